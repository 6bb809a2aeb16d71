//! What status reads of one volume, the same way for every volume a node
//! runs: the configured one and each of the table's.
//!
//! A [`VolumeProbe`] holds a running volume's parts (its group's
//! coordinator, its controller, replicas, resync, scrub and data path);
//! [`VolumeProbe::figures`] reads them into [`VolumeFigures`], plain data.
//! A [`VolumeReport`] is a volume as this node sees it, whether it runs a
//! copy (then with its figures) or not (then only what the cluster group's
//! table says: name, group, size, placement). The node's table of volumes
//! reports through [`TableVolumes`].
//!
//! A volume's figures come from its own group and its own parts only
//! (every invariant stays local to one volume); the replica states are
//! its group's committed in-sync set, with what only the active writer
//! knows (a failing member kept in the set is `degraded`; a copy being
//! rebuilt is `rebuilding`).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::{INFO_TIMEOUT, ReplicaReport, SuspendedIo};
use crate::ha::{Controller, ReplicaState, Role};
use crate::ids::{GroupId, NodeId, Term};
use crate::metrics::DeviceMetrics;
use crate::raft::{RaftCoordinator, WriterRecord};
use crate::replica::mirror::resync::Resyncer;
use crate::replica::mirror::scrub::{ScrubStatus, Scrubber};
use crate::replica::mirror::set::ReplicaSet;
use crate::volume::{Access, Device, DeviceError};

/// A running volume's parts that status reads. Cheap to clone.
#[derive(Clone)]
pub struct VolumeProbe {
    /// The volume's group's coordinator (group 0's for the configured
    /// volume).
    pub coordinator: Arc<RaftCoordinator>,
    pub controller: Arc<Controller>,
    /// Every copy, this node's first.
    pub replicas: Arc<ReplicaSet>,
    pub resync: Arc<Resyncer>,
    pub scrub: Arc<Scrubber>,
    /// The data path: the read gate in front of the write gate, counted.
    pub device: Arc<dyn Device>,
    /// The data path's counters.
    pub io: Arc<DeviceMetrics>,
    /// The size and `min_in_sync` it was configured or created with (the
    /// group's recorded ones win once there are any).
    pub size: u64,
    pub min_in_sync: usize,
}

/// What a node that runs a copy of a volume sees of it, at one moment.
#[derive(Debug, Clone)]
pub struct VolumeFigures {
    /// The volume's group's term and the leader this node knows there.
    pub term: Term,
    pub leader: Option<NodeId>,
    /// The time left on this node's lease of the group, if it holds one.
    pub lease_remaining: Option<Duration>,
    pub prev_writer: Option<WriterRecord>,
    pub in_sync: BTreeSet<NodeId>,
    /// The volume's size and `min_in_sync`: the group's recorded ones, or
    /// the configured (created) ones before any were recorded.
    pub size: u64,
    pub min_in_sync: usize,
    pub role: Role,
    /// Whether a write through this node's gate would pass now.
    pub gate_open: bool,
    pub fence_failures: u64,
    pub promotions: u64,
    /// Every copy, this node's first.
    pub replicas: Vec<ReplicaReport>,
    /// Why this node refuses reads now; `None` while it serves them.
    pub reads_refused: Option<String>,
    /// Writes held below `min_in_sync` (design C2), and what will end it.
    pub suspended: Option<SuspendedIo>,
    /// What this node's scrub has done (all zero unless it has written).
    pub scrub: ScrubStatus,
    /// The configured background scrub rate (bytes per second, 0: off).
    pub scrub_rate: u64,
    /// The data path's counters (live).
    pub io: Arc<DeviceMetrics>,
}

/// One volume as this node sees it.
#[derive(Debug, Clone)]
pub struct VolumeReport {
    pub name: String,
    /// Its Raft group (0: the cluster group's own, the configured volume).
    pub group: GroupId,
    /// The size and `min_in_sync` the table records.
    pub size: u64,
    pub min_in_sync: usize,
    /// The nodes that hold its copies.
    pub placement: Vec<NodeId>,
    /// What this node's copy reports; `None` while it runs none (see
    /// [`VolumeReport::here`]).
    pub figures: Option<VolumeFigures>,
}

/// Whether a node runs a copy of a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Here {
    /// It runs one.
    Running,
    /// The table places a copy here that does not run (yet).
    Starting,
    /// It holds no copy.
    Elsewhere,
}

impl Here {
    /// The name status uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Here::Running => "running",
            Here::Starting => "starting",
            Here::Elsewhere => "elsewhere",
        }
    }
}

impl VolumeReport {
    /// Whether node `local` (the one reporting) runs a copy.
    pub fn here(&self, local: NodeId) -> Here {
        match (&self.figures, self.placement.contains(&local)) {
            (Some(_), _) => Here::Running,
            (None, true) => Here::Starting,
            (None, false) => Here::Elsewhere,
        }
    }

    /// The nodes of the placement that the running copy's replica set
    /// lacks (none while this node runs no copy: it cannot tell).
    pub fn missing(&self) -> Vec<NodeId> {
        let Some(figures) = &self.figures else {
            return Vec::new();
        };
        self.placement
            .iter()
            .filter(|id| !figures.replicas.iter().any(|r| r.id == **id))
            .copied()
            .collect()
    }
}

/// The table's volumes as a node sees them (see `node::writers`).
#[async_trait::async_trait]
pub trait TableVolumes: Send + Sync {
    /// Each volume of the cluster group's table, in the table's order.
    async fn reports(&self) -> Vec<VolumeReport>;
}

impl VolumeProbe {
    /// Whether a write through this node's gate of the volume would pass
    /// now: it is the active writer, fenced and within its lease.
    pub fn is_active_writer(&self) -> bool {
        self.controller.device().is_writable()
    }

    /// Everything this node sees of the volume now; `local` is this node.
    pub async fn figures(&self, local: NodeId) -> VolumeFigures {
        let raft = self.coordinator.status();
        let controller = self.controller.status();
        let control = raft.applied.control.clone();
        let (size, min_in_sync) = match &control.volume {
            Some(volume) => (
                control.volume_size().unwrap_or(volume.size),
                volume.min_in_sync,
            ),
            None => (self.size, self.min_in_sync),
        };
        let replicas = self.replica_reports(local).await;
        VolumeFigures {
            term: raft.term,
            leader: raft.leader,
            lease_remaining: self.lease_remaining(),
            prev_writer: control.writer,
            in_sync: control.in_sync,
            size,
            min_in_sync,
            role: controller.role,
            gate_open: self.is_active_writer(),
            fence_failures: controller.fence_failures,
            promotions: controller.promotions,
            suspended: self.suspended(&replicas),
            replicas,
            reads_refused: self.reads_refused(),
            scrub: self.scrub.status(),
            scrub_rate: self.scrub.rate(),
            io: Arc::clone(&self.io),
        }
    }

    /// The writes held below `min_in_sync`, with what will end the wait:
    /// a rebuild's progress, or a replica coming back.
    fn suspended(&self, replicas: &[ReplicaReport]) -> Option<SuspendedIo> {
        let held = self.controller.device().suspension();
        let since = held.since.filter(|_| held.waiting > 0)?;
        let rebuilds: Vec<String> = replicas
            .iter()
            .filter_map(|r| {
                let progress = r.resync.filter(|p| p.running)?;
                let percent = 100 * progress.done / progress.total.max(1);
                Some(format!("node {}'s rebuild, {percent}%", r.id))
            })
            .collect();
        let until = if rebuilds.is_empty() {
            "waiting for a replica to answer or come back".to_string()
        } else {
            format!("waiting for {}", rebuilds.join(" and "))
        };
        Some(SuspendedIo {
            waiting: held.waiting,
            for_how_long: since.elapsed(),
            why: format!("{}; {until}", held.why),
        })
    }

    /// Why this node refuses reads now, or `None` while it serves them: the
    /// active writer reads its in-sync replicas; a passive node serves its
    /// own copy only while that copy is in the committed in-sync set (see
    /// [`crate::ha::ReadGate`]).
    fn reads_refused(&self) -> Option<String> {
        match self.device.access() {
            Access::Refused(DeviceError::NotInSync) => Some("replica not in sync".into()),
            Access::Refused(why) => Some(why.to_string()),
            Access::ReadWrite { .. } | Access::ReadOnly => None,
        }
    }

    /// Every replica's state and fence floor, this node's own first.
    async fn replica_reports(&self, local: NodeId) -> Vec<ReplicaReport> {
        let committed = self.coordinator.state_machine().current().control.in_sync;
        let engine: Vec<_> = self.controller.status().replicas;
        let active = self.is_active_writer();
        let progress = self.resync.progress();
        let members = self.replicas.members();
        let infos = futures::future::join_all(members.iter().map(|replica| async move {
            match tokio::time::timeout(INFO_TIMEOUT, replica.info()).await {
                Ok(Ok(info)) => Ok(info),
                Ok(Err(err)) => Err(err.to_string()),
                Err(_) => Err(format!("no answer within {INFO_TIMEOUT:?}")),
            }
        }))
        .await;
        members
            .iter()
            .zip(infos)
            .map(|(replica, info)| {
                let id = replica.id();
                let in_sync = committed.contains(&id);
                let degraded = active
                    && engine
                        .iter()
                        .any(|r| r.id == id && r.state == ReplicaState::Degraded);
                let resync = progress.get(&id).copied();
                let rebuilding = active && resync.is_some_and(|p| p.running);
                let state = match (in_sync, degraded, rebuilding) {
                    (true, true, _) => ReplicaState::Degraded,
                    (true, false, _) => ReplicaState::InSync,
                    (false, _, true) => ReplicaState::Rebuilding,
                    (false, _, false) => ReplicaState::Offline,
                };
                ReplicaReport {
                    local: id == local,
                    id,
                    state,
                    info,
                    resync,
                }
            })
            .collect()
    }

    /// The time left on this node's lease, if it holds one now.
    fn lease_remaining(&self) -> Option<Duration> {
        let status = self.coordinator.status();
        let now = Instant::now();
        status
            .lease
            .filter(|lease| lease.covers(status.term, now))
            .map(|lease| lease.deadline - now)
    }
}

#[cfg(test)]
impl VolumeFigures {
    /// What node 1 sees of a volume in term `term`, with copies in sync on
    /// `copies`, as the controller in `role` (the writer's gate open).
    pub fn sample(role: Role, term: u64, copies: &[u64]) -> Self {
        let copy = |id: &u64| ReplicaReport {
            id: NodeId(*id),
            state: ReplicaState::InSync,
            local: *id == 1,
            info: Ok(Default::default()),
            resync: None,
        };
        VolumeFigures {
            term: Term(term),
            leader: Some(NodeId(1)),
            lease_remaining: None,
            prev_writer: None,
            in_sync: copies.iter().copied().map(NodeId).collect(),
            size: 4 << 20,
            min_in_sync: 2,
            role,
            gate_open: role == Role::Leader,
            fence_failures: 0,
            promotions: 0,
            replicas: copies.iter().map(copy).collect(),
            reads_refused: None,
            suspended: None,
            scrub: Default::default(),
            scrub_rate: 0,
            io: Arc::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Here, VolumeFigures, VolumeReport};
    use crate::ha::Role;
    use crate::ids::{GroupId, NodeId};

    fn placed_on(nodes: &[u64], figures: Option<VolumeFigures>) -> VolumeReport {
        VolumeReport {
            name: "db".into(),
            group: GroupId(1),
            size: 4 << 20,
            min_in_sync: 2,
            placement: nodes.iter().copied().map(NodeId).collect(),
            figures,
        }
    }

    #[test]
    fn a_volume_is_running_starting_or_elsewhere_by_its_copy_here() {
        let running = placed_on(
            &[1, 2],
            Some(VolumeFigures::sample(Role::Leader, 3, &[1, 2])),
        );
        assert_eq!(running.here(NodeId(1)), Here::Running);
        assert_eq!(placed_on(&[1, 2], None).here(NodeId(1)), Here::Starting);
        assert_eq!(placed_on(&[2, 3], None).here(NodeId(1)), Here::Elsewhere);
    }

    #[test]
    fn a_placed_node_the_replica_set_lacks_is_missing_and_unknown_without_a_copy() {
        let figures = VolumeFigures::sample(Role::Follower, 3, &[1, 2]);
        assert_eq!(placed_on(&[1, 2, 4], Some(figures)).missing(), [NodeId(4)]);
        assert!(placed_on(&[2, 3, 4], None).missing().is_empty());
    }
}
