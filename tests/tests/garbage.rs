//! Garbage on every listening port — the manager API, every OSD shard port, the NBD
//! port and every metrics port — leaves every daemon running and serving.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::ids::{Epoch, ObjectId, PgId, PgSeq, RequestId, VolumeId};
use flame_common::protocol::{IoTarget, Message, PAYLOAD_BYTES_MAX};
use flame_tests::misbehaving::{nbd_raw_client, nbd_request};
use flame_tests::{ClusterOptions, Endpoint, PortKind, TestCluster, http_get, pattern};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

fn connect(ep: &Endpoint) -> TcpStream {
    let s = TcpStream::connect_timeout(&ep.addr, Duration::from_secs(5))
        .unwrap_or_else(|e| panic!("{} ({}) does not accept: {e}", ep.name, ep.addr));
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    s
}

/// Sends `bytes`, then reads until the peer closes or goes quiet; returns nothing.
/// The peer may close at any point (that is a valid answer to garbage), so write
/// errors are fine.
fn blast(ep: &Endpoint, bytes: &[u8]) {
    let mut s = connect(ep);
    let _ = s.write_all(bytes);
    let _ = s.shutdown(Shutdown::Write);
    let mut sink = [0u8; 4096];
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        match s.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
}

fn valid_write_header(len: u32) -> Vec<u8> {
    let msg = Message::Write {
        id: RequestId(1),
        epoch: Epoch(1),
        target: IoTarget {
            pg: PgId(0),
            object: ObjectId {
                volume: VolumeId(1),
                index: 0,
            },
            offset: 0,
            length: len,
        },
        flags: 0,
        seq: PgSeq(0),
        op: flame_common::ids::OpId::NONE,
        remote: None,
        data: flame_common::buffer::PayloadBuf::zeroed(len as usize),
    };
    msg.to_header().0.encode().to_vec()
}

fn garbage_inputs() -> Vec<(&'static str, Vec<u8>)> {
    let header = valid_write_header(4096);
    vec![
        ("random bytes", pattern(42, 64 * 1024)),
        ("half a Flame header", header[..32].to_vec()),
        // A well-formed header announcing a payload that never comes.
        ("header without its payload", {
            let mut v = valid_write_header(PAYLOAD_BYTES_MAX);
            v.extend_from_slice(&[7u8; 100]);
            v
        }),
        ("a Flame header with a corrupted checksum", {
            let mut v = header.clone();
            v[60] ^= 0xff;
            v
        }),
        (
            "HTTP garbage",
            b"GET /\x00\xff HTTP/9.9\r\nContent-Length: 99999999999\r\n\r\nxx".to_vec(),
        ),
        ("NBD-like garbage", {
            let mut v = b"IHAVEOPT".to_vec();
            v.extend_from_slice(&[0, 0, 0, 7, 0xff, 0xff, 0xff, 0xff]);
            v.extend_from_slice(&pattern(7, 1000));
            v
        }),
        ("one byte", vec![0]),
        ("nothing", vec![]),
    ]
}

fn assert_serving(cluster: &mut TestCluster, after: &str) {
    cluster.assert_all_running();
    let st = cluster.status();
    assert_eq!(st.osds_up, 3, "after {after}: {st:?}");
    for ep in cluster.endpoints() {
        if ep.kind == PortKind::Metrics {
            let (code, body) = http_get(ep.addr, "/metrics")
                .unwrap_or_else(|e| panic!("after {after}: {}: {e}", ep.name));
            assert_eq!(code, 200, "after {after}: {}", ep.name);
            assert!(body.contains("flame_"), "after {after}: {}", ep.name);
        }
    }
    cluster.qemu_io(
        "g",
        &[
            "write -P 0x66 4190208 8192",
            "read -P 0x66 4190208 8192",
            "read -P 0x55 0 4096",
        ],
    );
}

#[test]
fn garbage_on_every_port_leaves_the_cluster_serving() {
    let mut cluster = TestCluster::start_with(ClusterOptions::with_nbd());
    cluster.create_nbd_volume("g", 16 << 20);
    cluster.qemu_io("g", &["write -P 0x55 0 4096"]);
    let endpoints = cluster.endpoints();
    assert!(
        endpoints.iter().any(|e| e.kind == PortKind::OsdData)
            && endpoints.iter().any(|e| e.kind == PortKind::Nbd)
            && endpoints.iter().any(|e| e.kind == PortKind::MgrApi)
            && endpoints
                .iter()
                .filter(|e| e.kind == PortKind::Metrics)
                .count()
                == 4,
        "{endpoints:?}"
    );

    for (what, bytes) in garbage_inputs() {
        for ep in &endpoints {
            blast(ep, &bytes);
        }
        assert_serving(&mut cluster, what);
    }

    // Stalled peers: half-sent garbage held open on every port while others work.
    let stalled: Vec<TcpStream> = endpoints
        .iter()
        .map(|ep| {
            let mut s = connect(ep);
            let _ = s.write_all(&valid_write_header(4096)[..20]);
            s
        })
        .collect();
    assert_serving(&mut cluster, "stalled half-sent connections");
    drop(stalled);

    // Many connections at once that vanish immediately.
    for ep in &endpoints {
        let conns: Vec<TcpStream> = (0..50).map(|_| connect(ep)).collect();
        drop(conns);
    }
    assert_serving(&mut cluster, "50 connections opened and dropped per port");
}

/// flame-nbd bounds a client's time as the OSDs do: a client that sends a 4 MiB
/// WRITE's header and trickles its payload (holding a pool buffer) is closed once
/// `payload_recv_timeout_ms` passes, one that asks for reads and never reads the
/// replies once a batch of them has waited `send_stall_timeout_ms`; each is
/// counted by reason, and flame-nbd serves others meanwhile and after.
#[test]
fn trickling_and_never_reading_nbd_clients_are_closed_within_their_bounds() {
    use flame_client::nbd::proto::{CMD_READ, CMD_WRITE};
    let cluster = TestCluster::start_with(ClusterOptions {
        nbd_extra_yaml: "payload_recv_timeout_ms: 1000\nsend_stall_timeout_ms: 1000\n".into(),
        ..ClusterOptions::with_nbd()
    });
    cluster.create_nbd_volume("stall", 64 << 20);
    cluster.qemu_io("stall", &["write -P 0x42 0 4M"]);
    let (nbd, metrics) = (cluster.nbd_addr(), cluster.nbd_metrics_addr());
    let counted = |reason: &str| {
        let label = format!("reason=\"{reason}\"");
        flame_tests::metric_sum(
            metrics,
            "flame_nbd_stalled_connections_closed_total",
            &label,
        ) == 1
    };

    // 1. The trickler: a 4 MiB write's header and 100 bytes, then one byte a
    //    quarter second.
    let mut t = nbd_raw_client(nbd, "stall");
    t.write_all(&nbd_request(CMD_WRITE, 1, 4 << 20, 4 << 20))
        .unwrap();
    t.write_all(&[0x7e; 100]).unwrap();
    let started = std::time::Instant::now();
    let mut closed = false;
    for _ in 0..40 {
        std::thread::sleep(Duration::from_millis(250));
        if t.write_all(&[0x7e]).is_err() || counted("payload_stall") {
            closed = true;
            break;
        }
    }
    let took = started.elapsed();
    assert!(closed, "the trickling NBD client was not closed in 10 s");
    println!("trickler closed after {took:?} (bound 1 s)");
    assert!(took < Duration::from_secs(5), "closed after {took:?}");
    // Nothing of its write landed, and flame-nbd serves.
    cluster.qemu_io(
        "stall",
        &[
            "read -P 0 4M 4M",
            "write -P 0x43 8M 64k",
            "read -P 0x43 8M 64k",
        ],
    );

    // 2. The non-reader: 32 reads of 4 MiB (128 MiB of replies), none read.
    let mut n = nbd_raw_client(nbd, "stall");
    for cookie in 0..32u64 {
        n.write_all(&nbd_request(CMD_READ, 100 + cookie, 0, 4 << 20))
            .unwrap();
    }
    let started = std::time::Instant::now();
    while !counted("send_stall") {
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "the non-reading NBD client was not closed in 15 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "non-reader closed after {:?} (bound 1 s)",
        started.elapsed()
    );
    cluster.qemu_io("stall", &["read -P 0x42 0 4M"]);
    drop(n);
    drop(t);
}

/// Idle connections go: with `idle_timeout_ms` an OSD closes a tcp connection
/// that has sent nothing and has nothing in flight for that long (a raw HELLO
/// and then silence; flame-nbd's connections and the OSDs' replication
/// connections between two bursts of I/O), counted as `reason="idle"`. Clients
/// and peers reconnect on their next request: the writes after the pause are
/// replicated and read back.
#[test]
fn idle_osd_connections_are_closed_and_clients_and_peers_reconnect() {
    use flame_common::protocol::Header;
    let mut cluster = TestCluster::start_with(ClusterOptions {
        osd_extra_yaml: "idle_timeout_ms: 1000\n".into(),
        ..ClusterOptions::with_nbd()
    });
    cluster.create_nbd_volume("idle", 64 << 20);
    let idle_closed = |cluster: &TestCluster| -> u64 {
        (0..cluster.osd_count())
            .map(|i| {
                flame_tests::metric_sum(
                    cluster.osd_metrics_addr(i),
                    "flame_osd_stalled_connections_closed_total",
                    "reason=\"idle\"",
                )
            })
            .sum()
    };
    // Replicated writes in every object of the first 16 MiB: flame-nbd talks to
    // several primaries, and they to their replicas.
    cluster.qemu_io("idle", &["write -P 0x31 0 16M"]);
    let before = idle_closed(&cluster);

    // A raw connection: HELLO, then nothing.
    let map = cluster.map();
    let (&osd, info) = map.osds.iter().next().unwrap();
    let hm = cluster.hello_maker();
    let mut raw = TcpStream::connect_timeout(&info.shard_addr(0), Duration::from_secs(5)).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    raw.write_all(&hm.hello(osd, 0, map.epoch, false, 0, 0).encode())
        .unwrap();
    let mut h = [0u8; 128];
    raw.read_exact(&mut h).unwrap();
    let reply = Header::decode(&h).unwrap();
    assert_eq!(reply.status, 0, "hello");
    let mut rest = vec![0u8; reply.payload_len as usize];
    raw.read_exact(&mut rest).unwrap();
    let started = std::time::Instant::now();
    let mut sink = [0u8; 64];
    let closed = matches!(raw.read(&mut sink), Ok(0) | Err(_));
    let took = started.elapsed();
    assert!(closed, "the idle raw connection sent something");
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "an idle connection closed after {took:?} (bound 1 s)"
    );
    println!("idle raw connection closed after {took:?} (bound 1 s)");

    // flame-nbd's and the peers' connections idled too; I/O goes on over new ones.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while idle_closed(&cluster) < before + 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "no idle connections closed beside the raw one: {} then {}",
            before,
            idle_closed(&cluster)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    cluster.qemu_io(
        "idle",
        &[
            "write -P 0x32 4M 8M",
            "read -P 0x31 0 4M",
            "read -P 0x32 4M 8M",
            "read -P 0x31 12M 4M",
        ],
    );
    cluster.assert_all_running();
    println!(
        "idle closes counted: {} before the pause, {} after",
        before,
        idle_closed(&cluster)
    );
}
