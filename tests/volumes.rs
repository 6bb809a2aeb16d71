//! Many volumes per cluster, with real node processes: the volume table in
//! the cluster group (group 0), through the CLI and the admin API.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::cluster::Cluster;

const WAIT: Duration = Duration::from_secs(30);

/// The names, groups and placements `volume list` prints on node `id`.
async fn listed(cluster: &Cluster, id: u64) -> Vec<(String, String, String)> {
    let (ok, out, err) = cluster.cli(id, &["volume", "list"]).await;
    assert!(ok, "volume list: {err}");
    out.lines()
        .skip(1)
        .map(|line| {
            let words: Vec<&str> = line.split_whitespace().collect();
            (
                words[0].to_string(),
                words[4].to_string(),
                words[5].to_string(),
            )
        })
        .collect()
}

/// Polls until `volume list` on node `id` shows `want`.
async fn wait_listed(cluster: &Cluster, id: u64, want: &[(&str, &str, &str)]) {
    let want: Vec<_> = want
        .iter()
        .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
        .collect();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let now = listed(cluster, id).await;
        if now == want {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "node {id} lists {now:?}, not {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn volumes_are_created_once_by_name_listed_everywhere_and_deleted() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let cluster = Cluster::start(3).await;
    let (leader, _) = cluster.wait_for_leader(&[1, 2, 3], WAIT).await;
    let follower = [1, 2, 3].into_iter().find(|id| *id != leader).unwrap();
    // The configured volume is the cluster group's own.
    wait_listed(&cluster, follower, &[("vol0", "0", "1,2,3")]).await;

    // Asked of a follower: it names the leader, and the CLI asks there.
    let (ok, out, err) = cluster
        .cli(follower, &["volume", "create", "db", "--size", "64MiB"])
        .await;
    assert!(ok, "create: {out} {err}");
    assert!(out.contains("volume db created"), "{out}");
    assert!(out.contains("copies       3"), "{out}");
    for id in [1, 2, 3] {
        wait_listed(
            &cluster,
            id,
            &[("vol0", "0", "1,2,3"), ("db", "1", "1,2,3")],
        )
        .await;
    }
    // Again, as asked: the same volume, nothing new.
    let (ok, out, _) = cluster
        .cli(leader, &["volume", "create", "db", "--size", "64MiB"])
        .await;
    assert!(ok && out.contains("exists as asked"), "{out}");

    // Refusals, each with its reason, changing nothing.
    for (args, why) in [
        (
            &["volume", "create", "db", "--size", "128MiB"][..],
            "exists with another size",
        ),
        (
            &["volume", "create", "vol0", "--size", "64MiB"],
            "cluster group's own",
        ),
        (
            &["volume", "create", "Bad", "--size", "64MiB"],
            "bad volume name",
        ),
        (
            &["volume", "create", "odd", "--size", "1000"],
            "bad volume size",
        ),
        (
            &[
                "volume",
                "create",
                "wide",
                "--size",
                "1MiB",
                "--replicas",
                "4",
            ],
            "4 copies asked for",
        ),
        (&["volume", "delete", "nope"], "no volume nope"),
        (&["volume", "delete", "vol0"], "cannot be deleted"),
    ] {
        let (ok, out, err) = cluster.cli(leader, args).await;
        assert!(!ok && err.contains(why), "{args:?}: {out} {err}");
    }
    let (ok, out, _) = cluster.cli(follower, &["volume", "show", "db"]).await;
    assert!(ok && out.contains("raft group   1"), "{out}");

    let (ok, out, err) = cluster.cli(follower, &["volume", "delete", "db"]).await;
    assert!(ok, "delete: {out} {err}");
    for id in [1, 2, 3] {
        wait_listed(&cluster, id, &[("vol0", "0", "1,2,3")]).await;
    }
    // A group is never reused: the next volume gets a new one.
    let (ok, out, err) = cluster
        .cli(
            leader,
            &[
                "volume",
                "create",
                "db",
                "--size",
                "64MiB",
                "--replicas",
                "2",
            ],
        )
        .await;
    assert!(ok, "{out} {err}");
    let (ok, out, _) = cluster.cli(leader, &["volume", "show", "db"]).await;
    assert!(
        ok && out.contains("raft group   2") && out.contains("copies       2"),
        "{out}"
    );
}

/// Volume `name`'s writer, once every node in `among` agrees on it.
async fn wait_writer(cluster: &Cluster, among: &[u64], name: &str) -> u64 {
    cluster.wait_volume_writer(among, name, WAIT).await
}

/// Writes `pattern` over the first MiB of volume `name` through node
/// `id`'s NBD export of that name, and reads it back.
async fn write_pattern(cluster: &Cluster, id: u64, name: &str, pattern: u8) {
    if let Err(out) = try_write_pattern(cluster, id, name, pattern).await {
        panic!("writing {name} through node {id}: {out}");
    }
}

/// [`write_pattern`], or what qemu-io said when it failed.
async fn try_write_pattern(
    cluster: &Cluster,
    id: u64,
    name: &str,
    pattern: u8,
) -> Result<(), String> {
    let uri = format!("nbd://{}/{name}", cluster.nbd_addrs[&id]);
    let out = common::tools::run_within(
        "qemu-io",
        &[
            "-f",
            "raw",
            "-c",
            &format!("write -P {pattern} 0 1M"),
            "-c",
            &format!("read -P {pattern} 0 1M"),
            &uri,
        ],
        WAIT,
    )
    .await;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    match out.status.success() && !text.contains("failed") {
        true => Ok(()),
        false => Err(text),
    }
}

/// Volume `name`'s term as node `id`'s `volume list` shows it.
async fn term_of(cluster: &Cluster, id: u64, name: &str) -> Option<u64> {
    let (_, out, _) = cluster.cli(id, &["volume", "list"]).await;
    out.lines()
        .map(|line| line.split_whitespace().collect::<Vec<_>>())
        .find(|words| words.first() == Some(&name))
        .and_then(|words| words.get(7)?.parse().ok())
}

/// Writes `pattern` to volume `name` through its writer, as a client that
/// follows the writer would: when the write fails because the writer
/// moved meanwhile (a lease lost on a starved machine, then the balancer
/// moving it back), it is written again through the new one; a failure
/// with the writer in place fails the test.
async fn write_through_writer(cluster: &Cluster, name: &str, pattern: u8) {
    for _ in 0..3 {
        let writer = wait_writer(cluster, &[1, 2, 3], name).await;
        let term = term_of(cluster, writer, name).await;
        match try_write_pattern(cluster, writer, name, pattern).await {
            Ok(()) => return,
            Err(out) => {
                let now = wait_writer(cluster, &[1, 2, 3], name).await;
                let moved = term_of(cluster, now, name).await != term;
                assert!(moved, "writing {name} through its writer {writer}: {out}");
            }
        }
    }
    panic!("the writer of {name} kept moving");
}

/// Reads volume `name`'s first MiB through node `id` and checks it holds
/// `pattern` only.
async fn read_pattern(cluster: &Cluster, id: u64, name: &str, pattern: u8) {
    let uri = format!("nbd://{}/{name}", cluster.nbd_addrs[&id]);
    let out = common::tools::run_ok_within(
        "qemu-io",
        &[
            "-r",
            "-f",
            "raw",
            "-c",
            &format!("read -P {pattern} 0 1M"),
            &uri,
        ],
        WAIT,
    )
    .await;
    assert!(
        !out.contains("failed") && !out.contains("mismatch"),
        "{name} on {id}: {out}"
    );
}

/// Every node's `status --json` and `status` list the configured volume
/// and each volume of `written` (name, writer) with its writer and term,
/// the same on every node, each of its three copies in sync, and say
/// whether that node writes it; every node's `/metrics` has each volume's
/// own series (term, gate), which promtool accepts.
async fn status_and_metrics_show(cluster: &Cluster, written: &[(&str, u64)]) {
    let mut terms = std::collections::BTreeMap::new();
    for id in [1, 2, 3] {
        let copies_in_sync = |s: &replica_ha::proto::admin::StatusReply| {
            written.iter().all(|(name, _)| {
                s.volumes.iter().any(|v| {
                    v.name == *name
                        && v.replicas.iter().filter(|r| r.state == "in_sync").count() == 3
                })
            })
        };
        cluster
            .wait_status(id, WAIT, "every copy in sync", copies_in_sync)
            .await;
        let (ok, out, err) = cluster.cli(id, &["status", "--json"]).await;
        assert!(ok, "status --json on {id}: {err}");
        let json: serde_json::Value = serde_json::from_str(&out).expect("status --json");
        let volumes = json["volumes"].as_array().expect("volumes");
        let names: Vec<&str> = volumes.iter().filter_map(|v| v["name"].as_str()).collect();
        assert_eq!(names, ["vol0", "a", "b"], "{out}");
        let (_, table, _) = cluster.cli(id, &["status"]).await;
        let (code, metrics) = common::tools::http_get(cluster.http_addrs[&id], "/metrics");
        assert_eq!(code, 200);
        for (name, writer) in written {
            let volume = volumes.iter().find(|v| v["name"] == *name).unwrap();
            assert_eq!(volume["here"], "running", "{volume}");
            assert_eq!(volume["leader"], *writer, "{volume}");
            assert_eq!(volume["writing"], id == *writer, "{volume}");
            let term = volume["term"].as_u64().expect("a term");
            assert_eq!(
                *terms.entry(*name).or_insert(term),
                term,
                "{name}'s term on node {id}"
            );
            // volume  group  writer  term  this node  copies
            let row: Vec<&str> = table
                .lines()
                .map(|line| line.split_whitespace().collect::<Vec<_>>())
                .find(|words| words.first() == Some(name) && words.len() > 5)
                .unwrap_or_else(|| panic!("no row of {name} in\n{table}"));
            let writes = if id == *writer { "writes" } else { "copy" };
            assert_eq!(
                row[2..5],
                [writer.to_string().as_str(), &term.to_string(), writes],
                "{table}"
            );
            for series in [
                format!("replica_ha_term{{volume=\"{name}\"}} {term}\n"),
                format!(
                    "replica_ha_gate_open{{volume=\"{name}\"}} {}\n",
                    u8::from(id == *writer)
                ),
            ] {
                assert!(metrics.contains(&series), "no {series:?} in\n{metrics}");
            }
        }
        common::tools::promtool_accepts(&metrics);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_volume_has_its_own_group_writer_and_data_and_status_and_metrics_show_it() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let cluster = Cluster::start(3).await;
    cluster.wait_for_leader(&[1, 2, 3], WAIT).await;
    for name in ["a", "b"] {
        let (ok, out, err) = cluster
            .cli(1, &["volume", "create", name, "--size", "8MiB"])
            .await;
        assert!(ok, "create {name}: {out} {err}");
    }
    let writer_a = wait_writer(&cluster, &[1, 2, 3], "a").await;
    let writer_b = wait_writer(&cluster, &[1, 2, 3], "b").await;
    write_pattern(&cluster, writer_a, "a", 0x0a).await;
    write_pattern(&cluster, writer_b, "b", 0x0b).await;
    // Each volume reads back its own bytes, and the configured volume is
    // untouched (a volume created through the table starts zeroed).
    read_pattern(&cluster, writer_a, "a", 0x0a).await;
    read_pattern(&cluster, writer_b, "b", 0x0b).await;
    let (writer0, _) = cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    read_pattern(&cluster, writer0, "vol0", 0).await;
    // Every node lists both exports.
    let listed = common::tools::run_ok_within(
        "nbdinfo",
        &[
            "--list",
            "--json",
            &format!("nbd://{}", cluster.nbd_addrs[&1]),
        ],
        WAIT,
    )
    .await;
    for name in ["\"vol0\"", "\"a\"", "\"b\""] {
        assert!(listed.contains(name), "{listed}");
    }
    status_and_metrics_show(&cluster, &[("a", writer_a), ("b", writer_b)]).await;
}

/// Polls until `check` holds, or fails saying `what`.
async fn wait_until(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The export names node `id` lists.
async fn exports_of(cluster: &Cluster, id: u64) -> String {
    common::tools::run_ok_within(
        "nbdinfo",
        &[
            "--list",
            "--json",
            &format!("nbd://{}", cluster.nbd_addrs[&id]),
        ],
        WAIT,
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_copy_is_never_served_empty_and_a_copy_deleted_while_down_is_removed() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::start(3).await;
    cluster.wait_for_leader(&[1, 2, 3], WAIT).await;
    let (ok, out, err) = cluster
        .cli(1, &["volume", "create", "a", "--size", "8MiB"])
        .await;
    assert!(ok, "{out} {err}");
    let writer = wait_writer(&cluster, &[1, 2, 3], "a").await;
    write_pattern(&cluster, writer, "a", 0x5a).await;
    let lost = [1, 2, 3].into_iter().find(|id| *id != writer).unwrap();
    let copy = cluster.data_dir(lost).join("volumes/1-a");
    assert!(copy.join("replica").exists(), "{}", copy.display());

    // Its copy gone, its Raft state intact: the node does not start the
    // volume (an empty copy would count as the one it held, S8).
    cluster.kill(lost);
    std::fs::remove_dir_all(copy.join("replica")).unwrap();
    cluster.spawn(lost);
    wait_until("the node refuses to start the lost copy", async || {
        cluster
            .log(lost)
            .contains("is missing but its Raft group's state is here")
    })
    .await;
    assert!(!exports_of(&cluster, lost).await.contains("\"a\""));
    assert!(!copy.join("replica").exists(), "an empty copy was made");
    read_pattern(&cluster, writer, "a", 0x5a).await;

    // Deleted while that node is down: it removes what is left when back.
    cluster.kill(lost);
    let (ok, _, err) = cluster.cli(writer, &["volume", "delete", "a"]).await;
    assert!(
        !ok && err.contains("cannot say whether a client uses it"),
        "{err}"
    );
    let (ok, out, err) = cluster
        .cli(writer, &["volume", "delete", "a", "--force"])
        .await;
    assert!(ok, "{out} {err}");
    cluster.spawn(lost);
    wait_until("the deleted volume's copy is removed", async || {
        !copy.exists()
    })
    .await;
    wait_until("the writer's copy is removed", async || {
        !cluster.data_dir(writer).join("volumes/1-a").exists()
    })
    .await;
}

/// How many of the table's volumes (not the configured one) each node
/// writes, as node `id`'s
/// `volume list` shows them; `None` while a volume has no writer.
async fn writers_per_node(cluster: &Cluster, id: u64) -> Option<BTreeMap<u64, usize>> {
    let (ok, out, _) = cluster.cli(id, &["volume", "list"]).await;
    if !ok {
        return None;
    }
    let mut counts = BTreeMap::new();
    // The configured volume (group 0) is the cluster group's, not balanced.
    let table = out
        .lines()
        .skip(1)
        .filter(|line| line.split_whitespace().nth(4) != Some("0"));
    for line in table {
        let writer = line.split_whitespace().nth(6)?.parse::<u64>().ok()?;
        *counts.entry(writer).or_default() += 1;
    }
    Some(counts)
}

/// Polls until node `id` lists each of `nodes` writing `each` volumes.
async fn wait_spread(cluster: &Cluster, id: u64, nodes: &[u64], each: usize) {
    let want: BTreeMap<u64, usize> = nodes.iter().map(|n| (*n, each)).collect();
    let mut last = None;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let now = writers_per_node(cluster, id).await;
        if now.as_ref() == Some(&want) {
            return;
        }
        last = now.or(last);
        assert!(
            tokio::time::Instant::now() < deadline,
            "writers per node {last:?}, not {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Whether node `id` sees volume `name` written by the node the table
/// prefers for it (where the balancer leaves it).
async fn on_preferred_writer(cluster: &Cluster, id: u64, name: &str) -> bool {
    let (ok, out, _) = cluster.cli(id, &["volume", "show", name]).await;
    let field = |key: &str| {
        out.lines()
            .find_map(|line| line.trim().strip_prefix(key))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|word| word.parse::<u64>().ok())
    };
    ok && field("writer").is_some() && field("writer") == field("preferred")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writers_spread_over_the_nodes_and_return_to_a_node_that_comes_back() {
    let _serial = common::cluster::one_cluster_at_a_time().await;
    let mut cluster = Cluster::start_with(3, &["--size", "16MiB", "--balance-interval", "1"]).await;
    cluster.wait_for_leader(&[1, 2, 3], WAIT).await;
    let names = ["v1", "v2", "v3", "v4", "v5", "v6"];
    cluster.add_volumes(&names, WAIT).await;
    // Six volumes on three nodes: whoever won the elections, the balancer
    // leaves two writers on each.
    wait_spread(&cluster, 1, &[1, 2, 3], 2).await;

    // A writer moved by hand, asked through a node that does not write the
    // volume (it names the writer, which the CLI asks next)...
    let writer = wait_writer(&cluster, &[1, 2, 3], "v1").await;
    let to = if writer == 3 { 2 } else { 3 };
    let asked = 6 - writer - to;
    let (ok, out, err) = cluster
        .cli(
            asked,
            &["transfer", "--volume", "v1", "--to", &to.to_string()],
        )
        .await;
    assert!(ok, "transfer --volume v1 --to {to}: {out} {err}");
    assert!(
        out.contains(&format!("node {to} now leads volume v1")),
        "{out}"
    );
    // ... and a node that holds no copy, or a volume that does not exist,
    // is refused.
    let (ok, _, err) = cluster
        .cli(asked, &["transfer", "--volume", "nope", "--to", "2"])
        .await;
    assert!(!ok && err.contains("no volume nope"), "{err}");
    // The balancer moves it back once the interval has passed.
    wait_spread(&cluster, 1, &[1, 2, 3], 2).await;

    // Node 3 dies: its volumes fail over to nodes 1 and 2; when it comes
    // back, and its copies are in sync, it gets its share back.
    cluster.kill(3);
    wait_until("every volume written by node 1 or 2", async || {
        let counts = writers_per_node(&cluster, 1).await;
        counts.is_some_and(|c| c.keys().all(|n| *n != 3) && c.values().sum::<usize>() == 6)
    })
    .await;
    cluster.spawn(3);
    wait_spread(&cluster, 1, &[1, 2, 3], 2).await;
    // Settled: each on the node the table prefers, where it stays.
    for name in names {
        wait_until("the writer on its preferred node", async || {
            on_preferred_writer(&cluster, 1, name).await
        })
        .await;
    }
    for name in names {
        write_through_writer(&cluster, name, 0x5a).await;
    }
}
