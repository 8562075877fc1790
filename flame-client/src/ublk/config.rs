//! `flame-ublk` configuration (YAML, every key optional; the cluster and transport
//! keys are flame-nbd's, with the same meaning and defaults).
//!
//! ```yaml
//! mgr: 127.0.0.1:6800            # manager to fetch the cluster map from
//! volume: demo                   # the volume to export (or --volume)
//! metrics_listen: 127.0.0.1:9310 # Prometheus /metrics
//! dev_id: -1                     # ublk device number (/dev/ublkbN); -1 = the kernel picks
//! queues: 1                      # ublk hardware queues, one thread each
//! queue_depth: 64                # requests in flight per queue (the bound)
//! max_io_bytes: 524288           # largest request the kernel sends (its max_sectors)
//! transport: tcp                 # transport to the OSDs
//! poll_mode: interrupt           # interrupt | busy | adaptive
//! io_timeout_ms: 0               # bound on one operation (0 = never: wait through outages)
//! connect_timeout_ms: 2000       # connecting to the manager / OSDs
//! transfer_mode: convert         # convert | inline (the client library's)
//! convert_threshold_bytes: {tcp: 4294967295, shm: 65536, rdma: 4096}
//! reply_mode: push               # push | fetch
//! memory_pool:                   # payload memory of the queue threads
//!   mode: percpu
//!   bytes_per_thread: 67108864
//! ```

use flame_common::config::Validate;
use flame_common::reactor::PollMode;
use flame_common::transport::TransportKind;
use serde::Deserialize;
use std::net::SocketAddr;

/// Most queues (the kernel's `UBLK_MAX_NR_QUEUES` is 4096; a typo should fail).
pub const QUEUES_MAX: u16 = 64;
/// Deepest queue the kernel accepts (`UBLK_MAX_QUEUE_DEPTH`).
pub const QUEUE_DEPTH_MAX: u16 = 4096;

/// Settings of the ublk export.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct UblkConfig {
    /// Manager address (`host:port`).
    pub mgr: String,
    /// The volume to export (`--volume` overrides it).
    pub volume: String,
    /// Address of the Prometheus `/metrics` endpoint.
    pub metrics_listen: SocketAddr,
    /// Device number to ask for (`/dev/ublkbN`); -1 lets the kernel choose.
    pub dev_id: i32,
    /// ublk hardware queues; each is served by its own thread from fetch to commit.
    pub queues: u16,
    /// Requests in flight per queue: the kernel never sends more (the bound on
    /// the bridge's work), and each has its own `max_io_bytes` buffer.
    pub queue_depth: u16,
    /// Largest read or write the kernel sends in one request.
    pub max_io_bytes: u32,
    /// Transport to the OSDs.
    pub transport: TransportKind,
    /// How idle queue threads wait.
    pub poll_mode: PollMode,
    /// Longest one operation may take (retries included) before the request fails
    /// with EIO; 0 (the default) = never (flame-nbd's `io_timeout_ms`).
    pub io_timeout_ms: u64,
    /// Local address connections to the manager and the OSDs leave from.
    pub bind_addr: Option<std::net::IpAddr>,
    /// Timeout for connecting to the manager and OSDs.
    pub connect_timeout_ms: u64,
    /// The client library's `transfer_mode`.
    pub transfer_mode: crate::config::TransferMode,
    /// The client library's `convert_threshold_bytes`.
    pub convert_threshold_bytes: crate::config::ConvertThresholds,
    /// The client library's `reply_mode`.
    pub reply_mode: crate::config::ReplyMode,
    /// The keyring this bridge signs its manager requests with (a `client` role
    /// entity's, from `flame-admin auth key`); `null` only against a manager with
    /// `auth: none`.
    pub keyring: Option<std::path::PathBuf>,
    /// The cluster CA when the manager serves TLS (the client library's
    /// `mgr_tls_ca`).
    pub mgr_tls_ca: Option<std::path::PathBuf>,
    /// The client library's `fetch_over_emulated` (tests and measurements only).
    pub fetch_over_emulated: bool,
    /// The client library's `fetch_polls_max`.
    pub fetch_polls_max: u32,
    /// The client library's `fetch_fallbacks_to_push`.
    pub fetch_fallbacks_to_push: u32,
    /// Registered payload memory of each queue thread.
    pub memory_pool: flame_common::buffer::registered::MemoryPoolConfig,
}

impl Default for UblkConfig {
    fn default() -> Self {
        let nbd = crate::nbd::NbdConfig::default();
        UblkConfig {
            mgr: nbd.mgr,
            volume: String::new(),
            metrics_listen: SocketAddr::from(([127, 0, 0, 1], 9310)),
            dev_id: -1,
            queues: 1,
            queue_depth: 64,
            max_io_bytes: 512 << 10,
            transport: nbd.transport,
            poll_mode: nbd.poll_mode,
            io_timeout_ms: nbd.io_timeout_ms,
            bind_addr: nbd.bind_addr,
            connect_timeout_ms: nbd.connect_timeout_ms,
            transfer_mode: nbd.transfer_mode,
            convert_threshold_bytes: nbd.convert_threshold_bytes,
            reply_mode: nbd.reply_mode,
            keyring: nbd.keyring,
            mgr_tls_ca: nbd.mgr_tls_ca,
            fetch_over_emulated: nbd.fetch_over_emulated,
            fetch_polls_max: nbd.fetch_polls_max,
            fetch_fallbacks_to_push: nbd.fetch_fallbacks_to_push,
            memory_pool: nbd.memory_pool,
        }
    }
}

impl UblkConfig {
    /// The client library's settings (the cluster and transport keys).
    pub fn client_config(&self) -> crate::ClientConfig {
        crate::ClientConfig {
            mgr: self.mgr.clone(),
            transport: self.transport,
            io_timeout_ms: self.io_timeout_ms,
            connect_timeout_ms: self.connect_timeout_ms,
            bind_addr: self.bind_addr,
            transfer_mode: self.transfer_mode,
            convert_threshold_bytes: self.convert_threshold_bytes,
            reply_mode: self.reply_mode,
            keyring: self.keyring.clone(),
            mgr_tls_ca: self.mgr_tls_ca.clone(),
            fetch_over_emulated: self.fetch_over_emulated,
            fetch_polls_max: self.fetch_polls_max,
            fetch_fallbacks_to_push: self.fetch_fallbacks_to_push,
            // The volume it serves on this host: a restarted flame-ublk fences
            // the writes its crashed predecessor left on the wire
            // (`ClientConfig::instance`).
            instance: Some(crate::config::host_instance_name(
                "flame-ublk",
                &self.volume,
            )),
            ..crate::ClientConfig::default()
        }
    }
}

impl Validate for UblkConfig {
    fn validate(&self) -> Result<(), (String, String)> {
        let bad = |k: &str, m: &str| Err((k.to_string(), m.to_string()));
        if self.mgr.is_empty() {
            return bad("mgr", "must be host:port");
        }
        if self.queues == 0 || self.queues > QUEUES_MAX {
            return bad("queues", "must be between 1 and 64");
        }
        if self.queue_depth == 0 || self.queue_depth > QUEUE_DEPTH_MAX {
            return bad("queue_depth", "must be between 1 and 4096");
        }
        if self.max_io_bytes < 4096
            || self.max_io_bytes > 32 << 20
            || !self.max_io_bytes.is_power_of_two()
        {
            return bad(
                "max_io_bytes",
                "must be a power of two between 4096 and 33554432",
            );
        }
        if self.dev_id < -1 {
            return bad("dev_id", "must be -1 (the kernel picks) or a device number");
        }
        if self.io_timeout_ms > 3_600_000 {
            return bad(
                "io_timeout_ms",
                "must be 0 (never give up) or between 1 and 3600000 ms",
            );
        }
        if self.connect_timeout_ms == 0 || self.connect_timeout_ms > 3_600_000 {
            return bad("connect_timeout_ms", "must be between 1 and 3600000 ms");
        }
        self.memory_pool.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::config::parse_str;

    #[test]
    fn defaults_overrides_and_bad_values() {
        let c: UblkConfig = parse_str("", "t").unwrap();
        assert_eq!(c, UblkConfig::default());
        assert_eq!(c.client_config().mgr, "127.0.0.1:6800");
        let c: UblkConfig =
            parse_str("volume: v\nqueues: 2\nqueue_depth: 32\ndev_id: 3\n", "t").unwrap();
        assert_eq!(
            (c.volume.as_str(), c.queues, c.queue_depth, c.dev_id),
            ("v", 2, 32, 3)
        );
        for (yaml, key) in [
            ("queues: 0\n", "queues"),
            ("queue_depth: 5000\n", "queue_depth"),
            ("max_io_bytes: 1000\n", "max_io_bytes"),
            ("dev_id: -2\n", "dev_id"),
            ("listen: 1.2.3.4:5\n", "listen"),
        ] {
            let e = parse_str::<UblkConfig>(yaml, "t").unwrap_err();
            assert!(e.to_string().contains(key), "{yaml}: {e}");
        }
    }

    /// deploy/examples/ublk.yaml documents the keys with their defaults: it
    /// parses, and only the keys an operator must set differ.
    #[test]
    fn the_example_configuration_holds_the_defaults() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/examples/ublk.yaml");
        let text = std::fs::read_to_string(path).unwrap();
        let c: UblkConfig = parse_str(&text, path).unwrap();
        assert_eq!(
            c,
            UblkConfig {
                keyring: Some("/etc/flame/keys/client.ublk.keyring".into()),
                mgr_tls_ca: Some("/etc/flame/tls/ca.crt".into()),
                ..UblkConfig::default()
            }
        );
    }
}

/// Property test of this configuration's YAML decoding (`parse_str`), as for
/// flame-nbd's: arbitrary text and the shipped example
/// (`deploy/examples/ublk.yaml`) with bytes flipped, inserted, deleted or cut
/// give the configuration or an error naming the key, never a panic or a hang.
/// Seeded and bounded (`PROPTEST_CASES` / `PROPTEST_RNG_SEED` override).
#[cfg(test)]
mod props {
    use super::*;
    use flame_common::config::parse_str;
    use flame_common::fuzzing::mutate;
    use flame_common::fuzzing::props::config;
    use proptest::prelude::*;

    const EXAMPLE: &str = include_str!("../../../deploy/examples/ublk.yaml");

    /// This file's proptest seed (`config`).
    const SEED: u64 = 0xf1a3_001b;

    proptest! {
        #![proptest_config(config(128, SEED))]

        #[test]
        fn yaml_configs_parse_or_fail_cleanly(
            text in "[a-z_:{}\\[\\],&*!|>#0-9 .\n-]{0,80}",
            m in proptest::collection::vec(any::<(u8, u32, u8)>(), 0..8),
        ) {
            let _ = parse_str::<UblkConfig>(&text, "t");
            let mut b = EXAMPLE.as_bytes().to_vec();
            mutate(&mut b, &m);
            let _ = parse_str::<UblkConfig>(&String::from_utf8_lossy(&b), "t");
        }
    }
}
