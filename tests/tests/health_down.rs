//! With OSDs down, health, `flame-admin status`, `pg ls`, `pg info`, `status
//! --watch` and the manager's metrics say what happens to I/O, with the true
//! counts computed from the map: one OSD of three copies down leaves its placement
//! groups `active+degraded` (HEALTH_WARN, reads are served), a second one puts the
//! groups that had both below min_size (`inactive`, HEALTH_ERR, the volumes
//! named), and every view agrees with the others.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::ids::{ObjectId, OsdId};
use flame_common::map::ClusterMap;
use flame_common::mgr_api::{ClusterStatus, PgStatus};
use flame_common::placement::{self, PgTable};
use flame_tests::{
    ClusterOptions, TOOL_TIMEOUT, TestCluster, http_get, output_text, require_tool, run_bounded,
};
use std::process::Command;
use std::time::{Duration, Instant};

const OBJECT: u64 = 4 << 20;

/// Waits (bounded) until the OSD process `i` is down in the map; returns its id
/// and the map.
fn wait_down(cluster: &TestCluster, i: usize) -> (OsdId, ClusterMap) {
    let addr = cluster.osd_addr(i, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let map = cluster.map();
        if let Some(o) = map.osds.values().find(|o| o.addr == addr && !o.up) {
            return (o.id, map);
        }
        assert!(Instant::now() < deadline, "OSD {i} never marked down");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// `pg ls --json` and `status --json` of one epoch (retried until both agree on
/// it, since the map may move between the two calls).
fn pgs_and_status(cluster: &TestCluster) -> (Vec<PgStatus>, ClusterStatus) {
    for _ in 0..50 {
        let pgs: Vec<PgStatus> = serde_json::from_value(cluster.admin_json(&["pg", "ls"])).unwrap();
        let st: ClusterStatus = serde_json::from_value(cluster.admin_json(&["status"])).unwrap();
        if pgs.iter().all(|p| p.epoch == st.epoch) {
            return (pgs, st);
        }
    }
    panic!("the map kept changing");
}

/// Sum of the samples of `name` whose labels contain `label` in Prometheus text.
fn sample(text: &str, name: &str, label: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.strip_prefix(name))
        .filter(|rest| rest.starts_with(label) || (label.is_empty() && rest.starts_with(' ')))
        .filter_map(|rest| rest.rsplit(' ').next()?.parse::<f64>().ok())
        .reduce(|a, b| a + b)
}

#[test]
fn health_and_pg_states_say_what_down_osds_do_to_io() {
    let mut cluster = TestCluster::start_with(ClusterOptions {
        osds: 4,
        nbd: true,
        heartbeat_grace_ms: 2000,
        pg_count: 64,
        ..ClusterOptions::default()
    });
    let vol = cluster.create_nbd_volume("hv", 16 * OBJECT);
    cluster.qemu_io("hv", &["write -P 0x5a 0 64M", "flush"]);
    let (pgs, st) = pgs_and_status(&cluster);
    assert_eq!(st.health, "HEALTH_OK", "{st:?}");
    assert_eq!(pgs.len(), 64);
    assert!(pgs.iter().all(|p| p.state == "active+clean"), "{pgs:?}");
    assert_eq!(st.pgs_by_state.get("active+clean"), Some(&64));

    // Not a terminal: one plain line per redraw, no escape codes, bounded by
    // --count.
    let out = cluster.admin_ok(&["status", "--watch", "--interval-ms", "200", "--count", "3"]);
    assert_eq!(out.lines().count(), 3, "{out}");
    assert!(!out.contains('\x1b'), "{out:?}");
    assert!(
        out.lines()
            .all(|l| l.contains("HEALTH_OK epoch") && l.contains("pgs 64 active+clean")),
        "{out}"
    );

    // With --json: one status object per line.
    let out = cluster.admin_ok(&[
        "status",
        "--watch",
        "--interval-ms",
        "100",
        "--count",
        "2",
        "--json",
    ]);
    let lines: Vec<ClusterStatus> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(lines.iter().all(|s| s.pg_summary.clean == 64), "{out}");

    // ---- One OSD down: its groups go on with two complete copies.
    cluster.kill_osd(1);
    let (dead, map) = wait_down(&cluster, 1);
    let (pgs, st) = pgs_and_status(&cluster);
    let table = PgTable::new(&cluster.map());
    let holding = table
        .iter()
        .filter(|(_, m)| m.placed.contains(&dead))
        .count();
    assert!(holding > 0 && holding < 64, "{holding}");
    assert_eq!(st.health, "HEALTH_WARN", "{st:?}");
    assert_eq!(st.pg_summary.degraded as usize, holding, "{st:?}");
    assert_eq!(st.pg_summary.inactive, 0, "{st:?}");
    assert!(
        st.health_detail.contains(&format!(
            "{holding} of 64 placement groups are degraded (fewer than pool.size 3 \
             complete copies up): I/O goes on with the copies that are up"
        )),
        "{:?}",
        st.health_detail
    );
    assert!(
        !st.health_detail.iter().any(|d| d.contains("waits")),
        "nothing waits with 2 of 3 copies up: {:?}",
        st.health_detail
    );
    for p in &pgs {
        let placed_there = p.placed.contains(&dead);
        assert_eq!(
            p.state,
            if placed_there {
                "active+degraded"
            } else {
                "active+clean"
            },
            "{p:?}"
        );
        assert!(!p.acting.contains(&dead), "{p:?}");
        assert_eq!(p.primary, p.acting.first().copied());
    }
    let degraded: Vec<PgStatus> =
        serde_json::from_value(cluster.admin_json(&["pg", "ls", "--state", "degraded"])).unwrap();
    assert_eq!(degraded.len(), holding);
    let text = cluster.admin_ok(&["pg", "ls", "--state", "active+degraded"]);
    assert_eq!(text.lines().count(), holding + 1, "{text}");
    assert!(text.starts_with("PG  STATE"), "{text}");
    // The table view of status names the states too.
    let text = cluster.admin_ok(&["status"]);
    assert!(
        text.contains(&format!("{holding} active+degraded"))
            && text.contains("objects   ")
            && text.contains(" degraded, "),
        "{text}"
    );
    // pg info: roles, and the primary's log bounds or why they are unavailable;
    // never a failure.
    let one = &degraded[0];
    let text = cluster.admin_ok(&["pg", "info", &one.pg.0.to_string()]);
    assert!(text.contains("state          active+degraded"), "{text}");
    assert!(
        text.contains("log bounds     seq ")
            || text.contains("log bounds     empty")
            || text.contains("log bounds     unavailable ("),
        "{text}"
    );
    let info = cluster.admin_json(&["pg", "info", &format!("pg.{}", one.pg.0)]);
    assert_eq!(info["state"], "active+degraded");
    assert!(
        info["log"].is_object() || info["log_unavailable"].is_string(),
        "{info}"
    );
    // Metrics: the same counts.
    let (code, metrics) = http_get(cluster.mgr_addr(), "/metrics").unwrap();
    assert_eq!(code, 200);
    assert_eq!(
        sample(&metrics, "flame_mgr_pgs", "{state=\"active+degraded\"}"),
        Some(holding as f64),
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, "flame_mgr_pgs_degraded", ""),
        Some(holding as f64)
    );
    assert_eq!(
        sample(&metrics, "flame_mgr_osds", "{state=\"down\"}"),
        Some(1.0)
    );
    assert_eq!(
        sample(&metrics, "flame_mgr_osds", "{state=\"out\"}"),
        Some(0.0)
    );
    assert!(sample(&metrics, "flame_mgr_objects_to_recover", "").is_some());
    assert!(sample(&metrics, "flame_mgr_recovery_bytes_per_second", "").is_some());

    // "I/O continues": an object in a degraded group reads back at once.
    let objects: Vec<(u64, Vec<OsdId>)> = (0..16u64)
        .map(|index| {
            let o = ObjectId {
                volume: vol.id,
                index,
            };
            (index, placement::locate(&map, o).osds)
        })
        .collect();
    if let Some((index, _)) = objects.iter().find(|(_, s)| s.contains(&dead)) {
        // Read-only (`-r`): nothing to flush when qemu closes the image.
        let started = Instant::now();
        let out = run_bounded(
            Command::new(require_tool("qemu-io"))
                .args(["-r", "-f", "raw"])
                .arg(cluster.nbd_uri("hv"))
                .arg("-c")
                .arg(format!("read -P 0x5a {} 4096", index * OBJECT)),
            TOOL_TIMEOUT,
        );
        let text = output_text(&out);
        assert!(
            out.status.success() && !text.contains("failed"),
            "read of object {index}: {text}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "a read in a degraded group waited {:?}",
            started.elapsed()
        );
    }

    // ---- A second OSD down: groups that had both are below min_size.
    cluster.kill_osd(2);
    let (dead2, _) = wait_down(&cluster, 2);
    let (pgs, st) = pgs_and_status(&cluster);
    let table = PgTable::new(&cluster.map());
    let waiting: Vec<u32> = table
        .iter()
        .filter(|(_, m)| !m.active)
        .map(|(pg, _)| pg.0)
        .collect();
    let both = table
        .iter()
        .filter(|(_, m)| m.placed.contains(&dead) && m.placed.contains(&dead2))
        .count();
    assert_eq!(waiting.len(), both, "groups holding both wait, no others");
    assert!(both > 0);
    assert_eq!(st.health, "HEALTH_ERR", "{st:?}");
    assert_eq!(st.pg_summary.inactive as usize, both);
    let line = st
        .health_detail
        .iter()
        .find(|d| d.contains("inactive"))
        .unwrap_or_else(|| panic!("{:?}", st.health_detail));
    assert!(
        line.starts_with(&format!(
            "{both} of 64 placement groups have fewer than pool.min_size 2 complete copies \
             up: I/O to them waits (no error, no stale data)"
        )),
        "{line}"
    );
    let inactive: Vec<&PgStatus> = pgs
        .iter()
        .filter(|p| p.state.starts_with("inactive"))
        .collect();
    assert_eq!(
        inactive.iter().map(|p| p.pg.0).collect::<Vec<_>>(),
        waiting,
        "{inactive:?}"
    );
    // The group waits for the copy that stayed complete (the manager's rule).
    assert!(
        inactive.iter().all(|p| p.down_complete.contains(&dead2)),
        "{inactive:?}"
    );
    let hit = objects
        .iter()
        .filter(|(_, s)| s.contains(&dead) && s.contains(&dead2))
        .count();
    if hit > 0 {
        assert!(
            st.health_detail.contains(&format!(
                "volume hv: {hit} of its 16 objects are in those placement groups"
            )),
            "{:?}",
            st.health_detail
        );
    }

    // On a terminal, the watch clears the screen and draws the status with a
    // progress line (`script` gives it a pseudo-terminal).
    if let Ok(script) = which("script") {
        let keyring = cluster
            .keyring("client.admin")
            .map(|k| format!("--keyring {}", k.display()))
            .unwrap_or_default();
        let cmd = format!(
            "{} --mgr {} {keyring} status --watch --interval-ms 200 --count 2",
            cluster.bin("flame-admin").display(),
            cluster.mgr_addr()
        );
        let out = run_bounded(
            Command::new(script).args(["-qec", &cmd, "/dev/null"]),
            TOOL_TIMEOUT,
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{}", output_text(&out));
        assert_eq!(text.matches("\x1b[H\x1b[2J").count(), 2, "{text:?}");
        assert!(
            text.contains("HEALTH_ERR") && text.contains("progress  "),
            "{text}"
        );
        assert!(
            text.contains(&format!("{both} inactive+degraded")),
            "{text}"
        );
    }

    // Both back: nothing waits any more. The groups that went on without them
    // show them recovering until the recovery engine reports them complete.
    cluster.restart_osd(1);
    cluster.restart_osd(2);
    cluster.wait_osds_up(4);
    let (pgs, st) = pgs_and_status(&cluster);
    assert_eq!(st.pg_summary.inactive, 0, "{st:?}");
    for p in &pgs {
        assert_eq!(
            p.state.contains("recovering"),
            !p.recovering.is_empty(),
            "{p:?}"
        );
    }
    assert_ne!(st.health, "HEALTH_ERR", "{st:?}");
    // The metric follows: a state no group is in any more is not exported with
    // its old count, and the counts add up to the pool's groups.
    let (_, metrics) = http_get(cluster.mgr_addr(), "/metrics").unwrap();
    assert_eq!(
        sample(&metrics, "flame_mgr_pgs", "{state=\"inactive+degraded\"}"),
        None,
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, "flame_mgr_pgs", "{"),
        Some(64.0),
        "{metrics}"
    );
}

fn which(tool: &str) -> Result<std::path::PathBuf, ()> {
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join(tool))
                .find(|p| p.is_file())
        })
        .ok_or(())
}
