//! When a replica counts as failed: when it falls **silent**, not when it is
//! merely busy.
//!
//! A writer keeps up to the NBD server's device budget (32 MiB) in flight,
//! and every replica works through its share in order. Under a flood (a
//! client's default parallelism, a slow disk, an unoptimized build on two
//! cores) the last request of a full queue waits for all those before it,
//! so one request's latency says how deep the queue is, not whether the
//! replica is alive. A fixed per-request timeout therefore dropped healthy
//! followers from the in-sync set, both at once when both were busy, and
//! the client got EIO for a volume whose every replica was working (seen in
//! CI: nbdcopy into a fresh volume).
//!
//! So a request is given up on when its replica has answered **nothing** —
//! no request, success or error — for the whole `timeout`, or when the
//! request itself has waited [`STUCK_AFTER`] timeouts while others were
//! answered (a request the replica lost). A replica that keeps answering
//! is waited for; one that goes quiet is failed within one timeout.
//!
//! Invariant kept: a request given up on is reported `Unavailable`, which
//! the engine treats as an unknown outcome (it disowns the request: see the
//! engine's "no late landing"). Nothing here ever reports a success that
//! did not happen.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::ids::NodeId;

use crate::replica::ReplicaError;

/// How many timeouts one request may wait while its replica goes on
/// answering others.
pub const STUCK_AFTER: u32 = 10;

/// The longest any one request may take: transports below the engine (the
/// gRPC deadline of a remote replica) must allow at least this much.
pub fn longest_wait(timeout: Duration) -> Duration {
    timeout * STUCK_AFTER
}

/// When each replica last answered.
#[derive(Debug, Default)]
pub struct Liveness {
    heard: Mutex<HashMap<NodeId, Instant>>,
}

impl Liveness {
    /// Runs `call` to replica `id`, giving up as the module docs say.
    pub async fn bounded<T>(
        &self,
        id: NodeId,
        timeout: Duration,
        call: impl Future<Output = Result<T, ReplicaError>>,
    ) -> Result<T, ReplicaError> {
        let started = Instant::now();
        let give_up = started + longest_wait(timeout);
        tokio::pin!(call);
        let mut check = started + timeout;
        loop {
            tokio::select! {
                result = &mut call => {
                    if !matches!(result, Err(ReplicaError::Unavailable(_))) {
                        self.heard_from(id);
                    }
                    return result;
                }
                _ = tokio::time::sleep_until(check) => {
                    let now = Instant::now();
                    let quiet_since = self.last_heard(id).map_or(started, |at| at.max(started));
                    if now >= give_up {
                        return Err(ReplicaError::Unavailable(format!(
                            "no answer within {:?} while the replica answered others",
                            now - started
                        )));
                    }
                    if now >= quiet_since + timeout {
                        return Err(ReplicaError::Unavailable(format!(
                            "no answer from the replica for {:?}",
                            now - quiet_since
                        )));
                    }
                    check = (quiet_since + timeout).min(give_up);
                }
            }
        }
    }

    /// Forgets replica `id` (it left the set; a later copy under the same
    /// id starts afresh).
    pub fn forget(&self, id: NodeId) {
        let mut heard = self.heard.lock().unwrap_or_else(|p| p.into_inner());
        heard.remove(&id);
    }

    fn heard_from(&self, id: NodeId) {
        let mut heard = self.heard.lock().unwrap_or_else(|p| p.into_inner());
        match heard.get_mut(&id) {
            Some(at) => *at = Instant::now(),
            None => {
                heard.insert(id, Instant::now());
            }
        }
    }

    fn last_heard(&self, id: NodeId) -> Option<Instant> {
        let heard = self.heard.lock().unwrap_or_else(|p| p.into_inner());
        heard.get(&id).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    const TIMEOUT: Duration = Duration::from_millis(100);

    async fn answer_after(wait: Duration) -> Result<(), ReplicaError> {
        tokio::time::sleep(wait).await;
        Ok(())
    }

    /// Replica `id` answers `count` other requests, one every half timeout,
    /// in the background.
    fn answering_others(
        liveness: &Arc<Liveness>,
        id: NodeId,
        count: u32,
    ) -> tokio::task::JoinHandle<()> {
        let liveness = Arc::clone(liveness);
        tokio::spawn(async move {
            for _ in 0..count {
                liveness
                    .bounded(id, TIMEOUT, answer_after(TIMEOUT / 2))
                    .await
                    .expect("an answered request succeeds");
            }
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_replica_fails_after_one_timeout() {
        let liveness = Liveness::default();
        let started = Instant::now();
        let result = liveness
            .bounded(NodeId(7), TIMEOUT, std::future::pending::<Result<(), _>>())
            .await;
        assert!(matches!(result, Err(ReplicaError::Unavailable(_))));
        assert_eq!(Instant::now() - started, TIMEOUT);
    }

    #[tokio::test(start_paused = true)]
    async fn a_busy_replica_that_keeps_answering_is_waited_for() {
        let liveness = Arc::new(Liveness::default());
        // Others are answered every half timeout while one request waits
        // five timeouts in the queue.
        let others = answering_others(&liveness, NodeId(7), 12);
        let slow = liveness.bounded(NodeId(7), TIMEOUT, answer_after(TIMEOUT * 5));
        assert!(slow.await.is_ok());
        others.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_the_replica_lost_fails_even_while_others_are_answered() {
        let liveness = Arc::new(Liveness::default());
        let others = answering_others(&liveness, NodeId(7), STUCK_AFTER * 3);
        let started = Instant::now();
        let lost = liveness
            .bounded(NodeId(7), TIMEOUT, std::future::pending::<Result<(), _>>())
            .await;
        assert!(matches!(lost, Err(ReplicaError::Unavailable(_))));
        assert_eq!(Instant::now() - started, longest_wait(TIMEOUT));
        others.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn answers_from_one_replica_do_not_keep_another_alive() {
        let liveness = Arc::new(Liveness::default());
        let others = answering_others(&liveness, NodeId(1), 20);
        let started = Instant::now();
        let silent = liveness
            .bounded(NodeId(2), TIMEOUT, std::future::pending::<Result<(), _>>())
            .await;
        assert!(silent.is_err());
        assert_eq!(Instant::now() - started, TIMEOUT);
        others.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_connection_is_no_sign_of_life() {
        let liveness = Liveness::default();
        let broken = liveness
            .bounded(NodeId(7), TIMEOUT, async {
                Err::<(), _>(ReplicaError::Unavailable("connection reset".into()))
            })
            .await;
        assert!(broken.is_err());
        assert_eq!(liveness.last_heard(NodeId(7)), None);
    }
}
