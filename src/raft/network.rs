//! Raft's RPCs over gRPC: the client openraft calls, and the server that
//! hands requests to the local openraft instance.
//!
//! - openraft's messages travel as JSON in a [`RaftMessage`] that names the
//!   cluster, the sender and the member it is meant for; a message of
//!   another cluster is refused (`FAILED_PRECONDITION`), an undecodable one
//!   too (`INVALID_ARGUMENT`).
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
//!   [`campaign_for_transfer`]): the old leader's vote and the target's own
//!   make a majority of three, and the old leader has nothing left to
//!   protect with a lease. Meanwhile the old leader refuses votes from any
//!   other node, so only the target can win.
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

/// What the client and the server of one node share.
pub struct Peers {
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
    election_timeout_max: Duration,
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
    /// `addresses` maps every configured peer (not this node) to
    /// `HOST:PORT`; `book` is the membership as the coordinator keeps it.
    pub fn new(
        cluster_id: String,
        self_member: MemberId,
        addresses: BTreeMap<NodeId, String>,
        book: Arc<MemberBook>,
        transport: Transport,
        election_timeout_max: Duration,
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
            votes_from: Instant::now() + election_timeout_max,
            leader_contact: Mutex::new(Instant::now()),
            acks: Mutex::default(),
            acked: tokio::sync::Notify::new(),
            behind_since: Mutex::new(None),
            campaigned_at: Mutex::new(None),
            pre_voting_since: Mutex::new(None),
            granted_pre_vote_at: Mutex::new(None),
            transfer: Mutex::default(),
            election_timeout_max,
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

    /// The member book the coordinator keeps.
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

    /// Why this node would not vote for `candidate` (whose log ends before
    /// `next_index`) in a new election now, if it would not.
    fn refuse_pre_vote(&self, candidate: NodeId, next_index: u64, raft: &Raft) -> Option<String> {
        if let Some(why) = self.refuse_vote(candidate) {
            return Some(why);
        }
        if let Some(why) = self.refuse_non_voter(candidate, None) {
            return Some(why);
        }
        let metrics = raft.metrics().borrow().clone();
        let now = Instant::now();
        let own = *lock(&self.campaigned_at);
        let view = PreVoteView {
            leads: metrics.state == openraft::ServerState::Leader,
            campaigned_recently: own
                .is_some_and(|at| now.duration_since(at) < self.election_timeout_max / 4),
            asking: lock(&self.pre_voting_since).is_some(),
            quiet: now.duration_since(self.last_leader_contact()),
            log_end: metrics.last_log_index.map_or(0, |i| i + 1),
        };
        pre_vote_refusal(
            self.self_id,
            candidate,
            next_index,
            &view,
            self.election_timeout_max,
        )
    }

    /// Records that this node's own pre-vote round begins (`true`) or is
    /// over (`false`).
    pub fn note_pre_voting(&self, asking: bool) {
        *lock(&self.pre_voting_since) = asking.then(Instant::now);
    }

    /// Whether this node granted another node's pre-vote at or after
    /// `since`: that node is about to campaign, and this one holds off
    /// rather than split the vote.
    pub fn granted_pre_vote_since(&self, since: Instant) -> bool {
        lock(&self.granted_pre_vote_at).is_some_and(|at| at >= since)
    }

    fn note_pre_vote_granted(&self) {
        *lock(&self.granted_pre_vote_at) = Some(Instant::now());
    }

    /// Records that this node is starting a campaign now.
    pub fn note_campaign(&self) {
        *lock(&self.campaigned_at) = Some(Instant::now());
    }

    /// When a peer last refused our vote because its log is ahead.
    pub fn last_behind(&self) -> Option<Instant> {
        *lock(&self.behind_since)
    }

    fn leader_heard(&self) {
        *lock(&self.leader_contact) = Instant::now();
    }

    /// Drops the cached channel to `peer` after a transport failure.
    fn forget_channel(&self, peer: NodeId) {
        lock(&self.channels).remove(&peer);
    }

    /// Whether a transfer to another node is running: this node then
    /// neither campaigns nor votes for anyone but the target.
    pub fn transfer_elsewhere(&self) -> bool {
        matches!(*lock(&self.transfer), Some((target, until)) if target != self.self_id && Instant::now() < until)
    }

    /// Marks a transfer to `target` as running for a few election timeouts.
    pub fn begin_transfer(&self, target: NodeId) {
        let until = Instant::now() + self.election_timeout_max * 4;
        *lock(&self.transfer) = Some((target, until));
    }

    /// Ends a transfer early.
    pub fn end_transfer(&self) {
        *lock(&self.transfer) = None;
    }

    /// Why node `candidate` (as `member`, when the request names it) may
    /// not be elected as far as this node's membership goes: it is not a
    /// voter, or not in the incarnation the membership names (S8). Refusing
    /// a vote is always safe; this keeps a removed node, or a node's former
    /// incarnation, from disturbing the members. A node with no membership
    /// (forming) refuses nobody on this ground.
    fn refuse_non_voter(&self, candidate: NodeId, member: Option<MemberId>) -> Option<String> {
        let book = self.book.entries();
        if book.is_empty() {
            return None;
        }
        match book.get(&candidate) {
            None => Some(format!("node {candidate} is not a member")),
            Some(entry) if !entry.voter => Some(format!("node {candidate} is not a voter")),
            Some(entry) if member.is_some_and(|m| m != entry.member) => Some(format!(
                "member {} is not the incarnation of node {candidate} in the membership ({})",
                member.unwrap_or_default(),
                entry.member
            )),
            Some(_) => None,
        }
    }

    /// Why a vote from `candidate` must be refused now, if it must.
    fn refuse_vote(&self, candidate: NodeId) -> Option<String> {
        let now = Instant::now();
        let transfer = *lock(&self.transfer);
        // The target of a running transfer gets the vote even in the
        // start-up window: the leader that this node heard (or is) hands
        // over, so no forgotten lease of another leader can be running.
        let transfer_target =
            matches!(transfer, Some((target, until)) if target == candidate && now < until);
        if now < self.votes_from && !transfer_target {
            return Some("starting up: not voting yet".into());
        }
        match transfer {
            Some((target, until)) if now < until && candidate != target => {
                Some(format!("leadership is being transferred to node {target}"))
            }
            _ => None,
        }
    }

    /// `payload` in an envelope for member `to` (a reply's goes back to
    /// whoever asked: `to` 0).
    fn envelope<T: Serialize>(&self, to: u64, payload: &T) -> Result<RaftMessage, String> {
        Ok(RaftMessage {
            cluster_id: self.cluster_id.clone(),
            from: self.self_id.0,
            payload: serde_json::to_vec(payload)
                .map_err(|e| format!("encode: {e}"))?
                .into(),
            to,
        })
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

/// What a node knows of itself when a peer asks for its pre-vote.
#[derive(Debug, Clone, Copy)]
struct PreVoteView {
    /// It leads.
    leads: bool,
    /// It started a campaign of its own within `election_max / 4`.
    campaigned_recently: bool,
    /// Its own pre-vote round is running.
    asking: bool,
    /// How long since it heard a leader (or granted a vote).
    quiet: Duration,
    /// Where its log ends (the next index).
    log_end: u64,
}

/// Why `me` would not grant `candidate`'s pre-vote (its log ending before
/// `next_index`), if it would not. Of two nodes that lost the leader at
/// once, the one that campaigned first wins; of two asking at the same
/// moment, the longer log, or on a tie the lower id (the other grants it
/// and holds off; see `detector`).
fn pre_vote_refusal(
    me: NodeId,
    candidate: NodeId,
    next_index: u64,
    view: &PreVoteView,
    election_max: Duration,
) -> Option<String> {
    if view.leads {
        return Some("this node leads".into());
    }
    if view.campaigned_recently {
        return Some("campaigning myself".into());
    }
    if view.asking && next_index <= view.log_end && candidate > me {
        return Some("asking for votes myself; the lower id goes first".into());
    }
    if view.quiet < election_max {
        return Some(format!("heard a leader {:?} ago", view.quiet));
    }
    if next_index < view.log_end {
        return Some(format!(
            "log ends at {next_index}, mine at {}",
            view.log_end
        ));
    }
    None
}

fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, Status> {
    serde_json::from_slice(payload)
        .map_err(|e| Status::invalid_argument(format!("malformed Raft message: {e}")))
}

/// openraft's network factory: one [`PeerClient`] per target.
#[derive(Clone)]
pub struct Network {
    peers: Arc<Peers>,
}

impl Network {
    /// A factory over `peers`.
    pub fn new(peers: Arc<Peers>) -> Self {
        Self { peers }
    }
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerClient;

    async fn new_client(&mut self, target: MemberId, _node: &MemberNode) -> PeerClient {
        PeerClient {
            target,
            peers: Arc::clone(&self.peers),
        }
    }
}

/// The client side of Raft's RPCs to one member.
pub struct PeerClient {
    target: MemberId,
    peers: Arc<Peers>,
}

#[derive(Clone, Copy)]
enum Rpc {
    Append,
    Vote,
    Snapshot,
}

type RpcResult<T, E> = Result<T, RPCError<MemberId, MemberNode, RaftError<MemberId, E>>>;

impl PeerClient {
    async fn call<Req, Resp, E>(&self, rpc: Rpc, request: &Req, ttl: Duration) -> RpcResult<Resp, E>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let unreachable = |why: String| RPCError::Unreachable(Unreachable::new(&NetErr(why)));
        let message = self
            .peers
            .envelope(self.target.0, request)
            .map_err(|e| RPCError::Network(NetworkError::new(&NetErr(e))))?;
        let node = self.target.node();
        let mut client = self
            .peers
            .client(node)
            .map_err(|e| unreachable(e.to_string()))?;
        let mut grpc = GrpcRequest::new(message);
        grpc.set_timeout(ttl);
        let reply = match rpc {
            Rpc::Append => client.append_entries(grpc).await,
            Rpc::Vote => client.vote(grpc).await,
            Rpc::Snapshot => client.install_snapshot(grpc).await,
        }
        .map_err(|status| {
            let why = format!("{}: {}", status.code(), status.message());
            if ran_out_of_time(&status) {
                // The peer is there but slow: try again at the next
                // heartbeat, on the same connection.
                return RPCError::Network(NetworkError::new(&NetErr(why)));
            }
            // A channel whose connection failed is rebuilt on the next call.
            self.peers.forget_channel(node);
            unreachable(why)
        })?
        .into_inner();
        self.peers.touch(node);
        let result: Result<Resp, RaftError<MemberId, E>> =
            serde_json::from_slice(&reply.payload)
                .map_err(|e| unreachable(format!("malformed reply: {e}")))?;
        result.map_err(|err| RPCError::RemoteError(RemoteError::new(self.target, err)))
    }
}

/// Whether a call failed only because its deadline passed.
fn ran_out_of_time(status: &Status) -> bool {
    match status.code() {
        tonic::Code::DeadlineExceeded => true,
        // tonic's client-side timeout reports itself as cancelled.
        tonic::Code::Cancelled => status.message().contains("Timeout expired"),
        _ => false,
    }
}

#[derive(Debug)]
struct NetErr(String);

impl std::fmt::Display for NetErr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for NetErr {}

impl RaftNetwork<TypeConfig> for PeerClient {
    fn backoff(&self) -> openraft::network::Backoff {
        openraft::network::Backoff::new(std::iter::repeat(UNREACHABLE_BACKOFF))
    }

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<AppendEntriesResponse<MemberId>, openraft::error::Infallible> {
        let (term, sent_at) = (Term(rpc.vote.leader_id().get_term()), Instant::now());
        // The call runs as a task of its own with a budget of its own: when
        // openraft stops waiting (one heartbeat interval, `option`), the
        // reply may still come, and if it accepts us it still counts for the
        // lease by its send time (see the module docs, acknowledgements).
        let call = {
            let client = PeerClient {
                target: self.target,
                peers: Arc::clone(&self.peers),
            };
            let budget = self.peers.election_timeout_max.max(option.hard_ttl());
            tokio::spawn(async move {
                let response: RpcResult<AppendEntriesResponse<MemberId>, _> =
                    client.call(Rpc::Append, &rpc, budget).await;
                if let Ok(response) = &response {
                    if accepts_leader(response) {
                        client.peers.record_ack(client.target, term, sent_at);
                    }
                }
                response
            })
        };
        match tokio::time::timeout(option.hard_ttl(), call).await {
            Ok(Ok(response)) => response,
            Ok(Err(join)) => Err(RPCError::Network(NetworkError::new(&NetErr(format!(
                "the append call ended: {join}"
            ))))),
            // Slow, not gone: openraft tries again at the next heartbeat,
            // while this call may still bring its acknowledgement.
            Err(_) => Err(RPCError::Network(NetworkError::new(&NetErr(format!(
                "no reply within {:?} (still awaited for the lease)",
                option.hard_ttl()
            ))))),
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> RpcResult<InstallSnapshotResponse<MemberId>, InstallSnapshotError> {
        self.call(Rpc::Snapshot, &rpc, option.hard_ttl()).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<MemberId>,
        option: RPCOption,
    ) -> RpcResult<VoteResponse<MemberId>, openraft::error::Infallible> {
        // A granted vote is not counted toward the lease: the voter's vote is
        // not committed yet, so openraft's vote lease does not hold it back
        // from another candidate. The first heartbeat's replies, one round
        // trip later, start the lease.
        let response: VoteResponse<MemberId> =
            self.call(Rpc::Vote, &rpc, option.hard_ttl()).await?;
        // A refusal because the peer's log is ahead: this node cannot win;
        // the detector holds off so the up-to-date node can.
        if !response.vote_granted && response.last_log_id > rpc.last_log_id {
            *lock(&self.peers.behind_since) = Some(Instant::now());
        }
        Ok(response)
    }
}

/// Whether an AppendEntries reply shows the follower took the sender's vote
/// as its own: every reply but `HigherVote`.
fn accepts_leader(response: &AppendEntriesResponse<MemberId>) -> bool {
    match response {
        AppendEntriesResponse::Success
        | AppendEntriesResponse::PartialSuccess(_)
        | AppendEntriesResponse::Conflict => true,
        AppendEntriesResponse::HigherVote(_) => false,
    }
}

/// The target of a transfer campaigns at once: the old leader closed and
/// drained its gate and stopped its heartbeats before it asked, so there is
/// no lease of its to wait out, and it votes for the target as soon as its
/// own openraft vote lease allows (at once when it has led longer than
/// `election_timeout_max`). Another follower's openraft lease runs until
/// `election_timeout_max` after the last heartbeat, so where the old
/// leader's vote is not enough (five nodes, a leader elected moments ago),
/// the target tries again every two heartbeats until then, and once more
/// after it.
async fn campaign_for_transfer(raft: Raft, peers: Arc<Peers>) {
    let started = Instant::now();
    let until = started + peers.election_timeout_max + Duration::from_millis(20);
    let retry = Duration::from_millis(100);
    loop {
        if let Err(err) = raft.trigger().elect().await {
            tracing::warn!(%err, "could not start the transfer election");
            return;
        }
        let won = raft
            .wait(Some(retry))
            .state(openraft::ServerState::Leader, "transfer election")
            .await
            .is_ok();
        if won {
            tracing::info!(took = ?started.elapsed(), "took leadership over");
            return;
        }
        let now = Instant::now();
        if now >= until {
            tracing::warn!("the transfer election did not win; the failure detector takes over");
            return;
        }
        // Campaign again, at the latest just after every follower's
        // openraft lease on the old leader has run out.
        tokio::time::sleep_until((now + retry).min(until)).await;
    }
}

/// The server side: hands Raft's RPCs to the local openraft instance. Each
/// handler runs on the Raft runtime when there is one.
pub struct RaftService {
    raft: Raft,
    peers: Arc<Peers>,
}

impl RaftService {
    /// A service for `raft`.
    pub fn new(raft: Raft, peers: Arc<Peers>) -> Self {
        Self { raft, peers }
    }

    /// The tonic server of this service (the transport sets its limits).
    pub fn into_server(self) -> raft_server::RaftServer<Self> {
        raft_server::RaftServer::new(self)
    }

    /// Runs `handler` with this service's Raft and peers, on the Raft
    /// runtime if one is set.
    async fn on_raft<T, F, Fut>(&self, handler: F) -> Result<GrpcResponse<T>, Status>
    where
        T: Send + 'static,
        F: FnOnce(Raft, Arc<Peers>) -> Fut,
        Fut: std::future::Future<Output = Result<GrpcResponse<T>, Status>> + Send + 'static,
    {
        let future = handler(self.raft.clone(), Arc::clone(&self.peers));
        match self.peers.runtime.get() {
            Some(runtime) => runtime
                .spawn(future)
                .await
                .map_err(|err| Status::internal(format!("raft runtime: {err}")))?,
            None => future.await,
        }
    }
}

fn reply<T: Serialize>(peers: &Peers, result: &T) -> Result<GrpcResponse<RaftMessage>, Status> {
    peers
        .envelope(0, result)
        .map(GrpcResponse::new)
        .map_err(Status::internal)
}

#[tonic::async_trait]
impl raft_server::Raft for RaftService {
    async fn append_entries(
        &self,
        request: GrpcRequest<RaftMessage>,
    ) -> Result<GrpcResponse<RaftMessage>, Status> {
        let caller = Caller::of(&request);
        let message = request.into_inner();
        self.on_raft(|raft, peers| async move {
            peers.admit(&caller, &message.cluster_id, message.from, message.to)?;
            let rpc: AppendEntriesRequest<TypeConfig> = decode(&message.payload)?;
            let result = raft.append_entries(rpc).await;
            if result.as_ref().is_ok_and(accepts_leader) {
                peers.leader_heard();
            }
            reply(&peers, &result)
        })
        .await
    }

    async fn vote(
        &self,
        request: GrpcRequest<RaftMessage>,
    ) -> Result<GrpcResponse<RaftMessage>, Status> {
        let caller = Caller::of(&request);
        let message = request.into_inner();
        self.on_raft(|raft, peers| async move {
            let from = peers.admit(&caller, &message.cluster_id, message.from, message.to)?;
            let rpc: VoteRequest<MemberId> = decode(&message.payload)?;
            if let Some(why) = peers.refuse_vote(from) {
                return Err(Status::unavailable(why));
            }
            let member = rpc.vote.leader_id().voted_for();
            if member.is_some_and(|m| m.node() != from) {
                return Err(Status::permission_denied(format!(
                    "node {from} asks for a vote for another node"
                )));
            }
            if let Some(why) = peers.refuse_non_voter(from, member) {
                return Err(Status::failed_precondition(why));
            }
            let result = raft.vote(rpc).await;
            if result.as_ref().is_ok_and(|vote| vote.vote_granted) {
                peers.leader_heard();
            }
            reply(&peers, &result)
        })
        .await
    }

    async fn install_snapshot(
        &self,
        request: GrpcRequest<RaftMessage>,
    ) -> Result<GrpcResponse<RaftMessage>, Status> {
        let caller = Caller::of(&request);
        let message = request.into_inner();
        self.on_raft(|raft, peers| async move {
            peers.admit(&caller, &message.cluster_id, message.from, message.to)?;
            let rpc: InstallSnapshotRequest<TypeConfig> = decode(&message.payload)?;
            reply(&peers, &raft.install_snapshot(rpc).await)
        })
        .await
    }

    async fn pre_vote(
        &self,
        request: GrpcRequest<PreVoteRequest>,
    ) -> Result<GrpcResponse<PreVoteReply>, Status> {
        let caller = Caller::of(&request);
        let request = request.into_inner();
        self.on_raft(|raft, peers| async move {
            let from = peers.admit(&caller, &request.cluster_id, request.from, request.to)?;
            let refusal = peers.refuse_pre_vote(from, request.next_index, &raft);
            if refusal.is_none() {
                peers.note_pre_vote_granted();
            }
            Ok(GrpcResponse::new(PreVoteReply {
                granted: refusal.is_none(),
                reason: refusal.unwrap_or_default(),
            }))
        })
        .await
    }

    async fn transfer_leader(
        &self,
        request: GrpcRequest<TransferRequest>,
    ) -> Result<GrpcResponse<TransferReply>, Status> {
        let caller = Caller::of(&request);
        let request = request.into_inner();
        self.on_raft(|raft, peers| async move {
            let from = peers.admit(&caller, &request.cluster_id, request.from, request.to)?;
            let target = NodeId(request.target);
            let metrics = raft.metrics().borrow().clone();
            let leader = metrics.current_leader.map(MemberId::node);
            if leader != Some(from) || metrics.current_term != request.term {
                return Err(Status::failed_precondition(format!(
                    "node {from} does not lead term {} here (leader {:?}, term {})",
                    request.term, metrics.current_leader, metrics.current_term
                )));
            }
            peers.begin_transfer(target);
            if target == peers.self_id {
                tracing::info!(
                    %from,
                    term = request.term,
                    "leadership offered; campaigning now"
                );
                tokio::spawn(campaign_for_transfer(raft, Arc::clone(&peers)));
            } else {
                tracing::info!(
                    %from,
                    %target,
                    "leadership moving; holding off"
                );
            }
            Ok(GrpcResponse::new(TransferReply {}))
        })
        .await
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
        Peers::new(
            "c".into(),
            MemberId(1),
            addresses,
            Arc::default(),
            Transport::default(),
            Duration::from_millis(300),
        )
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
        let replaced = Peers::new(
            "c".into(),
            former,
            [(NodeId(2), "127.0.0.1:2".to_string())].into(),
            Arc::default(),
            Transport::default(),
            Duration::from_millis(300),
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
    fn of_two_nodes_asking_at_once_the_longer_log_then_the_lower_id_goes_first() {
        let max = Duration::from_millis(450);
        let idle = PreVoteView {
            leads: false,
            campaigned_recently: false,
            asking: false,
            quiet: Duration::from_millis(500),
            log_end: 10,
        };
        let asking = PreVoteView {
            asking: true,
            ..idle
        };
        let (one, two, three) = (NodeId(1), NodeId(2), NodeId(3));
        // Not asking itself: anyone with a log as long is granted.
        assert_eq!(pre_vote_refusal(one, two, 10, &idle, max), None);
        // Asking: a higher id with no longer a log is refused...
        assert!(pre_vote_refusal(one, two, 10, &asking, max).is_some());
        assert!(pre_vote_refusal(two, three, 9, &asking, max).is_some());
        // ...a lower id is granted, and so is a longer log.
        assert_eq!(pre_vote_refusal(two, one, 10, &asking, max), None);
        assert_eq!(pre_vote_refusal(one, three, 11, &asking, max), None);
        // The other rules still hold.
        let heard = PreVoteView {
            quiet: Duration::from_millis(100),
            ..idle
        };
        assert!(pre_vote_refusal(two, one, 10, &heard, max).is_some());
        assert!(pre_vote_refusal(two, one, 9, &idle, max).is_some());
        let campaigning = PreVoteView {
            campaigned_recently: true,
            ..idle
        };
        assert!(pre_vote_refusal(two, one, 10, &campaigning, max).is_some());
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
