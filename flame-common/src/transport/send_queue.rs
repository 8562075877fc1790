//! The send queue every transport's connection embeds, written once: what is
//! queued and not yet handed to the link, its byte bound, and the connection's
//! closed and closing state that goes with it.
//!
//! Each transport keeps its own *backlog* type (what a unit of sending is on
//! its link: buffers for one `writev` on a byte stream
//! ([`super::stream_send`]), whole records for the shm ring, chunks that
//! credits let go over rdma) and its own drainer (a writer task, or a pump on
//! completions). The rules are here and nowhere else:
//! * a push past `bytes_max` is refused whole, and the owner closes the
//!   connection (a peer that does not read must not grow memory without
//!   limit); a push to a closed queue is refused;
//! * [`SendQueue::close`] drops what is queued and wakes the drainer and every
//!   waiter, once;
//! * [`SendQueue::close_after_send`] lets what is queued (and what is pushed
//!   before it drained: a refusal right after) go first, then the drainer ends
//!   with [`WriterEnd::Drained`] and the owner closes;
//! * the drainer's progress goes into the connection's [`StallMarks`] for the
//!   owner's stall watchdog.

use super::StallMarks;
use std::cell::{Cell, RefCell};
use std::task::{Poll, Waker};

/// What a transport queues for its link, in order.
pub trait Backlog: Default {
    /// Whether nothing is queued.
    fn is_empty(&self) -> bool;
}

struct State<B> {
    backlog: B,
    /// Bytes in `backlog`.
    queued_bytes: usize,
    /// Bytes the drainer took for its current round ([`SendQueue::take_all`])
    /// and has not yet handed to the link (a `writev` still in progress): they
    /// count as queued until its next round begins.
    in_round: usize,
    /// The drainer took a round and has not come back for more.
    draining: bool,
    /// The drainer, waiting for something to send (or for room on its link).
    drainer: Option<Waker>,
    /// Tasks waiting for the queue to drain or shrink.
    drain_waiters: Vec<Waker>,
}

/// Why a push was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushRefused {
    /// The connection is closed: nothing more is sent.
    Closed,
    /// The queue would pass its byte bound (the bound is the value): the peer
    /// does not read. The owner closes the connection.
    Backlog(usize),
}

/// How the drainer ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriterEnd {
    /// The owner closed the queue.
    Closed,
    /// Everything queued before [`SendQueue::close_after_send`] was sent: the
    /// owner closes the connection now.
    Drained,
    /// A write failed (the peer is gone): the owner closes the connection.
    Failed,
}

/// One connection's send queue and close state (one thread); see the module
/// documentation.
pub struct SendQueue<B> {
    state: RefCell<State<B>>,
    closed: Cell<bool>,
    /// Close once everything queued so far is sent.
    closing: Cell<bool>,
    /// Bound on queued bytes; a push past it is refused.
    bytes_max: usize,
    marks: StallMarks,
}

impl<B: Backlog> SendQueue<B> {
    /// An empty queue of at most `bytes_max` bytes.
    pub fn new(bytes_max: usize) -> SendQueue<B> {
        assert!(bytes_max > 0, "a send queue must hold something");
        SendQueue {
            state: RefCell::new(State {
                backlog: B::default(),
                queued_bytes: 0,
                in_round: 0,
                draining: false,
                drainer: None,
                drain_waiters: Vec::new(),
            }),
            closed: Cell::new(false),
            closing: Cell::new(false),
            bytes_max,
            marks: StallMarks::default(),
        }
    }

    /// The progress marks of this connection (the owner's receive side marks its
    /// payloads and frames there too).
    pub fn marks(&self) -> &StallMarks {
        &self.marks
    }

    /// Whether the connection was closed.
    pub fn is_closed(&self) -> bool {
        self.closed.get()
    }

    /// Whether the connection closes once what is queued was sent.
    pub fn is_closing(&self) -> bool {
        self.closing.get()
    }

    /// Bytes queued and not yet handed to the link (including a round the
    /// drainer took and is still writing).
    pub fn queued_bytes(&self) -> usize {
        let st = self.state.borrow();
        st.queued_bytes + st.in_round
    }

    /// Whether nothing is queued (what the drainer took may still be on its way).
    pub fn is_empty(&self) -> bool {
        self.state.borrow().backlog.is_empty()
    }

    /// Queues `bytes` more bytes, which `add` puts into the backlog, after
    /// everything queued before; refused whole when closed or past the bound.
    pub fn push(&self, bytes: usize, add: impl FnOnce(&mut B)) -> Result<(), PushRefused> {
        if self.closed.get() {
            return Err(PushRefused::Closed);
        }
        let mut st = self.state.borrow_mut();
        if (st.queued_bytes + st.in_round).saturating_add(bytes) > self.bytes_max {
            return Err(PushRefused::Backlog(self.bytes_max));
        }
        add(&mut st.backlog);
        st.queued_bytes += bytes;
        if let Some(w) = st.drainer.take() {
            w.wake();
        }
        Ok(())
    }

    /// Looks at the backlog (the drainer, before it takes; a transport's own
    /// bookkeeping in it). Nothing may be added or removed here: pushes and
    /// takes go through [`SendQueue::push`] and [`SendQueue::take`], which
    /// count the bytes.
    pub fn with_backlog<R>(&self, look: impl FnOnce(&mut B) -> R) -> R {
        look(&mut self.state.borrow_mut().backlog)
    }

    /// Takes what the drainer sends now: `take` removes it from the backlog and
    /// says how many bytes that was. Senders waiting for room go on.
    pub fn take<R>(&self, take: impl FnOnce(&mut B) -> (R, usize)) -> R {
        let mut st = self.state.borrow_mut();
        let (r, bytes) = take(&mut st.backlog);
        assert!(bytes <= st.queued_bytes, "took more than was queued");
        st.queued_bytes -= bytes;
        // Handed to the link at once: with nothing left, nothing is on its way.
        st.draining = !st.backlog.is_empty();
        let waiters = std::mem::take(&mut st.drain_waiters);
        drop(st);
        waiters.into_iter().for_each(Waker::wake);
        r
    }

    /// Takes everything queued for one round of the drainer, which may take
    /// a while to hand it all to the link (a `writev` to a peer that reads
    /// slowly): its bytes still count as queued until the drainer comes back
    /// for its next round ([`SendQueue::next_round`]).
    pub fn take_all<R>(&self, take: impl FnOnce(&mut B) -> R) -> R {
        let mut st = self.state.borrow_mut();
        let r = take(&mut st.backlog);
        assert!(st.backlog.is_empty(), "take_all left something queued");
        st.in_round += st.queued_bytes;
        st.queued_bytes = 0;
        st.draining = true;
        r
    }

    /// The drainer waits for something to send: `Ok` when there is, else how
    /// it ends ([`WriterEnd::Closed`], or [`WriterEnd::Drained`] when closing
    /// and everything went).
    pub async fn next_round(&self) -> Result<(), WriterEnd> {
        std::future::poll_fn(|cx| {
            if self.closed.get() {
                return Poll::Ready(Err(WriterEnd::Closed));
            }
            let mut st = self.state.borrow_mut();
            if st.in_round > 0 {
                // The last round went: senders waiting for room go on.
                st.in_round = 0;
                let waiters = std::mem::take(&mut st.drain_waiters);
                waiters.into_iter().for_each(Waker::wake);
            }
            if !st.backlog.is_empty() {
                return Poll::Ready(Ok(()));
            }
            st.draining = false;
            let waiters = std::mem::take(&mut st.drain_waiters);
            let end = if self.closing.get() {
                Poll::Ready(Err(WriterEnd::Drained))
            } else {
                st.drainer = Some(cx.waker().clone());
                Poll::Pending
            };
            drop(st);
            waiters.into_iter().for_each(Waker::wake);
            end
        })
        .await
    }

    /// Wakes every task waiting for the queue to shrink (the link is gone, see
    /// [`SendQueue::wait_below_unless`]).
    pub fn wake_waiters(&self) {
        let waiters = std::mem::take(&mut self.state.borrow_mut().drain_waiters);
        waiters.into_iter().for_each(Waker::wake);
    }

    /// Wakes the drainer (something it waits on outside the queue changed:
    /// room on its link, the peer's end).
    pub fn wake_drainer(&self) {
        let w = self.state.borrow_mut().drainer.take();
        if let Some(w) = w {
            w.wake();
        }
    }

    /// The drainer waits for something else (room on its link): a push or the
    /// close wakes it too.
    pub fn park_drainer(&self, waker: &Waker) {
        self.state.borrow_mut().drainer = Some(waker.clone());
    }

    /// Waits until the queue holds at most `bytes_max` bytes (0: everything
    /// handed to the link, which needs a drainer that calls
    /// [`SendQueue::next_round`]), or the connection is closed.
    pub async fn wait_below(&self, bytes_max: usize) {
        self.wait_below_unless(bytes_max, || false).await
    }

    /// Like [`SendQueue::wait_below`], ending too once `gone()` says the link
    /// is gone (a transport whose peer can vanish before the owner closes:
    /// [`SendQueue::wake_waiters`] wakes the wait to look).
    pub async fn wait_below_unless(&self, bytes_max: usize, gone: impl Fn() -> bool) {
        std::future::poll_fn(|cx| {
            if self.closed.get() || gone() {
                return Poll::Ready(());
            }
            let mut st = self.state.borrow_mut();
            let done = if bytes_max == 0 {
                st.backlog.is_empty() && !st.draining
            } else {
                st.queued_bytes + st.in_round <= bytes_max
            };
            if done {
                return Poll::Ready(());
            }
            st.drain_waiters.push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Sends what is queued, then ends the drainer with [`WriterEnd::Drained`].
    /// What is pushed before the queue has drained still goes (a refusal queued
    /// right after, say).
    pub fn close_after_send(&self) {
        if self.closed.get() {
            return;
        }
        self.closing.set(true);
        // Wake the drainer so an already-empty queue ends at once.
        if let Some(w) = self.state.borrow_mut().drainer.take() {
            w.wake();
        }
    }

    /// Closes: drops what is queued, wakes the drainer and every waiter. `true`
    /// the first time (the owner then closes its link).
    pub fn close(&self) -> bool {
        if self.closed.replace(true) {
            return false;
        }
        let mut st = self.state.borrow_mut();
        let dropped = std::mem::take(&mut st.backlog);
        st.queued_bytes = 0;
        st.in_round = 0;
        let drainer = st.drainer.take();
        let waiters = std::mem::take(&mut st.drain_waiters);
        drop(st);
        drop(dropped);
        if let Some(w) = drainer {
            w.wake();
        }
        for w in waiters {
            w.wake();
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    #[derive(Default)]
    struct Records(VecDeque<Vec<u8>>);

    impl Backlog for Records {
        fn is_empty(&self) -> bool {
            self.0.is_empty()
        }
    }

    fn push(q: &SendQueue<Records>, r: &[u8]) -> Result<(), PushRefused> {
        q.push(r.len(), |b| b.0.push_back(r.to_vec()))
    }

    #[test]
    fn the_byte_bound_refuses_whole_pushes() {
        let q = SendQueue::<Records>::new(10);
        push(&q, b"12345678").unwrap();
        assert_eq!(push(&q, b"xyz"), Err(PushRefused::Backlog(10)));
        assert_eq!(q.queued_bytes(), 8, "nothing of a refused push is queued");
        assert_eq!(q.with_backlog(|b| b.0.len()), 1);
        push(&q, b"12").unwrap();
        assert_eq!(q.queued_bytes(), 10, "exactly at the bound is allowed");
    }

    #[test]
    fn taking_frees_room() {
        let q = SendQueue::<Records>::new(10);
        push(&q, b"12345678").unwrap();
        let got = q.take(|b| {
            let r = b.0.pop_front().unwrap();
            let n = r.len();
            (r, n)
        });
        assert_eq!(got, b"12345678");
        assert_eq!(q.queued_bytes(), 0);
        assert!(q.is_empty());
        push(&q, b"123456789").unwrap();
    }

    #[test]
    fn a_round_in_progress_counts_as_queued_until_the_next_round() {
        use crate::reactor::{Reactor, ReactorConfig};
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let q = SendQueue::<Records>::new(10);
            push(&q, b"123456").unwrap();
            assert_eq!(q.next_round().await, Ok(()));
            let taken = q.take_all(|b| std::mem::take(&mut b.0));
            assert_eq!(taken.len(), 1);
            assert!(q.is_empty());
            assert_eq!(q.queued_bytes(), 6, "still being written");
            assert_eq!(push(&q, b"12345"), Err(PushRefused::Backlog(10)));
            push(&q, b"1234").unwrap();
            // The drainer comes back: the round went.
            assert_eq!(q.next_round().await, Ok(()));
            assert_eq!(q.queued_bytes(), 4);
        })
        .unwrap();
    }

    #[test]
    fn close_drops_the_queue_once_and_refuses_pushes() {
        let q = SendQueue::<Records>::new(1 << 10);
        push(&q, b"queued").unwrap();
        q.close_after_send();
        assert!(q.is_closing());
        push(&q, b"late").unwrap();
        assert_eq!(q.queued_bytes(), 10, "closing: what is queued still goes");
        assert!(q.close(), "the first close");
        assert!(!q.close(), "then no more");
        assert_eq!(q.queued_bytes(), 0);
        assert!(q.is_empty());
        assert!(q.is_closed());
        assert_eq!(push(&q, b"x"), Err(PushRefused::Closed));
    }

    #[test]
    fn the_drainer_ends_drained_after_close_after_send_and_closed_after_close() {
        use crate::reactor::{Reactor, ReactorConfig};
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let q = SendQueue::<Records>::new(1 << 10);
            push(&q, b"last").unwrap();
            assert_eq!(q.next_round().await, Ok(()));
            q.close_after_send();
            q.take(|b| (b.0.pop_front(), 4));
            assert_eq!(q.next_round().await, Err(WriterEnd::Drained));
            let q = SendQueue::<Records>::new(1 << 10);
            push(&q, b"dropped").unwrap();
            q.close();
            assert_eq!(q.next_round().await, Err(WriterEnd::Closed));
            q.wait_below(0).await;
        })
        .unwrap();
    }
}
