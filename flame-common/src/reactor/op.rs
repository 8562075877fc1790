//! io_uring operations as futures.
//!
//! Each operation owns the memory the kernel reads or writes (buffers, iovecs,
//! socket addresses, timespecs) until its completion arrives, even if the future is
//! dropped first: the memory then stays parked in the reactor's operation table and
//! is freed when the completion comes in. That is what makes dropping an in-flight
//! operation memory-safe.

use super::buf::{IoBuf, IoBufMut};
use super::executor::{try_with_current, with_current};
use io_uring::{opcode, squeue, types};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};

/// A submitted operation. Resolves to the raw completion result and gives back the
/// resources it held.
struct Op<R: 'static> {
    key: Option<usize>,
    _r: std::marker::PhantomData<fn() -> R>,
}

impl<R: 'static> Op<R> {
    /// Queues `sqe` (its `user_data` is set here) with `resources` kept alive until
    /// completion. The entry reaches the kernel at the reactor's next submit.
    fn submit(sqe: squeue::Entry, resources: R) -> Op<R> {
        let key = with_current(|r| r.push_op(sqe, Box::new(resources), false));
        Op {
            key: Some(key),
            _r: std::marker::PhantomData,
        }
    }

    /// Like `submit`, for operations that are cancelled in the kernel when their
    /// future is dropped (waiting has no effect worth finishing).
    fn submit_cancellable(sqe: squeue::Entry, resources: R) -> Op<R> {
        let key = with_current(|r| r.push_op(sqe, Box::new(resources), true));
        Op {
            key: Some(key),
            _r: std::marker::PhantomData,
        }
    }
}

impl<R: 'static> Future for Op<R> {
    type Output = (i32, R);

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(key) = self.key else {
            panic!("operation polled after completion");
        };
        let done = with_current(|r| r.poll_op(key, cx.waker()));
        match done {
            None => Poll::Pending,
            Some((res, resources)) => {
                self.key = None;
                // The box was created from an `R` in `submit`.
                let resources = match resources.downcast::<R>() {
                    Ok(b) => *b,
                    Err(_) => unreachable!("operation resources changed type"),
                };
                Poll::Ready((res, resources))
            }
        }
    }
}

impl<R: 'static> Drop for Op<R> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            // Still in flight: leave the memory to the reactor until completion.
            // If the reactor is gone (thread teardown) the ring is gone too, and with it
            // any kernel access to the memory.
            try_with_current(|r| r.orphan_op(key));
        }
    }
}

fn result(res: i32) -> io::Result<usize> {
    if res < 0 {
        Err(io::Error::from_raw_os_error(-res))
    } else {
        Ok(res as usize)
    }
}

/// Accepts one connection on a listening socket.
pub async fn accept(listener: RawFd) -> io::Result<OwnedFd> {
    let sqe = opcode::Accept::new(
        types::Fd(listener),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    )
    .flags(libc::SOCK_CLOEXEC)
    .build();
    let (res, ()) = Op::submit_cancellable(sqe, ()).await;
    let fd = result(res)?;
    // The kernel handed us a fresh descriptor we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Connects a socket (created non-connected by the caller) to `addr`.
pub async fn connect(fd: RawFd, addr: SocketAddr) -> io::Result<()> {
    let (storage, len) = sockaddr_of(addr);
    let storage = Box::new(storage);
    let sqe = opcode::Connect::new(
        types::Fd(fd),
        &*storage as *const libc::sockaddr_storage as *const libc::sockaddr,
        len,
    )
    .build();
    let (res, _storage) = Op::submit_cancellable(sqe, storage).await;
    result(res).map(|_| ())
}

fn sockaddr_of(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is a valid value.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in, sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: a.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: a.scope_id(),
            };
            // SAFETY: as above, for sockaddr_in6.
            unsafe { std::ptr::write(&mut storage as *mut _ as *mut libc::sockaddr_in6, sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// Receives into `buf[start..]`; returns the byte count (0 = peer closed) and the
/// buffer. Any [`IoBufMut`] serves: a connection's receive buffer, or a payload
/// buffer a large payload is received straight into.
pub async fn recv<B: IoBufMut>(fd: RawFd, buf: B, start: usize) -> (io::Result<usize>, B) {
    let end = buf.len();
    recv_range(fd, buf, start, end).await
}

/// Receives into `buf[start..end]` only: a reader that must not consume bytes past
/// a point of the stream (the payload after a header, meant for its own buffer).
pub async fn recv_range<B: IoBufMut>(
    fd: RawFd,
    mut buf: B,
    start: usize,
    end: usize,
) -> (io::Result<usize>, B) {
    assert!(
        start <= end && end <= buf.len(),
        "recv range {start}..{end} beyond a {}-byte buffer",
        buf.len()
    );
    let len = (end - start).min(u32::MAX as usize) as u32;
    let ptr = buf.as_mut_ptr().wrapping_add(start);
    let sqe = opcode::Recv::new(types::Fd(fd), ptr, len).build();
    let (res, buf) = Op::submit_cancellable(sqe, buf).await;
    (result(res), buf)
}

/// Sends `buf[start..]`; returns the byte count sent (may be short) and the buffer.
pub async fn send(fd: RawFd, buf: Vec<u8>, start: usize) -> (io::Result<usize>, Vec<u8>) {
    assert!(start <= buf.len(), "send start beyond buffer");
    let len = (buf.len() - start).min(u32::MAX as usize) as u32;
    let ptr = buf[start..].as_ptr();
    let sqe = opcode::Send::new(types::Fd(fd), ptr, len)
        .flags(libc::MSG_NOSIGNAL)
        .build();
    let (res, buf) = Op::submit(sqe, buf).await;
    (result(res), buf)
}

/// Writes several buffers with one `writev`, skipping the first `skip` bytes of the
/// concatenation (for resuming after a short write). Returns bytes written and the
/// buffers. Any [`IoBuf`] serves: byte vectors, or shared payload buffers that a
/// send queue holds by reference instead of copying.
pub async fn writev<B: IoBuf>(fd: RawFd, bufs: Vec<B>, skip: usize) -> (io::Result<usize>, Vec<B>) {
    let mut iovecs: Vec<libc::iovec> = Vec::with_capacity(bufs.len());
    let mut to_skip = skip;
    for b in &bufs {
        let len = b.len();
        if to_skip >= len {
            to_skip -= len;
            continue;
        }
        iovecs.push(libc::iovec {
            iov_base: b.as_ptr().wrapping_add(to_skip) as *mut libc::c_void,
            iov_len: len - to_skip,
        });
        to_skip = 0;
    }
    if iovecs.is_empty() {
        return (Ok(0), bufs);
    }
    // IOV_MAX bounds one call; the caller loops on short writes anyway.
    iovecs.truncate(1024);
    let sqe = opcode::Writev::new(types::Fd(fd), iovecs.as_ptr(), iovecs.len() as u32).build();
    let (res, (bufs, _iovecs)) = Op::submit(sqe, (bufs, iovecs)).await;
    (result(res), bufs)
}

/// Writes all of `bufs` (in order), resuming after short writes. A zero-byte write
/// (peer gone) is an error. Returns the buffers for reuse.
pub async fn writev_all<B: IoBuf>(fd: RawFd, mut bufs: Vec<B>) -> io::Result<Vec<B>> {
    let total: usize = bufs.iter().map(IoBuf::len).sum();
    let mut done = 0;
    // Bounded: every round writes at least one byte or returns.
    while done < total {
        let (res, back) = writev(fd, bufs, done).await;
        bufs = back;
        match res {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "peer accepted no bytes",
                ));
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(bufs)
}

/// Reads `buf.len()` bytes at `offset` of a file into `buf`; returns the count read
/// (short at end of file).
pub async fn read_at<B: IoBufMut>(fd: RawFd, mut buf: B, offset: u64) -> (io::Result<usize>, B) {
    let len = buf.len().min(u32::MAX as usize) as u32;
    let ptr = buf.as_mut_ptr();
    let sqe = match with_current(|r| r.fixed_index(ptr as usize, len as usize)) {
        Some(index) => opcode::ReadFixed::new(types::Fd(fd), ptr, len, index)
            .offset(offset)
            .build(),
        None => opcode::Read::new(types::Fd(fd), ptr, len)
            .offset(offset)
            .build(),
    };
    let (res, buf) = Op::submit(sqe, buf).await;
    (result(res), buf)
}

/// Writes `buf` at `offset` of a file; returns the count written. With `dsync` the
/// write is on stable storage when it completes (`RWF_DSYNC`, the FUA of files).
pub async fn write_at<B: IoBuf>(
    fd: RawFd,
    buf: B,
    offset: u64,
    dsync: bool,
) -> (io::Result<usize>, B) {
    let len = buf.len().min(u32::MAX as usize) as u32;
    let ptr = buf.as_ptr();
    let flags = if dsync { libc::RWF_DSYNC } else { 0 };
    let sqe = match with_current(|r| r.fixed_index(ptr as usize, len as usize)) {
        Some(index) => opcode::WriteFixed::new(types::Fd(fd), ptr, len, index)
            .offset(offset)
            .rw_flags(flags)
            .build(),
        None => opcode::Write::new(types::Fd(fd), ptr, len)
            .offset(offset)
            .rw_flags(flags)
            .build(),
    };
    let (res, buf) = Op::submit(sqe, buf).await;
    (result(res), buf)
}

/// `fdatasync` (or `fsync` when `data_only` is false) through the ring.
pub async fn fsync(fd: RawFd, data_only: bool) -> io::Result<()> {
    let mut op = opcode::Fsync::new(types::Fd(fd));
    if data_only {
        op = op.flags(types::FsyncFlags::DATASYNC);
    }
    let (res, ()) = Op::submit(op.build(), ()).await;
    result(res).map(|_| ())
}

/// `fallocate(fd, mode, offset, len)` through the ring (used to punch holes).
pub async fn fallocate(fd: RawFd, mode: i32, offset: u64, len: u64) -> io::Result<()> {
    let sqe = opcode::Fallocate::new(types::Fd(fd), len)
        .offset(offset)
        .mode(mode)
        .build();
    let (res, ()) = Op::submit(sqe, ()).await;
    result(res).map(|_| ())
}

/// Closes a descriptor through the ring.
pub async fn close(fd: OwnedFd) -> io::Result<()> {
    use std::os::fd::IntoRawFd;
    let raw = fd.into_raw_fd();
    let (res, ()) = Op::submit(opcode::Close::new(types::Fd(raw)).build(), ()).await;
    result(res).map(|_| ())
}

/// A path as a C string the kernel can read, or `InvalidInput` for a path with a
/// NUL byte.
fn c_path(path: &std::path::Path) -> io::Result<std::ffi::CString> {
    use std::os::unix::ffi::OsStrExt;
    std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "path contains a NUL byte"))
}

/// `openat(AT_FDCWD, path, flags | O_CLOEXEC, mode)` through the ring, so a path
/// lookup that has to read a directory from disk blocks a kernel worker, not the
/// calling thread.
pub async fn open(path: &std::path::Path, flags: i32, mode: u32) -> io::Result<OwnedFd> {
    let c = Box::new(c_path(path)?);
    let sqe = opcode::OpenAt::new(types::Fd(libc::AT_FDCWD), c.as_ptr())
        .flags(flags | libc::O_CLOEXEC)
        .mode(mode as libc::mode_t)
        .build();
    let (res, _c) = Op::submit(sqe, c).await;
    let fd = result(res)?;
    // SAFETY: the kernel handed us a fresh descriptor we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// `mkdirat(AT_FDCWD, path, mode)` through the ring. An existing directory is
/// `AlreadyExists`.
pub async fn mkdir(path: &std::path::Path, mode: u32) -> io::Result<()> {
    let c = Box::new(c_path(path)?);
    let sqe = opcode::MkDirAt::new(types::Fd(libc::AT_FDCWD), c.as_ptr())
        .mode(mode as libc::mode_t)
        .build();
    let (res, _c) = Op::submit(sqe, c).await;
    result(res).map(|_| ())
}

/// `unlinkat(AT_FDCWD, path, 0)` (or `AT_REMOVEDIR` with `dir`) through the ring.
pub async fn unlink(path: &std::path::Path, dir: bool) -> io::Result<()> {
    let c = Box::new(c_path(path)?);
    let sqe = opcode::UnlinkAt::new(types::Fd(libc::AT_FDCWD), c.as_ptr())
        .flags(if dir { libc::AT_REMOVEDIR } else { 0 })
        .build();
    let (res, _c) = Op::submit(sqe, c).await;
    result(res).map(|_| ())
}

/// Size in bytes of an open file (`statx` on the descriptor through the ring).
pub async fn file_size(fd: RawFd) -> io::Result<u64> {
    let empty = Box::new(std::ffi::CString::default());
    // SAFETY: statx is plain old data; all-zero is a valid value.
    let buf: Box<libc::statx> = Box::new(unsafe { std::mem::zeroed() });
    let sqe = opcode::Statx::new(
        types::Fd(fd),
        empty.as_ptr(),
        &*buf as *const libc::statx as *mut types::statx,
    )
    .flags(libc::AT_EMPTY_PATH)
    .mask(libc::STATX_SIZE)
    .build();
    let (res, (_empty, buf)) = Op::submit(sqe, (empty, buf)).await;
    result(res)?;
    Ok(buf.stx_size)
}

/// Waits until `fd` is readable (or has hung up / failed: `POLLIN | POLLHUP |
/// POLLERR`), returning the ready events. Cancelled when dropped, and it consumes
/// nothing, so racing it against another wait loses no data: the shared-memory
/// transport waits this way for a listener's connections, for descriptors passed
/// with `SCM_RIGHTS` (which a plain `recv` would discard) and for a peer's Unix
/// socket to close.
pub async fn poll_readable(fd: RawFd) -> io::Result<u32> {
    let sqe = opcode::PollAdd::new(types::Fd(fd), (libc::POLLIN | libc::POLLRDHUP) as u32).build();
    let (res, ()) = Op::submit_cancellable(sqe, ()).await;
    result(res).map(|e| e as u32)
}

/// Submits an entry the caller built (an operation this module has no function
/// for: flame-ublk's `URING_CMD`s to a ublk queue) on the current reactor's ring,
/// resolving to the completion's raw result (a negative errno on failure) and
/// giving `resources` back. The entry's `user_data` is overwritten.
///
/// Dropping the future before completion leaves `resources` parked in the
/// reactor until the kernel completes the entry, as for every operation here.
///
/// # Safety
///
/// Every piece of memory the entry points at must be owned by `resources` (moved
/// into the reactor with it) or outlive the operation, and the entry must not
/// need a ring set-up this reactor does not have (e.g. 128-byte entries).
pub unsafe fn submit_entry<R: 'static>(
    sqe: squeue::Entry,
    resources: R,
) -> impl Future<Output = (i32, R)> {
    Op::submit(sqe, resources)
}

/// Waits until the eventfd `fd` is written, consuming its count. The read is
/// cancelled in the kernel when the future is dropped (the source it belongs to
/// was removed), so a doorbell never holds a slot past its source.
pub(crate) async fn doorbell_wait(fd: RawFd) -> io::Result<u64> {
    let buf = Box::new(0u64);
    let ptr = &*buf as *const u64 as *mut u8;
    // Offset -1: "current position", the only meaning a counter has.
    let sqe = opcode::Read::new(types::Fd(fd), ptr, 8)
        .offset(u64::MAX)
        .build();
    let (res, buf) = Op::submit_cancellable(sqe, buf).await;
    result(res).map(|_| *buf)
}
