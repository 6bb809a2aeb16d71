//! A replica that forgets what was never made durable, the way LazyFS
//! drops a file's unsynced writes: every write that completed without FUA
//! and was not covered by a later flush is undone by [`PowerCutReplica::power_cut`].
//!
//! The durable image is kept in memory beside the real store. A write with
//! FUA becomes durable at once; a flush makes durable every write that had
//! completed when the flush began. A power cut writes the durable image
//! back over each range written since, so the store then holds exactly what
//! a machine would find on its disk after losing power.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;
use replica_ha::ids::{NodeId, Term};
use replica_ha::replica::disk::local::LocalReplica;
use replica_ha::replica::disk::store::ReplicaStore;
use replica_ha::replica::{FenceReply, Replica, ReplicaError, ReplicaInfo, Stamp};

/// See the module docs.
pub struct PowerCutReplica {
    inner: LocalReplica,
    state: Mutex<Durability>,
    /// Set by [`PowerCutReplica::restart`]: block requests fail as a
    /// restarted remote replica's do, until a rebuild accepts it.
    restarted: std::sync::atomic::AtomicBool,
}

struct Durability {
    /// What the disk would hold after a power cut.
    image: Vec<u8>,
    /// Writes that completed but are not durable yet, oldest first.
    pending: Vec<(u64, Bytes)>,
    /// Flushes that reached the store, and writes that became durable
    /// through one.
    flushes: u64,
}

impl PowerCutReplica {
    /// Wraps `store`, whose current content counts as durable.
    pub async fn new(id: NodeId, store: Arc<ReplicaStore>) -> Arc<Self> {
        let size = store.size();
        let mut image = Vec::with_capacity(size as usize);
        let chunk = 4 << 20;
        let mut offset = 0;
        while offset < size {
            let len = chunk.min(size - offset);
            image.extend_from_slice(&store.read(offset, len).await.expect("read the store"));
            offset += len;
        }
        Arc::new(Self {
            restarted: Default::default(),
            inner: LocalReplica::new(id, store),
            state: Mutex::new(Durability {
                image,
                pending: Vec::new(),
                flushes: 0,
            }),
        })
    }

    pub fn store(&self) -> &Arc<ReplicaStore> {
        self.inner.store()
    }

    /// How many flushes reached the store.
    pub fn flushes(&self) -> u64 {
        self.state.lock().unwrap().flushes
    }

    /// Bytes written but not yet durable.
    pub fn unflushed_bytes(&self) -> u64 {
        let state = self.state.lock().unwrap();
        state.pending.iter().map(|(_, d)| d.len() as u64).sum()
    }

    /// Loses every write that was not durable, as a power cut would.
    pub async fn power_cut(&self) {
        let (restore, image) = {
            let mut state = self.state.lock().unwrap();
            let ranges: Vec<(u64, u64)> = state
                .pending
                .drain(..)
                .map(|(offset, data)| (offset, data.len() as u64))
                .collect();
            (ranges, state.image.clone())
        };
        let store = self.inner.store();
        // At the store's own floor, so the restore is neither refused as
        // stale nor raises the floor.
        let info = store.info().await.expect("the store's floor");
        let stamp = Stamp {
            term: info.floor.max(Term(1)),
            generation: info.generation,
        };
        for (offset, len) in restore {
            let old = Bytes::copy_from_slice(&image[offset as usize..(offset + len) as usize]);
            store
                .write(stamp, offset, old, true)
                .await
                .expect("restore the durable image");
        }
    }
}

impl PowerCutReplica {
    /// The replica's process starts again after [`PowerCutReplica::power_cut`]:
    /// its store has a new session, which the writer's side notices on the
    /// block channel and in digest replies, so every block and digest
    /// request fails as [`ReplicaError::Restarted`] until
    /// [`Replica::accept_restart`].
    pub fn restart(&self) {
        self.restarted
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    fn check_session(&self) -> Result<(), ReplicaError> {
        if self.restarted.load(std::sync::atomic::Ordering::SeqCst) {
            Err(ReplicaError::Restarted("the store was opened again".into()))
        } else {
            Ok(())
        }
    }
}

fn apply(image: &mut [u8], offset: u64, data: &[u8]) {
    image[offset as usize..offset as usize + data.len()].copy_from_slice(data);
}

#[async_trait]
impl Replica for PowerCutReplica {
    fn id(&self) -> NodeId {
        self.inner.id()
    }
    fn accept_restart(&self) {
        self.restarted
            .store(false, std::sync::atomic::Ordering::SeqCst);
    }
    async fn write(
        &self,
        stamp: Stamp,
        offset: u64,
        data: Bytes,
        fua: bool,
    ) -> Result<(), ReplicaError> {
        self.check_session()?;
        self.inner.write(stamp, offset, data.clone(), fua).await?;
        let mut state = self.state.lock().unwrap();
        if fua {
            apply(&mut state.image, offset, &data);
        } else {
            state.pending.push((offset, data));
        }
        Ok(())
    }
    async fn discard(&self, stamp: Stamp, offset: u64, len: u64) -> Result<(), ReplicaError> {
        // Like a write of zeroes that is not forced to the disk.
        self.check_session()?;
        self.inner.discard(stamp, offset, len).await?;
        let zeroes = Bytes::from(vec![0u8; len as usize]);
        self.state.lock().unwrap().pending.push((offset, zeroes));
        Ok(())
    }
    async fn mark_ahead(&self, stamp: Stamp, offset: u64, len: u64) -> Result<(), ReplicaError> {
        // Marks go to the metadata Db, which a power cut keeps (flushed).
        self.check_session()?;
        self.inner.mark_ahead(stamp, offset, len).await
    }
    async fn read(&self, offset: u64, len: u64) -> Result<Bytes, ReplicaError> {
        self.check_session()?;
        self.inner.read(offset, len).await
    }
    async fn flush(&self, stamp: Stamp) -> Result<(), ReplicaError> {
        self.check_session()?;
        let covered = self.state.lock().unwrap().pending.len();
        self.inner.flush(stamp).await?;
        let mut state = self.state.lock().unwrap();
        let durable: Vec<(u64, Bytes)> = state.pending.drain(..covered).collect();
        for (offset, data) in durable {
            apply(&mut state.image, offset, &data);
        }
        state.flushes += 1;
        Ok(())
    }
    async fn grow(&self, stamp: Stamp, size: u64) -> Result<u64, ReplicaError> {
        // Growing is durable at once (the store syncs it); the new range
        // reads as zeroes.
        let size = self.inner.grow(stamp, size).await?;
        let mut state = self.state.lock().unwrap();
        let len = state.image.len().max(size as usize);
        state.image.resize(len, 0);
        Ok(size)
    }
    async fn fence(&self, term: Term) -> Result<FenceReply, ReplicaError> {
        self.inner.fence(term).await
    }
    async fn clear_dirty_below(&self, term: Term) -> Result<(), ReplicaError> {
        self.inner.clear_dirty_below(term).await
    }
    async fn retire_marks(
        &self,
        stamp: Stamp,
        through: Term,
        extents: &[u64],
    ) -> Result<usize, ReplicaError> {
        self.inner.retire_marks(stamp, through, extents).await
    }
    async fn info(&self) -> Result<ReplicaInfo, ReplicaError> {
        self.inner.info().await
    }
    async fn digests(&self, offset: u64, len: u64) -> Result<(u64, Vec<Bytes>), ReplicaError> {
        // Digests name the store's session too (`RemoteReplica::digests`).
        self.check_session()?;
        self.inner.digests(offset, len).await
    }
    async fn note_missed(
        &self,
        stamp: Stamp,
        node: NodeId,
        incarnation: replica_ha::ids::Incarnation,
        extents: &[u64],
    ) -> Result<(), ReplicaError> {
        self.inner
            .note_missed(stamp, node, incarnation, extents)
            .await
    }
    async fn missed(
        &self,
        node: NodeId,
        from: u64,
    ) -> Result<Option<replica_ha::replica::disk::missed::MissedMap>, ReplicaError> {
        self.inner.missed(node, from).await
    }
    async fn missed_maps(
        &self,
    ) -> Result<std::collections::BTreeMap<NodeId, replica_ha::ids::Incarnation>, ReplicaError>
    {
        self.inner.missed_maps().await
    }
    async fn close_missed(&self, stamp: Stamp, node: NodeId) -> Result<(), ReplicaError> {
        self.inner.close_missed(stamp, node).await
    }
    async fn set_unverified(
        &self,
        stamp: Stamp,
        node: NodeId,
        incarnation: replica_ha::ids::Incarnation,
        change: replica_ha::replica::disk::missed::Unverified,
    ) -> Result<(), ReplicaError> {
        self.inner
            .set_unverified(stamp, node, incarnation, change)
            .await
    }
}
