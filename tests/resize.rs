//! Online resize with real node processes and real NBD clients: the
//! volume grows under a writing client, a new connection sees the new
//! size, writes past the old end land and read back, a follower that was
//! down meanwhile is rebuilt to the new size, the next writer serves it,
//! and shrinking is refused. The same for a volume of the table
//! (`volume resize`), asked of a node that holds no copy of it.

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
    nbd_size_of(cluster, id, "vol0").await
}

/// The NBD URI of volume `name` on node `id`.
fn uri_of(cluster: &Cluster, id: u64, name: &str) -> String {
    format!("nbd://{}/{name}", cluster.nbd_addrs[&id])
}

/// The size a new NBD connection to export `name` of `id` is offered.
async fn nbd_size_of(cluster: &Cluster, id: u64, name: &str) -> u64 {
    let uri = uri_of(cluster, id, name);
    let out = run_ok_within("nbdinfo", &["--size", &uri], TOOL_LIMIT).await;
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

/// Runs qemu-io `commands` on volume `name` of node `id`; none may fail.
async fn qemu_io(cluster: &Cluster, id: u64, name: &str, commands: &[&str]) {
    let uri = uri_of(cluster, id, name);
    let mut args = vec!["-f", "raw"];
    for command in commands {
        args.extend(["-c", command]);
    }
    args.push(&uri);
    let out = run_ok_within("qemu-io", &args, TOOL_LIMIT).await;
    assert!(
        !out.contains("failed") && !out.contains("mismatch"),
        "{name} on {id}: {out}"
    );
}

/// Volume `name`'s line of `volume list` on node `id`, in words.
async fn listed(cluster: &Cluster, id: u64, name: &str) -> Vec<String> {
    let (ok, out, err) = cluster.cli(id, &["volume", "list"]).await;
    assert!(ok, "volume list on {id}: {err}");
    let line = out
        .lines()
        .find(|line| line.split_whitespace().next() == Some(name));
    let words = line.unwrap_or_else(|| panic!("node {id} lists no {name}: {out}"));
    words.split_whitespace().map(String::from).collect()
}

/// `volume resize NAME` asked of node `id` grows the volume `from` one
/// size `to` the other.
async fn volume_grows(cluster: &Cluster, id: u64, name: &str, (from, to): (u64, u64)) {
    let size = to.to_string();
    let (ok, out, err) = cluster
        .cli(id, &["volume", "resize", name, "--size", &size])
        .await;
    assert!(ok, "{out} {err}");
    let said = format!("volume {name} grew from {from} to {to} bytes");
    assert!(out.contains(&said), "{out}");
}

/// Polls until `volume list` on node `id` shows volume `name` of `size`
/// bytes (a follower of the cluster group applies a change a heartbeat
/// after its leader).
async fn wait_listed_size(cluster: &Cluster, id: u64, name: &str, size: u64) {
    let what = format!("node {id} lists {name} of {size} bytes");
    wait_until(&what, async || {
        listed(cluster, id, name).await[1] == size.to_string()
    })
    .await;
}

/// Polls until `check` holds, or fails saying `what`.
async fn wait_until(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Node `id`'s copy of table volume `name` of group 1, as it is on disk.
fn copy_of(cluster: &Cluster, id: u64, name: &str) -> Vec<u8> {
    let file = cluster
        .data_dir(id)
        .join(format!("volumes/1-{name}/replica/volume.img"));
    std::fs::read(&file).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_volume_grows_on_its_writer_from_any_node_and_a_copy_that_missed_it_is_rebuilt() {
    const SMALL: u64 = 8 << 20;
    const BIG: u64 = 16 << 20;
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::start(4).await;
    let (leader, _) = cluster.wait_for_writer(&[1, 2, 3, 4], WAIT).await;

    // `volume resize` of the configured volume, asked of another node,
    // goes to its writer.
    let follower = [1, 2, 3, 4].into_iter().find(|id| *id != leader).unwrap();
    volume_grows(&cluster, follower, "vol0", (SIZE, GROWN)).await;

    // Three copies on four nodes: one node holds none.
    let (ok, out, err) = cluster
        .cli(1, &["volume", "create", "db", "--size", "8MiB"])
        .await;
    assert!(ok, "{out} {err}");
    let holders: Vec<u64> = listed(&cluster, 1, "db").await[5]
        .split(',')
        .map(|id| id.parse().unwrap())
        .collect();
    let outsider = [1, 2, 3, 4]
        .into_iter()
        .find(|id| !holders.contains(id))
        .unwrap();
    let writer = cluster.wait_volume_writer(&holders, "db", WAIT).await;
    let others: Vec<u64> = holders.iter().copied().filter(|id| *id != writer).collect();
    let (away, stays) = (others[0], others[1]);

    // Refusals, on a node without a copy, each with its reason.
    for (name, size, why) in [
        ("nope", "16MiB", "no volume nope"),
        ("db", "4MiB", "cannot shrink"),
        ("db", "8389000", "multiple of 512"),
        ("db", "65TiB", "at most 70368744177664"),
    ] {
        let (ok, out, err) = cluster
            .cli(outsider, &["volume", "resize", name, "--size", size])
            .await;
        assert!(!ok && err.contains(why), "{name} {size}: {out} {err}");
    }
    assert_eq!(nbd_size_of(&cluster, writer, "db").await, SMALL);

    // Data before; then a copy goes away and misses writes and the resize.
    qemu_io(&cluster, writer, "db", &["write -P 0x11 0 1M"]).await;
    cluster.kill(away);
    qemu_io(&cluster, writer, "db", &["write -P 0x22 1M 1M"]).await;
    // The size is recorded in the table by the cluster group's leader,
    // which is not the writer: through `Node.RecordSize`.
    let (leader, _) = cluster
        .wait_for_leader(&[writer, stays, outsider], WAIT)
        .await;
    if leader == writer {
        let (ok, out, err) = cluster
            .cli(writer, &["transfer", "--to", &outsider.to_string()])
            .await;
        assert!(ok, "{out} {err}");
    }

    // Asked of the node without a copy: it names a holder that answers,
    // which names the writer.
    volume_grows(&cluster, outsider, "db", (SMALL, BIG)).await;
    let (ok, out, _) = cluster
        .cli(writer, &["volume", "resize", "db", "--size", "16MiB"])
        .await;
    assert!(ok && out.contains("already"), "{out}");
    for id in [writer, stays, outsider] {
        wait_listed_size(&cluster, id, "db", BIG).await;
    }
    assert_eq!(nbd_size_of(&cluster, writer, "db").await, BIG);
    // The old data is intact, and writes past the old end land.
    qemu_io(
        &cluster,
        writer,
        "db",
        &[
            "read -P 0x11 0 1M",
            "read -P 0x22 1M 1M",
            "write -P 0x33 12M 1M",
            "read -P 0x33 12M 1M",
        ],
    )
    .await;

    // The copy that missed it all returns, grows and is rebuilt: every
    // copy holds the same bytes, past the old end too.
    cluster.spawn(away);
    wait_until(
        "the returning copy is rebuilt to the new size",
        async || {
            let mine = copy_of(&cluster, away, "db");
            mine.len() as u64 == BIG
                && [writer, stays]
                    .iter()
                    .all(|id| copy_of(&cluster, *id, "db") == mine)
        },
    )
    .await;

    // A restarted writer opens its copy at the new size, the table says
    // so there, and the volume's next writer serves it with every byte.
    cluster.kill(writer);
    cluster.spawn(writer);
    let next = cluster.wait_volume_writer(&holders, "db", WAIT).await;
    wait_listed_size(&cluster, writer, "db", BIG).await;
    assert_eq!(nbd_size_of(&cluster, next, "db").await, BIG);
    qemu_io(
        &cluster,
        next,
        "db",
        &[
            "read -P 0x11 0 1M",
            "read -P 0x22 1M 1M",
            "read -P 0x33 12M 1M",
            "write -P 0x44 15M 1M",
        ],
    )
    .await;
    wait_until("every copy holds the last write", async || {
        let first = copy_of(&cluster, holders[0], "db");
        first.len() as u64 == BIG
            && holders[1..]
                .iter()
                .all(|id| copy_of(&cluster, *id, "db") == first)
    })
    .await;
}
