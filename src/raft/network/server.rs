//! The server side of Raft's RPCs: hands admitted requests to the local
//! openraft instance, after the checks of S8 and S9 (see the parent's
//! docs).

use super::client::accepts_leader;
use super::votes::campaign_for_transfer;
use super::*;

fn decode<T: DeserializeOwned>(payload: &[u8]) -> Result<T, Status> {
    serde_json::from_slice(payload)
        .map_err(|e| Status::invalid_argument(format!("malformed Raft message: {e}")))
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
