//! The NBD wire format: constants, and pure parsers and encoders for the
//! messages this server reads and writes, and for those `attach`'s client
//! side writes and reads (see [`super::client`]).
//!
//! Numbers follow the NBD protocol document (`doc/proto.md` of the NBD
//! project). Everything is big-endian. Parsers take byte slices and return
//! a typed value or a [`WireError`]; they never panic on any input, which the
//! fuzz-style tests in [`super`] check.

use bytes::{BufMut, Bytes, BytesMut};

/// `NBDMAGIC`: the first 8 bytes a server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: the newstyle greeting and the start of every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// The magic that starts every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// The magic that starts every request in the transmission phase.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// The magic that starts every simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

/// Handshake flags the server sends.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags.
pub const CLIENT_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const CLIENT_NO_ZEROES: u32 = 1 << 1;

/// Option numbers.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
const REP_ERROR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERROR | 1;
/// The server's policy forbids the option to this client.
pub const REP_ERR_POLICY: u32 = REP_ERROR | 2;
pub const REP_ERR_INVALID: u32 = REP_ERROR | 3;
pub const REP_ERR_UNKNOWN: u32 = REP_ERROR | 6;
pub const REP_ERR_TLS_REQD: u32 = REP_ERROR | 5;

/// Information types in `NBD_REP_INFO`.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

/// Command flags this server understands.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// On `WRITE_ZEROES`: fail with `ENOTSUP` at once rather than zero slowly.
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;
const KNOWN_CMD_FLAGS: u16 =
    CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_REQ_ONE | CMD_FLAG_FAST_ZERO;

/// Structured replies (`NBD_OPT_STRUCTURED_REPLY`).
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;

/// The one metadata context served, and its id on this server.
pub const BASE_ALLOCATION: &str = "base:allocation";
pub const BASE_ALLOCATION_ID: u32 = 1;
/// `base:allocation` block states.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// Error values in replies (errno numbers fixed by the protocol).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// The size of a request header.
pub const REQUEST_LEN: usize = 28;

/// A message that cannot be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// A magic number is wrong; the stream cannot be trusted further.
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    /// A field is inconsistent with the message length.
    #[error("malformed {what}")]
    Malformed { what: &'static str },
}

/// `NBD_OPT_INFO` / `NBD_OPT_GO` data: the export name and the information
/// types the client asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: Vec<u8>,
    pub infos: Vec<u16>,
}

/// Parses the data of an `NBD_OPT_INFO` or `NBD_OPT_GO` option: a 32-bit
/// name length, the name, a 16-bit count and that many 16-bit info types,
/// with nothing after them.
pub fn parse_info_request(data: &[u8]) -> Result<InfoRequest, WireError> {
    let malformed = WireError::Malformed {
        what: "NBD_OPT_INFO/GO data",
    };
    let (len, rest) = split_u32(data).ok_or(malformed.clone())?;
    let len = usize::try_from(len).map_err(|_| malformed.clone())?;
    if rest.len() < len {
        return Err(malformed);
    }
    let (name, rest) = rest.split_at(len);
    let (count, rest) = split_u16(rest).ok_or(malformed.clone())?;
    if rest.len() != usize::from(count) * 2 {
        return Err(malformed);
    }
    let infos = rest
        .chunks_exact(2)
        .map(|pair| u16::from_be_bytes([pair[0], pair[1]]))
        .collect();
    Ok(InfoRequest {
        name: name.to_vec(),
        infos,
    })
}

/// An option header: the option number and the length of its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub len: u32,
}

/// Parses the 16-byte header of a client option.
pub fn parse_option_header(buf: &[u8; 16]) -> Result<OptionHeader, WireError> {
    let magic = u64::from_be_bytes(array(&buf[0..8]));
    if magic != IHAVEOPT {
        return Err(WireError::BadMagic(magic));
    }
    Ok(OptionHeader {
        option: u32::from_be_bytes(array(&buf[8..12])),
        len: u32::from_be_bytes(array(&buf[12..16])),
    })
}

/// A command in the transmission phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    Read,
    Write,
    Disconnect,
    Flush,
    Trim,
    /// A hint to have the range ready for reading soon.
    Cache,
    WriteZeroes,
    /// Which parts of a range hold data (`base:allocation`).
    BlockStatus,
    /// A command this server does not implement.
    Other(u16),
}

impl Command {
    /// The command's type number on the wire.
    pub fn to_type(self) -> u16 {
        match self {
            Command::Read => 0,
            Command::Write => 1,
            Command::Disconnect => 2,
            Command::Flush => 3,
            Command::Trim => 4,
            Command::Cache => 5,
            Command::WriteZeroes => 6,
            Command::BlockStatus => 7,
            Command::Other(kind) => kind,
        }
    }

    fn from_type(kind: u16) -> Self {
        match kind {
            0 => Command::Read,
            1 => Command::Write,
            2 => Command::Disconnect,
            3 => Command::Flush,
            4 => Command::Trim,
            5 => Command::Cache,
            6 => Command::WriteZeroes,
            7 => Command::BlockStatus,
            other => Command::Other(other),
        }
    }

    /// Whether the command changes the volume's contents.
    pub fn mutates(self) -> bool {
        matches!(self, Command::Write | Command::Trim | Command::WriteZeroes)
    }
}

/// A request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: Command,
    pub cookie: u64,
    pub offset: u64,
    pub len: u32,
}

impl Request {
    /// Whether the FUA flag is set.
    pub fn fua(&self) -> bool {
        self.flags & CMD_FLAG_FUA != 0
    }

    /// Whether the client asks for zeroes only if they are fast.
    pub fn fast_zero(&self) -> bool {
        self.flags & CMD_FLAG_FAST_ZERO != 0
    }

    /// Whether the client allows a hole where it asks for zeroes (no
    /// `NO_HOLE` flag).
    pub fn may_punch(&self) -> bool {
        self.flags & CMD_FLAG_NO_HOLE == 0
    }

    /// Whether the request carries flags this server does not know.
    pub fn has_unknown_flags(&self) -> bool {
        self.flags & !KNOWN_CMD_FLAGS != 0
    }

    /// How many payload bytes follow the header on the wire.
    pub fn payload_len(&self) -> u32 {
        match self.command {
            Command::Write => self.len,
            _ => 0,
        }
    }
}

/// `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT` data: the
/// export name and the context queries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest {
    pub name: Vec<u8>,
    pub queries: Vec<Vec<u8>>,
}

/// Parses the data of a meta context option: a 32-bit name length, the
/// name, a 32-bit query count, and each query as a 32-bit length and its
/// bytes. Anything short, long or left over is malformed.
pub fn parse_meta_context_request(data: &[u8]) -> Result<MetaContextRequest, WireError> {
    let malformed = || WireError::Malformed {
        what: "NBD_OPT_*_META_CONTEXT data",
    };
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], WireError> {
        let end = at
            .checked_add(n)
            .filter(|end| *end <= data.len())
            .ok_or_else(malformed)?;
        let bytes = &data[at..end];
        at = end;
        Ok(bytes)
    };
    let name_len = u32::from_be_bytes(array(take(4)?)) as usize;
    let name = take(name_len)?.to_vec();
    let count = u32::from_be_bytes(array(take(4)?)) as usize;
    let mut queries = Vec::new();
    for _ in 0..count {
        let len = u32::from_be_bytes(array(take(4)?)) as usize;
        queries.push(take(len)?.to_vec());
    }
    if at != data.len() {
        return Err(malformed());
    }
    Ok(MetaContextRequest { name, queries })
}

/// The data of a meta context option, as a client sends it.
pub fn meta_context_data(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut data = Vec::new();
    data.extend_from_slice(&(name.len() as u32).to_be_bytes());
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for query in queries {
        data.extend_from_slice(&(query.len() as u32).to_be_bytes());
        data.extend_from_slice(query.as_bytes());
    }
    data
}

/// An `NBD_REP_META_CONTEXT` body: the context's id and name.
pub fn meta_context(id: u32, name: &str) -> Vec<u8> {
    let mut body = id.to_be_bytes().to_vec();
    body.extend_from_slice(name.as_bytes());
    body
}

/// A structured reply chunk's header; `len` bytes of payload follow.
pub fn chunk_header(flags: u16, kind: u16, cookie: u64, len: u32) -> [u8; 20] {
    let mut buf = [0u8; 20];
    buf[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    buf[4..6].copy_from_slice(&flags.to_be_bytes());
    buf[6..8].copy_from_slice(&kind.to_be_bytes());
    buf[8..16].copy_from_slice(&cookie.to_be_bytes());
    buf[16..20].copy_from_slice(&len.to_be_bytes());
    buf
}

/// The one chunk of a structured reply with nothing to carry (a read of
/// length 0: an `OFFSET_DATA` chunk must carry at least one byte).
pub fn none_chunk(cookie: u64) -> [u8; 20] {
    chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, 0)
}

/// The final chunk of a structured reply that failed with `error`.
pub fn error_chunk(error: u32, cookie: u64) -> Vec<u8> {
    let mut chunk = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, 6).to_vec();
    chunk.extend_from_slice(&error.to_be_bytes());
    chunk.extend_from_slice(&0u16.to_be_bytes());
    chunk
}

/// The header and offset of an `OFFSET_DATA` chunk of a read: `len` bytes
/// at `offset` follow. `done` on the read's last chunk.
pub fn data_chunk_head(cookie: u64, offset: u64, len: usize, done: bool) -> Vec<u8> {
    let flags = if done { REPLY_FLAG_DONE } else { 0 };
    let mut chunk = chunk_header(flags, REPLY_TYPE_OFFSET_DATA, cookie, 8 + len as u32).to_vec();
    chunk.extend_from_slice(&offset.to_be_bytes());
    chunk
}

/// An `OFFSET_HOLE` chunk of a read: `len` bytes at `offset` read as
/// zeroes, and none are sent. `done` on the read's last chunk.
pub fn hole_chunk(cookie: u64, offset: u64, len: u32, done: bool) -> Vec<u8> {
    let flags = if done { REPLY_FLAG_DONE } else { 0 };
    let mut chunk = chunk_header(flags, REPLY_TYPE_OFFSET_HOLE, cookie, 12).to_vec();
    chunk.extend_from_slice(&offset.to_be_bytes());
    chunk.extend_from_slice(&len.to_be_bytes());
    chunk
}

/// The one `BLOCK_STATUS` chunk for context `id`: each `(length, flags)`.
pub fn block_status_chunk(cookie: u64, id: u32, extents: &[(u32, u32)]) -> Vec<u8> {
    let len = 4 + 8 * extents.len() as u32;
    let mut chunk = chunk_header(REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, cookie, len).to_vec();
    chunk.extend_from_slice(&id.to_be_bytes());
    for (length, flags) in extents {
        chunk.extend_from_slice(&length.to_be_bytes());
        chunk.extend_from_slice(&flags.to_be_bytes());
    }
    chunk
}

/// Parses a request header.
pub fn parse_request(buf: &[u8; REQUEST_LEN]) -> Result<Request, WireError> {
    let magic = u32::from_be_bytes(array(&buf[0..4]));
    if magic != REQUEST_MAGIC {
        return Err(WireError::BadMagic(u64::from(magic)));
    }
    Ok(Request {
        flags: u16::from_be_bytes(array(&buf[4..6])),
        command: Command::from_type(u16::from_be_bytes(array(&buf[6..8]))),
        cookie: u64::from_be_bytes(array(&buf[8..16])),
        offset: u64::from_be_bytes(array(&buf[16..24])),
        len: u32::from_be_bytes(array(&buf[24..28])),
    })
}

/// A request header, as a client sends it.
pub fn request(request: &Request) -> [u8; REQUEST_LEN] {
    let mut buf = [0u8; REQUEST_LEN];
    buf[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    buf[4..6].copy_from_slice(&request.flags.to_be_bytes());
    buf[6..8].copy_from_slice(&request.command.to_type().to_be_bytes());
    buf[8..16].copy_from_slice(&request.cookie.to_be_bytes());
    buf[16..24].copy_from_slice(&request.offset.to_be_bytes());
    buf[24..28].copy_from_slice(&request.len.to_be_bytes());
    buf
}

/// A simple reply's header, as a client reads it: `(error, cookie)`.
pub fn parse_simple_reply(buf: &[u8; 16]) -> Result<(u32, u64), WireError> {
    let magic = u32::from_be_bytes(array(&buf[0..4]));
    if magic != SIMPLE_REPLY_MAGIC {
        return Err(WireError::BadMagic(u64::from(magic)));
    }
    Ok((
        u32::from_be_bytes(array(&buf[4..8])),
        u64::from_be_bytes(array(&buf[8..16])),
    ))
}

/// The server's greeting, as a client reads it: its handshake flags.
pub fn parse_greeting(buf: &[u8; 18]) -> Result<u16, WireError> {
    let magic = u64::from_be_bytes(array(&buf[0..8]));
    if magic != NBD_MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let newstyle = u64::from_be_bytes(array(&buf[8..16]));
    if newstyle != IHAVEOPT {
        return Err(WireError::BadMagic(newstyle));
    }
    Ok(u16::from_be_bytes(array(&buf[16..18])))
}

/// An option, as a client sends it.
pub fn option(option: u32, data: &[u8]) -> Bytes {
    let mut buf = BytesMut::with_capacity(16 + data.len());
    buf.put_u64(IHAVEOPT);
    buf.put_u32(option);
    buf.put_u32(u32::try_from(data.len()).unwrap_or(u32::MAX));
    buf.put_slice(data);
    buf.freeze()
}

/// The data of an `NBD_OPT_GO` for export `name`, asking for no extra
/// information.
pub fn go_data(name: &str) -> Vec<u8> {
    let mut data = Vec::with_capacity(6 + name.len());
    data.extend_from_slice(&u32::try_from(name.len()).unwrap_or(u32::MAX).to_be_bytes());
    data.extend_from_slice(name.as_bytes());
    data.extend_from_slice(&0u16.to_be_bytes());
    data
}

/// An option reply's header, as a client reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    pub option: u32,
    pub kind: u32,
    pub len: u32,
}

impl OptionReplyHeader {
    /// Whether the reply is an error (`NBD_REP_ERR_*`).
    pub fn is_error(&self) -> bool {
        self.kind & REP_ERROR != 0
    }
}

/// Parses an option reply's header.
pub fn parse_option_reply(buf: &[u8; 20]) -> Result<OptionReplyHeader, WireError> {
    let magic = u64::from_be_bytes(array(&buf[0..8]));
    if magic != OPTION_REPLY_MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    Ok(OptionReplyHeader {
        option: u32::from_be_bytes(array(&buf[8..12])),
        kind: u32::from_be_bytes(array(&buf[12..16])),
        len: u32::from_be_bytes(array(&buf[16..20])),
    })
}

/// The body of `NBD_INFO_EXPORT`, as a client reads it: `(size, flags)`;
/// `None` for another information type or a short body.
pub fn parse_info_export(data: &[u8]) -> Option<(u64, u16)> {
    let (kind, rest) = split_u16(data)?;
    if kind != INFO_EXPORT || rest.len() < 10 {
        return None;
    }
    Some((
        u64::from_be_bytes(array(&rest[0..8])),
        u16::from_be_bytes(array(&rest[8..10])),
    ))
}

/// The server's greeting.
pub fn greeting() -> Bytes {
    let mut buf = BytesMut::with_capacity(18);
    buf.put_u64(NBD_MAGIC);
    buf.put_u64(IHAVEOPT);
    buf.put_u16(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
    buf.freeze()
}

/// An option reply.
pub fn option_reply(option: u32, kind: u32, data: &[u8]) -> Bytes {
    let mut buf = BytesMut::with_capacity(20 + data.len());
    buf.put_u64(OPTION_REPLY_MAGIC);
    buf.put_u32(option);
    buf.put_u32(kind);
    buf.put_u32(u32::try_from(data.len()).unwrap_or(u32::MAX));
    buf.put_slice(data);
    buf.freeze()
}

/// The body of `NBD_INFO_EXPORT`: the size and the transmission flags.
pub fn info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut buf = Vec::with_capacity(12);
    buf.put_u16(INFO_EXPORT);
    buf.put_u64(size);
    buf.put_u16(flags);
    buf
}

/// The body of `NBD_INFO_BLOCK_SIZE`.
pub fn info_block_size(minimum: u32, preferred: u32, maximum: u32) -> Vec<u8> {
    let mut buf = Vec::with_capacity(14);
    buf.put_u16(INFO_BLOCK_SIZE);
    buf.put_u32(minimum);
    buf.put_u32(preferred);
    buf.put_u32(maximum);
    buf
}

/// The body of `NBD_INFO_NAME` or `NBD_INFO_DESCRIPTION`.
pub fn info_text(kind: u16, text: &str) -> Vec<u8> {
    let mut buf = Vec::with_capacity(2 + text.len());
    buf.put_u16(kind);
    buf.put_slice(text.as_bytes());
    buf
}

/// The body of `NBD_REP_SERVER` naming one export: its name, then its
/// description (the protocol's "implementation-specific details", which
/// clients such as qemu's show as the description).
pub fn server_entry(name: &str, description: &str) -> Vec<u8> {
    let mut buf = Vec::with_capacity(4 + name.len() + description.len());
    buf.put_u32(u32::try_from(name.len()).unwrap_or(u32::MAX));
    buf.put_slice(name.as_bytes());
    buf.put_slice(description.as_bytes());
    buf
}

/// The reply to `NBD_OPT_EXPORT_NAME`: size, flags and, unless the client
/// asked for none, 124 zero bytes.
pub fn export_name_reply(size: u64, flags: u16, no_zeroes: bool) -> Bytes {
    let mut buf = BytesMut::with_capacity(134);
    buf.put_u64(size);
    buf.put_u16(flags);
    if !no_zeroes {
        buf.put_bytes(0, 124);
    }
    buf.freeze()
}

/// The header of a simple reply (read data, if any, follows it).
pub fn simple_reply(error: u32, cookie: u64) -> [u8; 16] {
    let mut buf = [0u8; 16];
    buf[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    buf[4..8].copy_from_slice(&error.to_be_bytes());
    buf[8..16].copy_from_slice(&cookie.to_be_bytes());
    buf
}

fn split_u32(data: &[u8]) -> Option<(u32, &[u8])> {
    let (head, rest) = data.split_at_checked(4)?;
    Some((u32::from_be_bytes(array(head)), rest))
}

fn split_u16(data: &[u8]) -> Option<(u16, &[u8])> {
    let (head, rest) = data.split_at_checked(2)?;
    Some((u16::from_be_bytes(array(head)), rest))
}

/// A fixed-size array from a slice of exactly that length (callers slice it
/// to size, so the fallback of zeroes is unreachable).
fn array<const N: usize>(slice: &[u8]) -> [u8; N] {
    slice.try_into().unwrap_or([0; N])
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn info_data(name: &[u8], infos: &[u16]) -> Vec<u8> {
        let mut buf = Vec::new();
        buf.put_u32(name.len() as u32);
        buf.put_slice(name);
        buf.put_u16(infos.len() as u16);
        for info in infos {
            buf.put_u16(*info);
        }
        buf
    }

    #[test]
    fn info_requests_round_trip() {
        let data = info_data(b"vol0", &[INFO_BLOCK_SIZE, INFO_NAME]);
        assert_eq!(
            parse_info_request(&data),
            Ok(InfoRequest {
                name: b"vol0".to_vec(),
                infos: vec![INFO_BLOCK_SIZE, INFO_NAME]
            })
        );
        assert_eq!(
            parse_info_request(&info_data(b"", &[])),
            Ok(InfoRequest {
                name: vec![],
                infos: vec![]
            })
        );
    }

    #[test]
    fn inconsistent_info_requests_are_malformed() {
        let good = info_data(b"vol0", &[INFO_NAME]);
        for bad in [
            &good[..3],                      // no name length
            &good[..good.len() - 1],         // a truncated info type
            &[0xff, 0xff, 0xff, 0xff, 0, 0], // a name longer than the data
            &[0, 0, 0, 0, 0, 1],             // one info announced, none sent
            &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0], // trailing bytes
        ] {
            assert!(parse_info_request(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn requests_parse_and_bad_magic_is_refused() {
        let mut buf = [0u8; REQUEST_LEN];
        buf[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        buf[4..6].copy_from_slice(&CMD_FLAG_FUA.to_be_bytes());
        buf[6..8].copy_from_slice(&1u16.to_be_bytes());
        buf[8..16].copy_from_slice(&7u64.to_be_bytes());
        buf[16..24].copy_from_slice(&4096u64.to_be_bytes());
        buf[24..28].copy_from_slice(&512u32.to_be_bytes());
        let request = parse_request(&buf).unwrap();
        assert_eq!(request.command, Command::Write);
        assert!(request.fua() && !request.has_unknown_flags());
        assert_eq!(
            (request.cookie, request.offset, request.len),
            (7, 4096, 512)
        );
        assert_eq!(request.payload_len(), 512);
        buf[0] ^= 1;
        assert!(matches!(parse_request(&buf), Err(WireError::BadMagic(_))));
    }

    proptest! {
        #[test]
        fn parsers_never_panic(data in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = parse_info_request(&data);
            let _ = parse_meta_context_request(&data);
            if let Ok(buf) = <[u8; REQUEST_LEN]>::try_from(&data[..data.len().min(REQUEST_LEN)]) {
                let _ = parse_request(&buf);
            }
            if let Ok(buf) = <[u8; 16]>::try_from(&data[..data.len().min(16)]) {
                let _ = parse_option_header(&buf);
            }
        }

        #[test]
        fn well_formed_meta_context_requests_parse_and_cut_ones_do_not(
            name in "[a-z0-9]{0,12}",
            queries in proptest::collection::vec("[a-z:]{0,20}", 0..5),
            cut in 1usize..8,
        ) {
            let refs: Vec<&str> = queries.iter().map(String::as_str).collect();
            let data = meta_context_data(&name, &refs);
            let parsed = parse_meta_context_request(&data).unwrap();
            prop_assert_eq!(parsed.name, name.as_bytes().to_vec());
            let want: Vec<Vec<u8>> = queries.iter().map(|q| q.as_bytes().to_vec()).collect();
            prop_assert_eq!(parsed.queries, want);
            prop_assert!(parse_meta_context_request(&data[..data.len().saturating_sub(cut)]).is_err());
            let mut longer = data.clone();
            longer.push(0);
            prop_assert!(parse_meta_context_request(&longer).is_err());
        }

        #[test]
        fn well_formed_info_requests_parse(name in proptest::collection::vec(any::<u8>(), 0..40),
                                           infos in proptest::collection::vec(any::<u16>(), 0..8)) {
            let parsed = parse_info_request(&info_data(&name, &infos)).unwrap();
            prop_assert_eq!(parsed, InfoRequest { name, infos });
        }
    }
}
