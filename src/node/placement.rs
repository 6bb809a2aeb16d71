//! A table volume's group follows the table: its placement (`volume move`,
//! a removed node's copies) and the incarnations the cluster group names
//! for its nodes (`members replace`).
//!
//! The cluster group decides where a volume's copies belong; the volume's
//! own group decides who holds one now, and only its writer changes that,
//! with the membership changes `members` makes for the configured volume
//! ([`Membership`]), one at a time, in this order ([`next_step`]):
//! 1. **Replace**: a node of the placement whose voter in the group is
//!    another incarnation than the one the cluster names (its disk was
//!    replaced): the old incarnation's copy leaves the in-sync set first,
//!    the new one joins and is rebuilt in full (S8: an empty copy never
//!    counts as the old one).
//! 2. **Add**: a node of the placement that is no voter: it joins as a
//!    learner, its copy is rebuilt into the in-sync set, then it votes.
//! 3. **Remove**: a member no longer placed, only once every placed node
//!    is a voter of the right incarnation, so a move adds before it
//!    removes and the volume never has fewer copies than before it. The
//!    writer's own node hands the writer over first; the next writer goes
//!    on.
//!
//! A node whose copy was moved away keeps its volume running while it is
//! still a member of the group (`node::host`), and drops it only after.
//! A step that fails is tried again after [`RETRY`]; nothing here runs on
//! a node that does not write the volume.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use super::membership::Membership;
use crate::api::admin::MembershipError;
use crate::ha::Coordinator;
use crate::ids::{MemberId, NodeId, VolumeId};
use crate::net::Transport;
use crate::raft::RaftCoordinator;
use crate::replica::peer::channels::hello;

/// How long a node may take to say which incarnation it runs.
const HELLO: Duration = Duration::from_secs(2);

/// How long after a failed step, or without any change, the writer looks
/// again.
pub const RETRY: Duration = Duration::from_secs(5);

/// One membership change that brings a volume's group closer to its
/// placement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// `node`'s incarnation in the group becomes `new`.
    Replace { node: NodeId, new: MemberId },
    /// `member` (of `node`) joins the group.
    Add { node: NodeId, member: MemberId },
    /// `node` leaves the group.
    Remove { node: NodeId },
}

/// The next step for a group whose members are `group` (each node's
/// incarnation, and whether it votes), towards `placement`, with the
/// incarnations the cluster names in `cluster`; none when it is there.
pub fn next_step(
    placement: &BTreeSet<NodeId>,
    cluster: &BTreeMap<NodeId, MemberId>,
    group: &BTreeMap<NodeId, (MemberId, bool)>,
    in_sync: &BTreeSet<NodeId>,
) -> Option<Step> {
    for node in placement {
        let Some(named) = cluster.get(node) else {
            continue;
        };
        match group.get(node) {
            // Replaced only once the cluster names no such incarnation any
            // more (a writer whose cluster state lags must not swap an old
            // one back in).
            Some((member, true)) if member != named && !cluster.values().any(|m| m == member) => {
                return Some(Step::Replace {
                    node: *node,
                    new: *named,
                });
            }
            Some((_, true)) => {}
            // A learner of another incarnation (its disk replaced during its
            // rebuild) goes first, then the named one is added.
            Some((member, false)) if member != named => {
                return Some(Step::Remove { node: *node });
            }
            _ => {
                return Some(Step::Add {
                    node: *node,
                    member: *named,
                });
            }
        }
    }
    // Nothing leaves while a placed node is not a voter of the named
    // incarnation (one the cluster does not name, say), or its copy is
    // not in the committed in-sync set: a move never leaves the volume
    // with fewer in-sync copies than it had.
    let complete = placement.iter().all(|node| {
        let voting = matches!((group.get(node), cluster.get(node)), (Some((member, true)), Some(named)) if member == named);
        voting && in_sync.contains(node)
    });
    group
        .keys()
        .find(|node| complete && !placement.contains(node))
        .map(|node| Step::Remove { node: *node })
}

/// The voters of `coordinator`'s group, by node; none while a change of
/// them is under way (a joint configuration names two incarnations of a
/// node being replaced).
fn voters(coordinator: &RaftCoordinator) -> BTreeMap<NodeId, MemberId> {
    let applied = coordinator.state_machine().current();
    let membership = applied.membership.membership();
    if membership.get_joint_config().len() > 1 {
        return BTreeMap::new();
    }
    membership
        .voter_ids()
        .map(|member| (member.node(), member))
        .collect()
}

/// Every member of `coordinator`'s group, by node, and whether it votes.
fn members(coordinator: &RaftCoordinator) -> BTreeMap<NodeId, (MemberId, bool)> {
    let metrics = coordinator.raft().metrics().borrow().clone();
    let membership = metrics.membership_config.membership();
    let voting: BTreeSet<MemberId> = membership.voter_ids().collect();
    membership
        .nodes()
        .map(|(member, _)| (member.node(), (*member, voting.contains(member))))
        .collect()
}

/// Keeps volume `id`'s group (through `membership`, over `group`) in
/// step with the table of `cluster` (see the module docs), while this
/// node writes it; `addresses` gives each node's gRPC address. Runs
/// until the task is stopped.
pub async fn follow(
    id: VolumeId,
    (cluster, group): (Arc<RaftCoordinator>, Arc<RaftCoordinator>),
    membership: Membership,
    (transport, cluster_id): (Transport, String),
    addresses: impl Fn() -> BTreeMap<NodeId, String> + Send,
) {
    let mut table = cluster.state_machine().subscribe();
    // Server metrics: sent when leadership or membership change, not on
    // every turn of openraft's loop.
    let mut metrics = group.raft().server_metrics();
    loop {
        let entry = cluster
            .state_machine()
            .current()
            .control
            .volumes
            .get(&id)
            .cloned();
        let in_sync = group.state_machine().current().control.in_sync;
        let step = entry
            .filter(|entry| entry.group == group.group())
            .and_then(|entry| {
                next_step(
                    &entry.placement,
                    &voters(&cluster),
                    &members(&group),
                    &in_sync,
                )
            });
        let writing = group.observe().borrow().is_self;
        let mut wait = RETRY;
        if let (Some(step), true) = (step, writing) {
            let addr = |node: NodeId| addresses().get(&node).cloned().unwrap_or_default();
            tracing::info!(volume = %id, ?step, "the volume's group follows its placement");
            let outcome = match step {
                Step::Replace { node, new } => {
                    // Only the incarnation the node runs now is swapped in:
                    // a writer whose cluster state lags names an old one.
                    let me = group.member().node();
                    let asked = hello(&transport, &cluster_id, me, node, &addr(node), HELLO).await;
                    match asked.map(|reply| MemberId(reply.member)) {
                        Ok(running) if running == new => {
                            membership.follow_replacement(node, new, addr(node)).await
                        }
                        Ok(running) => Err(MembershipError::Refused(format!(
                            "node {node} runs as {running}, not as {new} the cluster names here"
                        ))),
                        Err(err) => Err(MembershipError::Refused(format!(
                            "node {node} does not say which incarnation it runs: {err}"
                        ))),
                    }
                }
                Step::Add { node, member } => {
                    membership.follow_placement(node, member, addr(node)).await
                }
                Step::Remove { node } => membership.leave_placement(node).await,
            };
            match outcome {
                Ok(done) => {
                    tracing::info!(volume = %id, "{done}");
                    wait = Duration::ZERO;
                }
                Err(MembershipError::Moved { to, .. }) => {
                    tracing::info!(volume = %id, %to, "handed the writer over to leave the group");
                }
                Err(err) => {
                    tracing::warn!(volume = %id, ?step, %err, "not done yet; trying again later");
                    // Whatever changes meanwhile, not before RETRY.
                    tokio::time::sleep(RETRY).await;
                }
            }
        }
        if wait.is_zero() {
            continue;
        }
        tokio::select! {
            changed = table.changed() => if changed.is_err() { return },
            changed = metrics.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(wait) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Incarnation;

    fn member(node: u64, incarnation: u64) -> MemberId {
        MemberId::new(NodeId(node), Incarnation(incarnation))
    }

    fn nodes(ids: &[u64]) -> BTreeSet<NodeId> {
        ids.iter().map(|id| NodeId(*id)).collect()
    }

    fn cluster(ids: &[(u64, u64)]) -> BTreeMap<NodeId, MemberId> {
        ids.iter()
            .map(|(id, inc)| (NodeId(*id), member(*id, *inc)))
            .collect()
    }

    fn group(ids: &[(u64, u64, bool)]) -> BTreeMap<NodeId, (MemberId, bool)> {
        ids.iter()
            .map(|(id, inc, voter)| (NodeId(*id), (member(*id, *inc), *voter)))
            .collect()
    }

    #[test]
    fn a_group_that_matches_its_placement_needs_nothing() {
        let settled = group(&[(1, 1, true), (2, 1, true), (3, 1, true)]);
        let names = cluster(&[(1, 1), (2, 1), (3, 1), (4, 1)]);
        assert_eq!(
            next_step(&nodes(&[1, 2, 3]), &names, &settled, &nodes(&[1, 2, 3])),
            None
        );
    }

    #[test]
    fn a_move_adds_the_new_copy_before_the_old_one_leaves() {
        let names = cluster(&[(1, 1), (2, 1), (3, 1), (4, 1)]);
        let placement = nodes(&[2, 3, 4]);
        let before = group(&[(1, 1, true), (2, 1, true), (3, 1, true)]);
        let add = Step::Add {
            node: NodeId(4),
            member: member(4, 1),
        };
        let old = nodes(&[1, 2, 3]);
        assert_eq!(next_step(&placement, &names, &before, &old), Some(add));
        // Still a learner (its rebuild runs): adding it goes on first.
        let learning = group(&[(1, 1, true), (2, 1, true), (3, 1, true), (4, 1, false)]);
        assert_eq!(next_step(&placement, &names, &learning, &old), Some(add));
        // A voter whose copy is not in sync yet (or fell out): nothing leaves.
        let voting = group(&[(1, 1, true), (2, 1, true), (3, 1, true), (4, 1, true)]);
        assert_eq!(next_step(&placement, &names, &voting, &old), None);
        let degraded = nodes(&[1, 3, 4]);
        assert_eq!(next_step(&placement, &names, &voting, &degraded), None);
        let remove = Step::Remove { node: NodeId(1) };
        let all = nodes(&[1, 2, 3, 4]);
        assert_eq!(next_step(&placement, &names, &voting, &all), Some(remove));
    }

    #[test]
    fn a_replaced_disk_is_swapped_in_before_anything_leaves() {
        let names = cluster(&[(1, 1), (2, 9), (3, 1)]);
        let stale = group(&[(1, 1, true), (2, 1, true), (3, 1, true), (4, 1, true)]);
        let replace = Step::Replace {
            node: NodeId(2),
            new: member(2, 9),
        };
        let all = nodes(&[1, 2, 3]);
        assert_eq!(
            next_step(&nodes(&[1, 2, 3]), &names, &stale, &all),
            Some(replace)
        );
    }

    #[test]
    fn a_learner_of_a_replaced_incarnation_leaves_before_the_new_one_joins() {
        let names = cluster(&[(1, 1), (2, 1), (4, 7)]);
        let stale = group(&[(1, 1, true), (2, 1, true), (3, 1, true), (4, 1, false)]);
        let all = nodes(&[1, 2, 3]);
        let remove = Step::Remove { node: NodeId(4) };
        assert_eq!(
            next_step(&nodes(&[1, 2, 4]), &names, &stale, &all),
            Some(remove)
        );
    }

    #[test]
    fn a_node_the_cluster_does_not_name_is_not_added_and_nothing_leaves_meanwhile() {
        let names = cluster(&[(1, 1), (2, 1), (4, 1)]);
        let short = group(&[(1, 1, true), (2, 1, true), (4, 1, true)]);
        assert_eq!(
            next_step(&nodes(&[1, 2, 3]), &names, &short, &nodes(&[1, 2, 4])),
            None
        );
    }
}
