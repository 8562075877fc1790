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

use flame_common::buffer::{PayloadBuf, PayloadBufMut};
use flame_common::reactor::{self, IoBufMut};
use flame_common::transport::Stall;
use flame_common::transport::bring_up::Source;
use flame_common::transport::receive_share;
use flame_common::transport::stream_send::{PushRefused, StreamSend, WriterEnd};
use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::rc::Rc;

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

/// One accepted NBD connection, owned by the current reactor thread.
pub(crate) struct Conn {
    stream: TcpStream,
    /// Whose share of the pool its unfinished payloads hold
    /// ([`flame_common::transport::receive_share`]).
    source: Source,
    /// The send queue, its writer's state, the closed flag and the stall marks
    /// ([`flame_common::transport::stream_send`], shared with the OSD's tcp
    /// connections).
    tx: StreamSend,
}

impl Conn {
    /// Wraps an accepted socket and starts its writer task.
    pub(crate) fn new(stream: TcpStream) -> Rc<Conn> {
        receive_share::register_metrics();
        let source = stream
            .peer_addr()
            .map_or(Source::Local, |a| Source::Ip(a.ip()));
        let conn = Rc::new(Conn {
            stream,
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
            let _ = self.stream.shutdown(std::net::Shutdown::Both);
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
        self.stream.as_raw_fd()
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // Make sure no operation the kernel still holds keeps the socket alive.
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }
}

/// Drains the send queue until the connection closes.
async fn writer(conn: Rc<Conn>) {
    if conn.tx.write_until_closed(conn.fd()).await != WriterEnd::Closed {
        conn.close();
    }
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
