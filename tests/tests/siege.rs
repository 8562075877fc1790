//! Slow and stalled peers against every OSD shard and flame-nbd at once, while
//! fio verifies data through flame-nbd: issue 15's "bounded resources for every
//! peer", black-box. Every offender is closed within its bound, fio sees no
//! error, and the daemons' memory stays bounded (VmRSS before and after in the
//! test log).

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::ids::{ObjectId, OsdId, PgSeq, RequestId};
use flame_common::map::ClusterMap;
use flame_common::placement::locate;
use flame_common::protocol::{self, IoTarget, Message};
use flame_tests::misbehaving::{fio_randrw_verify, nbd_raw_client, nbd_request};
use flame_tests::{ClusterOptions, TestCluster};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// Tricklers per OSD shard and against flame-nbd (the figure).
const TRICKLERS_PER_TARGET: usize = 32;
/// Idle connections, spread over the OSD shards (the figure).
const IDLE_CONNECTIONS: usize = 1024;
/// How long every offender has to be closed by, once fio is done (its bounds
/// are 1 s, 1 s and 2 s; a trickler waiting for pool memory behind others is
/// closed in turn).
const CLOSED_WITHIN: Duration = Duration::from_secs(30);

fn vm_rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// A raw client connection to `osd`'s `shard`, HELLO answered.
fn osd_client(cluster: &TestCluster, map: &ClusterMap, osd: OsdId, shard: u16) -> TcpStream {
    try_osd_client(cluster.hello_maker(), map, osd, shard)
        .unwrap_or_else(|e| panic!("hello to {osd} shard {shard}: {e}"))
}

/// [`osd_client`], or why the OSD would not have it (the offenders that keep
/// coming during fio may be refused: that is the bounds at work).
fn try_osd_client(
    maker: flame_tests::HelloMaker,
    map: &ClusterMap,
    osd: OsdId,
    shard: u16,
) -> Result<TcpStream, String> {
    let addr = map.osds[&osd].shard_addr(shard);
    let mut s =
        TcpStream::connect_timeout(&addr, Duration::from_secs(5)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .map_err(|e| e.to_string())?;
    let hello = maker.hello(osd, shard, map.epoch, false, 0, 0);
    s.write_all(&hello.encode()).map_err(|e| e.to_string())?;
    let mut head = [0u8; protocol::HEADER_LEN];
    s.read_exact(&mut head).map_err(|e| e.to_string())?;
    let h = protocol::Header::decode(&head).map_err(|e| e.to_string())?;
    if h.status != 0 {
        return Err(format!("status {}", h.status));
    }
    let mut body = vec![0u8; h.payload_len as usize];
    s.read_exact(&mut body).map_err(|e| e.to_string())?;
    Ok(s)
}

/// Whether the daemon closed `s` (EOF or reset), reading and discarding
/// whatever it still had queued for us; waits until `deadline`.
fn closed_by(s: &mut TcpStream, deadline: Instant) -> bool {
    let mut buf = vec![0u8; 1 << 20];
    // Bounded by the deadline (each read waits at most 1 s).
    while Instant::now() < deadline {
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(_) => return true,
        }
    }
    false
}

/// Objects of `volume` whose primary is each (OSD, shard), one each.
fn one_object_per_shard(
    map: &ClusterMap,
    volume: flame_common::ids::VolumeId,
) -> Vec<(OsdId, u16, ObjectId)> {
    let mut found: Vec<(OsdId, u16, ObjectId)> = Vec::new();
    let want = map
        .osds
        .values()
        .map(|o| usize::from(o.shards))
        .sum::<usize>();
    for index in 0..4096 {
        let object = ObjectId { volume, index };
        let loc = locate(map, object);
        let osd = loc.osds[0];
        let shard = map.osds[&osd].shard_of(loc.pg);
        if !found.iter().any(|&(o, s, _)| (o, s) == (osd, shard)) {
            found.push((osd, shard, object));
            if found.len() == want {
                break;
            }
        }
    }
    assert_eq!(found.len(), want, "no object for some shard");
    found
}

/// The first 4 MiB of `object`.
fn first_4m(map: &ClusterMap, object: ObjectId) -> IoTarget {
    IoTarget {
        pg: locate(map, object).pg,
        object,
        offset: 0,
        length: 4 << 20,
    }
}

fn write_header(map: &ClusterMap, id: u64, object: ObjectId) -> Vec<u8> {
    let target = first_4m(map, object);
    let len = target.length as usize;
    let msg = Message::Write {
        id: RequestId(id),
        epoch: map.epoch,
        target,
        flags: 0,
        seq: PgSeq(0),
        op: flame_common::ids::OpId::NONE,
        remote: None,
        data: flame_common::buffer::PayloadBuf::copy_from(&vec![0x7e; len]),
    };
    // The header and the first 100 bytes of the payload: then nothing more.
    msg.encode()[..protocol::HEADER_LEN + 100].to_vec()
}

fn read_request(map: &ClusterMap, id: u64, object: ObjectId) -> Vec<u8> {
    Message::Read {
        id: RequestId(id),
        epoch: map.epoch,
        target: first_4m(map, object),
        flags: 0,
        remote: None,
    }
    .encode()
}

fn raise_open_files() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        lim.rlim_cur = lim.rlim_max;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
    }
    assert!(
        lim.rlim_cur >= 4096,
        "this test needs 4096 open files (ulimit -Hn is {})",
        lim.rlim_cur
    );
}

#[test]
fn fio_through_flame_nbd_sees_no_error_while_peers_trickle_stall_and_idle() {
    use flame_client::nbd::proto::{CMD_READ, CMD_WRITE};
    raise_open_files();
    let bounds = "payload_recv_timeout_ms: 1000\nsend_stall_timeout_ms: 1000\n";
    let cluster = TestCluster::start_with(ClusterOptions {
        osd_extra_yaml: format!("{bounds}idle_timeout_ms: 2000\n"),
        nbd_extra_yaml: bounds.into(),
        // The offenders come from 127.0.0.1, the daemons from addresses of
        // their own: the per-source connection caps keep them apart.
        per_daemon_addrs: true,
        ..ClusterOptions::with_nbd()
    });
    cluster.create_nbd_volume("siege", 64 << 20);
    cluster.qemu_io("siege", &["write -P 0x42 0 8M"]);
    // A volume of its own for the raw offenders (fio's data is not theirs).
    let raw = cluster.create_volume("raw", 16 << 30);
    let map = cluster.map();
    let pids: Vec<(String, u32)> = (0..cluster.osd_count())
        .map(|i| (format!("osd process {i}"), cluster.osd_pid(i).unwrap()))
        .chain([("flame-nbd".to_string(), cluster.nbd_pid().unwrap())])
        .collect();
    let rss_before: Vec<u64> = pids.iter().map(|(_, p)| vm_rss_kib(*p)).collect();
    assert!(
        rss_before.iter().all(|&k| k > 0),
        "no VmRSS read: {rss_before:?}"
    );

    // The offenders, all at once.
    let targets = one_object_per_shard(&map, raw.id);
    let mut tricklers = Vec::new();
    let mut readers = Vec::new();
    for (n, &(osd, shard, object)) in targets.iter().enumerate() {
        for i in 0..TRICKLERS_PER_TARGET {
            let mut s = osd_client(&cluster, &map, osd, shard);
            s.write_all(&write_header(&map, 1 + i as u64, object))
                .unwrap();
            tricklers.push(s);
        }
        // A reader that never reads its replies: 32 reads of 4 MiB.
        let mut s = osd_client(&cluster, &map, osd, shard);
        for id in 0..32u64 {
            s.write_all(&read_request(&map, 1000 + id + 100 * n as u64, object))
                .unwrap();
        }
        readers.push(s);
    }
    let mut idle = Vec::with_capacity(IDLE_CONNECTIONS);
    for i in 0..IDLE_CONNECTIONS {
        let (osd, shard, _) = targets[i % targets.len()];
        idle.push(osd_client(&cluster, &map, osd, shard));
    }
    let nbd = cluster.nbd_addr();
    for i in 0..TRICKLERS_PER_TARGET {
        let mut s = nbd_raw_client(nbd, "siege");
        s.write_all(&nbd_request(CMD_WRITE, i as u64, 32 << 20, 4 << 20))
            .unwrap();
        s.write_all(&[0x7e; 100]).unwrap();
        tricklers.push(s);
    }
    let mut s = nbd_raw_client(nbd, "siege");
    for cookie in 0..32u64 {
        s.write_all(&nbd_request(CMD_READ, 100 + cookie, 0, 4 << 20))
            .unwrap();
    }
    readers.push(s);
    println!(
        "offenders: {} tricklers, {} non-readers, {} idle connections",
        tricklers.len(),
        readers.len(),
        idle.len()
    );

    // fio through flame-nbd meanwhile: verified random reads and writes. The
    // tricklers keep coming while it runs (closed ones are replaced: four new
    // ones on every shard every 250 ms), so fio runs under the siege, not after
    // it.
    let started = Instant::now();
    let fio_done = std::sync::atomic::AtomicBool::new(false);
    let (maker, uri) = (cluster.hello_maker(), cluster.nbd_uri("siege"));
    let (more, refused) = std::thread::scope(|scope| {
        let attacker = scope.spawn(|| {
            let (mut more, mut refused) = (Vec::new(), 0usize);
            // Bounded: at most 240 rounds (60 s), until fio is done.
            for round in 0..240u64 {
                if fio_done.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                for &(osd, shard, object) in &targets {
                    for i in 0..4 {
                        match try_osd_client(maker, &map, osd, shard) {
                            Ok(mut s) => {
                                let id = 10_000 + round * 8 + i;
                                if s.write_all(&write_header(&map, id, object)).is_ok() {
                                    more.push(s);
                                }
                            }
                            Err(_) => refused += 1,
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(250));
            }
            (more, refused)
        });
        fio_randrw_verify(&uri, "8M", "16M");
        fio_done.store(true, std::sync::atomic::Ordering::Relaxed);
        attacker.join().unwrap()
    });
    println!(
        "fio done in {:?} under the siege; {} more tricklers came meanwhile ({refused} refused at HELLO)",
        started.elapsed(),
        more.len()
    );
    assert!(!more.is_empty(), "no trickler came while fio ran");
    tricklers.extend(more);

    // Every offender is closed by the daemons.
    let deadline = Instant::now() + CLOSED_WITHIN;
    let open = |conns: &mut Vec<TcpStream>| {
        conns
            .iter_mut()
            .map(|s| closed_by(s, deadline))
            .filter(|closed| !closed)
            .count()
    };
    assert_eq!(open(&mut tricklers), 0, "tricklers left open");
    assert_eq!(open(&mut readers), 0, "non-readers left open");
    assert_eq!(open(&mut idle), 0, "idle connections left open");
    println!(
        "every offender closed {:?} after fio began",
        started.elapsed()
    );

    // The data is intact, and the daemons' memory is bounded.
    cluster.qemu_io("siege", &["read -P 0x42 0 8M"]);
    for ((name, pid), before) in pids.iter().zip(&rss_before) {
        let after = vm_rss_kib(*pid);
        println!("{name}: VmRSS {before} KiB before, {after} KiB after");
        assert!(
            after < before + (512 << 10),
            "{name} grew from {before} KiB to {after} KiB"
        );
    }
}
