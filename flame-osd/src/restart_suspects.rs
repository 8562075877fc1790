//! What an OSD's restart left in doubt, and when that doubt is settled.
//!
//! A write is acknowledged once every copy *applied* it — in the page cache, not
//! yet on stable storage until a FLUSH (a disk's volatile write cache, in short).
//! A power cut takes what no FLUSH covered. At start-up the intent journal names
//! the objects such writes touched ([`crate::store::recover`]); this copy of them
//! may lack acknowledged writes that the other copies hold, so it must not be the
//! one that serves them, nor the one that peering copies over the others.
//!
//! The doubt about a group is settled in one of three ways:
//! * the manager took this copy out of the group's complete copies (the others
//!   went on without it) and a primary recovered it — recovery copies the
//!   suspects whole ([`crate::recovery`] asks for them with `PG_SUSPECTS`) — so
//!   a map that shows it *recovering* and then complete again settles it;
//! * it stayed complete (the group could not go on without it: too few other
//!   copies were up when it restarted) and it is the group's primary: before it
//!   serves, recovers or peers the group it pulls each suspect object from
//!   another complete copy up that does not suspect that object ([`settle`];
//!   `pull_suspects` in [`crate::recovery`]) — waiting, if none is up, for the
//!   complete copies that are down — then [`RestartSuspects::settled`] ends it;
//! * it stayed complete as a replica: the primary compares the suspect objects
//!   and pushes what differs, and the doubt stays here (harmless: it only costs
//!   a comparison if this copy becomes the primary later).
//!
//! Without the second rule a copy that lost writes served them one write old
//! (simulator seeds 42219 and 44034). This type makes those decisions and does
//! no I/O.
//!
//! Each object's doubt has a [`Cause`]: the machine rebooted since the write (a
//! power cut may have taken it), or only the process stopped (kill -9: the page
//! cache kept it, and start-up made it stable). When every complete copy is up
//! and in doubt, a copy that only crashed is the source for one that rebooted
//! (simulator seed 58: the primary lost power and the other copy was killed;
//! the primary kept its own bytes, a write old, and copied them over the one
//! that had kept the acknowledged write).

use flame_common::ids::{ObjectId, OsdId, PgId};
use flame_common::placement::PgMembers;
use std::collections::BTreeMap;

/// Why a copy is in doubt about an object: what may have happened to the
/// writes no FLUSH covered. Ordered: a doubt with both causes is a reboot's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Cause {
    /// Only the process stopped since the write (kill -9, a crash) — the
    /// machine did not reboot (its boot id is the same), so the page cache kept
    /// every write the process acknowledged and start-up made them stable (a
    /// writeback error stops start-up: the daemon's `syncfs`). Nothing lost; in
    /// doubt only in that a copy sure of the object is preferred.
    Crash,
    /// The machine rebooted since the write (a power cut, say), or this copy
    /// cannot tell: any block may be older than what this copy acknowledged.
    Reboot,
}

/// The doubt about one group.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Doubt {
    objects: BTreeMap<ObjectId, Cause>,
    /// A map has shown this copy recovering since the start: the next map that
    /// shows it complete comes from a primary that recovered it.
    seen_recovering: bool,
}

/// The groups (and their objects) this copy may have lost acknowledged writes of.
#[derive(Debug, Default)]
pub struct RestartSuspects {
    groups: BTreeMap<PgId, Doubt>,
}

impl RestartSuspects {
    /// The doubt recovery found at start-up, with its causes. Bounded by the
    /// record ([`crate::store::doubt_record`]).
    pub fn new(objects: &[(PgId, ObjectId, Cause)]) -> RestartSuspects {
        let mut groups: BTreeMap<PgId, Doubt> = BTreeMap::new();
        for &(pg, object, cause) in objects {
            let c = groups
                .entry(pg)
                .or_default()
                .objects
                .entry(object)
                .or_insert(cause);
            *c = (*c).max(cause);
        }
        RestartSuspects { groups }
    }

    /// Whether this copy of `pg` is in doubt (client I/O asks this per request:
    /// one lookup, in a map that is almost always empty).
    pub fn has(&self, pg: PgId) -> bool {
        self.groups.contains_key(&pg)
    }

    /// The suspect objects of `pg`, in order.
    pub fn objects(&self, pg: PgId) -> Vec<ObjectId> {
        self.groups
            .get(&pg)
            .map(|d| d.objects.keys().copied().collect())
            .unwrap_or_default()
    }

    /// The suspect objects of `pg` whose cause is `cause`, in order.
    pub fn objects_of(&self, pg: PgId, cause: Cause) -> Vec<ObjectId> {
        self.groups
            .get(&pg)
            .map(|d| {
                d.objects
                    .iter()
                    .filter(|(_, c)| **c == cause)
                    .map(|(o, _)| *o)
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The suspect objects of `pg` with their causes, in order.
    pub fn causes(&self, pg: PgId) -> Vec<(ObjectId, Cause)> {
        self.groups
            .get(&pg)
            .map(|d| d.objects.iter().map(|(o, c)| (*o, *c)).collect())
            .unwrap_or_default()
    }

    /// The groups still in doubt.
    pub fn pgs(&self) -> Vec<PgId> {
        self.groups.keys().copied().collect()
    }

    /// A new map shows `pg`'s roles as `members`: a copy seen recovering and now
    /// complete again was recovered (suspects included), so its doubt is settled.
    /// One that stayed complete throughout keeps its doubt until it pulled its
    /// suspects as primary. Returns whether the doubt was settled by this map.
    pub fn on_map(&mut self, me: OsdId, pg: PgId, members: &PgMembers) -> bool {
        let Some(doubt) = self.groups.get_mut(&pg) else {
            return false;
        };
        if members.recovering.contains(&me) {
            doubt.seen_recovering = true;
            return false;
        }
        if doubt.seen_recovering && members.acting.contains(&me) {
            self.groups.remove(&pg);
            return true;
        }
        false
    }

    /// The doubt about `pg` is over: this copy, the group's primary, replaced
    /// each suspect object by the copy of another complete member that is sure
    /// of it (or every complete copy is in doubt too), or this OSD no longer
    /// holds the group (its copy is a stray).
    pub fn settled(&mut self, pg: PgId) {
        self.groups.remove(&pg);
    }
}

/// What one other complete copy up is in doubt about itself (its answers to
/// `PG_SUSPECTS`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerDoubt {
    /// These objects (possibly none), each with its cause.
    Objects(BTreeMap<ObjectId, Cause>),
    /// More than one answer can list: in doubt about everything, as far as
    /// this copy can tell.
    TooMany,
}

/// Where a suspect object of this copy, the group's primary, is settled from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    /// From this complete copy up, which is sure of it — or, when every
    /// complete copy is up and in doubt and this one's doubt is a reboot's,
    /// which only crashed (kept what it acknowledged).
    PullFrom(OsdId),
    /// Not now: no complete copy up is sure of it, but complete copies are down
    /// and one of them may hold acknowledged writes this one lost. The group
    /// waits for them, as it waits when it has too few complete copies (an
    /// operator who knows they are gone marks them lost).
    Wait,
    /// This copy's stays: every complete copy there is is up and in doubt about
    /// it too (they all restarted; what none of them kept, no copy has), and
    /// none of them only crashed where this one rebooted.
    Keep,
}

/// Chooses where `object`, in doubt here for `mine`, is settled from: the
/// first complete copy up (in `others`' order) that is sure of it; else wait
/// while complete copies are down (`down_complete`); else, if this copy
/// rebooted, the first that only crashed (it kept every write it acknowledged:
/// seed 58); else keep this one.
pub fn settle(
    object: ObjectId,
    mine: Cause,
    others: &[(OsdId, PeerDoubt)],
    down_complete: usize,
) -> Settle {
    let first = |wanted: Option<Cause>| {
        others.iter().find_map(|(osd, d)| match d {
            PeerDoubt::Objects(o) if o.get(&object).copied() == wanted => Some(*osd),
            _ => None,
        })
    };
    if let Some(osd) = first(None) {
        return Settle::PullFrom(osd);
    }
    if down_complete > 0 {
        return Settle::Wait;
    }
    match mine {
        Cause::Reboot => first(Some(Cause::Crash)).map_or(Settle::Keep, Settle::PullFrom),
        Cause::Crash => Settle::Keep,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::ids::VolumeId;

    const ME: OsdId = OsdId(3);
    const PG: PgId = PgId(7);

    fn obj(i: u64) -> ObjectId {
        ObjectId {
            volume: VolumeId(1),
            index: i,
        }
    }

    fn members(acting: &[u32], recovering: &[u32]) -> PgMembers {
        let ids = |v: &[u32]| v.iter().map(|&i| OsdId(i)).collect::<Vec<_>>();
        PgMembers {
            placed: ids(acting).into_iter().chain(ids(recovering)).collect(),
            acting: ids(acting),
            recovering: ids(recovering),
            down_complete: Vec::new(),
            active: true,
        }
    }

    const R: Cause = Cause::Reboot;
    const C: Cause = Cause::Crash;

    #[test]
    fn start_up_doubt_is_grouped_and_answered_in_order() {
        let s = RestartSuspects::new(&[
            (PG, obj(2), C),
            (PG, obj(1), R),
            (PgId(1), obj(9), C),
            // Named twice: a reboot's doubt wins.
            (PG, obj(2), R),
            (PG, obj(3), C),
        ]);
        assert!(s.has(PG) && s.has(PgId(1)) && !s.has(PgId(2)));
        assert_eq!(s.objects(PG), vec![obj(1), obj(2), obj(3)]);
        assert_eq!(s.objects_of(PG, R), vec![obj(1), obj(2)]);
        assert_eq!(s.objects_of(PG, C), vec![obj(3)]);
        assert_eq!(s.causes(PgId(1)), vec![(obj(9), C)]);
        assert_eq!(s.pgs(), vec![PgId(1), PG]);
        assert!(!RestartSuspects::new(&[]).has(PG));
    }

    /// The copy the group could not go on without never leaves the complete
    /// copies: no map settles its doubt, only its own pull (seeds 42219, 44034).
    #[test]
    fn a_copy_that_stayed_complete_keeps_its_doubt_until_it_pulled() {
        let mut s = RestartSuspects::new(&[(PG, obj(1), R)]);
        assert!(!s.on_map(ME, PG, &members(&[3, 1], &[])));
        assert!(!s.on_map(ME, PG, &members(&[1, 3], &[])));
        assert!(s.has(PG));
        s.settled(PG);
        assert!(!s.has(PG));
        assert!(s.pgs().is_empty());
    }

    /// Taken out and recovered: the primary copied the suspects whole.
    #[test]
    fn recovering_then_complete_settles_the_doubt() {
        let mut s = RestartSuspects::new(&[(PG, obj(1), R), (PgId(1), obj(2), C)]);
        assert!(!s.on_map(ME, PG, &members(&[1], &[3])));
        assert!(s.has(PG), "still answered to the primary that recovers it");
        // Another group's map does not touch this one.
        assert!(!s.on_map(ME, PgId(1), &members(&[1, 3], &[])));
        assert!(s.on_map(ME, PG, &members(&[1, 3], &[])));
        assert!(!s.has(PG));
        assert!(s.has(PgId(1)));
        // Nothing left to settle.
        assert!(!s.on_map(ME, PG, &members(&[1, 3], &[])));
    }

    fn doubt(v: &[(u64, Cause)]) -> PeerDoubt {
        PeerDoubt::Objects(v.iter().map(|&(i, c)| (obj(i), c)).collect())
    }

    #[test]
    fn a_suspect_is_pulled_from_a_copy_that_is_sure_of_it_or_waits_for_one() {
        let others = vec![
            (OsdId(1), doubt(&[(1, R)])),
            (OsdId(2), PeerDoubt::TooMany),
            (OsdId(4), doubt(&[])),
        ];
        // osd.1 suspects obj(1) too; osd.2 can tell nothing: osd.4.
        assert_eq!(settle(obj(1), R, &others, 0), Settle::PullFrom(OsdId(4)));
        assert_eq!(settle(obj(2), R, &others, 1), Settle::PullFrom(OsdId(1)));
        // A copy sure of it beats one that only crashed, whatever this one's cause.
        let crashed_first = vec![(OsdId(1), doubt(&[(1, C)])), (OsdId(4), doubt(&[]))];
        assert_eq!(
            settle(obj(1), R, &crashed_first, 0),
            Settle::PullFrom(OsdId(4))
        );
        assert_eq!(
            settle(obj(1), C, &crashed_first, 0),
            Settle::PullFrom(OsdId(4))
        );
        // Nobody up is sure. A complete copy down may hold the lost writes
        // (simulator seed 44034: the only complete copy up had restarted).
        let unsure = vec![(OsdId(1), doubt(&[(1, R)])), (OsdId(2), PeerDoubt::TooMany)];
        assert_eq!(settle(obj(1), R, &unsure, 1), Settle::Wait);
        assert_eq!(settle(obj(1), R, &[], 2), Settle::Wait);
        // Every complete copy is up and in doubt, or this is the only one.
        assert_eq!(settle(obj(1), R, &unsure, 0), Settle::Keep);
        assert_eq!(settle(obj(1), C, &unsure, 0), Settle::Keep);
        assert_eq!(settle(obj(1), R, &[], 0), Settle::Keep);
    }

    /// Seed 58: every complete copy up and in doubt; this one (the primary)
    /// lost power, another was only killed and kept the acknowledged write.
    /// That one is the source; one that crashed too keeps its own.
    #[test]
    fn among_copies_all_in_doubt_one_that_only_crashed_is_the_source() {
        let others = vec![
            (OsdId(1), doubt(&[(1, R), (2, R)])),
            (OsdId(2), PeerDoubt::TooMany),
            (OsdId(4), doubt(&[(1, C), (2, R)])),
        ];
        assert_eq!(settle(obj(1), R, &others, 0), Settle::PullFrom(OsdId(4)));
        // Every copy rebooted: none kept more than another.
        assert_eq!(settle(obj(2), R, &others, 0), Settle::Keep);
        // This copy only crashed: it kept what it acknowledged.
        assert_eq!(settle(obj(1), C, &others, 0), Settle::Keep);
        assert_eq!(settle(obj(2), C, &others, 0), Settle::Keep);
        // Complete copies down: they may be sure of it; wait as before.
        assert_eq!(settle(obj(1), R, &others, 1), Settle::Wait);
    }

    /// Recovering, then down again (not in acting): still in doubt.
    #[test]
    fn recovering_then_gone_keeps_the_doubt() {
        let mut s = RestartSuspects::new(&[(PG, obj(1), R)]);
        s.on_map(ME, PG, &members(&[1], &[3]));
        assert!(!s.on_map(ME, PG, &members(&[1], &[])));
        assert!(s.has(PG));
        s.settled(PG);
        assert!(!s.has(PG));
    }
}
