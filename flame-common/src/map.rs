//! The cluster map: everything a client or OSD needs to place and route I/O.
//!
//! The manager owns the map and bumps [`ClusterMap::epoch`] on every change; OSDs
//! and clients fetch it by epoch and compute placement themselves (see
//! [`crate::placement`]), which keeps the manager off the data path.

use crate::ids::{Epoch, OsdId, PgId, VolumeId};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

/// Replication and layout settings. Fixed when the cluster is created: changing
/// `pg_count` or `object_size` later would move or reshape every object.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PoolConfig {
    /// Copies of each object.
    pub size: u32,
    /// Fewest complete copies that must be up for a placement group to serve I/O.
    /// With fewer, I/O to the group waits (no error, no stale data) until enough
    /// copies are back: see [`crate::placement::PgMembers`].
    pub min_size: u32,
    /// Number of placement groups objects are hashed into.
    pub pg_count: u32,
    /// Bytes per object; a power of two.
    pub object_size: u32,
}

/// Largest object size accepted: bounds every per-request buffer.
pub const OBJECT_SIZE_MAX: u32 = 64 << 20;
/// Smallest object size accepted.
pub const OBJECT_SIZE_MIN: u32 = 64 << 10;
/// Most placement groups a pool may have (bounds per-PG tables).
pub const PG_COUNT_MAX: u32 = 1 << 16;
/// Most replicas per object.
pub const POOL_SIZE_MAX: u32 = 8;

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            size: 3,
            min_size: 2,
            pg_count: 128,
            object_size: 4 << 20,
        }
    }
}

impl PoolConfig {
    /// Checks the settings, naming the bad key.
    pub fn validate(&self) -> Result<(), (String, String)> {
        if self.size == 0 || self.size > POOL_SIZE_MAX {
            return Err(("pool.size".into(), format!("must be 1..={POOL_SIZE_MAX}")));
        }
        if self.min_size == 0 || self.min_size > self.size {
            return Err(("pool.min_size".into(), "must be 1..=size".into()));
        }
        if self.pg_count == 0 || self.pg_count > PG_COUNT_MAX {
            return Err((
                "pool.pg_count".into(),
                format!("must be 1..={PG_COUNT_MAX}"),
            ));
        }
        if !self.object_size.is_power_of_two()
            || !(OBJECT_SIZE_MIN..=OBJECT_SIZE_MAX).contains(&self.object_size)
        {
            return Err((
                "pool.object_size".into(),
                format!("must be a power of two in {OBJECT_SIZE_MIN}..={OBJECT_SIZE_MAX}"),
            ));
        }
        Ok(())
    }
}

/// One OSD as the map knows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OsdInfo {
    /// Cluster-wide id.
    pub id: OsdId,
    /// Address of shard 0's data listener; shard `i` listens on the same IP at port
    /// `addr.port() + i`, so a client can reach the owning shard directly.
    pub addr: SocketAddr,
    /// Number of shard threads; placement group `pg` lives on shard `pg % shards`.
    pub shards: u16,
    /// Failure domain: placement puts copies on distinct hosts where it can.
    pub host: String,
    /// Relative share of data; 0 takes no new data.
    pub weight: f64,
    /// Heartbeating (up) or not (down). A down OSD keeps its placement until it is
    /// marked out; its placement groups go on with the copies that are up (at least
    /// `pool.min_size`), and it is recovered when it comes back.
    pub up: bool,
    /// The epoch in which this OSD last came up (0 for maps from before this field).
    /// Everything an OSD knew before that epoch died with its previous process, so a
    /// recovery report naming it is trusted only from this epoch on.
    #[serde(default)]
    pub up_from: Epoch,
    /// Part of placement (in) or not (out).
    pub r#in: bool,
    /// Where the OSD serves Prometheus metrics.
    pub metrics_addr: Option<SocketAddr>,
}

impl OsdInfo {
    /// The data address of shard `shard`.
    pub fn shard_addr(&self, shard: u16) -> SocketAddr {
        let mut a = self.addr;
        a.set_port(self.addr.port().wrapping_add(shard));
        a
    }

    /// The shard of this OSD that owns placement group `pg`.
    pub fn shard_of(&self, pg: PgId) -> u16 {
        (pg.0 % u32::from(self.shards.max(1))) as u16
    }
}

/// A volume: a thin-provisioned virtual disk of `size` bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeInfo {
    /// Never-reused id; objects are named by it.
    pub id: VolumeId,
    /// User-facing name, also the NBD export name.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Creation time, seconds since the Unix epoch.
    pub created_unix: u64,
}

/// The whole cluster map. Serialized as JSON by the manager's API.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClusterMap {
    /// Cluster identity; a client or OSD refuses a map of another cluster.
    pub fsid: String,
    /// Incremented on every change.
    pub epoch: Epoch,
    /// Replication settings.
    pub pool: PoolConfig,
    /// OSDs by id.
    pub osds: BTreeMap<OsdId, OsdInfo>,
    /// Volumes by name.
    pub volumes: BTreeMap<String, VolumeInfo>,
    /// Placement groups whose complete copies are not exactly the OSDs placement
    /// chooses for them: the OSDs (in primary-preference order) that hold every
    /// acknowledged write of the group. Absent: the placed OSDs are complete. The
    /// manager records an entry when placement moves a group (an OSD out, in, added,
    /// reweighted) or a member misses writes (it went down while the group carried
    /// on), and removes it when the group's primary reports the placed members
    /// recovered. It is how a map change never loses track of where the data is:
    /// see [`crate::placement::PgMembers`].
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pg_complete: BTreeMap<PgId, Vec<OsdId>>,
    /// Tombstones of removed volumes (the newest [`DELETED_VOLUMES_MAX`] ids). A
    /// volume is removed from the map at once, but an OSD that was down at the time
    /// still holds its objects: every OSD, when it starts or sees a map with a
    /// tombstone of a volume it holds objects of, deletes them. Volume ids are never
    /// reused, so a tombstone can never name a live volume.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub deleted_volumes: BTreeSet<VolumeId>,
    /// OSDs whose file system is at least the manager's `full_ratio` used. A
    /// primary refuses a write (ENOSPC) when any OSD that must apply it is here, so
    /// no disk runs out of space half-way through a replicated write; discards and
    /// write-zeroes still pass (they free space). In the map so that every primary
    /// sees the same set at the same epoch.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub full_osds: BTreeSet<OsdId>,
    /// OSDs at least `nearfull_ratio` used (and not full): a warning in status only,
    /// I/O is unchanged.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub nearfull_osds: BTreeSet<OsdId>,
    /// Where the interval history starts: every placement group without an entry
    /// in [`Self::pg_intervals`] has had the same roles since at least this epoch.
    /// `None` (a map from a manager that keeps no history): unknown, so every epoch
    /// counts as a new interval. See [`Self::interval_since`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pg_intervals_from: Option<Epoch>,
    /// Placement groups whose roles changed after `pg_intervals_from`: the first
    /// epoch of their current roles (their *interval*: acting set, primary first,
    /// recovering members, whether active, and each of those OSDs' `up_from`).
    /// Bounded: at most one entry per group, and entries older than
    /// [`INTERVAL_HISTORY_EPOCHS`] are folded into `pg_intervals_from`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pg_intervals: BTreeMap<PgId, Epoch>,
}

/// Epochs of interval history a map keeps per placement group
/// ([`ClusterMap::pg_intervals`]). A forward from a sender older than that is
/// refused as if its group's roles had changed (it refreshes its map and retries).
pub const INTERVAL_HISTORY_EPOCHS: u64 = 1024;

/// Most tombstones [`ClusterMap::deleted_volumes`] keeps (the newest ids): bounds the
/// map. An OSD down across more volume removals than this keeps the objects of the
/// oldest ones (they take space, nothing reads them).
pub const DELETED_VOLUMES_MAX: usize = 4096;

impl ClusterMap {
    /// Empty map of a new cluster.
    pub fn new(fsid: String, pool: PoolConfig) -> Self {
        ClusterMap {
            fsid,
            epoch: Epoch(1),
            pool,
            osds: BTreeMap::new(),
            volumes: BTreeMap::new(),
            pg_complete: BTreeMap::new(),
            deleted_volumes: BTreeSet::new(),
            full_osds: BTreeSet::new(),
            nearfull_osds: BTreeSet::new(),
            pg_intervals_from: None,
            pg_intervals: BTreeMap::new(),
        }
    }

    /// The first epoch since which `pg` has had the roles it has in this map (its
    /// *interval*, Ceph's `same_interval_since`), or an epoch at or after it when
    /// the history does not reach back that far. A replica refuses a write
    /// forwarded under an epoch older than this: its sender acted on other roles
    /// (it may have been replaced as primary meanwhile). Without history (`None`),
    /// the map's own epoch: every map change is a new interval.
    pub fn interval_since(&self, pg: PgId) -> Epoch {
        match self.pg_intervals_from {
            None => self.epoch,
            Some(from) => self.pg_intervals.get(&pg).copied().unwrap_or(from),
        }
    }

    /// Records the interval history of a map whose epoch has just been bumped:
    /// every group whose roles differ from `prev` (the roles of the previous map,
    /// from [`crate::placement::pg_roles`]) starts a new interval at this epoch;
    /// entries older than [`INTERVAL_HISTORY_EPOCHS`] are folded into
    /// `pg_intervals_from`. Returns this map's roles, the `prev` of the next call.
    /// `prev` empty (a manager that just started with a map without history, or
    /// a new cluster): every group's interval starts now.
    pub fn record_intervals(
        &mut self,
        prev: &[crate::placement::PgRoles],
    ) -> Vec<crate::placement::PgRoles> {
        let now = crate::placement::pg_roles(self);
        let epoch = self.epoch;
        match self.pg_intervals_from {
            Some(_) if prev.len() == now.len() => {
                for (pg, (a, b)) in prev.iter().zip(&now).enumerate() {
                    if a != b {
                        self.pg_intervals.insert(PgId(pg as u32), epoch);
                    }
                }
            }
            _ => {
                self.pg_intervals.clear();
                self.pg_intervals_from = Some(epoch);
            }
        }
        let horizon = Epoch(epoch.0.saturating_sub(INTERVAL_HISTORY_EPOCHS));
        let mut from = self.pg_intervals_from.unwrap_or(epoch);
        self.pg_intervals.retain(|_, since| {
            if *since < horizon {
                from = from.max(*since);
                false
            } else {
                true
            }
        });
        self.pg_intervals_from = Some(from);
        debug_assert!(self.pg_intervals.values().all(|e| *e <= epoch));
        now
    }

    /// Looks a volume up by id.
    pub fn volume_by_id(&self, id: VolumeId) -> Option<&VolumeInfo> {
        self.volumes.values().find(|v| v.id == id)
    }
}

/// Checks a volume name: it is an NBD export name and a path component in the CLI,
/// so keep it to a safe, bounded alphabet.
pub fn validate_volume_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > VOLUME_NAME_BYTES_MAX {
        return Err(format!(
            "volume name must be 1..={VOLUME_NAME_BYTES_MAX} bytes"
        ));
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err("volume name may contain only A-Z a-z 0-9 - _ .".into());
    }
    if name.chars().all(|c| c == '.') {
        // `.` and `..` are path segments: an HTTP client normalises them away.
        return Err("volume name may not consist of dots only".into());
    }
    Ok(())
}

/// Longest volume name.
pub const VOLUME_NAME_BYTES_MAX: usize = 128;
/// Largest volume: 1 PiB. Bounds object indexes and arithmetic on offsets.
pub const VOLUME_SIZE_MAX: u64 = 1 << 50;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_names() {
        assert!(validate_volume_name("vm-1_a.b").is_ok());
        for bad in ["", ".", "..", "...", "a/b", "a b", "ä"] {
            assert!(validate_volume_name(bad).is_err(), "{bad:?} accepted");
        }
        assert!(validate_volume_name(&"x".repeat(VOLUME_NAME_BYTES_MAX + 1)).is_err());
    }
}
