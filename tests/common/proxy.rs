//! A fault-injecting TCP proxy for partition tests on loopback.
//!
//! Each proxy forwards one direction of one node pair. While blocked it
//! forwards nothing — neither on open connections nor on new ones — but
//! closes nothing either, as a network partition drops packets without
//! resetting connections: gRPC calls time out rather than fail at once, and
//! after the heal TCP delivers what was held, as retransmission would.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub struct Proxy {
    pub addr: std::net::SocketAddr,
    blocked: Arc<AtomicBool>,
    generation: watch::Sender<u64>,
    task: JoinHandle<()>,
}

impl Proxy {
    /// Starts a proxy on a free loopback port that forwards to `target`.
    pub async fn start(target: std::net::SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let blocked = Arc::new(AtomicBool::new(false));
        let (generation, _) = watch::channel(0u64);
        let task = tokio::spawn({
            let blocked = Arc::clone(&blocked);
            let generation = generation.clone();
            async move {
                loop {
                    let Ok((inbound, _)) = listener.accept().await else {
                        return;
                    };
                    let blocked = Arc::clone(&blocked);
                    let mut healed = generation.subscribe();
                    tokio::spawn(async move {
                        if wait_unblocked(&blocked, &mut healed).await.is_err() {
                            return;
                        }
                        let Ok(outbound) = TcpStream::connect(target).await else {
                            return;
                        };
                        let (ri, wi) = inbound.into_split();
                        let (ro, wo) = outbound.into_split();
                        let back = healed.clone();
                        tokio::join!(
                            pump(ri, wo, Arc::clone(&blocked), healed),
                            pump(ro, wi, blocked, back),
                        );
                    });
                }
            }
        });
        Proxy {
            addr,
            blocked,
            generation,
            task,
        }
    }

    /// Cuts (`true`) or restores (`false`) this direction.
    pub fn set_blocked(&self, blocked: bool) {
        self.blocked.store(blocked, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Waits while the proxy is blocked; fails when the proxy is gone.
async fn wait_unblocked(
    blocked: &AtomicBool,
    changes: &mut watch::Receiver<u64>,
) -> Result<(), watch::error::RecvError> {
    while blocked.load(Ordering::SeqCst) {
        changes.changed().await?;
    }
    Ok(())
}

/// Copies one direction, holding each chunk while the proxy is blocked.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    blocked: Arc<AtomicBool>,
    mut changes: watch::Receiver<u64>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if wait_unblocked(&blocked, &mut changes).await.is_err() {
            break;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
