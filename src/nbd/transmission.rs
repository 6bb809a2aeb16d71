//! The transmission phase: requests in, replies out, many in flight.
//!
//! Replies are simple, or, once the client negotiated structured replies,
//! chunks for reads and block status: a read of at least [`HOLES_FROM`]
//! bytes whose range holds holes on the serving copy answers them with
//! `OFFSET_HOLE` chunks and reads and sends only the data between them.
//!
//! One loop reads request headers (and write payloads) in order, from one
//! buffer, and spawns each request; one task writes the replies as they
//! finish, in any order (the client matches them by cookie), and flushes
//! them when none is queued; while spawned requests are still running it
//! first yields once, so the replies of those about to finish share the
//! send. A byte budget bounds what one connection may hold in flight: a
//! request waits for budget before its payload is read, so a fast client
//! cannot make the server buffer without limit.
//!
//! **A closed gate closes the session (design C1).** A writable session is
//! bound to the term the gate was open for at the handshake. It is served
//! only while the device still grants exactly that term (lease included):
//! each request checks it before it runs, and an idle session polls it
//! every [`GATE_POLL`]. Once the gate closed (lease lost, demotion, a newer
//! term), the session reads no more requests and answers nothing it had not
//! completed: a request that met the closed gate, read or write, gets **no
//! reply** — not `ESHUTDOWN`, which qemu and the kernel would hand straight
//! to the guest's filesystem, while both retry on a dropped connection. The
//! replies of requests that completed are still sent (requests in flight
//! get [`CLOSE_GRACE`] to complete), then, [`LINGER`] after the gate
//! closed, the connection closes, and the client retries the rest on the
//! new writer. A write left unanswered may or
//! may not have landed; sending it again is safe, because a write the gate
//! holds (C2) is bound to the session and its term ([`Bond`]): once the
//! session ends — its gate closed, the client hung up or sent `DISC` — it
//! is not sent again, so it cannot land after what the client sent since.
//!
//! **A client no longer admitted is closed the same way (S9).** A session
//! opened with a certificate polls its admission every [`GATE_POLL`]: once
//! the certificate's node left the membership, the session is closed as if
//! its gate had closed (requests it read in the poll's window still run).
//!
//! Every other error goes back as an NBD error code; see [`errno`]: range
//! errors, `EINVAL`, `EPERM` for writes on a read-only session, and `EIO`
//! for a read that a passive node refuses because its copy left the in-sync
//! set ([`crate::ha::ReadGate`]). A request header with a bad magic ends the
//! connection after the requests already in flight are answered: nothing
//! after it can be trusted, and nothing of it is executed.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, watch};
use tokio::time::Instant;

use super::handshake::Session;
use super::wire::{self, Command, Request};
use super::{Admission, Client, ConnectionError, Export, MAX_REQUEST_LEN};
use crate::volume::{Bond, Change, Device, DeviceError, RangeError};

/// The read buffer of a connection. A payload's bytes past what the buffer
/// holds already are read straight into the payload's own buffer while at
/// least this many remain.
const READ_BUFFER: usize = 64 * 1024;
/// The bytes one connection may hold in flight (reads and writes).
const BUDGET_BYTES: u64 = 128 * 1024 * 1024;
/// The budget's unit: a request costs its length in units, at least one.
const BUDGET_UNIT: u64 = 4096;
/// The shortest structured read that is answered with hole chunks where
/// the copy has holes: below it, asking where the holes are costs more
/// than sending the zeroes.
pub const HOLES_FROM: u64 = 64 * 1024;
/// What `WRITE_ZEROES` writes from, one chunk at a time.
static ZEROES: [u8; 1 << 20] = [0; 1 << 20];
/// How often an idle writable session checks that its gate still grants
/// its term (a lease runs out without any event).
pub const GATE_POLL: Duration = Duration::from_millis(20);
/// How long a session whose gate closed waits for its requests in flight
/// to complete before it closes without their replies.
pub const CLOSE_GRACE: Duration = Duration::from_secs(1);
/// How long a session whose gate closed stays connected, answering nothing
/// new, before it hangs up (unless the client hangs up first). A client
/// behind a load balancer reconnects the moment the connection drops, and
/// the balancer's health checks (every 100 ms in `cluster/haproxy.cfg`)
/// need that long to stop routing to this node and start routing to the
/// next writer; reconnecting sooner would land here again, fail, and cost
/// qemu a second of back-off.
pub const LINGER: Duration = Duration::from_millis(400);

/// Counts a spawned request as running until it is dropped: just before
/// its reply is queued, or when it ends without one.
struct Running(Arc<AtomicUsize>);

impl Running {
    fn start(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(count))
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Why a request got no data back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// An NBD error reply.
    Error(u32),
    /// No reply: the session's gate closed, and so does the connection.
    Closed,
}

impl Failure {
    fn of(err: &DeviceError, write: bool) -> Self {
        errno(err, write).map_or(Failure::Closed, Failure::Error)
    }
}

/// What a request that succeeded gives back.
#[derive(Debug)]
enum Answer {
    /// Nothing but success.
    Done,
    /// A read's data.
    Data(Bytes),
    /// A structured read's data and holes, in order: `(offset, data)`,
    /// where empty data stands for a hole of `hole` bytes.
    Pieces(Vec<Piece>),
    /// `base:allocation` descriptors: (length, state flags).
    Extents(Vec<(u32, u32)>),
}

/// One chunk of a structured read.
#[derive(Debug)]
enum Piece {
    /// Bytes read at this offset.
    Data(u64, Bytes),
    /// A hole: this many bytes at this offset read as zeroes.
    Hole(u64, u32),
}

/// A finished request, on its way to the client.
struct Reply {
    cookie: u64,
    /// 0 on success, else an NBD error code.
    error: u32,
    /// What it gives back (sent only on success).
    answer: Answer,
    /// Where a read began (a structured data chunk says so).
    offset: u64,
    /// Answered in structured reply chunks: a read or a block status
    /// query, when the client negotiated structured replies.
    chunked: bool,
    /// Released once the reply is written.
    _budget: OwnedSemaphorePermit,
}

/// Whether `request` is answered in chunks in `session`.
fn chunked(session: Session, request: &Request) -> bool {
    session.structured && matches!(request.command, Command::Read | Command::BlockStatus)
}

/// Serves `client`'s requests until it disconnects or sends garbage.
pub async fn run<R, W>(
    reader: R,
    writer: W,
    export: Arc<Export>,
    session: Session,
    client: Client,
    admission: Arc<Admission>,
) -> Result<(), ConnectionError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    // Request headers and small payloads come out of one buffer: a busy
    // client's requests then cost one receive for many, not two each.
    let mut reader = BufReader::with_capacity(READ_BUFFER, reader);
    let (replies, queue) = mpsc::unbounded_channel();
    // Turns true once the session's gate closed; see the module docs.
    let (closed, watched) = watch::channel(false);
    let closed = Arc::new(closed);
    // Requests spawned and not yet answered.
    let running = Arc::new(AtomicUsize::new(0));
    let writer = tokio::spawn(write_replies(writer, queue, watched, Arc::clone(&running)));
    let budget = Arc::new(Semaphore::new(units(BUDGET_BYTES) as usize));
    // Held requests stand only while the session does (C1; `Bond`).
    let ended = Arc::new(AtomicBool::new(false));
    let bond = {
        let (gate_closed, ended) = (closed.subscribe(), Arc::clone(&ended));
        Bond::session(session.term, move || {
            *gate_closed.borrow() || ended.load(Ordering::Acquire)
        })
    };
    let outcome = tokio::select! {
        outcome = read_requests(&mut reader, &export, session, &bond, &budget, (&replies, &running), &closed) => outcome,
        () = gate_closed(export.device.as_ref(), session, &closed) => {
            tracing::info!(
                term = ?session.term.map(|term| term.0),
                "the session's gate closed: closing the connection"
            );
            Ok(())
        }
        why = admission_lost(&admission, &client, &closed) => {
            tracing::info!(%why, "the client is no longer admitted: closing the connection");
            Ok(())
        }
    };
    // No more requests: a held one is not sent again (the client may
    // already be sending it elsewhere).
    ended.store(true, Ordering::Release);
    // In-flight requests hold clones of `replies`; the writer ends after the
    // last of them has answered (within the grace, once the gate closed).
    drop(replies);
    let written = writer
        .await
        .map_err(|err| ConnectionError::Io(std::io::Error::other(err.to_string())))?;
    if *closed.borrow() {
        // Read what the client still sends until it sees the end of the
        // replies and hangs up: closing with unread data would reset the
        // connection, and a reset can discard replies not yet read.
        let mut sink = tokio::io::sink();
        let drain = tokio::io::copy(&mut reader, &mut sink);
        let _ = tokio::time::timeout(CLOSE_GRACE, drain).await;
    }
    outcome?;
    written.map_err(ConnectionError::Io)
}

/// Resolves [`LINGER`] after a writable session's gate no longer grants
/// its term, and marks the session closed at once; never for a read-only
/// session.
async fn gate_closed(device: &dyn Device, session: Session, closed: &watch::Sender<bool>) {
    if session.term.is_none() {
        return std::future::pending().await;
    }
    let mut watched = closed.subscribe();
    while session.open(device) {
        tokio::select! {
            () = tokio::time::sleep(GATE_POLL) => {}
            _ = watched.wait_for(|closed| *closed) => break,
        }
    }
    closed.send_replace(true);
    tokio::time::sleep(LINGER).await;
}

/// Resolves [`LINGER`] after `client`'s certificate is no longer admitted
/// by the listener (a node removed from the membership), with the reason,
/// and marks the session closed at once, as a closed gate does; never for
/// a client whose admission cannot change (one without a certificate), nor
/// once the session closed for another reason.
async fn admission_lost(
    admission: &Admission,
    client: &Client,
    closed: &watch::Sender<bool>,
) -> String {
    if !matches!(client, Client::Certified(_)) {
        return std::future::pending().await;
    }
    let mut watched = closed.subscribe();
    let why = loop {
        let ended = tokio::select! {
            () = tokio::time::sleep(GATE_POLL) => false,
            _ = watched.wait_for(|closed| *closed) => true,
        };
        if ended {
            return std::future::pending().await;
        }
        if let Err(why) = admission.grant(client) {
            break why;
        }
    };
    closed.send_replace(true);
    tokio::time::sleep(LINGER).await;
    why
}

/// Reads requests and spawns them; returns on `DISC`, end of stream or a
/// request that cannot be parsed.
async fn read_requests<R: AsyncRead + Unpin>(
    reader: &mut R,
    export: &Arc<Export>,
    session: Session,
    bond: &Bond,
    budget: &Arc<Semaphore>,
    (replies, running): (&mpsc::UnboundedSender<Reply>, &Arc<AtomicUsize>),
    closed: &Arc<watch::Sender<bool>>,
) -> Result<(), ConnectionError> {
    loop {
        let mut header = [0u8; wire::REQUEST_LEN];
        match reader.read_exact(&mut header).await {
            Ok(_) => {}
            // A client that closes without NBD_CMD_DISC: nothing is lost,
            // every request it sent is still answered or abandoned by it.
            Err(err) if err.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(err) => return Err(err.into()),
        }
        let request = wire::parse_request(&header)?;
        if request.command == Command::Disconnect {
            return Ok(());
        }
        let units = cost(&request);
        let permit = Arc::clone(budget)
            .acquire_many_owned(units)
            .await
            .map_err(|_| ConnectionError::Io(std::io::Error::other("budget closed")))?;
        let payload = match read_payload(reader, &request).await? {
            Ok(payload) => payload,
            Err(_) if !session.open(export.device.as_ref()) => {
                closed.send_replace(true);
                return Ok(());
            }
            Err(error) => {
                let _ = replies.send(refusal(session, &request, error, permit));
                continue;
            }
        };
        let export = Arc::clone(export);
        let (replies, closed, bond) = (replies.clone(), Arc::clone(closed), bond.clone());
        let running = Running::start(running);
        tokio::spawn(async move {
            let device = export.device.as_ref();
            let result = match export.executing.acquire_many(units).await {
                Ok(_executing) => execute(device, session, &bond, &request, payload).await,
                Err(_) => Err(Failure::Error(wire::EIO)),
            };
            let (error, answer) = match result {
                // What completed is answered, even after the gate closed.
                Ok(answer) => (0, answer),
                Err(Failure::Error(error)) if session.open(device) => (error, Answer::Done),
                // A request that met the closed gate, or failed once it had
                // closed, gets no answer: the client retries it on the new
                // writer after the connection closes.
                Err(_) => {
                    tracing::debug!(?request, "NBD request met a closed gate: no reply");
                    closed.send_replace(true);
                    return;
                }
            };
            if error != 0 {
                tracing::debug!(?request, error, "NBD request failed");
            }
            drop(running);
            let _ = replies.send(Reply {
                cookie: request.cookie,
                error,
                answer,
                offset: request.offset,
                chunked: chunked(session, &request),
                _budget: permit,
            });
        });
    }
}

/// Reads a write's payload. An oversized one is read and discarded, and
/// the request is refused with `EINVAL`: the stream stays in step and
/// nothing is written.
async fn read_payload<R: AsyncRead + Unpin>(
    reader: &mut R,
    request: &Request,
) -> Result<Result<Bytes, u32>, ConnectionError> {
    let len = request.payload_len();
    if len == 0 {
        return Ok(Ok(Bytes::new()));
    }
    if len > MAX_REQUEST_LEN {
        let discarded =
            tokio::io::copy(&mut reader.take(u64::from(len)), &mut tokio::io::sink()).await?;
        if discarded < u64::from(len) {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
        return Ok(Err(wire::EINVAL));
    }
    // Read into spare capacity: zeroing a buffer first costs as much as
    // filling it.
    let len = len as usize;
    let mut buf = BytesMut::with_capacity(len);
    while buf.len() < len {
        let want = len - buf.len();
        if reader.read_buf(&mut (&mut buf).limit(want)).await? == 0 {
            return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
        }
    }
    Ok(Ok(buf.freeze()))
}

fn refusal(session: Session, request: &Request, error: u32, budget: OwnedSemaphorePermit) -> Reply {
    tracing::debug!(?request, error, "NBD request refused");
    Reply {
        cookie: request.cookie,
        error,
        answer: Answer::Done,
        offset: request.offset,
        chunked: chunked(session, request),
        _budget: budget,
    }
}

/// A request's share of the budgets.
fn cost(request: &Request) -> u32 {
    let bytes = match request.command {
        Command::Read | Command::Write => u64::from(request.len).min(u64::from(MAX_REQUEST_LEN)),
        // Its largest reply: a descriptor per run, at most MAX_RUNS.
        Command::BlockStatus => 8 * crate::volume::MAX_RUNS,
        _ => 0,
    };
    units(bytes)
}

/// Budget units for `bytes` (at least one).
pub(super) fn units(bytes: u64) -> u32 {
    bytes.div_ceil(BUDGET_UNIT).max(1) as u32
}

/// Runs one request against the device. A writable session whose gate no
/// longer grants its term runs nothing more, reads included.
async fn execute(
    device: &dyn Device,
    session: Session,
    bond: &Bond,
    request: &Request,
    payload: Bytes,
) -> Result<Answer, Failure> {
    if !session.open(device) {
        return Err(Failure::Closed);
    }
    if request.has_unknown_flags()
        || (request.fast_zero() && request.command != Command::WriteZeroes)
        || (request.flags & wire::CMD_FLAG_REQ_ONE != 0 && request.command != Command::BlockStatus)
    {
        return Err(Failure::Error(wire::EINVAL));
    }
    let (offset, len) = (request.offset, u64::from(request.len));
    if request.command.mutates() && !session.writable() {
        return Err(Failure::Error(wire::EPERM));
    }
    match request.command {
        Command::Read if session.structured && len >= HOLES_FROM => {
            read_around_holes(device, offset, len).await
        }
        Command::Read => device
            .read_at(offset, len)
            .await
            .map(Answer::Data)
            .map_err(|e| Failure::of(&e, false)),
        Command::Write => {
            let write = Change::Write {
                offset,
                data: payload,
                fua: request.fua(),
            };
            change(device, bond, write).await.map(|()| Answer::Done)
        }
        // A read-only connection wrote nothing, so it has nothing to flush.
        Command::Flush if !session.writable() => Ok(Answer::Done),
        Command::Flush => change(device, bond, Change::Flush)
            .await
            .map(|()| Answer::Done),
        Command::Trim => discard(device, bond, offset, len, request.fua())
            .await
            .map(|()| Answer::Done),
        // Zeroes may be a hole unless the client said NO_HOLE; written
        // zeroes are slow, so a client that wants them fast hears so.
        Command::WriteZeroes if request.fast_zero() && !request.may_punch() => {
            Err(Failure::Error(wire::ENOTSUP))
        }
        Command::WriteZeroes if request.may_punch() => {
            discard(device, bond, offset, len, request.fua())
                .await
                .map(|()| Answer::Done)
        }
        Command::WriteZeroes => write_zeroes(device, bond, offset, len, request.fua())
            .await
            .map(|()| Answer::Done),
        // Reads are served from a replica's page cache already; the hint
        // is checked and needs nothing more.
        Command::Cache => match offset.checked_add(len) {
            Some(end) if end <= device.size() => Ok(Answer::Done),
            _ => Err(Failure::Error(wire::EINVAL)),
        },
        Command::BlockStatus => block_status(device, session, request).await,
        Command::Disconnect | Command::Other(_) => Err(Failure::Error(wire::EINVAL)),
    }
}

/// A structured read of `[offset, offset + len)`: the holes of the
/// serving copy become hole chunks, and only the data between them is
/// read. A range without holes, or whose allocation cannot be learned, is
/// one read, as without structured replies.
async fn read_around_holes(device: &dyn Device, offset: u64, len: u64) -> Result<Answer, Failure> {
    let read = |at: u64, n: u64| async move {
        device
            .read_at(at, n)
            .await
            .map_err(|e| Failure::of(&e, false))
    };
    let runs = match device.allocation(offset, len).await {
        Ok(runs) if runs.iter().any(|run| run.hole && run.len > 0) => runs,
        _ => return read(offset, len).await.map(Answer::Data),
    };
    let mut pieces = Vec::new();
    let mut at = offset;
    let end = offset + len;
    for run in runs.iter().filter(|run| run.len > 0) {
        if at >= end {
            break;
        }
        let n = run.len.min(end - at);
        if run.hole {
            // At most the request's u32 length.
            pieces.push(Piece::Hole(at, n as u32));
        } else {
            pieces.push(Piece::Data(at, read(at, n).await?));
        }
        at += n;
    }
    if at < end {
        // Runs that stop short: the rest is read.
        pieces.push(Piece::Data(at, read(at, end - at).await?));
    }
    Ok(Answer::Pieces(pieces))
}

/// `BLOCK_STATUS` for `base:allocation` (the only context): where this
/// node's copy holds data, and where holes that read as zeroes. Needs the
/// context selected and a non-empty range within the volume; with
/// `REQ_ONE`, only the first extent.
async fn block_status(
    device: &dyn Device,
    session: Session,
    request: &Request,
) -> Result<Answer, Failure> {
    let (offset, len) = (request.offset, u64::from(request.len));
    let beyond = offset
        .checked_add(len)
        .is_none_or(|end| end > device.size());
    if session.allocation.is_none() || len == 0 || beyond {
        return Err(Failure::Error(wire::EINVAL));
    }
    let extents = device
        .allocation(offset, len)
        .await
        .map_err(|e| Failure::of(&e, false))?;
    // Never past the request: the runs are cut where they reach its end.
    let mut covered = 0u64;
    let mut descriptors: Vec<(u32, u32)> = Vec::new();
    for extent in extents.iter().filter(|extent| extent.len > 0) {
        if covered >= len {
            break;
        }
        let run = extent.len.min(len - covered);
        covered += run;
        let state = if extent.hole {
            wire::STATE_HOLE | wire::STATE_ZERO
        } else {
            0
        };
        // At most the request's u32 length.
        descriptors.push((run as u32, state));
    }
    if descriptors.is_empty() {
        return Err(Failure::Error(wire::EIO));
    }
    if request.flags & wire::CMD_FLAG_REQ_ONE != 0 {
        descriptors.truncate(1);
    }
    Ok(Answer::Extents(descriptors))
}

/// `TRIM`, and `WRITE_ZEROES` without `NO_HOLE`: the range is discarded on
/// every in-sync replica (punched out of its file, so the space is freed)
/// and reads back as zeroes. With FUA it is flushed before the answer.
/// A write, discard or flush of the session's `bond`.
async fn change(device: &dyn Device, bond: &Bond, change: Change) -> Result<(), Failure> {
    device
        .change(change, bond)
        .await
        .map_err(|e| Failure::of(&e, true))
}

async fn discard(
    device: &dyn Device,
    bond: &Bond,
    offset: u64,
    len: u64,
    fua: bool,
) -> Result<(), Failure> {
    check_span(device, offset, len)?;
    change(device, bond, Change::Discard { offset, len }).await?;
    if fua {
        change(device, bond, Change::Flush).await?;
    }
    Ok(())
}

/// `WRITE_ZEROES` as ordinary replicated writes of zeroes, 1 MiB at a time.
async fn write_zeroes(
    device: &dyn Device,
    bond: &Bond,
    offset: u64,
    len: u64,
    fua: bool,
) -> Result<(), Failure> {
    check_span(device, offset, len)?;
    let end = offset + len;
    let mut at = offset;
    while at < end {
        let n = (end - at).min(ZEROES.len() as u64);
        let data = Bytes::from_static(&ZEROES[..n as usize]);
        change(
            device,
            bond,
            Change::Write {
                offset: at,
                data,
                fua,
            },
        )
        .await?;
        at += n;
    }
    Ok(())
}

/// Trim and write-zeroes may span more than one request's worth of bytes;
/// they only have to fit the volume.
fn check_span(device: &dyn Device, offset: u64, len: u64) -> Result<(), Failure> {
    match offset.checked_add(len) {
        Some(end) if end <= device.size() => Ok(()),
        _ => Err(Failure::Error(wire::ENOSPC)),
    }
}

/// The NBD error code for a device error, or `None` for the refusals of the
/// gate and of the replicas' fence (this node is not, or no longer, the
/// writer): those are never answered; the connection closes instead (see
/// the module docs). Out-of-range requests are `ENOSPC` for writes and
/// `EINVAL` for reads, as the protocol asks; a read a passive node refuses
/// because its copy is out of sync is `EIO`.
pub fn errno(err: &DeviceError, write: bool) -> Option<u32> {
    Some(match err {
        DeviceError::NotLeader
        | DeviceError::LeaseExpired
        | DeviceError::Inactive
        | DeviceError::Abandoned
        | DeviceError::StaleTerm { .. } => return None,
        DeviceError::Range(RangeError::OutOfRange { .. }) if write => wire::ENOSPC,
        DeviceError::Range(_) => wire::EINVAL,
        DeviceError::InsufficientReplicas { .. }
        | DeviceError::InSyncCommit(_)
        | DeviceError::Rejoining(_)
        | DeviceError::NoReadableReplica(_)
        | DeviceError::NotInSync
        | DeviceError::Io(_) => wire::EIO,
        DeviceError::Remote { errno } => *errno,
    })
}

/// Writes replies as they come, flushing whenever the queue runs dry. Once
/// the session is `closed`, it writes only what arrives within
/// [`CLOSE_GRACE`], then ends.
async fn write_replies<W: AsyncWrite + Unpin>(
    writer: W,
    mut queue: mpsc::UnboundedReceiver<Reply>,
    mut closed: watch::Receiver<bool>,
    running: Arc<AtomicUsize>,
) -> std::io::Result<()> {
    let mut writer = BufWriter::with_capacity(256 * 1024, writer);
    let mut grace_ends: Option<Instant> = None;
    loop {
        let next = match grace_ends {
            Some(deadline) => match tokio::time::timeout_at(deadline, queue.recv()).await {
                Ok(next) => next,
                Err(_) => break,
            },
            None => tokio::select! {
                next = queue.recv() => next,
                _ = closed.wait_for(|closed| *closed) => {
                    grace_ends = Some(Instant::now() + CLOSE_GRACE);
                    continue;
                }
            },
        };
        let Some(reply) = next else { break };
        match (reply.chunked, reply.error, &reply.answer) {
            (true, 0, Answer::Data(data)) if data.is_empty() => {
                writer.write_all(&wire::none_chunk(reply.cookie)).await?;
            }
            (true, 0, Answer::Data(data)) => {
                let head = wire::data_chunk_head(reply.cookie, reply.offset, data.len(), true);
                writer.write_all(&head).await?;
                writer.write_all(data).await?;
            }
            (true, 0, Answer::Pieces(pieces)) => {
                for (i, piece) in pieces.iter().enumerate() {
                    let done = i + 1 == pieces.len();
                    match piece {
                        Piece::Data(offset, data) => {
                            let head =
                                wire::data_chunk_head(reply.cookie, *offset, data.len(), done);
                            writer.write_all(&head).await?;
                            writer.write_all(data).await?;
                        }
                        Piece::Hole(offset, len) => {
                            let chunk = wire::hole_chunk(reply.cookie, *offset, *len, done);
                            writer.write_all(&chunk).await?;
                        }
                    }
                }
            }
            (true, 0, Answer::Extents(extents)) => {
                let chunk =
                    wire::block_status_chunk(reply.cookie, wire::BASE_ALLOCATION_ID, extents);
                writer.write_all(&chunk).await?;
            }
            (true, error, _) => {
                // A failed one, or (never) a chunked one with nothing to say.
                let error = if error == 0 { wire::EIO } else { error };
                writer
                    .write_all(&wire::error_chunk(error, reply.cookie))
                    .await?;
            }
            (false, error, answer) => {
                writer
                    .write_all(&wire::simple_reply(error, reply.cookie))
                    .await?;
                if let (0, Answer::Data(data)) = (error, answer) {
                    writer.write_all(data).await?;
                }
            }
        }
        if queue.is_empty() && running.load(Ordering::Acquire) > 0 {
            // Other requests are about to answer: let them, and send their
            // replies in the same write.
            tokio::task::yield_now().await;
        }
        if queue.is_empty() {
            writer.flush().await?;
        }
    }
    writer.flush().await?;
    writer.shutdown().await
}
