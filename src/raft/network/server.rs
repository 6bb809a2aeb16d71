//! The server side of Raft's RPCs: hands admitted requests to the local
//! openraft instance, after the checks of S8 and S9 (see the parent's
//! docs).

use super::client::accepts_leader;
use super::votes::campaign_for_transfer;
use super::*;
use crate::proto::raft::{RaftBatch, RaftBatchItem};

fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, Status> {
    serde_json::from_slice(payload)
        .map_err(|e| Status::invalid_argument(format!("malformed Raft message: {e}")))
}

/// The Raft groups a node serves, by id: shared by its Raft server and
/// the node, which adds and removes volume groups while the server runs.
/// Every group is over the same node's [`PeerBook`], whose admission the
/// server applies to every message (S8, S9) before it looks the group up.
#[derive(Clone)]
pub struct ServedGroups {
    node: Arc<PeerBook>,
    groups: Arc<std::sync::RwLock<GroupMap>>,
}

/// Each served group's Raft and peers, by id.
type GroupMap = BTreeMap<GroupId, (Raft, Arc<Peers>)>;

impl ServedGroups {
    /// No group yet, over `node`'s book.
    pub fn new(node: Arc<PeerBook>) -> Self {
        Self {
            node,
            groups: Arc::default(),
        }
    }

    /// Serves `raft`, the group of `peers`, from now on. Refused for a
    /// group served already, or peers over another node's [`PeerBook`]
    /// (whose admission would not be the one applied).
    pub fn insert(&self, raft: Raft, peers: Arc<Peers>) -> Result<(), String> {
        if !Arc::ptr_eq(peers.node(), &self.node) {
            return Err(format!(
                "group {} is of another node's peer book",
                peers.group()
            ));
        }
        let mut groups = self.groups.write().unwrap_or_else(|p| p.into_inner());
        match groups.entry(peers.group()) {
            std::collections::btree_map::Entry::Occupied(_) => {
                Err(format!("group {} is served already", peers.group()))
            }
            std::collections::btree_map::Entry::Vacant(slot) => {
                slot.insert((raft, peers));
                Ok(())
            }
        }
    }

    /// Stops serving the group of `peers`, if it is the one served (not
    /// another instance of the same group): its messages are `NOT_FOUND`
    /// from now on.
    pub fn remove(&self, peers: &Arc<Peers>) -> Option<(Raft, Arc<Peers>)> {
        let mut groups = self.groups.write().unwrap_or_else(|p| p.into_inner());
        match groups.get(&peers.group()) {
            Some((_, served)) if Arc::ptr_eq(served, peers) => groups.remove(&peers.group()),
            _ => None,
        }
    }

    /// Every served group.
    pub fn all(&self) -> Vec<(Raft, Arc<Peers>)> {
        let groups = self.groups.read().unwrap_or_else(|p| p.into_inner());
        groups
            .values()
            .map(|(raft, peers)| (raft.clone(), Arc::clone(peers)))
            .collect()
    }

    /// The group `group`, if it is served.
    pub fn get(&self, group: GroupId) -> Option<(Raft, Arc<Peers>)> {
        let groups = self.groups.read().unwrap_or_else(|p| p.into_inner());
        groups
            .get(&group)
            .map(|(raft, peers)| (raft.clone(), Arc::clone(peers)))
    }
}

/// The server side: hands Raft's RPCs to the local openraft instance of the
/// group they name. Each handler runs on the Raft runtime when there is
/// one.
pub struct RaftService {
    /// Admits every message (S8, S9), whichever group it names.
    node: Arc<PeerBook>,
    /// The groups this node runs.
    groups: ServedGroups,
}

impl RaftService {
    /// A service for `raft`, the group of `peers`.
    pub fn new(raft: Raft, peers: Arc<Peers>) -> Self {
        let groups = ServedGroups::new(Arc::clone(peers.node()));
        groups
            .groups
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(peers.group(), (raft, peers));
        Self::serving(groups)
    }

    /// A service for every group in `groups`, now and later.
    pub fn serving(groups: ServedGroups) -> Self {
        Self {
            node: Arc::clone(&groups.node),
            groups,
        }
    }

    /// The groups this service serves.
    pub fn groups(&self) -> &ServedGroups {
        &self.groups
    }

    /// The same service, serving `raft` too, the group of `peers`. Refused
    /// as [`ServedGroups::insert`] refuses.
    pub fn with_group(self, raft: Raft, peers: Arc<Peers>) -> Result<Self, String> {
        self.groups.insert(raft, peers)?;
        Ok(self)
    }

    /// The tonic server of this service (the transport sets its limits).
    pub fn into_server(self) -> raft_server::RaftServer<Self> {
        raft_server::RaftServer::new(self)
    }

    /// Admits a message of `caller` (see [`Peers::admit`]) and finds the
    /// group it names: its Raft and peers, and the sender. A group this
    /// node does not run is `NOT_FOUND`, and no group sees the message.
    fn admit(
        &self,
        caller: &Caller,
        envelope: Envelope<'_>,
    ) -> Result<(Raft, Arc<Peers>, NodeId), Status> {
        let from = self
            .node
            .admit(caller, envelope.cluster_id, envelope.from, envelope.to)?;
        match self.groups.get(GroupId(envelope.group)) {
            Some((raft, peers)) => Ok((raft, peers, from)),
            None => Err(Status::not_found(format!(
                "node {} runs no Raft group {}",
                self.node.self_id, envelope.group
            ))),
        }
    }

    /// Runs `handler` on the Raft runtime if one is set.
    async fn on_raft<T, Fut>(&self, handler: Fut) -> Result<GrpcResponse<T>, Status>
    where
        T: Send + 'static,
        Fut: std::future::Future<Output = Result<GrpcResponse<T>, Status>> + Send + 'static,
    {
        match self.node.runtime.get() {
            Some(runtime) => runtime
                .spawn(handler)
                .await
                .map_err(|err| Status::internal(format!("raft runtime: {err}")))?,
            None => handler.await,
        }
    }
}

/// What every Raft request names: the cluster, the sender, the member it
/// is meant for and the group.
struct Envelope<'a> {
    cluster_id: &'a str,
    from: u64,
    to: u64,
    group: u64,
}

impl<'a> From<&'a RaftMessage> for Envelope<'a> {
    fn from(m: &'a RaftMessage) -> Self {
        Self {
            cluster_id: &m.cluster_id,
            from: m.from,
            to: m.to,
            group: m.group,
        }
    }
}

impl<'a> From<&'a PreVoteRequest> for Envelope<'a> {
    fn from(m: &'a PreVoteRequest) -> Self {
        Self {
            cluster_id: &m.cluster_id,
            from: m.from,
            to: m.to,
            group: m.group,
        }
    }
}

impl<'a> From<&'a TransferRequest> for Envelope<'a> {
    fn from(m: &'a TransferRequest) -> Self {
        Self {
            cluster_id: &m.cluster_id,
            from: m.from,
            to: m.to,
            group: m.group,
        }
    }
}

/// The answer to the message at `index` of a batch.
fn batch_item(index: usize, answer: Result<RaftMessage, Status>) -> RaftBatchItem {
    let index = u32::try_from(index).unwrap_or(u32::MAX);
    match answer {
        Ok(reply) => RaftBatchItem {
            reply: Some(reply),
            code: 0,
            error: String::new(),
            index,
        },
        Err(status) => RaftBatchItem {
            reply: None,
            code: status.code() as i32,
            error: status.message().to_string(),
            index,
        },
    }
}

/// Hands one AppendEntries to its group's Raft; a follower that takes the
/// sender as its leader has heard one (see the module docs of the parent).
async fn append(
    raft: Raft,
    peers: Arc<Peers>,
    message: RaftMessage,
) -> Result<RaftMessage, Status> {
    let rpc: AppendEntriesRequest<TypeConfig> = decode(&message.payload)?;
    let result = raft.append_entries(rpc).await;
    if result.as_ref().is_ok_and(accepts_leader) {
        peers.leader_heard();
    }
    reply(&peers, &result).map(GrpcResponse::into_inner)
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
        let (raft, peers, _from) = self.admit(&caller, Envelope::from(&message))?;
        self.on_raft(async move { append(raft, peers, message).await.map(GrpcResponse::new) })
            .await
    }

    type AppendBatchStream =
        std::pin::Pin<Box<dyn futures::Stream<Item = Result<RaftBatchItem, Status>> + Send>>;

    async fn append_batch(
        &self,
        request: GrpcRequest<RaftBatch>,
    ) -> Result<GrpcResponse<Self::AppendBatchStream>, Status> {
        let caller = Caller::of(&request);
        let batch = request.into_inner();
        if batch.messages.len() > super::batch::MAX_BATCH {
            return Err(Status::invalid_argument(format!(
                "a batch of {} messages; at most {} are taken",
                batch.messages.len(),
                super::batch::MAX_BATCH
            )));
        }
        // Each message is admitted as if it came alone (S8, S9): the
        // cluster, the sender its certificate names, this member, and a
        // group this node runs; one that is not gets its own refusal.
        // Each answer goes back as soon as it is ready: one slow group
        // holds no other group's acknowledgement back (S4 counts each by
        // its own send time).
        let (answers, answered) = tokio::sync::mpsc::unbounded_channel();
        for (index, message) in batch.messages.into_iter().enumerate() {
            let admitted = self
                .admit(&caller, Envelope::from(&message))
                .map(|(raft, peers, _)| (raft, peers, message));
            let answers = answers.clone();
            let answer = async move {
                let answer = match admitted {
                    Ok((raft, peers, message)) => append(raft, peers, message).await,
                    Err(status) => Err(status),
                };
                let _ = answers.send(Ok(batch_item(index, answer)));
            };
            match self.node.runtime.get() {
                Some(runtime) => drop(runtime.spawn(answer)),
                None => drop(tokio::spawn(answer)),
            }
        }
        let stream = futures::stream::unfold(answered, |mut answered| async move {
            answered.recv().await.map(|item| (item, answered))
        });
        Ok(GrpcResponse::new(Box::pin(stream)))
    }

    async fn vote(
        &self,
        request: GrpcRequest<RaftMessage>,
    ) -> Result<GrpcResponse<RaftMessage>, Status> {
        let caller = Caller::of(&request);
        let message = request.into_inner();
        let (raft, peers, from) = self.admit(&caller, Envelope::from(&message))?;
        self.on_raft(async move {
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
        let (raft, peers, _from) = self.admit(&caller, Envelope::from(&message))?;
        self.on_raft(async move {
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
        let (raft, peers, from) = self.admit(&caller, Envelope::from(&request))?;
        self.on_raft(async move {
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
        let (raft, peers, from) = self.admit(&caller, Envelope::from(&request))?;
        self.on_raft(async move {
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
