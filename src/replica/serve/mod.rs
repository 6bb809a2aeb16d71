//! The serving wing: the stores of the volumes a node holds a copy of,
//! offered to each volume's writer over the node's one data listener.
//!
//! - [`stores`]: the registry of those stores by volume name, each with
//!   its volume's fence callback; volumes come and go while the listener
//!   runs. Both servers pick a store from it by the volume a request
//!   names, after the checks that need no store (S8, S9), so a writer of
//!   one volume reaches no other's copy.
//! - [`blocks`]: the block channel's server (writes, discards, reads,
//!   flushes and marks ahead as binary frames): checks the cluster and the
//!   volume at the connection's `Hello`, which binds it to that volume's
//!   store, and the incarnation (S8) of every frame, then calls the store.
//! - [`service`]: the replica gRPC service for control calls (fence,
//!   digests, mark retirement, missed-write maps, status, grow), on the
//!   node's data listener beside the block channel.
//!
//! Both map the store's errors to the wire through [`super::wire`], the one
//! mapping the client side reads them back with.

pub mod blocks;
pub mod service;
pub mod stores;
