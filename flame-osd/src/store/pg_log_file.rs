//! The stable copy of one shard's placement-group logs: which writes (group
//! sequence number, client op id, object, range) this copy holds, kept across
//! restarts so that numbering continues above every seq seen, a retry is still
//! recognised and a write older than one of its session's is still refused
//! after the OSD restarted (`crate::pg_log`, `crate::pg_core`).
//!
//! **When a record becomes stable.** A write's data is stable only once a FLUSH
//! (or its FUA) made it so, and a record must never claim a write whose bytes a
//! power cut could still take away (a retry would be answered "applied" from a
//! copy that lost it). So records wait in memory, per volume, and
//! [`ObjectStore::flush`](super::ObjectStore::flush) writes those of the writes
//! it covers — taken *before* it syncs the data — *after* the data is stable,
//! with one appended synced write (`RWF_DSYNC`). A 4 KiB write costs no device
//! write of its own; a FLUSH costs one more synced write. Records of a FUA write
//! become stable at the next FLUSH of its volume; records still in memory at a
//! crash are lost, which only means that their ops are unknown after the restart
//! (applied again if retried: correct, as before this file existed).
//!
//! **Format.** Two files per shard, `pglog/<shard>.0` and `.1`, each a
//! 4096-byte header (magic, generation, crc32c) followed by 68-byte records (each
//! with the file's generation and a crc32c). The file with the higher
//! generation is the current one; its records are read up to the first torn or
//! older one. A header that does not decode is never taken as "no file": the
//! file's first record (whole, since a compaction syncs its records before it
//! writes the header) says its generation. A compaction numbers its file above
//! every generation that can be on disk in either file (it scans the file it
//! overwrites once per run), so a record left from an earlier use of a
//! generation never counts as current. When the current file grows past [`FILE_BYTES_MAX`] (or twice what
//! the last compaction kept), the newest
//! `keep_per_pg` records of every group are written to the other file, which is
//! synced and then given the next generation (its header written and synced
//! last): a crash at any point leaves one whole current file.
//!
//! Bounded: at most [`PENDING_MAX`] records wait in memory (beyond that the
//! oldest are dropped: those ops are then unknown after a restart), a file is
//! compacted before it passes half of [`LOAD_BYTES_MAX`] (plus one flush's
//! records), and loading reads at most [`LOAD_BYTES_MAX`].

use super::fs::{File, Fs};
use crate::metrics::SyncKind;
use crate::pg_log::{EntryKind, LogEntry};
use flame_common::collections::HashMap;
use flame_common::ids::{Epoch, ObjectId, OpId, PgId, VolumeId};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// First bytes of a log file's header.
pub const PG_LOG_MAGIC: &[u8; 8] = b"FLAMEPGL";
/// Size of a log file's header; records follow it.
pub const HEADER_LEN: u64 = super::journal::JOURNAL_HEADER_LEN;
/// Size of one record: generation, seq, op session, op seq, volume, object
/// index (u64 each), offset, length, group (u32 each), kind (u8), 3 zero bytes,
/// crc32c of the 64 bytes before it.
pub const RECORD_LEN: usize = 68;
/// Size past which the current file is compacted into the other one (or twice
/// what the last compaction kept, if that is more: many groups times
/// `pg_log_entries_max` records can exceed this, and compacting at every FLUSH
/// would then cost a rewrite each).
pub const FILE_BYTES_MAX: u64 = 64 << 20;
/// Most bytes of a log file read when loading (a bound on what a damaged or
/// foreign file can make a shard read and hold).
pub const LOAD_BYTES_MAX: u64 = 256 << 20;
/// Records waiting for a FLUSH, at most (4.25 MiB).
pub const PENDING_MAX: usize = 65_536;
/// Bytes read at once when loading.
const READ_CHUNK: usize = 1 << 20;

/// One group's log entry as stored: what a restarted copy knows of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredEntry {
    /// Its group.
    pub pg: PgId,
    /// The entry (`interval` 0, `applied` empty: it proves only that this copy
    /// holds it). For a forgotten proof, only its object, offset and length
    /// count (seq 0, no op).
    pub entry: LogEntry,
    /// Not a write but a proof forgotten ([`PgLogFile::note_forgotten`]):
    /// the entries stored before it no longer prove that this copy holds their
    /// ops over `entry`'s bytes.
    pub proof_forgotten: bool,
}

fn encode_header(generation: u64) -> Vec<u8> {
    super::journal::encode_generation_header(PG_LOG_MAGIC, generation)
}

fn decode_header(b: &[u8]) -> Option<u64> {
    super::journal::decode_generation_header(PG_LOG_MAGIC, b)
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[o..o + 8]);
    u64::from_le_bytes(a)
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

/// The record kind of a forgotten proof ([`PgLogFile::note_forgotten`]).
const FORGOTTEN_CODE: u8 = 4;

fn kind_code(kind: EntryKind) -> u8 {
    match kind {
        EntryKind::Write => 1,
        EntryKind::Zero => 2,
        EntryKind::Discard => 3,
    }
}

/// A record without its file generation (filled in when written). Public
/// (hidden), with [`seal`] and [`decode_record`], for the property test
/// (`flame-osd/tests/store_decode_props.rs`) and the fuzz target.
#[doc(hidden)]
pub fn encode_record(pg: PgId, e: &LogEntry) -> [u8; RECORD_LEN] {
    let mut b = [0u8; RECORD_LEN];
    b[8..16].copy_from_slice(&e.seq.to_le_bytes());
    b[16..24].copy_from_slice(&e.op.session.to_le_bytes());
    b[24..32].copy_from_slice(&e.op.seq.to_le_bytes());
    b[32..40].copy_from_slice(&e.object.volume.0.to_le_bytes());
    b[40..48].copy_from_slice(&e.object.index.to_le_bytes());
    b[48..52].copy_from_slice(&e.offset.to_le_bytes());
    b[52..56].copy_from_slice(&e.length.to_le_bytes());
    b[56..60].copy_from_slice(&pg.0.to_le_bytes());
    b[60] = kind_code(e.kind);
    b
}

/// The record of a proof forgotten over `[offset, offset+length)` of `object`
/// (`length` 0: all of it): seq and op 0, kind [`FORGOTTEN_CODE`].
#[doc(hidden)]
pub fn encode_forgotten(pg: PgId, object: ObjectId, offset: u32, length: u32) -> [u8; RECORD_LEN] {
    let mut b = [0u8; RECORD_LEN];
    b[32..40].copy_from_slice(&object.volume.0.to_le_bytes());
    b[40..48].copy_from_slice(&object.index.to_le_bytes());
    b[48..52].copy_from_slice(&offset.to_le_bytes());
    b[52..56].copy_from_slice(&length.to_le_bytes());
    b[56..60].copy_from_slice(&pg.0.to_le_bytes());
    b[60] = FORGOTTEN_CODE;
    b
}

/// The record of a stored entry, as [`decode_record`] read it.
#[doc(hidden)]
pub fn encode_stored(s: &StoredEntry) -> [u8; RECORD_LEN] {
    if s.proof_forgotten {
        encode_forgotten(s.pg, s.entry.object, s.entry.offset, s.entry.length)
    } else {
        encode_record(s.pg, &s.entry)
    }
}

/// Stamps `generation` and the checksum (crc32c of bytes 0..64) into a record.
#[doc(hidden)]
pub fn seal(mut b: [u8; RECORD_LEN], generation: u64) -> [u8; RECORD_LEN] {
    b[0..8].copy_from_slice(&generation.to_le_bytes());
    let crc = crc32c::crc32c(&b[..64]);
    b[64..68].copy_from_slice(&crc.to_le_bytes());
    b
}

/// Decodes one record of `generation`; `None` if it is torn, older, not
/// [`RECORD_LEN`] bytes, or names a write that could not have been logged.
#[doc(hidden)]
pub fn decode_record(b: &[u8], generation: u64) -> Option<StoredEntry> {
    if b.len() != RECORD_LEN {
        return None;
    }
    if crc32c::crc32c(&b[..64]) != u32_at(b, 64) || u64_at(b, 0) != generation {
        return None;
    }
    let forgotten = b[60] == FORGOTTEN_CODE;
    let kind = match b[60] {
        1 => EntryKind::Write,
        2 => EntryKind::Zero,
        3 => EntryKind::Discard,
        FORGOTTEN_CODE => EntryKind::Write,
        _ => return None,
    };
    let seq = u64_at(b, 8);
    let (offset, length) = (u32_at(b, 48), u32_at(b, 52));
    // Bounded before use: a record that could not have been written is the end.
    if u64::from(offset) + u64::from(length) > 1 << 32 {
        return None;
    }
    if forgotten {
        // Written with seq and op 0, and nothing after the kind.
        if seq != 0 || u64_at(b, 16) != 0 || u64_at(b, 24) != 0 || b[61..64] != [0; 3] {
            return None;
        }
    } else if seq == 0 || seq > crate::pg_core::PG_SEQ_MAX {
        return None;
    }
    Some(StoredEntry {
        pg: PgId(u32_at(b, 56)),
        entry: LogEntry {
            seq,
            op: OpId {
                session: u64_at(b, 16),
                seq: u64_at(b, 24),
            },
            interval: Epoch(0),
            object: ObjectId {
                volume: VolumeId(u64_at(b, 32)),
                index: u64_at(b, 40),
            },
            offset,
            length,
            kind,
            applied: Vec::new(),
        },
        proof_forgotten: forgotten,
    })
}

/// The directory of the log files (created on the first write).
pub fn dir(root: &Path) -> PathBuf {
    root.join("pglog")
}

/// The two files of one shard.
fn paths(root: &Path, shard: u16) -> [PathBuf; 2] {
    let dir = dir(root);
    [0, 1].map(|i| dir.join(format!("{shard:04x}.{i}")))
}

/// The current file of a shard: which of the two, kept open, its generation,
/// where its valid records end.
struct Current {
    index: usize,
    file: Rc<File>,
    generation: u64,
    end: u64,
}

/// One shard's stable placement-group logs and the records waiting for a FLUSH.
pub struct PgLogFile {
    fs: Fs,
    root: PathBuf,
    dir: PathBuf,
    paths: [PathBuf; 2],
    current: RefCell<Option<Current>>,
    /// Records of applied writes not yet made stable, per volume, oldest first.
    pending: RefCell<HashMap<VolumeId, VecDeque<[u8; RECORD_LEN]>>>,
    pending_len: Cell<usize>,
    /// Newest records of each group a compaction keeps (`pg_log_entries_max`).
    keep_per_pg: Cell<usize>,
    /// The current file's size at which it is compacted.
    compact_at: Cell<u64>,
    /// One persist or compaction at a time (they append at the file's end).
    writing: Cell<bool>,
    writer_free: super::wait_list::WaitList,
    /// The stable copy could not be read at start: nothing is written this run
    /// (a new file would get a generation below the unread one's, which would win
    /// at the next start). Records are dropped: their ops are unknown after a
    /// restart, as if there were no stable log.
    disabled: Cell<bool>,
    /// At least every generation that can be on disk in either file (headers and
    /// records, also those of a compaction that a crash interrupted): the next
    /// compaction numbers its file above it, so no record left in a file from an
    /// earlier use of a generation ever counts as current. Only grows.
    highest: Cell<u64>,
    /// Whether each file's records were scanned for their newest generation this
    /// run (once per file: after that, this run wrote everything newer in it).
    scanned: [Cell<bool>; 2],
}

/// What a file's header says.
enum Head {
    /// It decodes: the file's generation.
    Valid(u64),
    /// All zero: never written (a first compaction into this file did not finish).
    Blank,
    /// It does not decode (torn while a compaction wrote it, or corrupted).
    Damaged,
}

fn classify(head: &[u8]) -> Head {
    match decode_header(head) {
        Some(g) => Head::Valid(g),
        None if head.iter().all(|&b| b == 0) => Head::Blank,
        None => Head::Damaged,
    }
}

/// The generation of a record whose checksum verifies, whatever it is.
fn record_generation(b: &[u8]) -> Option<u64> {
    (b.len() >= RECORD_LEN && crc32c::crc32c(&b[..64]) == u32_at(b, 64)).then(|| u64_at(b, 0))
}

/// The newest generation on disk in `file`: its header's (if it decodes) and that
/// of every record in its first [`LOAD_BYTES_MAX`] bytes whose checksum verifies
/// (nothing beyond is ever loaded, so nothing beyond can count as current).
async fn newest_generation(file: &File) -> io::Result<u64> {
    let head = file.read(0, HEADER_LEN as usize).await?;
    let mut newest = decode_header(&head).unwrap_or(0);
    let size = file.size().await?.min(LOAD_BYTES_MAX);
    let mut offset = HEADER_LEN;
    // Bounded by the size read above.
    while offset + RECORD_LEN as u64 <= size {
        let chunk = file.read(offset, READ_CHUNK).await?;
        if chunk.len() < RECORD_LEN {
            break;
        }
        for r in chunk.chunks_exact(RECORD_LEN) {
            if let Some(g) = record_generation(r) {
                newest = newest.max(g);
            }
        }
        offset += (chunk.len() / RECORD_LEN * RECORD_LEN) as u64;
    }
    Ok(newest)
}

/// The writer role of a [`PgLogFile`], given back when dropped (also when the
/// flush waiting on it is cancelled).
struct Writer<'a>(&'a PgLogFile);

impl Drop for Writer<'_> {
    fn drop(&mut self) {
        self.0.writing.set(false);
        self.0.writer_free.wake_all();
    }
}

impl PgLogFile {
    /// The log files of shard `shard` under data directory `root` (nothing is read
    /// until [`PgLogFile::load`]).
    pub fn new(fs: Fs, root: &Path, shard: u16) -> PgLogFile {
        PgLogFile {
            fs,
            root: root.to_path_buf(),
            dir: dir(root),
            paths: paths(root, shard),
            current: RefCell::new(None),
            pending: RefCell::new(HashMap::default()),
            pending_len: Cell::new(0),
            keep_per_pg: Cell::new(2048),
            compact_at: Cell::new(FILE_BYTES_MAX),
            writing: Cell::new(false),
            writer_free: super::wait_list::WaitList::default(),
            disabled: Cell::new(false),
            highest: Cell::new(0),
            scanned: [Cell::new(false), Cell::new(false)],
        }
    }

    /// Sets how many records of each group a compaction keeps.
    pub fn set_keep_per_pg(&self, n: usize) {
        self.keep_per_pg.set(n.max(1));
    }

    /// Records waiting for a FLUSH.
    pub fn pending(&self) -> usize {
        self.pending_len.get()
    }

    /// A write this copy applied: its record waits for the next FLUSH of its
    /// volume.
    pub fn note(&self, pg: PgId, entry: &LogEntry) {
        if entry.seq == 0 || self.disabled.get() {
            return;
        }
        self.push_pending(entry.object.volume, encode_record(pg, entry));
    }

    /// Queues a record for the next FLUSH of `volume` (bounded: see
    /// [`PENDING_MAX`]).
    fn push_pending(&self, volume: VolumeId, record: [u8; RECORD_LEN]) {
        let mut pending = self.pending.borrow_mut();
        if self.pending_len.get() >= PENDING_MAX {
            // Bounded: drop the oldest record of the fullest volume.
            if let Some(q) = pending.values_mut().max_by_key(|q| q.len())
                && q.pop_front().is_some()
            {
                self.pending_len.set(self.pending_len.get() - 1);
            }
        }
        pending.entry(volume).or_default().push_back(record);
        self.pending_len.set(self.pending_len.get() + 1);
    }

    /// This copy's bytes `[offset, offset+length)` of `object` (`length` 0:
    /// all of it) were replaced by another copy's (recovery, peering, a
    /// repair): the entries stored before no longer prove that this copy holds
    /// their ops there ([`crate::pg_log::PgLog::forget_proof`]). Without this
    /// record the proof came back at the next start: a primary again after it
    /// had been backfilled answered a client's retry of a zeroing it had
    /// applied before as a duplicate from the backfilled bytes, which lacked it
    /// (simulator seed 250636). Stable with the next FLUSH of the volume, like
    /// the bytes it describes.
    pub fn note_forgotten(&self, pg: PgId, object: ObjectId, offset: u32, length: u32) {
        if self.disabled.get() {
            return;
        }
        self.push_pending(object.volume, encode_forgotten(pg, object, offset, length));
    }

    /// Takes the records a FLUSH of `volume` (every volume: `None`) will make
    /// stable: call before the FLUSH syncs the data.
    pub fn take(&self, volume: Option<VolumeId>) -> Vec<[u8; RECORD_LEN]> {
        let mut pending = self.pending.borrow_mut();
        let mut out = Vec::new();
        match volume {
            Some(v) => {
                if let Some(q) = pending.remove(&v) {
                    out.extend(q);
                }
            }
            None => {
                for (_, q) in pending.drain() {
                    out.extend(q);
                }
            }
        }
        self.pending_len
            .set(self.pending_len.get().saturating_sub(out.len()));
        out
    }

    /// Records taken for a FLUSH that failed go back (they are still not stable).
    pub fn put_back(&self, records: Vec<[u8; RECORD_LEN]>) {
        // In reverse, so that each volume's queue keeps its order (oldest first).
        for r in records.into_iter().rev() {
            let volume = VolumeId(u64_at(&r, 32));
            self.pending
                .borrow_mut()
                .entry(volume)
                .or_default()
                .push_front(r);
            self.pending_len.set(self.pending_len.get() + 1);
        }
    }

    /// Stops writing the stable copy for the rest of this run (see `disabled`).
    pub fn disable(&self) {
        self.disabled.set(true);
        self.take(None);
    }

    async fn open(&self, index: usize) -> io::Result<File> {
        if self.fs.mkdir(&self.dir).await? {
            self.fs.sync_dir(&self.root).await?;
        }
        match self.fs.open(&self.paths[index], true).await? {
            Some((f, created)) => {
                if created {
                    self.fs.sync_dir(&self.dir).await?;
                }
                Ok(f)
            }
            None => Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{}: not created", self.paths[index].display()),
            )),
        }
    }

    /// Reads the stable records, oldest first, and makes the current file ready
    /// for appending. Missing files hold none. The file with the newest
    /// generation is current: a header's, or — for a header that does not
    /// decode — that of the file's first record, because a compaction writes and
    /// syncs all its records before it writes the header: a header torn while it
    /// was written, or corrupted since, still leaves whole records that say which
    /// generation the file holds. An all-zero header is a file whose first
    /// compaction never reached its header (its records may be partial): never
    /// current.
    pub async fn load(&self) -> io::Result<Vec<StoredEntry>> {
        // (generation, header valid, index, file): the highest wins, a valid
        // header over a recovered one of the same generation.
        let mut best: Option<(u64, bool, usize, File)> = None;
        for index in 0..2 {
            let Some((file, _)) = self.fs.open(&self.paths[index], false).await? else {
                continue;
            };
            let head = file.read(0, HEADER_LEN as usize).await?;
            let (generation, valid) = match classify(&head) {
                Head::Valid(g) => (g, true),
                Head::Blank => continue,
                Head::Damaged => {
                    let first = file.read(HEADER_LEN, RECORD_LEN).await?;
                    let found =
                        record_generation(&first).filter(|&g| decode_record(&first, g).is_some());
                    tracing::warn!(
                        file = %self.paths[index].display(),
                        generation = ?found,
                        "the placement-group log file's header does not decode (torn or \
                         corrupt); its generation is taken from its first record"
                    );
                    match found {
                        Some(g) => (g, false),
                        None => continue,
                    }
                }
            };
            self.highest.set(self.highest.get().max(generation));
            if best
                .as_ref()
                .is_none_or(|(bg, bv, _, _)| (generation, valid) > (*bg, *bv))
            {
                best = Some((generation, valid, index, file));
            }
        }
        let best = best.map(|(g, _, i, f)| (i, g, f));
        let Some((index, generation, file)) = best else {
            *self.current.borrow_mut() = None;
            return Ok(Vec::new());
        };
        let size = file.size().await?.min(LOAD_BYTES_MAX);
        let mut out = Vec::new();
        let mut end = HEADER_LEN;
        // Bounded by the size read above; stops at the first torn or older record.
        'read: while end + RECORD_LEN as u64 <= size {
            let chunk = file.read(end, READ_CHUNK).await?;
            if chunk.len() < RECORD_LEN {
                break;
            }
            for r in chunk.chunks_exact(RECORD_LEN) {
                match decode_record(r, generation) {
                    Some(e) => {
                        out.push(e);
                        end += RECORD_LEN as u64;
                    }
                    None => break 'read,
                }
            }
        }
        *self.current.borrow_mut() = Some(Current {
            index,
            file: Rc::new(file),
            generation,
            end,
        });
        Ok(out)
    }

    /// Makes `records` (taken by [`PgLogFile::take`] before the data they describe
    /// was synced, and synced since) stable: one synced write (`RWF_DSYNC`);
    /// compacts first when the current file is full.
    pub async fn persist(&self, records: &[[u8; RECORD_LEN]]) -> io::Result<()> {
        if records.is_empty() || self.disabled.get() {
            return Ok(());
        }
        // Bounded: each wake-up is a writer that finished.
        while self.writing.get() {
            self.writer_free.wait().await;
        }
        self.writing.set(true);
        let _writer = Writer(self);
        let full = self
            .current
            .borrow()
            .as_ref()
            .is_none_or(|c| c.end >= self.compact_at.get());
        if full {
            self.compact().await?;
        }
        let (file, generation, end) = match self.current.borrow().as_ref() {
            Some(c) => (c.file.clone(), c.generation, c.end),
            None => return Err(io::Error::other("pg log file not started")),
        };
        let mut buf = Vec::with_capacity(records.len() * RECORD_LEN);
        for r in records {
            buf.extend_from_slice(&seal(*r, generation));
        }
        // One synced write (RWF_DSYNC) to the open file: the records and nothing
        // else (no open, close or directory work per FLUSH).
        file.write(end, buf, Some(SyncKind::PgLog)).await?;
        if let Some(c) = self.current.borrow_mut().as_mut() {
            c.end = end + (records.len() * RECORD_LEN) as u64;
        }
        Ok(())
    }

    /// Writes the newest `keep_per_pg` records of every group of the current file
    /// (none: a first start) into the other file and makes it current.
    async fn compact(&self) -> io::Result<()> {
        let started = self.current.borrow().is_some();
        let kept: Vec<StoredEntry> = match started {
            true => {
                let mut per_pg: BTreeMap<u32, VecDeque<StoredEntry>> = BTreeMap::new();
                let keep = self.keep_per_pg.get();
                for e in self.load().await? {
                    let q = per_pg.entry(e.pg.0).or_default();
                    q.push_back(e);
                    if q.len() > keep {
                        q.pop_front();
                    }
                }
                per_pg.into_values().flatten().collect()
            }
            false => Vec::new(),
        };
        let (index, current) = match self.current.borrow().as_ref() {
            Some(c) => (1 - c.index, c.generation),
            None => (0, 0),
        };
        let file = self.open(index).await?;
        if !self.scanned[index].get() {
            // Records of an earlier use of any generation up to the newest in
            // this file (a compaction a crash interrupted, a header that did not
            // decode) must stay stale: the new generation goes above them all.
            let newest = newest_generation(&file).await?;
            self.highest.set(self.highest.get().max(newest));
            self.scanned[index].set(true);
        }
        let generation = self
            .highest
            .get()
            .max(current)
            .checked_add(1)
            .ok_or_else(|| io::Error::other("placement-group log generation exhausted"))?;
        // Taken before anything is written: a compaction that fails half way
        // leaves records of this generation, and the next one must go above.
        self.highest.set(generation);
        let mut buf = Vec::with_capacity(kept.len() * RECORD_LEN);
        for e in &kept {
            buf.extend_from_slice(&seal(encode_stored(e), generation));
        }
        if !buf.is_empty() {
            file.write(HEADER_LEN, buf, Some(SyncKind::PgLog)).await?;
        }
        // Last: the header makes the file current.
        file.write(0, encode_header(generation), Some(SyncKind::PgLog))
            .await?;
        let end = HEADER_LEN + (kept.len() * RECORD_LEN) as u64;
        self.compact_at.set(
            FILE_BYTES_MAX
                .max(end.saturating_mul(2))
                .min(LOAD_BYTES_MAX / 2),
        );
        *self.current.borrow_mut() = Some(Current {
            index,
            file: Rc::new(file),
            generation,
            end,
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::fs::SimFs;
    use flame_common::reactor::Reactor;

    fn entry(seq: u64, volume: u64, op_seq: u64) -> LogEntry {
        LogEntry {
            seq,
            op: OpId {
                session: 9,
                seq: op_seq,
            },
            interval: Epoch(0),
            object: ObjectId {
                volume: VolumeId(volume),
                index: seq % 3,
            },
            offset: 4096,
            length: 8192,
            kind: EntryKind::Write,
            applied: Vec::new(),
        }
    }

    fn run<F: std::future::Future + 'static>(f: F) -> F::Output {
        Reactor::new(Default::default())
            .unwrap()
            .block_on(f)
            .unwrap()
    }

    fn sim(root: &Path) -> (std::rc::Rc<SimFs>, Fs) {
        let sim = SimFs::new(&[root.to_path_buf()]);
        (sim.clone(), Fs::Sim(sim))
    }

    #[test]
    fn records_round_trip_and_a_torn_one_ends_the_log() {
        let e = entry(7, 1, 3);
        let sealed = seal(encode_record(PgId(5), &e), 4);
        assert_eq!(
            decode_record(&sealed, 4),
            Some(StoredEntry {
                pg: PgId(5),
                entry: e,
                proof_forgotten: false,
            })
        );
        assert_eq!(decode_record(&sealed, 5), None, "another generation");
        // A forgotten proof: object and range, nothing else.
        let o = ObjectId {
            volume: VolumeId(2),
            index: 9,
        };
        let f = decode_record(&seal(encode_forgotten(PgId(5), o, 4096, 8192), 4), 4).unwrap();
        assert!(f.proof_forgotten);
        assert_eq!(
            (f.pg, f.entry.object, f.entry.offset, f.entry.length),
            (PgId(5), o, 4096, 8192)
        );
        assert_eq!(
            seal(encode_stored(&f), 4),
            seal(encode_forgotten(PgId(5), o, 4096, 8192), 4)
        );
        let mut with_op = encode_forgotten(PgId(5), o, 0, 0);
        with_op[24] = 1;
        assert_eq!(
            decode_record(&seal(with_op, 4), 4),
            None,
            "a forgotten proof names no op"
        );
        let mut torn = sealed;
        torn[20] ^= 1;
        assert_eq!(decode_record(&torn, 4), None);
        assert_eq!(decode_record(&[0u8; RECORD_LEN], 0), None, "zeroes");
    }

    #[test]
    fn only_flushed_records_survive_and_a_flush_takes_only_its_volume() {
        let root = PathBuf::from("/sim/osd");
        let (sim, fs) = sim(&root);
        let log = PgLogFile::new(fs.clone(), &root, 0);
        run(async move {
            assert!(log.load().await.unwrap().is_empty());
            log.note(PgId(1), &entry(1, 1, 1));
            log.note(PgId(1), &entry(2, 2, 2));
            log.note(PgId(2), &entry(3, 1, 3));
            let v1 = log.take(Some(VolumeId(1)));
            assert_eq!(v1.len(), 2);
            assert_eq!(log.pending(), 1, "volume 2's record waits for its flush");
            log.persist(&v1).await.unwrap();
        });
        // Power cut: what was synced stays.
        sim.power_cut(&mut || false);
        let log = PgLogFile::new(fs, &root, 0);
        let got = run(async move { log.load().await.unwrap() });
        let seqs: Vec<u64> = got.iter().map(|e| e.entry.seq).collect();
        assert_eq!(seqs, vec![1, 3]);
        assert_eq!(got[1].pg, PgId(2));
    }

    /// Seed 250636: a proof forgotten when another copy's bytes replaced this
    /// one's is stable with the next flush of the volume, after the entries it
    /// covers, and a compaction keeps it after them.
    #[test]
    fn a_forgotten_proof_outlives_a_restart_and_a_compaction_in_order() {
        let root = PathBuf::from("/sim/osd");
        let (sim, fs) = sim(&root);
        let log = std::rc::Rc::new(PgLogFile::new(fs.clone(), &root, 1));
        log.set_keep_per_pg(2);
        let o = entry(1, 1, 1).object;
        let l = log.clone();
        run(async move {
            l.load().await.unwrap();
            l.note(PgId(1), &entry(1, 1, 1));
            l.note_forgotten(PgId(1), o, 0, 4096);
            let r = l.take(Some(VolumeId(1)));
            l.persist(&r).await.unwrap();
            l.compact().await.unwrap();
        });
        sim.power_cut(&mut || false);
        let log = PgLogFile::new(fs, &root, 1);
        let got = run(async move { log.load().await.unwrap() });
        let kinds: Vec<(u64, bool)> = got
            .iter()
            .map(|e| (e.entry.seq, e.proof_forgotten))
            .collect();
        assert_eq!(kinds, vec![(1, false), (0, true)]);
        assert_eq!(
            (
                got[1].entry.object,
                got[1].entry.offset,
                got[1].entry.length
            ),
            (o, 0, 4096)
        );
    }

    #[test]
    fn compaction_keeps_the_newest_records_of_every_group_and_survives_a_cut() {
        let root = PathBuf::from("/sim/osd");
        let (sim, fs) = sim(&root);
        let log = std::rc::Rc::new(PgLogFile::new(fs.clone(), &root, 3));
        log.set_keep_per_pg(2);
        let l = log.clone();
        run(async move {
            l.load().await.unwrap();
            for s in 1..=5 {
                l.note(PgId(1), &entry(s, 1, s));
                l.note(PgId(2), &entry(s + 100, 1, s));
            }
            let r = l.take(None);
            l.persist(&r).await.unwrap();
            l.compact().await.unwrap();
            l.note(PgId(1), &entry(6, 1, 6));
            let r = l.take(None);
            l.persist(&r).await.unwrap();
        });
        sim.power_cut(&mut || false);
        let log = PgLogFile::new(fs, &root, 3);
        let got = run(async move { log.load().await.unwrap() });
        let mut seqs: Vec<(u32, u64)> = got.iter().map(|e| (e.pg.0, e.entry.seq)).collect();
        seqs.sort();
        assert_eq!(seqs, vec![(1, 4), (1, 5), (1, 6), (2, 104), (2, 105)]);
    }

    #[test]
    fn records_put_back_after_a_failed_flush_keep_their_order() {
        let root = PathBuf::from("/sim/osd");
        let (_sim, fs) = sim(&root);
        let log = PgLogFile::new(fs, &root, 0);
        for s in 1..=3 {
            log.note(PgId(1), &entry(s, 1, s));
        }
        let taken = log.take(Some(VolumeId(1)));
        log.put_back(taken);
        log.note(PgId(1), &entry(4, 1, 4));
        let seqs: Vec<u64> = log
            .take(None)
            .iter()
            .filter_map(|r| decode_record(&seal(*r, 1), 1).map(|e| e.entry.seq))
            .collect();
        assert_eq!(seqs, vec![1, 2, 3, 4]);
    }

    #[test]
    fn a_disabled_log_writes_nothing() {
        // The stable copy could not be read: a new file would get generation 1
        // and lose to the unread one at the next start, so nothing is written.
        let root = PathBuf::from("/sim/osd");
        let (_sim, fs) = sim(&root);
        let log = std::rc::Rc::new(PgLogFile::new(fs.clone(), &root, 0));
        log.disable();
        log.note(PgId(1), &entry(1, 1, 1));
        assert_eq!(log.pending(), 0);
        let l = log.clone();
        run(async move {
            l.persist(&[encode_record(PgId(1), &entry(2, 1, 2))])
                .await
                .unwrap()
        });
        let fresh = PgLogFile::new(fs, &root, 0);
        assert!(run(async move { fresh.load().await.unwrap() }).is_empty());
    }

    #[test]
    fn the_pending_records_are_bounded() {
        let root = PathBuf::from("/sim/osd");
        let (_sim, fs) = sim(&root);
        let log = PgLogFile::new(fs, &root, 0);
        for s in 1..=(PENDING_MAX as u64 + 10) {
            log.note(PgId(1), &entry(s, 1, s));
        }
        assert_eq!(log.pending(), PENDING_MAX);
        let r = log.take(None);
        assert_eq!(
            decode_record(&seal(r[0], 1), 1).map(|e| e.entry.seq),
            Some(11)
        );
    }

    /// Overwrites the first 4 KiB of `path` with `head` (stable).
    fn set_header(fs: &Fs, path: &Path, head: Vec<u8>) {
        let fs = fs.clone();
        let path = path.to_path_buf();
        run(async move {
            let (file, _) = fs.open(&path, false).await.unwrap().unwrap();
            file.write(0, head, Some(SyncKind::PgLog)).await.unwrap();
        });
    }

    /// The header of a file, garbled in its second half: torn by a power cut
    /// while a compaction wrote it, or corrupted by the medium since.
    fn garbled(sim: &SimFs, path: &Path) -> Vec<u8> {
        let mut head = sim.contents(path).unwrap()[..HEADER_LEN as usize].to_vec();
        for b in &mut head[2048..] {
            *b ^= 0x5a;
        }
        head
    }

    fn seqs(log: PgLogFile) -> Vec<u64> {
        run(async move { log.load().await.unwrap() })
            .iter()
            .map(|e| e.entry.seq)
            .collect()
    }

    /// The current file's header did not decode: the older file was taken as
    /// current (the newer records lost), and the next compaction reused the
    /// damaged file's generation.
    #[test]
    fn a_current_file_whose_header_does_not_decode_stays_current() {
        let root = PathBuf::from("/sim/osd");
        let (sim, fs) = sim(&root);
        let log = std::rc::Rc::new(PgLogFile::new(fs.clone(), &root, 0));
        let l = log.clone();
        run(async move {
            l.load().await.unwrap();
            for s in 1..=2 {
                l.note(PgId(1), &entry(s, 1, s));
            }
            let r = l.take(None);
            l.persist(&r).await.unwrap(); // .0, generation 1
            l.compact().await.unwrap(); // .1, generation 2
            l.note(PgId(1), &entry(3, 1, 3));
            let r = l.take(None);
            l.persist(&r).await.unwrap();
        });
        let [p0, p1] = paths(&root, 0);
        set_header(&fs, &p1, garbled(&sim, &p1));
        assert_eq!(seqs(PgLogFile::new(fs.clone(), &root, 0)), vec![1, 2, 3]);
        // It takes appends, and the next compaction goes above its generation.
        let log = std::rc::Rc::new(PgLogFile::new(fs.clone(), &root, 0));
        let l = log.clone();
        run(async move {
            l.load().await.unwrap();
            l.note(PgId(1), &entry(4, 1, 4));
            let r = l.take(None);
            l.persist(&r).await.unwrap();
            l.compact().await.unwrap();
        });
        let head = sim.contents(&p0).unwrap();
        assert_eq!(decode_header(&head), Some(3));
        assert_eq!(seqs(PgLogFile::new(fs, &root, 0)), vec![1, 2, 3, 4]);
    }

    /// A compaction that a crash stopped after its records were synced and
    /// before its header was written leaves records of the next generation in
    /// the file it wrote. The next compaction reused that generation: when it
    /// kept fewer records, the stale ones after them counted as current.
    #[test]
    fn an_unfinished_compaction_never_lends_its_records_to_the_next() {
        let root = PathBuf::from("/sim/osd");
        let (sim, fs) = sim(&root);
        let log = std::rc::Rc::new(PgLogFile::new(fs.clone(), &root, 0));
        let l = log.clone();
        run(async move {
            l.load().await.unwrap();
            for s in 1..=4 {
                l.note(PgId(1), &entry(s, 1, s));
            }
            let r = l.take(None);
            l.persist(&r).await.unwrap(); // .0, generation 1
            l.compact().await.unwrap(); // .1, generation 2, all four records
        });
        // The crash came before .1's header: it is still all zero.
        let [_, p1] = paths(&root, 0);
        set_header(&fs, &p1, vec![0; HEADER_LEN as usize]);
        assert_eq!(seqs(PgLogFile::new(fs.clone(), &root, 0)), vec![1, 2, 3, 4]);
        let log = std::rc::Rc::new(PgLogFile::new(fs.clone(), &root, 0));
        log.set_keep_per_pg(1);
        let l = log.clone();
        run(async move {
            l.load().await.unwrap();
            l.compact().await.unwrap(); // .1 again, keeping only seq 4
        });
        let head = sim.contents(&p1).unwrap();
        assert_eq!(decode_header(&head), Some(3), "above the unfinished 2");
        assert_eq!(seqs(PgLogFile::new(fs.clone(), &root, 0)), vec![4]);
        // Both headers unreadable: the records still say which file is current.
        let [p0, _] = paths(&root, 0);
        set_header(&fs, &p0, garbled(&sim, &p0));
        set_header(&fs, &p1, garbled(&sim, &p1));
        assert_eq!(seqs(PgLogFile::new(fs, &root, 0)), vec![4]);
    }
}
