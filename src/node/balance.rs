//! The writer balancer: spreads the writers of the table's volumes over
//! the nodes, so that each node writes about as many volumes as any other.
//!
//! Every volume's group elects its leader by itself, and the first node to
//! time out wins; left alone, one node may end up writing most volumes.
//! The volume table names a **preferred writer** for each volume
//! ([`crate::raft::volume_table::VolumeTable::preferred_writers`]), the
//! same on every node. Each node runs this balancer over the volumes it
//! writes: one whose preferred writer is another node is handed to it,
//! with the drained hand-over `transfer` does
//! ([`Controller::hand_over`]), when all of these hold:
//! - this node has written it for at least the balance interval (so a
//!   writer moves at most once per interval, also just after a failover);
//! - every copy of it is in sync, none is rebuilding or degraded, and no
//!   write is held below `min_in_sync`;
//! - the preferred node holds a copy and was heard from within the lease.
//!
//! One hand-over at a time per node, and the views are read again after
//! each. A node that returns from a restart gets its share back once it is
//! in sync and the interval has passed. A hand-over that fails (the target
//! declines or does not take over) has closed the gate already: the
//! writer resigns for a fresh term, and the volume's next writer may be
//! another node; that writer waits an interval before it moves it again.
//!
//! Safety does not depend on any of this: a hand-over is a leadership
//! transfer like any other, the new writer fences before it writes (S1,
//! S2), and a balancer that moved nothing would leave every invariant as
//! it is. The configured volume (group 0, the cluster group) is not
//! balanced: its leader also leads the cluster.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::host::HostedVolumes;
use crate::ids::{NodeId, VolumeId};
use crate::raft::RaftCoordinator;

/// How often the balancer looks at the volumes this node writes.
const SCAN: Duration = Duration::from_secs(1);

/// What the balancer sees of one volume this node runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BalanceView {
    /// The volume's group (a volume deleted and made again has another).
    pub group: u64,
    /// The volume group's current term.
    pub term: u64,
    /// Whether this node writes it now (its gate open).
    pub writing: bool,
    /// The group's voters: the nodes that hold its copies.
    pub voters: BTreeSet<NodeId>,
    /// The copies the writer's mirror holds in sync.
    pub in_sync: BTreeSet<NodeId>,
    /// The group's members heard from within the lease.
    pub live: BTreeSet<NodeId>,
    /// Whether a copy is being rebuilt, degraded or away, or writes are
    /// held below `min_in_sync`: a hand-over waits for calm.
    pub unsettled: bool,
}

/// Where volume `view` should go now, if anywhere: `preferred`, when this
/// node (`me`) has written it for `held` ≥ `interval` and the module docs'
/// conditions hold.
pub fn hand_over_to(
    view: &BalanceView,
    me: NodeId,
    preferred: NodeId,
    held: Duration,
    interval: Duration,
) -> Option<NodeId> {
    let ready = view.writing
        && preferred != me
        && held >= interval
        && !view.unsettled
        && view.voters.contains(&preferred)
        && view.voters.is_subset(&view.in_sync)
        && view.live.contains(&preferred);
    ready.then_some(preferred)
}

/// Runs the balancer of this node (`me`) over `hosted`, with the table of
/// `cluster`'s group, until the task is stopped.
pub async fn run(
    cluster: Arc<RaftCoordinator>,
    hosted: HostedVolumes,
    me: NodeId,
    interval: Duration,
) {
    // Since when this node writes each volume (of its group), in which
    // term.
    let mut since: BTreeMap<(VolumeId, u64), (u64, Instant)> = BTreeMap::new();
    let mut tick = tokio::time::interval(SCAN);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let preferred = cluster
            .state_machine()
            .current()
            .control
            .volumes
            .preferred_writers();
        let views = hosted.balance_views().await;
        let now = Instant::now();
        since.retain(|(id, group), _| {
            views
                .iter()
                .any(|(v, view, _)| v == id && view.group == *group && view.writing)
        });
        for (id, view, controller) in views {
            if !view.writing {
                continue;
            }
            let held = since
                .entry((id.clone(), view.group))
                .and_modify(|(term, at)| {
                    if *term != view.term {
                        (*term, *at) = (view.term, now);
                    }
                })
                .or_insert((view.term, now));
            let Some(&target) = preferred.get(&id) else {
                continue;
            };
            let Some(to) = hand_over_to(&view, me, target, now - held.1, interval) else {
                continue;
            };
            tracing::info!(volume = %id, %to, "balancer: handing the writer to its preferred node");
            if let Err(err) = controller.hand_over(to).await {
                tracing::warn!(volume = %id, %to, %err, "balancer: the hand-over failed");
            }
            // Either way, wait another interval before moving it again;
            // and look again at every volume, as this took a while.
            held.1 = Instant::now();
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nodes(ids: &[u64]) -> BTreeSet<NodeId> {
        ids.iter().map(|id| NodeId(*id)).collect()
    }

    /// Node 1 writes a volume on nodes 1–3, all in sync and heard.
    fn settled() -> BalanceView {
        BalanceView {
            group: 1,
            term: 4,
            writing: true,
            voters: nodes(&[1, 2, 3]),
            in_sync: nodes(&[1, 2, 3]),
            live: nodes(&[1, 2, 3]),
            unsettled: false,
        }
    }

    const INTERVAL: Duration = Duration::from_secs(30);

    fn verdict(view: &BalanceView, preferred: u64, held_secs: u64) -> Option<NodeId> {
        hand_over_to(
            view,
            NodeId(1),
            NodeId(preferred),
            Duration::from_secs(held_secs),
            INTERVAL,
        )
    }

    #[test]
    fn a_settled_writer_hands_the_volume_to_its_preferred_node() {
        assert_eq!(verdict(&settled(), 2, 30), Some(NodeId(2)));
    }

    #[test]
    fn a_writer_keeps_a_volume_it_prefers_or_has_not_held_for_the_interval() {
        assert_eq!(verdict(&settled(), 1, 300), None);
        assert_eq!(verdict(&settled(), 2, 29), None);
        let passive = BalanceView {
            writing: false,
            ..settled()
        };
        assert_eq!(verdict(&passive, 2, 300), None);
    }

    #[test]
    fn nothing_moves_while_a_copy_rebuilds_or_is_out_of_sync() {
        let rebuilding = BalanceView {
            unsettled: true,
            ..settled()
        };
        assert_eq!(verdict(&rebuilding, 2, 300), None);
        let behind = BalanceView {
            in_sync: nodes(&[1, 2]),
            ..settled()
        };
        assert_eq!(verdict(&behind, 2, 300), None);
    }

    #[test]
    fn nothing_moves_to_a_silent_node_or_one_without_a_copy() {
        let silent = BalanceView {
            live: nodes(&[1, 3]),
            ..settled()
        };
        assert_eq!(verdict(&silent, 2, 300), None);
        assert_eq!(verdict(&settled(), 4, 300), None);
    }
}
