//! Many volumes on one cluster, side by side with the same cluster holding
//! only its configured volume: issue #38's targets. What the volumes cost
//! at rest and take to make, how the balancer spreads their writers, how
//! fast those of a killed node fail over, and what one busy volume among
//! idle ones writes.
//!
//! One three-node cluster of real release processes on loopback, started
//! with `--size SIZE --balance-interval BALANCE_SECS`:
//! 1. With the configured volume `vol0` alone: each node's CPU over
//!    `IDLE_SECS` seconds of rest (from `/proc/PID/stat`, as a share of
//!    one core) and its resident memory; then fio's 4 KiB random writes at
//!    QD32 for `FIO_SECS` seconds over the whole of vol0, through its
//!    writer's NBD export.
//! 2. `VOLUMES - 1` volumes of `SIZE` (`v1`, `v2`, …) made through the
//!    volume table, one `volume create` after another: the time to create
//!    them all, and until every one has a writer.
//! 3. The balancer settling: every node's `ListVolumes` polled every
//!    200 ms, for up to `SETTLE_SECS`, until every table volume is written
//!    by its preferred node (the one the table recorded at its creation)
//!    and by no other. Writers per node count all `VOLUMES` volumes, vol0
//!    included: the balancer leaves vol0 with the cluster group's leader,
//!    so 64 volumes settle at 21/21/22 at best.
//! 4. Idle CPU and RSS again, every volume at rest.
//! 5. The fio job of step 1 on table volume `v1`, and then on vol0, each
//!    through its writer while every other volume idles. Their IOPS are
//!    set beside vol0's alone (the mean of steps 1 and 7) as a ratio. v1
//!    is the figure the target speaks of (a fresh volume, as vol0 was in
//!    step 1); vol0 is the same volume as in step 1, written once already.
//! 6. `RUNS` times: SIGKILL of the node that writes the most volumes. For
//!    each volume it wrote, the time from the kill until a surviving node
//!    is that volume's active writer (gate open, lease valid), and
//!    p50/p90/p99/max (nearest rank) over those volumes. Measured with a
//!    `WatchLeader` stream per volume on each survivor, opened before the
//!    kill: a node sends an update as soon as it sees a change, and looks
//!    every 20 ms, so each figure is late by up to about 20 ms plus its
//!    delivery. The node is then restarted, and the balancer settles again
//!    before the next run.
//!    A fio that fails (the writer dropped its connection) is reported
//!    with its error and counts as 0 IOPS.
//! 7. That cluster is stopped, and step 1's fio job runs again on a fresh
//!    one-volume cluster: how far the machine drifted meanwhile.
//!
//! A short table at the end sets each figure beside its target. Ratios and
//! counts are the result: absolute figures drift on a shared machine, and
//! nothing here asserts a speed. Every node process (and fio) is killed
//! when the run ends, fails or is interrupted (SIGINT, SIGTERM).
//!
//! Run: `cargo bench --bench volumes`. Knobs, with their defaults:
//! `VOLUMES=64 SIZE=1GiB IDLE_SECS=20 BALANCE_SECS=2 SETTLE_SECS=300
//! FIO_SECS=10 RUNS=3` (`BALANCE_SECS=0` turns the balancer off: step 3
//! and each run then wait only for one writer per volume). Needs fio.

#[path = "../tests/common/mod.rs"]
mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::cluster::Cluster;
use common::env_u64;
use common::percentile;
use common::tools::{FioFigures, fio_randwrite_qd32, volume_uri};
use replica_ha::proto::admin::{VolumeListRequest, WatchLeaderRequest};
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(120);

/// The run's knobs (see the module docs).
struct Knobs {
    volumes: u64,
    size: String,
    idle_secs: u64,
    balance_secs: u64,
    settle: Duration,
    fio_secs: u64,
    runs: u64,
}

impl Knobs {
    fn from_env() -> Knobs {
        Knobs {
            volumes: env_u64("VOLUMES", 64).max(2),
            size: std::env::var("SIZE").unwrap_or_else(|_| "1GiB".into()),
            idle_secs: env_u64("IDLE_SECS", 20),
            balance_secs: env_u64("BALANCE_SECS", 2),
            settle: Duration::from_secs(env_u64("SETTLE_SECS", 300)),
            fio_secs: env_u64("FIO_SECS", 10),
            runs: env_u64("RUNS", 3),
        }
    }
}

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

/// Each node's CPU (share of one core) over `secs` seconds of rest, and
/// its resident memory (MiB) after them.
async fn at_rest(cluster: &Cluster, secs: u64) -> BTreeMap<u64, (f64, u64)> {
    let pids: BTreeMap<u64, u32> = cluster
        .ids
        .iter()
        .filter_map(|id| cluster.pid(*id).map(|pid| (*id, pid)))
        .collect();
    let before: BTreeMap<u64, Duration> =
        pids.iter().map(|(id, pid)| (*id, cpu_time(*pid))).collect();
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(secs)).await;
    let wall = started.elapsed().as_secs_f64();
    pids.iter()
        .map(|(id, pid)| {
            let used = cpu_time(*pid).saturating_sub(before[id]).as_secs_f64();
            (*id, (100.0 * used / wall, rss_mib(*pid)))
        })
        .collect()
}

/// One volume as the nodes list it.
#[derive(Debug, Default, Clone)]
struct Seen {
    /// The nodes that say they write it now.
    writers: Vec<u64>,
    /// The node the balancer moves its writer to (0: none, vol0).
    preferred: u64,
    /// Its size in bytes.
    size: u64,
}

/// Every volume as the nodes of `among` list it (`ListVolumes`); a node
/// that does not answer within 2 s adds nothing.
async fn seen(cluster: &Cluster, among: &[u64]) -> BTreeMap<String, Seen> {
    let mut all: BTreeMap<String, Seen> = BTreeMap::new();
    for id in among {
        let mut request = tonic::Request::new(VolumeListRequest {});
        request.set_timeout(Duration::from_secs(2));
        let Ok(reply) = cluster.admin(*id).list_volumes(request).await else {
            continue;
        };
        for volume in reply.into_inner().volumes {
            let entry = all.entry(volume.name).or_default();
            entry.preferred = volume.preferred;
            entry.size = volume.size;
            if volume.writing {
                entry.writers.push(*id);
            }
        }
    }
    all
}

/// How many volumes each node writes (volumes with one writer), every
/// node listed.
fn writers_per_node(cluster: &Cluster, seen: &BTreeMap<String, Seen>) -> BTreeMap<u64, usize> {
    let mut counts: BTreeMap<u64, usize> = cluster.ids.iter().map(|id| (*id, 0)).collect();
    for volume in seen.values() {
        if let [writer] = volume.writers.as_slice() {
            *counts.entry(*writer).or_default() += 1;
        }
    }
    counts
}

/// Whether `seen` holds `volumes` volumes, each with exactly one writer,
/// its preferred node where it has one.
fn settled(seen: &BTreeMap<String, Seen>, volumes: u64) -> bool {
    seen.len() as u64 == volumes
        && seen.values().all(|v| match v.writers.as_slice() {
            [writer] => v.preferred == 0 || *writer == v.preferred,
            _ => false,
        })
}

/// Polls every node until the balancer has settled (see [`settled`];
/// with the balancer off, until every volume has one writer) or `within`
/// passed; returns how long it took, if it did, and the last listing.
async fn wait_settled(
    cluster: &Cluster,
    knobs: &Knobs,
    within: Duration,
) -> (Option<Duration>, BTreeMap<String, Seen>) {
    let started = Instant::now();
    loop {
        let now = seen(cluster, &cluster.ids).await;
        let done = if knobs.balance_secs > 0 {
            settled(&now, knobs.volumes)
        } else {
            now.len() as u64 == knobs.volumes && now.values().all(|v| v.writers.len() == 1)
        };
        if done {
            return (Some(started.elapsed()), now);
        }
        if started.elapsed() >= within {
            return (None, now);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One SIGKILL of `victim`: for each of `volumes` (those it writes), the
/// time from the kill until a node of the rest writes it, or `None` if
/// none did within `within`.
async fn kill_writer(
    cluster: &mut Cluster,
    victim: u64,
    volumes: &[String],
    within: Duration,
) -> Vec<(String, Option<Duration>)> {
    let survivors: Vec<u64> = cluster
        .ids
        .iter()
        .copied()
        .filter(|id| *id != victim)
        .collect();
    // The kill's instant, once it is sent.
    let (kill_tx, kill_rx) = tokio::sync::watch::channel(None::<Instant>);
    let mut watches = tokio::task::JoinSet::new();
    for id in &survivors {
        let channel = cluster.channel(*id);
        for name in volumes {
            let mut client =
                replica_ha::proto::admin::admin_client::AdminClient::new(channel.clone());
            let request = WatchLeaderRequest {
                volume: name.clone(),
            };
            let mut stream = client
                .watch_leader(request)
                .await
                .unwrap_or_else(|err| panic!("node {id}: WatchLeader {name}: {err}"))
                .into_inner();
            // The stream is live once its first update arrived.
            stream
                .message()
                .await
                .unwrap_or_else(|err| panic!("node {id}: WatchLeader {name}: {err}"));
            let kill_rx = kill_rx.clone();
            let name = name.clone();
            watches.spawn(async move {
                while let Ok(Some(update)) = stream.message().await {
                    let killed = *kill_rx.borrow();
                    if let (Some(killed), true) = (killed, update.writer) {
                        return (name, Some(killed.elapsed()));
                    }
                }
                (name, None)
            });
        }
    }
    kill_tx.send_replace(Some(Instant::now()));
    cluster.kill(victim);
    let mut first: BTreeMap<String, Option<Duration>> =
        volumes.iter().map(|name| (name.clone(), None)).collect();
    let deadline = Instant::now() + within;
    while let Ok(Some(Ok((name, took)))) =
        tokio::time::timeout_at(deadline, watches.join_next()).await
    {
        let best = first.entry(name).or_default();
        *best = match (*best, took) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if first.values().all(Option::is_some) {
            break;
        }
    }
    // Dropping the set ends the streams still open.
    drop(watches);
    first.into_iter().collect()
}

/// A duration in milliseconds, for the tables.
fn ms(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

/// p50/p90/p99/max of `samples` (sorted here), with how many there are.
fn spread(samples: &mut [Duration]) -> String {
    if samples.is_empty() {
        return "no samples".into();
    }
    samples.sort();
    format!(
        "n={} p50 {} p90 {} p99 {} max {}",
        samples.len(),
        ms(percentile(samples, 50)),
        ms(percentile(samples, 90)),
        ms(percentile(samples, 99)),
        ms(samples[samples.len() - 1])
    )
}

/// `counts` as `1:21 2:21 3:22`.
fn per_node(counts: &BTreeMap<u64, usize>) -> String {
    let parts: Vec<String> = counts.iter().map(|(id, n)| format!("{id}:{n}")).collect();
    parts.join(" ")
}

/// A fresh three-node cluster with the knobs' size and balance interval,
/// once its configured volume has a writer.
async fn start(knobs: &Knobs) -> Cluster {
    let balance = knobs.balance_secs.to_string();
    let cluster =
        Cluster::start_with(3, &["--size", &knobs.size, "--balance-interval", &balance]).await;
    cluster.wait_for_writer(&cluster.ids, WAIT).await;
    cluster
}

/// fio's 4 KiB random writes at QD32 over the whole of volume `name`,
/// through its writer; prints the figures after `label`.
async fn fio_on(cluster: &Cluster, name: &str, fio_secs: u64, label: &str) -> FioFigures {
    let deadline = Instant::now() + WAIT;
    let (writer, size) = loop {
        let listed = seen(cluster, &cluster.ids).await;
        match listed.get(name) {
            Some(volume) if volume.writers.len() == 1 => break (volume.writers[0], volume.size),
            _ => assert!(
                Instant::now() < deadline,
                "no single writer of {name}: {listed:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let uri = volume_uri(cluster.nbd_addrs[&writer], name);
    let figures = match fio_randwrite_qd32(&uri, &size.to_string(), fio_secs).await {
        Ok(figures) => figures,
        Err(err) => {
            // A client error is a finding, not the end of the run: the
            // job counts as 0 IOPS, and the nodes' logs say why.
            println!("{label}: fio on {name} (writer node {writer}) FAILED: {err}");
            return FioFigures::default();
        }
    };
    println!(
        "{label}: fio 4k randwrite QD32 on {name} (writer node {writer}): {:.0} IOPS, p50 {:.0} µs, p99 {:.0} µs",
        figures.iops, figures.p50_us, figures.p99_us
    );
    figures
}

/// The whole run (see the module docs); its clusters are killed when this
/// ends or is dropped.
async fn run(knobs: Knobs) {
    let mut cluster = start(&knobs).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rest_one = at_rest(&cluster, knobs.idle_secs).await;
    let fio_before = fio_on(&cluster, "vol0", knobs.fio_secs, "vol0 alone").await;

    let started = Instant::now();
    let names: Vec<String> = (1..knobs.volumes).map(|n| format!("v{n}")).collect();
    for name in &names {
        let (ok, out, err) = cluster
            .cli(1, &["volume", "create", name, "--size", &knobs.size])
            .await;
        assert!(ok, "volume create {name}: {out} {err}");
    }
    let created = started.elapsed();
    for name in &names {
        cluster.wait_volume_writer(&[1], name, WAIT).await;
    }
    let written = started.elapsed();
    let before = writers_per_node(&cluster, &seen(&cluster, &cluster.ids).await);
    println!(
        "{} volumes: created in {:.2} s, every one with a writer after {:.2} s; writers per node then {}",
        knobs.volumes,
        created.as_secs_f64(),
        written.as_secs_f64(),
        per_node(&before)
    );
    let (took, listed) = wait_settled(&cluster, &knobs, knobs.settle).await;
    let balanced = writers_per_node(&cluster, &listed);
    match took {
        Some(took) => println!(
            "balancer settled {:.1} s later: writers per node {}",
            took.as_secs_f64(),
            per_node(&balanced)
        ),
        None => println!(
            "balancer NOT settled within {:?}: writers per node {}",
            knobs.settle,
            per_node(&balanced)
        ),
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rest_many = at_rest(&cluster, knobs.idle_secs).await;

    let busy = &names[0];
    let label = format!("{} volumes, the rest idle", knobs.volumes);
    let fio_table = fio_on(&cluster, busy, knobs.fio_secs, &label).await;
    let fio_vol0 = fio_on(&cluster, "vol0", knobs.fio_secs, &label).await;

    let mut failovers = Vec::new();
    for run in 1..=knobs.runs {
        let (took, listed) = wait_settled(&cluster, &knobs, knobs.settle).await;
        if took.is_none() {
            println!(
                "run {run}: the balancer did not settle within {:?}",
                knobs.settle
            );
        }
        // Past a restarted node's start-up window (it refuses votes for
        // election_max after it starts), and heartbeats steady.
        tokio::time::sleep(Duration::from_secs(1)).await;
        let counts = writers_per_node(&cluster, &listed);
        let victim = counts
            .iter()
            .max_by_key(|(id, n)| (**n, std::cmp::Reverse(**id)))
            .map_or(1, |(id, _)| *id);
        let led: Vec<String> = listed
            .iter()
            .filter(|(_, v)| v.writers == [victim])
            .map(|(name, _)| name.clone())
            .collect();
        let samples = kill_writer(&mut cluster, victim, &led, Duration::from_secs(30)).await;
        let mut times: Vec<Duration> = samples.iter().filter_map(|(_, t)| *t).collect();
        let missing: Vec<&str> = samples
            .iter()
            .filter(|(_, t)| t.is_none())
            .map(|(name, _)| name.as_str())
            .collect();
        let with_vol0 = if led.iter().any(|n| n == "vol0") {
            " (vol0 among them)"
        } else {
            ""
        };
        let line = format!(
            "run {run}: node {victim} killed, it wrote {}{with_vol0}: new writer after {}{}",
            led.len(),
            spread(&mut times),
            if missing.is_empty() {
                String::new()
            } else {
                format!("; none within 30 s: {missing:?}")
            }
        );
        println!("{line}");
        failovers.push(line);
        cluster.spawn(victim);
    }
    // The one-volume job again, on a fresh cluster: how far the machine
    // drifted over the run.
    drop(cluster);
    let cluster = start(&knobs).await;
    let fio_after = fio_on(&cluster, "vol0", knobs.fio_secs, "vol0 alone, again").await;
    let fio_alone = (fio_before.iops + fio_after.iops) / 2.0;

    println!();
    println!(
        "== {} volumes on 3 nodes: vol0 and {} table volumes of {}; balance interval {} s ==",
        knobs.volumes,
        names.len(),
        knobs.size,
        knobs.balance_secs
    );
    println!(
        "{:<42} {:>16} {:>16}   target",
        "figure", "vol0 alone", "all volumes"
    );
    println!(
        "{:<42} {:>16} {:>16}   ≤ 15 s (64)",
        "create all",
        "-",
        format!("{:.2} s", created.as_secs_f64())
    );
    println!(
        "{:<42} {:>16} {:>16}   21–22 each (64)",
        "writers per node after balancing",
        "-",
        per_node(&balanced)
    );
    for id in &cluster.ids {
        let (cpu_1, rss_1) = rest_one.get(id).copied().unwrap_or_default();
        let (cpu_n, rss_n) = rest_many.get(id).copied().unwrap_or_default();
        println!(
            "{:<42} {:>16} {:>16}   ≤ 5 %",
            format!("node {id} idle CPU (% of a core)"),
            format!("{cpu_1:.2} %"),
            format!("{cpu_n:.2} %")
        );
        println!(
            "{:<42} {:>16} {:>16}   ≤ 256 MiB",
            format!("node {id} RSS"),
            format!("{rss_1} MiB"),
            format!("{rss_n} MiB")
        );
    }
    println!(
        "{:<42} {:>16} {:>16}",
        "fio 4k randwrite QD32 on vol0 alone",
        format!("{:.0} IOPS", fio_before.iops),
        "(before)"
    );
    println!(
        "{:<42} {:>16} {:>16}",
        "",
        format!("{:.0} IOPS", fio_after.iops),
        "(after, fresh)"
    );
    for (name, figures) in [(busy.as_str(), fio_table), ("vol0", fio_vol0)] {
        println!(
            "{:<42} {:>16} {:>16}   {:.2}x of vol0 alone (≥ 0.9)",
            format!("fio 4k randwrite QD32 on {name}, rest idle"),
            "-",
            format!("{:.0} IOPS", figures.iops),
            figures.iops / fio_alone.max(1.0)
        );
    }
    println!("kill -9 of the busiest writer, per volume it wrote (target p99 ≤ 1 s; ±20 ms):");
    for line in &failovers {
        println!("  {line}");
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let knobs = Knobs::from_env();
    let mut terminate =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).expect("SIGTERM");
    // Dropping the run (interrupted) drops its cluster, which kills every
    // node; a panic drops it the same way.
    let stopped_by = tokio::select! {
        () = run(knobs) => return,
        _ = tokio::signal::ctrl_c() => "SIGINT",
        _ = terminate.recv() => "SIGTERM",
    };
    eprintln!("{stopped_by}: the nodes are stopped");
    std::process::exit(1);
}
