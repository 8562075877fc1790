//! The OSD's wire protocol, spoken directly (no client library): a scripted client
//! against three real OSD processes and a real manager.
//!
//! Checks that a write acknowledged by the primary is on all three OSDs' disks,
//! byte for byte; that overlapping pipelined writes leave identical copies; that
//! non-primaries and wrong shards refuse I/O with ESTALE; and that a write whose
//! replica is gone is refused with EAGAIN, never acknowledged.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::ids::{Epoch, ObjectId, OsdId, PgSeq, RequestId};
use flame_common::map::ClusterMap;
use flame_common::placement::locate;
use flame_common::protocol::{self, IoTarget, Message, status};
use flame_common::reactor::{Reactor, ReactorConfig};
use flame_common::transport::{Conn, TransportKind};
use flame_tests::{ClusterOptions, HelloMaker, TestCluster};
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(5);

/// Index of the test's OSD process that has map id `id`.
fn process_of(cluster: &TestCluster, map: &ClusterMap, id: OsdId) -> usize {
    let addr = map.osds[&id].addr;
    (0..cluster.osd_count())
        .find(|&i| cluster.osd_addr(i, 0) == addr)
        .expect("OSD process for map entry")
}

async fn connect(hm: &HelloMaker, map: &ClusterMap, osd: OsdId, shard: u16) -> Conn {
    connect_as(hm, map, osd, shard, 0, 0).await
}

/// Connects with a fencing session and generation (0, 0: no fencing).
async fn connect_as(
    hm: &HelloMaker,
    map: &ClusterMap,
    osd: OsdId,
    shard: u16,
    session: u64,
    generation: u64,
) -> Conn {
    let info = &map.osds[&osd];
    let conn = Conn::connect(TransportKind::Tcp, info.shard_addr(shard), TIMEOUT)
        .await
        .expect("connect");
    conn.send(&hm.hello(osd, shard, map.epoch, false, session, generation))
        .unwrap();
    match conn.recv().await.unwrap() {
        Message::HelloReply {
            status: 0,
            shards,
            shard: theirs,
            versions,
            ..
        } => {
            assert_eq!(shards, info.shards);
            assert_eq!(theirs, shard);
            assert_eq!(versions, protocol::VERSIONS);
        }
        other => panic!("hello refused: {other:?}"),
    }
    conn
}

fn target(map: &ClusterMap, object: ObjectId, offset: u32, length: u32) -> IoTarget {
    IoTarget {
        pg: locate(map, object).pg,
        object,
        offset,
        length,
    }
}

async fn call(conn: &Conn, msg: Message) -> Message {
    conn.send(&msg).unwrap();
    conn.recv().await.unwrap()
}

/// Like `call`, but retries while the OSD answers ESTALE (or, with `also_eagain`,
/// EAGAIN), as a client does: an OSD fetches a newer map as soon as it sees a
/// request carrying one, but the first request may find it (or a replica, which the
/// primary reports as EAGAIN) a heartbeat behind. After an OSD returns, recovery
/// reports move the map every few milliseconds and a replica refuses forwards from
/// an older epoch, so on a loaded two-core machine this can take seconds: 30 s.
///
/// After ESTALE from an OSD whose map is newer, the request goes again under that
/// epoch, as a client's does once it fetched the newer map: a primary refuses a
/// client write sent under a map older than its group's interval, and recovery
/// after a restart starts new intervals.
async fn call_retry(conn: &Conn, mut msg: Message, also_eagain: bool) -> Message {
    for _ in 0..600 {
        let reply = call(conn, msg.clone()).await;
        let st = status_of(&reply);
        if st != status::ESTALE && !(also_eagain && st == status::EAGAIN) {
            return reply;
        }
        if st == status::ESTALE && reply.epoch() > msg.epoch() {
            set_epoch(&mut msg, reply.epoch());
        }
        flame_common::reactor::sleep(Duration::from_millis(50)).await;
    }
    panic!("OSD kept asking for a retry for 30 s");
}

/// `msg` sent under `to` (the requests `call_retry` resends).
fn set_epoch(msg: &mut Message, to: flame_common::ids::Epoch) {
    match msg {
        Message::Read { epoch, .. }
        | Message::Write { epoch, .. }
        | Message::WriteZeroes { epoch, .. }
        | Message::Discard { epoch, .. }
        | Message::Flush { epoch, .. }
        | Message::Ping { epoch, .. } => *epoch = to,
        other => panic!("call_retry does not resend {:?}", other.op()),
    }
}

fn status_of(m: &Message) -> i32 {
    match m {
        Message::Reply { status, .. } => *status,
        other => panic!("not a reply: {other:?}"),
    }
}

fn read(map: &ClusterMap, id: u64, object: ObjectId, offset: u32, len: u32) -> Message {
    Message::Read {
        id: RequestId(id),
        epoch: map.epoch,
        target: target(map, object, offset, len),
        flags: 0,
        remote: None,
    }
}

fn write(map: &ClusterMap, id: u64, object: ObjectId, offset: u32, data: Vec<u8>) -> Message {
    Message::Write {
        id: RequestId(id),
        epoch: map.epoch,
        target: target(map, object, offset, data.len() as u32),
        flags: 0,
        seq: PgSeq(0),
        op: flame_common::ids::OpId::NONE,
        remote: None,
        data: flame_common::buffer::PayloadBuf::copy_from(&data),
    }
}

#[test]
fn replicated_writes_reach_every_copy_in_one_order() {
    let cluster = TestCluster::start();
    let vol = cluster.create_volume("proto", 64 << 20);
    let map = cluster.map();
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let hm = cluster.hello_maker();
    let m = map.clone();
    reactor
        .block_on(async move {
            for index in 0..4u64 {
                let object = ObjectId {
                    volume: vol.id,
                    index,
                };
                let loc = locate(&m, object);
                assert_eq!(loc.osds.len(), 3);
                let shard = m.osds[&loc.osds[0]].shard_of(loc.pg);
                let conn = connect(&hm, &m, loc.osds[0], shard).await;
                // A pattern at an unaligned offset.
                let data: Vec<u8> = (0..5000u32).map(|i| (i as u8) ^ (index as u8)).collect();
                assert_eq!(
                    status_of(
                        &call_retry(&conn, write(&m, 1, object, 777, data.clone()), true).await
                    ),
                    status::OK
                );
                let r = call(&conn, read(&m, 2, object, 0, 8192)).await;
                let Message::Reply {
                    status: 0,
                    data: back,
                    ..
                } = r
                else {
                    panic!("read failed: {r:?}")
                };
                assert!(back[..777].iter().all(|&b| b == 0));
                assert_eq!(&back[777..5777], &data[..]);
                // Pipelined overlapping writes: 64 writes of distinct patterns over the
                // same few KiB, sent without waiting. All copies must end equal.
                for k in 0..64u64 {
                    let fill = vec![
                        (k as u8).wrapping_mul(3).wrapping_add(1);
                        4096 - (k as usize % 7) * 100
                    ];
                    conn.send(&write(
                        &m,
                        100 + k,
                        object,
                        65536 + (k as u32 % 5) * 64,
                        fill,
                    ))
                    .unwrap();
                }
                for _ in 0..64 {
                    assert_eq!(status_of(&conn.recv().await.unwrap()), status::OK);
                }
                let f = call(
                    &conn,
                    Message::Flush {
                        id: RequestId(3),
                        epoch: m.epoch,
                        flags: 0,
                        volume: vol.id,
                    },
                )
                .await;
                assert_eq!(status_of(&f), status::OK);
                // A replica refuses client I/O: it is not the primary.
                let rshard = m.osds[&loc.osds[1]].shard_of(loc.pg);
                let rconn = connect(&hm, &m, loc.osds[1], rshard).await;
                assert_eq!(
                    status_of(&call(&rconn, read(&m, 4, object, 0, 16)).await),
                    status::ESTALE
                );
                // The primary's other shard refuses too: wrong shard for this PG.
                let other_shard = (shard + 1) % m.osds[&loc.osds[0]].shards;
                let oconn = connect(&hm, &m, loc.osds[0], other_shard).await;
                assert_eq!(
                    status_of(&call(&oconn, read(&m, 5, object, 0, 16)).await),
                    status::ESTALE
                );
                // Beyond the object is invalid.
                let r = call(&conn, read(&m, 6, object, m.pool.object_size - 8, 16)).await;
                assert_eq!(status_of(&r), status::EINVAL);
            }
        })
        .unwrap();
    // Every copy holds identical bytes, and no other OSD holds the object.
    for index in 0..4u64 {
        let object = ObjectId {
            volume: vol.id,
            index,
        };
        let loc = locate(&map, object);
        let copies: Vec<Vec<u8>> = loc
            .osds
            .iter()
            .map(|id| {
                let i = process_of(&cluster, &map, *id);
                cluster.object_data(i, vol.id, index).unwrap_or_else(|| {
                    panic!(
                        "{} missing",
                        cluster.object_path(i, vol.id, index).display()
                    )
                })
            })
            .collect();
        assert!(copies[0].len() > 65536);
        assert_eq!(
            copies[0], copies[1],
            "primary and replica 1 differ for object {index}"
        );
        assert_eq!(
            copies[0], copies[2],
            "primary and replica 2 differ for object {index}"
        );
        for i in 0..cluster.osd_count() {
            let holds = loc
                .osds
                .iter()
                .any(|id| process_of(&cluster, &map, *id) == i);
            assert_eq!(cluster.object_path(i, vol.id, index).exists(), holds);
        }
    }
}

#[test]
fn write_with_a_dead_replica_is_refused_not_acknowledged() {
    let mut cluster = TestCluster::start();
    let vol = cluster.create_volume("dead", 16 << 20);
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let loc = locate(&map, object);
    let victim = process_of(&cluster, &map, loc.osds[2]);
    cluster.kill_osd(victim);
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let hm = cluster.hello_maker();
    let m = map.clone();
    let l = loc.clone();
    reactor
        .block_on(async move {
            let shard = m.osds[&l.osds[0]].shard_of(l.pg);
            let conn = connect(&hm, &m, l.osds[0], shard).await;
            let st = status_of(
                &call_retry(&conn, write(&m, 1, object, 0, vec![0xee; 4096]), false).await,
            );
            assert_eq!(st, status::EAGAIN);
            // Reads of the placement group still work from the primary.
            assert_eq!(
                status_of(&call(&conn, read(&m, 2, object, 0, 16)).await),
                status::OK
            );
        })
        .unwrap();
    // Back up: writes are acknowledged again (the primary reconnects).
    cluster.restart_osd(victim);
    cluster.wait_osds_up(3);
    let m = cluster.map();
    let st = reactor
        .block_on(async move {
            let shard = m.osds[&loc.osds[0]].shard_of(loc.pg);
            let conn = connect(&hm, &m, loc.osds[0], shard).await;
            status_of(&call_retry(&conn, write(&m, 3, object, 0, vec![0xef; 4096]), true).await)
        })
        .unwrap();
    assert_eq!(
        st,
        status::OK,
        "write after the replica returned was not acknowledged"
    );
}

#[test]
fn a_small_shard_byte_bound_slows_clients_but_never_deadlocks() {
    // 16 MiB per shard, while one connection pipelines 48 writes of 1 MiB (3× the
    // bound) and each write also occupies the replicas' shards: every write must
    // still be acknowledged, and the copies must agree.
    let opts = ClusterOptions {
        osd_extra_yaml: "max_inflight_bytes_per_shard: 16777216".into(),
        ..ClusterOptions::default()
    };
    let cluster = TestCluster::start_with(opts);
    let vol = cluster.create_volume("bound", 64 << 20);
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let loc = locate(&map, object);
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let hm = cluster.hello_maker();
    let m = map.clone();
    let l = loc.clone();
    reactor
        .block_on(async move {
            let shard = m.osds[&l.osds[0]].shard_of(l.pg);
            let conn = connect(&hm, &m, l.osds[0], shard).await;
            // Warm up until the OSDs have the volume's epoch.
            let st =
                status_of(&call_retry(&conn, write(&m, 1, object, 0, vec![1; 4096]), true).await);
            assert_eq!(st, status::OK);
            for k in 0..48u64 {
                let data = vec![k as u8; 1 << 20];
                conn.send(&write(&m, 100 + k, object, ((k % 4) as u32) << 20, data))
                    .unwrap();
            }
            for acked in 0..48 {
                let reply =
                    futures_lite::future::or(async { Some(conn.recv().await.unwrap()) }, async {
                        flame_common::reactor::sleep(Duration::from_secs(60)).await;
                        None
                    })
                    .await;
                let reply = reply
                    .unwrap_or_else(|| panic!("only {acked} of 48 writes acknowledged in 60 s"));
                assert_eq!(status_of(&reply), status::OK);
            }
        })
        .unwrap();
    let copies: Vec<Vec<u8>> = loc
        .osds
        .iter()
        .map(|id| {
            cluster
                .object_data(process_of(&cluster, &map, *id), vol.id, 0)
                .unwrap()
        })
        .collect();
    assert_eq!(copies[0].len(), 4 << 20);
    assert_eq!(copies[0], copies[1]);
    assert_eq!(copies[0], copies[2]);
    // The last write to each MiB wins (writes to one range are ordered).
    for mib in 0..4usize {
        let last = (44 + mib) as u8;
        assert!(
            copies[0][mib << 20..(mib + 1) << 20]
                .iter()
                .all(|&b| b == last),
            "MiB {mib}"
        );
    }
}

#[test]
fn a_reconnected_session_fences_its_old_connection() {
    // A client that resends on a new connection must never have the stale original
    // (still arriving on the old connection) executed after it.
    let cluster = TestCluster::start();
    let vol = cluster.create_volume("fence", 16 << 20);
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let loc = locate(&map, object);
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let hm = cluster.hello_maker();
    reactor
        .block_on(async move {
            let m = map;
            let primary = loc.osds[0];
            let shard = m.osds[&primary].shard_of(loc.pg);
            let session = 0x5eed_u64;
            let old = connect_as(&hm, &m, primary, shard, session, 1).await;
            let st =
                status_of(&call_retry(&old, write(&m, 1, object, 0, vec![1; 4096]), true).await);
            assert_eq!(st, status::OK);
            // The session reconnects.
            let new = connect_as(&hm, &m, primary, shard, session, 2).await;
            assert_eq!(
                status_of(&call(&new, write(&m, 2, object, 0, vec![2; 4096])).await),
                status::OK
            );
            // A late request on the old connection is not executed; the connection ends.
            old.send(&write(&m, 3, object, 0, vec![3; 4096])).unwrap();
            let late = futures_lite::future::or(async { old.recv().await.ok() }, async {
                flame_common::reactor::sleep(Duration::from_secs(5)).await;
                None
            })
            .await;
            assert!(
                late.is_none(),
                "the superseded connection answered: {late:?}"
            );
            let r = call(&new, read(&m, 4, object, 0, 4096)).await;
            let Message::Reply {
                status: 0, data, ..
            } = r
            else {
                panic!("read failed: {r:?}")
            };
            assert!(data.iter().all(|&b| b == 2), "the stale write was executed");
            // A hello older than the session's newest is refused.
            let info = &m.osds[&primary];
            let stale = Conn::connect(TransportKind::Tcp, info.shard_addr(shard), TIMEOUT)
                .await
                .unwrap();
            stale
                .send(&hm.hello(primary, shard, m.epoch, false, session, 1))
                .unwrap();
            match stale.recv().await {
                Ok(Message::HelloReply { status, .. }) => assert_eq!(status, status::ESTALE),
                other => panic!("stale hello answered {other:?}"),
            }
            // Other sessions are unaffected.
            let other = connect_as(&hm, &m, primary, shard, 0xabcdef, 1).await;
            assert_eq!(
                status_of(&call(&other, read(&m, 5, object, 0, 16)).await),
                status::OK
            );
            // Session ids travel in clear. Another entity (client.admin's ticket)
            // claiming this session with the highest generation opens a session
            // of its own: the client's connection keeps executing, and the client
            // can still reconnect. Without authentication there are no entities,
            // and the claim fences the session (docs/security.md says so).
            let claim = connect_as(&hm.as_admin(), &m, primary, shard, session, u64::MAX).await;
            assert_eq!(
                status_of(&call(&claim, read(&m, 6, object, 0, 16)).await),
                status::OK
            );
            if hm.service.is_some() {
                assert_eq!(
                    status_of(&call(&new, write(&m, 7, object, 0, vec![7; 4096])).await),
                    status::OK,
                    "another entity's claim of the session fenced the client's connection"
                );
                let again = connect_as(&hm, &m, primary, shard, session, 3).await;
                assert_eq!(
                    status_of(&call(&again, read(&m, 8, object, 0, 16)).await),
                    status::OK
                );
            } else {
                new.send(&write(&m, 7, object, 0, vec![7; 4096])).unwrap();
                let late = futures_lite::future::or(async { new.recv().await.ok() }, async {
                    flame_common::reactor::sleep(Duration::from_secs(5)).await;
                    None
                })
                .await;
                assert!(late.is_none(), "without entities, a claim fences: {late:?}");
            }
        })
        .unwrap();
}

/// A peer speaking protocol version 1 (whose header is 64 bytes) is recognised from
/// those 64 bytes, answered in version 1's own format with a refusal that names both
/// versions, and disconnected; the OSD's log names both versions; and the OSD keeps
/// serving version-2 clients.
#[test]
fn a_protocol_v1_peer_is_refused_with_both_versions_named() {
    use std::io::{Read, Write};
    let cluster = TestCluster::start();
    let map = cluster.map();
    // A version-1 HELLO, byte for byte as a v1 build sent it: magic, version 1,
    // opcode 1, flags 0, request id 77, epoch, shard 0 in the offset field, crc32c
    // of bytes 0..60 at 60..64.
    let mut hello = [0u8; 64];
    hello[0..4].copy_from_slice(b"FLME");
    hello[4] = 1;
    hello[5] = 1;
    hello[8..16].copy_from_slice(&77u64.to_le_bytes());
    hello[16..24].copy_from_slice(&map.epoch.0.to_le_bytes());
    let crc = crc32c::crc32c(&hello[0..60]);
    hello[60..64].copy_from_slice(&crc.to_le_bytes());
    let mut s = std::net::TcpStream::connect(cluster.osd_addr(0, 0)).unwrap();
    s.set_read_timeout(Some(TIMEOUT)).unwrap();
    s.write_all(&hello).unwrap();
    // The OSD answers and closes: read to the end (a read timeout fails the test).
    let mut reply = Vec::new();
    s.read_to_end(&mut reply)
        .expect("the OSD neither answered and closed nor closed");
    // Decode it as a version-1 peer would.
    assert!(
        reply.len() >= 64,
        "reply of {} bytes: {reply:?}",
        reply.len()
    );
    let u32_at = |i: usize| u32::from_le_bytes(reply[i..i + 4].try_into().unwrap());
    assert_eq!(&reply[0..4], b"FLME");
    assert_eq!(reply[4], 1, "the refusal must be in the peer's version");
    assert_eq!(reply[5], 0x81, "a HELLO reply");
    assert_eq!(crc32c::crc32c(&reply[0..60]), u32_at(60), "v1 header crc");
    assert_eq!(u64::from_le_bytes(reply[8..16].try_into().unwrap()), 77);
    assert_eq!(u32_at(52) as i32, status::EPROTONOSUPPORT);
    assert_eq!(u32_at(44), u32::from(protocol::VERSION));
    assert_eq!(u32_at(48) as usize, reply.len() - 64, "payload length");
    let text = String::from_utf8(reply[64..].to_vec()).unwrap();
    assert!(
        text.contains("version 1") && text.contains(&format!("version {}", protocol::VERSION)),
        "refusal text does not name both versions: {text:?}"
    );
    // The OSD's log names both versions (bounded wait for the log line).
    let wanted = format!(
        "peer speaks Flame protocol version 1, this build speaks version {}",
        protocol::VERSION
    );
    let deadline = std::time::Instant::now() + TIMEOUT;
    while !cluster.log_tails().contains(&wanted) {
        assert!(
            std::time::Instant::now() < deadline,
            "no OSD log line {wanted:?}:\n{}",
            cluster.log_tails()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Version-2 clients are still served.
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let hm = cluster.hello_maker();
    let osd = *map.osds.keys().next().unwrap();
    reactor
        .block_on(async move {
            let conn = connect(&hm, &map, osd, 0).await;
            let pong = call_retry(
                &conn,
                Message::Ping {
                    id: RequestId(1),
                    epoch: map.epoch,
                },
                false,
            )
            .await;
            assert_eq!(status_of(&pong), status::OK);
        })
        .unwrap();
}

/// A client may not send a replica-flagged write straight to a replica: it would be
/// applied to that copy alone, outside the primary's ordering gate, and the copies
/// would diverge. Only peer (OSD-to-OSD) connections may.
#[test]
fn replica_flag_from_a_client_connection_is_refused() {
    let cluster = TestCluster::start();
    let vol = cluster.create_volume("bypass", 16 << 20);
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let loc = locate(&map, object);
    let replica = loc.osds[1];
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let hm = cluster.hello_maker();
    let m = map.clone();
    reactor
        .block_on(async move {
            let shard = m.osds[&replica].shard_of(loc.pg);
            let conn = connect(&hm, &m, replica, shard).await;
            let mut msg = write(&m, 1, object, 0, vec![0x5a; 4096]);
            if let Message::Write { flags, .. } = &mut msg {
                *flags |= flame_common::protocol::flags::REPLICA;
            }
            assert_eq!(status_of(&call(&conn, msg).await), status::EINVAL);
            // The connection stays usable for legitimate requests.
            assert_eq!(
                status_of(&call(&conn, read(&m, 2, object, 0, 16)).await),
                status::ESTALE,
                "a replica still refuses client reads as non-primary"
            );
        })
        .unwrap();
    // Nothing reached the replica's disk.
    let p = cluster.object_path(process_of(&cluster, &map, replica), vol.id, 0);
    let on_disk = std::fs::read(&p).unwrap_or_default();
    assert!(
        on_disk.iter().all(|&b| b == 0),
        "the bypassing write reached the replica's copy ({})",
        p.display()
    );
    let report = cluster.admin_json(&["scrub", "bypass"]);
    assert_eq!(report["inconsistent"].as_u64(), Some(0), "{report}");
}

/// A forged replication write — over a connection with the OSD role (a holder
/// of the OSD key), REPLICA flag, `pg_seq` u64::MAX, which would wrap when
/// that OSD later became primary — is refused by the replica: the copies stay
/// equal (scrub: 0 inconsistent) and the data the primary wrote reads back.
#[test]
fn a_forged_pg_seq_is_refused_and_changes_nothing() {
    let cluster = TestCluster::start();
    let vol = cluster.create_volume("forged", 16 << 20);
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let loc = locate(&map, object);
    let (primary, replica) = (loc.osds[0], loc.osds[1]);
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let hm = cluster.hello_maker();
    let m = map.clone();
    reactor
        .block_on(async move {
            let conn = connect(&hm, &m, primary, m.osds[&primary].shard_of(loc.pg)).await;
            let w = call_retry(&conn, write(&m, 1, object, 0, vec![0x5a; 4096]), true).await;
            assert_eq!(status_of(&w), status::OK);
            let shard = m.osds[&replica].shard_of(loc.pg);
            let peer = Conn::connect(
                TransportKind::Tcp,
                m.osds[&replica].shard_addr(shard),
                TIMEOUT,
            )
            .await
            .expect("connect");
            peer.send(&hm.hello(replica, shard, m.epoch, true, 0, 0))
                .unwrap();
            match peer.recv().await.unwrap() {
                Message::HelloReply { status: 0, .. } => {}
                other => panic!("peer hello refused: {other:?}"),
            }
            let mut forged = write(&m, 2, object, 0, vec![0x66; 4096]);
            if let Message::Write { flags, seq, .. } = &mut forged {
                *flags |= flame_common::protocol::flags::REPLICA;
                *seq = PgSeq(u64::MAX);
            }
            let st = status_of(&call(&peer, forged).await);
            assert_eq!(
                st,
                status::EINVAL,
                "a forward with pg_seq u64::MAX was not refused"
            );
            let r = call_retry(&conn, read(&m, 3, object, 0, 4096), true).await;
            match r {
                Message::Reply {
                    status: 0, data, ..
                } => assert!(data.as_slice().iter().all(|&b| b == 0x5a), "data changed"),
                other => panic!("read after the forged forward: {other:?}"),
            }
        })
        .unwrap();
    let report = cluster.admin_json(&["scrub", "forged"]);
    assert_eq!(report["inconsistent"].as_u64(), Some(0), "{report}");
    assert_eq!(report["repaired"].as_u64(), Some(0), "{report}");
}

/// An OSD refuses a write past its volume's end (and to a volume it does not know):
/// after a shrink, a client with an older map must not land bytes past the new end
/// once the trim has removed them. Discards past the end (the trim itself) pass.
#[test]
fn writes_past_the_volume_end_are_refused() {
    let cluster = TestCluster::start();
    // 6 MiB: object 0 whole, object 1 up to 2 MiB.
    let vol = cluster.create_volume("small", 6 << 20);
    let map = cluster.map();
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let hm = cluster.hello_maker();
    reactor
        .block_on(async move {
            let obj = |index| ObjectId {
                volume: vol.id,
                index,
            };
            for (object, offset, want) in [
                (obj(0), 0, status::OK),
                (obj(1), (2 << 20) - 4096, status::OK),
                (obj(1), 2 << 20, status::EINVAL),
                (obj(2), 0, status::EINVAL),
                (
                    ObjectId {
                        volume: flame_common::ids::VolumeId(vol.id.0 + 1000),
                        index: 0,
                    },
                    0,
                    status::EINVAL,
                ),
            ] {
                let loc = locate(&map, object);
                let shard = map.osds[&loc.osds[0]].shard_of(loc.pg);
                let conn = connect(&hm, &map, loc.osds[0], shard).await;
                let reply =
                    call_retry(&conn, write(&map, 1, object, offset, vec![7; 4096]), true).await;
                assert_eq!(status_of(&reply), want, "write to {object} at {offset}");
                if want != status::OK {
                    let discard = Message::Discard {
                        id: RequestId(2),
                        epoch: map.epoch,
                        target: target(&map, object, offset, 4096),
                        flags: 0,
                        seq: PgSeq(0),
                        op: flame_common::ids::OpId::NONE,
                    };
                    assert_eq!(
                        status_of(&call_retry(&conn, discard, true).await),
                        status::OK,
                        "a discard past the end (a shrink's trim) must pass"
                    );
                }
            }
        })
        .unwrap();
}

fn op_write(
    map: &ClusterMap,
    id: u64,
    object: ObjectId,
    op: flame_common::ids::OpId,
    data: Vec<u8>,
) -> Message {
    let mut m = write(map, id, object, 0, data);
    if let Message::Write { op: o, .. } = &mut m {
        *o = op;
    }
    m
}

/// A client's op ids are its entity's own (docs/security.md): another entity
/// writing the same volume's group under the client's session id, with a huge
/// sequence number, does not make the group refuse the client's next write as
/// superseded. Without authentication there are no entities: it does.
#[test]
fn a_clients_op_ids_are_scoped_to_its_entity() {
    use flame_common::ids::OpId;
    let cluster = TestCluster::start();
    let vol = cluster.create_volume("op-scope", 16 << 20);
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let loc = locate(&map, object);
    let hm = cluster.hello_maker();
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    reactor
        .block_on(async move {
            let m = map;
            let osd = loc.osds[0];
            let shard = m.osds[&osd].shard_of(loc.pg);
            let session = 0x0c11_e417_u64;
            let op = |seq| OpId { session, seq };
            let client = connect(&hm, &m, osd, shard).await;
            let other = connect(&hm.as_admin(), &m, osd, shard).await;
            let w = |id, seq, byte| op_write(&m, id, object, op(seq), vec![byte; 4096]);
            assert_eq!(
                status_of(&call_retry(&client, w(1, 5, 1), true).await),
                status::OK
            );
            assert_eq!(
                status_of(&call_retry(&other, w(2, 1 << 40, 2), true).await),
                status::OK
            );
            let next = status_of(&call_retry(&client, w(3, 6, 3), true).await);
            if hm.service.is_some() {
                assert_eq!(
                    next,
                    status::OK,
                    "another entity's op under the client's session id superseded the client's write"
                );
            } else {
                assert_eq!(next, status::SUPERSEDED, "without entities, one namespace");
            }
        })
        .unwrap();
}

/// The placement-group log is stable (issue 13): after every OSD of a group was
/// killed and restarted, an op older than a flushed newer op of its session never
/// lands over the newer bytes (before, the restarted copies had no history and
/// applied it: the read-back was the old bytes), and a retry of the flushed newer
/// op is still recognised (not applied again).
#[test]
fn an_ops_history_survives_a_restart_of_every_copy() {
    let mut cluster = TestCluster::start();
    let vol = cluster.create_volume("durable-log", 16 << 20);
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let loc = locate(&map, object);
    let op = |seq| flame_common::ids::OpId { session: 77, seq };
    let (a, b) = (vec![0xaa; 4096], vec![0xbb; 4096]);
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let hm = cluster.hello_maker();
    {
        let (m, l, a, b) = (map.clone(), loc.clone(), a.clone(), b.clone());
        reactor
            .block_on(async move {
                let shard = m.osds[&l.osds[0]].shard_of(l.pg);
                let conn = connect(&hm, &m, l.osds[0], shard).await;
                for (id, seq, data) in [(1, 5, a), (2, 6, b)] {
                    let st = status_of(
                        &call_retry(&conn, op_write(&m, id, object, op(seq), data), true).await,
                    );
                    assert_eq!(st, status::OK);
                }
                // FLUSH on every copy: the writes' data and their log records
                // become stable.
                for (i, &osd) in l.osds.iter().enumerate() {
                    let shard = m.osds[&osd].shard_of(l.pg);
                    let c = connect(&hm, &m, osd, shard).await;
                    let flush = Message::Flush {
                        id: RequestId(10 + i as u64),
                        epoch: m.epoch,
                        flags: 0,
                        volume: object.volume,
                    };
                    assert_eq!(status_of(&call(&c, flush).await), status::OK);
                }
            })
            .unwrap();
    }
    for i in 0..cluster.osd_count() {
        cluster.kill_osd(i);
    }
    for i in 0..cluster.osd_count() {
        cluster.restart_osd(i);
    }
    cluster.wait_osds_up(3);
    let m = cluster.map();
    let primary = process_of(&cluster, &m, locate(&m, object).osds[0]);
    let dups = "flame_osd_dup_ops_total";
    let dups_before: f64 = ["answered", "completed"]
        .iter()
        .map(|r| cluster.osd_metric(primary, &format!("{dups}{{result=\"{r}\"}}")))
        .sum();
    let got = reactor
        .block_on(async move {
            let l = locate(&m, object);
            let shard = m.osds[&l.osds[0]].shard_of(l.pg);
            let conn = connect(&hm, &m, l.osds[0], shard).await;
            // The older op, resent after the restart: never applied over the newer
            // bytes — refused as superseded, or (by a copy whose log holds the op
            // itself) answered as a retry of what it already applied.
            let st = status_of(&call_retry(&conn, op_write(&m, 20, object, op(5), a), true).await);
            assert!(
                st == status::SUPERSEDED || st == status::OK,
                "resent older op: status {st}"
            );
            // (EAGAIN retried: right after the restart the group may still be
            // settling its copies, more so on a loaded machine.)
            let got = match call_retry(&conn, read(&m, 21, object, 0, 4096), true).await {
                Message::Reply {
                    status: 0, data, ..
                } => data.as_slice().to_vec(),
                other => panic!("read failed: {other:?}"),
            };
            // The newer op again: a retry, answered without applying it.
            let st = status_of(&call_retry(&conn, op_write(&m, 22, object, op(6), b), true).await);
            assert_eq!(st, status::OK);
            got
        })
        .unwrap();
    assert!(
        got == vec![0xbb; 4096],
        "the copy reads {:#x}, not the newer bytes",
        got[0]
    );
    let dups_after: f64 = ["answered", "completed"]
        .iter()
        .map(|r| cluster.osd_metric(primary, &format!("{dups}{{result=\"{r}\"}}")))
        .sum();
    assert!(
        dups_after - dups_before >= 1.0,
        "the retry of the flushed op must be recognised after the restart"
    );
}

/// A primary replaced while it still runs — taken out, not down — and unable to
/// learn the new map (failpoint `map_fetch`) serves no read under its old map once
/// its successor acknowledges writes: the successor first tells it about the new
/// map (`flame-osd/src/activation.rs`), after which it refuses client I/O until it
/// has fetched that map. Before, it served the old bytes to a client with the old
/// map while the new primary had acknowledged newer ones.
#[test]
fn a_replaced_primary_that_cannot_learn_the_new_map_serves_no_stale_read() {
    use flame_common::placement::PgMembers;
    let cluster = TestCluster::start_with(ClusterOptions {
        osds: 4,
        ..ClusterOptions::default()
    });
    let vol = cluster.create_volume("replaced", 16 << 20);
    let old = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let pg = locate(&old, object).pg;
    let p = PgMembers::compute(&old, pg)
        .primary()
        .expect("the group has a primary");
    let pi = process_of(&cluster, &old, p);
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let hm = cluster.hello_maker();
    {
        let m = old.clone();
        reactor
            .block_on(async move {
                let conn = connect(&hm, &m, p, m.osds[&p].shard_of(pg)).await;
                let st = status_of(
                    &call_retry(&conn, write(&m, 1, object, 0, vec![0x11; 4096]), true).await,
                );
                assert_eq!(st, status::OK);
            })
            .unwrap();
    }
    cluster.set_failpoint(pi, "map_fetch", "return");
    let resp = cluster.mgr_post(&format!("/v1/osds/{}/out", p.0), &());
    assert!(matches!(resp, Ok((200, _))), "osd out: {resp:?}");
    // Bounded: until the group's write set no longer has the old primary.
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    let new = loop {
        let m = cluster.map();
        if !PgMembers::compute(&m, pg).write_set().any(|id| id == p) {
            break m;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "osd.{} never left the write set of {pg}",
            p.0
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let q = PgMembers::compute(&new, pg)
        .primary()
        .expect("a new primary");
    assert_ne!(q, p);
    let got = reactor
        .block_on(async move {
            // The new primary acknowledges newer bytes.
            let conn = connect(&hm, &new, q, new.osds[&q].shard_of(pg)).await;
            let st = status_of(
                &call_retry(&conn, write(&new, 2, object, 0, vec![0x22; 4096]), true).await,
            );
            assert_eq!(st, status::OK);
            // A client that still has the old map reads from the old primary.
            let conn = connect(&hm, &old, p, old.osds[&p].shard_of(pg)).await;
            call(&conn, read(&old, 3, object, 0, 4096)).await
        })
        .unwrap();
    cluster.clear_failpoint(pi, "map_fetch");
    match got {
        Message::Reply {
            status: 0, data, ..
        } => assert!(
            data.as_slice() == [0x22u8; 4096].as_slice(),
            "stale read: the replaced primary served bytes {:#x} after its successor \
             acknowledged 0x22",
            data.as_slice()[0]
        ),
        Message::Reply { status: st, .. } => {
            assert!(
                st == status::ESTALE || st == status::EAGAIN,
                "the replaced primary answered {st}"
            );
        }
        other => panic!("not a reply: {other:?}"),
    }
}

/// One raw DELETE_VOLUME per shard used to erase a live volume (volume ids are
/// public in `GET /v1/map`): now every shard refuses it while its map has the
/// volume, nothing is deleted, and `flame-admin volume rm` (which removes the
/// volume from the map first) still deletes the objects everywhere.
#[test]
fn a_raw_delete_of_a_live_volume_is_refused_and_erases_nothing() {
    let cluster = TestCluster::start();
    let vol = cluster.create_volume("keep", 8 << 20);
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let hm = cluster.hello_maker();
    let m = map.clone();
    reactor
        .block_on(async move {
            let loc = locate(&m, object);
            let shard = m.osds[&loc.osds[0]].shard_of(loc.pg);
            let conn = connect(&hm, &m, loc.osds[0], shard).await;
            let reply = call_retry(&conn, write(&m, 1, object, 0, vec![0x5a; 4096]), true).await;
            assert_eq!(status_of(&reply), status::OK);
            let delete = Message::DeleteVolume {
                id: RequestId(9),
                epoch: m.epoch,
                volume: vol.id,
            };
            // As the admin (whom the OSDs let send it): refused by the map rule.
            for info in m.osds.values() {
                for s in 0..info.shards {
                    let conn = connect(&hm.as_admin(), &m, info.id, s).await;
                    assert_eq!(
                        status_of(&call(&conn, delete.clone()).await),
                        status::EINVAL,
                        "{} shard {s} deleted a live volume",
                        info.id
                    );
                }
            }
            // As a client, with keys: refused before that, by role.
            if hm.service.is_some() {
                let st = status_of(&call(&conn, delete).await);
                assert_eq!(st, status::EPERM, "a client sent DELETE_VOLUME");
            }
            let reply = call_retry(&conn, read(&m, 2, object, 0, 4096), true).await;
            match reply {
                Message::Reply {
                    status: 0, data, ..
                } => assert!(data.as_slice().iter().all(|&b| b == 0x5a), "data changed"),
                other => panic!("read after the refused deletes: {other:?}"),
            }
        })
        .unwrap();
    assert_eq!(cluster.object_files_per_osd(vol.id), vec![1; 3]);
    let report = cluster.admin_json(&["scrub", "keep"]);
    assert_eq!(report["inconsistent"].as_u64(), Some(0), "{report}");
    let out = cluster.admin_ok(&["volume", "rm", "keep"]);
    assert!(out.contains("removed volume keep"), "{out}");
    assert_eq!(cluster.object_files_per_osd(vol.id), vec![0; 3], "{out}");
}

/// An OSD of a cluster with keys admits a connection only with a ticket made
/// with its service key and a proof of the ticket's session key, and the
/// replication role only for the osd entity; everything else is answered EPERM
/// and closed, counted by reason, and changes nothing. An admitted HELLO's
/// answer carries the OSD's proof, which checks.
/// Keyless HELLOs sent in a burst by the test below.
const HELLO_BURST: usize = 60;

#[test]
fn hellos_without_a_valid_ticket_are_refused_and_counted() {
    use flame_common::auth::handshake::{
        HelloBinding, check_server_proof, hello_auth, hello_nonce,
    };
    use flame_common::auth::{EntityName, Role, SecretKey, ServiceKey, TICKET_LIFETIME_MS};
    let cluster = TestCluster::start_with(ClusterOptions {
        auth: true,
        ..ClusterOptions::default()
    });
    let vol = cluster.create_volume("gate", 16 << 20);
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let loc = locate(&map, object);
    let osd = loc.osds[0];
    let shard = map.osds[&osd].shard_of(loc.pg);
    let service = cluster.keys().expect("keys").service();
    let other_cluster = ServiceKey::from_osd_key(&SecretKey::random().unwrap(), 1);
    let binding = move |peer: bool| HelloBinding {
        osd: osd.0,
        shard,
        peer,
        session: 0,
        generation: 0,
    };
    let now = flame_common::clock::unix_ms();
    let client = EntityName::parse("client.test").unwrap();
    let ticket = service.issue(&client, Role::Client, now, TICKET_LIFETIME_MS);
    let good = hello_auth(&ticket, &binding(false), now, hello_nonce());
    let mut wrong_proof = hello_auth(&ticket, &binding(false), now, hello_nonce());
    wrong_proof.proof[0] ^= 1;
    let cases: Vec<(&str, bool, Option<flame_common::protocol::HelloAuth>)> = vec![
        ("no ticket", false, None),
        (
            "another cluster's ticket",
            false,
            Some(hello_auth(
                &other_cluster.issue(&client, Role::Client, now, TICKET_LIFETIME_MS),
                &binding(false),
                now,
                hello_nonce(),
            )),
        ),
        ("a proof that does not match", false, Some(wrong_proof)),
        (
            "a client ticket asking for the peer role",
            true,
            Some(hello_auth(&ticket, &binding(true), now, hello_nonce())),
        ),
        (
            "an expired ticket",
            false,
            Some(hello_auth(
                &service.issue(&client, Role::Client, now - 3 * TICKET_LIFETIME_MS, 1000),
                &binding(false),
                now,
                hello_nonce(),
            )),
        ),
    ];
    let m = map.clone();
    let replay = good.clone();
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    reactor
        .block_on(async move {
            let addr = m.osds[&osd].shard_addr(shard);
            let hello =
                |peer: bool, auth| flame_tests::hello_message(m.epoch, shard, peer, 0, 0, auth);
            for (what, peer, auth) in cases {
                let conn = Conn::connect(TransportKind::Tcp, addr, TIMEOUT)
                    .await
                    .unwrap();
                conn.send(&hello(peer, auth)).unwrap();
                match conn.recv().await {
                    Ok(Message::HelloReply { status, proof, .. }) => {
                        assert_eq!(status, status::EPERM, "{what}");
                        assert!(proof.is_none(), "{what}: no proof in a refusal");
                    }
                    other => panic!("{what}: answered {other:?}"),
                }
                // And closed: a request after the refusal gets nothing.
                let _ = conn.send(&read(&m, 1, object, 0, 16));
                assert!(conn.recv().await.is_err(), "{what}: connection still open");
            }
            // The valid HELLO: admitted, with the OSD's proof.
            let conn = Conn::connect(TransportKind::Tcp, addr, TIMEOUT)
                .await
                .unwrap();
            conn.send(&hello(false, Some(good.clone()))).unwrap();
            match conn.recv().await.unwrap() {
                Message::HelloReply {
                    status: 0,
                    proof: Some(p),
                    ..
                } => assert!(check_server_proof(&ticket, &binding(false), &good, &p)),
                other => panic!("valid hello answered {other:?}"),
            }
            assert_eq!(
                status_of(&call_retry(&conn, read(&m, 2, object, 0, 16), true).await),
                status::OK,
                "the admitted connection serves"
            );
            // The same HELLO again (captured and replayed): refused.
            let again = Conn::connect(TransportKind::Tcp, addr, TIMEOUT)
                .await
                .unwrap();
            again.send(&hello(false, Some(replay))).unwrap();
            match again.recv().await {
                Ok(Message::HelloReply { status, .. }) => assert_eq!(status, status::EPERM),
                other => panic!("replayed hello answered {other:?}"),
            }
            // A burst of keyless HELLOs: each refused, but not each logged.
            for _ in 0..HELLO_BURST {
                let conn = Conn::connect(TransportKind::Tcp, addr, TIMEOUT)
                    .await
                    .unwrap();
                conn.send(&hello(false, None)).unwrap();
                match conn.recv().await {
                    Ok(Message::HelloReply { status, .. }) => assert_eq!(status, status::EPERM),
                    other => panic!("keyless hello answered {other:?}"),
                }
            }
        })
        .unwrap();
    // At most 20 refusal lines per 10 s (`connection.rs`, REFUSAL_LINES): the
    // burst (well under 10 s) and the cases before it log at most two windows'
    // worth, and a later line says how many were left out.
    let log = cluster.osd_log(process_of(&cluster, &map, osd));
    let lines = log.matches("refusing connection").count();
    assert!(
        (1..=40).contains(&lines),
        "{lines} refusal lines for {} refused HELLOs",
        HELLO_BURST + 6
    );
    let (code, text) = flame_tests::http_get(
        cluster.osd_metrics_addr(process_of(&cluster, &map, osd)),
        "/metrics",
    )
    .unwrap();
    assert_eq!(code, 200);
    for reason in [
        "missing",
        "forged_ticket",
        "bad_proof",
        "not_an_osd",
        "expired_ticket",
        "replayed",
    ] {
        // Every refusal is counted, the ones left out of the log too.
        let times = if reason == "missing" {
            1 + HELLO_BURST
        } else {
            1
        };
        assert!(
            text.contains(&format!(
                "flame_osd_hello_refusals_total{{reason=\"{reason}\"}} {times}"
            )),
            "refusal {reason} not counted {times} times:\n{}",
            text.lines()
                .filter(|l| l.contains("hello_refusals"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// Bounded resources per peer: a connection that sends a 4 MiB WRITE's header
/// and then trickles (it holds a pool buffer) is closed once
/// `payload_recv_timeout_ms` passes; one that asks for 4 MiB reads and never
/// reads the replies is closed once the shard has been stuck writing to it for
/// `send_stall_timeout_ms`. Each is counted by reason, and the shard keeps
/// serving others meanwhile.
#[test]
fn trickling_and_never_reading_connections_are_closed_within_their_bounds() {
    use std::io::{Read as _, Write as _};
    let cluster = TestCluster::start_with(ClusterOptions {
        osd_extra_yaml: "payload_recv_timeout_ms: 1000\nsend_stall_timeout_ms: 1000\n".into(),
        ..ClusterOptions::default()
    });
    let vol = cluster.create_volume("stall", 64 << 20);
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let loc = locate(&map, object);
    let osd = loc.osds[0];
    let shard = map.osds[&osd].shard_of(loc.pg);
    let addr = map.osds[&osd].shard_addr(shard);
    let metrics = cluster.osd_metrics_addr(process_of(&cluster, &map, osd));
    let hm = cluster.hello_maker();
    let open = || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        s.write_all(&hm.hello(osd, shard, map.epoch, false, 0, 0).encode())
            .unwrap();
        let mut reply = [0u8; 128 + 48];
        s.read_exact(&mut reply[..128]).unwrap();
        let h = protocol::Header::decode(reply[..128].try_into().unwrap()).unwrap();
        assert_eq!(h.status, 0, "hello");
        s.read_exact(&mut reply[..h.payload_len as usize]).unwrap();
        s
    };
    let counted = |reason: &str| {
        let label = format!("reason=\"{reason}\"");
        flame_tests::metric_sum(
            metrics,
            "flame_osd_stalled_connections_closed_total",
            &label,
        ) == 1
    };
    // 1. The trickler: a 4 MiB write's header and 100 bytes, then one byte a
    //    quarter second.
    let mut t = open();
    let bytes = write(&map, 1, object, 0, vec![0x7e; 4 << 20]).encode();
    t.write_all(&bytes[..128 + 100]).unwrap();
    let started = std::time::Instant::now();
    let mut closed = false;
    for i in 0..40 {
        std::thread::sleep(Duration::from_millis(250));
        if t.write_all(&bytes[128 + 100 + i..128 + 101 + i]).is_err() {
            closed = true;
            break;
        }
        if counted("payload_stall") {
            closed = true;
            break;
        }
    }
    let took = started.elapsed();
    assert!(closed, "the trickling connection was not closed in 10 s");
    println!("trickler closed after {took:?} (bound 1 s)");
    assert!(took < Duration::from_secs(5), "closed after {took:?}");
    // Its buffer is free and the shard serves: a real write and read back.
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let m = map.clone();
    reactor
        .block_on(async move {
            let conn = connect(&hm, &m, osd, shard).await;
            let w = call_retry(&conn, write(&m, 2, object, 0, vec![0x11; 4096]), true).await;
            assert_eq!(status_of(&w), status::OK);
            let r = call_retry(&conn, read(&m, 3, object, 0, 4096), true).await;
            let Message::Reply {
                status: 0, data, ..
            } = r
            else {
                panic!("read: {r:?}")
            };
            assert!(data.iter().all(|&b| b == 0x11));
        })
        .unwrap();
    // 2. The non-reader: 32 reads of 4 MiB, no reply read.
    let mut n = open();
    for id in 0..32u64 {
        n.write_all(&read(&map, 10 + id, object, 0, 4 << 20).encode())
            .unwrap();
    }
    let started = std::time::Instant::now();
    while !counted("send_stall") {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the non-reading connection was not closed in 15 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "non-reader closed after {:?} (bound 1 s)",
        started.elapsed()
    );
    drop(n);
    drop(t);
}

/// A sender that does not take its replies gets no more requests read once its
/// queued replies pass its share of the shard's pool (64 MiB of a 256 MiB
/// pool): of 200 reads of 1 MiB sent without reading a reply, the OSD runs
/// about its byte budget (16 MiB in flight) plus that share and what the
/// kernel's socket buffers took, then stops reading until the stall watchdog
/// closes the connection. Without the bound it ran all 200 (the queued
/// replies kept their pool buffers, up to the send queue's 256 MiB).
#[test]
fn a_non_reader_gets_no_more_requests_read_past_its_share() {
    use std::io::{Read as _, Write as _};
    let cluster = TestCluster::start_with(ClusterOptions {
        shards: 1,
        osd_extra_yaml: "send_stall_timeout_ms: 4000\nmax_inflight_bytes_per_shard: 16777216\n\
                         memory_pool:\n  bytes_per_thread: 268435456\n"
            .into(),
        ..ClusterOptions::default()
    });
    let vol = cluster.create_volume("backlog", 64 << 20);
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let osd = locate(&map, object).osds[0];
    let addr = map.osds[&osd].shard_addr(0);
    let metrics = cluster.osd_metrics_addr(process_of(&cluster, &map, osd));
    let reads = || flame_tests::metric_sum(metrics, "flame_osd_ops_total", "op=\"read\"");
    let hm = cluster.hello_maker();
    // The object holds data, so every read's reply carries 1 MiB.
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let m = map.clone();
    let hm2 = hm;
    reactor
        .block_on(async move {
            let conn = connect(&hm2, &m, osd, 0).await;
            let w = call_retry(&conn, write(&m, 2, object, 0, vec![0x11; 1 << 20]), true).await;
            assert_eq!(status_of(&w), status::OK);
        })
        .unwrap();
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(&hm.hello(osd, 0, map.epoch, false, 0, 0).encode())
        .unwrap();
    let mut reply = [0u8; 128 + 48];
    s.read_exact(&mut reply[..128]).unwrap();
    let h = protocol::Header::decode(reply[..128].try_into().unwrap()).unwrap();
    assert_eq!(h.status, 0, "hello");
    s.read_exact(&mut reply[..h.payload_len as usize]).unwrap();
    let before = reads();
    for id in 0..200u64 {
        s.write_all(&read(&map, 10 + id, object, 0, 1 << 20).encode())
            .unwrap();
    }
    // Let the OSD run what it will, well before the watchdog's 4 s.
    std::thread::sleep(Duration::from_millis(2000));
    let ran = reads() - before;
    println!("reads run for a connection that takes no reply: {ran} of 200");
    assert!(ran >= 16, "the OSD ran only {ran} reads");
    assert!(
        ran <= 120,
        "{ran} reads ran for a connection that takes no reply (budget 16 + share 64 + socket buffers)"
    );
    drop(s);
}

/// Idleness counts only when nothing is in flight: with `idle_timeout_ms` at
/// 1 s and a client's write held 2.5 s on its primary (failpoint
/// `write_hold`), the connection that waits silently for the reply is not
/// closed as idle; the reply arrives on it.
#[test]
fn a_connection_waiting_for_a_reply_is_not_idle() {
    use std::io::{Read as _, Write as _};
    let cluster = TestCluster::start_with(ClusterOptions {
        shards: 1,
        osd_extra_yaml: "idle_timeout_ms: 1000\n".into(),
        ..ClusterOptions::default()
    });
    let vol = cluster.create_volume("busy", 16 << 20);
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let primary = locate(&map, object).osds[0];
    let process = process_of(&cluster, &map, primary);
    let hm = cluster.hello_maker();
    let mut c = std::net::TcpStream::connect(map.osds[&primary].shard_addr(0)).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    c.write_all(&hm.hello(primary, 0, map.epoch, false, 0, 0).encode())
        .unwrap();
    let mut header = [0u8; 128];
    let mut read_message = |c: &mut std::net::TcpStream| {
        c.read_exact(&mut header).unwrap();
        let h = protocol::Header::decode(&header).unwrap();
        let mut body = vec![0u8; h.payload_len as usize];
        c.read_exact(&mut body).unwrap();
        h
    };
    assert_eq!(read_message(&mut c).status, 0, "hello");
    cluster.set_failpoint(process, "write_hold", "1*return(2500)");
    let started = std::time::Instant::now();
    c.write_all(&write(&map, 1, object, 0, vec![0x3c; 4096]).encode())
        .unwrap();
    let reply = read_message(&mut c);
    let took = started.elapsed();
    assert_eq!(reply.status, status::OK, "the held write's reply");
    assert!(
        took >= Duration::from_millis(2400),
        "the write was held: {took:?}"
    );
    cluster.clear_failpoint(process, "write_hold");
    // Silent now, with nothing in flight: closed as idle.
    let mut sink = [0u8; 16];
    assert!(
        matches!(c.read(&mut sink), Ok(0) | Err(_)),
        "closed once idle"
    );
}

/// Peers have a byte bound of their own: with `max_peer_inflight_bytes_per_shard`
/// at 16 MiB and every forwarded write held 3 s on the replica (failpoint
/// `forward_hold`), a peer connection that sends twelve 4 MiB forwarded writes
/// has exactly four in flight (16 MiB: the rest wait unread in the socket, so
/// the peer's memory is bounded, never heap without limit), the clients' bound
/// is untouched, and all twelve are applied once the holds end (back-pressure:
/// none is refused).
#[test]
fn peer_connections_have_a_byte_bound_of_their_own() {
    use std::io::{Read as _, Write as _};
    let cluster = TestCluster::start_with(ClusterOptions {
        shards: 1,
        osd_extra_yaml: "max_peer_inflight_bytes_per_shard: 16777216\n".into(),
        ..ClusterOptions::default()
    });
    let vol = cluster.create_volume("peerbytes", 64 << 20);
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let replica = locate(&map, object).osds[1];
    let process = process_of(&cluster, &map, replica);
    let metrics = cluster.osd_metrics_addr(process);
    let inflight = |kind: &str| -> u64 {
        flame_tests::metric_sum(
            metrics,
            "flame_osd_inflight_bytes",
            &format!("kind=\"{kind}\""),
        )
    };
    cluster.set_failpoint(process, "forward_hold", "return(3000)");
    let hm = cluster.hello_maker();
    let mut p = std::net::TcpStream::connect(map.osds[&replica].shard_addr(0)).unwrap();
    p.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    p.write_all(&hm.hello(replica, 0, map.epoch, true, 0, 0).encode())
        .unwrap();
    let mut header = [0u8; 128];
    let mut read_message = |p: &mut std::net::TcpStream| {
        p.read_exact(&mut header).unwrap();
        let h = protocol::Header::decode(&header).unwrap();
        let mut body = vec![0u8; h.payload_len as usize];
        p.read_exact(&mut body).unwrap();
        h
    };
    assert_eq!(read_message(&mut p).status, 0, "peer hello");
    // Twelve forwarded 4 MiB writes, sent from a thread (the socket fills up
    // once the replica stops reading).
    let mut sender = p.try_clone().unwrap();
    let writes: Vec<Vec<u8>> = (0..12u64)
        .map(|i| {
            let mut msg = write(&map, 100 + i, object, 0, vec![0x5b; 4 << 20]);
            if let Message::Write { flags, .. } = &mut msg {
                *flags |= protocol::flags::REPLICA;
            }
            msg.encode()
        })
        .collect();
    let sending = std::thread::spawn(move || {
        for w in writes {
            sender.write_all(&w).unwrap();
        }
    });
    std::thread::sleep(Duration::from_millis(1500));
    let (peer_bytes, client_bytes) = (inflight("peer"), inflight("client"));
    println!("during the hold: {peer_bytes} peer bytes, {client_bytes} client bytes in flight");
    assert_eq!(peer_bytes, 16 << 20, "four 4 MiB forwarded writes, no more");
    assert_eq!(client_bytes, 0, "peers count against their own bound");
    cluster.clear_failpoint(process, "forward_hold");
    // Every write is answered (the first four after their hold), none refused.
    let statuses: Vec<i32> = (0..12).map(|_| read_message(&mut p).status).collect();
    assert!(
        statuses.iter().all(|&st| st == status::OK),
        "back-pressure, not refusal: every write waits its turn and is applied ({statuses:?})"
    );
    sending.join().unwrap();
    assert_eq!(inflight("peer"), 0);
}

/// Connection slots: one source address holds at most
/// `max_connections_per_source` connections to a shard; clients take at most
/// `max_connections_per_shard - connections_reserved_for_peers`, and the rest
/// is kept for OSD peers (a client beyond its share is answered EAGAIN at
/// HELLO, a peer is still admitted). Closing a connection frees its slot.
#[test]
fn connection_slots_are_capped_per_source_and_kept_for_peers() {
    use std::io::{Read as _, Write as _};
    let cluster = TestCluster::start_with(ClusterOptions {
        shards: 1,
        osd_extra_yaml: "max_connections_per_shard: 12\nmax_connections_per_source: 3\n\
                         connections_reserved_for_peers: 8\n"
            .into(),
        ..ClusterOptions::default()
    });
    let map = cluster.map();
    let osd = *map.osds.keys().next().unwrap();
    let addr = map.osds[&osd].shard_addr(0);
    let hm = cluster.hello_maker();
    // A raw connection from `source`, and the status of its HELLO (None: closed
    // before any answer).
    let open = |source: [u8; 4], peer: bool| {
        let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        s.bind(&std::net::SocketAddr::from((source, 0)).into())
            .unwrap();
        s.connect(&addr.into()).unwrap();
        let mut s: std::net::TcpStream = s.into();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let _ = s.write_all(&hm.hello(osd, 0, map.epoch, peer, 0, 0).encode());
        let mut h = [0u8; 128];
        let status = match s.read_exact(&mut h) {
            Ok(()) => Some(protocol::Header::decode(&h).unwrap().status),
            Err(_) => None,
        };
        (s, status)
    };
    let mut held = Vec::new();
    for _ in 0..3 {
        let (s, st) = open([127, 0, 0, 77], false);
        assert_eq!(st, Some(0));
        held.push(s);
    }
    let (_, st) = open([127, 0, 0, 77], false);
    assert_eq!(st, None, "a fourth connection from one source is closed");
    // A fourth client from another source fills the clients' share (12 - 8).
    let (s, st) = open([127, 0, 0, 78], false);
    assert_eq!(st, Some(0));
    held.push(s);
    let (_, st) = open([127, 0, 0, 79], false);
    assert_eq!(
        st,
        Some(status::EAGAIN),
        "a fifth client takes a peer's slot"
    );
    let (peer, st) = open([127, 0, 0, 79], true);
    assert_eq!(st, Some(0), "an OSD peer is still admitted");
    // Closing frees the slot.
    drop(held.pop());
    std::thread::sleep(Duration::from_millis(300));
    let (_, st) = open([127, 0, 0, 79], false);
    assert_eq!(st, Some(0), "the freed client slot is taken again");
    drop(peer);
}

/// Per-volume capabilities: an entity added with `--volumes vm1-*` gets
/// tickets naming them, and every OSD lets it read and write only those
/// volumes; a client may not delete volumes or scrub, whatever its volumes.
/// Changing its volumes takes effect with its next ticket.
#[test]
fn a_client_reads_and_writes_only_the_volumes_its_ticket_names() {
    use flame_common::auth::handshake::{HelloBinding, hello_auth, hello_nonce};
    let cluster = TestCluster::start_with(ClusterOptions {
        auth: true,
        ..ClusterOptions::default()
    });
    let mine = cluster.create_volume("vm1-root", 16 << 20);
    let theirs = cluster.create_volume("other", 16 << 20);
    let add = flame_common::mgr_api::AuthEntityAdd {
        entity: flame_common::auth::EntityName::parse("client.vm1").unwrap(),
        role: flame_common::auth::Role::Client,
        volumes: flame_common::auth::VolumePatterns::parse_list("vm1-*").unwrap(),
    };
    let (code, body) = cluster.mgr_post("/v1/auth/entities", &add).unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("vm1-*"), "{body}");
    let creds = cluster.keys().unwrap().creds("client.vm1", 1);
    let mgr = flame_client::MgrClient::new(&cluster.mgr_addr().to_string())
        .unwrap()
        .with_credentials(Some(creds));
    let ticket = mgr.ticket().unwrap().expect("a ticket");
    assert_eq!(ticket.claims.volumes.as_slice(), ["vm1-*"]);
    let map = cluster.map();
    let obj = |v: &flame_common::map::VolumeInfo| ObjectId {
        volume: v.id,
        index: 0,
    };
    let (mo, to) = (obj(&mine), obj(&theirs));
    let m = map.clone();
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    reactor
        .block_on(async move {
            let open = |o: ObjectId| {
                let l = locate(&m, o);
                let osd = l.osds[0];
                let shard = m.osds[&osd].shard_of(l.pg);
                let binding = HelloBinding {
                    osd: osd.0,
                    shard,
                    peer: false,
                    session: 0,
                    generation: 0,
                };
                let auth = hello_auth(
                    &ticket,
                    &binding,
                    flame_common::clock::unix_ms(),
                    hello_nonce(),
                );
                let addr = m.osds[&osd].shard_addr(shard);
                let epoch = m.epoch;
                async move {
                    let c = Conn::connect(TransportKind::Tcp, addr, TIMEOUT)
                        .await
                        .unwrap();
                    c.send(&flame_tests::hello_message(
                        epoch,
                        shard,
                        false,
                        0,
                        0,
                        Some(auth),
                    ))
                    .unwrap();
                    assert!(matches!(
                        c.recv().await.unwrap(),
                        Message::HelloReply { status: 0, .. }
                    ));
                    c
                }
            };
            let c = open(mo).await;
            let w = call_retry(&c, write(&m, 1, mo, 0, vec![0x42; 4096]), true).await;
            assert_eq!(status_of(&w), status::OK, "its own volume");
            let r = call_retry(&c, read(&m, 2, mo, 0, 4096), true).await;
            assert_eq!(status_of(&r), status::OK);
            let c = open(to).await;
            let w = call_retry(&c, write(&m, 3, to, 0, vec![0x66; 4096]), true).await;
            assert_eq!(status_of(&w), status::EPERM, "another volume: written");
            let r = call_retry(&c, read(&m, 4, to, 0, 4096), true).await;
            assert_eq!(status_of(&r), status::EPERM, "another volume: read");
            let d = call(
                &c,
                Message::DeleteVolume {
                    id: RequestId(5),
                    epoch: m.epoch,
                    volume: theirs.id,
                },
            )
            .await;
            assert_eq!(status_of(&d), status::EPERM, "a client deleted a volume");
        })
        .unwrap();
    // The other volume's object was never written.
    let l = locate(&map, to);
    let p = cluster.object_path(process_of(&cluster, &map, l.osds[0]), theirs.id, 0);
    assert!(
        std::fs::read(&p)
            .unwrap_or_default()
            .iter()
            .all(|&b| b == 0),
        "the refused write reached {}",
        p.display()
    );
    // Widened to every volume: the next ticket says so.
    let (code, body) = cluster
        .mgr_post(
            "/v1/auth/entities/client.vm1/volumes",
            &flame_common::mgr_api::AuthEntityVolumes {
                volumes: flame_common::auth::VolumePatterns::all(),
            },
        )
        .unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(mgr.ticket().unwrap().unwrap().claims.volumes.is_all());
}

/// An OSD hands its map to a sender whose map is older (a client it refused as
/// stale, which may be cut off from the manager), answers a sender whose map is
/// as new with nothing, and refuses (ESTALE) one whose map is newer than its
/// own: it fetches that map before it answers for it.
#[test]
fn an_osd_hands_its_map_to_a_sender_with_an_older_one() {
    let cluster = TestCluster::start();
    let map = cluster.map();
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let hm = cluster.hello_maker();
    reactor
        .block_on(async move {
            let osd = *map.osds.keys().next().unwrap();
            let conn = connect(&hm, &map, osd, 0).await;
            let ask = |id, epoch| Message::MapRequest {
                id: RequestId(id),
                epoch,
            };
            let (st, theirs, data) = match call(&conn, ask(1, Epoch(1))).await {
                Message::Reply {
                    status,
                    epoch,
                    data,
                    ..
                } => (status, epoch, data),
                other => panic!("not a reply: {other:?}"),
            };
            assert_eq!(st, status::OK);
            let handed: ClusterMap =
                serde_json::from_slice(data.as_slice()).expect("the reply is a map");
            assert_eq!(
                handed.epoch, theirs,
                "the map of the epoch it answers under"
            );
            assert!(handed.epoch > Epoch(1));
            assert_eq!(handed.fsid, map.fsid);
            // The cluster may still be publishing its first epochs (the OSDs
            // booting): a newer map learnt between two asks is handed again,
            // and must be newer. A bounded number of asks reaches an epoch
            // with nothing newer.
            let mut theirs = theirs;
            let mut nothing_newer = false;
            for id in 2..12 {
                match call(&conn, ask(id, theirs)).await {
                    Message::Reply {
                        status,
                        epoch,
                        data,
                        ..
                    } => {
                        assert_eq!(status, status::OK);
                        if data.is_empty() {
                            nothing_newer = true;
                            break;
                        }
                        let newer: ClusterMap =
                            serde_json::from_slice(data.as_slice()).expect("the reply is a map");
                        assert!(newer.epoch > theirs, "only a newer map is handed");
                        assert_eq!(newer.epoch, epoch, "the map of the epoch it answers under");
                        theirs = newer.epoch;
                    }
                    other => panic!("not a reply: {other:?}"),
                }
            }
            assert!(nothing_newer, "nothing newer: nothing handed");
            assert_eq!(
                status_of(&call(&conn, ask(20, Epoch(theirs.0 + 100))).await),
                status::ESTALE
            );
        })
        .unwrap();
}

/// `flame-admin auth rotate osd --force` reaches every OSD without a restart:
/// each OSD (on its own `osd.N` key) sees the new `osd` generation in a
/// heartbeat answer, fetches the new service key sealed for it, and admits
/// HELLOs with tickets of the new generation within a few heartbeats, and no
/// longer those of the old one.
#[test]
fn a_rotated_osd_key_reaches_every_osd_without_a_restart() {
    use flame_common::auth::{EntityName, ServiceKey};
    use std::io::{Read as _, Write as _};
    let cluster = TestCluster::start();
    let keys = cluster
        .keys()
        .expect("this test needs a cluster with authentication (FLAME_TEST_AUTH unset)");
    let map = cluster.map();
    let old = cluster.hello_maker();
    let out = cluster.admin(&["auth", "rotate", "osd", "--force"]);
    assert!(out.status.success(), "{}", flame_tests::output_text(&out));
    let new_service: &'static ServiceKey = Box::leak(Box::new(ServiceKey::from_osd_key(
        &keys.secret.derive_entity_key(&EntityName::osd(), 2),
        2,
    )));
    let new = HelloMaker {
        service: Some(new_service),
        ..old
    };
    // The status of a raw HELLO made by `maker` to `osd`'s shard 0.
    let hello_status = |maker: &HelloMaker, osd: OsdId| -> i32 {
        let addr = map.osds[&osd].shard_addr(0);
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&maker.hello(osd, 0, map.epoch, false, 0, 0).encode())
            .unwrap();
        let mut head = [0u8; 128];
        s.read_exact(&mut head).unwrap();
        protocol::Header::decode(&head).unwrap().status
    };
    for &osd in map.osds.keys() {
        // Bounded: 100 tries, 100 ms apart (heartbeats are every 500 ms).
        let admitted = (0..100).any(|_| {
            let ok = hello_status(&new, osd) == 0;
            if !ok {
                std::thread::sleep(Duration::from_millis(100));
            }
            ok
        });
        assert!(admitted, "{osd} never admitted a ticket of the rotated key");
        assert_ne!(
            hello_status(&old, osd),
            0,
            "{osd} still admits the old generation's tickets"
        );
    }
}

/// A flipped byte in the intent journal's header after kill -9 is never taken
/// as an empty journal: a write acknowledged after the last flush (its data in
/// the page cache, its stable checksums still the flushed write's) reads back
/// after every OSD was killed and had its journal header damaged — start-up
/// recomputes the checksums of every object an entry names. Taking the journal
/// as empty would leave the old checksums over the new data on every copy:
/// EIO, or the old data.
#[test]
fn a_flipped_journal_header_after_kill9_never_serves_stale_checksums() {
    let mut cluster = TestCluster::start_with(ClusterOptions {
        shards: 1,
        ..ClusterOptions::default()
    });
    let vol = cluster.create_volume("jnl", 16 << 20);
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let primary = locate(&map, object).osds[0];
    let hm = cluster.hello_maker();
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let m = map.clone();
    reactor
        .block_on(async move {
            let conn = connect(&hm, &m, primary, 0).await;
            let w = call_retry(&conn, write(&m, 1, object, 0, vec![0x11; 8192]), true).await;
            assert_eq!(status_of(&w), status::OK);
            let flush = Message::Flush {
                id: RequestId(2),
                epoch: m.epoch,
                flags: 0,
                volume: vol.id,
            };
            assert_eq!(status_of(&call_retry(&conn, flush, true).await), status::OK);
            // Acknowledged, not flushed: a journal entry on every copy.
            let w = call_retry(&conn, write(&m, 3, object, 0, vec![0x22; 8192]), true).await;
            assert_eq!(status_of(&w), status::OK);
        })
        .unwrap();
    let mut flipped = 0;
    for i in 0..cluster.osd_count() {
        cluster.kill_osd(i);
        let dir = cluster.osd_data_dir(i).join("journal");
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let mut bytes = std::fs::read(&path).unwrap();
            // Inside the generation field (16..24) of the 4 KiB header.
            bytes[17] ^= 0x5a;
            std::fs::write(&path, &bytes).unwrap();
            flipped += 1;
        }
    }
    assert!(flipped >= 3, "no journal found to damage");
    for i in 0..cluster.osd_count() {
        cluster.restart_osd(i);
    }
    let map = cluster.map();
    let primary = locate(&map, object).osds[0];
    let shard = map.osds[&primary].shard_of(locate(&map, object).pg);
    reactor
        .block_on(async move {
            let conn = connect(&hm, &map, primary, shard).await;
            let r = call_retry(&conn, read(&map, 4, object, 0, 8192), true).await;
            match r {
                Message::Reply {
                    status: 0, data, ..
                } => assert!(
                    data.as_slice().iter().all(|&b| b == 0x22),
                    "the acknowledged write did not read back"
                ),
                other => panic!("read after the damaged journals: {other:?}"),
            }
        })
        .unwrap();
}
