//! The disk wing: one node's copy of the volume, as the replica serving it
//! keeps it (the *downstairs* side).
//!
//! - [`store`]: admission of every request (the fence floor: S2, S3), the
//!   S6 marks, growth and the digests. It is the only door to the copy:
//!   the servers of [`super::serve`] and [`local::LocalReplica`] both
//!   call it, so the checks are the same in every path.
//! - [`local`]: the store behind the [`super::Replica`] seam, for the
//!   writer's own copy.
//! - `data`: the data file below admission (`DataFile`: direct and cached
//!   I/O, holes, sync), private to this wing so that nothing reaches the
//!   bytes without passing the store.
//! - `identity`: which cluster and volume a store's dir belongs to, written
//!   once and checked at every open (its type, [`store::StoreIdentity`], is
//!   named through the store).
//! - [`meta`]: the metadata database (sled) and its recovery after an I/O
//!   failure (S7: durable before acknowledged).
//! - [`missed`]: the missed-write maps kept for absent members (C4,
//!   invariant M).
//! - [`predigest`]: digests of the marked extents, hashed while no leader
//!   is heard, ready for the next promotion (S6 kept fast).
//!
//! Nothing here knows of the network or of other copies.

mod data;
mod identity;
pub mod local;
pub mod meta;
pub mod missed;
pub mod predigest;
pub mod store;
