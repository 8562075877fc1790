//! The intent journal of one shard: which objects may have data on disk newer than
//! their stable checksums.
//!
//! Before the first write to an object after the journal was last reset, the object
//! is appended here with a synced write; concurrent first writes share one device
//! write (group commit: whoever finds the journal idle writes every queued entry).
//! A FLUSH that leaves the shard with no dirty object resets the journal by starting
//! a new generation (one synced header write): entries of older generations are
//! ignored. At start-up, every object named by an entry of the current generation has
//! its checksums recomputed from the data on disk (see `super::recover`).
//!
//! A header that does not decode (torn while a reset wrote it, or corrupted) is
//! never taken as an empty journal: every entry carries its own generation and
//! crc, so start-up recomputes every object any entry in the file names, and the
//! next generation goes above the newest entry left in it ([`replay`],
//! [`reset_file`]); no format change, and a reset stays one synced header write.
//!
//! Byte layout in docs/on-disk-format.md.

use super::fs::{File, Fs};
use crate::metrics::SyncKind;
use flame_common::collections::{HashMap, HashSet};
use flame_common::ids::{ObjectId, PgId, VolumeId};
use std::cell::{Cell, RefCell};

use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// First bytes of a journal header.
pub const JOURNAL_MAGIC: &[u8; 8] = b"FLAMEJNL";
/// Size of the journal header; entries follow it.
pub const JOURNAL_HEADER_LEN: u64 = 4096;
/// Size of one entry.
pub const ENTRY_LEN: usize = 32;
/// Entries after which the store holds new writes back, lets the ones in flight
/// finish and flushes everything, which resets the journal (it may exceed this by
/// the writes that were in flight).
pub const JOURNAL_ENTRIES_SOFT_MAX: usize = 65_536;
/// Entries written by one group commit at most.
const BATCH_MAX: usize = 1024;
/// Entries one journal holds at most: the soft bound and a few batches beyond it
/// (writes in flight when the bound is hit). The restart-doubt record reserves
/// room for as many per shard (`super::doubt_record::reserve`).
pub const JOURNAL_ENTRIES_MAX: usize = JOURNAL_ENTRIES_SOFT_MAX + 4 * BATCH_MAX;
/// Bytes of journal file allocated up front: the header and
/// [`JOURNAL_ENTRIES_MAX`] entries.
const JOURNAL_RESERVE_BYTES: u64 = JOURNAL_HEADER_LEN + (JOURNAL_ENTRIES_MAX * ENTRY_LEN) as u64;
/// Bytes read at once when replaying a journal.
const REPLAY_CHUNK: usize = 1 << 20;

fn encode_header(generation: u64) -> Vec<u8> {
    encode_generation_header(JOURNAL_MAGIC, generation)
}

fn decode_header(b: &[u8]) -> Option<u64> {
    decode_generation_header(JOURNAL_MAGIC, b)
}

/// A 4096-byte header of a generation-numbered file of the store (the intent
/// journal, the placement-group log): `magic` (0..8), the format (8..12), zero,
/// the generation (16..24), zero, crc32c of bytes 0..4092 at 4092. Public (hidden)
/// for the property test (`flame-osd/tests/store_decode_props.rs`) and the fuzz
/// target (`fuzz/fuzz_targets/store.rs`).
#[doc(hidden)]
pub fn encode_generation_header(magic: &[u8; 8], generation: u64) -> Vec<u8> {
    let mut b = vec![0u8; JOURNAL_HEADER_LEN as usize];
    b[0..8].copy_from_slice(magic);
    b[8..12].copy_from_slice(&super::layout::FORMAT.to_le_bytes());
    b[16..24].copy_from_slice(&generation.to_le_bytes());
    let n = b.len();
    let crc = crc32c::crc32c(&b[..n - 4]);
    b[n - 4..].copy_from_slice(&crc.to_le_bytes());
    b
}

/// The generation of a header written by [`encode_generation_header`] with
/// `magic`; `None` if it is not one (another magic, torn, too short).
#[doc(hidden)]
pub fn decode_generation_header(magic: &[u8; 8], b: &[u8]) -> Option<u64> {
    let n = JOURNAL_HEADER_LEN as usize;
    if b.len() < n || &b[0..8] != magic {
        return None;
    }
    let crc = u32::from_le_bytes([b[n - 4], b[n - 3], b[n - 2], b[n - 1]]);
    if crc32c::crc32c(&b[..n - 4]) != crc {
        return None;
    }
    let mut g = [0u8; 8];
    g.copy_from_slice(&b[16..24]);
    Some(u64::from_le_bytes(g))
}

/// Appends one journal entry. Public (hidden) for the property test and the fuzz
/// target, like [`decode_entry`].
#[doc(hidden)]
pub fn encode_entry(out: &mut Vec<u8>, generation: u64, object: ObjectId, pg: PgId) {
    let start = out.len();
    out.extend_from_slice(&generation.to_le_bytes());
    out.extend_from_slice(&object.volume.0.to_le_bytes());
    out.extend_from_slice(&object.index.to_le_bytes());
    out.extend_from_slice(&pg.0.to_le_bytes());
    let crc = crc32c::crc32c(&out[start..]);
    out.extend_from_slice(&crc.to_le_bytes());
}

/// Decodes one [`ENTRY_LEN`]-byte entry of `generation`; `None` if it is torn,
/// of another generation, or not [`ENTRY_LEN`] bytes (the length is checked here,
/// not trusted to the caller, so no slice of a damaged file can make it panic).
#[doc(hidden)]
pub fn decode_entry(b: &[u8], generation: u64) -> Option<(PgId, ObjectId)> {
    if b.len() != ENTRY_LEN {
        return None;
    }
    let u64_at = |o: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[o..o + 8]);
        u64::from_le_bytes(a)
    };
    let crc = u32::from_le_bytes([b[28], b[29], b[30], b[31]]);
    if crc32c::crc32c(&b[..28]) != crc || u64_at(0) != generation {
        return None;
    }
    let pg = PgId(u32::from_le_bytes([b[24], b[25], b[26], b[27]]));
    Some((
        pg,
        ObjectId {
            volume: VolumeId(u64_at(8)),
            index: u64_at(16),
        },
    ))
}

/// Most bytes of a journal whose header does not decode that start-up scans for
/// entries (every journal flame-osd writes is far smaller: the reservation is
/// about 2.2 MiB); a larger one is refused rather than half read.
pub const JOURNAL_SCAN_MAX: u64 = 256 << 20;

/// What start-up learns from one journal file.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Replayed {
    /// The objects that may have data on disk newer than their stable checksums.
    pub objects: Vec<(PgId, ObjectId)>,
    /// The header did not decode, so which generation is current is unknown:
    /// `objects` are then every object that any entry of the file names, of any
    /// generation (a superset of the current generation's).
    pub header_unreadable: bool,
}

/// Every entry that verifies (its crc), of any generation, in the file from
/// offset [`JOURNAL_HEADER_LEN`] on: for a journal whose header does not decode.
/// Bounded by [`JOURNAL_SCAN_MAX`]: a larger file is an error, never half read.
async fn scan_entries(file: &File, path: &Path) -> io::Result<Vec<(u64, PgId, ObjectId)>> {
    let size = file.size().await?;
    if size > JOURNAL_SCAN_MAX {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "intent journal {}: its header does not decode and the file is {size} bytes, \
                 more than any journal flame-osd writes ({JOURNAL_SCAN_MAX}): it is not a \
                 journal this OSD wrote; move it out of journal/ and start again (the objects \
                 it may name then keep the checksums they have: a block newer than its \
                 checksum fails verification and is repaired from another copy), or start \
                 this OSD on an empty data_dir",
                path.display()
            ),
        ));
    }
    let mut out = Vec::new();
    let mut offset = JOURNAL_HEADER_LEN;
    // Bounded by the file size, itself bounded above.
    while offset + ENTRY_LEN as u64 <= size {
        let chunk = file.read(offset, REPLAY_CHUNK).await?;
        for e in chunk.chunks_exact(ENTRY_LEN) {
            let generation = u64::from_le_bytes([e[0], e[1], e[2], e[3], e[4], e[5], e[6], e[7]]);
            if let Some((pg, object)) = decode_entry(e, generation) {
                out.push((generation, pg, object));
            }
        }
        offset += REPLAY_CHUNK as u64;
    }
    Ok(out)
}

/// The header's generation, or `None` if the header does not decode (torn by a
/// power cut while a reset wrote it, or corrupted by the medium).
async fn read_generation(file: &File) -> io::Result<Option<u64>> {
    let head = file.read(0, JOURNAL_HEADER_LEN as usize).await?;
    Ok(decode_header(&head))
}

/// Whether a journal file holds nothing at all: never written (a journal created
/// and not yet given its first header), so an all-zero header is not damage.
async fn is_blank(file: &File) -> io::Result<bool> {
    let head = file.read(0, JOURNAL_HEADER_LEN as usize).await?;
    Ok(head.iter().all(|&b| b == 0) && file.size().await? <= JOURNAL_HEADER_LEN)
}

/// The generation the next header of this journal gets: above every generation
/// that can be on disk in it, so no entry left from an earlier generation ever
/// counts as current. With a valid header, the one after it (entries of a
/// generation are written only once its header is stable, so none is newer); with
/// a header that does not decode, the one after the newest entry in the file.
async fn next_generation(file: &File, path: &Path) -> io::Result<u64> {
    let newest = match read_generation(file).await? {
        Some(g) => g,
        None => scan_entries(file, path)
            .await?
            .iter()
            .map(|e| e.0)
            .max()
            .unwrap_or(0),
    };
    newest.checked_add(1).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "intent journal {}: generation {newest} cannot be followed (not written by \
                 flame-osd); start this OSD on an empty data_dir",
                path.display()
            ),
        )
    })
}

/// Reads the objects named by the current generation of the journal at `path`.
/// A missing or never-written journal names none. A journal whose header does not
/// decode is **not** empty: it names every object of every entry in it that
/// verifies (start-up recomputes them all, and they are in doubt until copied
/// again from their primaries), because the current generation's entries are
/// among them and cannot be told from older ones without the header.
pub async fn replay(fs: &Fs, path: &Path) -> io::Result<Replayed> {
    let Some((file, _)) = fs.open(path, false).await? else {
        return Ok(Replayed::default());
    };
    let Some(generation) = read_generation(&file).await? else {
        if is_blank(&file).await? {
            return Ok(Replayed::default());
        }
        let mut seen = HashSet::default();
        let objects = scan_entries(&file, path)
            .await?
            .into_iter()
            .filter(|(_, _, object)| seen.insert(*object))
            .map(|(_, pg, object)| (pg, object))
            .collect();
        return Ok(Replayed {
            objects,
            header_unreadable: true,
        });
    };
    let size = file.size().await?;
    let mut out = Vec::new();
    let mut offset = JOURNAL_HEADER_LEN;
    // Bounded by the file size; stops at the first entry that is torn or older.
    while offset + ENTRY_LEN as u64 <= size {
        let chunk = file.read(offset, REPLAY_CHUNK).await?;
        for e in chunk.chunks_exact(ENTRY_LEN) {
            match decode_entry(e, generation) {
                Some(x) => out.push(x),
                None => {
                    return Ok(Replayed {
                        objects: out,
                        header_unreadable: false,
                    });
                }
            }
        }
        offset += REPLAY_CHUNK as u64;
    }
    Ok(Replayed {
        objects: out,
        header_unreadable: false,
    })
}

/// Starts a new, empty generation of the journal at `path` (synced), numbered
/// above every generation on disk in it ([`next_generation`]).
pub async fn reset_file(fs: &Fs, path: &Path) -> io::Result<()> {
    let Some((file, _)) = fs.open(path, false).await? else {
        return Ok(());
    };
    let generation = next_generation(&file, path).await?;
    file.write(0, encode_header(generation), Some(SyncKind::Journal))
        .await
}

/// The generation in the header of the journal at `path` (`None`: missing, or the
/// header does not decode). Tests check that generations never restart.
#[cfg(test)]
pub async fn header_generation(fs: &Fs, path: &Path) -> io::Result<Option<u64>> {
    match fs.open(path, false).await? {
        Some((file, _)) => read_generation(&file).await,
        None => Ok(None),
    }
}

/// The journal of one shard.
pub struct Journal {
    fs: Fs,
    path: PathBuf,
    file: RefCell<Option<Rc<File>>>,
    generation: Cell<u64>,
    /// Objects with an entry in the current generation, with the entry's sequence
    /// number (durable once `durable_seq` reaches it).
    entries: RefCell<HashMap<ObjectId, u64>>,
    pending: RefCell<Vec<(u64, ObjectId, PgId)>>,
    next_seq: Cell<u64>,
    durable_seq: Cell<u64>,
    /// Where the next entry goes.
    tail: Cell<u64>,
    /// A group commit or reset is writing.
    busy: Cell<bool>,
    waiters: super::wait_list::WaitList,
    /// A journal write failed: nothing more can be promised.
    failed: Cell<bool>,
    /// Synced entry writes so far (tests check the group commit with it).
    commits: Cell<u64>,
}

impl Journal {
    /// The journal at `path`; opened (and given a new generation) at first use.
    pub fn new(fs: Fs, path: PathBuf) -> Journal {
        Journal {
            fs,
            path,
            file: RefCell::new(None),
            generation: Cell::new(0),
            entries: RefCell::new(HashMap::default()),
            pending: RefCell::new(Vec::new()),
            next_seq: Cell::new(1),
            durable_seq: Cell::new(0),
            tail: Cell::new(JOURNAL_HEADER_LEN),
            busy: Cell::new(false),
            waiters: super::wait_list::WaitList::default(),
            failed: Cell::new(false),
            commits: Cell::new(0),
        }
    }

    /// Entries in the current generation.
    pub fn len(&self) -> usize {
        self.entries.borrow().len()
    }

    /// Whether the current generation names no object.
    pub fn is_empty(&self) -> bool {
        self.entries.borrow().is_empty()
    }

    /// Synced entry writes so far.
    #[cfg(test)]
    pub fn commits(&self) -> u64 {
        self.commits.get()
    }

    /// Returns once `object` is durably named by the journal. Only the first call
    /// per object per generation writes (and concurrent ones share that write).
    pub async fn record(&self, object: ObjectId, pg: PgId) -> io::Result<()> {
        let seq = {
            let mut entries = self.entries.borrow_mut();
            match entries.get(&object) {
                Some(&s) => s,
                None => {
                    let s = self.next_seq.get();
                    self.next_seq.set(s + 1);
                    entries.insert(object, s);
                    self.pending.borrow_mut().push((s, object, pg));
                    s
                }
            }
        };
        // Bounded: each round either finds the entry durable, fails, writes a batch
        // that contains queued entries, or waits for the writer that will.
        loop {
            if self.durable_seq.get() >= seq {
                return Ok(());
            }
            if self.failed.get() {
                return Err(io::Error::other("the intent journal failed earlier"));
            }
            if self.busy.get() {
                self.wait().await;
                continue;
            }
            let busy = Busy::take(self);
            let res = self.commit_batch().await;
            drop(busy);
            if let Err(e) = res {
                self.failed.set(true);
                return Err(e);
            }
        }
    }

    async fn file(&self) -> io::Result<Rc<File>> {
        if let Some(f) = self.file.borrow().as_ref() {
            return Ok(f.clone());
        }
        let (file, created) = self
            .fs
            .open(&self.path, true)
            .await?
            .ok_or_else(|| io::Error::other("journal vanished while creating it"))?;
        if created && let Some(dir) = self.path.parent() {
            // A journal whose name a power cut can take away protects nothing.
            self.fs.sync_dir(dir).await?;
        }
        // Entries are appended while writes run; their space is reserved once, so a
        // full disk fails data writes (ENOSPC to the client) rather than a journal
        // write (which stops the OSD). Up to the soft bound plus a batch in flight.
        file.allocate(0, JOURNAL_RESERVE_BYTES).await?;
        let generation = next_generation(&file, &self.path).await?;
        file.write(0, encode_header(generation), Some(SyncKind::Journal))
            .await?;
        self.generation.set(generation);
        let file = Rc::new(file);
        *self.file.borrow_mut() = Some(file.clone());
        Ok(file)
    }

    /// Writes the queued entries (up to [`BATCH_MAX`]) with one synced write.
    async fn commit_batch(&self) -> io::Result<()> {
        let file = self.file().await?;
        let batch: Vec<_> = {
            let mut p = self.pending.borrow_mut();
            let n = p.len().min(BATCH_MAX);
            p.drain(..n).collect()
        };
        let Some(last) = batch.last().map(|b| b.0) else {
            return Ok(());
        };
        let mut bytes = Vec::with_capacity(batch.len() * ENTRY_LEN);
        for (_, object, pg) in &batch {
            encode_entry(&mut bytes, self.generation.get(), *object, *pg);
        }
        let offset = self.tail.get();
        self.tail.set(offset + bytes.len() as u64);
        // If this future is dropped before the write is known to be stable, the
        // entries go back to the queue: a later batch writes them again rather than
        // counting them durable.
        let mut requeue = Requeue {
            journal: self,
            batch: Some(batch),
        };
        crate::failpoints::check("journal_write")?;
        file.write(offset, bytes, Some(SyncKind::Journal)).await?;
        requeue.batch = None;
        self.commits.set(self.commits.get() + 1);
        self.durable_seq.set(self.durable_seq.get().max(last));
        Ok(())
    }

    /// Starts a new generation if `clean()` still holds once the journal is idle:
    /// the caller's check that no object is dirty and no write is in flight. Returns
    /// whether it reset.
    pub async fn reset_if(&self, clean: impl Fn() -> bool) -> io::Result<bool> {
        // Bounded: waits only while another writer runs, which ends.
        while self.busy.get() {
            self.wait().await;
        }
        if !clean() || !self.pending.borrow().is_empty() || self.failed.get() {
            return Ok(false);
        }
        if self.entries.borrow().is_empty() {
            return Ok(true);
        }
        let busy = Busy::take(self);
        let res = async {
            let file = self.file().await?;
            let generation = self
                .generation
                .get()
                .checked_add(1)
                .ok_or_else(|| io::Error::other("intent journal generation exhausted"))?;
            // From here on, new entries belong to the new generation; they are
            // written only after its header (the journal is busy until then).
            self.generation.set(generation);
            self.entries.borrow_mut().clear();
            self.tail.set(JOURNAL_HEADER_LEN);
            crate::failpoints::check("journal_write")?;
            file.write(0, encode_header(generation), Some(SyncKind::Journal))
                .await?;
            Ok(())
        }
        .await;
        drop(busy);
        if let Err(e) = res {
            self.failed.set(true);
            return Err(e);
        }
        Ok(true)
    }

    fn wake_all(&self) {
        self.waiters.wake_all();
    }

    /// Waits for the next `wake_all`.
    async fn wait(&self) {
        self.waiters.wait().await
    }
}

/// Holds the journal's writer role; released (and waiters woken) on drop, also when
/// the future holding it is dropped.
struct Busy<'a>(&'a Journal);

impl<'a> Busy<'a> {
    fn take(journal: &'a Journal) -> Busy<'a> {
        debug_assert!(!journal.busy.get(), "two journal writers");
        journal.busy.set(true);
        Busy(journal)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.busy.set(false);
        self.0.wake_all();
    }
}

/// A batch whose write has not been seen to complete.
struct Requeue<'a> {
    journal: &'a Journal,
    batch: Option<Vec<(u64, ObjectId, PgId)>>,
}

impl Drop for Requeue<'_> {
    fn drop(&mut self) {
        if let Some(batch) = self.batch.take() {
            let mut pending = self.journal.pending.borrow_mut();
            let rest = std::mem::take(&mut *pending);
            pending.extend(batch);
            pending.extend(rest);
        }
    }
}
