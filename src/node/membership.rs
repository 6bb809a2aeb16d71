//! Membership at run time: replace, add and remove nodes, through Raft's
//! joint consensus, and the replica set that follows the membership.
//!
//! After formation the committed membership is the truth; the peer list
//! only gives first formation and addresses. Every change is made by the
//! active writer (it holds the lease, so its in-sync changes commit in its
//! term), one at a time, in an order that keeps S5 and S8:
//!
//! - **replace N**: N's replica leaves the in-sync set (committed, and the
//!   writer's view with it) before anything else, so the empty copy of the
//!   new incarnation can never count as the old one. This goes on below
//!   `min_in_sync` (writes are then held until the rebuild ends), for the
//!   lost copy comes back no other way. The new incarnation joins as a learner, catches
//!   up on Raft, and the voters are swapped (old out, new in) in one joint
//!   change. Its replica is then rebuilt in full by the resync, which
//!   returns it to the in-sync set only when every extent matches.
//! - **add N**: N's certificate is admitted, its replica joins the set
//!   (out of sync), N joins as a learner and catches up; once the resync
//!   has rebuilt its replica and returned it to the in-sync set, N becomes
//!   a voter.
//! - **remove N**: refused if fewer members than `min_in_sync` would
//!   remain. N's replica leaves the in-sync set (committed), then N leaves
//!   the voters. Removing the writer's own node hands leadership over
//!   first and says where to ask again.
//!
//! A change while another runs (on this node, or a joint configuration not
//! yet uniform) is refused. A node's replica set follows the *applied*
//! membership ([`follow_membership`]): a member's replica enters out of
//! sync (rebuilding) and a removed one leaves only once its removal is
//! committed. With `auto_replace`, the writer replaces a waiting new
//! incarnation by itself once the old one has been silent long enough
//! ([`auto_replace`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;

use crate::api::admin::{MembersChanges, MembershipError};
use crate::ha::{Controller, Coordinator};
use crate::ids::{GroupId, MemberId, NodeId, Term};
use crate::net::Transport;
use crate::raft::{MemberNode, RaftCoordinator};
use crate::replica::Replica;
use crate::replica::mirror::engine::{Engine, Leaving, MembershipError as EngineMembershipError};
use crate::replica::mirror::set::ReplicaSet;
use crate::replica::peer::remote::RemoteReplica;

/// How long one membership entry may take to commit.
const CHANGE_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs one openraft membership call, bounded by `limit`.
async fn within<T, E: std::fmt::Display>(
    limit: Duration,
    what: &str,
    call: impl std::future::Future<Output = Result<T, E>>,
) -> Result<T, MembershipError> {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(done)) => Ok(done),
        Ok(Err(err)) => Err(raft_error(what, err)),
        Err(_) => Err(MembershipError::Failed(format!(
            "{what}: not committed within {limit:?} (run the command again to finish it)"
        ))),
    }
}

/// How long a new learner gets to catch up on Raft.
const CATCH_UP: Duration = Duration::from_secs(60);

/// How long `add` waits for a new node's replica to be rebuilt before it
/// becomes a voter.
const REBUILD_WAIT: Duration = Duration::from_secs(3600);

/// How long `add` waits for the new node to announce itself.
const ANNOUNCE_WAIT: Duration = Duration::from_secs(10);

/// How long a change that needs the active writer waits for this node's
/// promotion to finish, and how often it looks.
const ACTIVE_WAIT: Duration = Duration::from_secs(10);
const ACTIVE_POLL: Duration = Duration::from_millis(50);

/// What membership changes need of the node.
pub struct Membership {
    coordinator: Arc<RaftCoordinator>,
    controller: Arc<Controller>,
    /// The writer's engine: a node leaving the in-sync set leaves its view
    /// too, not only the committed set.
    engine: Arc<Engine>,
    transport: Transport,
    /// The configured peer list's addresses.
    peers: BTreeMap<NodeId, String>,
    /// One change at a time.
    busy: tokio::sync::Mutex<()>,
}

type Outcome = Result<String, MembershipError>;

fn raft_error(what: &str, err: impl std::fmt::Display) -> MembershipError {
    let text = err.to_string();
    if text.contains("in progress") || text.contains("InProgress") {
        return MembershipError::InProgress(format!("{what}: {text}"));
    }
    MembershipError::Failed(format!("{what}: {text}"))
}

impl Membership {
    /// Membership changes over the node's parts.
    pub fn new(
        coordinator: Arc<RaftCoordinator>,
        controller: Arc<Controller>,
        engine: Arc<Engine>,
        transport: Transport,
        peers: BTreeMap<NodeId, String>,
    ) -> Self {
        Self {
            coordinator,
            controller,
            engine,
            transport,
            peers,
            busy: tokio::sync::Mutex::new(()),
        }
    }

    /// The term this node writes in, or why it may not change the
    /// membership.
    fn writer_term(&self) -> Result<Term, MembershipError> {
        let seen = self.coordinator.observe().borrow().clone();
        if !seen.is_self {
            return Err(MembershipError::NotWriter(seen.leader));
        }
        let membership = self
            .coordinator
            .raft()
            .metrics()
            .borrow()
            .membership_config
            .clone();
        if membership.membership().get_joint_config().len() > 1 {
            return Err(MembershipError::InProgress(
                "a joint configuration is still being committed".into(),
            ));
        }
        Ok(seen.term)
    }

    fn voters(&self) -> BTreeSet<MemberId> {
        self.coordinator
            .raft()
            .metrics()
            .borrow()
            .membership_config
            .membership()
            .voter_ids()
            .collect()
    }

    fn address(&self, node: NodeId) -> String {
        match self.coordinator.book().entries().get(&node) {
            Some(entry) if !entry.addr.is_empty() => entry.addr.clone(),
            _ => self.peers.get(&node).cloned().unwrap_or_default(),
        }
    }

    fn min_in_sync(&self) -> usize {
        let applied = self.coordinator.state_machine().current();
        applied.control.volume.map_or(1, |v| v.min_in_sync)
    }

    /// Drops `node`'s replica from the in-sync set, if it is in it, through
    /// the active engine: it commits the change and moves its own view
    /// with it (see [`crate::replica::mirror::engine::Engine::leave_in_sync`],
    /// which also says how far `why` lets the set shrink). While this node
    /// leads but its promotion has not finished (the engine is not active;
    /// just after a hand-over, say), waits for it up to [`ACTIVE_WAIT`]: a
    /// change committed behind the engine's back would leave its view
    /// naming the node.
    async fn leave_in_sync(&self, node: NodeId, why: Leaving) -> Result<(), MembershipError> {
        let deadline = Instant::now() + ACTIVE_WAIT;
        loop {
            match self.engine.leave_in_sync(node, why).await {
                Ok(()) => return Ok(()),
                Err(EngineMembershipError::Inactive) if Instant::now() < deadline => {
                    self.writer_term()?;
                    tokio::time::sleep(ACTIVE_POLL).await;
                }
                Err(EngineMembershipError::Inactive) => {
                    return Err(MembershipError::InProgress(format!(
                        "this node leads but has not become the active writer within \
                         {ACTIVE_WAIT:?} (its promotion runs); try again"
                    )));
                }
                Err(err) => {
                    return Err(MembershipError::Failed(format!(
                        "dropping node {node} from the in-sync set: {err}"
                    )));
                }
            }
        }
    }

    /// Adds `member` as a learner at `addr` and waits until it caught up.
    async fn add_learner(&self, member: MemberId, addr: String) -> Result<(), MembershipError> {
        let raft = self.coordinator.raft();
        let added = within(
            CHANGE_TIMEOUT,
            "adding the learner",
            raft.add_learner(member, MemberNode { addr }, false),
        )
        .await?;
        let index = added.log_id.index;
        let deadline = Instant::now() + CATCH_UP;
        let mut metrics = raft.metrics();
        loop {
            let matched = metrics
                .borrow_and_update()
                .replication
                .as_ref()
                .and_then(|r| r.get(&member).cloned().flatten())
                .map(|id| id.index);
            if matched.is_some_and(|m| m >= index) {
                return Ok(());
            }
            tokio::select! {
                _ = metrics.changed() => {}
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(MembershipError::Failed(format!(
                        "member {member} did not catch up on Raft within {CATCH_UP:?} (matched {matched:?} of {index})"
                    )));
                }
            }
        }
    }

    /// The incarnation of `node` that announced itself waiting, waiting
    /// up to `within` for it.
    async fn announced(&self, node: NodeId, within: Duration) -> Option<MemberId> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(member) = self.coordinator.book().waiting(node) {
                return Some(member);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Every incarnation of `node` in the membership: (member, voter).
    fn incarnations(&self, node: NodeId) -> Vec<(MemberId, bool)> {
        let metrics = self.coordinator.raft().metrics().borrow().clone();
        let membership = metrics.membership_config.membership();
        let voters: BTreeSet<MemberId> = membership.voter_ids().collect();
        membership
            .nodes()
            .filter(|(m, _)| m.node() == node)
            .map(|(m, _)| (*m, voters.contains(m)))
            .collect()
    }

    /// Makes `new` node `node`'s only incarnation: it must be a learner
    /// (caught up); every other incarnation leaves the voters and the
    /// membership. One joint change for the voters, then the stale
    /// learners go.
    async fn swap_in(&self, node: NodeId, new: MemberId) -> Result<(), MembershipError> {
        let stale: Vec<MemberId> = self
            .incarnations(node)
            .into_iter()
            .map(|(m, _)| m)
            .filter(|m| *m != new)
            .collect();
        let mut voters = self.voters();
        voters.retain(|v| !stale.contains(v));
        voters.insert(new);
        within(
            CHANGE_TIMEOUT,
            "swapping the voters",
            self.coordinator.raft().change_membership(voters, false),
        )
        .await?;
        let learners: BTreeSet<MemberId> = self
            .incarnations(node)
            .into_iter()
            .filter(|(m, voter)| *m != new && !voter)
            .map(|(m, _)| m)
            .collect();
        if !learners.is_empty() {
            within(
                CHANGE_TIMEOUT,
                "removing the stale incarnations",
                self.coordinator
                    .raft()
                    .change_membership(openraft::ChangeMembers::RemoveNodes(learners), false),
            )
            .await?;
        }
        Ok(())
    }

    /// Replaces `node`'s lost incarnation by the new one that waits. Picks
    /// up where an earlier attempt stopped: a new incarnation already added
    /// as a learner is taken as the one to swap in.
    async fn replace_node(&self, node: NodeId) -> Outcome {
        let _busy = self.one_at_a_time()?;
        self.writer_term()?;
        let known = self.incarnations(node);
        if known.is_empty() {
            return Err(MembershipError::Unknown(node));
        }
        if node == self.coordinator.member().node() {
            return Err(MembershipError::Refused(format!(
                "node {node} is the writer and has its disk; nothing to replace"
            )));
        }
        let is_known = |m: &MemberId| known.iter().any(|(k, _)| k == m);
        let announced = self
            .coordinator
            .book()
            .waiting(node)
            .filter(|m| !is_known(m));
        let resumed = known.iter().find(|(_, voter)| !voter).map(|(m, _)| *m);
        let Some(new) = announced.or(resumed) else {
            return Err(MembershipError::Refused(format!(
                "node {node} has no new incarnation waiting: start it with an empty data dir \
                 and this cluster's peer list; its status then says \"replaced disk: waiting \
                 to be re-added\""
            )));
        };
        let addr = self.address(node);
        self.swap_incarnation(node, new, addr).await
    }

    /// Makes `new` the incarnation of `node` (at `addr`) in this group:
    /// the old one's replica leaves the in-sync set first, then `new`
    /// joins as a learner and the voters are swapped; the resync rebuilds
    /// its replica in full.
    async fn swap_incarnation(&self, node: NodeId, new: MemberId, addr: String) -> Outcome {
        tracing::info!(%node, %new, group = self.coordinator.group().0, "replacing a node's incarnation");
        self.leave_in_sync(node, Leaving::Replaced).await?;
        self.add_learner(new, addr).await?;
        self.swap_in(node, new).await?;
        tracing::info!(%node, %new, "replaced; the resync rebuilds its replica in full");
        Ok(format!(
            "node {node} is now incarnation {}; its replica is being rebuilt in full (see status)",
            new.incarnation()
        ))
    }

    /// Makes `new`, the incarnation the node list names for `node`, its
    /// incarnation in this volume group too (a table volume's group
    /// following `members replace`); see [`Membership::swap_incarnation`].
    pub async fn follow_replacement(&self, node: NodeId, new: MemberId, addr: String) -> Outcome {
        let _busy = self.one_at_a_time()?;
        self.writer_term()?;
        if node == self.coordinator.member().node() {
            return Err(MembershipError::Refused(format!(
                "node {node} is the writer; nothing to replace"
            )));
        }
        self.swap_incarnation(node, new, addr).await
    }

    async fn add_node(&self, node: NodeId, addr: String) -> Outcome {
        let _busy = self.one_at_a_time()?;
        let term = self.writer_term()?;
        crate::node::config::check_node_id("node", node)
            .map_err(|err| MembershipError::Refused(err.to_string()))?;
        // Picks up where an earlier add stopped: a learner of `node` (and
        // only that) is taken as the one to finish.
        let known = self.incarnations(node);
        let resumed = match known.as_slice() {
            [] => None,
            [(learner, false)] => Some(*learner),
            _ => {
                return Err(MembershipError::Refused(format!(
                    "node {node} is a member already (to bring back a lost disk, use `members replace`)"
                )));
            }
        };
        if addr.parse::<std::net::SocketAddr>().is_err() && !addr.contains(':') {
            return Err(MembershipError::Refused(format!(
                "address {addr:?} is not HOST:PORT"
            )));
        }
        if resumed.is_none() {
            // A node not in the cluster holds no in-sync copy. Should the
            // set still name it (it was removed while its rebuild ended),
            // its new incarnation must not count as that copy (S8).
            self.leave_in_sync(node, Leaving::Replaced).await?;
        }
        self.transport.admit_member(node);
        let announced = match resumed {
            Some(learner) => Some(learner),
            None => self.announced(node, ANNOUNCE_WAIT).await,
        };
        let Some(member) = announced else {
            self.transport.expel_member(node);
            return Err(MembershipError::Refused(format!(
                "node {node} did not announce itself within {ANNOUNCE_WAIT:?}: is it running at \
                 {addr}, with this cluster's id, certificates and a peer list that names this node?"
            )));
        };
        self.join(node, member, addr, term).await
    }

    /// Adds `member` (of `node`, at `addr`) as a learner, waits until the
    /// resync has rebuilt its replica into the in-sync set, and makes it a
    /// voter; while this node writes in `term` throughout.
    async fn join(&self, node: NodeId, member: MemberId, addr: String, term: Term) -> Outcome {
        tracing::info!(%node, %member, %addr, group = self.coordinator.group().0, "adding a member");
        self.add_learner(member, addr).await?;
        // The replica set follows the applied membership: the new replica
        // is there, out of sync, and the resync rebuilds it.
        self.wait_in_sync(node).await?;
        let term_now = self.writer_term()?;
        if term_now != term {
            return Err(MembershipError::Failed(format!(
                "the writer changed during the rebuild (term {term} → {term_now}); run the add again"
            )));
        }
        within(
            CHANGE_TIMEOUT,
            "making it a voter",
            self.coordinator.raft().change_membership(
                openraft::ChangeMembers::AddVoterIds(BTreeSet::from([member])),
                true,
            ),
        )
        .await?;
        Ok(format!(
            "node {node} (incarnation {}) is a voter, its replica in sync",
            member.incarnation()
        ))
    }

    /// Waits until `node`'s replica is in the committed in-sync set.
    async fn wait_in_sync(&self, node: NodeId) -> Result<(), MembershipError> {
        let mut applied = self.coordinator.state_machine().subscribe();
        let deadline = Instant::now() + REBUILD_WAIT;
        loop {
            if applied.borrow_and_update().control.in_sync.contains(&node) {
                return Ok(());
            }
            tokio::select! {
                changed = applied.changed() => if changed.is_err() {
                    return Err(MembershipError::Failed("the state machine stopped".into()));
                },
                _ = tokio::time::sleep_until(deadline) => {
                    return Err(MembershipError::Failed(format!(
                        "node {node}'s replica was not rebuilt within {REBUILD_WAIT:?}; it stays a learner"
                    )));
                }
            }
        }
    }

    /// Adds `member`, the incarnation the node list names for `node`, to
    /// this volume group (a copy placed on it: `volume move`, or a node's
    /// copies moving off a removed node); see [`Membership::join`]. A node
    /// of the cluster is admitted already, so nothing is admitted here.
    pub async fn follow_placement(&self, node: NodeId, member: MemberId, addr: String) -> Outcome {
        let _busy = self.one_at_a_time()?;
        let term = self.writer_term()?;
        let resumed = match self.incarnations(node).as_slice() {
            [] => false,
            [(learner, false)] if *learner == member => true,
            _ => {
                return Err(MembershipError::Refused(format!(
                    "node {node} is in the group already under another incarnation"
                )));
            }
        };
        if !resumed {
            // A copy the group forgot must not count as this one (S8).
            self.leave_in_sync(node, Leaving::Replaced).await?;
        }
        self.join(node, member, addr, term).await
    }

    /// Removes `node` from this group (see [`Membership::remove_node`]).
    pub async fn leave_placement(&self, node: NodeId) -> Outcome {
        self.remove_node(node).await
    }

    async fn remove_node(&self, node: NodeId) -> Outcome {
        let _busy = self.one_at_a_time()?;
        self.writer_term()?;
        let Some(member) = self.coordinator.book().member(node) else {
            return Err(MembershipError::Unknown(node));
        };
        let voters = self.voters();
        let remaining = voters.iter().filter(|v| **v != member).count();
        let needed = self.min_in_sync();
        if voters.contains(&member) && remaining < needed {
            return Err(MembershipError::Refused(format!(
                "removing node {node} would leave {remaining} members, fewer than min_in_sync \
                 {needed}: no write could be acknowledged"
            )));
        }
        let in_sync = self.coordinator.state_machine().current().control.in_sync;
        let still = in_sync.iter().filter(|id| **id != node).count();
        if still < needed {
            return Err(MembershipError::Refused(format!(
                "removing node {node} would leave {still} in-sync replicas, fewer than min_in_sync \
                 {needed}: writes would stop until a rebuild ends; wait for it (see status)"
            )));
        }
        if node == self.coordinator.member().node() {
            let Some(to) = self.coordinator.successors().into_iter().next() else {
                return Err(MembershipError::Refused(format!(
                    "node {node} is the writer and no live member can take over"
                )));
            };
            self.controller.hand_over(to).await.map_err(|err| {
                MembershipError::Failed(format!("handing over to node {to}: {err}"))
            })?;
            return Err(MembershipError::Moved {
                to,
                addr: self.address(to),
            });
        }
        self.leave_in_sync(node, Leaving::Cluster).await?;
        let change = if voters.contains(&member) {
            openraft::ChangeMembers::RemoveVoters(BTreeSet::from([member]))
        } else {
            openraft::ChangeMembers::RemoveNodes(BTreeSet::from([member]))
        };
        within(
            CHANGE_TIMEOUT,
            "removing it",
            self.coordinator.raft().change_membership(change, false),
        )
        .await?;
        Ok(format!("node {node} removed"))
    }

    fn one_at_a_time(&self) -> Result<tokio::sync::MutexGuard<'_, ()>, MembershipError> {
        self.busy.try_lock().map_err(|_| {
            MembershipError::InProgress("another membership change runs on this node".into())
        })
    }
}

/// How often the writer looks for a node to replace by itself.
const AUTO_REPLACE_POLL: Duration = Duration::from_secs(1);

/// With `auto_replace`: while this node is the writer, replaces a member
/// whose new incarnation waits (it announced itself) once the member's old
/// incarnation has been silent for `after` — the last time this node heard
/// the node, or this task's start if it never did. Runs until stopped.
pub async fn auto_replace(membership: Arc<Membership>, after: Duration) {
    let started = Instant::now();
    loop {
        tokio::time::sleep(AUTO_REPLACE_POLL).await;
        if membership.writer_term().is_err() {
            continue;
        }
        let me = membership.coordinator.member().node();
        for (node, entry) in membership.coordinator.book().entries() {
            let waiting = membership.coordinator.book().waiting(node);
            if node == me || waiting.is_none_or(|m| m == entry.member) {
                continue;
            }
            let heard = membership
                .coordinator
                .last_heard(node)
                .map_or(started, |at| at.max(started));
            if heard.elapsed() < after {
                continue;
            }
            tracing::warn!(%node, silent = ?heard.elapsed(), "auto_replace: replacing the node's lost incarnation");
            match membership.replace_node(node).await {
                Ok(done) => tracing::info!(%node, "auto_replace: {done}"),
                Err(err) => tracing::warn!(%node, %err, "auto_replace: not replaced (yet)"),
            }
        }
    }
}

#[async_trait]
impl MembersChanges for Membership {
    async fn replace(&self, node: NodeId) -> Outcome {
        self.replace_node(node).await
    }

    async fn add(&self, node: NodeId, addr: String) -> Outcome {
        self.add_node(node, addr).await
    }

    async fn remove(&self, node: NodeId) -> Outcome {
        self.remove_node(node).await
    }
}

/// Keeps this node's replica set and channel pool in step with the
/// applied (committed) membership of the volume's group: a new member's
/// replica joins (out of sync until the resync rebuilds it), a removed
/// member's leaves. With `admission` (the cluster group's volume, whose
/// membership is the node list) the certificate allow-list follows it
/// too. Runs until the state machine stops.
pub async fn follow_membership(
    coordinator: Arc<RaftCoordinator>,
    replicas: Arc<ReplicaSet>,
    admission: Option<Transport>,
    make: impl Fn(NodeId, &str) -> Arc<dyn Replica> + Send,
) {
    let local = replicas.local_id();
    let mut applied = coordinator.state_machine().subscribe();
    loop {
        let members: BTreeMap<NodeId, String> = {
            let current = applied.borrow_and_update();
            current
                .membership
                .membership()
                .nodes()
                .map(|(member, node)| (member.node(), node.addr.clone()))
                .collect()
        };
        if !members.is_empty() {
            for (node, addr) in &members {
                if *node != local && replicas.get(*node).is_none() {
                    if let Some(transport) = &admission {
                        transport.admit_member(*node);
                    }
                    if let Some(channels) = replicas.channels() {
                        channels.add(*node, addr.clone(), None);
                    }
                    match replicas.add(make(*node, addr)) {
                        Ok(()) => tracing::info!(%node, %addr, "a member's replica joined the set"),
                        Err(err) => tracing::warn!(%node, %err, "cannot add the member's replica"),
                    }
                }
            }
            for node in replicas.ids() {
                if node != local && !members.contains_key(&node) {
                    match replicas.remove(node) {
                        Ok(_) => {
                            if let Some(channels) = replicas.channels() {
                                channels.remove(node);
                            }
                            if let Some(transport) = &admission {
                                transport.expel_member(node);
                            }
                            tracing::info!(%node, "a removed member's replica left the set");
                        }
                        Err(err) => tracing::warn!(%node, %err, "cannot drop the removed replica"),
                    }
                }
            }
        }
        if applied.changed().await.is_err() {
            return;
        }
    }
}

/// Builds the replica of a member added at run time, reached through
/// `channels`, of volume `volume` of Raft group `group`.
pub fn remote_maker(
    channels: Arc<crate::replica::peer::channels::Channels>,
    cluster_id: String,
    volume: String,
    group: GroupId,
    timeout: Duration,
) -> impl Fn(NodeId, &str) -> Arc<dyn Replica> + Send {
    move |node, _addr| {
        Arc::new(RemoteReplica::through(
            node,
            Arc::clone(&channels),
            &cluster_id,
            &volume,
            group,
            timeout,
        )) as Arc<dyn Replica>
    }
}
