//! Which cluster and volume a store belongs to, and the shape of its copy:
//! the `identity` tree of the store's metadata.
//!
//! The identity is written once, when a store is created, and checked on
//! every open after that: a data dir of another cluster, another volume or
//! another extent size is refused with a clear error before anything in it
//! is touched (the store's "Identity" rule), so a node pointed at the wrong
//! dir can never serve, fence or change someone else's copy. The size is
//! the one field that changes afterwards, and only by a stamped growth
//! (see the store's "Growth" rule); an open never changes it.

use crate::replica::ReplicaError;
use crate::volume::DEFAULT_EXTENT_SIZE;

/// Which cluster and volume a store belongs to, and its shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreIdentity {
    /// The cluster's id; a node of another cluster is refused.
    pub cluster_id: String,
    /// The volume's name.
    pub volume: String,
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
            size: spec.size,
            extent_size: spec.extent_size,
        }
    }
}

impl StoreIdentity {
    /// An identity with the default extent size.
    pub fn new(cluster_id: impl Into<String>, volume: impl Into<String>, size: u64) -> Self {
        Self {
            cluster_id: cluster_id.into(),
            volume: volume.into(),
            size,
            extent_size: DEFAULT_EXTENT_SIZE,
        }
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
    let size = identity.size.to_be_bytes();
    let extent_size = identity.extent_size.to_be_bytes();
    let fields: [(&str, &[u8]); 4] = [
        ("cluster_id", identity.cluster_id.as_bytes()),
        ("volume", identity.volume.as_bytes()),
        ("size", &size),
        ("extent_size", &extent_size),
    ];
    crate::sled_ops::insert_all(tree, fields)?;
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
    if stored.extent_size != wanted.extent_size {
        return mismatch("extent size", &stored.extent_size, &wanted.extent_size);
    }
    Ok(())
}
