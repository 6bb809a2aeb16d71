//! Resync: bringing a returning or replaced replica back into the in-sync
//! set, online, copying only the extents that differ.
//!
//! The active writer runs [`Resyncer::run`]. Every `interval` it looks for
//! a replica that answers but is outside the committed in-sync set, and
//! rebuilds it through the engine (see [`super::engine`] for why this keeps
//! S5):
//! 1. `begin_rebuild`: the replica becomes a write-only member, so it cannot
//!    fall further behind while it is rebuilt;
//! 2. when the source keeps a missed-write map of the target (see
//!    [`super::missed`]): each extent the map names, and each the target
//!    holds marks for, is compared and copied if it differs, under its
//!    stripe lock, up to four at once — the cost follows what the replica
//!    missed, not the volume's size. Otherwise (a new incarnation, a source
//!    without a map) a full digest pass: BLAKE3 digests of each 1 MiB
//!    extent, 64 extents per request, from an in-sync source and from the
//!    target, copying each extent that differs the same way; holes hash
//!    without being read, so an empty disk costs what the source holds;
//! 3. `finish_rebuild`: the return is committed through Raft, conditional on
//!    this writer's term.
//!
//! Interruptions need no bookkeeping: a failed write to the target, a new
//! term, or an error aborts the rebuild, the replica stays out, and the next
//! attempt (by this writer or the next) compares digests again, so extents
//! already copied are not copied twice. The map stays open until the
//! return commits, so the next attempt compares what it names again — all
//! of it, plus what was written since, which is the resumption a map
//! rebuild needs; a full pass starts again from the first extent.
//!
//! The copy rate is limited by `rate` (bytes per second of copied data) so
//! a rebuild cannot starve client I/O.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use tokio::time::Instant;

use super::engine::RebuildError;
use super::{Engine, Replica};
use crate::ids::{NodeId, Term};
use crate::volume::Device;

/// How many extents one digest request covers.
const EXTENTS_PER_PASS: u64 = 64;
/// How many extent copies run at once.
const COPIES_IN_FLIGHT: usize = 4;

/// How a resyncer runs.
#[derive(Debug, Clone, Copy)]
pub struct ResyncConfig {
    /// How often to look for a replica to rebuild.
    pub interval: Duration,
    /// The most bytes per second copied to a target (0: no limit).
    pub rate: u64,
}

impl Default for ResyncConfig {
    fn default() -> Self {
        Self {
            interval: Duration::from_millis(500),
            rate: 0,
        }
    }
}

/// One rebuild's progress.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Progress {
    /// Bytes of the volume compared so far.
    pub done: u64,
    /// The volume size.
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
    /// A full rebuild (every extent compared) rather than one of the
    /// extents the missed-write map names.
    pub full: bool,
}

/// Rebuilds replicas that are reachable but out of sync. See the module
/// docs.
pub struct Resyncer {
    engine: Arc<Engine>,
    config: ResyncConfig,
    progress: Mutex<BTreeMap<NodeId, Progress>>,
    /// Replicas whose next rebuild compares every extent, by request.
    full: Mutex<std::collections::BTreeSet<NodeId>>,
}

impl Resyncer {
    /// A resyncer over the engine's replica set.
    pub fn new(engine: Arc<Engine>, config: ResyncConfig) -> Self {
        Self {
            engine,
            config,
            progress: Mutex::default(),
            full: Mutex::default(),
        }
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
        loop {
            tokio::time::sleep(self.config.interval).await;
            if self.engine.term().is_none() {
                continue;
            }
            let in_sync = self.engine.in_sync();
            for replica in self.engine.replica_set().members().iter() {
                let id = replica.id();
                if in_sync.contains(&id) || replica.info().await.is_err() {
                    continue;
                }
                match self.rebuild(replica).await {
                    Ok(copied) => tracing::info!(replica = %id, copied, "resync finished"),
                    Err(err) => tracing::warn!(replica = %id, %err, "resync abandoned"),
                }
            }
        }
    }

    /// Rebuilds one replica; returns the bytes copied.
    pub async fn rebuild(&self, target: &Arc<dyn Replica>) -> Result<u64, RebuildError> {
        let id = target.id();
        let term = self.engine.begin_rebuild(id).await?;
        let forced = self
            .full
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&id);
        let plan = if forced {
            Ok(None)
        } else {
            self.engine.missed_plan(id).await
        };
        let outcome = match plan {
            Ok(Some(extents)) => {
                tracing::info!(%term, replica = %id, extents = extents.len(), "resync started from the missed-write map");
                self.copy_listed(id, term, &extents).await
            }
            Ok(None) => {
                let why = if forced {
                    "asked for"
                } else {
                    "no missed-write map of this copy"
                };
                tracing::info!(%term, replica = %id, why, "full resync started");
                let copied = self.copy_differences(id, term).await;
                if copied.is_ok() {
                    self.full
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&id);
                }
                copied
            }
            Err(err) => Err(err),
        };
        let outcome = match outcome {
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

    /// The digest pass: compares every extent and copies those that differ.
    async fn copy_differences(&self, id: NodeId, term: Term) -> Result<u64, RebuildError> {
        let mut total = self.engine.size();
        let extent = self.engine.extent_size();
        let started = Instant::now();
        let mut copied = 0u64;
        let mut offset = 0u64;
        self.report(id, 0, total, 0, started);
        let target = self.replica(id)?;
        while offset < total {
            if self.engine.term() != Some(term) || self.engine.rebuild_failed(id) {
                return Err(RebuildError::Abandoned(id));
            }
            if self.engine.size() > total {
                // Resized meanwhile: the target grows too, and the pass
                // goes on to the new end.
                self.engine.grow_target(id).await?;
                total = self.engine.size();
            }
            let len = (EXTENTS_PER_PASS * extent).min(total - offset);
            let source = self.source()?;
            let (ours, theirs) =
                futures::join!(source.digests(offset, len), target.digests(offset, len));
            let (first, ours) =
                ours.map_err(|e| RebuildError::replica("digesting", source.id(), e))?;
            let (_, theirs) = theirs.map_err(|e| RebuildError::replica("digesting", id, e))?;
            let differing: Vec<u64> = ours
                .iter()
                .enumerate()
                .filter(|(i, digest)| theirs.get(*i) != Some(*digest))
                .map(|(i, _)| first + i as u64)
                .collect();
            // A few extents at once: each copy holds only its own stripe,
            // and one pass's extents fall on distinct stripes.
            let mut copies = futures::stream::iter(differing)
                .map(|extent| self.engine.copy_extent(id, extent))
                .buffer_unordered(COPIES_IN_FLIGHT);
            while let Some(bytes) = copies.next().await {
                copied += bytes?;
                // Progress as it copies, not only per digest request: a
                // request's extents can take long to copy at a capped rate.
                self.report(id, offset, total, copied, started);
                self.throttle(copied, started).await;
            }
            offset += len;
            self.report(id, offset, total, copied, started);
        }
        Ok(copied)
    }

    /// The map's pass: compares and copies only `extents`, the ones the
    /// target may differ in (see [`Engine::missed_plan`]), a few at once.
    async fn copy_listed(
        &self,
        id: NodeId,
        term: Term,
        extents: &[u64],
    ) -> Result<u64, RebuildError> {
        let extent = self.engine.extent_size();
        let total = extents.len() as u64 * extent;
        let started = Instant::now();
        let mut copied = 0u64;
        self.report_pass(id, 0, total, 0, started, false);
        for (done, batch) in extents.chunks(EXTENTS_PER_PASS as usize).enumerate() {
            if self.engine.term() != Some(term) || self.engine.rebuild_failed(id) {
                return Err(RebuildError::Abandoned(id));
            }
            let mut copies = futures::stream::iter(batch.iter().copied())
                .map(|extent| self.engine.copy_extent(id, extent))
                .buffer_unordered(COPIES_IN_FLIGHT);
            let at = done as u64 * EXTENTS_PER_PASS * extent;
            while let Some(bytes) = copies.next().await {
                copied += bytes?;
                self.report_pass(id, at, total, copied, started, false);
                self.throttle(copied, started).await;
            }
            let at = (at + batch.len() as u64 * extent).min(total);
            self.report_pass(id, at, total, copied, started, false);
        }
        Ok(copied)
    }

    /// Sleeps as long as needed to keep `copied` within the rate limit.
    async fn throttle(&self, copied: u64, started: Instant) {
        if self.config.rate == 0 {
            return;
        }
        let due = Duration::from_secs_f64(copied as f64 / self.config.rate as f64);
        let elapsed = started.elapsed();
        if due > elapsed {
            tokio::time::sleep(due - elapsed).await;
        }
    }

    fn report(&self, id: NodeId, done: u64, total: u64, copied: u64, started: Instant) {
        self.report_pass(id, done, total, copied, started, true);
    }

    fn report_pass(
        &self,
        id: NodeId,
        done: u64,
        total: u64,
        copied: u64,
        started: Instant,
        full: bool,
    ) {
        let seconds = started.elapsed().as_secs_f64().max(1e-3);
        let rate = done as f64 / seconds;
        let eta = if rate > 0.0 {
            (total - done) as f64 / rate
        } else {
            0.0
        };
        self.lock().insert(
            id,
            Progress {
                done,
                total,
                copied,
                rate,
                eta,
                running: true,
                full,
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
