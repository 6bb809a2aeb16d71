//! What a node reports about itself, computed in one place as plain data
//! ([`NodeStatus`]) for the admin `Status` RPC, `/metrics` and the health
//! checks, which only render it.
//!
//! A node reports its configured volume and each volume of the cluster
//! group's table, every one it runs read by the same code from its own
//! parts ([`VolumeProbe`], in `probe.rs`); one it holds no copy of only as
//! the table records it.
//!
//! Replica states come from the volume's group's committed control state,
//! so every node that runs it reports the same in-sync set; the active writer adds what only its engine
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
mod probe;
#[cfg(test)]
mod samples;
mod table;
mod watch;

pub use json::StatusJson;
pub use lines::member_line;
pub use probe::{Here, TableVolumes, VolumeFigures, VolumeProbe, VolumeReport};
pub use table::Table;
pub use watch::Watch;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::ha::{Controller, HaError, ReplicaState};
use crate::ids::{GroupId, NodeId, Term};
use crate::nbd::NbdStats;
use crate::raft::RaftCoordinator;
use crate::raft::coordinator::LogProgress;
use crate::replica::ReplicaInfo;
use crate::replica::mirror::engine::{Engine, ResizeError};
use crate::replica::mirror::resync::{Progress, Resyncer};
use crate::replica::mirror::scrub::Scrubber;
use crate::volume::{Access, Device};

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
    /// The configured volume (the cluster group's own).
    volume: VolumeProbe,
    engine: Arc<Engine>,
    nbd: Arc<NbdStats>,
    /// The table's volumes, once the node keeps a table.
    table: Option<Arc<dyn TableVolumes>>,
}

/// The parts a [`NodeView`] is made of.
pub struct NodeParts {
    pub facts: NodeFacts,
    /// Why this node is not a member yet, while it is not (S8).
    pub waiting: Arc<crate::members::Waiting>,
    /// The configured volume's parts, over the cluster group.
    pub volume: VolumeProbe,
    /// The writer's mirror over the in-sync replicas (for a resize).
    pub engine: Arc<Engine>,
    /// The NBD server's counters.
    pub nbd: Arc<NbdStats>,
    /// The table's volumes as this node sees them (none: it reports only
    /// the configured volume).
    pub table: Option<Arc<dyn TableVolumes>>,
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
    /// openraft's server state in the cluster group, lower case
    /// (`leader`, `follower`, …).
    pub raft_state: String,
    /// Where the cluster group's Raft log stands (openraft's figures, for
    /// metrics).
    pub log: LogProgress,
    /// The index of the last entry the cluster group's state machine
    /// applied: the state that the configured volume's `in_sync`,
    /// `prev_writer`, `size` and `min_in_sync` are read from.
    pub applied_index: u64,
    /// The nodes heard from within one lease, this one included.
    pub live: Vec<NodeId>,
    /// Why this node is not a member of the cluster, while it is not (S8).
    pub not_member: Option<String>,
    /// The cluster's uuid, once the first leader drew it.
    pub cluster_uuid: Option<String>,
    /// The NBD server's counters (live).
    pub nbd: Arc<NbdStats>,
    /// The configured volume (the cluster group's own).
    pub own: VolumeFigures,
    /// Each volume of the table as this node sees it.
    pub table: Vec<VolumeReport>,
}

impl NodeStatus {
    /// The configured volume as a [`VolumeReport`]: group 0, its copies on
    /// the nodes of its replica set.
    pub fn own_report(&self) -> VolumeReport {
        VolumeReport {
            name: self.facts.volume.clone(),
            group: GroupId::FIRST,
            size: self.own.size,
            min_in_sync: self.own.min_in_sync,
            placement: self.own.replicas.iter().map(|r| r.id).collect(),
            figures: Some(self.own.clone()),
        }
    }

    /// Every volume this node runs a copy of, by name: the configured one
    /// first, then the table's.
    pub fn running(&self) -> Vec<(&str, &VolumeFigures)> {
        let table = self
            .table
            .iter()
            .filter_map(|v| v.figures.as_ref().map(|f| (v.name.as_str(), f)));
        std::iter::once((self.facts.volume.as_str(), &self.own))
            .chain(table)
            .collect()
    }
}

impl NodeView {
    /// A view over a node's parts.
    pub fn new(parts: NodeParts) -> Self {
        Self {
            facts: parts.facts,
            waiting: parts.waiting,
            volume: parts.volume,
            engine: parts.engine,
            nbd: parts.nbd,
            table: parts.table,
        }
    }

    /// What this node was configured as.
    pub fn facts(&self) -> &NodeFacts {
        &self.facts
    }

    /// The data path (read gate, write gate, counters).
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.volume.device
    }

    /// The NBD server's counters, for the server to update.
    pub fn nbd_stats(&self) -> &Arc<NbdStats> {
        &self.nbd
    }

    /// Whether a write through this node's gate would pass now: it is the
    /// active writer, fenced and within its lease.
    pub fn is_active_writer(&self) -> bool {
        self.volume.is_active_writer()
    }

    /// Who this node sees writing, in brief: what `WatchLeader` streams.
    pub fn leader_view(&self) -> LeaderView {
        self.leader_source().view()
    }

    /// Where the configured volume's [`LeaderView`] is read.
    pub fn leader_source(&self) -> LeaderSource {
        LeaderSource::new(
            Arc::clone(&self.volume.coordinator),
            Arc::clone(&self.volume.controller),
            self.facts.size,
        )
    }

    /// The writer's scrub, for the admin API to ask for a pass.
    pub fn scrubber(&self) -> &Arc<Scrubber> {
        &self.volume.scrub
    }

    /// The writer's resync, for the admin API to ask for a full rebuild.
    pub fn resyncer(&self) -> &Arc<Resyncer> {
        &self.volume.resync
    }

    /// Grows the volume to `size` bytes (see [`Engine::resize`]).
    pub async fn resize(&self, size: u64) -> Result<u64, ResizeError> {
        self.engine.resize(size).await
    }

    /// Hands leadership to node `to` and waits until it leads.
    pub async fn transfer_to(&self, to: NodeId) -> Result<(), HaError> {
        self.volume.controller.hand_over(to).await
    }

    /// Everything this node reports now: the node, its configured
    /// volume and the table's volumes, read at once.
    pub async fn status(&self) -> NodeStatus {
        let raft = self.volume.coordinator.status();
        let table = async {
            match &self.table {
                Some(table) => table.reports().await,
                None => Vec::new(),
            }
        };
        let (own, table) = tokio::join!(self.volume.figures(self.facts.id), table);
        NodeStatus {
            facts: self.facts.clone(),
            raft_state: format!("{:?}", raft.state).to_lowercase(),
            log: self.volume.coordinator.log_progress(),
            applied_index: raft.applied.last_applied.map_or(0, |id| id.index),
            live: self.volume.coordinator.live_members(),
            not_member: self.not_member(),
            cluster_uuid: raft.applied.control.uuid.clone(),
            nbd: Arc::clone(&self.nbd),
            own,
            table,
        }
    }

    /// Why this node is not a member, while it is not: still waiting to be
    /// (re-)added (see `node::formation`), or removed from a membership
    /// that it holds.
    fn not_member(&self) -> Option<String> {
        if let Some(why) = self.waiting.reason() {
            return Some(why);
        }
        let book = self.volume.coordinator.book();
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
        let coordinator = &self.volume.coordinator;
        let live = coordinator.live_members();
        let raft = coordinator.status();
        let in_sync = raft.applied.control.in_sync;
        coordinator
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
}
