//! Resync with real node processes: a follower that missed writes comes
//! back into the in-sync set online, byte-identical, having received about
//! what changed; a replica whose disk was replaced (empty replica dir) is
//! rebuilt in full through the same path. Writes keep flowing meanwhile and
//! none is lost.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::cluster::{Cluster, one_cluster_at_a_time};
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(20);
const SIZE: u64 = 128 << 20;
const MIB: u64 = 1 << 20;

/// The BLAKE3 extent digests of node `id`'s whole replica.
async fn digests(cluster: &Cluster, id: u64) -> Vec<Bytes> {
    cluster.digests(id, 0, SIZE).await
}

/// Writes small blocks with distinct contents until told to stop; returns
/// every acknowledged (offset, data).
fn background_writes(
    cluster: Arc<Cluster>,
    writer: u64,
    stop: Arc<Mutex<bool>>,
) -> tokio::task::JoinHandle<BTreeMap<u64, Bytes>> {
    tokio::spawn(async move {
        let mut acked = BTreeMap::new();
        for i in 0u64.. {
            if *stop.lock().unwrap() {
                break;
            }
            // Distinct 4 KiB blocks spread over the volume's second half.
            let offset = 64 * MIB + (i * 7919 % 16384) * 4096;
            let data = Bytes::from(vec![(i % 251) as u8 + 1; 4096]);
            if cluster.write(writer, offset, data.clone()).await.is_ok() {
                acked.insert(offset, data);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        acked
    })
}

async fn verify_identical(cluster: &Cluster, writer: u64) {
    let reference = digests(cluster, writer).await;
    assert_eq!(reference.len() as u64, SIZE / MIB);
    for id in &cluster.ids {
        let theirs = digests(cluster, *id).await;
        for (extent, (a, b)) in reference.iter().zip(&theirs).enumerate() {
            assert!(
                a == b,
                "extent {extent} differs between node {writer} and node {id}"
            );
        }
    }
}

/// What `writer` reports of replica `id` (its resync counters among it).
async fn replica_status(
    cluster: &Cluster,
    writer: u64,
    id: u64,
) -> replica_ha::proto::admin::ReplicaStatus {
    let status = cluster.status(writer).await.unwrap();
    status
        .replicas
        .into_iter()
        .find(|r| r.id == id.to_string())
        .unwrap()
}

async fn copied_bytes(cluster: &Cluster, writer: u64, id: u64) -> u64 {
    replica_status(cluster, writer, id)
        .await
        .resync_copied_bytes
}

/// Writes `count` MiB, one at a time, spread evenly over the first `size`
/// bytes, each of its own byte from `first`. The first write after a
/// replica's death waits for its removal; one that fails meanwhile is
/// sent again.
async fn write_spread(cluster: &Cluster, writer: u64, count: u64, size: u64, first: u8) {
    for i in 0..count {
        let data = Bytes::from(vec![first.wrapping_add(i as u8); MIB as usize]);
        let deadline = Instant::now() + WAIT;
        while cluster
            .write(writer, i * (size / count), data.clone())
            .await
            .is_err()
        {
            assert!(Instant::now() < deadline, "the writer took no write");
        }
    }
}

/// Kills `first` (the writer, mid-rebuild of `follower`) and waits until
/// the next writer has `follower` back in sync; returns the next writer,
/// the survivor that is not `follower`, and what the next writer reports
/// of `follower`'s rebuild. Either survivor may win: the follower too (it
/// then rebuilds its own copy from the other).
async fn cut_off_writer(
    cluster: &mut Cluster,
    first: u64,
    follower: u64,
    wait: Duration,
) -> (u64, u64, replica_ha::proto::admin::ReplicaStatus) {
    cluster.kill(first);
    let others: Vec<u64> = cluster
        .ids
        .iter()
        .copied()
        .filter(|id| *id != first)
        .collect();
    let (second, _) = cluster
        .wait_for_writer(&others, Duration::from_secs(30))
        .await;
    let survivor = *others.iter().find(|id| **id != follower).unwrap();
    cluster.wait_in_sync(second, follower, true, wait).await;
    let replica = replica_status(cluster, second, follower).await;
    (second, survivor, replica)
}

/// Nodes `a` and `b` hold the same first `size` bytes (256 extents per
/// digest request).
async fn verify_identical_up_to(cluster: &Cluster, a: u64, b: u64, size: u64) {
    let mut offset = 0;
    while offset < size {
        let len = (256 * MIB).min(size - offset);
        assert!(
            cluster.digests(a, offset, len).await == cluster.digests(b, offset, len).await,
            "nodes {a} and {b} differ in [{offset}, +{len})"
        );
        offset += len;
    }
}

/// A node that was the writer before judges a copy by what its own fence
/// finds, not by the session it saw in its earlier term: a follower that
/// restarted under the other writer (which rebuilt it) is neither stalled
/// on at the promotion nor rebuilt again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_again_counts_on_the_copies_its_fence_found() {
    let _one = one_cluster_at_a_time().await;
    let mut cluster = Cluster::start_with(3, &["--size", &SIZE.to_string()]).await;
    let (first, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let [second, follower] = {
        let others: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != first).collect();
        [others[0], others[1]]
    };
    let block = |byte: u8| Bytes::from(vec![byte; 4096]);
    // `second` writes once, so it has seen the follower's session.
    transfer(&cluster, first, second).await;
    cluster.write(second, 0, block(1)).await.unwrap();
    transfer(&cluster, second, first).await;
    // Under `first`, the follower restarts and is rebuilt.
    restart_idle_and_wait_rebuilt(&mut cluster, first, follower, block(2)).await;
    cluster.wait_in_sync(first, follower, true, WAIT).await;
    // `second` again: its fence finds the follower's new session.
    transfer(&cluster, first, second).await;
    for i in 0..20u64 {
        cluster
            .write(second, 2 * MIB + i * 4096, block(3))
            .await
            .unwrap();
    }
    assert!(
        !cluster
            .log(second)
            .contains("replica restarted: not counted on until it is rebuilt"),
        "node {second} judged node {follower} by the session of its earlier term"
    );
    assert!(cluster.in_sync(second).await.contains(&follower));
    verify_identical(&cluster, second).await;
}

/// SIGKILLs `follower` and starts it again with nothing written meanwhile,
/// writes `data` at 1 MiB through `writer` once it is back, and waits
/// until `writer` has rebuilt it. No write failed on the follower while it
/// was down: only its new store session can make the writer rebuild it.
async fn restart_idle_and_wait_rebuilt(
    cluster: &mut Cluster,
    writer: u64,
    follower: u64,
    data: Bytes,
) {
    let rebuilds = |cluster: &Cluster| cluster.log(writer).matches("resync finished").count();
    let before = rebuilds(cluster);
    cluster.kill(follower);
    cluster.spawn(follower);
    cluster
        .wait_status(follower, WAIT, "the follower is back", |s| s.term > 0)
        .await;
    cluster.write(writer, MIB, data).await.unwrap();
    let deadline = Instant::now() + WAIT;
    while rebuilds(cluster) == before {
        assert!(
            Instant::now() < deadline,
            "node {follower} restarted and was never rebuilt"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Hands the writer's role from `from` to `to` and waits until `to` writes.
async fn transfer(cluster: &Cluster, from: u64, to: u64) {
    let (ok, out, err) = cluster
        .cli(from, &["transfer", "--to", &to.to_string()])
        .await;
    assert!(ok, "transfer {from} -> {to}: {out}{err}");
    let (now, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    assert_eq!(now, to);
}

/// A follower whose process restarts while nothing is written (so no
/// write fails on it meanwhile) is not counted on as before: its store was
/// opened again, and writes it had not flushed could have gone with the
/// page cache (on a power cut; a SIGKILL keeps them, but the writer cannot
/// tell the two apart). The writer notices the new session at the next
/// write, drops the copy and rebuilds it before it counts again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_restarted_while_idle_is_rebuilt_before_it_counts_again() {
    let _one = one_cluster_at_a_time().await;
    let mut cluster = Cluster::start_with(3, &["--size", &SIZE.to_string()]).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let follower = [1, 2, 3].into_iter().find(|id| *id != writer).unwrap();
    let block = |byte: u8| Bytes::from(vec![byte; 4096]);
    cluster.write(writer, 0, block(1)).await.unwrap();
    cluster.wait_in_sync(writer, follower, true, WAIT).await;
    restart_idle_and_wait_rebuilt(&mut cluster, writer, follower, block(2)).await;
    assert!(
        cluster
            .log(writer)
            .contains("replica restarted: not counted on until it is rebuilt")
    );
    cluster.wait_in_sync(writer, follower, true, WAIT).await;
    for (offset, byte) in [(0, 1), (MIB, 2)] {
        assert_eq!(
            cluster.read(writer, offset, 4096).await.unwrap(),
            block(byte)
        );
    }
    verify_identical(&cluster, writer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_returning_follower_and_a_replaced_disk_are_rebuilt_online() {
    let _one = one_cluster_at_a_time().await;
    let mut cluster = Cluster::start_with(3, &["--size", "128MiB"]).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    // The volume under test is not the only one.
    cluster.add_volumes(&["other", "more"], WAIT).await;
    let follower = *cluster.ids.iter().find(|id| **id != writer).unwrap();

    // 1. The follower misses 64 MiB of writes.
    cluster.kill(follower);
    for i in 0..16u64 {
        let data = Bytes::from(vec![(i + 1) as u8; 4 * MIB as usize]);
        cluster.write(writer, i * 4 * MIB, data).await.unwrap();
    }
    cluster.wait_in_sync(writer, follower, false, WAIT).await;

    // 2. It comes back while writes keep flowing.
    cluster.spawn(follower);
    let cluster = Arc::new(cluster);
    let stop = Arc::new(Mutex::new(false));
    let writes = background_writes(Arc::clone(&cluster), writer, Arc::clone(&stop));
    cluster
        .wait_in_sync(writer, follower, true, Duration::from_secs(60))
        .await;
    tokio::time::sleep(Duration::from_millis(300)).await; // writes after the return, too
    *stop.lock().unwrap() = true;
    let acked = writes.await.unwrap();
    assert!(!acked.is_empty());
    let copied = copied_bytes(&cluster, writer, follower).await;
    eprintln!(
        "incremental resync: 64 MiB changed while down (+{} KiB during), {} MiB copied",
        acked.len() * 4,
        copied / MIB
    );
    // Copies are whole 1 MiB extents: the 64 rewritten ones, plus at most
    // the extents the background writes touched before the rebuild began.
    let touched: std::collections::BTreeSet<u64> = acked.keys().map(|o| o / MIB).collect();
    assert!(
        copied >= 64 * MIB,
        "the missed extents were copied: {copied}"
    );
    assert!(
        copied <= (64 + touched.len() as u64) * MIB,
        "only changed extents are copied: {copied} bytes, {} extents touched",
        touched.len()
    );
    verify_identical(&cluster, writer).await;
    for (offset, data) in &acked {
        assert_eq!(&cluster.read(follower, *offset, 4096).await.unwrap(), data);
    }

    // 3. The follower's disk is replaced: an empty data dir, a new
    // incarnation, brought back by `members replace` (S8).
    let mut cluster = Arc::into_inner(cluster).expect("no other holder");
    cluster.kill(follower);
    cluster.wipe(follower);
    // A write notices it is gone, and the in-sync set shrinks.
    cluster
        .write(writer, 0, Bytes::from(vec![0xee; 4096]))
        .await
        .unwrap();
    cluster.wait_in_sync(writer, follower, false, WAIT).await;
    cluster.spawn(follower);
    cluster
        .wait_status(follower, WAIT, "waiting to be re-added", |s| {
            s.not_member.starts_with("replaced disk")
        })
        .await;
    let (ok, out, err) = cluster
        .cli(
            writer,
            &["members", "replace", "--id", &follower.to_string()],
        )
        .await;
    assert!(ok, "members replace: {out}{err}");
    cluster
        .wait_in_sync(writer, follower, true, Duration::from_secs(60))
        .await;
    let copied = copied_bytes(&cluster, writer, follower).await;
    eprintln!("full rebuild: {} MiB copied", copied / MIB);
    assert!(
        copied >= 64 * MIB,
        "every written extent was copied: {copied}"
    );
    verify_identical(&cluster, writer).await;
}

/// A cluster whose resync copies at most 8 MiB/s, so a 64 MiB rebuild
/// lasts long enough to interrupt.
async fn slow_resync_cluster() -> (Cluster, u64, u64) {
    let mut cluster = Cluster::start_with(3, &["--size", "128MiB", "--resync-rate", "8MiB"]).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let follower = *cluster.ids.iter().find(|id| **id != writer).unwrap();
    cluster.kill(follower);
    for i in 0..16u64 {
        let data = Bytes::from(vec![(i + 7) as u8; 4 * MIB as usize]);
        cluster.write(writer, i * 4 * MIB, data).await.unwrap();
    }
    cluster.wait_in_sync(writer, follower, false, WAIT).await;
    (cluster, writer, follower)
}

/// Waits until `writer` is rebuilding `id` and has copied something.
async fn wait_rebuilding(cluster: &Cluster, writer: u64, id: u64) {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(status) = cluster.status(writer).await {
            let replica = status.replicas.iter().find(|r| r.id == id.to_string());
            if replica.is_some_and(|r| r.resync_running && r.resync_copied_bytes > 0) {
                assert_eq!(replica.unwrap().state, "rebuilding");
                return;
            }
        }
        assert!(Instant::now() < deadline, "no rebuild of {id} started");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn verify_identical_among(cluster: &Cluster, ids: &[u64]) {
    let reference = digests(cluster, ids[0]).await;
    for id in &ids[1..] {
        let theirs = digests(cluster, *id).await;
        for (extent, (a, b)) in reference.iter().zip(&theirs).enumerate() {
            assert!(
                a == b,
                "extent {extent} differs between node {} and node {id}",
                ids[0]
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_interrupted_by_a_target_restart_finishes_correctly() {
    let _one = one_cluster_at_a_time().await;
    let (mut cluster, writer, follower) = slow_resync_cluster().await;
    cluster.spawn(follower);
    wait_rebuilding(&cluster, writer, follower).await;
    cluster.kill(follower);
    // Writes go on while it is down again; they fail on it, which ends the
    // rebuild without returning it. If the kill caught the rebuild in its
    // last step (the target marked joining), such a write cannot be
    // acknowledged until the return is settled (S5), and the gate holds it
    // until then (C2): no write is refused.
    for i in 0..4u64 {
        cluster
            .write(writer, 100 * MIB + i * 4096, Bytes::from(vec![0x5c; 4096]))
            .await
            .unwrap();
    }
    assert!(!cluster.in_sync(writer).await.contains(&follower));
    cluster.spawn(follower);
    cluster
        .wait_in_sync(writer, follower, true, Duration::from_secs(60))
        .await;
    verify_identical(&cluster, writer).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_interrupted_by_a_failover_is_finished_by_the_new_writer() {
    let _one = one_cluster_at_a_time().await;
    let (mut cluster, writer, follower) = slow_resync_cluster().await;
    cluster.spawn(follower);
    wait_rebuilding(&cluster, writer, follower).await;
    cluster.kill(writer);
    let survivors: Vec<u64> = cluster
        .ids
        .iter()
        .copied()
        .filter(|id| *id != writer)
        .collect();
    let (new_writer, _) = cluster.wait_for_writer(&survivors, WAIT).await;
    // Either survivor may lead, the half-rebuilt one too: it fences, then
    // rebuilds its own replica from the one in-sync survivor. Until that
    // finishes only one replica is in sync, below min_in_sync, so writes
    // are refused (S5) — they succeed once the rebuild is done.
    cluster
        .wait_in_sync(new_writer, follower, true, Duration::from_secs(60))
        .await;
    let data = Bytes::from(vec![0x77; 4096]);
    cluster
        .write(new_writer, 120 * MIB, data.clone())
        .await
        .unwrap();
    verify_identical_among(&cluster, &survivors).await;
    assert_eq!(cluster.read(follower, 120 * MIB, 4096).await.unwrap(), data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn divergent_unacknowledged_data_on_a_replica_is_corrected() {
    let _one = one_cluster_at_a_time().await;
    let mut cluster = Cluster::start_with(3, &["--size", "128MiB"]).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    // The volume under test is not the only one.
    cluster.add_volumes(&["other", "more"], WAIT).await;
    let follower = *cluster.ids.iter().find(|id| **id != writer).unwrap();
    cluster
        .write(writer, 0, Bytes::from(vec![0x11; 4096]))
        .await
        .unwrap();
    cluster.kill(follower);
    cluster
        .write(writer, 4096, Bytes::from(vec![0x22; 4096]))
        .await
        .unwrap();
    cluster.wait_in_sync(writer, follower, false, WAIT).await;
    // A write no writer acknowledged, on the down replica only, as one
    // that reached only it before its writer died leaves it: marked (S6)
    // and applied. The rebuild must compare that extent although no other
    // copy's missed-write map names it. (Bytes changed behind the store's
    // back, with no mark, are the scrub's to find: tests/scrub.rs.)
    let store = replica_ha::replica::disk::store::ReplicaStore::open(
        cluster.data_dir(follower).join("replica"),
        replica_ha::replica::disk::store::StoreIdentity::new(
            &cluster.cluster_id,
            "vol0",
            128 * MIB,
        ),
    )
    .await
    .unwrap();
    let stamp = store.floor_stamp().await;
    store
        .write(stamp, 50 * MIB, Bytes::from(vec![0xbd; 8192]), true)
        .await
        .unwrap();
    drop(store);
    cluster.spawn(follower);
    cluster
        .wait_in_sync(writer, follower, true, Duration::from_secs(60))
        .await;
    verify_identical(&cluster, writer).await;
    assert_eq!(
        cluster.read(follower, 50 * MIB, 8192).await.unwrap(),
        Bytes::from(vec![0; 8192])
    );
}

/// #21: a follower that missed 4 MiB of a 1 GiB and of an 8 GiB volume is
/// rebuilt from the missed-write map: by the resync's own counters it
/// compares and copies the extents written while it was away (and at most
/// a few more), whatever the volume's size, and ends identical.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_missed_4_mib_compares_what_it_missed_not_the_volume() {
    const GIB: u64 = 1 << 30;
    for gib in [1u64, 8] {
        let _one = one_cluster_at_a_time().await;
        let size = gib * GIB;
        let mut cluster = Cluster::start_with(3, &["--size", &format!("{gib}GiB")]).await;
        let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
        let follower = *cluster.ids.iter().find(|id| **id != writer).unwrap();
        cluster.kill(follower);
        write_spread(&cluster, writer, 4, size, 0x40).await;
        cluster.wait_in_sync(writer, follower, false, WAIT).await;
        cluster.spawn(follower);
        cluster
            .wait_in_sync(writer, follower, true, Duration::from_secs(60))
            .await;
        let replica = replica_status(&cluster, writer, follower).await;
        eprintln!(
            "{gib} GiB: compared {} of {} MiB, copied {} MiB, full = {}",
            replica.resync_done_bytes >> 20,
            replica.resync_total_bytes >> 20,
            replica.resync_copied_bytes >> 20,
            replica.resync_full
        );
        assert!(!replica.resync_full, "a map rebuild, not a full one");
        assert!(
            (4 * MIB..=8 * MIB).contains(&replica.resync_total_bytes),
            "compared {} bytes for 4 MiB missed",
            replica.resync_total_bytes
        );
        assert_eq!(replica.resync_done_bytes, replica.resync_total_bytes);
        assert!((4 * MIB..=replica.resync_total_bytes).contains(&replica.resync_copied_bytes));
        verify_identical_up_to(&cluster, follower, writer, size).await;
        for id in cluster.ids.clone() {
            cluster.kill(id);
        }
    }
}

/// #21, resume: the writer dies while it rebuilds a follower from the
/// missed-write map. The next writer rebuilds it from the same map (kept
/// on the replica that stays), comparing what the follower missed, not the
/// volume: the bytes compared over both writers stay far below one pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_cut_off_by_the_writers_death_goes_on_from_the_map() {
    let _one = one_cluster_at_a_time().await;
    const GIB: u64 = 1 << 30;
    let mut cluster = Cluster::start_with(3, &["--size", "1GiB", "--resync-rate", "2MiB"]).await;
    let (first, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let follower = *cluster.ids.iter().find(|id| **id != first).unwrap();
    cluster.kill(follower);
    write_spread(&cluster, first, 16, GIB, 0x60).await;
    cluster.wait_in_sync(first, follower, false, WAIT).await;
    cluster.spawn(follower);
    // Cut the rebuild off once it has copied something.
    let deadline = Instant::now() + Duration::from_secs(30);
    let before = loop {
        let copied = copied_bytes(&cluster, first, follower).await;
        if copied >= 2 * MIB {
            break copied;
        }
        assert!(Instant::now() < deadline, "the rebuild copied nothing");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let (_, survivor, replica) =
        cut_off_writer(&mut cluster, first, follower, Duration::from_secs(60)).await;
    eprintln!(
        "cut off after {} MiB copied; the next writer compared {} of {} MiB and copied {} MiB (full = {})",
        before >> 20,
        replica.resync_done_bytes >> 20,
        replica.resync_total_bytes >> 20,
        replica.resync_copied_bytes >> 20,
        replica.resync_full
    );
    assert!(!replica.resync_full, "the next writer used the map");
    assert!(
        replica.resync_total_bytes <= 20 * MIB,
        "the next writer compared {} bytes for 16 MiB missed",
        replica.resync_total_bytes
    );
    verify_identical_up_to(&cluster, follower, survivor, GIB).await;
}

/// #21, resume: a full rebuild cut off by the writer's death goes on, on
/// the next writer, from where it had verified. The bytes compared by both
/// writers together stay within one pass over the volume plus what the
/// first compared after it last recorded its progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_rebuild_cut_off_by_the_writers_death_resumes_where_it_verified() {
    let _one = one_cluster_at_a_time().await;
    const GIB: u64 = 1 << 30;
    let mut cluster = Cluster::start_with(3, &["--size", "1GiB", "--resync-rate", "4MiB"]).await;
    let (first, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let follower = *cluster.ids.iter().find(|id| **id != first).unwrap();
    cluster.kill(follower);
    write_spread(&cluster, first, 32, GIB, 0x30).await;
    cluster.wait_in_sync(first, follower, false, WAIT).await;
    let id = follower.to_string();
    let (ok, out, err) = cluster.cli(first, &["resync", "--full", "--id", &id]).await;
    assert!(ok, "{out}{err}");
    cluster.spawn(follower);
    // Cut the pass off once it has compared a good part of the volume.
    let deadline = Instant::now() + Duration::from_secs(60);
    let before = loop {
        let replica = replica_status(&cluster, first, follower).await;
        if replica.resync_running && replica.resync_full && replica.resync_done_bytes >= 384 * MIB {
            break replica.resync_done_bytes;
        }
        assert!(
            Instant::now() < deadline,
            "the full rebuild did not get far"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (_, survivor, replica) =
        cut_off_writer(&mut cluster, first, follower, Duration::from_secs(90)).await;
    eprintln!(
        "cut off after {} MiB compared; the next writer compared {} of {} MiB and copied {} MiB (full = {})",
        before >> 20,
        replica.resync_done_bytes >> 20,
        replica.resync_total_bytes >> 20,
        replica.resync_copied_bytes >> 20,
        replica.resync_full
    );
    assert!(replica.resync_full, "the rest of a full rebuild");
    assert!(
        replica.resync_total_bytes <= GIB - 256 * MIB,
        "the next writer started over: {} bytes to compare",
        replica.resync_total_bytes
    );
    assert!(
        before + replica.resync_total_bytes <= GIB + 128 * MIB,
        "{} + {} bytes compared for a {GIB}-byte volume",
        before,
        replica.resync_total_bytes
    );
    verify_identical_up_to(&cluster, follower, survivor, GIB).await;
}

/// `replica-ha resync --full --id N`: the next rebuild of an out-of-sync
/// replica compares every extent instead of its missed-write map; a
/// replica in sync, an unknown one, or a request without `--full` is
/// refused with the reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_rebuild_can_be_asked_for() {
    let _one = one_cluster_at_a_time().await;
    let mut cluster = Cluster::start_with(3, &["--size", "128MiB"]).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let mut followers = cluster.ids.iter().copied().filter(|id| *id != writer);
    let (follower, other) = (followers.next().unwrap(), followers.next().unwrap());
    async fn ask(cluster: &Cluster, writer: u64, args: Vec<String>) -> (bool, String, String) {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        cluster.cli(writer, &args).await
    }
    let args = |id: u64, full: bool| {
        let mut args = vec!["resync".to_string(), "--id".into(), id.to_string()];
        if full {
            args.push("--full".into());
        }
        args
    };
    let (ok, _, err) = ask(&cluster, writer, args(other, true)).await;
    assert!(!ok && err.contains("in sync"), "{err}");
    let (ok, _, err) = ask(&cluster, writer, args(9, true)).await;
    assert!(!ok && err.contains("not a replica"), "{err}");
    cluster.kill(follower);
    cluster
        .write(writer, 0, Bytes::from(vec![0x77; 4096]))
        .await
        .unwrap();
    cluster.wait_in_sync(writer, follower, false, WAIT).await;
    let (ok, _, err) = ask(&cluster, writer, args(follower, false)).await;
    assert!(!ok && err.contains("--full"), "{err}");
    let (ok, out, err) = ask(&cluster, writer, args(follower, true)).await;
    assert!(ok, "{out}{err}");
    cluster.spawn(follower);
    cluster
        .wait_in_sync(writer, follower, true, Duration::from_secs(60))
        .await;
    let replica = replica_status(&cluster, writer, follower).await;
    assert!(replica.resync_full, "the rebuild was a full one");
    assert_eq!(replica.resync_total_bytes, SIZE);
    verify_identical(&cluster, writer).await;
}
