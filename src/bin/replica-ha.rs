//! The `replica-ha` command line: run a node, ask a node for its status,
//! hand leadership over, inspect a replica offline.
//!
//! This file defines the commands and dispatches them; each command's
//! flags and work are in a file of its own under `src/cli/`
//! ([`replica_ha::cli`]), with what they share.
//!
//! Exit codes: 0 success, 1 a runtime failure (a node unreachable, a failed
//! transfer), 2 a usage or configuration error.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use replica_ha::certs::CertsCommand;
use replica_ha::cli::attach::AttachArgs;
use replica_ha::cli::inspect::InspectArgs;
use replica_ha::cli::members::MembersArgs;
use replica_ha::cli::node::NodeArgs;
use replica_ha::cli::resize::ResizeArgs;
use replica_ha::cli::resync::ResyncArgs;
use replica_ha::cli::scrub::ScrubArgs;
use replica_ha::cli::status::StatusArgs;
use replica_ha::cli::transfer::TransferArgs;
use replica_ha::cli::volume::VolumeArgs;
use replica_ha::cli::{self, failure};

#[derive(Parser)]
#[command(
    name = "replica-ha",
    version,
    about = "A replicated block volume with one fenced writer, chosen by embedded Raft."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a node. All nodes of a cluster start with the same peer list; the
    /// cluster forms by itself (no init step). Flags override the config
    /// file. SIGTERM resigns leadership and stops cleanly.
    Node(Box<NodeArgs>),
    /// Make the cluster's certificate authority and issue node and client
    /// certificates for mutual TLS (see README, Security).
    #[command(subcommand)]
    Certs(CertsCommand),
    /// Show a node's view: its role (follower, fence_pending, leader) and
    /// whether its write gate is open, Raft state, term, leader, lease, live
    /// members, the last promoted writer, the in-sync set, whether this node
    /// serves reads (a passive node only while its replica is in the
    /// committed in-sync set), each replica's state, fence floor and dirty
    /// marks, and the NBD export to use. Any node answers; exit 1 if it
    /// cannot be reached.
    Status(StatusArgs),
    /// List the cluster's members as a node's committed membership names
    /// them: id, address, incarnation (a new one for each new data dir),
    /// voter or learner, live, in-sync. With a subcommand, change the
    /// membership (ask the writer; needs an admin certificate).
    Members(MembersArgs),
    /// Hand leadership to another node (graceful switchover). Ask the current
    /// leader; the command returns once the named node leads.
    Transfer(TransferArgs),
    /// Ask the writer to scrub: compare every extent's BLAKE3 digest on all
    /// in-sync replicas and repair a copy that differs from the majority
    /// (or, with no majority, from the writer's copy, saving the replaced
    /// bytes in the writer's DATA_DIR/scrub-kept/). Without --now the pass
    /// starts once a running one ends, at the node's scrub_rate (full speed
    /// if that is 0); `status` shows its progress. Ask the writer; needs an
    /// admin certificate.
    Scrub(ScrubArgs),
    /// Ask the writer to rebuild an out-of-sync replica in full: every
    /// extent compared with an in-sync copy, instead of only those its
    /// missed-write map names (use it when you doubt that copy's disk). A
    /// rebuild of it that is running starts over. A replica in the in-sync
    /// set is refused (`replica-ha scrub --now` compares those). Ask the
    /// writer; needs an admin certificate.
    Resync(ResyncArgs),
    /// Grow the volume online: every in-sync replica grows its copy, the
    /// new size is committed through Raft, and the writer's NBD export
    /// offers it to new connections. A connected client keeps the size it
    /// connected with until it reconnects. A replica that is down meanwhile
    /// grows when it is rebuilt. Shrinking is refused. Ask the writer;
    /// needs an admin certificate.
    Resize(ResizeArgs),
    /// The cluster's volumes: create, list, show, delete. Each volume has
    /// its own Raft group, whose leader is its writer; its NBD export name
    /// is its name.
    Volume(VolumeArgs),
    /// Serve volumes to local NBD clients, each following its own writer:
    /// run it on the client's host and point qemu, nbdcopy, nbdfuse or
    /// nbd-client at a volume's unix socket (--socket for one, --serve
    /// NAME=PATH for each of several). When a writer changes it sends what
    /// had no answer again to the next writer, so the client sees a pause,
    /// never an error. Stops on SIGTERM.
    Attach(Box<AttachArgs>),
    /// Show a replica data directory offline: identity, fence floor and the
    /// extents each writer's term may have left dirty. The node that owns
    /// the directory must be stopped (the metadata is locked while it runs).
    Inspect(InspectArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        // The data plane yields the CPU to Raft's threads (see
        // `raft::runtime`).
        .on_thread_start(replica_ha::raft::runtime::data_plane_thread)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => return failure(format!("cannot start the runtime: {err}")),
    };
    runtime.block_on(dispatch(cli))
}

async fn dispatch(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Node(args) => cli::node::run(*args).await,
        Command::Certs(command) => cli::certs::run(command),
        Command::Status(args) => cli::status::run(args).await,
        Command::Members(args) => cli::members::run(args).await,
        Command::Transfer(args) => cli::transfer::run(args).await,
        Command::Scrub(args) => cli::scrub::run(args).await,
        Command::Resync(args) => cli::resync::run(args).await,
        Command::Resize(args) => cli::resize::run(args).await,
        Command::Volume(args) => cli::volume::run(args).await,
        Command::Attach(args) => cli::attach::run(*args).await,
        Command::Inspect(args) => cli::inspect::run(args).await,
    }
}
