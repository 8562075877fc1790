//! What one recovery pass does for one placement group its shard is the
//! primary of, decided without I/O: [`GroupPass`] hands out the next step from
//! a fresh snapshot of the group ([`GroupFacts`]) and is told each step's
//! outcome; the async pass in [`crate::recovery`] runs the steps.
//!
//! The order, and why:
//! 1. **This copy's own restart doubt** ([`Step::SettleOwnDoubt`]): nothing is
//!    served, peered or recovered from a copy that may lack acknowledged writes
//!    until the other complete copies settled it. If that fails, the pass stops
//!    for this group (it is retried after a delay).
//! 2. **Peering**, once per primacy: the newest copy first
//!    ([`Step::TakeNewerCopies`]), then every other complete copy compared with
//!    this one ([`Step::PeerWith`]). If taking the newest copy failed, no member
//!    is compared (the pushes would overwrite newer bytes). Only when every
//!    comparison succeeded is the group peered ([`Step::MarkPeered`]), which
//!    also settles every compared member's restart doubt.
//! 3. **Complete members' restart doubt** ([`Step::CompareDoubt`]), once per
//!    incarnation: a copy that restarted and stayed complete may lack writes
//!    its power cut took.
//! 4. **Recovering members** ([`Step::Recover`]); a member already reported
//!    recovered waits for the map, and its report is sent again
//!    ([`Step::ResendReport`]) when the map still shows it recovering long
//!    after.
//! 5. **Complete members lagging** behind writes they failed
//!    ([`Step::CatchUp`]), after a grace (the client's retry usually repairs
//!    them first): [`Step::StartLagClock`] and [`Step::ClearLagClock`] keep
//!    the time each has lagged.
//!
//! Any failed step but the first lets the pass go on with the other members
//! and makes the group retry after a delay ([`GroupPass::failed`]).

use flame_common::ids::{Epoch, OsdId};
use std::time::Duration;

/// A complete member other than the primary, as the pass sees it now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReplicaFacts {
    pub osd: OsdId,
    /// Its incarnation (`up_from`) in the map; `None`: not in the map.
    pub up_from: Option<Epoch>,
    /// The incarnation whose restart doubt this primary compared last.
    pub doubt_compared: Option<Epoch>,
    /// The group's log says it failed writes the other copies applied.
    pub lagging: bool,
    /// How long it has been seen lagging (`None`: the clock is not running).
    pub lagging_for: Option<Duration>,
}

/// A member being recovered, as the pass sees it now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RecoveringFacts {
    pub osd: OsdId,
    /// Its incarnation in the map; `None`: not in the map.
    pub up_from: Option<Epoch>,
    /// Reported recovered: for which incarnation, and how long ago.
    pub reported: Option<(Epoch, Duration)>,
}

/// The group as the pass sees it before each step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct GroupFacts {
    /// This copy's restart left objects of the group in doubt.
    pub in_doubt: bool,
    /// Peering compared every complete copy under the current primacy.
    pub peered: bool,
    /// The complete members but the primary, in acting order.
    pub replicas: Vec<ReplicaFacts>,
    /// The members being recovered.
    pub recovering: Vec<RecoveringFacts>,
}

/// The pass's timings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PassTimings {
    /// A report the map has not caught up with after this long is sent again.
    pub report_retry: Duration,
    /// A complete member lagging this long is caught up by the primary.
    pub lagging_grace: Duration,
}

/// One thing the pass does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    SettleOwnDoubt,
    TakeNewerCopies,
    /// Compare (backfill) this complete member's copy with this one, under
    /// incarnation `up_from`.
    PeerWith(OsdId, Epoch),
    /// Every comparison succeeded: record the group peered and every compared
    /// member's doubt settled.
    MarkPeered,
    CompareDoubt(OsdId, Epoch),
    Recover(OsdId, Epoch),
    ResendReport(OsdId, Epoch),
    StartLagClock(OsdId),
    ClearLagClock(OsdId),
    /// Stop the member's lag clock and catch it up from the log.
    CatchUp(OsdId),
}

/// How a step ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Done,
    /// The roles it was planned under changed: nothing to retry for it.
    Abandoned,
    /// A member or the local store failed: retry the group later.
    Failed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Phase {
    OwnDoubt,
    Peering,
    Doubts,
    Recovering,
    Lagging,
    Done,
}

/// One group's pass: which steps were handed out, and whether any failed.
#[derive(Debug)]
pub(crate) struct GroupPass {
    timings: PassTimings,
    phase: Phase,
    /// Members the current phase has handed a step for (or skipped).
    seen: Vec<OsdId>,
    took_newer: bool,
    /// Taking the newest copy failed: no member is compared.
    newest_failed: bool,
    /// Some step of peering failed: the group is not peered.
    peering_ok: bool,
    failed: bool,
    /// Steps handed out; bounds the pass (each member gets at most one step
    /// per phase).
    steps: u32,
}

impl GroupPass {
    pub(crate) fn new(timings: PassTimings) -> GroupPass {
        GroupPass {
            timings,
            phase: Phase::OwnDoubt,
            seen: Vec::new(),
            took_newer: false,
            newest_failed: false,
            peering_ok: true,
            failed: false,
            steps: 0,
        }
    }

    /// Some step failed: the group is retried after a delay.
    pub(crate) fn failed(&self) -> bool {
        self.failed
    }

    fn enter(&mut self, phase: Phase) {
        debug_assert!(phase > self.phase, "phases only move on");
        self.phase = phase;
        self.seen.clear();
    }

    /// The next step given the group as it is now; `None`: the pass is over
    /// for this group.
    pub(crate) fn next(&mut self, facts: &GroupFacts) -> Option<Step> {
        // Each phase hands out at most one step per member, and the peering
        // phase two more: a bound the loop below cannot exceed.
        let bound = 4 * (facts.replicas.len() + facts.recovering.len()) as u32 + 8;
        if self.steps > bound {
            debug_assert!(false, "a group's pass is bounded");
            return None;
        }
        let step = self.pick(facts);
        self.steps += u32::from(step.is_some());
        step
    }

    fn pick(&mut self, facts: &GroupFacts) -> Option<Step> {
        loop {
            match self.phase {
                Phase::OwnDoubt => {
                    self.enter(Phase::Peering);
                    if facts.in_doubt {
                        return Some(Step::SettleOwnDoubt);
                    }
                }
                Phase::Peering => {
                    if facts.peered {
                        self.enter(Phase::Doubts);
                        continue;
                    }
                    if !self.took_newer {
                        self.took_newer = true;
                        return Some(Step::TakeNewerCopies);
                    }
                    if !self.newest_failed
                        && let Some(r) = self.unseen_replica(facts)
                    {
                        self.seen.push(r.osd);
                        if let Some(up_from) = r.up_from {
                            return Some(Step::PeerWith(r.osd, up_from));
                        }
                        continue;
                    }
                    self.enter(Phase::Doubts);
                    if self.peering_ok {
                        return Some(Step::MarkPeered);
                    }
                    self.failed = true;
                }
                Phase::Doubts => {
                    let Some(r) = self.unseen_replica(facts) else {
                        self.enter(Phase::Recovering);
                        continue;
                    };
                    self.seen.push(r.osd);
                    if let Some(up_from) = r.up_from
                        && r.doubt_compared != Some(up_from)
                    {
                        return Some(Step::CompareDoubt(r.osd, up_from));
                    }
                }
                Phase::Recovering => {
                    let Some(m) = facts
                        .recovering
                        .iter()
                        .find(|m| !self.seen.contains(&m.osd))
                        .copied()
                    else {
                        self.enter(Phase::Lagging);
                        continue;
                    };
                    self.seen.push(m.osd);
                    let Some(up_from) = m.up_from else {
                        continue;
                    };
                    match m.reported {
                        Some((reported, ago)) if reported == up_from => {
                            if ago >= self.timings.report_retry {
                                return Some(Step::ResendReport(m.osd, up_from));
                            }
                        }
                        _ => return Some(Step::Recover(m.osd, up_from)),
                    }
                }
                Phase::Lagging => {
                    let Some(r) = self.unseen_replica(facts) else {
                        self.enter(Phase::Done);
                        continue;
                    };
                    self.seen.push(r.osd);
                    match (r.lagging, r.lagging_for) {
                        (false, Some(_)) => return Some(Step::ClearLagClock(r.osd)),
                        (false, None) => {}
                        (true, None) => return Some(Step::StartLagClock(r.osd)),
                        (true, Some(d)) if d >= self.timings.lagging_grace => {
                            return Some(Step::CatchUp(r.osd));
                        }
                        (true, Some(_)) => {}
                    }
                }
                Phase::Done => return None,
            }
        }
    }

    fn unseen_replica(&self, facts: &GroupFacts) -> Option<ReplicaFacts> {
        facts
            .replicas
            .iter()
            .find(|r| !self.seen.contains(&r.osd))
            .copied()
    }

    /// How `step` ended.
    pub(crate) fn record(&mut self, step: Step, outcome: Outcome) {
        match (step, outcome) {
            (Step::SettleOwnDoubt, Outcome::Done) => {}
            (Step::SettleOwnDoubt, _) => {
                self.failed = true;
                self.phase = Phase::Done;
            }
            (Step::TakeNewerCopies | Step::PeerWith(..), Outcome::Done) => {}
            (Step::TakeNewerCopies, _) => {
                self.newest_failed = true;
                self.peering_ok = false;
            }
            (Step::PeerWith(..), _) => self.peering_ok = false,
            (_, Outcome::Failed) => self.failed = true,
            (_, Outcome::Done | Outcome::Abandoned) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: PassTimings = PassTimings {
        report_retry: Duration::from_secs(3),
        lagging_grace: Duration::from_secs(8),
    };
    const A: OsdId = OsdId(1);
    const B: OsdId = OsdId(2);
    const C: OsdId = OsdId(3);
    const E: Epoch = Epoch(7);

    fn replica(osd: OsdId) -> ReplicaFacts {
        ReplicaFacts {
            osd,
            up_from: Some(E),
            doubt_compared: Some(E),
            lagging: false,
            lagging_for: None,
        }
    }

    fn recovering(osd: OsdId) -> RecoveringFacts {
        RecoveringFacts {
            osd,
            up_from: Some(E),
            reported: None,
        }
    }

    fn peered(replicas: Vec<ReplicaFacts>) -> GroupFacts {
        GroupFacts {
            peered: true,
            replicas,
            ..GroupFacts::default()
        }
    }

    /// Runs a pass to its end on fixed facts, every step ending with
    /// `outcome(step)`: the steps and whether the group is retried.
    fn run(facts: &GroupFacts, outcome: impl Fn(Step) -> Outcome) -> (Vec<Step>, bool) {
        let mut pass = GroupPass::new(T);
        let mut steps = Vec::new();
        while let Some(s) = pass.next(facts) {
            steps.push(s);
            pass.record(s, outcome(s));
        }
        (steps, pass.failed())
    }

    fn done(_: Step) -> Outcome {
        Outcome::Done
    }

    #[test]
    fn a_clean_peered_group_has_nothing_to_do() {
        assert_eq!(
            run(&peered(vec![replica(A), replica(B)]), done),
            (vec![], false)
        );
        assert_eq!(
            run(
                &GroupFacts {
                    peered: true,
                    ..Default::default()
                },
                done
            ),
            (vec![], false)
        );
    }

    #[test]
    fn its_own_doubt_comes_first_and_a_failure_ends_the_pass() {
        let mut f = GroupFacts {
            in_doubt: true,
            replicas: vec![replica(A)],
            recovering: vec![recovering(B)],
            ..GroupFacts::default()
        };
        let (steps, failed) = run(&f, |_| Outcome::Failed);
        assert_eq!((steps, failed), (vec![Step::SettleOwnDoubt], true));
        f.peered = true;
        let (steps, failed) = run(&f, done);
        assert_eq!(steps, vec![Step::SettleOwnDoubt, Step::Recover(B, E)]);
        assert!(!failed);
    }

    #[test]
    fn peering_takes_the_newest_copy_then_compares_every_replica_in_the_map() {
        let mut gone = replica(C);
        gone.up_from = None;
        let f = GroupFacts {
            replicas: vec![replica(A), gone, replica(B)],
            ..GroupFacts::default()
        };
        let (steps, failed) = run(&f, done);
        assert_eq!(
            steps,
            vec![
                Step::TakeNewerCopies,
                Step::PeerWith(A, E),
                Step::PeerWith(B, E),
                Step::MarkPeered,
            ]
        );
        assert!(!failed);
        // Alone in the group: peered at once.
        let (steps, _) = run(&GroupFacts::default(), done);
        assert_eq!(steps, vec![Step::TakeNewerCopies, Step::MarkPeered]);
    }

    #[test]
    fn no_member_is_compared_when_the_newest_copy_was_not_taken() {
        let f = GroupFacts {
            replicas: vec![replica(A)],
            recovering: vec![recovering(B)],
            ..GroupFacts::default()
        };
        let (steps, failed) = run(&f, |s| {
            if s == Step::TakeNewerCopies {
                Outcome::Failed
            } else {
                Outcome::Done
            }
        });
        // Recovery still goes on; the group is not peered and retried.
        assert_eq!(steps, vec![Step::TakeNewerCopies, Step::Recover(B, E)]);
        assert!(failed);
    }

    #[test]
    fn one_failed_comparison_leaves_the_group_unpeered_but_compares_the_rest() {
        let f = GroupFacts {
            replicas: vec![replica(A), replica(B)],
            ..GroupFacts::default()
        };
        for bad in [Outcome::Failed, Outcome::Abandoned] {
            let (steps, failed) = run(&f, |s| {
                if s == Step::PeerWith(A, E) {
                    bad
                } else {
                    Outcome::Done
                }
            });
            assert_eq!(
                steps,
                vec![
                    Step::TakeNewerCopies,
                    Step::PeerWith(A, E),
                    Step::PeerWith(B, E)
                ]
            );
            assert!(failed, "{bad:?}");
        }
    }

    #[test]
    fn a_restarted_replicas_doubt_is_compared_once_per_incarnation() {
        let mut r = replica(A);
        r.doubt_compared = Some(Epoch(3));
        let mut gone = replica(B);
        gone.up_from = None;
        gone.doubt_compared = None;
        let (steps, failed) = run(&peered(vec![r, gone]), done);
        assert_eq!((steps, failed), (vec![Step::CompareDoubt(A, E)], false));
        // Compared: nothing.
        r.doubt_compared = Some(E);
        assert_eq!(run(&peered(vec![r]), done).0, vec![]);
        // Abandoned is not a failure; failed is.
        r.doubt_compared = None;
        assert!(!run(&peered(vec![r]), |_| Outcome::Abandoned).1);
        assert!(run(&peered(vec![r]), |_| Outcome::Failed).1);
    }

    #[test]
    fn a_peering_of_this_pass_settles_the_doubt_its_snapshot_shows() {
        // The executor records the doubt compared when it marks the group
        // peered; the next snapshot shows it, and no comparison follows.
        let mut r = replica(A);
        r.doubt_compared = None;
        let mut facts = GroupFacts {
            replicas: vec![r],
            ..GroupFacts::default()
        };
        let mut pass = GroupPass::new(T);
        let mut steps = Vec::new();
        while let Some(s) = pass.next(&facts) {
            steps.push(s);
            if s == Step::MarkPeered {
                facts.peered = true;
                facts.replicas[0].doubt_compared = Some(E);
            }
            pass.record(s, Outcome::Done);
        }
        assert_eq!(
            steps,
            vec![
                Step::TakeNewerCopies,
                Step::PeerWith(A, E),
                Step::MarkPeered
            ]
        );
    }

    #[test]
    fn a_reported_member_waits_for_the_map_and_its_report_is_resent_late() {
        let mut m = recovering(B);
        m.reported = Some((E, Duration::from_secs(1)));
        let f = |m| GroupFacts {
            peered: true,
            recovering: vec![m],
            ..GroupFacts::default()
        };
        assert_eq!(run(&f(m), done).0, vec![]);
        m.reported = Some((E, Duration::from_secs(3)));
        assert_eq!(run(&f(m), done).0, vec![Step::ResendReport(B, E)]);
        // Reported for an earlier incarnation: it restarted, recover it again.
        m.reported = Some((Epoch(2), Duration::from_secs(1)));
        assert_eq!(run(&f(m), done).0, vec![Step::Recover(B, E)]);
        // Not in the map: nothing.
        m.up_from = None;
        assert_eq!(run(&f(m), done).0, vec![]);
        // A failed recovery retries the group; an abandoned one does not.
        let (_, failed) = run(&f(recovering(B)), |_| Outcome::Failed);
        assert!(failed);
        let (_, failed) = run(&f(recovering(B)), |_| Outcome::Abandoned);
        assert!(!failed);
    }

    #[test]
    fn a_lagging_replica_is_caught_up_after_the_grace_and_its_clock_kept() {
        let lag = |lagging, lagging_for| ReplicaFacts {
            lagging,
            lagging_for,
            ..replica(A)
        };
        let s = |r| run(&peered(vec![r]), done).0;
        assert_eq!(s(lag(true, None)), vec![Step::StartLagClock(A)]);
        assert_eq!(s(lag(true, Some(Duration::from_secs(7)))), vec![]);
        assert_eq!(
            s(lag(true, Some(Duration::from_secs(8)))),
            vec![Step::CatchUp(A)]
        );
        assert_eq!(
            s(lag(false, Some(Duration::from_secs(9)))),
            vec![Step::ClearLagClock(A)]
        );
        assert_eq!(s(lag(false, None)), vec![]);
        let (_, failed) = run(&peered(vec![lag(true, Some(T.lagging_grace))]), |_| {
            Outcome::Failed
        });
        assert!(failed);
    }

    #[test]
    fn the_phases_come_in_order_for_every_member() {
        let mut a = replica(A);
        a.doubt_compared = None;
        a.lagging = true;
        a.lagging_for = Some(Duration::from_secs(60));
        let f = GroupFacts {
            in_doubt: true,
            peered: false,
            replicas: vec![a],
            recovering: vec![recovering(C)],
        };
        let (steps, failed) = run(&f, done);
        assert_eq!(
            steps,
            vec![
                Step::SettleOwnDoubt,
                Step::TakeNewerCopies,
                Step::PeerWith(A, E),
                Step::MarkPeered,
                // The snapshot (fixed here) still shows its doubt.
                Step::CompareDoubt(A, E),
                Step::Recover(C, E),
                Step::CatchUp(A),
            ]
        );
        assert!(!failed);
    }
}
