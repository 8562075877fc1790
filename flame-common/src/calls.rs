//! Requests in flight on one connection, matched to their replies: the one
//! request/reply multiplexer under a client's OSD connections
//! (`flame-client/src/connection.rs`) and an OSD's replication connections
//! (`flame-osd/src/peers.rs`).
//!
//! Both sides send requests with fresh ids and read replies in whatever order the
//! OSD sends them, so both need the same things, and get them here, checked the
//! same way:
//! * **Admission.** At most `in_flight_max` requests and `bytes_max` payload
//!   bytes wait for replies at once (a request larger than the byte bound goes
//!   alone); a caller beyond waits, first come, first served, so a busy sender
//!   is held back here instead of growing a send queue or being cut off by the
//!   receiver's own bound. Only the first waiter is woken when room frees (it
//!   wakes the next as it goes), so a reply costs one wake, not one per waiter.
//! * **Matching.** A reply to a waiting request must be of the same operation;
//!   another operation, or a request where a reply belongs, is a broken peer:
//!   the connection fails. A reply to an id not waiting is a late one (its
//!   caller gave up) and is dropped.
//! * **Abandoned requests.** A caller that stops waiting (timeout, cancellation)
//!   and keeps something alive for the peer (a client's grant, which the OSD may
//!   still read or write) leaves it among the abandoned until the late reply
//!   comes or the connection ends: a grant must outlive the peer's use of it. At
//!   most `abandoned_max` are kept; a peer that leaves more unanswered is not
//!   answering, and the connection fails (which revokes them all).
//! * **Failure.** One failure ends the connection once: it is closed, every
//!   waiting caller gets the reason at once, the abandoned go (revoking their
//!   grants), and later requests are refused.
//!
//! [`CallBook`] holds the decisions (pure, synchronous, unit-tested branch by
//! branch); [`Calls`] drives it on a reactor thread around a [`Conn`].

use crate::collections::HashMap;
use crate::ids::RequestId;
use crate::protocol::{Message, OpCode};
use crate::transport::Conn;
use futures_channel::oneshot;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::task::{Poll, Waker};

/// How much one connection may have waiting for replies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallLimits {
    /// Requests waiting for their reply at once.
    pub in_flight_max: usize,
    /// Payload bytes of the requests waiting at once (a larger request goes alone).
    pub bytes_max: u64,
    /// Abandoned requests that keep something until their late reply.
    pub abandoned_max: usize,
}

/// Why the calls of a connection failed: the message every waiting caller gets.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct CallFailed(pub String);

/// A request waiting for its reply.
struct Waiting<R, K> {
    op: OpCode,
    bytes: u64,
    tx: oneshot::Sender<Result<R, CallFailed>>,
    keep: Option<K>,
}

/// What a received reply is, for [`CallBook::deliver`].
pub enum Delivery<R, K> {
    /// The reply of a waiting request: hand it to `tx` (with `keep`).
    Waiting {
        tx: oneshot::Sender<Result<R, CallFailed>>,
        keep: Option<K>,
    },
    /// A late reply (its caller gave up): drop it, and what the request kept.
    Late(Option<K>),
}

/// The state of one connection's requests; see the module documentation.
pub struct CallBook<R, K> {
    limits: CallLimits,
    waiting: HashMap<u64, Waiting<R, K>>,
    abandoned: HashMap<u64, K>,
    /// Payload bytes of `waiting`.
    bytes: u64,
    /// Ids are `counter * modulus + residue` (a client's reply slots name
    /// themselves by residue; 1 otherwise).
    counter: u64,
    modulus: u64,
    failed: Option<CallFailed>,
}

impl<R, K> CallBook<R, K> {
    /// No requests yet; ids start at 1.
    pub fn new(limits: CallLimits) -> CallBook<R, K> {
        assert!(
            limits.in_flight_max > 0,
            "a connection must admit a request"
        );
        CallBook {
            limits,
            waiting: HashMap::default(),
            abandoned: HashMap::default(),
            bytes: 0,
            counter: 1,
            modulus: 1,
            failed: None,
        }
    }

    /// Makes request ids `counter * modulus + residue` from now on.
    pub fn set_id_modulus(&mut self, modulus: u64) {
        assert!(modulus > 0);
        self.modulus = modulus;
    }

    /// A fresh request id whose residue is `residue` (`None`: the last one,
    /// `modulus - 1`).
    pub fn next_id(&mut self, residue: Option<u32>) -> RequestId {
        let c = self.counter;
        self.counter = c.wrapping_add(1);
        let m = self.modulus;
        let residue = residue.map_or(m - 1, u64::from);
        assert!(residue < m, "residue {residue} outside modulus {m}");
        RequestId(c.wrapping_mul(m).wrapping_add(residue))
    }

    /// Whether a request of `bytes` payload bytes may be sent now; `Err` once
    /// the connection failed.
    pub fn has_room(&self, bytes: u64) -> Result<bool, CallFailed> {
        if let Some(f) = &self.failed {
            return Err(f.clone());
        }
        let bytes_fit =
            self.bytes == 0 || self.bytes.saturating_add(bytes) <= self.limits.bytes_max;
        Ok(self.waiting.len() < self.limits.in_flight_max && bytes_fit)
    }

    /// Records a sent request. The caller checked [`CallBook::has_room`].
    pub fn insert(
        &mut self,
        id: RequestId,
        op: OpCode,
        bytes: u64,
        keep: Option<K>,
    ) -> Result<oneshot::Receiver<Result<R, CallFailed>>, CallFailed> {
        if let Some(f) = &self.failed {
            return Err(f.clone());
        }
        assert!(
            !self.waiting.contains_key(&id.0) && !self.abandoned.contains_key(&id.0),
            "request id {id} reused while in flight"
        );
        let (tx, rx) = oneshot::channel();
        self.waiting.insert(
            id.0,
            Waiting {
                op,
                bytes,
                tx,
                keep,
            },
        );
        self.bytes += bytes;
        assert!(
            self.waiting.len() <= self.limits.in_flight_max,
            "admitted past the bound"
        );
        Ok(rx)
    }

    /// Takes request `id` out of the waiting ones because its reply came another
    /// way (a client read it from its reply slot): its operation and what it
    /// kept, or `None` if it is no longer waiting.
    pub fn take(&mut self, id: RequestId) -> Option<(OpCode, Option<K>)> {
        let w = self.waiting.remove(&id.0)?;
        self.bytes -= w.bytes;
        Some((w.op, w.keep))
    }

    /// The caller of request `id` stopped waiting. If it was still waiting and
    /// keeps something, that joins the abandoned; `Err` when that makes too many
    /// (the connection has failed then, and the caller closes it).
    pub fn abandon(&mut self, id: RequestId) -> Result<(), CallFailed> {
        let Some(w) = self.waiting.remove(&id.0) else {
            return Ok(());
        };
        self.bytes -= w.bytes;
        let Some(keep) = w.keep else {
            return Ok(());
        };
        if self.failed.is_some() {
            return Ok(());
        }
        self.abandoned.insert(id.0, keep);
        if self.abandoned.len() > self.limits.abandoned_max {
            let why = CallFailed(format!(
                "{} abandoned requests are still unanswered",
                self.abandoned.len()
            ));
            self.fail(why.clone());
            return Err(why);
        }
        Ok(())
    }

    /// A reply to request `id` of operation `op` arrived. `Err` (and the
    /// connection has failed) when it answers a waiting request of another
    /// operation.
    pub fn deliver(&mut self, op: OpCode, id: RequestId) -> Result<Delivery<R, K>, CallFailed> {
        if let Some(f) = &self.failed {
            return Err(f.clone());
        }
        if let Some(keep) = self.abandoned.remove(&id.0) {
            return Ok(Delivery::Late(Some(keep)));
        }
        let why = match self.waiting.remove(&id.0) {
            Some(w) if w.op == op => {
                self.bytes -= w.bytes;
                return Ok(Delivery::Waiting {
                    tx: w.tx,
                    keep: w.keep,
                });
            }
            Some(w) => {
                self.bytes -= w.bytes;
                CallFailed(format!(
                    "request {id} ({}) was answered with a {} reply",
                    w.op.name(),
                    op.name()
                ))
            }
            None => return Ok(Delivery::Late(None)),
        };
        self.fail(why.clone());
        Err(why)
    }

    /// Ends every request: the first failure sticks; returns the waiting
    /// callers' senders to tell (none if it had failed already).
    pub fn fail(&mut self, why: CallFailed) -> Vec<oneshot::Sender<Result<R, CallFailed>>> {
        if self.failed.is_some() {
            return Vec::new();
        }
        self.failed = Some(why.clone());
        self.bytes = 0;
        self.abandoned.clear();
        self.waiting.drain().map(|(_, w)| w.tx).collect()
    }

    /// Why the connection failed, if it did.
    pub fn failure(&self) -> Option<&CallFailed> {
        self.failed.as_ref()
    }

    /// Requests waiting for replies.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Abandoned requests that keep something until their late reply.
    pub fn abandoned(&self) -> usize {
        self.abandoned.len()
    }

    /// Payload bytes of the waiting requests.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

/// Callers waiting for room, first come first served: only the first may take
/// room (a later small request never overtakes a large one waiting), and only
/// the first is woken when room frees (one wake per reply, not one per
/// waiter); it wakes the next as it leaves.
#[derive(Default)]
struct RoomQueue {
    next_ticket: u64,
    waiting: VecDeque<(u64, Waker)>,
}

/// One connection's requests, driven on its reactor thread: [`CallBook`]
/// around a [`Conn`], with the callers waiting for room.
pub struct Calls<R, K> {
    conn: Conn,
    book: RefCell<CallBook<R, K>>,
    room: RefCell<RoomQueue>,
    /// The connection was closed by a failure (see [`Calls::fail`]).
    closed: Cell<bool>,
}

/// Takes a caller's ticket out of the room queue however its wait ends, and
/// wakes the next one.
struct LeaveRoomQueue<'a> {
    room: &'a RefCell<RoomQueue>,
    ticket: &'a Cell<Option<u64>>,
}

impl Drop for LeaveRoomQueue<'_> {
    fn drop(&mut self) {
        let mut q = self.room.borrow_mut();
        if let Some(t) = self.ticket.take()
            && let Some(pos) = q.waiting.iter().position(|(h, _)| *h == t)
        {
            q.waiting.remove(pos);
        }
        if let Some((_, w)) = q.waiting.front() {
            w.wake_by_ref();
        }
    }
}

impl<R, K> Calls<R, K> {
    /// Requests on `conn` within `limits`.
    pub fn new(conn: Conn, limits: CallLimits) -> Calls<R, K> {
        Calls {
            conn,
            book: RefCell::new(CallBook::new(limits)),
            room: RefCell::new(RoomQueue::default()),
            closed: Cell::new(false),
        }
    }

    /// The connection (for what is not a request: grants, one-sided reads).
    pub fn conn(&self) -> &Conn {
        &self.conn
    }

    /// See [`CallBook::set_id_modulus`].
    pub fn set_id_modulus(&self, modulus: u64) {
        self.book.borrow_mut().set_id_modulus(modulus);
    }

    /// See [`CallBook::next_id`].
    pub fn next_id(&self, residue: Option<u32>) -> RequestId {
        self.book.borrow_mut().next_id(residue)
    }

    /// Why the connection failed, if it did.
    pub fn failure(&self) -> Option<CallFailed> {
        self.book.borrow().failure().cloned()
    }

    /// Whether the connection failed.
    pub fn is_failed(&self) -> bool {
        self.book.borrow().failure().is_some()
    }

    /// Abandoned requests that keep something until their late reply.
    pub fn abandoned(&self) -> usize {
        self.book.borrow().abandoned()
    }

    /// Sends `wire` (its id is one of [`Calls::next_id`]) once there is room for
    /// its `bytes`, keeping `keep` with it until its reply; the returned call
    /// waits for that reply. A failed send fails the connection.
    pub async fn start(
        &self,
        wire: Message,
        bytes: u64,
        keep: Option<K>,
    ) -> Result<Call<'_, R, K>, CallFailed> {
        let ticket = Cell::new(None);
        let leave = LeaveRoomQueue {
            room: &self.room,
            ticket: &ticket,
        };
        std::future::poll_fn(|cx| {
            let room = self.book.borrow().has_room(bytes);
            let mut q = self.room.borrow_mut();
            let first = match ticket.get() {
                None => q.waiting.is_empty(),
                Some(t) => q.waiting.front().is_some_and(|(h, _)| *h == t),
            };
            match room {
                Err(f) => Poll::Ready(Err(f)),
                Ok(true) if first => Poll::Ready(Ok(())),
                Ok(_) => {
                    match ticket.get() {
                        Some(t) => {
                            if let Some(entry) = q.waiting.iter_mut().find(|(h, _)| *h == t) {
                                entry.1 = cx.waker().clone();
                            }
                        }
                        None => {
                            let t = q.next_ticket;
                            q.next_ticket += 1;
                            q.waiting.push_back((t, cx.waker().clone()));
                            ticket.set(Some(t));
                        }
                    }
                    Poll::Pending
                }
            }
        })
        .await?;
        // Out of the queue; the next one looks for room once this request
        // took its share (no await in between).
        drop(leave);
        let id = wire.id();
        let rx = self.book.borrow_mut().insert(id, wire.op(), bytes, keep)?;
        let call = Call {
            calls: self,
            id,
            rx,
            done: false,
        };
        if let Err(e) = self.conn.send_owned(wire) {
            let why = CallFailed(format!("sending to {}: {e}", self.conn.peer()));
            self.fail(why.clone());
            return Err(why);
        }
        Ok(call)
    }

    /// Hands a received reply to its caller: `make` builds what the caller gets
    /// from what the request kept. `Err`: the reply answers a request of another
    /// operation, and the connection has failed (and is closed).
    pub fn deliver(
        &self,
        op: OpCode,
        id: RequestId,
        make: impl FnOnce(Option<K>) -> R,
    ) -> Result<(), CallFailed> {
        let delivery = self.book.borrow_mut().deliver(op, id);
        match delivery {
            Ok(Delivery::Waiting { tx, keep }) => {
                let _ = tx.send(Ok(make(keep)));
                self.wake_first_waiter();
                Ok(())
            }
            Ok(Delivery::Late(keep)) => {
                drop(keep);
                Ok(())
            }
            Err(why) => {
                self.fail(why.clone());
                Err(why)
            }
        }
    }

    /// Fails the connection (once; later failures keep the first reason): closes
    /// it, tells every waiting caller and refuses every later request. Returns
    /// whether this call closed the connection (the first failure, also when
    /// the book had already failed itself: a wrong reply, too many abandoned).
    pub fn fail(&self, why: CallFailed) -> bool {
        let first = !self.closed.replace(true);
        // Closed first, so the peer's transfers still running end on the
        // closed link rather than on grants revoked under them.
        self.conn.close();
        // Dropping the senders outside the borrow: a woken caller may look at
        // the book at once.
        let txs = self.book.borrow_mut().fail(why.clone());
        for tx in txs {
            let _ = tx.send(Err(why.clone()));
        }
        let waiting: Vec<Waker> = self
            .room
            .borrow()
            .waiting
            .iter()
            .map(|(_, w)| w.clone())
            .collect();
        for w in waiting {
            w.wake();
        }
        first
    }

    /// Wakes the first caller waiting for room (it wakes the next as it goes).
    fn wake_first_waiter(&self) {
        let first = self.room.borrow().waiting.front().map(|(_, w)| w.clone());
        if let Some(w) = first {
            w.wake();
        }
    }
}

/// A sent request waiting for its reply. Dropping it before the reply abandons
/// the request (see the module documentation).
pub struct Call<'a, R, K> {
    calls: &'a Calls<R, K>,
    id: RequestId,
    rx: oneshot::Receiver<Result<R, CallFailed>>,
    done: bool,
}

impl<R, K> Call<'_, R, K> {
    /// The request's id.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// Waits for the reply (or the connection's failure).
    pub async fn reply(mut self) -> Result<R, CallFailed> {
        let r = (&mut self.rx).await;
        self.done = true;
        r.unwrap_or_else(|_| Err(self.lost()))
    }

    /// The reply if it has come, without waiting.
    pub fn try_reply(&mut self) -> Option<Result<R, CallFailed>> {
        match self.rx.try_recv() {
            Ok(None) => None,
            Ok(Some(r)) => {
                self.done = true;
                Some(r)
            }
            Err(_) => {
                self.done = true;
                Some(Err(self.lost()))
            }
        }
    }

    /// Takes the request out of the waiting ones because its reply came another
    /// way: its operation and what it kept (`None`: it is no longer waiting).
    pub fn take(mut self) -> Option<(OpCode, Option<K>)> {
        self.done = true;
        let taken = self.calls.book.borrow_mut().take(self.id);
        self.calls.wake_first_waiter();
        taken
    }

    fn lost(&self) -> CallFailed {
        self.calls.failure().unwrap_or_else(|| {
            CallFailed(format!("connection to {} dropped", self.calls.conn.peer()))
        })
    }
}

impl<R, K> Drop for Call<'_, R, K> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let abandoned = self.calls.book.borrow_mut().abandon(self.id);
        if let Err(why) = abandoned {
            self.calls.fail(why);
        }
        self.calls.wake_first_waiter();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: CallLimits = CallLimits {
        in_flight_max: 2,
        bytes_max: 100,
        abandoned_max: 2,
    };

    type Book = CallBook<&'static str, &'static str>;

    fn book() -> Book {
        CallBook::new(LIMITS)
    }

    #[test]
    fn ids_are_fresh_and_carry_their_residue() {
        let mut b = book();
        assert_eq!(b.next_id(None), RequestId(1));
        assert_eq!(b.next_id(None), RequestId(2));
        b.set_id_modulus(5);
        let id = b.next_id(Some(3));
        assert_eq!(id.0 % 5, 3);
        assert_eq!(b.next_id(None).0 % 5, 4, "no residue: the last one");
    }

    #[test]
    #[should_panic(expected = "outside modulus")]
    fn a_residue_outside_the_modulus_is_a_bug() {
        let mut b = book();
        b.set_id_modulus(4);
        b.next_id(Some(4));
    }

    #[test]
    fn room_is_bounded_by_count_and_bytes_but_a_large_request_goes_alone() {
        let mut b = book();
        assert_eq!(b.has_room(1_000), Ok(true), "alone, any size");
        let _rx1 = b.insert(RequestId(1), OpCode::Write, 60, None).unwrap();
        assert_eq!(b.has_room(40), Ok(true));
        assert_eq!(b.has_room(41), Ok(false), "over the byte bound");
        let _rx2 = b.insert(RequestId(2), OpCode::Read, 0, None).unwrap();
        assert_eq!(b.has_room(0), Ok(false), "over the count bound");
        assert_eq!(b.bytes(), 60);
        assert!(matches!(
            b.deliver(OpCode::Write, RequestId(1)),
            Ok(Delivery::Waiting { .. })
        ));
        assert_eq!(b.bytes(), 0);
        assert_eq!(b.has_room(1_000), Ok(true));
    }

    #[test]
    fn a_reply_reaches_its_request_with_what_it_kept() {
        let mut b = book();
        let mut rx = b
            .insert(RequestId(7), OpCode::Read, 0, Some("grant"))
            .unwrap();
        let Ok(Delivery::Waiting { tx, keep }) = b.deliver(OpCode::Read, RequestId(7)) else {
            panic!("not delivered");
        };
        assert_eq!(keep, Some("grant"));
        tx.send(Ok("data")).unwrap();
        assert_eq!(rx.try_recv().unwrap(), Some(Ok("data")));
        assert_eq!(b.waiting(), 0);
    }

    #[test]
    fn a_reply_of_another_operation_fails_the_connection_and_every_caller() {
        let mut b = book();
        let _rx1 = b.insert(RequestId(1), OpCode::Read, 0, None).unwrap();
        let _rx2 = b.insert(RequestId(2), OpCode::Write, 10, None).unwrap();
        let err = b.deliver(OpCode::Write, RequestId(1)).err().unwrap();
        assert!(err.0.contains("answered with a write reply"), "{err}");
        assert_eq!(b.failure(), Some(&err));
        assert_eq!(b.waiting(), 0, "the other caller was told too");
        assert_eq!(b.bytes(), 0);
        assert_eq!(b.has_room(0), Err(err.clone()));
        assert!(b.insert(RequestId(3), OpCode::Read, 0, None).is_err());
    }

    #[test]
    fn a_reply_to_no_waiting_request_is_late_and_dropped() {
        let mut b = book();
        assert!(matches!(
            b.deliver(OpCode::Read, RequestId(9)),
            Ok(Delivery::Late(None))
        ));
        let _rx = b.insert(RequestId(1), OpCode::Read, 0, None).unwrap();
        assert!(b.deliver(OpCode::Read, RequestId(1)).is_ok());
        assert!(matches!(
            b.deliver(OpCode::Read, RequestId(1)),
            Ok(Delivery::Late(None))
        ));
        assert!(b.failure().is_none());
    }

    #[test]
    fn an_abandoned_request_that_keeps_nothing_is_forgotten() {
        let mut b = book();
        let _rx = b.insert(RequestId(1), OpCode::Read, 30, None).unwrap();
        b.abandon(RequestId(1)).unwrap();
        assert_eq!((b.waiting(), b.abandoned(), b.bytes()), (0, 0, 0));
    }

    #[test]
    fn an_abandoned_request_keeps_what_it_holds_until_its_late_reply() {
        let mut b = book();
        let rx = b
            .insert(RequestId(1), OpCode::Write, 50, Some("grant"))
            .unwrap();
        drop(rx);
        b.abandon(RequestId(1)).unwrap();
        assert_eq!((b.waiting(), b.abandoned(), b.bytes()), (0, 1, 0));
        let Ok(Delivery::Late(Some(keep))) = b.deliver(OpCode::Write, RequestId(1)) else {
            panic!("a late reply is not late");
        };
        assert_eq!(keep, "grant");
        assert_eq!(b.abandoned(), 0);
        // Abandoning what already ended changes nothing.
        b.abandon(RequestId(1)).unwrap();
        assert_eq!(b.abandoned(), 0);
    }

    #[test]
    fn too_many_unanswered_abandoned_requests_fail_the_connection() {
        let mut b = book();
        for id in 1..=3 {
            let _rx = b
                .insert(RequestId(id), OpCode::Read, 0, Some("grant"))
                .unwrap();
            let r = b.abandon(RequestId(id));
            assert_eq!(r.is_err(), id == 3, "request {id}");
        }
        assert!(b.failure().is_some());
        assert_eq!(b.abandoned(), 0, "the failure drops them (revokes grants)");
    }

    #[test]
    fn taking_a_request_releases_its_room() {
        let mut b = book();
        let _rx = b
            .insert(RequestId(4), OpCode::Read, 80, Some("slot"))
            .unwrap();
        assert_eq!(b.take(RequestId(4)), Some((OpCode::Read, Some("slot"))));
        assert_eq!(b.take(RequestId(4)), None);
        assert_eq!((b.waiting(), b.bytes()), (0, 0));
    }

    #[test]
    fn the_first_failure_sticks() {
        let mut b = book();
        let _rx = b
            .insert(RequestId(1), OpCode::Read, 0, Some("grant"))
            .unwrap();
        assert_eq!(b.fail(CallFailed("first".into())).len(), 1);
        assert!(b.fail(CallFailed("second".into())).is_empty());
        assert_eq!(b.failure(), Some(&CallFailed("first".into())));
        // Abandoning after the failure keeps nothing.
        b.abandon(RequestId(1)).unwrap();
        assert_eq!(b.abandoned(), 0);
    }

    /// A reply for `req` from the far end.
    fn reply_to(req: &Message, op: OpCode) -> Message {
        Message::Reply {
            op,
            id: req.id(),
            epoch: crate::ids::Epoch(1),
            status: 0,
            data: crate::buffer::PayloadBuf::empty(),
        }
    }

    /// A connected tcp pair on this thread (connecting side, accepted side).
    async fn tcp_pair() -> (Conn, Conn) {
        use crate::transport::{Listener, TransportKind};
        let l = Listener::bind(TransportKind::Tcp, "127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = l.local_addr();
        let far = crate::reactor::spawn(async move { l.accept().await.unwrap() });
        let near = Conn::connect(TransportKind::Tcp, addr, std::time::Duration::from_secs(2))
            .await
            .unwrap();
        (near, far.await)
    }

    /// `Calls` over a real tcp pair: a caller beyond the bound waits until a
    /// reply frees room, replies reach their callers out of order, and a reply
    /// of another operation fails every caller and closes the connection.
    #[test]
    fn calls_wait_for_room_match_replies_and_fail_together() {
        use crate::reactor::{Reactor, ReactorConfig, spawn};
        use std::rc::Rc;
        use std::time::Duration;
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let (near, far) = tcp_pair().await;
            let calls: Rc<Calls<Message, &'static str>> = Rc::new(Calls::new(near, LIMITS));
            let ping = |calls: &Calls<Message, &'static str>| Message::Ping {
                id: calls.next_id(None),
                epoch: crate::ids::Epoch(1),
            };
            // Reads replies and hands them to `calls`, as a connection's reader.
            let reader = {
                let calls = calls.clone();
                spawn(async move {
                    loop {
                        match calls.conn().recv().await {
                            Ok(Message::Reply { op, id, .. }) => {
                                let reply = reply_to(
                                    &Message::Ping {
                                        id,
                                        epoch: crate::ids::Epoch(1),
                                    },
                                    op,
                                );
                                if let Err(f) = calls.deliver(op, id, |_| reply) {
                                    return f;
                                }
                            }
                            Ok(_) => return CallFailed("a request".into()),
                            Err(e) => return CallFailed(e.to_string()),
                        }
                    }
                })
            };
            let first = calls.start(ping(&calls), 0, None).await.unwrap();
            let second = calls.start(ping(&calls), 0, Some("grant")).await.unwrap();
            // A third waits: two are in flight.
            let third = {
                let calls = calls.clone();
                spawn(async move {
                    let m = ping(&calls);
                    let call = calls.start(m, 0, None).await?;
                    call.reply().await
                })
            };
            let r1 = far.recv().await.unwrap();
            let r2 = far.recv().await.unwrap();
            crate::reactor::sleep(Duration::from_millis(50)).await;
            assert_eq!(calls.book.borrow().waiting(), 2, "the third waits for room");
            // Out of order: the second first.
            far.send_owned(reply_to(&r2, OpCode::Ping)).unwrap();
            assert_eq!(second.reply().await.unwrap().id(), r2.id());
            let r3 = far.recv().await.unwrap();
            far.send_owned(reply_to(&r3, OpCode::Ping)).unwrap();
            assert_eq!(third.await.unwrap().id(), r3.id());
            // A reply of another operation to the first fails it, and the
            // connection, for every later caller too.
            far.send_owned(reply_to(&r1, OpCode::Write)).unwrap();
            let err = first.reply().await.unwrap_err();
            assert!(err.0.contains("answered with a write reply"), "{err}");
            assert_eq!(reader.await, err);
            assert!(calls.is_failed());
            assert!(calls.conn().is_closed());
            assert_eq!(calls.start(ping(&calls), 0, None).await.err(), Some(err));
        })
        .unwrap();
    }

    /// Room goes first come, first served: a small request arriving after a
    /// large one that waits does not overtake it, and both go once a reply
    /// frees room (the first wakes the next).
    #[test]
    fn callers_take_room_in_arrival_order() {
        use crate::reactor::{Reactor, ReactorConfig, spawn};
        use std::rc::Rc;
        use std::time::Duration;
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let (near, far) = tcp_pair().await;
            let limits = CallLimits {
                in_flight_max: 8,
                bytes_max: 100,
                abandoned_max: 8,
            };
            let calls: Rc<Calls<Message, ()>> = Rc::new(Calls::new(near, limits));
            let ping = |calls: &Calls<Message, ()>| Message::Ping {
                id: calls.next_id(None),
                epoch: crate::ids::Epoch(1),
            };
            let reader = {
                let calls = calls.clone();
                spawn(async move {
                    while let Ok(Message::Reply { op, id, .. }) = calls.conn().recv().await {
                        let reply = reply_to(
                            &Message::Ping {
                                id,
                                epoch: crate::ids::Epoch(1),
                            },
                            op,
                        );
                        if calls.deliver(op, id, |_| reply).is_err() {
                            break;
                        }
                    }
                })
            };
            let first = calls.start(ping(&calls), 60, None).await.unwrap();
            let order = Rc::new(RefCell::new(Vec::new()));
            let queued = |name: &'static str, bytes: u64| {
                let (calls, order) = (calls.clone(), order.clone());
                spawn(async move {
                    let call = calls.start(ping(&calls), bytes, None).await.unwrap();
                    order.borrow_mut().push(name);
                    call.reply().await.unwrap();
                })
            };
            let large = queued("large", 50);
            crate::reactor::sleep(Duration::from_millis(20)).await;
            let small = queued("small", 10);
            crate::reactor::sleep(Duration::from_millis(50)).await;
            assert!(
                order.borrow().is_empty(),
                "the small one overtook: {:?}",
                order.borrow()
            );
            assert_eq!(calls.book.borrow().waiting(), 1);
            let r1 = far.recv().await.unwrap();
            far.send_owned(reply_to(&r1, OpCode::Ping)).unwrap();
            first.reply().await.unwrap();
            for _ in 0..2 {
                let r = far.recv().await.unwrap();
                far.send_owned(reply_to(&r, OpCode::Ping)).unwrap();
            }
            large.await;
            small.await;
            assert_eq!(*order.borrow(), vec!["large", "small"]);
            assert!(calls.room.borrow().waiting.is_empty());
            calls.fail(CallFailed("done".into()));
            reader.await;
        })
        .unwrap();
    }

    #[test]
    #[should_panic(expected = "reused while in flight")]
    fn an_id_in_flight_is_never_reused() {
        let mut b = book();
        let _rx = b.insert(RequestId(1), OpCode::Read, 0, None).unwrap();
        let _rx = b.insert(RequestId(1), OpCode::Read, 0, None).unwrap();
    }
}
