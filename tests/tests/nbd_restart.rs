//! A restart of flame-nbd (kill -9, then start again on the same port) does not fail
//! the I/O of a QEMU client that reconnects (`reconnect-delay`): its requests pause
//! while flame-nbd is away and run once it is back, and every write it was told
//! succeeded reads back. flame-nbd keeps no state a reconnecting client needs: each
//! acknowledged write was applied on every copy before the reply.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_tests::{ClusterOptions, TestCluster, output_text, require_tool, run_bounded};
use std::process::Command;
use std::time::{Duration, Instant};

/// Writes in the client's sequence, 64 KiB each, with a pause after each.
const ROUNDS: usize = 30;
/// Pause between writes (ms): the sequence spans the outage.
const PAUSE_MS: u64 = 100;
/// How long flame-nbd stays dead.
const OUTAGE: Duration = Duration::from_millis(1500);
/// QEMU's reconnect-delay (s): longer than the outage plus the restart.
const RECONNECT_DELAY_S: u64 = 20;

#[test]
fn qemu_with_reconnect_delay_rides_through_a_kill_9_of_flame_nbd() {
    let mut cluster = TestCluster::start_with(ClusterOptions::with_nbd());
    cluster.create_nbd_volume("rs", 16 << 20);
    let addr = cluster.nbd_addr();
    let image = format!(
        "driver=nbd,server.type=inet,server.host={},server.port={},export=rs,\
         reconnect-delay={RECONNECT_DELAY_S}",
        addr.ip(),
        addr.port()
    );
    let mut commands = Vec::new();
    for i in 0..ROUNDS {
        commands.push(format!("write -P {} {} 64k", i + 1, i * 65536));
        commands.push(format!("sleep {PAUSE_MS}"));
    }
    for i in 0..ROUNDS {
        commands.push(format!("read -P {} {} 64k", i + 1, i * 65536));
    }
    commands.push("flush".into());
    let qemu_io = require_tool("qemu-io");
    let client = std::thread::spawn(move || {
        let mut cmd = Command::new(qemu_io);
        cmd.arg("--image-opts").arg(&image);
        for c in &commands {
            cmd.arg("-c").arg(c);
        }
        run_bounded(&mut cmd, Duration::from_secs(90))
    });
    // Into the sequence: kill flame-nbd mid-way, leave it dead, start it again on
    // the same port (the harness waits for the port to be free, as an init system
    // restarting it would not: flame-nbd itself retries a busy address).
    std::thread::sleep(Duration::from_millis(1200));
    assert!(
        !client.is_finished(),
        "the client finished before the restart; the test proves nothing"
    );
    cluster.kill_nbd();
    let killed = Instant::now();
    std::thread::sleep(OUTAGE);
    cluster.restart_nbd();
    eprintln!("flame-nbd back after {:?}", killed.elapsed());
    assert!(
        !client.is_finished(),
        "the client finished during the outage: its writes did not wait"
    );
    let out = client.join().expect("client thread");
    let text = output_text(&out);
    assert!(
        out.status.success() && !text.contains("failed") && !text.contains("error"),
        "qemu-io saw an error across the flame-nbd restart ({}):\n{text}\n{}",
        out.status,
        cluster.log_tails()
    );
    // Everything acknowledged is there for a new client too.
    let mut reads = Vec::new();
    for i in 0..ROUNDS {
        reads.push(format!("read -P {} {} 64k", i + 1, i * 65536));
    }
    let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
    cluster.qemu_io("rs", &reads);
    cluster.assert_all_running();
}
