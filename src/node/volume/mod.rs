//! One volume on a node: its parts and the work that keeps it running.
//!
//! A [`Volume`] is assembled ([`assemble`]) from this node's copy, the
//! replica set, the engine, the fencer, the controller and its gate, the
//! resync, the scrub and the data path; nothing runs until
//! `Volume::start` spawns its tasks: the controller (S1, S4), the resync
//! and the scrub (S6), mark retirement and marks ahead (S7), hashing ahead
//! while no leader is heard, keeping the replica set in step with the
//! membership (S8), and fixing the volume config in Raft when the cluster
//! has none ([`policy`]). The volume stops them itself: first its writer
//! (`Volume::stop_writing`, which closes the gate), then its tasks
//! (`Volume::stop`).
//!
//! Every invariant stays local to one volume: nothing here reads or
//! writes another volume's parts. The node keeps the volumes in its
//! [`crate::node::host::VolumeHost`].

mod assemble;
mod policy;

use std::sync::Arc;
use std::time::Duration;

use std::collections::BTreeMap;
use std::path::PathBuf;

use super::config::{ConfigError, NodeConfig};
use super::membership;
use super::tasks::Tasks;
use crate::api::status::VolumeProbe;
use crate::ha::Controller;
use crate::ids::{NodeId, VolumeId};
use crate::metrics::DeviceMetrics;
use crate::net::Transport;
use crate::raft::RaftCoordinator;
use crate::raft::group::RaftGroup;
use crate::raft::volume_table::VolumeEntry;
use crate::replica::disk::store::ReplicaStore;
use crate::replica::mirror::engine::Engine;
use crate::replica::mirror::resync::Resyncer;
use crate::replica::mirror::scrub::Scrubber;
use crate::replica::mirror::set::ReplicaSet;
use crate::volume::{Device, VolumeSpec};

/// How often the writer retires the marks of extents that are durable on
/// every in-sync replica (see `Engine::retire_marks`): what a failover must
/// converge is about what the writer wrote in this long.
pub const MARK_RETIREMENT: Duration = Duration::from_millis(200);

/// How long a replica may stay silent (answer nothing while it has requests)
/// before it counts as failed; see `replica::mirror::liveness`.
pub const REPLICA_TIMEOUT: Duration = Duration::from_secs(1);

/// What differs between the volumes of a node: what the volume is, where
/// its copy lives, and who holds the others.
#[derive(Debug, Clone)]
pub struct Site {
    /// The volume: cluster, name, size, `min_in_sync`.
    pub spec: VolumeSpec,
    /// This node's copy's directory.
    pub dir: PathBuf,
    /// Where the scrub keeps the copies it replaced.
    pub keep_dir: PathBuf,
    /// The other nodes that hold a copy at start, by id, with their gRPC
    /// addresses (each is asked for its data address); the membership
    /// changes them later.
    pub peers: BTreeMap<NodeId, String>,
    /// Whether the volume is the cluster group's own, configured on every
    /// node (its spec is checked against the cluster's record, its gate
    /// journal is the configured one, and its membership is the node
    /// list, which admits peers, S8, S9).
    pub configured: bool,
}

impl Site {
    /// The cluster group's own volume, as the node's config describes it.
    pub fn configured(config: &NodeConfig) -> Self {
        Self {
            spec: policy::volume_spec(config),
            dir: config.data_dir.join("replica"),
            keep_dir: config.data_dir.join("scrub-kept"),
            peers: config
                .peers
                .iter()
                .filter(|(id, _)| **id != config.id)
                .map(|(id, addr)| (*id, addr.to_string()))
                .collect(),
            configured: true,
        }
    }

    /// A volume of the table, whose copy this node holds, with every
    /// node's gRPC address from `addresses`. Its copy's directory is named
    /// for its group as well as its name: a name may be reused by a later
    /// volume, a group never is.
    pub fn of_table(
        config: &NodeConfig,
        entry: &VolumeEntry,
        addresses: &BTreeMap<NodeId, String>,
    ) -> Self {
        let dir = config
            .data_dir
            .join("volumes")
            .join(format!("{}-{}", entry.group.0, entry.id));
        let spec = VolumeSpec {
            group: entry.group,
            ..VolumeSpec::new(
                &config.cluster_id,
                &entry.id.0,
                entry.size,
                entry.min_in_sync,
            )
        };
        Self {
            spec,
            keep_dir: dir.join("scrub-kept"),
            dir: dir.join("replica"),
            peers: entry
                .placement
                .iter()
                .filter(|id| **id != config.id)
                .filter_map(|id| addresses.get(id).map(|addr| (*id, addr.clone())))
                .collect(),
            configured: false,
        }
    }
}

/// One volume's parts, wired together, and its running tasks.
pub struct Volume {
    /// The volume's name.
    id: VolumeId,
    /// What and where the volume is.
    site: Site,
    /// What [`Volume::start`] spawned.
    tasks: Tasks,
    /// This node's copy.
    pub store: Arc<ReplicaStore>,
    /// Every copy, this node's first.
    pub replicas: Arc<ReplicaSet>,
    /// The mirror the write gate fronts.
    pub engine: Arc<Engine>,
    pub controller: Arc<Controller>,
    pub resync: Arc<Resyncer>,
    /// The writer's comparison of the in-sync copies.
    pub scrub: Arc<Scrubber>,
    /// The data path: the read gate in front of the write gate, counted.
    pub device: Arc<dyn Device>,
    /// The data path's counters.
    pub io: Arc<DeviceMetrics>,
}

impl Volume {
    /// The volume's name.
    pub fn id(&self) -> &VolumeId {
        &self.id
    }

    /// What and where the volume is.
    pub fn site(&self) -> &Site {
        &self.site
    }

    /// What status reads of the volume, run over `coordinator`'s group.
    pub fn probe(&self, coordinator: &Arc<RaftCoordinator>) -> VolumeProbe {
        VolumeProbe {
            coordinator: Arc::clone(coordinator),
            controller: Arc::clone(&self.controller),
            replicas: Arc::clone(&self.replicas),
            resync: Arc::clone(&self.resync),
            scrub: Arc::clone(&self.scrub),
            device: Arc::clone(&self.device),
            io: Arc::clone(&self.io),
            size: self.site.spec.size,
            min_in_sync: self.site.spec.min_in_sync,
        }
    }

    /// Spawns the volume's tasks (see the module docs) over its Raft group
    /// `raft` and the node's transport.
    pub(super) fn start(&mut self, config: &NodeConfig, raft: &RaftGroup, transport: &Transport) {
        let tasks = &mut self.tasks;
        if let Some(channels) = self.replicas.channels() {
            tasks.spawn(
                "replica set follows the membership",
                membership::follow_membership(
                    Arc::clone(&raft.coordinator),
                    Arc::clone(&self.replicas),
                    self.site.configured.then(|| transport.clone()),
                    membership::remote_maker(
                        Arc::clone(channels),
                        config.cluster_id.clone(),
                        self.site.spec.name.clone(),
                        self.site.spec.group,
                        crate::replica::mirror::liveness::longest_wait(REPLICA_TIMEOUT),
                    ),
                ),
            );
        }
        tasks.spawn("resync", Arc::clone(&self.resync).run());
        tasks.spawn("scrub", Arc::clone(&self.scrub).run());
        tasks.spawn(
            "mark retirement",
            Arc::clone(&self.engine).run_mark_retirement(MARK_RETIREMENT),
        );
        tasks.spawn("mark ahead", Arc::clone(&self.engine).run_mark_ahead());
        let controller = Arc::clone(&self.controller);
        tasks.spawn("controller", async move {
            if let Err(err) = controller.run().await {
                tracing::info!(%err, "controller stopped");
            }
        });
        tasks.spawn(
            "predigest",
            policy::predigest_when_leader_silent(
                Arc::clone(&self.store),
                raft.raft.clone(),
                Arc::clone(&raft.peers),
                config.timing,
            ),
        );
        tasks.spawn(
            "volume config",
            policy::fix_volume_spec(Arc::clone(&raft.coordinator), self.site.spec.clone()),
        );
    }

    /// Resolves when the cluster's recorded config of this volume differs
    /// from the one this node was configured with.
    pub(super) async fn conflict(&self, raft: &RaftGroup) -> ConfigError {
        match self.site.configured {
            true => policy::conflict(&raft.coordinator, &self.site.spec).await,
            false => std::future::pending().await,
        }
    }

    /// Closes the gate: no client write is admitted from now on. Gives up
    /// after `grace`, saying so.
    pub(super) async fn stop_writing(&self, grace: Duration) {
        if tokio::time::timeout(grace, self.controller.stop())
            .await
            .is_err()
        {
            tracing::warn!(volume = %self.id, "stopping the controller timed out");
        }
    }

    /// Stops the volume's tasks, waiting up to `deadline`.
    pub(super) async fn stop(self, deadline: Duration) {
        self.tasks.stop(deadline).await;
    }
}
