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
use crate::buffer::{PayloadBuf, PayloadBufMut, SendBuf};
use crate::protocol::{HEADER_LEN, HEADER_PREFIX_LEN, Header, Message, ProtocolError};
use crate::reactor;
use std::cell::{Cell, RefCell};
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

struct SendQueue {
    /// Buffers to write, in order. The last one may be a batch still being filled.
    bufs: Vec<SendBuf>,
    /// Whether the last buffer in `bufs` is a batch buffer that may take more.
    last_is_batch: bool,
    queued_bytes: usize,
    writer: Option<Waker>,
}

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
    queue: RefCell<SendQueue>,
    recv_state: RefCell<Option<RecvState>>,
    closed: Cell<bool>,
    /// Close once everything queued so far is written (see `close_after_send`).
    closing: Cell<bool>,
    /// Receive payloads into heap memory when the pool is exhausted instead of
    /// waiting (see [`super::Conn::set_never_wait_for_memory`]).
    never_wait: Cell<bool>,
}

impl TcpConn {
    fn new(stream: TcpStream) -> io::Result<Rc<TcpConn>> {
        stream.set_nodelay(true)?;
        // A peer that reset right after connecting has no address any more; that is
        // its problem (its first read fails), not a reason to fail the accept loop.
        let peer = stream
            .peer_addr()
            .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
        let conn = Rc::new(TcpConn {
            stream,
            peer,
            queue: RefCell::new(SendQueue {
                bufs: Vec::new(),
                last_is_batch: false,
                queued_bytes: 0,
                writer: None,
            }),
            recv_state: RefCell::new(Some(RecvState {
                buf: vec![0u8; RECV_BUFFER_BYTES],
                start: 0,
                end: 0,
                header_only: false,
            })),
            closed: Cell::new(false),
            closing: Cell::new(false),
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
        if self.closed.get() {
            return Err(TransportError::Closed);
        }
        let mut q = self.queue.borrow_mut();
        if q.queued_bytes + bytes.len() > SEND_QUEUE_BYTES_MAX {
            drop(q);
            self.close();
            return Err(TransportError::Backlog(SEND_QUEUE_BYTES_MAX));
        }
        q.queued_bytes += bytes.len();
        q.bufs.push(SendBuf::Copied(bytes));
        q.last_is_batch = false;
        if let Some(w) = q.writer.take() {
            w.wake();
        }
        Ok(())
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
        if self.closed.get() {
            return Err(TransportError::Closed);
        }
        let payload = payload.filter(|p| !p.is_empty());
        let payload_len = inline.len() + payload.as_ref().map_or(0, PayloadBuf::len);
        debug_assert_eq!(header.payload_len as usize, payload_len);
        let bytes = HEADER_LEN + payload_len;
        let mut q = self.queue.borrow_mut();
        if q.queued_bytes + bytes > SEND_QUEUE_BYTES_MAX {
            drop(q);
            self.close();
            return Err(TransportError::Backlog(SEND_QUEUE_BYTES_MAX));
        }
        if !q.last_is_batch {
            q.bufs.push(SendBuf::Copied(Vec::with_capacity(4096)));
            q.last_is_batch = true;
        }
        if let Some(SendBuf::Copied(batch)) = q.bufs.last_mut() {
            batch.extend_from_slice(&header.encode());
            batch.extend_from_slice(inline);
        }
        if let Some(data) = payload {
            q.bufs.push(SendBuf::Shared(data));
            q.last_is_batch = false;
        }
        q.queued_bytes += bytes;
        if let Some(w) = q.writer.take() {
            w.wake();
        }
        Ok(())
    }

    /// See [`super::Conn::recv`].
    pub async fn recv(&self) -> Result<Message, TransportError> {
        let Some(mut st) = self.recv_state.borrow_mut().take() else {
            return Err(TransportError::Io(io::Error::other(
                "two tasks receiving on one connection",
            )));
        };
        let result = self.recv_inner(&mut st).await;
        *self.recv_state.borrow_mut() = Some(st);
        match &result {
            // A peer of another protocol version: close once what is queued has
            // been sent, so the caller can still queue a refusal in the peer's
            // format ([`crate::protocol::version_refusal`]) before it yields.
            Err(TransportError::Protocol(ProtocolError::ForeignVersion { .. })) => {
                self.close_after_send()
            }
            Err(_) => self.close(),
            Ok(_) => {}
        }
        result
    }

    async fn recv_inner(&self, st: &mut RecvState) -> Result<Message, TransportError> {
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
        st.header_only = false;
        // Payload: bounded by Header::decode before this allocation.
        let len = header.payload_len as usize;
        let have = (st.end - st.start).min(len);
        // From the thread's memory pool; when it is exhausted this waits for frees
        // (not reading the socket meanwhile back-pressures the peer) and, past the
        // pool's wait bound, fails, which closes the connection.
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
            if self.closed.get() {
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
        if len >= DIRECT_RECV_PAYLOAD_BYTES_MIN {
            st.header_only = true;
        }
        let payload = payload.freeze();
        Ok(Message::from_parts(&header, payload)?)
    }

    async fn fill(&self, fd: i32, st: &mut RecvState) -> Result<(), TransportError> {
        if self.closed.get() {
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
        if self.closed.get() {
            return;
        }
        self.closing.set(true);
        // Wake the writer so an already-empty queue closes at once.
        if let Some(w) = self.queue.borrow_mut().writer.take() {
            w.wake();
        }
    }

    /// See [`super::Conn::set_never_wait_for_memory`].
    pub fn set_never_wait_for_memory(&self, on: bool) {
        self.never_wait.set(on);
    }

    /// See [`super::Conn::close`].
    pub fn close(&self) {
        if self.closed.replace(true) {
            return;
        }
        // Wakes a pending receive (it completes with 0 or an error) and the writer.
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        let mut q = self.queue.borrow_mut();
        q.bufs.clear();
        q.queued_bytes = 0;
        if let Some(w) = q.writer.take() {
            w.wake();
        }
    }

    /// See [`super::Conn::is_closed`].
    pub fn is_closed(&self) -> bool {
        self.closed.get()
    }

    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }
}

/// Drains a connection's send queue until the connection closes.
async fn writer(conn: Rc<TcpConn>) {
    let fd = conn.stream.as_raw_fd();
    loop {
        let bufs = std::future::poll_fn(|cx| {
            if conn.closed.get() {
                return Poll::Ready(None);
            }
            let mut q = conn.queue.borrow_mut();
            if q.bufs.is_empty() {
                if conn.closing.get() {
                    drop(q);
                    conn.close();
                    return Poll::Ready(None);
                }
                q.writer = Some(cx.waker().clone());
                return Poll::Pending;
            }
            q.last_is_batch = false;
            q.queued_bytes = 0;
            Poll::Ready(Some(std::mem::take(&mut q.bufs)))
        })
        .await;
        let Some(bufs) = bufs else { return };
        if reactor::writev_all(fd, bufs).await.is_err() {
            conn.close();
            return;
        }
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
                text.contains("version 1") && text.contains("version 2"),
                "{text}"
            );
            c.close();
        })
        .unwrap();
        peer.join().unwrap();
    }
}
