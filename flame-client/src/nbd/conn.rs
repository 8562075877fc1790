//! Socket I/O of one NBD connection on the reactor: a buffered reader and a batched
//! writer.
//!
//! Replies are queued (never awaited) by whichever request task finishes; a writer
//! task per connection drains everything queued with one `writev` per round, so the
//! out-of-order replies of pipelined requests that complete in one reactor tick
//! leave in one system call. Reply headers are copied into a batch buffer; read data
//! travels by reference, as its own iovecs, from the buffers it arrived in from the
//! OSDs. The queue and its writer are [`flame_common::transport::stream_send`], the
//! same as the OSD protocol's tcp connections.
//!
//! A WRITE's payload is received into its own aligned [`PayloadBufMut`]: the part
//! that came in with the request header is copied out of the receive buffer, the
//! rest is received straight into it; after a large payload the next request header
//! is received alone, so a stream of large writes lands without a copy.
//!
//! After `STARTTLS` ([`start_tls`]) a rustls session sits between both sides
//! and the socket: the writer encrypts each round's buffers into one (a copy,
//! the price of TLS), and the reader decrypts what it receives into its buffer,
//! so payloads are copied out of it rather than received in place.

use flame_common::buffer::{PayloadBuf, PayloadBufMut, SendBuf};
use flame_common::reactor::{self, IoBuf, IoBufMut};
use flame_common::transport::Stall;
use flame_common::transport::bring_up::Source;
use flame_common::transport::receive_share;
use flame_common::transport::stream_send::{PushRefused, StreamSend, WriterEnd};
use std::cell::RefCell;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::Arc;

/// Receive buffer per connection: many request headers (and small writes) per
/// system call.
const RECV_BUFFER_BYTES: usize = 128 << 10;
/// After a payload of at least this size, the next request header is received alone
/// (one more system call), so the payload after it is received straight into its
/// buffer instead of being copied out of the receive buffer.
const DIRECT_RECV_PAYLOAD_BYTES_MIN: usize = 64 << 10;
/// Bound on reply bytes queued on one connection. The reader lets in at most
/// what keeps the unsent replies under the transmission's high mark plus the
/// bytes in flight (one request may exceed that bound alone; asserted in
/// `transmission`), so only a bug reaches it; the connection is then closed
/// rather than grow.
pub(crate) const SEND_QUEUE_BYTES_MAX: usize = 256 << 20;
/// Size of an NBD request header: what a header-only receive asks for.
const REQUEST_HEADER_BYTES: usize = super::proto::REQUEST_LEN;
/// Ciphertext received per system call on a TLS connection (a few records).
const TLS_RECV_BYTES: usize = 64 << 10;

/// One accepted NBD connection, owned by the current reactor thread.
pub(crate) struct Conn {
    /// The socket (TCP or Unix).
    fd: OwnedFd,
    /// The TLS session once `STARTTLS` began it.
    tls: RefCell<Option<rustls::ServerConnection>>,
    /// Whose share of the pool its unfinished payloads hold
    /// ([`flame_common::transport::receive_share`]).
    source: Source,
    /// The send queue, its writer's state, the closed flag and the stall marks
    /// ([`flame_common::transport::stream_send`], shared with the OSD's tcp
    /// connections).
    tx: StreamSend,
}

impl Conn {
    /// Wraps an accepted socket from `source` and starts its writer task.
    pub(crate) fn new(fd: OwnedFd, source: Source) -> Rc<Conn> {
        receive_share::register_metrics();
        let conn = Rc::new(Conn {
            fd,
            tls: RefCell::new(None),
            source,
            tx: StreamSend::new(SEND_QUEUE_BYTES_MAX),
        });
        reactor::spawn(writer(conn.clone())).detach();
        conn
    }

    /// Queues bytes (copied), in order after everything queued before.
    pub(crate) fn send(&self, parts: &[&[u8]]) {
        self.push(parts, Vec::new(), 0);
    }

    /// Queues a header (copied) followed by `data` (by reference, never copied).
    pub(crate) fn send_with_data(&self, header: &[u8], data: Vec<PayloadBuf>) {
        let bytes = data.iter().map(PayloadBuf::len).sum();
        self.push(&[header], data, bytes);
    }

    fn push(&self, parts: &[&[u8]], data: Vec<PayloadBuf>, bytes: usize) {
        match self.tx.push_parts(parts, data, bytes) {
            Ok(()) | Err(PushRefused::Closed) => {}
            Err(PushRefused::Backlog(max)) => {
                // The reader stops at SEND_QUEUE_HIGH_BYTES, so only replies to
                // requests already in flight come here: a client holding that
                // much unread is gone in all but name.
                tracing::warn!("NBD client left more than {max} bytes of replies unread; closing");
                self.close();
            }
        }
    }

    /// Bytes queued and not yet handed to the kernel.
    pub(crate) fn queued_bytes(&self) -> usize {
        self.tx.queued_bytes()
    }

    /// Waits until the queue holds at most `bytes_max` bytes (0 = everything written),
    /// or the connection is closed.
    pub(crate) async fn wait_queue_below(&self, bytes_max: usize) {
        self.tx.wait_below(bytes_max).await
    }

    /// Closes the connection: pending receives complete, queued bytes are dropped.
    pub(crate) fn close(&self) {
        if self.tx.close() {
            // Shutting down wakes a pending receive (it completes with 0).
            self.shutdown();
        }
    }

    /// Ends the connection: a TLS session says `close_notify`, and what is
    /// queued (that, or a TLS alert after a failed handshake) gets up to
    /// `bound` to leave before the socket closes.
    pub(crate) async fn finish(&self, bound: std::time::Duration) {
        if let Some(tls) = self.tls.borrow_mut().as_mut() {
            tls.send_close_notify();
        }
        if self.tls_on() {
            self.kick_writer();
        }
        futures_lite::future::or(self.wait_queue_below(0), async {
            reactor::sleep(bound).await
        })
        .await;
        self.close();
    }

    fn shutdown(&self) {
        let _ = socket2::SockRef::from(&self.fd).shutdown(std::net::Shutdown::Both);
    }

    /// Whether a TLS session carries the connection.
    pub(crate) fn tls_on(&self) -> bool {
        self.tls.borrow().is_some()
    }

    /// Whether the TLS session is still in its handshake.
    fn tls_handshaking(&self) -> bool {
        self.tls
            .borrow()
            .as_ref()
            .is_some_and(|t| t.is_handshaking())
    }

    /// Has the writer run a round with nothing queued, so that what the TLS
    /// session has to send (handshake messages, alerts) goes out.
    fn kick_writer(&self) {
        let _ = self.tx.push_owned(Vec::new());
    }

    /// The writer's seal: with TLS on, the round's buffers encrypted into one
    /// (with whatever the session itself has to send); in clear, as they are.
    fn seal(&self, bufs: Vec<SendBuf>) -> io::Result<Vec<SendBuf>> {
        let mut tls = self.tls.borrow_mut();
        let Some(tls) = tls.as_mut() else {
            return Ok(bufs);
        };
        let total: usize = bufs.iter().map(IoBuf::len).sum();
        for b in &bufs {
            // SAFETY: an IoBuf's pointer is valid for its length while the
            // buffer lives (it does, in `bufs`, across this call).
            let bytes = unsafe { std::slice::from_raw_parts(b.as_ptr(), b.len()) };
            tls.writer().write_all(bytes)?;
        }
        // Records add at most a few dozen bytes per 16 KiB.
        let mut out = Vec::with_capacity(total + total / 256 + 1024);
        while tls.wants_write() {
            tls.write_tls(&mut out)?;
        }
        Ok(vec![SendBuf::Copied(out)])
    }

    /// Gives the TLS session ciphertext from `data`; returns how much it
    /// took. A protocol error (a bad record, a refused certificate) queues
    /// the session's alert and is returned.
    fn feed_tls(&self, mut data: &[u8]) -> io::Result<usize> {
        let before = data.len();
        let mut guard = self.tls.borrow_mut();
        let Some(tls) = guard.as_mut() else {
            return Err(io::Error::other("no TLS session"));
        };
        tls.read_tls(&mut data)?;
        let processed = tls.process_new_packets();
        let wants_write = tls.wants_write();
        drop(guard);
        if wants_write {
            self.kick_writer();
        }
        processed.map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        Ok(before - data.len())
    }

    /// Plaintext the TLS session holds, into `out`: `Ok(0)` when the client
    /// closed the session, `WouldBlock` when it needs more ciphertext.
    fn read_plaintext(&self, out: &mut [u8]) -> io::Result<usize> {
        match self.tls.borrow_mut().as_mut() {
            Some(tls) => tls.reader().read(out),
            None => Err(io::Error::other("no TLS session")),
        }
    }

    /// What the connection is stuck on, if anything, with its progress mark
    /// ([`flame_common::transport::stall`]).
    pub(crate) fn stall(&self) -> Option<(Stall, u64)> {
        Some(self.tx.marks().current())
    }

    /// Whether the connection was closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Make sure no operation the kernel still holds keeps the socket alive.
        self.shutdown();
    }
}

/// Drains the send queue until the connection closes (through the TLS
/// session once there is one).
async fn writer(conn: Rc<Conn>) {
    let sealing = conn.clone();
    let end = conn
        .tx
        .write_until_closed_with(conn.fd(), move |bufs| sealing.seal(bufs))
        .await;
    if end != WriterEnd::Closed {
        conn.close();
    }
}

/// Begins TLS on `conn` after the `STARTTLS` acknowledgement was queued:
/// waits for it to leave in clear, runs the TLS handshake (bounded by the
/// negotiation's deadline) and returns the client's certificate (DER), which
/// `config`'s verifier checked against the client CA. A client that sent
/// anything after `STARTTLS` before the acknowledgement broke the protocol.
pub(crate) async fn start_tls(
    conn: &Conn,
    rd: &mut Reader,
    config: Arc<rustls::ServerConfig>,
) -> io::Result<Vec<u8>> {
    if rd.buffered() > 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the client sent data after STARTTLS before its reply",
        ));
    }
    conn.wait_queue_below(0).await;
    let mut session = rustls::ServerConnection::new(config)
        .map_err(|e| io::Error::other(format!("TLS session: {e}")))?;
    // The send queue bounds what is queued (SEND_QUEUE_BYTES_MAX); rustls's
    // own 64 KiB limit would refuse one round of it.
    session.set_buffer_limit(None);
    *conn.tls.borrow_mut() = Some(session);
    while conn.tls_handshaking() {
        rd.fill().await?;
    }
    // The handshake's last flight out before negotiation goes on.
    conn.kick_writer();
    conn.wait_queue_below(0).await;
    let cert = conn
        .tls
        .borrow()
        .as_ref()
        .and_then(|t| t.peer_certificates())
        .and_then(|c| c.first())
        .map(|c| c.as_ref().to_vec());
    cert.ok_or_else(|| io::Error::new(io::ErrorKind::PermissionDenied, "no client certificate"))
}

/// The receiving side of a connection (one per connection, owned by its reader
/// task).
pub(crate) struct Reader {
    conn: Rc<Conn>,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Receive only up to the end of the next request header (see
    /// [`DIRECT_RECV_PAYLOAD_BYTES_MIN`]).
    header_only: bool,
    /// Ciphertext received and not yet given to the TLS session (allocated
    /// at the first TLS receive).
    tls_in: Vec<u8>,
    tls_in_start: usize,
    tls_in_end: usize,
}

fn eof() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "peer closed the connection")
}

impl Reader {
    /// A reader on `conn`.
    pub(crate) fn new(conn: Rc<Conn>) -> Reader {
        Reader {
            conn,
            buf: vec![0u8; RECV_BUFFER_BYTES],
            start: 0,
            end: 0,
            header_only: false,
            tls_in: Vec::new(),
            tls_in_start: 0,
            tls_in_end: 0,
        }
    }

    /// One step of a TLS connection's receive: plaintext the session holds
    /// into the buffer, else ciphertext received earlier into the session,
    /// else one receive of ciphertext. Each step makes progress or fails.
    async fn fill_tls(&mut self) -> io::Result<()> {
        match self.conn.read_plaintext(&mut self.buf[self.end..]) {
            Ok(0) => return Err(eof()),
            Ok(n) => {
                self.end += n;
                return Ok(());
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
        if self.tls_in_start < self.tls_in_end {
            let took = self
                .conn
                .feed_tls(&self.tls_in[self.tls_in_start..self.tls_in_end])?;
            self.tls_in_start += took;
            return Ok(());
        }
        if self.tls_in.is_empty() {
            self.tls_in = vec![0u8; TLS_RECV_BYTES];
        }
        let buf = std::mem::take(&mut self.tls_in);
        let (res, buf) = reactor::recv(self.conn.fd(), buf, 0).await;
        self.tls_in = buf;
        match res {
            Ok(0) => Err(eof()),
            Ok(n) => {
                self.tls_in_start = 0;
                self.tls_in_end = n;
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Bytes buffered and not yet consumed.
    pub(crate) fn buffered(&self) -> usize {
        self.end - self.start
    }

    async fn fill(&mut self) -> io::Result<()> {
        if self.conn.is_closed() {
            return Err(eof());
        }
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.conn.tls_on() {
            return self.fill_tls().await;
        }
        let buf = std::mem::take(&mut self.buf);
        let limit = if self.header_only {
            // Up to the end of a request header: a WRITE's payload after it goes to
            // its own buffer.
            (self.start + REQUEST_HEADER_BYTES)
                .max(self.end + 1)
                .min(buf.len())
        } else {
            buf.len()
        };
        let (res, buf) = reactor::recv_range(self.conn.fd(), buf, self.end, limit).await;
        self.buf = buf;
        match res {
            Ok(0) => Err(eof()),
            Ok(n) => {
                self.end += n;
                Ok(())
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Fills `out` completely.
    pub(crate) async fn read_exact(&mut self, out: &mut [u8]) -> io::Result<()> {
        debug_assert!(out.len() <= RECV_BUFFER_BYTES);
        while self.buffered() < out.len() {
            self.fill().await?;
        }
        out.copy_from_slice(&self.buf[self.start..self.start + out.len()]);
        self.start += out.len();
        self.header_only = false;
        Ok(())
    }

    /// Receives into `out` from byte `filled` until it is full (the bytes before
    /// `filled` came from the receive buffer). Bounded: every round receives at
    /// least one byte or returns.
    async fn recv_rest<B: IoBufMut>(&mut self, mut out: B, mut filled: usize) -> io::Result<B> {
        let len = out.len();
        if self.conn.tls_on() {
            // Decrypted into the receive buffer, then copied out.
            while filled < len {
                if self.buffered() == 0 {
                    self.fill().await?;
                    continue;
                }
                let take = self.buffered().min(len - filled);
                // SAFETY: an IoBufMut's pointer is valid for writes of its
                // length while we hold it (we own `out`).
                let dst = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr(), len) };
                dst[filled..filled + take]
                    .copy_from_slice(&self.buf[self.start..self.start + take]);
                self.start += take;
                filled += take;
            }
            return Ok(out);
        }
        while filled < len {
            if self.conn.is_closed() {
                return Err(eof());
            }
            let (res, back) = reactor::recv(self.conn.fd(), out, filled).await;
            out = back;
            match res {
                Ok(0) => return Err(eof()),
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// Reads a WRITE's payload of exactly `len` bytes into its own aligned buffer:
    /// what is already buffered is copied, the rest is received straight into it.
    /// The caller bounds `len`.
    pub(crate) async fn read_payload(&mut self, len: usize) -> io::Result<PayloadBufMut> {
        let have = self.buffered().min(len);
        // A payload still to come holds part of its source's share of the pool
        // until it is whole (trickling clients cannot take the whole pool). From
        // the thread's memory pool, waiting for frees when it is exhausted (the
        // socket is not read meanwhile: back-pressure); past the pool's wait
        // bound the error ends the connection.
        if have < len {
            // The slow path: the connection's stall watchdog sees it, from here
            // (a wait for the source's share counts).
            self.conn.tx.marks().payload_started();
        }
        let share = if have < len {
            Some(receive_share::take(self.conn.source, len as u64).await?)
        } else {
            None
        };
        let mut out = PayloadBufMut::for_overwrite_wait(len).await?;
        out.as_mut_slice()[..have].copy_from_slice(&self.buf[self.start..self.start + have]);
        self.start += have;
        let out = self.recv_rest(out, have).await?;
        self.conn.tx.marks().payload_finished();
        drop(share);
        if len >= DIRECT_RECV_PAYLOAD_BYTES_MIN {
            self.header_only = true;
        }
        Ok(out)
    }

    /// Reads exactly `len` bytes into a new buffer; bytes beyond what is buffered are
    /// received straight into it. The caller bounds `len`.
    pub(crate) async fn read_vec(&mut self, len: usize) -> io::Result<Vec<u8>> {
        let have = self.buffered().min(len);
        if have == len {
            let out = self.buf[self.start..self.start + have].to_vec();
            self.start += have;
            return Ok(out);
        }
        // Fresh zeroed pages from the allocator: no memset of up to 32 MiB that the
        // receive is about to overwrite.
        let mut out = vec![0u8; len];
        out[..have].copy_from_slice(&self.buf[self.start..self.start + have]);
        self.start += have;
        self.recv_rest(out, have).await
    }

    /// Consumes and drops `len` bytes (an over-long option), with bounded memory.
    pub(crate) async fn skip(&mut self, mut len: u64) -> io::Result<()> {
        // Skipped bytes go through the receive buffer: read them in large chunks.
        self.header_only = false;
        loop {
            let take = (self.buffered() as u64).min(len) as usize;
            self.start += take;
            len -= take as u64;
            if len == 0 {
                return Ok(());
            }
            self.fill().await?;
        }
    }
}
