//! What the manager shows about placement groups and recovery: each group's state
//! (`GET /v1/pgs`), counts by state (status, metrics, health), and recovery
//! progress, rate and ETA from the OSDs' heartbeats.
//!
//! Pure logic like [`crate::state`]: the PG part is a function of the map (through
//! [`PgTable`], cached per epoch by [`crate::shared::Shared`]); the recovery part
//! is a [`RecoveryTracker`] fed by heartbeats with the time passed in, so both are
//! unit-tested without a server or a clock.

use flame_common::ids::{OsdId, PgId};
use flame_common::map::ClusterMap;
use flame_common::mgr_api::{
    PgStatus, PgSummary, RECOVERY_RATE_WINDOW_S, RecoveryProgress, RecoverySummary,
};
use flame_common::pg_state::PgState;
use flame_common::placement::{PgMembers, PgTable};
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// The `GET /v1/pgs/{id}` entry of `pg`, `None` past the pool's last group.
pub fn pg_status(table: &PgTable, map: &ClusterMap, pg: PgId) -> Option<PgStatus> {
    (pg.0 < table.pg_count()).then(|| entry(map, pg, table.pg(pg)))
}

/// Every group's entry, by number (`GET /v1/pgs`).
pub fn pg_statuses(table: &PgTable, map: &ClusterMap) -> Vec<PgStatus> {
    table.iter().map(|(pg, m)| entry(map, pg, m)).collect()
}

fn entry(map: &ClusterMap, pg: PgId, m: &PgMembers) -> PgStatus {
    PgStatus {
        pg,
        state: PgState::of(m, &map.pool).to_string(),
        epoch: map.epoch,
        placed: m.placed.clone(),
        acting: m.acting.clone(),
        primary: m.primary(),
        recovering: m.recovering.clone(),
        down_complete: m.down_complete.clone(),
    }
}

/// Counts of groups by state string and by flag.
pub fn summarize(table: &PgTable, map: &ClusterMap) -> (BTreeMap<String, u32>, PgSummary) {
    let mut by_state: BTreeMap<String, u32> = BTreeMap::new();
    let mut sum = PgSummary::default();
    for (_, m) in table.iter() {
        let s = PgState::of(m, &map.pool);
        *by_state.entry(s.to_string()).or_default() += 1;
        sum.total += 1;
        sum.active += u32::from(s.active);
        sum.clean += u32::from(s.clean);
        sum.degraded += u32::from(s.degraded);
        sum.recovering += u32::from(s.recovering);
        sum.remapped += u32::from(s.remapped);
        sum.inactive += u32::from(!s.active);
        sum.incomplete += u32::from(s.incomplete);
    }
    (by_state, sum)
}

/// Example groups named per kind in a health line; the count says how many more.
const DETAIL_PGS_MAX: usize = 5;

fn osd_list(ids: &[OsdId]) -> String {
    if ids.is_empty() {
        return "none".into();
    }
    ids.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Health lines about placement groups, one per kind of problem with the count,
/// saying what happens to I/O:
///
/// * `errors`: groups whose I/O waits (inactive: below `min_size`; incomplete: no
///   complete copy up);
/// * `warnings`: groups with less redundancy than asked for or data still moving
///   (degraded, recovering, remapped), whose I/O goes on;
/// * `examples`: one line per kind naming a few groups and the OSDs involved
///   (`degraded placement groups: pg.3 (acting osd.0, osd.2), ...`), kept apart so
///   the count lines stay short and stable;
/// * per group, whether its I/O waits (for the per-volume detail).
pub struct PgHealth {
    /// Lines that make health ERR.
    pub errors: Vec<String>,
    /// Lines that make health WARN.
    pub warnings: Vec<String>,
    /// Example groups per kind.
    pub examples: Vec<String>,
    /// Per group number: its I/O waits.
    pub io_waits: Vec<bool>,
}

/// Computes [`PgHealth`] for every group of `table`.
pub fn pg_health(table: &PgTable, map: &ClusterMap) -> PgHealth {
    let pool = &map.pool;
    let total = table.pg_count();
    let mut inactive = Vec::new();
    let mut incomplete = Vec::new();
    let mut degraded = Vec::new();
    let mut recovering = Vec::new();
    let mut remapped = Vec::new();
    let mut io_waits = Vec::with_capacity(total as usize);
    for (pg, m) in table.iter() {
        let s = PgState::of(m, pool);
        io_waits.push(s.io_waits());
        if s.incomplete {
            incomplete.push((pg, m));
        } else if !s.active {
            inactive.push((pg, m));
        } else if s.degraded {
            degraded.push((pg, m));
        }
        if s.active && s.recovering {
            recovering.push((pg, m));
        }
        if s.active && s.remapped {
            remapped.push((pg, m));
        }
    }
    let mut examples = Vec::new();
    let mut example =
        |kind: &str, list: &[(PgId, &PgMembers)], show: &dyn Fn(&PgMembers) -> String| {
            if list.is_empty() {
                return;
            }
            let mut parts: Vec<String> = list
                .iter()
                .take(DETAIL_PGS_MAX)
                .map(|(pg, m)| format!("{pg} ({})", show(m)))
                .collect();
            if list.len() > DETAIL_PGS_MAX {
                parts.push(format!("and {} more", list.len() - DETAIL_PGS_MAX));
            }
            examples.push(format!("{kind} placement groups: {}", parts.join(", ")));
        };
    example("inactive", &inactive, &|m| {
        format!(
            "acting {}; waiting for {}",
            osd_list(&m.acting),
            osd_list(&m.down_complete)
        )
    });
    example("incomplete", &incomplete, &|m| {
        if m.down_complete.is_empty() {
            "no OSD holds it".to_string()
        } else {
            format!(
                "complete copies on {}, all down",
                osd_list(&m.down_complete)
            )
        }
    });
    example("degraded", &degraded, &|m| {
        format!("acting {}", osd_list(&m.acting))
    });
    example("recovering", &recovering, &|m| {
        format!(
            "{} from {}",
            osd_list(&m.recovering),
            m.primary().map_or_else(|| "?".into(), |p| p.to_string())
        )
    });
    example("remapped", &remapped, &|m| {
        format!(
            "placed {}; acting {}",
            osd_list(&m.placed),
            osd_list(&m.acting)
        )
    });
    let groups = |n: usize, verb_one: &str, verb_many: &str| {
        if n == 1 {
            format!("1 of {total} placement groups {verb_one}")
        } else {
            format!("{n} of {total} placement groups {verb_many}")
        }
    };
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    if !inactive.is_empty() {
        errors.push(format!(
            "{} fewer than pool.min_size {} complete copies up: I/O to them waits (no \
             error, no stale data) until enough copies are back up (inactive)",
            groups(inactive.len(), "has", "have"),
            pool.min_size,
        ));
    }
    if !incomplete.is_empty() {
        errors.push(format!(
            "{} no complete copy up: I/O to them waits until one is back (incomplete)",
            groups(incomplete.len(), "has", "have"),
        ));
    }
    if !degraded.is_empty() {
        warnings.push(format!(
            "{} degraded (fewer than pool.size {} complete copies up): I/O goes on with \
             the copies that are up",
            groups(degraded.len(), "is", "are"),
            pool.size,
        ));
    }
    if !recovering.is_empty() {
        warnings.push(format!(
            "{} recovering: their primary copies what the recovering members missed \
             (they already get every new write); I/O goes on",
            groups(recovering.len(), "is", "are"),
        ));
    }
    if !remapped.is_empty() {
        warnings.push(format!(
            "{} remapped: complete copies are on OSDs placement no longer chooses \
             (misplaced data); they serve until the new members are complete, then are \
             removed; I/O goes on",
            groups(remapped.len(), "is", "are"),
        ));
    }
    PgHealth {
        errors,
        warnings,
        examples,
        io_waits,
    }
}

/// Most rate samples kept (one per [`SAMPLE_SPACING`] at most): bounds memory and
/// the cost of cloning the state on every commit.
const SAMPLES_MAX: usize = 64;
/// Least time between two rate samples.
const SAMPLE_SPACING: Duration = Duration::from_secs(1);

/// One point of the cluster's cumulative recovery counters.
#[derive(Clone, Copy, Debug)]
struct Sample {
    at: Instant,
    objects: u64,
    bytes: u64,
}

/// The latest report of one OSD.
#[derive(Clone, Debug)]
struct OsdReport {
    progress: RecoveryProgress,
}

/// Recovery figures from heartbeats: the latest report per OSD, and cumulative
/// cluster counters sampled over time for the rate.
///
/// OSD counters restart at 0 when the OSD restarts; the tracker adds up each
/// OSD's *increases* between heartbeats (a decrease counts as a restart: the new
/// value is what it did since), so the cluster counters only ever grow and the
/// rate never goes negative. The first report of an OSD after the manager starts
/// adds nothing (what it did before is not part of any rate the manager saw).
#[derive(Clone, Debug, Default)]
pub struct RecoveryTracker {
    osds: BTreeMap<OsdId, OsdReport>,
    /// Objects and bytes recovered cluster-wide since the manager started.
    objects: u64,
    bytes: u64,
    /// `objects`/`bytes` when the current recovery began.
    episode_objects: u64,
    episode_bytes: u64,
    /// Whether no up OSD reported recovery work (objects left or recovering
    /// groups) at the last report.
    idle: bool,
    /// When the current recovery began (`None`: none since the manager started).
    episode_at: Option<Instant>,
    samples: VecDeque<Sample>,
    last_report: Option<Instant>,
    /// Objects per group, as its primary last reported them. Kept when the
    /// primary goes down (the group's objects did not go away), replaced by the
    /// next primary's count.
    pg_objects: BTreeMap<PgId, u64>,
}

impl RecoveryTracker {
    /// A tracker with no reports.
    pub fn new() -> RecoveryTracker {
        RecoveryTracker {
            idle: true,
            ..Default::default()
        }
    }

    /// Records OSD `id`'s heartbeat figures (`None`: it reports none) at `now`.
    /// `map` is the current map: only up OSDs count toward what is left, and OSDs
    /// no longer in it are forgotten.
    pub fn record(
        &mut self,
        id: OsdId,
        progress: Option<&RecoveryProgress>,
        map: &ClusterMap,
        now: Instant,
    ) {
        self.osds.retain(|o, _| map.osds.contains_key(o));
        match progress {
            None => {
                self.osds.remove(&id);
            }
            Some(p) => {
                let pg_count = map.pool.pg_count;
                // Bounded by the pool: a longer list is not from a sane OSD.
                if p.pg_objects.len() <= pg_count as usize {
                    for &(pg, n) in &p.pg_objects {
                        if pg.0 < pg_count {
                            self.pg_objects.insert(pg, n);
                        }
                    }
                }
                let before = (self.objects, self.bytes);
                if let Some(prev) = self.osds.get(&id) {
                    let grew = |new: u64, old: u64| if new >= old { new - old } else { new };
                    self.objects = self.objects.saturating_add(grew(
                        p.objects_recovered_total,
                        prev.progress.objects_recovered_total,
                    ));
                    self.bytes = self.bytes.saturating_add(grew(
                        p.bytes_recovered_total,
                        prev.progress.bytes_recovered_total,
                    ));
                }
                self.osds.insert(
                    id,
                    OsdReport {
                        progress: p.clone(),
                    },
                );
                let busy = self.busy(map);
                let grew = self.objects > before.0;
                if self.idle && (busy || grew) {
                    // A recovery begins: progress counts from the report that
                    // showed work (including what that report recovered). A
                    // recovery over before any report showed work left still
                    // starts a new count rather than adding to the last one.
                    (self.episode_objects, self.episode_bytes) = before;
                    self.episode_at = Some(now);
                }
                self.idle = !busy;
            }
        }
        self.last_report = Some(now);
        let due = self
            .samples
            .back()
            .is_none_or(|s| now.saturating_duration_since(s.at) >= SAMPLE_SPACING);
        let sample = Sample {
            at: now,
            objects: self.objects,
            bytes: self.bytes,
        };
        match self.samples.back_mut() {
            // Several OSDs report in one instant (a test's clock, or a burst):
            // the sample holds all of them.
            Some(last) if last.at == now => *last = sample,
            _ if due => self.samples.push_back(sample),
            _ => {}
        }
        let window = Duration::from_secs(RECOVERY_RATE_WINDOW_S);
        while self.samples.len() > SAMPLES_MAX
            || self.samples.len() > 1
                && self
                    .samples
                    .get(1)
                    .is_some_and(|s| now.saturating_duration_since(s.at) > window)
        {
            self.samples.pop_front();
        }
        debug_assert!(self.samples.len() <= SAMPLES_MAX);
    }

    /// Whether some up OSD reports recovery work: objects left, or groups
    /// recovering (whether or not it could estimate them).
    fn busy(&self, map: &ClusterMap) -> bool {
        self.osds
            .iter()
            .filter(|(id, _)| map.osds.get(id).is_some_and(|o| o.up))
            .any(|(_, r)| r.progress.objects_to_recover > 0 || r.progress.pgs_recovering > 0)
    }

    /// The object-copy figures of [`RecoverySummary`]: each group's reported
    /// object count times the copies it lacks (`size` − acting), keeps outside the
    /// placed set (acting members placement no longer chooses) and is making
    /// (recovering members).
    fn object_figures(&self, table: &PgTable, map: &ClusterMap, s: &mut RecoverySummary) {
        let size = map.pool.size as usize;
        for (pg, m) in table.iter() {
            let Some(&n) = self.pg_objects.get(&pg) else {
                s.pgs_uncounted += 1;
                continue;
            };
            let missing = size.saturating_sub(m.acting.len()) as u64;
            let misplaced = m.acting.iter().filter(|id| !m.placed.contains(id)).count() as u64;
            let recovering = m.recovering.len() as u64;
            s.objects = s.objects.saturating_add(n);
            s.degraded_copies = s.degraded_copies.saturating_add(n.saturating_mul(missing));
            s.misplaced_copies = s
                .misplaced_copies
                .saturating_add(n.saturating_mul(misplaced));
            s.recovering_copies = s
                .recovering_copies
                .saturating_add(n.saturating_mul(recovering));
        }
        s.object_copies = s.objects.saturating_mul(size as u64);
    }

    /// Cluster figures at `now` over the up OSDs of `map`; `table` is the
    /// [`PgTable`] of `map` (for the degraded / misplaced / recovering copies).
    pub fn summary(&self, table: &PgTable, map: &ClusterMap, now: Instant) -> RecoverySummary {
        let mut s = RecoverySummary::default();
        self.object_figures(table, map, &mut s);
        // Recovering groups in the map, and those the OSDs account for.
        let in_map = table
            .iter()
            .filter(|(_, m)| !m.recovering.is_empty())
            .count() as u32;
        let mut reported = 0u32;
        for (id, r) in &self.osds {
            if !map.osds.get(id).is_some_and(|o| o.up) {
                continue;
            }
            let p = &r.progress;
            s.osds_reporting += 1;
            s.objects_to_recover = s.objects_to_recover.saturating_add(p.objects_to_recover);
            s.pgs_unestimated = s.pgs_unestimated.saturating_add(p.pgs_unestimated);
            reported = reported.saturating_add(p.pgs_recovering);
            s.recovering |= p.objects_to_recover > 0 || p.pgs_recovering > 0;
            s.scrub_errors = s.scrub_errors.saturating_add(p.scrub_errors_total);
            s.scrub_repaired = s.scrub_repaired.saturating_add(p.scrub_repaired_total);
            if p.last_scrub_unix > 0 {
                s.oldest_scrub_unix = Some(
                    s.oldest_scrub_unix
                        .map_or(p.last_scrub_unix, |o| o.min(p.last_scrub_unix)),
                );
            }
        }
        // Groups the map shows recovering that no primary reported (its map is
        // older, or it reports no figures): how much they hold back is unknown.
        s.pgs_unestimated = s
            .pgs_unestimated
            .saturating_add(in_map.saturating_sub(reported));
        s.recovering |= in_map > 0;
        if self.idle && s.recovering {
            // The map shows a new recovery no OSD reported yet: it has done nothing
            // so far; the last recovery's count is not this one's.
        } else {
            s.objects_recovered = self.objects.saturating_sub(self.episode_objects);
            s.bytes_recovered = self.bytes.saturating_sub(self.episode_bytes);
        }
        let window = Duration::from_secs(RECOVERY_RATE_WINDOW_S);
        // While a recovery is under way its rate counts from its start only (not
        // the idle time before it).
        let since = self.episode_at.filter(|_| !self.idle);
        if let Some(last) = self.last_report
            && now.saturating_duration_since(last) <= window
            && let Some(first) = self.samples.iter().find(|x| {
                now.saturating_duration_since(x.at) <= window && since.is_none_or(|t| x.at >= t)
            })
        {
            let dt = last.saturating_duration_since(first.at).as_secs_f64();
            if dt >= SAMPLE_SPACING.as_secs_f64() {
                s.objects_per_second = self.objects.saturating_sub(first.objects) as f64 / dt;
                s.bytes_per_second = self.bytes.saturating_sub(first.bytes) as f64 / dt;
            }
        }
        if s.objects_to_recover > 0 && s.objects_per_second > 0.0 {
            let eta = (s.objects_to_recover as f64 / s.objects_per_second).ceil();
            // `as` saturates: an absurd estimate shows as a huge number, never wraps.
            s.eta_seconds = Some(eta as u64);
        }
        if s.eta_seconds.is_none() && (s.objects_to_recover > 0 || s.pgs_unestimated > 0) {
            // No rate yet because the recovery just began (or the tracker has not
            // seen it begin), or nothing known to divide by: estimating. Else
            // nothing moved for a whole window: stalled, not estimating.
            let young = self
                .episode_at
                .filter(|_| !self.idle)
                .is_none_or(|t| now.saturating_duration_since(t) < window);
            s.eta_estimating = young || s.objects_to_recover == 0;
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::ids::Epoch;
    use flame_common::map::{OsdInfo, PoolConfig};

    fn map(n: u32) -> ClusterMap {
        let mut m = ClusterMap::new(
            "f".into(),
            PoolConfig {
                pg_count: 16,
                ..Default::default()
            },
        );
        for i in 0..n {
            m.osds.insert(
                OsdId(i),
                OsdInfo {
                    id: OsdId(i),
                    addr: format!("127.0.0.1:{}", 7000 + 10 * i).parse().unwrap(),
                    shards: 1,
                    host: format!("h{i}"),
                    weight: 1.0,
                    up: true,
                    up_from: Epoch(1),
                    r#in: true,
                    metrics_addr: None,
                },
            );
        }
        m
    }

    fn progress(left: u64, done: u64) -> RecoveryProgress {
        RecoveryProgress {
            objects_to_recover: left,
            objects_recovered_total: done,
            bytes_recovered_total: done * (4 << 20),
            ..Default::default()
        }
    }

    #[test]
    fn rate_eta_and_progress_from_heartbeats() {
        let m = map(3);
        let t0 = Instant::now();
        let mut t = RecoveryTracker::new();
        // osd.0 had recovered 500 objects in an earlier recovery before the
        // manager started: none of that is "current" progress or rate.
        t.record(OsdId(0), Some(&progress(0, 500)), &m, t0);
        t.record(OsdId(1), Some(&progress(0, 0)), &m, t0);
        let s = t.summary(&PgTable::new(&m), &m, t0);
        assert_eq!((s.objects_to_recover, s.objects_recovered), (0, 0));
        assert_eq!(s.progress(), None);
        assert_eq!(s.eta_seconds, None);
        // A recovery of 100 objects at 10 objects (40 MiB) per second on osd.0.
        for sec in 1..=6u64 {
            let at = t0 + Duration::from_secs(sec);
            t.record(
                OsdId(0),
                Some(&progress(100 - 10 * sec, 500 + 10 * sec)),
                &m,
                at,
            );
            t.record(OsdId(1), Some(&progress(0, 0)), &m, at);
        }
        let now = t0 + Duration::from_secs(6);
        let s = t.summary(&PgTable::new(&m), &m, now);
        assert_eq!(s.objects_to_recover, 40);
        assert_eq!(s.osds_reporting, 2);
        // Progress counts from the first report that showed work (which had
        // already recovered 10).
        assert_eq!(s.objects_recovered, 60);
        assert_eq!(s.bytes_recovered, 60 * (4 << 20));
        assert!((s.objects_per_second - 10.0).abs() < 1e-9, "{s:?}");
        assert!((s.bytes_per_second - 40.0 * 1048576.0).abs() < 1.0, "{s:?}");
        assert_eq!(s.eta_seconds, Some(4));
        assert!((s.progress().unwrap() - 0.6).abs() < 1e-9);
        // osd.0 restarts: its counter starts again at 0 and counts up to 5. That
        // adds 5, never a negative jump.
        let at = now + Duration::from_secs(1);
        t.record(OsdId(0), Some(&progress(35, 5)), &m, at);
        assert_eq!(t.summary(&PgTable::new(&m), &m, at).objects_recovered, 65);
        // Nothing reported for longer than the window: no rate, no estimate.
        let late = at + Duration::from_secs(RECOVERY_RATE_WINDOW_S + 1);
        let s = t.summary(&PgTable::new(&m), &m, late);
        assert_eq!(s.objects_per_second, 0.0);
        assert_eq!(s.eta_seconds, None);
        assert_eq!(s.objects_to_recover, 35);
    }

    /// `map` with pg 5's third placed member not complete (recovering).
    fn with_pg5_recovering(m: &ClusterMap) -> ClusterMap {
        let mut m = m.clone();
        let placed = PgTable::new(&m).pg(PgId(5)).placed.clone();
        m.pg_complete.insert(PgId(5), vec![placed[0], placed[1]]);
        assert_eq!(PgTable::new(&m).pg(PgId(5)).recovering, vec![placed[2]]);
        m
    }

    fn working(left: u64, done: u64, recovering: u32, unestimated: u32) -> RecoveryProgress {
        RecoveryProgress {
            pgs_recovering: recovering,
            pgs_unestimated: unestimated,
            ..progress(left, done)
        }
    }

    #[test]
    fn each_recovery_counts_from_zero() {
        let m = map(3);
        let t0 = Instant::now();
        let mut t = RecoveryTracker::new();
        t.record(OsdId(0), Some(&progress(0, 0)), &m, t0);
        // First recovery: 20 objects, then clean.
        let t1 = t0 + Duration::from_secs(1);
        t.record(OsdId(0), Some(&working(20, 0, 1, 0)), &m, t1);
        let t2 = t0 + Duration::from_secs(3);
        t.record(OsdId(0), Some(&progress(0, 20)), &m, t2);
        let s = t.summary(&PgTable::new(&m), &m, t2);
        assert_eq!(s.objects_recovered, 20);
        assert!(!s.recovering);
        // Second recovery: counts from 0, not from 20.
        let t3 = t0 + Duration::from_secs(10);
        t.record(OsdId(0), Some(&working(8, 22, 1, 0)), &m, t3);
        let s = t.summary(&PgTable::new(&m), &m, t3);
        assert_eq!((s.objects_recovered, s.objects_to_recover), (2, 8));
        assert!(s.recovering);
        // A third recovery that was over before any report showed work left
        // still is a recovery of its own.
        t.record(
            OsdId(0),
            Some(&progress(0, 30)),
            &m,
            t3 + Duration::from_secs(1),
        );
        let t4 = t3 + Duration::from_secs(10);
        t.record(OsdId(0), Some(&progress(0, 33)), &m, t4);
        assert_eq!(t.summary(&PgTable::new(&m), &m, t4).objects_recovered, 3);
        // Groups recovering with nothing left to copy (flushing, reporting)
        // keep the recovery going: no new count when the next objects come.
        let t5 = t4 + Duration::from_secs(10);
        t.record(OsdId(0), Some(&working(5, 33, 1, 0)), &m, t5);
        t.record(
            OsdId(0),
            Some(&working(0, 38, 1, 0)),
            &m,
            t5 + Duration::from_secs(1),
        );
        let t6 = t5 + Duration::from_secs(2);
        t.record(OsdId(0), Some(&working(4, 38, 1, 0)), &m, t6);
        assert_eq!(t.summary(&PgTable::new(&m), &m, t6).objects_recovered, 5);
    }

    #[test]
    fn groups_recovering_in_the_map_are_never_idle_or_done() {
        let m = map(3);
        let t0 = Instant::now();
        let mut t = RecoveryTracker::new();
        for id in 0..3 {
            t.record(OsdId(id), Some(&progress(0, 0)), &m, t0);
        }
        // An earlier recovery of 9 objects.
        let t1 = t0 + Duration::from_secs(1);
        t.record(OsdId(0), Some(&working(9, 0, 1, 0)), &m, t1);
        t.record(
            OsdId(0),
            Some(&progress(0, 9)),
            &m,
            t1 + Duration::from_secs(1),
        );
        assert_eq!(t.summary(&PgTable::new(&m), &m, t1).objects_recovered, 9);
        // The map shows pg 5 recovering; no OSD has reported it yet.
        let r = with_pg5_recovering(&m);
        let table = PgTable::new(&r);
        let now = t1 + Duration::from_secs(2);
        let s = t.summary(&table, &r, now);
        assert!(s.recovering);
        assert_eq!((s.objects_to_recover, s.pgs_unestimated), (0, 1));
        assert_eq!(
            s.objects_recovered, 0,
            "the last recovery's count is not this one's"
        );
        assert!(s.eta_estimating && s.eta_seconds.is_none());
        assert_eq!(s.phase(), flame_common::mgr_api::RecoveryPhase::Estimating);
        // Its primary reports it, not estimated yet: still unknown, once.
        t.record(OsdId(0), Some(&working(0, 9, 1, 1)), &r, now);
        let s = t.summary(&table, &r, now);
        assert_eq!((s.objects_to_recover, s.pgs_unestimated), (0, 1));
        // Estimated, and then only flushing: finishing, never idle.
        t.record(OsdId(0), Some(&working(0, 12, 1, 0)), &r, now);
        let s = t.summary(&table, &r, now);
        assert_eq!((s.objects_to_recover, s.pgs_unestimated), (0, 0));
        assert!(s.recovering);
        assert_eq!(s.phase(), flame_common::mgr_api::RecoveryPhase::Finishing);
        assert_eq!(s.objects_recovered, 3);
        // Complete in the map and reported idle: idle again.
        t.record(OsdId(0), Some(&progress(0, 12)), &m, now);
        let s = t.summary(&PgTable::new(&m), &m, now);
        assert!(!s.recovering);
        assert_eq!(
            s.phase(),
            flame_common::mgr_api::RecoveryPhase::Idle { last_recovered: 3 }
        );
    }

    #[test]
    fn eta_whenever_objects_are_left_and_a_rate_is_known() {
        let m = with_pg5_recovering(&map(3));
        let table = PgTable::new(&m);
        let t0 = Instant::now();
        let mut t = RecoveryTracker::new();
        t.record(OsdId(0), Some(&progress(0, 0)), &m, t0);
        // Idle for a long time before: that time is not part of the rate.
        for sec in 1..=20u64 {
            t.record(
                OsdId(0),
                Some(&progress(0, 0)),
                &m,
                t0 + Duration::from_secs(sec),
            );
        }
        let start = t0 + Duration::from_secs(21);
        t.record(OsdId(0), Some(&working(100, 0, 1, 0)), &m, start);
        let s = t.summary(&table, &m, start);
        assert_eq!(s.eta_seconds, None);
        assert!(s.eta_estimating, "no rate yet: estimating");
        for sec in 1..=4u64 {
            let at = start + Duration::from_secs(sec);
            t.record(
                OsdId(0),
                Some(&working(100 - 5 * sec, 5 * sec, 1, 0)),
                &m,
                at,
            );
        }
        let now = start + Duration::from_secs(4);
        let s = t.summary(&table, &m, now);
        assert!((s.objects_per_second - 5.0).abs() < 1e-9, "{s:?}");
        assert_eq!(s.eta_seconds, Some(16));
        assert!(!s.eta_estimating);
        // Objects left and some groups not estimated: an ETA for what is known.
        t.record(OsdId(0), Some(&working(80, 20, 2, 1)), &m, now);
        let s = t.summary(&table, &m, now);
        assert_eq!(s.eta_seconds, Some(16));
        assert_eq!(s.pgs_unestimated, 1);
        // Nothing moves for longer than the window: stalled, not estimating.
        let late = now + Duration::from_secs(RECOVERY_RATE_WINDOW_S + 5);
        t.record(OsdId(0), Some(&working(80, 20, 1, 0)), &m, late);
        let s = t.summary(&table, &m, late);
        assert_eq!(s.eta_seconds, None);
        assert!(!s.eta_estimating);
    }

    #[test]
    fn down_and_silent_osds_do_not_count() {
        let mut m = map(3);
        let t0 = Instant::now();
        let mut t = RecoveryTracker::new();
        t.record(OsdId(0), Some(&progress(7, 0)), &m, t0);
        t.record(OsdId(1), Some(&progress(5, 0)), &m, t0);
        assert_eq!(t.summary(&PgTable::new(&m), &m, t0).objects_to_recover, 12);
        // A down OSD's last report is stale: its groups have another primary.
        m.osds.get_mut(&OsdId(1)).unwrap().up = false;
        assert_eq!(t.summary(&PgTable::new(&m), &m, t0).objects_to_recover, 7);
        // An OSD that stops sending figures is forgotten.
        t.record(OsdId(0), None, &m, t0);
        let s = t.summary(&PgTable::new(&m), &m, t0);
        assert_eq!((s.objects_to_recover, s.osds_reporting), (0, 0));
        // An OSD removed from the map is forgotten at the next report.
        m.osds.get_mut(&OsdId(1)).unwrap().up = true;
        m.osds.remove(&OsdId(1));
        t.record(OsdId(2), Some(&progress(0, 0)), &m, t0);
        assert_eq!(t.osds.len(), 1);
    }

    #[test]
    fn scrub_figures_and_bounded_samples() {
        let m = map(2);
        let t0 = Instant::now();
        let mut t = RecoveryTracker::new();
        for sec in 0..1000u64 {
            let at = t0 + Duration::from_millis(sec * 700);
            for id in 0..2 {
                let p = RecoveryProgress {
                    scrub_errors_total: 3,
                    scrub_repaired_total: 2,
                    last_scrub_unix: 1000 + u64::from(id),
                    ..progress(0, sec)
                };
                t.record(OsdId(id), Some(&p), &m, at);
            }
            assert!(t.samples.len() <= SAMPLES_MAX);
        }
        let s = t.summary(&PgTable::new(&m), &m, t0 + Duration::from_millis(999 * 700));
        assert_eq!((s.scrub_errors, s.scrub_repaired), (6, 4));
        assert_eq!(s.oldest_scrub_unix, Some(1000));
        // 2 objects per 0.7 s.
        assert!((s.objects_per_second - 2.0 / 0.7).abs() < 0.01, "{s:?}");
        // The window keeps about 30 s of 1 s-spaced samples, never more.
        assert!(t.samples.len() <= 32, "{}", t.samples.len());
    }

    #[test]
    fn degraded_misplaced_and_recovering_copies_from_primary_counts() {
        let mut m = map(4);
        let t0 = Instant::now();
        let mut t = RecoveryTracker::new();
        let table = PgTable::new(&m);
        // Nothing reported: every group uncounted, no figures.
        let s = t.summary(&table, &m, t0);
        assert_eq!((s.objects, s.pgs_uncounted), (0, 16));
        // Each primary reports its groups: pg n holds n objects.
        for id in 0..4 {
            let mine: Vec<(PgId, u64)> = table
                .iter()
                .filter(|(_, mm)| mm.primary() == Some(OsdId(id)))
                .map(|(pg, _)| (pg, u64::from(pg.0)))
                .collect();
            let p = RecoveryProgress {
                pg_objects: mine,
                ..progress(0, 0)
            };
            t.record(OsdId(id), Some(&p), &m, t0);
        }
        let s = t.summary(&table, &m, t0);
        let objects: u64 = (0..16).sum();
        assert_eq!((s.objects, s.object_copies), (objects, 3 * objects));
        assert_eq!(
            (s.degraded_copies, s.misplaced_copies, s.recovering_copies),
            (0, 0, 0)
        );
        assert_eq!(s.pgs_uncounted, 0);
        // osd.0 down: every group it held lacks one copy of each object. Its
        // reports stay (the objects did not go away) until a new primary counts.
        m.osds.get_mut(&OsdId(0)).unwrap().up = false;
        let down = PgTable::new(&m);
        let expect: u64 = down
            .iter()
            .filter(|(_, mm)| mm.placed.contains(&OsdId(0)))
            .map(|(pg, _)| u64::from(pg.0))
            .sum();
        assert!(expect > 0);
        let s = t.summary(&down, &m, t0);
        assert_eq!(s.degraded_copies, expect);
        assert_eq!((s.misplaced_copies, s.recovering_copies), (0, 0));
        // Back up; pg 5's complete copies are two placed members and an OSD
        // placement no longer picks: one misplaced and one recovering copy of
        // each of its 5 objects, none missing.
        m.osds.get_mut(&OsdId(0)).unwrap().up = true;
        let placed = PgTable::new(&m).pg(PgId(5)).placed.clone();
        let other = (0..4).map(OsdId).find(|id| !placed.contains(id)).unwrap();
        m.pg_complete
            .insert(PgId(5), vec![placed[0], placed[1], other]);
        let s = t.summary(&PgTable::new(&m), &m, t0);
        assert_eq!(
            (s.degraded_copies, s.misplaced_copies, s.recovering_copies),
            (0, 5, 5)
        );
        // A list longer than the pool, or groups past its end, are ignored.
        let bogus = RecoveryProgress {
            pg_objects: (0..17).map(|i| (PgId(i), 1000)).collect(),
            ..progress(0, 0)
        };
        t.record(OsdId(1), Some(&bogus), &m, t0);
        let past = RecoveryProgress {
            pg_objects: vec![(PgId(99), 1000)],
            ..progress(0, 0)
        };
        t.record(OsdId(1), Some(&past), &m, t0);
        assert_eq!(t.summary(&table, &m, t0).objects, objects);
    }

    #[test]
    fn pg_entries_and_health_lines() {
        let mut m = map(4);
        let table = PgTable::new(&m);
        let all = pg_statuses(&table, &m);
        assert_eq!(all.len(), 16);
        assert!(
            all.iter()
                .all(|p| p.state == "active+clean" && p.acting == p.placed)
        );
        assert_eq!(pg_status(&table, &m, PgId(16)), None);
        let h = pg_health(&table, &m);
        assert!(h.errors.is_empty() && h.warnings.is_empty() && h.examples.is_empty());
        assert!(h.io_waits.iter().all(|w| !w));
        // Two OSDs down, nothing recorded: groups with both lose min_size.
        m.osds.get_mut(&OsdId(0)).unwrap().up = false;
        m.osds.get_mut(&OsdId(1)).unwrap().up = false;
        let table = PgTable::new(&m);
        let (by_state, sum) = summarize(&table, &m);
        assert_eq!(sum.total, 16);
        assert_eq!(by_state.values().sum::<u32>(), 16);
        let h = pg_health(&table, &m);
        let inactive = h.io_waits.iter().filter(|w| **w).count();
        assert_eq!(inactive as u32, sum.inactive);
        assert!(inactive > 0);
        assert!(
            h.errors[0].starts_with(&format!(
                "{inactive} of 16 placement groups have fewer than pool.min_size 2"
            )),
            "{:?}",
            h.errors
        );
        let ex = h
            .examples
            .iter()
            .find(|e| e.starts_with("inactive placement groups: pg."))
            .unwrap_or_else(|| panic!("{:?}", h.examples));
        assert!(ex.contains("waiting for osd.0, osd.1"), "{ex}");
        // Examples are bounded.
        assert!(ex.matches("pg.").count() <= DETAIL_PGS_MAX, "{ex}");
        let e = pg_status(&table, &m, PgId(0)).unwrap();
        assert_eq!(e.primary, e.acting.first().copied());
        assert_eq!(e.epoch, m.epoch);
    }
}
