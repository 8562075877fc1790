//! Failover numbers for docs/benchmarks.md (ignored in the normal suite; run with
//! `cargo build --release --workspace --bins && cargo test --release -p flame-tests
//! --test failover_bench -- --ignored --nocapture --test-threads 1`).
//!
//! * `failover_times`: three OSDs, 2 s grace, the verified workload; kill -9 of one
//!   OSD → time until the map shows it down, until client I/O resumed (the last
//!   completion of an operation that was stalled by the kill), the longest client
//!   operation and the longest gap between acknowledgements; then its restart →
//!   time until every group is clean again, the bytes recovery copied meanwhile
//!   (the OSDs' `flame_osd_recovery_bytes_total`) per second (catch-up from the
//!   log, or backfill where the log no longer reaches back) and the client's
//!   operations per second during it.
//! * `recovery_throughput`: four OSDs, a filled volume, the workload; one OSD is
//!   killed and marked out by hand → the bytes of object data the other three gain
//!   until the cluster is clean, per second (backfill throughput), and the client's
//!   operations per second before and during the recovery. Extra OSD YAML (a
//!   recovery throttle) comes from `FLAME_BENCH_OSD_YAML`, so throttled and
//!   unthrottled runs use the same binary.
//!
//! Every run prints one `BENCH` line per figure; the numbers are the mean over
//! `FLAME_BENCH_ROUNDS` rounds (default 3) with min and max.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::placement::mix64;
use flame_tests::failover::CLEAN_TIMEOUT;
use flame_tests::oracle::{OracleState, Workload, WorkloadConfig, create_filled};
use flame_tests::{ClusterOptions, TestCluster};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn rounds() -> usize {
    std::env::var("FLAME_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .clamp(1, 20)
}

fn osd_yaml() -> String {
    std::env::var("FLAME_BENCH_OSD_YAML").unwrap_or_default()
}

fn print_stat(name: &str, unit: &str, values: &[f64]) {
    if values.is_empty() {
        println!("BENCH | {name} | not reached in any round | | |");
        return;
    }
    let mean = values.iter().sum::<f64>() / values.len().max(1) as f64;
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    println!("BENCH | {name} | {mean:.2} {unit} | min {min:.2} | max {max:.2} |");
}

fn workload(cluster: &TestCluster, volume: &str, state: OracleState, secs: u64) -> Workload {
    Workload::start(
        &cluster.client_target(),
        volume,
        state,
        WorkloadConfig {
            writers: 8,
            max_duration: Duration::from_secs(secs),
            max_ops: u64::MAX,
            io_timeout_ms: 60_000,
            ..WorkloadConfig::default()
        },
    )
}

fn acks(w: &Workload) -> u64 {
    w.acks()
}

#[test]
#[ignore = "benchmark: run by hand, see the module docs"]
fn failover_times() {
    let (mut down, mut resume, mut op_max, mut gap_max, mut clean) =
        (vec![], vec![], vec![], vec![], vec![]);
    let (mut catchup_mibs, mut catchup_ops, mut catchup_mib) = (vec![], vec![], vec![]);
    for round in 0..rounds() {
        let mut cluster = TestCluster::start_with(ClusterOptions {
            osd_extra_yaml: osd_yaml(),
            ..ClusterOptions::failover(3)
        });
        let size = 64 * MIB;
        let vol = cluster.create_volume("bench", size);
        let w = workload(
            &cluster,
            "bench",
            OracleState::new(mix64(vol.id.0 ^ round as u64), size),
            60,
        );
        assert!(w.wait_more_acks(500, Duration::from_secs(30)));
        std::thread::sleep(Duration::from_secs(2));
        let victim = round % 3;
        let kill_us = w.now_us();
        let t_kill = Instant::now();
        cluster.kill_osd(victim);
        cluster.wait_osd_down(victim, Duration::from_secs(30));
        let down_us = t_kill.elapsed().as_micros() as u64;
        down.push(t_kill.elapsed().as_secs_f64());
        // Let every stalled operation finish.
        std::thread::sleep(Duration::from_secs(8));
        let live: Vec<usize> = (0..3).filter(|&i| i != victim).collect();
        let copied_before = recovery_bytes(&cluster, &live);
        let acks_before = acks(&w);
        cluster.restart_osd(victim);
        let t_restart = Instant::now();
        match cluster.try_wait_clean(CLEAN_TIMEOUT) {
            Ok(_) => {
                let took = t_restart.elapsed().as_secs_f64();
                clean.push(took);
                let copied =
                    recovery_bytes(&cluster, &[0, 1, 2]).saturating_sub(copied_before) as f64;
                catchup_mib.push(copied / MIB as f64);
                catchup_mibs.push(copied / MIB as f64 / took);
                catchup_ops.push((acks(&w) - acks_before) as f64 / took);
            }
            Err(e) => eprintln!("round {round}: not clean within {CLEAN_TIMEOUT:?}: {e}"),
        }
        let (report, _) = w.stop();
        assert!(report.clean(), "{report}\n{}", cluster.log_tails());
        let resumed_us = report
            .slow_ops
            .iter()
            // Stalled by the kill: in flight at it, or started before the map
            // marking the OSD down can have reached the client (+2 s); the restart
            // comes 8 s after that.
            .filter(|o| o.end_us >= kill_us && o.start_us <= kill_us + down_us + 2_000_000)
            .map(|o| o.end_us)
            .max()
            .unwrap_or(kill_us);
        resume.push((resumed_us - kill_us) as f64 / 1e6);
        if let Some(slowest) = report.slow_ops.iter().max_by_key(|o| o.end_us - o.start_us) {
            eprintln!(
                "round {round}: slowest operation: {} of {} ms, from {} ms after the kill",
                slowest.kind,
                (slowest.end_us - slowest.start_us) / 1000,
                (slowest.start_us as i64 - kill_us as i64) / 1000
            );
        }
        op_max.push(report.op_latency_max.as_secs_f64());
        gap_max.push(report.longest_pause.as_secs_f64());
        eprintln!("round {round}: {report}");
    }
    print_stat("kill -9 → marked down", "s", &down);
    print_stat("kill -9 → client I/O resumed", "s", &resume);
    print_stat("longest client operation", "s", &op_max);
    print_stat("longest gap between acknowledgements", "s", &gap_max);
    print_stat("restart → all groups clean", "s", &clean);
    print_stat("catch-up after restart: data copied", "MiB", &catchup_mib);
    print_stat("catch-up after restart: throughput", "MiB/s", &catchup_mibs);
    print_stat("client ops/s while catching up", "ops/s", &catchup_ops);
}

/// Bytes recovery copied so far, summed over OSD processes `osds` (their
/// `flame_osd_recovery_bytes_total`; a restarted OSD's counter starts again at 0).
fn recovery_bytes(cluster: &TestCluster, osds: &[usize]) -> u64 {
    osds.iter()
        .map(|&i| cluster.osd_metric(i, "flame_osd_recovery_bytes_total") as u64)
        .sum()
}

#[test]
#[ignore = "benchmark: run by hand, see the module docs"]
fn recovery_throughput() {
    let (mut mibs, mut iops_before, mut iops_during, mut secs) = (vec![], vec![], vec![], vec![]);
    for round in 0..rounds() {
        let mut cluster = TestCluster::start_with(ClusterOptions {
            osd_extra_yaml: osd_yaml(),
            ..ClusterOptions::failover(4)
        });
        let size = 256 * MIB;
        let (_, state) = create_filled(&cluster, "bench", size, round as u64, 60_000);
        let w = workload(&cluster, "bench", state, 120);
        assert!(w.wait_more_acks(200, Duration::from_secs(30)));
        let (a0, t0) = (acks(&w), Instant::now());
        std::thread::sleep(Duration::from_secs(5));
        iops_before.push((acks(&w) - a0) as f64 / t0.elapsed().as_secs_f64());

        let victim = 3;
        let id = cluster.osd_id(victim);
        let before = cluster.object_data_bytes_per_osd();
        cluster.kill_osd(victim);
        cluster.wait_osd_down(victim, Duration::from_secs(30));
        let (a1, t1) = (acks(&w), Instant::now());
        cluster.admin_ok(&["osd", "out", &id.to_string()]);
        cluster.wait_clean(Duration::from_secs(600));
        let took = t1.elapsed().as_secs_f64();
        iops_during.push((acks(&w) - a1) as f64 / took);
        let after = cluster.object_data_bytes_per_osd();
        let gained: u64 = (0..3).map(|i| after[i].saturating_sub(before[i])).sum();
        mibs.push(gained as f64 / MIB as f64 / took);
        secs.push(took);
        let (report, _) = w.stop();
        assert!(report.clean(), "{report}\n{}", cluster.log_tails());
        eprintln!(
            "round {round}: {:.1} MiB recovered in {took:.1} s; {report}",
            gained as f64 / MIB as f64
        );
    }
    print_stat("backfill after out: throughput", "MiB/s", &mibs);
    print_stat("backfill after out: time to clean", "s", &secs);
    print_stat("client ops/s before the failure", "ops/s", &iops_before);
    print_stat("client ops/s while recovering", "ops/s", &iops_during);
}
