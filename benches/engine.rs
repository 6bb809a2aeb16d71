//! The write path's cost: the engine mirroring to three local replica stores
//! (each a data file plus sled metadata, in three directories) against one
//! plain file written with positioned I/O, at 4 KiB and 1 MiB.
//!
//! Neither side syncs (no FUA), so the comparison is of the write path, not
//! of the disk's flush. Offsets cycle over a 256 MiB volume so the dirty
//! marks are paid once per extent and term, as in steady state.
//!
//! Run: `cargo bench --bench engine`.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use replica_ha::ha::WriterEngine;
use replica_ha::ha::fake::MemoryInSync;
use replica_ha::ids::{NodeId, Term};
use replica_ha::replica::Replica;
use replica_ha::replica::disk::local::LocalReplica;
use replica_ha::replica::disk::store::{ReplicaStore, StoreIdentity};
use replica_ha::replica::mirror::engine::{Engine, EngineConfig};
use replica_ha::volume::Device;

const VOLUME: u64 = 256 * 1024 * 1024;
const SIZES: [u64; 2] = [4 * 1024, 1024 * 1024];

fn offsets(block: u64) -> impl Iterator<Item = u64> {
    (0..VOLUME / block).map(move |i| i * block).cycle()
}

async fn three_replica_engine(dir: &std::path::Path) -> Engine {
    let ids = [NodeId(1), NodeId(2), NodeId(3)];
    let mut replicas: Vec<Arc<dyn Replica>> = Vec::new();
    for id in ids {
        let store = ReplicaStore::open(
            dir.join(id.to_string()),
            StoreIdentity::new("bench", "vol0", VOLUME),
        )
        .await
        .expect("open store");
        replicas.push(Arc::new(LocalReplica::new(id, Arc::new(store))));
    }
    let config = EngineConfig {
        local_id: NodeId(1),
        replica_timeout: Duration::from_secs(10),
        volume: replica_ha::volume::VolumeSpec::new("test", "vol0", VOLUME, 2),
    };
    let engine = Engine::new(config, replicas, Arc::new(MemoryInSync::new(ids))).expect("engine");
    engine.activate(Term(1)).await.expect("activate");
    engine
}

fn bench_writes(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("tempdir");
    let engine = runtime.block_on(three_replica_engine(dir.path()));
    let plain = Arc::new(File::create(dir.path().join("plain.img")).expect("plain file"));
    plain.set_len(VOLUME).expect("size plain file");

    let mut group = c.benchmark_group("write");
    for size in SIZES {
        let data = Bytes::from(vec![0xa5u8; size as usize]);
        group.throughput(Throughput::Bytes(size));

        let mut at = offsets(size);
        group.bench_with_input(BenchmarkId::new("plain_file", size), &size, |b, _| {
            b.to_async(&runtime).iter(|| {
                let (file, data, offset) =
                    (Arc::clone(&plain), data.clone(), at.next().unwrap_or(0));
                async move {
                    tokio::task::spawn_blocking(move || file.write_all_at(&data, offset))
                        .await
                        .expect("join")
                        .expect("write");
                }
            })
        });

        let mut at = offsets(size);
        group.bench_with_input(
            BenchmarkId::new("engine_3_replicas", size),
            &size,
            |b, _| {
                b.to_async(&runtime).iter(|| {
                    let (data, offset) = (data.clone(), at.next().unwrap_or(0));
                    let engine = &engine;
                    async move { engine.write_at(offset, data, false).await.expect("write") }
                })
            },
        );
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().measurement_time(Duration::from_secs(5)).sample_size(30);
    targets = bench_writes
}
criterion_main!(benches);
