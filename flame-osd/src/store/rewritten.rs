//! The blocks this process rewrote, since it started, of the objects its
//! restart left in doubt ([`crate::restart_suspects`]).
//!
//! A power cut may have kept any block of such an object one write old; but a
//! block this process wrote whole since it started holds that write whatever the
//! cut took (it is in the page cache, or stable). So when every complete copy of
//! an object is in doubt, the primary takes from each other copy the blocks that
//! copy rewrote since its own restart, where its own copy did not: otherwise a
//! primary that lost power after a replica's restart copies its older bytes
//! over the writes that replica acknowledged since (simulator seed 230811).
//!
//! Kept in memory only: a later restart forgets it (the blocks are then in doubt
//! again). Bounded: objects by the restart-doubt record, ranges per object by
//! its blocks.

use flame_common::collections::HashMap;
use flame_common::ids::ObjectId;
use std::cell::RefCell;

/// Blocks of an object as sorted, disjoint, non-adjacent `[first, end)` ranges.
pub type BlockRanges = Vec<(u32, u32)>;

/// Adds `[first, end)` to `ranges`, merging what touches or overlaps it.
pub fn insert(ranges: &mut BlockRanges, first: u32, end: u32) {
    if first >= end {
        return;
    }
    let (mut lo, mut hi) = (first, end);
    ranges.retain(|&(a, b)| {
        if b < lo || a > hi {
            return true;
        }
        lo = lo.min(a);
        hi = hi.max(b);
        false
    });
    let at = ranges.partition_point(|&(a, _)| a < lo);
    ranges.insert(at, (lo, hi));
}

/// Whether block `b` is in `ranges`.
pub fn contains(ranges: &[(u32, u32)], b: u32) -> bool {
    let at = ranges.partition_point(|&(_, end)| end <= b);
    ranges.get(at).is_some_and(|&(first, _)| first <= b)
}

/// The blocks a write of `len` bytes at `offset` covers whole (a partial block
/// keeps bytes from before, which may be the older ones).
pub fn whole_blocks(offset: u32, len: u32, block: u32) -> Option<(u32, u32)> {
    let start = u64::from(offset).div_ceil(u64::from(block));
    let end = (u64::from(offset) + u64::from(len)) / u64::from(block);
    (start < end).then_some((start as u32, end as u32))
}

/// What the store tracks: for each object in doubt at start-up, the blocks
/// rewritten since.
#[derive(Default)]
pub struct Rewritten {
    objects: RefCell<HashMap<ObjectId, BlockRanges>>,
}

impl Rewritten {
    /// Starts tracking these objects (the start-up's doubt of this shard).
    pub fn track(&self, objects: impl IntoIterator<Item = ObjectId>) {
        let mut m = self.objects.borrow_mut();
        for o in objects {
            m.entry(o).or_default();
        }
    }

    /// Stops tracking these objects (their doubt is settled: this copy's marks
    /// are never asked for again), so the data path pays nothing for them.
    pub fn untrack(&self, objects: impl IntoIterator<Item = ObjectId>) {
        let mut m = self.objects.borrow_mut();
        for o in objects {
            m.remove(&o);
        }
    }

    /// Whether no object is tracked (no doubt, or all of it settled).
    pub fn is_idle(&self) -> bool {
        self.objects.borrow().is_empty()
    }

    /// `object`'s blocks `[first, end)` were just written whole (or removed).
    /// One branch on the data path when nothing is tracked.
    pub fn note(&self, object: ObjectId, first: u32, end: u32) {
        let mut m = self.objects.borrow_mut();
        if m.is_empty() {
            return;
        }
        if let Some(r) = m.get_mut(&object) {
            insert(r, first, end);
        }
    }

    /// The blocks of `object` rewritten since start-up (empty if it is not
    /// tracked).
    pub fn of(&self, object: ObjectId) -> BlockRanges {
        self.objects
            .borrow()
            .get(&object)
            .cloned()
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::ids::VolumeId;

    #[test]
    fn ranges_merge_when_they_touch_or_overlap_and_stay_sorted() {
        let mut r = BlockRanges::new();
        insert(&mut r, 10, 12);
        insert(&mut r, 2, 4);
        assert_eq!(r, vec![(2, 4), (10, 12)]);
        insert(&mut r, 4, 5);
        assert_eq!(r, vec![(2, 5), (10, 12)]);
        insert(&mut r, 6, 8);
        assert_eq!(r, vec![(2, 5), (6, 8), (10, 12)]);
        insert(&mut r, 3, 11);
        assert_eq!(r, vec![(2, 12)]);
        insert(&mut r, 7, 7);
        assert_eq!(r, vec![(2, 12)]);
        assert!(contains(&r, 2) && contains(&r, 11));
        assert!(!contains(&r, 1) && !contains(&r, 12));
        assert!(!contains(&[], 0));
    }

    #[test]
    fn only_whole_blocks_count() {
        assert_eq!(whole_blocks(0, 4096, 4096), Some((0, 1)));
        assert_eq!(whole_blocks(4096, 8192, 4096), Some((1, 3)));
        assert_eq!(whole_blocks(512, 8192, 4096), Some((1, 2)));
        assert_eq!(whole_blocks(512, 4096, 4096), None);
        assert_eq!(whole_blocks(0, 4095, 4096), None);
        assert_eq!(whole_blocks(u32::MAX - 4095, 4095, 4096), None);
    }

    #[test]
    fn only_tracked_objects_are_noted() {
        let o = |i| ObjectId {
            volume: VolumeId(1),
            index: i,
        };
        let t = Rewritten::default();
        t.note(o(1), 0, 1);
        assert!(t.of(o(1)).is_empty());
        t.track([o(1)]);
        t.note(o(1), 0, 1);
        t.note(o(2), 0, 1);
        assert_eq!(t.of(o(1)), vec![(0, 1)]);
        assert!(t.of(o(2)).is_empty());
        t.untrack([o(1)]);
        t.note(o(1), 4, 5);
        assert!(t.of(o(1)).is_empty());
    }
}
