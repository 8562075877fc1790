//! What the shard threads and the control thread share about this OSD's health:
//! the lease (may this OSD serve I/O at all?), each shard's last sign of progress
//! (may the control thread vouch for this OSD in a heartbeat?), and the peers the
//! shards could not reach (to report to the manager).
//!
//! The lease is the fence that keeps a cut-off old primary from acknowledging
//! anything once the manager can have replaced it: the manager picks a successor
//! only after an OSD has been silent for `heartbeat_grace_ms`, and the lease —
//! counted from when the last *acknowledged* heartbeat was *sent* — runs out
//! before that (`lease_ms + heartbeat_interval_ms < heartbeat_grace_ms`, see
//! docs/guarantees.md). Every time here is monotonic (`Instant`), in
//! milliseconds since [`Liveness::new`].

use flame_common::clock;
use flame_common::ids::OsdId;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// Most unreachable-peer reports queued between two control-thread rounds; more
/// are dropped (one per peer per second is all the manager is told anyway).
const FAILED_PEERS_QUEUED_MAX: usize = 1024;

/// Health state shared by one OSD's threads.
pub struct Liveness {
    base: Instant,
    /// The lease runs until this time (ms since `base`); 0 = no lease yet.
    lease_until_ms: AtomicU64,
    /// Per shard: the last time (ms since `base`) its reactor loop ran its
    /// progress task.
    progress_ms: Vec<AtomicU64>,
    /// Peers a shard could not reach since the control thread last looked.
    failed_peers: Mutex<Vec<OsdId>>,
    /// Reads and writes refused because the lease had run out (on arrival or
    /// before their `OK`), since start: how often the fence acted (the
    /// simulator's report shows it, so a run proves the branch is taken).
    pub lease_refusals: AtomicU64,
    /// Test hook (`failpoints` feature): shards that must hang (their threads
    /// block, as a stuck disk or a livelock would).
    #[cfg(feature = "failpoints")]
    stalled: Vec<std::sync::atomic::AtomicBool>,
}

impl Liveness {
    /// No lease, every shard counted as having just made progress.
    pub fn new(shards: u16) -> Liveness {
        Liveness {
            base: clock::now(),
            lease_until_ms: AtomicU64::new(0),
            progress_ms: (0..shards).map(|_| AtomicU64::new(0)).collect(),
            failed_peers: Mutex::new(Vec::new()),
            lease_refusals: AtomicU64::new(0),
            #[cfg(feature = "failpoints")]
            stalled: (0..shards)
                .map(|_| std::sync::atomic::AtomicBool::new(false))
                .collect(),
        }
    }

    /// Milliseconds since this state was created (monotonic).
    pub fn now_ms(&self) -> u64 {
        clock::elapsed(self.base).as_millis() as u64
    }

    /// Whether this OSD may serve and acknowledge I/O now.
    pub fn lease_valid(&self) -> bool {
        self.now_ms() < self.lease_until_ms.load(Ordering::Acquire)
    }

    /// Extends the lease to `sent_ms + lease_ms`, where `sent_ms` is when the
    /// acknowledged heartbeat (or boot) was sent. Never shortens it.
    pub fn renew(&self, sent_ms: u64, lease_ms: u64) {
        self.lease_until_ms
            .fetch_max(sent_ms.saturating_add(lease_ms), Ordering::AcqRel);
    }

    /// Records that shard `shard`'s loop is running.
    pub fn progress(&self, shard: u16) {
        if let Some(p) = self.progress_ms.get(usize::from(shard)) {
            p.store(self.now_ms(), Ordering::Release);
        }
    }

    /// The shards that made no progress within the last `stall_ms` (empty: all
    /// healthy). Shards count from start-up, so a shard that never ran is stalled
    /// once `stall_ms` has passed.
    pub fn stalled_shards(&self, stall_ms: u64) -> Vec<u16> {
        let now = self.now_ms();
        self.progress_ms
            .iter()
            .enumerate()
            .filter(|(_, p)| now.saturating_sub(p.load(Ordering::Acquire)) > stall_ms)
            .map(|(i, _)| i as u16)
            .collect()
    }

    /// Notes that a shard could not reach `peer` (connect refused or timed out,
    /// connection lost, no answer in time).
    pub fn peer_failed(&self, peer: OsdId) {
        if let Ok(mut q) = self.failed_peers.lock()
            && q.len() < FAILED_PEERS_QUEUED_MAX
            && !q.contains(&peer)
        {
            q.push(peer);
        }
    }

    /// Takes the peers noted since the last call.
    pub fn take_failed_peers(&self) -> Vec<OsdId> {
        self.failed_peers
            .lock()
            .map(|mut q| std::mem::take(&mut *q))
            .unwrap_or_default()
    }

    /// Test hook: makes shard `shard` hang (true) or run again (false).
    #[cfg(feature = "failpoints")]
    pub fn set_stalled(&self, shard: u16, stalled: bool) {
        if let Some(s) = self.stalled.get(usize::from(shard)) {
            s.store(stalled, Ordering::Release);
        }
    }

    /// Test hook: blocks the calling shard thread while it is marked stalled.
    #[cfg(feature = "failpoints")]
    pub fn hang_while_stalled(&self, shard: u16) {
        let Some(s) = self.stalled.get(usize::from(shard)) else {
            return;
        };
        // Bounded by the test that set it: it clears the flag.
        while s.load(Ordering::Acquire) {
            clock::sleep_blocking(std::time::Duration::from_millis(20));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_starts_invalid_and_only_grows() {
        let l = Liveness::new(2);
        assert!(
            !l.lease_valid(),
            "no lease before the first acknowledged heartbeat"
        );
        l.renew(l.now_ms(), 60_000);
        assert!(l.lease_valid());
        // An older acknowledgement never shortens the lease.
        l.renew(0, 1);
        assert!(l.lease_valid());
        let l = Liveness::new(1);
        l.renew(0, 0);
        assert!(!l.lease_valid(), "an expired lease does not serve");
    }

    #[test]
    fn stalled_shards_and_failed_peers() {
        let l = Liveness::new(2);
        std::thread::sleep(std::time::Duration::from_millis(30));
        assert_eq!(l.stalled_shards(10), vec![0, 1]);
        l.progress(1);
        assert_eq!(l.stalled_shards(10), vec![0]);
        l.progress(0);
        assert!(l.stalled_shards(10).is_empty());
        l.progress(7); // out of range: ignored
        l.peer_failed(OsdId(3));
        l.peer_failed(OsdId(3));
        l.peer_failed(OsdId(4));
        assert_eq!(l.take_failed_peers(), vec![OsdId(3), OsdId(4)]);
        assert!(l.take_failed_peers().is_empty());
    }
}
