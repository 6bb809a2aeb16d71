//! Raft's RPCs over gRPC: the client openraft calls, and the server that
//! hands requests to the local openraft instance.
//!
//! - openraft's messages travel as JSON in a [`RaftMessage`] that names the
//!   cluster, the sender, the member it is meant for and the Raft group;
//!   a message of another cluster is refused (`FAILED_PRECONDITION`), an
//!   undecodable one too (`INVALID_ARGUMENT`), and one for a group this
//!   node does not run is refused (`NOT_FOUND`) after the sender was
//!   admitted, before any group sees it. Group 0, which a node of an
//!   earlier build names by leaving the field out, is the one group a
//!   node runs today.
//! - **S8, no amnesia.** Raft names members by node *and* incarnation
//!   ([`crate::ids::MemberId`]). Every message, pre-vote and transfer names
//!   the member it is for, and a node refuses one meant for another
//!   incarnation of itself (`FAILED_PRECONDITION`, "replaced disk"): a node
//!   that lost its Raft state never votes, acknowledges an append or counts
//!   toward a quorum as its former self. Its new incarnation is heard only
//!   once a committed membership change names it (see [`crate::members`]).
//! - One lazily connected channel per peer, built by [`crate::net`] inside
//!   the Raft runtime ([`super::runtime`]) when one is set, so its
//!   connection is driven there; openraft waits one heartbeat interval for
//!   each call. A call that ran out of time is reported as a network error:
//!   openraft just tries again at the next heartbeat. An AppendEntries call
//!   goes on in a task of its own past openraft's wait, up to
//!   `election_timeout_max`, so a reply that comes late still counts as an
//!   acknowledgement by its send time. (Measured under a saturating client
//!   on two cores: followers' replies took over 50 ms for long enough that
//!   none counted, the lease ran out while both followers still took every
//!   heartbeat, and the writer closed its sessions at an unchanged term.)
//!   Only a
//!   peer that cannot be reached at all is reported as `Unreachable`, and
//!   openraft then backs off for [`UNREACHABLE_BACKOFF`], not its default
//!   500 ms. (Measured under nbdcopy's default flood: one heartbeat reply
//!   later than 50 ms, reported as `Unreachable`, silenced replication to
//!   that peer for 500 ms — twice the lease — and when it hit both peers at
//!   once the writer lost its lease.)
//! - The server's handlers run on the Raft runtime too, when one is set.
//! - **Start-up window.** openraft keeps "when did I last hear the leader"
//!   in memory only; a restarted node would vote at once and could elect a
//!   new leader while the old one's lease still runs. So for its first
//!   `election_timeout_max` a node refuses votes (and the coordinator keeps
//!   elections off).
//! - **Transfer.** openraft 0.9 has no leader transfer, so we build one: the
//!   leader's controller closes and drains its write gate, then the leader
//!   stops heartbeats and asks the target to campaign, at once (see
//!   [`votes::campaign_for_transfer`]): the old leader's vote and the target's own
//!   make a majority of three, and the old leader has nothing left to
//!   protect with a lease. Meanwhile the old leader refuses votes from any
//!   other node, so only the target can win.
//! - **What is per group, what per node.** [`Peers`] is one group's: its
//!   acknowledgements (the lease clock), leader contact, campaign and
//!   vote-refusal state. [`PeerBook`] is the node's, shared by its groups:
//!   identity, the configured peers and member book, one channel per peer,
//!   when each peer was last heard, the Raft runtime, and the admission of
//!   every message.
//! - **Liveness.** Every successful exchange with a peer, in either
//!   direction, is recorded; `members` lists the peers heard from within a
//!   lease.
//! - **Acknowledgements (the lease clock).** [`PeerClient`] takes the time
//!   just *before* it sends each AppendEntries (heartbeat or append) and
//!   each vote request. When the reply shows that the peer accepted this
//!   node's vote — AppendEntries `Success`, `PartialSuccess` or `Conflict`
//!   (each is returned only after the follower took our vote as its own;
//!   only `HigherVote` is a refusal), or a granted vote — that send time is
//!   recorded for the peer, tagged with the term of our vote. Per peer only
//!   the newest send time of the highest term is kept, so a late reply to an
//!   old request never moves it back or forward. The coordinator builds the
//!   lease from these times alone (see [`super`], the lease).
//! - **The follower's side of the same argument.** A follower counts as
//!   having heard a leader (`leader_contact`, which holds back its own
//!   campaign and its pre-vote) on exactly the replies the leader counts as
//!   acknowledgements: every AppendEntries reply but `HigherVote`, and a
//!   granted vote. The contact is taken after openraft handled the request,
//!   so it is never earlier than the leader's send time.

mod batch;
mod client;
mod server;
mod votes;

pub use client::{Network, PeerClient};
pub use server::{RaftService, ServedGroups};

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::error::{
    InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable,
};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::runtime::Handle;
use tokio::time::Instant;
use tonic::transport::Channel;
use tonic::{Request as GrpcRequest, Response as GrpcResponse, Status};

use super::{MemberId, MemberNode, NodeId, Raft, Term, TypeConfig};
use crate::ids::GroupId;
use crate::members::MemberBook;
use crate::net::{Caller, Expect, Transport, TransportError};
use crate::proto::raft::raft_client::RaftClient;
use crate::proto::raft::raft_server;
use crate::proto::raft::{
    PreVoteReply, PreVoteRequest, RaftMessage, TransferReply, TransferRequest,
};

/// Why no client for a peer could be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PeerError {
    /// The node is not one of the configured peers.
    #[error("node {0} is not a configured peer")]
    Unknown(NodeId),
    /// The peer's address is unusable.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// What the client and the server of one group share: the node's
/// [`PeerBook`] (reached through this type too) and the group's own lease
/// evidence, leader contact and vote refusals.
pub struct Peers {
    /// What every group of this node shares.
    node: Arc<PeerBook>,
    /// The Raft group whose messages these are.
    group: GroupId,
    /// The group's membership, as its coordinator last saw it: for group
    /// 0 (the cluster group, every node) the node's own book.
    members: Arc<MemberBook>,
    /// Votes are refused until then (the start-up window).
    votes_from: Instant,
    /// When a leader was last heard (append entries) or a vote granted.
    leader_contact: Mutex<Instant>,
    /// Per member: the term and send time of the newest request of ours it
    /// accepted (see the module docs, acknowledgements). Per member, not
    /// per node: one incarnation's acknowledgement never counts for
    /// another's place in a quorum.
    acks: Mutex<HashMap<MemberId, (Term, Instant)>>,
    /// Woken on every new acknowledgement.
    acked: tokio::sync::Notify,
    /// When a peer last refused our vote because its log is ahead of ours.
    behind_since: Mutex<Option<Instant>>,
    /// When this node last started a campaign.
    campaigned_at: Mutex<Option<Instant>>,
    /// When this node's own pre-vote round began, while it runs.
    pre_voting_since: Mutex<Option<Instant>>,
    /// When this node last granted another node's pre-vote.
    granted_pre_vote_at: Mutex<Option<Instant>>,
    /// While a transfer to this node runs, votes from others are refused.
    transfer: Mutex<Option<(NodeId, Instant)>>,
    /// Until when this node, as leader, hands its leadership over (it
    /// sends no heartbeats meanwhile).
    handing_over: Mutex<Option<Instant>>,
    election_timeout_max: Duration,
}

/// What every Raft group of one node shares: who the node is, whom it may
/// hear (the configured peers and the member book, S8, S9), one channel per
/// peer, when each peer was last heard, and the Raft runtime.
pub struct PeerBook {
    cluster_id: String,
    self_id: NodeId,
    /// This node in Raft: its id and its data dir's incarnation.
    self_member: MemberId,
    /// The configured peer list's addresses (first formation, and peers
    /// whose address the membership does not record).
    addresses: BTreeMap<NodeId, String>,
    /// The membership as the coordinator last saw it.
    book: Arc<MemberBook>,
    transport: Transport,
    channels: Mutex<HashMap<NodeId, Channel>>,
    heard: Mutex<HashMap<NodeId, Instant>>,
    /// Each peer's heartbeat batcher (see [`batch`]).
    batchers: Mutex<HashMap<NodeId, batch::Batcher>>,
    /// Rounds of heartbeats sent, and the heartbeats they held.
    batched: batch::Counts,
    /// The Raft runtime, when Raft has one (see [`super::runtime`]).
    runtime: std::sync::OnceLock<Handle>,
}

/// How long openraft waits before it calls a peer again that could not be
/// reached: short against the lease, so a peer that is back is heard from
/// within a heartbeat or two.
pub const UNREACHABLE_BACKOFF: Duration = Duration::from_millis(100);

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

impl Peers {
    /// The peers of `group` on the node of `node`.
    pub fn of_group(
        node: Arc<PeerBook>,
        group: GroupId,
        election_timeout_max: Duration,
    ) -> Arc<Self> {
        let members = match group {
            GroupId::FIRST => Arc::clone(&node.book),
            _ => Arc::default(),
        };
        Arc::new(Self {
            node,
            group,
            members,
            votes_from: Instant::now() + election_timeout_max,
            leader_contact: Mutex::new(Instant::now()),
            acks: Mutex::default(),
            acked: tokio::sync::Notify::new(),
            behind_since: Mutex::new(None),
            campaigned_at: Mutex::new(None),
            pre_voting_since: Mutex::new(None),
            granted_pre_vote_at: Mutex::new(None),
            transfer: Mutex::default(),
            handing_over: Mutex::default(),
            election_timeout_max,
        })
    }

    /// What every group of this node shares.
    pub fn node(&self) -> &Arc<PeerBook> {
        &self.node
    }

    /// The Raft group every message of these peers names.
    pub fn group(&self) -> GroupId {
        self.group
    }

    /// The group's membership (see [`crate::members`]); the node's book,
    /// which admits peers (S8), is [`PeerBook::book`], reached through
    /// [`Peers::node`].
    pub fn book(&self) -> &Arc<MemberBook> {
        &self.members
    }

    /// The group's other members; before the group has a membership, the
    /// node's peers.
    pub fn peer_ids(&self) -> Vec<NodeId> {
        let members = self.members.entries();
        match members.is_empty() {
            true => self.node.peer_ids(),
            false => members
                .into_keys()
                .filter(|id| *id != self.node.self_id)
                .collect(),
        }
    }

    /// Records that `peer` accepted our vote of `term` in a request sent at
    /// `sent_at`. Keeps only the newest send time of the highest term.
    fn record_ack(&self, peer: MemberId, term: Term, sent_at: Instant) {
        let mut acks = lock(&self.acks);
        let newer = match acks.get(&peer) {
            Some((known, at)) => term > *known || (term == *known && sent_at > *at),
            None => true,
        };
        if newer {
            acks.insert(peer, (term, sent_at));
            drop(acks);
            self.acked.notify_one();
        }
    }

    /// Each member's newest acknowledged send time in `term`.
    pub fn acks_in(&self, term: Term) -> HashMap<MemberId, Instant> {
        lock(&self.acks)
            .iter()
            .filter(|(_, (t, _))| *t == term)
            .map(|(peer, (_, at))| (*peer, *at))
            .collect()
    }

    /// Resolves at the next acknowledgement (or at once if one came since
    /// the last call).
    pub async fn next_ack(&self) {
        self.acked.notified().await
    }

    /// When a leader was last heard from, or a vote last granted.
    pub fn last_leader_contact(&self) -> Instant {
        *lock(&self.leader_contact)
    }

    fn leader_heard(&self) {
        *lock(&self.leader_contact) = Instant::now();
    }

    /// `payload` in an envelope for member `to` (a reply's goes back to
    /// whoever asked: `to` 0).
    fn envelope<T: Serialize>(&self, to: u64, payload: &T) -> Result<RaftMessage, String> {
        Ok(RaftMessage {
            cluster_id: self.node.cluster_id.clone(),
            from: self.node.self_id.0,
            payload: serde_json::to_vec(payload)
                .map_err(|e| format!("encode: {e}"))?
                .into(),
            to,
            group: self.group.0,
        })
    }
}

/// A group's peers are its node's too: the node-wide book is read through
/// them.
impl std::ops::Deref for Peers {
    type Target = PeerBook;

    fn deref(&self) -> &PeerBook {
        &self.node
    }
}

impl PeerBook {
    /// `addresses` maps every configured peer (not this node) to
    /// `HOST:PORT`; `book` is the membership as the coordinator keeps it.
    pub fn new(
        cluster_id: String,
        self_member: MemberId,
        addresses: BTreeMap<NodeId, String>,
        book: Arc<MemberBook>,
        transport: Transport,
    ) -> Arc<Self> {
        Arc::new(Self {
            cluster_id,
            self_id: self_member.node(),
            self_member,
            addresses,
            book,
            transport,
            channels: Mutex::default(),
            heard: Mutex::default(),
            batchers: Mutex::default(),
            batched: batch::Counts::default(),
            runtime: std::sync::OnceLock::new(),
        })
    }

    /// Builds channels on, and runs the server's handlers on, `runtime`
    /// from now on. Call before the first RPC; a second call is ignored.
    pub fn run_on(&self, runtime: Handle) {
        let _ = self.runtime.set(runtime);
    }

    /// The cluster id every message must carry.
    pub fn cluster_id(&self) -> &str {
        &self.cluster_id
    }

    /// This node's id.
    pub fn self_id(&self) -> NodeId {
        self.self_id
    }

    /// This node in Raft (id and incarnation).
    pub fn self_member(&self) -> MemberId {
        self.self_member
    }

    /// The node's member book: the cluster group's membership.
    pub fn book(&self) -> &Arc<MemberBook> {
        &self.book
    }

    /// The peers (without this node): the members, and before there is a
    /// membership, the configured peers.
    pub fn peer_ids(&self) -> Vec<NodeId> {
        let book = self.book.entries();
        let known = if book.is_empty() {
            self.addresses.keys().copied().collect::<Vec<_>>()
        } else {
            book.keys().copied().collect()
        };
        known.into_iter().filter(|id| *id != self.self_id).collect()
    }

    /// Where `peer`'s gRPC listener is: this node's peer list's address
    /// (it knows best how this node reaches the peer: through a proxy, a
    /// NAT), else the membership's record (a node added at run time).
    pub fn address(&self, peer: NodeId) -> Option<String> {
        if let Some(addr) = self.addresses.get(&peer) {
            return Some(addr.clone());
        }
        match self.book.entries().get(&peer) {
            Some(entry) if !entry.addr.is_empty() => Some(entry.addr.clone()),
            _ => None,
        }
    }

    /// The member a message to `peer` is meant for: the book's, else the
    /// node's incarnation-0 member (a cluster older than incarnations).
    pub fn member_of(&self, peer: NodeId) -> MemberId {
        self.book
            .member(peer)
            .unwrap_or(MemberId::new(peer, crate::ids::Incarnation(0)))
    }

    /// The peers heard from since `since`.
    pub fn heard_since(&self, since: Instant) -> Vec<NodeId> {
        lock(&self.heard)
            .iter()
            .filter(|(_, at)| **at >= since)
            .map(|(id, _)| *id)
            .collect()
    }

    /// When `peer` was last heard from (in either direction), if it was
    /// since this node started.
    pub fn last_heard(&self, peer: NodeId) -> Option<Instant> {
        lock(&self.heard).get(&peer).copied()
    }

    fn touch(&self, peer: NodeId) {
        lock(&self.heard).insert(peer, Instant::now());
    }

    /// A client for `peer`, on its cached channel.
    pub fn client(&self, peer: NodeId) -> Result<RaftClient<Channel>, PeerError> {
        let mut channels = lock(&self.channels);
        let channel = match channels.get(&peer) {
            Some(channel) => channel.clone(),
            None => {
                let addr = self.address(peer).ok_or(PeerError::Unknown(peer))?;
                // The channel spawns its connection task where it is built.
                let _on_raft = self.runtime.get().map(Handle::enter);
                let channel = self.transport.channel(&addr, Expect::Node(peer))?;
                channels.insert(peer, channel.clone());
                channel
            }
        };
        Ok(self.transport.limit(RaftClient::new(channel)))
    }

    /// Drops the cached channel to `peer` after a transport failure.
    fn forget_channel(&self, peer: NodeId) {
        lock(&self.channels).remove(&peer);
    }

    /// Checks the envelope of an incoming message: its cluster; the node it
    /// says it comes from, which must be the node whose certificate
    /// `caller` presented (S9) and a member or configured peer; and the
    /// member it is meant for, which must be this node in this incarnation
    /// (S8). Records the sender and returns it.
    fn admit(
        &self,
        caller: &Caller,
        cluster_id: &str,
        from: u64,
        to: u64,
    ) -> Result<NodeId, Status> {
        if cluster_id != self.cluster_id {
            return Err(Status::failed_precondition(format!(
                "message of cluster {cluster_id:?}, this node belongs to {:?}",
                self.cluster_id
            )));
        }
        let from = NodeId(from);
        caller.check_claim(from)?;
        if !self.addresses.contains_key(&from) && self.book.member(from).is_none() {
            return Err(Status::permission_denied(format!(
                "node {from} is not a member of this cluster"
            )));
        }
        // 0: a node of the version before incarnations, which names no
        // member; it can mean only incarnation 0 of this node.
        let to = match to {
            0 => MemberId::new(self.self_id, crate::ids::Incarnation(0)),
            to => MemberId(to),
        };
        if to != self.self_member {
            return Err(Status::failed_precondition(format!(
                "replaced disk: this is node {} in incarnation {}, not member {to}; it answers only once a membership change names it (`replica-ha members replace --id {}`)",
                self.self_id,
                self.self_member.incarnation(),
                self.self_id
            )));
        }
        self.touch(from);
        Ok(from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers() -> Arc<Peers> {
        let addresses = [(NodeId(1), "127.0.0.1:1"), (NodeId(2), "127.0.0.1:2")]
            .into_iter()
            .map(|(id, addr)| (id, addr.to_string()))
            .collect();
        let node = PeerBook::new(
            "c".into(),
            MemberId(1),
            addresses,
            Arc::default(),
            Transport::default(),
        );
        Peers::of_group(node, GroupId::FIRST, Duration::from_millis(300))
    }

    /// The lease clock is a group's own: an acknowledgement in one group
    /// never counts for another's lease (S4 stays local to one volume),
    /// while what a node knows of its peers is shared by its groups.
    #[test]
    fn a_nodes_groups_share_its_book_but_not_their_lease_evidence() {
        let first = peers();
        let other = Peers::of_group(
            Arc::clone(first.node()),
            GroupId(5),
            Duration::from_millis(300),
        );
        first.record_ack(MemberId(2), Term(3), Instant::now());
        assert_eq!(first.acks_in(Term(3)).len(), 1);
        assert!(other.acks_in(Term(3)).is_empty(), "an ack crossed groups");
        let before = other.last_leader_contact();
        std::thread::sleep(Duration::from_millis(2));
        first.leader_heard();
        assert_eq!(other.last_leader_contact(), before);
        let since = Instant::now();
        first.admit(&Caller::Unauthenticated, "c", 2, 1).unwrap();
        assert_eq!(other.heard_since(since), vec![NodeId(2)]);
        let message = other.envelope(0, &()).unwrap();
        assert_eq!(
            (message.group, first.envelope(0, &()).unwrap().group),
            (5, 0)
        );
    }

    #[test]
    fn only_a_member_of_this_cluster_is_admitted_and_only_it_is_heard() {
        let peers = peers();
        let since = Instant::now();
        let anyone = Caller::Unauthenticated;
        let other_cluster = peers.admit(&anyone, "d", 2, 1).unwrap_err();
        assert_eq!(other_cluster.code(), tonic::Code::FailedPrecondition);
        let stranger = peers.admit(&anyone, "c", 9, 1).unwrap_err();
        assert_eq!(stranger.code(), tonic::Code::PermissionDenied);
        assert!(
            peers.heard_since(since).is_empty(),
            "a refused sender is not heard"
        );
        assert_eq!(peers.admit(&anyone, "c", 2, 1).unwrap(), NodeId(2));
        assert_eq!(peers.heard_since(since), vec![NodeId(2)]);
    }

    #[test]
    fn a_message_meant_for_another_incarnation_of_this_node_is_refused() {
        let peers = peers();
        let anyone = Caller::Unauthenticated;
        let former = MemberId::new(NodeId(1), crate::ids::Incarnation(77));
        let refused = peers.admit(&anyone, "c", 2, former.0).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
        assert!(
            refused.message().starts_with("replaced disk"),
            "{refused:?}"
        );
        assert_eq!(peers.admit(&anyone, "c", 2, 1).unwrap(), NodeId(2));
        // A sender from before incarnations names no member (0): that can
        // mean only incarnation 0, so a replaced node refuses it.
        assert_eq!(peers.admit(&anyone, "c", 2, 0).unwrap(), NodeId(2));
        let replaced = PeerBook::new(
            "c".into(),
            former,
            [(NodeId(2), "127.0.0.1:2".to_string())].into(),
            Arc::default(),
            Transport::default(),
        );
        let refused = replaced.admit(&anyone, "c", 2, 0).unwrap_err();
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    }

    #[test]
    fn only_a_voter_in_the_named_incarnation_may_be_elected() {
        let peers = peers();
        // No membership yet (forming): nobody is refused on this ground.
        assert_eq!(peers.refuse_non_voter(NodeId(9), None), None);
        let entry = |member: MemberId, voter: bool| crate::members::Entry {
            member,
            addr: String::new(),
            voter,
        };
        let three_new = MemberId::new(NodeId(3), crate::ids::Incarnation(5));
        peers.book().set(
            [
                (NodeId(1), entry(MemberId(1), true)),
                (NodeId(2), entry(MemberId(2), true)),
                (NodeId(3), entry(three_new, false)),
            ]
            .into(),
        );
        assert_eq!(peers.refuse_non_voter(NodeId(2), Some(MemberId(2))), None);
        assert!(
            peers.refuse_non_voter(NodeId(9), None).is_some(),
            "not a member"
        );
        assert!(
            peers.refuse_non_voter(NodeId(3), Some(three_new)).is_some(),
            "a learner"
        );
        let two_old = MemberId::new(NodeId(2), crate::ids::Incarnation(1));
        assert!(
            peers.refuse_non_voter(NodeId(2), Some(two_old)).is_some(),
            "a former incarnation"
        );
    }

    #[test]
    fn a_message_is_admitted_only_from_the_node_whose_certificate_sent_it() {
        let peers = peers();
        let since = Instant::now();
        let impostor = peers
            .admit(&Caller::Node(NodeId(3)), "c", 2, 1)
            .unwrap_err();
        assert_eq!(impostor.code(), tonic::Code::PermissionDenied);
        assert!(impostor.message().contains("claims node 2"), "{impostor:?}");
        let tool = Caller::Client {
            name: "ops".into(),
            role: crate::certs::Role::Admin,
        };
        assert_eq!(
            peers.admit(&tool, "c", 2, 1).unwrap_err().code(),
            tonic::Code::PermissionDenied
        );
        assert!(
            peers.heard_since(since).is_empty(),
            "a refused sender is not heard"
        );
        assert_eq!(
            peers.admit(&Caller::Node(NodeId(2)), "c", 2, 1).unwrap(),
            NodeId(2)
        );
    }
}
