//! Cross-process test harness.
//!
//! Integration tests must exercise what a user runs: the real `flame-mgr`,
//! `flame-osd` and `flame-nbd` binaries as separate processes, talking over real
//! sockets, with data in real directories. [`TestCluster`] starts such a cluster on
//! loopback inside a temporary directory, waits until it is ready, and gives tests
//! the handles they need (addresses, data directories, kill/restart of single
//! daemons, the `flame-admin` CLI, the manager API).
//!
//! Everything is bounded: every wait has a timeout and every external tool runs
//! with a deadline, so a broken daemon fails a test with its log instead of hanging
//! CI. Every child is killed when the cluster is dropped (also while a test panics),
//! and additionally carries `PR_SET_PDEATHSIG = SIGKILL`, so even a test process
//! killed by a timeout leaves no daemon behind.
//!
//! The binaries are taken from the cargo target directory the test itself was built
//! into (`target/<profile>/`), so `cargo build --workspace --bins` must run before
//! `cargo test` (scripts/test.sh does).

// This crate drives real daemons in real time: its helpers and real-daemon tests may
// read the real clock and sleep. The simulator (`sim`) may not: everything in it
// runs in virtual time, and a read of the real clock there would make a seed
// depend on the machine (the clock rule, clippy.toml, docs/testing.md).
#![allow(clippy::disallowed_methods)]

pub mod failover;
pub mod faults;
pub mod misbehaving;
pub mod net;
pub mod oracle;
#[deny(clippy::disallowed_methods)]
pub mod sim;
pub mod vm;

use flame_common::ids::{Epoch, OsdId, VolumeId};
use flame_common::map::{ClusterMap, VolumeInfo};
use flame_common::mgr_api::{ClusterStatus, OsdStatus, VolumeCreate};
use flame_common::placement::mix64;
use flame_common::protocol::Message;
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Where object data starts in an object file: after the 4 KiB header and the
/// 64 KiB checksum area (docs/on-disk-format.md).
pub const OBJECT_DATA_OFFSET: usize = 4096 + 65536;

/// How long a daemon may take to become ready after it was started. Generous: CI
/// machines have two cores and run other tests at the same time.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(45);
/// Default deadline for one run of an external tool (qemu-io, nbdcopy, fio, ...).
pub const TOOL_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a daemon gets between SIGTERM and SIGKILL in [`TestCluster::stop_all`].
pub const STOP_GRACE: Duration = Duration::from_secs(10);
/// Timeout of one HTTP request to a daemon.
pub const HTTP_TIMEOUT: Duration = Duration::from_secs(10);
/// Lines of each daemon log shown when a test fails.
const LOG_TAIL_LINES: usize = 40;

/// Shape of the cluster to start.
#[derive(Clone, Debug)]
pub struct ClusterOptions {
    /// Number of OSD processes.
    pub osds: usize,
    /// Shard threads per OSD; each gets its own data port.
    pub shards: u16,
    /// Whether to start `flame-nbd` as well.
    pub nbd: bool,
    /// The manager's `heartbeat_grace_ms`.
    pub heartbeat_grace_ms: u64,
    /// The pool's placement-group count.
    pub pg_count: u32,
    /// The OSDs' `heartbeat_interval_ms` (how often they report, and so how soon
    /// they notice a new map epoch on their own).
    pub osd_heartbeat_interval_ms: u64,
    /// Start the OSDs one after the other, each only once the previous one is
    /// registered (as on a real cluster whose machines boot at different times),
    /// instead of all at once. Each OSD then boots with a map that lacks the later
    /// ones.
    pub osds_one_by_one: bool,
    /// Extra lines appended to every OSD's YAML configuration.
    pub osd_extra_yaml: String,
    /// The manager's `down_out_interval_ms` (`None`: the manager's default).
    pub down_out_interval_ms: Option<u64>,
    /// Extra top-level lines appended to the manager's YAML configuration.
    pub mgr_extra_yaml: String,
    /// Give every daemon its own loopback address in a /24 leased for this cluster
    /// alone ([`net::NetLease`], `127.A.B.0/24`): the manager .10, OSD `i` .(11+i),
    /// flame-nbd .9 (also [`TestCluster::client_ip`]). Daemons' outgoing
    /// connections leave from their own address, so iptables rules between two
    /// addresses cut exactly one link (the partition tests), and never another
    /// cluster's or another test run's. Otherwise everything is on 127.0.0.1.
    pub per_daemon_addrs: bool,
    /// The `transport` of every OSD and of flame-nbd (`tcp`, `shm` or `rdma`). Default: the
    /// environment's `FLAME_TEST_TRANSPORT`, else `tcp`, so the whole suite can be
    /// run over shared memory (`FLAME_TEST_TRANSPORT=shm cargo test -p
    /// flame-tests`). Tests that cut links with iptables need `tcp`: shared memory
    /// does not cross the firewall.
    pub transport: String,
    /// Extra top-level lines appended to flame-nbd's YAML configuration (after
    /// the ones [`client_env_yaml`] takes from the environment).
    pub nbd_extra_yaml: String,
    /// `poll_mode` of every OSD and of flame-nbd. Default: the environment's
    /// `FLAME_TEST_POLL_MODE`, else `interrupt`.
    pub poll_mode: String,
    /// Whether the manager requires authentication (keys in `DIR/keys`, every
    /// daemon and helper signing). Default: on, unless `FLAME_TEST_AUTH=none`
    /// (CI runs one suite that way, as an operator with `auth: none` would).
    pub auth: bool,
    /// Whether the manager serves TLS: the harness makes a cluster CA and the
    /// manager's certificate (`DIR/tls`, for the manager's address), and every
    /// daemon, flame-admin and the harness's own calls trust that CA only.
    pub mgr_tls: bool,
    /// Whether flame-nbd's TCP export requires TLS: the harness makes the
    /// cluster CA (`DIR/tls`, shared with [`Self::mgr_tls`]) and flame-nbd's
    /// certificate, and clients need one from
    /// [`TestCluster::client_cert_dir`]. Otherwise the TCP export is in clear
    /// (`tcp_without_tls`). The Unix socket export (`DIR/nbd.sock`, the
    /// harness's uid) is there either way.
    pub nbd_tls: bool,
}

/// Whether test clusters authenticate (`FLAME_TEST_AUTH`: `required`, the
/// default, or `none`).
pub fn test_auth() -> bool {
    match std::env::var("FLAME_TEST_AUTH") {
        Ok(a) if a == "none" => false,
        Ok(a) if a.is_empty() || a == "required" => true,
        Ok(a) => panic!("FLAME_TEST_AUTH={a}: expected required or none"),
        Err(_) => true,
    }
}

/// A test cluster's keys: the cluster secret and the keyrings written from it.
#[derive(Debug)]
pub struct TestKeys {
    /// The directory holding `cluster.keyring`, `client.admin.keyring`,
    /// `client.test.keyring` (role client), `osd.N.keyring` (OSD process N's own
    /// key) and `osd.keyring` (the shared key every OSD may hold, for tests of
    /// it).
    pub dir: PathBuf,
    /// The cluster secret.
    pub secret: flame_common::auth::SecretKey,
}

/// Makes HELLOs as a raw client (or, for `peer`, an OSD) of one test cluster
/// sends them: with a ticket and its proof when the cluster authenticates.
#[derive(Clone, Copy, Debug)]
pub struct HelloMaker {
    /// The OSDs' service key (`None` with `auth: none`). Leaked (a few bytes
    /// per test), so the maker is `Copy` and moves into every `block_on`.
    pub service: Option<&'static flame_common::auth::ServiceKey>,
    /// Client HELLOs as `client.admin` (role admin) instead of `client.test`.
    pub admin: bool,
}

impl HelloMaker {
    /// This maker, with client HELLOs as `client.admin`.
    pub fn as_admin(self) -> HelloMaker {
        HelloMaker {
            admin: true,
            ..self
        }
    }

    /// A HELLO to shard `shard` of `osd`, with a fresh ticket of `client.test`
    /// (role client), or for `peer` of the `osd` entity, and its proof. Each one
    /// opens one connection (the shard remembers its nonce).
    pub fn hello(
        &self,
        osd: OsdId,
        shard: u16,
        epoch: Epoch,
        peer: bool,
        session: u64,
        generation: u64,
    ) -> Message {
        let auth = self.service.map(|service| {
            let (name, role) = if peer {
                ("osd", flame_common::auth::Role::Osd)
            } else if self.admin {
                ("client.admin", flame_common::auth::Role::Admin)
            } else {
                ("client.test", flame_common::auth::Role::Client)
            };
            hello_auth(service, name, role, osd, shard, peer, session, generation)
        });
        hello_message(epoch, shard, peer, session, generation, auth)
    }
}

/// A HELLO with the given fields and authentication section (for tests that
/// make their own tickets and proofs).
pub fn hello_message(
    epoch: Epoch,
    shard: u16,
    peer: bool,
    session: u64,
    generation: u64,
    auth: Option<flame_common::protocol::HelloAuth>,
) -> Message {
    Message::Hello {
        id: flame_common::ids::RequestId(0),
        epoch,
        versions: flame_common::protocol::VERSIONS,
        shard,
        peer,
        session,
        generation,
        auth: auth.map(Box::new),
    }
}

/// A HELLO's authentication section for `entity` with `role`, with a ticket
/// made with `service` now.
#[allow(clippy::too_many_arguments)]
pub fn hello_auth(
    service: &flame_common::auth::ServiceKey,
    entity: &str,
    role: flame_common::auth::Role,
    osd: OsdId,
    shard: u16,
    peer: bool,
    session: u64,
    generation: u64,
) -> flame_common::protocol::HelloAuth {
    let e = flame_common::auth::EntityName::parse(entity).expect("entity");
    let ticket = service.issue(
        &e,
        role,
        flame_common::clock::unix_ms(),
        flame_common::auth::TICKET_LIFETIME_MS,
    );
    let binding = flame_common::auth::handshake::HelloBinding {
        osd: osd.0,
        shard,
        peer,
        session,
        generation,
    };
    flame_common::auth::handshake::hello_auth(
        &ticket,
        &binding,
        flame_common::clock::unix_ms(),
        flame_common::auth::handshake::hello_nonce(),
    )
}

impl TestKeys {
    /// Writes a new cluster's keys into `dir` (created, mode 0700), as
    /// `flame-admin auth init` does, plus `client.test` and the shared `osd`
    /// (generation 1).
    pub fn create(dir: &Path) -> TestKeys {
        let (secret, _) = flame_common::auth::Keyring::init_cluster(dir)
            .unwrap_or_else(|e| panic!("test keys: {e}"));
        let keys = TestKeys {
            dir: dir.to_path_buf(),
            secret,
        };
        keys.write_keyring("client.test", 1);
        keys.write_keyring("osd", 1);
        keys
    }

    /// The OSDs' service key (the `osd` key at generation 1).
    pub fn service(&self) -> flame_common::auth::ServiceKey {
        let osd = flame_common::auth::EntityName::osd();
        flame_common::auth::ServiceKey::from_osd_key(&self.secret.derive_entity_key(&osd, 1), 1)
    }

    /// Writes the keyring of `entity` at `generation` into the directory (the
    /// manager must know the entity for it to work: `POST /v1/auth/entities`).
    pub fn write_keyring(&self, entity: &str, generation: u64) -> PathBuf {
        let e = flame_common::auth::EntityName::parse(entity).expect("entity");
        let path = self.keyring(entity);
        flame_common::auth::Keyring::derived(&self.secret, &e, generation)
            .save(&path)
            .unwrap_or_else(|err| panic!("{err}"));
        path
    }

    /// The keyring file of `entity` (`client.admin`, `osd.N`, `osd`,
    /// `client.test`).
    pub fn keyring(&self, entity: &str) -> PathBuf {
        self.dir.join(format!("{entity}.keyring"))
    }

    /// Credentials of `entity` at `generation`, derived from the secret.
    pub fn creds(&self, entity: &str, generation: u64) -> flame_common::auth::Credentials {
        let e = flame_common::auth::EntityName::parse(entity).expect("entity");
        flame_common::auth::Credentials {
            key: self.secret.derive_entity_key(&e, generation),
            entity: e,
            generation,
        }
    }
}

/// The transport the test clusters use unless a test says otherwise
/// (`FLAME_TEST_TRANSPORT`: `tcp`, `shm` or `rdma`; default `tcp`). `rdma` needs
/// daemons built with the `rdma` features and a device named by the
/// environment the daemons inherit (`FLAME_RDMA_DEVICE`, ...): the test VM's
/// Soft-RoCE (`tests/tests/rdma_vm.rs`) runs the cluster suites that way.
pub fn test_transport() -> String {
    match std::env::var("FLAME_TEST_TRANSPORT") {
        Ok(t) if t == "tcp" || t == "shm" || t == "rdma" => t,
        Ok(t) if t.is_empty() => "tcp".to_string(),
        Ok(t) => panic!("FLAME_TEST_TRANSPORT={t}: expected tcp, shm or rdma"),
        Err(_) => "tcp".to_string(),
    }
}

/// flame-nbd settings of the communication layer taken from the environment, so
/// CI can run any cluster test in another combination without a code change:
/// `FLAME_TEST_TRANSFER_MODE` (`inline` | `convert`), `FLAME_TEST_CONVERT_THRESHOLD`
/// (bytes, on every transport) and `FLAME_TEST_REPLY_MODE` (`push` | `fetch`).
pub fn client_env_yaml() -> String {
    let mut y = String::new();
    if let Ok(v) = std::env::var("FLAME_TEST_TRANSFER_MODE") {
        y.push_str(&format!("transfer_mode: {v}\n"));
    }
    if let Ok(v) = std::env::var("FLAME_TEST_CONVERT_THRESHOLD") {
        y.push_str(&format!(
            "convert_threshold_bytes: {{tcp: {v}, shm: {v}, rdma: {v}}}\n"
        ));
    }
    if let Ok(v) = std::env::var("FLAME_TEST_REPLY_MODE") {
        y.push_str(&format!("reply_mode: {v}\n"));
    }
    y
}

impl Default for ClusterOptions {
    fn default() -> Self {
        ClusterOptions {
            osds: 3,
            shards: 2,
            nbd: false,
            heartbeat_grace_ms: 6000,
            pg_count: 128,
            osd_heartbeat_interval_ms: 500,
            osds_one_by_one: false,
            osd_extra_yaml: String::new(),
            down_out_interval_ms: None,
            mgr_extra_yaml: String::new(),
            per_daemon_addrs: true,
            transport: test_transport(),
            nbd_extra_yaml: String::new(),
            poll_mode: std::env::var("FLAME_TEST_POLL_MODE")
                .ok()
                .filter(|m| !m.is_empty())
                .unwrap_or_else(|| "interrupt".into()),
            auth: test_auth(),
            mgr_tls: false,
            nbd_tls: false,
        }
    }
}

impl ClusterOptions {
    /// The default cluster plus `flame-nbd`.
    pub fn with_nbd() -> Self {
        ClusterOptions {
            nbd: true,
            ..ClusterOptions::default()
        }
    }

    /// A cluster of `osds` OSDs for failure tests: failures detected within about
    /// 2 s (short grace, frequent heartbeats) and few placement groups, so recovery
    /// and the checks over every group stay quick on a small machine. Down OSDs stay
    /// `in` unless a test sets `down_out_interval_ms`.
    pub fn failover(osds: usize) -> Self {
        ClusterOptions {
            osds,
            heartbeat_grace_ms: 2000,
            osd_heartbeat_interval_ms: 250,
            pg_count: 32,
            ..ClusterOptions::default()
        }
    }
}

/// What protocol a listening port speaks; the garbage tests use it to say what they
/// hit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PortKind {
    /// The manager's HTTP API (also serves /metrics).
    MgrApi,
    /// A Flame protocol data port of one OSD shard.
    OsdData,
    /// A Prometheus /metrics endpoint.
    Metrics,
    /// The NBD server.
    Nbd,
}

/// One listening socket of the cluster.
#[derive(Clone, Debug)]
pub struct Endpoint {
    /// Human-readable owner, e.g. `osd.1 shard 0`.
    pub name: String,
    /// Address.
    pub addr: SocketAddr,
    /// Protocol.
    pub kind: PortKind,
}

/// A daemon process the harness controls.
struct Daemon {
    name: String,
    binary: PathBuf,
    config: PathBuf,
    log: PathBuf,
    /// Every address the daemon listens on.
    ports: Vec<SocketAddr>,
    child: Option<Child>,
}

/// How long a restart waits for the ports of a killed daemon to become free.
const PORT_RELEASE_TIMEOUT: Duration = Duration::from_secs(15);

impl Daemon {
    fn new(
        name: &str,
        binary: PathBuf,
        config: PathBuf,
        log: PathBuf,
        ports: Vec<SocketAddr>,
    ) -> Daemon {
        Daemon {
            name: name.to_string(),
            binary,
            config,
            log,
            ports,
            child: None,
        }
    }

    /// Waits until every listening address of the daemon can be bound again. A
    /// process killed with io_uring requests in flight (an accept on its listener)
    /// releases its sockets only when the kernel's deferred ring teardown has run,
    /// which can be after the process was reaped; a restart in that window would
    /// fail with EADDRINUSE.
    fn wait_ports_free(&self) {
        let deadline = Instant::now() + PORT_RELEASE_TIMEOUT;
        for addr in &self.ports {
            while let Err(e) = TcpListener::bind(addr) {
                if Instant::now() > deadline {
                    panic!(
                        "{}: {addr} still in use {PORT_RELEASE_TIMEOUT:?} after the old process died: {e}",
                        self.name
                    );
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }

    fn start(&mut self) {
        assert!(
            self.child.is_none(),
            "{} is already running; kill it first",
            self.name
        );
        self.wait_ports_free();
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap_or_else(|e| panic!("cannot open log {}: {e}", self.log.display()));
        let _ = writeln!(log, "==== harness: starting {} ====", self.name);
        let log_err = log
            .try_clone()
            .unwrap_or_else(|e| panic!("cannot clone log handle: {e}"));
        let mut cmd = Command::new(&self.binary);
        cmd.arg("--config")
            .arg(&self.config)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        // SAFETY: prctl is async-signal-safe; the closure allocates nothing.
        unsafe {
            cmd.pre_exec(|| {
                // The daemon dies with the thread that spawned it, so a test process
                // killed by a timeout leaves nothing behind. (Consequence: start and
                // restart daemons from the test's own thread.)
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap_or_else(|e| {
            panic!(
                "cannot start {} ({}): {e}",
                self.name,
                self.binary.display()
            )
        });
        self.child = Some(child);
    }

    /// SIGKILL and reap.
    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM without waiting.
    fn signal_term(&self) {
        if let Some(child) = &self.child
            && let Ok(pid) = i32::try_from(child.id())
        {
            // SAFETY: plain kill(2) on our own child's pid; it is not reaped yet, so
            // the pid cannot have been reused.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
    }

    /// Waits up to `deadline` for the process to exit, then SIGKILLs it.
    fn reap_by(&mut self, deadline: Instant) -> Option<ExitStatus> {
        let mut child = self.child.take()?;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    let _ = child.kill();
                    return child.wait().ok();
                }
            }
        }
    }

    /// `Some(status)` if the process has exited on its own.
    fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    fn is_running(&mut self) -> bool {
        self.child.is_some() && self.exited().is_none()
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Addresses of one OSD.
#[derive(Clone, Copy, Debug)]
struct OsdAddrs {
    data: SocketAddr,
    metrics: SocketAddr,
}

/// A running Flame cluster on loopback: one manager, N OSDs, optionally flame-nbd.
pub struct TestCluster {
    ips: DaemonIps,
    // Daemons are declared (and so dropped) before the directory they write into.
    mgr: Daemon,
    osds: Vec<Daemon>,
    nbd: Option<Daemon>,
    mgr_addr: SocketAddr,
    osd_addrs: Vec<OsdAddrs>,
    nbd_addr: Option<SocketAddr>,
    nbd_metrics_addr: Option<SocketAddr>,
    opts: ClusterOptions,
    bin_dir: PathBuf,
    /// The cluster directory; `None` only after [`Drop`] decided to keep it.
    dir: Option<tempfile::TempDir>,
    root: PathBuf,
    /// The cluster's keys (`None` with `auth: none`).
    keys: Option<TestKeys>,
}

impl TestCluster {
    /// Starts the default cluster (1 manager, 3 OSDs with 2 shards each) and waits
    /// until every OSD is up.
    pub fn start() -> TestCluster {
        TestCluster::start_with(ClusterOptions::default())
    }

    /// Starts a cluster of the given shape and waits until it is ready.
    pub fn start_with(opts: ClusterOptions) -> TestCluster {
        assert!(
            opts.osds > 0 && opts.shards > 0,
            "need at least one OSD shard"
        );
        let bin_dir = bin_dir();
        let dir = tempfile::Builder::new()
            .prefix("flame-test-")
            .tempdir()
            .unwrap_or_else(|e| panic!("cannot create a temporary directory: {e}"));
        let root = dir.path().to_path_buf();
        let ips = DaemonIps::new(opts.per_daemon_addrs, opts.osds);
        let on = |ip: Ipv4Addr, port: u16| SocketAddr::from((ip, port));

        let keys = opts.auth.then(|| TestKeys::create(&root.join("keys")));
        let keyring_yaml = |entity: &str| {
            keys.as_ref()
                .map(|k| format!("keyring: \"{}\"\n", k.keyring(entity).display()))
                .unwrap_or_default()
        };
        let mgr_addr = on(ips.mgr, free_ports_on(ips.mgr, 1));
        let tls_dir = root.join("tls");
        if opts.mgr_tls || opts.nbd_tls {
            flame_client::admin::tls::generate(&tls_dir, &[ips.mgr.to_string()])
                .unwrap_or_else(|e| panic!("tls init: {e}"));
        }
        let tls_yaml = if opts.mgr_tls {
            format!(
                "tls:\n  cert_file: \"{}\"\n  key_file: \"{}\"\n",
                tls_dir.join(flame_common::tls::MGR_CERT_FILE).display(),
                tls_dir.join(flame_common::tls::MGR_KEY_FILE).display()
            )
        } else {
            String::new()
        };
        let mgr_yaml = format!(
            "# flame-mgr config written by the test harness\n\
             {}\
             listen: \"{mgr_addr}\"\n\
             data_dir: \"{}\"\n\
             heartbeat_grace_ms: {}\n\
             failure_check_interval_ms: 500\n\
             pool:\n  size: 3\n  min_size: 2\n  pg_count: {}\n  object_size: 4194304\n\
             {tls_yaml}{}{}{}\n",
            match &keys {
                Some(k) => format!("keyring: \"{}\"\n", k.dir.join("cluster.keyring").display()),
                None => "auth: none\n".to_string(),
            },
            root.join("mgr").display(),
            opts.heartbeat_grace_ms,
            opts.pg_count,
            // The test OSDs share the host's file system, whose fill level is not
            // the tests' business (one CI machine's disk was 90 % used before the
            // first test): only a nearly exhausted disk counts as nearfull or full
            // here. Tests of fullness force each OSD's usage (`disk_usage`).
            if opts.mgr_extra_yaml.contains("full_ratio") {
                ""
            } else {
                "nearfull_ratio: 0.98\nfull_ratio: 0.99\n"
            },
            opts.down_out_interval_ms
                .map(|ms| format!("down_out_interval_ms: {ms}\n"))
                .unwrap_or_default(),
            opts.mgr_extra_yaml,
        );
        let mgr = Daemon::new(
            "mgr",
            binary(&bin_dir, "flame-mgr"),
            write_config(&root, "mgr.yaml", &mgr_yaml),
            root.join("mgr.log"),
            vec![mgr_addr],
        );

        let mut osds = Vec::new();
        let mut osd_addrs = Vec::new();
        for i in 0..opts.osds {
            let (daemon, addrs) = osd_daemon(
                &root,
                &bin_dir,
                (mgr_addr, keys.as_ref()),
                &opts,
                i,
                ips.osds[i],
            );
            osds.push(daemon);
            osd_addrs.push(addrs);
        }

        let (mut nbd, mut nbd_addr, mut nbd_metrics_addr) = (None, None, None);
        if opts.nbd {
            let listen = on(ips.client, free_ports_on(ips.client, 1));
            let metrics = on(ips.client, free_ports_on(ips.client, 1));
            let bind = if opts.per_daemon_addrs {
                format!("bind_addr: \"{}\"\n", ips.client)
            } else {
                String::new()
            };
            let nbd_tls_yaml = if opts.nbd_tls {
                flame_client::admin::tls::issue(&tls_dir, "nbd", &[ips.client.to_string()])
                    .unwrap_or_else(|e| panic!("tls issue: {e}"));
                format!(
                    "tls: {{cert_file: \"{0}/nbd.crt\", key_file: \"{0}/nbd.key\", \
                     client_ca_file: \"{0}/{1}\"}}\n",
                    tls_dir.display(),
                    flame_common::tls::CA_CERT_FILE
                )
            } else {
                "tcp_without_tls: true\n".to_string()
            };
            let yaml = format!(
                "# flame-nbd config written by the test harness\n\
                 mgr: \"{mgr_addr}\"\n\
                 listen: \"{listen}\"\n\
                 {nbd_tls_yaml}\
                 unix: {{path: \"{}\"}}\n\
                 metrics_listen: \"{metrics}\"\n\
                 threads: 2\n\
                 poll_mode: {poll_mode}\n\
                 transport: {transport}\n\
                 {bind}{}{}{}{}{}",
                root.join(NBD_SOCKET_FILE).display(),
                mgr_ca_yaml(&opts, &root),
                keyring_yaml("client.test"),
                client_env_yaml(),
                opts.nbd_extra_yaml,
                memory_pool_yaml(&opts.nbd_extra_yaml),
                transport = opts.transport,
                poll_mode = opts.poll_mode,
            );
            nbd = Some(Daemon::new(
                "nbd",
                binary(&bin_dir, "flame-nbd"),
                write_config(&root, "nbd.yaml", &yaml),
                root.join("nbd.log"),
                vec![listen, metrics],
            ));
            nbd_addr = Some(listen);
            nbd_metrics_addr = Some(metrics);
        }

        let mut cluster = TestCluster {
            ips,
            mgr,
            osds,
            nbd,
            mgr_addr,
            osd_addrs,
            nbd_addr,
            nbd_metrics_addr,
            opts,
            bin_dir,
            dir: Some(dir),
            root,
            keys,
        };
        let since = Instant::now();
        cluster.mgr.start();
        cluster.wait_mgr();
        if cluster.keys.is_some() {
            // flame-nbd's entity: read-only, as an operator would give a bridge.
            let added = cluster.mgr_post(
                "/v1/auth/entities",
                &serde_json::json!({"entity": "client.test", "role": "client"}),
            );
            assert!(matches!(added, Ok((200, _))), "add client.test: {added:?}");
            // Every OSD process its own key, as deployed (process i is osd.i).
            for i in 0..cluster.osds.len() {
                cluster.add_osd_entity(i);
            }
        }
        if cluster.opts.osds_one_by_one {
            for i in 0..cluster.osds.len() {
                cluster.osds[i].start();
                cluster.wait_osd_ready(i, since);
            }
        } else {
            for osd in &mut cluster.osds {
                osd.start();
            }
            for i in 0..cluster.osds.len() {
                cluster.wait_osd_ready(i, since);
            }
        }
        if cluster.nbd.is_some() {
            cluster.start_nbd_and_wait();
        }
        cluster
    }

    // ---------------------------------------------------------------- addresses

    /// The manager's API address (also serves `/metrics`).
    pub fn mgr_addr(&self) -> SocketAddr {
        self.mgr_addr
    }

    /// `http://<mgr><path>` (`https://` when the manager serves TLS).
    pub fn mgr_url(&self, path: &str) -> String {
        let scheme = if self.opts.mgr_tls { "https" } else { "http" };
        format!("{scheme}://{}{path}", self.mgr_addr)
    }

    /// The cluster CA when the manager serves TLS ([`ClusterOptions::mgr_tls`]).
    pub fn mgr_tls_ca(&self) -> Option<PathBuf> {
        mgr_ca_path(&self.opts, &self.root)
    }

    /// The manager's IP address.
    pub fn mgr_ip(&self) -> Ipv4Addr {
        self.ips.mgr
    }

    /// OSD process `i`'s IP address (every shard, metrics, outgoing connections).
    pub fn osd_ip(&self, i: usize) -> Ipv4Addr {
        self.ips.osds[i]
    }

    /// The address flame-nbd and test clients use (host .9 of the cluster's subnet
    /// with [`ClusterOptions::per_daemon_addrs`], else 127.0.0.1).
    pub fn client_ip(&self) -> Ipv4Addr {
        self.ips.client
    }

    /// An address of the cluster's subnet no daemon uses (host .8; 127.0.0.1
    /// without per-daemon addresses): a test client that a partition between the
    /// daemons' addresses leaves alone.
    pub fn spare_ip(&self) -> Ipv4Addr {
        self.ips
            .lease
            .as_ref()
            .map_or(Ipv4Addr::LOCALHOST, |l| l.ip(8))
    }

    fn lease(&self) -> &net::NetLease {
        self.ips.lease.as_ref().unwrap_or_else(|| {
            panic!(
                "partitions need ClusterOptions::per_daemon_addrs (daemons on their own addresses)"
            )
        })
    }

    /// Drops loopback traffic between `ip` and each of `others`, both ways, until
    /// the returned value is dropped (iptables; root needed).
    pub fn partition(&self, ip: Ipv4Addr, others: &[Ipv4Addr]) -> net::Partition {
        net::Partition::between(self.lease(), ip, others)
    }

    /// Cuts OSD process `i` off from everything (manager, other OSDs, every client
    /// whatever its address) until the returned value is dropped (iptables; root
    /// needed).
    pub fn isolate_osd(&self, i: usize) -> net::Partition {
        net::Partition::isolate(self.lease(), self.osd_ip(i))
    }

    /// Number of OSD processes.
    pub fn osd_count(&self) -> usize {
        self.osds.len()
    }

    /// Shard threads per OSD.
    pub fn shards(&self) -> u16 {
        self.opts.shards
    }

    /// Data address of shard `shard` of OSD process `i`.
    pub fn osd_addr(&self, i: usize, shard: u16) -> SocketAddr {
        let mut a = self.osd_addrs[i].data;
        a.set_port(a.port() + shard);
        a
    }

    /// Metrics address of OSD process `i`.
    pub fn osd_metrics_addr(&self, i: usize) -> SocketAddr {
        self.osd_addrs[i].metrics
    }

    /// The NBD server's address. Panics if the cluster has no flame-nbd.
    pub fn nbd_addr(&self) -> SocketAddr {
        self.nbd_addr
            .expect("this TestCluster was started without flame-nbd (use ClusterOptions::with_nbd)")
    }

    /// flame-nbd's metrics address. Panics if the cluster has no flame-nbd.
    pub fn nbd_metrics_addr(&self) -> SocketAddr {
        self.nbd_metrics_addr
            .expect("this TestCluster was started without flame-nbd (use ClusterOptions::with_nbd)")
    }

    /// NBD URI of a volume: `nbd://127.0.0.1:PORT/NAME`.
    pub fn nbd_uri(&self, volume: &str) -> String {
        format!("nbd://{}/{volume}", self.nbd_addr())
    }

    /// flame-nbd's Unix socket export.
    pub fn nbd_socket(&self) -> PathBuf {
        self.root.join(NBD_SOCKET_FILE)
    }

    /// NBD URI of a volume on the Unix socket export:
    /// `nbd+unix:///NAME?socket=PATH`.
    pub fn nbd_unix_uri(&self, volume: &str) -> String {
        format!(
            "nbd+unix:///{volume}?socket={}",
            self.nbd_socket().display()
        )
    }

    /// NBD URI of a volume over TLS (`nbds://`, libnbd) with the client
    /// certificate in `cert_dir` ([`Self::client_cert_dir`]).
    pub fn nbd_tls_uri(&self, volume: &str, cert_dir: &Path) -> String {
        format!(
            "nbds://{}/{volume}?tls-certificates={}",
            self.nbd_addr(),
            cert_dir.display()
        )
    }

    /// Issues a client certificate from the cluster CA ([`ClusterOptions::nbd_tls`])
    /// for `entity` with `volumes` (`*`: every one), read-only or not, into a
    /// new directory laid out as QEMU's `tls-creds-x509` and libnbd's
    /// `tls-certificates` want it (`ca-cert.pem`, `client-cert.pem`,
    /// `client-key.pem`); returns it.
    pub fn client_cert_dir(&self, entity: &str, volumes: &str, read_only: bool) -> PathBuf {
        let tls = self.root.join("tls");
        let claims = flame_client::nbd::client_cert::ClientClaims {
            entity: flame_common::auth::EntityName::parse(entity).expect("entity"),
            volumes: flame_common::auth::VolumePatterns::parse_list(volumes).expect("volumes"),
            read_only,
        };
        let files = flame_client::admin::tls::issue_client(&tls, &claims, 1)
            .unwrap_or_else(|e| panic!("tls client {entity}: {e}"));
        let dir = self.root.join(format!("creds-{entity}"));
        fs::create_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for (from, to) in [
            (&tls.join(flame_common::tls::CA_CERT_FILE), "ca-cert.pem"),
            (&files[0], "client-cert.pem"),
            (&files[1], "client-key.pem"),
        ] {
            fs::copy(from, dir.join(to)).unwrap_or_else(|e| panic!("{}: {e}", from.display()));
        }
        dir
    }

    /// Every listening socket of the cluster.
    pub fn endpoints(&self) -> Vec<Endpoint> {
        let mut v = vec![Endpoint {
            name: "mgr api".into(),
            addr: self.mgr_addr,
            kind: PortKind::MgrApi,
        }];
        for i in 0..self.osds.len() {
            for s in 0..self.opts.shards {
                v.push(Endpoint {
                    name: format!("osd.{i} shard {s}"),
                    addr: self.osd_addr(i, s),
                    kind: PortKind::OsdData,
                });
            }
            v.push(Endpoint {
                name: format!("osd.{i} metrics"),
                addr: self.osd_metrics_addr(i),
                kind: PortKind::Metrics,
            });
        }
        if let (Some(nbd), Some(metrics)) = (self.nbd_addr, self.nbd_metrics_addr) {
            v.push(Endpoint {
                name: "nbd".into(),
                addr: nbd,
                kind: PortKind::Nbd,
            });
            v.push(Endpoint {
                name: "nbd metrics".into(),
                addr: metrics,
                kind: PortKind::Metrics,
            });
        }
        v
    }

    // ---------------------------------------------------------------- paths

    /// The cluster's temporary directory (configs, logs, data).
    pub fn dir(&self) -> &Path {
        self.root.as_path()
    }

    /// Data directory of OSD process `i`.
    pub fn osd_data_dir(&self, i: usize) -> PathBuf {
        self.root.join(format!("osd.{i}"))
    }

    /// Where OSD process `i` stores object `index` of `volume` — the on-disk layout
    /// of docs/on-disk-format.md:
    /// `pgs/<pg, 8 hex digits>/<volume id, 16 hex digits>.<object index, 16 hex digits>`.
    pub fn object_path(&self, i: usize, volume: VolumeId, index: u64) -> PathBuf {
        let object = flame_common::ids::ObjectId { volume, index };
        let pg = flame_common::placement::object_pg(object, self.opts.pg_count);
        self.osd_data_dir(i)
            .join("pgs")
            .join(format!("{:08x}", pg.0))
            .join(format!("{:016x}.{index:016x}", volume.0))
    }

    /// Byte `at` (a data offset within the object) of OSD process `i`'s copy of object
    /// 0 of `volume`; with `set`, overwrites it first and syncs (behind the OSD's
    /// back: bit rot). Wait for the groups to be clean first: a recovery still
    /// comparing the object would repair the byte before the test looks.
    pub fn object_byte(&self, i: usize, volume: VolumeId, at: usize, set: Option<u8>) -> u8 {
        use std::os::unix::fs::FileExt;
        let path = self.object_path(i, volume, 0);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let pos = (OBJECT_DATA_OFFSET + at) as u64;
        if let Some(v) = set {
            f.write_all_at(&[v], pos)
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            f.sync_all()
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        }
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, pos)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        b[0]
    }

    /// The data bytes of an object file (what follows its header and checksum area,
    /// [`OBJECT_DATA_OFFSET`]), or `None` if OSD process `i` has no file for it.
    /// Byte `k` is byte `k` of the object; bytes past the end read as zero.
    pub fn object_data(&self, i: usize, volume: VolumeId, index: u64) -> Option<Vec<u8>> {
        let file = fs::read(self.object_path(i, volume, index)).ok()?;
        Some(file.get(OBJECT_DATA_OFFSET..).unwrap_or_default().to_vec())
    }

    /// The manager's data directory.
    pub fn mgr_data_dir(&self) -> PathBuf {
        self.root.join("mgr")
    }

    /// Path of a binary of this build (`flame-admin`, ...).
    pub fn bin(&self, name: &str) -> PathBuf {
        binary(&self.bin_dir, name)
    }

    // ---------------------------------------------------------------- daemon control

    /// SIGKILLs OSD process `i` (and reaps it).
    pub fn kill_osd(&mut self, i: usize) {
        self.osds[i].kill();
    }

    /// Starts OSD process `i` again (SIGKILLing it first if it still runs) and waits
    /// until it serves and has heartbeated to the manager.
    pub fn restart_osd(&mut self, i: usize) {
        self.osds[i].kill();
        let since = Instant::now();
        self.osds[i].start();
        self.wait_osd_ready(i, since);
    }

    /// Whether OSD process `i` is running.
    pub fn osd_running(&mut self, i: usize) -> bool {
        self.osds[i].is_running()
    }

    /// Pid of flame-nbd, if it runs.
    pub fn nbd_pid(&self) -> Option<u32> {
        self.nbd.as_ref().and_then(Daemon::pid)
    }

    /// Pid of OSD process `i`, if started.
    pub fn osd_pid(&self, i: usize) -> Option<u32> {
        self.osds[i].pid()
    }

    /// SIGKILLs the manager.
    pub fn kill_mgr(&mut self) {
        self.mgr.kill();
    }

    /// Starts the manager again (SIGKILLing it first if it still runs), waits for its
    /// API, then waits until every running OSD has heartbeated to it.
    pub fn restart_mgr(&mut self) {
        self.mgr.kill();
        let since = Instant::now();
        self.mgr.start();
        self.wait_mgr();
        for i in 0..self.osds.len() {
            if self.osds[i].is_running() {
                self.wait_osd_ready(i, since);
            }
        }
    }

    /// Whether the manager is running.
    pub fn mgr_running(&mut self) -> bool {
        self.mgr.is_running()
    }

    /// SIGKILLs flame-nbd.
    pub fn kill_nbd(&mut self) {
        if let Some(nbd) = &mut self.nbd {
            nbd.kill();
        }
    }

    /// Starts flame-nbd again (SIGKILLing it first) and waits for its port.
    pub fn restart_nbd(&mut self) {
        self.kill_nbd();
        self.start_nbd_and_wait();
    }

    /// Whether flame-nbd is running (false if the cluster has none).
    pub fn nbd_running(&mut self) -> bool {
        self.nbd.as_mut().is_some_and(Daemon::is_running)
    }

    /// Panics, with the logs, unless every daemon that was started is still running.
    /// Tests call it after abusing the cluster: a daemon that died of bad input is a
    /// bug even if the others cover for it.
    pub fn assert_all_running(&mut self) {
        let mut dead = Vec::new();
        if let Some(s) = self.mgr.exited() {
            dead.push(format!("mgr ({s})"));
        }
        for osd in &mut self.osds {
            if let Some(s) = osd.exited() {
                dead.push(format!("{} ({s})", osd.name));
            }
        }
        if let Some(nbd) = &mut self.nbd
            && let Some(s) = nbd.exited()
        {
            dead.push(format!("nbd ({s})"));
        }
        assert!(
            dead.is_empty(),
            "daemons exited: {}\n{}",
            dead.join(", "),
            self.log_tails()
        );
    }

    /// Stops everything: SIGTERM to every daemon, up to [`STOP_GRACE`] to exit,
    /// then SIGKILL.
    pub fn stop_all(&mut self) {
        if let Some(nbd) = &self.nbd {
            nbd.signal_term();
        }
        for osd in &self.osds {
            osd.signal_term();
        }
        self.mgr.signal_term();
        let deadline = Instant::now() + STOP_GRACE;
        if let Some(nbd) = &mut self.nbd {
            nbd.reap_by(deadline);
        }
        for osd in &mut self.osds {
            osd.reap_by(deadline);
        }
        self.mgr.reap_by(deadline);
    }

    /// SIGKILLs every daemon at once (a power-cut-like stop of all processes).
    pub fn kill_all(&mut self) {
        self.kill_nbd();
        for osd in &mut self.osds {
            osd.kill();
        }
        self.mgr.kill();
    }

    /// Starts every daemon that is not running (manager first) and waits until the
    /// cluster is ready again.
    pub fn start_all(&mut self) {
        let since = Instant::now();
        if !self.mgr.is_running() {
            self.mgr.kill();
            self.mgr.start();
        }
        self.wait_mgr();
        for osd in &mut self.osds {
            if !osd.is_running() {
                osd.kill();
                osd.start();
            }
        }
        for i in 0..self.osds.len() {
            self.wait_osd_ready(i, since);
        }
        if self.nbd.is_some() && !self.nbd_running() {
            self.restart_nbd();
        }
    }

    fn start_nbd_and_wait(&mut self) {
        let addr = self.nbd_addr();
        let Some(nbd) = &mut self.nbd else { return };
        nbd.start();
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Some(nbd) = &mut self.nbd
                && let Some(status) = nbd.exited()
            {
                panic!("flame-nbd exited ({status})\n{}", self.log_tails());
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(500)).is_ok() {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "flame-nbd did not listen on {addr} within {STARTUP_TIMEOUT:?}\n{}",
                    self.log_tails()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn wait_mgr(&mut self) {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            if let Some(status) = self.mgr.exited() {
                panic!("flame-mgr exited ({status})\n{}", self.log_tails());
            }
            let last = match self.try_status() {
                Ok(_) => return,
                Err(e) => e,
            };
            if Instant::now() > deadline {
                panic!(
                    "flame-mgr API at {} not ready within {STARTUP_TIMEOUT:?}: {last}\n{}",
                    self.mgr_addr,
                    self.log_tails()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until OSD process `i` accepts connections on every shard port and the
    /// manager lists it up with a heartbeat received after `since`.
    fn wait_osd_ready(&mut self, i: usize, since: Instant) {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        let data = self.osd_addrs[i].data;
        loop {
            if let Some(status) = self.osds[i].exited() {
                panic!("osd.{i} exited ({status})\n{}", self.log_tails());
            }
            let problem = self.osd_problem(i, data, since);
            let Some(problem) = problem else { return };
            if Instant::now() > deadline {
                panic!(
                    "osd.{i} not ready within {STARTUP_TIMEOUT:?}: {problem}\n{}",
                    self.log_tails()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Why OSD `i` is not ready yet, or `None` if it is.
    fn osd_problem(&self, i: usize, data: SocketAddr, since: Instant) -> Option<String> {
        for s in 0..self.opts.shards {
            let addr = self.osd_addr(i, s);
            if let Err(e) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
                return Some(format!("shard {s} at {addr} not accepting: {e}"));
            }
        }
        let osds = match self.try_osds() {
            Ok(o) => o,
            Err(e) => return Some(e),
        };
        let Some(entry) = osds.iter().find(|o| o.info.addr == data) else {
            return Some(format!("manager does not list an OSD at {data}"));
        };
        if !entry.info.up {
            return Some(format!("{} is down in the map", entry.info.id));
        }
        match entry.last_heartbeat_ms_ago {
            Some(ms) if Duration::from_millis(ms) <= since.elapsed() => None,
            Some(ms) => Some(format!("last heartbeat {ms} ms ago, before the restart")),
            None => Some("no heartbeat since the manager started".into()),
        }
    }

    /// Waits (bounded) until the manager reports `n` OSDs up.
    pub fn wait_osds_up(&mut self, n: u32) {
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            let last = match self.try_status() {
                Ok(s) if s.osds_up == n => return,
                Ok(s) => format!("{} of {} OSDs up", s.osds_up, s.osds),
                Err(e) => e,
            };
            if Instant::now() > deadline {
                panic!(
                    "cluster did not reach {n} OSDs up within {STARTUP_TIMEOUT:?}: {last}\n{}",
                    self.log_tails()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    // ---------------------------------------------------------------- manager API

    /// GET on the manager API, signed as `client.admin`: `(status code, body)`.
    pub fn api_get(&self, path: &str) -> Result<(u16, String), String> {
        self.mgr_call("GET", path, None)
    }

    /// What an in-process test client connects to: the manager, signing as
    /// `client.admin` when the cluster authenticates.
    pub fn client_target(&self) -> oracle::ClientTarget {
        oracle::ClientTarget {
            mgr: self.mgr_addr.to_string(),
            keyring: self.keyring("client.admin"),
            mgr_tls_ca: self.mgr_tls_ca(),
        }
    }

    /// The cluster's keys (`None` with `auth: none`).
    pub fn keys(&self) -> Option<&TestKeys> {
        self.keys.as_ref()
    }

    /// What makes HELLOs for raw connections to this cluster's OSDs
    /// ([`HelloMaker`]; `Send`, so it moves into a test's reactor).
    pub fn hello_maker(&self) -> HelloMaker {
        HelloMaker {
            service: self
                .keys
                .as_ref()
                .map(|k| &*Box::leak(Box::new(k.service()))),
            admin: false,
        }
    }

    /// [`HelloMaker::hello`] of this cluster.
    pub fn hello(
        &self,
        osd: OsdId,
        shard: u16,
        epoch: Epoch,
        peer: bool,
        session: u64,
        generation: u64,
    ) -> Message {
        self.hello_maker()
            .hello(osd, shard, epoch, peer, session, generation)
    }

    /// The keyring of `entity` (`client.admin`, `osd`, `client.test`), if the
    /// cluster authenticates.
    pub fn keyring(&self, entity: &str) -> Option<PathBuf> {
        self.keys.as_ref().map(|k| k.keyring(entity))
    }

    /// A manager endpoint signing as `creds` (none: unsigned).
    pub fn mgr_endpoint(
        &self,
        creds: Option<flame_common::auth::Credentials>,
    ) -> flame_common::http::MgrEndpoint {
        let trust = self
            .mgr_tls_ca()
            .map(|ca| flame_common::tls::MgrTrust::load(&ca).unwrap_or_else(|e| panic!("{e}")));
        let agent = match &trust {
            None => agent(),
            Some(t) => flame_common::http::agent(
                ureq::Agent::config_builder()
                    .http_status_as_error(false)
                    .timeout_global(Some(HTTP_TIMEOUT)),
                None,
                Some(t),
            ),
        };
        flame_common::http::MgrEndpoint {
            agent,
            base: self.mgr_url(""),
            creds,
        }
    }

    /// `METHOD path` with an optional JSON body on the manager API, signed as
    /// `client.admin` when the cluster authenticates: `(status, body)`; errors
    /// are transport failures (and answers whose signature does not check).
    pub fn mgr_call(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
    ) -> Result<(u16, String), String> {
        let creds = self.keys.as_ref().map(|k| k.creds("client.admin", 1));
        mgr_call_as(&self.mgr_endpoint(creds), method, path, body)
    }

    /// Adds OSD process `i`'s own entity `osd.i` (role osd) to the manager's
    /// table; its keyring is written with its configuration.
    pub fn add_osd_entity(&self, i: usize) {
        let added = self.mgr_post(
            "/v1/auth/entities",
            &serde_json::json!({"entity": format!("osd.{i}"), "role": "osd"}),
        );
        assert!(matches!(added, Ok((200, _))), "add osd.{i}: {added:?}");
    }

    /// `POST path` with JSON `body` as `client.admin`: `(status, body)`.
    pub fn mgr_post<B: serde::Serialize>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<(u16, String), String> {
        let bytes = serde_json::to_vec(body).map_err(|e| e.to_string())?;
        self.mgr_call("POST", path, Some(&bytes))
    }

    fn api_json<T: serde::de::DeserializeOwned>(&self, path: &str) -> Result<T, String> {
        let (code, body) = self.api_get(path)?;
        if !(200..300).contains(&code) {
            return Err(format!("GET {path}: HTTP {code}: {body}"));
        }
        serde_json::from_str(&body).map_err(|e| format!("GET {path}: bad JSON ({e}): {body}"))
    }

    /// `GET /v1/status`.
    pub fn try_status(&self) -> Result<ClusterStatus, String> {
        self.api_json("/v1/status")
    }

    /// `GET /v1/status`, panicking on failure.
    pub fn status(&self) -> ClusterStatus {
        self.try_status()
            .unwrap_or_else(|e| panic!("status: {e}\n{}", self.log_tails()))
    }

    /// `GET /v1/osds`.
    pub fn try_osds(&self) -> Result<Vec<OsdStatus>, String> {
        self.api_json("/v1/osds")
    }

    /// `GET /v1/map`, panicking on failure.
    pub fn map(&self) -> ClusterMap {
        self.api_json("/v1/map")
            .unwrap_or_else(|e| panic!("map: {e}\n{}", self.log_tails()))
    }

    /// `GET /v1/volumes/{name}`, panicking on failure.
    pub fn volume(&self, name: &str) -> VolumeInfo {
        self.api_json(&format!("/v1/volumes/{name}"))
            .unwrap_or_else(|e| panic!("volume {name}: {e}\n{}", self.log_tails()))
    }

    /// Creates a volume through the API (`POST /v1/volumes`), panicking on failure.
    pub fn create_volume(&self, name: &str, size_bytes: u64) -> VolumeInfo {
        let body = VolumeCreate {
            name: name.to_string(),
            size: size_bytes,
        };
        let result = self
            .mgr_post("/v1/volumes", &body)
            .and_then(|(code, text)| {
                if (200..300).contains(&code) {
                    serde_json::from_str::<VolumeInfo>(&text)
                        .map_err(|e| format!("bad JSON ({e}): {text}"))
                } else {
                    Err(format!("HTTP {code}: {text}"))
                }
            });
        let info = result.unwrap_or_else(|e| {
            panic!(
                "create volume {name} ({size_bytes} bytes): {e}\n{}",
                self.log_tails()
            )
        });
        assert_eq!(info.name, name);
        assert_eq!(info.size, size_bytes);
        info
    }

    // ---------------------------------------------------------------- flame-admin

    /// `flame-admin` pointed at this cluster (`FLAME_MGR`) as `client.admin`
    /// (`FLAME_KEYRING`, when the cluster authenticates), to add arguments to.
    pub fn admin_command(&self) -> Command {
        let mut cmd = Command::new(self.bin("flame-admin"));
        cmd.env("FLAME_MGR", self.mgr_addr.to_string())
            .env_remove("FLAME_KEYRING")
            .env_remove("FLAME_MGR_CA");
        if let Some(ca) = self.mgr_tls_ca() {
            cmd.env("FLAME_MGR_CA", ca);
        }
        if let Some(k) = &self.keys {
            cmd.env("FLAME_KEYRING", k.keyring("client.admin"));
        }
        cmd
    }

    /// Runs `flame-admin --mgr <mgr> ARGS...` (bounded by [`TOOL_TIMEOUT`]).
    pub fn admin(&self, args: &[&str]) -> Output {
        let mut cmd = self.admin_command();
        cmd.arg("--mgr").arg(self.mgr_addr.to_string()).args(args);
        run_bounded(&mut cmd, TOOL_TIMEOUT)
    }

    /// Runs flame-admin and panics (with its output and the logs) unless it
    /// succeeds; returns stdout.
    pub fn admin_ok(&self, args: &[&str]) -> String {
        let out = self.admin(args);
        if !out.status.success() {
            panic!(
                "flame-admin {args:?} failed ({}):\n{}\n{}",
                out.status,
                output_text(&out),
                self.log_tails()
            );
        }
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Runs `flame-admin ARGS... --json`, asserts success and parses stdout.
    pub fn admin_json(&self, args: &[&str]) -> serde_json::Value {
        let mut all: Vec<&str> = args.to_vec();
        all.push("--json");
        let stdout = self.admin_ok(&all);
        serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("flame-admin {all:?}: stdout is not JSON ({e}):\n{stdout}"))
    }

    // ---------------------------------------------------------------- NBD helpers

    /// Creates volume `name` of `size` bytes and waits until flame-nbd exports it
    /// (what every NBD test does first).
    pub fn create_nbd_volume(&self, name: &str, size: u64) -> VolumeInfo {
        let vol = self.create_volume(name, size);
        self.wait_nbd_export(name);
        vol
    }

    /// Waits (bounded) until flame-nbd serves the export `volume` (`nbdinfo --size`
    /// succeeds). A just-created volume may need a map refresh in flame-nbd.
    pub fn wait_nbd_export(&self, volume: &str) -> u64 {
        let nbdinfo = require_tool("nbdinfo");
        let uri = self.nbd_uri(volume);
        let deadline = Instant::now() + STARTUP_TIMEOUT;
        loop {
            let out = run_bounded(
                Command::new(&nbdinfo).arg("--size").arg(&uri),
                Duration::from_secs(30),
            );
            if out.status.success() {
                let text = String::from_utf8_lossy(&out.stdout);
                return text
                    .trim()
                    .parse()
                    .unwrap_or_else(|e| panic!("nbdinfo --size {uri} printed {text:?}: {e}"));
            }
            if Instant::now() > deadline {
                panic!(
                    "export {volume} not served by flame-nbd within {STARTUP_TIMEOUT:?}:\n{}\n{}",
                    output_text(&out),
                    self.log_tails()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Runs `qemu-io -f raw <uri> -c CMD...` on `volume` and panics unless every
    /// command succeeded (qemu-io exits non-zero and prints "Pattern verification
    /// failed" when a `read -P` does not match). Returns stdout.
    pub fn qemu_io(&self, volume: &str, commands: &[&str]) -> String {
        self.qemu_io_uri(&self.nbd_uri(volume), commands)
    }

    /// [`Self::qemu_io`] on any NBD URI (`nbd+unix://…`).
    pub fn qemu_io_uri(&self, uri: &str, commands: &[&str]) -> String {
        let volume = uri;
        let mut cmd = Command::new(require_tool("qemu-io"));
        cmd.arg("-f").arg("raw").arg(uri);
        for c in commands {
            cmd.arg("-c").arg(c);
        }
        let out = run_bounded(&mut cmd, TOOL_TIMEOUT);
        let text = output_text(&out);
        if !out.status.success()
            || text.contains("Pattern verification failed")
            || text.contains("failed:")
        {
            panic!(
                "qemu-io {commands:?} on {volume} failed ({}):\n{text}\n{}",
                out.status,
                self.log_tails()
            );
        }
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    // ---------------------------------------------------------------- diagnostics

    /// Everything the manager has logged so far (every run of it).
    pub fn mgr_log(&self) -> String {
        fs::read_to_string(&self.mgr.log).unwrap_or_default()
    }

    /// Everything OSD `i` has logged so far (every run of it; empty if none).
    pub fn osd_log(&self, i: usize) -> String {
        self.osds
            .get(i)
            .and_then(|o| fs::read_to_string(&o.log).ok())
            .unwrap_or_default()
    }

    /// The last lines of every daemon's log, for failure messages.
    pub fn log_tails(&self) -> String {
        let mut s = format!("---- cluster dir {} ----\n", self.root.display());
        let mut logs = vec![&self.mgr.log];
        logs.extend(self.osds.iter().map(|o| &o.log));
        if let Some(nbd) = &self.nbd {
            logs.push(&nbd.log);
        }
        for log in logs {
            let text = fs::read_to_string(log).unwrap_or_else(|e| format!("(unreadable: {e})"));
            let lines: Vec<&str> = text.lines().collect();
            let from = lines.len().saturating_sub(LOG_TAIL_LINES);
            let _ = writeln!(
                s,
                "---- {} (last {} lines) ----",
                log.display(),
                lines.len() - from
            );
            for line in &lines[from..] {
                let _ = writeln!(s, "{line}");
            }
        }
        s
    }
}

impl Drop for TestCluster {
    fn drop(&mut self) {
        self.kill_all();
        if std::thread::panicking() {
            // Shown by the test runner next to the failure.
            eprintln!("{}", self.log_tails());
        }
        if std::env::var_os("FLAME_TEST_KEEP").is_some()
            && let Some(dir) = self.dir.take()
        {
            let _ = dir.keep();
            eprintln!(
                "FLAME_TEST_KEEP: cluster directory kept at {}",
                self.root.display()
            );
        }
    }
}

// -------------------------------------------------------------------- free helpers

/// The directory holding this build's binaries: the test executable lives in
/// `target/<profile>/deps/`, the binaries in `target/<profile>/`.
pub fn bin_dir() -> PathBuf {
    let exe =
        std::env::current_exe().unwrap_or_else(|e| panic!("cannot find the test executable: {e}"));
    let mut dir = exe
        .parent()
        .unwrap_or_else(|| panic!("test executable {} has no parent", exe.display()))
        .to_path_buf();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    dir
}

/// The OSDs' `lease_ms` line: the rule lease_ms + heartbeat_interval_ms <
/// heartbeat_grace_ms (docs/guarantees.md) for the grace the test chose, while
/// outliving two heartbeat intervals (the OSD requires it: a test that slows
/// heartbeats down to keep a map stale gets a lease to match). A test that sets
/// lease_ms itself keeps it (empty line).
/// `FLAME_TEST_THREADING=staged` runs every test cluster's OSDs in the staged
/// threading mode (CI runs a cluster test that way so the mode does not rot);
/// unset or `penetrating` keeps the default. A test that sets `threading:` itself
/// in `osd_extra_yaml` wins.
fn threading_yaml(extra: &str) -> &'static str {
    if extra.contains("threading:") {
        return "";
    }
    match std::env::var("FLAME_TEST_THREADING").as_deref() {
        Ok("staged") => "threading: staged\nnetwork_threads: 1\n",
        Ok("penetrating") | Ok("") | Err(_) => "",
        Ok(other) => panic!("FLAME_TEST_THREADING={other}: expected staged or penetrating"),
    }
}

/// The memory-pool mode test daemons use: `FLAME_TEST_MEMORY_POOL` (`percpu`,
/// `locked` or `heap`), so CI can run a cluster test with the `locked` pool, or the
/// default (`percpu`).
pub fn test_memory_pool_mode() -> String {
    match std::env::var("FLAME_TEST_MEMORY_POOL") {
        Ok(m) if ["percpu", "locked", "heap"].contains(&m.as_str()) => m,
        Ok(m) if !m.is_empty() => {
            panic!("FLAME_TEST_MEMORY_POOL={m}: want percpu, locked or heap")
        }
        _ => "percpu".into(),
    }
}

/// The `memory_pool` section of a test daemon's config (none when `extra` has its
/// own): the mode from [`test_memory_pool_mode`], 32 MiB per thread (the regions
/// are pinned for io_uring, and a test machine runs many daemons at once).
fn memory_pool_yaml(extra: &str) -> String {
    if extra.contains("memory_pool:") {
        return String::new();
    }
    format!(
        "memory_pool:\n  mode: {}\n  bytes_per_thread: 33554432\n",
        test_memory_pool_mode()
    )
}

fn lease_yaml(opts: &ClusterOptions) -> String {
    let interval = opts.osd_heartbeat_interval_ms;
    let lease_ms = (opts.heartbeat_grace_ms.saturating_sub(interval) * 2 / 3)
        .clamp(2 * interval, 4000.max(2 * interval));
    if opts.osd_extra_yaml.contains("lease_ms:") {
        String::new()
    } else {
        format!("lease_ms: {lease_ms}\n")
    }
}

/// The daemon of OSD process `i` (not started) listening on `ip`, and its
/// addresses: its YAML configuration written into the cluster directory `root`.
fn osd_daemon(
    root: &Path,
    bin_dir: &Path,
    (mgr_addr, keys): (SocketAddr, Option<&TestKeys>),
    opts: &ClusterOptions,
    i: usize,
    ip: Ipv4Addr,
) -> (Daemon, OsdAddrs) {
    let on = |ip: Ipv4Addr, port: u16| SocketAddr::from((ip, port));
    let keyring_yaml = keys
        .map(|k| {
            let entity = format!("osd.{i}");
            k.write_keyring(&entity, 1);
            format!("keyring: \"{}\"\n", k.keyring(&entity).display())
        })
        .unwrap_or_default();
    let addrs = OsdAddrs {
        data: on(ip, free_ports_on(ip, opts.shards)),
        metrics: on(ip, free_ports_on(ip, 1)),
    };
    let yaml = format!(
        "# flame-osd config written by the test harness\n\
         mgr: \"{mgr_addr}\"\n\
         {keyring_yaml}\
         {}\
         listen: \"{}\"\n\
         metrics_listen: \"{}\"\n\
         data_dir: \"{}\"\n\
         host: \"test-host-{i}\"\n\
         shards: {}\n\
         poll_mode: {}\n\
         transport: {}\n\
         heartbeat_interval_ms: {}\n\
         {}{}{}{}\n",
        mgr_ca_yaml(opts, root),
        addrs.data,
        addrs.metrics,
        root.join(format!("osd.{i}")).display(),
        opts.shards,
        opts.poll_mode,
        opts.transport,
        opts.osd_heartbeat_interval_ms,
        lease_yaml(opts),
        threading_yaml(&opts.osd_extra_yaml),
        memory_pool_yaml(&opts.osd_extra_yaml),
        opts.osd_extra_yaml,
    );
    let name = format!("osd.{i}");
    let daemon = Daemon::new(
        &name,
        binary(bin_dir, "flame-osd"),
        write_config(root, &format!("{name}.yaml"), &yaml),
        root.join(format!("{name}.log")),
        (0..opts.shards)
            .map(|s| on(ip, addrs.data.port() + s))
            .chain([addrs.metrics])
            .collect(),
    );
    (daemon, addrs)
}

/// The cluster CA of a harness cluster whose manager serves TLS.
fn mgr_ca_path(opts: &ClusterOptions, root: &Path) -> Option<PathBuf> {
    opts.mgr_tls
        .then(|| root.join("tls").join(flame_common::tls::CA_CERT_FILE))
}

/// `mgr_tls_ca: …` for a daemon's config when the manager serves TLS.
/// flame-nbd's Unix socket export, in the cluster's directory.
const NBD_SOCKET_FILE: &str = "nbd.sock";

fn mgr_ca_yaml(opts: &ClusterOptions, root: &Path) -> String {
    mgr_ca_path(opts, root)
        .map(|p| format!("mgr_tls_ca: \"{}\"\n", p.display()))
        .unwrap_or_default()
}

fn binary(bin_dir: &Path, name: &str) -> PathBuf {
    let path = bin_dir.join(name);
    if !path.is_file() {
        panic!(
            "{} not found: run `cargo build --workspace --bins` (same profile as the tests) \
             before `cargo test` — scripts/test.sh does both",
            path.display()
        );
    }
    path
}

fn write_config(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    fs::write(&path, text).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    path
}

/// Ports handed out by this process, so two clusters of one test binary (tests run
/// in parallel threads) never get the same port.
static TAKEN_PORTS: Mutex<BTreeSet<u16>> = Mutex::new(BTreeSet::new());
static PORT_SEED: AtomicU64 = AtomicU64::new(0);

/// Lowest port handed out. Below the kernel's ephemeral range (32768+), so an
/// outgoing connection of some daemon cannot grab a port between our probe and the
/// daemon's bind.
const PORT_MIN: u16 = 20_000;
/// One past the highest port handed out.
const PORT_END: u16 = 32_000;

/// The loopback addresses of a cluster's daemons: with per-daemon addresses, host
/// numbers in the cluster's own leased subnet ([`net::NetLease`]): the manager .10,
/// OSD `i` .(11+i), clients .9; .8 stays unused (a test's extra client).
#[derive(Debug)]
struct DaemonIps {
    mgr: Ipv4Addr,
    osds: Vec<Ipv4Addr>,
    client: Ipv4Addr,
    /// The subnet, held while the cluster lives; `None`: everything on 127.0.0.1.
    lease: Option<net::NetLease>,
}

/// Most OSDs with per-daemon addresses (hosts .11 to .250 of the subnet).
const PER_DAEMON_OSDS_MAX: usize = 240;

impl DaemonIps {
    fn new(per_daemon: bool, osds: usize) -> DaemonIps {
        if !per_daemon {
            let lo = Ipv4Addr::LOCALHOST;
            return DaemonIps {
                mgr: lo,
                osds: vec![lo; osds],
                client: lo,
                lease: None,
            };
        }
        let lease = net::NetLease::acquire();
        let mut ips = DaemonIps {
            mgr: lease.ip(10),
            osds: Vec::new(),
            client: lease.ip(9),
            lease: Some(lease),
        };
        for i in 0..osds {
            let ip = ips.osd(i);
            ips.osds.push(ip);
        }
        ips
    }

    /// The address of OSD process `i` (existing or about to be added).
    fn osd(&self, i: usize) -> Ipv4Addr {
        match &self.lease {
            None => Ipv4Addr::LOCALHOST,
            Some(l) => {
                assert!(
                    i < PER_DAEMON_OSDS_MAX,
                    "per-daemon addresses for at most {PER_DAEMON_OSDS_MAX} OSDs"
                );
                l.ip(11 + i as u8)
            }
        }
    }
}

/// Finds `count` consecutive free loopback ports and returns the first. Each
/// candidate range is probed by binding every port in it; ranges already handed out
/// by this process are skipped.
pub fn free_ports(count: u16) -> u16 {
    free_ports_on(Ipv4Addr::LOCALHOST, count)
}

/// [`free_ports`] on loopback address `ip`.
pub fn free_ports_on(ip: Ipv4Addr, count: u16) -> u16 {
    assert!(count > 0 && count < 100, "free_ports({count})");
    let seed = PORT_SEED.fetch_add(1, Ordering::Relaxed)
        ^ u64::from(std::process::id()) << 32
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    let span = u64::from(PORT_END - PORT_MIN - count);
    let mut taken = TAKEN_PORTS.lock().unwrap_or_else(|e| e.into_inner());
    for attempt in 0..1000u64 {
        let base = PORT_MIN + (mix64(seed.wrapping_add(attempt)) % span) as u16;
        let range = base..base + count;
        if range.clone().any(|p| taken.contains(&p)) {
            continue;
        }
        // Hold every listener until all are bound, then release them together.
        let bound: Result<Vec<TcpListener>, _> =
            range.clone().map(|p| TcpListener::bind((ip, p))).collect();
        if bound.is_ok() {
            taken.extend(range);
            return base;
        }
    }
    panic!("no {count} consecutive free loopback ports in {PORT_MIN}..{PORT_END}");
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(HTTP_TIMEOUT))
        .build()
        .into()
}

/// `METHOD path` through `endpoint` (signed if it has credentials) →
/// `(status, body)`; errors are transport failures or untrusted answers.
pub fn mgr_call_as(
    endpoint: &flame_common::http::MgrEndpoint,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
) -> Result<(u16, String), String> {
    let a = endpoint
        .call(method, path, body, HTTP_TIMEOUT, 256 << 20)
        .map_err(|e| format!("{method} {path}: {e}"))?;
    Ok((a.status, String::from_utf8_lossy(&a.body).into_owned()))
}

/// The sum of the samples of metric family `name` at `addr`'s `/metrics` whose
/// labels contain `label` (`reason="idle"`; `""` for every sample): a counter or
/// gauge over the children a test cares about. 0 when there are none.
pub fn metric_sum(addr: SocketAddr, name: &str, label: &str) -> u64 {
    let (code, text) = http_get(addr, "/metrics").unwrap_or_else(|e| panic!("{addr}: {e}"));
    assert_eq!(code, 200, "{addr}/metrics: HTTP {code}");
    metric_sum_in(&text, name, label)
}

/// [`metric_sum`], or `None` when `addr` does not answer (a daemon
/// restarting).
pub fn try_metric_sum(addr: SocketAddr, name: &str, label: &str) -> Option<u64> {
    match http_get(addr, "/metrics") {
        Ok((200, text)) => Some(metric_sum_in(&text, name, label)),
        _ => None,
    }
}

fn metric_sum_in(text: &str, name: &str, label: &str) -> u64 {
    text.lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
                && l.contains(label)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum()
}

/// `GET http://<addr><path>` → `(status, body)`, unsigned (OSD and flame-nbd
/// endpoints, the manager's `/metrics`); errors are transport failures.
pub fn http_get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let url = format!("http://{addr}{path}");
    let mut resp = agent()
        .get(&url)
        .call()
        .map_err(|e| format!("GET {url}: {e}"))?;
    let code = resp.status().as_u16();
    let body = resp
        .body_mut()
        .read_to_string()
        .map_err(|e| format!("GET {url}: reading body: {e}"))?;
    Ok((code, body))
}

/// Finds an external tool on `PATH`, or panics telling how to install it. Tests do
/// not skip when a tool is missing: a skipped test would pass CI silently.
pub fn require_tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    for dir in std::env::split_paths(&path) {
        let candidate = dir.join(name);
        if candidate.is_file() {
            return candidate;
        }
    }
    panic!(
        "required tool `{name}` not found on PATH. scripts/test.sh installs the test \
         tools (apt-get install qemu-utils libnbd-bin fio python3-libnbd fuse3)"
    );
}

/// Runs a command to completion with a deadline, capturing stdout and stderr. On
/// timeout the command is killed and the test fails with what it printed so far.
pub fn run_bounded(cmd: &mut Command, timeout: Duration) -> Output {
    let desc = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {desc}: {e}"));
    let mut out_pipe = child.stdout.take();
    let mut err_pipe = child.stderr.take();
    let out_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(p) = out_pipe.as_mut() {
            let _ = p.read_to_end(&mut v);
        }
        v
    });
    let err_reader = std::thread::spawn(move || {
        let mut v = Vec::new();
        if let Some(p) = err_pipe.as_mut() {
            let _ = p.read_to_end(&mut v);
        }
        v
    });
    let deadline = Instant::now() + timeout;
    let (status, timed_out) = loop {
        match child.try_wait() {
            Ok(Some(status)) => break (status, false),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let _ = child.kill();
                match child.wait() {
                    Ok(status) => break (status, true),
                    Err(e) => panic!("cannot reap {desc}: {e}"),
                }
            }
            Err(e) => panic!("cannot wait for {desc}: {e}"),
        }
    };
    let output = Output {
        status,
        stdout: out_reader.join().unwrap_or_default(),
        stderr: err_reader.join().unwrap_or_default(),
    };
    if timed_out {
        panic!(
            "{desc} did not finish within {timeout:?}; killed. Output so far:\n{}",
            output_text(&output)
        );
    }
    output
}

/// Runs a command with [`run_bounded`] and panics unless it succeeds.
pub fn run_ok(cmd: &mut Command, timeout: Duration) -> Output {
    let desc = format!("{cmd:?}");
    let out = run_bounded(cmd, timeout);
    if !out.status.success() {
        panic!("{desc} failed ({}):\n{}", out.status, output_text(&out));
    }
    out
}

/// stdout and stderr of a finished command, for messages.
pub fn output_text(out: &Output) -> String {
    format!(
        "--- stdout ---\n{}--- stderr ---\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Deterministic pseudo-random bytes: the same `seed` always gives the same data, so
/// a failing comparison can be reproduced, and different seeds never look alike.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 8);
    let mut i = 0u64;
    while v.len() < len {
        v.extend_from_slice(&mix64(seed ^ mix64(i)).to_le_bytes());
        i += 1;
    }
    v.truncate(len);
    v
}

/// Index and length of the first difference between two byte strings, for
/// readable assertion messages on megabytes of data.
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<String> {
    if let Some(i) = a.iter().zip(b).position(|(x, y)| x != y) {
        return Some(format!(
            "first difference at byte {i} (offset {i:#x}): {:#04x} vs {:#04x}",
            a[i], b[i]
        ));
    }
    if a.len() != b.len() {
        return Some(format!("lengths differ: {} vs {}", a.len(), b.len()));
    }
    None
}

/// Asserts two byte strings are equal, reporting where they differ instead of
/// printing both.
#[track_caller]
pub fn assert_same_bytes(what: &str, got: &[u8], want: &[u8]) {
    if let Some(diff) = first_difference(got, want) {
        panic!("{what}: {diff}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn free_ports_are_distinct_and_bindable() {
        // Each range was bound whole before it was handed out (free_ports does
        // that itself); binding it again here would race every other process on
        // the machine (a CI run once lost that race), so check what is ours to
        // check: ranges never overlap and stay in bounds.
        let ranges: Vec<u16> = (0..50).map(|_| free_ports(4)).collect();
        for (i, &a) in ranges.iter().enumerate() {
            assert!((PORT_MIN..=PORT_END - 4).contains(&a), "{a}");
            for &b in &ranges[i + 1..] {
                assert!(a + 4 <= b || b + 4 <= a, "ranges overlap: {a} {b}");
            }
        }
    }

    #[test]
    fn pattern_is_deterministic_and_seed_dependent() {
        assert_eq!(pattern(1, 1000), pattern(1, 1000));
        assert_ne!(pattern(1, 1000), pattern(2, 1000));
        assert_eq!(pattern(3, 13).len(), 13);
        assert_eq!(&pattern(3, 13)[..], &pattern(3, 20)[..13]);
    }

    #[test]
    fn first_difference_finds_it() {
        assert_eq!(first_difference(b"abc", b"abc"), None);
        assert!(first_difference(b"abc", b"abd").unwrap().contains("byte 2"));
        assert!(first_difference(b"ab", b"abc").unwrap().contains("lengths"));
    }

    #[test]
    fn run_bounded_kills_on_timeout() {
        let r = std::panic::catch_unwind(|| {
            run_bounded(Command::new("sleep").arg("30"), Duration::from_millis(200))
        });
        assert!(r.is_err(), "a command past its deadline must fail the test");
        let out = run_bounded(&mut Command::new("true"), Duration::from_secs(10));
        assert!(out.status.success());
    }

    #[test]
    fn bin_dir_is_the_profile_dir() {
        let d = bin_dir();
        assert_ne!(d.file_name().and_then(|n| n.to_str()), Some("deps"));
        assert!(d.join("deps").is_dir(), "{} has no deps/", d.display());
    }
}
