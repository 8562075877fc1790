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
//! Everything that decides by time reads [`now`] (and [`elapsed`]) instead of
//! `Instant::now()`: the reactor's timers, the OSD's leases and retries, the
//! client's deadlines. Off the simulator it costs one thread-local read.

use std::cell::Cell;
use std::time::{Duration, Instant};

thread_local! {
    /// `Some`: this thread runs in virtual time, and this is the current instant.
    static VIRTUAL_NOW: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// The current instant: virtual on a simulated thread, real otherwise.
#[inline]
pub fn now() -> Instant {
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
/// simulated thread a virtual wall clock that moves with [`now`].
pub fn unix_ms() -> u64 {
    if let Some(base) = VIRTUAL_WALL_BASE.try_with(Cell::get).ok().flatten() {
        let since = now().saturating_duration_since(base).as_millis();
        return VIRTUAL_UNIX_MS_START.saturating_add(u64::try_from(since).unwrap_or(u64::MAX));
    }
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Whether this thread runs in virtual time.
pub fn is_simulated() -> bool {
    VIRTUAL_NOW.try_with(Cell::get).ok().flatten().is_some()
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

/// Moves this thread's virtual clock forward to `to` (never backward). Panics on
/// a thread that is not in virtual time: a simulator bug.
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
    advance_to(now() + by);
}

/// Switches this thread back to real time (the end of a simulation).
pub fn real() {
    VIRTUAL_NOW.with(|c| c.set(None));
    VIRTUAL_WALL_BASE.with(|w| w.set(None));
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
