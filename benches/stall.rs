//! The write stall a client sees when the writer changes, through
//! `replica-ha attach` and through HAProxy (`cluster/haproxy.cfg` with
//! qemu's `reconnect-delay`), for a transfer, a SIGTERM of the writer and a
//! SIGKILL of the writer.
//!
//! The client (`tests/stack/pulse.py`) writes 4 KiB at random offsets, one
//! at a time and each synchronous, to qemu-storage-daemon's FUSE export of
//! the volume, and logs when each completed. For each event the stall is
//! the longest gap between completions from 0.5 s before the event to 3 s
//! after it. Prints every sample, then per path and event the number of
//! runs, p50 and the nearest-rank p99 (with fewer than 100 runs, the
//! maximum), and the application errors (there must be none).
//!
//! Run: `cargo bench --bench stall` (`RUNS=10` per event and path; needs
//! root, qemu-utils, haproxy and python3).

#[path = "../tests/common/mod.rs"]
mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::cluster::Cluster;
use common::percentile;
use common::stack::{Stack, Via, writer};

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn completions(stack: &Stack) -> Vec<f64> {
    std::fs::read_to_string(stack.dir.join("pulse.log"))
        .unwrap_or_default()
        .lines()
        .filter_map(|line| line.parse().ok())
        .collect()
}

/// The longest gap between completions in `[from, to]`, counting from the
/// last completion before `from`.
fn stall(times: &[f64], from: f64, to: f64) -> Duration {
    let mut last = times
        .iter()
        .rev()
        .find(|t| **t <= from)
        .copied()
        .unwrap_or(from);
    let mut longest = 0.0f64;
    for t in times.iter().filter(|t| **t > from && **t <= to) {
        longest = longest.max(t - last);
        last = *t;
    }
    Duration::from_secs_f64(longest)
}

#[derive(Clone, Copy, Debug)]
enum Event {
    Transfer,
    Sigterm,
    Sigkill,
}

async fn one(cluster: &mut Cluster, stack: &Stack, event: Event) -> Duration {
    let all = [1, 2, 3];
    let w = writer(cluster, &all).await;
    // Completions flowing before the event.
    let flowing = completions(stack).len() + 20;
    while completions(stack).len() < flowing {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let at = now();
    match event {
        Event::Transfer => {
            let to = all.into_iter().find(|id| *id != w).unwrap();
            let mut request = tonic::Request::new(replica_ha::proto::admin::TransferRequest {
                to,
                ..Default::default()
            });
            request.set_timeout(Duration::from_secs(30));
            cluster
                .admin(w)
                .transfer_leader(request)
                .await
                .expect("transfer");
        }
        Event::Sigterm => assert!(cluster.terminate(w).success()),
        Event::Sigkill => cluster.kill(w),
    }
    let until = at + 3.0;
    while now() < until {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Back once the window is over, so that its restart is no part of it.
    if !cluster.is_running(w) {
        cluster.spawn(w);
    }
    stall(&completions(stack), at - 0.5, until)
}

fn pulse(stack: &Stack) -> Child {
    Command::new("python3")
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/stack/pulse.py"))
        .arg(stack.disk())
        .arg(stack.dir.join("pulse.log"))
        .arg(stack.dir.join("stop"))
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3")
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let runs = common::env_u64("RUNS", 10) as usize;
    let mut table = Vec::new();
    let paths = std::env::var("PATHS").unwrap_or_else(|_| "attach,HAProxy".into());
    for path in ["attach", "HAProxy"]
        .into_iter()
        .filter(|p| paths.contains(p))
    {
        let mut cluster =
            Cluster::start_with(3, &["--size", "256MiB", "--nbd-tls", "optional"]).await;
        writer(&cluster, &[1, 2, 3]).await;
        let via = match path {
            "attach" => Via::Attach(cluster.dir.path().join("attach.sock")),
            _ => Via::Haproxy(common::cluster::free_port()),
        };
        let stack = Stack::build(&cluster, via).await;
        let client = pulse(&stack);
        // Measure a settled cluster: a transfer within election_max of the
        // writer's own election waits out openraft's vote lease on it (see
        // the design's caveats), which is not what this measures.
        let settled = now() + 2.0;
        while completions(&stack).last().is_none_or(|t| *t < settled) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        for event in [Event::Transfer, Event::Sigterm, Event::Sigkill] {
            let mut samples = Vec::new();
            for run in 0..runs {
                let took = one(&mut cluster, &stack, event).await;
                println!("{path:>8} {event:?} run {run}: stall {took:?}");
                samples.push(took);
            }
            samples.sort();
            table.push((path, event, samples));
        }
        if std::env::var("STALL_DEBUG").is_ok() {
            // Where the time went: each node's hand-overs and promotions.
            for id in [1, 2, 3] {
                for line in cluster.log(id).lines().filter(|l| {
                    [
                        "drained and settled",
                        "took leadership",
                        "promoted: gate open",
                        "transfer election",
                    ]
                    .iter()
                    .any(|k| l.contains(k))
                }) {
                    println!("    node {id}: {line}");
                }
            }
        }
        std::fs::write(stack.dir.join("stop"), b"").unwrap();
        let out = client.wait_with_output().unwrap();
        println!(
            "{path}: application errors: {} {}",
            usize::from(!out.status.success()),
            String::from_utf8_lossy(&out.stderr)
        );
        drop(stack);
    }
    println!("\n| path | event | runs | p50 | p99 (nearest rank) |");
    println!("|---|---|---|---|---|");
    for (path, event, samples) in &table {
        println!(
            "| {path} | {event:?} | {} | {} ms | {} ms |",
            samples.len(),
            percentile(samples, 50).as_millis(),
            percentile(samples, 99).as_millis()
        );
    }
}
