//! S4, the lease from send times, in-process: three openraft nodes over
//! loopback gRPC, with the real network, failure detector and coordinator,
//! and a log store double whose appends can be stalled. A leader whose Raft
//! core is stuck in a log fsync publishes no metrics; its lease must still
//! end at its last real quorum acknowledgement plus the lease, however
//! often its clock looks at it, and must end before another node leads.
//! And every group's lease is its own: two groups on the same nodes, over
//! one Db, peer book and server per node, fail over apart.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Debug;
use std::ops::RangeBounds;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use openraft::storage::{LogFlushed, LogState, RaftLogReader, RaftLogStorage};
use openraft::{Entry, LogId, StorageError, Vote};
use replica_ha::ha::Coordinator;
use replica_ha::ids::GroupId;
use replica_ha::raft::network::{Network, PeerBook, Peers, RaftService};
use replica_ha::raft::{
    LogStore, MemberId, NodeId, Raft, RaftCoordinator, RaftDb, RaftTiming, Request, StateMachine,
    Term, TypeConfig,
};
use tokio::time::Instant;

mod common;

/// The sled log store, with appends that wait while `stalled` is set (a
/// log fsync that takes as long as the test wants).
#[derive(Clone)]
struct StallingLog {
    inner: LogStore,
    stalled: Arc<AtomicBool>,
}

impl RaftLogReader<TypeConfig> for StallingLog {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>, StorageError<MemberId>> {
        self.inner.try_get_log_entries(range).await
    }
}

impl RaftLogStorage<TypeConfig> for StallingLog {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError<MemberId>> {
        self.inner.get_log_state().await
    }

    async fn get_log_reader(&mut self) -> LogStore {
        self.inner.get_log_reader().await
    }

    async fn save_vote(&mut self, vote: &Vote<MemberId>) -> Result<(), StorageError<MemberId>> {
        self.inner.save_vote(vote).await
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<MemberId>>, StorageError<MemberId>> {
        self.inner.read_vote().await
    }

    async fn save_committed(
        &mut self,
        committed: Option<LogId<MemberId>>,
    ) -> Result<(), StorageError<MemberId>> {
        self.inner.save_committed(committed).await
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<MemberId>>, StorageError<MemberId>> {
        self.inner.read_committed().await
    }

    async fn append<I>(
        &mut self,
        entries: I,
        callback: LogFlushed<TypeConfig>,
    ) -> Result<(), StorageError<MemberId>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        while self.stalled.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        self.inner.append(entries, callback).await
    }

    async fn truncate(&mut self, log_id: LogId<MemberId>) -> Result<(), StorageError<MemberId>> {
        self.inner.truncate(log_id).await
    }

    async fn purge(&mut self, log_id: LogId<MemberId>) -> Result<(), StorageError<MemberId>> {
        self.inner.purge(log_id).await
    }
}

/// One node of the test cluster: its groups, its server and detectors.
struct TestNode {
    groups: BTreeMap<GroupId, TestGroup>,
    /// What the node's groups share.
    book: Arc<PeerBook>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

/// One Raft group on a test node.
struct TestGroup {
    raft: Raft,
    coordinator: Arc<RaftCoordinator>,
    stalled: Arc<AtomicBool>,
}

impl TestGroup {
    /// Stalls this group's next log append (its Raft core waits in it,
    /// sends no heartbeats and publishes no metrics) and starts a write of
    /// `term` that runs into the stall. Returns when it stalled, and the
    /// write.
    fn stall_a_write(&self, term: Term) -> (Instant, tokio::task::JoinHandle<()>) {
        self.stalled.store(true, Ordering::SeqCst);
        let stalled_at = Instant::now();
        let raft = self.raft.clone();
        let write = tokio::spawn(async move {
            let _ = raft
                .client_write(Request::ShrinkInSync {
                    term,
                    remove: BTreeSet::new(),
                })
                .await;
        });
        (stalled_at, write)
    }
}

impl TestNode {
    /// The node's first group (the only one, unless the test asked for more).
    fn first(&self) -> &TestGroup {
        &self.groups[&GroupId::FIRST]
    }

    async fn stop(&self) {
        for task in &self.tasks {
            task.abort();
        }
        for group in self.groups.values() {
            let _ = group.raft.shutdown().await;
        }
    }
}

async fn start_cluster(timing: RaftTiming) -> BTreeMap<NodeId, TestNode> {
    start_cluster_via(timing, false, 1).await.0
}

/// [`start_cluster`] with `groups` Raft groups on every node (ids 0 up),
/// sharing each node's Db, peer book and server; with `proxied`, each node
/// is reached by the others through a proxy of its own, returned in node
/// order.
async fn start_cluster_via(
    timing: RaftTiming,
    proxied: bool,
    groups: u64,
) -> (BTreeMap<NodeId, TestNode>, Vec<common::proxy::Proxy>) {
    let ids: [NodeId; 3] = [NodeId(1), NodeId(2), NodeId(3)];
    let mut proxies = Vec::new();
    let mut listeners = BTreeMap::new();
    for id in ids {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        listeners.insert(id, listener);
    }
    let mut addrs: BTreeMap<NodeId, String> = BTreeMap::new();
    for (id, listener) in &listeners {
        let addr = listener.local_addr().unwrap();
        let reached = if proxied {
            let proxy = common::proxy::Proxy::start(addr).await;
            let at = proxy.addr;
            proxies.push(proxy);
            at
        } else {
            addr
        };
        addrs.insert(*id, reached.to_string());
    }
    let mut nodes = BTreeMap::new();
    for (id, listener) in listeners {
        let dir = tempfile::tempdir().unwrap();
        let db = RaftDb::new(&sled::open(dir.path()).unwrap());
        let others = addrs
            .iter()
            .filter(|(peer, _)| **peer != id)
            .map(|(peer, addr)| (*peer, addr.clone()))
            .collect();
        let book = PeerBook::new(
            "lease-test".into(),
            MemberId(id.0),
            others,
            Arc::default(),
            replica_ha::net::Transport::default(),
        );
        let mut service: Option<RaftService> = None;
        let mut node = TestNode {
            groups: BTreeMap::new(),
            book: Arc::clone(&book),
            tasks: Vec::new(),
            _dir: dir,
        };
        for group in (0..groups).map(GroupId) {
            let stalled = Arc::new(AtomicBool::new(false));
            let log = StallingLog {
                inner: LogStore::of_group(&db, group).unwrap(),
                stalled: Arc::clone(&stalled),
            };
            let state_machine = StateMachine::of_group(&db, group).unwrap();
            let peers = Peers::of_group(Arc::clone(&book), group, timing.election_max);
            let config = timing.raft_config("lease-test").unwrap();
            let raft = Raft::new(
                MemberId(id.0),
                Arc::new(config),
                Network::new(Arc::clone(&peers)),
                log,
                state_machine.clone(),
            )
            .await
            .unwrap();
            let coordinator =
                RaftCoordinator::start(raft.clone(), state_machine, Arc::clone(&peers), timing);
            service = Some(match service {
                None => RaftService::new(raft.clone(), Arc::clone(&peers)),
                Some(service) => service
                    .with_group(raft.clone(), Arc::clone(&peers))
                    .expect("a new group of this node"),
            });
            let members: BTreeSet<MemberId> = ids.into_iter().map(|id| MemberId(id.0)).collect();
            let _ = raft.initialize(members).await;
            node.tasks.push(tokio::spawn({
                let (raft, peers) = (raft.clone(), Arc::clone(&peers));
                async move {
                    tokio::time::sleep(timing.election_max).await;
                    replica_ha::raft::detector::run(raft, peers, timing).await;
                }
            }));
            node.groups.insert(
                group,
                TestGroup {
                    raft,
                    coordinator,
                    stalled,
                },
            );
        }
        let service = service.expect("at least one group");
        // The node's heartbeat clock, over every group it serves.
        node.tasks
            .push(tokio::spawn(replica_ha::raft::heartbeat::drive(
                service.groups().clone(),
                timing.heartbeat,
            )));
        let service = replica_ha::net::Transport::default()
            .serve(replica_ha::net::Audience::Members, service.into_server());
        node.tasks.push(tokio::spawn(async move {
            let _ = replica_ha::net::Transport::default()
                .server()
                .add_service(service)
                .serve_with_incoming(replica_ha::net::Transport::default().incoming(listener))
                .await;
        }));
        nodes.insert(id, node);
    }
    (nodes, proxies)
}

/// The node that holds a lease now, with its term.
fn lease_holder(nodes: &BTreeMap<NodeId, TestNode>) -> Option<(NodeId, Term)> {
    lease_holder_of(nodes, GroupId::FIRST)
}

/// The node that holds group `group`'s lease now, with its term.
fn lease_holder_of(nodes: &BTreeMap<NodeId, TestNode>, group: GroupId) -> Option<(NodeId, Term)> {
    let now = Instant::now();
    let holders: Vec<_> = nodes
        .iter()
        .filter_map(|(id, node)| {
            let lease = node.groups[&group].coordinator.lease()?;
            (lease.deadline > now).then_some((*id, lease.term))
        })
        .collect();
    assert!(
        holders.len() <= 1,
        "two leases of group {group} at once: {holders:?}"
    );
    holders.first().copied()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_stuck_in_a_log_fsync_loses_its_lease_at_its_last_ack() {
    let timing = RaftTiming::default();
    let nodes = start_cluster(timing).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    let (leader, term) = loop {
        if let Some(holder) = lease_holder(&nodes) {
            break holder;
        }
        assert!(Instant::now() < deadline, "no leader");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };

    // Stall the leader's next log append.
    let old = nodes[&leader].first();
    let (stalled_at, write) = old.stall_a_write(term);

    // No acknowledgement can be newer than the stall (give a heartbeat
    // already on its way a little slack: 50 ms, whatever the interval).
    let bound = stalled_at + timing.lease() + Duration::from_millis(50);
    let mut successor = None;
    let until = stalled_at + Duration::from_secs(2);
    while Instant::now() < until {
        if let Some(lease) = old.coordinator.lease() {
            assert!(
                lease.deadline <= bound,
                "the stuck leader's lease runs {:?} past its last possible ack + lease",
                lease.deadline - bound
            );
        }
        if let Some((id, new_term)) = lease_holder(&nodes) {
            if id != leader {
                assert!(new_term > term);
                successor.get_or_insert((id, Instant::now() - stalled_at));
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (new, after) = successor.expect("no other node took over during the stall");
    eprintln!("node {new} led {after:?} after node {leader} stalled");
    old.stalled.store(false, Ordering::SeqCst);
    let _ = tokio::time::timeout(Duration::from_secs(5), write).await;

    for node in nodes.values() {
        node.stop().await;
    }
}

/// S4 without false alarms: followers whose replies come later than a
/// heartbeat interval (80 ms a round trip, openraft waits 50 ms) still
/// acknowledge the leader, so its lease holds without a break, at one
/// term. Before, every such reply was dropped with its call, no
/// acknowledgement counted, and the writer's lease lapsed under a client
/// that saturated the machine (#36). Heartbeats every 50 ms here (the
/// default is 100 ms): the replies are later than openraft's wait and
/// well within the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_heartbeat_replies_still_keep_the_lease() {
    let timing = RaftTiming {
        heartbeat: Duration::from_millis(50),
        ..RaftTiming::default()
    };
    let (nodes, proxies) = start_cluster_via(timing, true, 1).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    let (leader, term) = loop {
        if let Some(holder) = lease_holder(&nodes) {
            break holder;
        }
        assert!(Instant::now() < deadline, "no leader");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    for proxy in &proxies {
        proxy.set_delay(Duration::from_millis(40));
    }
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        assert_eq!(
            lease_holder(&nodes),
            Some((leader, term)),
            "the lease lapsed with every follower answering late"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for node in nodes.values() {
        node.stop().await;
    }
}

/// Every invariant stays local to one group: two groups on the same three
/// nodes, sharing each node's Db, peer book and server, elect their own
/// leaders and keep their own leases. When the first group's leader is
/// stuck in a log fsync, that group fails over; the second group's lease
/// holder keeps its lease at its term, without a break, whichever node it
/// is on, for its acknowledgements are its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_groups_on_the_same_nodes_keep_their_own_leases() {
    let timing = RaftTiming::default();
    let (nodes, _) = start_cluster_via(timing, false, 2).await;
    let (first, second) = (GroupId::FIRST, GroupId(1));
    let deadline = Instant::now() + Duration::from_secs(15);
    let (holders, (leader, term)) = loop {
        if let (Some(a), Some(b)) = (
            lease_holder_of(&nodes, first),
            lease_holder_of(&nodes, second),
        ) {
            break ((a, b), a);
        }
        assert!(Instant::now() < deadline, "a group elected no leader");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let (_, (other_leader, other_term)) = holders;
    let stuck = &nodes[&leader].groups[&first];
    let (stalled_at, write) = stuck.stall_a_write(term);
    let mut failed_over = false;
    while Instant::now() < stalled_at + Duration::from_secs(2) {
        assert_eq!(
            lease_holder_of(&nodes, second),
            Some((other_leader, other_term)),
            "the second group's lease moved or lapsed with the first group's leader stuck"
        );
        if let Some((id, _)) = lease_holder_of(&nodes, first) {
            failed_over |= id != leader;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(failed_over, "the first group did not fail over");
    stuck.stalled.store(false, Ordering::SeqCst);
    let _ = tokio::time::timeout(Duration::from_secs(5), write).await;
    for node in nodes.values() {
        node.stop().await;
    }
}

/// The heartbeats of the groups one node leads travel together: once node 1
/// leads all three groups, its rounds to a peer hold about one heartbeat
/// of each group, not one each.
#[tokio::test]
async fn the_groups_a_node_leads_send_their_heartbeats_together() {
    use replica_ha::ha::Coordinator;
    let timing = RaftTiming::default();
    let (nodes, _) = start_cluster_via(timing, false, 3).await;
    let groups = [GroupId::FIRST, GroupId(1), GroupId(2)];
    let deadline = Instant::now() + Duration::from_secs(20);
    let one = NodeId(1);
    loop {
        let holders: Vec<_> = groups.iter().map(|g| lease_holder_of(&nodes, *g)).collect();
        if holders
            .iter()
            .all(|h| matches!(h, Some((id, _)) if *id == one))
        {
            break;
        }
        for (group, holder) in groups.iter().zip(&holders) {
            if let Some((leader, _)) = holder.filter(|(id, _)| *id != one) {
                let _ = nodes[&leader].groups[group]
                    .coordinator
                    .transfer_to(one)
                    .await;
            }
        }
        assert!(
            Instant::now() < deadline,
            "node 1 did not come to lead every group: {holders:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Count over the next 40 rounds (about a second of heartbeats to two
    // peers), whatever time they take.
    let since = nodes[&one].book.heartbeat_rounds();
    let deadline = Instant::now() + Duration::from_secs(20);
    let (rounds, heartbeats) = loop {
        let (r, h) = nodes[&one].book.heartbeat_rounds();
        if r - since.0 >= 40 {
            break (r - since.0, h - since.1);
        }
        assert!(Instant::now() < deadline, "node 1 sent no heartbeats");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(
        heartbeats >= rounds * 2,
        "{heartbeats} heartbeats of three groups went in {rounds} rounds: not together"
    );
    for node in nodes.values() {
        node.stop().await;
    }
}

/// The Raft server serves each group once, and only over its own node's
/// peer book (whose admission is the one it applies).
#[tokio::test]
async fn a_server_takes_a_group_once_and_only_of_its_own_node() {
    let timing = RaftTiming::default();
    let dir = tempfile::tempdir().unwrap();
    let db = RaftDb::new(&sled::open(dir.path()).unwrap());
    let book = || {
        PeerBook::new(
            "lease-test".into(),
            MemberId(1),
            BTreeMap::new(),
            Arc::default(),
            replica_ha::net::Transport::default(),
        )
    };
    let (ours, theirs) = (book(), book());
    let group = |node: &Arc<PeerBook>, id: GroupId| {
        let peers = Peers::of_group(Arc::clone(node), id, timing.election_max);
        let (db, config) = (db.clone(), timing.raft_config("lease-test").unwrap());
        async move {
            let raft = Raft::new(
                MemberId(1),
                Arc::new(config),
                Network::new(Arc::clone(&peers)),
                LogStore::of_group(&db, id).unwrap(),
                StateMachine::of_group(&db, id).unwrap(),
            )
            .await
            .unwrap();
            (raft, peers)
        }
    };
    let (first, first_peers) = group(&ours, GroupId::FIRST).await;
    let (second, second_peers) = group(&ours, GroupId(1)).await;
    let (foreign, foreign_peers) = group(&theirs, GroupId(2)).await;
    let service = RaftService::new(first.clone(), first_peers);
    let again = RaftService::new(first.clone(), Arc::clone(&second_peers))
        .with_group(second.clone(), Arc::clone(&second_peers));
    assert!(
        again
            .err()
            .expect("a group twice")
            .contains("served already")
    );
    let mismatched = RaftService::new(first.clone(), Arc::clone(&second_peers))
        .with_group(foreign.clone(), foreign_peers);
    let why = mismatched.err().expect("another node's group");
    assert!(why.contains("another node"), "{why}");
    assert!(service.with_group(second.clone(), second_peers).is_ok());
    for raft in [first, second, foreign] {
        let _ = raft.shutdown().await;
    }
}
