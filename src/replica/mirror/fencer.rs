//! The token fencer: fence-before-promote by raising every replica's fence
//! floor to the new term, then reconcile before the new writer writes.
//!
//! `fence(prev, T)` succeeds only when, in this order:
//! 1. **S1.** The replicas that durably took floor `T` (the *fenced* set)
//!    number at least `N − min_in_sync + 1` — so the old writer can no longer
//!    gather `min_in_sync` acknowledgements — and include a member of the
//!    committed in-sync set, so the new writer starts from a copy that holds
//!    every acknowledged write. Each fenced replica has also drained every
//!    write of an older term (S3). A replica whose floor is already above
//!    `T` means a newer writer exists: the fence fails.
//! 2. **S5.** In-sync members that were not reached are removed from the set
//!    by a committed Raft change (they may miss this writer's writes).
//! 3. **S6.** Every extent an older term marked dirty on a reached in-sync
//!    replica is copied from one in-sync source (the local replica when it
//!    is one) to the other reached in-sync replicas, written with term `T`.
//!    An extent whose BLAKE3 digest already agrees on a target is not
//!    copied there. The copies go in batches of [`CONVERGE_BATCH`]
//!    extents, eight at a time. Afterwards every member agrees, in its page
//!    cache; making that durable (a flush of every member) and dropping the
//!    older marks is left to the new writer's first mark-retirement pass,
//!    off the failover's path: until then the marks stay, so a crash or a
//!    power cut before that pass finds them again and the next promotion
//!    converges them once more. The extents copied are handed to the
//!    writer through the [`FloorBook`], so the marks the copies made on
//!    their targets go with its own. An attempt that fails, or runs past
//!    [`SETTLE_AFTER`], settles what it finished itself (flush, then drop
//!    the marks), so the next attempt resumes with what is still marked: no
//!    amount of marks can make the fence timeout unreachable. The marks
//!    are few to begin with: a writer retires its own during its term (see
//!    `Engine::retire_marks`), so only its hot set is left. Any in-sync copy
//!    holds every acknowledged write, so whichever source is chosen, the
//!    result is "the last acknowledged write, or a later unacknowledged one"
//!    — and afterwards every in-sync replica reads the same.
//!
//! The `Fence(T)` sent to the previous writer's own replica doubles as the
//! best-effort "step down" notice: its node closes its gate on receipt
//! (see the fence callback of the volume's entry in the node's
//! `replica::serve::stores::Stores`). Nothing depends on it — the raised
//! floors refuse the old term either way.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::StreamExt;
use futures::future::join_all;

use crate::ha::{FenceError, Fencer, InSyncTracker, Writer};
use crate::ids::{NodeId, Term};
use crate::replica::mirror::quorum;
use crate::replica::mirror::set::ReplicaSet;
use crate::replica::{FenceReply, FloorBook, Replica, ReplicaError, Stamp};
use crate::volume::VolumeSpec;

/// The stamps the fencer of `term` sends each fenced replica. A member's
/// floor may be a later generation of this term (a stint of this node's
/// own at the term, or a rebuild): what the fencer sends it carries that
/// generation, so it is admitted.
fn stamps_for(term: Term, fenced: &BTreeMap<NodeId, FenceReply>) -> BTreeMap<NodeId, Stamp> {
    fenced
        .iter()
        .map(|(id, reply)| {
            let stamp = Stamp {
                term,
                generation: reply.generation,
            };
            (*id, stamp)
        })
        .collect()
}

/// The stamp the fencer uses for replica `id` (generation 0 if unknown).
fn stamp_of(stamps: &BTreeMap<NodeId, Stamp>, id: NodeId) -> Stamp {
    stamps.get(&id).copied().unwrap_or_default()
}

/// How many marked extents one convergence step copies before it makes them
/// durable and retires their marks.
const CONVERGE_BATCH: usize = 64;
/// How many extents are copied at once.
const COPIES_IN_FLIGHT: usize = 8;

/// How long a convergence runs before it settles what it did (see
/// [`TokenFencer::settle`]); a short one leaves that to the new writer.
const SETTLE_AFTER: Duration = Duration::from_secs(1);

/// Fences by term and reconciles. See the module docs.
pub struct TokenFencer {
    replicas: Arc<ReplicaSet>,
    tracker: Arc<dyn InSyncTracker>,
    min_in_sync: usize,
    /// The configured size, for a volume whose config is not committed yet.
    size: u64,
    timeout: Duration,
    floors: Arc<FloorBook>,
}

/// The members of the replica set when a fence began.
type Members = [Arc<dyn Replica>];

fn find(members: &Members, id: NodeId) -> Option<&Arc<dyn Replica>> {
    members.iter().find(|r| r.id() == id)
}

impl TokenFencer {
    /// A fencer of `volume` over its replica set (the local replica
    /// included).
    pub fn new(
        replicas: Arc<ReplicaSet>,
        tracker: Arc<dyn InSyncTracker>,
        volume: &VolumeSpec,
        timeout: Duration,
    ) -> Self {
        Self {
            replicas,
            tracker,
            min_in_sync: volume.min_in_sync,
            size: volume.size,
            timeout,
            floors: Arc::default(),
        }
    }

    /// Shares the floors this fencer finds with an engine (see
    /// [`FloorBook`]).
    pub fn with_floor_book(mut self, floors: Arc<FloorBook>) -> Self {
        self.floors = floors;
        self
    }

    /// Sends `Fence(term)` to every replica and keeps those that took it.
    async fn fence_all(
        &self,
        term: Term,
        members: &Members,
    ) -> Result<BTreeMap<NodeId, FenceReply>, FenceError> {
        let replies = self
            .replicas
            .fan_out(members, self.timeout, |replica| async move {
                let reply = replica.fence(term).await?;
                if reply.floor == term {
                    replica.count_on_session(reply.session);
                }
                Ok(reply)
            })
            .await;
        let mut fenced = BTreeMap::new();
        for (id, reply) in replies {
            match reply {
                Ok(reply) if reply.floor == term => {
                    self.floors.note(
                        id,
                        Stamp {
                            term,
                            generation: reply.generation,
                        },
                    );
                    fenced.insert(id, reply);
                }
                Ok(reply) => {
                    return Err(FenceError::NewerWriter {
                        replica: id,
                        floor: reply.floor,
                        term,
                    });
                }
                Err(err) => tracing::warn!(replica = %id, %term, %err, "fence not taken"),
            }
        }
        Ok(fenced)
    }

    /// Copies one extent from `source` to every target, written with `term`.
    async fn copy_to_all(
        &self,
        stamps: &BTreeMap<NodeId, Stamp>,
        source: &Arc<dyn Replica>,
        targets: &[&Arc<dyn Replica>],
        extent: u64,
        extent_size: u64,
        size: u64,
    ) -> Result<bool, FenceError> {
        let offset = extent * extent_size;
        let len = extent_size.min(size.saturating_sub(offset));
        // Most marked extents already agree (their writes were acknowledged
        // everywhere before the writer died): compare digests first and copy
        // only to the replicas that differ. Nothing writes meanwhile — the
        // old writer is fenced and the new gate is closed.
        let digest = |replica: &Arc<dyn Replica>| {
            let replica = Arc::clone(replica);
            async move {
                self.within(&replica, replica.digests(offset, len))
                    .await
                    .map(|(_, d)| d)
                    .map_err(|e| FenceError::replica("digesting", replica.id(), e))
            }
        };
        let (ours, theirs) =
            futures::join!(digest(source), join_all(targets.iter().map(|t| digest(t))));
        let ours = ours?;
        let mut differing = Vec::new();
        for (target, digests) in targets.iter().zip(theirs) {
            if digests? != ours {
                differing.push(*target);
            }
        }
        if differing.is_empty() {
            return Ok(false);
        }
        let data = self
            .within(source, source.read(offset, len))
            .await
            .map_err(|e| FenceError::replica("reading", source.id(), e))?;
        let writes = differing.iter().map(|target| {
            let data = data.clone();
            async move {
                let write = target.write(stamp_of(stamps, target.id()), offset, data, false);
                self.within(target, write)
                    .await
                    .map_err(|e| FenceError::replica("copying", target.id(), e))
            }
        });
        join_all(writes)
            .await
            .into_iter()
            .collect::<Result<(), FenceError>>()
            .map(|()| true)
    }

    /// Runs `step`, `call`, on every replica of `replicas` at once; the
    /// first error wins.
    async fn on_all<'a, F, Fut>(
        &self,
        step: &'static str,
        replicas: &[&'a Arc<dyn Replica>],
        call: F,
    ) -> Result<(), FenceError>
    where
        F: Fn(&'a Arc<dyn Replica>) -> Fut,
        Fut: std::future::Future<Output = Result<(), ReplicaError>>,
    {
        let outcomes = self
            .replicas
            .fan_out(replicas.iter().copied(), self.timeout, call)
            .await;
        outcomes
            .into_iter()
            .try_for_each(|(id, outcome)| outcome.map_err(|e| FenceError::replica(step, id, e)))
    }

    /// Makes the converged `extents` durable on every member, then drops
    /// their marks through `term` there (older ones, and the ones the
    /// copies made).
    async fn settle(
        &self,
        term: Term,
        all: &[&Arc<dyn Replica>],
        stamps: &BTreeMap<NodeId, Stamp>,
        extents: &[u64],
        report: &mut Convergence,
    ) -> Result<(), FenceError> {
        if extents.is_empty() {
            return Ok(());
        }
        let flushing = Instant::now();
        self.on_all("flushing converged extents", all, |replica| {
            let stamp = stamp_of(stamps, replica.id());
            async move { replica.flush(stamp).await }
        })
        .await?;
        report.flushing += flushing.elapsed();
        for chunk in extents.chunks(CONVERGE_BATCH) {
            self.on_all("retiring converged marks", all, |replica| {
                let stamp = stamp_of(stamps, replica.id());
                async move {
                    replica
                        // Through `term`: the copies themselves marked the
                        // extents with it on the targets, and no write of
                        // `term` has happened yet (the gate is closed).
                        .retire_marks(stamp, term, chunk)
                        .await
                        .map(|_| ())
                }
            })
            .await?;
        }
        Ok(())
    }

    /// `call` to `replica`, given up on once the replica falls silent for
    /// the timeout (see [`crate::replica::mirror::liveness`]).
    async fn within<T>(
        &self,
        replica: &Arc<dyn Replica>,
        call: impl std::future::Future<Output = Result<T, ReplicaError>>,
    ) -> Result<T, ReplicaError> {
        self.replicas
            .bounded(replica.id(), self.timeout, call)
            .await
    }

    /// Makes the older terms' dirty extents identical on `members` (S6).
    async fn converge(
        &self,
        term: Term,
        members: &BTreeSet<NodeId>,
        fenced: &BTreeMap<NodeId, FenceReply>,
        replicas: &Members,
    ) -> Result<Convergence, FenceError> {
        let mut report = Convergence::default();
        let local = self.replicas.local_id();
        let source_id = if members.contains(&local) {
            local
        } else {
            members.iter().next().cloned().ok_or(FenceError::NoSource)?
        };
        let source = find(replicas, source_id).ok_or(FenceError::NoSource)?;
        let mut extents = BTreeSet::new();
        let mut extent_size = 0;
        for id in members {
            if let Some(reply) = fenced.get(id) {
                if reply.extent_size == 0 || (extent_size != 0 && reply.extent_size != extent_size)
                {
                    return Err(FenceError::ExtentSize {
                        replica: *id,
                        reported: reply.extent_size,
                        expected: extent_size,
                    });
                }
                extent_size = reply.extent_size;
                extents.extend(
                    reply
                        .dirty
                        .iter()
                        .filter(|m| m.term < term)
                        .map(|m| m.extent),
                );
            }
        }
        let targets: Vec<&Arc<dyn Replica>> = members
            .iter()
            .filter(|id| **id != source_id)
            .filter_map(|id| find(replicas, *id))
            .collect();
        let all: Vec<&Arc<dyn Replica>> = members
            .iter()
            .filter_map(|id| find(replicas, *id))
            .collect();
        let stamps = stamps_for(term, fenced);
        // The committed size, not this node's config: a resize may have
        // grown the volume past it, and every in-sync replica with it.
        let size = self.tracker.volume_size().await?.unwrap_or(self.size);
        let extents: Vec<u64> = extents
            .into_iter()
            .filter(|extent| {
                extent
                    .checked_mul(extent_size)
                    .is_some_and(|offset| offset < size)
            })
            .collect();
        // In batches of extents compared (and copied where they differ) in
        // parallel. Making them durable and dropping their older marks is
        // left to the new writer, off the failover's path (see
        // `Engine::retire_marks`), unless this attempt runs long or fails:
        // then what it finished is settled here, so a later attempt (after
        // a timeout, or by the next writer) resumes with the extents still
        // marked instead of starting over.
        let started = Instant::now();
        let mut unsettled: Vec<u64> = Vec::new();
        let mut copied_extents: Vec<u64> = Vec::new();
        for batch in extents.chunks(CONVERGE_BATCH) {
            let copies = futures::stream::iter(batch.iter().copied())
                .map(|extent| {
                    let copy =
                        self.copy_to_all(&stamps, source, &targets, extent, extent_size, size);
                    async move { (extent, copy.await) }
                })
                .buffer_unordered(COPIES_IN_FLIGHT);
            let outcomes: Vec<(u64, Result<bool, FenceError>)> = copies.collect().await;
            let mut failed = None;
            for (extent, outcome) in outcomes {
                match outcome {
                    Ok(copied) => {
                        if copied {
                            report.copied += 1;
                            copied_extents.push(extent);
                        }
                    }
                    Err(err) => failed = failed.or(Some(err)),
                }
            }
            if let Some(err) = failed {
                self.floors.note_copied(term, copied_extents);
                if let Err(settling) = self
                    .settle(term, &all, &stamps, &unsettled, &mut report)
                    .await
                {
                    tracing::warn!(%term, %settling, "could not keep the convergence's progress");
                }
                return Err(err);
            }
            unsettled.extend_from_slice(batch);
            if started.elapsed() >= SETTLE_AFTER {
                self.settle(term, &all, &stamps, &unsettled, &mut report)
                    .await?;
                unsettled.clear();
                copied_extents.clear();
            }
        }
        self.floors.note_copied(term, copied_extents);
        report.marked = extents.len();
        Ok(report)
    }
}

impl TokenFencer {
    /// Invariant M when the fencer drops unreached members (see
    /// [`crate::replica::disk::missed`]): before their removal commits, every member that
    /// stays opens their missed-write maps with every extent any fenced
    /// replica holds a mark for — the dead writer's unacknowledged writes
    /// may have reached some copies and not the ones that leave.
    async fn open_missed_maps(
        &self,
        term: Term,
        leaving: &BTreeSet<NodeId>,
        staying: &BTreeSet<NodeId>,
        fenced: &BTreeMap<NodeId, FenceReply>,
        replicas: &Members,
    ) -> Result<(), FenceError> {
        let marked: BTreeSet<u64> = fenced
            .values()
            .flat_map(|reply| reply.dirty.iter().map(|m| m.extent))
            .collect();
        let marked: Vec<u64> = marked.into_iter().collect();
        let targets: Vec<&Arc<dyn Replica>> = staying
            .iter()
            .filter_map(|id| find(replicas, *id))
            .collect();
        let stamps = stamps_for(term, fenced);
        for node in leaving {
            let incarnation = self.replicas.incarnation(*node);
            for piece in crate::replica::disk::missed::pieces(&marked) {
                self.on_all("opening a missed-write map", &targets, |replica| {
                    let stamp = stamp_of(&stamps, replica.id());
                    async move { replica.note_missed(stamp, *node, incarnation, piece).await }
                })
                .await?;
            }
        }
        Ok(())
    }
}

/// What one convergence did, for the log.
#[derive(Debug, Default)]
struct Convergence {
    /// Extents marked by an older term on some member.
    marked: usize,
    /// Of those, extents that differed and were copied.
    copied: usize,
    /// Time spent making the batches durable.
    flushing: Duration,
}

#[async_trait]
impl Fencer for TokenFencer {
    #[tracing::instrument(
        name = "fence",
        skip_all,
        fields(node = %self.replicas.local_id(), term = %term, role = "fence_pending")
    )]
    async fn fence(&self, prev_writer: Option<&Writer>, term: Term) -> Result<(), FenceError> {
        let started = Instant::now();
        let committed = self.tracker.in_sync().await?;
        let replicas = self.replicas.members();
        let fenced = self.fence_all(term, &replicas).await?;
        let fenced_after = started.elapsed();
        // N counts every replica an older writer may still reach: the set's
        // members, and any committed in-sync replica this node's set lacks
        // (unfenced, since it was not sent the fence).
        let absent = committed
            .iter()
            .filter(|id| find(&replicas, **id).is_none())
            .count();
        let n = replicas.len() + absent;
        let need = quorum::fence_quorum(n, self.min_in_sync);
        if fenced.len() < need {
            return Err(FenceError::TooFewFenced {
                term,
                fenced: fenced.len(),
                replicas: n,
                need,
            });
        }
        if !fenced.keys().any(|id| committed.contains(id)) {
            return Err(FenceError::NoInSyncFenced { in_sync: committed });
        }
        let unreached: BTreeSet<NodeId> = committed
            .iter()
            .filter(|id| !fenced.contains_key(*id))
            .cloned()
            .collect();
        let members = if unreached.is_empty() {
            committed
        } else {
            tracing::warn!(
                %term,
                ?unreached,
                "dropping unreached replicas from the in-sync set"
            );
            let staying: BTreeSet<NodeId> = committed.difference(&unreached).copied().collect();
            self.open_missed_maps(term, &unreached, &staying, &fenced, &replicas)
                .await?;
            self.tracker.remove(term, &unreached).await?
        };
        let converged = self.converge(term, &members, &fenced, &replicas).await?;
        tracing::info!(
            %term,
            prev = ?prev_writer,
            fenced = ?fenced.keys().collect::<Vec<_>>(),
            converged = converged.marked,
            copied = converged.copied,
            fence_ms = fenced_after.as_millis() as u64,
            flush_ms = converged.flushing.as_millis() as u64,
            total_ms = started.elapsed().as_millis() as u64,
            "fenced and reconciled"
        );
        Ok(())
    }
}
