//! The `Node` service on a node's gRPC listener: what a node tells its
//! peers about itself. Today that is where its replica service listens
//! (see `replica::channels`); a peer asks once, and again after a call
//! failed in transport.
//!
//! Members only (the transport's guard), and the asker must claim the node
//! its certificate names (S9), as for Raft.

use std::net::SocketAddr;

use tonic::{Request, Response, Status};

use crate::ids::NodeId;
use crate::net::Caller;
use crate::proto::node::node_server::{Node, NodeServer};
use crate::proto::node::{HelloReply, HelloRequest};

/// See the module docs.
pub struct HelloService {
    id: NodeId,
    cluster_id: String,
    /// The data listener's address, as bound.
    data: SocketAddr,
}

impl HelloService {
    /// The service of node `id` of `cluster_id`, whose replica service is
    /// bound at `data`.
    pub fn new(id: NodeId, cluster_id: impl Into<String>, data: SocketAddr) -> Self {
        Self {
            id,
            cluster_id: cluster_id.into(),
            data,
        }
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
        caller.check_claim(NodeId(request.from))?;
        Ok(Response::new(HelloReply {
            node_id: self.id.0,
            data_address: self.data.to_string(),
        }))
    }
}
