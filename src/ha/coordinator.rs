//! The coordination and fencing seams.
//!
//! A [`Coordinator`] elects one leader per term and tells this node whether
//! it is that leader. Its contract, which the controller's safety rests on:
//! - `term` never decreases and rises on every change of leader, and a term
//!   has at most one leader: it is a fencing token;
//! - a lost lease surfaces on [`Coordinator::observe`] as `is_self: false`;
//!   and because an observation can be late or lost, [`Coordinator::lease`]
//!   gives the deadline until which this node's leadership of a term is
//!   guaranteed, which the gate checks on every write (S4). No other node
//!   may be elected for a newer term before that deadline has passed.
//!
//! A [`Fencer`] shuts the previous writer out: it returns Ok only once no
//! write of an older term can be acknowledged any more (S1). When in doubt it
//! must fail: a failed fence keeps the new leader passive, which is safe; a
//! false success lets two writers corrupt the volume.
//!
//! An [`InSyncTracker`] holds the committed in-sync set, and is the only way
//! the writer's engine and the fencer change it (S5). Raft's coordinator
//! provides the durable, committed one.

use std::collections::BTreeSet;

use async_trait::async_trait;
use tokio::sync::watch;
use tokio::time::Instant;

use super::HaError;
use crate::ids::{NodeId, Term};

/// One observation of who leads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Leadership {
    /// The leader's node id; `None` while there is no leader.
    pub leader: Option<NodeId>,
    /// Whether the leader is this node *and* its lease is valid.
    pub is_self: bool,
    /// The term of the observation (non-decreasing).
    pub term: Term,
}

/// This node's lease: it leads `term` at least until `deadline`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// The term the lease is for.
    pub term: Term,
    /// When it runs out, unless renewed.
    pub deadline: Instant,
}

impl Lease {
    /// Whether this lease covers `term` at `now`.
    pub fn covers(&self, term: Term, now: Instant) -> bool {
        self.term == term && now < self.deadline
    }
}

/// The last writer that was promoted: the one a new leader must fence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Writer {
    /// Its node id.
    pub node: NodeId,
    /// The term it wrote with.
    pub term: Term,
}

/// Leader election with a lease, plus the promotion record. See the module
/// docs for the contract. All methods are safe to call concurrently;
/// cancellation is by dropping the future.
#[async_trait]
pub trait Coordinator: Send + Sync {
    /// This node's stable id: the `leader` of a [`Leadership`] when it leads.
    fn node_id(&self) -> NodeId;

    /// Waits until this node leads with a valid lease. Returns at once when
    /// it already does.
    async fn campaign(&self) -> Result<(), HaError>;

    /// Hands leadership to a peer if this node leads; a no-op otherwise. The
    /// controller closes its gate before it calls this.
    async fn resign(&self) -> Result<(), HaError>;

    /// Gives up the current term for a newer one: hands leadership to a
    /// peer, or, when no peer takes over (none can win: their logs are
    /// behind), starts an election of its own at a higher term. Used by a
    /// leader whose term it already wrote in (see the controller).
    async fn resign_for_fresh_term(&self) -> Result<(), HaError> {
        self.resign().await
    }

    /// Hands leadership to node `to` and returns once it leads; fails with
    /// [`HaError::NotLeader`] if this node does not lead. The controller
    /// closes (and drains) its gate before it calls this, so the target
    /// may campaign at once.
    async fn transfer_to(&self, to: NodeId) -> Result<(), HaError>;

    /// Whether this node is the only voter: no other node could lead, hold
    /// a replica, or be handed leadership.
    fn sole_voter(&self) -> bool;

    /// A stream of observations that holds the current one from the start.
    /// Its sender is dropped when the coordinator shuts down.
    fn observe(&self) -> watch::Receiver<Leadership>;

    /// The nodes heard from within the lease.
    async fn members(&self) -> Result<Vec<NodeId>, HaError>;

    /// This node's current lease, if it leads.
    fn lease(&self) -> Option<Lease>;

    /// The last promoted writer as of `term`: waits until the state this
    /// node leads with at `term` is current, so the answer is not stale.
    async fn prev_writer(&self, term: Term) -> Result<Option<Writer>, HaError>;

    /// Records that this node is the writer of `term`. Must fail, recording
    /// nothing, unless this node still leads `term`.
    async fn record_promotion(&self, term: Term) -> Result<(), HaError>;
}

/// Shuts the previous writer out before a new one writes (S1).
#[async_trait]
pub trait Fencer: Send + Sync {
    /// Fences every writer older than `term`, `prev_writer` among them (it
    /// may be `None` on a fresh volume). Ok only once no write of an older
    /// term can be acknowledged; idempotent.
    async fn fence(&self, prev_writer: Option<&Writer>, term: Term) -> Result<(), FenceError>;
}

/// Why a fence did not shut the previous writer out; the new leader stays
/// passive and tries again.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FenceError {
    /// A replica has taken a newer term than the one being fenced with.
    #[error("replica {replica} has seen term {floor} > {term}: a newer writer exists")]
    NewerWriter {
        replica: NodeId,
        floor: Term,
        term: Term,
    },
    /// Too few replicas took the term for no older writer to reach
    /// `min_in_sync` of them.
    #[error(
        "only {fenced} of {replicas} replicas took term {term}; {need} are needed to shut out the old writer"
    )]
    TooFewFenced {
        term: Term,
        fenced: usize,
        replicas: usize,
        need: usize,
    },
    /// None of the fenced replicas is in the committed in-sync set, so
    /// none holds every acknowledged write.
    #[error("no fenced replica is in the in-sync set {in_sync:?}; waiting for one")]
    NoInSyncFenced { in_sync: BTreeSet<NodeId> },
    /// The in-sync set could not be read or changed.
    #[error(transparent)]
    InSync(#[from] InSyncError),
    /// The fence did not finish within the controller's fence timeout.
    #[error("timed out after {0:?}")]
    TimedOut(std::time::Duration),
    /// No in-sync replica is left to converge from.
    #[error("no in-sync replica to converge from")]
    NoSource,
    /// The fenced replicas count their marks in different extent sizes.
    #[error("replica {replica} reports extent size {reported}, not {expected}")]
    ExtentSize {
        replica: NodeId,
        reported: u64,
        expected: u64,
    },
    /// A request to a replica failed while converging.
    #[error("{step} on {replica}: {cause}")]
    Replica {
        step: &'static str,
        replica: NodeId,
        cause: String,
    },
}

impl FenceError {
    /// A failed `step` (`"digesting extent"`, `"flushing"`, …) on `replica`.
    pub fn replica(step: &'static str, replica: NodeId, cause: impl std::fmt::Display) -> Self {
        Self::Replica {
            step,
            replica,
            cause: cause.to_string(),
        }
    }
}

/// The committed in-sync set, and the only way the engine may change it.
///
/// Invariant (S5): every member holds every acknowledged write. So a replica
/// that missed a write must be removed — durably, by a committed change —
/// *before* that write is acknowledged, and it returns only through a
/// finished resync.
#[async_trait]
pub trait InSyncTracker: Send + Sync {
    /// The committed in-sync set.
    async fn in_sync(&self) -> Result<BTreeSet<NodeId>, InSyncError>;
    /// Commits the return of rebuilt `replicas` on behalf of the writer of
    /// `term` and returns the committed set. Fails, changing nothing, unless
    /// `term` is the recorded writer's.
    async fn add(
        &self,
        term: Term,
        replicas: &BTreeSet<NodeId>,
    ) -> Result<BTreeSet<NodeId>, InSyncError>;
    /// Commits the removal of `replicas` on behalf of the writer of `term`
    /// and returns the committed set. Fails, changing nothing, when the
    /// writer of `term` can no longer commit (it was deposed).
    async fn remove(
        &self,
        term: Term,
        replicas: &BTreeSet<NodeId>,
    ) -> Result<BTreeSet<NodeId>, InSyncError>;
    /// The volume's committed size, once its config is fixed.
    async fn volume_size(&self) -> Result<Option<u64>, InSyncError>;
    /// Commits the volume's growth to `size` bytes on behalf of the writer
    /// of `term`, which has grown every in-sync replica first. Fails,
    /// changing nothing, unless `term` is the recorded writer's and `size`
    /// is at least the committed size.
    async fn resize(&self, term: Term, size: u64) -> Result<(), InSyncError>;
}

/// Why the in-sync set could not be read or changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InSyncError {
    /// The change was refused, and nothing changed: its term is not the
    /// recorded writer's.
    #[error("in-sync change refused: {0}")]
    Refused(String),
    /// The change could not be committed: no quorum, a newer leader, or
    /// shutting down.
    #[error("in-sync change not committed: {0}")]
    Uncommitted(String),
}
