//! The transport: the one place where gRPC servers, client channels and
//! their settings are made, and where every connection is secured.
//!
//! A node builds one [`Transport`] from its configuration at start-up and
//! hands it to everything that listens or connects: the Raft network, the
//! remote replicas, the gRPC servers and the CLI's admin client. It carries
//! the message limits, the flow-control windows and timeouts, and the
//! node's TLS credentials ([`tls`]).
//!
//! **S9, only members speak.** With TLS (the default), every connection is
//! mutually authenticated against the cluster CA ([`tls`], [`conn`]), and
//! every service a server offers is wrapped by [`Transport::serve`] in a
//! [`PeerGuard`] for its [`Audience`]: Raft and replica requests are
//! admitted only from a node certificate of a member of this cluster
//! (the member list follows the membership), the `Node` service's from any
//! node certificate of this cluster (a node waiting to be added asks there),
//! admin requests from a client or node certificate of this cluster, and
//! the NBD export's ([`Audience::Volume`]) from a member's node
//! certificate or a client's. The guard records
//! who the caller is ([`Caller`]) in the request, where a handler checks
//! what a message claims (the Raft sender) or what it needs (the `admin`
//! role). Nothing from a connection reaches Raft, a replica or the admin
//! API before the guard admitted it.
//!
//! Without TLS (`insecure = true`) traffic is plaintext and the guard
//! admits every request as [`Caller::Unauthenticated`]: anyone who can
//! reach a port speaks for the cluster. The node says so at start, in
//! `status` and in `/metrics`.

pub mod conn;
pub mod frame;
pub mod link;
pub mod tls;

use std::sync::Arc;
use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Status};

use crate::certs::{PeerIdentity, Role};
use crate::ids::{GroupId, NodeId};
use conn::{Connector, PeerInfo};
pub use tls::{Expect, Tls};

/// Sizes and timeouts of every gRPC connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The largest gRPC message sent or accepted.
    pub max_message: usize,
    /// HTTP/2 flow-control window per stream (the connection's is twice
    /// this).
    pub window: u32,
    /// How long a new connection may take to establish.
    pub connect_timeout: Duration,
    /// HTTP/2 keep-alive ping interval; a peer that does not answer a ping
    /// within the same time is disconnected.
    pub keep_alive: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            // A 32 MiB replica write or a snapshot, plus framing.
            max_message: 64 * 1024 * 1024,
            // Large enough that a 1 MiB write is not cut into 64 KiB round
            // trips.
            window: 8 * 1024 * 1024,
            connect_timeout: Duration::from_millis(500),
            keep_alive: Duration::from_secs(5),
        }
    }
}

/// Who a service is for; the [`PeerGuard`] admits a request to it only
/// from a caller of that kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Audience {
    /// Other members of the cluster: Raft and replica traffic.
    Members,
    /// Any node of the cluster, member or not: the `Node` service, where a
    /// node that waits to be added or re-added asks who is there and
    /// announces itself (it learns nothing of the volume or of Raft's
    /// state beyond whether there is a membership).
    Nodes,
    /// Operators and their tools: the admin API.
    Operators,
    /// Whoever uses the volume's data: the NBD export. Member nodes and
    /// clients of any role are admitted (what they may do is their role's,
    /// [`Caller::writes_data`]); a node that is not a member is refused as
    /// the members' services refuse it.
    Volume,
}

/// Why the transport could not make a connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// The address is not a usable `HOST:PORT`.
    #[error("bad address {addr:?}: {why}")]
    BadAddress { addr: String, why: String },
}

/// A generated gRPC client or server whose message limits can be set (see
/// `crate::proto`).
pub trait Limited: Sized {
    /// The same client or server, sending and accepting messages of up to
    /// `max` bytes.
    fn limited(self, max: usize) -> Self;
}

/// How this node listens and connects; see the module docs. Cheap to
/// clone.
#[derive(Debug, Clone, Default)]
pub struct Transport {
    limits: Limits,
    /// TLS credentials; `None` is the insecure mode.
    tls: Option<Arc<Tls>>,
    /// The nodes whose certificates the members' services admit; `None`
    /// admits any node of the cluster.
    members: Option<Members>,
}

/// The cluster's members as the guard sees them: shared, so that a
/// membership change is seen by every service at once.
pub type Members = Arc<std::sync::RwLock<std::collections::BTreeSet<NodeId>>>;

impl Transport {
    /// A plaintext transport with `limits`: no authentication at all.
    pub fn plain(limits: Limits) -> Self {
        Self {
            limits,
            tls: None,
            members: None,
        }
    }

    /// A transport with `limits` whose every connection is mutual TLS with
    /// `tls`'s credentials.
    pub fn secured(limits: Limits, tls: Arc<Tls>) -> Self {
        Self {
            limits,
            tls: Some(tls),
            members: None,
        }
    }

    /// The same transport, whose servers admit only `members`' node
    /// certificates to the members' services (Raft, replica).
    pub fn with_members(mut self, members: Members) -> Self {
        self.members = Some(members);
        self
    }

    /// Admits node `id`'s certificate to the members' services from now on
    /// (a node being added). Without a member list, everyone is admitted
    /// already.
    pub fn admit_member(&self, id: NodeId) {
        if let Some(members) = &self.members {
            members
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .insert(id);
        }
    }

    /// Stops admitting node `id`'s certificate (a node removed).
    pub fn expel_member(&self, id: NodeId) {
        if let Some(members) = &self.members {
            members
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&id);
        }
    }

    /// The limits every connection uses.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The TLS credentials, unless insecure.
    pub fn tls(&self) -> Option<&Arc<Tls>> {
        self.tls.as_ref()
    }

    /// A lazily connecting channel to `addr` (`HOST:PORT`), which must be
    /// `expect` (with TLS). Fails only on an address that cannot be
    /// parsed.
    pub fn channel(&self, addr: &str, expect: Expect) -> Result<Channel, TransportError> {
        let limits = self.limits;
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|err| TransportError::BadAddress {
                addr: addr.to_string(),
                why: err.to_string(),
            })?
            .connect_timeout(limits.connect_timeout)
            .initial_stream_window_size(Some(limits.window))
            .initial_connection_window_size(Some(limits.window * 2))
            .http2_keep_alive_interval(limits.keep_alive)
            .keep_alive_timeout(limits.keep_alive);
        let tls = self.tls.as_ref().map(|tls| (Arc::clone(tls), expect));
        Ok(endpoint.connect_with_connector_lazy(Connector::new(addr, tls)))
    }

    /// A client made by `make` on a channel to `addr` (which must be
    /// `expect`), with this transport's message limits.
    pub fn client<C: Limited>(
        &self,
        addr: &str,
        expect: Expect,
        make: impl FnOnce(Channel) -> C,
    ) -> Result<C, TransportError> {
        Ok(self.limit(make(self.channel(addr, expect)?)))
    }

    /// `client` or `server` with this transport's message limits.
    pub fn limit<C: Limited>(&self, client: C) -> C {
        client.limited(self.limits.max_message)
    }

    /// A server builder with this transport's settings.
    pub fn server(&self) -> Server {
        Server::builder()
            .tcp_nodelay(true)
            .initial_stream_window_size(Some(self.limits.window))
            .initial_connection_window_size(Some(self.limits.window * 2))
            .http2_keepalive_interval(Some(self.limits.keep_alive))
    }

    /// `service` as a server offers it to `audience`: with this
    /// transport's message limits, behind the [`PeerGuard`].
    pub fn serve<S: Limited>(
        &self,
        audience: Audience,
        service: S,
    ) -> InterceptedService<S, PeerGuard> {
        InterceptedService::new(self.limit(service), self.guard(audience))
    }

    /// The guard a server puts in front of a service for `audience`; the
    /// block channel's server asks it about every frame.
    pub fn guard(&self, audience: Audience) -> PeerGuard {
        PeerGuard {
            audience,
            members: self.members.clone(),
            cluster_id: self.tls.as_ref().map(|tls| Arc::from(tls.cluster_id())),
        }
    }

    /// Opens a block-channel link ([`link`]) to `addr`, which must be
    /// `expect` (with TLS), for `cluster_id`'s `volume` of Raft group
    /// `group`; gives up after the connect timeout or `timeout`, whichever
    /// is longer.
    pub async fn link(
        &self,
        addr: &str,
        expect: Expect,
        cluster_id: &str,
        volume: &str,
        group: GroupId,
        timeout: Duration,
    ) -> Result<link::Link, link::LinkError> {
        let tls = self.tls.as_ref().map(|tls| (Arc::clone(tls), expect));
        let timeout = timeout.max(self.limits.connect_timeout);
        link::Link::connect(addr, tls, cluster_id, volume, group, timeout).await
    }

    /// The connections of `listener` for a server, with `TCP_NODELAY` set
    /// and, with TLS, handshaken and identified (see [`conn`]).
    pub fn incoming(
        &self,
        listener: tokio::net::TcpListener,
    ) -> impl futures::Stream<Item = Result<conn::Accepted, std::io::Error>> + Send + 'static {
        conn::incoming(listener, self.tls.clone())
    }
}

/// The check in front of every service (S9): whoever sent a request must
/// be one of the service's [`Audience`], as its certificate says. The
/// caller it admitted goes into the request as a [`Caller`].
#[derive(Debug, Clone)]
pub struct PeerGuard {
    audience: Audience,
    /// Who may call the members' services, if only some nodes may.
    members: Option<Members>,
    /// This cluster's id with TLS; `None` in the insecure mode.
    cluster_id: Option<Arc<str>>,
}

impl PeerGuard {
    /// The audience this guard admits.
    pub fn audience(&self) -> Audience {
        self.audience
    }

    /// The same guard, checking certificates against `cluster_id` even
    /// when the transport itself is insecure: for a server whose clients
    /// do authenticate (NBD with `nbd_tls`), so that their certificates
    /// count for what they name, never for everything.
    pub fn for_cluster(mut self, cluster_id: &str) -> Self {
        self.cluster_id = Some(Arc::from(cluster_id));
        self
    }

    /// Who `peer` is, if it may call a service for this guard's audience.
    pub fn admit(&self, peer: Option<&PeerInfo>) -> Result<Caller, Status> {
        let Some(cluster_id) = &self.cluster_id else {
            return Ok(Caller::Unauthenticated);
        };
        let identity = peer
            .and_then(|peer| peer.identity.as_deref())
            .ok_or_else(|| Status::unauthenticated("no client certificate"))?;
        match (identity, self.audience) {
            (PeerIdentity::Node { cluster_id: c, id }, Audience::Members | Audience::Volume)
                if **c == **cluster_id && !self.is_member(*id) =>
            {
                Err(Status::permission_denied(format!(
                    "node {id} is not a member of this cluster"
                )))
            }
            (PeerIdentity::Node { cluster_id: c, id }, _) if **c == **cluster_id => {
                Ok(Caller::Node(*id))
            }
            (
                PeerIdentity::Client {
                    cluster_id: c,
                    name,
                    role,
                },
                Audience::Operators | Audience::Volume,
            ) if **c == **cluster_id => Ok(Caller::Client {
                name: name.clone(),
                role: *role,
            }),
            (PeerIdentity::Client { .. }, Audience::Members | Audience::Nodes) => {
                Err(Status::permission_denied(format!(
                    "{identity} may not call node-to-node services; they need a node certificate"
                )))
            }
            _ => Err(Status::permission_denied(format!(
                "{identity} is not of cluster {cluster_id}"
            ))),
        }
    }
}

impl PeerGuard {
    fn is_member(&self, id: NodeId) -> bool {
        self.members.as_ref().is_none_or(|members| {
            members
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .contains(&id)
        })
    }
}

impl tonic::service::Interceptor for PeerGuard {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        let caller = self.admit(request.extensions().get::<PeerInfo>())?;
        request.extensions_mut().insert(caller);
        Ok(request)
    }
}

/// Who sent a request, as the [`PeerGuard`] admitted it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// The insecure mode: nobody is authenticated, everything is allowed.
    /// (A service called in-process, without a guard, sees this too.)
    Unauthenticated,
    /// A node of this cluster.
    Node(NodeId),
    /// An operator's tool of this cluster.
    Client { name: String, role: Role },
}

impl Caller {
    /// The caller of `request`, as its guard recorded it.
    pub fn of<T>(request: &Request<T>) -> Caller {
        request
            .extensions()
            .get::<Caller>()
            .cloned()
            .unwrap_or(Caller::Unauthenticated)
    }

    /// Refuses a caller that may not make a change to the cluster (an
    /// admin call such as a transfer): only `admin` clients may, and
    /// everyone in the insecure mode.
    pub fn require_admin(&self, what: &str) -> Result<(), Status> {
        match self {
            Caller::Unauthenticated
            | Caller::Client {
                role: Role::Admin, ..
            } => Ok(()),
            Caller::Client { name, role } => Err(Status::permission_denied(format!(
                "client {name} has role {role}; {what} needs an admin certificate"
            ))),
            Caller::Node(id) => Err(Status::permission_denied(format!(
                "node {id}'s certificate cannot {what}; use an admin client certificate"
            ))),
        }
    }

    /// Whether the caller may change the volume's data (a writable NBD
    /// export): a member node, an `admin` or `user` client, and everyone
    /// in the insecure mode; a `viewer` only reads.
    pub fn writes_data(&self) -> bool {
        match self {
            Caller::Unauthenticated | Caller::Node(_) => true,
            Caller::Client { role, .. } => role.writes_data(),
        }
    }

    /// Refuses a message that says it comes from node `claimed` unless the
    /// caller's certificate is that node's (S9).
    pub fn check_claim(&self, claimed: NodeId) -> Result<(), Status> {
        match self {
            Caller::Unauthenticated => Ok(()),
            Caller::Node(id) if *id == claimed => Ok(()),
            Caller::Node(id) => Err(Status::permission_denied(format!(
                "the certificate is node {id}'s, the message claims node {claimed}"
            ))),
            Caller::Client { name, .. } => Err(Status::permission_denied(format!(
                "client {name} cannot speak for node {claimed}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_address_is_a_typed_error() {
        let transport = Transport::default();
        let err = transport
            .channel("not an address", Expect::AnyNode)
            .unwrap_err();
        assert!(
            matches!(&err, TransportError::BadAddress { addr, .. } if addr == "not an address"),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn channels_to_parsable_addresses_connect_lazily() {
        // Nothing listens on port 1; a lazy channel does not care yet.
        assert!(
            Transport::default()
                .channel("127.0.0.1:1", Expect::AnyNode)
                .is_ok()
        );
    }
}
