//! The shared-memory transport end to end: a cluster whose OSDs and flame-nbd use
//! `transport: shm` serves writes and reads through qemu-io, its connections really
//! are shared memory (the processes map `memfd:flame-shm` segments), and an OSD
//! killed with SIGKILL in the middle of I/O leaves the others serving (the peers
//! see its Unix sockets close) without a hang.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_tests::{ClusterOptions, TestCluster};

const MIB: u64 = 1 << 20;

/// How many `memfd:flame-shm` segments process `pid` maps.
fn shm_segments(pid: u32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map(|m| m.lines().filter(|l| l.contains("memfd:flame-shm")).count())
        .unwrap_or(0)
}

#[test]
fn cluster_over_shm_serves_io_and_survives_an_osd_kill() {
    let mut cluster = TestCluster::start_with(ClusterOptions {
        transport: "shm".into(),
        ..ClusterOptions::with_nbd()
    });
    cluster.create_volume("shm", 64 * MIB);
    cluster.wait_nbd_export("shm");

    // Small and large writes (inline messages up to the 4 MiB object), then read
    // back with pattern checks.
    cluster.qemu_io(
        "shm",
        &[
            "write -P 0x11 0 4k",
            "write -P 0x22 4096 60k",
            "write -P 0x33 1M 1M",
            "write -P 0x44 8M 4M",
        ],
    );
    cluster.qemu_io(
        "shm",
        &[
            "read -P 0x11 0 4k",
            "read -P 0x22 4096 60k",
            "read -P 0x33 1M 1M",
            "read -P 0x44 8M 4M",
        ],
    );

    // Both sides of the client <-> OSD and OSD <-> OSD links are shared memory.
    let nbd = cluster.nbd_pid().expect("flame-nbd runs");
    assert!(
        shm_segments(nbd) > 0,
        "flame-nbd maps no shm segment: tcp was used"
    );
    for i in 0..cluster.osd_count() {
        let pid = cluster.osd_pid(i).expect("osd runs");
        assert!(
            shm_segments(pid) > 0,
            "osd.{i} maps no shm segment\n{}",
            cluster.log_tails()
        );
    }

    // Kill one OSD mid-flight: writes and reads go on through the other two.
    let writer = {
        let uri = cluster.nbd_uri("shm");
        std::thread::spawn(move || {
            let out = std::process::Command::new("qemu-io")
                .args(["-f", "raw", &uri])
                .args(["-c", "write -P 0x55 16M 16M"])
                .output()
                .expect("qemu-io runs");
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr)
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(150));
    cluster.kill_osd(2);
    let text = writer.join().expect("writer thread");
    assert!(
        !text.contains("failed"),
        "write during the kill failed: {text}"
    );
    cluster.qemu_io("shm", &["read -P 0x55 16M 16M", "read -P 0x44 8M 4M"]);
    cluster.restart_osd(2);
    cluster.qemu_io("shm", &["write -P 0x66 0 1M", "read -P 0x66 0 1M"]);
}
