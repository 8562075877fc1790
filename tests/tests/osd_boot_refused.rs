//! An OSD the manager must not register is refused before anything is recorded,
//! and the OSD says why and exits with status 2.
//!
//! Two cases, both seen in practice: a data directory from another (old dev)
//! cluster, whose OSD used to be registered and only then noticed the mismatch,
//! leaving a ghost `in`/`down` OSD that degraded placement groups and made FLUSH
//! fail; and a second OSD advertising an address a live OSD already holds.
//! Besides, an OSD whose lease does not fit the manager's grace (the manager says
//! its grace in the boot answer) refuses to run.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_tests::{ClusterOptions, TestCluster, free_ports, output_text, run_bounded};
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Runs one extra flame-osd against the cluster's manager with its own data
/// directory (`osd_json`: the identity file to put there, if any) and waits for it to
/// exit (bounded: a refused OSD exits at once; one that was accepted would run on,
/// and is killed at the timeout, failing the test).
fn run_extra_osd(
    cluster: &TestCluster,
    name: &str,
    osd_json: Option<&str>,
    advertise: Option<SocketAddr>,
) -> std::process::Output {
    run_extra_osd_with(cluster, name, osd_json, advertise, cluster.keyring("osd"))
}

/// [`run_extra_osd`] with `keyring` (`None`: none).
fn run_extra_osd_with(
    cluster: &TestCluster,
    name: &str,
    osd_json: Option<&str>,
    advertise: Option<SocketAddr>,
    keyring: Option<std::path::PathBuf>,
) -> std::process::Output {
    let dir = cluster.dir().join(name);
    std::fs::create_dir_all(&dir).unwrap();
    if let Some(json) = osd_json {
        std::fs::write(dir.join("osd.json"), json).unwrap();
    }
    // The advertised port must equal the listen port: to advertise another OSD's
    // address, listen on the same port of another loopback IP.
    let listen = advertise.map_or_else(
        || SocketAddr::from(([127, 0, 0, 1], free_ports(1))),
        |a| SocketAddr::from(([127, 0, 0, 2], a.port())),
    );
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_ports(1)));
    let advertise = advertise.map_or(String::new(), |a| format!("advertise: \"{a}\"\n"));
    let keyring = keyring.map_or(String::new(), |k| format!("keyring: \"{}\"\n", k.display()));
    let yaml = format!(
        "mgr: \"{}\"\n{keyring}listen: \"{listen}\"\n{advertise}metrics_listen: \"{metrics}\"\n\
         data_dir: \"{}\"\nhost: \"{name}\"\nshards: 1\npoll_mode: interrupt\n",
        cluster.mgr_addr(),
        dir.display()
    );
    let config = cluster.dir().join(format!("{name}.yaml"));
    std::fs::write(&config, yaml).unwrap();
    run_bounded(
        Command::new(cluster.bin("flame-osd"))
            .arg("--config")
            .arg(&config)
            .env("RUST_LOG", "warn"),
        Duration::from_secs(20),
    )
}

fn osd_uuids(dir: &Path) -> usize {
    std::fs::read_to_string(dir.join("mgr/state.json"))
        .map(|s| s.matches("\"u-").count())
        .unwrap_or(0)
}

#[test]
fn an_osd_of_another_cluster_or_a_taken_address_is_refused_without_a_trace() {
    let cluster = TestCluster::start();
    let before = cluster.map();
    assert_eq!(before.osds.len(), 3);

    // 1. A data directory that belongs to another cluster.
    let out = run_extra_osd(
        &cluster,
        "foreign",
        Some(r#"{"uuid":"u-foreign-0001","id":7,"fsid":"some-other-cluster"}"#),
        None,
    );
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(2), "foreign OSD: {text}");
    assert!(
        text.contains("belongs to cluster some-other-cluster"),
        "the refusal must say why: {text}"
    );
    let after = cluster.map();
    assert_eq!(after.osds.len(), 3, "a ghost OSD was registered: {after:?}");
    assert_eq!(
        after.epoch, before.epoch,
        "the refused boot changed the map"
    );
    assert_eq!(cluster.status().health, "HEALTH_OK");
    assert_eq!(osd_uuids(cluster.dir()), 0, "the uuid was recorded");

    // 2. A fresh OSD advertising the address of osd.0, which is up.
    let taken = cluster.osd_addr(0, 0);
    let out = run_extra_osd(&cluster, "squatter", None, Some(taken));
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(2), "squatter OSD: {text}");
    assert!(
        text.contains(&format!("address {taken}")) && text.contains("which is up"),
        "the refusal must name the address and its holder: {text}"
    );
    let after = cluster.map();
    assert_eq!(
        after.osds.len(),
        3,
        "a second OSD was registered at {taken}"
    );
    assert_eq!(after.epoch, before.epoch);
}

/// An OSD with its own key (`osd.N`) against a manager that runs with `auth:
/// none` (so it has no service key to give) stops with status 2 and the
/// manager's reason before it boots: nothing is registered, and systemd does
/// not restart it in a loop (each restart would have marked it up first).
/// An OSD holding its own key against a manager with `auth: none` gets an
/// unsigned refusal of the service key: it cannot tell that manager from
/// anyone on the path forging one, so it does not exit on it (no daemon stops
/// on an answer it cannot verify); it says why, keeps trying with backoff, and
/// registers nothing.
#[test]
fn an_osd_with_its_own_key_retries_an_unsigned_refusal_and_never_boots() {
    use flame_common::auth::{EntityName, Keyring, SecretKey};
    let cluster = TestCluster::start_with(flame_tests::ClusterOptions {
        auth: false,
        ..flame_tests::ClusterOptions::default()
    });
    let before = cluster.map();
    let keyring = cluster.dir().join("osd.7.keyring");
    let secret = SecretKey::random().unwrap();
    let entity = EntityName::parse("osd.7").unwrap();
    Keyring::derived(&secret, &entity, 1)
        .save(&keyring)
        .unwrap();
    let dir = cluster.dir().join("own-key");
    let listen = SocketAddr::from(([127, 0, 0, 1], free_ports(1)));
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_ports(1)));
    let config = cluster.dir().join("own-key.yaml");
    std::fs::write(
        &config,
        format!(
            "mgr: \"{}\"\nkeyring: \"{}\"\nlisten: \"{listen}\"\nmetrics_listen: \"{metrics}\"\n\
             data_dir: \"{}\"\nhost: own-key\nshards: 1\n",
            cluster.mgr_addr(),
            keyring.display(),
            dir.display()
        ),
    )
    .unwrap();
    let log = cluster.dir().join("own-key.log");
    let mut child = Command::new(cluster.bin("flame-osd"))
        .arg("--config")
        .arg(&config)
        .env("RUST_LOG", "warn")
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(std::fs::File::create(cluster.dir().join("own-key.err")).unwrap())
        .spawn()
        .unwrap();
    // Bounded: 4 s of retries (backoff 100 ms doubling to 2 s: several).
    std::thread::sleep(Duration::from_secs(4));
    let exited = child.try_wait().unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let text = std::fs::read_to_string(&log).unwrap_or_default()
        + &std::fs::read_to_string(cluster.dir().join("own-key.err")).unwrap_or_default();
    assert!(
        exited.is_none(),
        "it exited on an unsigned refusal ({exited:?}): {text}"
    );
    assert!(
        text.contains("service-key") && text.contains("auth: none") && text.contains("unsigned"),
        "it must say why it waits: {text}"
    );
    let after = cluster.map();
    assert_eq!(
        after.osds.len(),
        before.osds.len(),
        "it was registered: {after:?}"
    );
    assert_eq!(after.epoch, before.epoch, "its start changed the map");
}

/// The made-up-OSD attack, from outside the cluster's keys: three made-up OSDs
/// with a weight of 1e300 boot, heartbeat and report groups recovered, unsigned
/// and with a client's key. Every request is refused, the map does not move,
/// and after the stray delay every real OSD still holds its copies, which
/// agree (scrub: 0 inconsistent).
#[test]
fn made_up_osds_are_refused_and_real_copies_stay() {
    let cluster = flame_tests::TestCluster::start_with(flame_tests::ClusterOptions {
        osd_extra_yaml: "stray_delete_delay_ms: 500\n".into(),
        ..flame_tests::ClusterOptions::default()
    });
    let Some(keys) = cluster.keys() else {
        // With `auth: none` this is the documented risk (docs/security.md).
        return;
    };
    let vol = cluster.create_volume("real", 16 << 20);
    cluster.admin_ok(&[
        "bench",
        "real",
        "--rw",
        "write",
        "--bs",
        "1M",
        "--iodepth",
        "4",
        "--runtime",
        "1s",
    ]);
    let before = cluster.object_files_per_osd(vol.id);
    assert!(
        before.iter().all(|&n| n > 0),
        "no data to protect: {before:?}"
    );
    let epoch = cluster.map().epoch;
    let endpoints = [
        ("unsigned", cluster.mgr_endpoint(None)),
        (
            "client",
            cluster.mgr_endpoint(Some(keys.creds("client.test", 1))),
        ),
    ];
    let first_port = free_ports(3);
    for (who, ep) in &endpoints {
        for k in 0..3u16 {
            let port = first_port + k;
            let boot = serde_json::json!({
                "uuid": format!("made-up-{k}"),
                "id": null,
                "addr": format!("127.0.0.1:{port}"),
                "shards": 1,
                "host": format!("evil-{k}"),
                "weight": 1e300,
                "metrics_addr": null,
            });
            let body = serde_json::to_vec(&boot).unwrap();
            for (method, path, body) in [
                ("POST", "/v1/osd/boot", body.clone()),
                ("POST", "/v1/osd/heartbeat", b"{}".to_vec()),
                ("POST", "/v1/pg/recovered", b"{}".to_vec()),
            ] {
                let (status, _) = flame_tests::mgr_call_as(ep, method, path, Some(&body))
                    .unwrap_or_else(|e| panic!("{who}: {e}"));
                assert!(
                    status == 401 || status == 403,
                    "{who}: {method} {path} answered {status}"
                );
            }
        }
    }
    assert_eq!(
        cluster.map().epoch,
        epoch,
        "a refused request changed the map"
    );
    // Past the stray delay: nothing was taken for a stray.
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(cluster.object_files_per_osd(vol.id), before);
    let report = cluster.admin_json(&["scrub", "real"]);
    assert_eq!(report["inconsistent"].as_u64(), Some(0), "{report}");
}

/// The lease rule across the two daemons (`flame_common::timing`): an OSD with the
/// default lease_ms 4000 + heartbeat_interval_ms 1000 against a manager whose
/// heartbeat_grace_ms is 5000 stops at boot with one error naming the options and
/// their values, and exits with status 2.
#[test]
fn an_osd_whose_lease_outlives_the_managers_grace_refuses_to_run() {
    let cluster = TestCluster::start_with(ClusterOptions {
        heartbeat_grace_ms: 5000,
        ..ClusterOptions::default()
    });
    let out = run_extra_osd(&cluster, "long-lease", None, None);
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    for part in [
        "lease_ms (4000)",
        "heartbeat_interval_ms (1000)",
        "heartbeat_grace_ms (5000)",
    ] {
        assert!(text.contains(part), "{part:?} missing:\n{text}");
    }
}
