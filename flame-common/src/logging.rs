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
