//! One data listener, many volumes: the replica service and the block
//! channel of one node serve the stores of several volumes
//! (`replica::serve::Stores`), each request reaching the store of the
//! volume it names and no other.
//!
//! Each test serves two volumes' stores, `a` and `b`, behind one listener
//! and speaks to them as their writers do (`RemoteReplica`: block I/O on
//! the block channel, control calls on gRPC), or as a raw gRPC client
//! for what a writer never sends. Isolation is S2/S3 per volume: a write
//! or a fence of `a` changes `a`'s copy alone, and only `a`'s controller
//! hears of `a`'s fence.

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use replica_ha::ids::{NodeId, Term};
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
        let (a, b) = (open(&dir, "a").await, open(&dir, "b").await);
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
        RemoteReplica::new(
            NodeId(1),
            &Transport::default(),
            &self.addr.to_string(),
            CLUSTER,
            volume,
            Duration::from_secs(2),
        )
        .unwrap()
    }

    fn grpc(&self) -> ReplicaClient<tonic::transport::Channel> {
        ReplicaClient::new(
            Transport::default()
                .channel(&self.addr.to_string(), Expect::AnyNode)
                .unwrap(),
        )
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

async fn open(dir: &tempfile::TempDir, volume: &str) -> Arc<ReplicaStore> {
    let identity = StoreIdentity::new(CLUSTER, volume, SIZE);
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
    Some(pb::VolumeRef {
        cluster_id: CLUSTER.into(),
        volume: volume.into(),
        incarnation: 0,
    })
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
