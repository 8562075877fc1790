//! The `staged` threading mode (network threads hand requests to the shard
//! threads through bounded queues, replies come back the same way) serves a real
//! cluster correctly: writes of several sizes, concurrent writes to one object and
//! to many, read back through flame-nbd, replicated to all three OSDs; and the
//! network threads really carry the connections (their run-loop counters move).
//! Kept in CI so the mode the benchmark compares against does not rot.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_tests::{ClusterOptions, TestCluster, http_get};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn sample(text: &str, metric: &str, labels: &str) -> Option<f64> {
    text.lines()
        .find(|l| l.starts_with(metric) && l.contains(labels))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn staged_cluster_reads_back_what_it_wrote() {
    let mut opts = ClusterOptions::with_nbd();
    opts.osd_extra_yaml = "threading: staged\nnetwork_threads: 1\n".into();
    let cluster = TestCluster::start_with(opts);
    let vol = cluster.create_volume("st", 64 * MIB);
    cluster.wait_nbd_export("st");

    // Sizes from one block to a whole object, at unaligned-to-object offsets;
    // then overlapping writes in flight together (aio): the last one issued per
    // range must win, which needs per-object order through the queues.
    cluster.qemu_io(
        "st",
        &[
            "write -P 0x11 0 4k",
            "write -P 0x22 64k 60k",
            "write -P 0x33 3m 2m",
            "write -P 0x44 8m 4m",
        ],
    );
    let mut cmds: Vec<String> = Vec::new();
    for i in 0..32u64 {
        cmds.push(format!(
            "aio_write -P 0x{:02x} {} 4k",
            0x50 + i,
            20 * MIB + i * 4096
        ));
    }
    cmds.push("aio_flush".into());
    let cmds: Vec<&str> = cmds.iter().map(String::as_str).collect();
    cluster.qemu_io("st", &cmds);
    // Ordered writes to one block in one connection: the final content is the last.
    cluster.qemu_io(
        "st",
        &[
            "write -P 0x61 30m 4k",
            "write -P 0x62 30m 4k",
            "write -P 0x63 30m 4k",
        ],
    );
    let mut reads = vec![
        "read -P 0x11 0 4k".to_string(),
        "read -P 0x22 64k 60k".into(),
        "read -P 0x33 3m 2m".into(),
        "read -P 0x44 8m 4m".into(),
        "read -P 0x63 30m 4k".into(),
        "read -P 0x00 40m 1m".into(),
    ];
    for i in 0..32u64 {
        reads.push(format!(
            "read -P 0x{:02x} {} 4k",
            0x50 + i,
            20 * MIB + i * 4096
        ));
    }
    let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
    cluster.qemu_io("st", &reads);

    // Replicated: object 2 (8 MiB..12 MiB) holds 0x44 on every OSD.
    for osd in 0..cluster.osd_count() {
        let data = cluster
            .object_data(osd, vol.id, 2)
            .unwrap_or_else(|| panic!("osd.{osd} lacks object 2\n{}", cluster.log_tails()));
        assert!(
            data.len() >= 4 * MIB as usize,
            "osd.{osd}: {} bytes",
            data.len()
        );
        assert!(
            data[..4 * MIB as usize].iter().all(|&b| b == 0x44),
            "osd.{osd}: object 2 is not all 0x44"
        );
    }

    // The network threads carried the traffic: their run loop polled, and the
    // OSD says it runs staged.
    // (Counters are published once a second: allow a few.)
    for osd in 0..cluster.osd_count() {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let (code, text) = http_get(cluster.osd_metrics_addr(osd), "/metrics").unwrap();
            assert_eq!(code, 200);
            let polls = sample(
                &text,
                "flame_osd_reactor_events_total",
                "event=\"polls\",shard=\"net0\"",
            )
            .unwrap_or(0.0);
            if polls > 0.0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "osd.{osd}: network thread did not poll:\n{text}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}
