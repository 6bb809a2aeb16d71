//! The NBD server: how programs use the volume.
//!
//! Each node exports the volume over the Network Block Device protocol
//! (fixed newstyle, simple replies) on its `nbd` address, as one export named
//! after the volume; the empty name (the client's default) means it too.
//! Any NBD client works: `qemu-io`, `qemu-img`, `nbdcopy`, `nbdfuse`,
//! `nbd-client` for a kernel `/dev/nbdX`, fio's `nbd` engine.
//!
//! - **Writer and passive nodes.** The export is writable when the client
//!   connects to the active writer, and read-only (`NBD_FLAG_READ_ONLY`)
//!   otherwise. Every write still goes through the gate
//!   ([`crate::ha::ActiveDevice`]), and a writable session is bound to the
//!   gate's term: once that gate closes (lease lost, demotion, a newer term)
//!   the session answers what it completed and the connection closes; a
//!   request that met the closed gate gets no reply, never `ESHUTDOWN` and
//!   never a silent success (design C1, see [`transmission`]). Clients
//!   reconnect to the new writer and retry there.
//! - **Who may use it (S9).** With `nbd_tls`, a client that upgrades
//!   presents a certificate of the cluster CA (required with
//!   `nbd_client_auth`), and its identity decides: a node of the current
//!   membership and an `admin` or `user` client may write; a `viewer` gets
//!   a read-only export (`EPERM` for a write sent anyway); a node that is
//!   not a member (removed by `members remove`) is refused by the same
//!   guard as the replica service's ([`crate::net::Audience::Volume`]),
//!   and a certificate that names no identity of this cluster is refused,
//!   both with the reason (`NBD_REP_ERR_POLICY`); a session whose node is
//!   removed while it is open is closed (see [`transmission`]). A client without a
//!   certificate gets what the node grants it ([`Export::with_anonymous`];
//!   see `node::config` for how that follows from the listen address).
//! - **Fenced reads.** A passive node serves reads of its own replica only
//!   while that replica is in the committed in-sync set
//!   ([`crate::ha::ReadGate`]). Otherwise `GO`/`INFO` are refused with
//!   `NBD_REP_ERR_UNKNOWN` and the reason, `EXPORT_NAME` is closed, and a
//!   read-only session already open gets `EIO` for its reads until the
//!   replica is back in sync.
//! - **Commands**: `READ`, `WRITE`, `FLUSH`, `DISC`, `TRIM` and
//!   `WRITE_ZEROES` (both discard the range on every in-sync replica,
//!   freeing its space, unless `NO_HOLE` asks for written zeroes; see
//!   [`transmission`]), `CACHE` (range-checked; every read is served from
//!   the page cache of a replica anyway), the `FUA` flag, and `FAST_ZERO`
//!   (zeroes by discard are fast; with `NO_HOLE` the answer is `ENOTSUP`
//!   at once).
//!   `CAN_MULTI_CONN` is advertised: a flush makes every acknowledged write
//!   durable, whichever connection sent it.
//! - **Limits**: one request reads or writes at most [`MAX_REQUEST_LEN`]
//!   bytes (32 MiB, the protocol's default maximum, so clients need no
//!   negotiation); larger ones get `EINVAL`. Each connection holds at most
//!   128 MiB of requests in flight, and all connections together execute at
//!   most [`DEVICE_BUDGET_BYTES`] at once; at most [`MAX_CONNECTIONS`] connections
//!   are served at once; a client has [`HANDSHAKE_TIMEOUT`] to finish the
//!   handshake.
//! - **Bad input** never panics and never writes: malformed option data gets
//!   an error reply, a malformed request header closes the connection after
//!   the requests before it are answered.

pub mod client;
mod handshake;
mod transmission;
pub mod wire;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;

pub use transmission::{CLOSE_GRACE, errno};

use crate::certs::PeerIdentity;
use crate::net::conn::PeerInfo;
use crate::net::tls::NbdClientAuth;
use crate::net::{PeerGuard, Tls};
use crate::volume::{Access, Device, DeviceError, MAX_REQUEST};

/// The largest read or write one request may carry.
pub const MAX_REQUEST_LEN: u32 = MAX_REQUEST as u32;
/// The most connections served at once; more are closed on accept.
pub const MAX_CONNECTIONS: usize = 128;
/// How long a client may take to pick an export.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);

/// The bytes of requests executing against the device at once, across all
/// connections. Queueing stays in the NBD server instead of piling onto
/// the replicas' gRPC streams, where it would delay Raft heartbeats behind
/// data and cost the writer its lease under a flood (nbdcopy with four
/// connections of 64 requests did exactly that before this limit).
pub const DEVICE_BUDGET_BYTES: u64 = 32 * 1024 * 1024;

/// The one export a node serves.
pub struct Export {
    /// The export name (the volume name).
    pub name: String,
    /// A line for `NBD_INFO_DESCRIPTION`.
    pub description: String,
    /// The gated device.
    pub device: Arc<dyn Device>,
    /// Shared by every connection; see [`DEVICE_BUDGET_BYTES`].
    executing: Semaphore,
    /// TLS (`nbd_tls`), when on.
    tls: Option<ExportTls>,
    /// What a client that presents no certificate may do.
    anonymous: Grant,
}

/// What a client may do with the export, as its certificate (or the lack
/// of one) says; the device then decides what it can have now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grant {
    /// A writable export, on the writer.
    ReadWrite,
    /// A read-only export, even on the writer.
    ReadOnly,
}

/// Who is at the other end of a connection, as far as the server knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Client {
    /// No certificate: plaintext, or TLS without one.
    Anonymous,
    /// A certificate of the cluster CA that names this identity.
    Certified(Arc<PeerIdentity>),
    /// A certificate of the cluster CA that names no identity of this
    /// cluster, and why.
    Unnamed(String),
}

/// Why the export is not offered to a client.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Refusal {
    /// The client may not use it at all (its certificate's fault).
    Policy(String),
    /// This node may not serve it now (S10).
    Unavailable(DeviceError),
}

/// How an export speaks TLS.
#[derive(Debug, Clone)]
pub struct ExportTls {
    /// The node's credentials (reloaded on SIGHUP: each handshake takes
    /// the current ones).
    pub credentials: Arc<Tls>,
    /// Whether a client must upgrade before anything else.
    pub required: bool,
    /// Whether a client must present a certificate from the cluster CA.
    pub client_auth: NbdClientAuth,
    /// Who may use the export ([`crate::net::Audience::Volume`]): the same
    /// member admission as the replica service's, so a node removed from
    /// the membership is refused here too.
    pub guard: PeerGuard,
}

impl Export {
    /// An export of `device` named `name`.
    pub fn new(
        name: impl Into<String>,
        description: impl Into<String>,
        device: Arc<dyn Device>,
    ) -> Self {
        Self {
            name: name.into(),
            description: description.into(),
            device,
            executing: Semaphore::new(transmission::units(DEVICE_BUDGET_BYTES) as usize),
            tls: None,
            anonymous: Grant::ReadWrite,
        }
    }

    /// The same export, offering TLS as `tls` says.
    pub fn with_tls(mut self, tls: ExportTls) -> Self {
        self.tls = Some(tls);
        self
    }

    /// The same export, granting `grant` to a client without a certificate
    /// (by default [`Grant::ReadWrite`], as `attach`'s local socket).
    pub fn with_anonymous(mut self, grant: Grant) -> Self {
        self.anonymous = grant;
        self
    }

    fn has_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// Whether a client must upgrade to TLS before anything else: where TLS
    /// is required, or client certificates are (a plaintext client has
    /// none).
    fn tls_required(&self) -> bool {
        self.tls
            .as_ref()
            .is_some_and(|tls| tls.required || tls.client_auth == NbdClientAuth::Required)
    }

    /// Who the client of a finished TLS handshake is, from the certificate
    /// it presented (T3 of [`crate::net::tls`]).
    fn client_of(&self, certs: Option<&[rustls::pki_types::CertificateDer<'_>]>) -> Client {
        let Some(tls) = &self.tls else {
            return Client::Anonymous;
        };
        match tls.credentials.client_identity(certs) {
            Ok(None) => Client::Anonymous,
            Ok(Some(identity)) => Client::Certified(Arc::new(identity)),
            Err(err) => Client::Unnamed(err.to_string()),
        }
    }

    /// What `client` may do with the export (S9): decided by its
    /// certificate before anything touches the volume. A client without
    /// one gets what the configuration grants it; a certificate is
    /// admitted by the same guard as the replica service's and then
    /// gets what its role allows; one that names nobody of this cluster is
    /// refused.
    fn grant(&self, client: &Client) -> Result<Grant, String> {
        let identity = match client {
            Client::Anonymous => return Ok(self.anonymous),
            Client::Unnamed(why) => {
                return Err(format!(
                    "the client certificate names no node or client of this cluster: {why}"
                ));
            }
            Client::Certified(identity) => identity,
        };
        let guard = self
            .tls
            .as_ref()
            .map(|tls| &tls.guard)
            .ok_or_else(|| "this server has no TLS to check a certificate with".to_string())?;
        let peer = PeerInfo {
            remote: None,
            tls: true,
            identity: Some(Arc::clone(identity)),
        };
        match guard.admit(Some(&peer)) {
            Ok(caller) if caller.writes_data() => Ok(Grant::ReadWrite),
            Ok(_) => Ok(Grant::ReadOnly),
            Err(status) => Err(status.message().to_string()),
        }
    }

    /// Whether a client asking for `name` means this export ("" is the
    /// default export).
    fn answers_to(&self, name: &[u8]) -> bool {
        name.is_empty() || name == self.name.as_bytes()
    }

    /// The session `client` would get now: refused if its certificate
    /// does not allow it; writable, bound to the gate's term, only if it
    /// may write and while this node's gate would pass a write; read-only
    /// while this node's copy may be read; else why not.
    fn offer(&self, client: &Client) -> Result<handshake::Session, Refusal> {
        let grant = self.grant(client).map_err(Refusal::Policy)?;
        let flags = wire::TFLAG_HAS_FLAGS
            | wire::TFLAG_SEND_FLUSH
            | wire::TFLAG_CAN_MULTI_CONN
            | wire::TFLAG_SEND_CACHE;
        let access = match (self.device.access(), grant) {
            (Access::ReadWrite { .. }, Grant::ReadOnly) => Access::ReadOnly,
            (access, _) => access,
        };
        match access {
            Access::ReadWrite { term } => Ok(handshake::Session {
                flags: flags
                    | wire::TFLAG_SEND_FUA
                    | wire::TFLAG_SEND_TRIM
                    | wire::TFLAG_SEND_WRITE_ZEROES
                    | wire::TFLAG_SEND_FAST_ZERO,
                term: Some(term),
                structured: false,
                allocation: None,
            }),
            Access::ReadOnly => Ok(handshake::Session {
                flags: flags | wire::TFLAG_READ_ONLY,
                term: None,
                structured: false,
                allocation: None,
            }),
            Access::Refused(why) => Err(Refusal::Unavailable(why)),
        }
    }
}

/// Why a connection ended early.
#[derive(Debug, thiserror::Error)]
pub enum ConnectionError {
    /// The socket failed or closed mid-message.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The client sent something that is not NBD.
    #[error("protocol: {0}")]
    Protocol(#[from] wire::WireError),
    /// The client's flags are unknown or it is not fixed-newstyle.
    #[error("unsupported client flags {0:#x}")]
    ClientFlags(u32),
    /// `NBD_OPT_EXPORT_NAME` named another export.
    #[error("no export named {0:?}")]
    UnknownExport(String),
    /// The handshake took longer than [`HANDSHAKE_TIMEOUT`].
    #[error("handshake timed out")]
    HandshakeTimeout,
    /// `NBD_OPT_EXPORT_NAME` asked for an export this node may not serve
    /// now (its copy may not be read); that option has no error reply.
    #[error("export not available: {0}")]
    Unavailable(String),
    /// `NBD_OPT_EXPORT_NAME` from a client whose certificate does not
    /// allow it the export; that option has no error reply.
    #[error("client refused: {0}")]
    Refused(String),
    /// `NBD_OPT_EXPORT_NAME` before `STARTTLS` where TLS is required.
    #[error("the client chose the export without TLS, which is required")]
    TlsRequired,
    /// The TLS handshake after `STARTTLS` failed.
    #[error("TLS handshake: {0}")]
    Tls(String),
}

/// Counters of the NBD server, for metrics.
#[derive(Debug, Default)]
pub struct NbdStats {
    /// Connections open now.
    pub open: AtomicU64,
    /// Connections accepted since start.
    pub accepted: AtomicU64,
    /// Connections that ended with a protocol or I/O error.
    pub failed: AtomicU64,
    /// Connections refused because [`MAX_CONNECTIONS`] were open.
    pub refused: AtomicU64,
}

/// Where NBD clients connect: a TCP port (the node's export) or a unix
/// socket (`attach`'s).
pub trait Listener: Send + Sync + 'static {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// The next connection and who made it, in words.
    fn accept(
        &self,
    ) -> impl std::future::Future<Output = std::io::Result<(Self::Stream, String)>> + Send;
}

impl Listener for TcpListener {
    type Stream = tokio::net::TcpStream;

    async fn accept(&self) -> std::io::Result<(Self::Stream, String)> {
        let (stream, peer) = TcpListener::accept(self).await?;
        let _ = stream.set_nodelay(true);
        Ok((stream, peer.to_string()))
    }
}

impl Listener for tokio::net::UnixListener {
    type Stream = tokio::net::UnixStream;

    async fn accept(&self) -> std::io::Result<(Self::Stream, String)> {
        let (stream, _) = tokio::net::UnixListener::accept(self).await?;
        Ok((stream, "a unix socket client".into()))
    }
}

/// Serves `export` on `listener` until `stop` turns true; then drops every
/// connection.
pub async fn serve<L: Listener>(
    listener: L,
    export: Arc<Export>,
    stats: Arc<NbdStats>,
    mut stop: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|stop| *stop) => break,
            Some(_) = connections.join_next() => continue,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(%err, "NBD accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            stats.refused.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, "NBD connection refused: {MAX_CONNECTIONS} already open");
            continue;
        };
        stats.accepted.fetch_add(1, Ordering::Relaxed);
        let (export, stats) = (Arc::clone(&export), Arc::clone(&stats));
        connections.spawn(async move {
            stats.open.fetch_add(1, Ordering::Relaxed);
            tracing::info!(%peer, "NBD client connected");
            match handle(stream, export).await {
                Ok(()) => tracing::info!(%peer, "NBD client disconnected"),
                Err(err) => {
                    stats.failed.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(%peer, %err, "NBD connection ended");
                }
            }
            stats.open.fetch_sub(1, Ordering::Relaxed);
            drop(slot);
        });
    }
    connections.shutdown().await;
}

use client::Io;

/// Serves one client on `stream`: the handshake (upgraded to TLS on
/// `STARTTLS`), then requests.
pub async fn handle<S>(stream: S, export: Arc<Export>) -> Result<(), ConnectionError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (stream, negotiated, client) =
        tokio::time::timeout(HANDSHAKE_TIMEOUT, negotiate(stream, &export))
            .await
            .map_err(|_| ConnectionError::HandshakeTimeout)??;
    let (reader, writer) = tokio::io::split(stream);
    match negotiated {
        Some(session) => {
            let mode = if session.writable() {
                "read-write"
            } else {
                "read-only"
            };
            tracing::debug!(mode, "NBD export opened");
            transmission::run(reader, writer, export, session, client).await
        }
        None => Ok(()),
    }
}

/// The handshake: option haggling, and the TLS handshake when the client
/// asks for it. Returns the stream to serve on, the session, if any, and
/// who the client is.
async fn negotiate<S>(
    stream: S,
    export: &Export,
) -> Result<(Box<dyn Io>, Option<handshake::Session>, Client), ConnectionError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut stream: Box<dyn Io> = Box::new(stream);
    let mut phase = handshake::Phase::Fresh;
    let mut client = Client::Anonymous;
    loop {
        match handshake::negotiate(&mut stream, export, phase, &client).await? {
            handshake::Step::Session(session) => return Ok((stream, Some(session), client)),
            handshake::Step::Aborted => return Ok((stream, None, client)),
            handshake::Step::StartTls { no_zeroes } => {
                let tls = export.tls.as_ref().ok_or(ConnectionError::TlsRequired)?;
                let config = tls
                    .credentials
                    .nbd_server(tls.client_auth)
                    .map_err(|err| ConnectionError::Tls(err.to_string()))?;
                let secured = tokio_rustls::TlsAcceptor::from(config)
                    .accept(stream)
                    .await
                    .map_err(|err| ConnectionError::Tls(err.to_string()))?;
                client = export.client_of(secured.get_ref().1.peer_certificates());
                match &client {
                    Client::Anonymous => tracing::info!("NBD client without a certificate"),
                    Client::Certified(identity) => {
                        tracing::info!(%identity, "NBD client authenticated")
                    }
                    Client::Unnamed(why) => {
                        tracing::info!(%why, "NBD client's certificate names nobody")
                    }
                }
                stream = Box::new(secured);
                phase = handshake::Phase::Secured { no_zeroes };
            }
        }
    }
}

#[cfg(test)]
mod tests;
