//! The member book: which incarnation of each node this node deals with
//! (S8), and where that node listens.
//!
//! Raft's membership is the truth; the coordinator copies the effective
//! membership here whenever it changes ([`MemberBook::set`]), and the parts
//! that talk to peers read it:
//! - Raft's client stamps every message with the [`MemberId`] it is meant
//!   for, and a node refuses a message meant for another incarnation of
//!   itself: a node whose disk was replaced never answers for its former
//!   self, so its fresh vote and empty log can never stand in for the old
//!   ones;
//! - the replica client names the incarnation it expects in every request,
//!   and a replica of another incarnation refuses it: an empty replica
//!   never counts as the in-sync copy it replaced (S5);
//! - the transport's member list (S9) and the peers' addresses follow the
//!   book, so a node added at run time is reached and admitted.
//!
//! **Which incarnation of a node is expected.** While a replacement runs,
//! the membership holds two incarnations of one node: the old as a voter
//! and the new as a learner, then both as voters of the joint
//! configuration. The book expects the incoming one from the moment it is
//! in the membership: a learner incarnation over a voter one, and in a
//! joint configuration the one of the newer half. The old one is gone (its
//! disk is) or is being retired, and the in-sync set dropped it before the
//! replacement began.

use std::collections::BTreeMap;
use std::sync::{Mutex, RwLock};

use tokio::sync::watch;

use crate::ids::{Incarnation, MemberId, NodeId};

/// Why this node is not a member yet, while it is not; shared with status.
#[derive(Default)]
pub struct Waiting(Mutex<Option<String>>);

impl Waiting {
    /// Why this node waits, if it does.
    pub fn reason(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Records why it waits (logged when the reason changes), or that it
    /// no longer does.
    pub fn set(&self, reason: Option<String>) {
        let mut current = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if *current != reason {
            match &reason {
                Some(why) => tracing::warn!("not a member: {why}"),
                None if current.is_some() => tracing::info!("now a member of the cluster"),
                None => {}
            }
            *current = reason;
        }
    }
}

/// How long a waiting node's announcement counts: it repeats it every
/// few hundred milliseconds while it waits.
pub const WAITING_FRESH: std::time::Duration = std::time::Duration::from_secs(5);

/// What the book knows of one node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The incarnation expected (see the module docs).
    pub member: MemberId,
    /// Its gRPC address as the membership records it (empty: the peer
    /// list's).
    pub addr: String,
    /// A voter (in any half of the configuration), not only a learner.
    pub voter: bool,
}

/// See the module docs.
pub struct MemberBook {
    entries: RwLock<BTreeMap<NodeId, Entry>>,
    /// Nodes with no Raft state that announced themselves (see
    /// [`MemberBook::note_waiting`]), and when they last did.
    waiting: Mutex<BTreeMap<NodeId, (MemberId, std::time::Instant)>>,
    /// Bumped on every change.
    version: watch::Sender<u64>,
}

impl Default for MemberBook {
    fn default() -> Self {
        Self {
            entries: RwLock::default(),
            waiting: Mutex::default(),
            version: watch::channel(0).0,
        }
    }
}

impl MemberBook {
    /// Replaces what the book knows by `entries`.
    pub fn set(&self, entries: BTreeMap<NodeId, Entry>) {
        let mut book = self.entries.write().unwrap_or_else(|p| p.into_inner());
        if *book != entries {
            *book = entries;
            drop(book);
            self.version.send_modify(|v| *v += 1);
        }
    }

    /// The book's entries now.
    pub fn entries(&self) -> BTreeMap<NodeId, Entry> {
        self.entries
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The member expected for `node`, if it is one.
    pub fn member(&self, node: NodeId) -> Option<MemberId> {
        self.entries
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&node)
            .map(|entry| entry.member)
    }

    /// The incarnation of `node` to expect: incarnation 0 (a data dir
    /// older than incarnations) for a node the book does not know.
    pub fn incarnation(&self, node: NodeId) -> Incarnation {
        self.member(node)
            .map_or(Incarnation(0), MemberId::incarnation)
    }

    /// Records that `member` runs with no Raft state and waits to be added
    /// or re-added (it said so in a `Hello`, under its node's certificate).
    pub fn note_waiting(&self, member: MemberId) {
        self.waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(member.node(), (member, std::time::Instant::now()));
    }

    /// The incarnation of `node` that announced itself waiting within
    /// [`WAITING_FRESH`], if one did.
    pub fn waiting(&self, node: NodeId) -> Option<MemberId> {
        let waiting = self.waiting.lock().unwrap_or_else(|p| p.into_inner());
        waiting
            .get(&node)
            .filter(|(_, at)| at.elapsed() < WAITING_FRESH)
            .map(|(member, _)| *member)
    }

    /// Resolves at the next change.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.version.subscribe()
    }
}

/// The book's entries for a membership given as its configurations (oldest
/// half first, as openraft's joint config lists them) and every member's
/// address (voters and learners): per node, the incoming incarnation (see
/// the module docs).
pub fn entries_of(
    configs: &[std::collections::BTreeSet<MemberId>],
    nodes: &BTreeMap<MemberId, String>,
) -> BTreeMap<NodeId, Entry> {
    let voter = |member: &MemberId| configs.iter().any(|c| c.contains(member));
    // Rank: a learner over a voter; among voters, the newest half's.
    let rank = |member: &MemberId| -> usize {
        if !voter(member) {
            return usize::MAX;
        }
        configs
            .iter()
            .rposition(|c| c.contains(member))
            .unwrap_or(0)
    };
    let mut entries: BTreeMap<NodeId, (usize, Entry)> = BTreeMap::new();
    for (member, addr) in nodes {
        let entry = Entry {
            member: *member,
            addr: addr.clone(),
            voter: voter(member),
        };
        let ranked = rank(member);
        match entries.get(&member.node()) {
            Some((known, _)) if *known >= ranked => {}
            _ => {
                entries.insert(member.node(), (ranked, entry));
            }
        }
    }
    entries
        .into_iter()
        .map(|(node, (_, e))| (node, e))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn member(node: u64, incarnation: u64) -> MemberId {
        MemberId::new(NodeId(node), Incarnation(incarnation))
    }

    #[test]
    fn during_a_replacement_the_incoming_incarnation_is_expected() {
        let (old, new) = (member(3, 7), member(3, 9));
        let voters: BTreeSet<_> = [member(1, 1), member(2, 2), old].into();
        let mut nodes: BTreeMap<_, _> = voters.iter().map(|m| (*m, String::new())).collect();
        nodes.insert(new, "h:3".into());
        // The new incarnation is a learner.
        let book = entries_of(std::slice::from_ref(&voters), &nodes);
        assert_eq!(book[&NodeId(3)].member, new);
        assert!(!book[&NodeId(3)].voter);
        assert_eq!(book[&NodeId(3)].addr, "h:3");
        // The joint configuration: old half, new half.
        let newer: BTreeSet<_> = [member(1, 1), member(2, 2), new].into();
        let book = entries_of(&[voters.clone(), newer.clone()], &nodes);
        assert_eq!(book[&NodeId(3)].member, new);
        assert!(book[&NodeId(3)].voter);
        // Done.
        nodes.remove(&old);
        let book = entries_of(&[newer], &nodes);
        assert_eq!(book[&NodeId(3)].member, new);
        assert_eq!(book.len(), 3);
        // Before: the old one.
        nodes.remove(&new);
        nodes.insert(old, String::new());
        let book = entries_of(&[voters], &nodes);
        assert_eq!(book[&NodeId(3)].member, old);
    }

    #[test]
    fn an_unknown_node_is_expected_as_incarnation_0() {
        let book = MemberBook::default();
        assert_eq!(book.incarnation(NodeId(4)), Incarnation(0));
        let changed = book.subscribe();
        book.set(
            [(
                NodeId(4),
                Entry {
                    member: member(4, 5),
                    addr: String::new(),
                    voter: true,
                },
            )]
            .into(),
        );
        assert!(changed.has_changed().unwrap());
        assert_eq!(book.incarnation(NodeId(4)), Incarnation(5));
    }
}
