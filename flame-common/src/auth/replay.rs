//! Refusing replayed and stale signed requests.

use super::Nonce;
use std::collections::BTreeSet;

/// How far a request's time may be from the manager's clock, either way. Clocks of
/// a cluster's hosts must agree within this (NTP keeps them within milliseconds);
/// a captured request can be replayed at most this long, and the guard below
/// refuses even that.
pub const REPLAY_WINDOW_MS: u64 = 60_000;
/// Most requests remembered at once: `2 × REPLAY_WINDOW_MS` of requests at ~2 000
/// per second, about 10 MiB. Only signed (verified) requests are remembered, so
/// only a key holder can fill it; a full guard refuses new requests (the caller
/// retries) rather than forgetting one that could then be replayed.
pub const REPLAY_ENTRIES_MAX: usize = 262_144;

/// Why a request's time or nonce was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayRefusal {
    /// Older than the window: replayed, or the sender's clock is behind.
    Stale {
        /// How far behind, in milliseconds.
        behind_ms: u64,
    },
    /// Newer than the window: the sender's clock is ahead.
    Future {
        /// How far ahead, in milliseconds.
        ahead_ms: u64,
    },
    /// The same time and nonce were seen already.
    Replayed,
    /// The guard holds [`REPLAY_ENTRIES_MAX`] requests.
    Full,
}

impl std::fmt::Display for ReplayRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplayRefusal::Stale { behind_ms } => write!(
                f,
                "request time is {behind_ms} ms behind the manager's clock (more than \
                 {REPLAY_WINDOW_MS} ms): a replayed request, or this host's clock is wrong"
            ),
            ReplayRefusal::Future { ahead_ms } => write!(
                f,
                "request time is {ahead_ms} ms ahead of the manager's clock (more than \
                 {REPLAY_WINDOW_MS} ms): this host's clock is wrong"
            ),
            ReplayRefusal::Replayed => f.write_str("request replayed (its nonce was seen)"),
            ReplayRefusal::Full => f.write_str("too many requests in the replay window; retry"),
        }
    }
}

/// The signed requests of the last window, by (time, nonce). Pure: the caller
/// gives the time, so tests drive it directly.
#[derive(Debug)]
pub struct ReplayGuard {
    /// Ordered by time first, so expiry pops from the front.
    seen: BTreeSet<(u64, Nonce)>,
    /// Most entries held ([`ReplayRefusal::Full`] beyond).
    entries_max: usize,
}

impl Default for ReplayGuard {
    fn default() -> ReplayGuard {
        ReplayGuard::with_capacity(REPLAY_ENTRIES_MAX)
    }
}

impl ReplayGuard {
    /// An empty guard of [`REPLAY_ENTRIES_MAX`] entries (the manager's).
    pub fn new() -> ReplayGuard {
        ReplayGuard::default()
    }

    /// An empty guard of at most `entries_max` entries (an OSD shard's, which
    /// sees connections, not requests).
    pub fn with_capacity(entries_max: usize) -> ReplayGuard {
        ReplayGuard {
            seen: BTreeSet::new(),
            entries_max,
        }
    }

    /// Accepts a request signed at `time_ms` with `nonce` if it is within the
    /// window around `now_ms` and new, and remembers it.
    pub fn check(&mut self, now_ms: u64, time_ms: u64, nonce: Nonce) -> Result<(), ReplayRefusal> {
        let oldest_ms = now_ms.saturating_sub(REPLAY_WINDOW_MS);
        // Bounded by the set's size; each entry is removed once.
        while let Some(&(t, _)) = self.seen.first() {
            if t >= oldest_ms {
                break;
            }
            self.seen.pop_first();
        }
        if time_ms < oldest_ms {
            return Err(ReplayRefusal::Stale {
                behind_ms: now_ms - time_ms,
            });
        }
        if time_ms > now_ms.saturating_add(REPLAY_WINDOW_MS) {
            return Err(ReplayRefusal::Future {
                ahead_ms: time_ms - now_ms,
            });
        }
        if self.seen.contains(&(time_ms, nonce)) {
            return Err(ReplayRefusal::Replayed);
        }
        if self.seen.len() >= self.entries_max {
            return Err(ReplayRefusal::Full);
        }
        self.seen.insert((time_ms, nonce));
        debug_assert!(self.seen.len() <= self.entries_max);
        Ok(())
    }

    /// Requests remembered.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(i: u8) -> Nonce {
        Nonce([i; 16])
    }

    #[test]
    fn every_branch() {
        let mut g = ReplayGuard::new();
        let now = 1_000_000;
        assert_eq!(g.check(now, now, n(1)), Ok(()));
        assert_eq!(g.check(now, now, n(1)), Err(ReplayRefusal::Replayed));
        // Same nonce at another time is another request (the time is signed).
        assert_eq!(g.check(now, now + 1, n(1)), Ok(()));
        assert_eq!(
            g.check(now, now - REPLAY_WINDOW_MS - 1, n(2)),
            Err(ReplayRefusal::Stale {
                behind_ms: REPLAY_WINDOW_MS + 1
            })
        );
        assert_eq!(g.check(now, now - REPLAY_WINDOW_MS, n(2)), Ok(()));
        assert_eq!(
            g.check(now, now + REPLAY_WINDOW_MS + 1, n(3)),
            Err(ReplayRefusal::Future {
                ahead_ms: REPLAY_WINDOW_MS + 1
            })
        );
        assert_eq!(g.check(now, now + REPLAY_WINDOW_MS, n(3)), Ok(()));
        assert_eq!(g.len(), 4);
        // Later, the old entries expire, and a replay of them is stale, not new.
        let later = now + REPLAY_WINDOW_MS + 2;
        assert!(matches!(
            g.check(later, now, n(1)),
            Err(ReplayRefusal::Stale { .. })
        ));
        assert_eq!(g.len(), 1, "only the one from the future is left");
        // A clock before the window's size does not underflow.
        assert_eq!(ReplayGuard::new().check(5, 0, n(9)), Ok(()));
    }

    #[test]
    fn full_refuses_rather_than_forgets() {
        let mut g = ReplayGuard::new();
        let now = 10 * REPLAY_WINDOW_MS;
        for i in 0..REPLAY_ENTRIES_MAX as u64 {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&i.to_le_bytes());
            assert_eq!(g.check(now, now, Nonce(b)), Ok(()));
        }
        assert_eq!(g.check(now, now, n(0xee)), Err(ReplayRefusal::Full));
        // Once the window moves on, there is room again.
        assert_eq!(
            g.check(
                now + REPLAY_WINDOW_MS + 1,
                now + REPLAY_WINDOW_MS + 1,
                n(0xee)
            ),
            Ok(())
        );
        assert_eq!(g.len(), 1);
    }
}
