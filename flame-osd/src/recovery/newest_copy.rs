//! Peering's first step on a new primary: take over every object another
//! complete copy holds newer writes of (Ceph's authoritative log, per object),
//! so that peering then makes the other copies equal to the newest copy rather
//! than to whichever copy became primary. The choice is
//! [`crate::pg_log::PgLog::sources_ahead`] (pure, unit-tested); this module
//! asks the members for their logs and pulls.

use crate::pg::MapView;
use crate::shard::Shard;
use flame_common::ids::{Epoch, ObjectId, OsdId, PgId, RequestId};
use flame_common::placement::PgMembers;
use flame_common::protocol::{LogOps, Message, decode_log_ops};
use std::collections::BTreeMap;
use std::rc::Rc;

impl Shard {
    /// This shard is the new primary of `pg`: asks every other complete copy
    /// for its log's client ops ([`Message::PgLogOps`]) and replaces each object
    /// one of them is ahead on by that member's copy, holding the object's write
    /// gate (an object this shard's own in-flight write was ahead on is checked
    /// again once that write finished, and left alone). A member that does not
    /// answer (unreachable, or its map is older) is left out of the choice: it
    /// may be about to be marked down, or be a deposed primary that cannot
    /// learn the new map, and the group's recovery must not wait for it. An
    /// error pulling an object is returned: the caller then peers nobody this
    /// pass (peering must not push this copy's bytes over newer ones).
    pub(crate) async fn take_newer_copies(
        self: &Rc<Self>,
        view: &Rc<MapView>,
        pg: PgId,
        members: &PgMembers,
    ) -> Result<u64, i32> {
        debug_assert_eq!(members.primary(), Some(self.osd));
        let mut logs: Vec<(OsdId, LogOps)> = Vec::with_capacity(members.acting.len());
        for &member in members.acting.iter().skip(1) {
            let msg = Message::PgLogOps {
                id: RequestId(0),
                epoch: view.map.epoch,
                pg,
            };
            let ops = match self.ask(view, member, pg, msg).await {
                Ok(Message::Reply { data, .. }) => decode_log_ops(&data),
                Ok(_) => None,
                Err(st) => {
                    tracing::debug!(%pg, %member, st, "peering: a copy did not answer with its log; left out of the choice of the newest copy");
                    continue;
                }
            };
            match ops {
                Some(ops) => logs.push((member, ops)),
                None => {
                    tracing::warn!(%pg, %member, "peering: a copy answered with a log that does not decode; left out of the choice of the newest copy");
                }
            }
        }
        let plan = match self.pgs.borrow().log(pg) {
            Some(log) => log.sources_ahead(&logs),
            None => Vec::new(),
        };
        if plan.is_empty() {
            return Ok(0);
        }
        // The members' incarnations in the map they were asked under: a source
        // that restarted since may have lost what its log named.
        let up_from = |v: &MapView, id: OsdId| v.map.osds.get(&id).map(|o| o.up_from);
        let answered: Vec<(OsdId, Option<Epoch>)> = logs
            .iter()
            .map(|(id, _)| (*id, up_from(view, *id)))
            .collect();
        let primacy = self.pgs.borrow().primacy(pg);
        // The members' ops grouped by planned object, in one pass: the check
        // again once the writes before a pull finished costs what that
        // object's ops do.
        let mut per_object: BTreeMap<ObjectId, Vec<(OsdId, LogOps)>> = plan
            .iter()
            .map(|(object, _)| {
                let empty = logs
                    .iter()
                    .map(|(id, l)| {
                        let log = LogOps {
                            trimmed_through: l.trimmed_through,
                            ops: Vec::new(),
                        };
                        (*id, log)
                    })
                    .collect();
                (*object, empty)
            })
            .collect();
        for (i, (_, l)) in logs.iter().enumerate() {
            for op in &l.ops {
                if let Some(per) = per_object.get_mut(&op.object) {
                    per[i].1.ops.push(*op);
                }
            }
        }
        let mut taken = 0u64;
        for (object, source) in plan {
            let theirs = per_object.remove(&object).unwrap_or_default();
            let still =
                || {
                    self.pgs.borrow().primacy(pg) == primacy
                        && self.view().table.pg(pg).acting.contains(&source)
                        && answered
                            .iter()
                            .all(|(id, was)| up_from(&self.view(), *id) == *was)
                        && self.pgs.borrow().log(pg).is_some_and(|log| {
                            log.sources_ahead(&theirs).contains(&(object, source))
                        })
                };
            if self
                .pull_object(view, pg, object, source, Some(&still))
                .await?
            {
                tracing::warn!(%pg, %object, %source, "peering: another complete copy held newer writes of this object; took its copy before peering");
                taken += 1;
            }
        }
        if taken > 0 {
            // Members peered earlier under this primacy (a pass whose choice
            // left out a source that did not answer) no longer hold this copy's
            // bytes of what was taken: they are compared again, not caught up
            // from the log.
            if let Some(log) = self.pgs.borrow_mut().log_mut(pg) {
                log.unsync_all();
            }
            crate::metrics::newer_copies_taken(taken);
            self.recovery_shared
                .newer_copies_taken
                .fetch_add(taken, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(taken)
    }
}

/// One real shard (the new primary, OSD 1) against a scripted complete copy
/// (OSD 2) that answers with its log's ops, its block sums and its bytes.
#[cfg(test)]
mod tests {
    use super::super::gate_test::{read_of, shard};
    use crate::pg::MapView;
    use crate::pg_log::{EntryKind, LogEntry};
    use crate::store::meta::compare_sum;
    use flame_common::buffer::PayloadBuf;
    use flame_common::ids::{Epoch, ObjectId, OpId, OsdId, PgId, VolumeId};
    use flame_common::placement::PgMembers;
    use flame_common::protocol::{
        BlockSum, LogOp, LogOps, Message, OpCode, encode_block_sums, encode_log_ops,
    };
    use flame_common::reactor::Reactor;
    use std::net::SocketAddr;
    use std::rc::Rc;
    use std::sync::{Arc, Mutex};

    const PG: PgId = PgId(0);
    const OBJECT: ObjectId = ObjectId {
        volume: VolumeId(1),
        index: 0,
    };

    /// A complete copy holding `bytes` of [`OBJECT`] from offset 0 and a log
    /// with `ops` (op seqs of session 7); records the opcodes it was sent.
    fn scripted_copy(bytes: Vec<u8>, ops: &[u64]) -> (SocketAddr, Arc<Mutex<Vec<OpCode>>>) {
        let seen: Arc<Mutex<Vec<OpCode>>> = Arc::default();
        let log = LogOps {
            trimmed_through: 0,
            ops: ops
                .iter()
                .map(|&seq| LogOp {
                    seq,
                    op: OpId { session: 7, seq },
                    object: OBJECT,
                })
                .collect(),
        };
        let s2 = seen.clone();
        let addr = super::super::gate_test::scripted_copy(move |msg| {
            s2.lock().unwrap().push(msg.op());
            match msg {
                Message::PgLogOps { .. } => Some(encode_log_ops(&log)),
                Message::ObjectSums { .. } => {
                    let sums: Vec<BlockSum> = bytes
                        .chunks(4096)
                        .map(|b| BlockSum {
                            sum: compare_sum(b),
                            ..BlockSum::default()
                        })
                        .collect();
                    Some(encode_block_sums(&sums))
                }
                Message::Read { target, .. } => Some(read_of(&bytes, target)),
                _ => None,
            }
        });
        (addr, seen)
    }

    /// Runs peering's first step on a primary holding `mine` with log ops
    /// `my_ops`, against the scripted copy; returns what it answered and this
    /// copy's bytes afterwards.
    fn take(mine: &[u8], my_ops: &[u64], copy: SocketAddr) -> (Result<u64, i32>, Vec<u8>) {
        let dir = tempfile::tempdir().unwrap();
        let shard = shard(dir.path(), copy);
        // Both copies complete, this one the primary.
        let mut map = shard.view().map.clone();
        map.pg_complete.insert(PG, vec![OsdId(1), OsdId(2)]);
        *shard.view.borrow_mut() = Rc::new(MapView::new(&map));
        let members = PgMembers {
            placed: vec![OsdId(1), OsdId(2)],
            acting: vec![OsdId(1), OsdId(2)],
            recovering: vec![],
            down_complete: vec![],
            active: true,
        };
        for &seq in my_ops {
            shard
                .pgs
                .borrow_mut()
                .get_mut(PG)
                .log
                .record_replica(LogEntry {
                    seq,
                    op: OpId { session: 7, seq },
                    interval: Epoch(0),
                    object: OBJECT,
                    offset: 0,
                    length: mine.len() as u32,
                    kind: EntryKind::Write,
                    applied: vec![],
                });
        }
        let mine = mine.to_vec();
        let n = mine.len() as u32;
        let mut r = Reactor::new(Default::default()).unwrap();
        r.block_on(async move {
            shard
                .store
                .write(PG, OBJECT, 0, PayloadBuf::copy_from(&mine), false)
                .await
                .unwrap();
            let view = shard.view();
            let taken = shard.take_newer_copies(&view, PG, &members).await;
            let now = shard.store.read(PG, OBJECT, 0, n).await.unwrap();
            (taken, now.as_slice().to_vec())
        })
        .unwrap()
    }

    #[test]
    fn a_new_primary_takes_an_object_from_a_copy_whose_log_is_ahead() {
        let (copy, seen) = scripted_copy(vec![0xbb; 8192], &[1, 2]);
        let (taken, now) = take(&[0xaa; 8192], &[1], copy);
        assert_eq!(taken, Ok(1));
        assert!(
            now.iter().all(|&b| b == 0xbb),
            "this copy still holds its older bytes"
        );
        let seen = seen.lock().unwrap().clone();
        assert!(seen.contains(&OpCode::PgLogOps) && seen.contains(&OpCode::Read));
    }

    #[test]
    fn a_copy_whose_log_lacks_a_write_of_this_one_is_not_taken() {
        let (copy, seen) = scripted_copy(vec![0xbb; 8192], &[1, 3]);
        let (taken, now) = take(&[0xaa; 8192], &[1, 2], copy);
        assert_eq!(taken, Ok(0));
        assert!(now.iter().all(|&b| b == 0xaa), "this copy's bytes changed");
        assert!(!seen.lock().unwrap().contains(&OpCode::Read));
    }
}
