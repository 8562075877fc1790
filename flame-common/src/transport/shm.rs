//! Shared-memory transport for peers on the same host.
//!
//! # Connecting
//! An OSD shard listening on `ip:port` with `transport: shm` also listens on the
//! Unix socket `ip:port` (`any:port` when it listens on every address) in its
//! user's socket directory ([`socket_dir`]: `$FLAME_SHM_DIR`, else
//! `/tmp/flame-shm-<uid>`), a directory of mode 0700 owned by that user: no other
//! user can bind a listener's name before it (and so make its clients fall back
//! to TCP) or connect to it. A client looks in its own user's directory, so it
//! reaches the socket exactly when it runs as the same user on the same host;
//! otherwise the connect fails at once and the connection falls back to TCP. A
//! directory that is not a directory, is a symbolic link, is not the user's own or
//! is open to others is refused (the listener does not start, the client uses
//! TCP), with an error that names it. Both sides also check the other's user
//! (`SO_PEERCRED`) before sending anything: only the same user (or root) may share
//! memory. Received doorbells must be eventfds.
//!
//! Handshake: each side sends a hello (magic, version, layout, its segment's
//! address, and the address and length of up to [`REGIONS_MAX`] registered pool
//! regions) and, with `SCM_RIGHTS`, its segment (a memfd), two eventfds (its data
//! and space doorbells) and the regions' memfds. Each maps the other's segment and
//! regions, after checking that each memfd is sealed against shrinking and large
//! enough (a file that shrank under a mapping would fault, SIGBUS, and kill us).
//! The Unix socket then stays open and silent: its closing is how each side learns
//! that the other died, whenever and however (kill -9 included).
//!
//! # A segment (one per side, [`SEGMENT_BYTES`])
//! * control block: the producer index of the ring of messages *to* this side
//!   (written by the peer), its consumer index (written by this side), and two
//!   needs-wakeup flags;
//! * grant table: [`GRANT_SLOTS`] slots `{seq, access, key, len, addr}` written by
//!   this side, read by the peer before every one-sided access;
//! * ring: messages to this side, records `[u32 len][u32 kind][header][payload]`
//!   padded to 64 bytes; a pad record skips to the ring's end;
//! * staging: memory this side grants from when a buffer is not in a shared pool
//!   region (heap buffers, another thread's pool): the buffer is copied here, or
//!   copied back from here.
//!
//! # Shared pool regions: grants without a copy
//! The registered pool's regions ([`crate::buffer::registered`]) are memfds too,
//! and each side shares the regions it allocates from at the handshake. A grant of
//! a buffer that lies in one ([`PayloadBuf::location`]) publishes the buffer's own
//! address: the peer's one-sided READ or WRITE copies straight between its buffer
//! and ours, so a converted 1 MiB write costs one copy (client buffer → OSD buffer)
//! instead of two through the ring (client → ring → OSD). A write grant revoked
//! before the peer said it was done (a timeout, a closed request) keeps its buffer
//! out of circulation for [`QUARANTINE`]: a peer whose copy was already under way
//! must land in memory nobody else uses yet.
//!
//! # Data path
//! `send` copies the header and payload into the peer's ring and publishes the
//! producer index; it writes the peer's data eventfd only if the peer said it is
//! going to sleep (the needs-wakeup flag, Dekker-style with SeqCst fences on both
//! sides), so a receiver that is polling costs the sender no system call. `recv`
//! copies the payload out into a [`PayloadBufMut`] and validates the whole message
//! exactly as from a socket: the peer can scribble on shared memory at any time,
//! so nothing read from it is trusted before it is copied and checked.
//!
//! One-sided READ/WRITE are `memcpy`s by the initiator from or to the peer's
//! staging memory after checking the peer's grant table (key, access kind, bounds,
//! and that the grant did not change during the copy); the peer's CPU is not
//! involved. A failed check closes the connection.
//!
//! # Trust
//! The protection boundary is the segment: a peer process can read and write all of
//! the segment it was given (that is how shared memory works), never anything else
//! of this process. Grants, keys and bounds protect against buggy peers and stale
//! descriptors; against a malicious process of the same user they add nothing the
//! kernel does not already give it (it could ptrace us). That is why the listener
//! only accepts its own user.

use super::TransportError;
use super::grant::{
    Grant, GrantOwner, Refusal, SharedArea, WriteGrant, check_bounds, check_grant_len, random_key,
};
use super::receive::{Abandoned, Ending, Receiver};
use super::send_queue::{Backlog, PushRefused, SendQueue, WriterEnd};
use crate::buffer::registered::{self, RegionInfo};
use crate::buffer::{PayloadBuf, PayloadBufMut};
use crate::protocol::{
    HEADER_LEN, HEADER_PREFIX_LEN, Header, Message, PAYLOAD_BYTES_MAX, ProtocolError, RemoteBuf,
};
use crate::reactor;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

/// Bytes of the control block.
const CONTROL_BYTES: usize = 4096;
/// Grant slots per segment (a power of two: a key's low bits pick its slot).
pub const GRANT_SLOTS: usize = 4096;
const SLOT_BYTES: usize = 32;
const GRANTS_OFF: usize = CONTROL_BYTES;
const RING_OFF: usize = GRANTS_OFF + GRANT_SLOTS * SLOT_BYTES;
/// Record alignment in the ring.
const RECORD_ALIGN: usize = 64;
const RECORD_PREFIX: usize = 8;
/// The largest record: a header and the largest payload.
const RECORD_BYTES_MAX: usize =
    (RECORD_PREFIX + HEADER_LEN + PAYLOAD_BYTES_MAX as usize).next_multiple_of(RECORD_ALIGN);
/// Bytes of each ring: at least two of the largest records, so a record always
/// fits once the ring drains (either before or after the wrap point).
pub const RING_BYTES: usize = 2 * RECORD_BYTES_MAX + (64 << 10);
const STAGING_OFF: usize = RING_OFF + RING_BYTES;
/// Bytes of staging memory per side for grants.
pub const STAGING_BYTES: usize = 16 << 20;
/// Staging allocation unit (grants start 4 KiB-aligned, like payload buffers).
const STAGING_UNIT: usize = 4096;
/// Size of each side's memfd segment.
pub const SEGMENT_BYTES: usize = STAGING_OFF + STAGING_BYTES;

// Control block fields (byte offsets; each on its own cache line).
const CTL_MAGIC: usize = 0;
const CTL_PROD: usize = 64;
const CTL_CONS: usize = 128;
const CTL_DATA_WAIT: usize = 192;
const CTL_SPACE_WAIT: usize = 256;

const RECORD_MESSAGE: u32 = 1;
const RECORD_PAD: u32 = 2;
const ACCESS_READ: u32 = 1;
const ACCESS_WRITE: u32 = 2;

const HELLO_MAGIC: u64 = u64::from_le_bytes(*b"FLSHM\0v2");
/// Registered pool regions one side shares at most (a bound on what a hello may
/// make the peer map; a process has one region per data-path thread).
pub const REGIONS_MAX: usize = 8;
const HELLO_FIXED_BYTES: usize = 64;
const HELLO_REGION_BYTES: usize = 16;
const HELLO_BYTES: usize = HELLO_FIXED_BYTES + REGIONS_MAX * HELLO_REGION_BYTES;
/// Descriptors in a hello besides the regions': segment, data and space eventfds.
const HELLO_FDS: usize = 3;
/// Largest region a peer may ask us to map: the pool's own bound.
const REGION_BYTES_MAX: u64 = crate::buffer::registered::BYTES_PER_THREAD_MAX;
/// Address space all peers' regions may take in this process together (1 TiB of
/// the 128 TiB a process has; a dev cluster maps a few GiB). Beyond it a handshake
/// is refused (the connection falls back to tcp): many connections from peers with
/// large pools must not exhaust our address space or map count.
const PEER_REGION_BYTES_MAX: u64 = 1 << 40;
/// Address space currently mapped for peers' regions.
static PEER_REGION_BYTES: AtomicU64 = AtomicU64::new(0);
/// How long a write grant revoked early keeps its memory out of circulation (see
/// the module docs). A peer's copy is check → memcpy (≤ 4 MiB, well under a
/// millisecond) → check; a second covers a peer preempted in the middle.
pub const QUARANTINE: Duration = Duration::from_secs(1);
/// Bound on early-revoked grants kept in quarantine per connection; beyond it the
/// oldest is released early (logged).
const QUARANTINE_ENTRIES_MAX: usize = 1024;
/// How long a handshake may take before the connect falls back to TCP (client) or
/// the accept gives up on that peer (listener).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

/// The directory of this user's shm sockets: `$FLAME_SHM_DIR` if set, else
/// `/tmp/flame-shm-<euid>`. Listener and client find each other through it, so
/// both must see the same one (a service with a private /tmp, such as systemd's
/// `PrivateTmp=`, needs `FLAME_SHM_DIR` set for it and its clients).
pub fn socket_dir() -> PathBuf {
    match std::env::var_os("FLAME_SHM_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        // SAFETY: plain syscall.
        _ => PathBuf::from(format!("/tmp/flame-shm-{}", unsafe { libc::geteuid() })),
    }
}

/// Checks that `dir` is a directory (not a symbolic link) owned by this process's
/// user with mode 0700 — nobody else can create, replace or reach a socket in it.
/// With `create`, makes it first if it does not exist.
fn check_socket_dir(dir: &Path, create: bool) -> io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    if create {
        match std::fs::DirBuilder::new().mode(0o700).create(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("shm socket directory {}: {e}", dir.display()),
                ));
            }
        }
    }
    let md = std::fs::symlink_metadata(dir)?;
    // SAFETY: plain syscall.
    let me = unsafe { libc::geteuid() };
    let mode = md.mode() & 0o7777;
    if !md.is_dir() || md.uid() != me || mode != 0o700 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "shm socket directory {} must be a directory of mode 0700 owned by uid {me} \
                 (it is {}, mode {mode:04o}, owned by uid {}): remove it, or set FLAME_SHM_DIR",
                dir.display(),
                if md.is_symlink() {
                    "a symbolic link"
                } else if md.is_dir() {
                    "a directory"
                } else {
                    "not a directory"
                },
                md.uid()
            ),
        ));
    }
    Ok(())
}

/// The socket of a listener on `addr` in this user's socket directory (what a
/// client tries first; tests connect raw sockets to it).
pub fn listener_socket_path(addr: SocketAddr) -> PathBuf {
    socket_path(&socket_dir(), addr)
}

/// The socket of a listener on `addr` in `dir`.
fn socket_path(dir: &Path, addr: SocketAddr) -> PathBuf {
    if addr.ip().is_unspecified() {
        dir.join(format!("any:{}", addr.port()))
    } else {
        dir.join(addr.to_string())
    }
}

/// A memfd-backed mapping of one segment.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn map(fd: RawFd, len: usize) -> io::Result<Mapping> {
        // SAFETY: a fresh shared mapping of a file we hold; checked for failure.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Mapping { ptr: p.cast(), len })
    }

    fn base(&self) -> u64 {
        self.ptr as u64
    }

    /// An atomic u64 at `off` (8-aligned, inside the control block).
    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off.is_multiple_of(8) && off + 8 <= self.len);
        // SAFETY: in bounds, aligned, and the mapping lives as long as `self`.
        unsafe { &*(self.ptr.add(off) as *const AtomicU64) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off.is_multiple_of(4) && off + 4 <= self.len);
        // SAFETY: as above.
        unsafe { &*(self.ptr.add(off) as *const AtomicU32) }
    }

    /// Copies `dst.len()` bytes from `off` (bounds checked by the caller).
    fn read(&self, off: usize, dst: &mut [u8]) {
        assert!(off + dst.len() <= self.len, "shm read out of the mapping");
        // SAFETY: in bounds; the peer may write concurrently, which only makes the
        // bytes garbage, which every reader validates.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(off), dst.as_mut_ptr(), dst.len()) }
    }

    fn write(&self, off: usize, src: &[u8]) {
        assert!(off + src.len() <= self.len, "shm write out of the mapping");
        // SAFETY: in bounds.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(off), src.len()) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: mapped in `map` with this length.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn ring_doorbell(fd: RawFd) {
    let one: u64 = 1;
    // SAFETY: writing 8 bytes from a valid u64; an error (counter overflow, closed
    // peer) only loses a wake-up the close path makes up for.
    let _ = unsafe { libc::write(fd, (&one as *const u64).cast(), 8) };
}

/// This side's segment: its memfd, mapping and doorbells, and the staging memory
/// allocator.
struct Local {
    memfd: OwnedFd,
    map: Mapping,
    /// The doorbell the peer rings (new messages, and room freed in its ring)
    /// while this thread sleeps; shared with the reactor's poll source, which keeps
    /// a read posted on it.
    data_efd: Rc<OwnedFd>,
    /// Sent in the handshake for layout compatibility; unused since waits go
    /// through the reactor's poll source and one doorbell.
    space_efd: OwnedFd,
    /// Free staging extents: offset (from STAGING_OFF) → length, coalesced.
    free: RefCell<BTreeMap<usize, usize>>,
    /// Live grants: slot → what backs it.
    grants: RefCell<crate::collections::HashMap<usize, Backing>>,
    /// The pool regions shared with the peer (their memfds stay open while the
    /// connection lives; the peer maps them by address).
    shared: Vec<RegionInfo>,
    /// Memory of write grants revoked before the peer finished, until
    /// [`QUARANTINE`] has passed.
    quarantine: RefCell<VecDeque<(Instant, Backing)>>,
}

/// What a grant's bytes are.
enum Backing {
    /// Staging memory of this side's segment: offset from `STAGING_OFF`, length.
    Staging { off: usize, len: usize, write: bool },
    /// A payload buffer in a shared region, read by the peer in place (held so the
    /// memory is not reused while granted).
    InPlaceRead { _held: PayloadBuf },
    /// A payload buffer in a shared region, written by the peer in place (shared
    /// with the [`WriteGrant`]).
    InPlaceWrite { _held: Rc<RefCell<PayloadBufMut>> },
}

impl Local {
    fn new() -> io::Result<Local> {
        // SAFETY: plain syscall with a NUL-terminated name; result checked.
        let fd = unsafe {
            libc::memfd_create(
                c"flame-shm".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor we own.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain syscall on our descriptor.
        if unsafe { libc::ftruncate(memfd.as_raw_fd(), SEGMENT_BYTES as libc::off_t) } < 0 {
            return Err(io::Error::last_os_error());
        }
        registered::seal_size(memfd.as_raw_fd())?;
        let map = Mapping::map(memfd.as_raw_fd(), SEGMENT_BYTES)?;
        map.u64_at(CTL_MAGIC).store(HELLO_MAGIC, Ordering::Relaxed);
        let mut free = BTreeMap::new();
        free.insert(0, STAGING_BYTES);
        Ok(Local {
            memfd,
            map,
            data_efd: Rc::new(eventfd()?),
            space_efd: eventfd()?,
            free: RefCell::new(free),
            grants: RefCell::new(crate::collections::HashMap::default()),
            shared: shared_regions(),
            quarantine: RefCell::new(VecDeque::new()),
        })
    }

    /// This side's address of `buf`'s bytes when they lie in a region the peer
    /// has mapped.
    fn shared_addr(&self, location: Option<(u32, u64)>, len: usize) -> Option<u64> {
        let (id, off) = location?;
        let r = self.shared.iter().find(|r| r.id == id)?;
        let end = off.checked_add(len as u64)?;
        (end <= r.len as u64).then_some(r.base as u64 + off)
    }

    /// Gives back what a grant held, now or (an early-revoked write grant) after
    /// the quarantine.
    fn release_backing(&self, b: Backing, early_write: bool) {
        if early_write {
            let mut q = self.quarantine.borrow_mut();
            if q.len() >= QUARANTINE_ENTRIES_MAX
                && let Some((_, old)) = q.pop_front()
            {
                tracing::warn!("shm grant quarantine full: releasing the oldest early");
                self.release_now(old);
            }
            q.push_back((crate::clock::now(), b));
            return;
        }
        self.release_now(b);
    }

    fn release_now(&self, b: Backing) {
        if let Backing::Staging { off, len, .. } = b {
            self.release(off, len);
        }
    }

    /// Releases quarantined memory whose time has come.
    fn expire_quarantine(&self) {
        loop {
            let mut q = self.quarantine.borrow_mut();
            match q.front() {
                Some((at, _)) if crate::clock::elapsed(*at) >= QUARANTINE => {
                    let Some((_, b)) = q.pop_front() else { return };
                    drop(q);
                    self.release_now(b);
                }
                _ => return,
            }
        }
    }

    fn alloc(&self, len: usize) -> Option<usize> {
        let len = len.next_multiple_of(STAGING_UNIT);
        let mut free = self.free.borrow_mut();
        let (&off, &have) = free.iter().find(|&(_, &l)| l >= len)?;
        free.remove(&off);
        if have > len {
            free.insert(off + len, have - len);
        }
        Some(off)
    }

    fn release(&self, off: usize, len: usize) {
        let mut len = len.next_multiple_of(STAGING_UNIT);
        let mut off = off;
        let mut free = self.free.borrow_mut();
        if let Some((&next, &nlen)) = free.range(off + len..).next()
            && next == off + len
        {
            free.remove(&next);
            len += nlen;
        }
        if let Some((&prev, &plen)) = free.range(..off).next_back()
            && prev + plen == off
        {
            free.remove(&prev);
            off = prev;
            len += plen;
        }
        free.insert(off, len);
    }

    fn slot_off(slot: usize) -> usize {
        GRANTS_OFF + slot * SLOT_BYTES
    }

    /// Publishes a grant in the table (seqlock: odd while changing).
    fn publish(&self, slot: usize, key: u32, access: u32, addr: u64, len: u32) {
        let o = Local::slot_off(slot);
        let seq = self.map.u32_at(o);
        let s = seq.load(Ordering::Relaxed);
        seq.store(s | 1, Ordering::Relaxed);
        fence(Ordering::Release);
        self.map.u32_at(o + 4).store(access, Ordering::Relaxed);
        self.map.u32_at(o + 8).store(key, Ordering::Relaxed);
        self.map.u32_at(o + 12).store(len, Ordering::Relaxed);
        self.map.u64_at(o + 16).store(addr, Ordering::Relaxed);
        seq.store((s | 1).wrapping_add(1), Ordering::Release);
    }

    fn unpublish(&self, slot: usize) {
        self.publish(slot, 0, 0, 0, 0);
    }
}

/// One of the peer's pool regions as mapped here.
struct RemoteRegion {
    /// The peer's address of its first byte (grant addresses are in its space).
    base: u64,
    len: u64,
    map: Arc<PeerMapping>,
}

/// A peer region's memfd mapped once in this process and shared by every
/// connection to that peer (a flame-nbd thread connects to every shard of every
/// local OSD, and each OSD process shares the same regions with all of them: one
/// mapping per connection would multiply address space and map count by the
/// number of connections).
struct PeerMapping {
    map: Mapping,
    len: u64,
}

// SAFETY: plain shared memory, mapped for the value's life; every access is a copy
// bounded by a grant check, from whichever thread holds a connection.
unsafe impl Send for PeerMapping {}
// SAFETY: as above.
unsafe impl Sync for PeerMapping {}

impl Drop for PeerMapping {
    fn drop(&mut self) {
        PEER_REGION_BYTES.fetch_sub(self.len, Ordering::Relaxed);
    }
}

/// Live peer mappings by the memfd's identity (device, inode) and length. An
/// inode cannot be reused while a mapping of it lives, so an entry that upgrades
/// is the same memory. Only handshakes touch it.
type PeerMappings = crate::collections::HashMap<(u64, u64, u64), std::sync::Weak<PeerMapping>>;

fn peer_mappings() -> &'static std::sync::Mutex<PeerMappings> {
    static MAPPINGS: std::sync::OnceLock<std::sync::Mutex<PeerMappings>> =
        std::sync::OnceLock::new();
    MAPPINGS.get_or_init(Default::default)
}

/// Maps the peer region `fd` of `len` bytes, or shares the mapping another
/// connection already made of it.
fn map_peer_region(fd: RawFd, len: u64) -> io::Result<Arc<PeerMapping>> {
    // SAFETY: stat is plain data; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: plain syscall on a descriptor the caller owns.
    if unsafe { libc::fstat(fd, &mut st) } < 0 {
        return Err(io::Error::last_os_error());
    }
    let key = (st.st_dev, st.st_ino, len);
    let mut all = peer_mappings().lock().unwrap_or_else(|e| e.into_inner());
    if let Some(m) = all.get(&key).and_then(std::sync::Weak::upgrade) {
        return Ok(m);
    }
    // Bounded: the table holds at most one entry per live mapping plus the dead
    // ones dropped here.
    all.retain(|_, w| w.strong_count() > 0);
    if !reserve_peer_bytes(len) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "shm hello: peers' regions would exceed this process's mapping budget",
        ));
    }
    let map = match Mapping::map(fd, len as usize) {
        Ok(m) => m,
        Err(e) => {
            PEER_REGION_BYTES.fetch_sub(len, Ordering::Relaxed);
            return Err(e);
        }
    };
    let m = Arc::new(PeerMapping { map, len });
    all.insert(key, Arc::downgrade(&m));
    Ok(m)
}

/// Reserves `len` bytes of the peers' mapping budget; false when it is spent.
fn reserve_peer_bytes(len: u64) -> bool {
    let before = PEER_REGION_BYTES.fetch_add(len, Ordering::Relaxed);
    if before.saturating_add(len) > PEER_REGION_BYTES_MAX {
        PEER_REGION_BYTES.fetch_sub(len, Ordering::Relaxed);
        return false;
    }
    true
}

/// The regions this thread allocates from first, then the process's others, at
/// most [`REGIONS_MAX`]: what a new connection shares with its peer.
fn shared_regions() -> Vec<RegionInfo> {
    let mut out = registered::thread_regions();
    for r in registered::regions() {
        if out.len() >= REGIONS_MAX {
            break;
        }
        if !out.iter().any(|o| o.id == r.id) {
            out.push(r);
        }
    }
    out.truncate(REGIONS_MAX);
    out
}

/// The peer's segment as mapped here, and its doorbells.
struct Remote {
    map: Mapping,
    /// The peer's shared pool regions.
    regions: Vec<RemoteRegion>,
    /// The peer's address of its segment (grant addresses are in its space).
    base: u64,
    data_efd: OwnedFd,
    /// The peer's space eventfd (handshake layout); unused, see `Local::space_efd`.
    _space_efd: OwnedFd,
}

/// What waits for room in the peer's ring ([`SendQueue`]'s backlog).
#[derive(Default)]
struct RingBacklog {
    /// Messages that did not fit the peer's ring yet, in order: header (+ inline
    /// body) bytes and the payload by reference, one record each.
    records: VecDeque<(Vec<u8>, Option<PayloadBuf>)>,
    /// Bytes ever put into the backlog, and ever moved from it into the ring:
    /// the stall marks' batches are counted in these.
    in_total: u64,
    out_total: u64,
    /// While the backlog drains: the `in_total` that ends the current batch
    /// (everything queued when it began), for [`ShmConn::stall`].
    batch_end: Option<u64>,
}

impl Backlog for RingBacklog {
    fn is_empty(&self) -> bool {
        self.records.is_empty()
    }
}

/// One shared-memory connection owned by the current reactor thread.
pub struct ShmConn {
    local: Local,
    remote: Remote,
    sock: UnixStream,
    peer: SocketAddr,
    /// Producer position in the peer's ring (only this side produces there; the
    /// copy in shared memory is never read back).
    prod: Cell<u64>,
    /// Consumer position in this side's ring (likewise).
    cons: Cell<u64>,
    /// The peer's consumer position last seen (it must never go backwards).
    peer_cons: Cell<u64>,
    /// Messages waiting for room in the peer's ring, the close state, and what
    /// the connection waits on, for the owner's stall watchdog
    /// ([`crate::transport::stall`]): a backlog the peer does not make room
    /// for (progress counted per batch, everything backlogged when the wait
    /// began, so a peer that takes a record now and then still counts as not
    /// reading), and messages in and out for idleness. A message is always
    /// whole in the ring, so there is no payload receive stall.
    tx: SendQueue<RingBacklog>,
    /// The one receive at a time ([`super::receive`]); a record is taken
    /// from the ring whole, so an abandoned receive loses nothing.
    rx: Receiver<()>,
    /// The Unix socket closed: the peer is gone (messages already in the ring are
    /// still delivered).
    peer_gone: Cell<bool>,
    /// Data doorbells this side rang (system calls a sleeping peer cost us).
    doorbells: Cell<u64>,
    /// The receiving task, while it waits for a message.
    recv_waker: RefCell<Option<Waker>>,
    /// While the writer waits for room in the peer's ring: the peer's consumer
    /// position it saw (room appears when it moves).
    space_waiting: Cell<Option<u64>>,
    /// This connection's registration with the reactor's poll sources.
    source: Cell<Option<reactor::PollSourceId>>,
    /// Receive with the synchronous allocation, never waiting for pool memory
    /// (see [`super::Conn::set_never_wait_for_memory`]).
    never_wait: Cell<bool>,
    /// The payload length of the record at the ring's head when the pool could
    /// not serve it: the receiver waits for memory, leaving the record in the
    /// ring, which back-pressures the sender.
    need_memory: Cell<Option<usize>>,
    /// A buffer obtained by that wait, for the record at the ring's head.
    spare: RefCell<Option<PayloadBufMut>>,
    /// Woken when the connection closes or the peer goes (the wait for memory
    /// races it; the receive waker is not used there because a record waiting in
    /// the ring would wake it on every reactor pass).
    end_waker: RefCell<Option<Waker>>,
    /// Whether a task runs that releases the quarantine as it expires.
    quarantine_timer: Cell<bool>,
    /// This connection (for the tasks it spawns).
    me: std::rc::Weak<ShmConn>,
}

/// The shm connection as a completion source of its thread's reactor: the reactor
/// polls the ring under the thread's `poll_mode` (busy, interrupt, adaptive) like
/// its io_uring, and arms the needs-wakeup flags only when it is about to sleep.
struct RingSource {
    conn: std::rc::Weak<ShmConn>,
    doorbell: Rc<OwnedFd>,
}

impl reactor::PollSource for RingSource {
    fn poll(&self) -> bool {
        self.conn.upgrade().is_some_and(|c| c.poll_source(true))
    }

    fn arm(&self) -> bool {
        let Some(c) = self.conn.upgrade() else {
            return true;
        };
        let m = &c.local.map;
        if c.recv_waker.borrow().is_some() {
            m.u32_at(CTL_DATA_WAIT).store(1, Ordering::SeqCst);
        }
        if c.space_waiting.get().is_some() {
            c.remote
                .map
                .u32_at(CTL_SPACE_WAIT)
                .store(1, Ordering::SeqCst);
        }
        // Pairs with the producer's fence between publishing and reading the flag.
        fence(Ordering::SeqCst);
        !c.poll_source(false)
    }

    fn disarm(&self) {
        if let Some(c) = self.conn.upgrade() {
            c.local
                .map
                .u32_at(CTL_DATA_WAIT)
                .store(0, Ordering::Relaxed);
        }
    }

    fn doorbell(&self) -> Option<RawFd> {
        Some(self.doorbell.as_raw_fd())
    }
}

/// `flame_shm_grants_total{kind="in_place"|"staged"}`: grants made in place (the
/// buffer lies in a shared pool region: the peer's one-sided access is the only
/// copy) and through staging memory (one extra copy each), process-wide.
struct GrantCounters {
    in_place: prometheus::IntCounter,
    staged: prometheus::IntCounter,
}

static GRANTS: std::sync::LazyLock<GrantCounters> = std::sync::LazyLock::new(|| {
    let opts = prometheus::Opts::new(
        "flame_shm_grants_total",
        "One-sided grants over shm: in place (pool buffer shared with the peer) or staged (copied through staging memory)",
    );
    match prometheus::IntCounterVec::new(opts, &["kind"]) {
        Ok(v) => {
            if let Err(e) = prometheus::register(Box::new(v.clone())) {
                tracing::warn!("shm grant metrics not registered: {e}");
            }
            GrantCounters {
                in_place: v.with_label_values(&["in_place"]),
                staged: v.with_label_values(&["staged"]),
            }
        }
        Err(e) => {
            tracing::warn!("shm grant metrics not created: {e}");
            let unregistered = || {
                prometheus::IntCounter::new("flame_shm_grants_unregistered", "-")
                    .unwrap_or_else(|_| unreachable!("a constant, valid metric name"))
            };
            GrantCounters {
                in_place: unregistered(),
                staged: unregistered(),
            }
        }
    }
});

/// Grants made so far in this process: `(in place, through staging)`. The ratio
/// says whether one-sided transfers skip the extra copy (metrics, tests).
pub fn grant_counts() -> (u64, u64) {
    (GRANTS.in_place.get(), GRANTS.staged.get())
}

/// Bound on bytes waiting for room in the peer's ring.
pub const SEND_BACKLOG_BYTES_MAX: usize = super::tcp::SEND_QUEUE_BYTES_MAX;

fn hello_bytes(base: u64, regions: &[RegionInfo]) -> [u8; HELLO_BYTES] {
    let mut b = [0u8; HELLO_BYTES];
    b[0..8].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[8..16].copy_from_slice(&(SEGMENT_BYTES as u64).to_le_bytes());
    b[16..24].copy_from_slice(&(RING_BYTES as u64).to_le_bytes());
    b[24..32].copy_from_slice(&(STAGING_BYTES as u64).to_le_bytes());
    b[32..40].copy_from_slice(&(GRANT_SLOTS as u64).to_le_bytes());
    b[40..48].copy_from_slice(&base.to_le_bytes());
    b[48..52].copy_from_slice(&(regions.len() as u32).to_le_bytes());
    for (i, r) in regions.iter().take(REGIONS_MAX).enumerate() {
        let o = HELLO_FIXED_BYTES + i * HELLO_REGION_BYTES;
        b[o..o + 8].copy_from_slice(&(r.base as u64).to_le_bytes());
        b[o + 8..o + 16].copy_from_slice(&(r.len as u64).to_le_bytes());
    }
    b
}

/// Sends the hello and this side's descriptors (segment, doorbells, regions).
fn send_hello(sock: &UnixStream, local: &Local) -> io::Result<()> {
    let data = hello_bytes(local.map.base(), &local.shared);
    let mut fds = vec![
        local.memfd.as_raw_fd(),
        local.data_efd.as_raw_fd(),
        local.space_efd.as_raw_fd(),
    ];
    fds.extend(local.shared.iter().map(|r| r.memfd.as_raw_fd()));
    send_hello_with(sock, &data, &fds)
}

/// Sends hello bytes with descriptors (one `sendmsg`).
fn send_hello_with(sock: &UnixStream, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: data.as_ptr() as *mut libc::c_void,
        iov_len: data.len(),
    };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data; all-zero is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: the control buffer holds one cmsg of `fds.len()` fds, as sized above.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c) as *mut RawFd, fds.len());
    }
    // SAFETY: msg points at live buffers.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n as usize != data.len() {
        return Err(io::Error::other("short shm hello"));
    }
    Ok(())
}

/// Receives the peer's hello and descriptors (waiting through the reactor, bounded
/// by [`HANDSHAKE_TIMEOUT`]) and maps its segment.
async fn recv_hello(sock: &UnixStream) -> io::Result<Remote> {
    let wait = async {
        reactor::poll_readable(sock.as_raw_fd()).await?;
        Ok::<(), io::Error>(())
    };
    let expire = async {
        reactor::sleep(HANDSHAKE_TIMEOUT).await;
        Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "shm handshake timed out",
        ))
    };
    futures_lite::future::or(wait, expire).await?;
    let mut data = [0u8; HELLO_BYTES];
    let mut iov = libc::iovec {
        iov_base: data.as_mut_ptr().cast(),
        iov_len: data.len(),
    };
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe {
        libc::CMSG_SPACE(((HELLO_FDS + REGIONS_MAX) * std::mem::size_of::<RawFd>()) as u32)
    } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: msghdr is plain data.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space as _;
    // SAFETY: msg points at live buffers; MSG_CMSG_CLOEXEC marks received fds.
    let n = unsafe {
        libc::recvmsg(
            sock.as_raw_fd(),
            &mut msg,
            libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT,
        )
    };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    // Take ownership of every descriptor received first, so none leaks whatever
    // is wrong with the message.
    let mut fds: Vec<OwnedFd> = Vec::new();
    // SAFETY: walking the control buffer the kernel filled, within its length.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let p = libc::CMSG_DATA(c) as *const RawFd;
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(p.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    let bad = |what: &str| {
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("shm hello: {what}"),
        ))
    };
    if n as usize != HELLO_BYTES {
        return bad("peer closed or sent a short hello");
    }
    let hello = match decode_hello(&data) {
        Ok(h) => h,
        Err(what) => return bad(what),
    };
    if msg.msg_flags & libc::MSG_CTRUNC != 0 || fds.len() != HELLO_FDS + hello.regions.len() {
        return bad("descriptor count does not match the hello");
    }
    let base = hello.base;
    let mut fds = fds.into_iter();
    let (Some(memfd), Some(data_efd), Some(space_efd)) = (fds.next(), fds.next(), fds.next())
    else {
        return bad("descriptor count does not match the hello");
    };
    // A doorbell that is not an eventfd (a pipe, a socket) could block the
    // reactor thread that rings it: refuse it.
    if !is_eventfd(data_efd.as_raw_fd()) || !is_eventfd(space_efd.as_raw_fd()) {
        return bad("a doorbell is not an eventfd");
    }
    // The segment must be at least as large as we will touch and unable to
    // shrink, or an access would fault (SIGBUS).
    if !registered::size_sealed_at_least(memfd.as_raw_fd(), SEGMENT_BYTES as u64) {
        return bad("segment is too small, not sealed against shrinking, or not shared memory");
    }
    let map = Mapping::map(memfd.as_raw_fd(), SEGMENT_BYTES)?;
    if map.u64_at(CTL_MAGIC).load(Ordering::Relaxed) != HELLO_MAGIC {
        return bad("segment has no magic");
    }
    let mut regions = Vec::with_capacity(hello.regions.len());
    for (fd, &(r_base, r_len)) in fds.zip(&hello.regions) {
        if !registered::size_sealed_at_least(fd.as_raw_fd(), r_len) {
            return bad(
                "a region is too small, not sealed against shrinking, or not shared memory",
            );
        }
        regions.push(RemoteRegion {
            base: r_base,
            len: r_len,
            map: map_peer_region(fd.as_raw_fd(), r_len)?,
        });
    }
    Ok(Remote {
        map,
        regions,
        base,
        data_efd,
        _space_efd: space_efd,
    })
}

/// What a peer's hello announces, once [`decode_hello`] checked it.
#[doc(hidden)]
#[derive(Debug, PartialEq, Eq)]
pub struct Hello {
    /// The peer's address of its own segment.
    pub base: u64,
    /// Its shared pool regions: (address, length), at most [`REGIONS_MAX`].
    pub regions: Vec<(u64, u64)>,
}

/// Checks the bytes of a peer's hello (its descriptors are the caller's): the
/// layout equals ours, at most [`REGIONS_MAX`] regions each inside a sane range,
/// and every unused byte zero (so anything accepted is exactly what our encoder
/// writes). Apart from [`recv_hello`], public only for the property test and the
/// fuzz target.
#[doc(hidden)]
pub fn decode_hello(data: &[u8]) -> Result<Hello, &'static str> {
    if data.len() != HELLO_BYTES {
        return Err("peer closed or sent a short hello");
    }
    let u64_at = |o: usize| u64::from_le_bytes(data[o..o + 8].try_into().unwrap_or_default());
    let region_count = u32::from_le_bytes(data[48..52].try_into().unwrap_or_default()) as usize;
    if region_count > REGIONS_MAX {
        return Err("too many regions");
    }
    if data[0..40] != hello_bytes(0, &[])[0..40] {
        return Err("layout differs (another build?)");
    }
    let used = HELLO_FIXED_BYTES + region_count * HELLO_REGION_BYTES;
    if data[52..HELLO_FIXED_BYTES]
        .iter()
        .chain(&data[used..])
        .any(|&b| b != 0)
    {
        return Err("reserved or unused bytes are not zero");
    }
    let mut regions = Vec::with_capacity(region_count);
    for i in 0..region_count {
        let o = HELLO_FIXED_BYTES + i * HELLO_REGION_BYTES;
        let (r_base, r_len) = (u64_at(o), u64_at(o + 8));
        let sane = r_base != 0
            && r_len > 0
            && r_len <= REGION_BYTES_MAX
            && r_len.is_multiple_of(4096)
            && r_base.checked_add(r_len).is_some();
        if !sane {
            return Err("a region's address or length is out of range");
        }
        regions.push((r_base, r_len));
    }
    Ok(Hello {
        base: u64_at(40),
        regions,
    })
}

/// A ring record as [`next_record`] found it.
enum RingRecord {
    /// The ring is empty.
    Empty,
    /// A pad record of `rec` bytes (to the ring's end).
    Pad { rec: usize },
    /// A message whose header is checked: its payload (`header.payload_len`
    /// bytes) follows the header at ring offset `idx + RECORD_PREFIX + HEADER_LEN`;
    /// the record takes `rec` bytes.
    Message {
        header: Header,
        idx: usize,
        rec: usize,
    },
}

/// Finds and checks the record at consumer position `cons` of a ring whose
/// producer is at `prod`, reading ring bytes with `read(ring_offset, dst)`: every
/// position, length and kind the peer wrote is checked before it is trusted, and
/// the header is decoded (bounding the payload) before the caller allocates.
fn next_record(
    prod: u64,
    cons: u64,
    read: impl Fn(usize, &mut [u8]),
) -> Result<RingRecord, TransportError> {
    if prod == cons {
        return Ok(RingRecord::Empty);
    }
    let bad = |what| Err(TransportError::Protocol(ProtocolError::Inconsistent(what)));
    if prod < cons || prod - cons > RING_BYTES as u64 {
        return bad("shm ring producer index out of range");
    }
    let avail = (prod - cons) as usize;
    let idx = (cons % RING_BYTES as u64) as usize;
    let mut prefix = [0u8; RECORD_PREFIX];
    if idx + RECORD_PREFIX > RING_BYTES || avail < RECORD_PREFIX {
        return bad("shm ring record length out of range");
    }
    read(idx, &mut prefix);
    let len = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]) as usize;
    let kind = u32::from_le_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]);
    let rec = len.next_multiple_of(RECORD_ALIGN);
    if len < RECORD_PREFIX || rec > avail || idx + rec > RING_BYTES {
        return bad("shm ring record length out of range");
    }
    if kind == RECORD_PAD {
        if idx + len != RING_BYTES {
            return bad("shm pad record does not reach the ring's end");
        }
        return Ok(RingRecord::Pad { rec });
    }
    if kind != RECORD_MESSAGE || len < RECORD_PREFIX + HEADER_PREFIX_LEN {
        return bad("shm ring record of unknown kind");
    }
    let mut hprefix = [0u8; HEADER_PREFIX_LEN];
    read(idx + RECORD_PREFIX, &mut hprefix);
    Header::check_prefix(&hprefix)?;
    if len < RECORD_PREFIX + HEADER_LEN {
        return bad("shm ring record shorter than a header");
    }
    let mut hb = [0u8; HEADER_LEN];
    read(idx + RECORD_PREFIX, &mut hb);
    let header = Header::decode(&hb)?;
    if RECORD_PREFIX + HEADER_LEN + header.payload_len as usize != len {
        return bad("shm ring record length differs from its header");
    }
    Ok(RingRecord::Message { header, idx, rec })
}

/// The receiver's decoding of the next ring record (what `take_record` does,
/// without the shared memory and the payload pool), for the property test and the
/// fuzz target: `window` holds the ring's bytes from the consumer's ring offset
/// on, every other ring byte reads as zero.
#[doc(hidden)]
pub fn decode_ring_record(
    prod: u64,
    cons: u64,
    window: &[u8],
) -> Result<Option<Message>, TransportError> {
    let start = (cons % RING_BYTES as u64) as usize;
    let read = |off: usize, dst: &mut [u8]| {
        dst.fill(0);
        let lo = off.max(start);
        let hi = (off + dst.len()).min(start + window.len());
        if lo < hi {
            dst[lo - off..hi - off].copy_from_slice(&window[lo - start..hi - start]);
        }
    };
    match next_record(prod, cons, read)? {
        RingRecord::Empty | RingRecord::Pad { .. } => Ok(None),
        RingRecord::Message { header, idx, .. } => {
            let mut payload =
                crate::buffer::PayloadBufMut::for_overwrite(header.payload_len as usize);
            read(idx + RECORD_PREFIX + HEADER_LEN, payload.as_mut_slice());
            if header.op().is_transport_internal() {
                return Err(TransportError::Protocol(ProtocolError::Inconsistent(
                    "a tcp one-sided frame on a shm connection",
                )));
            }
            Ok(Some(Message::from_parts(&header, payload.freeze())?))
        }
    }
}

/// Connects to the Unix socket at `path` without blocking: `None` when it does
/// not exist, refuses, or its backlog is full (a stopped listener must not stall
/// the caller's reactor thread; the caller then uses TCP, with its timeout).
fn connect_path(path: &Path) -> Option<UnixStream> {
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: sockaddr_un is plain data; all-zero is valid.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let bytes = path.as_os_str().as_bytes();
    // Room for the terminating zero.
    if bytes.len() >= sa.sun_path.len() || bytes.contains(&0) {
        return None;
    }
    for (i, &b) in bytes.iter().enumerate() {
        sa.sun_path[i] = b as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
    // SAFETY: plain syscall; the result is checked.
    let fd = unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh descriptor we own.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sa is a valid sockaddr_un of `len` bytes.
    let r = unsafe {
        libc::connect(
            fd,
            (&sa as *const libc::sockaddr_un).cast(),
            len as libc::socklen_t,
        )
    };
    if r < 0 {
        return None;
    }
    Some(UnixStream::from(owned))
}

/// The user id of the process at the other end of a Unix socket (what it
/// was when it connected: `SO_PEERCRED`). Used by the shm handshake and by
/// flame-nbd's Unix socket export.
pub fn peer_uid(sock: &impl AsRawFd) -> io::Result<u32> {
    // SAFETY: ucred is plain data.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into cred.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.uid)
}

/// Whether `fd` is an eventfd (its /proc link is `anon_inode:[eventfd]`).
fn is_eventfd(fd: RawFd) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{fd}"))
        .is_ok_and(|p| p.as_os_str() == "anon_inode:[eventfd]")
}

impl ShmConn {
    async fn establish(sock: UnixStream, peer: SocketAddr) -> io::Result<Rc<ShmConn>> {
        sock.set_nonblocking(true)?;
        // Both sides, before anything is sent: memory is shared only with the
        // same user (or root). On the connecting side this is what stops another
        // local user who bound the listener's name first from receiving our
        // segment and pool memfds.
        let uid = peer_uid(&sock)?;
        // SAFETY: plain syscall.
        let me = unsafe { libc::geteuid() };
        if uid != me && uid != 0 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("shm peer runs as uid {uid}, not {me}"),
            ));
        }
        // The grant counters appear in /metrics from the first shm connection on.
        std::sync::LazyLock::force(&GRANTS);
        let local = Local::new()?;
        send_hello(&sock, &local)?;
        let remote = recv_hello(&sock).await?;
        let conn = Rc::new_cyclic(|me| ShmConn {
            local,
            remote,
            sock,
            peer,
            prod: Cell::new(0),
            cons: Cell::new(0),
            peer_cons: Cell::new(0),
            tx: SendQueue::new(SEND_BACKLOG_BYTES_MAX),
            rx: Receiver::new((), Abandoned::Resumes),
            peer_gone: Cell::new(false),
            doorbells: Cell::new(0),
            recv_waker: RefCell::new(None),
            space_waiting: Cell::new(None),
            source: Cell::new(None),
            never_wait: Cell::new(false),
            need_memory: Cell::new(None),
            spare: RefCell::new(None),
            end_waker: RefCell::new(None),
            quarantine_timer: Cell::new(false),
            me: me.clone(),
        });
        let source = RingSource {
            conn: Rc::downgrade(&conn),
            doorbell: conn.local.data_efd.clone(),
        };
        conn.source
            .set(Some(reactor::add_poll_source(Rc::new(source))));
        reactor::spawn(watch_peer(Rc::downgrade(&conn))).detach();
        reactor::spawn(writer(conn.clone())).detach();
        Ok(conn)
    }

    /// Connects to the shm listener of the OSD shard at `addr`. `Ok(None)` when no
    /// such listener is reachable (another host, another namespace, tcp-only
    /// daemon): the caller falls back to TCP.
    pub async fn connect(addr: SocketAddr) -> Result<Option<Rc<ShmConn>>, TransportError> {
        ShmConn::connect_in(&socket_dir(), addr).await
    }

    /// [`ShmConn::connect`] with the socket directory `dir`.
    async fn connect_in(
        dir: &Path,
        addr: SocketAddr,
    ) -> Result<Option<Rc<ShmConn>>, TransportError> {
        if let Err(e) = check_socket_dir(dir, false) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!(%addr, "not using shm: {e}");
            }
            return Ok(None);
        }
        let mut sock = None;
        let any = SocketAddr::new([0, 0, 0, 0].into(), addr.port());
        for path in [socket_path(dir, addr), socket_path(dir, any)] {
            if let Some(s) = connect_path(&path) {
                sock = Some(s);
                break;
            }
        }
        let Some(sock) = sock else { return Ok(None) };
        match ShmConn::establish(sock, addr).await {
            Ok(c) => Ok(Some(c)),
            Err(e) => {
                tracing::warn!(%addr, "shm handshake failed, using tcp: {e}");
                Ok(None)
            }
        }
    }

    fn closed_err(&self) -> TransportError {
        TransportError::Closed
    }

    /// See [`super::Conn::send`].
    pub fn send(&self, msg: &Message) -> Result<(), TransportError> {
        let (header, body) = msg.to_header();
        let mut head = header.encode().to_vec();
        match msg.payload_buf() {
            Some(data) => self.enqueue(head, Some(data.clone()).filter(|d| !d.is_empty())),
            None => {
                head.extend_from_slice(&body);
                self.enqueue(head, None)
            }
        }
    }

    /// See [`super::Conn::send_raw`].
    pub fn send_raw(&self, bytes: Vec<u8>) -> Result<(), TransportError> {
        // Only version refusals use this; over shm both sides are the same build
        // (the hello checks the layout), so it is delivered as an opaque record the
        // receiver will refuse like any bad header.
        self.enqueue(bytes, None)
    }

    fn enqueue(&self, head: Vec<u8>, payload: Option<PayloadBuf>) -> Result<(), TransportError> {
        if self.tx.is_closed() || self.peer_gone.get() {
            return Err(self.closed_err());
        }
        if self.tx.is_empty() {
            match self.try_put(&head, payload.as_deref()) {
                Ok(true) => {
                    // Went at once: activity, never a stall.
                    self.tx.marks().send_started();
                    self.tx.marks().send_finished();
                    return Ok(());
                }
                Ok(false) => {}
                Err(e) => {
                    self.close();
                    return Err(e);
                }
            }
        }
        let bytes = head.len() + payload.as_ref().map_or(0, |p| p.len());
        let pushed = self.tx.push(bytes, |b| {
            b.in_total += bytes as u64;
            b.records.push_back((head, payload));
        });
        match pushed {
            Ok(()) => Ok(()),
            Err(PushRefused::Closed) => Err(self.closed_err()),
            Err(PushRefused::Backlog(max)) => {
                self.close();
                Err(TransportError::Backlog(max))
            }
        }
    }

    /// Copies one record into the peer's ring if it has room. `Ok(false)`: no room
    /// yet. An error (a record too long, a peer whose consumer index went wrong)
    /// is the caller's to close the connection on: this may run while the
    /// backlog is borrowed.
    fn try_put(&self, head: &[u8], payload: Option<&[u8]>) -> Result<bool, TransportError> {
        let plen = payload.map_or(0, <[u8]>::len);
        let rec = (RECORD_PREFIX + head.len() + plen).next_multiple_of(RECORD_ALIGN);
        if rec > RECORD_BYTES_MAX {
            return Err(TransportError::Protocol(ProtocolError::TooLong {
                what: "shm record",
                len: rec as u64,
                max: RECORD_BYTES_MAX as u64,
            }));
        }
        let m = &self.remote.map;
        let cons = m.u64_at(CTL_CONS).load(Ordering::Acquire);
        let prod = self.prod.get();
        if cons < self.peer_cons.get() || cons > prod {
            return Err(TransportError::Protocol(ProtocolError::Inconsistent(
                "shm peer's ring consumer index moved backwards or past the producer",
            )));
        }
        self.peer_cons.set(cons);
        let free = RING_BYTES - (prod - cons) as usize;
        let idx = (prod % RING_BYTES as u64) as usize;
        let tail = RING_BYTES - idx;
        let mut at = prod;
        if rec > tail {
            if tail + rec > free {
                return Ok(false);
            }
            // Pad to the end; the record starts at the ring's beginning.
            m.u32_at(RING_OFF + idx + 4)
                .store(RECORD_PAD, Ordering::Relaxed);
            m.u32_at(RING_OFF + idx)
                .store(tail as u32, Ordering::Relaxed);
            at += tail as u64;
        } else if rec > free {
            return Ok(false);
        }
        let i = (at % RING_BYTES as u64) as usize;
        m.write(RING_OFF + i + RECORD_PREFIX, head);
        if let Some(p) = payload {
            m.write(RING_OFF + i + RECORD_PREFIX + head.len(), p);
        }
        m.u32_at(RING_OFF + i + 4)
            .store(RECORD_MESSAGE, Ordering::Relaxed);
        m.u32_at(RING_OFF + i).store(
            (RECORD_PREFIX + head.len() + plen) as u32,
            Ordering::Relaxed,
        );
        let new = at + rec as u64;
        self.prod.set(new);
        m.u64_at(CTL_PROD).store(new, Ordering::Release);
        // Doorbell only if the peer is (about to be) asleep: pairs with the fence
        // in `wait_data`.
        fence(Ordering::SeqCst);
        if m.u32_at(CTL_DATA_WAIT).swap(0, Ordering::SeqCst) != 0 {
            self.doorbells.set(self.doorbells.get() + 1);
            ring_doorbell(self.remote.data_efd.as_raw_fd());
        }
        Ok(true)
    }

    /// See [`super::Conn::recv`].
    pub async fn recv(&self) -> Result<Message, TransportError> {
        let close = || self.close();
        let turn = self.rx.begin(&close)?;
        let r = self.recv_inner().await;
        match turn.end(&r) {
            Ending::Open => {}
            Ending::CloseAfterSend => self.close_after_send(),
            Ending::Close => self.close(),
        }
        r
    }

    async fn recv_inner(&self) -> Result<Message, TransportError> {
        // Bounded: each round consumes a record, or sleeps until woken.
        loop {
            if self.tx.is_closed() {
                return Err(TransportError::Closed);
            }
            if let Some(m) = self.take_record()? {
                return Ok(m);
            }
            if let Some(len) = self.need_memory.take() {
                // The pool is exhausted: wait for frees (bounded by the pool's
                // wait; past it, fail, which closes the connection) with the
                // record still in the ring.
                let ended = std::future::poll_fn(|cx| {
                    if self.tx.is_closed() || self.peer_gone.get() {
                        return Poll::Ready(None);
                    }
                    *self.end_waker.borrow_mut() = Some(cx.waker().clone());
                    Poll::Pending
                });
                let wait = async { Some(PayloadBufMut::for_overwrite_wait(len).await) };
                let Some(buf) = futures_lite::future::or(wait, ended).await else {
                    return Err(TransportError::Closed);
                };
                *self.spare.borrow_mut() = Some(buf.map_err(io::Error::from)?);
                continue;
            }
            if self.peer_gone.get() {
                return Err(TransportError::Closed);
            }
            // Wait for the reactor's poll of this connection's ring to wake us.
            std::future::poll_fn(|cx| {
                if self.data_ready() {
                    return Poll::Ready(());
                }
                *self.recv_waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            })
            .await;
        }
    }

    /// Whether the receiving task has something to do: a record, or an end.
    fn data_ready(&self) -> bool {
        self.tx.is_closed()
            || self.peer_gone.get()
            || self.local.map.u64_at(CTL_PROD).load(Ordering::Acquire) != self.cons.get()
    }

    /// The poll source's check: wakes the receiving task if a message (or the end)
    /// is there, and the writer if the peer made room. Returns whether there was
    /// such work; with `wake` false only looks (`arm`'s re-check).
    fn poll_source(&self, wake: bool) -> bool {
        let mut found = false;
        if self.recv_waker.borrow().is_some() && self.data_ready() {
            found = true;
            if wake && let Some(w) = self.recv_waker.borrow_mut().take() {
                w.wake();
            }
        }
        if let Some(seen) = self.space_waiting.get() {
            let now = self.remote.map.u64_at(CTL_CONS).load(Ordering::Acquire);
            if now != seen || self.tx.is_closed() || self.peer_gone.get() {
                found = true;
                if wake {
                    self.space_waiting.set(None);
                    self.tx.wake_drainer();
                }
            }
        }
        found
    }

    /// The next message in this side's ring, if any.
    fn take_record(&self) -> Result<Option<Message>, TransportError> {
        // Bounded: at most one pad record precedes a message.
        for _ in 0..2 {
            let m = &self.local.map;
            let prod = m.u64_at(CTL_PROD).load(Ordering::Acquire);
            let read = |off: usize, dst: &mut [u8]| m.read(RING_OFF + off, dst);
            let (header, idx, rec) = match next_record(prod, self.cons.get(), read)? {
                RingRecord::Empty => return Ok(None),
                RingRecord::Pad { rec } => {
                    self.consume(rec);
                    continue;
                }
                RingRecord::Message { header, idx, rec } => (header, idx, rec),
            };
            let plen = header.payload_len as usize;
            // From the thread's pool; when it is exhausted the record stays in
            // the ring while `recv_inner` waits for memory (like tcp, which stops
            // reading its socket), unless this connection must never wait.
            let spare = self.spare.borrow_mut().take().filter(|b| b.len() == plen);
            let mut payload = match spare {
                Some(b) => b,
                None if self.never_wait.get() => PayloadBufMut::for_overwrite(plen),
                None => match PayloadBufMut::try_for_overwrite(plen) {
                    Some(b) => b,
                    None => {
                        self.need_memory.set(Some(plen));
                        return Ok(None);
                    }
                },
            };
            m.read(
                RING_OFF + idx + RECORD_PREFIX + HEADER_LEN,
                payload.as_mut_slice(),
            );
            self.consume(rec);
            if header.op().is_transport_internal() {
                return Err(TransportError::Protocol(ProtocolError::Inconsistent(
                    "a tcp one-sided frame on a shm connection",
                )));
            }
            self.tx.marks().frame_received();
            return Ok(Some(Message::from_parts(&header, payload.freeze())?));
        }
        Ok(None)
    }

    /// Frees `rec` bytes of this side's ring and wakes a peer waiting for room.
    fn consume(&self, rec: usize) {
        let new = self.cons.get() + rec as u64;
        self.cons.set(new);
        let m = &self.local.map;
        m.u64_at(CTL_CONS).store(new, Ordering::Release);
        fence(Ordering::SeqCst);
        if m.u32_at(CTL_SPACE_WAIT).swap(0, Ordering::SeqCst) != 0 {
            // The peer's one doorbell: its poll source then sees the room.
            ring_doorbell(self.remote.data_efd.as_raw_fd());
        }
    }

    /// See [`super::Conn::send_queued_bytes`].
    pub fn send_queued_bytes(&self) -> usize {
        self.tx.queued_bytes()
    }

    /// See [`super::Conn::wait_sent_below`]. Ends too when the peer is gone
    /// (its backlog will never be taken).
    pub async fn wait_sent_below(&self, bytes_max: usize) {
        self.tx
            .wait_below_unless(bytes_max.max(1), || self.peer_gone.get())
            .await
    }

    /// See [`super::Conn::stall`].
    pub fn stall(&self) -> (super::Stall, u64) {
        self.tx.marks().current()
    }

    /// See [`super::Conn::close`].
    pub fn close(&self) {
        // Drops the backlog and wakes the writer.
        if !self.tx.close() {
            return;
        }
        // The peer's watcher sees the socket close.
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        // Wake this side's own waiters (receiver, writer) and leave the reactor.
        if let Some(w) = self.recv_waker.borrow_mut().take() {
            w.wake();
        }
        if let Some(w) = self.end_waker.borrow_mut().take() {
            w.wake();
        }
        if let Some(id) = self.source.take() {
            reactor::remove_poll_source(id);
        }
        // Grants end with the connection.
        let slots: Vec<usize> = self.local.grants.borrow().keys().copied().collect();
        for s in slots {
            self.local.unpublish(s);
        }
    }

    /// See [`super::Conn::close_after_send`].
    pub fn close_after_send(&self) {
        self.tx.close_after_send();
    }

    /// See [`super::Conn::is_closed`].
    pub fn is_closed(&self) -> bool {
        self.tx.is_closed() || self.peer_gone.get()
    }

    /// See [`super::Conn::set_never_wait_for_memory`].
    pub fn set_never_wait_for_memory(&self, on: bool) {
        self.never_wait.set(on);
    }

    /// Data doorbells this side rang so far: one per time the peer went to sleep
    /// and was woken by a message, none while it was busy.
    pub fn doorbells_rung(&self) -> u64 {
        self.doorbells.get()
    }

    /// The TCP address the connection was made for (logs).
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }

    // ---- grants and one-sided operations ----

    /// Publishes a grant of `len` bytes at `addr` (this side's address, in its
    /// staging memory or a shared region) backed by `backing`.
    fn publish_grant(
        &self,
        len: usize,
        access: u32,
        backing: impl FnOnce(&Local) -> Option<(u64, Backing)>,
    ) -> Result<RemoteBuf, TransportError> {
        let len32 = check_grant_len(len)?;
        if self.is_closed() {
            return Err(TransportError::Closed);
        }
        self.local.expire_quarantine();
        if self.local.grants.borrow().len() >= GRANT_SLOTS / 2 {
            return Err(TransportError::Grant(format!(
                "{} grants are live on this connection: release some first",
                GRANT_SLOTS / 2
            )));
        }
        let Some((addr, backing)) = backing(&self.local) else {
            return Err(TransportError::Grant(format!(
                "shm staging memory ({STAGING_BYTES} bytes) exhausted on this connection"
            )));
        };
        let mut slots = self.local.grants.borrow_mut();
        let key = random_key(|k| slots.contains_key(&(k as usize & (GRANT_SLOTS - 1))));
        let slot = key as usize & (GRANT_SLOTS - 1);
        slots.insert(slot, backing);
        drop(slots);
        self.local.publish(slot, key, access, addr, len32);
        Ok(RemoteBuf {
            addr,
            len: len32,
            key,
        })
    }

    /// A grant of `len` bytes of staging memory, filled with `fill` if given.
    fn grant_staged(
        &self,
        len: usize,
        access: u32,
        fill: Option<&[u8]>,
    ) -> Result<RemoteBuf, TransportError> {
        GRANTS.staged.inc();
        self.publish_grant(len, access, |local| {
            let off = local.alloc(len)?;
            if let Some(src) = fill {
                local.map.write(STAGING_OFF + off, src);
            }
            let addr = local.map.base() + (STAGING_OFF + off) as u64;
            let write = access == ACCESS_WRITE;
            Some((addr, Backing::Staging { off, len, write }))
        })
    }

    /// See [`super::Conn::grant_read`]: in place when the buffer lies in a pool
    /// region shared with the peer; otherwise its bytes are copied into staging
    /// memory and the peer copies them from there.
    pub fn grant_read(self: &Rc<Self>, buf: &PayloadBuf) -> Result<Grant, TransportError> {
        let remote = match self.local.shared_addr(buf.location(), buf.len()) {
            Some(addr) => {
                GRANTS.in_place.inc();
                let held = buf.clone();
                self.publish_grant(buf.len(), ACCESS_READ, |_| {
                    Some((addr, Backing::InPlaceRead { _held: held }))
                })?
            }
            None => self.grant_staged(buf.len(), ACCESS_READ, Some(buf.as_slice()))?,
        };
        Ok(Grant::new(remote, self.clone()))
    }

    /// See [`super::Conn::grant_write`]: in place when the buffer lies in a shared
    /// pool region; otherwise the peer writes into staging memory and
    /// [`WriteGrant::finish`] copies the bytes into `buf`.
    pub fn grant_write(self: &Rc<Self>, buf: PayloadBufMut) -> Result<WriteGrant, TransportError> {
        let len = buf.len();
        match self.local.shared_addr(buf.location(), len) {
            Some(addr) => {
                GRANTS.in_place.inc();
                let buf = Rc::new(RefCell::new(buf));
                let held = buf.clone();
                let remote = self.publish_grant(len, ACCESS_WRITE, |_| {
                    Some((addr, Backing::InPlaceWrite { _held: held }))
                })?;
                Ok(WriteGrant::new(remote, self.clone(), buf))
            }
            None => {
                let remote = self.grant_staged(len, ACCESS_WRITE, None)?;
                Ok(WriteGrant::new(
                    remote,
                    self.clone(),
                    Rc::new(RefCell::new(buf)),
                ))
            }
        }
    }

    /// See [`super::Conn::grant_area`]: an area of this side's staging memory the
    /// peer reads in place, one-sidedly, while this side keeps writing it.
    pub fn grant_area(self: &Rc<Self>, len: usize) -> Result<SharedArea, TransportError> {
        let remote = self.grant_staged(len, ACCESS_READ, None)?;
        // Offset of the area in this side's segment.
        let base = (remote.addr - self.local.map.base()) as usize;
        let conn = Rc::downgrade(self);
        let writer = Box::new(move |offset: usize, data: &[u8]| {
            // Nothing to write into once the connection (and its segment) is gone.
            if let Some(c) = conn.upgrade() {
                c.local.map.write(base + offset, data);
            }
        });
        Ok(SharedArea::new(remote, self.clone(), writer))
    }

    /// Checks `[addr, addr + len)` against the peer's grant `key` and returns where
    /// those bytes are mapped here (in the peer's staging memory or one of its
    /// shared regions) and the grant's seqlock value, or refuses (and closes).
    fn check_remote(
        &self,
        key: u32,
        access: u32,
        addr: u64,
        len: u64,
    ) -> Result<(*mut u8, u32), TransportError> {
        if self.is_closed() {
            return Err(TransportError::Closed);
        }
        let m = &self.remote.map;
        let o = Local::slot_off(key as usize & (GRANT_SLOTS - 1));
        let seq = m.u32_at(o).load(Ordering::Acquire);
        let g_access = m.u32_at(o + 4).load(Ordering::Relaxed);
        let g_key = m.u32_at(o + 8).load(Ordering::Relaxed);
        let g_len = m.u32_at(o + 12).load(Ordering::Relaxed);
        let g_addr = m.u64_at(o + 16).load(Ordering::Relaxed);
        fence(Ordering::Acquire);
        let stable = m.u32_at(o).load(Ordering::Relaxed) == seq && seq.is_multiple_of(2);
        let refuse = |r: Refusal| {
            tracing::warn!(peer = %self.peer, reason = r.as_str(), "one-sided access refused; closing the shm connection");
            self.close();
            Err(TransportError::Refused(r.as_str()))
        };
        if !stable || g_key != key || key == 0 {
            return refuse(Refusal::UnknownKey);
        }
        if g_access != access {
            return refuse(Refusal::WrongAccess);
        }
        if let Err(r) = check_bounds(g_addr, g_len, addr, len) {
            return refuse(r);
        }
        // The bytes must lie in the peer's staging memory or in one of its shared
        // regions: a corrupt table must not make this side touch anything else
        // (or fault).
        let Some(end) = addr.checked_add(len) else {
            return refuse(Refusal::OutOfBounds);
        };
        let staging = self.remote.base.saturating_add(STAGING_OFF as u64)
            ..=self.remote.base.saturating_add(SEGMENT_BYTES as u64);
        if staging.contains(&addr) && staging.contains(&end) {
            let off = (addr - self.remote.base) as usize;
            // SAFETY: off + len ≤ SEGMENT_BYTES, the mapping's length.
            return Ok((unsafe { self.remote.map.ptr.add(off) }, seq));
        }
        for r in &self.remote.regions {
            if addr >= r.base && end <= r.base + r.len {
                // SAFETY: [addr, end) lies in the region, whose mapping is r.len long.
                return Ok((unsafe { r.map.map.ptr.add((addr - r.base) as usize) }, seq));
            }
        }
        refuse(Refusal::OutOfBounds)
    }

    fn still_granted(&self, key: u32, seq: u32) -> Result<(), TransportError> {
        let o = Local::slot_off(key as usize & (GRANT_SLOTS - 1));
        fence(Ordering::Acquire);
        if self.remote.map.u32_at(o).load(Ordering::Relaxed) != seq {
            self.close();
            return Err(TransportError::Refused("the grant ended during the access"));
        }
        Ok(())
    }

    /// See [`super::Conn::read_remote`]: a copy out of the peer's memory.
    pub fn read_remote(&self, remote: RemoteBuf) -> Result<PayloadBufMut, TransportError> {
        let (src, seq) =
            self.check_remote(remote.key, ACCESS_READ, remote.addr, u64::from(remote.len))?;
        let mut out = PayloadBufMut::for_overwrite(remote.len as usize);
        let dst = out.as_mut_slice();
        // SAFETY: `src` has `dst.len()` mapped bytes (check_remote); the peer may
        // write them concurrently, which only makes them garbage: a grant that
        // changed during the copy is refused below.
        unsafe { std::ptr::copy_nonoverlapping(src, dst.as_mut_ptr(), dst.len()) };
        self.still_granted(remote.key, seq)?;
        Ok(out)
    }

    /// See [`super::Conn::write_remote`]: a copy into the peer's memory.
    pub fn write_remote(
        &self,
        key: u32,
        addr: u64,
        data: &PayloadBuf,
    ) -> Result<(), TransportError> {
        let (dst, seq) = self.check_remote(key, ACCESS_WRITE, addr, data.len() as u64)?;
        let src = data.as_slice();
        // SAFETY: `dst` has `src.len()` mapped bytes (check_remote).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()) };
        self.still_granted(key, seq)
    }
}

impl GrantOwner for ShmConn {
    fn revoke(&self, key: u32, into: Option<&mut PayloadBufMut>) {
        let slot = key as usize & (GRANT_SLOTS - 1);
        let Some(backing) = self.local.grants.borrow_mut().remove(&slot) else {
            return;
        };
        // Unpublish first: from here on the peer's accesses are refused.
        self.local.unpublish(slot);
        let early_write = match &backing {
            Backing::Staging { off, len, write } => match into {
                Some(buf) => {
                    let n = buf.len().min(*len);
                    self.local
                        .map
                        .read(STAGING_OFF + off, &mut buf.as_mut_slice()[..n]);
                    false
                }
                // A write grant dropped without `finish` is early; a read grant or
                // a shared area owes no copy.
                None => *write,
            },
            Backing::InPlaceRead { .. } => false,
            // The peer wrote into the buffer itself; `into` is that buffer.
            Backing::InPlaceWrite { .. } => into.is_none(),
        };
        self.local.release_backing(backing, early_write);
        if early_write && !self.quarantine_timer.replace(true) {
            // Release the quarantine as it expires even if no grant follows on
            // this connection (bounded: ends when it is empty or the connection
            // is gone; the drop hands what is left to `linger`).
            let me = self.me.clone();
            reactor::spawn(async move {
                loop {
                    reactor::sleep(QUARANTINE).await;
                    let Some(c) = me.upgrade() else { return };
                    c.local.expire_quarantine();
                    if c.local.quarantine.borrow().is_empty() {
                        c.quarantine_timer.set(false);
                        return;
                    }
                }
            })
            .detach();
        }
    }
}

impl Drop for ShmConn {
    fn drop(&mut self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
        // Dropped without a close (on its reactor thread): leave the reactor.
        if let Some(id) = self.source.take()
            && reactor::current_id().is_some()
        {
            reactor::remove_poll_source(id);
        }
        // Pool buffers of early-revoked write grants: the peer may still be in the
        // middle of a copy into them (its mapping of our region outlives this
        // connection), so they stay out of circulation until their quarantine
        // ends. Staging extents need nothing: the segment goes with us.
        let held: Vec<(Instant, Backing)> = self
            .local
            .quarantine
            .borrow_mut()
            .drain(..)
            .filter(|(_, b)| matches!(b, Backing::InPlaceWrite { .. }))
            .collect();
        if let Some((last, _)) = held.last()
            && reactor::current_id().is_some()
        {
            let left = QUARANTINE.saturating_sub(crate::clock::elapsed(*last));
            reactor::spawn(async move {
                reactor::sleep(left).await;
                drop(held);
            })
            .detach();
        }
    }
}

/// Drains the backlog into the peer's ring as room appears.
async fn writer(conn: Rc<ShmConn>) {
    loop {
        // Wait for work.
        match conn.tx.next_round().await {
            Ok(()) => {}
            Err(WriterEnd::Drained) => {
                conn.close();
                return;
            }
            Err(_) => return,
        }
        if conn.peer_gone.get() {
            return;
        }
        conn.tx.with_backlog(|b| {
            if b.batch_end.is_none() {
                b.batch_end = Some(b.in_total);
                conn.tx.marks().send_started();
            }
        });
        // Move as much as fits; when the ring is full, wait until the peer's
        // consumer position moves (the poll source checks it and, before the
        // thread sleeps, sets the space flag the peer rings the doorbell for).
        // Bounded: each round moves a record, or waits for the peer's consumer
        // position to move, or ends.
        loop {
            if conn.tx.is_closed() || conn.peer_gone.get() {
                return;
            }
            let put = conn.tx.with_backlog(|b| {
                b.records
                    .front()
                    .map(|(h, p)| conn.try_put(h, p.as_deref()))
            });
            match put {
                None => break,
                Some(Ok(true)) => {
                    conn.tx.take(|b| {
                        let bytes = b
                            .records
                            .pop_front()
                            .map_or(0, |(h, p)| h.len() + p.as_ref().map_or(0, |p| p.len()));
                        b.out_total += bytes as u64;
                        if b.batch_end.is_some_and(|end| b.out_total >= end) {
                            // The batch went: progress. What was backlogged since
                            // is the next batch.
                            conn.tx.marks().send_finished();
                            b.batch_end = if b.records.is_empty() {
                                None
                            } else {
                                conn.tx.marks().send_started();
                                Some(b.in_total)
                            };
                        }
                        ((), bytes)
                    });
                }
                Some(Ok(false)) => {
                    let seen = conn.peer_cons.get();
                    std::future::poll_fn(|cx| {
                        if conn.tx.is_closed() || conn.peer_gone.get() {
                            return Poll::Ready(());
                        }
                        let now = conn.remote.map.u64_at(CTL_CONS).load(Ordering::Acquire);
                        if now != seen {
                            conn.space_waiting.set(None);
                            return Poll::Ready(());
                        }
                        conn.space_waiting.set(Some(seen));
                        conn.tx.park_drainer(cx.waker());
                        Poll::Pending
                    })
                    .await;
                }
                Some(Err(e)) => {
                    tracing::warn!(peer = %conn.peer, "shm send failed: {e}; closing");
                    conn.close();
                    return;
                }
            }
        }
    }
}

/// Waits for the peer's Unix socket to close (the peer closed the connection or
/// died), then marks the peer gone and wakes this side's sleepers.
async fn watch_peer(conn: std::rc::Weak<ShmConn>) {
    let Some(fd) = conn.upgrade().map(|c| c.sock.as_raw_fd()) else {
        return;
    };
    // Bounded: the socket carries no data after the handshake, so a readable
    // socket means the peer is gone (or broke the protocol, which ends it too).
    loop {
        let r = reactor::poll_readable(fd).await;
        let Some(c) = conn.upgrade() else { return };
        if c.tx.is_closed() {
            return;
        }
        if let Err(e) = &r
            && e.kind() == io::ErrorKind::Interrupted
        {
            continue;
        }
        c.peer_gone.set(true);
        if let Some(w) = c.recv_waker.borrow_mut().take() {
            w.wake();
        }
        if let Some(w) = c.end_waker.borrow_mut().take() {
            w.wake();
        }
        c.tx.wake_drainer();
        c.tx.wake_waiters();
        return;
    }
}

/// A listener on a TCP address and on its shm Unix socket: same-host peers get
/// shm, others TCP.
pub struct ShmListener {
    tcp: std::net::TcpListener,
    unix: UnixListener,
    addr: SocketAddr,
    /// The Unix socket's file, removed when the listener goes.
    path: PathBuf,
    /// Names this listener's handshakes in progress on the accepting thread
    /// ([`super::bring_up`]).
    id: u64,
}

impl ShmListener {
    /// Binds `addr` (TCP) and the Unix socket named after it in this user's socket
    /// directory ([`socket_dir`], created if missing, refused if others could
    /// reach into it).
    pub fn bind(addr: SocketAddr) -> io::Result<ShmListener> {
        ShmListener::bind_in(&socket_dir(), addr)
    }

    /// [`ShmListener::bind`] with the socket directory `dir`.
    fn bind_in(dir: &Path, addr: SocketAddr) -> io::Result<ShmListener> {
        check_socket_dir(dir, true)?;
        let tcp = std::net::TcpListener::bind(addr)?;
        let addr = tcp.local_addr()?;
        let path = socket_path(dir, addr);
        // The TCP address is ours now, and with it the name: a file already
        // there is a socket a killed listener left behind.
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                return Err(io::Error::new(
                    e.kind(),
                    format!("removing the stale shm socket {}: {e}", path.display()),
                ));
            }
        }
        let unix = UnixListener::bind(&path).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("binding the shm socket {}: {e}", path.display()),
            )
        })?;
        tcp.set_nonblocking(true)?;
        unix.set_nonblocking(true)?;
        Ok(ShmListener {
            tcp,
            unix,
            addr,
            path,
            id: super::bring_up::listener_id(),
        })
    }

    /// The bound TCP address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Accepts the next connection of either kind. Shm handshakes run in tasks
    /// of their own ([`super::bring_up`]: each within [`HANDSHAKE_TIMEOUT`], at
    /// most [`super::bring_up::BRING_UPS_PER_SOURCE_MAX`] at once: every local
    /// peer is one source), so a
    /// local peer that connects and sends nothing holds one slot for 2 s, not
    /// the listener. A shm peer whose handshake fails is dropped (logged) and
    /// the wait goes on.
    ///
    /// One task accepts on a listener; drop it on that task's thread (see
    /// [`super::bring_up`]).
    pub async fn accept(&self) -> Result<super::Conn, TransportError> {
        use super::bring_up::{Arrival, BringUps, Source};
        let ups = BringUps::of(self.id);
        let fds = [self.tcp.as_raw_fd(), self.unix.as_raw_fd()];
        ups.accept(&fds, HANDSHAKE_TIMEOUT, || {
            // Bounded: one accept of each kind per call, each retried only when
            // interrupted.
            loop {
                match self.tcp.accept() {
                    Ok((s, _)) => {
                        s.set_nonblocking(false)?;
                        let c = super::tcp::TcpConn::from_stream(s)?;
                        return Ok(Some(Arrival::Ready(super::Conn::Tcp(c))));
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e.into()),
                }
            }
            loop {
                return match self.unix.accept() {
                    Ok((s, _)) => {
                        let addr = self.addr;
                        Ok(Some(Arrival::BringUp {
                            source: Source::Local,
                            peer: format!("shm peer of {addr}"),
                            task: Box::pin(async move {
                                let c = ShmConn::establish(s, addr).await?;
                                Ok(super::Conn::Shm(c))
                            }),
                        }))
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => Err(e.into()),
                };
            }
        })
        .await
    }
}

impl Drop for ShmListener {
    fn drop(&mut self) {
        super::bring_up::BringUps::forget(self.id);
        // Ours as long as the TCP address is (see `bind`).
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Epoch, RequestId};
    use crate::reactor::{Reactor, ReactorConfig};

    /// Connections to the same peer share one mapping of each of its regions.
    #[test]
    fn peer_regions_are_mapped_once_per_process() {
        let cfg = registered::MemoryPoolConfig {
            bytes_per_thread: 4 << 20,
            ..Default::default()
        };
        registered::install_on_this_thread(&cfg).unwrap();
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let l = Rc::new(ShmListener::bind("127.0.0.1:0".parse().unwrap()).unwrap());
            let addr = l.local_addr();
            let mut accepted = Vec::new();
            let mut clients = Vec::new();
            for _ in 0..3 {
                let l2 = l.clone();
                let accept = crate::reactor::spawn(async move { l2.accept().await.unwrap() });
                clients.push(ShmConn::connect(addr).await.unwrap().unwrap());
                let super::super::Conn::Shm(s) = accept.await else {
                    panic!("accepted over tcp")
                };
                accepted.push(s);
            }
            // The listener's side mapped the connecting side's region: once.
            let first = &accepted[0].remote.regions;
            assert!(!first.is_empty(), "no region shared");
            for s in &accepted[1..] {
                assert!(Arc::ptr_eq(&s.remote.regions[0].map, &first[0].map));
            }
            drop(accepted);
            drop(clients);
        })
        .unwrap();
    }

    /// A write grant dropped before the peer finished keeps its pool buffer out of
    /// circulation for the quarantine, then gives it back by itself (no further
    /// grant on the connection needed).
    #[test]
    fn early_revoked_write_grants_are_quarantined_then_released() {
        let cfg = registered::MemoryPoolConfig {
            bytes_per_thread: 4 << 20,
            ..Default::default()
        };
        registered::install_on_this_thread(&cfg).unwrap();
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let l = ShmListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
            let addr = l.local_addr();
            let accept = crate::reactor::spawn(async move { l.accept().await.unwrap() });
            let c = ShmConn::connect(addr).await.unwrap().unwrap();
            let _s = accept.await;
            // The whole 4 MiB pool, granted in place, then dropped unfinished.
            let buf = PayloadBufMut::try_for_overwrite(4 << 20).unwrap();
            let g = c.grant_write(buf).unwrap();
            drop(g);
            assert!(
                PayloadBufMut::try_for_overwrite(4 << 20).is_none(),
                "released at once: a peer's copy in flight could land in reused memory"
            );
            let start = Instant::now();
            loop {
                if let Some(b) = PayloadBufMut::try_for_overwrite(4 << 20) {
                    drop(b);
                    break;
                }
                assert!(
                    start.elapsed() < QUARANTINE * 5,
                    "quarantine never released"
                );
                crate::reactor::sleep(Duration::from_millis(50)).await;
            }
            assert!(start.elapsed() >= QUARANTINE / 2);
        })
        .unwrap();
    }

    /// A hello whose region memfds could fault us later (not sealed against
    /// shrinking, smaller than announced) or do not match its count is refused
    /// with an error; nothing is mapped and nothing panics.
    #[test]
    fn hostile_region_hellos_are_refused() {
        fn memfd(len: i64, seal: bool) -> OwnedFd {
            let flags = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING;
            // SAFETY: plain syscalls on a fresh descriptor.
            let fd = unsafe { libc::memfd_create(c"hostile".as_ptr(), flags) };
            assert!(fd >= 0);
            // SAFETY: we own it.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            // SAFETY: sizing our own memfd.
            assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), len) }, 0);
            if seal {
                registered::seal_size(fd.as_raw_fd()).unwrap();
            }
            fd
        }
        let cases: [(&str, i64, bool, u64, u32, usize); 5] = [
            // (what, file bytes, sealed, announced bytes, announced count, region fds)
            ("not sealed", 1 << 20, false, 1 << 20, 1, 1),
            ("smaller than announced", 1 << 20, true, 2 << 20, 1, 1),
            (
                "count above the bound",
                1 << 20,
                true,
                1 << 20,
                REGIONS_MAX as u32 + 1,
                1,
            ),
            (
                "fewer descriptors than the count",
                1 << 20,
                true,
                1 << 20,
                2,
                1,
            ),
            ("length not page-sized", 1 << 20, true, 1000, 1, 1),
        ];
        for (what, file, sealed, announced, count, nfds) in cases {
            let mut r = Reactor::new(ReactorConfig::default()).unwrap();
            let res = r
                .block_on(async move {
                    let (a, b) = UnixStream::pair().unwrap();
                    b.set_nonblocking(true).unwrap();
                    let seg = Local::new().unwrap();
                    let mut data = hello_bytes(seg.map.base(), &[]);
                    data[48..52].copy_from_slice(&count.to_le_bytes());
                    data[64..72].copy_from_slice(&0x7f00_0000_0000u64.to_le_bytes());
                    data[72..80].copy_from_slice(&announced.to_le_bytes());
                    let regions: Vec<OwnedFd> = (0..nfds).map(|_| memfd(file, sealed)).collect();
                    let mut fds = vec![
                        seg.memfd.as_raw_fd(),
                        seg.data_efd.as_raw_fd(),
                        seg.space_efd.as_raw_fd(),
                    ];
                    fds.extend(regions.iter().map(|f| f.as_raw_fd()));
                    send_hello_with(&a, &data, &fds).unwrap();
                    recv_hello(&b).await.map(|_| ())
                })
                .unwrap();
            let err = res.expect_err(what);
            assert_eq!(err.kind(), io::ErrorKind::InvalidData, "{what}: {err}");
        }
        // The same hello with a sealed region of the announced size is accepted.
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async move {
            let (a, b) = UnixStream::pair().unwrap();
            b.set_nonblocking(true).unwrap();
            let seg = Local::new().unwrap();
            let mut data = hello_bytes(seg.map.base(), &[]);
            data[48..52].copy_from_slice(&1u32.to_le_bytes());
            data[64..72].copy_from_slice(&0x7f00_0000_0000u64.to_le_bytes());
            data[72..80].copy_from_slice(&(1u64 << 20).to_le_bytes());
            let region = memfd(1 << 20, true);
            let fds = [
                seg.memfd.as_raw_fd(),
                seg.data_efd.as_raw_fd(),
                seg.space_efd.as_raw_fd(),
                region.as_raw_fd(),
            ];
            send_hello_with(&a, &data, &fds).unwrap();
            let remote = recv_hello(&b).await.unwrap();
            assert_eq!(remote.regions.len(), 1);
        })
        .unwrap();
    }

    /// A hello whose doorbells are not eventfds (a pipe: writing the doorbell
    /// could block the reactor thread, or never wake the peer) is refused, each
    /// one in turn.
    #[test]
    fn doorbells_that_are_not_eventfds_are_refused() {
        for which in [1usize, 2] {
            let mut r = Reactor::new(ReactorConfig::default()).unwrap();
            let res = r
                .block_on(async move {
                    let (a, b) = UnixStream::pair().unwrap();
                    b.set_nonblocking(true).unwrap();
                    let seg = Local::new().unwrap();
                    let data = hello_bytes(seg.map.base(), &[]);
                    let mut pipe = [0 as RawFd; 2];
                    // SAFETY: plain syscall into a local array.
                    assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
                    // SAFETY: we own both ends.
                    let ends =
                        unsafe { [OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])] };
                    let mut fds = vec![
                        seg.memfd.as_raw_fd(),
                        seg.data_efd.as_raw_fd(),
                        seg.space_efd.as_raw_fd(),
                    ];
                    fds[which] = ends[1].as_raw_fd();
                    send_hello_with(&a, &data, &fds).unwrap();
                    recv_hello(&b).await.map(|_| ())
                })
                .unwrap();
            let err = res.expect_err("a pipe as doorbell");
            assert!(err.to_string().contains("not an eventfd"), "{err}");
        }
        assert!(is_eventfd(Local::new().unwrap().data_efd.as_raw_fd()));
    }

    /// A receiver whose thread is busy polling costs the sender no system call;
    /// one whose thread sleeps costs a doorbell per wake-up, not per message.
    #[test]
    fn doorbells_only_for_a_sleeping_receiver() {
        use crate::reactor::PollMode;
        // Interrupt: one doorbell per time the receiver went back to sleep during the
        // burst — 1 on a quiet machine, up to 17 seen on a saturated one (the
        // sender is preempted mid-burst); one per message (100) would fail.
        for (mode, min, max) in [(PollMode::Busy, 0, 0), (PollMode::Interrupt, 1, 60)] {
            let (tx, rx) = std::sync::mpsc::channel();
            let receiver = std::thread::spawn(move || {
                let mut r = Reactor::new(ReactorConfig {
                    poll_mode: mode,
                    ..ReactorConfig::default()
                })
                .unwrap();
                r.block_on(async move {
                    let l = ShmListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
                    tx.send(l.local_addr()).unwrap();
                    let super::super::Conn::Shm(s) = l.accept().await.unwrap() else {
                        panic!("accepted over tcp")
                    };
                    for i in 0..100 {
                        assert_eq!(s.recv().await.unwrap().id(), RequestId(i));
                    }
                })
                .unwrap();
            });
            let addr = rx.recv().unwrap();
            let mut r = Reactor::new(ReactorConfig::default()).unwrap();
            let rung = r
                .block_on(async move {
                    let c = ShmConn::connect(addr).await.unwrap().unwrap();
                    // Let the receiver settle into its wait (asleep, or spinning).
                    crate::reactor::sleep(Duration::from_millis(200)).await;
                    for i in 0..100 {
                        c.send(&Message::Ping {
                            id: RequestId(i),
                            epoch: Epoch(1),
                        })
                        .unwrap();
                    }
                    c.doorbells_rung()
                })
                .unwrap();
            receiver.join().unwrap();
            assert!(
                (min..=max).contains(&rung),
                "{mode:?}: {rung} doorbells for 100 messages"
            );
        }
    }

    /// A connected shm pair on this thread (client, accepted).
    async fn shm_pair() -> (Rc<ShmConn>, Rc<ShmConn>) {
        let l = ShmListener::bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = l.local_addr();
        let accepted = crate::reactor::spawn(async move { l.accept().await.unwrap() });
        let c = ShmConn::connect(addr).await.unwrap().unwrap();
        let super::super::Conn::Shm(far) = accepted.await else {
            panic!("accepted over tcp")
        };
        (c, far)
    }

    /// A 1 MiB write, to fill a ring.
    fn megabyte_write() -> Message {
        Message::Write {
            id: RequestId(1),
            epoch: Epoch(1),
            target: crate::protocol::IoTarget {
                pg: crate::ids::PgId(1),
                object: crate::ids::ObjectId {
                    volume: crate::ids::VolumeId(1),
                    index: 0,
                },
                offset: 0,
                length: 1 << 20,
            },
            flags: 0,
            seq: crate::ids::PgSeq(0),
            op: crate::ids::OpId::NONE,
            remote: None,
            data: PayloadBuf::copy_from(&vec![7u8; 1 << 20]),
        }
    }

    /// A wait for the backlog to shrink ends when the peer goes away: its
    /// backlog will never be taken (an OSD waiting to read the next request of
    /// a client that stopped taking replies and then died must not wait for
    /// good).
    #[test]
    fn a_wait_for_the_backlog_ends_when_the_peer_goes() {
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async move {
            let (c, far) = shm_pair().await;
            let ping = megabyte_write();
            // The far side never reads: the ring fills, a backlog builds.
            for _ in 0..64 {
                if c.send_queued_bytes() > 4 << 20 {
                    break;
                }
                c.send(&ping).unwrap();
            }
            assert!(c.send_queued_bytes() > 4 << 20, "no backlog built up");
            let waiting = {
                let c = c.clone();
                crate::reactor::spawn(async move { c.wait_sent_below(1 << 20).await })
            };
            crate::reactor::sleep(Duration::from_millis(50)).await;
            // The far side goes (as a killed process's socket closes).
            far.close();
            let ended = futures_lite::future::or(
                async {
                    waiting.await;
                    true
                },
                async {
                    crate::reactor::sleep(Duration::from_secs(5)).await;
                    false
                },
            )
            .await;
            assert!(ended, "the wait outlived the peer");
        })
        .unwrap();
    }

    /// A peer whose consumer index in its ring goes wrong (past what was
    /// produced, or backwards) breaks the protocol: the connection closes with
    /// an error, on the direct path and on the writer's, and the thread goes on
    /// (the check used to close the connection while its caller held the send
    /// queue borrowed: a panic).
    #[test]
    fn a_peer_whose_consumer_index_goes_wrong_is_closed_without_a_panic() {
        for backlogged in [false, true] {
            let mut r = Reactor::new(ReactorConfig::default()).unwrap();
            r.block_on(async move {
                let (c, _far) = shm_pair().await;
                let big = megabyte_write();
                if backlogged {
                    // The far side never reads: the ring fills, the rest waits
                    // in the backlog for the writer.
                    let mut sent = 0;
                    while c.tx.is_empty() {
                        c.send(&big).unwrap();
                        sent += 1;
                        assert!(sent < 64, "the ring never filled");
                    }
                } else {
                    c.send(&big).unwrap();
                }
                // The far side's consumer index, as this side sees it, jumps
                // past everything produced.
                c.remote
                    .map
                    .u64_at(CTL_CONS)
                    .store(u64::MAX / 2, Ordering::Release);
                if backlogged {
                    // The writer sees the index move and tries the next record.
                    for _ in 0..200 {
                        if c.is_closed() {
                            break;
                        }
                        crate::reactor::sleep(Duration::from_millis(5)).await;
                    }
                } else {
                    let e = c.send(&big).unwrap_err();
                    assert!(e.to_string().contains("consumer index"), "{e}");
                }
                assert!(c.is_closed(), "backlogged {backlogged}: still open");
                assert!(c.send(&big).is_err());
            })
            .unwrap();
        }
    }

    /// A listener's socket is a file in a 0700 directory of its user (created
    /// if missing), reached by a client looking there and removed with the
    /// listener; a stale one a killed listener left is replaced.
    #[test]
    fn the_socket_is_a_file_in_a_private_directory() {
        use std::os::unix::fs::PermissionsExt;
        let cfg = registered::MemoryPoolConfig {
            bytes_per_thread: 4 << 20,
            ..Default::default()
        };
        registered::install_on_this_thread(&cfg).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("sockets");
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async move {
            let l = ShmListener::bind_in(&dir, "127.0.0.1:0".parse().unwrap()).unwrap();
            let addr = l.local_addr();
            let mode = std::fs::metadata(&dir).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700);
            let path = socket_path(&dir, addr);
            assert!(path.exists(), "{}", path.display());
            let accept = crate::reactor::spawn(async move {
                let c = l.accept().await.unwrap();
                (l, c)
            });
            let c = ShmConn::connect_in(&dir, addr).await.unwrap();
            assert!(c.is_some(), "no shm connection");
            let (l, accepted) = accept.await;
            assert!(matches!(accepted, super::super::Conn::Shm(_)));
            drop((c, accepted, l));
            assert!(!path.exists(), "the socket outlived its listener");
            // A file left where the socket goes (a killed listener's) is replaced.
            let stale = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let port_addr = stale.local_addr().unwrap();
            drop(stale);
            std::fs::write(socket_path(&dir, port_addr), b"").unwrap();
            let l = ShmListener::bind_in(&dir, port_addr).unwrap();
            drop(l);
        })
        .unwrap();
    }

    /// A socket directory others could reach into is refused: the listener does
    /// not start (the error names the directory and what is wrong), and a client
    /// uses TCP instead of connecting through it.
    #[test]
    fn a_socket_directory_open_to_others_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("sockets");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = ShmListener::bind_in(&dir, "127.0.0.1:0".parse().unwrap())
            .err()
            .expect("a world-writable directory was used");
        let msg = err.to_string();
        assert!(
            msg.contains(&dir.display().to_string()) && msg.contains("0777"),
            "{msg}"
        );
        let link = tmp.path().join("link");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        let err = ShmListener::bind_in(&link, "127.0.0.1:0".parse().unwrap())
            .err()
            .expect("a symbolic link was followed");
        assert!(err.to_string().contains("symbolic link"), "{err}");
        // A client does not connect through such a directory, even to a socket
        // a real listener put there.
        let good = tmp.path().join("good");
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async move {
            let l = ShmListener::bind_in(&good, "127.0.0.1:0".parse().unwrap()).unwrap();
            std::fs::set_permissions(&good, std::fs::Permissions::from_mode(0o755)).unwrap();
            let c = ShmConn::connect_in(&good, l.local_addr()).await.unwrap();
            assert!(c.is_none(), "connected through a directory open to others");
        })
        .unwrap();
    }

    /// The uid tests' other user (`nobody` on Debian).
    const OTHER_UID: u32 = 65534;

    /// Forks a child that drops to [`OTHER_UID`] and runs `f`, whose two
    /// numbers it writes to the returned pipe before it exits. The child uses
    /// only system calls and this process's already loaded code.
    fn fork_as_other_user(f: impl FnOnce() -> [u64; 2]) -> (libc::pid_t, OwnedFd) {
        // SAFETY: geteuid is a plain syscall.
        assert_eq!(
            unsafe { libc::geteuid() },
            0,
            "this test runs a peer as another user: run it as root (CI does)"
        );
        let mut pipe = [0 as RawFd; 2];
        // SAFETY: plain syscall into a local array.
        assert_eq!(unsafe { libc::pipe(pipe.as_mut_ptr()) }, 0);
        // SAFETY: the child only makes system calls and exits with _exit; glibc
        // keeps malloc usable after fork.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", io::Error::last_os_error());
        if pid == 0 {
            // SAFETY: plain syscalls; the child never returns into the test.
            unsafe {
                libc::close(pipe[0]);
                if libc::setgroups(0, std::ptr::null()) != 0
                    || libc::setresgid(OTHER_UID, OTHER_UID, OTHER_UID) != 0
                    || libc::setresuid(OTHER_UID, OTHER_UID, OTHER_UID) != 0
                {
                    libc::_exit(3);
                }
                // Never outlives the test: killed after 10 s (SIGALRM), and a
                // panic ends it instead of unwinding into the test harness.
                libc::alarm(10);
                let Ok(out) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) else {
                    libc::_exit(4);
                };
                let bytes: [u8; 16] = std::mem::transmute(out);
                libc::write(pipe[1], bytes.as_ptr().cast(), 16);
                libc::_exit(0);
            }
        }
        // SAFETY: we own both ends.
        unsafe { libc::close(pipe[1]) };
        // SAFETY: the read end is ours.
        (pid, unsafe { OwnedFd::from_raw_fd(pipe[0]) })
    }

    /// Waits for the child of [`fork_as_other_user`] and returns its numbers.
    fn child_result(pid: libc::pid_t, pipe: OwnedFd) -> [u64; 2] {
        let mut bytes = [0u8; 16];
        let mut got = 0;
        while got < 16 {
            // SAFETY: reads into the rest of a local array.
            let n =
                unsafe { libc::read(pipe.as_raw_fd(), bytes[got..].as_mut_ptr().cast(), 16 - got) };
            if n <= 0 {
                break;
            }
            got += n as usize;
        }
        let mut status = 0;
        // SAFETY: waits for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0 && got == 16,
            "the other user's process failed (status {status:#x}, {got} bytes)"
        );
        [
            u64::from_ne_bytes(bytes[..8].try_into().unwrap()),
            u64::from_ne_bytes(bytes[8..].try_into().unwrap()),
        ]
    }

    /// Reads from `sock` until it closes or 5 s pass; returns the bytes and the
    /// file descriptors received (closing those).
    fn drain_counting(sock: &UnixStream) -> [u64; 2] {
        sock.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let (mut bytes, mut fds) = (0u64, 0u64);
        let mut buf = [0u8; 4096];
        let mut cmsg = [0u64; 64];
        loop {
            let mut iov = libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: buf.len(),
            };
            // SAFETY: msghdr is plain data; filled in below.
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = cmsg.as_mut_ptr().cast();
            msg.msg_controllen = std::mem::size_of_val(&cmsg) as _;
            // SAFETY: the buffers outlive the call.
            let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
            if n <= 0 {
                return [bytes, fds];
            }
            bytes += n as u64;
            // SAFETY: walks the control messages the kernel wrote.
            unsafe {
                let mut c = libc::CMSG_FIRSTHDR(&msg);
                while !c.is_null() {
                    if (*c).cmsg_type == libc::SCM_RIGHTS {
                        let len = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                        let p = libc::CMSG_DATA(c).cast::<RawFd>();
                        for i in 0..len / std::mem::size_of::<RawFd>() {
                            libc::close(*p.add(i));
                            fds += 1;
                        }
                    }
                    c = libc::CMSG_NXTHDR(&msg, c);
                }
            }
        }
    }

    /// Memory is shared only with the same user (or root), checked on both
    /// sides before anything is sent (`SO_PEERCRED`): a process of another user
    /// that listens where a client connects (a squatter), or that connects to a
    /// listener, gets no byte and no memfd, and the handshake fails naming its
    /// uid. (The 0700 socket directory keeps other users out in the first place;
    /// this is the check behind it, so the directory here is open to them.)
    #[test]
    fn a_peer_of_another_user_receives_no_byte_and_no_memory() {
        use std::io::{Read, Write};
        use std::os::unix::fs::PermissionsExt;
        let cfg = registered::MemoryPoolConfig {
            bytes_per_thread: 4 << 20,
            ..Default::default()
        };
        registered::install_on_this_thread(&cfg).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let peer: SocketAddr = "127.0.0.1:1".parse().unwrap();

        // 1. The squatter listens; we connect and would hand it our memory.
        let path = tmp.path().join("squatter");
        let (ready_tx, ready_rx) = UnixStream::pair().unwrap();
        let squat_path = path.clone();
        let (pid, result) = fork_as_other_user(move || {
            let Ok(l) = std::os::unix::net::UnixListener::bind(&squat_path) else {
                return [u64::MAX, u64::MAX];
            };
            let _ = (&ready_tx).write_all(b"r");
            match l.accept() {
                Ok((s, _)) => drain_counting(&s),
                Err(_) => [u64::MAX, u64::MAX],
            }
        });
        let mut byte = [0u8; 1];
        ready_rx
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        (&ready_rx).read_exact(&mut byte).unwrap();
        let sock = UnixStream::connect(&path).unwrap();
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        let err = r
            .block_on(async move { ShmConn::establish(sock, peer).await.map(|_| ()) })
            .unwrap()
            .expect_err("a handshake with another user's listener");
        assert!(
            err.kind() == io::ErrorKind::PermissionDenied
                && err.to_string().contains(&format!("uid {OTHER_UID}")),
            "{err}"
        );
        assert_eq!(
            child_result(pid, result),
            [0, 0],
            "the squatter received [bytes, fds]"
        );

        // 2. Another user connects to our listening socket.
        let path = tmp.path().join("listener");
        let l = std::os::unix::net::UnixListener::bind(&path).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o777)).unwrap();
        let dial = path.clone();
        let (pid, result) = fork_as_other_user(move || match UnixStream::connect(&dial) {
            Ok(s) => drain_counting(&s),
            Err(_) => [u64::MAX, u64::MAX],
        });
        let (sock, _) = l.accept().unwrap();
        let err = r
            .block_on(async move { ShmConn::establish(sock, peer).await.map(|_| ()) })
            .unwrap()
            .expect_err("a handshake with another user's client");
        assert!(
            err.to_string().contains(&format!("uid {OTHER_UID}")),
            "{err}"
        );
        assert_eq!(
            child_result(pid, result),
            [0, 0],
            "the other user's client received [bytes, fds]"
        );
    }
}
