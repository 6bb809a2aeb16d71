//! A replica in this process: this node's store behind the [`Replica`]
//! seam without a network hop, for the writer's own copy. Every call goes
//! through the store's admission, as the servers' do (S2, S3).

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;

use super::store::ReplicaStore;
use crate::ids::{Incarnation, NodeId, Term};
use crate::replica::{
    FenceReply, MissedMap, Replica, ReplicaError, ReplicaInfo, Stamp, Unverified,
};

/// A replica in this process: the store without a network hop.
pub struct LocalReplica {
    id: NodeId,
    store: Arc<ReplicaStore>,
}

impl LocalReplica {
    /// Wraps `store`, held by node `id`.
    pub fn new(id: NodeId, store: Arc<ReplicaStore>) -> Self {
        Self { id, store }
    }

    /// The store behind this replica.
    pub fn store(&self) -> &Arc<ReplicaStore> {
        &self.store
    }
}

#[async_trait]
impl Replica for LocalReplica {
    fn id(&self) -> NodeId {
        self.id
    }
    async fn allocation(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<Vec<crate::volume::Extent>, ReplicaError> {
        self.store.allocation(offset, len).await
    }
    async fn write(
        &self,
        stamp: Stamp,
        offset: u64,
        data: Bytes,
        fua: bool,
    ) -> Result<(), ReplicaError> {
        self.store.write(stamp, offset, data, fua).await
    }
    async fn discard(&self, stamp: Stamp, offset: u64, len: u64) -> Result<(), ReplicaError> {
        self.store.discard(stamp, offset, len).await
    }
    async fn mark_ahead(&self, stamp: Stamp, offset: u64, len: u64) -> Result<(), ReplicaError> {
        self.store.mark_ahead(stamp, offset, len).await
    }
    async fn read(&self, offset: u64, len: u64) -> Result<Bytes, ReplicaError> {
        self.store.read(offset, len).await
    }
    async fn flush(&self, stamp: Stamp) -> Result<(), ReplicaError> {
        self.store.flush(stamp).await
    }
    async fn grow(&self, stamp: Stamp, size: u64) -> Result<u64, ReplicaError> {
        self.store.grow(stamp, size).await
    }
    async fn fence(&self, term: Term) -> Result<FenceReply, ReplicaError> {
        self.store.fence(term).await
    }
    async fn clear_dirty_below(&self, term: Term) -> Result<(), ReplicaError> {
        self.store.clear_dirty_below(term).await
    }
    async fn retire_marks(
        &self,
        stamp: Stamp,
        through: Term,
        extents: &[u64],
    ) -> Result<usize, ReplicaError> {
        self.store.retire_marks(stamp, through, extents).await
    }
    async fn info(&self) -> Result<ReplicaInfo, ReplicaError> {
        self.store.info().await
    }
    async fn digests(&self, offset: u64, len: u64) -> Result<(u64, Vec<Bytes>), ReplicaError> {
        let (first, digests) = self.store.digests(offset, len).await?;
        Ok((
            first,
            digests
                .iter()
                .map(|d| Bytes::copy_from_slice(d.as_ref()))
                .collect(),
        ))
    }
    async fn note_missed(
        &self,
        stamp: Stamp,
        node: NodeId,
        incarnation: Incarnation,
        extents: &[u64],
    ) -> Result<(), ReplicaError> {
        self.store
            .note_missed(stamp, node, incarnation, extents)
            .await
    }
    async fn missed(&self, node: NodeId, from: u64) -> Result<Option<MissedMap>, ReplicaError> {
        self.store.missed(node, from)
    }
    async fn missed_maps(&self) -> Result<BTreeMap<NodeId, Incarnation>, ReplicaError> {
        Ok(self.store.missed_open())
    }
    async fn close_missed(&self, stamp: Stamp, node: NodeId) -> Result<(), ReplicaError> {
        self.store.close_missed(stamp, node).await
    }
    async fn set_unverified(
        &self,
        stamp: Stamp,
        node: NodeId,
        incarnation: Incarnation,
        change: Unverified,
    ) -> Result<(), ReplicaError> {
        self.store
            .set_unverified(stamp, node, incarnation, change)
            .await
    }
}
