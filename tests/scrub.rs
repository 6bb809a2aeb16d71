//! The scrub (design S11) with real node processes: bytes written straight
//! into a replica's `volume.img`, behind the node's back as bit rot would,
//! are found by `replica-ha scrub --now` as exactly that extent on exactly
//! that replica, repaired from the majority's copy, and reported by
//! `status` and `/metrics`; afterwards every replica's digests agree.

mod common;

use std::os::unix::fs::FileExt;
use std::time::Duration;

use bytes::Bytes;
use common::cluster::{BIN, Cluster, one_cluster_at_a_time};
use common::tools::{http_get, promtool_accepts};

const WAIT: Duration = Duration::from_secs(20);
const SIZE: u64 = 64 << 20;
const MIB: u64 = 1 << 20;

/// Writes `len` bytes of garbage into node `id`'s data file at `offset`,
/// bypassing the node.
fn rot(cluster: &Cluster, id: u64, offset: u64, len: usize) {
    let path = cluster.data_dir(id).join("replica").join("volume.img");
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .expect("the replica's data file");
    let garbage: Vec<u8> = (0..len).map(|i| (i * 7 + 13) as u8).collect();
    file.write_all_at(&garbage, offset).unwrap();
    file.sync_all().unwrap();
}

/// `replica-ha scrub --now` against node `id`: its exit code and output.
fn scrub_now(cluster: &Cluster, id: u64) -> (bool, String) {
    let mut args = vec![
        "scrub".to_string(),
        "--now".into(),
        "--addr".into(),
        cluster.addrs[&id].to_string(),
    ];
    args.extend(cluster.cli_tls("admin"));
    let output = std::process::Command::new(BIN)
        .args(&args)
        .output()
        .expect("the CLI runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scrub_finds_and_repairs_bit_rot_on_one_replica() {
    let _one = one_cluster_at_a_time().await;
    let cluster = Cluster::start_with(3, &["--size", "64MiB", "--scrub-rate", "0"]).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let data: Vec<u8> = (0..4 * MIB as usize).map(|i| (i % 251) as u8).collect();
    cluster
        .write(writer, 8 * MIB, Bytes::from(data))
        .await
        .unwrap();

    // Nothing differs yet.
    let (ok, out) = scrub_now(&cluster, writer);
    assert!(ok, "{out}");
    assert!(out.contains("64 extents compared, 0 differed"), "{out}");

    // Bit rot in extent 9 (1 MiB extents) of one follower.
    let follower = *cluster.ids.iter().find(|id| **id != writer).unwrap();
    rot(&cluster, follower, 9 * MIB + 12_345, 512);
    assert!(
        cluster.digests(follower, 9 * MIB, MIB).await
            != cluster.digests(writer, 9 * MIB, MIB).await,
        "the rot changed the follower's copy"
    );

    let (ok, out) = scrub_now(&cluster, writer);
    assert!(ok, "{out}");
    assert!(
        out.contains(&format!(
            "extent 9: node(s) {follower} differed from node {writer}; repaired"
        )),
        "{out}"
    );
    assert!(
        out.contains("64 extents compared, 1 differed, 1 repaired"),
        "{out}"
    );
    let writers = cluster.digests(writer, 0, SIZE).await;
    for id in &cluster.ids {
        let differ: Vec<usize> = (cluster.digests(*id, 0, SIZE).await.iter())
            .zip(&writers)
            .enumerate()
            .filter(|(_, (a, b))| a != b)
            .map(|(extent, _)| extent)
            .collect();
        assert!(
            differ.is_empty(),
            "node {id} differs from the writer after the repair in extents {differ:?}"
        );
    }

    // Status and metrics report it.
    let status = cluster.status(writer).await.unwrap();
    assert_eq!(
        (status.scrub_last_found, status.scrub_last_repaired),
        (1, 1),
        "{status:?}"
    );
    assert_eq!(status.scrub_last_checked_extents, 64);
    assert!(status.scrub_last_finished_unix > 0);
    let (code, metrics) = http_get(cluster.http_addrs[&writer], "/metrics");
    assert_eq!(code, 200);
    for line in [
        "replica_ha_scrub_differences_found_total{volume=\"vol0\"} 1",
        "replica_ha_scrub_differences_repaired_total{volume=\"vol0\"} 1",
        "replica_ha_scrub_passes_total{volume=\"vol0\"} 2",
        "replica_ha_scrub_running{volume=\"vol0\"} 0",
    ] {
        assert!(metrics.contains(line), "missing {line:?} in\n{metrics}");
    }
    promtool_accepts(&metrics);
    assert!(
        cluster.log(writer).contains("in-sync copies differed"),
        "the finding is logged"
    );

    // The writer's own copy rots: the two followers' copy is the majority.
    rot(&cluster, writer, 10 * MIB, 4096);
    let (ok, out) = scrub_now(&cluster, writer);
    assert!(ok, "{out}");
    assert!(
        out.contains(&format!("extent 10: node(s) {writer} differed from node")),
        "{out}"
    );
    let read = cluster.read(writer, 10 * MIB, 4096).await.unwrap();
    let expected: Vec<u8> = (2 * MIB as usize..2 * MIB as usize + 4096)
        .map(|i| (i % 251) as u8)
        .collect();
    assert!(read == expected, "the writer serves the repaired bytes");

    // A follower does not scrub.
    let (ok, out) = scrub_now(&cluster, follower);
    assert!(!ok, "{out}");
    assert!(out.contains("not the active writer"), "{out}");
}

/// With only two in-sync copies nothing says which is right: the writer's
/// is kept (so every copy holds one result), and the bytes it replaced are
/// saved on the writer, not lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_majority_the_writers_copy_is_kept_and_the_other_saved() {
    let _one = one_cluster_at_a_time().await;
    let mut cluster = Cluster::start_with(3, &["--size", "64MiB", "--scrub-rate", "0"]).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let followers: Vec<u64> = cluster
        .ids
        .iter()
        .copied()
        .filter(|id| *id != writer)
        .collect();
    // One follower goes away and leaves the in-sync set.
    cluster.kill(followers[0]);
    cluster
        .write(writer, 0, Bytes::from(vec![0x11; 4096]))
        .await
        .unwrap();
    cluster
        .wait_in_sync(writer, followers[0], false, WAIT)
        .await;
    cluster
        .write(writer, 3 * MIB, Bytes::from(vec![0x33; 8192]))
        .await
        .unwrap();
    rot(&cluster, followers[1], 3 * MIB + 100, 64);
    let rotten = {
        let path = cluster
            .data_dir(followers[1])
            .join("replica")
            .join("volume.img");
        let mut extent = vec![0u8; MIB as usize];
        let file = std::fs::File::open(path).unwrap();
        file.read_exact_at(&mut extent, 3 * MIB).unwrap();
        extent
    };

    let (ok, out) = scrub_now(&cluster, writer);
    assert!(ok, "{out}");
    assert!(
        out.contains(&format!(
            "extent 3: node(s) {} differed from node {writer}; repaired (no majority",
            followers[1]
        )),
        "{out}"
    );
    let kept_dir = cluster.data_dir(writer).join("scrub-kept");
    let saved: Vec<_> = std::fs::read_dir(&kept_dir)
        .expect("the replaced copy is saved")
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(saved.len(), 1, "{saved:?}");
    let name = saved[0].file_name().unwrap().to_string_lossy().to_string();
    assert!(
        name.starts_with(&format!("extent-3-node-{}-", followers[1])),
        "{name}"
    );
    assert!(
        std::fs::read(&saved[0]).unwrap() == rotten,
        "the saved file holds the replaced bytes"
    );
    assert!(
        cluster.digests(followers[1], 3 * MIB, MIB).await
            == cluster.digests(writer, 3 * MIB, MIB).await,
        "the follower holds the writer's copy now"
    );
}

/// `scrub --now` does not queue behind a paced background pass: it ends
/// that pass (which does not count) and runs its own at full speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scrub_now_ends_a_paced_pass_and_runs_its_own() {
    let _one = one_cluster_at_a_time().await;
    // 64 MiB at 1 MiB/s: a background pass takes about a minute.
    let cluster = Cluster::start_with(3, &["--size", "64MiB", "--scrub-rate", "1MiB"]).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cluster.status(writer).await.unwrap().scrub_running {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no background pass started"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (ok, out) = scrub_now(&cluster, writer);
    assert!(ok, "{out}");
    assert!(out.contains("64 extents compared, 0 differed"), "{out}");
    let status = cluster.status(writer).await.unwrap();
    assert_eq!(
        status.scrub_passes, 1,
        "only the requested pass finished: {status:?}"
    );
}
