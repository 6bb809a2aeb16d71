//! One order for overlapping writes (design S11: every in-sync replica
//! holds the same bytes).
//!
//! The engine sends a write to every replica at once, and each replica
//! applies what it receives in the order it arrives. Two writes in flight at
//! once that cover the same bytes could therefore reach two replicas in
//! opposite orders, and each would keep a different last write, with both
//! acknowledged and the in-sync set none the wiser. NBD leaves the result
//! of overlapping writes in flight unspecified, but it must be *one* result,
//! the same on every copy.
//!
//! So the writer orders them: a write that overlaps one already in flight
//! waits until that one has finished on every replica (answered, failed, or
//! disowned; see the engine's "no late landing") before it is sent anywhere.
//! Each replica then receives, and applies, overlapping writes in the order
//! the writer admitted them. Writes that do not overlap never wait for each
//! other, so a random workload keeps its full queue depth.
//!
//! The order is set by the writer, not by the channel, so it holds on any
//! transport that delivers a request before its answer comes back.
//!
//! Invariant: **a write enters only after every earlier-admitted write that
//! overlaps it has left.** A [`Turn`] is admitted in one step under a lock
//! (its number, its range, and the list of earlier overlapping turns it
//! waits for), and it leaves when dropped, so the waits form no cycle.
//!
//! Implementation caveats:
//! - A turn leaves when its write future is dropped, even halfway (an admin
//!   client's deadline). The engine then disowns every request of it still
//!   unanswered (`Engine::stamped`: the replica's generation is raised), so
//!   the next write there drains it or makes the replica refuse it: it
//!   cannot land after a later overlapping write. The extent counts as
//!   unacknowledged and is made equal again within the term
//!   (`Engine::repair_unsure`).
//! - Ranges are compared by byte; writes that share a block but no byte do
//!   not wait (the replicas write with `pwrite`, which keeps both).
//! - The list of writes in flight is scanned linearly; it is bounded by the
//!   NBD sessions' byte budgets, a few hundred entries at most.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// The writes in flight, by admission number.
#[derive(Debug, Default)]
pub struct WriteOrder {
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    /// The next admission number.
    next: u64,
    /// Each write in flight: its byte range and the signal its leaving
    /// sends (the sender is dropped).
    in_flight: BTreeMap<u64, InFlight>,
}

#[derive(Debug)]
struct InFlight {
    start: u64,
    end: u64,
    left: watch::Receiver<()>,
}

/// A write's place in the order: held while the write is sent and
/// answered; dropping it lets the overlapping writes after it go.
#[must_use = "the write's turn ends when this is dropped"]
#[derive(Debug)]
pub struct Turn {
    order: Arc<WriteOrder>,
    number: u64,
    /// Dropped with the turn: every receiver sees the channel close.
    _leaving: watch::Sender<()>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        self.order.lock().in_flight.remove(&self.number);
    }
}

impl WriteOrder {
    /// Admits a write to `[offset, offset + len)` and waits until every
    /// earlier-admitted write that overlaps it has left. A zero-length
    /// write overlaps nothing.
    pub async fn enter(self: &Arc<Self>, offset: u64, len: u64) -> Turn {
        let (start, end) = (offset, offset.saturating_add(len));
        let (turn, before) = {
            let mut inner = self.lock();
            let number = inner.next;
            inner.next += 1;
            let before: Vec<watch::Receiver<()>> = inner
                .in_flight
                .values()
                .filter(|w| start < end && start < w.end && w.start < end)
                .map(|w| w.left.clone())
                .collect();
            let (leaving, left) = watch::channel(());
            inner
                .in_flight
                .insert(number, InFlight { start, end, left });
            let turn = Turn {
                order: Arc::clone(self),
                number,
                _leaving: leaving,
            };
            (turn, before)
        };
        for mut earlier in before {
            // Resolves with an error once the earlier turn's sender is gone.
            while earlier.changed().await.is_ok() {}
        }
        turn
    }

    /// How many writes are in flight (admitted and not yet left).
    #[cfg(test)]
    fn in_flight(&self) -> usize {
        self.lock().in_flight.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Polls `future` once: whether it is ready now.
    fn ready<F: std::future::Future>(future: std::pin::Pin<&mut F>) -> Option<F::Output> {
        let waker = futures::task::noop_waker();
        let mut cx = std::task::Context::from_waker(&waker);
        match future.poll(&mut cx) {
            std::task::Poll::Ready(out) => Some(out),
            std::task::Poll::Pending => None,
        }
    }

    #[tokio::test]
    async fn an_overlapping_write_waits_for_the_earlier_one_to_leave() {
        let order = Arc::new(WriteOrder::default());
        let first = order.enter(0, 8192).await;
        let second = order.enter(4096, 4096);
        tokio::pin!(second);
        assert!(ready(second.as_mut()).is_none(), "overlaps the first");
        drop(first);
        let second = tokio::time::timeout(Duration::from_secs(5), second)
            .await
            .expect("enters once the first left");
        assert_eq!(order.in_flight(), 1);
        drop(second);
        assert_eq!(order.in_flight(), 0);
    }

    #[tokio::test]
    async fn writes_that_do_not_overlap_do_not_wait() {
        let order = Arc::new(WriteOrder::default());
        let _a = order.enter(0, 4096).await;
        // Adjacent, not overlapping; and one far away.
        let b = order.enter(4096, 4096);
        tokio::pin!(b);
        assert!(ready(b.as_mut()).is_some());
        let c = order.enter(1 << 30, 512);
        tokio::pin!(c);
        assert!(ready(c.as_mut()).is_some());
        let empty = order.enter(100, 0);
        tokio::pin!(empty);
        assert!(
            ready(empty.as_mut()).is_some(),
            "zero length overlaps nothing"
        );
    }

    #[tokio::test]
    async fn a_write_waits_for_every_earlier_overlap_and_not_for_later_ones() {
        let order = Arc::new(WriteOrder::default());
        let a = order.enter(0, 4096).await;
        let b = order.enter(8192, 4096).await;
        // c spans both a and b.
        let c = order.enter(0, 16384);
        tokio::pin!(c);
        assert!(ready(c.as_mut()).is_none());
        drop(a);
        assert!(ready(c.as_mut()).is_none(), "b is still in flight");
        // d comes after c and overlaps it: it waits for c, which waits.
        let d = order.enter(12288, 4096);
        tokio::pin!(d);
        assert!(ready(d.as_mut()).is_none());
        drop(b);
        let c = ready(c.as_mut()).expect("every earlier overlap left");
        assert!(ready(d.as_mut()).is_none(), "c is in flight");
        drop(c);
        assert!(ready(d.as_mut()).is_some());
    }
}
