//! The engine: a synchronous mirror of the volume over every in-sync replica.
//!
//! The controller activates the engine with its term once the previous
//! writer is fenced; from then on every write and flush is stamped with that
//! term (S2) and sent to all members of the in-sync set at once.
//!
//! **S5, ack means replicated.** A write returns Ok only when every member of
//! the in-sync set *as committed at the moment of the acknowledgement* has
//! it, and the set still has at least `min_in_sync` members. The decision is
//! made under the in-sync lock that every change of the set also takes, so
//! the set cannot change between the check and the answer. A member that
//! joined while the request was in flight, and so was never sent it, is sent
//! it before the request may be acknowledged. When some members fail or time
//! out, the engine asks the [`InSyncTracker`] to commit their removal and
//! acknowledges only after that commit, and only if every member of the
//! committed set got the write. If removing them would leave fewer than
//! `min_in_sync` members, nothing is committed and the write fails: the set
//! keeps members that hold every acknowledged write, so availability returns
//! with them.
//!
//! **No late landing.** A request whose outcome the engine never learned (a
//! timeout, a broken connection, a caller that dropped the write before its
//! answer) may still be applied by its replica later.
//! The engine disowns it: it raises the generation it stamps that replica's
//! requests with (see [`Stamp`]), so the next request there — a write, a
//! flush, or the flush that opens a rebuild — drains the lost one if the
//! replica admitted it, and makes the replica refuse it if it arrives later.
//! No write the engine gave up on can land after a later write on the same
//! replica.
//!
//! A replica that refuses a write with "stale term" means a newer writer has
//! fenced this one: the engine deactivates itself and fails the write, and
//! never shrinks the set on that account.
//!
//! **S11, one order.** A write waits for its turn ([`crate::replica::mirror::order`]) before
//! it takes its stripes: every earlier write that overlaps it must have
//! finished on every replica first, so overlapping writes land in the same
//! order everywhere. Copies (rebuild, repair) hold the stripe exclusively.
//!
//! Reads come from the local replica when it is in sync, else from the other
//! in-sync replicas in turn.
//!
//! **Where each part lives.** This file is the core that every other part
//! goes through: the engine's state and its lock, the stamp and generation
//! of each request (S2, S3), the fan-out of one request and the decision to
//! acknowledge it (S5), the extent stripes, the count of writes in flight
//! per extent, and the [`Device`] and [`WriterEngine`] faces. Each other job
//! is an `impl Engine` block of its own over the same state:
//!
//! - `marks.rs`: S6 kept cheap — the S6 marks retired while the term runs
//!   ([`Engine::retire_marks`]) and placed ahead of a sequential writer
//!   ([`Engine::run_mark_ahead`]).
//! - `rebuild.rs`: the online rebuild of a replica out of the in-sync set,
//!   from the barrier that makes it a write-only member to its committed
//!   return ([`Engine::begin_rebuild`], [`Engine::finish_rebuild`]; S5, S7).
//! - `maps.rs`: the missed-write maps the writer keeps on the replicas that
//!   stay while a member is away (invariant M), and the unverified range a
//!   full rebuild resumes from.
//! - `repair.rs`: one extent made to agree again on every in-sync replica
//!   under its stripe: the scrub's step ([`Engine::scrub_extent`], S11) and
//!   the repair of what an unacknowledged write left unsure
//!   ([`Engine::repair_unsure`]).
//! - `members.rs`: replicas added to and removed from the volume, and the
//!   volume's growth ([`Engine::resize`]).

mod maps;
mod marks;
mod members;
mod rebuild;
mod repair;

pub use maps::RebuildPlan;
pub use members::{Leaving, MAX_VOLUME_SIZE, MembershipError, ResizeError};
pub use rebuild::{MAX_COPY_RUN, RebuildError};
pub use repair::{ScrubError, ScrubFinding};

use std::collections::{BTreeMap, BTreeSet};
use std::ops::RangeInclusive;

use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{RwLock, RwLockReadGuard};

use async_trait::async_trait;
use bytes::Bytes;
use futures::future::join_all;

use crate::ha::{InSyncTracker, ReplicaState, ReplicaStatus, WriterEngine};
use crate::ids::{NodeId, Term};
use crate::replica::mirror::ahead::Ahead;
use crate::replica::mirror::order::WriteOrder;
use crate::replica::mirror::quorum::{self, Verdict};
use crate::replica::mirror::set::{ReplicaSet, SetError};
use crate::replica::{FloorBook, Replica, ReplicaError, Stamp};
use crate::volume::{Device, DeviceError, MAX_REQUEST, RangeError, VolumeSpec, check_request};

/// How an engine is set up.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The id of this node; its replica is read first.
    pub local_id: NodeId,
    /// How long one replica may take to answer one request before it counts
    /// as failed for that request.
    pub replica_timeout: Duration,
    /// The volume: its size, extent size and `min_in_sync`.
    pub volume: VolumeSpec,
}

/// An engine could not be built from its configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid engine configuration: {0}")]
pub struct EngineConfigError(pub String);

/// The mirroring engine. See the module docs.
pub struct Engine {
    config: EngineConfig,
    replicas: Arc<ReplicaSet>,
    tracker: Arc<dyn InSyncTracker>,
    state: Mutex<EngineState>,
    /// Serializes in-sync shrinks (see the module docs).
    shrink: tokio::sync::Mutex<()>,
    /// Serializes mark-retirement passes: a pass drops a mark only if no
    /// write reached its extent since the pass took its batch, which it
    /// reads from `Activity::done`; a second pass running meanwhile could
    /// take that write's extent out of `done` before the first pass's
    /// recheck, and the first would drop the mark before the second's
    /// flush made the write durable.
    retiring: tokio::sync::Mutex<()>,
    /// Extent stripes: a write holds the stripes of its extents shared, a
    /// rebuild's extent copy holds one exclusively.
    stripes: Vec<RwLock<()>>,
    /// The extent size the stripes are counted in.
    extent_size: u64,
    /// One order for overlapping writes (S11, see [`crate::replica::mirror::order`]).
    order: Arc<WriteOrder>,
    /// When a client's write or discard last began, in milliseconds after
    /// `born` (0: never): rebuilds yield while clients write (see
    /// [`Engine::clients_writing`]).
    client_seen_ms: std::sync::atomic::AtomicU64,
    born: std::time::Instant,
    /// Counts the times this engine began or ended opening or handing out
    /// missed-write maps: a sweep of former members' maps (see
    /// [`Engine::close_maps_of_former_members`]) is done again when it
    /// moved, since such a map may have been opened after the sweep.
    maps_opened: std::sync::atomic::AtomicU64,
    /// What the fencer found (see [`FloorBook`]).
    floors: Arc<FloorBook>,
    /// The size served: the config's until an activation learns the
    /// committed size, then raised by each resize once committed.
    size: std::sync::atomic::AtomicU64,
    /// Wakes [`Engine::run_mark_ahead`] when marks ahead are due.
    ahead_due: tokio::sync::Notify,
    /// Whether a term is active, for tasks that have nothing to do until
    /// one is (see [`Engine::until_active`]); set with `term` only.
    active: tokio::sync::watch::Sender<bool>,
}

/// How many stripes the extents map onto.
const STRIPES: u64 = 64;

/// The stripes of extents `first..=last`, each once, in ascending order:
/// whoever holds several takes them in this order, so no two holders wait
/// on each other.
fn stripes_of(first: u64, last: u64) -> Vec<u64> {
    let mut stripes: Vec<u64> = (first..=last).map(|e| e % STRIPES).collect();
    stripes.sort_unstable();
    stripes.dedup();
    stripes
}

/// The generation an activation stamps its requests with first; the fencer
/// uses generation 0 of the term (see [`Engine::stamp`]).
const FIRST_GENERATION: u64 = 1;

/// Each replica's answer to one mirrored request, by replica id.
type Outcomes = BTreeMap<NodeId, Result<(), ReplicaError>>;

/// What [`Engine::settle`] decided.
enum Settled {
    /// Every member of the committed in-sync set has the request.
    Acknowledged,
    /// These members joined after the request was sent: send it to them.
    Missing(Vec<Arc<dyn Replica>>),
}

/// A replica being rebuilt.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Rebuild {
    /// Its return is being committed: a write it fails is not acknowledged.
    joining: bool,
    /// A write to it failed: the rebuild must not finish.
    failed: bool,
    /// The extents copied to it (marked with this term there).
    copied: BTreeSet<u64>,
}

/// What this term's writes did to each extent, for retiring the S6 marks
/// while the term runs (see [`Engine::retire_marks`]).
#[derive(Debug, Default)]
struct Activity {
    /// Writes in flight, per extent.
    in_flight: BTreeMap<u64, usize>,
    /// Extents whose writes all finished acknowledged since the last pass.
    done: BTreeSet<u64>,
    /// Extents that were `done` at the last pass: the next pass retires
    /// those no write reached meanwhile. An extent is retired only once it
    /// stayed idle for a whole pass, so a hot extent keeps its mark and its
    /// writes do not each pay a first touch again (see
    /// [`Engine::retire_marks`]).
    cooling: BTreeSet<u64>,
    /// Extents a write of this term may have left different on the in-sync
    /// replicas (it was not acknowledged): they stay marked for the next
    /// promotion to converge.
    unsure: BTreeSet<u64>,
    /// Older terms' marks are still on the members: the promotion's
    /// convergence made them agree but left making that durable, and
    /// dropping those marks, to the writer (see [`Engine::retire_marks`]).
    older_marks: bool,
    /// Follows this term's writes for a sequential stream to mark ahead of.
    ahead: Ahead,
    /// Extents to mark ahead, oldest first (see [`Engine::run_mark_ahead`]).
    marks_due: Vec<RangeInclusive<u64>>,
    /// Extents marked ahead that no write reached yet, with the retirement
    /// passes they waited through: retired after
    /// [`crate::replica::mirror::ahead::AHEAD_PASSES`].
    ahead_waiting: BTreeMap<u64, u32>,
}

/// Counts one write in flight on its extents; when dropped, records how it
/// ended (a write dropped before it finished counts as unacknowledged).
struct InFlight<'a> {
    engine: &'a Engine,
    extents: std::ops::RangeInclusive<u64>,
    acknowledged: bool,
    /// A mark ahead, not a write: its extents wait for a write afterwards.
    ahead: bool,
    /// The activation it was counted in; a later one's counts are not its.
    activation: u64,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut state = self.engine.lock();
        if state.activations != self.activation {
            // Counted in an earlier activation, whose activity is gone.
            return;
        }
        let activity = &mut state.activity;
        for extent in self.extents.clone() {
            if let Some(count) = activity.in_flight.get_mut(&extent) {
                *count -= 1;
                if *count == 0 {
                    activity.in_flight.remove(&extent);
                }
            }
            if self.ahead {
                // Its extents wait for a write since it began (`begin`).
            } else if self.acknowledged {
                activity.done.insert(extent);
            } else {
                activity.unsure.insert(extent);
            }
        }
    }
}

/// A stamped request sent and not yet answered; dropped armed (its future
/// was dropped), it disowns the request: see [`Engine::stamped`].
struct Unanswered<'a> {
    engine: &'a Engine,
    id: NodeId,
    stamp: Stamp,
    armed: bool,
}

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if self.armed {
            tracing::info!(replica = %self.id, lost = %self.stamp, "disowned a request dropped before its answer");
            self.engine
                .raise_generation(self.id, self.stamp.generation + 1);
        }
    }
}

struct EngineState {
    /// The active term; `None` while passive.
    term: Option<Term>,
    /// The committed in-sync set as last learned from the tracker.
    in_sync: BTreeSet<NodeId>,
    /// Members whose last request failed but could not be dropped.
    degraded: BTreeSet<NodeId>,
    /// Replicas being rebuilt (write-only members).
    rebuilding: BTreeMap<NodeId, Rebuild>,
    /// The generation each replica's requests are stamped with in this term
    /// (0 when absent); raised past any request whose outcome was lost.
    generations: BTreeMap<NodeId, u64>,
    /// This term's writes, per extent.
    activity: Activity,
    /// How many times the engine was activated: tells an [`InFlight`] of
    /// an earlier activation from one of the current.
    activations: u64,
    /// Extents copied to a replica by a rebuild that was abandoned: marked
    /// with this term there, retired once a later rebuild returns it.
    orphan_copies: BTreeMap<NodeId, BTreeSet<u64>>,
}

impl Engine {
    /// Builds an engine over `replicas` (which must include the local one),
    /// in a replica set of its own; see [`Engine::over`].
    pub fn new(
        config: EngineConfig,
        replicas: Vec<Arc<dyn Replica>>,
        tracker: Arc<dyn InSyncTracker>,
    ) -> Result<Self, EngineConfigError> {
        let set = ReplicaSet::new(config.local_id, replicas).map_err(|e| match e {
            SetError::Duplicate(_) => EngineConfigError("replica ids are not unique".into()),
            other => EngineConfigError(other.to_string()),
        })?;
        Self::over(config, Arc::new(set), tracker)
    }

    /// Builds an engine over the replica set `replicas`, which the node's
    /// fencer, resync and status share, and membership change edits. Until
    /// it is activated, it believes every member is in sync, which only
    /// steers where reads go.
    pub fn over(
        config: EngineConfig,
        replicas: Arc<ReplicaSet>,
        tracker: Arc<dyn InSyncTracker>,
    ) -> Result<Self, EngineConfigError> {
        if replicas.local_id() != config.local_id {
            return Err(EngineConfigError(format!(
                "the local replica {:?} is not among the replicas",
                config.local_id
            )));
        }
        let ids = replicas.ids();
        if config.volume.min_in_sync == 0 || config.volume.min_in_sync > ids.len() {
            return Err(EngineConfigError(format!(
                "min_in_sync {} must be between 1 and the number of replicas ({})",
                config.volume.min_in_sync,
                ids.len()
            )));
        }
        let extent_size = config.volume.extent_size;
        if !extent_size.is_power_of_two() {
            return Err(EngineConfigError(format!(
                "the extent size {extent_size} is not a power of two"
            )));
        }
        Ok(Self {
            replicas,
            tracker,
            state: Mutex::new(EngineState {
                term: None,
                in_sync: ids,
                degraded: BTreeSet::new(),
                rebuilding: BTreeMap::new(),
                generations: BTreeMap::new(),
                activity: Activity::default(),
                activations: 0,
                orphan_copies: BTreeMap::new(),
            }),
            shrink: tokio::sync::Mutex::new(()),
            retiring: tokio::sync::Mutex::new(()),
            stripes: (0..STRIPES).map(|_| RwLock::new(())).collect(),
            extent_size,
            order: Arc::default(),
            client_seen_ms: std::sync::atomic::AtomicU64::new(0),
            born: std::time::Instant::now(),
            maps_opened: std::sync::atomic::AtomicU64::new(0),
            floors: Arc::default(),
            size: std::sync::atomic::AtomicU64::new(config.volume.size),
            ahead_due: tokio::sync::Notify::new(),
            active: tokio::sync::watch::channel(false).0,
            config,
        })
    }

    /// The volume's size as this engine serves it.
    fn current_size(&self) -> u64 {
        self.size.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Reads the floors the node's fencer finds (see [`FloorBook`]).
    pub fn with_floor_book(mut self, floors: Arc<FloorBook>) -> Self {
        self.floors = floors;
        self
    }

    /// The active term, if any.
    pub fn term(&self) -> Option<Term> {
        self.lock().term
    }

    /// Resolves once a term is active (at once if one is): the writer's
    /// background passes wait here on a node that does not write, instead
    /// of waking every interval to find nothing to do (a node holds many
    /// volumes and writes only some).
    pub async fn until_active(&self) {
        let mut active = self.active.subscribe();
        let _ = active.wait_for(|active| *active).await;
    }

    /// Sets the active term in `state` (held) and tells the waiters of
    /// [`Engine::until_active`].
    fn set_term(&self, state: &mut EngineState, term: Option<Term>) {
        state.term = term;
        self.active.send_replace(term.is_some());
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, EngineState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The active term, the in-sync replicas a request must reach, and the
    /// replicas being rebuilt that it also goes to.
    #[allow(clippy::type_complexity)]
    fn targets(&self) -> Result<(Term, Vec<Arc<dyn Replica>>, Vec<Arc<dyn Replica>>), DeviceError> {
        let mut state = self.lock();
        let term = state.term.ok_or(DeviceError::Inactive)?;
        let members = self.replicas.members();
        // A replica being rebuilt that left the set misses this request: its
        // rebuild must not finish (it would return without the write).
        for (id, rebuild) in state.rebuilding.iter_mut() {
            if !members.iter().any(|r| r.id() == *id) {
                rebuild.failed = true;
            }
        }
        let pick = |keep: &dyn Fn(&NodeId) -> bool| -> Vec<Arc<dyn Replica>> {
            members.iter().filter(|r| keep(&r.id())).cloned().collect()
        };
        let targets = pick(&|id| state.in_sync.contains(id));
        if targets.len() < self.config.volume.min_in_sync {
            return Err(DeviceError::InsufficientReplicas {
                have: targets.len(),
                need: self.config.volume.min_in_sync,
            });
        }
        let rebuilding = pick(&|id| state.rebuilding.contains_key(id));
        Ok((term, targets, rebuilding))
    }

    /// The stripes of `[offset, offset+len)`, held shared, in order.
    async fn lock_span(&self, offset: u64, len: u64) -> Vec<RwLockReadGuard<'_, ()>> {
        let first = offset / self.extent_size;
        let last = (offset + len.max(1) - 1) / self.extent_size;
        let stripes = stripes_of(first, last);
        let mut guards = Vec::with_capacity(stripes.len());
        for stripe in stripes {
            guards.push(self.stripes[stripe as usize].read().await);
        }
        guards
    }

    /// Waits until every write that started before this call has finished.
    async fn barrier(&self) {
        for stripe in &self.stripes {
            drop(stripe.write().await);
        }
    }

    /// Sends one request to every in-sync replica and every replica being
    /// rebuilt at once, each bounded by the replica timeout, and settles the
    /// outcome (S5). A replica that joined the in-sync set while the request
    /// was in flight, without having been sent it, is sent it too before the
    /// request may be acknowledged: the ack needs every member of the set as
    /// committed *at the ack*, not as it was when the request began.
    #[tracing::instrument(
        level = "debug",
        name = "mirror",
        skip_all,
        fields(node = %self.config.local_id, term, role = "leader")
    )]
    async fn mirror<F, Fut>(&self, op: F) -> Result<(), DeviceError>
    where
        F: Fn(Stamp, Arc<dyn Replica>) -> Fut,
        Fut: std::future::Future<Output = Result<(), ReplicaError>>,
    {
        let (term, targets, rebuilding) = self.targets()?;
        tracing::Span::current().record("term", term.0);
        let mut outcomes = Outcomes::new();
        let mut send: Vec<Arc<dyn Replica>> = targets.into_iter().chain(rebuilding).collect();
        let mut joining_failed = None;
        loop {
            let sent = self.send_all(term, &send, &op).await;
            self.check_stale(&sent)?;
            joining_failed = joining_failed.or(self.note_rebuilt(&sent));
            outcomes.extend(sent);
            match self.settle(term, &outcomes).await? {
                Settled::Acknowledged => break,
                Settled::Missing(missing) => send = missing,
            }
        }
        match joining_failed {
            Some(id) => Err(DeviceError::Rejoining(id)),
            None => Ok(()),
        }
    }

    /// Sends `op` to each of `replicas` at once, each stamped with the
    /// replica's current generation and bounded by the replica timeout, and
    /// returns every outcome. A request whose outcome was lost is disowned.
    async fn send_all<F, Fut>(&self, term: Term, replicas: &[Arc<dyn Replica>], op: &F) -> Outcomes
    where
        F: Fn(Stamp, Arc<dyn Replica>) -> Fut,
        Fut: std::future::Future<Output = Result<(), ReplicaError>>,
    {
        let results =
            join_all(replicas.iter().map(|replica| {
                self.stamped(term, replica, |stamp| op(stamp, Arc::clone(replica)))
            }))
            .await;
        replicas
            .iter()
            .map(|replica| replica.id())
            .zip(results)
            .collect()
    }

    /// Sends one request to `replica`, stamped with its current generation
    /// and bounded by the replica timeout, and disowns it if its outcome is
    /// lost (see [`Engine::disown_if_lost`]) — also when this future is
    /// dropped before the answer came, for the request may be on the wire
    /// already (no late landing, S3).
    async fn stamped<T, Fut>(
        &self,
        term: Term,
        replica: &Arc<dyn Replica>,
        call: impl FnOnce(Stamp) -> Fut,
    ) -> Result<T, ReplicaError>
    where
        Fut: std::future::Future<Output = Result<T, ReplicaError>>,
    {
        let id = replica.id();
        let stamp = self.stamp(term, id);
        let mut unanswered = Unanswered {
            engine: self,
            id,
            stamp,
            armed: true,
        };
        let outcome = self.bounded(id, call(stamp)).await;
        unanswered.armed = false;
        self.disown_if_lost(id, stamp, &outcome);
        outcome
    }

    /// `call` to replica `id`, given up on once the replica falls silent
    /// for the replica timeout (see [`crate::replica::mirror::liveness`]).
    pub(super) async fn bounded<T>(
        &self,
        id: NodeId,
        call: impl std::future::Future<Output = Result<T, ReplicaError>>,
    ) -> Result<T, ReplicaError> {
        self.replicas
            .bounded(id, self.config.replica_timeout, call)
            .await
    }

    /// The stamp a request of `term` to replica `id` carries now. An
    /// activation starts at generation [`FIRST_GENERATION`], above the
    /// fencer's, so the engine's first request to each replica drains and
    /// shuts out any copy of the promotion's fence that is still on its way.
    fn stamp(&self, term: Term, id: NodeId) -> Stamp {
        Stamp {
            term,
            generation: self
                .lock()
                .generations
                .get(&id)
                .copied()
                .unwrap_or(FIRST_GENERATION),
        }
    }

    /// No late landing: when the outcome of a request stamped `used` on
    /// `id` is unknown (a timeout, a broken connection), raise the
    /// generation for `id`, so the next request there drains the lost one
    /// if it was admitted and makes the replica refuse it if it arrives
    /// later. Until then `id` counts as failed for that request.
    ///
    /// A replica whose floor is a later generation of this very term (only
    /// this writer writes at its term: an earlier request of its own got
    /// there first) refuses the request for good; the engine then moves
    /// past that floor for the replica, which disowns the same requests.
    fn disown_if_lost<T>(&self, id: NodeId, used: Stamp, outcome: &Result<T, ReplicaError>) {
        let next = match outcome {
            Err(ReplicaError::Unavailable(why)) => {
                tracing::info!(replica = %id, lost = %used, %why, "disowned a request whose outcome is unknown");
                used.generation + 1
            }
            Err(ReplicaError::StaleGeneration { floor, .. }) if floor.term == used.term => {
                floor.generation + 1
            }
            _ => return,
        };
        self.raise_generation(id, next);
    }

    /// Stamps requests to `id` with at least generation `next` from now on.
    fn raise_generation(&self, id: NodeId, next: u64) {
        let mut state = self.lock();
        let generation = state.generations.entry(id).or_insert(FIRST_GENERATION);
        *generation = (*generation).max(next);
    }

    /// A replica that refused the term means a newer writer fenced this
    /// one: deactivate and fail, shrinking nothing.
    fn check_stale(&self, outcomes: &Outcomes) -> Result<(), DeviceError> {
        for (id, outcome) in outcomes {
            if let Err(ReplicaError::StaleTerm { term, floor }) = outcome {
                tracing::warn!(%term, %floor, replica = %id, "fenced by a newer writer; deactivating");
                self.deactivate_term(*term);
                return Err(DeviceError::StaleTerm {
                    term: *term,
                    floor: *floor,
                });
            }
        }
        Ok(())
    }

    /// The in-sync replicas, this node's own first (where reads go).
    pub fn in_sync_replicas(&self) -> Vec<Arc<dyn Replica>> {
        self.read_order()
    }

    /// Counts a write to `[offset, offset+len)` as in flight until the
    /// returned guard drops. Refused, counting nothing, while the in-sync
    /// set is smaller than `min_in_sync`: such a write could not be
    /// acknowledged, and the gate tries a held write again every 50 ms; if
    /// each try left its extents unsure, their repair would spoil, every
    /// time, the very rebuild that lets writes go on.
    fn begin_write(&self, offset: u64, len: u64) -> Result<InFlight<'_>, DeviceError> {
        let state = self.lock();
        if state.term.is_none() {
            // Said first: an inactive engine's writes end the session.
            return Err(DeviceError::Inactive);
        }
        let (have, need) = (state.in_sync.len(), self.config.volume.min_in_sync);
        if have < need {
            return Err(DeviceError::InsufficientReplicas { have, need });
        }
        Ok(self.begin_in(state, offset, len, false))
    }

    /// Counts a write, or a mark ahead (`ahead`), to `[offset, offset+len)`
    /// as in flight until the returned guard drops. A mark ahead's extents
    /// wait for a write from now on; a write reaches them, and they stop
    /// waiting.
    fn begin(&self, offset: u64, len: u64, ahead: bool) -> InFlight<'_> {
        self.begin_in(self.lock(), offset, len, ahead)
    }

    /// [`Engine::begin`] under the state lock the caller holds.
    fn begin_in(
        &self,
        mut state: std::sync::MutexGuard<'_, EngineState>,
        offset: u64,
        len: u64,
        ahead: bool,
    ) -> InFlight<'_> {
        let first = offset / self.extent_size;
        let last = (offset + len.max(1) - 1) / self.extent_size;
        for extent in first..=last {
            *state.activity.in_flight.entry(extent).or_insert(0) += 1;
            if ahead {
                // Not retired while in flight; if it is still in flight
                // when it ages out, its mark stays until a write there is
                // retired or the next promotion converges it.
                state.activity.ahead_waiting.entry(extent).or_insert(0);
            } else {
                state.activity.ahead_waiting.remove(&extent);
            }
        }
        let extents = first..=last;
        // A write may continue a sequential stream (in the same lock).
        let due = !ahead && self.plan_marks_ahead(&mut state.activity, &extents);
        let activation = state.activations;
        drop(state);
        if due {
            self.ahead_due.notify_one();
        }
        InFlight {
            engine: self,
            extents,
            acknowledged: false,
            ahead,
            activation,
        }
    }

    /// The committed in-sync set as this engine last learned it.
    pub fn in_sync(&self) -> BTreeSet<NodeId> {
        self.lock().in_sync.clone()
    }

    /// Whether a client's write or discard began within `within` (one the
    /// in-sync set could take; see [`Engine::begin_write`]): a
    /// rebuild then copies one extent at a time, so that a client's write
    /// waits behind at most one small copy (on a stripe, on the channel,
    /// on the target's disk) and the rebuild takes what clients leave.
    pub fn clients_writing(&self, within: Duration) -> bool {
        let seen = self
            .client_seen_ms
            .load(std::sync::atomic::Ordering::Relaxed);
        let now = self.born.elapsed().as_millis() as u64;
        seen != 0 && now.saturating_sub(seen) <= within.as_millis() as u64
    }

    /// The extent size the engine copies in.
    pub fn extent_size(&self) -> u64 {
        self.extent_size
    }

    fn replica(&self, id: NodeId) -> Option<Arc<dyn Replica>> {
        self.replicas.get(id)
    }

    /// One change to `[offset, offset+len)` (a write or a discard), mirrored
    /// with S5, S6 and S11: its turn in the write order first, with no
    /// stripe held (an earlier overlapping write may itself wait for a
    /// stripe behind a rebuild's copy), then its stripes shared, counted in
    /// flight on its extents until it is answered.
    async fn change<F, Fut>(&self, offset: u64, len: u64, op: F) -> Result<(), DeviceError>
    where
        F: Fn(Stamp, Arc<dyn Replica>) -> Fut,
        Fut: std::future::Future<Output = Result<(), ReplicaError>>,
    {
        let _turn = self.order.enter(offset, len).await;
        let _span = self.lock_span(offset, len).await;
        let mut in_flight = self.begin_write(offset, len)?;
        // Only writes that can go on count: a rebuild does not yield to a
        // write held until it is done.
        let since_born = self.born.elapsed().as_millis().max(1) as u64;
        self.client_seen_ms
            .store(since_born, std::sync::atomic::Ordering::Relaxed);
        let result = self.mirror(op).await;
        in_flight.acknowledged = result.is_ok();
        result
    }

    /// Decides whether a mirrored request may be acknowledged: every member
    /// of the committed in-sync set must have succeeded, after the failed
    /// ones were removed by a commit, and at least `min_in_sync` must
    /// remain. Runs under the in-sync lock, so the set cannot change between
    /// the check and the answer. Members that were never sent the request
    /// are returned, to be sent it.
    async fn settle(&self, term: Term, outcomes: &Outcomes) -> Result<Settled, DeviceError> {
        let _serialized = self.shrink.lock().await;
        let current = self.lock().in_sync.clone();
        let succeeded: BTreeMap<NodeId, bool> = outcomes
            .iter()
            .map(|(id, outcome)| (*id, outcome.is_ok()))
            .collect();
        let need = self.config.volume.min_in_sync;
        let errors = |ids: &BTreeSet<NodeId>| -> BTreeMap<NodeId, String> {
            ids.iter()
                .map(|id| {
                    let why = match outcomes.get(id) {
                        Some(Err(err)) => err.to_string(),
                        _ => "no longer in the replica set".to_string(),
                    };
                    (*id, why)
                })
                .collect()
        };
        let restarted: BTreeSet<NodeId> = outcomes
            .iter()
            .filter(|(_, outcome)| matches!(outcome, Err(ReplicaError::Restarted(_))))
            .map(|(id, _)| *id)
            .collect();
        let verdict = quorum::judge(&current, &self.replicas.ids(), &succeeded, &restarted, need);
        let to_remove = match verdict {
            Verdict::Acknowledge => return Ok(Settled::Acknowledged),
            Verdict::SendTo(ids) => {
                let missing = ids.iter().filter_map(|id| self.replica(*id)).collect();
                return Ok(Settled::Missing(missing));
            }
            Verdict::TooFew { have, need, failed } => {
                tracing::warn!(%term, have, need, failed = ?errors(&failed), "write not acknowledged: too few in-sync replicas");
                self.lock().degraded.extend(failed);
                return Err(DeviceError::InsufficientReplicas { have, need });
            }
            Verdict::Remove(ids) => ids,
        };
        tracing::warn!(%term, removed = ?to_remove, errors = ?errors(&to_remove), "dropping replicas from the in-sync set");
        self.open_missed_maps(term, &to_remove, &current).await?;
        let committed = self
            .tracker
            .remove(term, &to_remove)
            .await
            .map_err(|e| DeviceError::InSyncCommit(e.to_string()))?;
        {
            let mut state = self.lock();
            state.in_sync = committed.clone();
            state.degraded.retain(|id| committed.contains(id));
        }
        match quorum::all_succeeded(&committed, &succeeded, need) {
            Ok(()) => Ok(Settled::Acknowledged),
            Err(have) => Err(DeviceError::InsufficientReplicas { have, need }),
        }
    }

    /// Deactivates only if still active at `term` (a newer activation wins).
    fn deactivate_term(&self, term: Term) {
        let mut state = self.lock();
        if state.term.is_some_and(|active| active <= term) {
            self.set_term(&mut state, None);
        }
    }

    /// The replicas to read from, in order: the local one first if in sync.
    fn read_order(&self) -> Vec<Arc<dyn Replica>> {
        let state = self.lock();
        let local = self.config.local_id;
        let mut order = self.in_sync_members(&state);
        order.sort_by_key(|r| r.id() != local);
        order
    }

    /// The members of the replica set that `state` counts as in sync, in
    /// the set's order.
    fn in_sync_members(&self, state: &EngineState) -> Vec<Arc<dyn Replica>> {
        self.replicas
            .members()
            .iter()
            .filter(|r| state.in_sync.contains(&r.id()))
            .cloned()
            .collect()
    }
}

#[async_trait]
impl Device for Engine {
    async fn read_at(&self, offset: u64, len: u64) -> Result<Bytes, DeviceError> {
        check_request(offset, len, self.current_size())?;
        let mut errors = Vec::new();
        for replica in self.read_order() {
            match self.bounded(replica.id(), replica.read(offset, len)).await {
                Ok(data) => return Ok(data),
                Err(err) => errors.push(format!("{}: {err}", replica.id())),
            }
        }
        if errors.is_empty() {
            errors.push("the in-sync set is empty".into());
        }
        Err(DeviceError::NoReadableReplica(errors.join("; ")))
    }

    /// The allocation of the first copy in the read order (this node's
    /// own while it is in sync): where it holds data, every in-sync copy
    /// holds the same bytes, and a hole reads as zeroes on all of them.
    async fn allocation(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<Vec<crate::volume::Extent>, DeviceError> {
        crate::volume::check_span(offset, len, self.current_size())?;
        let mut errors = Vec::new();
        for replica in self.read_order() {
            match self
                .bounded(replica.id(), replica.allocation(offset, len))
                .await
            {
                Ok(extents) => return Ok(extents),
                Err(err) => errors.push(format!("{}: {err}", replica.id())),
            }
        }
        if errors.is_empty() {
            errors.push("the in-sync set is empty".into());
        }
        Err(DeviceError::NoReadableReplica(errors.join("; ")))
    }

    async fn write_at(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), DeviceError> {
        check_request(offset, data.len() as u64, self.current_size())?;
        self.change(offset, data.len() as u64, |stamp, replica| {
            let data = data.clone();
            async move { replica.write(stamp, offset, data, fua).await }
        })
        .await
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        let size = self.current_size();
        let end = match offset.checked_add(len) {
            Some(end) if end <= size => end,
            _ => return Err(RangeError::OutOfRange { offset, len, size }.into()),
        };
        let mut at = offset;
        while at < end {
            let n = (end - at).min(MAX_REQUEST);
            self.change(at, n, |stamp, replica| async move {
                replica.discard(stamp, at, n).await
            })
            .await?;
            at += n;
        }
        Ok(())
    }

    async fn flush(&self) -> Result<(), DeviceError> {
        self.mirror(|stamp, replica| async move { replica.flush(stamp).await })
            .await
    }

    /// The engine holds nothing (the gate in front of it does).
    async fn change(
        &self,
        change: crate::volume::Change,
        _: &crate::volume::Bond,
    ) -> Result<(), DeviceError> {
        change.run_once(self).await
    }

    fn size(&self) -> u64 {
        self.current_size()
    }

    fn is_writable(&self) -> bool {
        self.term().is_some()
    }
}

#[async_trait]
impl WriterEngine for Engine {
    async fn activate(&self, term: Term) -> Result<(), DeviceError> {
        // Serialized with in-sync changes: one committed after the set was
        // read here must not be overwritten by the set read before it.
        let _serialized = self.shrink.lock().await;
        let committed = self
            .tracker
            .in_sync()
            .await
            .map_err(|e| DeviceError::InSyncCommit(e.to_string()))?;
        // The committed size, whatever this node's config says: every
        // in-sync replica has grown to it, and none need be larger.
        if let Some(size) = self
            .tracker
            .volume_size()
            .await
            .map_err(|e| DeviceError::InSyncCommit(e.to_string()))?
        {
            self.size.store(size, std::sync::atomic::Ordering::Release);
        }
        let mut state = self.lock();
        state.in_sync = committed;
        state.degraded.clear();
        state.rebuilding.clear();
        state.generations = self
            .floors
            .of_term(term)
            .into_iter()
            .map(|(id, floor)| (id, floor.generation.saturating_add(1).max(FIRST_GENERATION)))
            .collect();
        state.activity = Activity {
            // What the promotion's convergence copied and left marked.
            done: self.floors.take_copied(term),
            older_marks: true,
            ..Activity::default()
        };
        state.activations += 1;
        state.orphan_copies.clear();
        self.set_term(&mut state, Some(term));
        tracing::info!(%term, in_sync = ?state.in_sync, "engine active");
        Ok(())
    }

    fn deactivate(&self) {
        let mut state = self.lock();
        self.set_term(&mut state, None);
        state.rebuilding.clear();
    }

    async fn settle(&self) -> Result<(), DeviceError> {
        self.repair_unsure().await?;
        self.retire_all_marks().await?;
        Ok(())
    }

    fn replicas(&self) -> Vec<ReplicaStatus> {
        let state = self.lock();
        self.replicas
            .members()
            .iter()
            .map(|r| {
                let id = r.id();
                let state = if state.degraded.contains(&id) {
                    ReplicaState::Degraded
                } else if state.rebuilding.contains_key(&id) {
                    ReplicaState::Rebuilding
                } else if state.in_sync.contains(&id) {
                    ReplicaState::InSync
                } else {
                    ReplicaState::Offline
                };
                ReplicaStatus {
                    id,
                    state,
                    local: id == self.config.local_id,
                }
            })
            .collect()
    }
}
