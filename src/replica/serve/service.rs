//! The replica gRPC service: the stores a node serves, offered to their
//! volumes' writers for the control calls (fence, grow, marks, digests,
//! missed-write maps, status). Block I/O (write, discard, read, flush) is
//! not here: it has one server, the block channel
//! ([`crate::replica::serve::blocks`]), on the same listener.
//!
//! Every request names the cluster, the incarnation and the volume, as its
//! name and Raft group (`VolumeRef`), and is checked in that order before
//! any store is touched ([`ReplicaService::admit`]):
//! - no volume named: `INVALID_ARGUMENT`;
//! - another cluster: `PERMISSION_DENIED` (S9);
//! - another incarnation of this node's data dir (S8): a replica whose
//!   disk was replaced is a new, empty copy, and refuses
//!   (`FAILED_PRECONDITION`, "replaced disk") every request meant for the
//!   copy it replaced, so it never counts as that copy toward S5;
//! - a volume this node holds no copy of: `NOT_FOUND`, naming it;
//! - a copy of that name of another Raft group: `NOT_FOUND`, naming both
//!   groups. A volume is (cluster, name, group): a name is reused once its
//!   volume is deleted, the new volume's group's terms start low, and terms
//!   of different groups are not comparable, so the old volume's writer
//!   must not pass the new copy's fence floor (S2). A `VolumeRef` of an
//!   earlier build names no group: group 0, the configured volume's.
//!
//! Only then is the named volume's store picked from the node's
//! [`Stores`], and the request served by that store alone: the store
//! enforces the fencing token exactly as in-process (S2, S3), so the wire
//! adds no path around it, and a fence that raised a floor notifies that
//! volume's controller only. Its errors go to the wire through
//! [`crate::replica::wire`].

use std::sync::Arc;

use tonic::{Request, Response, Status};

use tokio::sync::watch;

use crate::ids::{GroupId, Incarnation, NodeId, Term};
use crate::net::conn::route;
use crate::net::frame::PREFACE;
use crate::net::{Audience, Transport};
use crate::proto::replica as pb;
use crate::proto::replica::replica_server::{Replica as ReplicaRpc, ReplicaServer};
use crate::replica::DirtyExtent;
use crate::replica::disk::missed::Unverified;
use crate::replica::disk::store::ReplicaStore;
use crate::replica::serve::blocks::BlockServer;
pub use crate::replica::serve::stores::OnFenced;
use crate::replica::serve::stores::{Served, Stores};
use crate::replica::wire::{Stamped, replaced_disk, to_status};

/// Serves the stores of a node's [`Stores`], each to its own volume's
/// requests.
pub struct ReplicaService {
    stores: Stores,
    /// This node's data dir's incarnation.
    incarnation: Incarnation,
    /// The node this service runs on, for the handlers' spans.
    node: String,
}

impl ReplicaService {
    /// A service over `store` alone, with no fence callback.
    pub fn new(store: Arc<ReplicaStore>) -> Self {
        Self::serving(Stores::one(store, None))
    }

    /// A service over every store of `stores`, as it is when each request
    /// arrives (volumes may come and go while it serves).
    pub fn serving(stores: Stores) -> Self {
        Self {
            stores,
            incarnation: Incarnation(0),
            node: String::new(),
        }
    }

    /// Serves the replica of incarnation `incarnation` of this node's data
    /// dir: requests meant for another are refused.
    pub fn of_incarnation(mut self, incarnation: Incarnation) -> Self {
        self.incarnation = incarnation;
        self
    }

    /// Names the node this service runs on in the handlers' spans.
    pub fn on_node(mut self, node: impl Into<String>) -> Self {
        self.node = node.into();
        self
    }

    /// The stores it serves (shared: a volume added to them is served).
    pub fn stores(&self) -> &Stores {
        &self.stores
    }

    /// The tonic server (the transport sets its limits).
    pub fn into_server(self) -> ReplicaServer<Self> {
        ReplicaServer::new(self)
    }

    /// The block channel's server of the same stores, admitting frames
    /// through `transport`'s members' guard.
    pub fn block_server(&self, transport: &Transport) -> BlockServer {
        BlockServer::new(
            self.stores.clone(),
            self.incarnation,
            transport.guard(Audience::Members),
            &self.node,
        )
    }

    /// Serves these stores on `listener` through `transport` until `stop`
    /// turns true: the gRPC service and the block channel on the same
    /// port, told apart by each connection's first bytes.
    pub async fn serve(
        self,
        transport: &Transport,
        listener: tokio::net::TcpListener,
        stop: watch::Receiver<bool>,
    ) -> Result<(), tonic::transport::Error> {
        let (grpc, blocks) = route(transport.incoming(listener), PREFACE);
        let block_server = tokio::spawn(self.block_server(transport).serve(blocks, stop.clone()));
        let mut stopped = stop;
        let served = transport
            .server()
            .add_service(transport.serve(Audience::Members, self.into_server()))
            .serve_with_incoming_shutdown(grpc, async move {
                let _ = stopped.wait_for(|stop| *stop).await;
            })
            .await;
        // The block server stops on the same signal, within its grace; if
        // the gRPC server failed instead, it is stopped with it.
        if served.is_err() {
            block_server.abort();
        }
        let _ = block_server.await;
        served
    }

    /// Checks the volume a request names, in the module docs' order,
    /// before any store is touched; the store it names.
    fn admit(&self, volume: Option<&pb::VolumeRef>) -> Result<Served, Status> {
        let Some(v) = volume else {
            return Err(Status::invalid_argument("request names no volume"));
        };
        if v.cluster_id != self.stores.cluster_id() {
            return Err(Status::permission_denied(format!(
                "request for cluster {:?} volume {:?}; this node serves cluster {:?}",
                v.cluster_id,
                v.volume,
                self.stores.cluster_id()
            )));
        }
        if v.incarnation != self.incarnation.0 {
            return Err(Status::failed_precondition(replaced_disk(
                self.incarnation,
                Incarnation(v.incarnation),
            )));
        }
        self.stores
            .find(&v.volume, GroupId(v.group))
            .map_err(|refused| Status::not_found(format!("{refused} (cluster {:?})", v.cluster_id)))
    }
}

/// The volume a request names, for its span.
fn volume_of(volume: &Option<pb::VolumeRef>) -> &str {
    volume.as_ref().map_or("", |v| v.volume.as_str())
}

fn to_pb(mark: &DirtyExtent) -> pb::DirtyExtent {
    pb::DirtyExtent {
        term: mark.term.0,
        extent: mark.extent,
    }
}

#[tonic::async_trait]
impl ReplicaRpc for ReplicaService {
    #[tracing::instrument(name = "replica.grow", skip_all, fields(node = %self.node, volume = volume_of(&request.get_ref().volume), term = request.get_ref().term, size = request.get_ref().size))]
    async fn grow(
        &self,
        request: Request<pb::GrowRequest>,
    ) -> Result<Response<pb::GrowReply>, Status> {
        let r = request.into_inner();
        let served = self.admit(r.volume.as_ref())?;
        let size = served
            .store()
            .grow(r.stamp(), r.size)
            .await
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(pb::GrowReply { size }))
    }

    #[tracing::instrument(level = "debug", name = "replica.fence", skip_all, fields(node = %self.node, volume = volume_of(&request.get_ref().volume), term = request.get_ref().term))]
    async fn fence(
        &self,
        request: Request<pb::FenceRequest>,
    ) -> Result<Response<pb::FenceReply>, Status> {
        let r = request.into_inner();
        let served = self.admit(r.volume.as_ref())?;
        let reply = served
            .store()
            .fence(Term(r.term))
            .await
            .map_err(|e| to_status(&e))?;
        served.fenced(reply.floor);
        Ok(Response::new(pb::FenceReply {
            floor: reply.floor.0,
            dirty: reply.dirty.iter().map(to_pb).collect(),
            extent_size: reply.extent_size,
            generation: reply.generation,
            session: reply.session,
        }))
    }

    #[tracing::instrument(level = "debug", name = "replica.clear_dirty", skip_all, fields(node = %self.node, volume = volume_of(&request.get_ref().volume), term = request.get_ref().term))]
    async fn clear_dirty(
        &self,
        request: Request<pb::ClearDirtyRequest>,
    ) -> Result<Response<pb::ClearDirtyReply>, Status> {
        let r = request.into_inner();
        let served = self.admit(r.volume.as_ref())?;
        served
            .store()
            .clear_dirty_below(Term(r.term))
            .await
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(pb::ClearDirtyReply {}))
    }

    #[tracing::instrument(level = "debug", name = "replica.retire_marks", skip_all, fields(node = %self.node, volume = volume_of(&request.get_ref().volume), term = request.get_ref().term))]
    async fn retire_marks(
        &self,
        request: Request<pb::RetireMarksRequest>,
    ) -> Result<Response<pb::RetireMarksReply>, Status> {
        let r = request.into_inner();
        let served = self.admit(r.volume.as_ref())?;
        let retired = served
            .store()
            .retire_marks(r.stamp(), Term(r.through), &r.extents)
            .await
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(pb::RetireMarksReply {
            retired: retired as u64,
        }))
    }

    #[tracing::instrument(level = "debug", name = "replica.digest", skip_all, fields(node = %self.node, volume = volume_of(&request.get_ref().volume)))]
    async fn digest(
        &self,
        request: Request<pb::DigestRequest>,
    ) -> Result<Response<pb::DigestReply>, Status> {
        let r = request.into_inner();
        let served = self.admit(r.volume.as_ref())?;
        let (first_extent, digests) = served
            .store()
            .digests(r.offset, r.length)
            .await
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(pb::DigestReply {
            extent_size: served.store().identity().extent_size,
            first_extent,
            digests: digests.iter().map(|d| d.to_vec().into()).collect(),
            session: served.store().session(),
        }))
    }

    #[tracing::instrument(level = "debug", name = "replica.status", skip_all, fields(node = %self.node, volume = volume_of(&request.get_ref().volume)))]
    async fn status(
        &self,
        request: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::StatusReply>, Status> {
        let served = self.admit(request.into_inner().volume.as_ref())?;
        let info = served.store().info().await.map_err(|e| to_status(&e))?;
        Ok(Response::new(pb::StatusReply {
            floor: info.floor.0,
            size: served.store().size(),
            extent_size: served.store().identity().extent_size,
            dirty_extents: info.dirty_extents,
            stale_accepts: info.stale_accepts,
            generation: info.generation,
            first_touch_marks: info.first_touch_marks,
        }))
    }

    #[tracing::instrument(level = "debug", name = "replica.note_missed", skip_all, fields(node = %self.node, volume = volume_of(&request.get_ref().volume), term = request.get_ref().term, of = request.get_ref().node))]
    async fn note_missed(
        &self,
        request: Request<pb::NoteMissedRequest>,
    ) -> Result<Response<pb::NoteMissedReply>, Status> {
        let r = request.into_inner();
        let served = self.admit(r.volume.as_ref())?;
        served
            .store()
            .note_missed(
                r.stamp(),
                NodeId(r.node),
                Incarnation(r.incarnation),
                &r.extents,
            )
            .await
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(pb::NoteMissedReply {}))
    }

    #[tracing::instrument(level = "debug", name = "replica.missed", skip_all, fields(node = %self.node, volume = volume_of(&request.get_ref().volume), of = request.get_ref().node))]
    async fn missed(
        &self,
        request: Request<pb::MissedRequest>,
    ) -> Result<Response<pb::MissedReply>, Status> {
        let r = request.into_inner();
        let served = self.admit(r.volume.as_ref())?;
        let map = served
            .store()
            .missed(NodeId(r.node), r.from)
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(match map {
            Some(map) => pb::MissedReply {
                open: true,
                incarnation: map.incarnation.0,
                extents: map.extents,
                more: map.more,
                has_unverified: map.unverified_from.is_some(),
                unverified_from: map.unverified_from.unwrap_or(0),
            },
            None => pb::MissedReply::default(),
        }))
    }

    #[tracing::instrument(level = "debug", name = "replica.missed_maps", skip_all, fields(node = %self.node, volume = volume_of(&request.get_ref().volume)))]
    async fn missed_maps(
        &self,
        request: Request<pb::MissedMapsRequest>,
    ) -> Result<Response<pb::MissedMapsReply>, Status> {
        let served = self.admit(request.into_inner().volume.as_ref())?;
        let maps = served
            .store()
            .missed_open()
            .into_iter()
            .map(|(node, incarnation)| pb::OpenMap {
                node: node.0,
                incarnation: incarnation.0,
            })
            .collect();
        Ok(Response::new(pb::MissedMapsReply { maps }))
    }

    #[tracing::instrument(level = "debug", name = "replica.allocation", skip_all, fields(node = %self.node, volume = volume_of(&request.get_ref().volume)))]
    async fn allocation(
        &self,
        request: Request<pb::AllocationRequest>,
    ) -> Result<Response<pb::AllocationReply>, Status> {
        let r = request.into_inner();
        let served = self.admit(r.volume.as_ref())?;
        let runs = served
            .store()
            .allocation(r.offset, r.length)
            .await
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(pb::AllocationReply {
            lengths: runs.iter().map(|run| run.len).collect(),
            holes: runs.iter().map(|run| run.hole).collect(),
            session: served.store().session(),
        }))
    }

    #[tracing::instrument(level = "debug", name = "replica.set_unverified", skip_all, fields(node = %self.node, volume = volume_of(&request.get_ref().volume), term = request.get_ref().term, of = request.get_ref().node))]
    async fn set_unverified(
        &self,
        request: Request<pb::SetUnverifiedRequest>,
    ) -> Result<Response<pb::SetUnverifiedReply>, Status> {
        let r = request.into_inner();
        let served = self.admit(r.volume.as_ref())?;
        let change = if r.raise {
            Unverified::Raise(r.extent)
        } else {
            Unverified::Lower(r.extent)
        };
        served
            .store()
            .set_unverified(
                r.stamp(),
                NodeId(r.node),
                Incarnation(r.incarnation),
                change,
            )
            .await
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(pb::SetUnverifiedReply {}))
    }

    #[tracing::instrument(level = "debug", name = "replica.close_missed", skip_all, fields(node = %self.node, volume = volume_of(&request.get_ref().volume), term = request.get_ref().term, of = request.get_ref().node))]
    async fn close_missed(
        &self,
        request: Request<pb::CloseMissedRequest>,
    ) -> Result<Response<pb::CloseMissedReply>, Status> {
        let r = request.into_inner();
        let served = self.admit(r.volume.as_ref())?;
        served
            .store()
            .close_missed(r.stamp(), NodeId(r.node))
            .await
            .map_err(|e| to_status(&e))?;
        Ok(Response::new(pb::CloseMissedReply {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replica::ReplicaError;
    use crate::replica::wire::from_status;

    /// S8: a request meant for another incarnation of this node's replica
    /// (the writer still expects the copy the disk held before it was
    /// replaced) is refused and changes nothing: neither the floor nor the
    /// size. (Block requests are the block channel's; see its tests.)
    #[tokio::test]
    async fn a_request_for_another_incarnation_is_refused_and_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let identity = crate::replica::disk::store::StoreIdentity::new("c1", "vol0", 1 << 20);
        let store = Arc::new(ReplicaStore::open(dir.path(), identity).await.unwrap());
        let service = ReplicaService::new(Arc::clone(&store)).of_incarnation(Incarnation(7));
        let volume = |incarnation| {
            Some(pb::VolumeRef {
                cluster_id: "c1".into(),
                volume: "vol0".into(),
                incarnation,
                group: 0,
            })
        };
        let grow = |incarnation| {
            Request::new(pb::GrowRequest {
                volume: volume(incarnation),
                term: 4,
                generation: 0,
                size: 2 << 20,
            })
        };
        let fence = |incarnation| {
            Request::new(pb::FenceRequest {
                volume: volume(incarnation),
                term: 5,
            })
        };
        for former in [0, 6] {
            let refused = service.grow(grow(former)).await.unwrap_err();
            assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
            assert!(
                refused.message().starts_with("replaced disk"),
                "{refused:?}"
            );
            let refused = service.fence(fence(former)).await.unwrap_err();
            assert!(
                refused.message().starts_with("replaced disk"),
                "{refused:?}"
            );
        }
        assert_eq!(store.floor().await, Term(0));
        assert_eq!(store.size(), 1 << 20);
        // The incarnation it is: served.
        service.grow(grow(7)).await.unwrap();
        assert_eq!(store.floor().await, Term(4));
        assert_eq!(store.size(), 2 << 20);
    }

    /// The checks that need no store come first, in the order of the
    /// module docs: a request of another cluster, or for another
    /// incarnation, is refused as such even when it names a volume this
    /// node does not hold or another group; only a request that passes
    /// both is looked up, and a volume not held, or held of another group,
    /// is `NOT_FOUND`. None touches a store.
    #[tokio::test]
    async fn the_cluster_and_the_incarnation_are_checked_before_the_volume_is_looked_up() {
        let dir = tempfile::tempdir().unwrap();
        let open = |volume: &'static str| {
            let identity = crate::replica::disk::store::StoreIdentity::new("c1", volume, 1 << 20);
            ReplicaStore::open(dir.path().join(volume), identity)
        };
        let (a, b) = (
            Arc::new(open("a").await.unwrap()),
            Arc::new(open("b").await.unwrap()),
        );
        let stores = Stores::new("c1");
        stores.insert(Arc::clone(&a), None).unwrap();
        stores.insert(Arc::clone(&b), None).unwrap();
        let service = ReplicaService::serving(stores).of_incarnation(Incarnation(7));
        let fence_of = |cluster: &str, volume: &str, incarnation, group| {
            Request::new(pb::FenceRequest {
                volume: Some(pb::VolumeRef {
                    cluster_id: cluster.into(),
                    volume: volume.into(),
                    incarnation,
                    group,
                }),
                term: 5,
            })
        };
        let fence =
            |cluster: &str, volume: &str, incarnation| fence_of(cluster, volume, incarnation, 0);
        let refusals = [
            (
                fence("c2", "a", 7),
                tonic::Code::PermissionDenied,
                "cluster",
            ),
            (
                fence("c2", "z", 7),
                tonic::Code::PermissionDenied,
                "cluster",
            ),
            (
                fence("c1", "a", 6),
                tonic::Code::FailedPrecondition,
                "replaced disk",
            ),
            (
                fence("c1", "z", 6),
                tonic::Code::FailedPrecondition,
                "replaced disk",
            ),
            (
                fence_of("c2", "a", 7, 1),
                tonic::Code::PermissionDenied,
                "cluster",
            ),
            (
                fence_of("c1", "a", 6, 1),
                tonic::Code::FailedPrecondition,
                "replaced disk",
            ),
            (fence("c1", "z", 7), tonic::Code::NotFound, "volume \"z\""),
            (
                fence_of("c1", "a", 7, 1),
                tonic::Code::NotFound,
                "is of group 0, not group 1",
            ),
        ];
        for (request, code, text) in refusals {
            let refused = service.fence(request).await.unwrap_err();
            assert_eq!(refused.code(), code, "{refused:?}");
            assert!(refused.message().contains(text), "{refused:?}");
        }
        let no_volume = Request::new(pb::FenceRequest {
            volume: None,
            term: 5,
        });
        let refused = service.fence(no_volume).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert_eq!(a.floor().await, Term(0));
        assert_eq!(b.floor().await, Term(0));
        // Past the checks: the volume named, and only it.
        service.fence(fence("c1", "b", 7)).await.unwrap();
        assert_eq!(a.floor().await, Term(0));
        assert_eq!(b.floor().await, Term(5));
    }

    #[test]
    fn a_bad_request_is_a_bad_request_on_both_sides() {
        let err = ReplicaError::InvalidRequest("no volume".into());
        assert!(matches!(
            from_status(&to_status(&err), Term(1)),
            ReplicaError::InvalidRequest(_)
        ));
    }
}
