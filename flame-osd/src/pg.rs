//! Placement groups as one shard sees them: the map view with every group's
//! acting set precomputed, and the checks that decide whether this OSD and shard
//! may serve a request for a group in the role it asks for. Per-group state
//! (the write sequence, and later the recovery log and object versions) lives here.

use flame_common::collections::HashMap;
use flame_common::ids::{Epoch, OsdId, VolumeId};
use flame_common::map::ClusterMap;
use flame_common::placement::{PgTable, object_pg};
use flame_common::protocol::{IoTarget, status};

/// A map and the acting sets computed from it.
pub struct MapView {
    pub(crate) map: ClusterMap,
    pub(crate) table: PgTable,
    /// Every volume's size in bytes, by id: a write is checked against its
    /// volume's end with one lookup.
    volume_bytes: HashMap<VolumeId, u64>,
    /// The map as JSON, made at the first [`Message::MapRequest`] for this
    /// epoch (a client sent a write under an older map): once per epoch, not
    /// once per request.
    ///
    /// [`Message::MapRequest`]: flame_common::protocol::Message::MapRequest
    encoded: std::cell::OnceCell<Result<std::rc::Rc<[u8]>, i32>>,
}

impl MapView {
    /// Whether shard `shard` of OSD `osd` is the one that holds `pg` in this map
    /// (the one place that answers "is this group mine"; the role is
    /// [`MapView::check`]'s).
    pub(crate) fn held_by(&self, osd: OsdId, shard: u16, pg: flame_common::ids::PgId) -> bool {
        pg.0 < self.map.pool.pg_count
            && self
                .map
                .osds
                .get(&osd)
                .is_some_and(|me| me.shard_of(pg) == shard)
    }

    pub(crate) fn new(map: &ClusterMap) -> MapView {
        MapView {
            map: map.clone(),
            table: PgTable::new(map),
            volume_bytes: map.volumes.values().map(|v| (v.id, v.size)).collect(),
            encoded: std::cell::OnceCell::new(),
        }
    }

    /// The map as JSON for a [`MapRequest`] reply: `E2BIG` when it exceeds
    /// [`MAP_REPLY_BYTES_MAX`] (the client then waits for the manager's map),
    /// `EIO` if it does not encode.
    ///
    /// [`MapRequest`]: flame_common::protocol::Message::MapRequest
    /// [`MAP_REPLY_BYTES_MAX`]: flame_common::protocol::MAP_REPLY_BYTES_MAX
    pub(crate) fn encoded(&self) -> Result<std::rc::Rc<[u8]>, i32> {
        self.encoded
            .get_or_init(|| match serde_json::to_vec(&self.map) {
                Ok(b) if b.len() <= flame_common::protocol::MAP_REPLY_BYTES_MAX => Ok(b.into()),
                Ok(b) => {
                    tracing::warn!(
                        bytes = b.len(),
                        "the map is too large to hand to a client; it waits for the manager's"
                    );
                    Err(flame_common::protocol::status::E2BIG)
                }
                Err(e) => {
                    tracing::error!("the map does not encode: {e}");
                    Err(flame_common::protocol::status::EIO)
                }
            })
            .clone()
    }

    /// Checks that a write of `target` lies inside its volume as this map knows
    /// it. A client whose map predates a shrink (or a volume's removal) must not
    /// land bytes past the new end after the shrink's trim removed them: a later
    /// grow would show them where zeroes are promised. An older sender gets ESTALE
    /// (it refreshes its map and then sees the new size), a current one EINVAL, a
    /// newer one (a primary forwarding after a grow this OSD has not seen yet)
    /// ESTALE (this OSD fetches the newer map).
    /// Discards and zeroing are not checked: they remove data, and a shrink's trim
    /// is exactly such requests past the new end.
    pub(crate) fn check_write_inside_volume(
        &self,
        target: &IoTarget,
        sender_epoch: Epoch,
    ) -> Result<(), i32> {
        let object_size = u64::from(self.map.pool.object_size);
        let end = target
            .object
            .index
            .saturating_mul(object_size)
            .saturating_add(u64::from(target.offset) + u64::from(target.length));
        let inside = self
            .volume_bytes
            .get(&target.object.volume)
            .is_some_and(|&size| end <= size);
        match (inside, sender_epoch != self.map.epoch) {
            (true, _) => Ok(()),
            (false, true) => Err(status::ESTALE),
            (false, false) => Err(status::EINVAL),
        }
    }

    /// Whether a `DELETE_VOLUME` of `volume` sent under `sender_epoch` may run:
    /// only for a volume this map no longer has (removed through the manager,
    /// which keeps its tombstone), so that one raw message cannot erase a live
    /// volume. A live volume with a sender on a newer map is `EAGAIN` (that map
    /// may have removed it; this OSD fetches it and the sender retries); with
    /// one on this map or an older one it is refused (`EINVAL`).
    pub(crate) fn check_delete_volume(
        &self,
        volume: VolumeId,
        sender_epoch: Epoch,
    ) -> Result<(), i32> {
        if !self.volume_bytes.contains_key(&volume) {
            return Ok(());
        }
        if sender_epoch > self.map.epoch {
            Err(status::EAGAIN)
        } else {
            Err(status::EINVAL)
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
        let members = view.table.pg(target.pg);
        let me = map.osds.get(&osd).ok_or(status::ESTALE)?;
        if me.shard_of(target.pg) != shard {
            return Err(status::ESTALE);
        }
        let serves = if replica {
            members.write_set().any(|id| id == osd)
        } else {
            members.primary() == Some(osd)
        };
        if !serves {
            return Err(status::ESTALE);
        }
        // Fewer than min_size complete copies up: the group waits (the client
        // retries) rather than acknowledging a write with too few copies.
        if !replica && !members.active {
            return Err(status::EAGAIN);
        }
        Ok(())
    }
}
