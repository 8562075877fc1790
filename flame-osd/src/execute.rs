//! Running one request: the epoch check, the role check, the local store
//! operation or the primary's replication, and the reply with its metrics.

use crate::metrics::ShardMetrics;
use crate::pg::MapView;
use crate::pg_core::{ForwardAdmit, ForwardFacts};
use crate::pg_log::{EntryKind, LogEntry};
use crate::shard::Shard;
use flame_common::buffer::PayloadBuf;
use flame_common::clock;
use flame_common::ids::PgId;
use flame_common::placement::object_pg;
use flame_common::protocol::{self, Message, OpCode, flags, status};
use std::rc::Rc;
use std::sync::atomic::Ordering;

/// Reads and writes of data: what the lease gates (flush, delete and ping are not
/// acknowledgements of data a successor could have superseded).
fn is_io(op: OpCode) -> bool {
    matches!(
        op,
        OpCode::Read | OpCode::Write | OpCode::WriteZeroes | OpCode::Discard | OpCode::RemoveObject
    )
}

/// Whether the request changes data (a forward of one is fenced by the group's
/// core on a replica).
fn changes_data(msg: &Message) -> bool {
    matches!(
        msg,
        Message::Write { .. }
            | Message::WriteZeroes { .. }
            | Message::Discard { .. }
            | Message::RemoveObject { .. }
    )
}

impl Shard {
    /// Runs one request and builds its reply.
    pub async fn execute(self: &Rc<Self>, msg: Message) -> Message {
        let started = clock::now();
        let op = msg.op();
        let is_replica = crate::access::is_forwarded(&msg);
        let bytes = match &msg {
            Message::Read { target, .. } | Message::Write { target, .. } => {
                u64::from(target.length)
            }
            _ => 0,
        };
        let id = msg.id();
        // One map view for the whole request: its checks, its replication, and the
        // epoch in its reply.
        let view = self.view();
        let epoch = view.map.epoch;
        let leased = is_io(op);
        let (mut st, mut data) = if leased && !self.liveness.lease_valid() {
            // No manager-acknowledged heartbeat within the lease: the manager may
            // already have marked this OSD down and given its roles to others.
            self.liveness.lease_refusals.fetch_add(1, Ordering::Relaxed);
            (status::EAGAIN, PayloadBuf::empty())
        } else {
            self.apply(view, msg, is_replica).await
        };
        if leased && st == status::OK && !self.liveness.lease_valid() {
            // The lease ran out while the request ran: its result may already be
            // superseded (a read) or not be the only copy that counts (a write),
            // so it is not acknowledged; the client retries under the new map.
            self.liveness.lease_refusals.fetch_add(1, Ordering::Relaxed);
            st = status::EAGAIN;
            data = PayloadBuf::empty();
        }
        if let Some(i) = ShardMetrics::op_index(op) {
            let c = &self.metrics.by_op[usize::from(is_replica)][i];
            c.ops.inc();
            c.bytes.inc_by(bytes);
            c.latency.observe(clock::elapsed(started).as_secs_f64());
            if st != status::OK {
                self.metrics.errors[i].inc();
            }
        }
        Message::Reply {
            op,
            id,
            epoch,
            status: st,
            data,
        }
    }

    async fn apply(
        self: &Rc<Self>,
        view: Rc<MapView>,
        msg: Message,
        replica: bool,
    ) -> (i32, PayloadBuf) {
        let map = &view.map;
        let sender_epoch = msg.epoch();
        let forwarded_change = replica && changes_data(&msg);
        if sender_epoch > map.epoch {
            // The sender knows a newer map: fetch it now.
            self.wanted_epoch
                .fetch_max(sender_epoch.0, Ordering::Relaxed);
            if replica {
                // Another OSD acts on a newer map (a forward, or a new primary
                // telling this one about its map: crate::activation).
                self.peer_epoch
                    .set(self.peer_epoch.get().max(sender_epoch.0));
            }
            if !forwarded_change {
                // Do not act on the old map meanwhile (placement may have moved;
                // two OSDs must never both believe they are primary). The sender
                // retries in a few milliseconds.
                return (status::ESTALE, PayloadBuf::empty());
            }
            // A forward by a primary with a newer map: admitted (or not) by the
            // group's core below, after the role check.
        } else if !replica
            && is_io(msg.op())
            && self.peer_epoch.get() > map.epoch.0
            && self.wanted_epoch.load(Ordering::Relaxed) > map.epoch.0
        {
            // A peer OSD acts on a newer map than this shard's: its roles may
            // have moved (a primary replaced without being down, say), so it
            // serves no client I/O under the old map until the control thread
            // fetched the new one (milliseconds; `wanted_epoch` falls back when
            // the manager has nothing newer). The client retries.
            return (status::ESTALE, PayloadBuf::empty());
        }
        if let Message::Read {
            remote: Some(_), ..
        }
        | Message::Write {
            remote: Some(_), ..
        } = &msg
        {
            // The connection resolves one-sided transfers before a request gets
            // here (crate::connection); one that still names a remote buffer came
            // another way and cannot be served.
            return (status::EINVAL, PayloadBuf::empty());
        }
        match &msg {
            Message::Read { target, .. } => {
                if let Err(st) = view.check(self.osd, self.id, target, replica) {
                    return (st, PayloadBuf::empty());
                }
                if !replica {
                    if !self.serves_clients(target.pg) {
                        return (status::EAGAIN, PayloadBuf::empty());
                    }
                    return self.read_repairing(&view, target).await;
                }
                // A replica-flagged read comes from a primary repairing a block: a
                // bad block here is reported (EIO) and the primary repairs this
                // copy too, so it is logged but not counted as unrepaired.
                match self
                    .store
                    .read(target.pg, target.object, target.offset, target.length)
                    .await
                {
                    Ok(data) => (status::OK, data),
                    Err(crate::store::StoreError::Io(e))
                        if e.kind() == std::io::ErrorKind::OutOfMemory =>
                    {
                        (status::EAGAIN, PayloadBuf::empty())
                    }
                    Err(e) => {
                        tracing::error!(object = %target.object, "read for a primary failed: {e}");
                        (status::EIO, PayloadBuf::empty())
                    }
                }
            }
            Message::Write { target, .. }
            | Message::WriteZeroes { target, .. }
            | Message::Discard { target, .. } => {
                if let Err(st) = view.check(self.osd, self.id, target, replica) {
                    return (st, PayloadBuf::empty());
                }
                if matches!(msg, Message::Write { .. })
                    && let Err(st) = view.check_write_inside_volume(target, sender_epoch)
                {
                    return (st, PayloadBuf::empty());
                }
                if replica && let Err(st) = self.admit_forward(&view, target.pg, &msg) {
                    return (st, PayloadBuf::empty());
                }
                if !replica
                    && let Err(st) = crate::pg_core::admit_client_write(
                        sender_epoch,
                        view.map.interval_since(target.pg),
                    )
                {
                    tracing::debug!(object = %target.object, sender = %sender_epoch, "client write refused: sent under a map older than the group's interval");
                    return (st, PayloadBuf::empty());
                }
                if replica {
                    // Ordered like on the primary: a forwarded write that outlived its
                    // primary's timeout (and a retry of it on a new connection) must
                    // not overtake or be overtaken by an overlapping one.
                    let (_guard, earlier) = self.gate.enter(
                        target.object,
                        target.offset,
                        target.offset + target.length,
                    );
                    for e in earlier {
                        e.wait().await;
                    }
                    let logged = self.replica_log_entry(&msg);
                    let pg = target.pg;
                    let (object, offset, length) = (target.object, target.offset, target.length);
                    let st = self.apply_local(msg).await;
                    match logged {
                        Some(entry) if st == status::OK => {
                            self.store.pg_log().note(pg, &entry);
                            self.pgs.borrow_mut().get_mut(pg).log.record_replica(entry);
                        }
                        Some(_) => {}
                        None => {
                            // A copy from another member (recovery, peering, scrub
                            // or read repair) replaced these bytes (or may have,
                            // if it failed half-way): the log no longer proves
                            // what this copy holds there.
                            self.forget_proof(pg, object, offset, length.max(1));
                        }
                    }
                    return (st, PayloadBuf::empty());
                }
                if !self.serves_clients(target.pg) {
                    return (status::EAGAIN, PayloadBuf::empty());
                }
                (self.replicate(&view, msg).await, PayloadBuf::empty())
            }
            // Only the flushed volume's dirty objects are synced.
            Message::Flush { volume, .. } => match self.store.flush(Some(*volume)).await {
                Ok(()) => (status::OK, PayloadBuf::empty()),
                Err(e) => {
                    tracing::error!("flush failed: {e}");
                    (status::EIO, PayloadBuf::empty())
                }
            },
            Message::DeleteVolume { volume, epoch, .. } => {
                if let Err(st) = view.check_delete_volume(*volume, *epoch) {
                    if st != status::EAGAIN {
                        tracing::warn!(%volume, "refused DELETE_VOLUME of a volume the map still has (remove it through the manager)");
                    }
                    return (st, PayloadBuf::empty());
                }
                let me = map.osds.get(&self.osd).cloned();
                let shard = self.id;
                let owned = move |pg| me.as_ref().is_some_and(|m| m.shard_of(pg) == shard);
                match self.store.delete_volume(*volume, owned).await {
                    Ok(n) => {
                        tracing::info!(shard = self.id, %volume, objects = n, "deleted volume objects");
                        (status::OK, PayloadBuf::empty())
                    }
                    Err(e) => {
                        tracing::error!(%volume, "delete failed: {e}");
                        (status::EIO, PayloadBuf::empty())
                    }
                }
            }
            Message::Ping { .. } => (status::OK, PayloadBuf::empty()),
            // A sender with an older map (a client whose write this OSD refused
            // as sent before the group's interval, say) gets this one; the
            // client checks it as it checks the manager's. Nothing newer: empty.
            Message::MapRequest { epoch, .. } if *epoch < map.epoch => match view.encoded() {
                Ok(b) => (status::OK, PayloadBuf::copy_from(&b)),
                Err(st) => (st, PayloadBuf::empty()),
            },
            Message::MapRequest { .. } => (status::OK, PayloadBuf::empty()),
            Message::PgList { pg, start, max, .. } => {
                if !self.holds(&view, *pg) {
                    return (status::ESTALE, PayloadBuf::empty());
                }
                match self.store.list_pg(*pg).await {
                    Ok(all) => {
                        let page: Vec<_> = all
                            .into_iter()
                            .filter(|o| o >= start)
                            .take(*max as usize)
                            .collect();
                        (
                            status::OK,
                            PayloadBuf::copy_from(&protocol::encode_object_list(&page)),
                        )
                    }
                    Err(e) => {
                        tracing::error!(%pg, "listing failed: {e}");
                        (status::EIO, PayloadBuf::empty())
                    }
                }
            }
            Message::PgSuspects {
                pg, rebooted_only, ..
            } => {
                if !self.holds(&view, *pg) {
                    return (status::ESTALE, PayloadBuf::empty());
                }
                let suspects = if *rebooted_only {
                    self.suspects
                        .borrow()
                        .objects_of(*pg, crate::restart_suspects::Cause::Reboot)
                } else {
                    self.suspects.borrow().objects(*pg)
                };
                if suspects.len() > protocol::PG_LIST_MAX as usize {
                    return (status::E2BIG, PayloadBuf::empty());
                }
                (
                    status::OK,
                    PayloadBuf::copy_from(&protocol::encode_object_list(&suspects)),
                )
            }
            Message::PgLogOps { pg, .. } => {
                if !self.holds(&view, *pg) {
                    return (status::ESTALE, PayloadBuf::empty());
                }
                // A copy its restart left in doubt is no source for the newest
                // bytes (its log may name writes its disk lost).
                if self.suspects.borrow().has(*pg) {
                    return (status::EAGAIN, PayloadBuf::empty());
                }
                let ops = self
                    .pgs
                    .borrow()
                    .log(*pg)
                    .map(|l| l.log_ops(protocol::PG_LIST_MAX as usize))
                    .unwrap_or_default();
                (
                    status::OK,
                    PayloadBuf::copy_from(&protocol::encode_log_ops(&ops)),
                )
            }
            Message::ObjectSums { target, .. } => {
                if !self.holds(&view, target.pg)
                    || object_pg(target.object, map.pool.pg_count) != target.pg
                {
                    return (status::ESTALE, PayloadBuf::empty());
                }
                let rewritten = (target.offset == protocol::OBJECT_SUMS_REWRITTEN)
                    .then(|| self.store.rewritten_blocks(target.object));
                match self.store.block_sums(target.pg, target.object).await {
                    Ok(mut sums) => (
                        {
                            if let Some(ranges) = rewritten {
                                self.mark_rewritten(&ranges, &mut sums);
                            }
                            status::OK
                        },
                        PayloadBuf::copy_from(&protocol::encode_block_sums(&sums)),
                    ),
                    Err(e) => {
                        tracing::error!(object = %target.object, "checksumming failed: {e}");
                        (status::EIO, PayloadBuf::empty())
                    }
                }
            }
            Message::RemoveObject { target, .. } => {
                if !replica {
                    return (status::EINVAL, PayloadBuf::empty());
                }
                if let Err(st) = view.check(self.osd, self.id, target, true) {
                    return (st, PayloadBuf::empty());
                }
                if let Err(st) = self.admit_forward(&view, target.pg, &msg) {
                    return (st, PayloadBuf::empty());
                }
                self.forget_proof(target.pg, target.object, 0, 0);
                match self.store.remove_object(target.pg, target.object).await {
                    Ok(_) => (status::OK, PayloadBuf::empty()),
                    Err(e) => {
                        tracing::error!(object = %target.object, "remove failed: {e}");
                        (status::EIO, PayloadBuf::empty())
                    }
                }
            }
            Message::Scrub { pg, dry_run, .. } => {
                let members = view.table.pg(*pg);
                if !self.holds(&view, *pg) || members.primary() != Some(self.osd) {
                    return (status::ESTALE, PayloadBuf::empty());
                }
                match self.scrub_pg(&view, *pg, *dry_run).await {
                    Ok(counts) => (status::OK, PayloadBuf::copy_from(&counts.encode())),
                    Err(st) => (st, PayloadBuf::empty()),
                }
            }
            // Connection-level messages are handled by the connection.
            Message::Hello { .. }
            | Message::HelloReply { .. }
            | Message::Reply { .. }
            | Message::ReplyArea { .. }
            | Message::PushReply { .. } => (status::EINVAL, PayloadBuf::empty()),
        }
    }

    /// Whether this shard, the group's primary, may serve client I/O of `pg` yet:
    /// a new primary waits for the previous one ([`crate::activation`]), and a
    /// copy its restart left in doubt first pulls its suspects from another
    /// complete copy ([`crate::restart_suspects`]).
    fn serves_clients(&self, pg: PgId) -> bool {
        if self.suspects.borrow().has(pg) {
            return false;
        }
        self.pgs
            .borrow()
            .get(pg)
            .is_none_or(|c| c.may_serve_clients(clock::now))
    }

    /// A replica asks the group's core whether a forward that changes data may be
    /// applied here ([`crate::pg_core::PgCore::admit_forward`]: fencing by
    /// interval and by the newest sender seen). Call after the role check, so
    /// that only groups this shard holds get a core.
    fn admit_forward(&self, view: &MapView, pg: PgId, msg: &Message) -> Result<(), i32> {
        let sender_epoch = msg.epoch();
        let seq = match msg {
            Message::Write { seq, .. }
            | Message::WriteZeroes { seq, .. }
            | Message::Discard { seq, .. } => seq.0,
            _ => 0,
        };
        let facts = ForwardFacts {
            sender_epoch,
            my_epoch: view.map.epoch,
            my_interval: view.map.interval_since(pg),
            seq,
            newer_map_pending: self.wanted_epoch.load(Ordering::Relaxed) > view.map.epoch.0,
        };
        let (admitted, fence) = {
            let mut pgs = self.pgs.borrow_mut();
            let core = pgs.get_mut(pg);
            (core.admit_forward(facts), core.forward_fence())
        };
        let older = sender_epoch < view.map.epoch;
        match admitted {
            Ok(ForwardAdmit::Newer) => crate::metrics::forward_other_epoch(false, true),
            Ok(ForwardAdmit::Current) if older => crate::metrics::forward_other_epoch(true, true),
            Ok(ForwardAdmit::Current) => {}
            Err(st) => {
                if sender_epoch != view.map.epoch {
                    crate::metrics::forward_other_epoch(older, false);
                }
                // A forward of a newer map was admitted here before: fetch that
                // map (an older sender learns of it from the reply's epoch).
                if fence > view.map.epoch {
                    self.wanted_epoch.fetch_max(fence.0, Ordering::Relaxed);
                }
                return Err(st);
            }
        }
        Ok(())
    }

    /// The log entry a replica records for a forwarded write (`None` without a
    /// sequence number: recovery and repair copies are not logged).
    fn replica_log_entry(&self, msg: &Message) -> Option<LogEntry> {
        let (target, seq, kind) = match msg {
            Message::Write { target, seq, .. } => (target, seq, EntryKind::Write),
            Message::WriteZeroes { target, seq, .. } => (target, seq, EntryKind::Zero),
            Message::Discard { target, seq, .. } => (target, seq, EntryKind::Discard),
            _ => return None,
        };
        let op = match msg {
            Message::Write { op, .. }
            | Message::WriteZeroes { op, .. }
            | Message::Discard { op, .. } => *op,
            _ => flame_common::ids::OpId::NONE,
        };
        (seq.0 > 0).then(|| LogEntry {
            seq: seq.0,
            op,
            interval: flame_common::ids::Epoch(0),
            object: target.object,
            offset: target.offset,
            length: target.length,
            kind,
            applied: Vec::new(),
        })
    }

    /// Applies a write-like request to the local store.
    pub(crate) async fn apply_local(&self, msg: Message) -> i32 {
        let res = match msg {
            Message::Write {
                target,
                flags: f,
                data,
                ..
            } => {
                self.store
                    .write(
                        target.pg,
                        target.object,
                        target.offset,
                        data,
                        f & flags::FUA != 0,
                    )
                    .await
            }
            Message::WriteZeroes {
                target, flags: f, ..
            }
            | Message::Discard {
                target, flags: f, ..
            } => {
                self.store
                    .zero(
                        target.pg,
                        target.object,
                        target.offset,
                        target.length,
                        f & flags::FUA != 0,
                    )
                    .await
            }
            _ => return status::EINVAL,
        };
        match res {
            Ok(()) => status::OK,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => status::ENOSPC,
            // The shard's memory pool stayed exhausted before anything was written
            // (a partial write's merge buffer): the client tries again.
            Err(crate::store::StoreError::Io(e)) if e.kind() == std::io::ErrorKind::OutOfMemory => {
                tracing::warn!("local write deferred: {e}");
                status::EAGAIN
            }
            Err(e @ crate::store::StoreError::VolumeRemoved(_)) => {
                tracing::debug!("local write refused: {e}");
                status::EIO
            }
            Err(e) => {
                tracing::error!("local write failed: {e}");
                status::EIO
            }
        }
    }
}
