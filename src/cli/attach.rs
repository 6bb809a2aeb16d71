//! `replica-ha attach`: serve volumes to local NBD clients on the
//! client's host, each following its own writer ([`crate::attach`]). What
//! had no answer when a writer changes is sent again to the next one, so a
//! client sees a pause, never an error. The certificate decides whether
//! the volumes are writable through it (S9). Stops on SIGTERM or Ctrl-C.
//!
//! One volume: `--volume NAME --socket PATH` (the volume defaults to
//! `vol0`). Several: `--serve NAME=PATH` once per volume, alone or beside
//! the first form.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use super::{ClientTls, failure, init_logging, usage_error};
use crate::attach::{AttachConfig, Serve};
use crate::ids::NodeId;

/// The flags of `replica-ha attach`: the cluster, the volumes and how to
/// reach them.
#[derive(Args)]
#[command(after_help = "Examples:\n  \
    replica-ha attach --peer 1=10.0.0.1:7001 --peer 2=10.0.0.2:7001 --socket /run/vol0.sock\n  \
    replica-ha attach --peer 1=10.0.0.1:7001 --serve db=/run/db.sock --serve logs=/run/logs.sock\n\
    Each volume follows its own writer; a node without a copy of a volume names the nodes \
    that hold it, and attach asks them too.")]
pub struct AttachArgs {
    /// A node of the cluster, ID=HOST:PORT of its gRPC address; repeat for
    /// each (any one that answers is enough to start).
    #[arg(long = "peer", value_name = "ID=HOST:PORT", required = true)]
    peers: Vec<String>,
    /// The volume (export) to serve on --socket [default: vol0].
    #[arg(long, value_name = "NAME", requires = "socket")]
    volume: Option<String>,
    /// The unix socket to serve --volume on (mode 0600).
    #[arg(long, value_name = "PATH", required_unless_present = "serves")]
    socket: Option<PathBuf>,
    /// Serve volume NAME on the unix socket PATH (mode 0600); repeat for
    /// each volume, each on a socket of its own.
    #[arg(long = "serve", id = "serves", value_name = "NAME=PATH")]
    serves: Vec<String>,
    /// Also serve on this local TCP address (loopback only): every volume,
    /// by its export name; the first is the default export.
    #[arg(long, value_name = "HOST:PORT")]
    listen: Option<std::net::SocketAddr>,
    /// How many seconds a request waits for a writer before it fails with
    /// EIO.
    #[arg(long, value_name = "SECONDS", default_value_t = 120)]
    suspend_timeout: u64,
    /// How many seconds to wait at start for a node to answer.
    #[arg(long, value_name = "SECONDS", default_value_t = 30)]
    first_contact: u64,
    #[command(flatten)]
    tls: ClientTls,
}

/// Serves the volumes until SIGTERM or Ctrl-C; exit 2 for a peer that is
/// not ID=HOST:PORT, a `--serve` that is not NAME=PATH, nothing to serve,
/// or no usable client certificate.
pub async fn run(args: AttachArgs) -> ExitCode {
    init_logging();
    let mut peers = std::collections::BTreeMap::new();
    for entry in &args.peers {
        let parsed = entry
            .split_once('=')
            .and_then(|(id, addr)| Some((id.trim().parse::<NodeId>().ok()?, addr.trim())));
        match parsed {
            Some((id, addr)) if id != NodeId(0) && addr.parse::<std::net::SocketAddr>().is_ok() => {
                peers.insert(id, addr.to_string());
            }
            _ => return usage_error(format!("peer {entry:?} is not ID=HOST:PORT")),
        }
    }
    let serves = match serves(args.volume, args.socket, &args.serves) {
        Ok(serves) => serves,
        Err(why) => return usage_error(why),
    };
    let transport = match args.tls.transport() {
        Ok(transport) => transport,
        Err(err) => return usage_error(err),
    };
    let config = AttachConfig {
        peers,
        serves,
        listen: args.listen,
        suspend_timeout: Duration::from_secs(args.suspend_timeout),
        transport,
        first_contact: Duration::from_secs(args.first_contact),
    };
    match crate::attach::run(config, stopped()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => failure(err),
    }
}

/// The volumes to serve: `--volume`/`--socket` first, then each
/// `--serve NAME=PATH`.
fn serves(
    volume: Option<String>,
    socket: Option<PathBuf>,
    entries: &[String],
) -> Result<Vec<Serve>, String> {
    let mut serves: Vec<Serve> = socket
        .map(|socket| Serve {
            volume: volume.unwrap_or_else(|| "vol0".into()),
            socket,
        })
        .into_iter()
        .collect();
    for entry in entries {
        match entry.split_once('=') {
            Some((name, path)) if !name.trim().is_empty() && !path.trim().is_empty() => serves
                .push(Serve {
                    volume: name.trim().to_string(),
                    socket: PathBuf::from(path.trim()),
                }),
            _ => return Err(format!("--serve {entry:?} is not NAME=PATH")),
        }
    }
    if serves.is_empty() {
        return Err("nothing to serve: give --socket PATH, or --serve NAME=PATH".into());
    }
    Ok(serves)
}

/// Resolves on SIGTERM or Ctrl-C; never where SIGTERM cannot be caught
/// (the signals then end the process as they do by default).
async fn stopped() {
    let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_single_form_and_serve_pairs_make_one_list() {
        let made = serves(
            Some("db".into()),
            Some("/run/db.sock".into()),
            &["logs=/run/logs.sock".into()],
        )
        .unwrap();
        assert_eq!(
            made,
            vec![
                Serve {
                    volume: "db".into(),
                    socket: "/run/db.sock".into()
                },
                Serve {
                    volume: "logs".into(),
                    socket: "/run/logs.sock".into()
                }
            ]
        );
        let single = serves(None, Some("/s".into()), &[]).unwrap();
        assert_eq!(single[0].volume, "vol0");
        for bad in ["db", "=/x", "db=", ""] {
            assert!(serves(None, None, &[bad.into()]).is_err(), "{bad:?}");
        }
        assert!(serves(None, None, &[]).is_err());
    }
}
