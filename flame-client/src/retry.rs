//! When to retry, and how long to wait between tries.
//!
//! A block-device client must ride out the normal turbulence of a cluster — a map
//! change moving a placement group, an OSD restarting, a replica briefly unreachable
//! — without surfacing errors the application cannot do anything about. So every
//! transient condition is retried with exponential backoff (10 ms doubling up to
//! 500 ms, so a brief blip costs milliseconds and a long outage costs little CPU)
//! until the request's deadline, and only final answers are returned.

use flame_common::protocol::status;
use std::time::{Duration, Instant};

/// First wait after a transient failure.
pub const BACKOFF_INITIAL: Duration = Duration::from_millis(10);
/// Longest wait between two tries.
pub const BACKOFF_MAX: Duration = Duration::from_millis(500);

/// Why a try is being repeated. Also the `reason` label of
/// `flame_client_retries_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RetryReason {
    /// The OSD answered ESTALE: our map (or its map) is out of date.
    Stale,
    /// The OSD answered EAGAIN: a replica was unreachable.
    Again,
    /// Connecting, the Hello, or the connection itself failed.
    Connection,
    /// The map says the primary is down: wait for it (or for a new map).
    OsdDown,
    /// The map has no OSD for the placement group (none `in`).
    NoOsds,
    /// The primary refused the write as superseded (`status::SUPERSEDED`): a newer
    /// write of this client to overlapping bytes was applied first. The write is
    /// re-issued under a new op sequence number, so it lands after that one.
    Superseded,
}

impl RetryReason {
    /// Label for metrics and messages.
    pub fn name(self) -> &'static str {
        match self {
            RetryReason::Stale => "estale",
            RetryReason::Again => "eagain",
            RetryReason::Connection => "connection",
            RetryReason::OsdDown => "osd_down",
            RetryReason::NoOsds => "no_osds",
            RetryReason::Superseded => "superseded",
        }
    }

    /// Whether the map is likely out of date, so a fresh one should be awaited before
    /// the next try rather than merely requested.
    pub fn wants_fresh_map(self) -> bool {
        matches!(self, RetryReason::Stale)
    }
}

/// What an OSD reply status means for the client.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Success.
    Done,
    /// Try again (after backoff) for this reason.
    Retry(RetryReason),
    /// A final error: return it.
    Fail,
}

/// Classifies a reply status.
pub fn classify(st: i32) -> Verdict {
    match st {
        status::OK => Verdict::Done,
        status::ESTALE => Verdict::Retry(RetryReason::Stale),
        status::EAGAIN => Verdict::Retry(RetryReason::Again),
        status::SUPERSEDED => Verdict::Retry(RetryReason::Superseded),
        _ => Verdict::Fail,
    }
}

/// Exponential backoff bounded by a deadline.
#[derive(Clone, Debug)]
pub struct Backoff {
    next: Duration,
    deadline: Instant,
}

impl Backoff {
    /// Backoff for a request that must finish by `deadline`.
    pub fn new(deadline: Instant) -> Backoff {
        Backoff {
            next: BACKOFF_INITIAL,
            deadline,
        }
    }

    /// The wait before the next try, or `None` if the deadline has passed. The last
    /// wait is cut short at the deadline, so the final try happens just before it
    /// rather than never.
    pub fn next_delay(&mut self, now: Instant) -> Option<Duration> {
        let left = self.deadline.checked_duration_since(now)?;
        if left.is_zero() {
            return None;
        }
        let d = self.next.min(left);
        self.next = (self.next * 2).min(BACKOFF_MAX);
        Some(d)
    }

    /// The request's deadline.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap() {
        let now = Instant::now();
        let mut b = Backoff::new(now + Duration::from_secs(60));
        let ms: Vec<u128> = (0..9)
            .map(|_| b.next_delay(now).unwrap().as_millis())
            .collect();
        assert_eq!(ms, vec![10, 20, 40, 80, 160, 320, 500, 500, 500]);
    }

    #[test]
    fn stops_at_the_deadline_and_trims_the_last_wait() {
        let now = Instant::now();
        let mut b = Backoff::new(now + Duration::from_millis(25));
        assert_eq!(b.next_delay(now), Some(Duration::from_millis(10)));
        // 20 ms would be next, but only 15 ms are left at `now + 10ms`.
        let later = now + Duration::from_millis(10);
        assert_eq!(b.next_delay(later), Some(Duration::from_millis(15)));
        assert_eq!(b.next_delay(now + Duration::from_millis(25)), None);
        assert_eq!(b.next_delay(now + Duration::from_secs(1)), None);
    }

    #[test]
    fn statuses() {
        assert_eq!(classify(0), Verdict::Done);
        assert_eq!(classify(status::ESTALE), Verdict::Retry(RetryReason::Stale));
        assert_eq!(classify(status::EAGAIN), Verdict::Retry(RetryReason::Again));
        assert_eq!(
            classify(status::SUPERSEDED),
            Verdict::Retry(RetryReason::Superseded)
        );
        assert_eq!(classify(status::EIO), Verdict::Fail);
        assert_eq!(classify(status::EINVAL), Verdict::Fail);
        assert_eq!(classify(status::ENOSPC), Verdict::Fail);
        assert_eq!(classify(-9999), Verdict::Fail);
        assert!(RetryReason::Stale.wants_fresh_map());
        assert!(!RetryReason::Again.wants_fresh_map());
    }
}
