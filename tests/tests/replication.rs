//! A write through flame-nbd lands, byte for byte, in the object file of every OSD
//! of the acting set (all three OSDs of a three-OSD cluster).
//!
//! Relies on the on-disk layout of docs/on-disk-format.md:
//! `data_dir/pgs/<pg: 8 hex>/<volume id: 16 hex>.<object index: 16 hex>`, byte
//! `OBJECT_DATA_OFFSET + k` of the file = byte `k` of the object, missing bytes read
//! as zero.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::ids::ObjectId;
use flame_common::placement;
use flame_tests::{ClusterOptions, TOOL_TIMEOUT, TestCluster, pattern, require_tool, run_ok};
use std::process::Command;

const MIB: usize = 1 << 20;
const OBJECT: usize = 4 * MIB;

/// The object file's bytes `[offset, offset + len)`, with missing bytes as zero.
fn object_bytes(
    cluster: &TestCluster,
    osd: usize,
    path: &std::path::Path,
    offset: usize,
    len: usize,
) -> Vec<u8> {
    let file = std::fs::read(path).unwrap_or_else(|e| {
        panic!(
            "osd.{osd}: object file {} unreadable: {e}\n{}",
            path.display(),
            cluster.log_tails()
        )
    });
    let mut out = vec![0u8; len];
    let offset = offset + flame_tests::OBJECT_DATA_OFFSET;
    if file.len() > offset {
        let n = (file.len() - offset).min(len);
        out[..n].copy_from_slice(&file[offset..offset + n]);
    }
    out
}

#[test]
fn written_bytes_are_on_all_three_osds() {
    let cluster = TestCluster::start_with(ClusterOptions::with_nbd());
    let vol = cluster.create_nbd_volume("rep", 32 * MIB as u64);

    // Object 1, offset 512 KiB: 1 MiB of pseudo-random data (unique per byte range,
    // so a misplaced or shifted copy cannot match), written with qemu-img from a file.
    let data = pattern(0x5eed, MIB);
    let offset_in_object = 512 * 1024;
    let volume_offset = OBJECT + offset_in_object;
    let mut image = vec![0u8; 8 * MIB];
    image[volume_offset..volume_offset + MIB].copy_from_slice(&data);
    // Object 0 gets a fixed pattern at its start, so two objects are checked.
    image[..4096].fill(0xa5);
    let src = cluster.dir().join("rep.raw");
    std::fs::write(&src, &image).unwrap();
    run_ok(
        Command::new(require_tool("qemu-img"))
            .args(["convert", "-n", "-f", "raw", "-O", "raw", "-t", "none"])
            .arg(&src)
            .arg(cluster.nbd_uri("rep")),
        TOOL_TIMEOUT,
    );

    let map = cluster.map();
    for (index, at, want) in [
        (1u64, offset_in_object, &data[..]),
        (0u64, 0, &image[..4096]),
    ] {
        let object = ObjectId {
            volume: vol.id,
            index,
        };
        let loc = placement::locate(&map, object);
        assert_eq!(loc.osds.len(), 3, "acting set of {object}: {loc:?}");
        for osd in 0..cluster.osd_count() {
            let path = cluster.object_path(osd, vol.id, index);
            let got = object_bytes(&cluster, osd, &path, at, want.len());
            if got != want {
                let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
                panic!(
                    "osd.{osd}: {} differs from what was written, first at byte {} of the range",
                    path.display(),
                    i
                );
            }
            // Bytes around the written range were never written: zero.
            let before = object_bytes(&cluster, osd, &path, at.saturating_sub(4096), at.min(4096));
            assert!(
                before.iter().all(|&b| b == 0),
                "osd.{osd}: bytes before the write are not zero"
            );
        }
    }
    // Object 2 was covered by the image but all zero: whatever the OSDs keep for it,
    // it must read as zero.
    for osd in 0..cluster.osd_count() {
        let path = cluster.object_path(osd, vol.id, 2);
        if path.exists() {
            let got = object_bytes(&cluster, osd, &path, 0, 64 * 1024);
            assert!(
                got.iter().all(|&b| b == 0),
                "osd.{osd}: object 2 is not zero"
            );
        }
    }
}

#[test]
fn volume_rm_deletes_objects_on_every_osd() {
    let cluster = TestCluster::start_with(ClusterOptions::with_nbd());
    let vol = cluster.create_nbd_volume("gone", 16 * MIB as u64);
    cluster.qemu_io(
        "gone",
        &[
            "write -P 0x11 0 65536",
            "write -P 0x22 8388608 65536",
            "flush",
        ],
    );
    for osd in 0..cluster.osd_count() {
        for index in [0, 2] {
            let p = cluster.object_path(osd, vol.id, index);
            assert!(p.exists(), "osd.{osd}: {} missing after write", p.display());
        }
    }
    cluster.admin_ok(&["volume", "rm", "gone"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    for osd in 0..cluster.osd_count() {
        for index in [0, 2] {
            let p = cluster.object_path(osd, vol.id, index);
            while p.exists() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "osd.{osd}: {} still exists 30 s after volume rm\n{}",
                    p.display(),
                    cluster.log_tails()
                );
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
        }
    }
}
