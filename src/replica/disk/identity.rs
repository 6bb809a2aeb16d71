//! Which cluster and volume a store belongs to, and the shape of its copy:
//! the `identity` tree of the store's metadata.
//!
//! The identity is written once, when a store is created, and checked on
//! every open after that: a data dir of another cluster, another volume,
//! another Raft group or another extent size is refused with a clear error
//! before anything in it is touched (the store's "Identity" rule), so a
//! node pointed at the wrong dir can never serve, fence or change someone
//! else's copy. The size is the one field that changes afterwards, and
//! only by a stamped growth (see the store's "Growth" rule); an open never
//! changes it.
//!
//! A volume is (cluster, name, group): a name is reused once its volume is
//! deleted, and the new volume has a new group whose terms start low, so
//! the fence floor of one group's copy says nothing about another group's
//! writers (S2). The group is recorded only when it is not 0, so a store
//! written before groups (the configured volume, group 0) reads as group 0
//! and a group-0 store is written as it always was.

use crate::ids::GroupId;
use crate::replica::ReplicaError;
use crate::volume::DEFAULT_EXTENT_SIZE;

/// The identity field of the volume's Raft group; absent means group 0.
const GROUP_KEY: &str = "group";

/// Which cluster, volume and Raft group a store belongs to, and its shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreIdentity {
    /// The cluster's id; a node of another cluster is refused.
    pub cluster_id: String,
    /// The volume's name.
    pub volume: String,
    /// The volume's Raft group: its writer's terms are this group's.
    pub group: GroupId,
    /// The volume's size in bytes (a multiple of 512).
    pub size: u64,
    /// The granularity of dirty tracking in bytes (a power of two).
    pub extent_size: u64,
}

impl From<&crate::volume::VolumeSpec> for StoreIdentity {
    fn from(spec: &crate::volume::VolumeSpec) -> Self {
        Self {
            cluster_id: spec.cluster_id.clone(),
            volume: spec.name.clone(),
            group: spec.group,
            size: spec.size,
            extent_size: spec.extent_size,
        }
    }
}

impl StoreIdentity {
    /// An identity of group 0 with the default extent size.
    pub fn new(cluster_id: impl Into<String>, volume: impl Into<String>, size: u64) -> Self {
        Self {
            cluster_id: cluster_id.into(),
            volume: volume.into(),
            group: GroupId::FIRST,
            size,
            extent_size: DEFAULT_EXTENT_SIZE,
        }
    }

    /// The same identity, of Raft group `group`.
    pub fn in_group(self, group: GroupId) -> Self {
        Self { group, ..self }
    }

    pub(super) fn validate(&self) -> Result<(), ReplicaError> {
        let bad = |why: String| Err(ReplicaError::InvalidIdentity(why));
        if self.cluster_id.is_empty() {
            return bad("the cluster id is empty".into());
        }
        if self.volume.is_empty() {
            return bad("the volume name is empty".into());
        }
        if self.size == 0 || self.size % 512 != 0 {
            return bad(format!(
                "the volume size {} is not a positive multiple of 512",
                self.size
            ));
        }
        if !self.extent_size.is_power_of_two() || self.extent_size < 4096 {
            return bad(format!(
                "the extent size {} is not a power of two of at least 4096",
                self.extent_size
            ));
        }
        Ok(())
    }
}

/// The identity field `key`, decoded by `decode`, if it is there.
fn identity_field<T>(
    tree: &sled::Tree,
    key: &str,
    decode: impl FnOnce(&[u8]) -> Option<T>,
) -> Result<Option<T>, ReplicaError> {
    tree.get(key)?
        .map(|v| {
            decode(&v).ok_or_else(|| ReplicaError::Io(format!("corrupt identity field {key}")))
        })
        .transpose()
}

pub(super) fn read_identity(tree: &sled::Tree) -> Result<Option<StoreIdentity>, ReplicaError> {
    let text = |key| identity_field(tree, key, |v| String::from_utf8(v.to_vec()).ok());
    let number = |key| {
        identity_field(tree, key, |v| {
            <[u8; 8]>::try_from(v).ok().map(u64::from_be_bytes)
        })
    };
    match (
        text("cluster_id")?,
        text("volume")?,
        number("size")?,
        number("extent_size")?,
    ) {
        (Some(cluster_id), Some(volume), Some(size), Some(extent_size)) => {
            Ok(Some(StoreIdentity {
                cluster_id,
                volume,
                group: number(GROUP_KEY)?.map_or(GroupId::FIRST, GroupId),
                size,
                extent_size,
            }))
        }
        (None, None, None, None) => Ok(None),
        _ => Err(ReplicaError::Io("incomplete identity metadata".into())),
    }
}

pub(super) fn write_identity(
    tree: &sled::Tree,
    identity: &StoreIdentity,
) -> Result<(), ReplicaError> {
    let group = identity.group.0.to_be_bytes();
    let size = identity.size.to_be_bytes();
    let extent_size = identity.extent_size.to_be_bytes();
    // The group goes first: an identity cut short before the others were
    // written reads as no identity at all, never as group 0's.
    let group_field = (identity.group != GroupId::FIRST).then_some((GROUP_KEY, &group[..]));
    let fields: [(&str, &[u8]); 4] = [
        ("cluster_id", identity.cluster_id.as_bytes()),
        ("volume", identity.volume.as_bytes()),
        ("size", &size),
        ("extent_size", &extent_size),
    ];
    crate::sled_ops::insert_all(tree, group_field.into_iter().chain(fields))?;
    Ok(())
}

pub(super) fn check_identity(
    stored: &StoreIdentity,
    wanted: &StoreIdentity,
) -> Result<(), ReplicaError> {
    let mismatch = |field: &str, have: &dyn std::fmt::Display, want: &dyn std::fmt::Display| {
        Err(ReplicaError::IdentityMismatch(format!(
            "the data dir holds {field} {have}, the configuration says {want}"
        )))
    };
    if stored.cluster_id != wanted.cluster_id {
        return mismatch("cluster id", &stored.cluster_id, &wanted.cluster_id);
    }
    if stored.volume != wanted.volume {
        return mismatch("volume", &stored.volume, &wanted.volume);
    }
    if stored.group != wanted.group {
        return Err(ReplicaError::IdentityMismatch(format!(
            "the data dir holds volume {:?} of group {}, the configuration says group {} \
             (a volume of the same name in another group is another volume)",
            stored.volume, stored.group, wanted.group
        )));
    }
    if stored.extent_size != wanted.extent_size {
        return mismatch("extent size", &stored.extent_size, &wanted.extent_size);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree() -> sled::Tree {
        let db = sled::Config::new().temporary(true).open().unwrap();
        db.open_tree("identity").unwrap()
    }

    /// A store written before groups (the configured volume's) has no group
    /// field: it reads as group 0.
    #[test]
    fn a_store_written_without_a_group_reads_as_group_zero() {
        let tree = tree();
        let fields: [(&str, &[u8]); 4] = [
            ("cluster_id", b"c1"),
            ("volume", b"vol0"),
            ("size", &(1u64 << 20).to_be_bytes()),
            ("extent_size", &DEFAULT_EXTENT_SIZE.to_be_bytes()),
        ];
        crate::sled_ops::insert_all(&tree, fields).unwrap();
        let stored = read_identity(&tree).unwrap().unwrap();
        assert_eq!(stored.group, GroupId::FIRST);
        assert_eq!(stored, StoreIdentity::new("c1", "vol0", 1 << 20));
        check_identity(&stored, &StoreIdentity::new("c1", "vol0", 1 << 20)).unwrap();
    }

    /// A group-0 store is written as before groups; another group's
    /// records its group, and reads back with it.
    #[test]
    fn only_a_group_other_than_zero_is_recorded() {
        let zero = tree();
        write_identity(&zero, &StoreIdentity::new("c1", "vol0", 1 << 20)).unwrap();
        assert_eq!(zero.get(GROUP_KEY).unwrap(), None);
        assert_eq!(zero.len(), 4);
        let two = tree();
        let identity = StoreIdentity::new("c1", "db", 1 << 20).in_group(GroupId(2));
        write_identity(&two, &identity).unwrap();
        assert_eq!(read_identity(&two).unwrap(), Some(identity));
    }
}
