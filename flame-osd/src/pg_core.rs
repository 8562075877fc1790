//! The decision core of a placement group on one shard: every decision about a
//! write — may it be applied here, is it a retry, is it superseded, what does the
//! client get back, which members hold it, may a forward from another member be
//! applied — is made by the synchronous methods of [`PgCore`], which do no I/O.
//! The async drivers ([`crate::replication`] for the primary, [`crate::execute`]
//! for a replica, [`crate::recovery`]) only carry its decisions out: they send,
//! write to disk and wait, then hand the results back.
//!
//! Keeping the decisions here lets them be unit-tested branch by branch (the
//! tests below), and their invariants are asserted at every hand-over: sequence
//! numbers are handed out strictly increasing, a write is acknowledged only when
//! every member of its write set applied it, a member is never recorded as
//! holding a write it did not apply, and a copy that failed to apply a write never
//! answers a retry of it as already applied.
//!
//! The log itself (entries, op index, member tracking) is [`crate::pg_log`]; this
//! module owns it per group together with the replica's fence and the primacy
//! generation.

use crate::pg_log::{LogEntry, OpCheck, PgLog, WriteSetRoles};
use flame_common::collections::HashMap;
use flame_common::ids::{Epoch, ObjectId, OsdId, PgId};
use flame_common::protocol::status;

/// Highest placement-group sequence number a forward may carry. A replica that
/// later becomes primary numbers above every seq it has seen, so a forged
/// `u64::MAX` would overflow its numbering; real groups never come near 2^62.
pub const PG_SEQ_MAX: u64 = 1 << 62;

/// The state of one placement group on this shard.
#[derive(Debug)]
pub struct PgCore {
    /// The group's log: sequence numbers, entries, op index, member tracking.
    pub log: PgLog,
    /// Replica side: the highest sender epoch of a forward admitted for this
    /// group. A forward from an older map is refused while this shard's own map
    /// is older than that and the newer map is still to be fetched (it cannot
    /// tell whether the group's roles changed in between, and the older sender
    /// may be a primary that was replaced); see [`PgCore::admit_forward`].
    forward_fence: Epoch,
    /// Changed (to a value unique on this shard) whenever this shard's primacy of
    /// the group may have been interrupted (it became, or stopped being, the
    /// primary, or a map with a new interval arrived after skipped epochs). A recovery job that started
    /// under one generation must not report a member recovered under another:
    /// writes acknowledged by another primary in between are not in this log.
    primacy: u64,
    /// Primary side: whether client I/O may be served yet (see
    /// [`PgCore::await_previous_primary`]).
    activation: Activation,
}

/// Whether a new primary serves client I/O yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Activation {
    /// It does.
    Active,
    /// Not until `previous` (the group's primary in the map this shard had
    /// before, still up) has seen this shard's map, or until `until`, when it can
    /// no longer be serving under the old one.
    Waiting {
        previous: OsdId,
        until: std::time::Instant,
    },
}

/// A client write the primary is about to run, described as the log entry it
/// will become: [`PgCore::complete`] fills in `applied`.
pub type PrimaryWrite = LogEntry;

/// What the primary does with a client write ([`PgCore::decide`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Not seen before: apply it on every member of the write set.
    Apply,
    /// A retry of the write logged as `applied_seq`, which this copy holds: do not
    /// apply it again; copy this copy's bytes of the range to `copy_to` (members
    /// the log does not prove hold it; empty: answer at once).
    Duplicate {
        /// The entry of the first application.
        applied_seq: u64,
        /// Members that get this copy's current bytes of the range.
        copy_to: Vec<OsdId>,
    },
    /// A newer write of the same session to these bytes was applied first: refuse
    /// ([`status::SUPERSEDED`]).
    Superseded,
    /// The write was admitted under roles that no longer hold: this shard's
    /// primacy of the group changed, or the group's interval moved, while it
    /// waited for earlier writes. Refuse it without touching any copy (the
    /// client retries under the new map): applied here, it could overwrite this
    /// copy after a recovery made it current — and this copy may be the primary
    /// again by then (simulator seed 1480).
    Stale,
}

/// What a replica knows when a forward arrives ([`PgCore::admit_forward`]).
#[derive(Clone, Copy, Debug)]
pub struct ForwardFacts {
    /// The epoch of the sender's map.
    pub sender_epoch: Epoch,
    /// The epoch of this shard's map.
    pub my_epoch: Epoch,
    /// The first epoch of the group's current roles in this shard's map.
    pub my_interval: Epoch,
    /// The forward's placement-group sequence number (0: a recovery or repair
    /// copy, not logged).
    pub seq: u64,
    /// Whether this OSD still expects a newer map than its own (a client or peer
    /// showed it one and the control thread has not fetched it yet). Once the
    /// manager has answered that there is nothing newer, a fence raised by a
    /// bogus epoch no longer refuses anything.
    pub newer_map_pending: bool,
}

/// A forward [`PgCore::admit_forward`] let in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ForwardAdmit {
    /// Sent under this shard's own map, or an older one with the same roles.
    Current,
    /// Sent under a newer map than this shard's: fetch it.
    Newer,
}

/// Whether the primary admits a client's write (data, write-zeroes, discard)
/// sent under `sender_epoch` to a group whose current interval began at
/// `interval`: not when it was sent under a map older than the interval
/// (`ESTALE`; the client fetches the current map and sends it again).
///
/// Such a write may be a ghost: sent to this OSD in an earlier interval, held by
/// the network (TCP retransmits what an iptables DROP or a cut cable kept from
/// arriving, also for a socket its client has closed after giving up on it) and
/// arriving after the client wrote the same blocks again through another
/// primary. This copy was then caught up by backfill, which carries no op ids,
/// so the log cannot tell the ghost is older, and applying it would put the
/// blocks back one write (simulator seed 1617). A client still waiting for the
/// write resends it under its new map, and the log deduplicates it as usual.
pub fn admit_client_write(sender_epoch: Epoch, interval: Epoch) -> Result<(), i32> {
    if sender_epoch < interval {
        Err(status::ESTALE)
    } else {
        Ok(())
    }
}

/// Merges the local result and the replicas' results of a replicated write into
/// the client's status: OK only when every copy applied it; else the local
/// failure, or the first replica's (ESTALE becomes EAGAIN: maps disagree, the
/// client refreshes and retries).
pub fn merge_statuses(local: i32, replicas: &[(OsdId, i32)]) -> i32 {
    if local != status::OK {
        return local;
    }
    match replicas.iter().find(|(_, st)| *st != status::OK) {
        None => status::OK,
        Some((_, st)) if *st == status::ESTALE => status::EAGAIN,
        Some((_, st)) => *st,
    }
}

impl PgCore {
    /// A group this shard has not seen before; its log keeps at most `log_max`
    /// entries.
    pub fn new(log_max: usize) -> PgCore {
        PgCore {
            log: PgLog::new(log_max),
            forward_fence: Epoch(0),
            primacy: 0,
            activation: Activation::Active,
        }
    }

    /// The primacy generation (see [`PgCore`]'s field): a recovery job records it
    /// when it starts and is valid only while it is unchanged.
    pub fn primacy(&self) -> u64 {
        self.primacy
    }

    /// This shard's primacy of the group may have been interrupted: the log's
    /// member tracking no longer covers every write acknowledged for the group.
    /// `generation` is the shard's next unique generation ([`PgCores`]).
    fn primacy_changed(&mut self, generation: u64) {
        debug_assert!(generation > self.primacy);
        self.primacy = generation;
        self.log.reset_tracking();
    }

    /// The primary admits a client write: its sequence number, in admission
    /// (arrival) order. Strictly increasing per group.
    pub fn begin_write(&mut self) -> u64 {
        let before = self.log.last_seq();
        let seq = self.log.next_seq();
        assert!(seq > before, "pg seq did not increase: {before} -> {seq}");
        seq
    }

    /// [`Self::decide`] for a write admitted when this shard's primacy generation
    /// was `admitted_primacy` (`w.interval`: the group's interval in the map it
    /// was admitted under), now that the group's interval in this shard's current
    /// map is `interval_now`: [`Decision::Stale`] if either moved, abandoning
    /// `w.seq`.
    pub fn decide_now(
        &mut self,
        w: &PrimaryWrite,
        me: OsdId,
        write_set: &[OsdId],
        admitted_primacy: u64,
        interval_now: Epoch,
    ) -> Decision {
        if admitted_primacy != self.primacy || interval_now != w.interval {
            self.log.abandon(w.seq);
            return Decision::Stale;
        }
        self.decide(w, me, write_set)
    }

    /// What the primary `me` does with `w`, every earlier overlapping write being
    /// complete. `write_set` is the group's write set in the primary's map
    /// (primary first). A duplicate is answered only when this copy holds the
    /// first application; members the log does not prove hold it under the
    /// current interval get this copy's bytes. Anything but [`Decision::Apply`]
    /// abandons `w.seq`.
    pub fn decide(&mut self, w: &PrimaryWrite, me: OsdId, write_set: &[OsdId]) -> Decision {
        debug_assert_eq!(
            write_set.first(),
            Some(&me),
            "the primary leads its write set"
        );
        let check = self.log.check_op(w.op, w.object, w.offset, w.length);
        let decision = match check {
            OpCheck::New => Decision::Apply,
            OpCheck::Superseded => Decision::Superseded,
            OpCheck::Duplicate(applied_seq) => {
                let entry = self.log.entry(applied_seq);
                // An entry recorded by this shard as primary names who applied it;
                // one recorded as a replica (interval 0) says only that this copy
                // did. The proof holds only within the interval it was made in.
                let proven: &[OsdId] = entry
                    .filter(|e| e.interval == w.interval && e.interval.0 > 0)
                    .map_or(&[], |e| &e.applied);
                if entry.is_some_and(|e| e.interval.0 > 0 && !e.applied.contains(&me)) {
                    // The op index says this copy holds it, the entry says this
                    // copy failed it: never answer from a copy that lacks it.
                    debug_assert!(false, "op proven on a copy that did not apply it");
                    Decision::Apply
                } else {
                    Decision::Duplicate {
                        applied_seq,
                        copy_to: write_set
                            .iter()
                            .filter(|m| **m != me && !proven.contains(m))
                            .copied()
                            .collect(),
                    }
                }
            }
        };
        if decision != Decision::Apply {
            self.log.abandon(w.seq);
        }
        decision
    }

    /// Records a write the primary `me` applied (`local`: this copy's status) and
    /// sent to `replicas` (each with its status), under `roles`; returns the
    /// client's status. A copy that failed keeps no proof of the op, so a retry
    /// of it is applied again instead of being answered from this copy.
    ///
    /// `primacy` is the generation [`Self::primacy`] had when the write was
    /// admitted: if it changed while the write ran, the roles it was sent under
    /// say nothing about this primary's tracking any more, so the entry is kept
    /// (for retries and numbering) but tracks no member.
    pub fn complete(
        &mut self,
        w: PrimaryWrite,
        primacy: u64,
        me: OsdId,
        local: i32,
        replicas: &[(OsdId, i32)],
        roles: &WriteSetRoles<'_>,
    ) -> i32 {
        let result = merge_statuses(local, replicas);
        let mut applied = Vec::with_capacity(replicas.len() + 1);
        if local == status::OK {
            applied.push(me);
        }
        applied.extend(
            replicas
                .iter()
                .filter(|(_, st)| *st == status::OK)
                .map(|(id, _)| *id),
        );
        // Nobody outside the write set is recorded as holding it, and an OK means
        // every member of the write set holds it.
        debug_assert!(
            applied
                .iter()
                .all(|id| roles.acting.contains(id) || roles.recovering.contains(id)),
            "applied {applied:?} outside the write set {:?} + {:?}",
            roles.acting,
            roles.recovering
        );
        assert!(
            result != status::OK
                || roles
                    .acting
                    .iter()
                    .chain(roles.recovering)
                    .all(|id| applied.contains(id)),
            "write {} acknowledged without every member of its write set",
            w.seq
        );
        if local != status::OK {
            // This copy failed the write (a full disk, an exhausted pool) while
            // members may have applied it: their bytes of the range now differ
            // from this copy's, which is what reads are served from and what
            // recovery copies. Nobody counts as holding the entry, so every
            // tracked member misses it and is caught up to this copy's bytes (the
            // write was not acknowledged: undoing it where it landed is allowed,
            // and nobody read it, since only this copy serves reads).
            applied.clear();
        }
        let (op, object) = (w.op, w.object);
        let entry = LogEntry { applied, ..w };
        let primacy_changed = primacy != self.primacy;
        if primacy_changed {
            self.log.record_untracked(entry);
        } else {
            self.log.record_primary(entry, roles);
        }
        if local != status::OK || primacy_changed {
            // No proof that this copy holds the op: it failed it, or it applied
            // it under a primacy that ended meanwhile — in between, this copy may
            // have been a recovering member whose bytes of the object were
            // replaced by another primary's (backfill, log catch-up) that lack
            // the write. A retry is applied again instead of answered (and
            // copied to the others) from this copy.
            self.log.unprove_op(object, op);
        }
        result
    }

    /// The replicas of `replicas` (in their order) whose bytes of
    /// `[offset, offset+length)` of `object` may replace this primary's copy of
    /// them when its own cannot be read (a disk read error, a checksum
    /// mismatch). Not a member the log shows missing a write over those bytes
    /// (or missing one the log no longer holds): its bytes are older there, and
    /// written over this copy they would undo the write here while the members
    /// that applied it keep it — and log catch-up, which then copies this
    /// copy's bytes to the member that missed it, leaves those members alone,
    /// so the copies would differ for good (simulator seed 501399: a write
    /// refused by one replica's full disk, then the primary's read error
    /// repaired from that replica). Such a member gets the bytes from this copy
    /// once its catch-up runs.
    pub fn repair_sources(
        &self,
        replicas: &[OsdId],
        object: ObjectId,
        offset: u32,
        length: u32,
    ) -> Vec<OsdId> {
        replicas
            .iter()
            .filter(|m| !self.log.may_lack(**m, object, offset, length))
            .copied()
            .collect()
    }

    /// Every member of `write_set` now holds entry `applied_seq` (the primary
    /// copied its bytes to those that might not) under `interval`.
    pub fn retry_copied(&mut self, applied_seq: u64, interval: Epoch, write_set: &[OsdId]) {
        self.log
            .now_held_by(applied_seq, interval, write_set.iter().copied());
    }

    /// Replica side: may a forward (a write, zeroing, discard or object removal
    /// sent by a primary) be applied? Refused with ESTALE when
    /// * it was sent under an older map and this shard's map shows the group's
    ///   roles changed since (the sender may no longer be the primary), or
    /// * it was sent under an older map than a forward already admitted for this
    ///   group while this shard's own map is older than that forward's and the
    ///   newer map is still to be fetched: a primary with a newer map has written
    ///   here, and this shard cannot tell whether the older sender is still the
    ///   primary (it retries once this shard fetched the newer map);
    ///
    /// and with EINVAL when its sequence number is beyond [`PG_SEQ_MAX`].
    /// Admitting raises the fence to the sender's epoch.
    pub fn admit_forward(&mut self, f: ForwardFacts) -> Result<ForwardAdmit, i32> {
        if f.seq > PG_SEQ_MAX {
            return Err(status::EINVAL);
        }
        if !f.newer_map_pending {
            // The manager has nothing newer than this shard's map: a fence above
            // it came from an epoch that was never published.
            self.forward_fence = self.forward_fence.min(f.my_epoch);
        }
        if f.sender_epoch < f.my_epoch && f.sender_epoch < f.my_interval {
            return Err(status::ESTALE);
        }
        if f.sender_epoch < self.forward_fence
            && f.my_epoch < self.forward_fence
            && f.newer_map_pending
        {
            return Err(status::ESTALE);
        }
        self.forward_fence = self.forward_fence.max(f.sender_epoch);
        Ok(if f.sender_epoch > f.my_epoch {
            ForwardAdmit::Newer
        } else {
            ForwardAdmit::Current
        })
    }

    /// This shard just became the group's primary while `previous`, the primary
    /// of the map it had before, is still up: that OSD may still be serving reads
    /// to clients with the old map, and this one would acknowledge writes they
    /// do not see (a stale read, with no failure anywhere). So this shard serves
    /// no client I/O of the group until `previous` has seen the new map
    /// ([`Self::previous_primary_saw_map`]: it then serves nothing under the old
    /// one) or until `until` — now plus the lease, after which `previous`, if it
    /// reaches the manager, has learnt the new map from a heartbeat answer, and
    /// if it does not, its lease ran out (Ceph's read lease, in short).
    pub fn await_previous_primary(&mut self, previous: OsdId, until: std::time::Instant) {
        self.activation = Activation::Waiting { previous, until };
    }

    /// `previous` answered a request carrying this shard's map (any answer: it
    /// either has that map or has seen that it exists, and serves no client I/O
    /// until it has fetched it).
    pub fn previous_primary_saw_map(&mut self, previous: OsdId) {
        if matches!(self.activation, Activation::Waiting { previous: p, .. } if p == previous) {
            self.activation = Activation::Active;
        }
    }

    /// The previous primary this shard waits for, if any.
    pub fn waiting_for(&self) -> Option<OsdId> {
        match self.activation {
            Activation::Active => None,
            Activation::Waiting { previous, .. } => Some(previous),
        }
    }

    /// Whether this shard may serve client I/O of the group as its primary
    /// (`now` is asked only while it waits).
    pub fn may_serve_clients(&self, now: impl FnOnce() -> std::time::Instant) -> bool {
        match self.activation {
            Activation::Active => true,
            Activation::Waiting { until, .. } => now() >= until,
        }
    }

    /// The highest sender epoch of a forward admitted for this group.
    pub fn forward_fence(&self) -> Epoch {
        self.forward_fence
    }
}

/// How a group's roles look to a shard in the map it had and the map it now
/// sees ([`PrimacyChange::interrupts_primacy`]).
#[derive(Clone, Copy, Debug)]
pub struct PrimacyChange {
    /// The epoch of the map the shard had.
    pub prev_epoch: Epoch,
    /// Whether this OSD was the group's primary in it.
    pub was_primary: bool,
    /// The epoch of the map it now sees.
    pub epoch: Epoch,
    /// Whether this OSD is the group's primary in it.
    pub now_primary: bool,
    /// The first epoch of the group's current roles in the new map.
    pub interval: Epoch,
}

impl PrimacyChange {
    /// Whether this shard's primacy of the group may have been interrupted: it
    /// became or stopped being the primary, or it is the primary after epochs it
    /// never saw in which the group's roles changed (another OSD may have been
    /// the primary then, P→Q→P, and acknowledged writes this log never saw).
    pub fn interrupts_primacy(&self) -> bool {
        let skipped = self.epoch.0 > self.prev_epoch.0.saturating_add(1);
        let roles_moved_since = self.interval > self.prev_epoch;
        self.now_primary != self.was_primary || (self.now_primary && skipped && roles_moved_since)
    }
}

/// The cores of every placement group a shard has seen writes for.
pub struct PgCores {
    groups: HashMap<PgId, PgCore>,
    log_max: usize,
    /// The last primacy generation handed out on this shard: every core gets a
    /// new one when created and when its primacy changes, so a generation is
    /// never reused, also across a group's removal and return.
    generation: u64,
}

impl PgCores {
    /// No groups yet; each log keeps at most `log_max` entries.
    pub fn new(log_max: usize) -> PgCores {
        PgCores {
            groups: HashMap::default(),
            log_max,
            generation: 0,
        }
    }

    /// The core of `pg`, created empty.
    pub fn get_mut(&mut self, pg: PgId) -> &mut PgCore {
        let max = self.log_max;
        let generation = &mut self.generation;
        self.groups.entry(pg).or_insert_with(|| {
            *generation += 1;
            PgCore {
                primacy: *generation,
                ..PgCore::new(max)
            }
        })
    }

    /// This shard's primacy of `pg` may have been interrupted
    /// ([`crate::pg_core::PrimacyChange`]): its tracking is reset and it gets a
    /// new primacy generation.
    pub fn primacy_changed(&mut self, pg: PgId) {
        self.get_mut(pg);
        self.generation += 1;
        let generation = self.generation;
        if let Some(core) = self.groups.get_mut(&pg) {
            core.primacy_changed(generation);
        }
    }

    /// The core of `pg`, if any, to change it.
    pub fn existing_mut(&mut self, pg: PgId) -> Option<&mut PgCore> {
        self.groups.get_mut(&pg)
    }

    /// The core of `pg`, if any.
    pub fn get(&self, pg: PgId) -> Option<&PgCore> {
        self.groups.get(&pg)
    }

    /// The log of `pg`, if any.
    pub fn log(&self, pg: PgId) -> Option<&PgLog> {
        self.groups.get(&pg).map(|c| &c.log)
    }

    /// The log of `pg`, if any, to change it.
    pub fn log_mut(&mut self, pg: PgId) -> Option<&mut PgLog> {
        self.groups.get_mut(&pg).map(|c| &mut c.log)
    }

    /// The primacy generation of `pg` (0 for a group never seen).
    pub fn primacy(&self, pg: PgId) -> u64 {
        self.groups.get(&pg).map_or(0, |c| c.primacy)
    }

    /// Drops the state of a group this shard no longer holds.
    pub fn remove(&mut self, pg: PgId) {
        self.groups.remove(&pg);
    }

    /// Every group.
    pub fn iter(&self) -> impl Iterator<Item = (&PgId, &PgCore)> {
        self.groups.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pg_log::EntryKind;
    use flame_common::ids::{ObjectId, OpId, VolumeId};

    const P: OsdId = OsdId(1);
    const R1: OsdId = OsdId(2);
    const R2: OsdId = OsdId(3);
    const SET: [OsdId; 3] = [P, R1, R2];

    fn roles() -> WriteSetRoles<'static> {
        WriteSetRoles {
            acting: &SET,
            recovering: &[],
        }
    }

    fn write(core: &mut PgCore, op: u64, offset: u32, interval: u64) -> PrimaryWrite {
        PrimaryWrite {
            seq: core.begin_write(),
            op: OpId {
                session: 7,
                seq: op,
            },
            interval: Epoch(interval),
            object: ObjectId {
                volume: VolumeId(1),
                index: 0,
            },
            offset,
            length: 4096,
            kind: EntryKind::Write,
            applied: Vec::new(),
        }
    }

    fn all_ok() -> Vec<(OsdId, i32)> {
        vec![(R1, status::OK), (R2, status::OK)]
    }

    /// Simulator seed 1480: a deposed primary's old client write waited in its
    /// gate through a partition; meanwhile the OSD was marked down, came back,
    /// was caught up and became primary again. Applied then, under the view it
    /// was admitted with, it overwrote the caught-up copy with bytes two writes
    /// old — the copy that now served reads and that recovery copied from.
    #[test]
    fn a_write_admitted_under_roles_that_changed_meanwhile_is_stale() {
        let mut cores = PgCores::new(16);
        let pg = PgId(3);
        let admitted = cores.get_mut(pg).primacy();
        let w = write(cores.get_mut(pg), 1, 0, 5);
        // The roles changed twice while it waited (deposed, primary again).
        cores.primacy_changed(pg);
        cores.primacy_changed(pg);
        let c = cores.get_mut(pg);
        assert_eq!(
            c.decide_now(&w, P, &SET, admitted, Epoch(5)),
            Decision::Stale
        );
        assert!(!c.log.inflight_through(w.seq), "a stale write is abandoned");
        // The same primacy, but the group's interval moved on (roles changed and
        // changed back between two maps this shard installed).
        let now = c.primacy();
        let w = write(c, 2, 0, 5);
        assert_eq!(c.decide_now(&w, P, &SET, now, Epoch(9)), Decision::Stale);
        // Neither moved: decided as usual.
        let w = write(c, 3, 0, 9);
        assert_eq!(c.decide_now(&w, P, &SET, now, Epoch(9)), Decision::Apply);
    }

    #[test]
    fn sequence_numbers_strictly_increase() {
        let mut c = PgCore::new(16);
        let a = c.begin_write();
        let b = c.begin_write();
        assert!(b > a);
        c.log.record_replica(LogEntry {
            seq: 40,
            ..c.log_entry_for_test()
        });
        assert_eq!(
            c.begin_write(),
            41,
            "numbering continues above a replica's seq"
        );
    }

    #[test]
    fn a_new_write_is_applied_and_acknowledged_when_every_copy_applied_it() {
        let mut c = PgCore::new(16);
        let w = write(&mut c, 1, 0, 5);
        assert_eq!(c.decide(&w, P, &SET), Decision::Apply);
        assert_eq!(
            c.complete(w, c.primacy(), P, status::OK, &all_ok(), &roles()),
            status::OK
        );
        assert_eq!(c.log.missed_by(R2, 0), Some(vec![]));
    }

    #[test]
    fn a_replica_failure_fails_the_write_and_is_tracked_as_a_miss() {
        let mut c = PgCore::new(16);
        let w = write(&mut c, 1, 0, 5);
        assert_eq!(c.decide(&w, P, &SET), Decision::Apply);
        let replicas = [(R1, status::OK), (R2, status::EIO)];
        assert_eq!(
            c.complete(w, c.primacy(), P, status::OK, &replicas, &roles()),
            status::EIO
        );
        assert_eq!(c.log.missed_by(R2, 0).map(|m| m.len()), Some(1));
        // Its retry is a duplicate that copies to the member that failed only.
        let r = write(&mut c, 1, 0, 5);
        assert_eq!(
            c.decide(&r, P, &SET),
            Decision::Duplicate {
                applied_seq: 1,
                copy_to: vec![R2]
            }
        );
    }

    #[test]
    fn a_replica_estale_becomes_eagain_for_the_client() {
        assert_eq!(
            merge_statuses(status::OK, &[(R1, status::ESTALE), (R2, status::EIO)]),
            status::EAGAIN
        );
        assert_eq!(
            merge_statuses(status::ENOSPC, &[(R1, status::ESTALE)]),
            status::ENOSPC
        );
        assert_eq!(merge_statuses(status::OK, &[]), status::OK);
    }

    /// Suspect 2 of issue 13, reproduced by hand on a dev cluster: the primary's
    /// own apply failed (a transient EAGAIN) while both replicas applied; the
    /// client's retry must be applied again, not answered from the log — the copy
    /// that serves reads lacks the write.
    #[test]
    fn a_retry_of_a_write_the_primary_failed_itself_is_applied_again() {
        let mut c = PgCore::new(16);
        let w = write(&mut c, 1, 0, 5);
        assert_eq!(c.decide(&w, P, &SET), Decision::Apply);
        assert_eq!(
            c.complete(w, c.primacy(), P, status::EAGAIN, &all_ok(), &roles()),
            status::EAGAIN
        );
        let retry = write(&mut c, 1, 0, 5);
        assert_eq!(c.decide(&retry, P, &SET), Decision::Apply);
        assert_eq!(
            c.complete(retry, c.primacy(), P, status::OK, &all_ok(), &roles()),
            status::OK
        );
        // Now it is held everywhere: a further retry is answered at once.
        let again = write(&mut c, 1, 0, 5);
        assert_eq!(
            c.decide(&again, P, &SET),
            Decision::Duplicate {
                applied_seq: 2,
                copy_to: vec![]
            }
        );
    }

    /// Found by the simulator once disks could fill up (seed 105): the primary's
    /// own apply failed with ENOSPC while both replicas applied the write. The
    /// client was told ENOSPC and gives up, so nothing retries it; the replicas
    /// must still be brought back to the primary's bytes, or the copies differ
    /// for good (and a failover would serve the refused write after reads
    /// returned the older bytes).
    #[test]
    fn members_that_applied_a_write_the_primary_failed_are_caught_up_to_its_bytes() {
        let mut c = PgCore::new(16);
        let w = write(&mut c, 1, 0, 5);
        assert_eq!(c.decide(&w, P, &SET), Decision::Apply);
        assert_eq!(
            c.complete(w, c.primacy(), P, status::ENOSPC, &all_ok(), &roles()),
            status::ENOSPC
        );
        for member in [R1, R2] {
            assert_eq!(
                c.log.missed_by(member, 0).map(|m| m.len()),
                Some(1),
                "{member} holds bytes the primary does not"
            );
        }
    }

    /// Found by the simulator (seed 501399): a write refused by one replica's
    /// full disk (ENOSPC) was applied by the primary and the other replica; then
    /// the primary's disk failed a read of those blocks and it rewrote them from
    /// the first replica — the one without the write. The primary's copy went
    /// back one write, the other replica kept it, and log catch-up of the
    /// replica that missed it copied the primary's (older) bytes to it alone:
    /// the copies differed for good. A member that missed a write over the bytes
    /// is no source for them until it is caught up.
    #[test]
    fn a_member_that_missed_a_write_is_no_source_for_its_bytes_until_caught_up() {
        let mut c = PgCore::new(16);
        let w = write(&mut c, 1, 8192, 5);
        assert_eq!(c.decide(&w, P, &SET), Decision::Apply);
        let replicas = [(R1, status::ENOSPC), (R2, status::OK)];
        assert_eq!(
            c.complete(w, c.primacy(), P, status::OK, &replicas, &roles()),
            status::ENOSPC
        );
        let object = ObjectId {
            volume: VolumeId(1),
            index: 0,
        };
        let replicas = [R1, R2];
        assert_eq!(c.repair_sources(&replicas, object, 8192, 4096), vec![R2]);
        assert_eq!(
            c.repair_sources(&replicas, object, 4096, 8192),
            vec![R2],
            "a range overlapping the missed write"
        );
        // Bytes it missed nothing of, and another object: any member.
        assert_eq!(c.repair_sources(&replicas, object, 0, 8192), vec![R1, R2]);
        let other = ObjectId { index: 1, ..object };
        assert_eq!(c.repair_sources(&replicas, other, 8192, 4096), vec![R1, R2]);
        // Caught up: a source again.
        c.log.recovered(R1, c.log.last_seq());
        assert_eq!(
            c.repair_sources(&replicas, object, 8192, 4096),
            vec![R1, R2]
        );
    }

    /// A member whose miss the log trimmed is no source for the bytes of the
    /// missed write (the log remembers its range), nor for any byte once the
    /// log cannot tell what it missed.
    #[test]
    fn a_member_whose_miss_was_trimmed_is_no_source_for_its_bytes() {
        let mut c = PgCore::new(2);
        let w = write(&mut c, 1, 0, 5);
        c.decide(&w, P, &SET);
        c.complete(
            w,
            c.primacy(),
            P,
            status::OK,
            &[(R1, status::OK), (R2, status::EIO)],
            &roles(),
        );
        for op in 2..=3 {
            let w = write(&mut c, op, 65536, 5);
            c.decide(&w, P, &SET);
            c.complete(w, c.primacy(), P, status::OK, &all_ok(), &roles());
        }
        let object = ObjectId {
            volume: VolumeId(1),
            index: 0,
        };
        assert_eq!(c.repair_sources(&[R1, R2], object, 0, 4096), vec![R1]);
        let other = ObjectId { index: 7, ..object };
        assert_eq!(c.repair_sources(&[R1, R2], other, 0, 4096), vec![R1, R2]);
        assert_eq!(
            c.repair_sources(&[R1, R2], object, 32768, 4096),
            vec![R1, R2]
        );
        // A catch-up overtaken by trimming: what R2 missed since is unknown.
        c.log.recovered(R2, 0);
        assert_eq!(c.repair_sources(&[R1, R2], other, 0, 4096), vec![R1]);
    }

    /// Found by the simulator (seed 396): a write to block 27 of an object
    /// failed on both replicas (EAGAIN) and stayed on the primary only; the
    /// log trimmed it before recovery backfilled them. Then bit rot struck
    /// block 23 of the primary's copy. A member whose first miss was trimmed
    /// counted as lacking every byte, so neither replica was a source for
    /// block 23: a client read of it got EAGAIN for good, and so did the
    /// backfill of each replica, which repairs the source's bad blocks first
    /// from the other one — the group never healed. The log remembers the
    /// ranges of trimmed misses: both replicas hold block 23.
    #[test]
    fn replicas_whose_trimmed_miss_is_elsewhere_repair_a_rotten_block() {
        let mut c = PgCore::new(4);
        let object = ObjectId {
            volume: VolumeId(1),
            index: 0,
        };
        let w = write(&mut c, 1, 23 * 4096, 5);
        c.decide(&w, P, &SET);
        c.complete(w, c.primacy(), P, status::OK, &all_ok(), &roles());
        let w = write(&mut c, 2, 27 * 4096, 5);
        c.decide(&w, P, &SET);
        let failed = [(R1, status::EAGAIN), (R2, status::EAGAIN)];
        c.complete(w, c.primacy(), P, status::OK, &failed, &roles());
        // More writes elsewhere trim both.
        for op in 3..=8 {
            let w = write(&mut c, op, 0, 5);
            c.decide(&w, P, &SET);
            c.complete(w, c.primacy(), P, status::OK, &all_ok(), &roles());
        }
        assert!(c.log.first_seq() > 2, "the missed write was trimmed");
        assert!(c.log.lags(R1) && c.log.lags(R2), "both still to backfill");
        assert_eq!(
            c.repair_sources(&[R1, R2], object, 23 * 4096, 4096),
            vec![R1, R2]
        );
        assert_eq!(
            c.repair_sources(&[R1, R2], object, 27 * 4096, 4096),
            Vec::<OsdId>::new()
        );
    }

    #[test]
    fn an_older_write_of_the_same_session_is_superseded() {
        let mut c = PgCore::new(16);
        let newer = write(&mut c, 9, 0, 5);
        assert_eq!(c.decide(&newer, P, &SET), Decision::Apply);
        c.complete(newer, c.primacy(), P, status::OK, &all_ok(), &roles());
        let older = write(&mut c, 8, 0, 5);
        let seq = older.seq;
        assert_eq!(c.decide(&older, P, &SET), Decision::Superseded);
        assert!(
            !c.log.inflight_through(seq),
            "a refused write is not in flight"
        );
        // Not overlapping: new.
        let elsewhere = write(&mut c, 8, 8192, 5);
        assert_eq!(c.decide(&elsewhere, P, &SET), Decision::Apply);
    }

    #[test]
    fn a_retry_under_another_interval_copies_to_every_other_member() {
        let mut c = PgCore::new(16);
        let w = write(&mut c, 1, 0, 5);
        c.decide(&w, P, &SET);
        c.complete(w, c.primacy(), P, status::OK, &all_ok(), &roles());
        // The roles changed since (interval 6): the log proves nothing about them.
        let retry = write(&mut c, 1, 0, 6);
        assert_eq!(
            c.decide(&retry, P, &SET),
            Decision::Duplicate {
                applied_seq: 1,
                copy_to: vec![R1, R2]
            }
        );
        c.retry_copied(1, Epoch(6), &SET);
        let again = write(&mut c, 1, 0, 6);
        assert_eq!(
            c.decide(&again, P, &SET),
            Decision::Duplicate {
                applied_seq: 1,
                copy_to: vec![]
            }
        );
    }

    #[test]
    fn a_retry_of_an_op_logged_as_a_replica_copies_to_every_other_member() {
        // This shard applied the op as a replica, then became primary.
        let mut c = PgCore::new(16);
        c.log.record_replica(LogEntry {
            seq: 3,
            op: OpId { session: 7, seq: 1 },
            ..c.log_entry_for_test()
        });
        let retry = write(&mut c, 1, 0, 9);
        assert_eq!(
            c.decide(&retry, P, &SET),
            Decision::Duplicate {
                applied_seq: 3,
                copy_to: vec![R1, R2]
            }
        );
    }

    /// Simulator seed 500164. A write (op 1) reached the primary then and the
    /// member now primary, not R2 (dead, not yet marked down): not acknowledged.
    /// This shard became primary, so op 1 is a replica entry here; its next
    /// write started tracking R2 as complete — holding every earlier entry —
    /// and R2 failed it. Then R2 was marked down and the client's retry of op 1
    /// was answered from the log, copying to R1 only: acknowledged now, while R2
    /// lacks it. Log catch-up of R2 must copy it.
    #[test]
    fn a_retry_acknowledged_while_a_tracked_member_is_away_is_its_miss() {
        let mut c = PgCore::new(16);
        c.log.record_replica(LogEntry {
            seq: 4,
            op: OpId { session: 7, seq: 1 },
            ..c.log_entry_for_test()
        });
        // A new write under the new primary: R2 fails it.
        let w = write(&mut c, 2, 8192, 8);
        assert_eq!(c.decide(&w, P, &SET), Decision::Apply);
        let replicas = [(R1, status::OK), (R2, status::EAGAIN)];
        c.complete(w, c.primacy(), P, status::OK, &replicas, &roles());
        // Peering equalised R1; R2, dead, was never peered.
        c.log.peered(R1);
        // R2 is down: the write set is P and R1, and the retry copies to R1.
        let two = [P, R1];
        let retry = write(&mut c, 1, 0, 10);
        assert_eq!(
            c.decide(&retry, P, &two),
            Decision::Duplicate {
                applied_seq: 4,
                copy_to: vec![R1]
            }
        );
        c.retry_copied(4, Epoch(10), &two);
        let missed: Vec<u64> = c
            .log
            .missed_by(R2, 0)
            .unwrap()
            .iter()
            .map(|(seq, ..)| *seq)
            .collect();
        assert!(
            missed.contains(&4),
            "the acknowledged retry is R2's miss: {missed:?}"
        );
        // And R2, never peered under this primacy, is backfilled anyway.
        assert_eq!(c.log.catch_up(R2), None);
        assert_eq!(c.log.catch_up(R1), Some(vec![]));
    }

    #[test]
    #[should_panic(expected = "acknowledged without every member")]
    fn acknowledging_without_a_recovering_member_is_caught() {
        let mut c = PgCore::new(16);
        let w = write(&mut c, 1, 0, 5);
        c.decide(&w, P, &SET);
        // R2 is in the write set (recovering) but was not sent the write.
        let roles = WriteSetRoles {
            acting: &SET[..2],
            recovering: &SET[2..],
        };
        c.complete(w, c.primacy(), P, status::OK, &[(R1, status::OK)], &roles);
    }

    fn facts(sender: u64, mine: u64, interval: u64) -> ForwardFacts {
        ForwardFacts {
            sender_epoch: Epoch(sender),
            my_epoch: Epoch(mine),
            my_interval: Epoch(interval),
            seq: 1,
            newer_map_pending: sender > mine,
        }
    }

    /// Seed 1617: a client write held by the network since an earlier interval
    /// (sent under e10) reached the primary after the client had written the
    /// block again elsewhere, and put it back one write.
    #[test]
    fn a_client_write_sent_before_the_groups_interval_began_is_refused() {
        assert_eq!(
            admit_client_write(Epoch(10), Epoch(12)),
            Err(status::ESTALE)
        );
        assert_eq!(
            admit_client_write(Epoch(11), Epoch(12)),
            Err(status::ESTALE)
        );
    }

    #[test]
    fn a_client_write_sent_in_the_groups_interval_is_admitted() {
        // Under the map that began the interval, a later one, or one newer than
        // the primary's (that case never gets here: the primary fetches it).
        assert_eq!(admit_client_write(Epoch(12), Epoch(12)), Ok(()));
        assert_eq!(admit_client_write(Epoch(15), Epoch(12)), Ok(()));
    }

    #[test]
    fn a_forward_under_the_current_roles_is_admitted() {
        let mut c = PgCore::new(16);
        assert_eq!(c.admit_forward(facts(10, 10, 4)), Ok(ForwardAdmit::Current));
        // Older map, same roles (interval 4 ≤ 8).
        assert_eq!(c.admit_forward(facts(8, 10, 4)), Ok(ForwardAdmit::Current));
        // Newer map: admitted, fetch it.
        assert_eq!(c.admit_forward(facts(12, 10, 4)), Ok(ForwardAdmit::Newer));
    }

    #[test]
    fn a_forward_from_before_the_groups_roles_changed_is_refused() {
        let mut c = PgCore::new(16);
        assert_eq!(c.admit_forward(facts(8, 10, 9)), Err(status::ESTALE));
    }

    /// Suspect 1 of issue 13: a replica whose map lags applied a forward of the
    /// new primary (newer map); the old primary, which has not seen the new map
    /// either, forwards under the old one — same epoch as the replica's own map,
    /// so the interval check alone lets it in, over the newer write.
    #[test]
    fn an_old_primarys_forward_after_a_newer_primarys_is_refused_while_the_map_lags() {
        let mut c = PgCore::new(16);
        assert_eq!(c.admit_forward(facts(11, 10, 4)), Ok(ForwardAdmit::Newer));
        let pending = ForwardFacts {
            newer_map_pending: true,
            ..facts(10, 10, 4)
        };
        assert_eq!(c.admit_forward(pending), Err(status::ESTALE));
        assert_eq!(c.forward_fence(), Epoch(11));
        // Once this shard has the newer map, its interval decides.
        assert_eq!(c.admit_forward(facts(10, 11, 4)), Ok(ForwardAdmit::Current));
        assert_eq!(c.admit_forward(facts(10, 11, 11)), Err(status::ESTALE));
    }

    #[test]
    fn a_fence_raised_by_an_epoch_the_manager_does_not_have_expires() {
        // A peer claimed epoch 1000; the manager answered that 10 is the newest,
        // so nothing is pending any more: forwards of epoch 10 are admitted.
        let mut c = PgCore::new(16);
        assert_eq!(c.admit_forward(facts(1000, 10, 4)), Ok(ForwardAdmit::Newer));
        assert_eq!(c.admit_forward(facts(10, 10, 4)), Ok(ForwardAdmit::Current));
        assert_eq!(c.forward_fence(), Epoch(10), "the bogus fence fell back");
        // Later, while a real newer map is pending, the old bogus value does not
        // refuse a sender at this shard's epoch.
        let pending = ForwardFacts {
            newer_map_pending: true,
            ..facts(10, 10, 4)
        };
        assert_eq!(c.admit_forward(pending), Ok(ForwardAdmit::Current));
    }

    #[test]
    fn a_write_whose_primacy_changed_while_it_ran_tracks_no_member() {
        let mut cores = PgCores::new(16);
        let pg = PgId(3);
        let c = cores.get_mut(pg);
        let w = write(c, 1, 0, 5);
        let admitted_under = c.primacy();
        assert_eq!(c.decide(&w, P, &SET), Decision::Apply);
        // The shard saw a map in which it stopped (or may have stopped) being the
        // primary while the write was in flight.
        cores.primacy_changed(pg);
        let c = cores.get_mut(pg);
        assert_ne!(c.primacy(), admitted_under);
        assert_eq!(
            c.complete(w, admitted_under, P, status::OK, &all_ok(), &roles()),
            status::OK
        );
        assert!(!c.log.tracks(R2), "tracking must restart from backfill");
        assert_eq!(c.log.missed_by(R2, 0), None);
        // The entry itself is kept (numbering, older ops superseded), but it
        // proves nothing about this copy's bytes: see the next test.
        let retry = write(c, 1, 0, 5);
        assert_eq!(c.decide(&retry, P, &SET), Decision::Apply);
    }

    /// Seed 201884: a write applied by the primary whose forwards were held
    /// past its primacy; meanwhile the OSD was marked down, backfilled from the
    /// new primary (without the write), and made primary again. The old
    /// write's completion must not prove the op on this copy: a retry answered
    /// from it would acknowledge bytes that no copy holds.
    #[test]
    fn a_write_completed_after_its_primacy_ended_proves_nothing_to_a_retry() {
        let mut cores = PgCores::new(16);
        let pg = PgId(5);
        let c = cores.get_mut(pg);
        let w = write(c, 7, 4096, 4);
        let admitted_under = c.primacy();
        assert_eq!(c.decide(&w, P, &SET), Decision::Apply);
        // Marked down (primacy interrupted), backfilled, primary again.
        cores.primacy_changed(pg);
        cores.primacy_changed(pg);
        let c = cores.get_mut(pg);
        // The replicas refused the held forwards; this copy had applied it.
        let refused: Vec<(OsdId, i32)> = SET[1..].iter().map(|&m| (m, status::EAGAIN)).collect();
        assert_eq!(
            c.complete(w, admitted_under, P, status::OK, &refused, &roles()),
            status::EAGAIN
        );
        // The client's retry, under the new interval: applied again on every
        // copy, not answered from this one.
        let retry = write(c, 7, 4096, 12);
        assert_eq!(c.decide(&retry, P, &SET), Decision::Apply);
    }

    #[test]
    fn a_new_primary_serves_clients_once_the_previous_one_saw_its_map_or_the_lease_ran_out() {
        use std::time::{Duration, Instant};
        let mut c = PgCore::new(16);
        let t0 = Instant::now();
        assert!(c.may_serve_clients(|| t0), "a group starts active");
        c.await_previous_primary(R1, t0 + Duration::from_secs(4));
        assert_eq!(c.waiting_for(), Some(R1));
        assert!(!c.may_serve_clients(|| t0));
        assert!(!c.may_serve_clients(|| t0 + Duration::from_secs(3)));
        assert!(
            c.may_serve_clients(|| t0 + Duration::from_secs(4)),
            "its lease ran out"
        );
        // Another OSD's answer does not count; the previous primary's does.
        c.previous_primary_saw_map(R2);
        assert!(!c.may_serve_clients(|| t0));
        c.previous_primary_saw_map(R1);
        assert!(c.may_serve_clients(|| t0));
        assert_eq!(c.waiting_for(), None);
    }

    #[test]
    fn primacy_generations_are_never_reused_across_a_groups_removal() {
        let mut cores = PgCores::new(16);
        let pg = PgId(1);
        let first = cores.get_mut(pg).primacy();
        cores.remove(pg);
        let again = cores.get_mut(pg).primacy();
        assert_ne!(first, again);
        cores.primacy_changed(pg);
        assert!(cores.primacy(pg) > again);
    }

    #[test]
    fn a_forward_with_a_seq_beyond_the_bound_is_refused() {
        let mut c = PgCore::new(16);
        let f = ForwardFacts {
            seq: u64::MAX,
            ..facts(10, 10, 4)
        };
        assert_eq!(c.admit_forward(f), Err(status::EINVAL));
        assert_eq!(
            c.forward_fence(),
            Epoch(0),
            "a refused forward raises nothing"
        );
    }

    #[test]
    fn a_primacy_change_resets_tracking_and_bumps_the_generation() {
        let mut c = PgCore::new(16);
        let w = write(&mut c, 1, 0, 5);
        c.decide(&w, P, &SET);
        c.complete(w, c.primacy(), P, status::OK, &all_ok(), &roles());
        assert!(c.log.tracks(R2));
        let g = c.primacy();
        c.primacy_changed(g + 1);
        assert!(c.primacy() > g);
        assert!(!c.log.tracks(R2));
        assert_eq!(
            c.log.missed_by(R2, 0),
            None,
            "backfill after a primacy change"
        );
    }

    fn change(prev: u64, was: bool, now_epoch: u64, now: bool, interval: u64) -> PrimacyChange {
        PrimacyChange {
            prev_epoch: Epoch(prev),
            was_primary: was,
            epoch: Epoch(now_epoch),
            now_primary: now,
            interval: Epoch(interval),
        }
    }

    #[test]
    fn primacy_is_interrupted_when_it_changes_or_may_have_changed_unseen() {
        // Became or stopped being the primary.
        assert!(change(5, false, 6, true, 6).interrupts_primacy());
        assert!(change(5, true, 6, false, 6).interrupts_primacy());
        // Primary in both, consecutive epochs: uninterrupted, whatever the roles
        // of the others did (a replica going down is a new interval).
        assert!(!change(5, true, 6, true, 6).interrupts_primacy());
        // Primary in both, epochs skipped, roles changed since: P→Q→P may have
        // happened unseen.
        assert!(change(5, true, 8, true, 7).interrupts_primacy());
        // Epochs skipped but the roles are older than the map it had.
        assert!(!change(5, true, 8, true, 4).interrupts_primacy());
        // Never primary: nothing to interrupt.
        assert!(!change(5, false, 8, false, 7).interrupts_primacy());
    }

    impl PgCore {
        fn log_entry_for_test(&self) -> LogEntry {
            LogEntry {
                seq: 1,
                op: OpId::NONE,
                interval: Epoch(0),
                object: ObjectId {
                    volume: VolumeId(1),
                    index: 0,
                },
                offset: 0,
                length: 4096,
                kind: EntryKind::Write,
                applied: Vec::new(),
            }
        }
    }
}
