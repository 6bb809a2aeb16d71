//! The node process: wiring, start-up and shutdown.
//!
//! Start-up, in order:
//! 1. Open the data dir. Its Raft Db records the cluster id, the node id
//!    and a random incarnation on first use (S8: a new data dir is a new
//!    incarnation); a data dir of another cluster or node is refused
//!    (exit 2). Then load the certificates and check them
//!    ([`crate::net::tls`]): a missing, unreadable, expired or foreign one
//!    stops the node (exit 2). Without TLS (`insecure = true`) the node
//!    warns that nothing is authenticated.
//! 2. Start Raft's own runtime ([`crate::raft::runtime`]) and, on it,
//!    openraft over the sled stores, the coordinator's lease clock and the
//!    failure detector; then the gRPC server (Raft, replica and admin
//!    services) on `listen`, whose Raft handlers hop onto Raft's runtime.
//! 3. Formation without a manual step ([`formation`]): a node whose Raft
//!    state is empty asks its peers. Only in a brand-new cluster (every
//!    peer it reached empty, and a majority reached) does the founder, the
//!    lowest id of the peer list, form the membership; a node that finds
//!    the cluster formed waits as a non-member until a membership change
//!    names it (S8). A node with any Raft state never forms again; from
//!    then on the committed membership is the truth, and the peer list
//!    only gives addresses.
//! 4. Elections stay off for `election_timeout_max` (the start-up window,
//!    see [`crate::raft`]); then the failure detector
//!    ([`crate::raft::detector`]) campaigns whenever the leader goes quiet.
//! 5. The first leader fixes the volume config (size, `min_in_sync`) in the
//!    Raft state; a node whose own config disagrees with it stops (exit 2).
//!
//! The node keeps only node-wide work: identity, transport, certificates,
//! Raft, health and the listeners. The volumes it holds a copy of live in
//! its [`host::VolumeHost`]; each [`volume::Volume`] assembles its own
//! parts (store, replica set, engine, fencer, controller, resync, scrub,
//! data path) and starts and stops its own tasks, step 5 among them. What
//! status reports is computed by [`crate::api::status`].
//!
//! SIGHUP reloads the certificates: new connections use them, established
//! ones keep working; a reload that fails keeps the old ones and says why.
//!
//! Shutdown on SIGTERM or SIGINT: close every volume's gate and resign
//! (hand leadership to a caught-up peer), stop the node's background tasks
//! and every volume's ([`tasks`]) at once, stop Raft and the server, stop Raft's
//! runtime and wait for its threads, flush the Db, exit 0. The gRPC health
//! service reports NOT_SERVING from the first step on.

pub mod balance;
pub mod config;
pub mod formation;
pub mod hello;
pub mod host;
pub mod journal;
pub mod membership;
pub mod placement;
pub mod reads;
pub mod tasks;
pub mod volume;
pub mod volumes;
pub mod writers;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use config::{ConfigError, NbdTls, NodeConfig, Overrides, TlsFile};

use crate::api::admin::{AdminService, VolumeWriters};
use crate::api::status::{NodeFacts, NodeParts, NodeView, TableVolumes};
use crate::ha::Coordinator;
use crate::ids::{GroupId, Incarnation, MemberId, NodeId, VolumeId};
use crate::members::MemberBook;
use crate::nbd::{Export, ExportTls, Grant};
use crate::net::tls::{NbdClientAuth, Party};
use crate::net::{Audience, Limits, Tls, Transport};
use crate::raft::group::RaftGroup;
use crate::raft::network::{PeerBook, RaftService, ServedGroups};
use crate::raft::runtime::RaftRuntime;
use crate::raft::{RaftCoordinator, RaftDb};
use crate::replica::serve::service::ReplicaService;
use crate::replica::serve::stores::{OnFenced, Stores};
use hello::HelloService;
use host::VolumeHost;
use tasks::Tasks;
use volume::Volume;

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

/// How long the background tasks get to stop at shutdown.
const STOP_DEADLINE: Duration = Duration::from_secs(2);

/// A running node.
pub struct Node {
    config: NodeConfig,
    /// The node's certificates, reloaded on SIGHUP.
    tls: Option<Arc<Tls>>,
    db: sled::Db,
    raft: RaftParts,
    /// The volumes this node holds a copy of.
    host: VolumeHost,
    stop_server: watch::Sender<bool>,
    /// The gRPC server and the data listener's.
    servers: [JoinHandle<Result<(), tonic::transport::Error>>; 2],
    health: tonic_health::server::HealthReporter,
    tasks: Tasks,
}

/// Raft and what runs beside it on its own runtime.
pub(crate) struct RaftParts {
    /// The cluster group (group 0).
    cluster: RaftGroup,
    runtime: RaftRuntime,
    /// The node's Raft Db, every group's.
    db: RaftDb,
    /// The groups the Raft server serves: the cluster group and every
    /// hosted volume's.
    served: ServedGroups,
}

/// The listeners, bound before anything is served.
struct Listeners {
    grpc: tokio::net::TcpListener,
    /// The replica service's, apart from Raft and admin.
    data: tokio::net::TcpListener,
    nbd: Option<tokio::net::TcpListener>,
    http: Option<tokio::net::TcpListener>,
}

impl Node {
    /// Starts a node; see the module docs for the steps.
    pub async fn start(config: NodeConfig) -> Result<Self, NodeError> {
        let (db, incarnation) = open_data_dir(&config)?;
        let tls = load_tls(&config)?;
        let transport = match (&tls, config.insecure) {
            (Some(tls), false) => Transport::secured(Limits::default(), Arc::clone(tls))
                .with_members(Arc::new(std::sync::RwLock::new(
                    config.peers.keys().copied().collect(),
                ))),
            _ => {
                tracing::warn!(
                    "running INSECURE (insecure = true): no connection is authenticated; \
                     anyone who can reach this node's ports can write to its replica, raise its \
                     fence floor or move leadership"
                );
                Transport::plain(Limits::default())
            }
        };
        let listeners = Listeners::bind(&config).await?;
        let data_addr = listeners
            .data
            .local_addr()
            .map_err(|e| failed(format!("the data listener: {e}")))?;
        let member = crate::ids::MemberId::new(config.id, incarnation);
        let replica_dir = config.data_dir.join("replica");
        let replica_missing = !replica_dir.exists();
        let raft = start_raft(&config, &db, &transport, member).await?;
        if replica_missing && raft.cluster.raft.is_initialized().await.map_err(failed)? {
            // S8 covers the whole data dir: a lost replica with the Raft
            // state intact would otherwise be recreated empty and count as
            // the copy this member held.
            return Err(ConfigError(format!(
                "{} is missing but this node's Raft state is there (a lost disk?): started like \
                 this, an empty copy would count as the one node {} held. Empty the whole data \
                 dir {} so that the node comes back as a new incarnation, then run `replica-ha \
                 members replace --id {}` on the writer",
                replica_dir.display(),
                config.id,
                config.data_dir.display(),
                config.id
            ))
            .into());
        }
        let waiting = Arc::new(crate::members::Waiting::default());
        let volume = Volume::assemble(
            &config,
            volume::Site::configured(&config),
            &transport,
            &raft.cluster.coordinator,
        )
        .await?;
        let facts = facts(&config, data_addr, member);
        let hosted = host::HostedVolumes::default();
        let table_writers = Arc::new(writers::TableWriters::new(
            Arc::clone(&raft.cluster.coordinator),
            hosted.clone(),
            facts.peers.clone(),
        ));
        let view = Arc::new(NodeView::new(NodeParts {
            facts,
            waiting: Arc::clone(&waiting),
            volume: volume.probe(&raft.cluster.coordinator),
            engine: Arc::clone(&volume.engine),
            nbd: Arc::default(),
            table: Some(Arc::clone(&table_writers) as Arc<dyn TableVolumes>),
        }));
        let members = Arc::new(membership::Membership::new(
            Arc::clone(&raft.cluster.coordinator),
            Arc::clone(&volume.controller),
            Arc::clone(&volume.engine),
            transport.clone(),
            view.facts().peers.clone(),
        ));
        let nbd = listeners.nbd.map(|listener| {
            let tls = nbd_tls(&config, tls.as_ref(), &transport);
            // A volume this node holds no copy of is refused naming the
            // nodes that hold it.
            let elsewhere = Arc::clone(&table_writers);
            let exports = nbd_exports(&config, tls, view.device()).with_lookup(move |name| {
                Some(elsewhere.not_here(&VolumeId(name.into())).to_string())
            });
            (listener, exports)
        });
        let exports = nbd.as_ref().map(|(_, exports)| exports.clone());
        let writers: Arc<dyn VolumeWriters> = table_writers;
        let grpc = serve_grpc(
            &transport,
            &raft,
            (&volume, &hosted, exports.as_ref(), &writers),
            &view,
            &members,
            (listeners.grpc, listeners.data),
        )?;
        let mut tasks = Tasks::default();
        if let Some(after) = config.auto_replace {
            tasks.spawn(
                "auto_replace",
                membership::auto_replace(Arc::clone(&members), after),
            );
        }
        tasks.spawn(
            "formation",
            formation::run(
                raft.cluster.raft.clone(),
                config.clone(),
                member,
                transport.clone(),
                waiting,
            ),
        );
        tasks.spawn(
            "gRPC health",
            report_health(grpc.health.clone(), Arc::clone(&view)),
        );
        tasks.spawn("volume sizes", Arc::clone(&grpc.volumes).record_sizes());
        spawn_background(
            &mut tasks,
            &config,
            &raft,
            &view,
            nbd,
            listeners
                .http
                .map(|listener| (listener, Arc::clone(&writers))),
        );
        if let Some(interval) = config.balance_interval {
            tasks.spawn(
                "writer balancer",
                balance::run(
                    Arc::clone(&raft.cluster.coordinator),
                    hosted.clone(),
                    config.id,
                    interval,
                ),
            );
        }
        let mut host = VolumeHost::new(volume, hosted);
        host.start(&config, &raft, &transport);
        host.follow_table(host::HostParts {
            config: config.clone(),
            transport: transport.clone(),
            member,
            db: raft.db.clone(),
            book: Arc::clone(raft.cluster.peers.node()),
            runtime: raft.runtime.handle().clone(),
            served: raft.served.clone(),
            cluster: Arc::clone(&raft.cluster.coordinator),
            stores: grpc.stores.clone(),
            exports,
        });
        tracing::info!(
            node = %config.id,
            incarnation = %member.incarnation(),
            listen = %config.listen,
            data = %data_addr,
            nbd = ?config.nbd,
            http = ?config.http,
            "node started"
        );
        Ok(Self {
            config,
            tls,
            db,
            raft,
            host,
            stop_server: grpc.stop,
            servers: grpc.tasks,
            health: grpc.health,
            tasks,
        })
    }

    /// The coordinator.
    pub fn coordinator(&self) -> &Arc<RaftCoordinator> {
        &self.raft.cluster.coordinator
    }

    /// Runs until SIGTERM/SIGINT (Ok) or until the cluster's volume config
    /// turns out to differ from this node's (a config error). SIGHUP
    /// reloads the certificates.
    pub async fn run_until_signal(&self) -> Result<(), NodeError> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())
            .map_err(|e| failed(format!("cannot watch SIGTERM: {e}")))?;
        let mut hangup = signal(SignalKind::hangup())
            .map_err(|e| failed(format!("cannot watch SIGHUP: {e}")))?;
        let conflict = self.host.conflict(&self.raft);
        tokio::pin!(conflict);
        loop {
            tokio::select! {
                _ = term.recv() => return Ok(()),
                _ = tokio::signal::ctrl_c() => return Ok(()),
                conflict = &mut conflict => return Err(NodeError::Config(conflict)),
                _ = hangup.recv() => self.reload_certificates(),
            }
        }
    }

    /// SIGHUP: new connections use the certificates on disk from now on;
    /// established ones keep theirs. A reload that fails keeps the old
    /// credentials.
    fn reload_certificates(&self) {
        let Some(tls) = &self.tls else {
            tracing::info!("SIGHUP: no certificates configured, nothing to reload");
            return;
        };
        match tls.reload() {
            Ok(identity) => tracing::info!(
                cert = %tls.cert_path().display(),
                %identity,
                "SIGHUP: reloaded the certificates; new connections use them"
            ),
            Err(err) => {
                tracing::error!(%err, "SIGHUP: reload failed; keeping the old certificates")
            }
        }
    }

    /// Closes the gate, resigns, stops the background tasks, Raft and the
    /// server, and flushes.
    pub async fn shutdown(mut self) {
        // Load balancers and routers stop sending here first.
        use tonic_health::ServingStatus::NotServing;
        for service in ["", WRITER_HEALTH_SERVICE] {
            self.health.set_service_status(service, NotServing).await;
        }
        let grace = self.config.timing.election_max * 4;
        self.host.stop_writing(grace).await;
        if tokio::time::timeout(grace, self.raft.cluster.coordinator.resign())
            .await
            .is_err()
        {
            tracing::warn!("resigning timed out");
        }
        tokio::join!(
            self.tasks.stop(STOP_DEADLINE),
            self.host.stop(STOP_DEADLINE)
        );
        if let Err(err) = self.raft.cluster.raft.shutdown().await {
            tracing::warn!(%err, "raft shutdown");
        }
        self.stop_server.send_replace(true);
        let _ = tokio::time::timeout(STOP_DEADLINE, futures::future::join_all(self.servers)).await;
        let RaftParts {
            runtime, cluster, ..
        } = self.raft;
        drop(cluster);
        runtime.shutdown().await;
        if let Err(err) = self.db.flush_async().await {
            tracing::warn!(%err, "flushing the Raft Db");
        }
        tracing::info!(node = %self.config.id, "node stopped");
    }
}

/// Starts a node and runs it until a signal; then shuts it down.
pub async fn run(config: NodeConfig) -> Result<(), NodeError> {
    let node = Node::start(config).await?;
    let outcome = node.run_until_signal().await;
    node.shutdown().await;
    outcome
}

/// How the NBD export speaks TLS, from `nbd_tls` and `nbd_client_auth`
/// (the configuration made sure the credentials are there when needed),
/// and whom it admits: `transport`'s member admission, checking
/// certificates against this cluster even when the transport is insecure.
fn nbd_tls(
    config: &NodeConfig,
    tls: Option<&Arc<Tls>>,
    transport: &Transport,
) -> Option<ExportTls> {
    let required = match config.nbd_tls {
        NbdTls::Off => return None,
        NbdTls::Optional => false,
        NbdTls::Require => true,
    };
    let client_auth = if config.nbd_client_auth {
        NbdClientAuth::Required
    } else {
        NbdClientAuth::Optional
    };
    tls.map(|credentials| ExportTls {
        credentials: Arc::clone(credentials),
        required,
        client_auth,
        guard: transport
            .guard(Audience::Volume)
            .for_cluster(credentials.cluster_id()),
    })
}

/// Step 1, second half: loads and checks the node's certificates, when it uses them (a
/// bad one is a configuration error, exit code 2).
fn load_tls(config: &NodeConfig) -> Result<Option<Arc<Tls>>, NodeError> {
    let needed = !config.insecure || config.nbd_tls != NbdTls::Off;
    match &config.tls {
        Some(files) if needed => {
            Tls::load(files.clone(), &config.cluster_id, Party::Node(config.id))
                .map(Some)
                .map_err(|err| NodeError::Config(ConfigError(err.to_string())))
        }
        _ => Ok(None),
    }
}

/// Step 1: opens the data dir and its Raft Db, and refuses one of another
/// cluster or node. Returns the Db and the data dir's incarnation.
fn open_data_dir(config: &NodeConfig) -> Result<(sled::Db, Incarnation), NodeError> {
    std::fs::create_dir_all(&config.data_dir)
        .map_err(|e| failed(format!("cannot create {}: {e}", config.data_dir.display())))?;
    let db_path = config.data_dir.join("raft");
    let db = sled::open(&db_path).map_err(|e| {
        failed(format!(
            "cannot open {} (is another node using this data dir?): {e}",
            db_path.display()
        ))
    })?;
    let incarnation = check_data_dir_identity(&db, config)?;
    Ok((db, incarnation))
}

/// Step 2: Raft's runtime and, on it, openraft over the sled stores and the
/// coordinator's lease clock.
async fn start_raft(
    config: &NodeConfig,
    db: &sled::Db,
    transport: &Transport,
    member: MemberId,
) -> Result<RaftParts, NodeError> {
    let addresses: BTreeMap<_, _> = config
        .peers
        .iter()
        .filter(|(id, _)| **id != config.id)
        .map(|(id, addr)| (*id, addr.to_string()))
        .collect();
    let book = Arc::new(MemberBook::default());
    let node = PeerBook::new(
        config.cluster_id.clone(),
        member,
        addresses,
        Arc::clone(&book),
        transport.clone(),
    );
    // A timing openraft refuses is the configuration's fault (exit 2);
    // every group is configured the same.
    config
        .timing
        .raft_config(&config.cluster_id)
        .map_err(|e| ConfigError(format!("raft timing: {e}")))?;
    let runtime =
        RaftRuntime::start().map_err(|e| failed(format!("cannot start Raft's threads: {e}")))?;
    node.run_on(runtime.handle().clone());
    let db = RaftDb::new(db);
    let served = ServedGroups::new(Arc::clone(&node));
    let cluster = RaftGroup::start(
        GroupId::FIRST,
        member,
        &db,
        node,
        config.timing,
        runtime.handle(),
    )
    .await
    .map_err(failed)?;
    // The book holds the stored membership before anything is served: a
    // peer asking whether this node has Raft state gets the truth at once.
    book.set(crate::raft::coordinator::book_entries(
        cluster
            .raft
            .metrics()
            .borrow()
            .membership_config
            .membership(),
    ));
    served
        .insert(cluster.raft.clone(), Arc::clone(&cluster.peers))
        .map_err(failed)?;
    Ok(RaftParts {
        cluster,
        runtime,
        db,
        served,
    })
}

impl Listeners {
    async fn bind(config: &NodeConfig) -> Result<Self, NodeError> {
        let grpc = bind("gRPC", config.listen).await?;
        let data = bind("the replica service", config.data_listen).await?;
        let nbd = match config.nbd {
            Some(addr) => Some(bind("NBD", addr).await?),
            None => None,
        };
        let http = match config.http {
            Some(addr) => Some(bind("HTTP", addr).await?),
            None => None,
        };
        Ok(Self {
            grpc,
            data,
            nbd,
            http,
        })
    }
}

/// The running gRPC server.
struct GrpcServer {
    stop: watch::Sender<bool>,
    /// The gRPC listener's server and the data listener's.
    tasks: [JoinHandle<Result<(), tonic::transport::Error>>; 2],
    /// The standard health service's reporter (see [`report_health`]).
    health: tonic_health::server::HealthReporter,
    /// The stores the data listener serves, by volume: the node adds and
    /// removes volumes here as it opens and drops their copies.
    stores: Stores,
    /// The volume table's changes (the admin API's and `Node`'s).
    volumes: Arc<volumes::VolumeTableChanges>,
}

/// The servers: on the gRPC listener, Raft and `Node` for members, admin
/// for operators, health and reflection; on the data listener, the replica
/// service for members.
fn serve_grpc(
    transport: &Transport,
    raft: &RaftParts,
    (volume, hosted, exports, writers): (
        &Volume,
        &host::HostedVolumes,
        Option<&crate::nbd::Exports>,
        &Arc<dyn VolumeWriters>,
    ),
    view: &Arc<NodeView>,
    members: &Arc<membership::Membership>,
    (listener, data): (tokio::net::TcpListener, tokio::net::TcpListener),
) -> Result<GrpcServer, NodeError> {
    let (stop_server, stopped) = watch::channel(false);
    let facts = view.facts();
    let volumes = Arc::new(
        volumes::VolumeTableChanges::new(
            Arc::clone(&raft.cluster.coordinator),
            transport.clone(),
            facts.cluster_id.clone(),
            facts.data_dir.clone(),
            facts.peers.clone(),
            hosted.clone(),
        )
        .with_own_writer({
            let view = Arc::clone(view);
            move || view.is_active_writer()
        }),
    );
    let admin = AdminService::new(Arc::clone(view))
        .with_membership(Arc::clone(members) as Arc<dyn crate::api::admin::MembersChanges>)
        .with_volumes(Arc::clone(&volumes) as Arc<dyn crate::api::admin::VolumeChanges>)
        .with_writers(Arc::clone(writers));
    let (health, health_service) = tonic_health::server::health_reporter();
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| failed(format!("gRPC reflection: {e}")))?;
    let hello = HelloService::new(
        facts.member,
        facts.cluster_id.clone(),
        facts.data,
        Arc::clone(raft.cluster.peers.book()),
    )
    .with_data_dir(&facts.data_dir)
    .with_exports(exports.cloned())
    .with_volumes(Arc::clone(&volumes));
    // The data listener serves every volume of `stores`; today the one
    // this node holds, whose fence tells its own controller to step down.
    let stores = Stores::new(facts.cluster_id.clone());
    let step_down: OnFenced = {
        let controller = Arc::clone(&volume.controller);
        Arc::new(move |floor| controller.step_down(floor))
    };
    stores
        .insert(Arc::clone(&volume.store), Some(step_down))
        .map_err(|e| failed(format!("serving the replica: {e}")))?;
    let replica_service = ReplicaService::serving(stores.clone())
        .of_incarnation(facts.member.incarnation())
        .on_node(facts.id.to_string());
    let until_stopped = |mut stopped: watch::Receiver<bool>| async move {
        let _ = stopped.wait_for(|stop| *stop).await;
    };
    // The gRPC listener is served from Raft's runtime, accept loop and
    // connection I/O included (see `raft::runtime`): a follower's reading
    // of a heartbeat never queues behind block data on the main runtime.
    // The listener moves to that runtime's I/O driver.
    let listener = {
        let _raft_runtime = raft.runtime.handle().enter();
        let std = listener
            .into_std()
            .map_err(|e| failed(format!("moving the gRPC listener: {e}")))?;
        tokio::net::TcpListener::from_std(std)
            .map_err(|e| failed(format!("moving the gRPC listener: {e}")))?
    };
    let server = transport
        .server()
        .add_service(transport.serve(
            Audience::Members,
            RaftService::serving(raft.served.clone()).into_server(),
        ))
        .add_service(transport.serve(Audience::Nodes, hello.into_server()))
        .add_service(transport.serve(Audience::Operators, admin.into_server()))
        .add_service(health_service)
        .add_service(reflection);
    let control = raft.runtime.handle().spawn({
        let (transport, stopped) = (transport.clone(), stopped.clone());
        async move {
            server
                .serve_with_incoming_shutdown(transport.incoming(listener), until_stopped(stopped))
                .await
        }
    });
    let data = tokio::spawn({
        let transport = transport.clone();
        async move { replica_service.serve(&transport, data, stopped).await }
    });
    Ok(GrpcServer {
        stop: stop_server,
        tasks: [control, data],
        health,
        stores,
        volumes,
    })
}

/// Step 4, and the node's background work: the NBD and HTTP listeners and
/// the failure detector (after the start-up window). The volume's own work
/// (step 5 among it) is its own: see [`volume`].
fn spawn_background(
    tasks: &mut Tasks,
    config: &NodeConfig,
    raft: &RaftParts,
    view: &Arc<NodeView>,
    nbd: Option<(tokio::net::TcpListener, crate::nbd::Exports)>,
    http: Option<(tokio::net::TcpListener, Arc<dyn VolumeWriters>)>,
) {
    if let Some((listener, exports)) = nbd {
        let stats = Arc::clone(view.nbd_stats());
        let stop = tasks.stop_signal();
        tasks.spawn_draining(
            "NBD server",
            crate::nbd::serve(listener, exports, stats, stop),
        );
    }
    if let Some((listener, writers)) = http {
        let health = crate::api::http::Health {
            view: Arc::clone(view),
            writers: Some(writers),
        };
        let stopped = tasks.stopped();
        tasks.spawn_draining("HTTP server", async move {
            if let Err(err) = crate::api::http::serve(listener, health, stopped).await {
                tracing::warn!(%err, "the HTTP listener failed");
            }
        });
    }
    let (raft_handle, peers, timing) = (
        raft.cluster.raft.clone(),
        Arc::clone(&raft.cluster.peers),
        config.timing,
    );
    tasks.spawn_on(
        raft.runtime.handle(),
        "heartbeat clock",
        crate::raft::heartbeat::drive(raft.served.clone(), config.timing.heartbeat),
    );
    tasks.spawn_on(raft.runtime.handle(), "failure detector", async move {
        // The start-up window: no campaign before it has passed.
        tokio::time::sleep(timing.election_max).await;
        crate::raft::detector::run(raft_handle, peers, timing).await;
    });
}

/// The NBD listener's exports: one for every volume this node holds (the
/// configured one now, which the empty export name also means; the host
/// adds the table's), with the listener's TLS and the grant of a client
/// without a certificate. Warns of an exposed listener's weaker settings.
fn nbd_exports(
    config: &NodeConfig,
    tls: Option<ExportTls>,
    device: &Arc<dyn crate::volume::Device>,
) -> crate::nbd::Exports {
    let description = format!(
        "replica-ha volume {} of cluster {}",
        config.volume, config.cluster_id
    );
    let anonymous = if config.nbd_anonymous_writes() {
        Grant::ReadWrite
    } else {
        Grant::ReadOnly
    };
    // One listener for every volume this node holds; today that is the
    // configured one, which the empty export name also means.
    let mut exports = crate::nbd::Exports::new().with_anonymous(anonymous);
    if let Some(tls) = tls {
        exports = exports.with_tls(tls);
    }
    let export = Export::new(&config.volume, description, Arc::clone(device));
    exports.insert(Arc::new(export));
    exports.set_default(config.volume.as_str());
    if config.nbd_exposed() && !config.nbd_client_auth && config.nbd_tls != NbdTls::Off {
        tracing::warn!(
            nbd = ?config.nbd,
            "NBD beyond loopback without nbd_client_auth: a client without a \
             certificate may READ the volume (read-only export); set \
             nbd_client_auth = true to require a certificate for reads too"
        );
    }
    if config.nbd_plaintext_exposed() {
        tracing::warn!(
            nbd = ?config.nbd,
            "NBD is PLAINTEXT beyond loopback (nbd_tls = \"off\"): anyone who can reach \
             the port can read the volume and, on the writer, write it, without a \
             certificate; drop nbd_tls = \"off\" to require TLS and client certificates"
        );
    }
    exports
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

/// What status repeats of the configuration, and where the data listener
/// was bound.
fn facts(config: &NodeConfig, data: std::net::SocketAddr, member: MemberId) -> NodeFacts {
    NodeFacts {
        id: config.id,
        member,
        data,
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
        tls: !config.insecure,
        data_dir: config.data_dir.clone(),
    }
}

/// Refuses a data dir that belongs to another cluster or node, and returns
/// its incarnation: drawn at random for a new dir (S8), 0 for a dir made
/// before incarnations existed (recorded as such from then on).
fn check_data_dir_identity(db: &sled::Db, config: &NodeConfig) -> Result<Incarnation, NodeError> {
    let tree = db.open_tree("node").map_err(failed)?;
    let cluster = tree.get("cluster_id").map_err(failed)?;
    let node = tree.get("node_id").map_err(failed)?;
    let incarnation = match (&cluster, &node) {
        (None, None) => Incarnation::random(),
        _ => match tree.get("incarnation").map_err(failed)? {
            None => Incarnation(0),
            Some(bytes) => <[u8; 8]>::try_from(bytes.as_ref())
                .map(|b| Incarnation(u64::from_be_bytes(b)))
                .map_err(|_| failed("corrupt incarnation in the data dir"))?,
        },
    };
    match (cluster, node) {
        (None, None) => {
            // One batch: a crash never leaves a dir with an identity but no
            // incarnation, which would read as incarnation 0 (S8).
            let mut batch = sled::Batch::default();
            batch.insert("incarnation", &incarnation.0.to_be_bytes());
            batch.insert("cluster_id", config.cluster_id.as_bytes());
            batch.insert("node_id", &config.id.0.to_be_bytes());
            tree.apply_batch(batch).map_err(failed)?;
            db.flush().map_err(failed)?;
            tracing::debug!(node = %config.id, %incarnation, "new data dir");
            Ok(incarnation)
        }
        (Some(cluster), Some(node)) => {
            let cluster = String::from_utf8_lossy(&cluster).to_string();
            let node = <[u8; 8]>::try_from(node.as_ref())
                .map(u64::from_be_bytes)
                .map_err(|_| failed("corrupt node id in the data dir"))?;
            if cluster != config.cluster_id || NodeId(node) != config.id {
                return Err(ConfigError(format!(
                    "data dir {} belongs to cluster {cluster:?} node {node}, not cluster {:?} node {}",
                    config.data_dir.display(),
                    config.cluster_id,
                    config.id
                ))
                .into());
            }
            tree.insert("incarnation", &incarnation.0.to_be_bytes())
                .map_err(failed)?;
            Ok(incarnation)
        }
        _ => Err(failed("incomplete node identity in the data dir")),
    }
}
