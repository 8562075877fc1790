//! The send side of a byte-stream connection — the OSD protocol over tcp
//! ([`super::tcp`]) and flame-nbd's NBD connections: the connection's
//! [`SendQueue`] holding buffers for `writev`, and one writer task per
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
//! what it sends. The close rules are [`SendQueue`]'s.

use super::send_queue::{Backlog, SendQueue};
pub use super::send_queue::{PushRefused, WriterEnd};
use crate::buffer::{PayloadBuf, SendBuf};
use crate::reactor;
use std::os::fd::RawFd;

/// Capacity a new batch buffer starts with.
const BATCH_BYTES_INITIAL: usize = 4096;

/// A byte stream's backlog: buffers to write, in order.
#[derive(Default)]
pub struct StreamBufs {
    /// The last one may be a batch still being filled.
    bufs: Vec<SendBuf>,
    /// Whether the last buffer in `bufs` is a batch buffer that may take more.
    last_is_batch: bool,
}

impl Backlog for StreamBufs {
    fn is_empty(&self) -> bool {
        self.bufs.is_empty()
    }
}

/// A byte-stream connection's send queue and writer state (one thread).
pub type StreamSend = SendQueue<StreamBufs>;

impl SendQueue<StreamBufs> {
    /// Queues `copied` (copied into the batch buffer, in order) and then
    /// `shared` (by reference, each its own iovec; empty ones skipped), after
    /// everything queued before. All or nothing.
    pub fn push_parts(
        &self,
        copied: &[&[u8]],
        shared: impl IntoIterator<Item = PayloadBuf>,
        shared_bytes: usize,
    ) -> Result<(), PushRefused> {
        let copied_bytes: usize = copied.iter().map(|p| p.len()).sum();
        self.push(copied_bytes + shared_bytes, |q| {
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
            assert_eq!(
                pushed_shared, shared_bytes,
                "shared_bytes must be the payloads' length"
            );
        })
    }

    /// Queues `bytes` as a buffer of its own (not batched with what follows).
    pub fn push_owned(&self, bytes: Vec<u8>) -> Result<(), PushRefused> {
        self.push(bytes.len(), |q| {
            q.bufs.push(SendBuf::Copied(bytes));
            q.last_is_batch = false;
        })
    }

    /// The writer: drains the queue to `fd` until the connection closes, one
    /// `writev` (as many rounds as the kernel needs) per batch of everything
    /// queued. The owner runs it as a task of its own and closes the
    /// connection when it returns anything but [`WriterEnd::Closed`].
    pub async fn write_until_closed(&self, fd: RawFd) -> WriterEnd {
        self.write_until_closed_with(fd, Ok).await
    }

    /// [`Self::write_until_closed`], with each round's buffers passed through
    /// `seal` before they are written (a TLS session encrypts them there; it
    /// may also be called with no buffers, to send what the session itself
    /// has to say). An error from `seal` ends the writer as a failed write
    /// does.
    pub async fn write_until_closed_with(
        &self,
        fd: RawFd,
        mut seal: impl FnMut(Vec<SendBuf>) -> std::io::Result<Vec<SendBuf>>,
    ) -> WriterEnd {
        loop {
            if let Err(end) = self.next_round().await {
                return end;
            }
            let bufs = self.take_all(|q| {
                q.last_is_batch = false;
                std::mem::take(&mut q.bufs)
            });
            let Ok(bufs) = seal(bufs) else {
                return WriterEnd::Failed;
            };
            self.marks().send_started();
            let written = reactor::writev_all(fd, bufs).await;
            self.marks().send_finished();
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
        s.with_backlog(|q| {
            q.bufs
                .iter()
                .map(|b| match b {
                    SendBuf::Copied(v) => v.clone(),
                    SendBuf::Shared(p) => p.as_slice().to_vec(),
                })
                .collect()
        })
    }

    #[test]
    fn small_parts_batch_and_payloads_stay_their_own_buffers() {
        let s = StreamSend::new(1 << 20);
        s.push_parts(&[b"h1", b"-"], [], 0).unwrap();
        s.push_parts(&[b"h2"], [PayloadBuf::copy_from(b"DATA")], 4)
            .unwrap();
        s.push_parts(&[b"h3"], [PayloadBuf::empty()], 0).unwrap();
        assert_eq!(
            bufs(&s),
            vec![b"h1-h2".to_vec(), b"DATA".to_vec(), b"h3".to_vec()],
            "headers batch until a payload; empty payloads are skipped"
        );
        assert_eq!(s.queued_bytes(), 11);
        s.push_owned(b"raw".to_vec()).unwrap();
        s.push_parts(&[b"h4"], [], 0).unwrap();
        assert_eq!(bufs(&s).len(), 5, "an owned buffer is never appended to");
    }

    #[test]
    fn the_byte_bound_refuses_whole_pushes() {
        let s = StreamSend::new(10);
        s.push_parts(&[b"12345678"], [], 0).unwrap();
        assert_eq!(
            s.push_parts(&[b"h"], [PayloadBuf::copy_from(b"xy")], 2),
            Err(PushRefused::Backlog(10))
        );
        assert_eq!(s.queued_bytes(), 8, "nothing of a refused push is queued");
        assert_eq!(s.push_owned(vec![0; 3]), Err(PushRefused::Backlog(10)));
        s.push_parts(&[b"12"], [], 0).unwrap();
        assert_eq!(s.queued_bytes(), 10, "exactly at the bound is allowed");
    }

    #[test]
    fn close_drops_the_queue_once_and_refuses_pushes() {
        let s = StreamSend::new(1 << 10);
        s.push_parts(&[b"queued"], [], 0).unwrap();
        s.close_after_send();
        s.push_parts(&[b"late"], [], 0).unwrap();
        assert_eq!(s.queued_bytes(), 10, "closing: what is queued still goes");
        assert!(s.close(), "the first close");
        assert!(!s.close(), "then no more");
        assert_eq!(s.queued_bytes(), 0);
        assert!(s.is_closed());
        assert_eq!(s.push_owned(vec![1]), Err(PushRefused::Closed));
    }
}
