//! Placement groups as one shard sees them: the map view with every group's
//! acting set precomputed, and the checks that decide whether this OSD and shard
//! may serve a request for a group in the role it asks for. Per-group state
//! (the write sequence, and later the recovery log and object versions) lives here.

use flame_common::ids::OsdId;
use flame_common::map::ClusterMap;
use flame_common::placement::{PgTable, object_pg};
use flame_common::protocol::{IoTarget, status};

/// A map and the acting sets computed from it.
pub struct MapView {
    pub(crate) map: ClusterMap,
    pub(crate) table: PgTable,
}

impl MapView {
    pub(crate) fn new(map: &ClusterMap) -> MapView {
        MapView {
            map: map.clone(),
            table: PgTable::new(map),
        }
    }

    /// Checks that `target` is well-formed and that this OSD and shard should serve
    /// it in the role the request asks for.
    pub(crate) fn check(
        &self,
        osd: OsdId,
        shard: u16,
        target: &IoTarget,
        replica: bool,
    ) -> Result<(), i32> {
        let view = self;
        let map = &view.map;
        let end = u64::from(target.offset) + u64::from(target.length);
        if end > u64::from(map.pool.object_size) {
            return Err(status::EINVAL);
        }
        if object_pg(target.object, map.pool.pg_count) != target.pg {
            return Err(status::EINVAL);
        }
        let set = view.table.osds(target.pg);
        let me = map.osds.get(&osd).ok_or(status::ESTALE)?;
        if me.shard_of(target.pg) != shard {
            return Err(status::ESTALE);
        }
        let serves = if replica {
            set.contains(&osd)
        } else {
            set.first() == Some(&osd)
        };
        if !serves {
            return Err(status::ESTALE);
        }
        Ok(())
    }
}
