//! The restart doubt's record on disk: which objects a restart left this OSD in
//! doubt about ([`crate::restart_suspects`]) and no primary has settled yet.
//!
//! Start-up recovery ([`super::recover`]) learns the doubt from the intent
//! journals and then resets them. Kept only in memory, the doubt died with the
//! process: a second restart before a primary settled it found empty journals,
//! and the copy that had lost acknowledged writes in the first power cut came
//! back sure of itself — log catch-up then copied only what it missed while down,
//! and it kept (and could serve) blocks a write old (simulator seeds 369, 414).
//! So the doubt is written here, synced, before the journals are reset; start-up
//! reads it back and adds what the journals name; and it is rewritten (smaller)
//! as primaries settle groups. A record that still names a settled group is
//! safe — it costs a comparison after the next restart — so it is rewritten
//! lazily, never on the I/O path.
//!
//! Two files, `restart-doubt.0` and `.1`, each one whole record with its own
//! crc; a rewrite goes to the file the newest valid one is not, so a power cut
//! that tears it leaves the previous record (a superset of what a settlement
//! removed; and start-up, which adds, resets the journals only after its record
//! is stable). Byte layout in docs/on-disk-format.md.
//!
//! The record also names the boot (the kernel's boot id, [`Fs::boot_id`]) of
//! the process that wrote it — the one whose writes the journals name next. A
//! start-up in that same boot knows the machine did not reboot since those
//! writes: the page cache kept them, and the doubt they leave is only a crash's
//! ([`Cause::Crash`]); in another boot (or not knowing) it is a reboot's. Each
//! object keeps its cause across restarts (seed 58).

use super::fs::{BootId, Fs};
use crate::metrics::SyncKind;
pub use crate::restart_suspects::Cause;
use flame_common::ids::{ObjectId, PgId, VolumeId};
use std::collections::BTreeMap;
use std::io;
use std::path::{Path, PathBuf};

/// First bytes of a record.
pub const DOUBT_MAGIC: &[u8; 8] = b"FLAMEDBT";
/// The layout this build writes: version 3, with the boot id and a cause per
/// entry. Version 2 (the store format's number, which the first records
/// carried: no boot id, every entry a reboot's) is still read.
pub const RECORD_VERSION: u32 = 3;
/// Bytes before the entries: magic, version, count, generation, boot id.
const HEAD_LEN: usize = 40;
/// Version 2's.
const HEAD_LEN_V2: usize = 24;
/// Bytes of one entry: the group (u32), the volume (u64), the object's index
/// (u64), the cause (u8: 0 a crash's, 1 a reboot's).
const ENTRY_LEN: usize = 21;
/// Version 2's (no cause).
const ENTRY_LEN_V2: usize = 20;
/// Most objects one record names. Each restart adds at most what the shards'
/// journals name (about 70 000 each); a record at this bound is 20 MiB.
pub const DOUBT_OBJECTS_MAX: usize = 1 << 20;

/// The objects in doubt, per group, with their causes.
pub type Doubt = BTreeMap<PgId, BTreeMap<ObjectId, Cause>>;

/// Adds `object` of `pg` to `doubt` for `cause` (a reboot's doubt wins).
pub fn add(doubt: &mut Doubt, pg: PgId, object: ObjectId, cause: Cause) {
    let c = doubt.entry(pg).or_default().entry(object).or_insert(cause);
    *c = (*c).max(cause);
}

/// How many objects `doubt` names.
pub fn count(doubt: &Doubt) -> usize {
    doubt.values().map(BTreeMap::len).sum()
}

/// A record's contents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    /// Its generation.
    pub generation: u64,
    /// The boot its writer ran in (`None`: unknown, or a version 2 record).
    pub boot: Option<BootId>,
    /// Its doubt.
    pub doubt: Doubt,
}

/// The marker a process leaves under the data directory `root` when a sync
/// failed (a writeback error: the kernel may have dropped pages it could not
/// write, and reports that once) before it stops: the next start-up in the
/// same boot then takes the journals' doubt for a reboot's, not a crash's. The
/// page cache keeps it without a sync, which is all it needs: after a reboot
/// the boot id says as much.
pub fn writeback_failed_path(root: &Path) -> PathBuf {
    root.join("writeback-failed")
}

/// Leaves the [`writeback_failed_path`] marker (best effort, blocking: the
/// process is stopping). Not synced: see there.
pub fn mark_writeback_failed(root: &Path) {
    let path = writeback_failed_path(root);
    if let Err(e) = std::fs::write(
        &path,
        b"a sync failed; see restart-doubt in docs/on-disk-format.md\n",
    ) {
        tracing::error!(path = %path.display(), "cannot leave the writeback-failure marker: {e}");
    }
}

/// The two files of the record under the data directory `root`.
pub fn record_paths(root: &Path) -> [PathBuf; 2] {
    [root.join("restart-doubt.0"), root.join("restart-doubt.1")]
}

/// One record's bytes (an unknown boot is written as zeroes).
pub fn encode(generation: u64, boot: Option<BootId>, doubt: &Doubt) -> Vec<u8> {
    let count = count(doubt);
    let mut b = Vec::with_capacity(HEAD_LEN + count * ENTRY_LEN + 4);
    b.extend_from_slice(DOUBT_MAGIC);
    b.extend_from_slice(&RECORD_VERSION.to_le_bytes());
    b.extend_from_slice(&(count as u32).to_le_bytes());
    b.extend_from_slice(&generation.to_le_bytes());
    b.extend_from_slice(&boot.map_or([0; 16], |id| id.0));
    for (pg, objects) in doubt {
        for (o, cause) in objects {
            b.extend_from_slice(&pg.0.to_le_bytes());
            b.extend_from_slice(&o.volume.0.to_le_bytes());
            b.extend_from_slice(&o.index.to_le_bytes());
            b.push(match cause {
                Cause::Crash => 0,
                Cause::Reboot => 1,
            });
        }
    }
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// A record's contents; `None` if `b` is not a whole record (torn, never
/// written, another file, a count beyond [`DOUBT_OBJECTS_MAX`], a cause byte
/// other than 0 or 1). Bytes after the record are ignored (a shorter record
/// written over a longer one).
pub fn decode(b: &[u8]) -> Option<Decoded> {
    if b.len() < HEAD_LEN_V2 + 4 || &b[0..8] != DOUBT_MAGIC {
        return None;
    }
    let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    let u64_at = |o: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[o..o + 8]);
        u64::from_le_bytes(a)
    };
    let (head, entry) = match u32_at(8) {
        2 => (HEAD_LEN_V2, ENTRY_LEN_V2),
        RECORD_VERSION => (HEAD_LEN, ENTRY_LEN),
        _ => return None,
    };
    let count = u32_at(12) as usize;
    if count > DOUBT_OBJECTS_MAX {
        return None;
    }
    let end = head + count * entry;
    if b.len() < end + 4 || crc32c::crc32c(&b[..end]) != u32_at(end) {
        return None;
    }
    let boot = (head == HEAD_LEN)
        .then(|| {
            let mut id = [0u8; 16];
            id.copy_from_slice(&b[24..40]);
            id
        })
        .filter(|id| *id != [0; 16])
        .map(BootId);
    let mut doubt = Doubt::new();
    for e in b[head..end].chunks_exact(entry) {
        let pg = PgId(u32::from_le_bytes([e[0], e[1], e[2], e[3]]));
        let mut v = [0u8; 8];
        v.copy_from_slice(&e[4..12]);
        let mut i = [0u8; 8];
        i.copy_from_slice(&e[12..20]);
        let cause = match e.get(20) {
            None | Some(1) => Cause::Reboot,
            Some(0) => Cause::Crash,
            Some(_) => return None,
        };
        let object = ObjectId {
            volume: VolumeId(u64::from_le_bytes(v)),
            index: u64::from_le_bytes(i),
        };
        add(&mut doubt, pg, object, cause);
    }
    Some(Decoded {
        generation: u64_at(16),
        boot,
        doubt,
    })
}

/// Of the two files' contents, the valid record with the highest generation,
/// and which file (0 or 1) holds it.
pub fn newest(files: [Option<&[u8]>; 2]) -> Option<(Decoded, usize)> {
    let mut best: Option<(Decoded, usize)> = None;
    for (i, b) in files.iter().enumerate() {
        if let Some(d) = b.and_then(decode)
            && best
                .as_ref()
                .is_none_or(|(bd, _)| d.generation > bd.generation)
        {
            best = Some((d, i));
        }
    }
    best
}

/// The record on disk, read whole.
#[derive(Debug, Default)]
pub struct Stored {
    /// The newest valid record's generation (0: none).
    pub generation: u64,
    /// The boot its writer ran in (`None`: unknown, or no record).
    pub boot: Option<BootId>,
    /// Its doubt (empty: none).
    pub doubt: Doubt,
    /// The file the next record goes to (the other one than the newest).
    pub next_file: usize,
}

/// Reads the record under `root`. Neither file valid (never written, or both
/// damaged — a rewrite only ever tears one) reads as no doubt; a damaged file
/// beside a valid one is the torn rewrite, and is overwritten next.
pub async fn read(fs: &Fs, root: &Path) -> io::Result<Stored> {
    let paths = record_paths(root);
    let mut contents: [Option<Vec<u8>>; 2] = [None, None];
    for (i, p) in paths.iter().enumerate() {
        if let Some((file, _)) = fs.open(p, false).await? {
            let size = file.size().await?;
            let max = (HEAD_LEN + DOUBT_OBJECTS_MAX * ENTRY_LEN + 4) as u64;
            let len = size.min(max) as usize;
            contents[i] = Some(if len == 0 {
                Vec::new()
            } else {
                file.read(0, len).await?
            });
        }
    }
    let damaged: Vec<&Path> = paths
        .iter()
        .zip(&contents)
        // An empty file is one reserved but never written, not a damaged one.
        .filter(|(_, c)| {
            c.as_ref()
                .is_some_and(|c| !c.is_empty() && decode(c).is_none())
        })
        .map(|(p, _)| p.as_path())
        .collect();
    let found = newest([contents[0].as_deref(), contents[1].as_deref()]);
    if damaged.len() == 2 {
        tracing::error!(
            files = ?damaged,
            "neither restart-doubt record decodes (both damaged: a rewrite tears at most one); \
             what earlier restarts left in doubt is unknown, only the intent journals' doubt counts"
        );
    }
    Ok(match found {
        Some((d, i)) => Stored {
            generation: d.generation,
            boot: d.boot,
            doubt: d.doubt,
            next_file: 1 - i,
        },
        None => Stored::default(),
    })
}

/// Writes `doubt` as the record of `generation`, by a process of boot `boot`,
/// to file `file` (0 or 1) under `root`, synced, its name made durable if it is
/// new.
pub async fn write(
    fs: &Fs,
    root: &Path,
    file: usize,
    generation: u64,
    boot: Option<BootId>,
    doubt: &Doubt,
) -> io::Result<()> {
    let count = count(doubt);
    if count > DOUBT_OBJECTS_MAX {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{count} objects in restart doubt, more than a record holds \
                 ({DOUBT_OBJECTS_MAX}); mark this OSD out so it is recovered whole"
            ),
        ));
    }
    let path = &record_paths(root)[file & 1];
    let Some((f, created)) = fs.open(path, true).await? else {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("cannot create {}", path.display()),
        ));
    };
    f.write(0, encode(generation, boot, doubt), Some(SyncKind::Journal))
        .await?;
    if created {
        fs.sync_dir(root).await?;
    }
    Ok(())
}

/// Record entries each record file has room for per shard, reserved up front:
/// what the shard's journal names at most, twice (room for the doubt earlier
/// restarts left beside it).
const RESERVED_ENTRIES_PER_SHARD: usize = 2 * super::journal::JOURNAL_ENTRIES_MAX;

/// Bytes of each record file allocated up front for an OSD of `shards` shards:
/// a record of [`RESERVED_ENTRIES_PER_SHARD`] entries per shard, at most one of
/// [`DOUBT_OBJECTS_MAX`].
pub fn reserve_bytes(shards: usize) -> u64 {
    let entries = shards
        .max(1)
        .saturating_mul(RESERVED_ENTRIES_PER_SHARD)
        .min(DOUBT_OBJECTS_MAX);
    (HEAD_LEN + entries * ENTRY_LEN + 4) as u64
}

/// Allocates [`reserve_bytes`] in both record files under `root` (creating
/// them empty; an empty file reads as no record), so that start-up writes the
/// record on a full disk too: a start-up that could not write it used to serve
/// anyway, and a second restart before there was room forgot the first one's
/// doubt — the copy came back sure of blocks a failed write had left a write
/// old on it (simulator seed 200214). Best effort: a disk already full leaves
/// the reservation as it was (the record write says whether it fits).
pub async fn reserve(fs: &Fs, root: &Path, shards: usize) -> io::Result<()> {
    let bytes = reserve_bytes(shards);
    let mut created_any = false;
    for path in &record_paths(root) {
        let Some((f, created)) = fs.open(path, true).await? else {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("cannot create {}", path.display()),
            ));
        };
        created_any |= created;
        match f.allocate(0, bytes).await {
            Ok(()) => {}
            Err(e) if is_full(&e) => {
                tracing::warn!(
                    path = %path.display(),
                    bytes,
                    "cannot reserve room for the restart-doubt record (disk full)"
                );
            }
            Err(e) => return Err(e),
        }
    }
    if created_any {
        fs.sync_dir(root).await?;
    }
    Ok(())
}

/// Whether `e` says the file system (or the user's quota) is full.
pub fn is_full(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT))
        || e.kind() == io::ErrorKind::StorageFull
        || e.kind() == io::ErrorKind::QuotaExceeded
}

/// Rewrites of the record one [`DoubtRecord::persist`] call makes at most (more
/// settlements meanwhile wait for the next call).
const PERSIST_ROUNDS_MAX: u32 = 4;

/// The restart doubt of this OSD that no primary has settled yet, shared by its
/// shards, with what of it is on disk. Made by start-up recovery
/// ([`super::recover`]), which has written it; shards settle groups from it
/// ([`DoubtRecord::settle`]) and any shard rewrites the record later
/// ([`DoubtRecord::persist`]).
#[derive(Debug)]
pub struct DoubtRecord {
    /// Where the data directory is.
    root: PathBuf,
    /// The boot this process runs in (written into every record).
    boot: Option<BootId>,
    inner: parking_lot::Mutex<RecordState>,
}

#[derive(Debug)]
struct RecordState {
    doubt: Doubt,
    /// The generation of the newest record on disk.
    generation: u64,
    /// The file the next record goes to.
    next_file: usize,
    /// Bumped by every settlement.
    version: u64,
    /// The version the newest record on disk holds.
    persisted: u64,
    /// A shard is writing the record now.
    writing: bool,
}

impl DoubtRecord {
    /// The doubt `doubt` under `root`, of a process in boot `boot`, whose
    /// newest record on disk (of `generation`) holds `doubt` and `boot`, the
    /// next going to file `next_file`.
    pub fn new(
        root: &Path,
        boot: Option<BootId>,
        doubt: Doubt,
        generation: u64,
        next_file: usize,
    ) -> DoubtRecord {
        DoubtRecord {
            root: root.to_path_buf(),
            boot,
            inner: parking_lot::Mutex::new(RecordState {
                doubt,
                generation,
                next_file: next_file & 1,
                version: 0,
                persisted: 0,
                writing: false,
            }),
        }
    }

    /// No doubt and nothing on disk (tests, and shards built without a store
    /// recovery).
    pub fn none(root: &Path) -> DoubtRecord {
        DoubtRecord::new(root, None, Doubt::new(), 0, 0)
    }

    /// Every object in doubt, group by group.
    pub fn objects(&self) -> Vec<(PgId, ObjectId)> {
        self.entries()
            .into_iter()
            .map(|(pg, o, _)| (pg, o))
            .collect()
    }

    /// Every object in doubt with its cause, group by group.
    pub fn entries(&self) -> Vec<(PgId, ObjectId, Cause)> {
        let s = self.inner.lock();
        s.doubt
            .iter()
            .flat_map(|(pg, objects)| objects.iter().map(move |(o, c)| (*pg, *o, *c)))
            .collect()
    }

    /// The doubt about `pg` is settled: the next record leaves it out.
    pub fn settle(&self, pg: PgId) {
        let mut s = self.inner.lock();
        if s.doubt.remove(&pg).is_some() {
            s.version += 1;
        }
    }

    /// Whether settlements wait to be written (the record on disk still names
    /// groups settled since: more doubt than there is, never less).
    pub fn stale(&self) -> bool {
        let s = self.inner.lock();
        s.persisted != s.version
    }

    /// Writes the record again if settlements changed it, unless another shard
    /// is writing it (that one writes the newest version before it stops).
    pub async fn persist(&self, fs: &Fs) -> io::Result<()> {
        // Bounded: one write a round.
        for _ in 0..PERSIST_ROUNDS_MAX {
            let (doubt, version, generation, file) = {
                let mut s = self.inner.lock();
                if s.writing || s.persisted == s.version {
                    return Ok(());
                }
                s.writing = true;
                (s.doubt.clone(), s.version, s.generation + 1, s.next_file)
            };
            let written = write(fs, &self.root, file, generation, self.boot, &doubt).await;
            let mut s = self.inner.lock();
            s.writing = false;
            written?;
            debug_assert!(version <= s.version, "versions only grow");
            s.generation = generation;
            s.next_file = 1 - file;
            s.persisted = version;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: u64, i: u64) -> ObjectId {
        ObjectId {
            volume: VolumeId(v),
            index: i,
        }
    }

    fn doubt(items: &[(u32, u64, u64)]) -> Doubt {
        let mut d = Doubt::new();
        for &(pg, v, i) in items {
            add(&mut d, PgId(pg), obj(v, i), Cause::Reboot);
        }
        d
    }

    const BOOT: Option<BootId> = Some(BootId([7; 16]));

    fn decoded(generation: u64, boot: Option<BootId>, doubt: Doubt) -> Option<Decoded> {
        Some(Decoded {
            generation,
            boot,
            doubt,
        })
    }

    #[test]
    fn a_record_reads_back_as_written() {
        let mut d = doubt(&[(3, 1, 7), (3, 1, 2), (9, 2, 0)]);
        add(&mut d, PgId(9), obj(2, 1), Cause::Crash);
        // A reboot's doubt wins over a crash's.
        add(&mut d, PgId(3), obj(1, 7), Cause::Crash);
        assert_eq!(d[&PgId(3)][&obj(1, 7)], Cause::Reboot);
        assert_eq!(decode(&encode(5, BOOT, &d)), decoded(5, BOOT, d.clone()));
        assert_eq!(decode(&encode(5, None, &d)), decoded(5, None, d));
        assert_eq!(
            decode(&encode(1, BOOT, &Doubt::new())),
            decoded(1, BOOT, Doubt::new())
        );
    }

    /// The first records (version 2, the store format's number): no boot id,
    /// no causes — every entry a reboot's.
    #[test]
    fn a_version_2_record_reads_as_a_reboots_doubt_of_an_unknown_boot() {
        let mut b = Vec::new();
        b.extend_from_slice(DOUBT_MAGIC);
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&9u64.to_le_bytes());
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes());
        b.extend_from_slice(&7u64.to_le_bytes());
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        assert_eq!(decode(&b), decoded(9, None, doubt(&[(3, 1, 7)])));
    }

    #[test]
    fn a_torn_or_foreign_record_is_not_read() {
        let mut d = doubt(&[(3, 1, 7), (4, 1, 8)]);
        add(&mut d, PgId(4), obj(1, 9), Cause::Crash);
        let b = encode(5, BOOT, &d);
        for cut in 0..b.len() {
            assert_eq!(decode(&b[..cut]), None, "cut at {cut}");
        }
        for byte in 0..b.len() {
            let mut c = b.clone();
            c[byte] ^= 0x10;
            assert_eq!(decode(&c), None, "byte {byte} flipped");
        }
        // A shorter record written over a longer one: the tail is ignored.
        let mut over = encode(6, BOOT, &doubt(&[(1, 1, 1)]));
        over.extend_from_slice(&b[over.len()..]);
        assert_eq!(decode(&over), decoded(6, BOOT, doubt(&[(1, 1, 1)])));
        // A cause byte that is neither (its crc made right): refused.
        let mut odd = encode(6, BOOT, &doubt(&[(1, 1, 1)]));
        let end = odd.len() - 4;
        odd[end - 1] = 2;
        let crc = crc32c::crc32c(&odd[..end]);
        odd[end..].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(decode(&odd), None);
    }

    #[test]
    fn a_count_beyond_the_bound_is_refused_before_use() {
        let mut b = encode(1, BOOT, &Doubt::new());
        b[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&b), None);
    }

    #[test]
    fn the_newest_valid_record_wins_and_the_next_goes_to_the_other_file() {
        let old = encode(4, BOOT, &doubt(&[(1, 1, 1), (2, 1, 2)]));
        let new = encode(5, BOOT, &doubt(&[(1, 1, 1)]));
        let torn = &new[..new.len() - 1];
        let at = |f: [Option<&[u8]>; 2]| newest(f).map(|(d, i)| (d.generation, i));
        assert_eq!(at([Some(&old), Some(&new)]), Some((5, 1)));
        assert_eq!(at([Some(&new), Some(&old)]), Some((5, 0)));
        // The rewrite tore: the record before it (a superset) stands.
        assert_eq!(at([Some(&old), Some(torn)]), Some((4, 0)));
        assert_eq!(newest([None, None]), None);
    }
}
