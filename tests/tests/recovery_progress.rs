//! Recovery progress as `flame-admin status` reports it, with the real daemons:
//! one OSD of three is killed with kill -9, writes go on without it, it restarts,
//! and the manager's status (`GET /v1/status`, what `flame-admin status` and
//! `status --json` show) is sampled all through its recovery. The byte throttle
//! (`recovery_bytes_per_sec`) makes a few seconds of writes last long enough to
//! be sampled many times.
//!
//! While any group is recovering the status must say how much is left (objects
//! to recover > 0) or that it does not know (groups not estimated); it must never
//! read idle, done or 100 %. Each recovery counts its recovered objects from 0,
//! and a clean cluster has nothing to recover.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::mgr_api::{ClusterStatus, RecoveryPhase};
use flame_tests::{ClusterOptions, TestCluster};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn options() -> ClusterOptions {
    ClusterOptions {
        osds: 3,
        shards: 1,
        pg_count: 16,
        heartbeat_grace_ms: 2000,
        osd_heartbeat_interval_ms: 200,
        osd_extra_yaml: "scrub_interval_s: 0\nrecovery_bytes_per_sec: 1048576\n".into(),
        ..ClusterOptions::default()
    }
}

/// Random 4 KiB writes over the volume's first 16 MiB for `runtime`, through
/// `flame-admin bench`.
fn start_writes(cluster: &TestCluster, volume: &str, runtime: &str, seed: u64) -> Child {
    cluster
        .admin_command()
        .args(["--mgr", &cluster.mgr_addr().to_string(), "bench", volume])
        .args(["--rw", "randwrite", "--bs", "4k", "--iodepth", "4"])
        .args(["--runtime", runtime, "--force-overwrite"])
        .args(["--size-limit", "16M", "--seed", &seed.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot start flame-admin bench")
}

fn finish_writes(cluster: &TestCluster, child: Child) {
    let out = child.wait_with_output().expect("bench output");
    assert!(
        out.status.success(),
        "the writes failed:\n{}\n{}",
        flame_tests::output_text(&out),
        cluster.log_tails()
    );
}

/// Sum over the OSDs `which` of `flame_osd_recovery_objects_total` (every kind).
fn recovered_metric(cluster: &TestCluster, which: &[usize]) -> u64 {
    metric_sum(cluster, which, "flame_osd_recovery_objects_total")
}

/// Sum over the OSDs `which` of every series of the metric `name`.
fn metric_sum(cluster: &TestCluster, which: &[usize], name: &str) -> u64 {
    which
        .iter()
        .filter_map(|&i| flame_tests::try_metric_sum(cluster.osd_metrics_addr(i), name, ""))
        .sum()
}

/// Whether the status shows a recovery: a group recovering in the map, or the
/// manager saying one is under way.
fn recovering(s: &ClusterStatus) -> bool {
    s.pg_summary.recovering > 0 || s.recovery.recovering
}

/// Samples the status every 50 ms in the background until stopped.
struct Sampler {
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<ClusterStatus>>>,
    thread: std::thread::JoinHandle<()>,
}

impl Sampler {
    fn start(cluster: &TestCluster) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let mgr = cluster.mgr_endpoint(cluster.keys().map(|k| k.creds("client.admin", 1)));
        let (s, out) = (stop.clone(), samples.clone());
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                if let Ok((200, body)) = flame_tests::mgr_call_as(&mgr, "GET", "/v1/status", None)
                    && let Ok(st) = serde_json::from_str::<ClusterStatus>(&body)
                {
                    out.lock().unwrap().push(st);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        });
        Sampler {
            stop,
            samples,
            thread,
        }
    }

    fn finish(self) -> Vec<ClusterStatus> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("sampler");
        std::mem::take(&mut *self.samples.lock().unwrap())
    }
}

fn describe(s: &ClusterStatus) -> String {
    let r = &s.recovery;
    format!(
        "epoch {}: pgs {:?}; recovering {}, to recover {}, unestimated {}, recovered {}, \
         copies recovering {}, eta {:?} (estimating {}), phase {:?}",
        s.epoch.0,
        s.pgs_by_state,
        r.recovering,
        r.objects_to_recover,
        r.pgs_unestimated,
        r.objects_recovered,
        r.recovering_copies,
        r.eta_seconds,
        r.eta_estimating,
        r.phase()
    )
}

/// Waits (bounded) until the status shows no recovery at all and returns it.
fn wait_idle(cluster: &TestCluster) -> ClusterStatus {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let s = cluster.status();
        if !recovering(&s) && s.pg_summary.clean == s.pg_summary.total {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "no idle status in 60 s: {}\n{}",
            describe(&s),
            cluster.log_tails()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One recovery: OSD 2 killed, writes for `runtime` without it, restarted while
/// the status is sampled until the cluster is clean and idle. Returns the samples
/// taken while a recovery showed, and the idle status at the end.
fn one_recovery(
    cluster: &mut TestCluster,
    volume: &str,
    seed: u64,
) -> (Vec<ClusterStatus>, ClusterStatus) {
    cluster.kill_osd(2);
    cluster.wait_osd_down(2, Duration::from_secs(20));
    let writes = start_writes(cluster, volume, "2s", seed);
    finish_writes(cluster, writes);
    let sampler = Sampler::start(cluster);
    cluster.restart_osd(2);
    cluster.wait_clean(Duration::from_secs(90));
    let idle = wait_idle(cluster);
    let samples = sampler.finish();
    (samples.into_iter().filter(recovering).collect(), idle)
}

/// The properties every sample taken during a recovery must have.
fn check_recovering_samples(cluster: &TestCluster, what: &str, samples: &[ClusterStatus]) {
    assert!(
        samples.len() >= 5,
        "{what}: only {} samples showed the recovery; it must last longer to be \
         checked\n{}",
        samples.len(),
        cluster.log_tails()
    );
    let mut counted = 0;
    // "Finishing" (everything copied, groups still recovering in the map) is
    // true only at the very end, while the last groups are flushed and reported:
    // objects seen left after it mean it was a 0 that was not "nothing left".
    let mut finishing: Option<&ClusterStatus> = None;
    for s in samples {
        if let Some(f) = finishing {
            assert!(
                s.recovery.objects_to_recover == 0 && s.recovery.pgs_unestimated == 0,
                "{what}: work left after a status that said everything was copied:\n{}\n{}",
                describe(f),
                describe(s)
            );
        }
        if s.recovery.phase() == RecoveryPhase::Finishing {
            finishing.get_or_insert(s);
        }
        let r = &s.recovery;
        let d = describe(s);
        assert!(r.recovering, "{what}: groups recovering, summary not: {d}");
        assert!(
            r.objects_to_recover > 0
                || r.pgs_unestimated > 0
                || r.phase() == RecoveryPhase::Finishing,
            "{what}: groups recovering with 0 objects to recover and nothing unknown: {d}"
        );
        assert!(
            !matches!(r.phase(), RecoveryPhase::Idle { .. }),
            "{what}: idle while recovering: {d}"
        );
        assert!(
            r.progress().is_none_or(|f| f < 1.0),
            "{what}: 100 % while recovering: {d}"
        );
        if r.objects_to_recover > 0 {
            counted += 1;
            assert!(
                r.eta_seconds.is_some() || r.eta_estimating || r.objects_per_second == 0.0,
                "{what}: objects left and a rate, but no ETA: {d}"
            );
        }
    }
    println!(
        "{what}: {} samples while recovering, {counted} with objects to recover > 0",
        samples.len()
    );
    // The objects left were actually counted during the recovery, not only
    // "unknown" throughout.
    assert!(
        counted >= 2,
        "{what}: objects to recover was > 0 in only {counted} of {} samples:\n{}",
        samples.len(),
        samples.iter().map(describe).collect::<Vec<_>>().join("\n")
    );
}

/// Comparisons of complete members' restart doubt that osd.0 and osd.1 (never
/// restarted) started.
fn doubt_comparisons(cluster: &TestCluster) -> u64 {
    metric_sum(
        cluster,
        &[0, 1],
        "flame_osd_recovery_doubt_comparisons_total",
    )
}

/// The restarted OSD was recovering in every group it holds, and a member's
/// recovery compares what its restart left in doubt first: no primary starts
/// comparing that doubt again once the member is complete. (One did, in a CI
/// run at 33da461: a job after the groups were clean, which the status showed
/// as an object to recover after "Finishing".)
fn no_doubt_compared_after_recovery(cluster: &TestCluster, before: u64) {
    assert_eq!(
        doubt_comparisons(cluster),
        before,
        "a primary compared a recovered member's restart doubt again\n{}",
        cluster.log_tails()
    );
}

#[test]
fn status_reports_recovery_progress_consistently_and_per_recovery() {
    let mut cluster = TestCluster::start_with(options());
    cluster.create_volume("progress", 16 * MIB);
    let writes = start_writes(&cluster, "progress", "1s", 1);
    finish_writes(&cluster, writes);
    let clean = wait_idle(&cluster);
    assert_eq!(clean.recovery.objects_to_recover, 0, "{}", describe(&clean));

    // First recovery.
    let doubts = doubt_comparisons(&cluster);
    let (samples, idle) = one_recovery(&mut cluster, "progress", 2);
    check_recovering_samples(&cluster, "first recovery", &samples);
    no_doubt_compared_after_recovery(&cluster, doubts);
    let first = idle.recovery.objects_recovered;
    assert!(
        first > 0,
        "first recovery recovered nothing: {}",
        describe(&idle)
    );
    assert_eq!(idle.recovery.objects_to_recover, 0, "{}", describe(&idle));
    assert_eq!(idle.recovery.pgs_unestimated, 0, "{}", describe(&idle));
    assert_eq!(
        idle.recovery.phase(),
        RecoveryPhase::Idle {
            last_recovered: first
        }
    );
    // Piped, the watch says idle once clean (and only then: see below).
    let watch = cluster.admin_ok(&["status", "--watch", "--count", "1"]);
    assert!(watch.contains("recovery idle"), "{watch}");

    // Second recovery: counts from 0, exactly what the OSDs recovered in it.
    let before = recovered_metric(&cluster, &[0, 1]);
    let doubts = doubt_comparisons(&cluster);
    let (samples, _) = one_recovery(&mut cluster, "progress", 3);
    check_recovering_samples(&cluster, "second recovery", &samples);
    no_doubt_compared_after_recovery(&cluster, doubts);
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // osd.2 restarted: its counter counts only this recovery.
        let done = recovered_metric(&cluster, &[0, 1, 2]).saturating_sub(before);
        let s = cluster.status();
        if s.recovery.objects_recovered == done && done > 0 {
            assert_eq!(s.recovery.objects_to_recover, 0, "{}", describe(&s));
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the second recovery's count is {} (first {first}); the OSDs recovered {done} \
             in it: {}",
            s.recovery.objects_recovered,
            describe(&s)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}
