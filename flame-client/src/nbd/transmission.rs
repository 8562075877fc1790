//! The transmission phase: one reader task decoding requests, one task per request,
//! replies through the connection's batched writer.
//!
//! Requests run concurrently and reply out of order (matched by cookie). The reader
//! stops reading while the connection is at its bounds — requests in flight, bytes
//! in flight, or reply bytes queued but unsent (a client that stops reading replies
//! stops being read) — so one connection's memory is bounded whatever the client
//! does. Errors use the spec's errnos; malformed framing (bad magic, an over-long
//! write payload that cannot be skipped safely) ends the connection.

use super::backend::{Backend, Errno};
use super::conn::{Conn, Reader};
use super::metrics::{Op, OpMetrics};
use super::proto::{self, *};
use flame_common::buffer::PayloadBuf;
use flame_common::clock;
use flame_common::reactor;
use std::cell::{Cell, RefCell};
use std::io;
use std::rc::Rc;
use std::task::{Poll, Waker};

/// Requests in flight per connection; the reader waits at this bound.
pub const INFLIGHT_REQUESTS_MAX: usize = 128;
/// Read/write payload bytes in flight per connection (one request may exceed it alone).
pub const INFLIGHT_BYTES_MAX: u64 = 128 << 20;
/// Unsent reply bytes above which the reader stops reading requests.
pub const SEND_QUEUE_HIGH_BYTES: usize = 64 << 20;
// What the reader lets in stays below the connection's send-queue bound, so a
// client that reads nothing is stopped by the reader, never by that bound.
const _: () = assert!(
    SEND_QUEUE_HIGH_BYTES + INFLIGHT_BYTES_MAX as usize + PAYLOAD_BYTES_MAX as usize + (1 << 20)
        < super::conn::SEND_QUEUE_BYTES_MAX
);

/// Why transmission ended the connection without a soft disconnect.
#[derive(Debug, thiserror::Error)]
pub(crate) enum TransmissionError {
    /// Socket error or the client left.
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
    /// The client broke the framing.
    #[error("protocol violation: {0}")]
    Protocol(String),
}

struct Inflight {
    count: Cell<usize>,
    bytes: Cell<u64>,
    reader: RefCell<Option<Waker>>,
}

impl Inflight {
    fn has_room(&self, bytes: u64) -> bool {
        let n = self.count.get();
        n == 0 || (n < INFLIGHT_REQUESTS_MAX && self.bytes.get() + bytes <= INFLIGHT_BYTES_MAX)
    }

    fn start(&self, bytes: u64) {
        self.count.set(self.count.get() + 1);
        self.bytes.set(self.bytes.get() + bytes);
    }

    fn finish(&self, bytes: u64) {
        self.count.set(self.count.get().saturating_sub(1));
        self.bytes.set(self.bytes.get().saturating_sub(bytes));
        if let Some(w) = self.reader.borrow_mut().take() {
            w.wake();
        }
    }

    /// Waits until `pred` holds; woken by every finishing request.
    async fn wait(&self, pred: impl Fn(&Inflight) -> bool) {
        std::future::poll_fn(|cx| {
            if pred(self) {
                return Poll::Ready(());
            }
            *self.reader.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }
}

/// State the reader and the request tasks of one connection share.
struct Session<B> {
    conn: Rc<Conn>,
    backend: Rc<B>,
    structured: bool,
    metrics: Rc<OpMetrics>,
    inflight: Inflight,
}

fn op_of(cmd: u16) -> Op {
    match cmd {
        CMD_READ => Op::Read,
        CMD_WRITE => Op::Write,
        CMD_FLUSH => Op::Flush,
        CMD_TRIM => Op::Trim,
        CMD_WRITE_ZEROES => Op::WriteZeroes,
        CMD_CACHE => Op::Cache,
        _ => Op::Other,
    }
}

/// Queues an error reply: a structured `ERROR` chunk when negotiated (the only
/// allowed form for reads), a simple reply otherwise.
fn send_error(conn: &Conn, structured: bool, cookie: u64, errno: u32, message: &str) {
    if structured {
        conn.send(&[&encode_error_chunk(cookie, errno, message)]);
    } else {
        conn.send(&[&encode_simple_reply(errno, cookie)]);
    }
}

/// Serves requests until the client disconnects. `Ok` after `NBD_CMD_DISC` once every
/// in-flight request has been answered and the replies written; the caller closes
/// the connection either way.
pub(crate) async fn serve<B: Backend + 'static>(
    conn: Rc<Conn>,
    mut rd: Reader,
    backend: Rc<B>,
    structured: bool,
    read_only: bool,
    metrics: Rc<OpMetrics>,
) -> Result<(), TransmissionError> {
    let info = SessionInfo {
        size: backend.size(),
        // The client's grant may be read-only where the backend is not.
        read_only: read_only || backend.read_only(),
        structured,
    };
    let s = Rc::new(Session {
        conn,
        backend,
        structured,
        metrics,
        inflight: Inflight {
            count: Cell::new(0),
            bytes: Cell::new(0),
            reader: RefCell::new(None),
        },
    });
    // Handles of the running requests. When the client vanishes (any error return
    // below), dropping them cancels the requests: none keeps retrying for a client
    // that is gone, where a late retry could overwrite a write the client made
    // after reconnecting, and their buffers are freed at once.
    let mut tasks: Vec<reactor::Task<()>> = Vec::new();
    loop {
        // Replies the client has not read bound what we read from it — refused
        // requests included, whose error replies also queue up.
        if s.conn.queued_bytes() > SEND_QUEUE_HIGH_BYTES {
            s.conn.wait_queue_below(SEND_QUEUE_HIGH_BYTES).await;
        }
        let mut hb = [0u8; REQUEST_LEN];
        rd.read_exact(&mut hb).await?;
        let req = decode_request(&hb).map_err(|e| TransmissionError::Protocol(e.to_string()))?;
        if super::shutdown::shutting_down() && req.cmd != CMD_DISC {
            // Stopping: refuse new work with ESHUTDOWN (the client should then
            // disconnect); requests already running finish normally.
            if req.cmd == CMD_WRITE {
                if req.len > PAYLOAD_BYTES_MAX {
                    return Err(TransmissionError::Protocol(format!(
                        "write payload of {} bytes (max {})",
                        req.len, PAYLOAD_BYTES_MAX
                    )));
                }
                rd.skip(u64::from(req.len)).await?;
            }
            send_error(
                &s.conn,
                structured,
                req.cookie,
                errno::ESHUTDOWN,
                "server is shutting down",
            );
            continue;
        }
        let cmd = match validate(&req, &info) {
            Ok(c) => c,
            Err(refusal) if req.cmd == CMD_DISC => {
                // DISC is never answered, even when malformed: treat it as a
                // disconnect request.
                tracing::debug!("DISC with bad flags: {}", refusal.message);
                break;
            }
            Err(refusal) => {
                if req.cmd == CMD_WRITE {
                    if req.len > PAYLOAD_BYTES_MAX {
                        return Err(TransmissionError::Protocol(format!(
                            "write payload of {} bytes (max {})",
                            req.len, PAYLOAD_BYTES_MAX
                        )));
                    }
                    // Keep the stream in sync: the payload follows the header.
                    rd.skip(u64::from(req.len)).await?;
                }
                tracing::debug!(
                    cmd = req.cmd,
                    offset = req.offset,
                    len = req.len,
                    "refused: {}",
                    refusal.message
                );
                send_error(
                    &s.conn,
                    structured,
                    req.cookie,
                    refusal.errno,
                    refusal.message,
                );
                s.metrics.record(op_of(req.cmd), 0, 0.0, true);
                continue;
            }
        };
        let payload_bytes = match cmd {
            Command::Disc => break,
            Command::Read { len, .. } | Command::Write { len, .. } => u64::from(len),
            _ => 0,
        };
        // Bounds: requests and bytes in flight.
        s.inflight.wait(|i| i.has_room(payload_bytes)).await;
        if s.conn.is_closed() {
            return Err(TransmissionError::Io(io::ErrorKind::BrokenPipe.into()));
        }
        // A WRITE's payload is received into the buffer that goes to the backend
        // (and on to the OSDs) as it is.
        let data = match cmd {
            Command::Write { len, .. } => rd.read_payload(len as usize).await?.freeze(),
            _ => PayloadBuf::empty(),
        };
        s.inflight.start(payload_bytes);
        tasks.push(reactor::spawn(run_request(
            s.clone(),
            req.cookie,
            cmd,
            data,
            payload_bytes,
        )));
        if tasks.len() >= TASKS_PRUNE_AT {
            tasks.retain(|t| !t.is_finished());
        }
    }
    // Soft disconnect: finish what is in flight, write the replies, then close.
    s.inflight.wait(|i| i.count.get() == 0).await;
    drop(tasks);
    s.conn.wait_queue_below(0).await;
    Ok(())
}

/// Finished request handles are pruned when this many have accumulated (twice the
/// in-flight bound keeps the vector small and the pruning rare).
const TASKS_PRUNE_AT: usize = 256;

/// Data of a successful read: its offset and its buffers (sent as they are).
type ReadData = Option<(u64, Vec<PayloadBuf>)>;

async fn run_request<B: Backend>(
    s: Rc<Session<B>>,
    cookie: u64,
    cmd: Command,
    data: PayloadBuf,
    payload_bytes: u64,
) {
    let t0 = clock::now();
    let b = &*s.backend;
    let (op, bytes, result): (Op, u64, Result<ReadData, Errno>) = match cmd {
        Command::Read { offset, len } => (
            Op::Read,
            u64::from(len),
            match b.read(offset, len).await {
                Ok(d) if total_len(&d) == len as usize => Ok(Some((offset, d))),
                Ok(d) => {
                    tracing::error!(
                        offset,
                        len,
                        got = total_len(&d),
                        "backend read returned a wrong length"
                    );
                    Err(libc::EIO)
                }
                Err(e) => Err(e),
            },
        ),
        Command::Write { offset, len, fua } => (
            Op::Write,
            u64::from(len),
            b.write(offset, data, fua).await.map(|()| None),
        ),
        Command::Flush => (Op::Flush, 0, b.flush().await.map(|()| None)),
        Command::Trim { offset, len, fua } => (
            Op::Trim,
            u64::from(len),
            b.trim(offset, len, fua).await.map(|()| None),
        ),
        Command::WriteZeroes { offset, len, fua } => (
            Op::WriteZeroes,
            u64::from(len),
            b.write_zeroes(offset, len, fua).await.map(|()| None),
        ),
        Command::Cache | Command::Disc => (Op::Cache, 0, Ok(None)),
    };
    let conn = &s.conn;
    let failed = result.is_err();
    match result {
        Ok(Some((offset, d))) => {
            let n = total_len(&d);
            if s.structured && n == 0 {
                // OFFSET_DATA may not carry zero bytes: a zero-length read is a NONE.
                conn.send(&[&encode_none_chunk(cookie)]);
            } else if s.structured {
                // Bounded by the request's length (checked above), a u32.
                let h = encode_offset_data_header(cookie, offset, n as u32);
                conn.send_with_data(&h, d);
            } else {
                conn.send_with_data(&encode_simple_reply(0, cookie), d);
            }
        }
        Ok(None) => conn.send(&[&encode_simple_reply(0, cookie)]),
        Err(e) => {
            let errno = proto::wire_errno(e);
            tracing::debug!(?op, errno = e, "backend error");
            send_error(conn, s.structured, cookie, errno, "backend I/O error");
        }
    }
    let done_bytes = if failed { 0 } else { bytes };
    s.metrics
        .record(op, done_bytes, clock::elapsed(t0).as_secs_f64(), failed);
    s.inflight.finish(payload_bytes);
}

/// Bytes in a read's buffers.
fn total_len(bufs: &[PayloadBuf]) -> usize {
    bufs.iter().map(PayloadBuf::len).sum()
}
