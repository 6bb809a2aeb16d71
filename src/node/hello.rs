//! The `Node` service on a node's gRPC listener: what a node tells its
//! peers about itself: where its replica service listens (see
//! `replica::peer::channels`; a peer asks once, and again after a call failed in
//! transport), its Raft member id, whether it holds Raft state, and which
//! member its membership names for the asker (a node with no Raft state
//! asks these before it forms a cluster or waits; see
//! [`super::formation`]), what its build knows ([`FEATURE_GROUPS`]), and
//! the free space of its data dir (what placement offers a new volume).
//!
//! Any node certificate of the cluster (the transport's guard, audience
//! `Nodes`): a node that waits to be added is no member yet, and must be
//! able to ask and to announce itself. The asker must claim the node its
//! certificate names (S9), as for Raft, and announces only itself.

use std::net::SocketAddr;

use tonic::{Request, Response, Status};

use std::sync::Arc;

use crate::ids::{MemberId, NodeId};
use crate::members::MemberBook;
use crate::net::Caller;
use crate::proto::node::node_server::{Node, NodeServer};
use crate::proto::node::{HelloReply, HelloRequest};

/// The feature bit of a build that runs Raft groups besides group 0 and
/// applies the cluster group's volume table (see `docs/design.md`): no
/// volume is created before every member has said it knows them.
pub const FEATURE_GROUPS: u64 = 1;

/// The features this build knows.
pub const FEATURES: u64 = FEATURE_GROUPS;

/// Free bytes in the file system that holds `dir`; none when it cannot
/// tell.
pub fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    let stat = rustix::fs::statvfs(dir).ok()?;
    Some(stat.f_bavail.saturating_mul(stat.f_frsize))
}

/// See the module docs.
pub struct HelloService {
    id: NodeId,
    member: MemberId,
    /// The membership as this node knows it: empty while it has no Raft
    /// state.
    book: Arc<MemberBook>,
    cluster_id: String,
    /// The data listener's address, as bound.
    data: SocketAddr,
    /// The data dir, whose free space the reply tells.
    data_dir: Option<std::path::PathBuf>,
    /// The NBD listener's exports, whose clients the reply counts.
    exports: Option<crate::nbd::Exports>,
}

impl HelloService {
    /// The service of `member` of `cluster_id`, whose replica service is
    /// bound at `data` and whose membership `book` holds.
    pub fn new(
        member: MemberId,
        cluster_id: impl Into<String>,
        data: SocketAddr,
        book: Arc<MemberBook>,
    ) -> Self {
        Self {
            id: member.node(),
            member,
            book,
            cluster_id: cluster_id.into(),
            data,
            data_dir: None,
            exports: None,
        }
    }

    /// Counts the clients of `exports`' volumes when asked.
    pub fn with_exports(mut self, exports: Option<crate::nbd::Exports>) -> Self {
        self.exports = exports;
        self
    }

    /// How many NBD clients use volume `name` on this node now.
    fn sessions_of(&self, name: &str) -> u64 {
        let export = self.exports.as_ref().and_then(|exports| exports.get(name));
        export.map_or(0, |export| export.sessions() as u64)
    }

    /// Tells the free space of `dir` in every reply.
    pub fn with_data_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.data_dir = Some(dir.into());
        self
    }

    /// The tonic server of this service (the transport sets its limits).
    pub fn into_server(self) -> NodeServer<Self> {
        NodeServer::new(self)
    }
}

#[tonic::async_trait]
impl Node for HelloService {
    #[tracing::instrument(name = "hello", skip_all, fields(node = %self.id))]
    async fn hello(&self, request: Request<HelloRequest>) -> Result<Response<HelloReply>, Status> {
        let caller = Caller::of(&request);
        let request = request.into_inner();
        if request.cluster_id != self.cluster_id {
            return Err(Status::failed_precondition(format!(
                "hello of cluster {:?}, this node belongs to {:?}",
                request.cluster_id, self.cluster_id
            )));
        }
        let asker = NodeId(request.from);
        caller.check_claim(asker)?;
        let waiting = crate::ids::MemberId(request.waiting_member);
        if request.waiting_member != 0 && waiting.node() == asker {
            self.book.note_waiting(waiting);
        }
        let members = self.book.entries();
        Ok(Response::new(HelloReply {
            node_id: self.id.0,
            data_address: self.data.to_string(),
            member: self.member.0,
            raft_initialized: !members.is_empty(),
            asker_member: members.get(&asker).map_or(0, |entry| entry.member.0),
            features: FEATURES,
            free_bytes: self.data_dir.as_deref().and_then(free_bytes).unwrap_or(0),
            sessions: match request.sessions_of.is_empty() {
                true => 0,
                false => self.sessions_of(&request.sessions_of),
            },
        }))
    }
}
