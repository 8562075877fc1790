//! Clock skew and drift of the simulated OSDs (issue 30: "clock skew and drift
//! within the documented bound").
//!
//! The manager is the simulator's reference clock. Each OSD gets a
//! [`NodeClock`](flame_common::clock::NodeClock): its wall clock set up to
//! [`SKEW_MS_MAX`] apart (what ticket expiry and handshake times see), and its
//! monotonic clock running fast or slow by up to [`drift_bound_ppm`] — the most
//! drift for which the lease still fences a cut-off OSD (docs/guarantees.md,
//! "Why the lease fences a cut-off primary"): with the OSD's clock slow by ε its
//! lease lasts `lease_ms / (1 − ε)` of the manager's time, and the manager's
//! clock, fast by ε, waits `grace / (1 + ε)`; the rule keeps
//! `lease · (1 + ε) / (1 − ε) ≤ lease + interval < grace`, which holds for
//! ε ≤ interval / (2 · lease + interval).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The most wall-clock skew an OSD is given, either way (NTP keeps real hosts
/// far closer; two seconds is a host whose NTP has failed).
pub const SKEW_MS_MAX: i64 = 2_000;

/// The most clock-rate drift, in parts per million, for which
/// `lease_ms · (1 + ε) / (1 − ε) ≤ lease_ms + heartbeat_interval_ms`:
/// ε = interval / (2 · lease + interval). With the lease rule
/// `lease_ms + heartbeat_interval_ms < heartbeat_grace_ms` the lease then runs
/// out before the manager's grace even when the OSD's clock is slow and the
/// manager's fast by ε. Defaults (4 000 and 1 000 ms): 111 111 ppm (11 %);
/// the simulator's (1 500 and 500 ms): 142 857 ppm.
pub fn drift_bound_ppm(lease_ms: u64, heartbeat_interval_ms: u64) -> i64 {
    let den = 2 * u128::from(lease_ms) + u128::from(heartbeat_interval_ms);
    if den == 0 {
        return 0;
    }
    i64::try_from(u128::from(heartbeat_interval_ms) * 1_000_000 / den).unwrap_or(i64::MAX)
}

/// Each of `osds` OSDs' (skew ms, drift ppm), drawn from `seed` with an RNG of
/// their own (so the seed's other draws stay as they were): skew uniform in
/// ±[`SKEW_MS_MAX`], drift uniform within ±`drift_max_ppm`.
pub fn draw(seed: u64, osds: usize, drift_max_ppm: i64) -> Vec<(i64, i64)> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0xc10c_5eed_d81f_7000);
    let drift_max_ppm = drift_max_ppm.max(0);
    (0..osds)
        .map(|_| {
            (
                rng.random_range(-SKEW_MS_MAX..=SKEW_MS_MAX),
                rng.random_range(-drift_max_ppm..=drift_max_ppm),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bound keeps the lease inside the grace for the worst pairing: an OSD
    /// clock slow by ε and a manager clock fast by ε.
    #[test]
    fn the_drift_bound_keeps_the_lease_inside_the_grace() {
        for (lease, interval) in [(4000u64, 1000u64), (1500, 500), (2000, 1000), (600, 300)] {
            let e = drift_bound_ppm(lease, interval) as f64 / 1e6;
            let lease_seen = lease as f64 * (1.0 + e) / (1.0 - e);
            assert!(
                lease_seen <= (lease + interval) as f64 + 1e-6,
                "{lease}/{interval}"
            );
            // And it is the bound: 1 % more drift breaks it.
            let e = e * 1.01;
            assert!(lease as f64 * (1.0 + e) / (1.0 - e) > (lease + interval) as f64);
        }
        assert_eq!(drift_bound_ppm(4000, 1000), 111_111);
        assert_eq!(drift_bound_ppm(1500, 500), 142_857);
        assert_eq!(drift_bound_ppm(0, 0), 0);
    }

    #[test]
    fn draws_stay_within_their_bounds_and_replay() {
        let a = draw(7, 9, 100_000);
        assert_eq!(a, draw(7, 9, 100_000), "a seed replays");
        assert_ne!(a, draw(8, 9, 100_000));
        assert!(
            a.iter()
                .all(|&(s, d)| s.abs() <= SKEW_MS_MAX && d.abs() <= 100_000)
        );
        assert!(draw(7, 3, -5).iter().all(|&(_, d)| d == 0));
    }
}
