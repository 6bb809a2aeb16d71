//! Connections: the stream every gRPC server is fed (accepted, with the
//! TLS handshake done and the client's identity read), and the connector
//! every client channel dials with.
//!
//! - Accepting never waits on one client: each handshake runs in a task of
//!   its own, bounded in time ([`HANDSHAKE_TIMEOUT`]) and in number
//!   ([`MAX_HANDSHAKES`]), so a client that stalls in its handshake delays
//!   nobody else.
//! - Every accepted connection carries a [`PeerInfo`]: its address and, over
//!   TLS, the identity its certificate names. tonic hands it to every
//!   request of the connection, where the guard reads it.
//! - `TCP_NODELAY` is set on every connection, both ways: without it small
//!   replies wait on delayed ACKs, 40 ms each.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tonic::transport::server::Connected;

use super::tls::{Expect, Tls};
use crate::certs::PeerIdentity;

/// How long a client may take to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The most TLS handshakes one listener runs at once; more connections
/// wait to be accepted.
pub const MAX_HANDSHAKES: usize = 64;

/// Who is at the other end of an accepted connection.
#[derive(Debug, Clone)]
pub struct PeerInfo {
    /// The client's address.
    pub remote: Option<SocketAddr>,
    /// Whether the connection is TLS.
    pub tls: bool,
    /// The identity in the client's verified certificate (TLS only).
    pub identity: Option<Arc<PeerIdentity>>,
}

/// A TCP connection, plain or TLS.
#[derive(Debug)]
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
}

/// An accepted connection and who is on the other end.
#[derive(Debug)]
pub struct Accepted {
    stream: Stream,
    peer: PeerInfo,
    /// Bytes already read off the stream to tell its protocol
    /// ([`route`]), served again before the stream's own.
    prefix: bytes::Bytes,
}

impl Accepted {
    /// Who is on the other end.
    pub fn peer(&self) -> &PeerInfo {
        &self.peer
    }
}

impl Connected for Accepted {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.peer.clone()
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

impl AsyncRead for Accepted {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.prefix.is_empty() {
            let n = this.prefix.len().min(buf.remaining());
            buf.put_slice(&this.prefix.split_to(n));
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut this.stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for Accepted {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }
}

/// The connections of `listener`, handshaken with `tls` when given (see
/// the module docs). The accept loop ends when the stream is dropped.
pub fn incoming(
    listener: TcpListener,
    tls: Option<Arc<Tls>>,
) -> impl futures::Stream<Item = Result<Accepted, io::Error>> + Send + 'static {
    let (tx, rx) = mpsc::channel::<Accepted>(MAX_HANDSHAKES);
    tokio::spawn(async move {
        let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        loop {
            let permit = tokio::select! {
                permit = Arc::clone(&handshakes).acquire_owned() => match permit {
                    Ok(permit) => permit,
                    Err(_) => return,
                },
                _ = tx.closed() => return,
            };
            let (tcp, remote) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(err) => {
                        // Out of file descriptors, mostly: wait a little.
                        tracing::warn!(%err, "accepting a connection");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = tx.closed() => return,
            };
            let _ = tcp.set_nodelay(true);
            let tx = tx.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let accepted = match tls {
                    None => Ok(Accepted {
                        stream: Stream::Plain(tcp),
                        peer: PeerInfo {
                            remote: Some(remote),
                            tls: false,
                            identity: None,
                        },
                        prefix: bytes::Bytes::new(),
                    }),
                    Some(tls) => {
                        match tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(&tls, tcp, remote))
                            .await
                        {
                            Ok(outcome) => outcome,
                            Err(_) => Err(Refusal::TimedOut),
                        }
                    }
                };
                drop(permit);
                match accepted {
                    Ok(accepted) => {
                        let _ = tx.send(accepted).await;
                    }
                    Err(why) => tracing::info!(%remote, %why, "refused a connection"),
                }
            });
        }
    });
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|accepted| (Ok(accepted), rx))
    })
}

/// Sorts the connections of `incoming` by their first bytes: those that
/// open with `preface` go to the returned receiver (with the preface
/// consumed), every other one to the returned stream (with the bytes read
/// served again), for a gRPC server. A connection that sends fewer bytes
/// than the preface within [`HANDSHAKE_TIMEOUT`] is dropped. Sorting runs
/// per connection, so a slow one delays nobody.
pub fn route(
    incoming: impl futures::Stream<Item = Result<Accepted, io::Error>> + Send + 'static,
    preface: &'static [u8],
) -> (
    impl futures::Stream<Item = Result<Accepted, io::Error>> + Send + 'static,
    mpsc::Receiver<Accepted>,
) {
    use futures::StreamExt;
    use tokio::io::AsyncReadExt;
    let (others_tx, others_rx) = mpsc::channel::<Accepted>(MAX_HANDSHAKES);
    let (matched_tx, matched_rx) = mpsc::channel::<Accepted>(MAX_HANDSHAKES);
    tokio::spawn(async move {
        let mut incoming = std::pin::pin!(incoming);
        loop {
            let next = tokio::select! {
                next = incoming.next() => next,
                _ = others_tx.closed() => return,
            };
            let mut accepted = match next {
                Some(Ok(accepted)) => accepted,
                Some(Err(_)) => continue,
                None => return,
            };
            let (others_tx, matched_tx) = (others_tx.clone(), matched_tx.clone());
            tokio::spawn(async move {
                let mut first = vec![0u8; preface.len()];
                let read =
                    tokio::time::timeout(HANDSHAKE_TIMEOUT, accepted.stream.read_exact(&mut first))
                        .await;
                if !matches!(read, Ok(Ok(_))) {
                    return;
                }
                if first == preface {
                    let _ = matched_tx.send(accepted).await;
                } else {
                    accepted.prefix = bytes::Bytes::from(first);
                    let _ = others_tx.send(accepted).await;
                }
            });
        }
    });
    let others = futures::stream::unfold(others_rx, |mut rx| async move {
        rx.recv().await.map(|accepted| (Ok(accepted), rx))
    });
    (others, matched_rx)
}

/// Why an accepted connection was refused.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// The TLS handshake failed: not TLS, a certificate from another CA or
    /// none, an expired one.
    #[error("TLS handshake: {0}")]
    Handshake(#[source] io::Error),
    /// The certificate verified but names no identity of this cluster.
    #[error("client certificate: {0}")]
    Identity(#[source] crate::certs::CertError),
    /// The client presented no certificate.
    #[error("no client certificate")]
    NoCertificate,
    /// The handshake did not finish in time.
    #[error("no handshake within {HANDSHAKE_TIMEOUT:?}")]
    TimedOut,
}

/// The server's side of a TLS handshake, and the client's identity (T3 of
/// [`super::tls`]).
async fn handshake(tls: &Tls, tcp: TcpStream, remote: SocketAddr) -> Result<Accepted, Refusal> {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls.grpc_server());
    let stream = acceptor.accept(tcp).await.map_err(Refusal::Handshake)?;
    let identity = tls
        .client_identity(stream.get_ref().1.peer_certificates())
        .map_err(Refusal::Identity)?
        .ok_or(Refusal::NoCertificate)?;
    Ok(Accepted {
        stream: Stream::Tls(Box::new(stream.into())),
        peer: PeerInfo {
            remote: Some(remote),
            tls: true,
            identity: Some(Arc::new(identity)),
        },
        prefix: bytes::Bytes::new(),
    })
}

/// Dials `addr` for a tonic channel: TCP with `TCP_NODELAY`, then the TLS
/// handshake as a client that expects to reach `expect`, when `tls` is set.
#[derive(Clone)]
pub struct Connector {
    addr: String,
    tls: Option<(Arc<Tls>, Expect)>,
}

impl Connector {
    pub fn new(addr: &str, tls: Option<(Arc<Tls>, Expect)>) -> Self {
        Self {
            addr: addr.to_owned(),
            tls,
        }
    }

    /// Dials: TCP, then the TLS handshake when set.
    pub async fn dial(self) -> io::Result<Stream> {
        let tcp = TcpStream::connect(&self.addr).await?;
        tcp.set_nodelay(true)?;
        let Some((tls, expect)) = self.tls else {
            return Ok(Stream::Plain(tcp));
        };
        let config = tls.client(expect).map_err(io::Error::other)?;
        let stream = tokio_rustls::TlsConnector::from(config)
            .connect(super::tls::server_name(&self.addr), tcp)
            .await?;
        Ok(Stream::Tls(Box::new(stream.into())))
    }

    async fn connect(self) -> io::Result<TokioIo<Stream>> {
        Ok(TokioIo::new(self.dial().await?))
    }
}

impl tower_service::Service<tonic::codegen::http::Uri> for Connector {
    type Response = TokioIo<Stream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TokioIo<Stream>>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _uri: tonic::codegen::http::Uri) -> Self::Future {
        Box::pin(self.clone().connect())
    }
}
