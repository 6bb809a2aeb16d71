//! The NBD server: how programs use the volumes.
//!
//! Each node serves the volumes it holds a copy of over the Network Block
//! Device protocol (fixed newstyle, simple replies) on its `nbd` address,
//! one listener for all of them, each an export named after its volume.
//! Any NBD client works: `qemu-io`, `qemu-img`, `nbdcopy`, `nbdfuse`,
//! `nbd-client` for a kernel `/dev/nbdX`, fio's `nbd` engine.
//!
//! - **Which export.** The listener serves a registry, [`Exports`], that
//!   the node fills and empties as volumes come and go; a client picks an
//!   export by name (`GO`, `INFO`, `EXPORT_NAME`) and `LIST` lists them.
//!   The empty name (the client's default) is the registry's default
//!   export: the node's configured volume. A name this node does not hold
//!   is refused with the node's words for it (which nodes hold it). A
//!   connection keeps the export it chose even if the registry drops it.
//!   See [`Exports`].
//! - **Writer and passive nodes.** An export is writable when the client
//!   connects to its volume's active writer, and read-only
//!   (`NBD_FLAG_READ_ONLY`) otherwise. Every write still goes through the gate
//!   ([`crate::ha::ActiveDevice`]), and a writable session is bound to the
//!   gate's term: once that gate closes (lease lost, demotion, a newer term)
//!   the session answers what it completed and the connection closes; a
//!   request that met the closed gate gets no reply, never `ESHUTDOWN` and
//!   never a silent success (design C1, see [`transmission`]). Clients
//!   reconnect to the new writer and retry there.
//! - **Who may use it (S9).** Admission is the listener's, the same for
//!   every export, since a client upgrades and is admitted before it
//!   names one. With `nbd_tls`, a client that upgrades
//!   presents a certificate of the cluster CA (required with
//!   `nbd_client_auth`), and its identity decides: a node of the current
//!   membership and an `admin` or `user` client may write; a `viewer` gets
//!   read-only exports (`EPERM` for a write sent anyway); a node that is
//!   not a member (removed by `members remove`) is refused by the same
//!   guard as the replica service's ([`crate::net::Audience::Volume`]),
//!   and a certificate that names no identity of this cluster is refused,
//!   both with the reason (`NBD_REP_ERR_POLICY`); a session whose node is
//!   removed while it is open is closed (see [`transmission`]). A client without a
//!   certificate gets what the node grants it ([`Exports::with_anonymous`];
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
//!   128 MiB of requests in flight, and all connections to one export
//!   together execute at most [`DEVICE_BUDGET_BYTES`] at once; at most
//!   [`MAX_CONNECTIONS`] connections are served at once by one listener,
//!   whichever exports they chose; a client has [`HANDSHAKE_TIMEOUT`] to
//!   finish the handshake. [`NbdStats`] count the listener's connections,
//!   all exports together.
//! - **Bad input** never panics and never writes: malformed option data gets
//!   an error reply, a malformed request header closes the connection after
//!   the requests before it are answered.

pub mod client;
mod exports;
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

pub use exports::{Exports, Lookup};
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

/// The bytes of requests executing against one export's device at once,
/// across all its connections. Queueing stays in the NBD server instead of piling onto
/// the replicas' gRPC streams, where it would delay Raft heartbeats behind
/// data and cost the writer its lease under a flood (nbdcopy with four
/// connections of 64 requests did exactly that before this limit).
pub const DEVICE_BUDGET_BYTES: u64 = 32 * 1024 * 1024;

/// One export: a volume, by name, over its gated device.
pub struct Export {
    /// The export name (the volume name).
    pub name: String,
    /// A line for `NBD_INFO_DESCRIPTION` and `NBD_OPT_LIST`.
    pub description: String,
    /// The gated device.
    pub device: Arc<dyn Device>,
    /// Shared by every connection to this export; see
    /// [`DEVICE_BUDGET_BYTES`].
    executing: Semaphore,
    /// How many clients are in their transmission phase on it now.
    sessions: std::sync::atomic::AtomicUsize,
}

/// What a client may do with an export, as its certificate (or the lack
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

/// How a listener speaks TLS (`nbd_tls`): the node's, the same for every
/// export it serves.
#[derive(Debug, Clone)]
pub struct ExportTls {
    /// The node's credentials (reloaded on SIGHUP: each handshake takes
    /// the current ones).
    pub credentials: Arc<Tls>,
    /// Whether a client must upgrade before anything else.
    pub required: bool,
    /// Whether a client must present a certificate from the cluster CA.
    pub client_auth: NbdClientAuth,
    /// Who may use the exports ([`crate::net::Audience::Volume`]): the
    /// same member admission as the replica service's, so a node removed
    /// from the membership is refused here too.
    pub guard: PeerGuard,
}

/// Who may come in through a listener, and as what: TLS and the grant of
/// a client without a certificate. It is the listener's, not an
/// export's, because a client upgrades (`STARTTLS`) and is admitted
/// before it names the export it wants.
#[derive(Debug, Clone)]
struct Admission {
    /// TLS (`nbd_tls`), when on.
    tls: Option<ExportTls>,
    /// What a client that presents no certificate may do.
    anonymous: Grant,
}

impl Default for Admission {
    /// No TLS, and a client without a certificate may write (as
    /// `attach`'s local socket).
    fn default() -> Self {
        Self {
            tls: None,
            anonymous: Grant::ReadWrite,
        }
    }
}

impl Admission {
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

    /// What `client` may do with any export (S9): decided by its
    /// certificate before anything touches a volume. A client without
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
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export")
            .field("name", &self.name)
            .field("description", &self.description)
            .finish_non_exhaustive()
    }
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
            sessions: std::sync::atomic::AtomicUsize::new(0),
        }
    }

    /// How many clients use this export now (past their handshake).
    pub fn sessions(&self) -> usize {
        self.sessions.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The session a client with `grant` would get now: writable, bound
    /// to the gate's term, only if it may write and while this node's gate
    /// would pass a write; read-only while this node's copy may be read;
    /// else why not (S10).
    fn offer(&self, grant: Grant) -> Result<handshake::Session, DeviceError> {
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
            Access::Refused(why) => Err(why),
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
    /// `NBD_OPT_EXPORT_NAME` named an export this node does not serve
    /// (that option has no error reply), and what the node knows of it.
    #[error("no export named {name:?}: {why}")]
    UnknownExport { name: String, why: String },
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

/// Counters of one NBD listener, all its exports together, for metrics.
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

/// Serves `exports` on `listener` until `stop` turns true; then drops
/// every connection. Exports inserted into or removed from the registry
/// meanwhile are offered, or no longer, to the next client that names one.
pub async fn serve<L: Listener>(
    listener: L,
    exports: Exports,
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
        let (exports, stats) = (exports.clone(), Arc::clone(&stats));
        connections.spawn(async move {
            stats.open.fetch_add(1, Ordering::Relaxed);
            tracing::info!(%peer, "NBD client connected");
            match handle(stream, exports).await {
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
/// `STARTTLS`), in which it picks one of `exports`, then its requests
/// against that export, which it keeps even if the registry drops it.
pub async fn handle<S>(stream: S, exports: Exports) -> Result<(), ConnectionError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (stream, chosen, client) =
        tokio::time::timeout(HANDSHAKE_TIMEOUT, negotiate(stream, &exports))
            .await
            .map_err(|_| ConnectionError::HandshakeTimeout)??;
    let Some((export, session)) = chosen else {
        return Ok(());
    };
    let (reader, writer) = tokio::io::split(stream);
    let mode = if session.writable() {
        "read-write"
    } else {
        "read-only"
    };
    tracing::debug!(export = %export.name, mode, "NBD export opened");
    let admission = exports.admission();
    let _counted = SessionCount::of(&export);
    transmission::run(reader, writer, export, session, client, admission).await
}

/// Counts one client's session on an export while it lives.
struct SessionCount(Arc<Export>);

impl SessionCount {
    fn of(export: &Arc<Export>) -> Self {
        export
            .sessions
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self(Arc::clone(export))
    }
}

impl Drop for SessionCount {
    fn drop(&mut self) {
        self.0
            .sessions
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// What a finished handshake leaves: the stream to serve on, the export
/// and session the client chose (none if it gave up), and who it is.
type Negotiated = (
    Box<dyn Io>,
    Option<(Arc<Export>, handshake::Session)>,
    Client,
);

/// The handshake: option haggling, and the TLS handshake when the client
/// asks for it.
async fn negotiate<S>(stream: S, exports: &Exports) -> Result<Negotiated, ConnectionError>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let mut stream: Box<dyn Io> = Box::new(stream);
    let mut phase = handshake::Phase::Fresh;
    let mut client = Client::Anonymous;
    loop {
        match handshake::negotiate(&mut stream, exports, phase, &client).await? {
            handshake::Step::Session(export, session) => {
                return Ok((stream, Some((export, session)), client));
            }
            handshake::Step::Aborted => return Ok((stream, None, client)),
            handshake::Step::StartTls { no_zeroes } => {
                let (secured, who) = start_tls(stream, &exports.admission()).await?;
                stream = secured;
                client = who;
                phase = handshake::Phase::Secured { no_zeroes };
            }
        }
    }
}

/// The TLS handshake as the server, after the client's `STARTTLS` was
/// acknowledged: the secured stream, and who the client is by its
/// certificate.
async fn start_tls(
    stream: Box<dyn Io>,
    admission: &Admission,
) -> Result<(Box<dyn Io>, Client), ConnectionError> {
    let tls = admission.tls.as_ref().ok_or(ConnectionError::TlsRequired)?;
    let config = tls
        .credentials
        .nbd_server(tls.client_auth)
        .map_err(|err| ConnectionError::Tls(err.to_string()))?;
    let secured = tokio_rustls::TlsAcceptor::from(config)
        .accept(stream)
        .await
        .map_err(|err| ConnectionError::Tls(err.to_string()))?;
    let client = admission.client_of(secured.get_ref().1.peer_certificates());
    match &client {
        Client::Anonymous => tracing::info!("NBD client without a certificate"),
        Client::Certified(identity) => tracing::info!(%identity, "NBD client authenticated"),
        Client::Unnamed(why) => tracing::info!(%why, "NBD client's certificate names nobody"),
    }
    Ok((Box::new(secured), client))
}

#[cfg(test)]
mod tests;
