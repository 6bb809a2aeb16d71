//! Where a node's Raft groups keep their state: one sled Db per node, a set
//! of trees per group, and one grouped flusher for all of them.
//!
//! A group's log ([`super::LogStore`]: `log`, `log_meta`) and state
//! ([`super::StateMachine`]: `state`) are trees of the node's Raft Db,
//! named for the group: group [`GroupId::FIRST`] keeps the names every
//! earlier build used (`log`, `log_meta`, `state`), so a data dir written
//! by one is read as it was; any other group's trees are prefixed
//! `group/ID/`. Trees of different groups never share a key.
//!
//! Every log append, vote and applied batch returns only once it is
//! flushed (S7). All groups flush through the one [`Flusher`] of the Db:
//! a flush covers every update that completed before it began, whichever
//! group made it, so appends of many groups at once share one fsync.

use crate::ids::GroupId;
use crate::sled_ops::Flusher;

/// A node's Raft Db, shared by its groups; clones share the same Db and
/// flusher.
#[derive(Clone)]
pub struct RaftDb {
    db: sled::Db,
    flusher: Flusher,
}

impl RaftDb {
    /// The Raft state of every group in `db`.
    pub fn new(db: &sled::Db) -> Self {
        Self {
            db: db.clone(),
            flusher: Flusher::new(db),
        }
    }

    /// Group `group`'s tree `name`, opened (and created when new).
    pub fn tree(&self, group: GroupId, name: &str) -> sled::Result<sled::Tree> {
        self.db.open_tree(tree_name(group, name))
    }

    /// Drops every tree of group `group` (a deleted volume's), durably.
    /// The group must not run. Never group 0's.
    pub async fn drop_group(&self, group: GroupId) -> sled::Result<()> {
        if group == GroupId::FIRST {
            return Ok(());
        }
        let prefix = tree_name(group, "");
        for name in self.db.tree_names() {
            if name.starts_with(prefix.as_bytes()) {
                self.db.drop_tree(&name)?;
            }
        }
        self.flusher.flush().await
    }

    /// The flusher every group's durable writes go through.
    pub fn flusher(&self) -> &Flusher {
        &self.flusher
    }
}

/// The name of group `group`'s tree `name` (see the module docs).
fn tree_name(group: GroupId, name: &str) -> String {
    if group == GroupId::FIRST {
        name.to_string()
    } else {
        format!("group/{}/{name}", group.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_group_keeps_the_tree_names_of_earlier_builds() {
        for name in ["log", "log_meta", "state"] {
            assert_eq!(tree_name(GroupId::FIRST, name), name);
        }
        assert_eq!(tree_name(GroupId(7), "log"), "group/7/log");
    }

    #[test]
    fn no_two_groups_share_a_tree() {
        let names: std::collections::BTreeSet<String> = [0, 1, 2, 10, 11]
            .into_iter()
            .flat_map(|g| ["log", "log_meta", "state"].map(move |name| tree_name(GroupId(g), name)))
            .collect();
        assert_eq!(names.len(), 15);
    }
}
