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

use async_trait::async_trait;
use tokio::sync::watch;
use tokio::time::Instant;

use super::HaError;

/// One observation of who leads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Leadership {
    /// The leader's node id; `None` while there is no leader.
    pub leader: Option<String>,
    /// Whether the leader is this node *and* its lease is valid.
    pub is_self: bool,
    /// The term of the observation (non-decreasing).
    pub term: u64,
}

/// This node's lease: it leads `term` at least until `deadline`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// The term the lease is for.
    pub term: u64,
    /// When it runs out, unless renewed.
    pub deadline: Instant,
}

impl Lease {
    /// Whether this lease covers `term` at `now`.
    pub fn covers(&self, term: u64, now: Instant) -> bool {
        self.term == term && now < self.deadline
    }
}

/// The last writer that was promoted: the one a new leader must fence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Writer {
    /// Its node id.
    pub node: String,
    /// The term it wrote with.
    pub term: u64,
}

/// Leader election with a lease, plus the promotion record. See the module
/// docs for the contract. All methods are safe to call concurrently;
/// cancellation is by dropping the future.
#[async_trait]
pub trait Coordinator: Send + Sync {
    /// This node's stable id: the `leader` of a [`Leadership`] when it leads.
    fn node_id(&self) -> &str;

    /// Waits until this node leads with a valid lease. Returns at once when
    /// it already does.
    async fn campaign(&self) -> Result<(), HaError>;

    /// Hands leadership to a peer if this node leads; a no-op otherwise. The
    /// controller closes its gate before it calls this.
    async fn resign(&self) -> Result<(), HaError>;

    /// Whether this node is the only voter: no other node could lead, hold
    /// a replica, or be handed leadership.
    fn sole_voter(&self) -> bool;

    /// A stream of observations that holds the current one from the start.
    /// Its sender is dropped when the coordinator shuts down.
    fn observe(&self) -> watch::Receiver<Leadership>;

    /// The nodes heard from within the lease.
    async fn members(&self) -> Result<Vec<String>, HaError>;

    /// This node's current lease, if it leads.
    fn lease(&self) -> Option<Lease>;

    /// The last promoted writer as of `term`: waits until the state this
    /// node leads with at `term` is current, so the answer is not stale.
    async fn prev_writer(&self, term: u64) -> Result<Option<Writer>, HaError>;

    /// Records that this node is the writer of `term`. Must fail, recording
    /// nothing, unless this node still leads `term`.
    async fn record_promotion(&self, term: u64) -> Result<(), HaError>;
}

/// Shuts the previous writer out before a new one writes (S1).
#[async_trait]
pub trait Fencer: Send + Sync {
    /// Fences every writer older than `term`, `prev_writer` among them (it
    /// may be `None` on a fresh volume). Ok only once no write of an older
    /// term can be acknowledged; idempotent.
    async fn fence(&self, prev_writer: Option<&Writer>, term: u64) -> Result<(), String>;
}
