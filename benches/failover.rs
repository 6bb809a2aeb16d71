//! Failover time: SIGKILL the leader of a three-node cluster of real
//! processes on loopback, and time until another node holds a valid lease
//! (reports `is_self` in its status). The killed node is restarted and
//! rejoins, and is past its start-up window, before the next run: a leader
//! that dies while a just-restarted node still refuses votes fails over only
//! once that window ends (a safety rule; see `src/raft/mod.rs`). Prints every sample and p50/p90/p99/max.
//!
//! Run: `cargo bench --bench failover` (RUNS=50 for more samples).

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Duration;

use common::cluster::Cluster;
use tokio::time::Instant;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let runs = common::env_u64("RUNS", 25) as usize;
    let mut cluster = Cluster::start(3).await;
    let mut samples = Vec::new();
    for run in 0..runs {
        let (leader, _) = cluster
            .wait_for_leader(&[1, 2, 3], Duration::from_secs(30))
            .await;
        // Start every run from a steady state: the node restarted by the
        // previous run is past its start-up window (no votes for
        // election_max after start), and heartbeats have settled.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let others: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != leader).collect();
        let killed = Instant::now();
        cluster.kill(leader);
        let took = loop {
            let mut found = false;
            for id in &others {
                if cluster.status(*id).await.is_some_and(|s| s.is_self) {
                    found = true;
                }
            }
            if found {
                break killed.elapsed();
            }
            assert!(killed.elapsed() < Duration::from_secs(30), "no failover");
            tokio::time::sleep(Duration::from_millis(2)).await;
        };
        println!("run {run:>3}: leader {leader} killed, new lease after {took:?}");
        if took > Duration::from_secs(1) && std::env::var("FAILOVER_DEBUG").is_ok() {
            for id in &others {
                let log = cluster.log(*id);
                let tail: Vec<&str> = log.lines().rev().take(25).collect();
                println!(
                    "--- node {id}\n{}",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                );
            }
        }
        samples.push(took);
        cluster.spawn(leader);
    }
    samples.sort();
    println!(
        "failover over {} runs: p50 {:?}  p90 {:?}  p99 {:?}  max {:?}",
        samples.len(),
        percentile(&samples, 50.0),
        percentile(&samples, 90.0),
        percentile(&samples, 99.0),
        samples[samples.len() - 1]
    );
}
