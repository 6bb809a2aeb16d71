//! Forming the cluster, and a node that has no Raft state (S8).
//!
//! A node whose Raft state is empty is either one of a brand-new cluster,
//! or a node whose data dir was lost (a replaced disk, a re-imaged
//! machine), or a new node that an operator is about to add. Only the
//! first may form a membership; the other two must never vote or count
//! toward a quorum until a committed membership change names them (their
//! data dir's incarnation is new, so Raft's messages meant for their former
//! selves are refused: see [`crate::raft::network`]).
//!
//! So a node with no Raft state asks every configured peer (`Node.Hello`)
//! until it knows which case it is in:
//! - **A peer has Raft state.** The cluster exists. This node waits as a
//!   non-member, and says so in status, `/metrics` and the log: "replaced
//!   disk: waiting to be re-added" when the peer's membership names this
//!   node under another incarnation, "new node: waiting to be added" when
//!   it does not name it. Once a leader adds it, the leader's log reaches
//!   it and the wait ends.
//! - **Every peer it reached is empty, and with itself they are a majority
//!   of the peer list.** A brand-new cluster. Exactly one node forms it:
//!   the lowest id of the peer list (the *founder*), so that no two nodes
//!   ever write different first memberships. The founder waits up to
//!   [`FORMATION_GRACE`] for every peer, then forms with those it reached
//!   (at least a majority); each member is named with the incarnation it
//!   answered with. The other nodes wait for the founder's log.
//!
//! Implementation caveats: a peer list whose founder is down cannot form a
//! new cluster until it is up (no other node may form one). A peer that
//! was down during formation is not a member; it waits as a new node and
//! joins through `replica-ha members add`. If a majority of the peer list
//! lost its disks at once while the rest is down, the reachable empty nodes
//! look exactly like a new cluster and form one: a majority lost is a
//! cluster lost, and the old members that return then refuse the new ones
//! (their incarnations differ) rather than mix with them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use super::config::NodeConfig;
use crate::ids::{MemberId, NodeId};
use crate::members::Waiting;
use crate::net::Transport;
use crate::raft::{MemberNode, Raft};

/// How long the founder waits for every peer of the list once a majority
/// answered, before it forms the cluster with the majority.
pub const FORMATION_GRACE: Duration = Duration::from_secs(3);

/// How often a node with no Raft state asks its peers again.
const ASK_EVERY: Duration = Duration::from_millis(300);

/// How long one question may take.
const ASK_TIMEOUT: Duration = Duration::from_secs(1);

/// What one peer answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// Its member id (node and incarnation).
    pub member: MemberId,
    /// Whether it holds Raft state.
    pub initialized: bool,
    /// The member its membership names for the asking node's id.
    pub names_asker: Option<MemberId>,
}

/// What a node with no Raft state does next, from its peers' answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Form the cluster with these members.
    Form(Vec<MemberId>),
    /// Wait, for this reason.
    Wait(String),
}

/// Decides for node `me` of a peer list of `listed` nodes whose founder is
/// `founder`, from the `answers` of the peers it reached; `grace_over`
/// says whether the founder has waited [`FORMATION_GRACE`] with a
/// majority. Pure, so the rules are tested without a cluster.
pub fn decide(
    me: MemberId,
    founder: NodeId,
    listed: usize,
    answers: &[Answer],
    grace_over: bool,
) -> Decision {
    let node = me.node();
    if let Some(known) = answers.iter().find(|a| a.initialized) {
        let why = match answers.iter().find_map(|a| a.names_asker) {
            Some(named) if named == me => {
                "joining: the cluster names this node; waiting for the leader's log".to_string()
            }
            Some(_) => format!(
                "replaced disk: waiting to be re-added (`replica-ha members replace --id {node}`)"
            ),
            None => format!(
                "new node: waiting to be added (`replica-ha members add --id {node} --addr \
                 <this node's gRPC address>`); node {} holds the cluster's membership",
                known.member.node()
            ),
        };
        return Decision::Wait(why);
    }
    let reached = answers.len() + 1;
    let majority = listed / 2 + 1;
    if reached < majority {
        return Decision::Wait(format!(
            "forming: {reached} of the {listed} listed nodes reached, {majority} needed"
        ));
    }
    if node != founder {
        return Decision::Wait(format!(
            "forming: waiting for node {founder} (the lowest id of the peer list) to form the cluster"
        ));
    }
    if reached < listed && !grace_over {
        return Decision::Wait(format!(
            "forming: {reached} of the {listed} listed nodes reached; waiting a moment for the rest"
        ));
    }
    let mut members: Vec<MemberId> = answers.iter().map(|a| a.member).collect();
    members.push(me);
    members.sort_unstable();
    Decision::Form(members)
}

/// Runs until this node holds Raft state: asks the peers, decides, and
/// forms the cluster or waits (see the module docs).
pub async fn run(
    raft: Raft,
    config: NodeConfig,
    me: MemberId,
    transport: Transport,
    waiting: Arc<Waiting>,
) {
    let founder = config.peers.keys().next().copied().unwrap_or(config.id);
    let mut majority_since: Option<Instant> = None;
    loop {
        match raft.is_initialized().await {
            Ok(true) => {
                waiting.set(None);
                return;
            }
            Ok(false) => {}
            Err(err) => {
                tracing::warn!(%err, "cannot read Raft's state");
                return;
            }
        }
        let answers = ask_peers(&config, &transport, me).await;
        let majority = (answers.len() + 1) * 2 > config.peers.len();
        if !majority {
            majority_since = None;
        }
        let since = *majority_since.get_or_insert_with(Instant::now);
        let grace_over = majority && since.elapsed() >= FORMATION_GRACE;
        match decide(me, founder, config.peers.len(), &answers, grace_over) {
            Decision::Form(members) => {
                let nodes: BTreeMap<MemberId, MemberNode> = members
                    .iter()
                    .map(|m| {
                        let addr = config.peers.get(&m.node()).map(|a| a.to_string());
                        (
                            *m,
                            MemberNode {
                                addr: addr.unwrap_or_default(),
                            },
                        )
                    })
                    .collect();
                match raft.initialize(nodes).await {
                    Ok(()) => {
                        let names: Vec<String> = members.iter().map(|m| m.to_string()).collect();
                        tracing::info!(members = %names.join(", "), "formed the cluster");
                        waiting.set(None);
                        return;
                    }
                    Err(err) => tracing::warn!(%err, "could not form the cluster"),
                }
            }
            Decision::Wait(why) => waiting.set(Some(why)),
        }
        tokio::time::sleep(ASK_EVERY).await;
    }
}

/// Asks every configured peer who it is; the answers of those reached.
async fn ask_peers(config: &NodeConfig, transport: &Transport, me: MemberId) -> Vec<Answer> {
    let asks =
        config
            .peers
            .iter()
            .filter(|(id, _)| **id != config.id)
            .map(|(id, addr)| async move {
                let reply = crate::replica::peer::channels::hello(
                    transport,
                    &config.cluster_id,
                    me,
                    *id,
                    &addr.to_string(),
                    ASK_TIMEOUT,
                )
                .await;
                match reply {
                    Ok(reply) => Some(Answer {
                        member: MemberId(reply.member),
                        initialized: reply.raft_initialized,
                        names_asker: (reply.asker_member != 0)
                            .then_some(MemberId(reply.asker_member)),
                    }),
                    Err(err) => {
                        tracing::debug!(peer = %id, %err, "no answer");
                        None
                    }
                }
            });
    futures::future::join_all(asks)
        .await
        .into_iter()
        .flatten()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Incarnation;

    fn member(node: u64, incarnation: u64) -> MemberId {
        MemberId::new(NodeId(node), Incarnation(incarnation))
    }

    fn empty(node: u64) -> Answer {
        Answer {
            member: member(node, node * 10),
            initialized: false,
            names_asker: None,
        }
    }

    #[test]
    fn only_the_founder_forms_and_only_with_a_majority_of_empty_peers() {
        let me = member(1, 10);
        // Alone: never.
        assert!(matches!(
            decide(me, NodeId(1), 3, &[], true),
            Decision::Wait(_)
        ));
        // A majority, before the grace: wait for the rest; after: form.
        assert!(matches!(
            decide(me, NodeId(1), 3, &[empty(2)], false),
            Decision::Wait(_)
        ));
        assert_eq!(
            decide(me, NodeId(1), 3, &[empty(2)], true),
            Decision::Form(vec![me, member(2, 20)])
        );
        // Everyone: at once, with each one's incarnation.
        assert_eq!(
            decide(me, NodeId(1), 3, &[empty(3), empty(2)], false),
            Decision::Form(vec![me, member(2, 20), member(3, 30)])
        );
        // Not the founder: never forms.
        let two = member(2, 20);
        let Decision::Wait(why) = decide(two, NodeId(1), 3, &[empty(1), empty(3)], true) else {
            panic!("node 2 formed a cluster")
        };
        assert!(why.contains("node 1"), "{why}");
    }

    #[test]
    fn a_node_that_finds_the_cluster_formed_waits_and_says_why() {
        let me = member(3, 99);
        let leader = |names: Option<MemberId>| Answer {
            member: member(1, 10),
            initialized: true,
            names_asker: names,
        };
        // Its former incarnation is the member: a replaced disk.
        let Decision::Wait(why) = decide(me, NodeId(1), 3, &[leader(Some(member(3, 30)))], true)
        else {
            panic!("formed")
        };
        assert!(
            why.starts_with("replaced disk: waiting to be re-added"),
            "{why}"
        );
        assert!(why.contains("members replace --id 3"), "{why}");
        // Not named at all: a new node. Even the founder with everyone
        // else empty does not form once one peer holds state.
        let holder = Answer {
            member: member(2, 20),
            initialized: true,
            names_asker: None,
        };
        let Decision::Wait(why) = decide(member(1, 5), NodeId(1), 3, &[holder, empty(3)], true)
        else {
            panic!("formed")
        };
        assert!(why.starts_with("new node: waiting to be added"), "{why}");
        // Named as itself: the log is on its way.
        let Decision::Wait(why) = decide(me, NodeId(1), 3, &[leader(Some(me))], true) else {
            panic!("formed")
        };
        assert!(why.starts_with("joining"), "{why}");
    }
}
