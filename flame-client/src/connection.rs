//! Per-thread connections to OSD shards.
//!
//! Flame's penetrating model carries over to the client: a connection belongs to one
//! reactor thread for its whole life. Each thread keeps its own table of
//! connections keyed by (cluster, OSD, shard), opened lazily on first use, so the
//! data path takes no lock and never hands a request to another thread.
//!
//! A connection has one reader task that matches replies to requests by id (replies
//! may come out of order) and completes the waiting request through a oneshot
//! channel. When the connection fails, every request still waiting on it gets a
//! retryable error at once and the connection leaves the table; the next request
//! opens a new one. Requests are idempotent at the same offset, so the retry loop
//! may resend them there.

use crate::deadline::Deadline;
use crate::metrics;
use crate::retry::RetryReason;
use flame_common::ids::{Epoch, OsdId, RequestId};
use flame_common::protocol::{self, Message, OpCode, Versions, status};
use flame_common::reactor;
use flame_common::transport::{Conn, TransportKind};
use futures_channel::oneshot;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

/// Requests in flight on one connection at most; matches the OSD's default
/// `max_inflight_per_connection`, so a busy client queues here instead of being
/// throttled (or cut off) by the OSD.
pub const INFLIGHT_PER_CONNECTION_MAX: usize = 256;

/// Identifies one connection in a thread's table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct ConnKey {
    /// `Cluster::uid` of the owning cluster handle.
    pub cluster: u64,
    /// Target OSD.
    pub osd: OsdId,
    /// Target shard of that OSD.
    pub shard: u16,
}

/// Where and how to connect.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Target {
    pub key: ConnKey,
    pub addr: SocketAddr,
    pub transport: TransportKind,
    /// Local address the connection leaves from (`bind_addr`), if set.
    pub source: Option<std::net::IpAddr>,
    pub timeout: Duration,
    /// Our map epoch, sent in the Hello.
    pub epoch: Epoch,
    /// Shard count our map has for the OSD (checked against the Hello reply).
    pub shards: u16,
}

/// A retryable failure to get an answer on a connection.
#[derive(Clone, Debug)]
pub(crate) struct ConnError {
    /// Metrics/backoff classification.
    pub reason: RetryReason,
    /// Human-readable detail (kept for the timeout message).
    pub message: String,
}

impl ConnError {
    fn lost(message: impl Into<String>) -> ConnError {
        ConnError {
            reason: RetryReason::Connection,
            message: message.into(),
        }
    }
}

/// An OSD's answer.
#[derive(Debug)]
pub(crate) struct Reply {
    /// 0 or a negative errno.
    pub status: i32,
    /// The OSD's map epoch.
    pub epoch: Epoch,
    /// A HELLO reply's body: the OSD's protocol versions and shard count.
    pub hello: Option<HelloInfo>,
    /// Read data, in the buffer the transport received it into.
    pub data: flame_common::buffer::PayloadBuf,
}

/// What a HELLO reply tells about the OSD.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HelloInfo {
    /// The protocol versions the OSD speaks.
    pub versions: Versions,
    /// The OSD's shard count.
    pub shards: u16,
}

type Waiter = oneshot::Sender<Result<Reply, ConnError>>;

/// One connection to one OSD shard, owned by the current thread.
pub(crate) struct OsdConn {
    key: ConnKey,
    addr: SocketAddr,
    conn: Conn,
    next_id: Cell<u64>,
    /// Requests waiting for their reply, by request id, with the op they asked for.
    pending: RefCell<HashMap<u64, (OpCode, Waiter)>>,
    /// Tasks waiting for an in-flight slot.
    slot_waiters: RefCell<Vec<Waker>>,
    /// Write payload bytes of the pending requests (bounded by
    /// [`PENDING_BYTES_MAX`]).
    pending_bytes: Cell<u64>,
    failed: Cell<bool>,
    /// Whether this connection is counted in `flame_client_connections`.
    counted: Cell<bool>,
}

enum Slot {
    Ready(Rc<OsdConn>),
    Connecting(Vec<oneshot::Sender<Result<Rc<OsdConn>, ConnError>>>),
}

/// Generation of the next connection this process opens (see `Message::Hello`):
/// increasing, so an OSD can tell a reconnection from the connection it replaces.
static NEXT_GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// The fencing session of this thread's connections to one cluster: unique per
/// (thread, cluster handle), since each such pair has at most one live connection
/// per OSD shard. When it reconnects, the OSD stops executing requests still
/// arriving on the old connection, which this thread may already have resent.
fn session_of(key: &ConnKey) -> u64 {
    let seed = SESSION_SEED.with(|s| *s);
    flame_common::placement::mix64(seed ^ key.cluster) | 1
}

thread_local! {
    static SESSION_SEED: u64 = rand::random();
    static TABLE: RefCell<HashMap<ConnKey, Slot>> = RefCell::new(HashMap::new());
    /// The reactor the table's connections were made on (see [`check_reactor`]).
    static TABLE_REACTOR: Cell<Option<u64>> = const { Cell::new(None) };
}

/// Empties the table if the thread's reactor is not the one its connections were
/// made on. A connection's reader and writer are tasks of one reactor; once that
/// reactor is dropped they never run again, so a connection surviving into a new
/// reactor on the same thread would swallow requests until they time out.
fn check_reactor() {
    let now = reactor::current_id();
    if TABLE_REACTOR.with(|r| r.replace(now)) == now {
        return;
    }
    let stale: Vec<Slot> = TABLE.with(|t| t.borrow_mut().drain().map(|(_, s)| s).collect());
    for slot in stale {
        if let Slot::Ready(c) = slot {
            c.fail(&ConnError::lost(
                "the reactor of this connection was replaced",
            ));
        }
    }
}

/// Removes a pending request when its caller stops waiting (reply, timeout or
/// cancellation), so abandoned ids do not accumulate.
struct PendingGuard<'a> {
    conn: &'a OsdConn,
    id: u64,
    /// Payload bytes this request counts against [`PENDING_BYTES_MAX`].
    bytes: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.conn.pending.borrow_mut().remove(&self.id);
        self.conn
            .pending_bytes
            .set(self.conn.pending_bytes.get() - self.bytes);
        self.conn.wake_slot_waiters();
    }
}

/// Write payload bytes one connection may have pending. Far below the transport's
/// send-queue bound (which fails a connection whose peer stops reading): a client
/// with many large writes waits here instead of having a healthy but slow
/// connection torn down and its requests resent on a new one.
pub const PENDING_BYTES_MAX: u64 = 64 << 20;

impl OsdConn {
    /// Sends `msg` (whose id must come from [`OsdConn::next_id`]) and waits for its
    /// reply. The caller bounds the wait (dropping the future is clean).
    pub(crate) async fn call(&self, id: RequestId, msg: &Message) -> Result<Reply, ConnError> {
        let bytes = match msg {
            Message::Write { data, .. } => data.len() as u64,
            _ => 0,
        };
        self.acquire_slot(bytes).await?;
        let (tx, rx) = oneshot::channel();
        self.pending.borrow_mut().insert(id.0, (msg.op(), tx));
        self.pending_bytes.set(self.pending_bytes.get() + bytes);
        let _guard = PendingGuard {
            conn: self,
            id: id.0,
            bytes,
        };
        if let Err(e) = self.conn.send(msg) {
            let e = ConnError::lost(format!("sending to {}: {e}", self.addr));
            self.fail(&e);
            return Err(e);
        }
        match rx.await {
            Ok(r) => r,
            Err(_) => Err(ConnError::lost(format!(
                "connection to {} dropped",
                self.addr
            ))),
        }
    }

    /// A fresh request id for this connection.
    pub(crate) fn next_id(&self) -> RequestId {
        let id = self.next_id.get();
        self.next_id.set(id.wrapping_add(1));
        RequestId(id)
    }

    /// Waits until fewer than [`INFLIGHT_PER_CONNECTION_MAX`] requests are pending
    /// and `bytes` more fit under [`PENDING_BYTES_MAX`] (a request larger than the
    /// bound goes alone).
    async fn acquire_slot(&self, bytes: u64) -> Result<(), ConnError> {
        std::future::poll_fn(|cx| {
            if self.failed.get() {
                return Poll::Ready(Err(ConnError::lost(format!(
                    "connection to {} failed",
                    self.addr
                ))));
            }
            let pending_bytes = self.pending_bytes.get();
            let bytes_fit = pending_bytes == 0 || pending_bytes + bytes <= PENDING_BYTES_MAX;
            if self.pending.borrow().len() < INFLIGHT_PER_CONNECTION_MAX && bytes_fit {
                return Poll::Ready(Ok(()));
            }
            self.slot_waiters.borrow_mut().push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Wakes every task waiting for a slot; they re-check (a woken task may have
    /// been dropped meanwhile, so waking just one could strand the others).
    fn wake_slot_waiters(&self) {
        let waiters = std::mem::take(&mut *self.slot_waiters.borrow_mut());
        for w in waiters {
            w.wake();
        }
    }

    /// Ends the connection: closes it, removes it from the table and fails every
    /// pending request with a retryable error.
    fn fail(&self, why: &ConnError) {
        if self.failed.replace(true) {
            return;
        }
        tracing::debug!(osd = %self.key.osd, shard = self.key.shard, addr = %self.addr,
            reason = %why.message, "OSD connection failed");
        self.conn.close();
        if self.counted.replace(false) {
            metrics::connections_add(-1);
        }
        let _ = TABLE.try_with(|t| {
            if let Ok(mut t) = t.try_borrow_mut()
                && let Some(Slot::Ready(c)) = t.get(&self.key)
                && std::ptr::eq(Rc::as_ptr(c), self)
            {
                t.remove(&self.key);
            }
        });
        let pending: Vec<(u64, (OpCode, Waiter))> = self.pending.borrow_mut().drain().collect();
        for (_, (_, tx)) in pending {
            let _ = tx.send(Err(why.clone()));
        }
        self.wake_slot_waiters();
    }
}

/// Fails its connection when the reader task ends or is dropped — including when
/// the reactor it ran on is torn down, so a later reactor on the same thread never
/// picks up a connection nobody reads.
struct ReaderGuard(Rc<OsdConn>);

impl Drop for ReaderGuard {
    fn drop(&mut self) {
        self.0.fail(&ConnError::lost("connection reader stopped"));
    }
}

/// The reader task of a connection: dispatches replies until the connection fails.
async fn reader(c: Rc<OsdConn>) {
    let _guard = ReaderGuard(c.clone());
    loop {
        let msg = c.conn.recv().await;
        let answer = match msg {
            Ok(Message::Reply {
                op,
                id,
                epoch,
                status,
                data,
            }) => Ok((
                op,
                id,
                Reply {
                    status,
                    epoch,
                    hello: None,
                    data,
                },
            )),
            Ok(Message::HelloReply {
                id,
                epoch,
                status,
                versions,
                shards,
                ..
            }) => Ok((
                OpCode::Hello,
                id,
                Reply {
                    status,
                    epoch,
                    hello: Some(HelloInfo { versions, shards }),
                    data: flame_common::buffer::PayloadBuf::empty(),
                },
            )),
            Ok(other) => Err(other),
            Err(e) => {
                // A peer of another protocol version is named in the error (both
                // versions), which becomes the connection's failure message.
                c.fail(&ConnError::lost(format!("{}: {e}", c.addr)));
                return;
            }
        };
        let err = match answer {
            Ok((op, id, reply)) => {
                let entry = c.pending.borrow_mut().remove(&id.0);
                match entry {
                    Some((want, tx)) if want == op => {
                        let _ = tx.send(Ok(reply));
                        c.wake_slot_waiters();
                        continue;
                    }
                    Some((want, tx)) => {
                        let e = ConnError::lost(format!(
                            "{} answered request {id} ({}) with a {} reply",
                            c.addr,
                            want.name(),
                            op.name()
                        ));
                        let _ = tx.send(Err(e.clone()));
                        e
                    }
                    // The request timed out or was cancelled: drop the late reply.
                    None => continue,
                }
            }
            Err(other) => ConnError::lost(format!(
                "{} sent a {} request to a client",
                c.addr,
                other.op().name()
            )),
        };
        c.fail(&err);
        return;
    }
}

/// The connection for `target` on this thread, opening it (connect + Hello) if
/// needed. Concurrent callers share one connection attempt.
pub(crate) async fn get(target: &Target) -> Result<Rc<OsdConn>, ConnError> {
    enum Found {
        Conn(Rc<OsdConn>),
        Wait(oneshot::Receiver<Result<Rc<OsdConn>, ConnError>>),
        Stale(Rc<OsdConn>),
    }
    check_reactor();
    let found = TABLE.with(|t| {
        let mut t = t.borrow_mut();
        match t.get_mut(&target.key) {
            Some(Slot::Ready(c)) if !c.failed.get() && c.addr == target.addr => {
                return Found::Conn(c.clone());
            }
            Some(Slot::Ready(c)) => return Found::Stale(c.clone()),
            Some(Slot::Connecting(waiters)) => {
                let (tx, rx) = oneshot::channel();
                waiters.push(tx);
                return Found::Wait(rx);
            }
            None => {}
        }
        let (tx, rx) = oneshot::channel();
        t.insert(target.key, Slot::Connecting(vec![tx]));
        // The attempt runs as its own task so that a caller giving up does not
        // abandon the other waiters or leave the slot stuck in `Connecting`.
        reactor::spawn(connect_task(*target)).detach();
        Found::Wait(rx)
    });
    match found {
        Found::Conn(c) => Ok(c),
        Found::Wait(rx) => match rx.await {
            Ok(r) => r,
            Err(_) => Err(ConnError::lost("connection attempt abandoned")),
        },
        Found::Stale(c) => {
            // The OSD moved (new address) or the connection died: replace it.
            c.fail(&ConnError::lost("OSD address changed in the map"));
            TABLE.with(|t| {
                let mut t = t.borrow_mut();
                if let Some(Slot::Ready(old)) = t.get(&target.key)
                    && Rc::ptr_eq(old, &c)
                {
                    t.remove(&target.key);
                }
            });
            Box::pin(get(target)).await
        }
    }
}

/// Opens a connection and says Hello, then hands the result to every waiter.
async fn connect_task(target: Target) {
    let attempt = open(&target);
    let expire = async {
        Deadline::at(Instant::now() + target.timeout).await;
        Err(ConnError::lost(format!(
            "connecting to {} ({} shard {}) timed out",
            target.addr, target.key.osd, target.key.shard
        )))
    };
    let result = futures_lite::future::or(attempt, expire).await;
    let waiters = TABLE.with(|t| {
        let mut t = t.borrow_mut();
        let waiters = match t.remove(&target.key) {
            Some(Slot::Connecting(w)) => w,
            Some(other) => {
                // Cannot happen (only this task resolves a Connecting slot), but do
                // not lose a live connection if it does.
                t.insert(target.key, other);
                Vec::new()
            }
            None => Vec::new(),
        };
        if let Ok(c) = &result {
            t.insert(target.key, Slot::Ready(c.clone()));
        }
        waiters
    });
    if let Ok(c) = &result {
        c.counted.set(true);
        metrics::connections_add(1);
    }
    for w in waiters {
        let _ = w.send(result.clone());
    }
}

async fn open(target: &Target) -> Result<Rc<OsdConn>, ConnError> {
    let conn = Conn::connect_from(target.transport, target.addr, target.source, target.timeout)
        .await
        .map_err(|e| ConnError::lost(format!("connecting to {}: {e}", target.addr)))?;
    let c = Rc::new(OsdConn {
        key: target.key,
        addr: target.addr,
        conn,
        next_id: Cell::new(1),
        pending: RefCell::new(HashMap::new()),
        slot_waiters: RefCell::new(Vec::new()),
        pending_bytes: Cell::new(0),
        failed: Cell::new(false),
        counted: Cell::new(false),
    });
    reactor::spawn(reader(c.clone())).detach();
    let id = c.next_id();
    let hello = Message::Hello {
        id,
        epoch: target.epoch,
        versions: protocol::VERSIONS,
        shard: target.key.shard,
        peer: false,
        session: session_of(&target.key),
        generation: NEXT_GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
    };
    // If the timeout fires first, this future is dropped; close the connection then
    // so its reader task ends.
    let closer = CloseOnDrop(Some(c.clone()));
    let reply = c.call(id, &hello).await?;
    let mismatch = if reply.status == status::ESTALE {
        Some(format!(
            "{} is not shard {} of {}: our map is stale",
            target.addr, target.key.shard, target.key.osd
        ))
    } else if reply.status == status::EPROTONOSUPPORT {
        let theirs = reply
            .hello
            .map_or_else(|| "unknown".to_string(), |h| h.versions.to_string());
        let e = ConnError::lost(format!(
            "{} refused the hello: it speaks Flame protocol version {theirs}, this client speaks {}",
            target.addr,
            protocol::VERSIONS
        ));
        tracing::error!("{}", e.message);
        c.fail(&e);
        return Err(e);
    } else if reply.status != status::OK {
        Some(format!(
            "{} refused the hello: status {}",
            target.addr, reply.status
        ))
    } else if reply.hello.map(|h| h.shards) != Some(target.shards) {
        Some(format!(
            "{} has {:?} shards, our map says {}: our map is stale",
            target.addr,
            reply.hello.map(|h| h.shards),
            target.shards
        ))
    } else {
        None
    };
    if let Some(message) = mismatch {
        let e = ConnError {
            reason: RetryReason::Stale,
            message,
        };
        c.fail(&e);
        return Err(e);
    }
    closer.defuse();
    Ok(c)
}

struct CloseOnDrop(Option<Rc<OsdConn>>);

impl CloseOnDrop {
    fn defuse(mut self) {
        self.0 = None;
    }
}

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.fail(&ConnError::lost("connection attempt abandoned"));
        }
    }
}

/// Number of live connections in this thread's table (tests, diagnostics).
pub fn thread_connection_count() -> usize {
    TABLE.with(|t| {
        t.borrow()
            .values()
            .filter(|s| matches!(s, Slot::Ready(c) if !c.failed.get()))
            .count()
    })
}
