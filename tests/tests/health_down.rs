//! With an OSD down, health says what happens to I/O — writes to its placement
//! groups wait, reads wait only where it is the primary — with the true counts and
//! the volumes concerned, and the part about reads holds on the data path.

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
    let primary = sets.iter().filter(|s| s[0] == dead).count();
    assert_eq!(st.health, "HEALTH_ERR", "{st:?}");
    let line = st
        .health_detail
        .iter()
        .find(|d| d.contains("writes to them wait"))
        .unwrap_or_else(|| panic!("{:?}", st.health_detail));
    assert!(
        line.starts_with(&format!(
            "{holding} of {} placement groups have a down OSD ({dead})",
            map.pool.pg_count
        )),
        "{line}"
    );
    assert!(
        line.contains(&format!(
            "reads wait in the {primary} of them whose primary is down"
        )),
        "{line}"
    );
    let objects: Vec<_> = (0..16u64)
        .map(|index| {
            let o = ObjectId {
                volume: vol.id,
                index,
            };
            (index, placement::locate(&map, o).osds)
        })
        .collect();
    let hit = objects.iter().filter(|(_, s)| s.contains(&dead)).count();
    assert!(
        st.health_detail.contains(&format!(
            "volume hv: {hit} of its 16 objects are in those placement groups"
        )),
        "{:?}",
        st.health_detail
    );
    // "the others' reads are served": an object whose replica (not primary) is the
    // down OSD reads back at once.
    if let Some((index, _)) = objects
        .iter()
        .find(|(_, s)| s.contains(&dead) && s[0] != dead)
    {
        // Read-only (`-r`): qemu flushes a writable image when it closes it, and a
        // FLUSH waits for the down OSD — as health says.
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
            "a read with only a replica down waited {:?}",
            started.elapsed()
        );
    }
}
