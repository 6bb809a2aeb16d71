//! The volumes a node hosts: the cluster group's own (the configured
//! volume, on every node) and each volume of the cluster group's table
//! that places a copy here, with the Raft group of its own.
//!
//! The table's volumes follow the table ([`VolumeHost::follow_table`]):
//! whenever the applied table changes (and every [`RECHECK`], so that a
//! start that failed is tried again), the node
//! - starts each volume placed here that it does not run: its Raft group
//!   (served from then on; formed with the founders the table records, by
//!   any founder, when it has no state yet), the group's failure
//!   detector, and the volume's parts over that group, its copy in a
//!   directory named for group and name, its store in the data listener's
//!   [`Stores`] and its export in the NBD listener's [`Exports`];
//! - stops each volume it runs that the table no longer has, or no
//!   longer places here once this node is out of the volume's group (a
//!   moved copy stays until the new one is in sync: `node::placement`,
//!   [`still_needed`]):
//!   its export and store go first (no new client, no new peer request),
//!   then its writer (the gate closes), its tasks, its group (no longer
//!   served), and last its data: the copy's directory and the group's Raft
//!   trees.
//!
//! Every invariant stays local to one volume: a volume's parts speak only
//! to its own group and its own copies. Shutdown stops every volume at
//! once within one deadline, as for the configured one.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{Mutex, watch};

use crate::api::status::{LeaderSource, VolumeProbe};
use crate::ha::Controller;
use crate::ha::{Coordinator, ReplicaState, WriterEngine};

use super::balance::BalanceView;
use super::membership::Membership;
use crate::volume::Device;

use super::config::{ConfigError, NodeConfig};
use super::volume::{Site, Volume};
use super::{NodeError, RaftParts, failed};
use crate::ids::{GroupId, MemberId, NodeId, VolumeId};
use crate::nbd::{Export, Exports};
use crate::net::Transport;
use crate::raft::group::RaftGroup;
use crate::raft::network::{PeerBook, ServedGroups};
use crate::raft::volume_table::VolumeEntry;
use crate::raft::{MemberNode, RaftCoordinator, RaftDb};
use crate::replica::mirror::engine::Engine;
use crate::replica::serve::stores::{OnFenced, Stores};

/// How often the table's volumes are checked even without a change.
pub const RECHECK: Duration = Duration::from_secs(5);

/// The table's volumes a node runs, by name; clones share them.
#[derive(Clone, Default)]
pub struct HostedVolumes(Arc<Mutex<BTreeMap<VolumeId, Hosted>>>);

/// What a node sees of one of the table's volumes it runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostedView {
    /// Its group.
    pub group: GroupId,
    /// The group's leader as this node knows it (its writer, once
    /// promoted).
    pub leader: Option<NodeId>,
    /// The group's current term.
    pub term: u64,
    /// Whether this node is the volume's active writer now (its gate open).
    pub writing: bool,
    /// The size its group committed, as this node applied it (none before
    /// its config is fixed): what its writer serves.
    pub size: Option<u64>,
}

impl HostedVolumes {
    /// What this node sees of each table volume it runs.
    pub async fn views(&self) -> BTreeMap<VolumeId, HostedView> {
        let table = self.0.lock().await;
        table
            .iter()
            .map(|(id, hosted)| {
                let metrics = hosted.group.raft.metrics().borrow().clone();
                let view = HostedView {
                    group: hosted.group.id,
                    leader: metrics.current_leader.map(MemberId::node),
                    term: metrics.current_term,
                    writing: hosted.volume.controller.device().is_writable(),
                    size: committed_size(&hosted.group),
                };
                (id.clone(), view)
            })
            .collect()
    }

    /// What the balancer (`node::balance`) needs of each table volume this
    /// node runs, with the controller that hands its writer over.
    pub async fn balance_views(&self) -> Vec<(VolumeId, BalanceView, Arc<Controller>)> {
        let table = self.0.lock().await;
        table
            .iter()
            .map(|(id, hosted)| {
                let metrics = hosted.group.raft.metrics().borrow().clone();
                let voters = metrics
                    .membership_config
                    .membership()
                    .voter_ids()
                    .map(MemberId::node)
                    .collect();
                let view = BalanceView {
                    group: hosted.group.id.0,
                    term: metrics.current_term,
                    writing: hosted.volume.controller.device().is_writable(),
                    voters,
                    in_sync: hosted.volume.engine.in_sync(),
                    live: hosted
                        .group
                        .coordinator
                        .live_members()
                        .into_iter()
                        .collect(),
                    unsettled: unsettled(&hosted.volume),
                };
                (id.clone(), view, Arc::clone(&hosted.volume.controller))
            })
            .collect()
    }

    /// What status reads of each table volume this node runs, with its
    /// group. The parts are taken under the table's lock; reading them
    /// happens after, without it.
    pub async fn probes(&self) -> BTreeMap<VolumeId, (GroupId, VolumeProbe)> {
        let table = self.0.lock().await;
        table
            .iter()
            .map(|(id, hosted)| {
                let probe = hosted.volume.probe(&hosted.group.coordinator);
                (id.clone(), (hosted.group.id, probe))
            })
            .collect()
    }

    /// Volume `id`'s engine, while this node runs it as of group `group`
    /// (what grows it: see `node::volumes::sizes`).
    pub async fn engine(&self, id: &VolumeId, group: GroupId) -> Option<Arc<Engine>> {
        let table = self.0.lock().await;
        let hosted = table.get(id).filter(|hosted| hosted.group.id == group)?;
        Some(Arc::clone(&hosted.volume.engine))
    }

    /// Where volume `id`'s writer is read, while this node runs it: its
    /// group's coordinator and its controller.
    pub async fn leader_source(&self, id: &VolumeId) -> Option<LeaderSource> {
        let table = self.0.lock().await;
        table.get(id).map(|hosted| {
            LeaderSource::new(
                Arc::clone(&hosted.group.coordinator),
                Arc::clone(&hosted.volume.controller),
                hosted.volume.site().spec.size,
            )
        })
    }
}

/// Whether `volume`'s copies are anything but settled and in sync: one
/// rebuilding (or its rebuild running), degraded or away, or writes held
/// below `min_in_sync`.
fn unsettled(volume: &Volume) -> bool {
    let rebuilding = volume.resync.progress().values().any(|p| p.running);
    let copies = volume.engine.replicas();
    let away = copies.iter().any(|copy| copy.state != ReplicaState::InSync);
    let held = volume.controller.device().suspension().waiting > 0;
    rebuilding || away || held
}

/// See the module docs.
pub struct VolumeHost {
    /// The cluster group's own volume.
    own: Volume,
    /// The table's volumes this node runs, by name.
    table: HostedVolumes,
    /// Stops the table follower.
    stop_following: watch::Sender<bool>,
    follower: Option<tokio::task::JoinHandle<()>>,
}

/// A volume of the table, running here with its group.
struct Hosted {
    volume: Volume,
    group: RaftGroup,
    detector: tokio::task::JoinHandle<()>,
    /// Keeps the group in step with the table (`node::placement`).
    placement: tokio::task::JoinHandle<()>,
}

/// What starting and stopping the table's volumes needs of the node.
#[derive(Clone)]
pub struct HostParts {
    pub config: NodeConfig,
    pub transport: Transport,
    pub member: MemberId,
    pub db: RaftDb,
    pub book: Arc<PeerBook>,
    pub runtime: tokio::runtime::Handle,
    pub served: ServedGroups,
    pub cluster: Arc<RaftCoordinator>,
    pub stores: Stores,
    pub exports: Option<Exports>,
}

impl VolumeHost {
    /// A host of `own`, the cluster group's volume, and of the table's
    /// volumes in `table`.
    pub fn new(own: Volume, table: HostedVolumes) -> Self {
        Self {
            own,
            table,
            stop_following: watch::channel(false).0,
            follower: None,
        }
    }

    /// The cluster group's own volume.
    pub fn own(&self) -> &Volume {
        &self.own
    }

    /// Starts the cluster group's volume's tasks.
    pub(super) fn start(&mut self, config: &NodeConfig, raft: &RaftParts, transport: &Transport) {
        self.own.start(config, &raft.cluster, transport);
    }

    /// Starts following the volume table (see the module docs).
    pub(super) fn follow_table(&mut self, parts: HostParts) {
        let table = Arc::clone(&self.table.0);
        let stop = self.stop_following.subscribe();
        self.follower = Some(tokio::spawn(follow(table, parts, stop)));
    }

    /// Resolves with the first conflict between the configured volume's
    /// recorded config and this node's; never, when there is none.
    pub(super) async fn conflict(&self, raft: &RaftParts) -> ConfigError {
        self.own.conflict(&raft.cluster).await
    }

    /// Stops following the table, then closes every volume's gate, all at
    /// once, each within `grace`, and has every table volume's group hand
    /// its leadership over.
    pub(super) async fn stop_writing(&mut self, grace: Duration) {
        self.stop_following.send_replace(true);
        if let Some(mut follower) = self.follower.take() {
            // It stops between volumes; one that is starting may take a
            // while, and is cut off past the grace (Raft stops anyway).
            if tokio::time::timeout(grace, &mut follower).await.is_err() {
                follower.abort();
            }
        }
        let table = self.table.0.lock().await;
        let gates = table
            .values()
            .map(|hosted| hosted.volume.stop_writing(grace))
            .chain([self.own.stop_writing(grace)]);
        futures::future::join_all(gates).await;
        let resigns = table.values().map(|hosted| async move {
            if tokio::time::timeout(grace, hosted.group.coordinator.resign())
                .await
                .is_err()
            {
                tracing::warn!(volume = %hosted.volume.id(), "resigning timed out");
            }
        });
        futures::future::join_all(resigns).await;
    }

    /// Stops every volume's tasks, all at once, within `deadline`, and the
    /// table volumes' groups.
    pub(super) async fn stop(self, deadline: Duration) {
        let table = std::mem::take(&mut *self.table.0.lock().await);
        let stops = table.into_values().map(|hosted| async move {
            hosted.detector.abort();
            hosted.placement.abort();
            hosted.volume.stop(deadline).await;
            if let Err(err) = hosted.group.raft.shutdown().await {
                tracing::warn!(%err, "raft shutdown of a volume group");
            }
        });
        tokio::join!(futures::future::join_all(stops), self.own.stop(deadline));
    }
}

/// The volumes of the applied table placed on this node.
fn placed_here(parts: &HostParts) -> BTreeMap<VolumeId, VolumeEntry> {
    let applied = parts.cluster.state_machine().current();
    applied
        .control
        .volumes
        .volumes()
        .filter(|entry| entry.placement.contains(&parts.member.node()))
        .map(|entry| (entry.id.clone(), entry.clone()))
        .collect()
}

/// Keeps `table` in step with the cluster group's volume table until
/// `stop` turns true (see the module docs). The table's lock is held only
/// to take volumes out and put them in, never while one starts or stops.
async fn follow(
    table: Arc<Mutex<BTreeMap<VolumeId, Hosted>>>,
    parts: HostParts,
    mut stop: watch::Receiver<bool>,
) {
    let mut applied = parts.cluster.state_machine().subscribe();
    loop {
        let wanted = placed_here(&parts);
        let gone: Vec<Hosted> = {
            let mut running = table.lock().await;
            let table = parts.cluster.state_machine().current().control.volumes;
            let ids: Vec<VolumeId> = running
                .iter()
                .filter(|(id, hosted)| {
                    let group = Some(hosted.group.id);
                    let me = parts.member.node();
                    let entry = table.get(id).filter(|entry| Some(entry.group) == group);
                    let placed = entry.is_some_and(|entry| entry.placement.contains(&me));
                    let moving = entry.is_some();
                    let kept = placed || (moving && still_needed(hosted));
                    !kept
                })
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| running.remove(id)).collect()
        };
        for hosted in gone {
            remove(&parts, hosted).await;
        }
        let missing: Vec<VolumeEntry> = {
            let running = table.lock().await;
            wanted
                .values()
                .filter(|entry| !running.contains_key(&entry.id))
                .cloned()
                .collect()
        };
        for entry in missing {
            if *stop.borrow() {
                return;
            }
            match host(&parts, &entry).await {
                Ok(hosted) => {
                    tracing::info!(volume = %entry.id, group = entry.group.0, "volume started");
                    table.lock().await.insert(entry.id.clone(), hosted);
                }
                Err(err) => {
                    tracing::warn!(volume = %entry.id, %err, "cannot start the volume yet")
                }
            }
        }
        let running: BTreeSet<GroupId> = table
            .lock()
            .await
            .values()
            .map(|hosted| hosted.group.id)
            .collect();
        sweep_leftovers(&parts, &wanted, &running).await;
        tokio::select! {
            changed = applied.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(RECHECK) => {}
            _ = stop.wait_for(|stop| *stop) => return,
        }
    }
}

/// Removes the copies (and Raft state) of table volumes that were deleted
/// while this node was not running them: a directory `GROUP-NAME` under
/// `DATA/volumes` whose group the table gave out but no longer places
/// here, and that this node does not run (a copy moving away runs until
/// it left its group). A group the table has not given out yet is left alone (a table
/// that lags behind the directory cannot happen: a copy is made only after
/// its volume was applied).
async fn sweep_leftovers(
    parts: &HostParts,
    wanted: &BTreeMap<VolumeId, VolumeEntry>,
    running: &BTreeSet<GroupId>,
) {
    let root = parts.config.data_dir.join("volumes");
    let Ok(mut dirs) = tokio::fs::read_dir(&root).await else {
        return;
    };
    let table = parts.cluster.state_machine().current().control.volumes;
    while let Ok(Some(dir)) = dirs.next_entry().await {
        let name = dir.file_name().to_string_lossy().into_owned();
        let Some(group) = name
            .split_once('-')
            .and_then(|(group, _)| group.parse::<u64>().ok())
            .map(GroupId)
        else {
            continue;
        };
        // A volume the table still has is never swept: its copy here is
        // placed, or moving away and runs until it left the group.
        let kept = running.contains(&group)
            || wanted.values().any(|entry| entry.group == group)
            || table.volumes().any(|entry| entry.group == group);
        if kept || !table.has_given(group) {
            continue;
        }
        if let Err(err) = parts.db.drop_group(group).await {
            tracing::warn!(dir = %name, %err, "removing a deleted volume's Raft state");
            continue;
        }
        match tokio::fs::remove_dir_all(dir.path()).await {
            Ok(()) => tracing::info!(dir = %name, "removed the copy of a deleted volume"),
            Err(err) => tracing::warn!(dir = %name, %err, "removing a deleted volume's copy"),
        }
    }
}

/// The gRPC address of every member of the cluster group: the peer list's,
/// else the membership's record.
fn addresses(parts: &HostParts) -> BTreeMap<NodeId, String> {
    let applied = parts.cluster.state_machine().current();
    let mut addresses: BTreeMap<NodeId, String> = applied
        .membership
        .membership()
        .nodes()
        .filter(|(_, node)| !node.addr.is_empty())
        .map(|(member, node)| (member.node(), node.addr.clone()))
        .collect();
    for (id, addr) in &parts.config.peers {
        addresses.insert(*id, addr.to_string());
    }
    addresses
}

/// Starts `entry`'s group and volume on this node. The copy is opened
/// before the group is served or formed, so that a group with state here
/// always has its copy: one whose copy is gone while its Raft state is
/// there lost its disk, and is not started (an empty copy would count as
/// the one this member held, S8).
async fn host(parts: &HostParts, entry: &VolumeEntry) -> Result<Hosted, NodeError> {
    let addresses = addresses(parts);
    let group = RaftGroup::start(
        entry.group,
        parts.member,
        &parts.db,
        Arc::clone(&parts.book),
        parts.config.timing,
        &parts.runtime,
    )
    .await
    .map_err(failed)?;
    match start_volume(parts, entry, &addresses, &group).await {
        Ok(volume) => {
            let detector = spawn_detector(parts, &group);
            let placement = spawn_placement(parts, entry, &volume, &group);
            Ok(Hosted {
                volume,
                group,
                detector,
                placement,
            })
        }
        Err(err) => {
            stop_group(parts, &group).await;
            Err(err)
        }
    }
}

/// Over `group`, started but not served yet: opens the copy and wires the
/// volume, serves its store and the group, forms the group when this node
/// is a founder and it has no state, starts the volume and exports it.
async fn start_volume(
    parts: &HostParts,
    entry: &VolumeEntry,
    addresses: &BTreeMap<NodeId, String>,
    group: &RaftGroup,
) -> Result<Volume, NodeError> {
    let mut site = Site::of_table(&parts.config, entry, addresses);
    // The table records a size only after the group committed it, so the
    // group's may be larger (a resize whose recording in the table did
    // not finish yet): the volume starts at that one.
    site.spec.size = site.spec.size.max(committed_size(group).unwrap_or(0));
    let formed = group.raft.is_initialized().await.map_err(failed)?;
    if formed && !site.dir.exists() {
        return Err(ConfigError(format!(
            "volume {}: its copy {} is missing but its Raft group's state is here (a lost \
             disk?); not started, as an empty copy would count as the one this node held",
            entry.id,
            site.dir.display()
        ))
        .into());
    }
    let mut volume =
        Volume::assemble(&parts.config, site, &parts.transport, &group.coordinator).await?;
    let step_down: OnFenced = {
        let controller = Arc::clone(&volume.controller);
        Arc::new(move |floor| controller.step_down(floor))
    };
    parts
        .stores
        .insert(Arc::clone(&volume.store), Some(step_down))
        .map_err(|err| failed(format!("serving volume {}: {err}", entry.id)))?;
    if let Err(err) = parts
        .served
        .insert(group.raft.clone(), Arc::clone(&group.peers))
    {
        parts.stores.remove(&entry.id.0);
        return Err(failed(err));
    }
    if !formed && entry.founders.contains(&parts.member) {
        form_group(entry, addresses, group).await;
    }
    volume.start(&parts.config, group, &parts.transport);
    if let Some(exports) = &parts.exports {
        let description = format!(
            "replica-ha volume {} of cluster {}",
            entry.id, parts.config.cluster_id
        );
        let device = Arc::clone(&volume.device);
        exports.insert(Arc::new(Export::new(&entry.id.0, description, device)));
    }
    Ok(volume)
}

/// The volume size `group` committed, as this node applied it.
fn committed_size(group: &RaftGroup) -> Option<u64> {
    group
        .coordinator
        .state_machine()
        .current()
        .control
        .volume_size()
}

/// Forms `entry`'s group with its founders (forming it on several founders
/// with the same membership is safe; one that finds it formed does
/// nothing).
async fn form_group(entry: &VolumeEntry, addresses: &BTreeMap<NodeId, String>, group: &RaftGroup) {
    let members: BTreeMap<MemberId, MemberNode> = entry
        .founders
        .iter()
        .map(|member| {
            let addr = addresses.get(&member.node()).cloned().unwrap_or_default();
            (*member, MemberNode { addr })
        })
        .collect();
    match group.raft.initialize(members).await {
        Ok(()) => tracing::info!(volume = %entry.id, group = entry.group.0, "volume group formed"),
        Err(err) => tracing::debug!(volume = %entry.id, %err, "volume group formed already"),
    }
}

/// The group's failure detector, on Raft's runtime, after the start-up
/// window.
fn spawn_detector(parts: &HostParts, group: &RaftGroup) -> tokio::task::JoinHandle<()> {
    let (raft, peers, timing) = (
        group.raft.clone(),
        Arc::clone(&group.peers),
        parts.config.timing,
    );
    parts.runtime.spawn(async move {
        // The start-up window: no campaign before it has passed.
        tokio::time::sleep(timing.election_max).await;
        crate::raft::detector::run(raft, peers, timing).await;
    })
}

/// The task that keeps `group`'s membership in step with the table's
/// placement of `entry` (see `node::placement`).
fn spawn_placement(
    parts: &HostParts,
    entry: &VolumeEntry,
    volume: &Volume,
    group: &RaftGroup,
) -> tokio::task::JoinHandle<()> {
    let membership = Membership::new(
        Arc::clone(&group.coordinator),
        Arc::clone(&volume.controller),
        Arc::clone(&volume.engine),
        parts.transport.clone(),
        addresses(parts),
    );
    let addresses = {
        let parts = parts.clone();
        move || addresses(&parts)
    };
    tokio::spawn(super::placement::follow(
        entry.id.clone(),
        (Arc::clone(&parts.cluster), Arc::clone(&group.coordinator)),
        membership,
        (parts.transport.clone(), parts.config.cluster_id.clone()),
        addresses,
    ))
}

/// Whether this node, whose copy of `hosted` the table no longer places
/// here, must keep it running: while the volume's group, as this node
/// applied it, names it a member and its copy may count (in the applied
/// in-sync set), or the group's leader was heard within [`LEAVING_GRACE`]
/// (a move adds the new copy before the old one leaves; see
/// `node::placement`). A removed node does not apply its own removal
/// (openraft stops replicating to it), hence the grace: by then its copy
/// counts nowhere, and its vote, in the old half of the joint
/// configuration that removed it, is needed by no majority.
fn still_needed(hosted: &Hosted) -> bool {
    let coordinator = &hosted.group.coordinator;
    let me = coordinator.member();
    let applied = coordinator.state_machine().current();
    let member = applied
        .membership
        .membership()
        .nodes()
        .any(|(m, _)| *m == me);
    let counted = applied.control.in_sync.contains(&me.node());
    let heard = coordinator.last_leader_contact().elapsed() < LEAVING_GRACE;
    member && (counted || heard)
}

/// How long a node whose copy was moved away keeps it after it last heard
/// the group's leader, once its copy no longer counts (see
/// [`still_needed`]).
const LEAVING_GRACE: Duration = Duration::from_secs(10);

/// Stops serving and running `group`.
async fn stop_group(parts: &HostParts, group: &RaftGroup) {
    parts.served.remove(&group.peers);
    if let Err(err) = group.raft.shutdown().await {
        tracing::warn!(%err, group = group.id.0, "raft shutdown of a volume group");
    }
}

/// Stops a volume the table no longer places here and removes its data
/// (see the module docs for the order).
async fn remove(parts: &HostParts, hosted: Hosted) {
    let Hosted {
        volume,
        group,
        detector,
        placement,
    } = hosted;
    placement.abort();
    let id = volume.id().clone();
    if let Some(exports) = &parts.exports {
        exports.remove(&id.0);
    }
    parts.stores.remove(&id.0);
    volume.stop_writing(super::STOP_DEADLINE).await;
    detector.abort();
    let dir = volume.site().dir.parent().map(std::path::Path::to_path_buf);
    volume.stop(super::STOP_DEADLINE).await;
    stop_group(parts, &group).await;
    let group_id = group.id;
    drop(group);
    if let Err(err) = parts.db.drop_group(group_id).await {
        tracing::warn!(volume = %id, %err, "removing the volume group's Raft state");
    }
    if let Some(dir) = dir {
        if let Err(err) = tokio::fs::remove_dir_all(&dir).await {
            tracing::warn!(volume = %id, dir = %dir.display(), %err, "removing the volume's copy");
        }
    }
    tracing::info!(volume = %id, "volume stopped and its copy removed");
}
