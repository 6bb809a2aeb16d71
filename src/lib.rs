//! replica-ha: a replicated block volume with one fenced writer.
//!
//! The design, its invariants (S1–S11) and what the system does not do yet
//! are in `docs/design.md`; each module's doc restates the invariants it
//! enforces. The modules, from the edges inward:
//! - [`attach`]: the client side, on the client's host: serves the volume
//!   to local NBD clients and follows the writer, replaying what had no
//!   answer when it changes;
//! - [`nbd`]: the NBD server through which programs use the volume (and
//!   the client side `attach` speaks to it with);
//! - [`cli`]: the `replica-ha` command line, one file per command, and
//!   the admin client they share;
//! - [`api`]: the operator-facing front ends: `api::admin` (the operator's
//!   gRPC service) and `api::http` (metrics and health over HTTP); they
//!   render what `api::status` computes, and [`metrics`] counts;
//! - [`node`]: one node process: configuration, wiring, start-up and
//!   shutdown of what is node-wide, the gate journal, and the volume host
//!   whose volumes start and stop their own tasks;
//! - [`raft`]: the embedded Raft group (openraft over gRPC and sled): the
//!   writer's term, its lease, and the replicated volume state; its
//!   storage keeps a set of trees per group in the node's one Raft Db;
//! - [`replica`]: the data plane, in four wings: `disk` (the on-disk
//!   replica store that enforces the fencing token, S2, S3, S6, S7, above
//!   the data file's I/O), `serve` (that store on the wire), `peer` (the
//!   writer's client of it) and `mirror` (the mirroring
//!   [`replica::mirror::engine::Engine`], S5, the fencer and the resync),
//!   around the [`replica::Replica`] seam and `replica::wire`, the one
//!   mapping of its errors and stamps to the wire;
//! - [`ha`]: the reconcile core — `Coordinator`, `Fencer`, `InSyncTracker`,
//!   `Controller` and the `ActiveDevice` gate (S1, S4) — pure logic over
//!   traits;
//! - [`volume`]: the [`volume::Device`] seam that the NBD server, the gates
//!   and the engine all speak;
//! - [`ids`]: the [`ids::NodeId`] type every layer names a node by, and
//!   the incarnations that tell a node's lives apart (S8);
//! - [`members`]: which incarnation of each node this node deals with, as
//!   the Raft membership says;
//! - [`net`]: the one `Transport` every gRPC server and channel is made by,
//!   and where every connection is authenticated (mutual TLS, S9);
//! - [`certs`]: the cluster CA and the node and client certificates;
//! - [`sled_ops`]: how sled is used without its deadlocks;
//! - [`proto`]: the generated gRPC types.

#[cfg(all(feature = "unsafe-skip-term-check", not(debug_assertions)))]
compile_error!(
    "the feature unsafe-skip-term-check breaks S2 on purpose, for the fault campaign's \
     checker; it must never be built in release"
);

pub mod api;
pub mod attach;
pub mod certs;
pub mod cli;
pub mod ha;
pub mod ids;
pub mod members;
pub mod metrics;
pub mod nbd;
pub mod net;
pub mod node;
pub mod proto;
pub mod raft;
pub mod replica;
pub mod sled_ops;
pub mod volume;
