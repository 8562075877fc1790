//! Payload buffers: the one memory type a write's or a read's data lives in, from
//! the socket to the disk and to the replicas, and back.
//!
//! * [`PayloadBufMut`] is unique and writable: a payload is received into it from a
//!   socket, or read into it from the disk. [`PayloadBufMut::freeze`] turns it into
//! * [`PayloadBuf`], immutable and shared: a clone costs one atomic increment, not a
//!   copy, so the primary hands the *same* memory to its local `O_DIRECT` write and to
//!   the send queue of every replica connection; [`PayloadBuf::slice`] cuts a part of
//!   it without copying (a volume write split into per-object pieces).
//!
//! Every buffer starts at a [`DIRECT_IO_ALIGN`] (4 KiB) boundary, so a block-aligned
//! write is written with `O_DIRECT` from the memory it was received into, and a read
//! lands from the disk in the memory that is then sent to the socket. Both types
//! implement the reactor's [`IoBuf`] (and the mutable one [`IoBufMut`]), so io_uring
//! operations take them directly.
//!
//! # Where the memory comes from
//!
//! All allocation goes through one interface, a [`BufferPool`]: the calling thread's
//! current pool ([`thread_pool`], replaced with [`set_thread_pool`]), by default the
//! process-wide [`HeapPool`]. Every buffer remembers the pool and the thread it came
//! from, and its last owner's drop hands the memory back to *that* pool with *that*
//! home thread — whichever thread the drop runs on. That is the seam the registered
//! memory pool (DESIGN.md §2, technique 4) plugs into: per-thread pools of
//! pre-registered memory in size classes, allocation and free on the owning thread
//! without a lock, and a lock-free return queue for buffers freed elsewhere: the
//! [`registered`] module. Data-path threads install it at start
//! ([`registered::PoolInstaller`]); every other thread keeps the heap pool.
//!
//! # Exhaustion
//! A registered pool is bounded. The data path allocates with
//! [`PayloadBufMut::for_overwrite_wait`], which waits for frees (back-pressure: the
//! connection stops reading) and fails after the configured time. The synchronous
//! constructors ([`PayloadBufMut::for_overwrite`], [`PayloadBuf::copy_from`], …),
//! used for small control-plane payloads and copies of a caller's slice, take the
//! memory from the heap when the pool is exhausted and count it
//! ([`registered::HEAP_FALLBACKS`]).

pub mod registered;

use crate::clock;
use crate::node::{NodeLocal, NodeLocalKey};
use crate::reactor::{DIRECT_IO_ALIGN, IoBuf, IoBufMut};
use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::cell::{Cell, RefCell};
use std::fmt;
use std::ops::{Deref, Range};
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};
use std::thread::ThreadId;

/// Memory a pool hands out: at least the requested length, starting at a
/// [`DIRECT_IO_ALIGN`] boundary, every byte initialised (to zero when `zeroed`).
#[derive(Debug)]
pub struct RawBuf {
    /// Start of the memory.
    pub ptr: NonNull<u8>,
    /// Usable bytes (≥ the length asked for, ≥ 1).
    pub cap: usize,
    /// The pool's own tag (e.g. a size class or a registered region's index); the
    /// pool gets it back on release.
    pub token: u64,
    /// Whether every byte is zero (fresh memory). A recycled buffer holds old bytes.
    pub zeroed: bool,
}

/// Where payload memory comes from and goes back to.
///
/// # Safety
/// [`BufferPool::allocate`] must return memory valid for reads and writes of `cap`
/// bytes, aligned to [`DIRECT_IO_ALIGN`], fully initialised, and not handed out
/// again until it is released.
pub unsafe trait BufferPool: Send + Sync + 'static {
    /// Name for logs and tests.
    fn name(&self) -> &'static str;

    /// Memory for a payload of `len` bytes (`len` ≥ 1). `None` when the pool cannot
    /// serve it (the caller then fails the allocation like the heap does).
    fn allocate(&self, len: usize) -> Option<RawBuf>;

    /// Takes back memory this pool's `allocate` returned. `home` is the thread that
    /// allocated it; the calling thread may be another one (a buffer whose last
    /// reference was dropped elsewhere), which a per-thread pool routes home.
    ///
    /// # Safety
    /// `raw` came from this pool's `allocate` and is released exactly once, after
    /// which nothing reads or writes it.
    unsafe fn release(&self, raw: RawBuf, home: ThreadId);

    /// `Some((region id, offset))` when `ptr` (memory this pool handed out) lies in
    /// one of its registered regions ([`registered::regions`]); `None` for heap
    /// memory.
    fn location(&self, ptr: *const u8) -> Option<(u32, u64)> {
        let _ = ptr;
        None
    }

    /// The registered regions this pool carves buffers from (none for the heap).
    fn regions(&self) -> Vec<Arc<registered::Region>> {
        Vec::new()
    }
}

/// The default pool. Small buffers come from the global allocator (zeroed: a memset
/// of a few KiB); large ones are mapped straight from the kernel, and a large buffer
/// released on its home thread is kept (a bounded few per thread, see
/// [`RECYCLE_ENTRIES_MAX`]) for that thread's next buffer of the same size: a fresh
/// mapping costs a page fault per 4 KiB on first touch and a TLB flush on unmap,
/// which measured as twice the daemon CPU of a 1 MiB read. Fresh mappings are zero
/// already, so a receive that is about to overwrite megabytes does not first pay
/// for clearing them (the
/// global allocator clears over-aligned memory with a memset).
#[derive(Debug, Default)]
pub struct HeapPool;

/// Buffers of at least this size are mapped (`mmap`) rather than allocated.
pub const HEAP_MMAP_BYTES_MIN: usize = 128 << 10;
/// Token of a mapped buffer.
const TOKEN_MAPPED: u64 = 1;
/// Large buffers one thread keeps for reuse, at most.
pub const RECYCLE_ENTRIES_MAX: usize = 16;
/// Bytes of large buffers one thread keeps for reuse, at most.
pub const RECYCLE_BYTES_MAX: usize = 32 << 20;

/// Mapped buffers this thread released, kept for its next allocations of the same
/// size; unmapped when the thread ends.
#[derive(Default)]
struct Recycled {
    entries: Vec<(NonNull<u8>, usize)>,
    bytes: usize,
}

impl Recycled {
    fn take(&mut self, cap: usize) -> Option<NonNull<u8>> {
        let i = self.entries.iter().position(|&(_, c)| c == cap)?;
        let (ptr, _) = self.entries.swap_remove(i);
        self.bytes -= cap;
        Some(ptr)
    }

    fn keep(&mut self, ptr: NonNull<u8>, cap: usize) -> bool {
        if self.entries.len() >= RECYCLE_ENTRIES_MAX || self.bytes + cap > RECYCLE_BYTES_MAX {
            return false;
        }
        self.entries.push((ptr, cap));
        self.bytes += cap;
        true
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        for &(ptr, cap) in &self.entries {
            // SAFETY: mapped by HeapPool::allocate with exactly this length; kept
            // here only after its last buffer was released.
            unsafe { libc::munmap(ptr.as_ptr().cast(), cap) };
        }
    }
}

thread_local! {
    static RECYCLED: RefCell<Recycled> = RefCell::new(Recycled::default());
}
/// Token of a buffer from the global allocator.
const TOKEN_ALLOCATED: u64 = 0;

fn heap_layout(cap: usize) -> Option<Layout> {
    Layout::from_size_align(cap, DIRECT_IO_ALIGN).ok()
}

// SAFETY: alloc_zeroed returns zeroed memory of the layout's size and alignment;
// mmap returns page-aligned (≥ 4 KiB) zero pages.
unsafe impl BufferPool for HeapPool {
    fn name(&self) -> &'static str {
        "heap"
    }

    fn allocate(&self, len: usize) -> Option<RawBuf> {
        let cap = len.max(1);
        if cap >= HEAP_MMAP_BYTES_MIN {
            let cap = cap.checked_next_multiple_of(DIRECT_IO_ALIGN)?;
            if let Some(ptr) = RECYCLED
                .try_with(|r| r.borrow_mut().take(cap))
                .ok()
                .flatten()
            {
                return Some(RawBuf {
                    ptr,
                    cap,
                    token: TOKEN_MAPPED,
                    zeroed: false,
                });
            }
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
            return Some(RawBuf {
                ptr: NonNull::new(p.cast::<u8>())?,
                cap,
                token: TOKEN_MAPPED,
                zeroed: true,
            });
        }
        let layout = heap_layout(cap)?;
        // SAFETY: layout has non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        Some(RawBuf {
            ptr,
            cap,
            token: TOKEN_ALLOCATED,
            zeroed: true,
        })
    }

    unsafe fn release(&self, raw: RawBuf, home: ThreadId) {
        if raw.token == TOKEN_MAPPED
            && home == this_thread()
            && RECYCLED
                .try_with(|r| r.borrow_mut().keep(raw.ptr, raw.cap))
                .unwrap_or(false)
        {
            return;
        }
        if raw.token == TOKEN_MAPPED {
            // SAFETY: mapped in `allocate` with exactly this length (the caller's
            // contract); nothing uses it any more.
            unsafe { libc::munmap(raw.ptr.as_ptr().cast(), raw.cap) };
        } else if let Some(layout) = heap_layout(raw.cap) {
            // SAFETY: allocated in `allocate` with this layout (the caller's contract).
            unsafe { dealloc(raw.ptr.as_ptr(), layout) }
        }
    }
}

/// The process-wide heap pool.
pub fn heap_pool() -> Arc<dyn BufferPool> {
    static HEAP: OnceLock<Arc<dyn BufferPool>> = OnceLock::new();
    HEAP.get_or_init(|| Arc::new(HeapPool)).clone()
}

thread_local! {
    /// Per process (per simulated node: [`crate::node`]).
    static CURRENT_POOL: NodeLocal<RefCell<Option<Arc<dyn BufferPool>>>> = const { NodeLocal::new(|| RefCell::new(None)) };
    static THREAD_ID: Cell<Option<ThreadId>> = const { Cell::new(None) };
}

/// The calling thread's current pool (the heap pool unless replaced).
pub fn thread_pool() -> Arc<dyn BufferPool> {
    CURRENT_POOL.with_node(|p| p.borrow().clone().unwrap_or_else(heap_pool))
}

/// Makes `pool` the calling thread's pool for every later allocation; returns the
/// previous one. Buffers already allocated keep going back to their own pool.
pub fn set_thread_pool(pool: Arc<dyn BufferPool>) -> Arc<dyn BufferPool> {
    CURRENT_POOL.with_node(|p| p.borrow_mut().replace(pool).unwrap_or_else(heap_pool))
}

fn this_thread() -> ThreadId {
    THREAD_ID.with(|t| match t.get() {
        Some(id) => id,
        None => {
            let id = std::thread::current().id();
            t.set(Some(id));
            id
        }
    })
}

/// One allocation and where it goes back to. Its drop — when the last buffer
/// referring to it goes — is the only place the memory is released.
struct Chunk {
    ptr: NonNull<u8>,
    cap: usize,
    token: u64,
    pool: Arc<dyn BufferPool>,
    home: ThreadId,
}

// SAFETY: the chunk owns its memory. It is written only through the one
// `PayloadBufMut` that holds it (unique by construction) and only read once frozen,
// so sharing it between threads is sharing immutable bytes.
unsafe impl Send for Chunk {}
// SAFETY: as above.
unsafe impl Sync for Chunk {}

impl Drop for Chunk {
    fn drop(&mut self) {
        let raw = RawBuf {
            ptr: self.ptr,
            cap: self.cap,
            token: self.token,
            zeroed: false,
        };
        // SAFETY: the memory came from this pool and this is its only release (a
        // chunk is dropped once, when its Arc's last reference goes).
        unsafe { self.pool.release(raw, self.home) }
    }
}

/// The address a zero-length buffer reports: non-null and aligned, never accessed.
fn dangling() -> *mut u8 {
    std::ptr::without_provenance_mut(DIRECT_IO_ALIGN)
}

/// Memory from the thread's pool; when that pool cannot serve it, from the heap
/// (counted in [`registered::HEAP_FALLBACKS`]; see "Exhaustion" above).
fn allocate_chunk(len: usize) -> (Arc<Chunk>, bool) {
    if let Some(c) = try_allocate_chunk(len) {
        return c;
    }
    registered::HEAP_FALLBACKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let pool = heap_pool();
    let Some(raw) = pool.allocate(len) else {
        let layout = heap_layout(len.max(1)).unwrap_or(Layout::new::<u8>());
        std::alloc::handle_alloc_error(layout);
    };
    chunk_from(pool, raw, len)
}

/// Memory from the thread's pool, `None` when it is exhausted.
fn try_allocate_chunk(len: usize) -> Option<(Arc<Chunk>, bool)> {
    let pool = thread_pool();
    let raw = pool.allocate(len)?;
    Some(chunk_from(pool, raw, len))
}

fn chunk_from(pool: Arc<dyn BufferPool>, raw: RawBuf, len: usize) -> (Arc<Chunk>, bool) {
    assert!(
        raw.cap >= len && (raw.ptr.as_ptr() as usize).is_multiple_of(DIRECT_IO_ALIGN),
        "pool {} returned unaligned or short memory",
        pool.name()
    );
    let zeroed = raw.zeroed;
    let chunk = Chunk {
        ptr: raw.ptr,
        cap: raw.cap,
        token: raw.token,
        pool,
        home: this_thread(),
    };
    (Arc::new(chunk), zeroed)
}

/// The thread's memory pool could not serve a data-path allocation within its
/// wait (see "Exhaustion" in the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("memory pool exhausted: no {len}-byte buffer became free in time")]
pub struct PoolExhausted {
    /// Bytes asked for.
    pub len: usize,
}

impl From<PoolExhausted> for std::io::Error {
    /// `OutOfMemory`: callers answer it with "try again" (EAGAIN) or by closing the
    /// connection, never as a disk error.
    fn from(e: PoolExhausted) -> std::io::Error {
        std::io::Error::new(std::io::ErrorKind::OutOfMemory, e)
    }
}

/// A unique, writable payload buffer of a fixed length, 4 KiB-aligned.
///
/// Receive or read into it, then [`PayloadBufMut::freeze`] it to share it.
pub struct PayloadBufMut {
    /// `None` for a zero-length buffer (no allocation). Otherwise the only
    /// reference to the chunk: never cloned while this value exists.
    chunk: Option<Arc<Chunk>>,
    len: usize,
}

impl PayloadBufMut {
    /// `len` zero bytes from the thread's pool.
    pub fn zeroed(len: usize) -> PayloadBufMut {
        let (mut b, zeroed) = PayloadBufMut::allocate(len);
        if !zeroed {
            b.as_mut_slice().fill(0);
        }
        b
    }

    /// `len` bytes of unspecified (but initialised) content from the thread's pool,
    /// for a receive or read that overwrites all of them: a recycled buffer is not
    /// cleared first.
    pub fn for_overwrite(len: usize) -> PayloadBufMut {
        PayloadBufMut::allocate(len).0
    }

    /// Like [`PayloadBufMut::for_overwrite`] but `None` when the thread's pool is
    /// exhausted, instead of taking heap memory.
    pub fn try_for_overwrite(len: usize) -> Option<PayloadBufMut> {
        if len == 0 {
            return Some(PayloadBufMut::for_overwrite(0));
        }
        let (chunk, _) = try_allocate_chunk(len)?;
        Some(PayloadBufMut {
            chunk: Some(chunk),
            len,
        })
    }

    /// A buffer of `len` bytes of unspecified content for the data path: when the
    /// thread's pool is exhausted, waits (on the thread's reactor) for buffers to be
    /// freed, re-trying with a backoff of 50 µs … 1 ms, for at most the pool's
    /// `exhausted_wait_ms`. The caller — a connection about to receive a payload —
    /// does not read its socket meanwhile, which back-pressures the sender.
    pub async fn for_overwrite_wait(len: usize) -> Result<PayloadBufMut, PoolExhausted> {
        if let Some(b) = PayloadBufMut::try_for_overwrite(len) {
            return Ok(b);
        }
        let wait = std::time::Duration::from_millis(registered::thread_wait_ms());
        let start = clock::now();
        let mut backoff_us = 50;
        // Bounded by `wait`: every round sleeps at least 50 µs.
        loop {
            if crate::reactor::current_id().is_none() || clock::elapsed(start) >= wait {
                return Err(PoolExhausted { len });
            }
            crate::reactor::sleep(std::time::Duration::from_micros(backoff_us)).await;
            if let Some(b) = PayloadBufMut::try_for_overwrite(len) {
                return Ok(b);
            }
            backoff_us = (backoff_us * 2).min(1000);
        }
    }

    /// [`PayloadBufMut::for_overwrite_wait`], cleared to zero.
    pub async fn zeroed_wait(len: usize) -> Result<PayloadBufMut, PoolExhausted> {
        let mut b = PayloadBufMut::for_overwrite_wait(len).await?;
        b.as_mut_slice().fill(0);
        Ok(b)
    }

    /// Where the buffer lies in a registered region: `Some((region id, offset))`,
    /// `None` for heap memory (or an empty buffer).
    pub fn location(&self) -> Option<(u32, u64)> {
        let c = self.chunk.as_ref()?;
        c.pool.location(c.ptr.as_ptr())
    }

    /// A buffer and whether its bytes are known to be zero.
    fn allocate(len: usize) -> (PayloadBufMut, bool) {
        if len == 0 {
            let b = PayloadBufMut {
                chunk: None,
                len: 0,
            };
            return (b, true);
        }
        let (chunk, zeroed) = allocate_chunk(len);
        let b = PayloadBufMut {
            chunk: Some(chunk),
            len,
        };
        (b, zeroed)
    }

    /// A buffer holding a copy of `data` (the one copy of a caller's slice).
    pub fn copy_from(data: &[u8]) -> PayloadBufMut {
        let mut b = PayloadBufMut::for_overwrite(data.len());
        b.as_mut_slice().copy_from_slice(data);
        b
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn ptr(&self) -> *mut u8 {
        match &self.chunk {
            Some(c) => c.ptr.as_ptr(),
            None => dangling(),
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes (or dangling with len 0).
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        debug_assert!(
            self.chunk
                .as_ref()
                .is_none_or(|c| Arc::strong_count(c) == 1)
        );
        // SAFETY: as above, and this is the chunk's only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.len) }
    }

    /// Shortens the buffer to `len` bytes (no effect if it is not longer).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }

    /// Makes the buffer immutable and shareable, without copying.
    pub fn freeze(self) -> PayloadBuf {
        PayloadBuf {
            chunk: self.chunk,
            off: 0,
            len: self.len,
            crc: None,
        }
    }

    /// Name of the pool the memory came from (`None` for a zero-length buffer).
    pub fn pool_name(&self) -> Option<&'static str> {
        self.chunk.as_ref().map(|c| c.pool.name())
    }

    /// The thread that allocated the memory.
    pub fn home_thread(&self) -> Option<ThreadId> {
        self.chunk.as_ref().map(|c| c.home)
    }
}

impl fmt::Debug for PayloadBufMut {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PayloadBufMut({} bytes)", self.len)
    }
}

// SAFETY: the chunk's memory does not move when the value does.
unsafe impl IoBuf for PayloadBufMut {
    fn as_ptr(&self) -> *const u8 {
        self.ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

// SAFETY: as above; this value is the chunk's only reference.
unsafe impl IoBufMut for PayloadBufMut {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr()
    }
}

/// An immutable, shared payload: cloning and slicing never copy the bytes.
///
/// The full buffer starts 4 KiB-aligned; a slice starts wherever it was cut
/// ([`PayloadBuf::is_direct_io_aligned`] tells whether `O_DIRECT` may use it).
#[derive(Clone, Default)]
pub struct PayloadBuf {
    chunk: Option<Arc<Chunk>>,
    off: usize,
    len: usize,
    /// crc32c of exactly these bytes, once known (the bytes never change): the
    /// transport verifies a received payload's crc, and a primary forwarding it to
    /// two replicas then sends that value instead of computing it twice more.
    crc: Option<u32>,
}

impl PayloadBuf {
    /// The empty payload (no allocation).
    pub fn empty() -> PayloadBuf {
        PayloadBuf::default()
    }

    /// A payload holding a copy of `data` (the one copy of a caller's slice).
    pub fn copy_from(data: &[u8]) -> PayloadBuf {
        PayloadBufMut::copy_from(data).freeze()
    }

    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> PayloadBuf {
        PayloadBufMut::zeroed(len).freeze()
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn ptr(&self) -> *const u8 {
        match &self.chunk {
            Some(c) => c.ptr.as_ptr().wrapping_add(self.off),
            None => dangling(),
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: [off, off+len) lies within the chunk's initialised bytes, which
        // nobody writes any more (frozen).
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len) }
    }

    /// The bytes `range` of this payload, sharing its memory.
    ///
    /// # Panics
    /// If `range` is not within `0..len()` — a caller bug, like slice indexing.
    pub fn slice(&self, range: Range<usize>) -> PayloadBuf {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "slice {range:?} of a {}-byte payload",
            self.len
        );
        if range.is_empty() {
            return PayloadBuf::empty();
        }
        PayloadBuf {
            chunk: self.chunk.clone(),
            off: self.off + range.start,
            len: range.len(),
            crc: None,
        }
    }

    /// The crc32c of the bytes: remembered if known, computed otherwise.
    pub fn crc32c(&self) -> u32 {
        self.crc.unwrap_or_else(|| crc32c::crc32c(self.as_slice()))
    }

    /// Records `crc` as the crc32c of these bytes. Only for a value just checked
    /// against them (the transport's verification of a received payload).
    pub fn with_verified_crc32c(mut self, crc: u32) -> PayloadBuf {
        debug_assert_eq!(crc, crc32c::crc32c(self.as_slice()));
        self.crc = Some(crc);
        self
    }

    /// Whether the bytes start on a [`DIRECT_IO_ALIGN`] boundary.
    pub fn is_direct_io_aligned(&self) -> bool {
        (self.ptr() as usize).is_multiple_of(DIRECT_IO_ALIGN)
    }

    /// Whether `self` and `other` share memory (a clone or a slice of one another).
    pub fn same_memory(&self, other: &PayloadBuf) -> bool {
        match (&self.chunk, &other.chunk) {
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// References to the underlying memory (clones and slices), for tests and
    /// diagnostics; 0 for an empty payload.
    pub fn ref_count(&self) -> usize {
        self.chunk.as_ref().map_or(0, Arc::strong_count)
    }

    /// Name of the pool the memory came from (`None` for an empty payload).
    pub fn pool_name(&self) -> Option<&'static str> {
        self.chunk.as_ref().map(|c| c.pool.name())
    }

    /// Where these bytes lie in a registered region: `Some((region id, offset of
    /// the first byte))`, `None` for heap memory (or an empty payload).
    pub fn location(&self) -> Option<(u32, u64)> {
        let c = self.chunk.as_ref()?;
        let (id, off) = c.pool.location(c.ptr.as_ptr())?;
        Some((id, off + self.off as u64))
    }

    /// The thread that allocated the memory.
    pub fn home_thread(&self) -> Option<ThreadId> {
        self.chunk.as_ref().map(|c| c.home)
    }
}

impl Deref for PayloadBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl AsRef<[u8]> for PayloadBuf {
    fn as_ref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl PartialEq for PayloadBuf {
    fn eq(&self, other: &PayloadBuf) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for PayloadBuf {}

impl PartialEq<[u8]> for PayloadBuf {
    fn eq(&self, other: &[u8]) -> bool {
        self.as_slice() == other
    }
}

impl PartialEq<Vec<u8>> for PayloadBuf {
    fn eq(&self, other: &Vec<u8>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl PartialEq<&[u8]> for PayloadBuf {
    fn eq(&self, other: &&[u8]) -> bool {
        self.as_slice() == *other
    }
}

impl<const N: usize> PartialEq<[u8; N]> for PayloadBuf {
    fn eq(&self, other: &[u8; N]) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<const N: usize> PartialEq<&[u8; N]> for PayloadBuf {
    fn eq(&self, other: &&[u8; N]) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl fmt::Debug for PayloadBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let head = &self.as_slice()[..self.len.min(8)];
        write!(f, "PayloadBuf({} bytes, starts {head:02x?})", self.len)
    }
}

// SAFETY: the chunk's memory does not move and stays allocated while this value
// (one of its references) lives.
unsafe impl IoBuf for PayloadBuf {
    fn as_ptr(&self) -> *const u8 {
        self.ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// Allocates `len` uninitialised-by-contract bytes for tests of pools.
/// One entry of a connection's send queue, for one `writev`: small bytes copied in
/// (headers, small replies batched together), or a payload by reference, never
/// copied. Shared by the Flame transport and flame-nbd's connections.
pub enum SendBuf {
    /// Bytes copied into the queue.
    Copied(Vec<u8>),
    /// A payload sent from the memory it already lives in.
    Shared(PayloadBuf),
}

// SAFETY: both variants' memory is heap memory that does not move with the value.
unsafe impl IoBuf for SendBuf {
    fn as_ptr(&self) -> *const u8 {
        match self {
            SendBuf::Copied(v) => v.as_ptr(),
            SendBuf::Shared(p) => IoBuf::as_ptr(p),
        }
    }
    fn len(&self) -> usize {
        match self {
            SendBuf::Copied(v) => v.len(),
            SendBuf::Shared(p) => p.len(),
        }
    }
}

#[cfg(test)]
fn raw_alloc(len: usize) -> Option<NonNull<u8>> {
    let layout = heap_layout(len.max(1))?;
    // SAFETY: non-zero size.
    NonNull::new(unsafe { std::alloc::alloc(layout) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A pool that counts, records where each release came from, and hands out
    /// non-zeroed memory (like a recycling pool would).
    #[derive(Default)]
    struct CountingPool {
        allocs: AtomicUsize,
        releases: AtomicUsize,
        /// (home thread, releasing thread, token) per release.
        log: Mutex<Vec<(ThreadId, ThreadId, u64)>>,
    }

    // SAFETY: memory from raw_alloc, filled before it is handed out.
    unsafe impl BufferPool for CountingPool {
        fn name(&self) -> &'static str {
            "counting"
        }
        fn allocate(&self, len: usize) -> Option<RawBuf> {
            let n = self.allocs.fetch_add(1, Ordering::SeqCst);
            let ptr = raw_alloc(len)?;
            // SAFETY: fresh memory of len.max(1) bytes; initialise it with garbage.
            unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0xa5, len.max(1)) };
            Some(RawBuf {
                ptr,
                cap: len.max(1),
                token: n as u64 + 100,
                zeroed: false,
            })
        }
        unsafe fn release(&self, raw: RawBuf, home: ThreadId) {
            self.releases.fetch_add(1, Ordering::SeqCst);
            self.log
                .lock()
                .unwrap()
                .push((home, std::thread::current().id(), raw.token));
            // SAFETY: allocated by raw_alloc with this capacity.
            unsafe { HeapPool.release(raw, home) }
        }
    }

    /// Runs `f` with `pool` as this thread's pool, restoring the previous one.
    fn with_pool<T>(pool: Arc<dyn BufferPool>, f: impl FnOnce() -> T) -> T {
        let old = set_thread_pool(pool);
        let out = f();
        set_thread_pool(old);
        out
    }

    #[test]
    fn buffers_are_aligned_and_zeroed_when_asked() {
        for len in [
            1,
            100,
            4096,
            4097,
            HEAP_MMAP_BYTES_MIN - 1,
            HEAP_MMAP_BYTES_MIN + 1,
            1 << 20,
        ] {
            let b = PayloadBufMut::zeroed(len);
            assert_eq!(b.as_ptr() as usize % DIRECT_IO_ALIGN, 0, "len {len}");
            assert_eq!(b.len(), len);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            let f = b.freeze();
            assert!(f.is_direct_io_aligned());
            assert_eq!(f.pool_name(), Some("heap"));
        }
        // A recycled (non-zeroed) pool's memory is cleared by `zeroed` only.
        let pool = Arc::new(CountingPool::default());
        with_pool(pool.clone(), || {
            let b = PayloadBufMut::zeroed(4096);
            assert!(b.as_slice().iter().all(|&x| x == 0));
            let o = PayloadBufMut::for_overwrite(4096);
            assert!(o.as_slice().iter().all(|&x| x == 0xa5));
            assert_eq!(o.pool_name(), Some("counting"));
        });
    }

    #[test]
    fn clones_and_slices_share_memory_and_free_exactly_once() {
        let pool = Arc::new(CountingPool::default());
        let b = with_pool(pool.clone(), || {
            let mut m = PayloadBufMut::for_overwrite(8192);
            for (i, x) in m.as_mut_slice().iter_mut().enumerate() {
                *x = i as u8;
            }
            m.freeze()
        });
        assert_eq!(pool.allocs.load(Ordering::SeqCst), 1);
        let clones: Vec<PayloadBuf> = (0..3).map(|_| b.clone()).collect();
        let s = b.slice(4096..4100);
        assert_eq!(b.ref_count(), 5);
        assert!(
            clones
                .iter()
                .all(|c| c.same_memory(&b) && c.as_ptr() == b.as_ptr())
        );
        assert_eq!(s.as_slice(), &[0, 1, 2, 3]);
        assert!(s.same_memory(&b));
        assert!(s.is_direct_io_aligned());
        assert!(!b.slice(1..2).is_direct_io_aligned());
        drop(b);
        drop(clones);
        assert_eq!(
            pool.releases.load(Ordering::SeqCst),
            0,
            "a slice still holds it"
        );
        assert_eq!(s.ref_count(), 1);
        drop(s);
        assert_eq!(pool.releases.load(Ordering::SeqCst), 1);
        let log = pool.log.lock().unwrap();
        assert_eq!(log[0].2, 100, "the pool gets its token back");
    }

    #[test]
    fn a_buffer_dropped_on_another_thread_goes_back_to_its_home_pool() {
        let pool = Arc::new(CountingPool::default());
        let home = std::thread::current().id();
        let b = with_pool(pool.clone(), || PayloadBuf::copy_from(b"cross-thread"));
        assert_eq!(b.home_thread(), Some(home));
        // The thread that drops it uses another pool; the buffer still goes home.
        let other = std::thread::spawn(move || {
            assert_eq!(thread_pool().name(), "heap");
            assert_eq!(&b[..], b"cross-thread");
            drop(b);
            std::thread::current().id()
        })
        .join()
        .unwrap();
        assert_eq!(pool.releases.load(Ordering::SeqCst), 1);
        let log = pool.log.lock().unwrap();
        assert_eq!(log.as_slice(), &[(home, other, 100)]);
        assert_ne!(home, other);
    }

    #[test]
    fn zero_length_buffers_allocate_nothing() {
        let pool = Arc::new(CountingPool::default());
        with_pool(pool.clone(), || {
            let m = PayloadBufMut::zeroed(0);
            assert!(m.is_empty() && m.as_slice().is_empty());
            assert_eq!(m.pool_name(), None);
            let f = m.freeze();
            assert!(f.is_empty() && f.ref_count() == 0);
            assert_eq!(PayloadBuf::copy_from(&[]), PayloadBuf::empty());
            let b = PayloadBuf::copy_from(b"abc");
            assert!(b.slice(1..1).is_empty());
            assert_eq!(b.slice(1..1).ref_count(), 0);
        });
        assert_eq!(pool.allocs.load(Ordering::SeqCst), 1);
        assert_eq!(pool.releases.load(Ordering::SeqCst), 1);
    }

    #[test]
    #[should_panic(expected = "slice")]
    fn slicing_past_the_end_is_a_bug() {
        let _ = PayloadBuf::copy_from(b"abc").slice(2..4);
    }

    #[test]
    fn reactor_io_reads_into_and_writes_from_payload_buffers() {
        use crate::reactor::{Reactor, ReactorConfig, read_at, write_at};
        use std::os::fd::AsRawFd;
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
        r.block_on(async move {
            let data = PayloadBuf::copy_from(&[7u8; 4096]);
            let (res, back) = write_at(fd, data.clone(), 0, false).await;
            assert_eq!(res.unwrap(), 4096);
            assert!(back.same_memory(&data));
            let (res, got) = read_at(fd, PayloadBufMut::for_overwrite(4096), 0).await;
            assert_eq!(res.unwrap(), 4096);
            assert_eq!(got.freeze(), data);
        })
        .unwrap();
    }

    #[test]
    fn large_buffers_are_recycled_on_their_home_thread_and_come_back_zeroed_on_request() {
        let len = 1 << 20;
        let mut a = PayloadBufMut::zeroed(len);
        a.as_mut_slice().fill(0xab);
        let addr = a.as_slice().as_ptr() as usize;
        drop(a);
        // The same thread's next buffer of that size reuses the mapping...
        let b = PayloadBufMut::for_overwrite(len);
        assert_eq!(b.as_slice().as_ptr() as usize, addr, "not recycled");
        drop(b);
        // ...and one asked for zeroed is cleared, not handed out with old bytes.
        let c = PayloadBufMut::zeroed(len);
        assert_eq!(c.as_slice().as_ptr() as usize, addr);
        assert!(c.as_slice().iter().all(|&x| x == 0));
        // Released on another thread: unmapped there, not cached in a thread that
        // never allocates it.
        let d = PayloadBufMut::zeroed(len).freeze();
        let other = std::thread::spawn(move || {
            drop(d);
            RECYCLED.with(|r| r.borrow().entries.len())
        })
        .join()
        .unwrap();
        assert_eq!(other, 0);
    }

    #[test]
    fn a_verified_crc_travels_with_clones_and_not_with_slices() {
        let bytes: Vec<u8> = (0..8192u32).map(|i| (i * 7) as u8).collect();
        let b = PayloadBuf::copy_from(&bytes);
        assert_eq!(b.crc32c(), crc32c::crc32c(&bytes));
        let known = b.clone().with_verified_crc32c(crc32c::crc32c(&bytes));
        assert_eq!(known.crc, Some(crc32c::crc32c(&bytes)));
        assert_eq!(known.clone().crc, known.crc, "a clone (a forward) keeps it");
        let half = known.slice(0..4096);
        assert_eq!(half.crc, None, "a slice holds other bytes");
        assert_eq!(half.crc32c(), crc32c::crc32c(&bytes[..4096]));
    }
}
