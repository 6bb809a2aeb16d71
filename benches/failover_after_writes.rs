//! Failover time against what the killed writer wrote in its term.
//!
//! For each amount (default 0, 256 MiB, 2 GiB, 4 GiB), a fresh term's
//! writer receives that many bytes of sequential 1 MiB writes at queue depth
//! 8 over NBD (fio), is killed with SIGKILL at once, and the time until
//! another node's write gate is open (fenced, converged, promoted) is
//! measured. Convergence copies only what is still marked, and the writer
//! retires the marks of what is durable everywhere as it goes, so the time
//! should not grow with the amount. Prints every sample and, per amount,
//! the median, the nearest-rank 99th percentile and the maximum, and the
//! median's ratio to the amount 0.
//!
//! Run: `cargo bench --bench failover_after_writes` (`RUNS=5` samples per
//! amount, `AMOUNTS_MIB=0,256` to choose amounts, `FAILOVER_DEBUG=1` to
//! print the new writer's promotion steps). Needs `fio`.

#[path = "../tests/common/mod.rs"]
mod common;

use std::process::Command;
use std::time::Duration;

use common::cluster::Cluster;
use common::percentile;
use tokio::time::Instant;

fn env_list(name: &str, default: &[u64]) -> Vec<u64> {
    std::env::var(name)
        .ok()
        .map(|v| v.split(',').filter_map(|s| s.trim().parse().ok()).collect())
        .unwrap_or_else(|| default.to_vec())
}

/// Writes `mib` MiB from offset 0 into `url` with fio; panics on failure.
fn fill(url: &str, mib: u64) {
    if mib == 0 {
        return;
    }
    let status = Command::new("fio")
        .args([
            "--name=fill",
            "--ioengine=nbd",
            &format!("--uri={url}"),
            "--rw=write",
            "--bs=1M",
            "--iodepth=8",
            &format!("--size={mib}M"),
            "--output=/dev/null",
        ])
        .status()
        .expect("fio runs");
    assert!(status.success(), "fio failed writing {mib} MiB");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let runs = env_list("RUNS", &[3])[0] as usize;
    let amounts = env_list("AMOUNTS_MIB", &[0, 256, 2048, 4096]);
    let size = amounts.iter().max().copied().unwrap_or(0).max(64) + 64;
    let mut cluster = Cluster::start_with(3, &["--size", &format!("{size}MiB")]).await;
    let mut medians = Vec::new();
    for &mib in &amounts {
        let mut samples = Vec::new();
        for run in 0..runs {
            let (writer, _) = cluster
                .wait_for_writer(&[1, 2, 3], Duration::from_secs(60))
                .await;
            // Every replica back in sync, so the kill leaves two copies.
            let deadline = Instant::now() + Duration::from_secs(120);
            loop {
                let status = cluster.status(writer).await;
                if status.is_some_and(|s| s.replicas.iter().all(|r| r.state == "in_sync")) {
                    break;
                }
                assert!(Instant::now() < deadline, "replicas did not resync");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let url = format!("nbd://{}/vol0", cluster.nbd_addrs[&writer]);
            let url_for_fio = url.clone();
            tokio::task::spawn_blocking(move || fill(&url_for_fio, mib))
                .await
                .expect("fio task");
            let others: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != writer).collect();
            let killed = Instant::now();
            cluster.kill(writer);
            let took = loop {
                let mut open = false;
                for id in &others {
                    if cluster.status(*id).await.is_some_and(|s| s.gate_open) {
                        open = true;
                    }
                }
                if open {
                    break killed.elapsed();
                }
                assert!(killed.elapsed() < Duration::from_secs(60), "no failover");
                tokio::time::sleep(Duration::from_millis(2)).await;
            };
            println!(
                "{mib:>5} MiB written, run {run}: writer {writer} killed, new writer after {took:?}"
            );
            if std::env::var("FAILOVER_DEBUG").is_ok() {
                // Where the time went: the promotion steps of the new writer.
                for id in &others {
                    let log = cluster.log(*id);
                    let steps: Vec<&str> = log
                        .lines()
                        .filter(|l| {
                            [
                                "campaigning",
                                "pre-vote refused",
                                "won leadership",
                                "fenced and reconciled",
                                "promoted: gate open",
                            ]
                            .iter()
                            .any(|k| l.contains(k))
                        })
                        .collect();
                    for line in steps.iter().rev().take(5).rev() {
                        println!("    node {id}: {line}");
                    }
                }
            }
            samples.push(took);
            cluster.spawn(writer);
        }
        samples.sort();
        medians.push((
            mib,
            samples.len(),
            percentile(&samples, 50),
            percentile(&samples, 99),
            samples[samples.len() - 1],
        ));
    }
    let base = medians.first().map(|m| m.2.as_secs_f64()).unwrap_or(1.0);
    println!(
        "\n| written in the term | samples | median failover | p99 (nearest rank) | max | median / first amount's |"
    );
    println!("|---|---|---|---|---|---|");
    for (mib, n, median, p99, max) in medians {
        println!(
            "| {mib} MiB | {n} | {median:?} | {p99:?} | {max:?} | {:.2} |",
            median.as_secs_f64() / base
        );
    }
}
