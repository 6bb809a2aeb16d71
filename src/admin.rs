//! The admin gRPC service: what an operator (and `replica-ha status`) asks
//! a node.
//!
//! `Status` reports the node's Raft view, its lease, the controller's role
//! and gate, the live members and the replicated control state.
//! `TransferLeader` hands leadership to a named node and answers once it
//! leads (or fails with the reason). `Write` and `Read` go through the
//! node's gated device exactly as NBD requests do — never around the gate —
//! so a passive node refuses writes here too.

use std::sync::Arc;

use bytes::Bytes;
use tokio::time::Instant;
use tonic::{Request, Response, Status};

use crate::ha::{Controller, HaError};
use crate::node::NodeConfig;
use crate::proto::admin::admin_server::{Admin, AdminServer};
use crate::proto::admin::{
    ReadReply, ReadRequest, StatusReply, StatusRequest, TransferReply, TransferRequest, WriteReply,
    WriteRequest,
};
use crate::raft::RaftCoordinator;
use crate::replica::ReplicaStore;
use crate::volume::{Device, DeviceError, RangeError};

/// The admin service of one node.
pub struct AdminService {
    coordinator: Arc<RaftCoordinator>,
    controller: Arc<Controller>,
    store: Arc<ReplicaStore>,
    config: NodeConfig,
}

impl AdminService {
    /// A service over a node's parts.
    pub fn new(
        coordinator: Arc<RaftCoordinator>,
        controller: Arc<Controller>,
        store: Arc<ReplicaStore>,
        config: NodeConfig,
    ) -> Self {
        Self {
            coordinator,
            controller,
            store,
            config,
        }
    }

    /// The tonic server of this service.
    pub fn into_server(self) -> AdminServer<Self> {
        AdminServer::new(self)
    }
}

/// Maps a data-path error to a gRPC status, in one place.
pub fn device_status(err: DeviceError) -> Status {
    let message = err.to_string();
    match err {
        DeviceError::NotLeader | DeviceError::LeaseExpired | DeviceError::Inactive => {
            Status::failed_precondition(message)
        }
        DeviceError::StaleTerm { .. } => Status::failed_precondition(message),
        DeviceError::Range(RangeError::OutOfRange { .. }) => Status::out_of_range(message),
        DeviceError::Range(RangeError::TooLarge { .. }) => Status::invalid_argument(message),
        DeviceError::InsufficientReplicas { .. }
        | DeviceError::InSyncCommit(_)
        | DeviceError::NoReadableReplica(_) => Status::unavailable(message),
        DeviceError::Io(_) => Status::internal(message),
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
        let controller = self.controller.status();
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
            role: controller.role.as_str().to_string(),
            gate_open: controller.active,
            fence_floor: self.store.floor().await,
            fence_failures: controller.fence_failures,
            promotions: controller.promotions,
        }))
    }

    async fn write(&self, request: Request<WriteRequest>) -> Result<Response<WriteReply>, Status> {
        let request = request.into_inner();
        self.controller
            .device()
            .write_at(request.offset, request.data, request.fua)
            .await
            .map_err(device_status)?;
        Ok(Response::new(WriteReply {}))
    }

    async fn read(&self, request: Request<ReadRequest>) -> Result<Response<ReadReply>, Status> {
        let request = request.into_inner();
        let data: Bytes = self
            .controller
            .device()
            .read_at(request.offset, u64::from(request.length))
            .await
            .map_err(device_status)?;
        Ok(Response::new(ReadReply { data }))
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
