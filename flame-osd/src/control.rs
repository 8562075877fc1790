//! The OSD's control plane: identity, boot, heartbeats, map updates.
//!
//! Runs on its own ordinary thread with blocking HTTP calls to the manager; it never
//! touches the data path except by publishing new maps into the shared `ArcSwap`,
//! which shards read without locking.

use crate::config::OsdConfig;
use crate::liveness::Liveness;
use arc_swap::ArcSwap;
use flame_common::auth::Credentials;
use flame_common::clock;
use flame_common::http::MgrEndpoint;
use flame_common::ids::OsdId;
use flame_common::map::ClusterMap;
use flame_common::mgr_api::{
    HeartbeatReply, OsdBoot, OsdBootReply, OsdFailureReport, OsdHeartbeat,
};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How an error of [`Control::post`] that is final begins: a 4xx the manager
/// signed (or any 4xx without keys, where nothing can be verified).
const REFUSED: &str = "refused: ";

/// How often object bytes are recounted for the heartbeat's usage report.
const USAGE_INTERVAL: Duration = Duration::from_secs(10);

/// How often the control thread checks whether a shard asked for a newer map.
const MAP_CHECK_INTERVAL: Duration = Duration::from_millis(20);

/// At most one report of one unreachable peer per this interval.
const FAILURE_REPORT_INTERVAL: Duration = Duration::from_secs(1);

/// Largest map accepted from the manager.
const MAP_BYTES_MAX: u64 = 64 << 20;
/// Bound on one call to the manager, connect included.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// Largest answer to a boot, heartbeat or report (each is well under 1 KiB).
const ANSWER_BYTES_MAX: u64 = 1 << 20;

/// The OSD's identity, kept in `data_dir/osd.json`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Identity {
    /// Created at first start; names this data directory to the manager.
    pub uuid: String,
    /// Assigned by the manager at first boot.
    pub id: Option<OsdId>,
    /// The cluster this directory belongs to; an OSD refuses to join another.
    pub fsid: Option<String>,
}

impl Identity {
    fn path(data_dir: &Path) -> PathBuf {
        data_dir.join("osd.json")
    }

    /// Loads the identity, creating it on first start.
    pub fn load_or_create(data_dir: &Path) -> Result<Identity, String> {
        let path = Self::path(data_dir);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                format!(
                    "{} is corrupt ({e}); refusing to guess this OSD's identity",
                    path.display()
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let id = Identity {
                    uuid: new_uuid(),
                    id: None,
                    fsid: None,
                };
                id.save(data_dir)?;
                Ok(id)
            }
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        }
    }

    /// Writes the identity atomically (temp file, fsync, rename, fsync dir).
    pub fn save(&self, data_dir: &Path) -> Result<(), String> {
        use std::io::Write;
        let path = Self::path(data_dir);
        let tmp = data_dir.join("osd.json.tmp");
        let bytes = serde_json::to_vec_pretty(self).map_err(|e| e.to_string())?;
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)?;
            std::fs::File::open(data_dir)?.sync_all()
        };
        write().map_err(|e| format!("cannot write {}: {e}", path.display()))
    }
}

fn new_uuid() -> String {
    let a: u64 = rand::random();
    let b: u64 = rand::random();
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        (b >> 48) & 0x3fff | 0x8000,
        b & 0xffff_ffff_ffff
    )
}

/// Talks to the manager.
pub struct Control {
    mgr: MgrEndpoint,
    cfg: Arc<OsdConfig>,
    identity: Identity,
    metrics_addr: SocketAddr,
    /// Random per process start (`OsdBoot::incarnation`): tells the manager that a
    /// boot comes from a new process even when the old one was never marked down.
    incarnation: u64,
    /// Finds objects of removed volumes in every new map's tombstones.
    tombstones: crate::tombstones::Scanner,
    liveness: Arc<Liveness>,
    /// The shards' service key, for an OSD with its own key: replaced when a
    /// heartbeat answer names another `osd` key generation.
    service_keys: Option<crate::service_key::ServiceKeys>,
}

impl Control {
    /// A control plane for this OSD, calling the manager at `base` (a checked
    /// URL, [`flame_common::http::mgr_base_url`]), over TLS verified against
    /// `trust` when given. Its HTTP calls leave from the OSD's own address
    /// ([`OsdConfig::source_ip`]).
    pub fn new(
        cfg: Arc<OsdConfig>,
        identity: Identity,
        metrics_addr: SocketAddr,
        liveness: Arc<Liveness>,
        creds: Option<Credentials>,
        (base, trust): (String, Option<&flame_common::tls::MgrTrust>),
    ) -> Control {
        let agent =
            flame_common::http::agent(ureq::Agent::config_builder(), Some(cfg.source_ip()), trust);
        Control {
            mgr: MgrEndpoint { agent, base, creds },
            cfg,
            identity,
            metrics_addr,
            incarnation: rand::random(),
            tombstones: crate::tombstones::Scanner::default(),
            liveness,
            service_keys: None,
        }
    }

    /// Registers with the manager, retrying until it answers. Returns the id and the
    /// first map.
    pub fn boot(&mut self) -> Result<(OsdId, ClusterMap), String> {
        let body = OsdBoot {
            uuid: self.identity.uuid.clone(),
            id: self.identity.id,
            addr: self.cfg.advertised(),
            shards: self.cfg.shard_count(),
            host: self.cfg.host_name(),
            weight: self.cfg.weight,
            metrics_addr: Some(self.metrics_addr),
            fsid: self.identity.fsid.clone(),
            incarnation: self.incarnation,
        };
        let mut sent_ms = 0;
        let reply: OsdBootReply =
            match self.post_until_answered("boot", "/v1/osd/boot", &body, |l| {
                sent_ms = l.now_ms();
            }) {
                Ok(r) => r,
                // 4xx: the manager refused this OSD (another cluster's data
                // directory, an address held by another live OSD, another OSD's
                // key, an invalid setting). Retrying cannot help: say why and stop
                // with status 2, as for a bad configuration.
                Err(e) => {
                    tracing::error!("the manager refused this OSD: {e}");
                    eprintln!("flame-osd: the manager at {} {e}", self.cfg.mgr);
                    std::process::exit(2);
                }
            };
        // The lease argument spans this OSD's settings and the manager's
        // (docs/guarantees.md, "Failover"): with a lease that outlives the
        // manager's grace, this OSD could acknowledge I/O after its placement
        // groups got another primary. Refuse to run, as for a bad configuration.
        match self.cfg.check_against_mgr(reply.timings) {
            Ok(true) => {}
            Ok(false) => tracing::warn!(
                "the manager at {} did not say its heartbeat grace (it is older than this                  OSD): lease_ms + heartbeat_interval_ms < heartbeat_grace_ms is not checked",
                self.cfg.mgr
            ),
            Err(e) => {
                tracing::error!("invalid timing for this manager: {e}");
                eprintln!(
                    "flame-osd: invalid configuration for the manager at {}: {e}",
                    self.cfg.mgr
                );
                std::process::exit(2);
            }
        }
        if let Some(fsid) = &self.identity.fsid
            && *fsid != reply.fsid
        {
            return Err(format!(
                "data directory belongs to cluster {fsid}, but the manager runs cluster {}; refusing to join",
                reply.fsid
            ));
        }
        if self.identity.id != Some(reply.id) || self.identity.fsid.as_deref() != Some(&reply.fsid)
        {
            self.identity.id = Some(reply.id);
            self.identity.fsid = Some(reply.fsid.clone());
            self.identity.save(&self.cfg.data_dir)?;
        }
        let map = self.fetch_map()?;
        // The manager marked this OSD up when it answered the boot: that counts as
        // an acknowledged heartbeat, and the map fetched after it is at least as
        // new as the one that made this OSD up.
        self.liveness.renew(sent_ms, self.cfg.lease_ms);
        Ok((reply.id, map))
    }

    /// Keeps `keys` (the shards' service key) at the manager's `osd` key
    /// generation from now on (an OSD with its own key; see [`Self::run`]).
    pub fn follow_service_key(&mut self, keys: Option<crate::service_key::ServiceKeys>) {
        self.service_keys = keys;
    }

    /// The OSDs' service key, for an OSD that holds its own `osd.N` key: asked
    /// of the manager (`POST /v1/auth/service-key`), which seals it under this
    /// OSD's key. With `retry`, retries while the manager does not answer (at
    /// start); a refusal is final.
    pub fn fetch_service_key(&self, retry: bool) -> Result<flame_common::auth::ServiceKey, String> {
        let creds = self
            .mgr
            .creds
            .as_ref()
            .ok_or("no keyring: there is no service key to fetch")?;
        let path = "/v1/auth/service-key";
        let grant: flame_common::mgr_api::ServiceKeyGrant = if retry {
            self.post_until_answered("service key", path, &(), |_| {})
        } else {
            self.post(path, &())
        }
        .map_err(|e| format!("the manager refused this OSD the service key: {e}"))?;
        let sealed = hex::decode(&grant.sealed_key)
            .map_err(|e| format!("the manager's sealed service key is not hex: {e}"))?;
        flame_common::auth::ServiceKey::open_sealed(&creds.key, grant.generation, &sealed)
    }

    /// [`Self::post`], retried (with backoff up to 2 s) while the manager does
    /// not answer; a refusal (4xx) is returned. `before_each` runs before each
    /// attempt (the boot notes when it was sent).
    fn post_until_answered<B: Serialize, R: for<'de> Deserialize<'de>>(
        &self,
        what: &str,
        path: &str,
        body: &B,
        mut before_each: impl FnMut(&Liveness),
    ) -> Result<R, String> {
        let mut delay = Duration::from_millis(100);
        // Unbounded in count by design: an OSD waits for its manager. Each
        // round waits at least 100 ms.
        loop {
            before_each(&self.liveness);
            match self.post(path, body) {
                Ok(r) => return Ok(r),
                Err(e) if e.starts_with(REFUSED) => return Err(e),
                Err(e) => {
                    tracing::warn!(
                        "{what}: manager at {} not answering ({e}); retrying",
                        self.cfg.mgr
                    );
                    clock::sleep_blocking(delay);
                    delay = (delay * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// After a heartbeat: when the manager's `osd` key generation
    /// (`generation`) is not the one the shards hold, fetches the new service
    /// key and hands it to them (one try per heartbeat; a failure is logged and
    /// tried again at the next).
    fn follow_rotation(&self, generation: Option<flame_common::auth::KeyGeneration>) {
        let (Some(keys), Some(generation)) = (&self.service_keys, generation) else {
            return;
        };
        if keys.generation() == generation {
            return;
        }
        match self.fetch_service_key(false) {
            Ok(key) if key.generation() == generation => {
                tracing::info!(
                    from = keys.generation(),
                    to = generation,
                    "the osd key was rotated: checking tickets with the new service key"
                );
                keys.replace(key);
            }
            Ok(key) => tracing::warn!(
                got = key.generation(),
                want = generation,
                "service key of another generation than the heartbeat said; trying again"
            ),
            Err(e) => tracing::warn!("cannot fetch the rotated service key: {e}"),
        }
    }

    fn post<B: Serialize, R: for<'de> Deserialize<'de>>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<R, String> {
        let bytes = serde_json::to_vec(body).map_err(|e| e.to_string())?;
        let answer = self
            .mgr
            .call("POST", path, Some(&bytes), CALL_TIMEOUT, ANSWER_BYTES_MAX)
            .map_err(|e| e.to_string())?;
        let status = answer.status;
        if (400..500).contains(&status) {
            // The manager's ApiError body says why; bounded like every body.
            let why = serde_json::from_slice::<flame_common::mgr_api::ApiError>(&answer.body)
                .map_or_else(|e| format!("(unreadable reason: {e})"), |a| a.error);
            // Final only when it is verifiably the manager's: anyone on the
            // path could forge an unsigned refusal to stop this OSD. Without
            // keys (auth: none) nothing can be verified, as before.
            if answer.signed || self.mgr.creds.is_none() {
                return Err(format!("{REFUSED}{path} answered {status}: {why}"));
            }
            return Err(format!(
                "{path} answered {status}, unsigned (not verifiably the manager's, so \
                 not final; a manager that does not know this OSD's key answers so too): {why}"
            ));
        }
        if !(200..300).contains(&status) {
            return Err(format!("{path} answered {status}"));
        }
        serde_json::from_slice(&answer.body).map_err(|e| e.to_string())
    }

    /// Fetches the current map.
    pub fn fetch_map(&self) -> Result<ClusterMap, String> {
        let url = format!("{}/v1/map", self.mgr.base);
        crate::failpoints::check("map_fetch").map_err(|e| format!("GET {url}: {e}"))?;
        let answer = self
            .mgr
            .call("GET", "/v1/map", None, CALL_TIMEOUT, MAP_BYTES_MAX)
            .map_err(|e| format!("GET {url}: {e}"))?;
        if !(200..300).contains(&answer.status) {
            let why = serde_json::from_slice::<flame_common::mgr_api::ApiError>(&answer.body)
                .map_or_else(|_| String::new(), |a| format!(": {}", a.error));
            return Err(format!("GET {url}: answered {}{why}", answer.status));
        }
        let map: ClusterMap =
            serde_json::from_slice(&answer.body).map_err(|e| format!("GET {url}: bad map: {e}"))?;
        map.pool
            .validate()
            .map_err(|(k, m)| format!("manager sent an invalid map: {k}: {m}"))?;
        Ok(map)
    }

    /// Heartbeats forever; fetches the map whenever the manager reports a newer epoch
    /// or a shard saw a request from a peer with a newer map (`wanted_epoch`), and
    /// re-boots if the manager has forgotten this OSD.
    pub fn run(
        mut self,
        id: OsdId,
        map: Arc<ArcSwap<ClusterMap>>,
        wanted_epoch: Arc<AtomicU64>,
        recovery: Arc<crate::recovery::RecoveryShared>,
    ) -> ! {
        let interval = Duration::from_millis(self.cfg.heartbeat_interval_ms);
        // Counting object bytes walks the data directory, which can take seconds
        // with millions of objects: do it on its own thread so heartbeats are never
        // late because of it.
        let object_bytes = Arc::new(AtomicU64::new(0));
        {
            let object_bytes = object_bytes.clone();
            let dir = self.cfg.data_dir.clone();
            let spawned = std::thread::Builder::new()
                .name("disk-usage".into())
                .spawn(move || {
                    loop {
                        object_bytes.store(object_bytes_on_disk(&dir), Ordering::Relaxed);
                        clock::sleep_blocking(USAGE_INTERVAL);
                    }
                });
            if let Err(e) = spawned {
                tracing::warn!("cannot start the disk-usage thread ({e}); reporting 0 bytes used");
            }
        }
        self.tombstones
            .on_map(&self.cfg.data_dir, &map.load(), &recovery.removed_volumes);
        let mut last_heartbeat = clock::now();
        let mut reported = flame_common::collections::HashMap::default();
        loop {
            clock::sleep_blocking(MAP_CHECK_INTERVAL);
            let wanted = wanted_epoch.load(Ordering::Relaxed);
            if wanted > map.load().epoch.0 {
                // A client or peer already has a newer map: fetch it now rather than
                // at the next heartbeat, so their retries succeed quickly.
                match self.fetch_map() {
                    Ok(m) => {
                        tracing::info!(epoch = %m.epoch, "new map (asked for by a peer)");
                        self.tombstones
                            .on_map(&self.cfg.data_dir, &m, &recovery.removed_volumes);
                        let reached = m.epoch.0;
                        map.store(Arc::new(m));
                        // Stop asking if the manager has nothing newer — unless a shard
                        // asked for an even newer epoch meanwhile.
                        if reached < wanted {
                            let _ = wanted_epoch.compare_exchange(
                                wanted,
                                reached,
                                Ordering::Relaxed,
                                Ordering::Relaxed,
                            );
                        }
                    }
                    Err(e) => tracing::warn!("map fetch failed: {e}"),
                }
            }
            self.send_recovery_reports(id, &recovery, &wanted_epoch);
            self.report_failed_peers(id, &map, &mut reported);
            #[cfg(feature = "failpoints")]
            self.apply_test_stall();
            if clock::elapsed(last_heartbeat) < interval {
                continue;
            }
            last_heartbeat = clock::now();
            // A hung shard cannot serve its placement groups: stop vouching for
            // this OSD so the manager marks it down after its grace (and the
            // lease runs out here, so nothing is acknowledged meanwhile).
            let stalled = self.liveness.stalled_shards(self.cfg.shard_stall_ms);
            if !stalled.is_empty() {
                tracing::error!(
                    ?stalled,
                    stall_ms = self.cfg.shard_stall_ms,
                    "shard threads made no progress; not heartbeating"
                );
                continue;
            }
            // The file system's figures are one statvfs: fresh in every heartbeat,
            // so the manager sees a filling disk within a heartbeat interval.
            let (used_bytes, capacity_bytes) = fs_usage(&self.cfg.data_dir);
            let hb = OsdHeartbeat {
                id,
                uuid: self.identity.uuid.clone(),
                epoch: map.load().epoch,
                used_bytes,
                capacity_bytes,
                object_bytes: object_bytes.load(Ordering::Relaxed),
                recovery: Some({
                    let p = recovery.progress();
                    flame_common::mgr_api::RecoveryProgress {
                        objects_to_recover: p.objects_to_recover,
                        pgs_recovering: p.pgs_recovering,
                        pgs_unestimated: p.pgs_unestimated,
                        objects_recovered_total: p.objects_recovered_total,
                        bytes_recovered_total: p.bytes_recovered_total,
                        scrub_errors_total: p.scrub_errors_total,
                        scrub_repaired_total: p.scrub_repaired_total,
                        last_scrub_unix: p.last_scrub_unix,
                        pg_objects: recovery.pg_object_counts(),
                    }
                }),
            };
            // The lease counts from when the heartbeat was sent: the manager's
            // grace counts from when it arrived, which is later.
            let sent_ms = self.liveness.now_ms();
            match self.post::<_, HeartbeatReply>("/v1/osd/heartbeat", &hb) {
                Ok(reply) => {
                    self.follow_rotation(reply.service_generation);
                    if reply.epoch > map.load().epoch {
                        match self.fetch_map() {
                            Ok(m) => {
                                tracing::info!(epoch = %m.epoch, "new map");
                                self.tombstones.on_map(
                                    &self.cfg.data_dir,
                                    &m,
                                    &recovery.removed_volumes,
                                );
                                map.store(Arc::new(m));
                            }
                            Err(e) => tracing::warn!("map fetch failed: {e}"),
                        }
                    }
                    // Renewed only once this OSD's map is as new as the manager's:
                    // an OSD coming back from a partition must not serve under the
                    // old map (where it may still be primary) with a fresh lease.
                    if map.load().epoch >= reply.epoch {
                        self.liveness.renew(sent_ms, self.cfg.lease_ms);
                    }
                }
                // Only a signed 404: an unsigned one may be anyone's.
                Err(e) if e.starts_with(&format!("{REFUSED}/v1/osd/heartbeat answered 404")) => {
                    tracing::warn!("manager does not know this OSD; booting again");
                    match self.boot() {
                        Ok((new_id, _)) if new_id != id => {
                            // The shards serve placement groups as `id`; they cannot
                            // change identity under load. Restart clean.
                            tracing::error!(old = %id, new = %new_id, "the manager gave this OSD a new id; exiting to restart under it");
                            std::process::exit(1);
                        }
                        Ok((_, m)) => {
                            self.tombstones.on_map(
                                &self.cfg.data_dir,
                                &m,
                                &recovery.removed_volumes,
                            );
                            map.store(Arc::new(m));
                        }
                        Err(e) => {
                            tracing::error!("{e}");
                            std::process::exit(1);
                        }
                    }
                }
                Err(e) => tracing::warn!("heartbeat failed: {e}"),
            }
        }
    }

    /// Tells the manager about peers the shards could not reach, at most once per
    /// peer per [`FAILURE_REPORT_INTERVAL`]. `reported` remembers when each was last
    /// reported (pruned as entries age out, so it holds at most the peers reported
    /// within one interval).
    fn report_failed_peers(
        &self,
        id: OsdId,
        map: &ArcSwap<ClusterMap>,
        reported: &mut flame_common::collections::HashMap<OsdId, Instant>,
    ) {
        reported.retain(|_, at| clock::elapsed(*at) < FAILURE_REPORT_INTERVAL);
        for failed in self.liveness.take_failed_peers() {
            // Already down in this OSD's map: the manager knows.
            let up = map.load().osds.get(&failed).is_some_and(|o| o.up);
            if failed == id || !up || reported.contains_key(&failed) {
                continue;
            }
            reported.insert(failed, clock::now());
            let report = OsdFailureReport {
                reporter: id,
                uuid: self.identity.uuid.clone(),
                failed,
                epoch: map.load().epoch,
            };
            tracing::info!(peer = %failed, "reporting an unreachable peer to the manager");
            if let Err(e) = self.post::<_, serde_json::Value>("/v1/osd/failure", &report) {
                tracing::warn!(peer = %failed, "failure report not accepted: {e}");
            }
        }
    }

    /// Test hook (`failpoints` builds): while `data_dir/failpoint-shard-stall`
    /// exists and names a shard number, that shard's thread hangs.
    #[cfg(feature = "failpoints")]
    fn apply_test_stall(&self) {
        let path = self.cfg.data_dir.join("failpoint-shard-stall");
        let wanted = std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| s.trim().parse::<u16>().ok());
        for shard in 0..self.cfg.shard_count() {
            self.liveness.set_stalled(shard, wanted == Some(shard));
        }
    }
}

impl Control {
    /// Sends the members the shards recovered (`POST /v1/pg/recovered`), one
    /// report per map epoch, each bounded by `PG_RECOVERED_ENTRIES_MAX`. A failed
    /// post is not retried here: the shard reports a member again while the map
    /// still shows it recovering.
    fn send_recovery_reports(
        &self,
        id: OsdId,
        recovery: &crate::recovery::RecoveryShared,
        wanted_epoch: &AtomicU64,
    ) {
        use flame_common::mgr_api::{PG_RECOVERED_ENTRIES_MAX, PgRecoveredReport};
        let reports = recovery.take_reports();
        if reports.is_empty() {
            return;
        }
        let mut by_epoch: std::collections::BTreeMap<_, Vec<_>> = Default::default();
        for (epoch, pg, member) in reports {
            by_epoch.entry(epoch).or_default().push((pg, member));
        }
        for (epoch, entries) in by_epoch {
            for chunk in entries.chunks(PG_RECOVERED_ENTRIES_MAX) {
                let body = PgRecoveredReport {
                    reporter: id,
                    uuid: self.identity.uuid.clone(),
                    epoch,
                    recovered: chunk.to_vec(),
                };
                match self.post::<_, serde_json::Value>("/v1/pg/recovered", &body) {
                    Ok(reply) => {
                        tracing::info!(%epoch, entries = chunk.len(), "reported recovered members");
                        // The manager's new map makes the members complete: fetch it
                        // now rather than at the next heartbeat.
                        if let Some(e) = reply.get("epoch").and_then(serde_json::Value::as_u64) {
                            wanted_epoch.fetch_max(e, Ordering::Relaxed);
                        }
                    }
                    Err(e) => tracing::warn!(%epoch, "recovery report failed: {e}"),
                }
            }
        }
    }
}

/// Bytes used by object files.
fn object_bytes_on_disk(data_dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut used = 0u64;
    let objects = data_dir.join("pgs");
    if let Ok(vols) = std::fs::read_dir(&objects) {
        for vol in vols.flatten() {
            if let Ok(files) = std::fs::read_dir(vol.path()) {
                for f in files.flatten() {
                    if let Ok(m) = f.metadata() {
                        used += m.blocks() * 512;
                    }
                }
            }
        }
    }
    used
}

/// (bytes used, bytes usable) of the file system holding `data_dir`, as df
/// computes Use%: used = blocks - free, usable = used + available to
/// unprivileged users. (0, 0) if statvfs fails (the manager then judges nothing).
/// The `disk_usage` failpoint (`return(0.97)`) reports that fraction used instead.
fn fs_usage(data_dir: &Path) -> (u64, u64) {
    let (used, usable) = statvfs_usage(data_dir).unwrap_or((0, 0));
    match crate::failpoints::forced_usage() {
        Some(fraction) if usable > 0 => ((usable as f64 * fraction) as u64, usable),
        _ => (used, usable),
    }
}

fn statvfs_usage(path: &Path) -> Option<(u64, u64)> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs writes into the zeroed struct we pass.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return None;
    }
    let frsize = st.f_frsize;
    let used = st
        .f_blocks
        .saturating_sub(st.f_bfree)
        .saturating_mul(frsize);
    let usable = used.saturating_add(st.f_bavail.saturating_mul(frsize));
    Some((used, usable))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_is_stable_and_corruption_refused() {
        let dir = tempfile::tempdir().unwrap();
        let a = Identity::load_or_create(dir.path()).unwrap();
        let b = Identity::load_or_create(dir.path()).unwrap();
        assert_eq!(a.uuid, b.uuid);
        assert_eq!(a.uuid.len(), 36);
        std::fs::write(dir.path().join("osd.json"), b"{not json").unwrap();
        assert!(
            Identity::load_or_create(dir.path())
                .unwrap_err()
                .contains("corrupt")
        );
    }
}
