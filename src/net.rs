//! The transport: the one place where gRPC servers, client channels and
//! their settings are made.
//!
//! A node builds one [`Transport`] from its configuration at start-up and
//! hands it to everything that listens or connects: the Raft network, the
//! remote replicas, the gRPC server and the CLI's admin client. It carries
//! the message limits, the flow-control windows and timeouts, and the URL
//! scheme; the node identity of mutual TLS joins them here, so securing
//! every connection is a change to this module and to the config that
//! builds it.
//!
//! Every service a server offers is wrapped by [`Transport::serve`], which
//! sets the service's message limits and puts a [`PeerGuard`] in front of
//! it: the one hook where the identity of whoever sent a request is
//! checked before the request reaches Raft, a replica or the admin API.
//!
//! Implementation caveats:
//! - Traffic is plaintext HTTP/2 and the guard admits every request: the
//!   guard has no identity to check until TLS is configured.
//! - Raft, replica data and admin requests share one listener.

use std::time::Duration;

use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Status};

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
    /// Operators and their tools: the admin API.
    Operators,
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
}

impl Transport {
    /// A plaintext transport with `limits`.
    pub fn plain(limits: Limits) -> Self {
        Self { limits }
    }

    /// The limits every connection uses.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// A lazily connecting channel to `addr` (`HOST:PORT`). Fails only on
    /// an address that cannot be parsed.
    pub fn channel(&self, addr: &str) -> Result<Channel, TransportError> {
        let limits = self.limits;
        let endpoint = Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|err| TransportError::BadAddress {
                addr: addr.to_string(),
                why: err.to_string(),
            })?
            .connect_timeout(limits.connect_timeout)
            .tcp_nodelay(true)
            .initial_stream_window_size(Some(limits.window))
            .initial_connection_window_size(Some(limits.window * 2))
            .http2_keep_alive_interval(limits.keep_alive)
            .keep_alive_timeout(limits.keep_alive);
        Ok(endpoint.connect_lazy())
    }

    /// A client made by `make` on a channel to `addr`, with this
    /// transport's message limits.
    pub fn client<C: Limited>(
        &self,
        addr: &str,
        make: impl FnOnce(Channel) -> C,
    ) -> Result<C, TransportError> {
        Ok(self.limit(make(self.channel(addr)?)))
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
        InterceptedService::new(self.limit(service), PeerGuard { audience })
    }

    /// The connections of `listener`, each with `TCP_NODELAY` set. (A
    /// server fed from a listener does not apply [`Server::tcp_nodelay`]
    /// itself, and without it small replies wait on delayed ACKs: 40 ms
    /// each.)
    pub fn incoming(&self, listener: tokio::net::TcpListener) -> TcpIncoming {
        TcpIncoming::from(listener).with_nodelay(Some(true))
    }
}

/// The check in front of every service: whoever sent a request must be
/// one of the service's [`Audience`]. Over plaintext there is no identity
/// to check, so every request is admitted.
#[derive(Debug, Clone, Copy)]
pub struct PeerGuard {
    audience: Audience,
}

impl PeerGuard {
    /// The audience this guard admits.
    pub fn audience(&self) -> Audience {
        self.audience
    }
}

impl tonic::service::Interceptor for PeerGuard {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_address_is_a_typed_error() {
        let transport = Transport::default();
        let err = transport.channel("not an address").unwrap_err();
        assert!(
            matches!(&err, TransportError::BadAddress { addr, .. } if addr == "not an address"),
            "{err:?}"
        );
    }

    #[tokio::test]
    async fn channels_to_parsable_addresses_connect_lazily() {
        // Nothing listens on port 1; a lazy channel does not care yet.
        assert!(Transport::default().channel("127.0.0.1:1").is_ok());
    }
}
