//! The manager's YAML configuration (`flame-mgr --config PATH`).
//!
//! Every key has a default so `flame-mgr` with no file starts a usable single-node
//! manager for the dev cluster; unknown keys are rejected so a typo cannot silently
//! leave a setting at its default.

use flame_common::config::Validate;
use flame_common::map::PoolConfig;
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Longest accepted cluster id: it is stored in every map and shown in tables.
pub const FSID_BYTES_MAX: usize = 64;
/// Longest accepted heartbeat grace (1 hour). Longer would effectively disable
/// failure detection, which should be a deliberate code change, not a config typo.
pub const HEARTBEAT_GRACE_MS_MAX: u64 = 3_600_000;
/// Shortest accepted failure-check interval: below this the check loop would spin
/// for no benefit (heartbeats themselves are ~1 s apart).
pub const FAILURE_CHECK_INTERVAL_MS_MIN: u64 = 10;
/// Longest accepted failure-check interval (1 minute).
pub const FAILURE_CHECK_INTERVAL_MS_MAX: u64 = 60_000;

/// `flame-mgr` settings.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MgrConfig {
    /// Address of the HTTP API (which also serves `/metrics`). Port 0 picks a free
    /// port; the bound address is logged ("listening on ...").
    pub listen: SocketAddr,
    /// Directory holding `state.json`, the manager's only persistent state.
    pub data_dir: PathBuf,
    /// Cluster id to use when creating a new cluster; `null` generates a random one.
    /// If set and an existing state has another fsid, start-up fails: the config
    /// points at the wrong data directory.
    pub fsid: Option<String>,
    /// An up OSD not heard from for this long is marked down.
    pub heartbeat_grace_ms: u64,
    /// How often the manager looks for OSDs past their grace.
    pub failure_check_interval_ms: u64,
    /// Pool settings, used only when the cluster is created: they are fixed after
    /// that (changing them would move every object).
    pub pool: PoolConfig,
    /// Whether an OSD registering for the first time joins `in` even though
    /// volumes exist. Off by default: without backfill (not implemented yet) the
    /// placement groups it takes over would read back as zeroes. Turn it on only
    /// for a cluster whose volumes hold no data yet.
    pub new_osds_in_with_volumes: bool,
    /// An OSD whose file system is at least this fraction used is *nearfull*:
    /// `flame-admin status` warns (HEALTH_WARN); I/O is unchanged.
    pub nearfull_ratio: f64,
    /// An OSD whose file system is at least this fraction used is *full*: writes
    /// to its placement groups fail with ENOSPC (HEALTH_ERR) until space is freed
    /// (discards and write-zeroes still pass). Leaves room for what is in flight
    /// and for the OSD's own metadata.
    pub full_ratio: f64,
}

impl Default for MgrConfig {
    fn default() -> Self {
        MgrConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 6800)),
            data_dir: PathBuf::from("./flame-mgr"),
            fsid: None,
            heartbeat_grace_ms: 6000,
            failure_check_interval_ms: 1000,
            pool: PoolConfig::default(),
            new_osds_in_with_volumes: false,
            nearfull_ratio: 0.85,
            full_ratio: 0.95,
        }
    }
}

/// Checks a cluster id: short and of a safe alphabet, since it appears in logs,
/// file contents and tables.
pub fn validate_fsid(fsid: &str) -> Result<(), String> {
    if fsid.is_empty() || fsid.len() > FSID_BYTES_MAX {
        return Err(format!("must be 1..={FSID_BYTES_MAX} bytes"));
    }
    if !fsid
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err("may contain only A-Z a-z 0-9 - _ .".into());
    }
    Ok(())
}

impl Validate for MgrConfig {
    fn validate(&self) -> Result<(), (String, String)> {
        if self.data_dir.as_os_str().is_empty() {
            return Err(("data_dir".into(), "must not be empty".into()));
        }
        if let Some(fsid) = &self.fsid {
            validate_fsid(fsid).map_err(|m| ("fsid".to_string(), m))?;
        }
        if self.heartbeat_grace_ms == 0 || self.heartbeat_grace_ms > HEARTBEAT_GRACE_MS_MAX {
            return Err((
                "heartbeat_grace_ms".into(),
                format!("must be 1..={HEARTBEAT_GRACE_MS_MAX}"),
            ));
        }
        if !(FAILURE_CHECK_INTERVAL_MS_MIN..=FAILURE_CHECK_INTERVAL_MS_MAX)
            .contains(&self.failure_check_interval_ms)
        {
            return Err((
                "failure_check_interval_ms".into(),
                format!(
                    "must be {FAILURE_CHECK_INTERVAL_MS_MIN}..={FAILURE_CHECK_INTERVAL_MS_MAX}"
                ),
            ));
        }
        if !(self.nearfull_ratio > 0.0 && self.nearfull_ratio <= 1.0) {
            return Err(("nearfull_ratio".into(), "must be in (0, 1]".into()));
        }
        if !(self.full_ratio > 0.0 && self.full_ratio <= 1.0) {
            return Err(("full_ratio".into(), "must be in (0, 1]".into()));
        }
        if self.nearfull_ratio > self.full_ratio {
            return Err((
                "nearfull_ratio".into(),
                format!("must not exceed full_ratio ({})", self.full_ratio),
            ));
        }
        self.pool.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::config::parse_str;

    #[test]
    fn defaults_match_the_brief() {
        let c: MgrConfig = parse_str("", "t").unwrap();
        assert_eq!(c.listen.to_string(), "127.0.0.1:6800");
        assert_eq!(c.data_dir, PathBuf::from("./flame-mgr"));
        assert_eq!(c.fsid, None);
        assert_eq!(c.heartbeat_grace_ms, 6000);
        assert_eq!(c.failure_check_interval_ms, 1000);
        assert_eq!(c.pool, PoolConfig::default());
        assert_eq!(c.nearfull_ratio, 0.85);
        assert_eq!(c.full_ratio, 0.95);
    }

    #[test]
    fn full_file_parses() {
        let c: MgrConfig = parse_str(
            "listen: 127.0.0.1:0\ndata_dir: /tmp/x\nfsid: abc-1\nheartbeat_grace_ms: 500\n\
             failure_check_interval_ms: 100\npool:\n  size: 2\n  min_size: 1\n  pg_count: 64\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.fsid.as_deref(), Some("abc-1"));
        assert_eq!(c.pool.size, 2);
        assert_eq!(c.pool.object_size, 4 << 20);
    }

    #[test]
    fn bad_values_name_the_key() {
        for (yaml, key) in [
            ("heartbeat_grace_ms: 0\n", "heartbeat_grace_ms"),
            (
                "failure_check_interval_ms: 1\n",
                "failure_check_interval_ms",
            ),
            ("fsid: \"a b\"\n", "fsid"),
            ("pool:\n  min_size: 4\n", "pool.min_size"),
            ("pool:\n  sise: 4\n", "sise"),
            ("listen: nowhere\n", "listen"),
            ("full_ratio: 1.5\n", "full_ratio"),
            ("nearfull_ratio: 0.99\n", "nearfull_ratio"),
        ] {
            let e = parse_str::<MgrConfig>(yaml, "t").unwrap_err().to_string();
            assert!(e.contains(key), "{yaml:?} → {e}");
        }
    }
}
