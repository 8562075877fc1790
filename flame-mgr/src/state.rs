//! Cluster state and every operation on it.
//!
//! This module is pure logic: no I/O, no clocks, no locks. Each operation takes the
//! current time as an argument, mutates a [`ClusterState`] and reports errors as
//! [`StateError`]; the HTTP layer decides when to persist and publish. That keeps
//! every rule (ids, epochs, validation, health) unit-testable without a server.
//!
//! Invariant the persistence layer relies on: **an operation changes
//! [`PersistedState`] if and only if it bumps the map epoch** (by exactly one). So
//! "epoch changed" is the signal to write `state.json`, and runtime-only updates
//! (heartbeat timestamps and usage figures) never cost a disk write.

use flame_common::ids::{Epoch, OsdId, PgId, VolumeId};
use flame_common::map::{
    ClusterMap, OsdInfo, PoolConfig, VOLUME_SIZE_MAX, VolumeInfo, validate_volume_name,
};
use flame_common::mgr_api::{
    ClusterStatus, OsdBoot, OsdHeartbeat, OsdStatus, VolumeCreate, VolumeResize,
};
use flame_common::placement::pg_osds;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};
use tracing::{info, warn};

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
}

impl PersistedState {
    /// State of a brand-new cluster: no OSDs, no volumes, epoch 1.
    pub fn new_cluster(fsid: String, pool: PoolConfig) -> Self {
        PersistedState {
            format: STATE_FORMAT,
            map: ClusterMap::new(fsid, pool),
            osd_uuids: BTreeMap::new(),
            next_osd_id: 0,
            next_volume_id: 1,
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
}

/// The manager's whole in-memory state: the persisted part plus heartbeat data.
#[derive(Clone, Debug)]
pub struct ClusterState {
    /// What `state.json` holds.
    pub persisted: PersistedState,
    /// Heartbeat data by OSD; every OSD in the map has an entry.
    runtime: BTreeMap<OsdId, OsdRuntime>,
    /// `MgrConfig::new_osds_in_with_volumes`.
    pub new_osds_in_with_volumes: bool,
}

impl ClusterState {
    /// Wraps a loaded (or new) state. Every OSD counts as heard from at `now`, so
    /// OSDs get a full grace period to reach a restarted manager before they are
    /// marked down.
    pub fn new(persisted: PersistedState, now: Instant) -> Self {
        let runtime = persisted
            .map
            .osds
            .keys()
            .map(|&id| {
                (
                    id,
                    OsdRuntime {
                        last_heartbeat: now,
                        heard: false,
                        used_bytes: 0,
                        capacity_bytes: 0,
                        usage_reported: false,
                    },
                )
            })
            .collect();
        ClusterState {
            persisted,
            runtime,
            new_osds_in_with_volumes: false,
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

    fn bump_epoch(&mut self) {
        let e = &mut self.persisted.map.epoch;
        *e = Epoch(e.0.saturating_add(1));
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
    pub fn boot(&mut self, req: &OsdBoot, now: Instant) -> Result<OsdId, StateError> {
        validate_boot(req)?;
        let known = self.persisted.osd_uuids.get(&req.uuid).copied();
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
                let id = match req.id {
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
        let old = self.persisted.map.osds.get(&id);
        // Placement inputs (in, host, weight) must not change under existing data:
        // there is no backfill yet, so a placement group moved to an OSD that lacks
        // its objects would read back zeroes. While any volume exists, a new OSD
        // joins `out`, and a known OSD keeps the host and weight it registered with
        // (a changed value in its config is logged and ignored).
        let has_data = !self.persisted.map.volumes.is_empty() && !self.new_osds_in_with_volumes;
        let (host, weight) = match old {
            Some(o) if has_data && (o.host != req.host || o.weight != req.weight) => {
                warn!(
                    "{id} booted with host {:?} weight {} but keeps host {:?} weight {}: \
                     changing placement under existing volumes needs data movement (not \
                     implemented yet)",
                    req.host, req.weight, o.host, o.weight
                );
                (o.host.clone(), o.weight)
            }
            _ => (req.host.clone(), req.weight),
        };
        let r#in = match old {
            // An operator's "out" must survive the OSD restarting.
            Some(o) => o.r#in,
            None if has_data => {
                warn!(
                    "new OSD {id} joins OUT: volumes exist and moving their placement \
                     groups to it needs data movement (not implemented yet)"
                );
                false
            }
            None => true,
        };
        let info = OsdInfo {
            id,
            addr: req.addr,
            shards: req.shards,
            host,
            weight,
            up: true,
            r#in,
            metrics_addr: req.metrics_addr,
        };
        if old != Some(&info) {
            if old.is_some_and(|o| !o.up) {
                info!("{id} booted: marked up");
            }
            self.persisted.map.osds.insert(id, info);
            self.bump_epoch();
        }
        let rt = self.runtime.entry(id).or_insert(OsdRuntime {
            last_heartbeat: now,
            heard: true,
            used_bytes: 0,
            capacity_bytes: 0,
            usage_reported: false,
        });
        rt.last_heartbeat = now;
        rt.heard = true;
        Ok(id)
    }

    /// Records a heartbeat (`POST /v1/osd/heartbeat`); a down OSD comes back up.
    ///
    /// An id the manager does not know, or a uuid that does not match it, is
    /// `NotFound`: the sender is a stale process or the manager's state was
    /// replaced, and the OSD's answer to 404 is to boot again.
    pub fn heartbeat(&mut self, hb: &OsdHeartbeat, now: Instant) -> Result<(), StateError> {
        let bound = self.persisted.osd_uuids.get(&hb.uuid).copied();
        let osd = match self.persisted.map.osds.get_mut(&hb.id) {
            Some(osd) if bound == Some(hb.id) => osd,
            Some(_) => {
                return Err(StateError::NotFound(format!(
                    "{} is registered with another uuid; boot again",
                    hb.id
                )));
            }
            None => {
                return Err(StateError::NotFound(format!(
                    "{} is not registered; boot again",
                    hb.id
                )));
            }
        };
        let came_up = !osd.up;
        osd.up = true;
        let rt = self.runtime.entry(hb.id).or_insert(OsdRuntime {
            last_heartbeat: now,
            heard: true,
            used_bytes: 0,
            capacity_bytes: 0,
            usage_reported: false,
        });
        rt.last_heartbeat = now;
        rt.heard = true;
        rt.used_bytes = hb.used_bytes;
        rt.capacity_bytes = hb.capacity_bytes;
        rt.usage_reported = true;
        if came_up {
            info!("{} heartbeat: marked up", hb.id);
            self.bump_epoch();
        }
        Ok(())
    }

    /// Marks down every up OSD not heard from for longer than `grace`, in one epoch,
    /// and returns their ids.
    ///
    /// OSDs are never marked out here: taking an OSD out moves its placement groups,
    /// which is only safe once recovery can copy the data (a later issue). Until
    /// then, I/O to a down OSD's placement groups waits for it to return.
    pub fn mark_down_silent(&mut self, now: Instant, grace: Duration) -> Vec<OsdId> {
        let mut down = Vec::new();
        for (id, osd) in self.persisted.map.osds.iter_mut() {
            if !osd.up {
                continue;
            }
            let silent = self
                .runtime
                .get(id)
                .is_none_or(|rt| now.saturating_duration_since(rt.last_heartbeat) > grace);
            if silent {
                osd.up = false;
                down.push(*id);
            }
        }
        if !down.is_empty() {
            self.bump_epoch();
        }
        down
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
        if req.size < vol.size && !req.allow_shrink {
            return Err(StateError::Invalid(format!(
                "shrinking volume {name} from {} to {} bytes discards the data past the new end; \
                 pass allow_shrink=true (flame-admin: --allow-shrink) to confirm",
                vol.size, req.size
            )));
        }
        vol.size = req.size;
        let out = vol.clone();
        self.bump_epoch();
        Ok(out)
    }

    /// Removes a volume from the map (`DELETE /v1/volumes/{name}`) and returns it.
    /// Its objects on the OSDs are deleted by the caller (`flame-admin volume rm`),
    /// which knows the volume id from the reply.
    pub fn delete_volume(&mut self, name: &str) -> Result<VolumeInfo, StateError> {
        let vol = self
            .persisted
            .map
            .volumes
            .remove(name)
            .ok_or_else(|| no_such_volume(name))?;
        self.bump_epoch();
        Ok(vol)
    }

    /// `GET /v1/status`. `acting` is [`acting_sets`] of the current map.
    pub fn status(&self, acting: &[Vec<OsdId>]) -> ClusterStatus {
        let map = &self.persisted.map;
        let (health, health_detail) = health(map, acting);
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
        }
    }

    /// `GET /v1/osds`. `acting` is [`acting_sets`] of the current map.
    pub fn osd_statuses(&self, acting: &[Vec<OsdId>], now: Instant) -> Vec<OsdStatus> {
        let mut pgs: BTreeMap<OsdId, u32> = BTreeMap::new();
        for set in acting {
            for id in set {
                *pgs.entry(*id).or_default() += 1;
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
    if !req.weight.is_finite() || req.weight < 0.0 {
        return bad("weight must be a finite number >= 0".into());
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

/// The acting set of every placement group of `map`, indexed by PG number. Costs
/// `pg_count × osds` hash draws, so callers cache it per epoch.
pub fn acting_sets(map: &ClusterMap) -> Vec<Vec<OsdId>> {
    (0..map.pool.pg_count)
        .map(|pg| pg_osds(map, PgId(pg)))
        .collect()
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

/// Computes health and the reasons for it.
///
/// ERR: no OSDs, or some placement group has fewer than `min_size` up OSDs in its
/// acting set (its I/O blocks). WARN: an OSD is down or out, fewer OSDs are in than
/// `pool.size`, or a placement group has fewer than `size` copies up.
pub fn health(map: &ClusterMap, acting: &[Vec<OsdId>]) -> (Health, Vec<String>) {
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
    if !down.is_empty() || !out.is_empty() {
        level = level.max(Health::Warn);
        detail_osds(&mut detail, &down, "down");
        detail_osds(&mut detail, &out, "out");
    }
    let n_in = map.osds.values().filter(|o| o.r#in).count();
    if n_in < map.pool.size as usize {
        level = level.max(Health::Warn);
        detail.push(format!(
            "only {n_in} OSDs are in, fewer than pool.size {}: objects have fewer copies than configured",
            map.pool.size
        ));
    }
    let up_in_set = |set: &Vec<OsdId>| {
        set.iter()
            .filter(|id| map.osds.get(id).is_some_and(|o| o.up))
            .count()
    };
    let mut blocked = 0usize;
    let mut degraded = 0usize;
    for set in acting {
        let up = up_in_set(set);
        if up < map.pool.min_size as usize {
            blocked += 1;
        } else if up < map.pool.size as usize {
            degraded += 1;
        }
    }
    if blocked > 0 {
        level = Health::Err;
        detail.push(format!(
            "{blocked} of {} placement groups have fewer than min_size {} OSDs up: their I/O blocks",
            acting.len(),
            map.pool.min_size
        ));
    }
    if degraded > 0 {
        level = level.max(Health::Warn);
        detail.push(format!(
            "{degraded} of {} placement groups have fewer than size {} OSDs up (degraded)",
            acting.len(),
            map.pool.size
        ));
    }
    (level, detail)
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
            uuid: uuid.into(),
            id: None,
            addr: format!("127.0.0.1:{port}").parse().unwrap(),
            shards: 2,
            host: host.into(),
            weight: 1.0,
            metrics_addr: None,
        }
    }

    fn hb(id: OsdId, uuid: &str) -> OsdHeartbeat {
        OsdHeartbeat {
            id,
            uuid: uuid.into(),
            epoch: Epoch(0),
            used_bytes: 10,
            capacity_bytes: 100,
        }
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

    #[test]
    fn placement_inputs_do_not_change_under_existing_volumes() {
        let mut s = state();
        let now = Instant::now();
        let a = s.boot(&boot_req("u-a", 6900, "h1"), now).unwrap();
        assert!(s.map().osds[&a].r#in, "before any volume, new OSDs join in");
        s.create_volume(
            &VolumeCreate {
                name: "v".into(),
                size: 1 << 30,
            },
            0,
        )
        .unwrap();
        // A new OSD joins out while volumes exist (no backfill to fill it).
        let b = s.boot(&boot_req("u-b", 6910, "h2"), now).unwrap();
        assert!(!s.map().osds[&b].r#in);
        // A known OSD keeps the host and weight placement was computed with.
        let mut moved = boot_req("u-a", 6900, "h9");
        moved.weight = 5.0;
        s.boot(&moved, now).unwrap();
        assert_eq!(s.map().osds[&a].host, "h1");
        assert_eq!(s.map().osds[&a].weight, 1.0);
        // Unless the operator said the volumes hold no data yet.
        s.new_osds_in_with_volumes = true;
        let c = s.boot(&boot_req("u-c", 6920, "h3"), now).unwrap();
        assert!(s.map().osds[&c].r#in);
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
        let st = s.osd_statuses(&acting_sets(s.map()), t0 + grace * 10);
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
        let st = s.osd_statuses(&[], t1);
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
            let st = s.status(&acting_sets(s.map()));
            (st.health, st.health_detail)
        };
        assert_eq!(h(&s).0, "HEALTH_ERR", "no OSDs at all");
        s.boot(&boot_req("a", 6900, "h1"), now).unwrap();
        s.boot(&boot_req("b", 6910, "h2"), now).unwrap();
        let (lvl, detail) = h(&s);
        assert_eq!(lvl, "HEALTH_WARN", "{detail:?}");
        assert!(detail.iter().any(|d| d.contains("fewer than pool.size")));
        s.boot(&boot_req("c", 6920, "h3"), now).unwrap();
        assert_eq!(h(&s), ("HEALTH_OK".to_string(), vec![]));
        // One down of three: every PG still has min_size 2 up.
        s.persisted.map.osds.get_mut(&OsdId(0)).unwrap().up = false;
        let (lvl, detail) = h(&s);
        assert_eq!(lvl, "HEALTH_WARN");
        assert!(detail.contains(&"osd.0 is down".to_string()), "{detail:?}");
        assert!(detail.iter().any(|d| d.contains("degraded")));
        // Two down: PGs below min_size.
        s.persisted.map.osds.get_mut(&OsdId(1)).unwrap().up = false;
        let (lvl, detail) = h(&s);
        assert_eq!(lvl, "HEALTH_ERR");
        assert!(detail.iter().any(|d| d.contains("min_size")), "{detail:?}");
        // Out (but up) OSD: warn only while enough copies remain... here 2 in of size 3.
        for o in s.persisted.map.osds.values_mut() {
            o.up = true;
        }
        s.persisted.map.osds.get_mut(&OsdId(2)).unwrap().r#in = false;
        let (lvl, detail) = h(&s);
        assert_eq!(lvl, "HEALTH_WARN", "{detail:?}");
        assert!(detail.contains(&"osd.2 is out".to_string()));
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
        let acting = acting_sets(s.map());
        let st = s.status(&acting);
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
        let st = s.status(&[]);
        assert_eq!((st.osds_up, st.osds_awaiting_first_report), (2, 2));
        assert!(
            s.osd_statuses(&[], now)
                .iter()
                .all(|o| o.awaiting_first_report)
        );
        s.heartbeat(&hb(a, "a"), now).unwrap();
        assert_eq!(s.status(&[]).osds_awaiting_first_report, 1);
        let osds = s.osd_statuses(&[], now);
        assert!(!osds[0].awaiting_first_report && osds[1].awaiting_first_report);
        s.heartbeat(&hb(b, "b"), now).unwrap();
        assert_eq!(s.status(&[]).osds_awaiting_first_report, 0);
        // A manager restart forgets every report: all are waiting again, though the
        // map still says up.
        let s = ClusterState::new(s.persisted.clone(), now);
        let st = s.status(&[]);
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
