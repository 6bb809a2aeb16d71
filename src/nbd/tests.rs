//! The NBD server against a byte-level client over an in-memory pipe: the
//! handshake's options and refusals, every command, many requests in
//! flight, and garbage at every stage (which must neither panic nor write).

use std::sync::Arc;
use std::time::Duration;

use bytes::BufMut;
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::task::JoinHandle;

use super::wire::*;
use super::{ConnectionError, Export, Exports, handle};
use crate::ha::fake::{MemoryCopy, MemoryEngine};
use crate::ha::{ReadGate, WriterEngine};
use crate::ids::Term;
use crate::volume::{Bond, Change, DeviceError};

const SIZE: usize = 1 << 20;
const DEADLINE: Duration = Duration::from_secs(10);

/// A server over a memory volume, writable when `term` is given.
fn server(term: Option<Term>) -> (Arc<MemoryEngine>, Client) {
    let engine = MemoryEngine::new(SIZE);
    if let Some(term) = term {
        futures::executor::block_on(engine.activate(term)).unwrap();
    }
    let export = Arc::new(Export::new("vol0", "test volume", engine.clone()));
    let (client, server) = tokio::io::duplex(4 << 20);
    let task = tokio::spawn(handle(server, Exports::single(export)));
    (engine, Client { io: client, task })
}

struct Client {
    io: DuplexStream,
    task: JoinHandle<Result<(), ConnectionError>>,
}

/// An option reply as read by the client.
#[derive(Debug)]
struct OptionReply {
    option: u32,
    kind: u32,
    data: Vec<u8>,
}

impl Client {
    async fn greet(&mut self, flags: u32) {
        let mut greeting = [0u8; 18];
        self.io.read_exact(&mut greeting).await.unwrap();
        assert_eq!(&greeting[..], &super::wire::greeting()[..]);
        self.io.write_u32(flags).await.unwrap();
    }

    async fn send_option(&mut self, option: u32, data: &[u8]) {
        let mut buf = Vec::new();
        buf.put_u64(IHAVEOPT);
        buf.put_u32(option);
        buf.put_u32(data.len() as u32);
        buf.put_slice(data);
        self.io.write_all(&buf).await.unwrap();
    }

    async fn option_reply(&mut self) -> OptionReply {
        assert_eq!(self.io.read_u64().await.unwrap(), OPTION_REPLY_MAGIC);
        let option = self.io.read_u32().await.unwrap();
        let kind = self.io.read_u32().await.unwrap();
        let len = self.io.read_u32().await.unwrap();
        let mut data = vec![0; len as usize];
        self.io.read_exact(&mut data).await.unwrap();
        OptionReply { option, kind, data }
    }

    /// Negotiates structured replies and, with `allocation`, the
    /// `base:allocation` context, then `GO`.
    async fn go_structured(&mut self, allocation: bool) {
        self.greet(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES).await;
        self.send_option(OPT_STRUCTURED_REPLY, &[]).await;
        assert_eq!(self.option_reply().await.kind, REP_ACK);
        if allocation {
            let data = meta_context_data("vol0", &[BASE_ALLOCATION, "qemu:dirty-bitmap:x"]);
            self.send_option(OPT_SET_META_CONTEXT, &data).await;
            let context = self.option_reply().await;
            assert_eq!(context.kind, REP_META_CONTEXT);
            assert_eq!(
                context.data,
                meta_context(BASE_ALLOCATION_ID, BASE_ALLOCATION)
            );
            assert_eq!(self.option_reply().await.kind, REP_ACK);
        }
        self.send_option(OPT_GO, &info_request(b"vol0", &[])).await;
        assert_eq!(self.option_reply().await.kind, REP_INFO);
        assert_eq!(self.option_reply().await.kind, REP_ACK);
    }

    /// Reads one structured reply chunk: (flags, type, cookie, payload).
    async fn chunk(&mut self) -> (u16, u16, u64, Vec<u8>) {
        assert_eq!(self.io.read_u32().await.unwrap(), STRUCTURED_REPLY_MAGIC);
        let flags = self.io.read_u16().await.unwrap();
        let kind = self.io.read_u16().await.unwrap();
        let cookie = self.io.read_u64().await.unwrap();
        let len = self.io.read_u32().await.unwrap();
        let mut payload = vec![0; len as usize];
        self.io.read_exact(&mut payload).await.unwrap();
        (flags, kind, cookie, payload)
    }

    /// Handshakes with `GO` and returns the transmission flags.
    async fn go(&mut self) -> u16 {
        self.greet(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES).await;
        self.send_option(OPT_GO, &info_request(b"vol0", &[])).await;
        let info = self.option_reply().await;
        assert_eq!((info.kind, info.data.len()), (REP_INFO, 12));
        assert_eq!(self.option_reply().await.kind, REP_ACK);
        u16::from_be_bytes([info.data[10], info.data[11]])
    }

    async fn send(
        &mut self,
        kind: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        len: u32,
        data: &[u8],
    ) {
        let mut buf = Vec::new();
        buf.put_u32(REQUEST_MAGIC);
        buf.put_u16(flags);
        buf.put_u16(kind);
        buf.put_u64(cookie);
        buf.put_u64(offset);
        buf.put_u32(len);
        buf.put_slice(data);
        self.io.write_all(&buf).await.unwrap();
    }

    /// Reads one simple reply; `read_len` bytes of data follow a successful
    /// reply to a read.
    async fn reply(&mut self, read_len: usize) -> (u64, u32, Vec<u8>) {
        assert_eq!(self.io.read_u32().await.unwrap(), SIMPLE_REPLY_MAGIC);
        let error = self.io.read_u32().await.unwrap();
        let cookie = self.io.read_u64().await.unwrap();
        let mut data = vec![0; if error == 0 { read_len } else { 0 }];
        self.io.read_exact(&mut data).await.unwrap();
        (cookie, error, data)
    }

    async fn write(&mut self, cookie: u64, offset: u64, data: &[u8]) -> u32 {
        self.send(1, 0, cookie, offset, data.len() as u32, data)
            .await;
        let (got, error, _) = self.reply(0).await;
        assert_eq!(got, cookie);
        error
    }

    async fn read(&mut self, cookie: u64, offset: u64, len: u32) -> Result<Vec<u8>, u32> {
        self.send(0, 0, cookie, offset, len, &[]).await;
        let (got, error, data) = self.reply(len as usize).await;
        assert_eq!(got, cookie);
        if error == 0 { Ok(data) } else { Err(error) }
    }

    /// Closes the client side and waits for the server to finish.
    async fn finish(self) -> Result<(), ConnectionError> {
        drop(self.io);
        tokio::time::timeout(DEADLINE, self.task)
            .await
            .expect("the server did not finish")
            .expect("the server panicked")
    }
}

fn info_request(name: &[u8], infos: &[u16]) -> Vec<u8> {
    let mut buf = Vec::new();
    buf.put_u32(name.len() as u32);
    buf.put_slice(name);
    buf.put_u16(infos.len() as u16);
    for info in infos {
        buf.put_u16(*info);
    }
    buf
}

#[tokio::test]
async fn info_reports_size_flags_block_sizes_and_name() {
    let (_, mut client) = server(Some(Term(1)));
    client.greet(CLIENT_FIXED_NEWSTYLE).await;
    client
        .send_option(
            OPT_INFO,
            &info_request(b"", &[INFO_BLOCK_SIZE, INFO_NAME, INFO_DESCRIPTION]),
        )
        .await;
    let export = client.option_reply().await;
    assert_eq!((export.option, export.kind), (OPT_INFO, REP_INFO));
    assert_eq!(&export.data[..2], &INFO_EXPORT.to_be_bytes());
    assert_eq!(&export.data[2..10], &(SIZE as u64).to_be_bytes());
    let flags = u16::from_be_bytes([export.data[10], export.data[11]]);
    assert_eq!(flags & TFLAG_READ_ONLY, 0);
    for flag in [
        TFLAG_SEND_FLUSH,
        TFLAG_SEND_FUA,
        TFLAG_SEND_WRITE_ZEROES,
        TFLAG_SEND_TRIM,
    ] {
        assert_ne!(flags & flag, 0, "{flag:#x}");
    }
    let block = client.option_reply().await;
    assert_eq!(block.data, info_block_size(1, 4096, 32 << 20));
    assert_eq!(
        client.option_reply().await.data,
        info_text(INFO_NAME, "vol0")
    );
    assert_eq!(
        client.option_reply().await.data,
        info_text(INFO_DESCRIPTION, "test volume")
    );
    assert_eq!(client.option_reply().await.kind, REP_ACK);
    // INFO leaves the client in option haggling: ABORT ends it cleanly.
    client.send_option(OPT_ABORT, &[]).await;
    assert_eq!(client.option_reply().await.kind, REP_ACK);
    client.finish().await.unwrap();
}

#[tokio::test]
async fn bad_options_get_error_replies_and_the_handshake_goes_on() {
    let (_, mut client) = server(Some(Term(1)));
    client.greet(CLIENT_FIXED_NEWSTYLE).await;
    client.send_option(OPT_LIST, &[]).await;
    let entry = client.option_reply().await;
    assert_eq!(
        (entry.kind, entry.data),
        (REP_SERVER, server_entry("vol0", "test volume"))
    );
    assert_eq!(client.option_reply().await.kind, REP_ACK);
    let refusals = [
        (OPT_LIST, vec![1u8], REP_ERR_INVALID),
        (OPT_GO, vec![0, 0, 0, 9], REP_ERR_INVALID),
        (OPT_GO, info_request(b"other", &[]), REP_ERR_UNKNOWN),
        (OPT_INFO, info_request(b"vol1", &[]), REP_ERR_UNKNOWN),
        (5, vec![], REP_ERR_UNSUP), // STARTTLS
        (OPT_STRUCTURED_REPLY, vec![1], REP_ERR_INVALID),
        // SET_META_CONTEXT before structured replies, malformed, for
        // another export.
        (
            OPT_SET_META_CONTEXT,
            meta_context_data("vol0", &[BASE_ALLOCATION]),
            REP_ERR_INVALID,
        ),
        (OPT_LIST_META_CONTEXT, vec![0, 0, 0, 9], REP_ERR_INVALID),
        (
            OPT_LIST_META_CONTEXT,
            meta_context_data("other", &[]),
            REP_ERR_UNKNOWN,
        ),
        (999, vec![7; 100], REP_ERR_UNSUP),
    ];
    for (option, data, kind) in refusals {
        client.send_option(option, &data).await;
        let reply = client.option_reply().await;
        assert_eq!(
            (reply.option, reply.kind),
            (option, kind),
            "option {option}"
        );
    }
    client
        .send_option(OPT_GO, &info_request(b"vol0", &[]))
        .await;
    assert_eq!(client.option_reply().await.kind, REP_INFO);
    assert_eq!(client.option_reply().await.kind, REP_ACK);
    assert_eq!(client.write(1, 0, b"still works").await, 0);
    client.finish().await.unwrap();
}

#[tokio::test]
async fn export_name_replies_with_or_without_zero_padding() {
    for (flags, len) in [
        (CLIENT_FIXED_NEWSTYLE, 134),
        (CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES, 10),
    ] {
        let (engine, mut client) = server(Some(Term(1)));
        client.greet(flags).await;
        client.send_option(OPT_EXPORT_NAME, b"vol0").await;
        let mut reply = vec![0; len];
        client.io.read_exact(&mut reply).await.unwrap();
        assert_eq!(&reply[..8], &(SIZE as u64).to_be_bytes());
        assert_eq!(client.write(9, 4096, b"hello").await, 0);
        assert_eq!(engine.read_at_now(4096, 5), b"hello");
        client.finish().await.unwrap();
    }
}

#[tokio::test]
async fn unknown_export_names_and_client_flags_end_the_connection() {
    let (_, mut client) = server(Some(Term(1)));
    client.greet(CLIENT_FIXED_NEWSTYLE).await;
    client.send_option(OPT_EXPORT_NAME, b"nope").await;
    assert!(matches!(
        client.finish().await,
        Err(ConnectionError::UnknownExport { name, .. }) if name == "nope"
    ));
    for flags in [0, 1 << 7] {
        let (_, mut client) = server(Some(Term(1)));
        client.greet(flags).await;
        assert!(matches!(
            client.finish().await,
            Err(ConnectionError::ClientFlags(_))
        ));
    }
}

trait ReadNow {
    fn read_at_now(&self, offset: u64, len: u64) -> Vec<u8>;
}

impl ReadNow for MemoryEngine {
    fn read_at_now(&self, offset: u64, len: u64) -> Vec<u8> {
        use crate::volume::Device;
        futures::executor::block_on(self.read_at(offset, len))
            .unwrap()
            .to_vec()
    }
}

#[tokio::test]
async fn every_command_does_what_it_says() {
    let (engine, mut client) = server(Some(Term(3)));
    client.go().await;
    let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(client.write(1, 8192, &data).await, 0);
    assert_eq!(client.read(2, 8192, 8192).await.unwrap(), data);
    // FUA write, flush.
    client.send(1, CMD_FLAG_FUA, 3, 0, 4, b"fua!").await;
    assert_eq!(client.reply(0).await, (3, 0, vec![]));
    client.send(3, 0, 4, 0, 0, &[]).await;
    assert_eq!(client.reply(0).await, (4, 0, vec![]));
    // Write zeroes over part of the pattern, then over the whole volume
    // (more than one of the server's 1 MiB zero chunks).
    client.send(6, 0, 5, 8192 + 100, 200, &[]).await;
    assert_eq!(client.reply(0).await, (5, 0, vec![]));
    let mut expected = data.clone();
    expected[100..300].fill(0);
    assert_eq!(engine.read_at_now(8192, 8192), expected);
    client
        .send(6, CMD_FLAG_NO_HOLE, 6, 0, SIZE as u32, &[])
        .await;
    assert_eq!(client.reply(0).await, (6, 0, vec![]));
    assert!(engine.read_at_now(0, SIZE as u64).iter().all(|b| *b == 0));
    // Cache: a checked hint.
    client.send(5, 0, 10, 0, 4096, &[]).await;
    assert_eq!(client.reply(0).await, (10, 0, vec![]));
    client.send(5, 0, 11, SIZE as u64, 1, &[]).await;
    assert_eq!(client.reply(0).await.1, EINVAL);
    // Fast zero: by a hole it is fast; written zeroes (NO_HOLE) are not,
    // and are refused at once with nothing written; on a write, invalid.
    assert_eq!(client.write(12, 0, b"keep").await, 0);
    client
        .send(6, CMD_FLAG_FAST_ZERO | CMD_FLAG_NO_HOLE, 13, 0, 4096, &[])
        .await;
    assert_eq!(client.reply(0).await.1, ENOTSUP);
    assert_eq!(engine.read_at_now(0, 4), b"keep");
    client.send(1, CMD_FLAG_FAST_ZERO, 14, 0, 4, b"fast").await;
    assert_eq!(client.reply(0).await.1, EINVAL);
    client.send(6, CMD_FLAG_FAST_ZERO, 15, 0, 4096, &[]).await;
    assert_eq!(client.reply(0).await, (15, 0, vec![]));
    assert_eq!(engine.read_at_now(0, 4), [0; 4]);
    // Trim discards: the range reads back as zeroes.
    assert_eq!(client.write(7, 0, b"gone").await, 0);
    assert_eq!(engine.read_at_now(0, 4), b"gone");
    client.send(4, 0, 8, 0, 4096, &[]).await;
    assert_eq!(client.reply(0).await, (8, 0, vec![]));
    assert_eq!(engine.read_at_now(0, 4), [0; 4]);
    // Disconnect ends the connection cleanly.
    client.send(2, 0, 9, 0, 0, &[]).await;
    let mut rest = Vec::new();
    client.io.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
    client.finish().await.unwrap();
}

#[tokio::test]
async fn bad_requests_get_errors_and_write_nothing() {
    let (engine, mut client) = server(Some(Term(3)));
    client.go().await;
    let size = SIZE as u64;
    assert_eq!(client.write(1, size - 2, b"abcd").await, ENOSPC);
    assert_eq!(client.read(2, size - 2, 4).await, Err(EINVAL));
    assert_eq!(client.read(3, u64::MAX, 4).await, Err(EINVAL));
    assert_eq!(client.read(4, 0, (32 << 20) + 1).await, Err(EINVAL));
    // An oversized write's payload is consumed and refused.
    let big = vec![0xee; (32 << 20) + 1];
    assert_eq!(client.write(5, 0, &big).await, EINVAL);
    // Unknown command, unknown flag, out-of-range trim and write-zeroes.
    client.send(99, 0, 6, 0, 0, &[]).await;
    assert_eq!(client.reply(0).await.1, EINVAL);
    client.send(1, 1 << 9, 7, 0, 4, b"flag").await;
    assert_eq!(client.reply(0).await.1, EINVAL);
    client.send(4, 0, 8, size, 1, &[]).await;
    assert_eq!(client.reply(0).await.1, ENOSPC);
    client.send(6, 0, 9, u64::MAX - 1, 4, &[]).await;
    assert_eq!(client.reply(0).await.1, ENOSPC);
    assert!(engine.writes().is_empty(), "{:?}", engine.writes());
    assert_eq!(client.write(10, 0, b"fine").await, 0);
    client.finish().await.unwrap();
}

#[tokio::test]
async fn many_requests_in_flight_are_all_answered() {
    let (engine, mut client) = server(Some(Term(2)));
    client.go().await;
    engine.set_delay(Duration::from_millis(20));
    for cookie in 0..64u64 {
        let block = [cookie as u8; 512];
        client.send(1, 0, cookie, cookie * 512, 512, &block).await;
    }
    let mut cookies = Vec::new();
    for _ in 0..64 {
        let (cookie, error, _) = client.reply(0).await;
        assert_eq!(error, 0);
        cookies.push(cookie);
    }
    cookies.sort_unstable();
    assert_eq!(cookies, (0..64).collect::<Vec<_>>());
    // The 20 ms writes overlapped: 64 in sequence would take 1.28 s.
    for cookie in 0..64u64 {
        assert_eq!(
            engine.read_at_now(cookie * 512, 512),
            vec![cookie as u8; 512]
        );
    }
    client.finish().await.unwrap();
}

#[tokio::test]
async fn a_passive_node_exports_read_only() {
    let (engine, mut client) = server(None);
    let flags = client.go().await;
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    assert_eq!(flags & TFLAG_SEND_WRITE_ZEROES, 0);
    assert_eq!(client.write(1, 0, b"nope").await, EPERM);
    for (kind, cookie) in [(6u16, 2u64), (4, 3)] {
        client.send(kind, 0, cookie, 0, 4, &[]).await;
        assert_eq!(client.reply(0).await, (cookie, EPERM, vec![]));
    }
    client.send(3, 0, 4, 0, 0, &[]).await;
    assert_eq!(client.reply(0).await, (4, 0, vec![]), "flush of nothing");
    assert_eq!(client.read(5, 0, 4).await.unwrap(), vec![0; 4]);
    assert!(engine.writes().is_empty());
    client.finish().await.unwrap();
}

/// Sends a request without minding a connection the server already closed.
async fn send_to_closing(client: &mut Client, kind: u16, cookie: u64, offset: u64, data: &[u8]) {
    let mut buf = Vec::new();
    buf.put_u32(REQUEST_MAGIC);
    buf.put_u16(0);
    buf.put_u16(kind);
    buf.put_u64(cookie);
    buf.put_u64(offset);
    buf.put_u32(if kind == 0 { 4096 } else { data.len() as u32 });
    buf.put_slice(data);
    let _ = client.io.write_all(&buf).await;
}

/// Every simple reply the server sends until it closes the connection, as
/// `(cookie, error)`; fails if it does not close within [`DEADLINE`].
async fn replies_until_closed(client: &mut Client) -> Vec<(u64, u32)> {
    let mut rest = Vec::new();
    tokio::time::timeout(DEADLINE, client.io.read_to_end(&mut rest))
        .await
        .expect("the server kept the connection open after its gate closed")
        .expect("reading the replies");
    rest.chunks(16)
        .map(|reply| {
            assert_eq!(reply.len(), 16, "a torn reply: {rest:?}");
            assert_eq!(&reply[..4], &SIMPLE_REPLY_MAGIC.to_be_bytes());
            let error = u32::from_be_bytes(reply[4..8].try_into().unwrap());
            (u64::from_be_bytes(reply[8..16].try_into().unwrap()), error)
        })
        .collect()
}

/// Polls `done` until it holds or [`DEADLINE`] passes.
async fn eventually(what: &str, done: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !done() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// C1: a request that meets a closed gate gets no reply, not even
/// `ESHUTDOWN`; the replies of what completed before are delivered, then
/// the connection closes, so a client retries on the new writer.
#[tokio::test]
async fn a_session_whose_gate_closed_is_closed_without_an_error_reply() {
    let (engine, mut client) = server(Some(Term(4)));
    client.go().await;
    // Two writes complete; their replies are not read until the end.
    client.send(1, 0, 1, 0, 6, b"before").await;
    client.send(1, CMD_FLAG_FUA, 2, 4096, 4, b"also").await;
    eventually("both writes landed", || engine.writes().len() == 2).await;
    engine.deactivate();
    // Whatever comes after the close: write, flush, write-zeroes, trim.
    send_to_closing(&mut client, 1, 3, 0, b"after!").await;
    send_to_closing(&mut client, 3, 4, 0, &[]).await;
    send_to_closing(&mut client, 6, 5, 0, &[]).await;
    send_to_closing(&mut client, 4, 6, 0, &[]).await;
    let mut replies = replies_until_closed(&mut client).await;
    replies.sort_unstable();
    assert_eq!(replies, vec![(1, 0), (2, 0)], "only the completed writes");
    assert_eq!(engine.writes().len(), 2);
    assert_eq!(engine.read_at_now(0, 6), b"before");
    client.finish().await.unwrap();
}

/// A read-write session belongs to the term its gate was open for: once
/// that gate closed, even if it opened again for a newer term, the session
/// serves nothing more, reads included.
#[tokio::test]
async fn a_read_on_a_session_whose_gate_closed_is_not_served() {
    let (engine, mut client) = server(Some(Term(4)));
    client.go().await;
    assert_eq!(client.write(1, 0, b"mine").await, 0);
    assert_eq!(client.read(2, 0, 4).await, Ok(b"mine".to_vec()));
    engine.deactivate();
    engine.activate(Term(5)).await.unwrap();
    send_to_closing(&mut client, 0, 3, 0, &[]).await;
    assert_eq!(replies_until_closed(&mut client).await, vec![]);
    client.finish().await.unwrap();
    // A new session belongs to the new term and is served.
    let export = Arc::new(Export::new("vol0", "test volume", engine.clone()));
    let mut client = connect(&export);
    assert_eq!(client.go().await & TFLAG_READ_ONLY, 0);
    assert_eq!(client.read(4, 0, 4).await, Ok(b"mine".to_vec()));
    client.finish().await.unwrap();
}

/// A writer whose writes are all held (as below `min_in_sync`) until the
/// session that sent them ends: what it saw of each write's bond.
struct HoldingDevice {
    engine: Arc<MemoryEngine>,
    /// The term of each held write's bond, and whether its end was seen.
    held: std::sync::Mutex<Vec<(Option<Term>, bool)>>,
}

#[async_trait::async_trait]
impl crate::volume::Device for HoldingDevice {
    async fn read_at(&self, offset: u64, len: u64) -> Result<bytes::Bytes, DeviceError> {
        self.engine.read_at(offset, len).await
    }
    async fn write_at(&self, _: u64, _: bytes::Bytes, _: bool) -> Result<(), DeviceError> {
        unreachable!("the session writes through `change`, with its bond")
    }
    async fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.engine.discard(offset, len).await
    }
    async fn flush(&self) -> Result<(), DeviceError> {
        self.engine.flush().await
    }
    fn size(&self) -> u64 {
        self.engine.size()
    }
    fn access(&self) -> crate::volume::Access {
        self.engine.access()
    }
    async fn change(&self, _: Change, bond: &Bond) -> Result<(), DeviceError> {
        let index = {
            let mut held = self.held.lock().unwrap();
            held.push((bond.term(), false));
            held.len() - 1
        };
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while !bond.ended() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.held.lock().unwrap()[index].1 = bond.ended();
        Err(DeviceError::Abandoned)
    }
}

fn holding_server() -> (Arc<MemoryEngine>, Arc<HoldingDevice>, Client) {
    let engine = MemoryEngine::new(SIZE);
    futures::executor::block_on(engine.activate(Term(4))).unwrap();
    let device = Arc::new(HoldingDevice {
        engine: Arc::clone(&engine),
        held: std::sync::Mutex::default(),
    });
    let export = Arc::new(Export::new("vol0", "test volume", device.clone()));
    (engine, device, connect(&export))
}

/// C1: a write the gate holds is bound to its session and term, and its
/// bond ends with the session — when the client hangs up, and when the
/// gate closes — so it is not sent again after the client sent it
/// elsewhere (the gate's side is `tests/controller.rs`).
#[tokio::test]
async fn a_held_write_learns_that_its_session_ended() {
    for hang_up in [true, false] {
        let (engine, device, mut client) = holding_server();
        client.go().await;
        client.send(1, 0, 1, 0, 4, b"held").await;
        eventually("the write is held", || {
            !device.held.lock().unwrap().is_empty()
        })
        .await;
        if hang_up {
            client.finish().await.unwrap();
        } else {
            engine.deactivate();
            assert_eq!(replies_until_closed(&mut client).await, vec![]);
            client.finish().await.unwrap();
        }
        eventually("the held write saw its session end", || {
            device.held.lock().unwrap()[0].1
        })
        .await;
        assert_eq!(device.held.lock().unwrap()[0].0, Some(Term(4)));
    }
}

/// A passive node's export over the read gate: the engine (the writer's
/// mirror) and this node's own copy, which holds "mine" at offset 0.
fn passive_server() -> (Arc<MemoryCopy>, Arc<Export>) {
    let engine = MemoryEngine::new(SIZE);
    let mut data = vec![0; SIZE];
    data[..4].copy_from_slice(b"mine");
    let local = MemoryCopy::new(data);
    let gate = ReadGate::new(engine, local.clone());
    let export = Arc::new(Export::new("vol0", "test volume", Arc::new(gate)));
    (local, export)
}

/// A client of a listener serving `export` alone, as its default.
fn connect(export: &Arc<Export>) -> Client {
    connect_to(&Exports::single(Arc::clone(export)))
}

/// A client of a listener serving `exports`.
fn connect_to(exports: &Exports) -> Client {
    let (io, server_io) = tokio::io::duplex(1 << 20);
    Client {
        io,
        task: tokio::spawn(handle(server_io, exports.clone())),
    }
}

/// Fenced reads: a passive node serves reads of its own copy only
/// while that copy is in the committed in-sync set. Out of it, a new client
/// is turned away at the handshake with the reason, and a session already
/// open gets `EIO` for its reads until the copy is back in sync.
#[tokio::test]
async fn a_passive_node_out_of_the_in_sync_set_refuses_reads() {
    let (local, export) = passive_server();
    // In sync: read-only, and reads are served from the local copy.
    let mut open = connect(&export);
    assert_ne!(open.go().await & TFLAG_READ_ONLY, 0);
    assert_eq!(open.read(1, 0, 4).await, Ok(b"mine".to_vec()));

    local.set_in_sync(false);
    assert_eq!(open.read(2, 0, 4).await, Err(EIO), "an open session");
    // GO and INFO are refused with the reason; the handshake goes on.
    let mut refused = connect(&export);
    refused.greet(CLIENT_FIXED_NEWSTYLE).await;
    for option in [OPT_INFO, OPT_GO] {
        refused.send_option(option, &info_request(b"", &[])).await;
        let reply = refused.option_reply().await;
        assert_eq!((reply.option, reply.kind), (option, REP_ERR_UNKNOWN));
        let why = String::from_utf8_lossy(&reply.data).to_string();
        assert!(why.contains("not in the committed in-sync set"), "{why}");
    }
    refused.send_option(OPT_ABORT, &[]).await;
    assert_eq!(refused.option_reply().await.kind, REP_ACK);
    refused.finish().await.unwrap();
    // EXPORT_NAME has no error reply: the connection closes.
    let mut refused = connect(&export);
    refused.greet(CLIENT_FIXED_NEWSTYLE).await;
    refused.send_option(OPT_EXPORT_NAME, b"vol0").await;
    assert!(matches!(
        refused.finish().await,
        Err(ConnectionError::Unavailable(_))
    ));

    // Back in sync: served again, on the open session and on a new one.
    local.set_in_sync(true);
    assert_eq!(open.read(3, 0, 4).await, Ok(b"mine".to_vec()));
    open.finish().await.unwrap();
    let mut again = connect(&export);
    assert_ne!(again.go().await & TFLAG_READ_ONLY, 0);
    assert_eq!(again.read(4, 0, 4).await, Ok(b"mine".to_vec()));
    again.finish().await.unwrap();
}

#[tokio::test]
async fn a_bad_magic_ends_the_connection_after_answering_what_came_before() {
    let (engine, mut client) = server(Some(Term(1)));
    client.go().await;
    client.send(1, 0, 1, 0, 4, b"good").await;
    let mut garbage = vec![0xde, 0xad, 0xbe, 0xef];
    garbage.extend_from_slice(&[0u8; 24]);
    client.io.write_all(&garbage).await.unwrap();
    // A write header after the garbage must not be executed.
    client.send(1, 0, 2, 4, 4, b"evil").await;
    assert_eq!(client.reply(0).await, (1, 0, vec![]));
    let mut rest = Vec::new();
    client.io.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
    assert!(matches!(
        client.finish().await,
        Err(ConnectionError::Protocol(WireError::BadMagic(0xdeadbeef)))
    ));
    assert_eq!(engine.writes().len(), 1);
    assert_eq!(engine.read_at_now(0, 8), b"good\0\0\0\0");
}

/// A request with arbitrary fields (the magic is right, the rest is not).
fn any_request() -> impl Strategy<Value = (u16, u16, u64, u32)> {
    (
        prop_oneof![0u16..10, any::<u16>()],
        any::<u16>(),
        prop_oneof![0..SIZE as u64, Just(SIZE as u64 - 1), any::<u64>()],
        prop_oneof![0u32..5000, any::<u32>()],
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Garbage at any point of the handshake: the server ends the
    /// connection with an error or keeps haggling; it never panics and
    /// never writes.
    #[test]
    fn handshake_garbage_never_panics(prefix in 0usize..4, garbage in proptest::collection::vec(any::<u8>(), 0..300)) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let (engine, mut client) = server(Some(Term(1)));
            let mut greeting = [0u8; 18];
            client.io.read_exact(&mut greeting).await.unwrap();
            let mut stream = Vec::new();
            if prefix > 0 { stream.put_u32(CLIENT_FIXED_NEWSTYLE); }
            if prefix > 1 { stream.put_u64(IHAVEOPT); }
            if prefix > 2 { stream.put_u32(OPT_GO); }
            stream.extend_from_slice(&garbage);
            let _ = client.io.write_all(&stream).await;
            let _ = client.finish().await;
            prop_assert!(engine.writes().is_empty());
            Ok(())
        })?;
    }

    /// Arbitrary requests after a good handshake: every reply answers a
    /// cookie that was sent, nothing out of range is written, no panic.
    #[test]
    fn arbitrary_requests_never_panic(requests in proptest::collection::vec(any_request(), 1..12), tail in proptest::collection::vec(any::<u8>(), 0..40), structured in any::<bool>()) {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let (engine, mut client) = server(Some(Term(1)));
            if structured {
                // Structured replies and base:allocation: block status
                // (type 7) is served, reads come in chunks.
                client.go_structured(true).await;
            } else {
                client.go().await;
            }
            let mut stream = Vec::new();
            for (cookie, (kind, flags, offset, len)) in requests.iter().enumerate() {
                stream.put_u32(REQUEST_MAGIC);
                stream.put_u16(*flags);
                stream.put_u16(*kind);
                stream.put_u64(cookie as u64);
                stream.put_u64(*offset);
                stream.put_u32(*len);
                if *kind == 1 && *len <= 5000 {
                    stream.put_bytes(0xab, *len as usize);
                }
            }
            stream.extend_from_slice(&tail);
            let (mut read_half, mut write_half) = tokio::io::split(client.io);
            let writer = tokio::spawn(async move {
                let _ = write_half.write_all(&stream).await;
                let _ = write_half.shutdown().await;
                write_half
            });
            let mut replies = Vec::new();
            let _ = tokio::time::timeout(DEADLINE, read_half.read_to_end(&mut replies)).await
                .expect("the server neither answered nor closed");
            let write_half = writer.await.unwrap();
            let client = Client { io: read_half.unsplit(write_half), task: client.task };
            let _ = client.finish().await;
            for (_term, offset) in engine.writes() {
                prop_assert!(offset < SIZE as u64);
            }
            Ok(())
        })?;
    }
}

/// With structured replies, a read is one `OFFSET_DATA` chunk and a block
/// status query one `BLOCK_STATUS` chunk, each flagged done; a failure is
/// an `ERROR` chunk. Other commands keep simple replies.
#[tokio::test]
async fn structured_replies_carry_reads_and_block_status() {
    let (_, mut client) = server(Some(Term(1)));
    client.go_structured(true).await;
    assert_eq!(client.write(1, 4096, b"structured").await, 0);
    client.send(0, 0, 2, 4096, 10, &[]).await;
    let (flags, kind, cookie, payload) = client.chunk().await;
    assert_eq!(
        (flags, kind, cookie),
        (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 2)
    );
    assert_eq!(&payload[..8], &4096u64.to_be_bytes());
    assert_eq!(&payload[8..], b"structured");
    // Block status: descriptors covering the range (the fake has no holes).
    client.send(7, 0, 3, 0, 1 << 20, &[]).await;
    let (flags, kind, cookie, payload) = client.chunk().await;
    assert_eq!(
        (flags, kind, cookie),
        (REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, 3)
    );
    assert_eq!(&payload[..4], &BASE_ALLOCATION_ID.to_be_bytes());
    let total: u64 = payload[4..]
        .chunks(8)
        .map(|d| u64::from(u32::from_be_bytes([d[0], d[1], d[2], d[3]])))
        .sum();
    assert_eq!(total, 1 << 20);
    // Out of range: an error chunk, for a read and for block status.
    client.send(0, 0, 4, SIZE as u64, 512, &[]).await;
    let (flags, kind, cookie, payload) = client.chunk().await;
    assert_eq!(
        (flags, kind, cookie),
        (REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 4)
    );
    assert_eq!(&payload[..4], &EINVAL.to_be_bytes());
    client.send(7, 0, 5, SIZE as u64 - 512, 1024, &[]).await;
    let (_, kind, cookie, payload) = client.chunk().await;
    assert_eq!((kind, cookie), (REPLY_TYPE_ERROR, 5));
    assert_eq!(&payload[..4], &EINVAL.to_be_bytes());
    // A read of length 0: a NONE chunk (an OFFSET_DATA chunk must carry a
    // byte).
    client.send(0, 0, 6, 4096, 0, &[]).await;
    assert_eq!(
        client.chunk().await,
        (REPLY_FLAG_DONE, REPLY_TYPE_NONE, 6, vec![])
    );
    // REQ_ONE belongs to block status only.
    client.send(0, CMD_FLAG_REQ_ONE, 7, 0, 512, &[]).await;
    let (_, kind, _, payload) = client.chunk().await;
    assert_eq!(kind, REPLY_TYPE_ERROR);
    assert_eq!(&payload[..4], &EINVAL.to_be_bytes());
    client.send(7, CMD_FLAG_REQ_ONE, 8, 0, 4096, &[]).await;
    let (_, kind, _, payload) = client.chunk().await;
    assert_eq!((kind, payload.len()), (REPLY_TYPE_BLOCK_STATUS, 12));
    client.finish().await.unwrap();
}

/// A structured read of at least `HOLES_FROM` bytes over holes answers
/// them with `OFFSET_HOLE` chunks and sends only the data, in order, the
/// last chunk flagged done; a shorter one, or one without holes, is one
/// data chunk.
#[tokio::test]
async fn structured_reads_skip_holes_in_hole_chunks() {
    const K: u64 = 1024;
    let (_, mut client) = server(Some(Term(1)));
    client.go_structured(false).await;
    assert_eq!(client.write(1, 64 * K, &[0xaa; 8 * 1024]).await, 0);
    assert_eq!(client.write(2, 192 * K, &[0xbb; 4 * 1024]).await, 0);
    client.send(0, 0, 3, 0, 256 * 1024, &[]).await;
    let mut chunks = Vec::new();
    loop {
        let (flags, kind, cookie, payload) = client.chunk().await;
        assert_eq!(cookie, 3);
        let offset = u64::from_be_bytes(payload[..8].try_into().unwrap());
        let piece = match kind {
            REPLY_TYPE_OFFSET_HOLE => {
                assert_eq!(payload.len(), 12);
                let len = u32::from_be_bytes(payload[8..12].try_into().unwrap());
                (offset, u64::from(len), None)
            }
            REPLY_TYPE_OFFSET_DATA => {
                let data = payload[8..].to_vec();
                (offset, data.len() as u64, data.first().copied())
            }
            other => panic!("unexpected chunk type {other}"),
        };
        chunks.push(piece);
        if flags & REPLY_FLAG_DONE != 0 {
            break;
        }
    }
    assert_eq!(
        chunks,
        vec![
            (0, 64 * K, None),
            (64 * K, 8 * K, Some(0xaa)),
            (72 * K, 120 * K, None),
            (192 * K, 4 * K, Some(0xbb)),
            (196 * K, 60 * K, None),
        ]
    );
    // Shorter than HOLES_FROM: one data chunk, zeroes included.
    client.send(0, 0, 4, 60 * K, 8 * 1024, &[]).await;
    let (flags, kind, _, payload) = client.chunk().await;
    assert_eq!((flags, kind), (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA));
    assert_eq!(payload.len(), 8 + 8 * 1024);
    assert_eq!(&payload[8..8 + 4096], &[0u8; 4096][..]);
    assert_eq!(payload[8 + 4096], 0xaa);
    // No holes in the range: one data chunk.
    assert_eq!(client.write(5, 512 * K, &[0xcc; 64 * 1024]).await, 0);
    client.send(0, 0, 6, 512 * K, 64 * 1024, &[]).await;
    let (flags, kind, _, payload) = client.chunk().await;
    assert_eq!((flags, kind), (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA));
    assert_eq!(payload.len(), 8 + 64 * 1024);
    client.finish().await.unwrap();
}

/// LIST names the context with id 0; a SET that fails clears what an
/// earlier SET selected, so block status is then refused.
#[tokio::test]
async fn meta_context_list_and_a_failed_set() {
    let (_, mut client) = server(Some(Term(1)));
    client.greet(CLIENT_FIXED_NEWSTYLE).await;
    client
        .send_option(OPT_LIST_META_CONTEXT, &meta_context_data("vol0", &[]))
        .await;
    let listed = client.option_reply().await;
    assert_eq!(
        (listed.kind, listed.data),
        (REP_META_CONTEXT, meta_context(0, BASE_ALLOCATION))
    );
    assert_eq!(client.option_reply().await.kind, REP_ACK);
    client.send_option(OPT_STRUCTURED_REPLY, &[]).await;
    assert_eq!(client.option_reply().await.kind, REP_ACK);
    let select = meta_context_data("vol0", &[BASE_ALLOCATION]);
    client.send_option(OPT_SET_META_CONTEXT, &select).await;
    assert_eq!(client.option_reply().await.kind, REP_META_CONTEXT);
    assert_eq!(client.option_reply().await.kind, REP_ACK);
    let failing = meta_context_data("other", &[BASE_ALLOCATION]);
    client.send_option(OPT_SET_META_CONTEXT, &failing).await;
    assert_eq!(client.option_reply().await.kind, REP_ERR_UNKNOWN);
    client
        .send_option(OPT_GO, &info_request(b"vol0", &[]))
        .await;
    assert_eq!(client.option_reply().await.kind, REP_INFO);
    assert_eq!(client.option_reply().await.kind, REP_ACK);
    client.send(7, 0, 1, 0, 4096, &[]).await;
    let (_, kind, _, payload) = client.chunk().await;
    assert_eq!(kind, REPLY_TYPE_ERROR);
    assert_eq!(&payload[..4], &EINVAL.to_be_bytes());
    client.finish().await.unwrap();
}

/// Block status without the context selected is refused (`EINVAL`).
#[tokio::test]
async fn block_status_needs_the_allocation_context() {
    let (_, mut client) = server(Some(Term(1)));
    client.go_structured(false).await;
    client.send(7, 0, 9, 0, 4096, &[]).await;
    let (flags, kind, cookie, payload) = client.chunk().await;
    assert_eq!(
        (flags, kind, cookie),
        (REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 9)
    );
    assert_eq!(&payload[..4], &EINVAL.to_be_bytes());
    client.finish().await.unwrap();
}

#[tokio::test]
async fn zero_length_requests_at_the_end_are_fine() {
    let (_, mut client) = server(Some(Term(1)));
    client.go().await;
    assert_eq!(client.write(1, SIZE as u64, &[]).await, 0);
    assert_eq!(client.read(2, SIZE as u64, 0).await, Ok(vec![]));
    client.finish().await.unwrap();
}

/// Two volumes on one listener, as a node holding copies of both serves
/// them: "vol0" (the default) holds "zero" at 0, "db" holds "dbdb".
fn two_volumes() -> (Exports, Arc<MemoryEngine>, Arc<MemoryEngine>) {
    let exports = Exports::new();
    let mut engines = Vec::new();
    for (name, bytes) in [("vol0", b"zero"), ("db", b"dbdb")] {
        let engine = MemoryEngine::new(SIZE);
        futures::executor::block_on(engine.activate(Term(1))).unwrap();
        futures::executor::block_on(write_now(&engine, bytes));
        let description = format!("volume {name}");
        exports.insert(Arc::new(Export::new(name, description, engine.clone())));
        engines.push(engine);
    }
    exports.set_default("vol0");
    let db = engines.pop().unwrap();
    (exports, engines.pop().unwrap(), db)
}

/// Writes `bytes` at 0 of `engine`, outside any NBD session.
async fn write_now(engine: &Arc<MemoryEngine>, bytes: &[u8]) {
    use crate::volume::Device;
    let data = bytes::Bytes::copy_from_slice(bytes);
    engine.write_at(0, data, false).await.unwrap();
}

impl Client {
    /// Handshakes with `GO` for the export `name`; the reply's kind (and
    /// the session is open when it is `REP_ACK`).
    async fn go_named(&mut self, name: &[u8]) -> OptionReply {
        self.greet(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES).await;
        self.send_option(OPT_GO, &info_request(name, &[])).await;
        let reply = self.option_reply().await;
        if reply.kind != REP_INFO {
            return reply;
        }
        self.option_reply().await
    }

    /// The names and descriptions `LIST` gives.
    async fn list(&mut self) -> Vec<(String, String)> {
        self.send_option(OPT_LIST, &[]).await;
        let mut listed = Vec::new();
        loop {
            let reply = self.option_reply().await;
            if reply.kind == REP_ACK {
                return listed;
            }
            assert_eq!(reply.kind, REP_SERVER);
            let len = u32::from_be_bytes(reply.data[..4].try_into().unwrap()) as usize;
            let (name, description) = reply.data[4..].split_at(len);
            let text = |b: &[u8]| String::from_utf8(b.to_vec()).unwrap();
            listed.push((text(name), text(description)));
        }
    }
}

#[tokio::test]
async fn one_listener_serves_each_client_the_volume_it_names() {
    let (exports, vol0, db) = two_volumes();
    let mut to_db = connect_to(&exports);
    assert_eq!(to_db.go_named(b"db").await.kind, REP_ACK);
    let mut to_vol0 = connect_to(&exports);
    assert_eq!(to_vol0.go_named(b"vol0").await.kind, REP_ACK);
    assert_eq!(to_db.read(1, 0, 4).await, Ok(b"dbdb".to_vec()));
    assert_eq!(to_vol0.read(2, 0, 4).await, Ok(b"zero".to_vec()));
    // Writes land on the named volume only.
    assert_eq!(to_db.write(3, 4096, b"only db").await, 0);
    assert_eq!(db.read_at_now(4096, 7), b"only db");
    assert_eq!(vol0.read_at_now(4096, 7), vec![0; 7]);
    // EXPORT_NAME chooses by name too.
    let mut old_style = connect_to(&exports);
    old_style
        .greet(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES)
        .await;
    old_style.send_option(OPT_EXPORT_NAME, b"db").await;
    let mut reply = [0u8; 10];
    old_style.io.read_exact(&mut reply).await.unwrap();
    assert_eq!(old_style.read(4, 4096, 7).await, Ok(b"only db".to_vec()));
    for client in [to_db, to_vol0, old_style] {
        client.finish().await.unwrap();
    }
}

#[tokio::test]
async fn list_names_every_export_with_its_description_and_info_by_name() {
    let (exports, _, _) = two_volumes();
    assert_eq!(exports.names(), ["db", "vol0"]);
    let mut client = connect_to(&exports);
    client.greet(CLIENT_FIXED_NEWSTYLE).await;
    assert_eq!(
        client.list().await,
        [
            ("db".to_string(), "volume db".to_string()),
            ("vol0".to_string(), "volume vol0".to_string())
        ]
    );
    client
        .send_option(OPT_INFO, &info_request(b"db", &[INFO_DESCRIPTION]))
        .await;
    assert_eq!(client.option_reply().await.kind, REP_INFO);
    assert_eq!(
        client.option_reply().await.data,
        info_text(INFO_DESCRIPTION, "volume db")
    );
    assert_eq!(client.option_reply().await.kind, REP_ACK);
    client.send_option(OPT_ABORT, &[]).await;
    assert_eq!(client.option_reply().await.kind, REP_ACK);
    client.finish().await.unwrap();
}

/// A volume this node holds no copy of is refused with the node's words
/// for it (which nodes hold it), or that there is no such volume here.
#[tokio::test]
async fn a_volume_held_elsewhere_is_refused_with_the_nodes_that_hold_it() {
    let (exports, _, _) = two_volumes();
    let exports = exports.with_lookup(|name| {
        (name == "logs").then(|| "volume logs is held by nodes 2, 3, 5".to_string())
    });
    let mut client = connect_to(&exports);
    client.greet(CLIENT_FIXED_NEWSTYLE).await;
    let refusals = [
        (
            OPT_GO,
            b"logs".as_slice(),
            "volume logs is held by nodes 2, 3, 5",
        ),
        (OPT_INFO, b"logs", "volume logs is held by nodes 2, 3, 5"),
        (OPT_GO, b"nope", "there is no volume \"nope\" on this node"),
    ];
    for (option, name, why) in refusals {
        client.send_option(option, &info_request(name, &[])).await;
        let reply = client.option_reply().await;
        assert_eq!((reply.option, reply.kind), (option, REP_ERR_UNKNOWN));
        assert_eq!(String::from_utf8_lossy(&reply.data), why);
    }
    // The handshake goes on: a served name still opens.
    client.send_option(OPT_GO, &info_request(b"db", &[])).await;
    assert_eq!(client.option_reply().await.kind, REP_INFO);
    assert_eq!(client.option_reply().await.kind, REP_ACK);
    assert_eq!(client.read(1, 0, 4).await, Ok(b"dbdb".to_vec()));
    client.finish().await.unwrap();
    // EXPORT_NAME has no error reply: the connection closes, with the words.
    let mut old_style = connect_to(&exports);
    old_style.greet(CLIENT_FIXED_NEWSTYLE).await;
    old_style.send_option(OPT_EXPORT_NAME, b"logs").await;
    let ended = old_style.finish().await;
    assert!(
        matches!(&ended, Err(ConnectionError::UnknownExport { name, why })
            if name == "logs" && why.contains("held by nodes 2, 3, 5")),
        "{ended:?}"
    );
}

/// Volumes come and go while the listener runs: a removed export is no
/// longer listed nor offered, and a client that chose it before keeps it.
#[tokio::test]
async fn an_export_removed_while_a_client_uses_it_keeps_that_client_and_refuses_new_ones() {
    let (exports, _, db) = two_volumes();
    let mut before = connect_to(&exports);
    assert_eq!(before.go_named(b"db").await.kind, REP_ACK);
    assert!(exports.remove("db").is_some());
    assert_eq!(exports.get("db").map(|e| e.name.clone()), None);

    let mut after = connect_to(&exports);
    after.greet(CLIENT_FIXED_NEWSTYLE).await;
    assert_eq!(after.list().await.len(), 1, "only vol0 is listed");
    after.send_option(OPT_GO, &info_request(b"db", &[])).await;
    assert_eq!(after.option_reply().await.kind, REP_ERR_UNKNOWN);
    after.send_option(OPT_ABORT, &[]).await;
    assert_eq!(after.option_reply().await.kind, REP_ACK);
    after.finish().await.unwrap();

    assert_eq!(before.write(1, 8192, b"still").await, 0);
    assert_eq!(before.read(2, 0, 4).await, Ok(b"dbdb".to_vec()));
    assert_eq!(db.read_at_now(8192, 5), b"still");
    before.finish().await.unwrap();

    // Inserted again, it is offered again.
    exports.insert(Arc::new(Export::new("db", "volume db", db.clone())));
    let mut again = connect_to(&exports);
    assert_eq!(again.go_named(b"db").await.kind, REP_ACK);
    again.finish().await.unwrap();
}

/// The empty name is the registry's default export, the node's
/// configured volume: what a single-volume client names; without a
/// default it is refused with how to find the names.
#[tokio::test]
async fn the_empty_name_picks_the_default_export() {
    let (exports, _, _) = two_volumes();
    exports.set_default("db");
    let mut client = connect_to(&exports);
    client.greet(CLIENT_FIXED_NEWSTYLE).await;
    client
        .send_option(OPT_INFO, &info_request(b"", &[INFO_NAME]))
        .await;
    assert_eq!(client.option_reply().await.kind, REP_INFO);
    assert_eq!(client.option_reply().await.data, info_text(INFO_NAME, "db"));
    assert_eq!(client.option_reply().await.kind, REP_ACK);
    client.send_option(OPT_GO, &info_request(b"", &[])).await;
    assert_eq!(client.option_reply().await.kind, REP_INFO);
    assert_eq!(client.option_reply().await.kind, REP_ACK);
    assert_eq!(client.read(1, 0, 4).await, Ok(b"dbdb".to_vec()));
    client.finish().await.unwrap();

    let no_default = Exports::new();
    no_default.insert(exports.get("vol0").unwrap());
    let mut client = connect_to(&no_default);
    let refused = client.go_named(b"").await;
    assert_eq!(refused.kind, REP_ERR_UNKNOWN);
    let why = String::from_utf8_lossy(&refused.data).to_string();
    assert!(why.contains("no default export"), "{why}");
}

/// `base:allocation` set for one export does not follow the client to
/// another: the protocol drops it when `GO` names a different export.
#[tokio::test]
async fn a_context_set_for_one_export_does_not_follow_go_to_another() {
    let (exports, _, _) = two_volumes();
    for (go_to, allocation) in [(b"db".as_slice(), true), (b"vol0", false)] {
        let mut client = connect_to(&exports);
        client.greet(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES).await;
        client.send_option(OPT_STRUCTURED_REPLY, &[]).await;
        assert_eq!(client.option_reply().await.kind, REP_ACK);
        let data = meta_context_data("db", &[BASE_ALLOCATION]);
        client.send_option(OPT_SET_META_CONTEXT, &data).await;
        assert_eq!(client.option_reply().await.kind, REP_META_CONTEXT);
        assert_eq!(client.option_reply().await.kind, REP_ACK);
        client.send_option(OPT_GO, &info_request(go_to, &[])).await;
        assert_eq!(client.option_reply().await.kind, REP_INFO);
        assert_eq!(client.option_reply().await.kind, REP_ACK);
        client.send(7, 0, 1, 0, 4096, &[]).await;
        let (_, kind, _, _) = client.chunk().await;
        let served = kind != REPLY_TYPE_ERROR;
        assert_eq!(served, allocation, "GO to {:?}", lossy(go_to));
        client.finish().await.unwrap();
    }
}

fn lossy(name: &[u8]) -> String {
    String::from_utf8_lossy(name).into_owned()
}

/// The roles on NBD (S9, #36), in one process: a writable export on the
/// writer over TLS, and clients presenting each kind of certificate.
mod roles {
    use std::collections::BTreeSet;

    use tokio::io::AsyncWriteExt;

    use super::super::client::{self, ClientError, Connection};
    use super::super::{Export, ExportTls, Grant, NbdStats, serve};
    use super::*;
    use crate::certs::{self, Role, TlsFiles};
    use crate::ids::NodeId;
    use crate::net::tls::{NbdClientAuth, Party};
    use crate::net::{Audience, Limits, Tls, Transport};

    const CLUSTER: &str = "roles";

    struct Served {
        addr: String,
        certs: tempfile::TempDir,
        transport: Transport,
        _stop: tokio::sync::watch::Sender<bool>,
    }

    /// Node 1, the writer, serving over TLS to clients of any kind, with
    /// nodes 1 to 3 as members and `anonymous` for clients without a
    /// certificate.
    async fn writer(anonymous: Grant) -> Served {
        let certs = tempfile::tempdir().unwrap();
        let dir = certs.path();
        certs::init(dir, CLUSTER, 30, false).unwrap();
        for id in 1..=4 {
            certs::issue_node(dir, NodeId(id), &[], 10).unwrap();
        }
        certs::issue_client(dir, "ops", Role::Admin, 10).unwrap();
        certs::issue_client(dir, "vm", Role::User, 10).unwrap();
        certs::issue_client(dir, "grafana", Role::Viewer, 10).unwrap();
        certs::issue_unnamed(dir, "nobody", 10).unwrap();
        let tls = Tls::load(
            TlsFiles::for_node(dir, NodeId(1)),
            CLUSTER,
            Party::Node(NodeId(1)),
        )
        .unwrap();
        let members: BTreeSet<NodeId> = (1..=3).map(NodeId).collect();
        let transport = Transport::secured(Limits::default(), Arc::clone(&tls))
            .with_members(Arc::new(std::sync::RwLock::new(members)));
        let engine = MemoryEngine::new(SIZE);
        engine.activate(Term(3)).await.unwrap();
        let export = Arc::new(Export::new("vol0", "test volume", engine));
        let db = MemoryEngine::new(SIZE);
        db.activate(Term(3)).await.unwrap();
        let exports = Exports::single(export);
        exports.insert(Arc::new(Export::new("db", "another volume", db)));
        let exports = exports.with_anonymous(anonymous).with_tls(ExportTls {
            credentials: tls,
            required: false,
            client_auth: NbdClientAuth::Optional,
            guard: transport.guard(Audience::Volume),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (stop, stopped) = tokio::sync::watch::channel(false);
        tokio::spawn(serve(
            listener,
            exports,
            Arc::new(NbdStats::default()),
            stopped,
        ));
        Served {
            addr,
            certs,
            transport,
            _stop: stop,
        }
    }

    async fn open(served: &Served, who: Option<&str>) -> Result<Connection, ClientError> {
        open_export(served, "vol0", who).await
    }

    async fn open_export(
        served: &Served,
        export: &str,
        who: Option<&str>,
    ) -> Result<Connection, ClientError> {
        let config = crate::net::tls::unchecked_client(served.certs.path(), who).unwrap();
        let name = crate::net::tls::server_name(&served.addr);
        tokio::time::timeout(
            DEADLINE,
            client::connect(&served.addr, export, Some((config, name))),
        )
        .await
        .expect("the handshake ends")
    }

    /// Admission is the listener's: a certificate gets the same on every
    /// export it names after the upgrade.
    #[tokio::test]
    async fn a_certificate_gets_the_same_on_every_export() {
        let served = writer(Grant::ReadOnly).await;
        for export in ["vol0", "db"] {
            let mut ops = open_export(&served, export, Some("ops")).await.unwrap();
            assert_eq!(write(&mut ops).await, 0, "ops writes {export}");
            let viewer = open_export(&served, export, Some("grafana")).await;
            assert!(read_only(&viewer.unwrap()), "a viewer reads {export}");
            let anonymous = open_export(&served, export, None).await.unwrap();
            assert!(read_only(&anonymous), "anonymous reads {export}");
            let refused = open_export(&served, export, Some("node-4")).await;
            let refused = refused.err().expect("a non-member is refused");
            assert!(refused.to_string().contains("not a member"), "{refused}");
        }
    }

    /// One 512-byte write at 0; its error code.
    async fn write(connection: &mut Connection) -> u32 {
        let request = Request {
            flags: 0,
            command: Command::Write,
            cookie: 9,
            offset: 0,
            len: 512,
        };
        let data = bytes::Bytes::from(vec![0x5a; 512]);
        client::send(&mut connection.writer, &request, Some(&data))
            .await
            .unwrap();
        connection.writer.flush().await.unwrap();
        let (error, cookie) = client::receive(&mut connection.reader).await.unwrap();
        assert_eq!(cookie, 9);
        error
    }

    fn read_only(connection: &Connection) -> bool {
        connection.export.flags & TFLAG_READ_ONLY != 0
    }

    #[tokio::test]
    async fn a_certificate_gets_what_its_role_allows() {
        let served = writer(Grant::ReadWrite).await;
        for who in ["ops", "vm", "node-2"] {
            let mut session = open(&served, Some(who)).await.unwrap();
            assert!(!read_only(&session), "{who} may write");
            assert_eq!(write(&mut session).await, 0, "{who} wrote");
        }
        // A viewer reads, and a write it sends anyway is refused.
        let mut viewer = open(&served, Some("grafana")).await.unwrap();
        assert!(read_only(&viewer), "a viewer's export is read-only");
        assert_eq!(write(&mut viewer).await, EPERM);
    }

    #[tokio::test]
    async fn a_certificate_that_names_nobody_or_a_non_member_is_refused_with_the_reason() {
        let served = writer(Grant::ReadWrite).await;
        let refused = open(&served, Some("nobody")).await.err().expect("refused");
        assert!(
            refused.to_string().contains("names no node or client"),
            "{refused}"
        );
        let refused = open(&served, Some("node-4")).await.err().expect("refused");
        assert!(
            refused.to_string().contains("node 4 is not a member"),
            "{refused}"
        );

        // Removed from the membership, a node is refused from then on,
        // by the same admission as the replica service's.
        let mut member = open(&served, Some("node-3")).await.unwrap();
        assert_eq!(write(&mut member).await, 0);
        served.transport.expel_member(NodeId(3));
        let refused = open(&served, Some("node-3")).await.err().expect("refused");
        assert!(
            refused.to_string().contains("node 3 is not a member"),
            "{refused}"
        );
    }

    /// As the replica service refuses a removed node's frames on a link
    /// it already had, an NBD session of a node removed from the
    /// membership is closed, not only new ones refused.
    #[tokio::test]
    async fn a_session_of_a_node_removed_from_the_membership_is_closed() {
        use tokio::io::AsyncReadExt;
        let served = writer(Grant::ReadWrite).await;
        let mut member = open(&served, Some("node-3")).await.unwrap();
        assert_eq!(write(&mut member).await, 0);
        let mut user = open(&served, Some("vm")).await.unwrap();
        served.transport.expel_member(NodeId(3));
        let mut byte = [0u8; 1];
        let ended = tokio::time::timeout(DEADLINE, member.reader.read(&mut byte))
            .await
            .expect("the removed node's session ends");
        assert!(matches!(ended, Ok(0) | Err(_)), "{ended:?}");
        // Nobody else's session is touched.
        assert_eq!(write(&mut user).await, 0);
    }

    #[tokio::test]
    async fn a_client_without_a_certificate_gets_what_the_node_grants() {
        let open_to_all = writer(Grant::ReadWrite).await;
        let mut session = open(&open_to_all, None).await.unwrap();
        assert_eq!(write(&mut session).await, 0);

        let guarded = writer(Grant::ReadOnly).await;
        let mut session = open(&guarded, None).await.unwrap();
        assert!(read_only(&session));
        assert_eq!(write(&mut session).await, EPERM);
        let plain = client::connect(&guarded.addr, "vol0", None).await.unwrap();
        assert!(read_only(&plain), "plaintext too");
    }

    #[tokio::test]
    async fn client_certificates_required_means_tls_required() {
        let engine = MemoryEngine::new(SIZE);
        engine.activate(Term(3)).await.unwrap();
        let certs = tempfile::tempdir().unwrap();
        certs::init(certs.path(), CLUSTER, 30, false).unwrap();
        certs::issue_node(certs.path(), NodeId(1), &[], 10).unwrap();
        let tls = Tls::load(
            TlsFiles::for_node(certs.path(), NodeId(1)),
            CLUSTER,
            Party::Node(NodeId(1)),
        )
        .unwrap();
        let transport = Transport::secured(Limits::default(), Arc::clone(&tls));
        let export = Arc::new(Export::new("vol0", "test volume", engine));
        let exports = Exports::single(export).with_tls(ExportTls {
            credentials: tls,
            required: false,
            client_auth: NbdClientAuth::Required,
            guard: transport.guard(Audience::Volume),
        });
        let mut client = connect_to(&exports);
        client.greet(CLIENT_FIXED_NEWSTYLE).await;
        client
            .send_option(OPT_GO, &info_request(b"vol0", &[]))
            .await;
        assert_eq!(client.option_reply().await.kind, REP_ERR_TLS_REQD);
        client.send_option(OPT_EXPORT_NAME, b"vol0").await;
        assert!(matches!(
            client.finish().await,
            Err(ConnectionError::TlsRequired)
        ));
    }
}
