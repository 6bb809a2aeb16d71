//! Block-channel connections: the client's [`Link`] (many requests in
//! flight, replies matched by id) and the batching frame writer both ends
//! share ([`send_frames`]).
//!
//! A link is one connection to one peer's data listener, opened with the
//! [`PREFACE`] and a `Hello` frame that the peer must accept. Every
//! [`Link::call`] gets a fresh request id and waits for the reply with that
//! id, or for its deadline. A reply that comes after its caller gave up is
//! dropped. When the connection fails (the peer went away, or sent a frame
//! that does not decode, or a call timed out while nothing at all arrived)
//! every call in flight fails with [`LinkError::Closed`] and the link
//! stays closed; its owner makes a new one. Dropping a link stops its
//! tasks. A timeout is never taken for a success: the caller treats it as the
//! replica being unavailable for that request (S5), as with gRPC.
//!
//! **Batching.** Frames to send queue on a channel; the writer task takes
//! every frame queued at that moment (up to [`BATCH_BYTES`]) and writes
//! them with vectored writes, headers and payloads side by side. While
//! other requests are in flight it first yields once, so that frames about
//! to be queued join the batch; a lone request's frame goes at once. A
//! payload is the caller's `Bytes`, never copied here.

use std::collections::HashMap;
use std::io::IoSlice;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::AbortHandle;

use super::conn::Connector;
use super::frame::{ASIDE, Decoder, Frame, FrameError, Header, Kind, PREFACE, hello_payload};
use super::tls::{Expect, Tls};
use crate::ids::GroupId;

/// The most bytes one vectored write batch carries.
pub const BATCH_BYTES: usize = 4 * 1024 * 1024;

/// The most frames queued to send on one connection; a caller past it
/// waits.
const QUEUE: usize = 1024;

/// How much a reader asks the socket for at a time.
const READ_CHUNK: usize = 256 * 1024;

/// The alignment of a payload received apart (see [`ASIDE`]): the
/// largest logical block size of a common disk, what direct I/O needs.
pub const PAYLOAD_ALIGN: usize = 4096;

/// Why no next frame could be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The bytes received are no frame; nothing of it is handed on.
    #[error(transparent)]
    Malformed(#[from] FrameError),
    /// The connection failed.
    #[error("receiving: {0}")]
    Receiving(#[from] std::io::Error),
}

/// Reads whole frames off one side of a connection: small ones from a
/// shared buffer, each payload of at least [`ASIDE`] bytes into a buffer
/// of its own aligned to [`PAYLOAD_ALIGN`], read straight from the socket.
pub struct FrameReader<R> {
    reader: R,
    buf: BytesMut,
    decoder: Decoder,
}

impl<R: AsyncRead + Unpin> FrameReader<R> {
    /// A reader of `reader`, whose first bytes, if any were read already,
    /// are in `buf`.
    pub fn new(reader: R, buf: BytesMut) -> Self {
        Self {
            reader,
            buf,
            decoder: Decoder::default(),
        }
    }

    /// Limits the payloads taken from now on (see [`Decoder::limit`]).
    pub fn limit(&mut self, max: Option<u32>) {
        self.decoder.limit(max);
    }

    /// The reader and what it received past the last frame.
    pub fn into_parts(self) -> (R, BytesMut) {
        (self.reader, self.buf)
    }

    /// The next frame; `None` once the peer closed the connection (in the
    /// middle of a frame too: a partial frame is dropped, never handed on).
    /// Not cancel-safe: a frame being read when the future is dropped is
    /// lost, so a caller that stops waiting must stop reading too.
    pub async fn next(&mut self) -> Result<Option<Frame>, ReadError> {
        loop {
            if let Some(frame) = self.buffered()? {
                return Ok(Some(frame));
            }
            if let Some(len) = self.decoder.awaited().filter(|len| *len >= ASIDE) {
                let Some(payload) = self.read_aside(len).await? else {
                    return Ok(None);
                };
                return Ok(Some(self.decoder.complete(payload)?));
            }
            if self.buf.capacity() - self.buf.len() < READ_CHUNK / 16 {
                self.buf.reserve(READ_CHUNK);
            }
            if self.reader.read_buf(&mut self.buf).await? == 0 {
                return Ok(None);
            }
        }
    }

    /// The next frame if the bytes received already hold it whole, without
    /// waiting: a loop that must also watch for something else (a stop)
    /// needs to wait on both only when this is `None`.
    pub fn buffered(&mut self) -> Result<Option<Frame>, FrameError> {
        self.decoder.next(&mut self.buf)
    }

    /// Receives a payload of `len` bytes into a buffer of its own, aligned
    /// to [`PAYLOAD_ALIGN`]: what `buf` holds of it first, then the rest
    /// straight from the socket. `None` if the connection closed first.
    async fn read_aside(&mut self, len: usize) -> std::io::Result<Option<Bytes>> {
        // The capacity is never exceeded, so the vector never moves.
        let mut room: Vec<u8> = Vec::with_capacity(len + PAYLOAD_ALIGN);
        room.resize(room.as_ptr().align_offset(PAYLOAD_ALIGN), 0);
        let skip = room.len();
        let had = self.buf.len().min(len);
        room.extend_from_slice(&self.buf.split_to(had));
        while room.len() < skip + len {
            let want = skip + len - room.len();
            if self.reader.read_buf(&mut (&mut room).limit(want)).await? == 0 {
                return Ok(None);
            }
        }
        Ok(Some(Bytes::from_owner(room).slice(skip..)))
    }
}

/// Why a call on a link failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// No connection could be made, or the peer refused the `Hello`.
    #[error("cannot open a block channel to {addr}: {why}")]
    Connect { addr: String, why: String },
    /// The peer refused the `Hello` (another cluster, volume or group, not a
    /// member); the refusal says why.
    #[error("the block channel was refused: {}", String::from_utf8_lossy(&.0.payload))]
    Refused(Frame),
    /// The connection failed or closed; the request may or may not have
    /// been applied.
    #[error("block channel closed: {0}")]
    Closed(String),
    /// No reply within the deadline; the request may still be applied.
    #[error("no reply within {0:?}")]
    TimedOut(Duration),
}

/// The calls waiting for a reply, by request id; `None` once the link
/// failed, so no call can start waiting after the last ones were failed.
type Pending = Mutex<Option<HashMap<u64, oneshot::Sender<Frame>>>>;

/// What a link's caller, reader and writer share.
struct Shared {
    pending: Pending,
    /// Why the link failed, once it did.
    why: Mutex<Option<String>>,
    /// Turns true when the link fails; the reader stops then.
    closed: watch::Sender<bool>,
    /// When the link was opened, and when the last frame arrived (1 + ms
    /// after that; 0: never).
    born: Instant,
    heard: AtomicU64,
}

impl Shared {
    /// Fails the link: every call in flight fails, later ones at once.
    fn fail(&self, why: String) {
        lock(&self.why).get_or_insert(why);
        // Dropping the senders fails every call still waiting.
        lock(&self.pending).take();
        self.closed.send_replace(true);
    }

    /// How many calls are waiting for their reply.
    fn calls(&self) -> usize {
        lock(&self.pending).as_ref().map_or(0, HashMap::len)
    }

    fn why(&self) -> String {
        lock(&self.why).clone().unwrap_or_default()
    }

    fn now(&self) -> u64 {
        u64::try_from(self.born.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// One client connection; see the module docs.
pub struct Link {
    queue: mpsc::Sender<Frame>,
    shared: Arc<Shared>,
    next_id: AtomicU64,
    /// The reader and writer tasks, stopped when the link is dropped.
    tasks: [AbortHandle; 2],
    /// The server's store session (see [`Link::session`]).
    session: Option<u64>,
}

impl Drop for Link {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

impl Link {
    /// Opens a link to `addr` (with `tls`, which must reach `expect`) for
    /// `cluster_id`'s `volume` of Raft group `group`; gives up after
    /// `timeout`.
    pub async fn connect(
        addr: &str,
        tls: Option<(Arc<Tls>, Expect)>,
        cluster_id: &str,
        volume: &str,
        group: GroupId,
        timeout: Duration,
    ) -> Result<Link, LinkError> {
        let failed = |why: String| LinkError::Connect {
            addr: addr.to_string(),
            why,
        };
        let opened = tokio::time::timeout(timeout, async {
            let mut stream = Connector::new(addr, tls)
                .dial()
                .await
                .map_err(|e| failed(e.to_string()))?;
            let hello = Frame::new(
                Header::new(Kind::Hello, 0),
                hello_payload(cluster_id, volume, group),
            );
            let mut opening = PREFACE.to_vec();
            opening.extend_from_slice(&hello.header.encode());
            opening.extend_from_slice(&hello.payload);
            stream
                .write_all(&opening)
                .await
                .map_err(|e| failed(e.to_string()))?;
            stream.flush().await.map_err(|e| failed(e.to_string()))?;
            let mut frames = FrameReader::new(stream, BytesMut::with_capacity(READ_CHUNK));
            let reply = frames
                .next()
                .await
                .map_err(|e| failed(e.to_string()))?
                .ok_or_else(|| failed("the peer closed the connection".to_string()))?;
            match reply.header.kind {
                Kind::Ok => Ok((frames.into_parts(), session_of(&reply.payload))),
                Kind::Refused => Err(LinkError::Refused(reply)),
                other => Err(failed(format!("unexpected {other:?} frame"))),
            }
        })
        .await
        .map_err(|_| failed(format!("no answer within {timeout:?}")))??;
        let ((stream, buf), session) = opened;
        let mut link = Self::start(stream, buf);
        link.session = session;
        Ok(link)
    }

    /// The session of the store at the other end, as its `Hello` reply
    /// named it (`None` from a server that names none).
    pub fn session(&self) -> Option<u64> {
        self.session
    }

    /// Runs the link's reader and writer tasks over `stream`, whose reader
    /// has `buf` already.
    fn start<S>(stream: S, buf: BytesMut) -> Link
    where
        S: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (reader, writer) = tokio::io::split(stream);
        let (queue, frames) = mpsc::channel(QUEUE);
        let shared = Arc::new(Shared {
            pending: Mutex::new(Some(HashMap::new())),
            why: Mutex::new(None),
            closed: watch::channel(false).0,
            born: Instant::now(),
            heard: AtomicU64::new(0),
        });
        let writing = tokio::spawn({
            let shared = Arc::clone(&shared);
            async move {
                let outcome = send_frames(writer, frames, || shared.calls() > 1).await;
                shared.fail(match outcome {
                    Ok(()) => "the link was dropped".to_string(),
                    Err(err) => format!("sending: {err}"),
                });
            }
        });
        let reading = tokio::spawn(receive_replies(reader, buf, Arc::clone(&shared)));
        Link {
            queue,
            shared,
            next_id: AtomicU64::new(1),
            tasks: [writing.abort_handle(), reading.abort_handle()],
            session: None,
        }
    }

    /// Whether the connection has failed; a failed link never recovers.
    pub fn is_closed(&self) -> bool {
        *self.shared.closed.borrow() || self.queue.is_closed()
    }

    /// Sends a request of `header` (its id is set here) and `payload`, and
    /// waits up to `timeout` for its reply. A call that times out while
    /// nothing at all arrived on the link since it began fails the link:
    /// the peer or the path to it is gone (a half-open connection would
    /// otherwise hold every later call until TCP gives up, minutes later).
    pub async fn call(
        &self,
        mut header: Header,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Frame, LinkError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        header.id = id;
        let (tx, rx) = oneshot::channel();
        match lock(&self.shared.pending).as_mut() {
            Some(pending) => pending.insert(id, tx),
            None => return Err(LinkError::Closed(self.shared.why())),
        };
        let forget = Forget {
            shared: &self.shared,
            id,
        };
        let began = self.shared.now();
        let outcome = tokio::time::timeout(timeout, async {
            self.queue
                .send(Frame::new(header, payload))
                .await
                .map_err(|_| LinkError::Closed(self.shared.why()))?;
            rx.await.map_err(|_| LinkError::Closed(self.shared.why()))
        })
        .await;
        drop(forget);
        match outcome {
            Ok(outcome) => outcome,
            Err(_) => {
                if self.shared.heard.load(Ordering::SeqCst) <= began {
                    self.shared.fail(format!(
                        "nothing received for {timeout:?} with a request in flight"
                    ));
                }
                Err(LinkError::TimedOut(timeout))
            }
        }
    }
}

/// The store session a `Hello` reply's payload names: exactly 8 bytes,
/// big-endian, not 0.
fn session_of(payload: &[u8]) -> Option<u64> {
    let bytes: [u8; 8] = payload.try_into().ok()?;
    Some(u64::from_be_bytes(bytes)).filter(|session| *session != 0)
}

/// Removes a call's pending entry when the call ends, however it ends.
struct Forget<'a> {
    shared: &'a Shared,
    id: u64,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        if let Some(pending) = lock(&self.shared.pending).as_mut() {
            pending.remove(&self.id);
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reads replies and hands each to its caller; on any failure, or when the
/// link fails elsewhere, fails the link.
async fn receive_replies<R: AsyncRead + Unpin>(reader: R, buf: BytesMut, shared: Arc<Shared>) {
    let mut closed = shared.closed.subscribe();
    let why = tokio::select! {
        why = read_replies(reader, buf, &shared) => why,
        _ = closed.wait_for(|closed| *closed) => return,
    };
    shared.fail(why);
}

/// Reads replies until the connection fails; why it did.
async fn read_replies<R: AsyncRead + Unpin>(reader: R, buf: BytesMut, shared: &Shared) -> String {
    let mut frames = FrameReader::new(reader, buf);
    loop {
        match frames.next().await {
            Ok(Some(frame)) if frame.header.kind.is_reply() => {
                shared.heard.store(shared.now() + 1, Ordering::SeqCst);
                let caller = lock(&shared.pending)
                    .as_mut()
                    .and_then(|pending| pending.remove(&frame.header.id));
                if let Some(caller) = caller {
                    let _ = caller.send(frame);
                }
            }
            Ok(Some(frame)) => return format!("the peer sent a {:?} frame", frame.header.kind),
            Ok(None) => return "the peer closed the connection".to_string(),
            Err(err) => return err.to_string(),
        }
    }
}

/// Writes every frame that arrives on `frames` to `writer`, batching those
/// queued together into vectored writes; ends when `frames` closes
/// (cleanly) or a write fails. `busy` says whether requests other than the
/// one a frame belongs to are in flight, so more frames are likely to come
/// at once.
pub async fn send_frames<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut frames: mpsc::Receiver<Frame>,
    busy: impl Fn() -> bool,
) -> std::io::Result<()> {
    let mut batch: Vec<Bytes> = Vec::new();
    while let Some(first) = frames.recv().await {
        // While other requests are in flight, let the tasks about to queue
        // a frame do so first: one write then carries many frames (a
        // loopback send costs about as much as a frame's whole handling).
        // A lone request is sent at once; the yield would add to its
        // latency.
        if busy() {
            tokio::task::yield_now().await;
        }
        batch.clear();
        let mut bytes = 0;
        let mut next = Some(first);
        while let Some(frame) = next.take() {
            bytes += super::frame::HEADER_LEN + frame.payload.len();
            batch.push(Bytes::copy_from_slice(&frame.header.encode()));
            if !frame.payload.is_empty() {
                batch.push(frame.payload);
            }
            if bytes < BATCH_BYTES {
                next = frames.try_recv().ok();
            }
        }
        write_all_vectored(&mut writer, &mut batch).await?;
        writer.flush().await?;
    }
    writer.shutdown().await
}

/// Writes every byte of `chunks`, as few vectored writes as the socket
/// allows.
async fn write_all_vectored<W: AsyncWrite + Unpin>(
    writer: &mut W,
    chunks: &mut [Bytes],
) -> std::io::Result<()> {
    let mut first = 0;
    while first < chunks.len() {
        let slices: Vec<IoSlice<'_>> = chunks[first..]
            .iter()
            .take(64)
            .map(|chunk| IoSlice::new(chunk))
            .collect();
        let mut written = writer.write_vectored(&slices).await?;
        if written == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while written > 0 {
            let chunk = &mut chunks[first];
            if written >= chunk.len() {
                written -= chunk.len();
                first += 1;
            } else {
                bytes::Buf::advance(chunk, written);
                written = 0;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn frame_of(id: u64, len: usize) -> Frame {
        let mut header = Header::new(Kind::Write, id);
        header.stamp = crate::ids::Stamp::from(crate::ids::Term(3));
        header.offset = 1 << 20;
        let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8 ^ id as u8).collect();
        Frame::new(header, Bytes::from(payload))
    }

    fn wire_of(frames: &[Frame]) -> Vec<u8> {
        let mut wire = Vec::new();
        for frame in frames {
            wire.extend_from_slice(&frame.header.encode());
            wire.extend_from_slice(&frame.payload);
        }
        wire
    }

    /// Small and large frames read back as sent however the bytes arrive;
    /// each large payload lands in memory aligned for direct I/O.
    #[tokio::test]
    async fn small_and_large_frames_read_back_whole_and_large_ones_aligned() {
        let sizes = [0, 100, ASIDE - 1, ASIDE, 7, ASIDE + 12_345, 3 * ASIDE, 1];
        let frames: Vec<Frame> = sizes
            .iter()
            .enumerate()
            .map(|(id, len)| frame_of(id as u64, *len))
            .collect();
        let wire = wire_of(&frames);
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let sending = tokio::spawn(async move {
            // Pieces that end anywhere: in headers, in payloads.
            for piece in wire.chunks(7_919) {
                client.write_all(piece).await.unwrap();
            }
        });
        let mut reader = FrameReader::new(server, BytesMut::new());
        for sent in &frames {
            let got = reader.next().await.unwrap().expect("a frame");
            assert!(got == *sent, "frame {} differs", sent.header.id);
            if got.payload.len() >= ASIDE {
                assert_eq!(got.payload.as_ptr().align_offset(PAYLOAD_ALIGN), 0);
            }
        }
        sending.await.unwrap();
        assert!(reader.next().await.unwrap().is_none(), "closed");
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        /// A large frame cut short or with any bit flipped is never handed
        /// out, whichever way its payload is received.
        #[test]
        fn a_large_frame_cut_or_corrupted_is_never_handed_out(
            extra in 0usize..5000,
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
            bit in 0u8..8,
        ) {
            let frame = frame_of(9, ASIDE + extra);
            let wire = wire_of(std::slice::from_ref(&frame));
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let cut = cut.index(wire.len());
            let got = runtime.block_on(FrameReader::new(&wire[..cut], BytesMut::new()).next());
            prop_assert!(matches!(got, Ok(None)), "cut at {}: {:?}", cut, got.map(|f| f.map(|f| f.header)));
            let mut bad = wire.clone();
            bad[flip.index(wire.len())] ^= 1 << bit;
            let got = runtime.block_on(FrameReader::new(&bad[..], BytesMut::new()).next());
            prop_assert!(!matches!(got, Ok(Some(_))), "a corrupted frame was handed out");
            let whole = runtime.block_on(FrameReader::new(&wire[..], BytesMut::new()).next());
            prop_assert!(matches!(whole, Ok(Some(ref f)) if *f == frame));
        }
    }

    /// A peer that takes requests and never answers (a half-open
    /// connection): the first call times out and fails the link, so the
    /// next one fails at once instead of waiting out its own timeout, and
    /// the owner opens a new link.
    #[tokio::test]
    async fn a_silent_peer_fails_the_link_after_one_timeout() {
        let (client, _server) = tokio::io::duplex(1 << 20);
        let link = Link::start(client, BytesMut::new());
        let timeout = Duration::from_millis(100);
        let first = link
            .call(
                Header::new(Kind::Write, 0),
                Bytes::from_static(b"x"),
                timeout,
            )
            .await;
        assert_eq!(first, Err(LinkError::TimedOut(timeout)));
        assert!(link.is_closed());
        // A call that would wait an hour for its reply ends at once: the
        // deadline only stops the test if it does not.
        let second = tokio::time::timeout(
            Duration::from_secs(30),
            link.call(
                Header::new(Kind::Write, 0),
                Bytes::from_static(b"y"),
                Duration::from_secs(3600),
            ),
        )
        .await
        .expect("a call on a failed link does not wait for its reply");
        assert!(
            matches!(second, Err(LinkError::Closed(ref why)) if why.contains("nothing received")),
            "{second:?}"
        );
    }

    /// Replies go to the call with their id, whatever their order.
    #[tokio::test]
    async fn replies_reach_their_callers_in_any_order() {
        let (client, server) = tokio::io::duplex(1 << 20);
        let link = Arc::new(Link::start(client, BytesMut::new()));
        let (mut server_read, mut server_write) = tokio::io::split(server);
        let echo = tokio::spawn(async move {
            let mut buf = BytesMut::new();
            let mut decoder = Decoder::default();
            let mut got = Vec::new();
            while got.len() < 3 {
                match decoder.next(&mut buf).unwrap() {
                    Some(frame) => got.push(frame),
                    None => {
                        server_read.read_buf(&mut buf).await.unwrap();
                    }
                }
            }
            for frame in got.into_iter().rev() {
                let reply = Frame::new(Header::new(Kind::Ok, frame.header.id), frame.payload);
                server_write
                    .write_all(&reply.header.encode())
                    .await
                    .unwrap();
                server_write.write_all(&reply.payload).await.unwrap();
            }
            server_write
        });
        let calls: Vec<_> = [b"a", b"b", b"c"]
            .into_iter()
            .map(|payload| {
                let link = Arc::clone(&link);
                tokio::spawn(async move {
                    let reply = link
                        .call(
                            Header::new(Kind::Write, 0),
                            Bytes::from_static(payload),
                            Duration::from_secs(5),
                        )
                        .await
                        .unwrap();
                    (payload, reply.payload)
                })
            })
            .collect();
        for call in calls {
            let (sent, answered) = call.await.unwrap();
            assert_eq!(&answered[..], &sent[..]);
        }
        drop(echo.await.unwrap());
    }

    /// A `Hello` reply names a session only as 8 bytes, not 0; an older
    /// server's empty reply names none.
    #[test]
    fn a_hello_reply_names_a_session_only_as_eight_nonzero_bytes() {
        assert_eq!(session_of(&7u64.to_be_bytes()), Some(7));
        assert_eq!(session_of(&u64::MAX.to_be_bytes()), Some(u64::MAX));
        assert_eq!(session_of(&[]), None);
        assert_eq!(session_of(&0u64.to_be_bytes()), None);
        assert_eq!(session_of(&[1; 7]), None);
        assert_eq!(session_of(&[1; 9]), None);
    }

    /// With other requests in flight (`busy`) or not, whether the writer
    /// yields first or not.
    #[tokio::test]
    async fn a_batch_arrives_whole_and_in_order() {
        for busy in [false, true] {
            let (client, mut server) = tokio::io::duplex(1024);
            let (tx, rx) = mpsc::channel(16);
            let frames: Vec<Frame> = (0..10u64)
                .map(|i| Frame::new(Header::new(Kind::Ok, i), Bytes::from(vec![i as u8; 1000])))
                .collect();
            for frame in &frames {
                tx.send(frame.clone()).await.unwrap();
            }
            drop(tx);
            let sending = tokio::spawn(send_frames(client, rx, move || busy));
            let mut buf = BytesMut::new();
            server.read_buf(&mut buf).await.unwrap();
            let mut got = Vec::new();
            let mut decoder = Decoder::default();
            while got.len() < frames.len() {
                match decoder.next(&mut buf).unwrap() {
                    Some(frame) => got.push(frame),
                    None => {
                        let read = server.read_buf(&mut buf).await.unwrap();
                        assert!(read > 0, "busy {busy}: the stream ended after {got:?}");
                    }
                }
            }
            assert_eq!(got, frames);
            sending.await.unwrap().unwrap();
        }
    }
}
