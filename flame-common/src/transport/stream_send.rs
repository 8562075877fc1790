//! The send side of a byte-stream connection — the OSD protocol over tcp
//! ([`super::tcp`]) and flame-nbd's NBD connections — written once: a bounded
//! queue that senders append to without waiting, and one writer task per
//! connection that drains everything queued with one `writev` per round.
//!
//! Small parts (message headers, NBD reply headers, a HELLO's body) are copied
//! into a batch buffer; payloads travel by reference, as their own iovecs, from
//! the buffers they already live in. So the out-of-order replies of pipelined
//! requests that complete in one reactor tick leave in one system call, and a
//! payload is never copied on its way out.
//!
//! What the owner adds: its socket (the writer is given its fd), what "closed"
//! means beyond the queue (shutting the socket down wakes its receiver), and
//! what it sends. The queue holds the closed and closing flags, so every owner
//! closes the same way: [`StreamSend::close`] drops what is queued and wakes
//! everyone waiting; [`StreamSend::close_after_send`] lets what is queued go
//! first; a queue past its byte bound refuses and the owner closes (a peer that
//! does not read must not grow memory without limit). The writer's progress is
//! in [`StallMarks`] for the owner's stall watchdog.

use super::StallMarks;
use crate::buffer::{PayloadBuf, SendBuf};
use crate::reactor;
use std::cell::{Cell, RefCell};
use std::os::fd::RawFd;
use std::task::{Poll, Waker};

/// Capacity a new batch buffer starts with.
const BATCH_BYTES_INITIAL: usize = 4096;

#[derive(Default)]
struct Queue {
    /// Buffers to write, in order. The last one may be a batch still being filled.
    bufs: Vec<SendBuf>,
    /// Whether the last buffer in `bufs` is a batch buffer that may take more.
    last_is_batch: bool,
    /// Bytes in `bufs`.
    queued_bytes: usize,
    /// A `writev` round is in progress.
    writing: bool,
    /// The writer, waiting for something to write.
    writer: Option<Waker>,
    /// Tasks waiting for the queue to drain or shrink.
    drain_waiters: Vec<Waker>,
}

/// Why a push was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushRefused {
    /// The connection is closed: nothing more is sent.
    Closed,
    /// The queue would pass its byte bound (the bound is the value): the peer
    /// does not read. The owner closes the connection.
    Backlog(usize),
}

/// How the writer ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriterEnd {
    /// The owner closed the queue.
    Closed,
    /// Everything queued before [`StreamSend::close_after_send`] was written:
    /// the owner closes the connection now.
    Drained,
    /// A write failed (the peer is gone): the owner closes the connection.
    Failed,
}

/// A byte-stream connection's send queue and writer state (one thread).
pub struct StreamSend {
    queue: RefCell<Queue>,
    closed: Cell<bool>,
    /// Close once everything queued so far is written.
    closing: Cell<bool>,
    /// Bound on queued bytes; a push past it is refused.
    bytes_max: usize,
    marks: StallMarks,
}

impl StreamSend {
    /// An empty queue of at most `bytes_max` bytes.
    pub fn new(bytes_max: usize) -> StreamSend {
        assert!(bytes_max > 0, "a send queue must hold something");
        StreamSend {
            queue: RefCell::new(Queue::default()),
            closed: Cell::new(false),
            closing: Cell::new(false),
            bytes_max,
            marks: StallMarks::default(),
        }
    }

    /// The progress marks of this connection (the owner's receive side marks its
    /// payloads and frames there too).
    pub fn marks(&self) -> &StallMarks {
        &self.marks
    }

    /// Whether the connection was closed.
    pub fn is_closed(&self) -> bool {
        self.closed.get()
    }

    /// Queues `copied` (copied into the batch buffer, in order) and then
    /// `shared` (by reference, each its own iovec; empty ones skipped), after
    /// everything queued before. All or nothing.
    pub fn push(
        &self,
        copied: &[&[u8]],
        shared: impl IntoIterator<Item = PayloadBuf>,
        shared_bytes: usize,
    ) -> Result<(), PushRefused> {
        if self.closed.get() {
            return Err(PushRefused::Closed);
        }
        let copied_bytes: usize = copied.iter().map(|p| p.len()).sum();
        let bytes = copied_bytes + shared_bytes;
        let mut q = self.queue.borrow_mut();
        if q.queued_bytes + bytes > self.bytes_max {
            return Err(PushRefused::Backlog(self.bytes_max));
        }
        if copied_bytes > 0 {
            if !q.last_is_batch {
                q.bufs
                    .push(SendBuf::Copied(Vec::with_capacity(BATCH_BYTES_INITIAL)));
                q.last_is_batch = true;
            }
            if let Some(SendBuf::Copied(batch)) = q.bufs.last_mut() {
                for p in copied {
                    batch.extend_from_slice(p);
                }
            }
        }
        let mut pushed_shared = 0;
        for d in shared.into_iter().filter(|d| !d.is_empty()) {
            pushed_shared += d.len();
            q.bufs.push(SendBuf::Shared(d));
            q.last_is_batch = false;
        }
        debug_assert_eq!(
            pushed_shared, shared_bytes,
            "shared_bytes must be the payloads' length"
        );
        q.queued_bytes += copied_bytes + pushed_shared;
        if let Some(w) = q.writer.take() {
            w.wake();
        }
        Ok(())
    }

    /// Queues `bytes` as a buffer of its own (not batched with what follows).
    pub fn push_owned(&self, bytes: Vec<u8>) -> Result<(), PushRefused> {
        if self.closed.get() {
            return Err(PushRefused::Closed);
        }
        let mut q = self.queue.borrow_mut();
        if q.queued_bytes + bytes.len() > self.bytes_max {
            return Err(PushRefused::Backlog(self.bytes_max));
        }
        q.queued_bytes += bytes.len();
        q.bufs.push(SendBuf::Copied(bytes));
        q.last_is_batch = false;
        if let Some(w) = q.writer.take() {
            w.wake();
        }
        Ok(())
    }

    /// Bytes queued and not yet handed to the kernel.
    pub fn queued_bytes(&self) -> usize {
        self.queue.borrow().queued_bytes
    }

    /// Waits until the queue holds at most `bytes_max` bytes (0: everything
    /// written), or the connection is closed.
    pub async fn wait_below(&self, bytes_max: usize) {
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

    /// Sends what is queued, then ends the writer with [`WriterEnd::Drained`].
    /// What is pushed before the queue has drained still goes (a refusal queued
    /// right after, say).
    pub fn close_after_send(&self) {
        if self.closed.get() {
            return;
        }
        self.closing.set(true);
        // Wake the writer so an already-empty queue ends at once.
        if let Some(w) = self.queue.borrow_mut().writer.take() {
            w.wake();
        }
    }

    /// Closes: drops what is queued, wakes the writer and every waiter. `true`
    /// the first time (the owner then shuts its socket down).
    pub fn close(&self) -> bool {
        if self.closed.replace(true) {
            return false;
        }
        let mut q = self.queue.borrow_mut();
        q.bufs.clear();
        q.queued_bytes = 0;
        let writer = q.writer.take();
        let waiters = std::mem::take(&mut q.drain_waiters);
        drop(q);
        if let Some(w) = writer {
            w.wake();
        }
        for w in waiters {
            w.wake();
        }
        true
    }

    /// The writer: drains the queue to `fd` until the connection closes, one
    /// `writev` (as many rounds as the kernel needs) per batch of everything
    /// queued. The owner runs it as a task of its own and closes the
    /// connection when it returns anything but [`WriterEnd::Closed`].
    pub async fn write_until_closed(&self, fd: RawFd) -> WriterEnd {
        loop {
            let bufs = std::future::poll_fn(|cx| {
                if self.closed.get() {
                    return Poll::Ready(Err(WriterEnd::Closed));
                }
                let mut q = self.queue.borrow_mut();
                if q.bufs.is_empty() {
                    q.writing = false;
                    let waiters = std::mem::take(&mut q.drain_waiters);
                    if self.closing.get() {
                        drop(q);
                        waiters.into_iter().for_each(Waker::wake);
                        return Poll::Ready(Err(WriterEnd::Drained));
                    }
                    q.writer = Some(cx.waker().clone());
                    drop(q);
                    waiters.into_iter().for_each(Waker::wake);
                    return Poll::Pending;
                }
                q.writing = true;
                q.last_is_batch = false;
                q.queued_bytes = 0;
                let bufs = std::mem::take(&mut q.bufs);
                // Back-pressured senders may go on: the queue was just emptied.
                let waiters = std::mem::take(&mut q.drain_waiters);
                drop(q);
                waiters.into_iter().for_each(Waker::wake);
                Poll::Ready(Ok(bufs))
            })
            .await;
            let bufs = match bufs {
                Ok(b) => b,
                Err(end) => return end,
            };
            self.marks.send_started();
            let written = reactor::writev_all(fd, bufs).await;
            self.marks.send_finished();
            if written.is_err() {
                return WriterEnd::Failed;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bufs(s: &StreamSend) -> Vec<Vec<u8>> {
        s.queue
            .borrow()
            .bufs
            .iter()
            .map(|b| match b {
                SendBuf::Copied(v) => v.clone(),
                SendBuf::Shared(p) => p.as_slice().to_vec(),
            })
            .collect()
    }

    #[test]
    fn small_parts_batch_and_payloads_stay_their_own_buffers() {
        let s = StreamSend::new(1 << 20);
        s.push(&[b"h1", b"-"], [], 0).unwrap();
        s.push(&[b"h2"], [PayloadBuf::copy_from(b"DATA")], 4)
            .unwrap();
        s.push(&[b"h3"], [PayloadBuf::empty()], 0).unwrap();
        assert_eq!(
            bufs(&s),
            vec![b"h1-h2".to_vec(), b"DATA".to_vec(), b"h3".to_vec()],
            "headers batch until a payload; empty payloads are skipped"
        );
        assert_eq!(s.queued_bytes(), 11);
        s.push_owned(b"raw".to_vec()).unwrap();
        s.push(&[b"h4"], [], 0).unwrap();
        assert_eq!(bufs(&s).len(), 5, "an owned buffer is never appended to");
    }

    #[test]
    fn the_byte_bound_refuses_whole_pushes() {
        let s = StreamSend::new(10);
        s.push(&[b"12345678"], [], 0).unwrap();
        assert_eq!(
            s.push(&[b"h"], [PayloadBuf::copy_from(b"xy")], 2),
            Err(PushRefused::Backlog(10))
        );
        assert_eq!(s.queued_bytes(), 8, "nothing of a refused push is queued");
        assert_eq!(s.push_owned(vec![0; 3]), Err(PushRefused::Backlog(10)));
        s.push(&[b"12"], [], 0).unwrap();
        assert_eq!(s.queued_bytes(), 10, "exactly at the bound is allowed");
    }

    #[test]
    fn close_drops_the_queue_once_and_refuses_pushes() {
        let s = StreamSend::new(1 << 10);
        s.push(&[b"queued"], [], 0).unwrap();
        s.close_after_send();
        s.push(&[b"late"], [], 0).unwrap();
        assert_eq!(s.queued_bytes(), 10, "closing: what is queued still goes");
        assert!(s.close(), "the first close");
        assert!(!s.close(), "then no more");
        assert_eq!(s.queued_bytes(), 0);
        assert!(s.is_closed());
        assert_eq!(s.push_owned(vec![1]), Err(PushRefused::Closed));
    }
}
