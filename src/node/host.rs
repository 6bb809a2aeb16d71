//! The volumes a node hosts, by id.
//!
//! The [`VolumeHost`] owns each [`Volume`] the node holds a copy of; the
//! node itself keeps only node-wide work (identity, transport,
//! certificates, Raft, health and the listeners). A volume is started and
//! stopped through the host, and every volume stops its own tasks.
//!
//! One volume is all a node hosts for now (the one in its config); the
//! host is the seam at which a node will hold many.

use std::collections::BTreeMap;
use std::time::Duration;

use super::config::{ConfigError, NodeConfig};
use super::volume::Volume;
use super::{NodeError, RaftParts, failed};
use crate::ids::VolumeId;
use crate::net::Transport;

/// See the module docs.
#[derive(Default)]
pub struct VolumeHost {
    volumes: BTreeMap<VolumeId, Volume>,
}

impl VolumeHost {
    /// Takes `volume` in; a second volume of the same id is refused.
    pub fn insert(&mut self, volume: Volume) -> Result<(), NodeError> {
        if self.volumes.contains_key(volume.id()) {
            return Err(failed(format!("volume {} is hosted already", volume.id())));
        }
        self.volumes.insert(volume.id().clone(), volume);
        Ok(())
    }

    /// The volume named `id`, when this node hosts it.
    pub fn get(&self, id: &VolumeId) -> Option<&Volume> {
        self.volumes.get(id)
    }

    /// Every hosted volume, by id.
    pub fn volumes(&self) -> impl Iterator<Item = &Volume> {
        self.volumes.values()
    }

    /// Starts every volume's tasks.
    pub(super) fn start(&mut self, config: &NodeConfig, raft: &RaftParts, transport: &Transport) {
        for volume in self.volumes.values_mut() {
            volume.start(config, raft, transport);
        }
    }

    /// Resolves with the first conflict between a volume's recorded config
    /// and this node's; never, when there is none.
    pub(super) async fn conflict(&self, raft: &RaftParts) -> ConfigError {
        let conflicts: Vec<_> = self
            .volumes
            .values()
            .map(|volume| Box::pin(volume.conflict(raft)))
            .collect();
        if conflicts.is_empty() {
            return std::future::pending().await;
        }
        futures::future::select_all(conflicts).await.0
    }

    /// Closes every volume's gate, all at once, each within `grace`.
    pub(super) async fn stop_writing(&self, grace: Duration) {
        futures::future::join_all(self.volumes.values().map(|v| v.stop_writing(grace))).await;
    }

    /// Stops every volume's tasks, all at once, within `deadline`.
    pub(super) async fn stop(self, deadline: Duration) {
        futures::future::join_all(self.volumes.into_values().map(|v| v.stop(deadline))).await;
    }
}
