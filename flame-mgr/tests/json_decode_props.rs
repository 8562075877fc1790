//! Property tests of the manager's two JSON decoders: its request bodies (`ApiJson`
//! in `src/api.rs`: `serde_json` into the `flame_common::mgr_api` types, then the
//! state rule the route applies) and its `state.json` (`Store::load` in
//! `src/store.rs`: size bound, `serde_json`, `PersistedState::check`, then
//! `ClusterState::new` as at start-up). Valid encodings with bytes flipped,
//! inserted, deleted or cut, and arbitrary JSON-ish text, must be refused with an
//! error or accepted — and whatever is accepted must be applied (or refused by the
//! state rules) without a panic: a decoded body's numbers reach volume sizes,
//! weights, epochs and placement. Decoded values re-encode to equal values.
//!
//! Seeded and bounded (`PROPTEST_CASES` / `PROPTEST_RNG_SEED` override); the
//! cargo-fuzz target is `fuzz/fuzz_targets/mgr_json.rs`.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::fuzzing::mutate;
use flame_common::fuzzing::props::{config, mutations};
use flame_common::ids::{Epoch, OsdId, PgId, VolumeId};
use flame_common::map::PoolConfig;
use flame_common::mgr_api::*;
use flame_mgr::state::{ClusterState, PersistedState};
use flame_mgr::store::Store;
use proptest::prelude::*;
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::sync::OnceLock;
use std::time::Instant;

/// This file's proptest seed (`config`).
const SEED: u64 = 0xf1a3_0020;

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

/// A small live cluster: three OSDs up, one volume.
fn cluster() -> ClusterState {
    let pool = PoolConfig {
        pg_count: 32,
        ..Default::default()
    };
    let mut s = ClusterState::new(
        PersistedState::new_cluster("test-fsid".into(), pool),
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
}

/// Valid bodies of every POST route, as JSON.
fn bodies() -> &'static Vec<(&'static str, Vec<u8>)> {
    static B: OnceLock<Vec<(&'static str, Vec<u8>)>> = OnceLock::new();
    B.get_or_init(|| {
        let j = |v: &dyn erased::Json| v.json();
        vec![
            ("boot", j(&boot("d", 6930))),
            (
                "heartbeat",
                j(&OsdHeartbeat {
                    id: OsdId(0),
                    uuid: "a".into(),
                    epoch: Epoch(3),
                    used_bytes: 10,
                    capacity_bytes: 100,
                    recovery: None,
                    object_bytes: 5,
                }),
            ),
            (
                "failure",
                j(&OsdFailureReport {
                    reporter: OsdId(0),
                    uuid: "a".into(),
                    failed: OsdId(1),
                    epoch: Epoch(3),
                }),
            ),
            (
                "recovered",
                j(&PgRecoveredReport {
                    reporter: OsdId(0),
                    uuid: "a".into(),
                    epoch: Epoch(3),
                    recovered: vec![(PgId(1), OsdId(2))],
                }),
            ),
            ("reweight", j(&OsdReweight { weight: 0.5 })),
            (
                "create",
                j(&VolumeCreate {
                    name: "w".into(),
                    size: 1 << 30,
                }),
            ),
            (
                "resize",
                j(&VolumeResize {
                    size: 16 << 20,
                    allow_shrink: true,
                }),
            ),
            (
                "trim",
                j(&TrimDone {
                    volume: VolumeId(1),
                    range: TrimRange {
                        from: 16 << 20,
                        to: 64 << 20,
                    },
                }),
            ),
        ]
    })
}

mod erased {
    /// Serialize without naming the type (the table above holds eight).
    pub trait Json {
        fn json(&self) -> Vec<u8>;
    }
    impl<T: serde::Serialize> Json for T {
        fn json(&self) -> Vec<u8> {
            serde_json::to_vec(self).expect("serialize")
        }
    }
}

/// Decodes `b` as `T`; what decodes must re-encode to an equal value.
fn decode<T: DeserializeOwned + Serialize>(b: &[u8]) -> Option<T> {
    let v: T = serde_json::from_slice(b).ok()?;
    let again = serde_json::to_value(&v).expect("re-encode");
    let back: T = serde_json::from_value(again.clone()).expect("decode what was encoded");
    assert_eq!(serde_json::to_value(&back).expect("re-encode"), again);
    Some(v)
}

/// What the route named `route` does with body `b` (see `src/api.rs`).
fn apply(s: &mut ClusterState, route: &str, b: &[u8]) {
    let now = Instant::now();
    let _ = match route {
        "boot" => decode::<OsdBoot>(b).map(|r| s.boot(&r, now).map(drop)),
        "heartbeat" => decode::<OsdHeartbeat>(b).map(|r| s.heartbeat(&r, now)),
        "failure" => decode::<OsdFailureReport>(b).map(|r| s.failure_report(&r, now).map(drop)),
        "recovered" => decode::<PgRecoveredReport>(b).map(|r| s.pg_recovered(&r).map(drop)),
        "reweight" => decode::<OsdReweight>(b).map(|r| s.reweight(OsdId(1), r.weight).map(drop)),
        "create" => decode::<VolumeCreate>(b).map(|r| s.create_volume(&r, 2).map(drop)),
        "resize" => decode::<VolumeResize>(b).map(|r| s.resize_volume("v", &r).map(drop)),
        "trim" => decode::<TrimDone>(b).map(|r| s.trim_done("v", &r).map(drop)),
        _ => unreachable!("no route {route}"),
    };
    // Whatever was applied leaves a state that passes its own check.
    s.persisted
        .check()
        .expect("state consistent after a request");
}

proptest! {
    #![proptest_config(config(256, SEED))]

    #[test]
    fn request_bodies_decode_and_apply_safely(
        which in 0usize..8,
        m in mutations(8),
        text in "[\\[\\]{}\",:0-9a-z.eE+-]{0,60}",
    ) {
        let (route, valid) = &bodies()[which];
        let mut s = cluster();
        apply(&mut s, route, valid);
        let mut b = valid.clone();
        mutate(&mut b, &m);
        apply(&mut s, route, &b);
        apply(&mut s, route, text.as_bytes());
    }

    #[test]
    fn state_files_load_or_are_refused(m in mutations(8), step in 0usize..8) {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = Store::open(dir.path()).expect("store");
        let mut s = cluster();
        // A state a few requests along, so more of its fields are non-trivial.
        let (route, body) = &bodies()[step];
        apply(&mut s, route, body);
        let valid = serde_json::to_vec_pretty(&s.persisted).expect("serialize");
        std::fs::write(store.state_path(), &valid).expect("write");
        let loaded = store.load().expect("a saved state loads").expect("present");
        prop_assert_eq!(&loaded, &s.persisted);
        let mut b = valid;
        mutate(&mut b, &m);
        std::fs::write(store.state_path(), &b).expect("write");
        if let Ok(Some(p)) = store.load() {
            // As at start-up: the state machine is built from what loaded.
            let mut c = ClusterState::new(p.clone(), Instant::now());
            let _ = c.create_volume(&VolumeCreate { name: "z".into(), size: 1 << 20 }, 3);
            let again: PersistedState =
                serde_json::from_slice(&serde_json::to_vec(&p).expect("serialize")).expect("reload");
            prop_assert_eq!(again, p);
        }
    }
}
