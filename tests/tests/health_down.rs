//! With an OSD down, health says what happens to I/O — its placement groups are
//! degraded and I/O goes on with the two copies that are up — with the true
//! counts, and that holds on the data path: reads and writes to objects of those
//! groups (also where the down OSD was the primary) complete at once.

use flame_common::ids::{ObjectId, PgId};
use flame_common::placement;
use flame_tests::{
    ClusterOptions, TOOL_TIMEOUT, TestCluster, output_text, require_tool, run_bounded,
};
use std::process::Command;
use std::time::{Duration, Instant};

const OBJECT: u64 = 4 << 20;

#[test]
fn health_says_what_a_down_osd_does_to_io() {
    let mut cluster = TestCluster::start_with(ClusterOptions {
        osds: 4,
        nbd: true,
        heartbeat_grace_ms: 2000,
        ..ClusterOptions::default()
    });
    let vol = cluster.create_volume("hv", 16 * OBJECT);
    cluster.wait_nbd_export("hv");
    cluster.qemu_io("hv", &["write -P 0x5a 0 64M", "flush"]);
    assert_eq!(cluster.status().health, "HEALTH_OK");

    cluster.kill_osd(1);
    let addr = cluster.osd_addr(1, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    let (map, st) = loop {
        let map = cluster.map();
        let down = map.osds.values().any(|o| o.addr == addr && !o.up);
        if down {
            break (map, cluster.status());
        }
        assert!(Instant::now() < deadline, "osd.1 never marked down");
        std::thread::sleep(Duration::from_millis(200));
    };
    let dead = map.osds.values().find(|o| o.addr == addr).unwrap().id;
    let sets: Vec<_> = (0..map.pool.pg_count)
        .map(|pg| placement::pg_osds(&map, PgId(pg)))
        .collect();
    let holding = sets.iter().filter(|s| s.contains(&dead)).count();
    assert_eq!(st.health, "HEALTH_WARN", "{st:?}");
    assert!(
        st.health_detail.contains(&format!("{dead} is down")),
        "{st:?}"
    );
    let line = st
        .health_detail
        .iter()
        .find(|d| d.contains("degraded"))
        .unwrap_or_else(|| panic!("{:?}", st.health_detail));
    assert_eq!(
        line,
        &format!(
            "{holding} of {} placement groups are degraded (fewer than pool.size 3 complete \
             copies up): I/O goes on with the copies that are up",
            map.pool.pg_count
        )
    );
    assert!(
        !st.health_detail.iter().any(|d| d.contains("waits")),
        "nothing waits with 2 of 3 copies up: {:?}",
        st.health_detail
    );

    // On the data path: objects whose group holds the down OSD — as primary and
    // as replica — are read and written at once.
    let objects: Vec<_> = (0..16u64)
        .map(|index| {
            let o = ObjectId {
                volume: vol.id,
                index,
            };
            (index, placement::locate(&map, o).osds)
        })
        .collect();
    let as_primary = objects.iter().find(|(_, s)| s[0] == dead);
    let as_replica = objects
        .iter()
        .find(|(_, s)| s.contains(&dead) && s[0] != dead);
    for (index, _) in [as_primary, as_replica].into_iter().flatten() {
        let at = index * OBJECT;
        let started = Instant::now();
        let out = run_bounded(
            Command::new(require_tool("qemu-io"))
                .args(["-f", "raw"])
                .arg(cluster.nbd_uri("hv"))
                .arg("-c")
                .arg(format!("read -P 0x5a {at} 4096"))
                .arg("-c")
                .arg(format!("write -P 0x6b {} 4096", at + 8192))
                .arg("-c")
                .arg("flush")
                .arg("-c")
                .arg(format!("read -P 0x6b {} 4096", at + 8192)),
            TOOL_TIMEOUT,
        );
        let text = output_text(&out);
        assert!(
            out.status.success() && !text.contains("failed") && !text.contains("Pattern"),
            "I/O to object {index}: {text}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "I/O with one copy down waited {:?}",
            started.elapsed()
        );
    }
}
