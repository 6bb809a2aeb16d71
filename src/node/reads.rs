//! This node's own replica as the read gate ([`crate::ha::ReadGate`]) sees
//! it: its membership in the committed in-sync set, read from the Raft
//! state machine as this node has applied it, and reads of the local store
//! without a network hop. The rule itself (a passive node reads its copy
//! only while that copy is in the committed in-sync set) lives in the read
//! gate; this is only the wiring to Raft and the store.
//!
//! The in-sync set names nodes, not incarnations, so the copy also counts
//! only while the applied membership names this node *in this incarnation*
//! (S8): a new incarnation replaying the log from its start passes through
//! states in which its node id is in sync, when that meant its former,
//! lost copy.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::sync::watch;

use crate::ha::LocalCopy;
use crate::raft::state_machine::Applied;
use crate::raft::{MemberId, NodeId};
use crate::replica::{Replica, ReplicaError};
use crate::volume::DeviceError;

/// See the module docs.
pub struct RaftLocalCopy {
    id: NodeId,
    member: MemberId,
    replica: Arc<dyn Replica>,
    applied: watch::Receiver<Applied>,
}

impl RaftLocalCopy {
    /// The replica `replica` of `member`, in sync while `applied` says so.
    pub fn new(
        member: MemberId,
        replica: Arc<dyn Replica>,
        applied: watch::Receiver<Applied>,
    ) -> Self {
        Self {
            id: member.node(),
            member,
            replica,
            applied,
        }
    }
}

#[async_trait]
impl LocalCopy for RaftLocalCopy {
    fn in_sync(&self) -> bool {
        let applied = self.applied.borrow();
        let named = applied
            .membership
            .membership()
            .nodes()
            .any(|(member, _)| *member == self.member);
        named && applied.control.in_sync.contains(&self.id)
    }

    async fn read(&self, offset: u64, len: u64) -> Result<Bytes, DeviceError> {
        self.replica.read(offset, len).await.map_err(device_error)
    }

    async fn allocation(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<Vec<crate::volume::Extent>, DeviceError> {
        self.replica
            .allocation(offset, len)
            .await
            .map_err(device_error)
    }
}

fn device_error(err: ReplicaError) -> DeviceError {
    match err {
        ReplicaError::Range(range) => DeviceError::Range(range),
        other => DeviceError::Io(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Incarnation;
    use crate::raft::MemberNode;
    use openraft::{Membership, StoredMembership};

    /// A new incarnation replaying the log passes through states in which
    /// its node id is in sync: its copy must not count then (S8, S10).
    #[tokio::test]
    async fn the_copy_counts_only_for_the_incarnation_the_membership_names() {
        let old = MemberId::new(NodeId(3), Incarnation(7));
        let new = MemberId::new(NodeId(3), Incarnation(9));
        let applied_with = |member: MemberId| {
            let membership = StoredMembership::new(
                None,
                Membership::new(
                    vec![[MemberId(1), member].into()],
                    [
                        (MemberId(1), MemberNode::default()),
                        (member, MemberNode::default()),
                    ]
                    .into_iter()
                    .collect::<std::collections::BTreeMap<_, _>>(),
                ),
            );
            let mut applied = Applied {
                membership,
                ..Applied::default()
            };
            applied.control.in_sync = [NodeId(1), NodeId(3)].into();
            applied
        };
        let dir = tempfile::tempdir().unwrap();
        let spec = crate::volume::VolumeSpec::new("c", "v", 1 << 20, 2);
        let opened = crate::replica::disk::store::ReplicaStore::open(dir.path(), (&spec).into())
            .await
            .unwrap();
        let store: Arc<dyn Replica> = Arc::new(crate::replica::disk::local::LocalReplica::new(
            NodeId(3),
            Arc::new(opened),
        ));
        let (_tx, rx) = watch::channel(applied_with(old));
        assert!(!RaftLocalCopy::new(new, Arc::clone(&store), rx).in_sync());
        let (_tx, rx) = watch::channel(applied_with(new));
        assert!(RaftLocalCopy::new(new, store, rx).in_sync());
    }
}
