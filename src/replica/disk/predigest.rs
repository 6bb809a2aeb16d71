//! Digests of a replica's marked extents, computed ahead of a failover.
//!
//! A promotion compares the BLAKE3 digest of every extent an older writer
//! left marked (S6, see `fencer.rs`). After heavy writes that is a few
//! hundred extents, and hashing them on the failover's path costs tens of
//! milliseconds per replica. Yet the data does not change between the
//! moment the old writer falls silent and the moment the new one compares:
//! nothing writes to a replica while no writer holds a gate. So a replica
//! whose node has heard no leader for a while hashes its marked extents
//! then, during the failure detector's wait, and the comparison reads the
//! answers from here.
//!
//! Invariant: **a digest served from here equals the digest of the
//! extent's bytes at the moment it is served.** It holds because:
//! - every change to the data file is bracketed by a [`Touch`]: its start
//!   is counted before the bytes are written, its end after they are
//!   (`started` and `finished`, both only ever growing);
//! - a snapshot is taken only while `started == finished` (nothing in
//!   flight), records that count as its epoch, and is kept only if
//!   `started` still equals the epoch once every extent was hashed;
//! - a lookup uses the snapshot only while `started` equals its epoch: no
//!   change to the file has even begun since the snapshot was taken.
//!
//! Any write at all (client data, a rebuild copy, a convergence copy)
//! invalidates the whole snapshot, and so does the end of the promotion
//! (the new writer clearing the older terms' marks): the scrub must read
//! the disk, which can change without a write (bit rot). That is deliberately coarse: the
//! snapshot is for the quiet window between writers, not for steady use.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// A BLAKE3 digest of one extent.
pub type Digest = [u8; 32];

/// The counters every data write moves, and the last snapshot.
#[derive(Debug, Default)]
pub struct DigestCache {
    /// Changes to the data file begun.
    started: AtomicU64,
    /// Changes to the data file finished (or abandoned).
    finished: AtomicU64,
    snapshot: Mutex<Option<Snapshot>>,
}

#[derive(Debug)]
struct Snapshot {
    epoch: u64,
    digests: HashMap<u64, Digest>,
}

/// One change to the data file in progress; dropping it ends the change.
/// It must live until the bytes are written (move it into the I/O task).
#[must_use = "a touch ends when it is dropped"]
#[derive(Debug)]
pub struct Touch(Arc<DigestCache>);

impl Drop for Touch {
    fn drop(&mut self) {
        self.0.finished.fetch_add(1, Ordering::SeqCst);
    }
}

/// A quiet moment of the data file, from [`DigestCache::quiet`]: hash
/// the extents, then [`DigestCache::keep`] the result under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Epoch(u64);

impl DigestCache {
    /// Counts the start of a change to the data file; call it before the
    /// bytes are written and keep the returned guard until they are.
    pub fn touch(self: &Arc<Self>) -> Touch {
        self.started.fetch_add(1, Ordering::SeqCst);
        Touch(Arc::clone(self))
    }

    /// The current epoch if nothing is being written and the snapshot is
    /// not already of it; `None` when there is nothing to do.
    pub fn quiet(&self) -> Option<Epoch> {
        let finished = self.finished.load(Ordering::SeqCst);
        let started = self.started.load(Ordering::SeqCst);
        if started != finished {
            return None;
        }
        let current = self.lock().as_ref().map(|s| s.epoch);
        (current != Some(started)).then_some(Epoch(started))
    }

    /// Keeps `digests`, hashed after `epoch` was taken, if nothing has
    /// started writing since; returns whether they were kept.
    pub fn keep(&self, epoch: Epoch, digests: HashMap<u64, Digest>) -> bool {
        let mut snapshot = self.lock();
        if self.started.load(Ordering::SeqCst) != epoch.0 {
            return false;
        }
        *snapshot = Some(Snapshot {
            epoch: epoch.0,
            digests,
        });
        true
    }

    /// The digests of `first..=last` if the snapshot holds every one of
    /// them and nothing has started writing since it was taken.
    pub fn lookup(&self, first: u64, last: u64) -> Option<Vec<Digest>> {
        let snapshot = self.lock();
        let snapshot = snapshot.as_ref()?;
        if self.started.load(Ordering::SeqCst) != snapshot.epoch {
            return None;
        }
        (first..=last)
            .map(|extent| snapshot.digests.get(&extent).copied())
            .collect()
    }

    /// Drops the snapshot: the promotion it was taken for is over. From
    /// then on every digest is read from the disk, so a change to the file
    /// behind the store's back (bit rot) is seen by the next comparison.
    pub fn forget(&self) {
        *self.lock() = None;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Snapshot>> {
        self.snapshot
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digests(extents: &[u64]) -> HashMap<u64, Digest> {
        extents.iter().map(|e| (*e, [*e as u8; 32])).collect()
    }

    #[test]
    fn a_snapshot_serves_until_the_next_write_begins() {
        let cache = Arc::new(DigestCache::default());
        let epoch = cache.quiet().expect("quiet");
        assert!(cache.keep(epoch, digests(&[1, 2])));
        assert_eq!(cache.lookup(1, 2), Some(vec![[1; 32], [2; 32]]));
        assert_eq!(cache.lookup(1, 3), None, "extent 3 was not hashed");
        assert_eq!(cache.quiet(), None, "already current");
        let touch = cache.touch();
        assert_eq!(cache.lookup(1, 1), None, "a write has begun");
        drop(touch);
        assert_eq!(cache.lookup(1, 1), None, "and it changed the file");
    }

    #[test]
    fn no_snapshot_is_taken_while_a_write_is_in_flight() {
        let cache = Arc::new(DigestCache::default());
        let touch = cache.touch();
        assert_eq!(cache.quiet(), None);
        drop(touch);
        assert!(cache.quiet().is_some());
    }

    #[test]
    fn a_write_that_begins_while_hashing_spoils_the_snapshot() {
        let cache = Arc::new(DigestCache::default());
        let epoch = cache.quiet().expect("quiet");
        // The write begins and ends while the extents are being hashed.
        drop(cache.touch());
        assert!(!cache.keep(epoch, digests(&[1])));
        assert_eq!(cache.lookup(1, 1), None);
    }
}
