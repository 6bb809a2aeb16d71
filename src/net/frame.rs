//! The block channel's frames: how block data moves between nodes.
//!
//! Writes, discards, flushes and reads between the writer and each replica
//! (the bulk of a node's traffic) do not go through gRPC: each would be an
//! HTTP/2 stream, a protobuf encoding and several copies. They go as
//! length-prefixed binary frames over a few long-lived connections per
//! peer ([`super::link`]), many requests in flight on each, replies
//! matched by id. The connections are the node's data listener's, inside
//! the same mutual-TLS boundary as everything else (S9); a connection says
//! which protocol it speaks by its first bytes ([`PREFACE`]).
//!
//! ## Format (version 1, all integers big-endian)
//!
//! A connection opens with the 8-byte [`PREFACE`] from the client. Then
//! both sides send frames, each a fixed 64-byte header and a payload:
//!
//! | bytes | field | |
//! |---|---|---|
//! | 0 | version | 1 |
//! | 1 | kind | [`Kind`] |
//! | 2–3 | flags | a request's [`FUA`]; a refusal's [`ErrorCode`] |
//! | 4–7 | payload length | at most [`MAX_PAYLOAD`] |
//! | 8–15 | request id | chosen by the client, echoed in the reply |
//! | 16–23 | term | the writer's term (S2) |
//! | 24–31 | generation | the writer's generation within the term |
//! | 32–39 | offset | byte offset in the volume |
//! | 40–47 | length | bytes to read, discard or mark |
//! | 48–55 | incarnation | of the replica the request is for (S8) |
//! | 56–59 | checksum | CRC32C of bytes 0–55 and then the payload |
//! | 60–63 | reserved | 0 |
//!
//! A `Hello` frame's payload names the cluster and the volume
//! (`cluster_id`, a NUL, `volume`); every request on the connection is for
//! that volume. A refusal's payload is its message in UTF-8; its figures
//! (floor, range) are in the header's number fields.
//!
//! ## What a reader of frames guarantees
//!
//! [`Header::decode`] refuses a header of another version, an unknown
//! kind, a non-zero reserved field, or a payload longer than
//! [`MAX_PAYLOAD`] before anything is read past it; [`Header::verify`]
//! refuses a payload whose checksum does not match. A frame refused either
//! way is never handed to a replica: the connection is closed, and the
//! requests in flight on it fail on the client as unavailable (the writer
//! then treats the replica as it treats a timeout; S5). Nothing here
//! panics on any input.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::ids::{GroupId, Stamp, Term};

/// What a client sends first on a block-channel connection. Not the start
/// of an HTTP/2 preface (`PRI * HTTP/2.0`), so one listener serves both.
pub const PREFACE: &[u8; 8] = b"RHABLK\x00\x01";

/// The frame format's version.
pub const VERSION: u8 = 1;

/// The header's length.
pub const HEADER_LEN: usize = 64;

/// The largest payload: a 32 MiB request (`volume::MAX_REQUEST`) with room
/// to spare for a refusal's message.
pub const MAX_PAYLOAD: u32 = 32 * 1024 * 1024 + 64 * 1024;

/// A request flag: write through to stable storage before replying.
pub const FUA: u16 = 1;

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Names the connection's cluster and volume; answered `Ok` or refused.
    Hello = 1,
    /// Write the payload at `offset`.
    Write = 2,
    /// Discard `length` bytes at `offset`.
    Discard = 3,
    /// Read `length` bytes at `offset`; the reply carries them.
    Read = 4,
    /// Make every acknowledged write durable.
    Flush = 5,
    /// Mark the extents of `length` bytes at `offset` for the writer's
    /// term ahead of its writes (S6).
    Mark = 6,
    /// A reply: done (with a read's data).
    Ok = 0x81,
    /// A reply: refused, for the [`ErrorCode`] in `flags`.
    Refused = 0x82,
}

impl Kind {
    fn of(byte: u8) -> Option<Kind> {
        Some(match byte {
            1 => Kind::Hello,
            2 => Kind::Write,
            3 => Kind::Discard,
            4 => Kind::Read,
            5 => Kind::Flush,
            6 => Kind::Mark,
            0x81 => Kind::Ok,
            0x82 => Kind::Refused,
            _ => return None,
        })
    }

    /// Whether this kind is a reply (sent by the server).
    pub fn is_reply(self) -> bool {
        matches!(self, Kind::Ok | Kind::Refused)
    }
}

/// Why a request was refused; the replica layer maps its errors to and
/// from these (see `replica::serve::blocks`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum ErrorCode {
    /// Below the fence floor: `term` is the floor.
    StaleTerm = 1,
    /// Disowned generation: `term` and `generation` are the floor.
    StaleGeneration = 2,
    /// Term 0.
    InvalidTerm = 3,
    /// Malformed or not allowed; the message says why.
    InvalidRequest = 4,
    /// Longer than allowed: `length` and `offset` (the maximum).
    TooLarge = 5,
    /// Past the end: `offset`, `length` and `generation` (the size).
    OutOfRange = 6,
    /// Another cluster, volume or incarnation.
    IdentityMismatch = 7,
    /// The replica cannot serve now.
    Unavailable = 8,
    /// The replica's disk or metadata failed.
    Io = 9,
}

impl ErrorCode {
    /// The code of `flags`; an unknown one is `Unavailable` (the replica
    /// did not refuse on purpose in a way this side understands).
    pub fn of(flags: u16) -> ErrorCode {
        match flags {
            1 => ErrorCode::StaleTerm,
            2 => ErrorCode::StaleGeneration,
            3 => ErrorCode::InvalidTerm,
            4 => ErrorCode::InvalidRequest,
            5 => ErrorCode::TooLarge,
            6 => ErrorCode::OutOfRange,
            7 => ErrorCode::IdentityMismatch,
            9 => ErrorCode::Io,
            _ => ErrorCode::Unavailable,
        }
    }
}

/// A frame's header; see the module docs for the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub kind: Kind,
    pub flags: u16,
    pub payload_len: u32,
    pub id: u64,
    /// The writer's stamp: term and generation (S2, S3). A refusal
    /// reuses the two numbers as its [`ErrorCode`] says.
    pub stamp: Stamp,
    pub offset: u64,
    pub length: u64,
    pub incarnation: u64,
    pub checksum: u32,
}

/// Why a frame was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("frame version {0}, this node speaks {VERSION}")]
    Version(u8),
    #[error("unknown frame kind {0:#x}")]
    Kind(u8),
    #[error("reserved header bytes are not zero")]
    Reserved,
    #[error("payload of {0} bytes, more than the {MAX_PAYLOAD} allowed")]
    TooLong(u32),
    #[error("checksum mismatch: header says {expected:#010x}, frame has {actual:#010x}")]
    Checksum { expected: u32, actual: u32 },
    #[error("not a block-channel connection (bad preface)")]
    Preface,
    #[error("a payload without a header to complete")]
    NoHeader,
    #[error("payload of {got} bytes where the header says {expected}")]
    Truncated { expected: u32, got: usize },
}

impl Header {
    /// A header of `kind` with every number zero.
    pub fn new(kind: Kind, id: u64) -> Self {
        Self {
            kind,
            flags: 0,
            payload_len: 0,
            id,
            stamp: Stamp::default(),
            offset: 0,
            length: 0,
            incarnation: 0,
            checksum: 0,
        }
    }

    fn put_fields(&self, out: &mut impl BufMut) {
        out.put_u8(VERSION);
        out.put_u8(self.kind as u8);
        out.put_u16(self.flags);
        out.put_u32(self.payload_len);
        for n in [
            self.id,
            self.stamp.term.0,
            self.stamp.generation,
            self.offset,
            self.length,
            self.incarnation,
        ] {
            out.put_u64(n);
        }
    }

    /// The header of a frame with `payload`: its length and checksum set.
    pub fn seal(mut self, payload: &[u8]) -> Self {
        self.payload_len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        self.checksum = self.checksum_of(payload);
        self
    }

    fn checksum_of(&self, payload: &[u8]) -> u32 {
        let mut fields = [0u8; 56];
        self.put_fields(&mut &mut fields[..]);
        crc32c::crc32c_append(crc32c::crc32c(&fields), payload)
    }

    /// The 64 bytes of this header.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        let mut buf = &mut out[..];
        self.put_fields(&mut buf);
        buf.put_u32(self.checksum);
        buf.put_u32(0);
        out
    }

    /// Reads a header; refuses one this side cannot trust the length of.
    pub fn decode(bytes: &[u8; HEADER_LEN]) -> Result<Self, FrameError> {
        let mut buf = &bytes[..];
        let version = buf.get_u8();
        if version != VERSION {
            return Err(FrameError::Version(version));
        }
        let kind = buf.get_u8();
        let kind = Kind::of(kind).ok_or(FrameError::Kind(kind))?;
        let flags = buf.get_u16();
        let payload_len = buf.get_u32();
        if payload_len > MAX_PAYLOAD {
            return Err(FrameError::TooLong(payload_len));
        }
        let header = Header {
            kind,
            flags,
            payload_len,
            id: buf.get_u64(),
            stamp: Stamp {
                term: Term(buf.get_u64()),
                generation: buf.get_u64(),
            },
            offset: buf.get_u64(),
            length: buf.get_u64(),
            incarnation: buf.get_u64(),
            checksum: buf.get_u32(),
        };
        if buf.get_u32() != 0 {
            return Err(FrameError::Reserved);
        }
        Ok(header)
    }

    /// Checks `payload` (exactly `payload_len` bytes) against the checksum.
    pub fn verify(&self, payload: &[u8]) -> Result<(), FrameError> {
        let actual = self.checksum_of(payload);
        if actual != self.checksum {
            return Err(FrameError::Checksum {
                expected: self.checksum,
                actual,
            });
        }
        Ok(())
    }
}

/// A whole frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub header: Header,
    pub payload: Bytes,
}

impl Frame {
    /// A frame of `header` and `payload`, sealed.
    pub fn new(header: Header, payload: Bytes) -> Self {
        Self {
            header: header.seal(&payload),
            payload,
        }
    }
}

/// Takes whole frames off the front of a buffer of received bytes.
#[derive(Debug, Default)]
pub struct Decoder {
    /// The header of a frame whose payload has not all arrived.
    pending: Option<Header>,
    /// A payload limit below [`MAX_PAYLOAD`], if set.
    limit: Option<u32>,
}

impl Decoder {
    /// Refuses payloads longer than `max` (at most [`MAX_PAYLOAD`]) from
    /// now on, before any of one is read: a connection not yet past its
    /// `Hello` gets little.
    pub fn limit(&mut self, max: Option<u32>) {
        self.limit = max;
    }

    /// The next whole frame of `buf`, if it holds one; `Ok(None)` asks for
    /// more bytes. The payload is split off `buf` without a copy.
    pub fn next(&mut self, buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        let header = match self.pending.take() {
            Some(header) => header,
            None => {
                let Some(bytes) = buf.get(..HEADER_LEN) else {
                    return Ok(None);
                };
                let mut fixed = [0u8; HEADER_LEN];
                fixed.copy_from_slice(bytes);
                let header = Header::decode(&fixed)?;
                if self.limit.is_some_and(|max| header.payload_len > max) {
                    return Err(FrameError::TooLong(header.payload_len));
                }
                buf.advance(HEADER_LEN);
                header
            }
        };
        let len = header.payload_len as usize;
        if buf.len() < len {
            if len < ASIDE {
                buf.reserve(len - buf.len());
            }
            self.pending = Some(header);
            return Ok(None);
        }
        let payload = buf.split_to(len).freeze();
        header.verify(&payload)?;
        Ok(Some(Frame { header, payload }))
    }

    /// The length of the payload the frame whose header was taken still
    /// waits for, if one was: a reader may receive it apart (see
    /// [`ASIDE`]) and hand it to [`Decoder::complete`].
    pub fn awaited(&self) -> Option<usize> {
        self.pending.map(|header| header.payload_len as usize)
    }

    /// The frame whose header was taken, with `payload` received apart;
    /// checked like any other.
    pub fn complete(&mut self, payload: Bytes) -> Result<Frame, FrameError> {
        let header = self.pending.take().ok_or(FrameError::NoHeader)?;
        if payload.len() != header.payload_len as usize {
            return Err(FrameError::Truncated {
                expected: header.payload_len,
                got: payload.len(),
            });
        }
        header.verify(&payload)?;
        Ok(Frame { header, payload })
    }
}

/// Payloads at least this long are best received into a buffer of their
/// own, aligned for direct I/O, rather than into the connection's buffer:
/// a replica can then write a rebuild's or a client's large write to disk
/// straight from it, and the connection's buffer never grows to hold one.
/// [`Decoder::next`] does not make room for them.
pub const ASIDE: usize = 1 << 20;

/// What a `Hello` names: the volume the connection is for, as (cluster,
/// name, Raft group). Names are reused once a volume is deleted and terms
/// of different groups are not comparable, so the group is part of the
/// volume's identity (S2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloNames<'a> {
    pub cluster_id: &'a str,
    pub volume: &'a str,
    pub group: GroupId,
}

/// A `Hello` payload: `cluster\0volume`, followed by `\0group` (in
/// decimal) for a group other than 0. Group 0's is what earlier builds
/// sent, so either side of an earlier build meets it unchanged; an earlier
/// server refuses another group's as malformed.
pub fn hello_payload(cluster_id: &str, volume: &str, group: GroupId) -> Bytes {
    let group = (group != GroupId::FIRST).then(|| group.0.to_string());
    let group_len = group.as_ref().map_or(0, |g| g.len() + 1);
    let mut out = BytesMut::with_capacity(cluster_id.len() + volume.len() + 1 + group_len);
    out.put_slice(cluster_id.as_bytes());
    out.put_u8(0);
    out.put_slice(volume.as_bytes());
    if let Some(group) = group {
        out.put_u8(0);
        out.put_slice(group.as_bytes());
    }
    out.freeze()
}

/// What a `Hello` payload names, if it is well formed: one without a group
/// (an earlier build's) names group 0.
pub fn parse_hello(payload: &[u8]) -> Option<HelloNames<'_>> {
    let text = std::str::from_utf8(payload).ok()?;
    let (cluster_id, rest) = text.split_once('\0')?;
    let (volume, group) = match rest.split_once('\0') {
        Some((volume, group)) => (volume, parse_group(group)?),
        None => (rest, GroupId::FIRST),
    };
    Some(HelloNames {
        cluster_id,
        volume,
        group,
    })
}

/// A group in decimal: digits only (no sign, no separator), within `u64`.
fn parse_group(text: &str) -> Option<GroupId> {
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok().map(GroupId)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn write_frame(id: u64, data: &[u8]) -> Frame {
        let mut header = Header::new(Kind::Write, id);
        header.stamp = Stamp {
            term: Term(7),
            generation: 2,
        };
        header.offset = 4096;
        header.incarnation = 99;
        header.flags = FUA;
        Frame::new(header, Bytes::copy_from_slice(data))
    }

    fn bytes_of(frame: &Frame) -> Vec<u8> {
        let mut out = frame.header.encode().to_vec();
        out.extend_from_slice(&frame.payload);
        out
    }

    #[test]
    fn a_frame_reads_back_as_written_in_any_split() {
        let frame = write_frame(5, b"hello block");
        let wire = bytes_of(&frame);
        for cut in 0..wire.len() {
            let mut decoder = Decoder::default();
            let mut buf = BytesMut::from(&wire[..cut]);
            assert_eq!(decoder.next(&mut buf).unwrap(), None);
            buf.extend_from_slice(&wire[cut..]);
            assert_eq!(decoder.next(&mut buf).unwrap(), Some(frame.clone()));
            assert!(buf.is_empty());
        }
    }

    #[test]
    fn the_preface_is_not_http2() {
        assert_ne!(&PREFACE[..4], b"PRI ");
    }

    fn names(cluster_id: &'static str, volume: &'static str, group: u64) -> HelloNames<'static> {
        HelloNames {
            cluster_id,
            volume,
            group: GroupId(group),
        }
    }

    #[test]
    fn hello_names_cluster_volume_and_group() {
        let payload = hello_payload("c1", "db", GroupId(2));
        assert_eq!(&payload[..], b"c1\0db\x002");
        assert_eq!(parse_hello(&payload), Some(names("c1", "db", 2)));
        let payload = hello_payload("c1", "db", GroupId(u64::MAX));
        assert_eq!(parse_hello(&payload), Some(names("c1", "db", u64::MAX)));
        assert_eq!(parse_hello(b"no separator"), None);
        assert_eq!(parse_hello(b"a\0b\0c"), None);
        assert_eq!(parse_hello(b"a\0b\0"), None);
        assert_eq!(parse_hello(b"a\0b\0+2"), None);
        assert_eq!(parse_hello(b"a\0b\0 2"), None);
        assert_eq!(parse_hello(b"a\0b\x002\x003"), None);
        assert_eq!(parse_hello(b"a\0b\x0018446744073709551616"), None);
        assert_eq!(parse_hello(&[0xff, 0, 1]), None);
    }

    /// An earlier build's `Hello` names no group: it reads as group 0's,
    /// and group 0's is the same bytes an earlier build sends and reads.
    #[test]
    fn a_hello_without_a_group_names_group_zero_and_group_zero_sends_none() {
        assert_eq!(parse_hello(b"c1\0vol0"), Some(names("c1", "vol0", 0)));
        assert_eq!(
            &hello_payload("c1", "vol0", GroupId::FIRST)[..],
            b"c1\0vol0"
        );
    }

    #[test]
    fn a_flipped_bit_anywhere_is_refused() {
        let wire = bytes_of(&write_frame(1, &[0xab; 100]));
        for byte in 0..wire.len() {
            let mut bad = wire.clone();
            bad[byte] ^= 0x10;
            let mut buf = BytesMut::from(&bad[..]);
            let got = Decoder::default().next(&mut buf);
            assert!(!matches!(got, Ok(Some(_))), "byte {byte}: {got:?}");
        }
    }

    proptest! {
        /// Any cluster, volume (no NUL) and group read back as sent, and
        /// no payload at all panics the parser.
        #[test]
        fn a_hello_reads_back_as_sent_and_garbage_never_panics(
            cluster in "[^\\x00]{0,20}",
            volume in "[^\\x00]{0,20}",
            group in any::<u64>(),
            garbage in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let payload = hello_payload(&cluster, &volume, GroupId(group));
            let names = HelloNames { cluster_id: &cluster, volume: &volume, group: GroupId(group) };
            prop_assert_eq!(parse_hello(&payload), Some(names));
            let _ = parse_hello(&garbage);
        }

        /// Garbage never panics the decoder, and whatever it accepts
        /// carries a payload whose checksum matched: the only frames that
        /// reach a replica.
        #[test]
        fn garbage_never_panics_and_nothing_unchecked_comes_out(
            chunks in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..200), 0..8)
        ) {
            let mut decoder = Decoder::default();
            let mut buf = BytesMut::new();
            for chunk in chunks {
                buf.extend_from_slice(&chunk);
                loop {
                    match decoder.next(&mut buf) {
                        Ok(Some(frame)) => prop_assert!(frame.header.verify(&frame.payload).is_ok()),
                        Ok(None) => break,
                        Err(_) => return Ok(()),
                    }
                }
            }
        }

        /// A valid frame with its payload cut short, or with a wrong
        /// checksum, is never handed out.
        #[test]
        fn truncated_or_corrupted_frames_are_never_handed_out(
            data in proptest::collection::vec(any::<u8>(), 0..512),
            cut in any::<prop::sample::Index>(),
            flip in any::<prop::sample::Index>(),
            bit in 0u8..8,
        ) {
            let wire = bytes_of(&write_frame(3, &data));
            let cut = cut.index(wire.len());
            let mut buf = BytesMut::from(&wire[..cut]);
            prop_assert_eq!(Decoder::default().next(&mut buf), Ok(None));
            let mut bad = wire.clone();
            bad[flip.index(wire.len())] ^= 1 << bit;
            let mut buf = BytesMut::from(&bad[..]);
            let got = Decoder::default().next(&mut buf);
            prop_assert!(!matches!(got, Ok(Some(_))), "{:?}", got);
        }
    }
}
