//! A fault-injecting TCP proxy for partition tests on loopback.
//!
//! Each proxy forwards one direction of one node pair. While blocked it
//! forwards nothing — neither on open connections nor on new ones — but
//! closes nothing either, as a network partition drops packets without
//! resetting connections: gRPC calls time out rather than fail at once, and
//! after the heal TCP delivers what was held, as retransmission would.
//!
//! A proxy can also delay what it forwards ([`Proxy::set_delay`]): each
//! chunk is written that long after it was read, whatever else is queued,
//! like a slow link or a peer whose replies come late.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

pub struct Proxy {
    pub addr: std::net::SocketAddr,
    blocked: Arc<AtomicBool>,
    /// Microseconds each chunk is held before it is written.
    delay: Arc<AtomicU64>,
    generation: watch::Sender<u64>,
    task: JoinHandle<()>,
}

/// What each direction's pump shares with the proxy.
#[derive(Clone)]
struct Faults {
    blocked: Arc<AtomicBool>,
    delay: Arc<AtomicU64>,
}

impl Proxy {
    /// Starts a proxy on a free loopback port that forwards to `target`.
    pub async fn start(target: std::net::SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let faults = Faults {
            blocked: Arc::new(AtomicBool::new(false)),
            delay: Arc::new(AtomicU64::new(0)),
        };
        let (generation, _) = watch::channel(0u64);
        let task = tokio::spawn({
            let faults = faults.clone();
            let generation = generation.clone();
            async move {
                loop {
                    let Ok((inbound, _)) = listener.accept().await else {
                        return;
                    };
                    let faults = faults.clone();
                    let mut healed = generation.subscribe();
                    tokio::spawn(async move {
                        if wait_unblocked(&faults.blocked, &mut healed).await.is_err() {
                            return;
                        }
                        let Ok(outbound) = TcpStream::connect(target).await else {
                            return;
                        };
                        let (ri, wi) = inbound.into_split();
                        let (ro, wo) = outbound.into_split();
                        let back = healed.clone();
                        tokio::join!(
                            pump(ri, wo, faults.clone(), healed),
                            pump(ro, wi, faults, back),
                        );
                    });
                }
            }
        });
        Proxy {
            addr,
            blocked: faults.blocked,
            delay: faults.delay,
            generation,
            task,
        }
    }

    /// Holds every chunk, both ways, `delay` before writing it on.
    pub fn set_delay(&self, delay: Duration) {
        self.delay.store(delay.as_micros() as u64, Ordering::SeqCst);
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

/// Copies one direction, holding each chunk while the proxy is blocked,
/// and writing it no sooner than the delay after it was read.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    faults: Faults,
    mut changes: watch::Receiver<u64>,
) {
    let (queue, mut queued) = tokio::sync::mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = async move {
        while let Some((due, chunk)) = queued.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            if wait_unblocked(&faults.blocked, &mut changes).await.is_err() {
                break;
            }
            let delay = Duration::from_micros(faults.delay.load(Ordering::SeqCst));
            if queue
                .send((Instant::now() + delay, buf[..n].to_vec()))
                .is_err()
            {
                break;
            }
        }
    };
    tokio::join!(reader, writer);
}
