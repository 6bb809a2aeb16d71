//! The engine's membership and size: replicas added to and removed from the
//! volume's replica set, a replica taken out of the in-sync set for good,
//! and the volume grown on every copy before its new size is served.
//!
//! Invariants kept here:
//! - **S5.** A replica leaves the in-sync set only through a committed
//!   removal on behalf of the active term ([`Engine::leave_in_sync`]), and
//!   the engine's own view follows at once, so no write is acknowledged
//!   without it before. A new copy under a known id (a replaced disk) is
//!   refused while the old one is in the set or being rebuilt: it must not
//!   inherit the old copy's standing (S8), and returns only through a
//!   rebuild.
//! - **Growth before commit.** [`Engine::resize`] grows every replica that
//!   is or may be in the committed in-sync set (stamped like a flush, S2)
//!   before the new size is committed, and serves the size only after the
//!   commit. It holds the same lock as the in-sync changes, so no replica
//!   joins the set meanwhile without having grown.

use std::collections::BTreeSet;
use std::sync::Arc;

use futures::future::join_all;

use super::Engine;
use crate::ha::InSyncError;
use crate::ids::NodeId;
use crate::replica::mirror::set::{ReplicaSet, SetError};
use crate::replica::{Replica, ReplicaError};

/// Why a replica could not be added to or removed from the volume.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MembershipError {
    /// The replica set refused the change.
    #[error(transparent)]
    Set(#[from] SetError),
    /// A replica of this id is in the in-sync set; remove it first.
    #[error("replica {0} is in the in-sync set")]
    InSync(NodeId),
    /// A replica of this id is being rebuilt; remove it first.
    #[error("replica {0} is being rebuilt")]
    Rebuilding(NodeId),
    /// Removing it would leave fewer in-sync members than `min_in_sync`.
    #[error("only {remaining} in-sync replicas would remain; {need} are needed")]
    TooFew { remaining: usize, need: usize },
    /// Removing an in-sync replica needs the active writer's term.
    #[error("the engine is not active")]
    Inactive,
    /// The in-sync set could not be read or changed.
    #[error(transparent)]
    Commit(#[from] InSyncError),
}

/// Why a replica leaves the in-sync set through [`Engine::leave_in_sync`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Leaving {
    /// Its node leaves the cluster: refused below `min_in_sync`.
    Cluster,
    /// Its node's disk was replaced: goes on below `min_in_sync` (not below
    /// one), since the copy is lost either way and only its rebuild brings
    /// one back.
    Replaced,
}

/// The largest volume size a resize accepts (1 EiB): a file system's
/// files are limited to `i64::MAX` bytes.
pub const MAX_VOLUME_SIZE: u64 = 1 << 60;

/// Why the volume could not be resized. Nothing is committed, except
/// perhaps by [`ResizeError::Uncommitted`], whose outcome is unknown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResizeError {
    /// A volume only grows.
    #[error(
        "the volume is {now} bytes; it cannot shrink to {asked} bytes (a volume only grows: \
         copy the data to a smaller volume instead)"
    )]
    Shrink { now: u64, asked: u64 },
    /// Not a size a volume can have.
    #[error("a volume size must be a positive multiple of 512 bytes of at most 1 EiB, not {0}")]
    Invalid(u64),
    /// The engine has no term: this node is not the writer.
    #[error("this node is not the active writer; only the writer resizes (ask the leader)")]
    Inactive,
    /// An in-sync replica could not grow.
    #[error("replica {id} could not grow: {cause}; the volume stays {now} bytes")]
    Replica {
        id: NodeId,
        cause: ReplicaError,
        now: u64,
    },
    /// An in-sync replica is not in this engine's replica set.
    #[error(
        "in-sync replica {id} is not in the writer's replica set; the volume stays {now} bytes"
    )]
    Missing { id: NodeId, now: u64 },
    /// Raft refused the new size (this node is not the recorded writer, or
    /// the size is below the committed one); nothing changed.
    #[error("the new size was refused: {cause}; the volume stays {now} bytes")]
    Refused { cause: InSyncError, now: u64 },
    /// The new size may or may not have committed (no quorum, a newer
    /// leader): every in-sync copy has grown, so asking again for the same
    /// size is safe.
    #[error(
        "the new size was not confirmed: {cause}; it may have committed (ask again for the same \
         size; the volume is at least {now} bytes)"
    )]
    Uncommitted { cause: InSyncError, now: u64 },
}

impl Engine {
    /// Grows the volume to `size` bytes: every in-sync replica grows its
    /// copy (and so does each one being rebuilt, or its rebuild fails),
    /// then the new size is committed, and only then is it served. In-sync
    /// changes wait meanwhile, so no replica joins the set without having
    /// grown. Returns the size served afterwards.
    pub async fn resize(&self, size: u64) -> Result<u64, ResizeError> {
        if size == 0 || size % 512 != 0 || size > MAX_VOLUME_SIZE {
            return Err(ResizeError::Invalid(size));
        }
        let _serialized = self.shrink.lock().await;
        // The size committed may be larger than the one served: a resize
        // whose answer was lost.
        let committed_size =
            self.tracker
                .volume_size()
                .await
                .map_err(|cause| ResizeError::Uncommitted {
                    cause,
                    now: self.current_size(),
                })?;
        let now = self.current_size().max(committed_size.unwrap_or(0));
        let (term, mut must_grow, rebuilding) = {
            let state = self.lock();
            let term = state.term.ok_or(ResizeError::Inactive)?;
            // A replica whose return is committing, or whose outcome was
            // lost, may be in the committed set: it must grow like a member.
            let joining = state.rebuilding.iter().filter(|(_, r)| r.joining);
            let must_grow: BTreeSet<NodeId> = state
                .in_sync
                .iter()
                .copied()
                .chain(joining.map(|(id, _)| *id))
                .collect();
            let rebuilding: BTreeSet<NodeId> = state.rebuilding.keys().copied().collect();
            (term, must_grow, rebuilding)
        };
        if size < now {
            return Err(ResizeError::Shrink { now, asked: size });
        }
        let committed_set = self
            .tracker
            .in_sync()
            .await
            .map_err(|cause| ResizeError::Uncommitted { cause, now })?;
        must_grow.extend(committed_set);
        // Every replica that is or may be in the committed set must grow
        // before the size is committed; one the set lacks cannot, so the
        // resize fails rather than commit a size that an in-sync copy does
        // not have.
        let mut targets: Vec<Arc<dyn Replica>> = Vec::new();
        for id in &must_grow {
            let replica = self
                .replica(*id)
                .ok_or(ResizeError::Missing { id: *id, now })?;
            targets.push(replica);
        }
        targets.extend(
            rebuilding
                .difference(&must_grow)
                .filter_map(|id| self.replica(*id)),
        );
        let grown = join_all(targets.iter().map(|replica| async move {
            let outcome = self
                .stamped(term, replica, |stamp| replica.grow(stamp, size))
                .await;
            (replica.id(), outcome)
        }))
        .await;
        for (id, outcome) in grown {
            let Err(cause) = outcome else { continue };
            if must_grow.contains(&id) {
                return Err(ResizeError::Replica { id, cause, now });
            }
            tracing::warn!(replica = %id, %cause, "a replica being rebuilt could not grow");
            if let Some(rebuild) = self.lock().rebuilding.get_mut(&id) {
                rebuild.failed = true;
            }
        }
        self.tracker
            .resize(term, size)
            .await
            .map_err(|cause| match cause {
                InSyncError::Refused(_) => ResizeError::Refused { cause, now },
                InSyncError::Uncommitted(_) => ResizeError::Uncommitted { cause, now },
            })?;
        self.size
            .fetch_max(size, std::sync::atomic::Ordering::AcqRel);
        tracing::info!(%term, from = now, to = size, "volume resized");
        Ok(size)
    }

    /// The replica set this engine writes to.
    pub fn replica_set(&self) -> &Arc<ReplicaSet> {
        &self.replicas
    }

    /// Adds `replica` to the replica set. It gets the writes that start
    /// from now on only once a rebuild begins, and joins the in-sync set
    /// only through a finished rebuild. Refused while a replica of the same
    /// id is in the committed in-sync set or being rebuilt: a new copy
    /// (a replaced disk) must not inherit the old one's standing (S5).
    pub async fn add_replica(&self, replica: Arc<dyn Replica>) -> Result<(), MembershipError> {
        let _serialized = self.shrink.lock().await;
        let id = replica.id();
        let committed = self.tracker.in_sync().await?;
        {
            let state = self.lock();
            if committed.contains(&id) || state.in_sync.contains(&id) {
                return Err(MembershipError::InSync(id));
            }
            if state.rebuilding.contains_key(&id) {
                return Err(MembershipError::Rebuilding(id));
            }
        }
        self.replicas.add(replica)?;
        Ok(())
    }

    /// Removes replica `id` from the replica set. While it is in the
    /// in-sync set, its removal from that set is committed first (see
    /// [`Engine::leave_in_sync`]). A rebuild of it is abandoned.
    pub async fn remove_replica(&self, id: NodeId) -> Result<Arc<dyn Replica>, MembershipError> {
        self.leave_in_sync(id, Leaving::Cluster).await?;
        let removed = self.replicas.remove(id)?;
        Ok(removed)
    }

    /// Takes replica `id` out of the in-sync set for good: the removal is
    /// committed on behalf of the active term, so no write is acknowledged
    /// without it before (S5), and this engine's own view follows at once.
    /// A rebuild of it is abandoned. No missed-write map is opened: the
    /// copy comes back only through a full rebuild.
    ///
    /// `why` says how far the set may shrink. A node that leaves the
    /// cluster is refused if fewer than `min_in_sync` members would remain.
    /// A replaced node's copy is gone whatever is decided here, so its
    /// removal goes on below `min_in_sync`: writes are then held (C2)
    /// until the rebuild brings the new incarnation back. Either way the
    /// view never goes on naming a node the committed set dropped: were it
    /// to, its new incarnation, empty, would take writes and count for S5
    /// (S8), and a set below `min_in_sync` would acknowledge them.
    pub async fn leave_in_sync(&self, id: NodeId, why: Leaving) -> Result<(), MembershipError> {
        let _serialized = self.shrink.lock().await;
        let (term, in_sync) = {
            let state = self.lock();
            (state.term, state.in_sync.clone())
        };
        let committed = self.tracker.in_sync().await?;
        if committed.contains(&id) || in_sync.contains(&id) {
            let remaining = committed.iter().filter(|m| **m != id).count();
            let need = match why {
                Leaving::Cluster => self.config.volume.min_in_sync,
                // A copy to rebuild the new incarnation from.
                Leaving::Replaced => 1,
            };
            if remaining < need {
                return Err(MembershipError::TooFew { remaining, need });
            }
            let term = term.ok_or(MembershipError::Inactive)?;
            let ids: BTreeSet<NodeId> = [id].into();
            let now = self.tracker.remove(term, &ids).await?;
            let mut state = self.lock();
            state.in_sync = now;
            state.degraded.remove(&id);
        }
        self.abort_rebuild(id);
        Ok(())
    }
}
