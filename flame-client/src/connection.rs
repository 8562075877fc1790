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
//!
//! Two switchable mechanisms of the communication layer live here, per request:
//! * **Read-write conversion** ([`Transfer::convert`]): a write grants the peer
//!   READ access to its payload and sends only the descriptor; a read grants WRITE
//!   access to a fresh destination buffer, which the OSD fills before it replies.
//!   A grant lives as long as its request may still be served on this connection:
//!   with the pending request, and if the caller stops waiting (timeout, resend
//!   elsewhere after a failover) in the connection's orphans until the late reply
//!   arrives or the connection ends — dropping it earlier would make the OSD's
//!   still-running transfer hit a revoked key, which closes the connection. A
//!   resend on another connection makes a new grant there.
//! * **Remote fetching** ([`Transfer::fetch`], RFP): the connection has a reply
//!   area in the OSD's memory (asked for after the HELLO); a request takes a free
//!   slot, its id is chosen so that `id % (slots + 1)` names that slot, and
//!   instead of waiting for a pushed reply the client reads the slot one-sidedly
//!   until it holds the reply (id and checksums match), with backoff, at most
//!   `fetch_polls_max` times; then it asks the OSD to push that reply. After
//!   `fetch_fallbacks_to_push` such fallbacks in a row the connection asks for
//!   pushed replies for a while (RFP's hybrid mode).

use crate::cluster::{ClientTicket, Tickets};
use crate::deadline::Deadline;
use crate::metrics;
use crate::retry::RetryReason;
use flame_common::auth::handshake::{self, HelloBinding};
use flame_common::buffer::{PayloadBuf, PayloadBufMut};
use flame_common::calls::{CallFailed, CallLimits, Calls};
use flame_common::clock;
use flame_common::collections::HashMap;
use flame_common::ids::{Epoch, OsdId, RequestId};
use flame_common::node::{NodeLocal, NodeLocalKey};
use flame_common::protocol::{
    self, HEADER_LEN, Header, Message, OpCode, ReplyAreaInfo, Versions, flags, status,
};
use flame_common::reactor;
use flame_common::transport::{Conn, Grant, TransportKind, WriteGrant};
use futures_channel::oneshot;
use std::cell::{Cell, RefCell};

use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

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
    /// Remote fetching: the reply area to ask for (`None`: replies are pushed).
    pub fetch: Option<FetchConfig>,
    /// The lineage of the client's sessions, the same across its restarts
    /// (`None`: a random session per thread; `flame_common::lineage`).
    pub lineage: Option<u64>,
}

/// What a connection in fetch mode asks for and how it polls.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FetchConfig {
    /// Slots of the reply area.
    pub slots: u32,
    /// Payload bytes per slot.
    pub slot_payload_bytes: u32,
    /// Empty fetches of one reply before asking for push.
    pub polls_max: u32,
    /// Fallbacks in a row before the connection switches to push for a while.
    pub fallbacks_to_push: u32,
}

/// How one request's data and reply travel.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Transfer {
    /// Move the data (write payload, read result) by a one-sided transfer.
    pub convert: bool,
    /// Fetch the reply from the OSD's reply area if the connection has one.
    pub fetch: bool,
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

impl From<CallFailed> for ConnError {
    fn from(f: CallFailed) -> ConnError {
        ConnError::lost(f.0)
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
    /// Boxed: only HELLO replies have one, and every reply carries the field.
    pub hello: Option<Box<HelloInfo>>,
    /// Read data, in the buffer the transport received it into (or, for a
    /// converted read, the destination buffer the OSD wrote).
    pub data: PayloadBuf,
    /// The request's grant, handed back with its reply.
    hold: Option<Hold>,
}

/// A grant a request keeps alive while the OSD may use it.
enum Hold {
    /// A converted write's payload, readable by the OSD (held, never read:
    /// dropping it revokes the grant).
    Payload(#[allow(dead_code)] Grant),
    /// A converted read's destination, writable by the OSD.
    Dest(WriteGrant),
}

impl std::fmt::Debug for Hold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Hold::Payload(_) => f.write_str("Hold::Payload"),
            Hold::Dest(_) => f.write_str("Hold::Dest"),
        }
    }
}

/// How much one connection may have waiting for replies. Grants of abandoned
/// requests are kept until their late reply; beyond `abandoned_max` of them the
/// OSD is not answering and the connection is ended (which revokes them all).
const CALL_LIMITS: CallLimits = CallLimits {
    in_flight_max: INFLIGHT_PER_CONNECTION_MAX,
    bytes_max: PENDING_BYTES_MAX,
    abandoned_max: 4 * INFLIGHT_PER_CONNECTION_MAX,
};

/// The first polls of a fetch only yield to other tasks (a reply of a fast OSD is
/// there within microseconds); later ones sleep with doubling backoff.
const FETCH_SPIN_POLLS: u32 = 4;
/// First sleep between fetches after the spinning ones.
const FETCH_BACKOFF_MIN: Duration = Duration::from_micros(10);
/// Longest sleep between two fetches.
const FETCH_BACKOFF_MAX: Duration = Duration::from_micros(500);
/// Requests a connection sends with pushed replies after it switched to push
/// (RFP's hybrid), before it tries fetching again.
const PUSH_SPELL_REQUESTS: u32 = 1024;

/// A connection's reply area and slot bookkeeping.
struct FetchState {
    area: ReplyAreaInfo,
    config: FetchConfig,
    /// Free slot numbers.
    free: Vec<u32>,
    /// Fallbacks since the last successful fetch.
    fallbacks_in_row: u32,
    /// Requests still to send with pushed replies (hybrid mode).
    push_left: u32,
}

/// What a HELLO reply tells about the OSD.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HelloInfo {
    /// The protocol versions the OSD speaks.
    pub versions: Versions,
    /// The OSD's shard count.
    pub shards: u16,
    /// The shard that answered (another than asked for: our map is stale).
    pub shard: u16,
    /// The OSD's proof of the service key (answer to an authenticated HELLO).
    pub proof: Option<[u8; 32]>,
}

/// One connection to one OSD shard, owned by the current thread.
pub(crate) struct OsdConn {
    key: ConnKey,
    addr: SocketAddr,
    /// The connection's requests, matched to their replies; each keeps its
    /// grant, if it has one, until the OSD can no longer use it. Request ids
    /// are `counter * modulus + residue` (see [`FetchState`]); modulus 1
    /// without a reply area.
    calls: Calls<Reply, Hold>,
    /// The reply area, in fetch mode.
    fetch: RefCell<Option<FetchState>>,
    /// Whether this connection is counted in `flame_client_connections`.
    counted: Cell<bool>,
}

enum Slot {
    Ready(Rc<OsdConn>),
    Connecting(Vec<oneshot::Sender<Result<Rc<OsdConn>, ConnError>>>),
}

/// The fencing session of this thread's connections to one cluster: unique per
/// (thread, cluster handle), since each such pair has at most one live connection
/// per OSD shard. When it reconnects, the OSD stops executing requests still
/// arriving on the old connection, which this thread may already have resent.
/// With a lineage (an `instance` name), the session is the lineage's and this
/// thread's number in the process: the same ids again after a restart, whose
/// newer incarnation ([`next_generation`]) then fences the old process's
/// connections too.
fn session_of(target: &Target) -> u64 {
    match target.lineage {
        Some(lineage) => flame_common::lineage::session(lineage, thread_number()),
        None => {
            let seed = SESSION_SEED.with_node(|s| *s);
            flame_common::placement::mix64(seed ^ target.key.cluster) | 1
        }
    }
}

/// The generation of this thread's next connection: its process's
/// incarnation, then its own count of connections (`flame_common::lineage`).
/// A thread whose count is used up (4 194 303 connections) steps the
/// process's incarnation up and counts again: a repeated generation would let
/// a resend and its stale original both execute.
fn next_generation() -> u64 {
    let n = NEXT_GENERATION.with_node(|g| g.replace(g.get() + 1));
    if n < flame_common::lineage::CONNECTION_MAX {
        return flame_common::lineage::generation(incarnation(), n);
    }
    let current = incarnation();
    raise_incarnation(current, current.saturating_add(1));
    NEXT_GENERATION.with_node(|g| g.set(2));
    flame_common::lineage::generation(incarnation(), 1)
}

/// This process's incarnation: the wall clock's milliseconds when it first
/// connected, so a restarted client's is above its predecessor's; raised when
/// an OSD says a newer one of its lineage connected ([`outlive_incarnation`]).
/// One per process (per simulated node): threads of one incarnation must not
/// fence each other.
fn incarnation() -> u64 {
    if flame_common::node::current().is_some() {
        return NODE_INCARNATION.with_node(|i| {
            if i.get() == 0 {
                i.set(flame_common::clock::unix_ms().max(1));
            }
            i.get()
        });
    }
    let i = PROCESS_INCARNATION.load(std::sync::atomic::Ordering::Relaxed);
    if i != 0 {
        return i;
    }
    let now = flame_common::clock::unix_ms().max(1);
    match PROCESS_INCARNATION.compare_exchange(
        0,
        now,
        std::sync::atomic::Ordering::Relaxed,
        std::sync::atomic::Ordering::Relaxed,
    ) {
        Ok(_) => now,
        Err(set) => set,
    }
}

/// Sets the process's incarnation to `to` if it is still `from` (another
/// thread may have raised it meanwhile: raised once, not twice).
fn raise_incarnation(from: u64, to: u64) {
    let to = to.min(flame_common::lineage::INCARNATION_MAX);
    if flame_common::node::current().is_some() {
        NODE_INCARNATION.with_node(|i| {
            if i.get() == from {
                i.set(to);
            }
        });
    } else {
        let _ = PROCESS_INCARNATION.compare_exchange(
            from,
            to,
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
        );
    }
}

/// An OSD refused a HELLO of incarnation `refused` because a newer
/// incarnation of this lineage connected: this process's wall clock went back
/// past its crashed predecessor's start, or another live process uses the same
/// `instance` name (a misconfiguration). Steps the incarnation up from
/// `refused`, doubling the step with each refusal in a row (1 s, 2 s, … up to
/// 12 days), so a clock set back is outlived in a few dozen reconnections; a
/// refusal of an incarnation another thread already stepped past changes
/// nothing (threads of one process never leapfrog each other).
fn outlive_incarnation(refused: u64) {
    if incarnation() != refused {
        return;
    }
    let refusals = REFUSALS
        .with_node(|r| r.replace(r.get().saturating_add(1)))
        .min(20);
    let bumped = refused.saturating_add(1000u64 << refusals);
    raise_incarnation(refused, bumped);
    tracing::warn!(
        incarnation = incarnation(),
        "an OSD knows a newer incarnation of this client's instance name: the clock went \
         back, or another live process uses the same `instance`; connecting as a newer one"
    );
}

/// This thread's number within its process (1, 2, …; one per simulated node).
fn thread_number() -> u16 {
    THREAD_NUMBER.with_node(|n| *n)
}

static PROCESS_INCARNATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static NEXT_THREAD_NUMBER: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(1);

fn new_thread_number() -> u16 {
    if flame_common::node::current().is_some() {
        // A simulated node is one thread of its own process.
        return 1;
    }
    // Wraps after 65 535 threads (two threads sharing a number fence each
    // other's connections: they still work, with reconnections).
    let n = NEXT_THREAD_NUMBER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    n.max(1)
}

// Per process (per simulated node: `flame_common::node`), so that two
// simulated clients neither share connections nor sessions.
thread_local! {
    static SESSION_SEED: NodeLocal<u64> = const { NodeLocal::new(flame_common::entropy::u64) };
    /// Generation of the next connection this thread opens (see `Message::Hello`):
    /// increasing, so an OSD can tell a reconnection from the connection it
    /// replaces. Per thread, like the sessions it numbers (and so a simulated
    /// run does not depend on the runs before it in the process).
    static NEXT_GENERATION: NodeLocal<Cell<u64>> = const { NodeLocal::new(|| Cell::new(1)) };
    /// A simulated process's incarnation ([`incarnation`]; 0: not drawn yet).
    static NODE_INCARNATION: NodeLocal<Cell<u64>> = const { NodeLocal::new(|| Cell::new(0)) };
    /// Refusals as superseded so far ([`outlive_incarnation`]'s doubling step).
    static REFUSALS: NodeLocal<Cell<u32>> = const { NodeLocal::new(|| Cell::new(0)) };
    /// This thread's number in its process ([`thread_number`]).
    static THREAD_NUMBER: NodeLocal<u16> = const { NodeLocal::new(new_thread_number) };
    static TABLE: NodeLocal<RefCell<HashMap<ConnKey, Slot>>> =
        const { NodeLocal::new(|| RefCell::new(HashMap::default())) };
    /// The reactor the table's connections were made on (see [`check_reactor`]).
    static TABLE_REACTOR: NodeLocal<Cell<Option<u64>>> = const { NodeLocal::new(|| Cell::new(None)) };
}

/// Empties the table if the thread's reactor is not the one its connections were
/// made on. A connection's reader and writer are tasks of one reactor; once that
/// reactor is dropped they never run again, so a connection surviving into a new
/// reactor on the same thread would swallow requests until they time out.
fn check_reactor() {
    let now = reactor::current_id();
    if TABLE_REACTOR.with_node(|r| r.replace(now)) == now {
        return;
    }
    let stale: Vec<Slot> = TABLE.with_node(|t| t.borrow_mut().drain().map(|(_, s)| s).collect());
    for slot in stale {
        if let Slot::Ready(c) = slot {
            c.fail(&ConnError::lost(
                "the reactor of this connection was replaced",
            ));
        }
    }
}

/// Gives a fetch slot back when its request ends, however it ends. A late reply
/// the OSD leaves in a reused slot never overwrites a newer one: the OSD only
/// writes a slot with a larger request id than the one it holds.
struct SlotGuard<'a> {
    conn: &'a OsdConn,
    slot: Option<u32>,
}

impl Drop for SlotGuard<'_> {
    fn drop(&mut self) {
        if let Some(slot) = self.slot
            && let Some(f) = self.conn.fetch.borrow_mut().as_mut()
        {
            f.free.push(slot);
        }
    }
}

/// Sets flag bits on a request that carries flags.
fn add_flags(msg: &mut Message, bits: u16) {
    if let Message::Read { flags: f, .. }
    | Message::Write { flags: f, .. }
    | Message::WriteZeroes { flags: f, .. }
    | Message::Discard { flags: f, .. }
    | Message::Flush { flags: f, .. } = msg
    {
        *f |= bits;
    }
}

/// The reply to request `id` in the bytes of a fetched slot, if it is there and
/// whole (both header checksums and the payload checksum verify), with its op.
fn parse_fetched(buf: PayloadBuf, id: RequestId) -> Option<(OpCode, Reply)> {
    let mut hb = [0u8; HEADER_LEN];
    hb.copy_from_slice(buf.get(..HEADER_LEN)?);
    let h = Header::decode(&hb).ok()?;
    if h.request_id != id.0 || !h.is_reply() {
        return None;
    }
    let end = HEADER_LEN.checked_add(h.payload_len as usize)?;
    if end > buf.len() {
        return None;
    }
    match Message::from_parts(&h, buf.slice(HEADER_LEN..end)).ok()? {
        Message::Reply {
            op,
            status,
            epoch,
            data,
            ..
        } => Some((
            op,
            Reply {
                status,
                epoch,
                hello: None,
                data,
                hold: None,
            },
        )),
        _ => None,
    }
}

/// Whether a fetched reply (already matched to its request by id, op and
/// checksums) has the length its request allows: a successful inline read
/// carries exactly the `expect` bytes asked for, a converted read (`expect` 0:
/// its data went into the granted buffer) and every other op carry none. A
/// reply that passes its checksums but not this is an OSD bug, never data to
/// hand to a caller.
fn fetched_len_ok(op: OpCode, reply: &Reply, expect: u32) -> bool {
    if op == OpCode::Read && reply.status == status::OK {
        reply.data.len() == expect as usize
    } else {
        reply.data.is_empty() || reply.data.len() == expect as usize
    }
}

/// Write payload bytes one connection may have pending. Far below the transport's
/// send-queue bound (which fails a connection whose peer stops reading): a client
/// with many large writes waits here instead of having a healthy but slow
/// connection torn down and its requests resent on a new one.
pub const PENDING_BYTES_MAX: u64 = 64 << 20;

impl OsdConn {
    /// Sends `msg` (its id is replaced by a fresh one of this connection) with
    /// inline data and a pushed reply, and waits for the reply. The caller bounds
    /// the wait (dropping the future is clean).
    pub(crate) async fn call(&self, msg: &Message) -> Result<Reply, ConnError> {
        self.request(msg, Transfer::default()).await
    }

    /// Sends `msg` (with a fresh id of this connection) the way `how` says and
    /// waits for its reply; see the module documentation.
    pub(crate) async fn request(&self, msg: &Message, how: Transfer) -> Result<Reply, ConnError> {
        let mut wire = msg.clone();
        let hold = if how.convert {
            self.convert(&mut wire)
        } else {
            None
        };
        let converted = hold.is_some();
        // What a fetched reply carries: an inline read's data, nothing else.
        let expect = match &wire {
            Message::Read {
                target,
                remote: None,
                ..
            } => target.length,
            _ => 0,
        };
        let slot = if how.fetch {
            self.take_fetch_slot(expect)
        } else {
            None
        };
        let _slot_guard = SlotGuard { conn: self, slot };
        let id = self.calls.next_id(slot);
        wire.set_id(id);
        if slot.is_some() {
            add_flags(&mut wire, flags::FETCH_REPLY);
        }
        let bytes = match &wire {
            Message::Write { data, .. } => data.len() as u64,
            _ => 0,
        };
        let call = match self.calls.start(wire, bytes, hold).await {
            Ok(call) => call,
            Err(f) => {
                let e = ConnError::lost(format!("{}: {f}", self.addr));
                self.fail(&e);
                return Err(e);
            }
        };
        let mut reply = match slot {
            Some(slot) => self.fetch_reply(call, slot, expect).await?,
            None => call.reply().await?,
        };
        if converted {
            match reply.hold.take() {
                Some(Hold::Dest(g)) => {
                    let buf = g.finish();
                    if reply.status == status::OK && reply.data.is_empty() {
                        // The OSD wrote the data into our buffer, then replied.
                        reply.data = buf.freeze();
                        metrics::record_converted(false);
                    }
                }
                Some(Hold::Payload(_)) if reply.status == status::OK => {
                    metrics::record_converted(true);
                }
                Some(Hold::Payload(_)) | None => {}
            }
        }
        Ok(reply)
    }

    /// Turns `wire` into its converted form (descriptor instead of data) and
    /// returns the grant that backs it; `None` (the request stays inline) when
    /// there is nothing to convert or the transport cannot grant this memory.
    fn convert(&self, wire: &mut Message) -> Option<Hold> {
        match wire {
            Message::Write { remote, data, .. } if !data.is_empty() => {
                match self.calls.conn().grant_read(data) {
                    Ok(g) => {
                        *remote = Some(g.remote());
                        *data = PayloadBuf::empty();
                        Some(Hold::Payload(g))
                    }
                    Err(e) => {
                        tracing::debug!(addr = %self.addr, "write sent inline: cannot grant its payload: {e}");
                        None
                    }
                }
            }
            Message::Read { remote, target, .. } if target.length > 0 => {
                let buf = PayloadBufMut::for_overwrite(target.length as usize);
                match self.calls.conn().grant_write(buf) {
                    Ok(g) => {
                        *remote = Some(g.remote());
                        Some(Hold::Dest(g))
                    }
                    Err(e) => {
                        tracing::debug!(addr = %self.addr, "read sent inline: cannot grant a destination: {e}");
                        None
                    }
                }
            }
            _ => None,
        }
    }

    /// A free slot of the reply area for a reply with `payload` bytes, unless the
    /// connection has none, the reply does not fit, or it is in a push spell.
    fn take_fetch_slot(&self, payload: u32) -> Option<u32> {
        let mut f = self.fetch.borrow_mut();
        let f = f.as_mut()?;
        if u64::from(payload) + HEADER_LEN as u64 > u64::from(f.area.slot_bytes) {
            return None;
        }
        if f.push_left > 0 {
            f.push_left -= 1;
            return None;
        }
        f.free.pop()
    }

    /// Reads slot `slot` until it holds the reply to `id`, then (after too many
    /// empty reads) asks for the reply to be pushed and waits for it on `rx`.
    async fn fetch_reply(
        &self,
        mut call: flame_common::calls::Call<'_, Reply, Hold>,
        slot: u32,
        payload: u32,
    ) -> Result<Reply, ConnError> {
        let id = call.id();
        let lost = || ConnError::lost(format!("connection to {} dropped", self.addr));
        let (desc, config) = {
            let f = self.fetch.borrow();
            let f = f.as_ref().ok_or_else(lost)?;
            (f.area.slot(slot, HEADER_LEN as u32 + payload), f.config)
        };
        let mut delay = FETCH_BACKOFF_MIN;
        if let Some(desc) = desc {
            for poll in 0..config.polls_max {
                // The reply may come pushed after all (the OSD could not leave it),
                // or the connection may have failed.
                if let Some(r) = call.try_reply() {
                    return Ok(r?);
                }
                if poll < FETCH_SPIN_POLLS {
                    reactor::yield_now().await;
                } else {
                    reactor::sleep(delay).await;
                    delay = (delay * 2).min(FETCH_BACKOFF_MAX);
                }
                let buf = match self.calls.conn().read_remote(desc).await {
                    Ok(b) => b.freeze(),
                    Err(e) => {
                        let e =
                            ConnError::lost(format!("fetching a reply from {}: {e}", self.addr));
                        self.fail(&e);
                        return Err(e);
                    }
                };
                if let Some((op, reply)) = parse_fetched(buf, id) {
                    let Some((want, hold)) = call.take() else {
                        return Err(lost());
                    };
                    if want != op {
                        let e = ConnError::lost(format!(
                            "{} left a {} reply for request {id} ({})",
                            self.addr,
                            op.name(),
                            want.name()
                        ));
                        self.fail(&e);
                        return Err(e);
                    }
                    if !fetched_len_ok(op, &reply, payload) {
                        let e = ConnError::lost(format!(
                            "{} left a {}-byte {} reply for request {id}, which allows {payload}",
                            self.addr,
                            reply.data.len(),
                            op.name()
                        ));
                        self.fail(&e);
                        return Err(e);
                    }
                    metrics::record_fetch(metrics::Fetch::Hit);
                    if let Some(f) = self.fetch.borrow_mut().as_mut() {
                        f.fallbacks_in_row = 0;
                    }
                    return Ok(Reply { hold, ..reply });
                }
                metrics::record_fetch(metrics::Fetch::Miss);
            }
        }
        // Fetching keeps failing (a slow OSD): have this reply pushed, and after
        // several in a row push the next ones too.
        metrics::record_fetch(metrics::Fetch::Fallback);
        if let Some(f) = self.fetch.borrow_mut().as_mut() {
            f.fallbacks_in_row += 1;
            if f.fallbacks_in_row >= config.fallbacks_to_push {
                tracing::debug!(addr = %self.addr, "replies keep arriving after {} fetches: switching to push for {PUSH_SPELL_REQUESTS} requests", config.polls_max);
                f.fallbacks_in_row = 0;
                f.push_left = PUSH_SPELL_REQUESTS;
            }
        }
        let push = Message::PushReply {
            id: self.calls.next_id(None),
            epoch: Epoch(0),
            of: id,
        };
        if let Err(e) = self.calls.conn().send_owned(push) {
            let e = ConnError::lost(format!("sending to {}: {e}", self.addr));
            self.fail(&e);
            return Err(e);
        }
        Ok(call.reply().await?)
    }

    /// Whether the connection has failed (it is then replaced on next use).
    fn is_failed(&self) -> bool {
        self.calls.is_failed()
    }

    /// Ends the connection: closes it, fails every pending request with a
    /// retryable error and removes it from the table.
    fn fail(&self, why: &ConnError) {
        if self.calls.fail(CallFailed(why.message.clone())) {
            tracing::debug!(osd = %self.key.osd, shard = self.key.shard, addr = %self.addr,
                reason = %why.message, "OSD connection failed");
        }
        if self.counted.replace(false) {
            metrics::connections_add(-1);
        }
        let _ = TABLE.try_with_node(|t| {
            if let Ok(mut t) = t.try_borrow_mut()
                && let Some(Slot::Ready(c)) = t.get(&self.key)
                && std::ptr::eq(Rc::as_ptr(c), self)
            {
                t.remove(&self.key);
            }
        });
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
        let msg = c.calls.conn().recv().await;
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
                    hold: None,
                },
            )),
            Ok(Message::HelloReply {
                id,
                epoch,
                status,
                versions,
                shards,
                shard,
                proof,
                ..
            }) => Ok((
                OpCode::Hello,
                id,
                Reply {
                    status,
                    epoch,
                    hello: Some(Box::new(HelloInfo {
                        versions,
                        shards,
                        shard,
                        proof,
                    })),
                    data: PayloadBuf::empty(),
                    hold: None,
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
            // A late reply (the request timed out or was cancelled) is dropped
            // here, and with it the grant the OSD no longer uses.
            Ok((op, id, reply)) => match c.calls.deliver(op, id, |hold| Reply { hold, ..reply }) {
                Ok(()) => continue,
                Err(f) => ConnError::lost(format!("{}: {f}", c.addr)),
            },
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
pub(crate) async fn get(target: &Target, tickets: &Tickets) -> Result<Rc<OsdConn>, ConnError> {
    enum Found {
        Conn(Rc<OsdConn>),
        Wait(oneshot::Receiver<Result<Rc<OsdConn>, ConnError>>),
        Stale(Rc<OsdConn>),
    }
    check_reactor();
    let found = TABLE.with_node(|t| {
        let mut t = t.borrow_mut();
        match t.get_mut(&target.key) {
            Some(Slot::Ready(c)) if !c.is_failed() && c.addr == target.addr => {
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
        reactor::spawn(connect_task(*target, tickets.load_full())).detach();
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
            TABLE.with_node(|t| {
                let mut t = t.borrow_mut();
                if let Some(Slot::Ready(old)) = t.get(&target.key)
                    && Rc::ptr_eq(old, &c)
                {
                    t.remove(&target.key);
                }
            });
            Box::pin(get(target, tickets)).await
        }
    }
}

/// Opens a connection and says Hello, then hands the result to every waiter.
async fn connect_task(target: Target, ticket: Option<Arc<ClientTicket>>) {
    let attempt = open(&target, ticket.as_deref());
    let expire = async {
        Deadline::at(clock::now() + target.timeout).await;
        Err(ConnError::lost(format!(
            "connecting to {} ({} shard {}) timed out",
            target.addr, target.key.osd, target.key.shard
        )))
    };
    let result = futures_lite::future::or(attempt, expire).await;
    let waiters = TABLE.with_node(|t| {
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

async fn open(target: &Target, held: Option<&ClientTicket>) -> Result<Rc<OsdConn>, ConnError> {
    let ticket = held.map(|h| &h.ticket);
    let conn = Conn::connect_from(target.transport, target.addr, target.source, target.timeout)
        .await
        .map_err(|e| ConnError::lost(format!("connecting to {}: {e}", target.addr)))?;
    let c = Rc::new(OsdConn {
        key: target.key,
        addr: target.addr,
        calls: Calls::new(conn, CALL_LIMITS),
        fetch: RefCell::new(None),
        counted: Cell::new(false),
    });
    reactor::spawn(reader(c.clone())).detach();
    let binding = HelloBinding {
        osd: target.key.osd.0,
        shard: target.key.shard,
        peer: false,
        session: session_of(target),
        generation: next_generation(),
    };
    let auth = ticket.map(|t| {
        Box::new(handshake::hello_auth(
            t,
            &binding,
            clock::unix_ms(),
            handshake::hello_nonce(),
        ))
    });
    let hello = Message::Hello {
        id: RequestId(0),
        epoch: target.epoch,
        versions: protocol::VERSIONS,
        shard: binding.shard,
        peer: false,
        session: binding.session,
        generation: binding.generation,
        auth: auth.clone(),
    };
    // If the timeout fires first, this future is dropped; close the connection then
    // so its reader task ends.
    let closer = CloseOnDrop(Some(c.clone()));
    let reply = c.call(&hello).await?;
    if reply.status == status::EPERM {
        if let Some(h) = held {
            // Renewed by the map refresh this failure asks for.
            h.refused.store(true, std::sync::atomic::Ordering::Release);
        }
        let e = ConnError::lost(format!(
            "{} ({}) refused our hello: {} (see its log for why)",
            target.addr,
            target.key.osd,
            match ticket {
                Some(t) => format!("ticket of {} not accepted", t.claims.entity),
                None => "it requires authentication and this client has no keyring".into(),
            }
        ));
        tracing::error!("{}", e.message);
        c.fail(&e);
        return Err(e);
    }
    if let (Some(t), Some(a), 0) = (ticket, &auth, reply.status) {
        let proof = reply.hello.as_ref().and_then(|h| h.proof);
        if !proof.is_some_and(|p| handshake::check_server_proof(t, &binding, a, &p)) {
            // Whatever answered does not hold the service key: not an OSD of
            // this cluster (a squatter on its address). Send it nothing.
            let e = ConnError::lost(format!(
                "{} answered as {} without a valid proof of the cluster's OSD key (not this cluster's OSD, or one started without its keyring); not using it",
                target.addr, target.key.osd
            ));
            tracing::error!("{}", e.message);
            c.fail(&e);
            return Err(e);
        }
    }
    let mismatch = if reply.status == status::ESTALE
        && reply.hello.as_ref().map(|h| h.shard) == Some(target.key.shard)
    {
        // The right shard, yet refused: a newer connection of this session or
        // incarnation of this lineage is known there. Not a stale map: retried
        // as a connection failure, without waiting for a map refresh.
        if target.lineage.is_some() {
            outlive_incarnation(flame_common::lineage::incarnation_of(binding.generation));
        }
        let e = ConnError::lost(format!(
            "{} ({}) refused our hello as superseded by a newer connection of this client",
            target.addr, target.key.osd
        ));
        c.fail(&e);
        return Err(e);
    } else if reply.status == status::ESTALE {
        Some(format!(
            "{} is not shard {} of {}: our map is stale",
            target.addr, target.key.shard, target.key.osd
        ))
    } else if reply.status == status::EPROTONOSUPPORT {
        let theirs = reply
            .hello
            .as_ref()
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
    } else if reply.hello.as_ref().map(|h| h.shards) != Some(target.shards) {
        Some(format!(
            "{} has {:?} shards, our map says {}: our map is stale",
            target.addr,
            reply.hello.as_ref().map(|h| h.shards),
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
    if let Some(fc) = target.fetch {
        ask_reply_area(&c, target, fc).await?;
    }
    if target.lineage.is_some() {
        REFUSALS.with_node(|r| r.set(0));
    }
    closer.defuse();
    Ok(c)
}

/// Asks the OSD for a reply area (remote fetching). A refusal leaves the
/// connection with pushed replies: fetching is an optimisation, never a
/// requirement.
async fn ask_reply_area(c: &OsdConn, target: &Target, fc: FetchConfig) -> Result<(), ConnError> {
    let ask = Message::ReplyArea {
        id: RequestId(0),
        epoch: target.epoch,
        slots: fc.slots,
        slot_payload_bytes: fc.slot_payload_bytes,
    };
    let reply = c.call(&ask).await?;
    let info = (reply.status == status::OK)
        .then(|| ReplyAreaInfo::decode(&reply.data))
        .flatten();
    match info {
        Some(area) => {
            tracing::debug!(addr = %target.addr, slots = area.slots, slot_bytes = area.slot_bytes, "fetching replies");
            c.calls.set_id_modulus(area.modulus());
            *c.fetch.borrow_mut() = Some(FetchState {
                area,
                config: fc,
                free: (0..area.slots).rev().collect(),
                fallbacks_in_row: 0,
                push_left: 0,
            });
        }
        None => {
            tracing::warn!(addr = %target.addr, status = reply.status, "OSD gave no reply area: its replies are pushed");
        }
    }
    Ok(())
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

/// Whether every connection (live or being opened) in this thread's table —
/// this process's, or in the simulator this node's (`flame_common::node`) —
/// belongs to `cluster`, and how many there are. The simulator checks it each
/// time it enters a client node: a client process sees only its own
/// connections (two simulated clients sharing one table was a simulator flaw
/// that made resends no deployment has).
pub fn thread_connections_only_of(cluster: &crate::cluster::Cluster) -> Result<usize, String> {
    let uid = cluster.uid();
    TABLE.with_node(|t| {
        let t = t.borrow();
        match t.keys().find(|k| k.cluster != uid) {
            Some(k) => Err(format!(
                "this node's connection table holds a connection of another client \
                 (cluster handle {:016x}, to {} shard {}) besides its own ({uid:016x})",
                k.cluster, k.osd, k.shard
            )),
            None => Ok(t.len()),
        }
    })
}

/// Number of live connections in this thread's table (tests, diagnostics).
pub fn thread_connection_count() -> usize {
    TABLE.with_node(|t| {
        t.borrow()
            .values()
            .filter(|s| matches!(s, Slot::Ready(c) if !c.is_failed()))
            .count()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::ids::{ObjectId, PgId, PgSeq, VolumeId};
    use flame_common::protocol::IoTarget;
    use flame_common::reactor::{Reactor, ReactorConfig};
    use flame_common::transport::Listener;
    use std::cell::RefCell;

    /// A named client's sessions are its lineage's, the same in every
    /// process; its generations carry one incarnation for all its threads,
    /// and a refusal as superseded steps it up.
    #[test]
    fn a_named_client_connects_as_its_lineage_and_incarnation() {
        let mut target = fake_osd_target(1, OsdId(0), "127.0.0.1:1".parse().unwrap());
        target.lineage = Some(flame_common::lineage::lineage_of_name("nbd@h:/s"));
        let named = session_of(&target);
        assert_eq!(
            flame_common::lineage::lineage_of(named),
            flame_common::lineage::session(flame_common::lineage::lineage_of_name("nbd@h:/s"), 0)
        );
        let mine = flame_common::lineage::incarnation_of(next_generation());
        let other_thread = std::thread::spawn(|| {
            (
                thread_number(),
                flame_common::lineage::incarnation_of(next_generation()),
            )
        })
        .join()
        .unwrap();
        assert_ne!(
            other_thread.0,
            thread_number(),
            "two threads share a session"
        );
        assert_eq!(
            other_thread.1, mine,
            "threads of one process differ in incarnation"
        );
        outlive_incarnation(mine);
        let after = flame_common::lineage::incarnation_of(next_generation());
        assert!(
            after >= mine + 1000,
            "{after} is not a newer incarnation than {mine}"
        );
        // Another thread's refusal of the incarnation already stepped past
        // does not step it again.
        outlive_incarnation(mine);
        assert_eq!(
            flame_common::lineage::incarnation_of(next_generation()),
            after,
            "threads of one process leapfrog each other"
        );
        // A thread whose connection count is used up steps the incarnation
        // up rather than repeat a generation.
        NEXT_GENERATION.with_node(|g| g.set(flame_common::lineage::CONNECTION_MAX));
        let last = next_generation();
        assert!(next_generation() > last && flame_common::lineage::incarnation_of(last) > after);
    }

    /// Where a test's fake one-shard OSD at `addr` is, for cluster handle `cluster`.
    fn fake_osd_target(cluster: u64, osd: OsdId, addr: SocketAddr) -> Target {
        Target {
            key: ConnKey {
                cluster,
                osd,
                shard: 0,
            },
            addr,
            transport: TransportKind::Tcp,
            source: None,
            timeout: Duration::from_secs(5),
            epoch: Epoch(1),
            shards: 1,
            fetch: None,
            lineage: None,
        }
    }

    fn fetched(id: RequestId, status: i32, data: &[u8]) -> Message {
        Message::Reply {
            op: OpCode::Read,
            id,
            epoch: flame_common::ids::Epoch(3),
            status,
            data: PayloadBuf::copy_from(data),
        }
    }

    fn slot_bytes_of(msg: &Message) -> PayloadBuf {
        let (h, payload) = msg.to_header();
        let mut v = h.encode().to_vec();
        v.extend_from_slice(&payload);
        v.resize(HEADER_LEN + 8192, 0);
        PayloadBuf::copy_from(&v)
    }

    /// A fetched slot is accepted only as the whole reply of its own request:
    /// another request's reply (an older one still in a reused slot), a torn
    /// slot (payload or header checksum off) and a reply of the wrong length
    /// are all refused.
    #[test]
    fn a_fetched_reply_must_be_the_whole_reply_of_its_own_request() {
        let id = RequestId(5 * 17 + 3);
        let data = vec![0x22u8; 4096];
        let good = slot_bytes_of(&fetched(id, status::OK, &data));
        let (op, reply) = parse_fetched(good.clone(), id).unwrap();
        assert_eq!(op, OpCode::Read);
        assert_eq!(&reply.data[..], &data[..]);
        assert!(fetched_len_ok(op, &reply, 4096));
        // An older reply in the same slot (same residue, smaller counter).
        assert!(parse_fetched(good.clone(), RequestId(6 * 17 + 3)).is_none());
        // Torn: a payload byte or a header byte not yet (or wrongly) written.
        let mut torn = good.to_vec();
        torn[HEADER_LEN + 100] ^= 1;
        assert!(parse_fetched(PayloadBuf::copy_from(&torn), id).is_none());
        let mut torn = good.to_vec();
        torn[80] ^= 1;
        assert!(parse_fetched(PayloadBuf::copy_from(&torn), id).is_none());
        // Checksums right, length wrong: a read of 4096 bytes answered with
        // 512, and a converted read (data in the grant) answered inline.
        let short = slot_bytes_of(&fetched(id, status::OK, &data[..512]));
        let (op, reply) = parse_fetched(short, id).unwrap();
        assert!(!fetched_len_ok(op, &reply, 4096));
        assert!(!fetched_len_ok(op, &reply, 0));
        let empty = slot_bytes_of(&fetched(id, status::OK, &[]));
        let (op, reply) = parse_fetched(empty, id).unwrap();
        assert!(fetched_len_ok(op, &reply, 0));
        assert!(!fetched_len_ok(op, &reply, 4096));
        // An error reply carries no data.
        let err = slot_bytes_of(&fetched(id, status::EIO, &[]));
        let (op, reply) = parse_fetched(err, id).unwrap();
        assert!(fetched_len_ok(op, &reply, 4096));
    }

    /// With a ticket, a client opens a connection only to what proves it holds
    /// the OSDs' service key: a squatter on an OSD's address that answers the
    /// HELLO "OK" without the proof, or with a proof of another key, gets the
    /// HELLO and nothing else; the real OSD's answer (made with the service
    /// key) is accepted. A refusal (EPERM) marks the ticket for renewal.
    #[test]
    fn a_client_with_a_ticket_uses_only_an_osd_that_proves_the_service_key() {
        use flame_common::auth::handshake::{HelloBinding, HelloVerifier};
        use flame_common::auth::{EntityName, Role, SecretKey, ServiceKey, TICKET_LIFETIME_MS};
        let service = ServiceKey::from_osd_key(&SecretKey::from_hex(&"31".repeat(32)).unwrap(), 1);
        let impostor = ServiceKey::from_osd_key(&SecretKey::from_hex(&"32".repeat(32)).unwrap(), 1);
        let ticket = service.issue(
            &EntityName::parse("client.t").unwrap(),
            Role::Client,
            clock::unix_ms(),
            TICKET_LIFETIME_MS,
        );
        // What each fake OSD does with the HELLO: answer OK with no proof, with
        // a proof under another key, with the real proof, or refuse it.
        #[derive(Clone, Copy, Debug, PartialEq)]
        enum Answer {
            NoProof,
            WrongKey,
            Real,
            Refuse,
        }
        for (k, answer) in [
            Answer::NoProof,
            Answer::WrongKey,
            Answer::Real,
            Answer::Refuse,
        ]
        .into_iter()
        .enumerate()
        {
            let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
            let (service, impostor) = (service.clone(), impostor.clone());
            let tickets = Tickets::from_pointee(ClientTicket {
                ticket: ticket.clone(),
                refused: false.into(),
            });
            let tickets = Rc::new(tickets);
            let t2 = tickets.clone();
            let (result, got_request) = reactor
                .block_on(async move {
                    let listener =
                        Listener::bind(TransportKind::Tcp, "127.0.0.1:0".parse().unwrap()).unwrap();
                    let addr = listener.local_addr();
                    let got_request = Rc::new(Cell::new(false));
                    let got = got_request.clone();
                    reactor::spawn(async move {
                        let conn = listener.accept().await.unwrap();
                        let hello = conn.recv().await.unwrap();
                        let (Message::Hello { auth, .. }, Some(binding)) =
                            (&hello, HelloBinding::of(9, &hello))
                        else {
                            panic!("not a hello: {hello:?}");
                        };
                        let key = if answer == Answer::WrongKey {
                            impostor
                        } else {
                            service
                        };
                        let proof = HelloVerifier::new(key)
                            .verify(auth.as_deref(), &binding, clock::unix_ms())
                            .ok()
                            .map(|a| a.proof);
                        assert!(
                            answer == Answer::WrongKey || proof.is_some(),
                            "the client's proof checks"
                        );
                        conn.send(&Message::HelloReply {
                            id: hello.id(),
                            epoch: Epoch(1),
                            status: if answer == Answer::Refuse {
                                status::EPERM
                            } else {
                                0
                            },
                            versions: protocol::VERSIONS,
                            shard: 0,
                            shards: 1,
                            proof: if answer == Answer::NoProof {
                                None
                            } else {
                                proof.or(Some([0; 32]))
                            },
                        })
                        .unwrap();
                        if conn.recv().await.is_ok() {
                            got.set(true);
                        }
                    })
                    .detach();
                    let target = fake_osd_target(80 + k as u64, OsdId(9), addr);
                    let r = get(&target, &t2).await.map(|c| {
                        let _ = c.calls.conn().send(&Message::Ping {
                            id: RequestId(1),
                            epoch: Epoch(1),
                        });
                    });
                    reactor::sleep(Duration::from_millis(100)).await;
                    (r, got_request.get())
                })
                .unwrap();
            match answer {
                Answer::Real => {
                    assert!(result.is_ok(), "{answer:?}: {result:?}");
                    assert!(got_request, "the real OSD gets the request");
                }
                _ => {
                    assert!(result.is_err(), "{answer:?}: connected");
                    assert!(!got_request, "{answer:?}: a request reached it");
                }
            }
            let refused = tickets
                .load()
                .as_ref()
                .is_some_and(|t| t.refused.load(std::sync::atomic::Ordering::Acquire));
            assert_eq!(refused, answer == Answer::Refuse, "{answer:?}");
        }
    }

    /// A converted write whose caller gave up (a timeout, a resend elsewhere)
    /// keeps its grant until the OSD's late reply: the OSD's pull, made after the
    /// caller left, still reads the payload, and the connection survives.
    #[test]
    fn an_abandoned_converted_write_keeps_its_grant_until_the_reply() {
        let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
        type Pulled = Option<Result<Vec<u8>, String>>;
        let pulled: Rc<RefCell<Pulled>> = Rc::new(RefCell::new(None));
        let pulled2 = pulled.clone();
        reactor
            .block_on(async move {
                let listener =
                    Listener::bind(TransportKind::Tcp, "127.0.0.1:0".parse().unwrap()).unwrap();
                let addr = listener.local_addr();
                // A fake OSD shard: answers the hello, then pulls the converted
                // write's payload only after the client stopped waiting.
                reactor::spawn(async move {
                    let conn = listener.accept().await.unwrap();
                    let hello = conn.recv().await.unwrap();
                    conn.send(&Message::HelloReply {
                        id: hello.id(),
                        epoch: Epoch(1),
                        status: 0,
                        versions: protocol::VERSIONS,
                        shard: 0,
                        shards: 1,
                        proof: None,
                    })
                    .unwrap();
                    let Ok(Message::Write {
                        id,
                        remote: Some(r),
                        ..
                    }) = conn.recv().await
                    else {
                        panic!("expected a converted write");
                    };
                    let c2 = conn.clone();
                    reactor::spawn(async move {
                        reactor::sleep(Duration::from_millis(200)).await;
                        let got = c2.read_remote(r).await;
                        *pulled2.borrow_mut() = Some(
                            got.map(|b| b.as_slice().to_vec())
                                .map_err(|e| e.to_string()),
                        );
                        let _ = c2.send_owned(Message::Reply {
                            op: OpCode::Write,
                            id,
                            epoch: Epoch(1),
                            status: 0,
                            data: PayloadBuf::empty(),
                        });
                    })
                    .detach();
                    // Keep receiving: tcp's emulated READ completes through it.
                    while conn.recv().await.is_ok() {}
                })
                .detach();
                let target = fake_osd_target(77, OsdId(0), addr);
                let c = get(&target, &Tickets::empty()).await.unwrap();
                let msg = Message::Write {
                    id: RequestId(0),
                    epoch: Epoch(1),
                    target: IoTarget {
                        pg: PgId(0),
                        object: ObjectId {
                            volume: VolumeId(1),
                            index: 0,
                        },
                        offset: 0,
                        length: 8192,
                    },
                    flags: 0,
                    seq: PgSeq(0),
                    op: flame_common::ids::OpId::NONE,
                    remote: None,
                    data: PayloadBuf::copy_from(&[0xab; 8192]),
                };
                let how = Transfer {
                    convert: true,
                    fetch: false,
                };
                let gave_up =
                    futures_lite::future::or(async { Some(c.request(&msg, how).await) }, async {
                        reactor::sleep(Duration::from_millis(50)).await;
                        None
                    })
                    .await;
                assert!(gave_up.is_none(), "the fake OSD answered too early");
                for _ in 0..100 {
                    if pulled.borrow().is_some() && c.calls.abandoned() == 0 {
                        break;
                    }
                    reactor::sleep(Duration::from_millis(20)).await;
                }
                let got = pulled.borrow_mut().take().expect("the OSD pulled");
                assert_eq!(got.expect("pull after the caller left"), vec![0xab; 8192]);
                assert!(c.calls.abandoned() == 0, "the late reply released it");
                assert!(!c.is_failed(), "the connection survived");
            })
            .unwrap();
    }
}
