//! Failure detection: OSDs that stop heartbeating are marked down, and OSDs down
//! for `down_out_interval_ms` are marked out.
//!
//! Down keeps the OSD's placement: its placement groups go on with the complete
//! copies that are up (at least `pool.min_size`) and it is recovered when it comes
//! back. Out moves its placement groups to other OSDs, which are recovered from the
//! remaining complete copies (the old homes keep serving meanwhile), so a dead
//! machine does not leave the pool short of copies for longer than the interval.
//! OSDs also report unreachable peers (`POST /v1/osd/failure`), which marks them
//! down sooner than the grace: see `ClusterState::failure_report`.

use crate::shared::Shared;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::MissedTickBehavior;
use tracing::{error, warn};

/// The failure detector's settings (from `MgrConfig`).
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// `heartbeat_grace_ms`: silence after which an up OSD is marked down.
    pub grace: Duration,
    /// `failure_check_interval_ms`: how often to look.
    pub interval: Duration,
    /// `down_out_interval_ms`: how long down before out (zero: never).
    pub down_out: Duration,
}

/// Checks every `t.interval` for up OSDs silent for more than `t.grace` and for
/// OSDs down longer than `t.down_out`; runs forever.
pub async fn run(shared: Arc<Shared>, t: Timing) {
    let mut tick = tokio::time::interval(t.interval);
    // After a stall (e.g. a slow fsync) do not fire a burst of checks.
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let result = shared
            .commit(move |state, now| {
                let (down, out) = state.check_failures(now, t.grace, t.down_out);
                Ok((down, out, state.epoch()))
            })
            .await;
        match result {
            Ok((down, out, epoch)) => {
                for id in down {
                    warn!(
                        "{id} marked down: no heartbeat for more than {} ms, or reported \
                         unreachable by its peers (map {epoch})",
                        t.grace.as_millis()
                    );
                }
                for id in out {
                    warn!(
                        "{id} marked out: down for {} ms (down_out_interval_ms); its \
                         placement groups are recovered on other OSDs (map {epoch})",
                        t.down_out.as_millis()
                    );
                }
            }
            // Nothing changed; the next tick tries again.
            Err(e) => error!("failure check could not mark OSDs down or out: {e}"),
        }
    }
}
