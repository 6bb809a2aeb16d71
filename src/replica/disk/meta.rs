//! The replica store's metadata database, and its recovery after an I/O
//! failure such as a full disk.
//!
//! sled remembers the first I/O error its log writer hits (ENOSPC, EIO) and
//! fails every later operation with it, for as long as the database stays
//! open — even once the disk has room again. A replica whose disk filled up
//! once would therefore refuse every write, fence and rebuild until its
//! node restarted: the fault campaign's `disk-full-follower` left such a
//! replica out of the in-sync set for good.
//!
//! [`MetaSlot`] holds the open database. When an operation fails with an
//! I/O error, [`MetaSlot::failed`] takes the database out of the slot (so
//! the store's own handle is dropped), and a thread opens it again, every
//! [`REOPEN_EVERY`], until that succeeds; meanwhile every metadata
//! operation fails with a clear "reopening" error. sled recovers its log on
//! open to the last durable state.
//!
//! Invariants kept (they are why nothing has to be reloaded after a
//! reopen): the store raises its in-memory fence floor, and adds a mark to
//! its cache of durable marks, only *after* a flush succeeded, so the
//! reopened database holds at least what memory claims is durable. What it
//! may hold more of — a mark inserted but not flushed, a mark whose
//! unflushed removal was lost — is at worst a mark too many, which a
//! later retirement or convergence handles.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock, Weak};
use std::time::Duration;

use crate::replica::ReplicaError;
use crate::sled_ops::Flusher;

/// How often a failed database is tried again.
pub const REOPEN_EVERY: Duration = Duration::from_millis(250);

/// Handles on the open database.
#[derive(Clone)]
pub struct Meta {
    /// Cluster, volume, size and extent size.
    pub identity: sled::Tree,
    /// The fence floor and the audit counter.
    pub fence: sled::Tree,
    /// The dirty marks.
    pub dirty: sled::Tree,
    /// The missed-write maps (see [`crate::replica::disk::missed`]).
    pub missed: sled::Tree,
    /// Group flushes of the whole database.
    pub flusher: Flusher,
}

impl Meta {
    /// Opens the trees of `db`.
    pub fn of(db: &sled::Db) -> sled::Result<Self> {
        Ok(Self {
            identity: db.open_tree("identity")?,
            fence: db.open_tree("fence")?,
            dirty: db.open_tree("dirty")?,
            missed: db.open_tree("missed")?,
            flusher: Flusher::new(db),
        })
    }
}

/// The open database, or none while it is being reopened. See the module
/// docs.
pub struct MetaSlot {
    path: PathBuf,
    current: RwLock<Option<Meta>>,
    reopening: AtomicBool,
}

impl MetaSlot {
    /// A slot holding `meta`, opened from `path`.
    pub fn new(path: PathBuf, meta: Meta) -> Arc<Self> {
        Arc::new(Self {
            path,
            current: RwLock::new(Some(meta)),
            reopening: AtomicBool::new(false),
        })
    }

    /// The open database, or an error while it is being reopened.
    pub fn get(&self) -> Result<Meta, ReplicaError> {
        let current = self.current.read().unwrap_or_else(|p| p.into_inner());
        current.clone().ok_or_else(|| {
            ReplicaError::Io(format!(
                "metadata at {} failed and is being reopened",
                self.path.display()
            ))
        })
    }

    /// Turns a metadata error into the store's error; an I/O error also
    /// starts a reopen (once).
    pub fn failed(self: &Arc<Self>, err: sled::Error) -> ReplicaError {
        if matches!(err, sled::Error::Io(_)) && !self.reopening.swap(true, Ordering::SeqCst) {
            tracing::warn!(path = %self.path.display(), %err, "metadata failed; reopening it");
            let taken = self
                .current
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            drop(taken);
            let slot = Arc::downgrade(self);
            let spawned = std::thread::Builder::new()
                .name("replica-meta-reopen".into())
                .spawn(move || reopen(slot));
            if let Err(spawn) = spawned {
                tracing::error!(%spawn, "could not start reopening the metadata");
            }
        }
        ReplicaError::from(err)
    }
}

/// Opens the database again until that works, or the store is gone.
fn reopen(slot: Weak<MetaSlot>) {
    loop {
        std::thread::sleep(REOPEN_EVERY);
        let Some(slot) = slot.upgrade() else {
            return;
        };
        // Fails while a handle of the failed instance is still alive (an
        // operation that was running), or while the disk is still full.
        let opened = sled::Config::new()
            .path(&slot.path)
            .open()
            .and_then(|db| Meta::of(&db));
        match opened {
            Ok(meta) => {
                *slot.current.write().unwrap_or_else(|p| p.into_inner()) = Some(meta);
                slot.reopening.store(false, Ordering::SeqCst);
                tracing::info!(path = %slot.path.display(), "metadata reopened");
                return;
            }
            Err(err) => {
                tracing::debug!(path = %slot.path.display(), %err, "metadata not reopened yet");
            }
        }
    }
}
