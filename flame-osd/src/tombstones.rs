//! Deleting the objects of removed volumes that an OSD still holds.
//!
//! `flame-admin volume rm` removes the volume from the map, which keeps a
//! tombstone of its id (`ClusterMap::deleted_volumes`), then deletes its objects
//! on the OSDs that are up (DELETE_VOLUME, accepted only once the shard's map
//! has the tombstone). An OSD that was down at the time still holds its copies. So whenever this OSD sees a map with a tombstone it has not checked
//! yet — which includes the first map after every start — the control thread walks
//! the data directory (a blocking walk, off the shard threads) for objects of
//! tombstoned volumes, and each shard thread then deletes those volumes' objects in
//! its own placement groups through the store ([`crate::store::ObjectStore::delete_volume`],
//! the same path as a client's DeleteVolume request), so its caches stay right.
//!
//! Volume ids are never reused, so a tombstone never names a live volume.

use crate::shard::Shard;
use crate::store::layout;
use flame_common::ids::VolumeId;
use flame_common::map::ClusterMap;
use flame_common::reactor;
use std::collections::BTreeSet;
use std::path::Path;
use std::rc::Rc;
use std::sync::Mutex;
use std::time::Duration;

/// Tombstoned volumes whose objects the last walk found on disk: the control thread
/// sets it, every shard thread reads it. Bounded by `DELETED_VOLUMES_MAX`. One per
/// OSD process, held in what its shards share with the control thread
/// ([`crate::recovery::RecoveryShared`]) rather than in a global: the simulator
/// runs several OSDs in one process, and one's deletions are not another's.
#[derive(Debug, Default)]
pub struct Pending(Mutex<BTreeSet<VolumeId>>);

/// How often a shard thread looks for volumes to delete.
const CHECK_INTERVAL: Duration = Duration::from_millis(500);

impl Pending {
    fn get(&self) -> BTreeSet<VolumeId> {
        // A poisoned lock only means a panicking thread held it; the set is still valid.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set(&self, volumes: BTreeSet<VolumeId>) {
        *self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = volumes;
    }
}

/// The control thread's part: which tombstones it has already looked for.
#[derive(Debug, Default)]
pub struct Scanner {
    checked: BTreeSet<VolumeId>,
}

impl Scanner {
    /// Called with every map the OSD installs (the first one included): when it
    /// carries a tombstone not checked yet, walks the data directory and hands the
    /// tombstoned volumes found there to the shard threads (`pending`).
    pub fn on_map(&mut self, data_dir: &Path, map: &ClusterMap, pending: &Pending) {
        if map.deleted_volumes.is_subset(&self.checked) {
            return;
        }
        let held = volumes_on_disk(data_dir);
        let found: BTreeSet<VolumeId> = map.deleted_volumes.intersection(&held).copied().collect();
        if !found.is_empty() {
            tracing::info!(
                epoch = %map.epoch,
                "this OSD holds objects of {} removed volumes; deleting them",
                found.len()
            );
        }
        self.checked = map.deleted_volumes.clone();
        pending.set(found);
    }
}

/// The volumes with at least one object file in `data_dir` (a blocking walk of
/// `pgs/*/`). Unreadable directories are skipped: the next tombstone walks again.
pub fn volumes_on_disk(data_dir: &Path) -> BTreeSet<VolumeId> {
    let mut volumes = BTreeSet::new();
    let Ok(pgs) = std::fs::read_dir(layout::pgs_dir(data_dir)) else {
        return volumes;
    };
    for pg in pgs.flatten() {
        let name = pg.file_name();
        if layout::parse_pg_name(&name.to_string_lossy()).is_none() {
            continue;
        }
        let Ok(files) = std::fs::read_dir(pg.path()) else {
            continue;
        };
        for f in files.flatten() {
            if let Some(object) = layout::parse_object_name(&f.file_name().to_string_lossy()) {
                volumes.insert(object.volume);
            }
        }
    }
    volumes
}

/// A shard thread's part, run as a task for the life of the shard: deletes the
/// objects of every pending removed volume in this shard's placement groups, once
/// per volume (a failed deletion is retried at the next check).
pub async fn run(shard: Rc<Shard>) {
    let mut done: BTreeSet<VolumeId> = BTreeSet::new();
    loop {
        reactor::sleep(CHECK_INTERVAL).await;
        let pending = shard.recovery_shared.removed_volumes.get();
        // Forget volumes no longer pending, so `done` stays bounded.
        done.retain(|v| pending.contains(v));
        let todo: Vec<VolumeId> = pending.difference(&done).copied().collect();
        if todo.is_empty() {
            continue;
        }
        let view = shard.view();
        let Some(me) = view.map.osds.get(&shard.osd).cloned() else {
            continue;
        };
        for volume in todo {
            if view.map.volume_by_id(volume).is_some() {
                // Cannot happen (ids are never reused); never delete a live volume.
                done.insert(volume);
                continue;
            }
            let id = shard.id;
            match shard
                .store
                .delete_volume(volume, |pg| me.shard_of(pg) == id)
                .await
            {
                Ok(n) => {
                    tracing::info!(shard = id, %volume, objects = n, "deleted the objects of a removed volume");
                    done.insert(volume);
                }
                Err(e) => {
                    tracing::warn!(shard = id, %volume, "deleting a removed volume failed: {e}; will retry")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::ids::{ObjectId, PgId};

    #[test]
    fn finds_the_volumes_on_disk() {
        let dir = tempfile::tempdir().unwrap();
        assert!(volumes_on_disk(dir.path()).is_empty());
        for (pg, vol, index) in [(1u32, 5u64, 0u64), (1, 7, 3), (9, 5, 1)] {
            let object = ObjectId {
                volume: VolumeId(vol),
                index,
            };
            let path = layout::object_path(dir.path(), PgId(pg), object);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, b"x").unwrap();
        }
        std::fs::write(layout::pg_dir(dir.path(), PgId(1)).join("junk.tmp"), b"").unwrap();
        assert_eq!(
            volumes_on_disk(dir.path()),
            [VolumeId(5), VolumeId(7)].into_iter().collect()
        );
        // A map with a tombstone of one of them hands exactly that one over.
        let mut map = ClusterMap::new("f".into(), Default::default());
        map.deleted_volumes.insert(VolumeId(7));
        map.deleted_volumes.insert(VolumeId(8));
        let mut scanner = Scanner::default();
        let pending = Pending::default();
        scanner.on_map(dir.path(), &map, &pending);
        assert_eq!(pending.get(), [VolumeId(7)].into_iter().collect());
        // Checked already: no new walk (the set stays as it was).
        std::fs::remove_dir_all(layout::pgs_dir(dir.path())).unwrap();
        scanner.on_map(dir.path(), &map, &pending);
        assert_eq!(pending.get(), [VolumeId(7)].into_iter().collect());
    }
}
