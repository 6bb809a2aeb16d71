//! How long a follower that missed a few writes takes to be back in sync,
//! against the volume's size (issue 21's measurement): a three-node cluster
//! of release processes on a sparse volume; one follower is killed, 4 MiB
//! (`MISS_MIB`) are written (1 MiB at a time, spread over the volume), the follower is
//! started again, and the time from its start to its return to the in-sync
//! set is taken.
//!
//! With `BASELINE_BIN=PATH` (another build) each size also runs on that
//! build, alternating, and the ratios current/baseline are printed.
//!
//! With `WRITTEN=1` every replica file is written in full before the
//! nodes first start (the same bytes on each), so a pass over the volume
//! must read it: the case the missed-write map is for. Without it the
//! volume is sparse, and a full pass costs little (holes are not read).
//!
//! With `FULL=1` the follower's copy is lost while it is down (its file
//! emptied to a sparse one of the same size) and a full rebuild is asked
//! for (`replica-ha resync --full`): with `WRITTEN=1` every extent is then
//! copied, and each run also times `dd` of the writer's volume file to a
//! new file (1 MiB blocks, `conv=fsync`) on the same disk, just before the
//! follower starts and again just after it is back, and prints the
//! rebuild's throughput as a fraction of each dd's: from the follower's
//! start, and for the rebuild alone (from when the writer first reports it
//! running). Why two dds: see [`Run::dd`].
//!
//! With `CLIENT=1` a client writes 4 KiB with FUA at random offsets, one
//! at a time, through the writer for 2 s before the follower starts and
//! then until it is back, and each run prints the latencies of those
//! writes idle and during the rebuild (how far the rebuild yields to
//! clients).
//!
//! Run: `cargo bench --bench catch_up` (`SIZES_GIB=1,8`, `RUNS=3`,
//! `WRITTEN=0`, `MISS_MIB=4`, `FULL=0`, `CLIENT=0`).

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use bytes::Bytes;
use common::cluster::{BIN, Cluster};
use tokio::time::Instant;

const GIB: u64 = 1 << 30;
const MIB: u64 = 1 << 20;

fn env_list(name: &str, default: &str) -> Vec<u64> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect()
}

/// Writes `gib` GiB of one pattern into `path`.
fn fill(path: &Path, gib: u64) {
    use std::io::Write;
    std::fs::create_dir_all(path.parent().expect("a replica dir")).expect("mkdir");
    let mut file = std::io::BufWriter::new(std::fs::File::create(path).expect("create"));
    let chunk = vec![0x5au8; 8 * MIB as usize];
    for _ in 0..(gib * GIB / chunk.len() as u64) {
        file.write_all(&chunk).expect("fill the replica file");
    }
    file.flush().expect("flush");
}

/// The time `dd` takes to copy `from` to a new file beside it.
fn dd(from: &Path) -> Duration {
    let to = from.with_extension("dd-copy");
    let started = std::time::Instant::now();
    let status = std::process::Command::new("dd")
        .arg(format!("if={}", from.display()))
        .arg(format!("of={}", to.display()))
        .args(["bs=1M", "conv=fsync", "status=none"])
        .status()
        .expect("run dd");
    let took = started.elapsed();
    assert!(status.success(), "dd failed");
    let _ = std::fs::remove_file(&to);
    took
}

/// One catch-up on a fresh cluster of `bin` with a `gib` GiB volume; with
/// What one run measured.
struct Run {
    /// From the follower's start to its return to the in-sync set.
    back: Duration,
    /// From when the writer first reported the rebuild running to the
    /// return (without the node's start and the resync's poll).
    rebuild: Option<Duration>,
    /// With `full`: `dd` of the writer's volume file just before the
    /// follower starts, and again just after its return. The second writes
    /// into the same kind of page-cache pages the rebuild had to take (on
    /// a VM whose idle memory goes back to the host, pages freed seconds
    /// ago cost several times more to fill than pages freed just now).
    dd: Option<(Duration, Duration)>,
}

/// One run on `bin` (see the module docs).
async fn catch_up(bin: &Path, gib: u64, written: bool, full: bool) -> Run {
    let mut cluster = Cluster::new(3);
    if written {
        for id in cluster.ids.clone() {
            fill(
                &cluster.data_dir(id).join("replica").join("volume.img"),
                gib,
            );
        }
    }
    cluster.bin = bin.to_path_buf();
    cluster.extra_args = vec![
        "--size".into(),
        format!("{gib}GiB"),
        "--resync-rate".into(),
        "0".into(),
    ];
    for id in cluster.ids.clone() {
        cluster.spawn(id);
    }
    let (writer, _) = cluster
        .wait_for_writer(&[1, 2, 3], Duration::from_secs(60))
        .await;
    let follower = *cluster.ids.iter().find(|id| **id != writer).unwrap();
    cluster.kill(follower);
    let data = Bytes::from(vec![0x42; MIB as usize]);
    let missed = common::env_u64("MISS_MIB", 4).max(1);
    for i in 0..missed {
        let offset = i * (gib * GIB / missed);
        // The first write after the kill waits for the follower's removal.
        let deadline = Instant::now() + Duration::from_secs(30);
        while cluster.write(writer, offset, data.clone()).await.is_err() {
            assert!(Instant::now() < deadline, "the writer took no write");
        }
    }
    cluster
        .wait_in_sync(writer, follower, false, Duration::from_secs(30))
        .await;
    let mut dd_before = None;
    if full {
        let image = |id: u64| cluster.data_dir(id).join("replica").join("volume.img");
        // The follower's copy is lost: a sparse file of the same size.
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(image(follower))
            .expect("open the follower's copy");
        file.set_len(0).expect("empty it");
        file.set_len(gib * GIB).expect("size it");
        drop(file);
        let id = follower.to_string();
        let (ok, out, err) = cluster
            .cli(writer, &["resync", "--full", "--id", &id])
            .await;
        assert!(ok, "resync --full: {out}{err}");
        dd_before = Some(dd(&image(writer)));
    }
    let client = common::env_u64("CLIENT", 0) == 1;
    let idle = if client {
        let stop = std::sync::atomic::AtomicBool::new(false);
        let sleep = async {
            tokio::time::sleep(Duration::from_secs(2)).await;
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        };
        tokio::join!(client_writes(&cluster, writer, gib, &stop), sleep).0
    } else {
        Vec::new()
    };
    let started = Instant::now();
    cluster.spawn(follower);
    let (name, mut rebuilding) = (follower.to_string(), None);
    let deadline = Instant::now() + Duration::from_secs(900);
    let stop = std::sync::atomic::AtomicBool::new(!client);
    let watch = async {
        loop {
            let status = cluster.status(writer).await.unwrap_or_default();
            if status.in_sync.contains(&name) {
                break;
            }
            let running = status
                .replicas
                .iter()
                .any(|r| r.id == name && r.resync_running);
            if running && rebuilding.is_none() {
                rebuilding = Some(Instant::now());
            }
            assert!(Instant::now() < deadline, "node {follower} never came back");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    };
    let (during, ()) = tokio::join!(client_writes(&cluster, writer, gib, &stop), watch);
    let back = started.elapsed();
    let rebuild = rebuilding.map(|at| at.elapsed());
    if client {
        // Only the writes that began while the rebuild ran.
        let from = rebuilding.unwrap_or(started);
        let during: Vec<Duration> = during
            .into_iter()
            .filter(|(at, _)| *at >= from)
            .map(|(_, took)| took)
            .collect();
        let idle: Vec<Duration> = idle.into_iter().map(|(_, took)| took).collect();
        println!(
            "      client 4 KiB FUA writes, QD1: idle {}; during the rebuild {}",
            latencies(idle),
            latencies(during)
        );
    }
    let dd = dd_before.map(|before| {
        let image = cluster.data_dir(writer).join("replica").join("volume.img");
        (before, dd(&image))
    });
    for id in cluster.ids.clone() {
        cluster.kill(id);
    }
    Run { back, rebuild, dd }
}

/// With `CLIENT=1`: one client writing 4 KiB with FUA at random offsets
/// through the writer, one write at a time, until `stop`; when each write
/// began and how long it took.
async fn client_writes(
    cluster: &Cluster,
    writer: u64,
    gib: u64,
    stop: &std::sync::atomic::AtomicBool,
) -> Vec<(Instant, Duration)> {
    let data = Bytes::from(vec![0x17; 4096]);
    let blocks = gib * GIB / 4096;
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut took = Vec::new();
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let at = Instant::now();
        if cluster
            .write(writer, (state % blocks) * 4096, data.clone())
            .await
            .is_ok()
        {
            took.push((at, at.elapsed()));
        }
    }
    took
}

/// "p50 X ms, p99 Y ms (n writes)".
fn latencies(mut took: Vec<Duration>) -> String {
    if took.is_empty() {
        return "no writes".into();
    }
    took.sort();
    let at = |q: f64| took[((took.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e3;
    format!(
        "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} writes)",
        at(0.5),
        at(0.99),
        at(1.0),
        took.len()
    )
}

fn median(mut values: Vec<Duration>) -> Duration {
    values.sort();
    values[values.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let sizes = env_list("SIZES_GIB", "1,8");
    let runs = common::env_u64("RUNS", 3);
    let current = PathBuf::from(BIN);
    let baseline = std::env::var_os("BASELINE_BIN").map(PathBuf::from);
    let written = common::env_u64("WRITTEN", 0) == 1;
    let full = common::env_u64("FULL", 0) == 1;
    let kind = if written { "written" } else { "sparse" };
    let missed = common::env_u64("MISS_MIB", 4);
    if full {
        println!("full rebuild of a lost copy, {kind} volume, {runs} runs per size");
    } else {
        println!("catch-up after a {missed} MiB miss, {kind} volume, {runs} runs per size");
    }
    let secs = |d: Duration| d.as_secs_f64();
    for gib in sizes {
        let (mut backs, mut rebuilds, mut theirs) = (Vec::new(), Vec::new(), Vec::new());
        let (mut befores, mut afters) = (Vec::new(), Vec::new());
        for run in 0..runs {
            if let Some(baseline) = &baseline {
                let t = catch_up(baseline, gib, written, full).await.back;
                println!("{gib:>3} GiB run {run} baseline: {:>8.2} s", secs(t));
                theirs.push(t);
            }
            let Run { back, rebuild, dd } = catch_up(&current, gib, written, full).await;
            print!("{gib:>3} GiB run {run} current:  {:>8.2} s", secs(back));
            if let Some(rebuild) = rebuild {
                print!(" (rebuild {:.2} s)", secs(rebuild));
                rebuilds.push(rebuild);
            }
            if let Some((before, after)) = dd {
                print!(
                    "; dd {:.2} s before, {:.2} s after",
                    secs(before),
                    secs(after)
                );
                befores.push(before);
                afters.push(after);
            }
            println!();
            backs.push(back);
        }
        let back = median(backs);
        print!("{gib:>3} GiB median current {:.2} s", secs(back));
        if !rebuilds.is_empty() {
            print!(" (rebuild {:.2} s)", secs(median(rebuilds.clone())));
        }
        if !theirs.is_empty() {
            let theirs = median(theirs);
            print!(
                ", baseline {:.2} s, current/baseline {:.2}x",
                secs(theirs),
                secs(back) / secs(theirs)
            );
        }
        println!();
        if !befores.is_empty() {
            let (before, after) = (median(befores), median(afters));
            println!(
                "{gib:>3} GiB rebuild/dd throughput, from the follower's start: {:.2}x dd before, \
                 {:.2}x dd after",
                secs(before) / secs(back),
                secs(after) / secs(back)
            );
            if !rebuilds.is_empty() {
                let rebuild = median(rebuilds);
                println!(
                    "{gib:>3} GiB rebuild/dd throughput, the rebuild alone: {:.2}x dd before, \
                     {:.2}x dd after",
                    secs(before) / secs(rebuild),
                    secs(after) / secs(rebuild)
                );
            }
        }
    }
}
