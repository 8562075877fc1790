//! An OSD that has not yet heard of the newest map epoch must not serve a request
//! with its stale acting set.
//!
//! The first OSD of a cluster boots with a map that lists only itself (epoch 2). If
//! it served a write carrying a newer epoch with that map, it would be "primary" of
//! every placement group with no replicas, apply the write alone and acknowledge it
//! with one copy instead of three. Here the OSDs heartbeat only every 30 s, so the
//! epoch a request carries is their only news of the map, and the write is sent the
//! way any client sends it (HELLO, then WRITE with the client's epoch).

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::ids::{ObjectId, PgSeq, RequestId};
use flame_common::placement;
use flame_common::protocol::{HEADER_LEN, Header, IoTarget, Message, status};
use flame_tests::{ClusterOptions, TestCluster};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

fn send(s: &mut TcpStream, msg: &Message) {
    let (h, payload) = msg.to_header();
    s.write_all(&h.encode()).unwrap();
    s.write_all(&payload).unwrap();
}

fn recv(s: &mut TcpStream) -> Message {
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb).expect("no reply from the OSD");
    let h = Header::decode(&hb).expect("bad reply header");
    let mut payload = vec![0u8; h.payload_len as usize];
    s.read_exact(&mut payload).unwrap();
    Message::from_parts(&h, flame_common::buffer::PayloadBuf::copy_from(&payload))
        .expect("bad reply")
}

#[test]
fn a_write_meeting_a_stale_primary_is_never_acknowledged_with_fewer_copies() {
    // Heartbeats every 30 s need a lease of 60 s (twice the interval), and the
    // lease rule then needs a grace above 90 s and a report silence of 90 s: an
    // OSD refuses to run otherwise (flame_common::timing).
    let cluster = TestCluster::start_with(ClusterOptions {
        osd_heartbeat_interval_ms: 30_000,
        heartbeat_grace_ms: 100_000,
        mgr_extra_yaml: "failure_report_min_silence_ms: 90000\n".into(),
        osds_one_by_one: true,
        ..ClusterOptions::default()
    });
    let vol = cluster.create_volume("stale", 256 << 20);
    let map = cluster.map();
    // The first OSD process booted first: its own map lists only itself.
    let first = map
        .osds
        .values()
        .find(|o| o.addr == cluster.osd_addr(0, 0))
        .expect("first OSD not in the map")
        .clone();
    // An object whose primary (in the current map) is that OSD.
    let (object, loc) = (0..64)
        .map(|index| {
            let object = ObjectId {
                volume: vol.id,
                index,
            };
            (object, placement::locate(&map, object))
        })
        .find(|(_, loc)| loc.osds[0] == first.id)
        .expect("no object with the first OSD as primary among 64");
    let shard = first.shard_of(loc.pg);
    let data = vec![0x5au8; 4096];

    let deadline = Instant::now() + Duration::from_secs(30);
    let mut id = 0u64;
    loop {
        let mut s = TcpStream::connect(cluster.osd_addr(0, shard)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        id += 1;
        send(
            &mut s,
            &cluster.hello(first.id, shard, map.epoch, false, 0, 0),
        );
        let hello = recv(&mut s);
        assert!(
            matches!(hello, Message::HelloReply { status: 0, .. }),
            "{hello:?}"
        );
        id += 1;
        send(
            &mut s,
            &Message::Write {
                id: RequestId(id),
                epoch: map.epoch,
                target: IoTarget {
                    pg: loc.pg,
                    object,
                    offset: 0,
                    length: 4096,
                },
                flags: 0,
                seq: PgSeq(0),
                op: flame_common::ids::OpId::NONE,
                remote: None,
                data: flame_common::buffer::PayloadBuf::copy_from(&data),
            },
        );
        match recv(&mut s) {
            Message::Reply { status: 0, .. } => break,
            Message::Reply { status: st, .. } if st == status::EAGAIN || st == status::ESTALE => {
                // Not acknowledged: fine, as long as a retry eventually succeeds.
                assert!(
                    Instant::now() < deadline,
                    "write never succeeded (last status {st})\n{}",
                    cluster.log_tails()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            other => panic!("unexpected reply {other:?}\n{}", cluster.log_tails()),
        }
    }

    // Acknowledged: every copy of the acting set has it.
    for osd in 0..cluster.osd_count() {
        let path = cluster.object_path(osd, vol.id, object.index);
        let got = cluster
            .object_data(osd, vol.id, object.index)
            .unwrap_or_default();
        assert!(
            got.len() >= 4096 && got[..4096] == data[..],
            "write acknowledged by {} (primary, {}), but harness osd.{osd} has no copy \
             at {}: the primary served it with its stale map\n{}",
            first.id,
            loc.pg,
            path.display(),
            cluster.log_tails()
        );
    }
}
