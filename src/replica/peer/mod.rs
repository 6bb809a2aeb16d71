//! The peer wing: how the writer reaches another node's copy (the client
//! side of [`super::serve`]).
//!
//! - [`remote`]: [`remote::RemoteReplica`], the [`super::Replica`] over the
//!   block channel and the replica gRPC service, with a deadline on every
//!   call (a lost outcome is disowned, S3) and the store's session watched
//!   on every link and digest reply (a restarted copy is not counted on).
//! - [`channels`]: the pool that learns each peer's data address and keeps
//!   one gRPC channel per peer.

pub mod channels;
pub mod remote;
