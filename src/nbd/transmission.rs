//! The transmission phase: requests in, simple replies out, many in flight.
//!
//! One loop reads request headers (and write payloads) in order and spawns
//! each request; one task writes the replies as they finish, in any order
//! (the client matches them by cookie). A byte budget bounds what one
//! connection may hold in flight: a request waits for budget before its
//! payload is read, so a fast client cannot make the server buffer without
//! limit.
//!
//! Every error goes back as an NBD error code; see [`errno`]. A write the
//! gate refuses (this node is not, or no longer, the active writer) gets
//! `ESHUTDOWN`, so a client knows to reconnect to the new writer — never a
//! silent success. A request header with a bad magic ends the connection
//! after the requests already in flight are answered: nothing after it can
//! be trusted, and nothing of it is executed.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::handshake::Session;
use super::wire::{self, Command, Request};
use super::{ConnectionError, Export, MAX_REQUEST_LEN};
use crate::volume::{Device, DeviceError, RangeError};

/// The bytes one connection may hold in flight (reads and writes).
const BUDGET_BYTES: u64 = 128 * 1024 * 1024;
/// The budget's unit: a request costs its length in units, at least one.
const BUDGET_UNIT: u64 = 4096;
/// What `WRITE_ZEROES` writes from, one chunk at a time.
static ZEROES: [u8; 1 << 20] = [0; 1 << 20];

/// A finished request, on its way to the client.
struct Reply {
    cookie: u64,
    /// 0 on success, else an NBD error code.
    error: u32,
    /// Read data (sent only on success).
    data: Option<Bytes>,
    /// Released once the reply is written.
    _budget: OwnedSemaphorePermit,
}

/// Serves requests until the client disconnects or sends garbage.
pub async fn run<R, W>(
    mut reader: R,
    writer: W,
    export: Arc<Export>,
    session: Session,
) -> Result<(), ConnectionError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (replies, queue) = mpsc::unbounded_channel();
    let writer = tokio::spawn(write_replies(writer, queue));
    let budget = Arc::new(Semaphore::new(units(BUDGET_BYTES) as usize));
    let outcome = read_requests(&mut reader, &export, session, &budget, &replies).await;
    // In-flight requests hold clones of `replies`; the writer ends after the
    // last of them has answered.
    drop(replies);
    let written = writer
        .await
        .map_err(|err| ConnectionError::Io(std::io::Error::other(err.to_string())))?;
    outcome?;
    written.map_err(ConnectionError::Io)
}

/// Reads requests and spawns them; returns on `DISC`, end of stream or a
/// request that cannot be parsed.
async fn read_requests<R: AsyncRead + Unpin>(
    reader: &mut R,
    export: &Arc<Export>,
    session: Session,
    budget: &Arc<Semaphore>,
    replies: &mpsc::UnboundedSender<Reply>,
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
            Err(error) => {
                let _ = replies.send(refusal(&request, error, permit));
                continue;
            }
        };
        let export = Arc::clone(export);
        let replies = replies.clone();
        tokio::spawn(async move {
            let result = match export.executing.acquire_many(units).await {
                Ok(_executing) => execute(export.device.as_ref(), session, &request, payload).await,
                Err(_) => Err(wire::EIO),
            };
            let (error, data) = match result {
                Ok(data) => (0, data),
                Err(error) => (error, None),
            };
            if error != 0 {
                tracing::debug!(?request, error, "NBD request failed");
            }
            let _ = replies.send(Reply {
                cookie: request.cookie,
                error,
                data,
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
    let mut buf = BytesMut::zeroed(len as usize);
    reader.read_exact(&mut buf).await?;
    Ok(Ok(buf.freeze()))
}

fn refusal(request: &Request, error: u32, budget: OwnedSemaphorePermit) -> Reply {
    tracing::debug!(?request, error, "NBD request refused");
    Reply {
        cookie: request.cookie,
        error,
        data: None,
        _budget: budget,
    }
}

/// A request's share of the budgets.
fn cost(request: &Request) -> u32 {
    let bytes = match request.command {
        Command::Read | Command::Write => u64::from(request.len).min(u64::from(MAX_REQUEST_LEN)),
        _ => 0,
    };
    units(bytes)
}

/// Budget units for `bytes` (at least one).
pub(super) fn units(bytes: u64) -> u32 {
    bytes.div_ceil(BUDGET_UNIT).max(1) as u32
}

/// Runs one request against the device.
async fn execute(
    device: &dyn Device,
    session: Session,
    request: &Request,
    payload: Bytes,
) -> Result<Option<Bytes>, u32> {
    if request.has_unknown_flags() {
        return Err(wire::EINVAL);
    }
    let (offset, len) = (request.offset, u64::from(request.len));
    if request.command.mutates() && !session.writable() {
        return Err(wire::EPERM);
    }
    match request.command {
        Command::Read => device
            .read_at(offset, len)
            .await
            .map(Some)
            .map_err(|e| errno(&e, false)),
        Command::Write => device
            .write_at(offset, payload, request.fua())
            .await
            .map(|()| None)
            .map_err(|e| errno(&e, true)),
        // A read-only connection wrote nothing, so it has nothing to flush.
        Command::Flush if !session.writable() => Ok(None),
        Command::Flush => device
            .flush()
            .await
            .map(|()| None)
            .map_err(|e| errno(&e, true)),
        Command::Trim => trim(device, offset, len).map(|()| None),
        Command::WriteZeroes => write_zeroes(device, offset, len, request.fua())
            .await
            .map(|()| None),
        Command::Disconnect | Command::Other(_) => Err(wire::EINVAL),
    }
}

/// `TRIM` is a hint that the range's contents are no longer needed. It is
/// accepted (range- and gate-checked) and changes nothing: reads of a
/// trimmed range may return anything, and returning the old data keeps every
/// replica identical without a replicated discard.
fn trim(device: &dyn Device, offset: u64, len: u64) -> Result<(), u32> {
    check_span(device, offset, len)?;
    if device.is_writable() {
        Ok(())
    } else {
        Err(wire::ESHUTDOWN)
    }
}

/// `WRITE_ZEROES` as ordinary replicated writes of zeroes, 1 MiB at a time.
async fn write_zeroes(device: &dyn Device, offset: u64, len: u64, fua: bool) -> Result<(), u32> {
    check_span(device, offset, len)?;
    let end = offset + len;
    let mut at = offset;
    while at < end {
        let n = (end - at).min(ZEROES.len() as u64);
        let chunk = Bytes::from_static(&ZEROES[..n as usize]);
        device
            .write_at(at, chunk, fua)
            .await
            .map_err(|e| errno(&e, true))?;
        at += n;
    }
    Ok(())
}

/// Trim and write-zeroes may span more than one request's worth of bytes;
/// they only have to fit the volume.
fn check_span(device: &dyn Device, offset: u64, len: u64) -> Result<(), u32> {
    match offset.checked_add(len) {
        Some(end) if end <= device.size() => Ok(()),
        _ => Err(wire::ENOSPC),
    }
}

/// The NBD error code for a device error. Refusals of the gate and of the
/// replicas' fence (this node is not the writer) are `ESHUTDOWN`: the
/// client should reconnect to the active writer. Out-of-range requests are
/// `ENOSPC` for writes and `EINVAL` for reads, as the protocol asks.
pub fn errno(err: &DeviceError, write: bool) -> u32 {
    match err {
        DeviceError::NotLeader
        | DeviceError::LeaseExpired
        | DeviceError::Inactive
        | DeviceError::StaleTerm { .. } => wire::ESHUTDOWN,
        DeviceError::Range(RangeError::OutOfRange { .. }) if write => wire::ENOSPC,
        DeviceError::Range(_) => wire::EINVAL,
        DeviceError::InsufficientReplicas { .. }
        | DeviceError::InSyncCommit(_)
        | DeviceError::NoReadableReplica(_)
        | DeviceError::Io(_) => wire::EIO,
    }
}

/// Writes replies as they come, flushing whenever the queue runs dry.
async fn write_replies<W: AsyncWrite + Unpin>(
    writer: W,
    mut queue: mpsc::UnboundedReceiver<Reply>,
) -> std::io::Result<()> {
    let mut writer = BufWriter::with_capacity(256 * 1024, writer);
    while let Some(reply) = queue.recv().await {
        writer
            .write_all(&wire::simple_reply(reply.error, reply.cookie))
            .await?;
        if let (0, Some(data)) = (reply.error, &reply.data) {
            writer.write_all(data).await?;
        }
        if queue.is_empty() {
            writer.flush().await?;
        }
    }
    writer.flush().await?;
    writer.shutdown().await
}
