//! Acknowledged data survives kill -9 of every daemon (docs/guarantees.md): after a
//! restart of the whole cluster the volume reads back exactly what was written.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_tests::{
    ClusterOptions, TOOL_TIMEOUT, TestCluster, assert_same_bytes, output_text, pattern,
    require_tool, run_bounded, run_ok,
};
use std::process::Command;

const MIB: u64 = 1 << 20;

fn read_volume(cluster: &TestCluster, volume: &str, name: &str) -> Vec<u8> {
    let out = cluster.dir().join(name);
    let _ = std::fs::remove_file(&out);
    run_ok(
        Command::new(require_tool("nbdcopy"))
            .arg(cluster.nbd_uri(volume))
            .arg(&out),
        TOOL_TIMEOUT,
    );
    std::fs::read(&out).unwrap()
}

fn write_volume(cluster: &TestCluster, volume: &str, data: &[u8]) {
    let src = cluster.dir().join(format!("{volume}.in"));
    std::fs::write(&src, data).unwrap();
    // qemu-img flushes before it exits successfully.
    run_ok(
        Command::new(require_tool("qemu-img"))
            .args(["convert", "-n", "-f", "raw", "-O", "raw", "-t", "none"])
            .arg(&src)
            .arg(cluster.nbd_uri(volume)),
        TOOL_TIMEOUT,
    );
}

#[test]
fn flushed_writes_survive_kill9_of_every_daemon() {
    let size = 24 * MIB;
    let mut cluster = TestCluster::start_with(ClusterOptions::with_nbd());
    cluster.create_nbd_volume("crash", size);

    let mut want = pattern(1, size as usize);
    write_volume(&cluster, "crash", &want);
    for round in 0..2u64 {
        cluster.kill_all();
        cluster.start_all();
        cluster.wait_nbd_export("crash");
        let got = read_volume(&cluster, "crash", "crash.out");
        assert_same_bytes(
            &format!("after kill -9 of everything (round {round})"),
            &got,
            &want,
        );
        // Change part of it (across an object boundary), then crash again.
        let patch = pattern(100 + round, 6 * MIB as usize);
        let at = (3 * MIB) as usize;
        want[at..at + patch.len()].copy_from_slice(&patch);
        write_volume(&cluster, "crash", &want);
    }
    cluster.kill_all();
    cluster.start_all();
    cluster.wait_nbd_export("crash");
    let got = read_volume(&cluster, "crash", "crash.out");
    assert_same_bytes("after the final kill -9", &got, &want);
    // The manager kept its volumes and OSDs across kill -9.
    let st = cluster.status();
    assert_eq!(st.volumes, 1);
    assert_eq!(
        st.osds, 3,
        "restarted OSDs must keep their ids, not register anew"
    );
}

/// An acknowledged write that was never flushed still survives kill -9 of the
/// processes (it was handed to the kernel on every replica before the reply; only a
/// power failure may lose it).
#[test]
fn acknowledged_unflushed_writes_survive_kill9() {
    let mut cluster = TestCluster::start_with(ClusterOptions::with_nbd());
    cluster.create_nbd_volume("noflush", 16 * MIB);
    let py = "/usr/bin/python3";
    // libnbd's pwrite returns after the server's reply; shutdown sends no flush.
    let out = run_bounded(
        Command::new(py)
            .arg("-c")
            .arg(
                r#"
import sys, nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
for i in range(64):
    h.pwrite(bytes([i + 1]) * 65536, i * 196608 + 4096 * (i % 7))
h.shutdown()
print("OK")
"#,
            )
            .arg(cluster.nbd_uri("noflush")),
        TOOL_TIMEOUT,
    );
    assert!(out.status.success(), "{}", output_text(&out));
    cluster.kill_all();
    cluster.start_all();
    cluster.wait_nbd_export("noflush");
    let got = read_volume(&cluster, "noflush", "noflush.out");
    let mut want = vec![0u8; 16 * MIB as usize];
    for i in 0..64usize {
        let at = i * 196_608 + 4096 * (i % 7);
        want[at..at + 65536].fill(i as u8 + 1);
    }
    assert_same_bytes("unflushed acknowledged writes after kill -9", &got, &want);
}

/// The manager is not on the data path: I/O keeps working while it is down, for as
/// long as the OSDs' leases last (`lease_ms`, docs/guarantees.md). A longer outage
/// pauses I/O — the OSDs cannot tell it from being cut off and replaced — and
/// the paused I/O completes, without an error, once the manager is back.
#[test]
fn io_continues_while_the_manager_is_down() {
    let mut cluster = TestCluster::start_with(ClusterOptions::with_nbd());
    cluster.create_nbd_volume("nomgr", 8 * MIB);
    cluster.qemu_io("nomgr", &["write -P 0x31 0 1M", "flush"]);
    cluster.kill_mgr();
    cluster.qemu_io(
        "nomgr",
        &["read -P 0x31 0 1M", "write -P 0x32 4194304 1M", "flush"],
    );
    // Past the default lease (4 s): the OSDs stop serving; I/O waits.
    std::thread::sleep(std::time::Duration::from_secs(6));
    let mut paused = Command::new(require_tool("qemu-io"));
    paused
        .args(["-f", "raw"])
        .arg(cluster.nbd_uri("nomgr"))
        .args([
            "-c",
            "read -P 0x31 0 1M",
            "-c",
            "write -P 0x33 0 1M",
            "-c",
            "flush",
        ]);
    let io = std::thread::spawn(move || run_bounded(&mut paused, TOOL_TIMEOUT));
    std::thread::sleep(std::time::Duration::from_secs(2));
    assert!(
        !io.is_finished(),
        "I/O completed with the manager down for longer than the OSDs' lease"
    );
    cluster.restart_mgr();
    let out = io.join().unwrap();
    let text = output_text(&out);
    assert!(
        out.status.success() && !text.contains("failed"),
        "I/O paused by the manager's absence must complete once it is back: {text}\n{}",
        cluster.log_tails()
    );
    cluster.qemu_io("nomgr", &["read -P 0x33 0 1M", "read -P 0x32 4194304 1M"]);
}

/// flame-nbd (the client library inside it) reconnects to OSDs that were killed and
/// restarted, and serves the same data without being restarted itself.
#[test]
fn nbd_rides_out_an_osd_restart() {
    let mut cluster = TestCluster::start_with(ClusterOptions::with_nbd());
    cluster.create_nbd_volume("osdrestart", 16 * MIB);
    cluster.qemu_io("osdrestart", &["write -P 0x41 0 8M", "flush"]);
    for i in 0..cluster.osd_count() {
        cluster.kill_osd(i);
        cluster.restart_osd(i);
    }
    cluster.qemu_io(
        "osdrestart",
        &["read -P 0x41 0 8M", "write -P 0x42 8M 8M", "flush"],
    );
    for i in 0..cluster.osd_count() {
        cluster.kill_osd(i);
    }
    for i in 0..cluster.osd_count() {
        cluster.restart_osd(i);
    }
    cluster.qemu_io("osdrestart", &["read -P 0x41 0 8M", "read -P 0x42 8M 8M"]);
    assert!(cluster.nbd_running(), "flame-nbd died during OSD restarts");
}
