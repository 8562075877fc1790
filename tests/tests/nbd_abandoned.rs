//! A write whose NBD client went away must not land later on top of a newer write.
//!
//! The client sends WRITE "A" while a replica of the block is down (so the write
//! cannot complete and flame-nbd keeps retrying it), then vanishes. The replica comes
//! back and a new client writes "B" to the same block and reads it. If flame-nbd kept
//! retrying the abandoned "A" (its client is gone; nobody will ever see the reply),
//! that retry could succeed after "B" was acknowledged and silently replace it.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::ids::ObjectId;
use flame_common::placement::locate;
use flame_tests::{ClusterOptions, TestCluster};
use std::process::Command;
use std::time::Duration;

/// Sends one 4 KiB WRITE of `b'A'` at offset 0 with libnbd and exits without waiting
/// for the reply (the process dies, so the connection drops with the write in flight).
const ABANDON: &str = r#"
import nbd, os, sys, time
h = nbd.NBD()
h.connect_uri(sys.argv[1])
h.aio_pwrite(b"A" * 4096, 0)
# Let the state machine put the request on the wire, then vanish.
for _ in range(20):
    h.poll(0)
    time.sleep(0.01)
os._exit(0)
"#;

#[test]
fn an_abandoned_write_does_not_overwrite_a_later_one() {
    let mut cluster = TestCluster::start_with(ClusterOptions::with_nbd());
    let vol = cluster.create_nbd_volume("abandon", 16 << 20);
    let map = cluster.map();
    let loc = locate(
        &map,
        ObjectId {
            volume: vol.id,
            index: 0,
        },
    );
    let replica = (0..cluster.osd_count())
        .find(|&i| cluster.osd_addr(i, 0) == map.osds[&loc.osds[1]].addr)
        .expect("replica process");
    cluster.kill_osd(replica);

    let out = Command::new("/usr/bin/python3")
        .arg("-c")
        .arg(ABANDON)
        .arg(cluster.nbd_uri("abandon"))
        .output()
        .expect("python3 with libnbd (python3-libnbd)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Give flame-nbd time to notice the client is gone, then bring the replica back.
    std::thread::sleep(Duration::from_millis(300));
    cluster.restart_osd(replica);
    cluster.wait_osds_up(3);
    cluster.qemu_io("abandon", &["write -P 0x42 0 4k", "read -P 0x42 0 4k"]);
    // Longer than the client's retry backoff cap (500 ms) several times over: an
    // abandoned retry loop would have landed by now.
    std::thread::sleep(Duration::from_secs(3));
    cluster.qemu_io("abandon", &["read -P 0x42 0 4k"]);
}
