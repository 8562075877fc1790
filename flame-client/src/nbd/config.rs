//! `flame-nbd` configuration (YAML, every key optional).
//!
//! ```yaml
//! mgr: 127.0.0.1:6800            # manager to fetch the cluster map from
//! unix:                          # the local export: a Unix socket (default below)
//!   path: /run/flame/nbd.sock
//!   mode: "0660"                 # the socket file's mode (octal text)
//!   gid: 64055                   # its group (default: the daemon's)
//!   allow:                       # uids (SO_PEERCRED) and what each may open;
//!     - {uid: 64055, volumes: ["vm1-*"], read_only: false}  # empty: the daemon's own uid only
//! listen: 10.0.0.5:10809         # a TCP export (default none; every thread binds it with SO_REUSEPORT)
//! tls:                           # TLS on the TCP export (NBD STARTTLS), required there
//!   cert_file: /etc/flame/tls/nbd.crt     # flame-admin tls issue --as nbd
//!   key_file: /etc/flame/tls/nbd.key
//!   client_ca_file: /etc/flame/tls/ca.crt # clients present certificates from it (flame-admin tls client)
//! tcp_without_tls: false         # true: the TCP export in clear, to anyone, every volume (tests only)
//! metrics_listen: 127.0.0.1:9300 # Prometheus /metrics
//! threads: 0                     # reactor threads; 0 = one per core
//! transport: tcp                 # transport to the OSDs
//! poll_mode: interrupt           # interrupt | busy | adaptive
//! max_connections: 256           # NBD connections over all threads
//! io_timeout_ms: 0               # bound on one backend operation (0 = never)
//! handshake_timeout_ms: 10000    # a client must finish negotiation within this
//! payload_recv_timeout_ms: 10000 # a WRITE's payload must arrive within this of its header
//! send_stall_timeout_ms: 30000   # a client not reading its replies this long is closed
//! connect_timeout_ms: 2000       # connecting to the manager / OSDs
//! transfer_mode: convert         # convert (at/above the threshold) | inline
//! convert_threshold_bytes: {tcp: 4294967295, shm: 65536, rdma: 4096}  # 4294967295 = never
//! reply_mode: push               # push | fetch (remote fetching; shm/rdma only)
//! memory_pool:                   # payload memory of the reactor threads
//!   mode: percpu                 # percpu | locked | heap
//!   bytes_per_thread: 67108864   # registered bytes per thread (multiple of 4 MiB)
//! ```

use flame_common::config::Validate;
use flame_common::reactor::PollMode;
use flame_common::transport::TransportKind;
use serde::Deserialize;
use std::net::SocketAddr;

/// Settings of the NBD server.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct NbdConfig {
    /// Manager address (`host:port`) the Flame backend fetches the cluster map from.
    pub mgr: String,
    /// The local export: a Unix socket whose peers are admitted by uid.
    pub unix: Option<UnixExport>,
    /// The TCP export's address (`None`: no TCP export). It requires TLS
    /// (`tls`) unless `tcp_without_tls` says otherwise.
    pub listen: Option<SocketAddr>,
    /// TLS on the TCP export: flame-nbd's certificate and the CA of its
    /// clients' certificates, whose entity and capabilities decide what each
    /// client may open ([`super::client_cert`]).
    pub tls: Option<NbdTls>,
    /// Serve the TCP export in clear to anyone who reaches it, every volume,
    /// read and write: what NBD servers do by default, and what a Flame
    /// export does only when asked by name (tests, benchmarks, an isolated
    /// network). Logged as a warning at start.
    pub tcp_without_tls: bool,
    /// Address of the Prometheus `/metrics` endpoint.
    pub metrics_listen: SocketAddr,
    /// Reactor threads (0 = number of cores). Each accepts its own connections.
    pub threads: usize,
    /// Transport to the OSDs.
    pub transport: TransportKind,
    /// How idle reactor threads wait.
    pub poll_mode: PollMode,
    /// Most NBD connections served at once (over all threads); more are closed at
    /// accept.
    pub max_connections: usize,
    /// Longest one backend operation may take (retries included) before the request
    /// fails with EIO; 0 (the default) = never: I/O waits through failovers and
    /// outages, as a kernel block device on Ceph does. Enforced by the Flame client
    /// library (its `io_timeout_ms`).
    pub io_timeout_ms: u64,
    /// Local address connections to the manager and the OSDs leave from (`None`:
    /// the routing table chooses).
    pub bind_addr: Option<std::net::IpAddr>,
    /// Longest a client may take from connect to the end of negotiation.
    pub handshake_timeout_ms: u64,
    /// Longest a WRITE's payload may take to arrive once its header did: a client
    /// that trickles it holds a pool buffer of up to 32 MiB. Past it the
    /// connection is closed, logged and counted
    /// (`flame_nbd_stalled_connections_closed_total{reason="payload_stall"}`).
    pub payload_recv_timeout_ms: u64,
    /// Longest one batch of replies may wait for the client to take it (a client
    /// that stops reading holds the read data queued for it); then closed
    /// (`reason="send_stall"`).
    pub send_stall_timeout_ms: u64,
    /// Timeout for connecting to the manager and OSDs.
    pub connect_timeout_ms: u64,
    /// How I/O data travels to and from the OSDs (the client library's
    /// `transfer_mode`).
    pub transfer_mode: crate::config::TransferMode,
    /// Smallest converted I/O per transport (the client library's
    /// `convert_threshold_bytes`).
    pub convert_threshold_bytes: crate::config::ConvertThresholds,
    /// How the OSDs' replies come back (the client library's `reply_mode`).
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
    /// Registered payload memory of the reactor threads (NBD write payloads and
    /// read replies from the OSDs live in it).
    pub memory_pool: flame_common::buffer::registered::MemoryPoolConfig,
}

/// The Unix socket export (`unix:`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct UnixExport {
    /// Where the socket is created (a stale socket there is replaced; any
    /// other file is an error).
    pub path: std::path::PathBuf,
    /// The socket file's mode, octal text (`"0600"`, `"0660"`): who may
    /// connect at all; `allow` then decides by uid.
    pub mode: String,
    /// The socket file's group (default: the daemon's).
    pub gid: Option<u32>,
    /// The uids admitted and what each may open; empty: the daemon's own uid,
    /// every volume.
    pub allow: Vec<super::access::UidGrant>,
}

/// Default path of the Unix socket export.
pub const UNIX_SOCKET_PATH_DEFAULT: &str = "/run/flame/nbd.sock";

impl Default for UnixExport {
    fn default() -> Self {
        UnixExport {
            path: UNIX_SOCKET_PATH_DEFAULT.into(),
            mode: "0600".into(),
            gid: None,
            allow: Vec::new(),
        }
    }
}

impl UnixExport {
    /// `mode` as a number (validated: octal, at most 0777).
    pub fn mode_bits(&self) -> Result<u32, String> {
        match u32::from_str_radix(self.mode.trim_start_matches("0o"), 8) {
            Ok(m) if m <= 0o777 => Ok(m),
            _ => Err(format!("{:?}: an octal mode such as \"0660\"", self.mode)),
        }
    }
}

/// TLS on the TCP export (`tls:`).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NbdTls {
    /// flame-nbd's certificate (PEM; from the cluster CA: `flame-admin tls
    /// issue --as nbd --name ADDRESS`).
    pub cert_file: std::path::PathBuf,
    /// Its private key (PEM, mode 0600).
    pub key_file: std::path::PathBuf,
    /// The CA clients' certificates must chain to (the cluster's `ca.crt`).
    pub client_ca_file: std::path::PathBuf,
}

impl Default for NbdConfig {
    fn default() -> Self {
        NbdConfig {
            mgr: "127.0.0.1:6800".into(),
            unix: Some(UnixExport::default()),
            listen: None,
            tls: None,
            tcp_without_tls: false,
            metrics_listen: SocketAddr::from(([127, 0, 0, 1], 9300)),
            threads: 0,
            transport: TransportKind::Tcp,
            poll_mode: PollMode::Interrupt,
            max_connections: 256,
            io_timeout_ms: 0,
            bind_addr: None,
            handshake_timeout_ms: 10_000,
            payload_recv_timeout_ms: 10_000,
            send_stall_timeout_ms: 30_000,
            connect_timeout_ms: 2_000,
            transfer_mode: crate::config::TransferMode::Convert,
            convert_threshold_bytes: crate::config::ConvertThresholds::default(),
            reply_mode: crate::config::ReplyMode::Push,
            keyring: None,
            mgr_tls_ca: None,
            fetch_over_emulated: false,
            fetch_polls_max: crate::config::ClientConfig::default().fetch_polls_max,
            fetch_fallbacks_to_push: crate::config::ClientConfig::default().fetch_fallbacks_to_push,
            memory_pool: Default::default(),
        }
    }
}

/// Most entries of `unix.allow`.
pub const UNIX_ALLOW_MAX: usize = 1024;

/// Upper bound on `threads` (a typo like 10000 should fail, not spawn threads).
pub const THREADS_MAX: usize = 1024;

impl NbdConfig {
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
            // Its export endpoint: one live process holds it, and a restart
            // keeps it, so a restarted flame-nbd fences the writes its crashed
            // predecessor left on the wire (`ClientConfig::instance`).
            instance: Some(crate::config::host_instance_name(
                "flame-nbd",
                &match (&self.unix, &self.listen) {
                    (Some(u), _) => u.path.display().to_string(),
                    (None, Some(a)) => a.to_string(),
                    (None, None) => String::new(),
                },
            )),
            ..crate::ClientConfig::default()
        }
    }

    /// How long a connection may be stuck before it is closed
    /// (`payload_recv_timeout_ms`, `send_stall_timeout_ms`).
    pub fn stall_bounds(&self) -> flame_common::transport::StallBounds {
        flame_common::transport::StallBounds::from_ms(
            self.payload_recv_timeout_ms,
            self.send_stall_timeout_ms,
        )
    }

    /// Threads to run: `threads`, or the core count when 0.
    pub fn thread_count(&self) -> usize {
        if self.threads == 0 {
            flame_common::config::cores()
        } else {
            self.threads
        }
    }
}

impl Validate for NbdConfig {
    fn validate(&self) -> Result<(), (String, String)> {
        let bad = |k: &str, m: &str| Err((k.to_string(), m.to_string()));
        if self.threads > THREADS_MAX {
            return bad("threads", "must be at most 1024 (0 = one per core)");
        }
        if self.max_connections == 0 || self.max_connections > 1 << 20 {
            return bad("max_connections", "must be between 1 and 1048576");
        }
        if self.io_timeout_ms > 3_600_000 {
            return bad(
                "io_timeout_ms",
                "must be 0 (never give up) or between 1 and 3600000 ms",
            );
        }
        for (k, v) in [
            ("handshake_timeout_ms", self.handshake_timeout_ms),
            ("connect_timeout_ms", self.connect_timeout_ms),
            ("payload_recv_timeout_ms", self.payload_recv_timeout_ms),
            ("send_stall_timeout_ms", self.send_stall_timeout_ms),
        ] {
            if v == 0 || v > 3_600_000 {
                return bad(k, "must be between 1 and 3600000 ms");
            }
        }
        if self.mgr.is_empty() {
            return bad("mgr", "must be host:port");
        }
        if self.unix.is_none() && self.listen.is_none() {
            return bad(
                "listen",
                "nothing to serve: set `unix:` (a local socket) or `listen:` (TCP with `tls:`)",
            );
        }
        if let Some(u) = &self.unix {
            if let Err(e) = u.mode_bits() {
                return bad("unix.mode", &e);
            }
            if u.path.as_os_str().is_empty() || u.path.as_os_str().len() > 100 {
                return bad("unix.path", "a path of 1 to 100 bytes (a socket's bound)");
            }
            if u.allow.len() > UNIX_ALLOW_MAX {
                return bad("unix.allow", "at most 1024 entries");
            }
        }
        if self.listen.is_some() && self.tls.is_none() && !self.tcp_without_tls {
            return bad(
                "listen",
                "a TCP export needs `tls:` (cert_file, key_file, client_ca_file: clients \
                 present certificates from the cluster CA), or `tcp_without_tls: true` to \
                 serve every volume to anyone who reaches the port",
            );
        }
        if self.tls.is_some() && self.listen.is_none() {
            return bad("tls", "TLS is for the TCP export: set `listen:` too");
        }
        self.memory_pool.validate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::config::parse_str;

    #[test]
    fn defaults_and_overrides() {
        let c: NbdConfig = parse_str("", "t").unwrap();
        assert_eq!(c, NbdConfig::default());
        let c: NbdConfig = parse_str(
            "listen: 127.0.0.1:1234\ntcp_without_tls: true\nthreads: 2\npoll_mode: adaptive\nhandshake_timeout_ms: 500\n",
            "t",
        )
        .unwrap();
        assert_eq!(c.listen.map(|l| l.port()), Some(1234));
        assert_eq!(c.thread_count(), 2);
        assert_eq!(c.poll_mode, PollMode::Adaptive);
        assert_eq!(c.handshake_timeout_ms, 500);
    }

    #[test]
    fn bad_values_are_named() {
        let e = parse_str::<NbdConfig>("threads: 5000\n", "t").unwrap_err();
        assert!(e.to_string().contains("threads"), "{e}");
        let e = parse_str::<NbdConfig>("handshake_timeout_ms: 0\n", "t").unwrap_err();
        assert!(e.to_string().contains("handshake_timeout_ms"), "{e}");
        let e = parse_str::<NbdConfig>("listen_port: 1\n", "t").unwrap_err();
        assert!(e.to_string().contains("listen_port"), "{e}");
        let e = parse_str::<NbdConfig>("max_connections: 0\n", "t").unwrap_err();
        assert!(e.to_string().contains("max_connections"), "{e}");
    }

    #[test]
    fn tcp_needs_tls_or_asks_for_clear_by_name() {
        let e = parse_str::<NbdConfig>("listen: 127.0.0.1:1\n", "t").unwrap_err();
        assert!(e.to_string().contains("tcp_without_tls"), "{e}");
        let e = parse_str::<NbdConfig>("unix: null\n", "t").unwrap_err();
        assert!(e.to_string().contains("nothing to serve"), "{e}");
        let e =
            parse_str::<NbdConfig>("tls: {cert_file: a, key_file: b, client_ca_file: c}\n", "t")
                .unwrap_err();
        assert!(e.to_string().contains("listen"), "{e}");
        let c: NbdConfig = parse_str(
            "listen: 127.0.0.1:1\ntls: {cert_file: a, key_file: b, client_ca_file: c}\n",
            "t",
        )
        .unwrap();
        assert!(c.tls.is_some() && c.unix.is_some());
        for bad in ["mode: \"0999\"", "mode: \"01777\"", "mode: rw"] {
            let e = parse_str::<NbdConfig>(&format!("unix: {{{bad}}}\n"), "t").unwrap_err();
            assert!(e.to_string().contains("unix.mode"), "{bad}: {e}");
        }
        let c: NbdConfig = parse_str(
            "unix: {path: /tmp/s, mode: \"0660\", allow: [{uid: 7, volumes: [\"vm-*\"], read_only: true}]}\n",
            "t",
        )
        .unwrap();
        let u = c.unix.unwrap();
        assert_eq!(u.mode_bits(), Ok(0o660));
        assert!(u.allow[0].read_only && u.allow[0].volumes.allows("vm-1"));
    }
}

/// Property test of this configuration's YAML decoding (`parse_str`): arbitrary
/// text and the shipped example (`deploy/examples/nbd.yaml`) with bytes flipped,
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

    const EXAMPLE: &str = include_str!("../../../deploy/examples/nbd.yaml");

    /// This file's proptest seed (`config`).
    const SEED: u64 = 0xf1a3_0019;

    #[test]
    fn the_shipped_example_parses() {
        parse_str::<NbdConfig>(EXAMPLE, "nbd.yaml").expect("deploy/examples/nbd.yaml");
    }

    proptest! {
        #![proptest_config(config(128, SEED))]

        #[test]
        fn yaml_configs_parse_or_fail_cleanly(
            text in "[a-z_:{}\\[\\],&*!|>#0-9 .\n-]{0,80}",
            m in proptest::collection::vec(any::<(u8, u32, u8)>(), 0..8),
        ) {
            let _ = parse_str::<NbdConfig>(&text, "t");
            let mut b = EXAMPLE.as_bytes().to_vec();
            mutate(&mut b, &m);
            let _ = parse_str::<NbdConfig>(&String::from_utf8_lossy(&b), "t");
        }
    }
}
