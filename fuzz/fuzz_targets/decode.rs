//! Fuzzes the decoder of every Flame protocol message and of the header.
//!
//! Each input is decoded twice: as it is, and with its two header checksums and its
//! payload checksum recomputed (so that mutations reach the field checks of every
//! message instead of stopping at a checksum). Whatever decodes must re-encode to
//! exactly the bytes it came from; nothing may panic; the payload allocation is
//! bounded by `PAYLOAD_BYTES_MAX` (libFuzzer's `-rss_limit_mb` / `-malloc_limit_mb`
//! catch anything larger). The same properties run in CI, seeded and bounded, in
//! `flame-common/src/protocol.rs` (`decoding_arbitrary_bytes_never_panics_and_roundtrips`).
#![no_main]

use flame_common::protocol::{HEADER_LEN, HEADER_PREFIX_LEN, Header, Message, PAYLOAD_BYTES_MAX};
use libfuzzer_sys::fuzz_target;

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}

fn fix_checksums(b: &mut [u8]) {
    if b.len() < HEADER_LEN {
        return;
    }
    let c = crc32c::crc32c(&b[0..60]);
    b[60..64].copy_from_slice(&c.to_le_bytes());
    let plen = (u32_at(b, 48) as usize).min(b.len() - HEADER_LEN);
    let c = crc32c::crc32c(&b[HEADER_LEN..HEADER_LEN + plen]);
    b[72..76].copy_from_slice(&c.to_le_bytes());
    let c = crc32c::crc32c(&b[64..124]);
    b[124..128].copy_from_slice(&c.to_le_bytes());
}

fn check(b: &[u8]) {
    if let Some(p) = b.get(..HEADER_PREFIX_LEN) {
        let _ = Header::check_prefix(p.try_into().unwrap());
    }
    if let Some(hb) = b.get(..HEADER_LEN)
        && let Ok(h) = Header::decode(hb.try_into().unwrap())
    {
        assert!(h.payload_len <= PAYLOAD_BYTES_MAX);
        assert_eq!(&h.encode()[..], hb, "header re-encodes differently");
    }
    if let Ok(Some((m, used))) = Message::decode(b) {
        assert!(used <= b.len());
        assert_eq!(m.encode(), &b[..used], "{m:?} re-encodes differently");
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    let mut fixed = data.to_vec();
    fix_checksums(&mut fixed);
    check(&fixed);
});
