//! The channel pool: how this node reaches each peer's replica service.
//!
//! A node's replica service has a listener of its own (its *data*
//! listener), apart from the gRPC listener that carries Raft and the admin
//! API, so that block data and elections do not share a socket. The peer
//! list names only each node's gRPC address; a peer's data address is
//! asked of the peer itself (`Node.Hello` on its gRPC listener), unless the
//! configuration fixes it (`peer_data`, for proxies and NAT). A host of
//! `0.0.0.0` or `::` in the answer means the host the peer was reached at.
//!
//! [`Channels`] keeps one lazily connecting channel per peer and hands out
//! clones, and the data address it dials; every
//! [`crate::replica::peer::remote::RemoteReplica`] of the set dials through it (its gRPC
//! calls on the channel, its block channel's links to the address). A call that fails in transport makes the pool forget that peer's
//! channel ([`Channels::forget`]), so the next call asks again: a peer that
//! restarted listens on a new port when its data listener's port is chosen
//! by the OS.
//!
//! Both the question and the data channel go through the node's
//! [`Transport`], so they are mutual TLS, and each checks that the server
//! is the node asked for.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tonic::transport::Channel;

use crate::ids::NodeId;
use crate::net::{Expect, Transport};
use crate::proto::node::node_client::NodeClient;
use crate::proto::node::{HelloReply, HelloRequest};
use crate::replica::ReplicaError;

/// One channel slot per peer, with the data address it dials; a
/// resolution in progress holds its lock.
type Slot = Arc<tokio::sync::Mutex<Option<(Channel, String)>>>;

/// How to reach a peer.
#[derive(Debug, Clone)]
struct Peer {
    /// Its gRPC address, where its data address is asked for.
    control: String,
    /// Its data address, when the configuration fixes it.
    fixed: Option<String>,
    slot: Slot,
}

/// See the module docs.
pub struct Channels {
    transport: Transport,
    cluster_id: String,
    local: NodeId,
    /// How long asking a peer for its data address may take.
    timeout: Duration,
    peers: Mutex<BTreeMap<NodeId, Peer>>,
    /// Which incarnation of each peer to expect (S8); none: incarnation 0.
    book: Option<Arc<crate::members::MemberBook>>,
}

impl Channels {
    /// A pool for node `local` of `cluster_id`, dialling through
    /// `transport`; asking a peer gives up after `timeout`.
    pub fn new(
        transport: Transport,
        cluster_id: impl Into<String>,
        local: NodeId,
        timeout: Duration,
    ) -> Self {
        Self {
            transport,
            cluster_id: cluster_id.into(),
            local,
            timeout,
            peers: Mutex::default(),
            book: None,
        }
    }

    /// Expects of each peer the incarnation `book` names from now on.
    pub fn with_book(mut self, book: Arc<crate::members::MemberBook>) -> Self {
        self.book = Some(book);
        self
    }

    /// The incarnation of peer `id` that requests are meant for.
    pub fn incarnation(&self, id: NodeId) -> crate::ids::Incarnation {
        self.book
            .as_ref()
            .map_or(crate::ids::Incarnation(0), |book| book.incarnation(id))
    }

    /// The transport every channel is made by.
    pub fn transport(&self) -> &Transport {
        &self.transport
    }

    /// Knows peer `id` from now on: its gRPC address `control` and, if the
    /// configuration fixes it, its data address.
    pub fn add(&self, id: NodeId, control: impl Into<String>, fixed: Option<String>) {
        self.lock().insert(
            id,
            Peer {
                control: control.into(),
                fixed,
                slot: Slot::default(),
            },
        );
    }

    /// Forgets peer `id` altogether.
    pub fn remove(&self, id: NodeId) {
        self.lock().remove(&id);
    }

    /// Drops peer `id`'s channel, so the next call asks for its address
    /// again.
    pub fn forget(&self, id: NodeId) {
        if let Some(peer) = self.lock().get_mut(&id) {
            peer.slot = Slot::default();
        }
    }

    /// A channel to peer `id`'s replica service.
    pub async fn data(&self, id: NodeId) -> Result<Channel, ReplicaError> {
        Ok(self.resolve(id).await?.0)
    }

    /// Where peer `id`'s data listener is (`HOST:PORT`), for its block
    /// channel.
    pub async fn data_address(&self, id: NodeId) -> Result<String, ReplicaError> {
        Ok(self.resolve(id).await?.1)
    }

    /// Peer `id`'s channel and data address, asked for if not known yet.
    async fn resolve(&self, id: NodeId) -> Result<(Channel, String), ReplicaError> {
        let peer =
            self.lock().get(&id).cloned().ok_or_else(|| {
                ReplicaError::Unavailable(format!("node {id} is not a known peer"))
            })?;
        let mut slot = peer.slot.lock().await;
        if let Some(known) = slot.as_ref() {
            return Ok(known.clone());
        }
        let addr = match &peer.fixed {
            Some(addr) => addr.clone(),
            None => self.ask(id, &peer.control).await?,
        };
        let channel = self
            .transport
            .channel(&addr, Expect::Node(id))
            .map_err(|err| ReplicaError::Unavailable(err.to_string()))?;
        tracing::debug!(peer = %id, %addr, "replica channel");
        *slot = Some((channel.clone(), addr.clone()));
        Ok((channel, addr))
    }

    /// Asks peer `id` at `control` where its data listener is.
    async fn ask(&self, id: NodeId, control: &str) -> Result<String, ReplicaError> {
        let unreachable = |why: String| {
            ReplicaError::Unavailable(format!(
                "cannot learn node {id}'s data address at {control}: {why}"
            ))
        };
        let reply = hello(
            &self.transport,
            &self.cluster_id,
            self.local,
            id,
            control,
            self.timeout,
        )
        .await
        .map_err(|err| unreachable(err.to_string()))?;
        data_address(&reply.data_address, control).ok_or_else(|| {
            unreachable(format!(
                "its data address {:?} is not HOST:PORT",
                reply.data_address
            ))
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<NodeId, Peer>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Asks node `id` at `control` (its gRPC address) who it is, on behalf of
/// `from` of `cluster_id`; gives up after `timeout`. An answer from
/// another node is an error. `from` is a node (it then announces nothing)
/// or a member with no Raft state, which announces itself waiting (see
/// `HelloRequest.waiting_member`).
pub async fn hello(
    transport: &Transport,
    cluster_id: &str,
    from: impl Into<Asker>,
    id: NodeId,
    control: &str,
    timeout: Duration,
) -> Result<HelloReply, HelloError> {
    hello_counting(transport, cluster_id, from, (id, control), timeout, "").await
}

/// [`hello`], also asking how many NBD clients use volume `sessions_of`
/// on the node.
pub async fn hello_counting(
    transport: &Transport,
    cluster_id: &str,
    from: impl Into<Asker>,
    (id, control): (NodeId, &str),
    timeout: Duration,
    sessions_of: &str,
) -> Result<HelloReply, HelloError> {
    let mut client = transport.client(control, Expect::Node(id), NodeClient::new)?;
    let (from, waiting_member) = match from.into() {
        Asker::Node(node) => (node, 0),
        Asker::Waiting(member) => (member.node(), member.0),
    };
    let mut request = tonic::Request::new(HelloRequest {
        cluster_id: cluster_id.to_string(),
        from: from.0,
        waiting_member,
        sessions_of: sessions_of.to_string(),
    });
    request.set_timeout(timeout);
    let reply = client.hello(request).await?.into_inner();
    if reply.node_id != id.0
        || (reply.member != 0 && reply.member & crate::ids::MAX_NODE_ID != id.0)
    {
        return Err(HelloError::OtherNode(reply.node_id));
    }
    Ok(reply)
}

/// Why a [`hello`] got no answer from the node it asked.
#[derive(Debug, thiserror::Error)]
pub enum HelloError {
    /// No channel to the address (it is not one the transport can dial).
    #[error(transparent)]
    Address(#[from] crate::net::TransportError),
    /// The call failed or was refused.
    #[error("{}", .0.message())]
    Call(#[from] tonic::Status),
    /// Another node answered at the address.
    #[error("node {0} answered")]
    OtherNode(u64),
}

/// Who asks in a [`hello`].
pub enum Asker {
    /// A node, announcing nothing.
    Node(NodeId),
    /// A member with no Raft state, waiting to be added or re-added.
    Waiting(crate::ids::MemberId),
}

impl From<NodeId> for Asker {
    fn from(node: NodeId) -> Self {
        Asker::Node(node)
    }
}

impl From<crate::ids::MemberId> for Asker {
    fn from(member: crate::ids::MemberId) -> Self {
        Asker::Waiting(member)
    }
}

/// The address to dial for a data listener that says it is at `bound`,
/// on a node reached at `control`: an unspecified host becomes
/// `control`'s host.
fn data_address(bound: &str, control: &str) -> Option<String> {
    let bound: SocketAddr = bound.parse().ok()?;
    if !bound.ip().is_unspecified() {
        return Some(bound.to_string());
    }
    let (host, _) = control.rsplit_once(':')?;
    Some(format!("{host}:{}", bound.port()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unspecified_host_is_the_one_the_peer_was_reached_at() {
        assert_eq!(
            data_address("0.0.0.0:4000", "10.0.0.7:7001").unwrap(),
            "10.0.0.7:4000"
        );
        assert_eq!(
            data_address("[::]:4000", "[fd00::7]:7001").unwrap(),
            "[fd00::7]:4000"
        );
        assert_eq!(
            data_address("127.0.0.1:4000", "10.0.0.7:7001").unwrap(),
            "127.0.0.1:4000"
        );
        assert_eq!(data_address("nowhere", "10.0.0.7:7001"), None);
    }

    #[tokio::test]
    async fn an_unknown_peer_is_unavailable_and_a_forgotten_one_is_asked_again() {
        let channels = Channels::new(
            Transport::default(),
            "c",
            NodeId(1),
            Duration::from_millis(100),
        );
        assert!(matches!(
            channels.data(NodeId(2)).await,
            Err(ReplicaError::Unavailable(_))
        ));
        channels.add(NodeId(2), "127.0.0.1:1", Some("127.0.0.1:2".into()));
        let first = channels.data(NodeId(2)).await.unwrap();
        let again = channels.data(NodeId(2)).await.unwrap();
        drop((first, again));
        channels.forget(NodeId(2));
        assert!(
            channels.lock()[&NodeId(2)]
                .slot
                .try_lock()
                .unwrap()
                .is_none()
        );
        channels.data(NodeId(2)).await.unwrap();
        assert!(
            channels.lock()[&NodeId(2)]
                .slot
                .try_lock()
                .unwrap()
                .is_some()
        );
        // Without a fixed address the peer is asked; nothing listens on
        // port 1, so that fails, and says so.
        channels.add(NodeId(3), "127.0.0.1:1", None);
        let err = channels.data(NodeId(3)).await.unwrap_err();
        assert!(err.to_string().contains("node 3's data address"), "{err}");
    }
}
