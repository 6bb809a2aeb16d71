//! The mirror wing: the writer's side of the data plane (the *upstairs*).
//!
//! - [`engine`]: the synchronous mirror over every in-sync copy (S5), with
//!   [`order`] (one order for overlapping writes, S11), [`ahead`] (marks
//!   ahead of a sequential writer, S6) and [`liveness`] (when a copy counts
//!   as failed: silent, not busy). A folder: the core and its S5 decision
//!   in `engine/mod.rs`, and one file beside it for each other job (marks,
//!   rebuilds, missed-write maps, extent repairs, membership and resize).
//! - [`set`]: the volume's replicas by id, shared with the fencer, resync
//!   and status; [`quorum`]: the counting rules (S1, S5) as pure functions.
//! - [`fencer`]: fence before promote and the promotion's convergence (S1,
//!   S6).
//! - [`resync`]: the online rebuild of a copy out of sync (S5, C4).
//! - [`scrub`]: the background comparison and repair of the in-sync copies
//!   (S11).

pub mod ahead;
pub mod engine;
pub mod fencer;
pub mod liveness;
pub mod order;
pub mod quorum;
pub mod resync;
pub mod scrub;
pub mod set;
