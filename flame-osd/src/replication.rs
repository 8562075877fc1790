//! The primary's side of a write: order it against overlapping writes, forward it
//! to every replica and apply it locally at the same time, and answer once every
//! copy has applied it. Replicas apply forwarded writes in `execute`.
//!
//! Before it applies a client write, the primary asks the group's log about the
//! write's op id (once every earlier overlapping write has completed):
//! a **retry** of an op the log shows applied is answered without applying it
//! again — after copying this copy's bytes of the range to any write-set member
//! the log does not prove holds it (a new primary after a failover, or a replica
//! that failed the first try) — and a write **superseded** by a newer overlapping
//! write of the same client session is refused (`status::SUPERSEDED`). See
//! [`crate::pg_log`].

use crate::pg::MapView;
use crate::pg_core::{Decision, PrimaryWrite};
use crate::pg_log::{EntryKind, WriteSetRoles};
use crate::recovery::CopyMode;
use crate::shard::Shard;
use flame_common::ids::{OpId, OsdId, PgSeq};
use flame_common::protocol::IoTarget;
use flame_common::protocol::{Message, flags, status};
use flame_common::reactor;
use std::rc::Rc;
use std::sync::atomic::Ordering;

impl Shard {
    /// Primary path: order against overlapping writes, forward to the replicas and
    /// apply locally in parallel, answer once every copy has applied. Every
    /// decision is the group's core's ([`crate::pg_core::PgCore`]); this drives it.
    pub(crate) async fn replicate(self: &Rc<Self>, view: &Rc<MapView>, mut msg: Message) -> i32 {
        let (target, kind) = match &msg {
            Message::Write { target, .. } => (target.clone(), EntryKind::Write),
            Message::WriteZeroes { target, .. } => (target.clone(), EntryKind::Zero),
            Message::Discard { target, .. } => (target.clone(), EntryKind::Discard),
            _ => return status::EINVAL,
        };
        // Register before the first await: admission order is arrival order.
        let (_guard, earlier) =
            self.gate
                .enter(target.object, target.offset, target.offset + target.length);
        let members = view.table.pg(target.pg);
        // At least min_size complete copies up (checked again: the gate may have
        // been entered under a view that has since been replaced).
        if !members.active || members.primary() != Some(self.osd) {
            return status::EAGAIN;
        }
        // A write to a group with a full member fails before any copy takes it
        // (ENOSPC, final for the client): a disk that runs out half-way through a
        // replicated write would leave the copies disagreeing. Discards and
        // write-zeroes pass: they free space.
        if matches!(msg, Message::Write { .. })
            && let Some(full) = members
                .write_set()
                .find(|id| view.map.full_osds.contains(id))
        {
            tracing::debug!(osd = %full, pg = %target.pg, "write refused: a member's disk is full");
            return status::ENOSPC;
        }
        // The group's next sequence number, also before the first await: the log's
        // order is the admission order. Replicas record it with the entry.
        let (seq, primacy) = {
            let mut pgs = self.pgs.borrow_mut();
            let core = pgs.get_mut(target.pg);
            (core.begin_write(), core.primacy())
        };
        let (op, fua) = match &msg {
            Message::Write { op, flags: f, .. }
            | Message::WriteZeroes { op, flags: f, .. }
            | Message::Discard { op, flags: f, .. } => (*op, f & flags::FUA != 0),
            _ => (OpId::NONE, false),
        };
        if let Message::Write { seq: s, .. }
        | Message::WriteZeroes { seq: s, .. }
        | Message::Discard { seq: s, .. } = &mut msg
        {
            *s = PgSeq(seq);
        }
        let write = PrimaryWrite {
            seq,
            op,
            interval: view.map.interval_since(target.pg),
            object: target.object,
            offset: target.offset,
            length: target.length,
            kind,
            applied: Vec::new(),
        };
        // Every member that is up and takes writes — the other acting members and
        // those being recovered — applies the write before it is acknowledged.
        let write_set: Vec<OsdId> = members.write_set().collect();
        for e in earlier {
            e.wait().await;
        }
        // Every earlier overlapping write is in the log now: do the roles it was
        // admitted under still hold, is it a retry of one of them, or older than
        // one of its own session's?
        let interval_now = self.view().map.interval_since(target.pg);
        let decision = self.pgs.borrow_mut().get_mut(target.pg).decide_now(
            &write,
            self.osd,
            &write_set,
            primacy,
            interval_now,
        );
        match decision {
            Decision::Apply => {}
            Decision::Stale => {
                tracing::debug!(%op, object = %target.object, "write refused: the group's roles changed while it waited");
                return status::EAGAIN;
            }
            Decision::Superseded => {
                crate::metrics::superseded_op();
                tracing::debug!(%op, object = %target.object, "write refused: a newer write of its session to these bytes was applied first");
                return status::SUPERSEDED;
            }
            Decision::Duplicate {
                applied_seq,
                copy_to,
            } => {
                return self
                    .answer_retry(view, &write_set, &target, applied_seq, copy_to, fua)
                    .await;
            }
        }
        let replicas = &write_set[1..];
        // The same payload buffer goes to every replica's send queue and to the
        // local write: each forwarded message holds one more reference to it, not a
        // copy of it.
        let calls: Vec<_> = replicas
            .iter()
            .map(|&id| {
                let peers = self.peers.clone();
                let fwd = with_replica_flag(&msg);
                let view = view.clone();
                let me = self.clone();
                reactor::spawn(async move {
                    // Checked above: every replica is in this view's map.
                    let Some(osd) = view.map.osds.get(&id) else {
                        return (status::EAGAIN, None);
                    };
                    let epoch = view.map.epoch;
                    let gone = me.left_write_set(target.pg, id, epoch);
                    match peers
                        .call_reply_until(osd, osd.shard_of(target.pg), epoch, fwd, gone)
                        .await
                    {
                        Ok(Message::Reply { status, epoch, .. }) => (status, Some(epoch)),
                        Ok(_) => (status::EIO, None),
                        Err(st) => (st, None),
                    }
                })
            })
            .collect();
        let local = self.apply_local(msg).await;
        if local == status::OK {
            // Made stable with the next FLUSH of the volume (store/pg_log_file.rs).
            self.store.pg_log().note(target.pg, &write);
        }
        let mut results = Vec::with_capacity(replicas.len());
        for (c, &id) in calls.into_iter().zip(replicas) {
            let (st, replica_epoch) = c.await;
            if let Some(e) = replica_epoch
                && e > view.map.epoch
            {
                // The replica has a newer map (it refuses forwards from older
                // epochs): fetch it, so the client's retry meets current roles.
                self.wanted_epoch.fetch_max(e.0, Ordering::Relaxed);
                self.peer_epoch.set(self.peer_epoch.get().max(e.0));
            }
            results.push((id, st));
        }
        self.pgs.borrow_mut().get_mut(target.pg).complete(
            write,
            primacy,
            self.osd,
            local,
            &results,
            &WriteSetRoles {
                acting: &members.acting,
                recovering: &members.recovering,
            },
        )
    }

    /// Answers a retry of the write logged as `applied_seq` without applying it
    /// again. This copy holds its effect (the core checked); the members in
    /// `copy_to` — those the log does not prove hold it — get this copy's current
    /// bytes of the range instead (FUA if the write was), which include it. The
    /// caller holds the write gate over the range, so no other write to it runs
    /// meanwhile.
    async fn answer_retry(
        self: &Rc<Self>,
        view: &Rc<MapView>,
        write_set: &[OsdId],
        target: &IoTarget,
        applied_seq: u64,
        copy_to: Vec<OsdId>,
        fua: bool,
    ) -> i32 {
        if copy_to.is_empty() {
            crate::metrics::dup_op("answered");
            return status::OK;
        }
        // No source repair here: the gate held covers the retried range only,
        // and a repair rewrites whole blocks (and other members' copies). A
        // copy that fails a checksum is answered EAGAIN below, and the
        // client's retry rewrites the range.
        let mode = CopyMode {
            fua,
            throttled: false,
            repairs_source: false,
        };
        let range = (target.offset, target.length);
        let copies: Vec<_> = copy_to
            .iter()
            .map(|&m| {
                let me = self.clone();
                let view = view.clone();
                let (pg, object) = (target.pg, target.object);
                reactor::spawn(async move {
                    me.copy_range_with(&view, pg, object, m, range, mode).await
                })
            })
            .collect();
        let mut results = Vec::with_capacity(copies.len());
        for (c, &m) in copies.into_iter().zip(&copy_to) {
            results.push((m, c.await.err().unwrap_or(status::OK)));
        }
        let result = crate::pg_core::merge_statuses(status::OK, &results);
        if result == status::EIO {
            // This copy's disk failed to read the range (or a member's failed to
            // write it): copying it cannot prove the write is everywhere. The log
            // stops vouching for these bytes, so the client's retry is applied
            // again on every copy (rewriting the bad sector too) instead of being
            // answered by another copy that fails the same way.
            self.forget_proof(
                target.pg,
                target.object,
                target.offset,
                target.length.max(1),
            );
            crate::metrics::dup_op("unreadable");
            return status::EAGAIN;
        }
        if result == status::OK {
            let interval = view.map.interval_since(target.pg);
            self.pgs
                .borrow_mut()
                .get_mut(target.pg)
                .retry_copied(applied_seq, interval, write_set);
            crate::metrics::dup_op("completed");
        }
        // Otherwise the client retries (and the retry is answered the same way).
        result
    }
}

/// The message a replica gets: the same request with the [`flags::REPLICA`] bit.
/// A write's payload is shared (one reference more), never copied.
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

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::buffer::PayloadBuf;
    use flame_common::ids::{Epoch, ObjectId, PgId, RequestId, VolumeId};
    use flame_common::protocol::IoTarget;

    #[test]
    fn forwarded_writes_share_the_payload_buffer() {
        let data = PayloadBuf::copy_from(&[3u8; 4096]);
        let msg = Message::Write {
            id: RequestId(1),
            epoch: Epoch(2),
            target: IoTarget {
                pg: PgId(0),
                object: ObjectId {
                    volume: VolumeId(1),
                    index: 0,
                },
                offset: 0,
                length: 4096,
            },
            flags: flags::FUA,
            seq: PgSeq(0),
            op: flame_common::ids::OpId::NONE,
            remote: None,
            data: data.clone(),
        };
        let fwd: Vec<Message> = (0..2).map(|_| with_replica_flag(&msg)).collect();
        for f in &fwd {
            let Message::Write {
                flags: fl, data: d, ..
            } = f
            else {
                panic!("{f:?}")
            };
            assert_eq!(*fl, flags::FUA | flags::REPLICA);
            assert!(d.same_memory(&data), "replica got a copy of the payload");
        }
        assert_eq!(data.ref_count(), 4);
    }
}
