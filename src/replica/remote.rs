//! A peer's replica, reached over gRPC: the [`Replica`] the engine and the
//! fencer use for every copy but their own.
//!
//! Every call carries a deadline. A call that times out, or fails in
//! transport, is an error for that request (`Unavailable`): the engine then
//! drops the replica through a committed in-sync change before it
//! acknowledges anything that skipped it (S5), and disowns the request by
//! raising the replica's generation (see [`super::Stamp`]), since the peer
//! may still apply it. A timeout is never taken for a success.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tonic::transport::Channel;

use super::channels::Channels;
use super::missed::MissedMap;
use super::service::error_of;
use super::{DirtyExtent, FenceReply, Replica, ReplicaError, ReplicaInfo, Stamp};
use crate::ids::{Incarnation, NodeId, Term};
use crate::net::{Expect, Transport, TransportError};
use crate::proto::replica as pb;
use crate::proto::replica::replica_client::ReplicaClient;
use crate::volume::MAX_REQUEST;
use std::collections::BTreeMap;

/// A replica on another node.
pub struct RemoteReplica {
    id: NodeId,
    channels: Arc<Channels>,
    volume: pb::VolumeRef,
    timeout: Duration,
}

impl RemoteReplica {
    /// Node `id`'s replica of `cluster_id`'s `volume`, reached through the
    /// pool `channels` (which must know the peer), whose calls time out
    /// after `timeout`.
    pub fn through(
        id: NodeId,
        channels: Arc<Channels>,
        cluster_id: &str,
        volume: &str,
        timeout: Duration,
    ) -> Self {
        Self {
            id,
            channels,
            volume: pb::VolumeRef {
                cluster_id: cluster_id.to_string(),
                volume: volume.to_string(),
                incarnation: 0,
            },
            timeout,
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
        error_of(status, stamp)
    }

    fn request<T>(&self, message: T) -> tonic::Request<T> {
        let mut request = tonic::Request::new(message);
        request.set_timeout(self.timeout);
        request
    }

    /// The volume, and the incarnation of this replica's node that the
    /// membership names (S8).
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

    async fn write(
        &self,
        stamp: Stamp,
        offset: u64,
        data: Bytes,
        fua: bool,
    ) -> Result<(), ReplicaError> {
        let request = self.request(pb::WriteRequest {
            volume: self.volume(),
            term: stamp.term.0,
            offset,
            data,
            fua,
            generation: stamp.generation,
        });
        self.client()
            .await?
            .write(request)
            .await
            .map(|_| ())
            .map_err(|status| self.failed(&status, stamp))
    }

    async fn discard(&self, stamp: Stamp, offset: u64, len: u64) -> Result<(), ReplicaError> {
        let request = self.request(pb::DiscardRequest {
            volume: self.volume(),
            term: stamp.term.0,
            offset,
            length: len,
            generation: stamp.generation,
        });
        self.client()
            .await?
            .discard(request)
            .await
            .map(|_| ())
            .map_err(|status| self.failed(&status, stamp))
    }

    async fn read(&self, offset: u64, len: u64) -> Result<Bytes, ReplicaError> {
        let length = u32::try_from(len.min(MAX_REQUEST + 1)).unwrap_or(u32::MAX);
        let request = self.request(pb::ReadRequest {
            volume: self.volume(),
            offset,
            length,
        });
        let reply = self
            .client()
            .await?
            .read(request)
            .await
            .map_err(|status| self.failed(&status, Term::ZERO))?
            .into_inner();
        if reply.data.len() as u64 != len {
            return Err(ReplicaError::Unavailable(format!(
                "read of {len} bytes returned {}",
                reply.data.len()
            )));
        }
        Ok(reply.data)
    }

    async fn flush(&self, stamp: Stamp) -> Result<(), ReplicaError> {
        let request = self.request(pb::FlushRequest {
            volume: self.volume(),
            term: stamp.term.0,
            generation: stamp.generation,
        });
        self.client()
            .await?
            .flush(request)
            .await
            .map(|_| ())
            .map_err(|status| self.failed(&status, stamp))
    }

    async fn grow(&self, stamp: Stamp, size: u64) -> Result<u64, ReplicaError> {
        let request = self.request(pb::GrowRequest {
            volume: self.volume(),
            term: stamp.term.0,
            generation: stamp.generation,
            size,
        });
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
        let request = self.request(pb::RetireMarksRequest {
            volume: self.volume(),
            term: stamp.term.0,
            generation: stamp.generation,
            through: through.0,
            extents: extents.to_vec(),
        });
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
        Ok((reply.first_extent, reply.digests))
    }

    async fn note_missed(
        &self,
        stamp: Stamp,
        node: NodeId,
        incarnation: Incarnation,
        extents: &[u64],
    ) -> Result<(), ReplicaError> {
        let request = self.request(pb::NoteMissedRequest {
            volume: self.volume(),
            term: stamp.term.0,
            generation: stamp.generation,
            node: node.0,
            incarnation: incarnation.0,
            extents: extents.to_vec(),
        });
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
        let request = self.request(pb::CloseMissedRequest {
            volume: self.volume(),
            term: stamp.term.0,
            generation: stamp.generation,
            node: node.0,
        });
        self.client()
            .await?
            .close_missed(request)
            .await
            .map(|_| ())
            .map_err(|status| self.failed(&status, stamp))
    }
}
