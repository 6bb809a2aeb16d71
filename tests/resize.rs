//! Online resize with real node processes and real NBD clients: the
//! volume grows under a writing client, a new connection sees the new
//! size, writes past the old end land and read back, a follower that was
//! down meanwhile is rebuilt to the new size, the next writer serves it,
//! and shrinking is refused.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::cluster::Cluster;
use common::load::{SIZE, assert_identical_over, check_acked, start_client};
use common::tools::{http_get, run_ok_within, uri, write_and_read_back};

const WAIT: Duration = Duration::from_secs(30);
const GROWN: u64 = 2 * SIZE;
const TOOL_LIMIT: Duration = Duration::from_secs(60);

/// The size a new NBD connection to `id` is offered, as nbdinfo reads it.
async fn nbd_size(cluster: &Cluster, id: u64) -> u64 {
    let out = run_ok_within(
        "nbdinfo",
        &["--size", &uri(cluster.nbd_addrs[&id])],
        TOOL_LIMIT,
    )
    .await;
    out.trim()
        .parse()
        .unwrap_or_else(|_| panic!("nbdinfo --size printed {out:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_volume_grows_online_and_a_follower_that_missed_it_is_rebuilt_to_the_new_size() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::start(3).await;
    let (writer, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    let others: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != writer).collect();
    let (away, follower) = (others[0], others[1]);
    assert_eq!(nbd_size(&cluster, writer).await, SIZE);

    // Refusals first: a follower does not resize, the volume never shrinks,
    // and a size that is not a multiple of 512 is refused; none changes it.
    let (ok, _, err) = cluster.cli(follower, &["resize", "--size", "32MiB"]).await;
    assert!(!ok && err.contains("not the active writer"), "{err}");
    let (ok, _, err) = cluster.cli(writer, &["resize", "--size", "8MiB"]).await;
    assert!(!ok && err.contains("cannot shrink"), "{err}");
    let (ok, _, err) = cluster.cli(writer, &["resize", "--size", "33554500"]).await;
    assert!(!ok && err.contains("multiple of 512"), "{err}");
    assert_eq!(nbd_size(&cluster, writer).await, SIZE);

    cluster.kill(away);
    let (stop, client) = start_client(&cluster, &[writer]);
    cluster.wait_for_writes(writer, 50, WAIT).await;
    let (ok, out, err) = cluster.cli(writer, &["resize", "--size", "32MiB"]).await;
    assert!(ok, "resize failed: {out} {err}");
    assert!(
        out.contains(&format!("grew from {SIZE} to {GROWN}")),
        "{out}"
    );
    // The same size again is no change.
    let (ok, out, _) = cluster.cli(writer, &["resize", "--size", "32MiB"]).await;
    assert!(ok && out.contains("already"), "{out}");

    // A new connection sees the new size; status and metrics show it on
    // every member, the follower too (it is committed).
    assert_eq!(nbd_size(&cluster, writer).await, GROWN);
    for id in [writer, follower] {
        cluster
            .wait_status(id, WAIT, "the new size", |s| s.volume_size == GROWN)
            .await;
        let (code, metrics) = http_get(cluster.http_addrs[&id], "/metrics");
        assert_eq!(code, 200);
        assert!(
            metrics.contains(&format!(
                "replica_ha_volume_size_bytes{{volume=\"vol0\"}} {GROWN}"
            )),
            "{metrics}"
        );
    }

    // Writes past the old end succeed and read back: through the admin
    // API and through a real NBD client.
    let tail = Bytes::from(vec![0x5a; 64 << 10]);
    cluster
        .write(writer, GROWN - (64 << 10), tail.clone())
        .await
        .unwrap();
    let nbd = uri(cluster.nbd_addrs[&writer]);
    let past_old_end = SIZE + (1 << 20);
    write_and_read_back(&nbd, past_old_end, TOOL_LIMIT).await;
    stop.send(true).unwrap();
    let acked = client.await.unwrap();

    // The follower that was down returns with its old 16 MiB copy and is
    // rebuilt to the new size.
    cluster.spawn(away);
    cluster.wait_in_sync(writer, away, true, WAIT).await;
    let file = cluster.data_dir(away).join("replica").join("volume.img");
    assert_eq!(std::fs::metadata(&file).unwrap().len(), GROWN);
    assert_identical_over(&cluster, &[writer, follower, away], GROWN).await;

    // The next writer serves the committed size.
    cluster.kill(writer);
    let (next, _) = cluster.wait_for_writer(&[follower, away], WAIT).await;
    assert_eq!(nbd_size(&cluster, next).await, GROWN);
    assert_eq!(
        cluster
            .read(next, GROWN - (64 << 10), 64 << 10)
            .await
            .unwrap(),
        tail
    );
    check_acked(&cluster, next, &acked).await;
    cluster
        .write(next, GROWN - 4096, Bytes::from(vec![7; 4096]))
        .await
        .unwrap();
}
