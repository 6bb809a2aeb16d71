//! Heartbeats that travel together: the AppendEntries without entries that
//! this node's groups send to one peer node go to it in one `AppendBatch`
//! call, however many groups this node leads.
//!
//! Every group's heartbeats are sent at the same instants (the node's one
//! heartbeat driver, [`crate::raft::heartbeat`], triggers them all at once),
//! so a peer's queue holds one heartbeat of each group a moment later; its
//! batcher waits [`GATHER`] after the first, then sends what it holds in
//! one call, whose answers stream back each as soon as its group answered
//! (one slow group holds no other back), and hands each its own. Nothing else changes for
//! a group: its send time is taken before its heartbeat is queued (so it
//! is never later than the real send, which is all the lease needs, S4),
//! its reply must name its group, and the peer admits and answers each
//! message of a batch exactly as if it came alone (S8, S9).
//!
//! A peer of an earlier build answers `UNIMPLEMENTED`: from then on its
//! heartbeats go one call each, as before.

use std::sync::Weak;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::{mpsc, oneshot};

use super::*;
use crate::proto::raft::{RaftBatch, RaftBatchItem};

/// How long a batcher waits after the first heartbeat of a round for the
/// others: the driver triggers every group at once, and each group's
/// heartbeat reaches the queue within a few hundred microseconds.
const GATHER: Duration = Duration::from_millis(2);

/// The most messages in one call (the server refuses more).
pub const MAX_BATCH: usize = 4096;

/// One queued heartbeat: the message, how long it may take, and where its
/// answer goes.
pub(super) struct Queued {
    message: RaftMessage,
    ttl: Duration,
    answer: oneshot::Sender<Result<RaftMessage, Status>>,
}

/// How many rounds of heartbeats a node sent, to all its peers, and how
/// many heartbeats they held.
#[derive(Default)]
pub(super) struct Counts {
    rounds: std::sync::atomic::AtomicU64,
    heartbeats: std::sync::atomic::AtomicU64,
}

impl PeerBook {
    /// The rounds of heartbeats this node sent so far, and how many
    /// heartbeats they held (a round sent one by one counts each as one).
    pub fn heartbeat_rounds(&self) -> (u64, u64) {
        (
            self.batched.rounds.load(Ordering::Relaxed),
            self.batched.heartbeats.load(Ordering::Relaxed),
        )
    }
}

/// The queue of one peer's batcher.
pub(super) type Batcher = mpsc::UnboundedSender<Queued>;

impl PeerBook {
    /// Sends `message` (a heartbeat) to `peer` with the other groups'
    /// heartbeats to it, and returns its answer.
    pub(super) async fn heartbeat(
        self: &Arc<Self>,
        peer: NodeId,
        message: RaftMessage,
        ttl: Duration,
    ) -> Result<RaftMessage, Status> {
        let (answer, answered) = oneshot::channel();
        let queued = Queued {
            message,
            ttl,
            answer,
        };
        if let Err(unsent) = self.batcher(peer).send(queued) {
            // The batcher ended (the node is stopping): send it alone.
            let queued = unsent.0;
            return self.append_alone(peer, queued.message, queued.ttl).await;
        }
        answered
            .await
            .unwrap_or_else(|_| Err(Status::unavailable("the heartbeat batcher stopped")))
    }

    /// `peer`'s batcher's queue, started on first use on Raft's runtime.
    fn batcher(self: &Arc<Self>, peer: NodeId) -> mpsc::UnboundedSender<Queued> {
        let mut batchers = lock(&self.batchers);
        if let Some(queue) = batchers.get(&peer).filter(|queue| !queue.is_closed()) {
            return queue.clone();
        }
        let (queue, queued) = mpsc::unbounded_channel();
        // Whether the peer takes batches: set once it answered
        // UNIMPLEMENTED (an earlier build).
        let one_by_one = Arc::new(AtomicBool::new(false));
        let task = run_batcher(Arc::downgrade(self), peer, queued, one_by_one);
        match self.runtime.get() {
            Some(runtime) => drop(runtime.spawn(task)),
            None => drop(tokio::spawn(task)),
        }
        batchers.insert(peer, queue.clone());
        queue
    }

    /// One AppendEntries call to `peer`, alone.
    async fn append_alone(
        &self,
        peer: NodeId,
        message: RaftMessage,
        ttl: Duration,
    ) -> Result<RaftMessage, Status> {
        let mut client = self
            .client(peer)
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let mut request = GrpcRequest::new(message);
        request.set_timeout(ttl);
        client
            .append_entries(request)
            .await
            .map(GrpcResponse::into_inner)
    }
}

/// Gathers `peer`'s heartbeats round by round and sends each round in one
/// call, as a task of its own (a slow peer never holds the next round
/// back). Ends when the node's book is gone or its queue closes.
async fn run_batcher(
    book: Weak<PeerBook>,
    peer: NodeId,
    mut queued: mpsc::UnboundedReceiver<Queued>,
    one_by_one: Arc<AtomicBool>,
) {
    while let Some(first) = queued.recv().await {
        let mut round = vec![first];
        let gathered = tokio::time::sleep(GATHER);
        tokio::pin!(gathered);
        while round.len() < MAX_BATCH {
            tokio::select! {
                next = queued.recv() => match next {
                    Some(next) => round.push(next),
                    None => break,
                },
                _ = &mut gathered => break,
            }
        }
        let Some(book) = book.upgrade() else { return };
        let one_by_one = Arc::clone(&one_by_one);
        tokio::spawn(async move { send_round(&book, peer, round, &one_by_one).await });
    }
}

/// Sends one round to `peer` and answers each heartbeat of it.
async fn send_round(book: &PeerBook, peer: NodeId, round: Vec<Queued>, one_by_one: &AtomicBool) {
    let rounds = match one_by_one.load(Ordering::Relaxed) {
        true => round.len() as u64,
        false => 1,
    };
    book.batched.rounds.fetch_add(rounds, Ordering::Relaxed);
    book.batched
        .heartbeats
        .fetch_add(round.len() as u64, Ordering::Relaxed);
    if round.len() == 1 || one_by_one.load(Ordering::Relaxed) {
        return send_each(book, peer, round).await;
    }
    let ttl = round.iter().map(|q| q.ttl).max().unwrap_or_default();
    let messages = round.iter().map(|q| q.message.clone()).collect();
    let sent = async {
        let mut client = book
            .client(peer)
            .map_err(|e| Status::unavailable(e.to_string()))?;
        let mut request = GrpcRequest::new(RaftBatch { messages });
        request.set_timeout(ttl);
        client
            .append_batch(request)
            .await
            .map(GrpcResponse::into_inner)
    };
    match sent.await {
        Ok(answers) => answer_as_they_come(round, answers).await,
        Err(status) if status.code() == tonic::Code::Unimplemented => {
            tracing::info!(%peer, "the peer takes no heartbeat batches (an earlier build); one by one");
            one_by_one.store(true, Ordering::Relaxed);
            send_each(book, peer, round).await;
        }
        Err(status) => {
            for queued in round {
                let _ = queued.answer.send(Err(status.clone()));
            }
        }
    }
}

/// Hands each answer of a batch's stream to its heartbeat as it comes;
/// those the stream ends (or fails) without get that error.
async fn answer_as_they_come(round: Vec<Queued>, mut answers: tonic::Streaming<RaftBatchItem>) {
    let mut waiting: Vec<Option<oneshot::Sender<Result<RaftMessage, Status>>>> = round
        .into_iter()
        .map(|queued| Some(queued.answer))
        .collect();
    let ended = loop {
        match answers.message().await {
            Ok(Some(item)) => {
                let slot = usize::try_from(item.index)
                    .ok()
                    .and_then(|index| waiting.get_mut(index))
                    .and_then(Option::take);
                if let Some(answer) = slot {
                    let _ = answer.send(match item.code {
                        0 => item
                            .reply
                            .ok_or_else(|| Status::internal("a batch answer without its reply")),
                        code => Err(Status::new(tonic::Code::from(code), item.error)),
                    });
                }
            }
            Ok(None) => break Status::internal("the batch ended without this answer"),
            Err(status) => break status,
        }
    };
    for answer in waiting.into_iter().flatten() {
        let _ = answer.send(Err(ended.clone()));
    }
}

/// Sends each heartbeat of `round` in a call of its own, all at once.
async fn send_each(book: &PeerBook, peer: NodeId, round: Vec<Queued>) {
    let calls = round.into_iter().map(|queued| async move {
        let answer = book.append_alone(peer, queued.message, queued.ttl).await;
        let _ = queued.answer.send(answer);
    });
    futures::future::join_all(calls).await;
}
