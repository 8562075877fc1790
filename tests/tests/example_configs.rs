//! The documented example configurations (deploy/examples/*.yaml, every key with its
//! default) are accepted by the daemons: a renamed or removed key fails here, since
//! every daemon rejects unknown keys. Only addresses and paths are changed, so the
//! daemons can run side by side with anything else on the machine.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_tests::{TestKeys, bin_dir, free_ports, mgr_call_as};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

struct Running(Child, String);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn example(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/examples")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Replaces the value of top-level `key:` lines; panics if the key is not there
/// (the example must document it).
fn set(yaml: &str, key: &str, value: &str) -> String {
    let prefix = format!("{key}:");
    let mut found = false;
    let out: Vec<String> = yaml
        .lines()
        .map(|l| {
            if l.starts_with(&prefix) {
                found = true;
                format!("{prefix} {value}")
            } else {
                l.to_string()
            }
        })
        .collect();
    assert!(found, "example lacks top-level key `{key}`");
    out.join("\n") + "\n"
}

fn start(bin: &str, config: PathBuf, log: &Path) -> Running {
    let log_file = std::fs::File::create(log).unwrap();
    let child = Command::new(bin_dir().join(bin))
        .arg("--config")
        .arg(&config)
        .stdin(Stdio::null())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {bin}: {e} (cargo build --workspace --bins)"));
    Running(child, log.display().to_string())
}

fn wait_for(what: &str, daemon: &mut Running, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready() {
        if let Ok(Some(status)) = daemon.0.try_wait() {
            panic!(
                "{what} exited ({status}) with the example config:\n{}",
                std::fs::read_to_string(&daemon.1).unwrap_or_default()
            );
        }
        assert!(
            Instant::now() < deadline,
            "{what} not ready in 30 s:\n{}",
            std::fs::read_to_string(&daemon.1).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn example_configs_start_the_daemons() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let lo = |p: u16| SocketAddr::from(([127, 0, 0, 1], p));
    let quoted = |p: &Path| format!("\"{}\"", p.display());

    // The examples' keyrings, at their documented places in a scratch directory:
    // the nbd example's client.nbd is a role-client entity, as documented.
    let keys = TestKeys::create(&d.join("keys"));
    let mgr_addr = lo(free_ports(1));
    // The examples' TLS files, as `flame-admin tls init` writes them.
    let tls = d.join("tls");
    flame_client::admin::tls::generate(&tls, &["127.0.0.1".into()]).unwrap();
    let ca = tls.join("ca.crt");
    let trust = flame_common::tls::MgrTrust::load(&ca).unwrap();
    let mgr = flame_common::http::MgrEndpoint {
        agent: flame_common::http::agent(ureq::Agent::config_builder(), None, Some(&trust)),
        base: format!("https://{mgr_addr}"),
        creds: Some(keys.creds("client.admin", 1)),
    };
    let get = |path: &str| mgr_call_as(&mgr, "GET", path, None);
    let mgr_yaml = set(&example("mgr.yaml"), "listen", &mgr_addr.to_string());
    let mgr_yaml = set(&mgr_yaml, "data_dir", &quoted(&d.join("mgr")));
    let mgr_yaml = set(&mgr_yaml, "keyring", &quoted(&keys.keyring("cluster")));
    let mgr_yaml = set(
        &mgr_yaml,
        "tls",
        &format!(
            "{{cert_file: {}, key_file: {}}}",
            quoted(&tls.join("mgr.crt")),
            quoted(&tls.join("mgr.key"))
        ),
    );
    std::fs::write(d.join("mgr.yaml"), mgr_yaml).unwrap();
    let mut mgr_daemon = start("flame-mgr", d.join("mgr.yaml"), &d.join("mgr.log"));
    wait_for("flame-mgr", &mut mgr_daemon, || {
        get("/v1/status").is_ok_and(|(c, _)| c == 200)
    });

    // shards: 0 means one per core: reserve that many consecutive ports.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as u16;
    let osd_addr = lo(free_ports(cores));
    let mut osd_yaml = set(&example("osd.yaml"), "mgr", &mgr_addr.to_string());
    osd_yaml = set(&osd_yaml, "listen", &osd_addr.to_string());
    osd_yaml = set(&osd_yaml, "metrics_listen", &lo(free_ports(1)).to_string());
    osd_yaml = set(&osd_yaml, "data_dir", &quoted(&d.join("osd")));
    osd_yaml = set(&osd_yaml, "mgr_tls_ca", &quoted(&ca));
    // The example's own key, osd.0, added as documented.
    let added = mgr_call_as(
        &mgr,
        "POST",
        "/v1/auth/entities",
        Some(br#"{"entity":"osd.0","role":"osd"}"#),
    );
    assert!(matches!(added, Ok((200, _))), "{added:?}");
    keys.write_keyring("osd.0", 1);
    osd_yaml = set(&osd_yaml, "keyring", &quoted(&keys.keyring("osd.0")));
    std::fs::write(d.join("osd.yaml"), osd_yaml).unwrap();
    let mut osd = start("flame-osd", d.join("osd.yaml"), &d.join("osd.log"));
    wait_for("flame-osd", &mut osd, || {
        get("/v1/osds").is_ok_and(|(c, body)| {
            c == 200 && body.contains(&osd_addr.to_string()) && body.contains("\"up\":true")
        })
    });

    let nbd_addr = lo(free_ports(1));
    let mut nbd_yaml = set(&example("nbd.yaml"), "mgr", &mgr_addr.to_string());
    nbd_yaml = set(&nbd_yaml, "listen", &nbd_addr.to_string());
    nbd_yaml = set(&nbd_yaml, "metrics_listen", &lo(free_ports(1)).to_string());
    nbd_yaml = set(&nbd_yaml, "mgr_tls_ca", &quoted(&ca));
    // flame-nbd's certificate from the same CA (`flame-admin tls issue --as
    // nbd`), and its socket in the scratch directory.
    flame_client::admin::tls::issue(&tls, "nbd", &["127.0.0.1".into()]).unwrap();
    nbd_yaml = set(
        &nbd_yaml,
        "tls",
        &format!(
            "{{cert_file: {}, key_file: {}, client_ca_file: {}}}",
            quoted(&tls.join("nbd.crt")),
            quoted(&tls.join("nbd.key")),
            quoted(&ca)
        ),
    );
    nbd_yaml = set(
        &nbd_yaml,
        "unix",
        &format!("{{path: {}}}", quoted(&d.join("nbd.sock"))),
    );
    let added = mgr_call_as(
        &mgr,
        "POST",
        "/v1/auth/entities",
        Some(br#"{"entity":"client.nbd","role":"client"}"#),
    );
    assert!(matches!(added, Ok((200, _))), "{added:?}");
    keys.write_keyring("client.nbd", 1);
    nbd_yaml = set(&nbd_yaml, "keyring", &quoted(&keys.keyring("client.nbd")));
    std::fs::write(d.join("nbd.yaml"), nbd_yaml).unwrap();
    let mut nbd = start("flame-nbd", d.join("nbd.yaml"), &d.join("nbd.log"));
    wait_for("flame-nbd", &mut nbd, || {
        TcpStream::connect_timeout(&nbd_addr, Duration::from_millis(300)).is_ok()
            && d.join("nbd.sock").exists()
    });
}

/// Every daemon reports a bad config the same way: exactly one line on stderr,
/// starting with its name and naming the file and the key, nothing on stdout, and
/// exit status 2 (status 1 is for run-time failures). Covers an unknown key (parse
/// error), a value of the wrong type, a value out of range (validation) and a
/// missing file.
#[test]
fn bad_configs_give_one_line_on_stderr_and_exit_status_2() {
    let dir = tempfile::tempdir().unwrap();
    for (bin, unknown, wrong_type, out_of_range) in [
        (
            "flame-mgr",
            "heartbeat_grace",
            "heartbeat_grace_ms: soon",
            "pool: {size: 0}",
        ),
        ("flame-osd", "shard", "shards: many", "shards: 100000"),
        ("flame-nbd", "thread", "threads: many", "threads: 100000"),
    ] {
        let cases = [
            (format!("{unknown}: 1\n"), unknown.to_string()),
            (
                format!("{wrong_type}\n"),
                wrong_type.split(':').next().unwrap().to_string(),
            ),
            (
                format!("{out_of_range}\n"),
                out_of_range.split(':').next().unwrap().to_string(),
            ),
        ];
        for (i, (yaml, key)) in cases.iter().enumerate() {
            let cfg = dir.path().join(format!("{bin}-{i}.yaml"));
            std::fs::write(&cfg, yaml).unwrap();
            check_bad_config(bin, &cfg, key);
        }
        check_bad_config(bin, &dir.path().join("missing.yaml"), "missing.yaml");
    }
    // The files a config names: a manager certificate that is not there, a CA
    // that is not there (nothing is created before the message).
    let missing = dir.path().join("no-such.crt");
    let m = missing.display();
    for (bin, yaml) in [
        (
            "flame-mgr",
            format!(
                "auth: none\ndata_dir: \"{}/mgr\"\ntls: {{cert_file: \"{m}\", key_file: \"{m}\"}}\n",
                dir.path().display()
            ),
        ),
        ("flame-osd", format!("mgr_tls_ca: \"{m}\"\n")),
        ("flame-nbd", format!("mgr_tls_ca: \"{m}\"\n")),
    ] {
        let cfg = dir.path().join(format!("{bin}-tls.yaml"));
        std::fs::write(&cfg, yaml).unwrap();
        let out = flame_tests::run_bounded(
            Command::new(bin_dir().join(bin)).arg("--config").arg(&cfg),
            Duration::from_secs(30),
        );
        let err = String::from_utf8_lossy(&out.stderr);
        // Status 2 and a line of its own naming the file (the OSD also logs it).
        assert!(
            out.status.code() == Some(2)
                && err
                    .lines()
                    .any(|l| l.starts_with(&format!("{bin}: ")) && l.contains("no-such.crt"))
                && out.stdout.is_empty(),
            "{bin} with a missing TLS file: {out:?}"
        );
    }
    assert!(
        !dir.path().join("mgr").exists(),
        "the manager created its state first"
    );
}

fn check_bad_config(bin: &str, cfg: &Path, must_name: &str) {
    let out = flame_tests::run_bounded(
        Command::new(bin_dir().join(bin)).arg("--config").arg(cfg),
        Duration::from_secs(30),
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let what = format!(
        "{bin} --config {} ({:?})",
        cfg.display(),
        std::fs::read_to_string(cfg).ok()
    );
    assert_eq!(
        out.status.code(),
        Some(2),
        "{what}: exit status; stderr:\n{err}"
    );
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(
        lines.len(),
        1,
        "{what}: want one line on stderr, got:\n{err}"
    );
    assert!(
        lines[0].starts_with(&format!("{bin}: ")),
        "{what}: the line does not start with `{bin}: `: {err}"
    );
    assert!(
        lines[0].contains(must_name),
        "{what}: does not name `{must_name}`: {err}"
    );
    assert!(
        lines[0].contains(&cfg.display().to_string()),
        "{what}: does not name the file: {err}"
    );
    assert!(
        out.stdout.is_empty(),
        "{what}: wrote to stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
}
