//! The block-device seam.
//!
//! [`Device`] is the one interface of the data path: the NBD server calls it,
//! the write gate ([`crate::ha::ActiveDevice`]) implements it in front of the
//! engine, and the engine ([`crate::replica::mirror::engine::Engine`]) implements it over the
//! replicas. Every layer of the write path speaks it, so each can be tested
//! alone and stacked without adapters.
//!
//! Requests are validated in one place, [`check_request`], so the engine and
//! every replica agree on what is in range: an offset plus length beyond the
//! volume, or a request larger than [`MAX_REQUEST`], is refused before any
//! byte is written.
//!
//! [`VolumeSpec`] is the one description of a volume (cluster, name, size,
//! extent size, `min_in_sync`, Raft group): the store, the engine and the
//! fencer are built from it, and the Raft state records the cluster's. A
//! volume's identity is its cluster, name *and* group: names are reused
//! after a delete, and a term is a fencing token only within its own group
//! (S2), so a writer of a deleted volume must never pass for the writer of
//! a new one of the same name.
//!
//! [`Device::access`] says what a client connecting now may do: read and
//! write under the gate's term, only read, or nothing. The NBD server binds a
//! read-write session to that term and ends the session once the device no
//! longer grants it (design C1).
//!
//! [`Device::change`] is a write, discard or flush made on behalf of a
//! [`Bond`]: the client session it came from and the writer's term it was
//! admitted under. The write gate holds a request the in-sync set cannot
//! take yet (C2) only while its bond holds; once the session ended or the
//! term changed it abandons the request ([`DeviceError::Abandoned`]) before
//! it is sent again, so a request the client has given up on and sent
//! again never lands after what the client wrote since (C1, S3).

use async_trait::async_trait;
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

use crate::ids::{GroupId, NodeId, Term};

/// The largest single read or write, in bytes (32 MiB). NBD clients split
/// larger transfers; a bigger request is refused with [`RangeError::TooLarge`].
pub const MAX_REQUEST: u64 = 32 * 1024 * 1024;

/// The granularity of dirty tracking, digests and rebuild copies, unless a
/// volume says otherwise.
pub const DEFAULT_EXTENT_SIZE: u64 = 1024 * 1024;

/// What a volume is; see the module docs. A node builds its store, engine
/// and fencer from the spec of its own configuration; the first leader
/// records that spec in the Raft state, and a node whose spec differs from
/// the recorded one refuses to run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeSpec {
    /// The cluster's id.
    pub cluster_id: String,
    /// The volume's name.
    #[serde(rename = "volume")]
    pub name: String,
    /// The size in bytes.
    pub size: u64,
    /// The granularity of dirty tracking in bytes (a power of two). Volumes
    /// recorded before it was part of the spec have the default.
    #[serde(default = "default_extent_size")]
    pub extent_size: u64,
    /// The fewest in-sync replicas a write may be acknowledged on.
    pub min_in_sync: usize,
    /// The Raft group whose leader is the volume's writer and whose term
    /// its fencing token. A name can be reused once its volume is deleted,
    /// and terms of different groups are not comparable, so the group is
    /// part of the volume's identity (with the cluster and the name).
    /// Group 0 (the cluster group, whose volume is the configured one) is
    /// not written, so specs recorded before groups read as group 0 and a
    /// group-0 spec serialises as it always has.
    #[serde(default, skip_serializing_if = "is_group_zero")]
    pub group: GroupId,
}

fn is_group_zero(group: &GroupId) -> bool {
    *group == GroupId::FIRST
}

fn default_extent_size() -> u64 {
    DEFAULT_EXTENT_SIZE
}

impl VolumeSpec {
    /// A volume with the default extent size.
    pub fn new(
        cluster_id: impl Into<String>,
        name: impl Into<String>,
        size: u64,
        min_in_sync: usize,
    ) -> Self {
        Self {
            cluster_id: cluster_id.into(),
            name: name.into(),
            size,
            extent_size: DEFAULT_EXTENT_SIZE,
            min_in_sync,
            group: GroupId::FIRST,
        }
    }

    /// The same volume, of Raft group `group`.
    pub fn in_group(self, group: GroupId) -> Self {
        Self { group, ..self }
    }
}

/// A block device: positioned reads and writes over a fixed size.
///
/// Implementations must be safe to call concurrently; ordering between
/// overlapping concurrent writes is the caller's business, as with any disk.
#[async_trait]
pub trait Device: Send + Sync {
    /// Reads `len` bytes at `offset`.
    async fn read_at(&self, offset: u64, len: u64) -> Result<Bytes, DeviceError>;

    /// Writes `data` at `offset`. With `fua`, the write is durable when this
    /// returns Ok (force unit access); without it, only after a [`flush`].
    ///
    /// [`flush`]: Device::flush
    async fn write_at(&self, offset: u64, data: Bytes, fua: bool) -> Result<(), DeviceError>;

    /// Discards `[offset, offset + len)` (any length within the volume): it
    /// reads back as zeroes and its space is freed. Durable like a write
    /// without FUA: after a [`flush`].
    ///
    /// [`flush`]: Device::flush
    async fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError>;

    /// Makes every write that returned Ok before this call durable.
    async fn flush(&self) -> Result<(), DeviceError>;

    /// A write, discard or flush on behalf of `bond` (see the module
    /// docs). Every device says what it does with the bond, so none can
    /// drop it by omission: a device that holds requests keeps to it, a
    /// wrapper passes it on, and one that neither holds nor wraps runs the
    /// change once ([`Change::run_once`]), which keeps any bond.
    async fn change(&self, change: Change, bond: &Bond) -> Result<(), DeviceError>;

    /// The size of the device in bytes.
    fn size(&self) -> u64;

    /// Which parts of `[offset, offset + len)` hold data and which are
    /// holes (read as zeroes, hold no space): extents in order, covering
    /// the range. Gated like a read. The default knows of no holes.
    async fn allocation(&self, offset: u64, len: u64) -> Result<Vec<Extent>, DeviceError> {
        crate::volume::check_span(offset, len, self.size())?;
        Ok(vec![Extent { len, hole: false }])
    }

    /// Whether a write would be admitted now. Advisory — every write is
    /// still checked when it is made — and used to offer clients a
    /// read-only or a writable export.
    fn is_writable(&self) -> bool {
        true
    }

    /// What a client connecting now may do (see [`Access`]). Advisory like
    /// [`Device::is_writable`]; an ungated device grants writes under term 0.
    fn access(&self) -> Access {
        if self.is_writable() {
            Access::ReadWrite { term: Term::ZERO }
        } else {
            Access::ReadOnly
        }
    }
}

/// What a request that changes the volume is bound to (see the module
/// docs): the writer's term it may run under, and whether the session that
/// sent it still stands. The default binds a request to the term of its
/// first admission only.
#[derive(Clone, Default)]
pub struct Bond {
    term: Option<Term>,
    ended: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
}

impl std::fmt::Debug for Bond {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bond")
            .field("term", &self.term)
            .field("ended", &self.ended())
            .finish()
    }
}

impl Bond {
    /// A request of a session bound to `term` (if it is writable), which
    /// stands until `ended` says it ended.
    pub fn session(term: Option<Term>, ended: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        Self {
            term,
            ended: Some(Arc::new(ended)),
        }
    }

    /// The term the request may run under, if its session names one.
    pub fn term(&self) -> Option<Term> {
        self.term
    }

    /// Whether the session the request came from has ended.
    pub fn ended(&self) -> bool {
        self.ended.as_ref().is_some_and(|ended| ended())
    }
}

/// A request that changes the volume, as [`Device::change`] takes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// [`Device::write_at`].
    Write { offset: u64, data: Bytes, fua: bool },
    /// [`Device::discard`].
    Discard { offset: u64, len: u64 },
    /// [`Device::flush`].
    Flush,
}

impl Change {
    /// Runs the change once on `device`, for a device that holds nothing
    /// and wraps nothing: a single try keeps any bond.
    pub async fn run_once<D: Device + ?Sized>(self, device: &D) -> Result<(), DeviceError> {
        match self {
            Change::Write { offset, data, fua } => device.write_at(offset, data, fua).await,
            Change::Discard { offset, len } => device.discard(offset, len).await,
            Change::Flush => device.flush().await,
        }
    }
}

/// The most runs one allocation query returns (the protocol suggests at
/// most 2^20 descriptors a reply; fewer keep a reply within 512 KiB). A
/// query that meets more answers for the part it covered.
pub const MAX_RUNS: u64 = 1 << 16;

/// A run of the volume that is all data or all hole (see
/// [`Device::allocation`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Its length in bytes.
    pub len: u64,
    /// It holds no data: it reads as zeroes.
    pub hole: bool,
}

/// Checks that `[offset, offset + len)` lies within a volume of `size`
/// bytes (any length: an allocation query is not a transfer).
pub fn check_span(offset: u64, len: u64, size: u64) -> Result<(), RangeError> {
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(RangeError::OutOfRange { offset, len, size }),
    }
}

/// What a device grants a client now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    /// Reads and writes; writes pass the gate under `term`. A session opened
    /// so is valid only while the device still grants exactly this.
    ReadWrite { term: Term },
    /// Reads only: this node is passive and its copy may be read.
    ReadOnly,
    /// Neither: reads are refused, for this reason.
    Refused(DeviceError),
}

/// Why a request's shape is refused. Shared by every layer so they agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    /// `offset + len` reaches past the end of the volume.
    #[error("request of {len} bytes at offset {offset} is beyond the volume size {size}")]
    OutOfRange { offset: u64, len: u64, size: u64 },
    /// The request is larger than [`MAX_REQUEST`].
    #[error("request of {len} bytes exceeds the maximum of {max} bytes")]
    TooLarge { len: u64, max: u64 },
}

/// Checks that a request of `len` bytes at `offset` fits a volume of `size`
/// bytes and the per-request limit.
pub fn check_request(offset: u64, len: u64, size: u64) -> Result<(), RangeError> {
    if len > MAX_REQUEST {
        return Err(RangeError::TooLarge {
            len,
            max: MAX_REQUEST,
        });
    }
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(RangeError::OutOfRange { offset, len, size }),
    }
}

/// Everything that can go wrong on the data path, as the NBD server sees it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// The write gate is closed: this node is not the active writer.
    #[error("not the active writer (not leader)")]
    NotLeader,
    /// The gate is open but its lease deadline has passed (S4).
    #[error("the writer's lease has expired")]
    LeaseExpired,
    /// The request's shape is refused.
    #[error(transparent)]
    Range(#[from] RangeError),
    /// A replica has seen a newer writer: this writer is fenced (S2).
    #[error("stale term {term}: a replica's fence floor is {floor}")]
    StaleTerm { term: Term, floor: Term },
    /// Too few replicas acknowledged to meet `min_in_sync` (S5).
    #[error("only {have} in-sync replicas acknowledged, at least {need} are required")]
    InsufficientReplicas { have: usize, need: usize },
    /// The in-sync set could not be shrunk (the write is not acknowledged).
    #[error("could not commit the in-sync change: {0}")]
    InSyncCommit(String),
    /// A replica failed the write while its return to the in-sync set was
    /// being committed, so the write may not be acknowledged (S5) until
    /// that return is settled one way or the other.
    #[error("replica {0} failed the write while rejoining the in-sync set")]
    Rejoining(NodeId),
    /// No replica could serve a read.
    #[error("no in-sync replica could serve the read: {0}")]
    NoReadableReplica(String),
    /// The engine has no active term.
    #[error("the engine is not active")]
    Inactive,
    /// A passive node's own replica is outside the committed in-sync set, so
    /// its copy may lack acknowledged writes: reads are refused.
    #[error("reads refused: this node's replica is not in the committed in-sync set")]
    NotInSync,
    /// A local I/O error.
    #[error("I/O error: {0}")]
    Io(String),
    /// A held request whose session ended, or whose writer's term
    /// changed, before it could be sent again (see [`Bond`]): it was not
    /// applied by this attempt, and gets no reply (C1).
    #[error("abandoned: its session ended or the writer's term changed while it was held")]
    Abandoned,
    /// The writer behind `attach` answered with this NBD error number.
    #[error("the writer answered with NBD error {errno}")]
    Remote { errno: u32 },
}

impl DeviceError {
    /// Whether the request failed only because the in-sync set cannot take
    /// it right now: too few members, a change of the set that did not
    /// commit, or a replica's return still being settled. Nothing is wrong
    /// with the request or the data, and sending it again is safe, so the
    /// write gate holds it and tries again (design C2) instead of failing
    /// it.
    pub fn is_replica_shortfall(&self) -> bool {
        matches!(
            self,
            DeviceError::InsufficientReplicas { .. }
                | DeviceError::InSyncCommit(_)
                | DeviceError::Rejoining(_)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Specs recorded by earlier builds (in Raft logs, snapshots, state)
    /// name no group: they read as group 0, and a group-0 spec is written
    /// back as the same text, byte for byte.
    #[test]
    fn a_spec_recorded_without_a_group_is_group_zero_and_round_trips_byte_identical() {
        let old =
            r#"{"cluster_id":"c","volume":"v","size":4096,"extent_size":1048576,"min_in_sync":2}"#;
        let spec: VolumeSpec = serde_json::from_str(old).unwrap();
        assert_eq!(spec.group, GroupId::FIRST);
        assert_eq!(spec, VolumeSpec::new("c", "v", 4096, 2));
        assert_eq!(serde_json::to_string(&spec).unwrap(), old);
    }

    #[test]
    fn a_spec_of_another_group_records_its_group() {
        let spec = VolumeSpec::new("c", "db", 4096, 2).in_group(GroupId(2));
        let text = serde_json::to_string(&spec).unwrap();
        assert!(text.ends_with(r#","group":2}"#), "{text}");
        assert_eq!(serde_json::from_str::<VolumeSpec>(&text).unwrap(), spec);
    }

    #[test]
    fn in_range_requests_pass() {
        assert_eq!(check_request(0, 0, 0), Ok(()));
        assert_eq!(check_request(0, 4096, 4096), Ok(()));
        assert_eq!(check_request(4096, MAX_REQUEST, 4096 + MAX_REQUEST), Ok(()));
    }

    #[test]
    fn out_of_range_and_overflow_are_refused() {
        assert_eq!(
            check_request(1, 4096, 4096),
            Err(RangeError::OutOfRange {
                offset: 1,
                len: 4096,
                size: 4096
            })
        );
        assert!(matches!(
            check_request(u64::MAX, 1, u64::MAX),
            Err(RangeError::OutOfRange { .. })
        ));
    }

    #[test]
    fn oversized_requests_are_refused_first() {
        assert_eq!(
            check_request(0, MAX_REQUEST + 1, u64::MAX),
            Err(RangeError::TooLarge {
                len: MAX_REQUEST + 1,
                max: MAX_REQUEST
            })
        );
    }
}
