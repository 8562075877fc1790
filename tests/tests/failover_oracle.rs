//! Failures under the verified workload (the write oracle, tests/src/oracle.rs):
//! kill -9 of an OSD, an OSD going out, two of three copies down, an OSD added to a
//! filled cluster, kill -9 of the manager. In every case the client sees no error,
//! every read and every block at the end checks against the oracle, and once the
//! cluster is clean again the copies of every placement group are byte-identical.
//!
//! The clusters use a 2 s failure-detection grace (ClusterOptions::failover), so a
//! kill -9 is noticed within about 2.5 s.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::ids::OsdId;
use flame_common::placement::{PgTable, mix64};
use flame_tests::failover::{CLEAN_TIMEOUT, assert_copies_identical};
use flame_tests::oracle::{
    OracleState, Workload, WorkloadConfig, WorkloadReport, create_filled, verify_volume,
};
use flame_tests::{ClusterOptions, TestCluster};
use std::time::Duration;

const MIB: u64 = 1 << 20;
const OBJECT: u64 = 4 * MIB;
/// The client's io timeout in these tests: long, so that an operation that would
/// time out shows up as a long stall in the report rather than hiding as an error
/// budget; the workload's own bounds keep the test short.
const IO_TIMEOUT_MS: u64 = 60_000;
/// The target: no client operation pauses longer than the failure-detection
/// grace (2 s here) + 3 s.
const PAUSE_MAX: Duration = Duration::from_secs(5);

/// Seed of the oracle states (mixed with the volume id).
const MAGIC: u64 = 0xfa11_0fe5;

fn magic(vol: &flame_common::map::VolumeInfo) -> u64 {
    mix64(vol.id.0 ^ MAGIC)
}

fn workload(cluster: &TestCluster, volume: &str, state: OracleState, secs: u64) -> Workload {
    let cfg = WorkloadConfig {
        writers: 4,
        max_duration: Duration::from_secs(secs),
        io_timeout_ms: IO_TIMEOUT_MS,
        ..WorkloadConfig::default()
    };
    Workload::start(&cluster.client_target(), volume, state, cfg)
}

#[track_caller]
fn assert_progress(cluster: &TestCluster, w: &Workload, n: u64, within: Duration, what: &str) {
    assert!(
        w.wait_more_acks(n, within),
        "{what}: the workload did not complete {n} more operations within {within:?} \
         ({} in flight, {} write failures, {} errors)\n{}",
        w.progress()
            .in_flight
            .load(std::sync::atomic::Ordering::Relaxed),
        w.progress()
            .writes_failed
            .load(std::sync::atomic::Ordering::Relaxed),
        w.progress()
            .errors
            .load(std::sync::atomic::Ordering::Relaxed),
        cluster.log_tails()
    );
}

#[track_caller]
fn assert_report(cluster: &TestCluster, report: &WorkloadReport, state: &OracleState) {
    eprintln!("oracle: {report}");
    assert!(report.clean(), "{report}\n{}", cluster.log_tails());
    assert_eq!(
        report.blocks_verified,
        state.block_count(),
        "{report}\n{}",
        cluster.log_tails()
    );
}

/// After the workload: wait until clean, read everything again through a new
/// client, compare the copies of every object.
fn settle_and_compare(cluster: &TestCluster, volume: &str, state: &OracleState) {
    let took = cluster.wait_clean(CLEAN_TIMEOUT);
    eprintln!("clean {took:?} after the workload stopped");
    let again = verify_volume(&cluster.client_target(), volume, state, IO_TIMEOUT_MS);
    assert!(
        again.clean() && again.blocks_verified == state.block_count(),
        "after clean: {again}\n{}",
        cluster.log_tails()
    );
    let vol = cluster.volume(volume);
    let objects = vol.size.div_ceil(OBJECT);
    let copies = cluster.compare_copies(vol.id, objects);
    eprintln!("copies: {copies}");
    assert_copies_identical(cluster, &copies);
    assert_eq!(copies.copies, objects * 3, "{copies}");
}

/// kill -9 of one of three OSDs under the workload: no client error, no stall
/// beyond grace + 3 s, every block checks; restarted, it catches up and the three
/// copies end identical.
#[test]
fn kill9_one_of_three_osds_under_load() {
    let mut cluster = TestCluster::start_with(ClusterOptions::failover(3));
    let size = 32 * MIB;
    let vol = cluster.create_volume("k1", size);
    let w = workload(&cluster, "k1", OracleState::new(magic(&vol), size), 40);
    assert_progress(
        &cluster,
        &w,
        100,
        Duration::from_secs(20),
        "before the kill",
    );

    cluster.kill_osd(1);
    let down = cluster.wait_osd_down(1, Duration::from_secs(15));
    eprintln!("osd.1 marked down {down:?} after kill -9");
    assert_progress(&cluster, &w, 200, Duration::from_secs(20), "one OSD down");

    cluster.restart_osd(1);
    assert_progress(&cluster, &w, 100, Duration::from_secs(20), "after restart");
    let (report, state) = w.stop();
    assert_report(&cluster, &report, &state);
    assert!(
        report.op_latency_max <= PAUSE_MAX,
        "a client operation stalled {:?} (> {PAUSE_MAX:?}): {report}\nslowest: {:?}",
        report.op_latency_max,
        report.slow_ops.iter().max_by_key(|o| o.end_us - o.start_us)
    );
    settle_and_compare(&cluster, "k1", &state);
}

/// Four OSDs; one is killed and left down until the manager marks it out: its
/// placement groups get new members and recovery restores three copies on the
/// remaining three OSDs while the workload runs.
#[test]
fn osd_out_recovers_three_copies_on_the_rest() {
    let mut cluster = TestCluster::start_with(ClusterOptions {
        down_out_interval_ms: Some(3000),
        ..ClusterOptions::failover(4)
    });
    let size = 32 * MIB;
    let (_, state) = create_filled(&cluster, "out", size, MAGIC, IO_TIMEOUT_MS);
    let w = workload(&cluster, "out", state, 45);
    assert_progress(
        &cluster,
        &w,
        100,
        Duration::from_secs(20),
        "before the kill",
    );

    let victim = 2;
    let victim_id = cluster.osd_id(victim);
    cluster.kill_osd(victim);
    cluster.wait_osd_down(victim, Duration::from_secs(15));
    let out = cluster.wait_osd_out(victim, Duration::from_secs(20));
    eprintln!("osd.{victim} out {out:?} after it was marked down");
    let clean = cluster.wait_clean(CLEAN_TIMEOUT);
    eprintln!("clean {clean:?} after out, under load");
    assert_progress(&cluster, &w, 100, Duration::from_secs(20), "after recovery");
    let (report, state) = w.stop();
    assert_report(&cluster, &report, &state);
    // Nothing placed on the dead OSD any more.
    let map = cluster.map();
    for (pg, m) in PgTable::new(&map).iter() {
        assert!(
            !m.placed.contains(&victim_id),
            "pg {} still placed on out {victim_id}: {m:?}",
            pg.0
        );
    }
    settle_and_compare(&cluster, "out", &state);
}

/// Two of three copies down: I/O to those groups waits (no error, no stale data);
/// with one back it completes and verifies.
#[test]
fn two_of_three_down_waits_then_resumes() {
    let mut cluster = TestCluster::start_with(ClusterOptions::failover(3));
    let size = 16 * MIB;
    let (_, state) = create_filled(&cluster, "two", size, MAGIC, IO_TIMEOUT_MS);
    let ids: Vec<OsdId> = (0..3).map(|i| cluster.osd_id(i)).collect();
    cluster.kill_osd(1);
    cluster.kill_osd(2);
    cluster.wait_osd_down(1, Duration::from_secs(15));
    cluster.wait_osd_down(2, Duration::from_secs(15));

    // With three OSDs every group has a copy on each, so all I/O waits.
    let w = workload(&cluster, "two", state, 50);
    std::thread::sleep(Duration::from_secs(4));
    let p = w.progress();
    let get = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(
        (
            get(&p.writes_acked),
            get(&p.reads_verified),
            get(&p.writes_failed),
            get(&p.reads_failed),
            get(&p.errors)
        ),
        (0, 0, 0, 0, 0),
        "below min_size I/O must wait: nothing acknowledged, nothing failed\n{}",
        cluster.log_tails()
    );
    assert!(get(&p.in_flight) > 0, "nothing in flight");

    // Bring back the OSD that still holds complete copies of the most groups (the
    // one marked down second stayed complete: no write could be acknowledged
    // without it).
    let map = cluster.map();
    let table = PgTable::new(&map);
    let complete_count = |id: OsdId| {
        table
            .iter()
            .filter(|(_, m)| m.down_complete.contains(&id))
            .count()
    };
    let back = if complete_count(ids[1]) >= complete_count(ids[2]) {
        1
    } else {
        2
    };
    cluster.restart_osd(back);
    assert_progress(&cluster, &w, 100, Duration::from_secs(20), "one copy back");
    let (report, state) = w.stop();
    assert_report(&cluster, &report, &state);
    cluster.restart_osd(3 - back);
    settle_and_compare(&cluster, "two", &state);
}

/// A fourth OSD joins a filled three-OSD cluster: about a quarter of the copies
/// move to it (within 1.5x of that), the old copies are removed once the new ones
/// are complete, and the data stays intact under the workload.
#[test]
fn fourth_osd_rebalances_a_filled_cluster() {
    let mut cluster = TestCluster::start_with(ClusterOptions::failover(3));
    // 16 objects, 48 copies: with these OSD ids and volume id placement moves 7
    // copies to the fourth OSD (the ideal quarter is 12); small enough to rebalance
    // well within the test's time on a loaded two-core machine.
    let size = 64 * MIB;
    let (vol, state) = create_filled(&cluster, "grow", size, MAGIC, IO_TIMEOUT_MS);
    let objects = size / OBJECT;
    let before = cluster.object_files_per_osd(vol.id);
    assert_eq!(
        before.iter().sum::<usize>() as u64,
        objects * 3,
        "{before:?}"
    );

    let w = workload(&cluster, "grow", state, 40);
    assert_progress(
        &cluster,
        &w,
        50,
        Duration::from_secs(20),
        "before the new OSD",
    );
    let new = cluster.add_osd();
    let clean = cluster.wait_clean(CLEAN_TIMEOUT);
    eprintln!("clean {clean:?} after osd.{new} joined, under load");
    assert_progress(
        &cluster,
        &w,
        50,
        Duration::from_secs(20),
        "after rebalancing",
    );
    let (report, state) = w.stop();
    assert_report(&cluster, &report, &state);
    settle_and_compare(&cluster, "grow", &state);

    // Old copies are deleted once the new ones are complete (bounded wait).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let report = loop {
        let r = cluster.compare_copies(vol.id, objects);
        if r.strays.is_empty() || std::time::Instant::now() > deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert!(
        report.strays.is_empty(),
        "{report}\n{}",
        cluster.log_tails()
    );

    let after = cluster.object_files_per_osd(vol.id);
    let total: usize = after.iter().sum();
    assert_eq!(total as u64, objects * 3, "{after:?}");
    let moved: usize = after
        .iter()
        .enumerate()
        .map(|(i, &n)| n.saturating_sub(before.get(i).copied().unwrap_or(0)))
        .sum();
    let ideal = total as f64 / 4.0;
    eprintln!("copies per OSD before {before:?} after {after:?}: moved {moved}, ideal {ideal}");
    assert!(after[new] > 0, "nothing moved to the new OSD: {after:?}");
    assert!(
        moved as f64 <= 1.5 * ideal,
        "moved {moved} copies, more than 1.5x the ideal {ideal}: {before:?} -> {after:?}"
    );
}

/// kill -9 of the manager under the workload: nothing fails while it is down (I/O
/// may pause once the OSDs' leases run out), and after its restart the workload
/// carries on and an OSD failure is handled again.
#[test]
fn manager_kill9_under_load() {
    let mut cluster = TestCluster::start_with(ClusterOptions::failover(3));
    let size = 16 * MIB;
    let vol = cluster.create_volume("mgr", size);
    let w = workload(&cluster, "mgr", OracleState::new(magic(&vol), size), 40);
    assert_progress(
        &cluster,
        &w,
        100,
        Duration::from_secs(20),
        "before the kill",
    );
    let epoch = cluster.map().epoch;
    cluster.kill_mgr();
    // Without the manager, OSD leases run out (docs/failover.md): I/O may pause,
    // but nothing may fail.
    std::thread::sleep(Duration::from_secs(3));
    let p = w.progress();
    assert_eq!(
        (
            p.writes_failed.load(std::sync::atomic::Ordering::Relaxed),
            p.reads_failed.load(std::sync::atomic::Ordering::Relaxed),
            p.errors.load(std::sync::atomic::Ordering::Relaxed)
        ),
        (0, 0, 0),
        "I/O failed while the manager was down\n{}",
        cluster.log_tails()
    );
    cluster.restart_mgr();
    assert!(cluster.map().epoch >= epoch, "the manager lost its map");
    assert_progress(&cluster, &w, 100, Duration::from_secs(20), "manager back");
    // The restarted manager still detects failures and the cluster recovers.
    cluster.kill_osd(0);
    cluster.wait_osd_down(0, Duration::from_secs(15));
    assert_progress(&cluster, &w, 100, Duration::from_secs(20), "osd.0 down");
    cluster.restart_osd(0);
    let (report, state) = w.stop();
    assert_report(&cluster, &report, &state);
    settle_and_compare(&cluster, "mgr", &state);
}
