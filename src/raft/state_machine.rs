//! The Raft state machine: the control state, persisted in sled.
//!
//! After every applied batch the whole [`Applied`] state (last applied log
//! id, membership, [`ControlState`]) is written to the group's `state` tree and
//! flushed (S7: an in-sync change is durable before anyone acts on it); it is
//! a few hundred bytes. Snapshots are that same state as JSON. Every applied
//! state is also published on a watch channel, so the coordinator can wait
//! until the entries of its own term are applied before it trusts the
//! recorded writer and in-sync set.

// openraft's storage traits fix the error type; its size is not ours to choose.
#![allow(clippy::result_large_err)]

use crate::sled_ops::Flusher;
use std::io::Cursor;
use std::sync::Arc;

use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    EntryPayload, LogId, RaftSnapshotBuilder, SnapshotMeta, StorageError, StorageIOError,
    StoredMembership,
};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use super::storage::RaftDb;
use super::{ControlState, MemberId, MemberNode, Response, TypeConfig};
use crate::ids::GroupId;

const STATE: &str = "state";
const SNAPSHOT: &str = "snapshot";

/// What the state machine has applied.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    /// The last applied log id.
    pub last_applied: Option<LogId<MemberId>>,
    /// The last applied membership.
    pub membership: StoredMembership<MemberId, MemberNode>,
    /// The control data.
    pub control: ControlState,
}

#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<MemberId, MemberNode>,
    data: Vec<u8>,
}

/// The sled-backed state machine; clones share state.
#[derive(Clone)]
pub struct StateMachine {
    flusher: Flusher,
    tree: sled::Tree,
    applied: Arc<watch::Sender<Applied>>,
}

type Result<T> = std::result::Result<T, StorageError<MemberId>>;

fn sm_read(err: impl ToString) -> StorageError<MemberId> {
    StorageIOError::read_state_machine(&std::io::Error::other(err.to_string())).into()
}

fn sm_write(err: impl ToString) -> StorageError<MemberId> {
    StorageIOError::write_state_machine(&std::io::Error::other(err.to_string())).into()
}

impl StateMachine {
    /// Opens the state tree of `db`'s first group (see [`RaftDb`]) and
    /// loads what was applied before.
    pub fn open(db: &sled::Db) -> std::result::Result<Self, String> {
        Self::of_group(&RaftDb::new(db), GroupId::FIRST)
    }

    /// Opens group `group`'s state tree of `db` and loads what was applied
    /// before.
    pub fn of_group(db: &RaftDb, group: GroupId) -> std::result::Result<Self, String> {
        let tree = db.tree(group, "state").map_err(|e| e.to_string())?;
        let applied = match tree.get(STATE).map_err(|e| e.to_string())? {
            None => Applied::default(),
            Some(bytes) => {
                serde_json::from_slice(&bytes).map_err(|e| format!("corrupt state machine: {e}"))?
            }
        };
        Ok(Self {
            flusher: db.flusher().clone(),
            tree,
            applied: Arc::new(watch::channel(applied).0),
        })
    }

    /// A receiver of every applied state, starting with the current one.
    pub fn subscribe(&self) -> watch::Receiver<Applied> {
        self.applied.subscribe()
    }

    /// The current applied state.
    pub fn current(&self) -> Applied {
        self.applied.borrow().clone()
    }

    async fn persist(&self, applied: &Applied) -> Result<()> {
        let bytes = serde_json::to_vec(applied).map_err(sm_write)?;
        self.tree.insert(STATE, bytes).map_err(sm_write)?;
        self.flusher.flush().await.map_err(sm_write)?;
        Ok(())
    }

    fn stored_snapshot(&self) -> Result<Option<StoredSnapshot>> {
        match self.tree.get(SNAPSHOT).map_err(sm_read)? {
            None => Ok(None),
            Some(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(sm_read),
        }
    }

    async fn save_snapshot(&self, snapshot: &StoredSnapshot) -> Result<()> {
        let bytes = serde_json::to_vec(snapshot).map_err(sm_write)?;
        self.tree.insert(SNAPSHOT, bytes).map_err(sm_write)?;
        self.flusher.flush().await.map_err(sm_write)?;
        Ok(())
    }
}

impl RaftSnapshotBuilder<TypeConfig> for StateMachine {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>> {
        let applied = self.current();
        let data = serde_json::to_vec(&applied).map_err(sm_read)?;
        let snapshot_id = match applied.last_applied {
            Some(id) => format!("{}-{}", id.leader_id.term, id.index),
            None => "empty".into(),
        };
        let meta = SnapshotMeta {
            last_log_id: applied.last_applied,
            last_membership: applied.membership.clone(),
            snapshot_id,
        };
        self.save_snapshot(&StoredSnapshot {
            meta: meta.clone(),
            data: data.clone(),
        })
        .await?;
        Ok(Snapshot {
            meta,
            snapshot: Box::new(Cursor::new(data)),
        })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachine {
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(
        Option<LogId<MemberId>>,
        StoredMembership<MemberId, MemberNode>,
    )> {
        let applied = self.current();
        Ok((applied.last_applied, applied.membership))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Response>>
    where
        I: IntoIterator<Item = openraft::Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let mut applied = self.current();
        let mut responses = Vec::new();
        for entry in entries {
            applied.last_applied = Some(entry.log_id);
            let response = match &entry.payload {
                EntryPayload::Blank => Response::done(&applied.control),
                EntryPayload::Normal(request) => applied.control.apply(request),
                EntryPayload::Membership(membership) => {
                    applied.membership =
                        StoredMembership::new(Some(entry.log_id), membership.clone());
                    // A node that left the membership leaves the in-sync
                    // set with it: its copy is no longer kept current, and
                    // were it added again later (on an empty disk), it must
                    // not count as in sync (S5).
                    let members: std::collections::BTreeSet<_> =
                        membership.nodes().map(|(m, _)| m.node()).collect();
                    applied.control.in_sync.retain(|id| members.contains(id));
                    Response::done(&applied.control)
                }
            };
            responses.push(response);
        }
        self.persist(&applied).await?;
        self.applied.send_replace(applied);
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<MemberId, MemberNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<()> {
        let data = snapshot.into_inner();
        let applied: Applied = serde_json::from_slice(&data).map_err(|e| {
            StorageIOError::read_snapshot(Some(meta.signature()), &std::io::Error::other(e))
        })?;
        self.persist(&applied).await?;
        self.save_snapshot(&StoredSnapshot {
            meta: meta.clone(),
            data,
        })
        .await?;
        self.applied.send_replace(applied);
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>> {
        Ok(self.stored_snapshot()?.map(|stored| Snapshot {
            meta: stored.meta,
            snapshot: Box::new(Cursor::new(stored.data)),
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use openraft::storage::RaftStateMachine;
    use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, Membership};

    use super::*;
    use crate::ids::NodeId;
    use crate::raft::Request;
    use crate::volume::VolumeSpec;

    fn entry(index: u64, payload: EntryPayload<TypeConfig>) -> Entry<TypeConfig> {
        Entry {
            log_id: LogId::new(CommittedLeaderId::new(1, MemberId(1)), index),
            payload,
        }
    }

    /// A node removed from the membership leaves the in-sync set with it,
    /// so that it does not count as in sync if it is ever added again on
    /// an empty disk (S5).
    #[tokio::test]
    async fn a_membership_without_a_node_drops_it_from_the_in_sync_set() {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::open(dir.path()).unwrap();
        let mut machine = StateMachine::open(&db).unwrap();
        let nodes = |ids: &[u64]| -> BTreeMap<MemberId, MemberNode> {
            ids.iter()
                .map(|id| (MemberId(*id), MemberNode::default()))
                .collect()
        };
        let voters =
            |ids: &[u64]| -> BTreeSet<MemberId> { ids.iter().map(|id| MemberId(*id)).collect() };
        let init = Request::Init {
            volume: VolumeSpec::new("c", "v", 4096, 2),
            replicas: [NodeId(1), NodeId(2), NodeId(3)].into(),
            uuid: String::new(),
        };
        machine
            .apply(vec![
                entry(1, EntryPayload::Normal(init)),
                entry(
                    2,
                    EntryPayload::Membership(Membership::new(
                        vec![voters(&[1, 2])],
                        nodes(&[1, 2]),
                    )),
                ),
            ])
            .await
            .unwrap();
        assert_eq!(
            machine.current().control.in_sync,
            [NodeId(1), NodeId(2)].into()
        );
    }
}
