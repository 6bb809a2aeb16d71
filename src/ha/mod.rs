//! The reconcile core: who may write, and when.
//!
//! This module is pure logic over traits; it imports no tonic, openraft or
//! sled, so every transition can be tested against the in-memory fakes in
//! `fake` (built only for tests: `cfg(test)` or the feature `testing`).
//!
//! - [`Coordinator`] elects a leader and reports it ([`Leadership`]). Its
//!   term is both the lease and the fencing token. It also exposes the live
//!   [`Lease`] deadline that the gate checks on every write (S4).
//! - [`Fencer`] shuts the previous writer out before a new one writes (S1).
//! - [`InSyncTracker`] holds the committed in-sync set; the engine and the
//!   fencer change it only through a commit (S5).
//! - [`WriterEngine`] is the data plane the gate fronts: a [`Device`] that can
//!   be activated with a term.
//! - [`Controller`] is the state machine `Follower → FencePending → Leader`.
//! - [`ActiveDevice`] is the write gate.
//! - [`ReadGate`] is the read gate in front of it: a passive node reads its
//!   own replica only while that replica is in the committed in-sync set.
//!
//! The safety argument, in the order a promotion runs:
//! 1. The gate opens only from the controller, only after the fencer
//!    reported success for this term (S1), the promotion was recorded, the
//!    engine was activated with the term, no newer observation arrived
//!    meanwhile, and the lease for that same term is still valid. A fence that
//!    is slow while leadership is lost is abandoned: the observation cancels
//!    it, and the final check refuses to open.
//! 2. Every write through the gate re-checks that the lease of the gate's
//!    term has not expired (S4), so a controller that missed its demotion
//!    still cannot write past the deadline.
//! 3. Every write carries the term to the replicas (S2), which refuse it once
//!    a newer writer fenced them (S3), so even a write that passed the gate
//!    a moment before the deadline cannot land after the next fence.

mod controller;
mod coordinator;
#[cfg(any(test, feature = "testing"))]
pub mod fake;
mod gate;
mod reads;

use async_trait::async_trait;

pub use controller::{Controller, ControllerConfig, Role, Status};
pub use coordinator::{
    Coordinator, FenceError, Fencer, InSyncError, InSyncTracker, Leadership, Lease, Writer,
};
pub use gate::{ActiveDevice, GateJournal, SUSPEND_RETRY};
pub use reads::{LocalCopy, ReadGate};

use crate::ids::{NodeId, Term};
use crate::volume::{Device, DeviceError};

/// The data plane as the controller drives it: a device whose writes are
/// stamped with the term it was activated with.
#[async_trait]
pub trait WriterEngine: Device {
    /// Starts stamping writes with `term`, after loading the committed
    /// in-sync set. Fails if that set cannot be read.
    async fn activate(&self, term: Term) -> Result<(), DeviceError>;
    /// Stops writing: every later write fails until the next activation.
    fn deactivate(&self);
    /// Before a planned hand-over, with no write in flight: makes every
    /// acknowledged write durable on every in-sync replica and drops the
    /// marks that writes made (S6), so that the next writer has nothing
    /// to converge. Best effort: what is left marked is converged as after
    /// a crash.
    async fn settle(&self) -> Result<(), DeviceError>;
    /// The state of each replica, for status.
    fn replicas(&self) -> Vec<ReplicaStatus>;
}

/// The state of one replica as the engine sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplicaState {
    /// A member of the committed in-sync set; holds every acknowledged write.
    InSync,
    /// A member of the in-sync set whose last request failed, kept because
    /// dropping it would leave fewer than `min_in_sync` members; writes are
    /// not acknowledged until it answers again.
    Degraded,
    /// Not in the in-sync set; a resync is bringing it back.
    Rebuilding,
    /// Not in the in-sync set and not being rebuilt.
    Offline,
}

impl ReplicaState {
    /// The name used in status output and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicaState::InSync => "in_sync",
            ReplicaState::Degraded => "degraded",
            ReplicaState::Rebuilding => "rebuilding",
            ReplicaState::Offline => "offline",
        }
    }
}

/// One replica's line in a status report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaStatus {
    /// The node holding the replica.
    pub id: NodeId,
    /// Its state.
    pub state: ReplicaState,
    /// Whether it is this node's own replica.
    pub local: bool,
}

/// Errors of the control plane.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HaError {
    /// This node is not the active writer.
    #[error("not the active writer (not leader)")]
    NotLeader,
    /// Fence-before-promote could not confirm the old writer is shut out; the
    /// node stays passive.
    #[error("fence failed, refusing to promote: {0}")]
    FenceFailed(#[from] FenceError),
    /// The controller was stopped.
    #[error("controller stopped")]
    Stopped,
    /// `run` was called while another `run` is going on.
    #[error("controller is already running")]
    AlreadyRunning,
    /// The coordinator failed or its observation stream ended.
    #[error("coordinator: {0}")]
    Coordinator(String),
    /// The replicated state machine refused a committed request, changing
    /// nothing (its term is not the recorded writer's, or it is stale).
    #[error("refused: {0}")]
    Refused(String),
}
