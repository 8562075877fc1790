//! The client library against a scripted cluster (fake manager + fake OSDs, see
//! `fake_cluster`): I/O across object boundaries, out-of-order replies, retries
//! after dropped connections and ESTALE/EAGAIN, waiting for a down primary,
//! timeouts, map changes, flush fan-out, volume deletion, and flame-admin commands.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

mod fake_cluster;

use fake_cluster::{FakeCluster, small_pool};
use flame_client::admin::{Cli, execute};
use flame_client::bench::{self, BenchConfig, Pattern};
use flame_client::{ClientConfig, ClientError, Cluster, MgrClient};
use flame_common::buffer::PayloadBuf;
use flame_common::ids::{OsdId, VolumeId};
use flame_common::map::VolumeInfo;
use flame_common::reactor::{self, Reactor, ReactorConfig};
use std::future::Future;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn run<F: Future + 'static>(f: F) -> F::Output
where
    F::Output: 'static,
{
    let mut r = Reactor::new(ReactorConfig::default()).unwrap();
    r.block_on(f).unwrap()
}

fn config(fake: &FakeCluster) -> ClientConfig {
    ClientConfig {
        map_refresh_ms: 50,
        io_timeout_ms: 10_000,
        ..ClientConfig::new(fake.mgr_addr.to_string())
    }
}

fn connect(fake: &FakeCluster) -> Cluster {
    Cluster::connect(config(fake)).unwrap()
}

/// Deterministic non-zero bytes, different per seed.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(31).wrapping_add(seed * 7919) % 251 + 1) as u8)
        .collect()
}

#[test]
fn read_write_across_object_boundaries() {
    let fake = FakeCluster::start(3, 2, small_pool(2), MIB);
    let cluster = connect(&fake);
    let model = run(async move {
        let vol = cluster.open_volume("vol").await.unwrap();
        assert_eq!(vol.size(), MIB);
        assert_eq!(vol.object_size(), 64 << 10);
        let mut model = vec![0u8; MIB as usize];
        let cases: [(u64, usize); 7] = [
            (0, 100),
            (64 * KIB - 10, 20),            // straddles objects 0 and 1
            (60_000, 200_000),              // spans objects 0..=3
            (128 * KIB, 64 * KIB as usize), // exactly object 2
            (MIB - 5000, 5000),             // the volume's last bytes
            (300_000, 1),
            (500_000, 0), // empty write is a no-op
        ];
        for (i, &(off, len)) in cases.iter().enumerate() {
            let data = pattern(i as u64 + 1, len);
            if i % 2 == 0 {
                vol.write_at(off, &data, i % 3 == 0).await.unwrap();
            } else {
                vol.write_buf(off, PayloadBuf::copy_from(&data), false)
                    .await
                    .unwrap();
            }
            model[off as usize..off as usize + len].copy_from_slice(&data);
        }
        let all = vol.read_at(0, MIB as usize).await.unwrap();
        assert!(
            all == model,
            "whole-volume read differs from what was written"
        );
        for (off, len) in [(64 * KIB - 6, 12usize), (1, 300_000), (MIB - 1, 1), (0, 0)] {
            let got = vol.read_at(off, len).await.unwrap();
            assert_eq!(
                got,
                model[off as usize..off as usize + len],
                "read {off}+{len}"
            );
        }
        model
    });
    assert_eq!(fake.total(|s| s.misrouted.load(Ordering::SeqCst)), 0);
    // Every written object sits on its primary, and more than one OSD took data.
    let mut holders = std::collections::HashSet::new();
    for idx in 0..16u64 {
        let chunk = &model[(idx * 64 * KIB) as usize..((idx + 1) * 64 * KIB) as usize];
        if chunk.iter().all(|&b| b == 0) {
            continue;
        }
        let p = fake.primary_of(idx);
        let objects = fake.osd(p).state.objects.lock().unwrap();
        assert_eq!(
            objects.get(&(7, idx)).map(|o| o.as_slice()),
            Some(chunk),
            "object {idx} on its primary {p}"
        );
        holders.insert(p);
    }
    assert!(holders.len() > 1, "all data on one OSD: {holders:?}");
}

#[test]
fn large_requests_are_cut_at_the_message_bound() {
    // 8 MiB objects: a 9 MiB write from 1 MiB is pieces of 4 + 3 MiB (object 0)
    // and 2 MiB (object 1).
    let pool = flame_common::map::PoolConfig {
        object_size: 8 << 20,
        ..small_pool(1)
    };
    let fake = FakeCluster::start(2, 1, pool, 32 * MIB);
    let cluster = connect(&fake);
    run(async move {
        let vol = cluster.open_volume("vol").await.unwrap();
        let data = pattern(3, 9 * MIB as usize);
        // One buffer, sent as three slices of itself.
        vol.write_buf(MIB, PayloadBuf::copy_from(&data), false)
            .await
            .unwrap();
        let got = vol.read_at(MIB, 9 * MIB as usize).await.unwrap();
        assert!(got == data);
        // The same read without the gathering copy: one reply buffer per piece.
        let bufs = vol.read_bufs(MIB, 9 * MIB as usize).await.unwrap();
        let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        assert_eq!(lens, vec![4 << 20, 3 << 20, 2 << 20]);
        assert!(
            bufs.iter()
                .flat_map(|b| b.iter().copied())
                .eq(data.iter().copied())
        );
    });
    assert_eq!(fake.total(|s| s.io_requests.load(Ordering::SeqCst)), 9);
    assert_eq!(fake.total(|s| s.misrouted.load(Ordering::SeqCst)), 0);
}

#[test]
fn replies_out_of_order_are_matched_by_id() {
    // One OSD, one shard: every request shares one connection.
    let fake = FakeCluster::start(1, 1, small_pool(1), MIB);
    let cluster = connect(&fake);
    let state = fake.osd(OsdId(0)).state.clone();
    let st = state.clone();
    run(async move {
        let vol = cluster.open_volume("vol").await.unwrap();
        st.delay_odd_ms.store(30, Ordering::SeqCst);
        let writers: Vec<_> = (0..16u64)
            .map(|i| {
                let vol = vol.clone();
                reactor::spawn(async move {
                    vol.write_at(i * 64 * KIB + 100, &pattern(i, 4096), false)
                        .await
                        .unwrap()
                })
            })
            .collect();
        for w in writers {
            w.await;
        }
        let readers: Vec<_> = (0..16u64)
            .map(|i| {
                let vol = vol.clone();
                reactor::spawn(async move {
                    let got = vol.read_at(i * 64 * KIB + 100, 4096).await.unwrap();
                    assert_eq!(got, pattern(i, 4096), "object {i}");
                })
            })
            .collect();
        for r in readers {
            r.await;
        }
        // Finished requests leave no timers behind.
        assert_eq!(flame_client::deadline::pending(), 0);
    });
    assert_eq!(
        state.hellos.load(Ordering::SeqCst),
        1,
        "one shared connection"
    );
    assert!(
        state.reordered.load(Ordering::SeqCst) > 0,
        "the fake never reordered replies; the test tests nothing"
    );
}

#[test]
fn dropped_connection_fails_over_to_a_new_one() {
    let fake = FakeCluster::start(1, 1, small_pool(1), MIB);
    let cluster = connect(&fake);
    let state = fake.osd(OsdId(0)).state.clone();
    run(async move {
        let vol = cluster.open_volume("vol").await.unwrap();
        vol.write_at(0, &pattern(9, 256 * KIB as usize), false)
            .await
            .unwrap();
        assert_eq!(state.hellos.load(Ordering::SeqCst), 1);
        // Many reads in flight; the connection dies under them after the third
        // request arrives. Every one must still succeed, on a new connection.
        state.delay_odd_ms.store(20, Ordering::SeqCst);
        state.drop_next.store(0, Ordering::SeqCst);
        let readers: Vec<_> = (0..8u64)
            .map(|i| {
                let vol = vol.clone();
                reactor::spawn(async move {
                    let off = (i % 4) * 64 * KIB + i;
                    let got = vol.read_at(off, 1000).await.unwrap();
                    let want = &pattern(9, 256 * KIB as usize)[off as usize..off as usize + 1000];
                    assert_eq!(got, want);
                })
            })
            .collect();
        // Let the first requests go out, then cut the connection on the next one.
        reactor::sleep(Duration::from_millis(2)).await;
        state.drop_next.store(1, Ordering::SeqCst);
        vol.read_at(0, 10).await.unwrap();
        for r in readers {
            r.await;
        }
        assert!(
            state.hellos.load(Ordering::SeqCst) >= 2,
            "no reconnection happened"
        );
    });
}

#[test]
fn estale_and_eagain_are_retried_eio_is_final() {
    let fake = FakeCluster::start(1, 1, small_pool(1), MIB);
    let cluster = connect(&fake);
    let state = fake.osd(OsdId(0)).state.clone();
    run(async move {
        let vol = cluster.open_volume("vol").await.unwrap();
        state.estale_next.store(2, Ordering::SeqCst);
        state.eagain_next.store(1, Ordering::SeqCst);
        vol.write_at(0, b"persistent", true).await.unwrap();
        assert_eq!(state.io_requests.load(Ordering::SeqCst), 4);
        assert_eq!(vol.read_at(0, 10).await.unwrap(), b"persistent");

        state.eio_next.store(1, Ordering::SeqCst);
        let e = vol.write_at(0, b"x", false).await.unwrap_err();
        assert!(
            matches!(e, ClientError::Osd { status, .. } if status == -libc::EIO),
            "{e:?}"
        );
        assert_eq!(e.errno(), libc::EIO);
    });
    let text = flame_common::metrics::render();
    assert!(text.contains("flame_client_retries_total{reason=\"estale\"}"));
    assert!(text.contains("flame_client_retries_total{reason=\"eagain\"}"));
}

#[test]
fn silent_osd_times_out() {
    let fake = FakeCluster::start(1, 1, small_pool(1), MIB);
    let cluster = Cluster::connect(ClientConfig {
        io_timeout_ms: 300,
        ..config(&fake)
    })
    .unwrap();
    let state = fake.osd(OsdId(0)).state.clone();
    run(async move {
        let vol = cluster.open_volume("vol").await.unwrap();
        state.hang.store(true, Ordering::SeqCst);
        let t0 = Instant::now();
        let e = vol.read_at(0, 4096).await.unwrap_err();
        let took = t0.elapsed();
        assert!(matches!(e, ClientError::Timeout { .. }), "{e:?}");
        assert!(
            took >= Duration::from_millis(280) && took < Duration::from_secs(3),
            "{took:?}"
        );
        // The OSD comes back: the same volume works again.
        state.hang.store(false, Ordering::SeqCst);
        vol.read_at(0, 4096).await.unwrap();
    });
}

#[test]
fn unreachable_osd_times_out_with_the_reason() {
    let fake = FakeCluster::start(1, 1, small_pool(1), MIB);
    // Point the map at a port nobody listens on.
    let dead = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    fake.update_map(|m| m.osds.get_mut(&OsdId(0)).unwrap().addr = dead);
    let cluster = Cluster::connect(ClientConfig {
        io_timeout_ms: 400,
        ..config(&fake)
    })
    .unwrap();
    run(async move {
        let vol = cluster.open_volume("vol").await.unwrap();
        let e = vol.read_at(0, 1).await.unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, ClientError::Timeout { .. }), "{msg}");
        assert!(msg.contains("connect"), "{msg}");
    });
}

#[test]
fn down_primary_waits_for_the_map_then_succeeds() {
    let fake = FakeCluster::start(3, 1, small_pool(1), MIB);
    let p = fake.primary_of(0);
    fake.update_map(|m| m.osds.get_mut(&p).unwrap().up = false);
    let cluster = connect(&fake);
    let map = fake.map.clone();
    let revive = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        let mut m = map.lock().unwrap();
        m.osds.get_mut(&p).unwrap().up = true;
        m.epoch.0 += 1;
    });
    run(async move {
        let vol = cluster.open_volume("vol").await.unwrap();
        let t0 = Instant::now();
        vol.write_at(10, b"waited", false).await.unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(250), "did not wait");
        assert_eq!(vol.read_at(10, 6).await.unwrap(), b"waited");
    });
    revive.join().unwrap();
    assert!(
        fake.osd(p)
            .state
            .objects
            .lock()
            .unwrap()
            .contains_key(&(7, 0))
    );
}

#[test]
fn down_primary_times_out_when_it_stays_down() {
    let fake = FakeCluster::start(2, 1, small_pool(1), MIB);
    let p = fake.primary_of(0);
    fake.update_map(|m| m.osds.get_mut(&p).unwrap().up = false);
    let cluster = Cluster::connect(ClientConfig {
        io_timeout_ms: 300,
        ..config(&fake)
    })
    .unwrap();
    run(async move {
        let vol = cluster.open_volume("vol").await.unwrap();
        let e = vol.read_at(0, 1).await.unwrap_err();
        assert!(e.to_string().contains("down"), "{e}");
    });
    assert_eq!(fake.total(|s| s.io_requests.load(Ordering::SeqCst)), 0);
}

#[test]
fn map_changes_are_followed() {
    let fake = FakeCluster::start(3, 2, small_pool(1), MIB);
    let cluster = connect(&fake);
    let map = fake.map.clone();
    run(async move {
        let vol = cluster.open_volume("vol").await.unwrap();
        let e = vol.write_at(MIB + 10, b"x", false).await.unwrap_err();
        assert!(matches!(e, ClientError::OutOfRange { .. }), "{e:?}");
        // Grow the volume and move placement (an OSD goes out) in one epoch.
        {
            let mut m = map.lock().unwrap();
            m.volumes.get_mut("vol").unwrap().size = 2 * MIB;
            m.osds.get_mut(&OsdId(1)).unwrap().r#in = false;
            m.epoch.0 += 1;
        }
        let t0 = Instant::now();
        while vol.size() != 2 * MIB {
            assert!(t0.elapsed() < Duration::from_secs(3), "resize not seen");
            reactor::sleep(Duration::from_millis(5)).await;
        }
        for i in 0..32u64 {
            vol.write_at(i * 64 * KIB, &pattern(i, 512), false)
                .await
                .unwrap();
        }
        for i in 0..32u64 {
            assert_eq!(
                vol.read_at(i * 64 * KIB, 512).await.unwrap(),
                pattern(i, 512)
            );
        }
    });
    // Nothing went to the OSD that left placement, and nothing was misrouted.
    assert_eq!(
        fake.osd(OsdId(1)).state.io_requests.load(Ordering::SeqCst),
        0
    );
    assert_eq!(fake.total(|s| s.misrouted.load(Ordering::SeqCst)), 0);
}

#[test]
fn epoch_mismatch_triggers_refresh_and_retry() {
    let fake = FakeCluster::start(1, 1, small_pool(1), MIB);
    // A slow watcher, so the on-demand refresh must do the work.
    let cluster = Cluster::connect(ClientConfig {
        map_refresh_ms: 60_000,
        map_wait_ms: 1,
        ..config(&fake)
    })
    .unwrap();
    let map = fake.map.clone();
    let state = fake.osd(OsdId(0)).state.clone();
    run(async move {
        let vol = cluster.open_volume("vol").await.unwrap();
        vol.write_at(0, b"a", false).await.unwrap();
        // Let the watcher's first poll happen, then change the epoch behind it.
        reactor::sleep(Duration::from_millis(100)).await;
        map.lock().unwrap().epoch.0 += 1;
        let t0 = Instant::now();
        vol.write_at(0, b"b", false).await.unwrap();
        assert!(t0.elapsed() < Duration::from_secs(2));
        assert!(state.epoch_mismatch.load(Ordering::SeqCst) >= 1);
        assert_eq!(cluster.epoch(), map.lock().unwrap().epoch);
    });
}

#[test]
fn flush_reaches_every_shard_holding_the_volume_and_no_other() {
    let fake = FakeCluster::start(3, 2, small_pool(2), MIB);
    fake.update_map(|m| m.osds.get_mut(&OsdId(2)).unwrap().r#in = false);
    let cluster = connect(&fake);
    let map = fake.map.lock().unwrap().clone();
    let vol_id = map.volumes["vol"].id;
    run(async move {
        let vol = cluster.open_volume("vol").await.unwrap();
        vol.write_at(0, b"data", false).await.unwrap();
        vol.flush().await.unwrap();
    });
    // Expected: the owning shard of every acting-set member of every placement
    // group of the volume's objects, computed independently of the client.
    let table = flame_common::placement::PgTable::new(&map);
    let objects = map.volumes["vol"]
        .size
        .div_ceil(u64::from(map.pool.object_size));
    let mut expect: std::collections::BTreeMap<u32, std::collections::BTreeSet<u16>> =
        Default::default();
    for index in 0..objects {
        let (pg, osds) = table.locate(flame_common::ids::ObjectId {
            volume: vol_id,
            index,
        });
        for o in &osds.placed {
            expect
                .entry(o.0)
                .or_default()
                .insert(map.osds[o].shard_of(pg));
        }
    }
    assert!(!expect.is_empty());
    for id in [0u32, 1, 2] {
        let f = fake.osd(OsdId(id)).state.flushes.lock().unwrap().clone();
        let got: std::collections::BTreeSet<u16> = f.keys().copied().collect();
        assert_eq!(
            got,
            expect.get(&id).cloned().unwrap_or_default(),
            "osd.{id}: flushed shards {f:?}"
        );
        assert!(f.values().all(|&n| n == 1), "osd.{id}: {f:?}");
    }
    assert!(fake.osd(OsdId(2)).state.flushes.lock().unwrap().is_empty());
}

#[test]
fn flush_of_a_small_volume_skips_shards_without_its_pgs() {
    // A volume of one object lives in one placement group: its flush must reach
    // that group's acting set only (2 OSDs × 1 shard), not all 3 × 4 shards.
    let fake = FakeCluster::start(3, 4, small_pool(2), MIB);
    let object_size = u64::from(fake.map.lock().unwrap().pool.object_size);
    fake.update_map(|m| m.volumes.get_mut("vol").unwrap().size = object_size);
    let cluster = connect(&fake);
    run(async move {
        let vol = cluster.open_volume("vol").await.unwrap();
        vol.flush().await.unwrap();
    });
    let total: usize = (0..3)
        .map(|i| fake.osd(OsdId(i)).state.flushes.lock().unwrap().len())
        .sum();
    assert_eq!(
        total, 2,
        "a one-object volume's flush reached {total} shards"
    );
}

#[test]
fn delete_volume_objects_on_every_osd_that_is_up() {
    let fake = FakeCluster::start(3, 2, small_pool(1), MIB);
    let cluster = connect(&fake);
    let c = cluster.clone();
    run(async move {
        let vol = c.open_volume("vol").await.unwrap();
        for i in 0..16u64 {
            vol.write_at(i * 64 * KIB, b"junk", false).await.unwrap();
        }
        c.delete_volume_objects(VolumeId(7)).await.unwrap();
        for i in 0..16u64 {
            assert_eq!(vol.read_at(i * 64 * KIB, 4).await.unwrap(), vec![0; 4]);
        }
    });
    for o in &fake.osds {
        let d = o.state.deletes.lock().unwrap().clone();
        assert_eq!((d.get(&0), d.get(&1)), (Some(&1), Some(&1)), "{}", o.id);
        assert!(o.state.objects.lock().unwrap().is_empty());
    }
    // With an OSD down the others delete, and the down one is not contacted (it
    // deletes its copies from the map's tombstone when it is back).
    fake.update_map(|m| m.osds.get_mut(&OsdId(1)).unwrap().up = false);
    let c = cluster.clone();
    run(async move {
        c.refresh_map_now().await;
        c.delete_volume_objects(VolumeId(7)).await.unwrap();
    });
    for o in &fake.osds {
        let d = o.state.deletes.lock().unwrap().clone();
        let want = if o.id == OsdId(1) { 2 } else { 4 };
        assert_eq!(d.values().sum::<u32>(), want, "{}", o.id);
    }
}

#[test]
fn unknown_and_newly_created_volumes() {
    let fake = FakeCluster::start(1, 1, small_pool(1), MIB);
    let cluster = Cluster::connect(ClientConfig {
        map_refresh_ms: 60_000,
        map_wait_ms: 1,
        ..config(&fake)
    })
    .unwrap();
    let map = fake.map.clone();
    run(async move {
        let e = cluster.open_volume("nope").await.unwrap_err();
        assert!(
            matches!(e, ClientError::NoSuchVolume(ref n) if n == "nope"),
            "{e:?}"
        );
        // Created after our map was fetched: found through an on-demand refresh.
        {
            let mut m = map.lock().unwrap();
            m.volumes.insert(
                "late".into(),
                VolumeInfo {
                    id: VolumeId(8),
                    name: "late".into(),
                    size: 4096,
                    created_unix: 0,
                },
            );
            m.epoch.0 += 1;
        }
        let v = cluster.open_volume("late").await.unwrap();
        assert_eq!(v.size(), 4096);
        v.write_at(4000, &[1; 96], false).await.unwrap();
        // A removed volume's handle fails instead of writing into the void.
        {
            let mut m = map.lock().unwrap();
            m.volumes.remove("late");
            m.epoch.0 += 1;
        }
        cluster.refresh_map_now().await;
        assert_eq!(v.size(), 0);
        let e = v.read_at(0, 1).await.unwrap_err();
        assert!(matches!(e, ClientError::NoSuchVolume(_)), "{e:?}");
    });
}

#[test]
fn out_of_range_and_zeroing() {
    let fake = FakeCluster::start(2, 2, small_pool(1), MIB);
    let cluster = connect(&fake);
    run(async move {
        let vol = cluster.open_volume("vol").await.unwrap();
        for (off, len) in [(MIB, 1u64), (MIB - 1, 2), (u64::MAX, 2)] {
            let e = vol.read_at(off, len as usize).await.unwrap_err();
            assert!(matches!(e, ClientError::OutOfRange { .. }), "{e:?}");
            let e = vol.write_zeroes(off, len, false).await.unwrap_err();
            assert!(matches!(e, ClientError::OutOfRange { .. }), "{e:?}");
            let e = vol.discard(off, len).await.unwrap_err();
            assert!(matches!(e, ClientError::OutOfRange { .. }), "{e:?}");
        }
        assert!(vol.read_at(MIB, 0).await.unwrap().is_empty());
        let data = pattern(5, 300_000);
        vol.write_at(0, &data, false).await.unwrap();
        vol.write_zeroes(1000, 100_000, true).await.unwrap();
        vol.discard(200_000, 50_000).await.unwrap();
        let got = vol.read_at(0, 300_000).await.unwrap();
        let mut want = data.clone();
        want[1000..101_000].fill(0);
        want[200_000..250_000].fill(0);
        assert!(got == want);
    });
}

#[test]
fn bench_runs_against_the_fake() {
    let fake = FakeCluster::start(3, 2, small_pool(2), 4 * MIB);
    let cluster = connect(&fake);
    let report = run(async move {
        let vol = cluster.open_volume("vol").await.unwrap();
        let cfg = BenchConfig {
            pattern: Pattern::Randwrite,
            block_bytes: 4096,
            iodepth: 8,
            runtime: Duration::from_millis(300),
            size_limit: Some(MIB),
            seed: 3,
        };
        bench::run(&vol, &cfg).await.unwrap()
    });
    assert!(report.ops > 0);
    assert_eq!(report.bytes, report.ops * 4096);
    assert_eq!(report.region_bytes, MIB);
    assert!(report.latency.p50_us <= report.latency.p99_us);
    assert!(report.latency.p99_us <= report.latency.max_us);
    assert!(report.elapsed_s >= 0.3 && report.elapsed_s < 5.0);
    assert_eq!(fake.total(|s| s.misrouted.load(Ordering::SeqCst)), 0);
    // Only the first MiB (objects 0..16) was touched.
    for o in &fake.osds {
        assert!(o.state.objects.lock().unwrap().keys().all(|(_, i)| *i < 16));
    }
}

#[test]
fn manager_errors_are_shown_verbatim() {
    let fake = FakeCluster::start(1, 1, small_pool(1), MIB);
    let mgr = MgrClient::new(&fake.mgr_addr.to_string()).unwrap();
    let e = mgr.volume("missing").unwrap_err();
    assert!(matches!(e, ClientError::Api { status: 404, .. }), "{e:?}");
    assert!(e.to_string().contains("no volume named missing"), "{e}");
    let e = mgr.resize_volume("vol", 10, false).unwrap_err();
    assert!(e.to_string().contains("allow_shrink"), "{e}");
}

fn admin(fake: &FakeCluster, args: &[&str]) -> Result<String, String> {
    use clap::Parser;
    let mgr = fake.mgr_addr.to_string();
    let argv = ["flame-admin", "--mgr", mgr.as_str()]
        .into_iter()
        .chain(args.iter().copied());
    let cli = Cli::try_parse_from(argv).map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    execute(&cli, &mut out).map_err(|e| e.to_string())?;
    Ok(String::from_utf8(out).unwrap())
}

fn admin_json(fake: &FakeCluster, args: &[&str]) -> serde_json::Value {
    let mut a = vec!["--json"];
    a.extend_from_slice(args);
    let text = admin(fake, &a).unwrap();
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

#[test]
fn admin_commands_against_the_fake_cluster() {
    let fake = FakeCluster::start(3, 2, small_pool(2), MIB);
    let s = admin_json(&fake, &["status"]);
    assert_eq!(s["health"], "HEALTH_OK");
    assert_eq!(s["osds_up"], 3);
    let human = admin(&fake, &["status"]).unwrap();
    assert!(human.contains("3 total, 3 up, 3 in"), "{human}");

    let osds = admin(&fake, &["osd", "ls"]).unwrap();
    assert!(osds.starts_with("ID"), "{osds}");
    assert!(osds.contains("osd.2") && osds.contains("host1"), "{osds}");
    assert_eq!(
        admin_json(&fake, &["osd", "ls"]).as_array().unwrap().len(),
        3
    );

    let v = admin_json(&fake, &["volume", "create", "extra", "--size", "1M"]);
    assert_eq!(v["size"], MIB);
    assert_eq!(v["objects"], 16);
    let info = admin(&fake, &["volume", "info", "extra"]).unwrap();
    assert!(info.contains("16 of 64.0 KiB"), "{info}");
    let ls = admin_json(&fake, &["volume", "ls"]);
    assert_eq!(ls.as_array().unwrap().len(), 2);
    let e = admin(&fake, &["volume", "resize", "extra", "--size", "512K"]).unwrap_err();
    assert!(e.contains("allow_shrink"), "{e}");
    let r = admin_json(
        &fake,
        &[
            "volume",
            "resize",
            "extra",
            "--size",
            "512K",
            "--allow-shrink",
        ],
    );
    assert_eq!(r["size"], 512 * KIB);
    let e = admin(&fake, &["volume", "info", "nope"]).unwrap_err();
    assert!(e.contains("no volume named nope"), "{e}");

    let l = admin_json(&fake, &["locate", "vol", "64K"]);
    assert_eq!(l["object_index"], 1);
    assert_eq!(l["osds"][0]["role"], "primary");
    assert_eq!(l["osds"][0]["id"], fake.primary_of(1).0);
    assert_eq!(l["osds"].as_array().unwrap().len(), 2);
    let human = admin(&fake, &["locate", "vol", "65536"]).unwrap();
    assert!(
        human.contains("primary") && human.contains("replica"),
        "{human}"
    );
    assert!(admin(&fake, &["locate", "vol", "1M"]).is_err());

    let b = admin_json(
        &fake,
        &[
            "bench",
            "vol",
            "--rw",
            "write",
            "--bs",
            "64k",
            "--iodepth",
            "4",
            "--runtime",
            "200ms",
        ],
    );
    assert!(b["ops"].as_u64().unwrap() > 0, "{b}");

    // Removal with an OSD down: deleted on the OSDs that are up, the down one
    // is not contacted (the map's tombstone makes it delete its copies when it is
    // back), and the output says so.
    fake.update_map(|m| m.osds.get_mut(&OsdId(0)).unwrap().up = false);
    let out = admin(&fake, &["volume", "rm", "vol"]).unwrap();
    assert!(out.contains("removed volume vol"), "{out}");
    assert!(out.contains("osd.0 (down) will delete theirs"), "{out}");
    assert!(!fake.map.lock().unwrap().volumes.contains_key("vol"));
    for o in &fake.osds {
        let deletes = o.state.deletes.lock().unwrap().values().sum::<u32>();
        if o.id == OsdId(0) {
            assert_eq!(deletes, 0, "a down OSD was contacted");
        } else {
            assert_eq!(deletes, 2);
            assert!(o.state.objects.lock().unwrap().keys().all(|(v, _)| *v != 7));
        }
    }
}

#[test]
fn unreachable_manager_is_an_error_not_a_hang() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let t0 = Instant::now();
    let e = Cluster::connect(ClientConfig::new(port.to_string())).unwrap_err();
    assert!(matches!(e, ClientError::Mgr { .. }), "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[test]
fn sequential_reactors_on_one_thread_reconnect() {
    let fake = FakeCluster::start(1, 1, small_pool(1), MIB);
    let cluster = connect(&fake);
    for round in 0..3u8 {
        let c = cluster.clone();
        run(async move {
            let vol = c.open_volume("vol").await.unwrap();
            vol.write_at(0, &[round; 8], false).await.unwrap();
            assert_eq!(vol.read_at(0, 8).await.unwrap(), vec![round; 8]);
        });
    }
}
