//! Deterministic placement: object → placement group → OSDs.
//!
//! Every client and OSD runs this same function over the same map, so they agree on
//! where an object lives without asking anyone. OSDs are chosen by rendezvous
//! hashing with straw2 draws (each OSD draws `log2(u)/weight` from a hash of the PG
//! and its id; the highest draws win), which has the property CRUSH's straw2 is known
//! for: adding or removing one OSD moves only the placement groups that OSD wins or
//! held — about its weight share — and nothing else. Copies go to distinct hosts
//! first; only when there are fewer hosts than copies do two copies share a host.
//!
//! **No floating point.** Two machines whose math libraries round `ln()` differently
//! would place an object differently, and a client would then write where the OSDs
//! do not look. So, like Ceph's `crush_ln`, the draw is computed in fixed point: the
//! logarithm by an exact integer algorithm ([`log2_q44`]), the weight as a 16.16
//! fixed-point integer ([`weight_q16`]), the division in `i128`. Every step is
//! integer arithmetic with one defined result on every machine; golden-value tests
//! pin both the logarithm and whole acting sets.

use crate::ids::{ObjectId, OsdId, PgId};
use crate::map::ClusterMap;

/// A 64-bit mixer (the splitmix64 finalizer). Fixed forever: changing it would move
/// every object in every cluster.
pub fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn hash2(a: u64, b: u64) -> u64 {
    mix64(mix64(a ^ 0x9e37_79b9_7f4a_7c15).wrapping_add(b))
}

/// The placement group an object hashes into.
pub fn object_pg(object: ObjectId, pg_count: u32) -> PgId {
    assert!(pg_count > 0, "pool has no placement groups");
    PgId((hash2(object.volume.0, object.index) % u64::from(pg_count)) as u32)
}

/// Fractional bits of [`log2_q44`]'s result (as Ceph's `crush_ln`, which returns
/// `2^44 · log2(x)`).
pub const LOG2_FRAC_BITS: u32 = 44;

/// `log2(x) · 2^44`, truncated, for `x ≥ 1` (0 for `x = 0`, which callers never
/// pass), in integer arithmetic only.
///
/// The integer part is the position of the highest set bit. The fraction is
/// produced one bit at a time by the classic squaring method: with the mantissa
/// `m ∈ [1, 2)` held in Q1.63, `log2(m²) = 2·log2(m)`, so squaring shifts the
/// fraction left one bit, and `m² ≥ 2` says that bit is 1 (then halve `m`). Each
/// squaring truncates to 63 fraction bits; the result is within a few units of the
/// last place of the true value and, above all, identical on every machine. Ceph
/// reaches the same goal with lookup tables over a 16-bit input; this needs no
/// table, takes any 64-bit input (so draws from different OSDs rarely tie), and
/// costs 44 128-bit multiplications — about 0.1 µs, paid per (PG, OSD) once per
/// map epoch ([`PgTable`]).
pub fn log2_q44(x: u64) -> u64 {
    if x == 0 {
        return 0;
    }
    let int_part = 63 - x.leading_zeros();
    // Mantissa in [1, 2) as a Q1.63 fixed-point number (< 2^64).
    let mut m: u128 = u128::from(x) << (63 - int_part);
    let mut frac: u64 = 0;
    for _ in 0..LOG2_FRAC_BITS {
        // m < 2^64, so m² < 2^128: no overflow.
        m = (m * m) >> 63;
        frac <<= 1;
        if m >= 1u128 << 64 {
            frac |= 1;
            m >>= 1;
        }
    }
    (u64::from(int_part) << LOG2_FRAC_BITS) | frac
}

/// A weight as a 16.16 fixed-point integer, as CRUSH stores weights. The map
/// carries weights as JSON numbers; multiplying by 2^16 is exact in IEEE-754 and
/// rounding to an integer has one defined result, so this is the only place a float
/// is touched, and it is deterministic. Weights below 2^-17 round to 0 (no data);
/// absurdly large ones saturate.
pub fn weight_q16(weight: f64) -> u64 {
    if weight.is_nan() || weight <= 0.0 {
        return 0;
    }
    // `as` saturates at u64::MAX for huge values.
    (weight * 65536.0).round() as u64
}

/// Bits of the hash used as the straw2 uniform variable `u ∈ [1, 2^48]`.
const DRAW_BITS: u32 = 48;

/// straw2 draw of `osd` for `pg`: `log2(u / 2^48) / weight` in fixed point, with `u`
/// uniform in `[1, 2^48]` — a non-positive number; the highest draw wins. (CRUSH uses
/// `ln`; `log2 = ln / ln 2` ranks the same.)
fn straw2_draw(pg: PgId, osd: OsdId, weight_q16: u64) -> i128 {
    debug_assert!(weight_q16 > 0, "zero-weight OSDs draw nothing");
    let h = hash2(u64::from(pg.0) | (1 << 40), u64::from(osd.0));
    let u = (h >> (64 - DRAW_BITS)) + 1;
    // log2(u) ≤ 48 · 2^44 < 2^50: the difference fits i128 (and i64) easily.
    let ln = i128::from(log2_q44(u)) - (i128::from(DRAW_BITS) << LOG2_FRAC_BITS);
    // Scale by 2^16 before dividing by the 16.16 weight, keeping 44 fraction bits.
    (ln << 16) / i128::from(weight_q16.max(1))
}

/// The ordered acting set of `pg`: primary first, then the replicas; at most
/// `pool.size` OSDs (fewer only if fewer OSDs are in).
///
/// Placement considers every OSD that is `in` with a positive weight, whether up or
/// down: a down OSD keeps its placement groups, so I/O to them waits for it instead
/// of being answered by an OSD that lacks the data.
pub fn pg_osds(map: &ClusterMap, pg: PgId) -> Vec<OsdId> {
    let size = map.pool.size as usize;
    let mut ranked: Vec<(i128, OsdId, &str)> = map
        .osds
        .values()
        .filter(|o| o.r#in)
        .filter_map(|o| {
            let w = weight_q16(o.weight);
            (w > 0).then(|| (straw2_draw(pg, o.id, w), o.id, o.host.as_str()))
        })
        .collect();
    // Highest draw first; ties (rare: 48-bit draws) broken by id for determinism.
    ranked.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let mut chosen: Vec<OsdId> = Vec::with_capacity(size);
    let mut hosts: Vec<&str> = Vec::with_capacity(size);
    for &(_, id, host) in &ranked {
        if chosen.len() == size {
            break;
        }
        if !hosts.contains(&host) {
            chosen.push(id);
            hosts.push(host);
        }
    }
    // Fewer hosts than copies: fill from the ranking, sharing hosts.
    for &(_, id, _) in &ranked {
        if chosen.len() == size {
            break;
        }
        if !chosen.contains(&id) {
            chosen.push(id);
        }
    }
    chosen
}

/// Where one object lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    /// The object's placement group.
    pub pg: PgId,
    /// Acting set, primary first.
    pub osds: Vec<OsdId>,
}

/// Locates one object.
pub fn locate(map: &ClusterMap, object: ObjectId) -> Location {
    let pg = object_pg(object, map.pool.pg_count);
    Location {
        pg,
        osds: pg_osds(map, pg),
    }
}

/// Who does what for one placement group in one map — the rule every OSD and client
/// applies to the same map, so they agree on roles without asking anyone.
///
/// * `placed`: the OSDs placement chooses (every `in` OSD with a positive weight is
///   a candidate, up or down): where the group's copies belong.
/// * complete copies: `map.pg_complete[pg]` if the manager recorded one, else
///   `placed`. They hold every acknowledged write of the group.
/// * `acting`: the complete copies that are up, the placed ones first (in placement
///   order), then the others (old homes kept until the new ones are complete).
///   `acting[0]` is the primary: it orders writes, serves reads and runs recovery.
/// * `recovering`: placed OSDs that are up but not complete (new members after a
///   placement change, members back from an outage). They receive every new write,
///   serve nothing, and become complete when the primary has copied what they miss
///   and the manager has recorded its report.
/// * The group serves I/O (`active`) only with at least `pool.min_size` acting
///   members: a write is acknowledged once every member of `write_set()` (acting and
///   recovering) has applied it. With fewer, I/O waits.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PgMembers {
    /// Placement's choice, in placement order.
    pub placed: Vec<OsdId>,
    /// Complete and up, primary first.
    pub acting: Vec<OsdId>,
    /// Placed, up, not complete: being recovered.
    pub recovering: Vec<OsdId>,
    /// Complete but down: the group may wait for them.
    pub down_complete: Vec<OsdId>,
    /// Whether `acting` has at least `pool.min_size` members.
    pub active: bool,
}

impl PgMembers {
    /// Computes the roles of `pg` in `map`.
    pub fn compute(map: &ClusterMap, pg: PgId) -> PgMembers {
        let placed = pg_osds(map, pg);
        let complete: &[OsdId] = match map.pg_complete.get(&pg) {
            Some(c) => c,
            None => &placed,
        };
        let up = |id: &OsdId| map.osds.get(id).is_some_and(|o| o.up);
        let mut acting: Vec<OsdId> = placed
            .iter()
            .filter(|id| complete.contains(id) && up(id))
            .copied()
            .collect();
        acting.extend(
            complete
                .iter()
                .filter(|id| !placed.contains(id) && up(id))
                .copied(),
        );
        let recovering = placed
            .iter()
            .filter(|id| !complete.contains(id) && up(id))
            .copied()
            .collect();
        let down_complete = complete.iter().filter(|id| !up(id)).copied().collect();
        let active = !acting.is_empty() && acting.len() >= map.pool.min_size as usize;
        PgMembers {
            placed,
            acting,
            recovering,
            down_complete,
            active,
        }
    }

    /// The primary: the first acting member (`None` when no complete copy is up).
    pub fn primary(&self) -> Option<OsdId> {
        self.acting.first().copied()
    }

    /// Every OSD a write must reach before it is acknowledged: acting (primary
    /// first) then recovering.
    pub fn write_set(&self) -> impl Iterator<Item = OsdId> + '_ {
        self.acting.iter().chain(self.recovering.iter()).copied()
    }

    /// Whether `osd` should keep this group's data: placed, or holding a complete
    /// copy (up or down). An OSD holding data of a group it is not a member of in a
    /// map where the group is clean holds a stray copy.
    pub fn is_member(&self, osd: OsdId) -> bool {
        self.placed.contains(&osd)
            || self.acting.contains(&osd)
            || self.down_complete.contains(&osd)
    }

    /// Whether the group has `size` complete copies up, all where placement puts
    /// them (nothing to recover, nothing misplaced).
    pub fn is_clean(&self, size: u32) -> bool {
        self.recovering.is_empty()
            && self.down_complete.is_empty()
            && self.acting.len() == size as usize
            && self.acting == self.placed
    }
}

/// What makes up a placement group's *interval*: its acting set (primary first),
/// its recovering members, whether it is active, and the incarnation (`up_from`)
/// of each of those OSDs. While these stay the same from one map to the next the
/// group is in the same interval, and a write forwarded under any map of the
/// interval is as good as one forwarded under the newest (see
/// [`ClusterMap::interval_since`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgRoles {
    acting: Vec<(OsdId, crate::ids::Epoch)>,
    recovering: Vec<(OsdId, crate::ids::Epoch)>,
    active: bool,
}

impl PgRoles {
    /// The roles of `members` in `map`.
    pub fn of(map: &ClusterMap, members: &PgMembers) -> PgRoles {
        let with_up_from = |ids: &[OsdId]| {
            ids.iter()
                .map(|id| {
                    (
                        *id,
                        map.osds
                            .get(id)
                            .map_or_else(Default::default, |o| o.up_from),
                    )
                })
                .collect()
        };
        PgRoles {
            acting: with_up_from(&members.acting),
            recovering: with_up_from(&members.recovering),
            active: members.active,
        }
    }
}

/// The roles of every placement group of `map`, by group number.
pub fn pg_roles(map: &ClusterMap) -> Vec<PgRoles> {
    (0..map.pool.pg_count)
        .map(|pg| PgRoles::of(map, &PgMembers::compute(map, PgId(pg))))
        .collect()
}

/// The roles of every placement group of one map, computed once per epoch so the
/// data path does an index instead of `pg_count` hash draws and a sort per request.
#[derive(Clone, Debug)]
pub struct PgTable {
    epoch: crate::ids::Epoch,
    pg_count: u32,
    pgs: Vec<PgMembers>,
}

impl PgTable {
    /// Computes the table for `map`.
    pub fn new(map: &ClusterMap) -> PgTable {
        let pgs = (0..map.pool.pg_count)
            .map(|pg| PgMembers::compute(map, PgId(pg)))
            .collect();
        PgTable {
            epoch: map.epoch,
            pg_count: map.pool.pg_count,
            pgs,
        }
    }

    /// The epoch of the map this table was computed from.
    pub fn epoch(&self) -> crate::ids::Epoch {
        self.epoch
    }

    /// Number of placement groups.
    pub fn pg_count(&self) -> u32 {
        self.pg_count
    }

    /// Roles in `pg` (an empty, inactive entry for a PG outside the pool).
    pub fn pg(&self, pg: PgId) -> &PgMembers {
        static NONE: PgMembers = PgMembers {
            placed: Vec::new(),
            acting: Vec::new(),
            recovering: Vec::new(),
            down_complete: Vec::new(),
            active: false,
        };
        self.pgs.get(pg.0 as usize).unwrap_or(&NONE)
    }

    /// Every placement group's roles, by PG number.
    pub fn iter(&self) -> impl Iterator<Item = (PgId, &PgMembers)> {
        self.pgs
            .iter()
            .enumerate()
            .map(|(i, m)| (PgId(i as u32), m))
    }

    /// Locates an object: its placement group and that group's roles.
    pub fn locate(&self, object: ObjectId) -> (PgId, &PgMembers) {
        let pg = object_pg(object, self.pg_count);
        (pg, self.pg(pg))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::VolumeId;
    use crate::map::{OsdInfo, PoolConfig};
    use std::collections::HashMap;

    fn map_with(n_hosts: u32, osds_per_host: u32) -> ClusterMap {
        let mut m = ClusterMap::new(
            "test".into(),
            PoolConfig {
                pg_count: 1024,
                ..Default::default()
            },
        );
        for h in 0..n_hosts {
            for i in 0..osds_per_host {
                let id = OsdId(h * osds_per_host + i);
                m.osds.insert(id, osd(id, &format!("host{h}")));
            }
        }
        m
    }

    #[test]
    fn intervals_change_only_for_groups_whose_roles_changed() {
        use crate::ids::Epoch;
        let mut m = map_with(5, 1);
        m.pool.pg_count = 64;
        let mut roles = m.record_intervals(&[]);
        let start = m.epoch;
        assert_eq!(m.pg_intervals_from, Some(start));
        assert!(m.pg_intervals.is_empty());
        // A map change that moves no roles (a volume created) keeps every interval.
        m.epoch = Epoch(m.epoch.0 + 1);
        roles = m.record_intervals(&roles);
        assert!(m.pg_intervals.is_empty());
        assert_eq!(m.interval_since(PgId(3)), start);
        // OSD 4 goes down: exactly the groups it served start a new interval.
        m.epoch = Epoch(m.epoch.0 + 1);
        m.osds.get_mut(&OsdId(4)).unwrap().up = false;
        let down_at = m.epoch;
        roles = m.record_intervals(&roles);
        let table = PgTable::new(&m);
        let mut moved = 0;
        for pg in 0..64 {
            let had_4 = table.pg(PgId(pg)).placed.contains(&OsdId(4));
            let since = m.interval_since(PgId(pg));
            assert_eq!(since == down_at, had_4, "pg {pg}");
            moved += usize::from(had_4);
        }
        assert!(moved > 0 && moved < 64, "{moved}");
        // It restarts and is up again with a new up_from: a new interval again
        // (the A-B-A of roles is seen through the incarnation).
        m.epoch = Epoch(m.epoch.0 + 1);
        let o = m.osds.get_mut(&OsdId(4)).unwrap();
        o.up = true;
        o.up_from = m.epoch;
        let up_at = m.epoch;
        roles = m.record_intervals(&roles);
        for pg in 0..64 {
            let had_4 = table.pg(PgId(pg)).placed.contains(&OsdId(4));
            assert_eq!(m.interval_since(PgId(pg)) == up_at, had_4, "pg {pg}");
        }
        // History is bounded: old entries fold into `pg_intervals_from`.
        m.epoch = Epoch(m.epoch.0 + crate::map::INTERVAL_HISTORY_EPOCHS + 5);
        m.record_intervals(&roles);
        assert!(m.pg_intervals.is_empty());
        assert_eq!(m.pg_intervals_from, Some(up_at));
        // Without history every epoch is its own interval.
        m.pg_intervals_from = None;
        assert_eq!(m.interval_since(PgId(0)), m.epoch);
    }

    fn osd(id: OsdId, host: &str) -> OsdInfo {
        OsdInfo {
            id,
            addr: "127.0.0.1:6900".parse().unwrap(),
            shards: 2,
            host: host.into(),
            weight: 1.0,
            up: true,
            up_from: crate::ids::Epoch(1),
            r#in: true,
            metrics_addr: None,
        }
    }

    /// `floor(log2(x) · 2^44)` computed independently with 80-digit decimal
    /// arithmetic (Python's `decimal`), for checking accuracy.
    const LOG2_TRUE: [(u64, u64); 15] = [
        (1, 0),
        (2, 17592186044416),
        (3, 27882955186109),
        (5, 40847791027014),
        (10, 58439977071430),
        (255, 140638152966037),
        (256, 140737488355328),
        (1000, 175319931214292),
        (65535, 281474589437200),
        (65536, 281474976710656),
        (1 << 32, 562949953421312),
        ((1 << 48) - 1, 844424930131967),
        (1 << 48, 844424930131968),
        (123456789, 472867949738911),
        (u64::MAX, 1125899906842623),
    ];

    #[test]
    fn log2_is_accurate() {
        for (x, truth) in LOG2_TRUE {
            let got = log2_q44(x);
            assert!(
                got.abs_diff(truth) <= 4,
                "log2_q44({x}) = {got}, true value {truth}"
            );
        }
        // Exact at powers of two, monotonic on a sweep.
        for k in 0u32..64 {
            assert_eq!(log2_q44(1u64 << k), u64::from(k) << LOG2_FRAC_BITS);
        }
        let mut prev = 0;
        for x in 1..100_000u64 {
            let v = log2_q44(x);
            assert!(v >= prev, "log2_q44 not monotonic at {x}");
            prev = v;
        }
    }

    /// Golden values: the exact integers this implementation returns. They must
    /// never change — a change moves objects in every cluster — so any edit to
    /// `log2_q44` that alters one of them is a placement-format change.
    #[test]
    fn log2_golden_values() {
        const GOLDEN: [(u64, u64); 8] = [
            (3, 27882955186109),
            (10, 58439977071430),
            (1000, 175319931214292),
            (65535, 281474589437200),
            (123456789, 472867949738911),
            ((1 << 48) - 1, 844424930131967),
            (0xdead_beef_cafe, 840885729242285),
            (u64::MAX, 1125899906842623),
        ];
        for (x, want) in GOLDEN {
            assert_eq!(log2_q44(x), want, "log2_q44({x})");
        }
    }

    /// The fixed-point draw ranks OSDs as the former floating-point draw
    /// (`ln(u)/weight` with a 53-bit `u`) did on this machine, so clusters placed by
    /// the old code keep their placement (barring draws within rounding of a tie).
    #[test]
    fn agrees_with_the_float_formula() {
        fn float_sets(map: &ClusterMap, pg: PgId) -> Vec<OsdId> {
            let mut ranked: Vec<(f64, OsdId, &str)> = map
                .osds
                .values()
                .filter(|o| o.r#in && o.weight > 0.0)
                .map(|o| {
                    let h = hash2(u64::from(pg.0) | (1 << 40), u64::from(o.id.0));
                    let u = ((h >> 11) + 1) as f64 / (1u64 << 53) as f64;
                    (u.ln() / o.weight, o.id, o.host.as_str())
                })
                .collect();
            ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let mut chosen = Vec::new();
            let mut hosts = Vec::new();
            for &(_, id, host) in &ranked {
                if chosen.len() < map.pool.size as usize && !hosts.contains(&host) {
                    chosen.push(id);
                    hosts.push(host);
                }
            }
            chosen
        }
        let mut w = map_with(12, 2);
        w.osds.get_mut(&OsdId(0)).unwrap().weight = 2.0;
        w.osds.get_mut(&OsdId(5)).unwrap().weight = 0.5;
        w.osds.get_mut(&OsdId(9)).unwrap().weight = 1.75;
        let mut differ = 0;
        for pg in 0..4096 {
            if float_sets(&w, PgId(pg)) != pg_osds(&w, PgId(pg)) {
                differ += 1;
            }
        }
        assert_eq!(differ, 0, "{differ} of 4096 placement groups moved");
    }

    /// The hazard itself: nothing in the placement code (outside tests) may use a
    /// floating-point function whose result depends on the math library. The one
    /// float operation left, [`weight_q16`]'s exact scaling and rounding, is
    /// IEEE-754-defined.
    #[test]
    fn no_libm_functions_in_placement() {
        let src = include_str!("placement.rs");
        let code = &src[..src.find("#[cfg(test)]").unwrap()];
        for f in [
            ".ln(", ".log2(", ".log10(", ".exp(", ".powf(", ".sqrt(", "ln_1p",
        ] {
            assert!(!code.contains(f), "placement code calls {f}");
        }
    }

    #[test]
    fn weights_are_fixed_point() {
        assert_eq!(weight_q16(1.0), 0x1_0000);
        assert_eq!(weight_q16(0.5), 0x8000);
        assert_eq!(weight_q16(2.25), 0x2_4000);
        assert_eq!(weight_q16(0.0), 0);
        assert_eq!(weight_q16(-1.0), 0);
        assert_eq!(weight_q16(f64::NAN), 0);
        assert_eq!(weight_q16(1e-9), 0);
        assert_eq!(weight_q16(f64::INFINITY), u64::MAX);
    }

    /// Golden acting sets: (map, pg) → OSDs, pinned. Any change to hashing, the
    /// logarithm, weights or tie-breaking that moves a placement group shows here.
    #[test]
    fn placement_golden_values() {
        let m = map_with(4, 3);
        let got: Vec<Vec<u32>> = [0u32, 1, 2, 3, 100, 511, 1023]
            .iter()
            .map(|&pg| pg_osds(&m, PgId(pg)).iter().map(|o| o.0).collect())
            .collect();
        assert_eq!(
            got,
            vec![
                vec![11, 7, 3],
                vec![1, 7, 5],
                vec![0, 3, 9],
                vec![5, 2, 7],
                vec![9, 5, 8],
                vec![9, 4, 8],
                vec![0, 3, 6],
            ]
        );
        let mut w = map_with(6, 1);
        w.osds.get_mut(&OsdId(0)).unwrap().weight = 2.0;
        w.osds.get_mut(&OsdId(5)).unwrap().weight = 0.5;
        let got: Vec<Vec<u32>> = [0u32, 7, 42, 999]
            .iter()
            .map(|&pg| pg_osds(&w, PgId(pg)).iter().map(|o| o.0).collect())
            .collect();
        assert_eq!(
            got,
            vec![vec![3, 2, 0], vec![0, 4, 3], vec![3, 4, 0], vec![3, 1, 5]]
        );
    }

    #[test]
    fn table_matches_direct_computation() {
        let m = map_with(5, 2);
        let t = PgTable::new(&m);
        for pg in 0..m.pool.pg_count {
            assert_eq!(t.pg(PgId(pg)).placed, pg_osds(&m, PgId(pg)));
            // No recorded override and everyone up: placed copies are complete.
            assert_eq!(t.pg(PgId(pg)).acting, t.pg(PgId(pg)).placed);
            assert!(t.pg(PgId(pg)).is_clean(m.pool.size));
        }
        let o = ObjectId {
            volume: VolumeId(3),
            index: 99,
        };
        assert_eq!(t.locate(o).1.placed, locate(&m, o).osds);
        assert!(t.pg(PgId(m.pool.pg_count)).placed.is_empty());
        assert!(!t.pg(PgId(m.pool.pg_count)).active);
    }

    #[test]
    fn roles_follow_complete_copies_and_liveness() {
        let mut m = map_with(4, 1);
        let pg = PgId(5);
        let placed = pg_osds(&m, pg);
        let (a, b, c) = (placed[0], placed[1], placed[2]);
        let spare = m
            .osds
            .keys()
            .copied()
            .find(|id| !placed.contains(id))
            .unwrap();

        // One copy down: the group goes on with two (min_size 2), the next placed
        // complete copy is primary.
        m.osds.get_mut(&a).unwrap().up = false;
        let r = PgMembers::compute(&m, pg);
        assert_eq!(r.acting, vec![b, c]);
        assert_eq!(r.primary(), Some(b));
        assert_eq!(r.down_complete, vec![a]);
        assert!(r.active);

        // It comes back after missing writes (the manager dropped it from the
        // complete copies): it takes writes but is not primary until recovered.
        m.osds.get_mut(&a).unwrap().up = true;
        m.pg_complete.insert(pg, vec![b, c]);
        let r = PgMembers::compute(&m, pg);
        assert_eq!(r.acting, vec![b, c]);
        assert_eq!(r.recovering, vec![a]);
        assert_eq!(r.write_set().collect::<Vec<_>>(), vec![b, c, a]);
        assert!(!r.is_clean(3));

        // Two complete copies down: below min_size, inactive, but still primary
        // known so recovery can run.
        m.pg_complete.insert(pg, vec![a, b, c]);
        m.osds.get_mut(&b).unwrap().up = false;
        m.osds.get_mut(&c).unwrap().up = false;
        let r = PgMembers::compute(&m, pg);
        assert_eq!(r.acting, vec![a]);
        assert!(!r.active);

        // Placement moved a copy to `spare` (here: by recording the old complete
        // set); the old home keeps serving until the new one is complete.
        m.osds.get_mut(&b).unwrap().up = true;
        m.osds.get_mut(&c).unwrap().up = true;
        m.pg_complete.insert(pg, vec![a, b, c, spare]);
        m.pg_complete.insert(pg, vec![a, b, spare]);
        let r = PgMembers::compute(&m, pg);
        assert_eq!(r.acting, vec![a, b, spare]);
        assert_eq!(r.recovering, vec![c]);
        assert!(r.is_member(spare) && r.is_member(c));
    }

    #[test]
    fn distinct_osds_and_hosts() {
        let m = map_with(4, 3);
        for pg in 0..m.pool.pg_count {
            let set = pg_osds(&m, PgId(pg));
            assert_eq!(set.len(), 3);
            let hosts: std::collections::HashSet<_> =
                set.iter().map(|id| m.osds[id].host.clone()).collect();
            assert_eq!(hosts.len(), 3, "pg {pg} shares a host: {set:?}");
        }
    }

    #[test]
    fn fewer_hosts_than_copies_still_fills() {
        let m = map_with(1, 3);
        let set = pg_osds(&m, PgId(7));
        assert_eq!(set.len(), 3);
    }

    #[test]
    fn balanced_within_tolerance() {
        let m = map_with(10, 1);
        let mut count: HashMap<OsdId, u32> = HashMap::new();
        for pg in 0..m.pool.pg_count {
            for id in pg_osds(&m, PgId(pg)) {
                *count.entry(id).or_default() += 1;
            }
        }
        // 1024 PGs × 3 copies / 10 OSDs ≈ 307 each.
        let expect = 1024.0 * 3.0 / 10.0;
        for (id, c) in count {
            let dev = (f64::from(c) - expect).abs() / expect;
            assert!(dev < 0.2, "{id} holds {c}, expected ≈{expect}");
        }
    }

    #[test]
    fn weights_shift_share() {
        let mut m = map_with(6, 1);
        m.pool.size = 1;
        m.osds.get_mut(&OsdId(0)).unwrap().weight = 2.0;
        let mut heavy = 0;
        for pg in 0..m.pool.pg_count {
            if pg_osds(&m, PgId(pg))[0] == OsdId(0) {
                heavy += 1;
            }
        }
        // weight 2 of total 7 → ≈ 293 of 1024.
        assert!((230..360).contains(&heavy), "heavy OSD got {heavy}");
    }

    #[test]
    fn adding_an_osd_moves_only_its_share() {
        let before = map_with(8, 1);
        let mut after = before.clone();
        after.osds.insert(OsdId(100), osd(OsdId(100), "host-new"));
        let mut moved = 0usize;
        for pg in 0..before.pool.pg_count {
            let a = pg_osds(&before, PgId(pg));
            let b = pg_osds(&after, PgId(pg));
            for id in &a {
                if !b.contains(id) {
                    moved += 1;
                }
            }
            // Anything that left went to the new OSD.
            for id in &b {
                assert!(a.contains(id) || *id == OsdId(100));
            }
        }
        // Ideal: 1024 × 3 / 9 ≈ 341 copies move; allow slack.
        assert!(moved < 420, "moved {moved} copies");
        assert!(
            moved > 250,
            "moved {moved} copies: new OSD is not taking its share"
        );
    }

    #[test]
    fn removing_an_osd_moves_only_its_copies() {
        let before = map_with(8, 1);
        let mut after = before.clone();
        after.osds.get_mut(&OsdId(3)).unwrap().r#in = false;
        for pg in 0..before.pool.pg_count {
            let a = pg_osds(&before, PgId(pg));
            let b = pg_osds(&after, PgId(pg));
            if !a.contains(&OsdId(3)) {
                assert_eq!(
                    a, b,
                    "pg {pg} moved though it had no copy on the removed OSD"
                );
            }
        }
    }

    #[test]
    fn object_pg_is_stable_and_spread() {
        let mut seen = vec![0u32; 64];
        for i in 0..6400 {
            let pg = object_pg(
                ObjectId {
                    volume: VolumeId(7),
                    index: i,
                },
                64,
            );
            seen[pg.0 as usize] += 1;
        }
        assert!(seen.iter().all(|&c| c > 50 && c < 150), "{seen:?}");
        // Pinned values: placement must never change between releases.
        assert_eq!(
            object_pg(
                ObjectId {
                    volume: VolumeId(1),
                    index: 0
                },
                128
            ),
            object_pg(
                ObjectId {
                    volume: VolumeId(1),
                    index: 0
                },
                128
            )
        );
        assert_eq!(mix64(0), 0);
        assert_eq!(mix64(1), 0x5692161d100b05e5);
    }
}
