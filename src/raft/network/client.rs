//! The client side of Raft's RPCs: openraft's network factory and the
//! per-peer client, which records acknowledgements for the lease by send
//! time (see the parent's docs).

use super::*;

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
    /// An AppendEntries without entries: it goes with the other groups'
    /// to the same peer (see [`super::batch`]).
    Heartbeat,
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
        let reply = match rpc {
            Rpc::Heartbeat => self.peers.node().heartbeat(node, message, ttl).await,
            Rpc::Append | Rpc::Vote | Rpc::Snapshot => {
                let mut client = self
                    .peers
                    .client(node)
                    .map_err(|e| unreachable(e.to_string()))?;
                let mut grpc = GrpcRequest::new(message);
                grpc.set_timeout(ttl);
                match rpc {
                    Rpc::Vote => client.vote(grpc).await,
                    Rpc::Snapshot => client.install_snapshot(grpc).await,
                    _ => client.append_entries(grpc).await,
                }
                .map(GrpcResponse::into_inner)
            }
        }
        .map_err(|status| {
            let why = format!("{}: {}", status.code(), status.message());
            if ran_out_of_time(&status) {
                // The peer is there but slow: try again at the next
                // heartbeat, on the same connection.
                return RPCError::Network(NetworkError::new(&NetErr(why)));
            }
            if status.code() == tonic::Code::NotFound {
                // The peer does not run this group (yet): the connection,
                // which every group shares, is fine.
                return unreachable(why);
            }
            // A channel whose connection failed is rebuilt on the next call.
            self.peers.forget_channel(node);
            unreachable(why)
        })?;
        if reply.group != self.peers.group().0 {
            // Only this group's answer counts for it (S4): never one of
            // another group's, as a node that does not know groups would
            // send.
            return Err(unreachable(format!(
                "a reply of group {} to a request of group {}",
                reply.group,
                self.peers.group()
            )));
        }
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
            let kind = match rpc.entries.is_empty() {
                true => Rpc::Heartbeat,
                false => Rpc::Append,
            };
            tokio::spawn(async move {
                let response: RpcResult<AppendEntriesResponse<MemberId>, _> =
                    client.call(kind, &rpc, budget).await;
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
pub(super) fn accepts_leader(response: &AppendEntriesResponse<MemberId>) -> bool {
    match response {
        AppendEntriesResponse::Success
        | AppendEntriesResponse::PartialSuccess(_)
        | AppendEntriesResponse::Conflict => true,
        AppendEntriesResponse::HigherVote(_) => false,
    }
}
