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
//! Both serialise as the bare number, so the Raft log and vote, the
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
    fn a_term_keeps_the_bare_number_on_disk_on_screen_and_in_text() {
        assert_eq!(serde_json::to_string(&Term(7)).unwrap(), "7");
        assert_eq!(serde_json::from_str::<Term>("7").unwrap(), Term(7));
        assert_eq!(Term(7).to_string(), "7");
        assert_eq!(format!("{:>3}", Term(7)), "  7");
        assert_eq!(Term(7).next(), Term(8));
        assert!(Term::ZERO < Term(1));
    }
}
