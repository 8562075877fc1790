//! Where things are in a data directory, and the superblock that says which format
//! it holds (byte layout in docs/on-disk-format.md).
//!
//! ```text
//! data_dir/superblock, superblock.copy     format version, OSD uuid, checksums flag (two copies)
//! data_dir/osd.json                        identity (control.rs)
//! data_dir/journal/<shard, 4 hex>          intent journal of one shard
//! data_dir/pgs/<pg, 8 hex>/<volume, 16 hex>.<index, 16 hex>   one object
//! ```
//!
//! Objects are grouped by placement group, so a placement group can be listed,
//! copied or removed by reading one directory.

use flame_common::ids::{ObjectId, PgId, VolumeId};
use std::io::Write;
use std::path::{Path, PathBuf};

/// The on-disk format this code reads and writes.
pub const FORMAT: u32 = 2;
/// First bytes of the superblock.
pub const SUPERBLOCK_MAGIC: &[u8; 8] = b"FLAMESB\0";
/// Size of the superblock file.
pub const SUPERBLOCK_LEN: usize = 4096;
/// Superblock flag: per-block checksums are kept.
const FLAG_CHECKSUMS: u32 = 1;

/// The directory of all placement groups.
pub fn pgs_dir(root: &Path) -> PathBuf {
    root.join("pgs")
}

/// A placement group's directory.
pub fn pg_dir(root: &Path, pg: PgId) -> PathBuf {
    pgs_dir(root).join(format!("{:08x}", pg.0))
}

/// Parses a placement group directory's name.
pub fn parse_pg_name(name: &str) -> Option<PgId> {
    if name.len() != 8 {
        return None;
    }
    u32::from_str_radix(name, 16).ok().map(PgId)
}

/// An object file's path.
pub fn object_path(root: &Path, pg: PgId, object: ObjectId) -> PathBuf {
    pg_dir(root, pg).join(format!("{:016x}.{:016x}", object.volume.0, object.index))
}

/// Parses an object file's name (`None` for anything else, such as temp files).
pub fn parse_object_name(name: &str) -> Option<ObjectId> {
    let (v, i) = name.split_once('.')?;
    if v.len() != 16 || i.len() != 16 {
        return None;
    }
    Some(ObjectId {
        volume: VolumeId(u64::from_str_radix(v, 16).ok()?),
        index: u64::from_str_radix(i, 16).ok()?,
    })
}

/// The intent journals' directory.
pub fn journal_dir(root: &Path) -> PathBuf {
    root.join("journal")
}

/// One shard's intent journal.
pub fn journal_path(root: &Path, shard: u16) -> PathBuf {
    journal_dir(root).join(format!("{shard:04x}"))
}

/// What the superblock records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    /// On-disk format version.
    pub format: u32,
    /// Whether per-block checksums are kept (fixed when the directory is formatted).
    pub checksums: bool,
    /// The OSD uuid of `osd.json` when the directory was formatted.
    pub uuid: String,
}

impl Superblock {
    /// Encodes the superblock file.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; SUPERBLOCK_LEN];
        b[0..8].copy_from_slice(SUPERBLOCK_MAGIC);
        b[8..12].copy_from_slice(&self.format.to_le_bytes());
        let flags = if self.checksums { FLAG_CHECKSUMS } else { 0 };
        b[12..16].copy_from_slice(&flags.to_le_bytes());
        let uuid = self.uuid.as_bytes();
        // At most 64 bytes, cut at a character boundary: a uuid cut inside a UTF-8
        // character would decode (lossily) as another string than it was written.
        let mut n = uuid.len().min(64);
        while !self.uuid.is_char_boundary(n) {
            n -= 1;
        }
        b[16..20].copy_from_slice(&(n as u32).to_le_bytes());
        b[20..20 + n].copy_from_slice(&uuid[..n]);
        let crc = crc32c::crc32c(&b[..SUPERBLOCK_LEN - 4]);
        b[SUPERBLOCK_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes a superblock; `Err` says what is wrong with it.
    pub fn decode(b: &[u8]) -> Result<Superblock, String> {
        if b.len() != SUPERBLOCK_LEN || &b[0..8] != SUPERBLOCK_MAGIC {
            return Err("it is not a Flame superblock".into());
        }
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        if crc32c::crc32c(&b[..SUPERBLOCK_LEN - 4]) != u32_at(SUPERBLOCK_LEN - 4) {
            return Err("its checksum does not match (corrupt)".into());
        }
        let n = u32_at(16) as usize;
        if n > 64 {
            return Err(format!("uuid length {n} is out of range (corrupt)"));
        }
        Ok(Superblock {
            format: u32_at(8),
            checksums: u32_at(12) & FLAG_CHECKSUMS != 0,
            uuid: String::from_utf8_lossy(&b[20..20 + n]).into_owned(),
        })
    }
}

/// The two copies of the superblock, written together and identical: either one
/// that decodes is enough to open the directory (a bad sector or a stray write
/// takes one 4 KiB block, not the only record of what the directory holds).
/// Directories formatted before the second copy existed have only the first; it is
/// added at their next start.
pub const SUPERBLOCK_FILES: [&str; 2] = ["superblock", "superblock.copy"];

/// What reading one superblock copy found.
enum Copy {
    Missing,
    /// Unreadable: an I/O error or a block that does not decode (the reason).
    Bad(String),
    Good(Superblock),
}

fn read_copy(path: &Path) -> Copy {
    match std::fs::read(path) {
        Ok(bytes) => match Superblock::decode(&bytes) {
            Ok(sb) => Copy::Good(sb),
            Err(e) => Copy::Bad(e),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Copy::Missing,
        Err(e) => Copy::Bad(format!("cannot read it: {e}")),
    }
}

impl std::fmt::Display for Superblock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "format {}, OSD {}, checksums: {}",
            self.format, self.uuid, self.checksums
        )
    }
}

/// Checks that `data_dir` holds this format (formatting it if it is new) and returns
/// its superblock. Start-up only: blocking calls are fine here. The error is one
/// sentence that says what to do; the OSD exits with status 2 on it.
///
/// Of the two copies ([`SUPERBLOCK_FILES`]) one that decodes is enough; a missing
/// or unreadable other copy is rewritten from it (reported). Two copies that decode
/// but disagree, or no copy that decodes, are refused: what the directory holds is
/// then not known, and guessing could mix two OSDs' data or checksum settings.
pub fn open_data_dir(data_dir: &Path, uuid: &str, checksums: bool) -> Result<Superblock, String> {
    let dir = data_dir.display();
    let paths = SUPERBLOCK_FILES.map(|n| data_dir.join(n));
    let what_to_do = "Flame cannot convert a data directory in place: start this OSD on an \
                      empty data_dir (its copies are rebuilt from the other replicas when \
                      recovery exists; until then remove it from the cluster first), or run \
                      the flame-osd release that wrote it";
    let copies = [read_copy(&paths[0]), read_copy(&paths[1])];
    let (sb, repair) = match copies {
        [Copy::Good(a), Copy::Good(b)] => {
            if a != b {
                return Err(format!(
                    "data_dir {dir}: the two superblock copies disagree: {} says {a}, {} says \
                     {b}; they are written together and never change, so one of them comes \
                     from another data directory — replace it with a copy of the one that \
                     matches this OSD's osd.json and config (or start on an empty data_dir)",
                    paths[0].display(),
                    paths[1].display()
                ));
            }
            (a, None)
        }
        [Copy::Good(a), other] => (a, Some((1, other))),
        [other, Copy::Good(b)] => (b, Some((0, other))),
        [Copy::Missing, Copy::Missing] => return format_new(data_dir, uuid, checksums, what_to_do),
        [first, second] => {
            let why = |c: &Copy| match c {
                Copy::Missing => "missing".to_string(),
                Copy::Bad(e) => format!("unreadable: {e}"),
                Copy::Good(_) => "valid".to_string(),
            };
            return Err(format!(
                "data_dir {dir}: no copy of the superblock is readable ({} is {}; {} is {}), \
                 so the format, OSD and checksum setting of the directory are unknown and it \
                 is not opened; restore either file from a backup of this OSD's data_dir \
                 (the two copies are identical), or, without one, move this data_dir away and \
                 start flame-osd on an empty one: it joins as a new OSD and its placement \
                 groups are filled again from their other copies",
                paths[0].display(),
                why(&first),
                paths[1].display(),
                why(&second)
            ));
        }
    };
    if sb.format < FORMAT {
        return Err(format!(
            "data_dir {dir} holds on-disk format {}, older than the format {FORMAT} this \
             flame-osd uses; {what_to_do}",
            sb.format
        ));
    }
    if sb.format > FORMAT {
        return Err(format!(
            "data_dir {dir} holds on-disk format {}, newer than the format {FORMAT} this \
             flame-osd understands; run the newer flame-osd",
            sb.format
        ));
    }
    if sb.uuid != uuid {
        return Err(format!(
            "data_dir {dir}: the superblock names OSD {} but osd.json names {uuid}; \
             the directory was assembled from two OSDs — restore the matching osd.json",
            sb.uuid
        ));
    }
    if sb.checksums != checksums {
        return Err(format!(
            "data_dir {dir} was formatted with checksums: {}, the config says \
             checksums: {checksums}; the setting is fixed when a data directory is \
             formatted — set it back, or start on an empty data_dir",
            sb.checksums
        ));
    }
    if let Some((i, was)) = repair {
        match &was {
            Copy::Bad(e) => tracing::warn!(
                file = %paths[i].display(),
                "superblock copy unreadable ({e}); rewriting it from the other copy"
            ),
            _ => tracing::info!(
                file = %paths[i].display(),
                "superblock copy missing (a directory formatted before there were two, or \
                 a crash while formatting); writing it from the other copy"
            ),
        }
        // The directory opens on the good copy either way; a failed rewrite only
        // leaves it with one copy, as before, and is tried again at the next start.
        if let Err(e) = write_copy(data_dir, SUPERBLOCK_FILES[i], &sb)
            .and_then(|()| std::fs::File::open(data_dir)?.sync_all())
        {
            tracing::warn!(file = %paths[i].display(), "cannot rewrite the superblock copy: {e}");
        }
    }
    Ok(sb)
}

/// A data directory without any superblock copy: formatted if it is new, refused
/// if it holds an older layout or objects.
fn format_new(
    data_dir: &Path,
    uuid: &str,
    checksums: bool,
    what_to_do: &str,
) -> Result<Superblock, String> {
    let dir = data_dir.display();
    if data_dir.join("objects").exists() {
        return Err(format!(
            "data_dir {dir} holds on-disk format 1 (an objects/ directory, no \
             superblock), older than the format {FORMAT} this flame-osd uses; {what_to_do}"
        ));
    }
    if pgs_dir(data_dir).exists() {
        return Err(format!(
            "data_dir {dir} has a pgs/ directory but no superblock: it is damaged or \
             was not written by flame-osd; {what_to_do}"
        ));
    }
    let sb = Superblock {
        format: FORMAT,
        checksums,
        uuid: uuid.to_string(),
    };
    format_dir(data_dir, &sb).map_err(|e| format!("cannot format data_dir {dir}: {e}"))?;
    Ok(sb)
}

/// Writes one superblock copy: to a temp file, synced, renamed over `name` (the
/// caller syncs the directory), so a crash leaves the old file or a whole new one.
fn write_copy(data_dir: &Path, name: &str, sb: &Superblock) -> std::io::Result<()> {
    let tmp = data_dir.join(format!("{name}.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&sb.encode())?;
    f.sync_all()?;
    std::fs::rename(&tmp, data_dir.join(name))
}

/// Creates the directories, then both superblock copies (each written to a temp
/// file, synced, renamed), then syncs the directory: a crash leaves no copy, one
/// whole copy (the other is written at the next start) or both.
fn format_dir(data_dir: &Path, sb: &Superblock) -> std::io::Result<()> {
    std::fs::create_dir_all(pgs_dir(data_dir))?;
    std::fs::create_dir_all(journal_dir(data_dir))?;
    for name in SUPERBLOCK_FILES {
        write_copy(data_dir, name, sb)?;
    }
    std::fs::File::open(data_dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let o = ObjectId {
            volume: VolumeId(0xabc),
            index: 17,
        };
        let p = object_path(Path::new("/d"), PgId(0x1f), o);
        assert_eq!(
            p,
            Path::new("/d/pgs/0000001f/0000000000000abc.0000000000000011")
        );
        let name = p.file_name().and_then(|n| n.to_str()).unwrap();
        assert_eq!(parse_object_name(name), Some(o));
        assert_eq!(parse_object_name("x.tmp"), None);
        assert_eq!(parse_pg_name("0000001f"), Some(PgId(31)));
        assert_eq!(parse_pg_name("1f"), None);
    }

    #[test]
    fn formats_new_refuses_old_unknown_and_mismatched() {
        let d = tempfile::tempdir().unwrap();
        let sb = open_data_dir(d.path(), "u-1", true).unwrap();
        assert_eq!(sb.format, FORMAT);
        assert!(d.path().join("pgs").is_dir() && d.path().join("journal").is_dir());
        // Reopening agrees; the checksum setting and the uuid are checked.
        assert_eq!(open_data_dir(d.path(), "u-1", true).unwrap(), sb);
        let e = open_data_dir(d.path(), "u-1", false).unwrap_err();
        assert!(e.contains("checksums"), "{e}");
        let e = open_data_dir(d.path(), "u-2", true).unwrap_err();
        assert!(e.contains("osd.json"), "{e}");
        // A newer format.
        let newer = Superblock {
            format: FORMAT + 1,
            ..sb.clone()
        };
        for name in SUPERBLOCK_FILES {
            std::fs::write(d.path().join(name), newer.encode()).unwrap();
        }
        let e = open_data_dir(d.path(), "u-1", true).unwrap_err();
        assert!(e.contains("newer"), "{e}");
        // Garbage in both copies.
        for name in SUPERBLOCK_FILES {
            std::fs::write(d.path().join(name), b"hello").unwrap();
        }
        let e = open_data_dir(d.path(), "u-1", true).unwrap_err();
        assert!(e.contains("not a Flame superblock"), "{e}");
        // The v1 layout.
        let v1 = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(v1.path().join("objects/0000000000000001")).unwrap();
        let e = open_data_dir(v1.path(), "u-1", true).unwrap_err();
        assert!(
            e.contains("format 1") && e.contains("empty data_dir"),
            "{e}"
        );
        assert!(!v1.path().join("superblock").exists());
    }

    /// A corrupt 4 KiB block where the superblock was (a bad sector, a stray write).
    fn corrupt(path: &Path) {
        let mut b = std::fs::read(path).unwrap();
        b[100] ^= 0xff;
        std::fs::write(path, b).unwrap();
    }

    #[test]
    fn either_superblock_copy_is_enough_and_the_bad_one_is_rewritten() {
        let d = tempfile::tempdir().unwrap();
        let sb = open_data_dir(d.path(), "u-1", true).unwrap();
        for name in SUPERBLOCK_FILES {
            let path = d.path().join(name);
            assert_eq!(std::fs::read(&path).unwrap(), sb.encode(), "{name}");
        }
        for name in SUPERBLOCK_FILES {
            let path = d.path().join(name);
            corrupt(&path);
            assert_eq!(open_data_dir(d.path(), "u-1", true).unwrap(), sb, "{name}");
            assert_eq!(
                std::fs::read(&path).unwrap(),
                sb.encode(),
                "{name} rewritten"
            );
            // A missing copy too (a directory of the one-copy format, or a crash
            // while formatting).
            std::fs::remove_file(&path).unwrap();
            assert_eq!(open_data_dir(d.path(), "u-1", true).unwrap(), sb, "{name}");
            assert_eq!(std::fs::read(&path).unwrap(), sb.encode(), "{name} written");
        }
        // The good copy is still checked against the config.
        corrupt(&d.path().join(SUPERBLOCK_FILES[0]));
        let e = open_data_dir(d.path(), "u-2", true).unwrap_err();
        assert!(e.contains("osd.json"), "{e}");
    }

    #[test]
    fn no_readable_superblock_copy_is_refused_with_what_to_do() {
        let d = tempfile::tempdir().unwrap();
        open_data_dir(d.path(), "u-1", true).unwrap();
        for name in SUPERBLOCK_FILES {
            corrupt(&d.path().join(name));
        }
        let e = open_data_dir(d.path(), "u-1", true).unwrap_err();
        assert!(
            e.contains("no copy of the superblock is readable")
                && e.contains("checksum does not match")
                && e.contains("superblock.copy")
                && e.contains("restore")
                && e.contains("move this data_dir away"),
            "{e}"
        );
        // Nothing was formatted over it.
        assert!(Superblock::decode(&std::fs::read(d.path().join("superblock")).unwrap()).is_err());
        // One corrupt and the other missing: refused the same way.
        std::fs::remove_file(d.path().join(SUPERBLOCK_FILES[1])).unwrap();
        let e = open_data_dir(d.path(), "u-1", true).unwrap_err();
        assert!(e.contains("no copy") && e.contains("missing"), "{e}");
    }

    #[test]
    fn two_valid_superblock_copies_that_disagree_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let sb = open_data_dir(d.path(), "u-1", true).unwrap();
        let other = Superblock {
            uuid: "u-9".into(),
            ..sb
        };
        std::fs::write(d.path().join(SUPERBLOCK_FILES[1]), other.encode()).unwrap();
        let e = open_data_dir(d.path(), "u-1", true).unwrap_err();
        assert!(
            e.contains("disagree") && e.contains("OSD u-1") && e.contains("OSD u-9"),
            "{e}"
        );
    }
}
