//! One order for overlapping writes (design S11): with no fault at all,
//! concurrent writes that overlap leave every replica byte-identical, and
//! so they do with the writer killed in the middle, once the cluster has
//! healed.
//!
//! The workload is the one that showed replicas diverging: fio on the
//! writer's export, 4 KiB random writes over 16 KiB, two jobs at queue
//! depth 32 each, so that requests on the same blocks are in flight at
//! once. Needs `fio` (`.ci/run` installs it).

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use common::cluster::{Cluster, one_cluster_at_a_time};
use common::tools::{run_within, uri};

const WAIT: Duration = Duration::from_secs(30);

/// fio writing overlapping 4 KiB blocks over the first 16 KiB of `nbd`
/// for `seconds`, two jobs at queue depth 32.
fn overlapping_fio(nbd: SocketAddr, seconds: u64) -> Vec<String> {
    vec![
        "--name=overlap".into(),
        "--ioengine=nbd".into(),
        format!("--uri={}", uri(nbd)),
        "--rw=randwrite".into(),
        "--bs=4k".into(),
        "--size=16k".into(),
        "--iodepth=32".into(),
        "--numjobs=2".into(),
        "--refill_buffers".into(),
        "--time_based".into(),
        format!("--runtime={seconds}"),
    ]
}

async fn fio(args: Vec<String>, limit: Duration) -> std::process::Output {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run_within("fio", &args, limit).await
}

fn volume(cluster: &Cluster, id: u64) -> std::path::PathBuf {
    cluster.data_dir(id).join("replica").join("volume.img")
}

/// The first `len` bytes of a replica's data file.
fn head(path: &Path, len: usize) -> Vec<u8> {
    let mut bytes = std::fs::read(path).expect("the replica's data file");
    bytes.truncate(len);
    bytes
}

/// Stops the followers, then the writer, so that no promotion converges
/// anything after the workload: what is on disk is what the writer's
/// mirroring left there. Then compares the replicas' first 16 KiB.
fn stop_and_compare(cluster: &mut Cluster, writer: u64, ids: &[u64]) {
    for id in ids.iter().filter(|id| **id != writer) {
        cluster.terminate(*id);
    }
    cluster.terminate(writer);
    let copies: Vec<(u64, Vec<u8>)> = ids
        .iter()
        .map(|id| (*id, head(&volume(cluster, *id), 16 * 1024)))
        .collect();
    assert!(
        copies[0].1.iter().any(|b| *b != 0),
        "the workload wrote nothing"
    );
    for (id, bytes) in &copies[1..] {
        let differ: Vec<usize> = (0..4)
            .filter(|block| {
                let range = block * 4096..(block + 1) * 4096;
                bytes[range.clone()] != copies[0].1[range]
            })
            .collect();
        assert!(
            differ.is_empty(),
            "replica {id} differs from replica {} in 4 KiB blocks {differ:?}",
            copies[0].0
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_writes_leave_every_replica_identical() {
    let _one = one_cluster_at_a_time().await;
    let mut cluster = Cluster::start_with(3, &["--size", "64MiB"]).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let output = fio(
        overlapping_fio(cluster.nbd_addrs[&writer], 6),
        Duration::from_secs(60),
    )
    .await;
    assert!(
        output.status.success(),
        "fio failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let in_sync = cluster.in_sync(writer).await;
    assert_eq!(in_sync.len(), 3, "every replica stayed in sync");
    stop_and_compare(&mut cluster, writer, &[1, 2, 3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlapping_writes_across_a_writer_kill_converge_to_identical_replicas() {
    let _one = one_cluster_at_a_time().await;
    let all = [1, 2, 3];
    let mut cluster = Cluster::start_with(3, &["--size", "64MiB"]).await;
    let (writer, _) = cluster.wait_for_writer(&all, WAIT).await;
    let workload = tokio::spawn(fio(
        overlapping_fio(cluster.nbd_addrs[&writer], 8),
        Duration::from_secs(60),
    ));
    // Kill the writer while the overlapping writes run (fio then fails):
    // once it has taken a few hundred of them.
    cluster.wait_for_writes(writer, 300, WAIT).await;
    cluster.kill(writer);
    let _ = workload.await;
    let survivors: Vec<u64> = all.into_iter().filter(|id| *id != writer).collect();
    let (next, _) = cluster.wait_for_writer(&survivors, WAIT).await;
    // More overlapping writes on the next writer, then the old one returns
    // and is rebuilt.
    let output = fio(
        overlapping_fio(cluster.nbd_addrs[&next], 3),
        Duration::from_secs(60),
    )
    .await;
    assert!(
        output.status.success(),
        "fio on the next writer failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    cluster.spawn(writer);
    cluster
        .wait_in_sync(next, writer, true, Duration::from_secs(60))
        .await;
    stop_and_compare(&mut cluster, next, &all);
}
