//! Stalled connections: a peer that sends a payload's header and then trickles
//! its bytes holds a receive buffer, and one that never reads its replies holds
//! queued buffers; either holds them as long as it likes unless someone closes it.
//! Every byte-stream connection (tcp and rdma connections, flame-nbd's NBD
//! connections) keeps [`StallMarks`] on its data path — two flags and two counters, no clock read —
//! and one watchdog task per connection ([`watch`]) samples them a few times per
//! bound; the decision is the pure [`StallWatch`]. The same marks tell an idle
//! connection (nothing received or sent for [`StallBounds::idle`]), which a
//! daemon may close to free its slot (the OSD's `idle_timeout_ms`; clients and
//! peers reconnect on their next request).
//!
//! The bounds are deadlines on whole units, not on byte progress: a payload must
//! arrive completely within [`StallBounds::payload_recv`] of its header (a trickle
//! of one byte a second is progress, and still a stall), and a batch of queued
//! sends must be taken by the peer within [`StallBounds::send`].

use std::cell::Cell;
use std::time::{Duration, Instant};

/// What a connection is stuck on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stall {
    /// Receiving a payload whose header arrived.
    Receive,
    /// Writing queued messages the peer does not read.
    Send,
    /// Nothing received, nothing being sent (the mark counts both).
    Idle,
}

impl Stall {
    /// A label for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            Stall::Receive => "payload_stall",
            Stall::Send => "send_stall",
            Stall::Idle => "idle",
        }
    }
}

/// How long a connection may stay stuck on one thing before it is closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StallBounds {
    /// A payload's bytes after its header.
    pub payload_recv: Duration,
    /// Writing one batch of queued sends the peer does not take.
    pub send: Duration,
    /// Neither receiving nor sending anything; `None`: idle connections stay.
    pub idle: Option<Duration>,
}

impl StallBounds {
    /// Bounds from configured milliseconds; idle connections stay.
    pub fn from_ms(payload_recv_ms: u64, send_ms: u64) -> StallBounds {
        StallBounds {
            payload_recv: Duration::from_millis(payload_recv_ms),
            send: Duration::from_millis(send_ms),
            idle: None,
        }
    }

    /// These bounds, closing connections idle for `idle_ms` (0: never).
    pub fn with_idle_ms(self, idle_ms: u64) -> StallBounds {
        StallBounds {
            idle: (idle_ms > 0).then(|| Duration::from_millis(idle_ms)),
            ..self
        }
    }

    /// The bound of one kind of stall (`None`: that kind is never closed).
    pub fn of(&self, stall: Stall) -> Option<Duration> {
        match stall {
            Stall::Receive => Some(self.payload_recv),
            Stall::Send => Some(self.send),
            Stall::Idle => self.idle,
        }
    }

    /// How often a watchdog samples: a quarter of the smallest bound, so a stall
    /// is closed at most a quarter late, within 25 ms .. 5 s.
    pub fn sample_period(&self) -> Duration {
        let smallest = self
            .payload_recv
            .min(self.send)
            .min(self.idle.unwrap_or(Duration::MAX));
        (smallest / 4).clamp(Duration::from_millis(25), Duration::from_secs(5))
    }
}

/// The data path's side: what a connection is doing now, and how many units of
/// each kind it has finished. Cells: a connection lives on one thread.
#[derive(Debug, Default)]
pub struct StallMarks {
    /// A payload whose header arrived is being received (set only when it did
    /// not come whole with its header: the slow path).
    payload_pending: Cell<bool>,
    payloads_done: Cell<u64>,
    /// The writer is writing a batch.
    sending: Cell<bool>,
    batches_done: Cell<u64>,
    /// Frames (requests, messages) received.
    frames_received: Cell<u64>,
}

impl StallMarks {
    /// A payload's remaining bytes are awaited.
    pub fn payload_started(&self) {
        self.payload_pending.set(true);
    }

    /// The payload being awaited arrived whole (no effect when none was).
    pub fn payload_finished(&self) {
        if self.payload_pending.replace(false) {
            self.payloads_done.set(self.payloads_done.get() + 1);
        }
    }

    /// A whole frame (a request's or message's header) arrived.
    pub fn frame_received(&self) {
        self.frames_received
            .set(self.frames_received.get().wrapping_add(1));
    }

    /// The writer hands a batch to the kernel.
    pub fn send_started(&self) {
        self.sending.set(true);
    }

    /// The batch was written (or failed: the connection then closes).
    pub fn send_finished(&self) {
        self.sending.set(false);
        self.batches_done.set(self.batches_done.get() + 1);
    }

    /// What the connection is waiting on, with a progress mark that changes when
    /// it finishes one unit of it; [`Stall::Idle`] when it waits on nothing (the
    /// mark then changes with every frame received and batch sent). A receive
    /// stall is reported before a send stall.
    pub fn current(&self) -> (Stall, u64) {
        if self.payload_pending.get() {
            return (Stall::Receive, self.payloads_done.get());
        }
        if self.sending.get() {
            return (Stall::Send, self.batches_done.get());
        }
        let activity = self
            .frames_received
            .get()
            .wrapping_add(self.batches_done.get());
        (Stall::Idle, activity)
    }
}

/// The watchdog's decision, without I/O: fed samples of [`StallMarks::current`]
/// (`None`: nothing to watch at this sample) with the time they were taken, it
/// says when one stall has lasted past its bound.
#[derive(Debug)]
pub struct StallWatch {
    bounds: StallBounds,
    /// The stall (kind and mark) seen last, and when it was first seen.
    seen: Option<((Stall, u64), Instant)>,
}

impl StallWatch {
    /// A watch with these bounds, having seen nothing.
    pub fn new(bounds: StallBounds) -> StallWatch {
        StallWatch { bounds, seen: None }
    }

    /// Records a sample; `Some((stall, stuck_for))` when the same stall has
    /// lasted longer than its bound (the connection should be closed). A stall
    /// is measured from the first sample that saw it, so it is closed between
    /// its bound and its bound plus one sample period late.
    pub fn observe(
        &mut self,
        current: Option<(Stall, u64)>,
        now: Instant,
    ) -> Option<(Stall, Duration)> {
        let Some((current, bound)) =
            current.and_then(|c| self.bounds.of(c.0).map(|bound| (c, bound)))
        else {
            // Nothing to watch, or a kind these bounds never close.
            self.seen = None;
            return None;
        };
        let since = match self.seen {
            Some((s, since)) if s == current => since,
            _ => {
                self.seen = Some((current, now));
                return None;
            }
        };
        let stuck = now.saturating_duration_since(since);
        (stuck > bound).then_some((current.0, stuck))
    }
}

/// Watches one connection until `is_closed` says it closed (at most one sample
/// period after): samples `current` every [`StallBounds::sample_period`] and
/// calls `on_stuck` once, with the stall and how long it lasted, when one passes
/// its bound. `on_stuck` closes the connection (and logs and counts). One timer
/// per connection, nothing on the data path. Runs on the current reactor.
pub fn watch(
    bounds: StallBounds,
    current: impl Fn() -> Option<(Stall, u64)> + 'static,
    is_closed: impl Fn() -> bool + 'static,
    on_stuck: impl FnOnce(Stall, Duration) + 'static,
) {
    let every = bounds.sample_period();
    crate::reactor::spawn(async move {
        let mut watch = StallWatch::new(bounds);
        loop {
            crate::reactor::sleep(every).await;
            if is_closed() {
                return;
            }
            if let Some((stall, stuck)) = watch.observe(current(), crate::clock::now()) {
                on_stuck(stall, stuck);
                return;
            }
        }
    })
    .detach();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bounds() -> StallBounds {
        StallBounds::from_ms(1_000, 3_000)
    }

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn marks_report_receive_before_send_and_count_finished_units() {
        let m = StallMarks::default();
        assert_eq!(m.current(), (Stall::Idle, 0));
        m.send_started();
        assert_eq!(m.current(), (Stall::Send, 0));
        m.payload_started();
        assert_eq!(m.current(), (Stall::Receive, 0), "receive first");
        m.payload_finished();
        assert_eq!(m.current(), (Stall::Send, 0));
        m.send_finished();
        assert_eq!(m.current(), (Stall::Idle, 1), "a sent batch is activity");
        m.frame_received();
        assert_eq!(m.current(), (Stall::Idle, 2), "so is a received frame");
        m.send_started();
        assert_eq!(m.current(), (Stall::Send, 1), "a new mark per batch");
        m.payload_finished();
        m.payload_started();
        assert_eq!(
            m.current(),
            (Stall::Receive, 1),
            "finishing none counts none"
        );
    }

    #[test]
    fn idleness_closes_only_with_an_idle_bound() {
        let t0 = Instant::now();
        let idle = Some((Stall::Idle, 7));
        let mut w = StallWatch::new(bounds());
        w.observe(idle, at(t0, 0));
        assert_eq!(w.observe(idle, at(t0, 3_600_000)), None, "no idle bound");
        let mut w = StallWatch::new(bounds().with_idle_ms(2_000));
        w.observe(idle, at(t0, 0));
        assert_eq!(w.observe(idle, at(t0, 1_900)), None);
        // Activity (a new mark) restarts it.
        assert_eq!(w.observe(Some((Stall::Idle, 8)), at(t0, 1_950)), None);
        assert_eq!(w.observe(Some((Stall::Idle, 8)), at(t0, 3_900)), None);
        assert_eq!(
            w.observe(Some((Stall::Idle, 8)), at(t0, 4_000))
                .map(|s| s.0),
            Some(Stall::Idle)
        );
        assert_eq!(bounds().with_idle_ms(0).idle, None, "0 = never");
    }

    #[test]
    fn a_stall_closes_only_after_its_own_bound() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(bounds());
        let recv = Some((Stall::Receive, 4));
        assert_eq!(
            w.observe(recv, at(t0, 0)),
            None,
            "first sight starts the clock"
        );
        assert_eq!(
            w.observe(recv, at(t0, 1_000)),
            None,
            "at the bound: not past it"
        );
        assert_eq!(
            w.observe(recv, at(t0, 1_001)),
            Some((Stall::Receive, Duration::from_millis(1_001)))
        );
        let mut w = StallWatch::new(bounds());
        let send = Some((Stall::Send, 0));
        w.observe(send, at(t0, 0));
        assert_eq!(
            w.observe(send, at(t0, 2_000)),
            None,
            "the send bound is 3 s"
        );
        assert_eq!(
            w.observe(send, at(t0, 3_500)).map(|s| s.0),
            Some(Stall::Send)
        );
    }

    #[test]
    fn progress_or_idleness_restarts_the_clock() {
        let t0 = Instant::now();
        let mut w = StallWatch::new(bounds());
        w.observe(Some((Stall::Receive, 0)), at(t0, 0));
        // One payload finished and the next one is slow: a new stall.
        assert_eq!(w.observe(Some((Stall::Receive, 1)), at(t0, 900)), None);
        assert_eq!(w.observe(Some((Stall::Receive, 1)), at(t0, 1_800)), None);
        // Nothing pending in between: forgotten.
        assert_eq!(w.observe(None, at(t0, 1_850)), None);
        assert_eq!(w.observe(Some((Stall::Receive, 1)), at(t0, 1_900)), None);
        assert_eq!(w.observe(Some((Stall::Receive, 1)), at(t0, 2_800)), None);
        // A different kind is a different stall.
        assert_eq!(w.observe(Some((Stall::Send, 1)), at(t0, 2_850)), None);
        assert!(w.observe(Some((Stall::Send, 1)), at(t0, 5_900)).is_some());
    }

    #[test]
    fn the_sample_period_is_a_quarter_of_the_smaller_bound_within_limits() {
        assert_eq!(bounds().sample_period(), Duration::from_millis(250));
        assert_eq!(
            StallBounds::from_ms(10, 10).sample_period(),
            Duration::from_millis(25)
        );
        assert_eq!(
            StallBounds::from_ms(600_000, 600_000).sample_period(),
            Duration::from_secs(5)
        );
        assert_eq!(
            bounds().with_idle_ms(400).sample_period(),
            Duration::from_millis(100),
            "the idle bound counts"
        );
    }
}
