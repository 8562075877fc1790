//! A cluster of real processes starts healthy, and `flame-admin` manages volumes
//! against it (human output and `--json`).

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::ids::{ObjectId, VolumeId};
use flame_common::placement;
use flame_tests::{TestCluster, output_text};
use serde_json::Value;

const GIB: u64 = 1 << 30;

#[test]
fn cluster_starts_healthy_with_three_osds() {
    let cluster = TestCluster::start();
    let st = cluster.status();
    assert_eq!(st.osds, 3, "{st:?}");
    assert_eq!(st.osds_up, 3, "{st:?}");
    assert_eq!(st.osds_in, 3, "{st:?}");
    assert_eq!(st.health, "HEALTH_OK", "{st:?}");
    assert_eq!(st.volumes, 0);
    assert_eq!(st.pool.size, 3);
    // Capacity arrives with the OSDs' heartbeats (every 500 ms in the harness).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while cluster.status().capacity_bytes == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "OSDs never reported their capacity: {:?}",
            cluster.status()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }

    // The map advertises every OSD with its shard count and distinct addresses.
    let map = cluster.map();
    assert_eq!(map.osds.len(), 3);
    let mut addrs: Vec<_> = map.osds.values().map(|o| o.addr).collect();
    addrs.sort();
    addrs.dedup();
    assert_eq!(addrs.len(), 3);
    for osd in map.osds.values() {
        assert_eq!(osd.shards, cluster.shards(), "{osd:?}");
        assert!(osd.up && osd.r#in, "{osd:?}");
    }

    // flame-admin status: human and JSON agree with the API.
    let human = cluster.admin_ok(&["status"]);
    assert!(human.contains("HEALTH_OK"), "{human}");
    let json = cluster.admin_json(&["status"]);
    assert_eq!(json["health"], "HEALTH_OK", "{json}");
    assert_eq!(json["osds_up"], 3, "{json}");
    assert_eq!(json["osds_in"], 3, "{json}");
    assert_eq!(json["epoch"], map.epoch.0, "{json}");

    // flame-admin osd ls --json: three OSDs, up and in.
    let osds = cluster.admin_json(&["osd", "ls"]);
    let osds = osds.as_array().unwrap_or_else(|| panic!("osd ls: {osds}"));
    assert_eq!(osds.len(), 3, "{osds:?}");
    for o in osds {
        assert_eq!(o["up"], true, "{o}");
        assert_eq!(o["in"], true, "{o}");
    }
    let human = cluster.admin_ok(&["osd", "ls"]);
    for id in map.osds.keys() {
        assert!(human.contains(&id.to_string()), "{id} missing in:\n{human}");
    }
}

fn volume_names(cluster: &TestCluster) -> Vec<String> {
    let ls = cluster.admin_json(&["volume", "ls"]);
    ls.as_array()
        .unwrap_or_else(|| panic!("volume ls --json is not an array: {ls}"))
        .iter()
        .map(|v| v["name"].as_str().unwrap_or_default().to_string())
        .collect()
}

#[test]
fn volume_lifecycle_through_flame_admin() {
    let cluster = TestCluster::start();

    let created = cluster.admin_json(&["volume", "create", "vol1", "--size", "10G"]);
    assert_eq!(created["name"], "vol1", "{created}");
    assert_eq!(created["size"], 10 * GIB, "{created}");
    assert_eq!(cluster.volume("vol1").size, 10 * GIB);

    // Duplicate names, bad names and bad sizes are refused with an error.
    for args in [
        &["volume", "create", "vol1", "--size", "1G"][..],
        &["volume", "create", "bad/name", "--size", "1G"][..],
        &["volume", "create", "vol2", "--size", "ten"][..],
    ] {
        let out = cluster.admin(args);
        assert!(
            !out.status.success(),
            "{args:?} must fail:\n{}",
            output_text(&out)
        );
        assert!(!out.stderr.is_empty(), "{args:?}: error must be explained");
    }

    cluster.admin_ok(&["volume", "create", "vol2", "--size", "512M"]);
    let mut names = volume_names(&cluster);
    names.sort();
    assert_eq!(names, ["vol1", "vol2"]);
    let human = cluster.admin_ok(&["volume", "ls"]);
    assert!(human.contains("vol1") && human.contains("vol2"), "{human}");

    let info = cluster.admin_json(&["volume", "info", "vol1"]);
    assert_eq!(info["size"], 10 * GIB, "{info}");
    assert!(info["id"].is_u64(), "{info}");
    let human = cluster.admin_ok(&["volume", "info", "vol1"]);
    assert!(human.contains("vol1"), "{human}");

    // Grow.
    let grown = cluster.admin_json(&["volume", "resize", "vol1", "--size", "20G"]);
    assert_eq!(grown["size"], 20 * GIB, "{grown}");
    assert_eq!(cluster.volume("vol1").size, 20 * GIB);
    // Shrinking needs the explicit flag.
    let out = cluster.admin(&["volume", "resize", "vol1", "--size", "5G"]);
    assert!(
        !out.status.success(),
        "shrink without --allow-shrink must fail:\n{}",
        output_text(&out)
    );
    assert_eq!(cluster.volume("vol1").size, 20 * GIB);
    let shrunk =
        cluster.admin_json(&["volume", "resize", "vol1", "--size", "5G", "--allow-shrink"]);
    assert_eq!(shrunk["size"], 5 * GIB, "{shrunk}");

    // Status counts volumes and provisioned bytes.
    let st = cluster.status();
    assert_eq!(st.volumes, 2);
    assert_eq!(st.provisioned_bytes, 5 * GIB + (512 << 20));

    // Remove.
    cluster.admin_ok(&["volume", "rm", "vol1"]);
    assert_eq!(volume_names(&cluster), ["vol2"]);
    let out = cluster.admin(&["volume", "info", "vol1"]);
    assert!(
        !out.status.success(),
        "info of a removed volume must fail:\n{}",
        output_text(&out)
    );
    let out = cluster.admin(&["volume", "rm", "vol1"]);
    assert!(!out.status.success(), "removing twice must fail");
    // A new volume with the old name gets a new id.
    let old_id = created["id"].as_u64();
    let again = cluster.admin_json(&["volume", "create", "vol1", "--size", "1G"]);
    assert_ne!(
        again["id"].as_u64(),
        old_id,
        "volume ids must not be reused"
    );
}

/// Reads an id that may be printed as `7`, as `"pg.7"` / `"osd.7"`, or as an
/// object with an `id` field.
fn id_number(v: &Value) -> Option<u64> {
    if v.is_object() {
        return id_number(&v["id"]);
    }
    v.as_u64().or_else(|| {
        v.as_str()
            .and_then(|s| s.rsplit('.').next())
            .and_then(|n| n.parse().ok())
    })
}

#[test]
fn locate_matches_the_placement_function() {
    let cluster = TestCluster::start();
    let vol = cluster.create_volume("loc", GIB);
    let map = cluster.map();
    let object_size = u64::from(map.pool.object_size);
    for offset in [0, object_size - 1, object_size, 5 * object_size + 12345] {
        let offset_arg = offset.to_string();
        let json = cluster.admin_json(&["locate", "loc", &offset_arg]);
        let object = ObjectId {
            volume: VolumeId(vol.id.0),
            index: offset / object_size,
        };
        let want = placement::locate(&map, object);
        assert_eq!(id_number(&json["pg"]), Some(u64::from(want.pg.0)), "{json}");
        let osds: Vec<u64> = json["osds"]
            .as_array()
            .unwrap_or_else(|| panic!("locate --json has no osds array: {json}"))
            .iter()
            .filter_map(id_number)
            .collect();
        let want_osds: Vec<u64> = want.osds.iter().map(|o| u64::from(o.0)).collect();
        assert_eq!(
            osds, want_osds,
            "acting set (primary first) for offset {offset}: {json}"
        );
    }
    // Beyond the end of the volume is an error, not a location.
    let out = cluster.admin(&["locate", "loc", &(2 * GIB).to_string()]);
    assert!(!out.status.success(), "{}", output_text(&out));
    // Human output names the placement group.
    let human = cluster.admin_ok(&["locate", "loc", "0"]);
    let pg = placement::locate(
        &map,
        ObjectId {
            volume: vol.id,
            index: 0,
        },
    )
    .pg;
    assert!(
        human.contains(&pg.0.to_string()),
        "locate output does not name {pg}:\n{human}"
    );
}

/// Runs `cat PATH` as the unprivileged user `nobody` (uid 65534, no groups):
/// what another local user gets when reading a daemon's file.
fn cat_as_nobody(path: &std::path::Path) -> std::process::Output {
    std::process::Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "cat"])
        .arg(path)
        .output()
        .unwrap_or_else(|e| panic!("setpriv (util-linux) is needed for this test: {e}"))
}

/// The volumes' bytes on the OSDs and the cluster's state on the manager are
/// their daemon's user's alone: data directories 0700, files 0600, and another
/// local user reading an object file is refused (docs/security.md, "Data at
/// rest").
#[test]
fn another_user_cannot_read_the_data_on_disk() {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: plain syscall.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test runs as root (as CI does), to act as another user"
    );
    let cluster = TestCluster::start();
    let vol = cluster.create_volume("private", 16 << 20);
    flame_tests::oracle::with_volume(&cluster.client_target(), "private", 0, |v| async move {
        v.write_at(0, &[0x5a; 4096], true).await.expect("write")
    })
    .expect("client");
    let object = cluster.object_path(0, vol.id, 0);
    let mode = |p: &std::path::Path| {
        std::fs::metadata(p)
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
            .mode()
            & 0o7777
    };
    assert_eq!(mode(&cluster.osd_data_dir(0)), 0o700, "an OSD's data_dir");
    assert_eq!(mode(&object), 0o600, "an object file");
    assert_eq!(
        mode(&cluster.mgr_data_dir()),
        0o700,
        "the manager's data_dir"
    );
    let state = cluster.mgr_data_dir().join("state.json");
    assert_eq!(mode(&state), 0o600, "the manager's state");
    // Even a file left 0644 (by an older version) cannot be reached through
    // the closed directory.
    std::fs::set_permissions(&object, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    for path in [&object, &state] {
        let out = cat_as_nobody(path);
        assert!(
            !out.status.success() && out.stdout.is_empty(),
            "another user read {}: {} bytes",
            path.display(),
            out.stdout.len()
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("Permission denied"), "{err}");
    }
    // Root (the daemons' user here) still reads it: the refusal above is the
    // modes', not a missing file.
    let data = cluster
        .object_data(0, vol.id, 0)
        .expect("object 0 on osd.0");
    assert!(data[..4096].iter().all(|&b| b == 0x5a));
}
