//! The replicated write path over loopback: the engine writes to its local
//! replica and to two replicas served by the real replica gRPC service on
//! 127.0.0.1 (three stores in three directories), beside one plain file
//! written with positioned I/O. Reports 4 KiB QD1 latency (p50/p99) and
//! 1 MiB sequential throughput, both on first touch (every write is the
//! first of this term in its 1 MiB extent, so each pays a durable dirty
//! mark on every replica, S6) and in steady state (marks already durable).
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
use replica_ha::replica::remote::RemoteReplica;
use replica_ha::replica::service::ReplicaService;
use replica_ha::replica::{
    Engine, EngineConfig, LocalReplica, Replica, ReplicaStore, StoreIdentity,
};
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

async fn serve(store: Arc<ReplicaStore>) -> String {
    common::serve_replica(ReplicaService::new(store))
        .await
        .to_string()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[(((p / 100.0) * (sorted.len() - 1) as f64).round() as usize).min(sorted.len() - 1)]
}

fn report(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    println!(
        "{name:<28} 4 KiB QD1: p50 {:>9.1?}  p99 {:>9.1?}",
        percentile(&samples, 50.0),
        percentile(&samples, 99.0)
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let (s1, s2, s3) = (
        open(dir.path(), NodeId(1)).await,
        open(dir.path(), NodeId(2)).await,
        open(dir.path(), NodeId(3)).await,
    );
    let timeout = Duration::from_secs(5);
    let transport = replica_ha::net::Transport::default();
    let replicas: Vec<Arc<dyn Replica>> = vec![
        Arc::new(LocalReplica::new(NodeId(1), s1)),
        Arc::new(
            RemoteReplica::new(
                NodeId(2),
                &transport,
                &serve(s2).await,
                "bench",
                "vol0",
                timeout,
            )
            .expect("n2"),
        ),
        Arc::new(
            RemoteReplica::new(
                NodeId(3),
                &transport,
                &serve(s3).await,
                "bench",
                "vol0",
                timeout,
            )
            .expect("n3"),
        ),
    ];
    let engine = Engine::new(
        EngineConfig {
            local_id: NodeId(1),
            replica_timeout: timeout,
            volume: replica_ha::volume::VolumeSpec::new("test", "vol0", VOLUME, 2),
        },
        replicas,
        Arc::new(MemoryInSync::new([NodeId(1), NodeId(2), NodeId(3)])),
    )
    .expect("engine");
    engine.activate(Term(1)).await.expect("activate");
    let plain = Arc::new(File::create(dir.path().join("plain.img")).expect("file"));
    plain.set_len(VOLUME).expect("size");

    let small = Bytes::from(vec![0x5a; 4096]);
    let samples = 3000u64;
    // Warm up: dirty marks and connections.
    for i in 0..256 {
        engine
            .write_at(i * 4096, small.clone(), false)
            .await
            .expect("write");
    }
    let mut replicated = Vec::new();
    let mut local = Vec::new();
    for i in 0..samples {
        let offset = (i % 4096) * 4096;
        let start = Instant::now();
        engine
            .write_at(offset, small.clone(), false)
            .await
            .expect("write");
        replicated.push(start.elapsed());
        let (file, data) = (Arc::clone(&plain), small.clone());
        let start = Instant::now();
        tokio::task::spawn_blocking(move || file.write_all_at(&data, offset))
            .await
            .expect("join")
            .expect("pwrite");
        local.push(start.elapsed());
    }
    report("engine, 3 replicas (gRPC)", replicated);
    report("plain file", local);

    let big = Bytes::from(vec![0xa5; 1 << 20]);
    // First touch: one pass over the volume, a new extent every write.
    let start = Instant::now();
    for extent in 0..VOLUME >> 20 {
        engine
            .write_at(extent << 20, big.clone(), false)
            .await
            .expect("write");
    }
    let first_touch = (VOLUME >> 20) as f64 / start.elapsed().as_secs_f64();
    let budget = Duration::from_secs(3);
    let mut written = 0u64;
    let start = Instant::now();
    while start.elapsed() < budget {
        engine
            .write_at(written % VOLUME, big.clone(), false)
            .await
            .expect("write");
        written += 1 << 20;
    }
    let engine_rate = written as f64 / start.elapsed().as_secs_f64() / (1 << 20) as f64;
    let mut written = 0u64;
    let start = Instant::now();
    while start.elapsed() < budget {
        let (file, data, offset) = (Arc::clone(&plain), big.clone(), written % VOLUME);
        tokio::task::spawn_blocking(move || file.write_all_at(&data, offset))
            .await
            .expect("join")
            .expect("pwrite");
        written += 1 << 20;
    }
    let file_rate = written as f64 / start.elapsed().as_secs_f64() / (1 << 20) as f64;
    println!("1 MiB sequential, first touch: engine {first_touch:.0} MiB/s");
    println!(
        "1 MiB sequential, steady:      engine {engine_rate:.0} MiB/s, plain file {file_rate:.0} MiB/s, ratio {:.2}",
        engine_rate / file_rate
    );
}
