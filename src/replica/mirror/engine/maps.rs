//! The writer's side of the missed-write maps (C4, invariant M; the maps
//! themselves are kept by each store, see [`crate::replica::disk::missed`]).
//!
//! While a member is out of the in-sync set, every replica that stays keeps
//! a durable map of the extents it changed, so a rebuild compares only
//! those. The engine keeps invariant M by these rules, each a method here:
//! - a member being dropped has its map opened on every replica that stays
//!   before its removal commits, and every write still in flight is noted
//!   there ([`Engine::open_missed_maps`], called from the S5 settlement);
//! - a copy being rebuilt adopts its source's maps of the other absent
//!   members, each opened on it before the source's is read, and closes the
//!   stale ones it kept ([`Engine::adopt_missed_maps`]);
//! - a map is closed once its member's return committed
//!   ([`Engine::close_maps_of_returned`]) or the member left the cluster
//!   ([`Engine::close_maps_of_former_members`]).
//!
//! A full rebuild resumes across a writer change through the map's
//! *unverified range*: it is opened at extent 0 on every in-sync replica
//! ([`Engine::begin_full_rebuild`]) and raised as the rebuild verifies
//! ([`Engine::verified_below`]); [`Engine::missed_plan`] turns a map into
//! what a rebuild must compare. A map of another incarnation means a full
//! rebuild (S8).

use std::collections::BTreeSet;
use std::sync::Arc;

use futures::future::join_all;

use super::{Engine, RebuildError};
use crate::ids::{Incarnation, NodeId, Term};
use crate::replica::disk::missed::{self, MissedMap, Unverified};
use crate::replica::{Replica, ReplicaError};
use crate::volume::DeviceError;

/// What a rebuild compares, from the missed-write map ([`Engine::missed_plan`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RebuildPlan {
    /// Extents the target may differ in, below the unverified range.
    pub extents: Vec<u64>,
    /// Where a full rebuild left off: every extent from here on is
    /// compared too. `None`: no full rebuild is pending.
    pub unverified_from: Option<u64>,
}

impl Engine {
    /// Invariant M when members leave (see [`crate::replica::disk::missed`]): opens the
    /// missed-write maps of `leaving` on every replica that stays (the
    /// rest of `in_sync`, and those being rebuilt), then notes there the
    /// extents of every write still in flight — one that began before a
    /// map was open may have reached a replica that stays and not the one
    /// that leaves. A replica in sync that cannot take the note fails the
    /// removal (the write is held and tried again); a replica being
    /// rebuilt that cannot is not rebuilt this time.
    pub(super) async fn open_missed_maps(
        &self,
        term: Term,
        leaving: &BTreeSet<NodeId>,
        in_sync: &BTreeSet<NodeId>,
    ) -> Result<(), DeviceError> {
        let _counted = self.count_maps_opened();
        let leaving: Vec<(NodeId, Incarnation)> = leaving
            .iter()
            .map(|id| (*id, self.replicas.incarnation(*id)))
            .collect();
        let staying: Vec<Arc<dyn Replica>> = self
            .map_keepers(in_sync)
            .into_iter()
            .filter(|r| !leaving.iter().any(|(id, _)| *id == r.id()))
            .collect();
        for _phase in ["open", "in flight"] {
            let extents: Vec<u64> = {
                let state = self.lock();
                let activity = &state.activity;
                let mut extents: BTreeSet<u64> = activity.in_flight.keys().copied().collect();
                extents.extend(activity.unsure.iter().copied());
                extents.into_iter().collect()
            };
            let notes = staying.iter().map(|replica| {
                let (leaving, extents) = (&leaving, &extents);
                async move {
                    for (node, incarnation) in leaving {
                        for piece in missed::pieces(extents) {
                            self.stamped(term, replica, |stamp| {
                                replica.note_missed(stamp, *node, *incarnation, piece)
                            })
                            .await?;
                        }
                    }
                    Ok::<(), ReplicaError>(())
                }
            });
            for (replica, outcome) in staying.iter().zip(join_all(notes).await) {
                let Err(err) = outcome else { continue };
                let id = replica.id();
                if in_sync.contains(&id) {
                    return Err(DeviceError::InSyncCommit(format!(
                        "replica {id} could not open the missed-write map of {leaving:?}: {err}"
                    )));
                }
                tracing::warn!(replica = %id, %err, "a replica being rebuilt could not open a missed-write map");
                if let Some(rebuild) = self.lock().rebuilding.get_mut(&id) {
                    rebuild.failed = true;
                }
            }
        }
        Ok(())
    }

    /// Invariant M for a copy that returns: gives rebuild target `id`
    /// the maps the source keeps of other absent members, since the
    /// target missed what was recorded while it was away. It receives
    /// every write already (the barrier of `begin_rebuild` is behind); each
    /// map is opened on it *before* the source's is read, so a write that
    /// lands between the read and the copy is recorded by the target
    /// itself.
    pub(super) async fn adopt_missed_maps(
        &self,
        term: Term,
        id: NodeId,
    ) -> Result<(), RebuildError> {
        let _counted = self.count_maps_opened();
        let source = self.rebuild_source()?;
        let target = self.target(id)?;
        let maps = self
            .bounded(source.id(), source.missed_maps())
            .await
            .map_err(|e| {
                RebuildError::replica("listing the missed-write maps of", source.id(), e)
            })?;
        let give = |node: NodeId, incarnation: Incarnation, piece: &[u64]| {
            let (target, piece) = (&target, piece.to_vec());
            async move {
                self.stamped(term, target, |stamp| {
                    target.note_missed(stamp, node, incarnation, &piece)
                })
                .await
                .map_err(|e| RebuildError::replica("giving the missed-write maps to", id, e))
            }
        };
        // A map the target holds and the source does not is stale: the
        // member returned while the target was away, and its close missed
        // the target. Kept, it would claim to be complete the next time
        // that member leaves; closed, it is reopened then like any other.
        let stale: Vec<NodeId> = self
            .bounded(id, target.missed_maps())
            .await
            .map_err(|e| RebuildError::replica("listing the missed-write maps of", id, e))?
            .into_keys()
            .filter(|node| !maps.contains_key(node))
            .collect();
        for node in stale {
            self.stamped(term, &target, |stamp| target.close_missed(stamp, node))
                .await
                .map_err(|e| RebuildError::replica("closing a stale missed-write map on", id, e))?;
        }
        for (node, incarnation) in maps.into_iter().filter(|(node, _)| *node != id) {
            give(node, incarnation, &[]).await?;
            let Some(map) = self.whole_missed_map(&source, node).await? else {
                // Closed meanwhile: the member is back in sync.
                continue;
            };
            for piece in missed::pieces(&map.extents) {
                self.stamped(term, &target, |stamp| {
                    target.note_missed(stamp, node, map.incarnation, piece)
                })
                .await
                .map_err(|e| RebuildError::replica("giving the missed-write maps to", id, e))?;
            }
            if let Some(from) = map.unverified_from {
                self.stamped(term, &target, |stamp| {
                    target.set_unverified(stamp, node, map.incarnation, Unverified::Lower(from))
                })
                .await
                .map_err(|e| RebuildError::replica("giving the missed-write maps to", id, e))?;
            }
        }
        Ok(())
    }

    /// Every page of `replica`'s missed-write map of `node`. A map
    /// replaced between two pages is read again; one that keeps changing
    /// counts as none (a full rebuild).
    async fn whole_missed_map(
        &self,
        replica: &Arc<dyn Replica>,
        node: NodeId,
    ) -> Result<Option<MissedMap>, RebuildError> {
        'attempt: for _ in 0..3 {
            let mut whole: Option<MissedMap> = None;
            let mut from = 0;
            loop {
                let page = self
                    .bounded(replica.id(), replica.missed(node, from))
                    .await
                    .map_err(|e| {
                        RebuildError::replica("reading the missed-write map of", replica.id(), e)
                    })?;
                let Some(page) = page else {
                    return Ok(None);
                };
                let whole = whole.get_or_insert_with(|| MissedMap {
                    incarnation: page.incarnation,
                    ..MissedMap::default()
                });
                if whole.incarnation != page.incarnation {
                    continue 'attempt;
                }
                whole.extents.extend_from_slice(&page.extents);
                // A range that changed between pages: the larger one.
                whole.unverified_from = match (whole.unverified_from, page.unverified_from) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                match (page.more, page.extents.last()) {
                    (true, Some(last)) if *last < u64::MAX => from = last + 1,
                    _ => return Ok(Some(std::mem::take(whole))),
                }
            }
        }
        Ok(None)
    }

    /// What rebuild target `id` may differ in from the in-sync copies: the
    /// extents of the source's missed-write map of it, and those the
    /// target itself holds marks for (writes that reached it and perhaps
    /// no other), and, while a full rebuild of it has not verified every
    /// extent, every extent from the map's unverified range on. `None`
    /// when it needs a full rebuild from the first extent: the source
    /// keeps no map of it, or one of another incarnation (a replaced disk,
    /// S8).
    pub async fn missed_plan(&self, id: NodeId) -> Result<Option<RebuildPlan>, RebuildError> {
        let term = self.term().ok_or(RebuildError::Inactive)?;
        let source = self.rebuild_source()?;
        let Some(map) = self.whole_missed_map(&source, id).await? else {
            return Ok(None);
        };
        if map.incarnation != self.replicas.incarnation(id) {
            return Ok(None);
        }
        let target = self.target(id)?;
        // A fence at this term reads its marks and changes nothing else
        // (its floor is this term already, since `begin_rebuild`).
        let marks = self
            .bounded(id, target.fence(term))
            .await
            .map_err(|e| RebuildError::replica("reading the marks of", id, e))?;
        let mut extents: BTreeSet<u64> = map.extents.into_iter().collect();
        extents.extend(marks.dirty.iter().map(|m| m.extent));
        // Only extents of the volume (the answers come from the network),
        // and below the unverified range, which the plan covers whole.
        let count = self.current_size().div_ceil(self.extent_size);
        let below = map.unverified_from.unwrap_or(count).min(count);
        Ok(Some(RebuildPlan {
            extents: extents.into_iter().filter(|e| *e < below).collect(),
            unverified_from: map.unverified_from.map(|from| from.min(count)),
        }))
    }

    /// Starts a full rebuild of `id` that a later writer can resume: opens
    /// its missed-write map on every in-sync replica with an unverified
    /// range from extent 0 (replacing a map of another incarnation). From
    /// then on the map records every change, and the range shrinks as the
    /// rebuild verifies ([`Engine::verified_below`]). Fails unless every
    /// in-sync replica took it: one that did not may keep a map that
    /// claims less than the target may lack.
    ///
    /// A write that began before the map was open on some replica is not
    /// recorded there; this waits for every such write to finish before it
    /// returns, so the comparison sees its outcome, or the write failed on
    /// the target and the rebuild is abandoned (and no range is raised).
    pub async fn begin_full_rebuild(&self, id: NodeId, term: Term) -> Result<(), RebuildError> {
        self.change_unverified(id, term, Unverified::Lower(0), true)
            .await?;
        self.barrier().await;
        Ok(())
    }

    /// A full rebuild of `id` compared (and copied where they differed)
    /// every extent below `extent`: the target flushes them, and then every
    /// in-sync replica raises the map's unverified range to `extent`. A
    /// replica that misses the raise keeps a larger range, which only costs
    /// comparisons.
    ///
    /// Only for the rebuild of `term` that is still running: a raise from
    /// a rebuild that failed (a write to the target failed; the extent may
    /// differ) or from an older term (a later full rebuild lowered the
    /// range again) would cover extents nobody compared. The replicas
    /// refuse one stamped with an older term.
    pub async fn verified_below(
        &self,
        id: NodeId,
        term: Term,
        extent: u64,
    ) -> Result<(), RebuildError> {
        let target = self.target(id)?;
        self.stamped(term, &target, |stamp| target.flush(stamp))
            .await
            .map_err(|e| RebuildError::replica("flushing", id, e))?;
        self.change_unverified(id, term, Unverified::Raise(extent), false)
            .await
    }

    /// Sends `change` of `id`'s unverified range to every in-sync replica;
    /// with `all`, fails if one did not take it.
    async fn change_unverified(
        &self,
        id: NodeId,
        term: Term,
        change: Unverified,
        all: bool,
    ) -> Result<(), RebuildError> {
        if self.term() != Some(term) || self.rebuild_failed(id) {
            return Err(RebuildError::Abandoned(id));
        }
        let incarnation = self.replicas.incarnation(id);
        let in_sync = self.in_sync();
        let keepers: Vec<Arc<dyn Replica>> = self
            .replicas
            .members()
            .iter()
            .filter(|r| in_sync.contains(&r.id()))
            .cloned()
            .collect();
        let changes = keepers.iter().map(|replica| {
            self.stamped(term, replica, |stamp| {
                replica.set_unverified(stamp, id, incarnation, change)
            })
        });
        for (replica, outcome) in keepers.iter().zip(join_all(changes).await) {
            match outcome {
                Ok(()) => {}
                Err(e) if all => {
                    return Err(RebuildError::replica(
                        "opening the missed-write map on",
                        replica.id(),
                        e,
                    ));
                }
                Err(e) => {
                    tracing::warn!(replica = %replica.id(), of = %id, %e, "a missed-write map kept a larger unverified range");
                }
            }
        }
        Ok(())
    }

    /// Invariant M for member `id` back in sync: closes its map on every
    /// other keeper. Best effort: a map left open is a superset, which
    /// costs only copies.
    pub(super) async fn close_maps_of_returned(&self, term: Term, id: NodeId) {
        let keepers: Vec<Arc<dyn Replica>> = self
            .map_keepers(&self.in_sync())
            .into_iter()
            .filter(|r| r.id() != id)
            .collect();
        let closes = keepers.iter().map(|replica| async move {
            let closed = self
                .stamped(term, replica, |stamp| replica.close_missed(stamp, id))
                .await;
            (replica.id(), closed)
        });
        for (keeper, closed) in join_all(closes).await {
            if let Err(err) = closed {
                tracing::debug!(replica = %keeper, of = %id, %err, "could not close a missed-write map");
            }
        }
    }

    /// Closes the missed-write maps of nodes that are no longer members of
    /// the cluster (`members`: the committed membership, learners
    /// included) on every replica that keeps maps. A removed member's map
    /// would otherwise stay open for good, and every later change would
    /// add its extents to it. Dropping it is safe: a removed node can only
    /// come back by being added again, and a replica without a map on its
    /// source is rebuilt in full (see [`crate::replica::disk::missed`]). Returns the maps
    /// closed; a keeper that could not list or close its maps makes it an
    /// error (the caller tries again), after the others were done.
    pub async fn close_maps_of_former_members(
        &self,
        members: &BTreeSet<NodeId>,
    ) -> Result<usize, RebuildError> {
        let term = self.lock().term.ok_or(RebuildError::Inactive)?;
        let keepers = self.map_keepers(&self.in_sync());
        let sweeps = keepers.iter().map(|keeper| async move {
            let maps = self.bounded(keeper.id(), keeper.missed_maps()).await?;
            let mut closed = 0;
            for node in maps.into_keys().filter(|node| !members.contains(node)) {
                self.stamped(term, keeper, |stamp| keeper.close_missed(stamp, node))
                    .await?;
                tracing::info!(replica = %keeper.id(), of = %node, "closed the missed-write map of a former member");
                closed += 1;
            }
            Ok::<usize, ReplicaError>(closed)
        });
        let mut total = 0;
        let mut failed = None;
        for (keeper, swept) in keepers.iter().zip(join_all(sweeps).await) {
            match swept {
                Ok(closed) => total += closed,
                Err(err) => {
                    failed = Some(RebuildError::replica(
                        "closing former members' missed-write maps on",
                        keeper.id(),
                        err,
                    ))
                }
            }
        }
        failed.map_or(Ok(total), Err)
    }

    /// The replicas that keep missed-write maps: those in `in_sync` and
    /// those being rebuilt (they take every change, so they record it).
    fn map_keepers(&self, in_sync: &BTreeSet<NodeId>) -> Vec<Arc<dyn Replica>> {
        let state = self.lock();
        self.replicas
            .members()
            .iter()
            .filter(|r| in_sync.contains(&r.id()) || state.rebuilding.contains_key(&r.id()))
            .cloned()
            .collect()
    }

    /// Counts an opening of maps now and again when the guard drops, on
    /// every way out: a sweep that read the count while maps were being
    /// opened (and may have listed them before they were) sees it move
    /// once more when they are, and sweeps again.
    fn count_maps_opened(&self) -> impl Drop + '_ {
        struct Counted<'a>(&'a std::sync::atomic::AtomicU64);
        impl Drop for Counted<'_> {
            fn drop(&mut self) {
                self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        self.maps_opened
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Counted(&self.maps_opened)
    }

    /// How many times this engine began or ended opening or handing out
    /// missed-write maps. A sweep of former members' maps that read it
    /// before it began and reads the same after misses no map opened
    /// meanwhile.
    pub fn maps_opened(&self) -> u64 {
        self.maps_opened.load(std::sync::atomic::Ordering::SeqCst)
    }
}
