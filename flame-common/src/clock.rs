//! The time every data-path decision reads: the real monotonic clock, or the
//! simulator's virtual one.
//!
//! Timeouts, leases, retry delays, heartbeats and grace periods are what make a
//! distributed system's behaviour depend on timing. The deterministic simulator
//! (`tests/src/sim/`) runs the whole cluster on one thread in *virtual* time: it
//! switches this thread's clock to [`simulated`] mode, and from then on [`now`] on
//! that thread returns the virtual instant, which moves only when the simulator
//! advances it ([`advance_to`]) — straight to the next timer or network delivery
//! when every node is idle, so a minute of cluster life takes milliseconds and the
//! same seed gives the same run.
//!
//! **The clock rule.** Every production read of time in flame-common, flame-osd,
//! flame-mgr and flame-client goes through this module: [`now`] and [`elapsed`]
//! for decisions, [`unix_ms`] for what must agree between hosts, [`Stopwatch`]
//! for measuring real durations that decide nothing (metrics, benchmarks), and
//! [`sleep_blocking`] for a blocking thread. The workspace's `clippy.toml` forbids
//! `Instant::now`, `SystemTime::now` and `thread::sleep` everywhere else: one
//! `Instant::now()` in a decision is a branch the simulator can never take (the
//! OSD once asked `may_serve_clients(Instant::now)`, so in simulation a new
//! primary's wait for the old one's lease never ran out by time).
//!
//! **Node clocks.** Real machines' clocks disagree: their wall clocks are set
//! apart (skew) and their oscillators run at slightly different rates (drift).
//! On a simulated thread the simulator gives the node it is about to run a
//! [`NodeClock`] ([`set_node_clock`]); [`now`] and [`unix_ms`] then read that
//! node's clock, and [`sim_now`] stays the simulator's own time (the network's,
//! and the manager's, which the simulator runs as the reference clock). A node's
//! monotonic clock never goes backward, also when its drift changes, and the
//! simulator converts a node's timer deadlines back to its own time with
//! [`NodeClock::sim_instant`] before it advances to them, so every reactor's
//! timers stay consistent. Off the simulator all of this costs one thread-local
//! read.

// The one place that may read the real clock and block the thread: everything
// else reads time through the functions below (clippy.toml's disallowed-methods).
#![allow(clippy::disallowed_methods)]

use std::cell::Cell;
use std::time::{Duration, Instant};

thread_local! {
    /// `Some`: this thread runs in virtual time, and this is the current instant
    /// of the simulator (every node's clock derives from it).
    static VIRTUAL_NOW: Cell<Option<Instant>> = const { Cell::new(None) };
    /// The clock of the simulated node that runs now (`None`: the simulator's
    /// own clock, exact).
    static NODE_CLOCK: Cell<Option<NodeClock>> = const { Cell::new(None) };
}

/// The current instant: virtual on a simulated thread (as the current node's
/// clock reads it), real otherwise.
#[inline]
pub fn now() -> Instant {
    match VIRTUAL_NOW.try_with(Cell::get).ok().flatten() {
        None => Instant::now(),
        Some(t) => match NODE_CLOCK.try_with(Cell::get).ok().flatten() {
            None => t,
            Some(c) => c.local_instant(t),
        },
    }
}

/// The simulator's own time, the same whichever node runs: what the simulated
/// network schedules deliveries by and the simulator advances. Equal to [`now`]
/// off the simulator and when no node clock is set.
#[inline]
pub fn sim_now() -> Instant {
    VIRTUAL_NOW
        .try_with(Cell::get)
        .ok()
        .flatten()
        .unwrap_or_else(Instant::now)
}

/// Time passed since `since` by [`now`] (zero if `since` is in the future).
#[inline]
pub fn elapsed(since: Instant) -> Duration {
    now().saturating_duration_since(since)
}

/// Blocks the calling thread for `d`. For threads that never run in the
/// simulator (a daemon's control or admin thread, a command-line tool): a reactor
/// thread must `flame_common::reactor::sleep` instead, or it stalls every task
/// on it. On a simulated thread, where a blocking sleep would stall the whole
/// cluster, it moves virtual time forward by `d` instead (nothing else runs on
/// the thread meanwhile, as with a real blocking sleep).
pub fn sleep_blocking(d: Duration) {
    if is_simulated() {
        advance(d);
    } else {
        std::thread::sleep(d);
    }
}

/// Measures a real duration, for figures that decide nothing: how long a reactor
/// slept or spun (metrics), a benchmark's throughput. It reads the real clock
/// even in simulation, and gives no `Instant` to compare with a deadline, so it
/// cannot become a decision by accident.
#[derive(Clone, Copy, Debug)]
pub struct Stopwatch(Instant);

impl Stopwatch {
    /// Starts measuring now.
    pub fn start() -> Stopwatch {
        Stopwatch(Instant::now())
    }

    /// Real time since [`Stopwatch::start`].
    pub fn elapsed(&self) -> Duration {
        self.0.elapsed()
    }
}

/// Where virtual wall-clock time starts: a fixed date (2033-05-18), so a seed's
/// tickets and handshake times replay exactly.
const VIRTUAL_UNIX_MS_START: u64 = 2_000_000_000_000;

thread_local! {
    /// On a simulated thread: the virtual instant that [`VIRTUAL_UNIX_MS_START`]
    /// corresponds to.
    static VIRTUAL_WALL_BASE: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Wall-clock time in milliseconds since the Unix epoch, for what must agree
/// between hosts (ticket expiry, handshake times): the system clock, or on a
/// simulated thread a virtual wall clock that moves with [`now`] (the current
/// node's, with its skew).
pub fn unix_ms() -> u64 {
    if let Some(base) = VIRTUAL_WALL_BASE.try_with(Cell::get).ok().flatten() {
        let since = now().saturating_duration_since(base).as_millis();
        let ms = VIRTUAL_UNIX_MS_START.saturating_add(u64::try_from(since).unwrap_or(u64::MAX));
        let skew = NODE_CLOCK
            .try_with(Cell::get)
            .ok()
            .flatten()
            .map_or(0, |c| c.skew_ms);
        return ms.saturating_add_signed(skew);
    }
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Whether this thread runs in virtual time.
pub fn is_simulated() -> bool {
    VIRTUAL_NOW.try_with(Cell::get).ok().flatten().is_some()
}

/// Virtual time since this thread switched to it ([`simulated`]), as the
/// simulator reads it (`None` in real time): the simulator's logs carry it, so
/// that a daemon's log line lines up with the simulator's events.
pub fn virtual_elapsed() -> Option<Duration> {
    let now = VIRTUAL_NOW.try_with(Cell::get).ok().flatten()?;
    let base = VIRTUAL_WALL_BASE.try_with(Cell::get).ok().flatten()?;
    Some(now.saturating_duration_since(base))
}

/// Switches this thread to virtual time, starting at the real current instant
/// (so instants from before stay comparable). For the simulator only.
pub fn simulated() {
    VIRTUAL_NOW.with(|c| {
        if c.get().is_none() {
            let start = Instant::now();
            c.set(Some(start));
            VIRTUAL_WALL_BASE.with(|w| w.set(Some(start)));
        }
    });
}

/// Moves this thread's virtual clock forward to `to` (never backward), in the
/// simulator's own time ([`sim_now`]). Panics on a thread that is not in virtual
/// time: a simulator bug.
pub fn advance_to(to: Instant) {
    VIRTUAL_NOW.with(|c| {
        let cur = c.get().expect("clock::advance_to on a thread in real time");
        if to > cur {
            c.set(Some(to));
        }
    });
}

/// Moves this thread's virtual clock forward by `by`.
pub fn advance(by: Duration) {
    advance_to(sim_now() + by);
}

/// Switches this thread back to real time (the end of a simulation).
pub fn real() {
    VIRTUAL_NOW.with(|c| c.set(None));
    VIRTUAL_WALL_BASE.with(|w| w.set(None));
    NODE_CLOCK.with(|c| c.set(None));
}

/// Most drift a [`NodeClock`] takes, in parts per million (±50 %): beyond it a
/// clock is broken, not drifting, and the arithmetic stays far from zero rates.
pub const DRIFT_PPM_MAX: i64 = 500_000;

/// One simulated node's clock, relative to the simulator's ([`sim_now`]): its
/// wall clock is `skew_ms` ahead (behind when negative), and its monotonic clock
/// runs at `1 + drift_ppm / 10⁶` of the simulator's rate from an anchor on. Copy
/// it, keep it per node, and hand it to [`set_node_clock`] whenever that node
/// runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeClock {
    /// Simulator time of the anchor.
    anchor_sim: Instant,
    /// What this node's monotonic clock read at the anchor.
    anchor_local: Instant,
    /// Rate error, parts per million (within ±[`DRIFT_PPM_MAX`]).
    drift_ppm: i64,
    /// Wall-clock offset, milliseconds.
    skew_ms: i64,
}

impl NodeClock {
    /// A clock that agrees with the simulator's (no skew, no drift) from now on.
    pub fn exact() -> NodeClock {
        let t = sim_now();
        NodeClock {
            anchor_sim: t,
            anchor_local: t,
            drift_ppm: 0,
            skew_ms: 0,
        }
    }

    /// From now on, the wall clock is `skew_ms` off and the monotonic clock runs
    /// `drift_ppm` fast (slow when negative; clamped to ±[`DRIFT_PPM_MAX`]).
    /// The clock is re-anchored where it reads now, so it never jumps: a node's
    /// monotonic clock never goes backward, whatever the change. (A wall-clock
    /// skew may jump, as a real one set by an operator or NTP step does.)
    pub fn set(&mut self, skew_ms: i64, drift_ppm: i64) {
        let t = sim_now();
        self.anchor_local = self.local_instant(t);
        self.anchor_sim = t;
        self.drift_ppm = drift_ppm.clamp(-DRIFT_PPM_MAX, DRIFT_PPM_MAX);
        self.skew_ms = skew_ms;
    }

    /// The wall-clock offset, milliseconds.
    pub fn skew_ms(&self) -> i64 {
        self.skew_ms
    }

    /// The rate error, parts per million.
    pub fn drift_ppm(&self) -> i64 {
        self.drift_ppm
    }

    /// What this node's monotonic clock reads at simulator time `t` (at the
    /// anchor for a `t` before it).
    pub fn local_instant(&self, t: Instant) -> Instant {
        let since = t.saturating_duration_since(self.anchor_sim).as_nanos();
        let rate = (1_000_000 + self.drift_ppm) as u128;
        let local = since.saturating_mul(rate) / 1_000_000;
        self.anchor_local + nanos(local)
    }

    /// The earliest simulator time at which this node's clock reads `local` or
    /// later: where the simulator must advance to for a timer this node set for
    /// `local` to be due (the anchor for a `local` already passed).
    pub fn sim_instant(&self, local: Instant) -> Instant {
        let ahead = local
            .saturating_duration_since(self.anchor_local)
            .as_nanos();
        let rate = (1_000_000 + self.drift_ppm) as u128;
        // Rounded up: at the returned time the node's clock has reached `local`.
        let sim = ahead.saturating_mul(1_000_000).div_ceil(rate);
        self.anchor_sim + nanos(sim)
    }
}

/// `n` nanoseconds as a `Duration`, saturating (about 584 years).
fn nanos(n: u128) -> Duration {
    Duration::from_nanos(u64::try_from(n).unwrap_or(u64::MAX))
}

/// Makes [`now`] and [`unix_ms`] on this thread read `clock` (`None`: the
/// simulator's own clock). The simulator calls it whenever it switches to another
/// node, beside `transport::sim::set_current_node`. For the simulator only.
pub fn set_node_clock(clock: Option<NodeClock>) {
    NODE_CLOCK.with(|c| c.set(clock));
}

/// Runs `f` with [`now`] and [`unix_ms`] reading `clock`, then restores the node
/// clock that was set before. For the simulator's modelled parts of a node (an
/// OSD's control thread) that it runs outside that node's reactor.
pub fn with_node_clock<T>(clock: Option<NodeClock>, f: impl FnOnce() -> T) -> T {
    let before = node_clock();
    set_node_clock(clock);
    let out = f();
    set_node_clock(before);
    out
}

/// The simulator time ([`sim_now`]) at which the current node's clock reads
/// `local`: where to advance to for a timer of the node that runs now (set for
/// `local` by [`now`]) to be due. `local` itself when no node clock is set.
pub fn to_sim(local: Instant) -> Instant {
    node_clock().map_or(local, |c| c.sim_instant(local))
}

/// The node clock this thread reads now, if any.
pub fn node_clock() -> Option<NodeClock> {
    NODE_CLOCK.try_with(Cell::get).ok().flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on a fresh thread in virtual time.
    fn on_sim_thread(f: impl FnOnce() + Send + 'static) {
        std::thread::spawn(move || {
            simulated();
            f();
            real();
        })
        .join()
        .unwrap();
    }

    #[test]
    fn virtual_time_moves_only_when_advanced_and_never_back() {
        std::thread::spawn(|| {
            assert!(!is_simulated());
            simulated();
            let t0 = now();
            std::thread::sleep(Duration::from_millis(5));
            assert_eq!(now(), t0, "virtual time does not follow the real clock");
            assert_eq!(unix_ms(), VIRTUAL_UNIX_MS_START, "virtual wall clock");
            advance(Duration::from_secs(3600));
            assert_eq!(unix_ms(), VIRTUAL_UNIX_MS_START + 3_600_000);
            assert_eq!(elapsed(t0), Duration::from_secs(3600));
            advance_to(t0); // backward: ignored
            assert_eq!(elapsed(t0), Duration::from_secs(3600));
            real();
            assert!(!is_simulated());
            assert!(now() < t0 + Duration::from_secs(3600));
            assert!(unix_ms() > 1_700_000_000_000 && unix_ms() < VIRTUAL_UNIX_MS_START);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn sleep_blocking_moves_virtual_time_and_blocks_real_time() {
        on_sim_thread(|| {
            let t0 = now();
            let real = Stopwatch::start();
            sleep_blocking(Duration::from_secs(10));
            assert_eq!(elapsed(t0), Duration::from_secs(10));
            assert!(real.elapsed() < Duration::from_secs(5), "no real wait");
        });
        let real = Stopwatch::start();
        sleep_blocking(Duration::from_millis(20));
        assert!(real.elapsed() >= Duration::from_millis(20));
    }

    #[test]
    fn a_node_clock_drifts_and_skews_only_while_set() {
        on_sim_thread(|| {
            let t0 = sim_now();
            let mut c = NodeClock::exact();
            c.set(-2_000, 100_000); // wall clock 2 s behind, 10 % fast
            set_node_clock(Some(c));
            assert_eq!(now(), t0, "no jump when set");
            assert_eq!(unix_ms(), VIRTUAL_UNIX_MS_START - 2_000);
            advance(Duration::from_secs(10));
            assert_eq!(now() - t0, Duration::from_secs(11), "10 % fast");
            assert_eq!(sim_now() - t0, Duration::from_secs(10));
            assert_eq!(unix_ms(), VIRTUAL_UNIX_MS_START + 11_000 - 2_000);
            set_node_clock(None);
            assert_eq!(now() - t0, Duration::from_secs(10), "the simulator's clock");
            assert_eq!(unix_ms(), VIRTUAL_UNIX_MS_START + 10_000);
            assert_eq!(node_clock(), None);
            assert_eq!(
                with_node_clock(Some(c), || now() - t0),
                Duration::from_secs(11)
            );
            assert_eq!(node_clock(), None, "restored");
            assert_eq!(
                to_sim(t0 + Duration::from_secs(99)),
                t0 + Duration::from_secs(99)
            );
            set_node_clock(Some(c));
            assert_eq!(
                to_sim(t0 + Duration::from_secs(11)) - t0,
                Duration::from_secs(10)
            );
            set_node_clock(None);
        });
    }

    #[test]
    fn a_node_clock_never_goes_back_when_its_drift_changes() {
        on_sim_thread(|| {
            let mut c = NodeClock::exact();
            c.set(0, 400_000);
            let mut last = c.local_instant(sim_now());
            for (i, ppm) in [-400_000, 0, 250_000, -DRIFT_PPM_MAX * 4, 7]
                .into_iter()
                .enumerate()
            {
                advance(Duration::from_millis(300 + 100 * i as u64));
                let before = c.local_instant(sim_now());
                assert!(before > last, "time passes at any drift");
                c.set(0, ppm);
                assert_eq!(c.local_instant(sim_now()), before, "no jump on a change");
                last = before;
            }
            assert_eq!(c.drift_ppm(), 7);
            // Clamped: a rate of -300 % would run the clock backward.
            c.set(0, -3_000_000);
            assert_eq!(c.drift_ppm(), -DRIFT_PPM_MAX);
            let before = c.local_instant(sim_now());
            advance(Duration::from_secs(1));
            assert_eq!(
                c.local_instant(sim_now()) - before,
                Duration::from_millis(500)
            );
        });
    }

    #[test]
    fn a_timer_converted_to_simulator_time_is_due_there_and_not_before() {
        on_sim_thread(|| {
            for ppm in [-DRIFT_PPM_MAX, -142_857, -1, 0, 3, 99_999, DRIFT_PPM_MAX] {
                let mut c = NodeClock::exact();
                c.set(500, ppm);
                let deadline = c.local_instant(sim_now()) + Duration::from_nanos(1_234_567_891);
                let at = c.sim_instant(deadline);
                assert!(c.local_instant(at) >= deadline, "due at {ppm} ppm");
                assert!(
                    c.local_instant(at - Duration::from_nanos(1)) < deadline,
                    "not due a nanosecond earlier at {ppm} ppm"
                );
                // A deadline already passed is due at once.
                assert_eq!(c.sim_instant(c.local_instant(sim_now())), sim_now());
            }
        });
    }
}
