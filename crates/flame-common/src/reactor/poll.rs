//! How an idle reactor waits for work: the Flame thesis's dynamic counting polling.
//!
//! * `interrupt` — block in the kernel at once (lowest CPU, adds a wake-up to every
//!   completion's latency).
//! * `busy` — never block; spin on the completion queue (lowest latency, a full core).
//! * `adaptive` — after work, keep polling up to `N` empty polls before blocking.
//!   `N` follows recent history: when work tends to arrive after `k` empty polls, `N`
//!   settles a margin above `k`; when spinning keeps ending in sleep, `N` shrinks. It
//!   is bounded by `[spin_min, spin_max]`, so the cost of a wrong guess is bounded.

use serde::{Deserialize, Serialize};

/// Idle strategy of a reactor thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PollMode {
    /// Sleep in the kernel as soon as there is nothing to do.
    Interrupt,
    /// Spin forever.
    Busy,
    /// Spin a history-driven number of empty polls, then sleep.
    Adaptive,
}

/// Counters exposed for metrics and benchmarks.
#[derive(Clone, Copy, Debug, Default)]
pub struct PollStats {
    /// Empty polls performed.
    pub empty_polls: u64,
    /// Times spinning found work.
    pub spin_hits: u64,
    /// Times the thread blocked in the kernel.
    pub sleeps: u64,
    /// Current adaptive spin budget.
    pub budget: u32,
}

const SPIN_MIN: u32 = 16;
const SPIN_MAX: u32 = 1 << 16;

/// Idle-loop state of one reactor.
pub(crate) struct Poller {
    mode: PollMode,
    /// Adaptive budget of empty polls before sleeping.
    budget: u32,
    /// Exponential moving average of empty polls that preceded a hit (×16 fixed point).
    avg_hit_polls_x16: u64,
    stats: PollStats,
}

impl Poller {
    pub(crate) fn new(mode: PollMode) -> Poller {
        Poller {
            mode,
            budget: 1024,
            avg_hit_polls_x16: 1024 * 16,
            stats: PollStats::default(),
        }
    }

    pub(crate) fn stats(&self) -> PollStats {
        PollStats {
            budget: self.budget,
            ..self.stats
        }
    }

    pub(crate) fn record_work(&mut self) {}

    pub(crate) fn record_sleep(&mut self) {
        self.stats.sleeps += 1;
        if self.mode == PollMode::Adaptive {
            // Spinning did not pay off this time: shrink towards the floor.
            self.budget = (self.budget - self.budget / 4).max(SPIN_MIN);
        }
    }

    /// Polls `ready` up to the mode's budget. Returns true if work turned up (the
    /// caller should run it), false if the caller should sleep.
    pub(crate) fn spin(&mut self, mut ready: impl FnMut() -> bool) -> bool {
        let limit = match self.mode {
            PollMode::Interrupt => return false,
            PollMode::Busy => u32::MAX,
            PollMode::Adaptive => self.budget,
        };
        let mut polls: u32 = 0;
        while polls < limit {
            if ready() {
                self.stats.spin_hits += 1;
                self.stats.empty_polls += u64::from(polls);
                if self.mode == PollMode::Adaptive {
                    // EMA with weight 1/8 of the polls it took; budget = 2× average.
                    let sample = u64::from(polls) * 16;
                    self.avg_hit_polls_x16 = (self.avg_hit_polls_x16 * 7 + sample) / 8;
                    let want = (self.avg_hit_polls_x16 * 2 / 16) as u32;
                    self.budget = want.clamp(SPIN_MIN, SPIN_MAX);
                }
                return true;
            }
            polls += 1;
            std::hint::spin_loop();
        }
        self.stats.empty_polls += u64::from(polls);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adaptive_budget_tracks_history_within_bounds() {
        let mut p = Poller::new(PollMode::Adaptive);
        // Work always arrives after 100 polls.
        for _ in 0..64 {
            let mut n = 0;
            assert!(p.spin(|| {
                n += 1;
                n > 100
            }));
        }
        let b = p.stats().budget;
        assert!((150..=260).contains(&b), "budget {b}");
        // Work stops coming: every spin ends in sleep and the budget decays to the floor.
        for _ in 0..64 {
            assert!(!p.spin(|| false));
            p.record_sleep();
        }
        assert_eq!(p.stats().budget, SPIN_MIN);
    }

    #[test]
    fn interrupt_never_spins() {
        let mut p = Poller::new(PollMode::Interrupt);
        let mut called = false;
        assert!(!p.spin(|| {
            called = true;
            true
        }));
        assert!(!called);
    }
}
