//! The data path through failures, with real daemons: a write loop through
//! flame-nbd (python3-libnbd) rides out kill -9 of a replica and of a primary with
//! no error; a partitioned OSD is marked down, acknowledges nothing after its
//! lease, and comes back; a forwarded write from an older epoch is refused; a hung
//! shard thread stops its OSD's heartbeats.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::ids::{Epoch, ObjectId, OsdId, PgSeq, RequestId};
use flame_common::map::ClusterMap;
use flame_common::placement::{PgMembers, object_pg};
use flame_common::protocol::{IoTarget, Message, flags, status};
use flame_common::reactor::{Reactor, ReactorConfig};
use flame_common::transport::{Conn, TransportKind};
use flame_tests::{ClusterOptions, TestCluster, output_text};
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const OBJECT: u64 = 4 * MIB;
/// The manager's grace in these tests (short, so failovers are quick).
const GRACE_MS: u64 = 3000;
/// OSD settings matching it: lease_ms + heartbeat_interval_ms (500) < GRACE_MS.
const OSD_YAML: &str = "lease_ms: 2000\nreplica_timeout_ms: 2000\nconnect_timeout_ms: 1000\n";
/// Longest client pause accepted during a failover: the grace plus a few seconds
/// (the manager's check interval, map propagation, backoff).
const PAUSE_MAX: Duration = Duration::from_millis(GRACE_MS + 5000);

fn options(nbd: bool, per_daemon_addrs: bool) -> ClusterOptions {
    ClusterOptions {
        nbd,
        heartbeat_grace_ms: GRACE_MS,
        osd_extra_yaml: OSD_YAML.into(),
        per_daemon_addrs,
        ..ClusterOptions::default()
    }
}

/// Waits until `cond` holds, panicking with `what` and the daemon logs after
/// `timeout`. Returns how long it took.
fn wait_for(
    cluster: &TestCluster,
    timeout: Duration,
    what: &str,
    mut cond: impl FnMut() -> bool,
) -> Duration {
    let started = Instant::now();
    while !cond() {
        assert!(
            started.elapsed() < timeout,
            "{what}: not within {timeout:?}\n{}",
            cluster.log_tails()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    started.elapsed()
}

fn osd_up(cluster: &TestCluster, id: OsdId) -> bool {
    cluster.map().osds.get(&id).is_some_and(|o| o.up)
}

/// A bounded write loop through NBD over one object's 4 MiB: 4 KiB writes, each
/// block's content naming its write counter, a FLUSH every 16 writes; at the end
/// every block is read back and compared with its last acknowledged write. Stops
/// at the first error.
const WRITE_LOOP: &str = r#"
import json, sys, time, nbd
uri, base, span, secs, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
h = nbd.NBD()
h.connect_uri(uri)
BS = 4096
blocks = span // BS
last = {}
writes, errors, max_lat, worst_at, n = 0, [], 0.0, 0.0, 0
start = time.monotonic()
while time.monotonic() - start < secs:
    b = n % blocks
    n += 1
    buf = (n.to_bytes(8, 'little') + b.to_bytes(8, 'little')) * (BS // 16)
    t = time.monotonic()
    try:
        h.pwrite(buf, base + b * BS)
        if n % 16 == 0:
            h.flush()
    except Exception as e:
        errors.append("write %d: %s" % (n, e))
        break
    lat = time.monotonic() - t
    if lat > max_lat:
        max_lat, worst_at = lat, t - start
    last[b] = buf
    writes += 1
    if writes % 20 == 0:
        with open(out + ".progress", "w") as f:
            f.write(str(writes))
bad = 0
for b, buf in last.items():
    try:
        if h.pread(BS, base + b * BS) != buf:
            bad += 1
    except Exception as e:
        errors.append("read %d: %s" % (b, e))
        break
with open(out, "w") as f:
    json.dump({"writes": writes, "errors": errors, "bad_blocks": bad,
               "max_latency_s": max_lat, "worst_at_s": worst_at}, f)
"#;

struct WriteLoop {
    child: Child,
    out: PathBuf,
}

#[derive(Debug)]
struct LoopResult {
    writes: u64,
    errors: Vec<String>,
    bad_blocks: u64,
    max_latency: Duration,
    worst_at_s: f64,
}

impl WriteLoop {
    fn start(cluster: &TestCluster, volume: &str, object: u64, secs: u64) -> WriteLoop {
        let script = cluster.dir().join("write_loop.py");
        std::fs::write(&script, WRITE_LOOP).unwrap();
        let out = cluster.dir().join(format!("write_loop_{object}.json"));
        let child = Command::new("/usr/bin/python3")
            .arg(&script)
            .arg(cluster.nbd_uri(volume))
            .arg((object * OBJECT).to_string())
            .arg(OBJECT.to_string())
            .arg(secs.to_string())
            .arg(&out)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("python3 (with python3-libnbd): {e}"));
        WriteLoop { child, out }
    }

    /// Acknowledged writes so far.
    fn progress(&self) -> u64 {
        std::fs::read_to_string(self.out.with_extension("json.progress"))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    fn wait_progress(&self, cluster: &TestCluster, writes: u64) {
        wait_for(
            cluster,
            Duration::from_secs(30),
            "write loop progress",
            || self.progress() >= writes,
        );
    }

    fn finish(mut self, cluster: &TestCluster, timeout: Duration) -> LoopResult {
        let started = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                let out = self.child.wait_with_output().unwrap();
                assert!(
                    st.success(),
                    "write loop failed: {}\n{}",
                    output_text(&out),
                    cluster.log_tails()
                );
                break;
            }
            if started.elapsed() > timeout {
                let _ = self.child.kill();
                let out = self.child.wait_with_output().unwrap();
                panic!(
                    "write loop hung past {timeout:?}: {}\n{}",
                    output_text(&out),
                    cluster.log_tails()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&self.out).unwrap()).unwrap();
        LoopResult {
            writes: v["writes"].as_u64().unwrap(),
            errors: v["errors"]
                .as_array()
                .unwrap()
                .iter()
                .map(|e| e.as_str().unwrap_or_default().to_string())
                .collect(),
            bad_blocks: v["bad_blocks"].as_u64().unwrap(),
            max_latency: Duration::from_secs_f64(v["max_latency_s"].as_f64().unwrap()),
            worst_at_s: v["worst_at_s"].as_f64().unwrap(),
        }
    }
}

fn assert_clean(cluster: &TestCluster, what: &str, r: &LoopResult) {
    println!(
        "{what}: {} writes, longest pause {:?} (at {:.1} s), {} bad blocks",
        r.writes, r.max_latency, r.worst_at_s, r.bad_blocks
    );
    assert!(
        r.errors.is_empty(),
        "{what}: the client saw errors: {:?}\n{}",
        r.errors,
        cluster.log_tails()
    );
    assert_eq!(
        r.bad_blocks, 0,
        "{what}: blocks differ from their last acknowledged write"
    );
    assert!(r.writes > 50, "{what}: too few writes: {r:?}");
    assert!(
        r.max_latency < PAUSE_MAX,
        "{what}: a write waited {:?}, more than grace + 5 s",
        r.max_latency
    );
}

/// Object `index` of the volume and its placement group's roles now.
fn roles(map: &ClusterMap, volume: flame_common::ids::VolumeId, index: u64) -> PgMembers {
    let pg = object_pg(ObjectId { volume, index }, map.pool.pg_count);
    PgMembers::compute(map, pg)
}

/// kill -9 of an OSD under a write loop: `kill_primary` picks the written object's
/// primary, otherwise one of its replicas.
fn kill_under_writes(kill_primary: bool) {
    let what = if kill_primary { "primary" } else { "replica" };
    let mut cluster = TestCluster::start_with(options(true, false));
    let vol = cluster.create_nbd_volume("fo", 16 * MIB);
    let map = cluster.map();
    let members = roles(&map, vol.id, 1);
    let victim = if kill_primary {
        members.primary().unwrap()
    } else {
        members.acting[1]
    };
    let w = WriteLoop::start(&cluster, "fo", 1, 14);
    w.wait_progress(&cluster, 100);
    let killed_at = Instant::now();
    cluster.kill_osd(cluster.osd_process(&map, victim));
    let down = wait_for(
        &cluster,
        Duration::from_millis(GRACE_MS + 10_000),
        "killed OSD marked down",
        || !osd_up(&cluster, victim),
    );
    println!("{what} {victim} killed; marked down after {down:?}");
    let r = w.finish(&cluster, Duration::from_secs(60));
    assert_clean(&cluster, &format!("kill -9 of the {what}"), &r);
    println!(
        "kill -9 of the {what}: longest client pause {:?} (grace {GRACE_MS} ms; killed {:?} ago)",
        r.max_latency,
        killed_at.elapsed()
    );
}

#[test]
fn kill_9_of_a_replica_under_writes_gives_no_client_error() {
    kill_under_writes(false);
}

#[test]
fn kill_9_of_a_primary_under_writes_gives_no_client_error() {
    kill_under_writes(true);
}

/// What an OSD answers a client that still has `map`, from address `source`.
fn old_map_answers(
    hm: flame_tests::HelloMaker,
    map: &ClusterMap,
    osd: OsdId,
    shard: u16,
    target: IoTarget,
    source: IpAddr,
) -> (i32, i32) {
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let map = map.clone();
    reactor
        .block_on(async move {
            let info = &map.osds[&osd];
            let conn = Conn::connect_from(
                TransportKind::Tcp,
                info.shard_addr(shard),
                Some(source),
                Duration::from_secs(5),
            )
            .await
            .expect("connect to the isolated OSD from an unblocked address");
            let rpc = |msg: Message| {
                let conn = &conn;
                async move {
                    conn.send(&msg).unwrap();
                    let reply = futures_lite::future::or(async { conn.recv().await.ok() }, async {
                        flame_common::reactor::sleep(Duration::from_secs(10)).await;
                        None
                    })
                    .await;
                    match reply {
                        Some(Message::Reply { status, .. }) => status,
                        Some(Message::HelloReply { status, .. }) => status,
                        other => panic!("no reply from the isolated OSD: {other:?}"),
                    }
                }
            };
            let hello = rpc(hm.hello(osd, shard, map.epoch, false, 0, 0)).await;
            assert_eq!(hello, status::OK, "hello");
            let read = rpc(Message::Read {
                id: RequestId(1),
                epoch: map.epoch,
                target: target.clone(),
                flags: 0,
                remote: None,
            })
            .await;
            let write = rpc(Message::Write {
                id: RequestId(2),
                epoch: map.epoch,
                target: target.clone(),
                flags: 0,
                seq: PgSeq(0),
                op: flame_common::ids::OpId::NONE,
                remote: None,
                data: flame_common::buffer::PayloadBuf::copy_from(&vec![0xeeu8; 4096]),
            })
            .await;
            (read, write)
        })
        .unwrap()
}

#[test]
fn a_partitioned_primary_is_replaced_and_acknowledges_nothing_after_its_lease() {
    partition_under_writes(true, options(true, true));
}

/// A replica cut off without a connection reset: the primary stops waiting for it
/// once the map drops it from the write set, long before `replica_timeout_ms`
/// (left at its 10 s default here).
#[test]
fn a_partitioned_replica_holds_writes_no_longer_than_the_grace() {
    partition_under_writes(
        false,
        ClusterOptions {
            osd_extra_yaml: "lease_ms: 2000\nconnect_timeout_ms: 1000\n".into(),
            ..options(true, true)
        },
    );
}

fn partition_under_writes(isolate_primary: bool, opts: ClusterOptions) {
    let what = if isolate_primary {
        "primary"
    } else {
        "replica"
    };
    let cluster = TestCluster::start_with(opts);
    let vol = cluster.create_nbd_volume("part", 16 * MIB);
    let old_map = cluster.map();
    let members = roles(&old_map, vol.id, 1);
    let victim = if isolate_primary {
        members.primary().unwrap()
    } else {
        members.acting[1]
    };
    let k = cluster.osd_process(&old_map, victim);
    let ip = cluster.osd_ip(k);
    let mut others = vec![cluster.mgr_ip(), cluster.client_ip()];
    others.extend(
        (0..cluster.osd_count())
            .filter(|&i| i != k)
            .map(|i| cluster.osd_ip(i)),
    );

    let w = WriteLoop::start(&cluster, "part", 1, 16);
    w.wait_progress(&cluster, 100);
    let partition = cluster.partition(ip, &others);
    let down = wait_for(
        &cluster,
        Duration::from_millis(GRACE_MS + 10_000),
        "isolated OSD marked down",
        || !osd_up(&cluster, victim),
    );
    println!("isolated {what} {victim} ({ip}) marked down after {down:?}");
    // The isolated OSD still believes the old map (where it is primary). Asked
    // directly by a client that also has the old map, from an address the
    // partition does not block, it must not serve: its lease ran out before the
    // manager could mark it down.
    let pg = object_pg(
        ObjectId {
            volume: vol.id,
            index: 1,
        },
        old_map.pool.pg_count,
    );
    let target = IoTarget {
        pg,
        object: ObjectId {
            volume: vol.id,
            index: 1,
        },
        offset: 0,
        length: 4096,
    };
    let shard = old_map.osds[&victim].shard_of(pg);
    let (read, write) = old_map_answers(
        cluster.hello_maker(),
        &old_map,
        victim,
        shard,
        target,
        IpAddr::V4(cluster.spare_ip()),
    );
    println!("isolated OSD answered read {read}, write {write}");
    for (op, st) in [("read", read), ("write", write)] {
        assert!(
            st == status::EAGAIN || st == status::ESTALE,
            "the isolated old {what} answered a {op} with status {st}, not EAGAIN/ESTALE\n{}",
            cluster.log_tails()
        );
    }
    let r = w.finish(&cluster, Duration::from_secs(60));
    assert_clean(&cluster, &format!("partition of the {what}"), &r);
    drop(partition);
    let back = wait_for(
        &cluster,
        Duration::from_secs(20),
        "isolated OSD up again after the partition healed",
        || osd_up(&cluster, victim),
    );
    println!("{victim} up again {back:?} after the partition healed");
}

#[test]
fn a_forwarded_write_from_before_the_groups_roles_changed_is_refused() {
    let mut cluster = TestCluster::start_with(options(false, false));
    let vol = cluster.create_volume("fence", 16 * MIB);
    let map0 = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let pg = object_pg(object, map0.pool.pg_count);
    let members = PgMembers::compute(&map0, pg);
    let replica = members.acting[1];
    // The group's roles change: its third copy goes down (the replica stays).
    let gone = members.acting[2];
    cluster.kill_osd(cluster.osd_process(&map0, gone));
    wait_for(
        &cluster,
        Duration::from_secs(20),
        "the third copy marked down",
        || !cluster.map().osds[&gone].up,
    );
    let since = cluster.map().interval_since(pg);
    assert!(
        since > map0.epoch,
        "the group's roles changed: a new interval"
    );
    // And an epoch that changes no group's roles after it.
    cluster.create_volume("fence2", MIB);
    let map = cluster.map();
    assert_eq!(map.interval_since(pg), since);
    assert!(map.epoch > since);
    let shard = map.osds[&replica].shard_of(pg);
    let addr = map.osds[&replica].shard_addr(shard);
    let current = map.epoch;
    let mut reactor = Reactor::new(ReactorConfig::default()).unwrap();
    let hm = cluster.hello_maker();
    let answers = reactor
        .block_on(async move {
            let conn = Conn::connect(TransportKind::Tcp, addr, Duration::from_secs(5))
                .await
                .unwrap();
            conn.send(&hm.hello(replica, shard, current, true, 0, 0))
                .unwrap();
            assert!(matches!(
                conn.recv().await.unwrap(),
                Message::HelloReply { status: 0, .. }
            ));
            // First at the current epoch, until the replica has caught up with it
            // (it fetches the map a request names); then from the epoch that
            // started the group's interval (accepted: same roles), then from the
            // epoch before it (refused: other roles).
            let mut answers = Vec::new();
            let epochs = std::iter::repeat_n(current, 50).chain([since, Epoch(since.0 - 1)]);
            for (i, epoch) in epochs.enumerate() {
                if epoch == current
                    && answers
                        .last()
                        .is_some_and(|a: &(i32, Epoch)| a.0 == status::OK)
                {
                    continue;
                }
                flame_common::reactor::sleep(Duration::from_millis(20)).await;
                conn.send(&Message::Write {
                    id: RequestId(i as u64 + 1),
                    epoch,
                    target: IoTarget {
                        pg,
                        object,
                        offset: 0,
                        length: 4096,
                    },
                    flags: flags::REPLICA,
                    seq: PgSeq(0),
                    op: flame_common::ids::OpId::NONE,
                    remote: None,
                    data: flame_common::buffer::PayloadBuf::copy_from(&[7u8; 4096]),
                })
                .unwrap();
                match conn.recv().await.unwrap() {
                    Message::Reply { status, epoch, .. } => answers.push((status, epoch)),
                    other => panic!("{other:?}"),
                }
            }
            answers
        })
        .unwrap();
    let map = cluster.map();
    let n = answers.len();
    assert!(n >= 3, "{answers:?}");
    assert_eq!(
        answers[n - 3].0,
        status::OK,
        "a forward from the current epoch is applied: {answers:?}"
    );
    assert_eq!(
        answers[n - 2].0,
        status::OK,
        "a forward from an older epoch of the same interval is applied: {answers:?}"
    );
    assert_eq!(
        answers[n - 1],
        (status::ESTALE, map.epoch),
        "a forward from epoch {} (before the group's interval began at {}) must be refused \
         with the replica's epoch",
        since.0 - 1,
        since
    );
}

#[test]
fn a_hung_shard_stops_the_heartbeats_and_its_osd_is_marked_down() {
    let cluster = TestCluster::start_with(ClusterOptions {
        osd_extra_yaml: format!("{OSD_YAML}shard_stall_ms: 1000\n"),
        ..options(false, false)
    });
    let map = cluster.map();
    let id = *map
        .osds
        .iter()
        .find(|(_, o)| o.addr == cluster.osd_addr(0, 0))
        .unwrap()
        .0;
    let hook = cluster.osd_data_dir(0).join("failpoint-shard-stall");
    std::fs::write(&hook, "1").unwrap();
    let started = Instant::now();
    while osd_up(&cluster, id) {
        assert!(
            started.elapsed() < Duration::from_millis(1000 + GRACE_MS + 10_000),
            "osd.0 with shard 1 hung is still up: is flame-osd built with the test hooks \
             (cargo build --workspace --bins --features flame-osd/failpoints)?\n{}",
            cluster.log_tails()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    println!("hung shard: OSD marked down after {:?}", started.elapsed());
    std::fs::remove_file(&hook).unwrap();
    wait_for(
        &cluster,
        Duration::from_secs(20),
        "OSD up once the shard runs again",
        || osd_up(&cluster, id),
    );
}
