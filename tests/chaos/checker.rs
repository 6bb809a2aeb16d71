//! The campaign's checker: what must hold after every schedule, whatever
//! faults it injected. Pure functions over the evidence a run gathered, so
//! each rule is also tested on histories made up to break it.
//!
//! 1. **No lost write.** Per block, the final content is the last
//!    acknowledged write, or the write after it whose outcome was unknown
//!    (see `workload`). Anything else — an older write, zeroes, bytes no
//!    client wrote — lost an acknowledged write or let a stale one land.
//! 2. **No stale accept.** Every replica's audit counter of requests
//!    admitted below its fence floor is zero (S2).
//! 3. **No overlapping gates.** From the gate journals, each (node, term)
//!    could write from its `open` to the latest lease deadline (or admission
//!    time) it logged, cut at its `close`. No two such intervals overlap
//!    (S1, S4).
//! 4. **Converged.** After healing, the replicas in the in-sync set hold
//!    identical bytes (S5, S6).

use std::collections::BTreeMap;
use std::fmt;

use super::workload::{Content, Outcome, Record, WriteId, decode};

/// Everything a run gathered for the checker.
#[derive(Debug, Default, Clone)]
pub struct Evidence {
    pub history: Vec<Record>,
    /// Each workload block's final content, read through the writer.
    pub final_blocks: BTreeMap<u64, Vec<u8>>,
    /// Each node's gate journal.
    pub journals: BTreeMap<u64, String>,
    /// Each node's stale-accept audit counter.
    pub stale_accepts: BTreeMap<u64, u64>,
    /// Per-extent digests of each in-sync replica.
    pub replicas: BTreeMap<u64, Vec<[u8; 32]>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Violation {
    LostWrite {
        block: u64,
        expected: Option<WriteId>,
        found: Content,
    },
    StaleAccept {
        node: u64,
        count: u64,
    },
    GateOverlap {
        first: Interval,
        second: Interval,
    },
    Diverged {
        nodes: (u64, u64),
        extent: usize,
    },
    /// A certificate that must not write was let write, or a non-member
    /// was served (S9; see `abuse`).
    RoleAbuse {
        what: String,
    },
}

impl Violation {
    pub fn rule(&self) -> &'static str {
        match self {
            Violation::LostWrite { .. } => "lost write",
            Violation::StaleAccept { .. } => "stale accept",
            Violation::GateOverlap { .. } => "gate overlap",
            Violation::Diverged { .. } => "diverged",
            Violation::RoleAbuse { .. } => "role abuse",
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Violation::LostWrite {
                block,
                expected,
                found,
            } => write!(
                f,
                "block {block}: holds {found:?}, but the last acknowledged write was {expected:?}"
            ),
            Violation::StaleAccept { node, count } => {
                write!(
                    f,
                    "node {node}'s replica admitted {count} request(s) below its fence floor"
                )
            }
            Violation::GateOverlap { first, second } => write!(
                f,
                "gates overlap: {first} and {second} (by {} µs)",
                (first.end.min(second.end) - first.start.max(second.start)) / 1000
            ),
            Violation::Diverged { nodes, extent } => write!(
                f,
                "in-sync replicas {} and {} differ in extent {extent}",
                nodes.0, nodes.1
            ),
            Violation::RoleAbuse { what } => f.write_str(what),
        }
    }
}

/// When `node` could write with `term`, in wall-clock nanoseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Interval {
    pub node: u64,
    pub term: u64,
    pub start: u64,
    pub end: u64,
}

impl fmt::Display for Interval {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "node {} term {} [{}, {}]",
            self.node, self.term, self.start, self.end
        )
    }
}

pub fn check(evidence: &Evidence) -> Vec<Violation> {
    let mut violations = lost_writes(&evidence.history, &evidence.final_blocks);
    violations.extend(
        evidence
            .stale_accepts
            .iter()
            .filter(|(_, count)| **count > 0)
            .map(|(node, count)| Violation::StaleAccept {
                node: *node,
                count: *count,
            }),
    );
    violations.extend(gate_overlaps(&evidence.journals));
    violations.extend(divergence(&evidence.replicas));
    violations
}

/// Rule 1 (see the module docs).
pub fn lost_writes(history: &[Record], final_blocks: &BTreeMap<u64, Vec<u8>>) -> Vec<Violation> {
    let mut by_block: BTreeMap<u64, Vec<&Record>> = BTreeMap::new();
    for record in history {
        by_block.entry(record.block).or_default().push(record);
    }
    let mut violations = Vec::new();
    for (block, data) in final_blocks {
        let mut records = by_block.remove(block).unwrap_or_default();
        records.sort_by_key(|r| r.id);
        let last_acked = records.iter().rposition(|r| r.outcome == Outcome::Acked);
        let found = decode(data, *block);
        let allowed = match (last_acked, found) {
            (None, Content::Zero) => true,
            (_, Content::Garbage) | (Some(_), Content::Zero) => false,
            (None, Content::Write(id)) => records.iter().any(|r| r.id == id),
            (Some(i), Content::Write(id)) => records[i..].iter().any(|r| r.id == id),
        };
        if !allowed {
            violations.push(Violation::LostWrite {
                block: *block,
                expected: last_acked.map(|i| records[i].id),
                found,
            });
        }
    }
    violations
}

/// Parses `key=value` fields of a journal line.
fn field(line: &str, key: &str) -> Option<u64> {
    line.split(' ')
        .find_map(|part| part.strip_prefix(key)?.strip_prefix('='))
        .and_then(|value| value.parse().ok())
}

/// Each (node, term)'s writable interval, from the journals.
pub fn intervals(journals: &BTreeMap<u64, String>) -> Vec<Interval> {
    let mut all: BTreeMap<(u64, u64), (u64, u64, Option<u64>)> = BTreeMap::new();
    for (node, text) in journals {
        for line in text.lines() {
            let (Some(term), Some(at)) = (field(line, "term"), field(line, "at")) else {
                continue; // a torn last line
            };
            let until = field(line, "until").unwrap_or(at);
            let entry = all.entry((*node, term)).or_insert((at, at, None));
            match line.split(' ').next() {
                Some("open") | Some("admit") => {
                    entry.0 = entry.0.min(at);
                    entry.1 = entry.1.max(at).max(until);
                }
                Some("close") => entry.2 = Some(entry.2.map_or(at, |c: u64| c.min(at))),
                _ => {}
            }
        }
    }
    all.into_iter()
        .map(|((node, term), (start, end, close))| Interval {
            node,
            term,
            start,
            end: close.map_or(end, |c| end.min(c)).max(start),
        })
        .collect()
}

/// Rule 3 (see the module docs).
pub fn gate_overlaps(journals: &BTreeMap<u64, String>) -> Vec<Violation> {
    let intervals = intervals(journals);
    let mut violations = Vec::new();
    for (i, a) in intervals.iter().enumerate() {
        for b in &intervals[i + 1..] {
            if a.start < b.end && b.start < a.end {
                violations.push(Violation::GateOverlap {
                    first: *a,
                    second: *b,
                });
            }
        }
    }
    violations
}

/// Rule 4 (see the module docs).
pub fn divergence(replicas: &BTreeMap<u64, Vec<[u8; 32]>>) -> Vec<Violation> {
    let mut replicas = replicas.iter();
    let Some((first, reference)) = replicas.next() else {
        return Vec::new();
    };
    replicas
        .filter_map(|(node, digests)| {
            let extent = (0..reference.len().max(digests.len()))
                .find(|e| reference.get(*e) != digests.get(*e))?;
            Some(Violation::Diverged {
                nodes: (*first, *node),
                extent,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::super::workload::{BLOCK, encode};
    use super::*;
    use std::time::Duration;

    fn record(client: u32, seq: u64, block: u64, outcome: Outcome) -> Record {
        Record {
            id: WriteId { client, seq },
            block,
            node: 1,
            invoked: Duration::ZERO,
            completed: Duration::ZERO,
            outcome,
        }
    }

    fn holding(block: u64, client: u32, seq: u64) -> BTreeMap<u64, Vec<u8>> {
        BTreeMap::from([(block, encode(WriteId { client, seq }, block))])
    }

    #[test]
    fn the_last_acknowledged_or_a_later_unknown_write_is_allowed() {
        let history = vec![
            record(0, 1, 7, Outcome::Acked),
            record(0, 2, 7, Outcome::Acked),
            record(0, 3, 7, Outcome::Unknown("timed out".into())),
        ];
        assert!(lost_writes(&history, &holding(7, 0, 2)).is_empty());
        assert!(lost_writes(&history, &holding(7, 0, 3)).is_empty());
        // Never acknowledged anything: zeroes or the attempted write.
        let unacked = vec![record(1, 1, 9, Outcome::Refused(108))];
        let zero = BTreeMap::from([(9, vec![0u8; BLOCK])]);
        assert!(lost_writes(&unacked, &zero).is_empty());
        assert!(lost_writes(&unacked, &holding(9, 1, 1)).is_empty());
    }

    #[test]
    fn an_older_write_zeroes_or_garbage_is_a_lost_write() {
        let history = vec![
            record(0, 1, 7, Outcome::Acked),
            record(0, 2, 7, Outcome::Acked),
        ];
        let lost = lost_writes(&history, &holding(7, 0, 1));
        assert_eq!(
            lost,
            [Violation::LostWrite {
                block: 7,
                expected: Some(WriteId { client: 0, seq: 2 }),
                found: Content::Write(WriteId { client: 0, seq: 1 }),
            }]
        );
        let zero = BTreeMap::from([(7, vec![0u8; BLOCK])]);
        assert_eq!(lost_writes(&history, &zero)[0].rule(), "lost write");
        let mut torn = encode(WriteId { client: 0, seq: 2 }, 7);
        torn[BLOCK - 1] ^= 1;
        let torn = BTreeMap::from([(7, torn)]);
        assert!(matches!(
            lost_writes(&history, &torn)[..],
            [Violation::LostWrite {
                found: Content::Garbage,
                ..
            }]
        ));
        // Another block's write is not this block's.
        assert_eq!(
            lost_writes(
                &history,
                &BTreeMap::from([(7, encode(WriteId { client: 0, seq: 2 }, 8))])
            )
            .len(),
            1
        );
    }

    #[test]
    fn a_stale_accept_is_reported() {
        let evidence = Evidence {
            stale_accepts: BTreeMap::from([(1, 0), (2, 3)]),
            ..Evidence::default()
        };
        assert_eq!(
            check(&evidence),
            [Violation::StaleAccept { node: 2, count: 3 }]
        );
    }

    #[test]
    fn gates_one_after_another_pass_and_overlapping_ones_do_not() {
        let journals = BTreeMap::from([
            (
                1,
                "open term=2 at=100 until=300\nadmit term=2 at=150 until=400\nclose term=2 at=900\n"
                    .to_string(),
            ),
            (2, "open term=3 at=450 until=700\nadmit term=3 at=500 until=800\nadm".to_string()),
        ]);
        assert!(
            gate_overlaps(&journals).is_empty(),
            "{:?}",
            intervals(&journals)
        );
        // Node 1 admitted a write at 460 under an old lease: it overlaps.
        let mut broken = journals.clone();
        broken.insert(
            1,
            "open term=2 at=100 until=300\nadmit term=2 at=460 until=400\nclose term=2 at=900\n"
                .into(),
        );
        let overlaps = gate_overlaps(&broken);
        assert_eq!(overlaps.len(), 1, "{overlaps:?}");
        assert_eq!(overlaps[0].rule(), "gate overlap");
        // A close cuts the interval short.
        let closed = BTreeMap::from([
            (
                1,
                "open term=2 at=100 until=600\nclose term=2 at=200\n".to_string(),
            ),
            (2, "open term=3 at=450 until=700\n".to_string()),
        ]);
        assert!(gate_overlaps(&closed).is_empty());
    }

    #[test]
    fn differing_replicas_are_reported_with_the_extent() {
        let same = BTreeMap::from([(1, vec![[0u8; 32], [1; 32]]), (2, vec![[0u8; 32], [1; 32]])]);
        assert!(divergence(&same).is_empty());
        let mut differ = same.clone();
        differ.insert(3, vec![[0u8; 32], [2; 32]]);
        assert_eq!(
            divergence(&differ),
            [Violation::Diverged {
                nodes: (1, 3),
                extent: 1
            }]
        );
    }
}
