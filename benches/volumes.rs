//! Many volumes on one cluster: what they cost at rest and how long they
//! take to make, side by side with the same cluster holding only its
//! configured volume.
//!
//! On a three-node cluster of real processes on loopback it measures,
//! first with the configured volume alone and then with `VOLUMES` volumes
//! in all (the configured one and `VOLUMES - 1` of `SIZE` made through the
//! volume table):
//! - the time to create them all (`volume create`, one after another) and
//!   until every one has a writer;
//! - how many volumes each node writes;
//! - each node's CPU over `IDLE_SECS` seconds of rest (from
//!   `/proc/PID/stat`, as a share of one core), and its resident memory.
//!
//! Run: `cargo bench --bench volumes` (`VOLUMES=64 SIZE=1GiB IDLE_SECS=20`
//! are the defaults). Absolute figures drift on shared machines; compare
//! the two columns of one run.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::cluster::Cluster;
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(120);

/// The CPU time (user + system) process `pid` has used.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command name, which is in parentheses.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // utime and stime are fields 14 and 15 (1-based), 12 and 13 here.
    let hz = 100; // USER_HZ on Linux
    Duration::from_millis((ticks(11) + ticks(12)) * 1000 / hz)
}

/// Process `pid`'s resident memory in MiB.
fn rss_mib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse::<u64>().ok())
        .map_or(0, |kib| kib / 1024)
}

/// Each node's CPU share of one core over `secs` seconds of rest.
async fn idle_cpu(cluster: &Cluster, secs: u64) -> BTreeMap<u64, f64> {
    let pids: BTreeMap<u64, u32> = [1, 2, 3]
        .into_iter()
        .filter_map(|id| cluster.pid(id).map(|pid| (id, pid)))
        .collect();
    let before: BTreeMap<u64, Duration> =
        pids.iter().map(|(id, pid)| (*id, cpu_time(*pid))).collect();
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let wall = started.elapsed().as_secs_f64();
    pids.iter()
        .map(|(id, pid)| {
            let used = cpu_time(*pid).saturating_sub(before[id]).as_secs_f64();
            (*id, 100.0 * used / wall)
        })
        .collect()
}

/// How many volumes each node writes, as node 1 lists them.
async fn writers_per_node(cluster: &Cluster) -> BTreeMap<u64, usize> {
    let (_, out, _) = cluster.cli(1, &["volume", "list"]).await;
    let mut counts = BTreeMap::new();
    for line in out.lines().skip(1) {
        let words: Vec<&str> = line.split_whitespace().collect();
        if let Some(writer) = words.get(6).and_then(|w| w.parse::<u64>().ok()) {
            *counts.entry(writer).or_default() += 1;
        }
    }
    counts
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let volumes = common::env_u64("VOLUMES", 64).max(1);
    let idle = common::env_u64("IDLE_SECS", 20);
    let size = std::env::var("SIZE").unwrap_or_else(|_| "1GiB".into());
    let cluster = Cluster::start(3).await;
    cluster.wait_for_writer(&[1, 2, 3], WAIT).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cpu_one = idle_cpu(&cluster, idle).await;
    let rss_one: BTreeMap<u64, u64> = (1..=3)
        .map(|id| (id, rss_mib(cluster.pid(id).unwrap_or(0))))
        .collect();

    let started = Instant::now();
    let names: Vec<String> = (1..volumes).map(|n| format!("v{n}")).collect();
    for name in &names {
        let (ok, out, err) = cluster
            .cli(1, &["volume", "create", name, "--size", &size])
            .await;
        assert!(ok, "volume create {name}: {out} {err}");
    }
    let created = started.elapsed();
    for name in &names {
        cluster.wait_volume_writer(&[1], name, WAIT).await;
    }
    let written = started.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let writers = writers_per_node(&cluster).await;
    let cpu_many = idle_cpu(&cluster, idle).await;
    let rss_many: BTreeMap<u64, u64> = (1..=3)
        .map(|id| (id, rss_mib(cluster.pid(id).unwrap_or(0))))
        .collect();

    println!(
        "volumes: {volumes} ({} made through the table, {size} each)",
        names.len()
    );
    println!(
        "create all: {:.2} s; every one with a writer: {:.2} s",
        created.as_secs_f64(),
        written.as_secs_f64()
    );
    println!("writers per node: {writers:?}");
    println!(
        "{:<6} {:>14} {:>14} {:>12} {:>12}",
        "node", "idle CPU (1)", "idle CPU (N)", "RSS MiB (1)", "RSS MiB (N)"
    );
    for id in 1..=3u64 {
        println!(
            "{:<6} {:>13.2}% {:>13.2}% {:>12} {:>12}",
            id, cpu_one[&id], cpu_many[&id], rss_one[&id], rss_many[&id]
        );
    }
}
