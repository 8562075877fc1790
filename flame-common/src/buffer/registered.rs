//! The registered memory pool (DESIGN.md §2, technique 4): payload memory carved
//! from per-thread, `memfd`-backed regions in power-of-two size classes, 4 KiB …
//! 4 MiB.
//!
//! # Why per thread
//! Every data-path thread (an OSD shard, a flame-nbd or client reactor) allocates a
//! buffer for each request it receives or reads. With one shared pool the threads
//! contend on its lock (and its cache lines) for every request. Here each thread owns
//! a [`PerThreadPool`]: allocation and free on the owning thread touch only that
//! thread's state — no lock, no atomic read-modify-write. A buffer whose last
//! reference is dropped on another thread (a read reply sent by a connection of
//! another thread, say) goes home through the pool's lock-free bounded queue
//! (`crossbeam_queue::ArrayQueue`), which the owner drains at its next allocation.
//!
//! # Why memfd regions
//! Each pool's memory is one `memfd` mapped shared: a transport can hand the memfd
//! to a same-host peer (the `shm` transport) or register it with an RDMA device once
//! ([`regions`]), and the OSD registers its shard's region with io_uring as fixed
//! buffers, so the disk reads into and writes from the same memory the network
//! uses. [`PayloadBuf::location`](super::PayloadBuf::location) tells where inside a
//! region a buffer lies.
//!
//! # Size classes: a binary buddy allocator
//! A region is a whole number of 4 MiB blocks. A request is rounded up to a power of
//! two between 4 KiB and 4 MiB (its class); a free block of that class is taken, or
//! a larger one split in halves; a freed block merges with its free buddy. Unlike
//! slabs fixed per class, memory freed by one class is available to every other, so
//! a burst of small buffers cannot strand the region.
//!
//! # Bounds and exhaustion
//! A pool never grows: `bytes_per_thread` of region, plus at most
//! `large_bytes_per_thread` of buffers above 4 MiB (flame-nbd receives writes of up
//! to 32 MiB; those come from private mappings, counted against that budget, and are
//! not in a region). When a request cannot be served the allocation is a *miss*:
//! the data path waits for frees ([`super::PayloadBufMut::for_overwrite_wait`]),
//! which stops it reading its socket and so back-pressures the sender; after
//! `exhausted_wait_ms` it gives up with an error that closes the connection (the
//! client retries). See docs/architecture.md, "Memory".
//!
//! # Modes
//! [`PoolMode::Percpu`] is the above; [`PoolMode::Locked`] is one region shared by
//! all threads behind a mutex, kept only to measure what the per-thread design buys;
//! [`PoolMode::Heap`] is the plain [`super::HeapPool`].

use super::{BufferPool, RawBuf, heap_pool, set_thread_pool, this_thread};
use crate::node::{NodeLocal, NodeLocalKey};
use crate::reactor::DIRECT_IO_ALIGN;
use crossbeam_queue::ArrayQueue;
use serde::Deserialize;
use std::cell::UnsafeCell;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::thread::ThreadId;

/// Smallest size class: one page, the `O_DIRECT` alignment.
pub const CLASS_BYTES_MIN: usize = DIRECT_IO_ALIGN;
/// Number of size classes: 4 KiB · 2^0 … 4 KiB · 2^10 = 4 MiB.
pub const CLASS_COUNT: usize = 11;
/// Largest size class (the protocol's largest payload).
pub const CLASS_BYTES_MAX: usize = CLASS_BYTES_MIN << (CLASS_COUNT - 1);
/// Largest `bytes_per_thread` accepted (a bound on a config typo, not a design
/// limit): 16 GiB.
pub const BYTES_PER_THREAD_MAX: u64 = 16 << 30;
/// Largest `large_bytes_per_thread` accepted.
pub const LARGE_BYTES_PER_THREAD_MAX: u64 = 16 << 30;
/// Longest `exhausted_wait_ms` accepted: 10 minutes.
pub const EXHAUSTED_WAIT_MS_MAX: u64 = 600_000;

/// Which pool a daemon's data-path threads allocate payloads from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolMode {
    /// One pool per thread, no lock on the owner's path (the default).
    #[default]
    Percpu,
    /// One pool for all threads behind a mutex: only for the comparison benchmark.
    Locked,
    /// The global allocator / private mappings ([`super::HeapPool`]): unbounded, no
    /// registered memory.
    Heap,
}

impl PoolMode {
    /// The name used in configs and metrics.
    pub fn name(self) -> &'static str {
        match self {
            PoolMode::Percpu => "percpu",
            PoolMode::Locked => "locked",
            PoolMode::Heap => "heap",
        }
    }
}

/// `memory_pool:` section of the OSD, client and flame-nbd configs.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryPoolConfig {
    /// Pool design.
    pub mode: PoolMode,
    /// Registered bytes per data-path thread (a multiple of 4 MiB). In `locked`
    /// mode the one shared pool has this many bytes per thread that uses it.
    pub bytes_per_thread: u64,
    /// Bytes of buffers above 4 MiB (flame-nbd writes up to 32 MiB) one thread may
    /// hold at once; they are private mappings outside the registered region.
    pub large_bytes_per_thread: u64,
    /// How long a data-path allocation waits for frees when the pool is exhausted
    /// before it fails (and the connection that needed it is closed).
    pub exhausted_wait_ms: u64,
    /// Register each OSD shard's region with its io_uring as fixed buffers, so disk
    /// I/O from and to pool buffers skips the per-I/O page pinning.
    pub fixed_buffers: bool,
}

impl Default for MemoryPoolConfig {
    fn default() -> Self {
        MemoryPoolConfig {
            mode: PoolMode::Percpu,
            bytes_per_thread: 64 << 20,
            large_bytes_per_thread: 64 << 20,
            exhausted_wait_ms: 10_000,
            fixed_buffers: true,
        }
    }
}

impl MemoryPoolConfig {
    /// Checks the values; `Err((key, message))` names the bad one (keys are
    /// relative to the `memory_pool` section).
    pub fn validate(&self) -> Result<(), (String, String)> {
        let b = self.bytes_per_thread;
        if b < CLASS_BYTES_MAX as u64
            || b > BYTES_PER_THREAD_MAX
            || !b.is_multiple_of(CLASS_BYTES_MAX as u64)
        {
            return Err((
                "memory_pool.bytes_per_thread".into(),
                format!(
                    "must be a multiple of 4 MiB between 4 MiB and {BYTES_PER_THREAD_MAX} (got {b})"
                ),
            ));
        }
        if self.large_bytes_per_thread > LARGE_BYTES_PER_THREAD_MAX {
            return Err((
                "memory_pool.large_bytes_per_thread".into(),
                format!("must be at most {LARGE_BYTES_PER_THREAD_MAX}"),
            ));
        }
        if self.exhausted_wait_ms > EXHAUSTED_WAIT_MS_MAX {
            return Err((
                "memory_pool.exhausted_wait_ms".into(),
                format!("must be at most {EXHAUSTED_WAIT_MS_MAX}"),
            ));
        }
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// Regions

/// Source of process-unique region ids (0 is never used).
static NEXT_REGION_ID: AtomicU32 = AtomicU32::new(1);

/// One `memfd` mapped shared and read-write: the memory a pool carves buffers from.
/// Unmapped when its pool (and with it every buffer, which holds the pool) is gone.
pub struct Region {
    id: u32,
    base: NonNull<u8>,
    len: usize,
    memfd: Arc<OwnedFd>,
}

// SAFETY: the region is plain shared memory; who may write which part of it is
// decided by the allocator that hands the parts out.
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    /// Creates and maps a memfd of `len` bytes (a multiple of the page size).
    fn new(len: usize, name: &str) -> std::io::Result<Arc<Region>> {
        let cname = std::ffi::CString::new(format!("flame-pool-{name}"))
            .map_err(|_| std::io::Error::other("pool name contains NUL"))?;
        // SAFETY: a valid C string; memfd_create returns a new descriptor or -1.
        let fd = unsafe {
            libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor we own.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        let size = libc::off_t::try_from(len)
            .map_err(|_| std::io::Error::other("region too large for off_t"))?;
        // SAFETY: sizing our own memfd.
        if unsafe { libc::ftruncate(memfd.as_raw_fd(), size) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        seal_size(memfd.as_raw_fd())?;
        // SAFETY: a new shared mapping of our memfd; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                memfd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let base = NonNull::new(p.cast::<u8>()).ok_or_else(|| std::io::Error::other("null map"))?;
        let region = Arc::new(Region {
            id: NEXT_REGION_ID.fetch_add(1, Ordering::Relaxed),
            base,
            len,
            memfd: Arc::new(memfd),
        });
        let mut all = registry().regions.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&region));
        Ok(region)
    }

    /// What a transport needs to know about it.
    fn info(&self) -> RegionInfo {
        RegionInfo {
            id: self.id,
            base: self.base.as_ptr() as usize,
            len: self.len,
            memfd: self.memfd.clone(),
        }
    }

    fn contains(&self, ptr: *const u8) -> bool {
        let p = ptr as usize;
        let b = self.base.as_ptr() as usize;
        p >= b && p < b + self.len
    }
}

/// Seals a memfd's size for good (no shrink, no grow, no more seals). A same-host
/// peer that maps the memfd (the `shm` transport) checks the seal: a file that
/// could shrink under its mapping would make its accesses fault (SIGBUS) and kill
/// it, and a peer must never be able to crash us that way.
pub(crate) fn seal_size(fd: std::os::fd::RawFd) -> std::io::Result<()> {
    let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
    // SAFETY: plain fcntl on a descriptor the caller owns.
    if unsafe { libc::fcntl(fd, libc::F_ADD_SEALS, seals) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Whether a memfd received from a peer can never shrink below `len` bytes: sealed
/// against shrinking, at least that large now, and ordinary shared memory (tmpfs:
/// a hugetlbfs memfd with a hole punched in it could SIGBUS us on a fault when no
/// huge page is free).
pub(crate) fn size_sealed_at_least(fd: std::os::fd::RawFd, len: u64) -> bool {
    // SAFETY: statfs is plain data; fstatfs fills it.
    let mut sfs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: plain syscall on a descriptor the caller owns.
    if unsafe { libc::fstatfs(fd, &mut sfs) } < 0 {
        return false;
    }
    // f_type's integer type differs between targets; compare as i64.
    #[allow(clippy::unnecessary_cast)]
    let tmpfs = sfs.f_type as i64 == libc::TMPFS_MAGIC as i64;
    if !tmpfs {
        return false;
    }
    // SAFETY: plain fcntl; -1 (not a memfd, no sealing) is a refusal.
    let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return false;
    }
    // SAFETY: stat is plain data; fstat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: plain syscall on a descriptor the caller owns.
    if unsafe { libc::fstat(fd, &mut st) } < 0 {
        return false;
    }
    u64::try_from(st.st_size).is_ok_and(|size| size >= len)
}

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: mapped in `new` with exactly this length; the region is dropped
        // only when no buffer refers to it any more (buffers hold the pool, the pool
        // holds the region).
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// A registered region as a transport sees it (DESIGN.md §2 contract).
#[derive(Clone, Debug)]
pub struct RegionInfo {
    /// Process-unique id; [`super::PayloadBuf::location`] names it.
    pub id: u32,
    /// Address of the first byte in this process.
    pub base: usize,
    /// Bytes.
    pub len: usize,
    /// The memfd behind it (kept open while this value lives), to pass to a
    /// same-host peer or register with a device.
    pub memfd: Arc<OwnedFd>,
}

/// Every live registered region of this process (all threads' pools), for a
/// transport to share or register once.
pub fn regions() -> Vec<RegionInfo> {
    let all = registry().regions.lock().unwrap_or_else(|e| e.into_inner());
    all.iter()
        .filter_map(Weak::upgrade)
        .map(|r| r.info())
        .collect()
}

/// The regions the calling thread's current pool allocates from (empty for the heap
/// pool): what an OSD shard registers with its io_uring.
pub fn thread_regions() -> Vec<RegionInfo> {
    let pool = super::thread_pool();
    let any = pool.regions();
    any.iter().map(|r| r.info()).collect()
}

// ---------------------------------------------------------------------------
// The buddy allocator (single-threaded; the pools decide who may call it)

const NIL: u32 = u32::MAX;

/// Free lists per order over one region's pages.
struct Buddy {
    /// Head of each order's free list (a page index, or NIL).
    heads: [u32; CLASS_COUNT],
    /// Per page: `order + 1` if a free block of that order starts here, else 0.
    free_order: Vec<u8>,
    /// Per page: `order + 1` if an allocated block of that order starts here.
    used_order: Vec<u8>,
    /// Intrusive doubly-linked free lists, indexed by page.
    next: Vec<u32>,
    prev: Vec<u32>,
}

impl Buddy {
    /// `pages` must be a multiple of the largest block's pages.
    fn new(pages: usize) -> Buddy {
        let top = 1usize << (CLASS_COUNT - 1);
        assert!(pages > 0 && pages.is_multiple_of(top) && pages < NIL as usize);
        let mut b = Buddy {
            heads: [NIL; CLASS_COUNT],
            free_order: vec![0; pages],
            used_order: vec![0; pages],
            next: vec![NIL; pages],
            prev: vec![NIL; pages],
        };
        for page in (0..pages).step_by(top).rev() {
            b.push(page as u32, CLASS_COUNT - 1);
        }
        b
    }

    fn push(&mut self, page: u32, order: usize) {
        let p = page as usize;
        let head = self.heads[order];
        self.next[p] = head;
        self.prev[p] = NIL;
        if head != NIL {
            self.prev[head as usize] = page;
        }
        self.heads[order] = page;
        self.free_order[p] = order as u8 + 1;
    }

    fn unlink(&mut self, page: u32, order: usize) {
        let p = page as usize;
        let (n, pr) = (self.next[p], self.prev[p]);
        if pr == NIL {
            self.heads[order] = n;
        } else {
            self.next[pr as usize] = n;
        }
        if n != NIL {
            self.prev[n as usize] = pr;
        }
        self.free_order[p] = 0;
    }

    /// A block of `order`: its first page, or `None` when nothing large enough is free.
    fn alloc(&mut self, order: usize) -> Option<u32> {
        let mut k = (order..CLASS_COUNT).find(|&k| self.heads[k] != NIL)?;
        let page = self.heads[k];
        self.unlink(page, k);
        while k > order {
            k -= 1;
            self.push(page + (1 << k), k);
        }
        self.used_order[page as usize] = order as u8 + 1;
        Some(page)
    }

    /// Frees the block of `order` at `page`, merging with free buddies.
    fn free(&mut self, page: u32, order: usize) {
        let p = page as usize;
        assert_eq!(
            self.used_order[p],
            order as u8 + 1,
            "pool: freeing page {page} (order {order}) that is not allocated at that order"
        );
        self.used_order[p] = 0;
        let (mut page, mut order) = (page, order);
        while order < CLASS_COUNT - 1 {
            let buddy = page ^ (1 << order);
            if self.free_order[buddy as usize] != order as u8 + 1 {
                break;
            }
            self.unlink(buddy, order);
            page = page.min(buddy);
            order += 1;
        }
        self.push(page, order);
    }
}

/// The class (buddy order) of a request of `len` bytes (1 ≤ len ≤ 4 MiB).
pub fn class_of(len: usize) -> usize {
    let pages = len.div_ceil(CLASS_BYTES_MIN).max(1);
    pages.next_power_of_two().trailing_zeros() as usize
}

/// Bytes of class `class`.
pub fn class_bytes(class: usize) -> usize {
    CLASS_BYTES_MIN << class
}

// ---------------------------------------------------------------------------
// Statistics: written by one thread (the owner, or the holder of the lock) with a
// plain load + store, read by the metrics scrape.

/// Counters of one pool, for Prometheus (see [`crate::metrics`]).
#[derive(Default)]
pub struct PoolStats {
    /// Allocations served from the pool.
    pub hits: AtomicU64,
    /// Allocations the pool could not serve (exhausted, or over the large budget).
    pub misses: AtomicU64,
    /// Buffers freed on another thread and returned through the queue.
    pub remote_frees: AtomicU64,
    /// Bytes handed out per class (index [`CLASS_COUNT`]: buffers above 4 MiB).
    pub bytes_in_use: [AtomicU64; CLASS_COUNT + 1],
    /// Region bytes.
    pub capacity_bytes: AtomicU64,
}

/// Adds `d` (wrapping, so a subtraction is `d.wrapping_neg()`) by load + store:
/// only one thread ever writes a given counter, so no read-modify-write is needed.
fn bump(a: &AtomicU64, d: u64) {
    a.store(a.load(Ordering::Relaxed).wrapping_add(d), Ordering::Relaxed);
}

/// A pool as the metrics scrape sees it.
#[derive(Clone)]
pub struct PoolSnapshot {
    /// Thread name (`shard-0`, `nbd-1`, …) or `shared` for the locked pool.
    pub thread: String,
    /// Mode name.
    pub mode: &'static str,
    /// The counters.
    pub stats: Arc<PoolStats>,
}

struct Registry {
    regions: Mutex<Vec<Weak<Region>>>,
    pools: Mutex<Vec<(String, &'static str, Weak<PoolStats>)>>,
}

fn registry() -> &'static Registry {
    static R: OnceLock<Registry> = OnceLock::new();
    R.get_or_init(|| Registry {
        regions: Mutex::new(Vec::new()),
        pools: Mutex::new(Vec::new()),
    })
}

fn register_stats(thread: String, mode: &'static str, stats: &Arc<PoolStats>) {
    let mut all = registry().pools.lock().unwrap_or_else(|e| e.into_inner());
    all.retain(|(_, _, w)| w.strong_count() > 0);
    all.push((thread, mode, Arc::downgrade(stats)));
}

/// Every live pool's counters.
pub fn pool_snapshots() -> Vec<PoolSnapshot> {
    let all = registry().pools.lock().unwrap_or_else(|e| e.into_inner());
    all.iter()
        .filter_map(|(t, m, w)| {
            w.upgrade().map(|stats| PoolSnapshot {
                thread: t.clone(),
                mode: m,
                stats,
            })
        })
        .collect()
}

/// Allocations on pooled threads that found the pool exhausted and were served by
/// the heap instead: only the synchronous constructors do that (control-plane
/// replies, copies of a caller's slice); the data path waits instead.
pub static HEAP_FALLBACKS: AtomicU64 = AtomicU64::new(0);

// ---------------------------------------------------------------------------
// Large buffers (> 4 MiB): private mappings against a per-pool budget.

const TOKEN_LARGE: u64 = 1 << 63;

fn map_large(len: usize) -> Option<RawBuf> {
    let cap = len.checked_next_multiple_of(DIRECT_IO_ALIGN)?;
    // SAFETY: an anonymous private mapping; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            cap,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    Some(RawBuf {
        ptr: NonNull::new(p.cast::<u8>())?,
        cap,
        token: TOKEN_LARGE,
        zeroed: true,
    })
}

fn unmap_large(ptr: NonNull<u8>, cap: usize) {
    // SAFETY: mapped by `map_large` with exactly `cap` bytes; its last buffer is gone.
    unsafe { libc::munmap(ptr.as_ptr().cast(), cap) };
}

// ---------------------------------------------------------------------------
// The allocator state both pool kinds wrap.

/// Allocations between two looks at a per-thread pool's return queue.
const DRAIN_EVERY: u32 = 32;

struct Arena {
    region: Arc<Region>,
    /// Allocations since the return queue was last drained (per-thread pools).
    allocs_since_drain: u32,
    buddy: Buddy,
    large_bytes: u64,
    large_bytes_max: u64,
    stats: Arc<PoolStats>,
}

impl Arena {
    fn new(cfg: &MemoryPoolConfig, bytes: u64, name: &str) -> std::io::Result<Arena> {
        let len = usize::try_from(bytes).map_err(|_| std::io::Error::other("pool too large"))?;
        if len == 0 || !len.is_multiple_of(CLASS_BYTES_MAX) || len / CLASS_BYTES_MIN >= NIL as usize
        {
            return Err(std::io::Error::other(format!(
                "pool size {len} is not a positive multiple of 4 MiB below 16 TiB"
            )));
        }
        let region = Region::new(len, name)?;
        let stats = Arc::new(PoolStats::default());
        stats.capacity_bytes.store(bytes, Ordering::Relaxed);
        Ok(Arena {
            allocs_since_drain: 0,
            buddy: Buddy::new(len / CLASS_BYTES_MIN),
            region,
            large_bytes: 0,
            large_bytes_max: cfg.large_bytes_per_thread,
            stats,
        })
    }

    /// Memory for `len` bytes, or `None` (the caller counts the miss).
    fn allocate(&mut self, len: usize) -> Option<RawBuf> {
        let len = len.max(1);
        if len > CLASS_BYTES_MAX {
            let cap = len.checked_next_multiple_of(DIRECT_IO_ALIGN)? as u64;
            if self.large_bytes + cap > self.large_bytes_max {
                return None;
            }
            let raw = map_large(len)?;
            self.large_bytes += cap;
            bump(&self.stats.hits, 1);
            bump(&self.stats.bytes_in_use[CLASS_COUNT], cap);
            return Some(raw);
        }
        let class = class_of(len);
        let page = self.buddy.alloc(class)?;
        let off = page as usize * CLASS_BYTES_MIN;
        let cap = class_bytes(class);
        debug_assert!(off + cap <= self.region.len);
        bump(&self.stats.hits, 1);
        bump(&self.stats.bytes_in_use[class], cap as u64);
        Some(RawBuf {
            // SAFETY: off + cap ≤ region.len, so the pointer stays in the mapping.
            ptr: unsafe { NonNull::new_unchecked(self.region.base.as_ptr().add(off)) },
            cap,
            token: (page as u64) << 8 | class as u64,
            zeroed: false,
        })
    }

    fn release(&mut self, ptr: NonNull<u8>, cap: usize, token: u64) {
        if token & TOKEN_LARGE != 0 {
            unmap_large(ptr, cap);
            self.large_bytes -= cap as u64;
            bump(
                &self.stats.bytes_in_use[CLASS_COUNT],
                (cap as u64).wrapping_neg(),
            );
            return;
        }
        let class = (token & 0xff) as usize;
        let page = (token >> 8) as u32;
        assert!(
            class < CLASS_COUNT && cap == class_bytes(class) && self.region.contains(ptr.as_ptr()),
            "pool: released a buffer it did not hand out"
        );
        self.buddy.free(page, class);
        bump(&self.stats.bytes_in_use[class], (cap as u64).wrapping_neg());
    }

    fn location(&self, ptr: *const u8) -> Option<(u32, u64)> {
        self.region.contains(ptr).then(|| {
            (
                self.region.id,
                (ptr as usize - self.region.base.as_ptr() as usize) as u64,
            )
        })
    }
}

// ---------------------------------------------------------------------------
// The per-thread pool

/// One thread's pool. Its allocator state is touched only on the owning thread
/// (checked on every call); other threads only push to its return queue.
pub struct PerThreadPool {
    owner: ThreadId,
    arena: UnsafeCell<Arena>,
    /// Buffers released on other threads: (address, capacity, token). Its capacity
    /// is the most buffers that can be out at once, so a push never fails.
    returns: ArrayQueue<(usize, usize, u64)>,
    region: Arc<Region>,
    stats: Arc<PoolStats>,
}

// SAFETY: `arena` is only accessed on `owner` (every access checks
// `this_thread() == owner`); the rest is Sync.
unsafe impl Sync for PerThreadPool {}
// SAFETY: as above; the raw pointers inside are to the pool's own mapping.
unsafe impl Send for PerThreadPool {}

impl PerThreadPool {
    /// A pool owned by the calling thread.
    pub fn new(cfg: &MemoryPoolConfig) -> std::io::Result<Arc<PerThreadPool>> {
        let name = std::thread::current()
            .name()
            .unwrap_or("unnamed")
            .to_string();
        let arena = Arena::new(cfg, cfg.bytes_per_thread, &name)?;
        let pages = arena.buddy.free_order.len();
        let large_max = (cfg.large_bytes_per_thread as usize / (CLASS_BYTES_MAX + 1)) + 1;
        let stats = arena.stats.clone();
        register_stats(name, PoolMode::Percpu.name(), &stats);
        Ok(Arc::new(PerThreadPool {
            owner: this_thread(),
            region: arena.region.clone(),
            arena: UnsafeCell::new(arena),
            returns: ArrayQueue::new(pages + large_max),
            stats,
        }))
    }

    /// The owner's arena.
    ///
    /// # Safety
    /// Only on the owning thread, and the returned reference must not outlive the
    /// call it is made for (no re-entrancy: nothing called while it is held
    /// allocates or releases from this pool).
    #[allow(clippy::mut_from_ref)]
    unsafe fn arena(&self) -> &mut Arena {
        debug_assert_eq!(this_thread(), self.owner);
        // SAFETY: the caller's contract.
        unsafe { &mut *self.arena.get() }
    }

    /// Takes back what other threads released (bounded: the queue's length).
    fn drain_returns(&self, arena: &mut Arena) {
        let mut n = 0;
        while let Some((addr, cap, token)) = self.returns.pop() {
            if let Some(ptr) = NonNull::new(addr as *mut u8) {
                arena.release(ptr, cap, token);
            }
            n += 1;
        }
        if n > 0 {
            bump(&self.stats.remote_frees, n);
        }
    }

    /// The counters.
    pub fn stats(&self) -> &Arc<PoolStats> {
        &self.stats
    }
}

impl Drop for PerThreadPool {
    fn drop(&mut self) {
        // Large buffers returned after the owner stopped allocating are private
        // mappings of their own: unmap them (region memory goes with the region).
        while let Some((addr, cap, token)) = self.returns.pop() {
            if token & TOKEN_LARGE != 0
                && let Some(ptr) = NonNull::new(addr as *mut u8)
            {
                unmap_large(ptr, cap);
            }
        }
    }
}

// SAFETY: the buddy allocator hands out disjoint blocks of the mapped region (or
// fresh mappings), 4 KiB-aligned (blocks start at page multiples of a page-aligned
// mapping), never handed out again until released; memfd pages read as zero when
// fresh and hold old payload bytes later, initialised either way.
unsafe impl BufferPool for PerThreadPool {
    fn name(&self) -> &'static str {
        "percpu"
    }

    fn allocate(&self, len: usize) -> Option<RawBuf> {
        if this_thread() != self.owner {
            // Another thread with this pool installed: a wiring bug; let the caller
            // fall back as on exhaustion rather than touch the owner's state.
            debug_assert!(false, "per-thread pool used on a foreign thread");
            return None;
        }
        // SAFETY: on the owner; the reference lives for this call only.
        let arena = unsafe { self.arena() };
        // The return queue is drained every DRAIN_EVERY allocations, and at once
        // when the pool cannot serve one: looking at the queue reads cache lines
        // the freeing threads write, so doing it on every allocation would bounce
        // them between cores at the allocation rate.
        arena.allocs_since_drain += 1;
        if arena.allocs_since_drain >= DRAIN_EVERY {
            arena.allocs_since_drain = 0;
            self.drain_returns(arena);
        }
        if let Some(raw) = arena.allocate(len) {
            return Some(raw);
        }
        self.drain_returns(arena);
        let raw = arena.allocate(len);
        if raw.is_none() {
            bump(&self.stats.misses, 1);
        }
        raw
    }

    unsafe fn release(&self, raw: RawBuf, _home: ThreadId) {
        if this_thread() == self.owner {
            // SAFETY: on the owner; the reference lives for this call only.
            let arena = unsafe { self.arena() };
            arena.release(raw.ptr, raw.cap, raw.token);
            return;
        }
        if self
            .returns
            .push((raw.ptr.as_ptr() as usize, raw.cap, raw.token))
            .is_err()
        {
            // Cannot happen: the queue holds as many entries as buffers can be
            // out. Leaking is the safe answer if it ever did.
            debug_assert!(false, "pool return queue full");
            tracing::error!("memory pool return queue full: buffer leaked");
        }
    }

    fn location(&self, ptr: *const u8) -> Option<(u32, u64)> {
        self.region.contains(ptr).then(|| {
            (
                self.region.id,
                (ptr as usize - self.region.base.as_ptr() as usize) as u64,
            )
        })
    }

    fn regions(&self) -> Vec<Arc<Region>> {
        vec![self.region.clone()]
    }
}

// ---------------------------------------------------------------------------
// The locked pool (comparison only)

/// One pool shared by every thread, behind a mutex.
pub struct LockedPool {
    arena: parking_lot::Mutex<Arena>,
    region: Arc<Region>,
}

impl LockedPool {
    /// A pool of `bytes` (a multiple of 4 MiB).
    pub fn new(cfg: &MemoryPoolConfig, bytes: u64) -> std::io::Result<Arc<LockedPool>> {
        let arena = Arena::new(cfg, bytes, "shared")?;
        register_stats("shared".into(), PoolMode::Locked.name(), &arena.stats);
        Ok(Arc::new(LockedPool {
            region: arena.region.clone(),
            arena: parking_lot::Mutex::new(arena),
        }))
    }
}

// SAFETY: as for PerThreadPool; the mutex serialises every access to the arena.
unsafe impl BufferPool for LockedPool {
    fn name(&self) -> &'static str {
        "locked"
    }

    fn allocate(&self, len: usize) -> Option<RawBuf> {
        let mut arena = self.arena.lock();
        let raw = arena.allocate(len);
        if raw.is_none() {
            bump(&arena.stats.misses, 1);
        }
        raw
    }

    unsafe fn release(&self, raw: RawBuf, _home: ThreadId) {
        self.arena.lock().release(raw.ptr, raw.cap, raw.token);
    }

    fn location(&self, ptr: *const u8) -> Option<(u32, u64)> {
        self.arena.lock().location(ptr)
    }

    fn regions(&self) -> Vec<Arc<Region>> {
        vec![self.region.clone()]
    }
}

// ---------------------------------------------------------------------------
// Installing pools on threads

/// Builds and installs the configured pool on each data-path thread.
pub struct PoolInstaller {
    cfg: MemoryPoolConfig,
    /// The one shared pool in `locked` mode.
    locked: Option<Arc<LockedPool>>,
}

impl PoolInstaller {
    /// For a daemon with `threads` data-path threads (sizes the locked pool).
    pub fn new(cfg: &MemoryPoolConfig, threads: usize) -> std::io::Result<PoolInstaller> {
        register_metrics();
        let locked = match cfg.mode {
            PoolMode::Locked => {
                let bytes = cfg
                    .bytes_per_thread
                    .checked_mul(threads.max(1) as u64)
                    .ok_or_else(|| std::io::Error::other("locked pool size overflows"))?;
                Some(LockedPool::new(cfg, bytes)?)
            }
            _ => None,
        };
        Ok(PoolInstaller {
            cfg: cfg.clone(),
            locked,
        })
    }

    /// Makes the configured pool the calling thread's pool.
    pub fn install(&self) -> std::io::Result<()> {
        let pool: Arc<dyn BufferPool> = match self.cfg.mode {
            PoolMode::Percpu => PerThreadPool::new(&self.cfg)?,
            PoolMode::Locked => match &self.locked {
                Some(p) => p.clone(),
                None => return Err(std::io::Error::other("locked pool missing")),
            },
            PoolMode::Heap => heap_pool(),
        };
        set_thread_pool(pool);
        set_thread_wait_ms(self.cfg.exhausted_wait_ms);
        set_thread_source_share_bytes(source_share_bytes(self.cfg.bytes_per_thread));
        Ok(())
    }

    /// The configuration.
    pub fn config(&self) -> &MemoryPoolConfig {
        &self.cfg
    }
}

thread_local! {
    // Per process (per simulated node: [`crate::node`]), like the pool.
    static WAIT_MS: NodeLocal<std::cell::Cell<u64>> =
        const { NodeLocal::new(|| std::cell::Cell::new(10_000)) };
    static SHARE_BYTES: NodeLocal<std::cell::Cell<u64>> =
        const { NodeLocal::new(|| std::cell::Cell::new(source_share_bytes(64 << 20))) };
}

pub(crate) fn set_thread_wait_ms(ms: u64) {
    WAIT_MS.with_node(|w| w.set(ms));
}

/// Sets the calling thread's share per source (the installer, from the
/// pool's size; tests).
pub(crate) fn set_thread_source_share_bytes(bytes: u64) {
    SHARE_BYTES.with_node(|s| s.set(bytes));
}

/// The calling thread's share per source for unfinished payloads
/// ([`crate::transport::receive_share`]): its installed pool's
/// ([`source_share_bytes`]), else the default pool's.
pub fn thread_source_share_bytes() -> u64 {
    SHARE_BYTES.with_node(|s| s.get())
}

/// Each source's share of a pool of `bytes_per_thread` for its unfinished
/// payloads ([`crate::transport::receive_share`]): a quarter of the pool, at
/// least two of the largest pooled buffers.
pub const fn source_share_bytes(bytes_per_thread: u64) -> u64 {
    let quarter = bytes_per_thread / 4;
    let floor = 2 * CLASS_BYTES_MAX as u64;
    if quarter > floor { quarter } else { floor }
}

/// How long the calling thread's data-path allocations wait on an exhausted pool.
pub fn thread_wait_ms() -> u64 {
    WAIT_MS.with_node(|w| w.get())
}

/// Installs the pool `cfg` describes on the calling thread, for a daemon thread
/// that is the only user of its settings (a one-thread client).
pub fn install_on_this_thread(cfg: &MemoryPoolConfig) -> std::io::Result<()> {
    PoolInstaller::new(cfg, 1)?.install()
}

// ---------------------------------------------------------------------------
// Prometheus

/// Exposes every pool's counters in the process's default Prometheus registry:
/// `flame_pool_hits_total`, `flame_pool_misses_total`, `flame_pool_remote_frees_total`
/// (labels `thread`, `mode`), `flame_pool_bytes_in_use` (plus `class`: the class's
/// bytes, or `large`), `flame_pool_capacity_bytes`, and
/// `flame_pool_heap_fallbacks_total`. Values are read at scrape time from the
/// pools' own counters, so the allocation path does no metrics work beyond a
/// thread-local store. Idempotent.
pub fn register_metrics() {
    static DONE: OnceLock<()> = OnceLock::new();
    DONE.get_or_init(|| {
        if let Some(c) = PoolCollector::new()
            && let Err(e) = prometheus::register(Box::new(c))
        {
            tracing::warn!("memory pool metrics not registered: {e}");
        }
    });
}

struct PoolCollector {
    descs: Vec<prometheus::core::Desc>,
}

struct PoolFamilies {
    hits: prometheus::IntCounterVec,
    misses: prometheus::IntCounterVec,
    remote: prometheus::IntCounterVec,
    in_use: prometheus::IntGaugeVec,
    capacity: prometheus::IntGaugeVec,
    fallbacks: prometheus::IntCounter,
}

impl PoolFamilies {
    fn new() -> Result<PoolFamilies, prometheus::Error> {
        use prometheus::{IntCounter, IntCounterVec, IntGaugeVec, Opts};
        let l = &["thread", "mode"];
        Ok(PoolFamilies {
            hits: IntCounterVec::new(
                Opts::new(
                    "flame_pool_hits_total",
                    "Payload allocations served by the memory pool",
                ),
                l,
            )?,
            misses: IntCounterVec::new(
                Opts::new(
                    "flame_pool_misses_total",
                    "Payload allocations the memory pool could not serve (exhausted)",
                ),
                l,
            )?,
            remote: IntCounterVec::new(
                Opts::new(
                    "flame_pool_remote_frees_total",
                    "Buffers freed on another thread and returned through the queue",
                ),
                l,
            )?,
            in_use: IntGaugeVec::new(
                Opts::new(
                    "flame_pool_bytes_in_use",
                    "Pool bytes handed out, per size class",
                ),
                &["thread", "mode", "class"],
            )?,
            capacity: IntGaugeVec::new(
                Opts::new("flame_pool_capacity_bytes", "Registered bytes of each pool"),
                l,
            )?,
            fallbacks: IntCounter::new(
                "flame_pool_heap_fallbacks_total",
                "Synchronous allocations served by the heap because the pool was exhausted",
            )?,
        })
    }

    fn collectors(&self) -> [&dyn prometheus::core::Collector; 6] {
        [
            &self.hits,
            &self.misses,
            &self.remote,
            &self.in_use,
            &self.capacity,
            &self.fallbacks,
        ]
    }
}

impl PoolCollector {
    fn new() -> Option<PoolCollector> {
        let f = PoolFamilies::new().ok()?;
        let descs = f
            .collectors()
            .iter()
            .flat_map(|c| c.desc().into_iter().cloned())
            .collect();
        Some(PoolCollector { descs })
    }
}

impl prometheus::core::Collector for PoolCollector {
    fn desc(&self) -> Vec<&prometheus::core::Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<prometheus::proto::MetricFamily> {
        let Ok(f) = PoolFamilies::new() else {
            return Vec::new();
        };
        for s in pool_snapshots() {
            let l = [s.thread.as_str(), s.mode];
            let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
            f.hits.with_label_values(&l).inc_by(get(&s.stats.hits));
            f.misses.with_label_values(&l).inc_by(get(&s.stats.misses));
            f.remote
                .with_label_values(&l)
                .inc_by(get(&s.stats.remote_frees));
            f.capacity
                .with_label_values(&l)
                .set(get(&s.stats.capacity_bytes) as i64);
            for (class, a) in s.stats.bytes_in_use.iter().enumerate() {
                let name = if class < CLASS_COUNT {
                    class_bytes(class).to_string()
                } else {
                    "large".to_string()
                };
                f.in_use
                    .with_label_values(&[s.thread.as_str(), s.mode, name.as_str()])
                    .set(get(a) as i64);
            }
        }
        f.fallbacks.inc_by(HEAP_FALLBACKS.load(Ordering::Relaxed));
        f.collectors().iter().flat_map(|c| c.collect()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::{PayloadBuf, PayloadBufMut, thread_pool};
    use super::*;
    use crate::reactor::{IoBuf, Reactor, ReactorConfig};

    fn cfg(bytes: u64) -> MemoryPoolConfig {
        MemoryPoolConfig {
            bytes_per_thread: bytes,
            large_bytes_per_thread: 12 << 20,
            exhausted_wait_ms: 50,
            ..MemoryPoolConfig::default()
        }
    }

    /// Installs a per-thread pool of `bytes` on this (test) thread and returns its stats.
    fn install(bytes: u64) -> Arc<PoolStats> {
        install_on_this_thread(&cfg(bytes)).unwrap();
        let snaps = pool_snapshots();
        let me = std::thread::current()
            .name()
            .unwrap_or("unnamed")
            .to_string();
        // The newest pool of this thread's name.
        snaps
            .iter()
            .rev()
            .find(|s| s.thread == me && s.mode == "percpu")
            .unwrap()
            .stats
            .clone()
    }

    fn in_use(stats: &PoolStats) -> u64 {
        stats
            .bytes_in_use
            .iter()
            .map(|a| a.load(Ordering::Relaxed))
            .sum()
    }

    #[test]
    fn every_class_is_served_aligned_in_the_region_and_given_back() {
        let stats = install(8 << 20);
        let region = thread_regions();
        assert_eq!(region.len(), 1);
        let (id, base, len) = (region[0].id, region[0].base, region[0].len);
        assert_eq!(len, 8 << 20);
        assert!(
            regions()
                .iter()
                .any(|r| r.id == id && r.memfd.as_raw_fd() >= 0)
        );
        for class in 0..CLASS_COUNT {
            for len in [class_bytes(class), class_bytes(class) / 2 + 1] {
                let mut b = PayloadBufMut::for_overwrite(len);
                assert_eq!(b.pool_name(), Some("percpu"));
                assert_eq!(b.len(), len);
                assert_eq!(b.as_ptr() as usize % DIRECT_IO_ALIGN, 0);
                let (rid, off) = b.location().unwrap();
                assert_eq!(rid, id);
                assert_eq!(b.as_ptr() as usize, base + off as usize);
                assert!(off as usize + len <= 8 << 20);
                assert!(
                    off.is_multiple_of(class_bytes(class_of(len)) as u64),
                    "buddy alignment"
                );
                b.as_mut_slice().fill(class as u8);
                assert_eq!(
                    stats.bytes_in_use[class_of(len)].load(Ordering::Relaxed),
                    class_bytes(class_of(len)) as u64
                );
                let f = b.freeze();
                assert_eq!(
                    f.slice(len / 2..len).location(),
                    Some((id, off + (len / 2) as u64))
                );
            }
        }
        assert_eq!(in_use(&stats), 0, "every buffer went back");
        assert_eq!(class_of(1), 0);
        assert_eq!(class_of(4097), 1);
        assert_eq!(class_of(CLASS_BYTES_MAX), CLASS_COUNT - 1);
        // Zeroed buffers are cleared even when recycled.
        let z = PayloadBufMut::zeroed(4096);
        assert!(z.as_slice().iter().all(|&x| x == 0));
        set_thread_pool(heap_pool());
        assert_eq!(PayloadBuf::copy_from(b"x").location(), None, "heap memory");
    }

    #[test]
    fn exhaustion_is_a_miss_until_something_is_freed_and_buddies_merge() {
        let stats = install(4 << 20);
        let all = PayloadBufMut::try_for_overwrite(4 << 20).unwrap();
        let hits = stats.hits.load(Ordering::Relaxed);
        assert!(PayloadBufMut::try_for_overwrite(4096).is_none());
        assert_eq!(stats.misses.load(Ordering::Relaxed), 1);
        // The synchronous constructor falls back to the heap, counted.
        let before = HEAP_FALLBACKS.load(Ordering::Relaxed);
        let h = PayloadBufMut::for_overwrite(4096);
        assert_eq!(h.pool_name(), Some("heap"));
        assert!(HEAP_FALLBACKS.load(Ordering::Relaxed) > before);
        drop(all);
        // 1024 pages, then all freed: they merge back into one 4 MiB block.
        let pages: Vec<_> = (0..1024)
            .map(|_| PayloadBufMut::try_for_overwrite(4096).unwrap())
            .collect();
        assert!(PayloadBufMut::try_for_overwrite(1).is_none());
        let mut starts: Vec<usize> = pages.iter().map(|p| p.as_ptr() as usize).collect();
        starts.sort_unstable();
        starts.dedup();
        assert_eq!(starts.len(), 1024, "no page handed out twice");
        drop(pages);
        assert!(PayloadBufMut::try_for_overwrite(4 << 20).is_some());
        assert_eq!(stats.hits.load(Ordering::Relaxed), hits + 1025);
        assert_eq!(in_use(&stats), 0);
    }

    #[test]
    fn large_buffers_are_bounded_by_their_own_budget() {
        let stats = install(4 << 20);
        let a = PayloadBufMut::try_for_overwrite(8 << 20).unwrap();
        assert_eq!(a.location(), None, "outside the region");
        assert_eq!(a.pool_name(), Some("percpu"));
        assert_eq!(
            stats.bytes_in_use[CLASS_COUNT].load(Ordering::Relaxed),
            8 << 20
        );
        // Budget 12 MiB: another 8 MiB does not fit.
        assert!(PayloadBufMut::try_for_overwrite(8 << 20).is_none());
        let b = PayloadBufMut::try_for_overwrite(4 << 20).unwrap();
        assert!(b.location().is_some(), "4 MiB is still a class");
        drop(a);
        let c = PayloadBufMut::try_for_overwrite(12 << 20).unwrap();
        drop((b, c));
        assert_eq!(in_use(&stats), 0);
    }

    #[test]
    fn buffers_freed_on_another_thread_go_home_through_the_queue() {
        let stats = install(4 << 20);
        let b = PayloadBuf::copy_from(&[5u8; 4 << 20]);
        let addr = b.as_ptr() as usize;
        std::thread::spawn(move || {
            // The other thread has its own pool; the buffer still goes home.
            install_on_this_thread(&cfg(4 << 20)).unwrap();
            assert_eq!(b[0], 5);
            drop(b);
        })
        .join()
        .unwrap();
        assert_eq!(
            stats.remote_frees.load(Ordering::Relaxed),
            0,
            "not drained yet"
        );
        assert_eq!(in_use(&stats), 4 << 20);
        // The home thread's next allocation drains the queue and reuses the memory.
        let again = PayloadBufMut::try_for_overwrite(4 << 20).unwrap();
        assert_eq!(again.as_ptr() as usize, addr);
        assert_eq!(stats.remote_frees.load(Ordering::Relaxed), 1);
    }

    /// Two threads allocate, fill each buffer with a tag, hand half of them to the
    /// other thread, which checks the tag before dropping (a remote free). A block
    /// handed out twice while live would have its tag overwritten.
    #[test]
    fn two_threads_with_cross_frees_never_share_a_live_buffer() {
        const ROUNDS: usize = 3000;
        let (tx_a, rx_b) = std::sync::mpsc::sync_channel::<(PayloadBuf, u8)>(64);
        let (tx_b, rx_a) = std::sync::mpsc::sync_channel::<(PayloadBuf, u8)>(64);
        let worker = |tx: std::sync::mpsc::SyncSender<(PayloadBuf, u8)>,
                      rx: std::sync::mpsc::Receiver<(PayloadBuf, u8)>,
                      seed: u8| {
            move || {
                install_on_this_thread(&cfg(4 << 20)).unwrap();
                let mut held: std::collections::VecDeque<(PayloadBuf, u8)> = Default::default();
                let mut checked = 0usize;
                for i in 0..ROUNDS {
                    let len = 4096 << (i % 4);
                    let tag = (i as u8).wrapping_mul(31).wrapping_add(seed);
                    let waiting_since = std::time::Instant::now();
                    let mut b = loop {
                        match PayloadBufMut::try_for_overwrite(len) {
                            Some(b) => break b,
                            None => {
                                // Bounded: freed buffers must come home.
                                assert!(
                                    waiting_since.elapsed() < std::time::Duration::from_secs(10),
                                    "pool memory freed remotely never came back"
                                );
                                std::thread::yield_now();
                                // Exhausted: free our oldest, take what came back.
                                held.pop_front();
                                while let Ok((b, t)) = rx.try_recv() {
                                    assert!(b.iter().all(|&x| x == t));
                                    checked += 1;
                                }
                            }
                        }
                    };
                    b.as_mut_slice().fill(tag);
                    let f = b.freeze();
                    if i % 2 == 0 {
                        let _ = tx.send((f, tag));
                    } else {
                        held.push_back((f, tag));
                        if held.len() > 32 {
                            held.pop_front();
                        }
                    }
                    for (b, t) in &held {
                        assert!(
                            b[0] == *t && b[b.len() - 1] == *t,
                            "a live buffer was reused"
                        );
                    }
                    while let Ok((b, t)) = rx.try_recv() {
                        assert!(b.iter().all(|&x| x == t), "a live buffer was reused");
                        checked += 1;
                    }
                }
                drop(tx);
                while let Ok((b, t)) = rx.recv_timeout(std::time::Duration::from_secs(10)) {
                    assert!(b.iter().all(|&x| x == t));
                    checked += 1;
                }
                checked
            }
        };
        let a = std::thread::spawn(worker(tx_a, rx_a, 1));
        let b = std::thread::spawn(worker(tx_b, rx_b, 2));
        let (ca, cb) = (a.join().unwrap(), b.join().unwrap());
        assert_eq!(ca + cb, ROUNDS, "every sent buffer was checked");
    }

    #[test]
    fn buddy_allocations_never_overlap_and_merge_completely() {
        use rand::{Rng, SeedableRng};
        let pages = 2 * (1 << (CLASS_COUNT - 1));
        let mut b = Buddy::new(pages);
        let mut owner = vec![false; pages];
        let mut live: Vec<(u32, usize)> = Vec::new();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for _ in 0..20_000 {
            if rng.random_bool(0.55) {
                let order = rng.random_range(0..CLASS_COUNT);
                if let Some(p) = b.alloc(order) {
                    assert!(
                        (p as usize).is_multiple_of(1 << order),
                        "block aligned to its size"
                    );
                    let pages = &mut owner[p as usize..p as usize + (1 << order)];
                    assert!(pages.iter().all(|&o| !o), "a page handed out twice");
                    pages.fill(true);
                    live.push((p, order));
                }
            } else if !live.is_empty() {
                let (p, order) = live.swap_remove(rng.random_range(0..live.len()));
                owner[p as usize..p as usize + (1 << order)].fill(false);
                b.free(p, order);
            }
        }
        for (p, order) in live.drain(..) {
            b.free(p, order);
        }
        assert!(b.alloc(CLASS_COUNT - 1).is_some() && b.alloc(CLASS_COUNT - 1).is_some());
        assert!(
            b.alloc(0).is_none(),
            "everything merged back into two top blocks"
        );
    }

    #[test]
    #[should_panic(expected = "not allocated")]
    fn a_double_free_is_caught() {
        let mut b = Buddy::new(1 << (CLASS_COUNT - 1));
        let p = b.alloc(3).unwrap();
        b.free(p, 3);
        b.free(p, 3);
    }

    #[test]
    fn the_locked_pool_is_shared_by_threads() {
        let installer = PoolInstaller::new(
            &MemoryPoolConfig {
                mode: PoolMode::Locked,
                ..cfg(4 << 20)
            },
            2,
        )
        .unwrap();
        let installer = Arc::new(installer);
        installer.install().unwrap();
        let a = PayloadBufMut::for_overwrite(4 << 20).freeze();
        assert_eq!(a.pool_name(), Some("locked"));
        let i2 = installer.clone();
        let region = a.location().unwrap().0;
        std::thread::spawn(move || {
            i2.install().unwrap();
            let b = PayloadBufMut::try_for_overwrite(4 << 20).unwrap();
            assert_eq!(b.location().unwrap().0, region, "the same region");
            // 2 threads × 4 MiB: now full.
            assert!(PayloadBufMut::try_for_overwrite(4096).is_none());
            drop(a);
            assert!(PayloadBufMut::try_for_overwrite(4 << 20).is_some());
        })
        .join()
        .unwrap();
        assert_eq!(thread_pool().name(), "locked");
    }

    #[test]
    fn the_data_path_waits_for_a_free_then_gives_up_in_bounded_time() {
        install(4 << 20);
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            let all = PayloadBufMut::try_for_overwrite(4 << 20).unwrap();
            let start = std::time::Instant::now();
            // Nobody frees: fails after exhausted_wait_ms (50 ms).
            let e = PayloadBufMut::for_overwrite_wait(4096).await.unwrap_err();
            assert_eq!(e.len, 4096);
            assert!(start.elapsed() >= std::time::Duration::from_millis(50));
            assert!(start.elapsed() < std::time::Duration::from_secs(5));
            // A task frees it after 10 ms: the waiter gets it.
            crate::reactor::spawn(async move {
                crate::reactor::sleep(std::time::Duration::from_millis(10)).await;
                drop(all);
            })
            .detach();
            let b = PayloadBufMut::zeroed_wait(8192).await.unwrap();
            assert!(b.as_slice().iter().all(|&x| x == 0));
            assert!(b.location().is_some());
        })
        .unwrap();
    }

    #[test]
    fn disk_io_from_pool_buffers_uses_the_fixed_buffers() {
        use crate::reactor::{read_at, register_fixed_buffers, write_at};
        install(4 << 20);
        let dir = tempfile::tempdir().unwrap();
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap();
        let fd = f.as_raw_fd();
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        let regions: Vec<(usize, usize)> =
            thread_regions().iter().map(|r| (r.base, r.len)).collect();
        // SAFETY: the pool (and its region) lives as long as this thread.
        unsafe { register_fixed_buffers(&regions).unwrap() };
        r.block_on(async move {
            let before = crate::reactor::fixed_ops();
            let data = PayloadBuf::copy_from(&[9u8; 8192]);
            let (res, _) = write_at(fd, data.slice(4096..8192), 4096, true).await;
            assert_eq!(res.unwrap(), 4096);
            let (res, got) = read_at(fd, PayloadBufMut::for_overwrite(8192), 0).await;
            assert_eq!(res.unwrap(), 8192);
            assert_eq!(
                crate::reactor::fixed_ops(),
                before + 2,
                "both were fixed ops"
            );
            assert!(got.as_slice()[..4096].iter().all(|&x| x == 0));
            assert!(got.as_slice()[4096..].iter().all(|&x| x == 9));
            // Heap memory still works, as a plain operation.
            let (res, _) = write_at(fd, vec![1u8; 10], 0, false).await;
            assert_eq!(res.unwrap(), 10);
            assert_eq!(crate::reactor::fixed_ops(), before + 2);
        })
        .unwrap();
    }

    #[test]
    fn metrics_show_hits_misses_and_bytes_per_class() {
        let stats = install(4 << 20);
        let _a = PayloadBufMut::for_overwrite(8192);
        assert!(PayloadBufMut::try_for_overwrite(4 << 20).is_none());
        register_metrics();
        let text = crate::metrics::render();
        let me = std::thread::current().name().unwrap_or("").to_string();
        let line = |name: &str, extra: &str| {
            text.lines()
                .find(|l| {
                    l.starts_with(name)
                        && l.contains(&format!("thread=\"{me}\""))
                        && l.contains(extra)
                })
                .map(|l| l.rsplit(' ').next().unwrap_or("").to_string())
        };
        assert_eq!(stats.hits.load(Ordering::Relaxed), 1);
        assert_eq!(
            line("flame_pool_hits_total", "percpu").as_deref(),
            Some("1")
        );
        assert_eq!(
            line("flame_pool_misses_total", "percpu").as_deref(),
            Some("1")
        );
        assert_eq!(
            line("flame_pool_bytes_in_use", "class=\"8192\"").as_deref(),
            Some("8192")
        );
        assert_eq!(
            line("flame_pool_capacity_bytes", "percpu").as_deref(),
            Some("4194304")
        );
        assert!(text.contains("flame_pool_heap_fallbacks_total"));
    }

    #[test]
    fn config_values_are_checked() {
        assert!(MemoryPoolConfig::default().validate().is_ok());
        for bad in [0, 4096, (4 << 20) + 4096, BYTES_PER_THREAD_MAX + (4 << 20)] {
            let c = MemoryPoolConfig {
                bytes_per_thread: bad,
                ..MemoryPoolConfig::default()
            };
            assert_eq!(c.validate().unwrap_err().0, "memory_pool.bytes_per_thread");
        }
        let c: MemoryPoolConfig =
            serde_norway::from_str("mode: locked\nbytes_per_thread: 8388608\n").unwrap();
        assert_eq!(c.mode, PoolMode::Locked);
        assert!(serde_norway::from_str::<MemoryPoolConfig>("mode: slab\n").is_err());
    }
}
