//! The gate journal: an append-only text file of when this node's write gate
//! was usable, for audits and for the fault campaign's overlap check.
//!
//! One line per event, each written with a single `write` to a file opened
//! for appending, so a crash loses at most the line being written:
//!
//! ```text
//! open term=7 at=1764700000123456789 until=1764700000373456789
//! admit term=7 at=1764700000124000000 until=1764700000374000000
//! close term=7 at=1764700001000000000
//! ```
//!
//! Times are nanoseconds since the Unix epoch (the wall clock, so journals
//! of nodes on one machine compare). An `admit` line is written only when a
//! write passes the gate under a lease that ends later than any this term
//! has logged, so the file grows by about one line per lease renewal while
//! writes flow, not one per write. The interval in which node N could write
//! with term T is therefore from its `open` to the largest `until` (or `at`)
//! of its `open` and `admit` lines for T, cut at its `close`: a sound upper
//! bound of what it really did.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use crate::ha::GateJournal;
use crate::ids::Term;

/// A [`GateJournal`] appending to a file. See the module docs.
pub struct FileJournal {
    inner: Mutex<Inner>,
}

struct Inner {
    file: File,
    /// The term and the latest end logged for it: on the wall clock, and
    /// the monotonic deadline it came from (compared without conversion,
    /// whose jitter would make the same deadline look later).
    term: Term,
    logged_end: u64,
    logged_deadline: Option<Instant>,
    /// Whether a write already failed (warned once, not per line).
    failed: bool,
}

impl FileJournal {
    /// Opens (creating) `path` for appending.
    pub fn open(path: &Path) -> std::io::Result<Self> {
        let file = OpenOptions::new().create(true).append(true).open(path)?;
        Ok(Self {
            inner: Mutex::new(Inner {
                file,
                term: Term::ZERO,
                logged_end: 0,
                logged_deadline: None,
                failed: false,
            }),
        })
    }

    fn append(inner: &mut Inner, line: String) {
        if let Err(err) = inner.file.write_all(line.as_bytes()) {
            if !inner.failed {
                tracing::warn!(%err, "cannot append to the gate journal; its record is incomplete");
            }
            inner.failed = true;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Now, in nanoseconds since the Unix epoch.
pub fn wall_now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// The wall-clock time of a monotonic instant, rounded up to the next
/// microsecond: reading the two clocks jitters by nanoseconds, and without
/// rounding every admission under the same lease would look like a later
/// one. Rounding up keeps the journal an upper bound.
fn wall_ns(instant: Instant) -> u64 {
    let (now, wall) = (Instant::now(), wall_now_ns());
    let ns = if instant >= now {
        wall.saturating_add((instant - now).as_nanos() as u64)
    } else {
        wall.saturating_sub((now - instant).as_nanos() as u64)
    };
    ns.div_ceil(1000).saturating_mul(1000)
}

impl GateJournal for FileJournal {
    fn opened(&self, term: Term, deadline: Option<Instant>) {
        let at = wall_now_ns();
        let until = deadline.map_or(at, wall_ns);
        let mut inner = self.lock();
        inner.term = term;
        inner.logged_end = at.max(until);
        inner.logged_deadline = deadline;
        Self::append(
            &mut inner,
            format!("open term={term} at={at} until={until}\n"),
        );
    }

    fn admitted(&self, term: Term, deadline: Instant) {
        let (at, until) = (wall_now_ns(), wall_ns(deadline));
        let mut inner = self.lock();
        let known = inner
            .logged_deadline
            .is_some_and(|logged| deadline <= logged);
        if inner.term == term && known && at <= inner.logged_end {
            return;
        }
        if inner.term != term {
            (inner.term, inner.logged_end, inner.logged_deadline) = (term, 0, None);
        }
        inner.logged_end = inner.logged_end.max(at.max(until));
        inner.logged_deadline = inner.logged_deadline.max(Some(deadline));
        Self::append(
            &mut inner,
            format!("admit term={term} at={at} until={until}\n"),
        );
    }

    fn closed(&self, term: Term) {
        let at = wall_now_ns();
        let mut inner = self.lock();
        Self::append(&mut inner, format!("close term={term} at={at}\n"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn logs_open_each_later_lease_and_close() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gate.journal");
        let journal = FileJournal::open(&path).unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        journal.opened(Term(3), Some(deadline - Duration::from_millis(10)));
        journal.admitted(Term(3), deadline);
        journal.admitted(Term(3), deadline); // nothing new: not logged
        journal.admitted(Term(3), deadline + Duration::from_millis(50));
        journal.closed(Term(3));
        let text = std::fs::read_to_string(&path).unwrap();
        let kinds: Vec<&str> = text.lines().map(|l| l.split(' ').next().unwrap()).collect();
        assert_eq!(kinds, ["open", "admit", "admit", "close"], "{text}");
        assert!(text.lines().all(|l| l.contains("term=3 at=")), "{text}");
    }
}
