//! `replica-ha node`: run one node of the cluster until SIGTERM or SIGINT.
//!
//! The flags override the config file ([`crate::node::NodeConfig`]); a
//! wrong configuration, or a data dir of another cluster or node (S8), is
//! exit 2 before anything starts. Everything after that is
//! [`crate::node::run`]'s, whose error names its own exit code.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;

use super::{init_logging, usage_error};
use crate::ids::NodeId;
use crate::node::{self, NodeConfig, Overrides, TlsFile};

/// The flags of `replica-ha node`; they override the config file
/// (`--config`).
#[derive(Args)]
pub struct NodeArgs {
    /// The TOML config file (see README, Configuration).
    #[arg(long)]
    config: Option<PathBuf>,
    /// This node's id (a positive integer).
    #[arg(long)]
    id: Option<u64>,
    /// The cluster id; every node of the cluster uses the same.
    #[arg(long)]
    cluster_id: Option<String>,
    /// gRPC listen address, HOST:PORT.
    #[arg(long)]
    listen: Option<String>,
    /// A cluster member, ID=HOST:PORT; repeat for each (this node too).
    #[arg(long = "peer")]
    peers: Vec<String>,
    /// The replica (block data) service's listen address, HOST:PORT.
    /// Default: the gRPC host, with a port the OS picks; peers ask for it.
    #[arg(long, value_name = "HOST:PORT")]
    data_listen: Option<String>,
    /// A peer's data address, ID=HOST:PORT, where it cannot be asked
    /// (behind a proxy or NAT); repeat for each such peer.
    #[arg(long = "peer-data", value_name = "ID=HOST:PORT")]
    peer_data: Vec<String>,
    /// Where the node keeps its replica and Raft state.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// NBD listen address, HOST:PORT.
    #[arg(long)]
    nbd: Option<String>,
    /// HTTP (metrics, health) listen address, HOST:PORT.
    #[arg(long)]
    http: Option<String>,
    /// Volume size: bytes or with a KiB/MiB/GiB/TiB suffix.
    #[arg(long)]
    size: Option<String>,
    /// The fewest in-sync replicas a write is acknowledged on.
    #[arg(long)]
    min_in_sync: Option<usize>,
    /// How many seconds the writer holds a write or flush while too few
    /// replicas are in sync before failing it with EIO (0: fail at once).
    /// Default 120.
    #[arg(long, value_name = "SECONDS")]
    suspend_timeout: Option<u64>,
    /// While this node is the writer, replace a node's lost incarnation by
    /// the new one that waits (a replaced disk, restarted empty), without
    /// `members replace`, once the old one has been silent for
    /// --auto-replace-after. Off by default.
    #[arg(long)]
    auto_replace: bool,
    /// Seconds the old incarnation must have been silent first (default 60).
    #[arg(long, value_name = "SECONDS")]
    auto_replace_after: Option<u64>,
    /// Spread the writers of the cluster's volumes over the nodes: a
    /// writer that has kept a volume this many seconds hands it to the
    /// node the volume table prefers (each node about as many), once every
    /// copy is in sync. 0 turns it off. Default 30.
    #[arg(long, value_name = "SECONDS")]
    balance_interval: Option<u64>,
    /// The most bytes per second a resync copies to a returning replica
    /// (with KiB/MiB/GiB suffix; 0 for no limit). Default 128MiB.
    #[arg(long)]
    resync_rate: Option<String>,
    /// How many bytes per second of each in-sync replica the writer's
    /// background scrub compares (with KiB/MiB/GiB suffix; 0: only on
    /// request, see `replica-ha scrub`). Default 4MiB.
    #[arg(long)]
    scrub_rate: Option<String>,
    /// Append a line to FILE each time the write gate opens or closes and
    /// each time a write passes it under a later lease deadline: an audit
    /// record of when this node could write (used by cluster/chaos).
    #[arg(long, value_name = "FILE")]
    gate_journal: Option<PathBuf>,
    /// The certificate directory: DIR/ca.crt, DIR/node-ID.crt and
    /// DIR/node-ID.key (see `replica-ha certs`).
    #[arg(long, value_name = "DIR")]
    tls_dir: Option<PathBuf>,
    /// The cluster CA certificate (instead of --tls-dir's).
    #[arg(long, value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    /// This node's certificate (instead of --tls-dir's).
    #[arg(long, value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// This node's private key (instead of --tls-dir's).
    #[arg(long, value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// Run without TLS: nothing is authenticated, and anyone who can reach
    /// the node's ports can write to its replica. For a trusted network
    /// only; the node warns at start, and status and /metrics say so.
    #[arg(long)]
    insecure: bool,
    /// TLS on the NBD export: off (the default, as qemu-nbd and nbdkit),
    /// optional, or require (recommended beyond one machine).
    #[arg(long, value_name = "MODE", value_parser = ["off", "optional", "require"])]
    nbd_tls: Option<String>,
    /// NBD clients must present a certificate from the cluster CA.
    #[arg(long)]
    nbd_client_auth: bool,
}

/// Loads the configuration and runs the node until it is stopped.
pub async fn run(args: NodeArgs) -> ExitCode {
    init_logging();
    let overrides = Overrides {
        id: args.id.map(NodeId),
        cluster_id: args.cluster_id,
        listen: args.listen,
        data_listen: args.data_listen,
        peer_data: args.peer_data,
        data_dir: args.data_dir,
        nbd: args.nbd,
        http: args.http,
        peers: args.peers,
        size: args.size,
        min_in_sync: args.min_in_sync,
        resync_rate: args.resync_rate,
        scrub_rate: args.scrub_rate,
        gate_journal: args.gate_journal,
        suspend_timeout: args.suspend_timeout,
        auto_replace: args.auto_replace,
        auto_replace_after: args.auto_replace_after,
        balance_interval: args.balance_interval,
        insecure: args.insecure,
        tls: TlsFile {
            dir: args.tls_dir,
            ca: args.tls_ca,
            cert: args.tls_cert,
            key: args.tls_key,
        },
        nbd_tls: args.nbd_tls,
        nbd_client_auth: args.nbd_client_auth,
    };
    let config = match NodeConfig::load(args.config.as_deref(), overrides) {
        Ok(config) => config,
        Err(err) => return usage_error(err),
    };
    match node::run(config).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("replica-ha: {err}");
            ExitCode::from(err.exit_code())
        }
    }
}
