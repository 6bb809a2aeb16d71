//! A writing client for process tests: it writes block after block
//! through whichever node takes it and keeps what was acknowledged, and
//! the checks that every acknowledged block reads back and that replicas
//! are identical.

use std::collections::BTreeMap;
use std::time::Duration;

use bytes::Bytes;
use replica_ha::proto::admin::WriteRequest;
use replica_ha::proto::admin::admin_client::AdminClient;
use tokio::sync::watch;
use tonic::transport::Channel;

use super::cluster::Cluster;

/// The block the client writes.
pub const BLOCK: u64 = 4096;
/// The test volume's size (the harness's default); the client writes
/// within it.
pub const SIZE: u64 = 16 << 20;

/// Block `i`'s contents: every block written differs from every other.
pub fn pattern(i: u64) -> Bytes {
    let mut data = vec![0u8; BLOCK as usize];
    for (n, chunk) in data.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&(i.wrapping_mul(0x9e37_79b9) ^ n as u64).to_le_bytes());
    }
    Bytes::from(data)
}

/// A client that writes block after block (each once, to its own offset)
/// to whichever node takes it, until told to stop, and returns what was
/// acknowledged. A write that fails is sent again, unchanged, to the next
/// node: it is acknowledged once, or the client stops with it unanswered.
async fn client(
    mut nodes: Vec<(u64, AdminClient<Channel>)>,
    mut stop: watch::Receiver<bool>,
) -> BTreeMap<u64, Bytes> {
    let mut acked = BTreeMap::new();
    let mut at = 0usize;
    for i in 0..SIZE / BLOCK {
        let (offset, data) = (i * BLOCK, pattern(i));
        loop {
            if *stop.borrow_and_update() {
                return acked;
            }
            let count = nodes.len();
            let (_, node) = &mut nodes[at % count];
            let mut request = tonic::Request::new(WriteRequest {
                offset,
                data: data.clone(),
                fua: false,
            });
            request.set_timeout(Duration::from_secs(3));
            if node.write(request).await.is_ok() {
                acked.insert(offset, data);
                break;
            }
            at += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    acked
}

/// Starts [`client`] over every node of `ids`.
pub fn start_client(
    cluster: &Cluster,
    ids: &[u64],
) -> (
    watch::Sender<bool>,
    tokio::task::JoinHandle<BTreeMap<u64, Bytes>>,
) {
    let nodes = ids.iter().map(|id| (*id, cluster.admin(*id))).collect();
    let (stop, stopped) = watch::channel(false);
    (stop, tokio::spawn(client(nodes, stopped)))
}

/// Every acknowledged block reads back from `writer`.
pub async fn check_acked(cluster: &Cluster, writer: u64, acked: &BTreeMap<u64, Bytes>) {
    assert!(!acked.is_empty(), "the client wrote nothing");
    for (offset, data) in acked {
        let read = cluster.read(writer, *offset, BLOCK as u32).await.unwrap();
        assert!(
            read == *data,
            "the acknowledged block at {offset} reads back wrong from node {writer}"
        );
    }
}

/// The BLAKE3 digests of every extent are identical on all of `ids`.
pub async fn assert_identical(cluster: &Cluster, ids: &[u64]) {
    assert_identical_over(cluster, ids, SIZE).await
}

/// The BLAKE3 digests of every extent of the first `size` bytes are
/// identical on all of `ids`.
pub async fn assert_identical_over(cluster: &Cluster, ids: &[u64], size: u64) {
    let first = cluster.digests(ids[0], 0, size).await;
    for id in &ids[1..] {
        assert!(
            cluster.digests(*id, 0, size).await == first,
            "node {id}'s replica differs from node {}'s",
            ids[0]
        );
    }
}
