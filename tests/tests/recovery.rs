//! Recovery, backfill and scrub with the real daemons: an OSD killed with kill -9
//! while writes continue and then restarted is caught up from the placement
//! groups' logs (or by backfill when the logs no longer reach back), and ends with
//! copies byte-identical to the others; bits flipped in a replica's stored block
//! are found and repaired by `flame-admin scrub`.
//!
//! "Byte-identical" is checked on the files themselves: every object of the volume
//! is read from every OSD's data directory (docs/on-disk-format.md) and compared,
//! so the proof does not depend on the code under test.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::ids::VolumeId;
use flame_tests::{ClusterOptions, TestCluster, http_get, run_bounded};
use std::collections::BTreeSet;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const VOLUME_BYTES: u64 = 32 * MIB;
const OBJECT_BYTES: u64 = 4 * MIB;

fn options(extra: &str) -> ClusterOptions {
    ClusterOptions {
        nbd: true,
        pg_count: 16,
        heartbeat_grace_ms: 2000,
        osd_heartbeat_interval_ms: 200,
        osd_extra_yaml: format!("scrub_interval_s: 0\n{extra}"),
        ..ClusterOptions::default()
    }
}

/// Random 4 KiB writes to the volume for `runtime` through `flame-admin bench`
/// (the client library, with its retries), in the background.
fn start_writes(cluster: &TestCluster, volume: &str, runtime: &str, seed: u64) -> Child {
    cluster
        .admin_command()
        .args(["--mgr", &cluster.mgr_addr().to_string(), "bench", volume])
        .args(["--rw", "randwrite", "--bs", "4k", "--iodepth", "4"])
        .args([
            "--runtime",
            runtime,
            "--force-overwrite",
            "--size-limit",
            "16M",
        ])
        .args(["--seed", &seed.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot start flame-admin bench")
}

/// Waits (bounded) for the background writes and asserts they all succeeded.
fn finish_writes(cluster: &TestCluster, child: Child) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut child = child;
    loop {
        if let Some(status) = child.try_wait().expect("wait for bench") {
            let out = child.wait_with_output().expect("bench output");
            assert!(
                status.success(),
                "the writes failed while an OSD was down:\n{}\n{}",
                flame_tests::output_text(&out),
                cluster.log_tails()
            );
            return;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("bench did not finish\n{}", cluster.log_tails());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every object's data on every OSD, trailing zeroes trimmed (a missing file and
/// a file of zeroes read the same); the first difference found, if any.
fn copies_differ(cluster: &TestCluster, volume: VolumeId) -> Option<String> {
    for index in 0..VOLUME_BYTES / OBJECT_BYTES {
        let copies: Vec<Vec<u8>> = (0..cluster.osd_count())
            .map(|i| {
                let mut d = cluster.object_data(i, volume, index).unwrap_or_default();
                while d.last() == Some(&0) {
                    d.pop();
                }
                d
            })
            .collect();
        for (i, c) in copies.iter().enumerate().skip(1) {
            if *c != copies[0] {
                return Some(format!(
                    "object {index}: osd.{i} differs from osd.0 ({})",
                    flame_tests::first_difference(c, &copies[0])
                        .unwrap_or_else(|| "lengths differ".into())
                ));
            }
        }
    }
    None
}

/// Waits (bounded) until every copy of every object is identical.
fn wait_copies_identical(cluster: &TestCluster, volume: VolumeId, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let Some(diff) = copies_differ(cluster, volume) else {
            return;
        };
        assert!(
            Instant::now() < deadline,
            "copies still differ after {within:?}: {diff}\n{}",
            cluster.log_tails()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Sum over every OSD of the metric samples whose line starts with `prefix`.
fn metric_sum(cluster: &TestCluster, prefix: &str) -> f64 {
    (0..cluster.osd_count())
        .filter_map(|i| http_get(cluster.osd_metrics_addr(i), "/metrics").ok())
        .flat_map(|(_, body)| {
            body.lines()
                .filter(|l| l.starts_with(prefix))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

/// Whether every placement group's acting copies agree (`flame-admin pg compare`).
fn pg_compare_ok(cluster: &TestCluster, volume: &str) -> (bool, String) {
    let mut cmd = cluster.admin_command();
    cmd.args([
        "--mgr",
        &cluster.mgr_addr().to_string(),
        "pg",
        "compare",
        volume,
    ]);
    let out = run_bounded(&mut cmd, Duration::from_secs(60));
    (out.status.success(), flame_tests::output_text(&out))
}

/// The scenario of both recovery tests: writes run, OSD 2 is killed, writes go on
/// without it, it restarts while writes go on, and its copies must end identical.
fn kill_write_restart(cluster: &mut TestCluster, volume: &str) -> VolumeId {
    let vol = cluster.create_nbd_volume(volume, VOLUME_BYTES);
    // Data past the random writes' 16 MiB, zeroed and discarded while OSD 2 is down:
    // its copy must lose those bytes too (holes are copied as holes).
    cluster.qemu_io(volume, &["write -P 0xab 24M 2M"]);
    let writes = start_writes(cluster, volume, "9s", 7);
    std::thread::sleep(Duration::from_secs(1));
    cluster.kill_osd(2);
    cluster.wait_osd_down(2, Duration::from_secs(20));
    // Writes the killed OSD misses.
    cluster.qemu_io(volume, &["write -z 24M 512k", "discard 25M 512k"]);
    std::thread::sleep(Duration::from_secs(1));
    cluster.restart_osd(2);
    finish_writes(cluster, writes);
    wait_copies_identical(cluster, vol.id, Duration::from_secs(30));
    vol.id
}

#[test]
fn a_restarted_osd_catches_up_from_the_log_and_copies_end_identical() {
    let mut cluster = TestCluster::start_with(options(""));
    kill_write_restart(&mut cluster, "logrec");
    let log = metric_sum(&cluster, "flame_osd_recovery_members_total{kind=\"log\"}");
    let log_objects = metric_sum(&cluster, "flame_osd_recovery_objects_total{kind=\"log\"}");
    assert!(
        log > 0.0 && log_objects > 0.0,
        "no member was recovered from the log (members {log}, objects {log_objects})\n{}",
        cluster.log_tails()
    );
    let (ok, text) = pg_compare_ok(&cluster, "logrec");
    assert!(ok, "pg compare: {text}");
    // Each OSD serves its groups' log bounds, and some primary of a written group
    // has log entries (which OSD that is depends on placement).
    let mut bodies = Vec::new();
    for i in 0..cluster.osd_count() {
        let (code, body) = http_get(cluster.osd_metrics_addr(i), "/v1/pgs").unwrap();
        assert_eq!(code, 200, "{body}");
        bodies.push(body);
    }
    let logged = bodies.iter().any(|body| {
        let pgs: serde_json::Value = serde_json::from_str(body).unwrap();
        pgs.as_array()
            .expect("a list of groups")
            .iter()
            .any(|p| p["role"] == "primary" && p["log_last_seq"].as_u64() > Some(0))
    });
    assert!(logged, "no primary group with a log: {bodies:?}");
    let body = &bodies[0];
    let pgs: serde_json::Value = serde_json::from_str(body).unwrap();
    let pgs = pgs.as_array().expect("a list of groups");
    let one = pgs[0]["pg"].as_u64().unwrap();
    let (code, body) = http_get(cluster.osd_metrics_addr(0), &format!("/v1/pgs/{one}")).unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("log_first_seq"), "{body}");
    let (code, _) = http_get(cluster.osd_metrics_addr(0), "/v1/pgs/x").unwrap();
    assert_eq!(code, 400);
}

#[test]
fn a_log_that_no_longer_reaches_back_means_backfill() {
    let mut cluster = TestCluster::start_with(options("pg_log_entries_max: 4\n"));
    kill_write_restart(&mut cluster, "backfill");
    let backfill = metric_sum(
        &cluster,
        "flame_osd_recovery_members_total{kind=\"backfill\"}",
    );
    assert!(
        backfill > 0.0,
        "no member was backfilled\n{}",
        cluster.log_tails()
    );
    let (ok, text) = pg_compare_ok(&cluster, "backfill");
    assert!(ok, "pg compare: {text}");
}

#[test]
fn scrub_finds_and_repairs_bits_flipped_in_a_replica() {
    let cluster = TestCluster::start_with(options(""));
    let vol = cluster.create_volume("scrub", VOLUME_BYTES);
    let writes = start_writes(&cluster, "scrub", "2s", 3);
    finish_writes(&cluster, writes);
    cluster.admin_ok(&["pg", "compare", "scrub"]);
    // Peering would copy the primary's object over a flipped replica before the
    // scrub looks.
    let all: Vec<usize> = (0..cluster.osd_count()).collect();
    cluster.wait_peered(&all, Duration::from_secs(60));
    // Flip bits in a block a replica stores (not the primary: a client read would
    // repair a bad primary block first).
    let map = cluster.map();
    let mut flipped = BTreeSet::new();
    for index in 0..VOLUME_BYTES / OBJECT_BYTES {
        let object = flame_common::ids::ObjectId {
            volume: vol.id,
            index,
        };
        let loc = flame_common::placement::locate(&map, object);
        let replica = loc.osds[1];
        let i = (0..cluster.osd_count())
            .find(|&i| {
                map.osds
                    .get(&replica)
                    .is_some_and(|o| o.addr == cluster.osd_addr(i, 0))
            })
            .expect("replica process");
        let path = cluster.object_path(i, vol.id, index);
        let Ok(mut bytes) = std::fs::read(&path) else {
            continue;
        };
        // The first non-zero data byte: a block that holds written data.
        let Some(at) = bytes
            .iter()
            .skip(flame_tests::OBJECT_DATA_OFFSET)
            .position(|&b| b != 0)
        else {
            continue;
        };
        bytes[flame_tests::OBJECT_DATA_OFFSET + at] ^= 0x5a;
        std::fs::write(&path, &bytes).unwrap();
        flipped.insert(index);
        if flipped.len() == 2 {
            break;
        }
    }
    assert!(!flipped.is_empty(), "no object to corrupt");
    assert!(copies_differ(&cluster, vol.id).is_some());
    let (ok, text) = pg_compare_ok(&cluster, "scrub");
    assert!(!ok, "pg compare missed the corruption: {text}");

    let report = cluster.admin_json(&["scrub", "scrub"]);
    assert_eq!(
        report["inconsistent"].as_u64(),
        Some(flipped.len() as u64),
        "{report}"
    );
    assert_eq!(
        report["repaired"].as_u64(),
        Some(flipped.len() as u64),
        "{report}"
    );
    assert_eq!(report["primary_won"].as_u64(), Some(0), "{report}");
    assert!(
        copies_differ(&cluster, vol.id).is_none(),
        "scrub left copies different"
    );
    cluster.admin_ok(&["pg", "compare", "scrub"]);
    assert_eq!(
        metric_sum(&cluster, "flame_osd_scrub_errors_total"),
        flipped.len() as f64
    );
    assert_eq!(
        metric_sum(&cluster, "flame_osd_scrub_repaired_total"),
        flipped.len() as f64
    );
    // A second scrub finds nothing.
    let again = cluster.admin_json(&["scrub", "scrub"]);
    assert_eq!(again["inconsistent"].as_u64(), Some(0), "{again}");
}

/// Object files under an OSD's data directory.
fn object_files(cluster: &TestCluster, i: usize) -> usize {
    let pgs = cluster.osd_data_dir(i).join("pgs");
    std::fs::read_dir(pgs)
        .map(|dirs| {
            dirs.flatten()
                .filter_map(|d| std::fs::read_dir(d.path()).ok())
                .map(|files| files.count())
                .sum()
        })
        .unwrap_or(0)
}

#[test]
fn an_osd_taken_out_is_replaced_and_its_copies_are_removed_after_recovery() {
    let cluster = TestCluster::start_with(ClusterOptions {
        osds: 4,
        nbd: false,
        ..options("stray_delete_delay_ms: 500\n")
    });
    let vol = cluster.create_volume("out", VOLUME_BYTES);
    let writes = start_writes(&cluster, "out", "2s", 11);
    finish_writes(&cluster, writes);
    let out = cluster.osd_id(3);
    assert!(object_files(&cluster, 3) > 0, "osd.3 holds nothing to move");
    let resp = cluster.mgr_post(&format!("/v1/osds/{}/out", out.0), &());
    assert!(matches!(resp, Ok((200, _))), "osd out: {resp:?}");
    cluster.wait_clean(Duration::from_secs(40));
    // Every object has its three copies where placement now puts them, identical.
    let map = cluster.map();
    for index in 0..VOLUME_BYTES / OBJECT_BYTES {
        let object = flame_common::ids::ObjectId {
            volume: vol.id,
            index,
        };
        let holders: Vec<usize> = flame_common::placement::locate(&map, object)
            .osds
            .iter()
            .map(|id| {
                (0..cluster.osd_count())
                    .find(|&i| map.osds[id].addr == cluster.osd_addr(i, 0))
                    .expect("holder process")
            })
            .collect();
        assert!(
            !holders.contains(&3),
            "{object} still placed on the out OSD"
        );
        let data: Vec<Vec<u8>> = holders
            .iter()
            .map(|&i| {
                let mut d = cluster.object_data(i, vol.id, index).unwrap_or_default();
                while d.last() == Some(&0) {
                    d.pop();
                }
                d
            })
            .collect();
        assert!(
            data.iter().all(|d| *d == data[0]),
            "{object}: copies differ after re-replication"
        );
    }
    let (ok, text) = pg_compare_ok(&cluster, "out");
    assert!(ok, "pg compare: {text}");
    // The out OSD's copies go once the groups are clean.
    let deadline = Instant::now() + Duration::from_secs(20);
    while object_files(&cluster, 3) > 0 {
        assert!(
            Instant::now() < deadline,
            "osd.3 still holds {} object files\n{}",
            object_files(&cluster, 3),
            cluster.log_tails()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(metric_sum(&cluster, "flame_osd_stray_pgs_removed_total") > 0.0);
}

/// The status's object-copy figures against what the map says, for `objects`
/// objects of `volume` (all written): `(degraded, misplaced)` copies expected, from
/// each object's group roles in `map`.
fn expected_copies(
    map: &flame_common::map::ClusterMap,
    volume: VolumeId,
    objects: u64,
) -> (u64, u64) {
    let size = map.pool.size as usize;
    (0..objects)
        .map(|index| {
            let pg = flame_common::placement::object_pg(
                flame_common::ids::ObjectId { volume, index },
                map.pool.pg_count,
            );
            let m = flame_common::placement::PgMembers::compute(map, pg);
            let misplaced = m.acting.iter().filter(|id| !m.placed.contains(id)).count();
            (size.saturating_sub(m.acting.len()) as u64, misplaced as u64)
        })
        .fold((0, 0), |(d, m), (a, b)| (d + a, m + b))
}

/// Polls the status until its object figures match the map of the same epoch and
/// `want(degraded, misplaced)` holds; returns them.
fn wait_object_figures(
    cluster: &TestCluster,
    volume: VolumeId,
    objects: u64,
    what: &str,
    want: impl Fn(u64, u64) -> bool,
) -> (u64, u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut last = String::new();
    while Instant::now() < deadline {
        let st = cluster.status();
        let map = cluster.map();
        if map.epoch == st.epoch {
            let r = &st.recovery;
            let exp = expected_copies(&map, volume, objects);
            last = format!(
                "epoch {}: objects {} (uncounted groups {}), degraded {}, misplaced {}, \
                 recovering {}; the map says degraded {}, misplaced {}",
                st.epoch.0,
                r.objects,
                r.pgs_uncounted,
                r.degraded_copies,
                r.misplaced_copies,
                r.recovering_copies,
                exp.0,
                exp.1
            );
            if r.objects == objects
                && r.object_copies == objects * u64::from(map.pool.size)
                && (r.degraded_copies, r.misplaced_copies) == exp
                && want(exp.0, exp.1)
            {
                println!("{what}: {last}");
                return exp;
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!(
        "{what}: not reached in 30 s: {last}\n{}",
        cluster.log_tails()
    );
}

/// `flame-admin status` and the manager's metrics count degraded copies while an
/// OSD is down (exactly the copies its groups lack, from the primaries' object
/// counts) and misplaced copies while an OSD taken out still holds the only
/// copies placement moved away; both go back to 0 once recovery is done. The
/// recovery throttle keeps the misplaced phase long enough to be seen.
#[test]
fn status_counts_degraded_and_misplaced_copies_until_recovery_ends() {
    let mut cluster = TestCluster::start_with(ClusterOptions {
        osd_extra_yaml: "recovery_bytes_per_sec: 1048576\nscrub_interval_s: 0\n".into(),
        ..ClusterOptions::failover(4)
    });
    let size = 16 * MIB;
    let objects = size / OBJECT_BYTES;
    let (vol, state) = flame_tests::oracle::create_filled(&cluster, "counts", size, 7, 60_000);
    let mgr = cluster.client_target();
    wait_object_figures(&cluster, vol.id, objects, "clean", |d, m| d == 0 && m == 0);
    let text = cluster.admin_ok(&["status"]);
    assert!(
        text.contains(&format!(
            "objects   {objects} objects, {} copies; 0/{} (0.0%) degraded",
            objects * 3,
            objects * 3
        )),
        "{text}"
    );

    // kill -9 of an OSD holding copies: exactly the copies its groups lack.
    let map = cluster.map();
    let victim = (0..cluster.osd_count())
        .find(|&i| {
            let id = cluster.osd_id(i);
            (0..objects).any(|index| {
                flame_common::placement::locate(
                    &map,
                    flame_common::ids::ObjectId {
                        volume: vol.id,
                        index,
                    },
                )
                .osds
                .contains(&id)
            })
        })
        .expect("an OSD holding a copy");
    cluster.kill_osd(victim);
    cluster.wait_osd_down(victim, Duration::from_secs(20));
    let (degraded, _) =
        wait_object_figures(&cluster, vol.id, objects, "one OSD down", |d, _| d > 0);
    let metrics = http_get(cluster.mgr_addr(), "/metrics")
        .expect("mgr metrics")
        .1;
    assert!(
        metrics.contains(&format!(
            "flame_mgr_object_copies{{state=\"degraded\"}} {degraded}"
        )),
        "{metrics}"
    );
    let text = cluster.admin_ok(&["status"]);
    assert!(
        text.contains(&format!("{degraded}/{} (", objects * 3)),
        "{text}"
    );
    cluster.restart_osd(victim);
    cluster.wait_clean(Duration::from_secs(60));
    wait_object_figures(&cluster, vol.id, objects, "restarted and clean", |d, m| {
        d == 0 && m == 0
    });

    // osd out of a live OSD: its copies stay complete but misplaced until the new
    // members are complete.
    let id = cluster.osd_id(victim);
    cluster.admin_ok(&["osd", "out", &id.to_string()]);
    wait_object_figures(&cluster, vol.id, objects, "one OSD out", |d, m| {
        d == 0 && m > 0
    });
    cluster.wait_clean(Duration::from_secs(60));
    wait_object_figures(&cluster, vol.id, objects, "out and clean", |d, m| {
        d == 0 && m == 0
    });
    let again = flame_tests::oracle::verify_volume(&mgr, "counts", &state, 60_000);
    assert!(again.clean(), "{again}");
}
