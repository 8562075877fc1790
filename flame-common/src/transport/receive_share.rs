//! Each source's share of the thread's memory pool for the payloads it has
//! begun to send: one slow host cannot take the pool from everyone else.
//!
//! A stream receive takes its payload's whole buffer from the pool as soon as
//! the header has arrived, so the payload can land in it without a copy. A peer
//! that sends a 4 MiB WRITE header and then trickles holds those 4 MiB until its
//! payload deadline closes it; peers that keep arriving that way keep the pool
//! empty, and every other client's receive waits for memory (the siege test
//! measured fio three times slower while they came).
//!
//! So the unfinished payloads of one source (an IP address, an IPv6 host by
//! its /64, all local peers as one: [`share_key`]) hold at most the thread's
//! share ([`crate::buffer::registered::source_share_bytes`]: a quarter of its
//! pool, at least two of the largest payloads) — always at least one payload,
//! so a source alone never waits for itself. A receive over its source's share
//! waits its turn (first come, first served, woken when the source gives bytes
//! back) without holding pool memory and without reading its socket
//! (back-pressure), for at most the pool's `exhausted_wait_ms`; then the
//! connection is closed, as on an exhausted pool. The caller counts the wait
//! against the connection's payload deadline. The share is given back as
//! soon as the payload is whole: what becomes of the buffer then is bounded by
//! the connection's in-flight limit.
//!
//! A payload already whole in the connection's receive buffer takes no share
//! (it waits for nobody): the small messages of the data path pay nothing.
//! [`ShareBook`] decides; [`take`] waits on the calling thread's book.

use super::bring_up::Source;
use crate::buffer::registered;
use crate::node::{NodeLocal, NodeLocalKey};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io;
use std::marker::PhantomData;
use std::net::{IpAddr, Ipv6Addr};
use std::pin::Pin;
use std::rc::Rc;
use std::sync::LazyLock;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

/// The bytes of unfinished payloads each source holds on one thread, against
/// one share for every source. Entries are removed at zero, so the map is
/// bounded by the connections receiving a payload at once.
#[derive(Debug)]
pub struct ShareBook {
    held: HashMap<Source, u64>,
    share_bytes_max: u64,
}

impl Default for ShareBook {
    /// A book with this thread's share
    /// ([`registered::thread_source_share_bytes`]).
    fn default() -> ShareBook {
        ShareBook::new(registered::thread_source_share_bytes())
    }
}

impl ShareBook {
    /// A book giving each source at most `share_bytes_max` at once (beyond one
    /// payload).
    pub fn new(share_bytes_max: u64) -> ShareBook {
        ShareBook {
            held: HashMap::new(),
            share_bytes_max,
        }
    }

    /// Takes `bytes` for `source` if they fit in its share, or if it holds
    /// nothing (one payload always fits). Returns whether it took them.
    pub fn try_take(&mut self, source: Source, bytes: u64) -> bool {
        let held = self.held(source);
        if held > 0 && held.saturating_add(bytes) > self.share_bytes_max {
            return false;
        }
        self.held.insert(source, held.saturating_add(bytes));
        true
    }

    /// Gives back `bytes` `source` took.
    pub fn give_back(&mut self, source: Source, bytes: u64) {
        let Some(held) = self.held.get_mut(&source) else {
            debug_assert!(false, "{source:?} gives back {bytes} bytes it never took");
            return;
        };
        debug_assert!(*held >= bytes, "{source:?} gives back more than it holds");
        *held = held.saturating_sub(bytes);
        if *held == 0 {
            self.held.remove(&source);
        }
    }

    /// What `source` holds now.
    pub fn held(&self, source: Source) -> u64 {
        self.held.get(&source).copied().unwrap_or(0)
    }

    /// How many sources hold something.
    pub fn sources(&self) -> usize {
        self.held.len()
    }

    /// Sets the share (the thread's pool may be installed after the book was
    /// first used).
    pub fn set_share_bytes_max(&mut self, bytes: u64) {
        self.share_bytes_max = bytes;
    }
}

thread_local! {
    static BOOK: NodeLocal<RefCell<ShareBook>> = const { NodeLocal::new(|| RefCell::new(ShareBook::default())) };
}

static SHARE_WAITS: LazyLock<prometheus::IntCounter> = LazyLock::new(|| {
    prometheus::register_int_counter!(
        "flame_receive_share_waits_total",
        "Payload receives that waited because their source's unfinished payloads held its share of the thread's memory pool"
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static SHARE_CLOSES: LazyLock<prometheus::IntCounter> = LazyLock::new(|| {
    prometheus::register_int_counter!(
        "flame_receive_share_closes_total",
        "Connections closed because their source's share of the memory pool stayed held for the pool's exhausted_wait_ms"
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});

/// Makes the share metrics appear from the start (0 before any wait): every
/// connection that takes shares calls it when it is made.
pub fn register_metrics() {
    LazyLock::force(&SHARE_WAITS);
    LazyLock::force(&SHARE_CLOSES);
}

/// A source's hold on part of its share: given back when dropped, on the
/// thread that took it (hence not `Send`).
#[derive(Debug)]
pub struct ReceiveShare {
    source: Source,
    bytes: u64,
    _thread: PhantomData<Rc<()>>,
}

impl Drop for ReceiveShare {
    fn drop(&mut self) {
        if self.bytes > 0 {
            BOOK.with_node(|b| b.borrow_mut().give_back(self.source, self.bytes));
            wake_first(self.source);
        }
    }
}

/// The key a peer's share is kept under: its IPv4 address (an IPv4-mapped
/// IPv6 address is the IPv4 one), the /64 of an IPv6 address (a host holds a
/// whole /64, so one address each would give it as many shares as it likes),
/// or [`Source::Local`].
pub fn share_key(source: Source) -> Source {
    match source {
        Source::Ip(IpAddr::V6(v6)) => match v6.to_ipv4_mapped() {
            Some(v4) => Source::Ip(IpAddr::V4(v4)),
            None => {
                let prefix = u128::from(v6) & !((1u128 << 64) - 1);
                Source::Ip(IpAddr::V6(Ipv6Addr::from(prefix)))
            }
        },
        other => other,
    }
}

/// Takes `bytes` of `source`'s share on this thread (the thread's pool's
/// figures). While its other unfinished payloads hold it, or other receives of
/// the same source wait before this one, waits in turn (first come, first
/// served: a large payload is not starved by smaller ones arriving after it),
/// woken when the source gives bytes back, not polling, for at most the
/// pool's `exhausted_wait_ms`. The error names the source and closes the
/// connection that asked.
pub async fn take(source: Source, bytes: u64) -> io::Result<ReceiveShare> {
    let source = share_key(source);
    let taken = || ReceiveShare {
        source,
        bytes,
        _thread: PhantomData,
    };
    let queued = WAITING.with_node(|w| w.borrow().contains_key(&source));
    if !queued && try_take(source, bytes) {
        return Ok(taken());
    }
    SHARE_WAITS.inc();
    let wait = Duration::from_millis(registered::thread_wait_ms());
    let turn = ShareWait::new(source, bytes);
    let got = futures_lite::future::or(
        async {
            turn.await;
            true
        },
        async {
            crate::reactor::sleep(wait).await;
            false
        },
    )
    .await;
    if got {
        return Ok(taken());
    }
    SHARE_CLOSES.inc();
    Err(io::Error::new(
        io::ErrorKind::OutOfMemory,
        format!(
            "the unfinished payloads from {source:?} held its share of the memory pool \
             ({} bytes) for {} ms",
            BOOK.with_node(|b| b.borrow().held(source)),
            wait.as_millis()
        ),
    ))
}

/// One source's waiting receives, first in line first: wait id and the waker
/// of its last poll.
type WaitLine = VecDeque<(u64, Option<Waker>)>;

thread_local! {
    /// The receives waiting for each source's share, in arrival order, by
    /// wait id (with the waker of their last poll). Only the first may take;
    /// it is woken when the source gives bytes back, and wakes the next when
    /// it took or left. Bounded by the connections receiving at once: each
    /// wait removes itself when dropped; a source without waiters has no
    /// entry.
    static WAITING: NodeLocal<RefCell<HashMap<Source, WaitLine>>> = const { NodeLocal::new(|| RefCell::new(HashMap::new())) };
    static NEXT_WAIT_ID: NodeLocal<Cell<u64>> = const { NodeLocal::new(|| Cell::new(0)) };
}

/// Wakes the first receive waiting for `source`'s share.
fn wake_first(source: Source) {
    let waker = WAITING.with_node(|w| {
        w.borrow()
            .get(&source)
            .and_then(|q| q.front())
            .and_then(|(_, waker)| waker.clone())
    });
    if let Some(waker) = waker {
        waker.wake();
    }
}

/// One receive waiting for its source's share: queued at creation, ready once
/// it was first in line and took the bytes.
struct ShareWait {
    source: Source,
    bytes: u64,
    id: u64,
}

impl ShareWait {
    fn new(source: Source, bytes: u64) -> ShareWait {
        let id = NEXT_WAIT_ID.with_node(|n| {
            let id = n.get();
            n.set(id.wrapping_add(1));
            id
        });
        WAITING.with_node(|w| {
            w.borrow_mut()
                .entry(source)
                .or_default()
                .push_back((id, None))
        });
        ShareWait { source, bytes, id }
    }

    /// Leaves the queue; when it was first, the next in line may take now.
    fn leave(&self) {
        let was_first = WAITING.with_node(|w| {
            let mut w = w.borrow_mut();
            let Some(q) = w.get_mut(&self.source) else {
                return false;
            };
            let first = q.front().is_some_and(|(id, _)| *id == self.id);
            q.retain(|(id, _)| *id != self.id);
            if q.is_empty() {
                w.remove(&self.source);
            }
            first
        });
        if was_first {
            wake_first(self.source);
        }
    }
}

impl Future for ShareWait {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let first = WAITING.with_node(|w| {
            let mut w = w.borrow_mut();
            let Some(q) = w.get_mut(&self.source) else {
                return false;
            };
            if let Some((_, waker)) = q.iter_mut().find(|(id, _)| *id == self.id) {
                *waker = Some(cx.waker().clone());
            }
            q.front().is_some_and(|(id, _)| *id == self.id)
        });
        if first && try_take(self.source, self.bytes) {
            // Taken: out of the line, and the next may fit too.
            self.leave();
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

impl Drop for ShareWait {
    fn drop(&mut self) {
        self.leave();
    }
}

/// Takes `bytes` for `source` from this thread's book, under the thread's
/// current share (the pool's installer sets it).
fn try_take(source: Source, bytes: u64) -> bool {
    BOOK.with_node(|b| {
        let mut b = b.borrow_mut();
        b.set_share_bytes_max(registered::thread_source_share_bytes());
        b.try_take(source, bytes)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;

    fn ip(last: u8) -> Source {
        Source::Ip(IpAddr::V4(Ipv4Addr::new(127, 0, 0, last)))
    }

    #[test]
    fn one_source_holds_at_most_its_share_and_others_are_not_held_up() {
        let mut book = ShareBook::new(8 << 20);
        // One payload always fits, even one larger than the share.
        assert!(book.try_take(ip(1), 16 << 20));
        assert!(!book.try_take(ip(1), 1));
        book.give_back(ip(1), 16 << 20);
        assert_eq!(book.sources(), 0, "entries go at zero");
        // Up to the share, then no more from that source...
        assert!(book.try_take(ip(1), 4 << 20));
        assert!(book.try_take(ip(1), 4 << 20));
        assert!(!book.try_take(ip(1), 4 << 20));
        assert_eq!(book.held(ip(1)), 8 << 20);
        // ...while every other source has its own.
        assert!(book.try_take(ip(2), 4 << 20));
        assert!(book.try_take(Source::Local, 8 << 20));
        assert!(!book.try_take(Source::Local, 1));
        // Given back, the share takes again.
        book.give_back(ip(1), 4 << 20);
        assert!(book.try_take(ip(1), 4 << 20));
        for (s, b) in [
            (ip(1), 8u64 << 20),
            (ip(2), 4 << 20),
            (Source::Local, 8 << 20),
        ] {
            book.give_back(s, b);
        }
        assert_eq!(book.sources(), 0);
    }

    #[test]
    fn ipv6_hosts_share_by_their_64_and_mapped_ipv4_is_ipv4() {
        let v6 = |s: &str| Source::Ip(s.parse().unwrap());
        assert_eq!(
            share_key(v6("2001:db8:1:2:aaaa::1")),
            share_key(v6("2001:db8:1:2:bbbb::9"))
        );
        assert_ne!(
            share_key(v6("2001:db8:1:2::1")),
            share_key(v6("2001:db8:1:3::1"))
        );
        assert_eq!(share_key(v6("::ffff:127.0.0.5")), ip(5));
        assert_eq!(share_key(ip(5)), ip(5));
        assert_eq!(share_key(Source::Local), Source::Local);
    }

    /// Waiters take in arrival order: a large payload waiting first is not
    /// overtaken by smaller ones that would fit sooner.
    #[test]
    fn waiters_take_their_turn_in_arrival_order() {
        use crate::reactor::{Reactor, ReactorConfig};
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            registered::set_thread_source_share_bytes(8 << 20);
            let held = take(ip(20), 6 << 20).await.unwrap();
            let order = Rc::new(RefCell::new(Vec::new()));
            let (o1, o2) = (order.clone(), order.clone());
            // 4 MiB does not fit beside 6; 1 MiB would, but comes later.
            let big = crate::reactor::spawn(async move {
                let s = take(ip(20), 4 << 20).await.unwrap();
                o1.borrow_mut().push("big");
                s
            });
            crate::reactor::sleep(Duration::from_millis(5)).await;
            let small = crate::reactor::spawn(async move {
                let s = take(ip(20), 1 << 20).await.unwrap();
                o2.borrow_mut().push("small");
                s
            });
            crate::reactor::sleep(Duration::from_millis(20)).await;
            assert!(
                order.borrow().is_empty(),
                "the small one overtook: {:?}",
                order.borrow()
            );
            drop(held);
            let (b, sm) = (big.await, small.await);
            assert_eq!(*order.borrow(), ["big", "small"]);
            drop((b, sm));
            assert_eq!(BOOK.with_node(|b| b.borrow().sources()), 0);
            assert!(WAITING.with_node(|w| w.borrow().is_empty()));
        })
        .unwrap();
    }

    #[test]
    fn a_receive_over_its_share_waits_for_a_give_back_and_fails_past_the_bound() {
        use crate::reactor::{Reactor, ReactorConfig};
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            registered::set_thread_source_share_bytes(4 << 20);
            let first = take(ip(9), 4 << 20).await.unwrap();
            // Another source is not held up.
            let other = take(ip(10), 4 << 20).await.unwrap();
            // The same source waits until the first is given back.
            let done = Rc::new(std::cell::Cell::new(false));
            let flag = done.clone();
            let waiter = crate::reactor::spawn(async move {
                let s = take(ip(9), 1 << 20).await;
                flag.set(true);
                s.map(|s| s.bytes)
            });
            crate::reactor::sleep(Duration::from_millis(20)).await;
            assert!(!done.get(), "took beyond its share");
            drop(first);
            assert_eq!(waiter.await.unwrap(), 1 << 20);
            drop(other);
            // Held past the wait bound: an error naming the source, nothing kept.
            registered::set_thread_wait_ms(30);
            let held = take(ip(11), 4 << 20).await.unwrap();
            let err = take(ip(11), 4 << 20).await.unwrap_err();
            assert!(err.to_string().contains("127.0.0.11"), "{err}");
            drop(held);
            assert_eq!(BOOK.with_node(|b| b.borrow().sources()), 0);
            assert!(
                WAITING.with_node(|w| w.borrow().is_empty()),
                "a wait left its waker"
            );
        })
        .unwrap();
    }
}
