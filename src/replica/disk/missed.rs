//! The missed-write map: while a replica is out of the in-sync set, the
//! in-sync replicas record which extents they changed, so that its rebuild
//! compares and copies those and not the whole volume (DRBD's bitmap).
//!
//! Each replica store keeps, in its metadata database, one map per absent
//! member: an *open* record naming the member and the incarnation of its
//! data dir the map is about, and one entry per extent. While a map is
//! open, every change the store applies (a write, a discard, a copy of a
//! rebuild, scrub or convergence) adds its extents to it first, durably and
//! in the same metadata flush as the change's S6 mark; an extent already
//! in the map costs nothing more, so a long absence costs at most one entry
//! per extent of the volume.
//!
//! **Invariant M.** If an in-sync replica A holds an open map for member X
//! of incarnation I, every extent where X's copy (of incarnation I) may
//! differ from A's is in A's map or at or past the map's *unverified
//! range*, apart from the extents X itself holds marks for, which its
//! rebuild adds. How it is kept:
//! - *When X leaves.* Before the writer commits X's removal from the
//!   in-sync set, it opens X's map on every replica that stays (in sync or
//!   being rebuilt), and then notes there the extents of every write still
//!   in flight: a write that began before the map was open on some replica
//!   may have reached it and not X. A write that began after finds the map
//!   open. Writes whose outcome on X was unknown are among those in flight.
//!   A node whose fencer drops an unreachable X opens X's map with every
//!   marked extent of the dead writer (its unacknowledged writes may have
//!   reached some copies and not others).
//! - *While X is away.* A replica records every change while X's map is
//!   open, whoever makes it. A replica that returns from a rebuild of its
//!   own is given the maps of its source (each opened on it before the
//!   source's is read, after it began receiving writes), since it missed
//!   what the others recorded while it was away; a map it kept that the
//!   source does not (its member returned meanwhile) is stale and closed.
//! - *When X returns.* Once its return is committed, the writer closes its
//!   map everywhere. A map left open by a close that failed is a superset,
//!   and a superset only costs copies.
//! - *When X is removed from the cluster.* The writer's resyncer closes the
//!   maps of nodes that are no longer members on every keeper, and tries
//!   again until every close took (and after each writer change). A
//!   removed node returns only by being added again: a source without its
//!   map rebuilds it in full, and a map a failed close left open is
//!   complete (it recorded every change), so a rebuild from it is sound.
//!
//! **The unverified range** makes a full rebuild resumable. Before one
//! compares anything, the writer lowers the range of X's map to extent 0
//! on every in-sync replica (opening the map): X may differ anywhere, and
//! every change from then on is recorded. As the rebuild goes, X flushes
//! what it copied and the range is raised to the first extent not yet
//! compared. A rebuild by a later writer compares the listed extents below
//! the range and every extent from it on. Raising is the only way the
//! range shrinks, and only past extents compared while the map recorded
//! every change, so an extent changed after its comparison is listed. A
//! map given to a replica that returns keeps its range (lowered there, if
//! it had a map without one).
//!
//! A replica with no shared history gets a full rebuild: one whose
//! incarnation is not the map's (a replaced disk, S8), or a source without
//! an open map for it (the map was never opened there: a replica formed
//! before maps existed, or a node that lost its metadata). The map has no
//! other limit: it never covers more than every extent of the volume, and
//! then the rebuild compares every extent, as a full one does.
//!
//! Races inside a store: a map is opened, closed and changed under one
//! lock, and a change's entries are added to the in-memory copy only if no
//! open or close happened between computing them and their flush (a
//! `version` counts those), so memory never claims an entry the database
//! lost to a close. An open or close that fails part way makes memory
//! forget the member's entries, since the database may have lost some
//! (a replacement removes the open record before the old entries, so a
//! crash between leaves no map rather than a map with holes).

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;

use crate::ids::{Incarnation, NodeId};

use crate::replica::ReplicaError;
pub use crate::replica::{MissedMap, Unverified};

/// At most this many extents in one note or one page of a map.
pub const MAX_MISSED_EXTENTS: u64 = 65_536;

const OPEN: u8 = b'o';
const ENTRY: u8 = b'e';

/// The value of an open record: the incarnation and, with a range, where
/// it begins.
pub fn open_value(incarnation: Incarnation, unverified_from: Option<u64>) -> Vec<u8> {
    let mut value = incarnation.0.to_be_bytes().to_vec();
    if let Some(from) = unverified_from {
        value.extend_from_slice(&from.to_be_bytes());
    }
    value
}

/// An open record's incarnation and range.
fn decode_open(value: &[u8]) -> Result<(Incarnation, Option<u64>), ReplicaError> {
    match value.len() {
        8 => Ok((Incarnation(decode_u64(value)?), None)),
        16 => Ok((
            Incarnation(decode_u64(&value[..8])?),
            Some(decode_u64(&value[8..])?),
        )),
        _ => Err(ReplicaError::Io(format!(
            "corrupt missed-write map record {value:?}"
        ))),
    }
}

/// `extents` in pieces a note may carry; one empty piece when there are
/// none, so that a note still opens the map.
pub fn pieces(extents: &[u64]) -> impl Iterator<Item = &[u64]> {
    let empty: &[u64] = &[];
    let first = extents.is_empty().then_some(empty);
    first
        .into_iter()
        .chain(extents.chunks(MAX_MISSED_EXTENTS as usize))
}

/// The key of `node`'s open record.
pub fn open_key(node: NodeId) -> [u8; 9] {
    let mut key = [0u8; 9];
    key[0] = OPEN;
    key[1..].copy_from_slice(&node.0.to_be_bytes());
    key
}

/// The key of `node`'s entry for `extent`.
pub fn entry_key(node: NodeId, extent: u64) -> [u8; 17] {
    let mut key = [0u8; 17];
    key[0] = ENTRY;
    key[1..9].copy_from_slice(&node.0.to_be_bytes());
    key[9..].copy_from_slice(&extent.to_be_bytes());
    key
}

/// The prefix of every entry of `node`.
pub fn entry_prefix(node: NodeId) -> [u8; 9] {
    let mut key = open_key(node);
    key[0] = ENTRY;
    key
}

fn decode_u64(bytes: &[u8]) -> Result<u64, ReplicaError> {
    let bytes: [u8; 8] = bytes
        .try_into()
        .map_err(|_| ReplicaError::Io(format!("corrupt missed-write map key {bytes:?}")))?;
    Ok(u64::from_be_bytes(bytes))
}

/// The extent of an entry key.
pub fn decode_entry(key: &[u8]) -> Result<(NodeId, u64), ReplicaError> {
    if key.len() != 17 || key[0] != ENTRY {
        return Err(ReplicaError::Io(format!(
            "corrupt missed-write map key {key:?}"
        )));
    }
    Ok((NodeId(decode_u64(&key[1..9])?), decode_u64(&key[9..])?))
}

/// The in-memory copy of a store's maps: which are open, and which entries
/// are durable. See the module docs.
#[derive(Debug, Default)]
pub struct MissedMaps {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    open: BTreeMap<NodeId, Incarnation>,
    /// Where each open map's unverified range begins, if it has one.
    unverified: BTreeMap<NodeId, u64>,
    noted: HashSet<(NodeId, u64)>,
    version: u64,
}

/// Entries a change must add before it is applied, and the version they
/// were computed at.
#[derive(Debug, Default)]
pub struct Needed {
    pub entries: Vec<(NodeId, u64)>,
    version: u64,
}

impl MissedMaps {
    /// Loads the maps of `tree`; entries of a member without an open map
    /// (a change that raced a close) are removed.
    pub fn load(tree: &sled::Tree) -> Result<Self, ReplicaError> {
        let mut state = State::default();
        for item in tree.scan_prefix([OPEN]) {
            let (key, value) = item?;
            let node = NodeId(decode_u64(&key[1..])?);
            let (incarnation, unverified) = decode_open(&value)?;
            state.open.insert(node, incarnation);
            if let Some(from) = unverified {
                state.unverified.insert(node, from);
            }
        }
        let mut orphans = Vec::new();
        for key in tree.scan_prefix([ENTRY]).keys() {
            let key = key?;
            let (node, extent) = decode_entry(&key)?;
            if state.open.contains_key(&node) {
                state.noted.insert((node, extent));
            } else {
                orphans.push(key);
            }
        }
        crate::sled_ops::remove_all(tree, &orphans)?;
        Ok(Self {
            state: Mutex::new(state),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The entries a change to extents `first..=last` must add first.
    pub fn needed(&self, first: u64, last: u64) -> Needed {
        let state = self.lock();
        let entries = state
            .open
            .keys()
            .flat_map(|node| (first..=last).map(move |extent| (*node, extent)))
            .filter(|entry| !state.noted.contains(entry))
            .collect();
        Needed {
            entries,
            version: state.version,
        }
    }

    /// `needed`'s entries are durable now.
    pub fn flushed(&self, needed: Needed) {
        let mut state = self.lock();
        if state.version == needed.version {
            state.noted.extend(needed.entries);
        }
    }

    /// The incarnation `node`'s open map is about, if one is open.
    pub fn open_of(&self, node: NodeId) -> Option<Incarnation> {
        self.lock().open.get(&node).copied()
    }

    /// Where `node`'s open map's unverified range begins, if it has one.
    pub fn unverified_of(&self, node: NodeId) -> Option<u64> {
        self.lock().unverified.get(&node).copied()
    }

    /// `node`'s open map's unverified range is durably `from` now.
    pub fn set_unverified(&self, node: NodeId, from: Option<u64>) {
        let mut state = self.lock();
        match from {
            Some(from) => state.unverified.insert(node, from),
            None => state.unverified.remove(&node),
        };
    }

    /// Every member with an open map.
    pub fn open(&self) -> BTreeMap<NodeId, Incarnation> {
        self.lock().open.clone()
    }

    /// `node`'s map is open (about `incarnation`) and holds `extents`,
    /// durably; `replaced` if its earlier entries were removed.
    pub fn opened(&self, node: NodeId, incarnation: Incarnation, extents: &[u64], replaced: bool) {
        let mut state = self.lock();
        state.version += 1;
        if replaced {
            state.noted.retain(|(n, _)| *n != node);
            state.unverified.remove(&node);
        }
        state.open.insert(node, incarnation);
        state
            .noted
            .extend(extents.iter().map(|extent| (node, *extent)));
    }

    /// A change to `node`'s map failed part way: the database may have
    /// lost entries memory holds, so memory holds none of them any more
    /// (the next change to each extent adds it again: a superset).
    pub fn forget(&self, node: NodeId) {
        let mut state = self.lock();
        state.version += 1;
        state.noted.retain(|(n, _)| *n != node);
    }

    /// `node`'s map is closed and its entries removed, durably.
    pub fn closed(&self, node: NodeId) {
        let mut state = self.lock();
        state.version += 1;
        state.open.remove(&node);
        state.unverified.remove(&node);
        state.noted.retain(|(n, _)| *n != node);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_computed_before_a_close_are_not_remembered_after_it() {
        let maps = MissedMaps::default();
        maps.opened(NodeId(3), Incarnation(7), &[1], false);
        let needed = maps.needed(0, 2);
        assert_eq!(needed.entries, vec![(NodeId(3), 0), (NodeId(3), 2)]);
        maps.closed(NodeId(3));
        maps.flushed(needed);
        maps.opened(NodeId(3), Incarnation(7), &[], false);
        assert_eq!(maps.needed(0, 0).entries, vec![(NodeId(3), 0)]);
    }

    #[test]
    fn a_change_that_failed_part_way_forgets_what_memory_held() {
        let maps = MissedMaps::default();
        maps.opened(NodeId(3), Incarnation(7), &[1, 2], false);
        assert!(maps.needed(1, 2).entries.is_empty());
        let needed = maps.needed(0, 0);
        maps.forget(NodeId(3));
        maps.flushed(needed);
        assert_eq!(maps.open_of(NodeId(3)), Some(Incarnation(7)));
        assert_eq!(
            maps.needed(0, 2).entries,
            vec![(NodeId(3), 0), (NodeId(3), 1), (NodeId(3), 2)]
        );
    }

    #[test]
    fn the_unverified_range_only_shrinks_by_a_raise_and_only_grows_by_a_lower() {
        use Unverified::*;
        // No range yet: a lower makes one (and opens the map), a raise
        // does nothing.
        assert_eq!(Lower(0).apply(false, None), Some(Some(0)));
        assert_eq!(Lower(5).apply(true, None), Some(Some(5)));
        assert_eq!(Raise(9).apply(true, None), None);
        assert_eq!(Raise(9).apply(false, None), None);
        // A range: lowered further, raised further, never the other way.
        assert_eq!(Lower(3).apply(true, Some(5)), Some(Some(3)));
        assert_eq!(Lower(7).apply(true, Some(5)), None);
        assert_eq!(Raise(9).apply(true, Some(5)), Some(Some(9)));
        assert_eq!(Raise(2).apply(true, Some(5)), None);
    }

    #[test]
    fn open_records_round_trip_with_and_without_a_range() {
        for range in [None, Some(0), Some(1 << 40)] {
            let value = open_value(Incarnation(7), range);
            assert_eq!(decode_open(&value).unwrap(), (Incarnation(7), range));
        }
        assert!(decode_open(&[1, 2, 3]).is_err());
    }

    #[test]
    fn keys_round_trip_and_garbage_is_an_error() {
        let key = entry_key(NodeId(9), 1 << 40);
        assert_eq!(decode_entry(&key).unwrap(), (NodeId(9), 1 << 40));
        assert!(key.starts_with(&entry_prefix(NodeId(9))));
        assert!(decode_entry(&key[..16]).is_err());
        assert!(decode_entry(&open_key(NodeId(9))).is_err());
    }
}
