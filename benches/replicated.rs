//! The replicated write path over loopback: the engine writes to its local
//! replica and to two replicas served by the real replica gRPC service on
//! 127.0.0.1 (three stores in three directories), beside one plain file
//! written with positioned I/O. The same engine runs twice in one run: over
//! plaintext gRPC (`insecure = true`) and over mutual TLS (the default),
//! with the ratio of each figure. Reports 4 KiB QD1 latency (p50/p99) and
//! 1 MiB sequential throughput, on first touch (every write is the first
//! of this term in its 1 MiB extent, so it needs a durable dirty mark on
//! every replica, S6, and its blocks are new to the file system), again on
//! the first pass of a new term over blocks already allocated (the marks'
//! own cost, S6 alone), and in steady state (marks already durable).
//! Neither side syncs the data (no FUA).
//!
//! Run: `cargo bench --bench replicated`.

#[path = "../tests/common/mod.rs"]
mod common;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use replica_ha::ha::WriterEngine;
use replica_ha::ha::fake::MemoryInSync;
use replica_ha::ids::{NodeId, Term};
use replica_ha::net::tls::Party;
use replica_ha::net::{Limits, Tls, Transport};
use replica_ha::replica::Replica;
use replica_ha::replica::disk::local::LocalReplica;
use replica_ha::replica::disk::store::{ReplicaStore, StoreIdentity};
use replica_ha::replica::mirror::engine::{Engine, EngineConfig};
use replica_ha::replica::peer::remote::RemoteReplica;
use replica_ha::replica::serve::service::ReplicaService;
use replica_ha::volume::Device;

const VOLUME: u64 = 256 << 20;

async fn open(dir: &std::path::Path, id: NodeId) -> Arc<ReplicaStore> {
    Arc::new(
        ReplicaStore::open(
            dir.join(id.to_string()),
            StoreIdentity::new("bench", "vol0", VOLUME),
        )
        .await
        .expect("store"),
    )
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[(((p / 100.0) * (sorted.len() - 1) as f64).round() as usize).min(sorted.len() - 1)]
}

/// One node's transport: mutual TLS with its certificate from `certs`, or
/// plaintext.
fn transport(certs: Option<&std::path::Path>, id: NodeId) -> Transport {
    match certs {
        None => Transport::default(),
        Some(certs) => {
            let files = replica_ha::certs::TlsFiles::for_node(certs, id);
            let tls = Tls::load(files, "bench", Party::Node(id)).expect("credentials");
            Transport::secured(Limits::default(), tls)
        }
    }
}

/// An engine on node 1 over its own replica and nodes 2 and 3's, served
/// on loopback, all in `dir`; TLS with `certs`.
async fn engine(dir: &std::path::Path, certs: Option<&std::path::Path>) -> Engine {
    let timeout = Duration::from_secs(5);
    let client = transport(certs, NodeId(1));
    let mut replicas: Vec<Arc<dyn Replica>> = vec![Arc::new(LocalReplica::new(
        NodeId(1),
        open(dir, NodeId(1)).await,
    ))];
    for id in [NodeId(2), NodeId(3)] {
        let service = ReplicaService::new(open(dir, id).await);
        let addr = common::serve_replica_with(service, transport(certs, id)).await;
        replicas.push(Arc::new(
            RemoteReplica::new(
                id,
                &client,
                &addr.to_string(),
                "bench",
                "vol0",
                replica_ha::ids::GroupId::FIRST,
                timeout,
            )
            .expect("remote replica"),
        ));
    }
    let engine = Engine::new(
        EngineConfig {
            local_id: NodeId(1),
            replica_timeout: timeout,
            volume: replica_ha::volume::VolumeSpec::new("bench", "vol0", VOLUME, 2),
        },
        replicas,
        Arc::new(MemoryInSync::new([NodeId(1), NodeId(2), NodeId(3)])),
    )
    .expect("engine");
    engine.activate(Term(1)).await.expect("activate");
    engine
}

/// What one engine did.
struct Figures {
    p50: Duration,
    /// 4 KiB QD1 p50 when each write is its term's first in its extent.
    first_p50: Duration,
    p99: Duration,
    first_touch: f64,
    new_term: f64,
    steady: f64,
}

impl Figures {
    fn mean(runs: &[Figures]) -> Figures {
        let n = runs.len() as u32;
        Figures {
            p50: runs.iter().map(|f| f.p50).sum::<Duration>() / n,
            first_p50: runs.iter().map(|f| f.first_p50).sum::<Duration>() / n,
            p99: runs.iter().map(|f| f.p99).sum::<Duration>() / n,
            first_touch: runs.iter().map(|f| f.first_touch).sum::<f64>() / f64::from(n),
            new_term: runs.iter().map(|f| f.new_term).sum::<f64>() / f64::from(n),
            steady: runs.iter().map(|f| f.steady).sum::<f64>() / f64::from(n),
        }
    }
}

const SAMPLES: u64 = 3000;
const BUDGET: Duration = Duration::from_secs(3);

async fn measure(engine: &Engine) -> Figures {
    let small = Bytes::from(vec![0x5a; 4096]);
    // Warm up: dirty marks and connections.
    for i in 0..256 {
        engine
            .write_at(i * 4096, small.clone(), false)
            .await
            .expect("write");
    }
    let mut latencies = Vec::new();
    for i in 0..SAMPLES {
        let start = Instant::now();
        engine
            .write_at((i % 4096) * 4096, small.clone(), false)
            .await
            .expect("write");
        latencies.push(start.elapsed());
    }
    latencies.sort();
    let big = Bytes::from(vec![0xa5; 1 << 20]);
    // First touch: one pass over the volume past what the 4 KiB writes
    // touched (its first 12 MiB), a new extent every write.
    let untouched = 16..VOLUME >> 20;
    let start = Instant::now();
    for extent in untouched.clone() {
        engine
            .write_at(extent << 20, big.clone(), false)
            .await
            .expect("write");
    }
    let first_touch = untouched.count() as f64 / start.elapsed().as_secs_f64();
    let mut written = 0u64;
    let start = Instant::now();
    while start.elapsed() < BUDGET {
        engine
            .write_at(written % VOLUME, big.clone(), false)
            .await
            .expect("write");
        written += 1 << 20;
    }
    let steady = written as f64 / start.elapsed().as_secs_f64() / (1 << 20) as f64;
    // A new term: every extent's first write of it needs a mark again,
    // over blocks the file system has already allocated.
    engine.deactivate();
    engine.activate(Term(2)).await.expect("activate");
    let start = Instant::now();
    for extent in 0..VOLUME >> 20 {
        engine
            .write_at(extent << 20, big.clone(), false)
            .await
            .expect("write");
    }
    let new_term = (VOLUME >> 20) as f64 / start.elapsed().as_secs_f64();
    // 4 KiB at QD1, each the first write of another new term into its
    // extent (in a scattered order, so no stream forms).
    engine.deactivate();
    engine.activate(Term(3)).await.expect("activate");
    let extents = VOLUME >> 20;
    let mut first_small = Vec::new();
    for i in 0..extents {
        let extent = (i * 97) % extents;
        let start = Instant::now();
        engine
            .write_at(extent << 20, small.clone(), false)
            .await
            .expect("write");
        first_small.push(start.elapsed());
    }
    first_small.sort();
    Figures {
        first_p50: percentile(&first_small, 50.0),
        p50: percentile(&latencies, 50.0),
        p99: percentile(&latencies, 99.0),
        first_touch,
        new_term,
        steady,
    }
}

async fn plain_file(dir: &std::path::Path) -> Figures {
    let plain = Arc::new(File::create(dir.join("plain.img")).expect("file"));
    plain.set_len(VOLUME).expect("size");
    let small = Bytes::from(vec![0x5a; 4096]);
    let mut latencies = Vec::new();
    for i in 0..SAMPLES {
        let (file, data) = (Arc::clone(&plain), small.clone());
        let start = Instant::now();
        tokio::task::spawn_blocking(move || file.write_all_at(&data, (i % 4096) * 4096))
            .await
            .expect("join")
            .expect("pwrite");
        latencies.push(start.elapsed());
    }
    latencies.sort();
    let big = Bytes::from(vec![0xa5; 1 << 20]);
    let mut written = 0u64;
    let start = Instant::now();
    while start.elapsed() < BUDGET {
        let (file, data, offset) = (Arc::clone(&plain), big.clone(), written % VOLUME);
        tokio::task::spawn_blocking(move || file.write_all_at(&data, offset))
            .await
            .expect("join")
            .expect("pwrite");
        written += 1 << 20;
    }
    let rate = written as f64 / start.elapsed().as_secs_f64() / (1 << 20) as f64;
    Figures {
        first_p50: percentile(&latencies, 50.0),
        p50: percentile(&latencies, 50.0),
        p99: percentile(&latencies, 99.0),
        first_touch: rate,
        new_term: rate,
        steady: rate,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = common::cluster::make_certs(dir.path(), "bench", &[1, 2, 3]);
    // Plaintext, TLS, TLS, plaintext, each on fresh stores, so that
    // neither gains from going second; each figure is the mean of two.
    let mut plain_runs = Vec::new();
    let mut tls_runs = Vec::new();
    for (round, secure) in [false, true, true, false].into_iter().enumerate() {
        let stores = dir.path().join(format!("run{round}"));
        if secure {
            tls_runs.push(measure(&engine(&stores, Some(&certs)).await).await);
        } else {
            plain_runs.push(measure(&engine(&stores, None).await).await);
        }
    }
    let (plaintext, tls) = (Figures::mean(&plain_runs), Figures::mean(&tls_runs));
    let file = plain_file(dir.path()).await;
    println!(
        "| path | 4 KiB QD1 p50 | p99 | 4 KiB QD1 p50, first of its term in the extent | 1 MiB first touch | 1 MiB first of a new term | 1 MiB steady | steady / new term |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (name, f) in [
        ("engine, 3 replicas, gRPC plaintext", &plaintext),
        ("engine, 3 replicas, gRPC mutual TLS", &tls),
        ("plain file", &file),
    ] {
        println!(
            "| {name} | {:.1?} | {:.1?} | {:.1?} | {:.0} MiB/s | {:.0} MiB/s | {:.0} MiB/s | {:.2}x |",
            f.p50,
            f.p99,
            f.first_p50,
            f.first_touch,
            f.new_term,
            f.steady,
            f.steady / f.new_term
        );
    }
    println!(
        "| TLS / plaintext | {:.2}x | {:.2}x | {:.2}x | {:.2}x | {:.2}x | {:.2}x | |",
        tls.p50.as_secs_f64() / plaintext.p50.as_secs_f64(),
        tls.p99.as_secs_f64() / plaintext.p99.as_secs_f64(),
        tls.first_p50.as_secs_f64() / plaintext.first_p50.as_secs_f64(),
        tls.first_touch / plaintext.first_touch,
        tls.new_term / plaintext.new_term,
        tls.steady / plaintext.steady
    );
}
