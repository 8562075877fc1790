//! Socket I/O of one NBD connection on the reactor: a buffered reader and a batched
//! writer.
//!
//! Replies are queued (never awaited) by whichever request task finishes; a writer
//! task per connection drains everything queued with one `writev` per round, so the
//! out-of-order replies of pipelined requests that complete in one reactor tick
//! leave in one system call. Small replies are copied into a batch buffer; read data
//! travels as its own iovec without a copy.

use flame_common::reactor;
use std::cell::{Cell, RefCell};
use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::task::{Poll, Waker};

/// Data up to this size is copied into the batch buffer rather than sent as its own
/// iovec.
const INLINE_BYTES_MAX: usize = 16 << 10;
/// Receive buffer per connection: many request headers (and small writes) per
/// system call.
const RECV_BUFFER_BYTES: usize = 128 << 10;

#[derive(Default)]
struct SendQueue {
    bufs: Vec<Vec<u8>>,
    last_is_batch: bool,
    queued_bytes: usize,
    /// A `writev` round is in progress.
    writing: bool,
    writer: Option<Waker>,
    /// Tasks waiting for the queue to drain (graceful close) or shrink (back-pressure).
    drain_waiters: Vec<Waker>,
}

/// One accepted NBD connection, owned by the current reactor thread.
pub(crate) struct Conn {
    stream: TcpStream,
    queue: RefCell<SendQueue>,
    closed: Cell<bool>,
}

impl Conn {
    /// Wraps an accepted socket and starts its writer task.
    pub(crate) fn new(stream: TcpStream) -> Rc<Conn> {
        let conn = Rc::new(Conn {
            stream,
            queue: RefCell::new(SendQueue::default()),
            closed: Cell::new(false),
        });
        reactor::spawn(writer(conn.clone())).detach();
        conn
    }

    fn wake_writer(q: &mut SendQueue) {
        if let Some(w) = q.writer.take() {
            w.wake();
        }
    }

    /// Queues bytes (copied), in order after everything queued before.
    pub(crate) fn send(&self, parts: &[&[u8]]) {
        if self.closed.get() {
            return;
        }
        let mut q = self.queue.borrow_mut();
        if !q.last_is_batch {
            q.bufs.push(Vec::with_capacity(4096));
            q.last_is_batch = true;
        }
        let mut n = 0;
        if let Some(batch) = q.bufs.last_mut() {
            for p in parts {
                batch.extend_from_slice(p);
                n += p.len();
            }
        }
        q.queued_bytes += n;
        Self::wake_writer(&mut q);
    }

    /// Queues a header (copied) followed by `data` (moved, not copied, when large).
    pub(crate) fn send_with_data(&self, header: &[u8], data: Vec<u8>) {
        if data.len() <= INLINE_BYTES_MAX {
            self.send(&[header, &data]);
            return;
        }
        if self.closed.get() {
            return;
        }
        self.send(&[header]);
        let mut q = self.queue.borrow_mut();
        q.queued_bytes += data.len();
        q.bufs.push(data);
        q.last_is_batch = false;
        Self::wake_writer(&mut q);
    }

    /// Bytes queued and not yet handed to the kernel.
    pub(crate) fn queued_bytes(&self) -> usize {
        self.queue.borrow().queued_bytes
    }

    /// Waits until the queue holds at most `bytes_max` bytes (0 = everything written),
    /// or the connection is closed.
    pub(crate) async fn wait_queue_below(&self, bytes_max: usize) {
        std::future::poll_fn(|cx| {
            if self.closed.get() {
                return Poll::Ready(());
            }
            let mut q = self.queue.borrow_mut();
            let done = if bytes_max == 0 {
                q.bufs.is_empty() && !q.writing
            } else {
                q.queued_bytes <= bytes_max
            };
            if done {
                return Poll::Ready(());
            }
            q.drain_waiters.push(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Closes the connection: pending receives complete, queued bytes are dropped.
    pub(crate) fn close(&self) {
        if self.closed.replace(true) {
            return;
        }
        // Shutting down wakes a pending receive (it completes with 0) and the writer.
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        let mut q = self.queue.borrow_mut();
        q.bufs.clear();
        q.queued_bytes = 0;
        Self::wake_writer(&mut q);
        for w in q.drain_waiters.drain(..) {
            w.wake();
        }
    }

    /// Whether the connection was closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.get()
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
    let fd = conn.fd();
    loop {
        let bufs = std::future::poll_fn(|cx| {
            if conn.closed.get() {
                return Poll::Ready(None);
            }
            let mut q = conn.queue.borrow_mut();
            if q.bufs.is_empty() {
                q.writing = false;
                for w in q.drain_waiters.drain(..) {
                    w.wake();
                }
                q.writer = Some(cx.waker().clone());
                return Poll::Pending;
            }
            q.writing = true;
            q.last_is_batch = false;
            q.queued_bytes = 0;
            Poll::Ready(Some(std::mem::take(&mut q.bufs)))
        })
        .await;
        let Some(bufs) = bufs else { return };
        {
            // Back-pressured readers may go on: the queue was just emptied.
            let mut q = conn.queue.borrow_mut();
            for w in q.drain_waiters.drain(..) {
                w.wake();
            }
        }
        if reactor::writev_all(fd, bufs).await.is_err() {
            conn.close();
            return;
        }
    }
}

/// The receiving side of a connection (one per connection, owned by its reader
/// task).
pub(crate) struct Reader {
    conn: Rc<Conn>,
    buf: Vec<u8>,
    start: usize,
    end: usize,
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
        let (res, buf) = reactor::recv(self.conn.fd(), buf, self.end).await;
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
        Ok(())
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
        let mut filled = have;
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

    /// Consumes and drops `len` bytes (an over-long option), with bounded memory.
    pub(crate) async fn skip(&mut self, mut len: u64) -> io::Result<()> {
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
