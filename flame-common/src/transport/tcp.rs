//! TCP transport on the reactor.
//!
//! Sending: `send` appends the header to a batch buffer and queues the
//! payload as a reference to its [`PayloadBuf`] — never a copy, whatever its size;
//! a writer task per connection drains everything queued with one `writev` per
//! round. Replies queued by many requests during one reactor tick therefore leave in
//! one system call, and a write forwarded to two replicas is the same memory in both
//! send queues.
//!
//! Receiving: one buffer per connection takes whatever the socket has; headers are
//! cut out of it. Each payload goes into its own 4 KiB-aligned [`PayloadBufMut`] of
//! exactly `payload_len` bytes (bounded by the header's decode before allocation):
//! the part already in the connection's buffer is copied (a small payload arrives
//! whole with its header: one memcpy costs less than a system call), the rest is
//! received straight into it. After a large payload the next header is received
//! alone, so a stream of large writes lands in its payload buffers without a copy.

use super::TransportError;
use super::bring_up::Source;
use super::grant::{
    Grant, GrantOwner, GrantTable, GrantedBuf, SharedArea, WriteGrant, check_grant_len,
};
use super::receive::{Abandoned, Ending, Receiver};
use super::receive_share;
use super::stream_send::{PushRefused, StreamSend, WriterEnd};
use crate::buffer::{PayloadBuf, PayloadBufMut};
use crate::collections::HashMap;
use crate::protocol::{
    HEADER_LEN, HEADER_PREFIX_LEN, Header, Message, OpCode, ProtocolError, RemoteBuf, status,
};
use crate::reactor;
use std::cell::Cell;
use std::cell::RefCell as StdRefCell;

use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::Duration;

/// After a payload of at least this size, the next header is received alone (one
/// more system call), so the payload after it is received straight into its buffer
/// instead of being copied out of the connection's buffer.
const DIRECT_RECV_PAYLOAD_BYTES_MIN: usize = 64 << 10;
/// Receive buffer size: many small messages per system call.
const RECV_BUFFER_BYTES: usize = 256 << 10;
/// Bound on bytes queued for sending on one connection. Reached only if the peer
/// stops reading while we keep producing; the connection is then failed rather than
/// growing memory without limit.
pub const SEND_QUEUE_BYTES_MAX: usize = 256 << 20;

struct RecvState {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Receive only up to the end of the next header (see
    /// [`DIRECT_RECV_PAYLOAD_BYTES_MIN`]).
    header_only: bool,
}

/// One TCP connection owned by the current reactor thread.
pub struct TcpConn {
    stream: TcpStream,
    peer: SocketAddr,
    /// The send queue, its writer's state, the closed flags and the stall marks
    /// ([`super::stream_send`], shared with flame-nbd's connections).
    tx: StreamSend,
    /// The receive buffer, taken by the one receive running
    /// ([`super::receive`]: drop-safe, one error policy).
    rx: Receiver<RecvState>,
    /// Buffers this side granted to the peer; the receiving task serves the peer's
    /// one-sided requests from it.
    grants: Rc<GrantTable>,
    /// One-sided operations this side started, by frame id, until their reply.
    pending: StdRefCell<HashMap<u64, PendingOp>>,
    /// Id of the next one-sided operation (its own id space: frames are told apart
    /// from messages by opcode).
    next_op: Cell<u64>,
    /// Receive payloads into heap memory when the pool is exhausted instead of
    /// waiting (see [`super::Conn::set_never_wait_for_memory`]).
    never_wait: Cell<bool>,
}

/// TCP keepalive: first probe after this much silence, then every
/// [`KEEPALIVE_INTERVAL`], [`KEEPALIVE_PROBES`] times. With
/// [`TCP_USER_TIMEOUT`], a half-open peer (a host that died, a cable pulled) is
/// found within a minute instead of the kernel's two hours, and its slot freed.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_PROBES: u32 = 3;
/// How long sent data may stay unacknowledged before the kernel fails the
/// connection (`TCP_USER_TIMEOUT`).
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(30);

/// A one-sided operation waiting for the peer's reply.
struct PendingOp {
    /// `Some(len)` for a READ of `len` bytes, `None` for a WRITE.
    read_len: Option<u32>,
    waker: Option<Waker>,
    done: Option<Result<PayloadBufMut, TransportError>>,
}

/// Most one-sided operations in flight on one connection (each holds a pending
/// entry until its reply): a bound, not a tuning knob.
pub const ONE_SIDED_INFLIGHT_MAX: usize = 4096;

/// A frame received by the connection: a message for the caller, or a one-sided
/// request or reply the transport handles itself.
enum Frame {
    Message(Message),
    Internal(Header, PayloadBufMut),
}

impl GrantOwner for GrantTable {
    fn revoke(&self, key: u32, _into: Option<&mut PayloadBufMut>) {
        // The write grant's buffer is written in place; removing the table's
        // reference is all there is to do.
        self.remove(key);
    }
}

/// Keepalive probes and `TCP_USER_TIMEOUT` on `stream`, so that a half-open
/// peer (its host died, its link went) is noticed within about a minute
/// instead of holding its connection slot and memory for good. Every
/// long-lived TCP connection takes it: the OSD protocol's here, flame-nbd's NBD
/// connections.
pub fn set_liveness(stream: &TcpStream) -> io::Result<()> {
    let sock = socket2::SockRef::from(stream);
    sock.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(KEEPALIVE_IDLE)
            .with_interval(KEEPALIVE_INTERVAL)
            .with_retries(KEEPALIVE_PROBES),
    )?;
    sock.set_tcp_user_timeout(Some(TCP_USER_TIMEOUT))
}

impl TcpConn {
    /// Wraps an accepted or connected stream (blocking mode; every operation goes
    /// through the ring).
    pub fn from_stream(stream: TcpStream) -> io::Result<Rc<TcpConn>> {
        TcpConn::new(stream)
    }

    fn new(stream: TcpStream) -> io::Result<Rc<TcpConn>> {
        receive_share::register_metrics();
        stream.set_nodelay(true)?;
        set_liveness(&stream)?;
        // A peer that reset right after connecting has no address any more; that is
        // its problem (its first read fails), not a reason to fail the accept loop.
        let peer = stream
            .peer_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
        let conn = Rc::new(TcpConn {
            stream,
            peer,
            tx: StreamSend::new(SEND_QUEUE_BYTES_MAX),
            // Every wait of a receive holds a socket receive in flight or
            // follows a header whose payload is unread: abandoned, it closes.
            rx: Receiver::new(
                RecvState {
                    buf: vec![0u8; RECV_BUFFER_BYTES],
                    start: 0,
                    end: 0,
                    header_only: false,
                },
                Abandoned::Closes,
            ),
            grants: Rc::new(GrantTable::default()),
            pending: StdRefCell::new(HashMap::default()),
            next_op: Cell::new(1),
            never_wait: Cell::new(false),
        });
        reactor::spawn(writer(conn.clone())).detach();
        Ok(conn)
    }

    /// Connects to `addr`.
    pub async fn connect(
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<Rc<TcpConn>, TransportError> {
        Self::connect_from(addr, None, timeout).await
    }

    /// Connects to `addr` from local address `source` (any port) when given, so the
    /// connection leaves from the caller's own (advertised) address rather than
    /// whichever the routing table picks.
    pub async fn connect_from(
        addr: SocketAddr,
        source: Option<IpAddr>,
        timeout: Duration,
    ) -> Result<Rc<TcpConn>, TransportError> {
        let owned = new_socket(addr, source)?;
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
        Ok(TcpConn::new(TcpStream::from(owned))?)
    }

    /// See [`super::Conn::send`]. The payload is queued by reference (a clone of
    /// its [`PayloadBuf`]), not copied.
    pub fn send(&self, msg: &Message) -> Result<(), TransportError> {
        let (header, payload) = msg.to_header();
        match msg.payload_buf() {
            Some(data) => self.enqueue(&header, &[], Some(data.clone())),
            // A HELLO's body: a few bytes, copied into the batch.
            None => self.enqueue(&header, &payload, None),
        }
    }

    /// Queues a message, moving its payload buffer into the send queue.
    pub fn send_owned(&self, msg: Message) -> Result<(), TransportError> {
        let (header, payload) = msg.to_header();
        if msg.payload_buf().is_none() {
            return self.enqueue(&header, &payload, None);
        }
        drop(payload);
        let data = match msg {
            Message::Write { data, .. } | Message::Reply { data, .. } => Some(data),
            // Only writes and replies carry payloads.
            _ => None,
        };
        self.enqueue(&header, &[], data)
    }

    /// Queues bytes that are not a v2 message: the refusal of a peer speaking
    /// another protocol version, in that version's format
    /// ([`crate::protocol::version_refusal`]).
    pub fn send_raw(&self, bytes: Vec<u8>) -> Result<(), TransportError> {
        let pushed = self.tx.push_owned(bytes);
        self.pushed(pushed)
    }

    /// Appends the header (and `inline` bytes: a HELLO's body) to the batch buffer
    /// and the payload (by reference) after it, in order after everything queued
    /// before.
    fn enqueue(
        &self,
        header: &Header,
        inline: &[u8],
        payload: Option<PayloadBuf>,
    ) -> Result<(), TransportError> {
        let payload = payload.filter(|p| !p.is_empty());
        let payload_bytes = payload.as_ref().map_or(0, PayloadBuf::len);
        debug_assert_eq!(header.payload_len as usize, inline.len() + payload_bytes);
        let pushed = self
            .tx
            .push_parts(&[&header.encode(), inline], payload, payload_bytes);
        self.pushed(pushed)
    }

    /// A push's outcome as the transport's: a queue past its bound closes the
    /// connection (its peer does not read).
    fn pushed(&self, pushed: Result<(), PushRefused>) -> Result<(), TransportError> {
        match pushed {
            Ok(()) => Ok(()),
            Err(PushRefused::Closed) => Err(TransportError::Closed),
            Err(PushRefused::Backlog(max)) => {
                self.close();
                Err(TransportError::Backlog(max))
            }
        }
    }

    /// See [`super::Conn::recv`].
    pub async fn recv(&self) -> Result<Message, TransportError> {
        let close = || self.close();
        let mut turn = self.rx.begin(&close)?;
        let result = loop {
            match self.recv_inner(&mut turn).await {
                Ok(Frame::Message(m)) => break Ok(m),
                Ok(Frame::Internal(h, payload)) => {
                    if let Err(e) = self.serve_internal(&h, payload) {
                        break Err(e);
                    }
                }
                Err(e) => break Err(e),
            }
        };
        // A peer of another protocol version, or a refused one-sided access:
        // close once what is queued has been sent, so the caller can still
        // queue a refusal in the peer's format
        // ([`crate::protocol::version_refusal`]), and the access refusal
        // reaches the peer.
        match turn.end(&result) {
            Ending::Open => {}
            Ending::CloseAfterSend => self.close_after_send(),
            Ending::Close => self.close(),
        }
        result
    }

    async fn recv_inner(&self, st: &mut RecvState) -> Result<Frame, TransportError> {
        // First: a receive abandoned half-way closed the connection, and may
        // have left the state without its buffer (an in-flight receive owned
        // it), so nothing below may read it then.
        if self.tx.is_closed() {
            return Err(TransportError::Closed);
        }
        let fd = self.stream.as_raw_fd();
        // Header: first the prefix every protocol version shares, so a peer of
        // another version (whose header may be shorter) is recognised from what it
        // sent instead of waiting for bytes it will never send.
        while st.end - st.start < HEADER_PREFIX_LEN {
            self.fill(fd, st).await?;
        }
        let mut prefix = [0u8; HEADER_PREFIX_LEN];
        prefix.copy_from_slice(&st.buf[st.start..st.start + HEADER_PREFIX_LEN]);
        Header::check_prefix(&prefix)?;
        while st.end - st.start < HEADER_LEN {
            self.fill(fd, st).await?;
        }
        let mut hb = [0u8; HEADER_LEN];
        hb.copy_from_slice(&st.buf[st.start..st.start + HEADER_LEN]);
        let header = Header::decode(&hb)?;
        st.start += HEADER_LEN;

        self.tx.marks().frame_received();
        st.header_only = false;
        // Payload: bounded by Header::decode before this allocation.
        let len = header.payload_len as usize;
        let have = (st.end - st.start).min(len);
        // A payload still to come holds part of its source's share of the pool
        // until it is whole, so trickling peers cannot take the whole pool
        // ([`super::receive_share`]); waiting for it, or for pool memory, does
        // not read the socket (back-pressure), and past the pool's wait bound
        // fails, which closes the connection.
        if have < len {
            // The slow path: the watchdog of the connection's owner sees it,
            // from here (a wait for the source's share counts).
            self.tx.marks().payload_started();
        }
        let share = if have < len && !self.never_wait.get() {
            Some(receive_share::take(Source::Ip(self.peer.ip()), len as u64).await?)
        } else {
            None
        };
        let mut payload = if self.never_wait.get() {
            PayloadBufMut::for_overwrite(len)
        } else {
            PayloadBufMut::for_overwrite_wait(len)
                .await
                .map_err(io::Error::from)?
        };
        payload.as_mut_slice()[..have].copy_from_slice(&st.buf[st.start..st.start + have]);
        st.start += have;
        let mut filled = have;
        // Bounded: every round receives at least one byte or returns.
        while filled < len {
            if self.tx.is_closed() {
                return Err(TransportError::Closed);
            }
            let (res, back) = reactor::recv(fd, payload, filled).await;
            payload = back;
            match res {
                Ok(0) => return Err(TransportError::Closed),
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        self.tx.marks().payload_finished();
        drop(share);
        if len >= DIRECT_RECV_PAYLOAD_BYTES_MIN {
            st.header_only = true;
        }
        if header.op().is_transport_internal() {
            let actual = crc32c::crc32c(payload.as_slice());
            if actual != header.payload_crc {
                return Err(ProtocolError::BadPayloadChecksum {
                    expected: header.payload_crc,
                    actual,
                }
                .into());
            }
            return Ok(Frame::Internal(header, payload));
        }
        let payload = payload.freeze();
        Ok(Frame::Message(Message::from_parts(&header, payload)?))
    }

    /// Handles a one-sided frame: serves the peer's READ or WRITE of a granted
    /// buffer, or completes one of ours. A refused access queues a refusal reply
    /// and fails with [`TransportError::Refused`] (the connection then closes).
    fn serve_internal(&self, h: &Header, payload: PayloadBufMut) -> Result<(), TransportError> {
        let bad = |what| Err(TransportError::Protocol(ProtocolError::Inconsistent(what)));
        if h.flags != 0 {
            return bad("a one-sided frame with flags");
        }
        if h.is_reply() {
            let mut pending = self.pending.borrow_mut();
            // A reply to an operation that was given up on (its future dropped):
            // nothing waits for it any more.
            let Some(op) = pending.get_mut(&h.request_id) else {
                return Ok(());
            };
            let result = if h.status == status::EACCES {
                Err(TransportError::Refused("the peer refused the access"))
            } else if h.status != status::OK {
                Err(TransportError::Protocol(ProtocolError::Inconsistent(
                    "a one-sided reply with an unknown status",
                )))
            } else {
                match op.read_len {
                    Some(n) if n as usize == payload.len() => Ok(payload),
                    None if payload.is_empty() => Ok(payload),
                    _ => Err(TransportError::Protocol(ProtocolError::Inconsistent(
                        "a one-sided reply of the wrong length",
                    ))),
                }
            };
            let failed = result.is_err();
            op.done = Some(result);
            if let Some(w) = op.waker.take() {
                w.wake();
            }
            drop(pending);
            if failed {
                // The waiting task reports the reason; the connection is done.
                self.close_after_send();
            }
            return Ok(());
        }
        let reply = |payload: Option<PayloadBuf>, st: i32| {
            let payload_len = payload.as_ref().map_or(0, |p| p.len() as u32);
            let header = Header {
                opcode: h.opcode | 0x80,
                request_id: h.request_id,
                status: st,
                payload_len,
                payload_crc: payload.as_ref().map_or(0, PayloadBuf::crc32c),
                ..Header::default()
            };
            self.enqueue(&header, &[], payload)
        };
        let served = match h.op() {
            OpCode::RemoteRead => {
                if !payload.is_empty() {
                    return bad("a one-sided READ request with a payload");
                }
                self.grants
                    .read(h.remote_key, h.remote_addr, u64::from(h.remote_len))
                    .map(Some)
            }
            _ => {
                if payload.len() != h.remote_len as usize {
                    return bad("a one-sided WRITE whose payload is not its length");
                }
                self.grants
                    .write(h.remote_key, h.remote_addr, payload.as_slice())
                    .map(|()| None)
            }
        };
        match served {
            Ok(data) => reply(data, status::OK),
            Err(refusal) => {
                tracing::warn!(peer = %self.peer, reason = refusal.as_str(), "one-sided access refused; closing the connection");
                let _ = reply(None, status::EACCES);
                Err(TransportError::Refused(refusal.as_str()))
            }
        }
    }

    /// See [`super::Conn::grant_read`]: the table keeps a reference to `buf`.
    pub fn grant_read(&self, buf: &PayloadBuf) -> Result<Grant, TransportError> {
        let len = check_grant_len(buf.len())?;
        let addr = buf.as_slice().as_ptr() as u64;
        let remote = self
            .grants
            .insert(addr, len, GrantedBuf::Read(buf.clone()))?;
        Ok(Grant::new(remote, self.grants.clone()))
    }

    /// See [`super::Conn::grant_write`]: the peer's WRITEs land in `buf` in place.
    pub fn grant_write(&self, buf: PayloadBufMut) -> Result<WriteGrant, TransportError> {
        let len = check_grant_len(buf.len())?;
        let addr = buf.as_slice().as_ptr() as u64;
        let buf = Rc::new(std::cell::RefCell::new(buf));
        let remote = self
            .grants
            .insert(addr, len, GrantedBuf::Write(buf.clone()))?;
        Ok(WriteGrant::new(remote, self.grants.clone(), buf))
    }

    /// See [`super::Conn::grant_area`]: the peer's READs copy from the area as it
    /// is at that moment.
    pub fn grant_area(&self, len: usize) -> Result<SharedArea, TransportError> {
        let len = check_grant_len(len)?;
        let buf = PayloadBufMut::zeroed(len as usize);
        let addr = buf.as_slice().as_ptr() as u64;
        let buf = Rc::new(std::cell::RefCell::new(buf));
        let remote = self
            .grants
            .insert(addr, len, GrantedBuf::Area(buf.clone()))?;
        Ok(SharedArea::new(
            remote,
            self.grants.clone(),
            super::grant::buffer_writer(buf),
        ))
    }

    /// Live grants (for tests and metrics).
    pub fn grants_live(&self) -> usize {
        self.grants.len()
    }

    /// See [`super::Conn::read_remote`]: a READ request frame; the peer's receiving
    /// task answers with the bytes.
    pub async fn read_remote(&self, remote: RemoteBuf) -> Result<PayloadBufMut, TransportError> {
        if remote.len == 0 || remote.len > crate::protocol::PAYLOAD_BYTES_MAX {
            return Err(TransportError::Grant(format!(
                "cannot read {} bytes in one operation",
                remote.len
            )));
        }
        self.one_sided(
            OpCode::RemoteRead,
            remote.key,
            remote.addr,
            remote.len,
            None,
        )
        .await
    }

    /// See [`super::Conn::write_remote`] (`addr` is checked against `remote` by
    /// the caller): a WRITE request frame carrying the bytes.
    pub async fn write_remote(
        &self,
        key: u32,
        addr: u64,
        data: &PayloadBuf,
    ) -> Result<(), TransportError> {
        let len = data.len() as u32;
        self.one_sided(OpCode::RemoteWrite, key, addr, len, Some(data.clone()))
            .await
            .map(|_| ())
    }

    async fn one_sided(
        &self,
        op: OpCode,
        key: u32,
        addr: u64,
        len: u32,
        data: Option<PayloadBuf>,
    ) -> Result<PayloadBufMut, TransportError> {
        if self.tx.is_closed() {
            return Err(TransportError::Closed);
        }
        if self.pending.borrow().len() >= ONE_SIDED_INFLIGHT_MAX {
            return Err(TransportError::Backlog(ONE_SIDED_INFLIGHT_MAX));
        }
        let id = self.next_op.get();
        self.next_op.set(id.wrapping_add(1).max(1));
        let header = Header {
            opcode: op as u8,
            request_id: id,
            remote_addr: addr,
            remote_len: len,
            remote_key: key,
            payload_len: data.as_ref().map_or(0, |d| d.len() as u32),
            payload_crc: data.as_ref().map_or(0, PayloadBuf::crc32c),
            ..Header::default()
        };
        self.pending.borrow_mut().insert(
            id,
            PendingOp {
                read_len: (op == OpCode::RemoteRead).then_some(len),
                waker: None,
                done: None,
            },
        );
        // Removes the entry however this future ends (completed, failed, dropped).
        struct Forget<'a>(&'a TcpConn, u64);
        impl Drop for Forget<'_> {
            fn drop(&mut self) {
                self.0.pending.borrow_mut().remove(&self.1);
            }
        }
        let _forget = Forget(self, id);
        self.enqueue(&header, &[], data)?;
        std::future::poll_fn(|cx| {
            let mut pending = self.pending.borrow_mut();
            let Some(op) = pending.get_mut(&id) else {
                return Poll::Ready(Err(TransportError::Closed));
            };
            if let Some(done) = op.done.take() {
                return Poll::Ready(done);
            }
            if self.tx.is_closed() {
                return Poll::Ready(Err(TransportError::Closed));
            }
            op.waker = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    async fn fill(&self, fd: i32, st: &mut RecvState) -> Result<(), TransportError> {
        if self.tx.is_closed() {
            return Err(TransportError::Closed);
        }
        if st.start == st.end {
            st.start = 0;
            st.end = 0;
        } else if st.start > 0 && st.buf.len() - st.end < HEADER_LEN {
            st.buf.copy_within(st.start..st.end, 0);
            st.end -= st.start;
            st.start = 0;
        }
        let buf = std::mem::take(&mut st.buf);
        let limit = if st.header_only {
            // Up to the end of the header: the payload after it goes to its own
            // buffer.
            (st.start + HEADER_LEN).max(st.end + 1).min(buf.len())
        } else {
            buf.len()
        };
        let (res, buf) = reactor::recv_range(fd, buf, st.end, limit).await;
        st.buf = buf;
        match res {
            Ok(0) => Err(TransportError::Closed),
            Ok(n) => {
                st.end += n;
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// See [`super::Conn::close_after_send`].
    pub fn close_after_send(&self) {
        self.tx.close_after_send();
    }

    /// See [`super::Conn::set_never_wait_for_memory`].
    pub fn set_never_wait_for_memory(&self, on: bool) {
        self.never_wait.set(on);
    }

    /// See [`super::Conn::close`].
    pub fn close(&self) {
        if !self.tx.close() {
            return;
        }
        // Wakes a pending receive (it completes with 0 or an error).
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        // One-sided operations waiting for a reply fail now.
        let wakers: Vec<Waker> = self
            .pending
            .borrow_mut()
            .values_mut()
            .filter_map(|op| op.waker.take())
            .collect();
        for w in wakers {
            w.wake();
        }
    }

    /// See [`super::Conn::send_queued_bytes`].
    pub fn send_queued_bytes(&self) -> usize {
        self.tx.queued_bytes()
    }

    /// See [`super::Conn::wait_sent_below`].
    pub async fn wait_sent_below(&self, bytes_max: usize) {
        self.tx.wait_below(bytes_max.max(1)).await
    }

    /// See [`super::Conn::stall`].
    pub fn stall(&self) -> Option<(super::Stall, u64)> {
        Some(self.tx.marks().current())
    }

    /// See [`super::Conn::is_closed`].
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }
}

/// Drains a connection's send queue until the connection closes.
async fn writer(conn: Rc<TcpConn>) {
    let fd = conn.stream.as_raw_fd();
    if conn.tx.write_until_closed(fd).await != WriterEnd::Closed {
        // Drained after close_after_send, or the peer is gone.
        conn.close();
    }
}

/// A TCP listener whose accepts go through the ring.
pub struct TcpListener {
    inner: std::net::TcpListener,
}

impl TcpListener {
    /// Binds `addr` (std sets `SO_REUSEADDR`, so a restarted daemon rebinds at once).
    pub fn bind(addr: SocketAddr) -> io::Result<TcpListener> {
        Ok(TcpListener {
            inner: std::net::TcpListener::bind(addr)?,
        })
    }

    /// Accepts one connection.
    pub async fn accept(&self) -> io::Result<Rc<TcpConn>> {
        let fd = reactor::accept(self.inner.as_raw_fd()).await?;
        TcpConn::new(TcpStream::from(fd))
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner
            .local_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)))
    }
}

/// A fresh TCP socket for a connection to `addr`, bound to `source` (port 0)
/// when given.
pub fn new_socket(addr: SocketAddr, source: Option<IpAddr>) -> io::Result<OwnedFd> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM.cloexec(),
        None,
    )?;
    if let Some(ip) = source {
        socket.bind(&SocketAddr::new(ip, 0).into()).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot bind the outgoing connection to {ip}: {e}"),
            )
        })?;
    }
    Ok(OwnedFd::from(socket))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Epoch, ObjectId, PgId, RequestId, VolumeId};
    use crate::protocol::{IoTarget, OpCode};
    use crate::reactor::{Reactor, ReactorConfig, spawn};

    #[test]
    fn liveness_sets_keepalive_and_the_user_timeout() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let s = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        set_liveness(&s).unwrap();
        let sock = socket2::SockRef::from(&s);
        assert!(sock.keepalive().unwrap());
        assert_eq!(sock.tcp_keepalive_time().unwrap(), KEEPALIVE_IDLE);
        assert_eq!(sock.tcp_user_timeout().unwrap(), Some(TCP_USER_TIMEOUT));
    }

    #[test]
    fn messages_cross_in_order_small_and_large() {
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let l = TcpListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let addr = l.local_addr();
            let server = spawn(async move {
                let c = l.accept().await.unwrap();
                let mut got = Vec::new();
                for _ in 0..100 {
                    got.push(c.recv().await.unwrap());
                }
                got
            });
            let c = TcpConn::connect(addr, Duration::from_secs(2))
                .await
                .unwrap();
            let mut sent = Vec::new();
            for i in 0..100u64 {
                let len = if i % 10 == 0 { 1 << 20 } else { 4096 };
                let m = Message::Write {
                    id: RequestId(i),
                    epoch: Epoch(1),
                    target: IoTarget {
                        pg: PgId(1),
                        object: ObjectId {
                            volume: VolumeId(1),
                            index: i,
                        },
                        offset: 0,
                        length: len as u32,
                    },
                    flags: 0,
                    seq: crate::ids::PgSeq(0),
                    op: crate::ids::OpId::NONE,
                    remote: None,
                    data: PayloadBuf::copy_from(&vec![i as u8; len]),
                };
                if i % 2 == 0 {
                    c.send(&m).unwrap()
                } else {
                    c.send_owned(m.clone()).unwrap()
                }
                sent.push(m);
            }
            let got = server.await;
            assert_eq!(got, sent);
            // Every payload was received into its own aligned buffer, so the OSD
            // can write it with O_DIRECT from there.
            for m in &got {
                let data = m.payload_buf().unwrap();
                assert!(data.is_direct_io_aligned());
                assert_eq!(data.ref_count(), 1);
            }
            let _ = OpCode::Read;
        })
        .unwrap();
    }

    /// The same payload queued on two connections (a primary forwarding to two
    /// replicas) is one buffer referenced by both send queues, not two copies, and
    /// both peers receive it whole — small and large, interleaved.
    #[test]
    fn one_payload_buffer_goes_to_two_peers_by_reference() {
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let mut receivers = Vec::new();
            let mut conns = Vec::new();
            for _ in 0..2 {
                let l = TcpListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
                let addr = l.local_addr();
                receivers.push(spawn(async move {
                    let c = l.accept().await.unwrap();
                    let mut got = Vec::new();
                    for _ in 0..6 {
                        got.push(c.recv().await.unwrap());
                    }
                    got
                }));
                conns.push(
                    TcpConn::connect(addr, Duration::from_secs(2))
                        .await
                        .unwrap(),
                );
            }
            let mut sent = Vec::new();
            for i in 0..6u64 {
                let len = [4096, 1 << 20, 100, 3 << 20, 65536, 1][i as usize];
                let bytes: Vec<u8> = (0..len).map(|j| (j as u64 * 7 + i) as u8).collect();
                let data = PayloadBuf::copy_from(&bytes);
                let m = Message::Write {
                    id: RequestId(i),
                    epoch: Epoch(1),
                    target: IoTarget {
                        pg: PgId(1),
                        object: ObjectId {
                            volume: VolumeId(1),
                            index: i,
                        },
                        offset: 0,
                        length: len as u32,
                    },
                    flags: 0,
                    seq: crate::ids::PgSeq(0),
                    op: crate::ids::OpId::NONE,
                    remote: None,
                    data: data.clone(),
                };
                conns[0].send(&m).unwrap();
                conns[1].send(&m).unwrap();
                // The caller's reference, the message's, and one per send queue
                // (until the writers have run).
                assert_eq!(data.ref_count(), 4, "payload copied instead of shared");
                sent.push(m);
            }
            for rx in receivers {
                assert_eq!(rx.await, sent);
            }
        })
        .unwrap();
    }

    #[test]
    fn close_after_send_delivers_the_last_message() {
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let l = TcpListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let addr = l.local_addr();
            spawn(async move {
                let c = l.accept().await.unwrap();
                let ping = Message::Ping {
                    id: RequestId(9),
                    epoch: Epoch(1),
                };
                c.send(&ping.reply(Epoch(1), crate::protocol::status::ESTALE))
                    .unwrap();
                c.close_after_send();
                // Keep the listener side alive until the client has read.
                crate::reactor::sleep(Duration::from_millis(200)).await;
            })
            .detach();
            let c = TcpConn::connect(addr, Duration::from_secs(2))
                .await
                .unwrap();
            match c.recv().await.unwrap() {
                Message::Reply { status, .. } => {
                    assert_eq!(status, crate::protocol::status::ESTALE)
                }
                other => panic!("{other:?}"),
            }
            assert!(matches!(c.recv().await, Err(TransportError::Closed)));
        })
        .unwrap();
    }

    #[test]
    fn garbage_fails_the_connection_cleanly() {
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let l = TcpListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let addr = l.local_addr();
            let server = spawn(async move {
                let c = l.accept().await.unwrap();
                c.recv().await
            });
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            use std::io::Write;
            s.write_all(&[0xAB; 200]).unwrap();
            let res = server.await;
            assert!(
                matches!(res, Err(TransportError::Protocol(_))),
                "{:?}",
                res.err()
            );
        })
        .unwrap();
    }

    #[test]
    fn connect_refused_is_an_error() {
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            // Bind then drop to find a free port nobody listens on.
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap();
            let res = TcpConn::connect(port, Duration::from_secs(2)).await;
            assert!(res.is_err());
        })
        .unwrap();
    }

    /// A v2 connection whose peer answers with a protocol-v1 header (64 bytes, then
    /// silence) fails at once with an error naming both versions, instead of waiting
    /// for the 64 more bytes a v2 header would have.
    #[test]
    fn a_v1_answer_is_reported_with_both_versions_not_awaited() {
        use std::io::{Read, Write};
        let raw = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = raw.local_addr().unwrap();
        let peer = std::thread::spawn(move || {
            let (mut s, _) = raw.accept().unwrap();
            let mut hello = [0u8; crate::protocol::HEADER_LEN];
            s.read_exact(&mut hello).unwrap();
            // A v1 HELLO reply: the v1 header only, no payload.
            let mut b = [0u8; 64];
            b[0..4].copy_from_slice(b"FLME");
            b[4] = 1;
            b[5] = 0x81;
            let crc = crc32c::crc32c(&b[0..60]);
            b[60..64].copy_from_slice(&crc.to_le_bytes());
            s.write_all(&b).unwrap();
            // Stay connected (silent) until the client is done.
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest);
        });
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async move {
            let c = TcpConn::connect(addr, Duration::from_secs(2))
                .await
                .unwrap();
            c.send(&Message::Hello {
                id: RequestId(1),
                epoch: Epoch(1),
                versions: crate::protocol::VERSIONS,
                shard: 0,
                peer: false,
                session: 0,
                generation: 0,
                auth: None,
            })
            .unwrap();
            let res = futures_lite::future::or(async { Some(c.recv().await) }, async {
                crate::reactor::sleep(Duration::from_secs(5)).await;
                None
            })
            .await;
            let Some(Err(e)) = res else {
                panic!("expected a version error, got {res:?}")
            };
            let text = e.to_string();
            assert!(
                text.contains("version 1")
                    && text.contains(&format!("version {}", crate::protocol::VERSION)),
                "{text}"
            );
            c.close();
        })
        .unwrap();
        peer.join().unwrap();
    }
}
