//! A scripted cluster for client tests (crucible style): a fake manager (tiny_http,
//! the routes of `flame_common::mgr_api` over a map held in memory) and fake OSDs
//! (each a reactor thread listening on consecutive loopback ports, one per shard,
//! speaking `flame_common::protocol` over `flame_common::transport`).
//!
//! The fake OSD checks what the real one checks — the Hello names the shard it
//! reached, the request's epoch is the map's, the OSD is the PG's primary, the PG
//! belongs to the shard — and answers ESTALE otherwise, counting the misroutes so a
//! test can assert none happened. Faults are injected through counters: reply
//! ESTALE/EAGAIN to the next N requests, drop the connection on the next N, never
//! answer, delay replies for odd object indexes (replies out of order).

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]
#![allow(dead_code)]

use flame_common::ids::{Epoch, OsdId, VolumeId};
use flame_common::map::{ClusterMap, OsdInfo, PoolConfig, VolumeInfo};
use flame_common::mgr_api::{
    ApiError, ClusterStatus, OsdStatus, TrimDone, TrimRange, VolumeCreate, VolumeResize, VolumeTrim,
};
use flame_common::placement;
use flame_common::protocol::{IoTarget, Message, OpCode, status};
use flame_common::reactor::{self, Reactor, ReactorConfig};
use flame_common::transport::{Conn, Listener, TransportKind};
use std::collections::HashMap;
use std::io::Read;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Shared, mutable map: the manager serves it, the fake OSDs check against it.
pub type SharedMap = Arc<Mutex<ClusterMap>>;

/// Fault injection and counters of one fake OSD.
#[derive(Default)]
pub struct OsdState {
    /// Reply ESTALE to the next N I/O requests.
    pub estale_next: AtomicU32,
    /// Reply EAGAIN to the next N I/O requests.
    pub eagain_next: AtomicU32,
    /// Reply EIO to the next N I/O requests.
    pub eio_next: AtomicU32,
    /// Close the connection (without replying) on the next N I/O requests.
    pub drop_next: AtomicU32,
    /// Never reply to I/O requests.
    pub hang: AtomicBool,
    /// Delay replies to requests on odd object indexes by this many ms.
    pub delay_odd_ms: AtomicU64,
    /// Hellos answered OK (connections opened).
    pub hellos: AtomicU32,
    /// I/O requests received (read/write/zero/discard), faults included.
    pub io_requests: AtomicU32,
    /// Requests answered ESTALE because the client routed them wrongly (not the
    /// primary, wrong shard, wrong PG). Injected ESTALEs are not counted.
    pub misrouted: AtomicU32,
    /// Requests answered ESTALE because the epoch differed from the map's.
    pub epoch_mismatch: AtomicU32,
    /// Replies sent out of request order on one connection.
    pub reordered: AtomicU32,
    /// Flushes per shard.
    pub flushes: Mutex<HashMap<u16, u32>>,
    /// DeleteVolume requests per shard.
    pub deletes: Mutex<HashMap<u16, u32>>,
    /// Object data by (volume, index), each `object_size` bytes.
    pub objects: Mutex<HashMap<(u64, u64), Vec<u8>>>,
}

/// One fake OSD.
pub struct FakeOsd {
    pub id: OsdId,
    pub addr: SocketAddr,
    pub shards: u16,
    pub state: Arc<OsdState>,
}

/// A fake manager plus fake OSDs.
pub struct FakeCluster {
    pub mgr_addr: SocketAddr,
    pub map: SharedMap,
    pub osds: Vec<FakeOsd>,
    pub map_gets: Arc<AtomicU32>,
}

/// The pool of the fake clusters: small objects so tests cross boundaries cheaply.
pub fn small_pool(size: u32) -> PoolConfig {
    PoolConfig {
        size,
        min_size: 1,
        pg_count: 32,
        object_size: 64 << 10,
    }
}

impl FakeCluster {
    /// Starts `n_osds` OSDs with `shards` shards each (distinct hosts) and a manager
    /// serving a map with them and one volume `vol` of `vol_size` bytes.
    pub fn start(n_osds: u32, shards: u16, pool: PoolConfig, vol_size: u64) -> FakeCluster {
        let mut map = ClusterMap::new("fake-fsid".into(), pool);
        map.volumes.insert(
            "vol".into(),
            VolumeInfo {
                id: VolumeId(7),
                name: "vol".into(),
                size: vol_size,
                created_unix: 1_700_000_000,
            },
        );
        let map: SharedMap = Arc::new(Mutex::new(map));
        let mut osds = Vec::new();
        for i in 0..n_osds {
            let state = Arc::new(OsdState::default());
            let addr = start_osd(OsdId(i), shards, map.clone(), state.clone());
            map.lock().unwrap().osds.insert(
                OsdId(i),
                OsdInfo {
                    id: OsdId(i),
                    addr,
                    shards,
                    host: format!("host{i}"),
                    weight: 1.0,
                    up: true,
                    up_from: Epoch(1),
                    r#in: true,
                    metrics_addr: None,
                },
            );
            osds.push(FakeOsd {
                id: OsdId(i),
                addr,
                shards,
                state,
            });
        }
        let map_gets = Arc::new(AtomicU32::new(0));
        let mgr_addr = start_mgr(map.clone(), map_gets.clone());
        FakeCluster {
            mgr_addr,
            map,
            osds,
            map_gets,
        }
    }

    /// Changes the map and bumps its epoch (as the manager does on every change).
    pub fn update_map(&self, f: impl FnOnce(&mut ClusterMap)) {
        let mut m = self.map.lock().unwrap();
        f(&mut m);
        m.epoch = Epoch(m.epoch.0 + 1);
    }

    /// The fake OSD by id.
    pub fn osd(&self, id: OsdId) -> &FakeOsd {
        &self.osds[id.0 as usize]
    }

    /// The primary OSD of object `index` of volume 7 in the current map.
    pub fn primary_of(&self, index: u64) -> OsdId {
        let m = self.map.lock().unwrap();
        placement::locate(
            &m,
            flame_common::ids::ObjectId {
                volume: VolumeId(7),
                index,
            },
        )
        .osds[0]
    }

    /// Sum of a counter over all OSDs.
    pub fn total(&self, f: impl Fn(&OsdState) -> u32) -> u32 {
        self.osds.iter().map(|o| f(&o.state)).sum()
    }
}

// ---------------------------------------------------------------- manager

fn start_mgr(map: SharedMap, map_gets: Arc<AtomicU32>) -> SocketAddr {
    let server = tiny_http::Server::http("127.0.0.1:0").unwrap();
    let addr = server.server_addr().to_ip().unwrap();
    std::thread::spawn(move || {
        for req in server.incoming_requests() {
            let map = map.clone();
            let gets = map_gets.clone();
            // A thread per request: long polls must not hold up other calls.
            std::thread::spawn(move || serve(req, &map, &gets));
        }
    });
    addr
}

fn query_param(url: &str, key: &str) -> Option<u64> {
    let q = url.split_once('?')?.1;
    q.split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .and_then(|(_, v)| v.parse().ok())
}

/// Pending trims of every fake manager in this test process, keyed by the fake's map
/// (its address) and volume id, as the real manager keeps them beside its map.
fn pending_trims()
-> std::sync::MutexGuard<'static, std::collections::BTreeMap<(usize, VolumeId), TrimRange>> {
    static TRIMS: Mutex<std::collections::BTreeMap<(usize, VolumeId), TrimRange>> =
        Mutex::new(std::collections::BTreeMap::new());
    TRIMS.lock().unwrap_or_else(|e| e.into_inner())
}

fn map_key(map: &SharedMap) -> usize {
    Arc::as_ptr(map) as usize
}

fn serve(mut req: tiny_http::Request, map: &SharedMap, gets: &AtomicU32) {
    let url = req.url().to_string();
    let path = url.split('?').next().unwrap_or("").to_string();
    let method = req.method().clone();
    let mut body = String::new();
    let _ = req.as_reader().take(1 << 20).read_to_string(&mut body);
    let ok = |v: serde_json::Value| (200, v);
    let err = |code: u16, msg: &str| {
        (
            code,
            serde_json::to_value(ApiError {
                error: msg.to_string(),
            })
            .unwrap(),
        )
    };
    let (code, value) = match (method.as_str(), path.as_str()) {
        ("GET", "/v1/map") => {
            gets.fetch_add(1, Ordering::Relaxed);
            // Long poll, shortened: wait up to 200 ms for the wanted epoch.
            if let Some(min) = query_param(&url, "min_epoch") {
                let wait = query_param(&url, "wait_ms").unwrap_or(0).min(200);
                let until = std::time::Instant::now() + Duration::from_millis(wait);
                while map.lock().unwrap().epoch.0 < min && std::time::Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            ok(serde_json::to_value(&*map.lock().unwrap()).unwrap())
        }
        ("GET", "/v1/status") => {
            let m = map.lock().unwrap();
            let s = ClusterStatus {
                fsid: m.fsid.clone(),
                health: "HEALTH_OK".into(),
                health_detail: vec![],
                epoch: m.epoch,
                osds: m.osds.len() as u32,
                osds_up: m.osds.values().filter(|o| o.up).count() as u32,
                osds_in: m.osds.values().filter(|o| o.r#in).count() as u32,
                volumes: m.volumes.len() as u32,
                provisioned_bytes: m.volumes.values().map(|v| v.size).sum(),
                used_bytes: 0,
                capacity_bytes: 1 << 40,
                pool: m.pool.clone(),
                osds_awaiting_first_report: 0,
                ..Default::default()
            };
            ok(serde_json::to_value(s).unwrap())
        }
        ("GET", "/v1/osds") => {
            let m = map.lock().unwrap();
            let v: Vec<OsdStatus> = m
                .osds
                .values()
                .map(|o| OsdStatus {
                    info: o.clone(),
                    used_bytes: 0,
                    capacity_bytes: 1 << 30,
                    last_heartbeat_ms_ago: Some(10),
                    pgs: 0,
                    awaiting_first_report: false,
                })
                .collect();
            ok(serde_json::to_value(v).unwrap())
        }
        ("GET", "/v1/volumes") => {
            let m = map.lock().unwrap();
            let v: Vec<&VolumeInfo> = m.volumes.values().collect();
            ok(serde_json::to_value(v).unwrap())
        }
        ("POST", "/v1/volumes") => match serde_json::from_str::<VolumeCreate>(&body) {
            Ok(c) => {
                let mut m = map.lock().unwrap();
                if m.volumes.contains_key(&c.name) {
                    err(409, &format!("volume {} already exists", c.name))
                } else {
                    let id = VolumeId(100 + m.epoch.0);
                    let v = VolumeInfo {
                        id,
                        name: c.name.clone(),
                        size: c.size,
                        created_unix: 1_700_000_000,
                    };
                    m.volumes.insert(c.name, v.clone());
                    m.epoch = Epoch(m.epoch.0 + 1);
                    ok(serde_json::to_value(v).unwrap())
                }
            }
            Err(e) => err(400, &format!("bad body: {e}")),
        },
        (method, p) if p.starts_with("/v1/volumes/") => {
            let rest = &p["/v1/volumes/".len()..];
            let (name, action) = match rest.split_once('/') {
                Some((n, a)) => (n, a),
                None => (rest, ""),
            };
            let mut m = map.lock().unwrap();
            match (method, action, m.volumes.get(name).cloned()) {
                (_, _, None) => err(404, &format!("no volume named {name}")),
                ("GET", "", Some(v)) => ok(serde_json::to_value(v).unwrap()),
                ("DELETE", "", Some(v)) => {
                    m.volumes.remove(name);
                    m.epoch = Epoch(m.epoch.0 + 1);
                    ok(serde_json::to_value(v).unwrap())
                }
                ("GET", "trim", Some(v)) => ok(serde_json::to_value(VolumeTrim {
                    volume: v.id,
                    pending: pending_trims().get(&(map_key(map), v.id)).copied(),
                })
                .unwrap()),
                ("POST", "trim", Some(v)) => match serde_json::from_str::<TrimDone>(&body) {
                    Ok(d) => {
                        let mut t = pending_trims();
                        let key = (map_key(map), v.id);
                        if t.get(&key)
                            .is_some_and(|p| d.range.from <= p.from && d.range.to >= p.to)
                        {
                            t.remove(&key);
                        }
                        ok(serde_json::to_value(VolumeTrim {
                            volume: v.id,
                            pending: t.get(&key).copied(),
                        })
                        .unwrap())
                    }
                    Err(e) => err(400, &format!("bad body: {e}")),
                },
                ("POST", "resize", Some(mut v)) => {
                    match serde_json::from_str::<VolumeResize>(&body) {
                        Ok(r) if r.size < v.size && !r.allow_shrink => {
                            err(400, "shrinking needs allow_shrink")
                        }
                        Ok(r)
                            if r.size > v.size
                                && pending_trims().contains_key(&(map_key(map), v.id)) =>
                        {
                            err(409, "a trim is pending")
                        }
                        Ok(r) => {
                            if r.size < v.size {
                                pending_trims().insert(
                                    (map_key(map), v.id),
                                    TrimRange {
                                        from: r.size,
                                        to: v.size,
                                    },
                                );
                            }
                            v.size = r.size;
                            m.volumes.insert(name.to_string(), v.clone());
                            m.epoch = Epoch(m.epoch.0 + 1);
                            ok(serde_json::to_value(v).unwrap())
                        }
                        Err(e) => err(400, &format!("bad body: {e}")),
                    }
                }
                _ => err(404, "no such route"),
            }
        }
        _ => err(404, "no such route"),
    };
    let resp = tiny_http::Response::from_string(value.to_string()).with_status_code(code);
    let _ = req.respond(resp);
}

// ---------------------------------------------------------------- OSD

/// Binds `shards` listeners on consecutive loopback ports.
fn bind_consecutive(shards: u16) -> Vec<Listener> {
    for _ in 0..100 {
        let first = Listener::bind(TransportKind::Tcp, "127.0.0.1:0".parse().unwrap()).unwrap();
        let base = first.local_addr().port();
        let mut ls = vec![first];
        for s in 1..shards {
            let Some(port) = base.checked_add(s) else {
                break;
            };
            match Listener::bind(TransportKind::Tcp, SocketAddr::from(([127, 0, 0, 1], port))) {
                Ok(l) => ls.push(l),
                Err(_) => break,
            }
        }
        if ls.len() == shards as usize {
            return ls;
        }
    }
    panic!("no {shards} consecutive free ports");
}

fn start_osd(id: OsdId, shards: u16, map: SharedMap, state: Arc<OsdState>) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        let listeners = bind_consecutive(shards);
        tx.send(listeners[0].local_addr()).unwrap();
        r.block_on(async move {
            let tasks: Vec<_> = listeners
                .into_iter()
                .enumerate()
                .map(|(shard, l)| {
                    let osd = Osd {
                        id,
                        shard: shard as u16,
                        shards,
                        map: map.clone(),
                        state: state.clone(),
                    };
                    reactor::spawn(async move {
                        let osd = std::rc::Rc::new(osd);
                        while let Ok(conn) = l.accept().await {
                            reactor::spawn(serve_conn(osd.clone(), conn)).detach();
                        }
                    })
                })
                .collect();
            for t in tasks {
                t.await;
            }
        })
        .unwrap();
    });
    rx.recv().unwrap()
}

struct Osd {
    id: OsdId,
    shard: u16,
    shards: u16,
    map: SharedMap,
    state: Arc<OsdState>,
}

fn take(c: &AtomicU32) -> bool {
    c.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
        .is_ok()
}

async fn serve_conn(osd: std::rc::Rc<Osd>, conn: Conn) {
    // Hello first.
    match conn.recv().await {
        Ok(m @ Message::Hello { .. }) => {
            let Message::Hello { shard, .. } = &m else {
                unreachable!()
            };
            let epoch = osd.map.lock().unwrap().epoch;
            if *shard != osd.shard {
                let _ = conn.send(&m.reply(epoch, status::ESTALE));
                conn.close();
                return;
            }
            osd.state.hellos.fetch_add(1, Ordering::SeqCst);
            let mut r = m.reply(epoch, status::OK);
            if let Message::HelloReply { shards, shard, .. } = &mut r {
                *shards = osd.shards;
                *shard = osd.shard;
            }
            let _ = conn.send(&r);
        }
        _ => {
            conn.close();
            return;
        }
    }
    let last_sent = std::rc::Rc::new(std::cell::Cell::new(0u64));
    loop {
        let Ok(msg) = conn.recv().await else {
            return;
        };
        let is_io = matches!(
            msg,
            Message::Read { .. }
                | Message::Write { .. }
                | Message::WriteZeroes { .. }
                | Message::Discard { .. }
        );
        if is_io {
            osd.state.io_requests.fetch_add(1, Ordering::SeqCst);
            if take(&osd.state.drop_next) {
                conn.close();
                return;
            }
            if osd.state.hang.load(Ordering::SeqCst) {
                continue;
            }
        }
        let delay = match &msg {
            Message::Read { target, .. }
            | Message::Write { target, .. }
            | Message::WriteZeroes { target, .. }
            | Message::Discard { target, .. }
                if target.object.index % 2 == 1 =>
            {
                osd.state.delay_odd_ms.load(Ordering::SeqCst)
            }
            _ => 0,
        };
        let reply = handle(&osd, &msg, is_io);
        let conn = conn.clone();
        let last_sent = last_sent.clone();
        let state = osd.state.clone();
        reactor::spawn(async move {
            if delay > 0 {
                reactor::sleep(Duration::from_millis(delay)).await;
            }
            let id = reply.id().0;
            if id < last_sent.get() {
                state.reordered.fetch_add(1, Ordering::SeqCst);
            }
            last_sent.set(last_sent.get().max(id));
            let _ = conn.send(&reply);
        })
        .detach();
    }
}

fn check_route(osd: &Osd, map: &ClusterMap, t: &IoTarget) -> bool {
    let loc = placement::locate(map, t.object);
    loc.pg == t.pg
        && loc.osds.first() == Some(&osd.id)
        && u32::from(osd.shard) == t.pg.0 % u32::from(osd.shards)
}

fn handle(osd: &Osd, msg: &Message, is_io: bool) -> Message {
    let map = osd.map.lock().unwrap().clone();
    let epoch = map.epoch;
    let (req_epoch, target) = match msg {
        Message::Read { epoch, target, .. }
        | Message::Write { epoch, target, .. }
        | Message::WriteZeroes { epoch, target, .. }
        | Message::Discard { epoch, target, .. } => (*epoch, Some(target)),
        Message::Flush { epoch, .. } | Message::DeleteVolume { epoch, .. } => (*epoch, None),
        _ => return msg.reply(epoch, status::EINVAL),
    };
    if req_epoch != epoch {
        osd.state.epoch_mismatch.fetch_add(1, Ordering::SeqCst);
        return msg.reply(epoch, status::ESTALE);
    }
    if is_io {
        if take(&osd.state.estale_next) {
            return msg.reply(epoch, status::ESTALE);
        }
        if take(&osd.state.eagain_next) {
            return msg.reply(epoch, status::EAGAIN);
        }
        if take(&osd.state.eio_next) {
            return msg.reply(epoch, status::EIO);
        }
    }
    if let Some(t) = target
        && !check_route(osd, &map, t)
    {
        osd.state.misrouted.fetch_add(1, Ordering::SeqCst);
        return msg.reply(epoch, status::ESTALE);
    }
    let obj_size = map.pool.object_size as usize;
    let mut objects = osd.state.objects.lock().unwrap();
    let range = |t: &IoTarget| t.offset as usize..(t.offset + t.length) as usize;
    match msg {
        Message::Read { target, .. } => {
            let data = match objects.get(&(target.object.volume.0, target.object.index)) {
                Some(o) => flame_common::buffer::PayloadBuf::copy_from(&o[range(target)]),
                None => flame_common::buffer::PayloadBuf::zeroed(target.length as usize),
            };
            Message::Reply {
                op: OpCode::Read,
                id: msg.id(),
                epoch,
                status: 0,
                data,
            }
        }
        Message::Write { target, data, .. } => {
            let o = objects
                .entry((target.object.volume.0, target.object.index))
                .or_insert_with(|| vec![0; obj_size]);
            o[range(target)].copy_from_slice(data);
            msg.reply(epoch, 0)
        }
        Message::WriteZeroes { target, .. } | Message::Discard { target, .. } => {
            if let Some(o) = objects.get_mut(&(target.object.volume.0, target.object.index)) {
                o[range(target)].fill(0);
            }
            msg.reply(epoch, 0)
        }
        Message::Flush { .. } => {
            *osd.state
                .flushes
                .lock()
                .unwrap()
                .entry(osd.shard)
                .or_default() += 1;
            msg.reply(epoch, 0)
        }
        Message::DeleteVolume { volume, .. } => {
            *osd.state
                .deletes
                .lock()
                .unwrap()
                .entry(osd.shard)
                .or_default() += 1;
            objects.retain(|(v, _), _| *v != volume.0);
            msg.reply(epoch, 0)
        }
        _ => msg.reply(epoch, status::EINVAL),
    }
}
