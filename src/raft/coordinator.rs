//! [`RaftCoordinator`]: the core's `Coordinator` and `InSyncTracker` over
//! openraft.
//!
//! A watcher task follows openraft's metrics (for the state, the term and
//! the membership) and the acknowledgements our network layer records (see
//! [`super::network`]). From them it derives this node's [`Lease`] — see the
//! parent module for why `quorum-acked send time + election_timeout_min −
//! margin` — and publishes a [`Leadership`] whose `is_self` is true only
//! while that lease is valid. A timer at the lease deadline makes `is_self`
//! fall to false even when openraft reports nothing (a leader cut off from
//! its quorum, or one whose Raft core is stuck in a log fsync).
//!
//! **The deadline is an absolute instant, and only an acknowledgement moves
//! it.** It is computed from recorded send times only ([`lease_from_acks`]),
//! never from "now": a timer wake, or a re-read of metrics that did not
//! change, computes the same deadline again. (openraft's own
//! `millis_since_quorum_ack` is relative to the moment its core last
//! reported; a lease built from it and the reader's clock renews itself
//! whenever the core stops reporting.)
//!
//! Promotions and in-sync changes are Raft entries that must be committed
//! *in the caller's term*: a write that openraft commits under another term,
//! or that the state machine refuses, is reported as a failure.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use openraft::ServerState;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::network::Peers;
use super::state_machine::Applied;
use super::{MemberId, NodeId, Raft, Request, Response, StateMachine, Term, WriterRecord};
use crate::ha::{Coordinator, HaError, InSyncError, InSyncTracker, Leadership, Lease, Writer};
use crate::proto::raft::TransferRequest;

/// Raft's timing. The defaults fail over in well under a second on
/// loopback.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RaftTiming {
    /// How often a leader sends heartbeats.
    pub heartbeat: Duration,
    /// The shortest election timeout.
    pub election_min: Duration,
    /// The longest election timeout (also the followers' vote lease).
    pub election_max: Duration,
    /// Taken off the lease: slack for the followers' clocks running fast
    /// against ours and for their campaign timers firing early.
    pub lease_margin: Duration,
}

impl Default for RaftTiming {
    fn default() -> Self {
        Self {
            heartbeat: Duration::from_millis(100),
            election_min: Duration::from_millis(300),
            election_max: Duration::from_millis(450),
            lease_margin: Duration::from_millis(50),
        }
    }
}

impl RaftTiming {
    /// The openraft configuration for this timing. openraft's own election
    /// timer stays off ([`super::detector`] starts elections), and so does
    /// its heartbeat timer ([`super::heartbeat`] sends the heartbeats).
    ///
    /// Its tick starts off too. With both timers off, a tick (one every
    /// 1.5 heartbeat intervals per group, each a turn of the group's
    /// loop) does one thing only: it steps down a leader once a committed
    /// membership leaves it out. The coordinator's watcher turns the tick
    /// on while this node leads a membership in which it has no vote
    /// (which covers every such case; see `watch_leadership`), so that
    /// step-down comes as before, and idle groups do not turn their loops
    /// for nothing.
    pub fn raft_config(&self, cluster_id: &str) -> Result<openraft::Config, String> {
        let config = openraft::Config {
            cluster_name: cluster_id.to_string(),
            heartbeat_interval: self.heartbeat.as_millis() as u64,
            election_timeout_min: self.election_min.as_millis() as u64,
            election_timeout_max: self.election_max.as_millis() as u64,
            enable_elect: false,
            // The node's heartbeat clock sends every group's heartbeats
            // at once (see `super::heartbeat`).
            enable_heartbeat: false,
            enable_tick: false,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(500),
            max_in_snapshot_log_to_keep: 100,
            ..Default::default()
        };
        config.validate().map_err(|err| err.to_string())
    }

    /// How long a lease lasts past the last quorum acknowledgement.
    pub fn lease(&self) -> Duration {
        self.election_min.saturating_sub(self.lease_margin)
    }

    /// How soon a node whose campaign did not win (or that held back from
    /// one) may try again, before jitter: a third of the shortest election
    /// timeout (100 ms by default). Tied to the election timeouts, not to
    /// the heartbeat interval, so a slower heartbeat leaves elections as
    /// they were.
    pub fn campaign_retry(&self) -> Duration {
        self.election_min / 3
    }

    /// How soon to look again at something that may change any moment (a
    /// transfer under way, a candidate about to run): 25 ms by default.
    pub fn recheck(&self) -> Duration {
        self.election_min / 12
    }
}

/// A snapshot of what the coordinator knows, for status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaftStatus {
    /// openraft's server state.
    pub state: ServerState,
    /// The current term.
    pub term: Term,
    /// The known leader.
    pub leader: Option<NodeId>,
    /// This node's lease, if it leads.
    pub lease: Option<Lease>,
    /// The applied control state.
    pub applied: Applied,
}

/// Where this node's Raft log stands, for metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogProgress {
    /// Index of the last log entry.
    pub last_log: u64,
    /// Index of the last applied entry.
    pub last_applied: u64,
    /// On the leader: each follower's last matched index.
    pub replication: Option<Vec<(NodeId, u64)>>,
}

/// The Raft-backed coordinator. See the module docs.
pub struct RaftCoordinator {
    id: NodeId,
    /// This node in Raft (node and incarnation).
    member: MemberId,
    raft: Raft,
    state_machine: StateMachine,
    peers: Arc<Peers>,
    timing: RaftTiming,
    lease: Arc<Mutex<Option<Lease>>>,
    observations: watch::Receiver<Leadership>,
    watcher: JoinHandle<()>,
}

impl Drop for RaftCoordinator {
    fn drop(&mut self) {
        self.watcher.abort();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl RaftCoordinator {
    /// Starts following `raft`'s metrics.
    pub fn start(
        raft: Raft,
        state_machine: StateMachine,
        peers: Arc<Peers>,
        timing: RaftTiming,
    ) -> Arc<Self> {
        let (id, member) = (peers.self_id(), peers.self_member());
        let lease = Arc::new(Mutex::new(None));
        let (tx, observations) = watch::channel(Leadership::default());
        let watcher = tokio::spawn(watch_leadership(
            raft.clone(),
            Arc::clone(&peers),
            timing,
            Arc::clone(&lease),
            tx,
        ));
        Arc::new(Self {
            id,
            member,
            raft,
            state_machine,
            peers,
            timing,
            lease,
            observations,
            watcher,
        })
    }

    /// The openraft instance.
    pub fn raft(&self) -> &Raft {
        &self.raft
    }

    /// The membership as this node knows it (see [`crate::members`]).
    pub fn book(&self) -> &Arc<crate::members::MemberBook> {
        self.peers.book()
    }

    /// When node `peer` was last heard from, if it was since start.
    pub fn last_heard(&self, peer: NodeId) -> Option<Instant> {
        self.peers.last_heard(peer)
    }

    /// The Raft group this coordinator runs.
    pub fn group(&self) -> crate::ids::GroupId {
        self.peers.group()
    }

    /// When this node last heard its group's leader, or granted a vote.
    pub fn last_leader_contact(&self) -> Instant {
        self.peers.last_leader_contact()
    }

    /// This node in Raft (node and incarnation).
    pub fn member(&self) -> MemberId {
        self.member
    }

    /// The state machine (its applied control state).
    pub fn state_machine(&self) -> &StateMachine {
        &self.state_machine
    }

    /// What the coordinator knows now.
    pub fn status(&self) -> RaftStatus {
        let metrics = self.raft.metrics().borrow().clone();
        RaftStatus {
            state: metrics.state,
            term: Term(metrics.current_term),
            leader: metrics.current_leader.map(MemberId::node),
            lease: *lock(&self.lease),
            applied: self.state_machine.current(),
        }
    }

    /// Where the Raft log stands now.
    pub fn log_progress(&self) -> LogProgress {
        let metrics = self.raft.metrics().borrow().clone();
        LogProgress {
            last_log: metrics.last_log_index.unwrap_or(0),
            last_applied: metrics.last_applied.map_or(0, |id| id.index),
            replication: metrics.replication.as_ref().map(|peers| {
                // One line per node: the incarnation the book expects.
                peers
                    .iter()
                    .filter(|(peer, _)| self.peers.member_of(peer.node()) == **peer)
                    .map(|(peer, matched)| (peer.node(), matched.map_or(0, |id| id.index)))
                    .collect()
            }),
        }
    }

    /// The live members as node ids: this node and the peers heard from
    /// within one lease.
    pub fn live_members(&self) -> Vec<NodeId> {
        let since = Instant::now()
            .checked_sub(self.timing.lease())
            .unwrap_or_else(Instant::now);
        let book = self.peers.book().entries();
        let mut members = self.peers.heard_since(since);
        // Members only, once there is a membership: a removed node that
        // still talks is not one.
        members.retain(|id| book.is_empty() || book.contains_key(id));
        members.push(self.id);
        members.sort_unstable();
        members.dedup();
        members
    }

    /// Proposes `request` and waits until it is committed and applied. Fails
    /// unless it was committed in `term` and applied.
    pub async fn commit(&self, term: Term, request: Request) -> Result<Response, HaError> {
        let written = self
            .raft
            .client_write(request)
            .await
            .map_err(|err| HaError::Coordinator(err.to_string()))?;
        if Term(written.log_id.leader_id.term) != term {
            return Err(HaError::Coordinator(format!(
                "committed in term {}, not {term}",
                written.log_id.leader_id.term
            )));
        }
        if let Some(refused) = written.data.refused.clone() {
            return Err(HaError::Refused(refused));
        }
        Ok(written.data)
    }

    /// Hands leadership to `to` and waits until it leads (or fails).
    async fn hand_leadership_to(&self, to: NodeId) -> Result<(), HaError> {
        let metrics = self.raft.metrics().borrow().clone();
        if metrics.current_leader != Some(self.member) {
            return Err(HaError::NotLeader);
        }
        if to == self.id {
            return Ok(());
        }
        self.peers.begin_transfer(to);
        // The heartbeat clock skips this group while this node hands over.
        self.peers.begin_handover();
        // However this ends — also when the caller drops it half-way —
        // heartbeats come back and the transfer mark goes: a leader left
        // without heartbeats would neither keep its followers nor hear
        // that they moved on to a higher term.
        let _restore = TransferGuard { peers: &self.peers };
        let request = TransferRequest {
            cluster_id: self.peers.cluster_id().to_string(),
            from: self.id.0,
            term: metrics.current_term,
            target: to.0,
            to: 0,
            group: self.peers.group().0,
        };
        // Tell every peer, the target last: non-targets must hold off
        // before the target's election can start.
        let mut peers: Vec<NodeId> = self
            .peers
            .peer_ids()
            .into_iter()
            .filter(|p| *p != to)
            .collect();
        peers.push(to);
        let mut outcome = Ok(());
        for peer in peers {
            let mut grpc = tonic::Request::new(TransferRequest {
                to: self.peers.member_of(peer).0,
                ..request.clone()
            });
            grpc.set_timeout(self.timing.election_max);
            let sent = match self.peers.client(peer) {
                Ok(mut client) => client
                    .transfer_leader(grpc)
                    .await
                    .map(|_| ())
                    .map_err(|s| s.message().to_string()),
                Err(err) => Err(err.to_string()),
            };
            if let Err(err) = sent {
                if peer == to {
                    outcome = Err(HaError::Coordinator(format!("node {to} declined: {err}")));
                } else {
                    tracing::warn!(%peer, %err, "could not announce the transfer");
                }
            }
        }
        if outcome.is_ok() {
            outcome = self.wait_for_leader(to).await;
        }
        outcome
    }

    async fn wait_for_leader(&self, to: NodeId) -> Result<(), HaError> {
        let mut metrics = self.raft.metrics();
        let deadline = Instant::now() + self.timing.election_max * 6;
        loop {
            let leader = metrics
                .borrow_and_update()
                .current_leader
                .map(MemberId::node);
            if leader == Some(to) {
                return Ok(());
            }
            tokio::select! {
                changed = metrics.changed() => {
                    changed.map_err(|_| HaError::Coordinator("raft stopped".into()))?;
                }
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(HaError::Coordinator(format!(
                        "node {to} did not take over in time (leader now {leader:?})"
                    )));
                }
            }
        }
    }

    /// The live peers to hand leadership to: those whose replica is in the
    /// committed in-sync set first, then the most caught-up in Raft.
    pub fn successors(&self) -> Vec<NodeId> {
        let metrics = self.raft.metrics().borrow().clone();
        let Some(replication) = metrics.replication else {
            return Vec::new();
        };
        let live = self.live_members();
        let in_sync = self.state_machine.current().control.in_sync;
        // A successor whose replica is in sync writes at once; one still
        // being rebuilt would hold every write until its rebuild ends.
        // Voters only: a learner cannot win the election.
        let voters: BTreeSet<MemberId> =
            metrics.membership_config.membership().voter_ids().collect();
        let mut peers: Vec<(bool, NodeId, Option<u64>)> = replication
            .into_iter()
            .filter(|(member, _)| voters.contains(member))
            .map(|(member, matched)| (member.node(), matched))
            .filter(|(id, _)| *id != self.id && live.contains(id))
            .map(|(id, matched)| (in_sync.contains(&id), id, matched.map(|m| m.index)))
            .collect();
        peers.sort_by(|a, b| b.0.cmp(&a.0).then(b.2.cmp(&a.2)).then(a.1.cmp(&b.1)));
        peers.into_iter().map(|(_, id, _)| id).collect()
    }

    /// Waits until the state machine has applied an entry of `term` (the
    /// leader's first entry) and every entry this node's log held when the
    /// call began, so the control state is current for `term` — including a
    /// promotion this node recorded at `term` before a restart, which sits
    /// after the term's first entry.
    async fn applied_through(&self, term: Term) -> Result<Applied, HaError> {
        let mut applied = self.state_machine.subscribe();
        let tail = self.raft.metrics().borrow().last_log_index;
        let deadline = Instant::now() + self.timing.election_max * 4;
        loop {
            let current = applied.borrow_and_update().clone();
            if current.last_applied.is_some_and(|id| {
                Term(id.leader_id.term) >= term && tail.is_none_or(|tail| id.index >= tail)
            }) {
                return Ok(current);
            }
            tokio::select! {
                changed = applied.changed() => {
                    changed.map_err(|_| HaError::Coordinator("state machine closed".into()))?;
                }
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(HaError::Coordinator(format!(
                        "no entry of term {term} applied yet"
                    )));
                }
            }
        }
    }
}

/// Ends a transfer when dropped: the mark gone, heartbeats on again.
struct TransferGuard<'a> {
    peers: &'a Peers,
}

impl Drop for TransferGuard<'_> {
    fn drop(&mut self) {
        self.peers.end_transfer();
        self.peers.end_handover();
    }
}

/// The lease of this node (`self_id`) as leader of `term`: the newest send
/// time that a quorum of every voter set in `configs` (one, or two during a
/// joint change) acknowledged in `term`, plus `lease`. `acks` holds each
/// peer's newest acknowledged send time in `term`. This node counts as
/// acknowledging at `now` — it is the leader, and a leader does not vote for
/// another candidate while its own clock (openraft's, also from send times)
/// runs — so it only ever decides the instant for a lone voter, where no
/// other node can win an election at all. None without a quorum.
pub fn lease_from_acks(
    self_id: MemberId,
    term: Term,
    configs: &[BTreeSet<MemberId>],
    acks: &std::collections::HashMap<MemberId, Instant>,
    lease: Duration,
    now: Instant,
) -> Option<Lease> {
    let mut quorum_acked: Option<Instant> = None;
    for voters in configs {
        let mut times: Vec<Instant> = voters
            .iter()
            .filter(|voter| **voter != self_id)
            .filter_map(|voter| acks.get(voter).copied())
            .collect();
        times.sort_unstable_by(|a, b| b.cmp(a));
        // This node, when it votes, is the newest acknowledgement of all.
        let mut needed = voters.len() / 2 + 1;
        if voters.contains(&self_id) {
            needed -= 1;
        }
        let acked = match needed {
            0 => now,
            n => *times.get(n - 1)?,
        };
        quorum_acked = Some(quorum_acked.map_or(acked, |earlier| earlier.min(acked)));
    }
    quorum_acked.map(|acked| Lease {
        term,
        deadline: acked + lease,
    })
}

/// The member book's entries for `membership` (see [`crate::members`]).
pub fn book_entries(
    membership: &openraft::Membership<MemberId, super::MemberNode>,
) -> std::collections::BTreeMap<NodeId, crate::members::Entry> {
    let nodes = membership
        .nodes()
        .map(|(member, node)| (*member, node.addr.clone()))
        .collect();
    crate::members::entries_of(membership.get_joint_config(), &nodes)
}

/// Follows openraft's server metrics and the recorded acknowledgements,
/// and publishes this node's lease and leadership. Ends, closing the
/// observation stream, when Raft stops.
///
/// It wakes only when something it reads changed: openraft's server
/// metrics (vote, state, leader, membership; sent only when one of them
/// changed, unlike the full metrics, which openraft sends again at every
/// turn of its loop), an acknowledgement, or the lease deadline. The
/// group's member book is set again only when the membership changed.
/// The term is the stored vote's (a leader's vote is stored before it
/// leads, so for the lease it is the term it leads; a follower reports a
/// newer vote once it is flushed, a moment after openraft adopts it, and
/// its `is_self` is false either way). It also keeps openraft's tick on
/// exactly while it is needed (see [`RaftTiming::raft_config`]).
async fn watch_leadership(
    raft: Raft,
    peers: Arc<Peers>,
    timing: RaftTiming,
    lease_cell: Arc<Mutex<Option<Lease>>>,
    tx: watch::Sender<Leadership>,
) {
    let id = peers.self_member();
    let mut metrics = raft.server_metrics();
    let mut booked: Option<Arc<openraft::StoredMembership<MemberId, super::MemberNode>>> = None;
    let mut ticking = false;
    loop {
        let now = Instant::now();
        let (lease, leadership, tick) = {
            let m = metrics.borrow_and_update();
            let membership = m.membership_config.membership();
            if booked.as_ref() != Some(&m.membership_config) {
                // The group's book; group 0's is the node's (S8 admission
                // for every group), as its membership is the node list.
                peers.book().set(book_entries(membership));
                booked = Some(Arc::clone(&m.membership_config));
            }
            let term = Term(m.vote.leader_id().get_term());
            let leads = m.state == ServerState::Leader && m.current_leader == Some(id);
            let lease = if leads {
                lease_from_acks(
                    id,
                    term,
                    membership.get_joint_config(),
                    &peers.acks_in(term),
                    timing.lease(),
                    now,
                )
            } else {
                None
            };
            let leadership = Leadership {
                leader: m.current_leader.map(MemberId::node),
                is_self: lease.is_some_and(|l| l.covers(term, now)),
                term,
            };
            let tick = m.state == ServerState::Leader && !membership.voter_ids().any(|v| v == id);
            (lease, leadership, tick)
        };
        if tick != ticking {
            raft.runtime_config().tick(tick);
            ticking = tick;
        }
        *lock(&lease_cell) = lease;
        tx.send_if_modified(|current| {
            let changed = *current != leadership;
            if changed {
                tracing::info!(node = %id, term = %leadership.term, leader = ?leadership.leader, is_self = leadership.is_self, "leadership");
                *current = leadership.clone();
            }
            changed
        });
        // A lease this node decides alone (it is the only voter: no
        // acknowledgement wakes it) is renewed every heartbeat, long
        // before it would run out; any other is looked at again when an
        // acknowledgement comes, or at its deadline.
        let alone = lease.is_some_and(|l| l.deadline == now + timing.lease());
        let wake = match alone {
            true => Some(now + timing.heartbeat),
            false => lease.filter(|l| l.deadline > now).map(|l| l.deadline),
        };
        tokio::select! {
            changed = metrics.changed() => if changed.is_err() { break },
            _ = peers.next_ack() => {}
            _ = tokio::time::sleep_until(wake.unwrap_or_else(Instant::now)), if wake.is_some() => {}
        }
    }
    *lock(&lease_cell) = None;
    tx.send_replace(Leadership::default());
}

#[async_trait]
impl Coordinator for RaftCoordinator {
    fn node_id(&self) -> NodeId {
        self.id
    }

    async fn campaign(&self) -> Result<(), HaError> {
        let mut rx = self.observations.clone();
        loop {
            if rx.borrow_and_update().is_self {
                return Ok(());
            }
            rx.changed()
                .await
                .map_err(|_| HaError::Coordinator("raft stopped".into()))?;
        }
    }

    async fn transfer_to(&self, to: NodeId) -> Result<(), HaError> {
        self.hand_leadership_to(to).await
    }

    async fn resign(&self) -> Result<(), HaError> {
        if self.raft.metrics().borrow().current_leader != Some(self.member) {
            return Ok(());
        }
        // Live peers only, the most caught-up first; one that declines or
        // does not take over in time is passed over for the next.
        let mut last = Ok(());
        for to in self.successors() {
            match self.hand_leadership_to(to).await {
                Ok(()) => return Ok(()),
                Err(err) => {
                    tracing::warn!(%to, %err, "transfer failed; trying the next peer");
                    last = Err(err);
                }
            }
        }
        last
    }

    async fn resign_for_fresh_term(&self) -> Result<(), HaError> {
        let handed = self.resign().await;
        if self.raft.metrics().borrow().current_leader != Some(self.member) {
            return handed;
        }
        // No peer took over: every live one is behind this node's log (a
        // restart with one peer stale and another away). Raise the term by
        // an election of its own; the peers vote for the longer log.
        tracing::info!(?handed, "no peer took over; campaigning for a fresh term");
        self.raft
            .trigger()
            .elect()
            .await
            .map_err(|err| HaError::Coordinator(err.to_string()))
    }

    fn sole_voter(&self) -> bool {
        let metrics = self.raft.metrics().borrow().clone();
        metrics
            .membership_config
            .membership()
            .voter_ids()
            .all(|id| id == self.member)
    }

    fn observe(&self) -> watch::Receiver<Leadership> {
        self.observations.clone()
    }

    async fn members(&self) -> Result<Vec<NodeId>, HaError> {
        Ok(self.live_members().into_iter().collect())
    }

    fn lease(&self) -> Option<Lease> {
        *lock(&self.lease)
    }

    async fn prev_writer(&self, term: Term) -> Result<Option<Writer>, HaError> {
        let applied = self.applied_through(term).await?;
        Ok(applied.control.writer.map(|w| Writer {
            node: w.node,
            term: w.term,
        }))
    }

    async fn record_promotion(&self, term: Term) -> Result<(), HaError> {
        if !self
            .lease()
            .is_some_and(|lease| lease.covers(term, Instant::now()))
        {
            return Err(HaError::NotLeader);
        }
        self.commit(
            term,
            Request::Promote(WriterRecord {
                node: self.id,
                term,
            }),
        )
        .await
        .map(|_| ())
    }
}

#[async_trait]
impl InSyncTracker for RaftCoordinator {
    async fn in_sync(&self) -> Result<BTreeSet<NodeId>, InSyncError> {
        Ok(self.state_machine.current().control.in_sync.clone())
    }

    async fn remove(
        &self,
        term: Term,
        replicas: &BTreeSet<NodeId>,
    ) -> Result<BTreeSet<NodeId>, InSyncError> {
        let remove = replicas.clone();
        self.commit_in_sync(term, Request::ShrinkInSync { term, remove })
            .await
    }

    async fn add(
        &self,
        term: Term,
        replicas: &BTreeSet<NodeId>,
    ) -> Result<BTreeSet<NodeId>, InSyncError> {
        let add = replicas.clone();
        self.commit_in_sync(term, Request::GrowInSync { term, add })
            .await
    }

    async fn volume_size(&self) -> Result<Option<u64>, InSyncError> {
        Ok(self.state_machine.current().control.volume_size())
    }

    async fn resize(&self, term: Term, size: u64) -> Result<(), InSyncError> {
        self.commit_in_sync(term, Request::Resize { term, size })
            .await
            .map(|_| ())
    }
}

impl RaftCoordinator {
    /// Commits an in-sync change in `term` and returns the committed set.
    async fn commit_in_sync(
        &self,
        term: Term,
        request: Request,
    ) -> Result<BTreeSet<NodeId>, InSyncError> {
        let response = self.commit(term, request).await.map_err(|err| match err {
            HaError::Refused(why) => InSyncError::Refused(why),
            other => InSyncError::Uncommitted(other.to_string()),
        })?;
        Ok(response.in_sync)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const LEASE: Duration = Duration::from_millis(250);

    #[test]
    fn the_deadline_is_the_quorum_th_newest_ack_plus_the_lease_and_time_does_not_move_it() {
        let t0 = Instant::now();
        let voters = vec![BTreeSet::from([MemberId(1), MemberId(2), MemberId(3)])];
        let acks = HashMap::from([
            (MemberId(2), t0),
            (MemberId(3), t0 + Duration::from_millis(40)),
        ]);
        for later in [0, 100, 1000, 5000] {
            let now = t0 + Duration::from_millis(later);
            let lease = lease_from_acks(MemberId(1), Term(7), &voters, &acks, LEASE, now).unwrap();
            // Self and node 3 make the quorum: node 3's send time decides.
            assert_eq!(lease.deadline, t0 + Duration::from_millis(40) + LEASE);
            assert_eq!(lease.term, Term(7));
        }
    }

    #[test]
    fn without_a_quorum_of_acks_there_is_no_lease() {
        let t0 = Instant::now();
        let five = vec![BTreeSet::from([
            MemberId(1),
            MemberId(2),
            MemberId(3),
            MemberId(4),
            MemberId(5),
        ])];
        let acks = HashMap::from([(MemberId(2), t0)]);
        assert_eq!(
            lease_from_acks(MemberId(1), Term(7), &five, &acks, LEASE, t0),
            None
        );
        let acks = HashMap::from([
            (MemberId(2), t0),
            (MemberId(4), t0 + Duration::from_millis(10)),
        ]);
        let lease = lease_from_acks(MemberId(1), Term(7), &five, &acks, LEASE, t0).unwrap();
        assert_eq!(lease.deadline, t0 + LEASE, "the older of the two peer acks");
    }

    #[test]
    fn a_joint_config_needs_a_quorum_of_each_half() {
        let t0 = Instant::now();
        let joint = vec![
            BTreeSet::from([MemberId(1), MemberId(2), MemberId(3)]),
            BTreeSet::from([MemberId(1), MemberId(4), MemberId(5)]),
        ];
        let acks = HashMap::from([
            (MemberId(2), t0 + Duration::from_millis(30)),
            (MemberId(4), t0),
        ]);
        let lease = lease_from_acks(MemberId(1), Term(7), &joint, &acks, LEASE, t0).unwrap();
        assert_eq!(lease.deadline, t0 + LEASE);
        let only_old_half = HashMap::from([(MemberId(2), t0)]);
        assert_eq!(
            lease_from_acks(MemberId(1), Term(7), &joint, &only_old_half, LEASE, t0),
            None
        );
    }

    #[test]
    fn a_lone_voter_leads_without_acks() {
        let now = Instant::now();
        let lone = vec![BTreeSet::from([MemberId(1)])];
        // S8: another incarnation of a voter acknowledges nothing for it.
        let voters = vec![BTreeSet::from([MemberId(1), MemberId(2), MemberId(3)])];
        let other_three = MemberId::new(NodeId(3), crate::ids::Incarnation(9));
        let acks = HashMap::from([(other_three, now)]);
        assert_eq!(
            lease_from_acks(MemberId(1), Term(3), &voters, &acks, LEASE, now),
            None
        );
        let lease =
            lease_from_acks(MemberId(1), Term(3), &lone, &HashMap::new(), LEASE, now).unwrap();
        assert_eq!(lease.deadline, now + LEASE);
    }
}
