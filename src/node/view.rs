//! What a node reports about itself, computed in one place for the admin
//! `Status` RPC, `/metrics` and the health checks.
//!
//! Replica states come from the committed Raft control state, so every node
//! reports the same in-sync set; the active writer adds what only its engine
//! knows (a member that is failing but cannot be dropped is `degraded`).
//! Fence floors are asked of each replica with a short deadline; an
//! unreachable one is reported as such, never guessed.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::NodeConfig;
use crate::ha::{Controller, ReplicaState};
use crate::metrics::DeviceMetrics;
use crate::nbd::NbdStats;
use crate::raft::RaftCoordinator;
use crate::replica::resync::{Progress, Resyncer};
use crate::replica::{Replica, ReplicaInfo};
use crate::volume::{Access, Device, DeviceError};

/// How long a status request waits for one replica's fence floor.
const INFO_TIMEOUT: Duration = Duration::from_millis(300);

/// The parts of a running node that status reports read.
pub struct NodeView {
    pub config: NodeConfig,
    pub coordinator: Arc<RaftCoordinator>,
    pub controller: Arc<Controller>,
    /// Every replica, this node's own first.
    pub replicas: Vec<Arc<dyn Replica>>,
    /// The resync of out-of-sync replicas (progress).
    pub resync: Arc<Resyncer>,
    /// The data path: the read gate in front of the write gate, counted.
    /// NBD and admin reads and writes use it.
    pub device: Arc<dyn Device>,
    /// The data path's counters.
    pub io: Arc<DeviceMetrics>,
    /// The NBD server's counters.
    pub nbd: Arc<NbdStats>,
}

/// One replica's line in a report.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaReport {
    pub id: String,
    pub state: ReplicaState,
    /// Whether it is this node's own replica.
    pub local: bool,
    /// Its floor and dirty marks, or why they could not be read.
    pub info: Result<ReplicaInfo, String>,
    /// Its latest rebuild on this node, if any.
    pub resync: Option<Progress>,
}

impl NodeView {
    /// Whether a write through this node's gate would pass now: it is the
    /// active writer, fenced and within its lease.
    pub fn is_active_writer(&self) -> bool {
        self.controller.device().is_writable()
    }

    /// Why this node refuses reads now, or `None` while it serves them: the
    /// active writer reads its in-sync replicas; a passive node serves its
    /// own copy only while that copy is in the committed in-sync set (see
    /// [`crate::ha::ReadGate`]).
    pub fn reads_refused(&self) -> Option<String> {
        match self.device.access() {
            Access::Refused(DeviceError::NotInSync) => Some("replica not in sync".into()),
            Access::Refused(why) => Some(why.to_string()),
            Access::ReadWrite { .. } | Access::ReadOnly => None,
        }
    }

    /// Every replica's state and fence floor, in the order of
    /// [`NodeView::replicas`].
    pub async fn replica_reports(&self) -> Vec<ReplicaReport> {
        let committed = self.coordinator.state_machine().current().control.in_sync;
        let engine: Vec<_> = self.controller.status().replicas;
        let active = self.is_active_writer();
        let progress = self.resync.progress();
        let infos = futures::future::join_all(self.replicas.iter().map(|replica| async move {
            match tokio::time::timeout(INFO_TIMEOUT, replica.info()).await {
                Ok(Ok(info)) => Ok(info),
                Ok(Err(err)) => Err(err.to_string()),
                Err(_) => Err(format!("no answer within {INFO_TIMEOUT:?}")),
            }
        }))
        .await;
        self.replicas
            .iter()
            .zip(infos)
            .map(|(replica, info)| {
                let id = replica.id().to_string();
                let in_sync = id.parse().is_ok_and(|node| committed.contains(&node));
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
                    local: id == self.config.id.to_string(),
                    id,
                    state,
                    info,
                    resync,
                }
            })
            .collect()
    }

    /// The time left on this node's lease, if it holds one now.
    pub fn lease_remaining(&self) -> Option<Duration> {
        let status = self.coordinator.status();
        let now = Instant::now();
        status
            .lease
            .filter(|lease| lease.covers(status.term, now))
            .map(|lease| lease.deadline - now)
    }
}
