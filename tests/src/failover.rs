//! Harness pieces for the failure tests: OSD ids, waiting for map states (down,
//! out, clean), adding an OSD to a running cluster, and comparing the copies of
//! every placement group byte for byte from the OSDs' data directories.

use crate::{OBJECT_DATA_OFFSET, STARTUP_TIMEOUT, TestCluster, osd_daemon};
use flame_common::ids::{ObjectId, OsdId, PgId, VolumeId};
use flame_common::map::ClusterMap;
use flame_common::placement::{PgMembers, PgTable, object_pg};
use std::fmt;
use std::fmt::Write as _;
use std::fs;
use std::time::{Duration, Instant};

/// How often the map is polled while waiting for a state.
const POLL: Duration = Duration::from_millis(50);

/// The placement groups of `map` that are not clean (see
/// [`PgMembers::is_clean`]), with their roles.
pub fn unclean_pgs(map: &ClusterMap) -> Vec<(PgId, PgMembers)> {
    PgTable::new(map)
        .iter()
        .filter(|(_, m)| !m.is_clean(map.pool.size))
        .map(|(pg, m)| (pg, m.clone()))
        .collect()
}

/// What [`TestCluster::compare_copies`] found.
#[derive(Clone, Debug, Default)]
pub struct CopyReport {
    /// Objects compared (each across all of its placement group's acting members).
    pub objects: u64,
    /// Copies read (object × acting member).
    pub copies: u64,
    /// Placement groups that had fewer than `size` acting members.
    pub degraded_pgs: Vec<PgId>,
    /// Differences between copies (must be empty).
    pub mismatches: Vec<String>,
    /// Object files on OSDs that are not members of the object's group.
    pub strays: Vec<String>,
}

impl fmt::Display for CopyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} objects, {} copies compared, {} degraded groups, {} mismatches, {} stray files",
            self.objects,
            self.copies,
            self.degraded_pgs.len(),
            self.mismatches.len(),
            self.strays.len()
        )?;
        for m in self.mismatches.iter().take(20) {
            write!(f, "\n  mismatch: {m}")?;
        }
        for m in self.strays.iter().take(20) {
            write!(f, "\n  stray: {m}")?;
        }
        Ok(())
    }
}

impl TestCluster {
    /// The cluster id of OSD process `i` (looked up in the manager's map by its data
    /// address), or `None` if the manager does not list it.
    pub fn try_osd_id(&self, map: &ClusterMap, i: usize) -> Option<OsdId> {
        let addr = self.osd_addr(i, 0);
        map.osds.values().find(|o| o.addr == addr).map(|o| o.id)
    }

    /// The cluster id of OSD process `i`; panics if the manager does not list it.
    pub fn osd_id(&self, i: usize) -> OsdId {
        let map = self.map();
        self.try_osd_id(&map, i)
            .unwrap_or_else(|| panic!("osd.{i} is not in the map\n{}", self.log_tails()))
    }

    /// The harness index of the OSD with cluster id `id`.
    pub fn osd_index(&self, map: &ClusterMap, id: OsdId) -> Option<usize> {
        let addr = map.osds.get(&id)?.addr;
        (0..self.osd_count()).find(|&i| self.osd_addr(i, 0) == addr)
    }

    /// Polls the manager's map until `problem(map)` returns `None`, up to `timeout`;
    /// returns how long it took, or the last problem on timeout.
    pub fn try_wait_map(
        &self,
        timeout: Duration,
        mut problem: impl FnMut(&ClusterMap) -> Option<String>,
    ) -> Result<Duration, String> {
        let t0 = Instant::now();
        loop {
            let got = self.api_get("/v1/map").and_then(|(code, body)| {
                if code == 200 {
                    serde_json::from_str::<ClusterMap>(&body).map_err(|e| e.to_string())
                } else {
                    Err(format!("HTTP {code}: {body}"))
                }
            });
            let last = match got {
                Ok(map) => match problem(&map) {
                    None => return Ok(t0.elapsed()),
                    Some(p) => format!("epoch {}: {p}", map.epoch.0),
                },
                Err(e) => e,
            };
            if t0.elapsed() > timeout {
                return Err(last);
            }
            std::thread::sleep(POLL);
        }
    }

    /// [`Self::try_wait_map`], panicking with the last problem and the logs on
    /// timeout.
    pub fn wait_map(
        &self,
        what: &str,
        timeout: Duration,
        problem: impl FnMut(&ClusterMap) -> Option<String>,
    ) -> Duration {
        self.try_wait_map(timeout, problem).unwrap_or_else(|last| {
            panic!(
                "{what}: not reached within {timeout:?}: {last}\n{}",
                self.log_tails()
            )
        })
    }

    /// Waits until the map shows OSD process `i` down; returns how long it took.
    pub fn wait_osd_down(&self, i: usize, timeout: Duration) -> Duration {
        let id = self.osd_id(i);
        self.wait_map(&format!("osd.{i} ({id}) down"), timeout, |m| {
            m.osds
                .get(&id)
                .filter(|o| o.up)
                .map(|_| "still up".to_string())
        })
    }

    /// Waits until the map shows OSD process `i` out; returns how long it took.
    pub fn wait_osd_out(&self, i: usize, timeout: Duration) -> Duration {
        let id = self.osd_id(i);
        self.wait_map(&format!("osd.{i} ({id}) out"), timeout, |m| {
            m.osds
                .get(&id)
                .filter(|o| o.r#in)
                .map(|_| "still in".to_string())
        })
    }

    /// Waits until every placement group is clean in the manager's map: `size`
    /// complete copies up, where placement puts them, nothing recovering. Returns
    /// how long it took.
    pub fn wait_clean(&self, timeout: Duration) -> Duration {
        self.try_wait_clean(timeout).unwrap_or_else(|last| {
            panic!(
                "all placement groups clean: not reached within {timeout:?}: {last}\n{}",
                self.log_tails()
            )
        })
    }

    /// Waits until every OSD process in `osds` has compared every member's copy
    /// of each group it is the primary of (its `/v1/pgs` lists groups, and none
    /// of its primary ones is unpeered; `flame_osd_pgs_unpeered` shows the same
    /// to operators). A clean map does not say so: a new primary's peering pass
    /// goes through its groups one after another, and until it reaches a group
    /// it may overwrite a member's differing copy (which a test corrupting a
    /// copy on purpose would see repaired behind its back).
    pub fn wait_peered(&self, osds: &[usize], timeout: Duration) {
        let t0 = Instant::now();
        let unpeered = |i: usize| -> Result<usize, String> {
            let (code, body) = crate::http_get(self.osd_metrics_addr(i), "/v1/pgs")?;
            let pgs: Vec<serde_json::Value> =
                serde_json::from_str(&body).map_err(|e| format!("HTTP {code}: {e}: {body}"))?;
            if pgs.is_empty() {
                return Err("no group published yet".into());
            }
            Ok(pgs
                .iter()
                .filter(|p| p["role"] == "primary" && p["peered"] != true)
                .count())
        };
        loop {
            let left: Vec<(usize, Result<usize, String>)> = osds
                .iter()
                .map(|&i| (i, unpeered(i)))
                .filter(|(_, r)| r != &Ok(0))
                .collect();
            if left.is_empty() {
                return;
            }
            assert!(
                t0.elapsed() < timeout,
                "groups not peered within {timeout:?} (osd process, unpeered groups): {left:?}\n{}",
                self.log_tails()
            );
            std::thread::sleep(POLL);
        }
    }

    /// [`Self::wait_clean`] without the panic: the last problem on timeout.
    pub fn try_wait_clean(&self, timeout: Duration) -> Result<Duration, String> {
        self.try_wait_map(timeout, |m| {
            let bad = unclean_pgs(m);
            let (pg, members) = bad.first()?;
            Some(format!(
                "{} groups not clean, e.g. pg {} {members:?}",
                bad.len(),
                pg.0
            ))
        })
    }

    /// Starts one more OSD process (a new, empty data directory, its own host name)
    /// and waits until it is up and `in`; returns its harness index.
    pub fn add_osd(&mut self) -> usize {
        let i = self.osds.len();
        let ip = self.ips.osd(i);
        self.ips.osds.push(ip);
        let (daemon, addrs) = osd_daemon(
            &self.root,
            &self.bin_dir,
            (self.mgr_addr, self.keys.as_ref()),
            &self.opts,
            i,
            ip,
        );
        self.osds.push(daemon);
        self.osd_addrs.push(addrs);
        if self.keys.is_some() {
            // Its own key, as every OSD of the harness.
            self.add_osd_entity(i);
        }
        let since = Instant::now();
        self.osds[i].start();
        self.wait_osd_ready(i, since);
        let id = self.osd_id(i);
        self.wait_map(&format!("new osd.{i} ({id}) in"), STARTUP_TIMEOUT, |m| {
            m.osds
                .get(&id)
                .filter(|o| !o.r#in)
                .map(|_| "joined out".to_string())
        });
        i
    }

    /// Number of object files of `volume` in each OSD process's data directory.
    pub fn object_files_per_osd(&self, volume: VolumeId) -> Vec<usize> {
        let prefix = format!("{:016x}.", volume.0);
        (0..self.osd_count())
            .map(|i| {
                let Ok(pgs) = fs::read_dir(self.osd_data_dir(i).join("pgs")) else {
                    return 0;
                };
                pgs.filter_map(Result::ok)
                    .filter_map(|pg| fs::read_dir(pg.path()).ok())
                    .flat_map(|files| files.filter_map(Result::ok))
                    .filter(|f| f.file_name().to_string_lossy().starts_with(&prefix))
                    .count()
            })
            .collect()
    }

    /// Compares, for each of the first `objects` objects of `volume`, the data of
    /// every copy held by its placement group's acting members in the current map
    /// (read from their data directories; a missing file or missing bytes read as
    /// zero), and lists object files on OSDs that are not members of the group.
    ///
    /// The cluster must be quiet (no writes in flight) and acknowledged writes are
    /// in the object files already (the OSDs write through to the files before they
    /// acknowledge), so copies of a healthy group are byte-identical.
    pub fn compare_copies(&self, volume: VolumeId, objects: u64) -> CopyReport {
        let map = self.map();
        let object_size = map.pool.object_size as usize;
        let mut report = CopyReport::default();
        for index in 0..objects {
            let object = ObjectId { volume, index };
            let pg = object_pg(object, map.pool.pg_count);
            let members = PgMembers::compute(&map, pg);
            if members.acting.len() < map.pool.size as usize && !report.degraded_pgs.contains(&pg) {
                report.degraded_pgs.push(pg);
            }
            let mut first: Option<(OsdId, Vec<u8>)> = None;
            for &id in &members.acting {
                let Some(i) = self.osd_index(&map, id) else {
                    report
                        .mismatches
                        .push(format!("{object}: acting {id} is not a harness OSD"));
                    continue;
                };
                let mut data = self.object_data(i, volume, index).unwrap_or_default();
                if data.len() > object_size {
                    report.mismatches.push(format!(
                        "{object} on {id}: {} data bytes, more than the object size",
                        data.len()
                    ));
                }
                data.resize(object_size, 0);
                report.copies += 1;
                match &first {
                    None => first = Some((id, data)),
                    Some((id0, d0)) => {
                        if let Some(diff) = crate::first_difference(d0, &data) {
                            report.mismatches.push(format!(
                                "{object} (pg {}): {id0} vs {id}: {diff} (block {})",
                                pg.0,
                                d0.iter().zip(&data).position(|(a, b)| a != b).unwrap_or(0) / 4096
                            ));
                        }
                    }
                }
            }
            for i in 0..self.osd_count() {
                let Some(id) = self.try_osd_id(&map, i) else {
                    continue;
                };
                let path = self.object_path(i, volume, index);
                // A down OSD cannot delete anything; its leftovers are not strays.
                let up = map.osds.get(&id).is_some_and(|o| o.up);
                if up && !members.is_member(id) && path.exists() {
                    report.strays.push(format!(
                        "{object} (pg {}) on {id}, not a member {members:?}",
                        pg.0
                    ));
                }
            }
            report.objects += 1;
        }
        report
    }

    /// What every OSD's data directory holds now for oracle block `block` of
    /// `volume` (written with `magic`), one line per OSD with its role in the
    /// block's group: for a stale read's report (which copy is old, and is it the
    /// one that serves?).
    pub fn block_copies(&self, volume: VolumeId, magic: u64, block: u64) -> String {
        let map = self.map();
        let object_size = u64::from(map.pool.object_size).max(1);
        let offset = block * crate::oracle::BLOCK as u64;
        let (index, within) = (offset / object_size, (offset % object_size) as usize);
        let pg = object_pg(ObjectId { volume, index }, map.pool.pg_count);
        let members = PgMembers::compute(&map, pg);
        let mut out = format!(
            "block {block}: object {index} at {within}, pg {} (map e{}: {members:?})\n",
            pg.0, map.epoch.0
        );
        for i in 0..self.osd_count() {
            let id = self.try_osd_id(&map, i);
            let what = match self.object_data(i, volume, index) {
                None => "no object file".to_string(),
                Some(data) => {
                    let mut b = data
                        .get(within..within + crate::oracle::BLOCK)
                        .unwrap_or_default()
                        .to_vec();
                    b.resize(crate::oracle::BLOCK, 0);
                    match crate::oracle::check_block(magic, block, &b, 0, u64::MAX) {
                        Ok(0) => "zeroes".to_string(),
                        Ok(c) => format!("counter {c}"),
                        Err(e) => format!("{e}"),
                    }
                }
            };
            let role = match id {
                Some(id) if members.primary() == Some(id) => "primary",
                Some(id) if members.acting.contains(&id) => "acting",
                Some(id) if members.recovering.contains(&id) => "recovering",
                Some(id) if members.is_member(id) => "member",
                Some(_) => "not a member",
                None => "not registered",
            };
            let _ = writeln!(
                out,
                "  osd process {i} ({}): {role}: {what}",
                id.map_or("?".to_string(), |id| id.to_string())
            );
        }
        out
    }

    /// Bytes of object data (file size past the header and checksum area) in each
    /// OSD process's data directory: what recovery and rebalancing move.
    pub fn object_data_bytes_per_osd(&self) -> Vec<u64> {
        (0..self.osd_count())
            .map(|i| {
                let Ok(pgs) = fs::read_dir(self.osd_data_dir(i).join("pgs")) else {
                    return 0;
                };
                pgs.filter_map(Result::ok)
                    .filter_map(|pg| fs::read_dir(pg.path()).ok())
                    .flat_map(|files| files.filter_map(Result::ok))
                    .filter_map(|f| f.metadata().ok())
                    .map(|m| m.len().saturating_sub(OBJECT_DATA_OFFSET as u64))
                    .sum()
            })
            .collect()
    }
}

/// Panics unless `report` shows every copy identical and no degraded group.
#[track_caller]
pub fn assert_copies_identical(cluster: &TestCluster, report: &CopyReport) {
    assert!(
        report.mismatches.is_empty() && report.degraded_pgs.is_empty() && report.copies > 0,
        "copies differ: {report}\n{}",
        cluster.log_tails()
    );
}

/// The default timeout for a cluster to become clean after a failure in the tests.
pub const CLEAN_TIMEOUT: Duration = STARTUP_TIMEOUT;
