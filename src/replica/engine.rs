//! The engine: a synchronous mirror of the volume over every in-sync replica.
//!
//! The controller activates the engine with its term once the previous
//! writer is fenced; from then on every write and flush is stamped with that
//! term (S2) and sent to all members of the in-sync set at once.
//!
//! **S5, ack means replicated.** A write returns Ok only when every member of
//! the in-sync set has it and the set still has at least `min_in_sync`
//! members. When some members fail or time out, the engine asks the
//! [`InSyncTracker`] to commit their removal and acknowledges only after that
//! commit, and only if every member of the committed set got the write. If
//! removing them would leave fewer than `min_in_sync` members, nothing is
//! committed and the write fails: the set keeps members that hold every
//! acknowledged write, so availability returns with them. Shrinks are
//! serialized, so two concurrent failures cannot both see "enough" members.
//!
//! A replica that refuses a write with "stale term" means a newer writer has
//! fenced this one: the engine deactivates itself and fails the write, and
//! never shrinks the set on that account.
//!
//! Reads come from the local replica when it is in sync, else from the other
//! in-sync replicas in turn.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::future::join_all;

use super::{InSyncTracker, Replica, ReplicaError};
use crate::ha::{ReplicaState, ReplicaStatus, WriterEngine};
use crate::volume::{Device, DeviceError, check_request};

/// How an engine is set up.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The id of this node; its replica is read first.
    pub local_id: String,
    /// The fewest in-sync replicas a write may be acknowledged on.
    pub min_in_sync: usize,
    /// How long one replica may take to answer one request before it counts
    /// as failed for that request.
    pub replica_timeout: Duration,
    /// The volume size in bytes.
    pub size: u64,
}

/// An engine could not be built from its configuration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid engine configuration: {0}")]
pub struct EngineConfigError(pub String);

/// The mirroring engine. See the module docs.
pub struct Engine {
    config: EngineConfig,
    replicas: Vec<Arc<dyn Replica>>,
    tracker: Arc<dyn InSyncTracker>,
    state: Mutex<EngineState>,
    /// Serializes in-sync shrinks (see the module docs).
    shrink: tokio::sync::Mutex<()>,
}

struct EngineState {
    /// The active term; `None` while passive.
    term: Option<u64>,
    /// The committed in-sync set as last learned from the tracker.
    in_sync: BTreeSet<String>,
    /// Members whose last request failed but could not be dropped.
    degraded: BTreeSet<String>,
}

impl Engine {
    /// Builds an engine over `replicas` (which must include the local one).
    /// Until it is activated, it believes every replica is in sync, which
    /// only steers where reads go.
    pub fn new(
        config: EngineConfig,
        replicas: Vec<Arc<dyn Replica>>,
        tracker: Arc<dyn InSyncTracker>,
    ) -> Result<Self, EngineConfigError> {
        let ids: BTreeSet<String> = replicas.iter().map(|r| r.id().to_string()).collect();
        if ids.len() != replicas.len() {
            return Err(EngineConfigError("replica ids are not unique".into()));
        }
        if !ids.contains(&config.local_id) {
            return Err(EngineConfigError(format!(
                "the local replica {:?} is not among the replicas",
                config.local_id
            )));
        }
        if config.min_in_sync == 0 || config.min_in_sync > replicas.len() {
            return Err(EngineConfigError(format!(
                "min_in_sync {} must be between 1 and the number of replicas ({})",
                config.min_in_sync,
                replicas.len()
            )));
        }
        Ok(Self {
            config,
            replicas,
            tracker,
            state: Mutex::new(EngineState {
                term: None,
                in_sync: ids,
                degraded: BTreeSet::new(),
            }),
            shrink: tokio::sync::Mutex::new(()),
        })
    }

    /// The active term, if any.
    pub fn term(&self) -> Option<u64> {
        self.lock().term
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, EngineState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The active term and the replicas a request must reach.
    fn targets(&self) -> Result<(u64, Vec<Arc<dyn Replica>>), DeviceError> {
        let state = self.lock();
        let term = state.term.ok_or(DeviceError::Inactive)?;
        let targets: Vec<_> = self
            .replicas
            .iter()
            .filter(|r| state.in_sync.contains(r.id()))
            .cloned()
            .collect();
        if targets.len() < self.config.min_in_sync {
            return Err(DeviceError::InsufficientReplicas {
                have: targets.len(),
                need: self.config.min_in_sync,
            });
        }
        Ok((term, targets))
    }

    /// Sends one request to every target at once, each bounded by the
    /// replica timeout, and settles the outcome (S5).
    async fn mirror<F, Fut>(&self, op: F) -> Result<(), DeviceError>
    where
        F: Fn(u64, Arc<dyn Replica>) -> Fut,
        Fut: std::future::Future<Output = Result<(), ReplicaError>>,
    {
        let (term, targets) = self.targets()?;
        let timeout = self.config.replica_timeout;
        let outcomes = join_all(targets.iter().map(|replica| {
            let call = op(term, Arc::clone(replica));
            async move {
                match tokio::time::timeout(timeout, call).await {
                    Ok(result) => result,
                    Err(_) => Err(ReplicaError::Unavailable(format!(
                        "no answer within {timeout:?}"
                    ))),
                }
            }
        }))
        .await;
        let outcomes: Vec<(String, Result<(), ReplicaError>)> = targets
            .iter()
            .map(|r| r.id().to_string())
            .zip(outcomes)
            .collect();
        self.settle(term, outcomes).await
    }

    /// Decides whether a mirrored request may be acknowledged.
    async fn settle(
        &self,
        term: u64,
        outcomes: Vec<(String, Result<(), ReplicaError>)>,
    ) -> Result<(), DeviceError> {
        let mut succeeded = BTreeSet::new();
        let mut failed = BTreeMap::new();
        for (id, outcome) in outcomes {
            match outcome {
                Ok(()) => {
                    succeeded.insert(id);
                }
                Err(ReplicaError::StaleTerm { term, floor }) => {
                    tracing::warn!(term, floor, replica = %id, "fenced by a newer writer; deactivating");
                    self.deactivate_term(term);
                    return Err(DeviceError::StaleTerm { term, floor });
                }
                Err(err) => {
                    failed.insert(id, err);
                }
            }
        }
        if failed.is_empty() {
            return Ok(());
        }
        let _serialized = self.shrink.lock().await;
        let current = self.lock().in_sync.clone();
        let remaining: BTreeSet<String> = current
            .iter()
            .filter(|id| !failed.contains_key(*id))
            .cloned()
            .collect();
        let need = self.config.min_in_sync;
        if remaining.len() < need || !remaining.is_subset(&succeeded) {
            let mut state = self.lock();
            state.degraded.extend(failed.keys().cloned());
            let have = remaining.intersection(&succeeded).count();
            tracing::warn!(term, have, need, failed = ?failed, "write not acknowledged: too few in-sync replicas");
            return Err(DeviceError::InsufficientReplicas { have, need });
        }
        let to_remove: BTreeSet<String> = current
            .iter()
            .filter(|id| failed.contains_key(*id))
            .cloned()
            .collect();
        if to_remove.is_empty() {
            // A concurrent request already committed their removal.
            return Ok(());
        }
        tracing::warn!(term, removed = ?to_remove, errors = ?failed, "dropping replicas from the in-sync set");
        let committed = self
            .tracker
            .remove(term, &to_remove)
            .await
            .map_err(DeviceError::InSyncCommit)?;
        let acknowledged = committed.len() >= need && committed.is_subset(&succeeded);
        {
            let mut state = self.lock();
            state.in_sync = committed.clone();
            state.degraded.retain(|id| committed.contains(id));
        }
        if acknowledged {
            Ok(())
        } else {
            Err(DeviceError::InsufficientReplicas {
                have: committed.intersection(&succeeded).count(),
                need,
            })
        }
    }

    /// Deactivates only if still active at `term` (a newer activation wins).
    fn deactivate_term(&self, term: u64) {
        let mut state = self.lock();
        if state.term.is_some_and(|active| active <= term) {
            state.term = None;
        }
    }

    /// The replicas to read from, in order: the local one first if in sync.
    fn read_order(&self) -> Vec<Arc<dyn Replica>> {
        let state = self.lock();
        let local = &self.config.local_id;
        let mut order: Vec<Arc<dyn Replica>> = self
            .replicas
            .iter()
            .filter(|r| state.in_sync.contains(r.id()))
            .cloned()
            .collect();
        order.sort_by_key(|r| r.id() != local);
        order
    }
}

#[async_trait]
impl Device for Engine {
    async fn read_at(&self, offset: u64, len: u64) -> Result<Bytes, DeviceError> {
        check_request(offset, len, self.config.size)?;
        let mut errors = Vec::new();
        for replica in self.read_order() {
            let read = replica.read(offset, len);
            match tokio::time::timeout(self.config.replica_timeout, read).await {
                Ok(Ok(data)) => return Ok(data),
                Ok(Err(err)) => errors.push(format!("{}: {err}", replica.id())),
                Err(_) => errors.push(format!("{}: timed out", replica.id())),
            }
        }
        if errors.is_empty() {
            errors.push("the in-sync set is empty".into());
        }
        Err(DeviceError::NoReadableReplica(errors.join("; ")))
    }

    async fn write_at(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), DeviceError> {
        check_request(offset, data.len() as u64, self.config.size)?;
        self.mirror(|term, replica| {
            let data = data.clone();
            async move { replica.write(term, offset, data, fua).await }
        })
        .await
    }

    async fn flush(&self) -> Result<(), DeviceError> {
        self.mirror(|term, replica| async move { replica.flush(term).await })
            .await
    }

    fn size(&self) -> u64 {
        self.config.size
    }

    fn is_writable(&self) -> bool {
        self.term().is_some()
    }
}

#[async_trait]
impl WriterEngine for Engine {
    async fn activate(&self, term: u64) -> Result<(), DeviceError> {
        let committed = self
            .tracker
            .in_sync()
            .await
            .map_err(DeviceError::InSyncCommit)?;
        let mut state = self.lock();
        state.in_sync = committed;
        state.degraded.clear();
        state.term = Some(term);
        tracing::info!(term, in_sync = ?state.in_sync, "engine active");
        Ok(())
    }

    fn deactivate(&self) {
        self.lock().term = None;
    }

    fn replicas(&self) -> Vec<ReplicaStatus> {
        let state = self.lock();
        self.replicas
            .iter()
            .map(|r| {
                let id = r.id();
                let state = if state.degraded.contains(id) {
                    ReplicaState::Degraded
                } else if state.in_sync.contains(id) {
                    ReplicaState::InSync
                } else {
                    ReplicaState::Offline
                };
                ReplicaStatus {
                    id: id.to_string(),
                    state,
                    local: id == self.config.local_id,
                }
            })
            .collect()
    }
}
