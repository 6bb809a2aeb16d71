//! The cluster's volume table: every volume's name, size, copy count,
//! `min_in_sync`, placement and Raft group, as the cluster group (group 0)
//! holds it in its control state (see `docs/design.md`, many volumes).
//!
//! Pure logic, so every node that applies the same requests computes the
//! same table:
//! - **Names** ([`check_name`]) are 1 to 63 characters of lower-case
//!   letters, digits, `-`, `_` and `.`, beginning with a letter or digit.
//!   `@` is never allowed: `VOL@SNAP` names a snapshot's export.
//! - **Sizes** are positive multiples of 512 bytes, at most
//!   [`MAX_VOLUME_SIZE`]. A volume only grows ([`VolumeTable::check_growth`],
//!   [`VolumeTable::grow`]), and the table records a size only after the
//!   volume's own group committed it (see `node::volumes::sizes`): the
//!   group's committed size is what is served; the table's follows it and
//!   is never larger.
//! - **Copies**: from 1 to the number of nodes; `min_in_sync` from 1 to
//!   the copy count.
//! - **Creation is idempotent by name**: creating a volume that exists
//!   with the same size, copies and `min_in_sync` is a success that
//!   changes nothing; with anything else it is refused.
//! - **Placement** ([`place`]) puts the copies on the nodes with the
//!   fewest copies, then the most free space, then the lowest id (copies
//!   first: volumes are sparse, so free space says little about what a
//!   node has promised, and a few bytes more free must not draw every
//!   volume to one node); a node without
//!   room for the volume, or whose room is not known (it did not answer),
//!   is never chosen. The room each node offered travels in the request,
//!   so applying it is deterministic.
//! - **Founders**: a volume records the members (node and incarnation,
//!   S8) its group is formed with. Every founder may form the group, with
//!   exactly that membership, so a creation that a node missed finishes
//!   when it comes back; a node of another incarnation (a replaced disk)
//!   is no founder and never forms it.
//! - **Groups**: each volume gets a Raft group id of its own, never
//!   reused. Group 0 is the cluster group, the one earlier builds ran; it
//!   also carries the cluster's first volume, the one the nodes' config
//!   names, as it always has. Other volumes' groups count from
//!   [`FIRST_NEW_GROUP`].
//! - **Preferred writers** ([`VolumeTable::preferred_writers`]): each
//!   volume has one node among its copies that should write it, so that
//!   every node writes about as many volumes as any other. Creation
//!   records it: the node of the placement preferred by the fewest
//!   volumes (then the lowest id). It stays put when other volumes come
//!   and go, so a deletion moves no writer (the counts may then differ by
//!   more than one). A volume recorded without one (made by the build
//!   before) gets the same rule's answer, in group order, after the
//!   recorded ones. The node balancer (`node::balance`) moves each writer
//!   towards it; nothing in the safety design depends on it.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::ids::{GroupId, MemberId, NodeId, VolumeId};

/// The largest volume: 64 TiB.
pub const MAX_VOLUME_SIZE: u64 = 64 << 40;

/// The longest volume name.
pub const MAX_NAME_LEN: usize = 63;

/// The group of the first volume created through the table (group 0 is
/// the cluster group: see the module docs).
pub const FIRST_NEW_GROUP: GroupId = GroupId(1);

/// What an operator asks for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRequest {
    /// The volume's name.
    pub name: String,
    /// Its size in bytes.
    pub size: u64,
    /// How many copies it has.
    pub copies: usize,
    /// How many copies must hold a write before it is acknowledged.
    pub min_in_sync: usize,
}

/// A volume of the table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeEntry {
    /// Its name.
    pub id: VolumeId,
    /// Its size in bytes.
    pub size: u64,
    /// How many copies it has.
    pub copies: usize,
    /// How many copies must hold a write before it is acknowledged.
    pub min_in_sync: usize,
    /// The nodes that hold its copies.
    pub placement: BTreeSet<NodeId>,
    /// The members its group was formed with (see the module docs).
    pub founders: BTreeSet<MemberId>,
    /// Its Raft group, whose leader is its writer and whose term its token.
    pub group: GroupId,
    /// The node that should write it (see the module docs); none in a
    /// table written by the build before this was recorded.
    #[serde(default)]
    pub preferred: Option<NodeId>,
}

/// What a member of the cluster offers to a volume's placement: its free
/// bytes, when it answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offer {
    /// The member (node and incarnation).
    pub member: MemberId,
    /// Free bytes in its data dir; none when it did not answer.
    pub free: Option<u64>,
}

/// What a node offers to placement, with the copies it holds already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRoom {
    /// Free bytes in its data dir.
    pub free: u64,
    /// How many copies it holds already.
    pub copies: usize,
}

/// Why the table refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TableError {
    /// The name breaks the naming rules; the message says which.
    #[error("bad volume name {name:?}: {why}")]
    BadName { name: String, why: &'static str },
    /// The size is zero, not a multiple of 512, or too large.
    #[error(
        "bad volume size {0}: a volume is a positive multiple of 512 bytes, at most {MAX_VOLUME_SIZE}"
    )]
    BadSize(u64),
    /// More copies than nodes, or none.
    #[error("{copies} copies asked for, but the cluster has {nodes} nodes (at least 1 copy)")]
    BadCopies { copies: usize, nodes: usize },
    /// `min_in_sync` outside 1 to the copy count.
    #[error("min_in_sync {min_in_sync} must be between 1 and the copy count {copies}")]
    BadMinInSync { min_in_sync: usize, copies: usize },
    /// Fewer nodes have room for the volume than it has copies.
    #[error("only {fit} nodes have room for {size} bytes; {copies} copies asked for")]
    NoRoom {
        size: u64,
        copies: usize,
        fit: usize,
    },
    /// A volume of that name exists with another size, copy count or
    /// `min_in_sync`.
    #[error("volume {0} exists with another size, copy count or min_in_sync")]
    Exists(VolumeId),
    /// No volume of that name.
    #[error("no volume {0}")]
    Unknown(VolumeId),
    /// A volume only grows.
    #[error(
        "volume {name} is {now} bytes; it cannot shrink to {asked} bytes (a volume only grows: \
         copy the data to a smaller volume instead)"
    )]
    Shrink {
        name: VolumeId,
        now: u64,
        asked: u64,
    },
    /// The volume of that name has another group now (deleted and created
    /// again): what was asked of the old one does not apply to it.
    #[error("volume {name} is of group {now} now, not of group {asked}")]
    OtherGroup {
        name: VolumeId,
        now: GroupId,
        asked: GroupId,
    },
    /// A move from a node that holds no copy of the volume.
    #[error("node {node} holds no copy of volume {name}")]
    NotPlaced { name: VolumeId, node: NodeId },
    /// A move to a node that holds a copy of the volume already.
    #[error("node {node} holds a copy of volume {name} already")]
    Placed { name: VolumeId, node: NodeId },
}

/// Checks that `size` is a size a volume may have (see the module docs).
pub fn check_size(size: u64) -> Result<u64, TableError> {
    match size == 0 || size % 512 != 0 || size > MAX_VOLUME_SIZE {
        true => Err(TableError::BadSize(size)),
        false => Ok(size),
    }
}

/// Checks `name` against the naming rules (see the module docs).
pub fn check_name(name: &str) -> Result<VolumeId, TableError> {
    let bad = |why| {
        Err(TableError::BadName {
            name: name.to_string(),
            why,
        })
    };
    let allowed = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || "-_.".contains(c);
    match name.chars().next() {
        None => return bad("it is empty"),
        Some(c) if !(c.is_ascii_lowercase() || c.is_ascii_digit()) => {
            return bad("it must begin with a lower-case letter or a digit");
        }
        Some(_) => {}
    }
    if name.len() > MAX_NAME_LEN {
        return bad("it is longer than 63 characters");
    }
    if !name.chars().all(allowed) {
        return bad("only lower-case letters, digits, '-', '_' and '.' are allowed");
    }
    Ok(VolumeId(name.to_string()))
}

/// The nodes for `copies` copies of a volume of `size` bytes: those with
/// the fewest copies, then the most free space, then the lowest id, among
/// the nodes with room for it.
pub fn place(
    nodes: &BTreeMap<NodeId, NodeRoom>,
    size: u64,
    copies: usize,
) -> Result<BTreeSet<NodeId>, TableError> {
    let mut fit: Vec<(NodeId, NodeRoom)> = nodes
        .iter()
        .filter(|(_, room)| room.free >= size)
        .map(|(id, room)| (*id, *room))
        .collect();
    if fit.len() < copies {
        return Err(TableError::NoRoom {
            size,
            copies,
            fit: fit.len(),
        });
    }
    fit.sort_by(|(a_id, a), (b_id, b)| {
        a.copies
            .cmp(&b.copies)
            .then(b.free.cmp(&a.free))
            .then(a_id.cmp(b_id))
    });
    Ok(fit.into_iter().take(copies).map(|(id, _)| id).collect())
}

/// The node of `placement` preferred by the fewest volumes so far, by
/// `load`; then the lowest id.
fn least_preferred(placement: &BTreeSet<NodeId>, load: &BTreeMap<NodeId, usize>) -> Option<NodeId> {
    placement
        .iter()
        .min_by_key(|node| (load.get(*node).copied().unwrap_or(0), **node))
        .copied()
}

/// How often each node appears in `nodes`.
fn count<'a>(nodes: impl Iterator<Item = &'a NodeId>) -> BTreeMap<NodeId, usize> {
    let mut counts = BTreeMap::new();
    for node in nodes {
        *counts.entry(*node).or_default() += 1;
    }
    counts
}

/// The volume table (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeTable {
    volumes: BTreeMap<VolumeId, VolumeEntry>,
    /// The group the next new volume gets (0 until the first: see
    /// [`FIRST_NEW_GROUP`]).
    next_group: u64,
}

impl VolumeTable {
    /// Creates the volume `request` asks for, placed over the members that
    /// made `offers` (every member of the cluster, one offer each); or, when
    /// it exists as asked, returns it unchanged. The flag says whether it
    /// was created now.
    pub fn create(
        &mut self,
        request: &VolumeRequest,
        offers: &[Offer],
    ) -> Result<(&VolumeEntry, bool), TableError> {
        let id = check_name(&request.name)?;
        if let Some(existing) = self.volumes.get(&id) {
            let same = existing.size == request.size
                && existing.copies == request.copies
                && existing.min_in_sync == request.min_in_sync;
            return match same {
                true => Ok((&self.volumes[&id], false)),
                false => Err(TableError::Exists(id)),
            };
        }
        let size = check_size(request.size)?;
        if request.copies == 0 || request.copies > offers.len() {
            return Err(TableError::BadCopies {
                copies: request.copies,
                nodes: offers.len(),
            });
        }
        if request.min_in_sync == 0 || request.min_in_sync > request.copies {
            return Err(TableError::BadMinInSync {
                min_in_sync: request.min_in_sync,
                copies: request.copies,
            });
        }
        let placement = place(&self.rooms(offers), size, request.copies)?;
        let founders = offers
            .iter()
            .map(|offer| offer.member)
            .filter(|member| placement.contains(&member.node()))
            .collect();
        let group = GroupId(self.next_group.max(FIRST_NEW_GROUP.0));
        self.next_group = group.0 + 1;
        let preferred = least_preferred(&placement, &self.writers_per_node());
        let entry = VolumeEntry {
            preferred,
            id: id.clone(),
            size,
            copies: request.copies,
            min_in_sync: request.min_in_sync,
            placement,
            founders,
            group,
        };
        Ok((self.volumes.entry(id).or_insert(entry), true))
    }

    /// Removes the volume `id` from the table, returning its entry.
    pub fn delete(&mut self, id: &VolumeId) -> Result<VolumeEntry, TableError> {
        self.volumes
            .remove(id)
            .ok_or_else(|| TableError::Unknown(id.clone()))
    }

    /// The volume `id`, if a growth to `size` bytes is one it may make:
    /// a size a volume may have, at least the one the table records (the
    /// same size again is no change, and allowed).
    pub fn check_growth(&self, id: &VolumeId, size: u64) -> Result<&VolumeEntry, TableError> {
        let entry = self
            .volumes
            .get(id)
            .ok_or_else(|| TableError::Unknown(id.clone()))?;
        check_size(size)?;
        match size < entry.size {
            true => Err(TableError::Shrink {
                name: id.clone(),
                now: entry.size,
                asked: size,
            }),
            false => Ok(entry),
        }
    }

    /// Records that volume `id` of group `group` grew to `size` bytes (its
    /// group committed it). Refused for another group's volume of that
    /// name, and below the recorded size; the same size again changes
    /// nothing. Returns the entry afterwards.
    pub fn grow(
        &mut self,
        id: &VolumeId,
        group: GroupId,
        size: u64,
    ) -> Result<&VolumeEntry, TableError> {
        let now = self.check_growth(id, size)?.group;
        if now != group {
            return Err(TableError::OtherGroup {
                name: id.clone(),
                now,
                asked: group,
            });
        }
        let entry = self
            .volumes
            .get_mut(id)
            .ok_or_else(|| TableError::Unknown(id.clone()))?;
        entry.size = size;
        Ok(entry)
    }

    /// Moves volume `id`'s copy from node `from` to node `to`, which
    /// offered `free` bytes (none: it did not say): the placement names
    /// `to` instead of `from`, and so does the preferred writer if it was
    /// `from`. The volume's group then follows (`node::placement`): `to`'s
    /// copy is added and rebuilt before `from`'s leaves. Asking again for
    /// a move that was made is a success that changes nothing.
    pub fn move_copy(
        &mut self,
        id: &VolumeId,
        from: NodeId,
        to: NodeId,
        free: Option<u64>,
    ) -> Result<&VolumeEntry, TableError> {
        let entry = self
            .volumes
            .get_mut(id)
            .ok_or_else(|| TableError::Unknown(id.clone()))?;
        let (has_from, has_to) = (
            entry.placement.contains(&from),
            entry.placement.contains(&to),
        );
        if has_to && !has_from {
            return Ok(entry);
        }
        let name = id.clone();
        if has_to {
            return Err(TableError::Placed { name, node: to });
        }
        if !has_from {
            return Err(TableError::NotPlaced { name, node: from });
        }
        if free.is_none_or(|free| free < entry.size) {
            return Err(TableError::NoRoom {
                size: entry.size,
                copies: 1,
                fit: 0,
            });
        }
        entry.placement.remove(&from);
        entry.placement.insert(to);
        // A node that held a copy must never form the group again (its
        // copy may be gone, and the group lives on without it).
        entry.founders.retain(|member| member.node() != from);
        if entry.preferred == Some(from) {
            entry.preferred = Some(to);
        }
        Ok(entry)
    }

    /// The volume `id`, if the table has it.
    pub fn get(&self, id: &VolumeId) -> Option<&VolumeEntry> {
        self.volumes.get(id)
    }

    /// Every volume, by name.
    pub fn volumes(&self) -> impl Iterator<Item = &VolumeEntry> {
        self.volumes.values()
    }

    /// Whether the table has no volume.
    pub fn is_empty(&self) -> bool {
        self.volumes.is_empty()
    }

    /// Whether the table has never had a volume: then, and only then, it
    /// need not be written down (a table emptied by deletions still knows
    /// which groups were given out, and must go on knowing it).
    pub fn is_pristine(&self) -> bool {
        self.volumes.is_empty() && self.next_group == 0
    }

    /// Whether group `group` was given to a volume of this table (now or
    /// before it was deleted).
    pub fn has_given(&self, group: GroupId) -> bool {
        group >= FIRST_NEW_GROUP && group.0 < self.next_group
    }

    /// The room of every member that offered some, with the copies it
    /// holds.
    fn rooms(&self, offers: &[Offer]) -> BTreeMap<NodeId, NodeRoom> {
        let copies = self.copies_per_node();
        offers
            .iter()
            .filter_map(|offer| {
                let node = offer.member.node();
                offer.free.map(|free| {
                    let copies = copies.get(&node).copied().unwrap_or(0);
                    (node, NodeRoom { free, copies })
                })
            })
            .collect()
    }

    /// The node that should write each volume (see the module docs).
    pub fn preferred_writers(&self) -> BTreeMap<VolumeId, NodeId> {
        let mut preferred: BTreeMap<VolumeId, NodeId> = self
            .volumes
            .values()
            .filter_map(|entry| Some((entry.id.clone(), entry.preferred?)))
            .collect();
        let mut load = count(preferred.values());
        let mut unrecorded: Vec<&VolumeEntry> = self
            .volumes
            .values()
            .filter(|entry| entry.preferred.is_none())
            .collect();
        unrecorded.sort_by_key(|entry| entry.group);
        for entry in unrecorded {
            if let Some(node) = least_preferred(&entry.placement, &load) {
                *load.entry(node).or_default() += 1;
                preferred.insert(entry.id.clone(), node);
            }
        }
        preferred
    }

    /// How many volumes prefer each node as their writer.
    pub fn writers_per_node(&self) -> BTreeMap<NodeId, usize> {
        count(self.preferred_writers().values())
    }

    /// How many copies each node holds.
    pub fn copies_per_node(&self) -> BTreeMap<NodeId, usize> {
        count(self.volumes.values().flat_map(|v| &v.placement))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    fn offers(free: &[(u64, u64)]) -> Vec<Offer> {
        free.iter()
            .map(|(id, gib)| Offer {
                member: MemberId::new(NodeId(*id), crate::ids::Incarnation(7)),
                free: Some(gib * GIB),
            })
            .collect()
    }

    fn nodes(free: &[(u64, u64)]) -> BTreeMap<NodeId, NodeRoom> {
        free.iter()
            .map(|(id, gib)| {
                (
                    NodeId(*id),
                    NodeRoom {
                        free: gib * GIB,
                        copies: 0,
                    },
                )
            })
            .collect()
    }

    fn request(name: &str, size: u64, copies: usize) -> VolumeRequest {
        VolumeRequest {
            name: name.into(),
            size,
            copies,
            min_in_sync: 2.min(copies),
        }
    }

    #[test]
    fn names_follow_the_rules_and_say_what_is_wrong() {
        for good in ["vol0", "db-1", "a", "9.x_y", &"a".repeat(63)] {
            assert!(check_name(good).is_ok(), "{good}");
        }
        for (bad, why) in [
            ("", "empty"),
            ("-x", "begin"),
            ("Vol", "begin"),
            ("vol@snap", "allowed"),
            ("a/b", "allowed"),
            ("vÖl", "allowed"),
            (&"a".repeat(64), "longer"),
        ] {
            let err = check_name(bad).unwrap_err().to_string();
            assert!(err.contains(why), "{bad:?}: {err}");
        }
    }

    #[test]
    fn creation_is_idempotent_by_name_and_refuses_a_different_volume_of_that_name() {
        let mut table = VolumeTable::default();
        let cluster = offers(&[(1, 100), (2, 100), (3, 100)]);
        let (first, created) = table.create(&request("db", GIB, 3), &cluster).unwrap();
        let first = first.clone();
        assert!(created);
        assert_eq!(first.group, FIRST_NEW_GROUP);
        let (again, created) = table.create(&request("db", GIB, 3), &cluster).unwrap();
        assert!(!created);
        assert_eq!(*again, first);
        assert_eq!(
            table.create(&request("db", 2 * GIB, 3), &cluster),
            Err(TableError::Exists(VolumeId("db".into())))
        );
        assert_eq!(table.volumes().count(), 1);
    }

    #[test]
    fn bad_sizes_and_copy_counts_are_refused_and_change_nothing() {
        let mut table = VolumeTable::default();
        let cluster = offers(&[(1, 100), (2, 100), (3, 100)]);
        for size in [0, 1000, MAX_VOLUME_SIZE + 512] {
            let refused = table.create(&request("v", size, 3), &cluster);
            assert_eq!(refused, Err(TableError::BadSize(size)));
        }
        let refused = table.create(&request("v", GIB, 4), &cluster);
        assert!(matches!(refused, Err(TableError::BadCopies { .. })));
        let refused = table.create(&request("v", GIB, 0), &cluster);
        assert!(matches!(refused, Err(TableError::BadCopies { .. })));
        let mut too_strict = request("v", GIB, 2);
        too_strict.min_in_sync = 3;
        let refused = table.create(&too_strict, &cluster);
        assert!(matches!(refused, Err(TableError::BadMinInSync { .. })));
        let refused = table.create(&request("v", 200 * GIB, 3), &cluster);
        assert!(matches!(refused, Err(TableError::NoRoom { fit: 0, .. })));
        assert_eq!(table, VolumeTable::default());
    }

    #[test]
    fn a_volume_grows_only_in_its_own_group_and_never_shrinks() {
        let mut table = VolumeTable::default();
        let cluster = offers(&[(1, 100), (2, 100), (3, 100)]);
        table.create(&request("db", GIB, 3), &cluster).unwrap();
        let db = VolumeId("db".into());
        let group = FIRST_NEW_GROUP;
        // Refusals, each with its own error, changing nothing.
        let refused = |table: &mut VolumeTable, name: &str, group, size| {
            table.grow(&VolumeId(name.into()), group, size).unwrap_err()
        };
        assert_eq!(
            refused(&mut table, "zz", group, 2 * GIB),
            TableError::Unknown(VolumeId("zz".into()))
        );
        for size in [0, 2 * GIB + 1000, MAX_VOLUME_SIZE + 512] {
            assert_eq!(
                refused(&mut table, "db", group, size),
                TableError::BadSize(size)
            );
        }
        let shrink = refused(&mut table, "db", group, GIB / 2);
        assert!(shrink.to_string().contains("cannot shrink"), "{shrink}");
        let other = refused(&mut table, "db", GroupId(9), 2 * GIB);
        assert!(matches!(other, TableError::OtherGroup { .. }), "{other}");
        assert_eq!(table.get(&db).unwrap().size, GIB);
        // The same size is no change; a larger one is recorded, and up to
        // the largest volume is allowed.
        assert_eq!(table.grow(&db, group, GIB).unwrap().size, GIB);
        assert_eq!(table.grow(&db, group, 2 * GIB).unwrap().size, 2 * GIB);
        assert!(table.check_growth(&db, 2 * GIB).is_ok());
        assert!(table.check_growth(&db, MAX_VOLUME_SIZE).is_ok());
        assert_eq!(table.get(&db).unwrap().size, 2 * GIB);
    }

    #[test]
    fn copies_go_to_the_nodes_with_fewest_copies_then_most_room() {
        let mut cluster = nodes(&[(1, 50), (2, 80), (3, 80), (4, 90), (5, 10)]);
        assert_eq!(
            place(&cluster, GIB, 3).unwrap(),
            [NodeId(2), NodeId(3), NodeId(4)].into()
        );
        // Equal copies and room (nodes 2 and 3): the lower id.
        assert_eq!(
            place(&cluster, GIB, 2).unwrap(),
            [NodeId(2), NodeId(4)].into()
        );
        // Fewer copies outweigh more room.
        cluster.get_mut(&NodeId(4)).unwrap().copies = 1;
        cluster.get_mut(&NodeId(2)).unwrap().copies = 1;
        assert_eq!(
            place(&cluster, GIB, 2).unwrap(),
            [NodeId(1), NodeId(3)].into()
        );
        // A node without room for the volume is never chosen.
        assert_eq!(
            place(&cluster, 60 * GIB, 3).unwrap(),
            [NodeId(2), NodeId(3), NodeId(4)].into()
        );
        assert!(place(&cluster, 85 * GIB, 2).is_err());
    }

    #[test]
    fn every_volume_gets_a_group_of_its_own_never_reused() {
        let mut table = VolumeTable::default();
        let cluster = offers(&[(1, 100), (2, 100), (3, 100)]);
        let group = |table: &mut VolumeTable, name| {
            table
                .create(&request(name, GIB, 3), &cluster)
                .unwrap()
                .0
                .group
        };
        let a = group(&mut table, "a");
        let b = group(&mut table, "b");
        table.delete(&VolumeId("a".into())).unwrap();
        let c = group(&mut table, "a");
        assert_eq!((a, b, c), (GroupId(1), GroupId(2), GroupId(3)));
        assert_eq!(
            table.delete(&VolumeId("zz".into())),
            Err(TableError::Unknown(VolumeId("zz".into())))
        );
        assert_eq!(table.copies_per_node()[&NodeId(1)], 2);
    }

    #[test]
    fn founders_are_the_placed_members_and_a_silent_node_is_never_placed() {
        let mut table = VolumeTable::default();
        let mut cluster = offers(&[(1, 100), (2, 90), (3, 80), (4, 200)]);
        cluster[3].free = None;
        let (entry, _) = table.create(&request("db", GIB, 3), &cluster).unwrap();
        assert_eq!(entry.placement, [NodeId(1), NodeId(2), NodeId(3)].into());
        assert_eq!(
            entry.founders,
            cluster[..3].iter().map(|offer| offer.member).collect()
        );
        // Four members, but only three answered: a fourth copy has no room.
        let refused = table.create(&request("wide", GIB, 4), &cluster);
        assert!(matches!(refused, Err(TableError::NoRoom { fit: 3, .. })));
    }

    #[test]
    fn copies_spread_evenly_over_nodes_of_equal_room() {
        let mut table = VolumeTable::default();
        let cluster = offers(&[(1, 100), (2, 100), (3, 100), (4, 100), (5, 100)]);
        for n in 0..10 {
            table
                .create(&request(&format!("v{n}"), GIB, 3), &cluster)
                .unwrap();
        }
        // 30 copies over 5 nodes: 6 each, at most ceil(3V/5) + 1.
        let counts = table.copies_per_node();
        assert!(counts.values().all(|&c| c == 6), "{counts:?}");
    }

    #[test]
    fn preferred_writers_spread_evenly_and_each_holds_a_copy() {
        for (nodes, volumes) in [(3, 64), (5, 40), (5, 7), (4, 9)] {
            let mut table = VolumeTable::default();
            let room: Vec<(u64, u64)> = (1..=nodes).map(|id| (id, 1000)).collect();
            let cluster = offers(&room);
            for n in 0..volumes {
                table
                    .create(&request(&format!("v{n}"), GIB, 3), &cluster)
                    .unwrap();
            }
            let preferred = table.preferred_writers();
            assert_eq!(preferred.len(), volumes);
            for (id, node) in &preferred {
                assert!(table.get(id).unwrap().placement.contains(node), "{id}");
            }
            let counts = table.writers_per_node();
            let (least, most) = (counts.values().min(), counts.values().max());
            assert_eq!(counts.len() as u64, nodes, "{counts:?}");
            assert!(
                most.unwrap() - least.unwrap() <= 1,
                "{nodes}x{volumes}: {counts:?}"
            );
        }
    }

    #[test]
    fn a_copy_moves_once_to_a_node_with_room_and_takes_the_preference_along() {
        let mut table = VolumeTable::default();
        let cluster = offers(&[(1, 100), (2, 100), (3, 100), (4, 100)]);
        table.create(&request("db", GIB, 3), &cluster).unwrap();
        let db = VolumeId("db".into());
        let before = table.get(&db).unwrap().clone();
        assert_eq!(before.placement, [NodeId(1), NodeId(2), NodeId(3)].into());
        assert_eq!(before.preferred, Some(NodeId(1)));
        let no_room = table.move_copy(&db, NodeId(1), NodeId(4), Some(GIB - 512));
        assert!(matches!(no_room, Err(TableError::NoRoom { .. })));
        let silent = table.move_copy(&db, NodeId(1), NodeId(4), None);
        assert!(matches!(silent, Err(TableError::NoRoom { .. })));
        let moved = table
            .move_copy(&db, NodeId(1), NodeId(4), Some(GIB))
            .unwrap();
        assert_eq!(moved.placement, [NodeId(2), NodeId(3), NodeId(4)].into());
        assert_eq!(moved.preferred, Some(NodeId(4)));
        assert_eq!(moved.group, before.group);
        let left: BTreeSet<_> = before
            .founders
            .iter()
            .filter(|m| m.node() != NodeId(1))
            .copied()
            .collect();
        assert_eq!(moved.founders, left);
        // Asked again: done already.
        let again = table.move_copy(&db, NodeId(1), NodeId(4), None).unwrap();
        assert_eq!(again.placement, [NodeId(2), NodeId(3), NodeId(4)].into());
        let placed = table.move_copy(&db, NodeId(2), NodeId(3), Some(GIB));
        assert!(matches!(placed, Err(TableError::Placed { .. })));
        let absent = table.move_copy(&db, NodeId(1), NodeId(5), Some(GIB));
        assert!(matches!(absent, Err(TableError::NotPlaced { .. })));
        let unknown = table.move_copy(&VolumeId("x".into()), NodeId(2), NodeId(1), Some(GIB));
        assert!(matches!(unknown, Err(TableError::Unknown(_))));
    }

    #[test]
    fn a_deletion_moves_no_other_writer_and_new_volumes_fill_the_gap() {
        let mut table = VolumeTable::default();
        let cluster = offers(&[(1, 100), (2, 100), (3, 100)]);
        let create = |table: &mut VolumeTable, n: usize| {
            table
                .create(&request(&format!("v{n}"), GIB, 3), &cluster)
                .unwrap();
        };
        for n in 0..12 {
            create(&mut table, n);
        }
        let before = table.preferred_writers();
        for n in [0, 3, 6, 9] {
            table.delete(&VolumeId(format!("v{n}"))).unwrap();
        }
        let after = table.preferred_writers();
        assert!(after.iter().all(|(id, node)| before[id] == *node));
        // The four deleted all preferred node 1; the next volumes go there.
        for n in 12..16 {
            create(&mut table, n);
        }
        let counts = table.writers_per_node();
        assert!(counts.values().all(|&c| c == 4), "{counts:?}");
    }

    #[test]
    fn volumes_recorded_without_a_preference_get_one_after_the_recorded() {
        let mut table = VolumeTable::default();
        let cluster = offers(&[(1, 100), (2, 100), (3, 100)]);
        for n in 0..6 {
            table
                .create(&request(&format!("v{n}"), GIB, 3), &cluster)
                .unwrap();
        }
        // As the build before wrote them: no preference recorded.
        let mut old = table.clone();
        for entry in old.volumes.values_mut().filter(|e| e.group.0 % 2 == 0) {
            entry.preferred = None;
        }
        let counts = old.writers_per_node();
        assert!(counts.values().all(|&c| c == 2), "{counts:?}");
        assert_eq!(old.clone().preferred_writers(), old.preferred_writers());
    }
}
