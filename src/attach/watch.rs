//! Who writes: `attach` streams every peer's `WatchLeader` and keeps the
//! writer with the highest term that any live node reports as itself.
//!
//! A node that sends nothing for [`SILENCE`] (it streams at least every
//! 100 ms) is taken as gone: a frozen or partitioned writer stops counting
//! long before a new one is elected, though the connection to it is kept
//! until a writer takes over (it may still answer). A stream that fails is
//! opened again after [`RETRY`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::ids::{NodeId, Term};
use crate::net::{Expect, Transport};
use crate::proto::admin::admin_client::AdminClient;
use crate::proto::admin::{LeaderUpdate, WatchLeaderRequest};

/// How long a node may stay silent before its view stops counting.
pub const SILENCE: Duration = Duration::from_millis(300);
/// How soon a failed stream is opened again.
pub const RETRY: Duration = Duration::from_millis(100);

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

/// Starts one watcher per peer (`id` → gRPC address) on `tasks`; the
/// returned receiver follows what they see.
pub fn spawn(
    transport: &Transport,
    peers: &BTreeMap<NodeId, String>,
    tasks: &mut JoinSet<()>,
) -> watch::Receiver<Seen> {
    let (seen, receiver) = watch::channel(Seen::default());
    let seen = Arc::new(seen);
    let views: Views = Arc::default();
    for (id, addr) in peers {
        let (transport, addr, id) = (transport.clone(), addr.clone(), *id);
        let (views, seen) = (Arc::clone(&views), Arc::clone(&seen));
        tasks.spawn(async move {
            loop {
                if let Err(why) = follow(&transport, id, &addr, &views, &seen).await {
                    tracing::debug!(node = %id, %addr, %why, "watch ended");
                }
                lock(&views).remove(&id);
                publish(&views, &seen);
                tokio::time::sleep(RETRY).await;
            }
        });
    }
    // Views that go silent stop counting even while their stream hangs.
    tasks.spawn(async move {
        loop {
            tokio::time::sleep(SILENCE / 3).await;
            publish(&views, &seen);
        }
    });
    receiver
}

/// Streams node `id`'s updates until the stream fails or goes silent.
async fn follow(
    transport: &Transport,
    id: NodeId,
    addr: &str,
    views: &Views,
    seen: &watch::Sender<Seen>,
) -> Result<(), String> {
    let mut client = transport
        .client(addr, Expect::Node(id), AdminClient::new)
        .map_err(|e| e.to_string())?;
    let mut stream =
        tokio::time::timeout(SILENCE, client.watch_leader(WatchLeaderRequest::default()))
            .await
            .map_err(|_| "no answer".to_string())?
            .map_err(|status| status.message().to_string())?
            .into_inner();
    loop {
        let update = tokio::time::timeout(SILENCE, stream.message())
            .await
            .map_err(|_| format!("silent for {SILENCE:?}"))?
            .map_err(|status| status.message().to_string())?
            .ok_or("the stream ended")?;
        if update.node_id != id.0 {
            return Err(format!("node {} answered for node {id}", update.node_id));
        }
        lock(views).insert(id, (update, Instant::now()));
        publish(views, seen);
    }
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
