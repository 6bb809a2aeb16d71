//! The cost of one order for overlapping writes (design S11), measured
//! with fio against the writer's NBD export of a three-node cluster of
//! release processes on loopback.
//!
//! Two workloads, 4 KiB random writes at queue depth 32 (fio's `nbd`
//! engine, one job):
//! - `spread`: over 1 GiB, where two writes in flight almost never overlap,
//!   so the order should cost nothing;
//! - `overlap`: over 16 KiB (four blocks), where nearly every write
//!   overlaps one in flight and so waits for it.
//!
//! With `BASELINE_BIN=PATH` (a build without the order, for example of
//! commit 6ad2807) each workload also runs on that build, alternating
//! baseline and current, and the ratios current/baseline are printed.
//! Absolute figures drift on shared machines; the ratios are the result.
//!
//! Run: `cargo bench --bench write_order` (`RUNS=3`, `SECONDS=10`; needs
//! fio).

#[path = "../tests/common/mod.rs"]
mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::cluster::{BIN, Cluster};
use common::env_u64;
use common::tools::{FioFigures as Figures, fio_randwrite_qd32, uri};

/// A fresh cluster of `bin`, fio `span` bytes at QD32 for `seconds`.
async fn measure(bin: &std::path::Path, span: &str, seconds: u64) -> Figures {
    let mut cluster = Cluster::new(3);
    cluster.bin = bin.to_path_buf();
    cluster.extra_args = vec!["--size".into(), "1GiB".into()];
    for id in cluster.ids.clone() {
        cluster.spawn(id);
    }
    let (writer, _) = cluster
        .wait_for_writer(&[1, 2, 3], Duration::from_secs(30))
        .await;
    let figures = fio_randwrite_qd32(&uri(cluster.nbd_addrs[&writer]), span, seconds)
        .await
        .unwrap_or_else(|err| panic!("fio failed: {err}"));
    for id in cluster.ids.clone() {
        cluster.kill(id);
    }
    figures
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let runs = env_u64("RUNS", 3);
    let seconds = env_u64("SECONDS", 10);
    let current = PathBuf::from(BIN);
    let baseline = std::env::var_os("BASELINE_BIN").map(PathBuf::from);
    println!("write order: fio 4 KiB randwrite QD32, {seconds} s per run, {runs} runs");
    for (workload, span) in [("spread", "1g"), ("overlap", "16k")] {
        let mut ours = Vec::new();
        let mut theirs = Vec::new();
        for run in 0..runs {
            if let Some(baseline) = &baseline {
                let f = measure(baseline, span, seconds).await;
                println!(
                    "{workload:<8} run {run} baseline: {:>8.0} IOPS  p50 {:>7.0} µs  p99 {:>7.0} µs",
                    f.iops, f.p50_us, f.p99_us
                );
                theirs.push(f);
            }
            let f = measure(&current, span, seconds).await;
            println!(
                "{workload:<8} run {run} current:  {:>8.0} IOPS  p50 {:>7.0} µs  p99 {:>7.0} µs",
                f.iops, f.p50_us, f.p99_us
            );
            ours.push(f);
        }
        let summary = |fs: &[Figures]| {
            (
                median(fs.iter().map(|f| f.iops).collect()),
                median(fs.iter().map(|f| f.p50_us).collect()),
                median(fs.iter().map(|f| f.p99_us).collect()),
            )
        };
        let (iops, p50, p99) = summary(&ours);
        println!("{workload:<8} current median: {iops:.0} IOPS, p50 {p50:.0} µs, p99 {p99:.0} µs");
        if !theirs.is_empty() {
            let (b_iops, b_p50, b_p99) = summary(&theirs);
            println!(
                "{workload:<8} baseline median: {b_iops:.0} IOPS, p50 {b_p50:.0} µs, p99 {b_p99:.0} µs"
            );
            println!(
                "{workload:<8} current/baseline: IOPS {:.2}x, p50 {:.2}x, p99 {:.2}x",
                iops / b_iops,
                p50 / b_p50,
                p99 / b_p99
            );
        }
    }
}
