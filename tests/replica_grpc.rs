//! The replica service over real gRPC on loopback, and the token fencer.
//!
//! S2/S3 over the wire: a stale term is `FAILED_PRECONDITION` with the floor
//! attached; a foreign cluster, out-of-range and oversized requests get
//! their codes and leave the data unchanged; a replica that does not answer
//! in time is a failure. The fencer: S1's two conditions, the in-sync
//! shrink of unreached members, and S6 convergence.

mod common;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{Fault, FaultyReplica, SIZE, store};
use replica_ha::ha::InSyncTracker;
use replica_ha::ha::fake::MemoryInSync;
use replica_ha::ha::{Fencer, WriterEngine};
use replica_ha::ids::{GroupId, NodeId, Term};
use replica_ha::proto::replica as pb;
use replica_ha::proto::replica::replica_client::ReplicaClient;
use replica_ha::replica::disk::local::LocalReplica;
use replica_ha::replica::disk::store::ReplicaStore;
use replica_ha::replica::mirror::engine::{Engine, EngineConfig};
use replica_ha::replica::mirror::fencer::TokenFencer;
use replica_ha::replica::mirror::set::ReplicaSet;
use replica_ha::replica::peer::remote::RemoteReplica;
use replica_ha::replica::serve::service::ReplicaService;
use replica_ha::replica::serve::stores::{OnFenced, Stores};
use replica_ha::replica::{FloorBook, Replica, ReplicaError, Stamp};
use replica_ha::volume::{Device, DeviceError, MAX_REQUEST, RangeError};
use tonic::Code;

async fn serve(store: Arc<ReplicaStore>) -> SocketAddr {
    common::serve_replica(ReplicaService::new(store)).await
}

fn volume(cluster: &str) -> Option<pb::VolumeRef> {
    Some(pb::VolumeRef {
        cluster_id: cluster.into(),
        volume: "vol0".into(),
        // A replica served alone: the incarnation of a data dir older
        // than incarnations.
        incarnation: 0,
        group: 0,
    })
}

fn block(byte: u8) -> Bytes {
    Bytes::from(vec![byte; 4096])
}

fn remote(addr: SocketAddr, id: NodeId) -> RemoteReplica {
    RemoteReplica::new(
        id,
        &replica_ha::net::Transport::default(),
        &addr.to_string(),
        "test",
        "vol0",
        GroupId::FIRST,
        Duration::from_secs(2),
    )
    .unwrap()
}

#[tokio::test]
async fn a_fence_tells_the_node_its_new_floor() {
    let dir = tempfile::tempdir().unwrap();
    let local = store(dir.path(), NodeId(1)).await;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let on_fenced: OnFenced = {
        let seen = Arc::clone(&seen);
        Arc::new(move |floor| seen.lock().unwrap().push(floor))
    };
    let service = ReplicaService::serving(Stores::one(local, Some(on_fenced)));
    let addr = common::serve_replica(service).await;
    remote(addr, NodeId(1)).fence(Term(4)).await.unwrap();
    assert_eq!(*seen.lock().unwrap(), vec![Term(4)]);
}

#[tokio::test]
async fn the_fence_floor_holds_over_grpc() {
    let dir = tempfile::tempdir().unwrap();
    let local = store(dir.path(), NodeId(1)).await;
    let replica = remote(serve(Arc::clone(&local)).await, NodeId(1));
    replica
        .write(Stamp::from(Term(1)), 0, block(1), false)
        .await
        .unwrap();
    let reply = replica.fence(Term(3)).await.unwrap();
    assert_eq!(reply.floor, Term(3));
    assert_eq!(reply.dirty.len(), 1);
    assert_eq!(
        replica
            .write(Stamp::from(Term(2)), 0, block(2), false)
            .await,
        Err(ReplicaError::StaleTerm {
            term: Term(2),
            floor: Term(3)
        })
    );
    assert_eq!(
        replica.flush(Stamp::from(Term(2))).await,
        Err(ReplicaError::StaleTerm {
            term: Term(2),
            floor: Term(3)
        })
    );
    assert_eq!(replica.read(0, 4096).await.unwrap(), block(1));
    // A newer generation of the floor's term raises it; the older one is
    // then refused, and the refusal keeps its kind over the wire.
    let newer = Stamp {
        term: Term(3),
        generation: 1,
    };
    replica.flush(newer).await.unwrap();
    assert_eq!(
        replica
            .write(Stamp::from(Term(3)), 0, block(2), false)
            .await,
        Err(ReplicaError::StaleGeneration {
            stamp: Stamp::from(Term(3)),
            floor: newer
        })
    );
    replica.write(newer, 0, block(3), true).await.unwrap();
    replica.clear_dirty_below(Term(3)).await.unwrap();
    assert_eq!(local.dirty_extents().unwrap().len(), 1);
    assert_eq!(local.read(0, 4096).await.unwrap(), block(3));
}

#[tokio::test]
async fn bad_requests_get_their_codes_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let local = store(dir.path(), NodeId(1)).await;
    let addr = serve(Arc::clone(&local)).await;
    let transport = replica_ha::net::Transport::default();
    let connect = |cluster: &'static str| {
        let transport = transport.clone();
        async move {
            common::blocks::BlockClient::connect(
                &transport,
                &addr.to_string(),
                replica_ha::net::Expect::AnyNode,
                cluster,
                // A replica served alone: the incarnation of a data dir
                // older than incarnations.
                0,
            )
            .await
        }
    };
    local.write(Term(5), 0, block(5), false).await.unwrap();

    // Another cluster's link is refused at its hello, with the reason.
    let foreign = connect("other")
        .await
        .err()
        .expect("another cluster's link");
    assert!(foreign.to_string().contains("cluster"), "{foreign}");
    let client = connect("test").await.unwrap();
    let at = |term: u64| Stamp::from(Term(term));
    let huge = Bytes::from(vec![9u8; MAX_REQUEST as usize + 4096]);
    let cases = [
        (client.write(at(4), 0, block(9), false).await, "stale term"),
        (client.write(at(0), 0, block(9), false).await, "term 0"),
        (
            client.write(at(9), SIZE - 1024, block(9), false).await,
            "beyond",
        ),
        (client.write(at(9), 0, huge, false).await, "exceeds"),
    ];
    for (outcome, text) in cases {
        let err = outcome.unwrap_err();
        assert!(err.to_string().contains(text), "{err:?}");
    }
    assert!(matches!(
        client.read(SIZE, 1).await,
        Err(ReplicaError::Range(RangeError::OutOfRange { .. }))
    ));
    let mut client = ReplicaClient::new(
        transport
            .channel(&addr.to_string(), replica_ha::net::Expect::AnyNode)
            .unwrap(),
    );
    // The control calls check the volume a request names before the
    // store: another cluster's fence, or one that names no volume, is
    // refused with its code and raises no floor.
    let fence = |volume| pb::FenceRequest { volume, term: 9 };
    let refusals = [
        (fence(volume("other")), Code::PermissionDenied, "cluster"),
        (fence(None), Code::InvalidArgument, "names no volume"),
    ];
    for (request, code, text) in refusals {
        let status = client.fence(request).await.unwrap_err();
        assert_eq!(status.code(), code, "{status:?}");
        assert!(status.message().contains(text), "{status:?}");
    }
    // Nothing changed: data, floor and marks are as before.
    assert_eq!(local.read(0, 4096).await.unwrap(), block(5));
    assert_eq!(
        local.read(SIZE - 4096, 4096).await.unwrap(),
        Bytes::from(vec![0u8; 4096])
    );
    assert_eq!(local.floor().await, Term(5));
    assert_eq!(local.dirty_extents().unwrap().len(), 1);
    let status = client
        .status(pb::StatusRequest {
            volume: volume("test"),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (status.floor, status.size, status.dirty_extents),
        (5, SIZE, 1)
    );
}

/// S8 on the block channel: a write meant for another incarnation of the
/// replica (the writer still expects the copy a replaced disk held) is
/// refused and changes nothing; the incarnation it is gets served.
#[tokio::test]
async fn a_block_write_for_another_incarnation_is_refused_and_changes_nothing() {
    use replica_ha::ids::Incarnation;
    let dir = tempfile::tempdir().unwrap();
    let local = store(dir.path(), NodeId(1)).await;
    let service = ReplicaService::new(Arc::clone(&local)).of_incarnation(Incarnation(7));
    let addr = common::serve_replica(service).await;
    let client = common::blocks::BlockClient::connect(
        &replica_ha::net::Transport::default(),
        &addr.to_string(),
        replica_ha::net::Expect::AnyNode,
        "test",
        0,
    )
    .await
    .unwrap();
    let data = Bytes::from_static(b"acknowledged?");
    let mut client = Some(client);
    for former in [0, 6] {
        let naming = client.take().unwrap().naming(former);
        let refused = naming
            .write(Stamp::from(Term(4)), 0, data.clone(), true)
            .await
            .unwrap_err();
        assert!(
            matches!(&refused, ReplicaError::IdentityMismatch(why) if why.contains("replaced disk")),
            "{refused:?}"
        );
        client = Some(naming);
    }
    assert_eq!(local.floor().await, Term(0));
    assert_eq!(local.read(0, 13).await.unwrap(), Bytes::from(vec![0; 13]));
    let client = client.unwrap().naming(7);
    client
        .write(Stamp::from(Term(4)), 0, data.clone(), true)
        .await
        .unwrap();
    assert_eq!(local.floor().await, Term(4));
    assert_eq!(local.read(0, 13).await.unwrap(), data);
}

#[tokio::test]
async fn a_replica_that_does_not_answer_in_time_fails_the_request() {
    // Accepts connections and never answers.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let replica = RemoteReplica::new(
        NodeId(9),
        &replica_ha::net::Transport::default(),
        &addr.to_string(),
        "test",
        "vol0",
        GroupId::FIRST,
        Duration::from_millis(200),
    )
    .unwrap();
    assert!(matches!(
        replica
            .write(Stamp::from(Term(1)), 0, block(1), false)
            .await,
        Err(ReplicaError::Unavailable(_))
    ));
    assert!(matches!(
        replica.fence(Term(1)).await,
        Err(ReplicaError::Unavailable(_))
    ));
}

#[tokio::test]
async fn the_engine_mirrors_through_remote_replicas() {
    let dir = tempfile::tempdir().unwrap();
    let stores = [
        store(dir.path(), NodeId(1)).await,
        store(dir.path(), NodeId(2)).await,
        store(dir.path(), NodeId(3)).await,
    ];
    let replicas: Vec<Arc<dyn Replica>> = vec![
        Arc::new(LocalReplica::new(NodeId(1), Arc::clone(&stores[0]))),
        Arc::new(remote(serve(Arc::clone(&stores[1])).await, NodeId(2))),
        Arc::new(remote(serve(Arc::clone(&stores[2])).await, NodeId(3))),
    ];
    let tracker = Arc::new(MemoryInSync::new([NodeId(1), NodeId(2), NodeId(3)]));
    let engine = Engine::new(
        EngineConfig {
            local_id: NodeId(1),
            replica_timeout: Duration::from_secs(2),
            volume: replica_ha::volume::VolumeSpec::new("test", "vol0", SIZE, 2),
        },
        replicas,
        tracker,
    )
    .unwrap();
    engine.activate(Term(4)).await.unwrap();
    engine.write_at(8192, block(7), true).await.unwrap();
    engine.flush().await.unwrap();
    for store in &stores {
        assert_eq!(store.read(8192, 4096).await.unwrap(), block(7));
        assert_eq!(store.floor().await, Term(4));
    }
    // A newer writer fences one remote replica: the old engine is refused.
    stores[2].fence(Term(5)).await.unwrap();
    assert_eq!(
        engine.write_at(0, block(8), false).await,
        Err(DeviceError::StaleTerm {
            term: Term(4),
            floor: Term(5)
        })
    );
}

/// S5 against the scrub and the convergence: digests (and allocation,
/// whose holes reads and rebuilds skip) name the store's session, so a
/// copy whose store was opened again since the writer first counted on it
/// gives neither (no vote, no source) until a rebuild accepts it (#36: digests went over gRPC without the session check of
/// block calls, and two restarted copies could outvote a good one).
#[tokio::test]
async fn digests_of_a_replica_that_restarted_are_refused_until_a_rebuild_accepts_it() {
    let (before, after) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serve_on = |store: Arc<ReplicaStore>, listener: tokio::net::TcpListener| {
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let served = tokio::spawn(async move {
            let transport = replica_ha::net::Transport::default();
            ReplicaService::new(store)
                .serve(&transport, listener, stopped)
                .await
        });
        (stop, served)
    };
    let (stop, served) = serve_on(store(before.path(), NodeId(2)).await, listener);
    let replica = remote(addr, NodeId(2));
    replica.digests(0, 4096).await.unwrap();
    stop.send_replace(true);
    tokio::time::timeout(Duration::from_secs(10), served)
        .await
        .expect("the first server stops")
        .unwrap()
        .unwrap();
    // The same node, its store opened again: a new session.
    let listener = tokio::net::TcpListener::bind(addr).await.unwrap();
    let (_stop, _served) = serve_on(store(after.path(), NodeId(2)).await, listener);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let refused = loop {
        match replica.digests(0, 4096).await {
            Err(ReplicaError::Unavailable(_)) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            other => break other,
        }
    };
    assert!(
        matches!(refused, Err(ReplicaError::Restarted(_))),
        "a restarted copy's digests were counted: {refused:?}"
    );
    let holes = replica.allocation(0, 4096).await;
    assert!(
        matches!(holes, Err(ReplicaError::Restarted(_))),
        "a restarted copy's holes were counted: {holes:?}"
    );
    replica.accept_restart();
    replica.digests(0, 4096).await.unwrap();
    replica.allocation(0, 4096).await.unwrap();
}

struct FenceRig {
    _dir: tempfile::TempDir,
    replicas: Vec<Arc<FaultyReplica>>,
    tracker: Arc<MemoryInSync>,
    fencer: TokenFencer,
    /// The new writer's engine on n1, sharing the fencer's floor book.
    engine: Engine,
}

impl FenceRig {
    /// Promotes n1's engine at `term` after a fence, and runs one of its
    /// mark-retirement passes: what a convergence leaves for the writer
    /// (making it durable, dropping the older marks) is done then.
    async fn write_at(&self, term: Term) {
        self.engine.activate(term).await.unwrap();
        self.engine.retire_marks().await.unwrap();
    }
}

async fn fence_rig(in_sync: &[NodeId]) -> FenceRig {
    fence_rig_of(in_sync, SIZE, Duration::from_millis(300)).await
}

/// Three stores of `size` bytes and a fencer over them whose calls time
/// out after `timeout`.
async fn fence_rig_of(in_sync: &[NodeId], size: u64, timeout: Duration) -> FenceRig {
    common::init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let mut replicas = Vec::new();
    for id in [NodeId(1), NodeId(2), NodeId(3)] {
        let store = ReplicaStore::open(
            dir.path().join(id.to_string()),
            replica_ha::replica::disk::store::StoreIdentity::new("test", "vol0", size),
        )
        .await
        .expect("open store");
        replicas.push(FaultyReplica::new(id, Arc::new(store)));
    }
    let tracker = Arc::new(MemoryInSync::new(in_sync.iter().copied()));
    let dyn_replicas: Vec<Arc<dyn Replica>> = replicas
        .iter()
        .map(|r| Arc::clone(r) as Arc<dyn Replica>)
        .collect();
    let floors = Arc::new(FloorBook::default());
    // One replica set, shared as in a node.
    let set = Arc::new(ReplicaSet::new(NodeId(1), dyn_replicas).unwrap());
    let fencer = TokenFencer::new(
        Arc::clone(&set),
        Arc::clone(&tracker) as Arc<dyn InSyncTracker>,
        &replica_ha::volume::VolumeSpec::new("test", "vol0", size, 2),
        timeout,
    )
    .with_floor_book(Arc::clone(&floors));
    let engine = Engine::over(
        EngineConfig {
            local_id: NodeId(1),
            replica_timeout: timeout,
            volume: replica_ha::volume::VolumeSpec::new("test", "vol0", size, 1),
        },
        set,
        Arc::clone(&tracker) as Arc<dyn InSyncTracker>,
    )
    .unwrap()
    .with_floor_book(floors);
    FenceRig {
        _dir: dir,
        replicas,
        tracker,
        fencer,
        engine,
    }
}

fn set(ids: &[NodeId]) -> BTreeSet<NodeId> {
    ids.iter().copied().collect()
}

#[tokio::test]
async fn fencing_raises_every_reachable_floor_and_shuts_the_old_writer_out() {
    let rig = fence_rig(&[NodeId(1), NodeId(2), NodeId(3)]).await;
    for r in &rig.replicas {
        r.store().write(Term(1), 0, block(1), false).await.unwrap();
    }
    rig.fencer.fence(None, Term(2)).await.unwrap();
    for r in &rig.replicas {
        assert_eq!(r.store().floor().await, Term(2));
        assert_eq!(
            r.store().write(Term(1), 0, block(9), false).await,
            Err(ReplicaError::StaleTerm {
                term: Term(1),
                floor: Term(2)
            })
        );
    }
    assert_eq!(
        rig.tracker.in_sync().await.unwrap(),
        set(&[NodeId(1), NodeId(2), NodeId(3)])
    );
}

#[tokio::test]
async fn an_unreached_in_sync_replica_is_dropped_by_a_commit() {
    let rig = fence_rig(&[NodeId(1), NodeId(2), NodeId(3)]).await;
    rig.replicas[2].set(Fault::Hang);
    rig.fencer.fence(None, Term(2)).await.unwrap();
    assert_eq!(
        rig.tracker.in_sync().await.unwrap(),
        set(&[NodeId(1), NodeId(2)])
    );
}

/// Invariant M when the fencer drops an unreached member: every member
/// that stays opens its missed-write map with the dead writer's marked
/// extents (its unacknowledged writes may have reached them and not the
/// one that left), before the removal commits.
#[tokio::test]
async fn a_dropped_member_gets_a_missed_write_map_with_the_marked_extents() {
    let rig = fence_rig(&[NodeId(1), NodeId(2), NodeId(3)]).await;
    let mib = 1 << 20;
    // Term 1's writer reached n1 and n2 only, at extents 2 and 4.
    for (i, extent) in [(0, 2), (1, 4)] {
        rig.replicas[i]
            .store()
            .write(Term(1), extent * mib, block(0x31), false)
            .await
            .unwrap();
    }
    rig.replicas[2].set(Fault::Hang);
    rig.fencer.fence(None, Term(2)).await.unwrap();
    assert_eq!(
        rig.tracker.in_sync().await.unwrap(),
        set(&[NodeId(1), NodeId(2)])
    );
    for i in 0..2 {
        let map = rig.replicas[i]
            .store()
            .missed(NodeId(3), 0)
            .unwrap()
            .expect("a map of the dropped member");
        assert_eq!(map.extents, vec![2, 4], "n{}'s map", i + 1);
    }
}

#[tokio::test]
async fn too_few_fenced_replicas_fail_the_fence_and_change_nothing() {
    let rig = fence_rig(&[NodeId(1), NodeId(2), NodeId(3)]).await;
    rig.replicas[1].set(Fault::Fail);
    rig.replicas[2].set(Fault::Hang);
    let err = rig.fencer.fence(None, Term(2)).await.unwrap_err();
    assert!(err.to_string().contains("only 1 of 3"), "{err}");
    assert_eq!(
        rig.tracker.in_sync().await.unwrap(),
        set(&[NodeId(1), NodeId(2), NodeId(3)])
    );
}

#[tokio::test]
async fn a_fence_without_an_in_sync_member_fails() {
    let rig = fence_rig(&[NodeId(3)]).await;
    rig.replicas[2].set(Fault::Fail);
    let err = rig.fencer.fence(None, Term(2)).await.unwrap_err();
    assert!(err.to_string().contains("in-sync"), "{err}");
    assert_eq!(rig.tracker.in_sync().await.unwrap(), set(&[NodeId(3)]));
}

#[tokio::test]
async fn a_replica_that_saw_a_newer_term_fails_the_fence() {
    let rig = fence_rig(&[NodeId(1), NodeId(2), NodeId(3)]).await;
    rig.replicas[1].store().fence(Term(7)).await.unwrap();
    let err = rig.fencer.fence(None, Term(5)).await.unwrap_err();
    assert!(err.to_string().contains("newer writer"), "{err}");
}

/// S6: an older writer left an unacknowledged write on one replica only;
/// after the fence every in-sync replica holds the same bytes there, and
/// once the new writer's first retirement pass ran, the older marks are
/// gone.
#[tokio::test]
async fn older_dirty_extents_converge_before_the_new_writer_writes() {
    let rig = fence_rig(&[NodeId(1), NodeId(2), NodeId(3)]).await;
    let extent = 3 * (1 << 20);
    rig.replicas[1]
        .store()
        .write(Term(1), extent, block(0xd1), false)
        .await
        .unwrap();
    rig.replicas[2]
        .store()
        .write(Term(1), extent + 8192, block(0xd2), false)
        .await
        .unwrap();
    rig.fencer.fence(None, Term(2)).await.unwrap();
    rig.write_at(Term(2)).await;
    let expected = rig.replicas[0].store().read(extent, 1 << 20).await.unwrap();
    for r in &rig.replicas {
        assert_eq!(r.store().read(extent, 1 << 20).await.unwrap(), expected);
        assert!(
            r.store()
                .dirty_extents()
                .unwrap()
                .iter()
                .all(|m| m.term >= Term(2))
        );
    }
}

/// S6 after an online resize: an extent past the size the nodes were
/// configured with, which an older writer left different on the in-sync
/// replicas, converges like any other (the fencer goes by the committed
/// size, not the config).
#[tokio::test]
async fn marked_extents_past_the_configured_size_converge_after_a_resize() {
    let rig = fence_rig(&[NodeId(1), NodeId(2), NodeId(3)]).await;
    rig.fencer.fence(None, Term(1)).await.unwrap();
    rig.engine.activate(Term(1)).await.unwrap();
    rig.engine.resize(2 * SIZE).await.unwrap();
    rig.engine.deactivate();
    // Term 1's writer reached only n2 and n3, differently, past the old end
    // (a later generation of its term, as its engine would stamp them).
    let late = replica_ha::replica::Stamp {
        term: Term(1),
        generation: 9,
    };
    let extent = SIZE + (1 << 20);
    rig.replicas[1]
        .store()
        .write(late, extent, block(0xd1), false)
        .await
        .unwrap();
    rig.replicas[2]
        .store()
        .write(late, extent + 8192, block(0xd2), false)
        .await
        .unwrap();
    rig.fencer.fence(None, Term(2)).await.unwrap();
    rig.write_at(Term(2)).await;
    assert_eq!(rig.engine.size(), 2 * SIZE);
    let expected = rig.replicas[0].store().read(extent, 1 << 20).await.unwrap();
    for r in &rig.replicas {
        assert!(
            r.store().read(extent, 1 << 20).await.unwrap() == expected,
            "node {} differs past the configured size",
            r.id()
        );
    }
}

/// S6, bounded: convergence makes progress that a later attempt keeps. The
/// first attempt fails on n3 in its second batch; the extents of the first
/// batch are converged, durable and no longer marked, so the retry copies
/// only the rest.
#[tokio::test]
async fn an_interrupted_convergence_resumes_where_it_was() {
    let rig = fence_rig_of(
        &[NodeId(1), NodeId(2), NodeId(3)],
        256 << 20,
        Duration::from_secs(5),
    )
    .await;
    let (replicas, tracker, fencer) = (&rig.replicas, &rig.tracker, &rig.fencer);
    // Term 1 left 128 extents marked, with n1's copy differing from n2's.
    for extent in 0..128u64 {
        replicas[0]
            .store()
            .write(Term(1), extent << 20, block(0xa1), false)
            .await
            .unwrap();
        replicas[1]
            .store()
            .write(Term(1), extent << 20, block(0xb2), false)
            .await
            .unwrap();
    }
    replicas[2].set(Fault::FailWritesAt(100 << 20));
    assert!(fencer.fence(None, Term(2)).await.is_err());
    let older = |i: usize| -> usize {
        replicas[i]
            .store()
            .dirty_extents()
            .unwrap()
            .iter()
            .filter(|m| m.term < Term(2))
            .count()
    };
    assert!(
        older(0) < 128 && older(0) > 0,
        "the first batch kept its progress: {} of 128 still marked",
        older(0)
    );
    assert_eq!(older(1), older(0));
    replicas[2].set(Fault::None);
    fencer.fence(None, Term(2)).await.unwrap();
    rig.write_at(Term(2)).await;
    for (i, r) in replicas.iter().enumerate() {
        assert_eq!(older(i), 0);
        for extent in [0u64, 99, 100, 127] {
            assert!(
                r.store().read(extent << 20, 4096).await.unwrap() == block(0xa1),
                "extent {extent} on {} converged to the source",
                r.id()
            );
        }
    }
    assert_eq!(tracker.in_sync().await.unwrap().len(), 3);
}

/// A short convergence leaves making its extents durable to the new
/// writer, off the failover's path: the older marks stay until the
/// writer's first pass has flushed every member (a crash before that pass
/// finds them again and converges once more), and then go; the marks the
/// copies made go like the writer's own, once idle for a whole pass.
#[tokio::test]
async fn a_short_convergence_leaves_the_flush_and_the_older_marks_to_the_writer() {
    let rig = fence_rig(&[NodeId(1), NodeId(2), NodeId(3)]).await;
    for (i, r) in rig.replicas.iter().enumerate() {
        r.store()
            .write(Term(1), 5 << 20, block(0xc0 + i as u8), false)
            .await
            .unwrap();
    }
    let older = |r: &FaultyReplica| {
        r.store()
            .dirty_extents()
            .unwrap()
            .iter()
            .filter(|m| m.term < Term(2))
            .count()
    };
    rig.fencer.fence(None, Term(2)).await.unwrap();
    let expected = rig.replicas[0]
        .store()
        .read(5 << 20, 1 << 20)
        .await
        .unwrap();
    for r in &rig.replicas {
        assert_eq!(r.store().read(5 << 20, 1 << 20).await.unwrap(), expected);
        assert_eq!(older(r), 1, "{} keeps its older mark until a flush", r.id());
    }
    rig.write_at(Term(2)).await;
    for r in &rig.replicas {
        assert_eq!(
            older(r),
            0,
            "{}: the older mark goes after the flush",
            r.id()
        );
        assert_eq!(r.store().read(5 << 20, 1 << 20).await.unwrap(), expected);
    }
    rig.engine.retire_marks().await.unwrap();
    for r in &rig.replicas {
        assert!(
            r.store().dirty_extents().unwrap().is_empty(),
            "{}: the copy's own mark is retired once idle for a pass",
            r.id()
        );
    }
}

/// S6 and S7 together: the convergence leaves its flush to the writer, so
/// a power cut of every node right after the fence, before the writer's
/// first pass, undoes the copy. The older marks are durable and still
/// there, so the next fence converges the extent again.
#[tokio::test]
async fn a_power_cut_before_the_writers_first_pass_leaves_the_marks_to_converge_again() {
    use common::power::PowerCutReplica;
    common::init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let mut nodes = Vec::new();
    for id in [NodeId(1), NodeId(2), NodeId(3)] {
        nodes.push(PowerCutReplica::new(id, common::store(dir.path(), id).await).await);
    }
    let replicas: Vec<Arc<dyn Replica>> = nodes
        .iter()
        .map(|r| Arc::clone(r) as Arc<dyn Replica>)
        .collect();
    let tracker = Arc::new(MemoryInSync::new([NodeId(1), NodeId(2), NodeId(3)]));
    let fencer = TokenFencer::new(
        Arc::new(ReplicaSet::new(NodeId(1), replicas).unwrap()),
        Arc::clone(&tracker) as Arc<dyn InSyncTracker>,
        &replica_ha::volume::VolumeSpec::new("test", "vol0", SIZE, 2),
        Duration::from_secs(1),
    );
    // Term 1's writer left a write on n2 only, durable there (FUA).
    let extent = 2u64 << 20;
    nodes[1]
        .write(Stamp::from(Term(1)), extent, block(0xe7), true)
        .await
        .unwrap();
    fencer.fence(None, Term(2)).await.unwrap();
    let n1 = nodes[0].store().read(extent, 4096).await.unwrap();
    assert_eq!(nodes[1].store().read(extent, 4096).await.unwrap(), n1);

    for node in &nodes {
        node.power_cut().await;
    }
    assert!(
        nodes[1].store().read(extent, 4096).await.unwrap() == block(0xe7),
        "the power cut undid the unflushed copy on n2"
    );
    assert!(
        nodes[1]
            .store()
            .dirty_extents()
            .unwrap()
            .iter()
            .any(|m| m.term == Term(1) && m.extent == 2),
        "term 1's mark outlived the fence that did not flush"
    );
    fencer.fence(None, Term(3)).await.unwrap();
    for node in &nodes {
        assert_eq!(node.store().read(extent, 4096).await.unwrap(), n1);
    }
}

/// S1 with a replica set that lacks a committed in-sync replica (a node
/// whose peer list is behind a membership change): the old writer may still
/// reach that one, so the fencer counts it among the N it must shut out.
/// Here n3 is in sync but not in this node's set, and n2 does not answer:
/// n1 alone (1 of 3) cannot shut out an old writer with min_in_sync 2,
/// which could still reach n2 and n3.
#[tokio::test]
async fn a_fence_counts_in_sync_replicas_the_set_lacks() {
    common::init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let n1 = FaultyReplica::new(NodeId(1), store(dir.path(), NodeId(1)).await);
    let n2 = FaultyReplica::new(NodeId(2), store(dir.path(), NodeId(2)).await);
    n2.set(Fault::Fail);
    let replicas: Vec<Arc<dyn Replica>> = vec![n1, n2];
    let tracker = Arc::new(MemoryInSync::new([NodeId(1), NodeId(2), NodeId(3)]));
    let fencer = TokenFencer::new(
        Arc::new(ReplicaSet::new(NodeId(1), replicas).unwrap()),
        Arc::clone(&tracker) as Arc<dyn InSyncTracker>,
        &replica_ha::volume::VolumeSpec::new("test", "vol0", SIZE, 2),
        Duration::from_secs(1),
    );
    let err = fencer.fence(None, Term(2)).await.unwrap_err();
    assert!(
        matches!(
            err,
            replica_ha::ha::FenceError::TooFewFenced {
                fenced: 1,
                replicas: 3,
                need: 2,
                ..
            }
        ),
        "{err}"
    );
}

/// The block channel refuses what it cannot trust and applies nothing of
/// it: a frame with a wrong checksum, an oversized or unknown header, a
/// request before `Hello`, a `Hello` for another volume or for the
/// volume's name in another Raft group, a request for
/// another incarnation (S8), a stale term (S2), a range past the end. A
/// broken frame closes its connection; the store is unchanged and still
/// serves the next connection.
#[tokio::test]
async fn the_block_channel_refuses_bad_frames_and_changes_nothing() {
    use replica_ha::net::frame::{Frame, Header, Kind, PREFACE, hello_payload};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let dir = tempfile::tempdir().unwrap();
    let local = store(dir.path(), NodeId(1)).await;
    local.write(Term(5), 0, block(5), false).await.unwrap();
    let addr = serve(Arc::clone(&local)).await;

    let write = |term: u64, offset: u64, incarnation: u64| {
        let mut header = Header::new(Kind::Write, 7);
        header.stamp = Stamp::from(Term(term));
        header.offset = offset;
        header.incarnation = incarnation;
        Frame::new(header, block(9))
    };
    let wire = |frame: &Frame| {
        let mut out = frame.header.encode().to_vec();
        out.extend_from_slice(&frame.payload);
        out
    };
    let hello_of = |volume: &str, group: GroupId| {
        wire(&Frame::new(
            Header::new(Kind::Hello, 1),
            hello_payload("test", volume, group),
        ))
    };
    let hello = |volume: &str| hello_of(volume, GroupId::FIRST);
    // Sends `bytes` after the preface and reads until the server closes;
    // what it answered.
    let exchange = |bytes: Vec<u8>| async move {
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        tcp.write_all(PREFACE).await.unwrap();
        tcp.write_all(&bytes).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), tcp.read_to_end(&mut answer))
            .await
            .expect("the server closes a connection it cannot trust")
            .ok();
        answer
    };

    let mut corrupt = wire(&write(9, 0, 0));
    let last = corrupt.len() - 1;
    corrupt[last] ^= 1;
    let mut oversized = wire(&write(9, 0, 0));
    oversized[4..8].copy_from_slice(&u32::MAX.to_be_bytes());
    let mut unknown = wire(&write(9, 0, 0));
    unknown[1] = 0x42;
    for (what, bytes) in [
        ("a wrong checksum", [hello("vol0"), corrupt].concat()),
        ("an oversized payload", [hello("vol0"), oversized].concat()),
        ("an unknown kind", [hello("vol0"), unknown].concat()),
        ("a write before Hello", wire(&write(9, 0, 0))),
        (
            "a Hello for another volume",
            [hello("vol1"), wire(&write(9, 0, 0))].concat(),
        ),
        (
            "a Hello for the volume's name in another group",
            [hello_of("vol0", GroupId(1)), wire(&write(9, 0, 0))].concat(),
        ),
        (
            "an oversized Hello",
            [hello(&"v".repeat(4096)), wire(&write(9, 0, 0))].concat(),
        ),
    ] {
        let answer = exchange(bytes).await;
        // At most the Hello's answer and one refusal came back; never an
        // Ok for the write.
        let mut buf = bytes::BytesMut::from(&answer[..]);
        let mut decoder = replica_ha::net::frame::Decoder::default();
        while let Ok(Some(frame)) = decoder.next(&mut buf) {
            assert!(
                frame.header.id != 7 || frame.header.kind == Kind::Refused,
                "{what}: the write was answered {:?}",
                frame.header.kind
            );
        }
        assert_eq!(local.read(0, 4096).await.unwrap(), block(5), "{what}");
        assert_eq!(local.floor().await, Term(5), "{what}");
    }

    // Well-formed requests the store refuses, over a real link.
    let link = replica_ha::net::Transport::default()
        .link(
            &addr.to_string(),
            replica_ha::net::Expect::AnyNode,
            "test",
            "vol0",
            GroupId::FIRST,
            Duration::from_secs(2),
        )
        .await
        .unwrap();
    for (what, frame, wanted) in [
        ("another incarnation", write(9, 0, 3), "replaced disk"),
        ("a stale term", write(4, 0, 0), "stale term"),
        ("past the end", write(9, SIZE - 1024, 0), "beyond"),
        ("term 0", write(0, 0, 0), "term 0"),
    ] {
        let reply = link
            .call(frame.header, frame.payload, Duration::from_secs(2))
            .await
            .unwrap();
        assert_eq!(reply.header.kind, Kind::Refused, "{what}");
        let message = String::from_utf8_lossy(&reply.payload);
        assert!(message.contains(wanted), "{what}: {message}");
    }
    assert_eq!(local.read(0, 4096).await.unwrap(), block(5));
    assert_eq!(local.floor().await, Term(5));
    // The same link still serves a good write.
    let good = write(9, 0, 0);
    let reply = link
        .call(good.header, good.payload, Duration::from_secs(2))
        .await
        .unwrap();
    assert_eq!(reply.header.kind, Kind::Ok);
    assert_eq!(local.read(0, 4096).await.unwrap(), block(9));
}
