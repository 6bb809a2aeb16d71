//! A fault-injecting TCP proxy for partition tests on loopback.
//!
//! Each proxy forwards one direction of one node pair. While blocked, it
//! cuts every open connection and holds new ones without forwarding (as a
//! partition drops packets), so gRPC calls time out.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::io::AsyncWriteExt;
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
                    let mut cut = generation.subscribe();
                    tokio::spawn(async move {
                        if blocked.load(Ordering::SeqCst) {
                            // Hold the connection silently until unblocked.
                            let _ = cut.changed().await;
                            drop(inbound);
                            return;
                        }
                        let Ok(outbound) = TcpStream::connect(target).await else {
                            return;
                        };
                        let (mut ri, mut wi) = inbound.into_split();
                        let (mut ro, mut wo) = outbound.into_split();
                        tokio::select! {
                            _ = tokio::io::copy(&mut ri, &mut wo) => {}
                            _ = tokio::io::copy(&mut ro, &mut wi) => {}
                            _ = cut.changed() => {}
                        }
                        let _ = wi.shutdown().await;
                        let _ = wo.shutdown().await;
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
