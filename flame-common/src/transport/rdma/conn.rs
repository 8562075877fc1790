//! RDMA connections: reliable-connection queue pairs on the reactor.
//!
//! **Bring-up.** A connection starts as a TCP connection (the *bootstrap*): both
//! ends create a queue pair, post their receive buffers, exchange a
//! [`ConnInfo`] (QP number, PSN, LID/GID, MTU, receive depth), move the queue pair
//! through INIT → RTR → RTS and confirm with one byte each way. The TCP connection
//! then stays open as the connection's *lifeline*: a peer that dies closes it, and
//! the connection fails at once instead of waiting for a SEND to exhaust its retries
//! (a peer that only receives would otherwise never notice).
//!
//! **Two-sided.** Flame messages are serialised exactly as on TCP (128-byte header,
//! payload) into a byte stream carried by SENDs of at most [`SLOT_BYTES`], each with
//! an 8-byte [`FrameHeader`]. The sender copies queued bytes into registered send
//! slots; the receiver keeps [`RECV_SLOTS`] registered receive buffers posted and
//! cuts messages out of the received chunks ([`StreamDecoder`]); a receive buffer is
//! re-posted once its bytes are consumed, and its credit goes back to the sender in
//! the next frame ([`Credits`]). So a receiver that stops reading stops its sender
//! (bounded memory on both sides), and no SEND ever finds no buffer. Payloads are
//! copied once on each side on this path; large payloads are meant to travel
//! one-sided (read-write conversion), which is zero-copy.
//!
//! **One-sided.** [`RdmaConn::read_remote`] / [`RdmaConn::write_remote`] post RDMA
//! READ/WRITE against a peer's grant (address, length, rkey); the local buffer is
//! registered for the operation. [`RdmaConn::grant_read`] /
//! [`RdmaConn::grant_write`] register exactly the granted buffer with remote access
//! (the pool's regions themselves are registered for local access only), so the NIC
//! enforces the grant's bounds, and deregistering it when the grant ends revokes it:
//! a later access fails in the NIC with a remote access error, which fails the
//! initiator's connection (and the target's, through the queue pair's error state
//! and the lifeline).
//!
//! **Completions.** All queue pairs of a thread share one completion queue
//! ([`ThreadCq`]) with one completion channel. A per-thread driver task polls the
//! queue while completions keep coming (yielding to other tasks between batches),
//! and when a poll finds nothing it arms the queue (`ibv_req_notify_cq`), polls once
//! more, and sleeps on the channel's file descriptor through io_uring. Every
//! completion's work-request id names its connection ([`WrId`]); an error
//! completion fails that connection.
//!
//! **Memory safety.** The NIC reads and writes memory behind Rust's back: receive
//! and send slots, one-sided buffers, granted buffers. Each stays alive and
//! registered until the queue pair that could touch it is destroyed or its work
//! request has completed: [`RdmaConn`]'s fields are declared so the queue pair is
//! dropped (destroyed) first, one-sided operations park their buffer in the
//! connection until their completion arrives even if the awaiting future is dropped,
//! and a grant holds its buffer until it is dropped (which deregisters it first).

use super::device::{Device, device, mtu_code, mtu_from_code};
use super::wire::{
    CONN_INFO_LEN, CONN_INFO_MAGIC, ConnInfo, Credits, FRAME_HEADER_LEN, FrameHeader, FrameKind,
    PayloadAlloc, QP_NUM_MASK, StreamDecoder, WrId, WrKind,
};
use crate::buffer::{PayloadBuf, PayloadBufMut};
use crate::collections::HashMap;
use crate::protocol::{Message, PAYLOAD_BYTES_MAX, RemoteBuf};
use crate::reactor;
use crate::transport::TransportError;
use crate::transport::grant::{
    GRANTS_PER_CONN_MAX, Grant, GrantOwner, Refusal, SharedArea, WriteGrant, buffer_writer,
    check_grant_len,
};
use crate::transport::receive::{Abandoned, Ending, Receiver};
use crate::transport::send_queue::{Backlog, PushRefused, SendQueue};
use rdma_mummy_sys::{
    ibv_ack_cq_events, ibv_cq, ibv_get_cq_event, ibv_poll_cq, ibv_req_notify_cq, ibv_wc,
    ibv_wc_status,
};
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::ptr::NonNull;
use std::rc::{Rc, Weak};
use std::task::{Poll, Waker};
use std::time::Duration;

/// Receive buffers each connection keeps posted (the peer's send window).
pub const RECV_SLOTS: u16 = 32;
/// Size of each send and receive slot, frame header included.
pub const SLOT_BYTES: u32 = 16 << 10;
/// Send slots per connection (a SEND's slot is free again at its completion).
pub const SEND_SLOTS: u32 = 32;
/// One-sided operations a connection may have in flight; more wait.
pub const ONE_SIDED_MAX: u32 = 16;
/// Completion-queue entries of each thread's queue (capped by the device).
pub const THREAD_CQ_ENTRIES: u32 = 32768;
/// Completion-queue entries a connection can have outstanding at once: every
/// posted receive, send and one-sided operation.
const CQE_PER_CONN: u32 = RECV_SLOTS as u32 + SEND_SLOTS + ONE_SIDED_MAX;
/// Completions taken from the queue per poll.
const POLL_BATCH: usize = 32;
/// Bound on the bootstrap exchange (TCP connect excluded: it has its own timeout).
pub const HANDSHAKE_TIMEOUT_MS: u64 = 5000;
/// Bound on bytes queued for sending on one connection (as on TCP).
pub const SEND_QUEUE_BYTES_MAX: usize = crate::transport::tcp::SEND_QUEUE_BYTES_MAX;
/// Completion-channel events consumed per wake-up (each is acknowledged).
const EVENTS_PER_WAKE_MAX: u32 = 64;

/// `flame_rdma_completions_total{op}`: successful work completions of this
/// process's queue pairs, by work request — `read` and `write` are the one-sided
/// RDMA READs and WRITEs it initiated (read-write conversion, remote fetching),
/// `send` and `recv` the two-sided frames. Process-wide; only a device makes them
/// (rdma has no emulation), so they show that verbs ran.
struct CompletionCounters {
    read: prometheus::IntCounter,
    write: prometheus::IntCounter,
    send: prometheus::IntCounter,
    recv: prometheus::IntCounter,
}

static COMPLETIONS: std::sync::LazyLock<CompletionCounters> = std::sync::LazyLock::new(|| {
    let opts = prometheus::Opts::new(
        "flame_rdma_completions_total",
        "Successful RDMA work completions, by work request: read and write (one-sided, initiated here), send and recv (two-sided frames)",
    );
    let unregistered = || {
        prometheus::IntCounter::new("flame_rdma_completions_unregistered", "-")
            .unwrap_or_else(|_| unreachable!("a constant, valid metric name"))
    };
    match prometheus::IntCounterVec::new(opts, &["op"]) {
        Ok(v) => {
            if let Err(e) = prometheus::register(Box::new(v.clone())) {
                tracing::warn!("rdma completion metrics not registered: {e}");
            }
            CompletionCounters {
                read: v.with_label_values(&["read"]),
                write: v.with_label_values(&["write"]),
                send: v.with_label_values(&["send"]),
                recv: v.with_label_values(&["recv"]),
            }
        }
        Err(e) => {
            tracing::warn!("rdma completion metrics not created: {e}");
            CompletionCounters {
                read: unregistered(),
                write: unregistered(),
                send: unregistered(),
                recv: unregistered(),
            }
        }
    }
});

/// Successful completions so far in this process: `(read, write, send, recv)`
/// (see `flame_rdma_completions_total`).
pub fn completion_counts() -> (u64, u64, u64, u64) {
    (
        COMPLETIONS.read.get(),
        COMPLETIONS.write.get(),
        COMPLETIONS.send.get(),
        COMPLETIONS.recv.get(),
    )
}

/// A verbs completion, copied out of the queue.
#[derive(Clone, Copy, Debug)]
struct Completion {
    wr_id: u64,
    status: u32,
    vendor_err: u32,
    byte_len: u32,
}

/// Name of a work-completion status, for error messages (no panic on new codes).
fn status_name(status: u32) -> &'static str {
    match status {
        ibv_wc_status::IBV_WC_SUCCESS => "success",
        ibv_wc_status::IBV_WC_LOC_LEN_ERR => "local length error",
        ibv_wc_status::IBV_WC_LOC_QP_OP_ERR => "local QP operation error",
        ibv_wc_status::IBV_WC_LOC_PROT_ERR => "local protection error",
        ibv_wc_status::IBV_WC_WR_FLUSH_ERR => "flushed (queue pair in error state)",
        ibv_wc_status::IBV_WC_LOC_ACCESS_ERR => "local access error",
        ibv_wc_status::IBV_WC_REM_INV_REQ_ERR => "remote invalid request",
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR => "remote access error (bad key or out of bounds)",
        ibv_wc_status::IBV_WC_REM_OP_ERR => "remote operation error",
        ibv_wc_status::IBV_WC_RETRY_EXC_ERR => "transport retries exceeded (peer unreachable)",
        ibv_wc_status::IBV_WC_RNR_RETRY_EXC_ERR => "receiver-not-ready retries exceeded",
        ibv_wc_status::IBV_WC_FATAL_ERR => "fatal device error",
        ibv_wc_status::IBV_WC_RESP_TIMEOUT_ERR => "response timeout",
        _ => "error",
    }
}

/// 32 random bits from the kernel (packet sequence numbers).
fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    // SAFETY: writing at most 4 bytes into a 4-byte array.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 4, 0) };
    if n != 4 {
        // getrandom on a 4-byte buffer does not fail on Linux >= 3.17; the PSN only
        // needs to differ between connections, so a time-based value is enough.
        let ms = crate::clock::unix_ms();
        return (ms ^ (ms >> 32)) as u32;
    }
    u32::from_le_bytes(b)
}

/// Page-aligned memory registered with the device for the life of a connection.
/// The region (declared first) is deregistered before the memory is freed.
struct SlotMemory {
    mr: Option<MemoryRegion<'static>>,
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

impl SlotMemory {
    fn new(dev: &'static Device, bytes: usize, access: AccessFlags) -> Result<SlotMemory, String> {
        let layout = std::alloc::Layout::from_size_align(bytes, 4096)
            .map_err(|e| format!("slot memory layout: {e}"))?;
        // SAFETY: non-zero size (callers pass slots * SLOT_BYTES > 0).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            return Err(format!("cannot allocate {bytes} bytes of RDMA slot memory"));
        };
        // SAFETY: `ptr` is valid for `bytes` bytes until `Drop`, which deregisters
        // the region before freeing.
        let mr = unsafe { dev.pd.reg_mr(ptr.as_ptr() as usize, bytes, access) };
        match mr {
            Ok(mr) => Ok(SlotMemory {
                mr: Some(mr),
                ptr,
                layout,
            }),
            Err(e) => {
                // SAFETY: allocated above with this layout, never registered.
                unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
                Err(format!(
                    "cannot register {bytes} bytes with the RDMA device: {e}"
                ))
            }
        }
    }

    fn lkey(&self) -> u32 {
        self.mr.as_ref().map_or(0, MemoryRegion::lkey)
    }

    fn addr(&self, slot: u32) -> u64 {
        self.ptr.as_ptr() as u64 + u64::from(slot) * u64::from(SLOT_BYTES)
    }

    /// The bytes of `slot`.
    ///
    /// # Safety
    /// No work request may be writing the slot (its receive completed and it was
    /// not re-posted yet, or it is a send slot not in flight), and no other slice
    /// of the same slot may be alive.
    // The memory is the NIC's and ours, not `self`'s: `&self` hands out slot views
    // under the contract above, like a slab of DMA buffers.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slot(&self, slot: u32) -> &mut [u8] {
        let off = slot as usize * SLOT_BYTES as usize;
        debug_assert!(off + SLOT_BYTES as usize <= self.layout.size());
        // SAFETY: in bounds (asserted); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(off), SLOT_BYTES as usize) }
    }
}

impl Drop for SlotMemory {
    fn drop(&mut self) {
        drop(self.mr.take());
        // SAFETY: allocated in `new` with `layout`; deregistered just above and the
        // owning connection destroyed its queue pair before dropping this.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

/// One thread's completion queue and completion channel, shared by the thread's
/// connections. Field order is drop order: the queue before the channel it uses.
pub struct ThreadCq {
    cq: BasicCompletionQueue<'static>,
    channel: Box<CompletionChannel<'static>>,
    conns: RefCell<HashMap<u32, Weak<RdmaConn>>>,
    next_conn: Cell<u32>,
    reserved_cqe: Cell<u32>,
    capacity_cqe: u32,
    /// Whether the queue is armed (an event will come on the channel).
    armed: Cell<bool>,
    /// The reactor whose driver task serves this queue ([`reactor::current_id`]).
    reactor: Option<u64>,
}

thread_local! {
    static THREAD_CQ: RefCell<Option<Rc<ThreadCq>>> = const { RefCell::new(None) };
}

impl ThreadCq {
    /// The current thread's queue, created (with its driver task) on first use.
    fn current(dev: &'static Device) -> Result<Rc<ThreadCq>, String> {
        let reactor = reactor::current_id();
        // A queue made under an earlier reactor of this thread has no driver any
        // more (its task died with that reactor): make a new one. The old one lives
        // on as long as its connections do.
        if let Some(t) = THREAD_CQ.with(|c| c.borrow().clone())
            && t.reactor == reactor
        {
            return Ok(t);
        }
        let channel = dev
            .ctx
            .create_comp_channel()
            .map_err(|e| format!("cannot create an RDMA completion channel: {e}"))?;
        channel
            .set_nonblocking(true)
            .map_err(|e| format!("cannot make the completion channel non-blocking: {e}"))?;
        let channel = Box::new(channel);
        // SAFETY: the channel is boxed (stable address) and stored in the same
        // `ThreadCq` after the queue, so it outlives the queue that refers to it.
        let channel_ref: &'static CompletionChannel<'static> =
            unsafe { &*(&*channel as *const CompletionChannel<'static>) };
        let entries = THREAD_CQ_ENTRIES.min(dev.cqe_max.max(CQE_PER_CONN * 2));
        let cq = dev
            .ctx
            .create_cq_builder()
            .setup_cqe(entries)
            .setup_comp_channel(channel_ref, 0)
            .build()
            .map_err(|e| format!("cannot create an RDMA completion queue of {entries}: {e}"))?;
        let t = Rc::new(ThreadCq {
            cq,
            channel,
            conns: RefCell::new(HashMap::default()),
            next_conn: Cell::new(1),
            reserved_cqe: Cell::new(0),
            // Half the entries: completions of destroyed queue pairs may linger.
            capacity_cqe: entries / 2,
            armed: Cell::new(false),
            reactor,
        });
        THREAD_CQ.with(|c| *c.borrow_mut() = Some(t.clone()));
        // The reactor polls the queue in its loop under the thread's poll mode
        // (every pass; every spin in busy/adaptive) and arms it before sleeping.
        // No doorbell: the completion channel is not an eventfd (reading it would
        // skip the driver's event bookkeeping), so the driver task below sleeps on
        // it and consumes its events through ibv_get_cq_event.
        reactor::add_poll_source(t.clone());
        reactor::spawn(drive(Rc::downgrade(&t))).detach();
        Ok(t)
    }

    fn raw(&self) -> *mut ibv_cq {
        // SAFETY: the queue is alive as long as `self`.
        unsafe { self.cq.cq().as_ptr() }
    }

    /// Reserves completion entries for one more connection (refused when the
    /// thread's queue is full: overrunning a completion queue breaks every queue
    /// pair on it).
    fn register(&self) -> Result<u32, String> {
        let used = self.reserved_cqe.get();
        if used + CQE_PER_CONN > self.capacity_cqe {
            return Err(format!(
                "this thread's RDMA completion queue is full ({} connections of {CQE_PER_CONN} \
                 entries each)",
                used / CQE_PER_CONN
            ));
        }
        self.reserved_cqe.set(used + CQE_PER_CONN);
        let id = self.next_conn.get();
        self.next_conn.set(id.wrapping_add(1).max(1));
        Ok(id)
    }

    fn unregister(&self, id: u32) {
        self.conns.borrow_mut().remove(&id);
        self.reserved_cqe
            .set(self.reserved_cqe.get().saturating_sub(CQE_PER_CONN));
    }

    /// Takes up to one batch of completions and hands each to its connection.
    /// Returns whether any were found (a reactor poll source's `poll`).
    pub fn poll(&self) -> bool {
        let mut wcs: [std::mem::MaybeUninit<ibv_wc>; POLL_BATCH] =
            [const { std::mem::MaybeUninit::uninit() }; POLL_BATCH];
        // SAFETY: a live queue and room for POLL_BATCH entries.
        let n = unsafe { ibv_poll_cq(self.raw(), POLL_BATCH as i32, wcs.as_mut_ptr().cast()) };
        if n < 0 {
            tracing::error!(
                "polling the RDMA completion queue failed: {}",
                io::Error::from_raw_os_error(-n)
            );
            return false;
        }
        let n = (n as usize).min(POLL_BATCH);
        let mut done = [Completion {
            wr_id: 0,
            status: 0,
            vendor_err: 0,
            byte_len: 0,
        }; POLL_BATCH];
        for (i, wc) in wcs.iter().take(n).enumerate() {
            // SAFETY: ibv_poll_cq filled the first `n` entries.
            let wc = unsafe { wc.assume_init_ref() };
            done[i] = Completion {
                wr_id: wc.wr_id,
                status: wc.status,
                vendor_err: wc.vendor_err,
                byte_len: wc.byte_len,
            };
        }
        for c in &done[..n] {
            self.dispatch(*c);
        }
        n > 0
    }

    fn dispatch(&self, c: Completion) {
        let Some(id) = WrId::decode(c.wr_id) else {
            tracing::warn!(
                wr_id = c.wr_id,
                "RDMA completion with a foreign work-request id"
            );
            return;
        };
        let conn = self.conns.borrow().get(&id.conn).and_then(Weak::upgrade);
        // None: a flushed work request of a connection already gone.
        if let Some(conn) = conn {
            conn.complete(id, c);
        }
    }

    /// Arms the queue's completion event before the thread sleeps. Returns false
    /// when completions arrived meanwhile (poll again instead of sleeping) — a
    /// reactor poll source's `arm`.
    pub fn arm(&self) -> bool {
        if !self.armed.get() {
            // SAFETY: a live queue.
            let rc = unsafe { ibv_req_notify_cq(self.raw(), 0) };
            if rc != 0 {
                tracing::error!(
                    "arming the RDMA completion queue failed: {}",
                    io::Error::from_raw_os_error(rc)
                );
                return false;
            }
            self.armed.set(true);
        }
        // A completion that arrived between the last poll and the arming raised no
        // event: poll once more.
        !self.poll()
    }

    /// Consumes and acknowledges the channel's pending events (non-blocking).
    fn consume_events(&self) {
        let mut got = 0u32;
        // Bounded: at most EVENTS_PER_WAKE_MAX events per wake-up.
        while got < EVENTS_PER_WAKE_MAX {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut libc::c_void = std::ptr::null_mut();
            // SAFETY: the channel of our queue (`ibv_cq.channel`), non-blocking.
            let rc = unsafe { ibv_get_cq_event((*self.raw()).channel, &mut cq, &mut ctx) };
            if rc != 0 {
                break;
            }
            got += 1;
            // SAFETY: the event names the queue it came from (ours: one queue per
            // channel); every event read is acknowledged, or destroying the queue
            // would wait for it forever.
            unsafe { ibv_ack_cq_events(cq, 1) };
        }
        if got > 0 {
            self.armed.set(false);
        }
    }

    fn channel_fd(&self) -> RawFd {
        self.channel.as_raw_fd()
    }
}

impl reactor::PollSource for ThreadCq {
    fn poll(&self) -> bool {
        ThreadCq::poll(self)
    }

    fn arm(&self) -> bool {
        ThreadCq::arm(self)
    }
}

/// The per-thread completion driver: polls while there is work, otherwise arms the
/// queue and sleeps on the completion channel.
async fn drive(t: Weak<ThreadCq>) {
    loop {
        let Some(cq) = t.upgrade() else { return };
        if cq.poll() {
            drop(cq);
            reactor::yield_now().await;
            continue;
        }
        if !cq.arm() {
            drop(cq);
            reactor::yield_now().await;
            continue;
        }
        let fd = cq.channel_fd();
        drop(cq);
        if let Err(e) = reactor::poll_readable(fd).await {
            tracing::error!("waiting on the RDMA completion channel failed: {e}");
            reactor::sleep(Duration::from_millis(1)).await;
        }
        if let Some(cq) = t.upgrade() {
            cq.consume_events();
        }
    }
}

/// Memory the NIC may touch for an in-flight one-sided operation. Field order:
/// the registration goes before the memory.
/// `None` registrations: the buffer is inside a registered pool region.
enum OneSidedKeep {
    Read {
        _mr: Option<MemoryRegion<'static>>,
        buf: PayloadBufMut,
    },
    Write {
        _mr: Option<MemoryRegion<'static>>,
        _buf: PayloadBuf,
    },
}

/// The local key for `len` bytes at `addr`: a registered pool region's, or a
/// registration made for this operation (returned, to be kept with the buffer).
fn local_key(
    dev: &'static Device,
    addr: u64,
    len: usize,
    what: &str,
) -> Result<(u32, Option<MemoryRegion<'static>>), TransportError> {
    if let Some(lkey) = super::device::local_lkey(addr as *const u8, len) {
        return Ok((lkey, None));
    }
    // SAFETY: callers keep the buffer alive (parked with the returned region)
    // until the operation completes.
    let mr = unsafe { dev.pd.reg_mr(addr as usize, len, AccessFlags::LocalWrite) }
        .map_err(|e| err(format!("registering a {what}: {e}")))?;
    Ok((mr.lkey(), Some(mr)))
}

/// A one-sided work request: READ (`read`) or WRITE of `len` bytes at local `addr`
/// (registered, `lkey`) from or to `remote_addr` under `rkey`.
struct OneSidedWr {
    read: bool,
    addr: u64,
    len: u32,
    lkey: u32,
    remote_addr: u64,
    rkey: u32,
}

struct OneSidedOp {
    status: Option<Completion>,
    waker: Option<Waker>,
    keep: Option<OneSidedKeep>,
    /// The awaiting future is gone: free the slot at completion.
    orphaned: bool,
}

/// What [`RdmaConn::poll_message`] found.
enum Received {
    Message(Message),
    /// The decoder waits for a payload buffer of this length from the pool.
    NeedsMemory(usize),
}

/// Queued bytes waiting for a send slot and a credit.
enum Chunk {
    Bytes(Vec<u8>),
    Payload(PayloadBuf),
}

impl Chunk {
    fn bytes(&self) -> &[u8] {
        match self {
            Chunk::Bytes(b) => b,
            Chunk::Payload(p) => p.as_slice(),
        }
    }
}

/// What waits for a send slot and a credit ([`SendQueue`]'s backlog).
#[derive(Default)]
struct Chunks {
    chunks: VecDeque<Chunk>,
    /// Bytes of the front chunk already sent.
    front_sent: usize,
}

impl Backlog for Chunks {
    fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }
}

struct State {
    credits: Credits,
    free_send: Vec<u32>,
    sends_in_flight: u32,
    /// Data bytes posted in SENDs since the connection began.
    posted_bytes: u64,
    /// While data waits for the peer's credits: the `posted_bytes` at which
    /// everything queued when the wait began will have gone (the stall marks'
    /// unit of send progress, a batch, as on tcp: a peer returning a credit now
    /// and then does not count as reading).
    batch_end: Option<u64>,
    /// Received data frames not yet consumed: (slot, data length, consumed).
    filled: VecDeque<(u32, u32, u32)>,
    decoder: StreamDecoder,
    recv_waker: Option<Waker>,
    ops: slab::Slab<OneSidedOp>,
    op_waiters: VecDeque<Waker>,
}

/// One RDMA connection owned by the current reactor thread. Field order is drop
/// order and matters (see the module documentation).
pub struct RdmaConn {
    qp: RefCell<BasicQueuePair<'static>>,
    state: RefCell<State>,
    recv_mem: SlotMemory,
    send_mem: SlotMemory,
    thread: Rc<ThreadCq>,
    lifeline: TcpStream,
    dev: &'static Device,
    id: u32,
    peer: SocketAddr,
    /// The peer's receive depth (known once the bootstrap exchange is done).
    peer_recv_slots: Cell<u16>,
    /// Data waiting for a send slot and the peer's credits, and the close
    /// state; and what the connection waits on, for the owner's stall watchdog
    /// ([`crate::transport::stall`]): a message partly received when the
    /// received frames ran out (a peer that stops mid-payload holds a pool
    /// buffer), data queued that no SEND could take for lack of the peer's
    /// credits (a peer that stops reading holds the queued payloads); one unit
    /// of send progress is one data frame posted.
    tx: SendQueue<Chunks>,
    /// Payloads received while the pool is exhausted take heap memory instead of
    /// waiting ([`RdmaConn::set_never_wait_for_memory`]).
    never_wait: Cell<bool>,
    failure: RefCell<Option<String>>,
    /// Live grants by key (rkey). After `qp` in the field order is irrelevant
    /// here: a grant is reachable only through a queue pair, and the queue pair is
    /// destroyed first.
    grants: RefCell<HashMap<u32, GrantEntry>>,
    /// The one receive at a time ([`crate::transport::receive`]); the decoder
    /// keeps a message's progress, so an abandoned receive loses nothing.
    rx: Receiver<()>,
}

impl Drop for RdmaConn {
    fn drop(&mut self) {
        // Wakes the lifeline task's receive so it ends.
        let _ = self.lifeline.shutdown(std::net::Shutdown::Both);
        self.thread.unregister(self.id);
    }
}

fn err(msg: impl Into<String>) -> TransportError {
    TransportError::Io(io::Error::other(msg.into()))
}

async fn with_timeout<T>(
    ms: u64,
    what: &str,
    fut: impl std::future::Future<Output = Result<T, TransportError>>,
) -> Result<T, TransportError> {
    let what = what.to_string();
    futures_lite::future::or(fut, async move {
        reactor::sleep(Duration::from_millis(ms)).await;
        Err(err(format!("{what} timed out after {ms} ms")))
    })
    .await
}

async fn write_all(fd: RawFd, bytes: Vec<u8>) -> Result<(), TransportError> {
    let mut sent = 0;
    let mut buf = bytes;
    // Bounded: each round sends at least one byte or fails.
    while sent < buf.len() {
        let (res, back) = reactor::send(fd, buf, sent).await;
        buf = back;
        match res {
            Ok(0) => return Err(TransportError::Closed),
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

async fn read_exact(fd: RawFd, len: usize) -> Result<Vec<u8>, TransportError> {
    let mut buf = vec![0u8; len];
    let mut got = 0;
    // Bounded: each round receives at least one byte or fails.
    while got < len {
        let (res, back) = reactor::recv(fd, buf, got).await;
        buf = back;
        match res {
            Ok(0) => return Err(TransportError::Closed),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(buf)
}

impl RdmaConn {
    /// Brings a connection up over the connected bootstrap socket `stream`.
    /// `initiator` sends its [`ConnInfo`] first.
    async fn establish(stream: TcpStream, initiator: bool) -> Result<Rc<RdmaConn>, TransportError> {
        let dev = device().map_err(TransportError::Unavailable)?;
        stream.set_nodelay(true)?;
        let peer = stream
            .peer_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
        let thread = ThreadCq::current(dev).map_err(err)?;
        let id = thread.register().map_err(err)?;
        // From here, `conn`'s Drop gives the reservation back.
        // SAFETY: `thread` (an Rc'd, never-moving ThreadCq) is stored in the
        // connection after the queue pair, so the queue outlives the queue pair.
        let cq_ref: &'static BasicCompletionQueue<'static> =
            unsafe { &*(&thread.cq as *const BasicCompletionQueue<'static>) };
        let mut builder = dev.pd.create_qp_builder();
        builder
            .setup_max_send_wr(SEND_SLOTS + ONE_SIDED_MAX)
            .setup_max_recv_wr(u32::from(RECV_SLOTS))
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(0)
            .setup_send_cq(cq_ref)
            .setup_recv_cq(cq_ref);
        let qp = match builder.build() {
            Ok(qp) => qp,
            Err(e) => {
                thread.unregister(id);
                return Err(err(format!("cannot create an RDMA queue pair: {e}")));
            }
        };
        let slots = |n: u32| n as usize * SLOT_BYTES as usize;
        let mems = SlotMemory::new(dev, slots(u32::from(RECV_SLOTS)), AccessFlags::LocalWrite)
            .and_then(|r| {
                SlotMemory::new(dev, slots(SEND_SLOTS), AccessFlags::LocalWrite).map(|s| (r, s))
            });
        let (recv_mem, send_mem) = match mems {
            Ok(m) => m,
            Err(e) => {
                drop(qp);
                thread.unregister(id);
                return Err(err(e));
            }
        };
        let conn = Rc::new(RdmaConn {
            qp: RefCell::new(qp),
            state: RefCell::new(State {
                credits: Credits::new(0, RECV_SLOTS),
                free_send: (0..SEND_SLOTS).rev().collect(),
                sends_in_flight: 0,
                posted_bytes: 0,
                batch_end: None,
                filled: VecDeque::new(),
                decoder: StreamDecoder::default(),
                recv_waker: None,
                ops: slab::Slab::with_capacity(ONE_SIDED_MAX as usize),
                op_waiters: VecDeque::new(),
            }),
            recv_mem,
            send_mem,
            thread: thread.clone(),
            lifeline: stream,
            dev,
            id,
            peer,
            peer_recv_slots: Cell::new(0),
            tx: SendQueue::new(SEND_QUEUE_BYTES_MAX),
            never_wait: Cell::new(false),
            failure: RefCell::new(None),
            grants: RefCell::new(HashMap::default()),
            rx: Receiver::new((), Abandoned::Resumes),
        });
        thread.conns.borrow_mut().insert(id, Rc::downgrade(&conn));
        let conn = Self::bring_up(conn, initiator).await?;
        reactor::spawn(lifeline(Rc::downgrade(&conn))).detach();
        Ok(conn)
    }

    /// INIT, receives posted, info exchanged, RTR, RTS, ready byte exchanged.
    async fn bring_up(conn: Rc<RdmaConn>, initiator: bool) -> Result<Rc<RdmaConn>, TransportError> {
        let dev = conn.dev;
        let access = AccessFlags::LocalWrite | AccessFlags::RemoteWrite | AccessFlags::RemoteRead;
        {
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::Init)
                .setup_pkey_index(0)
                .setup_port(dev.port)
                .setup_access_flags(access);
            conn.qp
                .borrow_mut()
                .modify(&attr)
                .map_err(|e| err(format!("RDMA queue pair to INIT: {e}")))?;
        }
        for slot in 0..u32::from(RECV_SLOTS) {
            conn.post_recv(slot)?;
        }
        let psn = random_u32() & QP_NUM_MASK;
        let local = ConnInfo {
            lid: dev.lid,
            qp_num: conn.qp.borrow().qp_number(),
            psn,
            gid: dev.gid.raw,
            mtu: mtu_code(dev.mtu),
            recv_slots: RECV_SLOTS,
            slot_bytes: SLOT_BYTES,
        };
        let fd = conn.lifeline.as_raw_fd();
        let remote = with_timeout(HANDSHAKE_TIMEOUT_MS, "RDMA bootstrap exchange", async {
            if initiator {
                write_all(fd, local.encode().to_vec()).await?;
            }
            let b = read_exact(fd, CONN_INFO_LEN).await?;
            let mut fixed = [0u8; CONN_INFO_LEN];
            fixed.copy_from_slice(&b);
            let remote = ConnInfo::decode(&fixed).map_err(err)?;
            if !initiator {
                write_all(fd, local.encode().to_vec()).await?;
            }
            Ok(remote)
        })
        .await?;
        // Before the queue pair can receive: the peer may send as soon as it has
        // read our ready byte, before we have read its one.
        conn.peer_recv_slots.set(remote.recv_slots);
        conn.state.borrow_mut().credits = Credits::new(remote.recv_slots, RECV_SLOTS);
        if remote.slot_bytes < SLOT_BYTES {
            return Err(err(format!(
                "peer's {}-byte receive slots are smaller than this build's {SLOT_BYTES}",
                remote.slot_bytes
            )));
        }
        {
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::ReadyToReceive)
                .setup_path_mtu(dev.mtu.min(mtu_from_code(u32::from(remote.mtu))))
                .setup_dest_qp_num(remote.qp_num)
                .setup_rq_psn(remote.psn)
                .setup_max_dest_read_atomic(dev.reads_in_flight)
                .setup_min_rnr_timer(12);
            let mut ah = AddressHandleAttribute::new();
            ah.setup_dest_lid(remote.lid)
                .setup_port(dev.port)
                .setup_service_level(0);
            if remote.gid != [0u8; 16] {
                ah.setup_grh_dest_gid(&Gid { raw: remote.gid })
                    .setup_grh_src_gid_index(dev.gid_index)
                    .setup_grh_hop_limit(64);
            }
            attr.setup_address_vector(&ah);
            conn.qp
                .borrow_mut()
                .modify(&attr)
                .map_err(|e| err(format!("RDMA queue pair to RTR: {e}")))?;
            let mut attr = QueuePairAttribute::new();
            attr.setup_state(QueuePairState::ReadyToSend)
                .setup_sq_psn(psn)
                .setup_timeout(14)
                .setup_retry_cnt(7)
                .setup_rnr_retry(7)
                .setup_max_read_atomic(dev.reads_in_flight);
            conn.qp
                .borrow_mut()
                .modify(&attr)
                .map_err(|e| err(format!("RDMA queue pair to RTS: {e}")))?;
        }
        // Both queue pairs are ready to receive before either sends.
        with_timeout(HANDSHAKE_TIMEOUT_MS, "RDMA bootstrap ready", async {
            write_all(fd, vec![1u8]).await?;
            let b = read_exact(fd, 1).await?;
            if b[0] != 1 {
                return Err(err("peer sent a bad ready byte on the RDMA bootstrap"));
            }
            Ok(())
        })
        .await?;
        Ok(conn)
    }

    /// Connects to a Flame RDMA endpoint at `addr` (its TCP bootstrap address),
    /// leaving from `source` when given.
    pub async fn connect_from(
        addr: SocketAddr,
        source: Option<IpAddr>,
        timeout: Duration,
    ) -> Result<Rc<RdmaConn>, TransportError> {
        device().map_err(TransportError::Unavailable)?;
        let owned = crate::transport::tcp::new_socket(addr, source)?;
        let raw = owned.as_raw_fd();
        let connect = async {
            reactor::connect(raw, addr)
                .await
                .map_err(TransportError::from)
        };
        let expire = async {
            reactor::sleep(timeout).await;
            Err(TransportError::ConnectTimeout(addr))
        };
        futures_lite::future::or(connect, expire).await?;
        RdmaConn::establish(TcpStream::from(owned), true).await
    }

    fn post_recv(&self, slot: u32) -> Result<(), TransportError> {
        let id = WrId {
            conn: self.id,
            kind: WrKind::Recv,
            index: slot,
        };
        let mut qp = self.qp.borrow_mut();
        let mut guard = qp.start_post_recv();
        let wr = guard.construct_wr(id.encode());
        // SAFETY: the slot is in registered memory that lives until the queue pair
        // is destroyed; no other work request uses it (it was just consumed).
        unsafe { wr.setup_sge(self.recv_mem.lkey(), self.recv_mem.addr(slot), SLOT_BYTES) };
        guard
            .post()
            .map_err(|e| err(format!("posting an RDMA receive: {e}")))
    }

    /// Posts as many frames as slots and credits allow (and a credit frame when
    /// credits are owed). Bounded by the send slots.
    fn pump(&self) {
        if self.tx.is_closed() {
            return;
        }
        let posted = self.pump_frames();
        let mut st = self.state.borrow_mut();
        st.posted_bytes += posted as u64;
        match st.batch_end {
            // Everything queued when the wait began has gone.
            Some(end) if st.posted_bytes >= end => {
                st.batch_end = None;
                self.tx.marks().send_finished();
            }
            // A batch that went at once (activity, for idleness).
            None if posted > 0 && self.tx.queued_bytes() == 0 => {
                self.tx.marks().send_started();
                self.tx.marks().send_finished();
            }
            _ => {}
        }
        // Data left queued waits for the peer's credits (or a send slot).
        let queued_bytes = self.tx.queued_bytes();
        if queued_bytes > 0 && st.batch_end.is_none() {
            st.batch_end = Some(st.posted_bytes + queued_bytes as u64);
            self.tx.marks().send_started();
        }
    }

    /// Posts frames; returns the data bytes posted.
    fn pump_frames(&self) -> usize {
        let mut data_posted = 0;
        for _ in 0..SEND_SLOTS {
            let mut st = self.state.borrow_mut();
            if st.free_send.is_empty() {
                break;
            }
            let kind = if self.tx.queued_bytes() > 0 && st.credits.can_send_data() {
                FrameKind::Data
            } else if st.credits.needs_credit_frame() {
                FrameKind::Credit
            } else {
                break;
            };
            let Some(slot) = st.free_send.pop() else {
                break;
            };
            let credits = st.credits.take_for_frame();
            // SAFETY: a free send slot: no work request uses it.
            let mem = unsafe { self.send_mem.slot(slot) };
            let mut len = 0usize;
            if kind == FrameKind::Data {
                let room = SLOT_BYTES as usize - FRAME_HEADER_LEN;
                self.tx.take(|q| {
                    // Bounded: each round consumes a chunk or fills the slot.
                    while len < room {
                        let front_sent = q.front_sent;
                        let Some(front) = q.chunks.front() else { break };
                        let bytes = &front.bytes()[front_sent..];
                        let n = bytes.len().min(room - len);
                        mem[FRAME_HEADER_LEN + len..FRAME_HEADER_LEN + len + n]
                            .copy_from_slice(&bytes[..n]);
                        len += n;
                        if n == bytes.len() {
                            q.chunks.pop_front();
                            q.front_sent = 0;
                        } else {
                            q.front_sent += n;
                        }
                    }
                    ((), len)
                });
            }
            let header = FrameHeader {
                kind,
                credits,
                len: len as u32,
            };
            mem[..FRAME_HEADER_LEN].copy_from_slice(&header.encode());
            st.sends_in_flight += 1;
            drop(st);
            let id = WrId {
                conn: self.id,
                kind: WrKind::Send,
                index: slot,
            };
            let posted = {
                let mut qp = self.qp.borrow_mut();
                let mut guard = qp.start_post_send();
                let wr = guard
                    .construct_wr(id.encode(), WorkRequestFlags::Signaled)
                    .setup_send();
                // SAFETY: the slot stays untouched until this SEND completes.
                unsafe {
                    wr.setup_sge(
                        self.send_mem.lkey(),
                        self.send_mem.addr(slot),
                        (FRAME_HEADER_LEN + len) as u32,
                    )
                };
                guard.post()
            };
            if let Err(e) = posted {
                self.fail(format!("posting an RDMA SEND: {e}"));
                return 0;
            }
            data_posted += len;
        }
        data_posted
    }

    /// A completion of one of this connection's work requests.
    fn complete(&self, id: WrId, c: Completion) {
        let ok = c.status == ibv_wc_status::IBV_WC_SUCCESS;
        match id.kind {
            WrKind::OneSided => {
                let mut st = self.state.borrow_mut();
                let index = id.index as usize;
                let (orphaned, read) = match st.ops.get(index) {
                    Some(op) => (
                        op.orphaned,
                        matches!(op.keep, Some(OneSidedKeep::Read { .. })),
                    ),
                    None => return,
                };
                if ok {
                    if read {
                        COMPLETIONS.read.inc();
                    } else {
                        COMPLETIONS.write.inc();
                    }
                }
                if orphaned {
                    // Its memory may be freed now: the NIC is done with it.
                    st.ops.remove(index);
                    if let Some(w) = st.op_waiters.pop_front() {
                        w.wake();
                    }
                } else if let Some(op) = st.ops.get_mut(index) {
                    op.status = Some(c);
                    if let Some(w) = op.waker.take() {
                        w.wake();
                    }
                }
                drop(st);
                if !ok && !self.tx.is_closed() {
                    self.fail(format!(
                        "RDMA one-sided operation failed: {} (status {}, vendor error {:#x})",
                        status_name(c.status),
                        c.status,
                        c.vendor_err
                    ));
                }
            }
            WrKind::Send => {
                {
                    let mut st = self.state.borrow_mut();
                    st.sends_in_flight = st.sends_in_flight.saturating_sub(1);
                    if id.index < SEND_SLOTS {
                        st.free_send.push(id.index);
                    }
                }
                if ok {
                    COMPLETIONS.send.inc();
                }
                if !ok {
                    if !self.tx.is_closed() {
                        self.fail(format!(
                            "RDMA SEND failed: {} (status {}, vendor error {:#x})",
                            status_name(c.status),
                            c.status,
                            c.vendor_err
                        ));
                    }
                    return;
                }
                self.pump();
                self.maybe_finish_closing();
            }
            WrKind::Recv => {
                if !ok {
                    if !self.tx.is_closed() {
                        self.fail(format!(
                            "RDMA receive failed: {} (status {}, vendor error {:#x})",
                            status_name(c.status),
                            c.status,
                            c.vendor_err
                        ));
                    }
                    return;
                }
                COMPLETIONS.recv.inc();
                if self.tx.is_closed() || id.index >= u32::from(RECV_SLOTS) {
                    return;
                }
                // SAFETY: the receive completed; the slot is not re-posted until its
                // bytes are consumed.
                let mem = unsafe { self.recv_mem.slot(id.index) };
                let header = match FrameHeader::decode(mem, c.byte_len, SLOT_BYTES) {
                    Ok(h) => h,
                    Err(e) => {
                        self.fail(format!("bad RDMA frame from the peer: {e}"));
                        return;
                    }
                };
                let returned = self
                    .state
                    .borrow_mut()
                    .credits
                    .returned(header.credits, self.peer_recv_slots.get());
                if let Err(e) = returned {
                    self.fail(e);
                    return;
                }
                if header.kind == FrameKind::Credit || header.len == 0 {
                    self.repost(id.index);
                } else {
                    let mut st = self.state.borrow_mut();
                    st.filled.push_back((id.index, header.len, 0));
                    if let Some(w) = st.recv_waker.take() {
                        w.wake();
                    }
                }
                self.pump();
            }
        }
    }

    /// Re-posts a consumed receive slot and owes the peer its credit.
    fn repost(&self, slot: u32) {
        if self.tx.is_closed() {
            return;
        }
        if let Err(e) = self.post_recv(slot) {
            self.fail(e.to_string());
            return;
        }
        self.state.borrow_mut().credits.reposted();
    }

    fn maybe_finish_closing(&self) {
        if self.tx.is_closing() && !self.tx.is_closed() {
            let drained = self.tx.queued_bytes() == 0 && self.state.borrow().sends_in_flight == 0;
            if drained {
                self.close();
            }
        }
    }

    /// Fails the connection with `why` (kept for the errors later calls return).
    fn fail(&self, why: String) {
        if self.tx.is_closed() {
            return;
        }
        tracing::debug!(peer = %self.peer, "RDMA connection failed: {why}");
        *self.failure.borrow_mut() = Some(why);
        self.close();
    }

    fn closed_error(&self) -> TransportError {
        match self.failure.borrow().as_ref() {
            Some(why) => err(why.clone()),
            None => TransportError::Closed,
        }
    }

    /// See [`crate::transport::Conn::send`]: the message is queued (header and
    /// payload by reference) and as much as credits allow is posted at once.
    pub fn send(&self, msg: &Message) -> Result<(), TransportError> {
        let (header, payload) = msg.to_header();
        let data = match msg.payload_buf() {
            Some(d) => Chunk::Payload(d.clone()),
            None => Chunk::Bytes(payload.into_owned()),
        };
        self.enqueue(header.encode().to_vec(), data)
    }

    /// Like [`RdmaConn::send`], moving the payload reference.
    pub fn send_owned(&self, msg: Message) -> Result<(), TransportError> {
        self.send(&msg)
    }

    /// Queues raw bytes (a version refusal in another protocol version's format).
    pub fn send_raw(&self, bytes: Vec<u8>) -> Result<(), TransportError> {
        self.enqueue(bytes, Chunk::Bytes(Vec::new()))
    }

    fn enqueue(&self, head: Vec<u8>, data: Chunk) -> Result<(), TransportError> {
        let bytes = head.len() + data.bytes().len();
        let pushed = self.tx.push(bytes, |q| {
            if !head.is_empty() {
                q.chunks.push_back(Chunk::Bytes(head));
            }
            if !data.bytes().is_empty() {
                q.chunks.push_back(data);
            }
        });
        match pushed {
            Ok(()) => {}
            Err(PushRefused::Closed) => return Err(self.closed_error()),
            Err(PushRefused::Backlog(max)) => {
                self.fail(format!("send queue over {max} bytes: peer is not reading"));
                return Err(TransportError::Backlog(max));
            }
        }
        self.pump();
        Ok(())
    }

    /// See [`crate::transport::Conn::recv`]. A payload is taken from the
    /// thread's memory pool; while the pool is exhausted this waits for frees
    /// (bounded by the pool's wait; past it, fails, which closes the connection)
    /// without consuming more received bytes, so the receive slots stay held and
    /// the sender runs out of credits: back-pressure, as on tcp. A connection set
    /// to never wait ([`RdmaConn::set_never_wait_for_memory`]) takes heap memory
    /// instead.
    pub async fn recv(&self) -> Result<Message, TransportError> {
        let close = || self.close();
        let turn = self.rx.begin(&close)?;
        let res = self.recv_inner().await;
        match turn.end(&res) {
            Ending::Open => {}
            Ending::CloseAfterSend => self.close_after_send(),
            Ending::Close => self.close(),
        }
        res
    }

    async fn recv_inner(&self) -> Result<Message, TransportError> {
        // Bounded: each round either returns or gives the decoder the payload
        // buffer it waited for (after which it consumes bytes again).
        loop {
            let len = match std::future::poll_fn(|cx| self.poll_message(cx)).await? {
                Received::Message(m) => return Ok(m),
                Received::NeedsMemory(len) => len,
            };
            let ended = std::future::poll_fn(|cx| {
                if self.tx.is_closed() {
                    return Poll::Ready(None);
                }
                self.state.borrow_mut().recv_waker = Some(cx.waker().clone());
                Poll::Pending
            });
            let wait = async { Some(PayloadBufMut::for_overwrite_wait(len).await) };
            let Some(buf) = futures_lite::future::or(wait, ended).await else {
                return Err(self.closed_error());
            };
            let buf = buf.map_err(io::Error::from)?;
            if self.state.borrow_mut().decoder.supply(buf).is_err() {
                return Err(err("RDMA receive: payload buffer of the wrong length"));
            }
        }
    }

    fn poll_message(
        &self,
        cx: &mut std::task::Context<'_>,
    ) -> Poll<Result<Received, TransportError>> {
        let alloc = if self.never_wait.get() {
            PayloadAlloc::Fallback
        } else {
            PayloadAlloc::PoolOrWait
        };
        // Bounded: each round consumes bytes of a filled slot (at most RECV_SLOTS
        // slots of SLOT_BYTES each are filled at a time) or returns.
        loop {
            if self.tx.is_closed() {
                return Poll::Ready(Err(self.closed_error()));
            }
            let mut st = self.state.borrow_mut();
            if let Some(len) = st.decoder.needs_memory() {
                return Poll::Ready(Ok(Received::NeedsMemory(len)));
            }
            let Some(&(slot, len, used)) = st.filled.front() else {
                if st.decoder.in_payload() {
                    // The peer's next frame of this payload has not come (a
                    // header split across frames, or a wait for pool memory,
                    // is not the peer's stall: as on tcp, only a payload is).
                    self.tx.marks().payload_started();
                }
                st.recv_waker = Some(cx.waker().clone());
                return Poll::Pending;
            };
            // SAFETY: a completed, not yet re-posted receive slot.
            let mem = unsafe { self.recv_mem.slot(slot) };
            let data = &mem[FRAME_HEADER_LEN + used as usize..FRAME_HEADER_LEN + len as usize];
            let (n, msg) = st.decoder.feed(data, alloc);
            let used = used + n as u32;
            let consumed = used >= len;
            if consumed {
                st.filled.pop_front();
            } else if let Some(front) = st.filled.front_mut() {
                front.2 = used;
            }
            drop(st);
            if consumed {
                self.repost(slot);
                self.pump();
            }
            if let Some(msg) = msg {
                self.tx.marks().payload_finished();
                self.tx.marks().frame_received();
                return Poll::Ready(msg.map(Received::Message).map_err(TransportError::from));
            }
        }
    }

    /// See [`crate::transport::Conn::set_never_wait_for_memory`].
    pub fn set_never_wait_for_memory(&self, on: bool) {
        self.never_wait.set(on);
    }

    /// See [`crate::transport::Conn::send_queued_bytes`].
    pub fn send_queued_bytes(&self) -> usize {
        self.tx.queued_bytes()
    }

    /// See [`crate::transport::Conn::wait_sent_below`].
    pub async fn wait_sent_below(&self, bytes_max: usize) {
        self.tx.wait_below(bytes_max.max(1)).await
    }

    /// See [`crate::transport::Conn::stall`].
    pub fn stall(&self) -> (crate::transport::Stall, u64) {
        self.tx.marks().current()
    }

    /// See [`crate::transport::Conn::close`]: the queue pair goes to the error
    /// state (outstanding work requests complete as flushed), receivers and
    /// one-sided waiters wake with an error, the lifeline closes.
    pub fn close(&self) {
        // Drops what is queued.
        if !self.tx.close() {
            return;
        }
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Error);
        if let Err(e) = self.qp.borrow_mut().modify(&attr) {
            tracing::warn!(peer = %self.peer, "cannot move the RDMA queue pair to error: {e}");
        }
        let _ = self.lifeline.shutdown(std::net::Shutdown::Both);
        let mut st = self.state.borrow_mut();
        if let Some(w) = st.recv_waker.take() {
            w.wake();
        }
        for (_, op) in st.ops.iter_mut() {
            if let Some(w) = op.waker.take() {
                w.wake();
            }
        }
        for w in st.op_waiters.drain(..) {
            w.wake();
        }
    }

    /// See [`crate::transport::Conn::close_after_send`].
    pub fn close_after_send(&self) {
        self.tx.close_after_send();
        self.maybe_finish_closing();
    }

    /// See [`crate::transport::Conn::is_closed`].
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// The peer's (bootstrap) address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    /// One-sided operations are done by the NIC, without the peer's CPU.
    pub fn one_sided_native(&self) -> bool {
        true
    }

    /// Registers `buf` for remote READ by the peer until the grant is dropped.
    /// The registration covers exactly `buf`, so the NIC refuses any access
    /// outside it; its key is the registration's rkey (chosen by the NIC).
    pub fn grant_read(self: &Rc<Self>, buf: &PayloadBuf) -> Result<Grant, TransportError> {
        let len = self.check_grant(buf.len())?;
        let s = buf.as_slice();
        // SAFETY: the grant table keeps a reference to `buf`'s memory until the
        // region is deregistered (field order in GrantEntry).
        let mr = unsafe {
            self.dev
                .pd
                .reg_mr(s.as_ptr() as usize, s.len(), AccessFlags::RemoteRead)
        }
        .map_err(|e| TransportError::Grant(format!("registering a granted buffer: {e}")))?;
        let remote = RemoteBuf {
            addr: s.as_ptr() as u64,
            len,
            key: mr.rkey(),
        };
        self.add_grant(remote, mr, GrantedMem::Read { _buf: buf.clone() })?;
        Ok(Grant::new(remote, self.clone()))
    }

    /// Registers `buf` for remote WRITE by the peer until
    /// [`WriteGrant::finish`]; the peer's NIC writes into `buf` in place.
    pub fn grant_write(self: &Rc<Self>, buf: PayloadBufMut) -> Result<WriteGrant, TransportError> {
        let len = self.check_grant(buf.len())?;
        let buf = Rc::new(RefCell::new(buf));
        let (addr, bytes) = {
            let mut b = buf.borrow_mut();
            let s = b.as_mut_slice();
            (s.as_mut_ptr() as u64, s.len())
        };
        // SAFETY: the grant table keeps the buffer (shared with the WriteGrant)
        // until the region is deregistered; its heap memory does not move.
        let mr = unsafe {
            self.dev.pd.reg_mr(
                addr as usize,
                bytes,
                AccessFlags::LocalWrite | AccessFlags::RemoteWrite,
            )
        }
        .map_err(|e| TransportError::Grant(format!("registering a granted buffer: {e}")))?;
        let remote = RemoteBuf {
            addr,
            len,
            key: mr.rkey(),
        };
        self.add_grant(remote, mr, GrantedMem::Write { _buf: buf.clone() })?;
        Ok(WriteGrant::new(remote, self.clone(), buf))
    }

    /// Registers a fresh zeroed buffer of `len` bytes for remote READ by the peer
    /// while this side keeps writing it ([`SharedArea::write_at`]): the reply area
    /// of remote fetching. The peer's NIC reads it without this side's CPU; a read
    /// racing with a write may see a mix, which Flame's replies let the reader
    /// detect (id and checksums).
    pub fn grant_area(self: &Rc<Self>, len: usize) -> Result<SharedArea, TransportError> {
        let len32 = self.check_grant(len)?;
        let buf = Rc::new(RefCell::new(PayloadBufMut::zeroed(len)));
        let addr = buf.borrow_mut().as_mut_slice().as_mut_ptr() as u64;
        // SAFETY: the grant table keeps the buffer until the region is
        // deregistered; its memory does not move.
        let mr = unsafe {
            self.dev
                .pd
                .reg_mr(addr as usize, len, AccessFlags::RemoteRead)
        }
        .map_err(|e| TransportError::Grant(format!("registering a reply area: {e}")))?;
        let remote = RemoteBuf {
            addr,
            len: len32,
            key: mr.rkey(),
        };
        self.add_grant(remote, mr, GrantedMem::Write { _buf: buf.clone() })?;
        Ok(SharedArea::new(remote, self.clone(), buffer_writer(buf)))
    }

    fn check_grant(&self, len: usize) -> Result<u32, TransportError> {
        if self.tx.is_closed() {
            return Err(self.closed_error());
        }
        let len = check_grant_len(len)?;
        if self.grants.borrow().len() >= GRANTS_PER_CONN_MAX {
            return Err(TransportError::Grant(format!(
                "{GRANTS_PER_CONN_MAX} grants are live on this connection: release some first"
            )));
        }
        Ok(len)
    }

    fn add_grant(
        &self,
        remote: RemoteBuf,
        mr: MemoryRegion<'static>,
        mem: GrantedMem,
    ) -> Result<(), TransportError> {
        let mut grants = self.grants.borrow_mut();
        if grants.contains_key(&remote.key) {
            // The NIC gave a live key twice: impossible, refuse rather than mix up.
            return Err(TransportError::Grant("RDMA key already in use".into()));
        }
        grants.insert(remote.key, GrantEntry { _mr: mr, _mem: mem });
        Ok(())
    }

    /// Waits for a one-sided operation slot (at most [`ONE_SIDED_MAX`] in flight).
    async fn op_slot(&self) -> Result<usize, TransportError> {
        std::future::poll_fn(|cx| {
            if self.tx.is_closed() {
                return Poll::Ready(Err(self.closed_error()));
            }
            let mut st = self.state.borrow_mut();
            if st.ops.len() < ONE_SIDED_MAX as usize {
                let key = st.ops.insert(OneSidedOp {
                    status: None,
                    waker: None,
                    keep: None,
                    orphaned: false,
                });
                return Poll::Ready(Ok(key));
            }
            st.op_waiters.push_back(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Posts `wr` (its local memory registered and owned by `keep`) and waits for
    /// it. Returns the kept memory.
    async fn one_sided(
        &self,
        wr: OneSidedWr,
        keep: OneSidedKeep,
    ) -> Result<OneSidedKeep, TransportError> {
        let OneSidedWr {
            read,
            addr,
            len,
            lkey,
            remote_addr,
            rkey,
        } = wr;
        let key = self.op_slot().await?;
        self.state.borrow_mut().ops[key].keep = Some(keep);
        let id = WrId {
            conn: self.id,
            kind: WrKind::OneSided,
            index: key as u32,
        };
        let posted = {
            let mut qp = self.qp.borrow_mut();
            let mut guard = qp.start_post_send();
            let wr = guard.construct_wr(id.encode(), WorkRequestFlags::Signaled);
            let local = if read {
                wr.setup_read(rkey, remote_addr)
            } else {
                wr.setup_write(rkey, remote_addr)
            };
            // SAFETY: the memory is registered (`lkey`) and parked in the
            // operation's slot until its completion arrives.
            unsafe { local.setup_sge(lkey, addr, len) };
            guard.post()
        };
        if let Err(e) = posted {
            // Never posted: the memory can go back at once.
            self.state.borrow_mut().ops.remove(key);
            self.fail(format!("posting an RDMA one-sided operation: {e}"));
            return Err(self.closed_error());
        }
        let mut guard = OrphanOnDrop {
            conn: self,
            key: Some(key),
        };
        let status = std::future::poll_fn(|cx| {
            let mut st = self.state.borrow_mut();
            let op = &mut st.ops[key];
            if let Some(c) = op.status {
                return Poll::Ready(Ok(c));
            }
            if self.tx.is_closed() {
                // Flushed completions still arrive; the memory stays parked.
                return Poll::Ready(Err(()));
            }
            op.waker = Some(cx.waker().clone());
            Poll::Pending
        })
        .await;
        let c = match status {
            Ok(c) => c,
            // `guard` parks the memory until the flushed completion arrives.
            Err(()) => return Err(self.closed_error()),
        };
        guard.key = None;
        let op = self.state.borrow_mut().ops.remove(key);
        if let Some(w) = self.state.borrow_mut().op_waiters.pop_front() {
            w.wake();
        }
        match c.status {
            ibv_wc_status::IBV_WC_SUCCESS => {}
            // The peer's NIC refused: unknown or revoked key, access kind not
            // granted, or outside the registration.
            ibv_wc_status::IBV_WC_REM_ACCESS_ERR | ibv_wc_status::IBV_WC_REM_INV_REQ_ERR => {
                return Err(TransportError::Refused(
                    "refused by the peer's RDMA device (unknown or revoked key, access not \
                     granted, or outside the grant)",
                ));
            }
            _ => return Err(self.closed_error()),
        }
        op.keep
            .ok_or_else(|| err("one-sided operation lost its memory"))
    }

    /// One-sided READ of the peer's granted buffer `remote` into a new buffer.
    pub async fn read_remote(&self, remote: RemoteBuf) -> Result<PayloadBufMut, TransportError> {
        if self.tx.is_closed() {
            return Err(self.closed_error());
        }
        if remote.len == 0 || remote.len > PAYLOAD_BYTES_MAX {
            self.fail(format!("one-sided READ of {} bytes refused", remote.len));
            return Err(TransportError::Refused(Refusal::OutOfBounds.as_str()));
        }
        let mut buf = PayloadBufMut::for_overwrite(remote.len as usize);
        let s = buf.as_mut_slice();
        let (addr, len) = (s.as_mut_ptr() as u64, s.len());
        // `buf` is kept (parked) with the registration until the READ completes.
        let (lkey, mr) = local_key(self.dev, addr, len, "READ target")?;
        let keep = OneSidedKeep::Read { _mr: mr, buf };
        let wr = OneSidedWr {
            read: true,
            addr,
            len: remote.len,
            lkey,
            remote_addr: remote.addr,
            rkey: remote.key,
        };
        match self.one_sided(wr, keep).await? {
            OneSidedKeep::Read { _mr, buf } => {
                drop(_mr);
                Ok(buf)
            }
            OneSidedKeep::Write { .. } => Err(err("one-sided READ returned WRITE memory")),
        }
    }

    /// One-sided WRITE of `data` at the peer's address `addr` under grant `key`
    /// ([`crate::transport::Conn::write_remote`] has checked the range against the
    /// descriptor; the NIC checks it against the registration).
    pub async fn write_remote(
        &self,
        key: u32,
        addr: u64,
        data: &PayloadBuf,
    ) -> Result<(), TransportError> {
        if self.tx.is_closed() {
            return Err(self.closed_error());
        }
        if data.is_empty() || data.len() > PAYLOAD_BYTES_MAX as usize {
            self.fail(format!("one-sided WRITE of {} bytes refused", data.len()));
            return Err(TransportError::Refused(Refusal::OutOfBounds.as_str()));
        }
        let s = data.as_slice();
        // A clone of `data` is kept (parked) with the registration until the WRITE
        // completes.
        let (lkey, mr) = local_key(self.dev, s.as_ptr() as u64, s.len(), "WRITE source")?;
        let keep = OneSidedKeep::Write {
            _mr: mr,
            _buf: data.clone(),
        };
        let wr = OneSidedWr {
            read: false,
            addr: s.as_ptr() as u64,
            len: s.len() as u32,
            lkey,
            remote_addr: addr,
            rkey: key,
        };
        self.one_sided(wr, keep).await.map(|_| ())
    }
}

/// Marks a one-sided operation orphaned if its future is dropped before its
/// completion: the memory stays parked in the connection until the NIC is done.
struct OrphanOnDrop<'a> {
    conn: &'a RdmaConn,
    key: Option<usize>,
}

impl Drop for OrphanOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            let mut st = self.conn.state.borrow_mut();
            let done = match st.ops.get_mut(key) {
                Some(op) if op.status.is_some() => true,
                Some(op) => {
                    op.orphaned = true;
                    op.waker = None;
                    false
                }
                None => false,
            };
            if done {
                st.ops.remove(key);
                if let Some(w) = st.op_waiters.pop_front() {
                    w.wake();
                }
            }
        }
    }
}

/// Watches the bootstrap connection: its end (the peer process died or closed)
/// fails the RDMA connection.
async fn lifeline(conn: Weak<RdmaConn>) {
    let Some(fd) = conn.upgrade().map(|c| c.lifeline.as_raw_fd()) else {
        return;
    };
    let (res, _) = reactor::recv(fd, vec![0u8; 16], 0).await;
    if let Some(c) = conn.upgrade() {
        let why = match res {
            // The peer closed (or its process died): the connection ends as a tcp
            // one whose peer closed does, with `TransportError::Closed` from every
            // later call. Not a failure of ours: a peer that refused a one-sided
            // access closes too, and its close may arrive here before the
            // refusal's completion does.
            Ok(0) => {
                tracing::debug!(peer = %c.peer, "RDMA peer closed its bootstrap connection");
                c.close();
                return;
            }
            Ok(_) => "peer sent bytes on its RDMA bootstrap connection".to_string(),
            Err(e) => format!("RDMA bootstrap connection failed: {e}"),
        };
        c.fail(why);
    }
}

/// Memory a grant lets the peer reach.
/// (Held only to keep the memory alive while registered.)
enum GrantedMem {
    Read { _buf: PayloadBuf },
    Write { _buf: Rc<RefCell<PayloadBufMut>> },
}

/// A live grant: the registration (declared first: deregistered before the
/// memory reference is released) and the memory.
struct GrantEntry {
    _mr: MemoryRegion<'static>,
    _mem: GrantedMem,
}

impl GrantOwner for RdmaConn {
    /// Deregisters the grant: from here on the NIC refuses the peer's accesses
    /// under its key. A write grant's bytes are already in place (the peer's NIC
    /// wrote into the buffer itself), so there is nothing to copy into `into`.
    fn revoke(&self, key: u32, _into: Option<&mut PayloadBufMut>) {
        self.grants.borrow_mut().remove(&key);
    }
}

/// Accepts RDMA connections (a TCP listener for the bootstrap) and, on the same
/// port, plain TCP connections: a client without an RDMA device (flame-admin
/// deleting a volume's objects, a host whose NIC has no RDMA) still reaches an
/// OSD on `transport: rdma`, as Vitastor's OSDs serve TCP beside RDMA. The
/// first four bytes a peer sends tell the two apart: an RDMA bootstrap starts
/// with [`CONN_INFO_MAGIC`], a Flame TCP connection with the wire protocol's
/// [`MAGIC`](crate::protocol::MAGIC) (its HELLO). Both are authenticated the same
/// way afterwards, at HELLO.
///
/// Each accepted connection is brought up by its own task
/// ([`crate::transport::bring_up`]), within [`HANDSHAKE_TIMEOUT_MS`] in all, at
/// most [`BRING_UPS_MAX`] at once and [`BRING_UPS_PER_SOURCE_MAX`] per source
/// address, so a peer that connects and sends nothing holds one of those for
/// 5 s, not the listener. An RDMA bring-up holds a queue pair and 1 MiB of
/// pinned slots before the peer has authenticated (at HELLO, after it): at most
/// 64 MiB per listener.
///
/// One task accepts on a listener (a shard's accept loop); it must be dropped
/// on that task's thread, where its bring-ups live (dropped elsewhere, they
/// stay until that thread ends). Bring-ups running when it is dropped finish
/// (within their 5 s) and close.
pub struct RdmaListener {
    /// Non-blocking: waited on with `poll_readable`, which a dropped `accept`
    /// cancels without losing a connection.
    inner: std::net::TcpListener,
    /// Names this listener's [`BringUps`](crate::transport::bring_up::BringUps) on the accepting thread. The listener
    /// is bound on one thread and moved to the one that accepts (a shard's), so
    /// it holds nothing tied to a thread itself.
    id: u64,
}

pub use crate::transport::bring_up::{BRING_UPS_MAX, BRING_UPS_PER_SOURCE_MAX};

/// What a connection's first four bytes say it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FirstBytes {
    /// An RDMA bootstrap.
    RdmaBootstrap,
    /// A Flame frame over TCP.
    Tcp,
    /// Neither: refused at once, without holding a bring-up slot for a
    /// bootstrap that will not come.
    Unknown(u32),
}

impl FirstBytes {
    fn of(first: [u8; 4]) -> FirstBytes {
        match u32::from_le_bytes(first) {
            crate::protocol::MAGIC => FirstBytes::Tcp,
            CONN_INFO_MAGIC => FirstBytes::RdmaBootstrap,
            other => FirstBytes::Unknown(other),
        }
    }
}

/// Waits (bounded by [`HANDSHAKE_TIMEOUT_MS`]) until `fd` holds four bytes and
/// returns them without consuming them (`MSG_PEEK`), so either path then reads
/// the stream from its first byte.
async fn peek_first_bytes(fd: RawFd) -> Result<[u8; 4], TransportError> {
    with_timeout(HANDSHAKE_TIMEOUT_MS, "first bytes of a connection", async {
        let mut first = [0u8; 4];
        // Bounded by the timeout around it; each round waits for readability
        // (or a short sleep when fewer than four bytes have arrived: the peer's
        // first write is a whole header or bootstrap, so that is rare).
        loop {
            // SAFETY: `first` is a live 4-byte buffer; MSG_DONTWAIT never blocks.
            let n = unsafe {
                libc::recv(
                    fd,
                    first.as_mut_ptr().cast(),
                    first.len(),
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            if n == 4 {
                return Ok(first);
            }
            if n == 0 {
                return Err(TransportError::Closed);
            }
            if n > 0 {
                reactor::sleep(Duration::from_millis(5)).await;
                continue;
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => {
                    reactor::poll_readable(fd).await?;
                }
                io::ErrorKind::Interrupted => {}
                _ => return Err(e.into()),
            }
        }
    })
    .await
}

/// What an accepted connection is (its first bytes), brought up as that.
async fn bring_up_accepted(stream: TcpStream) -> Result<crate::transport::Conn, TransportError> {
    match FirstBytes::of(peek_first_bytes(stream.as_raw_fd()).await?) {
        FirstBytes::Tcp => Ok(crate::transport::Conn::Tcp(
            crate::transport::tcp::TcpConn::from_stream(stream)?,
        )),
        FirstBytes::RdmaBootstrap => RdmaConn::establish(stream, false)
            .await
            .map(crate::transport::Conn::Rdma),
        FirstBytes::Unknown(magic) => Err(err(format!(
            "first bytes {magic:#010x} are neither an RDMA bootstrap nor a Flame frame: \
             not a Flame endpoint"
        ))),
    }
}

impl RdmaListener {
    /// Opens the device (failing with its message when there is none) and binds
    /// the bootstrap address.
    pub fn bind(addr: SocketAddr) -> Result<RdmaListener, TransportError> {
        device().map_err(TransportError::Unavailable)?;
        let inner = crate::transport::bind_retrying(|| std::net::TcpListener::bind(addr))?;
        inner.set_nonblocking(true)?;
        Ok(RdmaListener {
            inner,
            id: crate::transport::bring_up::listener_id(),
        })
    }

    /// The next connection brought up, RDMA or TCP (see the type's
    /// documentation); a peer whose bring-up fails (not a Flame endpoint,
    /// timeout) is logged and skipped.
    pub async fn accept(&self) -> Result<crate::transport::Conn, TransportError> {
        use crate::transport::bring_up::{Arrival, BringUps, Source};
        let ups = BringUps::of(self.id);
        let deadline = Duration::from_millis(HANDSHAKE_TIMEOUT_MS);
        ups.accept(&[self.inner.as_raw_fd()], deadline, || {
            // Bounded: one accept per call, retried only when interrupted.
            loop {
                return match self.inner.accept() {
                    // (Blocking: an accepted socket does not inherit the
                    // listener's O_NONBLOCK on Linux; the peek uses MSG_DONTWAIT
                    // and everything after it io_uring.)
                    Ok((stream, from)) => Ok(Some(Arrival::BringUp {
                        source: Source::Ip(from.ip()),
                        peer: from.to_string(),
                        task: Box::pin(bring_up_accepted(stream)),
                    })),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => Err(e.into()),
                };
            }
        })
        .await
    }

    /// The bound bootstrap address.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)))
    }
}

impl Drop for RdmaListener {
    /// Forgets the bring-ups on this thread: connections brought up and not
    /// accepted close, running bring-ups finish into nothing.
    fn drop(&mut self) {
        crate::transport::bring_up::BringUps::forget(self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_bytes_tell_rdma_from_tcp() {
        let tcp = crate::protocol::MAGIC.to_le_bytes();
        let rdma = CONN_INFO_MAGIC.to_le_bytes();
        assert_eq!(FirstBytes::of(tcp), FirstBytes::Tcp);
        assert_eq!(FirstBytes::of(rdma), FirstBytes::RdmaBootstrap);
        assert_eq!(
            FirstBytes::of(*b"GET "),
            FirstBytes::Unknown(u32::from_le_bytes(*b"GET "))
        );
    }
}
