//! The one place where gRPC servers and client channels are built.
//!
//! Every node-to-node and admin connection goes through [`channel`] and every
//! listener through [`server`], so moving all traffic to mutual TLS later is
//! a change here only.

use std::time::Duration;

use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};

/// The largest gRPC message a node sends or accepts: a 32 MiB replica write
/// or a snapshot, plus framing.
pub const MAX_MESSAGE: usize = 64 * 1024 * 1024;

/// HTTP/2 flow-control window per stream: large enough that a 1 MiB write
/// is not cut into 64 KiB round trips.
const WINDOW: u32 = 8 * 1024 * 1024;

/// How long a new connection may take to establish.
pub const CONNECT_TIMEOUT: Duration = Duration::from_millis(500);

/// A lazily connecting channel to `addr` (`HOST:PORT`). Fails only on an
/// address that cannot be parsed.
pub fn channel(addr: &str) -> Result<Channel, String> {
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|err| format!("bad address {addr:?}: {err}"))?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true)
        .initial_stream_window_size(Some(WINDOW))
        .initial_connection_window_size(Some(WINDOW * 2))
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(5));
    Ok(endpoint.connect_lazy())
}

/// A server builder with the project's transport settings.
pub fn server() -> Server {
    Server::builder()
        .tcp_nodelay(true)
        .initial_stream_window_size(Some(WINDOW))
        .initial_connection_window_size(Some(WINDOW * 2))
        .http2_keepalive_interval(Some(Duration::from_secs(5)))
}

/// The connections of `listener`, each with `TCP_NODELAY` set. (A server
/// fed from a listener does not apply [`Server::tcp_nodelay`] itself, and
/// without it small replies wait on delayed ACKs: 40 ms each.)
pub fn incoming(listener: tokio::net::TcpListener) -> TcpIncoming {
    TcpIncoming::from(listener).with_nodelay(Some(true))
}
