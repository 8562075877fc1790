//! End-to-end tests of the real `flame-mgr` binary over HTTP on 127.0.0.1.
//!
//! Each test starts the binary with `listen: 127.0.0.1:0` and a temporary data
//! directory, and learns the port from its "listening on http://ADDR" log line, so
//! tests never race each other for ports.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_common::auth::{Credentials, EntityName, Keyring, KeyringEntity, SecretKey};
use flame_common::http::MgrEndpoint;
use flame_common::ids::{Epoch, OsdId};
use flame_common::map::{ClusterMap, VolumeInfo};
use flame_common::mgr_api::{
    ApiError, ClusterStatus, HeartbeatReply, OsdBoot, OsdBootReply, OsdFailureReply,
    OsdFailureReport, OsdHeartbeat, OsdOpReply, OsdReweight, OsdStatus, PG_RECOVERED_ENTRIES_MAX,
    PgRecoveredReply, PgRecoveredReport, TrimDone, TrimRange, VolumeCreate, VolumeResize,
    VolumeTrim,
};
use flame_common::placement::PgMembers;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const START_TIMEOUT: Duration = Duration::from_secs(20);

/// A running manager, called as `client.admin` (its config's directory holds
/// the keys; unsigned if the config has `auth: none`).
struct Mgr {
    child: Child,
    url: String,
    log: Arc<Mutex<String>>,
    dir: PathBuf,
}

/// The cluster secret of the test directory `dir` (`dir/keys/cluster.keyring`),
/// created on first use as `flame-admin auth init` would.
fn cluster_secret(dir: &Path) -> SecretKey {
    let keys = dir.join("keys");
    let path = keys.join("cluster.keyring");
    if let Ok(k) = Keyring::load(&path) {
        return k.key;
    }
    Keyring::init_cluster(&keys).unwrap().0
}

/// Credentials of `entity` at `generation` in the cluster of `dir`.
fn creds_in(dir: &Path, entity: &str, generation: u64) -> Credentials {
    let entity = EntityName::parse(entity).unwrap();
    Credentials {
        key: cluster_secret(dir).derive_entity_key(&entity, generation),
        entity,
        generation,
    }
}

/// A config in `dir` with the cluster keyring (unless `extra` sets `auth:`).
fn write_config(dir: &Path, extra: &str) -> PathBuf {
    let path = dir.join("mgr.yaml");
    let keyring = if extra.contains("auth:") {
        String::new()
    } else {
        cluster_secret(dir);
        format!("keyring: {}\n", dir.join("keys/cluster.keyring").display())
    };
    let yaml = format!(
        "listen: 127.0.0.1:0\ndata_dir: {}\n{keyring}{extra}",
        dir.join("data").display()
    );
    std::fs::write(&path, yaml).unwrap();
    path
}

/// Spawns the binary; returns the child, its accumulated log and a channel of its
/// log lines (closed when it exits).
fn spawn(config: &Path) -> (Child, Arc<Mutex<String>>, Receiver<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_flame-mgr"))
        .arg("--config")
        .arg(config)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let log = Arc::new(Mutex::new(String::new()));
    let (tx, rx) = channel();
    let log2 = Arc::clone(&log);
    // Drains stderr for the life of the process, so it can never block on a full pipe.
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            log2.lock().unwrap().push_str(&line);
            log2.lock().unwrap().push('\n');
            let _ = tx.send(line);
        }
    });
    (child, log, rx)
}

impl Mgr {
    fn start(config: &Path) -> Mgr {
        let (child, log, rx) = spawn(config);
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok(line) => {
                    if let Some(pos) = line.find("listening on http://") {
                        let rest = &line[pos + "listening on ".len()..];
                        let url: String = rest.chars().take_while(|c| !c.is_whitespace()).collect();
                        let dir = config.parent().unwrap().to_path_buf();
                        return Mgr {
                            child,
                            url,
                            log,
                            dir,
                        };
                    }
                }
                Err(RecvTimeoutError::Timeout) => {
                    panic!(
                        "flame-mgr did not start in time; log:\n{}",
                        log.lock().unwrap()
                    )
                }
                Err(RecvTimeoutError::Disconnected) => {
                    panic!("flame-mgr exited at start; log:\n{}", log.lock().unwrap())
                }
            }
        }
    }

    /// SIGKILL, the harshest stop: no chance to flush anything.
    fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    /// An endpoint signing as `creds` (unsigned for `None`).
    fn endpoint(&self, creds: Option<Credentials>) -> MgrEndpoint {
        MgrEndpoint {
            agent: agent(),
            base: self.url.clone(),
            creds,
        }
    }

    /// An endpoint signing as `client.admin` (unsigned with `auth: none`).
    fn admin(&self) -> MgrEndpoint {
        let signed = !std::fs::read_to_string(self.dir.join("mgr.yaml"))
            .unwrap()
            .contains("auth: none");
        self.endpoint(signed.then(|| creds_in(&self.dir, "client.admin", 1)))
    }

    fn call(&self, method: &str, path: &str, body: Option<&[u8]>) -> (u16, Value) {
        call_as(&self.admin(), method, path, body)
    }

    fn get(&self, path: &str) -> (u16, Value) {
        self.call("GET", path, None)
    }

    fn post<B: Serialize>(&self, path: &str, body: &B) -> (u16, Value) {
        self.call("POST", path, Some(&serde_json::to_vec(body).unwrap()))
    }

    fn delete(&self, path: &str) -> (u16, Value) {
        self.call("DELETE", path, None)
    }

    fn get_ok<T: DeserializeOwned>(&self, path: &str) -> T {
        ok(self.get(path))
    }

    fn post_ok<B: Serialize, T: DeserializeOwned>(&self, path: &str, body: &B) -> T {
        ok(self.post(path, body))
    }

    fn map(&self) -> ClusterMap {
        self.get_ok("/v1/map")
    }
}

impl Drop for Mgr {
    fn drop(&mut self) {
        // A failing test shows what the manager logged.
        if std::thread::panicking() {
            eprintln!("--- flame-mgr log ---\n{}", self.log.lock().unwrap());
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An agent that returns non-2xx replies as responses, so tests can read the
/// ApiError body.
fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(40)))
        .build()
        .into()
}

/// `METHOD path` through `endpoint`: the status and the JSON body.
fn call_as(endpoint: &MgrEndpoint, method: &str, path: &str, body: Option<&[u8]>) -> (u16, Value) {
    let a = endpoint
        .call(method, path, body, Duration::from_secs(40), 256 << 20)
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let text = String::from_utf8_lossy(&a.body);
    let value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("reply {} is not JSON ({e}): {text:?}", a.status));
    (a.status, value)
}

fn ok<T: DeserializeOwned>((status, v): (u16, Value)) -> T {
    assert_eq!(status, 200, "{v}");
    serde_json::from_value(v).unwrap()
}

/// Asserts a failed call: its status and an ApiError mentioning `needle`.
fn assert_err((status, v): (u16, Value), want: u16, needle: &str) {
    assert_eq!(status, want, "{v}");
    let e: ApiError = serde_json::from_value(v).unwrap();
    assert!(e.error.contains(needle), "{:?} lacks {needle:?}", e.error);
}

fn boot(uuid: &str, port: u16, host: &str) -> OsdBoot {
    OsdBoot {
        fsid: None,
        uuid: uuid.into(),
        id: None,
        addr: format!("127.0.0.1:{port}").parse().unwrap(),
        shards: 2,
        host: host.into(),
        weight: 1.0,
        metrics_addr: None,
        incarnation: 1,
    }
}

fn heartbeat(id: OsdId, uuid: &str) -> OsdHeartbeat {
    OsdHeartbeat {
        id,
        uuid: uuid.into(),
        epoch: Epoch(0),
        used_bytes: 1000,
        capacity_bytes: 1 << 30,
        recovery: None,
        object_bytes: 500,
    }
}

fn create(name: &str, size: u64) -> VolumeCreate {
    VolumeCreate {
        name: name.into(),
        size,
    }
}

#[test]
fn volume_routes_status_and_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let mgr = Mgr::start(&write_config(dir.path(), "pool:\n  pg_count: 64\n"));

    let st: ClusterStatus = mgr.get_ok("/v1/status");
    assert_eq!(st.health, "HEALTH_ERR", "no OSDs yet");
    assert_eq!(st.epoch, Epoch(1));

    let v: VolumeInfo = mgr.post_ok("/v1/volumes", &create("disk-a", 10 << 30));
    assert_eq!((v.name.as_str(), v.size), ("disk-a", 10 << 30));
    let got: VolumeInfo = mgr.get_ok("/v1/volumes/disk-a");
    assert_eq!(got, v);
    let _: VolumeInfo = mgr.post_ok("/v1/volumes", &create("disk-b", 4096));
    let list: Vec<VolumeInfo> = mgr.get_ok("/v1/volumes");
    assert_eq!(
        list.iter().map(|v| v.name.as_str()).collect::<Vec<_>>(),
        ["disk-a", "disk-b"]
    );

    assert_err(
        mgr.post("/v1/volumes", &create("disk-a", 4096)),
        409,
        "exists",
    );
    assert_err(
        mgr.post("/v1/volumes", &create("bad name", 4096)),
        400,
        "volume name",
    );
    assert_err(
        mgr.post("/v1/volumes", &create("x", 1000)),
        400,
        "multiple of 512",
    );
    assert_err(
        mgr.post("/v1/volumes", &create("x", 0)),
        400,
        "multiple of 512",
    );
    assert_err(mgr.get("/v1/volumes/nope"), 404, "nope");

    let grow = VolumeResize {
        size: 20 << 30,
        allow_shrink: false,
    };
    let v2: VolumeInfo = mgr.post_ok("/v1/volumes/disk-a/resize", &grow);
    assert_eq!((v2.id, v2.size), (v.id, 20 << 30));
    let shrink = VolumeResize {
        size: 1 << 30,
        allow_shrink: false,
    };
    assert_err(
        mgr.post("/v1/volumes/disk-a/resize", &shrink),
        400,
        "allow_shrink",
    );
    let shrink = VolumeResize {
        allow_shrink: true,
        ..shrink
    };
    let v3: VolumeInfo = mgr.post_ok("/v1/volumes/disk-a/resize", &shrink);
    assert_eq!(v3.size, 1 << 30);
    assert_err(mgr.post("/v1/volumes/zzz/resize", &shrink), 404, "zzz");
    // The shrink left a pending trim: growing is refused until it is reported done.
    let range = TrimRange {
        from: 1 << 30,
        to: 20 << 30,
    };
    let t: VolumeTrim = mgr.get_ok("/v1/volumes/disk-a/trim");
    assert_eq!((t.volume, t.pending), (v.id, Some(range)));
    assert_err(mgr.post("/v1/volumes/disk-a/resize", &grow), 409, "trim");
    let done = TrimDone {
        volume: v.id,
        range,
    };
    let t: VolumeTrim = mgr.post_ok("/v1/volumes/disk-a/trim", &done);
    assert_eq!(t.pending, None);
    assert_err(mgr.get("/v1/volumes/zzz/trim"), 404, "zzz");

    let e_before = mgr.map().epoch;
    let (status, removed) = mgr.delete("/v1/volumes/disk-b");
    assert_eq!(status, 200);
    assert_eq!(removed["name"], "disk-b");
    assert_eq!(mgr.map().epoch, Epoch(e_before.0 + 1));
    assert_err(mgr.delete("/v1/volumes/disk-b"), 404, "disk-b");
    // A new volume never gets a deleted volume's id.
    let v4: VolumeInfo = mgr.post_ok("/v1/volumes", &create("disk-b", 4096));
    assert!(v4.id.0 > v.id.0 + 1, "{v4:?}");

    // Three OSDs on three hosts: healthy, and PG counts add up.
    let mut ids = Vec::new();
    for (i, u) in ["u0", "u1", "u2"].iter().enumerate() {
        let r: OsdBootReply = mgr.post_ok(
            "/v1/osd/boot",
            &boot(u, 6900 + 10 * i as u16, &format!("h{i}")),
        );
        assert_eq!(r.id, OsdId(i as u32));
        let _: HeartbeatReply = mgr.post_ok("/v1/osd/heartbeat", &heartbeat(r.id, u));
        ids.push(r.id);
    }
    let st: ClusterStatus = mgr.get_ok("/v1/status");
    // The volumes existed before the OSDs joined: the first OSD held the only
    // complete copy of every placement group, and each later one joined as
    // recovering, until a primary reports it recovered (no OSD process runs here
    // to do so). Until then I/O waits, as health says.
    assert_eq!(st.health, "HEALTH_ERR", "{:?}", st.health_detail);
    for needle in ["I/O to them waits", "inactive placement groups"] {
        assert!(
            st.health_detail.iter().any(|d| d.contains(needle)),
            "{:?}",
            st.health_detail
        );
    }
    assert_eq!((st.osds, st.osds_up, st.osds_in, st.volumes), (3, 3, 3, 2));
    // An OSD of another cluster is refused with 409 and leaves no trace.
    let e = mgr.map().epoch;
    let mut foreign = boot("u-foreign", 7900, "h9");
    foreign.fsid = Some("another-cluster".into());
    assert_err(
        mgr.post("/v1/osd/boot", &foreign),
        409,
        "belongs to cluster another-cluster",
    );
    // A second OSD at a live OSD's address too.
    assert_err(
        mgr.post("/v1/osd/boot", &boot("u-squat", 6900, "h9")),
        409,
        "which is up",
    );
    assert_eq!(mgr.map().epoch, e);
    assert_eq!(mgr.get_ok::<Vec<OsdStatus>>("/v1/osds").len(), 3);
    assert_eq!(st.provisioned_bytes, (1 << 30) + 4096);
    assert_eq!(st.used_bytes, 3000);
    let osds: Vec<OsdStatus> = mgr.get_ok("/v1/osds");
    assert_eq!(osds.len(), 3);
    assert!(osds.iter().all(|o| o.pgs == 64), "{osds:?}");
    assert!(osds.iter().all(|o| o.last_heartbeat_ms_ago.is_some()));

    let mut resp = agent().get(mgr.url("/metrics")).call().unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let text = resp.body_mut().read_to_string().unwrap();
    let epoch = mgr.map().epoch;
    for needle in [
        format!("flame_mgr_map_epoch {}", epoch.0),
        "flame_mgr_osds{state=\"up\"} 3".to_string(),
        "flame_mgr_osds{state=\"in\"} 3".to_string(),
        "flame_mgr_osds{state=\"total\"} 3".to_string(),
        "flame_mgr_volumes 2".to_string(),
        format!("flame_mgr_provisioned_bytes {}", (1u64 << 30) + 4096),
        "flame_mgr_used_bytes 3000".to_string(),
        "flame_mgr_api_requests_total{route=\"POST /v1/volumes\",status=\"409\"} 1".to_string(),
        "flame_mgr_api_latency_seconds_bucket{route=\"GET /v1/status\"".to_string(),
    ] {
        assert!(text.contains(&needle), "metrics lack {needle}:\n{text}");
    }
}

#[test]
fn sigkill_after_acknowledged_changes_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "");
    let mgr = Mgr::start(&config);
    let before = mgr.map();
    let v: VolumeInfo = mgr.post_ok("/v1/volumes", &create("demo", 4 << 30));
    mgr.kill9();

    let mgr = Mgr::start(&config);
    let after = mgr.map();
    assert_eq!(after.fsid, before.fsid);
    assert_eq!(after.epoch, Epoch(before.epoch.0 + 1));
    assert_eq!(after.volumes.get("demo"), Some(&v));

    // Now kill while creates are streaming in: every acknowledged one must survive.
    let endpoint = mgr.admin();
    let acked = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (acked, stop, endpoint) = (Arc::clone(&acked), Arc::clone(&stop), endpoint.clone());
        std::thread::spawn(move || {
            for i in 0.. {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let name = format!("v{i}");
                let body = serde_json::to_vec(&create(&name, 1 << 20)).unwrap();
                let answer = endpoint.call(
                    "POST",
                    "/v1/volumes",
                    Some(&body),
                    Duration::from_secs(40),
                    1 << 20,
                );
                match answer {
                    Ok(r) if r.status == 200 => acked.lock().unwrap().push(name),
                    Ok(r) => panic!("create {name}: {}", r.status),
                    Err(_) => break, // the manager died mid-request
                }
            }
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while acked.lock().unwrap().len() < 20 {
        assert!(Instant::now() < deadline, "creates too slow");
        std::thread::sleep(Duration::from_millis(1));
    }
    mgr.kill9();
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let acked = acked.lock().unwrap().clone();

    let mgr = Mgr::start(&config);
    let map = mgr.map();
    for name in &acked {
        assert!(map.volumes.contains_key(name), "acknowledged {name} lost");
    }
    // Every create bumped the epoch exactly once; nothing else happened.
    assert_eq!(map.epoch.0, 1 + map.volumes.len() as u64);
    // Ids stay unique and the next one is fresh.
    let next: VolumeInfo = mgr.post_ok("/v1/volumes", &create("after", 512));
    assert!(map.volumes.values().all(|v| v.id < next.id));
}

#[test]
fn silent_osd_is_marked_down_after_grace() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(
        dir.path(),
        "heartbeat_grace_ms: 1000\nfailure_check_interval_ms: 50\n",
    );
    let mgr = Mgr::start(&config);
    let r: OsdBootReply = mgr.post_ok("/v1/osd/boot", &boot("uuid-1", 6900, "h1"));
    // Booting again with the same settings changes nothing.
    let r2: OsdBootReply = mgr.post_ok("/v1/osd/boot", &boot("uuid-1", 6900, "h1"));
    assert_eq!((r2.id, r2.epoch, &r2.fsid), (r.id, r.epoch, &r.fsid));

    // Heartbeats well inside the grace keep it up with no map change.
    let t = Instant::now();
    while t.elapsed() < Duration::from_millis(2500) {
        let hb: HeartbeatReply = mgr.post_ok("/v1/osd/heartbeat", &heartbeat(r.id, "uuid-1"));
        assert_eq!(hb.epoch, r.epoch);
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(mgr.map().osds[&r.id].up);

    // Unknown id or wrong uuid: 404, so the OSD boots again.
    assert_err(
        mgr.post("/v1/osd/heartbeat", &heartbeat(OsdId(42), "uuid-1")),
        404,
        "boot again",
    );
    assert_err(
        mgr.post("/v1/osd/heartbeat", &heartbeat(r.id, "uuid-x")),
        404,
        "boot again",
    );

    // Silence: a long-poll for the next epoch returns once it is marked down.
    let t = Instant::now();
    let map: ClusterMap = mgr.get_ok(&format!(
        "/v1/map?min_epoch={}&wait_ms=10000",
        r.epoch.0 + 1
    ));
    assert_eq!(map.epoch, Epoch(r.epoch.0 + 1), "long-poll timed out");
    assert!(t.elapsed() < Duration::from_secs(8));
    let osd = &map.osds[&r.id];
    assert!(
        !osd.up && osd.r#in,
        "down but never automatically out: {osd:?}"
    );
    let st: ClusterStatus = mgr.get_ok("/v1/status");
    assert_ne!(st.health, "HEALTH_OK");
    assert!(st.health_detail.contains(&format!("{} is down", r.id)));

    // A heartbeat brings it back up.
    let hb: HeartbeatReply = mgr.post_ok("/v1/osd/heartbeat", &heartbeat(r.id, "uuid-1"));
    assert_eq!(hb.epoch, Epoch(r.epoch.0 + 2));
    assert!(mgr.map().osds[&r.id].up);

    // After a manager restart the OSD gets a fresh grace period, then goes down.
    mgr.kill9();
    let mgr = Mgr::start(&config);
    let map = mgr.map();
    assert!(map.osds[&r.id].up, "marked down right at restart");
    // A long-poll with nothing to wait for returns at once.
    let t = Instant::now();
    let same: ClusterMap = mgr.get_ok(&format!("/v1/map?min_epoch={}&wait_ms=10000", map.epoch.0));
    assert_eq!(same.epoch, map.epoch);
    assert!(t.elapsed() < Duration::from_secs(1));
    let later: ClusterMap = mgr.get_ok(&format!(
        "/v1/map?min_epoch={}&wait_ms=10000",
        map.epoch.0 + 1
    ));
    assert!(!later.osds[&r.id].up);
    // Same uuid, new address: same id back.
    let r3: OsdBootReply = mgr.post_ok("/v1/osd/boot", &boot("uuid-1", 7000, "h1"));
    assert_eq!(r3.id, r.id);
    assert_eq!(mgr.map().osds[&r.id].addr.port(), 7000);
}

#[test]
fn garbage_and_bad_requests_leave_it_serving() {
    let dir = tempfile::tempdir().unwrap();
    let mgr = Mgr::start(&write_config(dir.path(), ""));
    let addr = mgr.url.trim_start_matches("http://").to_string();

    // Random bytes, held open.
    let mut junk = TcpStream::connect(&addr).unwrap();
    let mut x: u64 = 0x1234_5678;
    let bytes: Vec<u8> = (0..8192)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            (x >> 33) as u8
        })
        .collect();
    let _ = junk.write_all(&bytes);
    // A request that stalls half-way through its headers.
    let mut stalled = TcpStream::connect(&addr).unwrap();
    stalled
        .write_all(b"POST /v1/volumes HTTP/1.1\r\nHost: x\r\nContent-Le")
        .unwrap();
    // A body that promises more than it sends.
    let mut short = TcpStream::connect(&addr).unwrap();
    short
        .write_all(b"POST /v1/volumes HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"na")
        .unwrap();
    // An absurd header, then hang up.
    {
        let mut big = TcpStream::connect(&addr).unwrap();
        let _ = big.write_all(b"GET /v1/map HTTP/1.1\r\nX: ");
        let _ = big.write_all(&vec![b'a'; 256 << 10]);
    }

    // Everyone else is still served.
    let st: ClusterStatus = mgr.get_ok("/v1/status");
    assert_eq!(st.epoch, Epoch(1));
    let _: VolumeInfo = mgr.post_ok("/v1/volumes", &create("still-works", 4096));

    // The junk connection got an error or was closed, not a hang.
    junk.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut buf = [0u8; 64];
    match junk.read(&mut buf) {
        Ok(0) | Err(_) => {}
        Ok(n) => assert!(
            String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 4"),
            "{:?}",
            &buf[..n]
        ),
    }

    // Malformed and oversized bodies: ApiError with 400 / 413.
    let raw = |body: &[u8]| mgr.call("POST", "/v1/volumes", Some(body));
    assert_err(raw(b"{\"name\": "), 400, "invalid JSON");
    assert_err(raw(b"{\"name\": \"a\"}"), 400, "size");
    assert_err(raw(b"[1,2,3]"), 400, "invalid JSON");
    assert_err(raw(&vec![b' '; 100 << 10]), 413, "limit");
    assert_err(
        mgr.post("/v1/osd/boot", &serde_json::json!({"uuid": "u"})),
        400,
        "invalid JSON",
    );
    let mut bad_boot = boot("u", 6900, "h");
    bad_boot.shards = 0;
    assert_err(mgr.post("/v1/osd/boot", &bad_boot), 400, "shards");
    assert_err(mgr.get("/v1/nothing"), 404, "no route");
    assert_err(mgr.delete("/v1/status"), 405, "not allowed");
    assert_err(mgr.get("/v1/map?min_epoch=x"), 400, "min_epoch");

    drop((stalled, short));
    let list: Vec<VolumeInfo> = mgr.get_ok("/v1/volumes");
    assert_eq!(list.len(), 1);
}

/// Waits for a process that is expected to exit on its own.
fn wait_exit(child: &mut Child) -> ExitStatus {
    let deadline = Instant::now() + START_TIMEOUT;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        assert!(Instant::now() < deadline, "flame-mgr did not exit");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn assert_fails_to_start(config: &Path, needle: &str) {
    let (mut child, log, _rx) = spawn(config);
    let status = wait_exit(&mut child);
    assert!(!status.success(), "started anyway");
    // Let the reader thread drain the last lines.
    std::thread::sleep(Duration::from_millis(200));
    let log = log.lock().unwrap().clone();
    assert!(log.contains(needle), "log lacks {needle:?}:\n{log}");
}

#[test]
fn refuses_to_start_on_bad_state_or_shared_dir() {
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), "");
    // A second manager on the same data_dir is refused while the first runs.
    let mgr = Mgr::start(&config);
    assert_fails_to_start(&config, "in use by another flame-mgr");
    let fsid = mgr.map().fsid;
    mgr.kill9();
    // A config fsid that does not match the data_dir's cluster.
    let wrong = write_config(dir.path(), "fsid: some-other-cluster\n");
    assert_fails_to_start(&wrong, "does not match");
    // The right one is fine.
    let right = write_config(dir.path(), &format!("fsid: {fsid}\n"));
    drop(Mgr::start(&right));
    // A corrupt state file is an error, never a silent reset.
    let state = dir.path().join("data/state.json");
    let mut text = std::fs::read_to_string(&state).unwrap();
    text.truncate(text.len() / 2);
    std::fs::write(&state, text).unwrap();
    assert_fails_to_start(&config, "corrupt");
    // Bad config values name the key.
    let bad = write_config(dir.path(), "heartbeat_grace_ms: 0\n");
    assert_fails_to_start(&bad, "heartbeat_grace_ms");
}

/// Boots OSDs u0..u{n-1} on hosts h0.. and heartbeats them once; returns the ids.
fn boot_osds(mgr: &Mgr, n: u16) -> Vec<OsdId> {
    (0..n)
        .map(|i| {
            let uuid = format!("u{i}");
            let r: OsdBootReply = mgr.post_ok(
                "/v1/osd/boot",
                &boot(&uuid, 6900 + 10 * i, &format!("h{i}")),
            );
            let _: HeartbeatReply = mgr.post_ok("/v1/osd/heartbeat", &heartbeat(r.id, &uuid));
            r.id
        })
        .collect()
}

/// Operator commands, recovery reports and failure reports over HTTP, as the
/// admin CLI and the OSDs send them.
#[test]
fn osd_commands_recovery_and_failure_reports() {
    let dir = tempfile::tempdir().unwrap();
    let mgr = Mgr::start(&write_config(
        dir.path(),
        "pool:\n  pg_count: 64\nheartbeat_grace_ms: 60000\nfailure_report_min_silence_ms: 300\n",
    ));
    let ids = boot_osds(&mgr, 4);
    let _: VolumeInfo = mgr.post_ok("/v1/volumes", &create("v", 1 << 30));
    assert!(mgr.map().pg_complete.is_empty());

    // osd.3 out: one epoch, its groups keep their complete copies.
    let e = mgr.map().epoch;
    let r: OsdOpReply = mgr.post_ok("/v1/osds/3/out", &());
    assert_eq!((r.osd, r.epoch, r.changed), (ids[3], Epoch(e.0 + 1), true));
    let map = mgr.map();
    assert!(!map.osds[&ids[3]].r#in);
    assert!(!map.pg_complete.is_empty());
    let r: OsdOpReply = mgr.post_ok("/v1/osds/osd.3/out", &());
    assert!(!r.changed && r.epoch == map.epoch, "{r:?}");
    assert_err(mgr.post("/v1/osds/osd.9/out", &()), 404, "osd.9");
    assert_err(mgr.post("/v1/osds/abc/in", &()), 400, "not an OSD id");
    assert_err(
        mgr.post("/v1/osds/1/reweight", &OsdReweight { weight: 101.0 }),
        400,
        "weight",
    );

    // The primary of a moved group reports the new member recovered.
    let (&pg, _) = map.pg_complete.iter().next().unwrap();
    let roles = PgMembers::compute(&map, pg);
    let primary = roles.primary().unwrap();
    let member = roles.recovering[0];
    let report = |reporter: OsdId, entries: Vec<_>| PgRecoveredReport {
        reporter,
        uuid: format!("u{}", reporter.0),
        epoch: map.epoch,
        recovered: entries,
    };
    let mut bad = report(primary, vec![(pg, member)]);
    bad.uuid = "nobody".into();
    assert_err(mgr.post("/v1/pg/recovered", &bad), 404, "boot again");
    // The largest report fits the body limit and is refused only for its count.
    let big = report(primary, vec![(pg, member); PG_RECOVERED_ENTRIES_MAX + 1]);
    assert_err(mgr.post("/v1/pg/recovered", &big), 400, "entries");
    // No route takes a body over 64 KiB, this one included (it took 4 MiB
    // before, from anyone naming an OSD: the signature over the body is
    // checked only once the body is read).
    let huge = report(primary, vec![(pg, member); 16 * PG_RECOVERED_ENTRIES_MAX]);
    assert!(serde_json::to_vec(&huge).unwrap().len() > 64 << 10);
    assert_err(mgr.post("/v1/pg/recovered", &huge), 413, "limit");
    // A member that is not the primary: skipped, not an error.
    let other = roles.acting[1];
    let r: PgRecoveredReply = mgr.post_ok("/v1/pg/recovered", &report(other, vec![(pg, member)]));
    assert_eq!((r.epoch, r.recorded), (map.epoch, 0));
    let r: PgRecoveredReply = mgr.post_ok("/v1/pg/recovered", &report(primary, vec![(pg, member)]));
    assert_eq!((r.epoch, r.recorded), (Epoch(map.epoch.0 + 1), 1));
    let after = mgr.map();
    assert_eq!(after.epoch, r.epoch);
    assert!(PgMembers::compute(&after, pg).recovering.is_empty());

    // Reweight and in.
    let r: OsdOpReply = mgr.post_ok("/v1/osds/osd.1/reweight", &OsdReweight { weight: 2.5 });
    assert!(r.changed);
    assert_eq!(mgr.map().osds[&ids[1]].weight, 2.5);
    let r: OsdOpReply = mgr.post_ok("/v1/osds/3/in", &());
    assert!(r.changed);

    // Failure reports: 4xx for nonsense, down once two distinct OSDs report.
    let fail = |reporter: OsdId, failed: OsdId| OsdFailureReport {
        reporter,
        uuid: format!("u{}", reporter.0),
        failed,
        epoch: mgr.map().epoch,
    };
    assert_err(
        mgr.post("/v1/osd/failure", &fail(ids[0], ids[0])),
        400,
        "itself",
    );
    assert_err(
        mgr.post("/v1/osd/failure", &fail(ids[0], OsdId(77))),
        404,
        "osd.77",
    );
    let mut wrong = fail(ids[0], ids[3]);
    wrong.uuid = "u1".into();
    assert_err(mgr.post("/v1/osd/failure", &wrong), 404, "boot again");
    // rm is refused while the OSD is up.
    assert_err(mgr.delete("/v1/osds/3"), 409, "is up");
    let r: OsdFailureReply = mgr.post_ok("/v1/osd/failure", &fail(ids[0], ids[3]));
    assert!(!r.down);
    // osd.3 last heartbeated before the commands above (well over 300 ms ago).
    std::thread::sleep(Duration::from_millis(400));
    let r: OsdFailureReply = mgr.post_ok("/v1/osd/failure", &fail(ids[1], ids[3]));
    assert!(r.down);
    assert!(!mgr.map().osds[&ids[3]].up);

    // Now it can be removed: gone from the map and every complete set.
    let r: OsdOpReply = ok(mgr.delete("/v1/osds/osd.3"));
    assert!(r.changed && r.lost_pgs.is_empty(), "{r:?}");
    let map = mgr.map();
    assert!(!map.osds.contains_key(&ids[3]));
    assert!(map.pg_complete.values().all(|c| !c.contains(&ids[3])));
    assert_err(mgr.delete("/v1/osds/3"), 404, "osd.3");
    // Its old uuid registers as a new OSD.
    let r: OsdBootReply = mgr.post_ok("/v1/osd/boot", &boot("u3", 6930, "h3"));
    assert_eq!(r.id, OsdId(4));

    // A removed volume leaves a tombstone in the map.
    let v: VolumeInfo = mgr.get_ok("/v1/volumes/v");
    let _ = mgr.delete("/v1/volumes/v");
    assert!(mgr.map().deleted_volumes.contains(&v.id));

    // A boot from a new process of an up OSD: a new incarnation.
    let before = mgr.map().osds[&ids[0]].up_from;
    let mut again = boot("u0", 6900, "h0");
    again.incarnation = 99;
    let r: OsdBootReply = mgr.post_ok("/v1/osd/boot", &again);
    assert_eq!(mgr.map().osds[&ids[0]].up_from, r.epoch);
    assert!(r.epoch > before);
    let r2: OsdBootReply = mgr.post_ok("/v1/osd/boot", &again);
    assert_eq!(r2.epoch, r.epoch, "a retried boot changes nothing");
}

/// `down_out_interval_ms`: an OSD down that long is marked out by itself, and its
/// placement groups keep track of their complete copies.
#[test]
fn down_osd_goes_out_after_the_interval() {
    let dir = tempfile::tempdir().unwrap();
    let mgr = Mgr::start(&write_config(
        dir.path(),
        "pool:\n  pg_count: 64\nheartbeat_grace_ms: 600\nfailure_check_interval_ms: 50\n\
         down_out_interval_ms: 1500\n",
    ));
    let ids = boot_osds(&mgr, 4);
    let _: VolumeInfo = mgr.post_ok("/v1/volumes", &create("v", 1 << 30));
    let start = Instant::now();
    let mut down_at = None;
    let out_at = loop {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "never marked out"
        );
        for (i, id) in ids.iter().take(3).enumerate() {
            let _: HeartbeatReply =
                mgr.post_ok("/v1/osd/heartbeat", &heartbeat(*id, &format!("u{i}")));
        }
        let map = mgr.map();
        let osd = &map.osds[&ids[3]];
        if !osd.up && down_at.is_none() {
            assert!(osd.r#in, "out before the interval");
            down_at = Some(Instant::now());
        }
        if !osd.r#in {
            break Instant::now();
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let down_at = down_at.expect("out without being seen down first");
    let waited = out_at - down_at;
    assert!(
        waited >= Duration::from_millis(1200) && waited < Duration::from_secs(6),
        "{waited:?}"
    );
    let map = mgr.map();
    assert!(!map.pg_complete.is_empty(), "out forgot where the data is");
    for (pg, complete) in &map.pg_complete {
        assert!(!complete.contains(&ids[3]), "{pg}: {complete:?}");
    }
}

/// `GET /v1/pgs` and `/v1/pgs/{id}` give each group's state and roles; heartbeats
/// carrying recovery figures show up in the status as totals, a rate and an ETA,
/// and in the metrics.
#[test]
fn pgs_routes_and_recovery_progress() {
    use flame_common::mgr_api::{PgStatus, RecoveryProgress};
    let dir = tempfile::tempdir().unwrap();
    let mgr = Mgr::start(&write_config(dir.path(), "pool:\n  pg_count: 32\n"));
    let uuids = ["r0", "r1", "r2"];
    for (i, u) in uuids.iter().enumerate() {
        let r: OsdBootReply = mgr.post_ok(
            "/v1/osd/boot",
            &boot(u, 6900 + 10 * i as u16, &format!("h{i}")),
        );
        assert_eq!(r.id, OsdId(i as u32));
    }
    let pgs: Vec<PgStatus> = mgr.get_ok("/v1/pgs");
    assert_eq!(pgs.len(), 32);
    for (i, p) in pgs.iter().enumerate() {
        assert_eq!(p.pg.0 as usize, i);
        assert_eq!(p.state, "active+clean", "{p:?}");
        assert_eq!(p.acting.len(), 3);
        assert_eq!(p.primary, Some(p.acting[0]));
    }
    let one: PgStatus = mgr.get_ok("/v1/pgs/7");
    assert_eq!(one, pgs[7]);
    let same: PgStatus = mgr.get_ok("/v1/pgs/pg.7");
    assert_eq!(same, pgs[7]);
    assert_err(mgr.get("/v1/pgs/32"), 404, "the pool has 32");
    assert_err(
        mgr.get("/v1/pgs/seven"),
        400,
        "not a placement group number",
    );

    // osd.0 recovers 10 objects (40 MiB) per heartbeat, ~4 heartbeats a few
    // hundred ms apart; the others report nothing to do.
    let beat = |id: u32, left: u64, done: u64| {
        let mut hb = heartbeat(OsdId(id), uuids[id as usize]);
        hb.recovery = Some(RecoveryProgress {
            objects_to_recover: left,
            objects_recovered_total: done,
            bytes_recovered_total: done * (4 << 20),
            scrub_errors_total: u64::from(id),
            ..Default::default()
        });
        let _: HeartbeatReply = mgr.post_ok("/v1/osd/heartbeat", &hb);
    };
    let started = Instant::now();
    for step in 0..5u64 {
        beat(0, 100 - 10 * step, 10 * step);
        beat(1, 0, 0);
        beat(2, 0, 0);
        std::thread::sleep(Duration::from_millis(400));
    }
    let elapsed = started.elapsed().as_secs_f64();
    let st: ClusterStatus = mgr.get_ok("/v1/status");
    let r = &st.recovery;
    assert_eq!(r.osds_reporting, 3);
    assert_eq!(r.objects_to_recover, 60);
    assert_eq!(r.objects_recovered, 40);
    assert_eq!(r.bytes_recovered, 40 * (4 << 20));
    assert_eq!(r.scrub_errors, 3);
    // 40 objects in a bit less than `elapsed` seconds (the last sleep is after
    // the last heartbeat).
    assert!(
        r.objects_per_second > 40.0 / elapsed && r.objects_per_second < 40.0 / 1.0,
        "{r:?} over {elapsed} s"
    );
    assert!(
        (r.bytes_per_second - r.objects_per_second * f64::from(4u32 << 20)).abs() < 1.0,
        "{r:?}"
    );
    let eta = r
        .eta_seconds
        .expect("an ETA while objects are left and moving");
    assert_eq!(eta, (60.0 / r.objects_per_second).ceil() as u64);
    assert_eq!(st.pgs_by_state.get("active+clean"), Some(&32));
    assert_eq!(st.pg_summary.total, 32);

    let mut resp = agent().get(mgr.url("/metrics")).call().unwrap();
    let text = resp.body_mut().read_to_string().unwrap();
    for needle in [
        "flame_mgr_objects_to_recover 60",
        "flame_mgr_pgs{state=\"active+clean\"} 32",
        "flame_mgr_pgs_degraded 0",
        "flame_mgr_osds{state=\"down\"} 0",
        "flame_mgr_osds{state=\"out\"} 0",
        "flame_mgr_scrub_errors 3",
    ] {
        assert!(text.contains(needle), "metrics lack {needle}:\n{text}");
    }
    let rate = text
        .lines()
        .find_map(|l| l.strip_prefix("flame_mgr_recovery_bytes_per_second "))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("{text}"));
    assert!(rate > 0.0, "{text}");
    // Every manager metric the Grafana dashboard queries exists.
    let dashboard = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/grafana/flame-dashboard.json"),
    )
    .unwrap();
    let mut rest = dashboard.as_str();
    let mut checked = 0;
    while let Some(at) = rest.find("flame_mgr_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        // Histograms are queried by their _bucket series.
        let base = name.strip_suffix("_bucket").unwrap_or(&name);
        assert!(
            text.contains(&format!("# TYPE {base} ")),
            "the dashboard queries {name}, which the manager does not export"
        );
        checked += 1;
        rest = &rest[at + name.len()..];
    }
    assert!(checked > 10, "{checked}");
}

/// Every route that changes something, with a body that would succeed.
fn mutations() -> Vec<(&'static str, String, Vec<u8>)> {
    let j = |v: Value| serde_json::to_vec(&v).unwrap();
    vec![
        (
            "POST",
            "/v1/volumes".into(),
            j(serde_json::json!({"name": "new", "size": 4096})),
        ),
        ("DELETE", "/v1/volumes/kept".into(), vec![]),
        (
            "POST",
            "/v1/volumes/kept/resize".into(),
            j(serde_json::json!({"size": 8192})),
        ),
        ("POST", "/v1/osds/0/out".into(), j(Value::Null)),
        (
            "POST",
            "/v1/osds/0/reweight".into(),
            j(serde_json::json!({"weight": 99.0})),
        ),
        ("DELETE", "/v1/osds/0".into(), vec![]),
        (
            "POST",
            "/v1/osd/boot".into(),
            serde_json::to_vec(&OsdBoot {
                weight: 100.0,
                ..boot("made-up", 7100, "evil")
            })
            .unwrap(),
        ),
        (
            "POST",
            "/v1/auth/entities".into(),
            j(serde_json::json!({"entity": "client.evil", "role": "admin"})),
        ),
        (
            "POST",
            "/v1/auth/entities/client.admin/rotate".into(),
            j(Value::Null),
        ),
        // The rest of the routes that change something: the checks run before
        // any body is read as JSON, so the body does not matter.
        ("POST", "/v1/osds/0/in".into(), j(Value::Null)),
        ("POST", "/v1/volumes/kept/trim".into(), j(Value::Null)),
        (
            "POST",
            "/v1/auth/entities/client.vm/volumes".into(),
            j(serde_json::json!({"volumes": "*"})),
        ),
        ("DELETE", "/v1/auth/entities/client.vm".into(), vec![]),
        ("POST", "/v1/osd/heartbeat".into(), j(Value::Null)),
        ("POST", "/v1/osd/failure".into(), j(Value::Null)),
        ("POST", "/v1/pg/recovered".into(), j(Value::Null)),
        ("POST", "/v1/auth/service-key".into(), j(Value::Null)),
    ]
}

/// Nobody without a key changes anything: unsigned, wrongly signed, replayed,
/// rotated-away and role-client requests are refused with a clear error naming
/// the entity, counted, and leave the epoch where it was; `client` reads; the
/// OSD key boots and heartbeats but cannot delete; answers are signed.
#[test]
fn authentication_and_roles_refuse_everything_without_a_key() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mgr = Mgr::start(&write_config(d, "pool:\n  pg_count: 16\n"));
    let _: VolumeInfo = mgr.post_ok("/v1/volumes", &create("kept", 4096));
    let (_, added) = mgr.post(
        "/v1/auth/entities",
        &serde_json::json!({"entity": "client.vm", "role": "client"}),
    );
    assert_eq!(added["generation"], 1, "{added}");
    let epoch = mgr.map().epoch;

    let unsigned = mgr.endpoint(None);
    let client = mgr.endpoint(Some(creds_in(d, "client.vm", 1)));
    let stranger = mgr.endpoint(Some(creds_in(d, "client.stranger", 1)));
    let other_cluster = mgr.endpoint(Some({
        let e = EntityName::admin();
        Credentials {
            key: SecretKey::random().unwrap().derive_entity_key(&e, 1),
            entity: e,
            generation: 1,
        }
    }));
    for (method, path, body) in mutations() {
        for (who, endpoint, status, needle) in [
            ("unsigned", &unsigned, 401, "authentication required"),
            ("stranger", &stranger, 401, "client.stranger is not known"),
            (
                "another cluster's key",
                &other_cluster,
                401,
                "wrong signature",
            ),
            (
                "client role",
                &client,
                403,
                "client.vm (role client) may not",
            ),
        ] {
            let (got, v) = call_as(endpoint, method, &path, Some(&body));
            assert_eq!(got, status, "{who}: {method} {path}: {v}");
            assert!(v["error"].as_str().unwrap().contains(needle), "{who}: {v}");
        }
    }
    // Reads: any entity; unsigned is refused too (the map names every volume).
    assert_eq!(call_as(&client, "GET", "/v1/map", None).0, 200);
    assert_eq!(call_as(&unsigned, "GET", "/v1/map", None).0, 401);
    assert_eq!(call_as(&unsigned, "GET", "/v1/nothing", None).0, 401);
    assert_eq!(call_as(&client, "GET", "/v1/auth/entities", None).0, 403);
    assert_eq!(mgr.map().epoch, epoch, "a refused request changed the map");
    assert!(mgr.map().volumes.contains_key("kept"));

    // The OSD key may boot and heartbeat, not act as the admin.
    let osd = mgr.endpoint(Some(creds_in(d, "osd", 1)));
    let body = serde_json::to_vec(&boot("u-1", 7000, "h1")).unwrap();
    let (st, r) = call_as(&osd, "POST", "/v1/osd/boot", Some(&body));
    assert_eq!(st, 200, "{r}");
    let (st, _) = call_as(&osd, "DELETE", "/v1/volumes/kept", None);
    assert_eq!(st, 403);

    // A captured request replayed verbatim is refused.
    let c = creds_in(d, "client.admin", 1);
    let body = serde_json::to_vec(&create("once", 4096)).unwrap();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let header = c
        .sign(
            "POST",
            "/v1/volumes",
            &body,
            now_ms,
            flame_common::auth::Nonce([9; 16]),
        )
        .to_header();
    let send = || {
        let mut r = agent()
            .post(mgr.url("/v1/volumes"))
            .header("authorization", &header)
            .send(&body[..])
            .unwrap();
        let status = r.status().as_u16();
        let signed = r
            .headers()
            .contains_key(flame_common::auth::SIGNATURE_HEADER);
        (status, signed, r.body_mut().read_to_string().unwrap())
    };
    let (st, signed, _) = send();
    assert_eq!(
        (st, signed),
        (200, true),
        "the answer carries the manager's signature"
    );
    let (st, _, text) = send();
    assert_eq!(st, 401, "{text}");
    assert!(text.contains("replayed"), "{text}");
    // A request from a clock two minutes off is refused, naming the clock.
    let old = c
        .sign(
            "GET",
            "/v1/map",
            b"",
            now_ms - 120_000,
            flame_common::auth::Nonce([1; 16]),
        )
        .to_header();
    let mut r = agent()
        .get(mgr.url("/v1/map"))
        .header("authorization", &old)
        .call()
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert!(r.body_mut().read_to_string().unwrap().contains("clock"));

    // Rotation: the old key stops at once, by name; the next generation works.
    let (st, v) = mgr.post("/v1/auth/entities/client.vm/rotate", &());
    assert_eq!((st, v["generation"].as_u64()), (200, Some(2)), "{v}");
    let (st, v) = call_as(&client, "GET", "/v1/map", None);
    assert_eq!(st, 401);
    assert!(
        v["error"]
            .as_str()
            .unwrap()
            .contains("generation 1 was rotated"),
        "{v}"
    );
    let rotated = mgr.endpoint(Some(creds_in(d, "client.vm", 2)));
    assert_eq!(call_as(&rotated, "GET", "/v1/map", None).0, 200);
    // Built-ins stay; a removed entity is refused.
    assert_err(
        mgr.delete("/v1/auth/entities/client.admin"),
        400,
        "built in",
    );
    let (st, _) = mgr.delete("/v1/auth/entities/client.vm");
    assert_eq!(st, 200);
    assert_eq!(call_as(&rotated, "GET", "/v1/map", None).0, 401);

    // Every refusal was counted, by reason.
    let mut resp = agent().get(mgr.url("/metrics")).call().unwrap();
    let text = resp.body_mut().read_to_string().unwrap();
    for reason in [
        "missing",
        "unknown_entity",
        "bad_signature",
        "forbidden",
        "replayed",
        "clock",
        "rotated_key",
    ] {
        assert!(
            text.contains(&format!(
                "flame_mgr_auth_refusals_total{{reason=\"{reason}\"}}"
            )),
            "no {reason} refusals counted:\n{text}"
        );
    }

    // The entity table survives a restart (it is in state.json).
    let config = d.join("mgr.yaml");
    mgr.kill9();
    let mgr = Mgr::start(&config);
    let list = mgr.get("/v1/auth/entities").1;
    assert_eq!(list.as_array().unwrap().len(), 2, "{list}");
    let removed = mgr.endpoint(Some(creds_in(d, "client.vm", 2)));
    assert_eq!(call_as(&removed, "GET", "/v1/map", None).0, 401);
    // Added again under the same name, it starts above its removed key (a
    // removed, perhaps stolen, key never works again), also after the restart.
    let (st, v) = mgr.post(
        "/v1/auth/entities",
        &serde_json::json!({"entity": "client.vm", "role": "client"}),
    );
    assert_eq!((st, v["generation"].as_u64()), (200, Some(3)), "{v}");
    assert_eq!(call_as(&removed, "GET", "/v1/map", None).0, 401);
    let again = mgr.endpoint(Some(creds_in(d, "client.vm", 3)));
    assert_eq!(call_as(&again, "GET", "/v1/map", None).0, 200);
}

/// The made-up-OSD attack by the holder of one OSD's own key (`osd.1`): it may
/// boot, heartbeat and report only as OSD 1. New uuids (with a huge weight),
/// another OSD's data directory or address, heartbeats, failure reports and
/// recovered copies for OSD 0 are refused (403 naming the entity, or 409),
/// counted, and the map stays as it was. The service key is sealed for the
/// asking OSD alone; no admin or client gets it.
#[test]
fn an_osds_own_key_acts_only_as_that_osd() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let mgr = Mgr::start(&write_config(d, "pool:\n  pg_count: 16\n"));
    for n in ["osd.0", "osd.1"] {
        let (st, v) = mgr.post(
            "/v1/auth/entities",
            &serde_json::json!({"entity": n, "role": "osd"}),
        );
        assert_eq!(st, 200, "{v}");
    }
    let osd0 = mgr.endpoint(Some(creds_in(d, "osd.0", 1)));
    let osd1 = mgr.endpoint(Some(creds_in(d, "osd.1", 1)));
    fn j<T: Serialize>(v: &T) -> Vec<u8> {
        serde_json::to_vec(v).unwrap()
    }
    // Each boots as its own id, whatever the order.
    let r: OsdBootReply = ok(call_as(
        &osd1,
        "POST",
        "/v1/osd/boot",
        Some(&j(&boot("u-1", 7010, "h1"))),
    ));
    assert_eq!(r.id, OsdId(1));
    let r: OsdBootReply = ok(call_as(
        &osd0,
        "POST",
        "/v1/osd/boot",
        Some(&j(&boot("u-0", 7000, "h0"))),
    ));
    assert_eq!(r.id, OsdId(0));
    let epoch = mgr.map().epoch;

    // osd.1's key poses as new OSDs with a huge weight, as osd.0's data
    // directory, at osd.0's address, and asks for osd.0's id.
    let mut refusals = vec![];
    for (i, port) in [7100u16, 7110, 7120].into_iter().enumerate() {
        let b = OsdBoot {
            weight: 100.0,
            ..boot(&format!("made-up-{i}"), port, "evil")
        };
        refusals.push(("a new uuid", j(&b), 409, "registered with uuid u-1"));
    }
    refusals.push((
        "osd.0's data directory",
        j(&boot("u-0", 7200, "evil")),
        409,
        "registered as osd.0",
    ));
    refusals.push((
        "osd.0's address",
        j(&boot("u-1", 7001, "h1")),
        409,
        "overlaps osd.0",
    ));
    let asks_0 = OsdBoot {
        id: Some(OsdId(0)),
        ..boot("made-up-3", 7300, "evil")
    };
    refusals.push(("osd.0's id", j(&asks_0), 403, "not as osd.0"));
    for (what, body, status, needle) in refusals {
        let (got, v) = call_as(&osd1, "POST", "/v1/osd/boot", Some(&body));
        assert_eq!(got, status, "{what}: {v}");
        assert!(v["error"].as_str().unwrap().contains(needle), "{what}: {v}");
    }
    let as_osd0: [(&str, Vec<u8>); 3] = [
        ("/v1/osd/heartbeat", j(&heartbeat(OsdId(0), "u-0"))),
        (
            "/v1/osd/failure",
            j(&OsdFailureReport {
                reporter: OsdId(0),
                uuid: "u-0".into(),
                failed: OsdId(1),
                epoch,
            }),
        ),
        (
            "/v1/pg/recovered",
            j(&PgRecoveredReport {
                reporter: OsdId(0),
                uuid: "u-0".into(),
                epoch,
                recovered: vec![(flame_common::ids::PgId(0), OsdId(1))],
            }),
        ),
    ];
    for (path, body) in &as_osd0 {
        let (got, v) = call_as(&osd1, "POST", path, Some(body));
        assert_eq!(got, 403, "{path}: {v}");
        let e = v["error"].as_str().unwrap();
        assert!(
            e.contains("osd.1 may act only as its own OSD, not as osd.0"),
            "{path}: {e}"
        );
    }
    assert_eq!(mgr.map().epoch, epoch, "a refused request changed the map");
    assert_eq!(mgr.map().osds.len(), 2);
    // Its own heartbeat is fine.
    let _: HeartbeatReply = ok(call_as(
        &osd1,
        "POST",
        "/v1/osd/heartbeat",
        Some(&j(&heartbeat(OsdId(1), "u-1"))),
    ));

    // Status warns about OSDs on the shared `osd` key, and only about them.
    let detail = |mgr: &Mgr| {
        mgr.get_ok::<ClusterStatus>("/v1/status")
            .health_detail
            .join("\n")
    };
    assert!(
        !detail(&mgr).contains("shared `osd` key"),
        "{}",
        detail(&mgr)
    );
    let legacy = mgr.endpoint(Some(creds_in(d, "osd", 1)));
    let r: OsdBootReply = ok(call_as(
        &legacy,
        "POST",
        "/v1/osd/boot",
        Some(&j(&boot("u-2", 7020, "h2"))),
    ));
    let _: HeartbeatReply = ok(call_as(
        &legacy,
        "POST",
        "/v1/osd/heartbeat",
        Some(&j(&heartbeat(r.id, "u-2"))),
    ));
    let text = detail(&mgr);
    assert!(
        text.contains(&format!("{} sign with the shared `osd` key", r.id)),
        "{text}"
    );

    // The service key: sealed for the asking OSD, the key tickets are made with.
    let g: flame_common::mgr_api::ServiceKeyGrant =
        ok(call_as(&osd1, "POST", "/v1/auth/service-key", None));
    let sealed = hex::decode(&g.sealed_key).unwrap();
    let service = flame_common::auth::ServiceKey::open_sealed(
        &creds_in(d, "osd.1", 1).key,
        g.generation,
        &sealed,
    )
    .unwrap();
    assert!(
        flame_common::auth::ServiceKey::open_sealed(
            &creds_in(d, "osd.0", 1).key,
            g.generation,
            &sealed
        )
        .is_err()
    );
    let t: flame_common::mgr_api::TicketGrant = ok(mgr.call("POST", "/v1/auth/ticket", None));
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let (claims, _) = service
        .open(&hex::decode(&t.ticket).unwrap(), now_ms)
        .unwrap();
    assert_eq!(claims.entity, EntityName::admin());
    assert_err(
        mgr.call("POST", "/v1/auth/service-key", None),
        403,
        "osd role",
    );

    let mut resp = agent().get(mgr.url("/metrics")).call().unwrap();
    let text = resp.body_mut().read_to_string().unwrap();
    assert!(
        text.contains("flame_mgr_auth_refusals_total{reason=\"other_osd\"} 4"),
        "{text}"
    );
}

/// `auth: required` without a keyring, a world-readable keyring and an entity's
/// keyring in place of the cluster's refuse to start (status 2, one line naming
/// the fix); `auth: none` starts and says so in its health.
#[test]
fn keyring_problems_refuse_start_and_auth_none_warns() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let path = d.join("mgr.yaml");
    let data = d.join("data");
    let write = |extra: &str| {
        std::fs::write(
            &path,
            format!("listen: 127.0.0.1:0\ndata_dir: {}\n{extra}", data.display()),
        )
        .unwrap();
    };
    let fails = |needle: &str| {
        let (mut child, log, _rx) = spawn(&path);
        let status = wait_exit(&mut child);
        assert_eq!(status.code(), Some(2), "{needle}");
        std::thread::sleep(Duration::from_millis(200));
        let log = log.lock().unwrap().clone();
        assert!(log.contains(needle), "log lacks {needle:?}:\n{log}");
    };
    write("");
    fails("flame-admin auth init");
    cluster_secret(d);
    let keyring = d.join("keys/cluster.keyring");
    std::fs::set_permissions(&keyring, std::fs::Permissions::from_mode(0o644)).unwrap();
    write(&format!("keyring: {}\n", keyring.display()));
    fails("chmod 600");
    std::fs::set_permissions(&keyring, std::fs::Permissions::from_mode(0o600)).unwrap();
    let admin = d.join("keys/admin.keyring");
    Keyring {
        entity: KeyringEntity::Entity(EntityName::admin(), 1),
        key: SecretKey::random().unwrap(),
    }
    .save(&admin)
    .unwrap();
    write(&format!("keyring: {}\n", admin.display()));
    fails("not the cluster secret");
    assert!(
        !data.join("state.json").exists(),
        "a refused start created a cluster"
    );

    write("auth: none\n");
    let mgr = Mgr::start(&path);
    let st: ClusterStatus = mgr.get_ok("/v1/status");
    assert_ne!(st.health, "HEALTH_OK");
    assert!(
        st.health_detail.iter().any(|l| l.contains("auth: none")),
        "{st:?}"
    );
    // A client holding a key does not believe an unsigned answer: a manager
    // without the cluster secret (or anyone in between) cannot feed it a map.
    let signed = mgr.endpoint(Some(creds_in(d, "client.admin", 1)));
    let e = signed
        .call("GET", "/v1/map", None, Duration::from_secs(10), 1 << 20)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not signed"), "{e}");
}
