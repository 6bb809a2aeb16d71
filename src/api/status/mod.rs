//! What a node reports about itself, computed in one place as plain data
//! ([`NodeStatus`]) for the admin `Status` RPC, `/metrics` and the health
//! checks, which only render it.
//!
//! Replica states come from the committed Raft control state, so every node
//! reports the same in-sync set; the active writer adds what only its engine
//! knows (a member that is failing but cannot be dropped is `degraded`).
//! Fence floors are asked of each replica with a short deadline; an
//! unreachable one is reported as such, never guessed.
//!
//! The admin service sends a [`NodeStatus`] as a `StatusReply`; the CLI's
//! renderings of such a reply live here too, beside what they render, and
//! add nothing the reply does not say: [`Table`] (`replica-ha status`),
//! [`Watch`] (`--watch`, the live view) and [`StatusJson`] (`--json`).

mod json;
mod lines;
#[cfg(test)]
mod samples;
mod table;
mod watch;

pub use json::StatusJson;
pub use lines::member_line;
pub use table::Table;
pub use watch::Watch;

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::ha::{Controller, HaError, ReplicaState, Role};
use crate::ids::{NodeId, Term};
use crate::metrics::DeviceMetrics;
use crate::nbd::NbdStats;
use crate::raft::coordinator::LogProgress;
use crate::raft::{RaftCoordinator, WriterRecord};
use crate::replica::ReplicaInfo;
use crate::replica::mirror::engine::{Engine, ResizeError};
use crate::replica::mirror::resync::{Progress, Resyncer};
use crate::replica::mirror::scrub::{ScrubStatus, Scrubber};
use crate::replica::mirror::set::ReplicaSet;
use crate::volume::{Access, Device, DeviceError};

/// How long a status request waits for one replica's fence floor.
const INFO_TIMEOUT: Duration = Duration::from_millis(300);

/// What this node was configured as: the facts status repeats.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeFacts {
    pub id: NodeId,
    /// This node in Raft: its id and its data dir's incarnation.
    pub member: crate::ids::MemberId,
    /// Where this node's replica service listens, as bound.
    pub data: SocketAddr,
    pub cluster_id: String,
    pub volume: String,
    /// The configured size and `min_in_sync` (the cluster's recorded ones
    /// win once there are any).
    pub size: u64,
    pub min_in_sync: usize,
    pub nbd: Option<SocketAddr>,
    /// Every node of the cluster, this one included, by id.
    pub peers: BTreeMap<NodeId, String>,
    /// Whether connections are mutual TLS; false in the insecure mode.
    pub tls: bool,
    /// The data dir.
    pub data_dir: std::path::PathBuf,
}

impl NodeFacts {
    /// How this node's connections are secured, in words.
    pub fn security(&self) -> &'static str {
        if self.tls { "mutual TLS" } else { "insecure" }
    }
}

/// The parts of a running node that status reads, and the two actions the
/// admin API takes through it: the data path and a leadership transfer.
pub struct NodeView {
    facts: NodeFacts,
    waiting: Arc<crate::members::Waiting>,
    coordinator: Arc<RaftCoordinator>,
    controller: Arc<Controller>,
    replicas: Arc<ReplicaSet>,
    resync: Arc<Resyncer>,
    scrub: Arc<Scrubber>,
    engine: Arc<Engine>,
    device: Arc<dyn Device>,
    io: Arc<DeviceMetrics>,
    nbd: Arc<NbdStats>,
}

/// The parts a [`NodeView`] is made of.
pub struct NodeParts {
    pub facts: NodeFacts,
    /// Why this node is not a member yet, while it is not (S8).
    pub waiting: Arc<crate::members::Waiting>,
    pub coordinator: Arc<RaftCoordinator>,
    pub controller: Arc<Controller>,
    /// The volume's replicas, this node's own first.
    pub replicas: Arc<ReplicaSet>,
    /// The resync of out-of-sync replicas (progress).
    pub resync: Arc<Resyncer>,
    /// The writer's scrub of the in-sync copies.
    pub scrub: Arc<Scrubber>,
    /// The writer's mirror over the in-sync replicas (for a resize).
    pub engine: Arc<Engine>,
    /// The data path: the read gate in front of the write gate, counted.
    /// NBD and admin reads and writes use it.
    pub device: Arc<dyn Device>,
    /// The data path's counters.
    pub io: Arc<DeviceMetrics>,
    /// The NBD server's counters.
    pub nbd: Arc<NbdStats>,
}

/// One replica's line in a report.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplicaReport {
    pub id: NodeId,
    pub state: ReplicaState,
    /// Whether it is this node's own replica.
    pub local: bool,
    /// Its floor and dirty marks, or why they could not be read.
    pub info: Result<ReplicaInfo, String>,
    /// Its latest rebuild on this node, if any.
    pub resync: Option<Progress>,
}

/// Who a node sees writing (see [`NodeView::leader_view`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaderView {
    pub term: Term,
    pub leader: Option<NodeId>,
    /// The term this node writes under, while it is the active writer.
    pub writer_term: Option<Term>,
    /// The volume's size.
    pub size: u64,
}

/// What a volume's [`LeaderView`] is read from on this node: its group's
/// coordinator, its controller (whose gate says whether this node writes
/// it) and the size it was created with (the recorded size wins once the
/// volume was resized). Cheap to clone; reading it takes no lock, so a
/// `WatchLeader` stream polls it without holding up the node.
#[derive(Clone)]
pub struct LeaderSource {
    coordinator: Arc<RaftCoordinator>,
    controller: Arc<Controller>,
    size: u64,
}

impl LeaderSource {
    /// The source of a volume run by `controller` over `coordinator`'s
    /// group, created with `size` bytes.
    pub fn new(coordinator: Arc<RaftCoordinator>, controller: Arc<Controller>, size: u64) -> Self {
        Self {
            coordinator,
            controller,
            size,
        }
    }

    /// Who this node sees writing the volume now.
    pub fn view(&self) -> LeaderView {
        let raft = self.coordinator.status();
        let writer_term = match self.controller.device().access() {
            Access::ReadWrite { term } => Some(term),
            _ => None,
        };
        let size = raft.applied.control.volume_size().unwrap_or(self.size);
        LeaderView {
            term: raft.term,
            leader: raft.leader,
            writer_term,
            size,
        }
    }

    /// Whether a write through this node's gate of the volume would pass
    /// now: it is the volume's active writer, fenced and within its lease.
    pub fn is_active_writer(&self) -> bool {
        self.controller.device().is_writable()
    }

    /// Hands the volume's writer to node `to`, drained, as `transfer`
    /// does (see [`crate::ha::Controller::hand_over`]); only the volume's
    /// writer can.
    pub async fn hand_over(&self, to: NodeId) -> Result<(), HaError> {
        self.controller.hand_over(to).await
    }

    /// Whether node `id` is a voter of the volume's group: holds a copy.
    pub fn holds_copy(&self, id: NodeId) -> bool {
        let metrics = self.coordinator.raft().metrics();
        let voters = metrics.borrow().membership_config.membership().voter_ids();
        voters.into_iter().any(|member| member.node() == id)
    }

    /// Whether `other` reads the same running volume (not a later one of
    /// the same name).
    pub fn is_same(&self, other: &LeaderSource) -> bool {
        Arc::ptr_eq(&self.controller, &other.controller)
    }
}

impl std::fmt::Debug for LeaderSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaderSource")
            .field("view", &self.view())
            .finish()
    }
}

/// I/O held because too few replicas are in sync.
#[derive(Debug, Clone, PartialEq)]
pub struct SuspendedIo {
    /// Requests waiting.
    pub waiting: usize,
    /// How long requests have been waiting without a break.
    pub for_how_long: Duration,
    /// Why, and what will end it: "1 in-sync replica of the 2 needed;
    /// waiting for node 3's rebuild, 62%".
    pub why: String,
}

/// One node of the cluster as this node sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberReport {
    pub id: NodeId,
    pub address: String,
    /// The incarnation the membership names (S8).
    pub incarnation: crate::ids::Incarnation,
    /// A voter, not a learner.
    pub voter: bool,
    /// Heard from within one lease.
    pub live: bool,
    pub leader: bool,
    pub in_sync: bool,
}

/// Everything a node reports, at one moment.
#[derive(Debug, Clone)]
pub struct NodeStatus {
    pub facts: NodeFacts,
    /// openraft's server state, lower case (`leader`, `follower`, …).
    pub raft_state: String,
    pub term: Term,
    pub leader: Option<NodeId>,
    /// Where the Raft log stands (openraft's figures, for metrics).
    pub log: LogProgress,
    /// The index of the last entry the state machine applied: the state
    /// that `in_sync`, `prev_writer`, `size` and `min_in_sync` are read
    /// from.
    pub applied_index: u64,
    /// The time left on this node's lease, if it holds one now.
    pub lease_remaining: Option<Duration>,
    /// The nodes heard from within one lease, this one included.
    pub live: Vec<NodeId>,
    pub prev_writer: Option<WriterRecord>,
    pub in_sync: BTreeSet<NodeId>,
    /// The volume's size and `min_in_sync`: the cluster's recorded ones, or
    /// this node's configured ones before any were recorded.
    pub size: u64,
    pub min_in_sync: usize,
    pub role: Role,
    /// Whether a write through this node's gate would pass now.
    pub gate_open: bool,
    pub fence_failures: u64,
    pub promotions: u64,
    pub replicas: Vec<ReplicaReport>,
    /// Why this node refuses reads now; `None` while it serves them.
    pub reads_refused: Option<String>,
    /// Why this node is not a member of the cluster, while it is not (S8).
    pub not_member: Option<String>,
    /// The cluster's uuid, once the first leader drew it.
    pub cluster_uuid: Option<String>,
    /// Writes held below `min_in_sync` (design C2), and what will end it.
    pub suspended: Option<SuspendedIo>,
    /// What this node's scrub has done (all zero unless it has written).
    pub scrub: ScrubStatus,
    /// The configured background scrub rate (bytes per second, 0: off).
    pub scrub_rate: u64,
    /// The data path's and the NBD server's counters (live).
    pub io: Arc<DeviceMetrics>,
    pub nbd: Arc<NbdStats>,
}

impl NodeView {
    /// A view over a node's parts.
    pub fn new(parts: NodeParts) -> Self {
        Self {
            facts: parts.facts,
            waiting: parts.waiting,
            coordinator: parts.coordinator,
            controller: parts.controller,
            replicas: parts.replicas,
            resync: parts.resync,
            scrub: parts.scrub,
            engine: parts.engine,
            device: parts.device,
            io: parts.io,
            nbd: parts.nbd,
        }
    }

    /// What this node was configured as.
    pub fn facts(&self) -> &NodeFacts {
        &self.facts
    }

    /// The data path (read gate, write gate, counters).
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// The NBD server's counters, for the server to update.
    pub fn nbd_stats(&self) -> &Arc<NbdStats> {
        &self.nbd
    }

    /// Whether a write through this node's gate would pass now: it is the
    /// active writer, fenced and within its lease.
    pub fn is_active_writer(&self) -> bool {
        self.controller.device().is_writable()
    }

    /// Who this node sees writing, in brief: what `WatchLeader` streams.
    pub fn leader_view(&self) -> LeaderView {
        self.leader_source().view()
    }

    /// Where the configured volume's [`LeaderView`] is read.
    pub fn leader_source(&self) -> LeaderSource {
        LeaderSource::new(
            Arc::clone(&self.coordinator),
            Arc::clone(&self.controller),
            self.facts.size,
        )
    }

    /// The writer's scrub, for the admin API to ask for a pass.
    pub fn scrubber(&self) -> &Arc<Scrubber> {
        &self.scrub
    }

    /// The writer's resync, for the admin API to ask for a full rebuild.
    pub fn resyncer(&self) -> &Arc<Resyncer> {
        &self.resync
    }

    /// Grows the volume to `size` bytes (see [`Engine::resize`]).
    pub async fn resize(&self, size: u64) -> Result<u64, ResizeError> {
        self.engine.resize(size).await
    }

    /// Hands leadership to node `to` and waits until it leads.
    pub async fn transfer_to(&self, to: NodeId) -> Result<(), HaError> {
        self.controller.hand_over(to).await
    }

    /// Everything this node reports now.
    pub async fn status(&self) -> NodeStatus {
        let mut status = self.snapshot().await;
        status.suspended = self.suspended(&status.replicas);
        status
    }

    /// The writes held below `min_in_sync`, with what will end the wait:
    /// a rebuild's progress, or a replica coming back.
    fn suspended(&self, replicas: &[ReplicaReport]) -> Option<SuspendedIo> {
        let held = self.controller.device().suspension();
        let since = held.since.filter(|_| held.waiting > 0)?;
        let rebuilds: Vec<String> = replicas
            .iter()
            .filter_map(|r| {
                let progress = r.resync.filter(|p| p.running)?;
                let percent = 100 * progress.done / progress.total.max(1);
                Some(format!("node {}'s rebuild, {percent}%", r.id))
            })
            .collect();
        let until = if rebuilds.is_empty() {
            "waiting for a replica to answer or come back".to_string()
        } else {
            format!("waiting for {}", rebuilds.join(" and "))
        };
        Some(SuspendedIo {
            waiting: held.waiting,
            for_how_long: since.elapsed(),
            why: format!("{}; {until}", held.why),
        })
    }

    async fn snapshot(&self) -> NodeStatus {
        let raft = self.coordinator.status();
        let controller = self.controller.status();
        let control = raft.applied.control.clone();
        let (size, min_in_sync) = match &control.volume {
            Some(volume) => (
                control.volume_size().unwrap_or(volume.size),
                volume.min_in_sync,
            ),
            None => (self.facts.size, self.facts.min_in_sync),
        };
        NodeStatus {
            facts: self.facts.clone(),
            raft_state: format!("{:?}", raft.state).to_lowercase(),
            term: raft.term,
            leader: raft.leader,
            log: self.coordinator.log_progress(),
            applied_index: raft.applied.last_applied.map_or(0, |id| id.index),
            lease_remaining: self.lease_remaining(),
            live: self.coordinator.live_members(),
            prev_writer: control.writer,
            in_sync: control.in_sync,
            size,
            min_in_sync,
            role: controller.role,
            gate_open: self.is_active_writer(),
            fence_failures: controller.fence_failures,
            promotions: controller.promotions,
            replicas: self.replica_reports().await,
            reads_refused: self.reads_refused(),
            not_member: self.not_member(),
            cluster_uuid: control.uuid.clone(),
            suspended: None,
            scrub: self.scrub.status(),
            scrub_rate: self.scrub.rate(),
            io: Arc::clone(&self.io),
            nbd: Arc::clone(&self.nbd),
        }
    }

    /// Why this node is not a member, while it is not: still waiting to be
    /// (re-)added (see `node::formation`), or removed from a membership
    /// that it holds.
    fn not_member(&self) -> Option<String> {
        if let Some(why) = self.waiting.reason() {
            return Some(why);
        }
        let book = self.coordinator.book();
        let entries = book.entries();
        let named = entries.get(&self.facts.id).map(|e| e.member);
        match named {
            _ if entries.is_empty() => None,
            Some(member) if member == self.facts.member => None,
            Some(member) => Some(format!(
                "replaced: the membership names incarnation {} of this node, not this one ({})",
                member.incarnation(),
                self.facts.member.incarnation()
            )),
            None => Some(
                "removed: this node is not a member of the cluster; stop it (to add it back, \
                 empty its data dir and run `replica-ha members add`)"
                    .into(),
            ),
        }
    }

    /// Every member of the cluster as this node's membership names it
    /// (empty while this node holds no membership).
    pub fn members(&self) -> Vec<MemberReport> {
        let live = self.coordinator.live_members();
        let raft = self.coordinator.status();
        let in_sync = raft.applied.control.in_sync;
        self.coordinator
            .book()
            .entries()
            .into_iter()
            .map(|(id, entry)| MemberReport {
                id,
                address: match entry.addr.is_empty() {
                    true => self.facts.peers.get(&id).cloned().unwrap_or_default(),
                    false => entry.addr,
                },
                incarnation: entry.member.incarnation(),
                voter: entry.voter,
                live: live.contains(&id),
                leader: raft.leader == Some(id),
                in_sync: in_sync.contains(&id),
            })
            .collect()
    }

    /// Why this node refuses reads now, or `None` while it serves them: the
    /// active writer reads its in-sync replicas; a passive node serves its
    /// own copy only while that copy is in the committed in-sync set (see
    /// [`crate::ha::ReadGate`]).
    fn reads_refused(&self) -> Option<String> {
        match self.device.access() {
            Access::Refused(DeviceError::NotInSync) => Some("replica not in sync".into()),
            Access::Refused(why) => Some(why.to_string()),
            Access::ReadWrite { .. } | Access::ReadOnly => None,
        }
    }

    /// Every replica's state and fence floor, this node's own first.
    async fn replica_reports(&self) -> Vec<ReplicaReport> {
        let committed = self.coordinator.state_machine().current().control.in_sync;
        let engine: Vec<_> = self.controller.status().replicas;
        let active = self.is_active_writer();
        let progress = self.resync.progress();
        let members = self.replicas.members();
        let infos = futures::future::join_all(members.iter().map(|replica| async move {
            match tokio::time::timeout(INFO_TIMEOUT, replica.info()).await {
                Ok(Ok(info)) => Ok(info),
                Ok(Err(err)) => Err(err.to_string()),
                Err(_) => Err(format!("no answer within {INFO_TIMEOUT:?}")),
            }
        }))
        .await;
        let local = self.facts.id;
        members
            .iter()
            .zip(infos)
            .map(|(replica, info)| {
                let id = replica.id();
                let in_sync = committed.contains(&id);
                let degraded = active
                    && engine
                        .iter()
                        .any(|r| r.id == id && r.state == ReplicaState::Degraded);
                let resync = progress.get(&id).copied();
                let rebuilding = active && resync.is_some_and(|p| p.running);
                let state = match (in_sync, degraded, rebuilding) {
                    (true, true, _) => ReplicaState::Degraded,
                    (true, false, _) => ReplicaState::InSync,
                    (false, _, true) => ReplicaState::Rebuilding,
                    (false, _, false) => ReplicaState::Offline,
                };
                ReplicaReport {
                    local: id == local,
                    id,
                    state,
                    info,
                    resync,
                }
            })
            .collect()
    }

    /// The time left on this node's lease, if it holds one now.
    fn lease_remaining(&self) -> Option<Duration> {
        let status = self.coordinator.status();
        let now = Instant::now();
        status
            .lease
            .filter(|lease| lease.covers(status.term, now))
            .map(|lease| lease.deadline - now)
    }
}
