//! `flame-osd` configuration (YAML, every key optional; see docs/configuration.md).

use flame_common::config::{Validate, cores};
use flame_common::reactor::PollMode;
use flame_common::timing::{
    MgrTimings, OSD_HEARTBEAT_INTERVAL_MS_MAX, OSD_HEARTBEAT_INTERVAL_MS_MIN, OSD_LEASE_MS_MAX,
    OsdTimings, TimingError, check_lease_outlives_heartbeats, check_osd_against_mgr,
};
use flame_common::transport::tcp::SEND_QUEUE_BYTES_MAX;
use flame_common::transport::{StallBounds, TransportKind};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Whether object files are opened with `O_DIRECT`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DirectIo {
    /// Use `O_DIRECT` if the data directory's file system supports it (tmpfs does not).
    #[default]
    Auto,
    /// Require `O_DIRECT`; refuse to start without it.
    On,
    /// Always use the page cache.
    Off,
}

/// Upper bound of `network_threads` (the staged mode is a comparison, not a
/// scaling knob).
pub const NETWORK_THREADS_MAX: u16 = 64;

/// How the OSD's threads divide a request's work (docs/architecture.md).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Threading {
    /// One shard thread receives, decodes, executes, replicates and replies: no
    /// hand-off, no lock (the Flame thesis's penetrating model).
    #[default]
    Penetrating,
    /// Network threads receive and decode, shard threads execute, through bounded
    /// queues both ways (Ceph's messenger + op shards). For comparison only.
    Staged,
}

/// Settings of one OSD.
#[derive(Clone, Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OsdConfig {
    /// Manager API address: `host:port`, or an `http://` or `https://` URL.
    pub mgr: String,
    /// This OSD's own keyring, `osd.N` (`flame-admin auth add osd.N`; the shared
    /// `osd` keyring of older deployments works too), that it signs its manager
    /// requests with. Needed unless the manager runs with
    /// `auth: none`; without it such a manager refuses the boot, and the OSD
    /// stops with the manager's reason.
    pub keyring: Option<PathBuf>,
    /// The cluster CA (`flame-admin tls init`'s `ca.crt`) when the manager
    /// serves TLS: its certificate is verified against this CA only. `null`:
    /// plain HTTP.
    pub mgr_tls_ca: Option<PathBuf>,
    /// Data address of shard 0; shard `i` listens on port + `i`.
    pub listen: SocketAddr,
    /// Address published in the cluster map for shard 0 (clients and peers connect
    /// there). Defaults to `listen`; set it when `listen` is a wildcard such as
    /// `0.0.0.0:6900`. Its port must equal `listen`'s port.
    pub advertise: Option<SocketAddr>,
    /// Prometheus endpoint.
    pub metrics_listen: SocketAddr,
    /// Where objects and the OSD's identity live.
    pub data_dir: PathBuf,
    /// Failure domain name; defaults to the machine's host name.
    pub host: Option<String>,
    /// Placement weight.
    pub weight: f64,
    /// Shard threads; 0 means one per core.
    pub shards: u16,
    /// Transport for clients and peers.
    pub transport: TransportKind,
    /// Idle strategy of the shard threads (and of the network threads in staged
    /// mode).
    pub poll_mode: PollMode,
    /// `penetrating` (default) or `staged` (for comparison: [`Threading`]).
    pub threading: Threading,
    /// Network threads of the staged mode (ignored when penetrating); shard
    /// listeners are spread over them round-robin.
    pub network_threads: u16,
    /// `O_DIRECT` policy.
    pub direct_io: DirectIo,
    /// Keep a crc32c per 4 KiB block and verify it on every read. Fixed when the
    /// data directory is formatted (the superblock records it); `false` exists to
    /// measure what checksums cost.
    pub checksums: bool,
    /// Heartbeat period.
    pub heartbeat_interval_ms: u64,
    /// How long after sending its last manager-acknowledged heartbeat this OSD may
    /// serve and acknowledge I/O; past it, every read and write is answered EAGAIN.
    /// Must satisfy `lease_ms + heartbeat_interval_ms < heartbeat_grace_ms` of the
    /// manager, so a cut-off OSD stops acknowledging before the manager can mark it
    /// down and choose a successor (docs/guarantees.md, "Fencing").
    pub lease_ms: u64,
    /// A shard thread whose loop has not run for this long is hung: the OSD stops
    /// heartbeating, so the manager marks it down instead of letting its placement
    /// groups wait on a shard that never answers.
    pub shard_stall_ms: u64,
    /// Connections one shard accepts before refusing more.
    pub max_connections_per_shard: u32,
    /// Connections one source address may hold to one shard.
    pub max_connections_per_source: u32,
    /// Of `max_connections_per_shard`, how many only OSD peers may take: a flood
    /// of client connections never stops replication.
    pub connections_reserved_for_peers: u32,
    /// How long a connection may take to deliver a payload once its header
    /// arrived (tcp): a trickling sender holds a pool buffer, so past this its
    /// connection is closed.
    pub payload_recv_timeout_ms: u64,
    /// How long the shard may be stuck writing to a connection that does not
    /// read its replies (tcp) before closing it.
    pub send_stall_timeout_ms: u64,
    /// How long a tcp connection may send nothing while nothing is in flight on
    /// it before it is closed, freeing its slot (0 = never). Clients and peers
    /// reconnect on their next request. Ceph's `ms_connection_idle_timeout`.
    pub idle_timeout_ms: u64,
    /// Requests one connection may have in flight; further requests wait unread in
    /// the socket, which back-pressures the sender.
    pub max_inflight_per_connection: u32,
    /// Payload bytes (write data, read lengths) one shard lets be in flight across
    /// all its connections; beyond it, connections stop reading until requests
    /// finish. Bounds a shard's memory whatever its clients do.
    pub max_inflight_bytes_per_shard: u64,
    /// Payload bytes (forwarded writes, recovery reads) one shard lets OSD peers
    /// have in flight, across all their connections; beyond it, peer connections
    /// stop reading until requests finish. A bound of its own, so peers never
    /// wait behind clients (`crate::byte_budget`).
    pub max_peer_inflight_bytes_per_shard: u64,
    /// Object files one shard keeps open.
    pub open_files_per_shard_max: u32,
    /// Registered payload memory of the shard threads (docs/configuration.md,
    /// "memory_pool").
    pub memory_pool: flame_common::buffer::registered::MemoryPoolConfig,
    /// How long a peer connection attempt may take.
    pub connect_timeout_ms: u64,
    /// How long a replica may take to apply a forwarded write before the primary
    /// fails the client's write with EAGAIN (the client retries).
    pub replica_timeout_ms: u64,
    /// Entries kept in each placement group's log (memory: about 64 bytes each).
    /// A member that missed more writes than this is backfilled (every object of
    /// the group compared) instead of caught up from the log.
    pub pg_log_entries_max: u32,
    /// Objects one shard recovers at once (each holds the object's write gate
    /// while it is copied, so client writes to it wait).
    pub recovery_max_active: u32,
    /// Bytes per second one shard copies for recovery (0 = unlimited), so client
    /// I/O keeps flowing while a member is recovered.
    pub recovery_bytes_per_sec: u64,
    /// Seconds between background scrubs of each placement group this OSD is the
    /// primary of (0 = no background scrub; `flame-admin scrub` still works).
    pub scrub_interval_s: u64,
    /// Bytes per second one shard reads for background scrubs (0 = unlimited).
    pub scrub_bytes_per_sec: u64,
    /// How long a copy of a placement group this OSD is no longer a member of is
    /// kept before it is deleted (the group must also be active meanwhile).
    pub stray_delete_delay_ms: u64,
    /// Remote fetching: most slots of the reply area one client connection may be
    /// granted (0: never grant one; clients then get pushed replies). Each slot
    /// holds a 128-byte header and up to `reply_slot_payload_bytes_max` bytes.
    pub reply_slots_per_connection_max: u32,
    /// Remote fetching: most payload bytes of one reply slot (replies with more
    /// are pushed).
    pub reply_slot_payload_bytes_max: u32,
    /// Grants reply areas on connections whose one-sided READ is emulated by
    /// this OSD's connection thread (tcp), where every fetch is a round trip
    /// through this OSD: only to exercise and measure remote fetching where no
    /// native transport is available.
    pub reply_area_over_emulated: bool,
}

impl OsdConfig {
    /// How long a connection may be stuck or idle (`Conn::stall`) before it is
    /// closed (`payload_recv_timeout_ms`, `send_stall_timeout_ms`,
    /// `idle_timeout_ms`).
    pub fn stall_bounds(&self) -> StallBounds {
        StallBounds::from_ms(self.payload_recv_timeout_ms, self.send_stall_timeout_ms)
            .with_idle_ms(self.idle_timeout_ms)
    }
}

impl Default for OsdConfig {
    fn default() -> Self {
        OsdConfig {
            mgr: "127.0.0.1:6800".into(),
            keyring: None,
            mgr_tls_ca: None,
            listen: SocketAddr::from(([127, 0, 0, 1], 6900)),
            advertise: None,
            metrics_listen: SocketAddr::from(([127, 0, 0, 1], 9201)),
            data_dir: PathBuf::from("./flame-osd"),
            host: None,
            weight: 1.0,
            shards: 0,
            transport: TransportKind::Tcp,
            poll_mode: PollMode::Interrupt,
            threading: Threading::Penetrating,
            network_threads: 1,
            direct_io: DirectIo::Auto,
            checksums: true,
            heartbeat_interval_ms: 1000,
            lease_ms: 4000,
            shard_stall_ms: 2000,
            max_connections_per_shard: 1024,
            max_connections_per_source: 256,
            connections_reserved_for_peers: 64,
            payload_recv_timeout_ms: 10_000,
            send_stall_timeout_ms: 30_000,
            idle_timeout_ms: 900_000,
            max_inflight_per_connection: 256,
            max_inflight_bytes_per_shard: 128 << 20,
            max_peer_inflight_bytes_per_shard: 256 << 20,
            open_files_per_shard_max: 1024,
            memory_pool: Default::default(),
            connect_timeout_ms: 2000,
            replica_timeout_ms: 10_000,
            pg_log_entries_max: 2048,
            recovery_max_active: 2,
            recovery_bytes_per_sec: 0,
            scrub_interval_s: 86_400,
            scrub_bytes_per_sec: 64 << 20,
            stray_delete_delay_ms: 5_000,
            reply_slots_per_connection_max: 64,
            reply_slot_payload_bytes_max: 4096,
            reply_area_over_emulated: false,
        }
    }
}

/// How often each shard thread records that its loop runs (see `shard_stall_ms`).
pub const PROGRESS_INTERVAL_MS: u64 = 100;

/// Most shard threads: more than cores only adds context switches.
pub const SHARDS_MAX: u16 = 256;

impl OsdConfig {
    /// Shard count with 0 resolved to the core count.
    pub fn shard_count(&self) -> u16 {
        if self.shards == 0 {
            cores().clamp(1, usize::from(SHARDS_MAX)) as u16
        } else {
            self.shards
        }
    }

    /// The data address published in the map.
    pub fn advertised(&self) -> SocketAddr {
        self.advertise.unwrap_or(self.listen)
    }

    /// The address this OSD's outgoing connections (to peers and to the manager)
    /// leave from: `listen`'s IP, or `advertise`'s when `listen` is a wildcard. On
    /// a multi-homed host this keeps traffic on the network the OSD is published
    /// on, and a firewall rule on the OSD's address covers both directions.
    pub fn source_ip(&self) -> std::net::IpAddr {
        if self.listen.ip().is_unspecified() {
            self.advertised().ip()
        } else {
            self.listen.ip()
        }
    }

    /// This OSD's half of the timing rules (`flame_common::timing`).
    pub fn timings(&self) -> OsdTimings {
        OsdTimings {
            lease_ms: self.lease_ms,
            heartbeat_interval_ms: self.heartbeat_interval_ms,
        }
    }

    /// Checks this OSD's timing against the manager's, as the boot answer gave it
    /// (`OsdBootReply::timings`): `Ok(true)` when every rule holds, `Ok(false)`
    /// when the manager did not say (older than the field: nothing to check
    /// against), the broken rule otherwise — then this OSD must not run.
    pub fn check_against_mgr(&self, mgr: Option<MgrTimings>) -> Result<bool, TimingError> {
        match mgr {
            Some(mgr) => check_osd_against_mgr(self.timings(), mgr).map(|()| true),
            None => Ok(false),
        }
    }

    /// Host name for placement.
    pub fn host_name(&self) -> String {
        if let Some(h) = &self.host {
            return h.clone();
        }
        std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_string())
            .ok()
            .filter(|s| !s.is_empty())
            .unwrap_or_else(|| "localhost".into())
    }
}

impl Validate for OsdConfig {
    fn validate(&self) -> Result<(), (String, String)> {
        let bad = |k: &str, m: &str| Err((k.to_string(), m.to_string()));
        if self.mgr.trim().is_empty() {
            return bad("mgr", "must be host:port of the manager");
        }
        self.memory_pool.validate()?;
        if self.shards > SHARDS_MAX {
            return bad("shards", "must be at most 256");
        }
        if u32::from(self.listen.port()) + u32::from(self.shard_count()) > 65535 {
            return bad("listen", "port + shards exceeds 65535");
        }
        let published = self.advertised();
        if published.ip().is_unspecified() {
            return bad(
                "advertise",
                "listen is a wildcard address: set advertise to this host's reachable IP:port",
            );
        }
        if published.port() != self.listen.port() {
            return bad(
                "advertise",
                "port must equal listen's port (shards use consecutive ports)",
            );
        }
        if self.threading == Threading::Staged
            && !(1..=NETWORK_THREADS_MAX).contains(&self.network_threads)
        {
            return bad("network_threads", "must be 1..=64 with threading: staged");
        }
        if !self.weight.is_finite()
            || !(0.0..=flame_common::mgr_api::OSD_WEIGHT_MAX).contains(&self.weight)
        {
            return bad(
                "weight",
                "must be a number in 0..=100 (the manager's bound)",
            );
        }
        if let Some(h) = &self.host
            && (h.is_empty() || h.len() > 64)
        {
            return bad("host", "must be 1..=64 bytes");
        }
        if !(OSD_HEARTBEAT_INTERVAL_MS_MIN..=OSD_HEARTBEAT_INTERVAL_MS_MAX)
            .contains(&self.heartbeat_interval_ms)
        {
            return bad(
                "heartbeat_interval_ms",
                &format!(
                    "must be {OSD_HEARTBEAT_INTERVAL_MS_MIN}..={OSD_HEARTBEAT_INTERVAL_MS_MAX}"
                ),
            );
        }
        // The lease must outlive the gap between two heartbeats (with room for one
        // late reply), or the OSD would stop serving between heartbeats. Its bound
        // against the manager's grace is checked at boot, when the manager says it.
        if let Err(e) = check_lease_outlives_heartbeats(self.lease_ms, self.heartbeat_interval_ms) {
            return bad("lease_ms", &e.to_string());
        }
        if self.lease_ms > OSD_LEASE_MS_MAX {
            return bad(
                "lease_ms",
                &format!(
                    "must be at most {OSD_LEASE_MS_MAX} (and lease_ms + heartbeat_interval_ms \
                     below the manager's heartbeat_grace_ms)"
                ),
            );
        }
        if !(PROGRESS_INTERVAL_MS * 4..=600_000).contains(&self.shard_stall_ms) {
            return bad("shard_stall_ms", "must be 400..=600000");
        }
        if !(1..=65_536).contains(&self.max_connections_per_shard) {
            return bad("max_connections_per_shard", "must be 1..=65536");
        }
        if !(1..=self.max_connections_per_shard).contains(&self.max_connections_per_source) {
            return bad(
                "max_connections_per_source",
                "must be 1..=max_connections_per_shard",
            );
        }
        if self.connections_reserved_for_peers >= self.max_connections_per_shard {
            return bad(
                "connections_reserved_for_peers",
                "must be below max_connections_per_shard",
            );
        }
        if !(100..=3_600_000).contains(&self.payload_recv_timeout_ms) {
            return bad("payload_recv_timeout_ms", "must be 100..=3600000");
        }
        if !(100..=3_600_000).contains(&self.send_stall_timeout_ms) {
            return bad("send_stall_timeout_ms", "must be 100..=3600000");
        }
        if self.idle_timeout_ms != 0 && !(100..=86_400_000).contains(&self.idle_timeout_ms) {
            return bad("idle_timeout_ms", "must be 0 (never) or 100..=86400000");
        }
        if !(1..=4096).contains(&self.max_inflight_per_connection) {
            return bad("max_inflight_per_connection", "must be 1..=4096");
        }
        // Below the transport's per-connection send-queue bound with room to spare:
        // everything one shard has in flight may be forwarded to one replica, and
        // that replica connection must never hit its backlog limit (which fails it).
        let shard_bytes_max = (SEND_QUEUE_BYTES_MAX as u64) * 3 / 4;
        if !((16 << 20)..=shard_bytes_max).contains(&self.max_inflight_bytes_per_shard) {
            return bad(
                "max_inflight_bytes_per_shard",
                &format!("must be 16 MiB..={} MiB (in bytes)", shard_bytes_max >> 20),
            );
        }
        if !((16 << 20)..=(4 << 30)).contains(&self.max_peer_inflight_bytes_per_shard) {
            return bad(
                "max_peer_inflight_bytes_per_shard",
                "must be 16 MiB..=4 GiB (in bytes)",
            );
        }
        if !(16..=1_000_000).contains(&self.open_files_per_shard_max) {
            return bad("open_files_per_shard_max", "must be 16..=1000000");
        }
        if !(1..=600_000).contains(&self.connect_timeout_ms) {
            return bad("connect_timeout_ms", "must be 1..=600000");
        }
        if !(1..=600_000).contains(&self.replica_timeout_ms) {
            return bad("replica_timeout_ms", "must be 1..=600000");
        }
        if !(1..=1_000_000).contains(&self.pg_log_entries_max) {
            return bad("pg_log_entries_max", "must be 1..=1000000");
        }
        if !(1..=64).contains(&self.recovery_max_active) {
            return bad("recovery_max_active", "must be 1..=64");
        }
        if self.scrub_interval_s > 365 * 86_400 {
            return bad("scrub_interval_s", "must be 0..=31536000");
        }
        if self.stray_delete_delay_ms > 86_400_000 {
            return bad("stray_delete_delay_ms", "must be 0..=86400000");
        }
        if self.reply_slots_per_connection_max > flame_common::protocol::REPLY_SLOTS_MAX {
            return bad(
                "reply_slots_per_connection_max",
                &format!("must be 0..={}", flame_common::protocol::REPLY_SLOTS_MAX),
            );
        }
        if self.reply_slot_payload_bytes_max > flame_common::protocol::REPLY_SLOT_PAYLOAD_BYTES_MAX
        {
            return bad(
                "reply_slot_payload_bytes_max",
                &format!(
                    "must be 0..={}",
                    flame_common::protocol::REPLY_SLOT_PAYLOAD_BYTES_MAX
                ),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::config::parse_str;

    #[test]
    fn defaults_and_overrides() {
        let c: OsdConfig =
            parse_str("shards: 2\npoll_mode: adaptive\ndirect_io: off\n", "t").unwrap();
        assert_eq!(c.shard_count(), 2);
        assert_eq!(c.poll_mode, PollMode::Adaptive);
        assert_eq!(c.direct_io, DirectIo::Off);
        assert!(
            parse_str::<OsdConfig>("shard: 2\n", "t")
                .unwrap_err()
                .to_string()
                .contains("shard")
        );
        for weight in ["-1", "1e300", "101"] {
            assert!(
                parse_str::<OsdConfig>(&format!("weight: {weight}\n"), "t")
                    .unwrap_err()
                    .to_string()
                    .contains("weight")
            );
        }
        assert!(parse_str::<OsdConfig>("poll_mode: sometimes\n", "t").is_err());
        let c: OsdConfig = parse_str("threading: staged\nnetwork_threads: 2\n", "t").unwrap();
        assert_eq!(c.threading, Threading::Staged);
        assert_eq!(c.network_threads, 2);
        assert!(parse_str::<OsdConfig>("threading: staged\nnetwork_threads: 0\n", "t").is_err());
        assert!(parse_str::<OsdConfig>("threading: pipelined\n", "t").is_err());
        assert_eq!(OsdConfig::default().threading, Threading::Penetrating);
        let e = parse_str::<OsdConfig>("listen: 0.0.0.0:6900\n", "t").unwrap_err();
        assert!(e.to_string().contains("advertise"), "{e}");
        let c: OsdConfig =
            parse_str("listen: 0.0.0.0:6900\nadvertise: 10.0.0.5:6900\n", "t").unwrap();
        assert_eq!(c.advertised().to_string(), "10.0.0.5:6900");
        let d = OsdConfig::default();
        assert!(
            d.lease_ms + d.heartbeat_interval_ms < 6000,
            "below the manager's default grace"
        );
        let e = parse_str::<OsdConfig>("lease_ms: 1500\n", "t").unwrap_err();
        assert!(e.to_string().contains("lease_ms"), "{e}");
    }

    /// Rule: `lease_ms` ≥ 2 × `heartbeat_interval_ms`.
    #[test]
    fn the_lease_must_outlive_two_heartbeats() {
        let e = parse_str::<OsdConfig>("heartbeat_interval_ms: 500\nlease_ms: 999\n", "t")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("lease_ms (999)") && e.contains("heartbeat_interval_ms (500)"),
            "{e}"
        );
        parse_str::<OsdConfig>("heartbeat_interval_ms: 500\nlease_ms: 1000\n", "t").unwrap();
    }

    fn mgr(grace: u64, silence: u64) -> Option<MgrTimings> {
        Some(MgrTimings {
            heartbeat_grace_ms: grace,
            failure_report_min_silence_ms: silence,
        })
    }

    /// Rule (at boot, against the manager's answer): `lease_ms` +
    /// `heartbeat_interval_ms` < the manager's `heartbeat_grace_ms`.
    #[test]
    fn the_lease_must_end_before_the_managers_grace() {
        let c = OsdConfig::default();
        assert_eq!(c.check_against_mgr(mgr(6000, 5000)), Ok(true));
        let e = c.check_against_mgr(mgr(5000, 5000)).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("lease_ms (4000)")
                && text.contains("heartbeat_interval_ms (1000)")
                && text.contains("heartbeat_grace_ms (5000)"),
            "{text}"
        );
    }

    /// Rule (at boot): the manager's `failure_report_min_silence_ms` ≥ `lease_ms`
    /// + `heartbeat_interval_ms`.
    #[test]
    fn the_managers_report_silence_must_cover_the_lease() {
        let c = OsdConfig::default();
        let e = c.check_against_mgr(mgr(6000, 4999)).unwrap_err();
        assert!(
            e.to_string()
                .contains("failure_report_min_silence_ms (4999)"),
            "{e}"
        );
    }

    /// An older manager says nothing: the OSD runs (and warns), as before.
    #[test]
    fn an_older_manager_is_not_checked_against() {
        assert_eq!(OsdConfig::default().check_against_mgr(None), Ok(false));
    }
}

/// Property test of this configuration's YAML decoding (`parse_str`): arbitrary
/// text and the shipped example (`deploy/examples/osd.yaml`) with bytes flipped,
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

    const EXAMPLE: &str = include_str!("../../deploy/examples/osd.yaml");

    /// This file's proptest seed (`config`).
    const SEED: u64 = 0xf1a3_0017;

    #[test]
    fn the_shipped_example_parses() {
        parse_str::<OsdConfig>(EXAMPLE, "osd.yaml").expect("deploy/examples/osd.yaml");
    }

    proptest! {
        #![proptest_config(config(128, SEED))]

        #[test]
        fn yaml_configs_parse_or_fail_cleanly(
            text in "[a-z_:{}\\[\\],&*!|>#0-9 .\n-]{0,80}",
            m in proptest::collection::vec(any::<(u8, u32, u8)>(), 0..8),
        ) {
            let _ = parse_str::<OsdConfig>(&text, "t");
            let mut b = EXAMPLE.as_bytes().to_vec();
            mutate(&mut b, &m);
            let _ = parse_str::<OsdConfig>(&String::from_utf8_lossy(&b), "t");
        }
    }
}
