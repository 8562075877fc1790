//! flame-nbd in front of a replicated cluster, driven by real NBD clients: qemu-io,
//! qemu-img, nbdcopy, nbdinfo, fio's nbd engine and nbdfuse.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_tests::{
    ClusterOptions, TOOL_TIMEOUT, TestCluster, assert_same_bytes, output_text, pattern,
    require_tool, run_bounded, run_ok,
};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const OBJECT: u64 = 4 * MIB;

fn cluster_with_volume(name: &str, size: u64) -> TestCluster {
    let cluster = TestCluster::start_with(ClusterOptions::with_nbd());
    cluster.create_volume(name, size);
    let served = cluster.wait_nbd_export(name);
    assert_eq!(served, size, "NBD export size must be the volume size");
    cluster
}

#[test]
fn qemu_io_patterns_across_object_boundaries() {
    let cluster = cluster_with_volume("pat", 64 * MIB);
    // Straddle the first and second object boundaries; unaligned edges too.
    let a = OBJECT - 64 * 1024; // 64 KiB before the boundary, 128 KiB long
    let b = 2 * OBJECT - 4096 + 512; // unaligned, crosses into the third object
    let c = 5 * OBJECT + 1000; // small unaligned write inside one object
    cluster.qemu_io(
        "pat",
        &[
            &format!("write -P 0xab {a} 131072"),
            &format!("write -P 0xcd {b} 8192"),
            &format!("write -P 0x17 {c} 777"),
            "flush",
        ],
    );
    // Read back in a separate process (a new NBD connection).
    cluster.qemu_io(
        "pat",
        &[
            &format!("read -P 0xab {a} 131072"),
            &format!("read -P 0xcd {b} 8192"),
            &format!("read -P 0x17 {c} 777"),
            // Unwritten space reads as zeroes, also right next to written bytes.
            &format!("read -P 0 {} 4096", a - 4096),
            &format!("read -P 0 {} 512", b - 512),
            &format!("read -P 0 {} 1000", 5 * OBJECT),
            "read -P 0 0 65536",
            &format!("read -P 0 {} 65536", 64 * MIB - 65536),
        ],
    );
    // Overwrite the middle of a written range, zero and discard others.
    cluster.qemu_io(
        "pat",
        &[
            &format!("write -P 0x5e {} 4096", OBJECT - 2048),
            &format!("write -z {b} 8192"),
            &format!("discard {a} 61440"),
            "flush",
        ],
    );
    cluster.qemu_io(
        "pat",
        &[
            &format!("read -P 0 {a} 61440"),
            &format!("read -P 0xab {} 2048", OBJECT - 4096),
            &format!("read -P 0x5e {} 4096", OBJECT - 2048),
            &format!("read -P 0xab {} 63488", OBJECT + 2048),
            &format!("read -P 0 {b} 8192"),
            &format!("read -P 0x17 {c} 777"),
        ],
    );
}

/// Runs a Python script using libnbd's bindings (python3-libnbd; Debian's
/// /usr/bin/python3, which has them) with the export URI as argv[1].
fn python_nbd(script: &str, uri: &str) -> String {
    let py = "/usr/bin/python3";
    assert!(
        std::path::Path::new(py).exists(),
        "{py} missing: scripts/test.sh installs python3-libnbd"
    );
    let out = run_bounded(
        Command::new(py).arg("-c").arg(script).arg(uri),
        TOOL_TIMEOUT,
    );
    let text = output_text(&out);
    assert!(out.status.success(), "python/libnbd script failed:\n{text}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Requests the client library would never send (out of range) get an error reply,
/// and the connection keeps working.
#[test]
fn out_of_range_requests_fail_and_connection_survives() {
    let size = 8 * MIB;
    let cluster = cluster_with_volume("range", size);
    let out = python_nbd(
        r#"
import sys, nbd
h = nbd.NBD()
h.set_strict_mode(0)          # let bad requests reach the server
h.connect_uri(sys.argv[1])
size = h.get_size()
h.pwrite(b"\x42" * 4096, 0)
for name, op in [
    ("read past end", lambda: h.pread(4096, size)),
    ("read across end", lambda: h.pread(8192, size - 4096)),
    ("write past end", lambda: h.pwrite(b"x" * 4096, size)),
    ("trim past end", lambda: h.trim(4096, size)),
    ("zero past end", lambda: h.zero(4096, size)),
]:
    try:
        op()
        print("NOERROR", name)
    except nbd.Error as e:
        print("error", name, e.errno)
assert h.pread(4096, 0) == b"\x42" * 4096, "connection unusable after errors"
h.flush()
h.shutdown()
print("OK")
"#,
        &cluster.nbd_uri("range"),
    );
    assert!(
        !out.contains("NOERROR"),
        "out-of-range requests succeeded:\n{out}"
    );
    assert!(out.contains("OK"), "{out}");
}

/// Several connections write different byte ranges of the same blocks at once; no
/// acknowledged write may be lost (the promise behind NBD multi-conn).
#[test]
fn concurrent_connections_writing_one_block_lose_nothing() {
    let cluster = cluster_with_volume("multi", 8 * MIB);
    let out = python_nbd(
        r#"
import sys, threading, nbd
uri = sys.argv[1]
WRITERS, ROUNDS, SLICE = 4, 60, 1024
BLOCKS = [0, 4096, 4 * 1024 * 1024 - 4096]   # incl. the last block of object 0
errors = []
def writer(i):
    try:
        h = nbd.NBD()
        h.connect_uri(uri)
        for r in range(ROUNDS):
            for b in BLOCKS:
                h.pwrite(bytes([(r * WRITERS + i) % 251 + 1]) * SLICE, b + i * SLICE)
        h.shutdown()
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=writer, args=(i,)) for i in range(WRITERS)]
for t in threads: t.start()
for t in threads: t.join(timeout=120)
assert not errors, errors
h = nbd.NBD()
h.connect_uri(uri)
for b in BLOCKS:
    data = h.pread(WRITERS * SLICE, b)
    for i in range(WRITERS):
        want = ((ROUNDS - 1) * WRITERS + i) % 251 + 1
        got = data[i * SLICE:(i + 1) * SLICE]
        assert got == bytes([want]) * SLICE, f"block {b} slice {i}: want {want}, got {set(got)}"
print("OK")
"#,
        &cluster.nbd_uri("multi"),
    );
    assert!(out.contains("OK"), "{out}");
}

#[test]
fn qemu_img_and_nbdcopy_round_trip_16_mib() {
    let size = 16 * MIB;
    let cluster = cluster_with_volume("copy", size);
    let dir = cluster.dir().to_path_buf();
    let input = dir.join("in.raw");
    let output = dir.join("out.raw");
    let data = pattern(0xc0ffee, size as usize);
    std::fs::write(&input, &data).unwrap();

    // qemu-img writes (it flushes before exiting), nbdcopy reads back.
    run_ok(
        Command::new(require_tool("qemu-img"))
            .args(["convert", "-n", "-f", "raw", "-O", "raw", "-t", "none"])
            .arg(&input)
            .arg(cluster.nbd_uri("copy")),
        TOOL_TIMEOUT,
    );
    run_ok(
        Command::new(require_tool("nbdcopy"))
            .arg(cluster.nbd_uri("copy"))
            .arg(&output),
        TOOL_TIMEOUT,
    );
    assert_same_bytes(
        "qemu-img → flame → nbdcopy",
        &std::fs::read(&output).unwrap(),
        &data,
    );

    // The other way round, with new data and several connections.
    let data2 = pattern(0xbeef, size as usize);
    std::fs::write(&input, &data2).unwrap();
    run_ok(
        Command::new(require_tool("nbdcopy"))
            .args(["--connections=4", "--flush"])
            .arg(&input)
            .arg(cluster.nbd_uri("copy")),
        TOOL_TIMEOUT,
    );
    std::fs::remove_file(&output).unwrap();
    run_ok(
        Command::new(require_tool("qemu-img"))
            .args(["convert", "-f", "raw", "-O", "raw"])
            .arg(cluster.nbd_uri("copy"))
            .arg(&output),
        TOOL_TIMEOUT,
    );
    assert_same_bytes(
        "nbdcopy → flame → qemu-img",
        &std::fs::read(&output).unwrap(),
        &data2,
    );
}

#[test]
fn nbdinfo_lists_exports_and_unknown_names_are_refused() {
    let cluster = cluster_with_volume("alpha", 8 * MIB);
    cluster.create_nbd_volume("beta", 16 * MIB);
    let nbdinfo = require_tool("nbdinfo");
    let out = run_ok(
        Command::new(&nbdinfo)
            .arg("--list")
            .arg(format!("nbd://{}", cluster.nbd_addr())),
        TOOL_TIMEOUT,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("alpha") && text.contains("beta"),
        "NBD_OPT_LIST must list every volume:\n{text}"
    );
    let out = run_bounded(
        Command::new(&nbdinfo).arg(cluster.nbd_uri("no-such-volume")),
        TOOL_TIMEOUT,
    );
    assert!(
        !out.status.success(),
        "an unknown export name must be refused:\n{}",
        output_text(&out)
    );
    // Block-size info (NBD_INFO_BLOCK_SIZE) is advertised.
    let out = run_ok(
        Command::new(&nbdinfo)
            .arg("--json")
            .arg(cluster.nbd_uri("alpha")),
        TOOL_TIMEOUT,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("block_size_preferred"),
        "block size info missing:\n{text}"
    );
}

#[test]
fn fio_randrw_with_crc32c_verify() {
    let cluster = cluster_with_volume("fio", 64 * MIB);
    flame_tests::misbehaving::fio_randrw_verify(&cluster.nbd_uri("fio"), "0", "32M");
}

/// nbdfuse exposes the volume as a file; dd through it reaches the cluster.
#[test]
fn nbdfuse_file_read_write() {
    assert!(
        std::path::Path::new("/dev/fuse").exists(),
        "/dev/fuse is missing: nbdfuse cannot run here (load the fuse module)"
    );
    let size = 8 * MIB;
    let cluster = cluster_with_volume("fuse", size);
    let mnt = cluster.dir().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut fuse = Command::new(require_tool("nbdfuse"))
        .arg(&mnt)
        .arg(cluster.nbd_uri("fuse"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("cannot start nbdfuse");
    struct Unmount<'a>(&'a std::path::Path, &'a mut std::process::Child);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = Command::new("fusermount3").arg("-u").arg(self.0).status();
            let _ = self.1.kill();
            let _ = self.1.wait();
        }
    }
    let guard = Unmount(&mnt, &mut fuse);
    let file = mnt.join("nbd");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0) != size {
        assert!(
            Instant::now() < deadline,
            "nbdfuse did not expose {} within 30 s",
            file.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let src = cluster.dir().join("fuse-in.raw");
    let data = pattern(77, 3 * MIB as usize);
    std::fs::write(&src, &data).unwrap();
    run_ok(
        Command::new("dd")
            .arg(format!("if={}", src.display()))
            .arg(format!("of={}", file.display()))
            .args(["bs=1M", "seek=3", "conv=notrunc,fsync", "status=none"]),
        TOOL_TIMEOUT,
    );
    let back = run_ok(
        Command::new("dd")
            .arg(format!("if={}", file.display()))
            .args(["bs=1M", "skip=3", "count=3", "status=none"]),
        TOOL_TIMEOUT,
    );
    assert_same_bytes("dd through nbdfuse", &back.stdout, &data);
    drop(guard);
    // The data went to the cluster, not to a cache of nbdfuse: read it with nbdcopy.
    let whole = cluster.dir().join("fuse-out.raw");
    run_ok(
        Command::new(require_tool("nbdcopy"))
            .arg(cluster.nbd_uri("fuse"))
            .arg(&whole),
        TOOL_TIMEOUT,
    );
    let whole = std::fs::read(&whole).unwrap();
    assert_same_bytes(
        "volume after nbdfuse writes",
        &whole[3 * MIB as usize..6 * MIB as usize],
        &data,
    );
    assert!(whole[..3 * MIB as usize].iter().all(|&b| b == 0));
}
