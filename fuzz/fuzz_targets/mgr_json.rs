//! Fuzzes the manager's JSON decoders (`flame-mgr`): every POST route's request
//! body (decoded as `ApiJson` does, then applied to a live three-OSD state the way
//! the route applies it) and `state.json` (decoded, checked and turned into the
//! state machine, as `Store::load` and start-up do). Input byte 0 picks the route
//! (or the state file) and whether the rest is the body as it is or mutations of a
//! valid one. Nothing may panic; the state must pass its own check after every
//! request. Property tests: `flame-mgr/tests/json_decode_props.rs`.
#![no_main]

use flame_common::fuzzing::{mutate, mutations_from};
use flame_common::ids::{Epoch, OsdId, PgId, VolumeId};
use flame_common::map::PoolConfig;
use flame_common::mgr_api::*;
use flame_mgr::state::{ClusterState, PersistedState};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use std::time::Instant;

fn boot(uuid: &str, port: u16) -> OsdBoot {
    OsdBoot {
        fsid: None,
        uuid: uuid.into(),
        id: None,
        addr: format!("127.0.0.1:{port}").parse().expect("address"),
        shards: 2,
        host: format!("h{port}"),
        weight: 1.0,
        metrics_addr: None,
        incarnation: 1,
    }
}

fn cluster() -> &'static ClusterState {
    static C: OnceLock<ClusterState> = OnceLock::new();
    C.get_or_init(|| {
        let pool = PoolConfig {
            pg_count: 32,
            ..Default::default()
        };
        let mut s = ClusterState::new(
            PersistedState::new_cluster("fuzz-fsid".into(), pool),
            Instant::now(),
        );
        for (i, u) in ["a", "b", "c"].iter().enumerate() {
            s.boot(&boot(u, 6900 + 10 * i as u16), Instant::now())
                .expect("boot");
        }
        s.create_volume(
            &VolumeCreate {
                name: "v".into(),
                size: 64 << 20,
            },
            1,
        )
        .expect("volume");
        s
    })
}

fn valid(route: u8) -> Vec<u8> {
    let j = |r: serde_json::Result<Vec<u8>>| r.expect("serialize");
    match route {
        0 => j(serde_json::to_vec(&boot("d", 6930))),
        1 => j(serde_json::to_vec(&OsdHeartbeat {
            id: OsdId(0),
            uuid: "a".into(),
            epoch: Epoch(3),
            used_bytes: 10,
            capacity_bytes: 100,
            recovery: None,
            object_bytes: 5,
        })),
        2 => j(serde_json::to_vec(&OsdFailureReport {
            reporter: OsdId(0),
            uuid: "a".into(),
            failed: OsdId(1),
            epoch: Epoch(3),
        })),
        3 => j(serde_json::to_vec(&PgRecoveredReport {
            reporter: OsdId(0),
            uuid: "a".into(),
            epoch: Epoch(3),
            recovered: vec![(PgId(1), OsdId(2))],
        })),
        4 => j(serde_json::to_vec(&OsdReweight { weight: 0.5 })),
        5 => j(serde_json::to_vec(&VolumeCreate {
            name: "w".into(),
            size: 1 << 30,
        })),
        6 => j(serde_json::to_vec(&VolumeResize {
            size: 16 << 20,
            allow_shrink: true,
        })),
        7 => j(serde_json::to_vec(&TrimDone {
            volume: VolumeId(1),
            range: TrimRange {
                from: 16 << 20,
                to: 64 << 20,
            },
        })),
        _ => j(serde_json::to_vec(&cluster().persisted)),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let route = (mode & 0x7f) % 9;
    let body = if mode & 0x80 != 0 {
        let mut b = valid(route);
        mutate(&mut b, &mutations_from(rest, 32));
        b
    } else {
        rest.to_vec()
    };
    let b = &body[..];
    let mut s = cluster().clone();
    let now = Instant::now();
    let _ = match route {
        0 => serde_json::from_slice::<OsdBoot>(b).map(|r| drop(s.boot(&r, now))),
        1 => serde_json::from_slice::<OsdHeartbeat>(b).map(|r| drop(s.heartbeat(&r, now))),
        2 => serde_json::from_slice::<OsdFailureReport>(b).map(|r| drop(s.failure_report(&r, now))),
        3 => serde_json::from_slice::<PgRecoveredReport>(b).map(|r| drop(s.pg_recovered(&r))),
        4 => serde_json::from_slice::<OsdReweight>(b).map(|r| drop(s.reweight(OsdId(1), r.weight))),
        5 => serde_json::from_slice::<VolumeCreate>(b).map(|r| drop(s.create_volume(&r, 2))),
        6 => serde_json::from_slice::<VolumeResize>(b).map(|r| drop(s.resize_volume("v", &r))),
        7 => serde_json::from_slice::<TrimDone>(b).map(|r| drop(s.trim_done("v", &r))),
        _ => {
            if let Ok(p) = serde_json::from_slice::<PersistedState>(b)
                && p.check().is_ok()
            {
                let mut c = ClusterState::new(p, now);
                let _ = c.create_volume(
                    &VolumeCreate {
                        name: "z".into(),
                        size: 1 << 20,
                    },
                    3,
                );
            }
            Ok(())
        }
    };
    s.persisted
        .check()
        .expect("state consistent after a request");
});
