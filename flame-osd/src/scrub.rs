//! Scrub: the primary of a placement group compares every acting copy of each of
//! its objects, block by block, by the checksum of the data each copy holds now
//! ([`Message::ObjectSums`] reads the whole object and also says which blocks fail
//! the copy's own stored checksum — bit rot that a comparison of stored checksum
//! tables alone would miss).
//!
//! Per block, the copies that verify vote with their checksum. The value a strict
//! majority of the acting copies holds wins; without one (two copies disagreeing),
//! the primary's copy wins if it verifies — counted as `primary_won` and logged,
//! since nothing proves it right — else any copy that verifies. Copies that differ
//! from the winner (or fail verification) are rewritten from a copy holding it
//! (replica-flagged WRITE, or DISCARD for an all-zero block), unless it is a dry
//! run (`flame-admin pg compare`, `flame-admin scrub --dry-run`). The whole object
//! is compared and repaired under the primary's write gate, so no client write
//! runs meanwhile.
//!
//! Background scrubs visit each group this shard is the primary of every
//! `scrub_interval_s`, reading at most `scrub_bytes_per_sec`.

use crate::pg::MapView;
use crate::recovery::throttle;
use crate::shard::Shard;
use flame_common::clock;
use flame_common::collections::HashMap;
use flame_common::ids::{ObjectId, OsdId, PgId, PgSeq, RequestId, VolumeId};
use flame_common::protocol::{BlockSum, IoTarget, Message, ScrubCounts, flags, status};
use std::collections::BTreeSet;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Block size of the store's checksums.
const BLOCK: u32 = 4096;

/// The outcome of one block's vote.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Vote {
    /// The winning checksum (`None`: no copy verifies).
    pub winner: Option<u32>,
    /// No strict majority: the primary's copy (index 0) won.
    pub primary_won: bool,
    /// Copies (by index) that must be rewritten.
    pub wrong: Vec<usize>,
}

/// Votes on one block held by `copies` (index 0 = the primary).
pub(crate) fn vote(copies: &[BlockSum]) -> Vote {
    let mut counts: HashMap<u32, usize> = HashMap::default();
    for c in copies.iter().filter(|c| !c.bad) {
        *counts.entry(c.sum).or_default() += 1;
    }
    let best = counts.values().copied().max().unwrap_or(0);
    let primary = copies.first().filter(|c| !c.bad).map(|c| c.sum);
    let (winner, primary_won) = if best * 2 > copies.len() {
        (
            counts.iter().find(|(_, n)| **n == best).map(|(s, _)| *s),
            false,
        )
    } else if let Some(p) = primary {
        // Tie or scattered values: the primary's verified copy.
        let agreed = copies.iter().all(|c| !c.bad && c.sum == p);
        (Some(p), !agreed)
    } else {
        // No majority and the primary's block is bad: the smallest checksum held by
        // the most copies (deterministic).
        let w = counts
            .iter()
            .filter(|(_, n)| **n == best)
            .map(|(s, _)| *s)
            .min();
        (w, false)
    };
    let wrong = copies
        .iter()
        .enumerate()
        .filter(|(_, c)| c.bad || Some(c.sum) != winner)
        .map(|(i, _)| i)
        .collect();
    Vote {
        winner,
        primary_won,
        wrong,
    }
}

impl Shard {
    /// Reads one block from `member` (this OSD: the local store, verified).
    async fn read_block(
        self: &Rc<Self>,
        view: &MapView,
        pg: PgId,
        object: ObjectId,
        member: OsdId,
        block: u32,
    ) -> Result<flame_common::buffer::PayloadBuf, i32> {
        let offset = block * BLOCK;
        if member == self.osd {
            return self
                .store
                .read(pg, object, offset, BLOCK)
                .await
                .map_err(|_| status::EIO);
        }
        let reply = self
            .ask(
                view,
                member,
                pg,
                Message::Read {
                    id: RequestId(0),
                    epoch: view.map.epoch,
                    target: IoTarget {
                        pg,
                        object,
                        offset,
                        length: BLOCK,
                    },
                    flags: flags::REPLICA,
                    remote: None,
                },
            )
            .await?;
        match reply {
            Message::Reply { data, .. } if data.len() == BLOCK as usize => Ok(data),
            _ => Err(status::EIO),
        }
    }

    /// Writes one block (`data`, or zeroes as a hole when `None`) to `member`.
    async fn write_block(
        self: &Rc<Self>,
        view: &MapView,
        pg: PgId,
        object: ObjectId,
        member: OsdId,
        block: u32,
        data: Option<flame_common::buffer::PayloadBuf>,
    ) -> Result<(), i32> {
        let offset = block * BLOCK;
        if member == self.osd {
            // Another copy's bytes replace this copy's: the log no longer proves
            // which ops this copy holds there.
            self.forget_proof(pg, object, offset, BLOCK);
            let r = match data {
                Some(d) => self.store.write(pg, object, offset, d, false).await,
                None => self.store.zero(pg, object, offset, BLOCK, false).await,
            };
            return r.map_err(|e| {
                tracing::error!(%object, block, "scrub repair of this copy failed: {e}");
                status::EIO
            });
        }
        let target = IoTarget {
            pg,
            object,
            offset,
            length: BLOCK,
        };
        let msg = match data {
            Some(d) => Message::Write {
                id: RequestId(0),
                epoch: view.map.epoch,
                target,
                flags: flags::REPLICA,
                seq: PgSeq(0),
                op: flame_common::ids::OpId::NONE,
                remote: None,
                data: d,
            },
            None => Message::Discard {
                id: RequestId(0),
                epoch: view.map.epoch,
                target,
                flags: flags::REPLICA,
                seq: PgSeq(0),
                op: flame_common::ids::OpId::NONE,
            },
        };
        self.ask(view, member, pg, msg).await.map(|_| ())
    }

    /// Whether `member`'s copy of `block` of `object` may differ from the
    /// others' for a known reason: a write over it the group's log shows the
    /// member missed (caught up later), or restart doubt not settled yet —
    /// this primary's own about the object, or a replica's whose suspects this
    /// primary has not compared for its incarnation. This primary's own copy
    /// outvoted is also explained when the others missed a write there by the
    /// log: one this copy failed (a full disk) while they applied it (seed 36:
    /// the scrub came before the catch-up that makes them equal to this copy).
    fn divergence_expected(
        &self,
        view: &MapView,
        pg: PgId,
        object: ObjectId,
        member: OsdId,
        block: usize,
    ) -> bool {
        let offset = (block as u32).saturating_mul(BLOCK);
        if member == self.osd {
            let others: Vec<OsdId> = view
                .table
                .pg(pg)
                .acting
                .iter()
                .copied()
                .filter(|&m| m != self.osd)
                .collect();
            let others_lag = self.pgs.borrow().get(pg).is_some_and(|c| {
                c.repair_sources(&others, object, offset, BLOCK).len() < others.len()
            });
            return others_lag
                || self
                    .doubt_record
                    .objects()
                    .iter()
                    .any(|&(p, o)| p == pg && o == object);
        }
        let lags = self.pgs.borrow().get(pg).is_some_and(|c| {
            c.repair_sources(&[member], object, offset, BLOCK)
                .is_empty()
        });
        let up_from = view.map.osds.get(&member).map(|o| o.up_from);
        let unsettled = self
            .recovery
            .suspects_checked
            .borrow()
            .get(&(pg, member))
            .copied()
            != up_from;
        lags || unsettled
    }

    /// Whether `member` (a replica) says its restart left `object` in doubt:
    /// asked only for a copy found differing with no reason this primary knows
    /// of, because the map may not show its restart yet (seed 74: a replica
    /// restarted within the heartbeat grace was compared, a power cut's blocks
    /// old, before the map told its new incarnation). Asked once per member
    /// and object (`asked`); an answer that cannot list (E2BIG: everything in
    /// doubt) or none at all counts as doubt.
    async fn member_doubts(
        self: &Rc<Self>,
        view: &MapView,
        pg: PgId,
        object: ObjectId,
        member: OsdId,
        asked: &mut Vec<(OsdId, bool)>,
    ) -> bool {
        if member == self.osd {
            return false;
        }
        if let Some(&(_, d)) = asked.iter().find(|(m, _)| *m == member) {
            return d;
        }
        let d = match self.member_suspects(view, pg, member, false).await {
            Ok(objects) => objects.contains(&object),
            Err(_) => true,
        };
        asked.push((member, d));
        d
    }

    /// Compares (and unless `dry_run` repairs) one object across `members`
    /// (index 0 = this primary). Returns (inconsistent, repaired, primary_won),
    /// or an error status when a copy could not be read or written.
    async fn scrub_object(
        self: &Rc<Self>,
        view: &MapView,
        pg: PgId,
        object: ObjectId,
        members: &[OsdId],
        dry_run: bool,
    ) -> Result<(bool, bool, bool), i32> {
        let (_guard, earlier) = self.gate.enter(object, 0, view.map.pool.object_size);
        for e in earlier {
            e.wait().await;
        }
        let mut sums = Vec::with_capacity(members.len());
        for &m in members {
            let s = self.object_sums(view, pg, object, m).await?;
            throttle(
                &self.recovery.scrub_throttle,
                (s.len() as u64).max(1) * u64::from(BLOCK),
                self.scrub_bytes_per_sec,
            )
            .await;
            sums.push(s);
        }
        let blocks = sums.iter().map(Vec::len).max().unwrap_or(0);
        let mut inconsistent = false;
        let mut primary_won = false;
        let mut fixes: Vec<(u32, Option<u32>, Vec<usize>)> = Vec::new();
        // Replicas' own restart doubt, asked once each (`member_doubts`).
        let mut doubts: Vec<(OsdId, bool)> = Vec::new();
        for b in 0..blocks {
            let copies: Vec<BlockSum> = sums
                .iter()
                .map(|s| s.get(b).copied().unwrap_or_default())
                .collect();
            let v = vote(&copies);
            if v.wrong.is_empty() {
                continue;
            }
            inconsistent = true;
            primary_won |= v.primary_won;
            for &i in &v.wrong {
                if !copies[i].bad
                    && !self.divergence_expected(view, pg, object, members[i], b)
                    && !self
                        .member_doubts(view, pg, object, members[i], &mut doubts)
                        .await
                {
                    tracing::error!(
                        %object,
                        block = b,
                        member = %members[i],
                        "scrub: this copy differs from the others although no write is known \
                         missing there and no restart doubt is unsettled"
                    );
                    self.recovery_shared
                        .scrub_unexplained
                        .fetch_add(1, Ordering::Relaxed);
                }
            }
            let Some(winner) = v.winner else {
                tracing::error!(%object, block = b, "scrub: no copy of this block verifies");
                return Err(status::EIO);
            };
            fixes.push((b as u32, Some(winner), v.wrong));
        }
        if primary_won {
            tracing::warn!(%object, "scrub: copies disagree with no majority; the primary's copy wins");
        }
        if dry_run || fixes.is_empty() {
            return Ok((inconsistent, false, primary_won));
        }
        for (block, winner, wrong) in fixes {
            let winner = winner.unwrap_or(0);
            let data = if winner == 0 {
                None
            } else {
                // A source: a copy holding the winner that verifies.
                let src = (0..members.len())
                    .find(|i| {
                        sums[*i]
                            .get(block as usize)
                            .is_some_and(|c| !c.bad && c.sum == winner)
                    })
                    .ok_or(status::EIO)?;
                Some(
                    self.read_block(view, pg, object, members[src], block)
                        .await?,
                )
            };
            for i in wrong {
                self.write_block(view, pg, object, members[i], block, data.clone())
                    .await?;
                crate::metrics::recovery_bytes(u64::from(BLOCK));
            }
        }
        Ok((inconsistent, true, primary_won))
    }

    /// Scrubs placement group `pg`, of which this shard must be the primary.
    pub(crate) async fn scrub_pg(
        self: &Rc<Self>,
        view: &Rc<MapView>,
        pg: PgId,
        dry_run: bool,
    ) -> Result<ScrubCounts, i32> {
        let members = view.table.pg(pg).acting.clone();
        if members.first() != Some(&self.osd) {
            return Err(status::ESTALE);
        }
        // Before peering the copies may differ by what the previous primary
        // applied on some and not others; peering (which takes the newest
        // copy) settles that, not a majority vote. And without a lease this
        // shard may not be the primary any more.
        if !self.peered_now(pg) || !self.liveness.lease_valid() {
            return Err(status::EAGAIN);
        }
        let mut objects = BTreeSet::new();
        for &m in &members {
            objects.extend(self.list_objects(view, pg, m).await?);
        }
        let mut counts = ScrubCounts::default();
        let mut volumes: BTreeSet<VolumeId> = BTreeSet::new();
        let mut stopped = false;
        for object in objects {
            // A primary whose lease ran out may have been deposed without
            // learning it (cut from the manager: seed 231501 scrubbed, and
            // repaired, as the primary of a group the map had given another);
            // and a map that changed the group's copies or its primacy (a
            // member whose copy became a stray deletes it: seed 231398
            // compared a copy being deleted) ends the scrub: it compares and
            // repairs nothing more.
            if !self.liveness.lease_valid()
                || !self.peered_now(pg)
                || self.view().table.pg(pg).acting != members
            {
                stopped = true;
                break;
            }
            counts.objects_checked += 1;
            match self.scrub_object(view, pg, object, &members, dry_run).await {
                Ok((inconsistent, repaired, primary_won)) => {
                    counts.inconsistent += u64::from(inconsistent);
                    counts.repaired += u64::from(repaired);
                    counts.primary_won += u64::from(primary_won);
                    if repaired {
                        volumes.insert(object.volume);
                    }
                }
                Err(st) => {
                    tracing::warn!(%object, st, "scrub could not check or repair an object");
                    counts.errors += 1;
                }
            }
        }
        // Repairs are made stable on every copy (also those of a scrub that
        // stopped part-way).
        for volume in volumes {
            if let Err(e) = self.store.flush(Some(volume)).await {
                tracing::error!(%volume, "flush after scrub repair failed: {e}");
            }
            for &m in members.iter().skip(1) {
                let msg = Message::Flush {
                    id: RequestId(0),
                    epoch: view.map.epoch,
                    flags: flags::REPLICA,
                    volume,
                };
                if let Err(st) = self.ask(view, m, pg, msg).await {
                    tracing::warn!(%m, st, "flush after scrub repair failed");
                }
            }
        }
        if stopped {
            return Err(status::EAGAIN);
        }
        if !dry_run {
            crate::metrics::scrub_result(counts.inconsistent, counts.repaired);
            let shared = &self.recovery_shared;
            shared.scrubs.fetch_add(1, Ordering::Relaxed);
            shared
                .scrub_errors
                .fetch_add(counts.inconsistent, Ordering::Relaxed);
            shared
                .scrub_repaired
                .fetch_add(counts.repaired, Ordering::Relaxed);
        }
        self.recovery
            .last_scrub
            .borrow_mut()
            .insert(pg, clock::now());
        let unix = clock::unix_ms() / 1000;
        self.recovery_shared
            .last_scrub_unix
            .store(unix, Ordering::Relaxed);
        tracing::info!(%pg, dry_run, ?counts, "scrubbed");
        Ok(counts)
    }

    /// Scrubs, one at a time, the groups this shard is the primary of whose last
    /// scrub is older than `scrub_interval_s` (none when it is 0).
    pub(crate) async fn background_scrub(self: &Rc<Self>, view: &Rc<MapView>) {
        if self.scrub_interval.is_zero()
            || self
                .recovery_shared
                .scrubs_paused
                .load(std::sync::atomic::Ordering::Relaxed)
        {
            return;
        }
        // The process's clock (virtual in the simulator): a run replays.
        let started = *self.recovery.started.get_or_init(clock::now);
        let due = view
            .table
            .iter()
            .filter(|(_, m)| m.primary() == Some(self.osd) && m.active)
            .map(|(pg, _)| pg)
            .filter(|pg| {
                self.holds(view, *pg) && self.peered_now(*pg) && self.liveness.lease_valid()
            })
            .find(|pg| {
                let last = self.recovery.last_scrub.borrow().get(pg).copied();
                // Groups never scrubbed wait one interval from the start.
                clock::elapsed(last.unwrap_or(started)) >= self.scrub_interval
            });
        if let Some(pg) = due
            && let Err(st) = self.scrub_pg(view, pg, false).await
        {
            tracing::warn!(%pg, st, "background scrub failed");
            self.recovery.last_scrub.borrow_mut().insert(
                pg,
                clock::now() - self.scrub_interval
                    + Duration::from_secs(60).min(self.scrub_interval),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(sum: u32) -> BlockSum {
        BlockSum {
            sum,
            ..BlockSum::default()
        }
    }

    #[test]
    fn the_majority_wins_and_the_minority_is_rewritten() {
        let v = vote(&[b(1), b(2), b(1)]);
        assert_eq!(v.winner, Some(1));
        assert_eq!(v.wrong, vec![1]);
        assert!(!v.primary_won);
        // The primary in the minority loses too.
        let v = vote(&[b(2), b(1), b(1)]);
        assert_eq!((v.winner, v.wrong), (Some(1), vec![0]));
    }

    #[test]
    fn a_bad_block_does_not_vote_and_is_rewritten() {
        let bad = BlockSum {
            sum: 1,
            bad: true,
            ..BlockSum::default()
        };
        let v = vote(&[b(1), bad, b(1)]);
        assert_eq!((v.winner, v.wrong), (Some(1), vec![1]));
        // Two copies, one bad: the good one wins without a "majority" question.
        let v = vote(&[bad, b(1)]);
        assert_eq!((v.winner, v.wrong.clone()), (Some(1), vec![0]));
    }

    #[test]
    fn two_copies_disagreeing_the_primary_wins_and_says_so() {
        let v = vote(&[b(3), b(4)]);
        assert_eq!(v.winner, Some(3));
        assert!(v.primary_won);
        assert_eq!(v.wrong, vec![1]);
        let v = vote(&[b(3), b(3)]);
        assert!(v.wrong.is_empty() && !v.primary_won);
    }

    #[test]
    fn no_copy_verifies_means_no_winner() {
        let bad = BlockSum {
            sum: 1,
            bad: true,
            ..BlockSum::default()
        };
        assert_eq!(vote(&[bad, bad]).winner, None);
    }
}
