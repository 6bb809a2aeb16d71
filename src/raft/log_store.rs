//! The Raft log, vote and commit index in sled.
//!
//! Trees of the node's Raft Db, one pair per group ([`super::storage`]):
//! `log` (big-endian index → JSON entry) and `log_meta` (`vote`,
//! `committed`, `purged`). S7: `save_vote` returns only
//! after the vote is flushed to disk, and `append` signals openraft's IO
//! callback only after the entries are flushed — a vote or an entry that was
//! acknowledged to a peer survives a crash. Purge removes applied entries
//! below a snapshot, so the log stays bounded.

// openraft's storage traits fix the error type; its size is not ours to choose.
#![allow(clippy::result_large_err)]

use crate::sled_ops::Flusher;
use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};

use openraft::storage::{LogFlushed, LogState, RaftLogReader, RaftLogStorage};
use openraft::{Entry, LogId, StorageError, StorageIOError, Vote};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::storage::RaftDb;
use super::{MemberId, TypeConfig};
use crate::ids::GroupId;

const VOTE: &str = "vote";
const COMMITTED: &str = "committed";
const PURGED: &str = "purged";

/// The sled-backed log store; clones share the same trees.
#[derive(Clone)]
pub struct LogStore {
    flusher: Flusher,
    log: sled::Tree,
    meta: sled::Tree,
}

type Result<T> = std::result::Result<T, StorageError<MemberId>>;

impl LogStore {
    /// Opens the log trees of `db`'s first group (see [`RaftDb`]).
    pub fn open(db: &sled::Db) -> std::result::Result<Self, sled::Error> {
        Self::of_group(&RaftDb::new(db), GroupId::FIRST)
    }

    /// Opens group `group`'s log trees of `db`.
    pub fn of_group(db: &RaftDb, group: GroupId) -> std::result::Result<Self, sled::Error> {
        Ok(Self {
            flusher: db.flusher().clone(),
            log: db.tree(group, "log")?,
            meta: db.tree(group, "log_meta")?,
        })
    }

    fn get_meta<T: DeserializeOwned>(&self, key: &str) -> std::result::Result<Option<T>, String> {
        match self.meta.get(key).map_err(|e| e.to_string())? {
            None => Ok(None),
            Some(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| format!("corrupt {key}: {e}")),
        }
    }

    fn put_meta<T: Serialize>(&self, key: &str, value: &T) -> std::result::Result<(), String> {
        let bytes = serde_json::to_vec(value).map_err(|e| e.to_string())?;
        self.meta.insert(key, bytes).map_err(|e| e.to_string())?;
        Ok(())
    }

    async fn flush(&self) -> std::result::Result<(), String> {
        self.flusher.flush().await.map_err(|e| e.to_string())
    }

    /// Removes the entries whose keys fall in `range`, durably; from the
    /// end backwards when `from_end` (a truncation), else from the start (a
    /// purge), so a crash midway leaves a contiguous log.
    async fn remove_entries<R: RangeBounds<[u8; 8]>>(
        &self,
        range: R,
        from_end: bool,
    ) -> Result<()> {
        let mut keys: Vec<sled::IVec> = self
            .log
            .range(range)
            .keys()
            .collect::<std::result::Result<_, _>>()
            .map_err(write_err)?;
        if from_end {
            keys.reverse();
        }
        crate::sled_ops::remove_all(&self.log, keys).map_err(write_err)?;
        self.flush().await.map_err(write_err)
    }

    fn last_entry_id(&self) -> std::result::Result<Option<LogId<MemberId>>, String> {
        match self.log.last().map_err(|e| e.to_string())? {
            None => Ok(None),
            Some((_, bytes)) => {
                let entry: Entry<TypeConfig> =
                    serde_json::from_slice(&bytes).map_err(|e| format!("corrupt entry: {e}"))?;
                Ok(Some(entry.log_id))
            }
        }
    }
}

fn key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

fn read_err(err: impl ToString) -> StorageError<MemberId> {
    StorageIOError::read_logs(&std::io::Error::other(err.to_string())).into()
}

fn write_err(err: impl ToString) -> StorageError<MemberId> {
    StorageIOError::write_logs(&std::io::Error::other(err.to_string())).into()
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>> {
        let start = match range.start_bound() {
            Bound::Included(i) => Bound::Included(key(*i)),
            Bound::Excluded(i) => Bound::Excluded(key(*i)),
            Bound::Unbounded => Bound::Unbounded,
        };
        let end = match range.end_bound() {
            Bound::Included(i) => Bound::Included(key(*i)),
            Bound::Excluded(i) => Bound::Excluded(key(*i)),
            Bound::Unbounded => Bound::Unbounded,
        };
        self.log
            .range::<[u8; 8], _>((start, end))
            .values()
            .map(|value| {
                let bytes = value.map_err(read_err)?;
                serde_json::from_slice(&bytes).map_err(read_err)
            })
            .collect()
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>> {
        let purged: Option<LogId<MemberId>> = self.get_meta(PURGED).map_err(read_err)?;
        let last = self.last_entry_id().map_err(read_err)?.or(purged);
        Ok(LogState {
            last_purged_log_id: purged,
            last_log_id: last,
        })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<MemberId>) -> Result<()> {
        let fail = |e: String| StorageIOError::write_vote(&std::io::Error::other(e));
        self.put_meta(VOTE, vote).map_err(fail)?;
        self.flush().await.map_err(fail)?;
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<MemberId>>> {
        self.get_meta(VOTE)
            .map_err(|e| StorageIOError::read_vote(&std::io::Error::other(e)).into())
    }

    async fn save_committed(&mut self, committed: Option<LogId<MemberId>>) -> Result<()> {
        self.put_meta(COMMITTED, &committed).map_err(write_err)?;
        self.flush().await.map_err(write_err)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<MemberId>>> {
        Ok(self
            .get_meta::<Option<LogId<MemberId>>>(COMMITTED)
            .map_err(read_err)?
            .flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<()>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let encoded = entries
            .into_iter()
            .map(|entry| Ok((key(entry.log_id.index), serde_json::to_vec(&entry)?)))
            .collect::<std::result::Result<Vec<_>, serde_json::Error>>()
            .map_err(write_err)?;
        crate::sled_ops::insert_all(&self.log, encoded).map_err(write_err)?;
        let flushed = self.flush().await;
        callback.log_io_completed(flushed.clone().map_err(std::io::Error::other));
        flushed.map_err(write_err)
    }

    async fn truncate(&mut self, log_id: LogId<MemberId>) -> Result<()> {
        self.remove_entries(key(log_id.index).., true).await
    }

    async fn purge(&mut self, log_id: LogId<MemberId>) -> Result<()> {
        self.put_meta(PURGED, &log_id).map_err(write_err)?;
        self.remove_entries(..=key(log_id.index), false).await
    }
}
