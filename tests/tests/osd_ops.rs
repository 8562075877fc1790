//! Operator commands on OSDs with the real daemons (`flame-admin osd out / in /
//! reweight / rm`), and removing a volume while an OSD is down: the OSD deletes its
//! copies from the map's tombstone when it comes back.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::ids::{OsdId, VolumeId};
use flame_tests::{ClusterOptions, TestCluster, output_text};
use std::path::Path;
use std::time::{Duration, Instant};

/// The OSD id of the cluster's `i`-th OSD process.
fn osd_id(cluster: &TestCluster, i: usize) -> OsdId {
    let addr = cluster.osd_addr(i, 0);
    cluster
        .map()
        .osds
        .values()
        .find(|o| o.addr == addr)
        .unwrap_or_else(|| panic!("OSD process {i} ({addr}) is not in the map"))
        .id
}

fn wait_for(what: &str, cluster: &TestCluster, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(
            Instant::now() < deadline,
            "{what} did not happen\n{}",
            cluster.log_tails()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Object files of `volume` in an OSD's data directory.
fn objects_of(data_dir: &Path, volume: VolumeId) -> usize {
    let prefix = format!("{:016x}.", volume.0);
    let Ok(pgs) = std::fs::read_dir(data_dir.join("pgs")) else {
        return 0;
    };
    pgs.flatten()
        .filter_map(|pg| std::fs::read_dir(pg.path()).ok())
        .flat_map(|files| files.flatten())
        .filter(|f| f.file_name().to_string_lossy().starts_with(&prefix))
        .count()
}

#[test]
fn osd_out_in_reweight_and_rm_from_the_cli() {
    let mut cluster = TestCluster::start_with(ClusterOptions {
        osds: 4,
        heartbeat_grace_ms: 2000,
        pg_count: 64,
        ..ClusterOptions::default()
    });
    cluster.wait_osds_up(4);
    cluster.create_volume("ops", 64 << 20);
    let id = osd_id(&cluster, 3);
    let name = id.to_string();
    let num = id.0.to_string();

    let r = cluster.admin_json(&["osd", "out", &name]);
    assert_eq!(r["changed"], true, "{r}");
    let map = cluster.map();
    assert!(!map.osds[&id].r#in);
    assert!(
        !map.pg_complete.is_empty(),
        "out must record where the data of the moved groups is"
    );
    let text = cluster.admin_ok(&["osd", "out", &num]);
    assert!(text.contains("already"), "{text}");
    let text = cluster.admin_ok(&["osd", "in", &num]);
    assert!(text.contains(&format!("{id} is in")), "{text}");
    assert!(cluster.map().osds[&id].r#in);
    let r = cluster.admin_json(&["osd", "reweight", &num, "0.5"]);
    assert_eq!(r["changed"], true, "{r}");
    assert_eq!(cluster.map().osds[&id].weight, 0.5);

    // Clear errors: unknown id, rm of an up OSD, a bad weight (usage error).
    let out = cluster.admin(&["osd", "out", "osd.99"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        output_text(&out).contains("no osd.99"),
        "{}",
        output_text(&out)
    );
    let out = cluster.admin(&["osd", "rm", &name, "--json"]);
    assert_eq!(out.status.code(), Some(1));
    let err: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(err["error"].as_str().unwrap().contains("is up"), "{err}");
    let out = cluster.admin(&["osd", "reweight", &num, "1000"]);
    assert_eq!(out.status.code(), Some(2), "{}", output_text(&out));

    // Down, then removed: gone from the map, the others carry on.
    cluster.kill_osd(3);
    wait_for("osd marked down", &cluster, || !cluster.map().osds[&id].up);
    let r = cluster.admin_json(&["osd", "rm", &name]);
    assert_eq!(r["changed"], true, "{r}");
    assert!(
        r.get("lost_pgs").is_none(),
        "nothing lost with 3 copies: {r}"
    );
    let map = cluster.map();
    assert!(!map.osds.contains_key(&id));
    assert!(map.pg_complete.values().all(|c| !c.contains(&id)));
    let st = cluster.status();
    assert_eq!((st.osds, st.osds_up), (3, 3), "{st:?}");
}

#[test]
fn a_volume_removed_while_an_osd_is_down_is_deleted_there_when_it_is_back() {
    let mut cluster = TestCluster::start_with(ClusterOptions {
        heartbeat_grace_ms: 2000,
        pg_count: 32,
        ..ClusterOptions::default()
    });
    cluster.wait_osds_up(3);
    let vol = cluster.create_volume("doomed", 32 << 20);
    let keep = cluster.create_volume("kept", 8 << 20);
    for v in ["doomed", "kept"] {
        cluster.admin_ok(&[
            "bench",
            v,
            "--rw",
            "write",
            "--bs",
            "64k",
            "--iodepth",
            "4",
            "--runtime",
            "300ms",
            "--force-overwrite",
        ]);
    }
    let held: Vec<usize> = (0..3)
        .map(|i| objects_of(&cluster.osd_data_dir(i), vol.id))
        .collect();
    assert!(
        held.iter().all(|&n| n > 0),
        "every OSD holds some: {held:?}"
    );
    let kept_before = objects_of(&cluster.osd_data_dir(2), keep.id);
    assert!(kept_before > 0);

    let id = osd_id(&cluster, 2);
    cluster.kill_osd(2);
    wait_for("osd marked down", &cluster, || !cluster.map().osds[&id].up);
    let text = cluster.admin_ok(&["volume", "rm", "doomed"]);
    assert!(
        text.contains(&format!("{id} (down) will delete theirs")),
        "{text}"
    );
    assert!(cluster.map().deleted_volumes.contains(&vol.id));
    for i in 0..2 {
        assert_eq!(objects_of(&cluster.osd_data_dir(i), vol.id), 0, "osd {i}");
    }
    assert_eq!(
        objects_of(&cluster.osd_data_dir(2), vol.id),
        held[2],
        "the down OSD kept its copies"
    );

    // A shrink goes on with the OSD down too: its trim completes (the down member
    // gets the discards through recovery).
    let r = cluster.admin_json(&["volume", "resize", "kept", "--size", "4M", "--allow-shrink"]);
    assert_eq!(r["size"], 4 << 20, "{r}");
    let (code, body) = cluster.api_get("/v1/volumes/kept/trim").unwrap();
    assert_eq!(code, 200, "{body}");
    let trim: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert!(trim["pending"].is_null(), "{trim}");

    cluster.restart_osd(2);
    wait_for(
        "the restarted OSD deleting the removed volume",
        &cluster,
        || objects_of(&cluster.osd_data_dir(2), vol.id) == 0,
    );
    // (Its object past the new end may go through recovery; object 0 stays.)
    assert!(
        objects_of(&cluster.osd_data_dir(2), keep.id) > 0,
        "only the removed volume is deleted"
    );
}
