//! `replica-ha attach`: serve the volume to local NBD clients on the
//! client's host, following the writer ([`crate::attach`]). What had no
//! answer when the writer changes is sent again to the next one, so a
//! client sees a pause, never an error. The certificate decides whether
//! the volume is writable through it (S9). Stops on SIGTERM or Ctrl-C.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

use super::{ClientTls, failure, init_logging, usage_error};
use crate::attach::AttachConfig;
use crate::ids::NodeId;

/// The flags of `replica-ha attach`: the cluster, the export and how to
/// reach it.
#[derive(Args)]
pub struct AttachArgs {
    /// A node of the cluster, ID=HOST:PORT of its gRPC address; repeat for
    /// each (any one that answers is enough to start).
    #[arg(long = "peer", value_name = "ID=HOST:PORT", required = true)]
    peers: Vec<String>,
    /// The volume (export) name.
    #[arg(long, default_value = "vol0")]
    volume: String,
    /// The unix socket to serve on (mode 0600).
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,
    /// Also serve on this local TCP address.
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

/// Serves the volume until SIGTERM or Ctrl-C; exit 2 for a peer that is
/// not ID=HOST:PORT or no usable client certificate.
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
    let transport = match args.tls.transport() {
        Ok(transport) => transport,
        Err(err) => return usage_error(err),
    };
    let config = AttachConfig {
        peers,
        volume: args.volume,
        socket: args.socket,
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
