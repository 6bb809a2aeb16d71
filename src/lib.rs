//! replica-ha: a replicated block volume with one fenced writer.
//!
//! The crate is laid out as DESIGN.md describes:
//! - [`volume`]: the [`volume::Device`] seam that the NBD server, the write
//!   gate and the engine all speak;
//! - [`replica`]: the data plane — the on-disk replica store that enforces the
//!   fencing token (S2, S3, S7), the [`replica::Replica`] seam, and the
//!   mirroring [`replica::Engine`] (S5);
//! - [`ha`]: the reconcile core — `Coordinator`, `Fencer`, `Controller` and
//!   the `ActiveDevice` gate (S1, S4) — pure logic over traits;
//! - [`nbd`]: the NBD server through which programs use the volume;
//! - [`proto`]: the generated gRPC types.

#[cfg(all(feature = "unsafe-skip-term-check", not(debug_assertions)))]
compile_error!(
    "the feature unsafe-skip-term-check breaks S2 on purpose, for the fault campaign's \
     checker; it must never be built in release"
);

pub mod admin;
pub mod ha;
pub mod http;
pub mod metrics;
pub mod nbd;
pub mod net;
pub mod node;
pub mod proto;
pub mod raft;
pub mod replica;
pub mod sled_ops;
pub mod volume;
