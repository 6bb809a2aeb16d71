//! Resync speed on a three-node cluster of real processes (release build),
//! 1 GiB volume, no resync rate limit:
//! - incremental: a follower misses 1% of the volume (ten 1 MiB extents,
//!   written as 4 KiB blocks spread over them); time from its restart to
//!   its return to the in-sync set, and the bytes copied — beside `cp` of
//!   just the changed bytes plus one digest pass over the volume;
//! - full: the follower's replica dir is emptied (a replaced disk) after
//!   the whole volume was written; rebuild MB/s beside `cp` of the image.
//!
//! Run: `cargo bench --bench resync`.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Duration;

use bytes::Bytes;
use common::cluster::Cluster;
use replica_ha::proto::replica as pb;
use replica_ha::proto::replica::replica_client::ReplicaClient;
use tokio::time::Instant;

const MIB: u64 = 1 << 20;
const SIZE: u64 = 1024 * MIB;

async fn in_sync(cluster: &Cluster, writer: u64, id: u64) -> bool {
    cluster
        .status(writer)
        .await
        .is_some_and(|s| s.in_sync.contains(&id.to_string()))
}

async fn wait(cluster: &Cluster, writer: u64, id: u64, want: bool) -> Duration {
    let started = Instant::now();
    while in_sync(cluster, writer, id).await != want {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "resync did not finish"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    started.elapsed()
}

async fn copied(cluster: &Cluster, writer: u64, id: u64) -> u64 {
    let status = cluster.status(writer).await.unwrap();
    status
        .replicas
        .iter()
        .find(|r| r.id == id.to_string())
        .map_or(0, |r| r.resync_copied_bytes)
}

/// One digest pass over the whole volume on `id`, as the resync makes it.
async fn digest_pass(cluster: &Cluster, id: u64) -> Duration {
    let volume = cluster.volume_ref(id).await;
    let mut client = ReplicaClient::new(cluster.peer_channel(id));
    let started = Instant::now();
    for chunk in 0..SIZE / (64 * MIB) {
        client
            .digest(pb::DigestRequest {
                volume: Some(volume.clone()),
                offset: chunk * 64 * MIB,
                length: 64 * MIB,
            })
            .await
            .unwrap();
    }
    started.elapsed()
}

fn cp_time(from: &std::path::Path, bytes: u64) -> Duration {
    let to = std::env::temp_dir().join("replica-ha-bench-cp.img");
    let started = std::time::Instant::now();
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "head -c {bytes} {} > {} && sync {}",
            from.display(),
            to.display(),
            to.display()
        ))
        .status()
        .unwrap();
    assert!(status.success());
    let took = started.elapsed();
    let _ = std::fs::remove_file(to);
    took
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let mut cluster = Cluster::new(3);
    cluster.extra_args = vec![
        "--size".into(),
        "1GiB".into(),
        "--resync-rate".into(),
        "0".into(),
    ];
    for id in cluster.ids.clone() {
        cluster.spawn(id);
    }
    let (writer, _) = cluster
        .wait_for_writer(&[1, 2, 3], Duration::from_secs(30))
        .await;
    let follower = *cluster.ids.iter().find(|id| **id != writer).unwrap();
    println!("filling the 1 GiB volume ...");
    for i in 0..SIZE / (4 * MIB) {
        let data = Bytes::from(vec![(i % 250) as u8 + 1; 4 * MIB as usize]);
        cluster.write(writer, i * 4 * MIB, data).await.unwrap();
    }

    // Incremental: 1% of the volume changes while the follower is down.
    cluster.kill(follower);
    let mut changed = 0u64;
    for extent in (0..1024u64).step_by(103).take(10) {
        for block in 0..256u64 {
            let offset = extent * MIB + block * 4096;
            cluster
                .write(writer, offset, Bytes::from(vec![0xa5; 4096]))
                .await
                .unwrap();
            changed += 4096;
        }
    }
    wait(&cluster, writer, follower, false).await;
    cluster.spawn(follower);
    let took = wait(&cluster, writer, follower, true).await;
    let sent = copied(&cluster, writer, follower).await;
    let pass = digest_pass(&cluster, writer).await;
    let image = cluster.data_dir(writer).join("replica").join("volume.img");
    let cp_changed = cp_time(&image, changed);
    let baseline = cp_changed + pass;
    println!(
        "incremental: {} MiB changed, {} MiB sent, {:.2} s from restart to in sync \
         (incl. node start and the 0.5 s resync poll); baseline cp of the changed bytes \
         {:.3} s + one digest pass {:.2} s = {:.2} s; ratio {:.1}",
        changed / MIB,
        sent / MIB,
        took.as_secs_f64(),
        cp_changed.as_secs_f64(),
        pass.as_secs_f64(),
        baseline.as_secs_f64(),
        took.as_secs_f64() / baseline.as_secs_f64()
    );

    // Full: a replaced (empty) disk.
    cluster.kill(follower);
    std::fs::remove_dir_all(cluster.data_dir(follower).join("replica")).unwrap();
    cluster
        .write(writer, 0, Bytes::from(vec![0x42; 4096]))
        .await
        .unwrap();
    wait(&cluster, writer, follower, false).await;
    cluster.spawn(follower);
    let took = wait(&cluster, writer, follower, true).await;
    let sent = copied(&cluster, writer, follower).await;
    let cp = cp_time(&image, SIZE);
    let rebuild = sent as f64 / MIB as f64 / took.as_secs_f64();
    let cp_rate = SIZE as f64 / MIB as f64 / cp.as_secs_f64();
    println!(
        "full rebuild: {} MiB in {:.2} s = {rebuild:.0} MiB/s; cp of the 1 GiB image \
         (with sync) {:.2} s = {cp_rate:.0} MiB/s; ratio {:.2}",
        sent / MIB,
        took.as_secs_f64(),
        cp.as_secs_f64(),
        rebuild / cp_rate
    );
}
