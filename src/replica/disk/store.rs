//! One node's copy of the volume on disk.
//!
//! A store is a data file (`volume.img`, created sparse at the volume size)
//! and one `sled::Db` (`meta/`) with three trees: `identity` (cluster id,
//! volume, size, extent size), `fence` (the fence floor) and `dirty` (the
//! extents each term touched).
//!
//! **Admission above, data below.** This file decides whether and when a
//! request may touch the copy; it never does the data I/O itself. Every
//! read, write, punch, sync and growth of the data file goes through
//! `DataFile` (`disk/data.rs`), and only after the request was admitted
//! and its marks were made durable. What the data layer promises in return
//! (durable on `sync`, holes read as zeroes, any byte range in) is written
//! there; a layer that keeps those promises, a snapshot layer say, can take
//! its place without a line of admission changing. The I/O runs on the
//! blocking pool, or on the calling thread when it is small enough for the
//! page cache to serve at once.
//!
//! Invariants this file upholds:
//! - **S2, token on every write.** `write` and `flush` carry the writer's
//!   term. A term below the fence floor is refused with
//!   [`ReplicaError::StaleTerm`]; a newer term first raises the floor
//!   durably, then is applied. The floor is a [`Stamp`]: within the floor's
//!   term, a request of an older *generation* is refused too
//!   ([`ReplicaError::StaleGeneration`]) and a newer one raises the floor
//!   the same way. That is how a writer disowns a request whose outcome it
//!   lost, so it can never land after a later write (no late landing).
//! - **S3, fence drains.** The floor sits behind a read/write lock. Every
//!   write and flush holds a read guard until its I/O has finished — the
//!   guard is *owned* and moves into the blocking I/O closure, so a cancelled
//!   request cannot release it while its `pwrite` is still running. `fence`
//!   and a floor raise take the write guard, so they return only after every
//!   in-flight request has finished or been refused, and none of an older
//!   term can start afterwards. The lock is write-preferring, so a stream of
//!   writes cannot starve a fence.
//! - **S6, dirty extents.** The first write of a term into an extent records
//!   `(term, extent)` durably *before* the data is written, so a promotion
//!   can learn every extent an older writer may have touched without an
//!   acknowledgement. `clear_dirty_below(T)` drops marks once converged.
//! - **S7, durable metadata first.** Every floor raise and every new dirty
//!   mark is flushed to disk (`sled` flush) before the request proceeds.
//! - **Audit.** [`ReplicaStore::stale_accepts`] counts requests admitted
//!   with a term below the floor, durably (it survives a restart). It is 0
//!   by construction; only the
//!   deliberately broken test build (feature `unsafe-skip-term-check`, which
//!   refuses to compile in release) admits them, so the fault campaign's
//!   checker can show that it notices.
//! - **Identity.** Cluster id, volume and size are written on first open;
//!   opening with another cluster, volume or extent size fails with a clear
//!   error and touches nothing.
//! - **Growth.** The size only grows ([`ReplicaStore::grow`], stamped and
//!   admitted like a flush). The data file is extended and synced before
//!   the new size is recorded, and the new range is served only after
//!   both: a crash in between leaves a longer file whose tail is never
//!   served, and the next growth cuts the file to the served size before
//!   extending it, so the new range reads as zeroes. Opening never changes
//!   the size or the file: the recorded size stands whatever the config
//!   says (the config's size is for a new volume; a volume grows only
//!   through `replica-ha resize`).

use crate::ids::{Incarnation, NodeId};
use crate::replica::disk::data::{DataFile, RunOn, run_io};
use crate::replica::disk::identity::{check_identity, read_identity, write_identity};
use crate::replica::disk::meta::{Meta, MetaSlot};
use crate::replica::disk::missed::{self, MAX_MISSED_EXTENTS, MissedMap, MissedMaps, Unverified};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::{OwnedRwLockReadGuard, RwLock};

use crate::ids::Term;
use crate::replica::disk::predigest::{Digest, DigestCache};
use crate::replica::{DirtyExtent, FenceReply, ReplicaError, Stamp};
use crate::volume::check_request;

pub use crate::replica::disk::identity::StoreIdentity;
pub use crate::volume::DEFAULT_EXTENT_SIZE;

/// The most extents one digest request may cover (256 MiB at 1 MiB).
pub const MAX_DIGEST_EXTENTS: u64 = 256;

/// The most marked extents [`ReplicaStore::predigest`] hashes (1 GiB at
/// 1 MiB): a bound on the work a quiet replica does ahead of a failover.
pub const MAX_PREDIGEST_EXTENTS: usize = 1024;

/// The most extents one mark retirement may name.
pub const MAX_RETIRE_EXTENTS: u64 = 4096;

const META_DIR: &str = "meta";
const FLOOR_KEY: &[u8] = b"floor";
/// The audit counter's key in the `fence` tree (only the broken build
/// writes it).
const STALE_ACCEPTS_KEY: &[u8] = b"stale_accepts";

/// One copy of the volume, on disk. See the module docs for its invariants.
pub struct ReplicaStore {
    dir: PathBuf,
    identity: StoreIdentity,
    /// The served size: `identity.size` as last recorded (see Growth).
    size: AtomicU64,
    /// Serializes growths.
    growing: tokio::sync::Mutex<()>,
    /// The data file; every byte of the copy is read and written through
    /// it (see [`crate::replica::disk::data`]).
    data: Arc<DataFile>,
    /// The metadata database (see [`crate::replica::disk::meta`]).
    meta: Arc<MetaSlot>,
    /// The durable fence floor, mirrored in memory. Read guard: a request in
    /// flight. Write guard: a fence or a floor raise (drains the readers).
    floor: Arc<RwLock<Stamp>>,
    /// Dirty marks known to be durable, so only a term's first write into an
    /// extent pays for a metadata flush.
    marked: Mutex<Marked>,
    /// The missed-write maps of absent members, as far as they are durable
    /// (see [`crate::replica::disk::missed`]).
    missed: MissedMaps,
    /// Serializes opening and closing maps.
    missed_edit: tokio::sync::Mutex<()>,
    /// Requests admitted with a term below the floor (see the module docs).
    stale_accepts: AtomicU64,
    /// Extents a write marked itself since start (see [`ReplicaStore::info`]).
    first_touch_marks: AtomicU64,
    /// Every change to the data file is counted here, and the digests of
    /// the marked extents hashed ahead of a failover are kept here.
    predigests: Arc<DigestCache>,
    /// Drawn at random each time the store is opened (see
    /// [`ReplicaStore::session`]).
    session: u64,
    /// Tests slow the data I/O down to hold requests in flight.
    #[cfg(test)]
    io_delay: Mutex<std::time::Duration>,
}

impl std::fmt::Debug for ReplicaStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicaStore")
            .field("dir", &self.dir)
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl ReplicaStore {
    /// Opens the store in `dir`, creating it on first use.
    ///
    /// Fails with [`ReplicaError::IdentityMismatch`] when `dir` holds a store
    /// of another cluster, volume or extent size, or a data file shorter
    /// than its recorded size, and with
    /// [`ReplicaError::Io`] when the directory is in use by another process.
    pub async fn open(
        dir: impl AsRef<Path>,
        identity: StoreIdentity,
    ) -> Result<Self, ReplicaError> {
        let dir = dir.as_ref().to_path_buf();
        tokio::task::spawn_blocking(move || Self::open_blocking(dir, identity))
            .await
            .map_err(|err| ReplicaError::Io(format!("open task failed: {err}")))?
    }

    fn open_blocking(dir: PathBuf, identity: StoreIdentity) -> Result<Self, ReplicaError> {
        identity.validate()?;
        std::fs::create_dir_all(&dir)?;
        let db = sled::Config::new()
            .path(dir.join(META_DIR))
            .open()
            .map_err(|err| ReplicaError::Io(format!("opening {}: {err}", dir.display())))?;
        let meta = Meta::of(&db)?;
        let identity_tree = meta.identity.clone();
        let fence_tree = &meta.fence;

        let stored = read_identity(&identity_tree)?;
        let mut identity = identity;
        let data = match &stored {
            Some(stored) => {
                check_identity(stored, &identity)?;
                let data = DataFile::open(&dir, stored.size)?;
                if identity.size != stored.size {
                    // The recorded size is the copy's: it grows only when a
                    // writer grows it, stamped, for a resize (the config's
                    // size is for a new volume).
                    tracing::info!(
                        configured = identity.size,
                        recorded = stored.size,
                        "the replica keeps its recorded size; grow a volume with \
                         `replica-ha resize`"
                    );
                    identity.size = stored.size;
                }
                data
            }
            None => {
                let data = DataFile::create(&dir, identity.size)?;
                write_identity(&identity_tree, &identity)?;
                db.flush()?;
                data
            }
        };
        let floor = match fence_tree.get(FLOOR_KEY)? {
            Some(bytes) => decode_stamp(&bytes)?,
            None => Stamp::default(),
        };
        let stale_accepts = match fence_tree.get(STALE_ACCEPTS_KEY)? {
            Some(bytes) => decode_u64(&bytes, "stale-accept count")?,
            None => 0,
        };
        let missed = MissedMaps::load(&meta.missed)?;
        let meta_path = dir.join(META_DIR);
        Ok(Self {
            dir,
            size: AtomicU64::new(identity.size),
            growing: tokio::sync::Mutex::new(()),
            identity,
            data: Arc::new(data),
            meta: MetaSlot::new(meta_path, meta),
            floor: Arc::new(RwLock::new(floor)),
            marked: Mutex::default(),
            missed,
            missed_edit: tokio::sync::Mutex::new(()),
            stale_accepts: AtomicU64::new(stale_accepts),
            first_touch_marks: AtomicU64::new(0),
            predigests: Arc::default(),
            session: new_session(),
            #[cfg(test)]
            io_delay: Mutex::default(),
        })
    }

    /// This opening of the store, never 0. A writer that sees it change
    /// knows the replica restarted: writes it took before and had not
    /// flushed may be gone with the page cache (a power cut, a kernel
    /// crash), so it no longer counts on the copy until it is rebuilt.
    pub fn session(&self) -> u64 {
        self.session
    }

    /// The identity this store was opened with.
    pub fn identity(&self) -> &StoreIdentity {
        &self.identity
    }

    /// The volume size in bytes.
    pub fn size(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// Grows the copy to `size` bytes on behalf of the writer of `stamp`
    /// (S2 and the generation rule apply as for a flush) and returns the
    /// size afterwards. A size at or below the current one changes nothing:
    /// this copy may have grown already for a resize that never committed.
    /// See Growth in the module docs for the order of the steps.
    pub async fn grow(&self, stamp: impl Into<Stamp>, size: u64) -> Result<u64, ReplicaError> {
        let stamp = stamp.into();
        check_term(stamp.term)?;
        if size % 512 != 0 {
            return Err(ReplicaError::InvalidRequest(format!(
                "a volume size must be a multiple of 512, not {size}"
            )));
        }
        let _admitted = self.admit(stamp).await?;
        let _one_at_a_time = self.growing.lock().await;
        if size <= self.size() {
            return Ok(self.size());
        }
        let meta = self.meta.get()?;
        let file = Arc::clone(&self.data);
        // The last extent's digest changes when it was partial: no
        // predigest taken before the growth is served after it.
        let _touch = self.predigests.touch();
        let from = self.size();
        run_io(RunOn::Pool, move || file.grow(from, size)).await?;
        meta.identity
            .insert("size", &size.to_be_bytes())
            .map_err(|e| self.meta.failed(e))?;
        meta.flusher
            .flush()
            .await
            .map_err(|e| self.meta.failed(e))?;
        self.size.store(size, Ordering::Release);
        tracing::info!(size, "replica grown");
        Ok(size)
    }

    /// The directory this store lives in.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The current fence floor's term. Waits for a fence in progress.
    pub async fn floor(&self) -> Term {
        self.floor.read().await.term
    }

    /// The current floor with its generation (see [`Stamp`]).
    pub async fn floor_stamp(&self) -> Stamp {
        *self.floor.read().await
    }

    /// Writes `data` at `offset` for the writer of `stamp` (S2, S3, S6).
    pub async fn write(
        &self,
        stamp: impl Into<Stamp>,
        offset: u64,
        data: Bytes,
        fua: bool,
    ) -> Result<(), ReplicaError> {
        let stamp = stamp.into();
        let admitted = self.admit_change(stamp, offset, data.len() as u64).await?;
        self.mark_dirty(stamp.term, offset, data.len() as u64)
            .await?;
        let file = Arc::clone(&self.data);
        #[cfg(test)]
        let delay = *self.io_delay.lock().unwrap_or_else(|p| p.into_inner());
        let touch = self.predigests.touch();
        #[cfg(not(test))]
        let on = RunOn::for_write(data.len(), fua);
        #[cfg(test)]
        let on = if delay.is_zero() {
            RunOn::for_write(data.len(), fua)
        } else {
            RunOn::Pool
        };
        run_io(on, move || {
            // The guard lives until the I/O is done, even if our caller is
            // cancelled: a fence cannot overtake this write (S3). So does
            // the touch: no predigest is taken or served meanwhile.
            let (_admitted, _touch) = (admitted, touch);
            #[cfg(test)]
            std::thread::sleep(delay);
            file.write(&data, offset, fua)
        })
        .await
    }

    /// Discards `[offset, offset + len)` on behalf of the writer of
    /// `stamp`: admitted and marked exactly like a write (S2, S3, S6), then
    /// punched out of the data file, so the space is freed and the range
    /// reads back as zeroes. A file system that cannot punch holes gets
    /// zeroes written instead; the bytes are the same either way, so
    /// digests, resync and scrub see no difference.
    pub async fn discard(
        &self,
        stamp: impl Into<Stamp>,
        offset: u64,
        len: u64,
    ) -> Result<(), ReplicaError> {
        let stamp = stamp.into();
        let admitted = self.admit_change(stamp, offset, len).await?;
        self.mark_dirty(stamp.term, offset, len).await?;
        let file = Arc::clone(&self.data);
        let touch = self.predigests.touch();
        run_io(RunOn::Pool, move || {
            // As for a write: held until the I/O is done (S3).
            let (_admitted, _touch) = (admitted, touch);
            file.punch(offset, len)
        })
        .await
    }

    /// Marks the extents of `[offset, offset + len)` for the writer of
    /// `stamp` ahead of its writes (S6 kept cheap): a sequential stream's
    /// writer asks for the extents it is about to reach, so that their
    /// first writes find them marked and need no metadata flush of their
    /// own. Admitted like a write (S2, S3): a fenced writer cannot mark,
    /// and a fence waits for a mark in progress. Nothing is written; the
    /// absent members' maps are not touched (they record writes). A mark
    /// too many only costs a comparison at the next promotion, and the
    /// writer retires these like any other.
    pub async fn mark_ahead(
        &self,
        stamp: impl Into<Stamp>,
        offset: u64,
        len: u64,
    ) -> Result<(), ReplicaError> {
        let stamp = stamp.into();
        let _admitted = self.admit_change(stamp, offset, len).await?;
        self.mark(stamp.term, offset, len, Touch::Ahead).await
    }

    /// Reads `len` bytes at `offset`. Reads carry no term: any replica may
    /// serve them.
    pub async fn read(&self, offset: u64, len: u64) -> Result<Bytes, ReplicaError> {
        check_request(offset, len, self.size())?;
        let file = Arc::clone(&self.data);
        run_io(RunOn::for_read(len), move || {
            // check_request bounds len by MAX_REQUEST, so it fits in usize.
            file.read(len as usize, offset).map(Bytes::from)
        })
        .await
    }

    /// Which parts of `[offset, offset + len)` hold data and which are
    /// holes, from the data file itself (`SEEK_DATA` / `SEEK_HOLE`; data in
    /// the page cache counts as data). A file system that cannot say
    /// reports all data.
    pub async fn allocation(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<Vec<crate::volume::Extent>, ReplicaError> {
        crate::volume::check_span(offset, len, self.size())?;
        let file = Arc::clone(&self.data);
        run_io(RunOn::Pool, move || {
            Ok(file.allocation(offset, offset + len))
        })
        .await
    }

    /// Makes every write that finished before this call durable, on behalf
    /// of the writer of `stamp` (S2 applies as for writes, and so does the
    /// raise of the floor to a newer generation).
    pub async fn flush(&self, stamp: impl Into<Stamp>) -> Result<(), ReplicaError> {
        let stamp = stamp.into();
        check_term(stamp.term)?;
        let admitted = self.admit(stamp).await?;
        let file = Arc::clone(&self.data);
        run_io(RunOn::Pool, move || {
            let _admitted = admitted;
            file.sync()?;
            Ok(())
        })
        .await
    }

    /// Raises the fence floor to `term` (durably, S7) after every request in
    /// flight has finished or been refused (S3), and returns the floor and
    /// the dirty extents. A `term` at or below the floor changes nothing; the
    /// reply's floor then tells the caller it is not the newest writer.
    pub async fn fence(&self, term: Term) -> Result<FenceReply, ReplicaError> {
        check_term(term)?;
        let floor = self.raise_floor(Stamp::term(term)).await?;
        Ok(FenceReply {
            floor: floor.term,
            generation: floor.generation,
            dirty: self.dirty_extents()?,
            extent_size: self.identity.extent_size,
            session: self.session,
        })
    }

    /// BLAKE3 digests of the extents overlapping `[offset, offset + len)`,
    /// at most [`MAX_DIGEST_EXTENTS`] per call; returns the first extent's
    /// index and the digests. Replicas compare these to find what differs.
    /// Each digest covers its extent up to the end of the request and no
    /// further, so two copies of different sizes (one grew for a resize
    /// that never committed) agree on the range the writer asks about.
    pub async fn digests(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<(u64, Vec<[u8; 32]>), ReplicaError> {
        if len == 0 {
            return Err(ReplicaError::InvalidRequest(
                "a digest request must cover at least one byte".into(),
            ));
        }
        let size = self.identity.extent_size;
        let extents = len.div_ceil(size);
        if extents > MAX_DIGEST_EXTENTS {
            return Err(ReplicaError::Range(crate::volume::RangeError::TooLarge {
                len,
                max: MAX_DIGEST_EXTENTS * size,
            }));
        }
        match offset.checked_add(len) {
            Some(end) if end <= self.size() => {}
            _ => {
                return Err(ReplicaError::Range(crate::volume::RangeError::OutOfRange {
                    offset,
                    len,
                    size: self.size(),
                }));
            }
        }
        let first = offset / size;
        let last = (offset + len - 1) / size;
        let until = offset + len;
        // The predigests cover whole extents up to the volume's end.
        let whole = until >= ((last + 1) * size).min(self.size());
        if whole {
            if let Some(digests) = self.predigests.lookup(first, last) {
                return Ok((first, digests));
            }
        }
        let digests = run_io(RunOn::Pool, self.hasher(first..=last, until)).await?;
        Ok((first, digests))
    }

    /// Hashes every marked extent (at most [`MAX_PREDIGEST_EXTENTS`]) while
    /// nothing writes, so that a promotion's comparison need not: see
    /// [`crate::replica::disk::predigest`]. Does nothing while a write is in flight or
    /// when the digests are current. Returns how many extents it hashed.
    pub async fn predigest(&self) -> Result<usize, ReplicaError> {
        let Some(epoch) = self.predigests.quiet() else {
            return Ok(0);
        };
        let mut extents: Vec<u64> = self.dirty_extents()?.iter().map(|m| m.extent).collect();
        extents.sort_unstable();
        extents.dedup();
        extents.truncate(MAX_PREDIGEST_EXTENTS);
        let count = extents.len();
        let hash = self.hasher(extents.clone(), self.size());
        let digests = run_io(RunOn::Pool, move || {
            Ok(extents.into_iter().zip(hash()?).collect())
        })
        .await?;
        if self.predigests.keep(epoch, digests) {
            Ok(count)
        } else {
            Ok(0)
        }
    }

    /// A blocking task that returns the BLAKE3 digests of `extents`, each
    /// hashed from its start to its end, `until` or the volume's end,
    /// whichever comes first. An extent that is a hole in the data file (never written, or
    /// discarded) reads as zeroes, so it gets the digest of zeroes without
    /// being read: a digest pass over a sparse volume costs in proportion
    /// to what is allocated, not to the volume's size.
    fn hasher(
        &self,
        extents: impl IntoIterator<Item = u64> + Send + 'static,
        until: u64,
    ) -> impl FnOnce() -> std::io::Result<Vec<Digest>> + Send + 'static {
        let (size, volume) = (self.identity.extent_size, until.min(self.size()));
        let file = Arc::clone(&self.data);
        move || {
            let mut buf = vec![0u8; size as usize];
            let mut zeroes: Option<Digest> = None;
            extents
                .into_iter()
                .map(|extent| {
                    let start = extent * size;
                    let end = (start + size).min(volume).max(start);
                    let chunk = &mut buf[..(end - start) as usize];
                    if file.is_hole(start, end) {
                        if chunk.len() as u64 != size {
                            chunk.fill(0);
                            return Ok(*blake3::hash(chunk).as_bytes());
                        }
                        return Ok(*zeroes.get_or_insert_with(|| {
                            *blake3::hash(&vec![0u8; size as usize]).as_bytes()
                        }));
                    }
                    file.read_into(chunk, start)?;
                    Ok(*blake3::hash(chunk).as_bytes())
                })
                .collect()
        }
    }

    /// The fence floor, the number of dirty marks and the audit counter.
    pub async fn info(&self) -> Result<crate::replica::ReplicaInfo, ReplicaError> {
        let floor = self.floor_stamp().await;
        Ok(crate::replica::ReplicaInfo {
            floor: floor.term,
            generation: floor.generation,
            dirty_extents: self.meta.get()?.dirty.len() as u64,
            stale_accepts: self.stale_accepts(),
            first_touch_marks: self.first_touch_marks.load(Ordering::Relaxed),
        })
    }

    /// Requests ever admitted with a term below the fence floor: 0 unless
    /// built with `unsafe-skip-term-check`.
    pub fn stale_accepts(&self) -> u64 {
        self.stale_accepts.load(Ordering::SeqCst)
    }

    /// Opens the missed-write map of `node` (about `incarnation` of its
    /// data dir) if it is not open, and adds `extents` to it, durably, on
    /// behalf of the writer of `stamp` (admitted like a write). A map open
    /// about another incarnation is replaced: the copy it described is
    /// gone (S8). See [`crate::replica::disk::missed`].
    pub async fn note_missed(
        &self,
        stamp: impl Into<Stamp>,
        node: NodeId,
        incarnation: Incarnation,
        extents: &[u64],
    ) -> Result<(), ReplicaError> {
        let stamp = stamp.into();
        check_term(stamp.term)?;
        if extents.len() as u64 > MAX_MISSED_EXTENTS {
            return Err(ReplicaError::InvalidRequest(format!(
                "{} extents in one note; at most {MAX_MISSED_EXTENTS}",
                extents.len()
            )));
        }
        let count = self.size().div_ceil(self.identity.extent_size);
        if let Some(extent) = extents.iter().find(|e| **e >= count) {
            return Err(ReplicaError::InvalidRequest(format!(
                "extent {extent} is past the volume's {count} extents"
            )));
        }
        let _admitted = self.admit(stamp).await?;
        let _one_at_a_time = self.missed_edit.lock().await;
        let current = self.missed.open_of(node);
        let replaced = current.is_some_and(|open| open != incarnation);
        // A note keeps the map's unverified range; a replacement has none.
        let unverified = if current == Some(incarnation) {
            self.missed.unverified_of(node)
        } else {
            None
        };
        let written = self
            .write_missed(node, incarnation, extents, replaced, unverified)
            .await;
        if let Err(err) = written {
            self.missed.forget(node);
            return Err(err);
        }
        if current != Some(incarnation) {
            tracing::info!(replica = %node, %incarnation, noted = extents.len(), "missed-write map opened");
        }
        self.missed.opened(node, incarnation, extents, replaced);
        Ok(())
    }

    /// The database side of [`ReplicaStore::note_missed`].
    async fn write_missed(
        &self,
        node: NodeId,
        incarnation: Incarnation,
        extents: &[u64],
        replaced: bool,
        unverified: Option<u64>,
    ) -> Result<(), ReplicaError> {
        let meta = self.meta.get()?;
        if replaced {
            // The open record first: a crash from here on leaves no map
            // (a full rebuild), never one with entries missing.
            meta.missed
                .remove(missed::open_key(node))
                .map_err(|e| self.meta.failed(e))?;
            let old: Vec<sled::IVec> = meta
                .missed
                .scan_prefix(missed::entry_prefix(node))
                .keys()
                .collect::<Result<_, _>>()
                .map_err(|e| self.meta.failed(e))?;
            crate::sled_ops::remove_all(&meta.missed, &old).map_err(|e| self.meta.failed(e))?;
        }
        let empty: &[u8] = &[];
        let entries = extents
            .iter()
            .map(|extent| (missed::entry_key(node, *extent), empty));
        crate::sled_ops::insert_all(&meta.missed, entries).map_err(|e| self.meta.failed(e))?;
        meta.missed
            .insert(
                missed::open_key(node),
                missed::open_value(incarnation, unverified),
            )
            .map_err(|e| self.meta.failed(e))?;
        meta.flusher.flush().await.map_err(|e| self.meta.failed(e))
    }

    /// Changes the unverified range of `node`'s missed-write map (about
    /// `incarnation`), durably, on behalf of the writer of `stamp`
    /// (admitted like a write): a full rebuild of `node` begins by
    /// lowering it to 0 and raises it as it verifies (see
    /// [`crate::replica::disk::missed`]). Lowering opens the map if need be.
    pub async fn set_unverified(
        &self,
        stamp: impl Into<Stamp>,
        node: NodeId,
        incarnation: Incarnation,
        change: Unverified,
    ) -> Result<(), ReplicaError> {
        let stamp = stamp.into();
        check_term(stamp.term)?;
        let _admitted = self.admit(stamp).await?;
        let _one_at_a_time = self.missed_edit.lock().await;
        let current = self.missed.open_of(node);
        let same = current == Some(incarnation);
        let now = if same {
            self.missed.unverified_of(node)
        } else {
            None
        };
        let Some(next) = change.apply(same, now) else {
            return Ok(());
        };
        let replaced = current.is_some_and(|open| open != incarnation);
        let written = self
            .write_missed(node, incarnation, &[], replaced, next)
            .await;
        if let Err(err) = written {
            self.missed.forget(node);
            return Err(err);
        }
        self.missed.opened(node, incarnation, &[], replaced);
        self.missed.set_unverified(node, next);
        tracing::debug!(replica = %node, %incarnation, ?next, "missed-write map's unverified range");
        Ok(())
    }

    /// One page of `node`'s missed-write map: the extents from `from` on,
    /// at most [`MAX_MISSED_EXTENTS`]; `None` if no map of it is open.
    /// Reads what the database holds, which may be more than is flushed: a
    /// superset is safe.
    pub fn missed(&self, node: NodeId, from: u64) -> Result<Option<MissedMap>, ReplicaError> {
        let Some(incarnation) = self.missed.open_of(node) else {
            return Ok(None);
        };
        let meta = self.meta.get()?;
        let start = missed::entry_key(node, from);
        let end = missed::entry_key(node, u64::MAX);
        let mut map = MissedMap {
            incarnation,
            unverified_from: self.missed.unverified_of(node),
            ..MissedMap::default()
        };
        for key in meta.missed.range(start..=end).keys() {
            let key = key.map_err(|e| self.meta.failed(e))?;
            if map.extents.len() as u64 == MAX_MISSED_EXTENTS {
                map.more = true;
                break;
            }
            map.extents.push(missed::decode_entry(&key)?.1);
        }
        Ok(Some(map))
    }

    /// The database side of [`ReplicaStore::close_missed`].
    async fn remove_missed(&self, node: NodeId) -> Result<(), ReplicaError> {
        let meta = self.meta.get()?;
        meta.missed
            .remove(missed::open_key(node))
            .map_err(|e| self.meta.failed(e))?;
        let entries: Vec<sled::IVec> = meta
            .missed
            .scan_prefix(missed::entry_prefix(node))
            .keys()
            .collect::<Result<_, _>>()
            .map_err(|e| self.meta.failed(e))?;
        crate::sled_ops::remove_all(&meta.missed, &entries).map_err(|e| self.meta.failed(e))?;
        meta.flusher.flush().await.map_err(|e| self.meta.failed(e))
    }

    /// The members this store keeps an open missed-write map of.
    pub fn missed_open(&self) -> std::collections::BTreeMap<NodeId, Incarnation> {
        self.missed.open()
    }

    /// Closes `node`'s missed-write map and drops its entries, on behalf
    /// of the writer of `stamp`, once `node` is back in the in-sync set.
    pub async fn close_missed(
        &self,
        stamp: impl Into<Stamp>,
        node: NodeId,
    ) -> Result<(), ReplicaError> {
        let stamp = stamp.into();
        check_term(stamp.term)?;
        let _admitted = self.admit(stamp).await?;
        let _one_at_a_time = self.missed_edit.lock().await;
        if self.missed.open_of(node).is_none() {
            return Ok(());
        }
        let removed = self.remove_missed(node).await;
        if let Err(err) = removed {
            self.missed.forget(node);
            return Err(err);
        }
        self.missed.closed(node);
        tracing::info!(replica = %node, "missed-write map closed");
        Ok(())
    }

    /// Every durable dirty mark, ordered by term then extent.
    pub fn dirty_extents(&self) -> Result<Vec<DirtyExtent>, ReplicaError> {
        let meta = self.meta.get()?;
        meta.dirty
            .iter()
            .keys()
            .map(|key| decode_dirty(&key.map_err(|e| self.meta.failed(e))?))
            .collect()
    }

    /// Drops the dirty marks of every term below `term`, once the extents
    /// they name have converged (S6). Drains in-flight requests first.
    pub async fn clear_dirty_below(&self, term: Term) -> Result<(), ReplicaError> {
        let drained = self.floor.write().await;
        // A writer older than the floor must not drop marks that the newer
        // one has still to converge.
        if term < drained.term {
            return Err(ReplicaError::StaleTerm {
                term,
                floor: drained.term,
            });
        }
        let meta = self.meta.get()?;
        let end = term.0.to_be_bytes();
        let keys: Vec<sled::IVec> = meta
            .dirty
            .range(..end.as_slice())
            .keys()
            .collect::<Result<_, _>>()
            .map_err(|e| self.meta.failed(e))?;
        crate::sled_ops::remove_all(&meta.dirty, &keys).map_err(|e| self.meta.failed(e))?;
        meta.flusher
            .flush()
            .await
            .map_err(|e| self.meta.failed(e))?;
        self.lock_marked().set.retain(|mark| mark.term >= term);
        // The promotion that the predigests were for is over.
        self.predigests.forget();
        Ok(())
    }

    /// Drops the marks of every term up to `through` on `extents`, on
    /// behalf of the writer of `stamp` (admitted like a write, so a deposed
    /// writer cannot drop marks its successor needs). The writer calls this
    /// once every in-sync replica holds those extents durably and no write
    /// to them is in flight: during its term, to keep only the hot set
    /// marked, and during convergence, to resume where it was (S6). Returns
    /// how many marks were dropped. Not flushed: a retirement lost in a
    /// crash only leaves a mark too many.
    pub async fn retire_marks(
        &self,
        stamp: impl Into<Stamp>,
        through: Term,
        extents: &[u64],
    ) -> Result<usize, ReplicaError> {
        let stamp = stamp.into();
        check_term(stamp.term)?;
        if through > stamp.term {
            return Err(ReplicaError::InvalidRequest(format!(
                "the writer of term {} cannot retire marks of term {through}",
                stamp.term
            )));
        }
        if extents.len() as u64 > MAX_RETIRE_EXTENTS {
            return Err(ReplicaError::InvalidRequest(format!(
                "{} extents in one retirement; at most {MAX_RETIRE_EXTENTS}",
                extents.len()
            )));
        }
        let _admitted = self.admit(stamp).await?;
        let wanted: HashSet<u64> = extents.iter().copied().collect();
        let end = encode_dirty(&DirtyExtent {
            term: through,
            extent: u64::MAX,
        });
        let meta = self.meta.get()?;
        // One step for `mark`: the marks leave memory and the Db together,
        // and a mark still being placed keeps its key (see `Marked`).
        let mut marked = self.lock_marked();
        let mut keys = Vec::new();
        for key in meta.dirty.range(..=end.as_slice()).keys() {
            let key = key.map_err(|e| self.meta.failed(e))?;
            let mark = decode_dirty(&key)?;
            if wanted.contains(&mark.extent) && !marked.placing.contains_key(&mark) {
                keys.push(key);
            }
        }
        marked
            .set
            .retain(|mark| mark.term > through || !wanted.contains(&mark.extent));
        crate::sled_ops::remove_all(&meta.dirty, &keys).map_err(|e| self.meta.failed(e))?;
        Ok(keys.len())
    }

    /// The checks of a request that changes `[offset, offset + len)` (a
    /// write, discard or mark): a real term and a range inside the volume,
    /// then admission (S2, S3). Returns the guard its I/O must hold.
    async fn admit_change(
        &self,
        stamp: Stamp,
        offset: u64,
        len: u64,
    ) -> Result<OwnedRwLockReadGuard<Stamp>, ReplicaError> {
        check_term(stamp.term)?;
        check_request(offset, len, self.size())?;
        self.admit(stamp).await
    }

    /// Waits until a request of `stamp` may proceed and returns the guard it
    /// must hold while its I/O runs. Raises the floor first when `stamp` is
    /// newer (S2); refuses an older generation of the floor's own term.
    async fn admit(&self, stamp: Stamp) -> Result<OwnedRwLockReadGuard<Stamp>, ReplicaError> {
        let term = stamp.term;
        loop {
            let guard = Arc::clone(&self.floor).read_owned().await;
            let floor = guard.term;
            if term == floor && stamp < *guard {
                return Err(ReplicaError::StaleGeneration {
                    stamp,
                    floor: *guard,
                });
            }
            if term < floor {
                if cfg!(feature = "unsafe-skip-term-check") {
                    self.count_stale_accept(term, floor).await?;
                    return Ok(guard);
                }
                return Err(ReplicaError::StaleTerm { term, floor });
            }
            if stamp == *guard {
                return Ok(guard);
            }
            drop(guard);
            self.raise_floor(stamp).await?;
        }
    }

    /// The deliberately broken build (feature `unsafe-skip-term-check`)
    /// admits a stale request instead of refusing it, and counts it here:
    /// durably, so a restart cannot hide it from the fault campaign's
    /// checker. Never called in a correct build.
    async fn count_stale_accept(&self, term: Term, floor: Term) -> Result<(), ReplicaError> {
        tracing::warn!(
            %term,
            %floor,
            "admitted a stale term (unsafe-skip-term-check)"
        );
        // One atomic read-modify-write, so concurrent stale admissions
        // cannot store their counts out of order.
        let meta = self.meta.get()?;
        let stored = meta
            .fence
            .update_and_fetch(STALE_ACCEPTS_KEY, |old| {
                let count = old
                    .and_then(|bytes| <[u8; 8]>::try_from(bytes).ok())
                    .map_or(0, u64::from_be_bytes);
                Some((count + 1).to_be_bytes().to_vec())
            })
            .map_err(|e| self.meta.failed(e))?;
        let count = stored
            .and_then(|bytes| <[u8; 8]>::try_from(bytes.as_ref()).ok())
            .map_or(0, u64::from_be_bytes);
        self.stale_accepts.fetch_max(count, Ordering::SeqCst);
        meta.flusher.flush().await.map_err(|e| self.meta.failed(e))
    }

    /// Takes the write guard (draining every request in flight), raises the
    /// floor to `stamp` durably if it is newer, and returns the floor.
    async fn raise_floor(&self, stamp: Stamp) -> Result<Stamp, ReplicaError> {
        let mut floor = self.floor.write().await;
        if stamp > *floor {
            let meta = self.meta.get()?;
            meta.fence
                .insert(FLOOR_KEY, &encode_stamp(stamp))
                .map_err(|e| self.meta.failed(e))?;
            meta.flusher
                .flush()
                .await
                .map_err(|e| self.meta.failed(e))?;
            *floor = stamp;
        }
        Ok(*floor)
    }

    /// Records durably that `term` touches the extents of `[offset, offset+len)`.
    async fn mark_dirty(&self, term: Term, offset: u64, len: u64) -> Result<(), ReplicaError> {
        self.mark(term, offset, len, Touch::Write).await
    }

    /// Durably marks the extents of `[offset, offset+len)` for `term`, and
    /// for a write also records it in the absent members' maps, all in one
    /// metadata flush; an extent already marked for `term` costs nothing.
    /// Only once the flush is done does the extent count as marked in
    /// memory, so a write that finds its extent marked there may go ahead
    /// without a flush of its own (S6).
    async fn mark(
        &self,
        term: Term,
        offset: u64,
        len: u64,
        touch: Touch,
    ) -> Result<(), ReplicaError> {
        if len == 0 {
            return Ok(());
        }
        let size = self.identity.extent_size;
        let (first, last) = (offset / size, (offset + len - 1) / size);
        // What is not durable yet is claimed before its keys go in, so no
        // retirement removes them until they are published below (see
        // `Marked`): a write never waits on, or loses to, a retirement.
        let placing = {
            let mut marked = self.lock_marked();
            let missing: Vec<DirtyExtent> = (first..=last)
                .map(|extent| DirtyExtent { term, extent })
                .filter(|mark| !marked.set.contains(mark))
                .collect();
            marked.claim(&missing);
            Placing {
                store: self,
                marks: missing,
            }
        };
        // The absent members' maps take a write first, in the same flush
        // (see [`crate::replica::disk::missed`]).
        let needed = match touch {
            Touch::Write => self.missed.needed(first, last),
            Touch::Ahead => missed::Needed::default(),
        };
        if placing.marks.is_empty() && needed.entries.is_empty() {
            return Ok(());
        }
        let empty: &[u8] = &[];
        let pairs = placing.marks.iter().map(|mark| (encode_dirty(mark), empty));
        let meta = self.meta.get()?;
        crate::sled_ops::insert_all(&meta.dirty, pairs).map_err(|e| self.meta.failed(e))?;
        let entries = needed
            .entries
            .iter()
            .map(|(node, extent)| (missed::entry_key(*node, *extent), empty));
        crate::sled_ops::insert_all(&meta.missed, entries).map_err(|e| self.meta.failed(e))?;
        meta.flusher
            .flush()
            .await
            .map_err(|e| self.meta.failed(e))?;
        if touch == Touch::Write {
            self.first_touch_marks
                .fetch_add(placing.marks.len() as u64, Ordering::Relaxed);
        }
        placing.publish();
        self.missed.flushed(needed);
        Ok(())
    }

    fn lock_marked(&self) -> std::sync::MutexGuard<'_, Marked> {
        self.marked
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The dirty marks known to be durable, and the marks being placed: their
/// keys are in the Db (or about to be) and their flush has not finished.
/// A retirement removes marks from `set` and from the Db in one step under
/// the lock, and leaves the keys of marks being placed alone, so a mark is
/// never lost between its insert and its publication (S6), and a write
/// never waits for a retirement of other extents, however many run (a
/// count of retirements that forced a mark to start over livelocked under
/// a sequential stream, whose writer then dropped its own copy).
#[derive(Debug, Default)]
struct Marked {
    set: HashSet<DirtyExtent>,
    placing: HashMap<DirtyExtent, usize>,
}

impl Marked {
    fn claim(&mut self, marks: &[DirtyExtent]) {
        for mark in marks {
            *self.placing.entry(*mark).or_default() += 1;
        }
    }

    fn release(&mut self, marks: &[DirtyExtent]) {
        for mark in marks {
            if let Some(count) = self.placing.get_mut(mark) {
                *count -= 1;
                if *count == 0 {
                    self.placing.remove(mark);
                }
            }
        }
    }
}

/// Marks one call of [`ReplicaStore::mark`] is placing. Dropped without
/// [`Placing::publish`] (an error, a cancelled request), it gives up its
/// claim and the marks do not count as durable; a key it left in the Db is
/// a mark too many, which costs a comparison, never safety.
struct Placing<'a> {
    store: &'a ReplicaStore,
    marks: Vec<DirtyExtent>,
}

impl Placing<'_> {
    /// The marks are durable: they count from now on, in the same step
    /// that gives up the claim, so no retirement can slip in between.
    fn publish(mut self) {
        let marks = std::mem::take(&mut self.marks);
        let mut marked = self.store.lock_marked();
        marked.release(&marks);
        marked.set.extend(marks);
    }
}

impl Drop for Placing<'_> {
    fn drop(&mut self) {
        if !self.marks.is_empty() {
            self.store.lock_marked().release(&self.marks);
        }
    }
}

/// Why extents are being marked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Touch {
    /// A write or discard is about to change them.
    Write,
    /// The writer expects to write them soon ([`ReplicaStore::mark_ahead`]).
    Ahead,
}

/// A number drawn at random for one opening of a store, never 0: the
/// standard library seeds each `RandomState` from the operating system's
/// randomness, and the time and process id are hashed in as well.
fn new_session() -> u64 {
    use std::hash::{BuildHasher, Hash, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    std::process::id().hash(&mut hasher);
    std::time::SystemTime::now().hash(&mut hasher);
    hasher.finish().max(1)
}

fn check_term(term: Term) -> Result<(), ReplicaError> {
    if term == Term::ZERO {
        Err(ReplicaError::InvalidTerm)
    } else {
        Ok(())
    }
}

fn encode_dirty(mark: &DirtyExtent) -> [u8; 16] {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&mark.term.0.to_be_bytes());
    key[8..].copy_from_slice(&mark.extent.to_be_bytes());
    key
}

fn decode_dirty(key: &[u8]) -> Result<DirtyExtent, ReplicaError> {
    if key.len() != 16 {
        return Err(ReplicaError::Io(format!(
            "corrupt dirty mark of {} bytes",
            key.len()
        )));
    }
    Ok(DirtyExtent {
        term: Term(decode_u64(&key[..8], "dirty mark")?),
        extent: decode_u64(&key[8..], "dirty mark")?,
    })
}

/// The floor on disk: the term, then the generation (a floor written
/// before generations existed is the term alone, generation 0).
fn encode_stamp(stamp: Stamp) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&stamp.term.0.to_be_bytes());
    bytes[8..].copy_from_slice(&stamp.generation.to_be_bytes());
    bytes
}

fn decode_stamp(bytes: &[u8]) -> Result<Stamp, ReplicaError> {
    match bytes.len() {
        8 => Ok(Stamp::term(Term(decode_u64(bytes, "fence floor")?))),
        16 => Ok(Stamp {
            term: Term(decode_u64(&bytes[..8], "fence floor")?),
            generation: decode_u64(&bytes[8..], "fence floor")?,
        }),
        n => Err(ReplicaError::Io(format!("corrupt fence floor: {n} bytes"))),
    }
}

fn decode_u64(bytes: &[u8], what: &str) -> Result<u64, ReplicaError> {
    let array: [u8; 8] = bytes
        .try_into()
        .map_err(|_| ReplicaError::Io(format!("corrupt {what}: {} bytes", bytes.len())))?;
    Ok(u64::from_be_bytes(array))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::GroupId;
    use crate::replica::disk::data::{DATA_FILE, DIRECT_IO, INLINE_IO, MEMORY_ALIGN};
    use crate::volume::{MAX_REQUEST, RangeError};
    use std::os::unix::fs::FileExt;
    use std::time::Duration;

    const SIZE: u64 = 8 * 1024 * 1024;
    fn identity() -> StoreIdentity {
        StoreIdentity::new("c1", "vol0", SIZE)
    }

    async fn open(dir: &Path) -> ReplicaStore {
        try_open(dir, identity()).await.expect("open")
    }

    /// Opens (or reopens) a store. sled releases a dropped Db's file lock
    /// only once its background I/O jobs let go of it, so a reopen right
    /// after a drop retries briefly (bounded) on that one error.
    async fn try_open(dir: &Path, identity: StoreIdentity) -> Result<ReplicaStore, ReplicaError> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            match ReplicaStore::open(dir, identity.clone()).await {
                Err(err)
                    if err.to_string().contains("could not acquire lock")
                        && tokio::time::Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                outcome => return outcome,
            }
        }
    }

    fn block(byte: u8, len: usize) -> Bytes {
        Bytes::from(vec![byte; len])
    }

    #[tokio::test]
    async fn the_audit_counts_stale_admissions_only_in_the_broken_build() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path()).await;
        store.fence(Term(5)).await.unwrap();
        let stale = store.write(Term(4), 0, block(9, 512), false).await;
        if cfg!(feature = "unsafe-skip-term-check") {
            assert_eq!(stale, Ok(()));
            assert_eq!(store.stale_accepts(), 1);
        } else {
            assert_eq!(
                stale,
                Err(ReplicaError::StaleTerm {
                    term: Term(4),
                    floor: Term(5)
                })
            );
            assert_eq!(store.stale_accepts(), 0);
        }
        assert_eq!(
            store.info().await.unwrap().stale_accepts,
            store.stale_accepts()
        );
        // The count is durable: a restart must not hide a stale admission.
        let before = store.stale_accepts();
        drop(store);
        let reopened = open(dir.path()).await;
        assert_eq!(reopened.stale_accepts(), before);
    }

    #[tokio::test]
    async fn write_then_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path()).await;
        assert_eq!(store.size(), SIZE);
        assert_eq!(store.dir(), dir.path());
        assert_eq!(store.identity(), &identity());
        store
            .write(Term(1), 4096, block(7, 4096), false)
            .await
            .unwrap();
        store
            .write(Term(1), 8192, block(8, 512), true)
            .await
            .unwrap();
        store.flush(Term(1)).await.unwrap();
        assert_eq!(store.read(4096, 4096).await.unwrap(), block(7, 4096));
        assert_eq!(store.read(8192, 512).await.unwrap(), block(8, 512));
        assert_eq!(store.read(0, 4096).await.unwrap(), block(0, 4096));
        // An empty write is accepted and touches nothing.
        store.write(Term(1), 0, Bytes::new(), false).await.unwrap();
        assert_eq!(store.read(0, 4096).await.unwrap(), block(0, 4096));
        assert!(format!("{store:?}").contains("ReplicaStore"));
    }

    /// Most of a large write bypasses the page cache: what the cache held
    /// of its range (even dirty) is not served afterwards, its unaligned
    /// ends go through the cache, and the bytes are on the disk once
    /// flushed.
    #[tokio::test]
    async fn large_writes_bypass_the_cache_and_read_back_coherently() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path()).await;
        if !store.data.has_direct() {
            eprintln!("this file system refuses O_DIRECT: only the cached path is tested");
        }
        let reads = |offset: u64, expected: Bytes, what: &'static str| {
            let store = &store;
            async move {
                let got = store.read(offset, expected.len() as u64).await.unwrap();
                assert!(got == expected, "{what}: not the bytes written");
            }
        };
        const MIB: u64 = 1 << 20;
        // Old bytes in the cache, dirty, then read back so they are cached.
        for piece in 0..(DIRECT_IO / INLINE_IO) {
            let at = (piece * INLINE_IO) as u64;
            store
                .write(Term(1), at, block(1, INLINE_IO), false)
                .await
                .unwrap();
        }
        reads(0, block(1, 4096), "a cached write").await;
        store
            .write(Term(1), 0, block(2, DIRECT_IO), false)
            .await
            .unwrap();
        reads(0, block(2, DIRECT_IO), "a direct write over cached pages").await;
        // Direct in [4, 6) MiB only; its ends go through the cache.
        let split = 3 * MIB + 512;
        store
            .write(Term(1), split, block(3, DIRECT_IO), false)
            .await
            .unwrap();
        let end = split + DIRECT_IO as u64;
        let whole = || async {
            reads(0, block(2, split as usize), "before the split write").await;
            reads(split, block(3, DIRECT_IO), "the split write").await;
            reads(end, block(0, (SIZE - end) as usize), "after it").await;
        };
        whole().await;
        store.flush(Term(1)).await.unwrap();
        // From the disk, not the cache.
        let uncache = || {
            rustix::fs::fadvise(store.data.file(), 0, None, rustix::fs::Advice::DontNeed).unwrap()
        };
        uncache();
        whole().await;
        // A payload aligned in memory, as the block channel receives a
        // large one: its middle, [2, 4) MiB, goes direct without a copy.
        let aligned = {
            let mut room: Vec<u8> = Vec::with_capacity(DIRECT_IO + MEMORY_ALIGN);
            room.resize(room.as_ptr().align_offset(MEMORY_ALIGN), 0u8);
            let skip = room.len();
            room.resize(skip + DIRECT_IO, 4u8);
            Bytes::from_owner(room).slice(skip..)
        };
        assert_eq!(aligned.as_ptr().align_offset(MEMORY_ALIGN), 0);
        store.write(Term(1), MIB, aligned, false).await.unwrap();
        let after_aligned = || async {
            reads(0, block(2, MIB as usize), "before the aligned write").await;
            reads(MIB, block(4, DIRECT_IO), "the aligned write").await;
            let next = MIB + DIRECT_IO as u64;
            reads(next, block(3, (end - next) as usize), "after it").await;
        };
        after_aligned().await;
        store.flush(Term(1)).await.unwrap();
        uncache();
        after_aligned().await;
    }

    #[tokio::test]
    async fn stale_term_is_refused_and_the_floor_survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = open(dir.path()).await;
            store
                .write(Term(5), 0, block(5, 4096), false)
                .await
                .unwrap();
            assert_eq!(store.floor().await, Term(5));
            assert_eq!(
                store.write(Term(4), 0, block(4, 4096), false).await,
                Err(ReplicaError::StaleTerm {
                    term: Term(4),
                    floor: Term(5)
                })
            );
            assert_eq!(
                store.flush(Term(3)).await,
                Err(ReplicaError::StaleTerm {
                    term: Term(3),
                    floor: Term(5)
                })
            );
        }
        let store = open(dir.path()).await;
        assert_eq!(store.floor().await, Term(5));
        assert_eq!(
            store.write(Term(4), 0, block(4, 4096), false).await,
            Err(ReplicaError::StaleTerm {
                term: Term(4),
                floor: Term(5)
            })
        );
        assert_eq!(store.read(0, 4096).await.unwrap(), block(5, 4096));
    }

    #[tokio::test]
    async fn a_newer_term_raises_the_floor_durably_before_it_is_applied() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = open(dir.path()).await;
            store.write(Term(2), 0, block(2, 512), false).await.unwrap();
            store.flush(Term(3)).await.unwrap();
            assert_eq!(store.floor().await, Term(3));
            store
                .write(Term(9), 512, block(9, 512), false)
                .await
                .unwrap();
            assert_eq!(store.floor().await, Term(9));
        }
        assert_eq!(open(dir.path()).await.floor().await, Term(9));
    }

    #[tokio::test]
    async fn an_older_generation_of_the_floor_term_is_refused_and_survives_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let next = Stamp {
            term: Term(4),
            generation: 2,
        };
        {
            let store = open(dir.path()).await;
            store.write(Term(4), 0, block(1, 512), false).await.unwrap();
            store.flush(next).await.unwrap();
            assert_eq!(store.floor_stamp().await, next);
            assert_eq!(
                store.write(Term(4), 0, block(2, 512), false).await,
                Err(ReplicaError::StaleGeneration {
                    stamp: Stamp::term(Term(4)),
                    floor: next
                })
            );
            // A fence of the same term keeps the generation (it is no newer)
            // and still reports the term as fenced.
            assert_eq!(store.fence(Term(4)).await.unwrap().floor, Term(4));
            assert_eq!(store.floor_stamp().await, next);
        }
        let store = open(dir.path()).await;
        assert_eq!(store.floor_stamp().await, next);
        assert_eq!(store.read(0, 512).await.unwrap(), block(1, 512));
        // A newer term starts over at generation 0.
        store.write(Term(5), 0, block(3, 512), false).await.unwrap();
        assert_eq!(store.floor_stamp().await, Stamp::term(Term(5)));
    }

    #[test]
    fn a_floor_stored_before_generations_reads_as_generation_zero() {
        assert_eq!(decode_stamp(&7u64.to_be_bytes()), Ok(Stamp::term(Term(7))));
        let stamp = Stamp {
            term: Term(7),
            generation: 3,
        };
        assert_eq!(decode_stamp(&encode_stamp(stamp)), Ok(stamp));
        assert!(decode_stamp(&[1, 2, 3]).is_err());
    }

    /// A retirement that runs while a mark waits for its metadata flush
    /// removes the mark's fresh key; the mark must not then count as
    /// durable, or a later write of the term would skip its own (S6).
    #[tokio::test]
    async fn a_mark_overlapped_by_a_retirement_is_placed_again_before_it_counts() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(open(dir.path()).await);
        let mib = DEFAULT_EXTENT_SIZE;
        for extent in [5u64, 6, 7] {
            let marking = {
                let store = Arc::clone(&store);
                tokio::spawn(async move { store.mark_ahead(Term(2), extent * mib, mib).await })
            };
            // The mark runs up to its flush (this runtime has one thread).
            tokio::task::yield_now().await;
            store
                .retire_marks(Term(2), Term(2), &[extent])
                .await
                .unwrap();
            marking.await.unwrap().unwrap();
            store
                .write(Term(2), extent * mib, block(7, 4096), false)
                .await
                .unwrap();
            let durable: Vec<u64> = store
                .dirty_extents()
                .unwrap()
                .into_iter()
                .map(|m| m.extent)
                .collect();
            assert!(
                durable.contains(&extent),
                "a write to extent {extent} was applied with no durable mark: {durable:?}"
            );
        }
    }

    /// Retirements of other extents that never stop overlap every mark's
    /// flush: the writes still succeed, each with a durable mark (the
    /// writer once dropped its own copy when a sequential stream's marks
    /// kept starting over, #36). A retirement of the very extent being
    /// marked is the test above.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_write_is_never_refused_for_retirements_that_overlap_its_mark() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(open(dir.path()).await);
        let mib = DEFAULT_EXTENT_SIZE;
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let retiring = {
            let (store, stop) = (Arc::clone(&store), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut passes = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    // Extents 4..8, at the writer's current term (a newer
                    // one may refuse it: that pass then does not count).
                    let floor = store.floor_stamp().await;
                    let extent = 4 + passes % 4;
                    if store
                        .retire_marks(floor, floor.term, &[extent])
                        .await
                        .is_ok()
                    {
                        passes += 1;
                    }
                    tokio::task::yield_now().await;
                }
                passes
            })
        };
        // Each term's first write to an extent places a mark.
        for term in (2..12).map(Term) {
            for extent in 0u64..4 {
                store
                    .write(term, extent * mib, block(9, 4096), false)
                    .await
                    .unwrap_or_else(|err| panic!("the write to extent {extent} failed: {err}"));
                let durable = store.dirty_extents().unwrap();
                assert!(
                    durable.contains(&DirtyExtent { term, extent }),
                    "extent {extent} was written in {term} with no durable mark"
                );
            }
        }
        stop.store(true, Ordering::SeqCst);
        let passes = retiring.await.unwrap();
        assert!(passes > 20, "retirements ran {passes} times only");
    }

    #[tokio::test]
    async fn marks_ahead_are_durable_marks_that_write_nothing_and_a_fenced_writer_cannot_place() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path()).await;
        let mib = DEFAULT_EXTENT_SIZE;
        store.mark_ahead(Term(2), 2 * mib, 3 * mib).await.unwrap();
        let marked = |store: &ReplicaStore| -> Vec<u64> {
            store
                .dirty_extents()
                .unwrap()
                .into_iter()
                .map(|m| m.extent)
                .collect()
        };
        assert_eq!(marked(&store), vec![2, 3, 4]);
        assert_eq!(
            store.read(2 * mib, 3 * mib).await.unwrap(),
            vec![0u8; 3 * mib as usize]
        );
        // Past the end, term 0 and a term below the floor mark nothing.
        let size = store.size();
        assert!(matches!(
            store.mark_ahead(Term(2), size - mib, 2 * mib).await,
            Err(ReplicaError::Range(_))
        ));
        assert_eq!(
            store.mark_ahead(Term::ZERO, 0, mib).await,
            Err(ReplicaError::InvalidTerm)
        );
        store.fence(Term(3)).await.unwrap();
        assert!(matches!(
            store.mark_ahead(Term(2), 6 * mib, mib).await,
            Err(ReplicaError::StaleTerm { .. })
        ));
        assert_eq!(marked(&store), vec![2, 3, 4]);
        // They survive a restart, like a write's.
        drop(store);
        let store = open(dir.path()).await;
        assert_eq!(marked(&store), vec![2, 3, 4]);
    }

    #[tokio::test]
    async fn fence_raises_the_floor_and_reports_dirty_extents() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path()).await;
        let mib = DEFAULT_EXTENT_SIZE;
        // Spans extents 0 and 1.
        store
            .write(Term(1), mib - 512, block(1, 1024), false)
            .await
            .unwrap();
        store
            .write(Term(2), 3 * mib, block(2, 512), false)
            .await
            .unwrap();
        let reply = store.fence(Term(4)).await.unwrap();
        assert_eq!(reply.floor, Term(4));
        assert_eq!(reply.extent_size, mib);
        assert_eq!(
            reply.dirty,
            vec![
                DirtyExtent {
                    term: Term(1),
                    extent: 0
                },
                DirtyExtent {
                    term: Term(1),
                    extent: 1
                },
                DirtyExtent {
                    term: Term(2),
                    extent: 3
                },
            ]
        );
        // A lower fence changes nothing and tells the caller the floor.
        assert_eq!(store.fence(Term(3)).await.unwrap().floor, Term(4));
        assert_eq!(
            store.write(Term(2), 0, block(2, 512), false).await,
            Err(ReplicaError::StaleTerm {
                term: Term(2),
                floor: Term(4)
            })
        );
    }

    #[tokio::test]
    async fn dirty_marks_are_durable_and_cleared_below_a_term() {
        let dir = tempfile::tempdir().unwrap();
        {
            let store = open(dir.path()).await;
            store.write(Term(1), 0, block(1, 512), false).await.unwrap();
            store.write(Term(1), 0, block(1, 512), false).await.unwrap();
            store.write(Term(2), 0, block(2, 512), false).await.unwrap();
            store
                .write(Term(3), 5 * DEFAULT_EXTENT_SIZE, block(3, 512), false)
                .await
                .unwrap();
        }
        let store = open(dir.path()).await;
        assert_eq!(store.dirty_extents().unwrap().len(), 3);
        store.clear_dirty_below(Term(3)).await.unwrap();
        assert_eq!(
            store.dirty_extents().unwrap(),
            vec![DirtyExtent {
                term: Term(3),
                extent: 5
            }]
        );
        // After a reopen the cleared marks stay gone.
        drop(store);
        let store = open(dir.path()).await;
        assert_eq!(store.dirty_extents().unwrap().len(), 1);
        // A cleared mark is recorded again when written again in its term.
        store.write(Term(3), 0, block(3, 512), false).await.unwrap();
        store.clear_dirty_below(Term(4)).await.unwrap();
        store.write(Term(4), 0, block(4, 512), false).await.unwrap();
        assert_eq!(
            store.dirty_extents().unwrap(),
            vec![DirtyExtent {
                term: Term(4),
                extent: 0
            }]
        );
    }

    /// Starts a term-1 write of `byte`s at offset 0 that is held in its I/O
    /// for 300 ms, and returns once it holds its admission (a read guard).
    async fn start_held_write(
        store: &Arc<ReplicaStore>,
        byte: u8,
    ) -> tokio::task::JoinHandle<Result<(), ReplicaError>> {
        store
            .write(Term(1), 0, block(0, 4096), false)
            .await
            .unwrap();
        *store.io_delay.lock().unwrap() = Duration::from_millis(300);
        let writer = {
            let store = Arc::clone(store);
            tokio::spawn(async move { store.write(Term(1), 0, block(byte, 4096), false).await })
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while store.floor.try_write().is_ok() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "write never admitted"
            );
            tokio::task::yield_now().await;
        }
        writer
    }

    /// S3: a fence must not return while a write of an older term is still
    /// on its way to the disk. The write is held in its I/O for a while; if
    /// the fence did not drain it, the data would change after the fence.
    /// Many concurrent writes, each to a new extent (a dirty mark and a
    /// metadata flush each), must all finish. sled 0.34's batches take a
    /// process-wide write lock that deadlocks against a concurrent flush;
    /// an NBD client at queue depth 16 hung a node that way.
    /// (A deadlock blocks the runtime's workers, so the watchdog is a plain
    /// thread outside the runtime.)
    #[test]
    fn concurrent_first_writes_to_many_extents_finish() {
        let (done, finished) = std::sync::mpsc::channel();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let outcome = runtime.block_on(async {
                let identity = StoreIdentity {
                    extent_size: 4096,
                    ..identity()
                };
                let store = Arc::new(try_open(&path, identity).await.unwrap());
                let extents = SIZE / 4096;
                for term in (1..=4).map(Term) {
                    let writes = (0..extents).map(|i| {
                        let store = Arc::clone(&store);
                        tokio::spawn(async move {
                            store
                                .write(term, i * 4096, block(i as u8, 4096), i % 2 == 0)
                                .await
                        })
                    });
                    for write in futures::future::join_all(writes).await {
                        write.unwrap().unwrap();
                    }
                }
                store.dirty_extents().unwrap().len() as u64 == 4 * extents
            });
            let _ = done.send(outcome);
        });
        let outcome = finished.recv_timeout(Duration::from_secs(60));
        assert_eq!(outcome, Ok(true), "concurrent writes hung or lost marks");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn fence_drains_in_flight_writes() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(open(dir.path()).await);
        let writer = start_held_write(&store, 0xee).await;
        store.fence(Term(2)).await.unwrap();
        let after_fence = store.read(0, 4096).await.unwrap();
        let written = writer.await.unwrap();
        assert_eq!(written, Ok(()), "the write was admitted before the fence");
        assert_eq!(
            store.read(0, 4096).await.unwrap(),
            after_fence,
            "a write of an older term landed after the fence returned"
        );
        assert_eq!(after_fence, block(0xee, 4096));
    }

    /// S3 with cancellation: dropping the request future must not release
    /// its admission while the I/O is still running.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_cancelled_write_still_holds_off_the_fence() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(open(dir.path()).await);
        let writer = start_held_write(&store, 0xcc).await;
        // Give the blocking task time to start, then cancel the request.
        tokio::time::sleep(Duration::from_millis(20)).await;
        writer.abort();
        let _ = writer.await;
        store.fence(Term(2)).await.unwrap();
        let after_fence = store.read(0, 4096).await.unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(store.read(0, 4096).await.unwrap(), after_fence);
    }

    #[tokio::test]
    async fn digests_tell_equal_and_different_extents_apart() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path()).await;
        let mib = DEFAULT_EXTENT_SIZE;
        let (first, before) = store.digests(0, 3 * mib).await.unwrap();
        assert_eq!((first, before.len()), (0, 3));
        assert_eq!(before[0], before[1], "two zero extents");
        store
            .write(Term(1), mib + 10, block(1, 512), false)
            .await
            .unwrap();
        let (_, after) = store.digests(0, 3 * mib).await.unwrap();
        assert_eq!(after[0], before[0]);
        assert_ne!(after[1], before[1]);
        let (first, one) = store.digests(mib, mib).await.unwrap();
        assert_eq!((first, one), (1, vec![after[1]]));
        // A digest covers its extent up to the end of the request: that
        // is what a copy of another size (one that grew for a resize that
        // never committed) is compared on.
        let (first, part) = store.digests(mib + 5, 6).await.unwrap();
        let mut expected = vec![0u8; 11];
        expected[10] = 1;
        assert_eq!(
            (first, part),
            (1, vec![*blake3::hash(&expected).as_bytes()])
        );
        assert!(matches!(
            store.digests(SIZE, 1).await,
            Err(ReplicaError::Range(_))
        ));
        assert!(matches!(
            store.digests(0, 0).await,
            Err(ReplicaError::InvalidRequest(_))
        ));
        assert!(matches!(
            store.digests(0, (MAX_DIGEST_EXTENTS + 1) * mib).await,
            Err(ReplicaError::Range(_))
        ));
    }

    /// The oracle for digests that skip holes: each extent's digest equals
    /// BLAKE3 of the bytes a read returns, across writes that are not yet
    /// flushed (delayed allocation), zero-filled writes, discards of whole
    /// and partial extents, and extents never written.
    #[tokio::test]
    async fn digests_equal_the_hash_of_what_reads_return() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path()).await;
        let mib = DEFAULT_EXTENT_SIZE;
        let extents = SIZE / mib;
        let check = |when: &'static str| {
            let store = &store;
            async move {
                let (_, digests) = store.digests(0, SIZE).await.unwrap();
                for extent in 0..extents {
                    let bytes = store.read(extent * mib, mib).await.unwrap();
                    assert_eq!(
                        digests[extent as usize],
                        *blake3::hash(&bytes).as_bytes(),
                        "extent {extent} {when}"
                    );
                }
            }
        };
        check("of a new store").await;
        store
            .write(Term(1), mib + 10, block(1, 512), false)
            .await
            .unwrap();
        store
            .write(Term(1), 3 * mib - 1, block(2, 2), false)
            .await
            .unwrap();
        store
            .write(Term(1), 2 * mib, Bytes::from(vec![0u8; 4096]), false)
            .await
            .unwrap();
        check("after writes not yet flushed").await;
        store.flush(Term(1)).await.unwrap();
        check("after a flush").await;
        store.discard(Term(1), mib, mib).await.unwrap();
        store.discard(Term(1), 3 * mib - 1, 1).await.unwrap();
        check("after discards").await;
    }

    /// Once the promotion is over (the new writer clears the older marks),
    /// the snapshot is dropped: a change behind the store's back (bit rot)
    /// is seen by the next digest, as the scrub needs.
    #[tokio::test]
    async fn predigests_are_dropped_once_older_marks_are_cleared() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path()).await;
        let mib = DEFAULT_EXTENT_SIZE;
        store
            .write(Term(1), mib, block(1, 4096), false)
            .await
            .unwrap();
        assert_eq!(store.predigest().await.unwrap(), 1);
        let (_, hashed_ahead) = store.digests(mib, mib).await.unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join(DATA_FILE))
            .unwrap()
            .write_all_at(&[0xee; 16], mib)
            .unwrap();
        assert_eq!(
            store.digests(mib, mib).await.unwrap().1,
            hashed_ahead,
            "served from the snapshot"
        );
        store.clear_dirty_below(Term(2)).await.unwrap();
        let (_, after) = store.digests(mib, mib).await.unwrap();
        let bytes = store.read(mib, mib).await.unwrap();
        assert_eq!(after[0], *blake3::hash(&bytes).as_bytes());
        assert_ne!(after, hashed_ahead, "the rot is seen");
    }

    #[tokio::test]
    async fn predigests_serve_until_the_next_write() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path()).await;
        let mib = DEFAULT_EXTENT_SIZE;
        store
            .write(Term(1), mib, block(1, 4096), false)
            .await
            .unwrap();
        store
            .write(Term(1), 3 * mib, block(3, 4096), false)
            .await
            .unwrap();
        assert_eq!(
            store.predigest().await.unwrap(),
            2,
            "the two marked extents"
        );
        assert_eq!(store.predigest().await.unwrap(), 0, "already current");
        let (_, fresh) = store.digests(mib, mib).await.unwrap();

        // Change the file behind the store's back: the digest served is the
        // one hashed ahead, which shows it is served from there.
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join(DATA_FILE))
            .unwrap()
            .write_all_at(&[0xee; 16], mib)
            .unwrap();
        assert_eq!(store.digests(mib, mib).await.unwrap().1, fresh);
        // An unmarked extent is hashed on the spot.
        let (_, zero) = store.digests(2 * mib, mib).await.unwrap();
        assert_eq!(zero[0], *blake3::hash(&vec![0u8; mib as usize]).as_bytes());

        // Any write through the store ends the snapshot, even to another
        // extent: the changed bytes are hashed again.
        store
            .write(Term(1), 3 * mib, block(4, 4096), false)
            .await
            .unwrap();
        assert_ne!(store.digests(mib, mib).await.unwrap().1, fresh);
    }

    #[tokio::test]
    async fn no_predigest_is_taken_while_a_write_is_in_flight() {
        let dir = tempfile::tempdir().unwrap();
        let store = Arc::new(open(dir.path()).await);
        store
            .write(Term(1), 0, block(1, 4096), false)
            .await
            .unwrap();
        *store.io_delay.lock().unwrap() = Duration::from_millis(300);
        let writing = tokio::spawn({
            let store = Arc::clone(&store);
            async move { store.write(Term(1), 0, block(2, 4096), false).await }
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while store.predigests.quiet().is_some() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the write never began"
            );
            tokio::task::yield_now().await;
        }
        assert_eq!(store.predigest().await.unwrap(), 0);
        writing.await.unwrap().unwrap();
        *store.io_delay.lock().unwrap() = Duration::ZERO;
        assert_eq!(store.predigest().await.unwrap(), 1);
        let (_, now) = store.digests(0, DEFAULT_EXTENT_SIZE).await.unwrap();
        let mut expected = vec![0u8; DEFAULT_EXTENT_SIZE as usize];
        expected[..4096].fill(2);
        assert_eq!(now[0], *blake3::hash(&expected).as_bytes());
    }

    #[tokio::test]
    async fn identity_mismatch_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        drop(open(dir.path()).await);
        let cases = [
            (StoreIdentity::new("c2", "vol0", SIZE), "cluster id"),
            (StoreIdentity::new("c1", "vol1", SIZE), "volume"),
            (
                StoreIdentity {
                    extent_size: 65536,
                    ..identity()
                },
                "extent size",
            ),
        ];
        for (wrong, field) in cases {
            let err = try_open(dir.path(), wrong).await.unwrap_err();
            match err {
                ReplicaError::IdentityMismatch(msg) => assert!(msg.contains(field), "{msg}"),
                other => panic!("expected a mismatch of {field}, got {other:?}"),
            }
        }
        // The right identity still opens.
        drop(open(dir.path()).await);
    }

    /// A volume's name can be reused (delete `db`, create `db`: a new
    /// group), so a store of one group is not the copy of the same name in
    /// another: opening it as another group is refused, both ways, naming
    /// both groups, and changes nothing.
    #[tokio::test]
    async fn a_store_opened_as_another_group_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let of_group = |group| identity().in_group(GroupId(group));
        drop(try_open(dir.path(), of_group(2)).await.unwrap());
        for other in [0, 1, 3] {
            let err = try_open(dir.path(), of_group(other)).await.unwrap_err();
            match err {
                ReplicaError::IdentityMismatch(msg) => assert!(
                    msg.contains("group 2") && msg.contains(&format!("group {other}")),
                    "{msg}"
                ),
                other => panic!("expected a mismatch of group, got {other:?}"),
            }
        }
        let store = try_open(dir.path(), of_group(2)).await.unwrap();
        assert_eq!(store.identity().group, GroupId(2));
        drop(store);
        // And a group-0 store is not another group's either.
        let dir = tempfile::tempdir().unwrap();
        drop(open(dir.path()).await);
        let err = try_open(dir.path(), of_group(1)).await.unwrap_err();
        assert!(matches!(err, ReplicaError::IdentityMismatch(_)), "{err:?}");
    }

    /// While a member's map is open, every change adds its extents first,
    /// durably; a reopened store still has them; another incarnation
    /// replaces the map; a close drops it; a fenced writer can do neither.
    #[tokio::test]
    async fn a_missed_write_map_records_every_change_while_it_is_open() {
        let dir = tempfile::tempdir().unwrap();
        let mib = DEFAULT_EXTENT_SIZE;
        let store = open(dir.path()).await;
        let (x, y) = (NodeId(3), NodeId(4));
        store.write(Term(2), 0, block(1, 512), false).await.unwrap();
        assert_eq!(store.missed(x, 0).unwrap(), None, "no map before it opens");
        store
            .note_missed(Term(2), x, Incarnation(7), &[5])
            .await
            .unwrap();
        store
            .write(Term(2), mib, block(1, 512), false)
            .await
            .unwrap();
        store.discard(Term(2), 2 * mib, 4096).await.unwrap();
        store
            .write(Term(2), mib + 4096, block(2, 512), false)
            .await
            .unwrap();
        let map = store.missed(x, 0).unwrap().unwrap();
        assert_eq!(map.incarnation, Incarnation(7));
        assert_eq!(map.extents, vec![1, 2, 5]);
        assert_eq!(store.missed(x, 2).unwrap().unwrap().extents, vec![2, 5]);
        drop(store);

        let store = open(dir.path()).await;
        assert_eq!(store.missed(x, 0).unwrap().unwrap().extents, vec![1, 2, 5]);
        assert_eq!(store.missed_open().into_keys().collect::<Vec<_>>(), vec![x]);
        // Another member's map starts empty.
        store
            .note_missed(Term(2), y, Incarnation(1), &[])
            .await
            .unwrap();
        store
            .write(Term(2), 6 * mib, block(3, 512), false)
            .await
            .unwrap();
        assert_eq!(store.missed(y, 0).unwrap().unwrap().extents, vec![6]);
        assert_eq!(
            store.missed(x, 0).unwrap().unwrap().extents,
            vec![1, 2, 5, 6]
        );
        // A new incarnation of x: its old map described a copy that is gone.
        store
            .note_missed(Term(2), x, Incarnation(8), &[0])
            .await
            .unwrap();
        let map = store.missed(x, 0).unwrap().unwrap();
        assert_eq!((map.incarnation, map.extents), (Incarnation(8), vec![0]));
        // Refused: past the end, or from a fenced writer.
        assert!(matches!(
            store.note_missed(Term(2), x, Incarnation(8), &[8]).await,
            Err(ReplicaError::InvalidRequest(_))
        ));
        store.fence(Term(3)).await.unwrap();
        assert!(matches!(
            store.note_missed(Term(2), x, Incarnation(8), &[1]).await,
            Err(ReplicaError::StaleTerm { .. })
        ));
        assert!(matches!(
            store.close_missed(Term(2), x).await,
            Err(ReplicaError::StaleTerm { .. })
        ));
        store.close_missed(Term(3), x).await.unwrap();
        assert_eq!(store.missed(x, 0).unwrap(), None);
        store.write(Term(3), 0, block(4, 512), false).await.unwrap();
        drop(store);
        let store = open(dir.path()).await;
        assert_eq!(store.missed(x, 0).unwrap(), None);
        assert_eq!(store.missed(y, 0).unwrap().unwrap().extents, vec![0, 6]);
    }

    #[tokio::test]
    async fn a_replica_grows_durably_and_never_shrinks() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path()).await;
        store.write(Term(2), 0, block(7, 4096), true).await.unwrap();
        // Stamped like a flush: a fenced writer cannot grow it.
        store.fence(Term(3)).await.unwrap();
        assert!(matches!(
            store.grow(Term(2), SIZE * 2).await,
            Err(ReplicaError::StaleTerm { .. })
        ));
        assert!(matches!(
            store.grow(Term(3), SIZE * 2 + 100).await,
            Err(ReplicaError::InvalidRequest(_))
        ));
        assert_eq!(store.size(), SIZE);
        assert_eq!(store.grow(Term(3), SIZE * 2).await, Ok(SIZE * 2));
        // The new range reads as zeroes and takes writes.
        assert_eq!(store.read(SIZE, 512).await.unwrap(), block(0, 512));
        store
            .write(Term(3), SIZE * 2 - 512, block(9, 512), true)
            .await
            .unwrap();
        // Smaller or equal: nothing changes.
        assert_eq!(store.grow(Term(3), SIZE).await, Ok(SIZE * 2));
        drop(store);
        // The growth survives a restart, also when the config still says
        // the size the volume was created with.
        let store = open(dir.path()).await;
        assert_eq!(store.size(), SIZE * 2);
        assert_eq!(store.read(0, 4096).await.unwrap(), block(7, 4096));
        assert_eq!(
            store.read(SIZE * 2 - 512, 512).await.unwrap(),
            block(9, 512)
        );
        drop(store);
        // A larger configured size changes nothing either: only a stamped
        // growth grows a copy.
        let store = try_open(dir.path(), StoreIdentity::new("c1", "vol0", SIZE * 3))
            .await
            .unwrap();
        assert_eq!(store.size(), SIZE * 2);
        assert_eq!(
            std::fs::metadata(dir.path().join(DATA_FILE)).unwrap().len(),
            SIZE * 2
        );
        assert_eq!(store.read(0, 4096).await.unwrap(), block(7, 4096));
    }

    /// Copies of different sizes (one grew for a resize that never
    /// committed) agree on a partial last extent, and a predigest of that
    /// extent taken before a growth is not served after it.
    #[tokio::test]
    async fn digests_go_by_the_request_not_the_copys_size() {
        let mib = DEFAULT_EXTENT_SIZE;
        let odd = 3 * mib + 1536;
        let (a_dir, b_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let a = try_open(a_dir.path(), StoreIdentity::new("c1", "vol0", odd))
            .await
            .unwrap();
        let b = try_open(b_dir.path(), StoreIdentity::new("c1", "vol0", odd))
            .await
            .unwrap();
        for store in [&a, &b] {
            store
                .write(Term(1), 3 * mib, block(4, 512), true)
                .await
                .unwrap();
        }
        assert_eq!(a.predigest().await.unwrap(), 1);
        assert_eq!(a.grow(Term(1), 4 * mib).await, Ok(4 * mib));
        assert_eq!(
            a.digests(0, odd).await.unwrap(),
            b.digests(0, odd).await.unwrap()
        );
        let mut whole = vec![0u8; mib as usize];
        whole[..512].fill(4);
        let (_, grown) = a.digests(3 * mib, mib).await.unwrap();
        assert_eq!(grown, vec![*blake3::hash(&whole).as_bytes()]);
    }

    #[tokio::test]
    async fn a_growth_cut_off_before_it_was_recorded_is_kept_unserved_and_zeroed_by_the_next() {
        let dir = tempfile::tempdir().unwrap();
        drop(open(dir.path()).await);
        // The file was extended and something landed in its tail (it can
        // not, but the store must not rely on that), and then the node died.
        let data = dir.path().join(DATA_FILE);
        let file = std::fs::OpenOptions::new().write(true).open(&data).unwrap();
        file.set_len(SIZE * 4).unwrap();
        file.write_all_at(&[0xee; 512], SIZE).unwrap();
        drop(file);
        // Opening keeps the file and serves the recorded size.
        let store = open(dir.path()).await;
        assert_eq!(store.size(), SIZE);
        assert_eq!(std::fs::metadata(&data).unwrap().len(), SIZE * 4);
        assert!(store.read(SIZE, 512).await.is_err());
        // The next growth serves zeroes past the old end.
        assert_eq!(store.grow(Term(1), SIZE * 2).await, Ok(SIZE * 2));
        assert_eq!(store.read(SIZE, 512).await.unwrap(), block(0, 512));
        assert_eq!(std::fs::metadata(&data).unwrap().len(), SIZE * 2);
    }

    #[tokio::test]
    async fn invalid_identities_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            StoreIdentity::new("", "vol0", SIZE),
            StoreIdentity::new("c1", "", SIZE),
            StoreIdentity::new("c1", "vol0", 0),
            StoreIdentity::new("c1", "vol0", 1000),
            StoreIdentity {
                extent_size: 3000,
                ..identity()
            },
        ];
        for bad in cases {
            assert!(matches!(
                try_open(dir.path(), bad).await,
                Err(ReplicaError::InvalidIdentity(_))
            ));
        }
    }

    #[tokio::test]
    async fn a_foreign_file_or_a_missing_or_resized_data_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(DATA_FILE), b"not a volume").unwrap();
        assert!(matches!(
            try_open(dir.path(), identity()).await,
            Err(ReplicaError::IdentityMismatch(_))
        ));

        let dir = tempfile::tempdir().unwrap();
        drop(open(dir.path()).await);
        let data = dir.path().join(DATA_FILE);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&data)
            .unwrap()
            .set_len(SIZE / 2)
            .unwrap();
        assert!(matches!(
            try_open(dir.path(), identity()).await,
            Err(ReplicaError::IdentityMismatch(_))
        ));
        std::fs::remove_file(&data).unwrap();
        assert!(matches!(
            try_open(dir.path(), identity()).await,
            Err(ReplicaError::Io(_))
        ));
    }

    #[tokio::test]
    async fn a_data_dir_in_use_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let _first = open(dir.path()).await;
        let err = ReplicaStore::open(dir.path(), identity())
            .await
            .unwrap_err();
        assert!(matches!(err, ReplicaError::Io(_)), "{err:?}");
    }

    #[tokio::test]
    async fn bad_requests_are_refused_and_write_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = open(dir.path()).await;
        assert_eq!(
            store.write(Term(0), 0, block(1, 512), false).await,
            Err(ReplicaError::InvalidTerm)
        );
        assert_eq!(store.flush(Term(0)).await, Err(ReplicaError::InvalidTerm));
        assert_eq!(store.fence(Term(0)).await, Err(ReplicaError::InvalidTerm));
        assert_eq!(
            store.write(Term(1), SIZE - 256, block(1, 512), false).await,
            Err(ReplicaError::Range(RangeError::OutOfRange {
                offset: SIZE - 256,
                len: 512,
                size: SIZE
            }))
        );
        assert!(matches!(
            store.read(SIZE, 1).await,
            Err(ReplicaError::Range(RangeError::OutOfRange { .. }))
        ));
        assert!(matches!(
            store.read(0, MAX_REQUEST + 1).await,
            Err(ReplicaError::Range(RangeError::TooLarge { .. }))
        ));
        // Refused requests neither raised the floor nor marked anything.
        assert_eq!(store.floor().await, Term(0));
        assert!(store.dirty_extents().unwrap().is_empty());
        assert_eq!(store.read(SIZE - 512, 512).await.unwrap(), block(0, 512));
    }

    #[tokio::test]
    async fn oversized_writes_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let big = StoreIdentity::new("c1", "vol0", 2 * MAX_REQUEST);
        let store = try_open(dir.path(), big).await.unwrap();
        let data = Bytes::from(vec![1u8; MAX_REQUEST as usize + 512]);
        assert!(matches!(
            store.write(Term(1), 0, data, false).await,
            Err(ReplicaError::Range(RangeError::TooLarge { .. }))
        ));
        assert_eq!(store.read(0, 512).await.unwrap(), block(0, 512));
        assert_eq!(store.floor().await, Term(0));
    }

    #[tokio::test]
    async fn corrupt_metadata_is_an_error_not_a_panic() {
        assert!(decode_dirty(&[0u8; 3]).is_err());
        assert!(decode_u64(&[1, 2], "x").is_err());
        let dir = tempfile::tempdir().unwrap();
        {
            let db = sled::open(dir.path().join(META_DIR)).unwrap();
            let tree = db.open_tree("identity").unwrap();
            tree.insert("cluster_id", "c1").unwrap();
            db.flush().unwrap();
        }
        assert!(matches!(
            try_open(dir.path(), identity()).await,
            Err(ReplicaError::Io(msg)) if msg.contains("incomplete")
        ));
        let dir = tempfile::tempdir().unwrap();
        drop(open(dir.path()).await);
        {
            let db = sled::open(dir.path().join(META_DIR)).unwrap();
            db.open_tree("fence")
                .unwrap()
                .insert(FLOOR_KEY, &[1u8][..])
                .unwrap();
            db.open_tree("identity")
                .unwrap()
                .insert("volume", &[0xffu8][..])
                .unwrap();
            db.flush().unwrap();
        }
        assert!(matches!(
            try_open(dir.path(), identity()).await,
            Err(ReplicaError::Io(_))
        ));
    }
}
