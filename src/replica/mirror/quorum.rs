//! The counting rules that S1 and S5 rest on, as pure functions.
//!
//! - [`fence_quorum`]: how many replicas a new writer must fence before
//!   it may write (S1). An older writer acknowledges a write only on at
//!   least `min_in_sync` replicas; once `N − min_in_sync + 1` have taken the
//!   new term, at most `min_in_sync − 1` are left that it could still
//!   reach, so it can acknowledge nothing more.
//! - [`copy_to_keep`]: which of the differing in-sync copies the scrub
//!   keeps (S11): the one a majority holds, else the writer's.
//! - [`judge`]: what the engine does with the outcomes of one mirrored
//!   request (S5): acknowledge it only when every member of the committed
//!   in-sync set has it and the set has at least `min_in_sync` members
//!   (it may have shrunk while the request was out); a member that failed it (or that is no longer in
//!   the [`crate::replica::mirror::set::ReplicaSet`]) must be removed by a commit first, and
//!   only if at least `min_in_sync` members remain.

use std::collections::{BTreeMap, BTreeSet};

use bytes::Bytes;

use crate::ids::NodeId;

/// How many of `replicas` must take a new term before no older writer can
/// acknowledge a write (see the module docs).
pub fn fence_quorum(replicas: usize, min_in_sync: usize) -> usize {
    replicas.saturating_sub(min_in_sync) + 1
}

/// What [`judge`] decided about one mirrored request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every member of the in-sync set has it.
    Acknowledge,
    /// These in-sync members are in the replica set but were not sent the
    /// request (they joined after it was sent): send it to them, then
    /// judge again.
    SendTo(BTreeSet<NodeId>),
    /// These in-sync members failed it, or left the replica set, and
    /// enough would remain without them: commit their removal, then
    /// acknowledge only if [`all_succeeded`] on the committed set.
    Remove(BTreeSet<NodeId>),
    /// Without the failed members (if any) fewer than `need` would remain:
    /// the request is not acknowledged, and nothing is removed.
    TooFew {
        have: usize,
        need: usize,
        failed: BTreeSet<NodeId>,
    },
}

/// Judges one request. `outcomes` holds, for each replica it was sent to,
/// whether that replica succeeded; `members` is the replica set now;
/// `restarted` names replicas that failed because they restarted, whose
/// copies may have lost acknowledged writes. Those leave the set even
/// below `min_in_sync` (one copy must stay): counted on, they would let a
/// later flush be acknowledged over writes they no longer hold; kept
/// without being counted, they would hold writes for ever, since only a
/// copy out of the set is rebuilt.
pub fn judge(
    in_sync: &BTreeSet<NodeId>,
    members: &BTreeSet<NodeId>,
    outcomes: &BTreeMap<NodeId, bool>,
    restarted: &BTreeSet<NodeId>,
    min_in_sync: usize,
) -> Verdict {
    let unsent: BTreeSet<NodeId> = in_sync
        .iter()
        .filter(|id| members.contains(*id) && !outcomes.contains_key(*id))
        .cloned()
        .collect();
    if !unsent.is_empty() {
        return Verdict::SendTo(unsent);
    }
    let failed: BTreeSet<NodeId> = in_sync
        .iter()
        .filter(|id| outcomes.get(*id) != Some(&true))
        .cloned()
        .collect();
    // Checked even when nothing failed: the set may have shrunk below
    // `min_in_sync` while the request was in flight (a replaced copy
    // leaves it whatever `min_in_sync` says).
    let have = in_sync.len() - failed.len();
    if have < min_in_sync {
        let lost: BTreeSet<NodeId> = failed.intersection(restarted).cloned().collect();
        if !lost.is_empty() && lost.len() < in_sync.len() {
            return Verdict::Remove(lost);
        }
        return Verdict::TooFew {
            have,
            need: min_in_sync,
            failed,
        };
    }
    if failed.is_empty() {
        return Verdict::Acknowledge;
    }
    Verdict::Remove(failed)
}

/// After a removal was committed: Ok when every member of `committed`
/// succeeded and there are at least `min_in_sync`; otherwise how many did.
pub fn all_succeeded(
    committed: &BTreeSet<NodeId>,
    outcomes: &BTreeMap<NodeId, bool>,
    min_in_sync: usize,
) -> Result<(), usize> {
    let succeeded = committed
        .iter()
        .filter(|id| outcomes.get(*id) == Some(&true))
        .count();
    if succeeded == committed.len() && succeeded >= min_in_sync {
        Ok(())
    } else {
        Err(succeeded)
    }
}

/// The digest to keep among the in-sync copies `(replica, digest)`, given
/// in read order (the writer's own first), and whether a majority holds
/// it: the one more than half of them hold, or else the first. `None` when
/// there are no copies.
pub fn copy_to_keep(copies: &[(NodeId, Bytes)]) -> Option<(Bytes, bool)> {
    let mut counts: BTreeMap<&Bytes, usize> = BTreeMap::new();
    for (_, digest) in copies {
        *counts.entry(digest).or_default() += 1;
    }
    let majority = counts
        .into_iter()
        .find(|(_, count)| 2 * count > copies.len())
        .map(|(digest, _)| (digest.clone(), true));
    majority.or_else(|| copies.first().map(|(_, digest)| (digest.clone(), false)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Node `a` is `NodeId(1)`, `b` is 2, and so on.
    fn id(letter: &str) -> NodeId {
        let byte = letter.as_bytes()[0];
        NodeId(u64::from(byte - b'a') + 1)
    }

    fn ids(list: &str) -> BTreeSet<NodeId> {
        list.split_whitespace().map(id).collect()
    }

    /// `"a+ b- c"`: a succeeded, b failed, c got nothing.
    fn outcomes(list: &str) -> BTreeMap<NodeId, bool> {
        list.split_whitespace()
            .filter_map(|o| {
                let (id, sign) = o.split_at(o.len() - 1);
                match sign {
                    "+" => Some((self::id(id), true)),
                    "-" => Some((self::id(id), false)),
                    _ => None,
                }
            })
            .collect()
    }

    #[test]
    fn fence_quorum_leaves_an_old_writer_short_of_min_in_sync() {
        // (replicas, min_in_sync, fence quorum)
        let table = [
            (1, 1, 1),
            (3, 1, 3),
            (3, 2, 2),
            (3, 3, 1),
            (5, 3, 3),
            (5, 2, 4),
        ];
        for (n, min, want) in table {
            let got = fence_quorum(n, min);
            assert_eq!(got, want, "N={n} min_in_sync={min}");
            // The old writer can still reach N - got replicas: fewer than
            // min_in_sync.
            assert!(n - got < min, "N={n} min_in_sync={min}");
        }
    }

    #[test]
    fn judge_acknowledges_only_what_every_in_sync_member_has() {
        // (in-sync, replica set, outcomes, min_in_sync, verdict)
        let table: Vec<(&str, &str, &str, usize, Verdict)> = vec![
            ("a b c", "a b c", "a+ b+ c+", 2, Verdict::Acknowledge),
            // A rebuilding member's failure is not the in-sync set's.
            ("a b", "a b c", "a+ b+ c-", 2, Verdict::Acknowledge),
            ("a b c", "a b c", "a+ b+ c-", 2, Verdict::Remove(ids("c"))),
            (
                "a b c",
                "a b c",
                "a+ b- c-",
                2,
                Verdict::TooFew {
                    have: 1,
                    need: 2,
                    failed: ids("b c"),
                },
            ),
            ("a b c", "a b c", "a+ b+ c-", 1, Verdict::Remove(ids("c"))),
            // Joined after the request went out: send it there.
            ("a b c", "a b c", "a+ b+", 2, Verdict::SendTo(ids("c"))),
            // Left the replica set while in sync: it counts as failed.
            ("a b c", "a b", "a+ b+", 2, Verdict::Remove(ids("c"))),
            (
                "a b c",
                "a b",
                "a+ b+",
                3,
                Verdict::TooFew {
                    have: 2,
                    need: 3,
                    failed: ids("c"),
                },
            ),
            // The set shrank below min_in_sync while the request was out
            // (a replaced copy left it): every member has it, yet it is
            // not acknowledged.
            (
                "a b",
                "a b c",
                "a+ b+ c+",
                3,
                Verdict::TooFew {
                    have: 2,
                    need: 3,
                    failed: ids(""),
                },
            ),
        ];
        for (in_sync, members, sent, min, want) in table {
            let got = judge(
                &ids(in_sync),
                &ids(members),
                &outcomes(sent),
                &BTreeSet::new(),
                min,
            );
            assert_eq!(
                got, want,
                "in-sync {in_sync}, set {members}, outcomes {sent}, min {min}"
            );
        }
    }

    #[test]
    fn a_restarted_copy_leaves_even_below_min_in_sync_but_one_copy_stays() {
        // (in-sync, outcomes, restarted, min_in_sync, verdict)
        let table: Vec<(&str, &str, &str, usize, Verdict)> = vec![
            // Enough remain: removed like any failure.
            ("a b c", "a+ b+ c-", "c", 2, Verdict::Remove(ids("c"))),
            // Too few would remain: the restarted copy leaves all the same;
            // the other failure stays, as a failure below min_in_sync does.
            ("a b c", "a+ b+ c-", "c", 3, Verdict::Remove(ids("c"))),
            ("a b c", "a+ b- c-", "c", 2, Verdict::Remove(ids("c"))),
            // Not restarted: kept, nothing acknowledged.
            (
                "a b c",
                "a+ b+ c-",
                "",
                3,
                Verdict::TooFew {
                    have: 2,
                    need: 3,
                    failed: ids("c"),
                },
            ),
            // The last copies do not all leave.
            (
                "a b",
                "a- b-",
                "a b",
                1,
                Verdict::TooFew {
                    have: 0,
                    need: 1,
                    failed: ids("a b"),
                },
            ),
        ];
        for (in_sync, sent, restarted, min, want) in table {
            let got = judge(
                &ids(in_sync),
                &ids(in_sync),
                &outcomes(sent),
                &ids(restarted),
                min,
            );
            assert_eq!(
                got, want,
                "in-sync {in_sync}, outcomes {sent}, restarted {restarted}, min {min}"
            );
        }
    }

    #[test]
    fn after_a_removal_every_remaining_member_must_have_succeeded() {
        let table = [
            ("a b", "a+ b+ c-", 2, Ok(())),
            ("a b", "a+ b+ c-", 3, Err(2)),
            ("a b c", "a+ b+ c-", 2, Err(2)),
            ("a", "a+", 1, Ok(())),
        ];
        for (committed, sent, min, want) in table {
            assert_eq!(
                all_succeeded(&ids(committed), &outcomes(sent), min),
                want,
                "committed {committed}, outcomes {sent}, min {min}"
            );
        }
    }

    fn copies(digests: &[(u64, &'static [u8])]) -> Vec<(NodeId, Bytes)> {
        digests
            .iter()
            .map(|(id, d)| (NodeId(*id), Bytes::from_static(d)))
            .collect()
    }

    #[test]
    fn the_copy_kept_is_the_majoritys_else_the_writers() {
        let keep = |d: &'static [u8], majority: bool| Some((Bytes::from_static(d), majority));
        // The writer's copy (first) rotted: the majority wins.
        assert_eq!(
            copy_to_keep(&copies(&[(1, b"x"), (2, b"a"), (3, b"a")])),
            keep(b"a", true)
        );
        // A follower's rotted.
        assert_eq!(
            copy_to_keep(&copies(&[(1, b"a"), (2, b"x"), (3, b"a")])),
            keep(b"a", true)
        );
        // No majority: three different, or one against one.
        assert_eq!(
            copy_to_keep(&copies(&[(1, b"c"), (2, b"a"), (3, b"b")])),
            keep(b"c", false)
        );
        assert_eq!(
            copy_to_keep(&copies(&[(2, b"b"), (3, b"a")])),
            keep(b"b", false)
        );
        // Two of four is not a majority.
        assert_eq!(
            copy_to_keep(&copies(&[(1, b"w"), (2, b"a"), (3, b"a"), (4, b"b")])),
            keep(b"w", false)
        );
        // All agree: a majority of one.
        assert_eq!(copy_to_keep(&copies(&[(1, b"a")])), keep(b"a", true));
        assert_eq!(copy_to_keep(&[]), None);
    }
}
