//! Fuzzes the rdma transport's wire decoders
//! (`flame-common/src/transport/rdma/wire.rs`; `--features rdma`): `ConnInfo`,
//! `FrameHeader`, `WrId` and the `StreamDecoder` fed the input in chunks whose
//! sizes the input's first byte picks. Nothing may panic; what decodes re-encodes
//! to the same bytes. Property tests: `flame-common/tests/rdma_wire_props.rs`.
#![no_main]

use flame_common::transport::rdma::wire::*;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    if let Some(b) = rest.get(..CONN_INFO_LEN) {
        let mut a = [0u8; CONN_INFO_LEN];
        a.copy_from_slice(b);
        if mode & 1 == 1 {
            a[0..4].copy_from_slice(&CONN_INFO_MAGIC.to_le_bytes());
            a[4..6].copy_from_slice(&CONN_INFO_VERSION.to_le_bytes());
            let crc = crc32c::crc32c(&a[..44]);
            a[44..48].copy_from_slice(&crc.to_le_bytes());
        }
        if let Ok(i) = ConnInfo::decode(&a) {
            assert!((RECV_SLOTS_MIN..=RECV_SLOTS_MAX).contains(&i.recv_slots));
        }
    }
    if rest.len() >= 16 {
        let byte_len = u32::from_le_bytes([rest[8], rest[9], rest[10], rest[11]]);
        let slot = u32::from_le_bytes([rest[12], rest[13], rest[14], rest[15]]);
        if let Ok(h) = FrameHeader::decode(&rest[..8], byte_len, slot) {
            assert_eq!(&h.encode()[..], &rest[..8]);
        }
        let mut v = [0u8; 8];
        v.copy_from_slice(&rest[..8]);
        if let Some(w) = WrId::decode(u64::from_le_bytes(v)) {
            assert_eq!(w.encode(), u64::from_le_bytes(v));
        }
    }
    let chunk = usize::from(mode >> 1) + 1;
    let mut d = StreamDecoder::default();
    for mut c in rest.chunks(chunk) {
        while !c.is_empty() {
            let (used, m) = d.feed(c, PayloadAlloc::Fallback);
            c = &c[used..];
            match m {
                Some(Err(_)) => return,
                Some(Ok(_)) => {}
                None => assert!(c.is_empty()),
            }
        }
    }
});
