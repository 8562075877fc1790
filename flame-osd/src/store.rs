//! The object store of one shard: object files under the data directory, read and
//! written through the shard's io_uring.
//!
//! On-disk layout (see docs/on-disk-format.md): `objects/<volume id, 16 hex
//! digits>/<object index, 16 hex digits>`, one sparse file per object, at most
//! `object_size` bytes. A byte never written reads as zero (a missing file, a hole,
//! or past the end of the file). Zeroing and discarding punch holes.
//!
//! A placement group belongs to exactly one shard, so an object file is only ever
//! touched by one thread: the open-file cache and the dirty set need no lock.

use crate::config::DirectIo;
use flame_common::buffer::{PayloadBuf, PayloadBufMut};
use flame_common::ids::{ObjectId, VolumeId};
use flame_common::reactor::{self, AlignedBuf, DIRECT_IO_ALIGN};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// One object's open descriptors.
struct ObjectFile {
    /// Page-cache descriptor: unaligned I/O, and everything when `O_DIRECT` is off.
    buffered: File,
    /// `O_DIRECT` descriptor for block-aligned I/O, when the file system allows it.
    direct: Option<File>,
}

/// Objects of one shard.
pub struct ObjectStore {
    root: PathBuf,
    direct_io: bool,
    open_max: usize,
    files: RefCell<HashMap<ObjectId, Rc<ObjectFile>>>,
    /// Objects written and not yet known stable, with the generation of their last
    /// write. An entry is removed only after an fdatasync that *started after* that
    /// write succeeded, so a flush racing another flush never returns before the
    /// data it covers is stable.
    dirty: RefCell<HashMap<ObjectId, u64>>,
    /// Directories that gained entries and are not yet known stable (same rule), so
    /// a new object's name is as durable as its data.
    dirty_dirs: RefCell<HashMap<PathBuf, u64>>,
    /// Generation counter for the two maps above.
    generation: Cell<u64>,
    /// Volume directories known to exist.
    known_dirs: RefCell<HashSet<VolumeId>>,
    /// Objects known not to exist (reads of never-written data are common and
    /// would otherwise cost a failing `open` each). Exact, because only this shard
    /// creates or removes its objects; cleared when it grows past its bound.
    absent: RefCell<HashSet<ObjectId>>,
}

/// Decides `O_DIRECT` for a data directory: probes by creating an aligned file.
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

/// Exit status of an OSD that stopped because its storage failed.
const EXIT_STORAGE_FAILED: i32 = 74;

/// Removes `key` from a dirty map if no write re-dirtied it since `generation`.
fn clear_if_unchanged<K: std::hash::Hash + Eq>(
    map: &RefCell<HashMap<K, u64>>,
    key: &K,
    generation: u64,
) {
    let mut m = map.borrow_mut();
    if m.get(key) == Some(&generation) {
        m.remove(key);
    }
}

/// Stops the process after a failed sync (see [`ObjectStore::flush`]).
fn fail_stop(what: &str, e: &io::Error) -> ! {
    tracing::error!(
        "{what} failed: {e}; stopping this OSD so no write is acknowledged as stable when it is not"
    );
    eprintln!("flame-osd: {what} failed: {e}; stopping");
    std::process::exit(EXIT_STORAGE_FAILED)
}

fn is_aligned(offset: u64, len: usize) -> bool {
    offset.is_multiple_of(DIRECT_IO_ALIGN as u64) && len.is_multiple_of(DIRECT_IO_ALIGN) && len > 0
}

impl ObjectStore {
    /// A store rooted at `data_dir/objects`.
    pub fn new(data_dir: &Path, direct_io: bool, open_max: usize) -> ObjectStore {
        ObjectStore {
            root: data_dir.join("objects"),
            direct_io,
            open_max: open_max.max(16),
            files: RefCell::new(HashMap::new()),
            dirty: RefCell::new(HashMap::new()),
            dirty_dirs: RefCell::new(HashMap::new()),
            generation: Cell::new(0),
            known_dirs: RefCell::new(HashSet::new()),
            absent: RefCell::new(HashSet::new()),
        }
    }

    fn volume_dir(&self, volume: VolumeId) -> PathBuf {
        self.root.join(format!("{:016x}", volume.0))
    }

    /// Path of an object's file.
    pub fn object_path(&self, object: ObjectId) -> PathBuf {
        self.volume_dir(object.volume)
            .join(format!("{:016x}", object.index))
    }

    /// Opens (or with `create`, creates) an object's file. `Ok(None)`: it does not
    /// exist and `create` is false — the object reads as zeroes.
    fn open(&self, object: ObjectId, create: bool) -> io::Result<Option<Rc<ObjectFile>>> {
        if let Some(f) = self.files.borrow().get(&object) {
            return Ok(Some(f.clone()));
        }
        if !create && self.absent.borrow().contains(&object) {
            return Ok(None);
        }
        let path = self.object_path(object);
        if create && !self.known_dirs.borrow().contains(&object.volume) {
            let dir = self.volume_dir(object.volume);
            if !dir.exists() {
                std::fs::create_dir_all(&dir)?;
                self.mark_dir_dirty(self.root.clone());
            }
            self.known_dirs.borrow_mut().insert(object.volume);
        }
        let existed = path.exists();
        let buffered = match OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .open(&path)
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound && !create => {
                let mut absent = self.absent.borrow_mut();
                if absent.len() >= ABSENT_CACHE_MAX {
                    absent.clear();
                }
                absent.insert(object);
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        self.absent.borrow_mut().remove(&object);
        if !existed {
            self.mark_dir_dirty(self.volume_dir(object.volume));
        }
        let direct = if self.direct_io {
            Some(
                OpenOptions::new()
                    .read(true)
                    .write(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(&path)?,
            )
        } else {
            None
        };
        let file = Rc::new(ObjectFile { buffered, direct });
        let mut files = self.files.borrow_mut();
        if files.len() >= self.open_max {
            // Evict an arbitrary entry; a dirty object is reopened by the next flush.
            if let Some(k) = files.keys().next().copied() {
                files.remove(&k);
            }
        }
        files.insert(object, file.clone());
        Ok(Some(file))
    }

    /// Reads `len` bytes at `offset`; never-written bytes are zero. The bytes land
    /// from the disk in the returned (aligned) buffer — with `O_DIRECT` when the
    /// range is block-aligned — which is then sent to the socket as it is.
    pub async fn read(&self, object: ObjectId, offset: u32, len: u32) -> io::Result<PayloadBuf> {
        let len = len as usize;
        let Some(file) = self.open(object, false)? else {
            return Ok(PayloadBuf::zeroed(len));
        };
        let offset = u64::from(offset);
        let fd = match (&file.direct, is_aligned(offset, len)) {
            (Some(direct), true) => direct.as_raw_fd(),
            _ => file.buffered.as_raw_fd(),
        };
        let (filled, buf) = read_full(fd, PayloadBufMut::zeroed(len), offset, len).await;
        filled?;
        Ok(buf.freeze())
    }

    /// Writes `data` at `offset`. With `fua` the data is on stable storage when this
    /// returns. A block-aligned write goes to the disk with `O_DIRECT` from `data`'s
    /// own memory (the buffer it was received into, shared with the replicas'
    /// send queues); anything else through the page cache, also without a copy.
    pub async fn write(
        &self,
        object: ObjectId,
        offset: u32,
        data: PayloadBuf,
        fua: bool,
    ) -> io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let file = self
            .open(object, true)?
            .ok_or_else(|| io::Error::other("object file vanished while creating it"))?;
        let offset = u64::from(offset);
        let direct = file
            .direct
            .as_ref()
            .filter(|_| is_aligned(offset, data.len()) && data.is_direct_io_aligned());
        let fd = match direct {
            Some(d) => d.as_raw_fd(),
            None => file.buffered.as_raw_fd(),
        };
        write_full(fd, data, offset, fua).await?;
        if fua {
            // The data is stable; only a newly created name may still need its dir.
            self.sync_dirs().await?;
        } else {
            self.mark_dirty(object);
        }
        Ok(())
    }

    fn next_generation(&self) -> u64 {
        let g = self.generation.get() + 1;
        self.generation.set(g);
        g
    }

    fn mark_dirty(&self, object: ObjectId) {
        let g = self.next_generation();
        self.dirty.borrow_mut().insert(object, g);
    }

    fn mark_dir_dirty(&self, dir: PathBuf) {
        let g = self.next_generation();
        self.dirty_dirs.borrow_mut().insert(dir, g);
    }

    /// Makes `[offset, offset+len)` read back as zeroes by punching a hole.
    pub async fn zero(&self, object: ObjectId, offset: u32, len: u32, fua: bool) -> io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let Some(file) = self.open(object, false)? else {
            return Ok(()); // no file: already zero
        };
        let fd = file.buffered.as_raw_fd();
        let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
        match reactor::fallocate(fd, mode, u64::from(offset), u64::from(len)).await {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                // File system without hole punching: write real zeroes.
                write_full(fd, vec![0u8; len as usize], u64::from(offset), false).await?;
            }
            Err(e) => return Err(e),
        }
        if fua {
            reactor::fsync(fd, true).await?;
        } else {
            self.mark_dirty(object);
        }
        Ok(())
    }

    /// Makes every write applied so far stable: fdatasync of every dirty object
    /// (up to [`FLUSH_PARALLEL_MAX`] at once through the ring) and fsync of
    /// directories that gained entries.
    ///
    /// A failed fdatasync is fatal to the process: Linux reports a writeback error
    /// once and then marks the pages clean, so a retry would "succeed" without the
    /// data. Stopping makes the manager mark this OSD down; clients wait for it.
    pub async fn flush(&self) -> io::Result<()> {
        let snapshot: Vec<(ObjectId, u64)> =
            self.dirty.borrow().iter().map(|(o, g)| (*o, *g)).collect();
        for chunk in snapshot.chunks(FLUSH_PARALLEL_MAX) {
            let mut syncs = Vec::with_capacity(chunk.len());
            for &(object, generation) in chunk {
                match self.open(object, false)? {
                    Some(file) => syncs.push((
                        object,
                        generation,
                        reactor::spawn(async move {
                            reactor::fsync(file.buffered.as_raw_fd(), true).await
                        }),
                    )),
                    // Deleted since: nothing left to make stable.
                    None => clear_if_unchanged(&self.dirty, &object, generation),
                }
            }
            for (object, generation, sync) in syncs {
                if let Err(e) = sync.await {
                    fail_stop(&format!("fdatasync of object {object}"), &e);
                }
                clear_if_unchanged(&self.dirty, &object, generation);
            }
        }
        self.sync_dirs().await
    }

    async fn sync_dirs(&self) -> io::Result<()> {
        let dirs: Vec<(PathBuf, u64)> = self
            .dirty_dirs
            .borrow()
            .iter()
            .map(|(d, g)| (d.clone(), *g))
            .collect();
        for (dir, generation) in dirs {
            let f = match File::open(&dir) {
                Ok(f) => f,
                // Removed with its volume: nothing to make durable.
                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                    clear_if_unchanged(&self.dirty_dirs, &dir, generation);
                    continue;
                }
                Err(e) => return Err(e),
            };
            if let Err(e) = reactor::fsync(f.as_raw_fd(), false).await {
                fail_stop(&format!("fsync of directory {}", dir.display()), &e);
            }
            clear_if_unchanged(&self.dirty_dirs, &dir, generation);
        }
        Ok(())
    }

    /// Removes the volume's objects for which `owned` is true (the objects of this
    /// shard's placement groups). Returns how many were removed. Yields to the
    /// shard's other tasks every [`DELETE_BATCH`] files, so removing a large volume
    /// does not stall every connection of the shard.
    pub async fn delete_volume(
        &self,
        volume: VolumeId,
        owned: impl Fn(ObjectId) -> bool,
    ) -> io::Result<u64> {
        let dir = self.volume_dir(volume);
        let entries = match std::fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(e),
        };
        let mut removed = 0;
        for entry in entries {
            let entry = entry?;
            let name = entry.file_name();
            let Some(index) = name.to_str().and_then(|s| u64::from_str_radix(s, 16).ok()) else {
                continue; // not an object file
            };
            let object = ObjectId { volume, index };
            if !owned(object) {
                continue;
            }
            self.files.borrow_mut().remove(&object);
            self.dirty.borrow_mut().remove(&object);
            match std::fs::remove_file(entry.path()) {
                Ok(()) => removed += 1,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
            self.absent.borrow_mut().insert(object);
            if removed % DELETE_BATCH == 0 {
                reactor::yield_now().await;
            }
        }
        self.known_dirs.borrow_mut().remove(&volume);
        // The last shard to finish removes the (then empty) directory.
        let _ = std::fs::remove_dir(&dir);
        Ok(removed)
    }
}

/// Reads until `len` bytes or end of file; the rest of `buf` keeps its zeroes.
async fn read_full<B: reactor::IoBufMut>(
    fd: i32,
    mut buf: B,
    offset: u64,
    len: usize,
) -> (io::Result<()>, B) {
    let mut done = 0usize;
    // Bounded: each round either advances or ends the loop.
    while done < len {
        let (res, back) = read_at_partial(fd, buf, offset + done as u64, done).await;
        buf = back;
        match res {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return (Err(e), buf),
        }
    }
    (Ok(()), buf)
}

/// Reads into `buf[start..]` (via a sub-range view of the buffer).
async fn read_at_partial<B: reactor::IoBufMut>(
    fd: i32,
    buf: B,
    offset: u64,
    start: usize,
) -> (io::Result<usize>, B) {
    if start == 0 {
        return reactor::read_at(fd, buf, offset).await;
    }
    let (res, sliced) = reactor::read_at(fd, Tail { buf, start }, offset).await;
    (res, sliced.buf)
}

async fn write_full<B: reactor::IoBuf>(
    fd: i32,
    buf: B,
    offset: u64,
    dsync: bool,
) -> io::Result<()> {
    let len = buf.len();
    let (res, mut buf) = reactor::write_at(fd, buf, offset, dsync).await;
    let mut done = res?;
    // Short writes on regular files are rare (signals, quota); finish them.
    while done < len {
        let (res, back) = reactor::write_at(
            fd,
            TailRef { buf, start: done },
            offset + done as u64,
            dsync,
        )
        .await;
        buf = back.buf;
        match res {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "device accepted no bytes",
                ));
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The tail `buf[start..]` of a buffer, as a buffer.
struct Tail<B> {
    buf: B,
    start: usize,
}

// SAFETY: a view into a buffer that itself satisfies IoBuf.
unsafe impl<B: reactor::IoBufMut> reactor::IoBuf for Tail<B> {
    fn as_ptr(&self) -> *const u8 {
        self.buf.as_ptr().wrapping_add(self.start)
    }
    fn len(&self) -> usize {
        self.buf.len() - self.start
    }
}

// SAFETY: as above.
unsafe impl<B: reactor::IoBufMut> reactor::IoBufMut for Tail<B> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.buf.as_mut_ptr().wrapping_add(self.start)
    }
}

/// Read-only tail view, for resuming short writes.
struct TailRef<B> {
    buf: B,
    start: usize,
}

// SAFETY: as above.
unsafe impl<B: reactor::IoBuf> reactor::IoBuf for TailRef<B> {
    fn as_ptr(&self) -> *const u8 {
        self.buf.as_ptr().wrapping_add(self.start)
    }
    fn len(&self) -> usize {
        self.buf.len() - self.start
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::reactor::{Reactor, ReactorConfig};

    fn obj(i: u64) -> ObjectId {
        ObjectId {
            volume: VolumeId(5),
            index: i,
        }
    }

    fn with_store(direct: bool, f: impl AsyncFnOnce(&ObjectStore, &Path) + 'static) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async move {
            let store = ObjectStore::new(&path, direct, 16);
            f(&store, &path).await;
        })
        .unwrap();
    }

    #[test]
    fn unwritten_reads_zero_and_writes_read_back() {
        for direct in [false, true] {
            with_store(direct, async |s, _| {
                assert_eq!(s.read(obj(1), 0, 8192).await.unwrap(), vec![0; 8192]);
                s.write(obj(1), 4096, PayloadBuf::copy_from(&[7; 4096]), false)
                    .await
                    .unwrap();
                s.write(obj(1), 10, PayloadBuf::copy_from(b"abc"), true)
                    .await
                    .unwrap();
                let back = s.read(obj(1), 0, 12288).await.unwrap();
                assert_eq!(&back[10..13], b"abc");
                assert!(back[4096..8192].iter().all(|&b| b == 7));
                assert!(back[8192..].iter().all(|&b| b == 0));
                s.flush().await.unwrap();
            });
        }
    }

    /// A block-aligned write whose memory is not aligned (a slice of a larger
    /// payload) cannot go through O_DIRECT (the kernel refuses it with EINVAL): it
    /// takes the buffered path, and a read lands in an aligned buffer either way.
    #[test]
    fn unaligned_memory_falls_back_to_the_page_cache() {
        with_store(true, async |s, _| {
            let big: Vec<u8> = (0..8193u32).map(|i| (i % 251) as u8).collect();
            let whole = PayloadBuf::copy_from(&big);
            let part = whole.slice(1..4097);
            assert!(!part.is_direct_io_aligned());
            s.write(obj(1), 4096, part, false).await.unwrap();
            let aligned = whole.slice(4096..8192);
            assert!(aligned.is_direct_io_aligned());
            s.write(obj(1), 8192, aligned, true).await.unwrap();
            let back = s.read(obj(1), 4096, 8192).await.unwrap();
            assert!(back.is_direct_io_aligned());
            assert_eq!(&back[..4096], &big[1..4097]);
            assert_eq!(&back[4096..], &big[4096..8192]);
        });
    }

    #[test]
    fn zero_punches_and_delete_removes_owned() {
        with_store(false, async |s, root| {
            s.write(obj(1), 0, PayloadBuf::copy_from(&[9; 65536]), false)
                .await
                .unwrap();
            s.write(obj(2), 0, PayloadBuf::copy_from(&[9; 10]), false)
                .await
                .unwrap();
            s.zero(obj(1), 4096, 8192, false).await.unwrap();
            let back = s.read(obj(1), 0, 65536).await.unwrap();
            assert!(back[..4096].iter().all(|&b| b == 9));
            assert!(back[4096..12288].iter().all(|&b| b == 0));
            assert!(back[12288..].iter().all(|&b| b == 9));
            s.zero(obj(3), 0, 4096, true).await.unwrap(); // missing object: no-op
            s.flush().await.unwrap();
            let n = s
                .delete_volume(VolumeId(5), |o| o.index == 1)
                .await
                .unwrap();
            assert_eq!(n, 1);
            assert!(
                !root
                    .join("objects/0000000000000005/0000000000000001")
                    .exists()
            );
            assert!(
                root.join("objects/0000000000000005/0000000000000002")
                    .exists()
            );
            assert_eq!(s.read(obj(1), 0, 16).await.unwrap(), vec![0; 16]);
        });
    }

    #[test]
    fn absent_cache_never_hides_a_written_object() {
        with_store(false, async |s, _| {
            assert_eq!(s.read(obj(7), 0, 8).await.unwrap(), vec![0; 8]);
            assert!(s.absent.borrow().contains(&obj(7)));
            s.zero(obj(7), 0, 8, false).await.unwrap(); // still absent: no file made
            s.write(obj(7), 0, PayloadBuf::copy_from(&[5; 8]), false)
                .await
                .unwrap();
            assert!(!s.absent.borrow().contains(&obj(7)));
            // Evict it from the open-file cache, then read through a fresh open.
            s.files.borrow_mut().clear();
            assert_eq!(s.read(obj(7), 0, 8).await.unwrap(), vec![5; 8]);
            s.delete_volume(VolumeId(5), |_| true).await.unwrap();
            assert_eq!(s.read(obj(7), 0, 8).await.unwrap(), vec![0; 8]);
            s.write(obj(7), 0, PayloadBuf::copy_from(&[6; 8]), false)
                .await
                .unwrap();
            assert_eq!(s.read(obj(7), 0, 8).await.unwrap(), vec![6; 8]);
        });
    }

    #[test]
    fn dirty_entries_stay_until_their_sync_completes() {
        // A flush in progress must not hide the data from a concurrent flush: the
        // second flush has to wait for (or issue) its own sync, not return early.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async move {
            let s = Rc::new(ObjectStore::new(&path, false, 16));
            s.write(obj(1), 0, PayloadBuf::copy_from(&[1; 4096]), false)
                .await
                .unwrap();
            let s1 = s.clone();
            let first = reactor::spawn(async move { s1.flush().await });
            reactor::yield_now().await; // the first flush has its sync in flight
            assert!(
                s.dirty.borrow().contains_key(&obj(1)),
                "dirty entry dropped before its sync finished"
            );
            // A write during the flush re-dirties the object: the first flush must not
            // clear the newer generation.
            s.write(obj(1), 0, PayloadBuf::copy_from(&[2; 4096]), false)
                .await
                .unwrap();
            first.await.unwrap();
            assert!(
                s.dirty.borrow().contains_key(&obj(1)),
                "newer write lost its dirty mark"
            );
            s.flush().await.unwrap();
            assert!(s.dirty.borrow().is_empty());
            assert!(s.dirty_dirs.borrow().is_empty());
        })
        .unwrap();
    }

    /// Unmounts a test mount, even when the test panics.
    struct Mount(PathBuf);
    impl Drop for Mount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }

    #[test]
    fn direct_io_probe_falls_back_where_unsupported() {
        // ramfs has no O_DIRECT (tmpfs gained it in Linux 6.6, so it no longer
        // serves). Mounting needs root, which the test command runs as.
        let dir = tempfile::tempdir().unwrap();
        let mnt = dir.path().join("ramfs");
        std::fs::create_dir(&mnt).unwrap();
        let ok = std::process::Command::new("mount")
            .args(["-t", "ramfs", "ramfs"])
            .arg(&mnt)
            .status()
            .unwrap();
        assert!(
            ok.success(),
            "mount -t ramfs failed: this test needs root (scripts/test.sh runs as root)"
        );
        let _mount = Mount(mnt.clone());
        assert!(!probe_direct_io(&mnt, DirectIo::Auto).unwrap());
        let err = probe_direct_io(&mnt, DirectIo::On).unwrap_err();
        assert!(err.to_string().contains("O_DIRECT"), "{err}");
        assert!(!probe_direct_io(&mnt, DirectIo::Off).unwrap());
        // On a file system with O_DIRECT, auto uses it.
        assert!(
            probe_direct_io(dir.path(), DirectIo::Auto).unwrap() || cfg!(not(target_os = "linux"))
        );
        // The store works without it.
        let path = mnt.clone();
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async move {
            let s = ObjectStore::new(&path, false, 16);
            s.write(obj(1), 4096, PayloadBuf::copy_from(&[1; 4096]), true)
                .await
                .unwrap();
            s.zero(obj(1), 4096, 100, false).await.unwrap();
            let back = s.read(obj(1), 4096, 4096).await.unwrap();
            assert!(back[..100].iter().all(|&b| b == 0));
            assert!(back[100..].iter().all(|&b| b == 1));
            s.flush().await.unwrap();
        })
        .unwrap();
    }

    #[test]
    fn open_file_cache_is_bounded() {
        with_store(false, async |s, _| {
            for i in 0..100 {
                s.write(obj(i), 0, PayloadBuf::copy_from(&[i as u8; 16]), false)
                    .await
                    .unwrap();
            }
            assert!(s.files.borrow().len() <= 16);
            s.flush().await.unwrap(); // reopens evicted dirty objects
            for i in 0..100 {
                assert_eq!(s.read(obj(i), 0, 16).await.unwrap(), vec![i as u8; 16]);
            }
        });
    }
}
