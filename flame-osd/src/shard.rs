//! A shard thread: the penetrating model.
//!
//! One thread owns a listener, every connection accepted on it, the objects of its
//! placement groups, its peer connections and its io_uring. A request is received,
//! decoded, applied to disk, replicated and answered by this thread alone: no queue
//! hand-off, no lock (the cluster map is read through a lock-free `ArcSwap`).
//!
//! A request's journey through the modules of this crate:
//! [`crate::connection`] (accept, HELLO, fencing, back-pressure) →
//! [`crate::execute`] (decode into an operation, run it, reply) →
//! [`crate::pg`] (is this OSD and shard the right one for the placement group?) →
//! [`crate::replication`] (primary: order, forward to the replicas, apply) →
//! [`crate::store`] (the bytes on disk). This file holds what the shard owns and
//! the state those steps share: the map view and the in-flight byte bound.

use crate::metrics::ShardMetrics;
use crate::ordering::WriteGate;
use crate::peers::Peers;
use crate::pg::MapView;
use crate::pg_core::PgCores;
use crate::recovery::{RecoveryShared, RecoveryState};
use crate::restart_suspects::RestartSuspects;
use crate::store::ObjectStore;
use arc_swap::ArcSwap;
use flame_common::clock;
use flame_common::ids::{Epoch, OsdId, PgId};
use flame_common::map::ClusterMap;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

/// How often a forward in flight checks whether its replica left the write set.
const REPLICA_CHECK_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

/// Everything one shard thread owns.
pub struct Shard {
    pub(crate) id: u16,
    pub(crate) osd: OsdId,
    /// The map as the control thread publishes it.
    pub(crate) map_source: Arc<ArcSwap<ClusterMap>>,
    /// Highest epoch seen in a request (shared with the control thread).
    pub(crate) wanted_epoch: Arc<AtomicU64>,
    /// Highest epoch a peer OSD showed this shard (a forward or a replica's
    /// reply). While it and `wanted_epoch` are both above this shard's map, the
    /// shard serves no client I/O: another OSD acts on a newer map, in which
    /// this one may no longer be the primary. A client's epoch only asks for a
    /// fetch (one client's odd map must not stall everyone's I/O).
    pub(crate) peer_epoch: Cell<u64>,
    /// `lease_ms`: how long a new primary waits at most for the previous one to
    /// see its map ([`crate::pg_core::PgCore::await_previous_primary`]).
    pub(crate) lease: std::time::Duration,
    /// Wakes the task that tells previous primaries about new maps
    /// ([`crate::activation`]).
    pub(crate) activation_wake: crate::store::wait_list::WaitList,
    /// This shard's own copy of the current map and its placement table, refreshed
    /// when the epoch changes. `Rc`, not `Arc`: cloning it per request touches no
    /// cache line shared with other shards.
    pub(crate) view: RefCell<Rc<MapView>>,
    /// What this OSD's restart left in doubt, per group ([`RestartSuspects`]).
    pub(crate) suspects: RefCell<RestartSuspects>,
    /// The same doubt on disk, for every shard of this OSD: what this shard
    /// settles is left out of it ([`crate::store::doubt_record`]), so a later
    /// restart still knows what is not settled.
    pub(crate) doubt_record: std::sync::Arc<crate::store::doubt_record::DoubtRecord>,
    pub(crate) store: ObjectStore,
    pub(crate) gate: Rc<WriteGate>,
    pub(crate) peers: Rc<Peers>,
    /// The lease and the shards' progress (shared with the control thread).
    pub(crate) liveness: Arc<crate::liveness::Liveness>,
    pub(crate) metrics: Rc<ShardMetrics>,
    /// Who may connect ([`crate::hello_gate`]).
    pub(crate) hello_gate: crate::hello_gate::HelloGate,
    /// How long a connection may be stuck before it is closed.
    pub(crate) stall_bounds: flame_common::transport::StallBounds,

    pub(crate) max_inflight: u32,
    /// `reply_slots_per_connection_max` (remote fetching; 0 = off).
    pub(crate) reply_slots_max: u32,
    /// `reply_slot_payload_bytes_max`.
    pub(crate) reply_slot_payload_max: u32,
    /// `reply_area_over_emulated`.
    pub(crate) reply_area_over_emulated: bool,
    /// Connection slots: per shard, per source, kept for peers.
    pub(crate) slots: Rc<RefCell<crate::connection_slots::ConnectionSlots>>,
    /// Payload bytes in flight on this shard: its clients', its peers'
    /// ([`crate::byte_budget`]: two bounds, so peers never wait behind clients).
    pub(crate) client_bytes: crate::byte_budget::ByteBudget,
    pub(crate) peer_bytes: crate::byte_budget::ByteBudget,
    /// Newest connection of each session and incarnation of each lineage
    /// (see `Message::Hello`, [`crate::session_fence`]).
    pub(crate) sessions: RefCell<crate::session_fence::SessionFences>,
    /// The decision core of each placement group this shard has seen writes for
    /// ([`crate::pg_core`]: its log, its replica fence, its primacy generation).
    pub(crate) pgs: RefCell<PgCores>,
    /// Recovery's per-shard state ([`crate::recovery`]).
    pub(crate) recovery: RecoveryState,
    /// What recovery shares with the control thread and the HTTP API.
    pub(crate) recovery_shared: Arc<RecoveryShared>,
    /// `recovery_max_active` (at least 1).
    pub(crate) recovery_max_active: u32,
    /// `recovery_bytes_per_sec` (0 = unlimited).
    pub(crate) recovery_bytes_per_sec: u64,
    /// `scrub_interval_s` (zero = no background scrub).
    pub(crate) scrub_interval: std::time::Duration,
    /// `scrub_bytes_per_sec` (0 = unlimited).
    pub(crate) scrub_bytes_per_sec: u64,
    /// `stray_delete_delay_ms`.
    pub(crate) stray_delete_delay: std::time::Duration,
}

impl Shard {
    /// The byte budget a connection's requests count against.
    pub(crate) fn bytes_of(&self, is_peer: bool) -> &crate::byte_budget::ByteBudget {
        if is_peer {
            &self.peer_bytes
        } else {
            &self.client_bytes
        }
    }

    /// The current map view; recomputed only when the epoch moved.
    pub(crate) fn view(&self) -> Rc<MapView> {
        let source = self.map_source.load();
        let cached = self.view.borrow().clone();
        if cached.map.epoch == source.epoch {
            return cached;
        }
        let fresh = Rc::new(MapView::new(&source));
        self.primacy_on_new_map(&cached, &fresh);
        self.store
            .note_removed_volumes(fresh.map.deleted_volumes.iter().copied());
        // Members that left a group (neither placed nor a complete copy still
        // serving) lose their tracking: their copy is a stray, deleted soon.
        {
            let mut pgs = self.pgs.borrow_mut();
            let tracked: Vec<PgId> = pgs.iter().map(|(pg, _)| *pg).collect();
            for pg in tracked {
                let m = fresh.table.pg(pg);
                if let Some(log) = pgs.log_mut(pg) {
                    log.forget_members(|o| m.placed.contains(&o) || m.write_set().any(|w| w == o));
                }
            }
        }
        // A group this OSD was recovered in since its start has nothing in
        // doubt here any more; one it left has nothing to settle.
        {
            let mut suspects = self.suspects.borrow_mut();
            for pg in suspects.pgs() {
                let objects = suspects.objects(pg);
                if !fresh.table.pg(pg).is_member(self.osd) {
                    suspects.settled(pg);
                    self.doubt_record.settle(pg);
                } else if !fresh.held_by(self.osd, self.id, pg) {
                    // Another shard's group: that one settles it.
                    suspects.settled(pg);
                } else if suspects.on_map(self.osd, pg, fresh.table.pg(pg)) {
                    self.doubt_record.settle(pg);
                } else {
                    continue;
                }
                self.store.untrack_rewrites(objects);
            }
        }
        *self.view.borrow_mut() = fresh.clone();
        fresh
    }

    /// Tells the group cores whose primacy may have been interrupted between
    /// `prev` and `fresh`, the moment this shard first sees `fresh` (not when the
    /// recovery loop next looks): the group's primary changed to or from this
    /// OSD, or epochs were skipped and the group's roles changed since `prev`
    /// (another primary may have served the epochs this shard never saw).
    fn primacy_on_new_map(&self, prev: &MapView, fresh: &MapView) {
        let same_pgs = prev.table.pg_count() == fresh.table.pg_count();
        let mut waiting = false;
        let mut pgs = self.pgs.borrow_mut();
        for (pg, m) in fresh.table.iter() {
            if !fresh.held_by(self.osd, self.id, pg) {
                continue;
            }
            let change = crate::pg_core::PrimacyChange {
                prev_epoch: prev.map.epoch,
                was_primary: same_pgs && prev.table.pg(pg).primary() == Some(self.osd),
                epoch: fresh.map.epoch,
                now_primary: m.primary() == Some(self.osd),
                interval: fresh.map.interval_since(pg),
            };
            if change.interrupts_primacy() {
                pgs.primacy_changed(pg);
            }
            if change.now_primary && !change.was_primary && same_pgs {
                // The previous primary, if still up, may serve reads under the
                // old map: no client I/O here until it has seen this one.
                let previous = prev.table.pg(pg).primary();
                if let Some(p) = previous
                    && p != self.osd
                    && fresh.map.osds.get(&p).is_some_and(|o| o.up)
                {
                    let until = clock::now() + self.lease;
                    pgs.get_mut(pg).await_previous_primary(p, until);
                    waiting = true;
                }
            }
        }
        drop(pgs);
        if waiting {
            self.activation_wake.wake_all();
        }
    }

    /// Completes once a newer map than epoch `since` no longer has `osd` in the
    /// write set of `pg`: the primary stops waiting for that replica (a peer cut
    /// off without a reset would otherwise hold the write for the whole
    /// `replica_timeout_ms`) and the client retries under the new map. Checks
    /// every [`REPLICA_CHECK_INTERVAL`].
    pub(crate) async fn left_write_set(&self, pg: PgId, osd: OsdId, since: Epoch) {
        loop {
            flame_common::reactor::sleep(REPLICA_CHECK_INTERVAL).await;
            let view = self.view();
            if view.map.epoch > since && !view.table.pg(pg).write_set().any(|m| m == osd) {
                return;
            }
        }
    }

    /// Loads the stable copy of this shard's placement-group logs (before the
    /// shard serves anything): the groups it holds continue their numbering above
    /// every seq this copy applied and recognise retries and superseded writes of
    /// the ops it holds, across the restart. An unreadable copy is reported and
    /// the logs start empty (as if the records had been lost: ops unknown).
    pub(crate) async fn load_pg_logs(&self) {
        let view = self.view();
        let stored = match self.store.pg_log().load().await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!(
                    shard = self.id,
                    "cannot read the placement-group log; not writing it this run: {e}"
                );
                self.store.pg_log().disable();
                return;
            }
        };
        let stored_len = stored.len();
        let mut pgs = self.pgs.borrow_mut();
        let mut loaded = 0usize;
        for s in stored {
            if !view.held_by(self.osd, self.id, s.pg) {
                continue;
            }
            let log = &mut pgs.get_mut(s.pg).log;
            if s.proof_forgotten {
                log.forget_proof(s.entry.object, s.entry.offset, s.entry.length);
            } else {
                log.record_replica(s.entry);
                loaded += 1;
            }
        }
        tracing::info!(
            shard = self.id,
            entries = loaded,
            stored = stored_len,
            "placement-group log loaded"
        );
    }

    /// This copy's bytes `[offset, offset+length)` of `object` (`length` 0: all
    /// of it) were, or may have been, replaced by another copy's (recovery,
    /// peering, scrub or read repair): the log no longer proves which ops this
    /// copy holds there — now, and after a restart (the stable log records it).
    pub(crate) fn forget_proof(
        &self,
        pg: PgId,
        object: flame_common::ids::ObjectId,
        offset: u32,
        length: u32,
    ) {
        if let Some(log) = self.pgs.borrow_mut().log_mut(pg) {
            log.forget_proof(object, offset, length);
        }
        self.store
            .pg_log()
            .note_forgotten(pg, object, offset, length);
    }

    /// Whether this shard is the one of this OSD that holds `pg` in `view`.
    pub(crate) fn holds(&self, view: &MapView, pg: PgId) -> bool {
        view.held_by(self.osd, self.id, pg)
    }

    pub(crate) fn epoch(&self) -> Epoch {
        self.view().map.epoch
    }
}
