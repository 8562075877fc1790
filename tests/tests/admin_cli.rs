//! What a new user meets in `flame-admin`, through the real binary against real
//! daemons: a write benchmark that refuses to destroy data, errors as JSON under
//! `--json`, sizes with binary units and fractions, and status figures that say
//! "waiting for first report" instead of zeroes.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_tests::{TestCluster, output_text};
use serde_json::Value;
use std::process::Output;
use std::time::{Duration, Instant};

const GIB: u64 = 1 << 30;

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Asserts `out` failed with `code` and printed `{"error": "..."}` (and nothing
/// else) on stdout and nothing on stderr; returns the message.
fn json_error(out: &Output, code: i32) -> String {
    assert_eq!(out.status.code(), Some(code), "{}", output_text(out));
    assert!(
        out.stderr.is_empty(),
        "stderr must be empty under --json: {}",
        stderr(out)
    );
    let v: Value = serde_json::from_str(&stdout(out))
        .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {}", stdout(out)));
    let obj = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"));
    assert_eq!(obj.len(), 1, "only `error`: {v}");
    let msg = obj["error"]
        .as_str()
        .unwrap_or_else(|| panic!("error is not a string: {v}"));
    assert!(!msg.is_empty());
    msg.to_string()
}

#[test]
fn write_bench_refuses_a_volume_that_holds_data() {
    let cluster = TestCluster::start_with(flame_tests::ClusterOptions::with_nbd());
    cluster.admin_ok(&["volume", "create", "scratch", "--size", "64M"]);
    let bench = |rw: &'static str, extra: &[&str]| {
        let mut args = vec![
            "bench",
            "scratch",
            "--rw",
            rw,
            "--bs",
            "4k",
            "--iodepth",
            "4",
            "--runtime",
            "300ms",
        ];
        args.extend_from_slice(extra);
        cluster.admin(&args)
    };
    // A new volume reads as zeroes: the benchmark runs. Sequential, so it surely
    // writes the volume's first block, which the check samples (a short random run
    // on a loaded machine may write too few blocks to hit a sampled one).
    let out = bench("write", &[]);
    assert!(out.status.success(), "fresh volume: {}", output_text(&out));
    assert!(stdout(&out).contains("iops"), "{}", output_text(&out));

    // Now it holds the benchmark's data: a second write run is refused, and says how
    // to go on.
    let out = bench("randwrite", &[]);
    assert_eq!(out.status.code(), Some(1), "{}", output_text(&out));
    let err = stderr(&out);
    assert!(err.contains("holds data"), "{err}");
    assert!(err.contains("--force-overwrite"), "{err}");
    assert!(err.contains("scratch volume"), "{err}");
    // Sequential writes too, and the refusal is JSON under --json.
    let msg = json_error(&bench("write", &["--json"]), 1);
    assert!(msg.contains("holds data"), "{msg}");

    // Reading never destroys anything: no check.
    let out = cluster.admin(&["bench", "scratch", "--rw", "randread", "--runtime", "200ms"]);
    assert!(out.status.success(), "{}", output_text(&out));

    // The explicit flag lets it through.
    let out = bench("randwrite", &["--force-overwrite"]);
    assert!(out.status.success(), "{}", output_text(&out));

    // Data only in the middle of the volume (object 8, past the first MiB and well
    // before the last) is found too: the check samples the start of every object.
    cluster.admin_ok(&["volume", "create", "mid", "--size", "64M"]);
    cluster.wait_nbd_export("mid");
    cluster.qemu_io("mid", &["write -P 0x5a 32M 4k"]);
    let out = cluster.admin(&["bench", "mid", "--rw", "write", "--runtime", "100ms"]);
    assert_eq!(out.status.code(), Some(1), "{}", output_text(&out));
    assert!(
        stderr(&out).contains(&format!("offset {}", 32 << 20)),
        "{}",
        output_text(&out)
    );
    // ... unless --size-limit keeps the run before it.
    let out = cluster.admin(&[
        "bench",
        "mid",
        "--rw",
        "write",
        "--runtime",
        "100ms",
        "--size-limit",
        "16M",
    ]);
    assert!(out.status.success(), "{}", output_text(&out));
}

#[test]
fn json_errors_are_json_on_stdout_with_a_nonzero_exit() {
    let cluster = TestCluster::start();
    // A failed request to the manager.
    let msg = json_error(&cluster.admin(&["volume", "info", "nope", "--json"]), 1);
    assert!(msg.contains("nope"), "{msg}");
    // --json before the subcommand, too.
    json_error(&cluster.admin(&["--json", "volume", "rm", "nope"]), 1);
    // A usage error (exit 2) is JSON too when --json is on the command line.
    let msg = json_error(
        &cluster.admin(&["volume", "create", "v", "--size", "10GB", "--json"]),
        2,
    );
    assert!(msg.contains("decimal units are not accepted"), "{msg}");
    json_error(&cluster.admin(&["frobnicate", "--json"]), 2);
    // An unreachable manager.
    let out = flame_tests::run_bounded(
        std::process::Command::new(cluster.bin("flame-admin"))
            .args(["--mgr", "127.0.0.1:1", "status", "--json"])
            .env_remove("FLAME_MGR"),
        Duration::from_secs(60),
    );
    let msg = json_error(&out, 1);
    assert!(msg.contains("127.0.0.1:1"), "{msg}");
    // Without --json the same errors stay one line on stderr, stdout empty.
    let out = cluster.admin(&["volume", "info", "nope"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "{}", output_text(&out));
    assert!(
        stderr(&out).starts_with("flame-admin: error:"),
        "{}",
        output_text(&out)
    );
}

#[test]
fn sizes_take_binary_units_and_exact_fractions() {
    let cluster = TestCluster::start();
    let v = cluster.admin_json(&["volume", "create", "frac", "--size", "1.5G"]);
    assert_eq!(v["size"], 3 * GIB / 2, "{v}");
    let v = cluster.admin_json(&["volume", "resize", "frac", "--size", "2GiB"]);
    assert_eq!(v["size"], 2 * GIB, "{v}");
    for (size, says) in [
        ("10GB", "decimal units are not accepted"),
        ("100P", "100 PiB, more than the largest allowed, 1 PiB"),
        ("0.1G", "whole number of bytes"),
        ("1000", "multiple of 512"),
    ] {
        let out = cluster.admin(&["volume", "create", "bad", "--size", size]);
        assert_eq!(out.status.code(), Some(2), "{size}: {}", output_text(&out));
        assert!(stderr(&out).contains(says), "{size}: {}", output_text(&out));
    }
    assert!(cluster.admin(&["volume", "info", "bad"]).status.code() == Some(1));
    let help = stdout(&cluster.admin(&["volume", "create", "--help"]));
    assert!(help.contains("binary"), "{help}");
    assert!(help.contains("GB"), "{help}");
}

#[test]
fn status_says_waiting_for_first_report_until_osds_report() {
    let mut cluster = TestCluster::start();
    cluster.admin_ok(&["volume", "create", "v", "--size", "1G"]);
    // Once every OSD has sent a heartbeat (a registered OSD may not have yet): real
    // figures.
    wait_all_reported(&cluster);
    let human = cluster.admin_ok(&["status"]);
    assert!(human.contains(" used of "), "{human}");
    assert!(!human.contains("waiting"), "{human}");

    // A manager restarted while the OSDs are away has no report from any of them,
    // but its map still says up (for the heartbeat grace): unknown, not 0 B of 0 B.
    for i in 0..cluster.osd_count() {
        cluster.kill_osd(i);
    }
    cluster.restart_mgr();
    let st = cluster.admin_json(&["status"]);
    assert_eq!(st["osds_awaiting_first_report"], 3, "{st}");
    let human = cluster.admin_ok(&["status"]);
    assert!(
        human.contains("unknown: waiting for first report from 3 OSDs"),
        "{human}"
    );
    assert!(!human.contains("0 B used of 0 B"), "{human}");
    assert!(human.contains("3 waiting for first report"), "{human}");
    let osds = cluster.admin_ok(&["osd", "ls"]);
    assert!(osds.contains("up?") && osds.contains("unknown"), "{osds}");
    assert!(osds.contains("waiting for first report"), "{osds}");
    let list = cluster.admin_json(&["osd", "ls"]);
    assert!(
        list.as_array()
            .unwrap()
            .iter()
            .all(|o| o["awaiting_first_report"] == true),
        "{list}"
    );

    // The OSDs come back and report: figures again.
    for i in 0..cluster.osd_count() {
        cluster.restart_osd(i);
    }
    wait_all_reported(&cluster);
    let human = cluster.admin_ok(&["status"]);
    assert!(
        human.contains(" used of ") && !human.contains("waiting"),
        "{human}"
    );
}

fn wait_all_reported(cluster: &TestCluster) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let st = cluster.admin_json(&["status"]);
        if st["osds_awaiting_first_report"] == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "OSDs never reported: {st}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `flame-admin auth` through the real binary: `init` writes a new cluster's
/// keyrings (0600, in a 0700 directory, never over existing ones); `add` gives a
/// read-only entity whose keyring reads but cannot change anything; `rotate`
/// retires its key at once (and refuses `osd` without --force); `rm` retires it
/// for good; without a keyring nothing works.
#[test]
fn auth_commands_manage_keys_end_to_end() {
    use std::os::unix::fs::PermissionsExt;
    let cluster = TestCluster::start();
    let Some(keys) = cluster.keys() else {
        panic!("this test needs a cluster with authentication (FLAME_TEST_AUTH unset)");
    };
    let admin = |args: &[&str]| cluster.admin(args);
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path().join("new-keys");
    let ds = d.to_str().unwrap();
    let out = admin(&["auth", "init", "--dir", ds]);
    assert!(out.status.success(), "{}", output_text(&out));
    assert_eq!(
        std::fs::metadata(&d).unwrap().permissions().mode() & 0o777,
        0o700
    );
    for f in ["cluster.keyring", "client.admin.keyring"] {
        let mode = std::fs::metadata(d.join(f)).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{f}");
    }
    // No shared OSD key: each OSD gets its own once the manager runs.
    assert!(!d.join("osd.keyring").exists());
    assert!(
        stdout(&out).contains("auth add osd.N"),
        "{}",
        output_text(&out)
    );
    let again = admin(&["auth", "init", "--dir", ds]);
    assert_eq!(again.status.code(), Some(1));
    assert!(
        stderr(&again).contains("already exists"),
        "{}",
        output_text(&again)
    );

    // `tls init`, offline too: the CA and the manager's certificate, keys
    // 0600, never over existing ones, at least one --name.
    let t = tmp.path().join("tls");
    let ts = t.to_str().unwrap();
    let out = admin(&["tls", "init", "--dir", ts, "--name", "127.0.0.1"]);
    assert!(out.status.success(), "{}", output_text(&out));
    for (f, mode) in [
        ("ca.crt", 0o644),
        ("ca.key", 0o600),
        ("mgr.crt", 0o644),
        ("mgr.key", 0o600),
    ] {
        let m = std::fs::metadata(t.join(f)).unwrap().permissions().mode() & 0o777;
        assert_eq!(m, mode, "{f}");
    }
    assert!(stdout(&out).contains("mgr_tls_ca"), "{}", output_text(&out));
    let again = admin(&["tls", "init", "--dir", ts, "--name", "127.0.0.1"]);
    assert_eq!(again.status.code(), Some(1));
    assert!(
        stderr(&again).contains("already exists"),
        "{}",
        output_text(&again)
    );
    let nameless = admin(&["tls", "init", "--dir", ts]);
    assert_eq!(
        nameless.status.code(),
        Some(2),
        "{}",
        output_text(&nameless)
    );
    // `tls issue`: another certificate from that CA, never over one.
    let out = admin(&[
        "tls",
        "issue",
        "--dir",
        ts,
        "--as",
        "mgr2",
        "--name",
        "127.0.0.2",
    ]);
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(stdout(&out).contains("mgr2.crt"), "{}", output_text(&out));
    let m = std::fs::metadata(t.join("mgr2.key"))
        .unwrap()
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(m, 0o600);
    let again = admin(&[
        "tls",
        "issue",
        "--dir",
        ts,
        "--as",
        "mgr2",
        "--name",
        "127.0.0.2",
    ]);
    assert_eq!(again.status.code(), Some(1), "{}", output_text(&again));
    assert!(
        stderr(&again).contains("already exists"),
        "{}",
        output_text(&again)
    );
    let bad = admin(&[
        "tls",
        "issue",
        "--dir",
        ts,
        "--as",
        "../x",
        "--name",
        "127.0.0.2",
    ]);
    assert_eq!(bad.status.code(), Some(1), "{}", output_text(&bad));

    let cluster_keyring = keys.keyring("cluster");
    let ck = cluster_keyring.to_str().unwrap();
    let k1 = tmp.path().join("cli.keyring");
    let out = admin(&[
        "auth",
        "add",
        "client.cli",
        "--role",
        "client",
        "--cluster-keyring",
        ck,
        "--out",
        k1.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", output_text(&out));
    let as_cli = |keyring: &std::path::Path, args: &[&str]| {
        let mut cmd = cluster.admin_command();
        cmd.env("FLAME_KEYRING", keyring).args(args);
        flame_tests::run_bounded(&mut cmd, Duration::from_secs(60))
    };
    assert!(as_cli(&k1, &["status"]).status.success());
    let refused = as_cli(&k1, &["volume", "create", "nope", "--size", "1M"]);
    assert_eq!(refused.status.code(), Some(1));
    assert!(
        stderr(&refused).contains("client.cli (role client) may not"),
        "{}",
        output_text(&refused)
    );

    // An OSD's own key: role osd without asking, and no other role.
    let k7 = tmp.path().join("osd.7.keyring");
    let out = admin(&[
        "auth",
        "add",
        "osd.7",
        "--cluster-keyring",
        ck,
        "--out",
        k7.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", output_text(&out));
    assert!(stdout(&out).contains("role osd"), "{}", output_text(&out));
    let out = admin(&["auth", "add", "osd.8", "--role", "admin"]);
    assert_eq!(out.status.code(), Some(1), "{}", output_text(&out));
    assert!(stderr(&out).contains("osd role"), "{}", output_text(&out));
    let out = admin(&["auth", "add", "client.x", "--role", "osd"]);
    assert_eq!(out.status.code(), Some(1), "{}", output_text(&out));

    let out = admin(&["auth", "rotate", "osd"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--force"), "{}", output_text(&out));
    let k2 = tmp.path().join("cli2.keyring");
    let out = admin(&[
        "auth",
        "rotate",
        "client.cli",
        "--cluster-keyring",
        ck,
        "--out",
        k2.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", output_text(&out));
    let old = as_cli(&k1, &["status"]);
    assert!(
        stderr(&old).contains("generation 1 was rotated"),
        "{}",
        output_text(&old)
    );
    assert!(as_cli(&k2, &["status"]).status.success());

    let list: Value = cluster.admin_json(&["auth", "ls"]);
    let names: Vec<&str> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["entity"].as_str().unwrap())
        .collect();
    let mut want = vec!["client.admin", "client.cli", "client.test", "osd"];
    let osds: Vec<String> = (0..cluster.osd_count())
        .map(|i| format!("osd.{i}"))
        .chain(["osd.7".to_string()])
        .collect();
    want.extend(osds.iter().map(String::as_str));
    assert_eq!(names, want);
    assert!(admin(&["auth", "rm", "client.cli"]).status.success());
    assert!(!as_cli(&k2, &["status"]).status.success());

    // A bridge whose key was removed stops at once with the manager's reason,
    // rather than retrying for its 30 s start-up patience.
    let port = flame_tests::free_ports(2);
    let yaml = tmp.path().join("nbd.yaml");
    std::fs::write(
        &yaml,
        format!(
            "mgr: \"{}\"\nkeyring: \"{}\"\nlisten: \"127.0.0.1:{port}\"\ntcp_without_tls: true\nunix: null\n\
             metrics_listen: \"127.0.0.1:{}\"\nthreads: 1\n",
            cluster.mgr_addr(),
            k2.display(),
            port + 1
        ),
    )
    .unwrap();
    let started = Instant::now();
    let out = flame_tests::run_bounded(
        std::process::Command::new(cluster.bin("flame-nbd"))
            .arg("--config")
            .arg(&yaml),
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(1), "{}", output_text(&out));
    assert!(
        stderr(&out).contains("client.cli is not known"),
        "{}",
        output_text(&out)
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );

    // No keyring at all: refused, saying how to give one.
    let mut cmd = cluster.admin_command();
    cmd.env_remove("FLAME_KEYRING").args(["volume", "ls"]);
    let out = flame_tests::run_bounded(&mut cmd, Duration::from_secs(60));
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--keyring"), "{}", output_text(&out));
}
