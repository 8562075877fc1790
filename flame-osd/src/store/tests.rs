use super::*;
use flame_common::reactor::{Reactor, ReactorConfig};

/// Start-up recovery, then every group's doubt settled (as primaries would):
/// the objects the journals (and earlier unsettled restarts) named.
async fn recover_settled(fs: &Fs, root: &Path) -> io::Result<Vec<(PgId, ObjectId)>> {
    let record = recover(fs, root, 1).await?;
    let objects = record.objects();
    for (pg, _) in &objects {
        record.settle(*pg);
    }
    record.persist(fs).await?;
    Ok(objects)
}

const PG: PgId = PgId(3);

fn obj(i: u64) -> ObjectId {
    ObjectId {
        volume: VolumeId(5),
        index: i,
    }
}

fn opts(direct_io: bool, checksums: bool) -> StoreOptions {
    StoreOptions {
        direct_io,
        open_max: 16,
        checksums,
    }
}

/// Runs `f` on a reactor with a formatted temporary data directory.
fn with_dir(f: impl AsyncFnOnce(&Path) + 'static) {
    let dir = tempfile::tempdir().unwrap();
    layout::open_data_dir(dir.path(), "test", true).unwrap();
    let path = dir.path().to_path_buf();
    let mut r = Reactor::new(ReactorConfig::default()).unwrap();
    r.block_on(async move { f(&path).await }).unwrap();
}

fn with_store(o: StoreOptions, f: impl AsyncFnOnce(&ObjectStore, &Path) + 'static) {
    with_dir(async move |path| {
        let store = ObjectStore::new(path, 0, o);
        f(&store, path).await;
    });
}

#[test]
fn unwritten_reads_zero_and_writes_read_back() {
    for (direct, sums) in [(false, true), (true, true), (false, false), (true, false)] {
        with_store(opts(direct, sums), async |s, _| {
            assert_eq!(s.read(PG, obj(1), 0, 8192).await.unwrap(), vec![0; 8192]);
            s.write(PG, obj(1), 4096, PayloadBuf::copy_from(&[7; 4096]), false)
                .await
                .unwrap();
            s.write(PG, obj(1), 10, PayloadBuf::copy_from(b"abc"), true)
                .await
                .unwrap();
            let back = s.read(PG, obj(1), 0, 12288).await.unwrap();
            assert_eq!(&back[10..13], b"abc");
            assert!(back[4096..8192].iter().all(|&b| b == 7));
            assert!(back[8192..].iter().all(|&b| b == 0));
            assert_eq!(s.read(PG, obj(1), 11, 3).await.unwrap(), b"bc\0");
            s.flush(None).await.unwrap();
        });
    }
}

/// Two objects with the same bytes have the same header and checksums, however
/// they got there: one whose last blocks were written and then zeroed ends like
/// one that never had them.
#[test]
fn the_checksum_list_ends_at_the_last_nonzero_block() {
    with_store(opts(false, true), async |s, _| {
        for o in [obj(1), obj(2)] {
            s.write(PG, o, 0, PayloadBuf::copy_from(&[7; 4096]), false)
                .await
                .unwrap();
        }
        // Blocks 3 and 4 written, then zeroed.
        for fill in [9u8, 0] {
            s.write(
                PG,
                obj(1),
                3 * 4096,
                PayloadBuf::copy_from(&[fill; 8192]),
                false,
            )
            .await
            .unwrap();
        }
        s.flush(None).await.unwrap();
        let head = |o| {
            let mut b = std::fs::read(s.object_path(PG, o)).unwrap();
            b.truncate(meta::DATA_OFFSET as usize);
            b
        };
        let (a, b) = (head(obj(1)), head(obj(2)));
        // The object id differs (bytes 16..32) and so does the header's crc.
        assert_eq!(a[32..meta::HEADER_LEN - 4], b[32..meta::HEADER_LEN - 4]);
        assert_eq!(a[meta::HEADER_LEN..], b[meta::HEADER_LEN..]);
    });
}

/// Slots past a shrunk checksum list are zero on disk, as for an object that never
/// had the blocks: when the list shrinks to nothing (the metadata write is then
/// the header alone), to fewer 4 KiB blocks of slots, on an object loaded from its
/// file, and when start-up recovery rewrites the metadata. Simulator seed 436: a
/// trim of a whole object left one copy's slot of a trimmed block on disk, which
/// no longer matched its zeroed data, while a copy that never had the block held 0.
#[test]
fn slots_past_a_shrunk_checksum_list_are_cleared_on_disk() {
    with_dir(async |root| {
        // The slots of an object's file that are not zero (its crc_count is 0).
        let nonzero_slots = |o| {
            let b = std::fs::read(layout::object_path(root, PG, o)).unwrap();
            assert_eq!(b[36..40], [0u8; 4], "crc_count of {o}");
            let area = &b[meta::HEADER_LEN..meta::DATA_OFFSET as usize];
            let slots = area.chunks_exact(4).enumerate();
            slots
                .filter(|(_, c)| *c != [0u8; 4])
                .map(|(i, _)| i)
                .collect::<Vec<_>>()
        };
        let none: Vec<usize> = Vec::new();
        let write = async |s: &ObjectStore, o, block: u32| {
            s.write(
                PG,
                o,
                block * BLOCK as u32,
                PayloadBuf::copy_from(&[7; BLOCK]),
                false,
            )
            .await
            .unwrap();
        };
        let trim = async |s: &ObjectStore, o, blocks: u32| {
            s.zero(PG, o, 0, blocks * BLOCK as u32, false)
                .await
                .unwrap();
        };
        let s = ObjectStore::new(root, 0, opts(false, true));
        // Block 114 of a 1 MiB object (the seed's), and block 2000 (a second block
        // of slots), each trimmed with the blocks before it.
        for (o, block) in [(obj(1), 114), (obj(2), 2000)] {
            write(&s, o, block).await;
            s.flush(None).await.unwrap();
            trim(&s, o, block + 1).await;
            s.flush(None).await.unwrap();
            assert_eq!(nonzero_slots(o), none, "{o} trimmed while open");
        }
        // Written and flushed by one store, trimmed by one that loads it.
        write(&s, obj(3), 114).await;
        s.flush(None).await.unwrap();
        drop(s);
        let s = ObjectStore::new(root, 0, opts(false, true));
        trim(&s, obj(3), 115).await;
        s.flush(None).await.unwrap();
        assert_eq!(nonzero_slots(obj(3)), none, "trimmed after a load");
        // Trimmed, then the OSD dies before the FLUSH: recovery recomputes.
        write(&s, obj(4), 114).await;
        s.flush(None).await.unwrap();
        trim(&s, obj(4), 115).await;
        drop(s);
        let in_doubt = recover_settled(&Fs::Real { direct_io: false }, root)
            .await
            .unwrap();
        assert_eq!(in_doubt, vec![(PG, obj(4))]);
        assert_eq!(nonzero_slots(obj(4)), none, "recomputed by recovery");
    });
}

/// A block-aligned write whose memory is not aligned (a slice of a larger payload)
/// cannot go through O_DIRECT from that memory (the kernel refuses it with EINVAL):
/// it is written correctly anyway, with and without checksums, and a block-aligned
/// read lands in an aligned buffer.
#[test]
fn unaligned_memory_is_written_correctly_with_direct_io() {
    for sums in [false, true] {
        with_store(opts(true, sums), async |s, _| {
            let big: Vec<u8> = (0..8193u32).map(|i| (i % 251) as u8).collect();
            let whole = PayloadBuf::copy_from(&big);
            let part = whole.slice(1..4097);
            assert!(!part.is_direct_io_aligned());
            s.write(PG, obj(1), 4096, part, false).await.unwrap();
            let aligned = whole.slice(4096..8192);
            assert!(aligned.is_direct_io_aligned());
            s.write(PG, obj(1), 8192, aligned, true).await.unwrap();
            let back = s.read(PG, obj(1), 4096, 8192).await.unwrap();
            assert!(back.is_direct_io_aligned());
            assert_eq!(&back[..4096], &big[1..4097]);
            assert_eq!(&back[4096..], &big[4096..8192]);
        });
    }
}

#[test]
fn zero_punches_and_delete_removes_owned() {
    with_store(opts(false, true), async |s, root| {
        s.write(PG, obj(1), 0, PayloadBuf::copy_from(&[9; 65536]), false)
            .await
            .unwrap();
        s.write(PgId(4), obj(2), 0, PayloadBuf::copy_from(&[9; 10]), false)
            .await
            .unwrap();
        s.zero(PG, obj(1), 4000, 8500, false).await.unwrap();
        let back = s.read(PG, obj(1), 0, 65536).await.unwrap();
        assert!(back[..4000].iter().all(|&b| b == 9));
        assert!(back[4000..12500].iter().all(|&b| b == 0));
        assert!(back[12500..].iter().all(|&b| b == 9));
        s.zero(PG, obj(3), 0, 4096, true).await.unwrap(); // missing object: no-op
        s.flush(None).await.unwrap();
        let n = s.delete_volume(VolumeId(5), |pg| pg == PG).await.unwrap();
        assert_eq!(n, 1);
        assert!(
            !root
                .join("pgs/00000003/0000000000000005.0000000000000001")
                .exists()
        );
        assert!(
            root.join("pgs/00000004/0000000000000005.0000000000000002")
                .exists()
        );
        assert_eq!(s.read(PG, obj(1), 0, 16).await.unwrap(), vec![0; 16]);
    });
}

#[test]
fn absent_cache_never_hides_a_written_object() {
    with_store(opts(false, true), async |s, _| {
        assert_eq!(s.read(PG, obj(7), 0, 8).await.unwrap(), vec![0; 8]);
        assert!(s.absent.borrow().contains(&obj(7)));
        s.zero(PG, obj(7), 0, 8, false).await.unwrap(); // still absent: no file made
        s.write(PG, obj(7), 0, PayloadBuf::copy_from(&[5; 8]), false)
            .await
            .unwrap();
        assert!(!s.absent.borrow().contains(&obj(7)));
        s.flush(None).await.unwrap();
        // Close it, then read through a fresh open (checksums loaded from disk).
        s.files.borrow_mut().remove(&obj(7));
        assert_eq!(s.read(PG, obj(7), 0, 8).await.unwrap(), vec![5; 8]);
        s.delete_volume(VolumeId(5), |_| true).await.unwrap();
        assert_eq!(s.read(PG, obj(7), 0, 8).await.unwrap(), vec![0; 8]);
        // Absent after a delete, then written again (another volume: a removed
        // one gets no new objects).
        let other = ObjectId {
            volume: VolumeId(6),
            index: 7,
        };
        assert_eq!(s.read(PG, other, 0, 8).await.unwrap(), vec![0; 8]);
        s.write(PG, other, 0, PayloadBuf::copy_from(&[6; 8]), false)
            .await
            .unwrap();
        assert_eq!(s.read(PG, other, 0, 8).await.unwrap(), vec![6; 8]);
    });
}

/// A copy racing `volume rm` (recovery from a member that has not deleted yet, or
/// a late forward) must not bring an object of the removed volume back on a copy
/// that already deleted its own: the CI run where one came back between the
/// deletes on two OSDs, and `volume rm` returned with it on disk.
#[test]
fn a_removed_volume_gets_no_new_objects() {
    with_store(opts(false, true), async |s, root| {
        s.write(PG, obj(1), 0, PayloadBuf::copy_from(&[9; 4096]), false)
            .await
            .unwrap();
        s.delete_volume(VolumeId(5), |_| true).await.unwrap();
        for res in [
            s.write(PG, obj(1), 0, PayloadBuf::copy_from(&[1; 4096]), false)
                .await,
            s.write(PG, obj(2), 0, PayloadBuf::copy_from(&[1; 8]), true)
                .await,
        ] {
            assert!(
                matches!(res, Err(StoreError::VolumeRemoved(VolumeId(5)))),
                "{res:?}"
            );
        }
        assert!(
            !root
                .join("pgs/00000003/0000000000000005.0000000000000001")
                .exists()
        );
        assert!(
            !root
                .join("pgs/00000003/0000000000000005.0000000000000002")
                .exists()
        );
        // A tombstone of the map marks a volume the same way, before any delete.
        s.note_removed_volumes([VolumeId(8)]);
        let tombstoned = ObjectId {
            volume: VolumeId(8),
            index: 0,
        };
        let res = s
            .write(PG, tombstoned, 0, PayloadBuf::copy_from(&[1; 8]), false)
            .await;
        assert!(
            matches!(res, Err(StoreError::VolumeRemoved(VolumeId(8)))),
            "{res:?}"
        );
        // Other volumes are untouched; the set keeps the newest ids only.
        s.note_removed_volumes((100..100 + DELETED_VOLUMES_MAX as u64).map(VolumeId));
        assert_eq!(s.removed_volumes.borrow().len(), DELETED_VOLUMES_MAX);
        assert!(!s.is_removed(VolumeId(5)));
        s.write(PG, obj(3), 0, PayloadBuf::copy_from(&[1; 8]), false)
            .await
            .unwrap();
    });
}

#[test]
fn dirty_entries_stay_until_their_sync_completes() {
    // A flush in progress must not hide the data from a concurrent flush: the
    // second flush has to wait for (or issue) its own sync, not return early.
    with_dir(async |path| {
        let s = Rc::new(ObjectStore::new(path, 0, opts(false, true)));
        s.write(PG, obj(1), 0, PayloadBuf::copy_from(&[1; 4096]), false)
            .await
            .unwrap();
        let s1 = s.clone();
        let first = reactor::spawn(async move { s1.flush(None).await });
        reactor::yield_now().await; // the first flush has its sync in flight
        assert!(
            s.dirty.borrow().contains_key(&obj(1)),
            "dirty entry dropped before its sync finished"
        );
        // A write during the flush re-dirties the object: the first flush must not
        // clear the newer generation.
        s.write(PG, obj(1), 0, PayloadBuf::copy_from(&[2; 4096]), false)
            .await
            .unwrap();
        first.await.unwrap();
        assert!(
            s.dirty.borrow().contains_key(&obj(1)),
            "newer write lost its dirty mark"
        );
        s.flush(None).await.unwrap();
        assert!(s.dirty.borrow().is_empty());
        assert!(s.dirty_dirs.borrow().is_empty());
        assert_eq!(s.journal.len(), 0, "a clean flush resets the journal");
    });
}

#[test]
fn flush_of_one_volume_leaves_the_others_dirty() {
    with_store(opts(false, true), async |s, _| {
        let other = ObjectId {
            volume: VolumeId(6),
            index: 0,
        };
        s.write(PG, obj(0), 0, PayloadBuf::copy_from(&[1; 4096]), false)
            .await
            .unwrap();
        s.write(PG, other, 0, PayloadBuf::copy_from(&[1; 4096]), false)
            .await
            .unwrap();
        s.flush(Some(VolumeId(5))).await.unwrap();
        let dirty: Vec<ObjectId> = s.dirty.borrow().keys().copied().collect();
        assert_eq!(dirty, vec![other]);
        assert_eq!(
            s.journal.len(),
            2,
            "the journal is kept while anything is dirty"
        );
        s.flush(None).await.unwrap();
        assert!(s.dirty.borrow().is_empty());
        assert_eq!(s.journal.len(), 0);
    });
}

/// Unmounts a test mount, even when the test panics.
struct Mount(PathBuf);
impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn direct_io_probe_falls_back_where_unsupported() {
    // ramfs has no O_DIRECT (tmpfs gained it in Linux 6.6, so it no longer
    // serves). Mounting needs root, which the test command runs as.
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("ramfs");
    std::fs::create_dir(&mnt).unwrap();
    let ok = std::process::Command::new("mount")
        .args(["-t", "ramfs", "ramfs"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(
        ok.success(),
        "mount -t ramfs failed: this test needs root (scripts/test.sh runs as root)"
    );
    let _mount = Mount(mnt.clone());
    assert!(!probe_direct_io(&mnt, DirectIo::Auto).unwrap());
    let err = probe_direct_io(&mnt, DirectIo::On).unwrap_err();
    assert!(err.to_string().contains("O_DIRECT"), "{err}");
    assert!(!probe_direct_io(&mnt, DirectIo::Off).unwrap());
    // On a file system with O_DIRECT, auto uses it.
    assert!(probe_direct_io(dir.path(), DirectIo::Auto).unwrap() || cfg!(not(target_os = "linux")));
    // The store works without it.
    layout::open_data_dir(&mnt, "t", true).unwrap();
    let path = mnt.clone();
    let mut r = Reactor::new(ReactorConfig::default()).unwrap();
    r.block_on(async move {
        let s = ObjectStore::new(&path, 0, opts(false, true));
        s.write(PG, obj(1), 4096, PayloadBuf::copy_from(&[1; 4096]), true)
            .await
            .unwrap();
        s.zero(PG, obj(1), 4096, 100, false).await.unwrap();
        let back = s.read(PG, obj(1), 4096, 4096).await.unwrap();
        assert!(back[..100].iter().all(|&b| b == 0));
        assert!(back[100..].iter().all(|&b| b == 1));
        s.flush(None).await.unwrap();
    })
    .unwrap();
}

#[test]
fn open_file_cache_is_bounded_and_least_recently_used() {
    with_store(opts(false, true), async |s, _| {
        for i in 0..100 {
            // Object 0 is used after every other one: it must never be the one
            // evicted when another object is opened.
            s.write(PG, obj(i), 0, PayloadBuf::copy_from(&[i as u8; 16]), false)
                .await
                .unwrap();
            assert!(s.files.borrow().map.contains_key(&obj(0)), "round {i}");
            if i % 10 == 9 {
                s.flush(None).await.unwrap(); // dirty objects stay open until flushed
            }
            assert_eq!(s.read(PG, obj(0), 0, 1).await.unwrap(), vec![0]);
        }
        s.flush(None).await.unwrap();
        assert!(s.open_count() <= 16, "{} open", s.open_count());
        for i in 0..100 {
            assert_eq!(s.read(PG, obj(i), 0, 16).await.unwrap(), vec![i as u8; 16]);
        }
    });
}

/// Byte offset of data byte `offset` of object `o` in its file.
fn file_offset(offset: u64) -> u64 {
    DATA_OFFSET + offset
}

fn flip_byte(path: &Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x5a;
    f.write_all_at(&b, at).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn corruption_is_reported_never_returned_and_repair_fixes_it() {
    for direct in [false, true] {
        with_dir(async move |root| {
            let s = ObjectStore::new(root, 0, opts(direct, true));
            let data: Vec<u8> = (0..4 * BLOCK).map(|i| (i % 251) as u8).collect();
            s.write(PG, obj(1), 0, PayloadBuf::copy_from(&data.clone()), false)
                .await
                .unwrap();
            s.flush(None).await.unwrap();
            drop(s);
            flip_byte(
                &layout::object_path(root, PG, obj(1)),
                file_offset(BLOCK as u64 + 7),
            );
            let s = ObjectStore::new(root, 0, opts(direct, true));
            match s.read(PG, obj(1), 100, 3 * BLOCK as u32).await {
                Err(StoreError::Checksum { object, blocks }) => {
                    assert_eq!(object, obj(1));
                    assert_eq!(blocks, vec![1]);
                }
                other => panic!("corrupt block not reported: {other:?}"),
            }
            // Blocks around it still read.
            assert_eq!(
                s.read(PG, obj(1), 0, BLOCK as u32).await.unwrap(),
                data[..BLOCK]
            );
            assert_eq!(
                s.read(PG, obj(1), 2 * BLOCK as u32, 2 * BLOCK as u32)
                    .await
                    .unwrap(),
                data[2 * BLOCK..]
            );
            // A partial write into the bad block must not launder it.
            assert!(matches!(
                s.write(
                    PG,
                    obj(1),
                    BLOCK as u32 + 1,
                    PayloadBuf::copy_from(&[1]),
                    false
                )
                .await,
                Err(StoreError::Checksum { .. })
            ));
            let before = metric("flame_osd_checksum_errors_total", "repaired");
            s.repair_block(PG, obj(1), 1, &data[BLOCK..2 * BLOCK])
                .await
                .unwrap();
            assert_eq!(
                metric("flame_osd_checksum_errors_total", "repaired"),
                before + 1
            );
            assert_eq!(s.read(PG, obj(1), 0, 4 * BLOCK as u32).await.unwrap(), data);
            // The repair is stable with its checksum: a fresh store verifies it.
            s.flush(None).await.unwrap();
            drop(s);
            let s = ObjectStore::new(root, 0, opts(direct, true));
            assert_eq!(s.read(PG, obj(1), 0, 4 * BLOCK as u32).await.unwrap(), data);
            // A corrupt header makes every block of the object unverifiable.
            drop(s);
            flip_byte(&layout::object_path(root, PG, obj(1)), 20);
            let s = ObjectStore::new(root, 0, opts(direct, true));
            assert!(matches!(
                s.read(PG, obj(1), 0, 10).await,
                Err(StoreError::Checksum { .. })
            ));
        });
    }
}

fn metric(name: &str, label: &str) -> u64 {
    let families = prometheus::gather();
    families
        .iter()
        .filter(|f| f.name() == name)
        .flat_map(|f| f.get_metric().iter())
        .filter(|m| m.get_label().iter().any(|l| l.value() == label))
        .map(|m| m.get_counter().get_value() as u64)
        .sum()
}

#[test]
fn partial_writes_keep_checksums_of_whole_blocks() {
    use rand::{Rng, SeedableRng};
    with_dir(async |root| {
        let s = ObjectStore::new(root, 0, opts(true, true));
        let size = 16 * BLOCK;
        let mut model = vec![0u8; size];
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for round in 0..200 {
            let off = rng.random_range(0..size - 1);
            let len = rng.random_range(1..=(size - off).min(3 * BLOCK));
            if rng.random_bool(0.2) {
                s.zero(PG, obj(1), off as u32, len as u32, false)
                    .await
                    .unwrap();
                model[off..off + len].fill(0);
            } else {
                let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                s.write(
                    PG,
                    obj(1),
                    off as u32,
                    PayloadBuf::copy_from(&data.clone()),
                    false,
                )
                .await
                .unwrap();
                model[off..off + len].copy_from_slice(&data);
            }
            if round % 50 == 49 {
                s.flush(None).await.unwrap();
            }
        }
        assert_eq!(s.read(PG, obj(1), 0, size as u32).await.unwrap(), model);
        s.flush(None).await.unwrap();
        drop(s);
        // From disk, with the checksums written by the flush.
        let s = ObjectStore::new(root, 0, opts(false, true));
        assert_eq!(s.read(PG, obj(1), 0, size as u32).await.unwrap(), model);
    });
}

#[test]
fn concurrent_partial_writes_to_one_block_both_land() {
    with_dir(async |root| {
        let s = Rc::new(ObjectStore::new(root, 0, opts(false, true)));
        let tasks: Vec<_> = (0..8u32)
            .map(|i| {
                let s = s.clone();
                reactor::spawn(async move {
                    s.write(
                        PG,
                        obj(1),
                        i * 100,
                        PayloadBuf::copy_from(&[i as u8 + 1; 100]),
                        false,
                    )
                    .await
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let back = s.read(PG, obj(1), 0, 800).await.unwrap();
        for i in 0..8usize {
            assert!(
                back[i * 100..(i + 1) * 100]
                    .iter()
                    .all(|&b| b == i as u8 + 1)
            );
        }
    });
}

#[test]
fn crash_before_flush_is_recovered_from_the_journal() {
    with_dir(async |root| {
        let s = ObjectStore::new(root, 0, opts(false, true));
        s.write(
            PG,
            obj(1),
            0,
            PayloadBuf::copy_from(&vec![1; 2 * BLOCK]),
            false,
        )
        .await
        .unwrap();
        s.flush(None).await.unwrap();
        // Unflushed: the data reaches the file, its checksums stay in memory.
        s.write(PG, obj(1), 0, PayloadBuf::copy_from(&vec![2; BLOCK]), false)
            .await
            .unwrap();
        s.write(PG, obj(2), 0, PayloadBuf::copy_from(&vec![3; BLOCK]), false)
            .await
            .unwrap();
        drop(s); // the OSD dies here
        let fs = Fs::Real { direct_io: false };
        // Without recovery the stale checksum shows (this is what the journal is for).
        let s = ObjectStore::new(root, 0, opts(false, true));
        assert!(matches!(
            s.read(PG, obj(1), 0, BLOCK as u32).await,
            Err(StoreError::Checksum { .. })
        ));
        drop(s);
        // Both objects are in doubt (their copies here may lack acknowledged
        // writes the other copies have): the member answers them to its primary.
        let mut in_doubt = recover_settled(&fs, root).await.unwrap();
        in_doubt.sort();
        assert_eq!(in_doubt, vec![(PG, obj(1)), (PG, obj(2))]);
        let s = ObjectStore::new(root, 0, opts(false, true));
        assert_eq!(
            s.read(PG, obj(1), 0, BLOCK as u32).await.unwrap(),
            vec![2; BLOCK]
        );
        assert_eq!(
            s.read(PG, obj(1), BLOCK as u32, BLOCK as u32)
                .await
                .unwrap(),
            vec![1; BLOCK]
        );
        assert_eq!(
            s.read(PG, obj(2), 0, BLOCK as u32).await.unwrap(),
            vec![3; BLOCK]
        );
        // The journals were reset: a second recovery has nothing to do.
        assert!(recover_settled(&fs, root).await.unwrap().is_empty());
    });
}

#[test]
fn journal_group_commits_concurrent_first_writes() {
    with_dir(async |root| {
        let o = StoreOptions {
            open_max: 64,
            ..opts(false, true)
        };
        let s = Rc::new(ObjectStore::new(root, 0, o));
        // Create and flush the objects, so the writes below are first writes after a
        // flush on open objects and reach the journal together.
        for i in 0..32 {
            s.write(PG, obj(i), 0, PayloadBuf::copy_from(&vec![1; BLOCK]), false)
                .await
                .unwrap();
        }
        s.flush(None).await.unwrap();
        assert_eq!(s.journal.len(), 0);
        let before = s.journal.commits();
        let tasks: Vec<_> = (0..32)
            .map(|i| {
                let s = s.clone();
                reactor::spawn(async move {
                    s.write(PG, obj(i), 0, PayloadBuf::copy_from(&vec![2; BLOCK]), false)
                        .await
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        // A second write to the same objects journals nothing.
        for i in 0..32 {
            s.write(
                PG,
                obj(i),
                BLOCK as u32,
                PayloadBuf::copy_from(&vec![1; BLOCK]),
                false,
            )
            .await
            .unwrap();
        }
        let journal_writes = s.journal.commits() - before;
        assert!(
            (1..=2).contains(&journal_writes),
            "{journal_writes} synced journal writes for 32 concurrent first writes"
        );
        assert_eq!(s.journal.len(), 32);
    });
}

#[test]
fn reads_racing_writes_to_the_same_blocks_never_report_corruption() {
    // A read that sees a block's new data with its old checksum (or the reverse)
    // while a write is in flight must re-read, not report a checksum error.
    super::WIDEN_RACE.with(|w| w.set(true));
    with_dir(async |root| {
        let s = Rc::new(ObjectStore::new(root, 0, opts(true, true)));
        s.write(
            PG,
            obj(1),
            0,
            PayloadBuf::copy_from(&vec![9; 4 * BLOCK]),
            false,
        )
        .await
        .unwrap();
        let done = Rc::new(Cell::new(false));
        let writer = {
            let done = done.clone();
            let s = s.clone();
            reactor::spawn(async move {
                for round in 0..200u32 {
                    let b = (round % 4) * BLOCK as u32;
                    let v = (round % 251) as u8 + 1;
                    s.write(PG, obj(1), b, PayloadBuf::copy_from(&vec![v; BLOCK]), false)
                        .await
                        .unwrap();
                    if round % 7 == 0 {
                        // A partial write too (read-modify-write of one block).
                        s.write(PG, obj(1), b + 100, PayloadBuf::copy_from(&[v; 200]), false)
                            .await
                            .unwrap();
                    }
                }
                done.set(true);
            })
        };
        let readers: Vec<_> = (0..4)
            .map(|_| {
                let s = s.clone();
                let done = done.clone();
                reactor::spawn(async move {
                    let mut reads = 0;
                    // Bounded: the writer ends after 200 rounds.
                    while !done.get() && reads < 100_000 {
                        match s.read(PG, obj(1), 0, 4 * BLOCK as u32).await {
                            Ok(_) => reads += 1,
                            Err(e) => panic!("read racing a write failed: {e}"),
                        }
                    }
                    reads
                })
            })
            .collect();
        writer.await;
        for r in readers {
            assert!(r.await >= 1, "a reader never completed a read");
        }
    });
}

#[test]
fn dirty_objects_are_bounded_by_flushing() {
    with_store(opts(false, true), async |s, _| {
        // open_max is 16: the 17th dirty object makes the store flush first.
        for i in 0..40 {
            s.write(PG, obj(i), 0, PayloadBuf::copy_from(&vec![1; BLOCK]), false)
                .await
                .unwrap();
            assert!(
                s.dirty.borrow().len() <= 16,
                "{} dirty",
                s.dirty.borrow().len()
            );
        }
        assert!(s.journal.len() <= 16);
    });
}

#[test]
fn the_journal_is_bounded_under_constant_concurrent_writes() {
    // Writes are always in flight, so a flush alone could never reset the journal:
    // the store holds new writes back until the in-flight ones are done.
    with_dir(async |root| {
        let o = StoreOptions {
            open_max: 1024,
            ..opts(false, true)
        };
        let s = Rc::new(ObjectStore::new(root, 0, o));
        s.journal_max.set(16);
        let tasks: Vec<_> = (0..4u64)
            .map(|t| {
                let s = s.clone();
                reactor::spawn(async move {
                    for i in 0..50u64 {
                        s.write(
                            PG,
                            obj(t * 1000 + i),
                            0,
                            PayloadBuf::copy_from(&vec![1; BLOCK]),
                            false,
                        )
                        .await
                        .unwrap();
                        assert!(s.journal.len() <= 16 + 4, "journal at {}", s.journal.len());
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await;
        }
        for t in 0..4u64 {
            for i in 0..50u64 {
                assert_eq!(
                    s.read(PG, obj(t * 1000 + i), 0, 4).await.unwrap(),
                    vec![1; 4]
                );
            }
        }
    });
}

/// Simulator seed 41296: two flushes of one object in flight together — one
/// encoded before a write to it completed, one after — whose metadata writes
/// complete out of order on the disk (as io_uring's may). The older checksums
/// landed last, and the newer flush had already marked the object clean, so the
/// disk kept a checksum that did not match the data: after a restart the block
/// failed verification.
#[test]
fn racing_flushes_never_leave_stale_checksums_on_disk() {
    let mut r = Reactor::new(ReactorConfig::default()).unwrap();
    r.block_on(async {
        let root = PathBuf::from("/sim");
        for seed in 0..40u64 {
            let sim = fs::SimFs::new(&[
                root.clone(),
                layout::pgs_dir(&root),
                layout::journal_dir(&root),
            ]);
            sim.set_latency(5..=600, seed);
            let fs = Fs::Sim(sim);
            let store = Rc::new(ObjectStore::with_fs(
                fs.clone(),
                &root,
                0,
                opts(false, true),
            ));
            let (a, b) = (vec![0xa1u8; BLOCK], vec![0xb2u8; BLOCK]);
            store
                .write(PG, obj(0), 0, PayloadBuf::copy_from(&a), false)
                .await
                .unwrap();
            store.flush(None).await.unwrap();
            let s = store.clone();
            let data = b.clone();
            let write = reactor::spawn(async move {
                s.write(PG, obj(0), 0, PayloadBuf::copy_from(&data), false)
                    .await
            });
            let s = store.clone();
            let early = reactor::spawn(async move { s.flush(None).await });
            write.await.unwrap();
            store.flush(None).await.unwrap();
            early.await.unwrap();
            drop(store);
            let reopened = ObjectStore::with_fs(fs, &root, 0, opts(false, true));
            let got = reopened
                .read(PG, obj(0), 0, BLOCK as u32)
                .await
                .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
            assert_eq!(got.as_slice(), &b[..], "seed {seed}");
        }
    })
    .unwrap();
}

/// A simulated data directory and a store on it.
fn sim_dir() -> (Rc<fs::SimFs>, Fs, PathBuf) {
    let root = PathBuf::from("/sim");
    let sim = fs::SimFs::new(&[
        root.clone(),
        layout::pgs_dir(&root),
        layout::journal_dir(&root),
    ]);
    (sim.clone(), Fs::Sim(sim), root)
}

/// Leaves the second half of a file's first 4 KiB garbled, stably: a header torn
/// by a power cut while a reset wrote it (on a disk whose sectors are smaller than
/// 4 KiB), or corrupted by the medium since.
async fn garble_header(fs: &Fs, path: &Path) {
    let (file, _) = fs.open(path, false).await.unwrap().unwrap();
    let mut head = file.read(0, 4096).await.unwrap();
    for b in &mut head[2048..] {
        *b ^= 0x5a;
    }
    file.write(0, head, Some(SyncKind::Journal)).await.unwrap();
}

/// A restart's doubt lived only in memory once start-up had reset the
/// journals: a second restart before a primary settled it found nothing in
/// doubt, and the copy that lost acknowledged writes in the first power cut came
/// back sure of itself (simulator seeds 369, 414). The record keeps it, through
/// a torn rewrite too, until it is settled.
#[test]
fn a_restarts_doubt_outlives_a_second_restart_until_it_is_settled() {
    let mut r = Reactor::new(ReactorConfig::default()).unwrap();
    r.block_on(async {
        let (sim, fs, root) = sim_dir();
        let other = PgId(PG.0 + 1);
        let s = ObjectStore::with_fs(fs.clone(), &root, 0, opts(false, true));
        s.write(PG, obj(1), 0, PayloadBuf::copy_from(&[1; BLOCK]), false)
            .await
            .unwrap();
        s.write(other, obj(2), 0, PayloadBuf::copy_from(&[2; BLOCK]), false)
            .await
            .unwrap();
        drop(s);
        sim.power_cut(&mut || true);
        let sorted = |r: &doubt_record::DoubtRecord| {
            let mut v = r.objects();
            v.sort();
            v
        };
        let both = vec![(PG, obj(1)), (other, obj(2))];
        assert_eq!(sorted(&recover(&fs, &root, 1).await.unwrap()), both);
        // Power cut again before any primary settled it: still in doubt.
        sim.power_cut(&mut || true);
        let record = recover(&fs, &root, 1).await.unwrap();
        assert_eq!(
            sorted(&record),
            both,
            "the second restart forgot the first one's doubt"
        );
        // One group settled and written; a later rewrite torn by a power cut
        // leaves that record.
        record.settle(PG);
        assert!(record.stale());
        record.persist(&fs).await.unwrap();
        assert!(!record.stale());
        record.settle(other);
        sim.cut_after(0);
        assert!(record.persist(&fs).await.is_err());
        sim.power_cut(&mut || false);
        let record = recover(&fs, &root, 1).await.unwrap();
        assert_eq!(sorted(&record), vec![(other, obj(2))]);
        record.settle(other);
        record.persist(&fs).await.unwrap();
        assert!(recover(&fs, &root, 1).await.unwrap().objects().is_empty());
    })
    .unwrap();
}

/// Simulator seed 200214: a start-up on a full disk could not write the
/// restart-doubt record, served anyway after resetting the journals, and the
/// next restart — the disk still full — forgot the objects the first one had in
/// doubt: the copy came back sure of blocks a failed write left a write old.
/// The record now has room reserved for it, so a full disk still records the
/// doubt and a second restart still knows it.
#[test]
fn a_restart_on_a_full_disk_still_records_its_doubt_for_the_next_one() {
    let mut r = Reactor::new(ReactorConfig::default()).unwrap();
    r.block_on(async {
        let (sim, fs, root) = sim_dir();
        // The daemon's first start, on an empty directory with room.
        assert!(recover(&fs, &root, 1).await.unwrap().objects().is_empty());
        let s = ObjectStore::with_fs(fs.clone(), &root, 0, opts(false, true));
        s.write(PG, obj(1), 0, PayloadBuf::copy_from(&[1; BLOCK]), false)
            .await
            .unwrap();
        drop(s);
        sim.power_cut(&mut || true);
        sim.set_full(true);
        let record = recover(&fs, &root, 1)
            .await
            .expect("a full disk refused the record its room was reserved for");
        assert_eq!(record.objects(), vec![(PG, obj(1))]);
        assert!(!record.stale());
        // Restarted again before any primary settled it, the disk still full.
        sim.power_cut(&mut || true);
        let record = recover(&fs, &root, 1).await.unwrap();
        assert_eq!(
            record.objects(),
            vec![(PG, obj(1))],
            "the second restart forgot the doubt of the first, on a full disk"
        );
    })
    .unwrap();
}

/// Seed 58: a copy killed with kill -9 kept its acknowledged writes (page
/// cache), one that lost power may not have; start-up could not tell them
/// apart, and a primary that lost power kept its own stale bytes over the
/// killed copy's. The record names the boot of the process that wrote the
/// journals: the same boot at start-up means a crash's doubt, another (or none
/// known) a reboot's, and each object keeps its cause across restarts.
#[test]
fn a_restart_in_the_same_boot_is_a_crashs_doubt_and_after_a_power_cut_a_reboots() {
    use doubt_record::Cause::{Crash, Reboot};
    let mut r = Reactor::new(ReactorConfig::default()).unwrap();
    r.block_on(async {
        let (sim, fs, root) = sim_dir();
        let write = |i: u64| {
            let s = ObjectStore::with_fs(fs.clone(), &root, 0, opts(false, true));
            async move {
                s.write(
                    PG,
                    obj(i),
                    0,
                    PayloadBuf::copy_from(&[i as u8; BLOCK]),
                    false,
                )
                .await
                .unwrap();
            }
        };
        let sorted = |r: &doubt_record::DoubtRecord| {
            let mut v = r.entries();
            v.sort();
            v
        };
        // Never started before: no record names a boot, so no crash can be
        // told from a reboot.
        write(1).await;
        let record = recover(&fs, &root, 1).await.unwrap();
        assert_eq!(sorted(&record), vec![(PG, obj(1), Reboot)]);
        // Killed (the page cache stays), restarted in the same boot.
        write(2).await;
        let record = recover(&fs, &root, 1).await.unwrap();
        assert_eq!(
            sorted(&record),
            vec![(PG, obj(1), Reboot), (PG, obj(2), Crash)]
        );
        // Power cut: what this process wrote is a reboot's doubt; what the
        // crash left stays a crash's (start-up made it stable, and no write
        // since touched it).
        write(3).await;
        sim.power_cut(&mut || true);
        let record = recover(&fs, &root, 1).await.unwrap();
        assert_eq!(
            sorted(&record),
            vec![
                (PG, obj(1), Reboot),
                (PG, obj(2), Crash),
                (PG, obj(3), Reboot)
            ]
        );
        // Written again after the crash, then a power cut: a reboot's doubt.
        record.settle(PG);
        record.persist(&fs).await.unwrap();
        write(2).await;
        sim.power_cut(&mut || true);
        let record = recover(&fs, &root, 1).await.unwrap();
        assert_eq!(sorted(&record), vec![(PG, obj(2), Reboot)]);
        record.settle(PG);
        record.persist(&fs).await.unwrap();
        // No doubt left, and a start after a power cut names its boot (a
        // record with no objects), so a kill after it is told from a reboot.
        sim.power_cut(&mut || true);
        assert!(recover(&fs, &root, 1).await.unwrap().objects().is_empty());
        write(4).await;
        let record = recover(&fs, &root, 1).await.unwrap();
        assert_eq!(sorted(&record), vec![(PG, obj(4), Crash)]);
        record.settle(PG);
        record.persist(&fs).await.unwrap();
        // A sync failed before the process stopped (a writeback error, which
        // the kernel reports once): in the same boot still, a reboot's doubt,
        // once; the marker goes with it.
        write(5).await;
        let marker = doubt_record::writeback_failed_path(&root);
        fs.open(&marker, true).await.unwrap();
        let record = recover(&fs, &root, 1).await.unwrap();
        assert_eq!(sorted(&record), vec![(PG, obj(5), Reboot)]);
        assert!(fs.open(&marker, false).await.unwrap().is_none());
        write(6).await;
        let record = recover(&fs, &root, 1).await.unwrap();
        assert_eq!(
            sorted(&record),
            vec![(PG, obj(5), Reboot), (PG, obj(6), Crash)]
        );
    })
    .unwrap();
}

/// A journal header that does not decode at start-up was taken as an empty
/// journal: the objects it named kept their stale checksums (EIO later, and not
/// in doubt, so not copied again).
#[test]
fn a_journal_whose_header_does_not_decode_still_gets_its_objects_recomputed() {
    let mut r = Reactor::new(ReactorConfig::default()).unwrap();
    r.block_on(async {
        let (sim, fs, root) = sim_dir();
        let s = ObjectStore::with_fs(fs.clone(), &root, 0, opts(false, true));
        s.write(PG, obj(1), 0, PayloadBuf::copy_from(&[1; 2 * BLOCK]), false)
            .await
            .unwrap();
        s.flush(None).await.unwrap();
        s.write(PG, obj(1), 0, PayloadBuf::copy_from(&[2; BLOCK]), false)
            .await
            .unwrap();
        s.write(PG, obj(2), 0, PayloadBuf::copy_from(&[3; BLOCK]), false)
            .await
            .unwrap();
        // Power cut: everything reached the disk (the journal entries were synced).
        drop(s);
        sim.power_cut(&mut || true);
        let journal = layout::journal_path(&root, 0);
        garble_header(&fs, &journal).await;
        let mut in_doubt = recover_settled(&fs, &root).await.unwrap();
        in_doubt.sort();
        assert_eq!(in_doubt, vec![(PG, obj(1)), (PG, obj(2))]);
        let s = ObjectStore::with_fs(fs.clone(), &root, 0, opts(false, true));
        assert_eq!(
            s.read(PG, obj(1), 0, 2 * BLOCK as u32).await.unwrap(),
            [vec![2; BLOCK], vec![1; BLOCK]].concat()
        );
        assert_eq!(
            s.read(PG, obj(2), 0, BLOCK as u32).await.unwrap(),
            vec![3; BLOCK]
        );
        drop(s);
        // The reset gave it a header that decodes again: nothing left to do.
        assert!(recover_settled(&fs, &root).await.unwrap().is_empty());
    })
    .unwrap();
}

/// A journal header that does not decode made the next generation 1 again, so
/// the entries left in the file from an earlier generation 1 counted as current
/// (their objects recomputed at every start, adopting whatever the medium did to
/// them, and reported in doubt).
#[test]
fn a_journal_whose_header_does_not_decode_never_restarts_its_generation() {
    let mut r = Reactor::new(ReactorConfig::default()).unwrap();
    r.block_on(async {
        let (_sim, fs, root) = sim_dir();
        let journal = layout::journal_path(&root, 0);
        // A fresh journal: generation 1, three entries.
        let s = ObjectStore::with_fs(fs.clone(), &root, 0, opts(false, true));
        for i in 1..=3 {
            s.write(PG, obj(i), 0, PayloadBuf::copy_from(&[9; BLOCK]), false)
                .await
                .unwrap();
        }
        drop(s);
        assert_eq!(
            journal::header_generation(&fs, &journal).await.unwrap(),
            Some(1)
        );
        garble_header(&fs, &journal).await;
        recover_settled(&fs, &root).await.unwrap();
        let g = journal::header_generation(&fs, &journal)
            .await
            .unwrap()
            .unwrap();
        assert!(
            g > 1,
            "generation {g}: restarted at or below the entries' 1"
        );
        let left = journal::replay(&fs, &journal).await.unwrap();
        assert!(
            left.objects.is_empty() && !left.header_unreadable,
            "stale entries count as current: {left:?}"
        );
        // The next run's first entry overwrites the first old one; the two after
        // it stay stale.
        let s = ObjectStore::with_fs(fs.clone(), &root, 0, opts(false, true));
        s.write(PG, obj(4), 0, PayloadBuf::copy_from(&[4; BLOCK]), false)
            .await
            .unwrap();
        drop(s);
        assert_eq!(
            recover_settled(&fs, &root).await.unwrap(),
            vec![(PG, obj(4))]
        );
        // And a header garbled once the shard runs again (after start-up) is
        // numbered above every entry too.
        garble_header(&fs, &journal).await;
        let s = ObjectStore::with_fs(fs.clone(), &root, 0, opts(false, true));
        s.write(PG, obj(5), 0, PayloadBuf::copy_from(&[5; BLOCK]), false)
            .await
            .unwrap();
        drop(s);
        assert!(journal::header_generation(&fs, &journal).await.unwrap() > Some(g));
        assert_eq!(
            recover_settled(&fs, &root).await.unwrap(),
            vec![(PG, obj(5))]
        );
    })
    .unwrap();
}

mod power_loss {
    //! The power-loss simulation: a seeded random workload on the simulated disk,
    //! a power cut after a random number of disk operations, recovery, and a check
    //! of every block against what the workload was promised.
    use super::*;
    use fs::SimFs;
    use rand::{Rng, SeedableRng};
    use std::collections::HashMap;

    const OBJECTS: u64 = 4;
    const BLOCKS: usize = 8;
    const ROOT: &str = "/sim";

    /// What each block may hold after the cut: the value a completed FLUSH (or FUA
    /// write) made stable, plus every value written since (which may or may not
    /// have reached the disk).
    #[derive(Default)]
    struct Model {
        allowed: HashMap<(u64, usize), Vec<Vec<u8>>>,
        current: HashMap<(u64, usize), Vec<u8>>,
    }

    impl Model {
        fn current(&self, key: (u64, usize)) -> Vec<u8> {
            self.current
                .get(&key)
                .cloned()
                .unwrap_or_else(|| vec![0; BLOCK])
        }

        /// A write was issued: its value becomes allowed.
        fn issue(&mut self, key: (u64, usize), value: Vec<u8>) {
            let base = self.current(key);
            let allowed = self.allowed.entry(key).or_insert_with(|| vec![base]);
            allowed.push(value.clone());
            self.current.insert(key, value);
        }

        /// Everything written so far is stable (a FLUSH completed).
        fn stable_all(&mut self) {
            let keys: Vec<_> = self.current.keys().copied().collect();
            for k in keys {
                self.stable(k);
            }
        }

        fn stable(&mut self, key: (u64, usize)) {
            let v = self.current(key);
            self.allowed.insert(key, vec![v]);
        }

        fn allows(&self, key: (u64, usize), value: &[u8]) -> bool {
            match self.allowed.get(&key) {
                Some(v) => v.iter().any(|a| a == value),
                None => value.iter().all(|&b| b == 0),
            }
        }
    }

    fn pattern(rng: &mut impl Rng) -> Vec<u8> {
        let b: u8 = rng.random();
        vec![b; BLOCK]
    }

    /// One seeded run: returns how many blocks were checked.
    async fn run(seed: u64) -> usize {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let root = PathBuf::from(ROOT);
        let sim = SimFs::new(&[
            root.clone(),
            layout::pgs_dir(&root),
            layout::journal_dir(&root),
        ]);
        let fs = Fs::Sim(sim.clone());
        let mut store = Rc::new(ObjectStore::with_fs(
            fs.clone(),
            &root,
            0,
            opts(false, true),
        ));
        // Small journal bounds in some runs: resets (and drains) mid-workload.
        if rng.random_bool(0.5) {
            store.journal_max.set(rng.random_range(1..4));
        }
        let mut model = Model::default();
        // Each block's value as of its last completed write (what a replica
        // acknowledged).
        let mut acked: HashMap<(u64, usize), Vec<u8>> = HashMap::default();
        sim.cut_after(rng.random_range(5..400));
        // Bounded: 60 steps, each a handful of operations.
        'workload: for _ in 0..60 {
            match rng.random_range(0..10) {
                0..6 => {
                    // Concurrent writes to distinct blocks (some partial).
                    let mut tasks = Vec::new();
                    let mut used = HashSet::default();
                    for _ in 0..rng.random_range(1..5) {
                        let o = rng.random_range(0..OBJECTS);
                        let b = rng.random_range(0..BLOCKS);
                        if !used.insert((o, b)) {
                            continue;
                        }
                        let fua = rng.random_bool(0.1);
                        let (offset, data, full) = if rng.random_bool(0.3) {
                            let at = rng.random_range(0..BLOCK - 1);
                            let len = rng.random_range(1..BLOCK - at);
                            let v: u8 = rng.random();
                            let mut full = model.current((o, b));
                            full[at..at + len].fill(v);
                            ((b * BLOCK + at) as u32, vec![v; len], full)
                        } else {
                            let p = pattern(&mut rng);
                            ((b * BLOCK) as u32, p.clone(), p)
                        };
                        model.issue((o, b), full.clone());
                        let s = store.clone();
                        tasks.push((
                            (o, b),
                            fua,
                            full,
                            reactor::spawn(async move {
                                s.write(PG, obj(o), offset, PayloadBuf::copy_from(&data), fua)
                                    .await
                            }),
                        ));
                    }
                    for (key, fua, full, t) in tasks {
                        let res = t.await;
                        if res.is_ok() {
                            acked.insert(key, full);
                        }
                        match res {
                            Ok(()) if fua => model.stable(key),
                            Ok(()) => {}
                            Err(_) => assert!(sim.is_dead(), "write failed with power on"),
                        }
                    }
                }
                6 => {
                    let o = rng.random_range(0..OBJECTS);
                    let b = rng.random_range(0..BLOCKS);
                    model.issue((o, b), vec![0; BLOCK]);
                    if store
                        .zero(PG, obj(o), (b * BLOCK) as u32, BLOCK as u32, false)
                        .await
                        .is_err()
                    {
                        assert!(sim.is_dead());
                    } else {
                        acked.insert((o, b), vec![0; BLOCK]);
                    }
                }
                7 => {
                    // A kill -9 and a restart: the page cache survives, and
                    // start-up recovery must leave everything it found durable,
                    // new files' names included, or a power cut soon after
                    // loses writes that no one then knows are in doubt (the
                    // deterministic simulator's seed 12567).
                    drop(store);
                    let recovered = recover_settled(&fs, &root).await;
                    store = Rc::new(ObjectStore::with_fs(
                        fs.clone(),
                        &root,
                        0,
                        opts(false, true),
                    ));
                    match recovered {
                        Ok(_) => model.stable_all(),
                        Err(_) => assert!(sim.is_dead(), "recovery failed with power on"),
                    }
                }
                _ => match store.flush(None).await {
                    Ok(()) => model.stable_all(),
                    Err(_) => assert!(sim.is_dead(), "flush failed with power on"),
                },
            }
            if sim.is_dead() {
                break 'workload;
            }
        }
        if !sim.is_dead() {
            // The cut came after the workload: everything unflushed is at risk.
            sim.cut_after(0);
            let _ = store.flush(None).await;
        }
        drop(store);
        sim.power_cut(&mut || rng.random_bool(0.5));
        let in_doubt: HashSet<ObjectId> = recover_settled(&fs, &root)
            .await
            .unwrap()
            .into_iter()
            .map(|(_, o)| o)
            .collect();
        let store = ObjectStore::with_fs(fs, &root, 0, opts(false, true));
        let mut checked = 0;
        for o in 0..OBJECTS {
            for b in 0..BLOCKS {
                let got = store
                    .read(PG, obj(o), (b * BLOCK) as u32, BLOCK as u32)
                    .await
                    .unwrap_or_else(|e| panic!("seed {seed}: object {o} block {b}: {e}"));
                assert!(
                    model.allows((o, b), &got),
                    "seed {seed}: object {o} block {b} holds {:?}, not a value it was promised",
                    got[0]
                );
                // A block that lost a completed write (a replica acknowledged it,
                // no FLUSH covered it): its object must be among those recovery
                // reports in doubt, which the primary copies again before this
                // copy counts as complete.
                let last = acked
                    .get(&(o, b))
                    .cloned()
                    .unwrap_or_else(|| vec![0; BLOCK]);
                assert!(
                    got == last || in_doubt.contains(&obj(o)),
                    "seed {seed}: object {o} block {b} lost a completed write and is not in doubt"
                );
                checked += 1;
            }
        }
        checked
    }

    #[test]
    fn every_flushed_write_survives_and_every_block_verifies() {
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async {
            for seed in 0..300 {
                assert_eq!(run(seed).await, OBJECTS as usize * BLOCKS);
            }
        })
        .unwrap();
    }
}

/// CPU seconds used by this thread so far.
fn thread_cpu() -> f64 {
    // SAFETY: getrusage fills the zeroed struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut ru) };
    let t = |tv: libc::timeval| tv.tv_sec as f64 + tv.tv_usec as f64 * 1e-6;
    t(ru.ru_utime) + t(ru.ru_stime)
}

/// What checksums cost the store itself, per 4 KiB write and read (in-process, page
/// cache, no network): `cargo test --release -p flame-osd checksum_cost -- --ignored
/// --nocapture`. A measurement, not a check.
#[test]
#[ignore]
fn checksum_cost() {
    use rand::{Rng, SeedableRng};
    const OPS: u32 = 20_000;
    for round in 0..3 {
        for sums in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            layout::open_data_dir(dir.path(), "bench", sums).unwrap();
            let path = dir.path().to_path_buf();
            let mut r = Reactor::new(ReactorConfig::default()).unwrap();
            let (w, rd) = r
                .block_on(async move {
                    let s = ObjectStore::new(&path, 0, opts(true, sums));
                    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
                    let data = vec![0x5au8; BLOCK];
                    let t = thread_cpu();
                    for _ in 0..OPS {
                        let o = rng.random_range(0..16);
                        let b = rng.random_range(0..1024u32);
                        s.write(
                            PG,
                            obj(o),
                            b * BLOCK as u32,
                            PayloadBuf::copy_from(&data.clone()),
                            false,
                        )
                        .await
                        .unwrap();
                    }
                    let w = thread_cpu() - t;
                    let t = thread_cpu();
                    for _ in 0..OPS {
                        let o = rng.random_range(0..16);
                        let b = rng.random_range(0..1024u32);
                        s.read(PG, obj(o), b * BLOCK as u32, BLOCK as u32)
                            .await
                            .unwrap();
                    }
                    (w, thread_cpu() - t)
                })
                .unwrap();
            println!(
                "round {round} checksums {sums:5}: write {:6.2} µs CPU/op, read {:6.2} µs CPU/op",
                w * 1e6 / f64::from(OPS),
                rd * 1e6 / f64::from(OPS)
            );
        }
    }
}

/// Found by the simulator once file systems could fill up (seeds 726, 1106,
/// 1215): a write to a new object on a full disk failed its metadata
/// reservation with ENOSPC, as it should, but left the empty object file behind;
/// a later zeroing of that object opened it without creating it (so without a
/// reservation) and made it dirty, and the next FLUSH, writing its header on the
/// still full disk, stopped the OSD — which could then not even start, its
/// start-up recovery rewriting the same header. No object file may exist without
/// its metadata's space.
#[test]
fn a_write_refused_for_a_full_disk_leaves_no_object_file_a_flush_would_need_space_for() {
    let mut r = Reactor::new(ReactorConfig::default()).unwrap();
    r.block_on(async {
        let (sim, fs, root) = sim_dir();
        let store = ObjectStore::with_fs(fs.clone(), &root, 0, opts(false, true));
        // A first object, so the group's directory exists.
        store
            .write(PG, obj(0), 0, PayloadBuf::copy_from(&[1u8; BLOCK]), false)
            .await
            .unwrap();
        store.flush(None).await.unwrap();
        sim.set_full(true);
        let err = store
            .write(PG, obj(1), 0, PayloadBuf::copy_from(&[2u8; BLOCK]), false)
            .await
            .expect_err("a new object on a full disk");
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        assert!(
            !sim.paths().contains(&store.object_path(PG, obj(1))),
            "the refused write left its object file"
        );
        store
            .zero(PG, obj(1), 0, BLOCK as u32, false)
            .await
            .unwrap();
        store.flush(None).await.unwrap();
        assert!(!sim.take_fail_stop(), "the store stopped the OSD");
        assert_eq!(
            store
                .read(PG, obj(1), 0, BLOCK as u32)
                .await
                .unwrap()
                .as_slice(),
            &[0u8; BLOCK][..]
        );
    })
    .unwrap();
}

/// Simulator seed 13469: a forwarded write to a new object on a full disk
/// created the object's file and failed its metadata reservation; while that
/// reservation waited for the disk, another operation on the object that opens
/// without creating (a read here) found the file and loaded its (empty)
/// metadata. The writer took its file back (unlinked it) and the reader then
/// cached its open state of the unlinked file: once the disk had space, every
/// later write of the object landed in that orphan, acknowledged, while the
/// object's file on disk stayed missing — this copy lost every block of it.
/// Only one task opens an object at a time; the others use its result.
#[test]
fn a_read_racing_a_create_refused_for_a_full_disk_caches_no_unlinked_file() {
    let mut r = Reactor::new(ReactorConfig::default()).unwrap();
    r.block_on(async {
        let (sim, fs, root) = sim_dir();
        // Every disk operation takes the same time: the read's metadata load
        // ends just after the refused create took its file back.
        sim.set_latency(100..=100, 1);
        let store = Rc::new(ObjectStore::with_fs(
            fs.clone(),
            &root,
            0,
            opts(false, true),
        ));
        store
            .write(PG, obj(0), 0, PayloadBuf::copy_from(&[1u8; BLOCK]), false)
            .await
            .unwrap();
        store.flush(None).await.unwrap();
        sim.set_full(true);
        let s = store.clone();
        let write = reactor::spawn(async move {
            s.write(PG, obj(1), 0, PayloadBuf::copy_from(&[2u8; BLOCK]), false)
                .await
        });
        let s = store.clone();
        let read = reactor::spawn(async move { s.read(PG, obj(1), 0, BLOCK as u32).await });
        let err = write.await.expect_err("a new object on a full disk");
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        assert_eq!(read.await.unwrap().as_slice(), &[0u8; BLOCK][..]);
        // Space again: the object is written, and flushed.
        sim.set_full(false);
        store
            .write(PG, obj(1), 0, PayloadBuf::copy_from(&[3u8; BLOCK]), false)
            .await
            .unwrap();
        store.flush(None).await.unwrap();
        assert!(
            sim.paths().contains(&store.object_path(PG, obj(1))),
            "the acknowledged write went to an unlinked file"
        );
        // What the disk holds, through a store that opens it afresh.
        let fresh = ObjectStore::with_fs(fs.clone(), &root, 0, opts(false, true));
        assert_eq!(
            fresh
                .read(PG, obj(1), 0, BLOCK as u32)
                .await
                .unwrap()
                .as_slice(),
            &[3u8; BLOCK][..]
        );
    })
    .unwrap();
}

/// Seed 230811: the blocks a copy in doubt wrote whole since its start-up are
/// sure whatever the restart's power cut took. Only tracked objects are
/// marked; a partial block keeps older bytes and is not; a zeroing (also of an
/// absent object), a repair and a removal are.
#[test]
fn blocks_rewritten_since_start_up_are_marked_for_tracked_objects_only() {
    with_store(opts(false, true), async |s, _| {
        s.track_rewrites([obj(1), obj(2)]);
        let b = BLOCK as u32;
        // Blocks 1 and 2 whole, and part of block 4.
        s.write(PG, obj(1), b, PayloadBuf::copy_from(&[1; 2 * BLOCK]), false)
            .await
            .unwrap();
        s.write(
            PG,
            obj(1),
            4 * b + 512,
            PayloadBuf::copy_from(&[1; 1024]),
            false,
        )
        .await
        .unwrap();
        assert_eq!(s.rewritten_blocks(obj(1)), vec![(1, 3)]);
        s.zero(PG, obj(1), 3 * b, b, false).await.unwrap();
        s.repair_range(PG, obj(1), 6, &[2; BLOCK]).await.unwrap();
        assert_eq!(s.rewritten_blocks(obj(1)), vec![(1, 4), (6, 7)]);
        // A zeroing of an object with no file: it reads as zero, surely.
        s.zero(PG, obj(2), 0, 2 * b, false).await.unwrap();
        assert_eq!(s.rewritten_blocks(obj(2)), vec![(0, 2)]);
        // Not tracked: nothing.
        s.write(PG, obj(3), 0, PayloadBuf::copy_from(&[1; BLOCK]), false)
            .await
            .unwrap();
        assert!(s.rewritten_blocks(obj(3)).is_empty());
        // Removed: every block reads as zero, surely.
        assert!(s.remove_object(PG, obj(1)).await.unwrap());
        assert_eq!(
            s.rewritten_blocks(obj(1)),
            vec![(0, crate::store::meta::BLOCKS_MAX as u32)]
        );
        // Settled: no longer tracked, nothing more noted.
        s.untrack_rewrites([obj(2)]);
        s.write(PG, obj(2), 0, PayloadBuf::copy_from(&[1; BLOCK]), false)
            .await
            .unwrap();
        assert!(s.rewritten_blocks(obj(2)).is_empty());
    });
}
