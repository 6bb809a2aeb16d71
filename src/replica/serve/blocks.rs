//! The block channel's server: the stores a node serves, offered to their
//! volumes' writers as frames ([`crate::net::frame`]) for writes,
//! discards, reads and flushes.
//!
//! It is block I/O's only server (the replica gRPC service has only the
//! control calls), and makes the same checks as that service, in the
//! same order, so neither adds a path around them:
//! - **S9.** A connection reaches this server only after the data
//!   listener's TLS handshake; every frame is then admitted by the members'
//!   [`PeerGuard`] (the member list can change while a connection lives).
//! - **Identity.** The first frame must be a `Hello` naming this node's
//!   cluster and a volume it holds a copy of ([`Stores`]), by its name and
//!   Raft group (an earlier build's `Hello` names no group: group 0). A
//!   copy of that name of another group is another volume (names are
//!   reused after a delete, and terms of different groups are not
//!   comparable, S2): refused like a volume not held, naming both groups.
//!   Anything else closes the connection with the refusal, and no store is
//!   touched. The connection is bound to that volume's store for its life:
//!   a later frame cannot name another (a second `Hello` closes it), so a
//!   writer of one volume reaches no other volume's copy (S2, S3 hold per
//!   volume). The `Ok` that answers the `Hello` carries the store's
//!   session (8 bytes, big-endian;
//!   [`crate::replica::disk::store::ReplicaStore::session`]), by which the
//!   writer tells a replica that restarted (and may have lost writes it
//!   had not flushed) from one it merely reconnected to.
//! - **Removal.** A volume removed from the [`Stores`] while a connection
//!   to it lives closes that connection as the server's stop does: no
//!   further frame is read, what runs finishes on the store it began on.
//! - **S8.** Every request names the incarnation it is for; one meant for
//!   another incarnation is refused and changes nothing.
//! - **S2, S3, S6, range.** The store checks the stamp, drains, marks and
//!   bounds exactly as for an in-process request.
//! - A frame that does not decode (bad checksum, unknown kind, oversized)
//!   closes the connection; nothing from it reaches the store.
//!
//! Requests run concurrently, at most [`IN_FLIGHT`] per connection and at
//! most 64 MiB of payload and read data (the reader stops reading past
//! either); replies go back in completion order through the batching
//! writer of [`crate::net::link`]. A node serves at most
//! [`MAX_CONNECTIONS`] block connections; nothing is read from one the
//! guard does not admit, and at most 1 KiB before its `Hello`.
//!
//! Its errors go to the wire through [`crate::replica::wire`].

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use tokio::sync::{Semaphore, mpsc, watch};

use crate::ids::Incarnation;
use crate::net::PeerGuard;
use crate::net::conn::{Accepted, PeerInfo};
use crate::net::frame::{FUA, Frame, Header, Kind, parse_hello};
use crate::net::link::{FrameReader, ReadError, send_frames};
use crate::replica::ReplicaError;
use crate::replica::disk::store::ReplicaStore;
use crate::replica::serve::stores::{Served, Stores};
use crate::replica::wire::to_refusal;

/// The most requests one connection runs at once.
pub const IN_FLIGHT: usize = 256;

/// The most payload bytes (KiB) one connection's requests and their read
/// replies hold at once: 64 MiB. The reader stops reading past it.
const BUDGET_KIB: u32 = 64 * 1024;

/// The most block-channel connections a node serves at once.
pub const MAX_CONNECTIONS: usize = 256;

/// The largest `Hello` payload (a cluster id, a volume name and a group).
const HELLO_MAX: u32 = 1024;

/// How long a stopping server, or a connection's last replies, may take.
const STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(2);

/// A request's share of its connection's budget, in KiB: its payload and
/// the data a read will send back.
fn cost(header: &Header) -> u32 {
    let reply = match header.kind {
        Kind::Read => header.length.min(crate::volume::MAX_REQUEST),
        _ => 0,
    };
    let kib = (u64::from(header.payload_len) + reply) / 1024 + 1;
    u32::try_from(kib).unwrap_or(BUDGET_KIB).min(BUDGET_KIB)
}

/// A reply's payload with the budget it holds, released when the payload
/// has been written and dropped.
struct Held {
    data: Bytes,
    _bytes: tokio::sync::OwnedSemaphorePermit,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

/// Why the server closed a connection before its peer did.
#[derive(Debug, thiserror::Error)]
enum Closed {
    /// The guard does not (or no longer) admit the peer (S9).
    #[error("not admitted: {0}")]
    NotAdmitted(String),
    /// What arrived is no frame, or the connection failed.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// The first frame was no `Hello` for a volume this node serves.
    #[error(transparent)]
    Hello(ReplicaError),
    /// A reply or a second `Hello` where a request belongs.
    #[error("a {0:?} frame where a request belongs")]
    Misplaced(Kind),
}

/// Serves the block channel of a node's stores; see the module docs.
#[derive(Clone)]
pub struct BlockServer {
    stores: Stores,
    incarnation: Incarnation,
    guard: PeerGuard,
    node: Arc<str>,
}

impl BlockServer {
    /// A server of `stores`, incarnation `incarnation` of node `node`'s
    /// data dir, admitting frames through `guard`.
    pub fn new(stores: Stores, incarnation: Incarnation, guard: PeerGuard, node: &str) -> Self {
        Self {
            stores,
            incarnation,
            guard,
            node: Arc::from(node),
        }
    }

    /// Serves every connection that arrives on `connections` (their
    /// preface already read) until `stop` turns true; then gives the
    /// connections `STOP_GRACE` to finish what they started.
    pub async fn serve(
        self,
        mut connections: mpsc::Receiver<Accepted>,
        stop: watch::Receiver<bool>,
    ) {
        let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
        let mut running = tokio::task::JoinSet::new();
        let mut stopped = stop.clone();
        loop {
            let accepted = tokio::select! {
                accepted = connections.recv() => accepted,
                _ = stopped.wait_for(|stop| *stop) => None,
                Some(_) = running.join_next(), if !running.is_empty() => continue,
            };
            let Some(accepted) = accepted else { break };
            let remote = accepted.peer().remote;
            let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
                tracing::warn!(node = %self.node, ?remote, "block channel: too many connections; refused one");
                continue;
            };
            let server = self.clone();
            let stop = stop.clone();
            running.spawn(async move {
                if let Err(why) = server.serve_connection(accepted, stop).await {
                    tracing::info!(node = %server.node, ?remote, %why, "block channel closed");
                }
                drop(slot);
            });
        }
        let _ = tokio::time::timeout(STOP_GRACE, async {
            while running.join_next().await.is_some() {}
        })
        .await;
        running.abort_all();
    }

    /// Serves one connection until it closes, fails or `stop` turns true.
    async fn serve_connection(
        &self,
        accepted: Accepted,
        stop: watch::Receiver<bool>,
    ) -> Result<(), Closed> {
        let peer = accepted.peer().clone();
        let (reader, writer) = tokio::io::split(accepted);
        let (replies, outgoing) = mpsc::channel::<Frame>(IN_FLIGHT);
        let in_flight = Arc::new(Semaphore::new(IN_FLIGHT));
        let running = Arc::clone(&in_flight);
        let mut sending = tokio::spawn(send_frames(writer, outgoing, move || {
            IN_FLIGHT - running.available_permits() > 1
        }));
        let mut frames = FrameReader::new(reader, BytesMut::with_capacity(64 * 1024));
        let mut connection = Connection {
            peer,
            replies,
            stop,
            in_flight,
            budget: Arc::new(Semaphore::new(BUDGET_KIB as usize)),
        };
        let outcome = self.converse(&mut connection, &mut frames).await;
        drop(connection);
        // Replies of requests still running are sent as they finish; the
        // writer ends once the last one is out, or gives up on a client
        // that does not read.
        if tokio::time::timeout(STOP_GRACE, &mut sending)
            .await
            .is_err()
        {
            sending.abort();
        }
        outcome
    }

    /// Admits the peer, binds the connection to the volume its `Hello`
    /// names, then serves its requests against that volume's store.
    async fn converse<R>(
        &self,
        connection: &mut Connection,
        frames: &mut FrameReader<R>,
    ) -> Result<(), Closed>
    where
        R: tokio::io::AsyncRead + Unpin,
    {
        // Nothing is read from a connection the guard would not admit, and
        // little before its Hello.
        frames.limit(Some(HELLO_MAX));
        self.admit(connection, 0).await?;
        let Some(frame) = connection.next(frames, None).await? else {
            return Ok(());
        };
        self.admit(connection, frame.header.id).await?;
        let served = match self.hello(&frame) {
            Ok(served) => served,
            Err(err) => {
                connection.reply(to_refusal(frame.header.id, &err)).await;
                return Err(Closed::Hello(err));
            }
        };
        frames.limit(None);
        // Its payload: the store's session, which tells the writer whether
        // this replica restarted.
        let session = Bytes::copy_from_slice(&served.store().session().to_be_bytes());
        let ok = Frame::new(Header::new(Kind::Ok, frame.header.id), session);
        connection.reply(ok).await;
        self.serve_requests(connection, frames, &served).await
    }

    /// Serves the requests of a connection bound to `served`'s store until
    /// it closes, fails, `stop` turns true or the volume is removed.
    async fn serve_requests<R>(
        &self,
        connection: &mut Connection,
        frames: &mut FrameReader<R>,
        served: &Served,
    ) -> Result<(), Closed>
    where
        R: tokio::io::AsyncRead + Unpin,
    {
        let mut retired = served.retired();
        loop {
            let Some(frame) = connection.next(frames, Some(&mut retired)).await? else {
                return Ok(());
            };
            // The member list can change while a connection lives.
            self.admit(connection, frame.header.id).await?;
            if frame.header.kind.is_reply() || frame.header.kind == Kind::Hello {
                return Err(Closed::Misplaced(frame.header.kind));
            }
            let (Ok(slot), Ok(bytes)) = (
                Arc::clone(&connection.in_flight).acquire_owned().await,
                Arc::clone(&connection.budget)
                    .acquire_many_owned(cost(&frame.header))
                    .await,
            ) else {
                return Ok(());
            };
            let server = self.clone();
            let store = Arc::clone(served.store());
            let replies = connection.replies.clone();
            tokio::spawn(async move {
                let reply = server.handle(&store, frame).await;
                // A read's data keeps its share of the budget until it has
                // been sent.
                let reply = Frame {
                    payload: Bytes::from_owner(Held {
                        data: reply.payload,
                        _bytes: bytes,
                    }),
                    header: reply.header,
                };
                let _ = replies.send(reply).await;
                drop(slot);
            });
        }
    }

    /// Asks the guard whether the peer is (still) admitted (S9); if not,
    /// refuses request `id` and closes.
    async fn admit(&self, connection: &Connection, id: u64) -> Result<(), Closed> {
        match self.guard.admit(Some(&connection.peer)) {
            Ok(_) => Ok(()),
            Err(status) => {
                let why = status.message().to_string();
                let refusal = ReplicaError::IdentityMismatch(why.clone());
                connection.reply(to_refusal(id, &refusal)).await;
                Err(Closed::NotAdmitted(why))
            }
        }
    }

    /// Checks a connection's first frame: a `Hello` for this node's
    /// cluster and a volume it serves, of the group it names, whose store
    /// it returns. Looks at no store before all match.
    fn hello(&self, frame: &Frame) -> Result<Served, ReplicaError> {
        if frame.header.kind != Kind::Hello {
            return Err(ReplicaError::InvalidRequest(format!(
                "a block channel opens with Hello, not {:?}",
                frame.header.kind
            )));
        }
        let Some(hello) = parse_hello(&frame.payload) else {
            return Err(ReplicaError::InvalidRequest("malformed Hello".into()));
        };
        let (cluster, volume) = (hello.cluster_id, hello.volume);
        if cluster != self.stores.cluster_id() {
            return Err(ReplicaError::IdentityMismatch(format!(
                "block channel for cluster {cluster:?} volume {volume:?}; this node serves \
                 cluster {:?}",
                self.stores.cluster_id()
            )));
        }
        self.stores
            .find(volume, hello.group)
            .map_err(|refused| ReplicaError::IdentityMismatch(format!("block channel: {refused}")))
    }

    /// Runs one request against `store`, the connection's; the reply to
    /// send.
    #[tracing::instrument(level = "debug", name = "blocks.request", skip_all, fields(node = %self.node, volume = %store.identity().volume, kind = ?frame.header.kind, term = %frame.header.stamp.term))]
    async fn handle(&self, store: &ReplicaStore, frame: Frame) -> Frame {
        let h = frame.header;
        let stamp = h.stamp;
        let done = |payload: Bytes| Frame::new(Header::new(Kind::Ok, h.id), payload);
        if h.incarnation != self.incarnation.0 {
            let err = ReplicaError::IdentityMismatch(crate::replica::wire::replaced_disk(
                self.incarnation,
                Incarnation(h.incarnation),
            ));
            return to_refusal(h.id, &err);
        }
        let outcome = match h.kind {
            Kind::Write => store
                .write(stamp, h.offset, frame.payload, h.flags & FUA != 0)
                .await
                .map(|()| Bytes::new()),
            Kind::Discard => store
                .discard(stamp, h.offset, h.length)
                .await
                .map(|()| Bytes::new()),
            Kind::Mark => store
                .mark_ahead(stamp, h.offset, h.length)
                .await
                .map(|()| Bytes::new()),
            Kind::Read => store.read(h.offset, h.length).await,
            Kind::Flush => store.flush(stamp).await.map(|()| Bytes::new()),
            Kind::Hello | Kind::Ok | Kind::Refused => Err(ReplicaError::InvalidRequest(format!(
                "{:?} is not a request",
                h.kind
            ))),
        };
        match outcome {
            Ok(payload) => done(payload),
            Err(err) => to_refusal(h.id, &err),
        }
    }
}

/// One connection's state shared by its reading loop: who the peer is,
/// where replies go, and what bounds it.
struct Connection {
    peer: PeerInfo,
    replies: mpsc::Sender<Frame>,
    stop: watch::Receiver<bool>,
    in_flight: Arc<Semaphore>,
    budget: Arc<Semaphore>,
}

impl Connection {
    /// Queues `frame` for the peer (a peer gone already gets nothing).
    async fn reply(&self, frame: Frame) {
        let _ = self.replies.send(frame).await;
    }

    /// The next frame, or `None` once the peer closed, `stop` turned true
    /// or (when given) the volume was retired. Stopping drops a frame
    /// being read: the connection ends. What is buffered already is taken
    /// without waiting.
    async fn next<R>(
        &mut self,
        frames: &mut FrameReader<R>,
        retired: Option<&mut watch::Receiver<bool>>,
    ) -> Result<Option<Frame>, Closed>
    where
        R: tokio::io::AsyncRead + Unpin,
    {
        let is_retired = retired.as_ref().is_some_and(|r| *r.borrow());
        if *self.stop.borrow() || is_retired {
            return Ok(None);
        }
        let read = match frames.buffered() {
            // Stopping and retiring first: a frame that arrives after the
            // volume was removed is never served.
            Ok(None) => tokio::select! {
                biased;
                _ = self.stop.wait_for(|stop| *stop) => return Ok(None),
                () = until_retired(retired) => return Ok(None),
                read = frames.next() => read,
            },
            buffered => buffered.map_err(ReadError::from),
        };
        read.map_err(Closed::Read)
    }
}

/// Resolves once `retired` turns true or its registry is gone; never
/// without one.
async fn until_retired(retired: Option<&mut watch::Receiver<bool>>) {
    match retired {
        Some(retired) => {
            let _ = retired.wait_for(|retired| *retired).await;
        }
        None => std::future::pending().await,
    }
}
