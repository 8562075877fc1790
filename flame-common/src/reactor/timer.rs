//! Timers kept by the reactor itself, not by the kernel.
//!
//! # Why not an io_uring `TIMEOUT` per sleep
//! Most timers on the data path never fire: a primary arms one per replica forward
//! (`call_timeout`) and drops it when the replica answers, microseconds later. As a
//! ring operation each such timer cost a `TIMEOUT` entry, an `ASYNC_CANCEL` entry,
//! two completions and a boxed timespec; `perf` showed the kernel's timeout and
//! cancel paths at about 2 % of an OSD shard's CPU under 4 KiB QD32 writes. Here a
//! timer is an entry in an ordered map owned by the thread's reactor: arming and
//! dropping it touch only that map, and the reactor's one blocking wait carries the
//! earliest deadline as its own timeout (`io_uring_enter` with `EXT_ARG`).
//!
//! Single-threaded like the reactor: a [`Sleep`] is polled and dropped on the
//! thread whose reactor armed it.

use super::executor::{try_with_current, with_current};
use crate::clock;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// A timer's place in the map: its deadline, then a sequence number that makes
/// equal deadlines distinct.
type TimerKey = (Instant, u64);

/// The armed timers of one reactor, earliest first.
#[derive(Default)]
pub(crate) struct Timers {
    map: RefCell<BTreeMap<TimerKey, Waker>>,
    next_seq: Cell<u64>,
}

impl Timers {
    fn arm(&self, deadline: Instant, waker: Waker) -> TimerKey {
        let seq = self.next_seq.get();
        self.next_seq.set(seq.wrapping_add(1));
        let key = (deadline, seq);
        self.map.borrow_mut().insert(key, waker);
        key
    }

    /// Replaces the waker of a still-armed timer; false if it already fired.
    fn rearm(&self, key: TimerKey, waker: &Waker) -> bool {
        match self.map.borrow_mut().get_mut(&key) {
            Some(w) => {
                if !w.will_wake(waker) {
                    *w = waker.clone();
                }
                true
            }
            None => false,
        }
    }

    fn disarm(&self, key: TimerKey) {
        self.map.borrow_mut().remove(&key);
    }

    /// Wakes every timer whose deadline has passed; returns how many. Bounded by
    /// the number of armed timers.
    pub(crate) fn fire(&self) -> usize {
        if self.map.borrow().is_empty() {
            return 0;
        }
        let now = clock::now();
        let mut fired = 0;
        loop {
            // Take one entry at a time: waking runs no task code (it only queues
            // the task), but keep the borrow short anyway.
            let due = {
                let mut map = self.map.borrow_mut();
                match map.first_key_value() {
                    Some((&(deadline, _), _)) if deadline <= now => map.pop_first(),
                    _ => None,
                }
            };
            let Some((_, waker)) = due else {
                return fired;
            };
            waker.wake();
            fired += 1;
        }
    }

    /// Whether the earliest timer is due (the spinning idle loop's check).
    pub(crate) fn due(&self) -> bool {
        self.map
            .borrow()
            .first_key_value()
            .is_some_and(|(&(deadline, _), _)| deadline <= clock::now())
    }

    /// How long the reactor may sleep before the earliest timer is due (`None`:
    /// no timer armed, sleep until a completion).
    pub(crate) fn until_next(&self) -> Option<Duration> {
        self.map
            .borrow()
            .first_key_value()
            .map(|(&(deadline, _), _)| deadline.saturating_duration_since(clock::now()))
    }

    /// The earliest armed deadline.
    pub(crate) fn earliest(&self) -> Option<Instant> {
        self.map.borrow().first_key_value().map(|(&(d, _), _)| d)
    }

    /// Drops every waker (reactor teardown).
    pub(crate) fn clear(&self) {
        let all = std::mem::take(&mut *self.map.borrow_mut());
        drop(all);
    }
}

/// The future of [`sleep`].
#[must_use = "a Sleep does nothing unless awaited"]
pub struct Sleep {
    /// `None`: never (the duration overflowed `Instant`).
    deadline: Option<Instant>,
    key: Option<TimerKey>,
}

impl Future for Sleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let Some(deadline) = self.deadline else {
            return Poll::Pending;
        };
        if clock::now() >= deadline {
            if let Some(key) = self.key.take() {
                with_current(|r| r.timers().disarm(key));
            }
            return Poll::Ready(());
        }
        let key = self.key;
        let armed = key.is_some_and(|k| with_current(|r| r.timers().rearm(k, cx.waker())));
        if !armed {
            // First poll, or fired early by a clock read just before the deadline
            // (then the next `now` check above completes it): arm (again).
            self.key = Some(with_current(|r| {
                r.timers().arm(deadline, cx.waker().clone())
            }));
        }
        Poll::Pending
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            try_with_current(|r| r.timers().disarm(key));
        }
    }
}

/// Completes after `duration` on the current thread's reactor. Dropping it before
/// then disarms it (no system call either way). Call it on a reactor thread.
pub fn sleep(duration: Duration) -> Sleep {
    Sleep {
        deadline: clock::now().checked_add(duration),
        key: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reactor::{Reactor, ReactorConfig, spawn};

    #[test]
    fn sleeps_complete_in_deadline_order_and_dropped_ones_never_fire() {
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let order = std::rc::Rc::new(RefCell::new(Vec::new()));
            let mut tasks = Vec::new();
            for (i, ms) in [30u64, 10, 20].into_iter().enumerate() {
                let o = order.clone();
                tasks.push(spawn(async move {
                    sleep(Duration::from_millis(ms)).await;
                    o.borrow_mut().push(i);
                }));
            }
            // A long timer raced by a short one: dropped, it must leave no entry.
            let start = clock::now();
            futures_lite::future::or(
                sleep(Duration::from_secs(3600)),
                sleep(Duration::from_millis(5)),
            )
            .await;
            assert!(clock::elapsed(start) < Duration::from_secs(1));
            for t in tasks {
                t.await;
            }
            assert_eq!(*order.borrow(), vec![1, 2, 0]);
            assert!(clock::elapsed(start) >= Duration::from_millis(30));
            with_current(|r| assert!(r.timers().until_next().is_none(), "a timer left armed"));
            // Never (overflowing) and zero durations.
            futures_lite::future::or(sleep(Duration::MAX), sleep(Duration::ZERO)).await;
        })
        .unwrap();
    }
}
