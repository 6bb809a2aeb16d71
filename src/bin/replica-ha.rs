//! The `replica-ha` command line: run a node, ask a node for its status,
//! hand leadership over, inspect a replica offline.
//!
//! Exit codes: 0 success, 1 a runtime failure (a node unreachable, a failed
//! transfer), 2 a usage or configuration error.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use replica_ha::api::status::{StatusJson, Table, Watch, member_line};
use replica_ha::certs::{self, CertsCommand, TlsFiles};
use replica_ha::ids::NodeId;
use replica_ha::net::tls::Party;
use replica_ha::net::{Expect, Limits, Tls, Transport};
use replica_ha::node::{self, NodeConfig, Overrides, TlsFile};
use replica_ha::proto::admin::admin_client::AdminClient;
use replica_ha::proto::admin::{
    MembersChange, MembersRequest, ResizeRequest, ResyncRequest, ScrubRequest, StatusReply,
    StatusRequest, TransferRequest,
};
use replica_ha::replica::{ReplicaStore, StoreIdentity};

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
    Status {
        /// The node's gRPC address.
        #[arg(long, default_value = "127.0.0.1:7001")]
        addr: String,
        /// Print one JSON object instead of a table (for scripts; the keys
        /// are those of the table, plus `replicas` as a list).
        #[arg(long, conflicts_with = "watch")]
        json: bool,
        /// Keep a live view on the terminal, refreshed once a second: role,
        /// term, gate, lease, I/O, write rate, scrub, and every replica with
        /// its state and resync progress. It keeps trying while the node
        /// cannot be reached (during its restart, say). Ctrl-C ends it.
        #[arg(long)]
        watch: bool,
        #[command(flatten)]
        tls: ClientTls,
    },
    /// List the cluster's members as a node's committed membership names
    /// them: id, address, incarnation (a new one for each new data dir),
    /// voter or learner, live, in-sync. With a subcommand, change the
    /// membership (ask the writer; needs an admin certificate).
    Members {
        /// The gRPC address of the node to ask (the writer, for a change).
        /// Give it before the subcommand: `add` has an `--addr` of its own,
        /// the new node's.
        #[arg(long, default_value = "127.0.0.1:7001")]
        addr: String,
        #[command(subcommand)]
        change: Option<MembersCommand>,
        #[command(flatten)]
        tls: ClientTls,
    },
    /// Hand leadership to another node (graceful switchover). Ask the current
    /// leader; the command returns once the named node leads.
    Transfer {
        /// The current leader's gRPC address.
        #[arg(long)]
        addr: String,
        /// The node id to hand leadership to.
        #[arg(long)]
        to: u64,
        #[command(flatten)]
        tls: ClientTls,
    },
    /// Ask the writer to scrub: compare every extent's BLAKE3 digest on all
    /// in-sync replicas and repair a copy that differs from the majority
    /// (or, with no majority, from the writer's copy, saving the replaced
    /// bytes in the writer's DATA_DIR/scrub-kept/). Without --now the pass
    /// starts once a running one ends, at the node's scrub_rate (full speed
    /// if that is 0); `status` shows its progress. Ask the writer; needs an
    /// admin certificate.
    Scrub {
        /// The writer's gRPC address.
        #[arg(long, default_value = "127.0.0.1:7001")]
        addr: String,
        /// End a paced pass that is running, run one at full speed, wait for
        /// it and print what differed. Exit 0 when every extent was compared
        /// and every copy agreed or was repaired, 1 otherwise.
        #[arg(long)]
        now: bool,
        #[command(flatten)]
        tls: ClientTls,
    },
    /// Ask the writer to rebuild an out-of-sync replica in full: every
    /// extent compared with an in-sync copy, instead of only those its
    /// missed-write map names (use it when you doubt that copy's disk). A
    /// rebuild of it that is running starts over. A replica in the in-sync
    /// set is refused (`replica-ha scrub --now` compares those). Ask the
    /// writer; needs an admin certificate.
    Resync {
        /// The writer's gRPC address.
        #[arg(long, default_value = "127.0.0.1:7001")]
        addr: String,
        /// The replica's node id.
        #[arg(long)]
        id: u64,
        /// Compare every extent (the only kind of rebuild that can be asked
        /// for; without it the command refuses).
        #[arg(long)]
        full: bool,
        #[command(flatten)]
        tls: ClientTls,
    },
    /// Grow the volume online: every in-sync replica grows its copy, the
    /// new size is committed through Raft, and the writer's NBD export
    /// offers it to new connections. A connected client keeps the size it
    /// connected with until it reconnects. A replica that is down meanwhile
    /// grows when it is rebuilt. Shrinking is refused. Ask the writer;
    /// needs an admin certificate.
    Resize {
        /// The writer's gRPC address.
        #[arg(long, default_value = "127.0.0.1:7001")]
        addr: String,
        /// The new size: bytes, or with a unit (KiB, MiB, GiB, TiB), a
        /// multiple of 512 and at least the current size.
        #[arg(long, value_parser = parse_volume_size)]
        size: u64,
        #[command(flatten)]
        tls: ClientTls,
    },
    /// Serve the volume to local NBD clients, following the writer: run it
    /// on the client's host and point qemu, nbdcopy, nbdfuse or nbd-client
    /// at its unix socket. When the writer changes it sends what had no
    /// answer again to the next writer, so the client sees a pause, never
    /// an error. Stops on SIGTERM.
    Attach(Box<AttachArgs>),
    /// Show a replica data directory offline: identity, fence floor and the
    /// extents each writer's term may have left dirty. The node that owns
    /// the directory must be stopped (the metadata is locked while it runs).
    Inspect {
        /// The replica's data directory (holds volume.img and meta/).
        #[arg(long)]
        data_dir: PathBuf,
        /// The cluster id the directory must belong to.
        #[arg(long)]
        cluster_id: String,
        /// The volume name.
        #[arg(long, default_value = "vol0")]
        volume: String,
        /// Accepted for older scripts and otherwise ignored: inspect shows
        /// the size recorded in the directory (the volume may have grown
        /// since its config was written) and never changes the directory.
        #[arg(long, hide = true)]
        size: Option<u64>,
    },
}

/// A change to the membership, made through Raft's joint consensus.
#[derive(Subcommand)]
enum MembersCommand {
    /// Bring back a node whose data dir was lost: swap its old incarnation
    /// for the new one that is running and waiting (its `status` says
    /// "replaced disk: waiting to be re-added"). Its replica leaves the
    /// in-sync set first, joins as a learner, is rebuilt in full, and only
    /// then counts toward writes (S5, S8).
    Replace {
        /// The node's id.
        #[arg(long)]
        id: u64,
    },
    /// Add a new node, running with this cluster's peer list and waiting:
    /// it joins as a learner, catches up on Raft, its replica is rebuilt by
    /// resync, and then it becomes a voter. Returns once it votes.
    Add {
        /// The new node's id.
        #[arg(long)]
        id: u64,
        /// Its gRPC address, HOST:PORT.
        #[arg(long)]
        addr: String,
    },
    /// Remove a node. Its replica leaves the in-sync set through a
    /// committed change first; removing the writer's own node hands
    /// leadership over first. Refused if fewer members than min_in_sync
    /// would remain.
    Remove {
        /// The node's id.
        #[arg(long)]
        id: u64,
    },
}

/// How the CLI authenticates to a node: a client certificate of the
/// cluster CA (role `viewer` to read, `admin` to change; `attach` needs
/// `user` or `admin` to write the volume). `cluster/up`
/// prints the exact flags (or the environment) to use.
#[derive(Args)]
struct ClientTls {
    /// The certificate directory: DIR/ca.crt and, with --as NAME,
    /// DIR/NAME.crt and DIR/NAME.key.
    #[arg(long, global = true, value_name = "DIR", env = "REPLICA_HA_TLS_DIR")]
    tls_dir: Option<PathBuf>,
    /// The client certificate's name in --tls-dir.
    #[arg(long = "as", global = true, value_name = "NAME", env = "REPLICA_HA_AS")]
    name: Option<String>,
    /// The cluster CA certificate (instead of --tls-dir's).
    #[arg(long, global = true, value_name = "FILE")]
    ca: Option<PathBuf>,
    /// The client certificate (instead of --tls-dir's).
    #[arg(long, global = true, value_name = "FILE")]
    cert: Option<PathBuf>,
    /// The client certificate's key (instead of --tls-dir's).
    #[arg(long, global = true, value_name = "FILE")]
    key: Option<PathBuf>,
    /// Connect without TLS, to a node that runs with `insecure = true`.
    #[arg(long, global = true, env = "REPLICA_HA_INSECURE")]
    insecure: bool,
}

impl ClientTls {
    /// The transport these flags describe; an error says what is missing.
    fn transport(&self) -> Result<Transport, String> {
        if self.insecure {
            return Ok(Transport::plain(Limits::default()));
        }
        let default = match (&self.tls_dir, &self.name) {
            (Some(dir), Some(name)) => Some(TlsFiles::for_client(dir, name)),
            (Some(dir), None) if self.cert.is_some() && self.key.is_some() => {
                Some(TlsFiles::for_client(dir, "unnamed"))
            }
            (Some(_), None) => {
                return Err("--tls-dir needs --as NAME (the client certificate's name)".into());
            }
            (None, _) => None,
        };
        let files = TlsFiles::with_overrides(
            default,
            self.ca.clone(),
            self.cert.clone(),
            self.key.clone(),
        )
        .ok_or(
            "no client certificate: pass --tls-dir DIR --as NAME (or --ca, --cert and --key), \
             or --insecure for a node without TLS",
        )?;
        let ca_pem = std::fs::read(files.ca())
            .map_err(|e| format!("reading {}: {e}", files.ca().display()))?;
        let cluster = certs::cluster_id_of_ca(&ca_pem)
            .map_err(|e| format!("{}: {e}", files.ca().display()))?;
        let tls = Tls::load(files, &cluster, Party::Client).map_err(|e| e.to_string())?;
        Ok(Transport::secured(Limits::default(), tls))
    }
}

#[derive(Args)]
struct AttachArgs {
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

#[derive(Args)]
struct NodeArgs {
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
        Err(err) => {
            eprintln!("replica-ha: cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(dispatch(cli))
}

async fn dispatch(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Node(args) => run_node(*args).await,
        Command::Certs(command) => match certs::run(command) {
            Ok(report) => {
                println!("{report}");
                ExitCode::SUCCESS
            }
            Err(err) => {
                eprintln!("replica-ha: {err}");
                ExitCode::from(2)
            }
        },
        Command::Attach(args) => attach(*args).await,
        Command::Status {
            addr,
            watch: true,
            tls,
            ..
        } => watch_status(&addr, &tls).await,
        Command::Status {
            addr, json, tls, ..
        } => status(&addr, json, &tls).await,
        Command::Transfer { addr, to, tls } => transfer(&addr, to, &tls).await,
        Command::Members {
            addr,
            change: None,
            tls,
        } => list_members(&addr, &tls).await,
        Command::Members {
            addr,
            change: Some(change),
            tls,
        } => change_members(&addr, change, &tls).await,
        Command::Scrub { addr, now, tls } => scrub(&addr, now, &tls).await,
        Command::Resize { addr, size, tls } => resize(&addr, size, &tls).await,
        Command::Resync {
            addr,
            id,
            full,
            tls,
        } => resync(&addr, id, full, &tls).await,
        Command::Inspect {
            data_dir,
            cluster_id,
            volume,
            size: _,
        } => {
            // The smallest valid size: opening never grows a store past what
            // it recorded, so inspect changes nothing.
            inspect(data_dir, StoreIdentity::new(cluster_id, volume, 512)).await
        }
    }
}

async fn inspect(dir: PathBuf, identity: StoreIdentity) -> ExitCode {
    if !dir.join("meta").exists() {
        eprintln!("replica-ha: {} holds no replica", dir.display());
        return ExitCode::from(2);
    }
    let store = match ReplicaStore::open(&dir, identity).await {
        Ok(store) => store,
        Err(err) => {
            eprintln!("replica-ha: {}: {err}", dir.display());
            return ExitCode::from(2);
        }
    };
    let id = store.identity();
    println!("cluster_id   {}", id.cluster_id);
    println!("volume       {}", id.volume);
    println!("size         {}", store.size());
    println!("extent_size  {}", id.extent_size);
    println!("fence_floor  {}", store.floor().await);
    match store.dirty_extents() {
        Ok(dirty) => {
            println!("dirty        {}", dirty.len());
            for mark in dirty {
                println!("  term {:>6}  extent {}", mark.term, mark.extent);
            }
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("replica-ha: {err}");
            ExitCode::FAILURE
        }
    }
}

fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,openraft=warn".into()),
        )
        .with_writer(std::io::stderr)
        .try_init();
}

async fn attach(args: AttachArgs) -> ExitCode {
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
            _ => {
                eprintln!("replica-ha: peer {entry:?} is not ID=HOST:PORT");
                return ExitCode::from(2);
            }
        }
    }
    let transport = match args.tls.transport() {
        Ok(transport) => transport,
        Err(err) => {
            eprintln!("replica-ha: {err}");
            return ExitCode::from(2);
        }
    };
    let config = replica_ha::attach::AttachConfig {
        peers,
        volume: args.volume,
        socket: args.socket,
        listen: args.listen,
        suspend_timeout: Duration::from_secs(args.suspend_timeout),
        transport,
        first_contact: Duration::from_secs(args.first_contact),
    };
    let stop = async {
        let Ok(mut term) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        else {
            return std::future::pending().await;
        };
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    };
    match replica_ha::attach::run(config, stop).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("replica-ha: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn run_node(args: NodeArgs) -> ExitCode {
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
        Err(err) => {
            eprintln!("replica-ha: {err}");
            return ExitCode::from(2);
        }
    };
    match node::run(config).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("replica-ha: {err}");
            ExitCode::from(err.exit_code())
        }
    }
}

fn admin_client(
    addr: &str,
    tls: &ClientTls,
) -> Result<AdminClient<tonic::transport::Channel>, String> {
    tls.transport()?
        .client(addr, Expect::AnyNode, AdminClient::new)
        .map_err(|e| e.to_string())
}

/// One line saying why a call failed: the server's reason, or the
/// transport's (a refused certificate shows up there).
fn describe(status: &tonic::Status) -> String {
    let mut line = status.message().to_string();
    let mut source = std::error::Error::source(status);
    while let Some(cause) = source {
        let text = cause.to_string();
        if !line.contains(&text) {
            line = format!("{line}: {text}");
        }
        source = cause.source();
    }
    line
}

/// One `Status` call to `addr`.
async fn fetch_status(addr: &str, tls: &ClientTls) -> Result<StatusReply, String> {
    let mut client = admin_client(addr, tls)?;
    let mut request = tonic::Request::new(StatusRequest {});
    request.set_timeout(Duration::from_secs(3));
    client
        .status(request)
        .await
        .map(|r| r.into_inner())
        .map_err(|s| describe(&s))
}

async fn status(addr: &str, json: bool, tls: &ClientTls) -> ExitCode {
    match fetch_status(addr, tls).await {
        Ok(reply) if json => {
            println!("{}", StatusJson::new(&reply));
            ExitCode::SUCCESS
        }
        Ok(reply) => {
            print!("{}", Table(&reply));
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("replica-ha: cannot reach {addr}: {err}");
            ExitCode::FAILURE
        }
    }
}

/// `status --watch`: the live view, redrawn once a second until Ctrl-C.
async fn watch_status(addr: &str, tls: &ClientTls) -> ExitCode {
    let mut watch = Watch::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = tokio::signal::ctrl_c() => return ExitCode::SUCCESS,
        }
        let now = std::time::Instant::now();
        let view = match fetch_status(addr, tls).await {
            Ok(reply) => watch.frame(&reply, now, unix_now()),
            Err(err) => watch.unreachable(addr, &err),
        };
        // Clear the screen and draw from the top.
        print!("\x1b[2J\x1b[H{view}");
        use std::io::Write;
        let _ = std::io::stdout().flush();
    }
}

/// Seconds since the Unix epoch, now.
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn scrub(addr: &str, now: bool, tls: &ClientTls) -> ExitCode {
    let outcome = async {
        let mut client = admin_client(addr, tls)?;
        let mut request = tonic::Request::new(ScrubRequest { now });
        // A pass at full speed reads every replica once: allow an hour.
        request.set_timeout(Duration::from_secs(if now { 3600 } else { 10 }));
        client
            .scrub(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| describe(&s))
    }
    .await;
    let reply = match outcome {
        Ok(reply) => reply,
        Err(err) => {
            eprintln!("replica-ha: scrub failed: {err}");
            return ExitCode::FAILURE;
        }
    };
    if !now {
        println!("scrub started; `replica-ha status` shows its progress");
        return ExitCode::SUCCESS;
    }
    for f in &reply.findings {
        let differing: Vec<String> = f.differing.iter().map(u64::to_string).collect();
        let outcome = if f.repaired {
            "repaired"
        } else {
            "NOT repaired"
        };
        let majority = if f.majority {
            ""
        } else {
            " (no majority: the writer's copy was kept; the replaced copies are saved on the writer, see its log)"
        };
        println!(
            "extent {}: node(s) {} differed from node {}; {outcome}{majority}",
            f.extent,
            differing.join(", "),
            f.source,
        );
    }
    let repaired = reply.findings.iter().filter(|f| f.repaired).count();
    println!(
        "scrub: {} extents compared, {} differed, {repaired} repaired",
        reply.checked,
        reply.findings.len()
    );
    if reply.unchecked > 0 {
        println!(
            "scrub: {} extents could not be compared (a replica did not answer; see the writer's log)",
            reply.unchecked
        );
    }
    if repaired == reply.findings.len() && reply.unchecked == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// `replica-ha members`: one line per member.
async fn list_members(addr: &str, tls: &ClientTls) -> ExitCode {
    let outcome = async {
        let mut client = admin_client(addr, tls)?;
        let mut request = tonic::Request::new(MembersRequest {});
        request.set_timeout(Duration::from_secs(5));
        let members = client
            .members(request)
            .await
            .map_err(|s| describe(&s))?
            .into_inner()
            .members;
        let mut status = tonic::Request::new(StatusRequest {});
        status.set_timeout(Duration::from_secs(5));
        let status = client
            .status(status)
            .await
            .map_err(|s| describe(&s))?
            .into_inner();
        Ok::<_, String>((members, status))
    }
    .await;
    let (members, status) = match outcome {
        Ok(answer) => answer,
        Err(err) => {
            eprintln!("replica-ha: {err}");
            return ExitCode::FAILURE;
        }
    };
    if members.is_empty() {
        println!(
            "node {} holds no membership: {}",
            status.node_id,
            member_line(&status)
        );
        return ExitCode::SUCCESS;
    }
    println!(
        "{:<6} {:<22} {:<12} {:<8} {:<5} in-sync",
        "id", "address", "incarnation", "role", "live"
    );
    for m in &members {
        let role = match (m.voter, m.leader) {
            (true, true) => "leader",
            (true, false) => "voter",
            (false, _) => "learner",
        };
        println!(
            "{:<6} {:<22} {:<12} {:<8} {:<5} {}",
            m.id,
            m.address,
            format!("{:010x}", m.incarnation),
            role,
            if m.live { "yes" } else { "no" },
            if m.in_sync { "yes" } else { "no" },
        );
    }
    ExitCode::SUCCESS
}

/// `replica-ha members replace|add|remove`: asks the node at `addr`, and
/// when the writer's own node is removed, asks again where leadership moved.
async fn change_members(addr: &str, change: MembersCommand, tls: &ClientTls) -> ExitCode {
    let (op, id, new_addr) = match change {
        MembersCommand::Replace { id } => ("replace", id, String::new()),
        MembersCommand::Add { id, addr } => ("add", id, addr),
        MembersCommand::Remove { id } => ("remove", id, String::new()),
    };
    let mut at = addr.to_string();
    for _ in 0..2 {
        let outcome = async {
            let mut client = admin_client(&at, tls)?;
            let mut request = tonic::Request::new(MembersChange {
                op: op.into(),
                id,
                addr: new_addr.clone(),
            });
            // Adding waits for the new replica's rebuild.
            request.set_timeout(Duration::from_secs(3600));
            client
                .change_members(request)
                .await
                .map(|r| r.into_inner())
                .map_err(|s| describe(&s))
        }
        .await;
        match outcome {
            Ok(reply) if reply.moved_to != 0 => {
                println!("{}; asking it at {}", reply.summary, reply.moved_to_addr);
                at = reply.moved_to_addr;
            }
            Ok(reply) => {
                println!("{}", reply.summary);
                return ExitCode::SUCCESS;
            }
            Err(err) => {
                eprintln!("replica-ha: members {op} --id {id}: {err}");
                return ExitCode::FAILURE;
            }
        }
    }
    eprintln!("replica-ha: members {op} --id {id}: leadership kept moving; try again");
    ExitCode::FAILURE
}

fn parse_volume_size(text: &str) -> Result<u64, String> {
    replica_ha::node::config::parse_size(text).map_err(|e| e.to_string())
}

async fn resync(addr: &str, id: u64, full: bool, tls: &ClientTls) -> ExitCode {
    let outcome = async {
        let mut client = admin_client(addr, tls)?;
        let mut request = tonic::Request::new(ResyncRequest { id, full });
        request.set_timeout(Duration::from_secs(10));
        client
            .resync(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| describe(&s))
    }
    .await;
    match outcome {
        Ok(_) => {
            println!(
                "replica {id} will be rebuilt in full (every extent compared); `replica-ha status` \
                 shows its progress"
            );
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("replica-ha: resync failed: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn resize(addr: &str, size: u64, tls: &ClientTls) -> ExitCode {
    let outcome = async {
        let mut client = admin_client(addr, tls)?;
        let mut request = tonic::Request::new(ResizeRequest { size });
        request.set_timeout(Duration::from_secs(30));
        client
            .resize(request)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| describe(&s))
    }
    .await;
    match outcome {
        Ok(reply) if reply.previous == reply.size => {
            println!("the volume is {} bytes already", reply.size);
            ExitCode::SUCCESS
        }
        Ok(reply) => {
            println!(
                "the volume grew from {} to {} bytes; new connections see the new size",
                reply.previous, reply.size
            );
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("replica-ha: resize failed: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn transfer(addr: &str, to: u64, tls: &ClientTls) -> ExitCode {
    let outcome = async {
        let mut client = admin_client(addr, tls)?;
        let mut request = tonic::Request::new(TransferRequest { to });
        request.set_timeout(Duration::from_secs(10));
        client
            .transfer_leader(request)
            .await
            .map_err(|s| describe(&s))
    }
    .await;
    match outcome {
        Ok(_) => {
            println!("node {to} now leads");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("replica-ha: transfer to {to} failed: {err}");
            ExitCode::FAILURE
        }
    }
}
