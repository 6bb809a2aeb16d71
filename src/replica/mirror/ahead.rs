//! Marking ahead of a sequential writer (S6 kept cheap, issue 16 item 4).
//!
//! Before a replica applies the first write of a term to an extent, it
//! records durably that the extent is dirty (S6): a metadata flush, which
//! costs more than the write itself. A random writer pays it once per hot
//! extent; a sequential one — a copy, a backup restore, a database's log —
//! reaches a new extent every few writes and would pay it again and again.
//!
//! [`Ahead`] watches the extents the writer's writes touch. When they run
//! in order and come within [`LOW_WATER`] extents of the end of what was
//! already marked ahead, it names the next extents up to [`AHEAD`] past
//! the write. The engine asks every replica that takes writes to mark them
//! (`Replica::mark_ahead`) in the background, off the write's path: one
//! metadata flush for many extents, so most first writes to an extent find
//! it marked and need none.
//!
//! ## Why this is safe
//!
//! - A write that finds its extent marked in a replica's memory skips its
//!   own metadata flush, so it does rely on the mark being durable: a mark,
//!   ahead or not, enters that memory only after its flush, and only if no
//!   mark retirement ran on the replica meanwhile (a retirement removes
//!   marks from memory and the Db in one step; a mark it overlapped is
//!   placed again; `ReplicaStore::mark`). A write that finds its extent
//!   unmarked marks it first, as always.
//! - A mark ahead is admitted like a write (term, generation; S2, S3), so a
//!   fenced writer cannot place one.
//! - The engine places a mark ahead under its extents' stripes, held
//!   shared, and counts it like a write in flight meanwhile: a retirement
//!   pass, which holds a stripe exclusively and then checks what is in
//!   flight, never overlaps it. Afterwards its extents wait for a write;
//!   one that no write reached within [`AHEAD_PASSES`] retirement passes
//!   has its mark retired like a written extent's. A mark that is lost or
//!   lands late is only a mark too many, which costs a comparison at the
//!   next promotion.
//! - An in-flight count is ignored once the engine was activated again,
//!   so a mark ahead (or write) of an earlier term that finishes late
//!   cannot unbalance the new term's counts.
//!
//! ## Limits
//!
//! The hot set grows by at most [`AHEAD`] extents per sequential stream,
//! for at most [`AHEAD_PASSES`] retirement passes. A stream slower than
//! about [`AHEAD`] extents per that time finds some of its marks ahead
//! retired and marks those extents itself. Mixed versions: a node of an
//! earlier version closes a block-channel connection on a `Mark` frame (an
//! unknown kind), which drops that replica from the in-sync set; upgrade
//! every node at once (README). Random writes get no marks ahead:
//! their first touch of an extent still costs one metadata flush (grouped
//! with the flushes of concurrent writes by `sled_ops::Flusher`).

use std::ops::RangeInclusive;

/// How many extents past a sequential write are marked ahead.
pub const AHEAD: u64 = 32;

/// A new mark ahead is asked for once fewer than this many extents past
/// the write are marked.
pub const LOW_WATER: u64 = 24;

/// How many mark-retirement passes an extent marked ahead waits for a
/// write before its mark is retired (about 2 s at the node's 200 ms).
pub const AHEAD_PASSES: u32 = 10;

/// Follows the writer's writes and decides what to mark ahead.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Ahead {
    /// The last extent the previous write touched.
    last: Option<u64>,
    /// The extents last asked to be marked ahead.
    marked: Option<RangeInclusive<u64>>,
}

impl Ahead {
    /// Notes a write to extents `first..=last` of a volume whose last extent
    /// is `end`; returns the extents to mark ahead now, if any.
    pub fn after_write(&mut self, first: u64, last: u64, end: u64) -> Option<RangeInclusive<u64>> {
        let sequential = self
            .last
            .is_some_and(|prev| first == prev || first == prev.saturating_add(1));
        self.last = Some(last);
        if !sequential || last >= end {
            return None;
        }
        let want_to = last.saturating_add(AHEAD).min(end);
        let enough = last.saturating_add(LOW_WATER).min(want_to);
        let from = match &self.marked {
            // Still enough marked ahead of this write.
            Some(marked) if marked.contains(&(last + 1)) && *marked.end() >= enough => {
                return None;
            }
            // Extend what is marked.
            Some(marked) if marked.contains(&(last + 1)) => marked.end() + 1,
            _ => last + 1,
        };
        self.marked = Some(last + 1..=want_to);
        (from <= want_to).then_some(from..=want_to)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ranges asked for while writing `writes` (first, last) in turn.
    fn asked(writes: &[(u64, u64)], end: u64) -> Vec<RangeInclusive<u64>> {
        let mut ahead = Ahead::default();
        writes
            .iter()
            .filter_map(|&(first, last)| ahead.after_write(first, last, end))
            .collect()
    }

    #[test]
    fn a_sequential_stream_is_marked_ahead_in_batches() {
        let writes: Vec<(u64, u64)> = (0..40).map(|e| (e, e)).collect();
        let ranges = asked(&writes, 1000);
        // The second write shows the order; then a batch each time fewer
        // than LOW_WATER extents are left ahead.
        assert_eq!(ranges[0], 2..=1 + AHEAD);
        for pair in ranges.windows(2) {
            assert_eq!(*pair[1].start(), pair[0].end() + 1, "{ranges:?}");
        }
        // Every extent the stream reached after the first two was marked
        // ahead before the write that reached it.
        let marked: Vec<u64> = ranges.iter().flat_map(|r| r.clone()).collect();
        for extent in 2..40 {
            assert!(marked.contains(&extent), "extent {extent}: {ranges:?}");
        }
        // In batches, not one extent at a time.
        assert!(
            ranges.len() <= 40 / (AHEAD - LOW_WATER) as usize + 1,
            "{ranges:?}"
        );
    }

    #[test]
    fn writes_within_one_extent_ask_once() {
        let writes: Vec<(u64, u64)> = (0..100).map(|i| (i / 256, i / 256)).collect();
        assert_eq!(asked(&writes, 1000), vec![1..=AHEAD]);
    }

    #[test]
    fn random_writes_are_not_marked_ahead() {
        let writes = [(7, 7), (300, 300), (12, 12), (900, 901), (55, 55)];
        assert!(asked(&writes, 1000).is_empty());
    }

    #[test]
    fn marks_ahead_stop_at_the_volumes_end() {
        let ranges = asked(&[(995, 995), (996, 996), (997, 997), (998, 999)], 999);
        assert_eq!(ranges, vec![997..=999]);
        for range in &ranges {
            assert!(*range.end() <= 999);
        }
    }

    #[test]
    fn a_new_stream_elsewhere_is_marked_from_where_it_is() {
        let ranges = asked(&[(0, 0), (1, 1), (500, 500), (501, 501)], 1000);
        assert_eq!(ranges, vec![2..=1 + AHEAD, 502..=501 + AHEAD]);
    }
}
