//! Rebuilding a replica online ([`crate::replica::mirror::resync`] drives
//! it; these are its steps).
//!
//! A replica outside the in-sync set can be rebuilt while the volume is
//! written: [`Engine::begin_rebuild`] makes it a write-only member (it
//! receives every write, but its answers do not count for S5), and a
//! barrier waits out the writes that began without it, and it is given the
//! source's missed-write maps of other absent members (see `maps.rs` and
//! [`crate::replica::disk::missed`]). Extents are then compared and copied
//! with [`Engine::copy_extent`] and [`Engine::copy_differing_run`], which
//! hold the extents' stripes exclusively so no write to them interleaves
//! with the copy (S11). [`Engine::finish_rebuild`] marks it joining — from
//! then on a write it fails is not acknowledged — waits out the writes that
//! began before, **flushes the target** (the copies were written without
//! FUA, and the set must not count on bytes a power cut would take; S7),
//! and commits its return through the tracker (S5). A write it failed while
//! rebuilding aborts the rebuild; the replica stays out. A write it fails
//! after its return committed is judged as for any member.
//!
//! No late landing (S3) holds for the target too: a request to it whose
//! outcome was lost is drained by a stamped flush before the comparison
//! begins.

use std::collections::BTreeSet;
use std::sync::Arc;

use super::{Engine, Outcomes, stripes_of};
use crate::ha::InSyncError;
use crate::ids::{NodeId, Term};
use crate::replica::{Replica, ReplicaError};

/// Why a step of a rebuild failed; the rebuild is abandoned and starts
/// again later.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RebuildError {
    /// The engine has no term: this node is not the writer.
    #[error("the engine is not active")]
    Inactive,
    /// No replica of the volume has this id.
    #[error("{0} is not a replica of this volume")]
    Unknown(NodeId),
    /// The replica is in the in-sync set already.
    #[error("{0} is in sync already")]
    InSync(NodeId),
    /// The rebuild failed or was abandoned (a new term, a write that failed
    /// on the target).
    #[error("the rebuild of {0} failed or was abandoned")]
    Abandoned(NodeId),
    /// A write to the target failed while it was rebuilt or rejoined, so it
    /// may lack an acknowledged write.
    #[error("a write to {0} failed during its rebuild")]
    WriteFailed(NodeId),
    /// No in-sync replica is left to copy from.
    #[error("no in-sync replica to copy from")]
    NoSource,
    /// A request to a replica failed.
    #[error("{step} {replica}: {cause}")]
    Replica {
        step: &'static str,
        replica: NodeId,
        cause: ReplicaError,
    },
    /// The return could not be committed.
    #[error(transparent)]
    Commit(#[from] InSyncError),
}

impl RebuildError {
    pub(in crate::replica::mirror) fn replica(
        step: &'static str,
        replica: NodeId,
        cause: ReplicaError,
    ) -> Self {
        Self::Replica {
            step,
            replica,
            cause,
        }
    }
}

/// The most extents one rebuild copy moves in one write (8 MiB of 1 MiB
/// extents: within a request's limit, and within the stripes).
pub const MAX_COPY_RUN: u64 = 8;

impl Engine {
    /// Starts rebuilding `id`: from now on it receives every write. Returns
    /// the term the rebuild runs under, once every write that began without
    /// it has finished.
    pub async fn begin_rebuild(&self, id: NodeId) -> Result<Term, RebuildError> {
        // Its session known first: see `accept_restart` below.
        let target = self.target(id)?;
        target
            .reach()
            .await
            .map_err(|cause| RebuildError::replica("reaching", id, cause))?;
        let term = {
            let mut state = self.lock();
            let term = state.term.ok_or(RebuildError::Inactive)?;
            if self.replicas.get(id).is_none() {
                return Err(RebuildError::Unknown(id));
            }
            if state.in_sync.contains(&id) {
                return Err(RebuildError::InSync(id));
            }
            // A replica whose return's outcome is unknown stays joining (see
            // `finish_rebuild`): its failures keep failing writes.
            let orphans = state.orphan_copies.remove(&id).unwrap_or_default();
            let rebuild = state.rebuilding.entry(id).or_default();
            rebuild.failed = false;
            rebuild.copied.extend(orphans);
            // Out of the set, a restarted copy may be counted on again: the
            // comparison that follows covers what it may have lost (its
            // marks, the maps). Decided here, under the lock that just
            // checked it is out of the set and made it a target, so neither
            // a copy in sync is accepted nor a write fails on it as
            // restarted in between.
            target.accept_restart();
            term
        };
        self.barrier().await;
        // A request to the target whose outcome was lost (see
        // `disown_if_lost`) must not land after the comparison: a flush with
        // the target's current stamp drains it or makes it refused.
        let drained = self
            .stamped(term, &target, |stamp| target.flush(stamp))
            .await;
        if let Err(cause) = drained {
            self.abort_rebuild(id);
            return Err(RebuildError::replica("draining", id, cause));
        }
        self.grow_target(id)
            .await
            .inspect_err(|_| self.abort_rebuild(id))?;
        self.adopt_missed_maps(term, id)
            .await
            .inspect_err(|_| self.abort_rebuild(id))?;
        Ok(term)
    }

    /// Grows the rebuild target `id` to the volume's size, for a copy that
    /// missed a resize. The size is the larger of the one served and the
    /// committed one: a resize whose commit was not confirmed may have
    /// committed all the same, and a copy that joins the in-sync set must
    /// hold every byte a later writer will serve.
    pub async fn grow_target(&self, id: NodeId) -> Result<(), RebuildError> {
        let term = self.lock().term.ok_or(RebuildError::Inactive)?;
        let target = self.target(id)?;
        let committed = self.tracker.volume_size().await?.unwrap_or(0);
        let size = self.current_size().max(committed);
        self.stamped(term, &target, |stamp| target.grow(stamp, size))
            .await
            .map_err(|cause| RebuildError::replica("growing", id, cause))?;
        Ok(())
    }

    /// Compares extent `extent` of the first in-sync replica and `id`
    /// under the extent's stripe, and copies it to `id` when they differ.
    /// Returns the bytes copied.
    pub async fn copy_extent(&self, id: NodeId, extent: u64) -> Result<u64, RebuildError> {
        self.copy_run(id, extent..=extent, true).await
    }

    /// Copies extents `run` (consecutive, at most [`MAX_COPY_RUN`]) of the
    /// first in-sync replica to `id` in one write, under their stripes,
    /// without comparing first: for extents a digest pass just found
    /// different. (A write between that comparison and this copy changes
    /// nothing: the copy is taken under the stripes, so it is the source's
    /// extents as they are then.) One write also means one S6 mark flush
    /// on the target for the whole run. Returns the bytes copied.
    pub async fn copy_differing_run(
        &self,
        id: NodeId,
        run: std::ops::RangeInclusive<u64>,
    ) -> Result<u64, RebuildError> {
        self.copy_run(id, run, false).await
    }

    async fn copy_run(
        &self,
        id: NodeId,
        run: std::ops::RangeInclusive<u64>,
        compare: bool,
    ) -> Result<u64, RebuildError> {
        let (first, last) = (*run.start(), *run.end());
        if last < first || last - first >= MAX_COPY_RUN {
            return Err(RebuildError::replica(
                "copying to",
                id,
                ReplicaError::InvalidRequest(format!("a run of extents {first}..={last}")),
            ));
        }
        let stripes = stripes_of(first, last);
        let mut _exclusive = Vec::with_capacity(stripes.len());
        for stripe in stripes {
            _exclusive.push(self.stripes[stripe as usize].write().await);
        }
        let term = self.term().ok_or(RebuildError::Inactive)?;
        if self.rebuild_failed(id) {
            return Err(RebuildError::Abandoned(id));
        }
        let source = self.rebuild_source()?;
        let target = self.target(id)?;
        let offset = first * self.extent_size;
        let size = self.current_size();
        if offset >= size {
            return Ok(0);
        }
        let len = ((last - first + 1) * self.extent_size).min(size - offset);
        if compare {
            let (a, b) = futures::join!(source.digests(offset, len), target.digests(offset, len));
            let a = a.map_err(|e| RebuildError::replica("digesting", source.id(), e))?;
            let b = b.map_err(|e| RebuildError::replica("digesting", id, e))?;
            if a == b {
                return Ok(0);
            }
        }
        let data = source
            .read(offset, len)
            .await
            .map_err(|e| RebuildError::replica("reading", source.id(), e))?;
        let written = self
            .stamped(term, &target, |stamp| {
                target.write(stamp, offset, data, false)
            })
            .await;
        written.map_err(|e| RebuildError::replica("writing", id, e))?;
        if let Some(rebuild) = self.lock().rebuilding.get_mut(&id) {
            rebuild.copied.extend(first..=last);
        }
        Ok(len)
    }

    /// Commits the return of `id` to the in-sync set, once no write it
    /// failed could have been acknowledged without it.
    pub async fn finish_rebuild(&self, id: NodeId) -> Result<(), RebuildError> {
        let term = {
            let mut state = self.lock();
            let term = state.term.ok_or(RebuildError::Inactive)?;
            let rebuild = state
                .rebuilding
                .get_mut(&id)
                .ok_or(RebuildError::Abandoned(id))?;
            rebuild.joining = true;
            term
        };
        // Writes that began before `joining` may have been acknowledged
        // without it; wait for them, then check none failed on it.
        self.barrier().await;
        if self.rebuild_failed(id) {
            self.abort_rebuild(id);
            return Err(RebuildError::WriteFailed(id));
        }
        // S5 and S7: the copies were written without FUA; make them durable
        // on the target before the set counts on it.
        let target = self.target(id).inspect_err(|_| self.abort_rebuild(id))?;
        let flushed = self
            .stamped(term, &target, |stamp| target.flush(stamp))
            .await;
        if let Err(cause) = flushed {
            self.abort_rebuild(id);
            return Err(RebuildError::replica("flushing", id, cause));
        }
        let ids: BTreeSet<NodeId> = [id].into();
        // In-sync changes are serialized with the acknowledgement decisions
        // of [`Engine::settle`], and with resizes: a resize that committed
        // meanwhile did not grow this copy.
        let _serialized = self.shrink.lock().await;
        // Abandoned while this waited (the copy left the set for good, see
        // `leave_in_sync`): it must not return.
        if !self.lock().rebuilding.contains_key(&id) {
            return Err(RebuildError::Abandoned(id));
        }
        self.grow_target(id)
            .await
            .inspect_err(|_| self.abort_rebuild(id))?;
        let committed = match self.tracker.add(term, &ids).await {
            Ok(committed) => committed,
            Err(err) => {
                // The outcome is unknown: the entry may still commit (under
                // a successor). If the committed set already holds it, take
                // it in. Otherwise settle it the other way: commit its
                // removal, which lands after the return if both commit. Only
                // if that fails too does it stay a joining write-only member
                // — it gets every write, and one it fails is not
                // acknowledged (the gate holds such writes) — until this
                // activation ends.
                match self.tracker.in_sync().await {
                    Ok(now) if now.contains(&id) => {
                        let mut state = self.lock();
                        state.rebuilding.remove(&id);
                        state.in_sync = now;
                    }
                    _ => match self.tracker.remove(term, &ids).await {
                        Ok(now) => {
                            let mut state = self.lock();
                            state.rebuilding.remove(&id);
                            state.in_sync = now;
                        }
                        Err(_) => {
                            if let Some(rebuild) = self.lock().rebuilding.get_mut(&id) {
                                rebuild.failed = true;
                            }
                        }
                    },
                }
                return Err(err.into());
            }
        };
        let failed_meanwhile = {
            let mut state = self.lock();
            let rebuild = state.rebuilding.remove(&id).unwrap_or_default();
            state.in_sync = committed;
            // The copies are durable on it now (flushed above), and equal on
            // every member: their marks can be retired like a write's.
            state.activity.done.extend(rebuild.copied);
            rebuild.failed
        };
        if failed_meanwhile {
            // A write it failed while joining was not acknowledged; drop it
            // again before it serves as a full copy.
            let committed = self.tracker.remove(term, &ids).await?;
            self.lock().in_sync = committed;
            return Err(RebuildError::WriteFailed(id));
        }
        // Its marks. Those of older terms are stale: the rebuild compared
        // with an in-sync copy every extent it may differ in (its own
        // marks among them), and those copies converged at this term's
        // promotion. Those of this term (copies of an abandoned
        // attempt, writes it took while it was out) name extents that agree
        // now: retire them like a write's. A fence at this term reads them
        // and changes nothing else (the floor is already past it). Best
        // effort: a mark too many costs only a copy at the next promotion.
        match self.bounded(target.id(), target.fence(term)).await {
            Ok(reply) => {
                let mut state = self.lock();
                let extents: Vec<u64> = reply
                    .dirty
                    .iter()
                    .filter(|m| m.term == term)
                    .map(|m| m.extent)
                    .filter(|e| !state.activity.unsure.contains(e))
                    .collect();
                state.activity.done.extend(extents);
            }
            Err(err) => tracing::debug!(replica = %id, %err, "could not read its marks"),
        }
        if let Err(err) = self
            .bounded(target.id(), target.clear_dirty_below(term))
            .await
        {
            tracing::debug!(replica = %id, %err, "could not clear older marks");
        }
        // Invariant M: back in sync, it needs no map any more.
        self.close_maps_of_returned(term, id).await;
        tracing::info!(%term, replica = %id, "replica back in the in-sync set");
        Ok(())
    }

    /// Stops rebuilding `id` (it stays out of the in-sync set).
    pub fn abort_rebuild(&self, id: NodeId) {
        let mut state = self.lock();
        if let Some(rebuild) = state.rebuilding.remove(&id) {
            state
                .orphan_copies
                .entry(id)
                .or_default()
                .extend(rebuild.copied);
        }
    }

    /// Spoils a running rebuild of `id` as a failed write to it would: it
    /// does not return (or, if its return is committing, is dropped again),
    /// and the next attempt starts afresh.
    pub fn spoil_rebuild(&self, id: NodeId) {
        if let Some(rebuild) = self.lock().rebuilding.get_mut(&id) {
            rebuild.failed = true;
        }
    }

    /// Whether a write to `id` failed since its rebuild began (or it is no
    /// longer being rebuilt).
    pub fn rebuild_failed(&self, id: NodeId) -> bool {
        self.lock().rebuilding.get(&id).is_none_or(|r| r.failed)
    }

    /// Records failures on replicas still being rebuilt: the rebuild is
    /// spoiled, and a failure on a joining replica fails the request
    /// (returned as the replica's id). A replica whose return has already
    /// committed is a member by now, and [`Engine::settle`] judges it.
    pub(super) fn note_rebuilt(&self, outcomes: &Outcomes) -> Option<NodeId> {
        let mut joining_failed = None;
        let mut state = self.lock();
        for (id, outcome) in outcomes {
            let (Err(err), Some(rebuild)) = (outcome, state.rebuilding.get_mut(id)) else {
                continue;
            };
            if !rebuild.failed {
                tracing::warn!(replica = %id, %err, "a write to a replica being rebuilt failed");
            }
            rebuild.failed = true;
            if rebuild.joining {
                joining_failed = Some(*id);
            }
        }
        joining_failed
    }

    /// Where a rebuild copies from and reads the missed-write maps of: the
    /// first in-sync replica in read order (this node's own while it is in
    /// sync).
    pub(super) fn rebuild_source(&self) -> Result<Arc<dyn Replica>, RebuildError> {
        self.read_order()
            .into_iter()
            .next()
            .ok_or(RebuildError::NoSource)
    }

    /// The replica `id`, as the target of a rebuild step.
    pub(super) fn target(&self, id: NodeId) -> Result<Arc<dyn Replica>, RebuildError> {
        self.replica(id).ok_or(RebuildError::Unknown(id))
    }
}
