//! The client side of NBD, for `replica-ha attach`: the fixed-newstyle
//! handshake as a client (upgraded with `NBD_OPT_STARTTLS` when given TLS),
//! then requests out and simple replies in, matched by cookie.
//!
//! Only what `attach` needs: `NBD_OPT_GO` for one export, simple replies,
//! the commands READ, WRITE, FLUSH, TRIM, WRITE_ZEROES and DISC. Anything
//! the server sends that does not parse ends the connection with a
//! [`ClientError`]; nothing from the server can make it panic.
//!
//! Nothing here waits on the server without a bound: the TCP connect and
//! the handshake (greeting, options, TLS) each have a deadline, so a
//! server that accepts and then says nothing (a SIGSTOPped process, whose
//! kernel still completes the TCP handshake) costs `attach` seconds, not
//! forever (design C3).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;

use super::wire::{self, Command, Request, WireError};

/// A connection, plain or TLS.
pub trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// How long the TCP connect may take. A live node on the LAN accepts
/// within milliseconds; a refused or unroutable address fails at once or
/// never, so a second only decides the latter case, and stays well inside
/// the election time that a replacement writer needs anyway.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// How long the handshake may take once connected: greeting, options,
/// the TLS upgrade and the export's info. A live node answers each step
/// at once (a TLS handshake is a few milliseconds); a frozen one never
/// does. Two seconds leave a loaded node room, and are still short
/// against `attach`'s suspend timeout (120 s by default).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

/// The longest option reply read (export names are at most 4 KiB).
const MAX_OPTION_REPLY: u32 = 64 * 1024;

/// Why a connection to a server failed or ended.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("protocol: {0}")]
    Protocol(#[from] WireError),
    #[error("the server is not fixed-newstyle (flags {0:#x})")]
    OldStyle(u16),
    #[error("the server refused {what}: {why}")]
    Refused { what: &'static str, why: String },
    #[error("the server sent no size for the export")]
    NoSize,
    #[error("TLS: {0}")]
    Tls(String),
    #[error("no {what} within {limit:?}")]
    TimedOut { what: &'static str, limit: Duration },
}

/// What the server said of the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExportInfo {
    pub size: u64,
    pub flags: u16,
}

/// A connection past the handshake, ready for requests.
pub struct Connection {
    pub reader: ReadHalf<Box<dyn Io>>,
    pub writer: WriteHalf<Box<dyn Io>>,
    pub export: ExportInfo,
}

/// What a TLS connection needs: the client's configuration and the name
/// the server's certificate must carry.
pub type ClientTls = (
    Arc<rustls::ClientConfig>,
    rustls::pki_types::ServerName<'static>,
);

/// Connects to `addr` and opens `export`; with `tls`, upgrades first and
/// refuses to go on in plaintext. Fails with [`ClientError::TimedOut`]
/// when the connect takes longer than [`CONNECT_TIMEOUT`] or the
/// handshake longer than [`HANDSHAKE_TIMEOUT`].
pub async fn connect(
    addr: &str,
    export: &str,
    tls: Option<ClientTls>,
) -> Result<Connection, ClientError> {
    let tcp = within(CONNECT_TIMEOUT, "TCP connection", TcpStream::connect(addr)).await??;
    tcp.set_nodelay(true)?;
    within(
        HANDSHAKE_TIMEOUT,
        "NBD handshake",
        handshake(Box::new(tcp), export, tls),
    )
    .await?
}

/// Runs `work` for at most `limit`; `what` names it in the error.
pub async fn within<T>(
    limit: Duration,
    what: &'static str,
    work: impl std::future::Future<Output = T>,
) -> Result<T, ClientError> {
    tokio::time::timeout(limit, work)
        .await
        .map_err(|_| ClientError::TimedOut { what, limit })
}

/// The handshake on a connected stream, from the greeting to the
/// export's info.
async fn handshake(
    mut stream: Box<dyn Io>,
    export: &str,
    tls: Option<ClientTls>,
) -> Result<Connection, ClientError> {
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).await?;
    let flags = wire::parse_greeting(&greeting)?;
    if flags & wire::FLAG_FIXED_NEWSTYLE == 0 {
        return Err(ClientError::OldStyle(flags));
    }
    let no_zeroes = flags & wire::FLAG_NO_ZEROES != 0;
    let mut client_flags = wire::CLIENT_FIXED_NEWSTYLE;
    if no_zeroes {
        client_flags |= wire::CLIENT_NO_ZEROES;
    }
    stream.write_all(&client_flags.to_be_bytes()).await?;
    if let Some((config, name)) = tls {
        stream
            .write_all(&wire::option(wire::OPT_STARTTLS, &[]))
            .await?;
        stream.flush().await?;
        let (header, data) = read_option_reply(&mut stream).await?;
        if header.kind != wire::REP_ACK {
            return Err(ClientError::Refused {
                what: "STARTTLS",
                why: String::from_utf8_lossy(&data).into_owned(),
            });
        }
        let secured = tokio_rustls::TlsConnector::from(config)
            .connect(name, stream)
            .await
            .map_err(|err| ClientError::Tls(err.to_string()))?;
        stream = Box::new(secured);
    }
    stream
        .write_all(&wire::option(wire::OPT_GO, &wire::go_data(export)))
        .await?;
    stream.flush().await?;
    let mut info = None;
    loop {
        let (header, data) = read_option_reply(&mut stream).await?;
        if header.is_error() {
            return Err(ClientError::Refused {
                what: "the export",
                why: String::from_utf8_lossy(&data).into_owned(),
            });
        }
        match header.kind {
            wire::REP_INFO => {
                if let Some((size, flags)) = wire::parse_info_export(&data) {
                    info = Some(ExportInfo { size, flags });
                }
            }
            wire::REP_ACK => break,
            _ => {}
        }
    }
    let export = info.ok_or(ClientError::NoSize)?;
    let (reader, writer) = tokio::io::split(stream);
    Ok(Connection {
        reader,
        writer,
        export,
    })
}

async fn read_option_reply(
    stream: &mut Box<dyn Io>,
) -> Result<(wire::OptionReplyHeader, Vec<u8>), ClientError> {
    let mut header = [0u8; 20];
    stream.read_exact(&mut header).await?;
    let header = wire::parse_option_reply(&header)?;
    if header.len > MAX_OPTION_REPLY {
        return Err(WireError::Malformed {
            what: "option reply longer than 64 KiB",
        }
        .into());
    }
    let mut data = vec![0; header.len as usize];
    stream.read_exact(&mut data).await?;
    Ok((header, data))
}

/// Sends one request (and a write's payload).
pub async fn send(
    writer: &mut WriteHalf<Box<dyn Io>>,
    request: &Request,
    payload: Option<&Bytes>,
) -> Result<(), ClientError> {
    writer.write_all(&wire::request(request)).await?;
    if let (Command::Write, Some(payload)) = (request.command, payload) {
        writer.write_all(payload).await?;
    }
    Ok(())
}

/// Reads one simple reply's header: `(error, cookie)`. A read's data
/// follows it; the caller knows how long it is.
pub async fn receive(reader: &mut ReadHalf<Box<dyn Io>>) -> Result<(u32, u64), ClientError> {
    let mut header = [0u8; 16];
    reader.read_exact(&mut header).await?;
    Ok(wire::parse_simple_reply(&header)?)
}
