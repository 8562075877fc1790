//! `flame-admin status` and `status --watch`: the cluster's health, placement-group
//! states and recovery progress, once or redrawn every interval.
//!
//! On a terminal the watch clears the screen and redraws the whole status with a
//! progress bar; anywhere else (a pipe, a log file, CI) it prints one plain line
//! per interval with no escape codes, so the output stays greppable; with `--json`
//! one JSON object per line.

use super::format::{fields, utc_time};
use super::{AdminError, Result, osds_line, usage_line};
use crate::MgrClient;
use flame_common::mgr_api::{ClusterStatus, RecoveryPhase, RecoverySummary, format_size};
use std::io::Write;
use std::time::Duration;

/// Shortest accepted `--interval-ms`: the manager computes PG states per epoch,
/// but a status is not free, and a terminal cannot show faster redraws anyway.
pub const WATCH_INTERVAL_MS_MIN: u64 = 100;
/// Longest accepted `--interval-ms` (one hour).
pub const WATCH_INTERVAL_MS_MAX: u64 = 3_600_000;
/// Width of the progress bar in characters.
const BAR_WIDTH: usize = 30;
/// Clears the screen and moves the cursor home (ANSI): only ever written to a
/// terminal.
const CLEAR_SCREEN: &str = "\x1b[H\x1b[2J";

/// `1h 2m 3s`, `4m 5s`, `6s`.
pub fn human_duration(secs: u64) -> String {
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    if h > 0 {
        format!("{h}h {m}m {s}s")
    } else if m > 0 {
        format!("{m}m {s}s")
    } else {
        format!("{s}s")
    }
}

/// `[#########---------] 50.0%`: `fraction` (clamped to `[0, 1]`) of `width`
/// characters filled, ASCII only so every terminal and font shows it.
pub fn progress_bar(fraction: f64, width: usize) -> String {
    let f = if fraction.is_finite() {
        fraction.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let filled = ((f * width as f64).round() as usize).min(width);
    format!(
        "[{}{}] {:5.1}%",
        "#".repeat(filled),
        "-".repeat(width - filled),
        f * 100.0
    )
}

/// Rate and ETA: `40.0 MiB/s, 10.0 objects/s, ETA 4s`.
fn rate_text(r: &RecoverySummary) -> String {
    let mut t = format!(
        "{:.1} MiB/s, {:.1} objects/s",
        r.bytes_per_second / 1_048_576.0,
        r.objects_per_second
    );
    match r.eta_seconds {
        Some(eta) => t.push_str(&format!(", ETA {}", human_duration(eta))),
        None if r.eta_estimating => t.push_str(", ETA estimating"),
        None if r.objects_to_recover > 0 => {
            t.push_str(", ETA unknown (no progress in the last 30 s)")
        }
        None => {}
    }
    t
}

/// Where the recovery of `s` stands. A group recovering in the map means a
/// recovery is under way even from a manager that does not say so itself.
pub fn phase(s: &ClusterStatus) -> RecoveryPhase {
    let mut r = s.recovery.clone();
    r.recovering |= s.pg_summary.recovering > 0;
    r.phase()
}

/// How many objects are left: `40`, `40+` (some groups not estimated yet) or
/// `unknown`.
fn left_text(s: &ClusterStatus) -> String {
    match phase(s) {
        RecoveryPhase::Estimating => "unknown".into(),
        RecoveryPhase::Recovering { partial: true, .. } => {
            format!("{}+", s.recovery.objects_to_recover)
        }
        _ => s.recovery.objects_to_recover.to_string(),
    }
}

/// ` (3 placement groups not estimated yet)`, or nothing.
fn unestimated_text(r: &RecoverySummary) -> String {
    match r.pgs_unestimated {
        0 => String::new(),
        1 => " (1 placement group not estimated yet)".into(),
        n => format!(" ({n} placement groups not estimated yet)"),
    }
}

/// The `recovery` value of `status`: what is left, the rate and the ETA.
pub fn recovery_line(s: &ClusterStatus) -> String {
    let r = &s.recovery;
    let groups = s.pg_summary.recovering;
    if r.osds_reporting == 0 {
        if groups > 0 {
            return format!(
                "{groups} placement groups recovering; no OSD reports recovery progress \
                 (amount left unknown)"
            );
        }
        return "no figures: no OSD reports recovery progress".into();
    }
    match phase(s) {
        RecoveryPhase::Idle { .. } => "idle: nothing to recover".into(),
        RecoveryPhase::Estimating => format!(
            "{groups} placement groups recovering, objects to recover unknown{}, {} \
             recovered ({}); {}",
            unestimated_text(r),
            r.objects_recovered,
            format_size(r.bytes_recovered),
            rate_text(r)
        ),
        RecoveryPhase::Recovering { .. } => format!(
            "{} objects to recover{}, {} recovered ({}); {}",
            left_text(s),
            unestimated_text(r),
            r.objects_recovered,
            format_size(r.bytes_recovered),
            rate_text(r)
        ),
        RecoveryPhase::Finishing => format!(
            "finishing: 0 objects to recover, {} recovered ({}); {groups} placement groups \
             still recovering until their primaries report them complete",
            r.objects_recovered,
            format_size(r.bytes_recovered),
        ),
    }
}

/// The `pgs` value of `status`: the total, then one `count state` per line.
pub fn pgs_lines(s: &ClusterStatus, indent: &str) -> String {
    let mut t = format!("{} total", s.pg_summary.total);
    // Most groups first; ties by name (the map is sorted by name).
    let mut states: Vec<(&String, &u32)> = s.pgs_by_state.iter().collect();
    states.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    for (state, n) in states {
        t.push_str(&format!("\n{indent}{n} {state}"));
    }
    t
}

/// `12/300 (4.0%)`: a count of copies out of all copies.
fn share(n: u64, of: u64) -> String {
    if of == 0 {
        return n.to_string();
    }
    format!("{n}/{of} ({:.1}%)", n as f64 * 100.0 / of as f64)
}

/// The `objects` value of `status`: objects and copies, and of those copies how
/// many are degraded (missing), misplaced (on an OSD placement no longer chooses)
/// and recovering (being made), from the primaries' per-group object counts and
/// the map; then what the primaries still have to copy.
pub fn objects_line(s: &ClusterStatus) -> String {
    let r = &s.recovery;
    let mut t = format!(
        "{} objects, {} copies; {} degraded, {} misplaced, {} recovering; {} to recover",
        r.objects,
        r.object_copies,
        share(r.degraded_copies, r.object_copies),
        share(r.misplaced_copies, r.object_copies),
        share(r.recovering_copies, r.object_copies),
        left_text(s),
    );
    if r.pgs_uncounted > 0 {
        t.push_str(&format!(
            " ({} placement groups not counted yet)",
            r.pgs_uncounted
        ));
    }
    t
}

/// The whole `status` text.
pub fn status_text(s: &ClusterStatus) -> String {
    // Detail lines go under the health value: keys are padded to "recovery" + 2.
    let indent = " ".repeat("recovery".len() + 2);
    let mut health = s.health.clone();
    for d in &s.health_detail {
        health.push_str(&format!("\n{indent}- {d}"));
    }
    let mut pairs = vec![
        ("cluster", s.fsid.clone()),
        ("health", health),
        ("map", format!("epoch {}", s.epoch.0)),
        ("osds", osds_line(s)),
        (
            "volumes",
            format!(
                "{} ({} provisioned)",
                s.volumes,
                format_size(s.provisioned_bytes)
            ),
        ),
        ("usage", usage_line(s)),
        // Capacity warnings (nearfull / full OSDs) belong here, next to usage,
        // once the manager reports them; today they appear in health detail.
        ("pgs", pgs_lines(s, &indent)),
        ("objects", objects_line(s)),
        ("recovery", recovery_line(s)),
    ];
    let r = &s.recovery;
    if r.scrub_errors > 0 || r.oldest_scrub_unix.is_some() {
        pairs.push((
            "scrub",
            format!(
                "{} errors found, {} repaired; oldest last scrub {}",
                r.scrub_errors,
                r.scrub_repaired,
                r.oldest_scrub_unix.map_or_else(|| "never".into(), utc_time)
            ),
        ));
    }
    pairs.push((
        "pool",
        format!(
            "size {}, min_size {}, {} PGs, {} objects",
            s.pool.size,
            s.pool.min_size,
            s.pool.pg_count,
            format_size(u64::from(s.pool.object_size))
        ),
    ));
    fields(&pairs)
}

/// The progress line under the status on a terminal.
pub fn progress_line(s: &ClusterStatus) -> String {
    let r = &s.recovery;
    let groups = s.pg_summary.recovering;
    match phase(s) {
        RecoveryPhase::Recovering { fraction, .. } => format!(
            "progress  {} {} of {}{} objects; {}",
            progress_bar(fraction, BAR_WIDTH),
            r.objects_recovered,
            r.objects_recovered.saturating_add(r.objects_to_recover),
            if r.pgs_unestimated > 0 { "+" } else { "" },
            rate_text(r)
        ),
        RecoveryPhase::Estimating => format!(
            "progress  estimating: {groups} placement groups recovering, amount left not \
             known yet ({} objects recovered so far)",
            r.objects_recovered
        ),
        RecoveryPhase::Finishing => format!(
            "progress  finishing: every object copied ({} objects); {groups} placement \
             groups still recovering",
            r.objects_recovered
        ),
        RecoveryPhase::Idle { last_recovered } if last_recovered > 0 => format!(
            "progress  {} recovery done ({} objects, {})",
            progress_bar(1.0, BAR_WIDTH),
            last_recovered,
            format_size(r.bytes_recovered)
        ),
        RecoveryPhase::Idle { .. } => "progress  nothing to recover".into(),
    }
}

/// One line of the non-terminal watch: time, health, PG states, recovery.
pub fn watch_line(s: &ClusterStatus, unix_s: u64) -> String {
    let mut states: Vec<(&String, &u32)> = s.pgs_by_state.iter().collect();
    states.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    let pgs = states
        .iter()
        .map(|(st, n)| format!("{n} {st}"))
        .collect::<Vec<_>>()
        .join(", ");
    let r = &s.recovery;
    let groups = s.pg_summary.recovering;
    let recovery = match phase(s) {
        RecoveryPhase::Recovering { fraction, .. } => format!(
            "recovery {:.1}% ({} to recover); {}",
            fraction * 100.0,
            left_text(s),
            rate_text(r)
        ),
        RecoveryPhase::Estimating => format!(
            "recovery estimating ({groups} placement groups recovering, amount left \
             unknown); {}",
            rate_text(r)
        ),
        RecoveryPhase::Finishing => {
            format!("recovery finishing (0 to recover, {groups} placement groups recovering)")
        }
        RecoveryPhase::Idle { .. } => "recovery idle".into(),
    };
    format!(
        "{} {} epoch {}; osds {} up, {} in of {}; pgs {}; {}",
        utc_time(unix_s),
        s.health,
        s.epoch.0,
        s.osds_up,
        s.osds_in,
        s.osds,
        if pgs.is_empty() { "none".into() } else { pgs },
        recovery
    )
}

/// How `status --watch` prints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WatchMode {
    /// Clear the screen and redraw with a progress bar.
    Terminal,
    /// One plain line per interval.
    Lines,
    /// One JSON object per line.
    Json,
}

/// `status --watch` settings.
#[derive(Clone, Copy, Debug)]
pub struct WatchOptions {
    /// Time between redraws.
    pub interval: Duration,
    /// Stop after this many redraws (`None`: until interrupted).
    pub count: Option<u64>,
    /// How to print.
    pub mode: WatchMode,
}

fn unix_now() -> u64 {
    flame_common::clock::unix_ms() / 1000
}

/// Renders one redraw of the watch.
pub fn render(mode: WatchMode, status: &std::result::Result<ClusterStatus, String>) -> String {
    let now = unix_now();
    match (mode, status) {
        (WatchMode::Terminal, Ok(s)) => format!(
            "{CLEAR_SCREEN}{}\n{}\n\n{} — Ctrl-C to stop\n",
            status_text(s),
            progress_line(s),
            utc_time(now)
        ),
        (WatchMode::Terminal, Err(e)) => {
            format!(
                "{CLEAR_SCREEN}{}: cannot get the status: {e}\n",
                utc_time(now)
            )
        }
        (WatchMode::Lines, Ok(s)) => format!("{}\n", watch_line(s, now)),
        (WatchMode::Lines, Err(e)) => format!("{} error: {e}\n", utc_time(now)),
        (WatchMode::Json, Ok(s)) => match serde_json::to_string(s) {
            Ok(j) => format!("{j}\n"),
            Err(e) => {
                let body = serde_json::json!({ "error": format!("encoding JSON: {e}") });
                format!("{body}\n")
            }
        },
        (WatchMode::Json, Err(e)) => {
            let body = serde_json::json!({ "error": e });
            format!("{body}\n")
        }
    }
}

/// Fetches and prints the status every interval. A manager that does not answer
/// is shown as such and the watch goes on (it may be restarting); the command
/// fails only if no fetch at all succeeded.
pub fn watch(mgr: &MgrClient, opts: WatchOptions, out: &mut dyn Write) -> Result<()> {
    let mut drawn: u64 = 0;
    let mut succeeded: u64 = 0;
    let mut last_error = String::new();
    loop {
        let status = mgr.status().map_err(|e| e.to_string());
        match &status {
            Ok(_) => succeeded += 1,
            Err(e) => last_error.clone_from(e),
        }
        out.write_all(render(opts.mode, &status).as_bytes())
            .and_then(|()| out.flush())
            .map_err(|e| AdminError(format!("writing output: {e}")))?;
        drawn += 1;
        if opts.count.is_some_and(|n| drawn >= n) {
            break;
        }
        flame_common::clock::sleep_blocking(opts.interval);
    }
    if succeeded == 0 {
        return Err(AdminError(format!(
            "no status in {drawn} attempts: {last_error}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::ids::Epoch;
    use flame_common::mgr_api::PgSummary;

    fn status() -> ClusterStatus {
        let mut s = ClusterStatus {
            fsid: "f".into(),
            health: "HEALTH_WARN".into(),
            health_detail: vec!["8 of 128 placement groups are degraded".into()],
            epoch: Epoch(42),
            osds: 4,
            osds_up: 3,
            osds_in: 4,
            pg_summary: PgSummary {
                total: 128,
                active: 128,
                clean: 120,
                degraded: 8,
                recovering: 8,
                ..Default::default()
            },
            ..Default::default()
        };
        s.pgs_by_state.insert("active+clean".into(), 120);
        s.pgs_by_state
            .insert("active+recovering+degraded".into(), 8);
        s.recovery = RecoverySummary {
            osds_reporting: 3,
            objects_to_recover: 40,
            objects_recovered: 60,
            bytes_recovered: 60 << 22,
            objects_per_second: 10.0,
            bytes_per_second: 40.0 * 1_048_576.0,
            eta_seconds: Some(4),
            objects: 1000,
            object_copies: 3000,
            degraded_copies: 60,
            misplaced_copies: 0,
            recovering_copies: 60,
            ..Default::default()
        };
        s
    }

    #[test]
    fn bars_and_durations() {
        assert_eq!(progress_bar(0.5, 10), "[#####-----]  50.0%");
        assert_eq!(progress_bar(0.0, 4), "[----]   0.0%");
        assert_eq!(progress_bar(1.7, 4), "[####] 100.0%");
        assert_eq!(progress_bar(f64::NAN, 4), "[----]   0.0%");
        assert_eq!(human_duration(4), "4s");
        assert_eq!(human_duration(65), "1m 5s");
        assert_eq!(human_duration(3723), "1h 2m 3s");
    }

    #[test]
    fn status_text_has_pgs_objects_and_recovery() {
        let t = status_text(&status());
        assert!(t.contains("pgs       128 total\n          120 active+clean\n          8 active+recovering+degraded"), "{t}");
        assert!(
            t.contains("objects   1000 objects, 3000 copies; 60/3000 (2.0%) degraded, 0/3000 (0.0%) misplaced, 60/3000 (2.0%) recovering; 40 to recover"),
            "{t}"
        );
        assert!(
            t.contains("recovery  40 objects to recover, 60 recovered (240.0 MiB); 40.0 MiB/s, 10.0 objects/s, ETA 4s"),
            "{t}"
        );
        assert!(
            t.contains("health    HEALTH_WARN\n          - 8 of 128"),
            "{t}"
        );
        assert!(!t.contains("scrub"), "{t}");
        let mut s = status();
        s.recovery.scrub_errors = 2;
        s.recovery.scrub_repaired = 2;
        s.recovery.oldest_scrub_unix = Some(0);
        assert!(
            status_text(&s)
                .contains("scrub     2 errors found, 2 repaired; oldest last scrub 1970-01-01")
        );
        s.recovery.pgs_uncounted = 3;
        assert!(status_text(&s).contains("40 to recover (3 placement groups not counted yet)"));
        s.recovery = RecoverySummary::default();
        assert!(status_text(&s).contains("objects   0 objects, 0 copies; 0 degraded, 0 misplaced"));
        assert!(
            status_text(&s).contains(
                "recovery  8 placement groups recovering; no OSD reports recovery progress \
                 (amount left unknown)"
            ),
            "{}",
            status_text(&s)
        );
        s.pg_summary.recovering = 0;
        assert!(status_text(&s).contains("recovery  no figures: no OSD reports recovery progress"));
        s.recovery.osds_reporting = 3;
        assert!(status_text(&s).contains("recovery  idle: nothing to recover"));
    }

    #[test]
    fn recovery_line_per_phase() {
        // Groups recovering, none estimated: unknown, never 0 or idle.
        let mut s = status();
        s.recovery.objects_to_recover = 0;
        s.recovery.pgs_unestimated = 8;
        s.recovery.eta_seconds = None;
        s.recovery.eta_estimating = true;
        let t = recovery_line(&s);
        assert_eq!(
            t,
            "8 placement groups recovering, objects to recover unknown (8 placement groups \
             not estimated yet), 60 recovered (240.0 MiB); 40.0 MiB/s, 10.0 objects/s, ETA \
             estimating"
        );
        assert!(
            objects_line(&s).ends_with("; unknown to recover"),
            "{}",
            objects_line(&s)
        );
        // Some estimated: a lower bound.
        s.recovery.objects_to_recover = 40;
        s.recovery.pgs_unestimated = 1;
        let t = recovery_line(&s);
        assert!(
            t.starts_with("40+ objects to recover (1 placement group not estimated yet), 60"),
            "{t}"
        );
        assert!(
            objects_line(&s).ends_with("; 40+ to recover"),
            "{}",
            objects_line(&s)
        );
        // Estimated, no rate yet.
        s.recovery.pgs_unestimated = 0;
        assert!(recovery_line(&s).ends_with("ETA estimating"));
        // Stalled.
        s.recovery.eta_estimating = false;
        assert!(recovery_line(&s).ends_with("ETA unknown (no progress in the last 30 s)"));
        // Everything copied, groups still recovering in the map.
        s.recovery.objects_to_recover = 0;
        let t = recovery_line(&s);
        assert!(
            t.starts_with("finishing: 0 objects to recover, 60 recovered"),
            "{t}"
        );
        // The manager says a recovery is under way though the map copy it sent
        // shows none recovering: still not idle.
        s.pg_summary.recovering = 0;
        s.recovery.recovering = true;
        assert!(recovery_line(&s).starts_with("finishing"));
        s.recovery.recovering = false;
        assert_eq!(recovery_line(&s), "idle: nothing to recover");
    }

    #[test]
    fn terminal_redraw_clears_and_draws_a_bar() {
        let t = render(WatchMode::Terminal, &Ok(status()));
        assert!(t.starts_with(CLEAR_SCREEN), "{t:?}");
        assert!(
            t.contains(
                "progress  [##################------------]  60.0% 60 of 100 objects; 40.0 MiB/s"
            ),
            "{t}"
        );
        let mut s = status();
        s.recovery.objects_to_recover = 0;
        // Groups still recovering: never done, never 100 %.
        let t = render(WatchMode::Terminal, &Ok(s.clone()));
        assert!(
            t.contains("progress  finishing: every object copied (60 objects); 8 placement"),
            "{t}"
        );
        assert!(!t.contains("100.0%") && !t.contains("done"), "{t}");
        s.recovery.pgs_unestimated = 8;
        let t = render(WatchMode::Terminal, &Ok(s.clone()));
        assert!(
            t.contains("progress  estimating: 8 placement groups recovering"),
            "{t}"
        );
        assert!(!t.contains("100.0%"), "{t}");
        // Some groups not estimated: the total is a lower bound.
        s.recovery.objects_to_recover = 40;
        s.recovery.pgs_unestimated = 2;
        let t = render(WatchMode::Terminal, &Ok(s.clone()));
        assert!(t.contains("60 of 100+ objects"), "{t}");
        // One object left of a million: not 100.0 %.
        s.recovery.objects_to_recover = 1;
        s.recovery.objects_recovered = 1_000_000;
        let t = render(WatchMode::Terminal, &Ok(s.clone()));
        assert!(t.contains(" 99.9% ") && !t.contains("100.0%"), "{t}");
        // Clean: done, with the last recovery's count.
        s.recovery.objects_to_recover = 0;
        s.recovery.pgs_unestimated = 0;
        s.recovery.objects_recovered = 60;
        s.pg_summary.recovering = 0;
        let t = render(WatchMode::Terminal, &Ok(s.clone()));
        assert!(t.contains("100.0% recovery done (60 objects"), "{t}");
        s.recovery.objects_recovered = 0;
        let t = render(WatchMode::Terminal, &Ok(s));
        assert!(t.contains("progress  nothing to recover"), "{t}");
        let t = render(WatchMode::Terminal, &Err("refused".into()));
        assert!(t.starts_with(CLEAR_SCREEN) && t.contains("cannot get the status: refused"));
    }

    #[test]
    fn line_mode_has_no_escape_codes() {
        let t = render(WatchMode::Lines, &Ok(status()));
        assert!(!t.contains('\x1b'), "{t:?}");
        assert_eq!(t.lines().count(), 1, "{t}");
        assert!(
            t.contains(
                "HEALTH_WARN epoch 42; osds 3 up, 4 in of 4; pgs 120 active+clean, 8 \
                 active+recovering+degraded; recovery 60.0% (40 to recover); 40.0 MiB/s"
            ),
            "{t}"
        );
        // Never idle while groups recover.
        let mut s = status();
        s.recovery.objects_to_recover = 0;
        s.recovery.pgs_unestimated = 8;
        s.recovery.eta_seconds = None;
        s.recovery.eta_estimating = true;
        let t = watch_line(&s, 0);
        assert!(
            t.ends_with(
                "; recovery estimating (8 placement groups recovering, amount left unknown); \
                 40.0 MiB/s, 10.0 objects/s, ETA estimating"
            ),
            "{t}"
        );
        s.recovery.pgs_unestimated = 0;
        let t = watch_line(&s, 0);
        assert!(
            t.ends_with("; recovery finishing (0 to recover, 8 placement groups recovering)"),
            "{t}"
        );
        s.pg_summary.recovering = 0;
        assert!(watch_line(&s, 0).ends_with("; recovery idle"));
        let t = render(WatchMode::Lines, &Err("refused".into()));
        assert!(
            t.ends_with(" error: refused\n") && !t.contains('\x1b'),
            "{t}"
        );
        let j = render(WatchMode::Json, &Ok(status()));
        assert_eq!(j.lines().count(), 1);
        let back: ClusterStatus = serde_json::from_str(&j).unwrap();
        assert_eq!(back.recovery, status().recovery);
    }
}
