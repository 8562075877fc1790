//! The primary's side of a write: order it against overlapping writes, forward it
//! to every replica and apply it locally at the same time, and answer once every
//! copy has applied it. Replicas apply forwarded writes in `execute`.

use crate::pg::MapView;
use crate::shard::Shard;
use flame_common::protocol::{Message, flags, status};
use flame_common::reactor;
use std::rc::Rc;

impl Shard {
    /// Primary path: order against overlapping writes, forward to the replicas and
    /// apply locally in parallel, answer once every copy has applied.
    pub(crate) async fn replicate(self: &Rc<Self>, view: &Rc<MapView>, msg: Message) -> i32 {
        let map = &view.map;
        let target = match &msg {
            Message::Write { target, .. }
            | Message::WriteZeroes { target, .. }
            | Message::Discard { target, .. } => target.clone(),
            _ => return status::EINVAL,
        };
        // Register before the first await: admission order is arrival order.
        let (_guard, earlier) =
            self.gate
                .enter(target.object, target.offset, target.offset + target.length);
        let set = view.table.osds(target.pg);
        // Every copy or none: with fewer OSDs in than the pool's size, a write would
        // be acknowledged with fewer copies than promised.
        if set.len() < map.pool.size as usize {
            return status::EAGAIN;
        }
        // A replica known to be down cannot apply the write: fail fast, the client
        // waits and retries until it is back.
        let replicas = &set[1..];
        if !replicas
            .iter()
            .all(|id| map.osds.get(id).is_some_and(|o| o.up))
        {
            return status::EAGAIN;
        }
        for e in earlier {
            e.wait().await;
        }
        // One copy of the payload per replica: each send queue owns its bytes.
        let calls: Vec<_> = replicas
            .iter()
            .map(|&id| {
                let peers = self.peers.clone();
                let fwd = with_replica_flag(&msg);
                let view = view.clone();
                reactor::spawn(async move {
                    // Checked above: every replica is in this view's map.
                    let Some(osd) = view.map.osds.get(&id) else {
                        return status::EAGAIN;
                    };
                    peers
                        .call(osd, osd.shard_of(target.pg), view.map.epoch, fwd)
                        .await
                })
            })
            .collect();
        let local = self.apply_local(msg).await;
        let mut result = local;
        for c in calls {
            let st = c.await;
            if result == status::OK && st != status::OK {
                // A replica's ESTALE means maps disagree: the client refreshes and
                // retries, as for EAGAIN.
                result = if st == status::ESTALE {
                    status::EAGAIN
                } else {
                    st
                };
            }
        }
        result
    }
}

fn with_replica_flag(msg: &Message) -> Message {
    let mut m = msg.clone();
    if let Message::Write { flags: f, .. }
    | Message::WriteZeroes { flags: f, .. }
    | Message::Discard { flags: f, .. } = &mut m
    {
        *f |= flags::REPLICA;
    }
    m
}
