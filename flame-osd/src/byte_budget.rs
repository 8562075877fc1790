//! Payload bytes in flight on one shard, bounded: a connection reader takes a
//! request's bytes before starting it and stops reading (the unread requests wait
//! in the socket and slow the sender down) while the budget is used up.
//!
//! A shard has two: one for its clients (`max_inflight_bytes_per_shard`) and one
//! for its OSD peers (`max_peer_inflight_bytes_per_shard`). They are separate
//! because a peer's requests (forwarded writes, recovery reads) are what complete
//! other OSDs' client writes: if they waited behind clients, two OSDs whose
//! client budgets are full of writes waiting on each other's replicas would wait
//! forever. A peer's request completes on this OSD's own disk, never waiting on
//! another incoming connection, so the peer budget frees by itself.
//!
//! One request may take more than what is left (a budget below its bound admits
//! the next request whole), so a request larger than the bound still runs.

use std::cell::{Cell, RefCell};
use std::task::{Context, Poll, Waker};

/// A bound on payload bytes in flight, shared by one shard's connection readers.
/// Cells: it lives on the shard's thread.
#[derive(Debug)]
pub struct ByteBudget {
    used: Cell<u64>,
    max: u64,
    /// Readers waiting for room.
    waiters: RefCell<Vec<Waker>>,
    /// `used`, for operators (`flame_osd_inflight_bytes{kind,shard}`).
    gauge: Option<prometheus::IntGauge>,
}

impl ByteBudget {
    /// A budget of `max` bytes, reporting its use in `gauge`.
    pub fn new(max: u64, gauge: Option<prometheus::IntGauge>) -> ByteBudget {
        assert!(max > 0, "a byte budget of 0 would admit nothing");
        ByteBudget {
            used: Cell::new(0),
            max,
            waiters: RefCell::new(Vec::new()),
            gauge,
        }
    }

    /// Whether another request may start now.
    pub fn has_room(&self) -> bool {
        self.used.get() < self.max
    }

    /// Bytes in flight.
    pub fn used(&self) -> u64 {
        self.used.get()
    }

    /// Ready when there is room; otherwise registers `cx` to be woken by the next
    /// release that makes room.
    pub fn poll_room(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.has_room() {
            return Poll::Ready(());
        }
        self.waiters.borrow_mut().push(cx.waker().clone());
        Poll::Pending
    }

    /// Waits until there is room.
    pub async fn room(&self) {
        std::future::poll_fn(|cx| self.poll_room(cx)).await
    }

    /// A request of `bytes` starts.
    pub fn take(&self, bytes: u64) {
        let used = self.used.get() + bytes;
        self.used.set(used);
        self.report(used);
    }

    /// A request of `bytes` ended; wakes the waiting readers when that made room.
    pub fn release(&self, bytes: u64) {
        let used = self.used.get();
        assert!(bytes <= used, "released {bytes} bytes of {used} in flight");
        let used = used - bytes;
        self.used.set(used);
        self.report(used);
        if used < self.max {
            for w in self.waiters.borrow_mut().drain(..) {
                w.wake();
            }
        }
    }

    fn report(&self, used: u64) {
        if let Some(g) = &self.gauge {
            g.set(i64::try_from(used).unwrap_or(i64::MAX));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn admits_while_below_the_bound_and_wakes_waiters_when_room_is_made() {
        let b = ByteBudget::new(8, None);
        let woken = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(woken.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(b.poll_room(&mut cx).is_ready());
        b.take(6);
        assert!(b.has_room(), "6 of 8: the next request may start");
        b.take(6);
        assert_eq!(b.used(), 12, "one request may overshoot");
        assert!(b.poll_room(&mut cx).is_pending());
        b.release(2);
        assert_eq!(woken.0.load(Ordering::SeqCst), 0, "10 of 8: still full");
        b.release(6);
        assert_eq!(woken.0.load(Ordering::SeqCst), 1, "4 of 8: room");
        assert!(b.poll_room(&mut cx).is_ready());
        b.release(4);
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn the_gauge_follows_the_bytes_in_flight() {
        let g = prometheus::IntGauge::new("t_inflight_bytes", "test").unwrap();
        let b = ByteBudget::new(1 << 20, Some(g.clone()));
        b.take(4096);
        b.take(512);
        assert_eq!(g.get(), 4608);
        b.release(4096);
        assert_eq!(g.get(), 512);
    }

    #[test]
    #[should_panic(expected = "released")]
    fn releasing_more_than_taken_is_a_bug() {
        let b = ByteBudget::new(8, None);
        b.take(1);
        b.release(2);
    }
}
