//! Logging set-up shared by every binary.

/// Installs a `tracing` subscriber writing to stderr, filtered by `RUST_LOG`
/// (default `info`). Called once at start-up by every daemon and tool, so their logs
/// look the same and can be turned up the same way.
pub fn init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Colours only on a terminal: daemons usually log to files (dev-cluster.sh, the
    // test harness, journald), where escape codes make logs unreadable and ungreppable.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    // A second call (tests) is harmless: try_init just reports the existing subscriber.
    let _ = tracing_subscriber::fmt()
        .with_timer(NodeTime)
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .try_init();
}

/// A log line's time: the wall clock's, or, in the simulator, the virtual
/// seconds since the seed started (as its event list prints them) and the
/// simulated node that logs (its address), so one seed's daemon logs read as
/// one story.
struct NodeTime;

impl tracing_subscriber::fmt::time::FormatTime for NodeTime {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        match crate::clock::virtual_elapsed() {
            None => tracing_subscriber::fmt::time::SystemTime.format_time(w),
            Some(t) => match crate::node::current() {
                Some(node) => write!(w, "{:9.3} s {node}", t.as_secs_f64()),
                None => write!(w, "{:9.3} s sim", t.as_secs_f64()),
            },
        }
    }
}

/// Makes any panic end the whole process (after logging it).
///
/// Daemons call this: a panic would otherwise end only the thread it happened on,
/// leaving, say, an OSD whose control thread still heartbeats while a shard thread
/// is dead — healthy to the manager, a black hole to clients. Failing stop lets the
/// manager mark the daemon down and the supervisor (systemd) restart it.
pub fn abort_on_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        tracing::error!("panic: {info}; aborting the process");
        default(info);
        std::process::abort();
    }));
}

/// A bound on the log lines of one kind of event that anyone can cause (a
/// refused HELLO, a request with a bad signature): at most `lines_max` lines
/// per `window`, so that a flood of bad requests cannot fill the disk or bury
/// the lines that matter. The lines beyond are counted, and the next line
/// allowed says how many were left out. Decides only; the caller logs.
#[derive(Debug)]
pub struct LineBudget {
    window: std::time::Duration,
    lines_max: u32,
    state: parking_lot::Mutex<LineBudgetState>,
}

#[derive(Debug)]
struct LineBudgetState {
    /// When the current window began (`None`: no line yet).
    since: Option<std::time::Instant>,
    /// Lines allowed in the current window.
    lines: u32,
    /// Lines left out since the last one allowed.
    left_out: u64,
}

impl LineBudget {
    /// At most `lines_max` lines per `window`.
    pub const fn new(window: std::time::Duration, lines_max: u32) -> LineBudget {
        LineBudget {
            window,
            lines_max,
            state: parking_lot::const_mutex(LineBudgetState {
                since: None,
                lines: 0,
                left_out: 0,
            }),
        }
    }

    /// Whether a line may be logged at `now`: `Some(n)`, with `n` lines left
    /// out since the last one allowed (to say so in this one), or `None`.
    pub fn admit(&self, now: std::time::Instant) -> Option<u64> {
        let mut s = self.state.lock();
        let fresh = s
            .since
            .is_none_or(|since| now.saturating_duration_since(since) >= self.window);
        if fresh {
            s.since = Some(now);
            s.lines = 0;
        }
        if s.lines >= self.lines_max {
            s.left_out = s.left_out.saturating_add(1);
            return None;
        }
        s.lines += 1;
        Some(std::mem::take(&mut s.left_out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_line_budget_allows_its_lines_per_window_and_counts_the_rest() {
        let budget = LineBudget::new(Duration::from_secs(10), 2);
        let t0 = Instant::now();
        assert_eq!(budget.admit(t0), Some(0));
        assert_eq!(budget.admit(t0 + Duration::from_secs(1)), Some(0));
        // The window's lines are spent: left out, counted.
        for s in 2..7 {
            assert_eq!(budget.admit(t0 + Duration::from_secs(s)), None);
        }
        // A new window: the first line says how many were left out.
        assert_eq!(budget.admit(t0 + Duration::from_secs(10)), Some(5));
        assert_eq!(budget.admit(t0 + Duration::from_secs(11)), Some(0));
        assert_eq!(budget.admit(t0 + Duration::from_secs(12)), None);
        // Nothing allowed with no lines at all.
        let none = LineBudget::new(Duration::from_secs(1), 0);
        assert_eq!(none.admit(t0), None);
    }
}
