//! The write gate in front of the engine.
//!
//! [`ActiveDevice`] is the [`Device`] the data path (the NBD server) writes
//! through. Reads and `size` pass to the engine; whether a passive node may
//! serve reads at all is the read gate's business ([`super::ReadGate`]).
//! Writes and flushes pass only while
//! 1. the controller has opened the gate for a term — after fencing (S1) —
//!    and not closed it since, **and**
//! 2. the coordinator's lease for that same term has not run out (S4).
//!
//! The second check is made on every request, so a node whose demotion is
//! late (a lost observation, a stalled controller) still stops writing at the
//! lease deadline, which no newer leader can precede. Opening and closing is
//! one atomic store: wait-free while writes are in flight. A write that
//! passed the gate just before it closed may still complete; it carries the
//! old term, so the replicas refuse it once the next writer fenced them (S2,
//! S3).
//!
//! [`Device::access`] reports the term the gate is open for, lease
//! included: the NBD server binds a read-write session to it and closes the
//! session as soon as the gate no longer grants that term (design C1), so a
//! deposed writer's sessions neither write nor read.
//!
//! **Draining.** The gate counts the writes and flushes that passed it and
//! have not finished; [`ActiveDevice::drained`] waits for that count to
//! reach zero. A planned hand-over closes the gate, then drains, so that
//! every request a client sent before is answered by this writer, under
//! its lease, before another is elected.
//!
//! **Degraded, not failed (design C2).** A write or flush that the engine
//! cannot acknowledge only because the in-sync set cannot take it now
//! ([`DeviceError::is_replica_shortfall`]: below `min_in_sync`, a change of
//! the set that did not commit, a returning replica that failed it) is
//! held, not failed: it is tried
//! again, each time through the gate again (so never past a closed gate or
//! a lapsed lease), until it succeeds or the suspend timeout passes, and
//! only then fails. Retrying is safe only while the client waits for this
//! answer: a held request is bound to its [`Bond`] — the term it was first
//! admitted under (its session's) and the session it came from — and is
//! abandoned ([`DeviceError::Abandoned`], no reply) as soon as a retry
//! finds the term changed or the session ended (#36: a client that
//! reconnected and sent it again, then wrote the same block, would
//! otherwise have the old copy land last, C1/S3). [`ActiveDevice::suspension`]
//! says how many requests wait, since when, and why.
//!
//! A [`GateJournal`], when one is attached, is told of every opening and
//! closing and of each write admitted, with the lease deadline it was
//! admitted under. From that record an auditor (the fault campaign) can
//! reconstruct when each node's gate was usable and check that no two nodes'
//! intervals overlapped.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::time::Instant;

use super::{Coordinator, WriterEngine};
use crate::ids::Term;
use crate::volume::{Access, Bond, Change, Device, DeviceError};

/// Receives the gate's history (see the module docs). Calls are made on the
/// write path, so an implementation must be quick and must not block long.
pub trait GateJournal: Send + Sync {
    /// The controller opened the gate for `term`, whose lease then ran
    /// until `deadline` (if there was one for that term).
    fn opened(&self, term: Term, deadline: Option<Instant>);
    /// A write or flush of `term` passed the gate under a lease that runs
    /// out at `deadline` (in the past only in a deliberately broken build).
    fn admitted(&self, term: Term, deadline: Instant);
    /// The controller closed the gate (it was open for `term`).
    fn closed(&self, term: Term);
}

/// The gated device. See the module docs.
pub struct ActiveDevice {
    engine: Arc<dyn WriterEngine>,
    coordinator: Arc<dyn Coordinator>,
    /// The term the gate is open for; 0 when closed (0 is never a term).
    open_term: AtomicU64,
    /// Writes and flushes that passed the gate and have not finished.
    in_flight: tokio::sync::watch::Sender<usize>,
    /// How long a request is held below `min_in_sync` before it fails.
    suspend_timeout: Duration,
    /// The requests held now.
    suspended: Mutex<Suspension>,
    journal: OnceLock<Arc<dyn GateJournal>>,
}

/// How often a held request is tried again.
pub const SUSPEND_RETRY: Duration = Duration::from_millis(50);

/// The requests held below `min_in_sync` (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Suspension {
    /// How many wait.
    pub waiting: usize,
    /// Since when requests have been waiting without a break.
    pub since: Option<Instant>,
    /// Why, in words: "1 in-sync replica of the 2 needed".
    pub why: String,
}

/// One held request, until it is released (or dropped).
struct Held<'a>(&'a ActiveDevice);

impl<'a> Held<'a> {
    fn new(device: &'a ActiveDevice, why: &DeviceError) -> Self {
        let mut now = device.lock_suspended();
        if now.waiting == 0 {
            now.since = Some(Instant::now());
            tracing::warn!(%why, "I/O suspended: writes are held until the in-sync set can take them");
        }
        now.waiting += 1;
        now.why = why.to_string();
        Self(device)
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        let mut now = self.0.lock_suspended();
        now.waiting = now.waiting.saturating_sub(1);
        if now.waiting == 0 {
            if let Some(since) = now.since.take() {
                tracing::info!(held = ?since.elapsed(), "I/O resumed");
            }
            now.why.clear();
        }
    }
}

/// One request that passed the gate, until it finishes (or is dropped).
struct Passing<'a>(&'a tokio::sync::watch::Sender<usize>);

impl<'a> Passing<'a> {
    fn new(in_flight: &'a tokio::sync::watch::Sender<usize>) -> Self {
        in_flight.send_modify(|n| *n += 1);
        Self(in_flight)
    }
}

impl Drop for Passing<'_> {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl ActiveDevice {
    pub(super) fn new(
        engine: Arc<dyn WriterEngine>,
        coordinator: Arc<dyn Coordinator>,
        suspend_timeout: Duration,
    ) -> Self {
        Self {
            engine,
            coordinator,
            open_term: AtomicU64::new(0),
            in_flight: tokio::sync::watch::channel(0).0,
            suspend_timeout,
            suspended: Mutex::default(),
            journal: OnceLock::new(),
        }
    }

    /// Records the gate's history to `journal` from now on. A second call
    /// is refused: the history must not be split between two journals.
    pub fn record_to(&self, journal: Arc<dyn GateJournal>) -> Result<(), &'static str> {
        self.journal
            .set(journal)
            .map_err(|_| "the gate already has a journal")
    }

    pub(super) fn open(&self, term: Term) {
        if let Some(journal) = self.journal.get() {
            let lease = self.coordinator.lease().filter(|lease| lease.term == term);
            journal.opened(term, lease.map(|lease| lease.deadline));
        }
        self.open_term.store(term.0, Ordering::SeqCst);
    }

    pub(super) fn close(&self) {
        let term = self.open_term.swap(0, Ordering::SeqCst);
        if let (Some(journal), true) = (self.journal.get(), term != 0) {
            journal.closed(Term(term));
        }
    }

    /// Waits until no write or flush that passed the gate is still running,
    /// or `within` has passed; returns how many still are (0 when
    /// drained). Close the gate first, or new requests keep it busy.
    pub async fn drained(&self, within: std::time::Duration) -> usize {
        let mut count = self.in_flight.subscribe();
        let _ = tokio::time::timeout(within, count.wait_for(|n| *n == 0)).await;
        *count.borrow()
    }

    /// The requests held below `min_in_sync` now.
    pub fn suspension(&self) -> Suspension {
        self.lock_suspended().clone()
    }

    fn lock_suspended(&self) -> std::sync::MutexGuard<'_, Suspension> {
        self.suspended.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `change` through the gate; while the engine cannot acknowledge
    /// it for too few in-sync replicas, holds it and tries again, through
    /// the gate each time, until the suspend timeout — and only while its
    /// `bond` holds: the same term as its first admission (its session's,
    /// if it names one) and a session that has not ended. Otherwise it is
    /// abandoned before it is sent again (see the module docs).
    async fn held(&self, change: &Change, bond: &Bond) -> Result<(), DeviceError> {
        let admitted = self.admit_bound(bond, bond.term())?;
        let _passing = Passing::new(&self.in_flight);
        let deadline = Instant::now() + self.suspend_timeout;
        let mut held = None;
        loop {
            match self.apply(change).await {
                Err(err) if err.is_replica_shortfall() && Instant::now() < deadline => {
                    held.get_or_insert_with(|| Held::new(self, &err));
                    tokio::time::sleep_until((Instant::now() + SUSPEND_RETRY).min(deadline)).await;
                    self.admit_bound(bond, Some(admitted))?;
                }
                outcome => return outcome,
            }
        }
    }

    /// Admits a request of `bond` (and tells the journal), at `term` if one
    /// is given; returns the term it was admitted under. A request whose
    /// session ended, or that another term would admit, is
    /// [`DeviceError::Abandoned`].
    fn admit_bound(&self, bond: &Bond, term: Option<Term>) -> Result<Term, DeviceError> {
        let (open, deadline) = self.admit()?;
        if bond.ended() || term.is_some_and(|term| term != open) {
            tracing::debug!(?bond, %open, "a held request was abandoned");
            return Err(DeviceError::Abandoned);
        }
        if let Some(journal) = self.journal.get() {
            journal.admitted(open, deadline);
        }
        Ok(open)
    }

    /// One try of `change` on the engine.
    async fn apply(&self, change: &Change) -> Result<(), DeviceError> {
        match change {
            Change::Write { offset, data, fua } => {
                self.engine.write_at(*offset, data.clone(), *fua).await
            }
            Change::Discard { offset, len } => self.engine.discard(*offset, *len).await,
            Change::Flush => self.engine.flush().await,
        }
    }

    /// Whether the controller has the gate open (the lease may still have
    /// run out; see [`ActiveDevice::writable_until`]).
    pub fn is_open(&self) -> bool {
        self.open_term.load(Ordering::SeqCst) != 0
    }

    /// The term the gate is open for, if it is.
    pub fn open_term(&self) -> Option<Term> {
        match self.open_term.load(Ordering::SeqCst) {
            0 => None,
            term => Some(Term(term)),
        }
    }

    /// Until when a write would pass the gate, if one would now.
    pub fn writable_until(&self) -> Option<Instant> {
        self.admit().ok().map(|(_, deadline)| deadline)
    }

    /// The gate's term and lease deadline if a write may pass now.
    fn admit(&self) -> Result<(Term, Instant), DeviceError> {
        let term = self.open_term().ok_or(DeviceError::NotLeader)?;
        match self.coordinator.lease() {
            Some(lease) if lease.covers(term, Instant::now()) => Ok((term, lease.deadline)),
            _ => Err(DeviceError::LeaseExpired),
        }
    }
}

#[async_trait]
impl Device for ActiveDevice {
    async fn read_at(&self, offset: u64, len: u64) -> Result<Bytes, DeviceError> {
        self.engine.read_at(offset, len).await
    }

    async fn allocation(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<Vec<crate::volume::Extent>, DeviceError> {
        self.engine.allocation(offset, len).await
    }

    async fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.held(&Change::Discard { offset, len }, &Bond::default())
            .await
    }

    async fn write_at(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), DeviceError> {
        self.held(&Change::Write { offset, data, fua }, &Bond::default())
            .await
    }

    async fn flush(&self) -> Result<(), DeviceError> {
        self.held(&Change::Flush, &Bond::default()).await
    }

    async fn change(&self, change: Change, bond: &Bond) -> Result<(), DeviceError> {
        self.held(&change, bond).await
    }

    fn size(&self) -> u64 {
        self.engine.size()
    }

    fn is_writable(&self) -> bool {
        self.admit().is_ok()
    }

    fn access(&self) -> Access {
        match self.admit() {
            Ok((term, _)) => Access::ReadWrite { term },
            Err(_) => Access::ReadOnly,
        }
    }
}
