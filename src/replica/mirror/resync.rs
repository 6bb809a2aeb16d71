//! Resync: bringing a returning or replaced replica back into the in-sync
//! set, online, copying only the extents that differ.
//!
//! The active writer runs [`Resyncer::run`]. Every `interval` it looks for
//! a replica that answers but is outside the committed in-sync set, and
//! rebuilds it through the engine (see [`crate::replica::mirror::engine`] for why this keeps
//! S5):
//! 1. `begin_rebuild`: the replica becomes a write-only member, so it cannot
//!    fall further behind while it is rebuilt;
//! 2. when the source keeps a missed-write map of the target (see
//!    [`crate::replica::disk::missed`]): each extent the map names, and each the target
//!    holds marks for, is compared and copied if it differs, under its
//!    stripe lock, up to four at once — the cost follows what the replica
//!    missed, not the volume's size. Otherwise (a new incarnation, a source
//!    without a map) a full digest pass: BLAKE3 digests of each 1 MiB
//!    extent, 64 extents per request, from an in-sync source and from the
//!    target (by allocation alone where either side holds a hole), copying
//!    each run that differs; the next step is compared while earlier ones
//!    are copied, so an empty disk costs what the source holds;
//! 3. `finish_rebuild`: the return is committed through Raft, conditional on
//!    this writer's term.
//!
//! Interruptions: a failed write to the target, a new term, or an error
//! aborts the rebuild, the replica stays out, and the next attempt (by this
//! writer or the next) compares digests again, so extents already copied
//! are not copied twice. The map stays open until the return commits, so
//! the next attempt compares what it names again — all of it, plus what
//! was written since. A full rebuild keeps its place in the map: it opens
//! the map with an unverified range from the first extent, and every
//! `raise_every` has the target flush and the in-sync replicas raise the
//! range past what it compared and copied; the next attempt compares the map's
//! extents below the range and the range, so a writer change costs at
//! most that interval's progress again (see [`crate::replica::disk::missed`]).
//!
//! The resyncer also closes the missed-write maps of removed members (see
//! [`Engine::close_maps_of_former_members`]) whenever the term or the
//! committed membership changes.
//!
//! The copy rate is limited by `rate` (bytes per second of copied data) so
//! a rebuild cannot starve client I/O: it delays the start of each copy,
//! never the copies already running (they hold stripe locks).

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::ops::RangeInclusive;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::time::Instant;

use crate::ids::{NodeId, Term};
use crate::replica::Replica;
use crate::replica::mirror::engine::Engine;
use crate::replica::mirror::engine::{MAX_COPY_RUN, RebuildError, RebuildPlan};
use crate::volume::Device;

/// How many copies (each a run of up to [`MAX_COPY_RUN`] extents) run at
/// once.
const COPIES_IN_FLIGHT: usize = 4;
/// While clients wrote this recently, a rebuild copies one extent at a
/// time (see [`Engine::clients_writing`]).
const CLIENTS_RECENT: Duration = Duration::from_millis(100);

/// How many copies of how many extents each a rebuild runs at once now:
/// [`COPIES_IN_FLIGHT`] runs of up to `longest` while no client writes,
/// one extent at a time while one does.
fn copy_pace(engine: &Engine, longest: u64) -> (usize, u64) {
    if engine.clients_writing(CLIENTS_RECENT) {
        (1, 1)
    } else {
        (COPIES_IN_FLIGHT, longest)
    }
}

/// A full pass raises the map's unverified range (see
/// [`Engine::verified_below`]) every `raise_every`, and also as soon as
/// what it verified moved this far since the last raise: a writer change
/// then costs at most this much compared again, however fast the pass
/// moves over holes. One raise runs at a time, beside the copies.
const RAISE_AFTER_BYTES: u64 = 64 << 20;

/// A full pass compares the next `step_extents` once fewer than
/// this many extents found to differ wait to be copied.
const LOOKAHEAD: usize = 2 * COPIES_IN_FLIGHT * MAX_COPY_RUN as usize;

/// What a full pass waits on: a comparison, a copy, a raise, or the rate
/// cap.
type Work<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Done> + Send + 'a>>;

/// A comparison's or a copy's outcome.
enum Done {
    /// The end of the bytes compared, and the extents that differ.
    Compared(Result<(u64, Vec<u64>), RebuildError>),
    /// A copy of this many extents of this step.
    Copied(u64, u64, Result<u64, RebuildError>),
    /// The unverified range raised (see [`Engine::verified_below`]).
    Raised(Result<(), RebuildError>),
    /// The rate cap lets the next copy start.
    Paced,
}

/// The next run to copy from `ready`: consecutive extents of one step, at
/// most `longest`, with that step.
fn next_run(ready: &mut VecDeque<(u64, u64)>, longest: u64) -> Option<(u64, RangeInclusive<u64>)> {
    let (first, step) = ready.pop_front()?;
    let mut last = first;
    while last - first + 1 < longest && ready.front() == Some(&(last + 1, step)) {
        ready.pop_front();
        last += 1;
    }
    Some((step, first..=last))
}

/// The steps of a full pass in order (each a range of bytes compared),
/// with how many of each one's differing extents are not copied yet: the
/// bytes below the first step with copies outstanding are verified.
#[derive(Debug)]
struct Steps {
    /// The number of the first step in `left`.
    first: u64,
    /// Each step not yet done: its end, and its extents not yet copied.
    left: VecDeque<(u64, u64)>,
    /// The end of the last step done.
    verified: u64,
}

impl Steps {
    fn new(from: u64) -> Self {
        Self {
            first: 0,
            left: VecDeque::new(),
            verified: from,
        }
    }

    /// A step compared up to `end`, `differing` extents to copy; returns
    /// its number.
    fn compared(&mut self, end: u64, differing: u64) -> u64 {
        self.left.push_back((end, differing));
        let step = self.first + self.left.len() as u64 - 1;
        self.settle();
        step
    }

    /// `extents` of step `step` were copied.
    fn copied(&mut self, step: u64, extents: u64) {
        if let Some((_, left)) = step
            .checked_sub(self.first)
            .and_then(|i| self.left.get_mut(i as usize))
        {
            *left = left.saturating_sub(extents);
        }
        self.settle();
    }

    fn settle(&mut self) {
        while let Some(&(end, 0)) = self.left.front() {
            self.left.pop_front();
            self.first += 1;
            self.verified = end;
        }
    }

    /// The end of the bytes compared, and copied where they differed.
    fn verified(&self) -> u64 {
        self.verified
    }
}

/// Which extents of `extent` bytes, from the start of a span of `len`
/// bytes whose allocation is `runs`, hold data (any byte not in a hole).
/// Runs that fall short of the span leave the rest as data.
fn with_data(runs: &[crate::volume::Extent], extent: u64, len: u64) -> Vec<bool> {
    let count = len.div_ceil(extent);
    let mut data = vec![false; count as usize];
    let mut at = 0u64;
    for run in runs {
        let end = at.saturating_add(run.len).min(len);
        if !run.hole && end > at {
            for i in at / extent..=(end - 1) / extent {
                data[i as usize] = true;
            }
        }
        at = end;
    }
    if at < len {
        for slot in &mut data[(at / extent) as usize..] {
            *slot = true;
        }
    }
    data
}

/// One rebuild's state, as it is reported.
struct Pass {
    id: NodeId,
    term: Term,
    started: Instant,
    /// Bytes this rebuild compares.
    total: u64,
    /// Bytes compared so far.
    done: u64,
    /// Bytes copied so far.
    copied: u64,
    /// Whether it compares an unverified range (a full rebuild, or the
    /// rest of one).
    full: bool,
}

/// After a rebuild of a replica fails, the next attempt waits this long,
/// doubling with each further failure up to [`RETRY_AFTER_MAX`], so that a
/// replica that answers but cannot be rebuilt (a full disk, say) is not
/// retried, and logged, at every interval.
const RETRY_AFTER: Duration = Duration::from_millis(500);
const RETRY_AFTER_MAX: Duration = Duration::from_secs(8);

/// How a resyncer runs.
#[derive(Debug, Clone, Copy)]
pub struct ResyncConfig {
    /// How often to look for a replica to rebuild: a replica that comes
    /// back waits at most this long for its rebuild to begin. After a
    /// failed rebuild the next attempt at that replica waits longer (see
    /// [`RETRY_AFTER`]).
    pub interval: Duration,
    /// The most bytes per second copied to a target (0: no limit).
    pub rate: u64,
    /// How many extents a full pass compares per step (one request for
    /// allocation or digests to each side).
    pub step_extents: u64,
    /// How often a full rebuild records how far it verified (see
    /// [`Engine::verified_below`]): what a writer change can cost it again.
    pub raise_every: Duration,
}

impl Default for ResyncConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(100),
            rate: 0,
            step_extents: 64,
            raise_every: Duration::from_millis(500),
        }
    }
}

/// One rebuild's progress.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Bytes compared so far.
    pub done: u64,
    /// Bytes this rebuild compares: the extents the missed-write map
    /// names, and for a full rebuild every extent from where it begins
    /// (the first, unless it resumes one a former writer began).
    pub total: u64,
    /// Bytes copied so far.
    pub copied: u64,
    /// Compared bytes per second so far.
    pub rate: f64,
    /// Seconds left at that rate.
    pub eta: f64,
    /// Whether the rebuild is running (false: the last one, finished or
    /// abandoned).
    pub running: bool,
    /// A full rebuild (every extent compared, or every one a former
    /// writer's full rebuild had not verified yet) rather than one of only
    /// the extents the missed-write map names.
    pub full: bool,
}

/// Rebuilds replicas that are reachable but out of sync. See the module
/// docs.
pub struct Resyncer {
    engine: Arc<Engine>,
    config: ResyncConfig,
    progress: Mutex<BTreeMap<NodeId, Progress>>,
    /// Replicas whose next rebuild compares every extent, by request.
    full: Mutex<BTreeSet<NodeId>>,
    /// Per replica whose last rebuild failed: when the next attempt may
    /// begin, and the wait that led to it (see [`RETRY_AFTER`]).
    retry: Mutex<BTreeMap<NodeId, (Instant, Duration)>>,
    /// The committed membership, when the resyncer also closes the
    /// missed-write maps of removed members (see
    /// [`Engine::close_maps_of_former_members`]).
    members: Option<Members>,
}

/// The resyncer's closing of former members' maps (see
/// [`Resyncer::closing_maps_of_former_members`]).
#[derive(Debug, Default)]
struct Sweep {
    /// The term, membership and count of maps opened (see
    /// [`Engine::maps_opened`]) it last closed every map for.
    done: Option<(Term, BTreeSet<NodeId>, u64)>,
    /// After a failed sweep: no new one before this.
    not_before: Option<Instant>,
}

/// Reads the committed membership (learners included).
pub type Members = Box<dyn Fn() -> BTreeSet<NodeId> + Send + Sync>;

impl Resyncer {
    /// A resyncer over the engine's replica set.
    pub fn new(engine: Arc<Engine>, config: ResyncConfig) -> Self {
        Self {
            engine,
            config,
            progress: Mutex::default(),
            full: Mutex::default(),
            retry: Mutex::default(),
            members: None,
        }
    }

    /// Also closes, whenever the term or `members` changes, the
    /// missed-write maps that replicas keep of nodes no longer members.
    pub fn closing_maps_of_former_members(mut self, members: Members) -> Self {
        self.members = Some(members);
        self
    }

    /// Makes the next rebuild of `id` a full one (every extent compared),
    /// whatever its missed-write map says; a rebuild of it that is running
    /// is abandoned so that the next one starts. Refused for a replica in
    /// the in-sync set (the scrub compares those).
    pub fn force_full(&self, id: NodeId) -> Result<(), RebuildError> {
        if self.engine.replica_set().get(id).is_none() {
            return Err(RebuildError::Unknown(id));
        }
        if self.engine.in_sync().contains(&id) {
            return Err(RebuildError::InSync(id));
        }
        self.full
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(id);
        self.retry().remove(&id);
        self.engine.spoil_rebuild(id);
        tracing::info!(replica = %id, "the next rebuild compares every extent (asked for)");
        Ok(())
    }

    /// Each replica's latest rebuild.
    pub fn progress(&self) -> BTreeMap<NodeId, Progress> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<NodeId, Progress>> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs forever (until the task is dropped).
    pub async fn run(self: Arc<Self>) {
        let mut sweep = Sweep::default();
        loop {
            tokio::time::sleep(self.config.interval).await;
            let Some(term) = self.engine.term() else {
                // Only the writer rebuilds: on a node that does not write
                // this volume, wait until it does instead of waking every
                // interval; the first look then comes an interval later.
                self.engine.until_active().await;
                continue;
            };
            self.close_maps_of_former_members(term, &mut sweep).await;
            let in_sync = self.engine.in_sync();
            for replica in self.engine.replica_set().members().iter() {
                let id = replica.id();
                let waiting = self
                    .retry()
                    .get(&id)
                    .is_some_and(|(at, _)| Instant::now() < *at);
                if in_sync.contains(&id) || waiting || replica.info().await.is_err() {
                    continue;
                }
                match self.rebuild(replica).await {
                    Ok(copied) => {
                        self.retry().remove(&id);
                        tracing::info!(replica = %id, copied, "resync finished");
                    }
                    Err(err) => {
                        let mut retry = self.retry();
                        let wait = retry
                            .get(&id)
                            .map_or(RETRY_AFTER, |(_, wait)| (*wait * 2).min(RETRY_AFTER_MAX));
                        retry.insert(id, (Instant::now() + wait, wait));
                        tracing::warn!(replica = %id, %err, retry_in = ?wait, "resync abandoned");
                    }
                }
            }
        }
    }

    fn retry(&self) -> std::sync::MutexGuard<'_, BTreeMap<NodeId, (Instant, Duration)>> {
        self.retry.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Closes former members' maps once per term, membership and count of
    /// maps opened. A sweep that failed (a keeper did not answer) is tried
    /// again only after [`RETRY_AFTER_MAX`]: it waits on every keeper, so a
    /// silent one would otherwise hold up every pass's rebuilds by the
    /// replica timeout.
    async fn close_maps_of_former_members(&self, term: Term, sweep: &mut Sweep) {
        let Some(members) = &self.members else {
            return;
        };
        // Read before the sweep: a map opened while it runs moves the
        // count, and the next pass sweeps again.
        let now = (term, members(), self.engine.maps_opened());
        // An empty membership is one not read yet, not a cluster of none.
        if now.1.is_empty()
            || sweep.done.as_ref() == Some(&now)
            || sweep.not_before.is_some_and(|at| Instant::now() < at)
        {
            return;
        }
        match self.engine.close_maps_of_former_members(&now.1).await {
            Ok(_) => {
                *sweep = Sweep {
                    done: Some(now),
                    not_before: None,
                }
            }
            Err(err) => {
                sweep.not_before = Some(Instant::now() + RETRY_AFTER_MAX);
                tracing::info!(%err, retry_in = ?RETRY_AFTER_MAX, "former members' missed-write maps not closed yet");
            }
        }
    }

    /// Rebuilds one replica; returns the bytes copied.
    pub async fn rebuild(&self, target: &Arc<dyn Replica>) -> Result<u64, RebuildError> {
        let id = target.id();
        let term = self.engine.begin_rebuild(id).await?;
        let outcome = match self.compare_and_copy(id, term).await {
            Ok(copied) => self.engine.finish_rebuild(id).await.map(|()| copied),
            Err(err) => {
                self.engine.abort_rebuild(id);
                Err(err)
            }
        };
        if let Some(progress) = self.lock().get_mut(&id) {
            progress.running = false;
        }
        outcome
    }

    /// The comparison of a begun rebuild: what the missed-write map names
    /// and, for a full rebuild, every extent from where the last one left
    /// off (from the first, for a new one). Returns the bytes copied.
    async fn compare_and_copy(&self, id: NodeId, term: Term) -> Result<u64, RebuildError> {
        let forced = self
            .full
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&id);
        let plan = if forced {
            None
        } else {
            self.engine.missed_plan(id).await?
        };
        let plan = match plan {
            Some(plan) => {
                tracing::info!(%term, replica = %id, extents = plan.extents.len(), unverified_from = ?plan.unverified_from, "resync started from the missed-write map");
                plan
            }
            None => {
                let why = if forced {
                    "asked for"
                } else {
                    "no missed-write map of this copy"
                };
                tracing::info!(%term, replica = %id, why, "full resync started");
                self.engine.begin_full_rebuild(id, term).await?;
                RebuildPlan {
                    extents: Vec::new(),
                    unverified_from: Some(0),
                }
            }
        };
        let extent = self.engine.extent_size();
        let listed = plan.extents.len() as u64 * extent;
        let unverified = plan
            .unverified_from
            .map_or(0, |from| self.engine.size().saturating_sub(from * extent));
        let mut pass = Pass {
            id,
            term,
            started: Instant::now(),
            total: listed + unverified,
            done: 0,
            copied: 0,
            full: plan.unverified_from.is_some(),
        };
        self.report(&pass);
        self.copy_listed(&mut pass, &plan.extents).await?;
        if let Some(from) = plan.unverified_from {
            self.copy_differences(&mut pass, from).await?;
        }
        if forced {
            self.full
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
        }
        Ok(pass.copied)
    }

    /// The digest pass from extent `from` to the end: compares every
    /// extent and copies those that differ; every `raise_every`, or
    /// [`RAISE_AFTER_BYTES`], it has the target flush and the in-sync
    /// replicas raise the map's unverified range past what is done, so a writer that takes over
    /// resumes from there.
    ///
    /// A pipeline, not a sequence of steps: the next `step_extents`
    /// are compared while the copies of earlier ones run, and the copies
    /// of one step go on while the last of the one before finishes. Each
    /// copy's size and how many run at once are chosen when it starts
    /// (see [`copy_pace`]), so a client that begins to write is yielded to
    /// at once. The range is raised only below extents all of whose
    /// copies are done ([`Steps`]).
    async fn copy_differences(&self, pass: &mut Pass, from: u64) -> Result<(), RebuildError> {
        let (id, term) = (pass.id, pass.term);
        let extent = self.engine.extent_size();
        let mut size = self.engine.size();
        let done_before = pass.done;
        // Bytes whose copy began, for the rate cap.
        let mut begun = pass.copied;
        // Where the next comparison starts.
        let mut next = from.saturating_mul(extent);
        let mut raised = Instant::now();
        let mut raised_to = next;
        let target = self.replica(id)?;
        let longest_run = (crate::volume::MAX_REQUEST / extent).clamp(1, MAX_COPY_RUN);
        let mut steps = Steps::new(next);
        // Extents found to differ and not yet copied, with their step.
        let mut ready: VecDeque<(u64, u64)> = VecDeque::new();
        let mut work: FuturesUnordered<Work<'_>> = FuturesUnordered::new();
        let (mut comparing, mut copying, mut raising, mut pacing) = (false, 0usize, false, false);
        loop {
            if self.engine.term() != Some(term) || self.engine.rebuild_failed(id) {
                return Err(RebuildError::Abandoned(id));
            }
            if !comparing && next < size && ready.len() < LOOKAHEAD {
                if self.engine.size() > size {
                    // Resized meanwhile: the target grows too, and the pass
                    // goes on to the new end.
                    self.engine.grow_target(id).await?;
                    let grown = self.engine.size();
                    pass.total += grown - size;
                    size = grown;
                }
                let len = (self.step_extents() * extent).min(size - next);
                let (source, target, at) = (self.source()?, Arc::clone(&target), next);
                work.push(Box::pin(async move {
                    let found = self.differing(&source, &target, at, len).await;
                    Done::Compared(found.map(|differing| (at + len, differing)))
                }));
                comparing = true;
                next += len;
            }
            let (in_flight, longest) = copy_pace(&self.engine, longest_run);
            while copying < in_flight && !ready.is_empty() {
                // The rate cap holds back the next copy, by the bytes
                // begun, not the pass: what runs is still polled.
                if let Some(wait) = self.held_back(pass.started, begun) {
                    if !pacing {
                        work.push(Box::pin(async move {
                            tokio::time::sleep(wait).await;
                            Done::Paced
                        }));
                        pacing = true;
                    }
                    break;
                }
                let Some((step, run)) = next_run(&mut ready, longest) else {
                    break;
                };
                let extents = run.end() - run.start() + 1;
                begun += extents * extent;
                work.push(Box::pin(async move {
                    let copied = self.engine.copy_differing_run(id, run).await;
                    Done::Copied(step, extents, copied)
                }));
                copying += 1;
            }
            let Some(done) = work.next().await else {
                break;
            };
            match done {
                Done::Compared(found) => {
                    comparing = false;
                    let (end, differing) = found?;
                    let step = steps.compared(end, differing.len() as u64);
                    ready.extend(differing.into_iter().map(|extent| (extent, step)));
                }
                Done::Copied(step, extents, copied) => {
                    copying -= 1;
                    pass.copied += copied?;
                    steps.copied(step, extents);
                }
                Done::Raised(raised_now) => {
                    raising = false;
                    raised_now?;
                }
                Done::Paced => pacing = false,
            }
            // Progress as it copies, not only per comparison: a step's
            // extents can take long to copy at a capped rate.
            let verified = steps.verified();
            pass.done = done_before + (verified - from.saturating_mul(extent));
            self.report(pass);
            // Raised beside the copies, which hold stripe locks: awaited
            // here, it would stall the client writes waiting on those.
            let due = raised.elapsed() >= self.config.raise_every
                || verified - raised_to >= RAISE_AFTER_BYTES;
            if !raising && due && verified > raised_to && verified < size {
                work.push(Box::pin(async move {
                    Done::Raised(
                        self.engine
                            .verified_below(id, term, verified / extent)
                            .await,
                    )
                }));
                (raising, raised, raised_to) = (true, Instant::now(), verified);
            }
        }
        Ok(())
    }

    /// The extents of `[offset, offset + len)` (whole extents from
    /// `offset`, which is one's start) where `target` differs from
    /// `source`, by allocation first: a hole on both sides is equal without
    /// a look, data over a hole differs without one; only extents with
    /// data on both sides (or a copy that cannot say) are compared by
    /// digest.
    async fn differing(
        &self,
        source: &Arc<dyn Replica>,
        target: &Arc<dyn Replica>,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u64>, RebuildError> {
        let extent = self.engine.extent_size();
        let count = len.div_ceil(extent) as usize;
        let mut differing = Vec::new();
        let mut unsure: Vec<usize> = (0..count).collect();
        if offset % extent == 0 {
            let (ours, theirs) = futures::join!(
                source.allocation(offset, len),
                target.allocation(offset, len)
            );
            // A copy that cannot say is all data: compared by digest.
            if let (Ok(ours), Ok(theirs)) = (ours, theirs) {
                let (ours, theirs) = (
                    with_data(&ours, extent, len),
                    with_data(&theirs, extent, len),
                );
                unsure.clear();
                for i in 0..count {
                    match (ours[i], theirs[i]) {
                        (false, false) => {}
                        (true, false) => differing.push(offset / extent + i as u64),
                        _ => unsure.push(i),
                    }
                }
            }
        }
        if !unsure.is_empty() {
            let (ours, theirs) =
                futures::join!(source.digests(offset, len), target.digests(offset, len));
            let (first, ours) =
                ours.map_err(|e| RebuildError::replica("digesting", source.id(), e))?;
            let (_, theirs) =
                theirs.map_err(|e| RebuildError::replica("digesting", target.id(), e))?;
            for i in unsure {
                if ours.get(i).is_none() || ours.get(i) != theirs.get(i) {
                    differing.push(first + i as u64);
                }
            }
        }
        differing.sort_unstable();
        Ok(differing)
    }

    /// The map's pass: compares and copies only `extents`, the ones the
    /// target may differ in (see [`Engine::missed_plan`]), a few at once.
    async fn copy_listed(&self, pass: &mut Pass, extents: &[u64]) -> Result<(), RebuildError> {
        let (id, term) = (pass.id, pass.term);
        let extent = self.engine.extent_size();
        let begun = AtomicU64::new(pass.copied);
        for batch in extents.chunks(self.step_extents() as usize) {
            if self.engine.term() != Some(term) || self.engine.rebuild_failed(id) {
                return Err(RebuildError::Abandoned(id));
            }
            let (in_flight, _) = copy_pace(&self.engine, 1);
            // The rate cap delays each copy's start by the bytes begun
            // before it, while the copies already running go on.
            let (started, begun) = (pass.started, &begun);
            let mut copies = futures::stream::iter(batch.iter().copied())
                .map(|at| async move {
                    let before = begun.fetch_add(extent, Ordering::Relaxed);
                    if let Some(wait) = self.held_back(started, before) {
                        tokio::time::sleep(wait).await;
                    }
                    self.engine.copy_extent(id, at).await
                })
                .buffer_unordered(in_flight);
            while let Some(bytes) = copies.next().await {
                pass.copied += bytes?;
                self.report(pass);
            }
            pass.done += batch.len() as u64 * extent;
            self.report(pass);
        }
        Ok(())
    }

    /// How long a copy must wait, after `bytes` begun since `since`, to
    /// keep within the rate limit, if it must. Judged on the bytes begun,
    /// not those done, so that copies start evenly spaced rather than a
    /// few at once and then a long wait.
    fn held_back(&self, since: Instant, bytes: u64) -> Option<Duration> {
        rate_wait(self.config.rate, since.elapsed(), bytes)
    }

    fn report(&self, pass: &Pass) {
        let seconds = pass.started.elapsed().as_secs_f64().max(1e-3);
        let done = pass.done.min(pass.total);
        let rate = done as f64 / seconds;
        let eta = if rate > 0.0 {
            (pass.total - done) as f64 / rate
        } else {
            0.0
        };
        self.lock().insert(
            pass.id,
            Progress {
                done,
                total: pass.total,
                copied: pass.copied,
                rate,
                eta,
                running: true,
                full: pass.full,
            },
        );
    }

    fn replica(&self, id: NodeId) -> Result<Arc<dyn Replica>, RebuildError> {
        self.engine
            .replica_set()
            .get(id)
            .ok_or(RebuildError::Unknown(id))
    }

    /// An in-sync replica to compare against.
    /// The configured step, within what one digest request may cover.
    fn step_extents(&self) -> u64 {
        self.config
            .step_extents
            .clamp(1, crate::replica::disk::store::MAX_DIGEST_EXTENTS)
    }

    fn source(&self) -> Result<Arc<dyn Replica>, RebuildError> {
        let in_sync = self.engine.in_sync();
        self.engine
            .replica_set()
            .members()
            .iter()
            .find(|r| in_sync.contains(&r.id()))
            .cloned()
            .ok_or(RebuildError::NoSource)
    }
}

/// How long to wait, `elapsed` after a pass began with `bytes` begun
/// since, to keep to `rate` bytes per second (0: no limit); `None` if not
/// at all.
fn rate_wait(rate: u64, elapsed: Duration, bytes: u64) -> Option<Duration> {
    if rate == 0 {
        return None;
    }
    let due = Duration::from_secs_f64(bytes as f64 / rate as f64);
    due.checked_sub(elapsed).filter(|wait| !wait.is_zero())
}

#[cfg(test)]
mod tests {
    use super::{rate_wait, with_data};
    use std::time::Duration;

    #[test]
    fn the_rate_cap_holds_a_copy_back_until_the_bytes_begun_are_due() {
        let (mib, secs) = (1u64 << 20, Duration::from_secs_f64);
        // 2 MiB begun at 1 MiB/s: due at 2 s.
        assert_eq!(rate_wait(mib, secs(0.5), 2 * mib), Some(secs(1.5)));
        assert_eq!(rate_wait(mib, secs(2.0), 2 * mib), None);
        assert_eq!(rate_wait(mib, secs(3.0), 2 * mib), None);
        // Nothing begun yet: the first copy starts at once.
        assert_eq!(rate_wait(mib, secs(0.0), 0), None);
        // No limit.
        assert_eq!(rate_wait(0, secs(0.0), 1 << 40), None);
    }
    use crate::volume::Extent;

    fn run(len: u64, hole: bool) -> Extent {
        Extent { len, hole }
    }

    #[test]
    fn an_extent_holds_data_if_any_of_its_bytes_does() {
        let runs = [
            run(1024, true),
            run(10, false),
            run(4096 - 1034, true),
            run(4096, true),
        ];
        assert_eq!(
            with_data(&runs, 1024, 8192),
            vec![false, true, false, false, false, false, false, false]
        );
        // A run of data across an extent boundary marks both.
        let runs = [run(1000, true), run(100, false), run(948, true)];
        assert_eq!(with_data(&runs, 1024, 2048), vec![true, true]);
        // A partial last extent.
        assert_eq!(
            with_data(&[run(1500, true)], 1024, 1500),
            vec![false, false]
        );
    }

    #[test]
    fn consecutive_extents_of_one_step_make_runs_no_longer_than_asked() {
        use super::next_run;
        let all = |extents: &[(u64, u64)], longest| {
            let mut ready: std::collections::VecDeque<(u64, u64)> =
                extents.iter().copied().collect();
            std::iter::from_fn(|| next_run(&mut ready, longest)).collect::<Vec<_>>()
        };
        assert_eq!(all(&[], 8), vec![]);
        let step0 = |e: &[u64]| e.iter().map(|e| (*e, 0)).collect::<Vec<_>>();
        assert_eq!(
            all(&step0(&[3, 4, 5, 9, 10, 12]), 8),
            vec![(0, 3..=5), (0, 9..=10), (0, 12..=12)]
        );
        assert_eq!(
            all(&step0(&[0, 1, 2, 3, 4]), 2),
            vec![(0, 0..=1), (0, 2..=3), (0, 4..=4)]
        );
        assert_eq!(all(&[(7, 0)], 1), vec![(0, 7..=7)]);
        // A run never spans two steps.
        assert_eq!(
            all(&[(62, 0), (63, 0), (64, 1), (65, 1)], 8),
            vec![(0, 62..=63), (1, 64..=65)]
        );
    }

    /// The bytes verified end where the first step with copies left
    /// begins, however the copies finish.
    #[test]
    fn only_steps_whose_copies_all_finished_count_as_verified() {
        use super::Steps;
        let mut steps = Steps::new(100);
        assert_eq!(steps.verified(), 100);
        let a = steps.compared(200, 2);
        let b = steps.compared(300, 0);
        let c = steps.compared(400, 1);
        assert_eq!((a, b, c), (0, 1, 2));
        assert_eq!(steps.verified(), 100, "a's copies are not done");
        steps.copied(c, 1);
        assert_eq!(steps.verified(), 100, "c is done, but not a");
        steps.copied(a, 1);
        assert_eq!(steps.verified(), 100, "one of a's two extents is left");
        steps.copied(a, 1);
        assert_eq!(steps.verified(), 400, "a, b and c are done");
        let d = steps.compared(500, 0);
        assert_eq!((d, steps.verified()), (3, 500), "nothing to copy: done");
    }

    #[test]
    fn runs_short_of_the_span_leave_the_rest_as_data() {
        assert_eq!(
            with_data(&[run(1024, true)], 1024, 3072),
            vec![false, true, true]
        );
        assert_eq!(with_data(&[], 1024, 2048), vec![true, true]);
        // Runs past the span are cut at its end.
        assert_eq!(
            with_data(&[run(1 << 40, true)], 1024, 2048),
            vec![false, false]
        );
    }
}
