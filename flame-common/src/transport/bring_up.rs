//! Bringing accepted connections up without holding up the listener: the
//! machinery every listener whose connections need a handshake before they are
//! connections uses (the rdma listener's bootstraps, the shm listener's
//! memory-sharing handshakes), written once.
//!
//! Each accepted connection is brought up by a task of its own, within a
//! deadline in all, at most [`BRING_UPS_MAX`] at once per listener and
//! [`BRING_UPS_PER_SOURCE_MAX`] per source, so a peer that connects and sends
//! nothing holds one of those slots until its deadline, never the listener
//! (which a handshake run in the accept loop itself would: one silent peer
//! after another, each for the whole deadline).
//!
//! The slots live on the thread that accepts ([`BringUps::of`], keyed by a
//! listener id from [`listener_id`]): a listener is bound on one thread and
//! moved to the one that accepts, so it holds nothing tied to a thread itself,
//! and forgets its slots when dropped ([`BringUps::forget`]).

use super::{Conn, TransportError};
use crate::node::{NodeLocal, NodeLocalKey};
use crate::reactor;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::IpAddr;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::Duration;

/// Connections one listener brings up at once (each bounded by its deadline);
/// more wait in the kernel's backlog.
pub const BRING_UPS_MAX: usize = 64;

/// Bring-ups one source may have running at once; a connection from a source
/// at its bound is closed at once (before anything is allocated for it), so one
/// host's silent connections hold at most a quarter of [`BRING_UPS_MAX`]. (A
/// client host whose threads all reconnect at once past this bound sees some
/// connections closed; they retry.)
pub const BRING_UPS_PER_SOURCE_MAX: usize = 16;

/// Where a connection comes from, for [`BRING_UPS_PER_SOURCE_MAX`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// A network peer, by address.
    Ip(IpAddr),
    /// A local peer (a Unix socket): all count as one source.
    Local,
}

/// A connection being brought up: the future that does it.
pub type BringUp = Pin<Box<dyn Future<Output = Result<Conn, TransportError>>>>;

/// What one round of a listener's non-blocking accepts found.
pub enum Arrival {
    /// A connection ready as it is (nothing to bring up).
    Ready(Conn),
    /// A connection to bring up from `source`; `peer` names it in the log.
    BringUp {
        /// For the per-source bound.
        source: Source,
        /// The peer, for the log.
        peer: String,
        /// Brings it up.
        task: BringUp,
    },
}

/// A listener's bring-ups on the thread that accepts: the tasks bringing
/// connections up and the connections they brought up, waiting for `accept`.
#[derive(Default)]
pub struct BringUps {
    /// Brought up, not yet handed out.
    done: RefCell<VecDeque<Conn>>,
    /// Tasks still bringing a connection up.
    running: Cell<usize>,
    /// Of those, how many from each source.
    running_from: RefCell<HashMap<Source, usize>>,
    /// The `accept` waiting for `done` (or for room to start another).
    waker: RefCell<Option<Waker>>,
}

thread_local! {
    /// Each listener's bring-ups on this thread, by listener id.
    static BRING_UPS: NodeLocal<RefCell<HashMap<u64, Rc<BringUps>>>> =
        const { NodeLocal::new(|| RefCell::new(HashMap::default())) };
}

static NEXT_LISTENER_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// A new listener's id (process-wide unique), naming its [`BringUps`].
pub fn listener_id() -> u64 {
    NEXT_LISTENER_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
}

impl BringUps {
    /// Listener `id`'s bring-ups on this thread.
    pub fn of(id: u64) -> Rc<BringUps> {
        BRING_UPS.with_node(|m| m.borrow_mut().entry(id).or_default().clone())
    }

    /// Forgets listener `id`'s bring-ups on this thread (its `Drop`):
    /// connections brought up and not accepted close, running bring-ups finish
    /// into nothing (within their deadline).
    pub fn forget(id: u64) {
        let _ = BRING_UPS.try_with_node(|m| m.borrow_mut().remove(&id));
    }

    /// Bring-ups running or brought up and waiting: at most [`BRING_UPS_MAX`].
    fn in_use(&self) -> usize {
        self.running.get() + self.done.borrow().len()
    }

    fn wake(&self) {
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// Brings a connection up in a task of its own, within `deadline` in all;
    /// the connection goes to `done`, a failure to the log. A source already at
    /// [`BRING_UPS_PER_SOURCE_MAX`] is refused (`task` dropped: the connection
    /// closed).
    fn start(self: &Rc<Self>, source: Source, peer: String, deadline: Duration, task: BringUp) {
        {
            let mut running_from = self.running_from.borrow_mut();
            let n = running_from.entry(source).or_insert(0);
            if *n >= BRING_UPS_PER_SOURCE_MAX {
                tracing::warn!(%peer, "refusing a connection: {BRING_UPS_PER_SOURCE_MAX} from this source are being brought up already");
                return;
            }
            *n += 1;
        }
        self.running.set(self.running.get() + 1);
        let ups = self.clone();
        reactor::spawn(async move {
            let result = futures_lite::future::or(task, async move {
                reactor::sleep(deadline).await;
                Err(TransportError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "connection bring-up timed out after {} ms",
                        deadline.as_millis()
                    ),
                )))
            })
            .await;
            ups.running.set(ups.running.get() - 1);
            {
                let mut running_from = ups.running_from.borrow_mut();
                if let Some(n) = running_from.get_mut(&source) {
                    *n -= 1;
                    if *n == 0 {
                        running_from.remove(&source);
                    }
                }
            }
            match result {
                Ok(conn) => ups.done.borrow_mut().push_back(conn),
                Err(e) => tracing::warn!(%peer, "connection bring-up failed: {e}"),
            }
            ups.wake();
        })
        .detach();
    }

    /// The next connection: one brought up, or one `poll_accept` finds ready.
    /// `poll_accept` tries the listener's sockets once without blocking (only
    /// while a slot is free); `fds` are those sockets, waited on for
    /// readability in between, and `deadline` bounds each bring-up.
    pub async fn accept(
        self: &Rc<Self>,
        fds: &[RawFd],
        deadline: Duration,
        mut poll_accept: impl FnMut() -> Result<Option<Arrival>, TransportError>,
    ) -> Result<Conn, TransportError> {
        // Bounded: each round returns, starts a bring-up (at most BRING_UPS_MAX
        // before one finishes) or waits for a connection or a bring-up.
        loop {
            if let Some(conn) = self.done.borrow_mut().pop_front() {
                return Ok(conn);
            }
            let room = self.in_use() < BRING_UPS_MAX;
            if room {
                match poll_accept()? {
                    Some(Arrival::Ready(conn)) => return Ok(conn),
                    Some(Arrival::BringUp { source, peer, task }) => {
                        self.start(source, peer, deadline, task);
                        continue;
                    }
                    None => {}
                }
            }
            let arrival = async {
                if !room {
                    return std::future::pending().await;
                }
                let mut waits: Vec<_> = fds
                    .iter()
                    .map(|&fd| Box::pin(reactor::poll_readable(fd)))
                    .collect();
                let polled = std::future::poll_fn(|cx| {
                    for w in &mut waits {
                        if let Poll::Ready(r) = w.as_mut().poll(cx) {
                            return Poll::Ready(r.map(|_| ()));
                        }
                    }
                    Poll::Pending
                })
                .await;
                if polled.is_err() {
                    // A listener-level failure: do not let the caller spin.
                    reactor::sleep(Duration::from_millis(100)).await;
                }
                polled.map_err(TransportError::from)
            };
            // Ready when a bring-up finished (with a connection or with room).
            let in_use = self.in_use();
            let finished = std::future::poll_fn(|cx| {
                if self.in_use() != in_use || !self.done.borrow().is_empty() {
                    Poll::Ready(Ok(()))
                } else {
                    *self.waker.borrow_mut() = Some(cx.waker().clone());
                    Poll::Pending
                }
            });
            futures_lite::future::or(finished, arrival).await?;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reactor::{Reactor, ReactorConfig};

    /// Counts the bring-ups dropped (refused, or cut at their deadline).
    struct Dropped(Rc<Cell<usize>>);

    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.set(self.0.get() + 1);
        }
    }

    /// A bring-up that never finishes by itself.
    fn silent(dropped: &Rc<Cell<usize>>) -> BringUp {
        let d = Dropped(dropped.clone());
        Box::pin(async move {
            let _d = d;
            std::future::pending().await
        })
    }

    /// A source at its bound is refused at once (its connection dropped), other
    /// sources are not, and a bring-up past its deadline gives its slot back.
    #[test]
    fn a_source_at_its_bound_is_refused_and_a_deadline_frees_the_slot() {
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let id = listener_id();
            let ups = BringUps::of(id);
            let dropped = Rc::new(Cell::new(0));
            let a = Source::Ip("10.0.0.1".parse().unwrap());
            let long = Duration::from_secs(60);
            for _ in 0..BRING_UPS_PER_SOURCE_MAX {
                ups.start(a, "a".into(), long, silent(&dropped));
            }
            assert_eq!(
                (ups.running.get(), dropped.get()),
                (BRING_UPS_PER_SOURCE_MAX, 0)
            );
            ups.start(a, "a".into(), long, silent(&dropped));
            assert_eq!(
                (ups.running.get(), dropped.get()),
                (BRING_UPS_PER_SOURCE_MAX, 1)
            );
            ups.start(Source::Local, "local".into(), long, silent(&dropped));
            assert_eq!(ups.running.get(), BRING_UPS_PER_SOURCE_MAX + 1);
            ups.start(
                Source::Local,
                "short".into(),
                Duration::from_millis(10),
                silent(&dropped),
            );
            assert_eq!(ups.running.get(), BRING_UPS_PER_SOURCE_MAX + 2);
            // Bounded: until the short one's deadline passed, at most 5 s.
            for _ in 0..500 {
                if dropped.get() == 2 {
                    break;
                }
                reactor::sleep(Duration::from_millis(10)).await;
            }
            assert_eq!(
                (ups.running.get(), dropped.get()),
                (BRING_UPS_PER_SOURCE_MAX + 1, 2)
            );
            assert_eq!(ups.running_from.borrow().get(&Source::Local), Some(&1));
            BringUps::forget(id);
        })
        .unwrap();
    }
}
