//! The node's background tasks and the one signal that stops them.
//!
//! The node's long-running work (the NBD and HTTP listeners, the
//! controller, the failure detector, resync, mark retirement, health
//! reporting) is spawned through [`Tasks`]. Shutdown sends one stop signal:
//! the HTTP server drains its requests, the NBD server closes its
//! connections, and every other task is stopped at its next await point.
//! [`Tasks::stop`] waits for all of them, within a deadline, before the
//! node stops Raft and flushes its state; a task still running at the
//! deadline is named in the log and aborted. (The gRPC server is stopped
//! after Raft, by a signal of its own: Raft's handlers live on it.)
//!
//! Dropping a [`Tasks`] without calling [`Tasks::stop`] stops its tasks
//! too: the signal's sender goes away.

use std::future::Future;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How long an aborted task gets to be dropped.
const ABORT_GRACE: Duration = Duration::from_millis(100);

/// See the module docs.
pub struct Tasks {
    stop: watch::Sender<bool>,
    running: Vec<(&'static str, JoinHandle<()>)>,
}

impl Default for Tasks {
    fn default() -> Self {
        Self {
            stop: watch::channel(false).0,
            running: Vec::new(),
        }
    }
}

impl Tasks {
    /// A receiver of the stop signal, for a task that drains gracefully.
    pub fn stop_signal(&self) -> watch::Receiver<bool> {
        self.stop.subscribe()
    }

    /// A future that resolves once the stop signal is sent.
    pub fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut stop = self.stop.subscribe();
        async move {
            let _ = stop.wait_for(|stop| *stop).await;
        }
    }

    /// Runs `task`, named `name`, on the current runtime until it ends or
    /// the stop signal comes.
    pub fn spawn(&mut self, name: &'static str, task: impl Future<Output = ()> + Send + 'static) {
        let handle = tokio::spawn(self.until_stopped(task));
        self.running.push((name, handle));
    }

    /// Runs `task`, which watches [`Tasks::stop_signal`] itself and ends
    /// on its own after draining (a server closing its connections).
    pub fn spawn_draining(
        &mut self,
        name: &'static str,
        task: impl Future<Output = ()> + Send + 'static,
    ) {
        self.running.push((name, tokio::spawn(task)));
    }

    /// The same as [`Tasks::spawn`], on `runtime`.
    pub fn spawn_on(
        &mut self,
        runtime: &Handle,
        name: &'static str,
        task: impl Future<Output = ()> + Send + 'static,
    ) {
        let handle = runtime.spawn(self.until_stopped(task));
        self.running.push((name, handle));
    }

    fn until_stopped(
        &self,
        task: impl Future<Output = ()> + Send + 'static,
    ) -> impl Future<Output = ()> + Send + 'static {
        let stopped = self.stopped();
        async move {
            tokio::select! {
                () = task => {}
                () = stopped => {}
            }
        }
    }

    /// Sends the stop signal and waits up to `deadline` for every task to
    /// end; aborts (and names) those that do not.
    pub async fn stop(self, deadline: Duration) {
        self.stop.send_replace(true);
        let until = tokio::time::Instant::now() + deadline;
        for (name, mut handle) in self.running {
            match tokio::time::timeout_at(until, &mut handle).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) if err.is_panic() => {
                    let panic = err.into_panic();
                    let why = panic
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    tracing::error!(task = name, why, "task panicked");
                }
                Ok(Err(_)) => {}
                Err(_) => {
                    tracing::warn!(task = name, "task did not stop in time; aborting it");
                    handle.abort();
                    // Wait for the abort to land, so nothing of it runs on
                    // while the node stops Raft and flushes.
                    let _ = tokio::time::timeout(ABORT_GRACE, handle).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use tokio::time::Instant;

    const DEADLINE: Duration = Duration::from_secs(3600);

    #[tokio::test(start_paused = true)]
    async fn stop_ends_a_looping_task_at_once_and_lets_a_draining_one_finish() {
        let mut tasks = Tasks::default();
        tasks.spawn("loop", async {
            loop {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        });
        let drained = Arc::new(AtomicBool::new(false));
        let mut stop = tasks.stop_signal();
        tasks.spawn_draining("drain", {
            let drained = Arc::clone(&drained);
            async move {
                let _ = stop.wait_for(|s| *s).await;
                // Draining takes a while.
                tokio::time::sleep(Duration::from_secs(1)).await;
                drained.store(true, Ordering::SeqCst);
            }
        });
        let started = Instant::now();
        tasks.stop(DEADLINE).await;
        assert!(drained.load(Ordering::SeqCst), "the draining task was cut");
        // On the paused clock: stop waited for the drain, not the deadline.
        assert!(Instant::now() - started < Duration::from_secs(60));
    }

    #[tokio::test(start_paused = true)]
    async fn a_task_that_ignores_the_signal_is_aborted_at_the_deadline() {
        let mut tasks = Tasks::default();
        let finished = Arc::new(AtomicBool::new(false));
        tasks.spawn_draining("stubborn", {
            let finished = Arc::clone(&finished);
            async move {
                tokio::time::sleep(DEADLINE * 2).await;
                finished.store(true, Ordering::SeqCst);
            }
        });
        let started = Instant::now();
        tasks.stop(DEADLINE).await;
        assert!(Instant::now() - started >= DEADLINE);
        tokio::time::sleep(DEADLINE * 2).await;
        assert!(
            !finished.load(Ordering::SeqCst),
            "the stubborn task was not aborted"
        );
    }
}
