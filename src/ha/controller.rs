//! The controller: the per-node state machine that keeps one writer.
//!
//! ```text
//!            observe: is_self (lease valid)
//! Follower ───────────────────────────────▶ FencePending ──fence ok, promotion
//!    ▲                                         │   ▲        recorded, engine
//!    │ observe: !is_self, a newer term,        │   │        active, lease still
//!    │ the lease ran out, or stop              │   │        valid, nothing newer
//!    │                                         │   └ fence failed / timed out:
//!    └──────────────── Leader ◀────────────────┘     retry later, never write
//! ```
//!
//! Invariants:
//! - **S1.** The gate opens only after the [`Fencer`] returned Ok for this
//!   very term. A failed or timed-out fence leaves the node in
//!   `FencePending`, gate closed; it retries on the next observation or after
//!   `retry_interval`.
//! - **The seed's slow-fence window is closed.** Every await of a promotion
//!   (previous writer, fence, record) is abandoned as soon as a new
//!   observation arrives or `stop` is called; the gate is opened under the
//!   state lock only if no observation is pending, the controller is not
//!   stopped, and the lease of the term is still valid. The gate's own
//!   per-write lease check (S4) is the second wall.
//! - **One stint per term.** A node never opens its gate twice for the same
//!   term. Writes of an earlier stint carry the same token, so a fence at
//!   that term neither drains nor refuses those still in flight, and
//!   convergence would not see their marks as older. When the recorded
//!   writer is this node at the very term it leads (its lease lapsed while
//!   it stayed leader, or it restarted and was restored as leader of that
//!   term), it resigns instead, and the next election brings a fresh term —
//!   unless this controller itself recorded that promotion and never opened
//!   its gate for it (nothing was written), in which case it finishes it,
//!   or it is the only voter (no other replica, no one to hand over to),
//!   in which case it promotes at the same term again.
//!   The Raft state machine refuses a second promotion at a recorded term
//!   as well.
//! - **Demotion is immediate.** `!is_self`, a newer term, or a lease that ran
//!   out without an observation closes the gate before anything else.
//! - **Hand-over drains** (design C1). A planned hand-over
//!   ([`Controller::hand_over`], and [`Controller::stop`] on SIGTERM)
//!   closes the gate to new requests, waits for the ones that passed it to
//!   finish (at most [`DRAIN_LIMIT`]), settles (every acknowledged write
//!   durable everywhere, its marks retired, so the next writer has nothing
//!   to converge), deactivates the engine, and only then asks the
//!   coordinator to transfer. While it runs the controller does not
//!   promote; if the transfer fails and this node still leads, the one-stint
//!   rule has it resign for a fresh term.
//! - **Stop** hands over as above, once; later calls are no-ops, and `run`
//!   after `stop` returns `Stopped`.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::{
    ActiveDevice, Coordinator, FenceError, Fencer, HaError, Leadership, ReplicaStatus, Writer,
    WriterEngine,
};
use crate::ids::{NodeId, Term};
use crate::volume::Device;

/// The longest a hand-over waits for the requests in flight to finish. A
/// write takes far less unless a replica stalls; then the hand-over goes on
/// and the stalled request is left to the replicas' fences (S2, S3).
pub const DRAIN_LIMIT: Duration = Duration::from_secs(1);

/// Timing of the controller.
#[derive(Debug, Clone, Copy)]
pub struct ControllerConfig {
    /// How long one fence attempt may take before it counts as failed.
    pub fence_timeout: Duration,
    /// How soon a failed promotion step is tried again without a new
    /// observation.
    pub retry_interval: Duration,
    /// How long the gate holds a write or flush that too few in-sync
    /// replicas cannot acknowledge before it fails (design C2); zero fails
    /// at once.
    pub suspend_timeout: Duration,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        Self {
            fence_timeout: Duration::from_secs(2),
            retry_interval: Duration::from_millis(200),
            suspend_timeout: Duration::ZERO,
        }
    }
}

/// The controller's role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// Not the leader; the gate is closed.
    Follower,
    /// Leads, but has not yet fenced the previous writer; the gate is closed.
    FencePending,
    /// Fenced and promoted: the gate is open.
    Leader,
}

impl Role {
    /// The name used by status and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Follower => "follower",
            Role::FencePending => "fence_pending",
            Role::Leader => "leader",
        }
    }
}

/// A snapshot of the controller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The role.
    pub role: Role,
    /// The term of the latest observation acted on.
    pub term: Term,
    /// The leader of that observation.
    pub leader: Option<NodeId>,
    /// The writer fenced (or being fenced) on the latest promotion.
    pub prev_writer: Option<Writer>,
    /// Whether the write gate is open.
    pub active: bool,
    /// Failed or timed-out fence attempts since start.
    pub fence_failures: u64,
    /// Promotions (gate openings) since start.
    pub promotions: u64,
    /// Promotions refused because this node had already written at the
    /// term (see the module docs); each resigned for a fresh term.
    pub spent_terms: u64,
    /// The engine's replicas.
    pub replicas: Vec<ReplicaStatus>,
}

struct Inner {
    role: Role,
    term: Term,
    leader: Option<NodeId>,
    prev_writer: Option<Writer>,
    stopped: bool,
    running: bool,
    fence_failures: u64,
    promotions: u64,
    spent_terms: u64,
    /// The last term this controller recorded a promotion for.
    last_recorded: Option<Term>,
    /// The last term this controller opened its gate for.
    last_opened: Option<Term>,
    /// A planned hand-over is running: do not promote.
    handing_over: bool,
}

/// What the run loop does after a reconcile step.
enum Next {
    /// Look at the latest observation again at once.
    Again,
    /// Wait for a new observation, or until the instant (a retry, or the
    /// lease deadline to re-check).
    Wait(Option<Instant>),
}

/// The reconcile state machine. See the module docs.
pub struct Controller {
    coordinator: Arc<dyn Coordinator>,
    fencer: Arc<dyn Fencer>,
    engine: Arc<dyn WriterEngine>,
    device: Arc<ActiveDevice>,
    config: ControllerConfig,
    inner: Mutex<Inner>,
    stop: watch::Sender<bool>,
    /// Wakes the run loop to look at leadership again (after a hand-over).
    wake: watch::Sender<()>,
}

impl Controller {
    /// Builds a controller; its device starts passive.
    pub fn new(
        engine: Arc<dyn WriterEngine>,
        coordinator: Arc<dyn Coordinator>,
        fencer: Arc<dyn Fencer>,
        config: ControllerConfig,
    ) -> Self {
        let device = Arc::new(ActiveDevice::new(
            Arc::clone(&engine),
            Arc::clone(&coordinator),
            config.suspend_timeout,
        ));
        Self {
            coordinator,
            fencer,
            engine,
            device,
            config,
            inner: Mutex::new(Inner {
                role: Role::Follower,
                term: Term::ZERO,
                leader: None,
                prev_writer: None,
                stopped: false,
                running: false,
                fence_failures: 0,
                promotions: 0,
                spent_terms: 0,
                last_recorded: None,
                last_opened: None,
                handing_over: false,
            }),
            stop: watch::channel(false).0,
            wake: watch::channel(()).0,
        }
    }

    /// The gated device the data path writes through.
    pub fn device(&self) -> Arc<ActiveDevice> {
        Arc::clone(&self.device)
    }

    /// A snapshot of the controller's state.
    pub fn status(&self) -> Status {
        let inner = self.lock();
        Status {
            role: inner.role,
            term: inner.term,
            leader: inner.leader,
            prev_writer: inner.prev_writer.clone(),
            active: self.device.is_open(),
            fence_failures: inner.fence_failures,
            promotions: inner.promotions,
            spent_terms: inner.spent_terms,
            replicas: self.engine.replicas(),
        }
    }

    /// The live members, from the coordinator.
    pub async fn members(&self) -> Result<Vec<NodeId>, HaError> {
        self.coordinator.members().await
    }

    /// Drives the state machine until [`Controller::stop`] (then `Stopped`)
    /// or until the coordinator's observation stream ends. The gate is
    /// closed whenever this returns.
    pub async fn run(&self) -> Result<(), HaError> {
        {
            let mut inner = self.lock();
            if inner.stopped {
                return Err(HaError::Stopped);
            }
            if inner.running {
                return Err(HaError::AlreadyRunning);
            }
            inner.running = true;
        }
        // Reset `running` and close the gate however the loop ends,
        // cancellation included.
        struct Exit<'a>(&'a Controller);
        impl Drop for Exit<'_> {
            fn drop(&mut self) {
                self.0.demote(None, "controller loop ended");
                self.0.lock().running = false;
            }
        }
        let _exit = Exit(self);
        self.run_loop().await
    }

    /// A newer writer has fenced this node's replica at `term`: if this node
    /// writes (or is promoting) at an older term, it closes its gate now
    /// rather than at its next refused write. Best effort: the replicas
    /// refuse the old term either way (S2).
    pub fn step_down(&self, term: Term) {
        let (role, current) = {
            let inner = self.lock();
            (inner.role, inner.term)
        };
        if role != Role::Follower && current < term {
            self.demote(None, "fenced by a newer writer");
        }
    }

    /// Hands leadership to `to` (see the module docs): close the gate,
    /// drain, settle, deactivate, transfer. Returns once `to` leads, or the
    /// transfer's error.
    pub async fn hand_over(&self, to: NodeId) -> Result<(), HaError> {
        {
            let mut inner = self.lock();
            if inner.stopped {
                return Err(HaError::Stopped);
            }
            // Handing over to itself while writing: nothing to do. Closing
            // the gate first would make it give up its term for a fresh one
            // and maybe the leadership with it.
            let seen = self.coordinator.observe().borrow().clone();
            if seen.is_self && seen.leader == Some(to) && self.device.is_writable() {
                return Ok(());
            }
            inner.handing_over = true;
        }
        self.quiesce("handing over").await;
        let outcome = self.coordinator.transfer_to(to).await;
        self.lock().handing_over = false;
        // Look at leadership again, whatever came of it.
        self.wake.send_replace(());
        outcome
    }

    /// Hands over to the best successor (see the module docs) and stops
    /// for good. Idempotent.
    pub async fn stop(&self) -> Result<(), HaError> {
        let first = {
            let mut inner = self.lock();
            let first = !inner.stopped;
            inner.stopped = true;
            inner.handing_over = true;
            first
        };
        if first {
            // Before the run loop hears of the stop: its exit would close
            // the gate without draining.
            self.quiesce("stopping").await;
        }
        self.stop.send_replace(true);
        if first {
            tracing::info!(
                node = %self.coordinator.node_id(),
                "controller stopped; resigning"
            );
            self.coordinator.resign().await?;
        } else {
            self.demote(None, "stopped");
        }
        Ok(())
    }

    /// Closes the gate to new requests, lets the ones in flight finish,
    /// settles, and deactivates: this writer is done, and the next one has
    /// nothing to converge of it.
    async fn quiesce(&self, why: &str) {
        let was_open = self.device.open_term();
        self.device.close();
        let left = self.device.drained(DRAIN_LIMIT).await;
        if left > 0 {
            tracing::warn!(
                left,
                "requests still in flight after {DRAIN_LIMIT:?}; handing over"
            );
        }
        if let Some(term) = was_open {
            match self.engine.settle().await {
                Ok(()) => tracing::info!(%term, "drained and settled before handing over"),
                Err(err) => {
                    tracing::warn!(%term, %err, "could not settle; the next writer converges")
                }
            }
        }
        self.demote(None, why);
    }

    async fn run_loop(&self) -> Result<(), HaError> {
        let mut stop = self.stop.subscribe();
        let mut nudged = self.wake.subscribe();
        let mut observations = self.coordinator.observe();
        let campaign = self.coordinator.campaign();
        tokio::pin!(campaign);
        let mut campaigning = true;
        loop {
            if *stop.borrow_and_update() {
                return Err(HaError::Stopped);
            }
            let seen = observations.borrow_and_update().clone();
            let wake = match self.reconcile(&seen, &mut observations, &mut stop).await? {
                Next::Again => continue,
                Next::Wait(wake) => wake,
            };
            tokio::select! {
                changed = observations.changed() => {
                    if changed.is_err() {
                        return Err(HaError::Coordinator("observation stream ended".into()));
                    }
                }
                _ = stop.changed() => {}
                _ = nudged.changed() => {}
                result = &mut campaign, if campaigning => {
                    campaigning = false;
                    if let Err(err) = result {
                        tracing::warn!(%err, "campaign failed");
                    }
                }
                _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => {}
            }
        }
    }

    /// Acts on one observation.
    async fn reconcile(
        &self,
        seen: &Leadership,
        observations: &mut watch::Receiver<Leadership>,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Next, HaError> {
        if !seen.is_self {
            self.demote(Some(seen), "not the leader");
            return Ok(Next::Wait(None));
        }
        if self.lock().handing_over {
            // The hand-over closed the gate; it wakes the loop when done.
            return Ok(Next::Wait(None));
        }
        let lease = self
            .coordinator
            .lease()
            .filter(|lease| lease.covers(seen.term, Instant::now()));
        let (role, term) = {
            let inner = self.lock();
            (inner.role, inner.term)
        };
        if role == Role::Leader {
            match lease {
                Some(lease) if term == seen.term => return Ok(Next::Wait(Some(lease.deadline))),
                Some(_) => self.demote(Some(seen), "a newer term began"),
                None => self.demote(Some(seen), "the lease ran out"),
            }
        }
        if lease.is_none() {
            self.set_pending(seen);
            return Ok(self.retry_later());
        }
        self.promote(seen, observations, stop).await
    }

    /// Fence, record, activate, and open the gate for `seen.term` (S1).
    #[tracing::instrument(
        name = "promote",
        skip_all,
        fields(node = %self.coordinator.node_id(), term = %seen.term, role = "fence_pending")
    )]
    async fn promote(
        &self,
        seen: &Leadership,
        observations: &mut watch::Receiver<Leadership>,
        stop: &mut watch::Receiver<bool>,
    ) -> Result<Next, HaError> {
        let term = seen.term;
        self.set_pending(seen);

        let prev = match cancellable(observations, stop, self.coordinator.prev_writer(term)).await?
        {
            None => return Ok(Next::Again),
            Some(Err(err)) => {
                tracing::warn!(%term, %err, "could not read the previous writer");
                return Ok(self.retry_later());
            }
            Some(Ok(prev)) => prev,
        };
        let recorded_self = prev
            .as_ref()
            .is_some_and(|w| w.term == term && w.node == self.coordinator.node_id());
        // A promotion this very controller recorded but never opened (the
        // engine did not activate, the lease ran out just before) wrote
        // nothing: finish it instead of recording it again.
        let unopened = {
            let inner = self.lock();
            inner.last_recorded == Some(term) && inner.last_opened != Some(term)
        };
        // A sole voter has no other replica that could hold a late write of
        // its earlier stint or differ from its own, and no one to hand
        // leadership to: it goes on at the same term.
        if recorded_self && !unopened && !self.coordinator.sole_voter() {
            // This node already wrote at this term (its lease lapsed, or it
            // restarted and was restored as leader of the same term): writes
            // of that stint may still be in flight with this very token, so
            // the fence could not shut them out. Promote only at a fresh
            // term: hand leadership on, and let the next election raise it.
            tracing::warn!(
                %term,
                "term already used by this node's earlier stint; resigning for a fresh term"
            );
            self.lock().spent_terms += 1;
            if let Some(Err(err)) =
                cancellable(observations, stop, self.coordinator.resign_for_fresh_term()).await?
            {
                tracing::warn!(%term, %err, "could not resign");
            }
            return Ok(self.retry_later());
        }
        self.lock().prev_writer = prev.clone();

        let fence = tokio::time::timeout(
            self.config.fence_timeout,
            self.fencer.fence(prev.as_ref(), term),
        );
        let failure = match cancellable(observations, stop, fence).await? {
            None => return Ok(Next::Again),
            Some(Ok(Ok(()))) => None,
            Some(Ok(Err(err))) => Some(err),
            Some(Err(_)) => Some(FenceError::TimedOut(self.config.fence_timeout)),
        };
        if let Some(err) = failure {
            self.lock().fence_failures += 1;
            let err = HaError::FenceFailed(err);
            tracing::warn!(%term, prev = ?prev, %err, "staying fence_pending");
            return Ok(self.retry_later());
        }

        if !recorded_self || self.coordinator.sole_voter() {
            match cancellable(observations, stop, self.coordinator.record_promotion(term)).await? {
                None => return Ok(Next::Again),
                Some(Err(err)) => {
                    tracing::warn!(%term, %err, "could not record the promotion");
                    return Ok(self.retry_later());
                }
                Some(Ok(())) => self.lock().last_recorded = Some(term),
            }
        }
        if let Err(err) = self.engine.activate(term).await {
            tracing::warn!(%term, %err, "could not activate the engine");
            return Ok(self.retry_later());
        }
        self.open_gate(term, observations)
    }

    /// The last step of a promotion, under the state lock so that `stop`
    /// and a pending observation are seen.
    fn open_gate(
        &self,
        term: Term,
        observations: &watch::Receiver<Leadership>,
    ) -> Result<Next, HaError> {
        let mut inner = self.lock();
        if inner.stopped {
            self.engine.deactivate();
            return Err(HaError::Stopped);
        }
        if inner.handing_over {
            self.engine.deactivate();
            return Ok(Next::Wait(None));
        }
        if observations.has_changed().unwrap_or(true) {
            self.engine.deactivate();
            return Ok(Next::Again);
        }
        let lease = self
            .coordinator
            .lease()
            .filter(|lease| lease.covers(term, Instant::now()));
        let Some(lease) = lease else {
            self.engine.deactivate();
            tracing::warn!(%term, "lease ran out during promotion");
            return Ok(self.retry_later());
        };
        self.device.open(term);
        inner.last_opened = Some(term);
        inner.role = Role::Leader;
        inner.promotions += 1;
        tracing::info!(
            node = %self.coordinator.node_id(),
            %term,
            role = Role::Leader.as_str(),
            prev = ?inner.prev_writer,
            "promoted: gate open"
        );
        Ok(Next::Wait(Some(lease.deadline)))
    }

    fn set_pending(&self, seen: &Leadership) {
        let mut inner = self.lock();
        if inner.role != Role::FencePending || inner.term != seen.term {
            tracing::info!(
                node = %self.coordinator.node_id(),
                term = %seen.term,
                role = Role::FencePending.as_str(),
                "won leadership; fencing before promotion"
            );
        }
        inner.role = Role::FencePending;
        inner.term = seen.term;
        inner.leader = seen.leader;
    }

    /// Closes the gate and becomes a follower.
    fn demote(&self, seen: Option<&Leadership>, why: &str) {
        let mut inner = self.lock();
        self.device.close();
        self.engine.deactivate();
        if inner.role != Role::Follower {
            tracing::info!(
                node = %self.coordinator.node_id(),
                term = %inner.term,
                role = Role::Follower.as_str(),
                why,
                "demoted: gate closed"
            );
        }
        inner.role = Role::Follower;
        if let Some(seen) = seen {
            inner.term = seen.term;
            inner.leader = seen.leader;
        }
    }

    fn retry_later(&self) -> Next {
        Next::Wait(Some(Instant::now() + self.config.retry_interval))
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Runs `work` until it finishes (`Some`), a new observation arrives
/// (`None`), or the controller is stopped (`Stopped`).
async fn cancellable<T>(
    observations: &mut watch::Receiver<Leadership>,
    stop: &mut watch::Receiver<bool>,
    work: impl std::future::Future<Output = T>,
) -> Result<Option<T>, HaError> {
    tokio::select! {
        result = work => Ok(Some(result)),
        changed = observations.changed() => match changed {
            Ok(()) => Ok(None),
            Err(_) => Err(HaError::Coordinator("observation stream ended".into())),
        },
        _ = stop.changed() => Err(HaError::Stopped),
    }
}
