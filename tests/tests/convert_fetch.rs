//! Read-write conversion and remote fetching against real daemons: a manager,
//! three OSDs and flame-nbd as processes on loopback.
//!
//! * Convert mode: writes and reads above the threshold move their data by
//!   one-sided transfers (the OSDs' and the client's counters say so), below it
//!   inline; every byte reads back, and a converted write is on all three OSDs'
//!   disks (the primary pulled it and forwarded it inline).
//! * A forged descriptor (unknown key, or out of a live grant's bounds) ends the
//!   connection that sent it and nothing else: a well-behaved client on the same
//!   OSD shard keeps working.
//! * Fetch mode: replies are left in the OSDs' reply areas and fetched; the data
//!   is verified the same way.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::buffer::{PayloadBuf, PayloadBufMut};
use flame_common::ids::{ObjectId, PgSeq, RequestId};
use flame_common::map::ClusterMap;
use flame_common::placement::locate;
use flame_common::protocol::{IoTarget, Message, RemoteBuf, status};
use flame_common::reactor::{Reactor, ReactorConfig};
use flame_common::transport::{Conn, TransportKind};
use flame_tests::{ClusterOptions, HelloMaker, TestCluster, http_get, pattern};
use std::net::SocketAddr;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(10);

/// Sum of every sample of metric `prefix` (a name with the start of its labels,
/// e.g. `flame_osd_converted_total{op="write"`) at `addr`.
fn metric_sum(addr: SocketAddr, prefix: &str) -> f64 {
    let (code, body) = http_get(addr, "/metrics").unwrap_or_else(|e| panic!("{addr}: {e}"));
    assert_eq!(code, 200, "{addr} metrics: HTTP {code}");
    body.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn osd_sum(cluster: &TestCluster, prefix: &str) -> f64 {
    (0..cluster.osd_count())
        .map(|i| metric_sum(cluster.osd_metrics_addr(i), prefix))
        .sum()
}

/// Writes patterns of several sizes with qemu-io (through flame-nbd) and reads
/// them back verified; sizes at and above 4 KiB are converted when the threshold
/// is 4 KiB, 512 bytes travel inline.
fn write_and_verify(cluster: &TestCluster, volume: &str) {
    let cmds = [
        "write -P 0x11 0 512",
        "write -P 0x22 4096 4096",
        "write -P 0x33 65536 65536",
        "write -P 0x44 1048576 1048576",
        // Spans objects 0 and 1 (4 MiB objects): two converted pieces.
        "write -P 0x55 4063232 262144",
        "read -P 0x11 0 512",
        "read -P 0x22 4096 4096",
        "read -P 0x33 65536 65536",
        "read -P 0x44 1048576 1048576",
        "read -P 0x55 4063232 262144",
        // Never written: zeroes, pushed into the client's buffer too.
        "read -P 0 8388608 131072",
    ];
    cluster.qemu_io(volume, &cmds);
}

#[test]
fn convert_mode_moves_data_one_sided_and_refuses_forged_descriptors() {
    let cluster = TestCluster::start_with(ClusterOptions {
        nbd_extra_yaml: "transfer_mode: convert\n\
                         convert_threshold_bytes: {tcp: 4096, shm: 4096, rdma: 4096}\n"
            .into(),
        ..ClusterOptions::with_nbd()
    });
    let vol = cluster.create_volume("conv", 64 << 20);
    cluster.wait_nbd_export("conv");
    write_and_verify(&cluster, "conv");

    let pulled = osd_sum(&cluster, "flame_osd_converted_total{op=\"write\"");
    let pushed = osd_sum(&cluster, "flame_osd_converted_total{op=\"read\"");
    // 4 converted write requests and 1 spanning write of 2 pieces; qemu-io may
    // split none of them (all within NBD's limits).
    assert!(pulled >= 5.0, "converted writes pulled by OSDs: {pulled}");
    assert!(pushed >= 6.0, "converted reads pushed by OSDs: {pushed}");
    let nbd = cluster.nbd_metrics_addr();
    let client_w = metric_sum(nbd, "flame_client_converted_total{op=\"write\"");
    let client_r = metric_sum(nbd, "flame_client_converted_total{op=\"read\"");
    assert_eq!(
        client_w, pulled,
        "client and OSDs count converted writes alike"
    );
    assert_eq!(
        client_r, pushed,
        "client and OSDs count converted reads alike"
    );

    // The pulled 1 MiB is on every copy's disk, byte for byte (forwarded inline).
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    assert_eq!(locate(&map, object).osds.len(), 3);
    for osd in 0..cluster.osd_count() {
        let data = cluster
            .object_data(osd, vol.id, 0)
            .unwrap_or_else(|| panic!("osd.{osd} has no object 0"));
        let got = &data[1 << 20..2 << 20];
        assert!(
            got.iter().all(|&b| b == 0x44),
            "osd.{osd}: the converted 1 MiB write is not on disk"
        );
    }

    forged_descriptors_end_only_their_connection(&cluster, &map, object);
    // flame-nbd's connections were not affected either.
    cluster.qemu_io("conv", &["read -P 0x44 1048576 1048576"]);
}

fn target(map: &ClusterMap, object: ObjectId, offset: u32, length: u32) -> IoTarget {
    IoTarget {
        pg: locate(map, object).pg,
        object,
        offset,
        length,
    }
}

async fn connect_primary(hm: &HelloMaker, map: &ClusterMap, object: ObjectId) -> Conn {
    let loc = locate(map, object);
    let osd = &map.osds[&loc.osds[0]];
    let shard = osd.shard_of(loc.pg);
    let conn = Conn::connect(TransportKind::Tcp, osd.shard_addr(shard), TIMEOUT)
        .await
        .expect("connect");
    conn.send(&hm.hello(osd.id, shard, map.epoch, false, 0, 0))
        .unwrap();
    match conn.recv().await.unwrap() {
        Message::HelloReply { status: 0, .. } => conn,
        other => panic!("hello refused: {other:?}"),
    }
}

/// Receives until the connection ends; panics if it is still open after
/// [`TIMEOUT`] or answers `id` (the forged request must not be served).
async fn expect_closed(conn: &Conn, id: u64, what: &str) {
    let deadline = std::time::Instant::now() + TIMEOUT;
    loop {
        let next = futures_lite::future::or(async { Some(conn.recv().await) }, async {
            flame_common::reactor::sleep(TIMEOUT).await;
            None
        })
        .await;
        match next {
            Some(Err(_)) => return,
            Some(Ok(Message::Reply {
                id: got, status, ..
            })) if got.0 == id => {
                panic!("{what}: answered with status {status} instead of closing")
            }
            Some(Ok(_)) => {}
            None => panic!("{what}: connection still open after {TIMEOUT:?}"),
        }
        assert!(std::time::Instant::now() < deadline, "{what}: not closed");
    }
}

fn forged_descriptors_end_only_their_connection(
    cluster: &TestCluster,
    map: &ClusterMap,
    object: ObjectId,
) {
    let map = map.clone();
    let hm = cluster.hello_maker();
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let result = reactor.block_on(async move {
        // A well-behaved client on the same shard, connected before and used after.
        let good = connect_primary(&hm, &map, object).await;
        let data = PayloadBuf::copy_from(&pattern(7, 8192));
        let grant = good.grant_read(&data).expect("grant");

        // 1. A write naming a key that was never granted.
        let bad = connect_primary(&hm, &map, object).await;
        let forged = RemoteBuf {
            addr: grant.remote().addr,
            len: 8192,
            key: grant.remote().key ^ 0x5a5a_5a5a,
        };
        bad.send(&Message::Write {
            id: RequestId(1),
            epoch: map.epoch,
            target: target(&map, object, 0, 8192),
            flags: 0,
            seq: PgSeq(0),
            op: flame_common::ids::OpId::NONE,
            remote: Some(forged),
            data: PayloadBuf::empty(),
        })
        .unwrap();
        expect_closed(&bad, 1, "write with an unknown key").await;

        // 2. A write reaching past the end of a live grant of its own connection.
        let bad = connect_primary(&hm, &map, object).await;
        let small = PayloadBuf::copy_from(&[9u8; 4096]);
        let g = bad.grant_read(&small).expect("grant");
        bad.send(&Message::Write {
            id: RequestId(2),
            epoch: map.epoch,
            target: target(&map, object, 0, 8192),
            flags: 0,
            seq: PgSeq(0),
            op: flame_common::ids::OpId::NONE,
            remote: Some(RemoteBuf {
                len: 8192,
                ..g.remote()
            }),
            data: PayloadBuf::empty(),
        })
        .unwrap();
        expect_closed(&bad, 2, "write past its grant").await;
        drop(g);

        // 3. A read whose destination key is forged (the OSD's push is refused).
        let bad = connect_primary(&hm, &map, object).await;
        bad.send(&Message::Read {
            id: RequestId(3),
            epoch: map.epoch,
            target: target(&map, object, 0, 4096),
            flags: 0,
            remote: Some(RemoteBuf {
                addr: 0x7000_0000,
                len: 4096,
                key: 0xdead_beef,
            }),
        })
        .unwrap();
        expect_closed(&bad, 3, "read with a forged destination").await;

        // The good connection still works, converted both ways.
        good.send(&Message::Write {
            id: RequestId(10),
            epoch: map.epoch,
            target: target(&map, object, 0, 8192),
            flags: 0,
            seq: PgSeq(0),
            op: flame_common::ids::OpId::NONE,
            remote: Some(grant.remote()),
            data: PayloadBuf::empty(),
        })
        .unwrap();
        match good.recv().await {
            Ok(Message::Reply { id, status, .. }) if id.0 == 10 => {
                assert_eq!(status, status::OK, "good converted write")
            }
            other => panic!("good connection after forged ones: {other:?}"),
        }
        drop(grant);
        let dest = good
            .grant_write(PayloadBufMut::zeroed(8192))
            .expect("grant");
        good.send(&Message::Read {
            id: RequestId(11),
            epoch: map.epoch,
            target: target(&map, object, 0, 8192),
            flags: 0,
            remote: Some(dest.remote()),
        })
        .unwrap();
        match good.recv().await {
            Ok(Message::Reply {
                id, status, data, ..
            }) if id.0 == 11 => {
                assert_eq!(status, status::OK);
                assert!(data.is_empty(), "a converted read's reply has no payload");
            }
            other => panic!("good converted read: {other:?}"),
        }
        let got = dest.finish();
        assert_eq!(got.as_slice(), &pattern(7, 8192)[..], "pushed data");
    });
    if let Err(e) = result {
        panic!("reactor: {e}\n{}", cluster.log_tails());
    }
}

/// The in-process client library in convert + fetch mode (its reply polling at
/// the default budget): writes and reads of several sizes, verified; returns the
/// (hits, misses, fallbacks) its fetches counted.
fn library_fetch_roundtrip(
    cluster: &TestCluster,
    volume: &str,
    transport: TransportKind,
) -> (f64, f64, f64) {
    let mut cfg = flame_client::ClientConfig::new(cluster.mgr_addr().to_string());
    cfg.keyring = cluster.keyring("client.admin");
    cfg.transport = transport;
    cfg.transfer_mode = flame_client::TransferMode::Convert;
    cfg.convert_threshold_bytes = flame_client::ConvertThresholds {
        tcp: 4096,
        shm: 4096,
        rdma: 4096,
    };
    cfg.reply_mode = flame_client::ReplyMode::Fetch;
    cfg.fetch_over_emulated = transport == TransportKind::Tcp;
    cfg.io_timeout_ms = 60_000;
    let client = flame_client::Cluster::connect(cfg).expect("client");
    let name = volume.to_string();
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let result = reactor.block_on(async move {
        let vol = client.open_volume(&name).await.expect("open");
        // Offsets past what the NBD part of the test wrote.
        let cases: [(u64, usize); 5] = [
            (16 << 20, 512),
            ((16 << 20) + 8192, 4096),
            ((16 << 20) + 65536, 65536),
            (17 << 20, 1 << 20),
            ((20 << 20) - 4096, 12288),
        ];
        for (i, &(off, len)) in cases.iter().enumerate() {
            vol.write_at(off, &pattern(100 + i as u64, len), false)
                .await
                .expect("write");
        }
        for (i, &(off, len)) in cases.iter().enumerate() {
            let got = vol.read_at(off, len).await.expect("read");
            assert!(
                got == pattern(100 + i as u64, len),
                "{len} bytes at {off} read back wrong"
            );
        }
    });
    if let Err(e) = result {
        panic!("reactor: {e}");
    }
    let text = flame_common::metrics::render();
    let sum = |prefix: &str| -> f64 {
        text.lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    (
        sum("flame_client_fetch_total{result=\"hit\""),
        sum("flame_client_fetch_total{result=\"miss\""),
        sum("flame_client_fetch_total{result=\"fallback\""),
    )
}

/// Fetch mode (over tcp's emulated READ, which both sides must allow: no native
/// transport runs here yet) with conversion on: replies are left in the OSDs'
/// reply areas and fetched, every byte reads back. With one fetch allowed per
/// reply (and the switch to push after many fallbacks in a row disabled),
/// replies that are not ready at once are asked to be pushed (the fallback) and
/// still arrive. OSDs allow only 4 requests in flight per
/// connection, so a deep benchmark queue also runs their back-pressure while
/// conversions are in flight (the receive loop must keep serving the transfers).
#[test]
fn fetch_mode_fetches_replies_and_falls_back_to_push() {
    let cluster = TestCluster::start_with(ClusterOptions {
        osd_extra_yaml: "reply_area_over_emulated: true\nmax_inflight_per_connection: 4\n".into(),
        nbd_extra_yaml: "transfer_mode: convert\n\
                         convert_threshold_bytes: {tcp: 4096, shm: 4096, rdma: 4096}\n\
                         reply_mode: fetch\n\
                         fetch_over_emulated: true\n\
                         fetch_polls_max: 1\n\
                         fetch_fallbacks_to_push: 100000\n"
            .into(),
        ..ClusterOptions::with_nbd()
    });
    cluster.create_volume("fetch", 64 << 20);
    cluster.wait_nbd_export("fetch");
    write_and_verify(&cluster, "fetch");

    // flame-nbd polls each reply once: every reply not ready by then (all of
    // them, on this machine) is pushed on request, and the data is right.
    let nbd = cluster.nbd_metrics_addr();
    let misses = metric_sum(nbd, "flame_client_fetch_total{result=\"miss\"");
    let fallbacks = metric_sum(nbd, "flame_client_fetch_total{result=\"fallback\"");
    let osd_fallbacks = osd_sum(
        &cluster,
        "flame_osd_fetch_replies_total{result=\"fallback\"",
    );
    assert!(fallbacks >= 10.0, "fallbacks to push: {fallbacks}");
    assert_eq!(
        misses, fallbacks,
        "one fetch per reply before asking for push"
    );
    assert!(
        osd_fallbacks >= fallbacks,
        "OSDs pushed {osd_fallbacks} replies on request, the client asked {fallbacks} times"
    );
    assert!(osd_sum(&cluster, "flame_osd_reply_areas{") >= 1.0);
    let converted = metric_sum(nbd, "flame_client_converted_total{");
    assert!(converted >= 10.0, "conversion with fetching: {converted}");

    // The library with the default polling budget: replies are fetched.
    let left_before = osd_sum(&cluster, "flame_osd_fetch_replies_total{result=\"left\"");
    let (hits, lib_misses, lib_fallbacks) =
        library_fetch_roundtrip(&cluster, "fetch", TransportKind::Tcp);
    let left = osd_sum(&cluster, "flame_osd_fetch_replies_total{result=\"left\"") - left_before;
    eprintln!(
        "fetch: hits {hits} misses {lib_misses} fallbacks {lib_fallbacks}, replies left {left}"
    );
    assert!(
        hits >= 8.0,
        "replies fetched: {hits} (misses {lib_misses}, fallbacks {lib_fallbacks})"
    );
    assert!(
        left >= hits,
        "OSDs left {left} replies, the client fetched {hits}"
    );

    // Outside the region the bench below may overwrite (its first 8 MiB).
    cluster.qemu_io(
        "fetch",
        &["write -P 0x5a 9437184 65536", "read -P 0x5a 9437184 65536"],
    );

    // A deep queue of converted writes against a bound of 4 per connection
    // (flame-admin's own client, convert mode, inline replies).
    let out = cluster.admin(&[
        "bench",
        "fetch",
        "--rw",
        "randwrite",
        "--bs",
        "64k",
        "--iodepth",
        "32",
        "--runtime",
        "2s",
        "--size-limit",
        "8M",
        "--force-overwrite",
        "--transfer-mode",
        "convert",
        "--convert-threshold",
        "4k",
    ]);
    assert!(
        out.status.success(),
        "bench under back-pressure failed: {}\n{}",
        flame_tests::output_text(&out),
        cluster.log_tails()
    );
    // The bench wrote its own random fill over random 64 KiB blocks of the first
    // 8 MiB (--size-limit), so what write_and_verify left there is gone when the
    // bench happened to hit that block (how often depends on the machine's
    // speed): checking the old pattern there was a bug of this test, not of
    // fetching. After the bench flame-nbd (fetching, converting) must still
    // return exactly what is on the volume: the pattern written past the bench's
    // region is intact, the never-written range reads zeroes, and fresh writes
    // inside the region read back.
    cluster.qemu_io(
        "fetch",
        &[
            "read -P 0x5a 9437184 65536",
            "read -P 0 8388608 131072",
            "write -P 0x66 4096 4096",
            "write -P 0x77 65536 65536",
            "read -P 0x66 4096 4096",
            "read -P 0x77 65536 65536",
        ],
    );
}

/// The combination CI must keep working: `shm` between flame-nbd and the OSDs,
/// read-write conversion, fetched replies (natively: the client copies replies
/// out of the OSD's shared memory) and adaptive polling, on every daemon. The
/// data is verified through flame-nbd and through the library, and the counters
/// show that conversion and fetching really ran.
#[test]
fn shm_convert_fetch_adaptive_cluster() {
    let cluster = TestCluster::start_with(ClusterOptions {
        transport: "shm".into(),
        poll_mode: "adaptive".into(),
        nbd_extra_yaml: "transfer_mode: convert\n\
                         convert_threshold_bytes: {tcp: 4096, shm: 4096, rdma: 4096}\n\
                         reply_mode: fetch\n"
            .into(),
        ..ClusterOptions::with_nbd()
    });
    cluster.create_volume("shmvol", 64 << 20);
    cluster.wait_nbd_export("shmvol");
    write_and_verify(&cluster, "shmvol");
    let nbd = cluster.nbd_metrics_addr();
    let converted = metric_sum(nbd, "flame_client_converted_total{");
    let hits = metric_sum(nbd, "flame_client_fetch_total{result=\"hit\"");
    let fallbacks = metric_sum(nbd, "flame_client_fetch_total{result=\"fallback\"");
    let areas = osd_sum(&cluster, "flame_osd_reply_areas{");
    let in_place = metric_sum(nbd, "flame_shm_grants_total{kind=\"in_place\"");
    let staged = metric_sum(nbd, "flame_shm_grants_total{kind=\"staged\"");
    eprintln!(
        "shm: converted {converted} hits {hits} fallbacks {fallbacks} areas {areas} \
         grants in place {in_place} staged {staged}"
    );
    assert!(areas >= 1.0, "no reply area granted over shm");
    // flame-nbd's payload buffers come from its threads' pools, whose regions it
    // shares with the OSDs: conversion must not copy them through staging memory.
    assert!(
        in_place >= 10.0 && in_place > staged,
        "converted buffers granted in place {in_place}, through staging {staged}"
    );
    assert!(converted >= 10.0, "converted over shm: {converted}");
    assert!(
        hits + fallbacks >= 10.0,
        "fetched {hits}, fell back {fallbacks}"
    );
    assert!(hits >= 1.0, "no reply fetched over shm");
    let (lib_hits, _, _) = library_fetch_roundtrip(&cluster, "shmvol", TransportKind::Shm);
    assert!(lib_hits >= 1.0, "the library fetched no reply over shm");
}
