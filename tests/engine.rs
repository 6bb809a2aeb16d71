//! The engine over three real local stores, with injected replica faults.
//! S5: a write is acknowledged only when every member of the committed
//! in-sync set has it, the set has at least min_in_sync members, and any
//! shrink was committed first.

mod common;

#[test]
fn replica_states_have_stable_names() {
    let names: Vec<_> = [
        ReplicaState::InSync,
        ReplicaState::Degraded,
        ReplicaState::Rebuilding,
        ReplicaState::Offline,
    ]
    .iter()
    .map(|s| s.as_str())
    .collect();
    assert_eq!(names, ["in_sync", "degraded", "rebuilding", "offline"]);
}

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::{Fault, FaultyReplica, LoggingTracker, SHORT, SIZE, store};
use replica_ha::ha::InSyncTracker;
use replica_ha::ha::{ReplicaState, WriterEngine};
use replica_ha::ids::{NodeId, Term};
use replica_ha::replica::Replica;
use replica_ha::replica::mirror::engine::{Engine, EngineConfig};
use replica_ha::volume::{Device, DeviceError, MAX_REQUEST, RangeError};

const IDS: [NodeId; 3] = [NodeId(1), NodeId(2), NodeId(3)];

struct Rig {
    _dir: tempfile::TempDir,
    replicas: Vec<Arc<FaultyReplica>>,
    tracker: Arc<LoggingTracker>,
    events: Arc<Mutex<Vec<String>>>,
    engine: Arc<Engine>,
}

impl Rig {
    async fn new(min_in_sync: usize) -> Self {
        common::init_tracing();
        let dir = tempfile::tempdir().unwrap();
        let mut replicas = Vec::new();
        for id in IDS {
            replicas.push(FaultyReplica::new(id, store(dir.path(), id).await));
        }
        let events = Arc::new(Mutex::new(Vec::new()));
        let tracker = LoggingTracker::new(&IDS, Arc::clone(&events));
        let dyn_replicas: Vec<Arc<dyn Replica>> = replicas
            .iter()
            .map(|r| Arc::clone(r) as Arc<dyn Replica>)
            .collect();
        let engine = Engine::new(
            EngineConfig {
                local_id: NodeId(1),
                replica_timeout: SHORT,
                volume: replica_ha::volume::VolumeSpec::new("test", "vol0", SIZE, min_in_sync),
            },
            dyn_replicas,
            Arc::clone(&tracker) as Arc<dyn InSyncTracker>,
        )
        .unwrap();
        Rig {
            _dir: dir,
            replicas,
            tracker,
            events,
            engine: Arc::new(engine),
        }
    }

    async fn on(&self, i: usize, offset: u64, len: u64) -> Bytes {
        self.replicas[i].store().read(offset, len).await.unwrap()
    }

    /// The digests of every extent of replica `i`'s copy.
    async fn whole(&self, i: usize) -> (u64, Vec<[u8; 32]>) {
        self.replicas[i].store().digests(0, SIZE).await.unwrap()
    }

    /// The extents replica `i` holds S6 marks for, in order.
    fn marked(&self, i: usize) -> Vec<u64> {
        self.replicas[i]
            .store()
            .dirty_extents()
            .unwrap()
            .into_iter()
            .map(|m| m.extent)
            .collect()
    }

    async fn committed(&self) -> BTreeSet<NodeId> {
        self.tracker.in_sync().await.unwrap()
    }

    fn states(&self) -> Vec<ReplicaState> {
        self.engine.replicas().iter().map(|r| r.state).collect()
    }
}

fn block(byte: u8) -> Bytes {
    Bytes::from(vec![byte; 4096])
}

fn set(ids: &[NodeId]) -> BTreeSet<NodeId> {
    ids.iter().copied().collect()
}

#[tokio::test]
async fn writes_reach_every_replica_with_the_active_term() {
    let rig = Rig::new(2).await;
    assert_eq!(
        rig.engine.write_at(0, block(1), false).await,
        Err(DeviceError::Inactive)
    );
    assert_eq!(rig.engine.flush().await, Err(DeviceError::Inactive));
    rig.engine.activate(Term(7)).await.unwrap();
    assert_eq!(rig.engine.term(), Some(Term(7)));
    rig.engine.write_at(4096, block(9), true).await.unwrap();
    rig.engine.flush().await.unwrap();
    for i in 0..3 {
        assert_eq!(rig.on(i, 4096, 4096).await, block(9));
        assert_eq!(rig.replicas[i].store().floor().await, Term(7));
    }
    assert_eq!(rig.engine.read_at(4096, 4096).await.unwrap(), block(9));
    assert_eq!(rig.states(), vec![ReplicaState::InSync; 3]);
    assert!(rig.engine.replicas()[0].local);
    assert_eq!(rig.engine.size(), SIZE);
    rig.engine.deactivate();
    assert_eq!(
        rig.engine.write_at(0, block(1), false).await,
        Err(DeviceError::Inactive)
    );
}

#[tokio::test]
async fn a_failed_replica_is_dropped_by_a_commit_before_the_write_is_acknowledged() {
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(1)).await.unwrap();
    rig.replicas[1].set(Fault::Fail);
    rig.engine.write_at(0, block(5), false).await.unwrap();
    rig.events.lock().unwrap().push("ack".into());
    assert_eq!(*rig.events.lock().unwrap(), vec!["remove:n2", "ack"]);
    assert_eq!(rig.committed().await, set(&[NodeId(1), NodeId(3)]));
    assert_eq!(
        rig.states(),
        vec![
            ReplicaState::InSync,
            ReplicaState::Offline,
            ReplicaState::InSync
        ]
    );
    // Later writes skip n2 without another commit.
    rig.replicas[1].set(Fault::None);
    rig.engine.write_at(8192, block(6), false).await.unwrap();
    assert_eq!(rig.on(1, 8192, 4096).await, block(0));
    assert_eq!(rig.on(2, 8192, 4096).await, block(6));
    assert_eq!(rig.events.lock().unwrap().len(), 2);
}

#[tokio::test]
async fn a_replica_that_does_not_answer_counts_as_failed() {
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(1)).await.unwrap();
    rig.replicas[2].set(Fault::Hang);
    rig.engine.write_at(0, block(5), false).await.unwrap();
    assert_eq!(rig.committed().await, set(&[NodeId(1), NodeId(2)]));
}

#[tokio::test]
async fn too_few_replicas_fail_the_write_and_commit_nothing() {
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(1)).await.unwrap();
    rig.replicas[1].set(Fault::Fail);
    rig.replicas[2].set(Fault::Hang);
    assert_eq!(
        rig.engine.write_at(0, block(5), false).await,
        Err(DeviceError::InsufficientReplicas { have: 1, need: 2 })
    );
    assert_eq!(
        rig.engine.flush().await,
        Err(DeviceError::InsufficientReplicas { have: 1, need: 2 })
    );
    assert!(
        rig.events.lock().unwrap().is_empty(),
        "nothing may be committed"
    );
    assert_eq!(rig.committed().await, set(&IDS));
    assert_eq!(
        rig.states(),
        vec![
            ReplicaState::InSync,
            ReplicaState::Degraded,
            ReplicaState::Degraded
        ]
    );
    // When they answer again, writes are acknowledged on all three.
    rig.replicas[1].set(Fault::None);
    rig.replicas[2].set(Fault::None);
    rig.engine.write_at(0, block(6), false).await.unwrap();
    for i in 0..3 {
        assert_eq!(rig.on(i, 0, 4096).await, block(6));
    }
}

#[tokio::test]
async fn a_refused_in_sync_commit_fails_the_write() {
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(1)).await.unwrap();
    rig.tracker.inner.fail_removals(true);
    rig.replicas[1].set(Fault::Fail);
    assert!(matches!(
        rig.engine.write_at(0, block(5), false).await,
        Err(DeviceError::InSyncCommit(_))
    ));
    assert_eq!(rig.committed().await, set(&IDS));
}

#[tokio::test]
async fn a_stale_term_deactivates_the_engine_and_shrinks_nothing() {
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(3)).await.unwrap();
    rig.replicas[2].store().fence(Term(5)).await.unwrap();
    assert_eq!(
        rig.engine.write_at(0, block(5), false).await,
        Err(DeviceError::StaleTerm {
            term: Term(3),
            floor: Term(5)
        })
    );
    assert_eq!(rig.engine.term(), None);
    assert!(rig.events.lock().unwrap().is_empty());
    assert_eq!(rig.committed().await, set(&IDS));
    assert_eq!(rig.on(2, 0, 4096).await, block(0));
}

#[tokio::test]
async fn concurrent_failures_cannot_both_be_acknowledged() {
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(1)).await.unwrap();
    rig.replicas[1].set(Fault::FailWritesAt(0));
    rig.replicas[2].set(Fault::FailWritesAt(4096));
    let (a, b) = tokio::join!(
        rig.engine.write_at(0, block(1), false),
        rig.engine.write_at(4096, block(2), false)
    );
    assert_eq!(
        [a.is_ok(), b.is_ok()].iter().filter(|ok| **ok).count(),
        1,
        "{a:?} {b:?}"
    );
    let committed = rig.committed().await;
    assert_eq!(committed.len(), 2);
    // Every acknowledged write is on every committed member.
    let (offset, data) = if a.is_ok() {
        (0, block(1))
    } else {
        (4096, block(2))
    };
    for (i, id) in IDS.iter().enumerate() {
        if committed.contains(id) {
            assert_eq!(rig.on(i, offset, 4096).await, data);
        }
    }
}

#[tokio::test]
async fn a_committed_set_below_min_in_sync_acknowledges_nothing() {
    let rig = Rig::new(2).await;
    rig.tracker
        .inner
        .remove(Term(1), &set(&[NodeId(2), NodeId(3)]))
        .await
        .unwrap();
    rig.engine.activate(Term(2)).await.unwrap();
    assert_eq!(
        rig.engine.write_at(0, block(1), false).await,
        Err(DeviceError::InsufficientReplicas { have: 1, need: 2 })
    );
}

#[tokio::test]
async fn reads_prefer_the_local_replica_and_fall_back_to_in_sync_peers() {
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(1)).await.unwrap();
    rig.engine.write_at(0, block(3), false).await.unwrap();
    // Drop the local replica from the in-sync set.
    rig.replicas[0].set(Fault::Fail);
    rig.engine.write_at(4096, block(4), false).await.unwrap();
    assert_eq!(rig.committed().await, set(&[NodeId(2), NodeId(3)]));
    rig.replicas[0].set(Fault::None);
    assert_eq!(rig.engine.read_at(4096, 4096).await.unwrap(), block(4));
    // One in-sync peer fails a read: the next one serves it.
    rig.replicas[1].set(Fault::Fail);
    assert_eq!(rig.engine.read_at(4096, 4096).await.unwrap(), block(4));
    rig.replicas[2].set(Fault::Hang);
    assert!(matches!(
        rig.engine.read_at(0, 4096).await,
        Err(DeviceError::NoReadableReplica(_))
    ));
}

#[tokio::test]
async fn bad_requests_are_refused_before_any_replica_is_touched() {
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(1)).await.unwrap();
    assert!(matches!(
        rig.engine.write_at(SIZE - 512, block(1), false).await,
        Err(DeviceError::Range(RangeError::OutOfRange { .. }))
    ));
    assert!(matches!(
        rig.engine.read_at(0, MAX_REQUEST + 1).await,
        Err(DeviceError::Range(RangeError::TooLarge { .. }))
    ));
    for i in 0..3 {
        assert_eq!(rig.on(i, SIZE - 4096, 4096).await, block(0));
    }
}

#[tokio::test]
async fn invalid_configurations_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let a: Arc<dyn Replica> = FaultyReplica::new(NodeId(1), store(dir.path(), NodeId(1)).await);
    let b: Arc<dyn Replica> = FaultyReplica::new(NodeId(2), store(dir.path(), NodeId(2)).await);
    let tracker = Arc::new(replica_ha::ha::fake::MemoryInSync::new([
        NodeId(1),
        NodeId(2),
    ]));
    let config = |local: NodeId, min| EngineConfig {
        local_id: local,
        replica_timeout: Duration::from_secs(1),
        volume: replica_ha::volume::VolumeSpec::new("test", "vol0", SIZE, min),
    };
    let cases = [
        (
            config(NodeId(1), 1),
            vec![Arc::clone(&a), Arc::clone(&a)],
            "unique",
        ),
        (
            config(NodeId(26), 1),
            vec![Arc::clone(&a), Arc::clone(&b)],
            "local",
        ),
        (
            config(NodeId(1), 0),
            vec![Arc::clone(&a), Arc::clone(&b)],
            "min_in_sync",
        ),
        (
            config(NodeId(1), 3),
            vec![Arc::clone(&a), Arc::clone(&b)],
            "min_in_sync",
        ),
    ];
    for (config, replicas, what) in cases {
        let err = Engine::new(config, replicas, tracker.clone())
            .err()
            .expect(what);
        assert!(err.to_string().contains(what), "{err}");
    }
}

/// Drops n3 from the in-sync set through a failed write, then heals it.
async fn with_n3_out(rig: &Rig) {
    rig.engine.activate(Term(5)).await.unwrap();
    rig.replicas[2].set(Fault::Fail);
    rig.engine.write_at(0, block(1), false).await.unwrap();
    assert!(!rig.committed().await.contains(&NodeId(3)));
    rig.replicas[2].set(Fault::None);
}

#[tokio::test]
async fn a_rebuild_copies_differences_receives_new_writes_and_rejoins() {
    let rig = Rig::new(2).await;
    with_n3_out(&rig).await;
    rig.engine.write_at(8192, block(2), false).await.unwrap();
    let term = rig.engine.begin_rebuild(NodeId(3)).await.unwrap();
    assert_eq!(term, Term(5));
    let states = rig.engine.replicas();
    assert_eq!(states[2].state, ReplicaState::Rebuilding);
    // A write during the rebuild reaches the rebuilding replica too.
    rig.engine.write_at(1 << 20, block(3), false).await.unwrap();
    assert_eq!(rig.on(2, 1 << 20, 4096).await, block(3));
    let copied = rig.engine.copy_extent(NodeId(3), 0).await.unwrap();
    assert_eq!(copied, 1 << 20, "extent 0 differed and was copied whole");
    assert_eq!(
        rig.engine.copy_extent(NodeId(3), 1).await.unwrap(),
        0,
        "extent 1 was equal"
    );
    rig.engine.finish_rebuild(NodeId(3)).await.unwrap();
    assert!(rig.committed().await.contains(&NodeId(3)));
    assert_eq!(rig.on(2, 0, 16384).await, rig.on(0, 0, 16384).await);
    assert!(rig.events.lock().unwrap().iter().any(|e| e == "add:n3"));
}

#[tokio::test]
async fn a_write_the_rebuilding_replica_fails_keeps_it_out() {
    let rig = Rig::new(2).await;
    with_n3_out(&rig).await;
    rig.engine.begin_rebuild(NodeId(3)).await.unwrap();
    rig.replicas[2].set(Fault::Fail);
    // The write is acknowledged (n1, n2 in sync) but the rebuild is spoiled.
    rig.engine.write_at(4096, block(4), false).await.unwrap();
    rig.replicas[2].set(Fault::None);
    assert!(rig.engine.rebuild_failed(NodeId(3)));
    assert!(rig.engine.copy_extent(NodeId(3), 0).await.is_err());
    assert!(rig.engine.finish_rebuild(NodeId(3)).await.is_err());
    assert!(!rig.committed().await.contains(&NodeId(3)));
    assert!(
        !rig.events
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.starts_with("add:"))
    );
}

#[tokio::test]
async fn a_rebuild_does_not_survive_a_new_term() {
    let rig = Rig::new(2).await;
    with_n3_out(&rig).await;
    rig.engine.begin_rebuild(NodeId(3)).await.unwrap();
    rig.engine.deactivate();
    rig.engine.activate(Term(6)).await.unwrap();
    assert!(
        rig.engine.rebuild_failed(NodeId(3)),
        "the old term's rebuild is gone"
    );
    assert!(rig.engine.finish_rebuild(NodeId(3)).await.is_err());
    assert!(
        rig.engine.begin_rebuild(NodeId(1)).await.is_err(),
        "n1 is in sync"
    );
}

/// S5 across a join: the write W reaches the joining n3 and is held there
/// while n3's return commits; then n3 fails W. W may be acknowledged only
/// if every member of the set committed by then has it.
#[tokio::test]
async fn a_write_that_fails_on_a_replica_whose_return_just_committed_is_not_acknowledged_without_it()
 {
    let rig = Rig::new(2).await;
    with_n3_out(&rig).await;
    rig.engine.begin_rebuild(NodeId(3)).await.unwrap();
    for extent in 0..(SIZE >> 20) {
        rig.engine.copy_extent(NodeId(3), extent).await.unwrap();
    }
    let commit = rig.tracker.hold_adds();
    let finish = tokio::spawn({
        let engine = Arc::clone(&rig.engine);
        async move { engine.finish_rebuild(NodeId(3)).await }
    });
    // finish_rebuild is now waiting on the held commit, past its barrier.
    common::wait_until("the return is being committed", || {
        rig.engine.replicas()[2].state == ReplicaState::Rebuilding
    })
    .await;
    rig.replicas[2].set(Fault::HoldWrites { pass: false });
    let write = tokio::spawn({
        let engine = Arc::clone(&rig.engine);
        async move { engine.write_at(3 << 20, block(0x5a), false).await }
    });
    rig.replicas[2].wait_held(1).await;
    commit.add_permits(1);
    finish.await.unwrap().unwrap();
    assert!(rig.committed().await.contains(&NodeId(3)), "n3 returned");
    rig.replicas[2].release(1);
    let acked = write.await.unwrap();
    rig.replicas[2].set(Fault::None);
    if acked.is_ok() {
        for (i, id) in IDS.iter().enumerate() {
            if rig.committed().await.contains(id) {
                assert!(
                    rig.on(i, 3 << 20, 4096).await == block(0x5a),
                    "{id} is in the committed in-sync set but lacks an acknowledged write"
                );
            }
        }
    }
}

/// An engine (node 1, `min_in_sync`) over two faultable replicas and a
/// third, node 3, that can lose power; `in_sync` committed. Returns the
/// directory to keep, node 3, the tracker and the engine.
async fn power_cut_rig(
    in_sync: &[NodeId],
    min_in_sync: usize,
) -> (
    tempfile::TempDir,
    Arc<common::power::PowerCutReplica>,
    Arc<LoggingTracker>,
    Arc<Engine>,
) {
    use common::power::PowerCutReplica;
    common::init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let n1 = FaultyReplica::new(NodeId(1), store(dir.path(), NodeId(1)).await);
    let n2 = FaultyReplica::new(NodeId(2), store(dir.path(), NodeId(2)).await);
    let n3 = PowerCutReplica::new(NodeId(3), store(dir.path(), NodeId(3)).await).await;
    let replicas: Vec<Arc<dyn Replica>> = vec![n1, n2, n3.clone()];
    let tracker = LoggingTracker::new(in_sync, Arc::default());
    let engine = Engine::new(
        EngineConfig {
            local_id: NodeId(1),
            replica_timeout: SHORT,
            volume: replica_ha::volume::VolumeSpec::new("test", "vol0", SIZE, min_in_sync),
        },
        replicas,
        Arc::clone(&tracker) as Arc<dyn InSyncTracker>,
    )
    .unwrap();
    (dir, n3, tracker, Arc::new(engine))
}

/// S5 and S7 for a rebuild: copied extents are durable on the target before
/// its return is committed, so a power cut right after the return loses no
/// acknowledged byte.
#[tokio::test]
async fn a_rebuilt_replica_keeps_every_acknowledged_byte_through_a_power_cut() {
    use replica_ha::replica::mirror::resync::{ResyncConfig, Resyncer};
    let (_dir, n3, tracker, engine) = power_cut_rig(&[NodeId(1), NodeId(2)], 2).await;
    engine.activate(Term(3)).await.unwrap();
    let data = |i: u64| Bytes::from(vec![0x10 + i as u8; 64 << 10]);
    for i in 0..4u64 {
        engine.write_at(i << 20, data(i), false).await.unwrap();
    }
    engine.flush().await.unwrap();
    let resync = Resyncer::new(Arc::clone(&engine), ResyncConfig::default());
    let copied = resync
        .rebuild(&(n3.clone() as Arc<dyn Replica>))
        .await
        .unwrap();
    assert!(copied >= 4 << 20, "copied {copied}");
    assert!(tracker.in_sync().await.unwrap().contains(&NodeId(3)));
    n3.power_cut().await;
    for i in 0..4u64 {
        assert!(
            n3.store().read(i << 20, 64 << 10).await.unwrap() == data(i),
            "extent {i} on the returned replica lost acknowledged bytes in a power cut"
        );
    }
}

/// No late landing: W1 reaches n3 but is held there past the replica
/// timeout, so the engine never learns its outcome. The client then writes
/// W2 to the same block and it is acknowledged with n3 in the set; only then
/// is W1 released. No in-sync replica may end up holding W1.
#[tokio::test]
async fn a_write_the_engine_gave_up_on_never_lands_over_a_later_acknowledged_one() {
    let rig = Rig::new(3).await;
    rig.engine.activate(Term(4)).await.unwrap();
    rig.replicas[2].set(Fault::HoldWrites { pass: true });
    let w1 = rig.engine.write_at(0, block(0x01), false).await;
    assert!(w1.is_err(), "n3 cannot be dropped below min_in_sync 3");
    rig.replicas[2].set(Fault::None);
    rig.engine.write_at(0, block(0x02), false).await.unwrap();
    assert_eq!(rig.committed().await, set(&IDS));
    rig.replicas[2].release(1);
    let late = rig.replicas[2].late_outcomes(1).await;
    assert!(late[0].is_err(), "the disowned W1 was admitted: {late:?}");
    for (i, id) in IDS.iter().enumerate() {
        assert!(
            rig.on(i, 0, 4096).await == block(0x02),
            "{id} holds the disowned W1 over the acknowledged W2"
        );
    }
}

/// No late landing for a write whose caller gave up: W1 reaches n3 and is
/// held there, and its future is dropped (a client that disconnected, a
/// deadline). W2 to the same block is then acknowledged; when W1 is let go,
/// n3 must refuse it, not apply it over W2.
#[tokio::test]
async fn a_dropped_write_never_lands_over_a_later_acknowledged_one() {
    let rig = Rig::new(3).await;
    rig.engine.activate(Term(4)).await.unwrap();
    rig.replicas[2].set(Fault::HoldWrites { pass: true });
    {
        let w1 = rig.engine.write_at(0, block(0x01), false);
        tokio::pin!(w1);
        tokio::select! {
            _ = &mut w1 => panic!("W1 finished while held"),
            () = rig.replicas[2].wait_held(1) => {}
        }
        // W1 is dropped here, unanswered.
    }
    rig.replicas[2].set(Fault::None);
    rig.engine.write_at(0, block(0x02), false).await.unwrap();
    rig.replicas[2].release(1);
    let late = rig.replicas[2].late_outcomes(1).await;
    assert!(late[0].is_err(), "the dropped W1 was admitted: {late:?}");
    for (i, id) in IDS.iter().enumerate() {
        assert!(
            rig.on(i, 0, 4096).await == block(0x02),
            "{id} holds the dropped W1 over the acknowledged W2"
        );
    }
}

/// The same across a rebuild: W1 times out on n3, n3 is dropped, rebuilt
/// and returned; W1 must not land on it afterwards.
#[tokio::test]
async fn a_write_the_engine_gave_up_on_never_lands_on_the_rebuilt_replica() {
    use replica_ha::replica::mirror::resync::{ResyncConfig, Resyncer};
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(4)).await.unwrap();
    rig.replicas[2].set(Fault::HoldWrites { pass: true });
    rig.engine.write_at(0, block(0x01), false).await.unwrap();
    assert_eq!(rig.committed().await, set(&[NodeId(1), NodeId(2)]));
    rig.replicas[2].set(Fault::None);
    let replicas: Vec<Arc<dyn Replica>> = rig
        .replicas
        .iter()
        .map(|r| Arc::clone(r) as Arc<dyn Replica>)
        .collect();
    let resync = Resyncer::new(Arc::clone(&rig.engine), ResyncConfig::default());
    resync.rebuild(&replicas[2]).await.unwrap();
    rig.engine.write_at(0, block(0x02), false).await.unwrap();
    assert_eq!(rig.committed().await, set(&IDS));
    rig.replicas[2].release(1);
    let late = rig.replicas[2].late_outcomes(1).await;
    assert!(late[0].is_err(), "the disowned W1 was admitted: {late:?}");
    assert!(
        rig.on(2, 0, 4096).await == block(0x02),
        "the rebuilt n3 holds the disowned W1"
    );
}

/// A replaced node's copy leaves the in-sync set even at `min_in_sync` 3
/// of 3, and the engine's view with it (S5, S8): writes are then refused
/// as too few, never acknowledged by two, until the rebuild brings the
/// copy back. A node leaving the cluster is still refused there, and a
/// replace that would leave no copy to rebuild from is refused too.
#[tokio::test]
async fn a_replaced_copy_leaves_the_in_sync_set_below_min_in_sync_and_writes_wait() {
    use replica_ha::replica::mirror::engine::{Leaving, MembershipError};
    use replica_ha::replica::mirror::resync::{ResyncConfig, Resyncer};
    let rig = Rig::new(3).await;
    rig.engine.activate(Term(2)).await.unwrap();
    rig.engine.write_at(0, block(1), false).await.unwrap();
    assert!(matches!(
        rig.engine.leave_in_sync(NodeId(3), Leaving::Cluster).await,
        Err(MembershipError::TooFew {
            remaining: 2,
            need: 3
        })
    ));
    rig.engine
        .leave_in_sync(NodeId(3), Leaving::Replaced)
        .await
        .unwrap();
    let two = set(&[NodeId(1), NodeId(2)]);
    assert_eq!(rig.committed().await, two);
    assert_eq!(rig.engine.in_sync(), two, "the view follows the commit");
    assert_eq!(
        rig.engine.write_at(4096, block(2), false).await,
        Err(DeviceError::InsufficientReplicas { have: 2, need: 3 })
    );
    assert!(
        rig.on(2, 4096, 4096).await != block(2),
        "the write went to the replaced copy"
    );
    let resync = Resyncer::new(Arc::clone(&rig.engine), ResyncConfig::default());
    resync
        .rebuild(&(Arc::clone(&rig.replicas[2]) as Arc<dyn Replica>))
        .await
        .unwrap();
    assert_eq!(rig.committed().await, set(&IDS));
    rig.engine.write_at(4096, block(2), false).await.unwrap();
    assert_eq!(rig.on(2, 0, 4096).await, block(1), "rebuilt");

    let lone = Rig::new(1).await;
    lone.engine.activate(Term(2)).await.unwrap();
    for id in [NodeId(2), NodeId(3)] {
        lone.engine
            .leave_in_sync(id, Leaving::Replaced)
            .await
            .unwrap();
    }
    assert!(matches!(
        lone.engine
            .leave_in_sync(NodeId(1), Leaving::Replaced)
            .await,
        Err(MembershipError::TooFew {
            remaining: 0,
            need: 1
        })
    ));
}

/// A write in flight when a replaced copy leaves the in-sync set below
/// `min_in_sync` is not acknowledged, though every replica it went to took
/// it: the set that must hold it is now too small (S5).
#[tokio::test]
async fn a_write_in_flight_when_the_set_shrinks_below_min_in_sync_is_not_acknowledged() {
    use replica_ha::replica::mirror::engine::Leaving;
    let rig = Rig::new(3).await;
    rig.engine.activate(Term(2)).await.unwrap();
    rig.replicas[2].set(Fault::HoldWritesOf(0xab));
    let engine = Arc::clone(&rig.engine);
    let write = tokio::spawn(async move { engine.write_at(0, block(0xab), false).await });
    rig.replicas[2].wait_held(1).await;
    rig.engine
        .leave_in_sync(NodeId(3), Leaving::Replaced)
        .await
        .unwrap();
    rig.replicas[2].release(1);
    assert_eq!(
        write.await.unwrap(),
        Err(DeviceError::InsufficientReplicas { have: 2, need: 3 })
    );
}

/// A rebuild whose copy leaves the set for good while the rebuild
/// finishes (here, while it flushes the target) does not bring it back.
#[tokio::test]
async fn a_rebuild_abandoned_while_it_finishes_does_not_return_the_copy() {
    use replica_ha::replica::mirror::engine::{Leaving, RebuildError};
    let rig = Rig::new(1).await;
    rig.engine.activate(Term(2)).await.unwrap();
    rig.engine
        .leave_in_sync(NodeId(3), Leaving::Cluster)
        .await
        .unwrap();
    rig.engine.begin_rebuild(NodeId(3)).await.unwrap();
    rig.replicas[2].set(Fault::HoldFlushes);
    let engine = Arc::clone(&rig.engine);
    let finish = tokio::spawn(async move { engine.finish_rebuild(NodeId(3)).await });
    rig.replicas[2].wait_held(1).await;
    rig.engine
        .leave_in_sync(NodeId(3), Leaving::Cluster)
        .await
        .unwrap();
    rig.replicas[2].release(1);
    assert!(matches!(
        finish.await.unwrap(),
        Err(RebuildError::Abandoned(NodeId(3)))
    ));
    assert_eq!(rig.committed().await, set(&[NodeId(1), NodeId(2)]));
}

/// A replica that loses power (and with it a write it acknowledged but had
/// not flushed) and starts again is not counted on: at `min_in_sync` 3 of
/// 3 the flush after it is not acknowledged on the strength of its empty
/// copy, the copy leaves the in-sync set though that leaves two, and the
/// rebuild (which compares its marks) gives the write back before it
/// counts again. Without the session check the flush would be
/// acknowledged while the copy lacked the write (S5).
#[tokio::test]
async fn a_replica_that_restarted_is_not_counted_on_until_a_rebuild_compares_it() {
    use replica_ha::replica::mirror::resync::{ResyncConfig, Resyncer};
    let (_dir, n3, tracker, engine) = power_cut_rig(&IDS, 3).await;
    engine.activate(Term(3)).await.unwrap();
    engine.write_at(0, block(7), false).await.unwrap();
    n3.power_cut().await;
    n3.restart();
    assert!(n3.store().read(0, 4096).await.unwrap() != block(7));
    assert_eq!(
        engine.flush().await,
        Err(DeviceError::InsufficientReplicas { have: 2, need: 3 })
    );
    assert_eq!(
        tracker.in_sync().await.unwrap(),
        set(&[NodeId(1), NodeId(2)])
    );
    let resync = Resyncer::new(Arc::clone(&engine), ResyncConfig::default());
    resync
        .rebuild(&(n3.clone() as Arc<dyn Replica>))
        .await
        .unwrap();
    assert_eq!(tracker.in_sync().await.unwrap(), set(&IDS));
    assert_eq!(n3.store().read(0, 4096).await.unwrap(), block(7));
    engine.flush().await.unwrap();
}

/// S5 against the scrub: five nodes, in-sync {1, 4, 5}, and 4 and 5 lose
/// power with a write acknowledged and not flushed. Their old copies agree,
/// so by digests alone they would outvote node 1's good one and the scrub
/// would overwrite it (#36). A restarted copy is no vote and no source:
/// its digests and its reads both name its new session and fail, so node
/// 1 keeps the write, and the next flush drops the restarted copies.
/// (The digests' own check is shown over gRPC in `replica_grpc.rs`.)
#[tokio::test]
async fn a_scrub_never_outvotes_a_good_copy_with_restarted_ones() {
    use common::power::PowerCutReplica;
    use replica_ha::replica::mirror::scrub::{ScrubConfig, Scrubber};
    common::init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let mut replicas: Vec<Arc<dyn Replica>> = Vec::new();
    let mut cut = Vec::new();
    for id in [1, 2, 3].map(NodeId) {
        replicas.push(FaultyReplica::new(id, store(dir.path(), id).await));
    }
    for id in [4, 5].map(NodeId) {
        let replica = PowerCutReplica::new(id, store(dir.path(), id).await).await;
        cut.push(Arc::clone(&replica));
        replicas.push(replica);
    }
    let n1 = Arc::clone(&replicas[0]);
    let in_sync = [1, 4, 5].map(NodeId);
    let tracker = LoggingTracker::new(&in_sync, Arc::default());
    let engine = Arc::new(
        Engine::new(
            EngineConfig {
                local_id: NodeId(1),
                replica_timeout: SHORT,
                volume: replica_ha::volume::VolumeSpec::new("test", "vol0", SIZE, 2),
            },
            replicas,
            Arc::clone(&tracker) as Arc<dyn InSyncTracker>,
        )
        .unwrap(),
    );
    engine.activate(Term(3)).await.unwrap();
    engine.write_at(0, block(7), false).await.unwrap();
    for replica in &cut {
        replica.power_cut().await;
        replica.restart();
    }
    let scrubber = Scrubber::new(
        Arc::clone(&engine),
        ScrubConfig {
            rate: 0,
            keep_dir: None,
        },
    );
    let report = tokio::time::timeout(Duration::from_secs(30), scrubber.pass(0))
        .await
        .expect("the pass ends");
    assert!(
        report.findings.is_empty(),
        "the scrub judged by restarted copies: {:?}",
        report.findings
    );
    assert_eq!(n1.read(0, 4096).await.unwrap(), block(7));
    // The next flush drops the restarted copies, so the write is never
    // called durable without them rebuilt.
    assert!(engine.flush().await.is_err());
    assert_eq!(tracker.in_sync().await.unwrap(), set(&[NodeId(1)]));
}

/// First touches of extents that meet mark retirements that never stop
/// (as a writer's passes do under a sequential flood): every write is acknowledged and no copy leaves the in-sync
/// set. Before, a mark that overlapped retirements eight times failed the
/// write on that copy, and the writer dropped its own copy (#36).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retirements_overlapping_every_mark_cost_no_copy() {
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(3)).await.unwrap();
    let own = Arc::clone(rig.replicas[0].store());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let retiring = tokio::spawn({
        let stop = Arc::clone(&stop);
        async move {
            let mut passes = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let floor = own.floor_stamp().await;
                // Far from the stream; only the overlap matters.
                if own.retire_marks(floor, floor.term, &[15]).await.is_ok() {
                    passes += 1;
                }
                tokio::task::yield_now().await;
            }
            passes
        }
    });
    // Out of order, so no mark ahead spares a write its own mark.
    for extent in (0..15u64).map(|i| i * 7 % 15) {
        let offset = extent << 20;
        rig.engine
            .write_at(offset, Bytes::from(vec![9; 4096]), false)
            .await
            .unwrap_or_else(|err| panic!("the write at {offset} failed: {err}"));
    }
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(retiring.await.unwrap() > 15, "the retirements did not run");
    assert_eq!(
        rig.committed().await,
        set(&IDS),
        "a copy left the in-sync set"
    );
    assert_eq!(rig.states(), vec![ReplicaState::InSync; 3]);
}

/// S6 kept cheap: once a term's acknowledged writes are durable on every
/// in-sync replica, their marks are retired during the term; an extent
/// with an unacknowledged write stays marked for the next promotion.
#[tokio::test]
async fn marks_of_acknowledged_durable_writes_are_retired_during_the_term() {
    let rig = Rig::new(3).await;
    rig.engine.activate(Term(3)).await.unwrap();
    for extent in 0..8u64 {
        rig.engine
            .write_at(extent << 20, block(extent as u8 + 1), false)
            .await
            .unwrap();
    }
    rig.replicas[2].set(Fault::FailWritesAt(9 << 20));
    assert!(rig.engine.write_at(9 << 20, block(9), false).await.is_err());
    rig.replicas[2].set(Fault::None);
    let marks = |i: usize| rig.marked(i);
    assert_eq!(marks(0).len(), 9, "every written extent is marked first");
    // An extent is retired once it stayed idle for a whole pass: the first
    // pass after the writes keeps every mark, and a write meanwhile keeps
    // its extent's mark for another pass.
    assert_eq!(rig.engine.retire_marks().await.unwrap(), 0);
    assert_eq!(marks(0).len(), 9, "recently written extents stay marked");
    rig.engine
        .write_at(1 << 20, block(0x22), false)
        .await
        .unwrap();
    assert_eq!(rig.engine.retire_marks().await.unwrap(), 7);
    assert_eq!(marks(0), vec![1, 9], "the extent written again stays hot");
    assert_eq!(rig.engine.retire_marks().await.unwrap(), 1);
    assert_eq!(marks(0), vec![9], "the unacknowledged write stays marked");
    assert_eq!(marks(1), vec![9]);
    assert!(marks(2).is_empty(), "n3 never took the write to extent 9");
    // Nothing new; a new write marks its extent again.
    assert_eq!(rig.engine.retire_marks().await.unwrap(), 0);
    rig.engine.write_at(0, block(0x33), true).await.unwrap();
    assert_eq!(marks(0), vec![0, 9]);
    assert_eq!(rig.engine.retire_marks().await.unwrap(), 0);
    assert_eq!(rig.engine.retire_marks().await.unwrap(), 1);
    assert_eq!(marks(0), vec![9]);
}

/// A writer that settles before it hands over retires every mark of its
/// acknowledged writes at once, however recent (the next writer then
/// converges only what is unsure).
#[tokio::test]
async fn a_settling_writer_retires_its_recent_marks_at_once() {
    let rig = Rig::new(3).await;
    rig.engine.activate(Term(3)).await.unwrap();
    for extent in 0..4u64 {
        rig.engine
            .write_at(extent << 20, block(extent as u8 + 1), false)
            .await
            .unwrap();
    }
    assert_eq!(rig.engine.retire_all_marks().await.unwrap(), 4);
    for i in 0..3 {
        let marks = rig.replicas[i].store().dirty_extents().unwrap();
        assert!(marks.is_empty(), "replica {i} kept {marks:?}");
    }
}

/// S6 kept cheap for a sequential writer (issue 16, item 4): once its
/// writes run in order, the extents ahead of them are marked on every
/// replica in the background, so the first writes there find their extent
/// marked already; the marks of extents it never reached are retired once
/// they waited long enough for it.
#[tokio::test]
async fn a_sequential_writer_marks_ahead_and_its_unreached_marks_are_retired() {
    use replica_ha::replica::mirror::ahead::{AHEAD, AHEAD_PASSES};
    let rig = Rig::new(3).await;
    let marker = tokio::spawn(Arc::clone(&rig.engine).run_mark_ahead());
    rig.engine.activate(Term(3)).await.unwrap();
    let marks = |i: usize| rig.marked(i);
    for extent in 0..2u64 {
        rig.engine
            .write_at(extent << 20, block(extent as u8 + 1), false)
            .await
            .unwrap();
    }
    let extents = SIZE >> 20;
    let through = (1 + AHEAD).min(extents - 1);
    let expected: Vec<u64> = (0..=through).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while (0..3).any(|i| marks(i) != expected) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "extents 2..={through} were not marked ahead on every replica: {:?}",
            (0..3).map(marks).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The stream goes on into the marked extents; nothing else is marked.
    rig.engine.write_at(2 << 20, block(3), false).await.unwrap();
    for i in 0..3 {
        assert_eq!(marks(i), expected, "replica {i}");
    }
    // The written extents' marks are dropped once they stayed idle for a
    // whole pass; those the writer did not reach wait for it, and are
    // dropped after AHEAD_PASSES.
    assert_eq!(rig.engine.retire_marks().await.unwrap(), 0);
    assert_eq!(rig.engine.retire_marks().await.unwrap(), 3);
    let waiting: Vec<u64> = (3..=through).collect();
    for i in 0..3 {
        assert_eq!(marks(i), waiting, "replica {i}");
    }
    for _ in 2..AHEAD_PASSES - 1 {
        assert_eq!(rig.engine.retire_marks().await.unwrap(), 0);
    }
    assert_eq!(rig.engine.retire_marks().await.unwrap(), waiting.len());
    for i in 0..3 {
        assert!(marks(i).is_empty(), "replica {i} kept {:?}", marks(i));
    }
    marker.abort();
}

/// What a client was promised survives a power cut of every replica at
/// once: a write acknowledged with FUA, and a write followed by an
/// acknowledged flush, are on every disk. A write with neither may be lost;
/// the double does lose it, which shows that the test can see a loss.
#[tokio::test]
async fn acknowledged_fua_writes_and_flushed_writes_survive_a_power_cut_of_every_replica() {
    use common::power::PowerCutReplica;
    common::init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = Vec::new();
    for id in IDS {
        nodes.push(PowerCutReplica::new(id, store(dir.path(), id).await).await);
    }
    let replicas: Vec<Arc<dyn Replica>> = nodes
        .iter()
        .map(|r| Arc::clone(r) as Arc<dyn Replica>)
        .collect();
    let tracker = LoggingTracker::new(&IDS, Arc::default());
    let engine = Engine::new(
        EngineConfig {
            local_id: NodeId(1),
            replica_timeout: SHORT,
            volume: replica_ha::volume::VolumeSpec::new("test", "vol0", SIZE, 2),
        },
        replicas,
        Arc::clone(&tracker) as Arc<dyn InSyncTracker>,
    )
    .unwrap();
    engine.activate(Term(2)).await.unwrap();
    let (fua, flushed, loose) = (0, 1 << 20, 2 << 20);
    engine.write_at(flushed, block(0xf2), false).await.unwrap();
    engine.flush().await.unwrap();
    // After the flush, so that only its own FUA can make it durable.
    engine.write_at(fua, block(0xf1), true).await.unwrap();
    engine.write_at(loose, block(0xf3), false).await.unwrap();
    assert_eq!(tracker.in_sync().await.unwrap(), set(&IDS));
    for node in &nodes {
        node.power_cut().await;
    }
    for (node, id) in nodes.iter().zip(IDS) {
        let on = |offset| async move { node.store().read(offset, 4096).await.unwrap() };
        assert!(on(fua).await == block(0xf1), "{id} lost a FUA write");
        assert!(
            on(flushed).await == block(0xf2),
            "{id} lost a flushed write"
        );
        assert!(
            on(loose).await == vec![0; 4096],
            "{id} kept a write that was never made durable: the double cut nothing"
        );
    }
}

/// Membership at run time: a replica added to the set while writes flow is
/// rebuilt and joins the in-sync set; one removed while it is in sync has
/// its removal from the in-sync set committed before it leaves, and no
/// write is acknowledged without it before that. Every acknowledged write
/// is on every member of the committed in-sync set at the end.
#[tokio::test]
async fn the_replica_set_takes_a_member_in_and_lets_one_go_while_writes_flow() {
    use replica_ha::replica::mirror::engine::MembershipError;
    use replica_ha::replica::mirror::resync::{ResyncConfig, Resyncer};
    use replica_ha::replica::mirror::set::ReplicaSet;
    use std::sync::atomic::{AtomicBool, Ordering};
    common::init_tracing();
    // Nothing here injects a fault: a generous timeout keeps a loaded
    // machine from failing a replica.
    const PATIENT: Duration = Duration::from_secs(10);
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = Vec::new();
    for id in IDS {
        nodes.push(FaultyReplica::new(id, store(dir.path(), id).await));
    }
    let dyn_of = |i: usize| Arc::clone(&nodes[i]) as Arc<dyn Replica>;
    let members = Arc::new(ReplicaSet::new(NodeId(1), vec![dyn_of(0), dyn_of(1)]).unwrap());
    let events = Arc::new(Mutex::new(Vec::new()));
    let tracker = LoggingTracker::new(&[NodeId(1), NodeId(2)], Arc::clone(&events));
    let engine = Arc::new(
        Engine::over(
            EngineConfig {
                local_id: NodeId(1),
                replica_timeout: PATIENT,
                volume: replica_ha::volume::VolumeSpec::new("test", "vol0", SIZE, 2),
            },
            Arc::clone(&members),
            Arc::clone(&tracker) as Arc<dyn InSyncTracker>,
        )
        .unwrap(),
    );
    engine.activate(Term(2)).await.unwrap();

    // A client writes block after block until told to stop; every write
    // must be acknowledged.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = tokio::spawn({
        let (engine, stop, events) = (Arc::clone(&engine), Arc::clone(&stop), Arc::clone(&events));
        async move {
            let blocks = SIZE / 4096;
            let mut acked = Vec::new();
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let offset = (n % blocks) * 4096;
                let byte = (n / blocks % 250) as u8 + 1;
                engine.write_at(offset, block(byte), false).await.unwrap();
                events.lock().unwrap().push(format!("ack:{offset}"));
                acked.push((offset, byte));
                n += 1;
                tokio::task::yield_now().await;
            }
            acked
        }
    });
    let acks = |events: &Mutex<Vec<String>>| {
        let events = events.lock().unwrap();
        events.iter().filter(|e| e.starts_with("ack:")).count()
    };
    let wait_for_acks = |at_least: usize| {
        let events = Arc::clone(&events);
        async move {
            let deadline = tokio::time::Instant::now() + PATIENT;
            while acks(&events) < at_least {
                assert!(tokio::time::Instant::now() < deadline, "writes stopped");
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
    };
    wait_for_acks(50).await;

    // In: n3 joins the set while writes flow, is rebuilt, and returns.
    engine.add_replica(dyn_of(2)).await.unwrap();
    let resync = Resyncer::new(Arc::clone(&engine), ResyncConfig::default());
    let during = acks(&events);
    tokio::time::timeout(PATIENT * 3, resync.rebuild(&dyn_of(2)))
        .await
        .expect("the rebuild finishes")
        .unwrap();
    assert_eq!(tracker.in_sync().await.unwrap(), set(&IDS));
    assert!(acks(&events) > during, "no write flowed during the rebuild");
    // A second copy under an in-sync id is refused.
    assert!(matches!(
        engine.add_replica(dyn_of(2)).await,
        Err(MembershipError::InSync(_))
    ));

    // Out: n2 leaves while in sync; its removal is committed first.
    let acks_before = events.lock().unwrap().len();
    engine.remove_replica(NodeId(2)).await.unwrap();
    assert!(!members.ids().contains(&NodeId(2)));
    assert_eq!(
        tracker.in_sync().await.unwrap(),
        set(&[NodeId(1), NodeId(3)])
    );
    wait_for_acks(acks(&events) + 100).await;
    // Not below min_in_sync.
    assert!(matches!(
        engine.remove_replica(NodeId(3)).await,
        Err(MembershipError::TooFew { .. })
    ));
    stop.store(true, Ordering::SeqCst);
    let acked = writer.await.unwrap();
    {
        // The writer has one write in flight at a time: at most the one
        // sent before the removal began is acknowledged before the
        // removal's commit.
        let events = events.lock().unwrap();
        let after = &events[acks_before..];
        let removal = after.iter().position(|e| e == "remove:n2");
        let removal = removal.unwrap_or_else(|| panic!("no removal of n2: {after:?}"));
        let acks_first = after[..removal]
            .iter()
            .filter(|e| e.starts_with("ack:"))
            .count();
        assert!(
            acks_first <= 1,
            "{acks_first} writes were acknowledged before n2's removal: {after:?}"
        );
    }
    let mut last = BTreeMap::new();
    for (offset, byte) in acked {
        last.insert(offset, byte);
    }
    for i in [0, 2] {
        for (&offset, &byte) in &last {
            assert!(
                nodes[i].store().read(offset, 4096).await.unwrap() == block(byte),
                "{} lacks the acknowledged write at {offset}",
                IDS[i]
            );
        }
    }
}

/// The set edited behind the engine's back: an in-sync replica that
/// simply left the set counts as failed, so the next write commits its
/// removal before it is acknowledged (S5).
#[tokio::test]
async fn an_in_sync_replica_that_left_the_set_is_removed_before_the_next_ack() {
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(2)).await.unwrap();
    rig.engine.write_at(0, block(0x01), false).await.unwrap();
    rig.engine.replica_set().remove(NodeId(3)).unwrap();
    rig.engine.write_at(0, block(0x02), false).await.unwrap();
    assert_eq!(rig.committed().await, set(&[NodeId(1), NodeId(2)]));
    assert_eq!(
        rig.events.lock().unwrap().last().map(String::as_str),
        Some("remove:n3")
    );
}

/// The engine counts extents in the volume's extent size, the one its
/// stores use: with 256 KiB extents, a rebuild copies exactly the extents
/// that differ, and the rebuilt replica equals the others.
#[tokio::test]
async fn the_engine_counts_extents_in_the_volumes_extent_size() {
    use replica_ha::replica::disk::local::LocalReplica;
    use replica_ha::replica::disk::store::{ReplicaStore, StoreIdentity};
    use replica_ha::replica::mirror::resync::{ResyncConfig, Resyncer};
    use replica_ha::volume::VolumeSpec;
    common::init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let spec = VolumeSpec {
        extent_size: 256 << 10,
        ..VolumeSpec::new("test", "vol0", SIZE, 2)
    };
    let mut replicas: Vec<Arc<dyn Replica>> = Vec::new();
    for id in IDS {
        let store = ReplicaStore::open(dir.path().join(id.to_string()), StoreIdentity::from(&spec))
            .await
            .unwrap();
        replicas.push(Arc::new(LocalReplica::new(id, Arc::new(store))));
    }
    let tracker = LoggingTracker::new(&[NodeId(1), NodeId(2)], Arc::default());
    let engine = Arc::new(
        Engine::new(
            EngineConfig {
                local_id: NodeId(1),
                replica_timeout: SHORT,
                volume: spec.clone(),
            },
            replicas.clone(),
            Arc::clone(&tracker) as Arc<dyn InSyncTracker>,
        )
        .unwrap(),
    );
    assert_eq!(engine.extent_size(), spec.extent_size);
    engine.activate(Term(2)).await.unwrap();
    // Writes n3 misses: one in the fifth 256 KiB extent, one in the ninth.
    let offsets = [5 * (256 << 10) + 4096, 9 * (256 << 10)];
    for offset in offsets {
        engine.write_at(offset, block(0x5e), false).await.unwrap();
    }
    let resync = Resyncer::new(Arc::clone(&engine), ResyncConfig::default());
    let copied = resync.rebuild(&replicas[2]).await.unwrap();
    assert_eq!(copied, 2 * spec.extent_size, "copied {copied} bytes");
    for offset in offsets {
        assert!(replicas[2].read(offset, 4096).await.unwrap() == block(0x5e));
    }
}

/// One order (S11): two overlapping writes in flight at once end the same
/// on every replica, even when one replica receives the first one late
/// (as a request overtaken on the network would). Without the writer's
/// order, replica 2 would apply the second write and then the first, and
/// keep a different last write than the others, both acknowledged.
#[tokio::test]
async fn overlapping_writes_in_flight_end_the_same_on_every_replica() {
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(3)).await.unwrap();
    rig.replicas[1].set(Fault::DelayWritesOf(0xa1, Duration::from_millis(100)));
    // The first write is admitted first (join polls in order); the second
    // overlaps half of it.
    let (first, second) = tokio::join!(
        rig.engine.write_at(0, Bytes::from(vec![0xa1; 8192]), false),
        rig.engine.write_at(4096, block(0xb2), false),
    );
    first.unwrap();
    second.unwrap();
    for i in 0..3 {
        let (head, tail) = (rig.on(i, 0, 4096).await, rig.on(i, 4096, 4096).await);
        assert!(
            head == block(0xa1),
            "replica {}: the first write's head",
            i + 1
        );
        assert!(
            tail == block(0xb2),
            "replica {} kept {:#x} where the second write came last",
            i + 1,
            tail[0]
        );
    }
    // Writes that do not overlap are not held behind one that is stuck:
    // the second completes while the first is still held on replica 2.
    rig.replicas[1].set(Fault::HoldWritesOf(0xd4));
    let stuck = rig.engine.write_at(0, Bytes::from(vec![0xd4; 4096]), false);
    tokio::pin!(stuck);
    tokio::select! {
        _ = &mut stuck => panic!("the held write finished"),
        () = rig.replicas[1].wait_held(1) => {}
    }
    tokio::select! {
        _ = &mut stuck => panic!("the held write finished"),
        quick = rig.engine.write_at(65536, block(0xc3), false) => quick.unwrap(),
    }
    rig.replicas[1].release(1);
    stuck.await.unwrap();
}

/// A discard is a change like a write: stamped with the term and mirrored
/// to every in-sync replica (S2, S5), marked (S6), and it frees the space
/// on every replica while the range reads back as zeroes there.
#[tokio::test]
async fn a_discard_zeroes_the_range_and_frees_space_on_every_replica() {
    use std::os::unix::fs::MetadataExt;
    let rig = Rig::new(3).await;
    rig.engine.activate(Term(5)).await.unwrap();
    let mib = Bytes::from(vec![0x5a; 1 << 20]);
    rig.engine
        .write_at(2 << 20, mib.clone(), false)
        .await
        .unwrap();
    rig.engine.flush().await.unwrap();
    let file = |i: usize| rig._dir.path().join(IDS[i].to_string()).join("volume.img");
    let allocated = |i: usize| std::fs::metadata(file(i)).unwrap().blocks();
    let before: Vec<u64> = (0..3).map(allocated).collect();
    rig.engine.discard(2 << 20, 1 << 20).await.unwrap();
    rig.engine.flush().await.unwrap();
    for (i, before) in before.into_iter().enumerate() {
        assert!(
            rig.on(i, 2 << 20, 1 << 20).await.iter().all(|b| *b == 0),
            "replica {} reads zeroes",
            i + 1
        );
        let after = allocated(i);
        assert!(
            after + 2048 <= before,
            "replica {} freed the MiB: {before} -> {after} blocks",
            i + 1,
        );
        let marked: Vec<u64> = rig.replicas[i]
            .store()
            .dirty_extents()
            .unwrap()
            .iter()
            .map(|m| m.extent)
            .collect();
        assert!(marked.contains(&2), "the discarded extent is marked");
    }
    // Beyond the volume: refused, nothing changed.
    assert!(matches!(
        rig.engine.discard(SIZE - 4096, 8192).await,
        Err(DeviceError::Range(RangeError::OutOfRange { .. }))
    ));
}

/// A discard meets a fenced replica exactly as a write does: refused
/// (stale term), not applied, and the fenced writer stops.
#[tokio::test]
async fn a_discard_of_a_fenced_writer_is_refused_and_not_applied() {
    let rig = Rig::new(3).await;
    rig.engine.activate(Term(5)).await.unwrap();
    rig.engine.write_at(0, block(0x77), false).await.unwrap();
    rig.replicas[2].store().fence(Term(6)).await.unwrap();
    assert!(matches!(
        rig.engine.discard(0, 4096).await,
        Err(DeviceError::StaleTerm { .. })
    ));
    assert!(
        rig.on(2, 0, 4096).await == block(0x77),
        "the fenced replica did not apply the discard"
    );
    assert_eq!(rig.engine.term(), None, "the fenced writer deactivated");
}

/// A scrub repair while a replica is being rebuilt makes that rebuild start
/// over: it may have copied the extent from the copy the scrub then found
/// wrong, and the repair retires the extent's marks.
#[tokio::test]
async fn a_scrub_repair_makes_a_running_rebuild_start_over() {
    use std::os::unix::fs::FileExt;
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(4)).await.unwrap();
    // n3 leaves the in-sync set, then its rebuild begins and copies extent 0.
    rig.replicas[2].set(Fault::Fail);
    rig.engine.write_at(0, block(0x11), false).await.unwrap();
    assert_eq!(rig.committed().await, set(&[NodeId(1), NodeId(2)]));
    rig.replicas[2].set(Fault::None);
    rig.engine.begin_rebuild(NodeId(3)).await.unwrap();
    rig.engine.copy_extent(NodeId(3), 0).await.unwrap();
    assert!(!rig.engine.rebuild_failed(NodeId(3)));
    // n2's copy of extent 0 rots; the scrub repairs it.
    let path = rig._dir.path().join(IDS[1].to_string()).join("volume.img");
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.write_all_at(&[0xee; 64], 100).unwrap();
    let finding = rig
        .engine
        .scrub_extent(0)
        .await
        .unwrap()
        .expect("a difference");
    assert_eq!(finding.differing, vec![NodeId(2)]);
    assert!(finding.repaired);
    assert!(
        rig.engine.rebuild_failed(NodeId(3)),
        "the rebuild of n3 must compare again"
    );
}

/// A scrub pass with a replica that never answers ends, reporting the
/// extents it could not compare, instead of stalling on that replica.
#[tokio::test]
async fn a_scrub_pass_with_a_silent_replica_ends_and_reports_what_it_could_not_compare() {
    use replica_ha::replica::mirror::scrub::{ScrubConfig, Scrubber};
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(4)).await.unwrap();
    rig.replicas[1].set(Fault::Hang);
    let scrubber = Scrubber::new(
        Arc::clone(&rig.engine),
        ScrubConfig {
            rate: 0,
            keep_dir: None,
        },
    );
    let report = tokio::time::timeout(Duration::from_secs(30), scrubber.pass(0))
        .await
        .expect("the pass ends");
    let extents = SIZE.div_ceil(rig.engine.extent_size());
    assert_eq!((report.checked, report.unchecked), (0, extents));
    assert!(report.findings.is_empty());
    assert_eq!(scrubber.status().unchecked, extents);
}

#[tokio::test]
async fn a_resize_grows_every_in_sync_replica_before_the_size_is_committed_and_served() {
    use replica_ha::replica::mirror::engine::ResizeError;
    let rig = Rig::new(2).await;
    assert_eq!(
        rig.engine.resize(2 * SIZE).await,
        Err(ResizeError::Inactive)
    );
    rig.engine.activate(Term(5)).await.unwrap();
    let past_end = 2 * SIZE - 4096;
    assert!(matches!(
        rig.engine.write_at(past_end, block(1), false).await,
        Err(DeviceError::Range(RangeError::OutOfRange { .. }))
    ));
    assert_eq!(
        rig.engine.resize(SIZE - 512).await,
        Err(ResizeError::Shrink {
            now: SIZE,
            asked: SIZE - 512
        })
    );
    assert_eq!(
        rig.engine.resize(SIZE + 100).await,
        Err(ResizeError::Invalid(SIZE + 100))
    );
    // An in-sync replica that cannot grow: nothing is committed or served.
    rig.replicas[1].set(Fault::Fail);
    assert!(matches!(
        rig.engine.resize(2 * SIZE).await,
        Err(ResizeError::Replica {
            id: NodeId(2),
            now: SIZE,
            ..
        })
    ));
    assert_eq!(rig.tracker.volume_size().await.unwrap(), None);
    assert_eq!(rig.engine.size(), SIZE);
    rig.replicas[1].set(Fault::None);
    // A commit that is refused: the copies grew, the size served did not.
    rig.tracker.inner.fail_removals(true);
    assert!(matches!(
        rig.engine.resize(2 * SIZE).await,
        Err(ResizeError::Refused { now: SIZE, .. })
    ));
    assert_eq!(rig.engine.size(), SIZE);
    rig.tracker.inner.fail_removals(false);

    assert_eq!(rig.engine.resize(2 * SIZE).await, Ok(2 * SIZE));
    assert_eq!(rig.tracker.volume_size().await.unwrap(), Some(2 * SIZE));
    assert_eq!(rig.engine.size(), 2 * SIZE);
    for replica in &rig.replicas {
        assert_eq!(replica.store().size(), 2 * SIZE);
    }
    rig.engine
        .write_at(past_end, block(6), false)
        .await
        .unwrap();
    for i in 0..3 {
        assert_eq!(rig.on(i, past_end, 4096).await, block(6));
    }
    assert_eq!(rig.engine.resize(2 * SIZE).await, Ok(2 * SIZE));

    // Another engine over the same replicas (the next writer) serves the
    // committed size once active, not its configured one, larger or
    // smaller.
    let next = Engine::new(
        EngineConfig {
            local_id: NodeId(2),
            replica_timeout: SHORT,
            volume: replica_ha::volume::VolumeSpec::new("test", "vol0", 3 * SIZE, 2),
        },
        rig.replicas
            .iter()
            .map(|r| Arc::clone(r) as Arc<dyn Replica>)
            .collect(),
        Arc::clone(&rig.tracker) as Arc<dyn InSyncTracker>,
    )
    .unwrap();
    assert_eq!(next.size(), 3 * SIZE);
    next.activate(Term(6)).await.unwrap();
    assert_eq!(next.size(), 2 * SIZE);
    assert_eq!(next.read_at(past_end, 4096).await.unwrap(), block(6));
}

#[tokio::test]
async fn a_replica_that_missed_a_resize_grows_when_its_rebuild_begins() {
    let rig = Rig::new(2).await;
    with_n3_out(&rig).await;
    rig.engine.resize(2 * SIZE).await.unwrap();
    assert_eq!(rig.replicas[2].store().size(), SIZE, "n3 was out");
    let last = 2 * SIZE - 4096;
    rig.engine.write_at(last, block(8), false).await.unwrap();
    rig.engine.begin_rebuild(NodeId(3)).await.unwrap();
    assert_eq!(rig.replicas[2].store().size(), 2 * SIZE);
    let extent = last / rig.engine.extent_size();
    assert_eq!(
        rig.engine.copy_extent(NodeId(3), extent).await.unwrap(),
        1 << 20
    );
    rig.engine.finish_rebuild(NodeId(3)).await.unwrap();
    assert!(rig.committed().await.contains(&NodeId(3)));
    assert_eq!(rig.on(2, last, 4096).await, block(8));
}

/// A resize whose commit was not confirmed may have committed all the
/// same: a copy rebuilt afterwards grows to the committed size, not only to
/// the size this writer serves, so it holds every byte a later writer
/// serves.
#[tokio::test]
async fn a_rebuilt_replica_grows_to_a_committed_size_the_writer_does_not_serve_yet() {
    let rig = Rig::new(2).await;
    with_n3_out(&rig).await;
    // The commit landed; its answer did not reach the writer.
    rig.tracker.resize(Term(5), 2 * SIZE).await.unwrap();
    assert_eq!(rig.engine.size(), SIZE);
    rig.engine.begin_rebuild(NodeId(3)).await.unwrap();
    assert_eq!(rig.replicas[2].store().size(), 2 * SIZE);
    // A resize goes by the committed size too: one in between is a shrink,
    // and the committed one again is served once every copy has grown.
    assert_eq!(
        rig.engine.resize(SIZE + SIZE / 2).await,
        Err(replica_ha::replica::mirror::engine::ResizeError::Shrink {
            now: 2 * SIZE,
            asked: SIZE + SIZE / 2
        })
    );
    assert_eq!(rig.engine.resize(2 * SIZE).await, Ok(2 * SIZE));
    assert_eq!(rig.replicas[0].store().size(), 2 * SIZE);
}

/// A replica the committed in-sync set holds grows with a resize even if
/// this writer does not count it in sync (a return whose answer was lost).
#[tokio::test]
async fn a_resize_grows_every_replica_of_the_committed_set() {
    let rig = Rig::new(2).await;
    with_n3_out(&rig).await;
    rig.tracker.add(Term(5), &[NodeId(3)].into()).await.unwrap();
    rig.engine.resize(2 * SIZE).await.unwrap();
    assert_eq!(rig.replicas[2].store().size(), 2 * SIZE);
}

/// An in-sync replica the writer's set lacks cannot grow, so the resize
/// fails before anything is committed.
#[tokio::test]
async fn a_resize_fails_when_an_in_sync_replica_is_missing_from_the_set() {
    use replica_ha::replica::mirror::engine::ResizeError;
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(5)).await.unwrap();
    rig.engine.replica_set().remove(NodeId(3)).unwrap();
    assert_eq!(
        rig.engine.resize(2 * SIZE).await,
        Err(ResizeError::Missing {
            id: NodeId(3),
            now: SIZE
        })
    );
    assert_eq!(rig.tracker.volume_size().await.unwrap(), None);
    assert_eq!(rig.engine.size(), SIZE);
}

#[tokio::test]
async fn a_replica_being_rebuilt_grows_with_the_resize() {
    let rig = Rig::new(2).await;
    with_n3_out(&rig).await;
    rig.engine.begin_rebuild(NodeId(3)).await.unwrap();
    rig.engine.resize(2 * SIZE).await.unwrap();
    assert_eq!(rig.replicas[2].store().size(), 2 * SIZE);
    // It takes the writes past the old end like the in-sync ones.
    rig.engine
        .write_at(2 * SIZE - 4096, block(4), false)
        .await
        .unwrap();
    assert!(!rig.engine.rebuild_failed(NodeId(3)));
    assert_eq!(rig.on(2, 2 * SIZE - 4096, 4096).await, block(4));
    assert_eq!(rig.engine.copy_extent(NodeId(3), 0).await.unwrap(), 1 << 20);
    rig.engine.finish_rebuild(NodeId(3)).await.unwrap();
    assert!(rig.committed().await.contains(&NodeId(3)));
}

/// #21: a follower that missed a few writes is rebuilt from the
/// missed-write map: the rebuild compares and copies those extents (and the
/// one in flight when it left), not the volume, and its copy then equals
/// the others everywhere. Once it is back, the map is closed.
#[tokio::test]
async fn a_rebuild_copies_what_the_missed_write_map_names() {
    use replica_ha::replica::mirror::resync::{ResyncConfig, Resyncer};
    let rig = Rig::new(2).await;
    with_n3_out(&rig).await;
    let mib = rig.engine.extent_size();
    for extent in [3, 5] {
        rig.engine
            .write_at(extent * mib + 8192, block(7), false)
            .await
            .unwrap();
    }
    for i in 0..2 {
        let map = rig.replicas[i]
            .store()
            .missed(NodeId(3), 0)
            .unwrap()
            .unwrap();
        assert_eq!(map.extents, vec![0, 3, 5], "n{}'s map", i + 1);
    }
    let resync = Resyncer::new(Arc::clone(&rig.engine), ResyncConfig::default());
    let target = Arc::clone(&rig.replicas[2]) as Arc<dyn Replica>;
    assert_eq!(resync.rebuild(&target).await.unwrap(), 3 * mib);
    let progress = resync.progress()[&NodeId(3)];
    assert!(!progress.full);
    assert_eq!((progress.done, progress.total), (3 * mib, 3 * mib));
    assert!(rig.committed().await.contains(&NodeId(3)));
    assert_eq!(rig.whole(2).await, rig.whole(0).await);
    for i in 0..2 {
        assert_eq!(rig.replicas[i].store().missed(NodeId(3), 0).unwrap(), None);
    }
}

/// #21: a source without a map of the target (it never opened one) means a
/// full rebuild, which compares every extent.
#[tokio::test]
async fn without_a_missed_write_map_the_rebuild_compares_every_extent() {
    use replica_ha::replica::mirror::resync::{ResyncConfig, Resyncer};
    let rig = Rig::new(2).await;
    with_n3_out(&rig).await;
    rig.engine
        .write_at(SIZE - 4096, block(7), false)
        .await
        .unwrap();
    for i in 0..2 {
        rig.replicas[i]
            .store()
            .close_missed(
                replica_ha::replica::Stamp {
                    term: Term(5),
                    generation: 1,
                },
                NodeId(3),
            )
            .await
            .unwrap();
    }
    let resync = Resyncer::new(Arc::clone(&rig.engine), ResyncConfig::default());
    let target = Arc::clone(&rig.replicas[2]) as Arc<dyn Replica>;
    resync.rebuild(&target).await.unwrap();
    let progress = resync.progress()[&NodeId(3)];
    assert!(progress.full);
    assert_eq!(progress.total, SIZE);
    assert_eq!(rig.whole(2).await, rig.whole(0).await);
}

/// A write that reached the replica being rebuilt and one in-sync copy but
/// not the source is not acknowledged; its repair makes the in-sync copies
/// agree on the source's bytes. The target still holds the undone write,
/// and its rebuild may have compared the extent before: it must not
/// return so, and the next attempt compares the extent again.
#[tokio::test]
async fn a_repair_of_an_unacknowledged_write_makes_a_running_rebuild_start_over() {
    let rig = Rig::new(2).await;
    with_n3_out(&rig).await;
    let mib = rig.engine.extent_size();
    let extent = 4;
    rig.engine.begin_rebuild(NodeId(3)).await.unwrap();
    rig.engine.copy_extent(NodeId(3), extent).await.unwrap();
    rig.replicas[0].set(Fault::FailWritesAt(extent * mib));
    let outcome = rig.engine.write_at(extent * mib, block(0x4e), false).await;
    assert!(outcome.is_err(), "{outcome:?}");
    rig.replicas[0].set(Fault::None);
    assert_eq!(rig.on(2, extent * mib, 4096).await, block(0x4e));
    assert_eq!(rig.engine.repair_unsure().await.unwrap(), 1);
    assert_eq!(
        rig.on(1, extent * mib, 4096).await,
        rig.on(0, extent * mib, 4096).await
    );
    assert!(rig.engine.finish_rebuild(NodeId(3)).await.is_err());
    assert!(!rig.committed().await.contains(&NodeId(3)));
    rig.engine.begin_rebuild(NodeId(3)).await.unwrap();
    let plan = rig.engine.missed_plan(NodeId(3)).await.unwrap().unwrap();
    assert!(plan.extents.contains(&extent), "{plan:?}");
    for extent in plan.extents {
        rig.engine.copy_extent(NodeId(3), extent).await.unwrap();
    }
    rig.engine.finish_rebuild(NodeId(3)).await.unwrap();
    assert_eq!(rig.whole(2).await, rig.whole(0).await);
}

/// A rig (`min_in_sync` 2) with n3 out of the in-sync set and no map of
/// it anywhere: its rebuild is a full one.
async fn with_n3_out_and_no_map() -> Rig {
    let rig = Rig::new(2).await;
    with_n3_out(&rig).await;
    let stamp = replica_ha::replica::Stamp {
        term: Term(5),
        generation: 1,
    };
    for keeper in &rig.replicas[..2] {
        keeper.store().close_missed(stamp, NodeId(3)).await.unwrap();
    }
    rig
}

/// #21, resume: a full rebuild interrupted by a writer change goes on
/// from where it had verified, not from the first extent. What it had
/// verified stays covered: a write there afterwards (here one that fails
/// on the target, so the first writer abandons the rebuild) is in the map,
/// and the next writer compares it again.
#[tokio::test]
async fn a_full_rebuild_resumes_on_the_next_writer_where_it_had_verified() {
    use replica_ha::replica::mirror::resync::{ResyncConfig, Resyncer};
    let rig = with_n3_out_and_no_map().await;
    let mib = rig.engine.extent_size();
    let extents = SIZE / mib;
    for extent in [1, 9, extents - 2] {
        rig.engine
            .write_at(extent * mib, block(9), false)
            .await
            .unwrap();
    }
    rig.engine.begin_rebuild(NodeId(3)).await.unwrap();
    assert_eq!(rig.engine.missed_plan(NodeId(3)).await.unwrap(), None);
    rig.engine
        .begin_full_rebuild(NodeId(3), Term(5))
        .await
        .unwrap();
    let verified = 8;
    for extent in 0..verified {
        rig.engine.copy_extent(NodeId(3), extent).await.unwrap();
    }
    rig.engine
        .verified_below(NodeId(3), Term(5), verified)
        .await
        .unwrap();
    for i in 0..2 {
        let map = rig.replicas[i].store().missed(NodeId(3), 0).unwrap();
        assert_eq!(map.unwrap().unverified_from, Some(verified), "n{}", i + 1);
    }
    // A write to a verified extent that fails on the target: the rebuild
    // is abandoned, the write acknowledged by n1 and n2, and recorded.
    rig.replicas[2].set(Fault::Fail);
    rig.engine
        .write_at(2 * mib, block(0x22), false)
        .await
        .unwrap();
    rig.replicas[2].set(Fault::None);

    // The writer changes.
    let next = Arc::new(
        Engine::new(
            EngineConfig {
                local_id: NodeId(2),
                replica_timeout: SHORT,
                volume: replica_ha::volume::VolumeSpec::new("test", "vol0", SIZE, 2),
            },
            rig.replicas
                .iter()
                .map(|r| Arc::clone(r) as Arc<dyn Replica>)
                .collect(),
            Arc::clone(&rig.tracker) as Arc<dyn InSyncTracker>,
        )
        .unwrap(),
    );
    next.activate(Term(6)).await.unwrap();
    next.begin_rebuild(NodeId(3)).await.unwrap();
    let plan = next.missed_plan(NodeId(3)).await.unwrap().unwrap();
    assert_eq!(plan.unverified_from, Some(verified));
    assert!(plan.extents.contains(&2), "{plan:?}");
    assert!(plan.extents.iter().all(|e| *e < verified), "{plan:?}");
    next.abort_rebuild(NodeId(3));
    let resync = Resyncer::new(Arc::clone(&next), ResyncConfig::default());
    let target = Arc::clone(&rig.replicas[2]) as Arc<dyn Replica>;
    resync.rebuild(&target).await.unwrap();
    let progress = resync.progress()[&NodeId(3)];
    assert!(progress.full);
    // The rest of the pass and what the map named: less than a whole pass.
    assert_eq!(
        progress.total,
        plan.extents.len() as u64 * mib + (extents - verified) * mib
    );
    assert!(progress.total < SIZE);
    assert!(rig.committed().await.contains(&NodeId(3)));
    assert_eq!(rig.whole(2).await, rig.whole(0).await);
    assert_eq!(rig.whole(2).await, rig.whole(1).await);
    for i in 0..3 {
        assert_eq!(rig.replicas[i].store().missed(NodeId(3), 0).unwrap(), None);
    }
}

/// #21, resume: a full pass runs its steps' copies side by side, but
/// records as verified only what lies below every copy still running. Here
/// the copy of the first extents is held on the target while the later
/// steps are compared and copied: the range must stay at 0, or a writer
/// change would skip extents that were never copied.
#[tokio::test]
async fn a_full_pass_records_as_verified_only_what_all_its_copies_reached() {
    use replica_ha::replica::mirror::resync::{ResyncConfig, Resyncer};
    let rig = with_n3_out_and_no_map().await;
    let mib = rig.engine.extent_size();
    let extents = SIZE / mib;
    // Every extent holds data; the first begins with the byte held.
    for extent in 0..extents {
        let byte = if extent == 0 { 0xab } else { 9 };
        rig.engine
            .write_at(extent * mib, block(byte), false)
            .await
            .unwrap();
    }
    rig.replicas[2].set(Fault::HoldWritesOf(0xab));
    // Copies side by side, as when no client writes.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while rig.engine.clients_writing(Duration::from_millis(100)) {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let step = 4;
    let resync = Arc::new(Resyncer::new(
        Arc::clone(&rig.engine),
        ResyncConfig {
            step_extents: step,
            raise_every: Duration::ZERO,
            ..ResyncConfig::default()
        },
    ));
    let rebuilding = tokio::spawn({
        let resync = Arc::clone(&resync);
        let target = Arc::clone(&rig.replicas[2]) as Arc<dyn Replica>;
        async move { resync.rebuild(&target).await }
    });
    // Every step but the first is copied.
    let rest = (extents - step) * mib;
    loop {
        let copied = resync.progress().get(&NodeId(3)).map_or(0, |p| p.copied);
        if copied >= rest {
            break;
        }
        assert!(!rebuilding.is_finished(), "{:?}", rebuilding.await);
        assert!(
            tokio::time::Instant::now() < deadline,
            "copied {copied} of {rest}: {:?}",
            resync.progress()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for i in 0..2 {
        let map = rig.replicas[i].store().missed(NodeId(3), 0).unwrap();
        assert_eq!(
            map.unwrap().unverified_from,
            Some(0),
            "n{}: raised past a copy still running",
            i + 1
        );
    }
    rig.replicas[2].release(1);
    rebuilding.await.unwrap().unwrap();
    assert!(rig.committed().await.contains(&NodeId(3)));
    assert_eq!(rig.whole(2).await, rig.whole(0).await);
}

/// Invariant M: a replica being rebuilt keeps its older terms' marks until
/// its rebuild has compared them. Here a dead writer's write reached only
/// n3 (marked there), and a scrub repair of that extent on n2 makes the
/// writer retire its marks meanwhile: n3's mark must survive, or the
/// rebuild (which compares the map and n3's own marks) would keep n3's
/// unacknowledged bytes.
#[tokio::test]
async fn a_rebuilding_replica_keeps_its_older_marks_until_its_rebuild_compared_them() {
    let rig = Rig::new(2).await;
    with_n3_out(&rig).await;
    let mib = rig.engine.extent_size();
    let extent = 6;
    rig.replicas[2]
        .store()
        .write(Term(4), extent * mib, block(0xd4), true)
        .await
        .unwrap();
    rig.engine.begin_rebuild(NodeId(3)).await.unwrap();
    // n2's copy of the extent went bad; the scrub repairs it from n1.
    let current = replica_ha::replica::Stamp {
        term: Term(5),
        generation: 1,
    };
    rig.replicas[1]
        .store()
        .write(current, extent * mib, block(0xee), true)
        .await
        .unwrap();
    let finding = rig.engine.scrub_extent(extent).await.unwrap().unwrap();
    assert!(finding.repaired);
    rig.engine.retire_marks().await.unwrap();
    // The repair spoiled the running rebuild; the next attempt begins.
    rig.engine.begin_rebuild(NodeId(3)).await.unwrap();
    let plan = rig.engine.missed_plan(NodeId(3)).await.unwrap().unwrap();
    assert_eq!(plan.unverified_from, None);
    let plan = plan.extents;
    assert!(
        plan.contains(&extent),
        "n3's own mark is in the plan: {plan:?}"
    );
    for e in plan {
        rig.engine.copy_extent(NodeId(3), e).await.unwrap();
    }
    rig.engine.finish_rebuild(NodeId(3)).await.unwrap();
    assert_eq!(
        rig.on(2, extent * mib, 4096).await,
        rig.on(0, extent * mib, 4096).await
    );
}

/// #21: a rebuild yields to clients: the engine says clients are writing
/// from a write's start until it has been quiet for the window asked.
#[tokio::test]
async fn the_engine_knows_when_clients_write() {
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(5)).await.unwrap();
    let window = Duration::from_millis(50);
    assert!(!rig.engine.clients_writing(window), "no write yet");
    rig.engine.write_at(0, block(1), false).await.unwrap();
    assert!(rig.engine.clients_writing(Duration::from_secs(60)));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while rig.engine.clients_writing(window) {
        assert!(tokio::time::Instant::now() < deadline, "still writing");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    rig.engine.discard(0, 4096).await.unwrap();
    assert!(
        rig.engine.clients_writing(Duration::from_secs(60)),
        "a discard is a write"
    );
}

/// A write held below `min_in_sync` (the gate tries it again every 50 ms)
/// is refused before it touches anything: it leaves no unsure extent,
/// whose repair would spoil the rebuild that brings the in-sync set back
/// (seen in the chaos campaign as writes held for good), and it does not
/// make the rebuild yield.
#[tokio::test]
async fn a_write_below_min_in_sync_touches_nothing_and_spoils_no_rebuild() {
    let rig = Rig::new(2).await;
    with_n3_out(&rig).await;
    // A new writer's fencer could not reach n2 and dropped it: below
    // min_in_sync, as a promotion may leave it.
    rig.engine.deactivate();
    let n2: BTreeSet<NodeId> = [NodeId(2)].into();
    rig.tracker.remove(Term(6), &n2).await.unwrap();
    rig.engine.activate(Term(6)).await.unwrap();
    assert_eq!(rig.committed().await, [NodeId(1)].into());
    let quiet = Duration::from_millis(50);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while rig.engine.clients_writing(quiet) {
        assert!(tokio::time::Instant::now() < deadline);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    rig.engine.begin_rebuild(NodeId(2)).await.unwrap();
    for _ in 0..3 {
        assert!(matches!(
            rig.engine.write_at(2 << 20, block(3), false).await,
            Err(DeviceError::InsufficientReplicas { have: 1, need: 2 })
        ));
    }
    assert_eq!(
        rig.engine.repair_unsure().await.unwrap(),
        0,
        "nothing unsure"
    );
    assert!(
        !rig.engine.clients_writing(quiet),
        "a held write is no client load"
    );
    assert!(!rig.engine.rebuild_failed(NodeId(2)));
    for extent in 0..(SIZE / rig.engine.extent_size()) {
        rig.engine.copy_extent(NodeId(2), extent).await.unwrap();
    }
    rig.engine.finish_rebuild(NodeId(2)).await.unwrap();
    rig.engine.write_at(2 << 20, block(3), false).await.unwrap();
    assert_eq!(rig.on(1, 2 << 20, 4096).await, block(3));
}

/// An inactive engine says so first, even below `min_in_sync`: the NBD
/// server ends the session on `Inactive`, while the gate would hold and
/// retry a write refused for too few replicas.
#[tokio::test]
async fn an_inactive_engine_refuses_as_inactive_below_min_in_sync() {
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(5)).await.unwrap();
    rig.engine.deactivate();
    let n2: BTreeSet<NodeId> = [NodeId(2), NodeId(3)].into();
    rig.tracker.remove(Term(6), &n2).await.unwrap();
    rig.engine.activate(Term(6)).await.unwrap();
    assert!(matches!(
        rig.engine.write_at(0, block(1), false).await,
        Err(DeviceError::InsufficientReplicas { have: 1, need: 2 })
    ));
    rig.engine.deactivate();
    assert!(matches!(
        rig.engine.write_at(0, block(1), false).await,
        Err(DeviceError::Inactive)
    ));
}

/// #21: a removed member's map is closed on every replica that kept it,
/// by the writer's resyncer once the membership no longer names it; a
/// member's map is left alone.
#[tokio::test]
async fn a_removed_members_map_is_closed_and_a_members_map_kept() {
    use replica_ha::replica::mirror::resync::{ResyncConfig, Resyncer};
    let rig = Rig::new(2).await;
    with_n3_out(&rig).await;
    rig.engine
        .write_at(SIZE - 4096, block(7), false)
        .await
        .unwrap();
    let kept = |i: usize| rig.replicas[i].store().missed(NodeId(3), 0).unwrap();
    let everyone: BTreeSet<NodeId> = IDS.into_iter().collect();
    assert_eq!(
        rig.engine
            .close_maps_of_former_members(&everyone)
            .await
            .unwrap(),
        0
    );
    assert!(kept(0).is_some() && kept(1).is_some(), "n3 is a member");

    rig.engine.remove_replica(NodeId(3)).await.unwrap();
    let resync = Arc::new(
        Resyncer::new(
            Arc::clone(&rig.engine),
            ResyncConfig {
                interval: Duration::from_millis(10),
                ..ResyncConfig::default()
            },
        )
        .closing_maps_of_former_members(Box::new(|| [NodeId(1), NodeId(2)].into())),
    );
    let running = tokio::spawn(Arc::clone(&resync).run());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while kept(0).is_some() || kept(1).is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "n3's map is still open: n1 {:?}, n2 {:?}",
            kept(0),
            kept(1)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    running.abort();
    assert!(rig.replicas[0].store().missed_open().is_empty());
    assert!(rig.replicas[1].store().missed_open().is_empty());
}

/// #21: a map opened after the sweep for the current membership, of a node
/// that is no longer a member, is closed too: the engine may learn only
/// later that such a node left the in-sync set (its replica left the set
/// first), and opens its map then.
#[tokio::test]
async fn a_former_members_map_opened_after_the_sweep_is_closed() {
    use replica_ha::replica::mirror::resync::{ResyncConfig, Resyncer};
    use std::sync::atomic::{AtomicUsize, Ordering};
    let rig = Rig::new(2).await;
    rig.engine.activate(Term(5)).await.unwrap();
    let asked = Arc::new(AtomicUsize::new(0));
    let members = {
        let asked = Arc::clone(&asked);
        Box::new(move || {
            asked.fetch_add(1, Ordering::SeqCst);
            [NodeId(1), NodeId(2)].into()
        })
    };
    let resync = Arc::new(
        Resyncer::new(
            Arc::clone(&rig.engine),
            ResyncConfig {
                interval: Duration::from_millis(10),
                ..ResyncConfig::default()
            },
        )
        .closing_maps_of_former_members(members),
    );
    let running = tokio::spawn(Arc::clone(&resync).run());
    // The membership is read once per pass: a second read means the first
    // pass, and its sweep, are over.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while asked.load(Ordering::SeqCst) < 2 {
        assert!(tokio::time::Instant::now() < deadline, "no sweep");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // n3 fails a write: the engine drops it and opens its map on n1, n2.
    rig.replicas[2].set(Fault::Fail);
    rig.engine.write_at(0, block(1), false).await.unwrap();
    assert!(!rig.committed().await.contains(&NodeId(3)));
    let kept = |i: usize| rig.replicas[i].store().missed(NodeId(3), 0).unwrap();
    while kept(0).is_some() || kept(1).is_some() {
        assert!(
            tokio::time::Instant::now() < deadline + Duration::from_secs(10),
            "n3's map is still open: n1 {:?}, n2 {:?}",
            kept(0),
            kept(1)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    running.abort();
}

/// Invariant M: a map a replica kept while it was away, of a member that
/// returned meanwhile (its close could not reach it), is stale: it lacks
/// what was written since. The replica's rebuild closes it, so it can
/// never pass for complete when that member leaves again.
#[tokio::test]
async fn a_rebuild_closes_the_stale_maps_its_target_kept() {
    let rig = Rig::new(1).await;
    with_n3_out(&rig).await;
    // n2 leaves too; n3 returns while n2 is away.
    rig.replicas[1].set(Fault::Fail);
    rig.engine.write_at(4096, block(2), false).await.unwrap();
    assert!(!rig.committed().await.contains(&NodeId(2)));
    rig.replicas[1].set(Fault::None);
    rig.engine.begin_rebuild(NodeId(3)).await.unwrap();
    for extent in rig
        .engine
        .missed_plan(NodeId(3))
        .await
        .unwrap()
        .unwrap()
        .extents
    {
        rig.engine.copy_extent(NodeId(3), extent).await.unwrap();
    }
    rig.engine.finish_rebuild(NodeId(3)).await.unwrap();
    assert_eq!(rig.replicas[0].store().missed(NodeId(3), 0).unwrap(), None);
    assert!(
        rig.replicas[1]
            .store()
            .missed(NodeId(3), 0)
            .unwrap()
            .is_some(),
        "n2 was away when n3's map was closed"
    );
    rig.engine.begin_rebuild(NodeId(2)).await.unwrap();
    assert_eq!(rig.replicas[1].store().missed(NodeId(3), 0).unwrap(), None);
}
