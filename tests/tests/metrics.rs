//! Every daemon serves Prometheus text on its metrics address, with the metrics the
//! issue names; values follow what the cluster did.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_tests::{ClusterOptions, TestCluster, http_get};
use std::net::SocketAddr;

fn scrape(addr: SocketAddr, who: &str) -> String {
    let (code, body) =
        http_get(addr, "/metrics").unwrap_or_else(|e| panic!("{who} metrics at {addr}: {e}"));
    assert_eq!(code, 200, "{who} metrics at {addr}: HTTP {code}\n{body}");
    body
}

/// Sum of every sample of `name` (all label sets) in Prometheus text, or None if
/// the metric has no samples.
fn sum_samples(text: &str, name: &str) -> Option<f64> {
    let mut found = false;
    let mut sum = 0.0;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue; // another metric with this prefix (name_bucket, ...)
        }
        let value = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = value {
            found = true;
            sum += v;
        }
    }
    found.then_some(sum)
}

/// Sum of the samples of `name` whose label set contains `label` (e.g.
/// `op="write"`), or None if there is none.
fn sum_with(text: &str, name: &str, label: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let Some(labels_end) = rest.strip_prefix('{').and_then(|r| r.find('}')) else {
            continue;
        };
        if !rest[..labels_end + 1].contains(label) {
            continue;
        }
        if let Some(v) = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

#[test]
fn every_daemon_serves_its_metrics() {
    let cluster = TestCluster::start_with(ClusterOptions::with_nbd());
    cluster.create_volume("m", 16 << 20);
    cluster.create_volume("m2", 1 << 30);
    cluster.wait_nbd_export("m");
    // Some I/O, so per-op counters have samples.
    cluster.qemu_io(
        "m",
        &[
            "write -P 0x1 0 1M",
            "read -P 0x1 0 1M",
            "write -P 0x2 4194304 65536",
            "flush",
        ],
    );
    let status = cluster.status();

    // Manager: on its API address.
    let mgr = scrape(cluster.mgr_addr(), "mgr");
    for name in ["flame_mgr_map_epoch", "flame_mgr_osds", "flame_mgr_volumes"] {
        assert!(mgr.contains(name), "mgr metrics lack {name}:\n{mgr}");
    }
    assert_eq!(
        sum_samples(&mgr, "flame_mgr_map_epoch"),
        Some(status.epoch.0 as f64),
        "map epoch metric must equal the status epoch"
    );
    assert_eq!(sum_samples(&mgr, "flame_mgr_volumes"), Some(2.0));
    assert_eq!(
        sum_with(&mgr, "flame_mgr_osds", "state=\"up\""),
        Some(3.0),
        "flame_mgr_osds{{state=\"up\"}} must be 3:\n{mgr}"
    );

    // OSDs: every one served writes (3 replicas of everything on 3 OSDs).
    for i in 0..cluster.osd_count() {
        let text = scrape(cluster.osd_metrics_addr(i), &format!("osd.{i}"));
        assert!(
            text.contains("flame_osd_ops_total"),
            "osd.{i} lacks flame_osd_ops_total:\n{text}"
        );
        let writes = sum_with(&text, "flame_osd_ops_total", "op=\"write\"").unwrap_or(0.0);
        assert!(writes > 0.0, "osd.{i}: no writes counted:\n{text}");
        // Per-shard-thread idle-loop counters (interrupt mode: the shards sleep).
        for name in [
            "flame_osd_reactor_events_total",
            "flame_osd_op_latency_seconds_bucket",
            "flame_osd_connections",
        ] {
            assert!(text.contains(name), "osd.{i} lacks {name}:\n{text}");
        }
        check_memory_pool(&text, &format!("osd.{i}"), "shard-");
        // Disk I/O from pool buffers used io_uring fixed buffers (the shards
        // publish that count once a second).
        if flame_tests::test_memory_pool_mode() != "heap" {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                let text = scrape(cluster.osd_metrics_addr(i), &format!("osd.{i}"));
                let n = sum_samples(&text, "flame_osd_fixed_io_total").unwrap_or(0.0);
                if n > 0.0 {
                    break;
                }
                assert!(
                    std::time::Instant::now() < deadline,
                    "osd.{i}: no fixed-buffer disk I/O:\n{text}"
                );
                std::thread::sleep(std::time::Duration::from_millis(200));
            }
        }
    }

    // flame-nbd.
    let nbd = scrape(cluster.nbd_metrics_addr(), "nbd");
    assert!(nbd.contains("flame_nbd_ops_total"), "{nbd}");
    let reads = sum_with(&nbd, "flame_nbd_ops_total", "op=\"read\"").unwrap_or(0.0);
    let writes = sum_with(&nbd, "flame_nbd_ops_total", "op=\"write\"").unwrap_or(0.0);
    assert!(reads > 0.0 && writes > 0.0, "nbd op counters:\n{nbd}");

    check_memory_pool(&nbd, "nbd", "nbd-");

    // Only /metrics is served on the metrics ports.
    let (code, _) = http_get(cluster.osd_metrics_addr(0), "/nope").unwrap();
    assert_eq!(code, 404);
}

/// The registered memory pool served the daemon's payloads (the mode the test
/// run uses, `FLAME_TEST_MEMORY_POOL`).
fn check_memory_pool(text: &str, who: &str, thread_prefix: &str) {
    let mode = flame_tests::test_memory_pool_mode();
    if mode == "heap" {
        assert_eq!(sum_samples(text, "flame_pool_hits_total"), None, "{who}");
        return;
    }
    let hits = sum_with(text, "flame_pool_hits_total", &format!("mode=\"{mode}\""));
    assert!(hits.unwrap_or(0.0) > 0.0, "{who}: no pool hits:\n{text}");
    assert!(text.contains("flame_pool_bytes_in_use{"), "{who}");
    assert!(text.contains("flame_pool_remote_frees_total"), "{who}");
    let capacity = sum_samples(text, "flame_pool_capacity_bytes").unwrap_or(0.0);
    // Two threads of 32 MiB each: one pool each, or one shared pool of both.
    assert_eq!(capacity, f64::from(64u32 << 20), "{who}:\n{text}");
    if mode == "percpu" {
        let label = format!("thread=\"{thread_prefix}0\"");
        assert!(
            sum_with(text, "flame_pool_capacity_bytes", &label).is_some(),
            "{who}: no pool of thread {thread_prefix}0:\n{text}"
        );
    }
}

#[test]
fn metric_parsing_helpers() {
    let text = "# HELP x\nx_total{op=\"read\",s=\"0\"} 3\nx_total{op=\"write\",s=\"0\"} 4\n\
                x_total{op=\"write\",s=\"1\"} 5\nx_total{op=\"write_zeroes\"} 6\nx_total_other 9\nx 1\n";
    assert_eq!(sum_samples(text, "x_total"), Some(18.0));
    assert_eq!(sum_samples(text, "x"), Some(1.0));
    assert_eq!(sum_samples(text, "y"), None);
    assert_eq!(sum_with(text, "x_total", "op=\"write\""), Some(9.0));
    assert_eq!(sum_with(text, "x_total", "op=\"flush\""), None);
}
