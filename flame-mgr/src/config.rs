//! The manager's YAML configuration (`flame-mgr --config PATH`).
//!
//! Every key has a default so `flame-mgr` with no file starts a usable single-node
//! manager for the dev cluster; unknown keys are rejected so a typo cannot silently
//! leave a setting at its default.

use flame_common::config::Validate;
use flame_common::map::PoolConfig;
use flame_common::timing::{OsdTimings, check_lease_rule, check_report_silence};
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
/// Longest accepted `down_out_interval_ms` (30 days): longer is a typo for "never",
/// which is spelled 0.
pub const DOWN_OUT_INTERVAL_MS_MAX: u64 = 30 * 24 * 3_600_000;
/// Most `min_down_reporters` accepted (more than the OSDs of any sane failure
/// domain; only the up OSDs count anyway).
pub const MIN_DOWN_REPORTERS_MAX: u32 = 64;

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
    /// An up OSD not heard from for this long is marked down. Also how long an
    /// OSD's failure report about a peer counts.
    pub heartbeat_grace_ms: u64,
    /// An OSD down this long is marked out: its placement groups get new members,
    /// which are recovered from the remaining copies, so the pool is back to
    /// `size` copies without the operator. Counted from when this manager marked
    /// it down; a manager restart starts the clock again for every down OSD. 0
    /// disables (down OSDs stay in until `flame-admin osd out`).
    pub down_out_interval_ms: u64,
    /// Distinct up OSDs that must report a peer unreachable (`POST
    /// /v1/osd/failure`) within the heartbeat grace before it is marked down ahead
    /// of its grace. With fewer other up OSDs than this, all of them must.
    pub min_down_reporters: u32,
    /// Failure reports mark an OSD down only once the manager has not heard from it
    /// for this long. Must be at least the OSDs' `lease_ms` plus their
    /// `heartbeat_interval_ms`, so the reported OSD has stopped serving (its lease
    /// ran out) before its placement groups get a new primary: an OSD whose lease
    /// is longer refuses to run (`flame_common::timing`). Every OSD runs a lease,
    /// so it is at least the shortest one (30 ms).
    pub failure_report_min_silence_ms: u64,
    /// How often the manager looks for OSDs past their grace.
    pub failure_check_interval_ms: u64,
    /// Pool settings, used only when the cluster is created: they are fixed after
    /// that (changing them would move every object).
    pub pool: PoolConfig,
    /// An OSD whose file system is at least this fraction used is *nearfull*:
    /// `flame-admin status` warns (HEALTH_WARN); I/O is unchanged.
    pub nearfull_ratio: f64,
    /// An OSD whose file system is at least this fraction used is *full*: writes
    /// to its placement groups fail with ENOSPC (HEALTH_ERR) until space is freed
    /// (discards and write-zeroes still pass). Leaves room for what is in flight
    /// and for the OSD's own metadata.
    pub full_ratio: f64,
    /// `required` (the default): every API request but `/metrics` must be signed
    /// by a known entity, and only roles that may do a thing can
    /// (docs/security.md). `none`: anyone who reaches the port may do anything;
    /// `status` warns about it. Never `none` on a network others can reach.
    pub auth: AuthMode,
    /// The cluster keyring (`flame-admin auth init --dir DIR` writes
    /// `DIR/cluster.keyring`): the secret every entity key derives from. Needed
    /// with `auth: required`.
    pub keyring: Option<PathBuf>,
    /// Open API connections at most; beyond it new ones wait in the listen
    /// backlog (each OSD and client keeps one or two open).
    pub connections_max: u32,
    /// Open API connections from one address at most (an IPv6 host counts by
    /// its /64); beyond it a new connection is closed at once, so one host
    /// cannot take every connection (`connections_max`) from the others.
    pub connections_per_source_max: u32,
    /// How long a client may take to send a request's headers before its
    /// connection is closed (half-sent requests must not hold connections).
    /// It bounds the TLS handshake too.
    pub header_read_timeout_ms: u64,
    /// How long an API connection may sit with no request in service and no
    /// byte moving before it is closed: a peer that connects and sends
    /// nothing, or stops between requests, holds its slot no longer (clients
    /// reconnect as they need; ureq drops its own idle connections after 15 s).
    pub idle_timeout_ms: u64,
    /// TLS on the API (`flame-admin tls init` writes the files): with it the
    /// manager serves only HTTPS, and clients verify it against the cluster CA
    /// (`mgr_tls_ca`). `null`: plain HTTP (requests are still signed).
    pub tls: Option<TlsFiles>,
}

/// The manager's certificate and private key (PEM; the key mode 0600).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    /// The certificate (chain), signed by the cluster CA, naming every address
    /// clients reach the manager by.
    pub cert_file: PathBuf,
    /// Its private key.
    pub key_file: PathBuf,
}

/// Whether the API requires authentication.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AuthMode {
    /// Every request is signed; roles are enforced.
    Required,
    /// Nothing is checked.
    None,
}

impl Default for MgrConfig {
    fn default() -> Self {
        MgrConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 6800)),
            data_dir: PathBuf::from("./flame-mgr"),
            fsid: None,
            heartbeat_grace_ms: 6000,
            failure_check_interval_ms: 1000,
            down_out_interval_ms: 600_000,
            min_down_reporters: crate::state::MIN_DOWN_REPORTERS_DEFAULT,
            failure_report_min_silence_ms: 5000,
            pool: PoolConfig::default(),
            nearfull_ratio: 0.85,
            full_ratio: 0.95,
            auth: AuthMode::Required,
            keyring: None,
            connections_max: 4096,
            connections_per_source_max: 256,
            header_read_timeout_ms: 10_000,
            idle_timeout_ms: 60_000,
            tls: None,
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
        if !(16..=1_000_000).contains(&self.connections_max) {
            return Err(("connections_max".into(), "must be 16..=1000000".into()));
        }
        if !(8..=self.connections_max).contains(&self.connections_per_source_max) {
            return Err((
                "connections_per_source_max".into(),
                "must be 8..=connections_max".into(),
            ));
        }
        if !(100..=600_000).contains(&self.header_read_timeout_ms) {
            return Err((
                "header_read_timeout_ms".into(),
                "must be 100..=600000".into(),
            ));
        }
        if !(100..=3_600_000).contains(&self.idle_timeout_ms) {
            return Err(("idle_timeout_ms".into(), "must be 100..=3600000".into()));
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
        if self.down_out_interval_ms > DOWN_OUT_INTERVAL_MS_MAX {
            return Err((
                "down_out_interval_ms".into(),
                format!("must be 0 (never) or at most {DOWN_OUT_INTERVAL_MS_MAX}"),
            ));
        }
        if self.failure_report_min_silence_ms > HEARTBEAT_GRACE_MS_MAX {
            return Err((
                "failure_report_min_silence_ms".into(),
                format!("must be at most {HEARTBEAT_GRACE_MS_MAX}"),
            ));
        }
        // The lease rules (flame_common::timing) need an OSD's lease_ms +
        // heartbeat_interval_ms below the grace and within the report silence. The
        // OSDs' settings are checked against these at their boot; here, that at
        // least the shortest lease any OSD may have fits, or no OSD could join.
        let shortest = OsdTimings::MIN;
        if let Err(e) = check_lease_rule(
            shortest.lease_ms,
            shortest.heartbeat_interval_ms,
            self.heartbeat_grace_ms,
        ) {
            return Err((
                "heartbeat_grace_ms".into(),
                format!("leaves no room for any OSD's lease: {e}"),
            ));
        }
        if let Err(e) = check_report_silence(
            shortest.lease_ms,
            shortest.heartbeat_interval_ms,
            self.failure_report_min_silence_ms,
        ) {
            return Err((
                "failure_report_min_silence_ms".into(),
                format!("is shorter than any OSD's lease: {e}"),
            ));
        }
        if self.min_down_reporters == 0 || self.min_down_reporters > MIN_DOWN_REPORTERS_MAX {
            return Err((
                "min_down_reporters".into(),
                format!("must be 1..={MIN_DOWN_REPORTERS_MAX}"),
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
        self.pool.validate()?;
        if self.auth == AuthMode::Required && self.keyring.is_none() {
            return Err((
                "keyring".into(),
                "is required with `auth: required` (the default): create one with \
                 `flame-admin auth init --dir DIR` and set `keyring: DIR/cluster.keyring`, \
                 or set `auth: none` explicitly (anyone on the network may then do anything)"
                    .into(),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::config::parse_str;

    #[test]
    fn defaults_match_the_brief() {
        let e = parse_str::<MgrConfig>("", "t").unwrap_err().to_string();
        assert!(e.contains("keyring") && e.contains("auth init"), "{e}");
        let c: MgrConfig = parse_str("keyring: /k\n", "t").unwrap();
        assert_eq!(c.auth, AuthMode::Required);
        assert!(parse_str::<MgrConfig>("auth: maybe\n", "t").is_err());
        let c: MgrConfig = parse_str("auth: none\n", "t").unwrap();
        assert_eq!((c.auth, c.keyring), (AuthMode::None, None));
        assert_eq!(c.listen.to_string(), "127.0.0.1:6800");
        assert_eq!(c.data_dir, PathBuf::from("./flame-mgr"));
        assert_eq!(c.fsid, None);
        assert_eq!(c.heartbeat_grace_ms, 6000);
        assert_eq!(c.failure_check_interval_ms, 1000);
        assert_eq!(c.down_out_interval_ms, 600_000, "Ceph's 10 minutes");
        assert_eq!(c.min_down_reporters, 2);
        assert_eq!(
            c.failure_report_min_silence_ms, 5000,
            "lease 4000 + interval 1000"
        );
        assert_eq!(c.pool, PoolConfig::default());
        assert_eq!(c.nearfull_ratio, 0.85);
        assert_eq!(c.full_ratio, 0.95);
    }

    #[test]
    fn full_file_parses() {
        let c: MgrConfig = parse_str(
            "listen: 127.0.0.1:0\ndata_dir: /tmp/x\nfsid: abc-1\nheartbeat_grace_ms: 500\n\
             failure_check_interval_ms: 100\ndown_out_interval_ms: 0\n\
             min_down_reporters: 3\nauth: none\npool:\n  size: 2\n  min_size: 1\n  pg_count: 64\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.fsid.as_deref(), Some("abc-1"));
        assert_eq!((c.down_out_interval_ms, c.min_down_reporters), (0, 3));
        assert_eq!(c.pool.size, 2);
        assert_eq!(c.pool.object_size, 4 << 20);
    }

    /// Rule: the grace leaves room for the shortest lease an OSD may have
    /// (`lease_ms` 20 + `heartbeat_interval_ms` 10 < grace).
    #[test]
    fn the_grace_must_leave_room_for_a_lease() {
        let e = parse_str::<MgrConfig>("auth: none\nheartbeat_grace_ms: 30\n", "t")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("heartbeat_grace_ms") && e.contains("lease_ms (20)"),
            "{e}"
        );
        parse_str::<MgrConfig>(
            "auth: none\nheartbeat_grace_ms: 31\nfailure_report_min_silence_ms: 30\n",
            "t",
        )
        .unwrap();
    }

    /// Rule: the failure-report silence covers at least the shortest lease (0,
    /// "reports act at once", would let reports replace an OSD whose lease runs).
    #[test]
    fn the_report_silence_must_cover_a_lease() {
        for silence in [0, 29] {
            let e = parse_str::<MgrConfig>(
                &format!("auth: none\nfailure_report_min_silence_ms: {silence}\n"),
                "t",
            )
            .unwrap_err()
            .to_string();
            assert!(
                e.contains("failure_report_min_silence_ms") && e.contains("lease_ms (20)"),
                "{e}"
            );
        }
        parse_str::<MgrConfig>("auth: none\nfailure_report_min_silence_ms: 30\n", "t").unwrap();
    }

    /// Both daemons' defaults satisfy every timing rule.
    #[test]
    fn the_defaults_admit_the_osds_default_timing() {
        let m: MgrConfig = parse_str("auth: none\n", "t").unwrap();
        flame_common::timing::check_osd_against_mgr(
            OsdTimings {
                lease_ms: 4000,
                heartbeat_interval_ms: 1000,
            },
            flame_common::timing::MgrTimings {
                heartbeat_grace_ms: m.heartbeat_grace_ms,
                failure_report_min_silence_ms: m.failure_report_min_silence_ms,
            },
        )
        .unwrap();
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
            ("min_down_reporters: 0\n", "min_down_reporters"),
            ("down_out_interval_ms: 9999999999\n", "down_out_interval_ms"),
            (
                "new_osds_in_with_volumes: true\n",
                "new_osds_in_with_volumes",
            ),
            ("pool:\n  min_size: 4\n", "pool.min_size"),
            ("pool:\n  sise: 4\n", "sise"),
            ("listen: nowhere\n", "listen"),
            ("full_ratio: 1.5\n", "full_ratio"),
            ("nearfull_ratio: 0.99\n", "nearfull_ratio"),
            (
                "connections_max: 64\nconnections_per_source_max: 65\n",
                "connections_per_source_max",
            ),
            (
                "connections_per_source_max: 2\n",
                "connections_per_source_max",
            ),
        ] {
            let e = parse_str::<MgrConfig>(yaml, "t").unwrap_err().to_string();
            assert!(e.contains(key), "{yaml:?} → {e}");
        }
    }
}

/// Property test of this configuration's YAML decoding (`parse_str`): arbitrary
/// text and the shipped example (`deploy/examples/mgr.yaml`) with bytes flipped,
/// inserted, deleted or cut give the configuration or an error naming the key,
/// never a panic or a hang (YAML aliases, deep nesting and huge numbers included).
/// Seeded and bounded (`PROPTEST_CASES` / `PROPTEST_RNG_SEED` override); the
/// cargo-fuzz target of every configuration is `fuzz/fuzz_targets/config.rs`.
#[cfg(test)]
mod props {
    use super::*;
    use flame_common::config::parse_str;
    use flame_common::fuzzing::mutate;
    use flame_common::fuzzing::props::config;
    use proptest::prelude::*;

    const EXAMPLE: &str = include_str!("../../deploy/examples/mgr.yaml");

    /// This file's proptest seed (`config`).
    const SEED: u64 = 0xf1a3_0018;

    #[test]
    fn the_shipped_example_parses() {
        parse_str::<MgrConfig>(EXAMPLE, "mgr.yaml").expect("deploy/examples/mgr.yaml");
    }

    proptest! {
        #![proptest_config(config(128, SEED))]

        #[test]
        fn yaml_configs_parse_or_fail_cleanly(
            text in "[a-z_:{}\\[\\],&*!|>#0-9 .\n-]{0,80}",
            m in proptest::collection::vec(any::<(u8, u32, u8)>(), 0..8),
        ) {
            let _ = parse_str::<MgrConfig>(&text, "t");
            let mut b = EXAMPLE.as_bytes().to_vec();
            mutate(&mut b, &m);
            let _ = parse_str::<MgrConfig>(&String::from_utf8_lossy(&b), "t");
        }
    }
}
