//! Client settings.
//!
//! The client is a library, so its settings come from whoever embeds it (flame-nbd's
//! YAML, flame-admin's flags). The struct still derives `Deserialize` with
//! `deny_unknown_fields` so an embedding daemon can nest it in its YAML unchanged.

use crate::error::ClientError;
use flame_common::protocol;
use flame_common::transport::TransportKind;
use serde::{Deserialize, Serialize};
use std::time::Duration;

/// How to reach the cluster and how long to keep trying.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClientConfig {
    /// Manager address: `host:port`, or an `http://` or `https://` URL.
    pub mgr: String,
    /// The cluster CA (`flame-admin tls init`'s `ca.crt`): the manager serves
    /// TLS, verified against this CA only. `null`: plain HTTP.
    pub mgr_tls_ca: Option<std::path::PathBuf>,
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
    /// How write and read data travel: `inline` (in the messages) or `convert`
    /// (read-write conversion: above the transport's threshold a write sends only
    /// the descriptor of its buffer and the OSD pulls the data with a one-sided
    /// READ; a read grants its destination buffer and the OSD pushes the data with
    /// a one-sided WRITE).
    pub transfer_mode: TransferMode,
    /// Smallest I/O converted in `convert` mode, per transport (smaller ones travel
    /// inline: a pull or push costs the OSD an extra step that only pays for larger
    /// payloads).
    pub convert_threshold_bytes: ConvertThresholds,
    /// How replies come back: `push` (the OSD sends them) or `fetch` (remote
    /// fetching, RFP: the OSD leaves each reply in a reply area it granted this
    /// connection and the client reads it one-sidedly). `fetch` needs a transport
    /// whose one-sided READ bypasses the OSD's CPU (`shm`, `rdma`): on `tcp` an
    /// emulated READ is itself a round trip through the OSD, so it is refused.
    pub reply_mode: ReplyMode,
    /// Fetch mode: empty fetches of one reply (with backoff between them) before
    /// the client asks the OSD to push that reply instead.
    pub fetch_polls_max: u32,
    /// Fetch mode: consecutive replies that had to be pushed after which the
    /// connection stops asking for fetched replies for a while (RFP's hybrid:
    /// when the OSD is slower than polling pays for, push is cheaper).
    pub fetch_fallbacks_to_push: u32,
    /// Fetch mode: slots asked for per connection (bounded by the OSD's own limit).
    pub fetch_slots: u32,
    /// Fetch mode: largest reply payload a slot holds; a read with a larger
    /// inline reply asks for push.
    pub fetch_slot_payload_bytes: u32,
    /// Allows `reply_mode: fetch` on `tcp`, whose one-sided READ is emulated by
    /// the OSD's connection thread (every fetch is then a round trip: never
    /// faster than push). Only to exercise and measure the fetching protocol
    /// where no native transport is available; the OSD must allow it too
    /// (`reply_area_over_emulated`).
    pub fetch_over_emulated: bool,
    /// Keyring of the entity this client signs its manager requests as
    /// (`client.NAME`, written by `flame-admin auth key`); `null` only against a
    /// manager with `auth: none`. Relative paths are relative to the working
    /// directory.
    pub keyring: Option<std::path::PathBuf>,
    /// A name for this client that stays the same across its restarts (at most
    /// 128 bytes), or `null`. With one, a restarted client fences what its crashed
    /// predecessor still has on the wire: an OSD that sees the new process
    /// connect executes nothing more from the old one's connections, so a write
    /// the old process never had acknowledged cannot land over what the new one
    /// wrote since (`flame_common::lineage`). One name per client process and
    /// cluster: two live processes with the same name fence each other's
    /// connections (they still work, with reconnections). Without one, each
    /// process is on its own (flame-nbd and flame-ublk set one by default).
    pub instance: Option<String>,
}

/// The longest `instance` name.
pub const INSTANCE_NAME_BYTES_MAX: usize = 128;

/// The default `instance` name of a daemon `program` serving `endpoint` (what
/// only one live process on a host can hold: its socket path, its volume):
/// `program@host/machine:endpoint` — the host name and the first 12 characters
/// of `/etc/machine-id` (hosts cloned from one image often share a name; a
/// machine id is made at first boot) — cut to [`INSTANCE_NAME_BYTES_MAX`] bytes.
pub fn host_instance_name(program: &str, endpoint: &str) -> String {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let host = read("/proc/sys/kernel/hostname");
    let machine = read("/etc/machine-id");
    let machine: String = machine.trim().chars().take(12).collect();
    let mut name = format!("{program}@{}/{machine}:{endpoint}", host.trim());
    if name.len() > INSTANCE_NAME_BYTES_MAX {
        let mut cut = INSTANCE_NAME_BYTES_MAX;
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        name.truncate(cut);
    }
    name
}

/// How I/O data travels between the client and its OSD.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum TransferMode {
    /// Data in the messages (two-sided send/receive).
    Inline,
    /// Read-write conversion at or above the transport's threshold (the
    /// default: the thresholds make it convert only where it measured faster).
    #[default]
    Convert,
}

/// How the OSD's replies reach the client.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum ReplyMode {
    /// The OSD sends each reply.
    #[default]
    Push,
    /// The client fetches each reply from the OSD's memory (RFP).
    Fetch,
}

/// Per-transport conversion thresholds in bytes (`u32::MAX`: never convert).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConvertThresholds {
    /// On `tcp`: a one-sided transfer is emulated by the peer's connection thread,
    /// so converting adds a round trip and only large I/O might gain.
    pub tcp: u32,
    /// On `shm`: a one-sided transfer is a copy by the OSD straight from or to the
    /// client's memory.
    pub shm: u32,
    /// On `rdma`: a real RDMA READ/WRITE (the thesis converts above 4 KiB).
    pub rdma: u32,
}

impl Default for ConvertThresholds {
    fn default() -> Self {
        ConvertThresholds {
            tcp: DEFAULT_CONVERT_THRESHOLD_TCP,
            shm: DEFAULT_CONVERT_THRESHOLD_SHM,
            rdma: DEFAULT_CONVERT_THRESHOLD_RDMA,
        }
    }
}

/// Default conversion threshold on `tcp`: never. Measured (docs/benchmarks.md,
/// bench/comm_layer.py): converting costs +8 … +32 % QD1 latency at 4 KiB and
/// 64 KiB and is within noise at 1 MiB, because the peer's connection thread
/// serves the emulated transfer with an extra round trip.
pub const DEFAULT_CONVERT_THRESHOLD_TCP: u32 = u32::MAX;
/// Default conversion threshold on `shm`: 64 KiB. Measured (docs/benchmarks.md):
/// with the pool's regions shared, a converted transfer is one copy instead of
/// two through the ring: 64 KiB writes −16 % QD1 p50, 1 MiB writes −11 % and reads
/// −14 %; at 4 KiB the difference (−3 … −5 %) is within the run's noise.
pub const DEFAULT_CONVERT_THRESHOLD_SHM: u32 = 64 << 10;
/// Default conversion threshold on `rdma`: the thesis's 4 KiB (not measured here,
/// there is no RDMA device).
pub const DEFAULT_CONVERT_THRESHOLD_RDMA: u32 = 4096;

impl ConvertThresholds {
    /// The threshold for `kind`.
    pub fn for_transport(&self, kind: TransportKind) -> u32 {
        match kind {
            TransportKind::Tcp => self.tcp,
            TransportKind::Shm => self.shm,
            TransportKind::Rdma => self.rdma,
            // No one-sided access on the simulator's network.
            TransportKind::Sim => u32::MAX,
        }
    }
}

/// Whether a transport's one-sided READ runs without the peer's CPU, which is what
/// remote fetching needs to pay off.
fn fetch_supported(kind: TransportKind) -> bool {
    match kind {
        TransportKind::Tcp | TransportKind::Sim => false,
        TransportKind::Shm | TransportKind::Rdma => true,
    }
}

/// Bound on `fetch_polls_max`.
pub const FETCH_POLLS_MAX: u32 = 100_000;

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
            // Measured default: converts only where it pays (shm ≥ 64 KiB; never
            // on tcp), see the thresholds.
            transfer_mode: TransferMode::Convert,
            convert_threshold_bytes: ConvertThresholds::default(),
            reply_mode: ReplyMode::Push,
            fetch_polls_max: 64,
            fetch_fallbacks_to_push: 8,
            fetch_slots: 64,
            fetch_slot_payload_bytes: 4096,
            fetch_over_emulated: false,
            keyring: None,
            mgr_tls_ca: None,
            instance: None,
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

    /// The credentials of [`Self::keyring`], loaded and checked (mode 0600, an
    /// entity's key), or `None` without one.
    pub fn credentials(&self) -> Result<Option<flame_common::auth::Credentials>, ClientError> {
        self.keyring
            .as_deref()
            .map(flame_common::auth::Credentials::load)
            .transpose()
            .map_err(ClientError::InvalidArgument)
    }

    /// A client of this configuration's manager, signing with its keyring.
    pub fn mgr_client(&self) -> Result<crate::MgrClient, ClientError> {
        let trust = self
            .mgr_tls_ca
            .as_deref()
            .map(flame_common::tls::MgrTrust::load)
            .transpose()
            .map_err(ClientError::InvalidArgument)?;
        Ok(
            crate::MgrClient::new_from(&self.mgr, self.bind_addr, trust.as_ref())?
                .with_credentials(self.credentials()?),
        )
    }

    /// Checks every value, naming the bad key.
    pub fn validate(&self) -> Result<(), ClientError> {
        if self.mgr.trim().is_empty() {
            return Err(ClientError::InvalidArgument(
                "mgr: manager address is empty".into(),
            ));
        }
        if let Some(name) = &self.instance
            && (name.is_empty() || name.len() > INSTANCE_NAME_BYTES_MAX)
        {
            return Err(ClientError::InvalidArgument(format!(
                "instance: must be 1..={INSTANCE_NAME_BYTES_MAX} bytes, got {}",
                name.len()
            )));
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
        let t = &self.convert_threshold_bytes;
        for (key, v) in [("tcp", t.tcp), ("shm", t.shm), ("rdma", t.rdma)] {
            if v == 0 {
                return Err(ClientError::InvalidArgument(format!(
                    "convert_threshold_bytes.{key}: must be at least 1 byte (u32::MAX = never convert), got 0"
                )));
            }
        }
        if self.reply_mode == ReplyMode::Fetch {
            if !fetch_supported(self.transport) && !self.fetch_over_emulated {
                return Err(ClientError::InvalidArgument(format!(
                    "reply_mode: fetch needs a transport whose one-sided READ bypasses the OSD's CPU (shm, rdma); \
                     on {:?} an emulated READ is itself a round trip through the OSD, so fetching cannot beat push",
                    self.transport
                )));
            }
            if self.fetch_polls_max == 0 || self.fetch_polls_max > FETCH_POLLS_MAX {
                return Err(ClientError::InvalidArgument(format!(
                    "fetch_polls_max: must be 1..={FETCH_POLLS_MAX}, got {}",
                    self.fetch_polls_max
                )));
            }
            if self.fetch_slots == 0 || self.fetch_slots > protocol::REPLY_SLOTS_MAX {
                return Err(ClientError::InvalidArgument(format!(
                    "fetch_slots: must be 1..={}, got {}",
                    protocol::REPLY_SLOTS_MAX,
                    self.fetch_slots
                )));
            }
            if self.fetch_slot_payload_bytes > protocol::REPLY_SLOT_PAYLOAD_BYTES_MAX {
                return Err(ClientError::InvalidArgument(format!(
                    "fetch_slot_payload_bytes: must be at most {}, got {}",
                    protocol::REPLY_SLOT_PAYLOAD_BYTES_MAX,
                    self.fetch_slot_payload_bytes
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
        let c: ClientConfig = serde_norway::from_str(
            "transfer_mode: convert\nconvert_threshold_bytes:\n  tcp: 65536\nreply_mode: push\n",
        )
        .unwrap();
        assert_eq!(c.transfer_mode, TransferMode::Convert);
        assert_eq!(c.convert_threshold_bytes.tcp, 65536);
        assert_eq!(c.convert_threshold_bytes.shm, DEFAULT_CONVERT_THRESHOLD_SHM);
        assert!(serde_norway::from_str::<ClientConfig>("transfer_mode: sideways\n").is_err());
    }

    #[test]
    fn fetch_is_refused_on_tcp_and_thresholds_must_be_positive() {
        let c = ClientConfig {
            reply_mode: ReplyMode::Fetch,
            transport: TransportKind::Tcp,
            ..Default::default()
        };
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("reply_mode") && e.contains("tcp") || e.contains("Tcp"),
            "{e}"
        );
        let mut c = ClientConfig::default();
        c.convert_threshold_bytes.shm = 0;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("convert_threshold_bytes.shm"), "{e}");
    }
}
