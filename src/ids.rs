//! Typed identities that every layer passes around.
//!
//! - [`NodeId`] names a node: the same number in the config's `id` and
//!   `--peer ID=…`, in the Raft membership, in the committed in-sync set
//!   and as the name of the replica that node holds. A node holds exactly
//!   one replica of the volume, so the replica's id is its node's id.
//!
//! A `NodeId` serialises as the bare number, so the Raft log and vote, the
//! replicated state and the wire keep the formats they had when ids were
//! `u64`. It prints as the bare number, which is what status, metrics
//! labels and logs show. (Terms are still bare `u64`; see the caveats in
//! `docs/design.md`.)

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
}
