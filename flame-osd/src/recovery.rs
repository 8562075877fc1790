//! Recovery: the primary of each placement group brings every member up to date.
//!
//! One task per shard ([`recovery_loop`]) watches the map. For every group whose
//! primary is this shard:
//!
//! * **New interval** (this shard just became the primary, or the OSD started):
//!   first every object another acting copy's log shows newer writes of is taken
//!   from that copy (`newest_copy`: the newest copy wins, not the primary's); then
//!   the other acting copies are compared with this one object by object, block
//!   by block ("peering"), and made equal to it — writes of a dead primary that
//!   never were acknowledged may have reached some copies only.
//! * **Recovering members** (placed, up, not complete): caught up from the group's
//!   log ([`crate::pg_log`]) when it shows what the member missed — only those
//!   objects and byte ranges are copied — else backfilled: the objects of both
//!   copies are listed ([`Message::PgList`]), each object's per-block checksums
//!   compared ([`Message::ObjectSums`]), differing blocks copied (replica-flagged
//!   WRITE, or DISCARD where this copy reads zeroes, so holes stay holes), and
//!   objects the member has and this copy has not removed
//!   ([`Message::RemoveObject`]). Then the member's shard flushes the volumes
//!   touched, and the member is reported recovered to the manager
//!   (`PgRecoveredReport`, batched by the control thread).
//!
//! Every object is copied while holding this shard's write gate over the whole
//! object: a client write to it waits, and a copy can never overwrite a newer
//! client write (the member gets every client write too, being in the write set).
//! A job checks before every object that the roles it was planned under still hold
//! (this shard primary, the member still in the write set and not restarted) and is
//! abandoned otherwise; the next map plans afresh.
//!
//! Throttled: at most `recovery_max_active` objects in flight per shard and
//! `recovery_bytes_per_sec` bytes copied per second. Copies of groups this OSD is no
//! longer a member of are deleted once the group is active, after
//! `stray_delete_delay_ms`.

use crate::pg::MapView;
use crate::shard::Shard;
use crate::store::StoreError;
use flame_common::clock;
use flame_common::collections::{HashMap, HashSet};
use flame_common::ids::{Epoch, ObjectId, OsdId, PgId, PgSeq, RequestId, VolumeId};
use flame_common::placement::PgMembers;
use flame_common::protocol::{
    BlockSum, IoTarget, Message, PG_LIST_MAX, decode_block_sums, decode_object_list, flags, status,
};
use flame_common::reactor;
use group_pass::{
    GroupFacts, GroupPass, Outcome, PassTimings, RecoveringFacts, ReplicaFacts, Step,
};
use serde::Serialize;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, BTreeSet};
use std::rc::Rc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How often the recovery task looks at the map when idle.
const POLL_INTERVAL: Duration = Duration::from_millis(100);
/// How often per-group status is published for `GET /v1/pgs`.
const PUBLISH_INTERVAL: Duration = Duration::from_millis(500);
/// How often stray copies are looked for.
const STRAY_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// How often the objects of every group this shard is primary of are counted
/// again (one directory listing per group). A group that becomes primary here is
/// counted at the next poll.
const OBJECT_COUNT_INTERVAL: Duration = Duration::from_secs(5);
/// A member reported recovered but still recovering in the map after this long is
/// reported again (the report or the manager may have been lost).
const REPORT_RETRY: Duration = Duration::from_secs(3);
/// How long a group whose recovery or peering failed waits before the next try.
const RETRY_DELAY: Duration = Duration::from_secs(1);
/// Largest piece of an object copied in one message.
const COPY_CHUNK_BYTES: u32 = 1 << 20;
/// Block size of the store's checksums.
const BLOCK: u32 = 4096;
/// Times a job re-reads the log for entries the member missed while it ran.
const LOG_ROUNDS_MAX: u32 = 8;
/// How long a job waits for the writes admitted before it to complete.
const INFLIGHT_WAIT_MAX: Duration = Duration::from_secs(30);
/// Most pages of one placement group's object listing (× [`PG_LIST_MAX`]).
const LIST_PAGES_MAX: usize = 1024;
/// Reports queued for the control thread at most (older ones are dropped; a
/// member still recovering is reported again).
const REPORTS_QUEUED_MAX: usize = 65_536;

/// How [`Shard::copy_range_with`] copies.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CopyMode {
    /// Each piece with FUA (stable on the member before it answers).
    pub fua: bool,
    /// Within `recovery_bytes_per_sec`.
    pub throttled: bool,
    /// The caller holds the object's write gate: blocks of this copy that fail
    /// their checksums are repaired from another copy before they are copied
    /// ([`Shard::repair_source_blocks`]) instead of failing the copy.
    pub repairs_source: bool,
}

impl CopyMode {
    /// Recovery's copies: throttled, made stable by the member's flush afterwards.
    pub const RECOVERY: CopyMode = CopyMode {
        fua: false,
        throttled: true,
        repairs_source: true,
    };
}

/// One object of a job: the byte ranges to copy (log-based), or `None` to compare
/// every block (backfill, peering).
type ObjectWork = (ObjectId, Option<Vec<(u32, u32)>>);

/// What every shard shares with the control thread and the HTTP server.
#[derive(Default)]
pub struct RecoveryShared {
    /// (epoch, group, member) recovered, for the control thread to report.
    reports: Mutex<Vec<(Epoch, PgId, OsdId)>>,
    /// Per-group status, published by the shard that holds the group.
    pgs: Mutex<BTreeMap<PgId, PgStatus>>,
    /// What recovery still has to do, per shard (summed for the heartbeat).
    remaining: Mutex<HashMap<u16, ShardWork>>,
    /// Objects copied or compared-and-fixed since start.
    pub objects_recovered: AtomicU64,
    /// Bytes copied since start.
    pub bytes_recovered: AtomicU64,
    /// Group scrubs (not dry runs) finished since start.
    pub scrubs: AtomicU64,
    /// Objects scrubs found inconsistent since start.
    pub scrub_errors: AtomicU64,
    /// Objects scrubs repaired since start.
    pub scrub_repaired: AtomicU64,
    /// Blocks a scrub found differing, each copy matching its own checksum, on
    /// a copy nothing tells may differ (no missed write in the group's log, no
    /// unsettled restart doubt): copies that diverged where none should have —
    /// a bug the scrub repairs out of sight. The simulator fails a seed on any.
    pub scrub_unexplained: AtomicU64,
    /// When a scrub of a group last finished, seconds since the Unix epoch.
    pub last_scrub_unix: AtomicU64,
    /// Objects peering took from another complete copy that held newer writes
    /// of them than this one (`recovery/newest_copy.rs`).
    pub newer_copies_taken: AtomicU64,
    /// Background scrubs start no new group scrub while set (Ceph's `noscrub`):
    /// the simulator sets it once its faults stop, so that the copies it
    /// compares at the end are what recovery left, before any scrub repair.
    pub scrubs_paused: std::sync::atomic::AtomicBool,
    /// Removed volumes whose objects this OSD still holds, for the shards to
    /// delete ([`crate::tombstones`]).
    pub(crate) removed_volumes: crate::tombstones::Pending,
    /// Complete members whose restart doubt a shard of this OSD, their
    /// primary, compared, with the incarnation it was compared for: until
    /// then, what that member's power cut took lives only on the other copies
    /// (the simulator holds back its next power cut till then: two copies
    /// losing the same unflushed write is a double fault).
    suspects_compared: Mutex<HashMap<(PgId, OsdId), Epoch>>,
}

/// What one shard's recovery still has to do, as last published.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ShardWork {
    /// Objects left over every recovering group it can estimate.
    pub objects: u64,
    /// Groups it is the primary of with recovering members.
    pub pgs_recovering: u32,
    /// Of those, groups it cannot estimate yet.
    pub pgs_unestimated: u32,
}

/// What recovery still has to do for one recovering member of a group, as far as
/// the primary can tell (`None`: it cannot yet).
///
/// * `reported`: the member was caught up and reported; the map has not caught up
///   yet. Nothing left.
/// * `job`: a job is running for it: what that job has left (its current log
///   round, or its backfill's listed objects).
/// * `log_objects`: the distinct objects of the log entries it missed, when the
///   log can tell (a log catch-up will copy only those).
/// * `counted`: the objects of this copy of the group, when counted: a backfill
///   compares every one.
pub(crate) fn member_pending(
    reported: bool,
    job: Option<u64>,
    log_objects: Option<u64>,
    counted: Option<u64>,
) -> Option<u64> {
    if reported {
        return Some(0);
    }
    job.or(log_objects).or(counted)
}

/// This OSD's recovery and scrub figures, for the heartbeat's `RecoveryProgress`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ProgressFigures {
    /// Objects recovery still has to do, over every recovering group it can
    /// estimate (not only the running jobs).
    pub objects_to_recover: u64,
    /// Groups this OSD is the primary of with recovering members.
    pub pgs_recovering: u32,
    /// Of those, groups it cannot estimate yet.
    pub pgs_unestimated: u32,
    /// Objects brought up to date on members since start.
    pub objects_recovered_total: u64,
    /// Bytes copied since start.
    pub bytes_recovered_total: u64,
    /// Objects scrubs found inconsistent since start.
    pub scrub_errors_total: u64,
    /// Objects scrubs repaired since start.
    pub scrub_repaired_total: u64,
    /// When a scrub last finished (seconds since the Unix epoch; 0 = never).
    pub last_scrub_unix: u64,
}

/// One placement group as this OSD sees it (`GET /v1/pgs/{id}`).
#[derive(Clone, Debug, Serialize)]
pub struct PgStatus {
    /// Group number.
    pub pg: u32,
    /// The shard holding it here.
    pub shard: u16,
    /// Map epoch this was computed under.
    pub epoch: u64,
    /// primary, replica, recovering (this copy is being recovered), stray (not a
    /// member: deleted soon), none.
    pub role: &'static str,
    /// Acting set, primary first.
    pub acting: Vec<u32>,
    /// Members being recovered.
    pub recovering: Vec<u32>,
    /// Whether the group serves I/O.
    pub active: bool,
    /// This copy is the primary and has compared every member's copy with its
    /// own since it became primary (peering). `false` for other roles.
    pub peered: bool,
    /// Oldest sequence number in this shard's log of the group.
    pub log_first_seq: u64,
    /// Newest sequence number assigned or seen.
    pub log_last_seq: u64,
    /// Entries in the log.
    pub log_entries: usize,
    /// Objects this shard brought up to date on other members, since start.
    pub objects_recovered_total: u64,
    /// Objects recovery still has to do for this group: its running job's, else
    /// what its recovering members missed by the log, else (backfill) the
    /// group's objects; the part it can estimate (see `remaining_unknown`).
    pub objects_remaining: u64,
    /// Some recovering member's remaining work cannot be estimated yet (a
    /// backfill of a group not counted yet).
    pub remaining_unknown: bool,
    /// Objects the running comparison of a complete member (peering, a
    /// restarted member's doubt, a lagging member's catch-up) has left. Not
    /// recovery: no copy is missing, and the map may show the group clean
    /// meanwhile (a primary that returned peers its groups after its own
    /// recovery); not counted in `objects_remaining` nor in the OSD's objects
    /// to recover, as Ceph counts peering in no recovery figure.
    pub objects_comparing: u64,
    /// Objects this copy holds, counted at most [`OBJECT_COUNT_INTERVAL`] ago
    /// (`None`: not counted; counted only where this OSD is the primary).
    pub objects: Option<u64>,
}

impl RecoveryShared {
    /// The incarnation of `member` whose restart doubt about `pg` a shard of
    /// this OSD (its primary) compared last, if any.
    pub fn suspects_compared(&self, pg: PgId, member: OsdId) -> Option<Epoch> {
        self.suspects_compared
            .lock()
            .ok()
            .and_then(|m| m.get(&(pg, member)).copied())
    }

    /// Queues a member as recovered (the control thread sends it).
    pub fn push_report(&self, epoch: Epoch, pg: PgId, member: OsdId) {
        if let Ok(mut r) = self.reports.lock() {
            if r.len() >= REPORTS_QUEUED_MAX {
                r.remove(0);
            }
            r.push((epoch, pg, member));
        }
    }

    /// Takes every queued report.
    pub fn take_reports(&self) -> Vec<(Epoch, PgId, OsdId)> {
        self.reports
            .lock()
            .map(|mut r| std::mem::take(&mut *r))
            .unwrap_or_default()
    }

    /// The figures the heartbeat reports.
    pub fn progress(&self) -> ProgressFigures {
        let work = self.work();
        ProgressFigures {
            objects_to_recover: work.objects,
            pgs_recovering: work.pgs_recovering,
            pgs_unestimated: work.pgs_unestimated,
            objects_recovered_total: self.objects_recovered.load(Ordering::Relaxed),
            bytes_recovered_total: self.bytes_recovered.load(Ordering::Relaxed),
            scrub_errors_total: self.scrub_errors.load(Ordering::Relaxed),
            scrub_repaired_total: self.scrub_repaired.load(Ordering::Relaxed),
            last_scrub_unix: self.last_scrub_unix.load(Ordering::Relaxed),
        }
    }

    /// `(group, objects)` of every group this OSD is the primary of and has
    /// counted, for the heartbeat: the manager multiplies them by the copies each
    /// group lacks (degraded) or keeps on the wrong OSD (misplaced).
    pub fn pg_object_counts(&self) -> Vec<(PgId, u64)> {
        self.pgs
            .lock()
            .map(|pgs| {
                pgs.values()
                    .filter(|s| s.role == "primary")
                    .filter_map(|s| Some((PgId(s.pg), s.objects?)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// What recovery still has to do on this OSD, summed over its shards.
    pub fn work(&self) -> ShardWork {
        self.remaining
            .lock()
            .map(|m| {
                m.values().fold(ShardWork::default(), |a, w| ShardWork {
                    objects: a.objects.saturating_add(w.objects),
                    pgs_recovering: a.pgs_recovering.saturating_add(w.pgs_recovering),
                    pgs_unestimated: a.pgs_unestimated.saturating_add(w.pgs_unestimated),
                })
            })
            .unwrap_or_default()
    }

    fn publish(&self, shard: u16, statuses: Vec<PgStatus>, remaining: ShardWork) {
        if let Ok(mut pgs) = self.pgs.lock() {
            pgs.retain(|_, s| s.shard != shard);
            for s in statuses {
                pgs.insert(PgId(s.pg), s);
            }
        }
        if let Ok(mut r) = self.remaining.lock() {
            r.insert(shard, remaining);
        }
    }

    /// The HTTP API served next to `/metrics`: `GET /v1/pgs` (every group this OSD
    /// holds or has a role in) and `GET /v1/pgs/{id}`. `None`: not this API's path.
    pub fn http(&self, url: &str) -> Option<(u16, String)> {
        let path = url.split('?').next().unwrap_or(url);
        let rest = path.strip_prefix("/v1/pgs")?;
        let pgs = self.pgs.lock().ok()?;
        if rest.is_empty() || rest == "/" {
            let all: Vec<&PgStatus> = pgs.values().collect();
            return Some((200, serde_json::to_string(&all).unwrap_or_default()));
        }
        let id = rest.strip_prefix('/')?;
        match id.parse::<u32>() {
            Ok(n) => match pgs.get(&PgId(n)) {
                Some(s) => Some((200, serde_json::to_string(s).unwrap_or_default())),
                None => Some((
                    404,
                    format!("{{\"error\":\"no placement group {n} here\"}}"),
                )),
            },
            Err(_) => Some((400, "{\"error\":\"bad placement group id\"}".into())),
        }
    }
}

/// A member reported recovered: not planned again while the map still shows it
/// recovering, unless it restarted or the report looks lost.
struct Reported {
    up_from: Epoch,
    /// The primacy generation it was reported under.
    primacy: u64,
    at: Instant,
}

/// What recovery keeps per shard.
#[derive(Default)]
pub struct RecoveryState {
    last_epoch: Cell<Option<Epoch>>,
    /// Groups whose other acting copies were compared, with the primacy
    /// generation they were compared under ([`crate::pg_core::PgCore::primacy`]).
    peered: RefCell<HashMap<PgId, u64>>,
    reported: RefCell<HashMap<(PgId, OsdId), Reported>>,
    stray_since: RefCell<HashMap<PgId, Instant>>,
    /// Complete members first seen lacking writes they failed, and since when:
    /// caught up only once they stayed complete for [`LAGGING_GRACE_LEASES`]
    /// leases (a member that failed writes because it died is soon marked down,
    /// and its recovery then does the work — and counts it).
    lagging_since: RefCell<HashMap<(PgId, OsdId), Instant>>,
    /// Complete members whose restart doubt ([`crate::restart_suspects`]) this
    /// shard, their primary, compared, with the incarnation (`up_from`) it was
    /// compared for.
    pub(crate) suspects_checked: RefCell<HashMap<(PgId, OsdId), Epoch>>,
    /// Groups whose last job failed (a member unreachable, a map moving) are tried
    /// again only after this instant, so a down peer costs one attempt per
    /// [`RETRY_DELAY`], not one per poll.
    retry_after: RefCell<HashMap<PgId, Instant>>,
    recovered_per_pg: RefCell<HashMap<PgId, u64>>,
    /// Objects the running job for (group, member) has left; 0 once its copying
    /// is over (flush and report to go). Removed when the job ends.
    remaining_per_job: RefCell<HashMap<(PgId, OsdId), u64>>,
    /// Objects of each group this shard is the primary of, and when all of them
    /// were last counted.
    object_counts: RefCell<HashMap<PgId, u64>>,
    object_counts_at: Cell<Option<Instant>>,
    /// Objects in flight and the tasks waiting for a slot.
    active: Cell<u32>,
    slot_waiters: RefCell<Vec<std::task::Waker>>,
    /// Byte throttles: the earliest time the next copy may start.
    copy_next: Cell<Option<Instant>>,
    pub(crate) scrub_throttle: Cell<Option<Instant>>,
    pub(crate) last_scrub: RefCell<HashMap<PgId, Instant>>,
    /// When background scrubbing started counting (the first pass).
    pub(crate) started: std::cell::OnceCell<Instant>,
}

/// Leases a complete member that failed writes must stay complete before its
/// primary catches it up without a map change (see `lagging_since`).
const LAGGING_GRACE_LEASES: u32 = 2;

/// Why a job stopped early.
#[derive(Debug)]
pub(crate) enum JobError {
    /// The roles it was planned under changed.
    Abandoned,
    /// A member or the local store failed (status).
    Failed(i32),
}

/// Holds one of the shard's `recovery_max_active` slots.
struct Slot(Rc<Shard>);

impl Drop for Slot {
    fn drop(&mut self) {
        let r = &self.0.recovery;
        r.active.set(r.active.get() - 1);
        for w in r.slot_waiters.borrow_mut().drain(..) {
            w.wake();
        }
    }
}

/// Sleeps as needed so that `bytes` more keep the rate under `bytes_per_sec`.
pub(crate) async fn throttle(next: &Cell<Option<Instant>>, bytes: u64, bytes_per_sec: u64) {
    if bytes_per_sec == 0 {
        return;
    }
    let now = clock::now();
    let start = next.get().filter(|t| *t > now).unwrap_or(now);
    let cost = Duration::from_secs_f64(bytes as f64 / bytes_per_sec as f64);
    next.set(Some(start + cost));
    if start > now {
        reactor::sleep(start - now).await;
    }
}

/// Blocks `[first, first+count)` where `local` and `remote` differ (a block bad on
/// the remote differs whatever its value), as byte ranges, coalesced.
pub(crate) fn differing_ranges(local: &[BlockSum], remote: &[BlockSum]) -> Vec<(u32, u32)> {
    let n = local.len().max(remote.len());
    let mut out: Vec<(u32, u32)> = Vec::new();
    for b in 0..n {
        let l = local.get(b).copied().unwrap_or_default();
        let r = remote.get(b).copied().unwrap_or_default();
        if r.bad || r.sum != l.sum {
            let off = b as u32 * BLOCK;
            match out.last_mut() {
                Some((o, len)) if *o + *len == off => *len += BLOCK,
                _ => out.push((off, BLOCK)),
            }
        }
    }
    out
}

/// Splits `data` (the bytes of whole blocks, the last one possibly short) into
/// runs of all-zero and of other blocks: `(start, end, zero)` byte ranges, in
/// order, covering it. Copies send zero runs as holes (DISCARD), so a hole stays
/// a hole on every copy.
pub(crate) fn block_runs(data: &[u8]) -> Vec<(usize, usize, bool)> {
    let mut runs: Vec<(usize, usize, bool)> = Vec::new();
    for (i, block) in data.chunks(BLOCK as usize).enumerate() {
        let zero = block.iter().all(|&x| x == 0);
        let (lo, hi) = (i * BLOCK as usize, i * BLOCK as usize + block.len());
        match runs.last_mut() {
            Some((_, end, z)) if *z == zero => *end = hi,
            _ => runs.push((lo, hi, zero)),
        }
    }
    runs
}

/// Merges byte ranges of one object, widened to whole blocks and clamped to
/// `object_size`.
fn merge_ranges(mut ranges: Vec<(u32, u32)>, object_size: u32) -> Vec<(u32, u32)> {
    ranges.sort();
    let mut out: Vec<(u32, u32)> = Vec::new();
    for (off, len) in ranges {
        let start = off / BLOCK * BLOCK;
        let end = (u64::from(off) + u64::from(len))
            .div_ceil(u64::from(BLOCK))
            .saturating_mul(u64::from(BLOCK))
            .min(u64::from(object_size)) as u32;
        if end <= start {
            continue;
        }
        match out.last_mut() {
            Some((o, l)) if *o + *l >= start => *l = (*l).max(end - *o),
            _ => out.push((start, end - start)),
        }
    }
    out
}

impl Shard {
    /// Whether this shard is still the primary of `pg` with `member` in its write
    /// set (and not restarted since `up_from`), under the current map, and has
    /// been without a break since the job started (its primacy generation is
    /// still `primacy`: a P→Q→P flip while the job waited means Q acknowledged
    /// writes this shard's log never saw).
    fn job_valid(&self, pg: PgId, member: OsdId, up_from: Epoch, primacy: u64) -> bool {
        let view = self.view();
        let m = view.table.pg(pg);
        self.pgs.borrow().primacy(pg) == primacy
            && m.primary() == Some(self.osd)
            && m.write_set().any(|id| id == member)
            && view
                .map
                .osds
                .get(&member)
                .is_some_and(|o| o.up_from == up_from)
    }

    async fn take_slot(self: &Rc<Self>) -> Slot {
        let r = &self.recovery;
        std::future::poll_fn(|cx| {
            if r.active.get() < self.recovery_max_active {
                std::task::Poll::Ready(())
            } else {
                r.slot_waiters.borrow_mut().push(cx.waker().clone());
                std::task::Poll::Pending
            }
        })
        .await;
        r.active.set(r.active.get() + 1);
        Slot(self.clone())
    }

    /// Sends a request to `member`'s shard for `pg` and returns its reply.
    pub(crate) async fn ask(
        self: &Rc<Self>,
        view: &MapView,
        member: OsdId,
        pg: PgId,
        msg: Message,
    ) -> Result<Message, i32> {
        let Some(osd) = view.map.osds.get(&member) else {
            return Err(status::ESTALE);
        };
        match self
            .peers
            .call_reply(osd, osd.shard_of(pg), view.map.epoch, msg)
            .await?
        {
            m @ Message::Reply { status: 0, .. } => Ok(m),
            Message::Reply { status: st, .. } => Err(st),
            _ => Err(status::EIO),
        }
    }

    /// The objects of `pg` that `member`'s last restart left in doubt
    /// ([`Message::PgSuspects`]); with `rebooted_only`, only those whose doubt
    /// is a reboot's (a member that does not know the selection answers all).
    pub(crate) async fn member_suspects(
        self: &Rc<Self>,
        view: &MapView,
        pg: PgId,
        member: OsdId,
        rebooted_only: bool,
    ) -> Result<Vec<ObjectId>, i32> {
        let msg = Message::PgSuspects {
            id: RequestId(0),
            epoch: view.map.epoch,
            pg,
            rebooted_only,
        };
        self.ask_object_list(view, member, pg, msg).await
    }

    /// Sends `msg` (PG_LIST, PG_SUSPECTS) to `member` and decodes the object
    /// list its reply carries.
    async fn ask_object_list(
        self: &Rc<Self>,
        view: &MapView,
        member: OsdId,
        pg: PgId,
        msg: Message,
    ) -> Result<Vec<ObjectId>, i32> {
        let Message::Reply { data, .. } = self.ask(view, member, pg, msg).await? else {
            return Err(status::EIO);
        };
        decode_object_list(&data).ok_or(status::EIO)
    }

    /// Marks in `sums` the blocks of `ranges` (what this copy rewrote since its
    /// restart, `store/rewritten.rs`, taken before the sums were read: a write
    /// landing in between is then not marked beside a sum from before it),
    /// extending `sums` with zero blocks where a rewritten block lies past them
    /// (zeroed or removed since), up to the object's size.
    pub(crate) fn mark_rewritten(&self, ranges: &[(u32, u32)], sums: &mut Vec<BlockSum>) {
        let Some(&(_, end)) = ranges.last() else {
            return;
        };
        let object_blocks = (self.view().map.pool.object_size / BLOCK) as usize;
        let end = (end as usize).min(object_blocks);
        if sums.len() < end {
            sums.resize(end, BlockSum::default());
        }
        for &(first, last) in ranges {
            for b in first as usize..(last as usize).min(sums.len()) {
                sums[b].rewritten = true;
            }
        }
    }

    /// Every object of `pg` on `member` (this OSD: the local store).
    pub(crate) async fn list_objects(
        self: &Rc<Self>,
        view: &MapView,
        pg: PgId,
        member: OsdId,
    ) -> Result<Vec<ObjectId>, i32> {
        if member == self.osd {
            return self.store.list_pg(pg).await.map_err(|e| {
                tracing::error!(%pg, "cannot list the placement group: {e}");
                status::EIO
            });
        }
        let mut out = Vec::new();
        let mut start = ObjectId {
            volume: VolumeId(0),
            index: 0,
        };
        for _ in 0..LIST_PAGES_MAX {
            let msg = Message::PgList {
                id: RequestId(0),
                epoch: view.map.epoch,
                pg,
                start,
                max: PG_LIST_MAX,
            };
            let page = self.ask_object_list(view, member, pg, msg).await?;
            let done = page.len() < PG_LIST_MAX as usize;
            let Some(last) = page.last().copied() else {
                break;
            };
            out.extend(page);
            if done {
                break;
            }
            start = match last.index.checked_add(1) {
                Some(i) => ObjectId {
                    volume: last.volume,
                    index: i,
                },
                None => match last.volume.0.checked_add(1) {
                    Some(v) => ObjectId {
                        volume: VolumeId(v),
                        index: 0,
                    },
                    None => break,
                },
            };
        }
        Ok(out)
    }

    /// The block checksums of an object on `member` (this OSD: the local store).
    pub(crate) async fn object_sums(
        self: &Rc<Self>,
        view: &MapView,
        pg: PgId,
        object: ObjectId,
        member: OsdId,
    ) -> Result<Vec<BlockSum>, i32> {
        self.object_sums_with(view, pg, object, member, false).await
    }

    /// [`Self::object_sums`], with the blocks `member` rewrote since its restart
    /// marked ([`BlockSum::rewritten`]) if `rewritten`.
    pub(crate) async fn object_sums_with(
        self: &Rc<Self>,
        view: &MapView,
        pg: PgId,
        object: ObjectId,
        member: OsdId,
        rewritten: bool,
    ) -> Result<Vec<BlockSum>, i32> {
        if member == self.osd {
            let ranges = rewritten.then(|| self.store.rewritten_blocks(object));
            let mut sums = self.store.block_sums(pg, object).await.map_err(|e| {
                tracing::error!(%object, "cannot checksum the object: {e}");
                status::EIO
            })?;
            if let Some(ranges) = ranges {
                self.mark_rewritten(&ranges, &mut sums);
            }
            return Ok(sums);
        }
        let target = IoTarget {
            pg,
            object,
            offset: if rewritten {
                flame_common::protocol::OBJECT_SUMS_REWRITTEN
            } else {
                0
            },
            length: 0,
        };
        let reply = self
            .ask(
                view,
                member,
                pg,
                Message::ObjectSums {
                    id: RequestId(0),
                    epoch: view.map.epoch,
                    target,
                },
            )
            .await?;
        let Message::Reply { data, .. } = reply else {
            return Err(status::EIO);
        };
        decode_block_sums(&data).ok_or(status::EIO)
    }

    /// Copies `[offset, offset+len)` of an object from this copy to `member`: runs
    /// of all-zero blocks as DISCARD (holes stay holes), the rest as WRITE, both
    /// replica-flagged. Returns the bytes sent. The caller holds the object's gate.
    pub(crate) async fn copy_range(
        self: &Rc<Self>,
        view: &MapView,
        pg: PgId,
        object: ObjectId,
        member: OsdId,
        offset: u32,
        len: u32,
    ) -> Result<u64, i32> {
        self.copy_range_with(view, pg, object, member, (offset, len), CopyMode::RECOVERY)
            .await
    }

    /// [`Self::copy_range`] with the copy's flags and throttling chosen by `mode`.
    pub(crate) async fn copy_range_with(
        self: &Rc<Self>,
        view: &MapView,
        pg: PgId,
        object: ObjectId,
        member: OsdId,
        (offset, len): (u32, u32),
        mode: CopyMode,
    ) -> Result<u64, i32> {
        let copy_flags = if mode.fua {
            flags::REPLICA | flags::FUA
        } else {
            flags::REPLICA
        };
        let mut sent = 0u64;
        let end = offset + len;
        let mut at = offset;
        // Bounded: `at` advances by at least one block per round.
        while at < end {
            let n = COPY_CHUNK_BYTES.min(end - at);
            if mode.throttled {
                throttle(
                    &self.recovery.copy_next,
                    u64::from(n),
                    self.recovery_bytes_per_sec,
                )
                .await;
            }
            let data = match self.store.read(pg, object, at, n).await {
                Err(StoreError::Checksum { blocks, .. }) if mode.repairs_source => {
                    self.repair_source_blocks(view, (pg, object, member), &blocks)
                        .await?;
                    self.store.read(pg, object, at, n).await
                }
                other => other,
            }
            .map_err(|e| {
                tracing::error!(%object, "recovery cannot read this copy: {e}");
                status::EIO
            })?;
            let mut run_start = 0usize;
            for (lo, hi, zero) in block_runs(data.as_slice()) {
                let target = IoTarget {
                    pg,
                    object,
                    offset: at + lo as u32,
                    length: (hi - lo) as u32,
                };
                let msg = if zero {
                    Message::Discard {
                        id: RequestId(0),
                        epoch: view.map.epoch,
                        target,
                        flags: copy_flags,
                        seq: PgSeq(0),
                        op: flame_common::ids::OpId::NONE,
                    }
                } else {
                    sent += (hi - lo) as u64;
                    Message::Write {
                        id: RequestId(0),
                        epoch: view.map.epoch,
                        target,
                        flags: copy_flags,
                        seq: PgSeq(0),
                        op: flame_common::ids::OpId::NONE,
                        remote: None,
                        data: data.slice(lo..hi),
                    }
                };
                self.ask(view, member, pg, msg).await?;
                run_start = hi;
            }
            debug_assert_eq!(run_start, data.len());
            at += n;
        }
        crate::metrics::recovery_bytes(sent);
        self.recovery_shared
            .bytes_recovered
            .fetch_add(sent, Ordering::Relaxed);
        Ok(sent)
    }

    /// This copy is a recovery source and `blocks` of `object` fail their
    /// checksums on it: copying them would spread the damage, and waiting for a
    /// read or a scrub (a day away) to repair them would hold the member's
    /// recovery until then (simulator seeds 64 and 159, bit rot). Repairs them
    /// from another acting copy first, as a read does (`repair_one` asks only
    /// replicas that lack no write there, and never `member`, the copy being
    /// brought up to date, whose bytes may be the older ones: a restarted
    /// member's suspect object, a peering target). The caller holds the
    /// object's write gate. EIO when some block has no copy to repair it from.
    async fn repair_source_blocks(
        self: &Rc<Self>,
        view: &MapView,
        (pg, object, member): (PgId, ObjectId, OsdId),
        blocks: &[u32],
    ) -> Result<(), i32> {
        let whole = IoTarget {
            pg,
            object,
            offset: 0,
            length: 0,
        };
        for &block in blocks {
            if let Err(st) = self.repair_one(view, &whole, block, Some(member)).await {
                tracing::error!(%object, block, st, "this copy has a block failing its checksum that no other copy could repair; not copying it");
                return Err(status::EIO);
            }
        }
        tracing::warn!(%object, blocks = blocks.len(), "repaired blocks failing their checksums on the recovery source before copying them");
        Ok(())
    }

    /// Brings one object of `member` up to date with this copy, holding the
    /// object's write gate throughout. `ranges`: only these (log-based); `None`:
    /// compare every block (backfill, peering). Returns whether anything changed.
    pub(crate) async fn sync_object(
        self: &Rc<Self>,
        view: &MapView,
        pg: PgId,
        object: ObjectId,
        member: OsdId,
        ranges: Option<Vec<(u32, u32)>>,
    ) -> Result<bool, i32> {
        let object_size = view.map.pool.object_size;
        let _slot = self.take_slot().await;
        let (_guard, earlier) = self.gate.enter(object, 0, object_size);
        for e in earlier {
            e.wait().await;
        }
        if let Some(ranges) = ranges {
            for (off, len) in merge_ranges(ranges, object_size) {
                self.copy_range(view, pg, object, member, off, len).await?;
            }
            return Ok(true);
        }
        let mut local = self.object_sums(view, pg, object, self.osd).await?;
        let bad: Vec<u32> = (0u32..)
            .zip(&local)
            .filter(|(_, b)| b.bad)
            .map(|(i, _)| i)
            .collect();
        if !bad.is_empty() {
            self.repair_source_blocks(view, (pg, object, member), &bad)
                .await?;
            local = self.object_sums(view, pg, object, self.osd).await?;
            if local.iter().any(|b| b.bad) {
                tracing::error!(%object, "this copy still has blocks failing their checksums; not copying it");
                return Err(status::EIO);
            }
        }
        let remote = self.object_sums(view, pg, object, member).await?;
        if local.is_empty() {
            if remote.is_empty() {
                return Ok(false);
            }
            let target = IoTarget {
                pg,
                object,
                offset: 0,
                length: 0,
            };
            self.ask(
                view,
                member,
                pg,
                Message::RemoveObject {
                    id: RequestId(0),
                    epoch: view.map.epoch,
                    target,
                    flags: flags::REPLICA,
                },
            )
            .await?;
            return Ok(true);
        }
        let diff = differing_ranges(&local, &remote);
        for &(off, len) in &diff {
            self.copy_range(view, pg, object, member, off, len).await?;
        }
        Ok(!diff.is_empty())
    }

    /// Makes `member`'s copies of the volumes' objects stable (a replica-flagged
    /// FLUSH per volume) before it is reported complete.
    async fn flush_member(
        self: &Rc<Self>,
        view: &MapView,
        pg: PgId,
        member: OsdId,
        volumes: &BTreeSet<VolumeId>,
    ) -> Result<(), i32> {
        for &volume in volumes {
            self.ask(
                view,
                member,
                pg,
                Message::Flush {
                    id: RequestId(0),
                    epoch: view.map.epoch,
                    flags: flags::REPLICA,
                    volume,
                },
            )
            .await?;
        }
        Ok(())
    }

    /// Runs `work` on every object of `objects` with up to `recovery_max_active`
    /// at once, checking before each that the job is still valid.
    async fn for_each_object(
        self: &Rc<Self>,
        view: &Rc<MapView>,
        pg: PgId,
        member: OsdId,
        (up_from, primacy): (Epoch, u64),
        objects: Vec<ObjectWork>,
        kind: &'static str,
    ) -> Result<BTreeSet<VolumeId>, JobError> {
        let mut changed = BTreeSet::new();
        let total = objects.len() as u64;
        let width = self.recovery_max_active.max(1) as usize;
        for (done, batch) in objects.chunks(width).enumerate() {
            if !self.job_valid(pg, member, up_from, primacy) {
                return Err(JobError::Abandoned);
            }
            self.recovery
                .remaining_per_job
                .borrow_mut()
                .insert((pg, member), total.saturating_sub((done * width) as u64));
            let tasks: Vec<_> = batch
                .iter()
                .cloned()
                .map(|(object, ranges)| {
                    let me = self.clone();
                    let view = view.clone();
                    reactor::spawn(async move {
                        me.sync_object(&view, pg, object, member, ranges).await
                    })
                })
                .collect();
            for (t, (object, _)) in tasks.into_iter().zip(batch) {
                match t.await {
                    Ok(true) => {
                        changed.insert(object.volume);
                        crate::metrics::recovery_object(kind);
                        self.recovery_shared
                            .objects_recovered
                            .fetch_add(1, Ordering::Relaxed);
                        *self
                            .recovery
                            .recovered_per_pg
                            .borrow_mut()
                            .entry(pg)
                            .or_default() += 1;
                    }
                    Ok(false) => {}
                    Err(st) => return Err(JobError::Failed(st)),
                }
            }
        }
        // The caller removes the entry when the whole job ends (after the flush).
        self.recovery
            .remaining_per_job
            .borrow_mut()
            .insert((pg, member), 0);
        Ok(changed)
    }

    /// Backfill (and peering): makes every object of `member`'s copy of `pg`
    /// equal to this one.
    async fn backfill(
        self: &Rc<Self>,
        view: &Rc<MapView>,
        pg: PgId,
        member: OsdId,
        job: (Epoch, u64),
        kind: &'static str,
    ) -> Result<BTreeSet<VolumeId>, JobError> {
        let mine = self
            .list_objects(view, pg, self.osd)
            .await
            .map_err(JobError::Failed)?;
        let theirs = self
            .list_objects(view, pg, member)
            .await
            .map_err(JobError::Failed)?;
        let all: BTreeSet<ObjectId> = mine.into_iter().chain(theirs).collect();
        let objects = all.into_iter().map(|o| (o, None)).collect();
        // Only the volumes whose objects changed need a flush on the member.
        self.for_each_object(view, pg, member, job, objects, kind)
            .await
    }

    /// Catches `member` up on `pg`, from the log when it can tell what the member
    /// missed, else by backfill; then flushes it and queues its report.
    async fn recover_member(
        self: &Rc<Self>,
        view: &Rc<MapView>,
        pg: PgId,
        member: OsdId,
    ) -> Result<&'static str, JobError> {
        let up_from = view
            .map
            .osds
            .get(&member)
            .map(|o| o.up_from)
            .ok_or(JobError::Abandoned)?;
        // The group's core is made now if it has none, so that its generation
        // stays put unless the primacy really changes (a first write mid-job
        // must not look like one).
        let job = (up_from, self.pgs.borrow_mut().get_mut(pg).primacy());
        // Writes numbered up to here may have been admitted under a map without the
        // member in the write set; all later ones have it (see `inflight_through`).
        let admitted = self.pgs.borrow().log(pg).map_or(0, |l| l.last_seq());
        let deadline = clock::now() + INFLIGHT_WAIT_MAX;
        let mut copied: HashSet<u64> = HashSet::default();
        let mut volumes = BTreeSet::new();
        let mut kind = "log";
        let mut rounds = 0u32;
        // What the member's restart left in doubt: writes it acknowledged but had
        // not made stable, which a power cut may have taken although this log says
        // it applied them. Copied whole first (too many: backfill).
        let mut backfill_anyway = false;
        match self.member_suspects(view, pg, member, false).await {
            Ok(suspects) if !suspects.is_empty() => {
                let objects = suspects.into_iter().map(|o| (o, None)).collect();
                volumes.extend(
                    self.for_each_object(view, pg, member, job, objects, "log")
                        .await?,
                );
            }
            Ok(_) => {}
            Err(status::E2BIG) => backfill_anyway = true,
            Err(st) => return Err(JobError::Failed(st)),
        }
        // Bounded: at most LOG_ROUNDS_MAX copying rounds, and waiting rounds end at
        // the deadline.
        loop {
            let (missed, inflight) = {
                let logs = self.pgs.borrow();
                match logs.log(pg) {
                    Some(_) if backfill_anyway => (None, false),
                    Some(log) => (log.catch_up(member), log.inflight_through(admitted)),
                    None => (None, false),
                }
            };
            let Some(missed) = missed else {
                if rounds > 0 {
                    // The log stopped reaching back while the job ran.
                    return Err(JobError::Failed(status::EAGAIN));
                }
                kind = "backfill";
                break;
            };
            let missed: Vec<_> = missed
                .into_iter()
                .filter(|(seq, ..)| !copied.contains(seq))
                .collect();
            if missed.is_empty() {
                if !inflight {
                    break;
                }
                if clock::now() > deadline {
                    return Err(JobError::Failed(status::EAGAIN));
                }
                reactor::sleep(Duration::from_millis(10)).await;
                continue;
            }
            rounds += 1;
            if rounds > LOG_ROUNDS_MAX {
                return Err(JobError::Failed(status::EAGAIN));
            }
            let mut per_object: BTreeMap<ObjectId, Vec<(u32, u32)>> = BTreeMap::new();
            for (seq, object, off, len) in missed {
                copied.insert(seq);
                per_object.entry(object).or_default().push((off, len));
            }
            volumes.extend(per_object.keys().map(|o| o.volume));
            let objects = per_object.into_iter().map(|(o, r)| (o, Some(r))).collect();
            self.for_each_object(view, pg, member, job, objects, "log")
                .await?;
        }
        let mut through = admitted;
        if kind == "backfill" {
            // Writes admitted before the job (numbered up to `admitted`) may have
            // been admitted under a map without the member: one still in flight
            // could create an object after the listing below, which would then
            // never be compared. Wait for them first (bounded).
            while self
                .pgs
                .borrow()
                .log(pg)
                .is_some_and(|l| l.inflight_through(admitted))
            {
                if clock::now() > deadline {
                    return Err(JobError::Failed(status::EAGAIN));
                }
                reactor::sleep(Duration::from_millis(10)).await;
            }
            // Entries recorded from now on are covered by the member getting every
            // write; the ones before by comparing everything.
            through = self.pgs.borrow().log(pg).map_or(0, |l| l.last_seq());
            volumes = self.backfill(view, pg, member, job, "backfill").await?;
        }
        self.flush_member(view, pg, member, &volumes)
            .await
            .map_err(JobError::Failed)?;
        if !self.job_valid(pg, member, up_from, job.1) {
            return Err(JobError::Abandoned);
        }
        self.pgs
            .borrow_mut()
            .get_mut(pg)
            .log
            .recovered(member, through);
        // Its doubt was compared first (or everything, by backfill): nothing is
        // left to compare when it joins the acting set, which would show as
        // recovery work after the group is clean.
        self.suspects_compared(pg, member, up_from);
        crate::metrics::recovery_member(kind);
        Ok(kind)
    }

    /// One pass over the groups this shard is the primary of.
    async fn recovery_pass(self: &Rc<Self>, view: &Rc<MapView>) {
        let mut pgs: Vec<(PgId, PgMembers)> = view
            .table
            .iter()
            .filter(|(pg, m)| m.primary() == Some(self.osd) && self.holds(view, *pg))
            .map(|(pg, m)| (pg, m.clone()))
            .collect();
        // Groups whose I/O waits for this copy's restart doubt go first.
        pgs.sort_by_key(|(pg, _)| !self.suspects.borrow().has(*pg));
        for (pg, members) in pgs {
            // A newer map arrived: re-plan with it.
            if self.view().map.epoch != view.map.epoch {
                return;
            }
            if self
                .recovery
                .retry_after
                .borrow()
                .get(&pg)
                .is_some_and(|t| *t > clock::now())
            {
                continue;
            }
            let timings = PassTimings {
                report_retry: REPORT_RETRY,
                lagging_grace: self.lease * LAGGING_GRACE_LEASES,
            };
            // The group's core is made now if it has none (as a job does), so
            // that its primacy stays put. The steps are planned under this
            // primacy: peering's comparisons run under it (a job that sees it
            // change is abandoned), and the group is marked peered under it
            // (`peered_now` compares with the current one; recoveries check
            // the current one themselves). Refusing the mark when the primacy
            // moved changed simulator seeds 310153 and 312369 into failures
            // (docs/testing.md, open seeds): not done until understood.
            let primacy = self.pgs.borrow_mut().get_mut(pg).primacy();
            let mut pass = GroupPass::new(timings);
            loop {
                let facts = self.group_facts(view, pg, &members, primacy);
                let Some(step) = pass.next(&facts) else {
                    break;
                };
                let outcome = self.run_step(view, pg, &members, primacy, step).await;
                pass.record(step, outcome);
            }
            if pass.failed() {
                self.recovery
                    .retry_after
                    .borrow_mut()
                    .insert(pg, clock::now() + RETRY_DELAY);
            } else {
                self.recovery.retry_after.borrow_mut().remove(&pg);
            }
        }
    }

    /// `pg` as its recovery pass sees it now ([`GroupPass::next`]).
    fn group_facts(
        &self,
        view: &MapView,
        pg: PgId,
        members: &PgMembers,
        primacy: u64,
    ) -> GroupFacts {
        let up_from = |osd: OsdId| view.map.osds.get(&osd).map(|o| o.up_from);
        let logs = self.pgs.borrow();
        let log = logs.log(pg);
        let checked = self.recovery.suspects_checked.borrow();
        let lagging_since = self.recovery.lagging_since.borrow();
        let reported = self.recovery.reported.borrow();
        GroupFacts {
            in_doubt: self.suspects.borrow().has(pg),
            peered: self.recovery.peered.borrow().get(&pg) == Some(&primacy),
            replicas: members
                .acting
                .iter()
                .skip(1)
                .map(|&osd| ReplicaFacts {
                    osd,
                    up_from: up_from(osd),
                    doubt_compared: checked.get(&(pg, osd)).copied(),
                    lagging: log.is_some_and(|l| l.lags(osd)),
                    lagging_for: lagging_since.get(&(pg, osd)).map(|t| clock::elapsed(*t)),
                })
                .collect(),
            recovering: members
                .recovering
                .iter()
                .map(|&osd| RecoveringFacts {
                    osd,
                    up_from: up_from(osd),
                    reported: reported
                        .get(&(pg, osd))
                        .map(|r| (r.up_from, clock::elapsed(r.at))),
                })
                .collect(),
        }
    }

    /// Runs one step of `pg`'s recovery pass ([`Step`]), planned with
    /// `members` under this shard's primacy `primacy` of the group.
    async fn run_step(
        self: &Rc<Self>,
        view: &Rc<MapView>,
        pg: PgId,
        members: &PgMembers,
        primacy: u64,
        step: Step,
    ) -> Outcome {
        let outcome_of = |r: Result<(), JobError>| match r {
            Ok(()) => Outcome::Done,
            Err(JobError::Abandoned) => Outcome::Abandoned,
            Err(JobError::Failed(_)) => Outcome::Failed,
        };
        match step {
            Step::SettleOwnDoubt => match self.pull_suspects(view, pg, members).await {
                Ok(()) => Outcome::Done,
                Err(st) => {
                    tracing::info!(%pg, st, "settling this copy's restart doubt did not finish; will retry");
                    Outcome::Failed
                }
            },
            Step::TakeNewerCopies => match self.take_newer_copies(view, pg, members).await {
                Ok(_) => Outcome::Done,
                Err(st) => {
                    tracing::info!(%pg, st, "peering: taking a newer copy did not finish; will retry");
                    Outcome::Failed
                }
            },
            Step::PeerWith(member, up_from) => {
                let r = match self
                    .backfill(view, pg, member, (up_from, primacy), "peering")
                    .await
                {
                    Ok(volumes) => match self.flush_member(view, pg, member, &volumes).await {
                        Err(st) => {
                            tracing::warn!(%pg, %member, st, "peering: flush failed");
                            Outcome::Failed
                        }
                        Ok(()) => {
                            if let Some(core) = self.pgs.borrow_mut().existing_mut(pg)
                                && core.primacy() == primacy
                            {
                                // Its copy equals this one's now: its log
                                // tracking is a base for catching it up.
                                core.log.peered(member);
                            }
                            Outcome::Done
                        }
                    },
                    Err(e) => {
                        tracing::debug!(%pg, %member, ?e, "peering comparison did not finish; will retry");
                        outcome_of(Err(e))
                    }
                };
                self.job_ended(pg, member);
                r
            }
            Step::MarkPeered => {
                self.recovery.peered.borrow_mut().insert(pg, primacy);
                // Peering compared every object of every member, the ones
                // their restarts left in doubt included.
                for &member in members.acting.iter().skip(1) {
                    if let Some(o) = view.map.osds.get(&member) {
                        self.suspects_compared(pg, member, o.up_from);
                    }
                }
                Outcome::Done
            }
            // A complete replica that restarted (it stayed complete: the group
            // could not go on without it) may lack acknowledged writes its
            // power cut took: its doubtful objects are compared once per
            // incarnation.
            Step::CompareDoubt(member, up_from) => {
                crate::metrics::doubt_comparison();
                let r = self
                    .push_member_suspects(view, pg, member, (up_from, primacy))
                    .await;
                match &r {
                    Ok(()) => self.suspects_compared(pg, member, up_from),
                    Err(JobError::Failed(st)) => {
                        tracing::debug!(%pg, %member, st, "comparing a restarted member's doubt did not finish; will retry");
                    }
                    Err(JobError::Abandoned) => {}
                }
                self.job_ended(pg, member);
                outcome_of(r)
            }
            Step::Recover(member, up_from) => {
                let result = self.recover_member(view, pg, member).await;
                self.job_ended(pg, member);
                match result {
                    Ok(kind) => {
                        tracing::info!(%pg, %member, kind, "member recovered");
                        self.report_recovered(view, pg, member, up_from);
                        Outcome::Done
                    }
                    Err(JobError::Abandoned) => {
                        tracing::info!(%pg, %member, "recovery abandoned: roles changed");
                        Outcome::Abandoned
                    }
                    Err(JobError::Failed(st)) => {
                        tracing::info!(%pg, %member, st, "recovery did not finish; will retry");
                        Outcome::Failed
                    }
                }
            }
            // Still recovering in the map long after the report: send it again.
            Step::ResendReport(member, up_from) => {
                self.report_recovered(view, pg, member, up_from);
                Outcome::Done
            }
            Step::StartLagClock(member) => {
                self.recovery
                    .lagging_since
                    .borrow_mut()
                    .insert((pg, member), clock::now());
                Outcome::Done
            }
            Step::ClearLagClock(member) => {
                self.recovery
                    .lagging_since
                    .borrow_mut()
                    .remove(&(pg, member));
                Outcome::Done
            }
            // A complete member that failed writes of this interval (a forward
            // that timed out or met a broken connection, while the member stayed
            // up): those writes were never acknowledged, but the member must not
            // keep the older bytes while the other copies have the newer ones —
            // a later failover would serve them, and its copy would differ. The
            // client's retry repairs it when there is one; a write the client
            // gave up on has none. Caught up from the log like a recovering
            // member (it stays complete in the map: it lacks no acknowledged write).
            Step::CatchUp(member) => {
                self.recovery
                    .lagging_since
                    .borrow_mut()
                    .remove(&(pg, member));
                let r = self.recover_member(view, pg, member).await.map(|_| ());
                match &r {
                    Ok(()) => {
                        tracing::info!(%pg, %member, "complete member caught up on writes it failed");
                    }
                    Err(JobError::Failed(st)) => {
                        tracing::debug!(%pg, %member, st, "catching up a complete member did not finish; will retry");
                    }
                    Err(JobError::Abandoned) => {}
                }
                self.job_ended(pg, member);
                outcome_of(r)
            }
        }
    }

    /// The job for (`pg`, `member`) ended: it no longer counts as work left.
    fn job_ended(&self, pg: PgId, member: OsdId) {
        self.recovery
            .remaining_per_job
            .borrow_mut()
            .remove(&(pg, member));
    }

    /// Queues `member`'s report as recovered in `pg` (incarnation `up_from`)
    /// and remembers it, so that it is not recovered again while the map
    /// catches up.
    fn report_recovered(&self, view: &MapView, pg: PgId, member: OsdId, up_from: Epoch) {
        self.recovery_shared.push_report(view.map.epoch, pg, member);
        self.recovery.reported.borrow_mut().insert(
            (pg, member),
            Reported {
                up_from,
                primacy: self.pgs.borrow().primacy(pg),
                at: clock::now(),
            },
        );
    }

    /// A new map: failed jobs may succeed now, and members reported recovered
    /// that the map no longer shows recovering are done. (A change of primacy is
    /// handled where the shard first sees the map, [`Shard::view`]: peering and
    /// jobs are keyed by the primacy generation.)
    fn on_new_map(&self, view: &MapView) {
        self.recovery.retry_after.borrow_mut().clear();
        let pgs = self.pgs.borrow();
        self.recovery
            .reported
            .borrow_mut()
            .retain(|(pg, member), r| {
                view.table.pg(*pg).recovering.contains(member) && r.primacy == pgs.primacy(*pg)
            });
        self.recovery
            .peered
            .borrow_mut()
            .retain(|pg, primacy| *primacy == pgs.primacy(*pg));
        self.recovery
            .suspects_checked
            .borrow_mut()
            .retain(|(pg, member), _| {
                let m = view.table.pg(*pg);
                m.acting.contains(member) || m.recovering.contains(member)
            });
    }

    /// Whether peering compared every other complete copy of `pg` with this
    /// one under this shard's current primacy of it: only then are the copies
    /// expected to agree (a write the previous primary applied on some copies
    /// and not others is peering's to settle, not a scrub's: seed 230204).
    pub(crate) fn peered_now(&self, pg: PgId) -> bool {
        let primacy = self.pgs.borrow().primacy(pg);
        self.recovery.peered.borrow().get(&pg) == Some(&primacy)
    }

    /// This shard, `pg`'s primary, compared `member`'s restart doubt for its
    /// incarnation `up_from` (or peering compared every object of it).
    fn suspects_compared(&self, pg: PgId, member: OsdId, up_from: Epoch) {
        self.recovery
            .suspects_checked
            .borrow_mut()
            .insert((pg, member), up_from);
        if let Ok(mut m) = self.recovery_shared.suspects_compared.lock() {
            m.insert((pg, member), up_from);
        }
    }

    /// Deletes copies of groups this OSD is no longer a member of, once the group
    /// is active and the copy has been stray for `stray_delete_delay_ms`.
    async fn remove_strays(self: &Rc<Self>, view: &MapView) {
        if !view.map.osds.contains_key(&self.osd) {
            return;
        }
        let dirs = match self.store.list_pg_dirs().await {
            Ok(d) => d,
            Err(e) => {
                tracing::warn!("cannot list placement groups: {e}");
                return;
            }
        };
        let now = clock::now();
        let present: HashSet<PgId> = dirs.iter().copied().collect();
        let mut stray = self.recovery.stray_since.borrow_mut().clone();
        stray.retain(|pg, _| present.contains(pg));
        for pg in dirs {
            if !self.holds(view, pg) || pg.0 >= view.table.pg_count() {
                continue;
            }
            let m = view.table.pg(pg);
            if m.is_member(self.osd) || !m.active {
                stray.remove(&pg);
                continue;
            }
            let since = *stray.entry(pg).or_insert(now);
            if now.duration_since(since) < self.stray_delete_delay {
                continue;
            }
            // Checked again against the newest map just before deleting.
            let fresh = self.view();
            let fm = fresh.table.pg(pg);
            if fm.is_member(self.osd) || !fm.active {
                stray.remove(&pg);
                continue;
            }
            match self.store.delete_pg(pg).await {
                Ok(n) => {
                    tracing::info!(%pg, objects = n, "deleted the copy of a placement group this OSD is no longer a member of");
                    crate::metrics::stray_removed();
                    self.pgs.borrow_mut().remove(pg);
                    stray.remove(&pg);
                }
                Err(e) => tracing::warn!(%pg, "cannot delete a stray copy: {e}"),
            }
        }
        *self.recovery.stray_since.borrow_mut() = stray;
    }

    /// Counts the objects of the groups this shard is the primary of: all of them
    /// every [`OBJECT_COUNT_INTERVAL`], in between only those not counted yet (a
    /// new primary after a failure, whose count the manager needs for the degraded
    /// figure right away).
    async fn count_objects(&self, view: &MapView) {
        let primary: HashSet<PgId> = view
            .table
            .iter()
            .filter(|(pg, m)| m.primary() == Some(self.osd) && self.holds(view, *pg))
            .map(|(pg, _)| pg)
            .collect();
        let due = self
            .recovery
            .object_counts_at
            .get()
            .is_none_or(|t| clock::elapsed(t) >= OBJECT_COUNT_INTERVAL);
        let todo: Vec<PgId> = if due {
            primary.iter().copied().collect()
        } else {
            let counts = self.recovery.object_counts.borrow();
            primary
                .iter()
                .filter(|pg| !counts.contains_key(pg))
                .copied()
                .collect()
        };
        if todo.is_empty() && !due {
            return;
        }
        match self.store.count_pg_objects(&todo).await {
            Ok(n) => {
                debug_assert_eq!(n.len(), todo.len());
                let mut counts = self.recovery.object_counts.borrow_mut();
                counts.retain(|pg, _| primary.contains(pg));
                counts.extend(todo.into_iter().zip(n));
                if due {
                    self.recovery.object_counts_at.set(Some(clock::now()));
                }
            }
            Err(e) => tracing::warn!("cannot count the objects of placement groups: {e}"),
        }
    }

    /// What recovery still has to do for `pg` (roles `m`, primary here): the
    /// objects it can estimate, and whether some recovering member it cannot.
    fn pg_pending(
        &self,
        view: &MapView,
        pg: PgId,
        m: &PgMembers,
        state: &PendingState<'_>,
    ) -> (u64, bool, u64) {
        let PendingState {
            logs,
            jobs,
            reported,
            counts,
        } = *state;
        let mut objects = 0u64;
        let mut unknown = false;
        for &member in &m.recovering {
            let up_from = view.map.osds.get(&member).map(|o| o.up_from);
            let done = reported
                .get(&(pg, member))
                .is_some_and(|r| Some(r.up_from) == up_from);
            let log_objects = logs.log(pg).and_then(|l| l.catch_up(member)).map(|e| {
                e.iter()
                    .map(|(_, object, ..)| *object)
                    .collect::<HashSet<_>>()
                    .len() as u64
            });
            match member_pending(
                done,
                jobs.get(&(pg, member)).copied(),
                log_objects,
                counts.get(&pg).copied(),
            ) {
                Some(n) => objects = objects.saturating_add(n),
                None => unknown = true,
            }
        }
        // Comparisons of the complete copies (peering, a restarted member's
        // doubt, a lagging member's catch-up): shown apart.
        let mut comparing = 0u64;
        for ((p, member), n) in jobs {
            if *p == pg && !m.recovering.contains(member) {
                comparing = comparing.saturating_add(*n);
            }
        }
        (objects, unknown, comparing)
    }

    /// Publishes this shard's per-group status and what its recovery still has
    /// to do. Runs from its own task, also while a recovery pass is under way;
    /// skips a round if some state is borrowed at that instant.
    fn publish_status(&self, view: &MapView) {
        let (Ok(logs), Ok(recovered), Ok(jobs), Ok(reported), Ok(stray), Ok(counts), Ok(peered)) = (
            self.pgs.try_borrow(),
            self.recovery.recovered_per_pg.try_borrow(),
            self.recovery.remaining_per_job.try_borrow(),
            self.recovery.reported.try_borrow(),
            self.recovery.stray_since.try_borrow(),
            self.recovery.object_counts.try_borrow(),
            self.recovery.peered.try_borrow(),
        ) else {
            return;
        };
        let mut out = Vec::new();
        let mut work = ShardWork::default();
        let mut unpeered = 0u64;
        for (pg, m) in view.table.iter() {
            if !self.holds(view, pg) {
                continue;
            }
            let log = logs.log(pg);
            let role = if m.primary() == Some(self.osd) {
                "primary"
            } else if m.recovering.contains(&self.osd) {
                "recovering"
            } else if m.acting.contains(&self.osd) {
                "replica"
            } else if stray.contains_key(&pg) {
                "stray"
            } else {
                "none"
            };
            if role == "none" && log.is_none() {
                continue;
            }
            let (pending, unknown, comparing) = if role == "primary" {
                let state = PendingState {
                    logs: &logs,
                    jobs: &jobs,
                    reported: &reported,
                    counts: &counts,
                };
                self.pg_pending(view, pg, m, &state)
            } else {
                (0, false, 0)
            };
            let is_peered = role == "primary" && peered.get(&pg) == Some(&logs.primacy(pg));
            unpeered += u64::from(role == "primary" && !is_peered);
            if role == "primary" && !m.recovering.is_empty() {
                work.pgs_recovering += 1;
                work.pgs_unestimated += u32::from(unknown);
            }
            work.objects = work.objects.saturating_add(pending);
            out.push(PgStatus {
                pg: pg.0,
                shard: self.id,
                epoch: view.map.epoch.0,
                role,
                acting: m.acting.iter().map(|o| o.0).collect(),
                recovering: m.recovering.iter().map(|o| o.0).collect(),
                active: m.active,
                peered: is_peered,
                log_first_seq: log.map_or(1, |l| l.first_seq()),
                log_last_seq: log.map_or(0, |l| l.last_seq()),
                log_entries: log.map_or(0, |l| l.len()),
                objects_recovered_total: recovered.get(&pg).copied().unwrap_or(0),
                objects_remaining: pending,
                remaining_unknown: unknown,
                objects_comparing: comparing,
                objects: counts.get(&pg).copied().filter(|_| role == "primary"),
            });
        }
        crate::metrics::recovery_remaining(self.id, work.objects);
        crate::metrics::pgs_unpeered(self.id, unpeered);
        self.recovery_shared.publish(self.id, out, work);
    }
}

/// What [`Shard::pg_pending`] reads, borrowed once per publish.
#[derive(Clone, Copy)]
struct PendingState<'a> {
    logs: &'a crate::pg_core::PgCores,
    jobs: &'a HashMap<(PgId, OsdId), u64>,
    reported: &'a HashMap<(PgId, OsdId), Reported>,
    counts: &'a HashMap<PgId, u64>,
}

/// Publishes the shard's status every [`PUBLISH_INTERVAL`], whatever recovery is
/// doing (a pass can run for as long as the whole recovery).
async fn publish_loop(shard: Rc<Shard>) {
    loop {
        shard.publish_status(&shard.view());
        reactor::sleep(PUBLISH_INTERVAL).await;
    }
}

/// The shard's recovery task: runs for the life of the shard.
pub(crate) async fn recovery_loop(shard: Rc<Shard>) {
    crate::metrics::register_recovery_metrics(shard.id);
    reactor::spawn(publish_loop(shard.clone())).detach();
    let mut last_stray: Option<Instant> = None;
    let mut doubt_retry_after: Option<Instant> = None;
    loop {
        let view = shard.view();
        if shard.recovery.last_epoch.get() != Some(view.map.epoch) {
            shard.on_new_map(&view);
            shard.recovery.last_epoch.set(Some(view.map.epoch));
        }
        shard.recovery_pass(&view).await;
        if shard.doubt_record.stale()
            && doubt_retry_after.is_none_or(|t| clock::now() >= t)
            && let Err(e) = shard.doubt_record.persist(shard.store.fs()).await
        {
            // The record on disk still names the settled groups: a later
            // restart compares them again (safe). Tried again after a while.
            tracing::warn!(
                shard = shard.id,
                "cannot rewrite the restart-doubt record: {e}"
            );
            doubt_retry_after = Some(clock::now() + STRAY_CHECK_INTERVAL);
        }
        if last_stray.is_none_or(|t| clock::elapsed(t) >= STRAY_CHECK_INTERVAL) {
            shard.remove_strays(&view).await;
            last_stray = Some(clock::now());
        }
        shard.background_scrub(&view).await;
        shard.count_objects(&shard.view()).await;
        reactor::sleep(POLL_INTERVAL).await;
    }
}

#[cfg(test)]
mod gate_test;
mod group_pass;
mod newest_copy;
mod suspects;

#[cfg(test)]
mod tests {
    use super::*;

    fn b(sum: u32) -> BlockSum {
        BlockSum {
            sum,
            ..BlockSum::default()
        }
    }

    #[test]
    fn blocks_are_split_into_zero_and_data_runs() {
        let b = BLOCK as usize;
        let mut data = vec![0u8; 5 * b + 100];
        data[b] = 1;
        data[2 * b + 7] = 1;
        data[5 * b + 99] = 1;
        assert_eq!(
            block_runs(&data),
            vec![
                (0, b, true),
                (b, 3 * b, false),
                (3 * b, 5 * b, true),
                (5 * b, 5 * b + 100, false)
            ]
        );
        assert!(block_runs(&[]).is_empty());
        assert_eq!(block_runs(&[0; 10]), vec![(0, 10, true)]);
    }

    #[test]
    fn differing_blocks_are_coalesced_into_ranges() {
        let local = vec![b(1), b(2), b(3), b(0), b(5)];
        let mut remote = vec![b(1), b(9), b(9), b(0)];
        assert_eq!(
            differing_ranges(&local, &remote),
            vec![(4096, 8192), (16384, 4096)]
        );
        remote[0].bad = true;
        assert_eq!(differing_ranges(&local, &remote)[0], (0, 12288));
        // The member has blocks beyond this copy's end: they must become zero.
        assert_eq!(differing_ranges(&[], &[b(0), b(7)]), vec![(4096, 4096)]);
        assert!(differing_ranges(&local, &local).is_empty());
    }

    #[test]
    fn pending_work_of_a_recovering_member() {
        // Reported recovered, the map not caught up: nothing left.
        assert_eq!(member_pending(true, Some(5), Some(3), Some(9)), Some(0));
        // A running job knows best.
        assert_eq!(member_pending(false, Some(5), Some(3), Some(9)), Some(5));
        assert_eq!(member_pending(false, Some(0), None, Some(9)), Some(0));
        // Not started: a log catch-up copies the objects of the entries missed...
        assert_eq!(member_pending(false, None, Some(3), Some(9)), Some(3));
        assert_eq!(member_pending(false, None, Some(0), Some(9)), Some(0));
        // ...else a backfill compares every object of the group...
        assert_eq!(member_pending(false, None, None, Some(9)), Some(9));
        // ...unless they are not counted yet: unknown, not 0.
        assert_eq!(member_pending(false, None, None, None), None);
    }

    #[test]
    fn log_ranges_are_widened_to_blocks_and_merged() {
        assert_eq!(
            merge_ranges(vec![(5000, 10), (0, 100), (4096, 4096)], 1 << 20),
            vec![(0, 8192)]
        );
        assert_eq!(
            merge_ranges(vec![(8192, 1), (65536 - 1, 100)], 65536),
            vec![(8192, 4096), (61440, 4096)]
        );
    }

    #[test]
    fn the_byte_throttle_spaces_copies_out() {
        let mut r = reactor::Reactor::new(Default::default()).unwrap();
        let started = clock::now();
        r.block_on(async {
            let next = Cell::new(None);
            for _ in 0..3 {
                throttle(&next, 1 << 20, 20 << 20).await;
            }
        })
        .unwrap();
        // 3 MiB at 20 MiB/s: the third waits for the first two (~100 ms).
        assert!(clock::elapsed(started) >= Duration::from_millis(90));
    }
}
