//! Cluster state and every operation on it.
//!
//! This module is pure logic: no I/O, no clocks, no locks. Each operation takes the
//! current time as an argument, mutates a [`ClusterState`] and reports errors as
//! [`StateError`]; the HTTP layer decides when to persist and publish. That keeps
//! every rule (ids, epochs, validation, health) unit-testable without a server.
//!
//! Invariant the persistence layer relies on: **an operation changes
//! [`PersistedState`] if and only if it bumps the map epoch** (by exactly one) —
//! entity changes ([`crate::auth`]) included, though the map itself does not
//! show them. So
//! "epoch changed" is the signal to write `state.json`, and runtime-only updates
//! (heartbeat timestamps and usage figures) never cost a disk write.

use flame_common::auth::EntityName;
use flame_common::ids::{Epoch, OsdId, PgId, VolumeId};
use flame_common::map::{
    ClusterMap, DELETED_VOLUMES_MAX, OsdInfo, PoolConfig, VOLUME_SIZE_MAX, VolumeInfo,
    validate_volume_name,
};
use flame_common::mgr_api::{
    ClusterStatus, OSD_WEIGHT_MAX, OsdBoot, OsdFailureReport, OsdHeartbeat, OsdStatus,
    PG_RECOVERED_ENTRIES_MAX, PgRecoveredReport, TrimDone, TrimRange, VolumeCreate, VolumeResize,
    VolumeTrim,
};
use flame_common::placement::{PgMembers, PgTable, pg_osds};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tracing::{debug, info, warn};

/// Version of the `state.json` layout; bumped on any incompatible change so an old
/// manager refuses a newer file instead of misreading it.
pub const STATE_FORMAT: u32 = 1;
/// Most OSDs a cluster may register: bounds the map, every placement computation
/// and the state file.
pub const OSD_COUNT_MAX: usize = 4096;
/// Largest OSD id the manager honors when an OSD asks for its old id; keeps
/// `next_osd_id` far from overflow whatever a client sends.
pub const OSD_ID_MAX: u32 = 1 << 20;
/// Most volumes a cluster may hold: bounds the map sent to every client and the
/// state file rewritten on every change.
pub const VOLUME_COUNT_MAX: usize = 65_536;
/// Most shard threads an OSD may announce (placement uses `pg % shards`, and an OSD
/// listens on `shards` consecutive ports).
pub const OSD_SHARDS_MAX: u16 = 256;
/// Longest host name (failure-domain label) accepted.
pub const HOST_BYTES_MAX: usize = 64;
/// Longest OSD uuid accepted.
pub const UUID_BYTES_MAX: usize = 64;
/// Most per-OSD lines in `health_detail` of one kind; the rest are summarized, so a
/// rack going down does not produce a thousand-line status.
const DETAIL_OSDS_MAX: usize = 10;

/// Why an operation was refused. Each variant maps to one HTTP status.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StateError {
    /// The request is malformed or out of range (400).
    #[error("{0}")]
    Invalid(String),
    /// The named OSD or volume does not exist (404).
    #[error("{0}")]
    NotFound(String),
    /// The request conflicts with existing state, e.g. a duplicate name (409).
    #[error("{0}")]
    Conflict(String),
}

/// Everything the manager must not lose: written to `state.json` as a whole.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PersistedState {
    /// Layout version, [`STATE_FORMAT`].
    pub format: u32,
    /// The cluster map as served to clients.
    pub map: ClusterMap,
    /// OSD data-directory uuid → id. Entries are never removed, so an id once
    /// handed out stays bound to its uuid and is never given to another OSD.
    pub osd_uuids: BTreeMap<String, OsdId>,
    /// Id the next new OSD gets (unless it asks for an unused one).
    pub next_osd_id: u32,
    /// Id the next volume gets. Only ever grows, so a deleted volume's id (which
    /// names its objects on the OSDs) is never reused.
    pub next_volume_id: u64,
    /// Shrunk volumes whose old bytes past the new end may still be on some copy
    /// (see [`flame_common::mgr_api::VolumeTrim`]). While a volume is here it cannot
    /// grow. Absent in state files of older managers (= nothing pending).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pending_trims: BTreeMap<VolumeId, TrimRange>,
    /// The incarnation ([`OsdBoot::incarnation`]) of each OSD's current process, as
    /// its last boot announced it. Kept so that a manager restart does not make a
    /// retried boot look like a new process. Changes only together with the epoch
    /// (a new incarnation always changes `up_from`). Absent in older files.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub osd_incarnations: BTreeMap<OsdId, u64>,
    /// Every entity and its role and key generation ([`crate::auth`]). Absent in
    /// older files: the built-ins `client.admin` and `osd` at generation 1.
    #[serde(default)]
    pub auth: crate::auth::AuthTable,
    /// The last key generation of every removed entity: one added again under
    /// the same name starts above it, so a removed (perhaps stolen) key never
    /// works again. At most [`AUTH_REMOVED_MAX`]. Absent in older files.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub auth_removed: BTreeMap<EntityName, flame_common::auth::KeyGeneration>,
}

/// Most removed entities the manager remembers ([`PersistedState::auth_removed`]);
/// past it, removing another is refused (rotate its key instead).
pub const AUTH_REMOVED_MAX: usize = 65_536;

impl PersistedState {
    /// State of a brand-new cluster: no OSDs, no volumes, epoch 1.
    pub fn new_cluster(fsid: String, pool: PoolConfig) -> Self {
        PersistedState {
            format: STATE_FORMAT,
            map: ClusterMap::new(fsid, pool),
            osd_uuids: BTreeMap::new(),
            next_osd_id: 0,
            next_volume_id: 1,
            pending_trims: BTreeMap::new(),
            osd_incarnations: BTreeMap::new(),
            auth: crate::auth::AuthTable::default(),
            auth_removed: BTreeMap::new(),
        }
    }

    /// Checks a loaded state for internal consistency. A file that fails this was
    /// edited by hand or written by a buggy manager; starting on it could hand out a
    /// duplicate id, so the manager refuses to start instead.
    pub fn check(&self) -> Result<(), String> {
        if self.format != STATE_FORMAT {
            return Err(format!(
                "state format {} is not supported (this manager reads format {STATE_FORMAT})",
                self.format
            ));
        }
        crate::config::validate_fsid(&self.map.fsid).map_err(|m| format!("fsid: {m}"))?;
        self.map
            .pool
            .validate()
            .map_err(|(k, m)| format!("{k}: {m}"))?;
        let mut ids = BTreeSet::new();
        for (uuid, id) in &self.osd_uuids {
            if !ids.insert(*id) {
                return Err(format!("{id} is bound to more than one uuid ({uuid})"));
            }
            if id.0 >= self.next_osd_id {
                return Err(format!(
                    "{id} is not below next_osd_id {}",
                    self.next_osd_id
                ));
            }
        }
        for (id, osd) in &self.map.osds {
            if osd.id != *id {
                return Err(format!("map entry {id} holds {}", osd.id));
            }
            if !ids.contains(id) {
                return Err(format!("{id} has no uuid binding"));
            }
        }
        let mut vids = BTreeSet::new();
        for (name, vol) in &self.map.volumes {
            if vol.name != *name {
                return Err(format!("volume entry {name} holds {}", vol.name));
            }
            if !vids.insert(vol.id) || vol.id.0 >= self.next_volume_id {
                return Err(format!(
                    "volume {name} has a duplicate or unissued id {}",
                    vol.id
                ));
            }
        }
        if self.map.deleted_volumes.len() > DELETED_VOLUMES_MAX {
            return Err(format!(
                "{} volume tombstones, more than {DELETED_VOLUMES_MAX}",
                self.map.deleted_volumes.len()
            ));
        }
        for id in &self.map.deleted_volumes {
            if vids.contains(id) || id.0 >= self.next_volume_id {
                return Err(format!(
                    "tombstone of {id}, which is a live or unissued volume id"
                ));
            }
        }
        self.auth.check().map_err(|m| format!("auth: {m}"))?;
        for id in self.osd_incarnations.keys() {
            if !self.map.osds.contains_key(id) {
                return Err(format!("incarnation of {id}, which is not in the map"));
            }
        }
        for (id, t) in &self.pending_trims {
            let Some(vol) = self.map.volume_by_id(*id) else {
                return Err(format!("pending trim of {id}, which is not a volume"));
            };
            if t.from != vol.size || t.to <= t.from {
                return Err(format!(
                    "pending trim {}..{} of volume {} (size {}) is inconsistent",
                    t.from, t.to, vol.name, vol.size
                ));
            }
        }
        Ok(())
    }
}

/// What the manager knows about an OSD that is not persisted: it is re-learned from
/// heartbeats within seconds of a restart.
#[derive(Clone, Debug)]
pub struct OsdRuntime {
    /// Last boot or heartbeat, or the manager's start time if none since then (the
    /// grace period every OSD gets after a manager restart).
    pub last_heartbeat: Instant,
    /// Whether `last_heartbeat` is a real report rather than the start-time stand-in.
    pub heard: bool,
    /// Last reported object bytes.
    pub used_bytes: u64,
    /// Last reported file-system bytes.
    pub capacity_bytes: u64,
    /// Whether a heartbeat (which carries the two figures above) has arrived since
    /// the manager started. Until then the figures are placeholders (0), and `up`
    /// is only the state the map last recorded: status shows "waiting for first
    /// report" rather than `0 B used of 0 B`.
    pub usage_reported: bool,
    /// When the OSD was last marked down (or, for an OSD down in the map when the
    /// manager started, the start time): `down_out_interval_ms` counts from here.
    /// `None` while it is up.
    pub down_since: Option<Instant>,
    /// Whether its last heartbeat was signed with the shared `osd` key (any
    /// holder of which may act as any OSD): `status` warns.
    pub shared_key: bool,
}

impl OsdRuntime {
    /// Runtime data of an OSD just heard from.
    fn heard_at(now: Instant) -> OsdRuntime {
        OsdRuntime {
            last_heartbeat: now,
            heard: true,
            used_bytes: 0,
            capacity_bytes: 0,
            usage_reported: false,
            down_since: None,
            shared_key: false,
        }
    }
}

/// Default of [`ClusterState::min_down_reporters`] (`MgrConfig::min_down_reporters`).
pub const MIN_DOWN_REPORTERS_DEFAULT: u32 = 2;
/// Default of [`ClusterState::heartbeat_grace`] (`MgrConfig::heartbeat_grace_ms`).
pub const HEARTBEAT_GRACE_DEFAULT: Duration = Duration::from_millis(6000);
/// Default of [`ClusterState::report_min_silence`]
/// (`MgrConfig::failure_report_min_silence_ms`): the OSDs' default `lease_ms` (4000)
/// plus their default `heartbeat_interval_ms` (1000).
pub const REPORT_MIN_SILENCE_DEFAULT: Duration = Duration::from_millis(5000);

/// The manager's whole in-memory state: the persisted part plus heartbeat data.
#[derive(Clone, Debug)]
pub struct ClusterState {
    /// What `state.json` holds.
    pub persisted: PersistedState,
    /// Heartbeat data by OSD; every OSD in the map has an entry.
    runtime: BTreeMap<OsdId, OsdRuntime>,
    /// Failure reports ([`OsdFailureReport`]) not yet expired: failed OSD →
    /// reporter → when it reported. Bounded by OSDs² (each pair once).
    failure_reports: BTreeMap<OsdId, BTreeMap<OsdId, Instant>>,
    /// `MgrConfig::min_down_reporters`: distinct up OSDs whose failure reports
    /// mark a peer down before its heartbeat grace runs out.
    pub min_down_reporters: u32,
    /// `MgrConfig::heartbeat_grace_ms`: also how long a failure report counts.
    pub heartbeat_grace: Duration,
    /// `MgrConfig::failure_report_min_silence_ms`: failure reports mark an OSD down
    /// only once the manager has not heard from it for this long, i.e. once its
    /// lease has run out (see [`Self::failure_report`]).
    pub report_min_silence: Duration,
    /// Recovery figures from heartbeats (progress, rate, ETA); runtime only.
    pub recovery: crate::pg_status::RecoveryTracker,
    /// `MgrConfig::nearfull_ratio` and `full_ratio`.
    pub full_ratios: FullRatios,
    /// The roles of every placement group in the current map, to find the groups
    /// whose interval a new epoch starts ([`ClusterMap::record_intervals`]).
    pg_roles: Vec<flame_common::placement::PgRoles>,
    /// `MgrConfig::auth` is `none`: anyone who reaches the API may do anything,
    /// which `status` reports as a warning.
    pub auth_disabled: bool,
}

/// The used fractions of an OSD's file system at which it is nearfull (a warning)
/// and full (writes to its placement groups fail with ENOSPC).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FullRatios {
    /// `MgrConfig::nearfull_ratio`.
    pub nearfull: f64,
    /// `MgrConfig::full_ratio`.
    pub full: f64,
}

impl Default for FullRatios {
    fn default() -> Self {
        FullRatios {
            nearfull: 0.85,
            full: 0.95,
        }
    }
}

impl ClusterState {
    /// Wraps a loaded (or new) state. Every OSD counts as heard from at `now`, so
    /// OSDs get a full grace period to reach a restarted manager before they are
    /// marked down.
    pub fn new(persisted: PersistedState, now: Instant) -> Self {
        let runtime = persisted
            .map
            .osds
            .values()
            .map(|osd| {
                (
                    osd.id,
                    OsdRuntime {
                        last_heartbeat: now,
                        heard: false,
                        used_bytes: 0,
                        capacity_bytes: 0,
                        usage_reported: false,
                        // The time it went down died with the previous manager:
                        // the down-out clock starts again (documented).
                        down_since: (!osd.up).then_some(now),
                        shared_key: false,
                    },
                )
            })
            .collect();
        // The persisted map is the last one published: its roles are what the next
        // epoch is compared with (none for a map without interval history, which
        // then starts it).
        let pg_roles = if persisted.map.pg_intervals_from.is_some() {
            flame_common::placement::pg_roles(&persisted.map)
        } else {
            Vec::new()
        };
        ClusterState {
            pg_roles,
            persisted,
            runtime,
            failure_reports: BTreeMap::new(),
            min_down_reporters: MIN_DOWN_REPORTERS_DEFAULT,
            heartbeat_grace: HEARTBEAT_GRACE_DEFAULT,
            report_min_silence: REPORT_MIN_SILENCE_DEFAULT,
            recovery: crate::pg_status::RecoveryTracker::new(),
            full_ratios: FullRatios::default(),
            auth_disabled: false,
        }
    }

    /// The current map.
    pub fn map(&self) -> &ClusterMap {
        &self.persisted.map
    }

    /// The current epoch.
    pub fn epoch(&self) -> Epoch {
        self.persisted.map.epoch
    }

    /// Every new epoch first restores the invariant of [`Self::drop_down_copies_of_active_groups`].
    fn bump_epoch(&mut self) {
        self.drop_down_copies_of_active_groups();
        let e = &mut self.persisted.map.epoch;
        *e = Epoch(e.0.saturating_add(1));
        // Replicas fence forwarded writes by interval, not by epoch: record which
        // groups' roles this epoch changes.
        self.pg_roles = self.persisted.map.record_intervals(&self.pg_roles);
    }

    /// Invariant of every map: a complete copy that is down belongs to a group that
    /// is **inactive** (fewer than `min_size` complete copies up). An active group
    /// takes writes, and a down copy misses them, so it is dropped from the group's
    /// complete copies (it is recovered when it is back).
    ///
    /// [`Self::record_missed_writes`] keeps a down copy where the group cannot go
    /// on without it. But the group can become active again through *another*
    /// copy's return (two of three down, one back): without this rule the copy
    /// still down would stay "complete" while missing every write from then on, and
    /// serve stale data when it returned. Run on every epoch bump, so no map ever
    /// published breaks it.
    fn drop_down_copies_of_active_groups(&mut self) {
        let map = &self.persisted.map;
        let min_size = map.pool.min_size as usize;
        let up = |id: &OsdId| map.osds.get(id).is_some_and(|o| o.up);
        let mut changes = Vec::new();
        for pg in (0..map.pool.pg_count).map(PgId) {
            let complete = complete_copies(map, pg);
            let up_count = complete.iter().filter(|id| up(id)).count();
            if up_count >= min_size.max(1) && up_count < complete.len() {
                let kept: Vec<OsdId> = complete.iter().copied().filter(|id| up(id)).collect();
                changes.push((pg, kept));
            }
        }
        for (pg, complete) in changes {
            self.set_complete(pg, complete);
        }
    }

    /// Whether `id` was never handed out, so an OSD asking for it may have it.
    fn osd_id_free(&self, id: OsdId) -> bool {
        id.0 < OSD_ID_MAX
            && !self.persisted.map.osds.contains_key(&id)
            && !self.persisted.osd_uuids.values().any(|&v| v == id)
    }

    /// Registers or re-registers an OSD (`POST /v1/osd/boot`) and returns its id.
    ///
    /// Idempotent: booting again with the same settings changes nothing and leaves
    /// the epoch alone. An existing OSD keeps its in/out state (an operator's "out"
    /// survives restarts); a new one starts in.
    ///
    /// Refused, before anything is recorded (so a refused OSD leaves no trace in the
    /// map):
    /// * an OSD whose data directory belongs to another cluster (`req.fsid`);
    /// * an OSD whose data ports overlap those of another OSD that is **up**: two
    ///   processes cannot both be reached at one address, and a map naming two live
    ///   OSDs there would send one's I/O to the other. When the holder is *down*
    ///   the boot is allowed — this is how an OSD legitimately moves, e.g. a disk
    ///   replaced by a fresh data directory on the same host and port — and the
    ///   down holder can no longer come back up at that address (its boot and
    ///   heartbeats are refused while the new OSD is up). Down OSDs are never
    ///   contacted, so sharing an address with one routes nothing wrongly.
    pub fn boot(&mut self, req: &OsdBoot, now: Instant) -> Result<OsdId, StateError> {
        self.boot_as(req, None, now)
    }

    /// The failure-detection timings a booting OSD's lease must fit
    /// (`OsdBootReply::timings`, `flame_common::timing`).
    pub fn timings(&self) -> flame_common::timing::MgrTimings {
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        flame_common::timing::MgrTimings {
            heartbeat_grace_ms: ms(self.heartbeat_grace),
            failure_report_min_silence_ms: ms(self.report_min_silence),
        }
    }

    /// [`Self::boot`], signed with the key of `key_of`.
    ///
    /// `key_of`: the OSD whose own key (`osd.N`) signed the boot, if one did. Such
    /// a boot must be OSD N's and nobody else's: a data directory registered as
    /// another id, a new data directory while N is bound to another, and an
    /// address overlapping any other OSD's (up or down: with its own key an OSD
    /// never needs another's address) are refused, so a host holding one OSD's
    /// key cannot pose as another OSD or lock one out.
    pub fn boot_as(
        &mut self,
        req: &OsdBoot,
        key_of: Option<OsdId>,
        now: Instant,
    ) -> Result<OsdId, StateError> {
        validate_boot(req)?;
        if let Some(fsid) = &req.fsid
            && *fsid != self.persisted.map.fsid
        {
            return Err(StateError::Conflict(format!(
                "this OSD's data directory belongs to cluster {fsid}, but this manager runs \
                 cluster {}: refusing to register it. Point the OSD at its own cluster's \
                 manager, or give it an empty data directory to join this cluster.",
                self.persisted.map.fsid
            )));
        }
        let known = self.persisted.osd_uuids.get(&req.uuid).copied();
        if let Some(n) = key_of {
            self.check_boot_of_own_key(req, known, n)?;
        }
        if let Some(holder) = self.live_osd_at(req.addr, req.shards, known) {
            let held = holder.shard_addr(0);
            return Err(StateError::Conflict(format!(
                "address {} ({} shard ports) overlaps {} at {held} ({} shard ports), which is \
                 up: refusing to register a second OSD there. Give this OSD another listen \
                 port, or stop {} first (once the manager marks it down this OSD may take \
                 the address).",
                req.addr, req.shards, holder.id, holder.shards, holder.id
            )));
        }
        let id = match known {
            Some(id) => {
                if let Some(asked) = req.id
                    && asked != id
                {
                    warn!(uuid = %req.uuid, "OSD asked for {asked} but its uuid is bound to {id}; it gets {id}");
                }
                id
            }
            None => {
                if self.persisted.map.osds.len() >= OSD_COUNT_MAX {
                    return Err(StateError::Invalid(format!(
                        "the cluster already has the maximum of {OSD_COUNT_MAX} OSDs"
                    )));
                }
                let id = match key_of.or(req.id) {
                    Some(asked) if self.osd_id_free(asked) => asked,
                    _ => OsdId(self.persisted.next_osd_id),
                };
                let next =
                    id.0.checked_add(1)
                        .ok_or_else(|| StateError::Invalid("no OSD ids left".to_string()))?;
                self.persisted.next_osd_id = self.persisted.next_osd_id.max(next);
                self.persisted.osd_uuids.insert(req.uuid.clone(), id);
                info!(uuid = %req.uuid, host = %req.host, addr = %req.addr, "new OSD registered as {id}");
                id
            }
        };
        let old = self.persisted.map.osds.get(&id).cloned();
        // A boot of an OSD that is up, from another process than the one recorded:
        // it restarted within the heartbeat grace, so it was never marked down, yet
        // it lost what its previous process had not made durable and missed the
        // writes in between. Treat it as down and up again.
        let restarted = old.as_ref().is_some_and(|o| o.up)
            && self.persisted.osd_incarnations.get(&id) != Some(&req.incarnation);
        if restarted {
            warn!(
                "{id} booted as a new process (incarnation {:#x}) while marked up: it \
                 restarted within the heartbeat grace; it is recovered before it serves",
                req.incarnation
            );
            self.record_missed_writes(id);
        }
        let info = OsdInfo {
            id,
            addr: req.addr,
            shards: req.shards,
            host: req.host.clone(),
            // The weight in the OSD's config is its initial weight only: once
            // registered, `osd reweight` sets it, and an operator's reweight must
            // survive the OSD restarting (as "out" does).
            weight: old.as_ref().map_or(req.weight, |o| o.weight),
            up: true,
            // A boot of an OSD that was down, or of a new process, is a new
            // incarnation, recorded in the next epoch. (A repeated boot of the same
            // process keeps its value.)
            up_from: match &old {
                Some(o) if o.up && !restarted => o.up_from,
                _ => Epoch(self.epoch().0.saturating_add(1)),
            },
            // An operator's "out" survives the OSD restarting; a new OSD joins in.
            r#in: old.as_ref().is_none_or(|o| o.r#in),
            metrics_addr: req.metrics_addr,
        };
        if old.as_ref() != Some(&info) {
            if old.as_ref().is_some_and(|o| !o.up) {
                info!("{id} booted: marked up");
            }
            let moves = old.as_ref().is_none_or(|o| o.host != info.host);
            if moves {
                // A new OSD, or one that moved to another host (failure domain):
                // placement changes, and the data keeps being tracked.
                self.change_placement(None, |map| {
                    map.osds.insert(id, info);
                });
            } else {
                self.persisted.map.osds.insert(id, info);
            }
            self.persisted.osd_incarnations.insert(id, req.incarnation);
            self.bump_epoch();
        }
        let rt = self
            .runtime
            .entry(id)
            .or_insert_with(|| OsdRuntime::heard_at(now));
        rt.last_heartbeat = now;
        rt.heard = true;
        rt.down_since = None;
        self.failure_reports.remove(&id);
        Ok(id)
    }

    /// An up OSD other than `me` whose shard ports (`addr.port()` up to
    /// `+ shards - 1` on the same IP) overlap `[addr, addr + shards)`.
    fn live_osd_at(&self, addr: SocketAddr, shards: u16, me: Option<OsdId>) -> Option<&OsdInfo> {
        self.osds_at(addr, shards, me).find(|o| o.up)
    }

    /// The OSDs but `me` whose data ports overlap `shards` ports from `addr`.
    fn osds_at(
        &self,
        addr: SocketAddr,
        shards: u16,
        me: Option<OsdId>,
    ) -> impl Iterator<Item = &OsdInfo> {
        let lo = u32::from(addr.port());
        let hi = lo + u32::from(shards.max(1));
        self.persisted.map.osds.values().filter(move |o| {
            let o_lo = u32::from(o.addr.port());
            let o_hi = o_lo + u32::from(o.shards.max(1));
            Some(o.id) != me && o.addr.ip() == addr.ip() && lo < o_hi && o_lo < hi
        })
    }

    /// The checks of a boot signed with OSD `n`'s own key (see [`Self::boot`]);
    /// `known`: the id the boot's data directory is registered as.
    fn check_boot_of_own_key(
        &self,
        req: &OsdBoot,
        known: Option<OsdId>,
        n: OsdId,
    ) -> Result<(), StateError> {
        match known {
            Some(id) if id != n => {
                return Err(StateError::Conflict(format!(
                    "this data directory (uuid {}) is registered as {id}, but the boot is \
                     signed with the key of {n}: give this OSD the keyring of {id}",
                    req.uuid
                )));
            }
            Some(_) => {}
            None if !self.osd_id_free(n) => {
                let holder = self
                    .persisted
                    .osd_uuids
                    .iter()
                    .find(|(_, id)| **id == n)
                    .map_or_else(
                        || "another data directory".to_string(),
                        |(u, _)| format!("uuid {u}"),
                    );
                return Err(StateError::Conflict(format!(
                    "{n} is registered with {holder}, not with this new data directory (uuid {}): \
                     a new data directory cannot take an OSD's id. If {n}'s old data is gone for \
                     good, remove it first (`flame-admin osd rm {n}`, once its groups are \
                     recovered elsewhere); else give this OSD a key of its own \
                     (`flame-admin auth add osd.M`)",
                    req.uuid
                )));
            }
            None => {}
        }
        if let Some(other) = self.osds_at(req.addr, req.shards, Some(n)).next() {
            return Err(StateError::Conflict(format!(
                "address {} ({} shard ports) overlaps {} at {} ({} shard ports): an OSD \
                 booting with its own key may not take another OSD's address, up or down. \
                 Give it another listen port, or remove {} (`flame-admin osd rm`) first",
                req.addr, req.shards, other.id, other.addr, other.shards, other.id
            )));
        }
        Ok(())
    }

    /// The OSD bound to `uuid` if it is `id`; `NotFound` otherwise (a stale process,
    /// or the manager's state was replaced: the OSD's answer to 404 is to boot again).
    fn check_binding(&self, id: OsdId, uuid: &str) -> Result<&OsdInfo, StateError> {
        let bound = self.persisted.osd_uuids.get(uuid).copied();
        match self.persisted.map.osds.get(&id) {
            Some(osd) if bound == Some(id) => Ok(osd),
            Some(_) => Err(StateError::NotFound(format!(
                "{id} is registered with another uuid; boot again"
            ))),
            None => Err(StateError::NotFound(format!(
                "{id} is not registered; boot again"
            ))),
        }
    }

    /// Records a heartbeat (`POST /v1/osd/heartbeat`); a down OSD comes back up.
    ///
    /// An id the manager does not know, or a uuid that does not match it, is
    /// `NotFound`: the sender is a stale process or the manager's state was
    /// replaced, and the OSD's answer to 404 is to boot again.
    pub fn heartbeat(&mut self, hb: &OsdHeartbeat, now: Instant) -> Result<(), StateError> {
        let osd = self.check_binding(hb.id, &hb.uuid)?;
        let came_up = !osd.up;
        if came_up {
            let (addr, shards) = (osd.addr, osd.shards);
            if let Some(holder) = self.live_osd_at(addr, shards, Some(hb.id)) {
                // Another OSD took the address while this one was down: coming back
                // up here would put two live OSDs at one address. The OSD answers
                // NotFound by booting again, which is refused with the reason.
                return Err(StateError::NotFound(format!(
                    "{}'s address {addr} is now held by {}, which is up; boot again",
                    hb.id, holder.id
                )));
            }
        }
        let next_epoch = Epoch(self.epoch().0.saturating_add(1));
        let Some(osd) = self.persisted.map.osds.get_mut(&hb.id) else {
            return Err(StateError::NotFound(format!("{} is not registered", hb.id)));
        };
        if came_up {
            osd.up = true;
            // It missed writes while it was down (record_missed_writes took it out
            // of the complete copies where the group went on): a recovery report
            // made before this epoch says nothing about what it holds now.
            osd.up_from = next_epoch;
        }
        let rt = self
            .runtime
            .entry(hb.id)
            .or_insert_with(|| OsdRuntime::heard_at(now));
        rt.last_heartbeat = now;
        rt.heard = true;
        rt.used_bytes = hb.used_bytes;
        rt.capacity_bytes = hb.capacity_bytes;
        rt.usage_reported = true;
        rt.down_since = None;
        let fullness_changed = self.update_fullness(hb);
        if came_up {
            info!("{} heartbeat: marked up", hb.id);
            // Reports about its previous outage must not take it down again.
            self.failure_reports.remove(&hb.id);
        }
        if came_up || fullness_changed {
            self.bump_epoch();
        }
        let map = &self.persisted.map;
        self.recovery.record(hb.id, hb.recovery.as_ref(), map, now);
        Ok(())
    }

    /// Records whether the reporting OSD is full or nearfull (in the map, so every
    /// primary refuses writes to a full OSD's groups from the same epoch on).
    /// Whether that changed. An OSD that reports no capacity (statvfs failed) is
    /// judged neither.
    fn update_fullness(&mut self, hb: &OsdHeartbeat) -> bool {
        let ratio = if hb.capacity_bytes == 0 {
            0.0
        } else {
            hb.used_bytes as f64 / hb.capacity_bytes as f64
        };
        let full = ratio >= self.full_ratios.full;
        let nearfull = !full && ratio >= self.full_ratios.nearfull;
        let map = &mut self.persisted.map;
        let was = (
            map.full_osds.contains(&hb.id),
            map.nearfull_osds.contains(&hb.id),
        );
        if was == (full, nearfull) {
            return false;
        }
        for (set, now) in [
            (&mut map.full_osds, full),
            (&mut map.nearfull_osds, nearfull),
        ] {
            if now {
                set.insert(hb.id);
            } else {
                set.remove(&hb.id);
            }
        }
        let pct = ratio * 100.0;
        if full {
            warn!(
                "{} is full ({pct:.1}% used): writes to its placement groups fail with ENOSPC",
                hb.id
            );
        } else if nearfull {
            warn!("{} is nearfull ({pct:.1}% used)", hb.id);
        } else {
            info!("{} has space again ({pct:.1}% used)", hb.id);
        }
        true
    }

    /// Marks `ids` (up OSDs) down at `now`: each misses the writes from now on
    /// ([`Self::record_missed_writes`]). The caller bumps the epoch once.
    fn mark_down(&mut self, ids: &[OsdId], now: Instant) {
        for id in ids {
            if let Some(osd) = self.persisted.map.osds.get_mut(id) {
                osd.up = false;
            }
            if let Some(rt) = self.runtime.get_mut(id) {
                rt.down_since = Some(now);
            }
            self.failure_reports.remove(id);
        }
        for &id in ids {
            self.record_missed_writes(id);
        }
    }

    /// Marks down every up OSD not heard from for longer than `grace`, in one epoch,
    /// and returns their ids. (Marking out is [`Self::check_failures`].)
    #[cfg(test)]
    pub fn mark_down_silent(&mut self, now: Instant, grace: Duration) -> Vec<OsdId> {
        self.check_failures(now, grace, Duration::ZERO).0
    }

    /// The failure detector's periodic step, in one epoch: marks down every up OSD
    /// not heard from for longer than `grace`, then marks out every OSD that is
    /// down and in and has been down for at least `down_out` (counted from when
    /// this manager marked it down, or from the manager's start for an OSD already
    /// down then; zero: never). Marking out moves its placement groups to other
    /// OSDs, which are recovered from the remaining complete copies. Returns (marked
    /// down, marked out).
    pub fn check_failures(
        &mut self,
        now: Instant,
        grace: Duration,
        down_out: Duration,
    ) -> (Vec<OsdId>, Vec<OsdId>) {
        let down: Vec<OsdId> = self
            .persisted
            .map
            .osds
            .values()
            .filter(|osd| osd.up)
            .filter(|osd| {
                self.runtime
                    .get(&osd.id)
                    .is_none_or(|rt| now.saturating_duration_since(rt.last_heartbeat) > grace)
            })
            .map(|osd| osd.id)
            .collect();
        self.expire_failure_reports(now);
        let mut down = down;
        // Reported OSDs whose silence has grown long enough since the last report.
        let reported: Vec<OsdId> = self
            .failure_reports
            .keys()
            .copied()
            .filter(|id| !down.contains(id) && self.reported_down(*id, now))
            .collect();
        down.extend(reported);
        if !down.is_empty() {
            self.mark_down(&down, now);
        }
        let out = self.down_too_long(now, down_out);
        if !out.is_empty() {
            self.change_placement(None, |map| {
                for id in &out {
                    if let Some(osd) = map.osds.get_mut(id) {
                        osd.r#in = false;
                    }
                }
            });
        }
        if !down.is_empty() || !out.is_empty() {
            self.bump_epoch();
        }
        (down, out)
    }

    /// OSDs down and in for at least `interval` (none if it is zero).
    fn down_too_long(&self, now: Instant, interval: Duration) -> Vec<OsdId> {
        if interval.is_zero() {
            return Vec::new();
        }
        self.persisted
            .map
            .osds
            .values()
            .filter(|osd| !osd.up && osd.r#in)
            .filter(|osd| {
                self.runtime
                    .get(&osd.id)
                    .and_then(|rt| rt.down_since)
                    .is_some_and(|t| now.saturating_duration_since(t) >= interval)
            })
            .map(|osd| osd.id)
            .collect()
    }

    /// Drops failure reports older than the heartbeat grace.
    fn expire_failure_reports(&mut self, now: Instant) {
        let grace = self.heartbeat_grace;
        for reports in self.failure_reports.values_mut() {
            reports.retain(|_, at| now.saturating_duration_since(*at) <= grace);
        }
        self.failure_reports.retain(|_, r| !r.is_empty());
    }

    /// Whether the unexpired failure reports about `id` (an up OSD) suffice to mark
    /// it down at `now`: enough distinct up reporters, and silence towards the
    /// manager for at least [`Self::report_min_silence`].
    fn reported_down(&self, id: OsdId, now: Instant) -> bool {
        let map = &self.persisted.map;
        let up = |id: &OsdId| map.osds.get(id).is_some_and(|o| o.up);
        if !up(&id) {
            return false;
        }
        let reporters = self
            .failure_reports
            .get(&id)
            .map_or(0, |reps| reps.keys().filter(|r| up(r)).count());
        let others_up = map.osds.values().filter(|o| o.up && o.id != id).count();
        let needed = (self.min_down_reporters as usize).min(others_up).max(1);
        let silent = self.runtime.get(&id).is_none_or(|rt| {
            now.saturating_duration_since(rt.last_heartbeat) >= self.report_min_silence
        });
        reporters >= needed && silent
    }

    /// Records that `r.reporter` cannot reach `r.failed` (`POST /v1/osd/failure`)
    /// and returns whether `r.failed` is down now.
    ///
    /// The failed OSD is marked down (one epoch) once distinct **up** OSDs have
    /// reported it within the heartbeat grace — [`Self::min_down_reporters`] of
    /// them, or every other up OSD when there are fewer — so one OSD with a broken
    /// link cannot take a healthy one out of service, **and** the manager has not
    /// heard from it for [`Self::report_min_silence`] (checked again by every
    /// [`Self::check_failures`] while the reports last). The silence is what keeps
    /// fencing sound: an OSD serves only while its last acknowledged heartbeat is
    /// younger than its lease (`lease_ms`, counted from when it was sent), so once
    /// the manager has heard nothing for longer than the lease, the OSD has stopped
    /// serving and its placement groups may get a new primary. An OSD that still
    /// heartbeats — only its peer links are broken — is never marked down by
    /// reports (it would keep serving under its valid lease, and flap). A report
    /// made under a map older than the failed OSD's current incarnation (`up_from`)
    /// is about an earlier process and is ignored.
    ///
    /// Refused: a reporter whose uuid is not bound to its id (404), an unknown
    /// failed id (404), an OSD reporting itself (400).
    pub fn failure_report(
        &mut self,
        r: &OsdFailureReport,
        now: Instant,
    ) -> Result<bool, StateError> {
        self.check_binding(r.reporter, &r.uuid)?;
        if r.failed == r.reporter {
            return Err(StateError::Invalid(format!(
                "{} reported itself as failed",
                r.reporter
            )));
        }
        let Some(failed) = self.persisted.map.osds.get(&r.failed) else {
            return Err(StateError::NotFound(format!(
                "{} (reported failed by {}) is not in the map",
                r.failed, r.reporter
            )));
        };
        if r.epoch > self.epoch() {
            return Err(StateError::Invalid(format!(
                "report made under map {} but the current map is {}",
                r.epoch,
                self.epoch()
            )));
        }
        if !failed.up {
            return Ok(true);
        }
        if r.epoch < failed.up_from {
            debug!(
                "ignoring {}'s report of {} under map {}: it came up again in {}",
                r.reporter, r.failed, r.epoch, failed.up_from
            );
            return Ok(false);
        }
        self.expire_failure_reports(now);
        self.failure_reports
            .entry(r.failed)
            .or_default()
            .insert(r.reporter, now);
        if !self.reported_down(r.failed, now) {
            debug!(
                "{} reports {} unreachable (not enough reporters or silence yet)",
                r.reporter, r.failed
            );
            return Ok(false);
        }
        warn!(
            "{} marked down: other OSDs report it unreachable and it has been silent \
             for {} ms",
            r.failed,
            self.report_min_silence.as_millis()
        );
        self.mark_down(&[r.failed], now);
        self.bump_epoch();
        Ok(true)
    }

    /// An OSD that stopped serving misses every write its placement groups take
    /// from now on. In every group where it holds a complete copy and at least
    /// `min_size` other complete copies are up, the group goes on without it, so it
    /// is no longer complete: the others are recorded as the complete copies
    /// (`ClusterMap::pg_complete`), and when it comes back it is recovered before
    /// it serves. Where fewer are up, the group waits for it — no write can be
    /// acknowledged without it — so it stays complete and serves again as soon as
    /// it is back. Call after marking it down, before bumping the epoch.
    fn record_missed_writes(&mut self, id: OsdId) {
        let map = &self.persisted.map;
        let min_size = map.pool.min_size as usize;
        let mut changes = Vec::new();
        for pg in (0..map.pool.pg_count).map(PgId) {
            let complete = complete_copies(map, pg);
            if !complete.contains(&id) {
                continue;
            }
            let rest: Vec<OsdId> = complete.iter().copied().filter(|&o| o != id).collect();
            let rest_up = rest
                .iter()
                .filter(|o| map.osds.get(o).is_some_and(|i| i.up))
                .count();
            if rest_up >= min_size {
                changes.push((pg, rest));
            }
        }
        for (pg, complete) in changes {
            self.set_complete(pg, complete);
        }
    }

    /// Applies a change of placement inputs (an OSD out, in, removed, reweighted,
    /// added, moved to another host) without losing track of the data: the complete
    /// copies of every placement group are taken before the change and recorded
    /// after it (`ClusterMap::pg_complete`), so the old homes keep serving and the
    /// new placed members start as recovering. A group that had no complete copy
    /// (it never had members) starts complete on its new members.
    ///
    /// `removed`: an OSD the change deletes from the map; it is dropped from every
    /// complete set. Returns the groups whose only complete copies were on it:
    /// their data is lost, and they start again empty on their placed members
    /// (recording an empty set would make them wait forever).
    ///
    /// While no volume exists no placement group holds data that matters, so the
    /// records are reset instead (each down OSD still counts as having missed
    /// writes, since a volume created now is written without it).
    fn change_placement(
        &mut self,
        removed: Option<OsdId>,
        change: impl FnOnce(&mut ClusterMap),
    ) -> Vec<PgId> {
        if self.persisted.map.volumes.is_empty() {
            change(&mut self.persisted.map);
            self.persisted.map.pg_complete.clear();
            let down: Vec<OsdId> = self
                .persisted
                .map
                .osds
                .values()
                .filter(|o| !o.up)
                .map(|o| o.id)
                .collect();
            for id in down {
                self.record_missed_writes(id);
            }
            return Vec::new();
        }
        let pg_count = self.persisted.map.pool.pg_count;
        let before: Vec<Vec<OsdId>> = (0..pg_count)
            .map(|pg| complete_copies(&self.persisted.map, PgId(pg)))
            .collect();
        change(&mut self.persisted.map);
        let mut lost = Vec::new();
        for (pg, mut complete) in (0..pg_count).map(PgId).zip(before) {
            if complete.is_empty() {
                self.persisted.map.pg_complete.remove(&pg);
                continue;
            }
            if let Some(gone) = removed {
                complete.retain(|&o| o != gone);
                if complete.is_empty() {
                    lost.push(pg);
                    self.persisted.map.pg_complete.remove(&pg);
                    continue;
                }
            }
            self.set_complete(pg, complete);
        }
        lost
    }

    /// Records `complete` as the complete copies of `pg`, dropping the record when
    /// it says what placement says anyway.
    fn set_complete(&mut self, pg: PgId, complete: Vec<OsdId>) {
        let map = &mut self.persisted.map;
        if pg_osds(map, pg) == complete {
            map.pg_complete.remove(&pg);
        } else {
            map.pg_complete.insert(pg, complete);
        }
    }

    /// Records the members a primary reports recovered (`POST /v1/pg/recovered`)
    /// and returns how many entries changed the map (all in one epoch; none: no
    /// bump).
    ///
    /// The reporter must be bound to its uuid (404) and the report at most
    /// [`PG_RECOVERED_ENTRIES_MAX`] entries (400). An entry is skipped — stale, not
    /// an error — unless, in the **current** map, the placement group exists, the
    /// reporter is its primary, and the member is up, came up no later than the
    /// report's epoch (what was copied to an earlier process proves nothing), and
    /// is recovering there (placed, not yet complete). A recorded member joins the
    /// complete copies (placed ones first, in placement order, then the others);
    /// once every placed member is complete, exactly the placed set is recorded, so
    /// the old homes stop being members (and delete their stray copies).
    pub fn pg_recovered(&mut self, r: &PgRecoveredReport) -> Result<u32, StateError> {
        if r.recovered.len() > PG_RECOVERED_ENTRIES_MAX {
            return Err(StateError::Invalid(format!(
                "{} entries in one report, more than {PG_RECOVERED_ENTRIES_MAX}",
                r.recovered.len()
            )));
        }
        let reporter = self.check_binding(r.reporter, &r.uuid)?;
        if r.epoch > self.epoch() {
            return Err(StateError::Invalid(format!(
                "report made under map {} but the current map is {}",
                r.epoch,
                self.epoch()
            )));
        }
        if reporter.up_from > r.epoch {
            debug!(
                "ignoring {}'s recovery report under map {}: it came up again in {}",
                r.reporter, r.epoch, reporter.up_from
            );
            return Ok(0);
        }
        let map = &self.persisted.map;
        let mut by_pg: BTreeMap<PgId, Vec<OsdId>> = BTreeMap::new();
        for &(pg, member) in &r.recovered {
            if pg.0 >= map.pool.pg_count {
                debug!("recovery report of {}: no {pg}", r.reporter);
                continue;
            }
            by_pg.entry(pg).or_default().push(member);
        }
        let mut changes = Vec::new();
        let mut recorded = 0u32;
        for (pg, members) in by_pg {
            let roles = PgMembers::compute(map, pg);
            if roles.primary() != Some(r.reporter) {
                debug!(
                    "recovery report of {}: not the primary of {pg} any more",
                    r.reporter
                );
                continue;
            }
            let mut complete = complete_copies(map, pg);
            for member in members {
                let fresh = map
                    .osds
                    .get(&member)
                    .is_some_and(|o| o.up && o.up_from <= r.epoch);
                if !fresh || !roles.recovering.contains(&member) || complete.contains(&member) {
                    debug!(
                        "recovery report of {}: {member} in {pg} is stale or already complete",
                        r.reporter
                    );
                    continue;
                }
                complete.push(member);
                recorded = recorded.saturating_add(1);
            }
            let done = roles.placed.iter().all(|o| complete.contains(o));
            let ordered: Vec<OsdId> = if done {
                roles.placed.clone()
            } else {
                let mut v: Vec<OsdId> = roles
                    .placed
                    .iter()
                    .filter(|o| complete.contains(o))
                    .copied()
                    .collect();
                v.extend(complete.iter().filter(|o| !roles.placed.contains(o)));
                v
            };
            changes.push((pg, ordered));
        }
        if recorded == 0 {
            return Ok(0);
        }
        for (pg, complete) in changes {
            self.set_complete(pg, complete);
        }
        self.bump_epoch();
        Ok(recorded)
    }

    /// The OSD `id` for an operator command, or `NotFound` naming the known ones.
    fn osd_for_command(&self, id: OsdId) -> Result<&OsdInfo, StateError> {
        self.persisted.map.osds.get(&id).ok_or_else(|| {
            let known: Vec<String> = self
                .persisted
                .map
                .osds
                .keys()
                .take(DETAIL_OSDS_MAX)
                .map(ToString::to_string)
                .collect();
            StateError::NotFound(format!(
                "there is no {id} (OSDs: {})",
                if known.is_empty() {
                    "none".to_string()
                } else {
                    known.join(", ")
                }
            ))
        })
    }

    /// `osd out` / `osd in` (`POST /v1/osds/{id}/out|in`): takes the OSD out of
    /// placement (its placement groups get new members, recovered from the complete
    /// copies, which keep serving meanwhile) or puts it back. Returns whether the
    /// map changed (false: it already was so; no epoch).
    pub fn set_in(&mut self, id: OsdId, r#in: bool) -> Result<bool, StateError> {
        if self.osd_for_command(id)?.r#in == r#in {
            return Ok(false);
        }
        self.change_placement(None, |map| {
            if let Some(osd) = map.osds.get_mut(&id) {
                osd.r#in = r#in;
            }
        });
        self.bump_epoch();
        Ok(true)
    }

    /// `osd reweight` (`POST /v1/osds/{id}/reweight`): sets the OSD's placement
    /// weight, `0..=OSD_WEIGHT_MAX`, finite. Returns whether the map changed.
    pub fn reweight(&mut self, id: OsdId, weight: f64) -> Result<bool, StateError> {
        if !weight.is_finite() || !(0.0..=OSD_WEIGHT_MAX).contains(&weight) {
            return Err(StateError::Invalid(format!(
                "weight {weight} is not a number in 0..={OSD_WEIGHT_MAX}"
            )));
        }
        if self.osd_for_command(id)?.weight == weight {
            return Ok(false);
        }
        self.change_placement(None, |map| {
            if let Some(osd) = map.osds.get_mut(&id) {
                osd.weight = weight;
            }
        });
        self.bump_epoch();
        Ok(true)
    }

    /// `osd rm` (`DELETE /v1/osds/{id}`): removes a down OSD from the map, its uuid
    /// binding (a data directory with that uuid registers as a new OSD) and every
    /// complete set. Refused while it is up (stop it first). Returns the placement
    /// groups whose last complete copy it held: their data is lost.
    pub fn remove_osd(&mut self, id: OsdId) -> Result<Vec<PgId>, StateError> {
        if self.osd_for_command(id)?.up {
            return Err(StateError::Conflict(format!(
                "{id} is up: stop it first (the manager marks it down after its \
                 heartbeat grace), then remove it"
            )));
        }
        let lost = self.change_placement(Some(id), |map| {
            map.osds.remove(&id);
        });
        self.persisted.osd_uuids.retain(|_, v| *v != id);
        self.persisted.osd_incarnations.remove(&id);
        self.runtime.remove(&id);
        self.failure_reports.remove(&id);
        for reports in self.failure_reports.values_mut() {
            reports.remove(&id);
        }
        if !lost.is_empty() {
            warn!(
                "{id} removed although it held the only complete copy of {} placement \
                 groups: their data is LOST (they start again empty)",
                lost.len()
            );
        }
        self.bump_epoch();
        Ok(lost)
    }

    /// Creates a volume (`POST /v1/volumes`).
    pub fn create_volume(
        &mut self,
        req: &VolumeCreate,
        now_unix: u64,
    ) -> Result<VolumeInfo, StateError> {
        validate_volume_name(&req.name).map_err(StateError::Invalid)?;
        validate_volume_size(req.size)?;
        if self.persisted.map.volumes.contains_key(&req.name) {
            return Err(StateError::Conflict(format!(
                "volume {} already exists",
                req.name
            )));
        }
        if self.persisted.map.volumes.len() >= VOLUME_COUNT_MAX {
            return Err(StateError::Invalid(format!(
                "the cluster already has the maximum of {VOLUME_COUNT_MAX} volumes"
            )));
        }
        let id = VolumeId(self.persisted.next_volume_id);
        self.persisted.next_volume_id =
            id.0.checked_add(1)
                .ok_or_else(|| StateError::Invalid("no volume ids left".to_string()))?;
        let vol = VolumeInfo {
            id,
            name: req.name.clone(),
            size: req.size,
            created_unix: now_unix,
        };
        self.persisted
            .map
            .volumes
            .insert(req.name.clone(), vol.clone());
        self.bump_epoch();
        Ok(vol)
    }

    /// Changes a volume's size (`POST /v1/volumes/{name}/resize`). Shrinking loses
    /// the data past the new end, so it needs `allow_shrink`. Resizing to the
    /// current size is a no-op and keeps the epoch.
    ///
    /// A shrink takes effect for I/O at once and records the cut-off range as a
    /// pending trim (persisted with the map, in the same epoch): the old bytes stay
    /// on the OSDs until a client removes them and reports it ([`Self::trim_done`]).
    /// Growing a volume with a pending trim is refused, so no crash or failure
    /// between the shrink and the trim can let a later grow expose old bytes.
    pub fn resize_volume(
        &mut self,
        name: &str,
        req: &VolumeResize,
    ) -> Result<VolumeInfo, StateError> {
        validate_volume_size(req.size)?;
        let vol = self
            .persisted
            .map
            .volumes
            .get_mut(name)
            .ok_or_else(|| no_such_volume(name))?;
        if req.size == vol.size {
            return Ok(vol.clone());
        }
        let pending = self.persisted.pending_trims.get(&vol.id).copied();
        if req.size > vol.size
            && let Some(t) = pending
        {
            return Err(StateError::Conflict(format!(
                "volume {name} was shrunk to {} bytes, but the old bytes up to {} have not \
                 been removed from every OSD yet; growing it now would show them where \
                 zeroes are promised. Finish the trim first (`flame-admin volume resize \
                 {name} --size {} --allow-shrink` completes it), then grow.",
                t.from, t.to, t.from
            )));
        }
        if req.size < vol.size && !req.allow_shrink {
            return Err(StateError::Invalid(format!(
                "shrinking volume {name} from {} to {} bytes discards the data past the new end; \
                 pass allow_shrink=true (flame-admin: --allow-shrink) to confirm",
                vol.size, req.size
            )));
        }
        if req.size < vol.size {
            // The range to remove: from the new end to the largest end any data
            // may have had (an earlier pending trim may reach further).
            let to = pending.map_or(vol.size, |t| t.to.max(vol.size));
            self.persisted
                .pending_trims
                .insert(vol.id, TrimRange { from: req.size, to });
        }
        vol.size = req.size;
        let out = vol.clone();
        self.bump_epoch();
        Ok(out)
    }

    /// The pending trim of volume `name` (`GET /v1/volumes/{name}/trim`).
    pub fn volume_trim(&self, name: &str) -> Result<VolumeTrim, StateError> {
        let vol = self
            .persisted
            .map
            .volumes
            .get(name)
            .ok_or_else(|| no_such_volume(name))?;
        Ok(VolumeTrim {
            volume: vol.id,
            pending: self.persisted.pending_trims.get(&vol.id).copied(),
        })
    }

    /// Records that a client removed `done.range` of the volume on every copy
    /// (`POST /v1/volumes/{name}/trim`). Clears the pending trim (one epoch) only if
    /// the range covers it; otherwise (a further shrink came in meanwhile) it stays
    /// and the reply shows what is left.
    pub fn trim_done(&mut self, name: &str, done: &TrimDone) -> Result<VolumeTrim, StateError> {
        let vol = self
            .persisted
            .map
            .volumes
            .get(name)
            .ok_or_else(|| no_such_volume(name))?;
        if vol.id != done.volume {
            return Err(StateError::Conflict(format!(
                "volume {name} is {} now, not {}: it was removed and created again",
                vol.id, done.volume
            )));
        }
        let id = vol.id;
        if let Some(t) = self.persisted.pending_trims.get(&id).copied()
            && done.range.from <= t.from
            && done.range.to >= t.to
        {
            self.persisted.pending_trims.remove(&id);
            self.bump_epoch();
        }
        self.volume_trim(name)
    }

    /// Removes a volume from the map (`DELETE /v1/volumes/{name}`) and returns it.
    /// Its objects on the OSDs that are up are deleted by the caller (`flame-admin
    /// volume rm`), which knows the volume id from the reply; the map keeps a
    /// tombstone of the id (`ClusterMap::deleted_volumes`, the newest
    /// [`DELETED_VOLUMES_MAX`]) so that an OSD down at the time deletes its copies
    /// when it is back.
    pub fn delete_volume(&mut self, name: &str) -> Result<VolumeInfo, StateError> {
        let vol = self
            .persisted
            .map
            .volumes
            .remove(name)
            .ok_or_else(|| no_such_volume(name))?;
        // Its objects are being deleted everywhere: nothing to trim.
        self.persisted.pending_trims.remove(&vol.id);
        let tombstones = &mut self.persisted.map.deleted_volumes;
        tombstones.insert(vol.id);
        while tombstones.len() > DELETED_VOLUMES_MAX {
            tombstones.pop_first();
        }
        self.bump_epoch();
        Ok(vol)
    }

    /// Adds an entity (`POST /v1/auth/entities`).
    pub fn auth_add(
        &mut self,
        name: &EntityName,
        role: crate::auth::Role,
        volumes: flame_common::auth::VolumePatterns,
    ) -> Result<crate::auth::EntityRecord, StateError> {
        let generation = match self.persisted.auth_removed.get(name) {
            None => 1,
            Some(&last) => last.checked_add(1).ok_or_else(|| {
                StateError::Conflict(format!("entity {name}: key generations exhausted"))
            })?,
        };
        let rec = self
            .persisted
            .auth
            .add_at(name, role, volumes, generation)
            .map_err(StateError::Conflict)?;
        self.persisted.auth_removed.remove(name);
        self.bump_epoch();
        Ok(rec)
    }

    /// Sets the volumes an entity may use (`POST /v1/auth/entities/{name}/volumes`).
    pub fn auth_set_volumes(
        &mut self,
        name: &EntityName,
        volumes: flame_common::auth::VolumePatterns,
    ) -> Result<crate::auth::EntityRecord, StateError> {
        if !self.persisted.auth.entities.contains_key(name) {
            return Err(StateError::NotFound(format!("no entity {name}")));
        }
        let rec = self
            .persisted
            .auth
            .set_volumes(name, volumes)
            .map_err(StateError::Invalid)?;
        self.bump_epoch();
        Ok(rec)
    }

    /// Moves an entity to its next key generation.
    pub fn auth_rotate(
        &mut self,
        name: &EntityName,
    ) -> Result<crate::auth::EntityRecord, StateError> {
        let rec = self
            .persisted
            .auth
            .rotate(name)
            .map_err(StateError::NotFound)?;
        self.bump_epoch();
        Ok(rec)
    }

    /// Removes an entity (not a built-in).
    pub fn auth_remove(
        &mut self,
        name: &EntityName,
    ) -> Result<crate::auth::EntityRecord, StateError> {
        if !self.persisted.auth.entities.contains_key(name) {
            return Err(StateError::NotFound(format!("no entity {name}")));
        }
        if self.persisted.auth_removed.len() >= AUTH_REMOVED_MAX
            && !self.persisted.auth_removed.contains_key(name)
        {
            return Err(StateError::Conflict(format!(
                "the manager remembers {AUTH_REMOVED_MAX} removed entities already (so \
                 their keys never work again); rotate {name}'s key instead of removing it"
            )));
        }
        let rec = self
            .persisted
            .auth
            .remove(name)
            .map_err(StateError::Invalid)?;
        self.persisted
            .auth_removed
            .insert(name.clone(), rec.generation);
        self.bump_epoch();
        Ok(rec)
    }

    /// Records which key OSD `id` signed its heartbeat with: the shared `osd`
    /// key (`shared`) or its own (`status` warns about the first).
    pub fn note_osd_key(&mut self, id: OsdId, shared: bool) {
        if let Some(rt) = self.runtime.get_mut(&id) {
            rt.shared_key = shared;
        }
    }

    /// `GET /v1/status`. `pgs` is the [`PgTable`] of the current map; `now`
    /// dates the recovery rate.
    pub fn status(&self, pgs: &PgTable, now: Instant) -> ClusterStatus {
        let map = &self.persisted.map;
        let (mut health, mut health_detail) = health(map, pgs, &self.persisted.pending_trims);
        if self.auth_disabled {
            health = health.max(Health::Warn);
            health_detail.push(
                "authentication is off (`auth: none`): anyone who can reach the manager \
                 can change or delete everything; create keys with `flame-admin auth init` \
                 and set `auth: required`"
                    .into(),
            );
        }
        let shared: Vec<String> = map
            .osds
            .values()
            .filter(|o| o.up && self.runtime.get(&o.id).is_some_and(|rt| rt.shared_key))
            .map(|o| o.id.to_string())
            .collect();
        if !shared.is_empty() {
            health = health.max(Health::Warn);
            health_detail.push(format!(
                "{} sign with the shared `osd` key, whose holder may act as any OSD: give \
                 each OSD its own (`flame-admin auth add osd.N`, then `keyring:` and a restart)",
                shared.join(", ")
            ));
        }
        let (pgs_by_state, pg_summary) = crate::pg_status::summarize(pgs, map);
        ClusterStatus {
            fsid: map.fsid.clone(),
            health: health.as_str().to_string(),
            health_detail,
            epoch: map.epoch,
            osds: count_u32(map.osds.len()),
            osds_up: count_u32(map.osds.values().filter(|o| o.up).count()),
            osds_in: count_u32(map.osds.values().filter(|o| o.r#in).count()),
            volumes: count_u32(map.volumes.len()),
            provisioned_bytes: map
                .volumes
                .values()
                .fold(0u64, |a, v| a.saturating_add(v.size)),
            used_bytes: self
                .runtime
                .values()
                .fold(0u64, |a, r| a.saturating_add(r.used_bytes)),
            capacity_bytes: self
                .runtime
                .values()
                .fold(0u64, |a, r| a.saturating_add(r.capacity_bytes)),
            pool: map.pool.clone(),
            osds_awaiting_first_report: count_u32(
                map.osds
                    .keys()
                    .filter(|id| !self.runtime.get(id).is_some_and(|r| r.usage_reported))
                    .count(),
            ),
            pgs_by_state,
            pg_summary,
            recovery: self.recovery.summary(pgs, map, now),
        }
    }

    /// `GET /v1/osds`. `table` is the [`PgTable`] of the current map.
    pub fn osd_statuses(&self, table: &PgTable, now: Instant) -> Vec<OsdStatus> {
        let mut pgs: BTreeMap<OsdId, u32> = BTreeMap::new();
        // Members: placed, or holding a complete copy (up or down).
        let mut members: Vec<OsdId> = Vec::new();
        for (_, m) in table.iter() {
            members.clear();
            for &id in m.placed.iter().chain(&m.acting).chain(&m.down_complete) {
                if !members.contains(&id) {
                    members.push(id);
                }
            }
            for &id in &members {
                debug_assert!(m.is_member(id));
                *pgs.entry(id).or_default() += 1;
            }
        }
        self.persisted
            .map
            .osds
            .values()
            .map(|info| {
                let rt = self.runtime.get(&info.id);
                OsdStatus {
                    info: info.clone(),
                    used_bytes: rt.map_or(0, |r| r.used_bytes),
                    capacity_bytes: rt.map_or(0, |r| r.capacity_bytes),
                    last_heartbeat_ms_ago: rt.filter(|r| r.heard).map(|r| {
                        let ms = now.saturating_duration_since(r.last_heartbeat).as_millis();
                        u64::try_from(ms).unwrap_or(u64::MAX)
                    }),
                    pgs: pgs.get(&info.id).copied().unwrap_or(0),
                    awaiting_first_report: !rt.is_some_and(|r| r.usage_reported),
                }
            })
            .collect()
    }
}

fn no_such_volume(name: &str) -> StateError {
    StateError::NotFound(format!("no volume named {name}"))
}

fn count_u32(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Checks the fields of a boot request that the map will carry to every client.
fn validate_boot(req: &OsdBoot) -> Result<(), StateError> {
    let bad = |m: String| Err(StateError::Invalid(m));
    if req.uuid.is_empty() || req.uuid.len() > UUID_BYTES_MAX {
        return bad(format!("uuid must be 1..={UUID_BYTES_MAX} bytes"));
    }
    if req.uuid.chars().any(char::is_control) {
        return bad("uuid must not contain control characters".into());
    }
    if req.host.is_empty() || req.host.len() > HOST_BYTES_MAX {
        return bad(format!("host must be 1..={HOST_BYTES_MAX} bytes"));
    }
    if req.host.chars().any(char::is_control) {
        return bad("host must not contain control characters".into());
    }
    if req.shards == 0 || req.shards > OSD_SHARDS_MAX {
        return bad(format!("shards must be 1..={OSD_SHARDS_MAX}"));
    }
    // Bounded like `osd reweight`: a huge weight would win nearly every straw2
    // draw and pull the whole cluster's placement onto one OSD.
    if !req.weight.is_finite() || !(0.0..=OSD_WEIGHT_MAX).contains(&req.weight) {
        return bad(format!("weight must be a number in 0..={OSD_WEIGHT_MAX}"));
    }
    // Clients connect to shard i at addr.port() + i: every one of those ports must
    // exist, and an unspecified address (0.0.0.0) cannot be connected to.
    if req.addr.ip().is_unspecified() || req.addr.port() == 0 {
        return bad(format!(
            "addr {} is not connectable: advertise a concrete IP and port",
            req.addr
        ));
    }
    if u32::from(req.addr.port()) + u32::from(req.shards) - 1 > u32::from(u16::MAX) {
        return bad(format!(
            "addr port {} + {} shards runs past port 65535",
            req.addr.port(),
            req.shards
        ));
    }
    Ok(())
}

fn validate_volume_size(size: u64) -> Result<(), StateError> {
    if size == 0 || !size.is_multiple_of(512) || size > VOLUME_SIZE_MAX {
        return Err(StateError::Invalid(format!(
            "volume size must be a positive multiple of 512 bytes, at most {} ({VOLUME_SIZE_MAX} bytes); got {size} bytes ({})",
            flame_common::mgr_api::format_size(VOLUME_SIZE_MAX),
            flame_common::mgr_api::format_size(size)
        )));
    }
    Ok(())
}

/// The OSDs holding complete copies of `pg`: the manager's record, or the placed
/// OSDs when there is none.
pub fn complete_copies(map: &ClusterMap, pg: PgId) -> Vec<OsdId> {
    match map.pg_complete.get(&pg) {
        Some(c) => c.clone(),
        None => pg_osds(map, pg),
    }
}

/// Cluster health levels, ordered by severity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Health {
    /// Everything is up, in and fully replicated.
    Ok,
    /// Redundancy is reduced but all I/O can proceed.
    Warn,
    /// Some I/O cannot proceed (or there is nowhere to put data at all).
    Err,
}

impl Health {
    /// The name used in the API (`HEALTH_OK`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Health::Ok => "HEALTH_OK",
            Health::Warn => "HEALTH_WARN",
            Health::Err => "HEALTH_ERR",
        }
    }
}

/// Appends one line per listed OSD, summarizing past [`DETAIL_OSDS_MAX`].
fn detail_osds(detail: &mut Vec<String>, ids: &[OsdId], what: &str) {
    for id in ids.iter().take(DETAIL_OSDS_MAX) {
        detail.push(format!("{id} is {what}"));
    }
    if ids.len() > DETAIL_OSDS_MAX {
        detail.push(format!(
            "... and {} more OSDs {what}",
            ids.len() - DETAIL_OSDS_MAX
        ));
    }
}

/// Most volume lines in `health_detail` (the rest are summarized).
const DETAIL_VOLUMES_MAX: usize = 10;
/// Objects of one volume checked against the blocked placement groups per status
/// call, and objects checked over all volumes: bounds the cost of `GET /v1/status`
/// on a cluster with huge volumes (each check is one hash).
const HEALTH_SCAN_OBJECTS_PER_VOLUME: u64 = 1 << 16;
const HEALTH_SCAN_OBJECTS_TOTAL: u64 = 1 << 20;

/// Computes health and the reasons for it, saying what happens to I/O — which is
/// what an operator needs to know — as well as naming the placement-group states
/// (see `flame_common::pg_state`).
///
/// What the data path does (see `PgMembers`): a group serves reads and writes
/// while at least `pool.min_size` complete copies are up (a write is acknowledged
/// once every acting and recovering member applied it); with fewer, I/O to it
/// waits — the OSDs answer EAGAIN and the client retries — until enough copies are
/// back.
///
/// ERR: no OSDs, or some placement group is inactive or incomplete (its I/O
/// waits). WARN: an OSD is down or out, some group is degraded, recovering or
/// remapped (I/O continues, redundancy is reduced or data is moving), or a shrunk
/// volume's old bytes are not yet trimmed.
pub fn health(
    map: &ClusterMap,
    pgs: &PgTable,
    pending_trims: &BTreeMap<VolumeId, TrimRange>,
) -> (Health, Vec<String>) {
    let (level, mut detail) = io_health(map, pgs);
    let level = level.max(space_health(map, &mut detail));
    if pending_trims.is_empty() {
        return (level, detail);
    }
    for (id, t) in pending_trims {
        let name = map.volume_by_id(*id).map_or("?", |v| v.name.as_str());
        detail.push(format!(
            "volume {name} was shrunk to {} bytes but its old bytes up to {} are not yet \
             removed on every copy: it cannot grow until `flame-admin volume resize {name} \
             --size {} --allow-shrink` completes the trim",
            t.from, t.to, t.from
        ));
    }
    (level.max(Health::Warn), detail)
}

/// Full OSDs (ERR: writes to their placement groups fail with ENOSPC) and nearfull
/// ones (WARN), as the map records them from the OSDs' heartbeats.
fn space_health(map: &ClusterMap, detail: &mut Vec<String>) -> Health {
    let mut level = Health::Ok;
    // Only OSDs still in the map (one removed while full leaves no warning).
    let listed = |set: &std::collections::BTreeSet<OsdId>| -> Vec<String> {
        set.iter()
            .filter(|id| map.osds.contains_key(id))
            .map(ToString::to_string)
            .collect()
    };
    let full = listed(&map.full_osds);
    let nearfull = listed(&map.nearfull_osds);
    if !full.is_empty() {
        level = Health::Err;
        let ids = full;
        detail.push(format!(
            "{} full (file system used at or above full_ratio): writes to their placement \
             groups fail with ENOSPC until space is freed (discards and write-zeroes still \
             work); free space or add OSDs",
            ids.join(", ")
        ));
    }
    if !nearfull.is_empty() {
        level = level.max(Health::Warn);
        let ids = nearfull;
        detail.push(format!(
            "{} nearfull (file system used at or above nearfull_ratio): writes fail with \
             ENOSPC once full_ratio is reached",
            ids.join(", ")
        ));
    }
    level
}

/// The OSD and placement-group part of [`health`].
fn io_health(map: &ClusterMap, pgs: &PgTable) -> (Health, Vec<String>) {
    let mut level = Health::Ok;
    let mut detail = Vec::new();
    if map.osds.is_empty() {
        return (
            Health::Err,
            vec![format!(
                "no OSDs: start at least {} flame-osd (pool.size)",
                map.pool.size
            )],
        );
    }
    let down: Vec<OsdId> = map.osds.values().filter(|o| !o.up).map(|o| o.id).collect();
    let out: Vec<OsdId> = map
        .osds
        .values()
        .filter(|o| !o.r#in)
        .map(|o| o.id)
        .collect();
    detail_osds(&mut detail, &down, "down");
    detail_osds(&mut detail, &out, "out (placement puts no data on it)");
    if !out.is_empty() || !down.is_empty() {
        level = level.max(Health::Warn);
    }
    let n_in = map.osds.values().filter(|o| o.r#in).count();
    let (size, min_size) = (map.pool.size as usize, map.pool.min_size as usize);
    // The level comes from the placement-group states below: groups whose old
    // homes are still complete can serve even with few OSDs in.
    if n_in < min_size {
        level = level.max(Health::Warn);
        detail.push(format!(
            "only {n_in} OSDs are in, fewer than pool.min_size {min_size}: placement \
             groups can only serve from complete copies on OSDs that are out"
        ));
    } else if n_in < size {
        level = level.max(Health::Warn);
        detail.push(format!(
            "only {n_in} OSDs are in, fewer than pool.size {size}: placement groups keep \
             fewer copies than asked for"
        ));
    }
    let h = crate::pg_status::pg_health(pgs, map);
    if !h.errors.is_empty() {
        level = Health::Err;
    }
    if !h.warnings.is_empty() {
        level = level.max(Health::Warn);
    }
    let blocked = !h.errors.is_empty();
    detail.extend(h.errors);
    if blocked {
        detail_blocked_volumes(&mut detail, map, &h.io_waits);
    }
    detail.extend(h.warnings);
    detail.extend(h.examples);
    (level, detail)
}

/// Appends, per volume with objects in a placement group whose I/O waits (the
/// groups of the error lines just before), how many
/// (bounded scan, see [`HEALTH_SCAN_OBJECTS_PER_VOLUME`]).
fn detail_blocked_volumes(detail: &mut Vec<String>, map: &ClusterMap, io_waits: &[bool]) {
    let object_size = u64::from(map.pool.object_size.max(1));
    let mut budget = HEALTH_SCAN_OBJECTS_TOTAL;
    let mut lines = Vec::new();
    let mut unscanned = 0usize;
    for vol in map.volumes.values() {
        let objects = vol.size.div_ceil(object_size);
        let scan = objects.min(HEALTH_SCAN_OBJECTS_PER_VOLUME);
        if scan > budget {
            unscanned += 1;
            continue;
        }
        budget -= scan;
        let hit = (0..scan)
            .filter(|&index| {
                let pg = flame_common::placement::object_pg(
                    flame_common::ids::ObjectId {
                        volume: vol.id,
                        index,
                    },
                    map.pool.pg_count,
                );
                io_waits.get(pg.0 as usize).copied().unwrap_or(false)
            })
            .count();
        if hit > 0 {
            let of = if scan < objects {
                format!("of its first {scan} objects (of {objects})")
            } else {
                format!("of its {objects} objects")
            };
            lines.push(format!(
                "volume {}: {hit} {of} are in those placement groups",
                vol.name
            ));
        }
    }
    let n = lines.len();
    detail.extend(lines.into_iter().take(DETAIL_VOLUMES_MAX));
    if n > DETAIL_VOLUMES_MAX {
        detail.push(format!("... and {} more volumes", n - DETAIL_VOLUMES_MAX));
    }
    if unscanned > 0 {
        detail.push(format!(
            "{unscanned} more volumes not checked (status scans at most \
             {HEALTH_SCAN_OBJECTS_TOTAL} objects)"
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state() -> ClusterState {
        let pool = PoolConfig {
            pg_count: 64,
            ..Default::default()
        };
        ClusterState::new(
            PersistedState::new_cluster("test-fsid".into(), pool),
            Instant::now(),
        )
    }

    fn boot_req(uuid: &str, port: u16, host: &str) -> OsdBoot {
        OsdBoot {
            fsid: None,
            uuid: uuid.into(),
            id: None,
            addr: format!("127.0.0.1:{port}").parse().unwrap(),
            shards: 2,
            host: host.into(),
            weight: 1.0,
            metrics_addr: None,
            incarnation: 1,
        }
    }

    fn hb(id: OsdId, uuid: &str) -> OsdHeartbeat {
        OsdHeartbeat {
            id,
            uuid: uuid.into(),
            epoch: Epoch(0),
            used_bytes: 10,
            capacity_bytes: 100,
            recovery: None,
            object_bytes: 5,
        }
    }

    #[test]
    fn full_and_nearfull_osds_are_in_the_map_and_in_health() {
        let mut s = state();
        let now = Instant::now();
        for (u, port, host) in [("a", 6900, "h1"), ("b", 6910, "h2"), ("c", 6920, "h3")] {
            s.boot(&boot_req(u, port, host), now).unwrap();
        }
        let a = s.map().osds.keys().next().copied().unwrap();
        let uuid = "a";
        let report = |s: &mut ClusterState, used: u64| {
            let mut h = hb(a, uuid);
            h.used_bytes = used;
            h.capacity_bytes = 1000;
            s.heartbeat(&h, now).unwrap();
        };
        report(&mut s, 500);
        let e0 = s.epoch();
        assert!(s.map().full_osds.is_empty() && s.map().nearfull_osds.is_empty());
        report(&mut s, 860);
        assert!(s.map().nearfull_osds.contains(&a));
        assert!(s.epoch() > e0, "a fullness change is a new epoch");
        let st = s.status(&PgTable::new(s.map()), Instant::now());
        assert_eq!(st.health, "HEALTH_WARN", "{:?}", st.health_detail);
        assert!(st.health_detail.iter().any(|d| d.contains("nearfull")));
        let e1 = s.epoch();
        report(&mut s, 870);
        assert_eq!(s.epoch(), e1, "no change, no epoch");
        report(&mut s, 950);
        assert!(s.map().full_osds.contains(&a) && !s.map().nearfull_osds.contains(&a));
        let st = s.status(&PgTable::new(s.map()), Instant::now());
        assert_eq!(st.health, "HEALTH_ERR", "{:?}", st.health_detail);
        assert!(
            st.health_detail
                .iter()
                .any(|d| d.contains("full") && d.contains("ENOSPC"))
        );
        report(&mut s, 100);
        assert!(s.map().full_osds.is_empty() && s.map().nearfull_osds.is_empty());
        assert_eq!(
            s.status(&PgTable::new(s.map()), Instant::now()).health,
            "HEALTH_OK"
        );
    }

    fn create(s: &mut ClusterState, name: &str, size: u64) -> Result<VolumeInfo, StateError> {
        s.create_volume(
            &VolumeCreate {
                name: name.into(),
                size,
            },
            1,
        )
    }

    #[test]
    fn boot_assigns_stable_ids_and_is_idempotent() {
        let mut s = state();
        let now = Instant::now();
        let e0 = s.epoch();
        let a = s.boot(&boot_req("u-a", 6900, "h1"), now).unwrap();
        let b = s.boot(&boot_req("u-b", 6910, "h2"), now).unwrap();
        assert_eq!((a, b), (OsdId(0), OsdId(1)));
        assert_eq!(s.epoch(), Epoch(e0.0 + 2));
        // Same boot again: same id, nothing changed, no epoch bump.
        let e = s.epoch();
        assert_eq!(s.boot(&boot_req("u-a", 6900, "h1"), now).unwrap(), a);
        assert_eq!(s.epoch(), e);
        // A changed address is a map change.
        assert_eq!(s.boot(&boot_req("u-a", 6920, "h1"), now).unwrap(), a);
        assert_eq!(s.epoch(), Epoch(e.0 + 1));
        assert_eq!(s.map().osds[&a].addr.port(), 6920);
        // The id asked for is ignored when the uuid is already bound.
        let mut req = boot_req("u-b", 6910, "h2");
        req.id = Some(OsdId(7));
        assert_eq!(s.boot(&req, now).unwrap(), b);
        s.persisted.check().unwrap();
    }

    /// A boot signed with OSD N's own key is N's and nobody else's: it gets id N
    /// (whatever id it asked for), and a data directory of another id, a new
    /// data directory while N is bound, and another OSD's address (even a down
    /// one's) are refused before anything is recorded.
    #[test]
    fn a_boot_signed_with_an_osds_own_key_is_that_osds_only() {
        let mut s = state();
        let now = Instant::now();
        // Key osd.5, fresh data directory: id 5, not the next free id (0).
        assert_eq!(
            s.boot_as(&boot_req("u-5", 6900, "h1"), Some(OsdId(5)), now)
                .unwrap(),
            OsdId(5)
        );
        assert_eq!(s.boot(&boot_req("u-x", 6910, "h2"), now).unwrap(), OsdId(6));
        // Again, and after a move to a free address: still 5.
        assert_eq!(
            s.boot_as(&boot_req("u-5", 6950, "h1"), Some(OsdId(5)), now)
                .unwrap(),
            OsdId(5)
        );
        let before = s.persisted.clone();
        let refused = |s: &mut ClusterState, req: &OsdBoot, key: u32, want: &str| {
            let e = s.boot_as(req, Some(OsdId(key)), now).unwrap_err();
            assert!(matches!(e, StateError::Conflict(_)), "{e:?}");
            assert!(e.to_string().contains(want), "{e}");
        };
        // osd.5's key on osd.6's data directory.
        refused(
            &mut s,
            &boot_req("u-x", 6910, "h2"),
            5,
            "registered as osd.6",
        );
        // osd.6's key on a new data directory: 6 is bound to u-x.
        refused(&mut s, &boot_req("u-new", 6990, "h3"), 6, "uuid u-x");
        // osd.5 at osd.6's address, while 6 is up and once it is down.
        refused(&mut s, &boot_req("u-5", 6910, "h1"), 5, "overlaps osd.6");
        s.persisted.map.osds.get_mut(&OsdId(6)).unwrap().up = false;
        let before_down = s.persisted.clone();
        refused(&mut s, &boot_req("u-5", 6911, "h1"), 5, "overlaps osd.6");
        assert_eq!(s.persisted, before_down, "a refused boot left a trace");
        s.persisted.map.osds.get_mut(&OsdId(6)).unwrap().up = true;
        assert_eq!(s.persisted, before);
        // Without an own key (the shared `osd` key) the down holder's address may
        // be taken, as before.
        s.persisted.map.osds.get_mut(&OsdId(6)).unwrap().up = false;
        assert_eq!(s.boot(&boot_req("u-y", 6910, "h4"), now).unwrap(), OsdId(7));
        s.persisted.check().unwrap();
    }

    #[test]
    fn boot_of_another_cluster_is_refused_before_anything_is_recorded() {
        let mut s = state();
        let now = Instant::now();
        let mut req = boot_req("u-foreign", 6900, "h1");
        req.fsid = Some("other-cluster".into());
        req.id = Some(OsdId(3));
        let before = s.persisted.clone();
        let err = s.boot(&req, now).unwrap_err();
        assert!(matches!(err, StateError::Conflict(_)), "{err:?}");
        assert!(err.to_string().contains("other-cluster"), "{err}");
        assert_eq!(s.persisted, before, "a refused boot left a trace");
        assert!(s.runtime.is_empty());
        // Its own fsid (a restarted member) and none (a fresh directory) are fine.
        req.fsid = Some("test-fsid".into());
        assert_eq!(s.boot(&req, now).unwrap(), OsdId(3));
        assert_eq!(
            s.boot(&boot_req("u-new", 6910, "h2"), now).unwrap(),
            OsdId(4)
        );
    }

    #[test]
    fn one_live_osd_per_address() {
        let mut s = state();
        let now = Instant::now();
        let a = s.boot(&boot_req("u-a", 6900, "h1"), now).unwrap();
        let e = s.epoch();
        // Same address, or overlapping shard ports (6900-6901 vs 6901-6902).
        for port in [6900, 6901, 6899] {
            let before = s.persisted.clone();
            let err = s.boot(&boot_req("u-b", port, "h2"), now).unwrap_err();
            assert!(matches!(err, StateError::Conflict(_)), "{err:?}");
            assert!(err.to_string().contains("which is up"), "{err}");
            assert_eq!(s.persisted, before);
        }
        // Adjacent ports and another IP are fine.
        s.boot(&boot_req("u-c", 6902, "h3"), now).unwrap();
        let mut other_ip = boot_req("u-d", 6900, "h4");
        other_ip.addr = "127.0.0.2:6900".parse().unwrap();
        s.boot(&other_ip, now).unwrap();
        // The holder re-booting at its own address is not a conflict.
        assert_eq!(s.boot(&boot_req("u-a", 6900, "h1"), now).unwrap(), a);
        assert!(s.epoch() > e);
        // Once the holder is down, a new OSD may take the address (a moved OSD) ...
        s.persisted.map.osds.get_mut(&a).unwrap().up = false;
        let b = s.boot(&boot_req("u-b", 6900, "h2"), now).unwrap();
        assert!(s.map().osds[&b].up);
        // ... and the old holder can no longer come up there: heartbeat and boot
        // are refused while the new one is up.
        let err = s.heartbeat(&hb(a, "u-a"), now).unwrap_err();
        assert!(matches!(err, StateError::NotFound(_)), "{err:?}");
        assert!(!s.map().osds[&a].up);
        assert!(matches!(
            s.boot(&boot_req("u-a", 6900, "h1"), now),
            Err(StateError::Conflict(_))
        ));
        assert!(!s.map().osds[&a].up);
        // At a new address it comes back.
        s.boot(&boot_req("u-a", 6950, "h1"), now).unwrap();
        assert!(s.map().osds[&a].up);
    }

    #[test]
    fn boot_honors_free_requested_id_and_never_reuses_ids() {
        let mut s = state();
        let now = Instant::now();
        let mut req = boot_req("u-a", 6900, "h1");
        req.id = Some(OsdId(5));
        assert_eq!(s.boot(&req, now).unwrap(), OsdId(5));
        // Next new OSD gets an id above every id handed out.
        assert_eq!(s.boot(&boot_req("u-b", 6910, "h"), now).unwrap(), OsdId(6));
        // Asking for a taken id gets a fresh one.
        let mut req = boot_req("u-c", 6920, "h");
        req.id = Some(OsdId(5));
        assert_eq!(s.boot(&req, now).unwrap(), OsdId(7));
        // Absurd ids are not honored.
        let mut req = boot_req("u-d", 6930, "h");
        req.id = Some(OsdId(u32::MAX));
        assert_eq!(s.boot(&req, now).unwrap(), OsdId(8));
        s.persisted.check().unwrap();
    }

    /// `n` OSDs on hosts h0.., booted and heartbeating at `now`, and a volume `v`.
    fn cluster_with_volume(n: u16, now: Instant) -> ClusterState {
        let mut s = state();
        for i in 0..n {
            let uuid = format!("u{i}");
            let id = s
                .boot(&boot_req(&uuid, 6900 + 10 * i, &format!("h{i}")), now)
                .unwrap();
            s.heartbeat(&hb(id, &uuid), now).unwrap();
        }
        create(&mut s, "v", 1 << 30).unwrap();
        s
    }

    /// Every epoch records which groups' roles it changed, so replicas can fence
    /// forwarded writes by interval: a volume changes none, an OSD going down
    /// exactly those it serves; a restarted manager goes on from the stored map.
    #[test]
    fn epochs_record_the_intervals_of_the_groups_whose_roles_changed() {
        let t0 = Instant::now();
        let mut s = cluster_with_volume(4, t0);
        let start = s.map().pg_intervals_from.expect("history kept");
        let before: Vec<Epoch> = (0..s.map().pool.pg_count)
            .map(|pg| s.map().interval_since(PgId(pg)))
            .collect();
        create(&mut s, "w", 1 << 20).unwrap();
        for (pg, since) in before.iter().enumerate() {
            assert_eq!(s.map().interval_since(PgId(pg as u32)), *since);
        }
        // OSD 1 misses its heartbeats and goes down.
        let later = t0 + s.heartbeat_grace + Duration::from_secs(1);
        for i in [0u32, 2, 3] {
            s.heartbeat(&hb(OsdId(i), &format!("u{i}")), later).unwrap();
        }
        assert_eq!(s.mark_down_silent(later, s.heartbeat_grace), vec![OsdId(1)]);
        let down_at = s.epoch();
        let table = PgTable::new(s.map());
        let mut changed = 0;
        for pg in 0..s.map().pool.pg_count {
            let served = table.pg(PgId(pg)).placed.contains(&OsdId(1));
            let since = s.map().interval_since(PgId(pg));
            assert_eq!(since == down_at, served, "pg {pg}");
            assert!(since >= start);
            changed += usize::from(served);
        }
        assert!(changed > 0);
        // A manager restarted from the stored state compares with that map.
        let mut s2 = ClusterState::new(s.persisted.clone(), later);
        create(&mut s2, "x", 1 << 20).unwrap();
        assert_eq!(
            s2.map().interval_since(PgId(0)),
            s.map().interval_since(PgId(0))
        );
        assert!(s2.map().pg_intervals.len() <= s2.map().pool.pg_count as usize);
    }

    fn all_complete(s: &ClusterState) -> Vec<Vec<OsdId>> {
        (0..s.map().pool.pg_count)
            .map(|pg| complete_copies(s.map(), PgId(pg)))
            .collect()
    }

    fn report(reporter: OsdId, epoch: Epoch, recovered: Vec<(PgId, OsdId)>) -> PgRecoveredReport {
        PgRecoveredReport {
            reporter,
            uuid: format!("u{}", reporter.0),
            epoch,
            recovered,
        }
    }

    /// The brief's rule for every placement-input change: the complete copies
    /// before the change are recorded after it, so nothing loses track of data.
    #[test]
    fn placement_changes_keep_track_of_data_and_new_osds_join_in() {
        let now = Instant::now();
        let mut s = cluster_with_volume(3, now);
        assert!(s.map().pg_complete.is_empty());
        let before = all_complete(&s);
        let e = s.epoch();
        // A new OSD joins `in` although a volume exists.
        let d = s.boot(&boot_req("u3", 6930, "h3"), now).unwrap();
        assert!(s.map().osds[&d].r#in, "new OSDs join in");
        assert_eq!(s.epoch(), Epoch(e.0 + 1));
        assert_eq!(all_complete(&s), before, "complete copies unchanged");
        let moved: Vec<PgId> = s.map().pg_complete.keys().copied().collect();
        assert!(!moved.is_empty() && moved.len() < 64, "{}", moved.len());
        for &pg in &moved {
            let m = PgMembers::compute(s.map(), pg);
            assert_eq!(m.recovering, vec![d], "{pg}: {m:?}");
            assert_eq!(m.acting.len(), 3, "old homes keep serving: {m:?}");
            assert!(m.active);
        }
        // Every other kind of change does the same.
        type Change = fn(&mut ClusterState);
        let changes: [(&str, Change); 4] = [
            ("out", |s| assert!(s.set_in(OsdId(1), false).unwrap())),
            ("in", |s| assert!(s.set_in(OsdId(1), true).unwrap())),
            ("reweight", |s| assert!(s.reweight(OsdId(0), 3.5).unwrap())),
            ("host move", |s| {
                let mut r = boot_req("u2", 6920, "h9");
                r.incarnation = 1;
                s.boot(&r, Instant::now()).unwrap();
            }),
        ];
        for (what, change) in changes {
            let before = all_complete(&s);
            let e = s.epoch();
            change(&mut s);
            assert_eq!(s.epoch(), Epoch(e.0 + 1), "{what}: one epoch");
            assert_eq!(all_complete(&s), before, "{what} moved data tracking");
            s.persisted.check().unwrap();
        }
        assert_eq!(s.map().osds[&OsdId(2)].host, "h9");
        assert_eq!(s.map().osds[&OsdId(0)].weight, 3.5);
        // The reweight survives the OSD restarting with its config weight.
        let mut r = boot_req("u0", 6900, "h0");
        r.incarnation = 7;
        s.boot(&r, now).unwrap();
        assert_eq!(s.map().osds[&OsdId(0)].weight, 3.5);
    }

    #[test]
    fn without_volumes_placement_changes_need_no_recovery() {
        let now = Instant::now();
        let mut s = state();
        for i in 0..4u16 {
            s.boot(
                &boot_req(&format!("u{i}"), 6900 + 10 * i, &format!("h{i}")),
                now,
            )
            .unwrap();
        }
        assert!(s.map().pg_complete.is_empty(), "bring-up moves no data");
        // A down OSD still counts as missing writes: a volume created now is
        // written without it.
        let later = now + Duration::from_secs(60);
        for i in [0u32, 2, 3] {
            s.heartbeat(&hb(OsdId(i), &format!("u{i}")), later).unwrap();
        }
        s.mark_down_silent(later, Duration::from_secs(1));
        assert!(!s.map().pg_complete.is_empty());
        s.boot(&boot_req("u9", 6990, "h9"), later).unwrap();
        let m = (0..64)
            .map(|pg| PgMembers::compute(s.map(), PgId(pg)))
            .find(|m| m.placed.contains(&OsdId(1)))
            .unwrap();
        assert!(m.down_complete.is_empty() && !m.acting.contains(&OsdId(1)));
    }

    #[test]
    fn operator_commands_validate_and_are_idempotent() {
        let now = Instant::now();
        let mut s = cluster_with_volume(4, now);
        let e = s.epoch();
        assert!(!s.set_in(OsdId(1), true).unwrap(), "already in");
        assert!(!s.reweight(OsdId(1), 1.0).unwrap(), "same weight");
        assert_eq!(s.epoch(), e, "no-ops bump nothing");
        for w in [-1.0, 100.5, f64::NAN, f64::INFINITY] {
            assert!(
                matches!(s.reweight(OsdId(1), w), Err(StateError::Invalid(_))),
                "{w}"
            );
        }
        assert!(s.reweight(OsdId(1), 100.0).unwrap());
        assert!(s.reweight(OsdId(1), 0.0).unwrap());
        for r in [
            s.set_in(OsdId(9), false).map(|_| ()),
            s.reweight(OsdId(9), 1.0).map(|_| ()),
            s.remove_osd(OsdId(9)).map(|_| ()),
        ] {
            let err = r.unwrap_err();
            assert!(matches!(err, StateError::NotFound(_)), "{err:?}");
            assert!(err.to_string().contains("osd.9"), "{err}");
        }
        // rm is refused while the OSD is up.
        let e = s.epoch();
        let err = s.remove_osd(OsdId(2)).unwrap_err();
        assert!(matches!(err, StateError::Conflict(_)), "{err:?}");
        assert!(err.to_string().contains("is up"), "{err}");
        assert_eq!(s.epoch(), e);
    }

    #[test]
    fn rm_removes_the_osd_everywhere_and_reports_lost_groups() {
        let now = Instant::now();
        let mut s = cluster_with_volume(4, now);
        let gone = OsdId(3);
        // One group whose only complete copy is on the OSD being removed.
        let victim = (0..64)
            .map(PgId)
            .find(|pg| pg_osds(s.map(), *pg).contains(&gone))
            .unwrap();
        s.persisted.map.pg_complete.insert(victim, vec![gone]);
        s.persisted.map.osds.get_mut(&gone).unwrap().up = false;
        let e = s.epoch();
        let lost = s.remove_osd(gone).unwrap();
        assert_eq!(lost, vec![victim]);
        assert_eq!(s.epoch(), Epoch(e.0 + 1));
        assert!(!s.map().osds.contains_key(&gone));
        assert!(!s.persisted.osd_uuids.values().any(|&id| id == gone));
        assert!(!s.persisted.osd_incarnations.contains_key(&gone));
        assert!(
            s.map().pg_complete.values().all(|c| !c.contains(&gone)),
            "{:?}",
            s.map().pg_complete
        );
        assert!(
            !s.map().pg_complete.contains_key(&victim),
            "a lost group starts again on its placed OSDs instead of waiting forever"
        );
        s.persisted.check().unwrap();
        // Its data directory comes back as a new OSD, with a new id.
        let id = s.boot(&boot_req("u3", 6930, "h3"), now).unwrap();
        assert_eq!(id, OsdId(4));
    }

    #[test]
    fn pg_recovered_records_members_and_skips_stale_entries() {
        let now = Instant::now();
        let mut s = cluster_with_volume(3, now);
        let d = s.boot(&boot_req("u3", 6930, "h3"), now).unwrap();
        let e = s.epoch();
        let moved: Vec<PgId> = s.map().pg_complete.keys().copied().collect();
        let (pg, other) = (moved[0], moved[1]);
        let m = PgMembers::compute(s.map(), pg);
        let primary = m.primary().unwrap();
        let not_primary = *m.acting.iter().find(|&&o| o != primary).unwrap();
        // Refused: bad uuid, too many entries, an epoch from the future.
        let mut r = report(primary, e, vec![(pg, d)]);
        r.uuid = "u-wrong".into();
        assert!(matches!(s.pg_recovered(&r), Err(StateError::NotFound(_))));
        let r = report(primary, e, vec![(pg, d); PG_RECOVERED_ENTRIES_MAX + 1]);
        assert!(matches!(s.pg_recovered(&r), Err(StateError::Invalid(_))));
        let r = report(primary, Epoch(e.0 + 1), vec![(pg, d)]);
        assert!(matches!(s.pg_recovered(&r), Err(StateError::Invalid(_))));
        // Skipped without error: not the primary, no such group, not recovering
        // there, a member that came up after the report's epoch.
        for r in [
            report(not_primary, e, vec![(pg, d)]),
            report(primary, e, vec![(PgId(64), d)]),
            report(primary, e, vec![(pg, not_primary)]),
            report(
                primary,
                Epoch(s.map().osds[&d].up_from.0 - 1),
                vec![(pg, d)],
            ),
        ] {
            assert_eq!(s.pg_recovered(&r).unwrap(), 0, "{r:?}");
        }
        assert_eq!(s.epoch(), e, "nothing changed, no epoch");
        // A valid batch: one epoch for all of it; the group is placed-complete,
        // so the record is dropped and the old home stops being a member.
        let old_home = *complete_copies(s.map(), pg)
            .iter()
            .find(|o| !m.placed.contains(o))
            .unwrap();
        let p2 = PgMembers::compute(s.map(), other).primary().unwrap();
        let mut batch = vec![(pg, d)];
        if p2 == primary {
            batch.push((other, d));
        }
        let r = report(primary, e, batch.clone());
        assert_eq!(s.pg_recovered(&r).unwrap(), batch.len() as u32);
        assert_eq!(s.epoch(), Epoch(e.0 + 1));
        assert!(!s.map().pg_complete.contains_key(&pg));
        let after = PgMembers::compute(s.map(), pg);
        assert!(!after.is_member(old_home) && after.is_clean(3), "{after:?}");
        // The same report again changes nothing.
        assert_eq!(s.pg_recovered(&r).unwrap(), 0);
        assert_eq!(s.epoch(), Epoch(e.0 + 1));
        s.persisted.check().unwrap();
    }

    #[test]
    fn pg_recovered_keeps_placed_order_until_every_placed_member_is_complete() {
        let now = Instant::now();
        let mut s = cluster_with_volume(5, now);
        // A group with two recovering members: both of its non-primary placed
        // OSDs missed writes (recorded by hand).
        let pg = PgId(7);
        let placed = pg_osds(s.map(), pg);
        let gone = OsdId((0..5).find(|i| !placed.contains(&OsdId(*i))).unwrap());
        s.persisted
            .map
            .pg_complete
            .insert(pg, vec![placed[0], gone]);
        let e = s.epoch();
        let r = report(placed[0], e, vec![(pg, placed[2])]);
        assert_eq!(s.pg_recovered(&r).unwrap(), 1);
        assert_eq!(
            s.map().pg_complete[&pg],
            vec![placed[0], placed[2], gone],
            "placed order first, then the others"
        );
        let r = report(placed[0], s.epoch(), vec![(pg, placed[1])]);
        assert_eq!(s.pg_recovered(&r).unwrap(), 1);
        assert!(
            !s.map().pg_complete.contains_key(&pg),
            "exactly the placed set"
        );
    }

    #[test]
    fn failure_reports_mark_down_with_enough_distinct_reporters() {
        let t0 = Instant::now();
        let mut s = cluster_with_volume(4, t0);
        s.heartbeat_grace = Duration::from_secs(6);
        let rep = |reporter: u32, failed: u32, s: &ClusterState| OsdFailureReport {
            reporter: OsdId(reporter),
            uuid: format!("u{reporter}"),
            failed: OsdId(failed),
            epoch: s.epoch(),
        };
        // 4xx: self, unknown, bad uuid.
        let r = rep(1, 1, &s);
        assert!(matches!(
            s.failure_report(&r, t0),
            Err(StateError::Invalid(_))
        ));
        let r = rep(1, 9, &s);
        assert!(matches!(
            s.failure_report(&r, t0),
            Err(StateError::NotFound(_))
        ));
        let mut r = rep(1, 0, &s);
        r.uuid = "u2".into();
        assert!(matches!(
            s.failure_report(&r, t0),
            Err(StateError::NotFound(_))
        ));
        let e = s.epoch();
        // One reporter, twice: not enough.
        assert!(!s.failure_report(&rep(1, 0, &s), t0).unwrap());
        assert!(!s.failure_report(&rep(1, 0, &s), t0).unwrap());
        assert_eq!(s.epoch(), e);
        // A report older than the grace has expired when the second arrives.
        let late = t0 + Duration::from_secs(7);
        assert!(!s.failure_report(&rep(2, 0, &s), late).unwrap());
        assert!(s.map().osds[&OsdId(0)].up);
        // A second distinct reporter within the grace: down, one epoch, and the
        // OSD missed writes where the group goes on.
        assert!(s.failure_report(&rep(3, 0, &s), late).unwrap());
        assert!(!s.map().osds[&OsdId(0)].up);
        assert_eq!(s.epoch(), Epoch(e.0 + 1));
        assert!(s.map().pg_complete.values().all(|c| !c.contains(&OsdId(0))));
        assert!(!s.map().pg_complete.is_empty());
        // Already down: nothing more.
        assert!(s.failure_report(&rep(1, 0, &s), late).unwrap());
        assert_eq!(s.epoch(), Epoch(e.0 + 1));
        // Down reporters do not count: osd.0 (down) + osd.1 against osd.2.
        let mut r = rep(0, 2, &s);
        r.epoch = s.epoch();
        assert!(!s.failure_report(&r, late).unwrap());
        assert!(!s.failure_report(&rep(1, 2, &s), late).unwrap());
        assert!(s.map().osds[&OsdId(2)].up);
        // A report made before the failed OSD's current incarnation came up is
        // about an earlier process.
        s.heartbeat(&hb(OsdId(0), "u0"), late).unwrap();
        let mut r = rep(1, 0, &s);
        r.epoch = Epoch(s.epoch().0 - 1);
        assert!(!s.failure_report(&r, late).unwrap());
        assert!(!s.failure_reports.contains_key(&OsdId(0)));
        // An OSD that still heartbeats keeps its lease: reports alone never take it
        // down (it would keep serving, and flap) ...
        s.heartbeat(&hb(OsdId(2), "u2"), late).unwrap();
        assert!(!s.failure_report(&rep(1, 2, &s), late).unwrap());
        assert!(!s.failure_report(&rep(3, 2, &s), late).unwrap());
        assert!(s.map().osds[&OsdId(2)].up);
        let e = s.epoch();
        let long = Duration::from_secs(600);
        assert_eq!(
            s.check_failures(late + Duration::from_secs(4), long, Duration::ZERO)
                .0,
            vec![]
        );
        // ... until it has been silent for the lease bound: then the next check
        // marks it down on the reports still standing.
        s.heartbeat(&hb(OsdId(0), "u0"), late + Duration::from_secs(5))
            .unwrap();
        s.heartbeat(&hb(OsdId(1), "u1"), late + Duration::from_secs(5))
            .unwrap();
        s.heartbeat(&hb(OsdId(3), "u3"), late + Duration::from_secs(5))
            .unwrap();
        assert_eq!(
            s.check_failures(late + Duration::from_secs(5), long, Duration::ZERO)
                .0,
            vec![OsdId(2)]
        );
        assert!(s.epoch() > e);
    }

    #[test]
    fn with_few_other_osds_every_one_of_them_must_report() {
        let now = Instant::now();
        let mut s = cluster_with_volume(2, now);
        s.min_down_reporters = 3;
        let r = OsdFailureReport {
            reporter: OsdId(1),
            uuid: "u1".into(),
            failed: OsdId(0),
            epoch: s.epoch(),
        };
        let later = now + Duration::from_secs(6);
        s.heartbeat(&hb(OsdId(1), "u1"), later).unwrap();
        assert!(
            s.failure_report(&r, later).unwrap(),
            "the only other OSD suffices"
        );
    }

    #[test]
    fn down_osds_go_out_after_the_interval() {
        let t0 = Instant::now();
        let mut s = cluster_with_volume(4, t0);
        let grace = Duration::from_secs(1);
        let out_after = Duration::from_secs(10);
        // osd.3 stops heartbeating; the others go on.
        let t1 = t0 + Duration::from_secs(2);
        for i in 0..3u32 {
            s.heartbeat(&hb(OsdId(i), &format!("u{i}")), t1).unwrap();
        }
        let e = s.epoch();
        assert_eq!(
            s.check_failures(t1, grace, out_after),
            (vec![OsdId(3)], vec![])
        );
        assert_eq!(s.epoch(), Epoch(e.0 + 1));
        for i in 0..3u32 {
            s.heartbeat(&hb(OsdId(i), &format!("u{i}")), t1 + out_after)
                .unwrap();
        }
        let almost = t1 + out_after - Duration::from_millis(1);
        assert_eq!(
            s.check_failures(almost, grace * 100, out_after),
            (vec![], vec![])
        );
        // Zero disables.
        assert_eq!(
            s.check_failures(t1 + out_after * 5, grace * 100, Duration::ZERO),
            (vec![], vec![])
        );
        // A manager restart starts the clock again.
        let mut restarted = ClusterState::new(s.persisted.clone(), t1 + out_after);
        assert_eq!(
            restarted.check_failures(t1 + out_after, grace * 100, out_after),
            (vec![], vec![])
        );
        assert_eq!(
            restarted.check_failures(t1 + out_after * 2, grace * 100, out_after),
            (vec![], vec![OsdId(3)])
        );
        let before = all_complete(&s);
        let e = s.epoch();
        assert_eq!(
            s.check_failures(t1 + out_after, grace * 100, out_after),
            (vec![], vec![OsdId(3)])
        );
        assert_eq!(s.epoch(), Epoch(e.0 + 1));
        assert!(!s.map().osds[&OsdId(3)].r#in);
        assert_eq!(all_complete(&s), before, "out keeps track of the data");
        // Already out: nothing more.
        assert_eq!(
            s.check_failures(t1 + out_after * 3, grace * 100, out_after),
            (vec![], vec![])
        );
        s.persisted.check().unwrap();
    }

    #[test]
    fn a_new_process_within_the_grace_is_recovered_before_it_serves() {
        let now = Instant::now();
        let mut s = cluster_with_volume(3, now);
        let e = s.epoch();
        // A retried boot of the same process changes nothing.
        s.boot(&boot_req("u1", 6910, "h1"), now).unwrap();
        assert_eq!(s.epoch(), e);
        // A new process (another incarnation) while still marked up.
        let mut r = boot_req("u1", 6910, "h1");
        r.incarnation = 2;
        s.boot(&r, now).unwrap();
        assert_eq!(s.epoch(), Epoch(e.0 + 1));
        let osd = &s.map().osds[&OsdId(1)];
        assert!(osd.up);
        assert_eq!(osd.up_from, s.epoch());
        assert_eq!(s.persisted.osd_incarnations[&OsdId(1)], 2);
        for pg in (0..64).map(PgId) {
            let m = PgMembers::compute(s.map(), pg);
            if m.placed.contains(&OsdId(1)) {
                assert_eq!(m.recovering, vec![OsdId(1)], "{pg}: {m:?}");
                assert!(m.active);
            }
        }
        // Its retries are idempotent again, also across a manager restart.
        let mut s = ClusterState::new(s.persisted.clone(), now);
        let e = s.epoch();
        s.boot(&r, now).unwrap();
        assert_eq!(s.epoch(), e);
    }

    #[test]
    fn a_heartbeat_back_from_down_starts_a_new_incarnation() {
        let t0 = Instant::now();
        let mut s = cluster_with_volume(3, t0);
        let grace = Duration::from_secs(1);
        for i in 0..2u32 {
            s.heartbeat(&hb(OsdId(i), &format!("u{i}")), t0 + grace * 2)
                .unwrap();
        }
        s.mark_down_silent(t0 + grace * 2, grace);
        let down_epoch = s.epoch();
        s.heartbeat(&hb(OsdId(2), "u2"), t0 + grace * 3).unwrap();
        assert_eq!(s.map().osds[&OsdId(2)].up_from, Epoch(down_epoch.0 + 1));
        assert_eq!(s.epoch(), Epoch(down_epoch.0 + 1));
    }

    #[test]
    fn removed_volumes_leave_bounded_tombstones() {
        let mut s = state();
        let v = create(&mut s, "a", 4096).unwrap();
        s.delete_volume("a").unwrap();
        assert!(s.map().deleted_volumes.contains(&v.id));
        s.persisted.check().unwrap();
        for i in 0..DELETED_VOLUMES_MAX + 5 {
            let name = format!("t{i}");
            create(&mut s, &name, 4096).unwrap();
            s.delete_volume(&name).unwrap();
        }
        let t = &s.map().deleted_volumes;
        assert_eq!(t.len(), DELETED_VOLUMES_MAX);
        assert!(!t.contains(&v.id), "the oldest are dropped");
        assert_eq!(t.last(), Some(&VolumeId(s.persisted.next_volume_id - 1)));
        s.persisted.check().unwrap();
        let mut p = s.persisted.clone();
        p.map.deleted_volumes.insert(VolumeId(p.next_volume_id));
        assert!(p.check().is_err(), "tombstone of an unissued id");
    }

    #[test]
    fn boot_keeps_out_and_validates() {
        let mut s = state();
        let now = Instant::now();
        let a = s.boot(&boot_req("u-a", 6900, "h1"), now).unwrap();
        s.persisted.map.osds.get_mut(&a).unwrap().r#in = false;
        s.persisted.map.osds.get_mut(&a).unwrap().up = false;
        let e = s.epoch();
        s.boot(&boot_req("u-a", 6900, "h1"), now).unwrap();
        assert!(!s.map().osds[&a].r#in, "out must survive a reboot");
        assert!(s.map().osds[&a].up);
        assert_eq!(s.epoch(), Epoch(e.0 + 1));

        let bad = |f: &dyn Fn(&mut OsdBoot)| {
            let mut r = boot_req("u-x", 7000, "h");
            f(&mut r);
            let mut s2 = s.clone();
            let e = s2.epoch();
            assert!(
                matches!(s2.boot(&r, now), Err(StateError::Invalid(_))),
                "{r:?}"
            );
            assert_eq!(s2.epoch(), e);
        };
        bad(&|r| r.shards = 0);
        bad(&|r| r.shards = 257);
        bad(&|r| r.weight = f64::NAN);
        bad(&|r| r.weight = f64::INFINITY);
        bad(&|r| r.weight = -1.0);
        bad(&|r| r.weight = 1e300);
        bad(&|r| r.weight = OSD_WEIGHT_MAX + 1.0);
        bad(&|r| r.host = String::new());
        bad(&|r| r.host = "h".repeat(65));
        bad(&|r| r.uuid = String::new());
        bad(&|r| r.uuid = "u".repeat(65));
        bad(&|r| r.addr = "0.0.0.0:6900".parse().unwrap());
        bad(&|r| r.addr = "127.0.0.1:0".parse().unwrap());
        bad(&|r| r.addr = "127.0.0.1:65535".parse().unwrap());
        // Limits themselves are fine.
        let mut r = boot_req("u".repeat(64).as_str(), 6000, &"h".repeat(64));
        r.shards = 256;
        r.weight = 0.0;
        s.boot(&r, now).unwrap();
    }

    #[test]
    fn heartbeat_rules() {
        let mut s = state();
        let t0 = Instant::now();
        let a = s.boot(&boot_req("u-a", 6900, "h1"), t0).unwrap();
        let e = s.epoch();
        s.heartbeat(&hb(a, "u-a"), t0).unwrap();
        assert_eq!(s.epoch(), e, "heartbeat of an up OSD changes no map");
        assert!(matches!(
            s.heartbeat(&hb(OsdId(9), "u-a"), t0),
            Err(StateError::NotFound(_))
        ));
        assert!(matches!(
            s.heartbeat(&hb(a, "u-other"), t0),
            Err(StateError::NotFound(_))
        ));
        // Silence past the grace → down, one epoch.
        let grace = Duration::from_millis(100);
        assert!(s.mark_down_silent(t0 + grace, grace).is_empty());
        assert_eq!(
            s.mark_down_silent(t0 + Duration::from_millis(101), grace),
            vec![a]
        );
        assert!(!s.map().osds[&a].up);
        assert!(s.map().osds[&a].r#in, "failure detection never marks out");
        assert_eq!(s.epoch(), Epoch(e.0 + 1));
        // Already down: no further bumps.
        assert!(s.mark_down_silent(t0 + grace * 10, grace).is_empty());
        assert_eq!(s.epoch(), Epoch(e.0 + 1));
        // A heartbeat brings it back up.
        s.heartbeat(&hb(a, "u-a"), t0 + grace * 10).unwrap();
        assert!(s.map().osds[&a].up);
        assert_eq!(s.epoch(), Epoch(e.0 + 2));
        let st = s.osd_statuses(&PgTable::new(s.map()), t0 + grace * 10);
        assert_eq!(st[0].used_bytes, 10);
        assert_eq!(st[0].capacity_bytes, 100);
        assert_eq!(st[0].last_heartbeat_ms_ago, Some(0));
    }

    #[test]
    fn restart_gives_every_osd_a_grace_period() {
        let mut s = state();
        let t0 = Instant::now();
        s.boot(&boot_req("u-a", 6900, "h1"), t0).unwrap();
        // Manager restarts much later: the OSD is not down yet.
        let t1 = t0 + Duration::from_secs(3600);
        let mut s = ClusterState::new(s.persisted.clone(), t1);
        let grace = Duration::from_secs(6);
        assert!(s.mark_down_silent(t1 + grace, grace).is_empty());
        let st = s.osd_statuses(&PgTable::new(s.map()), t1);
        assert_eq!(st[0].last_heartbeat_ms_ago, None);
        assert_eq!(s.mark_down_silent(t1 + grace * 2, grace), vec![OsdId(0)]);
    }

    #[test]
    fn volume_operations() {
        let mut s = state();
        let e = s.epoch();
        let v = create(&mut s, "a", 1 << 30).unwrap();
        assert_eq!(v.id, VolumeId(1));
        assert_eq!(s.epoch(), Epoch(e.0 + 1));
        assert!(matches!(
            create(&mut s, "a", 4096),
            Err(StateError::Conflict(_))
        ));
        for (name, size) in [
            ("b", 0),
            ("b", 1000),
            ("b", VOLUME_SIZE_MAX + 512),
            ("", 4096),
            ("bad/name", 4096),
        ] {
            assert!(
                matches!(create(&mut s, name, size), Err(StateError::Invalid(_))),
                "{name} {size}"
            );
        }
        assert_eq!(s.epoch(), Epoch(e.0 + 1), "refused ops bump nothing");
        create(&mut s, "max", VOLUME_SIZE_MAX).unwrap();
        // Deleted ids are never reused.
        let d = s.delete_volume("a").unwrap();
        assert_eq!(d.id, VolumeId(1));
        assert!(matches!(s.delete_volume("a"), Err(StateError::NotFound(_))));
        let again = create(&mut s, "a", 4096).unwrap();
        assert_eq!(again.id, VolumeId(3));
        s.persisted.check().unwrap();
    }

    #[test]
    fn resize_rules() {
        let mut s = state();
        create(&mut s, "v", 1 << 20).unwrap();
        let e = s.epoch();
        let rs = |size, allow_shrink| VolumeResize { size, allow_shrink };
        // Same size: no change, no bump.
        assert_eq!(
            s.resize_volume("v", &rs(1 << 20, false)).unwrap().size,
            1 << 20
        );
        assert_eq!(s.epoch(), e);
        // Grow.
        assert_eq!(
            s.resize_volume("v", &rs(2 << 20, false)).unwrap().size,
            2 << 20
        );
        assert_eq!(s.epoch(), Epoch(e.0 + 1));
        // Shrink needs the flag, and says so.
        let err = s.resize_volume("v", &rs(1 << 20, false)).unwrap_err();
        assert!(err.to_string().contains("allow_shrink"), "{err}");
        assert_eq!(s.map().volumes["v"].size, 2 << 20);
        assert_eq!(s.resize_volume("v", &rs(512, true)).unwrap().size, 512);
        assert_eq!(s.epoch(), Epoch(e.0 + 2));
        assert!(matches!(
            s.resize_volume("v", &rs(0, true)),
            Err(StateError::Invalid(_))
        ));
        assert!(matches!(
            s.resize_volume("nope", &rs(512, true)),
            Err(StateError::NotFound(_))
        ));
    }

    #[test]
    fn health_levels() {
        let mut s = state();
        let now = Instant::now();
        let h = |s: &ClusterState| {
            let st = st_of(s);
            (st.health, st.health_detail)
        };
        assert_eq!(h(&s).0, "HEALTH_ERR", "no OSDs at all");
        s.boot(&boot_req("a", 6900, "h1"), now).unwrap();
        // One OSD: one copy, below min_size 2: every group's I/O waits.
        let (lvl, detail) = h(&s);
        assert_eq!(lvl, "HEALTH_ERR", "{detail:?}");
        assert!(
            detail.iter().any(|d| d.starts_with(
                "64 of 64 placement groups have fewer than pool.min_size 2 complete \
                     copies up: I/O to them waits"
            )),
            "{detail:?}"
        );
        s.boot(&boot_req("b", 6910, "h2"), now).unwrap();
        // Two of three copies: min_size is met, I/O is served, redundancy is low.
        let (lvl, detail) = h(&s);
        assert_eq!(lvl, "HEALTH_WARN", "{detail:?}");
        assert!(
            detail.iter().any(|d| d.contains("fewer than pool.size")),
            "{detail:?}"
        );
        assert!(
            detail
                .iter()
                .any(|d| d.starts_with("64 of 64 placement groups are degraded")),
            "{detail:?}"
        );
        s.boot(&boot_req("c", 6920, "h3"), now).unwrap();
        assert_eq!(h(&s), ("HEALTH_OK".to_string(), vec![]));
        let st = st_of(&s);
        assert_eq!(st.pgs_by_state.get("active+clean"), Some(&64));
        assert_eq!(st.pg_summary.clean, 64);
        // Out (but up) OSD: placement puts nothing there; with only 2 in, degraded.
        s.persisted.map.osds.get_mut(&OsdId(2)).unwrap().r#in = false;
        let (lvl, detail) = h(&s);
        assert_eq!(lvl, "HEALTH_WARN", "{detail:?}");
        assert!(detail.contains(&"osd.2 is out (placement puts no data on it)".to_string()));
        s.persisted.map.osds.get_mut(&OsdId(2)).unwrap().r#in = true;
        s.boot(&boot_req("d", 6930, "h4"), now).unwrap();
        s.persisted.map.osds.get_mut(&OsdId(3)).unwrap().r#in = false;
        let (lvl, detail) = h(&s);
        assert_eq!(lvl, "HEALTH_WARN", "out with enough in: {detail:?}");
    }

    /// The status of `s` now, with its placement table.
    fn st_of(s: &ClusterState) -> ClusterStatus {
        s.status(&PgTable::new(s.map()), Instant::now())
    }

    /// Health says what happens to I/O as OSDs go down, with the true counts from
    /// the placement-group states: one OSD down (its groups carry on without it,
    /// the manager's rule) is a warning, I/O continues; a second one down puts the
    /// groups that had both below min_size: an error, I/O to them waits, and the
    /// volumes with objects there are named. Back up, the first OSD's groups
    /// recover.
    /// Two of three copies go down in one check, then one comes back: the group
    /// is active again and takes writes, so the copy still down must no longer
    /// count as complete — else it would serve stale data when it returns.
    #[test]
    fn a_copy_still_down_stops_being_complete_when_its_group_resumes() {
        let mut s = state();
        let t0 = Instant::now();
        let uuids = ["a", "b", "c"];
        for (i, u) in uuids.iter().enumerate() {
            let id = s
                .boot(&boot_req(u, 6900 + 10 * i as u16, &format!("h{i}")), t0)
                .unwrap();
            s.heartbeat(&hb(id, u), t0).unwrap();
        }
        create(&mut s, "v", 64 << 20).unwrap();
        let grace = Duration::from_secs(5);
        let t1 = t0 + grace * 2;
        s.heartbeat(&hb(OsdId(0), "a"), t1).unwrap();
        assert_eq!(s.mark_down_silent(t1, grace), vec![OsdId(1), OsdId(2)]);
        let table = PgTable::new(s.map());
        for (pg, m) in table.iter() {
            assert!(!m.active, "{pg} active with one copy up");
        }
        // osd.1 comes back: every group is active with osd.0 and osd.1.
        s.heartbeat(&hb(OsdId(1), "b"), t1).unwrap();
        let table = PgTable::new(s.map());
        for (pg, m) in table.iter() {
            assert!(m.active, "{pg} inactive: {m:?}");
            assert!(
                !complete_copies(s.map(), pg).contains(&OsdId(2)),
                "{pg}: osd.2 is down and misses writes, yet counts as complete"
            );
        }
        s.persisted.check().unwrap();
    }

    #[test]
    fn health_says_what_happens_when_osds_go_down() {
        let mut s = state();
        let t0 = Instant::now();
        let uuids = ["a", "b", "c", "d"];
        for (i, u) in uuids.iter().enumerate() {
            let id = s
                .boot(&boot_req(u, 6900 + 10 * i as u16, &format!("h{i}")), t0)
                .unwrap();
            s.heartbeat(&hb(id, u), t0).unwrap();
        }
        create(&mut s, "vol-x", 64 << 20).unwrap();
        let grace = Duration::from_secs(5);
        let beat_all_but = |s: &mut ClusterState, silent: &[u32], at: Instant| {
            for (i, u) in uuids.iter().enumerate() {
                if !silent.contains(&(i as u32)) {
                    s.heartbeat(&hb(OsdId(i as u32), u), at).unwrap();
                }
            }
        };
        let t1 = t0 + grace * 2;
        beat_all_but(&mut s, &[1], t1);
        assert_eq!(s.mark_down_silent(t1, grace), vec![OsdId(1)]);
        let table = PgTable::new(s.map());
        let holding = table
            .iter()
            .filter(|(_, m)| m.placed.contains(&OsdId(1)))
            .count();
        assert!(holding > 0);
        let st = s.status(&table, t1);
        assert_eq!(st.health, "HEALTH_WARN", "{:?}", st.health_detail);
        assert_eq!(st.pg_summary.degraded as usize, holding);
        assert_eq!(st.pg_summary.inactive, 0);
        assert_eq!(
            st.pgs_by_state.get("active+degraded").copied().unwrap_or(0) as usize,
            holding,
            "{:?}",
            st.pgs_by_state
        );
        let line = st
            .health_detail
            .iter()
            .find(|d| d.contains("degraded"))
            .unwrap_or_else(|| panic!("{:?}", st.health_detail));
        assert!(
            line == &format!(
                "{holding} of 64 placement groups are degraded (fewer than pool.size 3 \
                 complete copies up): I/O goes on with the copies that are up"
            ),
            "{line}"
        );
        assert!(st.health_detail.contains(&"osd.1 is down".to_string()));

        // A second OSD down: groups that had both are left with one complete copy.
        let t2 = t1 + grace * 2;
        beat_all_but(&mut s, &[1, 2], t2);
        assert_eq!(s.mark_down_silent(t2, grace), vec![OsdId(2)]);
        let table = PgTable::new(s.map());
        let both = table
            .iter()
            .filter(|(_, m)| m.placed.contains(&OsdId(1)) && m.placed.contains(&OsdId(2)))
            .count();
        assert!(both > 0);
        let st = s.status(&table, t2);
        assert_eq!(st.health, "HEALTH_ERR", "{:?}", st.health_detail);
        assert_eq!(
            st.pg_summary.inactive as usize, both,
            "{:?}",
            st.pgs_by_state
        );
        let line = st
            .health_detail
            .iter()
            .find(|d| d.contains("inactive"))
            .unwrap_or_else(|| panic!("{:?}", st.health_detail));
        assert!(
            line.starts_with(&format!(
                "{both} of 64 placement groups have fewer than pool.min_size 2 complete \
                 copies up: I/O to them waits (no error, no stale data)"
            )),
            "{line}"
        );
        assert!(
            st.health_detail
                .iter()
                .any(|d| d.starts_with("inactive placement groups: pg.")
                    && d.contains("waiting for osd.2")),
            "{:?}",
            st.health_detail
        );
        // Which volumes: vol-x has 16 objects of 4 MiB.
        let want = (0..16)
            .filter(|&index| {
                let pg = flame_common::placement::object_pg(
                    flame_common::ids::ObjectId {
                        volume: VolumeId(1),
                        index,
                    },
                    64,
                );
                !table.pg(pg).active
            })
            .count();
        if want > 0 {
            assert!(
                st.health_detail.contains(&format!(
                    "volume vol-x: {want} of its 16 objects are in those placement groups"
                )),
                "{:?}",
                st.health_detail
            );
        }

        // Both back. osd.2 stayed complete where its group waited for it (no write
        // could be acknowledged without it) and serves there at once; everywhere
        // else each of them missed writes and is recovered.
        let t3 = t2 + grace;
        beat_all_but(&mut s, &[], t3);
        let table = PgTable::new(s.map());
        let st = s.status(&table, t3);
        let either = table
            .iter()
            .filter(|(_, m)| m.placed.contains(&OsdId(1)) || m.placed.contains(&OsdId(2)))
            .count();
        assert_eq!(st.pg_summary.inactive, 0, "{:?}", st.pgs_by_state);
        assert_eq!(
            st.pg_summary.recovering as usize, either,
            "{:?}",
            st.pgs_by_state
        );
        assert_eq!(
            st.pgs_by_state
                .get("active+recovering+degraded")
                .copied()
                .unwrap_or(0) as usize,
            st.pg_summary.degraded as usize,
            "{:?}",
            st.pgs_by_state
        );
        assert_eq!(st.health, "HEALTH_WARN", "{:?}", st.health_detail);
        assert!(
            st.health_detail
                .iter()
                .any(|d| d.starts_with("recovering placement groups: pg.")
                    && d.contains("osd.1 from osd.")),
            "{:?}",
            st.health_detail
        );
    }

    #[test]
    fn shrink_records_a_pending_trim_that_blocks_growth() {
        let mut s = state();
        let v = create(&mut s, "v", 8 << 20).unwrap();
        let rs = |size, allow_shrink| VolumeResize { size, allow_shrink };
        let e = s.epoch();
        s.resize_volume("v", &rs(4 << 20, true)).unwrap();
        assert_eq!(
            s.epoch(),
            Epoch(e.0 + 1),
            "shrink and its pending trim: one epoch"
        );
        let want = TrimRange {
            from: 4 << 20,
            to: 8 << 20,
        };
        assert_eq!(s.volume_trim("v").unwrap().pending, Some(want));
        s.persisted.check().unwrap();
        // Growing is refused while the old bytes may remain.
        let err = s.resize_volume("v", &rs(16 << 20, false)).unwrap_err();
        assert!(matches!(err, StateError::Conflict(_)), "{err:?}");
        assert!(err.to_string().contains("--allow-shrink"), "{err}");
        assert_eq!(s.map().volumes["v"].size, 4 << 20);
        // A second shrink widens the range down to the new end.
        s.resize_volume("v", &rs(1 << 20, true)).unwrap();
        let want = TrimRange {
            from: 1 << 20,
            to: 8 << 20,
        };
        assert_eq!(s.volume_trim("v").unwrap().pending, Some(want));
        // Health says so.
        let st = st_of(&s);
        assert!(
            st.health_detail
                .iter()
                .any(|d| d.contains("volume v was shrunk")),
            "{:?}",
            st.health_detail
        );
        // A report that covers less (made before the second shrink) clears nothing.
        let done = |from, to| TrimDone {
            volume: v.id,
            range: TrimRange { from, to },
        };
        let e = s.epoch();
        assert!(
            s.trim_done("v", &done(4 << 20, 8 << 20))
                .unwrap()
                .pending
                .is_some()
        );
        assert_eq!(s.epoch(), e);
        // Another volume id (removed and re-created) is refused.
        assert!(matches!(
            s.trim_done(
                "v",
                &TrimDone {
                    volume: VolumeId(99),
                    range: want
                }
            ),
            Err(StateError::Conflict(_))
        ));
        assert!(
            s.trim_done("v", &done(1 << 20, 8 << 20))
                .unwrap()
                .pending
                .is_none()
        );
        assert_eq!(s.epoch(), Epoch(e.0 + 1));
        s.persisted.check().unwrap();
        // Now it may grow.
        assert_eq!(
            s.resize_volume("v", &rs(16 << 20, false)).unwrap().size,
            16 << 20
        );
        // Deleting a volume drops its pending trim.
        s.resize_volume("v", &rs(1 << 20, true)).unwrap();
        s.delete_volume("v").unwrap();
        assert!(s.persisted.pending_trims.is_empty());
        s.persisted.check().unwrap();
    }

    #[test]
    fn status_sums_and_pg_counts() {
        let mut s = state();
        let now = Instant::now();
        for (i, u) in ["a", "b", "c", "d"].iter().enumerate() {
            let id = s
                .boot(&boot_req(u, 6900 + 10 * i as u16, &format!("h{i}")), now)
                .unwrap();
            s.heartbeat(&hb(id, u), now).unwrap();
        }
        create(&mut s, "x", 4096).unwrap();
        create(&mut s, "y", 8192).unwrap();
        let acting = PgTable::new(s.map());
        let st = s.status(&acting, now);
        assert_eq!(st.provisioned_bytes, 4096 + 8192);
        assert_eq!(st.used_bytes, 40);
        assert_eq!(st.capacity_bytes, 400);
        assert_eq!((st.osds, st.osds_up, st.osds_in, st.volumes), (4, 4, 4, 2));
        let osds = s.osd_statuses(&acting, now);
        let total: u32 = osds.iter().map(|o| o.pgs).sum();
        assert_eq!(total, 64 * 3, "each of 64 PGs has 3 copies");
        assert!(osds.iter().all(|o| o.pgs > 0));
    }

    /// Until an OSD's first heartbeat since the manager started, its usage is not
    /// known: status counts it as waiting instead of adding a made-up 0.
    #[test]
    fn usage_is_unknown_until_the_first_heartbeat_after_a_manager_start() {
        let mut s = state();
        let now = Instant::now();
        let a = s.boot(&boot_req("a", 6900, "h1"), now).unwrap();
        let b = s.boot(&boot_req("b", 6910, "h2"), now).unwrap();
        let st = st_of(&s);
        assert_eq!((st.osds_up, st.osds_awaiting_first_report), (2, 2));
        assert!(
            s.osd_statuses(&PgTable::new(s.map()), now)
                .iter()
                .all(|o| o.awaiting_first_report)
        );
        s.heartbeat(&hb(a, "a"), now).unwrap();
        assert_eq!(st_of(&s).osds_awaiting_first_report, 1);
        let osds = s.osd_statuses(&PgTable::new(s.map()), now);
        assert!(!osds[0].awaiting_first_report && osds[1].awaiting_first_report);
        s.heartbeat(&hb(b, "b"), now).unwrap();
        assert_eq!(st_of(&s).osds_awaiting_first_report, 0);
        // A manager restart forgets every report: all are waiting again, though the
        // map still says up.
        let s = ClusterState::new(s.persisted.clone(), now);
        let st = st_of(&s);
        assert_eq!((st.osds_up, st.osds_awaiting_first_report), (2, 2));
        assert_eq!(st.used_bytes, 0);
    }

    #[test]
    fn check_catches_inconsistency() {
        let mut s = state();
        s.boot(&boot_req("a", 6900, "h1"), Instant::now()).unwrap();
        s.persisted.check().unwrap();
        let mut p = s.persisted.clone();
        p.next_osd_id = 0;
        assert!(p.check().is_err());
        let mut p = s.persisted.clone();
        p.format = 99;
        assert!(p.check().unwrap_err().contains("format"));
        let mut p = s.persisted.clone();
        p.osd_uuids.clear();
        assert!(p.check().is_err());
    }
}
