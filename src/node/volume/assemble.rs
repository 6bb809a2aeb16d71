//! The wiring of one volume's parts on a node: its replica store, the
//! replica set (this node's copy without a network hop, every peer's over
//! the transport), the engine, the fencer, the controller and its write
//! gate, the resync and the scrub, and the data path that NBD and the admin
//! API use (the read gate in front of the write gate, counted).

use std::sync::Arc;
use std::time::Duration;

use super::{REPLICA_TIMEOUT, Site, Volume};
use crate::ha::{Controller, ControllerConfig, Coordinator, InSyncTracker, ReadGate, WriterEngine};
use crate::ids::VolumeId;
use crate::metrics::{DeviceMetrics, MeteredDevice};
use crate::net::Transport;
use crate::node::config::{ConfigError, NodeConfig};
use crate::node::tasks::Tasks;
use crate::node::{NodeError, failed, journal, reads};
use crate::raft::RaftCoordinator;
use crate::replica::disk::local::LocalReplica;
use crate::replica::disk::store::{ReplicaStore, StoreIdentity};
use crate::replica::mirror::engine::{Engine, EngineConfig};
use crate::replica::mirror::fencer::TokenFencer;
use crate::replica::mirror::resync::{ResyncConfig, Resyncer};
use crate::replica::mirror::scrub::{ScrubConfig, Scrubber};
use crate::replica::mirror::set::ReplicaSet;
use crate::replica::peer::channels::Channels;
use crate::replica::peer::remote::RemoteReplica;
use crate::replica::{FloorBook, Replica, ReplicaError};

/// How long one fence attempt may take before the controller retries.
const FENCE_TIMEOUT: Duration = Duration::from_secs(10);

impl Volume {
    /// Opens this node's copy of the volume at `site` and wires its parts
    /// over its group's `coordinator` and `transport`. Nothing runs yet:
    /// see `Volume::start`.
    pub async fn assemble(
        config: &NodeConfig,
        site: Site,
        transport: &Transport,
        coordinator: &Arc<RaftCoordinator>,
    ) -> Result<Self, NodeError> {
        let spec = site.spec.clone();
        let store = Arc::new(open_store(&site).await?);
        let replicas = Arc::new(replica_set(
            config,
            &site,
            transport,
            &store,
            Arc::clone(coordinator.book()),
        )?);
        let tracker: Arc<dyn InSyncTracker> = Arc::clone(coordinator) as Arc<dyn InSyncTracker>;
        let floors = Arc::new(FloorBook::default());
        let engine = Engine::over(
            EngineConfig {
                local_id: config.id,
                replica_timeout: REPLICA_TIMEOUT,
                volume: spec.clone(),
            },
            Arc::clone(&replicas),
            Arc::clone(&tracker),
        )
        .map_err(|e| ConfigError(e.to_string()))?
        .with_floor_book(Arc::clone(&floors));
        let engine = Arc::new(engine);
        let fencer = TokenFencer::new(Arc::clone(&replicas), tracker, &spec, REPLICA_TIMEOUT)
            .with_floor_book(floors);
        let controller = Arc::new(Controller::new(
            Arc::clone(&engine) as Arc<dyn WriterEngine>,
            Arc::clone(coordinator) as Arc<dyn Coordinator>,
            Arc::new(fencer),
            ControllerConfig {
                fence_timeout: FENCE_TIMEOUT,
                retry_interval: Duration::from_millis(200),
                suspend_timeout: config.suspend_timeout,
            },
        ));
        if let Some(path) = config.gate_journal.as_ref().filter(|_| site.configured) {
            let journal = journal::FileJournal::open(path)
                .map_err(|err| ConfigError(format!("gate journal {}: {err}", path.display())))?;
            controller
                .device()
                .record_to(Arc::new(journal))
                .map_err(|err| failed(err.to_string()))?;
        }
        let members = {
            let applied = coordinator.state_machine().subscribe();
            Box::new(move || {
                applied
                    .borrow()
                    .membership
                    .membership()
                    .nodes()
                    .map(|(member, _)| member.node())
                    .collect()
            })
        };
        let resync = Arc::new(
            Resyncer::new(
                Arc::clone(&engine),
                ResyncConfig {
                    rate: config.resync_rate,
                    ..ResyncConfig::default()
                },
            )
            .closing_maps_of_former_members(members),
        );
        let scrub = Arc::new(Scrubber::new(
            Arc::clone(&engine),
            ScrubConfig {
                rate: config.scrub_rate,
                keep_dir: Some(site.keep_dir.clone()),
            },
        ));
        let io = Arc::new(DeviceMetrics::default());
        let local_copy = reads::RaftLocalCopy::new(
            coordinator.member(),
            replicas.local(),
            coordinator.state_machine().subscribe(),
        );
        let gated = ReadGate::new(controller.device(), Arc::new(local_copy));
        let device = Arc::new(MeteredDevice::new(Arc::new(gated), Arc::clone(&io)));
        Ok(Self {
            id: VolumeId(spec.name.clone()),
            site,
            tasks: Tasks::default(),
            store,
            replicas,
            engine,
            controller,
            resync,
            scrub,
            device,
            io,
        })
    }
}

/// Opens this node's replica; one of another cluster, volume or size is a
/// configuration error.
async fn open_store(site: &Site) -> Result<ReplicaStore, NodeError> {
    let identity = StoreIdentity::from(&site.spec);
    let dir = &site.dir;
    ReplicaStore::open(dir, identity)
        .await
        .map_err(|err| match err {
            ReplicaError::IdentityMismatch(why) | ReplicaError::InvalidIdentity(why) => {
                NodeError::Config(ConfigError(format!("replica in {}: {why}", dir.display())))
            }
            other => failed(format!("replica in {}: {other}", dir.display())),
        })
}

/// Every replica of the volume: this node's own without a network hop, the
/// peers' over `transport`, through one channel pool that learns each
/// peer's data address from the peer (or from `peer_data`), and names in
/// every request the peer's incarnation that `book` expects (S8).
fn replica_set(
    config: &NodeConfig,
    site: &Site,
    transport: &Transport,
    store: &Arc<ReplicaStore>,
    book: Arc<crate::members::MemberBook>,
) -> Result<ReplicaSet, NodeError> {
    let local_id = config.id;
    let channels = Arc::new(
        Channels::new(
            transport.clone(),
            &config.cluster_id,
            local_id,
            REPLICA_TIMEOUT,
        )
        .with_book(book),
    );
    let mut replicas: Vec<Arc<dyn Replica>> =
        vec![Arc::new(LocalReplica::new(local_id, Arc::clone(store)))];
    for (id, addr) in &site.peers {
        if *id != config.id {
            channels.add(*id, addr.to_string(), config.peer_data.get(id).cloned());
            let remote = RemoteReplica::through(
                *id,
                Arc::clone(&channels),
                &config.cluster_id,
                &site.spec.name,
                site.spec.group,
                // The engine and the fencer give up on a silent replica
                // after REPLICA_TIMEOUT; the transport allows a busy one to
                // take as long as they may wait.
                crate::replica::mirror::liveness::longest_wait(REPLICA_TIMEOUT),
            );
            replicas.push(Arc::new(remote));
        }
    }
    Ok(ReplicaSet::new(local_id, replicas)
        .map_err(|e| ConfigError(e.to_string()))?
        .with_channels(channels))
}
