//! Property tests of the decoders of what an OSD reads back from its disk
//! (`src/store/`): the superblock (`layout.rs`), object headers and their checksum
//! slots (`meta.rs`), the generation headers of the intent journal and of the
//! placement-group log (`journal.rs`), journal entries (`journal.rs`) and log records
//! (`pg_log_file.rs`). A torn write, a flipped bit or a file from elsewhere must be
//! refused, never panic, never size an allocation; what decodes re-encodes to the
//! same bytes (where every byte is meaningful), and `decode(encode(x)) == x`.
//!
//! Seeded and bounded (`PROPTEST_CASES` / `PROPTEST_RNG_SEED` override); the
//! cargo-fuzz target is `fuzz/fuzz_targets/store.rs`.

use crate::pg_log::{EntryKind, LogEntry};
use crate::store::journal::{
    ENTRY_LEN, JOURNAL_HEADER_LEN, JOURNAL_MAGIC, decode_entry, decode_generation_header,
    encode_entry, encode_generation_header,
};
use crate::store::layout::{SUPERBLOCK_LEN, Superblock};
use crate::store::meta::{self, BLOCKS_MAX, Loaded};
use crate::store::pg_log_file::{
    PG_LOG_MAGIC, RECORD_LEN, decode_record, encode_record, encode_stored, seal,
};
use flame_common::fuzzing::props::{config, mutations};
use flame_common::fuzzing::{Mutation, mutate};
use flame_common::ids::{Epoch, ObjectId, OpId, PgId, VolumeId};
use proptest::prelude::*;

/// This file's proptest seed (`config`).
const SEED: u64 = 0xf1a3_0006;

fn object() -> impl Strategy<Value = ObjectId> {
    (any::<u64>(), any::<u64>()).prop_map(|(v, index)| ObjectId {
        volume: VolumeId(v),
        index,
    })
}

/// Mutations, then (sometimes) the crc32c of bytes `..end` stored at `end`, so
/// the damage reaches the field checks behind the checksum.
fn damage(b: &mut Vec<u8>, m: &[Mutation], fix: Option<usize>) {
    mutate(b, m);
    if let Some(end) = fix
        && b.len() >= end + 4
    {
        let crc = crc32c::crc32c(&b[..end]);
        b[end..end + 4].copy_from_slice(&crc.to_le_bytes());
    }
}

fn check_superblock(b: &[u8]) {
    if let Ok(s) = Superblock::decode(b) {
        assert!(s.uuid.len() <= 3 * 64, "lossy decoding of 64 bytes at most");
    }
}

fn check_object_header(b: &[u8], o: ObjectId) {
    if let Loaded::Valid(h) = meta::Header::decode(b, o) {
        assert_eq!(h.object, o);
        assert!(h.crc_count as usize <= BLOCKS_MAX);
        // Bytes 48..4092 are reserved and not read (the crc covers them); the
        // fields re-encode exactly.
        assert!(
            h.encode()[..48] == b[..48],
            "object header re-encodes differently"
        );
    }
}

fn check_record(b: &[u8], generation: u64) {
    if let Some(e) = decode_record(b, generation) {
        assert!(e.entry.seq >= 1 && e.entry.seq <= crate::pg_core::PG_SEQ_MAX);
        assert!(u64::from(e.entry.offset) + u64::from(e.entry.length) <= 1 << 32);
        let again = seal(encode_stored(&e), generation);
        // Bytes 61..64 are padding the decoder does not read (the crc covers them).
        assert_eq!(&again[..61], &b[..61]);
    }
}

fn log_entry() -> impl Strategy<Value = (PgId, LogEntry)> {
    (
        any::<u32>(),
        1..=crate::pg_core::PG_SEQ_MAX,
        any::<(u64, u64)>(),
        object(),
        any::<u32>(),
        any::<u32>(),
        prop_oneof![
            Just(EntryKind::Write),
            Just(EntryKind::Zero),
            Just(EntryKind::Discard)
        ],
    )
        .prop_map(
            |(pg, seq, (session, op_seq), object, offset, length, kind)| {
                let length = length.min(u32::MAX - offset);
                (
                    PgId(pg),
                    LogEntry {
                        seq,
                        op: OpId {
                            session,
                            seq: op_seq,
                        },
                        interval: Epoch(0),
                        object,
                        offset,
                        length,
                        kind,
                        applied: Vec::new(),
                    },
                )
            },
        )
}

proptest! {
    #![proptest_config(config(256, SEED))]

    #[test]
    fn store_decoders_take_arbitrary_bytes(
        b in proptest::collection::vec(any::<u8>(), 0..128),
        o in object(),
        generation in any::<u64>(),
    ) {
        check_superblock(&b);
        check_object_header(&b, o);
        let _ = decode_generation_header(JOURNAL_MAGIC, &b);
        let _ = decode_entry(&b, generation);
        check_record(&b, generation);
        let _ = meta::decode_sums(&b, usize::MAX);
    }

    #[test]
    fn superblocks_round_trip_and_survive_mutation(
        format in any::<u32>(),
        checksums in any::<bool>(),
        uuid in "\\PC{0,70}",
        m in mutations(6),
        fix in any::<bool>(),
    ) {
        let s = Superblock { format, checksums, uuid };
        let mut b = s.encode();
        let d = Superblock::decode(&b).map_err(TestCaseError::fail)?;
        prop_assert_eq!(d.format, s.format);
        prop_assert_eq!(d.checksums, s.checksums);
        // Cut to 64 bytes at a character boundary, never altered.
        prop_assert!(s.uuid.starts_with(&d.uuid) && d.uuid.len() >= s.uuid.len().min(61));
        damage(&mut b, &m, fix.then_some(SUPERBLOCK_LEN - 4));
        check_superblock(&b);
    }

    #[test]
    fn object_headers_round_trip_and_survive_mutation(
        o in object(),
        pg in any::<u32>(),
        crc_count in 0..=BLOCKS_MAX as u32,
        version in any::<u64>(),
        sums in proptest::collection::vec(any::<u32>(), 0..20),
        m in mutations(6),
        fix in any::<bool>(),
    ) {
        let h = meta::Header { object: o, pg: PgId(pg), crc_count, version };
        let mut b = meta::encode_meta(&h, &sums, 0);
        prop_assert_eq!(meta::Header::decode(&b, o), Loaded::Valid(h));
        prop_assert_eq!(meta::decode_sums(&b[meta::HEADER_LEN..], sums.len()), sums);
        damage(&mut b, &m, fix.then_some(meta::HEADER_LEN - 4));
        check_object_header(&b, o);
    }

    #[test]
    fn journal_headers_and_entries_round_trip_and_survive_mutation(
        generation in any::<u64>(),
        o in object(),
        pg in any::<u32>(),
        m in mutations(6),
        fix in any::<bool>(),
    ) {
        for magic in [JOURNAL_MAGIC, PG_LOG_MAGIC] {
            let mut h = encode_generation_header(magic, generation);
            prop_assert_eq!(decode_generation_header(magic, &h), Some(generation));
            let n = JOURNAL_HEADER_LEN as usize;
            damage(&mut h, &m, fix.then_some(n - 4));
            let _ = decode_generation_header(magic, &h);
        }
        let mut e = Vec::new();
        encode_entry(&mut e, generation, o, PgId(pg));
        prop_assert_eq!(e.len(), ENTRY_LEN);
        prop_assert_eq!(decode_entry(&e, generation), Some((PgId(pg), o)));
        prop_assert_eq!(decode_entry(&e, generation.wrapping_add(1)), None);
        damage(&mut e, &m, fix.then_some(28));
        if let Some((p, obj)) = decode_entry(&e, generation) {
            let mut again = Vec::new();
            encode_entry(&mut again, generation, obj, p);
            prop_assert_eq!(again, e);
        }
    }

    #[test]
    fn log_records_round_trip_and_survive_mutation(
        (pg, entry) in log_entry(),
        generation in any::<u64>(),
        m in mutations(6),
        fix in any::<bool>(),
    ) {
        let b = seal(encode_record(pg, &entry), generation);
        let d = decode_record(&b, generation);
        prop_assert_eq!(d.as_ref().map(|d| (d.pg, &d.entry)), Some((pg, &entry)));
        let mut v = b.to_vec();
        damage(&mut v, &m, fix.then_some(64));
        check_record(&v, generation);
    }
}

/// Regressions: entries and records shorter than their fixed size made the
/// decoders index past the slice (a panic) — callers passed whole chunks, but
/// the decoders now check the length themselves.
#[test]
fn short_journal_entries_and_log_records_are_refused() {
    assert_eq!(decode_entry(&[0u8; ENTRY_LEN - 1], 0), None);
    assert_eq!(decode_entry(&[], 0), None);
    assert_eq!(decode_record(&[0u8; RECORD_LEN - 1], 0), None);
    assert_eq!(decode_record(&[0u8; 3], 0), None);
}

/// Regression: a uuid longer than 64 bytes cut inside a UTF-8 character came
/// back as a different string (a replacement character at the end).
#[test]
fn superblock_uuids_are_cut_at_a_character_boundary() {
    let uuid = format!("{}é", "a".repeat(63));
    let d = Superblock::decode(
        &Superblock {
            format: 3,
            checksums: true,
            uuid,
        }
        .encode(),
    )
    .unwrap();
    assert_eq!(d.uuid, "a".repeat(63));
}
