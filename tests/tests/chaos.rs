//! The chaos test: random OSD kill -9 / restart / out / in / network partition on a
//! four-OSD cluster while the verified workload (the write oracle) runs, never more
//! than one failure at a time (pool size 3, min_size 2: one copy may be missing),
//! then a full verification and a comparison of the copies.
//!
//! A partition cuts one OSD off from everything with iptables rules on `lo` (root
//! needed; the cluster has its own loopback subnet, see `flame_tests::net`, so the
//! rules touch no other test run) and heals them at the next step; the rules are
//! removed also when the test fails. `FLAME_CHAOS_PARTITIONS=0` leaves partitions
//! out (a machine without root or iptables).
//!
//! `cargo test --test chaos` runs it for `FLAME_CHAOS_SECONDS` (default 60) with
//! seed `FLAME_CHAOS_SEED` (default: from the clock); scripts/chaos.sh wraps it
//! with `--minutes N --seed S`. A failing run prints its seed so it can be replayed
//! (the sequence of actions and the workload's choices depend only on the seed;
//! the timing of the daemons does not).

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::placement::mix64;
use flame_tests::failover::{CLEAN_TIMEOUT, assert_copies_identical};
use flame_tests::net::Partition;
use flame_tests::oracle::{OracleState, Workload, WorkloadConfig, verify_volume};
use flame_tests::{ClusterOptions, TestCluster};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const OBJECT: u64 = 4 * MIB;
const OSDS: usize = 4;
/// Longest accepted run (a week), so a typo cannot start an endless test.
const SECONDS_MAX: u64 = 7 * 24 * 3600;

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(
        v.trim()
            .parse()
            .unwrap_or_else(|e| panic!("{name}={v:?}: not a number: {e}")),
    )
}

/// Prints the seed when the test fails, wherever it fails.
struct SeedGuard {
    seed: u64,
    seconds: u64,
    partitions: bool,
}

impl Drop for SeedGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "CHAOS FAILED: seed {} (replay: scripts/chaos.sh --seconds {} --seed {}{})",
                self.seed,
                self.seconds,
                self.seed,
                if self.partitions {
                    ""
                } else {
                    " --no-partitions"
                }
            );
        }
    }
}

/// The failure in force: at most one at a time.
#[derive(Debug)]
enum Failure {
    Killed(usize),
    Out(usize),
    /// Cut off by iptables rules, removed when the partition is dropped.
    Partitioned(usize, Partition),
}

#[test]
fn chaos() {
    let seconds = env_u64("FLAME_CHAOS_SECONDS").unwrap_or(60);
    assert!(
        seconds > 0 && seconds <= SECONDS_MAX,
        "FLAME_CHAOS_SECONDS={seconds}"
    );
    let seed = env_u64("FLAME_CHAOS_SEED").unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
            % 1_000_000
    });
    let partitions_on = env_u64("FLAME_CHAOS_PARTITIONS").is_none_or(|v| v != 0);
    let _guard = SeedGuard {
        seed,
        seconds,
        partitions: partitions_on,
    };
    eprintln!("chaos: {seconds} s, seed {seed}, partitions {partitions_on}");

    let mut cluster = TestCluster::start_with(ClusterOptions::failover(OSDS));
    let size = 32 * MIB;
    let vol = cluster.create_volume("chaos", size);
    let mgr = cluster.client_target();
    let cfg = WorkloadConfig {
        writers: 4,
        max_duration: Duration::from_secs(seconds + 120),
        max_ops: u64::MAX,
        seed,
        io_timeout_ms: 60_000,
        ..WorkloadConfig::default()
    };
    let w = Workload::start(
        &mgr,
        "chaos",
        OracleState::new(mix64(vol.id.0 ^ seed), size),
        cfg,
    );
    let mut rng = seed;
    let mut next = move |n: u64| {
        rng = mix64(rng.wrapping_add(0x9e37_79b9_7f4a_7c15));
        rng % n.max(1)
    };
    let (mut kills, mut outs, mut partitions) = (0u64, 0u64, 0u64);
    let mut failure: Option<Failure> = None;
    let t0 = Instant::now();
    let mut oracle_failed = false;
    while t0.elapsed() < Duration::from_secs(seconds) {
        std::thread::sleep(Duration::from_millis(1000 + next(3000)));
        if w.progress().errors.load(Ordering::Relaxed) != 0 {
            oracle_failed = true;
            break;
        }
        match failure.take() {
            None => {
                // A new failure only on a clean cluster: every group has all its
                // copies again, so this one leaves at least min_size of each.
                cluster.wait_clean(CLEAN_TIMEOUT);
                let victim = next(OSDS as u64) as usize;
                // The draw is made whether partitions are on or not, so a seed
                // replays the same kills and outs either way.
                let roll = next(10);
                if roll < 4 || roll >= 7 && !partitions_on {
                    eprintln!("chaos {:?}: kill -9 osd.{victim}", t0.elapsed());
                    cluster.kill_osd(victim);
                    kills += 1;
                    failure = Some(Failure::Killed(victim));
                } else if roll < 7 {
                    let id = cluster.osd_id(victim);
                    eprintln!("chaos {:?}: out osd.{victim} ({id})", t0.elapsed());
                    cluster.admin_ok(&["osd", "out", &id.to_string()]);
                    outs += 1;
                    failure = Some(Failure::Out(victim));
                } else {
                    let p = cluster.isolate_osd(victim);
                    eprintln!(
                        "chaos {:?}: partition osd.{victim} ({}; rules {:?})",
                        t0.elapsed(),
                        cluster.osd_ip(victim),
                        p.comment()
                    );
                    partitions += 1;
                    failure = Some(Failure::Partitioned(victim, p));
                }
            }
            Some(failure) => heal(&mut cluster, failure, &t0),
        }
    }
    if oracle_failed {
        eprintln!("chaos {:?}: the oracle failed; stopping", t0.elapsed());
        let (report, state) = w.stop();
        panic!(
            "oracle errors during chaos (seed {seed}): {report}\n{}{}",
            diagnosis(&cluster, vol.id, &state, &report.error_samples),
            cluster.log_tails()
        );
    }
    if let Some(failure) = failure {
        heal(&mut cluster, failure, &t0);
    }
    assert!(
        w.wait_more_acks(50, Duration::from_secs(30)),
        "no progress after the last repair\n{}",
        cluster.log_tails()
    );
    let (report, state) = w.stop();
    eprintln!("chaos oracle: {report}");
    assert!(
        report.clean(),
        "{report}\n{}{}",
        diagnosis(&cluster, vol.id, &state, &report.error_samples),
        cluster.log_tails()
    );
    assert_eq!(report.blocks_verified, state.block_count(), "{report}");
    cluster.wait_clean(CLEAN_TIMEOUT);
    let again = verify_volume(&mgr, "chaos", &state, 60_000);
    assert!(
        again.clean() && again.blocks_verified == state.block_count(),
        "{again}\n{}",
        diagnosis(&cluster, vol.id, &state, &again.error_samples)
    );
    let copies = cluster.compare_copies(vol.id, size.div_ceil(OBJECT));
    assert_copies_identical(&cluster, &copies);
    cluster.assert_all_running();
    println!(
        "CHAOS OK: seed {seed}, {:.1} minutes, {kills} kills, {outs} outs, {partitions} \
         partitions, writes acked {}, \
         reads verified {}, blocks verified {}, longest pause between acks {} ms, \
         slowest op {} ms, copies identical ({})",
        t0.elapsed().as_secs_f64() / 60.0,
        report.writes_acked,
        report.reads_verified,
        report.blocks_verified + again.blocks_verified,
        report.longest_pause.as_millis(),
        report.op_latency_max.as_millis(),
        copies
    );
}

/// Blocks a failure report looks at most.
const DIAGNOSED_BLOCKS_MAX: usize = 4;

/// For the first blocks the oracle's errors name ("block N: ..."): the oracle's
/// history of each and what every OSD's copy holds now — so that a failure that
/// does not replay still says which copy was old and what role it had.
fn diagnosis(
    cluster: &TestCluster,
    volume: flame_common::ids::VolumeId,
    state: &OracleState,
    samples: &[String],
) -> String {
    let mut blocks: Vec<u64> = Vec::new();
    for s in samples {
        for part in s.split("block ").skip(1) {
            let digits: String = part.chars().take_while(char::is_ascii_digit).collect();
            if part[digits.len()..].starts_with(':')
                && let Ok(b) = digits.parse::<u64>()
                && !blocks.contains(&b)
                && blocks.len() < DIAGNOSED_BLOCKS_MAX
            {
                blocks.push(b);
            }
        }
    }
    let mut out = String::from("---- diagnosis (oracle history; every OSD's copy now) ----\n");
    for b in blocks {
        out += &state.history(b);
        out.push('\n');
        out += &cluster.block_copies(volume, state.magic, b);
    }
    out
}

/// Ends `failure`: restarts a killed OSD, takes an out one back in, heals a
/// partition.
fn heal(cluster: &mut TestCluster, failure: Failure, t0: &Instant) {
    match failure {
        Failure::Killed(i) => {
            eprintln!("chaos {:?}: restart osd.{i}", t0.elapsed());
            cluster.restart_osd(i);
        }
        Failure::Out(i) => {
            let id = cluster.osd_id(i);
            eprintln!("chaos {:?}: in osd.{i} ({id})", t0.elapsed());
            cluster.admin_ok(&["osd", "in", &id.to_string()]);
        }
        Failure::Partitioned(i, p) => {
            let id = cluster.osd_id(i);
            let was_down = !cluster.map().osds.get(&id).is_some_and(|o| o.up);
            eprintln!(
                "chaos {:?}: heal the partition of osd.{i} ({id}; {})",
                t0.elapsed(),
                if was_down {
                    "it was marked down"
                } else {
                    "healed before the grace"
                }
            );
            p.heal();
        }
    }
}
