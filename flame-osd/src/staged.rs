//! The `staged` threading mode: Ceph's messenger + op-shard model, kept only so
//! that the penetrating model can be measured against it in the same binary
//! (`threading: staged`; docs/architecture.md, docs/benchmarks.md).
//!
//! Network threads own the listeners and every connection: they receive, decode,
//! run the HELLO exchange's transport part, apply back-pressure, and hand each
//! request to the worker thread that owns its shard through that worker's bounded
//! request queue (`crossbeam_queue::ArrayQueue`). Workers are the shard threads:
//! they run the request (storage I/O, replication, the reply's metrics) and push the
//! reply into the bounded reply queue of the network thread that owns the
//! connection, which sends it. Both queues are [`PollSource`]s, so they are polled
//! under the thread's poll mode like any completion source, and a producer wakes a
//! sleeping consumer through its reactor [`Handle`].
//!
//! Ordering: a connection belongs to one shard (its HELLO names it), so all its
//! requests go to the same worker, in receive order, through a FIFO queue; the
//! worker starts them in that order, exactly as the penetrating thread does. Per
//! object ordering is then the shard's write gate, unchanged. Session fencing (a
//! request of a superseded connection must not run) is checked on the worker, just
//! before the request runs.

use crate::session_fence::HelloIdentity;
use crate::shard::Shard;
use arc_swap::ArcSwap;
use crossbeam_queue::ArrayQueue;
use flame_common::map::ClusterMap;
use flame_common::protocol::{Message, status};
use flame_common::reactor::{self, Handle, PollSource};
use flame_common::transport::{Conn, Listener};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Requests one worker's queue holds; a full queue makes network threads wait.
pub const REQUEST_QUEUE_LEN: usize = 4096;
/// Replies one network thread's queue holds; a full queue makes workers wait.
pub const REPLY_QUEUE_LEN: usize = 4096;
/// Items a queue's `poll` takes at once, so one busy queue cannot starve the ring.
const DRAIN_PER_POLL_MAX: usize = 256;
/// How long a producer waits before retrying a push into a full queue.
const FULL_QUEUE_RETRY: Duration = Duration::from_micros(50);
use crate::peers::PEER_INFLIGHT_FACTOR;

/// A bounded cross-thread queue with the consumer's reactor handle.
pub struct Mailbox<T> {
    queue: ArrayQueue<T>,
    /// Set by the consumer once its source is registered (see [`Mailbox::wake`]).
    handle: OnceLock<Handle>,
}

impl<T> Mailbox<T> {
    /// An empty mailbox holding at most `len` items.
    pub fn new(len: usize) -> Mailbox<T> {
        assert!(len > 0, "a mailbox needs room");
        Mailbox {
            queue: ArrayQueue::new(len),
            handle: OnceLock::new(),
        }
    }

    /// Pushes `item`, waiting (asynchronously, on the producer's reactor) while the
    /// queue is full, then wakes the consumer.
    async fn send(&self, mut item: T) {
        loop {
            match self.queue.push(item) {
                Ok(()) => break,
                Err(back) => {
                    item = back;
                    reactor::sleep(FULL_QUEUE_RETRY).await;
                }
            }
        }
        self.wake();
    }

    /// Wakes the consumer if it sleeps. Without a handle the consumer has not yet
    /// registered its source; it polls once before it ever sleeps, so nothing is
    /// lost.
    fn wake(&self) {
        if let Some(h) = self.handle.get() {
            h.wake();
        }
    }

    /// The consumer registers `source` for this mailbox on its reactor and
    /// publishes its handle, in that order.
    fn register(&self, handle: Handle, source: Rc<dyn PollSource>) {
        reactor::add_poll_source(source);
        let _ = self.handle.set(handle);
    }
}

/// What a network thread asks a worker to do.
pub enum Work {
    /// A connection's HELLO: build the reply and register its session (keyed
    /// by the entity that said it: the connection's fence).
    Hello(Message, Option<HelloIdentity>),
    /// A request; `fence` is who opened the connection, if it has a session.
    Request {
        /// The decoded request.
        msg: Message,
        /// Who opened the connection (its session, lineage and generation).
        fence: Option<HelloIdentity>,
    },
}

/// A request on its way to a worker.
pub struct Job {
    work: Work,
    reply_to: Arc<Mailbox<Done>>,
    token: usize,
}

/// What a worker sends back.
pub enum Outcome {
    /// The reply to send.
    Reply(Message),
    /// The connection's session has a newer connection: close this one.
    Superseded,
}

/// A finished job on its way back to its network thread.
pub struct Done {
    token: usize,
    outcome: Outcome,
}

/// A worker's request queue as a completion source: each job becomes a task.
struct Inbox {
    shard: Rc<Shard>,
    mailbox: Arc<Mailbox<Job>>,
}

impl PollSource for Inbox {
    fn poll(&self) -> bool {
        let mut n = 0;
        while n < DRAIN_PER_POLL_MAX {
            let Some(job) = self.mailbox.queue.pop() else {
                break;
            };
            n += 1;
            let shard = self.shard.clone();
            reactor::spawn(async move {
                let outcome = shard.run_staged(job.work).await;
                job.reply_to
                    .send(Done {
                        token: job.token,
                        outcome,
                    })
                    .await;
            })
            .detach();
        }
        n > 0
    }

    fn arm(&self) -> bool {
        self.mailbox.queue.is_empty()
    }
}

/// Starts serving a worker's request queue on the current (shard) thread.
pub(crate) fn start_worker(shard: Rc<Shard>, mailbox: Arc<Mailbox<Job>>, handle: Handle) {
    let source = Rc::new(Inbox {
        shard,
        mailbox: mailbox.clone(),
    });
    mailbox.register(handle, source);
}

impl Shard {
    async fn run_staged(self: &Rc<Self>, work: Work) -> Outcome {
        match work {
            Work::Hello(hello, fence) => {
                let mut reply = self.hello(&hello);
                if let (Some(hello), Message::HelloReply { status: st @ 0, .. }) =
                    (fence, &mut reply)
                    && let Err(why) = self.register_session(hello)
                {
                    tracing::warn!(
                        shard = self.id,
                        session = hello.session_id(),
                        generation = hello.generation(),
                        ?why,
                        "hello from a superseded connection; refusing"
                    );
                    *st = status::ESTALE;
                }
                Outcome::Reply(reply)
            }
            Work::Request { msg, fence } => {
                if let Some(hello) = fence
                    && !self.session_holds(&hello)
                {
                    // A newer connection of the session, or incarnation of its
                    // client, exists (or the session was forgotten: refusing is
                    // the safe side, the client reconnects).
                    return Outcome::Superseded;
                }
                Outcome::Reply(self.execute(msg).await)
            }
        }
    }
}

/// A network thread's per-shard state (the part of [`Shard`] the connection path
/// needs, owned here because the shard lives on its worker thread).
struct NetShard {
    id: u16,
    inbox: Arc<Mailbox<Job>>,
    map: Arc<ArcSwap<ClusterMap>>,
    slots: Rc<RefCell<crate::connection_slots::ConnectionSlots>>,
    max_inflight: u32,
    /// Payload bytes in flight: clients', peers' (see [`crate::byte_budget`]).
    client_bytes: crate::byte_budget::ByteBudget,
    peer_bytes: crate::byte_budget::ByteBudget,
    connections_gauge: prometheus::IntGauge,
    /// Who may connect to this shard.
    hello_gate: crate::hello_gate::HelloGate,
    stall_bounds: flame_common::transport::StallBounds,
}

/// Replies waiting for their connection task, by token.
#[derive(Default)]
struct Pending {
    slots: RefCell<slab::Slab<Slot>>,
}

enum Slot {
    Waiting(Option<std::task::Waker>),
    Ready(Outcome),
}

impl Pending {
    fn insert(&self) -> usize {
        self.slots.borrow_mut().insert(Slot::Waiting(None))
    }

    async fn wait(&self, token: usize) -> Option<Outcome> {
        std::future::poll_fn(|cx| {
            let mut slots = self.slots.borrow_mut();
            match slots.get_mut(token) {
                None => std::task::Poll::Ready(None),
                Some(Slot::Ready(_)) => match slots.remove(token) {
                    Slot::Ready(o) => std::task::Poll::Ready(Some(o)),
                    Slot::Waiting(_) => std::task::Poll::Ready(None),
                },
                Some(Slot::Waiting(w)) => {
                    w.replace(cx.waker().clone());
                    std::task::Poll::Pending
                }
            }
        })
        .await
    }
}

/// A network thread's reply queue as a completion source.
struct Outbox {
    mailbox: Arc<Mailbox<Done>>,
    pending: Rc<Pending>,
}

impl PollSource for Outbox {
    fn poll(&self) -> bool {
        let mut n = 0;
        while n < DRAIN_PER_POLL_MAX {
            let Some(done) = self.mailbox.queue.pop() else {
                break;
            };
            n += 1;
            let mut slots = self.pending.slots.borrow_mut();
            let Some(slot) = slots.get_mut(done.token) else {
                debug_assert!(false, "a reply for an unknown token");
                continue;
            };
            let prev = std::mem::replace(slot, Slot::Ready(done.outcome));
            drop(slots);
            if let Slot::Waiting(Some(w)) = prev {
                w.wake();
            }
        }
        n > 0
    }

    fn arm(&self) -> bool {
        self.mailbox.queue.is_empty()
    }
}

/// What one network thread needs to start.
pub struct NetSetup {
    /// Network thread number (for names and metrics).
    pub index: u16,
    /// The listeners it serves: (shard id, listener, that shard's worker queue).
    pub listeners: Vec<(u16, Listener, Arc<Mailbox<Job>>)>,
    /// The live map (for the epoch of refusals).
    pub map: Arc<ArcSwap<ClusterMap>>,
    /// Configuration.
    pub config: Arc<crate::config::OsdConfig>,
    /// This OSD's id (HELLO proofs name it).
    pub osd: flame_common::ids::OsdId,
    /// The service key HELLOs are checked with (`None`: no keyring, no checks).
    pub service: Option<crate::service_key::ServiceKeys>,
}

/// Starts a network thread. It runs until the process exits.
pub fn spawn_network_thread(setup: NetSetup) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("net-{}", setup.index))
        .spawn(move || {
            let cfg = setup.config.clone();
            let mut r = match reactor::Reactor::new(reactor::ReactorConfig {
                poll_mode: cfg.poll_mode,
                ..Default::default()
            }) {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(net = setup.index, "cannot create io_uring: {e}");
                    std::process::exit(1);
                }
            };
            let handle = r.handle();
            if let Err(e) = r.block_on(network_main(setup, handle)) {
                tracing::error!("network thread failed: {e}");
                std::process::exit(1);
            }
        })
}

async fn network_main(setup: NetSetup, handle: Handle) {
    let cfg = setup.config;
    let replies = Arc::new(Mailbox::new(REPLY_QUEUE_LEN));
    let pending = Rc::new(Pending::default());
    replies.register(
        handle,
        Rc::new(Outbox {
            mailbox: replies.clone(),
            pending: pending.clone(),
        }),
    );
    let index = setup.index;
    reactor::spawn(async move {
        let mut m = crate::metrics::ReactorMetrics::new(&format!("net{index}"));
        loop {
            reactor::sleep(Duration::from_secs(1)).await;
            m.update(reactor::poll_stats());
        }
    })
    .detach();
    let mut accepts = Vec::new();
    for (id, listener, inbox) in setup.listeners {
        let shard = Rc::new(NetShard {
            id,
            inbox,
            map: setup.map.clone(),
            slots: Rc::new(RefCell::new(crate::connection_slots::ConnectionSlots::new(
                cfg.max_connections_per_shard,
                cfg.max_connections_per_source,
                cfg.connections_reserved_for_peers,
            ))),
            max_inflight: cfg.max_inflight_per_connection,
            client_bytes: crate::byte_budget::ByteBudget::new(
                cfg.max_inflight_bytes_per_shard,
                Some(crate::metrics::ShardMetrics::inflight_bytes_gauge(
                    "client", id,
                )),
            ),
            peer_bytes: crate::byte_budget::ByteBudget::new(
                cfg.max_peer_inflight_bytes_per_shard,
                Some(crate::metrics::ShardMetrics::inflight_bytes_gauge(
                    "peer", id,
                )),
            ),
            connections_gauge: crate::metrics::ShardMetrics::connections_gauge(id),
            hello_gate: crate::hello_gate::HelloGate::new(setup.osd, setup.service.clone()),
            stall_bounds: cfg.stall_bounds(),
        });
        accepts.push(reactor::spawn(accept_loop(
            shard,
            listener,
            replies.clone(),
            pending.clone(),
        )));
    }
    for a in accepts {
        a.await;
    }
}

async fn accept_loop(
    shard: Rc<NetShard>,
    listener: Listener,
    replies: Arc<Mailbox<Done>>,
    pending: Rc<Pending>,
) {
    loop {
        let conn = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(shard = shard.id, "accept failed: {e}");
                reactor::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(slot) =
            crate::connection_slots::SlotGuard::take_or_close(&shard.slots, &conn, shard.id)
        else {
            continue;
        };
        reactor::spawn(serve(
            shard.clone(),
            conn,
            slot,
            replies.clone(),
            pending.clone(),
        ))
        .detach();
    }
}

/// Hands `work` to the shard's worker and waits for the outcome.
async fn submit(
    shard: &NetShard,
    work: Work,
    replies: &Arc<Mailbox<Done>>,
    pending: &Pending,
) -> Option<Outcome> {
    let token = pending.insert();
    shard
        .inbox
        .send(Job {
            work,
            reply_to: replies.clone(),
            token,
        })
        .await;
    pending.wait(token).await
}

struct ConnCount(Rc<NetShard>);

impl Drop for ConnCount {
    fn drop(&mut self) {
        self.0.connections_gauge.dec();
    }
}

async fn serve(
    shard: Rc<NetShard>,
    conn: Conn,
    slot: crate::connection_slots::SlotGuard,
    replies: Arc<Mailbox<Done>>,
    pending: Rc<Pending>,
) {
    shard.connections_gauge.inc();
    let _count = ConnCount(shard.clone());
    let peer = conn.peer();
    let Some((hello, admitted)) =
        crate::connection::receive_hello(&conn, &shard.hello_gate, &slot, shard.id, peer).await
    else {
        return;
    };
    let is_peer = matches!(hello, Message::Hello { peer: true, .. });
    let fence = match &hello {
        Message::Hello {
            session,
            generation,
            ..
        } if *session != 0 => Some(HelloIdentity::new(
            admitted.who.as_ref(),
            *session,
            *generation,
        )),
        _ => None,
    };
    let Some(Outcome::Reply(mut reply)) =
        submit(&shard, Work::Hello(hello, fence), &replies, &pending).await
    else {
        conn.close();
        return;
    };
    if let Message::HelloReply {
        status: 0, proof, ..
    } = &mut reply
    {
        *proof = admitted.proof;
    }
    let ok = matches!(reply, Message::HelloReply { status: 0, .. });
    if conn.send(&reply).is_err() {
        conn.close();
        return;
    }
    if !ok {
        conn.close_after_send();
        return;
    }
    let access =
        crate::access::ConnAccess::new(is_peer, admitted.who.as_ref(), admitted.volumes.clone());
    let max_inflight = if is_peer {
        shard.max_inflight.saturating_mul(PEER_INFLIGHT_FACTOR)
    } else {
        shard.max_inflight
    };
    let inflight = Rc::new(crate::connection::Inflight::default());
    crate::connection::watch_stalls(&conn, shard.stall_bounds, shard.id, &inflight);
    loop {
        inflight.below(max_inflight).await;
        shard.bytes_of(is_peer).room().await;
        crate::connection::wait_for_replies_taken(&conn).await;
        let mut msg = match conn.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(shard = shard.id, %peer, "connection ended: {e}");
                conn.close();
                return;
            }
        };
        if conn.is_closed() {
            // A worker found the session superseded.
            return;
        }
        if matches!(
            msg,
            Message::Reply { .. } | Message::Hello { .. } | Message::HelloReply { .. }
        ) {
            tracing::warn!(shard = shard.id, %peer, "unexpected {:?} mid-connection; closing", msg.op());
            conn.close();
            return;
        }
        if let Err(r) = access.check(&msg, || shard.map.load()) {
            tracing::warn!(shard = shard.id, %peer, op = ?msg.op(), "refusing: {}", r.why);
            let epoch = shard.map.load().epoch;
            if conn.send_owned(msg.reply(epoch, r.status)).is_err() {
                conn.close();
                return;
            }
            continue;
        }
        access.scope_op(&mut msg);
        inflight.enter();
        let bytes = crate::connection::payload_bytes(&msg);
        shard.bytes_of(is_peer).take(bytes);
        if converted(&msg) {
            // A one-sided transfer runs here, where the connection is: pull a
            // write's payload before handing it to a worker, push a read's data
            // after. In its own task, so this loop keeps receiving (an emulated
            // transfer's completion arrives through it).
            let (shard, conn, inflight, pending, replies) = (
                shard.clone(),
                conn.clone(),
                inflight.clone(),
                pending.clone(),
                replies.clone(),
            );
            reactor::spawn(async move {
                serve_converted(&shard, &conn, &inflight, &pending, replies, msg, fence).await;
                shard.bytes_of(is_peer).release(bytes);
                inflight.leave();
            })
            .detach();
            continue;
        }
        let token = pending.insert();
        // Sent here, in receive order (not from the spawned task): the worker's
        // FIFO queue then starts this connection's requests in the order they came.
        shard
            .inbox
            .send(Job {
                work: Work::Request { msg, fence },
                reply_to: replies.clone(),
                token,
            })
            .await;
        let (shard, conn, inflight, pending) = (
            shard.clone(),
            conn.clone(),
            inflight.clone(),
            pending.clone(),
        );
        reactor::spawn(async move {
            match pending.wait(token).await {
                Some(Outcome::Reply(reply)) => {
                    let _ = conn.send_owned(reply);
                }
                Some(Outcome::Superseded) | None => {
                    tracing::info!(
                        shard = shard.id,
                        "connection superseded by a newer one of its session; closing"
                    );
                    conn.close();
                }
            }
            shard.bytes_of(is_peer).release(bytes);
            inflight.leave();
        })
        .detach();
    }
}

/// Whether a request's data travels one-sidedly (read-write conversion).
fn converted(msg: &Message) -> bool {
    matches!(
        msg,
        Message::Write {
            remote: Some(_),
            ..
        } | Message::Read {
            remote: Some(_),
            ..
        }
    )
}

/// Runs a converted request from a network thread: pulls the write's payload,
/// has a worker execute it, pushes the read's data, replies. A failed transfer
/// closes the connection (the transport already did; a bad descriptor deserves
/// nothing more), as in the penetrating path (`Shard::execute_converting`).
async fn serve_converted(
    shard: &Rc<NetShard>,
    conn: &Conn,
    inflight: &crate::connection::Inflight,
    pending: &Rc<Pending>,
    replies: Arc<Mailbox<Done>>,
    mut msg: Message,
    fence: Option<HelloIdentity>,
) {
    let Some((dest, _)) =
        crate::connection::pull_converted(conn, inflight, shard.id, &mut msg).await
    else {
        return;
    };
    let token = pending.insert();
    shard
        .inbox
        .send(Job {
            work: Work::Request { msg, fence },
            reply_to: replies,
            token,
        })
        .await;
    let mut reply = match pending.wait(token).await {
        Some(Outcome::Reply(reply)) => reply,
        Some(Outcome::Superseded) | None => {
            conn.close();
            return;
        }
    };
    if crate::connection::push_converted(conn, inflight, shard.id, dest, &mut reply)
        .await
        .is_none()
    {
        return;
    }
    let _ = conn.send_owned(reply);
}

impl NetShard {
    /// The byte budget a connection's requests count against.
    fn bytes_of(&self, is_peer: bool) -> &crate::byte_budget::ByteBudget {
        if is_peer {
            &self.peer_bytes
        } else {
            &self.client_bytes
        }
    }
}
