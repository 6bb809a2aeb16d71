//! A peer's replica, reached over the network: the [`Replica`] the engine
//! and the fencer use for every copy but their own.
//!
//! Block data (writes, discards, reads, flushes) goes over the block
//! channel ([`crate::net::link`], served by [`crate::replica::serve::blocks`]), on
//! [`LINKS`] connections per replica used in turn; everything else (fence,
//! digests, marks, maps, status) over the replica gRPC service. Both reach
//! the peer's data listener and the same store checks.
//!
//! Every call carries a deadline. A call that times out, or fails in
//! transport, is an error for that request (`Unavailable`): the engine then
//! drops the replica through a committed in-sync change before it
//! acknowledges anything that skipped it (S5), and disowns the request by
//! raising the replica's generation (see [`crate::replica::Stamp`]), since the peer
//! may still apply it. A timeout is never taken for a success.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tonic::transport::Channel;

use crate::ids::{GroupId, Incarnation, NodeId, Term};
use crate::net::frame::{FUA, Frame, Header, Kind};
use crate::net::link::{Link, LinkError};
use crate::net::{Expect, Transport, TransportError};
use crate::proto::replica as pb;
use crate::proto::replica::replica_client::ReplicaClient;
use crate::replica::disk::missed::{MissedMap, Unverified};
use crate::replica::peer::channels::Channels;
use crate::replica::wire::{Stamped, from_refusal, from_status};
use crate::replica::{DirtyExtent, FenceReply, Replica, ReplicaError, ReplicaInfo, Stamp};
use std::collections::BTreeMap;

/// How many block-channel connections a remote replica keeps.
pub const LINKS: usize = 2;

/// A replica on another node.
pub struct RemoteReplica {
    id: NodeId,
    channels: Arc<Channels>,
    volume: pb::VolumeRef,
    timeout: Duration,
    /// The block channel's connections, opened when first used and again
    /// after one fails.
    links: [tokio::sync::Mutex<Option<Arc<Link>>>; LINKS],
    next_link: AtomicUsize,
    /// The store session the block channel found, and whether it changed
    /// since the writer began to count on this copy (see
    /// [`RemoteReplica::note_session`]).
    session: std::sync::Mutex<Session>,
}

/// What a [`RemoteReplica`] knows of its store's sessions.
#[derive(Debug, Default)]
struct Session {
    /// The session last seen; `None` before the first link (or from a
    /// server that names none).
    seen: Option<u64>,
    /// The session changed, and no rebuild has accepted it yet.
    restarted: Option<(u64, u64)>,
}

impl RemoteReplica {
    /// Node `id`'s replica of `cluster_id`'s `volume` of Raft group
    /// `group` (every request names all three: a volume's name may be
    /// reused by a volume of another group), reached through the pool
    /// `channels` (which must know the peer), whose calls time out after
    /// `timeout`.
    pub fn through(
        id: NodeId,
        channels: Arc<Channels>,
        cluster_id: &str,
        volume: &str,
        group: GroupId,
        timeout: Duration,
    ) -> Self {
        Self {
            id,
            channels,
            volume: pb::VolumeRef {
                cluster_id: cluster_id.to_string(),
                volume: volume.to_string(),
                incarnation: 0,
                group: group.0,
            },
            timeout,
            links: Default::default(),
            next_link: AtomicUsize::new(0),
            session: Default::default(),
        }
    }

    /// A replica of node `id` whose replica service is at `addr`
    /// (`HOST:PORT`), reached through `transport` on a pool of its own:
    /// for a replica served alone, with nothing to ask its address of.
    pub fn new(
        id: NodeId,
        transport: &Transport,
        addr: &str,
        cluster_id: &str,
        volume: &str,
        group: GroupId,
        timeout: Duration,
    ) -> Result<Self, TransportError> {
        // Fails now, not at the first call, on an address that is no
        // address.
        transport.channel(addr, Expect::Node(id))?;
        let channels = Channels::new(transport.clone(), cluster_id, NodeId(0), timeout);
        channels.add(id, addr, Some(addr.to_string()));
        Ok(Self::through(
            id,
            Arc::new(channels),
            cluster_id,
            volume,
            group,
            timeout,
        ))
    }

    /// A client on the pool's channel to this replica.
    async fn client(&self) -> Result<ReplicaClient<Channel>, ReplicaError> {
        let channel = self.channels.data(self.id).await?;
        Ok(self.channels.transport().limit(ReplicaClient::new(channel)))
    }

    /// The error of a failed call. One that failed in transport drops the
    /// pool's channel, so the next call asks the peer where it listens.
    fn failed(&self, status: &tonic::Status, stamp: impl Into<Stamp>) -> ReplicaError {
        if status.code() == tonic::Code::Unavailable {
            self.channels.forget(self.id);
        }
        from_status(status, stamp)
    }

    /// One of the block channel's links, opened if it is not open.
    async fn link(&self) -> Result<Arc<Link>, ReplicaError> {
        let slot = &self.links[self.next_link.fetch_add(1, Ordering::Relaxed) % LINKS];
        let mut slot = slot.lock().await;
        if let Some(link) = slot.as_ref().filter(|link| !link.is_closed()) {
            return Ok(Arc::clone(link));
        }
        let addr = self.channels.data_address(self.id).await?;
        let link = self
            .channels
            .transport()
            .link(
                &addr,
                Expect::Node(self.id),
                &self.volume.cluster_id,
                &self.volume.volume,
                GroupId(self.volume.group),
                self.timeout,
            )
            .await
            .map_err(|err| match err {
                // The peer answered: not a transport failure.
                LinkError::Refused(refusal) => from_refusal(&refusal, Term::ZERO),
                err => self.lost(&err),
            })?;
        self.note_session(link.session());
        let link = Arc::new(link);
        *slot = Some(Arc::clone(&link));
        Ok(link)
    }

    /// Notes the session a new link found. A session other than the one
    /// seen before means the replica's store was opened again: its process
    /// restarted, perhaps its machine, and with it the page cache that held
    /// writes it had acknowledged but not flushed. From then on every block
    /// request fails as [`ReplicaError::Restarted`], so the engine drops the
    /// copy and a rebuild compares it (its S6 marks name every extent it
    /// may have lost) before it counts again.
    fn note_session(&self, now: Option<u64>) {
        let Some(now) = now else { return };
        let mut session = crate::replica::lock(&self.session);
        if let Some(before) = session.seen.filter(|before| *before != now) {
            tracing::warn!(replica = %self.id, before = format_args!("{before:016x}"), now = format_args!("{now:016x}"), "replica restarted: not counted on until it is rebuilt");
            session.restarted = Some((before, now));
        }
        session.seen = Some(now);
    }

    /// Notes the session a gRPC reply named (0: a server too old to name
    /// one) and refuses the reply if the copy restarted since it was
    /// counted on, as a block call would be.
    fn answered_in(&self, session: u64) -> Result<(), ReplicaError> {
        self.note_session(Some(session).filter(|session| *session != 0));
        self.restarted().map_or(Ok(()), Err)
    }

    /// The error every block request gets while a restart is not accepted.
    fn restarted(&self) -> Option<ReplicaError> {
        let (before, now) = crate::replica::lock(&self.session).restarted?;
        Some(ReplicaError::Restarted(format!(
            "node {}'s replica was opened again (session {before:016x}, now {now:016x}); \
             writes it had not flushed may be lost, so it is not counted on until it is rebuilt",
            self.id
        )))
    }

    /// The error of a block-channel call that got no reply; the next call
    /// asks the peer where it listens again, as it may have restarted.
    fn lost(&self, err: &LinkError) -> ReplicaError {
        self.channels.forget(self.id);
        ReplicaError::Unavailable(err.to_string())
    }

    /// Sends a block request of `kind` over the channel; its reply, or the
    /// error it stands for.
    async fn call(
        &self,
        kind: Kind,
        stamp: Stamp,
        fill: impl FnOnce(&mut Header),
        payload: Bytes,
    ) -> Result<Frame, ReplicaError> {
        let mut header = Header::new(kind, 0);
        header.stamp = stamp;
        header.incarnation = self.channels.incarnation(self.id).0;
        fill(&mut header);
        let link = self.link().await?;
        if let Some(err) = self.restarted() {
            return Err(err);
        }
        match link.call(header, payload, self.timeout).await {
            Ok(reply) if reply.header.kind == Kind::Ok => Ok(reply),
            Ok(refusal) => Err(from_refusal(&refusal, stamp)),
            Err(err @ LinkError::TimedOut(_)) => Err(ReplicaError::Unavailable(err.to_string())),
            Err(err) => Err(self.lost(&err)),
        }
    }

    /// A block request of `kind` about `len` bytes at `offset`, with no
    /// payload (a discard or a mark ahead).
    async fn call_on_range(
        &self,
        kind: Kind,
        stamp: Stamp,
        offset: u64,
        len: u64,
    ) -> Result<(), ReplicaError> {
        let fill = |h: &mut Header| {
            h.offset = offset;
            h.length = len;
        };
        self.call(kind, stamp, fill, Bytes::new()).await.map(|_| ())
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout);
        request
    }

    /// The volume (cluster, name, group), and the incarnation of this
    /// replica's node that the membership names (S8).
    fn volume(&self) -> Option<pb::VolumeRef> {
        Some(pb::VolumeRef {
            incarnation: self.channels.incarnation(self.id).0,
            ..self.volume.clone()
        })
    }
}

#[async_trait]
impl Replica for RemoteReplica {
    fn id(&self) -> NodeId {
        self.id
    }

    fn count_on_session(&self, session: u64) {
        let mut now = crate::replica::lock(&self.session);
        now.seen = Some(session).filter(|session| *session != 0);
        now.restarted = None;
    }

    async fn reach(&self) -> Result<(), ReplicaError> {
        self.link().await.map(|_| ())
    }

    fn accept_restart(&self) {
        if crate::replica::lock(&self.session)
            .restarted
            .take()
            .is_some()
        {
            tracing::info!(replica = %self.id, "a rebuild counts on the restarted replica's new session");
        }
    }

    async fn allocation(
        &self,
        offset: u64,
        len: u64,
    ) -> Result<Vec<crate::volume::Extent>, ReplicaError> {
        let request = self.request(pb::AllocationRequest {
            volume: self.volume(),
            offset,
            length: len,
        });
        let reply = self
            .client()
            .await?
            .allocation(request)
            .await
            .map_err(|status| self.failed(&status, Term::ZERO))?
            .into_inner();
        // Reads and rebuilds skip what this says is a hole: a restarted
        // copy's hole may be a write it lost (S5, S10).
        self.answered_in(reply.session)?;
        // The answer comes from the network: runs that do not add up to
        // the span asked for are no answer.
        let total = reply
            .lengths
            .iter()
            .try_fold(0u64, |sum, run| sum.checked_add(*run));
        if reply.lengths.len() != reply.holes.len() || total != Some(len) {
            return Err(ReplicaError::Unavailable(format!(
                "allocation of {len} bytes answered with runs of {total:?} bytes"
            )));
        }
        Ok(reply
            .lengths
            .into_iter()
            .zip(reply.holes)
            .map(|(len, hole)| crate::volume::Extent { len, hole })
            .collect())
    }

    async fn write(
        &self,
        stamp: Stamp,
        offset: u64,
        data: Bytes,
        fua: bool,
    ) -> Result<(), ReplicaError> {
        let fill = |h: &mut Header| {
            h.offset = offset;
            h.flags = if fua { FUA } else { 0 };
        };
        self.call(Kind::Write, stamp, fill, data).await.map(|_| ())
    }

    async fn discard(&self, stamp: Stamp, offset: u64, len: u64) -> Result<(), ReplicaError> {
        self.call_on_range(Kind::Discard, stamp, offset, len).await
    }

    async fn mark_ahead(&self, stamp: Stamp, offset: u64, len: u64) -> Result<(), ReplicaError> {
        self.call_on_range(Kind::Mark, stamp, offset, len).await
    }

    async fn read(&self, offset: u64, len: u64) -> Result<Bytes, ReplicaError> {
        let fill = |h: &mut Header| {
            h.offset = offset;
            h.length = len;
        };
        let reply = self
            .call(Kind::Read, Stamp::term(Term::ZERO), fill, Bytes::new())
            .await?;
        if reply.payload.len() as u64 != len {
            return Err(ReplicaError::Unavailable(format!(
                "read of {len} bytes returned {}",
                reply.payload.len()
            )));
        }
        Ok(reply.payload)
    }

    async fn flush(&self, stamp: Stamp) -> Result<(), ReplicaError> {
        self.call(Kind::Flush, stamp, |_| {}, Bytes::new())
            .await
            .map(|_| ())
    }

    async fn grow(&self, stamp: Stamp, size: u64) -> Result<u64, ReplicaError> {
        let request = self.request(
            pb::GrowRequest {
                volume: self.volume(),
                size,
                ..Default::default()
            }
            .stamped(stamp),
        );
        self.client()
            .await?
            .grow(request)
            .await
            .map(|reply| reply.into_inner().size)
            .map_err(|status| self.failed(&status, stamp))
    }

    async fn fence(&self, term: Term) -> Result<FenceReply, ReplicaError> {
        let request = self.request(pb::FenceRequest {
            volume: self.volume(),
            term: term.0,
        });
        let reply = self
            .client()
            .await?
            .fence(request)
            .await
            .map_err(|status| self.failed(&status, term))?
            .into_inner();
        Ok(FenceReply {
            floor: Term(reply.floor),
            generation: reply.generation,
            dirty: reply
                .dirty
                .into_iter()
                .map(|d| DirtyExtent {
                    term: Term(d.term),
                    extent: d.extent,
                })
                .collect(),
            extent_size: reply.extent_size,
            session: reply.session,
        })
    }

    async fn clear_dirty_below(&self, term: Term) -> Result<(), ReplicaError> {
        let request = self.request(pb::ClearDirtyRequest {
            volume: self.volume(),
            term: term.0,
        });
        self.client()
            .await?
            .clear_dirty(request)
            .await
            .map(|_| ())
            .map_err(|status| self.failed(&status, term))
    }

    async fn retire_marks(
        &self,
        stamp: Stamp,
        through: Term,
        extents: &[u64],
    ) -> Result<usize, ReplicaError> {
        let request = self.request(
            pb::RetireMarksRequest {
                volume: self.volume(),
                through: through.0,
                extents: extents.to_vec(),
                ..Default::default()
            }
            .stamped(stamp),
        );
        let reply = self
            .client()
            .await?
            .retire_marks(request)
            .await
            .map_err(|status| self.failed(&status, stamp))?
            .into_inner();
        Ok(usize::try_from(reply.retired).unwrap_or(usize::MAX))
    }

    async fn info(&self) -> Result<ReplicaInfo, ReplicaError> {
        let request = self.request(pb::StatusRequest {
            volume: self.volume(),
        });
        let reply = self
            .client()
            .await?
            .status(request)
            .await
            .map_err(|status| self.failed(&status, Term::ZERO))?
            .into_inner();
        Ok(ReplicaInfo {
            floor: Term(reply.floor),
            generation: reply.generation,
            dirty_extents: reply.dirty_extents,
            stale_accepts: reply.stale_accepts,
            first_touch_marks: reply.first_touch_marks,
        })
    }

    async fn digests(&self, offset: u64, len: u64) -> Result<(u64, Vec<Bytes>), ReplicaError> {
        let request = self.request(pb::DigestRequest {
            volume: self.volume(),
            offset,
            length: len,
        });
        let reply = self
            .client()
            .await?
            .digest(request)
            .await
            .map_err(|status| self.failed(&status, Term::ZERO))?
            .into_inner();
        // Digests decide what a scrub or a convergence keeps: those of a
        // copy that restarted since it was counted on are no vote (S5).
        self.answered_in(reply.session)?;
        Ok((reply.first_extent, reply.digests))
    }

    async fn note_missed(
        &self,
        stamp: Stamp,
        node: NodeId,
        incarnation: Incarnation,
        extents: &[u64],
    ) -> Result<(), ReplicaError> {
        let request = self.request(
            pb::NoteMissedRequest {
                volume: self.volume(),
                node: node.0,
                incarnation: incarnation.0,
                extents: extents.to_vec(),
                ..Default::default()
            }
            .stamped(stamp),
        );
        self.client()
            .await?
            .note_missed(request)
            .await
            .map(|_| ())
            .map_err(|status| self.failed(&status, stamp))
    }

    async fn missed(&self, node: NodeId, from: u64) -> Result<Option<MissedMap>, ReplicaError> {
        let request = self.request(pb::MissedRequest {
            volume: self.volume(),
            node: node.0,
            from,
        });
        let reply = self
            .client()
            .await?
            .missed(request)
            .await
            .map_err(|status| self.failed(&status, Term::ZERO))?
            .into_inner();
        Ok(reply.open.then_some(MissedMap {
            incarnation: Incarnation(reply.incarnation),
            extents: reply.extents,
            more: reply.more,
            unverified_from: reply.has_unverified.then_some(reply.unverified_from),
        }))
    }

    async fn missed_maps(&self) -> Result<BTreeMap<NodeId, Incarnation>, ReplicaError> {
        let request = self.request(pb::MissedMapsRequest {
            volume: self.volume(),
        });
        let reply = self
            .client()
            .await?
            .missed_maps(request)
            .await
            .map_err(|status| self.failed(&status, Term::ZERO))?
            .into_inner();
        Ok(reply
            .maps
            .into_iter()
            .map(|map| (NodeId(map.node), Incarnation(map.incarnation)))
            .collect())
    }

    async fn close_missed(&self, stamp: Stamp, node: NodeId) -> Result<(), ReplicaError> {
        let request = self.request(
            pb::CloseMissedRequest {
                volume: self.volume(),
                node: node.0,
                ..Default::default()
            }
            .stamped(stamp),
        );
        self.client()
            .await?
            .close_missed(request)
            .await
            .map(|_| ())
            .map_err(|status| self.failed(&status, stamp))
    }

    async fn set_unverified(
        &self,
        stamp: Stamp,
        node: NodeId,
        incarnation: Incarnation,
        change: Unverified,
    ) -> Result<(), ReplicaError> {
        let (raise, extent) = match change {
            Unverified::Lower(extent) => (false, extent),
            Unverified::Raise(extent) => (true, extent),
        };
        let request = self.request(
            pb::SetUnverifiedRequest {
                volume: self.volume(),
                node: node.0,
                incarnation: incarnation.0,
                raise,
                extent,
                ..Default::default()
            }
            .stamped(stamp),
        );
        self.client()
            .await?
            .set_unverified(request)
            .await
            .map(|_| ())
            .map_err(|status| self.failed(&status, stamp))
    }
}
