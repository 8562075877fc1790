//! Fuzzes the reply-payload decoders (`flame-common/src/protocol.rs`): object
//! lists, block sums, scrub counts, log ops, reply-area info. Input byte 0 picks the mode:
//! the rest as it is, or a valid encoding (chosen and sized by the input) damaged
//! by the mutations the rest encodes. Whatever decodes must re-encode to the same
//! bytes; nothing may panic. The same properties run in CI, seeded and bounded, in
//! `protocol.rs` (`payload_props`).
#![no_main]

use flame_common::fuzzing::{mutate, mutations_from};
use flame_common::ids::{ObjectId, VolumeId};
use flame_common::protocol::*;
use libfuzzer_sys::fuzz_target;

fn check(b: &[u8]) {
    if let Some(l) = decode_object_list(b) {
        assert!(l.len() <= PG_LIST_MAX as usize);
        assert_eq!(encode_object_list(&l), b);
    }
    if let Some(s) = decode_block_sums(b) {
        let e = encode_block_sums(&s);
        assert_eq!(&b[..e.len()], &e[..]);
        assert!(b[e.len()..].iter().all(|&x| x == 0));
    }
    if let Some(c) = ScrubCounts::decode(b) {
        assert_eq!(c.encode(), b);
        let mut t = c;
        t.add(&c);
    }
    if let Some(l) = decode_log_ops(b) {
        assert!(l.ops.len() <= PG_LIST_MAX as usize);
        assert_eq!(encode_log_ops(&l), b);
    }
    if let Some(r) = ReplyAreaInfo::decode(b) {
        assert_eq!(r.encode(), b);
        let _ = r.slot(r.slots - 1, r.slot_bytes);
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 2 == 0 {
        check(rest);
        return;
    }
    let n = usize::from(mode >> 3);
    let mut b = match mode % 8 {
        1 => encode_object_list(
            &(0..n as u64)
                .map(|i| ObjectId {
                    volume: VolumeId(i),
                    index: i * 7,
                })
                .collect::<Vec<_>>(),
        ),
        3 => encode_block_sums(
            &(0..n as u32)
                .map(|i| BlockSum {
                    sum: i.wrapping_mul(0x9e37_79b9),
                    bad: i % 3 == 0,
                })
                .collect::<Vec<_>>(),
        ),
        5 => ScrubCounts {
            objects_checked: n as u64,
            inconsistent: 1,
            repaired: 2,
            primary_won: 3,
            errors: u64::MAX,
        }
        .encode(),
        _ => ReplyAreaInfo {
            remote: RemoteBuf {
                addr: 1 << 20,
                len: (n as u32 + 1) * 4096,
                key: 9,
            },
            slots: n as u32 + 1,
            slot_bytes: 4096,
        }
        .encode(),
    };
    mutate(&mut b, &mutations_from(rest, 16));
    check(&b);
});
