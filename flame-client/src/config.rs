//! Client settings.
//!
//! The client is a library, so its settings come from whoever embeds it (flame-nbd's
//! YAML, flame-admin's flags). The struct still derives `Deserialize` with
//! `deny_unknown_fields` so an embedding daemon can nest it in its YAML unchanged.

use crate::error::ClientError;
use flame_common::transport::TransportKind;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// How to reach the cluster and how long to keep trying.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientConfig {
    /// Manager address: `host:port` or an `http://host:port` URL.
    pub mgr: String,
    /// Transport used to reach the OSDs.
    pub transport: TransportKind,
    /// Total time one request may take, retries included, before it fails with
    /// [`ClientError::Timeout`]. 0 (the default) = never give up: like a kernel
    /// block device on Ceph, I/O waits through any outage (an OSD failing over, a
    /// placement group below `min_size`, the manager restarting) and completes
    /// when the cluster can serve it, so the application sees latency, not EIO (a
    /// file system would go read-only at the first EIO). Set it to fail requests
    /// with EIO after that long instead.
    pub io_timeout_ms: u64,
    /// Bound on connecting to one OSD shard (connect + Hello).
    pub connect_timeout_ms: u64,
    /// How often the map is re-fetched when the manager does not support long polls
    /// (with long polls, changes arrive as soon as they happen).
    pub map_refresh_ms: u64,
    /// How long one long poll of the manager waits for a newer map.
    pub map_wait_ms: u64,
    /// Local address connections to the manager and the OSDs leave from; `None`
    /// lets the routing table choose. For multi-homed hosts (keep storage traffic
    /// on the storage network) and for tests giving each daemon its own address.
    pub bind_addr: Option<std::net::IpAddr>,
}

impl Default for ClientConfig {
    fn default() -> Self {
        ClientConfig {
            mgr: "127.0.0.1:6800".into(),
            transport: TransportKind::Tcp,
            io_timeout_ms: 0,
            connect_timeout_ms: 2_000,
            map_refresh_ms: 1_000,
            map_wait_ms: 5_000,
            bind_addr: None,
        }
    }
}

/// What `io_timeout_ms: 0` means: ten years, i.e. never, while keeping deadline
/// arithmetic on `Instant` finite.
pub const IO_TIMEOUT_NEVER: Duration = Duration::from_secs(10 * 365 * 86_400);

/// Longest accepted timeout: a day. Bounds `Instant` arithmetic and catches unit
/// mistakes (seconds given as microseconds).
const TIMEOUT_MS_MAX: u64 = 86_400_000;

impl ClientConfig {
    /// A default configuration pointing at `mgr`.
    pub fn new(mgr: impl Into<String>) -> Self {
        ClientConfig {
            mgr: mgr.into(),
            ..Default::default()
        }
    }

    /// Checks every value, naming the bad key.
    pub fn validate(&self) -> Result<(), ClientError> {
        if self.mgr.trim().is_empty() {
            return Err(ClientError::InvalidArgument(
                "mgr: manager address is empty".into(),
            ));
        }
        if self.io_timeout_ms > TIMEOUT_MS_MAX {
            return Err(ClientError::InvalidArgument(format!(
                "io_timeout_ms: must be 0 (never give up) or 1..={TIMEOUT_MS_MAX}, got {}",
                self.io_timeout_ms
            )));
        }
        for (key, v) in [
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("map_refresh_ms", self.map_refresh_ms),
            ("map_wait_ms", self.map_wait_ms),
        ] {
            if v == 0 || v > TIMEOUT_MS_MAX {
                return Err(ClientError::InvalidArgument(format!(
                    "{key}: must be 1..={TIMEOUT_MS_MAX}, got {v}"
                )));
            }
        }
        Ok(())
    }

    /// `io_timeout_ms` as a duration; 0 becomes [`IO_TIMEOUT_NEVER`].
    pub fn io_timeout(&self) -> Duration {
        if self.io_timeout_ms == 0 {
            IO_TIMEOUT_NEVER
        } else {
            Duration::from_millis(self.io_timeout_ms)
        }
    }

    /// `connect_timeout_ms` as a duration.
    pub fn connect_timeout(&self) -> Duration {
        Duration::from_millis(self.connect_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate_and_zero_is_rejected() {
        assert!(ClientConfig::default().validate().is_ok());
        assert_eq!(ClientConfig::default().io_timeout(), IO_TIMEOUT_NEVER);
        let c = ClientConfig {
            connect_timeout_ms: 0,
            ..Default::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("connect_timeout_ms"), "{e}");
        let c = ClientConfig {
            io_timeout_ms: TIMEOUT_MS_MAX + 1,
            ..Default::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("io_timeout_ms"), "{e}");
        assert!(ClientConfig::new(" ").validate().is_err());
    }

    #[test]
    fn nests_in_yaml_with_unknown_keys_refused() {
        let c: ClientConfig = serde_norway::from_str("mgr: 10.0.0.1:6800\n").unwrap();
        assert_eq!(c.mgr, "10.0.0.1:6800");
        assert_eq!(c.io_timeout_ms, 0);
        let c: ClientConfig = serde_norway::from_str("bind_addr: 127.0.0.9\n").unwrap();
        assert_eq!(c.bind_addr, Some([127, 0, 0, 9].into()));
        assert!(serde_norway::from_str::<ClientConfig>("io_timout_ms: 5\n").is_err());
    }
}
