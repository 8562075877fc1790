//! Property tests of the rdma transport's wire decoders
//! (`src/transport/rdma/wire.rs`, feature `rdma`; pure code, so they run without a
//! device): the bootstrap `ConnInfo`, the SEND `FrameHeader`, work-request ids and
//! the `StreamDecoder` that cuts messages out of received chunks. Arbitrary and
//! mutated inputs are accepted or refused, never a panic or an allocation beyond
//! the header's bound; encodings round-trip; any chunking of a valid stream gives
//! back its messages. `scripts/test.sh` runs them with `cargo test -p flame-common
//! --features rdma rdma` (every test name starts with `rdma_`).
//!
//! Seeded and bounded (`PROPTEST_CASES` / `PROPTEST_RNG_SEED` override); the
//! cargo-fuzz target is `fuzz/fuzz_targets/rdma_wire.rs` (`--features rdma`).
#![cfg(feature = "rdma")]

use flame_common::buffer::PayloadBuf;
use flame_common::fuzzing::mutate;
use flame_common::fuzzing::props::{config, mutations};
use flame_common::ids::{Epoch, ObjectId, OpId, PgId, PgSeq, RequestId, VolumeId};
use flame_common::protocol::{IoTarget, Message, PAYLOAD_BYTES_MAX};
use flame_common::transport::rdma::wire::*;
use proptest::prelude::*;

/// This file's proptest seed (`config`).
const SEED: u64 = 0xf1a3_0005;

fn conn_info() -> impl Strategy<Value = ConnInfo> {
    (
        any::<u16>(),
        0..=QP_NUM_MASK,
        0..=QP_NUM_MASK,
        any::<[u8; 16]>(),
        1u8..=5,
        RECV_SLOTS_MIN..=RECV_SLOTS_MAX,
        SLOT_BYTES_MIN..=SLOT_BYTES_MAX,
    )
        .prop_map(
            |(lid, qp_num, psn, gid, mtu, recv_slots, slot_bytes)| ConnInfo {
                lid,
                qp_num,
                psn,
                gid,
                mtu,
                recv_slots,
                slot_bytes,
            },
        )
}

fn check_conn_info(b: &[u8; CONN_INFO_LEN]) {
    if let Ok(i) = ConnInfo::decode(b) {
        assert!((RECV_SLOTS_MIN..=RECV_SLOTS_MAX).contains(&i.recv_slots));
        assert!((SLOT_BYTES_MIN..=SLOT_BYTES_MAX).contains(&i.slot_bytes));
        // Byte 33 and 40..44 are not read: the checksum covers them, so only
        // what the encoder writes there (zero) decodes.
        let mut e = i.encode();
        e[33] = b[33];
        e[40..44].copy_from_slice(&b[40..44]);
        e[44..48].copy_from_slice(&b[44..48]);
        assert_eq!(&e, b);
    }
}

fn message() -> impl Strategy<Value = Message> {
    (
        any::<u64>(),
        any::<u64>(),
        0u32..2000,
        any::<u8>(),
        any::<bool>(),
    )
        .prop_map(|(id, index, length, fill, write)| {
            let target = IoTarget {
                pg: PgId(1),
                object: ObjectId {
                    volume: VolumeId(2),
                    index,
                },
                offset: 0,
                length,
            };
            if write {
                Message::Write {
                    id: RequestId(id),
                    epoch: Epoch(3),
                    target,
                    flags: 0,
                    seq: PgSeq(0),
                    op: OpId::NONE,
                    remote: None,
                    data: PayloadBuf::copy_from(&vec![fill; length as usize]),
                }
            } else {
                Message::Ping {
                    id: RequestId(id),
                    epoch: Epoch(3),
                }
            }
        })
}

/// Feeds `stream` in chunks of the given sizes; returns the messages and whether
/// it stopped at an error. Bounded: every call consumes input or ends.
fn decode_stream(stream: &[u8], chunks: &[usize]) -> (Vec<Message>, bool) {
    let mut d = StreamDecoder::default();
    let mut out = Vec::new();
    let mut at = 0;
    let mut sizes = chunks.iter().copied().cycle();
    while at < stream.len() {
        let n = sizes.next().unwrap_or(1).max(1).min(stream.len() - at);
        let mut chunk = &stream[at..at + n];
        at += n;
        while !chunk.is_empty() {
            let (used, m) = d.feed(chunk, PayloadAlloc::Fallback);
            assert!(used <= chunk.len());
            chunk = &chunk[used..];
            match m {
                Some(Ok(m)) => out.push(m),
                Some(Err(_)) => return (out, true),
                None => assert!(chunk.is_empty(), "stopped with input left and no wait"),
            }
        }
    }
    (out, false)
}

proptest! {
    #![proptest_config(config(512, SEED))]

    #[test]
    fn rdma_conn_info_takes_any_bytes(b in any::<[u8; CONN_INFO_LEN]>(), fix in any::<bool>()) {
        let mut b = b;
        if fix {
            // Past the checksum and the magic, to the field checks.
            b[0..4].copy_from_slice(&CONN_INFO_MAGIC.to_le_bytes());
            b[4..6].copy_from_slice(&CONN_INFO_VERSION.to_le_bytes());
            let crc = crc32c::crc32c(&b[..44]);
            b[44..48].copy_from_slice(&crc.to_le_bytes());
        }
        check_conn_info(&b);
    }

    #[test]
    fn rdma_conn_info_round_trips_and_survives_mutation(
        i in conn_info(),
        m in mutations(6),
        fix in any::<bool>(),
    ) {
        let b = i.encode();
        prop_assert_eq!(ConnInfo::decode(&b), Ok(i));
        let mut v = b.to_vec();
        mutate(&mut v, &m);
        v.resize(CONN_INFO_LEN, 0);
        let mut mb = [0u8; CONN_INFO_LEN];
        mb.copy_from_slice(&v);
        if fix {
            let crc = crc32c::crc32c(&mb[..44]);
            mb[44..48].copy_from_slice(&crc.to_le_bytes());
        }
        check_conn_info(&mb);
    }

    #[test]
    fn rdma_frame_headers_and_wr_ids_take_any_input(
        b in proptest::collection::vec(any::<u8>(), 0..16),
        byte_len in prop_oneof![0u32..64, any::<u32>()],
        slot_bytes in prop_oneof![0u32..64, any::<u32>()],
        credits in any::<u16>(),
        len in 0u32..SLOT_BYTES_MAX,
        v in any::<u64>(),
    ) {
        if let Ok(h) = FrameHeader::decode(&b, byte_len, slot_bytes) {
            prop_assert_eq!(&h.encode()[..], &b[..FRAME_HEADER_LEN]);
            prop_assert_eq!(h.len as usize + FRAME_HEADER_LEN, byte_len as usize);
        }
        let h = FrameHeader { kind: FrameKind::Data, credits, len };
        let n = len + FRAME_HEADER_LEN as u32;
        prop_assert_eq!(FrameHeader::decode(&h.encode(), n, n), Ok(h));
        if let Some(w) = WrId::decode(v) {
            prop_assert_eq!(w.encode(), v);
        }
    }

    #[test]
    fn rdma_stream_decoder_survives_mutated_streams(
        msgs in proptest::collection::vec(message(), 1..5),
        chunks in proptest::collection::vec(1usize..300, 1..6),
        m in mutations(6),
    ) {
        let mut stream: Vec<u8> = msgs.iter().flat_map(|m| m.encode()).collect();
        let (got, failed) = decode_stream(&stream, &chunks);
        prop_assert!(!failed);
        prop_assert_eq!(got.len(), msgs.len());
        for (a, b) in got.iter().zip(&msgs) {
            prop_assert_eq!(a.encode(), b.encode());
        }
        mutate(&mut stream, &m);
        let (got, _) = decode_stream(&stream, &chunks);
        for g in got {
            prop_assert!(g.encode().len() <= 128 + PAYLOAD_BYTES_MAX as usize);
        }
    }

    #[test]
    fn rdma_stream_decoder_takes_arbitrary_bytes(
        b in proptest::collection::vec(any::<u8>(), 0..400),
        chunks in proptest::collection::vec(1usize..200, 1..4),
    ) {
        decode_stream(&b, &chunks);
    }
}
