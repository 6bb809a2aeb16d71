//! The fixed-newstyle handshake: greeting, client flags, and option
//! haggling until the client picks the export (`GO` or `EXPORT_NAME`) or
//! gives up (`ABORT`, or closing the socket).
//!
//! Options served: `EXPORT_NAME`, `ABORT`, `LIST`, `INFO`, `GO`,
//! `STRUCTURED_REPLY`, `LIST_META_CONTEXT` and `SET_META_CONTEXT` (the one
//! context `base:allocation`, for `NBD_CMD_BLOCK_STATUS`; setting one needs
//! structured replies first), and `STARTTLS` when the export has TLS. Every
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
//! ([`Export::grant`](super::Export)): a client whose certificate may not
//! use the export (it names nobody of this cluster, or a node that is not
//! a member) gets `NBD_REP_ERR_POLICY` with the reason for every option
//! but `ABORT`, and `EXPORT_NAME` closes the connection; one whose role
//! only reads (a viewer) is offered the export read-only even on the
//! writer.
//!
//! The export is offered as the device grants it at that moment
//! ([`crate::volume::Access`]): read-write under the gate's term, which the
//! session is then bound to; read-only; or not at all, when this node's
//! copy may not be read (a passive node outside the committed in-sync set).
//! That last refusal is `NBD_REP_ERR_UNKNOWN` ("export not available") with
//! the reason as text for `GO` and `INFO`, and a closed connection for
//! `EXPORT_NAME`, which has no error reply. A client is told at once, in
//! words, instead of opening an export whose every read fails.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::wire::{self, WireError};
use super::{Client, ConnectionError, Export, Refusal};
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
    /// The client picked the export.
    Session(Session),
    /// The client gave up (`ABORT`).
    Aborted,
    /// The client asked for TLS and was told yes: do the TLS handshake as
    /// the server, then negotiate again in [`Phase::Secured`].
    StartTls { no_zeroes: bool },
}

/// Runs the handshake over `stream`, for `client`, up to a session, an
/// abort, or an upgrade to TLS.
pub async fn negotiate<S>(
    stream: &mut S,
    export: &Export,
    phase: Phase,
    client: &Client,
) -> Result<Step, ConnectionError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let no_zeroes = match phase {
        Phase::Secured { no_zeroes } => no_zeroes,
        Phase::Fresh => {
            stream.write_all(&wire::greeting()).await?;
            stream.flush().await?;
            let client_flags = stream.read_u32().await?;
            let known = wire::CLIENT_FIXED_NEWSTYLE | wire::CLIENT_NO_ZEROES;
            if client_flags & !known != 0 || client_flags & wire::CLIENT_FIXED_NEWSTYLE == 0 {
                return Err(ConnectionError::ClientFlags(client_flags));
            }
            client_flags & wire::CLIENT_NO_ZEROES != 0
        }
    };
    let secured = matches!(phase, Phase::Secured { .. });
    let tls_required = export.tls_required() && !secured;
    let mut structured = false;
    let mut allocation: Option<u32> = None;
    loop {
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
        let option = header.option;
        let reply = |kind, data: &[u8]| wire::option_reply(option, kind, data);
        if tls_required && !matches!(option, wire::OPT_STARTTLS | wire::OPT_ABORT) {
            if option == wire::OPT_EXPORT_NAME {
                return Err(ConnectionError::TlsRequired);
            }
            let why = b"TLS is required: send NBD_OPT_STARTTLS first";
            stream
                .write_all(&reply(wire::REP_ERR_TLS_REQD, why))
                .await?;
            stream.flush().await?;
            continue;
        }
        let refused = match option {
            wire::OPT_ABORT => None,
            _ => export.grant(client).err(),
        };
        if let Some(why) = refused {
            if option == wire::OPT_EXPORT_NAME {
                return Err(ConnectionError::Refused(why));
            }
            tracing::info!(%why, "NBD client refused");
            stream
                .write_all(&reply(wire::REP_ERR_POLICY, why.as_bytes()))
                .await?;
            stream.flush().await?;
            continue;
        }
        let offer = export.offer(client).map(|session| Session {
            structured,
            allocation,
            ..session
        });
        match option {
            wire::OPT_STRUCTURED_REPLY if !data.is_empty() => {
                let why = b"NBD_OPT_STRUCTURED_REPLY takes no data";
                stream.write_all(&reply(wire::REP_ERR_INVALID, why)).await?;
            }
            wire::OPT_STRUCTURED_REPLY => {
                structured = true;
                stream.write_all(&reply(wire::REP_ACK, &[])).await?;
            }
            wire::OPT_LIST_META_CONTEXT | wire::OPT_SET_META_CONTEXT => {
                let set = option == wire::OPT_SET_META_CONTEXT;
                if set {
                    // A SET replaces what was selected, even when it fails.
                    allocation = None;
                }
                match meta_contexts(export, &data, set, structured) {
                    Err((kind, why)) => {
                        stream.write_all(&reply(kind, why.as_bytes())).await?;
                    }
                    Ok(found) => {
                        if set {
                            allocation = found.then_some(wire::BASE_ALLOCATION_ID);
                        }
                        if found {
                            // A LIST names contexts without ids (0).
                            let id = if set { wire::BASE_ALLOCATION_ID } else { 0 };
                            let body = wire::meta_context(id, wire::BASE_ALLOCATION);
                            stream
                                .write_all(&reply(wire::REP_META_CONTEXT, &body))
                                .await?;
                        }
                        stream.write_all(&reply(wire::REP_ACK, &[])).await?;
                    }
                }
            }
            wire::OPT_STARTTLS => {
                let refusal: Option<(u32, &[u8])> = if !export.has_tls() {
                    Some((
                        wire::REP_ERR_UNSUP,
                        b"this server has no TLS (nbd_tls = off)",
                    ))
                } else if secured {
                    Some((wire::REP_ERR_INVALID, b"TLS is already on"))
                } else if !data.is_empty() {
                    Some((wire::REP_ERR_INVALID, b"NBD_OPT_STARTTLS takes no data"))
                } else {
                    None
                };
                match refusal {
                    Some((kind, why)) => stream.write_all(&reply(kind, why)).await?,
                    None => {
                        stream.write_all(&reply(wire::REP_ACK, &[])).await?;
                        stream.flush().await?;
                        return Ok(Step::StartTls { no_zeroes });
                    }
                }
            }
            wire::OPT_EXPORT_NAME => {
                if !export.answers_to(&data) {
                    return Err(ConnectionError::UnknownExport(lossy(&data)));
                }
                let session = offer.map_err(|refusal| match refusal {
                    Refusal::Policy(why) => ConnectionError::Refused(why),
                    Refusal::Unavailable(err) => ConnectionError::Unavailable(err.to_string()),
                })?;
                let size = export.device.size();
                stream
                    .write_all(&wire::export_name_reply(size, session.flags, no_zeroes))
                    .await?;
                stream.flush().await?;
                return Ok(Step::Session(session));
            }
            wire::OPT_ABORT => {
                // The client may already be gone; the ACK is a courtesy.
                let _ = stream.write_all(&reply(wire::REP_ACK, &[])).await;
                let _ = stream.flush().await;
                return Ok(Step::Aborted);
            }
            wire::OPT_LIST if !data.is_empty() => {
                let why = b"NBD_OPT_LIST takes no data";
                stream.write_all(&reply(wire::REP_ERR_INVALID, why)).await?;
            }
            wire::OPT_LIST => {
                let entry = wire::server_entry(&export.name);
                stream.write_all(&reply(wire::REP_SERVER, &entry)).await?;
                stream.write_all(&reply(wire::REP_ACK, &[])).await?;
            }
            wire::OPT_INFO | wire::OPT_GO => match (wire::parse_info_request(&data), offer) {
                (Err(err), _) => {
                    let why = err.to_string();
                    stream
                        .write_all(&reply(wire::REP_ERR_INVALID, why.as_bytes()))
                        .await?;
                }
                (Ok(request), _) if !export.answers_to(&request.name) => {
                    let why = format!("no export named {:?}", lossy(&request.name));
                    stream
                        .write_all(&reply(wire::REP_ERR_UNKNOWN, why.as_bytes()))
                        .await?;
                }
                (Ok(_), Err(refused)) => {
                    let (kind, why) = match refused {
                        Refusal::Policy(why) => (wire::REP_ERR_POLICY, why),
                        Refusal::Unavailable(err) => (wire::REP_ERR_UNKNOWN, err.to_string()),
                    };
                    tracing::info!(%why, "NBD export refused");
                    stream.write_all(&reply(kind, why.as_bytes())).await?;
                }
                (Ok(request), Ok(session)) => {
                    for info in export_infos(export, session.flags, &request.infos) {
                        stream.write_all(&reply(wire::REP_INFO, &info)).await?;
                    }
                    stream.write_all(&reply(wire::REP_ACK, &[])).await?;
                    if option == wire::OPT_GO {
                        stream.flush().await?;
                        return Ok(Step::Session(session));
                    }
                }
            },
            _ => {
                let why = b"option not supported by replica-ha";
                stream.write_all(&reply(wire::REP_ERR_UNSUP, why)).await?;
            }
        }
        stream.flush().await?;
    }
}

/// Answers a meta context option: whether `base:allocation` is listed
/// (`LIST`) or selected (`SET`), or the refusal to send. A `LIST` with no
/// query, or the query `base:`, lists it; a `SET` selects it only when
/// asked for by name, and needs structured replies first.
fn meta_contexts(
    export: &Export,
    data: &[u8],
    set: bool,
    structured: bool,
) -> Result<bool, (u32, String)> {
    let request = wire::parse_meta_context_request(data)
        .map_err(|err| (wire::REP_ERR_INVALID, err.to_string()))?;
    if set && !structured {
        return Err((
            wire::REP_ERR_INVALID,
            "NBD_OPT_SET_META_CONTEXT needs NBD_OPT_STRUCTURED_REPLY first".into(),
        ));
    }
    if !export.answers_to(&request.name) {
        return Err((
            wire::REP_ERR_UNKNOWN,
            format!("no export named {:?}", lossy(&request.name)),
        ));
    }
    let named = |q: &Vec<u8>| q.as_slice() == wire::BASE_ALLOCATION.as_bytes();
    Ok(if set {
        request.queries.iter().any(named)
    } else {
        request.queries.is_empty()
            || request
                .queries
                .iter()
                .any(|q| named(q) || q.as_slice() == b"base:")
    })
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
