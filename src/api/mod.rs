//! The operator-facing front ends of a node: what people, scripts,
//! monitoring and load balancers talk to, as opposed to what nodes say to
//! each other (Raft, the replica service) or what programs use the volume
//! by (NBD).
//!
//! - [`admin`]: the admin gRPC service (`replica-ha status`, `members`,
//!   `transfer`, `scrub`, `resync`, `resize`, and `attach`'s
//!   `WatchLeader`);
//! - [`http`]: `/metrics` and the health checks over HTTP;
//! - [`status`]: what a node reports about itself, computed once for both,
//!   and the renderings of a status reply the CLI prints (table, live view,
//!   JSON).
//!
//! A CSI front end (a container orchestrator's volume driver) belongs here
//! too when it comes.
//!
//! The front ends reach the node through these seams only, and a new one
//! should be added only for a new kind of question: [`status::NodeView`],
//! which reads the node and carries its few actions (the gated data path,
//! resize, leadership transfer, the writer's scrub and resync);
//! [`admin::MembersChanges`] and [`admin::VolumeChanges`], which
//! `node::membership` and `node::volumes` implement; and
//! [`admin::VolumeWriters`], which `node::writers` implements: where each
//! table volume's writer is read (`WatchLeader`, `/health/leader/NAME`),
//! a read-only [`status::LeaderSource`]. None of them
//! hands out the Raft handle, the engine or a replica store: a write from
//! here passes the same gate as an NBD write (S1), and the control state
//! changes only through an action the node defines. Who may call what is
//! checked per call against the caller the transport recorded (S9,
//! [`crate::net::Caller`]).

pub mod admin;
pub mod http;
pub mod status;
