//! A shard thread: the penetrating model.
//!
//! One thread owns a listener, every connection accepted on it, the objects of its
//! placement groups, its peer connections and its io_uring. A request is received,
//! decoded, applied to disk, replicated and answered by this thread alone: no queue
//! hand-off, no lock (the cluster map is read through a lock-free `ArcSwap`).

use crate::config::OsdConfig;
use crate::metrics::ShardMetrics;
use crate::ordering::WriteGate;
use crate::peers::Peers;
use crate::store::ObjectStore;
use arc_swap::ArcSwap;
use flame_common::ids::{Epoch, OsdId};
use flame_common::map::ClusterMap;
use flame_common::placement::{PgTable, object_pg};
use flame_common::protocol::{IoTarget, Message, OpCode, flags, status};
use flame_common::reactor::{self, Reactor, ReactorConfig};
use flame_common::transport::{Conn, Listener, TransportError};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A replication connection may have this many times a client's in-flight bound.
const PEER_INFLIGHT_FACTOR: u32 = 16;

/// How long a new connection may take to send its `Hello`.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Everything one shard thread owns.
pub struct Shard {
    id: u16,
    osd: OsdId,
    /// The map as the control thread publishes it.
    map_source: Arc<ArcSwap<ClusterMap>>,
    /// Highest epoch seen in a request (shared with the control thread).
    wanted_epoch: Arc<AtomicU64>,
    /// This shard's own copy of the current map and its placement table, refreshed
    /// when the epoch changes. `Rc`, not `Arc`: cloning it per request touches no
    /// cache line shared with other shards.
    view: RefCell<Rc<MapView>>,
    store: ObjectStore,
    gate: Rc<WriteGate>,
    peers: Rc<Peers>,
    metrics: Rc<ShardMetrics>,
    max_connections: u32,
    max_inflight: u32,
    connections: Cell<u32>,
    /// Payload bytes in flight on this shard, and its bound.
    inflight_bytes: Cell<u64>,
    inflight_bytes_max: u64,
    /// Connection readers waiting for `inflight_bytes` to drop below the bound.
    byte_waiters: RefCell<Vec<std::task::Waker>>,
    /// Newest connection generation of each session (see `Message::Hello`).
    sessions: RefCell<std::collections::HashMap<u64, Rc<Cell<u64>>>>,
}

/// What a shard thread needs to start.
pub struct ShardSetup {
    /// Shard number.
    pub id: u16,
    /// This OSD's id.
    pub osd: OsdId,
    /// The bound listener of this shard.
    pub listener: Listener,
    /// The live map.
    pub map: Arc<ArcSwap<ClusterMap>>,
    /// Highest epoch seen in a request; the control thread fetches it.
    pub wanted_epoch: Arc<AtomicU64>,
    /// Configuration.
    pub config: Arc<OsdConfig>,
    /// Whether `O_DIRECT` works in the data directory.
    pub direct_io: bool,
}

/// Starts a shard thread. It runs until the process exits.
pub fn spawn(setup: ShardSetup) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name(format!("shard-{}", setup.id))
        .spawn(move || {
            let id = setup.id;
            let cfg = setup.config.clone();
            let mut reactor = match Reactor::new(ReactorConfig {
                poll_mode: cfg.poll_mode,
                ..Default::default()
            }) {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(shard = id, "cannot create io_uring: {e}");
                    std::process::exit(1);
                }
            };
            let metrics = Rc::new(ShardMetrics::new(id));
            let shard = Rc::new(Shard {
                id,
                osd: setup.osd,
                view: RefCell::new(Rc::new(MapView::new(&setup.map.load()))),
                map_source: setup.map,
                wanted_epoch: setup.wanted_epoch,
                store: ObjectStore::new(
                    &cfg.data_dir,
                    id,
                    crate::store::StoreOptions {
                        direct_io: setup.direct_io,
                        open_max: cfg.open_files_per_shard_max as usize,
                        checksums: cfg.checksums,
                    },
                ),
                gate: Rc::new(WriteGate::default()),
                peers: Rc::new(Peers::new(
                    cfg.transport,
                    Duration::from_millis(cfg.connect_timeout_ms),
                    Duration::from_millis(cfg.replica_timeout_ms),
                    metrics.clone(),
                )),
                metrics,
                max_connections: cfg.max_connections_per_shard,
                max_inflight: cfg.max_inflight_per_connection,
                connections: Cell::new(0),
                inflight_bytes: Cell::new(0),
                inflight_bytes_max: cfg.max_inflight_bytes_per_shard,
                byte_waiters: RefCell::new(Vec::new()),
                sessions: RefCell::new(std::collections::HashMap::new()),
            });
            if let Err(e) = reactor.block_on(accept_loop(shard, setup.listener)) {
                tracing::error!(shard = id, "reactor failed: {e}");
                std::process::exit(1);
            }
        })
}

/// How often a shard publishes its reactor's idle-loop counters.
const REACTOR_METRICS_INTERVAL: Duration = Duration::from_secs(1);

async fn accept_loop(shard: Rc<Shard>, listener: Listener) {
    let id = shard.id;
    reactor::spawn(async move {
        let mut m = crate::metrics::ReactorMetrics::new(id);
        loop {
            reactor::sleep(REACTOR_METRICS_INTERVAL).await;
            m.update(reactor::poll_stats());
        }
    })
    .detach();
    loop {
        let conn = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of descriptors or memory: back off instead of spinning. Any
                // other error concerns one connection (it reset before we got to it)
                // and must not slow down accepting everyone else.
                let resource = matches!(
                    &e,
                    TransportError::Io(io) if matches!(
                        io.raw_os_error(),
                        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                    )
                );
                tracing::warn!(shard = shard.id, "accept failed: {e}");
                if resource {
                    reactor::sleep(Duration::from_millis(100)).await;
                }
                continue;
            }
        };
        if shard.connections.get() >= shard.max_connections {
            tracing::warn!(shard = shard.id, peer = %conn.peer(), "connection limit reached; refusing");
            conn.close();
            continue;
        }
        reactor::spawn(serve_connection(shard.clone(), conn)).detach();
    }
}

/// Counts a connection while it lives.
struct ConnectionSlot(Rc<Shard>);

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.connections.set(self.0.connections.get() - 1);
        self.0.metrics.client_connections.dec();
    }
}

async fn serve_connection(shard: Rc<Shard>, conn: Conn) {
    shard.connections.set(shard.connections.get() + 1);
    shard.metrics.client_connections.inc();
    let _slot = ConnectionSlot(shard.clone());
    let peer = conn.peer();
    // The first message must be a Hello naming this shard.
    let mut max_inflight = shard.max_inflight;
    let mut is_peer = false;
    let mut fence: Option<Fence> = None;
    let first = futures_lite::future::or(async { Some(conn.recv().await) }, async {
        reactor::sleep(HELLO_TIMEOUT).await;
        None
    })
    .await;
    match first {
        Some(Ok(hello @ Message::Hello { .. })) => {
            if matches!(hello, Message::Hello { peer: true, .. }) {
                // One replication connection carries the writes of every client of
                // the sending shard: give it room for all of them.
                max_inflight = max_inflight.saturating_mul(PEER_INFLIGHT_FACTOR);
                is_peer = true;
            }
            let mut reply = shard.hello(&hello);
            if let (
                Message::Hello {
                    session,
                    generation,
                    ..
                },
                Message::Reply { status: st @ 0, .. },
            ) = (&hello, &mut reply)
                && *session != 0
            {
                match shard.register_session(*session, *generation) {
                    Some(f) => fence = Some(f),
                    None => {
                        tracing::warn!(shard = shard.id, %peer, session, generation, "hello from a superseded connection; refusing");
                        *st = status::ESTALE;
                    }
                }
            }
            let ok = matches!(reply, Message::Reply { status: 0, .. });
            if conn.send(&reply).is_err() {
                conn.close();
                return;
            }
            if !ok {
                // The refusal (wrong shard, superseded session) must reach the
                // sender, so it can tell a stale map from a network failure.
                conn.close_after_send();
                return;
            }
        }
        Some(Ok(other)) => {
            tracing::warn!(shard = shard.id, %peer, "first message was {:?}, not hello; closing", other.op());
            conn.close();
            return;
        }
        Some(Err(e)) => {
            tracing::debug!(shard = shard.id, %peer, "connection failed before hello: {e}");
            return;
        }
        None => {
            tracing::warn!(shard = shard.id, %peer, "no hello within {HELLO_TIMEOUT:?}; closing");
            conn.close();
            return;
        }
    }
    let inflight = Rc::new(Inflight {
        count: Cell::new(0),
        reader: Cell::new(None),
    });
    loop {
        // Back-pressure: stop reading while the connection has too much in flight;
        // the unread requests wait in the socket and slow the sender down.
        inflight.below(max_inflight).await;
        if !is_peer {
            // Replication connections never wait on the shard's byte bound: their
            // requests are what frees other shards' (and this one's) primaries, so
            // blocking them could deadlock two OSDs waiting on each other. Their
            // volume is bounded by the sending primaries' own bounds.
            shard.bytes_below_bound().await;
        }
        let msg = match conn.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(shard = shard.id, %peer, "connection ended: {e}");
                conn.close();
                return;
            }
        };
        if let Some(f) = &fence
            && f.current.get() != f.generation
        {
            // The same session has connected again: whatever still arrives here was
            // sent before the sender gave up on this connection and may have been
            // resent on the new one. Executing it now could let a stale write
            // overtake (and then overwrite) its newer copy.
            tracing::info!(shard = shard.id, %peer, "connection superseded by a newer one of its session; closing");
            conn.close();
            return;
        }
        if matches!(msg, Message::Reply { .. } | Message::Hello { .. }) {
            tracing::warn!(shard = shard.id, %peer, "unexpected {:?} mid-connection; closing", msg.op());
            conn.close();
            return;
        }
        inflight.count.set(inflight.count.get() + 1);
        let bytes = payload_bytes(&msg);
        shard.inflight_bytes.set(shard.inflight_bytes.get() + bytes);
        let shard = shard.clone();
        let conn = conn.clone();
        let inflight = inflight.clone();
        reactor::spawn(async move {
            let reply = shard.execute(msg).await;
            let _ = conn.send_owned(reply);
            shard.release_bytes(bytes);
            inflight.count.set(inflight.count.get() - 1);
            if let Some(w) = inflight.reader.take() {
                w.wake();
            }
        })
        .detach();
    }
}

/// Requests in flight on one connection, and the reader waiting for room.
struct Inflight {
    count: Cell<u32>,
    reader: Cell<Option<std::task::Waker>>,
}

impl Inflight {
    async fn below(&self, max: u32) {
        std::future::poll_fn(|cx| {
            if self.count.get() < max {
                std::task::Poll::Ready(())
            } else {
                self.reader.set(Some(cx.waker().clone()));
                std::task::Poll::Pending
            }
        })
        .await
    }
}

/// A map and the acting sets computed from it.
pub struct MapView {
    map: ClusterMap,
    table: PgTable,
}

impl MapView {
    fn new(map: &ClusterMap) -> MapView {
        MapView {
            map: map.clone(),
            table: PgTable::new(map),
        }
    }
}

/// A connection's place in its session: it may execute requests only while its
/// generation is the session's newest.
struct Fence {
    current: Rc<Cell<u64>>,
    generation: u64,
}

/// Sessions one shard remembers (beyond those with a live connection).
const SESSIONS_MAX: usize = 65_536;

/// Memory a request holds while it runs: its write data or its read result.
fn payload_bytes(msg: &Message) -> u64 {
    match msg {
        Message::Write { target, .. } | Message::Read { target, .. } => u64::from(target.length),
        _ => 0,
    }
}

impl Shard {
    /// Records that `session` opened connection `generation`. `None` if the session
    /// already has a newer connection (this hello is itself stale).
    fn register_session(&self, session: u64, generation: u64) -> Option<Fence> {
        let mut sessions = self.sessions.borrow_mut();
        if sessions.len() >= SESSIONS_MAX {
            // Forget sessions without a live connection (only their fences hold
            // a second reference).
            sessions.retain(|_, c| Rc::strong_count(c) > 1);
        }
        let current = sessions
            .entry(session)
            .or_insert_with(|| Rc::new(Cell::new(0)))
            .clone();
        if generation < current.get() {
            return None;
        }
        current.set(generation);
        Some(Fence {
            current,
            generation,
        })
    }

    /// Waits while the shard's in-flight payload bytes are at their bound.
    async fn bytes_below_bound(&self) {
        std::future::poll_fn(|cx| {
            if self.inflight_bytes.get() < self.inflight_bytes_max {
                std::task::Poll::Ready(())
            } else {
                self.byte_waiters.borrow_mut().push(cx.waker().clone());
                std::task::Poll::Pending
            }
        })
        .await
    }

    fn release_bytes(&self, bytes: u64) {
        let now = self.inflight_bytes.get() - bytes;
        self.inflight_bytes.set(now);
        if now < self.inflight_bytes_max {
            for w in self.byte_waiters.borrow_mut().drain(..) {
                w.wake();
            }
        }
    }

    /// The current map view; recomputed only when the epoch moved.
    fn view(&self) -> Rc<MapView> {
        let source = self.map_source.load();
        let cached = self.view.borrow().clone();
        if cached.map.epoch == source.epoch {
            return cached;
        }
        let fresh = Rc::new(MapView::new(&source));
        *self.view.borrow_mut() = fresh.clone();
        fresh
    }

    fn epoch(&self) -> Epoch {
        self.view().map.epoch
    }

    fn hello(&self, hello: &Message) -> Message {
        let Message::Hello { shard, .. } = hello else {
            return hello.reply(self.epoch(), status::EINVAL);
        };
        let view = self.view();
        let map = &view.map;
        let shards = map.osds.get(&self.osd).map_or(0, |o| u32::from(o.shards));
        let st = if *shard == self.id {
            status::OK
        } else {
            status::ESTALE
        };
        Message::Reply {
            op: OpCode::Hello,
            id: hello.id(),
            epoch: map.epoch,
            status: st,
            info: shards,
            data: Vec::new(),
        }
    }

    /// Checks that `target` is well-formed and that this OSD and shard should serve
    /// it in the role the request asks for.
    fn check(&self, view: &MapView, target: &IoTarget, replica: bool) -> Result<(), i32> {
        let map = &view.map;
        let end = u64::from(target.offset) + u64::from(target.length);
        if end > u64::from(map.pool.object_size) {
            return Err(status::EINVAL);
        }
        if object_pg(target.object, map.pool.pg_count) != target.pg {
            return Err(status::EINVAL);
        }
        let set = view.table.osds(target.pg);
        let me = map.osds.get(&self.osd).ok_or(status::ESTALE)?;
        if me.shard_of(target.pg) != self.id {
            return Err(status::ESTALE);
        }
        let serves = if replica {
            set.contains(&self.osd)
        } else {
            set.first() == Some(&self.osd)
        };
        if !serves {
            return Err(status::ESTALE);
        }
        Ok(())
    }

    /// Runs one request and builds its reply.
    pub async fn execute(self: &Rc<Self>, msg: Message) -> Message {
        let started = Instant::now();
        let op = msg.op();
        let is_replica = match &msg {
            Message::Write { flags: f, .. }
            | Message::WriteZeroes { flags: f, .. }
            | Message::Discard { flags: f, .. }
            | Message::Flush { flags: f, .. }
            | Message::Read { flags: f, .. } => f & flags::REPLICA != 0,
            _ => false,
        };
        let bytes = match &msg {
            Message::Read { target, .. } | Message::Write { target, .. } => {
                u64::from(target.length)
            }
            _ => 0,
        };
        let id = msg.id();
        // One map view for the whole request: its checks, its replication, and the
        // epoch in its reply.
        let view = self.view();
        let epoch = view.map.epoch;
        let (st, data) = self.apply(view, msg, is_replica).await;
        if let Some(i) = ShardMetrics::op_index(op) {
            let c = &self.metrics.by_op[usize::from(is_replica)][i];
            c.ops.inc();
            c.bytes.inc_by(bytes);
            c.latency.observe(started.elapsed().as_secs_f64());
            if st != status::OK {
                self.metrics.errors[i].inc();
            }
        }
        Message::Reply {
            op,
            id,
            epoch,
            status: st,
            info: 0,
            data,
        }
    }

    async fn apply(
        self: &Rc<Self>,
        view: Rc<MapView>,
        msg: Message,
        replica: bool,
    ) -> (i32, Vec<u8>) {
        let map = &view.map;
        let sender_epoch = msg.epoch();
        if sender_epoch > map.epoch {
            // The sender knows a newer map: fetch it now, and do not act on the old
            // one meanwhile (placement may have moved; two OSDs must never both
            // believe they are primary). The sender retries in a few milliseconds.
            self.wanted_epoch
                .fetch_max(sender_epoch.0, Ordering::Relaxed);
            return (status::ESTALE, Vec::new());
        }
        match &msg {
            Message::Read { target, .. } => {
                if let Err(st) = self.check(&view, target, replica) {
                    return (st, Vec::new());
                }
                match self
                    .store
                    .read(target.pg, target.object, target.offset, target.length)
                    .await
                {
                    Ok(data) => (status::OK, data),
                    Err(e) => {
                        // Repair from another copy needs protocol v2 (to be wired);
                        // until then the block stays bad and the read fails.
                        if let crate::store::StoreError::Checksum { blocks, .. } = &e {
                            crate::metrics::checksum_errors(false, blocks.len() as u64);
                        }
                        tracing::error!(object = %target.object, "read failed: {e}");
                        (status::EIO, Vec::new())
                    }
                }
            }
            Message::Write { target, .. }
            | Message::WriteZeroes { target, .. }
            | Message::Discard { target, .. } => {
                if let Err(st) = self.check(&view, target, replica) {
                    return (st, Vec::new());
                }
                if replica {
                    // Ordered like on the primary: a forwarded write that outlived its
                    // primary's timeout (and a retry of it on a new connection) must
                    // not overtake or be overtaken by an overlapping one.
                    let (_guard, earlier) = self.gate.enter(
                        target.object,
                        target.offset,
                        target.offset + target.length,
                    );
                    for e in earlier {
                        e.wait().await;
                    }
                    return (self.apply_local(msg).await, Vec::new());
                }
                (self.replicate(&view, msg).await, Vec::new())
            }
            Message::Flush { .. } => match self.store.flush(None).await {
                Ok(()) => (status::OK, Vec::new()),
                Err(e) => {
                    tracing::error!("flush failed: {e}");
                    (status::EIO, Vec::new())
                }
            },
            Message::DeleteVolume { volume, .. } => {
                let me = map.osds.get(&self.osd).cloned();
                let shard = self.id;
                let owned = move |pg| me.as_ref().is_some_and(|m| m.shard_of(pg) == shard);
                match self.store.delete_volume(*volume, owned).await {
                    Ok(n) => {
                        tracing::info!(shard = self.id, %volume, objects = n, "deleted volume objects");
                        (status::OK, Vec::new())
                    }
                    Err(e) => {
                        tracing::error!(%volume, "delete failed: {e}");
                        (status::EIO, Vec::new())
                    }
                }
            }
            Message::Ping { .. } => (status::OK, Vec::new()),
            Message::Hello { .. } | Message::Reply { .. } => (status::EINVAL, Vec::new()),
        }
    }

    /// Applies a write-like request to the local store.
    async fn apply_local(&self, msg: Message) -> i32 {
        let res = match msg {
            Message::Write {
                target,
                flags: f,
                data,
                ..
            } => {
                self.store
                    .write(
                        target.pg,
                        target.object,
                        target.offset,
                        data,
                        f & flags::FUA != 0,
                    )
                    .await
            }
            Message::WriteZeroes {
                target, flags: f, ..
            }
            | Message::Discard {
                target, flags: f, ..
            } => {
                self.store
                    .zero(
                        target.pg,
                        target.object,
                        target.offset,
                        target.length,
                        f & flags::FUA != 0,
                    )
                    .await
            }
            _ => return status::EINVAL,
        };
        match res {
            Ok(()) => status::OK,
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => status::ENOSPC,
            Err(e) => {
                tracing::error!("local write failed: {e}");
                status::EIO
            }
        }
    }

    /// Primary path: order against overlapping writes, forward to the replicas and
    /// apply locally in parallel, answer once every copy has applied.
    async fn replicate(self: &Rc<Self>, view: &Rc<MapView>, msg: Message) -> i32 {
        let map = &view.map;
        let target = match &msg {
            Message::Write { target, .. }
            | Message::WriteZeroes { target, .. }
            | Message::Discard { target, .. } => target.clone(),
            _ => return status::EINVAL,
        };
        // Register before the first await: admission order is arrival order.
        let (_guard, earlier) =
            self.gate
                .enter(target.object, target.offset, target.offset + target.length);
        let set = view.table.osds(target.pg);
        // Every copy or none: with fewer OSDs in than the pool's size, a write would
        // be acknowledged with fewer copies than promised.
        if set.len() < map.pool.size as usize {
            return status::EAGAIN;
        }
        // A replica known to be down cannot apply the write: fail fast, the client
        // waits and retries until it is back.
        let replicas = &set[1..];
        if !replicas
            .iter()
            .all(|id| map.osds.get(id).is_some_and(|o| o.up))
        {
            return status::EAGAIN;
        }
        for e in earlier {
            e.wait().await;
        }
        // One copy of the payload per replica: each send queue owns its bytes.
        let calls: Vec<_> = replicas
            .iter()
            .map(|&id| {
                let peers = self.peers.clone();
                let fwd = with_replica_flag(&msg);
                let view = view.clone();
                reactor::spawn(async move {
                    // Checked above: every replica is in this view's map.
                    let Some(osd) = view.map.osds.get(&id) else {
                        return status::EAGAIN;
                    };
                    peers
                        .call(osd, osd.shard_of(target.pg), view.map.epoch, fwd)
                        .await
                })
            })
            .collect();
        let local = self.apply_local(msg).await;
        let mut result = local;
        for c in calls {
            let st = c.await;
            if result == status::OK && st != status::OK {
                // A replica's ESTALE means maps disagree: the client refreshes and
                // retries, as for EAGAIN.
                result = if st == status::ESTALE {
                    status::EAGAIN
                } else {
                    st
                };
            }
        }
        result
    }
}

fn with_replica_flag(msg: &Message) -> Message {
    match msg.clone() {
        Message::Write {
            id,
            epoch,
            target,
            flags: f,
            data,
        } => Message::Write {
            id,
            epoch,
            target,
            flags: f | flags::REPLICA,
            data,
        },
        Message::WriteZeroes {
            id,
            epoch,
            target,
            flags: f,
        } => Message::WriteZeroes {
            id,
            epoch,
            target,
            flags: f | flags::REPLICA,
        },
        Message::Discard {
            id,
            epoch,
            target,
            flags: f,
        } => Message::Discard {
            id,
            epoch,
            target,
            flags: f | flags::REPLICA,
        },
        other => other,
    }
}
