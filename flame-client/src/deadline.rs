//! Cheap per-request deadlines.
//!
//! Every request is bounded by `io_timeout_ms`. This table predates the reactor's
//! own timers (`reactor::sleep` is now an entry in the reactor's map, disarmed at
//! once when dropped; it used to be an io_uring timer left orphaned for its full
//! duration). It is kept because one entry per request in a hash map is still a
//! little cheaper than an ordered-map entry, and deadlines this coarse do not need
//! the precision. Each thread
//! keeps a table of pending deadlines and one ticker task that wakes every
//! [`TICK`] while the table is not empty and wakes the expired ones. A deadline that
//! is dropped (the request finished first) removes its entry at once. Deadlines are
//! therefore up to one tick late, which is fine for timeouts measured in seconds.

use flame_common::clock;
use flame_common::collections::HashMap;
use flame_common::node::{NodeLocal, NodeLocalKey};
use flame_common::reactor;
use std::cell::{Cell, RefCell};

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

/// Granularity of deadlines.
pub const TICK: Duration = Duration::from_millis(10);

#[derive(Default)]
struct Table {
    next_key: u64,
    entries: HashMap<u64, (Instant, Waker)>,
    /// Whether a ticker task runs, and on which reactor.
    ticker: Option<u64>,
}

// Per process (per simulated node: `flame_common::node`): a node's ticker wakes
// its own deadlines only.
thread_local! {
    static TABLE: NodeLocal<RefCell<Table>> = const { NodeLocal::new(|| RefCell::new(Table::default())) };
    static TICKS: NodeLocal<Cell<u64>> = const { NodeLocal::new(|| Cell::new(0)) };
}

/// Resolves at (or up to one [`TICK`] after) `at`. Must be polled on a reactor
/// thread.
pub struct Deadline {
    at: Instant,
    key: Option<u64>,
}

impl Deadline {
    /// A deadline at `at`.
    pub fn at(at: Instant) -> Deadline {
        Deadline { at, key: None }
    }
}

impl Future for Deadline {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if clock::now() >= self.at {
            if let Some(k) = self.key.take() {
                TABLE.with_node(|t| t.borrow_mut().entries.remove(&k));
            }
            return Poll::Ready(());
        }
        let at = self.at;
        let key = self.key;
        let (key, start_ticker) = TABLE.with_node(|t| {
            let mut t = t.borrow_mut();
            let key = match key {
                Some(k) if t.entries.contains_key(&k) => {
                    if let Some(e) = t.entries.get_mut(&k)
                        && !e.1.will_wake(cx.waker())
                    {
                        e.1 = cx.waker().clone();
                    }
                    k
                }
                _ => {
                    let k = t.next_key;
                    t.next_key += 1;
                    t.entries.insert(k, (at, cx.waker().clone()));
                    k
                }
            };
            // A ticker of an earlier reactor on this thread is gone with it.
            let current = reactor::current_id();
            let start = t.ticker.is_none() || t.ticker != current;
            if start {
                t.ticker = current;
            }
            (key, start)
        });
        self.key = Some(key);
        if start_ticker {
            reactor::spawn(ticker()).detach();
        }
        Poll::Pending
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        if let Some(k) = self.key.take() {
            let _ = TABLE.try_with_node(|t| {
                if let Ok(mut t) = t.try_borrow_mut() {
                    t.entries.remove(&k);
                }
            });
        }
    }
}

/// Wakes expired deadlines every tick until none is pending.
async fn ticker() {
    let me = reactor::current_id();
    loop {
        reactor::sleep(TICK).await;
        TICKS.with_node(|n| n.set(n.get() + 1));
        let now = clock::now();
        let (expired, stop) = TABLE.with_node(|t| {
            let mut t = t.borrow_mut();
            if t.ticker != me {
                // Replaced (a new reactor took over this thread).
                return (Vec::new(), true);
            }
            let expired: Vec<Waker> = t
                .entries
                .values()
                .filter(|(at, _)| *at <= now)
                .map(|(_, w)| w.clone())
                .collect();
            let stop = t.entries.is_empty();
            if stop {
                t.ticker = None;
            }
            (expired, stop)
        });
        for w in expired {
            w.wake();
        }
        if stop {
            return;
        }
    }
}

/// Deadlines pending on this thread (tests).
pub fn pending() -> usize {
    TABLE.with_node(|t| t.borrow().entries.len())
}

/// Ticks run on this thread so far (tests: the ticker stops when idle).
pub fn ticks() -> u64 {
    TICKS.with_node(|n| n.get())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::reactor::{Reactor, ReactorConfig, sleep};

    #[test]
    fn fires_late_by_at_most_a_few_ticks_and_cleans_up() {
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let t0 = clock::now();
            Deadline::at(t0 + Duration::from_millis(50)).await;
            let took = clock::elapsed(t0);
            assert!(took >= Duration::from_millis(50), "{took:?}");
            assert!(took < Duration::from_millis(500), "{took:?}");
            assert_eq!(pending(), 0);

            // A deadline that loses a race is removed at once.
            let fast = async { 1 };
            let slow = async {
                Deadline::at(clock::now() + Duration::from_secs(30)).await;
                2
            };
            // Poll the slow one first so it registers, then let the fast one win.
            let v = futures_lite::future::or(
                async {
                    sleep(Duration::from_millis(5)).await;
                    fast.await
                },
                slow,
            )
            .await;
            assert_eq!(v, 1);
            assert_eq!(pending(), 0);

            // The ticker stops once nothing is pending.
            sleep(TICK * 5).await;
            let before = ticks();
            sleep(TICK * 10).await;
            assert_eq!(ticks(), before, "ticker kept running while idle");

            // Already expired: ready at once, nothing registered.
            Deadline::at(clock::now() - Duration::from_millis(1)).await;
            assert_eq!(pending(), 0);
        })
        .unwrap();
    }
}
