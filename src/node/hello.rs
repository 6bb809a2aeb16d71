//! The `Node` service on a node's gRPC listener: what a node tells its
//! peers about itself: where its replica service listens (see
//! `replica::peer::channels`; a peer asks once, and again after a call failed in
//! transport), its Raft member id, whether it holds Raft state, and which
//! member its membership names for the asker (a node with no Raft state
//! asks these before it forms a cluster or waits; see
//! [`super::formation`]), what its build knows ([`FEATURE_GROUPS`]), and
//! the free space of its data dir (what placement offers a new volume).
//! `RecordSize` takes a volume's size from its writer for the volume
//! table, on the cluster group's leader (see `node::volumes::sizes`); the
//! sender must be a member and hold a copy of that volume.
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
use crate::proto::node::{HelloReply, HelloRequest, RecordSizeReply, RecordSizeRequest};

use super::volumes::VolumeTableChanges;
use crate::api::admin::{VolumeError, volume_status};
use crate::ids::{GroupId, VolumeId};

/// The feature bit of a build that runs Raft groups besides group 0 and
/// applies the cluster group's volume table (see `docs/design.md`): no
/// volume is created before every member has said it knows them.
pub const FEATURE_GROUPS: u64 = 1;

/// The feature bit of a build that records a volume's growth in the
/// volume table (`ResizeVolume`, `Node.RecordSize`): no size is recorded
/// while a member answers without it.
pub const FEATURE_SIZES: u64 = 2;

/// The feature bit of a build that moves a volume's copies (`MoveVolume`
/// in the table, volume groups that follow their placement): no copy is
/// moved while a member answers without it.
pub const FEATURE_MOVES: u64 = 4;

/// The features this build knows.
pub const FEATURES: u64 = FEATURE_GROUPS | FEATURE_SIZES | FEATURE_MOVES;

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
    /// The volume table's changes, which record sizes.
    volumes: Option<Arc<VolumeTableChanges>>,
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
            volumes: None,
        }
    }

    /// Records volume sizes through `volumes` when asked.
    pub fn with_volumes(mut self, volumes: Arc<VolumeTableChanges>) -> Self {
        self.volumes = Some(volumes);
        self
    }

    /// Refuses a request of another cluster.
    fn check_cluster(&self, cluster_id: &str, what: &str) -> Result<(), Status> {
        match cluster_id == self.cluster_id {
            true => Ok(()),
            false => Err(Status::failed_precondition(format!(
                "{what} of cluster {cluster_id:?}, this node belongs to {:?}",
                self.cluster_id
            ))),
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
        self.check_cluster(&request.cluster_id, "hello")?;
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

    #[tracing::instrument(name = "record_size", skip_all, fields(node = %self.id))]
    async fn record_size(
        &self,
        request: Request<RecordSizeRequest>,
    ) -> Result<Response<RecordSizeReply>, Status> {
        let caller = Caller::of(&request);
        let request = request.into_inner();
        self.check_cluster(&request.cluster_id, "a size")?;
        let from = NodeId(request.from);
        caller.check_claim(from)?;
        if !self.book.entries().contains_key(&from) {
            return Err(Status::permission_denied(format!(
                "node {from} is not a member"
            )));
        }
        let Some(volumes) = self.volumes.clone() else {
            return Err(Status::unimplemented("this node keeps no volume table"));
        };
        let (name, group) = (VolumeId(request.volume), GroupId(request.group));
        // On a task of its own: the commit is not cut off half-way.
        let recorded =
            tokio::spawn(async move { volumes.accept(from, name, group, request.size).await })
                .await
                .map_err(|err| Status::internal(format!("recording the size failed: {err}")))?;
        match recorded {
            Ok(size) => Ok(Response::new(RecordSizeReply {
                size,
                redirect: String::new(),
            })),
            Err(VolumeError::NotLeader(Some((_, redirect)))) => {
                Ok(Response::new(RecordSizeReply { size: 0, redirect }))
            }
            Err(err) => Err(volume_status(err)),
        }
    }
}
