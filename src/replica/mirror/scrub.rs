//! Scrub: proving that every in-sync replica holds the same bytes, and
//! repairing the one that does not (design S11).
//!
//! One order (see [`crate::replica::mirror::order`]) keeps honest replicas identical; a
//! disk can still return other bytes than were written (bit rot, a bad
//! sector, a stray write by hand). Nothing else would notice: reads go to
//! one copy, and a rebuild compares only replicas that are out of sync. So
//! the active writer runs [`Scrubber::run`]:
//!
//! 1. a pass walks the volume 64 extents at a time and asks every in-sync
//!    replica for their BLAKE3 digests, without holding anything, so client
//!    writes go on;
//! 2. an extent whose digests differ is compared again under its stripe,
//!    where no write is in flight ([`Engine::scrub_extent`]); a difference
//!    that was only a write in flight vanishes there;
//! 3. a real difference is logged with the extent and the replicas, and the
//!    odd copies are overwritten from the copy a majority holds, or from
//!    the writer's own copy when no copy has a majority
//!    ([`crate::replica::mirror::quorum::copy_to_keep`]),
//!    then flushed. Without a majority nothing says the writer's copy is
//!    the right one, so the bytes it replaces are saved first, in
//!    `DATA_DIR/scrub-kept/`, and the log names the files.
//!
//! Passes run back to back at `scrub_rate` bytes compared per second (`0`:
//! only on request, and then at full speed). `replica-ha scrub` asks for a
//! pass now; `--now` ends a paced pass that is running, runs one at full
//! speed and waits for its findings. What the last pass found, and the
//! progress of one running, go to status and `/metrics`.
//!
//! Implementation caveats:
//! - Only the writer scrubs, and only while active: a pass ends at a change
//!   of term, and the next writer starts over from extent 0.
//! - A copy whose repair failed stays in the in-sync set; the next pass
//!   finds it again. Reads prefer the writer's copy, so a rotten writer copy
//!   is served until its repair succeeds (the optional end-to-end read check
//!   of the design is not built).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use futures::future::join_all;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;

use crate::replica::Replica;
use crate::replica::mirror::engine::Engine;
use crate::replica::mirror::engine::{ScrubError, ScrubFinding};
use crate::volume::Device;

/// How many extents one digest request covers.
const EXTENTS_PER_REQUEST: u64 = 64;
/// The pause between passes when scrubbing continuously.
const BETWEEN_PASSES: Duration = Duration::from_secs(1);

/// What the scrub has done, for status and metrics.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ScrubStatus {
    /// A pass is running.
    pub running: bool,
    /// Bytes of the volume compared by the running (or last) pass, of
    /// `total`.
    pub done: u64,
    pub total: u64,
    /// Passes begun, and passes finished (all of the volume compared).
    pub started: u64,
    pub passes: u64,
    /// When the last finished pass ended, and what it checked and found.
    pub last_finished: Option<SystemTime>,
    pub last_checked: u64,
    pub last_found: u64,
    pub last_repaired: u64,
    /// Differences found and repaired since this node started.
    pub found: u64,
    pub repaired: u64,
    /// Extents that could not be compared since this node started (a
    /// replica did not answer).
    pub unchecked: u64,
}

/// One pass's outcome.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PassReport {
    /// Which pass this was (counted from 1 as they begin).
    pub number: u64,
    /// Extents compared.
    pub checked: u64,
    /// Extents that could not be compared (a replica did not answer).
    pub unchecked: u64,
    /// Extents whose in-sync copies differed.
    pub findings: Vec<ScrubFinding>,
    /// Whether the pass compared the whole volume (false: ended by a change
    /// of term).
    pub complete: bool,
}

/// How the scrub runs.
#[derive(Debug, Clone)]
pub struct ScrubConfig {
    /// Bytes compared per second while scrubbing in the background; 0 means
    /// only on request.
    pub rate: u64,
    /// Where the bytes a repair without a majority replaced are saved
    /// (`None`: they are only logged as lost).
    pub keep_dir: Option<PathBuf>,
}

/// The writer's scrub. See the module docs.
pub struct Scrubber {
    engine: Arc<Engine>,
    config: ScrubConfig,
    status: watch::Sender<ScrubStatus>,
    /// Wakes the loop for a requested pass.
    requested: Notify,
    /// Requests waiting: the next pass runs unpaced if any asked for `now`.
    wanted: Mutex<Wanted>,
    /// The findings of the last finished pass.
    last: Mutex<PassReport>,
    /// Ends the running pass early (a request to scrub now), waking it if
    /// it is pacing itself.
    abort: AtomicBool,
    aborted: Notify,
}

#[derive(Debug, Default)]
struct Wanted {
    /// A pass was asked for.
    pass: bool,
    /// At full speed.
    hurry: bool,
}

impl Scrubber {
    /// A scrubber over the engine's replicas.
    pub fn new(engine: Arc<Engine>, config: ScrubConfig) -> Self {
        Self {
            engine,
            config,
            status: watch::Sender::new(ScrubStatus::default()),
            requested: Notify::new(),
            wanted: Mutex::default(),
            last: Mutex::default(),
            abort: AtomicBool::new(false),
            aborted: Notify::new(),
        }
    }

    /// What the scrub has done so far.
    pub fn status(&self) -> ScrubStatus {
        self.status.borrow().clone()
    }

    /// The configured background rate (bytes per second, 0: off).
    pub fn rate(&self) -> u64 {
        self.config.rate
    }

    /// Asks for a pass to start now, paced at the configured rate unless
    /// `hurry`; a hurried request ends a pass that is running (it does not
    /// count), a paced one lets it finish first.
    pub fn request(&self, hurry: bool) {
        {
            let mut wanted = self.lock();
            wanted.pass = true;
            wanted.hurry |= hurry;
        }
        if hurry && self.status.borrow().running {
            self.abort.store(true, Ordering::SeqCst);
            self.aborted.notify_one();
        }
        self.requested.notify_one();
    }

    /// Asks for a pass at full speed and waits until a pass that started
    /// after this call has finished; returns what it found. Fails with
    /// [`ScrubError::Inactive`] if this node is not, or stops being, the
    /// writer first.
    pub async fn scrub_now(&self) -> Result<PassReport, ScrubError> {
        if self.engine.term().is_none() {
            return Err(ScrubError::Inactive);
        }
        let mut status = self.status.subscribe();
        // Only a pass that begins after this request answers it (one
        // running now is ended by it).
        let begun = status.borrow().started;
        self.request(true);
        loop {
            // Also wake now and then: a node that stopped being the writer
            // starts no pass, and its status may not change.
            let _ = tokio::time::timeout(Duration::from_secs(1), status.changed()).await;
            let last = self.last_report();
            if last.number > begun {
                return Ok(last);
            }
            if !status.borrow().running && self.engine.term().is_none() {
                return Err(ScrubError::Inactive);
            }
        }
    }

    /// Runs passes until the task is dropped: back to back at the
    /// configured rate, or on request.
    pub async fn run(self: Arc<Self>) {
        loop {
            let pause = if self.config.rate == 0 {
                Duration::MAX
            } else {
                BETWEEN_PASSES
            };
            tokio::select! {
                () = self.requested.notified() => {}
                () = sleep_up_to(pause) => {}
            }
            let hurry = {
                let mut wanted = self.lock();
                let hurry = wanted.hurry;
                if !wanted.pass && self.config.rate == 0 {
                    continue;
                }
                *wanted = Wanted::default();
                hurry
            };
            if self.engine.term().is_none() {
                continue;
            }
            let rate = if hurry { 0 } else { self.config.rate };
            let report = self.pass(rate).await;
            tracing::info!(
                checked = report.checked,
                found = report.findings.len(),
                repaired = report.findings.iter().filter(|f| f.repaired).count(),
                complete = report.complete,
                "scrub pass ended"
            );
        }
    }

    /// One pass over the volume, comparing at most `rate` bytes per second
    /// (0: no limit).
    pub async fn pass(&self, rate: u64) -> PassReport {
        let total = self.engine.size();
        let extent_size = self.engine.extent_size();
        let term = self.engine.term();
        let started = Instant::now();
        // A request to end a pass is for one that began before it.
        self.abort.store(false, Ordering::SeqCst);
        let mut report = PassReport::default();
        self.status.send_modify(|s| {
            s.started += 1;
            report.number = s.started;
            s.running = true;
            s.done = 0;
            s.total = total;
        });
        let mut offset = 0;
        while offset < total {
            if term.is_none() || self.engine.term() != term || self.abort.load(Ordering::SeqCst) {
                break;
            }
            let len = (EXTENTS_PER_REQUEST * extent_size).min(total - offset);
            let first = offset / extent_size;
            let extents = len.div_ceil(extent_size);
            match self.suspects(offset, len).await {
                Ok(suspects) => {
                    report.checked += extents;
                    for extent in suspects {
                        self.check(extent, &mut report).await;
                    }
                }
                Err(err) => {
                    tracing::warn!(%err, first, extents, "scrub could not compare these extents");
                    report.unchecked += extents;
                    self.status.send_modify(|s| s.unchecked += extents);
                }
            }
            offset += len;
            self.status.send_modify(|s| s.done = offset);
            tokio::select! {
                () = pace(offset, rate, started) => {}
                () = self.aborted.notified() => {}
            }
        }
        report.complete = offset >= total && !self.abort.load(Ordering::SeqCst);
        if report.complete {
            *self.last.lock().unwrap_or_else(|p| p.into_inner()) = report.clone();
        }
        self.status.send_modify(|s| {
            s.running = false;
            if report.complete {
                s.passes += 1;
                s.last_finished = Some(SystemTime::now());
                s.last_checked = report.checked;
                s.last_found = report.findings.len() as u64;
                s.last_repaired = report.findings.iter().filter(|f| f.repaired).count() as u64;
            }
        });
        report
    }

    /// The extents of `[offset, offset+len)` whose digests differ among the
    /// in-sync replicas right now (writes in flight may cause some).
    async fn suspects(&self, offset: u64, len: u64) -> Result<Vec<u64>, ScrubError> {
        let members: Vec<Arc<dyn Replica>> = self.engine.in_sync_replicas();
        // Bounded like every engine request: a silent replica ends this
        // comparison with an error instead of stalling the pass.
        let answers = join_all(
            members
                .iter()
                .map(|r| self.engine.bounded(r.id(), r.digests(offset, len))),
        )
        .await;
        let mut lists = Vec::with_capacity(members.len());
        for (replica, answer) in members.iter().zip(answers) {
            let (first, digests) = answer.map_err(|cause| ScrubError::Replica {
                step: "digesting",
                replica: replica.id(),
                cause,
            })?;
            lists.push((first, digests));
        }
        let extent_size = self.engine.extent_size();
        let first = offset / extent_size;
        let count = len.div_ceil(extent_size) as usize;
        for ((answered, digests), replica) in lists.iter().zip(&members) {
            if *answered != first || digests.len() != count {
                return Err(ScrubError::Replica {
                    step: "digesting",
                    replica: replica.id(),
                    cause: crate::replica::ReplicaError::InvalidRequest(format!(
                        "answered {} digests from extent {answered} for {count} from extent {first}",
                        digests.len()
                    )),
                });
            }
        }
        let Some((_, reference)) = lists.first() else {
            return Ok(Vec::new());
        };
        Ok((0..count)
            .filter(|i| lists.iter().any(|(_, d)| d[*i] != reference[*i]))
            .map(|i| first + i as u64)
            .collect())
    }

    /// Compares one suspect extent under its stripe and records a finding.
    async fn check(&self, extent: u64, report: &mut PassReport) {
        match self.engine.scrub_extent(extent).await {
            Ok(None) => {}
            Ok(Some(mut finding)) => {
                self.keep_replaced(&mut finding);
                if finding.repaired {
                    tracing::warn!(
                        extent,
                        differing = ?finding.differing,
                        source = %finding.source,
                        "scrub: in-sync copies differed; repaired from the copy kept"
                    );
                } else {
                    tracing::error!(
                        extent,
                        differing = ?finding.differing,
                        source = %finding.source,
                        "scrub: in-sync copies differ and the repair failed; the next pass tries again"
                    );
                }
                self.status.send_modify(|s| {
                    s.found += 1;
                    s.repaired += u64::from(finding.repaired);
                });
                report.findings.push(finding);
            }
            Err(err) => {
                tracing::warn!(extent, %err, "scrub could not compare an extent");
                report.checked = report.checked.saturating_sub(1);
                report.unchecked += 1;
                self.status.send_modify(|s| s.unchecked += 1);
            }
        }
    }

    /// Saves the bytes a repair without a majority replaced, one file per
    /// replica, and logs where; then drops them from the finding.
    fn keep_replaced(&self, finding: &mut ScrubFinding) {
        let replaced = std::mem::take(&mut finding.replaced);
        if replaced.is_empty() {
            return;
        }
        let stamp = SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        for (replica, bytes) in replaced {
            let Some(dir) = &self.config.keep_dir else {
                tracing::error!(extent = finding.extent, %replica, "scrub: no majority; replica's copy replaced by the writer's and not saved");
                continue;
            };
            let path = dir.join(format!(
                "extent-{}-node-{replica}-{stamp}.img",
                finding.extent
            ));
            let saved = std::fs::create_dir_all(dir).and_then(|()| std::fs::write(&path, &bytes));
            match saved {
                Ok(()) => tracing::warn!(
                    extent = finding.extent,
                    %replica,
                    path = %path.display(),
                    "scrub: no majority; kept the writer's copy and saved the one it replaced"
                ),
                Err(err) => tracing::error!(
                    extent = finding.extent,
                    %replica,
                    path = %path.display(),
                    %err,
                    "scrub: no majority; could not save the copy the writer's replaced"
                ),
            }
        }
    }

    /// What the last finished pass found.
    fn last_report(&self) -> PassReport {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Wanted> {
        self.wanted.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Sleeps `pause`, or forever for `Duration::MAX`.
async fn sleep_up_to(pause: Duration) {
    if pause == Duration::MAX {
        std::future::pending::<()>().await;
    }
    tokio::time::sleep(pause).await;
}

/// Sleeps as long as needed to keep `done` bytes within `rate` per second.
async fn pace(done: u64, rate: u64, started: Instant) {
    if rate == 0 {
        return;
    }
    let due = Duration::from_secs_f64(done as f64 / rate as f64);
    let elapsed = started.elapsed();
    if due > elapsed {
        tokio::time::sleep(due - elapsed).await;
    }
}
