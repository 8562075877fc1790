//! Property tests of the shm transport's two decoders of peer-written bytes
//! (`src/transport/shm.rs`): the hello (`decode_hello`) and the ring records
//! (`decode_ring_record`, the checks `take_record` runs on the shared ring).
//! Arbitrary bytes and mutated valid encodings must be accepted or refused with a
//! clear error, never panic, and never allocate more than the header's bounded
//! payload; a hello encoded by the documented layout (docs/protocol.md, "The shm
//! transport") decodes to what was encoded, and a valid record to its message.
//!
//! Seeded and bounded (`PROPTEST_CASES` / `PROPTEST_RNG_SEED` override); the
//! cargo-fuzz target is `fuzz/fuzz_targets/shm.rs`.

use flame_common::buffer::PayloadBuf;
use flame_common::fuzzing::mutate;
use flame_common::fuzzing::props::{config, mutations};
use flame_common::ids::{Epoch, ObjectId, OpId, PgId, PgSeq, RequestId, VolumeId};
use flame_common::protocol::{IoTarget, Message, PAYLOAD_BYTES_MAX};
use flame_common::transport::shm::{
    GRANT_SLOTS, Hello, REGIONS_MAX, RING_BYTES, SEGMENT_BYTES, STAGING_BYTES, decode_hello,
    decode_ring_record,
};
use proptest::prelude::*;

const HELLO_BYTES: usize = 64 + 16 * REGIONS_MAX;

/// This file's proptest seed (`config`).
const SEED: u64 = 0xf1a3_0004;

/// The hello as docs/protocol.md lays it out.
fn encode_hello(h: &Hello) -> Vec<u8> {
    let mut b = vec![0u8; HELLO_BYTES];
    b[0..8].copy_from_slice(b"FLSHM\0v2");
    for (i, v) in [SEGMENT_BYTES, RING_BYTES, STAGING_BYTES, GRANT_SLOTS]
        .into_iter()
        .enumerate()
    {
        b[8 + 8 * i..16 + 8 * i].copy_from_slice(&(v as u64).to_le_bytes());
    }
    b[40..48].copy_from_slice(&h.base.to_le_bytes());
    b[48..52].copy_from_slice(&(h.regions.len() as u32).to_le_bytes());
    for (i, (base, len)) in h.regions.iter().enumerate() {
        b[64 + 16 * i..72 + 16 * i].copy_from_slice(&base.to_le_bytes());
        b[72 + 16 * i..80 + 16 * i].copy_from_slice(&len.to_le_bytes());
    }
    b
}

fn check_hello(b: &[u8]) {
    if let Ok(h) = decode_hello(b) {
        assert!(h.regions.len() <= REGIONS_MAX);
        assert_eq!(
            encode_hello(&h),
            b,
            "a hello that decodes re-encodes the same"
        );
    }
}

fn hello() -> impl Strategy<Value = Hello> {
    let region = (1u64..(1 << 46), 1u64..=(1 << 20)).prop_map(|(base, pages)| (base, pages * 4096));
    (
        any::<u64>(),
        proptest::collection::vec(region, 0..=REGIONS_MAX),
    )
        .prop_map(|(base, regions)| Hello { base, regions })
}

/// A ring record: `[u32 length][u32 kind = 1][message]`, padded to 64 bytes.
fn record(m: &Message) -> Vec<u8> {
    let enc = m.encode();
    let mut b = ((8 + enc.len()) as u32).to_le_bytes().to_vec();
    b.extend_from_slice(&1u32.to_le_bytes());
    b.extend_from_slice(&enc);
    b.resize(b.len().next_multiple_of(64), 0);
    b
}

fn message() -> impl Strategy<Value = Message> {
    let target = (
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        0u32..4096,
        0u32..300,
    )
        .prop_map(|(pg, v, index, offset, length)| IoTarget {
            pg: PgId(pg),
            object: ObjectId {
                volume: VolumeId(v),
                index,
            },
            offset,
            length,
        });
    prop_oneof![
        (any::<u64>(), any::<u64>()).prop_map(|(id, e)| Message::Ping {
            id: RequestId(id),
            epoch: Epoch(e),
        }),
        (any::<u64>(), target.clone()).prop_map(|(id, target)| Message::Read {
            id: RequestId(id),
            epoch: Epoch(1),
            target,
            flags: 0,
            remote: None,
        }),
        (any::<u64>(), target, any::<u8>()).prop_map(|(id, target, fill)| Message::Write {
            data: PayloadBuf::copy_from(&vec![fill; target.length as usize]),
            id: RequestId(id),
            epoch: Epoch(1),
            target,
            flags: 0,
            seq: PgSeq(0),
            op: OpId::NONE,
            remote: None,
        }),
    ]
}

fn check_record(prod: u64, cons: u64, window: &[u8]) {
    if let Ok(Some(m)) = decode_ring_record(prod, cons, window) {
        let enc = m.encode();
        assert!(enc.len() <= 128 + PAYLOAD_BYTES_MAX as usize);
        // What decodes is the message the record's bytes hold.
        assert_eq!(&window[8..8 + enc.len()], &enc[..]);
    }
}

proptest! {
    #![proptest_config(config(512, SEED))]

    #[test]
    fn hellos_take_arbitrary_bytes(b in proptest::collection::vec(any::<u8>(), 0..(HELLO_BYTES + 8))) {
        check_hello(&b);
    }

    #[test]
    fn hellos_round_trip_and_survive_mutation(h in hello(), m in mutations(6)) {
        let mut b = encode_hello(&h);
        prop_assert_eq!(decode_hello(&b), Ok(h));
        mutate(&mut b, &m);
        check_hello(&b);
    }

    #[test]
    fn ring_records_take_arbitrary_positions_and_bytes(
        prod in any::<u64>(),
        cons in any::<u64>(),
        window in proptest::collection::vec(any::<u8>(), 0..400),
    ) {
        check_record(prod, cons, &window);
        // Near the consumer, where positions pass the first checks.
        check_record(cons.wrapping_add(prod % 1024), cons, &window);
    }

    #[test]
    fn ring_records_decode_and_survive_mutation(
        msg in message(),
        lap in 0u64..4,
        slot in 0u64..1000,
        extra in 0u64..256,
        m in mutations(6),
    ) {
        let mut rec = record(&msg);
        let cons = lap * RING_BYTES as u64 + slot * 64;
        let prod = cons + rec.len() as u64 + extra * 64;
        let got = decode_ring_record(prod, cons, &rec);
        prop_assert!(matches!(&got, Ok(Some(d)) if d.encode() == msg.encode()), "{:?}", got);
        mutate(&mut rec, &m);
        check_record(prod, cons, &rec);
    }
}

/// A pad record is accepted only where it reaches the ring's end, and a record may
/// never run past it.
#[test]
fn pad_records_and_the_ring_end() {
    let pad = |len: u32| {
        let mut b = len.to_le_bytes().to_vec();
        b.extend_from_slice(&2u32.to_le_bytes());
        b
    };
    let near_end = RING_BYTES as u64 - 64;
    assert!(matches!(
        decode_ring_record(near_end + 64, near_end, &pad(64)),
        Ok(None)
    ));
    assert!(decode_ring_record(near_end + 64, near_end, &pad(8)).is_err());
    assert!(decode_ring_record(near_end + 128, near_end, &pad(128)).is_err());
    let ping = record(&Message::Ping {
        id: RequestId(1),
        epoch: Epoch(1),
    });
    let start = RING_BYTES as u64 - 64;
    assert!(decode_ring_record(start + 256, start, &ping).is_err());
}
