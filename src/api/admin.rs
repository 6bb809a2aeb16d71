//! The admin gRPC service: what an operator (and `replica-ha status`) asks
//! a node.
//!
//! `Status` reports the node's Raft view, its lease, the controller's role
//! and gate, the live members and the replicated control state.
//! `TransferLeader` hands leadership to a named node and answers once it
//! leads (or fails with the reason). `Write` and `Read` go through the
//! node's gated device exactly as NBD requests do — never around the gate —
//! so a passive node refuses writes here too.
//!
//! `WatchLeader` streams this node's view of who writes a volume, at every
//! change and at least every [`WATCH_KEEPALIVE`]: `replica-ha attach`
//! follows the writer by it. The request names the volume: empty (what
//! earlier builds of `attach` send) or the configured name means the
//! cluster group's own volume, read from the [`NodeView`]; any other name is
//! looked up through the node's [`VolumeWriters`], and the stream then
//! reports that volume's own group and gate. A volume this node holds no
//! copy of is `NOT_FOUND`, naming the nodes that hold it (in words, and in
//! the [`HOLDERS_METADATA`] metadata for a program), so a client moves on
//! to them; one whose copy does not run here yet is `UNAVAILABLE`. A
//! stream that follows a table volume looks it up again every
//! [`WATCH_RECHECK`], and ends with `NOT_FOUND` once the node no longer
//! holds it.
//!
//! Who may call what (S9; the transport's guard has already admitted only
//! certificates of this cluster): `Status`, `Members` and `Read` any
//! client or node certificate; `TransferLeader`, `Write` and `Scrub` change
//! the cluster or the volume and need a client certificate with role
//! `admin`. `Scrub` asks the writer for a pass of its scrub (see
//! `replica::mirror::scrub`), and with `now` waits for its findings.
//! `ChangeMembers` (admin) replaces, adds or removes a member through the
//! node's [`MembersChanges`] (see `node::membership`).
//! `ListVolumes` (any certificate) reads the volume table as this node
//! applied it; `CreateVolume` and `DeleteVolume` (admin) change it through
//! the node's [`VolumeChanges`] (see `node::volumes`), on the node that
//! leads the cluster group: another node answers with its address.
//! `Resize` (admin) grows the configured volume on its writer (unnamed,
//! another node refuses; named, it answers with the writer's address), or
//! a volume of the table through [`VolumeChanges::resize`] on that
//! volume's writer, which another node names in `redirect`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tonic::{Request, Response, Status};

use crate::api::status::{
    LeaderSource, LeaderView, NodeView, ReplicaReport, SuspendedIo, VolumeReport,
};
use crate::ha::HaError;
use crate::ids::{NodeId, VolumeId};
use crate::net::Caller;
use crate::proto::admin::admin_server::{Admin, AdminServer};
use crate::proto::admin::{
    LeaderUpdate, Member, MembersChange, MembersChangeReply, MembersReply, MembersRequest,
    ReadReply, ReadRequest, ReplicaStatus, ResizeReply, ResizeRequest, ResyncReply, ResyncRequest,
    ScrubReply, ScrubRequest, StatusReply, StatusRequest, TransferReply, TransferRequest,
    VolumeCreateReply, VolumeCreateRequest, VolumeDeleteReply, VolumeDeleteRequest, VolumeInfo,
    VolumeListReply, VolumeListRequest, VolumeMoveReply, VolumeMoveRequest, VolumeStatus,
    WatchLeaderRequest, WriteReply, WriteRequest,
};
use crate::raft::volume_table::{TableError, VolumeEntry, VolumeRequest};
use crate::replica::ReplicaError;
use crate::replica::mirror::engine::{RebuildError, ResizeError};
use crate::volume::{DeviceError, RangeError};

/// The admin service of one node.
pub struct AdminService {
    view: Arc<NodeView>,
    members: Option<Arc<dyn MembersChanges>>,
    volumes: Option<Arc<dyn VolumeChanges>>,
    writers: Option<Arc<dyn VolumeWriters>>,
}

/// Why this node has no view of a volume's writer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotHere {
    /// Other nodes hold the volume's copies, none of them this one: their
    /// ids and gRPC addresses ("" when unknown).
    #[error("volume {name} is held by {}, not by this node", holders_text(.holders))]
    Elsewhere {
        name: VolumeId,
        holders: Vec<(NodeId, String)>,
    },
    /// No volume of that name in the cluster.
    #[error("no volume {0} in this cluster")]
    Unknown(VolumeId),
    /// The volume places a copy here that does not run (yet): starting,
    /// or its start failed and is tried again.
    #[error("volume {0} has a copy on this node that does not run yet; ask again")]
    NotRunning(VolumeId),
    /// The node did not answer in time (it is starting or stopping
    /// volumes); ask again.
    #[error("this node is busy starting or stopping volumes; ask again")]
    Busy,
}

/// "nodes 2 (127.0.0.1:7002), 3 (…)": who holds a volume, in words.
fn holders_text(holders: &[(NodeId, String)]) -> String {
    let named: Vec<String> = holders
        .iter()
        .map(|(id, addr)| match addr.is_empty() {
            true => id.to_string(),
            false => format!("{id} ({addr})"),
        })
        .collect();
    match named.len() {
        1 => format!("node {}", named[0]),
        _ => format!("nodes {}", named.join(", ")),
    }
}

/// The metadata key of a `NOT_FOUND` answer to `WatchLeader` that names
/// the nodes holding the volume, as `ID=HOST:PORT` joined by commas.
pub const HOLDERS_METADATA: &str = "replica-ha-holders";

/// Where this node reads the writer of each volume of the table it holds
/// a copy of, as the node runs them (see `node::writers`).
#[async_trait::async_trait]
pub trait VolumeWriters: Send + Sync {
    /// Volume `name`'s [`LeaderSource`] here, or why there is none.
    async fn leader_source(&self, name: &VolumeId) -> Result<LeaderSource, NotHere>;
}

/// How long a lookup of a volume's writer may wait on the node (which
/// holds its volumes' table while it starts or stops one).
pub const LOOKUP_WAIT: Duration = Duration::from_secs(1);

/// Where volume `name`'s writer is read on this node: the configured
/// volume's (`name` empty or its own) from `view`, any other from
/// `writers`; with the volume's name.
pub async fn leader_source(
    view: &NodeView,
    writers: Option<&dyn VolumeWriters>,
    name: &str,
    wait: Duration,
) -> Result<(LeaderSource, String), NotHere> {
    let configured = &view.facts().volume;
    if name.is_empty() || name == configured {
        return Ok((view.leader_source(), configured.clone()));
    }
    let id = VolumeId(name.to_string());
    let Some(writers) = writers else {
        return Err(NotHere::Unknown(id));
    };
    match tokio::time::timeout(wait, writers.leader_source(&id)).await {
        Ok(found) => found.map(|source| (source, name.to_string())),
        Err(_) => Err(NotHere::Busy),
    }
}

/// A lookup's failure as a gRPC status: `NOT_FOUND` (with the holders as
/// [`HOLDERS_METADATA`]) or `UNAVAILABLE`.
pub fn not_here_status(err: NotHere) -> Status {
    let message = err.to_string();
    match err {
        NotHere::Elsewhere { holders, .. } => {
            let mut status = Status::not_found(message);
            let listed: Vec<String> = holders
                .iter()
                .filter(|(_, addr)| !addr.is_empty())
                .map(|(id, addr)| format!("{}={addr}", id.0))
                .collect();
            if let Ok(value) = listed.join(",").parse() {
                status.metadata_mut().insert(HOLDERS_METADATA, value);
            }
            status
        }
        NotHere::Unknown(_) => Status::not_found(message),
        NotHere::NotRunning(_) | NotHere::Busy => Status::unavailable(message),
    }
}

/// Why a volume change was not made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VolumeError {
    /// This node does not lead the cluster group; the leader it knows, and
    /// its gRPC address.
    #[error("only the cluster group's leader changes the volume table; {}", match .0 {
        Some((leader, addr)) => format!("node {leader} at {addr} leads, ask it"),
        None => "no leader is known now".to_string(),
    })]
    NotLeader(Option<(NodeId, String)>),
    /// The table refused the request (a bad name, size or copy count, a
    /// name taken, an unknown volume, too little room).
    #[error(transparent)]
    Table(#[from] TableError),
    /// The name is the cluster group's own volume's.
    #[error("volume {0} is the cluster group's own (the nodes' configured volume)")]
    ClusterVolume(String),
    /// The change is refused, for the reason given.
    #[error("{0}")]
    Refused(String),
    /// A step failed; try again.
    #[error("{0}")]
    Failed(String),
    /// Only the volume's writer resizes it; the node to ask (its writer,
    /// or one that holds a copy), when one is known.
    #[error("only volume {name}'s writer resizes it; {}", match .at {
        Some((node, addr)) => format!("ask node {node} at {addr}"),
        None => "no writer is known now; ask again".to_string(),
    })]
    NotWriter {
        name: VolumeId,
        at: Option<(NodeId, String)>,
    },
    /// The writer could not grow the volume.
    #[error(transparent)]
    Resize(#[from] ResizeError),
}

/// A volume of the table, and what this node sees of its group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeState {
    /// The table's entry.
    pub entry: VolumeEntry,
    /// Its group's leader as this node knows it; none when unknown or
    /// when this node does not run the group.
    pub leader: Option<NodeId>,
    /// Its group's term as this node knows it (0: it does not run it).
    pub term: u64,
    /// Whether this node is its active writer now.
    pub writing: bool,
}

/// Changes to the volume table, as the node makes them.
#[async_trait::async_trait]
pub trait VolumeChanges: Send + Sync {
    /// Every volume, the cluster group's own first.
    async fn list(&self) -> Vec<VolumeState>;
    /// Creates the volume `request` asks for; returns it, and whether it
    /// was created now (false: it existed as asked).
    async fn create(&self, request: VolumeRequest) -> Result<(VolumeEntry, bool), VolumeError>;
    /// Deletes the volume `name`; `force` even while a client uses it.
    async fn delete(&self, name: VolumeId, force: bool) -> Result<VolumeEntry, VolumeError>;
    /// Grows the volume `name` to `size` bytes, on its writer, and records
    /// the size in the table; returns the size served before and after.
    async fn resize(&self, name: VolumeId, size: u64) -> Result<(u64, u64), VolumeError>;
    /// Moves the volume `name`'s copy from node `from` to node `to` in the
    /// table; returns the entry as it is then.
    async fn move_copy(
        &self,
        name: VolumeId,
        from: NodeId,
        to: NodeId,
    ) -> Result<VolumeEntry, VolumeError>;
}

/// Why a membership change was not made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MembershipError {
    /// This node is not the active writer; the leader it knows.
    #[error("only the writer changes the membership; {}", match .0 {
        Some(leader) => format!("node {leader} leads, ask it"),
        None => "no leader is known now".to_string(),
    })]
    NotWriter(Option<NodeId>),
    /// No such member.
    #[error("node {0} is not a member")]
    Unknown(NodeId),
    /// The change is refused, for the reason given.
    #[error("{0}")]
    Refused(String),
    /// Another change runs.
    #[error("a membership change is in progress: {0}")]
    InProgress(String),
    /// The writer's own node is to go: leadership moved to `to` first.
    #[error("leadership moved to node {to} at {addr}; ask it again")]
    Moved { to: NodeId, addr: String },
    /// A step failed (the membership is as far as it got).
    #[error("{0}")]
    Failed(String),
}

/// Membership changes, as the node makes them.
#[async_trait::async_trait]
pub trait MembersChanges: Send + Sync {
    /// Swaps node `node`'s old incarnation for the new one that waits.
    async fn replace(&self, node: NodeId) -> Result<String, MembershipError>;
    /// Adds node `node`, reachable at `addr`.
    async fn add(&self, node: NodeId, addr: String) -> Result<String, MembershipError>;
    /// Removes node `node`.
    async fn remove(&self, node: NodeId) -> Result<String, MembershipError>;
}

impl AdminService {
    /// A service over a node's parts.
    pub fn new(view: Arc<NodeView>) -> Self {
        Self {
            view,
            members: None,
            volumes: None,
            writers: None,
        }
    }

    /// Follows the writers of the table's volumes through `writers`.
    pub fn with_writers(mut self, writers: Arc<dyn VolumeWriters>) -> Self {
        self.writers = Some(writers);
        self
    }

    /// Makes volume changes through `volumes`.
    pub fn with_volumes(mut self, volumes: Arc<dyn VolumeChanges>) -> Self {
        self.volumes = Some(volumes);
        self
    }

    /// The gRPC address of the configured volume's writer, when it is
    /// another node that this node knows.
    fn own_writer(&self) -> Option<String> {
        if self.view.is_active_writer() {
            return None;
        }
        let leader = self.view.leader_source().view().leader?;
        let members = self.view.members();
        let writer = members.into_iter().find(|m| m.id == leader)?;
        (!writer.address.is_empty() && leader != self.view.facts().id).then_some(writer.address)
    }

    /// The volume changes, or why this node makes none.
    fn volume_changes(&self) -> Result<Arc<dyn VolumeChanges>, Status> {
        self.volumes
            .clone()
            .ok_or_else(|| Status::unimplemented("this node keeps no volume table"))
    }

    /// Makes membership changes through `members`.
    pub fn with_membership(mut self, members: Arc<dyn MembersChanges>) -> Self {
        self.members = Some(members);
        self
    }

    /// The tonic server of this service (the transport sets its limits).
    pub fn into_server(self) -> AdminServer<Self> {
        AdminServer::new(self)
    }
}

/// Maps a data-path error to a gRPC status, in one place.
pub fn device_status(err: DeviceError) -> Status {
    let message = err.to_string();
    match err {
        DeviceError::NotLeader
        | DeviceError::LeaseExpired
        | DeviceError::Inactive
        | DeviceError::Abandoned => Status::failed_precondition(message),
        DeviceError::StaleTerm { .. } => Status::failed_precondition(message),
        DeviceError::Range(RangeError::OutOfRange { .. }) => Status::out_of_range(message),
        DeviceError::Range(RangeError::TooLarge { .. }) => Status::invalid_argument(message),
        DeviceError::InsufficientReplicas { .. }
        | DeviceError::InSyncCommit(_)
        | DeviceError::Rejoining(_)
        | DeviceError::NoReadableReplica(_)
        | DeviceError::NotInSync => Status::unavailable(message),
        DeviceError::Io(_) | DeviceError::Remote { .. } => Status::internal(message),
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

/// How often `WatchLeader` looks for a change, and the longest it stays
/// silent: a watcher that hears nothing for a few of these knows the node
/// is gone or frozen.
pub const WATCH_POLL: Duration = Duration::from_millis(20);
pub const WATCH_KEEPALIVE: Duration = Duration::from_millis(100);
/// How often a stream that follows a table volume looks the volume up
/// again (it may have been deleted, or created anew under its name).
pub const WATCH_RECHECK: Duration = Duration::from_secs(1);

/// One `WatchLeader` stream: the volume it follows and where it reads it.
struct LeaderWatch {
    view: Arc<NodeView>,
    /// Where the volume is looked up again; none for the configured one.
    writers: Option<Arc<dyn VolumeWriters>>,
    name: String,
    source: LeaderSource,
}

/// What a stream sends.
type WatchSender = tokio::sync::mpsc::Sender<Result<LeaderUpdate, Status>>;

impl LeaderWatch {
    /// Sends an update at every change and at least every
    /// [`WATCH_KEEPALIVE`], until the client goes away or the node no
    /// longer holds the volume.
    async fn run(mut self, tx: WatchSender) {
        let mut last: Option<(LeaderView, Instant)> = None;
        let mut checked = Instant::now();
        loop {
            if checked.elapsed() >= WATCH_RECHECK {
                checked = Instant::now();
                if let Err(gone) = self.recheck().await {
                    let _ = tx.send(Err(not_here_status(gone))).await;
                    return;
                }
            }
            let now = self.source.view();
            let due = match last {
                Some((seen, at)) => seen != now || at.elapsed() >= WATCH_KEEPALIVE,
                None => true,
            };
            if due {
                if tx.send(Ok(self.update(&now))).await.is_err() {
                    return;
                }
                last = Some((now, Instant::now()));
            }
            tokio::time::sleep(WATCH_POLL).await;
        }
    }

    /// Looks the volume up again: a new volume of the name is followed
    /// from then on; one no longer held here ends the stream. A node too
    /// busy to answer within a poll keeps the source it has.
    async fn recheck(&mut self) -> Result<(), NotHere> {
        let Some(writers) = &self.writers else {
            return Ok(());
        };
        let id = VolumeId(self.name.clone());
        match tokio::time::timeout(WATCH_POLL, writers.leader_source(&id)).await {
            Ok(Ok(source)) => {
                if !source.is_same(&self.source) {
                    self.source = source;
                }
                Ok(())
            }
            Ok(Err(NotHere::Busy)) | Err(_) => Ok(()),
            Ok(Err(gone)) => Err(gone),
        }
    }

    /// The update that says `now`.
    fn update(&self, now: &LeaderView) -> LeaderUpdate {
        let facts = self.view.facts();
        LeaderUpdate {
            node_id: facts.id.0,
            term: now.term.0,
            leader: now.leader.map_or(0, |id| id.0),
            writer: now.writer_term.is_some(),
            writer_term: now.writer_term.map_or(0, |t| t.0),
            nbd_address: facts.nbd.map(|a| a.to_string()).unwrap_or_default(),
            volume: self.name.clone(),
            size: now.size,
        }
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    type WatchLeaderStream =
        std::pin::Pin<Box<dyn futures::Stream<Item = Result<LeaderUpdate, Status>> + Send>>;

    async fn watch_leader(
        &self,
        request: Request<WatchLeaderRequest>,
    ) -> Result<Response<Self::WatchLeaderStream>, Status> {
        let asked = request.into_inner().volume;
        let writers = self.writers.clone();
        let (source, name) = leader_source(&self.view, writers.as_deref(), &asked, LOOKUP_WAIT)
            .await
            .map_err(not_here_status)?;
        let watch = LeaderWatch {
            view: Arc::clone(&self.view),
            // The configured volume is the node's for its life: no lookup.
            writers: writers.filter(|_| name != self.view.facts().volume),
            name,
            source,
        };
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        tokio::spawn(watch.run(tx));
        let stream = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|item| (item, rx))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn status(&self, _: Request<StatusRequest>) -> Result<Response<StatusReply>, Status> {
        let status = self.view.status().await;
        let facts = &status.facts;
        let own = &status.own;
        let replicas: Vec<ReplicaStatus> =
            own.replicas.iter().cloned().map(replica_status).collect();
        let fence_floor = replicas
            .iter()
            .find(|r| r.local)
            .map(|r| r.fence_floor)
            .unwrap_or(0);
        let (io_suspended_requests, io_suspended_seconds, io_suspended_why) =
            held(own.suspended.as_ref());
        let volumes = std::iter::once(status.own_report())
            .chain(status.table.iter().cloned())
            .map(|report| volume_section(&report, facts.id))
            .collect();
        Ok(Response::new(StatusReply {
            node_id: facts.id.0,
            cluster_id: facts.cluster_id.clone(),
            raft_state: status.raft_state.clone(),
            term: own.term.0,
            leader: own.leader.map_or(0, |id| id.0),
            is_self: own.lease_remaining.is_some(),
            lease_remaining_ms: own.lease_remaining.map_or(0, |d| d.as_millis() as u64),
            members: status.live.iter().map(|id| id.0).collect(),
            prev_writer: own.prev_writer.map_or(0, |w| w.node.0),
            prev_writer_term: own.prev_writer.map(|w| w.term.0).unwrap_or(0),
            in_sync: own.in_sync.iter().map(|id| id.to_string()).collect(),
            volume_size: own.size,
            min_in_sync: own.min_in_sync as u64,
            last_applied: status.applied_index,
            role: own.role.as_str().to_string(),
            gate_open: own.gate_open,
            fence_floor,
            fence_failures: own.fence_failures,
            promotions: own.promotions,
            replicas,
            volume: facts.volume.clone(),
            nbd_address: facts.nbd.map(|a| a.to_string()).unwrap_or_default(),
            reads_served: own.reads_refused.is_none(),
            reads_refused: own.reads_refused.clone().unwrap_or_default(),
            security: facts.security().to_string(),
            data_address: facts.data.to_string(),
            io_suspended_requests,
            io_suspended_seconds,
            io_suspended_why,
            scrub_running: own.scrub.running,
            scrub_done_bytes: own.scrub.done,
            scrub_total_bytes: own.scrub.total,
            scrub_last_finished_unix: own.scrub.last_finished.map_or(0, unix_seconds),
            scrub_last_checked_extents: own.scrub.last_checked,
            scrub_last_found: own.scrub.last_found,
            scrub_last_repaired: own.scrub.last_repaired,
            scrub_found: own.scrub.found,
            scrub_repaired: own.scrub.repaired,
            scrub_passes: own.scrub.passes,
            scrub_rate_bytes_per_second: own.scrub_rate,
            incarnation: facts.member.incarnation().0,
            member: facts.member.0,
            not_member: status.not_member.clone().unwrap_or_default(),
            cluster_uuid: status.cluster_uuid.clone().unwrap_or_default(),
            writes_total: own.io.writes.load(std::sync::atomic::Ordering::Relaxed),
            write_bytes_total: own
                .io
                .write_bytes
                .load(std::sync::atomic::Ordering::Relaxed),
            volumes,
        }))
    }

    async fn members(&self, _: Request<MembersRequest>) -> Result<Response<MembersReply>, Status> {
        let members = self
            .view
            .members()
            .into_iter()
            .map(|m| Member {
                id: m.id.0,
                address: m.address,
                live: m.live,
                leader: m.leader,
                in_sync: m.in_sync,
                incarnation: m.incarnation.0,
                voter: m.voter,
            })
            .collect();
        Ok(Response::new(MembersReply { members }))
    }

    async fn write(&self, request: Request<WriteRequest>) -> Result<Response<WriteReply>, Status> {
        Caller::of(&request).require_admin("write to the volume")?;
        let request = request.into_inner();
        self.view
            .device()
            .write_at(request.offset, request.data, request.fua)
            .await
            .map_err(device_status)?;
        Ok(Response::new(WriteReply {}))
    }

    async fn read(&self, request: Request<ReadRequest>) -> Result<Response<ReadReply>, Status> {
        let request = request.into_inner();
        let data: Bytes = self
            .view
            .device()
            .read_at(request.offset, u64::from(request.length))
            .await
            .map_err(device_status)?;
        Ok(Response::new(ReadReply { data }))
    }

    #[tracing::instrument(skip_all, fields(now = request.get_ref().now))]
    async fn scrub(&self, request: Request<ScrubRequest>) -> Result<Response<ScrubReply>, Status> {
        Caller::of(&request).require_admin("scrub the volume")?;
        if !self.view.is_active_writer() {
            return Err(Status::failed_precondition(
                "this node is not the active writer; only the writer scrubs (ask the leader)",
            ));
        }
        let scrubber = self.view.scrubber();
        if !request.into_inner().now {
            scrubber.request(false);
            return Ok(Response::new(ScrubReply::default()));
        }
        let report = scrubber
            .scrub_now()
            .await
            .map_err(|err| Status::failed_precondition(err.to_string()))?;
        Ok(Response::new(ScrubReply {
            checked: report.checked,
            unchecked: report.unchecked,
            findings: report
                .findings
                .into_iter()
                .map(|f| crate::proto::admin::ScrubFinding {
                    extent: f.extent,
                    differing: f.differing.iter().map(|id| id.0).collect(),
                    source: f.source.0,
                    repaired: f.repaired,
                    majority: f.majority,
                })
                .collect(),
        }))
    }

    #[tracing::instrument(skip_all, fields(id = request.get_ref().id, full = request.get_ref().full))]
    async fn resync(
        &self,
        request: Request<ResyncRequest>,
    ) -> Result<Response<ResyncReply>, Status> {
        Caller::of(&request).require_admin("ask for a full rebuild")?;
        if !self.view.is_active_writer() {
            return Err(Status::failed_precondition(
                "this node is not the active writer; only the writer rebuilds (ask the leader)",
            ));
        }
        let request = request.into_inner();
        if !request.full {
            return Err(Status::invalid_argument(
                "only a full rebuild can be asked for (--full); a replica out of sync is rebuilt \
                 from its missed-write map by itself",
            ));
        }
        self.view
            .resyncer()
            .force_full(NodeId(request.id))
            .map_err(|err| match err {
                RebuildError::Unknown(_) => Status::not_found(err.to_string()),
                RebuildError::InSync(_) => Status::failed_precondition(format!(
                    "{err}: a full rebuild is for a replica out of sync (`replica-ha scrub --now` \
                     compares the in-sync copies)"
                )),
                other => Status::failed_precondition(other.to_string()),
            })?;
        Ok(Response::new(ResyncReply {}))
    }

    #[tracing::instrument(skip_all, fields(size = request.get_ref().size, volume = %request.get_ref().volume))]
    async fn resize(
        &self,
        request: Request<ResizeRequest>,
    ) -> Result<Response<ResizeReply>, Status> {
        Caller::of(&request).require_admin("resize the volume")?;
        let ResizeRequest { size, volume } = request.into_inner();
        let redirect = |redirect| ResizeReply {
            redirect,
            ..Default::default()
        };
        if volume.is_empty() || volume == self.view.facts().volume {
            // Named, the configured volume is asked of its writer too.
            if let Some(writer) = (!volume.is_empty()).then(|| self.own_writer()).flatten() {
                return Ok(Response::new(redirect(writer)));
            }
            let previous = self.view.device().size();
            let size = self.view.resize(size).await.map_err(resize_status)?;
            return Ok(Response::new(ResizeReply {
                previous,
                size,
                redirect: String::new(),
            }));
        }
        let changes = self.volume_changes()?;
        let name = VolumeId(volume);
        // On a task of its own: a client that goes away does not cut the
        // commits off between the volume's group and the table.
        let outcome = tokio::spawn(async move { changes.resize(name, size).await })
            .await
            .map_err(|err| Status::internal(format!("resizing the volume failed: {err}")))?;
        match outcome {
            Ok((previous, size)) => Ok(Response::new(ResizeReply {
                previous,
                size,
                redirect: String::new(),
            })),
            Err(VolumeError::NotWriter {
                at: Some((_, addr)),
                ..
            }) => Ok(Response::new(redirect(addr))),
            Err(err) => Err(volume_status(err)),
        }
    }

    #[tracing::instrument(skip_all, fields(op, id))]
    async fn change_members(
        &self,
        request: Request<MembersChange>,
    ) -> Result<Response<MembersChangeReply>, Status> {
        Caller::of(&request).require_admin("change the membership")?;
        let request = request.into_inner();
        let Some(members) = self.members.clone() else {
            return Err(Status::unimplemented(
                "this node makes no membership changes",
            ));
        };
        let node = NodeId(request.id);
        tracing::Span::current().record("op", request.op.as_str());
        tracing::Span::current().record("id", request.id);
        if !["replace", "add", "remove"].contains(&request.op.as_str()) {
            return Err(Status::invalid_argument(format!(
                "unknown membership change {:?}: replace, add or remove",
                request.op
            )));
        }
        // On a task of its own: a client that goes away (a deadline,
        // Ctrl-C) does not cut a change off between its steps.
        let change = tokio::spawn(async move {
            match request.op.as_str() {
                "replace" => members.replace(node).await,
                "add" => members.add(node, request.addr).await,
                _ => members.remove(node).await,
            }
        });
        let outcome = change
            .await
            .map_err(|err| Status::internal(format!("the membership change failed: {err}")))?;
        match outcome {
            Ok(summary) => Ok(Response::new(MembersChangeReply {
                summary,
                ..Default::default()
            })),
            Err(MembershipError::Moved { to, addr }) => Ok(Response::new(MembersChangeReply {
                summary: format!("leadership moved to node {to}"),
                moved_to: to.0,
                moved_to_addr: addr,
            })),
            Err(err) => Err(membership_status(err)),
        }
    }

    async fn transfer_leader(
        &self,
        request: Request<TransferRequest>,
    ) -> Result<Response<TransferReply>, Status> {
        Caller::of(&request).require_admin("transfer leadership")?;
        let TransferRequest { to, volume } = request.into_inner();
        let to = NodeId(to);
        let members = self.view.members();
        if !members.iter().any(|m| m.id == to && m.voter) {
            return Err(Status::invalid_argument(format!(
                "node {to} is not a member"
            )));
        }
        if volume.is_empty() || volume == self.view.facts().volume {
            return self
                .view
                .transfer_to(to)
                .await
                .map(|()| Response::new(TransferReply::default()))
                .map_err(status_of);
        }
        let (source, name) =
            leader_source(&self.view, self.writers.as_deref(), &volume, LOOKUP_WAIT)
                .await
                .map_err(not_here_status)?;
        if !source.holds_copy(to) {
            return Err(Status::invalid_argument(format!(
                "node {to} holds no copy of volume {name}"
            )));
        }
        match source.view().leader {
            Some(writer) if writer == self.view.facts().id => source
                .hand_over(to)
                .await
                .map(|()| Response::new(TransferReply::default()))
                .map_err(status_of),
            Some(writer) => {
                let addr = members
                    .iter()
                    .find(|m| m.id == writer && !m.address.is_empty())
                    .map(|m| m.address.clone())
                    .ok_or_else(|| {
                        Status::unavailable(format!(
                            "node {writer} writes volume {name}, but this node knows no address of it; ask it"
                        ))
                    })?;
                Ok(Response::new(TransferReply { redirect: addr }))
            }
            None => Err(Status::unavailable(format!(
                "volume {name} has no writer now (an election runs); ask again"
            ))),
        }
    }

    async fn list_volumes(
        &self,
        _: Request<VolumeListRequest>,
    ) -> Result<Response<VolumeListReply>, Status> {
        let volumes = self.volume_changes()?.list().await;
        Ok(Response::new(VolumeListReply {
            volumes: volumes
                .iter()
                .map(|state| VolumeInfo {
                    leader: state.leader.map_or(0, |id| id.0),
                    term: state.term,
                    writing: state.writing,
                    ..volume_info(&state.entry)
                })
                .collect(),
        }))
    }

    #[tracing::instrument(skip_all, fields(name = %request.get_ref().name))]
    async fn create_volume(
        &self,
        request: Request<VolumeCreateRequest>,
    ) -> Result<Response<VolumeCreateReply>, Status> {
        Caller::of(&request).require_admin("create a volume")?;
        let changes = self.volume_changes()?;
        let asked = request.into_inner();
        let asked = VolumeRequest {
            name: asked.name,
            size: asked.size,
            copies: asked.copies as usize,
            min_in_sync: asked.min_in_sync as usize,
        };
        // On a task of its own: a client that goes away does not cut the
        // commit off half-way (it is idempotent, but the answer is lost).
        let outcome = tokio::spawn(async move { changes.create(asked).await })
            .await
            .map_err(|err| Status::internal(format!("creating the volume failed: {err}")))?;
        match outcome {
            Ok((volume, created)) => Ok(Response::new(VolumeCreateReply {
                volume: Some(volume_info(&volume)),
                created,
                redirect: String::new(),
            })),
            Err(VolumeError::NotLeader(Some((_, addr)))) => Ok(Response::new(VolumeCreateReply {
                redirect: addr,
                ..Default::default()
            })),
            Err(err) => Err(volume_status(err)),
        }
    }

    #[tracing::instrument(skip_all, fields(name = %request.get_ref().name))]
    async fn delete_volume(
        &self,
        request: Request<VolumeDeleteRequest>,
    ) -> Result<Response<VolumeDeleteReply>, Status> {
        Caller::of(&request).require_admin("delete a volume")?;
        let changes = self.volume_changes()?;
        let asked = request.into_inner();
        let name = VolumeId(asked.name);
        let outcome = tokio::spawn(async move { changes.delete(name, asked.force).await })
            .await
            .map_err(|err| Status::internal(format!("deleting the volume failed: {err}")))?;
        match outcome {
            Ok(volume) => Ok(Response::new(VolumeDeleteReply {
                volume: Some(volume_info(&volume)),
                redirect: String::new(),
            })),
            Err(VolumeError::NotLeader(Some((_, addr)))) => Ok(Response::new(VolumeDeleteReply {
                redirect: addr,
                ..Default::default()
            })),
            Err(err) => Err(volume_status(err)),
        }
    }

    #[tracing::instrument(skip_all, fields(name = %request.get_ref().name))]
    async fn move_volume(
        &self,
        request: Request<VolumeMoveRequest>,
    ) -> Result<Response<VolumeMoveReply>, Status> {
        Caller::of(&request).require_admin("move a volume's copy")?;
        let changes = self.volume_changes()?;
        let VolumeMoveRequest { name, from, to } = request.into_inner();
        let (name, from, to) = (VolumeId(name), NodeId(from), NodeId(to));
        let outcome = tokio::spawn(async move { changes.move_copy(name, from, to).await })
            .await
            .map_err(|err| Status::internal(format!("moving the copy failed: {err}")))?;
        match outcome {
            Ok(volume) => Ok(Response::new(VolumeMoveReply {
                volume: Some(volume_info(&volume)),
                redirect: String::new(),
            })),
            Err(VolumeError::NotLeader(Some((_, addr)))) => Ok(Response::new(VolumeMoveReply {
                redirect: addr,
                ..Default::default()
            })),
            Err(err) => Err(volume_status(err)),
        }
    }
}

/// A volume table entry as the admin API shows it.
fn volume_info(entry: &VolumeEntry) -> VolumeInfo {
    VolumeInfo {
        name: entry.id.to_string(),
        size: entry.size,
        copies: u32::try_from(entry.copies).unwrap_or(u32::MAX),
        min_in_sync: u32::try_from(entry.min_in_sync).unwrap_or(u32::MAX),
        placement: entry.placement.iter().map(|node| node.0).collect(),
        group: entry.group.0,
        leader: 0,
        term: 0,
        writing: false,
        preferred: entry.preferred.map_or(0, |node| node.0),
    }
}

/// A resize error as a gRPC status (see the proto for the codes).
fn resize_status(err: ResizeError) -> Status {
    let message = err.to_string();
    match err {
        ResizeError::Invalid(_) => Status::invalid_argument(message),
        ResizeError::Shrink { .. }
        | ResizeError::Inactive
        | ResizeError::Refused { .. }
        | ResizeError::Replica {
            cause: ReplicaError::StaleTerm { .. },
            ..
        } => Status::failed_precondition(message),
        ResizeError::Replica { .. }
        | ResizeError::Missing { .. }
        | ResizeError::Uncommitted { .. } => Status::unavailable(message),
    }
}

/// A volume error as a gRPC status (see the proto for the codes).
pub fn volume_status(err: VolumeError) -> Status {
    let message = err.to_string();
    match err {
        VolumeError::Resize(err) => resize_status(err),
        VolumeError::NotLeader(_) | VolumeError::Failed(_) | VolumeError::NotWriter { .. } => {
            Status::unavailable(message)
        }
        VolumeError::Table(TableError::Exists(_)) | VolumeError::ClusterVolume(_) => {
            Status::already_exists(message)
        }
        VolumeError::Table(TableError::Unknown(_)) => Status::not_found(message),
        VolumeError::Table(
            TableError::NoRoom { .. } | TableError::Shrink { .. } | TableError::OtherGroup { .. },
        )
        | VolumeError::Refused(_) => Status::failed_precondition(message),
        VolumeError::Table(_) => Status::invalid_argument(message),
    }
}

/// A membership error as a gRPC status (see the proto for the codes).
fn membership_status(err: MembershipError) -> Status {
    let message = err.to_string();
    match err {
        MembershipError::NotWriter(_) | MembershipError::Refused(_) => {
            Status::failed_precondition(message)
        }
        MembershipError::Unknown(_) => Status::not_found(message),
        MembershipError::InProgress(_) => Status::aborted(message),
        MembershipError::Moved { .. } => Status::internal(message),
        MembershipError::Failed(_) => Status::unavailable(message),
    }
}

/// Seconds since the Unix epoch (0 for a time before it).
fn unix_seconds(at: std::time::SystemTime) -> u64 {
    at.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Held writes as a reply gives them: how many, for how long, why (0,
/// 0.0 and "" while I/O flows).
fn held(suspended: Option<&SuspendedIo>) -> (u64, f64, String) {
    suspended.map_or((0, 0.0, String::new()), |s| {
        (
            s.waiting as u64,
            s.for_how_long.as_secs_f64(),
            s.why.clone(),
        )
    })
}

/// One volume's section of a status reply, as node `local` sees it.
fn volume_section(report: &VolumeReport, local: NodeId) -> VolumeStatus {
    let mut section = VolumeStatus {
        name: report.name.clone(),
        group: report.group.0,
        size: report.size,
        min_in_sync: report.min_in_sync as u64,
        placement: report.placement.iter().map(|id| id.0).collect(),
        here: report.here(local).as_str().to_string(),
        ..Default::default()
    };
    let Some(figures) = &report.figures else {
        return section;
    };
    let missing = report.missing().into_iter().map(|id| ReplicaStatus {
        id: id.to_string(),
        state: "missing".into(),
        ..Default::default()
    });
    let (requests, seconds, why) = held(figures.suspended.as_ref());
    VolumeStatus {
        size: figures.size,
        min_in_sync: figures.min_in_sync as u64,
        term: figures.term.0,
        leader: figures.leader.map_or(0, |id| id.0),
        writing: figures.gate_open,
        role: figures.role.as_str().to_string(),
        in_sync: figures.in_sync.iter().map(|id| id.to_string()).collect(),
        replicas: (figures.replicas.iter().cloned().map(replica_status))
            .chain(missing)
            .collect(),
        io_suspended_requests: requests,
        io_suspended_seconds: seconds,
        io_suspended_why: why,
        ..std::mem::take(&mut section)
    }
}

fn replica_status(report: ReplicaReport) -> ReplicaStatus {
    let (reachable, info, error) = match report.info.clone() {
        Ok(info) => (true, info, String::new()),
        Err(err) => (false, Default::default(), err),
    };
    ReplicaStatus {
        id: report.id.to_string(),
        state: report.state.as_str().to_string(),
        local: report.local,
        reachable,
        fence_floor: info.floor.0,
        dirty_extents: info.dirty_extents,
        error,
        resync_done_bytes: report.resync.map_or(0, |p| p.done),
        resync_total_bytes: report.resync.map_or(0, |p| p.total),
        resync_copied_bytes: report.resync.map_or(0, |p| p.copied),
        resync_rate_bytes_per_second: report.resync.map_or(0.0, |p| p.rate),
        resync_eta_seconds: report.resync.map_or(0.0, |p| p.eta),
        resync_running: report.resync.is_some_and(|p| p.running),
        resync_full: report.resync.is_some_and(|p| p.full),
        stale_accepts: info.stale_accepts,
        first_touch_marks: info.first_touch_marks,
    }
}
