//! Settling what a restart left in doubt on a copy that stayed complete
//! ([`crate::restart_suspects`]): the primary's own doubt is pulled from the
//! other complete copies before it serves the group or peers it; a complete
//! replica's doubt is compared and pushed from the primary.

use super::{BLOCK, JobError, differing_ranges};
use crate::pg::MapView;
use crate::restart_suspects::{Cause, PeerDoubt, Settle, settle};
use crate::shard::Shard;
use flame_common::ids::{Epoch, ObjectId, OsdId, PgId};
use flame_common::placement::PgMembers;
use flame_common::protocol::{BlockSum, IoTarget, Message, status};
use std::rc::Rc;

/// Ascending block numbers as `(offset, length)` byte ranges, adjacent blocks
/// merged.
fn byte_ranges(blocks: impl IntoIterator<Item = usize>) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    for b in blocks {
        let off = b as u32 * BLOCK;
        match out.last_mut() {
            Some((o, len)) if *o + *len == off => *len += BLOCK,
            _ => out.push((off, BLOCK)),
        }
    }
    out
}

/// The blocks of `mine` to replace with `source`'s: those whose sums differ or
/// that fail their checksum here, except those that fail theirs on the source
/// (this copy's block stays; read repair or scrub settles it).
pub(crate) fn ranges_to_pull(source: &[BlockSum], mine: &[BlockSum]) -> Vec<(u32, u32)> {
    byte_ranges(
        differing_ranges(source, mine)
            .into_iter()
            .flat_map(|(off, len)| (off / BLOCK..(off + len) / BLOCK).map(|b| b as usize))
            .filter(|&b| !source.get(b).is_some_and(|s| s.bad)),
    )
}

/// The blocks of `mine` that hold nothing (zeroes or absent) while `source`
/// holds good data there: what a copy in doubt lost that another kept.
pub(crate) fn holes_to_fill(source: &[BlockSum], mine: &[BlockSum]) -> Vec<(u32, u32)> {
    byte_ranges(source.iter().enumerate().filter_map(|(b, s)| {
        // Data there, nothing here (the rewritten flag is no data: a block
        // zeroed since a restart is a hole too).
        let hole = !s.bad && s.sum != 0 && mine.get(b).is_none_or(|m| !m.bad && m.sum == 0);
        hole.then_some(b)
    }))
}

/// The blocks of `mine` that `source` (another copy in doubt) rewrote since
/// its restart and this copy did not, where they differ: `source` holds the
/// newest write of those whatever its power cut took, while this copy's may be
/// a write old (seed 230811: a replica's restart, writes it acknowledged, then
/// the primary's power cut lost them; the primary kept its own bytes and
/// copied them over the replica's).
pub(crate) fn rewritten_to_take(source: &[BlockSum], mine: &[BlockSum]) -> Vec<(u32, u32)> {
    byte_ranges(source.iter().enumerate().filter_map(|(b, s)| {
        let m = mine.get(b).copied().unwrap_or_default();
        (s.rewritten && !s.bad && !m.rewritten && s.sum != m.sum).then_some(b)
    }))
}

/// Which blocks a pull replaces.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Pull {
    /// Every block that differs ([`ranges_to_pull`]); the object is removed
    /// here if the source lacks it (without `still`).
    Differing,
    /// Only the blocks the source, in doubt too, rewrote since its restart
    /// ([`rewritten_to_take`]).
    Rewritten,
    /// Only blocks empty here that hold data on the source ([`holes_to_fill`]).
    Holes,
}

impl Shard {
    /// This shard is the primary of `pg` and its restart left objects of it in
    /// doubt: replaces each by the copy of another complete member up that is
    /// sure of it ([`settle`]; `EAGAIN` while none is and complete copies are
    /// down). Until this succeeds the group serves no client I/O and is neither
    /// recovered nor peered from this copy (either would copy the doubtful
    /// blocks over the others — simulator seed 44034).
    pub(crate) async fn pull_suspects(
        self: &Rc<Self>,
        view: &Rc<MapView>,
        pg: PgId,
        members: &PgMembers,
    ) -> Result<(), i32> {
        debug_assert_eq!(members.primary(), Some(self.osd));
        let mine = self.suspects.borrow().causes(pg);
        let mut others: Vec<(OsdId, PeerDoubt)> = Vec::new();
        for &member in members.acting.iter().filter(|&&m| m != self.osd) {
            match self.member_doubt(view, pg, member).await {
                Ok(doubt) => others.push((member, doubt)),
                Err(status::E2BIG) => others.push((member, PeerDoubt::TooMany)),
                Err(st) => return Err(st),
            }
        }
        let (mut replaced, mut kept) = (0u64, 0u64);
        for (object, cause) in mine {
            match settle(object, cause, &others, members.down_complete.len()) {
                Settle::PullFrom(source) => {
                    if self.pull_object(view, pg, object, source, None).await? {
                        replaced += 1;
                    }
                }
                Settle::Keep => {
                    // Doubt is "may have lost", not "lost": a copy restarted
                    // after a kill -9 kept its page cache, and a power cut loses
                    // a new object's file (or blocks) to their older state. A
                    // block that holds nothing here but data on another copy in
                    // doubt came from a write every copy applied and this one
                    // lost (seed 68), and a block another copy rewrote since its
                    // restart holds the newest write there (seed 230811): take
                    // those; every other block stays.
                    // Every copy's rewritten blocks before any hole: a hole
                    // filled from one copy's older block must not hide another
                    // copy's newer one (this copy's pulls count as rewritten).
                    let mut filled = false;
                    for which in [Pull::Rewritten, Pull::Holes] {
                        for &(member, _) in &others {
                            filled |= self
                                .pull_blocks(view, pg, object, member, None, which)
                                .await?;
                        }
                    }
                    if filled {
                        replaced += 1;
                    } else {
                        kept += 1;
                    }
                }
                Settle::Wait => {
                    tracing::info!(%pg, %object, down = ?members.down_complete, "no complete copy up is sure of an object this restart left in doubt; waiting for the ones that are down");
                    return Err(status::EAGAIN);
                }
            }
        }
        if kept > 0 {
            tracing::warn!(%pg, objects = kept, "every complete copy is in doubt about these objects (none kept what this one may have lost); this copy's stay");
        }
        tracing::info!(%pg, replaced, kept, "objects this restart left in doubt settled from the other complete copies");
        let settled = self.suspects.borrow().objects(pg);
        self.suspects.borrow_mut().settled(pg);
        self.store.untrack_rewrites(settled);
        self.doubt_record.settle(pg);
        Ok(())
    }

    /// What `member`'s restart left it in doubt about in `pg`, with causes: every
    /// object, then those whose doubt is a reboot's — asked in that order, so a
    /// restart of the member between the two questions makes the second answer
    /// a new process's, which names a reboot's doubt for each object the first
    /// named that it did not settle (a crash is never inferred from it).
    async fn member_doubt(
        self: &Rc<Self>,
        view: &Rc<MapView>,
        pg: PgId,
        member: OsdId,
    ) -> Result<PeerDoubt, i32> {
        let all = self.member_suspects(view, pg, member, false).await?;
        if all.is_empty() {
            return Ok(PeerDoubt::Objects(Default::default()));
        }
        let rebooted: std::collections::BTreeSet<ObjectId> = self
            .member_suspects(view, pg, member, true)
            .await?
            .into_iter()
            .collect();
        Ok(PeerDoubt::Objects(
            all.into_iter()
                .map(|o| {
                    let cause = if rebooted.contains(&o) {
                        Cause::Reboot
                    } else {
                        Cause::Crash
                    };
                    (o, cause)
                })
                .collect(),
        ))
    }

    /// Replaces this copy of `object` by `source`'s, holding the object's write
    /// gate throughout — if `still` (asked once the writes before it finished)
    /// says it is still wanted. With `still`, an object the source lacks is
    /// left alone; without (a restart's doubt), it is removed here too.
    /// Returns whether anything changed.
    pub(super) async fn pull_object(
        self: &Rc<Self>,
        view: &Rc<MapView>,
        pg: PgId,
        object: ObjectId,
        source: OsdId,
        still: Option<&dyn Fn() -> bool>,
    ) -> Result<bool, i32> {
        self.pull_blocks(view, pg, object, source, still, Pull::Differing)
            .await
    }

    /// [`Self::pull_object`], replacing the blocks `which` says.
    pub(super) async fn pull_blocks(
        self: &Rc<Self>,
        view: &Rc<MapView>,
        pg: PgId,
        object: ObjectId,
        source: OsdId,
        still: Option<&dyn Fn() -> bool>,
        which: Pull,
    ) -> Result<bool, i32> {
        let object_size = view.map.pool.object_size;
        let _slot = self.take_slot().await;
        let (_guard, earlier) = self.gate.enter(object, 0, object_size);
        for e in earlier {
            e.wait().await;
        }
        if still.is_some_and(|f| !f()) {
            return Ok(false);
        }
        let rewritten = which == Pull::Rewritten;
        let theirs = self
            .object_sums_with(view, pg, object, source, rewritten)
            .await?;
        let mine = self
            .object_sums_with(view, pg, object, self.osd, rewritten)
            .await?;
        if theirs.is_empty() {
            // Taking a newer copy (`still` given) never removes this one: a
            // source whose log names writes to an object it lacks is wrong.
            if mine.is_empty() || still.is_some() || which != Pull::Differing {
                return Ok(false);
            }
            // No acknowledged write created it: the other copy would have it.
            self.forget_proof(pg, object, 0, 0);
            self.store.remove_object(pg, object).await.map_err(|e| {
                tracing::error!(%object, "cannot remove an object in doubt: {e}");
                status::EIO
            })?;
            return Ok(true);
        }
        let ranges = match which {
            Pull::Differing => ranges_to_pull(&theirs, &mine),
            Pull::Rewritten => rewritten_to_take(&theirs, &mine),
            Pull::Holes => holes_to_fill(&theirs, &mine),
        };
        let Some(osd) = view.map.osds.get(&source) else {
            return Err(status::ESTALE);
        };
        for &(off, len) in &ranges {
            let mut at = off;
            // Bounded: `at` advances by at least one block per round.
            while at < off + len {
                let n = super::COPY_CHUNK_BYTES.min(off + len - at);
                let target = IoTarget {
                    pg,
                    object,
                    offset: at,
                    length: n,
                };
                let data = match self.read_replica(osd, target, view.map.epoch).await? {
                    Message::Reply {
                        status: status::OK,
                        data,
                        ..
                    } if data.len() == n as usize => data,
                    Message::Reply { status: st, .. } if st != status::OK => return Err(st),
                    _ => return Err(status::EIO),
                };
                self.forget_proof(pg, object, at, n);
                self.write_pulled(pg, object, at, data.as_slice()).await?;
                at += n;
            }
        }
        Ok(!ranges.is_empty())
    }

    /// Writes pulled bytes over this copy, stably: runs of zero blocks as holes
    /// (as recovery copies them), the rest with their checksums.
    async fn write_pulled(
        &self,
        pg: PgId,
        object: ObjectId,
        offset: u32,
        data: &[u8],
    ) -> Result<(), i32> {
        let io = |e: crate::store::StoreError| {
            tracing::error!(%object, "cannot write pulled bytes: {e}");
            status::EIO
        };
        for (lo, hi, zero) in super::block_runs(data) {
            let at = offset + lo as u32;
            if zero {
                self.store
                    .zero(pg, object, at, (hi - lo) as u32, true)
                    .await
                    .map_err(io)?;
            } else {
                self.store
                    .repair_range(pg, object, at / BLOCK, &data[lo..hi])
                    .await
                    .map_err(io)?;
            }
        }
        Ok(())
    }

    /// This shard is the primary of `pg` and `member` a complete replica: if
    /// the member's restart (incarnation `up_from`) left objects of the group in
    /// doubt, compares them with this copy and pushes what differs, then
    /// flushes the member. Done once per incarnation (the caller records it).
    pub(crate) async fn push_member_suspects(
        self: &Rc<Self>,
        view: &Rc<MapView>,
        pg: PgId,
        member: OsdId,
        job: (Epoch, u64),
    ) -> Result<(), JobError> {
        let volumes = match self.member_suspects(view, pg, member, false).await {
            Ok(objects) if objects.is_empty() => return Ok(()),
            Ok(objects) => {
                let objects = objects.into_iter().map(|o| (o, None)).collect();
                self.for_each_object(view, pg, member, job, objects, "suspects")
                    .await?
            }
            Err(status::E2BIG) => self.backfill(view, pg, member, job, "suspects").await?,
            Err(st) => return Err(JobError::Failed(st)),
        };
        self.flush_member(view, pg, member, &volumes)
            .await
            .map_err(JobError::Failed)?;
        tracing::info!(%pg, %member, "compared what the member's restart left in doubt");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sums(v: &[(u32, bool)]) -> Vec<BlockSum> {
        v.iter()
            .map(|&(sum, bad)| BlockSum {
                sum,
                bad,
                ..BlockSum::default()
            })
            .collect()
    }

    #[test]
    fn pulls_differing_and_locally_bad_blocks_never_the_sources_bad_ones() {
        let source = sums(&[(1, false), (2, false), (3, true), (4, false), (5, false)]);
        let mine = sums(&[(1, false), (9, false), (9, false), (4, true), (5, false)]);
        let b = BLOCK;
        // Block 1 differs, block 2 is bad on the source (kept), block 3 is bad here.
        assert_eq!(ranges_to_pull(&source, &mine), vec![(b, b), (3 * b, b)]);
        assert!(ranges_to_pull(&source, &source).is_empty());
        // A longer copy here: the source's missing blocks read as zeroes.
        let short = sums(&[(1, false)]);
        assert_eq!(
            ranges_to_pull(&short, &sums(&[(1, false), (7, false), (8, false)])),
            vec![(b, 2 * b)]
        );
    }

    /// Seed 68: every complete copy was in doubt about a new object; the
    /// primary (power cut) had lost blocks the other (kill -9) kept. Only
    /// blocks empty here and holding good data there are taken.
    #[test]
    fn fills_only_blocks_empty_here_with_good_data_on_the_source() {
        let b = BLOCK;
        let source = sums(&[
            (1, false),
            (2, false),
            (3, true),
            (0, false),
            (5, false),
            (6, false),
        ]);
        let mine = sums(&[(0, false), (9, false), (0, false), (4, false)]);
        // Block 0 empty here: filled; 1 differs but holds data here: kept; 2 bad
        // on the source; 3 empty there; 4 and 5 past this copy's end: filled.
        assert_eq!(holes_to_fill(&source, &mine), vec![(0, b), (4 * b, 2 * b)]);
        assert_eq!(
            holes_to_fill(&source, &[]),
            vec![(0, 2 * b), (4 * b, 2 * b)]
        );
        assert_eq!(holes_to_fill(&mine, &source), vec![(3 * b, b)]);
        assert!(holes_to_fill(&source, &source).is_empty());
    }

    /// Seed 230811: a replica restarted (power cut) and then applied writes the
    /// primary acknowledged; the primary's power cut lost them. Every copy in
    /// doubt, the primary's bytes stay — except where the replica rewrote a
    /// block since its restart and the primary did not.
    #[test]
    fn takes_the_blocks_the_other_copy_rewrote_since_its_restart() {
        let b = BLOCK;
        let s = |sum, bad, rewritten| BlockSum {
            sum,
            bad,
            rewritten,
        };
        let source = vec![
            s(1, false, false), // older here or there: nothing tells, kept
            s(2, false, true),  // rewritten there: taken
            s(3, false, true),  // rewritten on both: kept
            s(4, true, true),   // bad there: kept
            s(5, false, true),  // rewritten there, equal here: nothing to do
            s(0, false, true),  // zeroed there since: taken
            s(7, false, true),  // past this copy's end: taken
        ];
        let mine = vec![
            s(9, false, false),
            s(9, false, false),
            s(9, false, true),
            s(9, false, false),
            s(5, false, false),
            s(9, false, false),
        ];
        assert_eq!(
            rewritten_to_take(&source, &mine),
            vec![(b, b), (5 * b, 2 * b)]
        );
        assert!(rewritten_to_take(&mine, &mine).is_empty());
        // A block zeroed since the source's restart is no data to fill a hole
        // with, and a rewritten zero block here is a hole.
        let zeroed = vec![s(0, false, true), s(3, false, false)];
        let holed = vec![s(0, false, true), s(0, false, false)];
        assert_eq!(holes_to_fill(&zeroed, &holed), vec![(b, b)]);
        assert!(holes_to_fill(&[s(0, false, true)], &[]).is_empty());
    }
}

/// One real shard (the primary, OSD 1, its restart in doubt about an object)
/// against a scripted complete copy (OSD 2) in doubt too.
#[cfg(test)]
mod scripted {
    use super::super::gate_test::{read_of, scripted_copy, shard};
    use crate::pg::MapView;
    use crate::restart_suspects::{Cause, RestartSuspects};
    use crate::store::meta::compare_sum;
    use flame_common::buffer::PayloadBuf;
    use flame_common::ids::{ObjectId, OsdId, PgId, VolumeId};
    use flame_common::placement::PgMembers;
    use flame_common::protocol::{
        BlockSum, Message, OBJECT_SUMS_REWRITTEN, encode_block_sums, encode_object_list,
    };
    use flame_common::reactor::Reactor;
    use std::net::SocketAddr;
    use std::rc::Rc;

    const PG: PgId = PgId(0);
    const OBJECT: ObjectId = ObjectId {
        volume: VolumeId(1),
        index: 0,
    };
    const B: usize = 4096;

    /// A complete copy in doubt (a reboot's) about [`OBJECT`], holding `bytes`,
    /// having rewritten the blocks in `rewritten` since its restart.
    fn copy_in_doubt(bytes: Vec<u8>, rewritten: Vec<usize>) -> SocketAddr {
        scripted_copy(move |msg| match msg {
            Message::PgSuspects { .. } => Some(encode_object_list(&[OBJECT])),
            Message::ObjectSums { target, .. } => {
                let marked = target.offset == OBJECT_SUMS_REWRITTEN;
                let sums: Vec<BlockSum> = bytes
                    .chunks(B)
                    .enumerate()
                    .map(|(i, b)| BlockSum {
                        sum: compare_sum(b),
                        bad: false,
                        rewritten: marked && rewritten.contains(&i),
                    })
                    .collect();
                Some(encode_block_sums(&sums))
            }
            Message::Read { target, .. } => Some(read_of(&bytes, target)),
            _ => None,
        })
    }

    /// Seed 230811: both copies rebooted since their last writes, so this
    /// copy's bytes stay — except the blocks the other rewrote since its own
    /// restart, which hold the newest write whatever its power cut took.
    #[test]
    fn a_primary_in_doubt_takes_the_blocks_the_other_copy_rewrote_since_its_restart() {
        // Four blocks: the other copy rewrote block 1 (a write acknowledged
        // after its restart, which this copy's power cut lost) and differs on
        // block 2 too (older there or here: nothing tells; this copy's stays).
        let theirs: Vec<u8> = [0xa0u8, 0xb1, 0xc1, 0xd0]
            .iter()
            .flat_map(|&v| vec![v; B])
            .collect();
        let mine: Vec<u8> = [0xa0u8, 0xb0, 0xc0, 0xd0]
            .iter()
            .flat_map(|&v| vec![v; B])
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let shard = shard(dir.path(), copy_in_doubt(theirs, vec![1]));
        let mut map = shard.view().map.clone();
        map.pg_complete.insert(PG, vec![OsdId(1), OsdId(2)]);
        *shard.view.borrow_mut() = Rc::new(MapView::new(&map));
        *shard.suspects.borrow_mut() = RestartSuspects::new(&[(PG, OBJECT, Cause::Reboot)]);
        let members = PgMembers {
            placed: vec![OsdId(1), OsdId(2)],
            acting: vec![OsdId(1), OsdId(2)],
            recovering: vec![],
            down_complete: vec![],
            active: true,
        };
        let mut r = Reactor::new(Default::default()).unwrap();
        let now = r
            .block_on(async move {
                shard
                    .store
                    .write(PG, OBJECT, 0, PayloadBuf::copy_from(&mine), false)
                    .await
                    .unwrap();
                let view = shard.view();
                shard.pull_suspects(&view, PG, &members).await.unwrap();
                assert!(!shard.suspects.borrow().has(PG), "the doubt is settled");
                let now = shard.store.read(PG, OBJECT, 0, 4 * B as u32).await.unwrap();
                now.as_slice().to_vec()
            })
            .unwrap();
        let firsts: Vec<u8> = now.chunks(B).map(|b| b[0]).collect();
        assert_eq!(
            firsts,
            vec![0xa0, 0xb1, 0xc0, 0xd0],
            "block 1 taken (rewritten there), block 2 kept (nothing tells)"
        );
    }
}
