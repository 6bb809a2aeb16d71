//! `replica-ha attach`: the client side of the volume (design C3).
//!
//! It runs on the client's host and serves the volume to any unmodified NBD
//! client, on a unix socket and, if asked, on a local TCP port. It finds
//! the writer itself, from every peer's `WatchLeader` stream ([`watch`]),
//! and sends each request to that writer's NBD export ([`follow`]). When
//! the writer changes (a crash, a transfer, a restart), the requests that
//! have no answer are sent again, in order, to the next writer, and the
//! local client sees nothing but a pause: never an error for a writer
//! change, never a dropped connection. A request waits at most the
//! suspend timeout for a writer; then it fails with `EIO`. Nothing a
//! writer does (freezing, vanishing, never greeting) keeps `attach` from
//! seeing the next one: every wait on a writer is bounded or runs beside
//! the watch ([`follow`]).
//!
//! One `attach` serves one or more volumes, each on a unix socket of its
//! own ([`Serve`]), each following its own writer: every volume of the
//! table has its own group and writer, so each is watched by name
//! (`WatchLeader` names it) and its requests go to the export of that name
//! on its writer. A volume's failover is its own: the others' requests
//! flow on. The TCP listener, when asked for, offers every volume by its
//! export name (the first is the default export).
//!
//! Downstream each socket offers one export, whatever node it talks to:
//! the volume's name and size, writable, with flush, FUA, trim and write
//! zeroes, multi-connection safe. The size is the volume's latest: after
//! a resize, connections opened from then on are offered the new size
//! (as the nodes do); open ones keep theirs. It shares the NBD server and
//! wire code with the node ([`crate::nbd`]); Raft and the replica store
//! stay out of it.
//!
//! With TLS (the default) it presents a client certificate of the cluster
//! CA: to `WatchLeader` (a viewer's is enough there), and to the writer's
//! export, which it opens with `NBD_OPT_STARTTLS` (the nodes need `nbd_tls =
//! "optional"` or `"require"`), checking that the server is the node the
//! watchers named. The export is writable only for a certificate whose role
//! writes (`user` or `admin`, S9); with a viewer's, the writer refuses each
//! write with `EPERM`, which `attach` passes on. A TLS configuration that
//! cannot be built is an error, never plaintext.

pub mod follow;
pub mod watch;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinSet;

use crate::ids::NodeId;
use crate::nbd::{Export, Exports, NbdStats};
use crate::net::Transport;
use follow::{Following, Upstream};

/// How long `attach` waits at start, by default, for any node to tell it
/// the volume's size.
pub const FIRST_CONTACT: Duration = Duration::from_secs(30);

/// What `attach` runs with.
#[derive(Debug, Clone)]
pub struct AttachConfig {
    /// Every node it may ask, by id: their gRPC addresses.
    pub peers: BTreeMap<NodeId, String>,
    /// The volumes to serve, each on its socket (at least one).
    pub serves: Vec<Serve>,
    /// A local TCP address to serve every volume on as well, by name.
    pub listen: Option<SocketAddr>,
    /// How long a request waits for a writer before it fails.
    pub suspend_timeout: Duration,
    /// How it reaches the nodes (TLS with a client certificate, or plain).
    pub transport: Transport,
    /// How long it waits at start for a node to answer.
    pub first_contact: Duration,
}

/// One volume `attach` serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Serve {
    /// The export to open on the volume's writer and to offer locally:
    /// the volume's name.
    pub volume: String,
    /// The unix socket to serve it on.
    pub socket: PathBuf,
}

/// Why `attach` could not run.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    #[error(
        "no node of {peers} answered for volume {volume} within {waited:?} (check the addresses, \
         the volume's name and the certificate)"
    )]
    NoContact {
        peers: String,
        volume: String,
        waited: Duration,
    },
    #[error("{what} {path}: {source}")]
    Socket {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "--listen {0} is not a loopback address: attach serves the volume writable to \
         whoever connects, with its own certificate, so it listens on this host only \
         (127.0.0.1 or [::1]); use the unix socket, or a node's NBD export with TLS"
    )]
    Exposed(SocketAddr),
    #[error("{0}")]
    Serves(String),
}

/// Checks that `serves` names at least one volume, and each volume and
/// socket once.
fn check_serves(serves: &[Serve]) -> Result<(), AttachError> {
    if serves.is_empty() {
        return Err(AttachError::Serves("no volume to serve".into()));
    }
    let mut volumes = std::collections::BTreeSet::new();
    let mut sockets = std::collections::BTreeSet::new();
    for serve in serves {
        if !volumes.insert(&serve.volume) {
            return Err(AttachError::Serves(format!(
                "volume {:?} is served twice: one socket per volume",
                serve.volume
            )));
        }
        if !sockets.insert(&serve.socket) {
            return Err(AttachError::Serves(format!(
                "socket {} is given twice: one volume per socket",
                serve.socket.display()
            )));
        }
    }
    Ok(())
}

/// Watches every volume of `config` and waits, for all at once up to
/// `first_contact`, until a node told each one's size; returns each
/// volume's watch with its size.
async fn first_contact(
    config: &AttachConfig,
    tasks: &mut JoinSet<()>,
) -> Result<Vec<(tokio::sync::watch::Receiver<watch::Seen>, u64)>, AttachError> {
    let seens: Vec<_> = config
        .serves
        .iter()
        .map(|serve| watch::spawn(&config.transport, &config.peers, &serve.volume, tasks))
        .collect();
    let waited = config.first_contact;
    let sized = seens.into_iter().map(|mut seen| async move {
        let size = tokio::time::timeout(waited, seen.wait_for(|s| s.size.is_some()))
            .await
            .ok()
            .and_then(|seen| seen.ok().and_then(|s| s.size));
        (seen, size)
    });
    let mut found = Vec::new();
    for ((seen, size), serve) in futures::future::join_all(sized)
        .await
        .into_iter()
        .zip(&config.serves)
    {
        let size = size.ok_or_else(|| AttachError::NoContact {
            peers: config
                .peers
                .values()
                .cloned()
                .collect::<Vec<_>>()
                .join(", "),
            volume: serve.volume.clone(),
            waited,
        })?;
        found.push((seen, size));
    }
    Ok(found)
}

/// Binds every volume's socket; none is left behind when one fails.
fn bind_sockets(serves: &[Serve]) -> Result<Vec<tokio::net::UnixListener>, AttachError> {
    let mut bound = Vec::new();
    for serve in serves {
        match bind_socket(&serve.socket) {
            Ok(listener) => bound.push(listener),
            Err(err) => {
                for earlier in &serves[..bound.len()] {
                    let _ = std::fs::remove_file(&earlier.socket);
                }
                return Err(err);
            }
        }
    }
    Ok(bound)
}

/// Serves the volumes until `stop` resolves; then stops taking
/// connections, and removes the sockets.
pub async fn run(
    config: AttachConfig,
    stop: impl std::future::Future<Output = ()>,
) -> Result<(), AttachError> {
    if let Some(addr) = config.listen.filter(|addr| !addr.ip().is_loopback()) {
        return Err(AttachError::Exposed(addr));
    }
    check_serves(&config.serves)?;
    let mut tasks = JoinSet::new();
    let contacts = first_contact(&config, &mut tasks).await?;
    let every = Exports::new();
    let mut locals = Vec::new();
    for ((seen, size), serve) in contacts.into_iter().zip(&config.serves) {
        let following = Following::start(
            seen,
            size,
            Upstream {
                export: serve.volume.clone(),
                tls: config.transport.tls().cloned(),
                suspend_timeout: config.suspend_timeout,
            },
            &mut tasks,
        );
        let export = Arc::new(Export::new(
            &serve.volume,
            format!("replica-ha volume {} through attach", serve.volume),
            Arc::new(following),
        ));
        every.insert(Arc::clone(&export));
        locals.push(Exports::single(export));
        tracing::info!(
            volume = %serve.volume,
            socket = %serve.socket.display(),
            size,
            "serving the volume; following its writer"
        );
    }
    if let Some(first) = config.serves.first() {
        every.set_default(first.volume.as_str());
    }
    let sockets = bind_sockets(&config.serves)?;
    let (stopping, stopped) = tokio::sync::watch::channel(false);
    let stats = Arc::new(NbdStats::default());
    let mut servers = JoinSet::new();
    for (unix, exports) in sockets.into_iter().zip(locals) {
        servers.spawn(crate::nbd::serve(
            unix,
            exports,
            Arc::clone(&stats),
            stopped.clone(),
        ));
    }
    let tcp = match config.listen {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| AttachError::Listen { addr, source }),
        ),
        None => None,
    };
    match tcp {
        Some(Err(err)) => {
            stopping.send_replace(true);
            remove_sockets(&config.serves);
            return Err(err);
        }
        Some(Ok(tcp)) => {
            tracing::info!(listen = ?config.listen, "serving every volume by name on TCP too");
            servers.spawn(crate::nbd::serve(tcp, every, stats, stopped));
        }
        None => {}
    }
    stop.await;
    stopping.send_replace(true);
    while servers.join_next().await.is_some() {}
    tasks.shutdown().await;
    remove_sockets(&config.serves);
    Ok(())
}

/// Removes every volume's socket.
fn remove_sockets(serves: &[Serve]) {
    for serve in serves {
        let _ = std::fs::remove_file(&serve.socket);
    }
}

/// Binds the unix socket, replacing a stale one (a socket file nothing
/// listens on); only this user may connect.
fn bind_socket(path: &std::path::Path) -> Result<tokio::net::UnixListener, AttachError> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let failed = |what, source| AttachError::Socket {
        what,
        path: path.to_owned(),
        source,
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(failed(
                "refusing to replace",
                std::io::Error::new(std::io::ErrorKind::AlreadyExists, "not a socket"),
            ));
        }
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(failed(
                "another attach serves on",
                std::io::Error::new(std::io::ErrorKind::AddrInUse, "in use"),
            ));
        }
        std::fs::remove_file(path).map_err(|e| failed("removing the stale socket", e))?;
    }
    let listener = tokio::net::UnixListener::bind(path).map_err(|e| failed("binding", e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))
        .map_err(|e| failed("restricting", e))?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `attach` writes with its own certificate for whoever connects, so
    /// it never listens beyond this host (S9).
    #[tokio::test]
    async fn attach_refuses_to_listen_beyond_loopback() {
        let dir = tempfile::tempdir().unwrap();
        let config = |listen: &str| AttachConfig {
            peers: BTreeMap::new(),
            serves: vec![Serve {
                volume: "vol0".into(),
                socket: dir.path().join("attach.sock"),
            }],
            listen: Some(listen.parse().unwrap()),
            suspend_timeout: Duration::from_secs(1),
            transport: Transport::default(),
            first_contact: Duration::from_millis(10),
        };
        for exposed in ["0.0.0.0:10900", "[::]:10900", "192.0.2.1:10900"] {
            let refused = run(config(exposed), std::future::ready(())).await;
            assert!(
                matches!(refused, Err(AttachError::Exposed(_))),
                "{exposed}: {refused:?}"
            );
        }
        // On loopback it goes on (and, with no peer, finds nobody).
        let loopback = run(config("127.0.0.1:0"), std::future::ready(())).await;
        assert!(!matches!(loopback, Err(AttachError::Exposed(_))));
    }

    #[test]
    fn each_volume_and_each_socket_is_served_once() {
        let serve = |volume: &str, socket: &str| Serve {
            volume: volume.into(),
            socket: socket.into(),
        };
        assert!(check_serves(&[serve("a", "/a"), serve("b", "/b")]).is_ok());
        for (serves, why) in [
            (vec![], "no volume"),
            (vec![serve("a", "/a"), serve("a", "/b")], "served twice"),
            (vec![serve("a", "/a"), serve("b", "/a")], "given twice"),
        ] {
            let err = check_serves(&serves).unwrap_err().to_string();
            assert!(err.contains(why), "{err}");
        }
    }
}
