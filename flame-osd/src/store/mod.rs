//! The object store of one shard: checksummed object files grouped by placement
//! group under the data directory, read and written through the shard's io_uring.
//!
//! Format (byte for byte in docs/on-disk-format.md): `pgs/<pg>/<volume>.<index>`,
//! one sparse file per object: a header block, a checksum slot per 4 KiB data block,
//! then the data ([`meta`]). A byte never written reads as zero.
//!
//! Every read verifies the checksum of every block it touches and returns
//! [`StoreError::Checksum`] (never the data) on a mismatch. Writes cost one device
//! write: checksums live in memory and are written with the object's metadata at
//! FLUSH. Between a write and the FLUSH that makes it stable, the object is named in
//! the shard's intent journal ([`journal`]), so after a crash its checksums are
//! recomputed from whatever data reached the disk ([`recover`]).
//!
//! A placement group belongs to exactly one shard, so an object file is only ever
//! touched by one thread: no state here needs a lock.
//!
//! Callers must order overlapping writes to an object (the shard's `WriteGate`
//! does); non-overlapping writes may run concurrently, including partial writes to
//! the same 4 KiB block, which the store serialises itself.

pub mod doubt_record;
pub mod fs;
pub mod journal;
pub mod layout;
pub mod meta;
pub mod pg_log_file;
mod pg_ops;
pub mod rewritten;
pub mod wait_list;

use crate::config::DirectIo;
use crate::metrics::SyncKind;
use flame_common::buffer::{PayloadBuf, PayloadBufMut};
use flame_common::collections::{HashMap, HashSet};
use flame_common::ids::{ObjectId, PgId, VolumeId};
use flame_common::map::{DELETED_VOLUMES_MAX, OBJECT_SIZE_MAX};
use flame_common::reactor::{self, AlignedBuf, DIRECT_IO_ALIGN};
use fs::{File, Fs};
use journal::Journal;
use meta::{BLOCK, BLOCKS_MAX, DATA_OFFSET, HEADER_LEN, Header, Loaded};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::OpenOptions;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::task::{Poll, Waker};

/// What can go wrong in the store.
#[derive(Debug)]
pub enum StoreError {
    /// The file system failed.
    Io(io::Error),
    /// Blocks of `object` do not match their checksums (or the object's metadata is
    /// unreadable): their data is not returned. Repair them from another copy with
    /// [`ObjectStore::repair_block`].
    Checksum {
        /// The object.
        object: ObjectId,
        /// Block numbers within the object (offset / 4096).
        blocks: Vec<u32>,
    },
    /// The object's volume was removed: no object of it is created any more (a
    /// recovery copy or a late write racing `volume rm` would otherwise bring one
    /// back on a copy that had already deleted its own).
    VolumeRemoved(VolumeId),
}

impl StoreError {
    /// The OS error number, if this is an I/O error that has one.
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            StoreError::Io(e) => e.raw_os_error(),
            StoreError::Checksum { .. } | StoreError::VolumeRemoved(_) => None,
        }
    }
}

impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StoreError::Io(e) => write!(f, "{e}"),
            StoreError::Checksum { object, blocks } => {
                write!(f, "checksum mismatch in object {object}, blocks {blocks:?}")
            }
            StoreError::VolumeRemoved(v) => write!(f, "volume {v} was removed"),
        }
    }
}

impl std::error::Error for StoreError {}

impl From<io::Error> for StoreError {
    fn from(e: io::Error) -> StoreError {
        StoreError::Io(e)
    }
}

/// How a store behaves (from the OSD config).
#[derive(Clone, Copy, Debug)]
pub struct StoreOptions {
    /// Use `O_DIRECT` for block-aligned I/O.
    pub direct_io: bool,
    /// Open object files kept per shard (least recently used ones are closed).
    pub open_max: usize,
    /// Keep and verify per-block checksums (fixed per data directory).
    pub checksums: bool,
}

/// Decides `O_DIRECT` for a data directory: probes by creating an aligned file.
/// Start-up only (blocking calls).
pub fn probe_direct_io(data_dir: &Path, policy: DirectIo) -> io::Result<bool> {
    if policy == DirectIo::Off {
        return Ok(false);
    }
    let probe = data_dir.join(".direct-io-probe");
    let result = (|| -> io::Result<()> {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .custom_flags(libc::O_DIRECT)
            .open(&probe)?;
        let buf = AlignedBuf::zeroed(DIRECT_IO_ALIGN);
        // SAFETY: buf is a valid aligned buffer of DIRECT_IO_ALIGN bytes.
        let n = unsafe {
            libc::pwrite(
                f.as_raw_fd(),
                buf.as_slice().as_ptr() as *const libc::c_void,
                DIRECT_IO_ALIGN,
                0,
            )
        };
        if n != DIRECT_IO_ALIGN as isize {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    })();
    let _ = std::fs::remove_file(&probe);
    match (result, policy) {
        (Ok(()), _) => Ok(true),
        (Err(e), DirectIo::On) => Err(io::Error::other(format!(
            "direct_io: on, but O_DIRECT does not work in {}: {e}",
            data_dir.display()
        ))),
        (Err(_), _) => Ok(false),
    }
}

/// Bound of the known-absent object cache.
const ABSENT_CACHE_MAX: usize = 65_536;

/// Files removed between yields when deleting a volume.
pub const DELETE_BATCH: u64 = 64;

/// Most fdatasyncs one flush keeps in flight (and object files it holds open).
pub const FLUSH_PARALLEL_MAX: usize = 64;

/// Times a read re-reads blocks that failed verification while a write to the
/// object was in flight (the write, not the disk, explains such a mismatch).
const READ_RETRIES: u32 = 32;

/// Objects examined for eviction at most per open (only idle, clean ones go).
const EVICT_SCAN_MAX: usize = 64;

/// Blocks recomputed per read during recovery (1 MiB).
const RECOVER_CHUNK_BLOCKS: usize = 256;

/// Exit status of an OSD that stopped because its storage failed.
const EXIT_STORAGE_FAILED: i32 = 74;

/// One open object: its file and its checksums as they are now (the on-disk copy
/// is brought up to date at FLUSH).
struct ObjectState {
    pg: PgId,
    object: ObjectId,
    file: File,
    /// Stored form of each block's checksum ([`meta::block_sum`]); a missing slot is
    /// 0 (an all-zero block).
    sums: RefCell<Vec<u32>>,
    /// The header on disk was invalid: no block of this object can be verified.
    meta_bad: Cell<bool>,
    /// Checksum slots the file may hold non-zero: the `crc_count` of its last
    /// metadata write (or more, for a file whose stale slots a load found). The
    /// next metadata write zeroes those past the new count ([`meta::encode_meta`]).
    disk_slots: Cell<usize>,
    version: Cell<u64>,
    /// Writes in flight, and a counter bumped when one starts or ends; a read that
    /// saw either change may have raced a write and re-reads.
    writes_inflight: Cell<u32>,
    write_epoch: Cell<u64>,
    idle_waiters: RefCell<Vec<Waker>>,
    /// Read-modify-write of partial blocks holds this.
    rmw: ObjectLock,
    /// A flush's write of the header and checksums holds this, so that two
    /// flushes' metadata writes of one object never race: with out-of-order
    /// completion the older snapshot could land last and leave checksums on disk
    /// that do not match the data (simulator seed 41296).
    meta: ObjectLock,
}

impl ObjectState {
    fn header(&self) -> Header {
        Header {
            object: self.object,
            pg: self.pg,
            crc_count: self.sums.borrow().len() as u32,
            version: self.version.get(),
        }
    }

    fn sum(&self, block: usize) -> u32 {
        self.sums.borrow().get(block).copied().unwrap_or(0)
    }

    /// Records block `block`'s checksum. The list ends at the last block that is
    /// not all zero: a block rewritten with zeroes at its end shortens it, so two
    /// copies with the same bytes have the same header (the simulator compares
    /// object files whole; seed 57 found copies equal but for this count, after a
    /// primary's abandoned write was overwritten with zeroes by recovery).
    fn set_sum(&self, block: usize, sum: u32) {
        let mut s = self.sums.borrow_mut();
        if block >= s.len() {
            if sum == 0 {
                return;
            }
            s.resize(block + 1, 0);
        }
        s[block] = sum;
        if sum == 0 && block + 1 == s.len() {
            let keep = s.iter().rposition(|&x| x != 0).map_or(0, |i| i + 1);
            s.truncate(keep);
        }
    }

    /// Blocks of `data` (starting at block `first`) that do not verify.
    fn verify(&self, first: usize, data: &[u8]) -> Vec<u32> {
        data.chunks(BLOCK)
            .enumerate()
            .filter(|(i, b)| self.meta_bad.get() || meta::block_sum(b) != self.sum(first + i))
            .map(|(i, _)| (first + i) as u32)
            .collect()
    }

    async fn wait_idle(&self) {
        std::future::poll_fn(|cx| {
            if self.writes_inflight.get() == 0 {
                Poll::Ready(())
            } else {
                self.idle_waiters.borrow_mut().push(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }
}

/// A lock over one object for the tasks of one shard thread (no atomics: the
/// store is single-threaded).
#[derive(Default)]
struct ObjectLock {
    locked: Cell<bool>,
    waiters: RefCell<Vec<Waker>>,
}

impl ObjectLock {
    async fn lock(&self) -> ObjectLockGuard<'_> {
        self.acquire().await;
        ObjectLockGuard(self)
    }

    async fn acquire(&self) {
        std::future::poll_fn(|cx| {
            if self.locked.get() {
                self.waiters.borrow_mut().push(cx.waker().clone());
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
        .await;
        self.locked.set(true);
    }

    fn release(&self) {
        self.locked.set(false);
        for w in self.waiters.borrow_mut().drain(..) {
            w.wake();
        }
    }
}

struct ObjectLockGuard<'a>(&'a ObjectLock);

impl Drop for ObjectLockGuard<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

/// Holds the opening of one object ([`ObjectStore::opening`]); the lock is
/// dropped from the map when nobody else waits for it.
struct OpeningGuard<'a> {
    store: &'a ObjectStore,
    object: ObjectId,
    lock: Rc<ObjectLock>,
}

impl Drop for OpeningGuard<'_> {
    fn drop(&mut self) {
        self.lock.release();
        // The map's reference and this one: no task waits for it.
        if Rc::strong_count(&self.lock) == 2 {
            self.store.opening.borrow_mut().remove(&self.object);
        }
    }
}

/// The open objects, least recently used first out.
#[derive(Default)]
struct Lru {
    map: HashMap<ObjectId, (Rc<ObjectState>, u64)>,
    order: BTreeMap<u64, ObjectId>,
    tick: u64,
}

impl Lru {
    fn get(&mut self, object: &ObjectId) -> Option<Rc<ObjectState>> {
        let (state, old) = self.map.get_mut(object)?;
        self.order.remove(old);
        self.tick += 1;
        *old = self.tick;
        self.order.insert(self.tick, *object);
        Some(state.clone())
    }

    /// Inserts, closing least recently used objects that nobody else holds (not
    /// dirty, no operation in flight) while over `max`.
    fn insert(&mut self, state: Rc<ObjectState>, max: usize) {
        let mut victims = Vec::new();
        for (tick, object) in self.order.iter().take(EVICT_SCAN_MAX) {
            if self.map.len() - victims.len() < max {
                break;
            }
            if self
                .map
                .get(object)
                .is_some_and(|(s, _)| Rc::strong_count(s) == 1)
            {
                victims.push((*tick, *object));
            }
        }
        for (tick, object) in victims {
            self.order.remove(&tick);
            self.map.remove(&object);
        }
        self.tick += 1;
        let object = state.object;
        if let Some((_, old)) = self.map.insert(object, (state, self.tick)) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, object);
    }

    fn remove(&mut self, object: &ObjectId) {
        if let Some((_, tick)) = self.map.remove(object) {
            self.order.remove(&tick);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.len()
    }
}

/// Objects of one shard.
pub struct ObjectStore {
    root: PathBuf,
    fs: Fs,
    checksums: bool,
    open_max: usize,
    files: RefCell<Lru>,
    /// Objects written and not yet known stable, with the generation of their last
    /// write (and their state, which stays open until then: its checksums exist only
    /// in memory). An entry is removed only after an fdatasync that *started after*
    /// that write succeeded, so a flush racing another flush never returns before the
    /// data it covers is stable.
    dirty: RefCell<HashMap<ObjectId, (u64, Rc<ObjectState>)>>,
    /// Directories that gained entries and are not yet known stable (same rule), so
    /// a new object's name is as durable as its data.
    dirty_dirs: RefCell<HashMap<PathBuf, u64>>,
    /// Generation counter for the two maps above.
    generation: Cell<u64>,
    /// Placement group directories known to exist.
    known_dirs: RefCell<HashSet<PgId>>,
    /// Objects known not to exist (reads of never-written data are common and
    /// would otherwise cost a failing `open` each). Exact, because only this shard
    /// creates or removes its objects; cleared when it grows past its bound.
    absent: RefCell<HashSet<ObjectId>>,
    /// Objects being opened (or removed), one task at a time each. An open
    /// awaits the disk between finding the file and caching its state, and a
    /// create refused for a full disk takes its file back meanwhile: a second
    /// opener that found the file then would cache the state of an unlinked
    /// file, and every later write of the object would land in that orphan
    /// (simulator seed 13469).
    opening: RefCell<HashMap<ObjectId, Rc<ObjectLock>>>,
    /// Volumes removed (by a DeleteVolume request or a tombstone in the map): no
    /// object of theirs is created again. Volume ids are never reused. Bounded by
    /// [`DELETED_VOLUMES_MAX`] (the newest ids, like the map's tombstones).
    removed_volumes: RefCell<BTreeSet<VolumeId>>,
    journal: Journal,
    /// Blocks rewritten since start-up of the objects its restart left in
    /// doubt (rewritten.rs): sure whatever the power cut took.
    rewritten: rewritten::Rewritten,
    /// The stable copy of the placement-group logs (pg_log_file.rs).
    pg_log: pg_log_file::PgLogFile,
    /// Write-like operations in flight on this shard (the journal is reset only
    /// when there are none).
    writes_inflight: Cell<u64>,
    /// Journal entries beyond which a new dirty object makes the store drain and
    /// flush ([`journal::JOURNAL_ENTRIES_SOFT_MAX`]; lower in tests).
    journal_max: Cell<usize>,
    /// New writes wait: the store is draining in-flight writes to reset the journal.
    draining: Cell<bool>,
    /// Tasks waiting for the drain to end or for in-flight writes to reach zero.
    drain_waiters: wait_list::WaitList,
}

/// Marks a write in flight on an object for as long as it lives; on drop the object
/// is dirty with a new generation (so a flush that raced the write keeps it dirty).
struct WriteGuard<'a> {
    store: &'a ObjectStore,
    state: Rc<ObjectState>,
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        self.store.mark_dirty(&self.state);
        let s = &self.state;
        s.writes_inflight.set(s.writes_inflight.get() - 1);
        s.write_epoch.set(s.write_epoch.get() + 1);
        if s.writes_inflight.get() == 0 {
            for w in s.idle_waiters.borrow_mut().drain(..) {
                w.wake();
            }
        }
        let left = self.store.writes_inflight.get() - 1;
        self.store.writes_inflight.set(left);
        if left == 0 {
            self.store.wake_drain();
        }
    }
}

/// Removes `key` from a dirty map if no write re-dirtied it since `generation`.
fn clear_if_unchanged<K: std::hash::Hash + Eq, V>(
    map: &RefCell<HashMap<K, V>>,
    key: &K,
    generation: u64,
    generation_of: impl Fn(&V) -> u64,
) {
    let mut m = map.borrow_mut();
    if m.get(key).map(generation_of) == Some(generation) {
        m.remove(key);
    }
}

fn invalid(msg: &str) -> StoreError {
    StoreError::Io(io::Error::new(io::ErrorKind::InvalidInput, msg.to_string()))
}

impl ObjectStore {
    /// The file system the store works through (shared with what else the
    /// shard writes under the data directory, such as the restart-doubt record).
    pub fn fs(&self) -> &Fs {
        &self.fs
    }

    /// The store of shard `shard` in `data_dir` (which [`layout::open_data_dir`]
    /// checked and [`recover`] recovered).
    pub fn new(data_dir: &Path, shard: u16, options: StoreOptions) -> ObjectStore {
        let fs = Fs::Real {
            direct_io: options.direct_io,
        };
        ObjectStore::with_fs(fs, data_dir, shard, options)
    }

    /// A store on any [`Fs`] (the power-loss simulation uses this).
    pub fn with_fs(fs: Fs, root: &Path, shard: u16, options: StoreOptions) -> ObjectStore {
        ObjectStore {
            root: root.to_path_buf(),
            journal: Journal::new(fs.clone(), layout::journal_path(root, shard)),
            pg_log: pg_log_file::PgLogFile::new(fs.clone(), root, shard),
            fs,
            checksums: options.checksums,
            open_max: options.open_max.max(16),
            files: RefCell::new(Lru::default()),
            dirty: RefCell::new(HashMap::default()),
            dirty_dirs: RefCell::new(HashMap::default()),
            generation: Cell::new(0),
            known_dirs: RefCell::new(HashSet::default()),
            absent: RefCell::new(HashSet::default()),
            rewritten: rewritten::Rewritten::default(),
            opening: RefCell::new(HashMap::default()),
            removed_volumes: RefCell::new(BTreeSet::new()),
            writes_inflight: Cell::new(0),
            journal_max: Cell::new(journal::JOURNAL_ENTRIES_SOFT_MAX),
            draining: Cell::new(false),
            drain_waiters: wait_list::WaitList::default(),
        }
    }

    /// Path of an object's file.
    pub fn object_path(&self, pg: PgId, object: ObjectId) -> PathBuf {
        layout::object_path(&self.root, pg, object)
    }

    /// A failed sync or journal write. On a real disk this stops the process: Linux
    /// reports a writeback error once and then marks the pages clean, so a retry
    /// would "succeed" without the data. Stopping makes the manager mark this OSD
    /// down; clients wait for it. On the simulated disk the simulator kills the
    /// process instead (`SimFs::fail_stop`: from here on nothing reaches its disk).
    fn sync_failed(&self, what: &str, e: io::Error) -> StoreError {
        if self.fs.is_sim() {
            tracing::error!("{what} failed: {e}; the simulated OSD stops");
            self.fs.fail_stop();
            return StoreError::Io(e);
        }
        tracing::error!(
            "{what} failed: {e}; stopping this OSD so no write is acknowledged as stable when it is not"
        );
        eprintln!("flame-osd: {what} failed: {e}; stopping");
        doubt_record::mark_writeback_failed(&self.root);
        std::process::exit(EXIT_STORAGE_FAILED)
    }

    /// The open state of an object; with `create`, creates its file. `Ok(None)`: it
    /// does not exist and `create` is false — the object reads as zeroes.
    async fn state(
        &self,
        pg: PgId,
        object: ObjectId,
        create: bool,
    ) -> Result<Option<Rc<ObjectState>>, StoreError> {
        if let Some(s) = self.cached(object) {
            return Ok(Some(s));
        }
        let _opening = self.lock_opening(object).await;
        // Opened (or found missing, or created and taken back) by the task this
        // one waited for.
        if let Some(s) = self.cached(object) {
            return Ok(Some(s));
        }
        if !create && self.absent.borrow().contains(&object) {
            return Ok(None);
        }
        if create && self.is_removed(object.volume) {
            return Err(StoreError::VolumeRemoved(object.volume));
        }
        if create && !self.known_dirs.borrow().contains(&pg) {
            if self.fs.mkdir(&layout::pg_dir(&self.root, pg)).await? {
                self.mark_dir_dirty(layout::pgs_dir(&self.root));
            }
            self.known_dirs.borrow_mut().insert(pg);
        }
        let path = self.object_path(pg, object);
        let Some((file, created)) = self.fs.open(&path, create).await? else {
            let mut absent = self.absent.borrow_mut();
            if absent.len() >= ABSENT_CACHE_MAX {
                absent.clear();
            }
            absent.insert(object);
            return Ok(None);
        };
        self.absent.borrow_mut().remove(&object);
        if created && self.is_removed(object.volume) {
            // Removed while this open waited: `delete_volume` marks the volume
            // before it lists, so either its listing sees this file or this check
            // sees the mark. Take the file back.
            drop(file);
            self.fs.unlink(&path, false).await?;
            return Err(StoreError::VolumeRemoved(object.volume));
        }
        if created {
            self.mark_dir_dirty(layout::pg_dir(&self.root, pg));
        }
        let state = ObjectState {
            pg,
            object,
            file,
            sums: RefCell::new(Vec::new()),
            meta_bad: Cell::new(false),
            disk_slots: Cell::new(0),
            version: Cell::new(0),
            writes_inflight: Cell::new(0),
            write_epoch: Cell::new(0),
            idle_waiters: RefCell::new(Vec::new()),
            rmw: ObjectLock::default(),
            meta: ObjectLock::default(),
        };
        if self.checksums && !created {
            load_meta(&state).await?;
        }
        if self.checksums && create {
            // The header and the first block of checksums (every checksum of a
            // 4 MiB object) are written at FLUSH, when ENOSPC would stop the OSD:
            // reserve their space now, where it fails the write with ENOSPC instead
            // (also for a file an earlier, failed attempt created).
            if let Err(e) = state.file.allocate(0, (HEADER_LEN + BLOCK) as u64).await {
                if created {
                    // Take back the file this call made: an object file must
                    // never exist without its metadata's space, or a later
                    // discard of it (which opens without creating) would leave
                    // a header for FLUSH to write on a full disk, and stop the
                    // OSD (simulator seeds 726, 1106, 1215).
                    drop(state);
                    self.fs.unlink(&path, false).await?;
                }
                return Err(e.into());
            }
        }
        // Another task may have opened it while this one waited: use theirs, whose
        // checksums may already be newer than the disk's.
        if let Some(s) = self.cached(object) {
            return Ok(Some(s));
        }
        let state = Rc::new(state);
        self.files.borrow_mut().insert(state.clone(), self.open_max);
        Ok(Some(state))
    }

    /// Waits until no other task opens or removes `object`, and holds that until
    /// the guard is dropped.
    async fn lock_opening(&self, object: ObjectId) -> OpeningGuard<'_> {
        let lock = self.opening.borrow_mut().entry(object).or_default().clone();
        lock.acquire().await;
        OpeningGuard {
            store: self,
            object,
            lock,
        }
    }

    fn cached(&self, object: ObjectId) -> Option<Rc<ObjectState>> {
        if let Some(s) = self.files.borrow_mut().get(&object) {
            return Some(s);
        }
        let dirty = self.dirty.borrow().get(&object).map(|(_, s)| s.clone())?;
        self.files.borrow_mut().insert(dirty.clone(), self.open_max);
        Some(dirty)
    }

    /// Reads `len` bytes at `offset`; never-written bytes are zero. Every block
    /// touched is verified; a block that does not match its checksum is reported,
    /// not returned.
    pub async fn read(
        &self,
        pg: PgId,
        object: ObjectId,
        offset: u32,
        len: u32,
    ) -> Result<PayloadBuf, StoreError> {
        check_range(offset, len)?;
        let Some(state) = self.state(pg, object, false).await? else {
            let zeros = PayloadBufMut::zeroed_wait(len as usize).await;
            return Ok(zeros.map_err(std::io::Error::from)?.freeze());
        };
        if len == 0 {
            return Ok(PayloadBuf::empty());
        }
        crate::failpoints::check("store_read")?;
        if !self.checksums {
            return Ok(state
                .file
                .read_buf(DATA_OFFSET + u64::from(offset), len as usize)
                .await?);
        }
        let (first, count) = block_span(offset, len);
        let start = (offset as usize) - first * BLOCK;
        let mut bad = Vec::new();
        for _ in 0..READ_RETRIES {
            let epoch = state.write_epoch.get();
            let racing = state.writes_inflight.get() > 0;
            let data = state
                .file
                .read_buf(DATA_OFFSET + (first * BLOCK) as u64, count * BLOCK)
                .await?;
            bad = state.verify(first, &data);
            if bad.is_empty() {
                // The requested bytes of the verified blocks, without a copy.
                return Ok(data.slice(start..start + len as usize));
            }
            if !racing && state.write_epoch.get() == epoch {
                break;
            }
            state.wait_idle().await;
        }
        tracing::error!(%object, blocks = ?bad, "checksum mismatch on read");
        state.file.note_checksum_mismatch(&bad);
        Err(StoreError::Checksum {
            object,
            blocks: bad,
        })
    }

    /// Writes `data` at `offset`. With `fua` the data is on stable storage when this
    /// returns (and the journal names the object, so its checksums are recomputed if
    /// the OSD stops before the next flush).
    pub async fn write(
        &self,
        pg: PgId,
        object: ObjectId,
        offset: u32,
        data: PayloadBuf,
        fua: bool,
    ) -> Result<(), StoreError> {
        check_range(offset, data.len() as u32)?;
        if data.len() > OBJECT_SIZE_MAX as usize {
            return Err(invalid("write larger than an object"));
        }
        if data.is_empty() {
            return Ok(());
        }
        let state = self
            .state(pg, object, true)
            .await?
            .ok_or_else(|| io::Error::other("object file vanished while creating it"))?;
        let _guard = self.begin_write(&state).await?;
        let len = data.len() as u32;
        let res = self.write_data(&state, offset, data, fua).await;
        self.check_write(object, res)?;
        self.note_rewritten(object, offset, len);
        if fua {
            // The data is stable; only a newly created name may still need its dir.
            self.sync_dirs().await?;
        }
        Ok(())
    }

    /// The data part of [`ObjectStore::write`] (its I/O errors are judged by
    /// [`ObjectStore::check_write`]).
    async fn write_data(
        &self,
        state: &Rc<ObjectState>,
        offset: u32,
        data: PayloadBuf,
        fua: bool,
    ) -> Result<(), StoreError> {
        crate::failpoints::check("store_write")?;
        let offset = u64::from(offset);
        if !self.checksums {
            state
                .file
                .write(DATA_OFFSET + offset, data, fua.then_some(SyncKind::Fua))
                .await?;
        } else if offset.is_multiple_of(BLOCK as u64) && data.len().is_multiple_of(BLOCK) {
            let sums: Vec<u32> = data.chunks(BLOCK).map(meta::block_sum).collect();
            state
                .file
                .write(DATA_OFFSET + offset, data, fua.then_some(SyncKind::Fua))
                .await?;
            widen_race_in_tests().await;
            let first = offset as usize / BLOCK;
            for (i, s) in sums.into_iter().enumerate() {
                state.set_sum(first + i, s);
            }
        } else {
            self.write_partial(state, offset, &data, fua).await?;
        }
        Ok(())
    }

    /// Judges a failed data write. A full file system (`ENOSPC`, `EDQUOT`) is
    /// reported to the caller (the client sees ENOSPC; nothing was acknowledged, and
    /// the copies that did take the write hold bytes no reader was promised). Any
    /// other I/O error stops the OSD like a failed sync (exit status 74): the disk
    /// may hold part of the write while the other copies hold all of it, and an OSD
    /// that carried on would serve a copy that silently diverged. Stopping gets it
    /// marked down, and the other copies carry on.
    fn check_write(&self, object: ObjectId, res: Result<(), StoreError>) -> Result<(), StoreError> {
        match res {
            Err(StoreError::Io(e))
                if !doubt_record::is_full(&e)
                    && e.kind() != io::ErrorKind::InvalidInput
                    // The memory pool stayed exhausted: raised before any byte
                    // reached the disk.
                    && e.kind() != io::ErrorKind::OutOfMemory =>
            {
                Err(self.sync_failed(&format!("write to object {object}"), e))
            }
            other => other,
        }
    }

    /// A write that does not cover whole blocks: the blocks it touches are read,
    /// verified, merged and written whole, so each block's new checksum is over its
    /// full new content. Serialised per object.
    async fn write_partial(
        &self,
        state: &Rc<ObjectState>,
        offset: u64,
        data: &[u8],
        fua: bool,
    ) -> Result<(), StoreError> {
        let _lock = state.rmw.lock().await;
        let (first, count) = block_span(offset as u32, data.len() as u32);
        let start = offset as usize - first * BLOCK;
        let end = start + data.len();
        let base = DATA_OFFSET + (first * BLOCK) as u64;
        // Aligned, so the merged blocks go to the disk with O_DIRECT from here.
        // Not `zeroed_wait`: this write already holds its payload, and if every
        // pool buffer belonged to partial writes waiting here, none would ever be
        // freed. The synchronous allocation takes heap memory when the pool is
        // exhausted, bounded by the writes in flight.
        let mut buf = PayloadBufMut::zeroed(count * BLOCK);
        // Only the edge blocks hold old bytes that survive the write.
        let mut edges = Vec::with_capacity(2);
        if !start.is_multiple_of(BLOCK) || (count == 1 && !end.is_multiple_of(BLOCK)) {
            edges.push(first);
        }
        if !end.is_multiple_of(BLOCK) && count > 1 {
            edges.push(first + count - 1);
        }
        for b in edges {
            let at = (b - first) * BLOCK;
            let old = state.file.read(base + at as u64, BLOCK).await?;
            let bad = state.verify(b, &old);
            if !bad.is_empty() {
                // Merging would give corrupt bytes a fresh, valid checksum.
                tracing::error!(object = %state.object, blocks = ?bad, "checksum mismatch under a partial write");
                state.file.note_checksum_mismatch(&bad);
                return Err(StoreError::Checksum {
                    object: state.object,
                    blocks: bad,
                });
            }
            buf.as_mut_slice()[at..at + BLOCK].copy_from_slice(&old);
        }
        buf.as_mut_slice()[start..end].copy_from_slice(data);
        let sums: Vec<u32> = buf.as_slice().chunks(BLOCK).map(meta::block_sum).collect();
        state
            .file
            .write(base, buf.freeze(), fua.then_some(SyncKind::Fua))
            .await?;
        widen_race_in_tests().await;
        for (i, s) in sums.into_iter().enumerate() {
            state.set_sum(first + i, s);
        }
        Ok(())
    }

    /// Registers a write-like operation: dirty (so the journal is not reset under
    /// it) and named in the journal before any data is written.
    async fn begin_write<'a>(
        &'a self,
        state: &Rc<ObjectState>,
    ) -> Result<WriteGuard<'a>, StoreError> {
        // Bounded: waits only while another task drains, which ends once the
        // writes in flight (each bounded by its I/O) are done and a flush ran.
        while self.draining.get() {
            self.wait_drain().await;
        }
        let new_dirty = !self.dirty.borrow().contains_key(&state.object);
        if self.checksums && new_dirty && self.journal.len() >= self.journal_max.get() {
            // Bounds the journal: a reset needs a moment with no write in flight,
            // which constant load may never leave, so make one.
            self.drain_and_flush().await?;
        } else if self.checksums && new_dirty && self.dirty.borrow().len() >= self.open_max {
            // Bounds memory: dirty checksums stay in memory until flushed.
            self.flush(None).await?;
        }
        self.writes_inflight.set(self.writes_inflight.get() + 1);
        state.writes_inflight.set(state.writes_inflight.get() + 1);
        state.write_epoch.set(state.write_epoch.get() + 1);
        let guard = WriteGuard {
            store: self,
            state: state.clone(),
        };
        self.mark_dirty(state);
        if self.checksums
            && let Err(e) = self.journal.record(state.object, state.pg).await
        {
            return Err(self.sync_failed("intent journal write", e));
        }
        Ok(guard)
    }

    /// Holds new writes back, waits for the ones in flight, and flushes everything
    /// (which then resets the journal).
    async fn drain_and_flush(&self) -> Result<(), StoreError> {
        struct Draining<'a>(&'a ObjectStore);
        impl Drop for Draining<'_> {
            fn drop(&mut self) {
                self.0.draining.set(false);
                self.0.wake_drain();
            }
        }
        self.draining.set(true);
        let _draining = Draining(self);
        // Bounded: no new write starts while draining.
        while self.writes_inflight.get() > 0 {
            self.wait_drain().await;
        }
        self.flush(None).await
    }

    fn wake_drain(&self) {
        self.drain_waiters.wake_all();
    }

    /// Waits for the next `wake_drain`.
    async fn wait_drain(&self) {
        self.drain_waiters.wait().await
    }

    fn next_generation(&self) -> u64 {
        let g = self.generation.get() + 1;
        self.generation.set(g);
        g
    }

    fn mark_dirty(&self, state: &Rc<ObjectState>) {
        let g = self.next_generation();
        self.dirty
            .borrow_mut()
            .insert(state.object, (g, state.clone()));
    }

    fn mark_dir_dirty(&self, dir: PathBuf) {
        let g = self.next_generation();
        self.dirty_dirs.borrow_mut().insert(dir, g);
    }

    /// Makes `[offset, offset+len)` read back as zeroes: whole blocks by punching a
    /// hole (their checksum becomes the zero block's), partial ones by writing zeroes.
    pub async fn zero(
        &self,
        pg: PgId,
        object: ObjectId,
        offset: u32,
        len: u32,
        fua: bool,
    ) -> Result<(), StoreError> {
        check_range(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let Some(state) = self.state(pg, object, false).await? else {
            // No file: already zero.
            self.note_rewritten(object, offset, len);
            return Ok(());
        };
        let _guard = self.begin_write(&state).await?;
        let res = async {
            crate::failpoints::check("store_write")?;
            let (start, end) = (u64::from(offset), u64::from(offset) + u64::from(len));
            if !self.checksums {
                state
                    .file
                    .punch(DATA_OFFSET + start, u64::from(len))
                    .await?;
            } else {
                let b = BLOCK as u64;
                let inner_start = start.div_ceil(b) * b;
                let inner_end = (end / b) * b;
                let head_end = inner_start.min(end);
                if start < head_end {
                    let zeroes = vec![0; (head_end - start) as usize];
                    self.write_partial(&state, start, &zeroes, false).await?;
                }
                if inner_start < inner_end {
                    state
                        .file
                        .punch(DATA_OFFSET + inner_start, inner_end - inner_start)
                        .await?;
                    for blk in inner_start / b..inner_end / b {
                        state.set_sum(blk as usize, 0);
                    }
                }
                let tail_start = inner_end.max(head_end);
                if tail_start < end {
                    let zeroes = vec![0; (end - tail_start) as usize];
                    self.write_partial(&state, tail_start, &zeroes, false)
                        .await?;
                }
            }
            Ok::<(), StoreError>(())
        }
        .await;
        self.check_write(object, res)?;
        self.note_rewritten(object, offset, len);
        if fua && let Err(e) = state.file.datasync().await {
            return Err(self.sync_failed(&format!("fdatasync of object {object}"), e));
        }
        Ok(())
    }

    /// Tracks the blocks rewritten from now on of `objects` (this shard's
    /// restart doubt), for [`ObjectStore::rewritten_blocks`].
    pub fn track_rewrites(&self, objects: impl IntoIterator<Item = ObjectId>) {
        self.rewritten.track(objects);
    }

    /// Stops tracking `objects` (their doubt is settled).
    pub fn untrack_rewrites(&self, objects: impl IntoIterator<Item = ObjectId>) {
        self.rewritten.untrack(objects);
    }

    /// The blocks of `object` (tracked by [`ObjectStore::track_rewrites`])
    /// written whole, zeroed, repaired or removed since start-up.
    pub fn rewritten_blocks(&self, object: ObjectId) -> rewritten::BlockRanges {
        self.rewritten.of(object)
    }

    fn note_rewritten(&self, object: ObjectId, offset: u32, len: u32) {
        // The data path pays one branch when nothing is in doubt (the usual case).
        if self.rewritten.is_idle() {
            return;
        }
        if let Some((first, end)) = rewritten::whole_blocks(offset, len, BLOCK as u32) {
            self.rewritten.note(object, first, end);
        }
    }

    /// Makes every write applied so far to `volume` (every volume with `None`)
    /// stable, checksums included: for each dirty object, its metadata is written
    /// and the file fdatasynced (up to [`FLUSH_PARALLEL_MAX`] at once through the
    /// ring); then directories that gained entries are fsynced. When no object is
    /// left dirty the intent journal is reset.
    ///
    /// A failed sync is fatal to the process (see `sync_failed`).
    pub async fn flush(&self, volume: Option<VolumeId>) -> Result<(), StoreError> {
        // The log records of the writes this flush covers: taken before their
        // data is synced, made stable after (pg_log_file.rs).
        let records = self.pg_log.take(volume);
        let result = self.flush_data(volume).await;
        if result.is_err() {
            self.pg_log.put_back(records);
            return result;
        }
        if let Err(e) = self.pg_log.persist(&records).await {
            return Err(self.sync_failed("placement-group log write", e));
        }
        Ok(())
    }

    /// The stable copy of this shard's placement-group logs.
    pub fn pg_log(&self) -> &pg_log_file::PgLogFile {
        &self.pg_log
    }

    async fn flush_data(&self, volume: Option<VolumeId>) -> Result<(), StoreError> {
        let snapshot: Vec<(ObjectId, u64, Rc<ObjectState>)> = self
            .dirty
            .borrow()
            .iter()
            .filter(|(o, _)| volume.is_none_or(|v| o.volume == v))
            .map(|(o, (g, s))| (*o, *g, s.clone()))
            .collect();
        for chunk in snapshot.chunks(FLUSH_PARALLEL_MAX) {
            let mut syncs = Vec::with_capacity(chunk.len());
            for (object, generation, state) in chunk {
                let with_meta = self.checksums;
                let state = state.clone();
                syncs.push((
                    *object,
                    *generation,
                    reactor::spawn(async move {
                        // One metadata write of this object at a time, encoded
                        // once it holds the lock: the last one to land is the
                        // newest (never older than `generation` says).
                        let _meta = state.meta.lock().await;
                        if with_meta && !state.meta_bad.get() {
                            let (m, count) = {
                                let sums = state.sums.borrow();
                                let on_disk = state.disk_slots.get();
                                (
                                    meta::encode_meta(&state.header(), &sums, on_disk),
                                    sums.len(),
                                )
                            };
                            crate::failpoints::check("store_meta_write")?;
                            state.file.write(0, m, None).await?;
                            state.disk_slots.set(count);
                        }
                        state.file.datasync().await
                    }),
                ));
            }
            for (object, generation, sync) in syncs {
                if let Err(e) = sync.await {
                    return Err(self.sync_failed(&format!("flush of object {object}"), e));
                }
                clear_if_unchanged(&self.dirty, &object, generation, |(g, _)| *g);
            }
        }
        self.sync_dirs().await?;
        if self.checksums {
            let clean = || self.dirty.borrow().is_empty() && self.writes_inflight.get() == 0;
            if let Err(e) = self.journal.reset_if(clean).await {
                return Err(self.sync_failed("intent journal reset", e));
            }
        }
        Ok(())
    }

    async fn sync_dirs(&self) -> Result<(), StoreError> {
        let dirs: Vec<(PathBuf, u64)> = self
            .dirty_dirs
            .borrow()
            .iter()
            .map(|(d, g)| (d.clone(), *g))
            .collect();
        for (dir, generation) in dirs {
            if let Err(e) = self.fs.sync_dir(&dir).await {
                return Err(self.sync_failed(&format!("fsync of directory {}", dir.display()), e));
            }
            clear_if_unchanged(&self.dirty_dirs, &dir, generation, |g| *g);
        }
        Ok(())
    }

    /// Replaces block `block` of an object with `good` (4096 bytes that verified on
    /// another copy), stably, and counts the repair. For the read-repair path: a read
    /// that got [`StoreError::Checksum`] fetches each bad block from a copy and calls
    /// this (`crate::read_repair`).
    pub async fn repair_block(
        &self,
        pg: PgId,
        object: ObjectId,
        block: u32,
        good: &[u8],
    ) -> Result<(), StoreError> {
        if good.len() != BLOCK {
            return Err(invalid("repair needs one whole block inside an object"));
        }
        self.repair_range(pg, object, block, good).await?;
        crate::metrics::checksum_errors(true, 1);
        tracing::warn!(%object, block, "repaired a block from another copy");
        Ok(())
    }

    /// Replaces whole blocks `first..` of an object with `good` (a multiple of 4096
    /// bytes that verified on another copy), stably (FUA), with their checksums.
    /// For reads that failed with an I/O error: rewriting the range lets the device
    /// remap a bad sector. Counting is the caller's.
    pub async fn repair_range(
        &self,
        pg: PgId,
        object: ObjectId,
        first: u32,
        good: &[u8],
    ) -> Result<(), StoreError> {
        let blocks = good.len() / BLOCK;
        if good.is_empty()
            || !good.len().is_multiple_of(BLOCK)
            || first as usize + blocks > BLOCKS_MAX
        {
            return Err(invalid("repair needs whole blocks inside an object"));
        }
        let state = self
            .state(pg, object, true)
            .await?
            .ok_or_else(|| io::Error::other("object file vanished while creating it"))?;
        let _guard = self.begin_write(&state).await?;
        let _lock = state.rmw.lock().await;
        let offset = DATA_OFFSET + u64::from(first) * BLOCK as u64;
        state
            .file
            .write(offset, PayloadBuf::copy_from(good), Some(SyncKind::Fua))
            .await?;
        for (i, b) in good.chunks(BLOCK).enumerate() {
            state.set_sum(first as usize + i, meta::block_sum(b));
        }
        self.rewritten.note(object, first, first + blocks as u32);
        Ok(())
    }

    /// Removes the volume's objects in the placement groups for which `owned` is
    /// true (this shard's). Returns how many were removed. Lists only placement
    /// group directories (on a helper thread) and yields to the shard's other tasks
    /// every [`DELETE_BATCH`] files, so removing a large volume does not stall every
    /// connection of the shard.
    pub async fn delete_volume(
        &self,
        volume: VolumeId,
        owned: impl Fn(PgId) -> bool,
    ) -> Result<u64, StoreError> {
        self.note_removed_volumes([volume]);
        let mut removed = 0;
        let dirs: Vec<PathBuf> = self
            .fs
            .list_dir(&layout::pgs_dir(&self.root))
            .await?
            .iter()
            .filter_map(|name| layout::parse_pg_name(name))
            .filter(|&pg| owned(pg))
            .map(|pg| layout::pg_dir(&self.root, pg))
            .collect();
        let listings = self.fs.list_dirs(dirs.clone()).await?;
        for (dir, names) in dirs.iter().zip(listings) {
            for name in names {
                let Some(object) = layout::parse_object_name(&name) else {
                    continue; // not an object file
                };
                if object.volume != volume {
                    continue;
                }
                // Not while another task opens it (as `remove_object`): it would
                // cache the state of the file this unlinks.
                let _opening = self.lock_opening(object).await;
                self.files.borrow_mut().remove(&object);
                self.dirty.borrow_mut().remove(&object);
                if self.fs.unlink(&dir.join(&name), false).await? {
                    removed += 1;
                }
                self.absent.borrow_mut().insert(object);
                if removed % DELETE_BATCH == 0 {
                    reactor::yield_now().await;
                }
            }
        }
        Ok(removed)
    }

    /// Remembers removed volumes (a DeleteVolume request, or the map's tombstones
    /// with every new map): creating an object of one fails from now on.
    pub fn note_removed_volumes(&self, volumes: impl IntoIterator<Item = VolumeId>) {
        let mut removed = self.removed_volumes.borrow_mut();
        removed.extend(volumes);
        while removed.len() > DELETED_VOLUMES_MAX {
            removed.pop_first();
        }
    }

    fn is_removed(&self, volume: VolumeId) -> bool {
        self.removed_volumes.borrow().contains(&volume)
    }

    /// Open objects (for tests of the cache bound).
    #[cfg(test)]
    fn open_count(&self) -> usize {
        self.files.borrow().len()
    }
}

/// In tests, lets other tasks run between a write's data reaching the file and its
/// checksums being updated: the window in which a racing read sees new data with old
/// checksums (in production it is as short as completion ordering makes it, but it
/// exists), widened so the test of the read's re-read hits it.
async fn widen_race_in_tests() {
    #[cfg(test)]
    if WIDEN_RACE.with(Cell::get) {
        reactor::sleep(std::time::Duration::from_micros(300)).await;
    }
}

#[cfg(test)]
thread_local! {
    /// Set by the test that races reads against writes (on its own thread).
    static WIDEN_RACE: Cell<bool> = const { Cell::new(false) };
}

/// Rejects a byte range that does not fit in the largest object.
fn check_range(offset: u32, len: u32) -> Result<(), StoreError> {
    if u64::from(offset) + u64::from(len) > u64::from(OBJECT_SIZE_MAX) {
        return Err(invalid("range beyond the largest object size"));
    }
    Ok(())
}

/// First block and number of blocks covering `[offset, offset+len)` (len > 0).
fn block_span(offset: u32, len: u32) -> (usize, usize) {
    let first = offset as usize / BLOCK;
    let last = (offset as usize + len as usize - 1) / BLOCK;
    (first, last - first + 1)
}

/// Slots in the first block of an object's checksum area (`head`: its header
/// block and that block) up to the last non-zero one: past its `crc_count` there
/// are none, but a file written before the metadata write cleared shrunk slots
/// may have some, which the next metadata write then clears.
fn stale_slots(head: &[u8]) -> usize {
    let slots = head.get(HEADER_LEN..).unwrap_or_default();
    slots
        .chunks_exact(4)
        .rposition(|c| c != [0u8; 4])
        .map_or(0, |i| i + 1)
}

/// Loads an object's header and checksums from its file.
async fn load_meta(state: &ObjectState) -> io::Result<()> {
    let head = state.file.read(0, HEADER_LEN + BLOCK).await?;
    match Header::decode(&head, state.object) {
        Loaded::Fresh => state.disk_slots.set(stale_slots(&head)),
        Loaded::Valid(h) => {
            let count = h.crc_count as usize;
            let sums = if count * 4 <= BLOCK {
                meta::decode_sums(&head[HEADER_LEN..], count)
            } else {
                let bytes = state.file.read(HEADER_LEN as u64, count * 4).await?;
                meta::decode_sums(&bytes, count)
            };
            *state.sums.borrow_mut() = sums;
            state.version.set(h.version);
            state.disk_slots.set(count.max(stale_slots(&head)));
        }
        Loaded::Bad(why) => {
            tracing::error!(object = %state.object, "object metadata unreadable ({why}): every block needs repair");
            state.meta_bad.set(true);
        }
    }
    Ok(())
}

/// Start-up recovery: for every object named by a shard's intent journal, the
/// checksums are recomputed from the data on disk and written with the metadata
/// (synced); those objects, and the ones earlier restarts left in doubt that no
/// primary settled since ([`doubt_record`]), are written as the new record of
/// the restart doubt (synced); then the journals are reset. Returns that doubt:
/// the objects that may lack acknowledged writes the other copies have
/// (`PgSuspects`).
///
/// Those objects had writes that no FLUSH covered; after a crash each of their
/// blocks holds either the old or the new data (both are valid answers for an
/// unflushed write), and recomputing makes the checksums agree with whichever it is.
/// A journal whose header does not decode is never taken as empty: every object any
/// of its entries names is recomputed (and in doubt), a superset of the current
/// generation's ([`journal::replay`]), and its reset numbers the new generation
/// above every entry left in it.
/// Run before any shard starts, with nothing else touching the directory;
/// `shards`: the OSD's shard count (the record's reserved room is sized for
/// it, and for every journal on disk).
pub async fn recover(fs: &Fs, root: &Path, shards: usize) -> io::Result<doubt_record::DoubtRecord> {
    let jdir = layout::journal_dir(root);
    let journals = fs.list_dir(&jdir).await?;
    let mut seen = HashSet::default();
    let mut recomputed = Vec::new();
    // The directories of the objects found: their names are made durable before
    // the journal that names them is reset.
    let mut dirs = std::collections::BTreeSet::new();
    for name in &journals {
        let path = jdir.join(name);
        let replayed = journal::replay(fs, &path).await?;
        if replayed.header_unreadable {
            tracing::warn!(
                journal = %path.display(),
                objects = replayed.objects.len(),
                "the intent journal's header does not decode (torn or corrupt): recomputing \
                 the checksums of every object any of its entries names"
            );
        }
        for (pg, object) in replayed.objects {
            if !seen.insert(object) {
                continue;
            }
            let path = layout::object_path(root, pg, object);
            let Some((file, _)) = fs.open(&path, false).await? else {
                // Its name never became durable: nothing to recompute, but every
                // write it had is gone — still in doubt.
                recomputed.push((pg, object));
                continue;
            };
            let head = file.read(0, HEADER_LEN + BLOCK).await?;
            // The slots the last metadata write left (cleared past the new count).
            let (version, on_disk) = match Header::decode(&head, object) {
                Loaded::Valid(h) => (h.version, h.crc_count as usize),
                _ => (0, 0),
            };
            let on_disk = on_disk.max(stale_slots(&head));
            let data_len = file.size().await?.saturating_sub(DATA_OFFSET);
            let blocks = (data_len.div_ceil(BLOCK as u64) as usize).min(BLOCKS_MAX);
            let mut sums = Vec::with_capacity(blocks);
            let mut b = 0;
            // Bounded by BLOCKS_MAX.
            while b < blocks {
                let n = RECOVER_CHUNK_BLOCKS.min(blocks - b);
                let data = file
                    .read(DATA_OFFSET + (b * BLOCK) as u64, n * BLOCK)
                    .await?;
                sums.extend(data.chunks(BLOCK).map(meta::block_sum));
                b += n;
            }
            while sums.last() == Some(&0) {
                sums.pop();
            }
            let header = Header {
                object,
                pg,
                crc_count: sums.len() as u32,
                version,
            };
            file.write(0, meta::encode_meta(&header, &sums, on_disk), None)
                .await?;
            file.datasync().await?;
            if let Some(dir) = path.parent() {
                dirs.insert(dir.to_path_buf());
            }
            recomputed.push((pg, object));
        }
    }
    // After a kill -9 the page cache kept a new object's file, but maybe not its
    // name on disk (its directory was never synced): once the journal is reset
    // nothing would say it is in doubt, and a later power cut would lose the whole
    // file silently (the simulator's seed 12567: a kill -9, a restart, and a
    // power cut a second later left a copy without acknowledged writes).
    for dir in &dirs {
        fs.sync_dir(dir).await?;
    }
    // The doubt outlives the journals that named it, until a primary settles it
    // (seeds 369, 414: a second restart found reset journals and no doubt).
    let stored = doubt_record::read(fs, root).await?;
    doubt_record::reserve(fs, root, journals.len().max(shards)).await?;
    // The record names the boot of the process that wrote it at its start,
    // the one whose writes the journals name (it reset them after): in this
    // boot still, the machine did not reboot since — the page cache kept
    // those writes and the syncs above made them stable; they may only have
    // been lost if the machine rebooted (seed 58), or if this cannot tell.
    // A sync that failed (the process stopped for it, or start-up's syncfs
    // reported it) may have cost pages the kernel could not write: a reboot's
    // doubt, although the boot is the same.
    let boot = fs.boot_id().await;
    let marker = doubt_record::writeback_failed_path(root);
    let writeback_failed = fs.open(&marker, false).await?.is_some();
    let cause = if boot.is_some() && boot == stored.boot && !writeback_failed {
        doubt_record::Cause::Crash
    } else {
        doubt_record::Cause::Reboot
    };
    let mut doubt = stored.doubt;
    let earlier = doubt_record::count(&doubt);
    let named = recomputed.len();
    for (pg, object) in recomputed {
        doubt_record::add(&mut doubt, pg, object, cause);
    }
    if earlier > 0 {
        tracing::info!(
            objects = earlier,
            "earlier restarts left objects in doubt that no primary settled: still in doubt"
        );
    }
    if named > 0 {
        tracing::info!(
            objects = named,
            ?cause,
            "the intent journals name objects written since their last flush"
        );
    }
    // No doubt now means none before either (it only grows here), and a record
    // of this boot says what the next start needs: nothing to write.
    let record = if doubt.is_empty() && (boot.is_none() || boot == stored.boot) {
        doubt_record::DoubtRecord::new(root, boot, doubt, stored.generation, stored.next_file)
    } else {
        let generation = stored.generation + 1;
        match doubt_record::write(fs, root, stored.next_file, generation, boot, &doubt).await {
            Ok(()) => {
                doubt_record::DoubtRecord::new(root, boot, doubt, generation, 1 - stored.next_file)
            }
            // Written into the room reserved for it, so a full disk refuses it
            // only past that room. Serving without it is not safe: the
            // journals are reset next, and a second restart before the record
            // was written would forget this doubt and come back sure of blocks
            // a write old (simulator seed 200214).
            Err(e) if doubt_record::is_full(&e) => {
                return Err(io::Error::new(
                    io::ErrorKind::StorageFull,
                    format!(
                        "cannot write the restart-doubt record ({} objects in doubt): the \
                         file system of {} is full beyond the room reserved for it; free \
                         space there and start again (docs/on-disk-format.md, \"The \
                         restart-doubt record\")",
                        doubt_record::count(&doubt),
                        root.display()
                    ),
                ));
            }
            Err(e) => return Err(e),
        }
    };
    for name in &journals {
        journal::reset_file(fs, &jdir.join(name)).await?;
    }
    // The journals' doubt is on disk as a reboot's: the marker has done its
    // work.
    debug_assert!(!record.stale(), "start-up returns only a written record");
    if writeback_failed {
        fs.unlink(&marker, false).await?;
    }
    Ok(record)
}

#[cfg(test)]
mod decode_props;
#[cfg(test)]
mod tests;
