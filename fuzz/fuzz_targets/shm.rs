//! Fuzzes the shm transport's decoders of peer-written bytes
//! (`flame-common/src/transport/shm.rs`): the hello (`decode_hello`) and the ring
//! records (`decode_ring_record`: positions, record length and kind, the header,
//! the payload bound). Input byte 0 picks which; for records, the next 16 bytes
//! are the producer and consumer positions (the producer near the consumer for
//! odd modes) and the rest is the ring from the consumer's offset. Nothing may
//! panic; a hello that decodes has at most `REGIONS_MAX` regions. Property tests:
//! `flame-common/tests/shm_decode_props.rs`.
#![no_main]

use flame_common::transport::shm::{REGIONS_MAX, decode_hello, decode_ring_record};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if mode % 4 == 0 {
        if let Ok(h) = decode_hello(rest) {
            assert!(h.regions.len() <= REGIONS_MAX);
        }
        return;
    }
    if rest.len() < 16 {
        return;
    }
    let u64_at = |o: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&rest[o..o + 8]);
        u64::from_le_bytes(a)
    };
    let cons = u64_at(8);
    let prod = if mode % 2 == 1 {
        cons.wrapping_add(u64_at(0) % (1 << 24))
    } else {
        u64_at(0)
    };
    if let Ok(Some(m)) = decode_ring_record(prod, cons, &rest[16..]) {
        // The record holds exactly that message's encoding.
        let enc = m.encode();
        assert_eq!(&rest[16 + 8..16 + 8 + enc.len()], &enc[..]);
    }
});
