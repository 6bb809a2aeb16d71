//! The node's one heartbeat clock: every heartbeat interval it has each
//! Raft group this node leads send its heartbeats, all at the same
//! instant, so that the heartbeats to one peer node travel in one call
//! ([`super::network`]'s batches) however many groups the node leads.
//!
//! openraft's own heartbeat timer is off ([`super::RaftTiming::raft_config`]):
//! its timers run from each group's start, at scattered instants, which
//! would leave nothing to send together. The rate is the same, so the
//! lease (S4) sees what it saw before: a heartbeat of every group every
//! interval, whose acknowledgements count by their send times. A group
//! whose leader hands over (`transfer`) sends none meanwhile, as before.

use std::time::Duration;

use openraft::ServerState;
use tokio::time::MissedTickBehavior;

use super::network::ServedGroups;

/// Triggers every interval `every` the heartbeats of each group of
/// `groups` this node leads. Runs until dropped.
pub async fn drive(groups: ServedGroups, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        for (raft, peers) in groups.all() {
            let leads = raft.metrics().borrow().state == ServerState::Leader;
            if leads && !peers.handing_over() {
                // A command to the group's core; it answers at once.
                let _ = raft.trigger().heartbeat().await;
            }
        }
    }
}
