//! The threads Raft runs on, apart from the data plane.
//!
//! The lease (S4) lasts only `election_timeout_min − margin` past the last
//! quorum acknowledgement (250 ms by default), so every step between a
//! heartbeat's send time and its acknowledgement must be quick: the Raft
//! core, its replication tasks and network clients, the follower's
//! handling of the request, the failure detector and the coordinator's
//! lease clock. On the node's shared runtime all of them queued behind the
//! data plane — NBD sessions, replica writes of megabytes, their fsyncs on
//! the blocking pool — and under a client's default parallelism the lease
//! ran out.
//!
//! Measured (debug build, 3 nodes, nbdcopy's default 4 × 64 requests): with
//! Raft on the shared runtime the writer lost its lease after 148 MB; with
//! only the slow-reply fix of [`super::network`] (no 500 ms backoff) still
//! after 11 MB; with both, 1 GiB in and out and fio at QD8 and QD32 ran
//! without a demotion (`cargo test --test raft_under_load`).
//!
//! [`RaftRuntime`] is a tokio runtime of its own, on threads of its own
//! (named `raft-*`), with its own blocking pool (so the Raft log's sled
//! flushes never wait for a free blocking thread behind data fsyncs). What
//! runs there:
//! - openraft: `Raft::new` is run inside it, so the core and the
//!   replication tasks it spawns live there;
//! - the Raft gRPC clients: every channel to a peer's Raft service is built
//!   inside it ([`super::network::Peers`]), so its connection task and I/O
//!   are driven there;
//! - the gRPC server of the control listener, Raft's service among them
//!   ([`super::network::RaftService`]; see below);
//! - the coordinator's lease watcher and the failure detector.
//!
//! **The gRPC listener.** All control services (Raft, `Node`, admin,
//! health) share one gRPC port, and tonic serves each connection from the
//! runtime that runs the server: that server runs here, its accept loop,
//! TLS handshakes and HTTP/2 connection I/O included (the listener is moved
//! to this runtime's I/O driver), so a follower reads a heartbeat off the
//! socket on these threads. Block data has a listener of its own, served
//! by the main runtime.
//!
//! **Priority.** Under a client that saturates both cores, the scheduler
//! shares the CPU among all threads alike, and Raft's few threads got too
//! little of it: a debug-build node lost its lease under nbdcopy's default
//! flood once block data moved to the faster channel. The main runtime's
//! threads (the data plane) therefore run at nice [`DATA_PLANE_NICE`];
//! Raft's run at [`RAFT_NICE`] where the node may raise its priority
//! (root), else at 0 (the binary sets this up; see `data_plane_thread`).
//! At 0, 2 of 30 debug runs of `cluster/flood` still lost the lease as
//! nbdcopy's flood began: both followers answered later than the lease.
//! Measured: `raft_under_load` held the lease in all of 17 runs (11 with
//! small replica I/O on the blocking pool, 6 with it inline on the data
//! plane's threads as now), 5 of them beside one or two CPU-bound loops
//! and/or a `dd` writing to the same disk. No priority makes a lease safe
//! on a machine starved without bound; the margin is what the test shows.
//!
//! **Shutdown.** [`RaftRuntime::shutdown`] ends the runtime on its own
//! thread (dropping a runtime is not allowed inside async code) and waits
//! for that thread, so no Raft thread outlives the node.

use std::future::Future;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::oneshot;

/// The nice value of the data plane's threads: below Raft's (0), so that
/// when clients saturate the CPU the scheduler still gives Raft's threads
/// their turn (a CFS weight of 335 against 1024).
pub const DATA_PLANE_NICE: i32 = 5;

/// The nice value Raft's threads ask for: above every ordinary process
/// (0), so that a client saturating the CPU beside the node (nbdcopy, fio,
/// the other nodes on one machine) still leaves Raft its turn (a CFS
/// weight of 3121 against 1024). It needs privilege (root or
/// `CAP_SYS_NICE`); without, Raft's threads stay at 0.
pub const RAFT_NICE: i32 = -5;

/// Lowers the calling thread's priority to [`DATA_PLANE_NICE`]: for the
/// main runtime's threads (NBD, block data, their I/O). Best effort.
pub fn data_plane_thread() {
    set_nice(DATA_PLANE_NICE);
}

/// Raises the calling thread to [`RAFT_NICE`] where allowed, else to 0.
fn raft_thread() {
    if !set_nice(RAFT_NICE) {
        set_nice(0);
    }
}

/// Sets the calling thread's nice value (Linux: per thread); whether it
/// was allowed. Raising it needs privilege; a refusal is only logged.
fn set_nice(nice: i32) -> bool {
    let tid = rustix::thread::gettid();
    match rustix::process::setpriority_process(Some(tid), nice) {
        Ok(()) => true,
        Err(err) => {
            tracing::debug!(%err, nice, "cannot set the thread's priority");
            false
        }
    }
}

/// How many worker threads Raft gets: enough that one busy task (a log
/// append's sled insert) does not hold up a heartbeat.
const WORKERS: usize = 2;

/// How long shutdown waits for Raft's tasks to finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// Raft's own runtime. See the module docs.
pub struct RaftRuntime {
    handle: Handle,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl RaftRuntime {
    /// Starts the runtime's threads.
    pub fn start() -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(WORKERS)
            .max_blocking_threads(8)
            .thread_name("raft-worker")
            // A thread inherits its creator's priority: one made from a
            // data-plane thread starts lowered.
            .on_thread_start(raft_thread)
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("raft-runtime".into())
            .spawn(move || {
                runtime.block_on(async {
                    let _ = stopped.await;
                });
                runtime.shutdown_timeout(SHUTDOWN_GRACE);
            })?;
        Ok(Self {
            handle,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// A handle to spawn onto the runtime or enter it.
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// Runs `future` on the runtime and waits for its output.
    pub async fn run<F>(&self, future: F) -> Result<F::Output, String>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.handle
            .spawn(future)
            .await
            .map_err(|err| format!("raft runtime task: {err}"))
    }

    /// Stops every task on the runtime and waits until its threads ended.
    pub async fn shutdown(mut self) {
        self.stop_now();
        if let Some(thread) = self.thread.take() {
            let joined = tokio::task::spawn_blocking(move || thread.join()).await;
            if !matches!(joined, Ok(Ok(()))) {
                tracing::warn!("the Raft runtime's thread did not end cleanly");
            }
        }
    }

    fn stop_now(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl Drop for RaftRuntime {
    fn drop(&mut self) {
        // Without an explicit shutdown the thread still ends; it is not
        // waited for (a drop may run inside async code).
        self.stop_now();
    }
}
