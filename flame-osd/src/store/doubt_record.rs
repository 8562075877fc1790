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

use super::fs::Fs;
use crate::metrics::SyncKind;
use flame_common::ids::{ObjectId, PgId, VolumeId};
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};

/// First bytes of a record.
pub const DOUBT_MAGIC: &[u8; 8] = b"FLAMEDBT";
/// Bytes before the entries: magic, format, count, generation.
const HEAD_LEN: usize = 24;
/// Bytes of one entry: the group (u32), the volume (u64), the object's index (u64).
const ENTRY_LEN: usize = 20;
/// Most objects one record names. Each restart adds at most what the shards'
/// journals name (about 70 000 each); a record at this bound is 20 MiB.
pub const DOUBT_OBJECTS_MAX: usize = 1 << 20;

/// The objects in doubt, per group.
pub type Doubt = BTreeMap<PgId, BTreeSet<ObjectId>>;

/// The two files of the record under the data directory `root`.
pub fn record_paths(root: &Path) -> [PathBuf; 2] {
    [root.join("restart-doubt.0"), root.join("restart-doubt.1")]
}

/// One record's bytes.
pub fn encode(generation: u64, doubt: &Doubt) -> Vec<u8> {
    let count: usize = doubt.values().map(BTreeSet::len).sum();
    let mut b = Vec::with_capacity(HEAD_LEN + count * ENTRY_LEN + 4);
    b.extend_from_slice(DOUBT_MAGIC);
    b.extend_from_slice(&super::layout::FORMAT.to_le_bytes());
    b.extend_from_slice(&(count as u32).to_le_bytes());
    b.extend_from_slice(&generation.to_le_bytes());
    for (pg, objects) in doubt {
        for o in objects {
            b.extend_from_slice(&pg.0.to_le_bytes());
            b.extend_from_slice(&o.volume.0.to_le_bytes());
            b.extend_from_slice(&o.index.to_le_bytes());
        }
    }
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// A record's generation and doubt; `None` if `b` is not a whole record (torn,
/// never written, another file, a count beyond [`DOUBT_OBJECTS_MAX`]). Bytes
/// after the record are ignored (a shorter record written over a longer one).
pub fn decode(b: &[u8]) -> Option<(u64, Doubt)> {
    if b.len() < HEAD_LEN + 4 || &b[0..8] != DOUBT_MAGIC {
        return None;
    }
    let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    let u64_at = |o: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[o..o + 8]);
        u64::from_le_bytes(a)
    };
    if u32_at(8) != super::layout::FORMAT {
        return None;
    }
    let count = u32_at(12) as usize;
    if count > DOUBT_OBJECTS_MAX {
        return None;
    }
    let end = HEAD_LEN + count * ENTRY_LEN;
    if b.len() < end + 4 || crc32c::crc32c(&b[..end]) != u32_at(end) {
        return None;
    }
    let mut doubt = Doubt::new();
    for e in b[HEAD_LEN..end].chunks_exact(ENTRY_LEN) {
        let pg = PgId(u32::from_le_bytes([e[0], e[1], e[2], e[3]]));
        let mut v = [0u8; 8];
        v.copy_from_slice(&e[4..12]);
        let mut i = [0u8; 8];
        i.copy_from_slice(&e[12..20]);
        doubt.entry(pg).or_default().insert(ObjectId {
            volume: VolumeId(u64::from_le_bytes(v)),
            index: u64::from_le_bytes(i),
        });
    }
    Some((u64_at(16), doubt))
}

/// Of the two files' contents, the valid record with the highest generation:
/// its generation, its doubt, and which file (0 or 1) holds it.
pub fn newest(files: [Option<&[u8]>; 2]) -> Option<(u64, Doubt, usize)> {
    let mut best: Option<(u64, Doubt, usize)> = None;
    for (i, b) in files.iter().enumerate() {
        if let Some((g, d)) = b.and_then(decode)
            && best.as_ref().is_none_or(|(bg, _, _)| g > *bg)
        {
            best = Some((g, d, i));
        }
    }
    best
}

/// The record on disk, read whole.
#[derive(Debug, Default)]
pub struct Stored {
    /// The newest valid record's generation (0: none).
    pub generation: u64,
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
        .filter(|(_, c)| c.as_ref().is_some_and(|c| decode(c).is_none()))
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
        Some((generation, doubt, i)) => Stored {
            generation,
            doubt,
            next_file: 1 - i,
        },
        None => Stored::default(),
    })
}

/// Writes `doubt` as the record of `generation` to file `file` (0 or 1) under
/// `root`, synced, its name made durable if it is new.
pub async fn write(
    fs: &Fs,
    root: &Path,
    file: usize,
    generation: u64,
    doubt: &Doubt,
) -> io::Result<()> {
    let count: usize = doubt.values().map(BTreeSet::len).sum();
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
    f.write(0, encode(generation, doubt), Some(SyncKind::Journal))
        .await?;
    if created {
        fs.sync_dir(root).await?;
    }
    Ok(())
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
    /// The doubt `doubt` under `root`, whose newest record on disk is of
    /// `generation`, the next going to file `next_file`; `on_disk`: that record
    /// holds `doubt` (else [`DoubtRecord::persist`] writes it).
    pub fn new(
        root: &Path,
        doubt: Doubt,
        generation: u64,
        next_file: usize,
        on_disk: bool,
    ) -> DoubtRecord {
        DoubtRecord {
            root: root.to_path_buf(),
            inner: parking_lot::Mutex::new(RecordState {
                doubt,
                generation,
                next_file: next_file & 1,
                version: u64::from(!on_disk),
                persisted: 0,
                writing: false,
            }),
        }
    }

    /// No doubt and nothing on disk (tests, and shards built without a store
    /// recovery).
    pub fn none(root: &Path) -> DoubtRecord {
        DoubtRecord::new(root, Doubt::new(), 0, 0, true)
    }

    /// Every object in doubt, group by group.
    pub fn objects(&self) -> Vec<(PgId, ObjectId)> {
        let s = self.inner.lock();
        s.doubt
            .iter()
            .flat_map(|(pg, objects)| objects.iter().map(move |o| (*pg, *o)))
            .collect()
    }

    /// The doubt about `pg` is settled: the next record leaves it out.
    pub fn settle(&self, pg: PgId) {
        let mut s = self.inner.lock();
        if s.doubt.remove(&pg).is_some() {
            s.version += 1;
        }
    }

    /// Whether settlements (or a start-up's doubt a full disk refused) wait to
    /// be written.
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
            let written = write(fs, &self.root, file, generation, &doubt).await;
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
            d.entry(PgId(pg)).or_default().insert(obj(v, i));
        }
        d
    }

    #[test]
    fn a_record_reads_back_as_written() {
        let d = doubt(&[(3, 1, 7), (3, 1, 2), (9, 2, 0)]);
        assert_eq!(decode(&encode(5, &d)), Some((5, d)));
        assert_eq!(decode(&encode(1, &Doubt::new())), Some((1, Doubt::new())));
    }

    #[test]
    fn a_torn_or_foreign_record_is_not_read() {
        let b = encode(5, &doubt(&[(3, 1, 7), (4, 1, 8)]));
        for cut in 0..b.len() {
            assert_eq!(decode(&b[..cut]), None, "cut at {cut}");
        }
        for byte in 0..b.len() {
            let mut c = b.clone();
            c[byte] ^= 0x10;
            assert_eq!(decode(&c), None, "byte {byte} flipped");
        }
        // A shorter record written over a longer one: the tail is ignored.
        let mut over = encode(6, &doubt(&[(1, 1, 1)]));
        over.extend_from_slice(&b[over.len()..]);
        assert_eq!(decode(&over), Some((6, doubt(&[(1, 1, 1)]))));
    }

    #[test]
    fn a_count_beyond_the_bound_is_refused_before_use() {
        let mut b = encode(1, &Doubt::new());
        b[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(decode(&b), None);
    }

    #[test]
    fn the_newest_valid_record_wins_and_the_next_goes_to_the_other_file() {
        let old = encode(4, &doubt(&[(1, 1, 1), (2, 1, 2)]));
        let new = encode(5, &doubt(&[(1, 1, 1)]));
        let torn = &new[..new.len() - 1];
        assert_eq!(
            newest([Some(&old), Some(&new)]).map(|x| (x.0, x.2)),
            Some((5, 1))
        );
        assert_eq!(
            newest([Some(&new), Some(&old)]).map(|x| (x.0, x.2)),
            Some((5, 0))
        );
        // The rewrite tore: the record before it (a superset) stands.
        assert_eq!(
            newest([Some(&old), Some(torn)]).map(|x| (x.0, x.2)),
            Some((4, 0))
        );
        assert_eq!(newest([None, None]), None);
    }
}
