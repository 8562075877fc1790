//! Placement-group states as an operator sees them, computed from the map alone.
//!
//! The roles of a group ([`PgMembers`]) say who does what; this module turns them
//! into the state names operators know from Ceph, so `flame-admin pg ls`, the
//! manager's health, its metrics and the Grafana panels all use one vocabulary and
//! one definition. It is a pure function of the map: every process computing it
//! from the same epoch gets the same answer, and it is unit-testable without a
//! cluster.
//!
//! | flag | meaning | I/O |
//! |---|---|---|
//! | `active` | at least `min_size` complete copies are up | served |
//! | `inactive` | fewer than `min_size` complete copies are up | waits (no error, no stale data) until enough are back |
//! | `clean` | `size` complete copies up, exactly where placement puts them | served |
//! | `degraded` | fewer than `size` complete copies are up | served if `active` |
//! | `recovering` | some placed member is up but not complete: the primary is copying to it | served if `active` |
//! | `remapped` | some complete copy is on an OSD placement no longer chooses (misplaced data, kept until the new members are complete) | served if `active` |
//! | `incomplete` | no complete copy is up at all | waits until one is back |
//!
//! A state is written as in Ceph: `active` or `inactive` first, then the flags that
//! hold, in the order of [`PgState::FLAG_NAMES`]: `active+clean`,
//! `active+recovering+degraded`, `inactive+degraded`, `inactive+incomplete`.

use crate::map::PoolConfig;
use crate::placement::PgMembers;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The state of one placement group: which of the flags in the module table hold.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
pub struct PgState {
    /// At least `min_size` complete copies are up: I/O is served.
    pub active: bool,
    /// `size` complete copies up where placement puts them; nothing to recover or move.
    pub clean: bool,
    /// Fewer than `size` complete copies are up.
    pub degraded: bool,
    /// Up placed members that are not complete are being recovered.
    pub recovering: bool,
    /// Complete copies live (also) on OSDs placement no longer chooses.
    pub remapped: bool,
    /// No complete copy is up.
    pub incomplete: bool,
}

impl PgState {
    /// Every name that can appear in a state string, in the order they appear.
    /// `flame-admin pg ls --state` accepts exactly these.
    pub const FLAG_NAMES: [&'static str; 7] = [
        "active",
        "inactive",
        "clean",
        "recovering",
        "remapped",
        "degraded",
        "incomplete",
    ];

    /// The state of a group with roles `m` in a pool with settings `pool`.
    ///
    /// Exactly one of `active` and `inactive` holds, and an active group that is
    /// not clean always carries at least one of `degraded`, `recovering` and
    /// `remapped` (so "active" alone never hides a problem; the unit tests check
    /// this over many random maps).
    pub fn of(m: &PgMembers, pool: &PoolConfig) -> PgState {
        let size = pool.size as usize;
        let active = m.active;
        // A complete copy outside the placed set: the group's data is (also)
        // somewhere placement no longer puts it.
        let remapped = m
            .acting
            .iter()
            .chain(m.down_complete.iter())
            .any(|id| !m.placed.contains(id));
        PgState {
            active,
            clean: active && m.is_clean(pool.size),
            degraded: m.acting.len() < size,
            recovering: !m.recovering.is_empty(),
            remapped,
            incomplete: m.acting.is_empty(),
        }
    }

    /// Whether the flag named `name` (one of [`Self::FLAG_NAMES`]) holds; `None`
    /// for an unknown name.
    pub fn has(&self, name: &str) -> Option<bool> {
        Some(match name {
            "active" => self.active,
            "inactive" => !self.active,
            "clean" => self.clean,
            "recovering" => self.recovering,
            "remapped" => self.remapped,
            "degraded" => self.degraded,
            "incomplete" => self.incomplete,
            _ => return None,
        })
    }

    /// Whether I/O to the group waits: it is not active. (Health reports these as
    /// errors: an application sees them as stalls.)
    pub fn io_waits(&self) -> bool {
        !self.active
    }
}

impl fmt::Display for PgState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.active { "active" } else { "inactive" })?;
        for (name, on) in [
            ("clean", self.clean),
            ("recovering", self.recovering),
            ("remapped", self.remapped),
            ("degraded", self.degraded),
            ("incomplete", self.incomplete),
        ] {
            if on {
                write!(f, "+{name}")?;
            }
        }
        Ok(())
    }
}

/// Whether a state string such as `active+recovering+degraded` matches a filter:
/// the filter is one flag name (`degraded`), or several joined by `+`, all of
/// which must be present (`active+degraded` matches `active+recovering+degraded`).
pub fn state_matches(state: &str, filter: &str) -> bool {
    let flags: Vec<&str> = state.split('+').collect();
    filter.split('+').all(|want| flags.contains(&want))
}

/// Checks a `--state` filter: every `+`-separated part must be a flag name.
pub fn validate_state_filter(filter: &str) -> Result<(), String> {
    for part in filter.split('+') {
        if !PgState::FLAG_NAMES.contains(&part) {
            return Err(format!(
                "unknown placement-group state `{part}`: expected one of {} (several may be \
                 joined with +, e.g. active+degraded)",
                PgState::FLAG_NAMES.join(", ")
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::{Epoch, OsdId, PgId};
    use crate::map::{ClusterMap, OsdInfo};

    fn pool() -> PoolConfig {
        PoolConfig {
            size: 3,
            min_size: 2,
            pg_count: 32,
            ..Default::default()
        }
    }

    fn map(n: u32) -> ClusterMap {
        let mut m = ClusterMap::new("f".into(), pool());
        for i in 0..n {
            m.osds.insert(
                OsdId(i),
                OsdInfo {
                    id: OsdId(i),
                    addr: format!("127.0.0.1:{}", 7000 + 10 * i).parse().unwrap(),
                    shards: 1,
                    host: format!("h{i}"),
                    weight: 1.0,
                    up: true,
                    up_from: Epoch(1),
                    r#in: true,
                    metrics_addr: None,
                },
            );
        }
        m
    }

    fn state(m: &ClusterMap, pg: u32) -> String {
        PgState::of(&PgMembers::compute(m, PgId(pg)), &m.pool).to_string()
    }

    #[test]
    fn clean_degraded_recovering_inactive_incomplete() {
        let mut m = map(3);
        assert_eq!(state(&m, 0), "active+clean");
        let placed = PgMembers::compute(&m, PgId(0)).placed;
        // One member down and recorded as having missed writes (the manager's rule):
        // served by the two others.
        m.osds.get_mut(&placed[1]).unwrap().up = false;
        m.pg_complete.insert(PgId(0), vec![placed[0], placed[2]]);
        assert_eq!(state(&m, 0), "active+degraded");
        // Back up: it receives writes while the primary recovers it.
        m.osds.get_mut(&placed[1]).unwrap().up = true;
        assert_eq!(state(&m, 0), "active+recovering+degraded");
        // Down again, and a second member down: below min_size, I/O waits.
        m.osds.get_mut(&placed[1]).unwrap().up = false;
        m.osds.get_mut(&placed[2]).unwrap().up = false;
        let s = PgState::of(&PgMembers::compute(&m, PgId(0)), &m.pool);
        assert_eq!(s.to_string(), "inactive+degraded");
        assert!(s.io_waits());
        // No complete copy up at all.
        m.osds.get_mut(&placed[0]).unwrap().up = false;
        assert_eq!(state(&m, 0), "inactive+degraded+incomplete");
    }

    #[test]
    fn remapped_when_complete_copies_are_not_where_placement_puts_them() {
        let mut m = map(4);
        // Find a PG whose placement does not include osd.3, then record osd.3 as a
        // complete holder instead of one placed member (data moving away from it).
        let pg = (0..32)
            .map(PgId)
            .find(|&pg| !PgMembers::compute(&m, pg).placed.contains(&OsdId(3)))
            .unwrap();
        let placed = PgMembers::compute(&m, pg).placed;
        m.pg_complete
            .insert(pg, vec![placed[0], placed[1], OsdId(3)]);
        let s = PgState::of(&PgMembers::compute(&m, pg), &m.pool);
        assert_eq!(s.to_string(), "active+recovering+remapped", "{s:?}");
        assert!(!s.degraded, "three complete copies are up");
        // The old home down: still remapped (its record is kept), now degraded.
        m.osds.get_mut(&OsdId(3)).unwrap().up = false;
        assert_eq!(state(&m, pg.0), "active+recovering+remapped+degraded");
    }

    #[test]
    fn fewer_osds_than_size() {
        let m = map(2);
        // Two copies where three are wanted: active (min_size 2) but degraded.
        assert_eq!(state(&m, 0), "active+degraded");
        let m = map(1);
        assert_eq!(state(&m, 0), "inactive+degraded");
        let m = map(0);
        assert_eq!(state(&m, 0), "inactive+degraded+incomplete");
    }

    /// Over many random maps: exactly one of active/inactive, clean excludes every
    /// problem flag, and an active group that is not clean names a reason.
    #[test]
    fn states_are_consistent_over_random_maps() {
        let mut rng = 0x1234_5678_9abc_def0u64;
        let mut next = |n: u64| {
            rng = crate::placement::mix64(rng.wrapping_add(0x9e37_79b9_7f4a_7c15));
            rng % n
        };
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..300 {
            let mut m = map(1 + next(6) as u32);
            for o in m.osds.values_mut() {
                o.up = next(4) != 0;
                o.r#in = next(5) != 0;
            }
            let ids: Vec<OsdId> = m.osds.keys().copied().collect();
            for pg in 0..m.pool.pg_count {
                if next(2) == 0 {
                    let k = next(ids.len() as u64 + 1) as usize;
                    let c: Vec<OsdId> = (0..k)
                        .map(|_| ids[next(ids.len() as u64) as usize])
                        .collect();
                    let mut c2 = Vec::new();
                    for id in c {
                        if !c2.contains(&id) {
                            c2.push(id);
                        }
                    }
                    if !c2.is_empty() {
                        m.pg_complete.insert(PgId(pg), c2);
                    }
                }
            }
            for pg in 0..m.pool.pg_count {
                let mem = PgMembers::compute(&m, PgId(pg));
                let s = PgState::of(&mem, &m.pool);
                let text = s.to_string();
                seen.insert(text.clone());
                if s.clean {
                    assert!(
                        s.active && !s.degraded && !s.recovering && !s.remapped && !s.incomplete,
                        "{text}"
                    );
                }
                if s.active && !s.clean {
                    assert!(s.degraded || s.recovering || s.remapped, "{text} {mem:?}");
                }
                if s.incomplete {
                    assert!(!s.active && s.degraded, "{text}");
                }
                assert_eq!(s.active, mem.active);
                for name in text.split('+') {
                    assert_eq!(s.has(name), Some(true), "{text}");
                }
            }
        }
        assert!(seen.len() >= 6, "random maps reached only {seen:?}");
    }

    #[test]
    fn filters() {
        assert!(state_matches("active+recovering+degraded", "degraded"));
        assert!(state_matches(
            "active+recovering+degraded",
            "active+degraded"
        ));
        assert!(!state_matches("active+clean", "degraded"));
        assert!(!state_matches("inactive+degraded", "active"));
        assert!(validate_state_filter("active+degraded").is_ok());
        let e = validate_state_filter("peering").unwrap_err();
        assert!(e.contains("peering") && e.contains("recovering"), "{e}");
        assert_eq!(PgState::default().has("bogus"), None);
    }
}
