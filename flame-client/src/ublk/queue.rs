//! One ublk queue, served by one thread on Flame's reactor (the penetrating model).
//!
//! The thread owns one io_uring — its [`Reactor`]'s — for everything: the ublk
//! `URING_CMD`s that fetch the kernel's requests and commit their results
//! (`UBLK_U_IO_FETCH_REQ`, `UBLK_U_IO_COMMIT_AND_FETCH_REQ` on `/dev/ublkcN`) and
//! the sockets to the OSDs that serve them. A request is fetched, sent to the
//! cluster, answered and committed by this thread: no queue hand-off, no lock.
//!
//! Each of the queue's `depth` tags is one task looping fetch → serve → commit;
//! the kernel never has more than `depth` requests out per queue, which bounds
//! the work in flight. A tag owns a page-aligned buffer of `max_io_bytes`: the
//! kernel copies a WRITE's data into it before the fetch completes and a READ's
//! data out of it when the commit is submitted (no `UBLK_F_USER_COPY`, no zero
//! copy: one memcpy between that buffer and the payload buffers of the client
//! library).

use super::sys;
use crate::nbd::metrics::{Op, OpMetrics};
use crate::{ClientError, Volume};
use flame_common::buffer::PayloadBufMut;
use flame_common::reactor::{self, AlignedBuf};
use io_uring::{opcode, types};
use std::io;
use std::os::fd::RawFd;
use std::rc::Rc;

/// Size of one I/O descriptor in the queue's shared array.
const DESC_BYTES: usize = std::mem::size_of::<sys::ublksrv_io_desc>();

/// A queue's I/O descriptors, mapped read-only from the char device: the kernel
/// writes request `tag`'s descriptor at index `tag` before completing its fetch.
pub(crate) struct Descriptors {
    base: *const sys::ublksrv_io_desc,
    len: usize,
    depth: u16,
}

fn page_round(n: usize) -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    n.div_ceil(page) * page
}

impl Descriptors {
    /// Maps queue `q_id`'s descriptors of `cdev` (`/dev/ublkcN`, open).
    pub(crate) fn map(cdev: RawFd, q_id: u16, depth: u16) -> io::Result<Descriptors> {
        let len = page_round(usize::from(depth) * DESC_BYTES);
        let stride = page_round(sys::UBLK_MAX_QUEUE_DEPTH as usize * DESC_BYTES);
        let off = sys::UBLKSRV_CMD_BUF_OFFSET as usize + usize::from(q_id) * stride;
        // SAFETY: a fresh shared read-only mapping of the device's descriptor area;
        // the kernel checks the offset and length.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                cdev,
                off as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Descriptors {
            base: p as *const sys::ublksrv_io_desc,
            len,
            depth,
        })
    }

    /// Request `tag`'s descriptor (valid once its fetch completed).
    fn get(&self, tag: u16) -> sys::ublksrv_io_desc {
        assert!(tag < self.depth, "tag {tag} beyond the queue depth");
        // SAFETY: inside the mapping; the kernel wrote it before completing the
        // fetch, and it does not change until the tag is committed.
        unsafe { std::ptr::read_volatile(self.base.add(usize::from(tag))) }
    }
}

impl Drop for Descriptors {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once.
        unsafe {
            libc::munmap(self.base as *mut libc::c_void, self.len);
        }
    }
}

/// What the tasks of one queue share.
pub(crate) struct Queue {
    pub(crate) q_id: u16,
    pub(crate) cdev: RawFd,
    pub(crate) descs: Descriptors,
    pub(crate) volume: Volume,
    pub(crate) buf_bytes: usize,
    pub(crate) metrics: OpMetrics,
}

/// Submits one ublk I/O command for `tag` on the current reactor's ring, with
/// `buf` (the tag's buffer) held by the reactor until it completes.
async fn io_cmd(
    q: &Queue,
    cmd_op: u32,
    tag: u16,
    result: i32,
    mut buf: AlignedBuf,
) -> (i32, AlignedBuf) {
    let cmd = sys::ublksrv_io_cmd {
        q_id: q.q_id,
        tag,
        result,
        addr: buf.as_mut_slice().as_mut_ptr() as u64,
    };
    // SAFETY: `ublksrv_io_cmd` is 16 bytes of plain integers, the size of the
    // entry's command area.
    let bytes: [u8; 16] = unsafe { std::mem::transmute(cmd) };
    let sqe = opcode::UringCmd16::new(types::Fd(q.cdev), cmd_op)
        .cmd(bytes)
        .build();
    // SAFETY: the only memory the command names is `buf`'s, moved into the
    // reactor with it until the completion; the char device outlives the thread.
    unsafe { reactor::submit_entry(sqe, buf) }.await
}

/// Serves tag `tag` until the kernel aborts its command (the device stops, or
/// this process is replaced): fetch, serve, commit and fetch again.
pub(crate) async fn serve_tag(q: Rc<Queue>, tag: u16) -> io::Result<()> {
    let mut buf = AlignedBuf::zeroed(q.buf_bytes);
    let mut cmd_op = sys::UBLK_U_IO_FETCH_REQ;
    let mut result = 0i32;
    loop {
        let (res, back) = io_cmd(&q, cmd_op, tag, result, buf).await;
        buf = back;
        if res == sys::UBLK_IO_RES_ABORT {
            return Ok(());
        }
        if res < 0 {
            return Err(io::Error::other(format!(
                "ublk queue {} tag {tag}: {} failed: {}",
                q.q_id,
                if cmd_op == sys::UBLK_U_IO_FETCH_REQ {
                    "FETCH_REQ"
                } else {
                    "COMMIT_AND_FETCH_REQ"
                },
                io::Error::from_raw_os_error(-res)
            )));
        }
        let desc = q.descs.get(tag);
        q.metrics.connections().inc();
        result = serve(&q, &desc, buf.as_mut_slice()).await;
        q.metrics.connections().dec();
        cmd_op = sys::UBLK_U_IO_COMMIT_AND_FETCH_REQ;
    }
}

/// One request's operation, decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Request {
    pub(crate) op: u32,
    pub(crate) offset: u64,
    pub(crate) len: usize,
    pub(crate) fua: bool,
}

impl Request {
    pub(crate) fn of(desc: &sys::ublksrv_io_desc) -> Request {
        Request {
            op: desc.op_flags & 0xff,
            offset: desc.start_sector << 9,
            len: (desc.nr_sectors as usize) << 9,
            fua: desc.op_flags & sys::UBLK_IO_F_FUA != 0,
        }
    }
}

fn neg_errno(e: ClientError) -> i32 {
    tracing::debug!("volume I/O failed: {e}");
    -e.errno().max(1)
}

/// Serves one request: the result to commit (bytes transferred for reads and
/// writes, 0 for the others, a negative errno on failure).
async fn serve(q: &Queue, desc: &sys::ublksrv_io_desc, buf: &mut [u8]) -> i32 {
    let r = Request::of(desc);
    let started = flame_common::clock::Stopwatch::start();
    tracing::trace!(q = q.q_id, ?r, "request");
    let (op, res) = match r.op {
        sys::UBLK_IO_OP_READ | sys::UBLK_IO_OP_WRITE if r.len > buf.len() => {
            tracing::warn!(len = r.len, "request larger than the tag's buffer");
            (Op::Other, -libc::EINVAL)
        }
        sys::UBLK_IO_OP_READ => (Op::Read, read(&q.volume, r, &mut buf[..r.len]).await),
        sys::UBLK_IO_OP_WRITE => (Op::Write, write(&q.volume, r, &buf[..r.len]).await),
        sys::UBLK_IO_OP_FLUSH => (
            Op::Flush,
            q.volume.flush().await.map_or_else(neg_errno, |()| 0),
        ),
        sys::UBLK_IO_OP_DISCARD => (Op::Trim, discard(&q.volume, r).await),
        sys::UBLK_IO_OP_WRITE_ZEROES => (
            Op::WriteZeroes,
            q.volume
                .write_zeroes(r.offset, r.len as u64, r.fua)
                .await
                .map_or_else(neg_errno, |()| 0),
        ),
        _ => (Op::Other, -libc::EOPNOTSUPP),
    };
    tracing::trace!(q = q.q_id, ?r, res, "done");
    let bytes = if res < 0 { 0 } else { r.len as u64 };
    q.metrics
        .record(op, bytes, started.elapsed().as_secs_f64(), res < 0);
    res
}

async fn read(volume: &Volume, r: Request, out: &mut [u8]) -> i32 {
    match volume.read_bufs(r.offset, r.len).await {
        Ok(bufs) => {
            let mut at = 0;
            for b in &bufs {
                let s = b.as_slice();
                out[at..at + s.len()].copy_from_slice(s);
                at += s.len();
            }
            debug_assert_eq!(at, r.len);
            r.len as i32
        }
        Err(e) => neg_errno(e),
    }
}

async fn write(volume: &Volume, r: Request, data: &[u8]) -> i32 {
    // From the thread's registered pool, waiting while it is exhausted (the
    // kernel then waits for this tag: back-pressure).
    let mut payload = match PayloadBufMut::for_overwrite_wait(data.len()).await {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!("no payload memory for a {} B write: {e}", data.len());
            return -libc::ENOMEM;
        }
    };
    payload.as_mut_slice().copy_from_slice(data);
    match volume.write_buf(r.offset, payload.freeze(), r.fua).await {
        Ok(()) => r.len as i32,
        Err(e) => neg_errno(e),
    }
}

async fn discard(volume: &Volume, r: Request) -> i32 {
    if let Err(e) = volume.discard(r.offset, r.len as u64).await {
        return neg_errno(e);
    }
    if r.fua {
        // Discard has no FUA form; a flush makes it (and everything before) stable.
        if let Err(e) = volume.flush().await {
            return neg_errno(e);
        }
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_decode() {
        let d = sys::ublksrv_io_desc {
            op_flags: sys::UBLK_IO_OP_WRITE | sys::UBLK_IO_F_FUA,
            nr_sectors: 8,
            start_sector: 16,
            addr: 0,
        };
        assert_eq!(
            Request::of(&d),
            Request {
                op: sys::UBLK_IO_OP_WRITE,
                offset: 8192,
                len: 4096,
                fua: true
            }
        );
        assert_eq!(DESC_BYTES, 24);
        assert_eq!(std::mem::size_of::<sys::ublksrv_io_cmd>(), 16);
    }
}
