//! A new primary tells the previous one about its map before it serves clients.
//!
//! When this shard becomes a group's primary while the group's previous primary
//! is still up ([`crate::shard::Shard::view`] notices), that OSD may still be
//! serving reads to clients with the old map — and this shard would acknowledge
//! writes those reads do not see. The group's core therefore holds client I/O
//! back ([`crate::pg_core::PgCore::await_previous_primary`]) until the previous
//! primary has answered a request carrying the new map (it then serves no client
//! I/O until it has fetched that map, see `peer_epoch` in [`crate::execute`]), or
//! until the lease ran out. This task sends those requests: a replica-flagged
//! zero-length read of the group, whose answer — any answer — is the proof.

use crate::shard::Shard;
use flame_common::collections::HashSet;
use flame_common::ids::{ObjectId, OsdId, PgId, RequestId, VolumeId};
use flame_common::protocol::{IoTarget, Message, flags};
use flame_common::reactor;

use std::rc::Rc;
use std::time::Duration;

/// How often a previous primary that did not answer is asked again.
const RETRY_INTERVAL: Duration = Duration::from_millis(200);

/// Runs for the life of the shard.
pub(crate) async fn activation_loop(shard: Rc<Shard>) {
    let probing: Rc<std::cell::RefCell<HashSet<PgId>>> = Rc::default();
    loop {
        let waiting: Vec<(PgId, OsdId)> = shard
            .pgs
            .borrow()
            .iter()
            .filter_map(|(pg, c)| c.waiting_for().map(|p| (*pg, p)))
            .collect();
        let idle = waiting.is_empty();
        // Bounded: at most one probe per group in flight.
        for (pg, previous) in waiting {
            if !probing.borrow_mut().insert(pg) {
                continue;
            }
            let (shard, probing) = (shard.clone(), probing.clone());
            reactor::spawn(async move {
                if probe(&shard, pg, previous).await
                    && let Some(c) = shard.pgs.borrow_mut().existing_mut(pg)
                {
                    c.previous_primary_saw_map(previous);
                }
                probing.borrow_mut().remove(&pg);
            })
            .detach();
        }
        if idle {
            // Nothing to tell anyone: no timer, only the next primacy change.
            shard.activation_wake.wait().await;
        } else {
            futures_lite::future::or(shard.activation_wake.wait(), reactor::sleep(RETRY_INTERVAL))
                .await;
        }
    }
}

/// Sends `previous` a request carrying this shard's map for `pg`; whether it
/// answered.
async fn probe(shard: &Rc<Shard>, pg: PgId, previous: OsdId) -> bool {
    let view = shard.view();
    let Some(osd) = view.map.osds.get(&previous) else {
        return false;
    };
    let msg = Message::Read {
        id: RequestId(0),
        epoch: view.map.epoch,
        target: IoTarget {
            pg,
            object: ObjectId {
                volume: VolumeId(0),
                index: 0,
            },
            offset: 0,
            length: 0,
        },
        flags: flags::REPLICA,
        remote: None,
    };
    let answered = matches!(
        shard
            .peers
            .call_reply(osd, osd.shard_of(pg), view.map.epoch, msg)
            .await,
        Ok(Message::Reply { .. })
    );
    if answered {
        tracing::debug!(%pg, %previous, epoch = %view.map.epoch, "previous primary saw the new map");
    }
    answered
}
