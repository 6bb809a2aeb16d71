//! The campaign's workload: clients that write self-describing blocks over
//! NBD to whichever node is the writer, and record every outcome.
//!
//! - Every block a client writes names itself: a header with the client,
//!   its sequence number and the block, and a body derived from all three,
//!   so the checker can tell which write a block holds, or that it holds
//!   none (torn or foreign bytes).
//! - Each client owns its blocks and writes one request at a time, with FUA:
//!   an acknowledgement means the write is durable on the in-sync replicas.
//! - A write that was not acknowledged (an NBD error, a timeout, a dropped
//!   connection) may or may not have landed, and may still be on its way.
//!   On any failure the client reconnects, trying the nodes in turn until
//!   one offers a writable export (a passive node's export is read-only).
//! - If that is another node — necessarily a writer of another term, as a
//!   term has one leader — the client writes the failed block again there,
//!   once. A write of the old term must never land after that one (S1–S3):
//!   this is how a stale write shows up as a lost acknowledged write. The
//!   block is then never written again, so such a late write stays visible
//!   at the end. Otherwise (the same node again) the block is retired too:
//!   the outcome of a write still in flight at a live writer of the same
//!   term is undefined against a later one, so no rule could judge it.
//! - For every block the final content must therefore be its last
//!   acknowledged write or a write after that one.
//! - Half the writes go to a few hot blocks (overwritten often, so ordering
//!   errors show) and half to many cold ones (mostly first writes, so a
//!   replica whose disk cannot allocate fails them).
//! - Beside them, overlapping writers ([`Layout::overlap`]): a few
//!   connections writing 4 KiB (or, one time in four, discarding it) at
//!   random 512-byte offsets within 16 KiB at once, so changes to the same
//!   bytes are in flight together. No rule can
//!   say which of them a block holds, so their outcomes are only counted;
//!   the diverged rule (every in-sync replica byte-identical at the end)
//!   judges them (design S11).

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
use tokio::time::Instant;

use super::nbd::{Connection, Reply};

pub const BLOCK: usize = 4096;
const MAGIC: &[u8; 8] = b"RHACHAOS";
/// How long one write may take before the client gives up on it (longer
/// than a failover, so a write stalled by one usually still ends with an
/// answer rather than a timeout).
const WRITE_LIMIT: Duration = Duration::from_secs(4);

/// Which write a block holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct WriteId {
    pub client: u32,
    pub seq: u64,
}

/// The contents of `id`'s write to `block`.
pub fn encode(id: WriteId, block: u64) -> Vec<u8> {
    let mut data = Vec::with_capacity(BLOCK);
    data.extend_from_slice(MAGIC);
    data.extend_from_slice(&id.client.to_be_bytes());
    data.extend_from_slice(&id.seq.to_be_bytes());
    data.extend_from_slice(&block.to_be_bytes());
    let mut state =
        (u64::from(id.client) << 48) ^ id.seq.rotate_left(17) ^ block.wrapping_mul(0x9e37_79b9);
    while data.len() < BLOCK {
        state = super::rng::splitmix(state);
        data.extend_from_slice(&state.to_be_bytes());
    }
    data.truncate(BLOCK);
    data
}

/// What a block holds: all zeroes, exactly one recorded write, or neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    Zero,
    Write(WriteId),
    Garbage,
}

pub fn decode(data: &[u8], block: u64) -> Content {
    if data.iter().all(|b| *b == 0) {
        return Content::Zero;
    }
    if data.len() != BLOCK || &data[..8] != MAGIC {
        return Content::Garbage;
    }
    let client = u32::from_be_bytes(data[8..12].try_into().unwrap());
    let seq = u64::from_be_bytes(data[12..20].try_into().unwrap());
    let id = WriteId { client, seq };
    if encode(id, block) == data {
        Content::Write(id)
    } else {
        Content::Garbage
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Acked,
    /// The server answered with an NBD error number.
    Refused(u32),
    /// No answer: a timeout or a dropped connection.
    Unknown(String),
}

/// One write as the client saw it. Times are since the workload started.
#[derive(Debug, Clone)]
pub struct Record {
    pub id: WriteId,
    pub block: u64,
    pub node: u64,
    pub invoked: Duration,
    pub completed: Duration,
    pub outcome: Outcome,
}

/// The blocks of the volume the workload uses: `clients × per_client`
/// blocks spread evenly over the volume, so writes touch many extents; the
/// first `hot` of each client's blocks are written half of the time.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    /// Where the workload's part of the volume begins.
    pub base: u64,
    pub clients: u32,
    pub per_client: u64,
    pub hot: u64,
    pub size: u64,
    /// Where the overlapping writers write (16 KiB, outside the blocks).
    pub overlap: u64,
}

/// The span the overlapping writers share, and how many there are.
const OVERLAP_SPAN: u64 = 16 * 1024;
const OVERLAP_WRITERS: u32 = 3;

impl Layout {
    pub fn offset(&self, block: u64) -> u64 {
        let stride = self.size / (u64::from(self.clients) * self.per_client);
        self.base + block * (stride / BLOCK as u64 * BLOCK as u64)
    }

    pub fn blocks_of(&self, client: u32) -> std::ops::Range<u64> {
        let first = u64::from(client) * self.per_client;
        first..first + self.per_client
    }

    pub fn all_blocks(&self) -> std::ops::Range<u64> {
        0..u64::from(self.clients) * self.per_client
    }
}

pub struct Workload {
    pub history: Arc<Mutex<Vec<Record>>>,
    /// Overlapping writes acknowledged (see [`Layout::overlap`]).
    pub overlapping: Arc<std::sync::atomic::AtomicU64>,
    stop: watch::Sender<bool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Workload {
    /// Starts `layout.clients` clients against the NBD addresses `nodes`.
    pub fn start(layout: Layout, nodes: BTreeMap<u64, SocketAddr>, seed: u64) -> Workload {
        let history = Arc::new(Mutex::new(Vec::new()));
        let (stop, stopped) = watch::channel(false);
        let started = Instant::now();
        let overlapping = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut tasks: Vec<tokio::task::JoinHandle<()>> = (0..OVERLAP_WRITERS)
            .map(|i| {
                tokio::spawn(overlap_writer(
                    layout.overlap,
                    nodes.clone(),
                    stopped.clone(),
                    Arc::clone(&overlapping),
                    seed ^ (u64::from(i) + 1).wrapping_mul(0x2545_f491_4f6c_dd1d),
                ))
            })
            .collect();
        let clients = (0..layout.clients)
            .map(|client| {
                let client = Client {
                    id: client,
                    layout,
                    nodes: nodes.clone(),
                    history: Arc::clone(&history),
                    stopped: stopped.clone(),
                    started,
                    rng: super::rng::Rng::new(seed ^ ((u64::from(client) + 1) * 0x5851_f42d)),
                };
                tokio::spawn(client.run())
            })
            .collect::<Vec<_>>();
        tasks.extend(clients);
        Workload {
            history,
            overlapping,
            stop,
            tasks,
        }
    }

    /// Writes acknowledged so far.
    pub fn acked(&self) -> usize {
        let history = self.history.lock().unwrap();
        history
            .iter()
            .filter(|r| r.outcome == Outcome::Acked)
            .count()
    }

    /// Stops every client (each finishes or abandons its current write) and
    /// returns the history.
    pub async fn stop(self) -> Vec<Record> {
        let _ = self.stop.send(true);
        for task in self.tasks {
            let _ = task.await;
        }
        let history = self.history.lock().unwrap();
        history.clone()
    }
}

struct Client {
    id: u32,
    layout: Layout,
    nodes: BTreeMap<u64, SocketAddr>,
    history: Arc<Mutex<Vec<Record>>>,
    stopped: watch::Receiver<bool>,
    started: Instant,
    rng: super::rng::Rng,
}

impl Client {
    async fn run(mut self) {
        let blocks = self.layout.blocks_of(self.id);
        let hot_end = blocks.start + self.layout.hot;
        let mut hot: Vec<u64> = (blocks.start..hot_end).collect();
        let mut cold: Vec<u64> = (hot_end..blocks.end).collect();
        let mut seq = 0u64;
        let mut connection: Option<(u64, Connection)> = None;
        // The block whose write failed, and the node it failed on.
        let mut failed: Option<(u64, u64)> = None;
        let mut retrying = None;
        while !*self.stopped.borrow() && (!hot.is_empty() || !cold.is_empty()) {
            let Some((node, conn)) = connection.as_mut() else {
                connection = self.find_writer().await;
                let found = connection.as_ref().map(|(node, _)| *node);
                if let (Some(node), Some((block, on))) = (found, failed) {
                    failed = None;
                    if node != on {
                        retrying = Some(block);
                    } else {
                        hot.retain(|b| *b != block);
                        cold.retain(|b| *b != block);
                    }
                }
                continue;
            };
            seq += 1;
            let block = match retrying {
                Some(block) => block,
                None => {
                    let pool = if cold.is_empty() || (!hot.is_empty() && self.rng.below(2) == 0) {
                        &hot
                    } else {
                        &cold
                    };
                    pool[self.rng.below(pool.len() as u64) as usize]
                }
            };
            let id = WriteId {
                client: self.id,
                seq,
            };
            let invoked = self.started.elapsed();
            let result = conn
                .write_fua(self.layout.offset(block), &encode(id, block), WRITE_LIMIT)
                .await;
            let outcome = match result {
                Ok(Reply::Ok(_)) => Outcome::Acked,
                Ok(Reply::Error(errno)) => Outcome::Refused(errno),
                Err(err) => Outcome::Unknown(err.to_string()),
            };
            let acked = outcome == Outcome::Acked;
            let node = *node;
            self.history.lock().unwrap().push(Record {
                id,
                block,
                node,
                invoked,
                completed: self.started.elapsed(),
                outcome,
            });
            if retrying.is_some() {
                // Frozen, whatever the outcome: a stale write that lands
                // later stays visible to the checker.
                hot.retain(|b| *b != block);
                cold.retain(|b| *b != block);
            } else if !acked {
                failed = Some((block, node));
            }
            if !acked {
                connection = None;
                // As a real client would: back off before reconnecting, or
                // a writer that refuses at once (fewer in-sync replicas
                // than min_in_sync) turns the client into a busy loop.
                self.pause(Duration::from_millis(100)).await;
            }
            retrying = None;
        }
    }

    /// Tries every node (starting at a random one) until one offers a
    /// writable export, pausing between rounds; `None` once stopped.
    async fn find_writer(&mut self) -> Option<(u64, Connection)> {
        let ids: Vec<u64> = self.nodes.keys().copied().collect();
        let first = self.rng.below(ids.len() as u64) as usize;
        for i in 0..ids.len() {
            if *self.stopped.borrow() {
                return None;
            }
            let node = ids[(first + i) % ids.len()];
            if let Ok(conn) = Connection::open(self.nodes[&node], Duration::from_secs(1)).await {
                if !conn.read_only {
                    return Some((node, conn));
                }
            }
        }
        self.pause(Duration::from_millis(100)).await;
        None
    }

    /// Sleeps for `how_long`, or until the workload stops.
    async fn pause(&self, how_long: Duration) {
        pause(&self.stopped, how_long).await;
    }
}

/// Sleeps for `how_long`, or until the workload stops.
async fn pause(stopped: &watch::Receiver<bool>, how_long: Duration) {
    let mut stopped = stopped.clone();
    let _ = tokio::time::timeout(how_long, stopped.wait_for(|s| *s)).await;
}

/// One overlapping writer: 4 KiB of fresh bytes at a random 512-byte offset
/// within `OVERLAP_SPAN` at `base`, one after another, to whichever node
/// offers a writable export; counts what was acknowledged.
async fn overlap_writer(
    base: u64,
    nodes: BTreeMap<u64, SocketAddr>,
    stopped: watch::Receiver<bool>,
    acked: Arc<std::sync::atomic::AtomicU64>,
    seed: u64,
) {
    let mut rng = super::rng::Rng::new(seed);
    let ids: Vec<u64> = nodes.keys().copied().collect();
    let mut connection: Option<Connection> = None;
    while !*stopped.borrow() {
        let Some(conn) = connection.as_mut() else {
            let node = ids[rng.below(ids.len() as u64) as usize];
            match Connection::open(nodes[&node], Duration::from_secs(1)).await {
                Ok(conn) if !conn.read_only => connection = Some(conn),
                _ => pause(&stopped, Duration::from_millis(100)).await,
            }
            continue;
        };
        let offset = base + rng.below((OVERLAP_SPAN - BLOCK as u64) / 512 + 1) * 512;
        let mut data = Vec::with_capacity(BLOCK);
        let mut state = rng.next();
        while data.len() < BLOCK {
            state = super::rng::splitmix(state);
            data.extend_from_slice(&state.to_be_bytes());
        }
        let answer = if rng.below(4) == 0 {
            conn.trim_fua(offset, BLOCK as u32, WRITE_LIMIT).await
        } else {
            conn.write_fua(offset, &data, WRITE_LIMIT).await
        };
        match answer {
            Ok(Reply::Ok(_)) => {
                acked.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            _ => {
                connection = None;
                pause(&stopped, Duration::from_millis(100)).await;
            }
        }
    }
}
