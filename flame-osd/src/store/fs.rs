//! The durability layer: every byte the store puts on disk goes through here.
//!
//! [`Fs::Real`] is the data directory, reached through the shard's io_uring (no
//! blocking system call on a shard thread: opens, `mkdir`s and `unlink`s are ring
//! operations, and the one call io_uring lacks, `getdents`, runs on a helper thread).
//!
//! [`Fs::Sim`] is an in-memory disk for tests that keeps what was written but not yet
//! made stable (by `fdatasync`, an `RWF_DSYNC` write, or — for a new file's name — an
//! `fsync` of its directory) aside, and at a simulated power cut keeps a random
//! subset of those pages and drops the rest. That is what a real disk with a volatile
//! cache may do; it lets a test show that everything a completed FLUSH covered
//! survives and that every block verifies after recovery.

use flame_common::buffer::{PayloadBuf, PayloadBufMut};
use flame_common::collections::HashMap;
use flame_common::reactor::{self, AlignedBuf, DIRECT_IO_ALIGN, IoBuf};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// Page size of the simulated disk: the unit a power cut keeps or drops whole.
const SIM_PAGE: usize = 4096;

/// The simulated pages `[offset, offset+len)` touches (none for `len` 0).
fn sim_pages(offset: u64, len: u64) -> std::ops::Range<u64> {
    if len == 0 {
        return 0..0;
    }
    offset / SIM_PAGE as u64..(offset + len - 1) / SIM_PAGE as u64 + 1
}

/// Where the store's files live.
#[derive(Clone)]
pub enum Fs {
    /// The real file system, through io_uring.
    Real {
        /// Whether block-aligned I/O uses a second, `O_DIRECT` descriptor.
        direct_io: bool,
    },
    /// The power-loss simulation (tests).
    Sim(Rc<SimFs>),
}

/// An open file of [`Fs`].
pub enum File {
    /// A real file.
    Real {
        /// Page-cache descriptor: unaligned I/O, syncs, hole punching.
        buffered: OwnedFd,
        /// `O_DIRECT` descriptor for block-aligned I/O, when enabled.
        direct: Option<OwnedFd>,
    },
    /// A simulated file.
    Sim(Rc<SimFs>, Rc<SimFile>),
}

/// Which boot of the machine a process runs in: the kernel's boot id, new at
/// every boot (a power cut's too) and the same for every process of one boot.
/// Two processes of one boot share the page cache: what one wrote, the next
/// reads, and a crash of the first loses none of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BootId(pub [u8; 16]);

impl BootId {
    /// Parses `/proc/sys/kernel/random/boot_id` (a UUID, 32 hex digits and
    /// dashes); `None` for anything else, or the all-zero id.
    pub fn parse(text: &str) -> Option<BootId> {
        let hex: Vec<u8> = text.trim().bytes().filter(|&b| b != b'-').collect();
        if hex.len() != 32 {
            return None;
        }
        let mut id = [0u8; 16];
        for (i, pair) in hex.chunks_exact(2).enumerate() {
            let digits = std::str::from_utf8(pair).ok()?;
            id[i] = u8::from_str_radix(digits, 16).ok()?;
        }
        (id != [0; 16]).then_some(BootId(id))
    }
}

fn is_aligned(offset: u64, len: usize) -> bool {
    offset.is_multiple_of(DIRECT_IO_ALIGN as u64) && len.is_multiple_of(DIRECT_IO_ALIGN) && len > 0
}

impl Fs {
    /// Whether a failed sync is reported as an error (simulation) instead of
    /// stopping the process (real disk; see `ObjectStore::flush`).
    pub fn is_sim(&self) -> bool {
        matches!(self, Fs::Sim(_))
    }

    /// On the simulated disk, the store stops the process (see
    /// [`SimFs::fail_stop`]); the real daemon exits instead.
    pub fn fail_stop(&self) {
        if let Fs::Sim(sim) = self {
            sim.fail_stop();
        }
    }

    /// The boot this process runs in: `/proc/sys/kernel/random/boot_id`, or
    /// the simulated disk's boot counter (a power cut starts a new boot, a
    /// process kill does not). `None` when it cannot be read (no procfs): the
    /// caller then cannot tell a crash from a reboot.
    pub async fn boot_id(&self) -> Option<BootId> {
        match self {
            Fs::Real { .. } => {
                let read = blocking(|| std::fs::read_to_string("/proc/sys/kernel/random/boot_id"))
                    .await
                    .and_then(|r| r);
                match read {
                    Ok(text) => BootId::parse(&text),
                    Err(e) => {
                        tracing::warn!("cannot read the kernel's boot id: {e}");
                        None
                    }
                }
            }
            Fs::Sim(sim) => {
                let mut id = [0u8; 16];
                id[..8].copy_from_slice(&sim.boot.get().to_le_bytes());
                id[8] = 0xb0;
                Some(BootId(id))
            }
        }
    }

    /// Opens `path` read-write; with `create`, creates it if missing. `Ok(None)`:
    /// missing and `create` is false. The flag says whether this call created it.
    pub async fn open(&self, path: &Path, create: bool) -> io::Result<Option<(File, bool)>> {
        match self {
            Fs::Real { direct_io } => {
                let mut created = false;
                let buffered = match reactor::open(path, libc::O_RDWR, 0o644).await {
                    Ok(fd) => fd,
                    Err(e) if e.kind() == io::ErrorKind::NotFound && !create => return Ok(None),
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        // O_EXCL tells us whether we made the name (and so must make
                        // its directory entry stable); a racing creator cannot exist
                        // (one shard owns the object) but is handled anyway.
                        match reactor::open(
                            path,
                            libc::O_RDWR | libc::O_CREAT | libc::O_EXCL,
                            0o644,
                        )
                        .await
                        {
                            Ok(fd) => {
                                created = true;
                                fd
                            }
                            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                                reactor::open(path, libc::O_RDWR, 0o644).await?
                            }
                            Err(e) => return Err(e),
                        }
                    }
                    Err(e) => return Err(e),
                };
                let direct = if *direct_io {
                    Some(reactor::open(path, libc::O_RDWR | libc::O_DIRECT, 0).await?)
                } else {
                    None
                };
                Ok(Some((File::Real { buffered, direct }, created)))
            }
            Fs::Sim(sim) => {
                sim.tick()?;
                let mut files = sim.files.borrow_mut();
                if let Some(f) = files.get(path) {
                    return Ok(Some((File::Sim(sim.clone(), f.clone()), false)));
                }
                if !create {
                    return Ok(None);
                }
                let parent = path.parent().map(Path::to_path_buf).unwrap_or_default();
                if !sim.dirs.borrow().contains(&parent) {
                    return Err(io::Error::from(io::ErrorKind::NotFound));
                }
                let f = Rc::new(SimFile::new(parent));
                if sim
                    .traced_name
                    .borrow()
                    .as_deref()
                    .is_some_and(|n| path.file_name().is_some_and(|f| f.to_string_lossy() == n))
                {
                    *f.traced.borrow_mut() = Some(path.to_path_buf());
                    f.trace(|| "created".into());
                }
                files.insert(path.to_path_buf(), f.clone());
                Ok(Some((File::Sim(sim.clone(), f), true)))
            }
        }
    }

    /// Creates a directory; `Ok(false)` if it already existed.
    pub async fn mkdir(&self, path: &Path) -> io::Result<bool> {
        match self {
            Fs::Real { .. } => match reactor::mkdir(path, 0o755).await {
                Ok(()) => Ok(true),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
                Err(e) => Err(e),
            },
            Fs::Sim(sim) => {
                sim.tick()?;
                Ok(sim.dirs.borrow_mut().insert(path.to_path_buf()))
            }
        }
    }

    /// Makes a directory's entries stable (`fsync` of the directory).
    pub async fn sync_dir(&self, path: &Path) -> io::Result<()> {
        crate::failpoints::check("store_sync")?;
        match self {
            Fs::Real { .. } => {
                let fd = match reactor::open(path, libc::O_RDONLY | libc::O_DIRECTORY, 0).await {
                    Ok(fd) => fd,
                    // Removed with its contents: nothing left to make durable.
                    Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
                    Err(e) => return Err(e),
                };
                crate::metrics::sync_done(crate::metrics::SyncKind::Dir);
                reactor::fsync(fd.as_raw_fd(), false).await
            }
            Fs::Sim(sim) => {
                sim.tick()?;
                sim.sync_error()?;
                for f in sim.files.borrow().values() {
                    if f.parent == path {
                        f.name_stable.set(true);
                    }
                }
                Ok(())
            }
        }
    }

    /// Removes a file (or an empty directory with `dir`); `Ok(false)` if missing.
    pub async fn unlink(&self, path: &Path, dir: bool) -> io::Result<bool> {
        match self {
            Fs::Real { .. } => match reactor::unlink(path, dir).await {
                Ok(()) => Ok(true),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
                Err(e) => Err(e),
            },
            Fs::Sim(sim) => {
                sim.tick()?;
                if dir {
                    return Ok(sim.dirs.borrow_mut().remove(path));
                }
                let removed = sim.files.borrow_mut().remove(path);
                if let Some(f) = &removed {
                    f.trace(|| "unlinked".into());
                }
                Ok(removed.is_some())
            }
        }
    }

    /// Names in a directory (empty if it does not exist). On the real file system
    /// this runs on a helper thread: io_uring has no `getdents`, and a large
    /// directory read from disk would stall every connection of the shard.
    pub async fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        match self {
            Fs::Real { .. } => {
                let path = path.to_path_buf();
                blocking(move || list_dir_blocking(&path)).await?
            }
            Fs::Sim(sim) => {
                sim.tick()?;
                let mut names = BTreeSet::new();
                for p in sim.files.borrow().keys().chain(sim.dirs.borrow().iter()) {
                    if p.parent() == Some(path)
                        && let Some(n) = p.file_name().and_then(|n| n.to_str())
                    {
                        names.insert(n.to_string());
                    }
                }
                Ok(names.into_iter().collect())
            }
        }
    }
}

impl Fs {
    /// Names in each of several directories (empty for a missing one), listed in
    /// one helper-thread call on the real file system.
    pub async fn list_dirs(&self, paths: Vec<PathBuf>) -> io::Result<Vec<Vec<String>>> {
        match self {
            Fs::Real { .. } => {
                blocking(move || {
                    paths
                        .iter()
                        .map(|p| list_dir_blocking(p))
                        .collect::<io::Result<Vec<_>>>()
                })
                .await?
            }
            Fs::Sim(_) => {
                let mut out = Vec::with_capacity(paths.len());
                for p in &paths {
                    out.push(self.list_dir(p).await?);
                }
                Ok(out)
            }
        }
    }
}

/// Names in a directory, with the blocking standard library (start-up and helper
/// threads only).
pub fn list_dir_blocking(path: &Path) -> io::Result<Vec<String>> {
    let entries = match std::fs::read_dir(path) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut names = Vec::new();
    for entry in entries {
        if let Some(n) = entry?.file_name().to_str() {
            names.push(n.to_string());
        }
    }
    Ok(names)
}

/// Runs `job` on a new helper thread and waits for it without blocking the reactor:
/// the helper signals an eventfd that the ring reads. For rare control work only
/// (deleting a volume), so a thread per call is fine.
async fn blocking<T: Send + 'static>(job: impl FnOnce() -> T + Send + 'static) -> io::Result<T> {
    // SAFETY: plain eventfd creation; the result is checked.
    let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    let efd = unsafe { OwnedFd::from_raw_fd(raw) };
    let signal = efd.try_clone()?;
    let slot = std::sync::Arc::new(std::sync::Mutex::new(None));
    let out = slot.clone();
    std::thread::Builder::new()
        .name("store-helper".into())
        .spawn(move || {
            let value = job();
            if let Ok(mut s) = out.lock() {
                *s = Some(value);
            }
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes from a live array to an eventfd we own.
            unsafe { libc::write(signal.as_raw_fd(), one.as_ptr().cast(), one.len()) };
        })?;
    let (res, _) = reactor::read_at(efd.as_raw_fd(), vec![0u8; 8], 0).await;
    res?;
    let value = slot
        .lock()
        .map_err(|_| io::Error::other("helper thread panicked"))?
        .take();
    value.ok_or_else(|| io::Error::other("helper thread ended without a result"))
}

impl File {
    /// The store found data blocks `blocks` of this file not matching their
    /// checksums: noted for the simulator's check ([`SimFs::take_checksum_mismatches`]);
    /// nothing for a real file.
    pub fn note_checksum_mismatch(&self, blocks: &[u32]) {
        if let File::Sim(sim, f) = self
            && !blocks.is_empty()
        {
            sim.note_checksum_mismatch(f, blocks);
        }
    }

    /// Reads `len` bytes at `offset`; bytes past the end of the file read as zero.
    pub async fn read(&self, offset: u64, len: usize) -> io::Result<Vec<u8>> {
        match self {
            File::Real { buffered, direct } => {
                if let (Some(direct), true) = (direct, is_aligned(offset, len)) {
                    let buf = AlignedBuf::zeroed(len);
                    let (filled, buf) = read_full(direct.as_raw_fd(), buf, offset, len).await;
                    filled?;
                    return Ok(buf.as_slice().to_vec());
                }
                let (filled, buf) =
                    read_full(buffered.as_raw_fd(), vec![0u8; len], offset, len).await;
                filled?;
                Ok(buf)
            }
            File::Sim(sim, f) => {
                sim.delay().await;
                sim.tick()?;
                Ok(f.read(offset, len))
            }
        }
    }

    /// Like [`File::read`], into a payload buffer: the bytes land from the disk in
    /// the (aligned) buffer that is then sent to the socket — with `O_DIRECT` when
    /// the range is block-aligned, through the page cache otherwise; no copy either
    /// way.
    pub async fn read_buf(&self, offset: u64, len: usize) -> io::Result<PayloadBuf> {
        match self {
            File::Real { buffered, direct } => {
                let fd = match (direct, is_aligned(offset, len)) {
                    (Some(direct), true) => direct.as_raw_fd(),
                    _ => buffered.as_raw_fd(),
                };
                // From the shard's pool (waiting for frees when it is exhausted;
                // an `OutOfMemory` error past the wait, answered EAGAIN).
                let buf = PayloadBufMut::zeroed_wait(len).await?;
                let (filled, buf) = read_full(fd, buf, offset, len).await;
                filled?;
                Ok(buf.freeze())
            }
            File::Sim(sim, f) => {
                sim.delay().await;
                sim.tick()?;
                sim.read_error()?;
                Ok(PayloadBuf::copy_from(&f.read(offset, len)))
            }
        }
    }

    /// Writes `data` at `offset`; with `sync` it is stable when this returns
    /// (`RWF_DSYNC`, the FUA of files), counted under that kind of sync.
    ///
    /// A block-aligned write from block-aligned memory (a [`PayloadBuf`] as received
    /// from the socket) goes to the disk with `O_DIRECT` from that memory; other
    /// memory at a block-aligned offset is first copied into an aligned buffer.
    pub async fn write<B: IoBuf + AsRef<[u8]>>(
        &self,
        offset: u64,
        data: B,
        sync: Option<crate::metrics::SyncKind>,
    ) -> io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        let dsync = sync.is_some();
        if let Some(kind) = sync
            && !matches!(self, File::Sim(..))
        {
            crate::metrics::sync_done(kind);
        }
        match self {
            File::Real { buffered, direct } => {
                let memory_aligned = (data.as_ptr() as usize).is_multiple_of(DIRECT_IO_ALIGN);
                if let (Some(direct), true, true) =
                    (direct, is_aligned(offset, data.len()), memory_aligned)
                {
                    write_full(direct.as_raw_fd(), data, offset, dsync).await
                } else if let (Some(direct), true) = (direct, is_aligned(offset, data.len())) {
                    let buf = AlignedBuf::copy_from(data.as_ref());
                    write_full(direct.as_raw_fd(), buf, offset, dsync).await
                } else {
                    write_full(buffered.as_raw_fd(), data, offset, dsync).await
                }
            }
            File::Sim(sim, f) => {
                sim.delay().await;
                sim.tick()?;
                sim.space_for(f, offset, data.len() as u64)?;
                if let Some(landed) = sim.write_error() {
                    f.trace(|| {
                        format!(
                            "write failed (EIO, landed: {landed}): {}",
                            SimFile::describe_write(offset, data.as_ref())
                        )
                    });
                    if landed {
                        f.write(offset, data.as_ref(), false);
                    }
                    return Err(io::Error::from_raw_os_error(libc::EIO));
                }
                f.trace(|| {
                    format!(
                        "write{}: {}",
                        if dsync { " (dsync)" } else { "" },
                        SimFile::describe_write(offset, data.as_ref())
                    )
                });
                f.write(offset, data.as_ref(), dsync);
                Ok(())
            }
        }
    }

    /// Makes `[offset, offset+len)` read as zeroes (punches a hole, or writes zeroes
    /// where the file system cannot).
    pub async fn punch(&self, offset: u64, len: u64) -> io::Result<()> {
        match self {
            File::Real { buffered, .. } => {
                let fd = buffered.as_raw_fd();
                let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
                match reactor::fallocate(fd, mode, offset, len).await {
                    Ok(()) => Ok(()),
                    Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                        let len = usize::try_from(len)
                            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
                        write_full(fd, vec![0u8; len], offset, false).await
                    }
                    Err(e) => Err(e),
                }
            }
            File::Sim(sim, f) => {
                sim.delay().await;
                sim.tick()?;
                let len = usize::try_from(len)
                    .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
                if let Some(landed) = sim.write_error() {
                    f.trace(|| {
                        format!("punch failed (EIO, landed: {landed}): {len} bytes at {offset}")
                    });
                    if landed {
                        f.write(offset, &vec![0u8; len], false);
                    }
                    return Err(io::Error::from_raw_os_error(libc::EIO));
                }
                f.trace(|| format!("punch: {len} bytes at {offset}"));
                f.write(offset, &vec![0u8; len], false);
                Ok(())
            }
        }
    }

    /// Allocates disk space for `[offset, offset+len)` without changing the file's
    /// size (`fallocate` with `FALLOC_FL_KEEP_SIZE`), so later writes there cannot
    /// fail with ENOSPC: the store reserves the space of an object's metadata and of
    /// its intent journal up front, because those writes come when a full disk can
    /// no longer be reported to a client (a FLUSH, a journal entry) and their
    /// failure stops the OSD. A file system without `fallocate` gets nothing
    /// reserved (and no error).
    pub async fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        match self {
            File::Real { buffered, .. } => {
                match reactor::fallocate(
                    buffered.as_raw_fd(),
                    libc::FALLOC_FL_KEEP_SIZE,
                    offset,
                    len,
                )
                .await
                {
                    Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => Ok(()),
                    other => other,
                }
            }
            File::Sim(sim, f) => {
                sim.delay().await;
                sim.tick()?;
                sim.space_for(f, offset, len)?;
                f.reserved.borrow_mut().extend(sim_pages(offset, len));
                Ok(())
            }
        }
    }

    /// `fdatasync`: everything written to this file is stable when this returns.
    pub async fn datasync(&self) -> io::Result<()> {
        crate::failpoints::check("store_sync")?;
        match self {
            File::Real { buffered, .. } => {
                crate::metrics::sync_done(crate::metrics::SyncKind::Fdatasync);
                reactor::fsync(buffered.as_raw_fd(), true).await
            }
            File::Sim(sim, f) => {
                sim.delay().await;
                sim.tick()?;
                if let Err(e) = sim.sync_error() {
                    f.trace(|| "datasync failed (EIO)".into());
                    return Err(e);
                }
                f.trace(|| "datasync".into());
                f.sync();
                Ok(())
            }
        }
    }

    /// Size of the file in bytes.
    pub async fn size(&self) -> io::Result<u64> {
        match self {
            File::Real { buffered, .. } => reactor::file_size(buffered.as_raw_fd()).await,
            File::Sim(sim, f) => {
                sim.delay().await;
                sim.tick()?;
                Ok(f.size())
            }
        }
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
        let (res, back) = if done == 0 {
            reactor::read_at(fd, buf, offset).await
        } else {
            let (res, t) =
                reactor::read_at(fd, Tail { buf, start: done }, offset + done as u64).await;
            (res, t.buf)
        };
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

/// The simulated disk.
#[derive(Default)]
pub struct SimFs {
    /// Ordered, so a listing and a power cut visit files in the same order every
    /// run (the deterministic simulator).
    files: RefCell<BTreeMap<PathBuf, Rc<SimFile>>>,
    /// Directories (always stable: the store creates them before files in them
    /// and never depends on a directory's own name surviving without its fsync).
    dirs: RefCell<BTreeSet<PathBuf>>,
    /// Operations left before the power cut (`None`: no cut planned).
    ops_left: Cell<Option<u64>>,
    /// Power is off: every operation fails until [`SimFs::power_cut`] restores.
    dead: Cell<bool>,
    /// Each data operation's latency, drawn from the seeded generator (`None`:
    /// none, operations complete in submission order).
    latency: RefCell<Option<SimLatency>>,
    /// Data reads ([`File::read_buf`]) fail with EIO with this probability,
    /// drawn from the generator (`None`: they never do).
    read_errors: RefCell<Option<(rand::rngs::StdRng, f64)>>,
    /// Data writes, punches, syncs and directory syncs fail with EIO with this
    /// probability, drawn from the generator (`None`: they never do). A failed
    /// write may or may not have reached the disk (drawn too).
    write_errors: RefCell<Option<(rand::rngs::StdRng, f64)>>,
    /// The file system is full: a write or allocation that needs a page no file
    /// holds or reserved fails with ENOSPC (overwrites and reserved space work).
    full: Cell<bool>,
    /// The store met an error it stops the process for (a failed sync or write:
    /// `ObjectStore::sync_failed`); the simulator then kills the process.
    fail_stopped: Cell<bool>,
    /// The machine's boot: [`SimFs::power_cut`] starts the next one.
    boot: Cell<u64>,
    /// Data blocks the store found not matching their checksums (file, block),
    /// in the order found: the simulator checks that it caused each one
    /// ([`SimFs::take_checksum_mismatches`]).
    mismatches: RefCell<Vec<(PathBuf, u32)>>,
    /// Files of this name are traced: every write, punch, sync, unlink and
    /// power cut of them is logged (`info`, target `simfs`), with the write
    /// counters of the workload's blocks written — how a failing seed's one
    /// object is followed through every copy (`simulate --trace-file`).
    traced_name: RefCell<Option<String>>,
}

/// The simulated disk's latency: a data operation (read, write, sync, allocate)
/// takes effect when it completes, after a delay drawn uniformly from `range`
/// (in microseconds of virtual time), so operations in flight together complete
/// in any order, as io_uring's do.
struct SimLatency {
    rng: rand::rngs::StdRng,
    range_us: std::ops::RangeInclusive<u64>,
}

/// One simulated file: its stable pages and its current (possibly volatile) pages.
pub struct SimFile {
    parent: PathBuf,
    stable: RefCell<HashMap<u64, Box<[u8; SIM_PAGE]>>>,
    current: RefCell<HashMap<u64, Box<[u8; SIM_PAGE]>>>,
    /// Pages written since they were last made stable.
    dirty: RefCell<BTreeSet<u64>>,
    /// The file's name survives a power cut (its directory was synced).
    name_stable: Cell<bool>,
    /// Pages allocated without being written (`fallocate`): a full disk still
    /// lets them be written.
    reserved: RefCell<BTreeSet<u64>>,
    /// The file's path, when it is traced ([`SimFs::trace_files_named`]).
    traced: RefCell<Option<PathBuf>>,
}

impl SimFs {
    /// An empty simulated disk with the given directories.
    pub fn new(dirs: &[PathBuf]) -> Rc<SimFs> {
        let fs = SimFs::default();
        fs.dirs.borrow_mut().extend(dirs.iter().cloned());
        Rc::new(fs)
    }

    /// Gives every later data operation a latency drawn from `range_us` by a
    /// generator seeded with `seed` (the deterministic simulator); operations then
    /// complete out of order. It sleeps on the reactor's (virtual) clock.
    pub fn set_latency(&self, range_us: std::ops::RangeInclusive<u64>, seed: u64) {
        use rand::SeedableRng;
        *self.latency.borrow_mut() = Some(SimLatency {
            rng: rand::rngs::StdRng::seed_from_u64(seed),
            range_us,
        });
    }

    /// Makes data reads fail with EIO with `probability` (a bad sector: the
    /// store serves such a read from another copy and rewrites it), drawn from a
    /// generator seeded with `seed`; `probability` 0 stops them.
    pub fn set_read_errors(&self, probability: f64, seed: u64) {
        use rand::SeedableRng;
        *self.read_errors.borrow_mut() = (probability > 0.0).then(|| {
            (
                rand::rngs::StdRng::seed_from_u64(seed),
                probability.min(1.0),
            )
        });
    }

    /// This read's simulated media error, if one is drawn.
    fn read_error(&self) -> io::Result<()> {
        use rand::Rng;
        let failed = match &mut *self.read_errors.borrow_mut() {
            Some((rng, p)) => rng.random_bool(*p),
            None => false,
        };
        if failed {
            return Err(io::Error::from_raw_os_error(libc::EIO));
        }
        Ok(())
    }

    /// Makes data writes, punches, file and directory syncs fail with EIO with
    /// `probability` (a failing disk or controller: the store stops the OSD, as
    /// the daemon does), drawn from a generator seeded with `seed`; `probability`
    /// 0 stops them.
    pub fn set_write_errors(&self, probability: f64, seed: u64) {
        use rand::SeedableRng;
        *self.write_errors.borrow_mut() = (probability > 0.0).then(|| {
            (
                rand::rngs::StdRng::seed_from_u64(seed),
                probability.min(1.0),
            )
        });
    }

    /// Fills the file system (`true`): writes and allocations that need new
    /// pages fail with ENOSPC until it is freed (`false`).
    pub fn set_full(&self, full: bool) {
        self.full.set(full);
    }

    /// Whether the file system is full.
    pub fn is_full(&self) -> bool {
        self.full.get()
    }

    /// The store stops the process: nothing it does from now on reaches the
    /// disk (as after `exit`), and the simulator kills it at its next look
    /// ([`SimFs::take_fail_stop`]).
    pub fn fail_stop(&self) {
        self.fail_stopped.set(true);
        self.dead.set(true);
        flame_common::transport::sim::crash_current();
    }

    /// Whether the store stopped the process since the last call.
    pub fn take_fail_stop(&self) -> bool {
        self.fail_stopped.replace(false)
    }

    /// EIO when a sync's simulated I/O error is drawn ([`SimFs::write_error`]).
    fn sync_error(&self) -> io::Result<()> {
        match self.write_error() {
            Some(_) => Err(io::Error::from_raw_os_error(libc::EIO)),
            None => Ok(()),
        }
    }

    /// This write's, punch's or sync's simulated I/O error, if one is drawn,
    /// and for a failed write whether its bytes reached the disk anyway.
    fn write_error(&self) -> Option<bool> {
        use rand::Rng;
        let mut errors = self.write_errors.borrow_mut();
        let (rng, p) = errors.as_mut()?;
        if !rng.random_bool(*p) {
            return None;
        }
        Some(rng.random_bool(0.5))
    }

    /// ENOSPC if the file system is full and `[offset, offset+len)` of `f`
    /// needs a page that is neither written nor reserved.
    fn space_for(&self, f: &SimFile, offset: u64, len: u64) -> io::Result<()> {
        if !self.full.get() || len == 0 {
            return Ok(());
        }
        let cur = f.current.borrow();
        let reserved = f.reserved.borrow();
        if sim_pages(offset, len).any(|p| !cur.contains_key(&p) && !reserved.contains(&p)) {
            return Err(io::Error::from_raw_os_error(libc::ENOSPC));
        }
        Ok(())
    }

    /// Waits for this operation's latency (nothing without one).
    async fn delay(&self) {
        use rand::Rng;
        let us = match &mut *self.latency.borrow_mut() {
            Some(l) => l.rng.random_range(l.range_us.clone()),
            None => return,
        };
        reactor::sleep(std::time::Duration::from_micros(us)).await;
    }

    /// Plans a power cut after `ops` more operations.
    pub fn cut_after(&self, ops: u64) {
        self.ops_left.set(Some(ops));
    }

    /// Whether the planned power cut has happened.
    pub fn is_dead(&self) -> bool {
        self.dead.get()
    }

    fn tick(&self) -> io::Result<()> {
        if self.dead.get() {
            return Err(io::Error::other("simulated power loss"));
        }
        if let Some(n) = self.ops_left.get() {
            if n == 0 {
                self.dead.set(true);
                self.ops_left.set(None);
                return Err(io::Error::other("simulated power loss"));
            }
            self.ops_left.set(Some(n - 1));
        }
        Ok(())
    }

    /// Every file's path, in order (the simulator's comparison of copies).
    pub fn paths(&self) -> Vec<PathBuf> {
        self.files.borrow().keys().cloned().collect()
    }

    /// `syncfs`: every file's pages and every name made stable, as the daemon
    /// does at start-up before it recovers the store (`daemon.rs`,
    /// `sync_data_fs`): what a killed process left in the page cache is on the
    /// disk before the new one serves (simulator seed 231152: without it, a file
    /// a killed process created kept an unstable name, and a power cut long
    /// after took the object the restarted OSD held as stable).
    pub fn syncfs(&self) {
        for f in self.files.borrow().values() {
            f.sync();
            f.name_stable.set(true);
        }
    }

    /// Traces every file of this name made from now on (see `traced_name`).
    pub fn trace_files_named(&self, name: &str) {
        *self.traced_name.borrow_mut() = Some(name.to_string());
    }

    /// The data blocks the store found not matching their checksums since the
    /// last call (file, block): each must be one the simulator rotted — a
    /// mismatch nothing injected is a store that lost track of its own bytes
    /// (a start-up that did not recompute an interrupted write's checksums,
    /// say), even when read repair and scrub then hide it.
    pub fn take_checksum_mismatches(&self) -> Vec<(PathBuf, u32)> {
        std::mem::take(&mut *self.mismatches.borrow_mut())
    }

    fn note_checksum_mismatch(&self, file: &Rc<SimFile>, blocks: &[u32]) {
        let files = self.files.borrow();
        // Bounded by the files on the simulated disk; mismatches are rare.
        let Some(path) = files
            .iter()
            .find(|(_, f)| Rc::ptr_eq(f, file))
            .map(|(p, _)| p.clone())
        else {
            return; // unlinked since it was opened: nothing left to check
        };
        self.mismatches
            .borrow_mut()
            .extend(blocks.iter().map(|&b| (path.clone(), b)));
    }

    /// The current contents of `path` (what a read would see), up to its last
    /// written page; `None` if there is no such file.
    pub fn contents(&self, path: &Path) -> Option<Vec<u8>> {
        let files = self.files.borrow();
        let f = files.get(path)?;
        let end = f
            .current
            .borrow()
            .keys()
            .max()
            .map_or(0, |&p| (p + 1) * SIM_PAGE as u64);
        Some(f.read(0, end as usize))
    }

    /// Bit rot: flips bit `bit` (0-7) of the byte at `offset` of `path`, in what
    /// a read sees and in what is stable alike (the medium changed under the
    /// file system, which reports nothing). False if no page holds that byte.
    pub fn flip_bit(&self, path: &Path, offset: u64, bit: u8) -> bool {
        let files = self.files.borrow();
        let Some(f) = files.get(path) else {
            return false;
        };
        let page = offset / SIM_PAGE as u64;
        let within = (offset % SIM_PAGE as u64) as usize;
        let mut flipped = false;
        for pages in [&f.current, &f.stable] {
            if let Some(p) = pages.borrow_mut().get_mut(&page) {
                p[within] ^= 1 << (bit % 8);
                flipped = true;
            }
        }
        flipped
    }

    /// The power comes back: every page not made stable was either written by the
    /// disk before the cut or lost (chosen by `keep`, called once per such page), a
    /// file whose name was never made stable is lost, and operations work again,
    /// in the machine's next boot ([`Fs::boot_id`]).
    pub fn power_cut(&self, keep: &mut impl FnMut() -> bool) {
        self.files.borrow_mut().retain(|_, f| {
            let survives = f.name_stable.get() || keep();
            if survives {
                f.cut(keep);
            } else {
                f.trace(|| "power cut: lost with its name (its directory never synced)".into());
            }
            survives
        });
        self.dead.set(false);
        self.ops_left.set(None);
        self.boot.set(self.boot.get() + 1);
    }
}

impl SimFile {
    fn new(parent: PathBuf) -> SimFile {
        SimFile {
            parent,
            stable: RefCell::new(HashMap::default()),
            current: RefCell::new(HashMap::default()),
            dirty: RefCell::new(BTreeSet::new()),
            name_stable: Cell::new(false),
            reserved: RefCell::new(BTreeSet::new()),
            traced: RefCell::new(None),
        }
    }

    /// Logs `what` happened to this file, if it is traced.
    fn trace(&self, what: impl FnOnce() -> String) {
        if let Some(path) = &*self.traced.borrow() {
            tracing::info!(target: "simfs", "{}: {}", path.display(), what());
        }
    }

    /// What a write of `data` at `offset` was, for the trace: its extent and,
    /// for each whole 4 KiB it carries, the simulated workload's write counter
    /// (bytes 16..24 of its blocks; 0 for zeroes).
    fn describe_write(offset: u64, data: &[u8]) -> String {
        let counters: Vec<String> = data
            .chunks_exact(4096)
            .map(|b| {
                let mut c = [0u8; 8];
                c.copy_from_slice(&b[16..24]);
                u64::from_le_bytes(c).to_string()
            })
            .collect();
        if counters.is_empty() {
            format!("{} bytes at {offset}", data.len())
        } else {
            format!(
                "{} bytes at {offset}, counters [{}]",
                data.len(),
                counters.join(" ")
            )
        }
    }

    fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        let cur = self.current.borrow();
        let mut done = 0usize;
        while done < len {
            let pos = offset + done as u64;
            let page = pos / SIM_PAGE as u64;
            let within = (pos % SIM_PAGE as u64) as usize;
            let n = (SIM_PAGE - within).min(len - done);
            if let Some(p) = cur.get(&page) {
                out[done..done + n].copy_from_slice(&p[within..within + n]);
            }
            done += n;
        }
        out
    }

    fn write(&self, offset: u64, data: &[u8], stable: bool) {
        let mut cur = self.current.borrow_mut();
        let mut done = 0usize;
        while done < data.len() {
            let pos = offset + done as u64;
            let page = pos / SIM_PAGE as u64;
            let within = (pos % SIM_PAGE as u64) as usize;
            let n = (SIM_PAGE - within).min(data.len() - done);
            let p = cur.entry(page).or_insert_with(|| Box::new([0u8; SIM_PAGE]));
            p[within..within + n].copy_from_slice(&data[done..done + n]);
            if stable {
                self.stable.borrow_mut().insert(page, p.clone());
                self.dirty.borrow_mut().remove(&page);
            } else {
                self.dirty.borrow_mut().insert(page);
            }
            done += n;
        }
    }

    fn sync(&self) {
        let cur = self.current.borrow();
        let mut stable = self.stable.borrow_mut();
        for page in std::mem::take(&mut *self.dirty.borrow_mut()) {
            if let Some(p) = cur.get(&page) {
                stable.insert(page, p.clone());
            }
        }
    }

    fn cut(&self, keep: &mut impl FnMut() -> bool) {
        let dirty = self.dirty.borrow().len();
        self.sync_some(keep);
        *self.current.borrow_mut() = self.stable.borrow().clone();
        self.trace(|| format!("power cut: {dirty} unsynced pages, each kept or lost"));
    }

    fn sync_some(&self, keep: &mut impl FnMut() -> bool) {
        let cur = self.current.borrow();
        let mut stable = self.stable.borrow_mut();
        for page in std::mem::take(&mut *self.dirty.borrow_mut()) {
            if keep()
                && let Some(p) = cur.get(&page)
            {
                stable.insert(page, p.clone());
            }
        }
    }

    fn size(&self) -> u64 {
        self.current
            .borrow()
            .keys()
            .max()
            .map_or(0, |p| (p + 1) * SIM_PAGE as u64)
    }
}
