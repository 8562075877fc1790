//! An OSD the manager must not register is refused before anything is recorded,
//! and the OSD says why and exits with status 2.
//!
//! Two cases, both seen in practice: a data directory from another (old dev)
//! cluster, whose OSD used to be registered and only then noticed the mismatch,
//! leaving a ghost `in`/`down` OSD that degraded placement groups and made FLUSH
//! fail; and a second OSD advertising an address a live OSD already holds.

use flame_tests::{TestCluster, free_ports, output_text, run_bounded};
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
#[test]
fn an_osd_with_its_own_key_stops_before_it_boots_where_it_gets_no_service_key() {
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
    let out = run_extra_osd_with(&cluster, "own-key", None, None, Some(keyring));
    let text = output_text(&out);
    assert_eq!(out.status.code(), Some(2), "{text}");
    assert!(
        text.contains("service key") && text.contains("auth: none"),
        "the refusal must say why: {text}"
    );
    let after = cluster.map();
    assert_eq!(
        after.osds.len(),
        before.osds.len(),
        "it was registered: {after:?}"
    );
    assert_eq!(after.epoch, before.epoch, "its start changed the map");
}
