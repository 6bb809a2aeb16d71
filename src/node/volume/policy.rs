//! The policy of one volume on a node, which the node's wiring used to
//! hold: the volume config this node is configured for and the check that
//! the cluster agrees with it, fixing that config in Raft when the cluster
//! has none, and hashing marked extents ahead while no leader is heard.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use crate::ha::Coordinator;
use crate::ids::NodeId;
use crate::node::config::{ConfigError, NodeConfig};
use crate::raft::network::Peers;
use crate::raft::{Raft, RaftCoordinator, Request};
use crate::volume::VolumeSpec;

/// The volume this node is configured for.
pub(super) fn volume_spec(config: &NodeConfig) -> VolumeSpec {
    VolumeSpec::new(
        &config.cluster_id,
        &config.volume,
        config.size,
        config.min_in_sync,
    )
}

/// Resolves when the cluster's recorded volume config differs from `mine`,
/// this node's.
pub(super) async fn conflict(coordinator: &RaftCoordinator, mine: &VolumeSpec) -> ConfigError {
    let mut applied = coordinator.state_machine().subscribe();
    loop {
        let control = applied.borrow_and_update().control.clone();
        if let Some(theirs) = control.volume.clone() {
            // The size may be the created one or any up to the current
            // one: a config updated after an online resize.
            let now = control.volume_size().unwrap_or(theirs.size);
            let size_fits = (theirs.size..=now).contains(&mine.size);
            let created = VolumeSpec {
                size: mine.size,
                ..theirs.clone()
            };
            if !size_fits || created != *mine {
                return ConfigError(format!(
                    "this node is configured with {mine:?} but the cluster was created with {theirs:?} \
                     and its volume is now {now} bytes (every node, also one added later, must be \
                     configured with the cluster's min_in_sync, and a size from the created one up \
                     to the current one; the volume grows only through `replica-ha resize`)"
                ));
            }
        }
        if applied.changed().await.is_err() {
            return std::future::pending().await;
        }
    }
}

/// Whenever this node leads and the cluster has no volume config yet,
/// commits this node's, with every member's replica in sync (all empty).
pub(super) async fn fix_volume_spec(coordinator: Arc<RaftCoordinator>, volume: VolumeSpec) {
    let mut observations = coordinator.observe();
    loop {
        let seen = observations.borrow_and_update().clone();
        let unset = coordinator
            .state_machine()
            .current()
            .control
            .volume
            .is_none();
        if seen.is_self && unset {
            let replicas: BTreeSet<NodeId> = coordinator.book().entries().into_keys().collect();
            let request = Request::Init {
                volume: volume.clone(),
                replicas,
                uuid: new_uuid(),
            };
            match coordinator.commit(seen.term, request).await {
                Ok(_) => tracing::info!(?volume, "volume config fixed"),
                Err(err) => tracing::warn!(%err, "could not fix the volume config yet"),
            }
        }
        if !unset {
            return;
        }
        tokio::select! {
            changed = observations.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
}

/// A random (version 4) UUID, in its usual text form.
fn new_uuid() -> String {
    let (a, b) = (crate::ids::random_u64(), crate::ids::random_u64());
    let a = (a & !0xf000) | 0x4000; // version 4
    let b = (b & !(0b11 << 62)) | (0b10 << 62); // RFC 4122 variant
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xffff,
        b >> 48,
        b & 0xffff_ffff_ffff
    )
}

/// While no leader has been heard for [`predigest_after`] (150 ms by
/// default), keeps the digests of this node's marked extents
/// hashed ahead (see [`crate::replica::disk::predigest`]): a failover is likely
/// coming, and its convergence then reads them instead of hashing. The
/// failure detector waits `election_max` before it campaigns, so this runs
/// in that wait, off the failover's path.
pub(super) async fn predigest_when_leader_silent(
    store: Arc<crate::replica::disk::store::ReplicaStore>,
    raft: Raft,
    peers: Arc<Peers>,
    timing: crate::raft::RaftTiming,
) {
    let silent_for = predigest_after(timing);
    let metrics = raft.metrics();
    let mut pause = timing.recheck();
    loop {
        tokio::time::sleep(pause).await;
        // Look again when the leader could first count as silent (a node
        // runs this per volume: an idle one wakes a few times a second).
        let leads = metrics.borrow().state == openraft::ServerState::Leader;
        let quiet = peers.last_leader_contact().elapsed();
        pause = match leads {
            true => silent_for,
            false => silent_for
                .saturating_sub(quiet)
                .clamp(timing.recheck(), silent_for),
        };
        if leads || quiet < silent_for {
            continue;
        }
        match store.predigest().await {
            Ok(0) => {}
            Ok(hashed) => tracing::debug!(hashed, "leader silent: hashed the marked extents ahead"),
            Err(err) => tracing::warn!(%err, "hashing the marked extents ahead"),
        }
    }
}

/// How long without a leader makes a node hash its marked extents ahead
/// of a failover: half the shortest election timeout, so that the hashing
/// has the rest of the detector's wait (`election_max` and jitter) however
/// often heartbeats come.
fn predigest_after(timing: crate::raft::RaftTiming) -> std::time::Duration {
    timing.election_min / 2
}
