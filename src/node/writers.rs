//! Where the admin API and the health checks read the writer of a volume of
//! the table: the node's [`VolumeWriters`].
//!
//! A volume this node runs answers from its own group and gate (its
//! [`LeaderSource`], from [`HostedVolumes`]). One it does not run is
//! looked up in the cluster group's applied table: placed on other nodes,
//! the answer names them with their gRPC addresses (the peer list's, else
//! the membership's record), so a client such as `attach` can ask them;
//! placed here, the copy is starting (or its start failed and is tried
//! again); absent, there is no such volume. Nothing here changes state.
//!
//! The same holds for what status reports of the table's volumes
//! ([`TableVolumes`]): each volume of the applied table, with the figures
//! of this node's copy where it runs one (read from the volume's own
//! parts, as for the configured volume), else only what the table says.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::host::HostedVolumes;
use crate::api::admin::{NotHere, VolumeWriters};
use crate::api::status::{LeaderSource, TableVolumes, VolumeReport};
use crate::ids::{NodeId, VolumeId};
use crate::raft::RaftCoordinator;

/// The writers of the table's volumes as this node sees them; see the
/// module docs.
pub struct TableWriters {
    /// The cluster group's coordinator: the table as applied here.
    cluster: Arc<RaftCoordinator>,
    /// The table's volumes this node runs.
    hosted: HostedVolumes,
    /// Every node's gRPC address from this node's peer list, preferred to
    /// the membership's record.
    configured: BTreeMap<NodeId, String>,
}

impl TableWriters {
    /// The writers of the volumes in `cluster`'s table, those this node
    /// runs read from `hosted`.
    pub fn new(
        cluster: Arc<RaftCoordinator>,
        hosted: HostedVolumes,
        configured: BTreeMap<NodeId, String>,
    ) -> Self {
        Self {
            cluster,
            hosted,
            configured,
        }
    }

    /// Why the volume `name`, which this node does not run, has no writer
    /// here (see the module docs).
    pub fn not_here(&self, name: &VolumeId) -> NotHere {
        let applied = self.cluster.state_machine().current();
        let Some(entry) = applied.control.volumes.get(name) else {
            return NotHere::Unknown(name.clone());
        };
        let me = self.cluster.member().node();
        if entry.placement.contains(&me) {
            return NotHere::NotRunning(name.clone());
        }
        let recorded: BTreeMap<NodeId, String> = applied
            .membership
            .membership()
            .nodes()
            .map(|(member, node)| (member.node(), node.addr.clone()))
            .collect();
        let holders = entry
            .placement
            .iter()
            .map(|id| {
                let addr = self
                    .configured
                    .get(id)
                    .or_else(|| recorded.get(id))
                    .cloned()
                    .unwrap_or_default();
                (*id, addr)
            })
            .collect();
        NotHere::Elsewhere {
            name: name.clone(),
            holders,
        }
    }
}

#[async_trait::async_trait]
impl VolumeWriters for TableWriters {
    async fn leader_source(&self, name: &VolumeId) -> Result<LeaderSource, NotHere> {
        match self.hosted.leader_source(name).await {
            Some(source) => Ok(source),
            None => Err(self.not_here(name)),
        }
    }
}

#[async_trait::async_trait]
impl TableVolumes for TableWriters {
    async fn reports(&self) -> Vec<VolumeReport> {
        let probes = self.hosted.probes().await;
        let applied = self.cluster.state_machine().current();
        let me = self.cluster.member().node();
        let reports = applied.control.volumes.volumes().map(|entry| {
            // A copy of an earlier volume of the name is not this one's.
            let probe = probes
                .get(&entry.id)
                .filter(|(group, _)| *group == entry.group)
                .map(|(_, probe)| probe);
            async move {
                let figures = match probe {
                    Some(probe) => Some(probe.figures(me).await),
                    None => None,
                };
                VolumeReport {
                    name: entry.id.to_string(),
                    group: entry.group,
                    size: entry.size,
                    min_in_sync: entry.min_in_sync,
                    placement: entry.placement.iter().copied().collect(),
                    figures,
                }
            }
        });
        futures::future::join_all(reports).await
    }
}
