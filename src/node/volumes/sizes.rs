//! Growing a volume of the table (`replica-ha volume resize`), and the
//! table's record of its size.
//!
//! A table volume's size lives in two records: its own group's committed
//! size (`Request::Resize` there, what the engine serves and what a
//! rebuild grows a copy to) and the cluster group's table entry
//! (`VolumeEntry.size`: what `volume list` shows and what a node starts
//! the volume with). **The group's wins**: it is committed only after
//! every copy that is or may be in the in-sync set has grown (the engine's
//! growth before commit, the same code as for the configured volume), so
//! it is the one the safety argument rests on. The table follows it and is
//! never ahead of it: a size is recorded only after the group committed
//! it, and only as a holder of a copy reports it.
//!
//! Growth, on the node asked:
//! 1. The size is checked against the table as applied here (unknown
//!    volume, a size no volume may have, a shrink), so that a bad request
//!    gets its own error on any node.
//! 2. A node that is not the volume's writer names the node to ask: the
//!    writer it knows, or, when it holds no copy, the first node holding
//!    one that answers it now (which knows the writer). The CLI follows.
//! 3. The writer grows the volume through its engine
//!    ([`crate::replica::mirror::engine::Engine::resize`]):
//!    every in-sync copy grows, the size is committed in the volume's
//!    group, and only then served to new connections.
//! 4. The writer records the size in the table: committed directly when it
//!    leads the cluster group, else sent to the leader (`Node.RecordSize`),
//!    which commits `ResizeVolume` after checking that the sender holds a
//!    copy of that volume of that group.
//!
//! A crash or a lost leader between 3 and 4 leaves the volume grown and
//! served, and the table at the old size: safe (the table is only ever
//! behind, and a node that starts the volume takes the larger of the two,
//! its copy keeping its own recorded size), and finished by itself:
//! every writer checks every [`RECHECK`] whether its group committed more
//! than the table records, and records it ([`VolumeTableChanges::record_sizes`]).
//! Asking again for the same size also finishes it. The leader commits a
//! record only when no member that answers runs a build without
//! [`FEATURE_SIZES`] (one could not apply the entry).

use std::sync::Arc;
use std::time::Duration;

use super::VolumeTableChanges;
use crate::api::admin::VolumeError;
use crate::ids::{GroupId, NodeId, VolumeId};
use crate::net::Expect;
use crate::node::hello::FEATURE_SIZES;
use crate::node::host::RECHECK;
use crate::proto::node::RecordSizeRequest;
use crate::proto::node::node_client::NodeClient;
use crate::raft::Request;
use crate::volume::Device;

/// How long the leader may take to record a size.
const RECORD_TIMEOUT: Duration = Duration::from_secs(5);

/// How many leaders a record follows before it gives up (the leader
/// moves while it asks).
const RECORD_HOPS: usize = 3;

impl VolumeTableChanges {
    /// Grows table volume `name` to `size` bytes (see the module docs);
    /// the size served before and after.
    pub(super) async fn grow(&self, name: VolumeId, size: u64) -> Result<(u64, u64), VolumeError> {
        let control = self.cluster.state_machine().current().control;
        let entry = control.volumes.check_growth(&name, size)?.clone();
        let me = self.cluster.member().node();
        let Some(engine) = self.hosted.engine(&name, entry.group).await else {
            if entry.placement.contains(&me) {
                return Err(VolumeError::Failed(format!(
                    "volume {name} has a copy on this node that does not run yet; ask again"
                )));
            }
            // The first holder that answers now (one that is down would
            // only send the client back here).
            let mut holders = self.members();
            holders.retain(|member, _| entry.placement.contains(&member.node()));
            let answered = self.answers(&holders).await.into_iter();
            let holder = answered
                .filter(|(_, answer)| answer.is_ok())
                .find_map(|(member, _)| holders.remove_entry(&member))
                .map(|(member, addr)| (member.node(), addr));
            return Err(VolumeError::NotWriter { name, at: holder });
        };
        let view = self.hosted.views().await.remove(&name);
        if !view.as_ref().is_some_and(|view| view.writing) {
            let writer = view.and_then(|view| view.leader).filter(|id| *id != me);
            let at = writer.and_then(|id| self.addresses().remove(&id).map(|addr| (id, addr)));
            return Err(VolumeError::NotWriter { name, at });
        }
        let previous = engine.size();
        let size = engine.resize(size).await?;
        let recorded = self.record(&name, entry.group, size).await;
        if let Err(err) = recorded {
            return Err(VolumeError::Failed(format!(
                "volume {name} grew to {size} bytes and serves them, but the volume table still \
                 records {} bytes ({err}); this writer records it within {} s by itself, or ask \
                 again for the same size",
                entry.size,
                RECHECK.as_secs()
            )));
        }
        Ok((previous, size))
    }

    /// Has the cluster group's leader record that volume `name` of group
    /// `group` is `size` bytes: this node, or the leader it names (see
    /// the module docs, step 4). The size the table records then.
    async fn record(&self, name: &VolumeId, group: GroupId, size: u64) -> Result<u64, VolumeError> {
        let me = self.cluster.member().node();
        let mut ask = match self.leading().await {
            Ok(_) => return self.accept(me, name.clone(), group, size).await,
            Err(VolumeError::NotLeader(Some(leader))) => leader,
            Err(err) => return Err(err),
        };
        for _ in 0..RECORD_HOPS {
            let (leader, addr) = &ask;
            let mut client = self
                .transport
                .client(addr, Expect::Node(*leader), NodeClient::new)
                .map_err(|err| VolumeError::Failed(err.to_string()))?;
            let mut request = tonic::Request::new(RecordSizeRequest {
                cluster_id: self.cluster_id.clone(),
                from: me.0,
                volume: name.0.clone(),
                group: group.0,
                size,
            });
            request.set_timeout(RECORD_TIMEOUT);
            let reply = client
                .record_size(request)
                .await
                .map_err(|status| {
                    VolumeError::Failed(format!("node {leader}: {}", status.message()))
                })?
                .into_inner();
            if reply.redirect.is_empty() {
                return Ok(reply.size);
            }
            ask = (*leader, reply.redirect);
        }
        Err(VolumeError::Failed(
            "the cluster group's leadership kept moving".into(),
        ))
    }

    /// The leader's side of a record (see the module docs, step 4):
    /// volume `name` of group `group` grew to `size` bytes, as node
    /// `from`, which holds a copy, says. The size the table records then.
    pub async fn accept(
        &self,
        from: NodeId,
        name: VolumeId,
        group: GroupId,
        size: u64,
    ) -> Result<u64, VolumeError> {
        let term = self.leading().await?;
        let control = self.cluster.state_machine().current().control;
        let entry = control
            .volumes
            .get(&name)
            .ok_or_else(|| crate::raft::volume_table::TableError::Unknown(name.clone()))?;
        if !entry.placement.contains(&from) {
            return Err(VolumeError::Refused(format!(
                "node {from} holds no copy of volume {name}; only a holder reports its size"
            )));
        }
        if entry.group == group && entry.size >= size {
            return Ok(entry.size);
        }
        let mut check = control.volumes.clone();
        check.grow(&name, group, size)?;
        let members = self.members();
        for (member, answer) in self.answers(&members).await {
            if matches!(answer, Ok((features, _)) if features & FEATURE_SIZES == 0) {
                return Err(VolumeError::Refused(format!(
                    "node {} runs an earlier build that cannot record a volume's size; upgrade \
                     it (volume {name} serves {size} bytes meanwhile)",
                    member.node()
                )));
            }
        }
        let request = Request::ResizeVolume { name, group, size };
        let response = self.commit(term, request).await?;
        Ok(response.volume.map_or(size, |entry| entry.size))
    }

    /// Every [`RECHECK`]: records the size of each volume this node writes
    /// whose group committed more than the table records (a record that a
    /// crash or a lost leader cut off). Runs until the node stops it.
    pub async fn record_sizes(self: Arc<Self>) {
        loop {
            tokio::time::sleep(RECHECK).await;
            let table = self.cluster.state_machine().current().control.volumes;
            for (name, view) in self.hosted.views().await {
                let behind = table
                    .get(&name)
                    .filter(|entry| entry.group == view.group)
                    .is_some_and(|entry| view.size.is_some_and(|size| size > entry.size));
                let Some(size) = view.size.filter(|_| view.writing && behind) else {
                    continue;
                };
                match self.record(&name, view.group, size).await {
                    Ok(_) => tracing::info!(volume = %name, size, "the table records the size"),
                    Err(err) => tracing::info!(volume = %name, %err, "cannot record the size yet"),
                }
            }
        }
    }
}
