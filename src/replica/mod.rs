//! The data plane: copies of the volume and the engine that mirrors to them.
//!
//! Four wings, one per side of the wire, as Crucible splits its upstairs,
//! downstairs and protocol:
//!
//! - [`disk`]: one node's copy on disk. Its store enforces the fencing
//!   token (S2), drains older writes on a fence (S3), records the extents
//!   each term touched (S6) and makes its metadata durable before it
//!   answers (S7).
//! - [`serve`]: that copy served to the writer: the block channel and the
//!   replica gRPC service (S2, S3 and S8 hold over the wire).
//! - [`peer`]: the writer's client of another node's copy.
//! - [`mirror`]: the writer's side: the engine (S5, S11), the replica set
//!   and quorum rules, the fencer (S1, S6), resync (C4) and scrub (S11).
//!
//! Beside them: the [`Replica`] seam the engine writes through
//! ([`disk::local::LocalReplica`] calls a store in-process; [`peer::remote`] reaches a
//! peer's), [`Stamp`], [`ReplicaError`] and [`wire`], the one mapping of
//! that error to the wire and back. The in-sync set is changed only
//! through the core's [`crate::ha::InSyncTracker`]: the engine may
//! acknowledge a write that skipped a replica only after its removal was
//! committed (S5).

pub mod disk;
pub mod mirror;
pub mod peer;
pub mod serve;
pub mod wire;

use std::sync::Mutex;

use async_trait::async_trait;
use bytes::Bytes;

pub use crate::ids::Stamp;
use crate::ids::{Incarnation, NodeId, Term};
use crate::volume::RangeError;
use std::collections::BTreeMap;

/// One absent member's map, as a store returns it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MissedMap {
    /// The incarnation of the member's data dir the map is about.
    pub incarnation: Incarnation,
    /// The extents, ascending, from the page's start.
    pub extents: Vec<u64>,
    /// Whether more extents follow (ask again from the last one plus one).
    pub more: bool,
    /// Where the member's unverified range begins, while a full rebuild
    /// of it has not compared every extent: it may differ in every extent
    /// from this one on, besides those listed.
    pub unverified_from: Option<u64>,
}

/// A change to a map's unverified range (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unverified {
    /// The member may differ from extent `.0` on: the range begins there
    /// or earlier. Opens the map if it is not open (and replaces one of
    /// another incarnation).
    Lower(u64),
    /// A full rebuild compared and copied every extent below `.0`, and the
    /// member flushed them: the range begins there or later. Nothing
    /// happens unless the map is open, about this incarnation, with a
    /// range.
    Raise(u64),
}

impl Unverified {
    /// The range after this change, from `current` (the range of a map
    /// open about the same incarnation; `None` for none, or no such map),
    /// or `None` when the change does nothing.
    pub fn apply(self, open: bool, current: Option<u64>) -> Option<Option<u64>> {
        match (self, open, current) {
            (Unverified::Lower(from), _, None) => Some(Some(from)),
            (Unverified::Lower(from), _, Some(now)) if from < now => Some(Some(from)),
            (Unverified::Raise(to), true, Some(now)) if to > now => Some(Some(to)),
            _ => None,
        }
    }
}

/// What the fencer found and left at its last fence, shared with the engine
/// of the same node:
/// - the floors, by replica id: an activation stamps each replica's first
///   request one generation above what the fencer used there, so a copy of
///   the fence still on its way is drained or refused (no late landing);
/// - the extents its convergence copied: the copies marked them with the
///   new term on their targets, and the writer retires those marks with
///   its own once a flush made the copies durable (see
///   `Engine::retire_marks`).
#[derive(Debug, Default)]
pub struct FloorBook {
    floors: Mutex<std::collections::BTreeMap<NodeId, Stamp>>,
    copied: Mutex<(Term, std::collections::BTreeSet<u64>)>,
}

impl FloorBook {
    /// Records that replica `id`'s floor is `floor`.
    pub fn note(&self, id: NodeId, floor: Stamp) {
        lock(&self.floors).insert(id, floor);
    }

    /// The recorded floors of `term`.
    pub fn of_term(&self, term: Term) -> Vec<(NodeId, Stamp)> {
        lock(&self.floors)
            .iter()
            .filter(|(_, stamp)| stamp.term == term)
            .map(|(id, stamp)| (*id, *stamp))
            .collect()
    }

    /// Records that the convergence of `term` copied `extents`.
    pub fn note_copied(&self, term: Term, extents: impl IntoIterator<Item = u64>) {
        let mut copied = lock(&self.copied);
        if copied.0 != term {
            *copied = (term, Default::default());
        }
        copied.1.extend(extents);
    }

    /// Takes the extents the convergence of `term` copied.
    pub fn take_copied(&self, term: Term) -> std::collections::BTreeSet<u64> {
        let mut copied = lock(&self.copied);
        if copied.0 != term {
            return Default::default();
        }
        std::mem::take(&mut copied.1)
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// An extent that a writer of `term` may have written without an
/// acknowledgement reaching every replica; promotion makes it identical on
/// all in-sync replicas (S6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DirtyExtent {
    /// The term of the writer that touched it.
    pub term: Term,
    /// The extent's index (byte offset / extent size).
    pub extent: u64,
}

/// What a replica answers to `fence(T)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceReply {
    /// The replica's durable fence floor after the fence (≥ T on success).
    pub floor: Term,
    /// The floor's generation within its term (see [`Stamp`]): requests of
    /// the fencer at the floor's term must carry at least this one.
    pub generation: u64,
    /// Every extent still marked dirty, of any term.
    pub dirty: Vec<DirtyExtent>,
    /// The extent size the marks are counted in.
    pub extent_size: u64,
    /// The store's session ([`disk::store::ReplicaStore::session`]); 0 from a
    /// replica that does not say.
    pub session: u64,
}

/// What a replica reports about itself, for status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicaInfo {
    /// Its durable fence floor.
    pub floor: Term,
    /// The floor's generation within its term (see [`Stamp`]).
    pub generation: u64,
    /// How many (term, extent) dirty marks it holds.
    pub dirty_extents: u64,
    /// Requests it admitted below its fence floor (the S2 audit; always 0
    /// outside the deliberately broken test build).
    pub stale_accepts: u64,
    /// Extents a write, discard or copy had to mark itself since the
    /// replica started, each after a metadata flush (S6's first-touch cost;
    /// marks ahead and a hot extent's kept mark spare it). Two writes that
    /// mark the same extent at once may both count it.
    pub first_touch_marks: u64,
}

/// Errors of the replica layer: the store, and any transport to it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplicaError {
    /// The term is below the replica's durable fence floor (S2).
    #[error("stale term {term}: fence floor is {floor}")]
    StaleTerm { term: Term, floor: Term },
    /// The writer disowned this request's generation (see [`Stamp`]): a
    /// later request of the same term already reached the replica.
    #[error("stale generation {stamp}: the replica's floor is {floor}")]
    StaleGeneration { stamp: Stamp, floor: Stamp },
    /// The request is malformed or asks for more than is allowed.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// Term 0 is never a valid writer's term.
    #[error("term 0 is not a valid writer term")]
    InvalidTerm,
    /// The request's shape is refused.
    #[error(transparent)]
    Range(#[from] RangeError),
    /// The identity given to open a store is not usable.
    #[error("invalid replica identity: {0}")]
    InvalidIdentity(String),
    /// The store on disk belongs to another cluster, volume or size.
    #[error("identity mismatch: {0}")]
    IdentityMismatch(String),
    /// The replica could not be reached, or did not answer in time.
    #[error("replica unavailable: {0}")]
    Unavailable(String),
    /// The replica restarted since the writer began to count on it: writes
    /// it took and had not flushed may be gone, so it is not counted until
    /// a rebuild has compared it (see [`Replica::accept_restart`]). Found
    /// by the writer's side of the block channel; never sent on the wire.
    #[error("replica restarted: {0}")]
    Restarted(String),
    /// The replica's disk or metadata failed.
    #[error("replica I/O error: {0}")]
    Io(String),
}

impl From<std::io::Error> for ReplicaError {
    fn from(err: std::io::Error) -> Self {
        ReplicaError::Io(err.to_string())
    }
}

impl From<sled::Error> for ReplicaError {
    fn from(err: sled::Error) -> Self {
        ReplicaError::Io(format!("metadata: {err}"))
    }
}

/// One copy of the volume, as the engine and the fencer see it.
#[async_trait]
pub trait Replica: Send + Sync {
    /// The id of the node that holds this copy.
    fn id(&self) -> NodeId;

    /// Opens a connection to this copy if none is open, so that its
    /// current session is known (see [`Replica::accept_restart`]).
    async fn reach(&self) -> Result<(), ReplicaError> {
        Ok(())
    }

    /// Counts on this copy's current session from now on: requests failed
    /// as [`ReplicaError::Restarted`] since it restarted go on, and a
    /// restart after this call is noticed again. The engine calls it, after
    /// [`Replica::reach`], only for a copy out of the in-sync set, in the
    /// same step that makes it a rebuild target (so no write fails on it
    /// as restarted in between); the rebuild then compares what the copy
    /// may have lost. A copy that cannot restart under the writer (one in
    /// this process) has nothing to do.
    fn accept_restart(&self) {}

    /// Counts on this copy as of store session `session` (0: unknown; the
    /// next block connection then sets it), forgetting any restart seen
    /// before. A new writer's fence calls it for every copy that took the
    /// fence: the promotion's convergence then compares what each copy
    /// holds now, and a restart after the fence is noticed. Without it a
    /// writer would judge a copy by the session it saw in an earlier term
    /// (and stall its fence on a restart the promotion handles anyway), or
    /// trust whatever session its first connection found.
    fn count_on_session(&self, _session: u64) {}

    /// Which parts of `[offset, offset + len)` of this copy hold data and
    /// which are holes (see [`crate::volume::Device::allocation`]). The
    /// default, for a copy that cannot say, knows of no holes.
    async fn allocation(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<Vec<crate::volume::Extent>, ReplicaError> {
        let _ = offset;
        Ok(vec![crate::volume::Extent { len, hole: false }])
    }
    /// Writes `data` at `offset` on behalf of the writer of `stamp`.
    async fn write(
        &self,
        stamp: Stamp,
        offset: u64,
        data: Bytes,
        fua: bool,
    ) -> Result<(), ReplicaError>;
    /// Discards `[offset, offset+len)` on behalf of the writer of `stamp`:
    /// it reads back as zeroes, and its space is freed.
    async fn discard(&self, stamp: Stamp, offset: u64, len: u64) -> Result<(), ReplicaError>;
    /// Marks the extents of `[offset, offset+len)` for the writer of
    /// `stamp` before it writes them (see [`disk::store::ReplicaStore::mark_ahead`]).
    async fn mark_ahead(&self, stamp: Stamp, offset: u64, len: u64) -> Result<(), ReplicaError>;
    /// Reads `len` bytes at `offset`.
    async fn read(&self, offset: u64, len: u64) -> Result<Bytes, ReplicaError>;
    /// Makes the writes that finished before it durable, on behalf of the
    /// writer of `stamp`.
    async fn flush(&self, stamp: Stamp) -> Result<(), ReplicaError>;
    /// Grows this copy to `size` bytes on behalf of the writer of `stamp`
    /// (a resize, or a rebuild of a copy that missed one) and returns its
    /// size afterwards; a copy at least that large stays as it is.
    async fn grow(&self, stamp: Stamp, size: u64) -> Result<u64, ReplicaError>;
    /// Raises the fence floor to `term` and drains older writes (S3).
    async fn fence(&self, term: Term) -> Result<FenceReply, ReplicaError>;
    /// Drops the dirty marks of terms below `term` (after convergence, S6).
    async fn clear_dirty_below(&self, term: Term) -> Result<(), ReplicaError>;
    /// Drops the marks of terms up to `through` on `extents`, for the
    /// writer of `stamp`, once they are durable on every in-sync replica
    /// (see [`disk::store::ReplicaStore::retire_marks`]). Returns how many were dropped.
    async fn retire_marks(
        &self,
        stamp: Stamp,
        through: Term,
        extents: &[u64],
    ) -> Result<usize, ReplicaError>;
    /// Its fence floor and dirty-mark count.
    async fn info(&self) -> Result<ReplicaInfo, ReplicaError>;
    /// BLAKE3 digests of the extents that `[offset, offset+len)` covers:
    /// the index of the first extent and one digest per extent, each of
    /// its bytes from the extent's start up to the end of the request.
    async fn digests(&self, offset: u64, len: u64) -> Result<(u64, Vec<Bytes>), ReplicaError>;
    /// Opens the missed-write map of member `node` (about `incarnation`)
    /// if it is not open, and adds `extents`, on behalf of the writer of
    /// `stamp` (see [`disk::missed`]).
    async fn note_missed(
        &self,
        stamp: Stamp,
        node: NodeId,
        incarnation: Incarnation,
        extents: &[u64],
    ) -> Result<(), ReplicaError>;
    /// One page of member `node`'s missed-write map from extent `from`;
    /// `None` when no map of it is open.
    async fn missed(&self, node: NodeId, from: u64) -> Result<Option<MissedMap>, ReplicaError>;
    /// The members this copy keeps an open missed-write map of.
    async fn missed_maps(&self) -> Result<BTreeMap<NodeId, Incarnation>, ReplicaError>;
    /// Closes member `node`'s missed-write map, on behalf of the writer of
    /// `stamp`.
    async fn close_missed(&self, stamp: Stamp, node: NodeId) -> Result<(), ReplicaError>;
    /// Changes the unverified range of member `node`'s missed-write map
    /// (about `incarnation`), on behalf of the writer of `stamp`.
    async fn set_unverified(
        &self,
        stamp: Stamp,
        node: NodeId,
        incarnation: Incarnation,
        change: Unverified,
    ) -> Result<(), ReplicaError>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_and_metadata_errors_become_replica_io_errors() {
        let io = std::io::Error::other("disk on fire");
        assert_eq!(
            ReplicaError::from(io),
            ReplicaError::Io("disk on fire".into())
        );
        let sled = sled::Error::Unsupported("nope".into());
        assert!(
            matches!(ReplicaError::from(sled), ReplicaError::Io(m) if m.starts_with("metadata"))
        );
    }
}
