//! The replicas of the volume, by node id: the one list that the engine,
//! the fencer, the resync and status all read, and that membership change
//! edits at run time.
//!
//! A [`ReplicaSet`] hands out snapshots: a request fans out to the members
//! as they were when it started, and a member added or removed meanwhile
//! affects only later requests. Membership change goes through the engine
//! (`Engine::add_replica`, `Engine::remove_replica`), which commits an
//! in-sync replica's removal before it leaves the set and refuses a new
//! copy under the id of one still in sync or being rebuilt; nothing in the
//! node drives it yet (Raft membership change is not built). It also owns the one [`Liveness`] record of
//! when each replica last answered, so a replica that falls silent to the
//! engine is silent to the fencer too, and every call to a member is
//! bounded the same way ([`ReplicaSet::bounded`], [`ReplicaSet::fan_out`]),
//! and the channel pool ([`crate::replica::peer::channels`]) its remote members dial
//! through.
//!
//! Invariants:
//! - ids are unique, and this node's own replica is always a member (it
//!   cannot be removed);
//! - the set says who *can* be written, never who *holds* every
//!   acknowledged write: that is the committed in-sync set (S5). Removing a
//!   replica that is still in the in-sync set does not let a write be
//!   acknowledged without it; the engine counts it as failed until its
//!   removal from the in-sync set is committed (see [`crate::replica::mirror::quorum`]),
//!   and the fencer counts it among the replicas an old writer may reach.
//!   A replica's id is its node's [`NodeId`]: a new copy under an old id
//!   is told apart only by the engine's checks above.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::future::join_all;

use crate::ids::NodeId;

use crate::replica::mirror::liveness::Liveness;
use crate::replica::peer::channels::Channels;
use crate::replica::{Replica, ReplicaError};

/// See the module docs.
pub struct ReplicaSet {
    local: NodeId,
    /// This node's replica first, then the others in the order added.
    members: RwLock<Arc<Vec<Arc<dyn Replica>>>>,
    liveness: Liveness,
    /// The channels the remote members dial through, when the set was
    /// given them (see [`crate::replica::peer::channels`]).
    channels: Option<Arc<Channels>>,
}

/// Why a member could not be added or removed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SetError {
    /// Another member already has this id.
    #[error("replica {0} is a member already")]
    Duplicate(NodeId),
    /// No member has this id.
    #[error("replica {0} is not a member")]
    Unknown(NodeId),
    /// This node's own replica is always a member.
    #[error("replica {0} is this node's own and cannot be removed")]
    Local(NodeId),
    /// The list given to [`ReplicaSet::new`] lacks this node's replica.
    #[error("the local replica {0} is not among the replicas")]
    NoLocal(NodeId),
}

impl ReplicaSet {
    /// A set of `replicas`, among them this node's own, `local`.
    pub fn new(local: NodeId, replicas: Vec<Arc<dyn Replica>>) -> Result<Self, SetError> {
        let mut ordered: Vec<Arc<dyn Replica>> = Vec::with_capacity(replicas.len());
        for replica in replicas {
            if ordered.iter().any(|r| r.id() == replica.id()) {
                return Err(SetError::Duplicate(replica.id()));
            }
            ordered.push(replica);
        }
        let at = ordered
            .iter()
            .position(|r| r.id() == local)
            .ok_or(SetError::NoLocal(local))?;
        let own = ordered.remove(at);
        ordered.insert(0, own);
        Ok(Self {
            local,
            members: RwLock::new(Arc::new(ordered)),
            liveness: Liveness::default(),
            channels: None,
        })
    }

    /// The same set, owning the channel pool its remote members dial
    /// through; a member added later is reached through it too.
    pub fn with_channels(mut self, channels: Arc<Channels>) -> Self {
        self.channels = Some(channels);
        self
    }

    /// The channel pool, if the set has one.
    pub fn channels(&self) -> Option<&Arc<Channels>> {
        self.channels.as_ref()
    }

    /// The incarnation of member `id`'s data dir that the membership
    /// names (S8); incarnation 0 for a set without a membership book.
    pub fn incarnation(&self, id: NodeId) -> crate::ids::Incarnation {
        self.channels
            .as_ref()
            .map_or(crate::ids::Incarnation(0), |c| c.incarnation(id))
    }

    /// This node's id.
    pub fn local_id(&self) -> NodeId {
        self.local
    }

    /// The members now, this node's first.
    pub fn members(&self) -> Arc<Vec<Arc<dyn Replica>>> {
        Arc::clone(&self.members.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// This node's own replica.
    pub fn local(&self) -> Arc<dyn Replica> {
        // The first member is this node's, and it cannot be removed.
        Arc::clone(&self.members()[0])
    }

    /// The member with this id.
    pub fn get(&self, id: NodeId) -> Option<Arc<dyn Replica>> {
        self.members().iter().find(|r| r.id() == id).cloned()
    }

    /// The members' ids.
    pub fn ids(&self) -> BTreeSet<NodeId> {
        self.members().iter().map(|r| r.id()).collect()
    }

    /// How many members there are.
    pub fn len(&self) -> usize {
        self.members().len()
    }

    /// Whether the set is empty (never: this node's replica is a member).
    pub fn is_empty(&self) -> bool {
        self.members().is_empty()
    }

    /// Adds `replica`. It takes part in requests that start from now on; it
    /// joins the in-sync set only through a rebuild.
    pub fn add(&self, replica: Arc<dyn Replica>) -> Result<(), SetError> {
        self.edit(|members| {
            if members.iter().any(|r| r.id() == replica.id()) {
                return Err(SetError::Duplicate(replica.id()));
            }
            members.push(replica);
            Ok(())
        })
    }

    /// Removes the member `id` and returns it. Requests already started
    /// still go to it.
    pub fn remove(&self, id: NodeId) -> Result<Arc<dyn Replica>, SetError> {
        if id == self.local {
            return Err(SetError::Local(id));
        }
        self.edit(|members| {
            let at = members
                .iter()
                .position(|r| r.id() == id)
                .ok_or(SetError::Unknown(id))?;
            Ok(members.remove(at))
        })
        .inspect(|_| self.liveness.forget(id))
    }

    fn edit<T>(
        &self,
        change: impl FnOnce(&mut Vec<Arc<dyn Replica>>) -> Result<T, SetError>,
    ) -> Result<T, SetError> {
        let mut members = self.members.write().unwrap_or_else(|p| p.into_inner());
        let mut next = Vec::clone(&members);
        let out = change(&mut next)?;
        *members = Arc::new(next);
        Ok(out)
    }

    /// `call` to member `id`, given up on once the replica falls silent for
    /// `timeout` (see [`crate::replica::mirror::liveness`]).
    pub async fn bounded<T>(
        &self,
        id: NodeId,
        timeout: Duration,
        call: impl Future<Output = Result<T, ReplicaError>>,
    ) -> Result<T, ReplicaError> {
        self.liveness.bounded(id, timeout, call).await
    }

    /// `call` to each of `replicas` at once, each bounded as
    /// [`ReplicaSet::bounded`] is; the outcomes in the same order, by id.
    pub async fn fan_out<'a, T, F, Fut>(
        &self,
        replicas: impl IntoIterator<Item = &'a Arc<dyn Replica>>,
        timeout: Duration,
        call: F,
    ) -> Vec<(NodeId, Result<T, ReplicaError>)>
    where
        F: Fn(&'a Arc<dyn Replica>) -> Fut,
        Fut: Future<Output = Result<T, ReplicaError>>,
    {
        join_all(replicas.into_iter().map(|replica| {
            let call = call(replica);
            async move {
                let outcome = self.bounded(replica.id(), timeout, call).await;
                (replica.id(), outcome)
            }
        }))
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replica::disk::local::LocalReplica;
    use crate::replica::disk::store::{ReplicaStore, StoreIdentity};

    async fn replica(dir: &std::path::Path, id: NodeId) -> Arc<dyn Replica> {
        let store = ReplicaStore::open(
            &dir.join(id.to_string()),
            StoreIdentity::new("set-test", "vol0", 1 << 20),
        )
        .await
        .unwrap();
        Arc::new(LocalReplica::new(id, Arc::new(store)))
    }

    #[tokio::test]
    async fn the_local_replica_comes_first_and_stays() {
        let dir = tempfile::tempdir().unwrap();
        let list = vec![
            replica(dir.path(), NodeId(1)).await,
            replica(dir.path(), NodeId(2)).await,
        ];
        let set = ReplicaSet::new(NodeId(2), list).unwrap();
        assert_eq!(set.members()[0].id(), NodeId(2));
        assert_eq!(
            set.remove(NodeId(2)).err(),
            Some(SetError::Local(NodeId(2)))
        );
        assert_eq!(set.len(), 2);
    }

    #[tokio::test]
    async fn ids_are_unique_and_the_local_one_is_required() {
        let dir = tempfile::tempdir().unwrap();
        let a = replica(dir.path(), NodeId(1)).await;
        assert_eq!(
            ReplicaSet::new(NodeId(1), vec![Arc::clone(&a), Arc::clone(&a)]).err(),
            Some(SetError::Duplicate(NodeId(1)))
        );
        assert_eq!(
            ReplicaSet::new(NodeId(26), vec![Arc::clone(&a)]).err(),
            Some(SetError::NoLocal(NodeId(26)))
        );
        let set = ReplicaSet::new(NodeId(1), vec![Arc::clone(&a)]).unwrap();
        assert_eq!(set.add(a).err(), Some(SetError::Duplicate(NodeId(1))));
        assert_eq!(
            set.remove(NodeId(17)).err(),
            Some(SetError::Unknown(NodeId(17)))
        );
    }

    #[tokio::test]
    async fn a_snapshot_taken_before_a_change_keeps_its_members() {
        let dir = tempfile::tempdir().unwrap();
        let set = ReplicaSet::new(NodeId(1), vec![replica(dir.path(), NodeId(1)).await]).unwrap();
        let before = set.members();
        set.add(replica(dir.path(), NodeId(2)).await).unwrap();
        assert_eq!(before.len(), 1);
        assert_eq!(set.ids(), [NodeId(1), NodeId(2)].into());
        let removed = set.remove(NodeId(2)).unwrap();
        assert_eq!(removed.id(), NodeId(2));
        assert_eq!(set.ids(), [NodeId(1)].into());
    }
}
