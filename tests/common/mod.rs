//! Shared test support: replicas that fail on command, and a tracker that
//! logs the order of in-sync commits.

#![allow(dead_code)]

pub mod blocks;
pub mod cluster;
pub mod load;
pub mod nbd_tls;
pub mod power;
pub mod proxy;
pub mod stack;
pub mod tools;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use replica_ha::ha::InSyncTracker;
use replica_ha::ha::fake::MemoryInSync;
use replica_ha::ids::{NodeId, Term};
use replica_ha::replica::disk::local::LocalReplica;
use replica_ha::replica::disk::store::{ReplicaStore, StoreIdentity};
use replica_ha::replica::{FenceReply, Replica, ReplicaError, ReplicaInfo, Stamp};

/// What a [`FaultyReplica`] does with the next requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Pass every request to the store.
    None,
    /// Fail every request as unreachable.
    Fail,
    /// Never answer.
    Hang,
    /// Fail only writes at this offset.
    FailWritesAt(u64),
    /// Hold each write until [`FaultyReplica::release`], then fail it
    /// (`pass: false`) or pass it to the store (`pass: true`). A write that
    /// passes goes on even if its caller gave up on it, as a request already
    /// on the wire would: see [`FaultyReplica::late_outcomes`].
    HoldWrites { pass: bool },
    /// Every flush takes this long before it reaches the store, as on a
    /// disk whose fsync stalls; everything else passes.
    SlowFlushes(Duration),
    /// Writes whose data begins with this byte take this long before they
    /// reach the store, as a request overtaken on the network would.
    DelayWritesOf(u8, Duration),
    /// Writes whose data begins with this byte are held until
    /// [`FaultyReplica::release`], then pass; everything else passes.
    HoldWritesOf(u8),
    /// Flushes are held (and counted as held) until
    /// [`FaultyReplica::release`], then pass; everything else passes.
    HoldFlushes,
}

/// A local replica with a switchable fault.
pub struct FaultyReplica {
    inner: LocalReplica,
    fault: Mutex<Fault>,
    /// Writes held by [`Fault::HoldWrites`] so far.
    held: tokio::sync::watch::Sender<u64>,
    /// Opened by [`FaultyReplica::release`].
    released: Arc<tokio::sync::Semaphore>,
    /// How the held writes that passed ended, in order.
    late: Arc<Mutex<Vec<Result<(), ReplicaError>>>>,
}

impl FaultyReplica {
    pub fn new(id: NodeId, store: Arc<ReplicaStore>) -> Arc<Self> {
        Arc::new(Self {
            inner: LocalReplica::new(id, store),
            fault: Mutex::new(Fault::None),
            held: tokio::sync::watch::channel(0).0,
            released: Arc::new(tokio::sync::Semaphore::new(0)),
            late: Arc::default(),
        })
    }

    /// Waits (bounded) until `count` held writes that pass have ended, and
    /// returns how each did.
    pub async fn late_outcomes(&self, count: usize) -> Vec<Result<(), ReplicaError>> {
        wait_until("the held writes ended", || {
            self.late.lock().unwrap().len() >= count
        })
        .await;
        self.late.lock().unwrap().clone()
    }

    /// Waits (bounded) until `count` writes have been held in all.
    pub async fn wait_held(&self, count: u64) {
        let mut held = self.held.subscribe();
        tokio::time::timeout(Duration::from_secs(10), held.wait_for(|n| *n >= count))
            .await
            .expect("the write reached the held replica in time")
            .expect("the replica is alive");
    }

    /// How many writes have been held in all.
    pub fn held_count(&self) -> u64 {
        *self.held.borrow()
    }

    /// Lets `count` held writes go on.
    pub fn release(&self, count: usize) {
        self.released.add_permits(count);
    }

    /// Counts one request as held and waits for [`FaultyReplica::release`].
    async fn hold(&self) {
        self.held.send_modify(|n| *n += 1);
        self.released
            .acquire()
            .await
            .expect("the semaphore is never closed")
            .forget();
    }

    pub fn set(&self, fault: Fault) {
        *self.fault.lock().unwrap() = fault;
    }

    pub fn store(&self) -> &Arc<ReplicaStore> {
        self.inner.store()
    }

    async fn gate(&self, write_offset: Option<u64>) -> Result<(), ReplicaError> {
        let fault = *self.fault.lock().unwrap();
        match fault {
            Fault::None => Ok(()),
            Fault::Fail => Err(ReplicaError::Unavailable("injected".into())),
            Fault::Hang => {
                std::future::pending::<()>().await;
                Ok(())
            }
            Fault::FailWritesAt(at) if write_offset == Some(at) => {
                Err(ReplicaError::Unavailable("injected".into()))
            }
            Fault::FailWritesAt(_) => Ok(()),
            Fault::SlowFlushes(_)
            | Fault::DelayWritesOf(..)
            | Fault::HoldWritesOf(_)
            | Fault::HoldFlushes => Ok(()),
            Fault::HoldWrites { .. } if write_offset.is_none() => Ok(()),
            Fault::HoldWrites { pass } => {
                self.hold().await;
                if pass {
                    Ok(())
                } else {
                    Err(ReplicaError::Unavailable("injected after a hold".into()))
                }
            }
        }
    }
}

#[async_trait]
impl Replica for FaultyReplica {
    fn id(&self) -> NodeId {
        self.inner.id()
    }
    async fn write(
        &self,
        stamp: Stamp,
        offset: u64,
        data: Bytes,
        fua: bool,
    ) -> Result<(), ReplicaError> {
        if *self.fault.lock().unwrap() == (Fault::HoldWrites { pass: true }) {
            // On the wire: it lands (or is refused) whatever the caller does.
            self.held.send_modify(|n| *n += 1);
            let (released, late) = (Arc::clone(&self.released), Arc::clone(&self.late));
            let store = Arc::clone(self.inner.store());
            let landing = tokio::spawn(async move {
                released.acquire().await.expect("never closed").forget();
                let outcome = store.write(stamp, offset, data, fua).await;
                late.lock().unwrap().push(outcome.clone());
                outcome
            });
            return landing
                .await
                .unwrap_or_else(|e| Err(ReplicaError::Io(e.to_string())));
        }
        let fault = *self.fault.lock().unwrap();
        match fault {
            Fault::DelayWritesOf(byte, delay) if data.first() == Some(&byte) => {
                tokio::time::sleep(delay).await;
            }
            Fault::HoldWritesOf(byte) if data.first() == Some(&byte) => {
                self.hold().await;
            }
            _ => {}
        }
        self.gate(Some(offset)).await?;
        self.inner.write(stamp, offset, data, fua).await
    }
    async fn discard(&self, stamp: Stamp, offset: u64, len: u64) -> Result<(), ReplicaError> {
        self.gate(Some(offset)).await?;
        self.inner.discard(stamp, offset, len).await
    }
    async fn mark_ahead(&self, stamp: Stamp, offset: u64, len: u64) -> Result<(), ReplicaError> {
        self.gate(None).await?;
        self.inner.mark_ahead(stamp, offset, len).await
    }
    async fn read(&self, offset: u64, len: u64) -> Result<Bytes, ReplicaError> {
        self.gate(None).await?;
        self.inner.read(offset, len).await
    }
    async fn flush(&self, stamp: Stamp) -> Result<(), ReplicaError> {
        let stall = *self.fault.lock().unwrap();
        if let Fault::SlowFlushes(stall) = stall {
            tokio::time::sleep(stall).await;
        }
        if stall == Fault::HoldFlushes {
            self.hold().await;
        }
        self.gate(None).await?;
        self.inner.flush(stamp).await
    }
    async fn grow(&self, stamp: Stamp, size: u64) -> Result<u64, ReplicaError> {
        self.gate(None).await?;
        self.inner.grow(stamp, size).await
    }
    async fn fence(&self, term: Term) -> Result<FenceReply, ReplicaError> {
        self.gate(None).await?;
        self.inner.fence(term).await
    }
    async fn clear_dirty_below(&self, term: Term) -> Result<(), ReplicaError> {
        self.gate(None).await?;
        self.inner.clear_dirty_below(term).await
    }
    async fn retire_marks(
        &self,
        stamp: Stamp,
        through: Term,
        extents: &[u64],
    ) -> Result<usize, ReplicaError> {
        self.gate(None).await?;
        self.inner.retire_marks(stamp, through, extents).await
    }
    async fn info(&self) -> Result<ReplicaInfo, ReplicaError> {
        self.gate(None).await?;
        self.inner.info().await
    }
    async fn digests(&self, offset: u64, len: u64) -> Result<(u64, Vec<Bytes>), ReplicaError> {
        self.gate(None).await?;
        self.inner.digests(offset, len).await
    }
    async fn note_missed(
        &self,
        stamp: Stamp,
        node: NodeId,
        incarnation: replica_ha::ids::Incarnation,
        extents: &[u64],
    ) -> Result<(), ReplicaError> {
        self.gate(None).await?;
        self.inner
            .note_missed(stamp, node, incarnation, extents)
            .await
    }
    async fn missed(
        &self,
        node: NodeId,
        from: u64,
    ) -> Result<Option<replica_ha::replica::disk::missed::MissedMap>, ReplicaError> {
        self.gate(None).await?;
        self.inner.missed(node, from).await
    }
    async fn missed_maps(
        &self,
    ) -> Result<std::collections::BTreeMap<NodeId, replica_ha::ids::Incarnation>, ReplicaError>
    {
        self.gate(None).await?;
        self.inner.missed_maps().await
    }
    async fn close_missed(&self, stamp: Stamp, node: NodeId) -> Result<(), ReplicaError> {
        self.gate(None).await?;
        self.inner.close_missed(stamp, node).await
    }
    async fn set_unverified(
        &self,
        stamp: Stamp,
        node: NodeId,
        incarnation: replica_ha::ids::Incarnation,
        change: replica_ha::replica::disk::missed::Unverified,
    ) -> Result<(), ReplicaError> {
        self.gate(None).await?;
        self.inner
            .set_unverified(stamp, node, incarnation, change)
            .await
    }
}

/// An in-memory tracker that appends "remove:<ids>" to a shared event log
/// when it commits, so a test can check commits precede acknowledgements.
pub struct LoggingTracker {
    pub inner: MemoryInSync,
    pub events: Arc<Mutex<Vec<String>>>,
    /// While set, each `add` waits for a permit before it commits.
    hold_adds: Mutex<Option<Arc<tokio::sync::Semaphore>>>,
}

impl LoggingTracker {
    pub fn new(members: &[NodeId], events: Arc<Mutex<Vec<String>>>) -> Arc<Self> {
        Arc::new(Self {
            inner: MemoryInSync::new(members.iter().copied()),
            events,
            hold_adds: Mutex::new(None),
        })
    }

    /// Makes every later `add` wait for a permit of the returned semaphore
    /// before it commits (a slow Raft commit).
    pub fn hold_adds(&self) -> Arc<tokio::sync::Semaphore> {
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        *self.hold_adds.lock().unwrap() = Some(Arc::clone(&gate));
        gate
    }
}

#[async_trait]
impl InSyncTracker for LoggingTracker {
    async fn in_sync(&self) -> Result<BTreeSet<NodeId>, replica_ha::ha::InSyncError> {
        self.inner.in_sync().await
    }
    async fn remove(
        &self,
        term: Term,
        replicas: &BTreeSet<NodeId>,
    ) -> Result<BTreeSet<NodeId>, replica_ha::ha::InSyncError> {
        let result = self.inner.remove(term, replicas).await;
        if result.is_ok() {
            let ids: Vec<String> = replicas.iter().map(|id| format!("n{id}")).collect();
            self.events
                .lock()
                .unwrap()
                .push(format!("remove:{}", ids.join(",")));
        }
        result
    }
    async fn add(
        &self,
        term: Term,
        replicas: &BTreeSet<NodeId>,
    ) -> Result<BTreeSet<NodeId>, replica_ha::ha::InSyncError> {
        let hold = self.hold_adds.lock().unwrap().clone();
        if let Some(hold) = hold {
            hold.acquire().await.expect("never closed").forget();
        }
        let result = self.inner.add(term, replicas).await;
        if result.is_ok() {
            let ids: Vec<String> = replicas.iter().map(|id| format!("n{id}")).collect();
            self.events
                .lock()
                .unwrap()
                .push(format!("add:{}", ids.join(",")));
        }
        result
    }
    async fn volume_size(&self) -> Result<Option<u64>, replica_ha::ha::InSyncError> {
        self.inner.volume_size().await
    }
    async fn resize(&self, term: Term, size: u64) -> Result<(), replica_ha::ha::InSyncError> {
        self.inner.resize(term, size).await
    }
}

pub const SIZE: u64 = 16 * 1024 * 1024;

/// Opens a store for node `id` under `dir`.
pub async fn store(dir: &std::path::Path, id: NodeId) -> Arc<ReplicaStore> {
    Arc::new(
        ReplicaStore::open(
            dir.join(id.to_string()),
            StoreIdentity::new("test", "vol0", SIZE),
        )
        .await
        .expect("open store"),
    )
}

/// Sends the library's logs to the test's captured output (shown when a
/// test fails).
pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_test_writer()
        .with_max_level(tracing::Level::DEBUG)
        .try_init();
}

/// The replica timeout of in-process engine tests: long enough for a real
/// fsync of a dirty mark on a busy CI disk (200 ms was not, once), short
/// enough that the tests with a hanging replica stay quick.
pub const SHORT: Duration = Duration::from_secs(1);

/// Polls `condition` every few milliseconds until it holds; panics naming
/// `what` after ten seconds.
pub async fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !condition() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "timed out waiting: {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Fills the file system that holds `path` to the last byte, with a file
/// at `path` (a full disk, for the tests that need one).
pub fn fill_file_system(path: &std::path::Path) {
    use std::io::Write;
    let mut file = std::fs::File::create(path).expect("create the filler");
    let chunk = vec![0u8; 1 << 20];
    let mut size = chunk.len();
    while size > 0 {
        if file.write_all(&chunk[..size]).is_err() {
            size /= 2;
        }
    }
}

/// Serves `service` alone, over the default transport, on a loopback port
/// of its own; returns the address.
pub async fn serve_replica(
    service: replica_ha::replica::serve::service::ReplicaService,
) -> std::net::SocketAddr {
    serve_replica_with(service, replica_ha::net::Transport::default()).await
}

/// [`serve_replica`] over `transport` (mutual TLS, for one).
pub async fn serve_replica_with(
    service: replica_ha::replica::serve::service::ReplicaService,
    transport: replica_ha::net::Transport,
) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        // Served until the test's runtime ends.
        let _stop = stop;
        service.serve(&transport, listener, stopped).await
    });
    addr
}

/// A number from the environment (benchmark and campaign knobs such as
/// `RUNS`), or `default` when it is unset. A value that is not a number
/// stops the run with its name, rather than being silently ignored.
pub fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(text) => text
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={text:?} is not a number")),
        Err(_) => default,
    }
}

/// The nearest-rank `p`th percentile of `sorted` (ascending, not empty):
/// the smallest sample that at least `p`% of the samples do not exceed.
/// With fewer than 100 samples the 99th is the maximum.
pub fn percentile(sorted: &[Duration], p: usize) -> Duration {
    let rank = (sorted.len() * p).div_ceil(100).max(1);
    sorted[rank.min(sorted.len()) - 1]
}
