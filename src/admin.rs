//! The admin gRPC service: what an operator (and `replica-ha status`) asks
//! a node.
//!
//! `Status` reports the node's Raft view, its lease, the live members and
//! the replicated control state. `TransferLeader` hands leadership to a
//! named node and answers once it leads (or fails with the reason).

use std::sync::Arc;

use tokio::time::Instant;
use tonic::{Request, Response, Status};

use crate::ha::HaError;
use crate::node::NodeConfig;
use crate::proto::admin::admin_server::{Admin, AdminServer};
use crate::proto::admin::{StatusReply, StatusRequest, TransferReply, TransferRequest};
use crate::raft::RaftCoordinator;

/// The admin service of one node.
pub struct AdminService {
    coordinator: Arc<RaftCoordinator>,
    config: NodeConfig,
}

impl AdminService {
    /// A service over `coordinator`.
    pub fn new(coordinator: Arc<RaftCoordinator>, config: NodeConfig) -> Self {
        Self {
            coordinator,
            config,
        }
    }

    /// The tonic server of this service.
    pub fn into_server(self) -> AdminServer<Self> {
        AdminServer::new(self)
    }
}

/// Maps a control-plane error to a gRPC status, in one place.
pub fn status_of(err: HaError) -> Status {
    match err {
        HaError::NotLeader => Status::failed_precondition(err.to_string()),
        HaError::Stopped => Status::unavailable(err.to_string()),
        other => Status::aborted(other.to_string()),
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn status(&self, _: Request<StatusRequest>) -> Result<Response<StatusReply>, Status> {
        let status = self.coordinator.status();
        let now = Instant::now();
        let lease = status.lease.filter(|l| l.covers(status.term, now));
        let control = &status.applied.control;
        let (size, min_in_sync) = match &control.volume {
            Some(volume) => (volume.size, volume.min_in_sync),
            None => (self.config.size, self.config.min_in_sync),
        };
        Ok(Response::new(StatusReply {
            node_id: self.config.id,
            cluster_id: self.config.cluster_id.clone(),
            raft_state: format!("{:?}", status.state).to_lowercase(),
            term: status.term,
            leader: status.leader.unwrap_or(0),
            is_self: lease.is_some(),
            lease_remaining_ms: lease
                .map(|l| (l.deadline - now).as_millis() as u64)
                .unwrap_or(0),
            members: self.coordinator.live_members(),
            prev_writer: control.writer.map(|w| w.node).unwrap_or(0),
            prev_writer_term: control.writer.map(|w| w.term).unwrap_or(0),
            in_sync: control.in_sync.iter().map(|id| id.to_string()).collect(),
            volume_size: size,
            min_in_sync: min_in_sync as u64,
            last_applied: status.applied.last_applied.map(|id| id.index).unwrap_or(0),
        }))
    }

    async fn transfer_leader(
        &self,
        request: Request<TransferRequest>,
    ) -> Result<Response<TransferReply>, Status> {
        let to = request.into_inner().to;
        if !self.config.peers.contains_key(&to) {
            return Err(Status::invalid_argument(format!(
                "node {to} is not a member"
            )));
        }
        self.coordinator
            .transfer_to(to)
            .await
            .map(|()| Response::new(TransferReply {}))
            .map_err(status_of)
    }
}
