//! The serving wing: a node's store offered to the writer over the network.
//!
//! - [`stores`]: the registry of the stores a node serves, by volume name,
//!   each with its volume's fence callback.
//! - [`blocks`]: the block channel's server (writes, discards, reads,
//!   flushes and marks ahead as binary frames): checks the cluster, the
//!   volume and the incarnation (S8) of every frame, then calls the store.
//! - [`service`]: the replica gRPC service for control calls (fence,
//!   digests, mark retirement, missed-write maps, status, grow), on the
//!   node's data listener beside the block channel.
//!
//! Both map the store's errors to the wire through [`super::wire`], the one
//! mapping the client side reads them back with.

pub mod blocks;
pub mod service;
pub mod stores;
