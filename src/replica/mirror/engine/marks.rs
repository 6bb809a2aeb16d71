//! S6 kept cheap: the writer's side of the dirty marks while its term runs.
//!
//! Every replica marks an extent before a term's first write to it, and a
//! promotion converges what is marked. So that this does not grow with all
//! a term ever wrote, the writer retires marks as it goes
//! ([`Engine::retire_marks`], every 200 ms): an extent whose writes were
//! all acknowledged before the last pass, and that no write reached since,
//! is flushed on every in-sync replica, and then, under the extent's stripe
//! (no write to it in flight), every in-sync replica drops its mark. An
//! extent written again meanwhile, or with an unacknowledged write this
//! term, stays marked. A writer that settles before it hands over retires
//! without waiting for the idle pass ([`Engine::retire_all_marks`]). An
//! extent with an unacknowledged write may differ among the members (the
//! write reached some, and the ones it missed could not be dropped); the
//! same pass copies it from one in-sync member to the others first
//! ([`Engine::repair_unsure`], in `repair.rs`), so the set agrees again
//! within the term, not only at the next promotion. The first pass after
//! an activation also finishes the promotion's convergence: once its flush
//! made every member durable, it drops the older terms' marks (see
//! `fencer`), and the extents the convergence copied are retired like the
//! term's own writes.
//!
//! A sequential writer is marked ahead ([`Engine::run_mark_ahead`]): the
//! next extents of an in-order run are marked on every replica in one
//! metadata flush, in the background, so a stream's first writes seldom
//! wait for a mark. A replica still marks on its own any extent a write
//! finds unmarked, so S6 never rests on a mark ahead; the marks of extents
//! no write reached are retired after [`AHEAD_PASSES`] passes.

use std::collections::{BTreeMap, BTreeSet};
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;

use super::{Activity, Engine, STRIPES};
use crate::ids::Term;
use crate::replica::mirror::ahead::AHEAD_PASSES;
use crate::replica::{Replica, Stamp};
use crate::volume::{Device, DeviceError, MAX_REQUEST};

/// The most mark-ahead requests that wait; older ones are dropped (they
/// are only an optimization).
const MARKS_DUE_MAX: usize = 4;

/// How long an extent's writes must have stopped before a retirement pass
/// drops its mark.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Idle {
    /// For a whole pass: the running writer's rule, so a hot extent stays
    /// marked.
    WholePass,
    /// Not at all: the writer settles before it hands over.
    NotNeeded,
}

impl Engine {
    /// One pass of mark retirement (S6 kept cheap). The extents whose
    /// writes of this term all finished acknowledged before the last pass,
    /// and that no write reached since, are flushed on every in-sync
    /// replica (a mirrored flush, acknowledged under S5's rule); then,
    /// holding each extent's stripe exclusively so no write to it is in
    /// flight, every in-sync replica drops its mark — unless a write
    /// touched the extent since the pass began, or one of this term's
    /// writes to it was not acknowledged. What stays marked is the hot set,
    /// and a promotion converges only that (DRBD's activity log).
    ///
    /// An extent waits one whole idle pass (200 ms to 400 ms after its last
    /// write) because a random writer over a working set of a few hundred
    /// extents rewrites each of them within every pass: retiring them at
    /// once made one write in seventeen a first touch again (4k QD1 over
    /// 128 extents), each with a metadata flush on every replica, and cost
    /// a quarter of that writer's throughput. Returns how many extents were
    /// retired.
    pub async fn retire_marks(&self) -> Result<usize, DeviceError> {
        self.retire_pass(Idle::WholePass).await
    }

    /// One pass of mark retirement, retiring every extent whose writes all
    /// finished acknowledged, however recent ([`Engine::retire_marks`]
    /// waits for a whole idle pass). For a writer that stopped taking
    /// requests and hands over: it leaves the next writer only what is
    /// unsure to converge.
    pub async fn retire_all_marks(&self) -> Result<usize, DeviceError> {
        self.retire_pass(Idle::NotNeeded).await
    }

    async fn retire_pass(&self, idle: Idle) -> Result<usize, DeviceError> {
        let _one_at_a_time = self.retiring.lock().await;
        let (term, batch, older_marks) = {
            let mut state = self.lock();
            let term = state.term.ok_or(DeviceError::Inactive)?;
            let activity = &mut state.activity;
            let fresh = std::mem::take(&mut activity.done);
            let cooled = std::mem::take(&mut activity.cooling);
            let mut batch: BTreeSet<u64> = match idle {
                Idle::WholePass => {
                    activity.cooling = fresh;
                    cooled.difference(&activity.cooling).copied().collect()
                }
                Idle::NotNeeded => fresh.union(&cooled).copied().collect(),
            };
            // Extents marked ahead that no write reached for a while.
            activity.ahead_waiting.retain(|extent, passes| {
                *passes += 1;
                let aged = *passes >= AHEAD_PASSES || idle == Idle::NotNeeded;
                if aged {
                    batch.insert(*extent);
                }
                !aged
            });
            let batch: Vec<u64> = batch
                .into_iter()
                .filter(|e| !activity.unsure.contains(e))
                .collect();
            (term, batch, activity.older_marks)
        };
        if batch.is_empty() && !older_marks {
            return Ok(0);
        }
        if let Err(err) = self.flush().await {
            self.lock().activity.done.extend(batch);
            return Err(err);
        }
        if older_marks {
            self.clear_older_marks(term).await;
        }
        let mut by_stripe: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for extent in batch {
            by_stripe.entry(extent % STRIPES).or_default().push(extent);
        }
        let mut retired = 0;
        for (stripe, extents) in by_stripe {
            let _exclusive = self.stripes[stripe as usize].write().await;
            let (ready, members) = {
                let state = self.lock();
                if state.term != Some(term) {
                    return Ok(retired);
                }
                let activity = &state.activity;
                let ready: Vec<u64> = extents
                    .into_iter()
                    .filter(|e| {
                        !activity.in_flight.contains_key(e)
                            && !activity.done.contains(e)
                            && !activity.unsure.contains(e)
                            && !activity.ahead_waiting.contains_key(e)
                    })
                    .collect();
                // Members only. A replica being rebuilt keeps its marks:
                // older terms' marks there may name the only record of a
                // write that reached it and no other copy, which its
                // rebuild compares (see `missed_plan`); its return retires
                // them (`finish_rebuild`).
                let members = self.in_sync_members(&state);
                (ready, members)
            };
            if ready.is_empty() {
                continue;
            }
            let calls = members.iter().map(|replica| {
                let ready = &ready;
                async move {
                    let outcome = self
                        .stamped(term, replica, |stamp| {
                            replica.retire_marks(stamp, term, ready)
                        })
                        .await;
                    (replica.id(), outcome)
                }
            });
            let mut kept = false;
            for (id, outcome) in join_all(calls).await {
                if let Err(err) = outcome {
                    // Only a mark too many; a member's is tried again.
                    tracing::debug!(replica = %id, %err, "could not retire marks");
                    kept |= self.lock().in_sync.contains(&id);
                }
            }
            if kept {
                self.lock().activity.done.extend(ready);
            } else {
                retired += ready.len();
            }
        }
        Ok(retired)
    }

    /// After a flush of every member: drops the older terms' marks the
    /// promotion left (their extents agree since the convergence, and are
    /// durable since the flush). A member that fails keeps them, and the
    /// next pass tries again; until then a failover converges them again.
    async fn clear_older_marks(&self, term: Term) {
        let members = self.in_sync_members(&self.lock());
        let calls = members.iter().map(|replica| async move {
            self.bounded(replica.id(), replica.clear_dirty_below(term))
                .await
                .map_err(|err| (replica.id(), err))
        });
        let failed: Vec<_> = join_all(calls)
            .await
            .into_iter()
            .filter_map(Result::err)
            .collect();
        let mut state = self.lock();
        if failed.is_empty() && state.term == Some(term) {
            state.activity.older_marks = false;
        }
        for (id, err) in failed {
            tracing::debug!(replica = %id, %err, "older marks kept for the next pass");
        }
    }

    /// Runs [`Engine::repair_unsure`] and [`Engine::retire_marks`] every
    /// `interval` while active, until the task is dropped.
    pub async fn run_mark_retirement(self: Arc<Self>, interval: Duration) {
        loop {
            tokio::time::sleep(interval).await;
            if self.term().is_none() {
                // Nothing to retire until this node writes: wait for that
                // rather than waking every interval; the first pass then
                // comes an interval after it, as before.
                self.until_active().await;
                continue;
            }
            if let Err(err) = self.repair_unsure().await {
                tracing::debug!(%err, "repair of unacknowledged extents skipped");
            }
            if let Err(err) = self.retire_marks().await {
                tracing::debug!(%err, "mark retirement skipped");
            }
        }
    }

    /// Notes a write to `extents` and, when it continues a sequential
    /// stream, queues the extents to mark ahead of it (see [`crate::replica::mirror::ahead`]);
    /// true if it queued some.
    pub(super) fn plan_marks_ahead(
        &self,
        activity: &mut Activity,
        extents: &RangeInclusive<u64>,
    ) -> bool {
        let size = self.current_size();
        if size == 0 {
            return false;
        }
        let end = (size - 1) / self.extent_size;
        let Some(due) = activity
            .ahead
            .after_write(*extents.start(), *extents.end(), end)
        else {
            return false;
        };
        if activity.marks_due.len() >= MARKS_DUE_MAX {
            activity.marks_due.remove(0);
        }
        activity.marks_due.push(due);
        true
    }

    /// Marks ahead of sequential writers, in the background, until the task
    /// is dropped: each queued range is marked on every replica that takes
    /// writes, under the extents' stripes (shared) and counted meanwhile
    /// like a write in flight, so no retirement pass overlaps it; then its
    /// extents wait for a write, and mark retirement drops the marks of
    /// those no write reached within [`AHEAD_PASSES`] passes. A replica
    /// that fails to mark is left to mark on its own when the writes come.
    pub async fn run_mark_ahead(self: Arc<Self>) {
        loop {
            self.ahead_due.notified().await;
            loop {
                let due = {
                    let mut state = self.lock();
                    let due = &mut state.activity.marks_due;
                    (!due.is_empty()).then(|| due.remove(0))
                };
                match due {
                    Some(extents) => self.mark_ahead(extents).await,
                    None => break,
                }
            }
        }
    }

    /// Marks `extents` ahead of the writes to them (see [`Engine::run_mark_ahead`]).
    async fn mark_ahead(&self, extents: RangeInclusive<u64>) {
        let size = self.current_size();
        let offset = extents.start().saturating_mul(self.extent_size);
        if offset >= size {
            return;
        }
        let end = extents
            .end()
            .saturating_add(1)
            .saturating_mul(self.extent_size)
            .min(size);
        // At most one request's worth (a larger extent size means fewer).
        let len = (end - offset).min(MAX_REQUEST);
        // The stripes, shared, as a write holds them: a retirement pass
        // (which holds a stripe exclusively and then checks what is in
        // flight) cannot drop a mark while this one is being placed.
        let _span = self.lock_span(offset, len).await;
        let Ok((term, targets, rebuilding)) = self.targets() else {
            return;
        };
        // Nothing is written, whatever the answers: no extent is unsure.
        let _in_flight = self.begin(offset, len, true);
        let send: Vec<Arc<dyn Replica>> = targets.into_iter().chain(rebuilding).collect();
        let op = |stamp: Stamp, replica: Arc<dyn Replica>| async move {
            replica.mark_ahead(stamp, offset, len).await
        };
        let sent = self.send_all(term, &send, &op).await;
        // A newer writer's floor deactivates this one, as for a write.
        let _ = self.check_stale(&sent);
        for (id, outcome) in sent {
            if let Err(err) = outcome {
                tracing::debug!(replica = %id, %err, "could not mark ahead");
            }
        }
    }
}
