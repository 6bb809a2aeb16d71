//! Typed identities that every layer passes around.
//!
//! - [`NodeId`] names a node: the same number in the config's `id` and
//!   `--peer ID=…`, in the Raft membership, in the committed in-sync set
//!   and as the name of the replica that node holds. A node holds exactly
//!   one replica of the volume, so the replica's id is its node's id.
//! - [`Term`] is a Raft term, and so a writer's fencing token: the term of
//!   a leadership, of a writer's stamps, of a replica's fence floor and of
//!   its dirty marks.
//!
//! - [`Incarnation`] names one life of a node's data dir: a random number
//!   drawn when the dir is created. A node whose disk was replaced is the
//!   same [`NodeId`] with a new incarnation (S8).
//! - [`MemberId`] is a node's id *in Raft*: its [`NodeId`] and its
//!   [`Incarnation`] in one number. Votes, log entries and the membership
//!   name members by it, so a vote that one incarnation cast can never be
//!   cast again by the next: to Raft they are different members.
//! - [`Stamp`] is what a writer's request to one replica carries: its
//!   term and its generation for that replica within the term (S2, S3).
//! - [`GroupId`] names a Raft group on a node.
//! - [`VolumeId`] names a volume: its name, the key under which a node's
//!   volume host keeps it and the NBD export a client asks for.
//!
//! The numeric ones serialise as the bare number, so the Raft log and vote, the
//! replicated state and the wire keep the formats they had when they were
//! `u64`, and both print as the bare number, which is what status, metrics
//! labels and logs show. Protobuf fields and sled keys stay `u64`, and so
//! does the term inside openraft's own votes and log ids; our code converts
//! where it meets them.

use std::fmt;
use std::num::ParseIntError;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A node's id (and the id of the replica it holds).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct NodeId(pub u64);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl FromStr for NodeId {
    type Err = ParseIntError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        text.parse().map(NodeId)
    }
}

/// openraft's storage test suite builds its node ids from numbers.
impl From<u64> for NodeId {
    fn from(id: u64) -> Self {
        NodeId(id)
    }
}

/// A Raft group's id on a node. Each volume will have a group of its own,
/// and the cluster one more; their logs, votes and state live side by side
/// in the node's Raft Db ([`crate::raft::storage`]). Group 0 is the group a
/// node ran before there were many, so its trees keep the names they had.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct GroupId(pub u64);

impl GroupId {
    /// The group every node ran before there were many: today's only one.
    pub const FIRST: GroupId = GroupId(0);
}

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A volume's id within its cluster: its name, as the operator gave it and
/// as NBD clients ask for it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct VolumeId(pub String);

impl fmt::Display for VolumeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for VolumeId {
    fn from(name: &str) -> Self {
        VolumeId(name.to_string())
    }
}

/// A Raft term: the leadership it names, and the fencing token of that
/// leadership's writer (S2). Term 0 is never a writer's term.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Term(pub u64);

impl Term {
    /// The term before any election; no writer holds it.
    pub const ZERO: Term = Term(0);

    /// The term after this one.
    pub fn next(self) -> Term {
        Term(self.0 + 1)
    }
}

/// Forwards to the number's `Display`, so a width or alignment applies
/// (`replica-ha inspect` lines its marks' terms up).
impl fmt::Display for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// How many low bits of a [`MemberId`] hold the [`NodeId`]; node ids are
/// below `2^24` (the config says so).
pub const NODE_ID_BITS: u32 = 24;

/// The largest node id.
pub const MAX_NODE_ID: u64 = (1 << NODE_ID_BITS) - 1;

/// How many bits an [`Incarnation`] has: the rest of a [`MemberId`].
const INCARNATION_BITS: u32 = 64 - NODE_ID_BITS;

/// What a write or flush is stamped with: the writer's term, the fencing
/// token (S2), and the writer's *generation* for this one replica within the
/// term. A replica orders stamps by term, then generation, and refuses any
/// below its floor; a newer stamp first raises the floor, draining every
/// request admitted under an older one (S3).
///
/// The generation is how a writer disowns a request whose outcome it never
/// learned (a timeout, a broken connection): it raises the generation it
/// uses for that replica, so the next request it sends there drains the
/// lost one if it was admitted and refuses it if it arrives later. A
/// request the writer gave up on can therefore never land after a later
/// write to the same replica (no late landing).
///
/// On the wire it is two numbers, `term` and `generation`, in the block
/// channel's frame header and in the replica service's messages alike;
/// `replica::wire` holds the one conversion each way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Stamp {
    /// The writer's term.
    pub term: Term,
    /// The writer's generation for the replica within the term.
    pub generation: u64,
}

impl Stamp {
    /// The first generation of `term`.
    pub fn term(term: Term) -> Self {
        Self {
            term,
            generation: 0,
        }
    }
}

impl From<Term> for Stamp {
    fn from(term: Term) -> Self {
        Self::term(term)
    }
}

impl fmt::Display for Stamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.term, self.generation)
    }
}

/// One life of a node's data dir (see the module docs). Incarnation 0 is
/// that of a data dir made before incarnations existed; a new dir draws a
/// random non-zero one.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Incarnation(pub u64);

impl Incarnation {
    /// A fresh random incarnation: non-zero, and fitting a [`MemberId`].
    pub fn random() -> Self {
        let mask = (1u64 << INCARNATION_BITS) - 1;
        loop {
            let drawn = random_u64() & mask;
            if drawn != 0 {
                return Incarnation(drawn);
            }
        }
    }
}

/// Prints as hex: it is a random name, not a count.
impl fmt::Display for Incarnation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:010x}", self.0)
    }
}

/// A member of the Raft group: a node in one incarnation (see the module
/// docs). The low [`NODE_ID_BITS`] bits are the node id, the rest the
/// incarnation, so a member of incarnation 0 has the node's own number:
/// logs and votes written before incarnations existed read unchanged.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct MemberId(pub u64);

impl MemberId {
    /// Node `node` in incarnation `incarnation`. Bits of either that do
    /// not fit are dropped; the config keeps node ids small and
    /// [`Incarnation::random`] keeps incarnations so.
    pub fn new(node: NodeId, incarnation: Incarnation) -> Self {
        MemberId((node.0 & MAX_NODE_ID) | (incarnation.0 << NODE_ID_BITS))
    }

    /// The node.
    pub fn node(self) -> NodeId {
        NodeId(self.0 & MAX_NODE_ID)
    }

    /// The incarnation.
    pub fn incarnation(self) -> Incarnation {
        Incarnation(self.0 >> NODE_ID_BITS)
    }
}

/// `3` for incarnation 0, else `3/00a1b2c3d4` (node/incarnation).
impl fmt::Display for MemberId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.incarnation() {
            Incarnation(0) => write!(f, "{}", self.node()),
            incarnation => write!(f, "{}/{incarnation}", self.node()),
        }
    }
}

/// openraft's storage test suite builds its node ids from numbers.
impl From<u64> for MemberId {
    fn from(id: u64) -> Self {
        MemberId(id)
    }
}

/// 64 random bits, from the standard library's per-process random hash
/// keys (drawn from the OS) mixed with the time and the process id:
/// enough to tell data dirs and clusters apart, with no crate for it.
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    hasher.write_u128(now);
    hasher.write_u32(std::process::id());
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_keeps_the_bare_number_on_disk_on_screen_and_in_text() {
        assert_eq!(serde_json::to_string(&NodeId(3)).unwrap(), "3");
        assert_eq!(serde_json::from_str::<NodeId>("3").unwrap(), NodeId(3));
        assert_eq!(NodeId(3).to_string(), "3");
        assert_eq!("12".parse::<NodeId>(), Ok(NodeId(12)));
        assert!("n1".parse::<NodeId>().is_err());
    }

    #[test]
    fn a_member_id_holds_its_node_and_incarnation_and_incarnation_0_is_the_bare_node() {
        assert_eq!(MemberId::new(NodeId(3), Incarnation(0)), MemberId(3));
        let fresh = Incarnation::random();
        assert_ne!(fresh, Incarnation(0));
        let member = MemberId::new(NodeId(3), fresh);
        assert_eq!((member.node(), member.incarnation()), (NodeId(3), fresh));
        assert_ne!(member, MemberId(3), "another incarnation is another member");
        assert_ne!(Incarnation::random(), fresh, "draws differ");
        assert_eq!(MemberId(3).to_string(), "3");
        assert_eq!(
            MemberId::new(NodeId(3), Incarnation(0xab)).to_string(),
            "3/00000000ab"
        );
        let biggest = MemberId::new(NodeId(MAX_NODE_ID), Incarnation((1 << 40) - 1));
        assert_eq!(biggest.node(), NodeId(MAX_NODE_ID));
        assert_eq!(biggest.incarnation(), Incarnation((1 << 40) - 1));
    }

    #[test]
    fn a_term_keeps_the_bare_number_on_disk_on_screen_and_in_text() {
        assert_eq!(serde_json::to_string(&Term(7)).unwrap(), "7");
        assert_eq!(serde_json::from_str::<Term>("7").unwrap(), Term(7));
        assert_eq!(Term(7).to_string(), "7");
        assert_eq!(format!("{:>3}", Term(7)), "  7");
        assert_eq!(Term(7).next(), Term(8));
        assert!(Term::ZERO < Term(1));
    }
}
