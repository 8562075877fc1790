//! Deterministic placement: object → placement group → OSDs.
//!
//! Every client and OSD runs this same function over the same map, so they agree on
//! where an object lives without asking anyone. OSDs are chosen by rendezvous
//! hashing with straw2 draws (each OSD draws `ln(u)/weight` from a hash of the PG and
//! its id; the highest draws win), which has the property CRUSH's straw2 is known
//! for: adding or removing one OSD moves only the placement groups that OSD wins or
//! held — about its weight share — and nothing else. Copies go to distinct hosts
//! first; only when there are fewer hosts than copies do two copies share a host.

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

/// straw2 draw of `osd` for `pg`: `ln(u) / weight` with `u` uniform in (0, 1].
fn straw2_draw(pg: PgId, osd: OsdId, weight: f64) -> f64 {
    let h = hash2(u64::from(pg.0) | (1 << 40), u64::from(osd.0));
    // 53 bits of the hash → uniform in (0, 1]; never 0, so ln is finite.
    let u = ((h >> 11) + 1) as f64 / (1u64 << 53) as f64;
    u.ln() / weight
}

/// The ordered acting set of `pg`: primary first, then the replicas; at most
/// `pool.size` OSDs (fewer only if fewer OSDs are in).
///
/// Placement considers every OSD that is `in` with a positive weight, whether up or
/// down: a down OSD keeps its placement groups, so I/O to them waits for it instead
/// of being answered by an OSD that lacks the data.
pub fn pg_osds(map: &ClusterMap, pg: PgId) -> Vec<OsdId> {
    let size = map.pool.size as usize;
    let mut ranked: Vec<(f64, OsdId, &str)> = map
        .osds
        .values()
        .filter(|o| o.r#in && o.weight > 0.0)
        .map(|o| (straw2_draw(pg, o.id, o.weight), o.id, o.host.as_str()))
        .collect();
    // Highest draw first; ties (practically impossible) broken by id for determinism.
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
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

/// Acting sets of every placement group of one map, computed once per epoch so the
/// data path does an index instead of `pg_count` hash draws and a sort per request.
#[derive(Clone, Debug)]
pub struct PgTable {
    epoch: crate::ids::Epoch,
    pg_count: u32,
    sets: Vec<Vec<OsdId>>,
}

impl PgTable {
    /// Computes the table for `map`.
    pub fn new(map: &ClusterMap) -> PgTable {
        let sets = (0..map.pool.pg_count)
            .map(|pg| pg_osds(map, PgId(pg)))
            .collect();
        PgTable {
            epoch: map.epoch,
            pg_count: map.pool.pg_count,
            sets,
        }
    }

    /// The epoch of the map this table was computed from.
    pub fn epoch(&self) -> crate::ids::Epoch {
        self.epoch
    }

    /// Acting set of `pg`, primary first; empty for a PG outside the pool.
    pub fn osds(&self, pg: PgId) -> &[OsdId] {
        self.sets.get(pg.0 as usize).map_or(&[], Vec::as_slice)
    }

    /// Locates an object.
    pub fn locate(&self, object: ObjectId) -> (PgId, &[OsdId]) {
        let pg = object_pg(object, self.pg_count);
        (pg, self.osds(pg))
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

    fn osd(id: OsdId, host: &str) -> OsdInfo {
        OsdInfo {
            id,
            addr: "127.0.0.1:6900".parse().unwrap(),
            shards: 2,
            host: host.into(),
            weight: 1.0,
            up: true,
            r#in: true,
            metrics_addr: None,
        }
    }

    #[test]
    fn table_matches_direct_computation() {
        let m = map_with(5, 2);
        let t = PgTable::new(&m);
        for pg in 0..m.pool.pg_count {
            assert_eq!(t.osds(PgId(pg)), pg_osds(&m, PgId(pg)).as_slice());
        }
        let o = ObjectId {
            volume: VolumeId(3),
            index: 99,
        };
        assert_eq!(t.locate(o).1, locate(&m, o).osds.as_slice());
        assert!(t.osds(PgId(m.pool.pg_count)).is_empty());
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
