//! The manager's HTTP/JSON API: paths and bodies.
//!
//! Shared by `flame-mgr` (server), `flame-osd` (boot and heartbeats) and
//! `flame-client`/`flame-admin` (maps and volume operations), so the three can only
//! disagree at compile time. Errors come back as a non-2xx status with an
//! [`ApiError`] body.
//!
//! With `auth: required` every request but `/metrics` carries a signature
//! ([`crate::auth`]) and every answer the manager's; routes need a role: reads
//! any entity, the `/v1/osd/*` and `/v1/pg/recovered` posts the `osd` role, all
//! other changes and `/v1/auth/*` the `admin` role. Refusals are 401 (who are
//! you), 403 (not allowed) or 429 (replay window full).
//!
//! | method | path | body → reply |
//! |---|---|---|
//! | GET | `/v1/map` | → [`crate::map::ClusterMap`] |
//! | GET | `/v1/status` | → [`ClusterStatus`] |
//! | GET | `/v1/osds` | → `Vec<`[`OsdStatus`]`>` |
//! | POST | `/v1/osd/boot` | [`OsdBoot`] → [`OsdBootReply`]; 409 if the OSD belongs to another cluster or its address is held by another up OSD |
//! | POST | `/v1/osd/heartbeat` | [`OsdHeartbeat`] → [`HeartbeatReply`] |
//! | POST | `/v1/osd/failure` | [`OsdFailureReport`] → [`OsdFailureReply`] |
//! | POST | `/v1/pg/recovered` | [`PgRecoveredReport`] → [`PgRecoveredReply`] |
//! | POST | `/v1/osds/{id}/out` | → [`OsdOpReply`] (`{id}`: `3` or `osd.3`) |
//! | POST | `/v1/osds/{id}/in` | → [`OsdOpReply`] |
//! | POST | `/v1/osds/{id}/reweight` | [`OsdReweight`] → [`OsdOpReply`] |
//! | DELETE | `/v1/osds/{id}` | → [`OsdOpReply`]; 409 while the OSD is up |
//! | GET | `/v1/volumes` | → `Vec<`[`crate::map::VolumeInfo`]`>` |
//! | POST | `/v1/volumes` | [`VolumeCreate`] → `VolumeInfo` |
//! | GET | `/v1/volumes/{name}` | → `VolumeInfo` |
//! | POST | `/v1/volumes/{name}/resize` | [`VolumeResize`] → `VolumeInfo` |
//! | GET | `/v1/volumes/{name}/trim` | → [`VolumeTrim`] (the shrink whose trim is pending, if any) |
//! | POST | `/v1/volumes/{name}/trim` | [`TrimDone`] → [`VolumeTrim`] |
//! | DELETE | `/v1/volumes/{name}` | → `VolumeInfo` (the removed volume) |
//! | GET | `/v1/pgs` | → `Vec<`[`PgStatus`]`>` (every placement group, by number) |
//! | GET | `/v1/pgs/{id}` | → [`PgStatus`]; 404 past the pool's last group |
//! | GET | `/v1/auth/entities` | → `Vec<`[`AuthEntityInfo`]`>` |
//! | POST | `/v1/auth/entities` | [`AuthEntityAdd`] → [`AuthEntityInfo`]; 409 if it exists |
//! | POST | `/v1/auth/entities/{name}/rotate` | → [`AuthEntityInfo`] (the next key generation) |
//! | DELETE | `/v1/auth/entities/{name}` | → [`AuthEntityInfo`] (the removed entity) |
//! | POST | `/v1/auth/entities/{name}/volumes` | [`AuthEntityVolumes`] → [`AuthEntityInfo`] |
//! | POST | `/v1/auth/ticket` | → [`TicketGrant`] for the signer (any entity); 409 with `auth: none` |
//! | POST | `/v1/auth/service-key` | → [`ServiceKeyGrant`] for the signer (role osd only); 409 with `auth: none` |
//! | GET | `/metrics` | → Prometheus text |

use crate::ids::{Epoch, OsdId, PgId};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;

/// Error body of every failed call.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ApiError {
    /// Human-readable reason.
    pub error: String,
}

/// An OSD announcing itself at start-up.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OsdBoot {
    /// Identity of the OSD's data directory, created at its first start. The manager
    /// maps it to a stable [`OsdId`], so a restarted OSD gets its old id back.
    pub uuid: String,
    /// Id the OSD had before, if its data directory recorded one.
    pub id: Option<OsdId>,
    /// Data address of shard 0.
    pub addr: SocketAddr,
    /// Shard threads.
    pub shards: u16,
    /// Failure domain.
    pub host: String,
    /// Placement weight.
    pub weight: f64,
    /// Metrics endpoint.
    pub metrics_addr: Option<SocketAddr>,
    /// The cluster id recorded in the OSD's data directory (`None` for a directory
    /// that never joined a cluster). The manager refuses a boot whose fsid is not its
    /// own *before* recording anything, so an OSD of another cluster never becomes a
    /// ghost entry in this map. Absent in requests from older OSDs (treated as
    /// `None`).
    #[serde(default)]
    pub fsid: Option<String>,
    /// A random value the OSD process picks at start. A boot of an OSD the manager
    /// has as up with another incarnation is a new process that restarted within the
    /// heartbeat grace: it lost whatever its previous process had not made durable
    /// and missed the writes in between, so the manager treats it as down-and-up
    /// (it is recovered before it serves). The same incarnation again is a retried
    /// boot and changes nothing. Absent in requests from older OSDs (0).
    #[serde(default)]
    pub incarnation: u64,
}

/// The manager's answer to [`OsdBoot`].
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OsdBootReply {
    /// The OSD's id.
    pub id: OsdId,
    /// The cluster id.
    pub fsid: String,
    /// Map epoch after the boot was recorded.
    pub epoch: Epoch,
    /// The manager's failure-detection timings, which the OSD's lease must fit
    /// ([`crate::timing::check_osd_against_mgr`]): an OSD whose `lease_ms` +
    /// `heartbeat_interval_ms` is not below the grace (or above the report
    /// silence) refuses to run, naming both options. Absent from managers older
    /// than this field (`None`: the OSD warns that it cannot check); older OSDs
    /// ignore it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timings: Option<crate::timing::MgrTimings>,
}

/// Periodic liveness report from an OSD.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OsdHeartbeat {
    /// Reporting OSD.
    pub id: OsdId,
    /// The OSD's data-directory uuid, so a stale process cannot heartbeat for a
    /// replaced OSD.
    pub uuid: String,
    /// Map epoch the OSD has.
    pub epoch: Epoch,
    /// Bytes used on its data directory's file system (`statvfs`: blocks minus
    /// free blocks), whoever uses them: what decides whether it is (near)full.
    pub used_bytes: u64,
    /// Bytes of that file system usable by the OSD (`statvfs`: used plus
    /// available), so `used_bytes / capacity_bytes` is df's Use%.
    pub capacity_bytes: u64,
    /// Bytes its object files occupy (recounted every few seconds; absent from
    /// OSDs older than this field).
    #[serde(default)]
    pub object_bytes: u64,
    /// Recovery and scrub figures of this OSD (as primary of its groups); `None`
    /// from an OSD that does not report them (older OSDs: the field is absent).
    #[serde(default)]
    pub recovery: Option<RecoveryProgress>,
}

/// What an OSD reports about recovery and scrub in every heartbeat, so the manager
/// can show progress, a rate and an ETA (`flame-admin status`, metrics) without
/// asking the OSDs. The `_total` figures are counters since the OSD process
/// started: the manager takes differences between heartbeats and treats a
/// decrease as a restart.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct RecoveryProgress {
    /// Objects this OSD still has to bring up to date on recovering members of
    /// the groups it is primary of, over every such group (not only the one being
    /// worked on): a log catch-up counts the objects of the log entries the
    /// member missed, a backfill the objects of the group (then the number being
    /// compared). Groups it cannot estimate yet are counted in `pgs_unestimated`
    /// instead, so 0 here with `pgs_recovering > 0` is not "nothing left".
    pub objects_to_recover: u64,
    /// Groups this OSD is the primary of that have recovering members in its map.
    pub pgs_recovering: u32,
    /// Of those, groups whose remaining work it cannot tell yet (a backfill whose
    /// objects are not counted yet): their objects are missing from
    /// `objects_to_recover`.
    pub pgs_unestimated: u32,
    /// Objects copied to recovering members since the OSD started.
    pub objects_recovered_total: u64,
    /// Bytes copied to recovering members since the OSD started.
    pub bytes_recovered_total: u64,
    /// Mismatches or unreadable blocks scrub found since the OSD started.
    pub scrub_errors_total: u64,
    /// Of those, how many were repaired from the agreeing copies.
    pub scrub_repaired_total: u64,
    /// When this OSD last finished a scrub pass, seconds since the Unix epoch (0:
    /// never since it started).
    pub last_scrub_unix: u64,
    /// `(group, objects)` for the groups this OSD is the primary of and has
    /// counted: the manager multiplies each by the copies the group lacks
    /// (degraded objects) or keeps where placement no longer wants them
    /// (misplaced). At most one entry per group of the pool; the manager ignores
    /// the list when it is longer, and entries past the pool's last group.
    pub pg_objects: Vec<(PgId, u64)>,
}

/// Answer to a heartbeat: the current epoch, so the OSD knows when to fetch the map.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct HeartbeatReply {
    /// Current map epoch.
    pub epoch: Epoch,
    /// The `osd` key generation, whose service key checks tickets (`None`
    /// with `auth: none`, and from older managers): an OSD with its own key
    /// that holds another fetches the new one, so a rotation of `osd` needs no
    /// OSD restart.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_generation: Option<u64>,
}

/// A primary telling the manager that members of its placement groups now hold
/// complete copies (`POST /v1/pg/recovered`): it copied to each of them everything
/// they missed, while holding each object's write gate, and every write since went
/// to them too. The manager records them as complete (see
/// `ClusterMap::pg_complete`) in one new epoch for the whole batch.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PgRecoveredReport {
    /// The reporting OSD: the groups' primary in `epoch`.
    pub reporter: OsdId,
    /// The uuid of the reporter's data directory (a stale process cannot report).
    pub uuid: String,
    /// The map epoch the recovery ran under. The manager ignores an entry when the
    /// reporter is no longer the group's primary, or when the member came up again
    /// after `epoch` (`OsdInfo::up_from`): what was copied to its previous
    /// incarnation proves nothing about the new one.
    pub epoch: Epoch,
    /// (placement group, recovered member) pairs. At most
    /// [`PG_RECOVERED_ENTRIES_MAX`].
    pub recovered: Vec<(PgId, OsdId)>,
}

/// Most entries in one [`PgRecoveredReport`]: at most `[4294967295,4294967295],`
/// (24 bytes) each, a report stays under the manager's 64 KiB body limit for
/// every route, so that no caller — one without a key included, whose
/// signature can only be checked once its body is read — makes the manager
/// buffer more (an OSD sends more entries as several reports).
pub const PG_RECOVERED_ENTRIES_MAX: usize = 2_048;

/// The manager's answer to a [`PgRecoveredReport`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PgRecoveredReply {
    /// Map epoch after the report was recorded (unchanged if nothing was new).
    pub epoch: Epoch,
    /// Entries that changed the map; the others were stale (the reporter is no
    /// longer the primary, the member restarted since, ...) or already recorded.
    pub recorded: u32,
}

/// An OSD reporting that it cannot reach a peer (`POST /v1/osd/failure`): the
/// manager marks the peer down sooner than its heartbeat grace would when enough
/// distinct OSDs report it (so one OSD with a broken link cannot take out others).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OsdFailureReport {
    /// The reporting OSD.
    pub reporter: OsdId,
    /// The uuid of the reporter's data directory.
    pub uuid: String,
    /// The peer it cannot reach.
    pub failed: OsdId,
    /// The reporter's map epoch.
    pub epoch: Epoch,
}

/// The manager's answer to an [`OsdFailureReport`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OsdFailureReply {
    /// Map epoch after the report was recorded.
    pub epoch: Epoch,
    /// Whether the failed OSD is down in that map (by this report, earlier ones or
    /// its heartbeat grace).
    pub down: bool,
}

/// New placement weight of an OSD (`POST /v1/osds/{id}/reweight`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OsdReweight {
    /// Relative share of data, `0..=`[`OSD_WEIGHT_MAX`]; 0 moves every placement
    /// group off the OSD (as `out`, but it stays `in`).
    pub weight: f64,
}

/// Largest OSD weight `osd reweight` accepts.
pub const OSD_WEIGHT_MAX: f64 = 100.0;

/// The manager's answer to an operator command on an OSD (out, in, reweight, rm).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OsdOpReply {
    /// The OSD.
    pub osd: OsdId,
    /// Map epoch after the command.
    pub epoch: Epoch,
    /// Whether the command changed the map (false: it was already so).
    pub changed: bool,
    /// Placement groups left with no complete copy by `osd rm` (it held the last
    /// one): their data is lost, and they start again empty on their placed OSDs.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lost_pgs: Vec<PgId>,
}

/// One OSD in `flame-admin osd ls`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct OsdStatus {
    /// Map entry.
    #[serde(flatten)]
    pub info: crate::map::OsdInfo,
    /// Last reported bytes used on the OSD's file system (see
    /// [`OsdHeartbeat::used_bytes`]).
    pub used_bytes: u64,
    /// Last reported usable bytes of that file system.
    pub capacity_bytes: u64,
    /// Milliseconds since the last heartbeat (None: never heard from since the
    /// manager started).
    pub last_heartbeat_ms_ago: Option<u64>,
    /// Placement groups this OSD is a member of: placed there, or holding a
    /// complete copy (see `PgMembers::is_member`; a down OSD still counts for the
    /// groups that wait for it or will recover it).
    pub pgs: u32,
    /// No heartbeat since the manager started: `used_bytes`/`capacity_bytes` are
    /// placeholders (0) and `up` is only what the map last recorded. Right after an
    /// OSD boots and after every manager restart, until its first heartbeat.
    /// (Absent from older managers: then false.)
    #[serde(default)]
    pub awaiting_first_report: bool,
}

/// `flame-admin status`.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// Cluster id.
    pub fsid: String,
    /// `HEALTH_OK`, `HEALTH_WARN` or `HEALTH_ERR`.
    pub health: String,
    /// Reasons for a health other than OK.
    pub health_detail: Vec<String>,
    /// Current map epoch.
    pub epoch: Epoch,
    /// OSDs known.
    pub osds: u32,
    /// OSDs up.
    pub osds_up: u32,
    /// OSDs in.
    pub osds_in: u32,
    /// Volumes.
    pub volumes: u32,
    /// Sum of volume sizes.
    pub provisioned_bytes: u64,
    /// Sum of OSD-reported object bytes (all copies).
    pub used_bytes: u64,
    /// Sum of OSD file-system sizes.
    pub capacity_bytes: u64,
    /// Pool settings.
    pub pool: crate::map::PoolConfig,
    /// OSDs of the map not heard from since the manager started (see
    /// [`OsdStatus::awaiting_first_report`]): `used_bytes` and `capacity_bytes`
    /// leave them out, and their `up` is only the last recorded state.
    #[serde(default)]
    pub osds_awaiting_first_report: u32,
    /// Placement groups by state string (`active+clean`: 120, ...), computed from
    /// the map: see [`crate::pg_state`]. (Absent from older managers: empty.)
    #[serde(default)]
    pub pgs_by_state: std::collections::BTreeMap<String, u32>,
    /// Placement groups per flag (a group counts under each flag it has).
    #[serde(default)]
    pub pg_summary: PgSummary,
    /// Recovery progress, rate and ETA, and scrub figures, from the OSDs'
    /// heartbeats.
    #[serde(default)]
    pub recovery: RecoverySummary,
}

/// Placement-group counts per state flag (see [`crate::pg_state::PgState`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct PgSummary {
    /// Placement groups in the pool.
    pub total: u32,
    /// Serving I/O (at least `min_size` complete copies up).
    pub active: u32,
    /// `size` complete copies where placement puts them.
    pub clean: u32,
    /// Fewer than `size` complete copies up.
    pub degraded: u32,
    /// With members being recovered.
    pub recovering: u32,
    /// With complete copies on OSDs placement no longer chooses (misplaced).
    pub remapped: u32,
    /// Not serving: I/O to them waits.
    pub inactive: u32,
    /// No complete copy up.
    pub incomplete: u32,
}

/// Cluster-wide recovery and scrub figures in [`ClusterStatus`], summed over the
/// up OSDs' latest [`RecoveryProgress`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RecoverySummary {
    /// OSDs whose last heartbeat carried recovery figures.
    pub osds_reporting: u32,
    /// Whether a recovery is under way: some group of the map is recovering, or
    /// some up OSD reports recovery work (objects left or recovering groups).
    /// While it is, the figures never read "done" or "idle".
    pub recovering: bool,
    /// Objects the primaries still have to bring up to date (every recovering
    /// group they can estimate, log catch-up and backfill alike).
    pub objects_to_recover: u64,
    /// Recovering groups whose remaining work is not in `objects_to_recover`: their
    /// primary cannot estimate it yet, or has not reported the group (its map is
    /// older than the manager's). While nonzero, the amount left is unknown.
    pub pgs_unestimated: u32,
    /// Objects brought up to date since the current recovery began (when the
    /// cluster went from no recovery work to some; 0 before the first one after the
    /// manager started): the progress bar shows this against
    /// `objects_to_recover`. The OSDs' lifetime counters are the
    /// `flame_osd_recovery_objects_total` metric.
    pub objects_recovered: u64,
    /// Bytes copied since the current recovery began.
    pub bytes_recovered: u64,
    /// Objects copied per second over the last [`RECOVERY_RATE_WINDOW_S`] (of the
    /// current recovery only, while one is under way).
    pub objects_per_second: f64,
    /// Bytes copied per second over the last [`RECOVERY_RATE_WINDOW_S`] (of the
    /// current recovery only, while one is under way).
    pub bytes_per_second: f64,
    /// `objects_to_recover / objects_per_second`, rounded up, whenever objects are
    /// left and the rate is known; `None` otherwise (see `eta_estimating`).
    pub eta_seconds: Option<u64>,
    /// A recovery is under way but has no ETA yet because it began less than
    /// [`RECOVERY_RATE_WINDOW_S`] ago and no rate is known yet, or the amount left
    /// is unknown. `false` with no ETA while recovering: nothing moved during the
    /// last window (stalled).
    pub eta_estimating: bool,
    /// Scrub errors found (sum of the OSDs' counters since they started).
    pub scrub_errors: u64,
    /// Scrub errors repaired.
    pub scrub_repaired: u64,
    /// The oldest "last scrub finished" among the reporting OSDs that have
    /// scrubbed, seconds since the Unix epoch.
    pub oldest_scrub_unix: Option<u64>,
    /// Objects in the pool, summed over the groups whose primary reported a count
    /// (each object once, whatever its number of copies).
    pub objects: u64,
    /// Copies the pool should hold: `objects × pool.size`; the denominator of the
    /// degraded and misplaced figures, as in Ceph's `x/y objects degraded`.
    pub object_copies: u64,
    /// Copies missing: per group, its objects × (`size` − complete copies up).
    /// Nonzero while an OSD is down or out and recovery has not made the copies
    /// again.
    pub degraded_copies: u64,
    /// Copies on an OSD placement no longer chooses: per group, its objects × the
    /// complete copies up outside the placed set. They serve until the new members
    /// are complete, then are removed.
    pub misplaced_copies: u64,
    /// Copies being made: per group, its objects × its recovering members.
    pub recovering_copies: u64,
    /// Groups no primary has reported a count for yet (their objects are missing
    /// from the figures above; 0 once every primary reported).
    pub pgs_uncounted: u32,
}

/// Where the cluster's recovery stands, as [`RecoverySummary::phase`] reads its
/// figures: the one place that decides whether "done" may be said.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RecoveryPhase {
    /// No recovery under way. `last_recovered`: objects the last recovery since
    /// the manager started brought up to date (0: none).
    Idle { last_recovered: u64 },
    /// A recovery is under way but how much is left is not known yet (no
    /// estimate for some recovering group, and none for any other).
    Estimating,
    /// A recovery is under way with objects known to be left. `fraction`:
    /// recovered / (recovered + left), always below 1; `partial`: some recovering
    /// groups are not estimated yet, so more may be left.
    Recovering { fraction: f64, partial: bool },
    /// A recovery is under way, nothing is left to copy, and the map still shows
    /// groups recovering: their primaries are flushing or reporting them complete.
    Finishing,
}

/// The largest fraction shown while a recovery is under way: rounding must not
/// print 100.0 %.
const FRACTION_WHILE_RECOVERING_MAX: f64 = 0.999;

impl RecoverySummary {
    /// Where the recovery stands; never [`RecoveryPhase::Idle`] while
    /// `recovering`, nor a full fraction.
    pub fn phase(&self) -> RecoveryPhase {
        if !self.recovering && self.objects_to_recover == 0 && self.pgs_unestimated == 0 {
            return RecoveryPhase::Idle {
                last_recovered: self.objects_recovered,
            };
        }
        if self.objects_to_recover > 0 {
            let all = self
                .objects_recovered
                .saturating_add(self.objects_to_recover);
            let f = self.objects_recovered as f64 / all as f64;
            return RecoveryPhase::Recovering {
                fraction: f.min(FRACTION_WHILE_RECOVERING_MAX),
                partial: self.pgs_unestimated > 0,
            };
        }
        if self.pgs_unestimated > 0 {
            RecoveryPhase::Estimating
        } else {
            RecoveryPhase::Finishing
        }
    }

    /// Fraction of the current recovery done, in `[0, 1)`; `None` when no
    /// recovery with a known amount left is under way (idle, estimating or
    /// finishing: see [`Self::phase`]).
    pub fn progress(&self) -> Option<f64> {
        match self.phase() {
            RecoveryPhase::Recovering { fraction, .. } => Some(fraction),
            _ => None,
        }
    }
}

/// The window over which the manager computes recovery rates.
pub const RECOVERY_RATE_WINDOW_S: u64 = 30;

/// One placement group in `GET /v1/pgs`: its state and roles in the current map
/// (see [`crate::placement::PgMembers`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PgStatus {
    /// The group.
    pub pg: crate::ids::PgId,
    /// State string, e.g. `active+recovering+degraded` ([`crate::pg_state`]).
    pub state: String,
    /// Map epoch the roles were computed from.
    pub epoch: Epoch,
    /// Placement's choice, in placement order.
    pub placed: Vec<OsdId>,
    /// Complete copies that are up, primary first.
    pub acting: Vec<OsdId>,
    /// The primary (`acting[0]`), if any complete copy is up.
    pub primary: Option<OsdId>,
    /// Placed members that are up but not complete: being recovered.
    pub recovering: Vec<OsdId>,
    /// Complete copies on OSDs that are down (an inactive group waits for them).
    pub down_complete: Vec<OsdId>,
}

/// Creates a volume.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VolumeCreate {
    /// Name (also the NBD export name).
    pub name: String,
    /// Size in bytes.
    pub size: u64,
}

/// Changes a volume's size.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VolumeResize {
    /// New size in bytes.
    pub size: u64,
    /// Must be true to make the volume smaller (data past the new end is lost).
    #[serde(default)]
    pub allow_shrink: bool,
}

/// Bytes `[from, to)` of a volume that a shrink cut off and that may still hold old
/// data on some copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TrimRange {
    /// The volume's size after the shrink (the first byte to remove).
    pub from: u64,
    /// The largest size the volume had before (the end of the old bytes).
    pub to: u64,
}

/// A volume's pending trim (`GET`/`POST /v1/volumes/{name}/trim`).
///
/// A shrink takes effect for I/O at once (the map carries the new size), but the
/// old bytes past the new end are still on the OSDs until a client removes them on
/// every copy. Until then the manager keeps the range here (persisted), refuses to
/// grow the volume — a grow would expose the old bytes where zeroes are promised —
/// and reports it in health. `flame-admin volume resize` completes the trim before
/// it returns and before it grows a volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeTrim {
    /// The volume (ids are never reused, so a trim can never apply to another).
    pub volume: crate::ids::VolumeId,
    /// What remains to be removed; `None` when nothing is pending.
    pub pending: Option<TrimRange>,
}

/// A client reporting that it removed `range` of `volume` on every copy and made
/// that stable (flushed).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrimDone {
    /// The volume trimmed.
    pub volume: crate::ids::VolumeId,
    /// The range removed. Clears the pending trim only if it covers all of it (a
    /// shrink that came in meanwhile widened the pending range).
    pub range: TrimRange,
}

/// Formats bytes with a binary unit, for tables.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(format_size(4 << 30), "4.0 GiB");
    }

    fn summary(recovering: bool, left: u64, unestimated: u32, done: u64) -> RecoverySummary {
        RecoverySummary {
            recovering,
            objects_to_recover: left,
            pgs_unestimated: unestimated,
            objects_recovered: done,
            ..Default::default()
        }
    }

    #[test]
    fn idle_only_when_nothing_recovers_and_nothing_is_left() {
        assert_eq!(
            summary(false, 0, 0, 7).phase(),
            RecoveryPhase::Idle { last_recovered: 7 }
        );
        assert_eq!(summary(false, 0, 0, 7).progress(), None);
        // Groups recovering with nothing left to copy: finishing, not done.
        assert_eq!(summary(true, 0, 0, 7).phase(), RecoveryPhase::Finishing);
        assert_eq!(summary(true, 0, 0, 7).progress(), None);
        // Work reported while the map (not yet) shows groups recovering.
        assert!(matches!(
            summary(false, 3, 0, 0).phase(),
            RecoveryPhase::Recovering { .. }
        ));
        assert_eq!(summary(false, 0, 2, 0).phase(), RecoveryPhase::Estimating);
    }

    #[test]
    fn unknown_amount_is_estimating_or_partial() {
        assert_eq!(summary(true, 0, 4, 10).phase(), RecoveryPhase::Estimating);
        assert_eq!(
            summary(true, 30, 4, 10).phase(),
            RecoveryPhase::Recovering {
                fraction: 0.25,
                partial: true
            }
        );
        assert_eq!(
            summary(true, 30, 0, 10).phase(),
            RecoveryPhase::Recovering {
                fraction: 0.25,
                partial: false
            }
        );
    }

    #[test]
    fn the_fraction_never_reaches_one_while_objects_are_left() {
        let f = summary(true, 1, 0, 1_000_000).progress().unwrap();
        assert!(f < 1.0 && format!("{:.1}", f * 100.0) != "100.0", "{f}");
        assert_eq!(summary(true, 5, 0, 0).progress(), Some(0.0));
    }

    /// The boot answer's `timings` keeps older peers working both ways: an older
    /// manager's answer (no field) decodes as `None`, and an older OSD, whose
    /// answer type has no such field, decodes a newer manager's answer.
    #[test]
    fn boot_reply_timings_are_optional_both_ways() {
        let old = r#"{"id":3,"fsid":"f","epoch":7}"#;
        let r: OsdBootReply = serde_json::from_str(old).unwrap();
        assert_eq!(r.timings, None);
        assert_eq!(serde_json::to_string(&r).unwrap(), old, "no null field");
        let new = OsdBootReply {
            timings: Some(crate::timing::MgrTimings {
                heartbeat_grace_ms: 6000,
                failure_report_min_silence_ms: 5000,
            }),
            ..r
        };
        let text = serde_json::to_string(&new).unwrap();
        #[derive(Deserialize)]
        struct OlderOsdBootReply {
            id: OsdId,
            epoch: Epoch,
        }
        let older: OlderOsdBootReply = serde_json::from_str(&text).unwrap();
        assert_eq!((older.id, older.epoch), (OsdId(3), Epoch(7)));
        let back: OsdBootReply = serde_json::from_str(&text).unwrap();
        assert_eq!(back.timings, new.timings);
    }
}

/// One entity of `GET /v1/auth/entities` (and the answer of adding, rotating or
/// removing one). Never a key: keys are derived where the cluster keyring is
/// (`flame-admin auth key`), so none travels over the network.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthEntityInfo {
    /// Its name.
    pub entity: crate::auth::EntityName,
    /// What it may do.
    pub role: crate::auth::Role,
    /// Its current key generation.
    pub generation: u64,
    /// The volumes it may read and write (empty: every volume).
    #[serde(default)]
    pub volumes: crate::auth::VolumePatterns,
}

/// `POST /v1/auth/entities`: a new `client.NAME` with role `client` or `admin`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthEntityAdd {
    /// Its name.
    pub entity: crate::auth::EntityName,
    /// What it may do.
    pub role: crate::auth::Role,
    /// The volumes it may read and write (absent or empty: every volume).
    #[serde(default)]
    pub volumes: crate::auth::VolumePatterns,
}

/// `POST /v1/auth/entities/{name}/volumes`: the volumes an entity may use from
/// its next ticket on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthEntityVolumes {
    /// Volume names or `prefix*` patterns; empty: every volume.
    pub volumes: crate::auth::VolumePatterns,
}

/// `POST /v1/auth/ticket`: a ticket for the signing entity, to open OSD
/// connections with (`flame_common::auth::ServiceKey`). The ticket travels in
/// clear; its session key only sealed under the signer's own key.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TicketGrant {
    /// The encoded ticket, hex.
    pub ticket: String,
    /// The session key sealed for the signer (`auth::seal_session_key`), hex.
    pub sealed_session_key: String,
}

/// `POST /v1/auth/service-key`: the OSDs' service key (what makes and checks
/// tickets) for an OSD that holds only its own `osd.N` key, sealed under that
/// key (`auth::ServiceKey::seal_for`). Only role osd may ask.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceKeyGrant {
    /// The `osd` key generation the service key belongs to (tickets carry it).
    pub generation: u64,
    /// The sealed key, hex.
    pub sealed_key: String,
}
