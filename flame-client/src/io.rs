//! Sending one request to the right OSD shard, and retrying it until it gets a
//! final answer or its deadline passes.
//!
//! Two shapes of request exist:
//! * **object I/O** (read, write, write-zeroes, discard of one piece): the target is
//!   computed from the map on every try — object → PG → acting set; the primary
//!   (first OSD) takes client I/O, on the shard `pg % shards` — so a retry after a
//!   map change goes wherever the object lives *now*. Only the primary is ever asked,
//!   so data never comes from a replica that might lag.
//! * **shard calls** (flush, delete-volume): addressed to a fixed (OSD, shard).
//!
//! Each try either succeeds, fails finally (EIO/EINVAL/ENOSPC, protocol
//! violations), or fails transiently (ESTALE, EAGAIN, connection trouble, primary
//! down in the map). Transient failures wait with [`Backoff`], ask the manager for a
//! fresh map (and for ESTALE wait for it), and try again.

use crate::cluster::Cluster;
use crate::config::{ReplyMode, TransferMode};
use crate::connection::{self, ConnError, ConnKey, FetchConfig, Reply, Target, Transfer};
use crate::deadline::Deadline;
use crate::error::ClientError;
use crate::join::try_join_bounded;
use crate::metrics::{self, Op};
use crate::retry::{Backoff, RetryReason, Verdict, classify};
use crate::split::Piece;
use flame_common::buffer::PayloadBuf;
use flame_common::clock;
use flame_common::collections::HashMap;
use flame_common::ids::{Epoch, ObjectId, OpId, OsdId, PgId, PgSeq, RequestId, VolumeId};
use flame_common::map::{ClusterMap, OsdInfo, PoolConfig};
use flame_common::node::{NodeLocal, NodeLocalKey};
use flame_common::placement;
use flame_common::protocol::{IoTarget, Message, OpCode, flags, status};
use flame_common::reactor;
use std::cell::RefCell;

use std::rc::Rc;
use std::time::Instant;

/// Most shard calls (flush, delete) in flight at once for one operation.
const SHARD_CALLS_WINDOW: usize = 256;

/// What to do with one piece.
pub(crate) enum PieceOp {
    /// Read the piece; the reply carries its bytes.
    Read,
    /// Write these bytes (exactly the piece's length). Shared, so every try sends
    /// the same memory.
    Write { data: PayloadBuf, fua: bool },
    /// Zero the range.
    WriteZeroes { fua: bool },
    /// Discard the range.
    Discard,
}

impl PieceOp {
    fn name(&self) -> &'static str {
        match self {
            PieceOp::Read => "read",
            PieceOp::Write { .. } => "write",
            PieceOp::WriteZeroes { .. } => "write_zeroes",
            PieceOp::Discard => "discard",
        }
    }
}

/// One transient failure.
struct Transient {
    reason: RetryReason,
    message: String,
}

impl From<ConnError> for Transient {
    fn from(e: ConnError) -> Self {
        Transient {
            reason: e.reason,
            message: e.message,
        }
    }
}

/// Longest a retry waits for an OSD's map (as for the manager's,
/// `cluster::REFRESH_WAIT_MAX`): the retry goes on with the map it has.
const MAP_FROM_OSD_WAIT_MAX: std::time::Duration = std::time::Duration::from_secs(2);

/// Outcome of one try.
enum Try<T> {
    Done(T),
    Retry(Transient),
    Fail(ClientError),
}

/// Waits before the next try: records the retry, asks for a fresh map, sleeps the
/// backoff (awaiting the fresh map if the failure suggests ours is stale). Returns
/// the timeout error when the deadline has passed.
async fn back_off(
    cluster: &Cluster,
    backoff: &mut Backoff,
    op: &'static str,
    t: Transient,
) -> Result<(), ClientError> {
    metrics::record_retry(t.reason);
    let Some(delay) = backoff.next_delay(clock::now()) else {
        return Err(timeout(cluster, op, t.message));
    };
    tracing::trace!(op, reason = t.reason.name(), msg = %t.message, ?delay, "retrying");
    // Only a stale map or a lost connection (the OSD may have moved) is news the
    // manager can help with now; for a down OSD or an unreachable replica, the
    // long-polling map watcher brings the change when it happens. Asking on every
    // retry of every piece would hammer the manager exactly during an incident.
    let ticket = matches!(t.reason, RetryReason::Stale | RetryReason::Connection)
        .then(|| cluster.request_map_refresh());
    // An OSD that refused us as stale has the newer map: ask it too, so that
    // a client the manager cannot reach goes on (as Ceph's OSDs share maps).
    let from_osd =
        t.reason == RetryReason::Stale && map_from_osd(cluster, backoff.deadline()).await;
    reactor::sleep(delay).await;
    if let Some(ticket) = ticket
        && t.reason.wants_fresh_map()
        && !from_osd
    {
        cluster.wait_refreshed(ticket, backoff.deadline()).await;
    }
    Ok(())
}

/// Asks the OSD last seen with a newer epoch than ours for its map
/// ([`Message::MapRequest`]) and publishes it if it checks. Returns whether a
/// newer map was published. Bounded by [`MAP_FROM_OSD_WAIT_MAX`] and `deadline`.
async fn map_from_osd(cluster: &Cluster, deadline: Instant) -> bool {
    let Some((epoch, target)) = cluster.take_newer_map_source() else {
        return false;
    };
    let msg = Message::MapRequest {
        id: RequestId(0),
        epoch: cluster.epoch(),
    };
    let deadline = deadline.min(clock::now() + MAP_FROM_OSD_WAIT_MAX);
    let attempt = async {
        match exchange(cluster, &target, &msg, Transfer::default()).await {
            Ok(reply) => Try::Done(reply),
            Err(t) => Try::Retry(t),
        }
    };
    let reply = match bounded(deadline, attempt).await {
        Some(Try::Done(reply)) => reply,
        _ => return false,
    };
    if reply.status != status::OK || reply.data.is_empty() {
        return false;
    }
    match serde_json::from_slice::<ClusterMap>(reply.data.as_slice()) {
        // Only the map of the epoch the OSD answers under (the one it showed
        // us): an OSD cannot hand over a map from a made-up future, after
        // which no map of the manager's would be newer.
        Ok(map) if map.epoch != reply.epoch => {
            tracing::warn!(osd = %target.key.osd, handed = %map.epoch, answered = %reply.epoch, "an OSD handed a map of another epoch than its own; ignoring it");
            false
        }
        Ok(map) => {
            let got = map.epoch;
            let published = cluster.publish_osd_map(map);
            if published {
                tracing::info!(%epoch, %got, osd = %target.key.osd, "took a newer map from an OSD");
            }
            published
        }
        Err(e) => {
            tracing::warn!(osd = %target.key.osd, "an OSD's map did not decode: {e}");
            false
        }
    }
}

fn timeout(cluster: &Cluster, op: &'static str, last: String) -> ClientError {
    ClientError::Timeout {
        op,
        timeout_ms: cluster.config().io_timeout_ms,
        last,
    }
}

/// Runs `attempt` bounded by the deadline.
async fn bounded<T>(
    deadline: Instant,
    attempt: impl std::future::Future<Output = Try<T>>,
) -> Option<Try<T>> {
    if clock::now() >= deadline {
        return None;
    }
    let expire = async {
        Deadline::at(deadline).await;
        None
    };
    futures_lite::future::or(async { Some(attempt.await) }, expire).await
}

fn target_for(cluster: &Cluster, map: &ClusterMap, osd: &OsdInfo, shard: u16) -> Target {
    let cfg = cluster.config();
    Target {
        key: ConnKey {
            cluster: cluster.uid(),
            osd: osd.id,
            shard,
        },
        addr: osd.shard_addr(shard),
        transport: cfg.transport,
        source: cfg.bind_addr,
        timeout: cfg.connect_timeout(),
        epoch: map.epoch,
        shards: osd.shards,
        fetch: (cfg.reply_mode == ReplyMode::Fetch).then_some(FetchConfig {
            slots: cfg.fetch_slots,
            slot_payload_bytes: cfg.fetch_slot_payload_bytes,
            polls_max: cfg.fetch_polls_max,
            fallbacks_to_push: cfg.fetch_fallbacks_to_push.max(1),
        }),
        lineage: cluster.lineage(),
    }
}

/// How a request of `length` data bytes travels under the cluster's settings:
/// converted at or above the transport's threshold in `convert` mode, its reply
/// fetched in `fetch` mode.
fn transfer_for(cluster: &Cluster, length: u32) -> Transfer {
    let cfg = cluster.config();
    Transfer {
        convert: cfg.transfer_mode == TransferMode::Convert
            && length >= cfg.convert_threshold_bytes.for_transport(cfg.transport),
        fetch: cfg.reply_mode == ReplyMode::Fetch,
    }
}

/// This thread's primaries of the map it saw last: placement ranks every `in` OSD
/// per placement group, which is worth doing once per PG and epoch rather than once
/// per request.
struct PrimaryCache {
    cluster: u64,
    epoch: Epoch,
    /// By PG: `UNKNOWN`, `NONE` (no OSD in) or the primary's id.
    primaries: Vec<u32>,
}

const UNKNOWN: u32 = u32::MAX;
const NONE: u32 = u32::MAX - 1;

thread_local! {
    static PRIMARIES: NodeLocal<RefCell<PrimaryCache>> = const {
        NodeLocal::new(|| {
            RefCell::new(PrimaryCache {
                cluster: 0,
                epoch: Epoch(0),
                primaries: Vec::new(),
            })
        })
    };
}

/// Targets of a volume's FLUSH per (volume, size), for the map this thread saw
/// last: computing them ranks every OSD for every placement group and hashes up to
/// 64 objects per group, too much to repeat for every FLUSH of an fsync-heavy
/// workload. Bounded: cleared when full.
struct FlushTargetCache {
    cluster: u64,
    epoch: Epoch,
    targets: HashMap<(VolumeId, Option<u64>), FlushTargets>,
}

/// The (OSD, shard) pairs one FLUSH goes to.
type FlushTargets = Rc<Vec<(OsdId, u16)>>;

/// Volumes whose flush targets one thread remembers per map.
const FLUSH_TARGET_CACHE_ENTRIES_MAX: usize = 64;

thread_local! {
    static FLUSH_TARGETS: NodeLocal<RefCell<FlushTargetCache>> = const {
        NodeLocal::new(|| {
            RefCell::new(FlushTargetCache {
                cluster: 0,
                epoch: Epoch(0),
                targets: HashMap::default(),
            })
        })
    };
}

/// [`volume_flush_targets`] through this thread's [`FlushTargetCache`].
fn flush_targets(
    cluster: &Cluster,
    map: &ClusterMap,
    volume: VolumeId,
    size_bytes: Option<u64>,
) -> FlushTargets {
    FLUSH_TARGETS.with_node(|c| {
        let mut c = c.borrow_mut();
        if c.cluster != cluster.uid() || c.epoch != map.epoch {
            c.cluster = cluster.uid();
            c.epoch = map.epoch;
            c.targets.clear();
        }
        if let Some(t) = c.targets.get(&(volume, size_bytes)) {
            return t.clone();
        }
        if c.targets.len() >= FLUSH_TARGET_CACHE_ENTRIES_MAX {
            c.targets.clear();
        }
        let t = Rc::new(volume_flush_targets(map, volume, size_bytes));
        c.targets.insert((volume, size_bytes), t.clone());
        t
    })
}

/// The primary of `pg` in `map` (the first OSD of its acting set).
fn primary_of(cluster: &Cluster, map: &ClusterMap, pg: PgId) -> Option<OsdId> {
    PRIMARIES.with_node(|c| {
        let mut c = c.borrow_mut();
        // A map is published once per epoch per cluster, so (cluster, epoch) names
        // its content.
        if c.cluster != cluster.uid() || c.epoch != map.epoch {
            c.cluster = cluster.uid();
            c.epoch = map.epoch;
            c.primaries.clear();
            c.primaries.resize(map.pool.pg_count as usize, UNKNOWN);
        }
        let slot = c.primaries.get_mut(pg.0 as usize)?;
        if *slot == UNKNOWN {
            *slot = placement::PgMembers::compute(map, pg)
                .primary()
                .map_or(NONE, |o| o.0);
        }
        (*slot != NONE).then_some(OsdId(*slot))
    })
}

/// Sends `msg` to `target` the way `how` says and waits for the reply. The
/// message stays with the caller, so a retry can resend it (with a new id, and
/// new grants on whichever connection it goes to) without rebuilding its payload.
async fn exchange(
    cluster: &Cluster,
    target: &Target,
    msg: &Message,
    how: Transfer,
) -> Result<Reply, Transient> {
    let conn = connection::get(target, cluster.tickets()).await?;
    Ok(conn.request(msg, how).await?)
}

/// Performs one piece of a volume request, retrying until `deadline`. Returns the
/// data for reads (exactly `piece.length` bytes, in the buffer the reply arrived
/// in), an empty payload otherwise.
pub(crate) async fn piece_io(
    cluster: &Cluster,
    volume: VolumeId,
    piece: Piece,
    op: PieceOp,
    deadline: Instant,
) -> Result<PayloadBuf, ClientError> {
    let op_name = op.name();
    let object = ObjectId {
        volume,
        index: piece.object_index,
    };
    let mut backoff = Backoff::new(deadline);
    let mut last: Option<String> = None;
    // One identity for every resend of this operation (reads need none).
    let new_op = || match op {
        PieceOp::Read => OpId::NONE,
        _ => cluster.next_op(),
    };
    let mut op_id = new_op();
    loop {
        let map = cluster.map();
        let pg = placement::object_pg(object, map.pool.pg_count);
        let asked = primary_of(cluster, &map, pg);
        let attempt = piece_try(cluster, &map, object, piece, &op, op_id);
        // A request to a primary that died or was cut off may never be answered
        // (its packets vanish): once a newer map names another primary, or marks
        // this one down, the try is abandoned and resent there.
        let attempt = futures_lite::future::or(attempt, primary_moved(cluster, &map, pg, asked));
        let t = match bounded(deadline, attempt).await {
            None => {
                let why = last.unwrap_or_else(|| "no answer from the OSD in time".into());
                return Err(timeout(cluster, op_name, why));
            }
            Some(Try::Done(data)) => return Ok(data),
            Some(Try::Fail(e)) => return Err(e),
            Some(Try::Retry(t)) => t,
        };
        if t.reason == RetryReason::Superseded {
            // A newer write of this client to these bytes landed first: this one
            // is re-issued as a new operation, so it lands after that one (the
            // two were in flight together, so either order is allowed).
            op_id = new_op();
        }
        last = Some(t.message.clone());
        back_off(cluster, &mut backoff, op_name, t).await?;
    }
}

/// How often an in-flight try checks whether its primary moved.
const PRIMARY_CHECK_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

/// Completes (with a retry) once the client's map is newer than `map` and `pg`'s
/// primary in it is no longer `asked`, or `asked` is down in it; pends otherwise.
async fn primary_moved<T>(
    cluster: &Cluster,
    map: &ClusterMap,
    pg: PgId,
    asked: Option<OsdId>,
) -> Try<T> {
    loop {
        reactor::sleep(PRIMARY_CHECK_INTERVAL).await;
        let now = cluster.map();
        if now.epoch <= map.epoch {
            continue;
        }
        let primary = primary_of(cluster, &now, pg);
        let down = asked.is_some_and(|id| now.osds.get(&id).is_none_or(|o| !o.up));
        if primary != asked || down {
            return Try::Retry(Transient {
                reason: RetryReason::Stale,
                message: format!(
                    "map {} moved the primary of {pg} away from {asked:?}; resending",
                    now.epoch
                ),
            });
        }
    }
}

/// One try of one piece against the map `map`.
async fn piece_try(
    cluster: &Cluster,
    map: &ClusterMap,
    object: ObjectId,
    piece: Piece,
    op: &PieceOp,
    op_id: OpId,
) -> Try<PayloadBuf> {
    let pg = placement::object_pg(object, map.pool.pg_count);
    let Some(primary) = primary_of(cluster, map, pg).and_then(|id| map.osds.get(&id)) else {
        // No complete copy is up (they are down, or no OSD is in): the group's
        // I/O waits for one to come back.
        return Try::Retry(Transient {
            reason: RetryReason::OsdDown,
            message: format!("no complete copy of {pg} ({object}) is up: its OSDs are down or out"),
        });
    };
    if !primary.up {
        return Try::Retry(Transient {
            reason: RetryReason::OsdDown,
            message: format!("{} (primary of {pg}) is down", primary.id),
        });
    }
    let target = target_for(cluster, map, primary, primary.shard_of(pg));
    let io = IoTarget {
        pg,
        object,
        offset: piece.object_offset,
        length: piece.length,
    };
    // The write payload is shared with the message (one reference more), so a
    // retry resends the same memory.
    let fua_flag = |fua: bool| if fua { flags::FUA } else { 0 };
    let (id, epoch) = (RequestId(0), map.epoch);
    let msg = match op {
        PieceOp::Read => Message::Read {
            id,
            epoch,
            target: io,
            flags: 0,
            remote: None,
        },
        PieceOp::Write { data, fua } => Message::Write {
            id,
            epoch,
            target: io,
            flags: fua_flag(*fua),
            seq: PgSeq(0),
            op: op_id,
            remote: None,
            data: data.clone(),
        },
        PieceOp::WriteZeroes { fua } => Message::WriteZeroes {
            id,
            epoch,
            target: io,
            flags: fua_flag(*fua),
            seq: PgSeq(0),
            op: op_id,
        },
        PieceOp::Discard => Message::Discard {
            id,
            epoch,
            target: io,
            flags: 0,
            seq: PgSeq(0),
            op: op_id,
        },
    };
    let data_bytes = match op {
        PieceOp::Read | PieceOp::Write { .. } => piece.length,
        _ => 0,
    };
    let result = exchange(cluster, &target, &msg, transfer_for(cluster, data_bytes)).await;
    drop(msg);
    let reply = match result {
        Ok(reply) => reply,
        Err(t) => return Try::Retry(t),
    };
    cluster.note_epoch_from(reply.epoch, &target);
    match classify(reply.status) {
        Verdict::Done => {
            if matches!(op, PieceOp::Read) && reply.data.len() != piece.length as usize {
                return Try::Fail(ClientError::Protocol(format!(
                    "{} answered a {}-byte read with {} bytes",
                    primary.id,
                    piece.length,
                    reply.data.len()
                )));
            }
            Try::Done(reply.data)
        }
        Verdict::Retry(reason) => Try::Retry(Transient {
            reason,
            message: format!(
                "{} answered {}",
                primary.id,
                crate::error::errno_name(reply.status)
            ),
        }),
        Verdict::Fail => Try::Fail(ClientError::Osd {
            osd: primary.id,
            op: op.name(),
            status: reply.status,
        }),
    }
}

/// What a shard call does when its OSD is down in the map.
#[derive(Clone, Copy, PartialEq, Eq)]
enum WhenDown {
    /// Done: nothing to do there now. A FLUSH never waits on a down OSD: its
    /// acknowledged writes are on the other members of the write set too (flushed
    /// by the same FLUSH), and an OSD syncs its whole store before serving again
    /// after a restart.
    Skip,
    /// Fail at once with [`ClientError::OsdDown`].
    Refuse,
}

/// Sends `op` to shard `shard` of `osd`, retrying until the deadline. An OSD that
/// left the map (or a shard it no longer has) is done: it holds nothing to flush
/// or delete.
async fn shard_call(
    cluster: &Cluster,
    osd: OsdId,
    shard: u16,
    op: OpCode,
    volume: VolumeId,
    when_down: WhenDown,
    deadline: Instant,
) -> Result<(), ClientError> {
    let mut backoff = Backoff::new(deadline);
    let mut last: Option<String> = None;
    loop {
        let map = cluster.map();
        let Some(info) = map.osds.get(&osd) else {
            return Ok(());
        };
        if shard >= info.shards {
            return Ok(());
        }
        let t = if !info.up {
            return match when_down {
                WhenDown::Refuse => Err(ClientError::OsdDown(osd)),
                WhenDown::Skip => Ok(()),
            };
        } else {
            let target = target_for(cluster, &map, info, shard);
            let (id, epoch) = (RequestId(0), map.epoch);
            let msg = match op {
                OpCode::DeleteVolume => Message::DeleteVolume { id, epoch, volume },
                _ => Message::Flush {
                    id,
                    epoch,
                    flags: 0,
                    volume,
                },
            };
            let attempt = async {
                // A delete can run for long: its reply is pushed, not polled for.
                let how = Transfer {
                    fetch: op == OpCode::Flush && transfer_for(cluster, 0).fetch,
                    ..Transfer::default()
                };
                match exchange(cluster, &target, &msg, how).await {
                    Ok(reply) => {
                        cluster.note_epoch_from(reply.epoch, &target);
                        match classify(reply.status) {
                            Verdict::Done => Try::Done(()),
                            Verdict::Retry(reason) => Try::Retry(Transient {
                                reason,
                                message: format!(
                                    "{osd} shard {shard} answered {}",
                                    crate::error::errno_name(reply.status)
                                ),
                            }),
                            Verdict::Fail => Try::Fail(ClientError::Osd {
                                osd,
                                op: op.name(),
                                status: reply.status,
                            }),
                        }
                    }
                    Err(t) => Try::Retry(t),
                }
            };
            // An OSD that dies with the request in flight may never answer: once
            // the map marks it down, the call ends as if it had been down at once.
            let went_down = async {
                loop {
                    reactor::sleep(PRIMARY_CHECK_INTERVAL).await;
                    if cluster.with_map(|m| m.osds.get(&osd).is_none_or(|o| !o.up)) {
                        return match when_down {
                            WhenDown::Skip => Try::Done(()),
                            WhenDown::Refuse => Try::Fail(ClientError::OsdDown(osd)),
                        };
                    }
                }
            };
            let attempt = futures_lite::future::or(attempt, went_down);
            match bounded(deadline, attempt).await {
                None => {
                    let why = last
                        .unwrap_or_else(|| format!("no answer from {osd} shard {shard} in time"));
                    return Err(timeout(cluster, op.name(), why));
                }
                Some(Try::Done(())) => return Ok(()),
                Some(Try::Fail(e)) => return Err(e),
                Some(Try::Retry(t)) => t,
            }
        };
        last = Some(t.message.clone());
        back_off(cluster, &mut backoff, op.name(), t).await?;
    }
}

/// Most objects of a volume [`volume_pgs`] hashes to find its placement groups before
/// it gives up and takes all of them (a bound on the work of one flush: with `n`
/// placement groups, about `n·ln n` objects cover them all, far below this).
const PG_SCAN_OBJECTS_PER_PG_MAX: u64 = 64;

/// The placement groups that can hold objects of a volume of `size_bytes` bytes:
/// those of objects `0..ceil(size / object_size)`. If that is more objects than
/// [`PG_SCAN_OBJECTS_PER_PG_MAX`] per placement group and they have not covered every
/// placement group by then, every placement group (a superset is always safe).
pub(crate) fn volume_pgs(volume: VolumeId, size_bytes: u64, pool: &PoolConfig) -> Vec<PgId> {
    let pg_count = pool.pg_count;
    let objects = size_bytes.div_ceil(u64::from(pool.object_size.max(1)));
    let scan_max = u64::from(pg_count).saturating_mul(PG_SCAN_OBJECTS_PER_PG_MAX);
    let mut seen = vec![false; pg_count as usize];
    let mut found = 0u32;
    for index in 0..objects.min(scan_max) {
        let pg = placement::object_pg(ObjectId { volume, index }, pg_count);
        if let Some(s) = seen.get_mut(pg.0 as usize)
            && !*s
        {
            *s = true;
            found += 1;
            if found == pg_count {
                break;
            }
        }
    }
    if objects > scan_max && found < pg_count {
        seen.iter_mut().for_each(|s| *s = true);
    }
    (0..pg_count)
        .filter(|&pg| seen[pg as usize])
        .map(PgId)
        .collect()
}

/// The (OSD, shard) pairs that hold a placement group of `volume` under `map`, as
/// primary or replica: the targets of the volume's FLUSH.
///
/// `size_bytes` overrides the volume's size in the map: a shrink's trim flushes
/// the objects past the new end, whose groups the new size may no longer reach.
pub(crate) fn volume_flush_targets(
    map: &ClusterMap,
    volume: VolumeId,
    size_bytes: Option<u64>,
) -> Vec<(OsdId, u16)> {
    // A volume no longer in the map: its size is unknown, so take every PG.
    let size = size_bytes.unwrap_or_else(|| map.volume_by_id(volume).map_or(u64::MAX, |v| v.size));
    let table = placement::PgTable::new(map);
    let mut targets = std::collections::BTreeSet::new();
    for pg in volume_pgs(volume, size, &map.pool) {
        // Every copy that is up and takes writes: a down OSD cannot be flushed
        // (and its copy is recovered from these before it serves again).
        for osd in table.pg(pg).write_set() {
            if let Some(info) = map.osds.get(&osd) {
                targets.insert((osd, info.shard_of(pg)));
            }
        }
    }
    targets.into_iter().collect()
}

/// Flushes one volume: sends FLUSH(volume) to every shard that holds one of the
/// volume's placement groups, as primary or replica, and waits for all of them.
///
/// Why this is enough for NBD's `CAN_MULTI_CONN` ("a flush on any connection covers
/// every write completed on any connection before it"): a write of this volume is
/// acknowledged to a client only after every OSD of its placement group's acting set
/// has applied it, on the shard that owns that placement group, and that shard
/// answers FLUSH(volume) only once every write of the volume it has applied — as
/// primary or replica, from any connection of any client — is stable. The targets
/// are every (OSD, owning shard) of every acting set of every placement group the
/// volume's objects hash to, so they cover every completed write of the volume,
/// whichever client thread or connection carried it. (A write whose acting set
/// changed between the write and the flush — an OSD marked `out`, or `in` — is
/// covered by recovery, not by this flush; see docs/protocol.md.)
pub(crate) async fn flush_volume(cluster: &Cluster, volume: VolumeId) -> Result<(), ClientError> {
    flush_volume_objects(cluster, volume, None).await
}

/// [`flush_volume`] over the objects of the first `size_bytes` bytes of the volume
/// (`None`: its size in the map).
pub(crate) async fn flush_volume_objects(
    cluster: &Cluster,
    volume: VolumeId,
    size_bytes: Option<u64>,
) -> Result<(), ClientError> {
    let started = clock::now();
    let deadline = started + cluster.config().io_timeout();
    let map = cluster.map();
    let targets = flush_targets(cluster, &map, volume, size_bytes);
    let res = try_join_bounded(
        targets.iter().copied(),
        SHARD_CALLS_WINDOW,
        |(osd, shard)| {
            shard_call(
                cluster,
                osd,
                shard,
                OpCode::Flush,
                volume,
                WhenDown::Skip,
                deadline,
            )
        },
    )
    .await
    .map(|_| ());
    metrics::record_op(Op::Flush, res.is_ok(), 0, clock::elapsed(started));
    res
}

impl Cluster {
    /// Deletes every object of volume `id` on every OSD of the map that is up (all
    /// shards, in parallel), and fails if one goes down meanwhile. OSDs that are
    /// down are skipped: once the volume is removed from the map, the map's
    /// tombstone of its id (`ClusterMap::deleted_volumes`) makes each of them
    /// delete its copies when it is back. Must run on a reactor thread.
    pub async fn delete_volume_objects(&self, id: VolumeId) -> Result<(), ClientError> {
        delete_volume_objects(self, id).await
    }
}

/// See [`Cluster::delete_volume_objects`].
pub(crate) async fn delete_volume_objects(
    cluster: &Cluster,
    volume: VolumeId,
) -> Result<(), ClientError> {
    let started = clock::now();
    let deadline = started + cluster.config().io_timeout();
    let map = cluster.map();
    let targets: Vec<(OsdId, u16)> = map
        .osds
        .values()
        .filter(|o| o.up)
        .flat_map(|o| (0..o.shards.max(1)).map(move |s| (o.id, s)))
        .collect();
    let res = try_join_bounded(targets, SHARD_CALLS_WINDOW, |(osd, shard)| {
        shard_call(
            cluster,
            osd,
            shard,
            OpCode::DeleteVolume,
            volume,
            WhenDown::Refuse,
            deadline,
        )
    })
    .await
    .map(|_| ());
    metrics::record_op(Op::DeleteVolume, res.is_ok(), 0, clock::elapsed(started));
    res
}

/// Deadline of a request starting now.
pub(crate) fn deadline_from_now(cluster: &Cluster) -> Instant {
    clock::now() + cluster.config().io_timeout()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(pg_count: u32) -> PoolConfig {
        PoolConfig {
            size: 3,
            min_size: 2,
            pg_count,
            object_size: 4 << 20,
        }
    }

    #[test]
    fn volume_pgs_are_those_of_its_objects() {
        let p = pool(128);
        let v = VolumeId(9);
        assert!(volume_pgs(v, 0, &p).is_empty());
        // One object (even a partial one): its placement group only.
        let one = volume_pgs(v, 1, &p);
        assert_eq!(
            one,
            vec![placement::object_pg(
                ObjectId {
                    volume: v,
                    index: 0
                },
                128
            )]
        );
        // Ten objects: exactly the set of their placement groups.
        let mut want: Vec<PgId> = (0..10)
            .map(|index| placement::object_pg(ObjectId { volume: v, index }, 128))
            .collect();
        want.sort();
        want.dedup();
        assert_eq!(volume_pgs(v, 10 * (4 << 20) - 1, &p), want);
        // A huge volume covers every placement group, found within the scan bound.
        assert_eq!(volume_pgs(v, 1 << 50, &p).len(), 128);
        assert_eq!(volume_pgs(v, u64::MAX, &p).len(), 128);
    }
}

mod scrub;
