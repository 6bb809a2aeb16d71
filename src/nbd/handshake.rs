//! The fixed-newstyle handshake: greeting, client flags, and option
//! haggling until the client picks an export (`GO` or `EXPORT_NAME`) or
//! gives up (`ABORT`, or closing the socket).
//!
//! Options served: `EXPORT_NAME`, `ABORT`, `LIST`, `INFO`, `GO`,
//! `STRUCTURED_REPLY`, `LIST_META_CONTEXT` and `SET_META_CONTEXT` (the one
//! context `base:allocation`, for `NBD_CMD_BLOCK_STATUS`; setting one needs
//! structured replies first, and a `GO` for another export than the one it
//! was set for drops it), and `STARTTLS` when the listener has TLS. Every
//! other option gets `NBD_REP_ERR_UNSUP`. What was negotiated before
//! `STARTTLS` is forgotten inside TLS, as the protocol asks. Malformed
//! option data gets `NBD_REP_ERR_INVALID`; a bad magic, unknown client
//! flags or an option longer than [`MAX_OPTION_LEN`] end the connection,
//! since the stream can no longer be trusted.
//!
//! **TLS** (`nbd_tls`), as the NBD protocol has it: `STARTTLS` is answered
//! with `NBD_REP_ACK`, the TLS handshake follows on the same connection,
//! and option haggling starts again inside it (a second `STARTTLS` is
//! invalid). Where TLS is required, every option before it but `STARTTLS`
//! and `ABORT` gets `NBD_REP_ERR_TLS_REQD`, and `EXPORT_NAME`, which has no
//! error reply, closes the connection: nothing about the export, not even
//! its name, is told in plaintext (TLS is required, too, where client
//! certificates are: a plaintext client has none).
//!
//! **Who may use it** (S9) is settled first, by the client's certificate
//! ([`Admission::grant`](super::Admission)), the same for every export: a
//! client whose certificate may not use them (it names nobody of this
//! cluster, or a node that is not a member) gets `NBD_REP_ERR_POLICY` with
//! the reason for every option but `ABORT`, and `EXPORT_NAME` closes the
//! connection; one whose role only reads (a viewer) is offered every
//! export read-only even on the writer.
//!
//! **Which export** is looked up by the name each option carries, at that
//! moment, in the listener's registry ([`Exports`]; the empty name is its
//! default export). A name it does not hold is refused with
//! `NBD_REP_ERR_UNKNOWN` and the registry's words for it (which nodes hold
//! that volume, when the node knows), and `EXPORT_NAME` closes the
//! connection.
//!
//! The export is offered as its device grants it at that moment
//! ([`crate::volume::Access`]): read-write under the gate's term, which the
//! session is then bound to; read-only; or not at all, when this node's
//! copy may not be read (a passive node outside the committed in-sync set).
//! That last refusal is `NBD_REP_ERR_UNKNOWN` ("export not available") with
//! the reason as text for `GO` and `INFO`, and a closed connection for
//! `EXPORT_NAME`, which has no error reply. A client is told at once, in
//! words, instead of opening an export whose every read fails.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::wire::{self, WireError};
use std::sync::Arc;

use super::{Client, ConnectionError, Export, Exports, Grant};
use crate::ids::Term;
use crate::volume::{Access, Device};

/// The longest option data accepted (the protocol caps export names at
/// 4 KiB; this leaves room for info requests).
pub const MAX_OPTION_LEN: u32 = 64 * 1024;

/// What the handshake settled for the transmission phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Session {
    /// The transmission flags sent to the client.
    pub flags: u16,
    /// For a writable session, the gate's term it was opened under: the
    /// session lasts only while the device grants exactly that term.
    pub term: Option<Term>,
    /// Structured replies were negotiated: reads and block status are
    /// answered in chunks.
    pub structured: bool,
    /// The id of `base:allocation`, when the client selected it.
    pub allocation: Option<u32>,
}

impl Session {
    /// Whether the client was offered a writable export.
    pub fn writable(&self) -> bool {
        self.flags & wire::TFLAG_READ_ONLY == 0
    }

    /// Whether the session may still be served: always for a read-only
    /// one, and for a writable one while `device` grants its term.
    pub fn open(&self, device: &dyn Device) -> bool {
        match self.term {
            None => true,
            Some(term) => device.access() == Access::ReadWrite { term },
        }
    }
}

/// Where a handshake stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// A new connection: greet, read the client's flags.
    Fresh,
    /// Inside TLS after `STARTTLS`: options again, with the flags the
    /// client sent before.
    Secured { no_zeroes: bool },
}

/// How one round of option haggling ended.
#[derive(Debug)]
pub enum Step {
    /// The client picked this export.
    Session(Arc<Export>, Session),
    /// The client gave up (`ABORT`).
    Aborted,
    /// The client asked for TLS and was told yes: do the TLS handshake as
    /// the server, then negotiate again in [`Phase::Secured`].
    StartTls { no_zeroes: bool },
}

/// Runs the handshake over `stream`, for `client`, up to a session on one
/// of `exports`, an abort, or an upgrade to TLS.
pub async fn negotiate<S>(
    stream: &mut S,
    exports: &Exports,
    phase: Phase,
    client: &Client,
) -> Result<Step, ConnectionError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let no_zeroes = match phase {
        Phase::Secured { no_zeroes } => no_zeroes,
        Phase::Fresh => greet(stream).await?,
    };
    let secured = matches!(phase, Phase::Secured { .. });
    let admission = exports.admission();
    let mut haggle = Haggle {
        stream,
        exports,
        no_zeroes,
        secured,
        structured: false,
        allocation: None,
    };
    let tls_required = admission.tls_required() && !secured;
    loop {
        let (option, data) = read_option(haggle.stream).await?;
        if tls_required && !matches!(option, wire::OPT_STARTTLS | wire::OPT_ABORT) {
            if option == wire::OPT_EXPORT_NAME {
                return Err(ConnectionError::TlsRequired);
            }
            let why = b"TLS is required: send NBD_OPT_STARTTLS first";
            haggle.reply(option, wire::REP_ERR_TLS_REQD, why).await?;
            continue;
        }
        if option == wire::OPT_ABORT {
            // The client may already be gone; the ACK is a courtesy.
            let _ = haggle.reply(option, wire::REP_ACK, &[]).await;
            return Ok(Step::Aborted);
        }
        let grant = match admission.grant(client) {
            Ok(grant) => grant,
            Err(why) if option == wire::OPT_EXPORT_NAME => {
                return Err(ConnectionError::Refused(why));
            }
            Err(why) => {
                tracing::info!(%why, "NBD client refused");
                haggle
                    .reply(option, wire::REP_ERR_POLICY, why.as_bytes())
                    .await?;
                continue;
            }
        };
        let has_tls = admission.has_tls();
        if let Some(step) = haggle.option(option, &data, grant, has_tls).await? {
            return Ok(step);
        }
    }
}

/// Greets a new client and reads its flags: whether it asked for no
/// zeroes after `EXPORT_NAME`'s reply.
async fn greet<S>(stream: &mut S) -> Result<bool, ConnectionError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    stream.write_all(&wire::greeting()).await?;
    stream.flush().await?;
    let client_flags = stream.read_u32().await?;
    let known = wire::CLIENT_FIXED_NEWSTYLE | wire::CLIENT_NO_ZEROES;
    if client_flags & !known != 0 || client_flags & wire::CLIENT_FIXED_NEWSTYLE == 0 {
        return Err(ConnectionError::ClientFlags(client_flags));
    }
    Ok(client_flags & wire::CLIENT_NO_ZEROES != 0)
}

/// The next option and its data; one longer than [`MAX_OPTION_LEN`] ends
/// the connection.
async fn read_option<S>(stream: &mut S) -> Result<(u32, Vec<u8>), ConnectionError>
where
    S: AsyncRead + Unpin,
{
    let mut header = [0u8; 16];
    stream.read_exact(&mut header).await?;
    let header = wire::parse_option_header(&header)?;
    if header.len > MAX_OPTION_LEN {
        return Err(WireError::Malformed {
            what: "option longer than 64 KiB",
        }
        .into());
    }
    let mut data = vec![0; header.len as usize];
    stream.read_exact(&mut data).await?;
    Ok((header.option, data))
}

/// One round of option haggling, between greeting (or `STARTTLS`) and
/// the choice of an export.
struct Haggle<'a, S> {
    stream: &'a mut S,
    exports: &'a Exports,
    no_zeroes: bool,
    /// Inside TLS already.
    secured: bool,
    /// `STRUCTURED_REPLY` was acknowledged.
    structured: bool,
    /// `base:allocation` was set, for this export.
    allocation: Option<Arc<Export>>,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Haggle<'_, S> {
    /// Sends one option reply, flushed.
    async fn reply(&mut self, option: u32, kind: u32, data: &[u8]) -> std::io::Result<()> {
        self.stream
            .write_all(&wire::option_reply(option, kind, data))
            .await?;
        self.stream.flush().await
    }

    /// Answers one option but `ABORT` from an admitted client whose
    /// certificate grants `grant` (`has_tls`: the listener offers TLS); the
    /// step it ends the handshake with, if it does.
    async fn option(
        &mut self,
        option: u32,
        data: &[u8],
        grant: Grant,
        has_tls: bool,
    ) -> Result<Option<Step>, ConnectionError> {
        match option {
            wire::OPT_STRUCTURED_REPLY if !data.is_empty() => {
                let why = b"NBD_OPT_STRUCTURED_REPLY takes no data";
                self.reply(option, wire::REP_ERR_INVALID, why).await?;
            }
            wire::OPT_STRUCTURED_REPLY => {
                self.structured = true;
                self.reply(option, wire::REP_ACK, &[]).await?;
            }
            wire::OPT_LIST_META_CONTEXT | wire::OPT_SET_META_CONTEXT => {
                self.meta_context(option, data).await?;
            }
            wire::OPT_STARTTLS => return self.start_tls(data, has_tls).await,
            wire::OPT_EXPORT_NAME => return self.export_name(data, grant).await.map(Some),
            wire::OPT_LIST if !data.is_empty() => {
                let why = b"NBD_OPT_LIST takes no data";
                self.reply(option, wire::REP_ERR_INVALID, why).await?;
            }
            wire::OPT_LIST => self.list().await?,
            wire::OPT_INFO | wire::OPT_GO => return self.info_or_go(option, data, grant).await,
            _ => {
                let why = b"option not supported by replica-ha";
                self.reply(option, wire::REP_ERR_UNSUP, why).await?;
            }
        }
        Ok(None)
    }

    /// `STARTTLS`: acknowledged, and the TLS handshake follows, once, where
    /// the listener has TLS and the option carries no data.
    async fn start_tls(
        &mut self,
        data: &[u8],
        has_tls: bool,
    ) -> Result<Option<Step>, ConnectionError> {
        let option = wire::OPT_STARTTLS;
        let refusal: Option<(u32, &[u8])> = if !has_tls {
            Some((
                wire::REP_ERR_UNSUP,
                b"this server has no TLS (nbd_tls = off)",
            ))
        } else if self.secured {
            Some((wire::REP_ERR_INVALID, b"TLS is already on"))
        } else if !data.is_empty() {
            Some((wire::REP_ERR_INVALID, b"NBD_OPT_STARTTLS takes no data"))
        } else {
            None
        };
        match refusal {
            Some((kind, why)) => {
                self.reply(option, kind, why).await?;
                Ok(None)
            }
            None => {
                self.reply(option, wire::REP_ACK, &[]).await?;
                Ok(Some(Step::StartTls {
                    no_zeroes: self.no_zeroes,
                }))
            }
        }
    }

    /// `LIST`: every export registered now, with its description.
    async fn list(&mut self) -> std::io::Result<()> {
        for export in self.exports.listed() {
            let entry = wire::server_entry(&export.name, &export.description);
            self.stream
                .write_all(&wire::option_reply(
                    wire::OPT_LIST,
                    wire::REP_SERVER,
                    &entry,
                ))
                .await?;
        }
        self.reply(wire::OPT_LIST, wire::REP_ACK, &[]).await
    }

    /// `EXPORT_NAME`, which has no error reply: the export named by `data`
    /// and its session, or the connection ends with the reason.
    async fn export_name(&mut self, data: &[u8], grant: Grant) -> Result<Step, ConnectionError> {
        let export = self
            .exports
            .choose(data)
            .map_err(|why| ConnectionError::UnknownExport {
                name: lossy(data),
                why,
            })?;
        let session = export
            .offer(grant)
            .map_err(|err| ConnectionError::Unavailable(err.to_string()))?;
        let session = self.settle(&export, session);
        let reply = wire::export_name_reply(export.device.size(), session.flags, self.no_zeroes);
        self.stream.write_all(&reply).await?;
        self.stream.flush().await?;
        Ok(Step::Session(export, session))
    }

    /// `INFO` or `GO`: the named export's info, or why it is not offered;
    /// `GO` then opens it.
    async fn info_or_go(
        &mut self,
        option: u32,
        data: &[u8],
        grant: Grant,
    ) -> Result<Option<Step>, ConnectionError> {
        let request = match wire::parse_info_request(data) {
            Ok(request) => request,
            Err(err) => {
                let why = err.to_string();
                self.reply(option, wire::REP_ERR_INVALID, why.as_bytes())
                    .await?;
                return Ok(None);
            }
        };
        let export = match self.exports.choose(&request.name) {
            Ok(export) => export,
            Err(why) => {
                tracing::info!(name = %lossy(&request.name), %why, "NBD export unknown");
                self.reply(option, wire::REP_ERR_UNKNOWN, why.as_bytes())
                    .await?;
                return Ok(None);
            }
        };
        let session = match export.offer(grant) {
            Ok(session) => self.settle(&export, session),
            Err(err) => {
                let why = err.to_string();
                tracing::info!(export = %export.name, %why, "NBD export refused");
                self.reply(option, wire::REP_ERR_UNKNOWN, why.as_bytes())
                    .await?;
                return Ok(None);
            }
        };
        for info in export_infos(&export, session.flags, &request.infos) {
            self.stream
                .write_all(&wire::option_reply(option, wire::REP_INFO, &info))
                .await?;
        }
        self.reply(option, wire::REP_ACK, &[]).await?;
        Ok((option == wire::OPT_GO).then_some(Step::Session(export, session)))
    }

    /// The session on `export` with what was negotiated: structured
    /// replies, and `base:allocation` if it was set for this export (a
    /// choice of another drops it, as the protocol asks).
    fn settle(&self, export: &Arc<Export>, session: Session) -> Session {
        let set_here = self
            .allocation
            .as_ref()
            .is_some_and(|set| Arc::ptr_eq(set, export));
        Session {
            structured: self.structured,
            allocation: set_here.then_some(wire::BASE_ALLOCATION_ID),
            ..session
        }
    }

    /// `LIST_META_CONTEXT` or `SET_META_CONTEXT`: whether `base:allocation`
    /// is listed or selected, or the refusal.
    async fn meta_context(&mut self, option: u32, data: &[u8]) -> std::io::Result<()> {
        let set = option == wire::OPT_SET_META_CONTEXT;
        if set {
            // A SET replaces what was selected, even when it fails.
            self.allocation = None;
        }
        match meta_contexts(self.exports, data, set, self.structured) {
            Err((kind, why)) => self.reply(option, kind, why.as_bytes()).await,
            Ok((export, found)) => {
                if found {
                    // A LIST names contexts without ids (0).
                    let id = if set { wire::BASE_ALLOCATION_ID } else { 0 };
                    let body = wire::meta_context(id, wire::BASE_ALLOCATION);
                    self.stream
                        .write_all(&wire::option_reply(option, wire::REP_META_CONTEXT, &body))
                        .await?;
                    if set {
                        self.allocation = Some(export);
                    }
                }
                self.reply(option, wire::REP_ACK, &[]).await
            }
        }
    }
}

/// Answers a meta context option: the export it names and whether
/// `base:allocation` is listed (`LIST`) or selected (`SET`), or the
/// refusal to send. A `LIST` with no query, or the query `base:`, lists
/// it; a `SET` selects it only when asked for by name, and needs structured
/// replies first.
fn meta_contexts(
    exports: &Exports,
    data: &[u8],
    set: bool,
    structured: bool,
) -> Result<(Arc<Export>, bool), (u32, String)> {
    let request = wire::parse_meta_context_request(data)
        .map_err(|err| (wire::REP_ERR_INVALID, err.to_string()))?;
    if set && !structured {
        return Err((
            wire::REP_ERR_INVALID,
            "NBD_OPT_SET_META_CONTEXT needs NBD_OPT_STRUCTURED_REPLY first".into(),
        ));
    }
    let export = exports
        .choose(&request.name)
        .map_err(|why| (wire::REP_ERR_UNKNOWN, why))?;
    let named = |q: &Vec<u8>| q.as_slice() == wire::BASE_ALLOCATION.as_bytes();
    let found = if set {
        request.queries.iter().any(named)
    } else {
        request.queries.is_empty()
            || request
                .queries
                .iter()
                .any(|q| named(q) || q.as_slice() == b"base:")
    };
    Ok((export, found))
}

/// The `NBD_REP_INFO` bodies for an `INFO`/`GO`: always the size and flags,
/// plus the block sizes, name and description when asked for.
fn export_infos(export: &Export, flags: u16, asked: &[u16]) -> Vec<Vec<u8>> {
    let mut infos = vec![wire::info_export(export.device.size(), flags)];
    if asked.contains(&wire::INFO_BLOCK_SIZE) {
        infos.push(wire::info_block_size(1, 4096, super::MAX_REQUEST_LEN));
    }
    if asked.contains(&wire::INFO_NAME) {
        infos.push(wire::info_text(wire::INFO_NAME, &export.name));
    }
    if asked.contains(&wire::INFO_DESCRIPTION) {
        infos.push(wire::info_text(wire::INFO_DESCRIPTION, &export.description));
    }
    infos
}

fn lossy(name: &[u8]) -> String {
    String::from_utf8_lossy(name).into_owned()
}
