//! Store calls for recovery, scrub and stray removal: list a placement group's
//! objects, checksum an object's blocks as they are on disk now, remove an object,
//! remove a whole placement group's copy.

use super::meta::{self, BLOCK, BLOCKS_MAX, DATA_OFFSET};
use super::{DELETE_BATCH, ObjectStore, RECOVER_CHUNK_BLOCKS, StoreError, layout};
use flame_common::ids::{ObjectId, PgId};
use flame_common::protocol::BlockSum;
use flame_common::reactor;

impl ObjectStore {
    /// The objects of `pg` this shard holds, in ascending (volume, index) order.
    /// Files that are not objects are ignored.
    pub async fn list_pg(&self, pg: PgId) -> Result<Vec<ObjectId>, StoreError> {
        let names = self.fs.list_dir(&layout::pg_dir(&self.root, pg)).await?;
        let mut objects: Vec<ObjectId> = names
            .iter()
            .filter_map(|n| layout::parse_object_name(n))
            .collect();
        objects.sort();
        Ok(objects)
    }

    /// How many objects this store holds of each of `pgs` (0 for a group without a
    /// directory), listed in one helper-thread call: the per-group counts the
    /// heartbeat carries so the manager can count degraded and misplaced objects.
    pub async fn count_pg_objects(&self, pgs: &[PgId]) -> Result<Vec<u64>, StoreError> {
        let dirs = pgs
            .iter()
            .map(|&pg| layout::pg_dir(&self.root, pg))
            .collect();
        let listed = self.fs.list_dirs(dirs).await?;
        Ok(listed
            .iter()
            .map(|names| {
                names
                    .iter()
                    .filter(|n| layout::parse_object_name(n).is_some())
                    .count() as u64
            })
            .collect())
    }

    /// Placement groups that have a directory on this data directory (any shard's).
    pub async fn list_pg_dirs(&self) -> Result<Vec<PgId>, StoreError> {
        let names = self.fs.list_dir(&layout::pgs_dir(&self.root)).await?;
        Ok(names
            .iter()
            .filter_map(|n| layout::parse_pg_name(n))
            .collect())
    }

    /// Every block of an object as its data is on disk now: the fingerprint of the
    /// data ([`meta::compare_sum`]: 0 = all zeroes) and whether it fails the checksum the store
    /// recorded for it. Reads the whole object. An absent object has no blocks;
    /// trailing all-zero good blocks are left out, so an object that reads as zeroes
    /// everywhere compares equal to an absent one.
    ///
    /// The caller keeps writes to the object out meanwhile (the primary's write
    /// gate); writes already in flight are waited for.
    pub async fn block_sums(
        &self,
        pg: PgId,
        object: ObjectId,
    ) -> Result<Vec<BlockSum>, StoreError> {
        let Some(state) = self.state(pg, object, false).await? else {
            return Ok(Vec::new());
        };
        state.wait_idle().await;
        let data_len = state.file.size().await?.saturating_sub(DATA_OFFSET);
        let on_disk = data_len.div_ceil(BLOCK as u64) as usize;
        let blocks = on_disk.max(state.sums.borrow().len()).min(BLOCKS_MAX);
        let mut out = Vec::with_capacity(blocks);
        let mut b = 0;
        // Bounded by BLOCKS_MAX.
        while b < blocks {
            let n = RECOVER_CHUNK_BLOCKS.min(blocks - b);
            let data = state
                .file
                .read(DATA_OFFSET + (b * BLOCK) as u64, n * BLOCK)
                .await?;
            for (i, block) in data.chunks(BLOCK).enumerate() {
                // Verified against the stored crc32c; compared by a non-linear
                // fingerprint (see `meta::compare_sum`: the crc32c of a block that
                // ends with its own crc32c is the same for every such block).
                let bad = self.checksums
                    && (state.meta_bad.get() || meta::block_sum(block) != state.sum(b + i));
                if bad {
                    state.file.note_checksum_mismatch(&[(b + i) as u32]);
                }
                out.push(BlockSum {
                    sum: meta::compare_sum(block),
                    bad,
                    rewritten: false,
                });
            }
            b += n;
            // A 64 MiB object is 64 reads: let the shard's other tasks run between.
            reactor::yield_now().await;
        }
        while out.last() == Some(&BlockSum::default()) {
            out.pop();
        }
        Ok(out)
    }

    /// Removes this shard's copy of an object (`Ok(false)`: there was none). The
    /// removal is made durable by the next FLUSH's directory sync.
    pub async fn remove_object(&self, pg: PgId, object: ObjectId) -> Result<bool, StoreError> {
        // Not while another task opens it: it would cache the state of the file
        // this unlinks.
        let _opening = self.lock_opening(object).await;
        if let Some(state) = self.cached(object) {
            state.wait_idle().await;
        }
        self.files.borrow_mut().remove(&object);
        self.dirty.borrow_mut().remove(&object);
        let removed = self.fs.unlink(&self.object_path(pg, object), false).await?;
        self.rewritten.note(object, 0, BLOCKS_MAX as u32);
        {
            let mut absent = self.absent.borrow_mut();
            if absent.len() >= super::ABSENT_CACHE_MAX {
                absent.clear();
            }
            absent.insert(object);
        }
        if removed {
            self.mark_dir_dirty(layout::pg_dir(&self.root, pg));
        }
        Ok(removed)
    }

    /// Removes this shard's whole copy of a placement group: every object file and
    /// then the directory. Returns how many objects were removed. Yields to the
    /// shard's other tasks every [`DELETE_BATCH`] files.
    pub async fn delete_pg(&self, pg: PgId) -> Result<u64, StoreError> {
        let mut removed = 0;
        for object in self.list_pg(pg).await? {
            if self.remove_object(pg, object).await? {
                removed += 1;
            }
            if removed % DELETE_BATCH == 0 {
                reactor::yield_now().await;
            }
        }
        let dir = layout::pg_dir(&self.root, pg);
        match self.fs.unlink(&dir, true).await {
            Ok(_) => {
                self.known_dirs.borrow_mut().remove(&pg);
                self.mark_dir_dirty(layout::pgs_dir(&self.root));
            }
            // A file that is not an object keeps the directory; the objects are gone.
            Err(e) => tracing::warn!(%pg, "cannot remove the placement group directory: {e}"),
        }
        self.sync_dirs().await?;
        Ok(removed)
    }
}
