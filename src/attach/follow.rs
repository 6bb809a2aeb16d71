//! The device `attach` serves: every request goes to the writer's NBD
//! export, over one connection, and one that has no answer when that
//! connection ends is sent again, in the order it was first sent, to the
//! writer that comes next (design C3).
//!
//! One task, the driver, owns the upstream connection and the requests
//! without an answer (by sequence number, which is also their NBD cookie).
//! It connects to the writer the watchers report, sends every unanswered
//! request again, then forwards new ones, and hands each answer back. It
//! drops the connection as soon as the watchers report another writer (a
//! newer term), without waiting for TCP to notice a frozen or vanished one.
//!
//! The driver itself never waits on a writer: the connect and handshake
//! run beside the watch (and are bounded, [`client::CONNECT_TIMEOUT`],
//! [`client::HANDSHAKE_TIMEOUT`]), and the bytes go out from a sender task
//! of the session, each request within [`SEND_TIMEOUT`]. A writer that
//! froze with the socket buffers full toward it holds up that task only;
//! the driver still sees the next writer at once, abandons the session
//! (sender, reader and socket), and sends every request without an answer
//! to the next writer, whether or not the old one got its bytes (C3).
//!
//! The size offered to new local connections follows the volume's: the
//! largest any watcher or writer handshake reported (a resize only grows
//! it); connections already open keep the size they were offered.
//!
//! Why sending again is safe:
//! - A request without an answer has nothing the client sent after it
//!   depend on it: the client sends a dependent write only after the
//!   answer. So only the order among unanswered requests matters, and it
//!   is kept.
//! - To another writer (a newer term): that writer fenced the replicas
//!   before it opened its gate, and a fence drains every write of an older
//!   term (S1, S3), so nothing the old connection sent can land after what
//!   is sent again.
//! - To the same writer at the same term (the connection broke, the writer
//!   did not change): what the old connection sent may still be running
//!   there, so the driver waits [`SAME_WRITER_GRACE`] (the server's own
//!   grace for requests in flight) before it sends again, or less if the
//!   writer changes meanwhile. A write stuck in the writer for longer than
//!   that could still land after the replay; see the design's caveats.
//!
//! An error the writer answers (`EIO` after its own suspend timeout,
//! `EINVAL`) is the answer, passed on as it is. While no writer can be
//! reached, requests wait up to the suspend timeout, then fail with `EIO`.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::io::AsyncReadExt;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use super::watch::{Seen, Writer};
use crate::ids::Term;
use crate::nbd::client::{self, ClientError, ClientTls, Connection, Io};
use crate::nbd::wire::{self, Command, Request};
use crate::net::{Expect, Tls};
use crate::volume::{Access, Device, DeviceError, MAX_REQUEST};

/// How long the driver waits before it sends requests again to the writer
/// whose connection broke, at the same term.
pub const SAME_WRITER_GRACE: Duration = crate::nbd::CLOSE_GRACE;
/// How soon a failed connection attempt is made again.
const RECONNECT: Duration = Duration::from_millis(50);
/// How often requests waiting for a writer are checked against the
/// suspend timeout.
const EXPIRY_TICK: Duration = Duration::from_millis(100);
/// How long one request may take to go out to the writer (its header,
/// its payload, the flush). A writer change is seen at once whatever the
/// sends do; this is the last resort for a writer that stops taking bytes
/// while no other one appears. A live writer stops reading only while it
/// runs as much as it may at once (256 requests, 32 MiB) and those are
/// held (C2); 30 s outlasts a hold that ends by a replica's return or
/// removal (its 1 s timeout, an election). Past it the session is given
/// up like a broken connection: the requests go again after
/// [`SAME_WRITER_GRACE`], or to the next writer.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// How the driver reaches writers.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// The export to open.
    pub export: String,
    /// The client certificate, for NBD over TLS; plaintext without.
    pub tls: Option<Arc<Tls>>,
    /// How long a request waits for a writer before it fails.
    pub suspend_timeout: Duration,
}

/// One request from a local client.
struct Job {
    command: Command,
    offset: u64,
    len: u32,
    flags: u16,
    payload: Option<Bytes>,
    queued: Instant,
    reply: oneshot::Sender<Result<Bytes, DeviceError>>,
}

/// The device; see the module docs.
pub struct Following {
    jobs: mpsc::UnboundedSender<Job>,
    /// The volume's size as last learnt; it only grows.
    size: Arc<AtomicU64>,
}

impl Following {
    /// Starts the driver on `tasks`, following `seen`, for a volume of at
    /// least `size` bytes (a larger size that `seen` or a writer reports
    /// replaces it).
    pub fn start(
        seen: watch::Receiver<Seen>,
        size: u64,
        upstream: Upstream,
        tasks: &mut JoinSet<()>,
    ) -> Self {
        let (jobs, queue) = mpsc::unbounded_channel();
        let size = Arc::new(AtomicU64::new(size));
        tasks.spawn(learn_size(seen.clone(), Arc::clone(&size)));
        let driver = Driver {
            jobs: queue,
            seen,
            upstream,
            size: Arc::clone(&size),
            pending: BTreeMap::new(),
            next: 1,
            disconnected_at: Some(Instant::now()),
        };
        // Every line the driver logs names its volume: one attach may
        // follow several.
        let span = tracing::info_span!("volume", name = %driver.upstream.export);
        tasks.spawn(tracing::Instrument::instrument(driver.run(), span));
        Self { jobs, size }
    }

    fn current_size(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    async fn submit(
        &self,
        command: Command,
        offset: u64,
        len: u32,
        flags: u16,
        payload: Option<Bytes>,
    ) -> Result<Bytes, DeviceError> {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            command,
            offset,
            len,
            flags,
            payload,
            queued: Instant::now(),
            reply,
        };
        self.jobs
            .send(job)
            .map_err(|_| DeviceError::Io("attach is stopping".into()))?;
        answer
            .await
            .map_err(|_| DeviceError::Io("attach stopped".into()))?
    }
}

#[async_trait]
impl Device for Following {
    async fn read_at(&self, offset: u64, len: u64) -> Result<Bytes, DeviceError> {
        crate::volume::check_request(offset, len, self.current_size())?;
        let len = u32::try_from(len.min(MAX_REQUEST)).unwrap_or(u32::MAX);
        self.submit(Command::Read, offset, len, 0, None).await
    }

    async fn write_at(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), DeviceError> {
        crate::volume::check_request(offset, data.len() as u64, self.current_size())?;
        let len = u32::try_from(data.len()).unwrap_or(u32::MAX);
        let flags = if fua { wire::CMD_FLAG_FUA } else { 0 };
        self.submit(Command::Write, offset, len, flags, Some(data))
            .await
            .map(|_| ())
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        // One NBD TRIM per u32's worth (a client's own TRIM always fits).
        let end = offset.saturating_add(len);
        let mut at = offset;
        while at < end {
            let n = (end - at).min(u64::from(u32::MAX / 4096 * 4096));
            self.submit(Command::Trim, at, n as u32, 0, None).await?;
            at += n;
        }
        Ok(())
    }

    async fn flush(&self) -> Result<(), DeviceError> {
        self.submit(Command::Flush, 0, 0, 0, None).await.map(|_| ())
    }

    /// `attach` replays what had no answer on its own (C3); a client's
    /// session here binds nothing on the writer, whose own session does.
    async fn change(
        &self,
        change: crate::volume::Change,
        _: &crate::volume::Bond,
    ) -> Result<(), DeviceError> {
        change.run_once(self).await
    }

    fn size(&self) -> u64 {
        self.current_size()
    }

    fn is_writable(&self) -> bool {
        true
    }

    /// Always writable, under one term of its own: a local client's
    /// session outlives every writer change.
    fn access(&self) -> Access {
        Access::ReadWrite { term: Term(1) }
    }
}

/// How a session with one writer, or an attempt to open one, ended.
enum Ended {
    /// The watchers report another writer.
    WriterChanged,
    /// The connection failed (or could not be opened).
    Lost(ClientError),
    /// `attach` is stopping and nothing waits.
    Stopped,
}

/// An answer read from the writer: `(cookie, error, read data)`.
type Answer = Result<(u64, u32, Bytes), ClientError>;

/// One request on its way to the writer, for the session's sender.
struct Outgoing {
    request: Request,
    payload: Option<Bytes>,
}

struct Driver {
    jobs: mpsc::UnboundedReceiver<Job>,
    seen: watch::Receiver<Seen>,
    upstream: Upstream,
    /// The size offered to new local connections.
    size: Arc<AtomicU64>,
    /// Requests without an answer, by sequence number (= cookie).
    pending: BTreeMap<u64, Job>,
    next: u64,
    /// Since when no writer has been connected.
    disconnected_at: Option<Instant>,
}

/// A connection the writer offered writable; a read-only export means the
/// node is not the writer (any more: its lease lapsed before the
/// handshake) or the certificate's role does not write. Either way, no
/// write or flush may be sent there: a read-only session answers a flush
/// without flushing anything.
fn writable(conn: Connection) -> Result<Connection, Ended> {
    if conn.export.flags & wire::TFLAG_READ_ONLY != 0 {
        return Err(Ended::Lost(ClientError::Refused {
            what: "a writable export",
            why: "the node offered it read-only: it is not the writer now, or this \
                  certificate's role does not write (attach needs user or admin)"
                .into(),
        }));
    }
    Ok(conn)
}

impl Driver {
    async fn run(mut self) {
        let mut broke: Option<(Writer, Instant)> = None;
        loop {
            let Some(writer) = self.next_writer(&broke).await else {
                return;
            };
            let conn = match self.open(&writer).await {
                Ok(conn) => conn,
                Err(Ended::Stopped) => return,
                Err(Ended::WriterChanged) => continue,
                Err(Ended::Lost(err)) => {
                    tracing::warn!(writer = %writer.node, addr = %writer.nbd, %err, "cannot open the writer's export");
                    if !self.idle(Instant::now() + RECONNECT).await {
                        return;
                    }
                    continue;
                }
            };
            tracing::info!(
                writer = %writer.node,
                term = %writer.term,
                resending = self.pending.len(),
                "following the writer"
            );
            self.disconnected_at = None;
            let ended = self.session(conn, &writer).await;
            self.disconnected_at = Some(Instant::now());
            match ended {
                Ended::Stopped => return,
                Ended::WriterChanged => broke = None,
                Ended::Lost(err) => {
                    tracing::info!(writer = %writer.node, %err, waiting = self.pending.len(), "lost the writer's connection");
                    broke = Some((writer, Instant::now()));
                }
            }
        }
    }

    /// The client TLS configuration for `writer`'s export: none only when
    /// `attach` runs without TLS. A configuration that cannot be built is
    /// an error, never a fall back to plaintext.
    fn tls(&self, writer: &Writer) -> Result<Option<ClientTls>, ClientError> {
        let Some(tls) = self.upstream.tls.as_ref() else {
            return Ok(None);
        };
        let config = tls
            .client(Expect::Node(writer.node))
            .map_err(|err| ClientError::Tls(err.to_string()))?;
        Ok(Some((config, crate::net::tls::server_name(&writer.nbd))))
    }

    /// After the watch changed (`changed`, its outcome): an end if the
    /// watchers are gone or report a writer other than `writer` (another
    /// node, or a newer term).
    fn watched(
        &mut self,
        changed: Result<(), watch::error::RecvError>,
        writer: &Writer,
    ) -> Result<(), Ended> {
        if changed.is_err() {
            return Err(Ended::Stopped);
        }
        let now = self.seen.borrow_and_update().writer.clone();
        if now.is_some_and(|w| w.node != writer.node || w.term > writer.term) {
            tracing::info!(from = %writer.node, term = %writer.term, waiting = self.pending.len(), "the writer changed");
            return Err(Ended::WriterChanged);
        }
        Ok(())
    }

    /// Takes `job` (what the local clients' channel gave) into the
    /// requests without an answer and returns its number; once the
    /// channel is closed, notes it in `closed`, or ends if nothing waits.
    fn took(&mut self, job: Option<Job>, closed: &mut bool) -> Result<Option<u64>, Ended> {
        match job {
            Some(job) => Ok(Some(self.queue(job))),
            None if self.pending.is_empty() => Err(Ended::Stopped),
            // Stopping: serve what waits, then end.
            None => {
                *closed = true;
                Ok(None)
            }
        }
    }

    /// Opens `writer`'s export (bounded by the client's deadlines), while
    /// taking new requests, failing those past the suspend timeout and
    /// watching for another writer, which abandons the attempt.
    async fn open(&mut self, writer: &Writer) -> Result<Connection, Ended> {
        let tls = self.tls(writer).map_err(Ended::Lost)?;
        let (addr, export) = (writer.nbd.clone(), self.upstream.export.clone());
        let connecting = client::connect(&addr, &export, tls);
        tokio::pin!(connecting);
        let mut closed = false;
        loop {
            self.expire();
            tokio::select! {
                conn = &mut connecting => return conn.map_err(Ended::Lost).and_then(writable),
                job = self.jobs.recv(), if !closed => {
                    self.took(job, &mut closed)?;
                }
                changed = self.seen.changed() => self.watched(changed, writer)?,
                () = tokio::time::sleep(EXPIRY_TICK) => {}
            }
        }
    }

    /// The writer to connect to next; `None` once `attach` stops with
    /// nothing waiting. Not the one whose connection just broke at the
    /// same term, until [`SAME_WRITER_GRACE`] has passed.
    async fn next_writer(&mut self, broke: &Option<(Writer, Instant)>) -> Option<Writer> {
        loop {
            let writer = self.seen.borrow_and_update().writer.clone();
            let now = Instant::now();
            let until = match (writer, broke) {
                (None, _) => now + EXPIRY_TICK,
                (Some(writer), Some((lost, at)))
                    if writer == *lost && *at + SAME_WRITER_GRACE > now =>
                {
                    *at + SAME_WRITER_GRACE
                }
                (Some(writer), _) => return Some(writer),
            };
            if !self.idle(until).await {
                return None;
            }
        }
    }

    /// Waits until `until` or a change of writer, taking new requests and
    /// failing those that waited longer than the suspend timeout; false
    /// once `attach` stops with nothing waiting.
    async fn idle(&mut self, until: Instant) -> bool {
        loop {
            self.expire();
            let tick = (Instant::now() + EXPIRY_TICK).min(until);
            tokio::select! {
                job = self.jobs.recv() => match job {
                    Some(job) => {
                        self.queue(job);
                    }
                    None if self.pending.is_empty() => return false,
                    None => tokio::time::sleep_until(tick).await,
                },
                changed = self.seen.changed() => {
                    if changed.is_err() {
                        return false;
                    }
                    return true;
                }
                () = tokio::time::sleep_until(tick) => {
                    if Instant::now() >= until {
                        return true;
                    }
                }
            }
        }
    }

    fn queue(&mut self, job: Job) -> u64 {
        let seq = self.next;
        self.next += 1;
        self.pending.insert(seq, job);
        seq
    }

    /// Fails the requests that have waited for a writer longer than the
    /// suspend timeout.
    fn expire(&mut self) {
        let Some(since) = self.disconnected_at else {
            return;
        };
        let now = Instant::now();
        let limit = self.upstream.suspend_timeout;
        let expired: Vec<u64> = self
            .pending
            .iter()
            .filter(|(_, job)| now.duration_since(job.queued.max(since)) >= limit)
            .map(|(seq, _)| *seq)
            .collect();
        if !expired.is_empty() {
            tracing::warn!(
                requests = expired.len(),
                "no writer within the suspend timeout; failing them"
            );
        }
        for seq in expired {
            if let Some(job) = self.pending.remove(&seq) {
                let _ = job.reply.send(Err(DeviceError::Io(format!(
                    "no writer could be reached within {limit:?}"
                ))));
            }
        }
    }

    /// Serves through one connection to `writer` until it ends: every
    /// request without an answer goes out first, in order, then the new
    /// ones. The bytes go out from a sender task, so nothing here waits
    /// on the writer; a change of writer ends the session at once.
    async fn session(&mut self, conn: Connection, writer: &Writer) -> Ended {
        let Connection {
            reader,
            writer: out,
            export,
        } = conn;
        self.size.fetch_max(export.size, Ordering::Relaxed);
        let reads: Arc<Mutex<HashMap<u64, u32>>> = Arc::default();
        let (outgoing, queued) = mpsc::unbounded_channel();
        let mut sending = AbortOnDrop(tokio::spawn(send_all(out, queued)));
        for (seq, job) in &self.pending {
            dispatch(&outgoing, &reads, *seq, job);
        }
        let (answers, mut answered) = mpsc::channel::<Answer>(64);
        let reading = tokio::spawn(read_answers(reader, Arc::clone(&reads), answers));
        let _stop_reading = AbortOnDrop(reading);
        let mut closed = false;
        loop {
            tokio::select! {
                answer = answered.recv() => match answer {
                    Some(Ok((cookie, error, data))) => {
                        let Some(job) = self.pending.remove(&cookie) else {
                            return Ended::Lost(ClientError::Protocol(wire::WireError::Malformed {
                                what: "answer to no request",
                            }));
                        };
                        let outcome = match error {
                            0 => Ok(data),
                            errno => Err(DeviceError::Remote { errno }),
                        };
                        let _ = job.reply.send(outcome);
                        if closed && self.pending.is_empty() {
                            return Ended::Stopped;
                        }
                    }
                    Some(Err(err)) => return Ended::Lost(err),
                    None => return Ended::Lost(ClientError::Io(std::io::ErrorKind::UnexpectedEof.into())),
                },
                sent = &mut sending.0 => {
                    return Ended::Lost(match sent {
                        Ok(Err(err)) => err,
                        Ok(Ok(())) => ClientError::Io(std::io::ErrorKind::BrokenPipe.into()),
                        Err(join) => ClientError::Io(std::io::Error::other(join.to_string())),
                    });
                }
                job = self.jobs.recv(), if !closed => match self.took(job, &mut closed) {
                    Ok(Some(seq)) => {
                        if let Some(job) = self.pending.get(&seq) {
                            dispatch(&outgoing, &reads, seq, job);
                        }
                    }
                    Ok(None) => {}
                    Err(ended) => return ended,
                },
                changed = self.seen.changed() => {
                    if let Err(ended) = self.watched(changed, writer) {
                        return ended;
                    }
                }
            }
        }
    }
}

/// Learns the volume's size from what the watchers see; it only grows.
async fn learn_size(mut seen: watch::Receiver<Seen>, size: Arc<AtomicU64>) {
    loop {
        if let Some(now) = seen.borrow_and_update().size {
            size.fetch_max(now, Ordering::Relaxed);
        }
        if seen.changed().await.is_err() {
            return;
        }
    }
}

/// Hands request `seq` of `job` to the session's sender; a read's length
/// is noted first, for its answer.
fn dispatch(
    outgoing: &mpsc::UnboundedSender<Outgoing>,
    reads: &Mutex<HashMap<u64, u32>>,
    seq: u64,
    job: &Job,
) {
    if job.command == Command::Read {
        reads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(seq, job.len);
    }
    let request = Request {
        flags: job.flags,
        command: job.command,
        cookie: seq,
        offset: job.offset,
        len: job.len,
    };
    // The sender ends only with the session, which then sees why.
    let _ = outgoing.send(Outgoing {
        request,
        payload: job.payload.clone(),
    });
}

/// The session's sender: writes each request in order, each within
/// [`SEND_TIMEOUT`], flushing whenever nothing more is queued.
async fn send_all(
    mut out: tokio::io::WriteHalf<Box<dyn Io>>,
    mut queued: mpsc::UnboundedReceiver<Outgoing>,
) -> Result<(), ClientError> {
    use tokio::io::AsyncWriteExt;
    while let Some(next) = queued.recv().await {
        let sending = async {
            client::send(&mut out, &next.request, next.payload.as_ref()).await?;
            if queued.is_empty() {
                out.flush().await?;
            }
            Ok::<(), ClientError>(())
        };
        client::within(SEND_TIMEOUT, "progress sending to the writer", sending).await??;
    }
    Ok(())
}

/// Reads answers until the connection fails; a read's data follows its
/// header when it succeeded.
async fn read_answers(
    mut reader: tokio::io::ReadHalf<Box<dyn Io>>,
    reads: Arc<Mutex<HashMap<u64, u32>>>,
    answers: mpsc::Sender<Answer>,
) {
    loop {
        let answer = async {
            let (error, cookie) = client::receive(&mut reader).await?;
            let len = reads
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&cookie);
            let data = match (error, len) {
                (0, Some(len)) => {
                    let mut data = vec![0u8; len as usize];
                    reader.read_exact(&mut data).await?;
                    Bytes::from(data)
                }
                _ => Bytes::new(),
            };
            Ok((cookie, error, data))
        }
        .await;
        let failed = answer.is_err();
        if answers.send(answer).await.is_err() || failed {
            return;
        }
    }
}

/// Aborts a task when dropped.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
