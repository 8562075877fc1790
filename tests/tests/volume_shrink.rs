//! A shrunk volume that grows again reads zeroes past its old end: shrinking removes
//! the cut-off bytes on every copy before it is acknowledged, and a shrink whose
//! trim did not happen (a crash between the two) blocks growth until a resize
//! completes the trim.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_tests::{ClusterOptions, TestCluster, output_text, require_tool, run_bounded};
use std::process::Command;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;
const OBJECT: u64 = 4 * MIB;

/// Waits (bounded) until flame-nbd serves `volume` with `size` bytes: it learns a
/// resize from the next map.
fn wait_export_size(cluster: &TestCluster, volume: &str, size: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = run_bounded(
            Command::new(require_tool("nbdinfo"))
                .arg("--size")
                .arg(cluster.nbd_uri(volume)),
            Duration::from_secs(30),
        );
        let got = String::from_utf8_lossy(&out.stdout).trim().to_string();
        if got == size.to_string() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "export {volume} still has size {got:?}, want {size}\n{}",
            output_text(&out)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Bytes `[offset, offset + len)` of object `index` of the volume on OSD `osd`'s
/// disk (docs/on-disk-format.md), missing bytes (no file, past its end, holes) as
/// zero.
fn on_disk(
    cluster: &TestCluster,
    osd: usize,
    vol: &flame_common::map::VolumeInfo,
    index: u64,
    offset: u64,
    len: u64,
) -> Vec<u8> {
    let mut out = vec![0u8; len as usize];
    if let Ok(file) = std::fs::read(cluster.object_path(osd, vol.id, index)) {
        // Object data follows the file's header and checksum area.
        let offset = offset as usize + flame_tests::OBJECT_DATA_OFFSET;
        if file.len() > offset {
            let n = (file.len() - offset).min(out.len());
            out[..n].copy_from_slice(&file[offset..offset + n]);
        }
    }
    out
}

#[test]
fn shrink_then_grow_reads_zeroes_past_the_old_end() {
    let cluster = TestCluster::start_with(ClusterOptions::with_nbd());
    let vol = cluster.create_nbd_volume("shrinky", 16 * MIB);
    // Data that stays (object 2 up to the new end) and data past the new end: the
    // partial tail of object 2 and all of object 3.
    let new_end = 2 * OBJECT + 512 * 1024;
    cluster.qemu_io(
        "shrinky",
        &[
            &format!("write -P 0xcd {} {}", 2 * OBJECT, new_end - 2 * OBJECT),
            &format!("write -P 0xab {new_end} {}", 16 * MIB - new_end),
            "flush",
        ],
    );
    // Before the shrink, every copy holds the old bytes (the check below can fail).
    for osd in 0..cluster.osd_count() {
        assert!(
            on_disk(&cluster, osd, &vol, 3, 0, OBJECT)
                .iter()
                .all(|&b| b == 0xab)
        );
    }

    cluster.admin_ok(&[
        "volume",
        "resize",
        "shrinky",
        "--size",
        &new_end.to_string(),
        "--allow-shrink",
    ]);
    // Acknowledged: the old bytes are gone from every copy.
    for osd in 0..cluster.osd_count() {
        let tail = on_disk(
            &cluster,
            osd,
            &vol,
            2,
            new_end - 2 * OBJECT,
            2 * OBJECT + OBJECT - new_end,
        );
        assert!(
            tail.iter().all(|&b| b == 0),
            "osd.{osd}: object 2 keeps old bytes past the new end"
        );
        let last = on_disk(&cluster, osd, &vol, 3, 0, OBJECT);
        assert!(
            last.iter().all(|&b| b == 0),
            "osd.{osd}: object 3 keeps old bytes"
        );
        let kept = on_disk(&cluster, osd, &vol, 2, 0, new_end - 2 * OBJECT);
        assert!(
            kept.iter().all(|&b| b == 0xcd),
            "osd.{osd}: data below the new end was lost"
        );
    }
    assert_eq!(
        cluster.status().health,
        "HEALTH_OK",
        "{:?}",
        cluster.status().health_detail
    );

    cluster.admin_ok(&["volume", "resize", "shrinky", "--size", "16M"]);
    wait_export_size(&cluster, "shrinky", 16 * MIB);
    cluster.qemu_io(
        "shrinky",
        &[
            &format!("read -P 0xcd {} {}", 2 * OBJECT, new_end - 2 * OBJECT),
            &format!("read -P 0 {new_end} {}", 16 * MIB - new_end),
        ],
    );
}

#[test]
fn an_interrupted_shrink_blocks_growth_until_its_trim_completes() {
    let cluster = TestCluster::start_with(ClusterOptions::with_nbd());
    cluster.create_nbd_volume("cut", 16 * MIB);
    cluster.qemu_io("cut", &["write -P 0x77 0 16M", "flush"]);
    // A shrink recorded by the manager whose client died before trimming: the API
    // call alone, as a crashed flame-admin would have left it.
    let resp = cluster.mgr_post(
        "/v1/volumes/cut/resize",
        &serde_json::json!({"size": 4 * MIB, "allow_shrink": true}),
    );
    assert!(matches!(resp, Ok((200, _))), "{resp:?}");
    let st = cluster.status();
    assert_eq!(st.health, "HEALTH_WARN");
    assert!(
        st.health_detail
            .iter()
            .any(|d| d.contains("volume cut was shrunk")),
        "{st:?}"
    );
    // Growing through the API alone is refused: it would show the old bytes.
    match cluster.mgr_post(
        "/v1/volumes/cut/resize",
        &serde_json::json!({"size": 16 * MIB}),
    ) {
        Ok((409, _)) => {}
        other => panic!("grow with a pending trim: {other:?}"),
    }
    // flame-admin completes the trim first, then grows.
    cluster.admin_ok(&["volume", "resize", "cut", "--size", "16M"]);
    assert_eq!(cluster.status().health, "HEALTH_OK");
    wait_export_size(&cluster, "cut", 16 * MIB);
    cluster.qemu_io("cut", &["read -P 0x77 0 4M", "read -P 0 4M 12M"]);
}
