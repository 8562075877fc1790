//! OSD metrics. Data-path counters carry a `shard` label and each shard resolves its
//! children once at start, so shards never contend on a counter.

use flame_common::metrics::LATENCY_BUCKETS_S;
use flame_common::protocol::OpCode;
use prometheus::{
    HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, register_histogram_vec,
    register_int_counter_vec, register_int_gauge_vec,
};
use std::sync::LazyLock;

static OPS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_ops_total",
        "Requests handled, by op, role and shard",
        &["op", "role", "shard"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static HELLO_REFUSALS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_hello_refusals_total",
        "Connections refused at HELLO for want of a valid ticket and proof, by reason (missing, forged_ticket, expired_ticket, bad_proof, replayed, not_an_osd, ...)",
        &["reason"]
    )
    .unwrap_or_else(|e| panic!("metric: {e}"))
});

static STALL_CLOSES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_stalled_connections_closed_total",
        "Connections closed for being stuck past their bound: payload_stall (a payload not delivered within payload_recv_timeout_ms of its header), send_stall (replies not read within send_stall_timeout_ms)",
        &["reason"]
    )
    .unwrap_or_else(|e| panic!("metric: {e}"))
});

/// Counts a connection closed by the stall watchdog.
pub fn stalled_connection_closed(reason: &str) {
    STALL_CLOSES.with_label_values(&[reason]).inc();
}

/// Counts a HELLO refused by the [`crate::hello_gate`].
pub fn hello_refused(reason: &str) {
    HELLO_REFUSALS.with_label_values(&[reason]).inc();
}

static BYTES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_bytes_total",
        "Payload bytes read or written, by op, role and shard",
        &["op", "role", "shard"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static ERRORS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_errors_total",
        "Requests answered with an error, by op and shard",
        &["op", "shard"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static LATENCY: LazyLock<HistogramVec> = LazyLock::new(|| {
    register_histogram_vec!(
        "flame_osd_op_latency_seconds",
        "Time from a request's arrival to its reply being queued, by op and role",
        &["op", "role"],
        LATENCY_BUCKETS_S.to_vec()
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static CONNECTIONS: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register_int_gauge_vec!(
        "flame_osd_connections",
        "Open connections, by kind (client|peer) and shard",
        &["kind", "shard"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});

static INFLIGHT_BYTES: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register_int_gauge_vec!(
        "flame_osd_inflight_bytes",
        "Payload bytes of requests in flight, by kind (client|peer: each has its own bound, max_inflight_bytes_per_shard and max_peer_inflight_bytes_per_shard) and shard",
        &["kind", "shard"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});

static CONVERTED: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_converted_total",
        "Client requests whose data moved by a one-sided transfer (read-write conversion): write = pulled from the client, read = pushed into the client's buffer",
        &["op", "shard"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static CONVERTED_BYTES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_converted_bytes_total",
        "Bytes moved by one-sided transfers of converted requests",
        &["shard"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static FETCH_REPLIES: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_fetch_replies_total",
        "Remote fetching: replies left in a reply area (left), pushed because they do not fit a slot (too_large), pushed because the client asked after empty fetches (fallback)",
        &["result", "shard"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static REPLY_AREAS: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register_int_gauge_vec!(
        "flame_osd_reply_areas",
        "Connections with a reply area (remote fetching), by shard",
        &["shard"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});

static REACTOR: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_reactor_events_total",
        "Run-loop events of the OSD's reactor threads (shard threads, and the network threads of threading: staged): polls (checks of every completion source: io_uring, shm rings, RDMA CQs, staged queues), empty_polls (spin iterations that found nothing), spin_hits (spinning found work), sleeps (blocked in the kernel)",
        &["event", "shard"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static SPIN_BUDGET: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register_int_gauge_vec!(
        "flame_osd_reactor_spin_budget_polls",
        "Current adaptive spin bound of each reactor thread, in empty polls (poll_mode: adaptive)",
        &["shard"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});

/// Publishes a shard thread's idle-loop counters (read from its reactor).
pub struct ReactorMetrics {
    polls: IntCounter,
    sleeps: IntCounter,
    spin_hits: IntCounter,
    empty_polls: IntCounter,
    budget: IntGauge,
    last: flame_common::reactor::poll::PollStats,
}

impl ReactorMetrics {
    /// Children for `shard` (a shard thread's number, or `net<i>` for a network
    /// thread of the staged mode).
    pub fn new(shard: &str) -> ReactorMetrics {
        let s = shard;
        ReactorMetrics {
            polls: REACTOR.with_label_values(&["polls", s]),
            sleeps: REACTOR.with_label_values(&["sleeps", s]),
            spin_hits: REACTOR.with_label_values(&["spin_hits", s]),
            empty_polls: REACTOR.with_label_values(&["empty_polls", s]),
            budget: SPIN_BUDGET.with_label_values(&[s]),
            last: Default::default(),
        }
    }

    /// Adds what happened since the last call.
    pub fn update(&mut self, now: flame_common::reactor::poll::PollStats) {
        self.polls.inc_by(now.polls.saturating_sub(self.last.polls));
        self.sleeps
            .inc_by(now.sleeps.saturating_sub(self.last.sleeps));
        self.spin_hits
            .inc_by(now.spin_hits.saturating_sub(self.last.spin_hits));
        self.empty_polls
            .inc_by(now.empty_polls.saturating_sub(self.last.empty_polls));
        self.budget.set(i64::from(now.budget));
        self.last = now;
    }
}

static FIXED_IO: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_fixed_io_total",
        "Disk reads and writes of the shard threads submitted as io_uring fixed-buffer operations (from the registered memory pool)",
        &["shard"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});

/// A shard's count of fixed-buffer disk operations, published from the reactor's
/// own counter (`reactor::fixed_ops`).
pub struct FixedIoMetric {
    counter: IntCounter,
    last: u64,
}

impl FixedIoMetric {
    /// The child for `shard`.
    pub fn new(shard: u16) -> FixedIoMetric {
        FixedIoMetric {
            counter: FIXED_IO.with_label_values(&[&shard.to_string()]),
            last: 0,
        }
    }

    /// Adds what happened since the last call (`now`: the reactor's total).
    pub fn update(&mut self, now: u64) {
        self.counter.inc_by(now.saturating_sub(self.last));
        self.last = now;
    }
}

/// The data-path ops that get their own counters.
pub const DATA_OPS: [OpCode; 5] = [
    OpCode::Read,
    OpCode::Write,
    OpCode::WriteZeroes,
    OpCode::Discard,
    OpCode::Flush,
];

/// Per-op counters of one role on one shard.
pub struct OpCounters {
    /// Requests.
    pub ops: IntCounter,
    /// Payload bytes.
    pub bytes: IntCounter,
    /// Latency histogram.
    pub latency: prometheus::Histogram,
}

/// Metric children of one shard, resolved once.
pub struct ShardMetrics {
    /// Indexed by `[role][op index]`, role 0 = primary/client-facing, 1 = replica.
    pub by_op: [[OpCounters; DATA_OPS.len()]; 2],
    /// Errors by op index.
    pub errors: [IntCounter; DATA_OPS.len()],
    /// Client connections.
    pub client_connections: IntGauge,
    /// Peer (replication) connections.
    pub peer_connections: IntGauge,
    /// Converted requests: `[read, write]`.
    pub converted: [IntCounter; 2],
    /// Bytes of converted requests.
    pub converted_bytes: IntCounter,
    /// Fetch-mode replies by [`FetchReply`].
    pub fetch_replies: [IntCounter; 3],
    /// Connections with a reply area.
    pub reply_areas: IntGauge,
}

/// What happened to a reply a client asked to fetch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FetchReply {
    /// Left in its slot.
    Left = 0,
    /// Pushed: larger than a slot.
    TooLarge = 1,
    /// Pushed: the client asked after empty fetches.
    Fallback = 2,
}

impl ShardMetrics {
    /// Resolves every child for `shard`.
    /// The `client` connections gauge of `shard` (the staged mode's network
    /// threads count the connections they own there).
    /// The gauge of a shard's bytes in flight, `kind` client or peer.
    pub fn inflight_bytes_gauge(kind: &str, shard: u16) -> IntGauge {
        INFLIGHT_BYTES.with_label_values(&[kind, &shard.to_string()])
    }

    pub fn connections_gauge(shard: u16) -> IntGauge {
        CONNECTIONS.with_label_values(&["client", &shard.to_string()])
    }

    pub fn new(shard: u16) -> ShardMetrics {
        // The store's counters are per OSD: make them visible (at 0) from the start,
        // so a dashboard or test sees them before the first sync or bad block.
        for result in ["repaired", "unrepaired"] {
            CHECKSUM_ERRORS.with_label_values(&[result]);
        }
        LazyLock::force(&SYNCS);
        for result in ["repaired", "unrepaired"] {
            READ_ERRORS.with_label_values(&[result]);
        }
        let s = shard.to_string();
        let role = |r: &str| {
            DATA_OPS.map(|op| OpCounters {
                ops: OPS.with_label_values(&[op.name(), r, &s]),
                bytes: BYTES.with_label_values(&[op.name(), r, &s]),
                latency: LATENCY.with_label_values(&[op.name(), r]),
            })
        };
        ShardMetrics {
            by_op: [role("primary"), role("replica")],
            errors: DATA_OPS.map(|op| ERRORS.with_label_values(&[op.name(), &s])),
            client_connections: CONNECTIONS.with_label_values(&["client", &s]),
            peer_connections: CONNECTIONS.with_label_values(&["peer", &s]),
            converted: ["read", "write"].map(|op| CONVERTED.with_label_values(&[op, &s])),
            converted_bytes: CONVERTED_BYTES.with_label_values(&[&s]),
            fetch_replies: ["left", "too_large", "fallback"]
                .map(|r| FETCH_REPLIES.with_label_values(&[r, &s])),
            reply_areas: REPLY_AREAS.with_label_values(&[&s]),
        }
    }

    /// Index of `op` in [`DATA_OPS`].
    pub fn op_index(op: OpCode) -> Option<usize> {
        DATA_OPS.iter().position(|o| *o == op)
    }
}

static CHECKSUM_ERRORS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_checksum_errors_total",
        "Blocks that failed checksum verification: repaired from another copy, or unrepaired (the read failed)",
        &["result"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});

/// Counts blocks that failed verification: `repaired` from another copy, or not.
pub fn checksum_errors(repaired: bool, blocks: u64) {
    let result = if repaired { "repaired" } else { "unrepaired" };
    CHECKSUM_ERRORS.with_label_values(&[result]).inc_by(blocks);
}

static READ_ERRORS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_read_errors_total",
        "Primary reads that failed with an I/O error from the disk: repaired (served from another copy and rewritten here) or unrepaired (the read failed)",
        &["result"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});

/// Counts a primary read the disk failed: served from another copy and rewritten
/// here (`repaired`), or failed (`unrepaired`).
pub fn read_errors(repaired: bool) {
    let result = if repaired { "repaired" } else { "unrepaired" };
    READ_ERRORS.with_label_values(&[result]).inc();
}

/// Kinds of operation that make data stable.
#[derive(Clone, Copy, Debug)]
pub enum SyncKind {
    /// `fdatasync` of an object file (FLUSH, FUA zeroing).
    Fdatasync,
    /// `fsync` of a directory (a new file's name).
    Dir,
    /// A write with `RWF_DSYNC` (FUA).
    Fua,
    /// A synced intent-journal write (group commit or reset).
    Journal,
    /// A synced write of placement-group log records (one per FLUSH that had
    /// records to make stable; `store/pg_log_file.rs`).
    PgLog,
}

static SYNCS: LazyLock<[IntCounter; 5]> = LazyLock::new(|| {
    let v = register_int_counter_vec!(
        "flame_osd_syncs_total",
        "Operations that made data stable, by kind (fdatasync|dir|fua|journal|pg_log): shows that FLUSH and FUA reach this OSD's disk",
        &["kind"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"));
    ["fdatasync", "dir", "fua", "journal", "pg_log"].map(|k| v.with_label_values(&[k]))
});

/// Counts one operation that made data stable (issued; a failed one stops the OSD).
pub fn sync_done(kind: SyncKind) {
    SYNCS[kind as usize].inc();
}

static RECOVERY_OBJECTS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_recovery_objects_total",
        "Objects the primary brought up to date on a member: kind log (the group's log said what it missed), backfill (compared object by object), peering (a new primary comparing the other copies)",
        &["kind"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static RECOVERY_BYTES: LazyLock<IntCounter> = LazyLock::new(|| {
    prometheus::register_int_counter!(
        "flame_osd_recovery_bytes_total",
        "Bytes copied to members by recovery and scrub repair"
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static RECOVERY_REMAINING: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register_int_gauge_vec!(
        "flame_osd_recovery_objects_remaining",
        "Objects (log ranges or objects to compare) recovery still has to do, by shard",
        &["shard"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static PGS_UNPEERED: LazyLock<IntGaugeVec> = LazyLock::new(|| {
    register_int_gauge_vec!(
        "flame_osd_pgs_unpeered",
        "Placement groups this shard is the primary of whose members' copies it has not yet compared (peered) since it became primary, by shard: until 0, peering may still overwrite a member's differing copy",
        &["shard"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static RECOVERY_MEMBERS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_recovery_members_total",
        "Members recovered in one placement group, by how: log or backfill",
        &["kind"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static NEWER_COPIES_TAKEN: LazyLock<IntCounter> = LazyLock::new(|| {
    prometheus::register_int_counter!(
        "flame_osd_peering_newer_copies_taken_total",
        "Objects a new primary took from another complete copy whose log showed newer writes of them, before peering"
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static DOUBT_COMPARISONS: LazyLock<IntCounter> = LazyLock::new(|| {
    prometheus::register_int_counter!(
        "flame_osd_recovery_doubt_comparisons_total",
        "Comparisons a primary started of a complete member's restart doubt (one per member incarnation not compared by peering or by the member's recovery)"
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static SCRUB_ERRORS: LazyLock<IntCounter> = LazyLock::new(|| {
    prometheus::register_int_counter!(
        "flame_osd_scrub_errors_total",
        "Objects a scrub found inconsistent across copies (or with a block failing its checksum)"
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static SCRUB_REPAIRED: LazyLock<IntCounter> = LazyLock::new(|| {
    prometheus::register_int_counter!("flame_osd_scrub_repaired_total", "Objects a scrub repaired")
        .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static STRAYS_REMOVED: LazyLock<IntCounter> = LazyLock::new(|| {
    prometheus::register_int_counter!(
        "flame_osd_stray_pgs_removed_total",
        "Copies of placement groups this OSD is no longer a member of, deleted"
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});

static DUP_OPS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_dup_ops_total",
        "Retried client writes recognised by their op id in the placement-group log and not applied again: answered (every member provably holds it), completed (the primary copied its bytes of the range to members that might not) or unreadable (the copy failed on a disk error: the client's next retry is applied again)",
        &["result"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static SUPERSEDED_OPS: LazyLock<IntCounter> = LazyLock::new(|| {
    prometheus::register_int_counter!(
        "flame_osd_superseded_ops_total",
        "Client writes refused because a newer write of the same client session to overlapping bytes was applied first"
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});
static FORWARD_EPOCHS: LazyLock<IntCounterVec> = LazyLock::new(|| {
    register_int_counter_vec!(
        "flame_osd_forwards_other_epoch_total",
        "Writes forwarded by a primary whose map epoch differs from this replica's: sender older|newer, result accepted (same interval) or refused (the group's roles changed since the sender's epoch)",
        &["sender", "result"]
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});

/// Counts a retried write answered from the log (`result`: answered, completed,
/// unreadable).
pub fn dup_op(result: &str) {
    DUP_OPS.with_label_values(&[result]).inc();
}

/// Counts a write refused as superseded.
pub fn superseded_op() {
    SUPERSEDED_OPS.inc();
}

/// Counts a forwarded write from another epoch (`older`: the sender's map is
/// older than this replica's).
pub fn forward_other_epoch(older: bool, accepted: bool) {
    FORWARD_EPOCHS
        .with_label_values(&[
            if older { "older" } else { "newer" },
            if accepted { "accepted" } else { "refused" },
        ])
        .inc();
}

/// Recovery and scrub metrics, registered at start so they read 0 before anything
/// happened (tests and dashboards can tell "nothing yet" from "not exported").
pub fn register_recovery_metrics(shard: u16) {
    for kind in ["log", "backfill", "peering"] {
        RECOVERY_OBJECTS.with_label_values(&[kind]);
    }
    for kind in ["log", "backfill"] {
        RECOVERY_MEMBERS.with_label_values(&[kind]);
    }
    LazyLock::force(&RECOVERY_BYTES);
    LazyLock::force(&NEWER_COPIES_TAKEN);
    LazyLock::force(&DOUBT_COMPARISONS);
    RECOVERY_REMAINING.with_label_values(&[&shard.to_string()]);
    PGS_UNPEERED.with_label_values(&[&shard.to_string()]);
    LazyLock::force(&SCRUB_ERRORS);
    LazyLock::force(&SCRUB_REPAIRED);
    LazyLock::force(&STRAYS_REMOVED);
    for result in ["answered", "completed", "unreadable"] {
        DUP_OPS.with_label_values(&[result]);
    }
    LazyLock::force(&SUPERSEDED_OPS);
    for sender in ["older", "newer"] {
        for result in ["accepted", "refused"] {
            FORWARD_EPOCHS.with_label_values(&[sender, result]);
        }
    }
}

/// An object brought up to date on a member (`kind`: log, backfill, peering).
pub fn recovery_object(kind: &str) {
    RECOVERY_OBJECTS.with_label_values(&[kind]).inc();
}

/// A member recovered in one group (`kind`: log or backfill).
pub fn recovery_member(kind: &str) {
    RECOVERY_MEMBERS.with_label_values(&[kind]).inc();
}

/// Objects peering took from a copy with newer writes of them.
pub fn newer_copies_taken(objects: u64) {
    NEWER_COPIES_TAKEN.inc_by(objects);
}

/// A primary starts comparing a complete member's restart doubt.
pub fn doubt_comparison() {
    DOUBT_COMPARISONS.inc();
}

/// Bytes copied by recovery or repair.
pub fn recovery_bytes(bytes: u64) {
    RECOVERY_BYTES.inc_by(bytes);
}

/// Sets a shard's remaining recovery work.
pub fn recovery_remaining(shard: u16, objects: u64) {
    RECOVERY_REMAINING
        .with_label_values(&[&shard.to_string()])
        .set(objects as i64);
}

/// Sets how many of a shard's primary groups are not peered yet.
pub fn pgs_unpeered(shard: u16, pgs: u64) {
    PGS_UNPEERED
        .with_label_values(&[&shard.to_string()])
        .set(pgs as i64);
}

/// Counts a scrub's inconsistent and repaired objects.
pub fn scrub_result(inconsistent: u64, repaired: u64) {
    SCRUB_ERRORS.inc_by(inconsistent);
    SCRUB_REPAIRED.inc_by(repaired);
}

/// Counts a stray placement-group copy deleted.
pub fn stray_removed() {
    STRAYS_REMOVED.inc();
}
