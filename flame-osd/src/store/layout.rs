//! Where things are in a data directory, and the superblock that says which format
//! it holds (byte layout in docs/on-disk-format.md).
//!
//! ```text
//! data_dir/superblock                      format version, OSD uuid, checksums flag
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

/// Checks that `data_dir` holds this format (formatting it if it is new) and returns
/// its superblock. Start-up only: blocking calls are fine here. The error is one
/// sentence that says what to do; the OSD exits with status 2 on it.
pub fn open_data_dir(data_dir: &Path, uuid: &str, checksums: bool) -> Result<Superblock, String> {
    let dir = data_dir.display();
    let sb_path = data_dir.join("superblock");
    let what_to_do = "Flame cannot convert a data directory in place: start this OSD on an \
                      empty data_dir (its copies are rebuilt from the other replicas when \
                      recovery exists; until then remove it from the cluster first), or run \
                      the flame-osd release that wrote it";
    match std::fs::read(&sb_path) {
        Ok(bytes) => {
            let sb = Superblock::decode(&bytes).map_err(|e| {
                format!(
                    "data_dir {dir}: {} is unreadable: {e}; {what_to_do}",
                    sb_path.display()
                )
            })?;
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
            Ok(sb)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
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
        Err(e) => Err(format!("cannot read {}: {e}", sb_path.display())),
    }
}

/// Creates the directories, then the superblock (written to a temp file, synced,
/// renamed, directory synced), so a crash leaves either no superblock or a whole one.
fn format_dir(data_dir: &Path, sb: &Superblock) -> std::io::Result<()> {
    std::fs::create_dir_all(pgs_dir(data_dir))?;
    std::fs::create_dir_all(journal_dir(data_dir))?;
    let tmp = data_dir.join("superblock.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(&sb.encode())?;
    f.sync_all()?;
    std::fs::rename(&tmp, data_dir.join("superblock"))?;
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
        std::fs::write(d.path().join("superblock"), newer.encode()).unwrap();
        let e = open_data_dir(d.path(), "u-1", true).unwrap_err();
        assert!(e.contains("newer"), "{e}");
        // Garbage.
        std::fs::write(d.path().join("superblock"), b"hello").unwrap();
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
}
