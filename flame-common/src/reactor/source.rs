//! Extra completion sources a reactor polls besides its io_uring: shared-memory
//! rings (the `shm` transport), RDMA completion queues (the `rdma` transport), and
//! the cross-thread request and reply queues of the OSD's `staged` threading mode.
//!
//! The Flame thesis's dynamic counting polling is a policy over *every* place a
//! thread waits for completions. A thread that polled its io_uring adaptively but
//! blocked on an RDMA completion channel (or the other way round) would pay a
//! wake-up on one path and burn a core on the other. So a source registers with the
//! thread's reactor ([`add_poll_source`]) and the one idle loop treats it exactly
//! like the io_uring completion queue under the thread's [`super::PollMode`]:
//!
//! * every pass of the run loop, and every spin iteration (`busy`, `adaptive`),
//!   calls [`PollSource::poll`];
//! * before the thread sleeps in the kernel it calls [`PollSource::arm`] on every
//!   source: the source enables its wake-up (sets the "sleeping" flag its peers
//!   read, requests a completion-channel event) and re-checks; `false` means work
//!   arrived meanwhile and the thread polls again instead of sleeping;
//! * the wake-up itself is either the source's doorbell ([`PollSource::doorbell`],
//!   an eventfd the reactor keeps a read posted on through io_uring, for peers in
//!   other processes), or, for a source fed by threads of this process, a
//!   [`super::Handle::wake`] by the producer after it published the work;
//! * after the thread wakes, [`PollSource::disarm`] lets the source tell its peers
//!   to stop ringing while the thread is awake and polling anyway.
//!
//! The store-load race (the peer publishes work and reads "not sleeping" while the
//! thread reads "no work" and sleeps) is the source's to close in `arm`: set the
//! flag, full fence, re-check. The reactor does the same for its own queues.

use super::executor::with_current;
use std::cell::{Cell, RefCell};
use std::os::fd::RawFd;
use std::rc::Rc;

/// An extra completion source polled by the current thread's reactor.
pub trait PollSource {
    /// Looks for completions; for each, wakes the task waiting for it (or spawns
    /// one). Returns true if it found any. Called often (every spin iteration in
    /// `busy` mode): it must be cheap when empty and must not block.
    fn poll(&self) -> bool;

    /// The thread is about to sleep: enable the wake-up, then re-check. Returns
    /// false if work is already there (the thread then polls instead of sleeping).
    fn arm(&self) -> bool;

    /// The thread woke up (for any reason) and polls again: the source may turn its
    /// wake-up off. Default: nothing to do.
    fn disarm(&self) {}

    /// An eventfd a peer writes to wake this thread while the source is armed. The
    /// reactor keeps a read posted on it through io_uring for as long as the
    /// source is registered; the descriptor must stay open until the source is
    /// removed. `None`: producers wake the thread through its [`super::Handle`].
    fn doorbell(&self) -> Option<RawFd> {
        None
    }
}

/// Identifies a registered source, for [`remove_poll_source`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PollSourceId(u64);

/// One registered source and the task that keeps its doorbell read posted.
struct Entry {
    id: u64,
    source: Rc<dyn PollSource>,
    _doorbell: Option<async_task::Task<()>>,
}

/// A reactor's sources. The list the loop iterates is an immutable snapshot
/// replaced on every change, so a source's `poll` may add or remove sources (a
/// connection closing) without a `RefCell` conflict, and polling clones one `Rc`,
/// not a vector.
pub(crate) struct Sources {
    entries: RefCell<Vec<Entry>>,
    snapshot: RefCell<Rc<[Rc<dyn PollSource>]>>,
    next_id: Cell<u64>,
}

impl Default for Sources {
    fn default() -> Self {
        let empty: Vec<Rc<dyn PollSource>> = Vec::new();
        Sources {
            entries: RefCell::new(Vec::new()),
            snapshot: RefCell::new(Rc::from(empty)),
            next_id: Cell::new(0),
        }
    }
}

impl Sources {
    fn rebuild(&self) {
        let list: Vec<Rc<dyn PollSource>> = self
            .entries
            .borrow()
            .iter()
            .map(|e| e.source.clone())
            .collect();
        *self.snapshot.borrow_mut() = Rc::from(list);
    }

    fn list(&self) -> Rc<[Rc<dyn PollSource>]> {
        self.snapshot.borrow().clone()
    }

    /// Whether any source is registered (the loop skips the rest when not).
    pub(crate) fn is_empty(&self) -> bool {
        self.snapshot.borrow().is_empty()
    }

    /// Polls every source; true if any found work.
    pub(crate) fn poll(&self) -> bool {
        if self.is_empty() {
            return false;
        }
        let mut found = false;
        for s in self.list().iter() {
            // Poll all of them, not just up to the first hit: one busy source must
            // not starve the others.
            found |= s.poll();
        }
        found
    }

    /// Arms every source before sleeping; false if one had work (the rest stay
    /// armed, which costs at most a spurious wake-up).
    pub(crate) fn arm(&self) -> bool {
        if self.is_empty() {
            return true;
        }
        self.list().iter().all(|s| s.arm())
    }

    /// Tells every source the thread is awake.
    pub(crate) fn disarm(&self) {
        if self.is_empty() {
            return;
        }
        for s in self.list().iter() {
            s.disarm();
        }
    }

    /// Drops every source (reactor teardown): their doorbell tasks go with them.
    pub(crate) fn clear(&self) {
        let entries = std::mem::take(&mut *self.entries.borrow_mut());
        self.rebuild();
        drop(entries);
    }
}

/// Registers `source` with the current thread's reactor; it is polled until
/// [`remove_poll_source`]. Panics off a reactor thread (a programming error, like
/// any Flame I/O there).
pub fn add_poll_source(source: Rc<dyn PollSource>) -> PollSourceId {
    let doorbell = source.doorbell().map(|fd| {
        super::spawn(async move {
            // Each completed read is a wake-up: the reactor's loop then polls every
            // source. An error (the descriptor was closed under us) ends the task;
            // the source is still polled, just no longer woken by this fd.
            while let Ok(_count) = super::op::doorbell_wait(fd).await {}
        })
    });
    with_current(|r| {
        let sources = r.sources();
        let id = sources.next_id.get();
        sources.next_id.set(id + 1);
        sources.entries.borrow_mut().push(Entry {
            id,
            source,
            _doorbell: doorbell,
        });
        sources.rebuild();
        PollSourceId(id)
    })
}

/// Stops polling a source (its doorbell read is cancelled). Returns false if it was
/// not registered on this thread's reactor.
pub fn remove_poll_source(id: PollSourceId) -> bool {
    with_current(|r| {
        let sources = r.sources();
        let removed = {
            let mut entries = sources.entries.borrow_mut();
            let before = entries.len();
            let gone: Vec<Entry> = entries.extract_if(.., |e| e.id == id.0).collect();
            debug_assert!(gone.len() <= 1, "source ids are unique");
            let removed = entries.len() < before;
            drop(entries);
            drop(gone);
            removed
        };
        sources.rebuild();
        removed
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reactor::{PollMode, Reactor, ReactorConfig, sleep, spawn};
    use crossbeam_queue::ArrayQueue;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::task::{Poll, Waker};
    use std::time::Duration;

    /// A whole ping-pong run takes well under a second; a lost wake-up that some
    /// unrelated completion (a timer's cancellation) happens to rescue shows up as
    /// rounds of hundreds of milliseconds, caught by this bound.
    const ROUNDS_DEADLINE: Duration = Duration::from_secs(20);

    /// A completion queue fed by another thread: the shape of the OSD's staged
    /// reply queue, and of a shm ring whose peer is a thread.
    struct QueueSource {
        queue: Arc<ArrayQueue<u64>>,
        got: Cell<u64>,
        waiter: Cell<Option<Waker>>,
        polls: Cell<u64>,
    }

    impl PollSource for QueueSource {
        fn poll(&self) -> bool {
            self.polls.set(self.polls.get() + 1);
            let mut found = false;
            while let Some(v) = self.queue.pop() {
                self.got.set(self.got.get() + v);
                found = true;
            }
            if found && let Some(w) = self.waiter.take() {
                w.wake();
            }
            found
        }
        fn arm(&self) -> bool {
            self.queue.is_empty()
        }
    }

    impl QueueSource {
        async fn wait_for(&self, total: u64) -> bool {
            let wait = std::future::poll_fn(|cx| {
                if self.got.get() >= total {
                    Poll::Ready(true)
                } else {
                    self.waiter.set(Some(cx.waker().clone()));
                    Poll::Pending
                }
            });
            futures_lite::future::or(wait, async {
                sleep(Duration::from_secs(5)).await;
                false
            })
            .await
        }
    }

    /// Ping-pong with a producer thread that publishes into the queue and wakes the
    /// reactor through its handle; the reactor often sleeps in between. A lost
    /// wake-up shows as a 5 s timeout.
    fn cross_thread_queue(mode: PollMode, rounds: u64) {
        let mut r = Reactor::new(ReactorConfig {
            poll_mode: mode,
            ..Default::default()
        })
        .unwrap();
        let handle = r.handle();
        let queue = Arc::new(ArrayQueue::new(64));
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let q = queue.clone();
        let producer = std::thread::spawn(move || {
            for _ in rx.iter().take(rounds as usize) {
                assert!(q.push(1).is_ok());
                handle.wake();
            }
        });
        let ok = r
            .block_on(async move {
                let src = Rc::new(QueueSource {
                    queue,
                    got: Cell::new(0),
                    waiter: Cell::new(None),
                    polls: Cell::new(0),
                });
                let id = add_poll_source(src.clone());
                let started = std::time::Instant::now();
                for i in 1..=rounds {
                    tx.send(()).unwrap();
                    if !src.wait_for(i).await || started.elapsed() > ROUNDS_DEADLINE {
                        return false;
                    }
                }
                assert!(src.polls.get() >= rounds);
                assert!(remove_poll_source(id));
                assert!(!remove_poll_source(id));
                true
            })
            .unwrap();
        assert!(ok, "wake-up lost ({mode:?})");
        producer.join().unwrap();
        let stats = r.poll_stats();
        assert!(stats.polls >= rounds, "polls {}", stats.polls);
        if mode == PollMode::Interrupt {
            assert!(stats.sleeps > 0);
            assert_eq!(stats.empty_polls, 0);
        }
    }

    #[test]
    fn cross_thread_source_interrupt() {
        cross_thread_queue(PollMode::Interrupt, 5000);
    }

    #[test]
    fn cross_thread_source_adaptive() {
        cross_thread_queue(PollMode::Adaptive, 5000);
    }

    #[test]
    fn cross_thread_source_busy() {
        cross_thread_queue(PollMode::Busy, 2000);
    }

    /// A source whose peer (here a thread, in general another process) rings an
    /// eventfd only while the source is armed: the shm transport's doorbell.
    struct DoorbellSource {
        work: Arc<ArrayQueue<u64>>,
        armed: Arc<AtomicBool>,
        efd: OwnedFd,
        got: Cell<u64>,
        waiter: Cell<Option<Waker>>,
    }

    impl PollSource for DoorbellSource {
        fn poll(&self) -> bool {
            let mut found = false;
            while let Some(v) = self.work.pop() {
                self.got.set(self.got.get() + v);
                found = true;
            }
            if found && let Some(w) = self.waiter.take() {
                w.wake();
            }
            found
        }
        fn arm(&self) -> bool {
            self.armed.store(true, Ordering::SeqCst);
            std::sync::atomic::fence(Ordering::SeqCst);
            self.work.is_empty()
        }
        fn disarm(&self) {
            self.armed.store(false, Ordering::Relaxed);
        }
        fn doorbell(&self) -> Option<RawFd> {
            Some(self.efd.as_raw_fd())
        }
    }

    fn doorbell_rounds(mode: PollMode, rounds: u64) {
        // SAFETY: eventfd returns a new descriptor or -1 (checked).
        let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: raw is a fresh descriptor we own.
        let efd = unsafe { OwnedFd::from_raw_fd(raw) };
        let peer_fd = efd.as_raw_fd();
        let work = Arc::new(ArrayQueue::new(64));
        let armed = Arc::new(AtomicBool::new(false));
        let mut r = Reactor::new(ReactorConfig {
            poll_mode: mode,
            ..Default::default()
        })
        .unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (w, a) = (work.clone(), armed.clone());
        // The peer knows nothing of the reactor: only the queue, the flag and the
        // eventfd (what a process on the other end of a memfd ring would have).
        let peer = std::thread::spawn(move || {
            let mut rings = 0u64;
            for _ in rx.iter().take(rounds as usize) {
                assert!(w.push(1).is_ok());
                std::sync::atomic::fence(Ordering::SeqCst);
                if a.swap(false, Ordering::SeqCst) {
                    let one: u64 = 1;
                    // SAFETY: writing 8 bytes from a valid u64 to an eventfd.
                    let n = unsafe {
                        libc::write(peer_fd, &one as *const u64 as *const libc::c_void, 8)
                    };
                    assert_eq!(n, 8);
                    rings += 1;
                }
            }
            rings
        });
        let ok = r
            .block_on(async move {
                let src = Rc::new(DoorbellSource {
                    work,
                    armed,
                    efd,
                    got: Cell::new(0),
                    waiter: Cell::new(None),
                });
                let started = std::time::Instant::now();
                let baseline = with_current(|r| r.ops_in_flight());
                let id = add_poll_source(src.clone());
                for i in 1..=rounds {
                    tx.send(()).unwrap();
                    let wait = std::future::poll_fn(|cx| {
                        if src.got.get() >= i {
                            Poll::Ready(true)
                        } else {
                            src.waiter.set(Some(cx.waker().clone()));
                            Poll::Pending
                        }
                    });
                    let ok = futures_lite::future::or(wait, async {
                        sleep(Duration::from_secs(5)).await;
                        false
                    })
                    .await;
                    if !ok || started.elapsed() > ROUNDS_DEADLINE {
                        return false;
                    }
                }
                // Removing the source cancels its posted doorbell read.
                assert!(remove_poll_source(id));
                for _ in 0..100 {
                    if with_current(|r| r.ops_in_flight()) <= baseline {
                        break;
                    }
                    sleep(Duration::from_millis(2)).await;
                }
                assert_eq!(with_current(|r| r.ops_in_flight()), baseline);
                true
            })
            .unwrap();
        assert!(ok, "doorbell wake-up lost ({mode:?})");
        let rings = peer.join().unwrap();
        if mode == PollMode::Interrupt {
            // Rounds where the reactor was asleep were woken by the doorbell alone
            // (no timer, no handle): the reactor waits on it through io_uring.
            // (The others found the work while arming: the peer was quicker.)
            assert!(rings > 0, "{rings} rings for {rounds} rounds");
        }
    }

    #[test]
    fn doorbell_source_interrupt() {
        doorbell_rounds(PollMode::Interrupt, 3000);
    }

    #[test]
    fn doorbell_source_adaptive() {
        doorbell_rounds(PollMode::Adaptive, 3000);
    }

    #[test]
    fn a_source_may_remove_itself_while_polled() {
        struct Once(Cell<Option<PollSourceId>>, Rc<Cell<u32>>);
        impl PollSource for Once {
            fn poll(&self) -> bool {
                self.1.set(self.1.get() + 1);
                if let Some(id) = self.0.take() {
                    assert!(remove_poll_source(id));
                }
                false
            }
            fn arm(&self) -> bool {
                true
            }
        }
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let count = Rc::new(Cell::new(0));
            let src = Rc::new(Once(Cell::new(None), count.clone()));
            let id = add_poll_source(src.clone());
            src.0.set(Some(id));
            spawn(async {}).await;
            sleep(Duration::from_millis(5)).await;
            assert_eq!(count.get(), 1, "polled once, then gone");
        })
        .unwrap();
    }
}
