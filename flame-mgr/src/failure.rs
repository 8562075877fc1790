//! Failure detection: OSDs that stop heartbeating are marked down.
//!
//! Only "down" is automatic. "Out" (which moves an OSD's placement groups to other
//! OSDs) is not, because nothing copies the data over yet: taking an OSD out today
//! would send reads to OSDs that lack the data. Until recovery exists (a later
//! issue), I/O to a down OSD's placement groups waits for it to come back.

use crate::shared::Shared;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::MissedTickBehavior;
use tracing::{error, warn};

/// Checks every `interval` for up OSDs silent for more than `grace`; runs forever.
pub async fn run(shared: Arc<Shared>, grace: Duration, interval: Duration) {
    let mut tick = tokio::time::interval(interval);
    // After a stall (e.g. a slow fsync) do not fire a burst of checks.
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let result = shared
            .commit(move |state, now| {
                let down = state.mark_down_silent(now, grace);
                Ok((down, state.epoch()))
            })
            .await;
        match result {
            Ok((down, epoch)) => {
                for id in down {
                    warn!(
                        "{id} marked down: no heartbeat for more than {} ms (map {epoch})",
                        grace.as_millis()
                    );
                }
            }
            // Nothing changed; the next tick tries again.
            Err(e) => error!("failure check could not mark OSDs down: {e}"),
        }
    }
}
