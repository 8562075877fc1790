//! The write oracle against a healthy cluster: the verified workload runs without a
//! single error, every block checks at the end, and the oracle does catch a lost
//! acknowledged write and a block newer than any issued write when they happen
//! (simulated by editing its memory, since a healthy cluster produces neither).

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::placement::mix64;
use flame_tests::oracle::{OracleState, Workload, WorkloadConfig, verify_volume};
use flame_tests::{ClusterOptions, TestCluster};
use std::time::Duration;

const MIB: u64 = 1 << 20;

#[test]
fn verified_workload_on_a_healthy_cluster() {
    let cluster = TestCluster::start_with(ClusterOptions::failover(3));
    let size = 16 * MIB;
    let vol = cluster.create_volume("oracle", size);
    let mgr = cluster.client_target();
    let state = OracleState::new(mix64(vol.id.0 ^ 0x0a1e), size);
    let cfg = WorkloadConfig {
        max_duration: Duration::from_secs(6),
        max_ops: 20_000,
        ..WorkloadConfig::default()
    };
    let w = Workload::start(&mgr, "oracle", state, cfg);
    assert!(
        w.wait_more_acks(100, Duration::from_secs(20)),
        "no progress\n{}",
        cluster.log_tails()
    );
    // Let it run out its time bound (bounded wait).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !w.finished() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let (report, state) = w.stop();
    eprintln!("oracle: {report}");
    assert!(report.clean(), "{report}\n{}", cluster.log_tails());
    assert!(
        report.writes_acked > 50 && report.reads_verified > 10,
        "{report}"
    );
    assert_eq!(report.blocks_verified, state.block_count(), "{report}");
    assert!(state.written_blocks() > 0);

    // A second pass through a new client sees the same.
    let again = verify_volume(&mgr, "oracle", &state, 30_000);
    assert!(
        again.clean() && again.blocks_verified == state.block_count(),
        "{again}"
    );

    // The oracle catches a lost acknowledged write: pretend one more write of a
    // written block was acknowledged.
    let i = state.blocks.iter().position(|b| b.acked > 0).unwrap();
    let mut lost = state.clone();
    let (_, counters) = lost.issue_write(i as u64..i as u64 + 1);
    lost.ack_write(i as u64, &counters);
    let r = verify_volume(&mgr, "oracle", &lost, 30_000);
    assert_eq!(r.errors, 1, "{r}");
    assert!(r.error_samples[0].contains("stale"), "{r}");

    // ... and data newer than anything issued.
    let mut rewound = state.clone();
    rewound.blocks[i].issued -= 1;
    rewound.blocks[i].acked = rewound.blocks[i].acked.min(rewound.blocks[i].issued);
    let r = verify_volume(&mgr, "oracle", &rewound, 30_000);
    assert_eq!(r.errors, 1, "{r}");
    assert!(r.error_samples[0].contains("too new"), "{r}");
}
