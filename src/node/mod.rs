//! The node process: wiring, start-up and shutdown.
//!
//! Start-up, in order:
//! 1. Open the data dir. Its Raft Db records the cluster id and node id on
//!    first use; a data dir of another cluster or node is refused (exit 2).
//! 2. Start Raft's own runtime ([`crate::raft::runtime`]) and, on it,
//!    openraft over the sled stores, the coordinator's lease clock and the
//!    failure detector; then the gRPC server (Raft, replica and admin
//!    services) on `listen`, whose Raft handlers hop onto Raft's runtime.
//! 3. Bootstrap without a manual step: a node whose Raft state is empty
//!    initializes the membership with the full peer list. Every node does
//!    so with the same list, so the entries agree; a node with any Raft
//!    state never initializes again.
//! 4. Elections stay off for `election_timeout_max` (the start-up window,
//!    see [`crate::raft`]); then the failure detector
//!    ([`crate::raft::detector`]) campaigns whenever the leader goes quiet.
//! 5. The first leader fixes the volume config (size, `min_in_sync`) in the
//!    Raft state; a node whose own config disagrees with it stops (exit 2).
//!
//! Shutdown on SIGTERM or SIGINT: resign (hand leadership to a caught-up
//! peer), stop Raft and the server, stop Raft's runtime and wait for its
//! threads, flush the Db, exit 0.

pub mod config;
pub mod journal;
pub mod reads;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use config::{ConfigError, NodeConfig, Overrides};

use crate::admin::AdminService;
use crate::ha::{Controller, ControllerConfig, Coordinator, InSyncTracker, ReadGate};
use crate::metrics::{DeviceMetrics, MeteredDevice};
use crate::nbd::Export;
use crate::net::{Audience, Limits, Transport};
use crate::raft::network::{Network, Peers, RaftService};
use crate::raft::runtime::RaftRuntime;
use crate::raft::{LogStore, Raft, RaftCoordinator, Request, StateMachine, VolumeConfig};
use crate::replica::fencer::TokenFencer;
use crate::replica::remote::RemoteReplica;
use crate::replica::resync::{ResyncConfig, Resyncer};
use crate::replica::service::ReplicaService;
use crate::replica::{
    Engine, EngineConfig, FloorBook, LocalReplica, Replica, ReplicaError, ReplicaSet, ReplicaStore,
    StoreIdentity,
};
use crate::status::{NodeFacts, NodeParts, NodeView};

/// How often the writer retires the marks of extents that are durable on
/// every in-sync replica (see `Engine::retire_marks`): what a failover must
/// converge is about what the writer wrote in this long.
const MARK_RETIREMENT: Duration = Duration::from_millis(200);

/// How long a replica may stay silent (answer nothing while it has requests)
/// before it counts as failed; see `replica::liveness`.
const REPLICA_TIMEOUT: Duration = Duration::from_secs(1);

/// Why a node stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The configuration or the data dir is wrong (exit code 2).
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The node could not start or failed while running (exit code 1).
    #[error("{0}")]
    Failed(String),
}

impl NodeError {
    /// The process exit code for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            NodeError::Config(_) => 2,
            NodeError::Failed(_) => 1,
        }
    }
}

fn failed(what: impl std::fmt::Display) -> NodeError {
    NodeError::Failed(what.to_string())
}

/// A running node.
pub struct Node {
    config: NodeConfig,
    db: sled::Db,
    raft: Raft,
    raft_runtime: RaftRuntime,
    coordinator: Arc<RaftCoordinator>,
    controller: Arc<Controller>,
    stop_server: watch::Sender<bool>,
    server: JoinHandle<Result<(), tonic::transport::Error>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Node {
    /// Starts a node; see the module docs for the steps.
    pub async fn start(config: NodeConfig) -> Result<Self, NodeError> {
        std::fs::create_dir_all(&config.data_dir)
            .map_err(|e| failed(format!("cannot create {}: {e}", config.data_dir.display())))?;
        let db_path = config.data_dir.join("raft");
        let db = sled::open(&db_path).map_err(|e| {
            failed(format!(
                "cannot open {} (is another node using this data dir?): {e}",
                db_path.display()
            ))
        })?;
        check_data_dir_identity(&db, &config)?;

        let log_store = LogStore::open(&db).map_err(failed)?;
        let state_machine = StateMachine::open(&db).map_err(failed)?;
        let addresses: BTreeMap<_, _> = config
            .peers
            .iter()
            .filter(|(id, _)| **id != config.id)
            .map(|(id, addr)| (*id, addr.to_string()))
            .collect();
        let transport = Transport::plain(Limits::default());
        let peers = Peers::new(
            config.cluster_id.clone(),
            config.id,
            addresses,
            transport.clone(),
            config.timing.election_max,
        );
        let raft_config = config
            .timing
            .raft_config(&config.cluster_id)
            .map_err(|e| ConfigError(format!("raft timing: {e}")))?;
        let raft_runtime = RaftRuntime::start()
            .map_err(|e| failed(format!("cannot start Raft's threads: {e}")))?;
        peers.run_on(raft_runtime.handle().clone());
        // Inside Raft's runtime, so the core and replication tasks that
        // openraft spawns live there.
        let raft = raft_runtime
            .run({
                let (id, network) = (config.id, Network::new(Arc::clone(&peers)));
                let state_machine = state_machine.clone();
                async move {
                    Raft::new(id, Arc::new(raft_config), network, log_store, state_machine).await
                }
            })
            .await
            .map_err(failed)?
            .map_err(|e| failed(format!("raft: {e}")))?;
        let coordinator = {
            // The lease watcher is spawned here: on Raft's runtime.
            let _on_raft = raft_runtime.handle().enter();
            RaftCoordinator::start(
                raft.clone(),
                state_machine.clone(),
                Arc::clone(&peers),
                config.timing,
            )
        };

        let store = Arc::new(open_replica(&config).await?);
        let (controller, engine, replicas) =
            start_controller(&config, &transport, &store, &coordinator)?;
        if let Some(path) = &config.gate_journal {
            let journal = journal::FileJournal::open(path)
                .map_err(|err| ConfigError(format!("gate journal {}: {err}", path.display())))?;
            controller
                .device()
                .record_to(Arc::new(journal))
                .map_err(|err| failed(err.to_string()))?;
        }
        let retirement = Arc::clone(&engine).run_mark_retirement(MARK_RETIREMENT);
        let resync = Arc::new(Resyncer::new(
            engine,
            ResyncConfig {
                rate: config.resync_rate,
                ..ResyncConfig::default()
            },
        ));
        let io = Arc::new(DeviceMetrics::default());
        // The data path: the read gate in front of the write gate, counted.
        let local_copy = reads::RaftLocalCopy::new(
            config.id,
            replicas
                .get(&config.id.to_string())
                .ok_or_else(|| failed("no local replica"))?,
            coordinator.state_machine().subscribe(),
        );
        let gated = ReadGate::new(controller.device(), Arc::new(local_copy));
        let view = Arc::new(NodeView::new(NodeParts {
            facts: facts(&config),
            coordinator: Arc::clone(&coordinator),
            controller: Arc::clone(&controller),
            replicas,
            resync: Arc::clone(&resync),
            device: Arc::new(MeteredDevice::new(Arc::new(gated), Arc::clone(&io))),
            io,
            nbd: Arc::default(),
        }));

        let listener = bind("gRPC", config.listen).await?;
        let nbd_listener = match config.nbd {
            Some(addr) => Some(bind("NBD", addr).await?),
            None => None,
        };
        let http_listener = match config.http {
            Some(addr) => Some(bind("HTTP", addr).await?),
            None => None,
        };
        let (stop_server, mut stopped) = watch::channel(false);
        let admin = AdminService::new(Arc::clone(&view));
        let (health, health_service) = tonic_health::server::health_reporter();
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
            .build_v1()
            .map_err(|e| failed(format!("gRPC reflection: {e}")))?;
        let replica_service = ReplicaService::new(Arc::clone(&store))
            .on_node(config.id.to_string())
            .on_fenced({
                let controller = Arc::clone(&controller);
                Arc::new(move |floor| controller.step_down(floor))
            });
        let server = tokio::spawn(
            transport
                .server()
                .add_service(transport.serve(
                    Audience::Members,
                    RaftService::new(raft.clone(), Arc::clone(&peers)).into_server(),
                ))
                .add_service(transport.serve(Audience::Members, replica_service.into_server()))
                .add_service(transport.serve(Audience::Operators, admin.into_server()))
                .add_service(health_service)
                .add_service(reflection)
                .serve_with_incoming_shutdown(transport.incoming(listener), async move {
                    let _ = stopped.wait_for(|stop| *stop).await;
                }),
        );

        if !raft.is_initialized().await.map_err(failed)? {
            let members: BTreeSet<_> = config.peers.keys().copied().collect();
            match raft.initialize(members).await {
                Ok(()) => tracing::info!(node = config.id, "bootstrapped the cluster membership"),
                Err(err) => {
                    tracing::info!(node = config.id, %err, "membership already initialized")
                }
            }
        }

        let mut tasks = Vec::new();
        tasks.push(tokio::spawn(report_health(health, Arc::clone(&view))));
        tasks.push(tokio::spawn(resync.run()));
        tasks.push(tokio::spawn(retirement));
        if let Some(listener) = nbd_listener {
            let description = format!(
                "replica-ha volume {} of cluster {}",
                config.volume, config.cluster_id
            );
            let export = Arc::new(Export::new(
                &config.volume,
                description,
                Arc::clone(view.device()),
            ));
            let (stats, stop) = (Arc::clone(view.nbd_stats()), stop_server.subscribe());
            tasks.push(tokio::spawn(crate::nbd::serve(
                listener, export, stats, stop,
            )));
        }
        if let Some(listener) = http_listener {
            let mut stop = stop_server.subscribe();
            let stopped = async move {
                let _ = stop.wait_for(|stop| *stop).await;
            };
            let view = Arc::clone(&view);
            tasks.push(tokio::spawn(async move {
                if let Err(err) = crate::http::serve(listener, view, stopped).await {
                    tracing::warn!(%err, "the HTTP listener failed");
                }
            }));
        }
        tasks.push(tokio::spawn({
            let controller = Arc::clone(&controller);
            async move {
                if let Err(err) = controller.run().await {
                    tracing::info!(%err, "controller stopped");
                }
            }
        }));
        tasks.push(raft_runtime.handle().spawn({
            let (raft, peers, timing) = (raft.clone(), Arc::clone(&peers), config.timing);
            async move {
                // The start-up window: no campaign before it has passed.
                tokio::time::sleep(timing.election_max).await;
                crate::raft::detector::run(raft, peers, timing).await;
            }
        }));
        tasks.push(tokio::spawn(fix_volume_config(
            Arc::clone(&coordinator),
            volume_config(&config),
            config.peers.keys().copied().collect(),
        )));
        tracing::info!(
            node = config.id,
            listen = %config.listen,
            nbd = ?config.nbd,
            http = ?config.http,
            "node started"
        );
        Ok(Self {
            config,
            db,
            raft,
            raft_runtime,
            coordinator,
            controller,
            stop_server,
            server,
            tasks,
        })
    }

    /// The coordinator.
    pub fn coordinator(&self) -> &Arc<RaftCoordinator> {
        &self.coordinator
    }

    /// Runs until SIGTERM/SIGINT (Ok) or until the cluster's volume config
    /// turns out to differ from this node's (a config error).
    pub async fn run_until_signal(&self) -> Result<(), NodeError> {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(|e| failed(format!("cannot watch SIGTERM: {e}")))?;
        tokio::select! {
            _ = term.recv() => Ok(()),
            _ = tokio::signal::ctrl_c() => Ok(()),
            conflict = self.volume_conflict() => Err(NodeError::Config(conflict)),
        }
    }

    /// Resolves when the cluster's recorded volume config differs from this
    /// node's.
    async fn volume_conflict(&self) -> ConfigError {
        let mine = volume_config(&self.config);
        let mut applied = self.coordinator.state_machine().subscribe();
        loop {
            if let Some(theirs) = applied.borrow_and_update().control.volume.clone() {
                if theirs != mine {
                    return ConfigError(format!(
                        "this node is configured with {mine:?} but the cluster was created with {theirs:?}"
                    ));
                }
            }
            if applied.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }

    /// Closes the gate, resigns, stops Raft and the server, and flushes.
    pub async fn shutdown(self) {
        let stop = self.controller.stop();
        if tokio::time::timeout(self.config.timing.election_max * 4, stop)
            .await
            .is_err()
        {
            tracing::warn!("stopping the controller timed out");
        }
        let resign = self.coordinator.resign();
        if tokio::time::timeout(self.config.timing.election_max * 4, resign)
            .await
            .is_err()
        {
            tracing::warn!("resigning timed out");
        }
        for task in &self.tasks {
            task.abort();
        }
        if let Err(err) = self.raft.shutdown().await {
            tracing::warn!(%err, "raft shutdown");
        }
        self.stop_server.send_replace(true);
        let _ = tokio::time::timeout(Duration::from_secs(2), self.server).await;
        drop(self.coordinator);
        self.raft_runtime.shutdown().await;
        if let Err(err) = self.db.flush_async().await {
            tracing::warn!(%err, "flushing the Raft Db");
        }
        tracing::info!(node = self.config.id, "node stopped");
    }
}

/// Starts a node and runs it until a signal; then shuts it down.
pub async fn run(config: NodeConfig) -> Result<(), NodeError> {
    let node = Node::start(config).await?;
    let outcome = node.run_until_signal().await;
    node.shutdown().await;
    outcome
}

/// Opens this node's replica; one of another cluster, volume or size is a
/// configuration error.
async fn open_replica(config: &NodeConfig) -> Result<ReplicaStore, NodeError> {
    let identity = StoreIdentity::new(&config.cluster_id, &config.volume, config.size);
    let dir = config.data_dir.join("replica");
    ReplicaStore::open(&dir, identity)
        .await
        .map_err(|err| match err {
            ReplicaError::IdentityMismatch(why) | ReplicaError::InvalidIdentity(why) => {
                NodeError::Config(ConfigError(format!("replica in {}: {why}", dir.display())))
            }
            other => failed(format!("replica in {}: {other}", dir.display())),
        })
}

/// Builds the engine over every replica (the local one without a network
/// hop), the token fencer, and the controller; returns the controller and
/// the replicas, this node's first.
fn start_controller(
    config: &NodeConfig,
    transport: &Transport,
    store: &Arc<ReplicaStore>,
    coordinator: &Arc<RaftCoordinator>,
) -> Result<(Arc<Controller>, Arc<Engine>, Arc<ReplicaSet>), NodeError> {
    let local_id = config.id.to_string();
    let mut replicas: Vec<Arc<dyn Replica>> =
        vec![Arc::new(LocalReplica::new(&local_id, Arc::clone(store)))];
    for (id, addr) in &config.peers {
        if *id != config.id {
            let remote = RemoteReplica::new(
                id.to_string(),
                transport,
                &addr.to_string(),
                &config.cluster_id,
                &config.volume,
                // The engine and the fencer give up on a silent replica
                // after REPLICA_TIMEOUT; the transport allows a busy one to
                // take as long as they may wait.
                crate::replica::liveness::longest_wait(REPLICA_TIMEOUT),
            )
            .map_err(|e| ConfigError(e.to_string()))?;
            replicas.push(Arc::new(remote));
        }
    }
    let replicas =
        Arc::new(ReplicaSet::new(&local_id, replicas).map_err(|e| ConfigError(e.to_string()))?);
    let tracker: Arc<dyn InSyncTracker> = Arc::clone(coordinator) as Arc<dyn InSyncTracker>;
    let floors = Arc::new(FloorBook::default());
    let engine = Engine::over(
        EngineConfig {
            local_id,
            min_in_sync: config.min_in_sync,
            replica_timeout: REPLICA_TIMEOUT,
            size: config.size,
        },
        Arc::clone(&replicas),
        Arc::clone(&tracker),
    )
    .map_err(|e| ConfigError(e.to_string()))?
    .with_floor_book(Arc::clone(&floors));
    let fencer = TokenFencer::new(
        Arc::clone(&replicas),
        tracker,
        config.min_in_sync,
        config.size,
        REPLICA_TIMEOUT,
    )
    .with_floor_book(floors);
    let engine = Arc::new(engine);
    let controller = Controller::new(
        Arc::clone(&engine) as Arc<dyn crate::ha::WriterEngine>,
        Arc::clone(coordinator) as Arc<dyn Coordinator>,
        Arc::new(fencer),
        ControllerConfig {
            fence_timeout: Duration::from_secs(10),
            retry_interval: Duration::from_millis(200),
        },
    );
    Ok((Arc::new(controller), engine, replicas))
}

async fn bind(
    what: &str,
    addr: std::net::SocketAddr,
) -> Result<tokio::net::TcpListener, NodeError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| failed(format!("cannot listen for {what} on {addr}: {e}")))
}

/// The gRPC health service name that is SERVING only on the active writer.
pub const WRITER_HEALTH_SERVICE: &str = "replica_ha.writer";

/// Keeps the standard gRPC health service current: the node itself ("")
/// and the admin service are SERVING while it runs; [`WRITER_HEALTH_SERVICE`]
/// is SERVING only while this node is the active writer. Polled, because a
/// lease runs out without any event.
async fn report_health(health: tonic_health::server::HealthReporter, view: Arc<NodeView>) {
    use tonic_health::ServingStatus;
    health.set_service_status("", ServingStatus::Serving).await;
    health
        .set_serving::<crate::proto::admin::admin_server::AdminServer<AdminService>>()
        .await;
    let mut last = None;
    loop {
        let writer = view.is_active_writer();
        if last != Some(writer) {
            let status = if writer {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            health
                .set_service_status(WRITER_HEALTH_SERVICE, status)
                .await;
            last = Some(writer);
        }
        tokio::time::sleep(HEALTH_POLL).await;
    }
}

/// How often the writer health status is refreshed.
const HEALTH_POLL: Duration = Duration::from_millis(50);

/// What status repeats of the configuration.
fn facts(config: &NodeConfig) -> NodeFacts {
    NodeFacts {
        id: config.id,
        cluster_id: config.cluster_id.clone(),
        volume: config.volume.clone(),
        size: config.size,
        min_in_sync: config.min_in_sync,
        nbd: config.nbd,
        peers: config
            .peers
            .iter()
            .map(|(id, addr)| (*id, addr.to_string()))
            .collect(),
    }
}

fn volume_config(config: &NodeConfig) -> VolumeConfig {
    VolumeConfig {
        cluster_id: config.cluster_id.clone(),
        volume: config.volume.clone(),
        size: config.size,
        min_in_sync: config.min_in_sync,
    }
}

/// Refuses a data dir that belongs to another cluster or node.
fn check_data_dir_identity(db: &sled::Db, config: &NodeConfig) -> Result<(), NodeError> {
    let tree = db.open_tree("node").map_err(failed)?;
    let cluster = tree.get("cluster_id").map_err(failed)?;
    let node = tree.get("node_id").map_err(failed)?;
    match (cluster, node) {
        (None, None) => {
            tree.insert("cluster_id", config.cluster_id.as_bytes())
                .map_err(failed)?;
            tree.insert("node_id", &config.id.to_be_bytes())
                .map_err(failed)?;
            db.flush().map_err(failed)?;
            Ok(())
        }
        (Some(cluster), Some(node)) => {
            let cluster = String::from_utf8_lossy(&cluster).to_string();
            let node = <[u8; 8]>::try_from(node.as_ref())
                .map(u64::from_be_bytes)
                .map_err(|_| failed("corrupt node id in the data dir"))?;
            if cluster != config.cluster_id || node != config.id {
                return Err(ConfigError(format!(
                    "data dir {} belongs to cluster {cluster:?} node {node}, not cluster {:?} node {}",
                    config.data_dir.display(),
                    config.cluster_id,
                    config.id
                ))
                .into());
            }
            Ok(())
        }
        _ => Err(failed("incomplete node identity in the data dir")),
    }
}

/// Whenever this node leads and the cluster has no volume config yet,
/// commits this node's.
async fn fix_volume_config(
    coordinator: Arc<RaftCoordinator>,
    volume: VolumeConfig,
    replicas: BTreeSet<u64>,
) {
    let mut observations = coordinator.observe();
    loop {
        let seen = observations.borrow_and_update().clone();
        let unset = coordinator
            .state_machine()
            .current()
            .control
            .volume
            .is_none();
        if seen.is_self && unset {
            let request = Request::Init {
                volume: volume.clone(),
                replicas: replicas.clone(),
            };
            match coordinator.commit(seen.term, request).await {
                Ok(_) => tracing::info!(?volume, "volume config fixed"),
                Err(err) => tracing::warn!(%err, "could not fix the volume config yet"),
            }
        }
        if !unset {
            return;
        }
        tokio::select! {
            changed = observations.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
}
