//! Who writes one volume: `attach` streams every peer's `WatchLeader` for
//! that volume (by name) and keeps the writer with the highest term that
//! any live node reports as itself.
//!
//! A node that sends nothing for [`SILENCE`] (it streams at least every
//! 100 ms) is taken as gone: a frozen or partitioned writer stops counting
//! long before a new one is elected, though the connection to it is kept
//! until a writer takes over (it may still answer). A stream that fails is
//! opened again after [`RETRY`].
//!
//! A node that holds no copy of the volume answers `NOT_FOUND` with the
//! nodes that do; those it names and `attach` was not given are watched
//! from then on, and the node is asked again only after [`NOT_HELD_RETRY`]
//! (the table may place a copy there later). An update for another volume
//! (a node of an earlier build, which ignores the name and streams its
//! configured volume) never counts.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::api::admin::HOLDERS_METADATA;
use crate::ids::{NodeId, Term};
use crate::net::{Expect, Transport};
use crate::proto::admin::admin_client::AdminClient;
use crate::proto::admin::{LeaderUpdate, WatchLeaderRequest};

/// How long a node may stay silent before its view stops counting.
pub const SILENCE: Duration = Duration::from_millis(300);
/// How soon a failed stream is opened again.
pub const RETRY: Duration = Duration::from_millis(100);
/// How soon a node that holds no copy of the volume is asked again.
pub const NOT_HELD_RETRY: Duration = Duration::from_secs(2);

/// The active writer as `attach` sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Writer {
    pub node: NodeId,
    pub term: Term,
    /// Its NBD address.
    pub nbd: String,
}

/// What the watchers found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    /// The writer, while some live node says it is one.
    pub writer: Option<Writer>,
    /// The volume's size, once any node told it.
    pub size: Option<u64>,
    /// The highest term any live node reported.
    pub term: Term,
}

/// Each node's latest update and when it came.
type Views = Arc<Mutex<BTreeMap<NodeId, (LeaderUpdate, Instant)>>>;

/// What every watcher of one volume shares.
struct Shared {
    transport: Transport,
    /// The volume's name, as asked of the nodes.
    volume: String,
    views: Views,
    seen: watch::Sender<Seen>,
    /// Nodes to watch as well (named as holders by a node without a copy).
    recruit: mpsc::UnboundedSender<(NodeId, String)>,
}

/// How a watch of one node ended.
enum Ended {
    /// It failed, for the reason given: ask again soon.
    Failed(String),
    /// The node holds no copy: ask again later, and watch the holders it
    /// named (id, gRPC address).
    NotHeld {
        why: String,
        holders: Vec<(NodeId, String)>,
    },
}

/// Starts watching volume `volume` on every peer (`id` → gRPC address),
/// and on the holders they name, on `tasks`; the returned receiver follows
/// what they see.
pub fn spawn(
    transport: &Transport,
    peers: &BTreeMap<NodeId, String>,
    volume: &str,
    tasks: &mut JoinSet<()>,
) -> watch::Receiver<Seen> {
    let (seen, receiver) = watch::channel(Seen::default());
    let (recruit, recruits) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared {
        transport: transport.clone(),
        volume: volume.to_string(),
        views: Arc::default(),
        seen,
        recruit,
    });
    for (id, addr) in peers {
        let _ = shared.recruit.send((*id, addr.clone()));
    }
    tasks.spawn(watch_recruits(Arc::clone(&shared), recruits));
    // Views that go silent stop counting even while their stream hangs.
    tasks.spawn(async move {
        loop {
            tokio::time::sleep(SILENCE / 3).await;
            publish(&shared.views, &shared.seen);
        }
    });
    receiver
}

/// Runs one watcher per node recruited, each node once. Its watchers end
/// with it (they are its own tasks).
async fn watch_recruits(
    shared: Arc<Shared>,
    mut recruits: mpsc::UnboundedReceiver<(NodeId, String)>,
) {
    let mut watchers = JoinSet::new();
    let mut known = BTreeSet::new();
    while let Some((id, addr)) = recruits.recv().await {
        if known.insert(id) {
            tracing::debug!(node = %id, %addr, volume = %shared.volume, "watching");
            let span = tracing::info_span!("volume", name = %shared.volume);
            watchers.spawn(tracing::Instrument::instrument(
                watch_node(Arc::clone(&shared), id, addr),
                span,
            ));
        }
    }
}

/// Watches node `id` for good: opens its stream again whenever it ends.
async fn watch_node(shared: Arc<Shared>, id: NodeId, addr: String) {
    loop {
        let pause = match follow(&shared, id, &addr).await {
            Ended::Failed(why) => {
                tracing::debug!(node = %id, %addr, %why, "watch ended");
                RETRY
            }
            Ended::NotHeld { why, holders } => {
                tracing::debug!(node = %id, %addr, %why, "no copy there");
                for holder in holders {
                    let _ = shared.recruit.send(holder);
                }
                NOT_HELD_RETRY
            }
        };
        lock(&shared.views).remove(&id);
        publish(&shared.views, &shared.seen);
        tokio::time::sleep(pause).await;
    }
}

/// Streams node `id`'s updates until the stream fails or goes silent.
async fn follow(shared: &Shared, id: NodeId, addr: &str) -> Ended {
    let mut client = match shared
        .transport
        .client(addr, Expect::Node(id), AdminClient::new)
    {
        Ok(client) => client,
        Err(err) => return Ended::Failed(err.to_string()),
    };
    let request = WatchLeaderRequest {
        volume: shared.volume.clone(),
    };
    let mut stream = match tokio::time::timeout(SILENCE, client.watch_leader(request)).await {
        Err(_) => return Ended::Failed("no answer".into()),
        Ok(Err(status)) => return refused(&status),
        Ok(Ok(response)) => response.into_inner(),
    };
    loop {
        let update = match tokio::time::timeout(SILENCE, stream.message()).await {
            Err(_) => return Ended::Failed(format!("silent for {SILENCE:?}")),
            Ok(Err(status)) => return refused(&status),
            Ok(Ok(None)) => return Ended::Failed("the stream ended".into()),
            Ok(Ok(Some(update))) => update,
        };
        if update.node_id != id.0 {
            return Ended::Failed(format!("node {} answered for node {id}", update.node_id));
        }
        if !update.volume.is_empty() && update.volume != shared.volume {
            return Ended::NotHeld {
                why: format!(
                    "it streams volume {}, not {} (an earlier build, which knows one volume)",
                    update.volume, shared.volume
                ),
                holders: Vec::new(),
            };
        }
        lock(&shared.views).insert(id, (update, Instant::now()));
        publish(&shared.views, &shared.seen);
    }
}

/// How a node's refusal ends its watch: `NOT_FOUND` means it holds no
/// copy, and names who does.
fn refused(status: &tonic::Status) -> Ended {
    if status.code() != tonic::Code::NotFound {
        return Ended::Failed(status.message().to_string());
    }
    let holders = status
        .metadata()
        .get(HOLDERS_METADATA)
        .and_then(|value| value.to_str().ok())
        .map(parse_holders)
        .unwrap_or_default();
    Ended::NotHeld {
        why: status.message().to_string(),
        holders,
    }
}

/// The holders of a [`HOLDERS_METADATA`] value, "ID=HOST:PORT,…"; what
/// does not parse is left out.
fn parse_holders(text: &str) -> Vec<(NodeId, String)> {
    text.split(',')
        .filter_map(|entry| {
            let (id, addr) = entry.split_once('=')?;
            let id = id.trim().parse::<u64>().ok().filter(|id| *id != 0)?;
            let addr = addr.trim();
            addr.parse::<std::net::SocketAddr>().ok()?;
            Some((NodeId(id), addr.to_string()))
        })
        .collect()
}

/// Recomputes what is seen from the views that are not silent.
fn publish(views: &Views, seen: &watch::Sender<Seen>) {
    let now = {
        let views = lock(views);
        let live = views
            .values()
            .filter(|(_, at)| at.elapsed() < SILENCE)
            .map(|(update, _)| update);
        decide(live)
    };
    seen.send_if_modified(|current| {
        // The size is kept once known.
        let next = Seen {
            size: now.size.or(current.size),
            ..now
        };
        let changed = *current != next;
        *current = next;
        changed
    });
}

/// The writer with the highest term among `updates` that claim it, the
/// size and the highest term.
fn decide<'a>(updates: impl Iterator<Item = &'a LeaderUpdate>) -> Seen {
    let mut seen = Seen::default();
    for update in updates {
        seen.term = seen.term.max(Term(update.term));
        if update.size > 0 {
            seen.size = Some(update.size);
        }
        let claims = update.writer && !update.nbd_address.is_empty();
        let better = seen
            .writer
            .as_ref()
            .is_none_or(|w| update.writer_term > w.term.0);
        if claims && better {
            seen.writer = Some(Writer {
                node: NodeId(update.node_id),
                term: Term(update.writer_term),
                nbd: update.nbd_address.clone(),
            });
        }
    }
    seen
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn update(node: u64, term: u64, writer_term: Option<u64>) -> LeaderUpdate {
        LeaderUpdate {
            node_id: node,
            term,
            leader: 0,
            writer: writer_term.is_some(),
            writer_term: writer_term.unwrap_or(0),
            nbd_address: format!("127.0.0.1:1080{node}"),
            volume: "vol0".into(),
            size: 1 << 20,
        }
    }

    #[test]
    fn holders_are_read_from_the_metadata_and_garbage_is_left_out() {
        assert_eq!(
            parse_holders("2=127.0.0.1:7002, 3=[::1]:7003"),
            vec![
                (NodeId(2), "127.0.0.1:7002".to_string()),
                (NodeId(3), "[::1]:7003".to_string())
            ]
        );
        for garbage in ["", "x", "0=127.0.0.1:1", "2=nowhere", "=1.2.3.4:5", "2"] {
            assert_eq!(parse_holders(garbage), vec![], "{garbage:?}");
        }
    }

    #[test]
    fn the_writer_is_the_claim_of_the_highest_term() {
        let old = update(1, 3, Some(3));
        let new = update(2, 4, Some(4));
        let follower = update(3, 4, None);
        let seen = decide([&old, &new, &follower].into_iter());
        assert_eq!(seen.writer.unwrap().node, NodeId(2));
        assert_eq!(seen.term, Term(4));
        assert_eq!(seen.size, Some(1 << 20));
        let seen = decide([&follower].into_iter());
        assert_eq!(seen.writer, None);
        let mut no_nbd = update(1, 5, Some(5));
        no_nbd.nbd_address.clear();
        assert_eq!(decide([&no_nbd].into_iter()).writer, None);
    }
}
