//! Block-channel connections: the client's [`Link`] (many requests in
//! flight, replies matched by id) and the batching frame writer both ends
//! share ([`send_frames`]).
//!
//! A link is one connection to one peer's data listener, opened with the
//! [`PREFACE`] and a `Hello` frame that the peer must accept. Every
//! [`Link::call`] gets a fresh request id and waits for the reply with that
//! id, or for its deadline. A reply that comes after its caller gave up is
//! dropped. When the connection fails (the peer went away, or sent a frame
//! that does not decode) every call in flight fails with
//! [`LinkError::Closed`] and the link stays closed; its owner makes a new
//! one. A timeout is never taken for a success: the caller treats it as the
//! replica being unavailable for that request (S5), as with gRPC.
//!
//! **Batching.** Frames to send queue on a channel; the writer task takes
//! every frame queued at that moment (up to [`BATCH_BYTES`]) and writes
//! them with vectored writes, headers and payloads side by side. A payload
//! is the caller's `Bytes`, never copied here.

use std::collections::HashMap;
use std::io::IoSlice;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};

use super::conn::{Connector, Stream};
use super::frame::{Decoder, Frame, Header, Kind, PREFACE, hello_payload};
use super::tls::{Expect, Tls};

/// The most bytes one vectored write batch carries.
pub const BATCH_BYTES: usize = 4 * 1024 * 1024;

/// The most frames queued to send on one connection; a caller past it
/// waits.
const QUEUE: usize = 1024;

/// How much a reader asks the socket for at a time.
const READ_CHUNK: usize = 256 * 1024;

/// Why a call on a link failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkError {
    /// No connection could be made, or the peer refused the `Hello`.
    #[error("cannot open a block channel to {addr}: {why}")]
    Connect { addr: String, why: String },
    /// The connection failed or closed; the request may or may not have
    /// been applied.
    #[error("block channel closed: {0}")]
    Closed(String),
    /// No reply within the deadline; the request may still be applied.
    #[error("no reply within {0:?}")]
    TimedOut(Duration),
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Frame>>>>;

/// One client connection; see the module docs.
pub struct Link {
    queue: mpsc::Sender<Frame>,
    pending: Pending,
    next_id: AtomicU64,
    closed: Arc<Closed>,
}

/// Whether a link has failed, and why.
#[derive(Default)]
struct Closed {
    flag: AtomicBool,
    why: Mutex<String>,
}

impl Closed {
    fn close(&self, why: String) {
        let mut held = self.why.lock().unwrap_or_else(|p| p.into_inner());
        if !self.flag.swap(true, Ordering::SeqCst) {
            *held = why;
        }
    }

    fn why(&self) -> String {
        self.why.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Link {
    /// Opens a link to `addr` (with `tls`, which must reach `expect`) for
    /// `cluster_id`'s `volume`; gives up after `timeout`.
    pub async fn connect(
        addr: &str,
        tls: Option<(Arc<Tls>, Expect)>,
        cluster_id: &str,
        volume: &str,
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
                .map_err(|e| e.to_string())?;
            stream.write_all(PREFACE).await.map_err(|e| e.to_string())?;
            let hello = Frame::new(
                Header::new(Kind::Hello, 0),
                hello_payload(cluster_id, volume),
            );
            stream
                .write_all(&hello.header.encode())
                .await
                .map_err(|e| e.to_string())?;
            stream
                .write_all(&hello.payload)
                .await
                .map_err(|e| e.to_string())?;
            stream.flush().await.map_err(|e| e.to_string())?;
            let mut buf = BytesMut::with_capacity(READ_CHUNK);
            let mut decoder = Decoder::default();
            let reply = loop {
                if let Some(frame) = decoder.next(&mut buf).map_err(|e| e.to_string())? {
                    break frame;
                }
                if stream.read_buf(&mut buf).await.map_err(|e| e.to_string())? == 0 {
                    return Err("the peer closed the connection".to_string());
                }
            };
            match reply.header.kind {
                Kind::Ok => Ok((stream, buf)),
                Kind::Refused => Err(String::from_utf8_lossy(&reply.payload).into_owned()),
                other => Err(format!("unexpected {other:?} frame")),
            }
        })
        .await
        .map_err(|_| failed(format!("no answer within {timeout:?}")))?
        .map_err(failed)?;
        let (stream, buf) = opened;
        Ok(Self::start(stream, buf))
    }

    /// Runs the link's reader and writer tasks over `stream`, whose reader
    /// has `buf` already.
    fn start(stream: Stream, buf: BytesMut) -> Link {
        let (reader, writer) = tokio::io::split(stream);
        let (queue, frames) = mpsc::channel(QUEUE);
        let pending = Pending::default();
        let closed = Arc::new(Closed::default());
        tokio::spawn({
            let closed = Arc::clone(&closed);
            async move {
                if let Err(err) = send_frames(writer, frames).await {
                    closed.close(format!("sending: {err}"));
                }
            }
        });
        tokio::spawn(receive_replies(
            reader,
            buf,
            Arc::clone(&pending),
            Arc::clone(&closed),
        ));
        Link {
            queue,
            pending,
            next_id: AtomicU64::new(1),
            closed,
        }
    }

    /// Whether the connection has failed; a failed link never recovers.
    pub fn is_closed(&self) -> bool {
        self.closed.flag.load(Ordering::SeqCst) || self.queue.is_closed()
    }

    /// Sends a request of `header` (its id is set here) and `payload`, and
    /// waits up to `timeout` for its reply.
    pub async fn call(
        &self,
        mut header: Header,
        payload: Bytes,
        timeout: Duration,
    ) -> Result<Frame, LinkError> {
        if self.is_closed() {
            return Err(LinkError::Closed(self.closed.why()));
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        header.id = id;
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        let forget = Forget {
            pending: &self.pending,
            id,
        };
        let outcome = tokio::time::timeout(timeout, async {
            self.queue
                .send(Frame::new(header, payload))
                .await
                .map_err(|_| LinkError::Closed(self.closed.why()))?;
            rx.await.map_err(|_| LinkError::Closed(self.closed.why()))
        })
        .await;
        drop(forget);
        outcome.map_err(|_| LinkError::TimedOut(timeout))?
    }
}

/// Removes a call's pending entry when the call ends, however it ends.
struct Forget<'a> {
    pending: &'a Pending,
    id: u64,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        lock(self.pending).remove(&self.id);
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Reads replies and hands each to its caller; on any failure, closes the
/// link and fails every call in flight.
async fn receive_replies<R: AsyncRead + Unpin>(
    mut reader: R,
    mut buf: BytesMut,
    pending: Pending,
    closed: Arc<Closed>,
) {
    let mut decoder = Decoder::default();
    let why = loop {
        match decoder.next(&mut buf) {
            Ok(Some(frame)) if frame.header.kind.is_reply() => {
                if let Some(caller) = lock(&pending).remove(&frame.header.id) {
                    let _ = caller.send(frame);
                }
                continue;
            }
            Ok(Some(frame)) => break format!("the peer sent a {:?} frame", frame.header.kind),
            Ok(None) => {}
            Err(err) => break err.to_string(),
        }
        if buf.capacity() - buf.len() < READ_CHUNK / 4 {
            buf.reserve(READ_CHUNK);
        }
        match reader.read_buf(&mut buf).await {
            Ok(0) => break "the peer closed the connection".to_string(),
            Ok(_) => {}
            Err(err) => break format!("receiving: {err}"),
        }
    };
    closed.close(why);
    // Dropping the senders fails every call still waiting.
    lock(&pending).clear();
}

/// Writes every frame that arrives on `frames` to `writer`, batching those
/// queued together into vectored writes; ends when `frames` closes
/// (cleanly) or a write fails.
pub async fn send_frames<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut frames: mpsc::Receiver<Frame>,
) -> std::io::Result<()> {
    let mut batch: Vec<Bytes> = Vec::new();
    while let Some(first) = frames.recv().await {
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

    #[tokio::test]
    async fn a_batch_arrives_whole_and_in_order() {
        let (client, mut server) = tokio::io::duplex(1024);
        let (tx, rx) = mpsc::channel(16);
        let frames: Vec<Frame> = (0..10u64)
            .map(|i| Frame::new(Header::new(Kind::Ok, i), Bytes::from(vec![i as u8; 1000])))
            .collect();
        for frame in &frames {
            tx.send(frame.clone()).await.unwrap();
        }
        drop(tx);
        let sending = tokio::spawn(send_frames(client, rx));
        let mut buf = BytesMut::new();
        server.read_buf(&mut buf).await.unwrap();
        let mut got = Vec::new();
        let mut decoder = Decoder::default();
        while got.len() < frames.len() {
            match decoder.next(&mut buf).unwrap() {
                Some(frame) => got.push(frame),
                None => {
                    server.read_buf(&mut buf).await.unwrap();
                }
            }
        }
        assert_eq!(got, frames);
        sending.await.unwrap().unwrap();
    }
}
