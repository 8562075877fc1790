//! The per-placement-group log: the recent writes of each group in the order of
//! their placement-group sequence number ([`PgSeq`]).
//!
//! The primary gives every write, zeroing and discard the next sequence number of
//! its group when it admits it (in arrival order, before its first await, like the
//! write gate) and records, when it completes, which members of the write set
//! applied it. Replicas record the entries they apply (seq > 0), so a replica that
//! becomes primary numbers above every seq it has seen.
//!
//! What the log is for: a member that was complete, went away (down, or failed a
//! write) and came back can be caught up with only what it missed — the objects and
//! byte ranges of the entries it did not apply — instead of comparing every object
//! of the group (backfill). That is only sound when this primary saw every write
//! since the member's first miss: the primary tracks a member from an entry it
//! recorded while the member was acting (complete), and the log must still hold
//! every entry from the member's first miss on. The tracking is reset
//! ([`crate::pg_core::PgCore::primacy_changed`]) as soon as the shard's map view
//! shows it may have stopped being, or newly become, the group's primary.
//!
//! Bounded: at most `pg_log_entries_max` entries per group (the oldest go first),
//! and a member's tracking is one integer. The entries (not the tracking) are
//! made stable at FLUSH by `crate::store::pg_log_file` and loaded at start; a
//! restarted primary's recovering members are backfilled.
//!
//! **Retries and superseded writes.** Every entry carries the client operation
//! that produced it ([`OpId`]: the client's session and the op's sequence number,
//! the same on every resend). The log indexes them by object, so the primary —
//! after the write gate let every earlier overlapping write finish — can tell
//! ([`PgLog::check_op`]):
//!
//! * a **retry**: the op is in the log and this copy still holds its effect →
//!   answered without applying it again (the dup table is the log: bounded by it);
//! * a **superseded** write: a newer op of the same session to overlapping bytes
//!   is in the log (or was trimmed from it) → refused, never applied over the newer
//!   one. A client that still wants it re-issues it under a new sequence number;
//!   one that gave up on it (its I/O timeout passed) never sees it land later.
//!
//! A copy made by recovery, peering or scrub repair replaces this copy's bytes with
//! another copy's; the entries over those bytes then no longer prove that this copy
//! holds their op ([`PgLog::forget_proof`]), so a later retry of such an op is
//! applied, not answered from the log.

use flame_common::collections::{HashMap, HashSet};
use flame_common::ids::{Epoch, ObjectId, OpId, OsdId};
use flame_common::protocol::{LogOp, LogOps};
use serde::Serialize;
use std::collections::BTreeMap;

/// Sessions per group whose trimmed ops are remembered ([`PgLog::check_op`]); the
/// least recently trimmed is forgotten first.
const TRIMMED_SESSIONS_MAX: usize = 1024;

/// Ranges of trimmed entries remembered per member that missed them
/// ([`PgLog::may_lack`]); a member that missed more may lack anything.
const TRIMMED_MISSES_MAX: usize = 256;

/// What an entry did to its byte range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryKind {
    /// Wrote data.
    Write,
    /// Zeroed the range (WRITE_ZEROES).
    Zero,
    /// Discarded the range (reads back as zeroes).
    Discard,
}

/// One logged write.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogEntry {
    /// Its sequence number in the group.
    pub seq: u64,
    /// The client operation that produced it (`OpId::NONE`: none given).
    pub op: OpId,
    /// The interval (first epoch of the group's current roles) under which the
    /// primary recorded it: `applied` proves who holds it only while the group's
    /// roles are unchanged. 0 on a replica.
    pub interval: Epoch,
    /// The object written.
    pub object: ObjectId,
    /// Byte range within the object.
    pub offset: u32,
    /// Bytes.
    pub length: u32,
    /// What it did.
    pub kind: EntryKind,
    /// Write-set members that applied it (primary's entries; empty on a replica,
    /// which knows only that it applied it itself).
    pub applied: Vec<OsdId>,
}

/// The roles of the members a write was sent to, as the primary's view had them.
pub struct WriteSetRoles<'a> {
    /// Complete members (primary first).
    pub acting: &'a [OsdId],
    /// Members being recovered.
    pub recovering: &'a [OsdId],
}

/// The log of one placement group on one shard.
#[derive(Debug, Default)]
pub struct PgLog {
    entries: BTreeMap<u64, LogEntry>,
    max: usize,
    /// Highest sequence number assigned or seen.
    last_seq: u64,
    /// Highest sequence number dropped from the log (0: none).
    trimmed_through: u64,
    /// Members this primary tracks: `None` = applied every entry since tracked;
    /// `Some(s)` = first entry not applied.
    tracked: HashMap<OsdId, Option<u64>>,
    /// Per tracked member, the (object, offset, length) of every entry it missed
    /// that this log has trimmed since: what it may lack beyond the retained
    /// entries. A member absent here may lack anything at all (its misses were
    /// trimmed unrecorded: a miss noted of an entry already trimmed, a catch-up
    /// overtaken by trimming, more than [`TRIMMED_MISSES_MAX`] of them).
    /// Without it a member whose one missed write was trimmed was no repair
    /// source for any byte, and with every replica so the primary's rotten
    /// block was repaired by neither reads nor recovery (simulator seed 396).
    /// Bounded by the members times [`TRIMMED_MISSES_MAX`].
    trimmed_misses: HashMap<OsdId, Vec<(ObjectId, u32, u32)>>,
    /// Members whose copy this primary made equal to its own since its primacy
    /// began (peering compared every object, or recovery caught them up). A
    /// complete member starts being tracked at the first write this primary
    /// records, on the premise that it holds every earlier entry — true of the
    /// acknowledged ones only: a write the previous primary (or this one, before
    /// a primacy change) applied on some copies but not acknowledged is in the
    /// log and on those copies, and may be acknowledged later by a retry. Only
    /// peering, which compares everything, settles that; until it did, a
    /// member's tracking is no base for catching it up from the log (see
    /// [`PgLog::catch_up`]). Bounded by the group's members.
    synced: HashSet<OsdId>,
    /// Sequence numbers assigned and not yet recorded (writes in flight). Bounded
    /// by the writes a shard has in flight.
    inflight: std::collections::BTreeSet<u64>,
    /// The entries' client ops, by object and (session, op seq). Bounded by the
    /// entries.
    ops: HashMap<ObjectId, BTreeMap<(u64, u64), OpRec>>,
    /// Per session, the highest op seq trimmed from this log and when (a trim
    /// counter): an op of that session at or below it may be older than a write
    /// this log no longer shows. At most [`TRIMMED_SESSIONS_MAX`] sessions.
    trimmed_ops: HashMap<u64, (u64, u64)>,
    /// Trims so far (the clock of `trimmed_ops`).
    trims: u64,
}

/// One client op of the log, indexed for [`PgLog::check_op`].
#[derive(Clone, Copy, Debug)]
struct OpRec {
    /// The entry's group sequence number.
    seq: u64,
    offset: u32,
    length: u32,
    /// Whether this copy still holds the op's effect (no copy from another
    /// member replaced these bytes since).
    proof: bool,
}

/// What the log says about a client op about to be applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpCheck {
    /// Not seen (or not provably held by this copy): apply it.
    New,
    /// Already applied here as the entry with this sequence number, and this copy
    /// still holds it: a retry.
    Duplicate(u64),
    /// A newer op of the same session to overlapping bytes was applied first (or
    /// trimmed from the log): refuse it.
    Superseded,
}

fn overlaps(a_off: u32, a_len: u32, b_off: u32, b_len: u32) -> bool {
    let (a_end, b_end) = (
        u64::from(a_off) + u64::from(a_len),
        u64::from(b_off) + u64::from(b_len),
    );
    u64::from(a_off) < b_end && u64::from(b_off) < a_end
}

/// A tracked member missed entry `seq`: its first miss is the lowest seq missed.
fn note_miss(first_missed: &mut Option<u64>, seq: u64) {
    *first_missed = Some(first_missed.map_or(seq, |s| s.min(seq)));
}

impl PgLog {
    /// An empty log keeping at most `max` entries (at least 1).
    pub fn new(max: usize) -> PgLog {
        PgLog {
            max: max.max(1),
            ..PgLog::default()
        }
    }

    /// The next sequence number (primary, at admission).
    pub fn next_seq(&mut self) -> u64 {
        self.last_seq += 1;
        self.inflight.insert(self.last_seq);
        self.last_seq
    }

    /// Whether a write numbered `seq` or lower is still in flight (numbered, not
    /// yet recorded). Recovery waits for those before reporting a member: they may
    /// have been admitted under a map in which the member was not in the write set.
    pub fn inflight_through(&self, seq: u64) -> bool {
        self.inflight.first().is_some_and(|s| *s <= seq)
    }

    /// A numbered write that will not be recorded (it failed before it was sent).
    pub fn abandon(&mut self, seq: u64) {
        self.inflight.remove(&seq);
    }

    /// Oldest retained entry's seq (`last_seq + 1` when empty).
    pub fn first_seq(&self) -> u64 {
        self.entries
            .first_key_value()
            .map_or(self.last_seq + 1, |(s, _)| *s)
    }

    /// Highest sequence number assigned or seen.
    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// Entries retained.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry is retained.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn insert(&mut self, entry: LogEntry) {
        self.last_seq = self.last_seq.max(entry.seq);
        if !entry.op.is_none() {
            self.ops.entry(entry.object).or_default().insert(
                (entry.op.session, entry.op.seq),
                OpRec {
                    seq: entry.seq,
                    offset: entry.offset,
                    length: entry.length,
                    proof: true,
                },
            );
        }
        self.entries.insert(entry.seq, entry);
        // Bounded: one insert, at most one removal beyond the bound per call.
        while self.entries.len() > self.max {
            if let Some((s, e)) = self.entries.pop_first() {
                self.trimmed_through = self.trimmed_through.max(s);
                self.note_trimmed(&e);
                self.unindex(&e);
            }
        }
    }

    /// Entry `e` leaves the log: the tracked members that missed it remember its
    /// range ([`PgLog::trimmed_misses`]).
    fn note_trimmed(&mut self, e: &LogEntry) {
        for (id, t) in &self.tracked {
            match *t {
                // Missed nothing the log trimmed (an entry completed out of
                // order may be trimmed below others already were).
                None => self.trimmed_misses.entry(*id).or_default().clear(),
                Some(first) if first > self.trimmed_through => {
                    self.trimmed_misses.entry(*id).or_default().clear();
                }
                Some(_) if !e.applied.contains(id) => {
                    if let Some(ranges) = self.trimmed_misses.get_mut(id) {
                        if ranges.len() < TRIMMED_MISSES_MAX {
                            ranges.push((e.object, e.offset, e.length));
                        } else {
                            self.trimmed_misses.remove(id);
                        }
                    }
                }
                Some(_) => {}
            }
        }
    }

    /// Drops a trimmed entry's op from the index, remembering its session's
    /// highest trimmed op seq.
    fn unindex(&mut self, e: &LogEntry) {
        if e.op.is_none() {
            return;
        }
        let key = (e.op.session, e.op.seq);
        if let Some(m) = self.ops.get_mut(&e.object) {
            // The same op may have been applied again later (a newer entry).
            if m.get(&key).is_some_and(|r| r.seq == e.seq) {
                m.remove(&key);
            }
            if m.is_empty() {
                self.ops.remove(&e.object);
            }
        }
        self.trims += 1;
        let t = self.trims;
        let slot = self.trimmed_ops.entry(e.op.session).or_insert((0, t));
        *slot = (slot.0.max(e.op.seq), t);
        if self.trimmed_ops.len() > TRIMMED_SESSIONS_MAX {
            // Bounded: one scan when a new session overflows the table.
            if let Some(oldest) = self
                .trimmed_ops
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(s, _)| *s)
            {
                self.trimmed_ops.remove(&oldest);
            }
        }
    }

    /// What this log says about client op `op` writing `[offset, offset+length)`
    /// of `object`. Call once every earlier overlapping write has completed (the
    /// write gate), so that they are all in the log.
    pub fn check_op(&self, op: OpId, object: ObjectId, offset: u32, length: u32) -> OpCheck {
        if op.is_none() {
            return OpCheck::New;
        }
        let Some(m) = self.ops.get(&object) else {
            return self.check_trimmed(op);
        };
        if let Some(r) = m.get(&(op.session, op.seq))
            && r.proof
        {
            return OpCheck::Duplicate(r.seq);
        }
        let newer = m
            .range((op.session, op.seq.saturating_add(1))..=(op.session, u64::MAX))
            .any(|(_, r)| overlaps(r.offset, r.length, offset, length));
        if newer {
            return OpCheck::Superseded;
        }
        self.check_trimmed(op)
    }

    fn check_trimmed(&self, op: OpId) -> OpCheck {
        match self.trimmed_ops.get(&op.session) {
            Some((seq, _)) if op.seq <= *seq => OpCheck::Superseded,
            _ => OpCheck::New,
        }
    }

    /// The entry numbered `seq`, if still in the log.
    pub fn entry(&self, seq: u64) -> Option<&LogEntry> {
        self.entries.get(&seq)
    }

    /// Every member of a write set now holds entry `seq` (the primary copied its
    /// bytes to those that might not), under the roles of `interval`: a further
    /// retry of its op is answered at once.
    ///
    /// The retry is acknowledged now: a tracked member outside the write set
    /// misses it, as it would a new write ([`PgLog::record_primary`]) — its
    /// tracking may have begun after the entry was first recorded, on the
    /// premise that it held every acknowledged write before (simulator seed
    /// 500164).
    pub fn now_held_by(&mut self, seq: u64, interval: Epoch, members: impl Iterator<Item = OsdId>) {
        let members: Vec<OsdId> = members.collect();
        for (id, t) in self.tracked.iter_mut() {
            if !members.contains(id) {
                note_miss(t, seq);
                if seq <= self.trimmed_through && !self.entries.contains_key(&seq) {
                    // A miss of an entry no longer here: its range is unknown.
                    self.trimmed_misses.remove(id);
                }
            }
        }
        if let Some(e) = self.entries.get_mut(&seq) {
            e.interval = interval;
            e.applied = members;
        }
    }

    /// Bytes `[offset, offset+length)` of `object` (`length` 0: all of it) on this
    /// copy were replaced by a copy from another member (recovery, peering, scrub
    /// repair): the entries over them no longer prove that this copy holds their
    /// ops.
    pub fn forget_proof(&mut self, object: ObjectId, offset: u32, length: u32) {
        let Some(m) = self.ops.get_mut(&object) else {
            return;
        };
        for r in m.values_mut() {
            if length == 0 || overlaps(r.offset, r.length, offset, length) {
                r.proof = false;
            }
        }
    }

    /// This copy failed to apply `op` to `object` (the primary's own write failed
    /// while replicas may have applied it): the log must not answer a retry of it
    /// from this copy, which may lack it.
    pub fn unprove_op(&mut self, object: ObjectId, op: OpId) {
        if op.is_none() {
            return;
        }
        if let Some(r) = self
            .ops
            .get_mut(&object)
            .and_then(|m| m.get_mut(&(op.session, op.seq)))
        {
            r.proof = false;
        }
    }

    /// Records a completed write on the primary: `entry.applied` holds the members
    /// that applied it, `roles` the write set it was sent to.
    pub fn record_primary(&mut self, entry: LogEntry, roles: &WriteSetRoles<'_>) {
        let seq = entry.seq;
        let was_inflight = self.inflight.remove(&seq);
        debug_assert!(
            was_inflight,
            "pg log: entry {seq} recorded but never admitted"
        );
        if !was_inflight {
            tracing::warn!(
                seq,
                "pg log: an entry recorded that was never admitted (group state reset?)"
            );
        }
        let applied = |id: &OsdId| entry.applied.contains(id);
        // Writes complete out of their admission order (a dead replica's pending
        // forwards fail in any order; overlapping-free writes finish as their I/O
        // does), so a member may miss this entry after a higher-numbered one was
        // already recorded as its first miss: its first miss is the lowest seq it
        // missed, never just the first one recorded. Otherwise log catch-up
        // (`missed_by`, which reads from the first miss on) would skip this entry
        // and report a member recovered without an acknowledged write.
        for id in roles.acting {
            // A complete member that this log does not track yet had every earlier
            // write (that is what complete means): track it from here.
            let t = self.tracked.entry(*id).or_insert_with(|| {
                // Holds every earlier entry: none trimmed is missing.
                self.trimmed_misses.insert(*id, Vec::new());
                None
            });
            if !applied(id) {
                note_miss(t, seq);
            }
        }
        for id in roles.recovering {
            // Tracked only if it was complete under this primary before; a member
            // that never was is backfilled, whatever it applies now.
            if let Some(t) = self.tracked.get_mut(id)
                && !applied(id)
            {
                note_miss(t, seq);
            }
        }
        for (id, t) in self.tracked.iter_mut() {
            let in_set = roles.acting.contains(id) || roles.recovering.contains(id);
            if !in_set {
                note_miss(t, seq);
            }
        }
        self.insert(entry);
    }

    /// Records a completed write on the primary without touching member
    /// tracking: its primacy changed while the write ran (see
    /// `PgCore::complete`).
    pub fn record_untracked(&mut self, entry: LogEntry) {
        self.inflight.remove(&entry.seq);
        self.insert(entry);
    }

    /// Records an entry a replica applied (seq > 0).
    pub fn record_replica(&mut self, entry: LogEntry) {
        debug_assert!(entry.seq > 0);
        self.insert(entry);
    }

    /// Forgets which members applied what: this shard's primary interval ended or
    /// began. Entries stay (their bounds are still reported), the numbering too.
    pub fn reset_tracking(&mut self) {
        self.tracked.clear();
        self.synced.clear();
        self.trimmed_misses.clear();
    }

    /// Peering made `member`'s copy equal to this primary's (every object
    /// compared) under the current primacy: its tracking is now a sound base for
    /// log catch-up ([`PgLog::catch_up`]).
    pub fn peered(&mut self, member: OsdId) {
        self.synced.insert(member);
    }

    /// This primary's copy changed outside the log: peering took another
    /// copy's bytes of an object ([`PgLog::sources_ahead`]). No member peered or
    /// recovered before is known to hold this copy's bytes any more, so each is
    /// compared in full (peering, backfill) rather than caught up from the log,
    /// which does not name those bytes (simulator seed 240719: a member peered
    /// in a pass whose choice of the newest copy missed an unanswering source,
    /// then caught up from the log after the next pass took that source's copy,
    /// kept its older blocks).
    pub fn unsync_all(&mut self) {
        self.synced.clear();
    }

    /// What log catch-up copies to `member`: [`PgLog::missed_by`], but `None`
    /// (backfill) for a member this primary has not made equal to its copy since
    /// its primacy began — neither peered nor recovered. Its tracking started
    /// from the premise that it held every earlier entry, which holds for the
    /// acknowledged ones only; a write applied by the other copies but not by it
    /// and acknowledged later (a retry answered from the log), or never
    /// acknowledged (abandoned), would be left out (simulator seeds 500164,
    /// 301476).
    pub fn catch_up(&self, member: OsdId) -> Option<Vec<(u64, ObjectId, u32, u32)>> {
        if !self.synced.contains(&member) {
            return None;
        }
        self.missed_by(member, 0)
    }

    /// What `member` missed, as (object, offset, length) ranges of entries with
    /// seq above `after`: `Some(ranges)` (possibly empty) when this log can tell,
    /// `None` when it cannot (not tracked, or the log no longer reaches back to the
    /// member's first miss) — then the member must be backfilled.
    pub fn missed_by(&self, member: OsdId, after: u64) -> Option<Vec<(u64, ObjectId, u32, u32)>> {
        let Some(first_missed) = *self.tracked.get(&member)? else {
            return Some(Vec::new());
        };
        if first_missed <= self.trimmed_through {
            return None;
        }
        Some(
            self.entries
                .range(first_missed.max(after + 1)..)
                .filter(|(_, e)| !e.applied.contains(&member))
                .map(|(s, e)| (*s, e.object, e.offset, e.length))
                .collect(),
        )
    }

    /// Whether `member`'s copy of `[offset, offset+length)` of `object` may lack
    /// an entry of this log: it is tracked, and it missed an entry over those
    /// bytes that catch-up has not brought it yet, retained or trimmed since
    /// (the trimmed ones' ranges are remembered), or it missed a trimmed one
    /// whose range the log does not know. `false` for a member not tracked: the
    /// log knows nothing against it.
    pub fn may_lack(&self, member: OsdId, object: ObjectId, offset: u32, length: u32) -> bool {
        let Some(Some(first_missed)) = self.tracked.get(&member).copied() else {
            return false;
        };
        if first_missed <= self.trimmed_through {
            match self.trimmed_misses.get(&member) {
                None => return true,
                Some(ranges) => {
                    if ranges
                        .iter()
                        .any(|&(o, off, len)| o == object && overlaps(off, len, offset, length))
                    {
                        return true;
                    }
                }
            }
        }
        self.entries.range(first_missed..).any(|(_, e)| {
            e.object == object
                && !e.applied.contains(&member)
                && overlaps(e.offset, e.length, offset, length)
        })
    }

    /// Stops tracking every member `keep` refuses: one that left the group (no
    /// longer placed, nor a complete copy still serving). Its copy becomes a stray
    /// and is deleted, so what it applied before proves nothing when it is placed
    /// here again: it must then be backfilled, not caught up from this log.
    pub fn forget_members(&mut self, keep: impl Fn(OsdId) -> bool) {
        self.tracked.retain(|m, _| keep(*m));
        self.synced.retain(|m| keep(*m));
        self.trimmed_misses.retain(|m, _| keep(*m));
    }

    /// The client ops of the retained entries whose effect this copy still
    /// holds (no copy from another member replaced those bytes since), for a
    /// peering primary ([`flame_common::protocol::Message::PgLogOps`]). At most
    /// the newest `max` (a reply's bound, [`flame_common::protocol::PG_LIST_MAX`]):
    /// older ones are then reported as trimmed.
    pub fn log_ops(&self, max: usize) -> LogOps {
        let mut trimmed_through = self.trimmed_through;
        let mut ops = Vec::new();
        // Bounded: one pass over the retained entries, newest first.
        for e in self.entries.values().rev() {
            if ops.len() == max {
                trimmed_through = trimmed_through.max(e.seq);
                break;
            }
            if e.op.is_none() || !self.holds_op(e.op, e.object, e.seq) {
                continue;
            }
            ops.push(LogOp {
                seq: e.seq,
                op: e.op,
                object: e.object,
            });
        }
        ops.reverse();
        LogOps {
            trimmed_through,
            ops,
        }
    }

    /// Whether this copy provably holds op `op`, logged as entry `seq`, of `object`.
    fn holds_op(&self, op: OpId, object: ObjectId, seq: u64) -> bool {
        self.ops
            .get(&object)
            .and_then(|m| m.get(&(op.session, op.seq)))
            .is_some_and(|r| r.proof && r.seq == seq)
    }

    /// Whether this copy may hold op `op` (numbered `seq` where it was logged)
    /// of `object`: its log holds it with proof, or may have dropped it. An op
    /// whose bytes a copy from another member replaced (or that this copy failed
    /// to apply) is not counted: another copy holding it is ahead.
    fn may_have_applied(&self, op: OpId, object: ObjectId, seq: u64) -> bool {
        seq <= self.trimmed_through
            || self
                .ops
                .get(&object)
                .and_then(|m| m.get(&(op.session, op.seq)))
                .is_some_and(|r| r.proof)
            || self.check_trimmed(op) == OpCheck::Superseded
    }

    /// Peering's first step, on a new primary (Ceph's authoritative log, per
    /// object): the objects another complete copy holds newer writes of than
    /// this one, each with the copy to take it from. `members` are the other
    /// complete copies' logs ([`PgLog::log_ops`]).
    ///
    /// A member is ahead on an object when its log shows ops to it that this
    /// log neither holds nor may have dropped, and behind when this log holds
    /// ops to it (that the member's log still reaches back to) which the member's
    /// does not. Only a member ahead and not behind is a source: its bytes carry
    /// everything this copy's do and more. Of several, the one whose ops include
    /// every other source's is taken (the first such in `members`' order); when
    /// none does, the copies diverged both ways and the object is left to
    /// peering as before. An object this log wrote without an op id is never
    /// taken (nothing tells whether the member has that write).
    ///
    /// Why at all: a write is acknowledged only once every member of its write
    /// set applied it and the primary is always a complete copy, so what a
    /// member holds beyond the primary was never acknowledged — unless the
    /// primary's copy lost it (a bug, a disk that drops writes). Taking the newest
    /// copy makes peering spread that one instead of the primary's.
    pub fn sources_ahead(&self, members: &[(OsdId, LogOps)]) -> Vec<(ObjectId, OsdId)> {
        let no_op_id: HashSet<ObjectId> = self
            .entries
            .values()
            .filter(|e| e.op.is_none())
            .map(|e| e.object)
            .collect();
        // Per (object, member index): its ops to the object.
        let mut theirs: HashMap<(ObjectId, usize), HashSet<OpId>> = HashMap::default();
        // Per object, per member index (in `members`' order): its ops to the
        // object this log may lack.
        let mut ahead: BTreeMap<ObjectId, BTreeMap<usize, Vec<OpId>>> = BTreeMap::new();
        for (i, (_, log)) in members.iter().enumerate() {
            for o in &log.ops {
                theirs.entry((o.object, i)).or_default().insert(o.op);
                if !self.may_have_applied(o.op, o.object, o.seq) {
                    ahead
                        .entry(o.object)
                        .or_default()
                        .entry(i)
                        .or_default()
                        .push(o.op);
                }
            }
        }
        let mut out = Vec::new();
        for (object, candidates) in ahead {
            if no_op_id.contains(&object) {
                continue;
            }
            let ops_of = |i: usize| theirs.get(&(object, i));
            // Not behind: every op of this log to the object that the member's
            // log still reaches is in it.
            let behind = |i: usize| {
                let floor = members[i].1.trimmed_through;
                self.ops.get(&object).is_some_and(|m| {
                    m.iter().any(|(&(session, seq), r)| {
                        r.seq > floor
                            && !ops_of(i).is_some_and(|set| set.contains(&OpId { session, seq }))
                    })
                })
            };
            let sources: Vec<(&usize, &Vec<OpId>)> =
                candidates.iter().filter(|(i, _)| !behind(**i)).collect();
            let dominant = sources.iter().find(|(i, _)| {
                let mine = ops_of(**i);
                sources
                    .iter()
                    .all(|(_, v)| v.iter().all(|op| mine.is_some_and(|set| set.contains(op))))
            });
            if let Some((i, _)) = dominant {
                out.push((object, members[**i].0));
            }
        }
        out
    }

    /// Whether `member` is tracked and missed nothing.
    pub fn tracks(&self, member: OsdId) -> bool {
        self.tracked.contains_key(&member)
    }

    /// Whether tracked `member` lacks an entry of this log that no catch-up
    /// brought it yet: it missed one the log still holds, or one the log has
    /// trimmed since (then only a backfill can bring it, [`PgLog::catch_up`]
    /// answering `None`). A complete member that failed writes is caught up
    /// for this; one whose misses were trimmed used to count as not lagging
    /// ([`PgLog::missed_by`] cannot list them), so it kept the older bytes for
    /// good (simulator seeds 45, 63, 369 with a log of 26–50 entries).
    pub fn lags(&self, member: OsdId) -> bool {
        match self.tracked.get(&member) {
            Some(Some(_)) => self.missed_by(member, 0).is_none_or(|m| !m.is_empty()),
            _ => false,
        }
    }

    /// `member` was caught up through `through`: it counts as having applied every
    /// entry up to there (later misses are tracked again). The entries above
    /// `through` that it did not apply are its misses — those the log still
    /// holds; if the log trimmed some of them meanwhile (more than
    /// `pg_log_entries_max` writes while the catch-up ran), which ones it missed
    /// is unknown, so its first miss is taken to be the first of those: it
    /// lags, and is backfilled rather than counted as holding them.
    pub fn recovered(&mut self, member: OsdId, through: u64) {
        let still_missing = if self.trimmed_through > through {
            // Which of the trimmed entries above `through` it missed is unknown.
            self.trimmed_misses.remove(&member);
            Some(through + 1)
        } else {
            // Every entry it missed that the log trimmed is at or below `through`.
            self.trimmed_misses.insert(member, Vec::new());
            self.entries
                .range(through + 1..)
                .find(|(_, e)| !e.applied.contains(&member))
                .map(|(s, _)| *s)
        };
        self.tracked.insert(member, still_missing);
        self.synced.insert(member);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::ids::VolumeId;

    #[test]
    fn a_copy_changed_outside_the_log_is_caught_up_by_no_member() {
        let mut log = PgLog::new(64);
        let m = OsdId(2);
        log.recovered(m, 0);
        assert_eq!(log.catch_up(m), Some(Vec::new()));
        log.unsync_all();
        assert_eq!(log.catch_up(m), None, "backfilled, not caught up");
    }

    /// Found by the simulator (seed 5374): a member taken out, whose stray copy
    /// was deleted, came back in and was "caught up" from this log as if it
    /// still held everything it applied before — and served zeroes.
    #[test]
    fn a_member_that_left_the_group_is_not_tracked_when_it_returns() {
        let mut log = PgLog::new(16);
        log.recovered(OsdId(2), 0);
        assert_eq!(log.missed_by(OsdId(2), 0), Some(Vec::new()));
        log.forget_members(|m| m != OsdId(2));
        assert_eq!(log.missed_by(OsdId(2), 0), None, "backfill, not the log");
    }

    /// Found by the simulator (seeds 45, 63, 369, logs of 26–50 entries): a
    /// complete member failed writes (forwards that timed out), and more
    /// writes than the log keeps followed. Its miss was trimmed, so the log
    /// could not list what it missed — and it counted as not lagging: never
    /// caught up, its copy differed for good.
    #[test]
    fn a_complete_member_whose_misses_were_trimmed_still_lags() {
        let mut log = PgLog::new(4);
        let all = WriteSetRoles {
            acting: &A,
            recovering: &[],
        };
        let s = log.next_seq();
        log.record_primary(entry(s, 0, &[1, 2, 3]), &all);
        assert!(!log.lags(OsdId(3)));
        // OSD 3 fails one write (it stays complete)...
        let s = log.next_seq();
        log.record_primary(entry(s, 1, &[1, 2]), &all);
        assert!(log.lags(OsdId(3)), "a miss the log holds");
        // ...then applies more writes than the log keeps.
        for i in 0..8 {
            let s = log.next_seq();
            log.record_primary(entry(s, 2 + i, &[1, 2, 3]), &all);
        }
        assert_eq!(log.missed_by(OsdId(3), 0), None, "its miss was trimmed");
        assert!(log.lags(OsdId(3)), "a trimmed miss still lags (backfill)");
        assert!(!log.lags(OsdId(2)));
        assert!(!log.lags(OsdId(9)), "not tracked: nothing known against it");
    }

    /// A member caught up through `through` while the log trimmed entries
    /// above `through` cannot be told to hold them: which of them it applied
    /// is gone with them.
    #[test]
    fn a_member_recovered_while_the_log_trimmed_its_later_misses_still_lags() {
        let mut log = PgLog::new(4);
        let all = WriteSetRoles {
            acting: &A[..2],
            recovering: &A[2..],
        };
        let through = {
            let s = log.next_seq();
            log.record_primary(entry(s, 0, &[1, 2, 3]), &all);
            s
        };
        // While the job ran: OSD 3 (recovering, not tracked) misses a write,
        // then more writes than the log keeps.
        let s = log.next_seq();
        log.record_primary(entry(s, 1, &[1, 2]), &all);
        for i in 0..8 {
            let s = log.next_seq();
            log.record_primary(entry(s, 2 + i, &[1, 2, 3]), &all);
        }
        log.recovered(OsdId(3), through);
        assert_eq!(log.catch_up(OsdId(3)), None, "backfill, not the log");
        assert!(log.lags(OsdId(3)));
        // Without a trim the log tells exactly.
        let mut log = PgLog::new(64);
        let s = log.next_seq();
        log.record_primary(entry(s, 0, &[1, 2, 3]), &all);
        let s = log.next_seq();
        log.record_primary(entry(s, 1, &[1, 2]), &all);
        log.recovered(OsdId(3), 1);
        assert!(log.lags(OsdId(3)));
        assert_eq!(log.catch_up(OsdId(3)).map(|m| m.len()), Some(1));
    }

    fn entry(seq: u64, index: u64, applied: &[u32]) -> LogEntry {
        LogEntry {
            seq,
            op: OpId::NONE,
            interval: Epoch(0),
            object: ObjectId {
                volume: VolumeId(1),
                index,
            },
            offset: 0,
            length: 4096,
            kind: EntryKind::Write,
            applied: applied.iter().map(|&i| OsdId(i)).collect(),
        }
    }

    const A: [OsdId; 3] = [OsdId(1), OsdId(2), OsdId(3)];

    fn object(index: u64) -> ObjectId {
        ObjectId {
            volume: VolumeId(1),
            index,
        }
    }

    /// Simulator seed 396: the log remembers the ranges of the misses it trims,
    /// so a member lacks those bytes only — also when an entry completed out
    /// of order is trimmed below one already trimmed — and anything at all once
    /// it missed an entry already gone.
    #[test]
    fn a_trimmed_miss_makes_a_member_lack_its_bytes_only() {
        let mut log = PgLog::new(2);
        let all = WriteSetRoles {
            acting: &A,
            recovering: &[],
        };
        let late = log.next_seq();
        let s = log.next_seq();
        log.record_primary(entry(s, 0, &[1, 2]), &all);
        for i in 0..3 {
            let s = log.next_seq();
            log.record_primary(entry(s, 5 + i, &[1, 2, 3]), &all);
        }
        assert!(log.lags(OsdId(3)));
        assert!(log.may_lack(OsdId(3), object(0), 0, 4096));
        assert!(!log.may_lack(OsdId(3), object(1), 0, 4096));
        assert!(!log.may_lack(OsdId(3), object(0), 4096, 4096));
        // Completed out of order, below what was trimmed: the miss above stays.
        log.record_primary(entry(late, 1, &[1, 2, 3]), &all);
        assert!(log.may_lack(OsdId(3), object(0), 0, 4096));
        assert!(!log.may_lack(OsdId(3), object(1), 0, 4096));
        // A retry of a trimmed entry acknowledged without it: range unknown.
        log.now_held_by(late, Epoch(0), [OsdId(1), OsdId(2)].into_iter());
        assert!(log.may_lack(OsdId(3), object(1), 0, 4096));
        assert!(log.may_lack(OsdId(3), object(9), 0, 4096));
        // Caught up: lacks nothing.
        log.recovered(OsdId(3), log.last_seq());
        assert!(!log.may_lack(OsdId(3), object(0), 0, 4096));
    }

    #[test]
    fn a_member_that_went_away_misses_exactly_the_entries_it_did_not_apply() {
        let mut log = PgLog::new(100);
        let all = WriteSetRoles {
            acting: &A,
            recovering: &[],
        };
        let s = log.next_seq();
        log.record_primary(entry(s, 0, &[1, 2, 3]), &all);
        assert_eq!(log.missed_by(OsdId(3), 0), Some(vec![]));
        // OSD 3 goes down: two writes without it.
        let two = WriteSetRoles {
            acting: &A[..2],
            recovering: &[],
        };
        for i in 1..=2 {
            let s = log.next_seq();
            log.record_primary(entry(s, i, &[1, 2]), &two);
        }
        // Back as recovering: it applies new writes.
        let back = WriteSetRoles {
            acting: &A[..2],
            recovering: &A[2..],
        };
        let s = log.next_seq();
        log.record_primary(entry(s, 9, &[1, 2, 3]), &back);
        let missed = log.missed_by(OsdId(3), 0).unwrap();
        let objects: Vec<u64> = missed.iter().map(|(_, o, _, _)| o.index).collect();
        assert_eq!(objects, vec![1, 2]);
        log.recovered(OsdId(3), log.last_seq());
        assert_eq!(log.missed_by(OsdId(3), 0), Some(vec![]));
        // Untracked members (never complete under this primary) need backfill.
        assert_eq!(log.missed_by(OsdId(7), 0), None);
        log.reset_tracking();
        assert_eq!(log.missed_by(OsdId(3), 0), None);
    }

    #[test]
    fn a_miss_recorded_after_a_later_one_is_not_skipped() {
        // Writes complete out of admission order: when a replica dies, its pending
        // forwards fail in any order. Entry b (higher seq) is recorded as missed
        // first, then entry a: the member missed both, and log catch-up must copy
        // both (the lost case: the member was reported recovered without a).
        let mut log = PgLog::new(10);
        let all = WriteSetRoles {
            acting: &A,
            recovering: &[],
        };
        let s = log.next_seq();
        log.record_primary(entry(s, 0, &[1, 2, 3]), &all);
        let a = log.next_seq();
        let b = log.next_seq();
        log.record_primary(entry(b, 2, &[1, 2]), &all);
        log.record_primary(entry(a, 1, &[1, 2]), &all);
        let missed = log.missed_by(OsdId(3), 0).unwrap();
        let objects: Vec<u64> = missed.iter().map(|(_, o, _, _)| o.index).collect();
        assert_eq!(objects, vec![1, 2]);
        // The same after a catch-up: a write numbered after `through` but
        // recorded after a later one it also missed.
        log.recovered(OsdId(3), log.last_seq());
        let c = log.next_seq();
        let d = log.next_seq();
        let back = WriteSetRoles {
            acting: &A[..2],
            recovering: &A[2..],
        };
        log.record_primary(entry(d, 4, &[1, 2]), &back);
        log.record_primary(entry(c, 3, &[1, 2]), &back);
        let missed = log.missed_by(OsdId(3), 0).unwrap();
        let objects: Vec<u64> = missed.iter().map(|(_, o, _, _)| o.index).collect();
        assert_eq!(objects, vec![3, 4]);
        // And for a member that left the write set.
        log.recovered(OsdId(3), log.last_seq());
        let e = log.next_seq();
        let f = log.next_seq();
        let two = WriteSetRoles {
            acting: &A[..2],
            recovering: &[],
        };
        log.record_primary(entry(f, 6, &[1, 2]), &two);
        log.record_primary(entry(e, 5, &[1, 2]), &two);
        let missed = log.missed_by(OsdId(3), 0).unwrap();
        let objects: Vec<u64> = missed.iter().map(|(_, o, _, _)| o.index).collect();
        assert_eq!(objects, vec![5, 6]);
    }

    #[test]
    fn a_log_that_no_longer_reaches_back_says_so() {
        let mut log = PgLog::new(4);
        let all = WriteSetRoles {
            acting: &A,
            recovering: &[],
        };
        let s = log.next_seq();
        log.record_primary(entry(s, 0, &[1, 2, 3]), &all);
        let two = WriteSetRoles {
            acting: &A[..2],
            recovering: &[],
        };
        for i in 1..=3 {
            let s = log.next_seq();
            log.record_primary(entry(s, i, &[1, 2]), &two);
        }
        assert_eq!(log.missed_by(OsdId(3), 0).map(|m| m.len()), Some(3));
        for i in 4..=5 {
            let s = log.next_seq();
            log.record_primary(entry(s, i, &[1, 2]), &two);
        }
        assert_eq!(log.len(), 4);
        assert_eq!(log.first_seq(), 3);
        assert_eq!(log.missed_by(OsdId(3), 0), None, "entry 2 was trimmed");
    }

    /// Simulator seed 301476: a write applied by two copies failed on the third
    /// (dead, not yet marked down) and was never acknowledged (abandoned); the
    /// primary's tracking was reset (epochs skipped) and started again at the
    /// next write, which the dead member failed too. Log catch-up from there left
    /// out the earlier write: the copies differed for good.
    #[test]
    fn a_member_tracked_from_before_peering_is_backfilled() {
        let mut log = PgLog::new(100);
        let all = WriteSetRoles {
            acting: &A,
            recovering: &[],
        };
        let s = log.next_seq();
        log.record_primary(entry(s, 0, &[1, 2, 3]), &all);
        log.recovered(OsdId(3), log.last_seq());
        // OSD 3 dies: the write to object 1 is applied by 1 and 2 only.
        let lost = log.next_seq();
        log.record_primary(entry(lost, 1, &[1, 2]), &all);
        assert_eq!(log.catch_up(OsdId(3)).map(|m| m.len()), Some(1));
        // The primacy may have been interrupted: tracking restarts at the next
        // write, which OSD 3 (still acting in the map) fails too.
        log.reset_tracking();
        let s = log.next_seq();
        log.record_primary(entry(s, 2, &[1, 2]), &all);
        // The tracking alone would copy object 2 only, not object 1.
        let tracked: Vec<u64> = log
            .missed_by(OsdId(3), 0)
            .unwrap()
            .iter()
            .map(|(_, o, ..)| o.index)
            .collect();
        assert_eq!(tracked, vec![2]);
        assert_eq!(log.catch_up(OsdId(3)), None, "backfill: never peered");
        // Peering (or a recovery) under this primacy makes the tracking sound.
        log.peered(OsdId(2));
        assert_eq!(log.catch_up(OsdId(2)), Some(vec![]));
        log.recovered(OsdId(3), log.last_seq());
        assert_eq!(log.catch_up(OsdId(3)), Some(vec![]));
        // A member that left the group is forgotten, synced or not.
        log.forget_members(|m| m != OsdId(2));
        assert_eq!(log.catch_up(OsdId(2)), None);
    }

    #[test]
    fn a_recovering_member_that_was_never_complete_is_not_tracked() {
        let mut log = PgLog::new(10);
        let roles = WriteSetRoles {
            acting: &A[..2],
            recovering: &A[2..],
        };
        let s = log.next_seq();
        log.record_primary(entry(s, 0, &[1, 2, 3]), &roles);
        assert!(!log.tracks(OsdId(3)));
        assert_eq!(log.missed_by(OsdId(3), 0), None);
    }

    #[test]
    fn writes_in_flight_are_known_until_recorded() {
        let mut log = PgLog::new(10);
        let a = log.next_seq();
        let b = log.next_seq();
        assert!(log.inflight_through(a));
        log.record_primary(
            entry(b, 0, &[1]),
            &WriteSetRoles {
                acting: &A[..1],
                recovering: &[],
            },
        );
        assert!(log.inflight_through(b), "a is still in flight");
        log.abandon(a);
        assert!(!log.inflight_through(b));
    }

    fn op_entry(seq: u64, op: OpId, offset: u32, length: u32) -> LogEntry {
        LogEntry {
            op,
            offset,
            length,
            ..entry(seq, 0, &[1, 2, 3])
        }
    }

    fn obj(index: u64) -> ObjectId {
        ObjectId {
            volume: VolumeId(1),
            index,
        }
    }

    #[test]
    fn a_retry_is_recognised_and_an_older_overlapping_op_of_the_session_is_refused() {
        let mut log = PgLog::new(100);
        let op = |session, seq| OpId { session, seq };
        log.record_replica(op_entry(1, op(7, 10), 0, 8192));
        // The same op again: a retry.
        assert_eq!(
            log.check_op(op(7, 10), obj(0), 0, 8192),
            OpCheck::Duplicate(1)
        );
        // An older op of session 7 overlapping it: superseded; not overlapping, or
        // another object, or another session: new.
        assert_eq!(
            log.check_op(op(7, 9), obj(0), 4096, 4096),
            OpCheck::Superseded
        );
        assert_eq!(log.check_op(op(7, 9), obj(0), 8192, 4096), OpCheck::New);
        assert_eq!(log.check_op(op(7, 9), obj(1), 0, 4096), OpCheck::New);
        assert_eq!(log.check_op(op(8, 9), obj(0), 0, 4096), OpCheck::New);
        // Newer ops of the session are new.
        assert_eq!(log.check_op(op(7, 11), obj(0), 0, 4096), OpCheck::New);
        // No op id: never checked.
        assert_eq!(log.check_op(OpId::NONE, obj(0), 0, 4096), OpCheck::New);
    }

    #[test]
    fn a_copy_from_another_member_takes_away_the_proof_but_not_the_order() {
        let mut log = PgLog::new(100);
        let op = OpId { session: 3, seq: 5 };
        log.record_replica(op_entry(1, op, 4096, 4096));
        log.forget_proof(obj(0), 0, 4096);
        assert_eq!(
            log.check_op(op, obj(0), 4096, 4096),
            OpCheck::Duplicate(1),
            "no overlap"
        );
        log.forget_proof(obj(0), 6000, 1);
        assert_eq!(
            log.check_op(op, obj(0), 4096, 4096),
            OpCheck::New,
            "applied again"
        );
        // Still newer than an older op of its session.
        assert_eq!(
            log.check_op(OpId { session: 3, seq: 4 }, obj(0), 4096, 1),
            OpCheck::Superseded
        );
        // Length 0: the whole object.
        log.record_replica(op_entry(2, OpId { session: 3, seq: 6 }, 0, 512));
        log.forget_proof(obj(0), 0, 0);
        assert_eq!(
            log.check_op(OpId { session: 3, seq: 6 }, obj(0), 0, 512),
            OpCheck::New
        );
    }

    #[test]
    fn ops_trimmed_from_the_log_still_supersede_older_ones_of_their_session() {
        let mut log = PgLog::new(2);
        for (seq, op_seq) in [(1, 10), (2, 11), (3, 12)] {
            log.record_replica(op_entry(
                seq,
                OpId {
                    session: 9,
                    seq: op_seq,
                },
                0,
                4096,
            ));
        }
        // Op 10 was trimmed: its retry is no longer recognised, and anything of
        // session 9 up to it is refused (it may be older than a write the log no
        // longer shows) — whatever the range.
        assert_eq!(log.len(), 2);
        assert_eq!(
            log.check_op(
                OpId {
                    session: 9,
                    seq: 10
                },
                obj(5),
                0,
                1
            ),
            OpCheck::Superseded
        );
        assert_eq!(
            log.check_op(
                OpId {
                    session: 9,
                    seq: 12
                },
                obj(0),
                0,
                4096
            ),
            OpCheck::Duplicate(3)
        );
        assert_eq!(
            log.check_op(OpId { session: 1, seq: 1 }, obj(0), 100, 1),
            OpCheck::New
        );
        // The index is bounded by the entries.
        let indexed: usize = log.ops.values().map(|m| m.len()).sum();
        assert_eq!(indexed, 2);
        // And the trimmed sessions by their bound.
        let mut log = PgLog::new(1);
        for s in 1..=(TRIMMED_SESSIONS_MAX as u64 + 10) {
            log.record_replica(op_entry(s, OpId { session: s, seq: 1 }, 0, 1));
        }
        assert!(log.trimmed_ops.len() <= TRIMMED_SESSIONS_MAX);
        assert!(
            !log.trimmed_ops.contains_key(&1),
            "the oldest session went first"
        );
    }

    #[test]
    fn replicas_keep_numbering_above_what_they_saw() {
        let mut log = PgLog::new(10);
        log.record_replica(entry(41, 0, &[]));
        assert_eq!(log.next_seq(), 42);
    }

    /// A log of the ops `(seq, session, op seq, object index)`, as a member
    /// reports it.
    fn reported(trimmed_through: u64, ops: &[(u64, u64, u64, u64)]) -> LogOps {
        LogOps {
            trimmed_through,
            ops: ops
                .iter()
                .map(|&(seq, session, op_seq, index)| LogOp {
                    seq,
                    op: OpId {
                        session,
                        seq: op_seq,
                    },
                    object: obj(index),
                })
                .collect(),
        }
    }

    /// This log, holding the ops `(seq, session, op seq, object index)`.
    fn holding(ops: &[(u64, u64, u64, u64)]) -> PgLog {
        let mut log = PgLog::new(100);
        for &(seq, session, op_seq, index) in ops {
            log.record_replica(LogEntry {
                object: obj(index),
                ..op_entry(
                    seq,
                    OpId {
                        session,
                        seq: op_seq,
                    },
                    0,
                    4096,
                )
            });
        }
        log
    }

    #[test]
    fn a_copy_whose_log_shows_a_write_this_one_lacks_is_taken_before_peering() {
        let log = holding(&[(1, 7, 1, 0)]);
        let member = reported(0, &[(1, 7, 1, 0), (2, 7, 2, 0), (3, 7, 3, 5)]);
        assert_eq!(
            log.sources_ahead(&[(OsdId(2), member.clone())]),
            vec![(obj(0), OsdId(2)), (obj(5), OsdId(2))],
            "object 0 (one op more) and object 5 (only there) come from the member"
        );
        // A member holding what this log holds, no more: nothing to take.
        assert!(
            log.sources_ahead(&[(OsdId(2), reported(0, &[(1, 7, 1, 0)]))])
                .is_empty()
        );
        assert!(log.sources_ahead(&[]).is_empty());
    }

    #[test]
    fn a_copy_that_lacks_a_write_this_one_holds_is_no_source_for_that_object() {
        // Both diverged on object 0: this log has op 2, the member op 3.
        let log = holding(&[(1, 7, 1, 0), (2, 7, 2, 0)]);
        let member = reported(0, &[(1, 7, 1, 0), (3, 7, 3, 0), (4, 7, 4, 1)]);
        assert_eq!(
            log.sources_ahead(&[(OsdId(2), member)]),
            vec![(obj(1), OsdId(2))],
            "object 0 stays this copy's; object 1 is only ahead there"
        );
        // What the member's log no longer reaches does not count against it.
        let member = reported(2, &[(3, 7, 3, 0)]);
        assert_eq!(
            log.sources_ahead(&[(OsdId(2), member)]),
            vec![(obj(0), OsdId(2))]
        );
    }

    #[test]
    fn ops_this_log_may_have_dropped_do_not_make_a_copy_ahead() {
        let mut log = PgLog::new(2);
        for seq in 1..=4 {
            log.record_replica(op_entry(seq, OpId { session: 7, seq }, 0, 4096));
        }
        // Entries 1 and 2 were trimmed here: the member's copies of them prove
        // nothing, whatever their numbering.
        let member = reported(0, &[(1, 7, 1, 0), (2, 7, 2, 0), (3, 7, 3, 0), (4, 7, 4, 0)]);
        assert!(log.sources_ahead(&[(OsdId(2), member)]).is_empty());
        // An op of a session this log trimmed through, under a seq it never saw.
        let member = reported(0, &[(9, 7, 2, 0), (3, 7, 3, 0), (4, 7, 4, 0)]);
        assert!(log.sources_ahead(&[(OsdId(2), member)]).is_empty());
        // Another session's op numbered where this log was trimmed.
        let member = reported(0, &[(2, 9, 1, 0), (3, 7, 3, 0), (4, 7, 4, 0)]);
        assert!(log.sources_ahead(&[(OsdId(2), member)]).is_empty());
        // Numbered above the trim, of a session never trimmed: ahead.
        let member = reported(0, &[(5, 9, 1, 0), (3, 7, 3, 0), (4, 7, 4, 0)]);
        assert_eq!(
            log.sources_ahead(&[(OsdId(2), member)]),
            vec![(obj(0), OsdId(2))]
        );
    }

    #[test]
    fn of_two_copies_ahead_the_one_holding_the_others_writes_is_taken() {
        let log = holding(&[(1, 7, 1, 0)]);
        let short = reported(0, &[(1, 7, 1, 0), (2, 7, 2, 0)]);
        let long = reported(0, &[(1, 7, 1, 0), (2, 7, 2, 0), (3, 7, 3, 0)]);
        assert_eq!(
            log.sources_ahead(&[(OsdId(2), short.clone()), (OsdId(3), long.clone())]),
            vec![(obj(0), OsdId(3))]
        );
        assert_eq!(
            log.sources_ahead(&[(OsdId(3), long), (OsdId(2), short.clone())]),
            vec![(obj(0), OsdId(3))]
        );
        // Ahead both, each with a write the other lacks: neither is taken.
        let other = reported(0, &[(1, 7, 1, 0), (3, 8, 1, 0)]);
        assert!(
            log.sources_ahead(&[(OsdId(2), short.clone()), (OsdId(3), other)])
                .is_empty()
        );
        // Equal: the first.
        assert_eq!(
            log.sources_ahead(&[(OsdId(3), short.clone()), (OsdId(2), short)]),
            vec![(obj(0), OsdId(3))]
        );
    }

    #[test]
    fn an_object_written_without_an_op_id_here_is_never_taken() {
        let mut log = holding(&[(1, 7, 1, 0)]);
        log.record_replica(entry(2, 0, &[]));
        let member = reported(0, &[(1, 7, 1, 0), (3, 7, 3, 0)]);
        assert!(log.sources_ahead(&[(OsdId(2), member)]).is_empty());
    }

    #[test]
    fn the_log_reports_its_client_ops_and_how_far_it_was_trimmed() {
        let mut log = PgLog::new(2);
        log.record_replica(op_entry(1, OpId { session: 7, seq: 1 }, 0, 4096));
        log.record_replica(entry(2, 3, &[]));
        log.record_replica(op_entry(3, OpId { session: 7, seq: 3 }, 0, 4096));
        assert_eq!(log.log_ops(100), reported(1, &[(3, 7, 3, 0)]));
        // Bounded: the newest only, the rest reported as trimmed.
        log.record_replica(op_entry(4, OpId { session: 7, seq: 4 }, 0, 4096));
        assert_eq!(log.log_ops(1), reported(3, &[(4, 7, 4, 0)]));
        // An op whose bytes a copy replaced is not reported.
        log.forget_proof(obj(0), 0, 0);
        assert_eq!(log.log_ops(100), reported(2, &[]));
    }

    #[test]
    fn an_op_this_copy_no_longer_provably_holds_counts_as_lacking() {
        let mut log = holding(&[(1, 7, 1, 0)]);
        let member = reported(0, &[(1, 7, 1, 0)]);
        assert!(log.sources_ahead(&[(OsdId(2), member.clone())]).is_empty());
        log.unprove_op(obj(0), OpId { session: 7, seq: 1 });
        assert_eq!(
            log.sources_ahead(&[(OsdId(2), member)]),
            vec![(obj(0), OsdId(2))]
        );
    }
}
