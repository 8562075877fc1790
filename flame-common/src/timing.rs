//! The timing rules that tie the OSDs' lease to the manager's failure detection.
//!
//! The lease argument (docs/guarantees.md, "Failover: fencing, the lease, and what
//! the client sees") holds only for some combinations of settings that live in two
//! daemons' configurations: the OSD's `lease_ms` and `heartbeat_interval_ms`, the
//! manager's `heartbeat_grace_ms` and `failure_report_min_silence_ms`. Neither
//! daemon's own validation can see the other's, so the rules are here, pure and
//! once, for every place that has both halves: the OSD at boot (the manager sends
//! its half in [`crate::mgr_api::OsdBootReply::timings`]), the manager's own
//! validation (against the smallest timing any OSD may have) and the simulator
//! (which picks both halves itself).

use serde::{Deserialize, Serialize};

/// Smallest `heartbeat_interval_ms` an OSD accepts (its configuration's bound).
pub const OSD_HEARTBEAT_INTERVAL_MS_MIN: u64 = 10;
/// Largest `heartbeat_interval_ms` an OSD accepts.
pub const OSD_HEARTBEAT_INTERVAL_MS_MAX: u64 = 60_000;
/// Largest `lease_ms` an OSD accepts.
pub const OSD_LEASE_MS_MAX: u64 = 600_000;

/// An OSD's half of the rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OsdTimings {
    /// `lease_ms`.
    pub lease_ms: u64,
    /// `heartbeat_interval_ms`.
    pub heartbeat_interval_ms: u64,
}

impl OsdTimings {
    /// The smallest timing any OSD may run with ([`check_lease_outlives_heartbeats`]
    /// at the smallest interval): what the manager checks its own settings
    /// against, since it does not know its OSDs' settings when it starts.
    pub const MIN: OsdTimings = OsdTimings {
        lease_ms: 2 * OSD_HEARTBEAT_INTERVAL_MS_MIN,
        heartbeat_interval_ms: OSD_HEARTBEAT_INTERVAL_MS_MIN,
    };
}

/// The manager's half of the rules, as it tells a booting OSD
/// ([`crate::mgr_api::OsdBootReply::timings`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MgrTimings {
    /// `heartbeat_grace_ms`: silence after which the manager marks an OSD down.
    pub heartbeat_grace_ms: u64,
    /// `failure_report_min_silence_ms`: silence after which peers' failure reports
    /// may mark an OSD down.
    pub failure_report_min_silence_ms: u64,
}

/// A combination of settings that breaks a timing rule. Each message names both
/// options of the rule and their values, and which daemon holds which.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TimingError {
    /// `lease_ms + heartbeat_interval_ms >= heartbeat_grace_ms`.
    #[error(
        "the OSD's lease_ms ({lease_ms}) + heartbeat_interval_ms ({interval_ms}) = {sum} ms \
         must be below the manager's heartbeat_grace_ms ({grace_ms}): otherwise a cut-off \
         OSD may still acknowledge I/O after the manager has given its placement groups \
         another primary (docs/guarantees.md, \"Failover\"). Lower lease_ms or \
         heartbeat_interval_ms, or raise heartbeat_grace_ms",
        sum = lease_ms.saturating_add(*interval_ms)
    )]
    LeaseNotBelowGrace {
        /// The OSD's `lease_ms`.
        lease_ms: u64,
        /// The OSD's `heartbeat_interval_ms`.
        interval_ms: u64,
        /// The manager's `heartbeat_grace_ms`.
        grace_ms: u64,
    },
    /// `failure_report_min_silence_ms < lease_ms + heartbeat_interval_ms`.
    #[error(
        "the manager's failure_report_min_silence_ms ({silence_ms}) must be at least the \
         OSD's lease_ms ({lease_ms}) + heartbeat_interval_ms ({interval_ms}) = {sum} ms: \
         otherwise peers' failure reports may mark an OSD down while its lease still runs \
         (docs/guarantees.md, \"Down\"). Lower lease_ms or heartbeat_interval_ms, or raise \
         failure_report_min_silence_ms",
        sum = lease_ms.saturating_add(*interval_ms)
    )]
    SilenceBelowLease {
        /// The OSD's `lease_ms`.
        lease_ms: u64,
        /// The OSD's `heartbeat_interval_ms`.
        interval_ms: u64,
        /// The manager's `failure_report_min_silence_ms`.
        silence_ms: u64,
    },
    /// `lease_ms < 2 * heartbeat_interval_ms`.
    #[error(
        "lease_ms ({lease_ms}) must be at least twice heartbeat_interval_ms \
         ({interval_ms}): otherwise the lease runs out between two heartbeats and the \
         OSD stops serving whenever one reply is late"
    )]
    LeaseBelowTwoIntervals {
        /// The OSD's `lease_ms`.
        lease_ms: u64,
        /// The OSD's `heartbeat_interval_ms`.
        interval_ms: u64,
    },
}

/// The lease rule: `lease_ms + interval_ms < grace_ms`. The manager marks an OSD
/// down no earlier than `grace_ms` after it received the OSD's last heartbeat; the
/// OSD stops serving `lease_ms` after it sent it; the interval is the margin for
/// clock-rate drift and a heartbeat delayed in the network.
pub fn check_lease_rule(lease_ms: u64, interval_ms: u64, grace_ms: u64) -> Result<(), TimingError> {
    if lease_ms.saturating_add(interval_ms) < grace_ms {
        Ok(())
    } else {
        Err(TimingError::LeaseNotBelowGrace {
            lease_ms,
            interval_ms,
            grace_ms,
        })
    }
}

/// The failure-report rule: `silence_ms >= lease_ms + interval_ms`. Reports mark
/// an OSD down only once the manager has not heard from it for `silence_ms`, so
/// the lease argument of [`check_lease_rule`] holds for reports too.
pub fn check_report_silence(
    lease_ms: u64,
    interval_ms: u64,
    silence_ms: u64,
) -> Result<(), TimingError> {
    if silence_ms >= lease_ms.saturating_add(interval_ms) {
        Ok(())
    } else {
        Err(TimingError::SilenceBelowLease {
            lease_ms,
            interval_ms,
            silence_ms,
        })
    }
}

/// The OSD's own rule: `lease_ms >= 2 * interval_ms`, so the lease outlives the
/// gap between two heartbeats with room for one late reply.
pub fn check_lease_outlives_heartbeats(lease_ms: u64, interval_ms: u64) -> Result<(), TimingError> {
    if lease_ms >= interval_ms.saturating_mul(2) {
        Ok(())
    } else {
        Err(TimingError::LeaseBelowTwoIntervals {
            lease_ms,
            interval_ms,
        })
    }
}

/// Every rule between one OSD's timing and the manager's: what an OSD checks at
/// boot, and what the simulator checks of the settings it draws.
pub fn check_osd_against_mgr(osd: OsdTimings, mgr: MgrTimings) -> Result<(), TimingError> {
    check_lease_outlives_heartbeats(osd.lease_ms, osd.heartbeat_interval_ms)?;
    check_lease_rule(
        osd.lease_ms,
        osd.heartbeat_interval_ms,
        mgr.heartbeat_grace_ms,
    )?;
    check_report_silence(
        osd.lease_ms,
        osd.heartbeat_interval_ms,
        mgr.failure_report_min_silence_ms,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const MGR_DEFAULT: MgrTimings = MgrTimings {
        heartbeat_grace_ms: 6000,
        failure_report_min_silence_ms: 5000,
    };
    const OSD_DEFAULT: OsdTimings = OsdTimings {
        lease_ms: 4000,
        heartbeat_interval_ms: 1000,
    };

    #[test]
    fn lease_plus_interval_must_be_below_the_grace() {
        assert_eq!(check_lease_rule(4000, 1000, 6000), Ok(()));
        assert_eq!(check_lease_rule(4000, 1000, 5001), Ok(()));
        // Equal is not below: the simulator's old 1500 + 500 = 2000 grace.
        let e = check_lease_rule(1500, 500, 2000).unwrap_err();
        assert_eq!(
            e,
            TimingError::LeaseNotBelowGrace {
                lease_ms: 1500,
                interval_ms: 500,
                grace_ms: 2000
            }
        );
        let text = e.to_string();
        for part in [
            "lease_ms (1500)",
            "heartbeat_interval_ms (500)",
            "= 2000 ms",
            "heartbeat_grace_ms (2000)",
        ] {
            assert!(text.contains(part), "{part:?} missing from {text}");
        }
        assert!(check_lease_rule(4000, 1000, 4999).is_err());
        // Never overflows into a pass.
        assert!(check_lease_rule(u64::MAX, 1, u64::MAX).is_err());
    }

    #[test]
    fn report_silence_must_cover_lease_plus_interval() {
        assert_eq!(check_report_silence(4000, 1000, 5000), Ok(()));
        assert_eq!(check_report_silence(4000, 1000, 9000), Ok(()));
        let e = check_report_silence(4000, 1000, 4999).unwrap_err();
        let text = e.to_string();
        for part in [
            "failure_report_min_silence_ms (4999)",
            "lease_ms (4000)",
            "heartbeat_interval_ms (1000)",
        ] {
            assert!(text.contains(part), "{part:?} missing from {text}");
        }
        assert!(check_report_silence(u64::MAX, 1, u64::MAX - 1).is_err());
    }

    #[test]
    fn the_lease_must_outlive_two_heartbeat_intervals() {
        assert_eq!(check_lease_outlives_heartbeats(2000, 1000), Ok(()));
        let e = check_lease_outlives_heartbeats(1999, 1000).unwrap_err();
        assert!(e.to_string().contains("lease_ms (1999)"), "{e}");
        assert!(
            e.to_string().contains("heartbeat_interval_ms (1000)"),
            "{e}"
        );
        assert!(check_lease_outlives_heartbeats(u64::MAX - 1, u64::MAX).is_err());
    }

    #[test]
    fn an_osd_is_checked_against_every_rule() {
        assert_eq!(check_osd_against_mgr(OSD_DEFAULT, MGR_DEFAULT), Ok(()));
        let grace = MgrTimings {
            heartbeat_grace_ms: 5000,
            ..MGR_DEFAULT
        };
        assert!(matches!(
            check_osd_against_mgr(OSD_DEFAULT, grace),
            Err(TimingError::LeaseNotBelowGrace { .. })
        ));
        let silence = MgrTimings {
            failure_report_min_silence_ms: 4000,
            ..MGR_DEFAULT
        };
        assert!(matches!(
            check_osd_against_mgr(OSD_DEFAULT, silence),
            Err(TimingError::SilenceBelowLease { .. })
        ));
        let short = OsdTimings {
            lease_ms: 1500,
            heartbeat_interval_ms: 1000,
        };
        assert!(matches!(
            check_osd_against_mgr(short, MGR_DEFAULT),
            Err(TimingError::LeaseBelowTwoIntervals { .. })
        ));
        // The smallest OSD timing is itself valid.
        assert_eq!(
            check_lease_outlives_heartbeats(
                OsdTimings::MIN.lease_ms,
                OsdTimings::MIN.heartbeat_interval_ms
            ),
            Ok(())
        );
    }

    #[test]
    fn timings_travel_as_json() {
        let text = serde_json::to_string(&MGR_DEFAULT).unwrap();
        assert_eq!(
            text,
            r#"{"heartbeat_grace_ms":6000,"failure_report_min_silence_ms":5000}"#
        );
        let back: MgrTimings = serde_json::from_str(&text).unwrap();
        assert_eq!(back, MGR_DEFAULT);
    }
}
