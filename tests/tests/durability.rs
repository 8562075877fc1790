//! An NBD FLUSH and an FUA write reach stable storage on every copy: each of the
//! three OSDs counts the syncs it issued (`flame_osd_syncs_total{kind=...}`), and
//! those counters must move on all three between the write and the reply to FLUSH
//! (or to the FUA write). A flame-nbd whose FLUSH does nothing, or an OSD whose
//! flush handler skips the sync, fails this test.
//!
//! Also: a corrupt block is never returned to a client, and an OSD refuses a data
//! directory of the old format with exit status 2.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::ids::ObjectId;
use flame_tests::{
    ClusterOptions, TOOL_TIMEOUT, TestCluster, http_get, output_text, require_tool, run_bounded,
};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// How long one step of the scripted NBD client may take.
const STEP_TIMEOUT: Duration = Duration::from_secs(60);

/// `flame_osd_syncs_total{kind="<kind>"}` of OSD process `i`.
fn syncs(cluster: &TestCluster, i: usize, kind: &str) -> u64 {
    let addr = cluster.osd_metrics_addr(i);
    let (code, body) = http_get(addr, "/metrics").unwrap_or_else(|e| panic!("osd.{i}: {e}"));
    assert_eq!(code, 200, "osd.{i} metrics: HTTP {code}");
    let want = format!("flame_osd_syncs_total{{kind=\"{kind}\"}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&want))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

fn all_syncs(cluster: &TestCluster, kind: &str) -> Vec<u64> {
    (0..cluster.osd_count())
        .map(|i| syncs(cluster, i, kind))
        .collect()
}

/// A Python/libnbd client driven step by step: each line sent on stdin runs one
/// step; it prints the step's name when the server has replied.
struct Client {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    lines: mpsc::Receiver<String>,
}

const SCRIPT: &str = r#"
import sys, nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
print("connected", flush=True)
for line in sys.stdin:
    step = line.strip()
    if step == "write":
        # Two objects, 64 KiB each, no flush.
        h.pwrite(b"\x5a" * 65536, 0)
        h.pwrite(b"\xa5" * 65536, 4 << 20)
    elif step == "flush":
        h.flush()
    elif step == "fua":
        h.pwrite(b"\x33" * 4096, 8 << 20, nbd.CMD_FLAG_FUA)
    elif step == "quit":
        h.shutdown()
        print("quit", flush=True)
        break
    print(step, flush=True)
"#;

impl Client {
    fn start(uri: &str) -> Client {
        let mut child = Command::new("/usr/bin/python3")
            .arg("-c")
            .arg(SCRIPT)
            .arg(uri)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 with libnbd (scripts/test.sh installs python3-libnbd)");
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut c = Client {
            child,
            stdin,
            lines,
        };
        c.expect("connected");
        c
    }

    fn expect(&mut self, what: &str) {
        match self.lines.recv_timeout(STEP_TIMEOUT) {
            Ok(l) if l == what => {}
            other => {
                let _ = self.child.kill();
                panic!("libnbd client: expected {what:?}, got {other:?}");
            }
        }
    }

    fn step(&mut self, what: &str) {
        writeln!(self.stdin, "{what}").expect("client stdin");
        self.stdin.flush().expect("client stdin");
        self.expect(what);
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn nbd_flush_and_fua_reach_stable_storage_on_every_osd() {
    let cluster = TestCluster::start_with(ClusterOptions::with_nbd());
    assert_eq!(cluster.osd_count(), 3);
    cluster.create_nbd_volume("dur", 16 * MIB);
    let mut client = Client::start(&cluster.nbd_uri("dur"));

    client.step("write");
    // Writes alone sync nothing on the data path (the journal write aside).
    let before = all_syncs(&cluster, "fdatasync");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        all_syncs(&cluster, "fdatasync"),
        before,
        "something synced object data without a FLUSH"
    );
    client.step("flush");
    let after = all_syncs(&cluster, "fdatasync");
    for i in 0..3 {
        // Two dirty objects on every OSD (three copies on three OSDs).
        assert!(
            after[i] >= before[i] + 2,
            "osd.{i}: FLUSH replied before the OSD synced the written objects \
             (fdatasync {} -> {})\n{}",
            before[i],
            after[i],
            cluster.log_tails()
        );
    }

    let before = all_syncs(&cluster, "fua");
    client.step("fua");
    let after = all_syncs(&cluster, "fua");
    for i in 0..3 {
        assert!(
            after[i] > before[i],
            "osd.{i}: an FUA write was acknowledged without a synced write on this copy \
             (fua {} -> {})\n{}",
            before[i],
            after[i],
            cluster.log_tails()
        );
    }
    client.step("quit");
    // Every OSD exports its checksum error counters (at 0: nothing was corrupt).
    for i in 0..3 {
        let (_, body) = http_get(cluster.osd_metrics_addr(i), "/metrics").unwrap();
        for result in ["repaired", "unrepaired"] {
            let line = format!("flame_osd_checksum_errors_total{{result=\"{result}\"}} 0");
            assert!(body.contains(&line), "osd.{i} lacks {line}");
        }
    }
}

#[test]
fn an_old_format_data_dir_is_refused_with_status_2() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("osd");
    // Format 1: objects/<volume>/<index>, identity, no superblock.
    std::fs::create_dir_all(data.join("objects/0000000000000001")).unwrap();
    std::fs::write(
        data.join("objects/0000000000000001/0000000000000000"),
        b"old",
    )
    .unwrap();
    std::fs::write(
        data.join("osd.json"),
        br#"{"uuid":"00000000-0000-4000-8000-000000000001","id":null,"fsid":null}"#,
    )
    .unwrap();
    let cfg = dir.path().join("osd.yaml");
    std::fs::write(
        &cfg,
        format!(
            "mgr: 127.0.0.1:1\nlisten: 127.0.0.1:0\nmetrics_listen: 127.0.0.1:0\ndata_dir: {}\n",
            data.display()
        ),
    )
    .unwrap();
    let bin = flame_tests::bin_dir().join("flame-osd");
    let out = flame_tests::run_bounded(
        Command::new(bin).arg("--config").arg(&cfg),
        Duration::from_secs(30),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("format 1") && stderr.contains("empty data_dir"),
        "the message must say what is wrong and what to do: {stderr}"
    );
    // Untouched: no superblock written, the old object still there.
    assert!(!data.join("superblock").exists());
    assert!(
        data.join("objects/0000000000000001/0000000000000000")
            .exists()
    );
}

/// `flame_osd_checksum_errors_total{result="<result>"}` of OSD process `i`.
fn checksum_errors(cluster: &TestCluster, i: usize, result: &str) -> u64 {
    let (_, body) = http_get(cluster.osd_metrics_addr(i), "/metrics").unwrap();
    let want = format!("flame_osd_checksum_errors_total{{result=\"{result}\"}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&want))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

fn qemu_io_read(cluster: &TestCluster, volume: &str, command: &str) -> String {
    let out = run_bounded(
        Command::new(require_tool("qemu-io"))
            .args(["-f", "raw", "-r"])
            .arg(cluster.nbd_uri(volume))
            .args(["-c", command]),
        TOOL_TIMEOUT,
    );
    output_text(&out)
}

/// A block that fails its checksum is never returned: the primary reads it from a
/// copy that verifies, repairs its own copy and every replica that reported the
/// block bad, and serves the good data. Only when no copy verifies does the read
/// fail with EIO.
#[test]
fn a_corrupt_block_is_repaired_from_a_good_copy_and_never_returned() {
    let cluster = TestCluster::start_with(ClusterOptions::with_nbd());
    let vol = cluster.create_nbd_volume("rot", 16 * MIB);
    cluster.qemu_io("rot", &["write -P 0x77 0 16384", "flush"]);
    // Recovery and peering from the OSDs' boots may still be comparing this
    // object: they would repair the bytes corrupted below before the read looks
    // (a CI run saw peering copy the object over the first replica's rot).
    cluster.wait_clean(Duration::from_secs(60));
    let all: Vec<usize> = (0..cluster.osd_count()).collect();
    cluster.wait_peered(&all, Duration::from_secs(60));
    let map = cluster.map();
    let object = ObjectId {
        volume: vol.id,
        index: 0,
    };
    let loc = flame_common::placement::locate(&map, object);
    let process = |id| {
        let addr = map.osds[&id].addr;
        (0..cluster.osd_count())
            .find(|&i| cluster.osd_addr(i, 0) == addr)
            .expect("OSD process")
    };
    let (primary, r1, r2) = (
        process(loc.osds[0]),
        process(loc.osds[1]),
        process(loc.osds[2]),
    );
    let repaired0 = checksum_errors(&cluster, primary, "repaired");

    // 1. Bit rot in block 1 of the primary's copy: repaired from a replica.
    let at1 = 4096 + 10;
    assert_eq!(cluster.object_byte(primary, vol.id, at1, Some(0x78)), 0x78);
    let text = qemu_io_read(&cluster, "rot", "read -P 0x77 0 8192");
    assert!(
        !text.contains("error") && !text.contains("Pattern verification failed"),
        "the read must be served from a good copy:\n{text}"
    );
    assert_eq!(
        cluster.object_byte(primary, vol.id, at1, None),
        0x77,
        "the primary's copy was not repaired"
    );
    assert_eq!(
        checksum_errors(&cluster, primary, "repaired"),
        repaired0 + 1
    );

    // 2. The same block rotten on the primary and on the first replica: both are
    // repaired from the second replica.
    let at2 = 2 * 4096 + 99;
    cluster.object_byte(primary, vol.id, at2, Some(0x01));
    cluster.object_byte(r1, vol.id, at2, Some(0x02));
    let text = qemu_io_read(&cluster, "rot", "read -P 0x77 8192 4096");
    assert!(
        !text.contains("error") && !text.contains("Pattern verification failed"),
        "the read must be served from the one good copy:\n{text}"
    );
    assert_eq!(cluster.object_byte(primary, vol.id, at2, None), 0x77);
    assert_eq!(
        cluster.object_byte(r1, vol.id, at2, None),
        0x77,
        "the replica that reported the block bad was not repaired"
    );
    // The replica's repair is counted once its write is acknowledged, which
    // may be just after the read's reply: wait for it (bounded, 10 s).
    let counted = (0..100).any(|_| {
        let ok = checksum_errors(&cluster, primary, "repaired") == repaired0 + 3;
        if !ok {
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        ok
    });
    assert!(
        counted,
        "repairs counted: {} (want {})",
        checksum_errors(&cluster, primary, "repaired"),
        repaired0 + 3
    );

    // 3. No copy verifies: EIO, never the data; counted as unrepaired.
    let unrepaired0 = checksum_errors(&cluster, primary, "unrepaired");
    let at3 = 3 * 4096 + 7;
    for i in [primary, r1, r2] {
        cluster.object_byte(i, vol.id, at3, Some(0x55));
    }
    let text = qemu_io_read(&cluster, "rot", "read -P 0x77 12288 4096");
    assert!(
        text.contains("Input/output error") && !text.contains("Pattern verification failed"),
        "a block no copy verifies must fail the read with EIO:\n{text}"
    );
    assert!(
        checksum_errors(&cluster, primary, "unrepaired") > unrepaired0,
        "osd.{primary} did not count the unrepairable block"
    );
    // The other blocks still read.
    cluster.qemu_io("rot", &["read -P 0x77 0 12288"]);
}
