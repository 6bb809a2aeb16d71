//! Every controller transition against the fake cluster, on paused tokio
//! time: leases, fence timeouts and retries run on a virtual clock, and waits
//! poll a condition against a virtual deadline.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::Bytes;
use replica_ha::ha::fake::{
    FakeCluster, FakeCoordinator, FenceBehavior, FenceScript, MemoryCopy, MemoryEngine,
};
use replica_ha::ha::{
    Controller, ControllerConfig, Coordinator, HaError, ReadGate, Role, SUSPEND_RETRY, Writer,
};
use replica_ha::ids::{NodeId, Term};
use replica_ha::metrics::MeteredDevice;
use replica_ha::volume::{Bond, Change, Device, DeviceError};
use tokio::task::JoinHandle;
use tokio::time::Instant;

const LEASE: Duration = Duration::from_secs(1);

struct Node {
    coordinator: Arc<FakeCoordinator>,
    engine: Arc<MemoryEngine>,
    controller: Arc<Controller>,
    run: JoinHandle<Result<(), HaError>>,
}

impl Node {
    fn start(cluster: &FakeCluster, script: &Arc<FenceScript>, id: NodeId) -> Node {
        Self::start_holding(cluster, script, id, Duration::ZERO)
    }

    /// A node whose gate holds writes short of replicas for `suspend`.
    fn start_holding(
        cluster: &FakeCluster,
        script: &Arc<FenceScript>,
        id: NodeId,
        suspend: Duration,
    ) -> Node {
        let coordinator = cluster.coordinator(id);
        let engine = MemoryEngine::new(1 << 20);
        let controller = Arc::new(Controller::new(
            engine.clone(),
            coordinator.clone(),
            script.fencer(id),
            ControllerConfig {
                fence_timeout: Duration::from_millis(500),
                retry_interval: Duration::from_millis(100),
                suspend_timeout: suspend,
            },
        ));
        let run = tokio::spawn({
            let controller = Arc::clone(&controller);
            async move { controller.run().await }
        });
        Node {
            coordinator,
            engine,
            controller,
            run,
        }
    }

    fn role(&self) -> Role {
        self.controller.status().role
    }

    async fn write(&self) -> Result<(), DeviceError> {
        self.controller
            .device()
            .write_at(0, Bytes::from_static(b"data"), false)
            .await
    }
}

fn setup(ids: &[NodeId]) -> (FakeCluster, Arc<FenceScript>, Vec<Node>) {
    common::init_tracing();
    let cluster = FakeCluster::new(LEASE);
    let script = FenceScript::new();
    let nodes = ids
        .iter()
        .map(|id| Node::start(&cluster, &script, *id))
        .collect();
    (cluster, script, nodes)
}

/// Polls `cond` every virtual millisecond until it holds; fails after ten
/// virtual seconds.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// Asserts `cond` holds at every virtual millisecond for `span`.
async fn always(what: &str, span: Duration, mut cond: impl FnMut() -> bool) {
    let end = Instant::now() + span;
    while Instant::now() < end {
        assert!(cond(), "{what}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

#[tokio::test(start_paused = true)]
async fn the_elected_node_fences_then_opens_its_gate() {
    let (cluster, script, nodes) = setup(&[NodeId(1), NodeId(2)]);
    let a = &nodes[0];
    assert_eq!(a.write().await, Err(DeviceError::NotLeader));
    let term = cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;

    let status = a.controller.status();
    assert_eq!(status.term, term);
    assert_eq!(status.leader.as_ref(), Some(&NodeId(1)));
    assert!(status.active);
    assert_eq!(status.promotions, 1);
    assert_eq!(status.prev_writer, None);
    assert_eq!(status.replicas.len(), 1);
    assert!(script.fenced(NodeId(1), term));
    assert_eq!(
        cluster.promoted(),
        Some(Writer {
            node: NodeId(1),
            term
        })
    );
    a.write().await.unwrap();
    a.controller.device().flush().await.unwrap();
    assert_eq!(a.engine.writes(), vec![(term, 0)]);
    assert_eq!(nodes[1].role(), Role::Follower);
    assert_eq!(nodes[1].write().await, Err(DeviceError::NotLeader));
    assert_eq!(
        nodes[1].controller.device().flush().await,
        Err(DeviceError::NotLeader)
    );
}

#[tokio::test(start_paused = true)]
async fn failover_fences_the_previous_writer_and_demotes_it() {
    let (cluster, script, nodes) = setup(&[NodeId(1), NodeId(2)]);
    let (a, b) = (&nodes[0], &nodes[1]);
    let first = cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    cluster.expire(true);
    until("a demoted", || a.role() == Role::Follower).await;
    assert!(!a.controller.status().active);
    assert_eq!(a.engine.term(), None);
    assert_eq!(a.write().await, Err(DeviceError::NotLeader));

    let second = cluster.elect(NodeId(2)).unwrap();
    assert!(second > first);
    until("b leads", || b.role() == Role::Leader).await;
    let previous = Some(Writer {
        node: NodeId(1),
        term: first,
    });
    assert_eq!(b.controller.status().prev_writer, previous);
    let record = script
        .log()
        .into_iter()
        .find(|r| r.node == NodeId(2))
        .unwrap();
    assert_eq!(
        (record.prev, record.term, record.ok),
        (previous, second, true)
    );
    b.write().await.unwrap();
    assert_eq!(a.controller.status().leader.as_ref(), Some(&NodeId(2)));
}

#[tokio::test(start_paused = true)]
async fn a_failed_fence_stays_pending_retries_and_never_opens() {
    let (cluster, script, nodes) = setup(&[NodeId(1)]);
    let a = &nodes[0];
    script.set(NodeId(1), FenceBehavior::Fail);
    cluster.elect(NodeId(1)).unwrap();
    until("three failed fences", || {
        a.controller.status().fence_failures >= 3
    })
    .await;
    assert_eq!(a.role(), Role::FencePending);
    assert_eq!(a.write().await, Err(DeviceError::NotLeader));
    assert_eq!(a.engine.term(), None);

    // A fresh observation triggers another attempt too.
    cluster.renew();
    let before = script.log().len();
    cluster.republish();
    until("a retry on the observation", || script.log().len() > before).await;
    assert!(!a.controller.status().active);

    script.set(NodeId(1), FenceBehavior::Succeed);
    cluster.renew();
    until("a leads", || a.role() == Role::Leader).await;
    assert!(script.log().iter().filter(|r| !r.ok).count() >= 3);
}

#[tokio::test(start_paused = true)]
async fn a_hung_fence_times_out_and_the_node_stays_passive() {
    let (cluster, script, nodes) = setup(&[NodeId(1)]);
    let a = &nodes[0];
    script.set(NodeId(1), FenceBehavior::Hang);
    cluster.elect(NodeId(1)).unwrap();
    until("a fence timeout", || {
        a.controller.status().fence_failures >= 1
    })
    .await;
    assert_eq!(a.role(), Role::FencePending);
    assert!(!a.controller.status().active);
}

/// The seed's known limitation: leadership lost while a fence is slow.
#[tokio::test(start_paused = true)]
async fn leadership_lost_during_a_slow_fence_never_opens_the_gate() {
    let (cluster, script, nodes) = setup(&[NodeId(1), NodeId(2)]);
    let (a, b) = (&nodes[0], &nodes[1]);
    script.set_delay(Duration::from_millis(400));
    cluster.elect(NodeId(1)).unwrap();
    until("a fencing", || a.role() == Role::FencePending).await;
    cluster.expire(true);
    let gate_a = a.controller.device();
    always("a's gate stays closed", LEASE * 2, || !gate_a.is_open()).await;
    assert_eq!(a.role(), Role::Follower);
    assert_eq!(a.controller.status().promotions, 0);
    // The abandoned attempt never reported success.
    assert!(
        script
            .log()
            .iter()
            .all(|r| r.node != NodeId(1) || r.term != Term(1))
    );
    cluster.elect(NodeId(2)).unwrap();
    until("b leads", || b.role() == Role::Leader).await;
    always("a's gate stays closed", LEASE, || !gate_a.is_open()).await;
}

/// Same, but the loss is never observed: the lease runs out during a slow
/// activation, and the final check refuses to open.
#[tokio::test(start_paused = true)]
async fn an_unobserved_lease_loss_during_promotion_never_opens_the_gate() {
    let (cluster, _script, nodes) = setup(&[NodeId(1), NodeId(2)]);
    let a = &nodes[0];
    a.engine
        .set_activate_delay(LEASE + Duration::from_millis(100));
    cluster.elect(NodeId(1)).unwrap();
    until("a fencing", || a.role() == Role::FencePending).await;
    cluster.set_deaf(NodeId(1), true);
    let gate_a = a.controller.device();
    always("a's gate stays closed", LEASE * 3, || !gate_a.is_open()).await;
    assert_eq!(a.controller.status().promotions, 0);
    assert_eq!(a.engine.term(), None, "the engine was deactivated again");
}

#[tokio::test(start_paused = true)]
async fn an_observation_during_activation_restarts_the_decision() {
    let (cluster, _script, nodes) = setup(&[NodeId(1)]);
    let a = &nodes[0];
    a.engine.set_activate_delay(Duration::from_millis(300));
    cluster.elect(NodeId(1)).unwrap();
    until("a fencing", || a.role() == Role::FencePending).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    cluster.expire(true);
    let gate_a = a.controller.device();
    always("a's gate stays closed", LEASE, || !gate_a.is_open()).await;
    assert_eq!(a.role(), Role::Follower);
    assert_eq!(a.engine.term(), None);
}

/// S4: the gate refuses writes at the lease deadline even though the
/// controller has not (yet) heard of the loss.
#[tokio::test(start_paused = true)]
async fn writes_are_refused_once_the_lease_ends_without_an_observation() {
    let (cluster, _script, nodes) = setup(&[NodeId(1)]);
    let a = &nodes[0];
    cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    a.write().await.unwrap();
    let deadline = cluster.lease_deadline().unwrap();

    // The lease is cut short with no observation: the controller sleeps on
    // toward the old deadline, still a leader in its own eyes.
    cluster.expire(false);
    assert_eq!(a.role(), Role::Leader);
    assert_eq!(a.write().await, Err(DeviceError::LeaseExpired));
    assert_eq!(
        a.controller.device().flush().await,
        Err(DeviceError::LeaseExpired)
    );
    assert_eq!(a.controller.device().writable_until(), None);

    // At the old deadline the controller notices by itself and demotes.
    tokio::time::sleep_until(deadline).await;
    until("a demotes itself", || a.role() != Role::Leader).await;
    assert!(!a.controller.status().active);
}

#[tokio::test(start_paused = true)]
async fn a_renewed_lease_keeps_the_leader_writable() {
    let (cluster, _script, nodes) = setup(&[NodeId(1)]);
    let a = &nodes[0];
    cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    for _ in 0..10 {
        tokio::time::sleep(LEASE / 2).await;
        cluster.renew();
        a.write().await.unwrap();
        assert_eq!(a.role(), Role::Leader);
    }
    assert_eq!(a.controller.status().promotions, 1);
}

#[tokio::test(start_paused = true)]
async fn a_lease_that_runs_out_and_returns_leads_to_a_new_fence() {
    let (cluster, script, nodes) = setup(&[NodeId(1)]);
    let a = &nodes[0];
    let first = cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    cluster.set_deaf(NodeId(1), true);
    tokio::time::sleep(LEASE).await;
    until("a demotes itself", || a.role() != Role::Leader).await;
    let second = cluster.elect(NodeId(1)).unwrap();
    cluster.set_deaf(NodeId(1), false);
    until("a leads again", || {
        a.role() == Role::Leader && a.controller.status().term == second
    })
    .await;
    assert!(second > first);
    assert!(script.fenced(NodeId(1), second));
    assert_eq!(a.controller.device().open_term(), Some(second));
    assert_eq!(
        a.controller.status().prev_writer,
        Some(Writer {
            node: NodeId(1),
            term: first
        })
    );
}

/// One stint per term: a leader whose lease lapsed and then returned at the
/// same term (no new election) must not open its gate at that term again;
/// it resigns, and only a fresh term promotes it.
#[tokio::test(start_paused = true)]
async fn a_lease_that_lapses_and_returns_at_the_same_term_is_not_promoted_again() {
    let (cluster, script, nodes) = setup(&[NodeId(1), NodeId(2)]);
    let a = &nodes[0];
    let first = cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    a.write().await.unwrap();
    cluster.expire(false);
    until("a demotes itself", || a.role() != Role::Leader).await;
    cluster.renew();
    cluster.republish();
    until("a resigns for a fresh term", || cluster.resigns() == 1).await;
    assert_eq!(a.controller.status().spent_terms, 1);
    assert_eq!(a.controller.device().open_term(), None);
    assert!(a.write().await.is_err());
    assert_eq!(
        a.controller.status().promotions,
        1,
        "no second stint at {first}"
    );
    let second = cluster.elect(NodeId(1)).unwrap();
    until("a leads at the fresh term", || {
        a.controller.device().open_term() == Some(second)
    })
    .await;
    assert!(script.fenced(NodeId(1), second));
    a.write().await.unwrap();
    assert_eq!(a.engine.writes().last().map(|w| w.0), Some(second));
}

/// A sole voter has no one to hand over to and no other replica: when its
/// lease lapses and returns at the same term, it promotes again rather than
/// stay passive for good.
#[tokio::test(start_paused = true)]
async fn a_sole_voter_whose_lease_returns_at_the_same_term_writes_again() {
    let (cluster, _script, nodes) = setup(&[NodeId(1)]);
    let a = &nodes[0];
    let term = cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    cluster.expire(false);
    until("a demotes itself", || a.role() != Role::Leader).await;
    cluster.renew();
    cluster.republish();
    until("a leads again", || a.role() == Role::Leader).await;
    assert_eq!(a.controller.device().open_term(), Some(term));
    assert_eq!(cluster.resigns(), 0);
    a.write().await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_new_term_observed_while_leading_closes_the_gate_first() {
    let (cluster, script, nodes) = setup(&[NodeId(1)]);
    let a = &nodes[0];
    let first = cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    // Hold the next fence so the intermediate state can be seen.
    script.set(NodeId(1), FenceBehavior::Hang);
    cluster.expire(false);
    let second = cluster.elect(NodeId(1)).unwrap();
    until("a re-fencing", || a.role() == Role::FencePending).await;
    assert!(
        !a.controller.status().active,
        "the gate of term {first} closed"
    );
    script.set(NodeId(1), FenceBehavior::Succeed);
    until("a leads at the new term", || a.role() == Role::Leader).await;
    assert_eq!(a.controller.device().open_term(), Some(second));
}

#[tokio::test(start_paused = true)]
async fn demotion_with_writes_in_flight_refuses_new_writes_and_hangs_nothing() {
    let (cluster, _script, nodes) = setup(&[NodeId(1)]);
    let a = &nodes[0];
    let term = cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    a.engine.set_delay(Duration::from_millis(200));
    let device = a.controller.device();
    let in_flight: Vec<_> = (0..8u64)
        .map(|i| {
            let device = Arc::clone(&device);
            tokio::spawn(async move {
                device
                    .write_at(i * 512, Bytes::from_static(b"x"), false)
                    .await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    cluster.expire(true);
    until("a demoted", || a.role() == Role::Follower).await;
    assert_eq!(a.write().await, Err(DeviceError::NotLeader));
    for write in in_flight {
        // Each either finished under the old term or was refused; none hangs.
        match write.await.unwrap() {
            Ok(()) | Err(DeviceError::Inactive) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(a.engine.writes().iter().all(|(t, _)| *t == term));
    assert_eq!(a.engine.term(), None);
}

#[tokio::test(start_paused = true)]
async fn stop_is_idempotent_resigns_once_and_run_after_stop_is_refused() {
    let (cluster, _script, nodes) = setup(&[NodeId(1), NodeId(2)]);
    let a = &nodes.into_iter().next().unwrap();
    cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    a.controller.stop().await.unwrap();
    assert!(!a.controller.status().active);
    assert_eq!(a.role(), Role::Follower);
    assert_eq!(a.engine.term(), None);
    assert_eq!(cluster.resigns(), 1);
    assert_eq!(cluster.leader().0, None);
    a.controller.stop().await.unwrap();
    assert_eq!(cluster.resigns(), 1);
    assert_eq!(a.write().await, Err(DeviceError::NotLeader));
    assert_eq!(a.controller.run().await, Err(HaError::Stopped));
}

/// A planned hand-over (design C1): writes that passed the gate before it
/// closed all finish, successfully, before the transfer is asked for; no
/// write passes after; the target is the one asked for; and the old
/// leader does not promote again meanwhile.
#[tokio::test(start_paused = true)]
async fn a_hand_over_drains_the_writes_in_flight_before_it_transfers() {
    let (cluster, _script, nodes) = setup(&[NodeId(1), NodeId(2)]);
    let a = Arc::new(nodes.into_iter().next().unwrap());
    let term = cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    a.engine.set_delay(Duration::from_millis(200));
    let mut writes = Vec::new();
    for _ in 0..4 {
        let a = Arc::clone(&a);
        writes.push(tokio::spawn(async move {
            let outcome = a.write().await;
            (outcome, Instant::now())
        }));
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let handing = tokio::spawn({
        let a = Arc::clone(&a);
        async move { a.controller.hand_over(NodeId(2)).await }
    });
    until("the gate closed", || !a.controller.status().active).await;
    assert_eq!(a.write().await, Err(DeviceError::NotLeader));
    handing.await.unwrap().unwrap();
    let transfers = cluster.transfers();
    assert_eq!(transfers.len(), 1);
    let (to, asked_at) = transfers[0];
    assert_eq!(to, NodeId(2));
    for write in writes {
        let (outcome, finished_at) = write.await.unwrap();
        assert_eq!(outcome, Ok(()), "a write in flight was cut short");
        assert!(
            finished_at <= asked_at,
            "a write finished after the transfer"
        );
    }
    assert_eq!(a.engine.writes().len(), 4);
    assert!(a.engine.writes().iter().all(|(t, _)| *t == term));
    assert_eq!(a.role(), Role::Follower);
    assert_eq!(a.engine.term(), None);
}

/// A hand-over to the writer itself (a `transfer` to the node that
/// writes) is done at once: its gate stays open, no transfer is asked for,
/// and it keeps its term.
#[tokio::test(start_paused = true)]
async fn a_hand_over_to_the_writer_itself_leaves_it_writing() {
    let (cluster, _script, nodes) = setup(&[NodeId(1), NodeId(2)]);
    let a = nodes.into_iter().next().unwrap();
    let term = cluster.elect(NodeId(1)).unwrap();
    until("a writes", || a.controller.status().active).await;
    assert_eq!(a.controller.hand_over(NodeId(1)).await, Ok(()));
    assert!(cluster.transfers().is_empty());
    always("a keeps writing", Duration::from_millis(300), || {
        a.controller.status().active && a.role() == Role::Leader
    })
    .await;
    assert_eq!(a.write().await, Ok(()));
    assert!(a.engine.writes().iter().all(|(t, _)| *t == term));
}

/// A hand-over on a node that does not lead changes nothing and says so.
#[tokio::test(start_paused = true)]
async fn a_hand_over_by_a_follower_is_refused() {
    let (cluster, _script, nodes) = setup(&[NodeId(1), NodeId(2)]);
    let mut nodes = nodes.into_iter();
    let (a, b) = (nodes.next().unwrap(), nodes.next().unwrap());
    cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    assert_eq!(
        b.controller.hand_over(NodeId(1)).await,
        Err(HaError::NotLeader)
    );
    assert!(cluster.transfers().is_empty());
    always("a keeps leading", Duration::from_millis(300), || {
        a.role() == Role::Leader
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn the_run_loop_returns_stopped_after_stop() {
    let (cluster, script, nodes) = setup(&[NodeId(1)]);
    let a = nodes.into_iter().next().unwrap();
    script.set(NodeId(1), FenceBehavior::Hang);
    cluster.elect(NodeId(1)).unwrap();
    until("a fencing", || a.role() == Role::FencePending).await;
    a.controller.stop().await.unwrap();
    assert_eq!(a.run.await.unwrap(), Err(HaError::Stopped));
    assert!(!a.controller.status().active);
}

#[tokio::test(start_paused = true)]
async fn stop_while_following_returns_stopped_from_run() {
    let (_cluster, _script, nodes) = setup(&[NodeId(1)]);
    let a = nodes.into_iter().next().unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    a.controller.stop().await.unwrap();
    assert_eq!(a.run.await.unwrap(), Err(HaError::Stopped));
}

#[tokio::test(start_paused = true)]
async fn a_second_run_is_refused_while_one_runs() {
    let (_cluster, _script, nodes) = setup(&[NodeId(1)]);
    let a = &nodes[0];
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(a.controller.run().await, Err(HaError::AlreadyRunning));
}

#[tokio::test(start_paused = true)]
async fn reads_and_size_pass_while_passive() {
    let (_cluster, _script, nodes) = setup(&[NodeId(1)]);
    let device = nodes[0].controller.device();
    assert!(!device.is_open());
    assert_eq!(device.size(), 1 << 20);
    assert_eq!(
        device.read_at(0, 4).await.unwrap(),
        Bytes::from_static(&[0; 4])
    );
}

#[tokio::test(start_paused = true)]
async fn failures_after_the_fence_keep_the_node_passive_until_they_clear() {
    let (cluster, _script, nodes) = setup(&[NodeId(1)]);
    let a = &nodes[0];
    cluster.set_fail_prev_writer(true);
    cluster.elect(NodeId(1)).unwrap();
    until("a pending", || a.role() == Role::FencePending).await;
    always("no gate without the previous writer", LEASE / 4, || {
        !a.controller.status().active
    })
    .await;
    cluster.set_fail_prev_writer(false);
    cluster.set_fail_promotions(true);
    always("no gate without a recorded promotion", LEASE / 4, || {
        !a.controller.status().active
    })
    .await;
    assert_eq!(cluster.promoted(), None);
    cluster.set_fail_promotions(false);
    a.engine.set_fail_activate(true);
    always("no gate without an active engine", LEASE / 4, || {
        !a.controller.status().active
    })
    .await;
    assert_eq!(a.role(), Role::FencePending);
    a.engine.set_fail_activate(false);
    until("a leads", || a.role() == Role::Leader).await;
}

#[tokio::test(start_paused = true)]
async fn an_observed_leader_without_a_lease_waits_passively() {
    let (cluster, _script, nodes) = setup(&[NodeId(1)]);
    let a = &nodes[0];
    cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    // The lease ends with no notification, then an observation repeats the
    // old news: is_self from a stale broadcast must not reopen the gate.
    cluster.set_deaf(NodeId(1), true);
    cluster.expire(false);
    cluster.set_deaf(NodeId(1), false);
    until("a demoted", || a.role() != Role::Leader).await;
    always("a's gate stays closed", LEASE, || {
        !a.controller.status().active
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_closed_observation_stream_ends_run_with_the_gate_closed() {
    let (cluster, _script, nodes) = setup(&[NodeId(1)]);
    let a = nodes.into_iter().next().unwrap();
    cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    cluster.shut_down();
    assert!(matches!(a.run.await.unwrap(), Err(HaError::Coordinator(_))));
    assert!(!a.controller.status().active);
    assert_eq!(a.controller.status().role, Role::Follower);
}

#[tokio::test(start_paused = true)]
async fn a_stream_that_closes_during_a_fence_ends_run() {
    let (cluster, script, nodes) = setup(&[NodeId(1)]);
    let a = nodes.into_iter().next().unwrap();
    script.set(NodeId(1), FenceBehavior::Hang);
    cluster.elect(NodeId(1)).unwrap();
    until("a fencing", || a.role() == Role::FencePending).await;
    cluster.shut_down();
    assert!(matches!(a.run.await.unwrap(), Err(HaError::Coordinator(_))));
}

#[tokio::test(start_paused = true)]
async fn members_and_campaign_come_from_the_coordinator() {
    let (cluster, _script, nodes) = setup(&[NodeId(1), NodeId(2)]);
    let a = &nodes[0];
    assert_eq!(
        a.controller.members().await.unwrap(),
        vec![NodeId(1), NodeId(2)]
    );
    assert_eq!(a.coordinator.node_id(), NodeId(1));
    let campaign = tokio::spawn({
        let coordinator = Arc::clone(&nodes[1].coordinator);
        async move { coordinator.campaign().await }
    });
    assert!(cluster.elect(NodeId(2)).is_ok());
    campaign.await.unwrap().unwrap();
    // Only b may resign b's leadership.
    a.coordinator.resign().await.unwrap();
    assert_eq!(cluster.leader().0.as_ref(), Some(&NodeId(2)));
    assert!(
        cluster.elect(NodeId(1)).is_err(),
        "b's lease is still valid"
    );
    nodes[1].coordinator.resign().await.unwrap();
    assert_eq!(cluster.leader().0, None);
    assert!(
        cluster
            .elect(NodeId(99))
            .unwrap_err()
            .to_string()
            .contains("unknown node")
    );
    assert_eq!(Role::FencePending.as_str(), "fence_pending");
}

#[tokio::test(start_paused = true)]
async fn stop_during_activation_never_opens_the_gate() {
    let (cluster, _script, nodes) = setup(&[NodeId(1)]);
    let a = nodes.into_iter().next().unwrap();
    a.engine.set_activate_delay(Duration::from_millis(300));
    cluster.elect(NodeId(1)).unwrap();
    until("a fencing", || a.role() == Role::FencePending).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    a.controller.stop().await.unwrap();
    assert_eq!(a.run.await.unwrap(), Err(HaError::Stopped));
    assert!(!a.controller.status().active);
    assert_eq!(a.engine.term(), None);
}

#[tokio::test(start_paused = true)]
async fn the_default_configuration_promotes() {
    let cluster = FakeCluster::new(LEASE);
    let script = FenceScript::new();
    let engine = MemoryEngine::new(4096);
    let controller = Arc::new(Controller::new(
        engine,
        cluster.coordinator(NodeId(1)),
        script.fencer(NodeId(1)),
        ControllerConfig::default(),
    ));
    tokio::spawn({
        let controller = Arc::clone(&controller);
        async move { controller.run().await }
    });
    cluster.elect(NodeId(1)).unwrap();
    until("a leads", || controller.status().role == Role::Leader).await;
    let names: Vec<_> = [Role::Follower, Role::FencePending, Role::Leader]
        .iter()
        .map(|r| r.as_str())
        .collect();
    assert_eq!(names, ["follower", "fence_pending", "leader"]);
}

#[tokio::test(start_paused = true)]
async fn a_step_down_notice_for_a_newer_term_closes_the_gate() {
    let (cluster, _script, nodes) = setup(&[NodeId(1)]);
    let a = &nodes[0];
    let term = cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    a.controller.step_down(term);
    assert_eq!(
        a.role(),
        Role::Leader,
        "its own term is no reason to step down"
    );
    a.controller.step_down(term.next());
    assert_eq!(a.role(), Role::Follower);
    assert!(!a.controller.status().active);
    assert_eq!(a.write().await, Err(DeviceError::NotLeader));
}

/// Design C2: a write the engine cannot acknowledge only because the
/// in-sync set cannot take it now (too few members, a change of the set
/// that did not commit, a returning replica that failed it) is held and
/// tried again, and completes; any other error fails at once.
#[tokio::test(start_paused = true)]
async fn a_write_short_of_replicas_is_held_and_other_errors_are_not() {
    common::init_tracing();
    let cluster = FakeCluster::new(LEASE);
    let script = FenceScript::new();
    let a = Node::start_holding(&cluster, &script, NodeId(1), Duration::from_secs(30));
    let term = cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    a.engine.fail_next_writes([
        DeviceError::InsufficientReplicas { have: 1, need: 2 },
        DeviceError::InSyncCommit("no quorum for the entry".into()),
        DeviceError::Rejoining(NodeId(3)),
    ]);
    a.write().await.unwrap();
    assert_eq!(a.engine.writes(), vec![(term, 0)], "written once, at last");
    a.engine
        .fail_next_writes([DeviceError::Io("the disk failed".into())]);
    assert_eq!(
        a.write().await,
        Err(DeviceError::Io("the disk failed".into()))
    );
}

/// A write held short of replicas, then `bond`'s session or term gone, a
/// resend and a later write to the same block acknowledged: the held write
/// must never land after them (#36: it retried under whichever term was
/// open, and overwrote the later write).
async fn a_held_write_left_behind(lapse: impl AsyncFnOnce(&FakeCluster, &Node, &AtomicBool)) {
    common::init_tracing();
    let cluster = FakeCluster::new(LEASE);
    let script = FenceScript::new();
    let a = Node::start_holding(&cluster, &script, NodeId(1), Duration::from_secs(30));
    let term = cluster.elect(NodeId(1)).unwrap();
    until("a leads", || a.role() == Role::Leader).await;
    let device = a.controller.device();
    // Through the stack a node serves NBD from: metrics, read gate, gate.
    let local = MemoryCopy::new(vec![0; 1 << 20]);
    let read_gate = Arc::new(ReadGate::new(device.clone(), local));
    let metrics = Arc::new(replica_ha::metrics::DeviceMetrics::default());
    let served: Arc<dyn Device> = Arc::new(MeteredDevice::new(read_gate, metrics));
    let write = |data: &'static [u8]| Change::Write {
        offset: 0,
        data: Bytes::from_static(data),
        fua: false,
    };
    let ended = Arc::new(AtomicBool::new(false));
    let bond = {
        let ended = Arc::clone(&ended);
        Bond::session(Some(term), move || ended.load(Ordering::SeqCst))
    };
    a.engine.set_short(true);
    let w0 = tokio::spawn({
        let (served, write) = (served.clone(), write(b"old0"));
        async move { served.change(write, &bond).await }
    });
    until("W0 is held", || device.suspension().waiting == 1).await;
    lapse(&cluster, &a, &ended).await;
    let now = device.open_term().expect("the gate is open again");
    a.engine.set_short(false);
    let fresh = Bond::session(Some(now), || false);
    served.change(write(b"old0"), &fresh).await.unwrap();
    served.change(write(b"new2"), &fresh).await.unwrap();
    tokio::time::sleep(SUSPEND_RETRY * 4).await;
    assert_eq!(w0.await.unwrap(), Err(DeviceError::Abandoned));
    assert_eq!(
        &a.engine.read_at(0, 4).await.unwrap()[..],
        b"new2",
        "the held write landed after a later acknowledged one"
    );
}

#[tokio::test(start_paused = true)]
async fn a_held_write_is_abandoned_when_its_writer_is_elected_again_at_a_newer_term() {
    a_held_write_left_behind(async |cluster: &FakeCluster, a: &Node, _: &AtomicBool| {
        let before = a.controller.device().open_term();
        cluster.expire(true);
        cluster.elect(NodeId(1)).unwrap();
        until("a leads at a newer term", || {
            a.role() == Role::Leader && a.controller.device().open_term() > before
        })
        .await;
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn a_held_write_is_abandoned_when_its_session_ends_though_the_term_stays() {
    a_held_write_left_behind(
        async |cluster: &FakeCluster, _: &Node, ended: &AtomicBool| {
            // The lease lapses unobserved and is renewed: the gate stays open
            // at the same term, but the session saw the lapse and closed.
            cluster.expire(false);
            tokio::time::sleep(Duration::from_millis(5)).await;
            ended.store(true, Ordering::SeqCst);
            cluster.renew();
        },
    )
    .await;
}
