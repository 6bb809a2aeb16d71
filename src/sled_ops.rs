//! How this crate uses sled safely: multi-key updates without batches, and
//! flushes that are grouped rather than piled onto sled's thread pool.
//!
//! **Flushes.** `flush_async` runs on sled's small I/O pool, and each call
//! blocks a pool thread until the log buffers are written — which is work
//! queued on the same pool. Dozens of concurrent writers each flushing
//! (queue-depth-16 NBD writes to new extents, each with a durable dirty
//! mark) took every pool thread and hung the node. [`Flusher`] makes
//! concurrent flushes share one: a caller whose write completed before a
//! flush started is covered by it, and at most one flush per [`Flusher`]
//! runs at a time, on tokio's blocking pool.
//!
//! sled 0.34 applies a `Batch` (and a transaction) under a process-wide
//! write lock, while `flush` holds the read side of that lock as it waits
//! for the log flusher — which itself needs the read side. Once a batch is
//! waiting, the lock lets no new reader in, so a batch racing a flush
//! deadlocks the whole process (seen as a node that hung under an NBD
//! client at queue depth 16; `concurrent_first_writes_to_many_extents_finish`
//! in the replica store reproduces it). Single-key `insert` and `remove` take
//! only the read side, so every multi-key update here is a sequence of them,
//! made durable by the caller's flush.
//!
//! Without a batch, a crash may persist only part of the sequence. sled
//! recovers a prefix of its operations, so callers order the keys such that
//! every prefix is a consistent state (for example, a log is truncated from
//! its end backwards).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Group commit for one sled Db. Clones share the group.
#[derive(Clone)]
pub struct Flusher {
    db: sled::Db,
    state: Arc<FlushState>,
}

struct FlushState {
    /// Tickets handed out: one per `flush` call.
    requested: AtomicU64,
    /// The highest ticket a finished flush covers; held while flushing.
    covered: tokio::sync::Mutex<u64>,
}

impl Flusher {
    /// A flusher for `db`.
    pub fn new(db: &sled::Db) -> Self {
        Self {
            db: db.clone(),
            state: Arc::new(FlushState {
                requested: AtomicU64::new(0),
                covered: tokio::sync::Mutex::new(0),
            }),
        }
    }

    /// Makes every update that completed before this call durable.
    pub async fn flush(&self) -> sled::Result<()> {
        let ticket = self.state.requested.fetch_add(1, Ordering::SeqCst) + 1;
        let mut covered = self.state.covered.lock().await;
        if *covered >= ticket {
            return Ok(());
        }
        // Every ticket up to `target` was taken after its caller's update,
        // and before this flush starts, so the flush covers them all.
        let target = self.state.requested.load(Ordering::SeqCst);
        let db = self.db.clone();
        tokio::task::spawn_blocking(move || db.flush())
            .await
            .map_err(|err| sled::Error::ReportableBug(format!("flush task: {err}")))??;
        *covered = target;
        Ok(())
    }
}

/// Inserts every pair, in order.
pub fn insert_all<K, V>(
    tree: &sled::Tree,
    pairs: impl IntoIterator<Item = (K, V)>,
) -> sled::Result<()>
where
    K: AsRef<[u8]>,
    V: Into<sled::IVec>,
{
    for (key, value) in pairs {
        tree.insert(key, value)?;
    }
    Ok(())
}

/// Removes every key, in order.
pub fn remove_all<K: AsRef<[u8]>>(
    tree: &sled::Tree,
    keys: impl IntoIterator<Item = K>,
) -> sled::Result<()> {
    for key in keys {
        tree.remove(key)?;
    }
    Ok(())
}
