//! Per-object metadata: the header block and the per-4-KiB-block checksums at the
//! start of every object file (byte layout in docs/on-disk-format.md).
//!
//! Checksums are stored as `crc32c(block) XOR crc32c(4 KiB of zeroes)`, so a stored
//! 0 means "the block is all zeroes". A block never written, a punched hole and a
//! checksum slot never written (a hole in the metadata) therefore agree with no
//! bookkeeping at all, and a never-written block verifies like any other.

use flame_common::ids::{ObjectId, PgId, VolumeId};
use flame_common::map::OBJECT_SIZE_MAX;
use std::sync::LazyLock;

/// Checksummed unit of object data.
pub const BLOCK: usize = 4096;
/// Checksums per object file: enough for the largest object size a pool may have.
pub const BLOCKS_MAX: usize = OBJECT_SIZE_MAX as usize / BLOCK;
/// Size of the header block.
pub const HEADER_LEN: usize = 4096;
/// Size of the checksum area that follows the header.
pub const CRC_AREA_LEN: usize = BLOCKS_MAX * 4;
/// Where object data starts in an object file. Block-aligned, so `O_DIRECT` works.
pub const DATA_OFFSET: u64 = (HEADER_LEN + CRC_AREA_LEN) as u64;

/// First bytes of an object header.
pub const OBJECT_MAGIC: &[u8; 8] = b"FLAMEOBJ";
/// Object header format this code writes and reads.
pub const OBJECT_FORMAT: u32 = 2;

/// crc32c of one all-zero block.
static ZERO_BLOCK_CRC: LazyLock<u32> = LazyLock::new(|| crc32c::crc32c(&[0u8; BLOCK]));

/// The stored checksum of a full block (see the module comment).
pub fn block_sum(block: &[u8]) -> u32 {
    debug_assert_eq!(block.len(), BLOCK);
    crc32c::crc32c(block) ^ *ZERO_BLOCK_CRC
}

/// The fingerprint copies of a block are compared by (recovery's backfill and
/// peering, scrub's vote: `BlockSum::sum` on the wire), 0 iff the block is all
/// zeroes.
///
/// Not the stored crc32c: a CRC is linear, so every block that ends with the
/// crc32c of the bytes before it (a format that checksums its own blocks — the
/// test oracle's blocks, and many on-disk formats) has the same crc32c, the CRC
/// residue, whatever its content. Two copies holding different such blocks would
/// compare equal and recovery would leave the stale one in place. This is a
/// non-linear hash (multiply-xorshift over 64-bit words, then a murmur3
/// finaliser), so no data layout makes different blocks agree short of a genuine
/// 32-bit collision. Every OSD must compute the same function: an OSD running an
/// older build compares as different everywhere (more copying, never less).
pub fn compare_sum(block: &[u8]) -> u32 {
    debug_assert_eq!(block.len(), BLOCK);
    if block.iter().all(|&b| b == 0) {
        return 0;
    }
    let mut h: u64 = 0x243F_6A88_85A3_08D3;
    for w in block.chunks_exact(8) {
        let w = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        h = (h ^ w).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        h ^= h >> 29;
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    h ^= h >> 33;
    h = h.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    h ^= h >> 33;
    // 0 is reserved for all-zero blocks.
    ((h ^ (h >> 32)) as u32).max(1)
}

/// Decoded object header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// The object this file holds (checked on load: a misplaced file is not trusted).
    pub object: ObjectId,
    /// Its placement group.
    pub pg: PgId,
    /// Number of meaningful checksum slots (highest block ever written + 1).
    pub crc_count: u32,
    /// Object version; 0 until the recovery work assigns versions.
    pub version: u64,
}

/// What the first block of an object file says.
#[derive(Debug, PartialEq, Eq)]
pub enum Loaded {
    /// All zeroes: the metadata was never written (a new object). Every checksum
    /// slot is 0.
    Fresh,
    /// A valid header.
    Valid(Header),
    /// Not a valid header for this object: its checksums cannot be trusted.
    Bad(String),
}

impl Header {
    /// Encodes the header block.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(OBJECT_MAGIC);
        b[8..12].copy_from_slice(&OBJECT_FORMAT.to_le_bytes());
        b[12..16].copy_from_slice(&(BLOCK as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.object.volume.0.to_le_bytes());
        b[24..32].copy_from_slice(&self.object.index.to_le_bytes());
        b[32..36].copy_from_slice(&self.pg.0.to_le_bytes());
        b[36..40].copy_from_slice(&self.crc_count.to_le_bytes());
        b[40..48].copy_from_slice(&self.version.to_le_bytes());
        let crc = crc32c::crc32c(&b[..HEADER_LEN - 4]);
        b[HEADER_LEN - 4..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes a header block and checks it belongs to `object`.
    pub fn decode(b: &[u8], object: ObjectId) -> Loaded {
        if b.len() < HEADER_LEN {
            return Loaded::Bad("short header".into());
        }
        if b[..HEADER_LEN].iter().all(|&x| x == 0) {
            return Loaded::Fresh;
        }
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[o..o + 8]);
            u64::from_le_bytes(a)
        };
        if &b[0..8] != OBJECT_MAGIC {
            return Loaded::Bad("bad magic".into());
        }
        if crc32c::crc32c(&b[..HEADER_LEN - 4]) != u32_at(HEADER_LEN - 4) {
            return Loaded::Bad("header checksum mismatch".into());
        }
        if u32_at(8) != OBJECT_FORMAT || u32_at(12) != BLOCK as u32 {
            return Loaded::Bad(format!(
                "format {} block size {}, expected {OBJECT_FORMAT} and {BLOCK}",
                u32_at(8),
                u32_at(12)
            ));
        }
        let h = Header {
            object: ObjectId {
                volume: VolumeId(u64_at(16)),
                index: u64_at(24),
            },
            pg: PgId(u32_at(32)),
            crc_count: u32_at(36),
            version: u64_at(40),
        };
        if h.object != object {
            return Loaded::Bad(format!("header names object {}", h.object));
        }
        if h.crc_count as usize > BLOCKS_MAX {
            return Loaded::Bad(format!("checksum count {} too large", h.crc_count));
        }
        Loaded::Valid(h)
    }
}

/// Encodes header and checksums as one block-aligned write at file offset 0.
///
/// `on_disk` is how many slots the file may hold from its last metadata write
/// (that write's `crc_count`): the slots from `sums.len()` up to it are written as
/// zeroes, so that every slot past `crc_count` is zero on disk however the list
/// shrank — to nothing (a write of the header alone) or to fewer 4 KiB blocks of
/// slots. A stale slot is never read (only `crc_count` slots are), but copies with
/// the same data would differ byte for byte, and a slot past `crc_count` must read
/// as the zero block's (simulator seed 436).
pub fn encode_meta(header: &Header, sums: &[u32], on_disk: usize) -> Vec<u8> {
    let slots = sums.len().max(on_disk.min(BLOCKS_MAX));
    let crc_bytes = (slots * 4).div_ceil(BLOCK) * BLOCK;
    let mut out = Vec::with_capacity(HEADER_LEN + crc_bytes);
    out.extend_from_slice(&header.encode());
    for s in sums {
        out.extend_from_slice(&s.to_le_bytes());
    }
    out.resize(HEADER_LEN + crc_bytes, 0);
    out
}

/// Decodes `count` checksum slots.
pub fn decode_sums(b: &[u8], count: usize) -> Vec<u32> {
    b.chunks_exact(4)
        .take(count)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_block_sums_to_zero_and_header_round_trips() {
        // The values docs/on-disk-format.md quotes.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(*ZERO_BLOCK_CRC, 0x98F9_4189, "{:#x}", *ZERO_BLOCK_CRC);
        assert_eq!(block_sum(&[0u8; BLOCK]), 0);
        assert_ne!(block_sum(&[1u8; BLOCK]), 0);
        assert_eq!(compare_sum(&[0u8; BLOCK]), 0);
        assert_ne!(compare_sum(&[1u8; BLOCK]), 0);
        let o = ObjectId {
            volume: VolumeId(3),
            index: 9,
        };
        let h = Header {
            object: o,
            pg: PgId(7),
            crc_count: 2,
            version: 42,
        };
        let m = encode_meta(&h, &[5, 6], 0);
        assert_eq!(m.len(), HEADER_LEN + BLOCK);
        assert_eq!(Header::decode(&m, o), Loaded::Valid(h.clone()));
        assert_eq!(decode_sums(&m[HEADER_LEN..], 2), vec![5, 6]);
        let mut bad = m.clone();
        bad[20] ^= 1;
        assert!(matches!(Header::decode(&bad, o), Loaded::Bad(_)));
        let other = ObjectId { index: 10, ..o };
        assert!(matches!(Header::decode(&m, other), Loaded::Bad(_)));
        assert_eq!(Header::decode(&[0u8; HEADER_LEN], o), Loaded::Fresh);
        assert_eq!(DATA_OFFSET % BLOCK as u64, 0);
        // docs/on-disk-format.md and tests/src/lib.rs (OBJECT_DATA_OFFSET) say so.
        assert_eq!(DATA_OFFSET, 69_632);
    }

    /// A block ending with the crc32c of its other bytes, `fill` elsewhere.
    fn self_checksummed(fill: u8) -> Vec<u8> {
        let mut b = vec![fill; BLOCK];
        let crc = crc32c::crc32c(&b[..BLOCK - 4]);
        b[BLOCK - 4..].copy_from_slice(&crc.to_le_bytes());
        b
    }

    #[test]
    fn blocks_carrying_their_own_crc_compare_different() {
        let (a, b) = (self_checksummed(1), self_checksummed(2));
        assert_ne!(a, b);
        // The CRC residue: the stored checksum cannot tell them apart...
        assert_eq!(block_sum(&a), block_sum(&b));
        // ...the comparison fingerprint must.
        assert_ne!(compare_sum(&a), compare_sum(&b));
        let mut c = a.clone();
        c[100] ^= 1;
        assert_ne!(compare_sum(&a), compare_sum(&c));
    }
}

#[cfg(test)]
mod speed {
    /// crc32c throughput (a measurement, not a check): `cargo test --release -p
    /// flame-osd crc_speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn crc_speed() {
        let buf = vec![0x5au8; 1 << 20];
        let t = std::time::Instant::now();
        let mut x = 0u32;
        for _ in 0..256 {
            x ^= crc32c::crc32c(&buf);
        }
        let s = t.elapsed().as_secs_f64();
        println!(
            "crc32c: {:.1} GB/s ({x:x})",
            256.0 * (1 << 20) as f64 / s / 1e9
        );
    }
}
