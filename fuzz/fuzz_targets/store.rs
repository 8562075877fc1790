//! Fuzzes the OSD's on-disk decoders (`flame-osd/src/store/`): superblock, object
//! header and checksum slots, journal and placement-group-log generation headers,
//! journal entries, log records. Input byte 0 picks whether the crc32c a decoder
//! checks first is recomputed over the rest (so mutations reach the field checks).
//! Nothing may panic; what decodes is in range and re-encodes to its bytes.
//! Property tests: `flame-osd/src/store/decode_props.rs`.
#![no_main]

use flame_common::ids::{ObjectId, VolumeId};
use flame_osd::store::journal::{
    ENTRY_LEN, JOURNAL_HEADER_LEN, JOURNAL_MAGIC, decode_entry, decode_generation_header,
    encode_entry,
};
use flame_osd::store::layout::{SUPERBLOCK_LEN, Superblock};
use flame_osd::store::meta::{self, BLOCKS_MAX, Loaded};
use flame_osd::store::pg_log_file::{PG_LOG_MAGIC, RECORD_LEN, decode_record, encode_record, seal};
use libfuzzer_sys::fuzz_target;

/// `b` padded or cut to `len` with the crc32c of `..len - 4` at its end.
fn sealed(b: &[u8], len: usize, fix: bool) -> Vec<u8> {
    let mut v = b.to_vec();
    v.resize(len, 0);
    if fix {
        let crc = crc32c::crc32c(&v[..len - 4]);
        v[len - 4..].copy_from_slice(&crc.to_le_bytes());
    }
    v
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let fix = mode & 1 == 1;
    let generation = u64::from(mode >> 1);
    let _ = Superblock::decode(rest);
    let _ = Superblock::decode(&sealed(rest, SUPERBLOCK_LEN, fix));
    let o = ObjectId {
        volume: VolumeId(rest.get(16).copied().unwrap_or(0).into()),
        index: 0,
    };
    if let Loaded::Valid(h) = meta::Header::decode(&sealed(rest, meta::HEADER_LEN, fix), o) {
        assert!(h.crc_count as usize <= BLOCKS_MAX);
    }
    let _ = meta::Header::decode(rest, o);
    let _ = meta::decode_sums(rest, usize::MAX);
    for magic in [JOURNAL_MAGIC, PG_LOG_MAGIC] {
        let _ = decode_generation_header(magic, rest);
        let _ = decode_generation_header(magic, &sealed(rest, JOURNAL_HEADER_LEN as usize, fix));
    }
    for e in [rest.to_vec(), sealed(rest, ENTRY_LEN - 4, false)] {
        let mut e = e;
        if fix && e.len() == ENTRY_LEN - 4 {
            let crc = crc32c::crc32c(&e);
            e.extend_from_slice(&crc.to_le_bytes());
        }
        if let Some((pg, obj)) = decode_entry(&e, generation) {
            let mut again = Vec::new();
            encode_entry(&mut again, generation, obj, pg);
            assert_eq!(again, e);
        }
    }
    for r in [rest.to_vec(), sealed(rest, RECORD_LEN, fix)] {
        if let Some(s) = decode_record(&r, generation) {
            assert!(u64::from(s.entry.offset) + u64::from(s.entry.length) <= 1 << 32);
            assert_eq!(
                &seal(encode_record(s.pg, &s.entry), generation)[..61],
                &r[..61]
            );
        }
    }
});
