//! flame-nbd with in-memory exports, driven by real NBD clients: nbdinfo, qemu-io,
//! qemu-img, nbdcopy, fio's nbd engine and the libnbd Python bindings. The tools are
//! required (the tests fail if one is missing): qemu-utils, libnbd-bin, fio,
//! python3-libnbd.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

mod nbd_common;

use nbd_common::*;
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(20);

#[test]
fn list_and_info() {
    let mut srv = NbdServer::start(&["disk=64M", "other=1M", "ro=1M:ro"], "");
    let list = run_ok(
        "nbdinfo",
        &["--list", &format!("nbd://127.0.0.1:{}", srv.port)],
        T,
    );
    for name in ["disk", "other", "ro"] {
        assert!(list.contains(&format!("export=\"{name}\"")), "{list}");
    }
    let json = run_ok("nbdinfo", &["--json", &srv.uri("disk")], T);
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let e = &v["exports"][0];
    assert_eq!(e["export-name"], "disk");
    assert_eq!(e["export-size"], 64 << 20);
    assert_eq!(e["block_size_minimum"], 1);
    assert_eq!(e["block_size_preferred"], 4096);
    assert_eq!(e["block_size_maximum"], 32 << 20);
    assert_eq!(e["can_multi_conn"], true);
    assert_eq!(e["can_fua"], true);
    assert_eq!(e["can_flush"], true);
    assert_eq!(e["can_trim"], true);
    assert_eq!(e["can_zero"], true);
    assert_eq!(e["is_read_only"], false);
    assert_eq!(v["protocol"], "newstyle-fixed");
    let ro = run_ok("nbdinfo", &["--json", &srv.uri("ro")], T);
    let v: serde_json::Value = serde_json::from_str(&ro).unwrap();
    assert_eq!(v["exports"][0]["is_read_only"], true);
    assert_eq!(v["exports"][0]["can_trim"], false);
    srv.assert_alive();
}

#[test]
fn qemu_io_patterns_fua_zeroes_discard() {
    let mut srv = NbdServer::start(&["disk=64M"], "");
    let uri = srv.uri("disk");
    let cmds = [
        "write -P 0xab 0 64k",
        "read -P 0xab 0 64k",
        // Unaligned, with FUA.
        "write -P 0xcd -f 100 1000",
        "read -P 0xab 0 100",
        "read -P 0xcd 100 1000",
        "read -P 0xab 1100 1000",
        // Crossing the 4 KiB map blocks, odd length.
        "write -P 0x11 4000 8193",
        "read -P 0x11 4000 8193",
        // Write zeroes (with FUA) read back as zeroes, neighbours intact.
        "write -z 8192 4096",
        "write -z -f 20000 3000",
        "read -P 0 8192 4096",
        "read -P 0 20000 3000",
        "read -P 0x11 4000 4192",
        // Discard then flush.
        "discard 32k 16k",
        "flush",
        "read -P 0 32k 16k",
        "read -P 0xab 48k 16k",
        // A large request (8 MiB) near the end.
        "write -P 0x5a 56M 8M",
        "read -P 0x5a 56M 8M",
    ];
    let mut args = vec!["-f", "raw", uri.as_str()];
    for c in &cmds {
        args.push("-c");
        args.push(c);
    }
    let out = run_ok("qemu-io", &args, T);
    assert!(!out.contains("failed"), "{out}");
    // A wrong pattern must be detected (the check above can fail).
    let bad = run(
        "qemu-io",
        &["-f", "raw", &uri, "-c", "read -P 0x99 0 4k"],
        T,
    );
    assert!(!bad.status.success());
    // Out of range is an error, and the server keeps serving.
    let oor = run(
        "qemu-io",
        &["-f", "raw", &uri, "-c", "write -P 1 67108000 4096"],
        T,
    );
    assert!(String::from_utf8_lossy(&oor.stdout).contains("failed") || !oor.status.success());
    run_ok(
        "qemu-io",
        &["-f", "raw", &uri, "-c", "read -P 0xab 0 100"],
        T,
    );
    let metrics = srv.metrics();
    for op in ["read", "write", "flush", "trim", "write_zeroes"] {
        assert!(
            metrics.contains(&format!("flame_nbd_ops_total{{op=\"{op}\"}}")),
            "{op} missing in metrics:\n{metrics}"
        );
    }
    assert!(metrics.contains("flame_nbd_op_latency_seconds_bucket"));
    assert!(metrics.contains("flame_nbd_connections"));
    srv.assert_alive();
}

#[test]
fn unknown_export_is_refused() {
    let mut srv = NbdServer::start(&["disk=1M"], "");
    let out = run(
        "qemu-io",
        &["-f", "raw", &srv.uri("nope"), "-c", "read 0 512"],
        T,
    );
    assert!(!out.status.success());
    let out = run("nbdinfo", &[&srv.uri("nope")], T);
    assert!(!out.status.success());
    run_ok("nbdinfo", &[&srv.uri("disk")], T);
    srv.assert_alive();
}

fn random_file(dir: &std::path::Path, name: &str, len: usize) -> std::path::PathBuf {
    let mut data = vec![0u8; len];
    // Deterministic pseudo-random content (xorshift), with a zero run in the middle.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for b in data.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x as u8;
    }
    data[len / 3..len / 3 + 65536].fill(0);
    let p = dir.join(name);
    std::fs::write(&p, &data).unwrap();
    p
}

#[test]
fn qemu_img_and_nbdcopy_roundtrip() {
    let mut srv = NbdServer::start(&["a=8M", "b=8M"], "");
    let dir = tempfile::tempdir().unwrap();
    let src = random_file(dir.path(), "src.img", 8 << 20);
    let src_s = src.to_str().unwrap();
    // qemu-img convert into export a and back.
    run_ok(
        "qemu-img",
        &[
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            src_s,
            &srv.uri("a"),
        ],
        T,
    );
    let back1 = dir.path().join("back1.img");
    run_ok(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            &srv.uri("a"),
            back1.to_str().unwrap(),
        ],
        T,
    );
    assert!(std::fs::read(&back1).unwrap() == std::fs::read(&src).unwrap());
    run_ok(
        "qemu-img",
        &["compare", "-f", "raw", "-F", "raw", src_s, &srv.uri("a")],
        T,
    );
    // nbdcopy with several connections into export b and back.
    run_ok(
        "nbdcopy",
        &["--connections=4", "--requests=16", src_s, &srv.uri("b")],
        T,
    );
    let back2 = dir.path().join("back2.img");
    run_ok("nbdcopy", &[&srv.uri("b"), back2.to_str().unwrap()], T);
    assert!(std::fs::read(&back2).unwrap() == std::fs::read(&src).unwrap());
    srv.assert_alive();
}

#[test]
fn fio_randrw_verify() {
    let mut srv = NbdServer::start(&["disk=32M"], "");
    let uri = format!("--uri={}", srv.uri("disk"));
    let out = run_ok(
        "fio",
        &[
            "--name=nbd-verify",
            "--ioengine=nbd",
            &uri,
            "--rw=randrw",
            "--bs=4k",
            "--iodepth=16",
            "--size=16M",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--verify_state_save=0",
            "--runtime=15",
        ],
        T,
    );
    assert!(out.contains("nbd-verify"), "{out}");
    assert!(!out.contains("verify: bad"), "{out}");
    // Larger, mixed block sizes, sequential write then verify.
    run_ok(
        "fio",
        &[
            "--name=nbd-seq",
            "--ioengine=nbd",
            &uri,
            "--rw=write",
            "--bsrange=512-256k",
            "--iodepth=8",
            "--size=8M",
            "--verify=crc32c",
            "--verify_fatal=1",
            "--verify_state_save=0",
            "--runtime=15",
        ],
        T,
    );
    srv.assert_alive();
}

#[test]
fn garbage_and_stalled_handshake_leave_others_served() {
    let mut srv = NbdServer::start(&["disk=4M"], "handshake_timeout_ms: 1000\n");
    // Stalled: connects, reads the greeting, never answers.
    let mut stalled = Raw::connect(srv.port);
    let _ = stalled.read_n(18);
    // Stalled mid-option: sends half an option header.
    let mut half = Raw::connect(srv.port);
    half.start(3);
    half.s.write_all(b"IHAVE").unwrap();
    // Garbage instead of client flags.
    let mut garbage = Raw::connect(srv.port);
    let _ = garbage.read_n(18);
    garbage.s.write_all(&[0xff; 64]).unwrap();
    garbage.expect_closed(Duration::from_secs(3));
    // Garbage after a good handshake (bad request magic).
    let mut garbage2 = Raw::connect(srv.port);
    garbage2.go("disk", false);
    garbage2.s.write_all(&[0x42; 200]).unwrap();
    garbage2.expect_closed(Duration::from_secs(3));
    // Meanwhile a real client works.
    run_ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            &srv.uri("disk"),
            "-c",
            "write -P 7 0 4k",
            "-c",
            "read -P 7 0 4k",
        ],
        T,
    );
    // The stalled ones are dropped after the handshake timeout.
    stalled.expect_closed(Duration::from_secs(4));
    half.expect_closed(Duration::from_secs(4));
    run_ok(
        "qemu-io",
        &["-f", "raw", &srv.uri("disk"), "-c", "read -P 7 0 4k"],
        T,
    );
    srv.assert_alive();
}

/// flame-nbd's connections probe a silent peer (keepalive; with
/// `TCP_USER_TIMEOUT`, set by the same call), so a client whose host went away
/// does not hold its slot for good: `ss` shows the keepalive timer on the
/// server's side of an idle connection.
#[test]
fn nbd_connections_have_keepalive() {
    let mut srv = NbdServer::start(&["disk=4M"], "");
    let mut c = Raw::connect(srv.port);
    c.go("disk", false);
    // The timer shows once nothing is in flight (while the last reply is
    // unacknowledged it is the retransmission timer).
    let mut text = String::new();
    for _ in 0..50 {
        let out = std::process::Command::new("ss")
            .args([
                "-tno",
                "state",
                "established",
                &format!("( sport = :{} )", srv.port),
            ])
            .output()
            .expect("ss (iproute2) is installed by scripts/test.sh");
        assert!(out.status.success(), "{out:?}");
        text = String::from_utf8_lossy(&out.stdout).into_owned();
        if text.lines().any(|l| l.contains("timer:(keepalive")) {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        text.lines().any(|l| l.contains("timer:(keepalive")),
        "no keepalive on the server's socket:\n{text}"
    );
    srv.assert_alive();
}

#[test]
fn killed_clients_with_requests_in_flight() {
    // The vanished clients use "disk"; the one that must keep working uses "other"
    // (requests a vanished client already sent may still be applied to "disk").
    let mut srv = NbdServer::start(&["disk=64M", "other=8M"], "");
    let t0 = Instant::now();
    // A raw client pipelines many large writes and reads, then vanishes without
    // reading a reply.
    for round in 0..3u64 {
        let mut r = Raw::connect(srv.port);
        r.go("disk", round % 2 == 0);
        let payload = vec![round as u8; 1 << 20];
        for i in 0..32u64 {
            r.request(1, 0, i, i << 20, 1 << 20, &payload);
            r.request(0, 0, 1000 + i, i << 20, 1 << 20, &[]);
        }
        drop(r);
    }
    // fio killed -9 in the middle of a run.
    require("fio");
    let uri = format!("--uri={}", srv.uri("disk"));
    let mut fio = Command::new("fio")
        .args([
            "--name=killed",
            "--ioengine=nbd",
            &uri,
            "--rw=randrw",
            "--bs=64k",
            "--iodepth=32",
            "--size=64M",
            "--time_based",
            "--runtime=30",
            // Jobs as threads of one process, in their own process group: the kill
            // below takes all of them at once.
            "--thread",
        ])
        .process_group(0)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1000));
    // Another client works while fio is running, and after it is killed.
    let check = |srv: &NbdServer, v: u8| {
        run_ok(
            "qemu-io",
            &[
                "-f",
                "raw",
                &srv.uri("other"),
                "-c",
                &format!("write -P {v} 0 1M"),
                "-c",
                &format!("read -P {v} 0 1M"),
            ],
            T,
        );
    };
    check(&srv, 0x11);
    // SAFETY: signalling the process group of a child we spawned.
    unsafe { libc::kill(-(fio.id() as i32), libc::SIGKILL) };
    fio.wait().unwrap();
    check(&srv, 0x22);
    srv.assert_alive();
    // Connections are all closed again once the dust settles.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let m = srv.metrics();
        if m.lines().any(|l| l == "flame_nbd_connections 0") {
            break;
        }
        assert!(Instant::now() < deadline, "connections not released:\n{m}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // The export the vanished clients used is fine too.
    run_ok(
        "qemu-io",
        &[
            "-f",
            "raw",
            &srv.uri("disk"),
            "-c",
            "write -P 0x3c 0 1M",
            "-c",
            "read -P 0x3c 0 1M",
        ],
        T,
    );
    srv.assert_alive();
    assert!(t0.elapsed() < Duration::from_secs(20));
}

#[test]
fn multi_conn_writers_to_one_block_lose_nothing() {
    let mut srv = NbdServer::start(&["disk=16M"], "");
    let py = python_with_nbd();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/nbd/multiconn.py");
    let child = Command::new(&py)
        .args([script, &srv.uri("disk"), "4", "128", "20"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_output(child, "multiconn.py", T);
    assert!(
        out.status.success(),
        "multiconn.py failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("ok 4 connections"));
    // Same with 8 connections (512-byte slices) and qemu-io checking the result.
    let child = Command::new(&py)
        .args([script, &srv.uri("disk"), "8", "64", "10"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_output(child, "multiconn.py", T);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Connection 0's last value in round 9: (0*37 + 9*11 + 1) & 0xff = 100.
    run_ok(
        "qemu-io",
        &["-f", "raw", &srv.uri("disk"), "-c", "read -P 100 0 512"],
        T,
    );
    srv.assert_alive();
}

#[test]
fn python_libnbd_simple_replies_and_export_name() {
    let mut srv = NbdServer::start(&["disk=1M", "ro=1M:ro"], "");
    let py = python_with_nbd();
    let script = r#"
import sys, nbd
uri = sys.argv[1]
ro_uri = sys.argv[2]
# Simple replies only (what the Linux kernel client uses).
h = nbd.NBD()
h.set_request_structured_replies(False)
h.connect_uri(uri)
assert not h.get_structured_replies_negotiated()
assert not h.can_df()
h.pwrite(b"\x5a" * 5000, 123, nbd.CMD_FLAG_FUA)
assert h.pread(5000, 123) == b"\x5a" * 5000
h.zero(1000, 500)
assert h.pread(1000, 500) == b"\0" * 1000
h.trim(4096, 8192)
h.flush()
h.shutdown()
# Non-fixed newstyle: NBD_OPT_EXPORT_NAME, 124 zero bytes.
h = nbd.NBD()
h.set_handshake_flags(0)
h.connect_uri(uri)
assert h.get_size() == 1 << 20
assert h.pread(10, 123) == b"\x5a" * 10
h.shutdown()
# INFO, LIST, ABORT in option mode.
h = nbd.NBD()
h.set_opt_mode(True)
h.connect_uri(uri)
names = []
h.opt_list(lambda n, d: names.append(n) or 0)
assert sorted(names) == ["disk", "ro"], names
h.set_export_name("ro")
h.opt_info()
assert h.get_size() == 1 << 20 and h.is_read_only()
h.set_export_name("missing")
try:
    h.opt_info()
    raise SystemExit("INFO on a missing export succeeded")
except nbd.Error:
    pass
h.opt_abort()
# Server-side errors with client checks off.
h = nbd.NBD()
h.set_strict_mode(0)
h.connect_uri(ro_uri)
try:
    h.pwrite(b"x", 0)
    raise SystemExit("write to read-only export succeeded")
except nbd.Error as e:
    assert e.errno == "EPERM", e
h.shutdown()
h = nbd.NBD()
h.set_strict_mode(0)
h.connect_uri(uri)
for f in (lambda: h.pwrite(b"x" * 10, (1 << 20) - 5), ):
    try:
        f()
        raise SystemExit("write past the end succeeded")
    except nbd.Error as e:
        assert e.errno == "ENOSPC", e
try:
    h.pread(10, (1 << 20) - 5)
    raise SystemExit("read past the end succeeded")
except nbd.Error as e:
    assert e.errno == "EINVAL", e
assert h.pread(10, 123) == b"\x5a" * 10
h.shutdown()
print("ok")
"#;
    let child = Command::new(&py)
        .args(["-c", script, &srv.uri("disk"), &srv.uri("ro")])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = wait_output(child, "python libnbd script", T);
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok",
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    srv.assert_alive();
}

#[test]
fn max_connections_is_enforced() {
    let mut srv = NbdServer::start(&["disk=1M"], "max_connections: 2\n");
    let mut a = Raw::connect(srv.port);
    a.go("disk", true);
    let mut b = Raw::connect(srv.port);
    b.go("disk", false);
    let mut c = Raw::connect(srv.port);
    c.expect_closed(Duration::from_secs(3));
    drop(a);
    // A slot frees up once a connection closes.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut d = Raw::connect(srv.port);
        let mut g = [0u8; 18];
        d.s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        if std::io::Read::read_exact(&mut d.s, &mut g).is_ok() {
            break;
        }
        assert!(Instant::now() < deadline, "slot never freed");
        std::thread::sleep(Duration::from_millis(50));
    }
    b.request(3, 0, 1, 0, 0, &[]);
    assert_eq!(b.simple_reply(), (0, 1));
    srv.assert_alive();
}
