//! Dropping the last `Cluster` handle stops its background threads (alone in its own
//! test binary, so no other test's clusters are counted).

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

mod fake_cluster;

use fake_cluster::{FakeCluster, small_pool};
use flame_client::{ClientConfig, Cluster};
use std::time::{Duration, Instant};

/// Threads whose name starts with `flame-map-` (the watcher and the refresher;
/// short-lived helper threads they spawn inherit the name on Linux).
fn map_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with("flame-map-"))
        .count()
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(5), "{what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn dropping_the_cluster_stops_its_threads() {
    let fake = FakeCluster::start(1, 1, small_pool(1), 1 << 20);
    let cluster = Cluster::connect(ClientConfig::new(fake.mgr_addr.to_string())).unwrap();
    let clone = cluster.clone();
    // Thread names are set by the threads themselves, just after they start.
    wait_until("map threads did not start", || map_threads() >= 2);
    drop(cluster);
    std::thread::sleep(Duration::from_millis(100));
    assert!(map_threads() >= 2, "a clone still holds the cluster");
    drop(clone);
    wait_until("map threads still running", || map_threads() == 0);
}
