//! One data listener, many volumes: the replica service and the block
//! channel of one node serve the stores of several volumes
//! (`replica::serve::Stores`), each request reaching the store of the
//! volume it names and no other.
//!
//! Each test serves two volumes' stores, `a` (Raft group 1) and `b` (group
//! 2), behind one listener and speaks to them as their writers do
//! (`RemoteReplica`: block I/O on the block channel, control calls on
//! gRPC), or as a raw gRPC client for what a writer never sends. Isolation
//! is S2/S3 per volume: a write or a fence of `a` changes `a`'s copy alone,
//! and only `a`'s controller hears of `a`'s fence.
//!
//! A volume is (cluster, name, group): every request names the group too,
//! and a copy refuses a request that names its name with another group.
//! Names are reused (`volume delete db`, `volume create db`: a new group)
//! and terms of different groups are not comparable, so the old volume's
//! writer, at a term far above the new group's, must not pass the new
//! copy's fence floor. (Red check: a writer of `b` that names `a`'s group
//! fails these tests.)

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use replica_ha::ids::{GroupId, NodeId, Term};
use replica_ha::net::{Expect, Transport};
use replica_ha::proto::replica as pb;
use replica_ha::proto::replica::replica_client::ReplicaClient;
use replica_ha::replica::disk::store::{ReplicaStore, StoreIdentity};
use replica_ha::replica::peer::remote::RemoteReplica;
use replica_ha::replica::serve::service::ReplicaService;
use replica_ha::replica::serve::stores::{OnFenced, Stores};
use replica_ha::replica::{Replica, ReplicaError, Stamp};
use tonic::Code;

const SIZE: u64 = 1 << 20;
const CLUSTER: &str = "test";
/// The Raft groups of volumes `a` and `b`.
const GROUP_A: GroupId = GroupId(1);
const GROUP_B: GroupId = GroupId(2);

/// The group of the volume `volume` of [`TwoVolumes`] (0 for any other).
fn group_of(volume: &str) -> GroupId {
    match volume {
        "a" => GROUP_A,
        "b" => GROUP_B,
        _ => GroupId::FIRST,
    }
}

/// Two volumes' stores behind one listener, and what each one's fence
/// callback heard.
struct TwoVolumes {
    _dir: tempfile::TempDir,
    addr: SocketAddr,
    stores: Stores,
    a: Arc<ReplicaStore>,
    b: Arc<ReplicaStore>,
    fenced_a: Arc<Mutex<Vec<Term>>>,
    fenced_b: Arc<Mutex<Vec<Term>>>,
}

impl TwoVolumes {
    async fn serve() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (
            open(&dir, "a", GROUP_A).await,
            open(&dir, "b", GROUP_B).await,
        );
        let (fenced_a, fenced_b) = (Arc::default(), Arc::default());
        let stores = Stores::new(CLUSTER);
        stores
            .insert(Arc::clone(&a), Some(recorder(&fenced_a)))
            .unwrap();
        stores
            .insert(Arc::clone(&b), Some(recorder(&fenced_b)))
            .unwrap();
        let addr = common::serve_replica(ReplicaService::serving(stores.clone())).await;
        Self {
            _dir: dir,
            addr,
            stores,
            a,
            b,
            fenced_a,
            fenced_b,
        }
    }

    /// The copy of `volume` on this listener, as its writer sees it.
    fn writer_of(&self, volume: &str) -> RemoteReplica {
        self.writer_naming(volume, group_of(volume))
    }

    /// A writer that names `volume` of group `group`.
    fn writer_naming(&self, volume: &str, group: GroupId) -> RemoteReplica {
        writer_at(self.addr, volume, group)
    }

    fn grpc(&self) -> ReplicaClient<tonic::transport::Channel> {
        grpc_at(self.addr)
    }

    /// Neither store holds a write, a raised floor or a mark, and no fence
    /// callback was called.
    async fn assert_untouched(&self) {
        for store in [&self.a, &self.b] {
            assert_eq!(filled(store.read(0, 4096).await.unwrap()), Some(0));
            assert_eq!(store.floor().await, Term(0));
            assert_eq!(store.info().await.unwrap().dirty_extents, 0);
        }
        assert!(self.fenced_a.lock().unwrap().is_empty());
        assert!(self.fenced_b.lock().unwrap().is_empty());
    }
}

/// A writer of `volume` of group `group` of the listener at `addr`.
fn writer_at(addr: SocketAddr, volume: &str, group: GroupId) -> RemoteReplica {
    RemoteReplica::new(
        NodeId(1),
        &Transport::default(),
        &addr.to_string(),
        CLUSTER,
        volume,
        group,
        Duration::from_secs(2),
    )
    .unwrap()
}

fn grpc_at(addr: SocketAddr) -> ReplicaClient<tonic::transport::Channel> {
    ReplicaClient::new(
        Transport::default()
            .channel(&addr.to_string(), Expect::AnyNode)
            .unwrap(),
    )
}

async fn open(dir: &tempfile::TempDir, volume: &str, group: GroupId) -> Arc<ReplicaStore> {
    let identity = StoreIdentity::new(CLUSTER, volume, SIZE).in_group(group);
    Arc::new(
        ReplicaStore::open(dir.path().join(volume), identity)
            .await
            .unwrap(),
    )
}

fn recorder(seen: &Arc<Mutex<Vec<Term>>>) -> OnFenced {
    let seen = Arc::clone(seen);
    Arc::new(move |floor| seen.lock().unwrap().push(floor))
}

fn block(byte: u8) -> Bytes {
    Bytes::from(vec![byte; 4096])
}

/// The byte `data` is filled with, if it is filled with one (so a
/// failure shows a byte, not 4 KiB).
fn filled(data: Bytes) -> Option<u8> {
    let first = *data.first()?;
    data.iter().all(|&b| b == first).then_some(first)
}

fn volume_ref(volume: &str) -> Option<pb::VolumeRef> {
    volume_ref_naming(volume, group_of(volume))
}

fn volume_ref_naming(volume: &str, group: GroupId) -> Option<pb::VolumeRef> {
    Some(pb::VolumeRef {
        cluster_id: CLUSTER.into(),
        volume: volume.into(),
        incarnation: 0,
        group: group.0,
    })
}

/// `outcome` is the refusal of a volume's name with another group: an
/// identity mismatch naming the group the copy holds and the one asked.
fn assert_refused_as_another_group<T: std::fmt::Debug>(
    outcome: Result<T, ReplicaError>,
    held: GroupId,
    asked: GroupId,
) {
    let named = |why: &str| why.contains(&format!("is of group {held}, not group {asked}"));
    assert!(
        matches!(outcome, Err(ReplicaError::IdentityMismatch(ref why)) if named(why)),
        "{outcome:?}"
    );
}

#[tokio::test]
async fn a_write_on_the_block_channel_lands_in_the_store_of_the_volume_it_names_only() {
    let node = TwoVolumes::serve().await;
    let (a, b) = (node.writer_of("a"), node.writer_of("b"));
    a.write(Stamp::from(Term(1)), 0, block(0xa), true)
        .await
        .unwrap();
    assert_eq!(filled(node.a.read(0, 4096).await.unwrap()), Some(0xa));
    assert_eq!(filled(node.b.read(0, 4096).await.unwrap()), Some(0));
    assert_eq!(node.b.info().await.unwrap().dirty_extents, 0);
    // And back: each connection reads its own volume's copy.
    b.write(Stamp::from(Term(1)), 0, block(0xb), true)
        .await
        .unwrap();
    assert_eq!(filled(a.read(0, 4096).await.unwrap()), Some(0xa));
    assert_eq!(filled(b.read(0, 4096).await.unwrap()), Some(0xb));
}

#[tokio::test]
async fn a_fence_raises_the_floor_of_its_own_volume_and_tells_its_controller_only() {
    let node = TwoVolumes::serve().await;
    let reply = node.writer_of("a").fence(Term(5)).await.unwrap();
    assert_eq!(reply.floor, Term(5));
    assert_eq!(node.a.floor().await, Term(5));
    assert_eq!(node.b.floor().await, Term(0));
    assert_eq!(*node.fenced_a.lock().unwrap(), [Term(5)]);
    assert!(node.fenced_b.lock().unwrap().is_empty());
    // b's writer of an older term still writes b: a's fence is not b's.
    node.writer_of("b")
        .write(Stamp::from(Term(1)), 0, block(0xb), false)
        .await
        .unwrap();
    let stale = node
        .writer_of("a")
        .write(Stamp::from(Term(1)), 0, block(0xa), false)
        .await;
    assert!(
        matches!(stale, Err(ReplicaError::StaleTerm { .. })),
        "{stale:?}"
    );
}

#[tokio::test]
async fn a_request_for_a_volume_this_node_does_not_hold_is_refused_and_changes_nothing() {
    let node = TwoVolumes::serve().await;
    // The control calls: NOT_FOUND, naming the volume.
    let refused = node
        .grpc()
        .fence(pb::FenceRequest {
            volume: volume_ref("nowhere"),
            term: 9,
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::NotFound, "{refused:?}");
    assert!(refused.message().contains("\"nowhere\""), "{refused:?}");
    // The same through a writer's client, and on the block channel, whose
    // Hello is refused before any store is looked at.
    let writer = node.writer_of("nowhere");
    let fence = writer.fence(Term(9)).await;
    assert!(
        matches!(fence, Err(ReplicaError::IdentityMismatch(ref why)) if why.contains("nowhere")),
        "{fence:?}"
    );
    let write = writer.write(Stamp::from(Term(9)), 0, block(9), true).await;
    assert!(
        matches!(write, Err(ReplicaError::IdentityMismatch(ref why)) if why.contains("nowhere")),
        "{write:?}"
    );
    node.assert_untouched().await;
}

#[tokio::test]
async fn a_removed_volume_is_refused_and_its_block_connections_close() {
    let node = TwoVolumes::serve().await;
    let (a, b) = (node.writer_of("a"), node.writer_of("b"));
    a.write(Stamp::from(Term(1)), 0, block(0xa), true)
        .await
        .unwrap();
    let removed = node.stores.remove("a").expect("a was served");
    assert!(Arc::ptr_eq(&removed, &node.a));
    // The open connection reads nothing more, and a new one is refused:
    // the write after the removal never lands.
    let after = a.write(Stamp::from(Term(1)), 4096, block(0xa), true).await;
    assert!(after.is_err(), "{after:?}");
    assert_eq!(filled(node.a.read(4096, 4096).await.unwrap()), Some(0));
    let fence = a.fence(Term(2)).await;
    assert!(fence.is_err(), "{fence:?}");
    assert_eq!(node.a.floor().await, Term(1));
    // The other volume is served as before.
    b.write(Stamp::from(Term(1)), 0, block(0xb), true)
        .await
        .unwrap();
    assert_eq!(filled(b.read(0, 4096).await.unwrap()), Some(0xb));
}

#[tokio::test]
async fn a_write_naming_a_volume_with_another_group_is_refused_and_changes_nothing() {
    let node = TwoVolumes::serve().await;
    // b's group named with a's name (and the reverse, and group 0, which
    // an earlier build names): refused on the block channel at its Hello,
    // and on gRPC, before any store is touched.
    for (volume, held, asked) in [
        ("a", GROUP_A, GROUP_B),
        ("b", GROUP_B, GROUP_A),
        ("a", GROUP_A, GroupId::FIRST),
    ] {
        let writer = node.writer_naming(volume, asked);
        let write = writer.write(Stamp::from(Term(9)), 0, block(9), true).await;
        assert_refused_as_another_group(write, held, asked);
        let fence = writer.fence(Term(9)).await;
        assert_refused_as_another_group(fence, held, asked);
        let refused = node
            .grpc()
            .fence(pb::FenceRequest {
                volume: volume_ref_naming(volume, asked),
                term: 9,
            })
            .await
            .unwrap_err();
        assert_eq!(refused.code(), Code::NotFound, "{refused:?}");
        assert!(
            refused
                .message()
                .contains(&format!("is of group {held}, not group {asked}")),
            "{refused:?}"
        );
    }
    node.assert_untouched().await;
    // Named with its own group, each is served.
    node.writer_of("a")
        .write(Stamp::from(Term(1)), 0, block(0xa), true)
        .await
        .unwrap();
    assert_eq!(filled(node.a.read(0, 4096).await.unwrap()), Some(0xa));
}

/// `volume delete db`, `volume create db`: the new db has group 2, and its
/// writer's terms start low. A node that has not applied the delete may
/// still run group 1's writer of db, at a term far above: its requests name
/// "db" too, and would pass the new copy's floor if the name were the
/// identity. They name group 1, and are refused; the new copy keeps its
/// data and its floor.
#[tokio::test]
async fn a_reused_name_refuses_the_old_groups_writer_at_a_higher_term() {
    let dir = tempfile::tempdir().unwrap();
    let db = open(&dir, "db", GroupId(2)).await;
    let fenced = Arc::default();
    let stores = Stores::new(CLUSTER);
    stores
        .insert(Arc::clone(&db), Some(recorder(&fenced)))
        .unwrap();
    let addr = common::serve_replica(ReplicaService::serving(stores)).await;
    let new_writer = writer_at(addr, "db", GroupId(2));
    new_writer.fence(Term(1)).await.unwrap();
    new_writer
        .write(Stamp::from(Term(1)), 0, block(0xdb), true)
        .await
        .unwrap();

    let old_writer = writer_at(addr, "db", GroupId(1));
    let write = old_writer
        .write(Stamp::from(Term(5)), 0, block(0x01), true)
        .await;
    assert_refused_as_another_group(write, GroupId(2), GroupId(1));
    let fence = old_writer.fence(Term(5)).await;
    assert_refused_as_another_group(fence, GroupId(2), GroupId(1));
    let grow = grpc_at(addr)
        .grow(pb::GrowRequest {
            volume: volume_ref_naming("db", GroupId(1)),
            term: 5,
            generation: 0,
            size: 2 * SIZE,
        })
        .await
        .unwrap_err();
    assert_eq!(grow.code(), Code::NotFound, "{grow:?}");

    assert_eq!(filled(db.read(0, 4096).await.unwrap()), Some(0xdb));
    assert_eq!(db.floor().await, Term(1));
    assert_eq!(db.size(), SIZE);
    assert_eq!(*fenced.lock().unwrap(), [Term(1)]);
    // The new volume's writer goes on at its own low term.
    new_writer
        .write(Stamp::from(Term(1)), 4096, block(0xdb), true)
        .await
        .unwrap();
}
