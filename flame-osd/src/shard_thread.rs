//! Starting a shard thread and accepting its connections: the thread builds its
//! [`Shard`] (its io_uring, store, peers, metrics) and then accepts on its own
//! listener forever, handing each connection to [`crate::connection`] on the same
//! thread.

use crate::config::{OsdConfig, PROGRESS_INTERVAL_MS};
use crate::liveness::Liveness;
use crate::metrics::ShardMetrics;
use crate::ordering::WriteGate;
use crate::peers::Peers;
use crate::pg::MapView;
use crate::shard::Shard;
use crate::store::ObjectStore;
use arc_swap::ArcSwap;
use flame_common::ids::OsdId;
use flame_common::map::ClusterMap;
use flame_common::reactor::{self, Reactor, ReactorConfig};
use flame_common::transport::{Listener, TransportError};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// What a shard thread needs to start.
pub struct ShardSetup {
    /// Shard number.
    pub id: u16,
    /// This OSD's id.
    pub osd: OsdId,
    /// The bound listener of this shard (penetrating), or the request queue the
    /// staged mode's network threads feed (the listener then lives there).
    pub intake: Intake,
    /// The live map.
    pub map: Arc<ArcSwap<ClusterMap>>,
    /// Highest epoch seen in a request; the control thread fetches it.
    pub wanted_epoch: Arc<AtomicU64>,
    /// Configuration.
    pub config: Arc<OsdConfig>,
    /// Whether `O_DIRECT` works in the data directory.
    pub direct_io: bool,
    /// Shared with the control thread and the HTTP API (recovery reports, status).
    pub recovery: Arc<crate::recovery::RecoveryShared>,
    /// Lease, shard progress and unreachable peers, shared with the control thread.
    pub liveness: Arc<Liveness>,
    /// Installs the configured memory pool on the shard thread.
    pub pool: Arc<flame_common::buffer::registered::PoolInstaller>,
    /// What start-up store recovery left in doubt ([`crate::store::recover`]),
    /// shared by the shards, which settle it.
    pub restart_doubt: Arc<crate::store::doubt_record::DoubtRecord>,
    /// See [`ShardParts::service`].
    pub service: Option<crate::service_key::ServiceKeys>,
}

/// Where a shard thread's requests come from.
pub enum Intake {
    /// Penetrating: it accepts and serves its own connections.
    Listener(Listener),
    /// Staged: network threads hand it requests through this queue.
    Queue(Arc<crate::staged::Mailbox<crate::staged::Job>>),
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
            if let Err(e) = install_pool(&setup.pool) {
                tracing::error!(shard = id, "cannot set up the memory pool: {e}");
                std::process::exit(1);
            }
            let store = ObjectStore::new(
                &cfg.data_dir,
                id,
                crate::store::StoreOptions {
                    direct_io: setup.direct_io,
                    open_max: cfg.open_files_per_shard_max as usize,
                    checksums: cfg.checksums,
                },
            );
            let shard = build_shard(
                ShardParts {
                    id,
                    osd: setup.osd,
                    map: setup.map,
                    wanted_epoch: setup.wanted_epoch,
                    config: cfg.clone(),
                    recovery: setup.recovery,
                    liveness: setup.liveness,
                    restart_doubt: &setup.restart_doubt,
                    service: setup.service.clone(),
                },
                store,
            );
            let handle = reactor.handle();
            if let Err(e) = reactor.block_on(accept_loop(shard, setup.intake, handle)) {
                tracing::error!(shard = id, "reactor failed: {e}");
                std::process::exit(1);
            }
        })
}

/// What a shard's state is made of, apart from its store.
pub struct ShardParts<'a> {
    /// Shard number.
    pub id: u16,
    /// This OSD's id.
    pub osd: OsdId,
    /// The live map.
    pub map: Arc<ArcSwap<ClusterMap>>,
    /// Highest epoch seen in a request; the control thread fetches it.
    pub wanted_epoch: Arc<AtomicU64>,
    /// Configuration.
    pub config: Arc<OsdConfig>,
    /// Shared with the control thread (recovery reports, status).
    pub recovery: Arc<crate::recovery::RecoveryShared>,
    /// Lease, shard progress and unreachable peers, shared with the control thread.
    pub liveness: Arc<Liveness>,
    /// What start-up store recovery left in doubt ([`crate::store::recover`]),
    /// shared by the shards, which settle it.
    pub restart_doubt: &'a Arc<crate::store::doubt_record::DoubtRecord>,
    /// The service key (from the `osd` keyring): HELLOs are checked with it and
    /// peer tickets made with it. `None`: no keyring, no checks.
    pub service: Option<crate::service_key::ServiceKeys>,
}

/// Builds a shard's state around `store`, on the thread (reactor) that will run
/// it: the shard thread, or a simulated OSD process of the deterministic
/// simulator (which gives it a store on the simulated disk).
pub fn build_shard(parts: ShardParts<'_>, store: ObjectStore) -> Rc<Shard> {
    let id = parts.id;
    let cfg = parts.config;
    let metrics = Rc::new(ShardMetrics::new(id));
    let view = MapView::new(&parts.map.load());
    // The map it starts with already tells, for each group in doubt, whether
    // the manager took this copy out (it is recovering: its recovery settles
    // the doubt) or kept it complete (it settles the doubt itself).
    let doubt = parts.restart_doubt.entries();
    // Blocks rewritten from now on are sure whatever the restart took.
    store.track_rewrites(doubt.iter().map(|&(_, object, _)| object));
    let mut suspects = crate::restart_suspects::RestartSuspects::new(&doubt);
    for pg in suspects.pgs() {
        suspects.on_map(parts.osd, pg, view.table.pg(pg));
    }
    let shard = Rc::new(Shard {
        id,
        osd: parts.osd,
        view: RefCell::new(Rc::new(view)),
        map_source: parts.map,
        wanted_epoch: parts.wanted_epoch,
        peer_epoch: Cell::new(0),
        lease: Duration::from_millis(cfg.lease_ms),
        activation_wake: Default::default(),
        suspects: RefCell::new(suspects),
        doubt_record: parts.restart_doubt.clone(),
        store,
        gate: Rc::new(WriteGate::default()),
        peers: Rc::new(Peers::new(
            cfg.transport,
            Some(cfg.source_ip()),
            Duration::from_millis(cfg.connect_timeout_ms),
            Duration::from_millis(cfg.replica_timeout_ms),
            cfg.max_inflight_per_connection,
            metrics.clone(),
            parts.liveness.clone(),
            parts.service.clone(),
            parts.osd,
        )),
        hello_gate: crate::hello_gate::HelloGate::new(parts.osd, parts.service),
        stall_bounds: cfg.stall_bounds(),
        liveness: parts.liveness,
        metrics,
        max_inflight: cfg.max_inflight_per_connection,
        reply_slots_max: cfg.reply_slots_per_connection_max,
        reply_slot_payload_max: cfg.reply_slot_payload_bytes_max,
        reply_area_over_emulated: cfg.reply_area_over_emulated,
        slots: Rc::new(RefCell::new(crate::connection_slots::ConnectionSlots::new(
            cfg.max_connections_per_shard,
            cfg.max_connections_per_source,
            cfg.connections_reserved_for_peers,
        ))),
        client_bytes: crate::byte_budget::ByteBudget::new(
            cfg.max_inflight_bytes_per_shard,
            Some(ShardMetrics::inflight_bytes_gauge("client", id)),
        ),
        peer_bytes: crate::byte_budget::ByteBudget::new(
            cfg.max_peer_inflight_bytes_per_shard,
            Some(ShardMetrics::inflight_bytes_gauge("peer", id)),
        ),
        sessions: RefCell::new(crate::session_fence::SessionFences::default()),
        pgs: RefCell::new(crate::pg_core::PgCores::new(
            cfg.pg_log_entries_max as usize,
        )),
        recovery: crate::recovery::RecoveryState::default(),
        recovery_shared: parts.recovery,
        recovery_max_active: cfg.recovery_max_active.max(1),
        recovery_bytes_per_sec: cfg.recovery_bytes_per_sec,
        scrub_interval: Duration::from_secs(cfg.scrub_interval_s),
        scrub_bytes_per_sec: cfg.scrub_bytes_per_sec,
        stray_delete_delay: Duration::from_millis(cfg.stray_delete_delay_ms),
    });
    shard
        .store
        .pg_log()
        .set_keep_per_pg(cfg.pg_log_entries_max as usize);
    shard
}

/// Serves a shard: loads its log, starts its background tasks and accepts on
/// `listener` until the reactor is dropped (what a shard thread runs; the
/// simulator runs it on a simulated OSD's reactor).
pub async fn serve(shard: Rc<Shard>, listener: Listener, handle: reactor::Handle) {
    accept_loop(shard, Intake::Listener(listener), handle).await
}

/// Makes the configured pool this thread's payload memory and, if configured,
/// registers its regions with the thread's io_uring as fixed buffers, so `O_DIRECT`
/// reads and writes of pool buffers skip per-I/O page pinning. A kernel or limit
/// that refuses the registration only costs that optimisation (logged).
fn install_pool(pool: &flame_common::buffer::registered::PoolInstaller) -> std::io::Result<()> {
    use flame_common::buffer::registered;
    pool.install()?;
    if !pool.config().fixed_buffers {
        return Ok(());
    }
    let regions: Vec<(usize, usize)> = registered::thread_regions()
        .iter()
        .map(|r| (r.base, r.len))
        .collect();
    if regions.is_empty() {
        return Ok(());
    }
    // SAFETY: the thread's pool keeps its regions mapped as long as any buffer or
    // the thread's pool slot refers to them; the slot is replaced only at thread
    // exit, after the reactor (and its ring) is gone.
    if let Err(e) = unsafe { reactor::register_fixed_buffers(&regions) } {
        tracing::warn!("memory pool not registered with io_uring (plain I/O instead): {e}");
    }
    Ok(())
}

/// How often a shard publishes its reactor's idle-loop counters.
const REACTOR_METRICS_INTERVAL: Duration = Duration::from_secs(1);

async fn accept_loop(shard: Rc<Shard>, intake: Intake, handle: reactor::Handle) {
    let id = shard.id;
    // The heartbeat's evidence that this thread's loop runs: if a task blocks the
    // thread (a stuck disk call, a livelock), this stops and the control thread
    // stops heartbeating (`shard_stall_ms`).
    let liveness = shard.liveness.clone();
    liveness.progress(id);
    reactor::spawn(async move {
        loop {
            reactor::sleep(Duration::from_millis(PROGRESS_INTERVAL_MS)).await;
            #[cfg(feature = "failpoints")]
            liveness.hang_while_stalled(id);
            liveness.progress(id);
        }
    })
    .detach();
    reactor::spawn(async move {
        let mut m = crate::metrics::ReactorMetrics::new(&id.to_string());
        let mut fixed = crate::metrics::FixedIoMetric::new(id);
        loop {
            reactor::sleep(REACTOR_METRICS_INTERVAL).await;
            m.update(reactor::poll_stats());
            fixed.update(reactor::fixed_ops());
        }
    })
    .detach();
    shard.load_pg_logs().await;
    reactor::spawn(crate::tombstones::run(shard.clone())).detach();
    reactor::spawn(crate::recovery::recovery_loop(shard.clone())).detach();
    reactor::spawn(crate::activation::activation_loop(shard.clone())).detach();
    let listener = match intake {
        Intake::Listener(l) => l,
        Intake::Queue(q) => {
            crate::staged::start_worker(shard, q, handle);
            // The queue's poll source spawns a task per request from now on.
            return std::future::pending().await;
        }
    };
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
        let Some(slot) =
            crate::connection_slots::SlotGuard::take_or_close(&shard.slots, &conn, shard.id)
        else {
            continue;
        };
        reactor::spawn(crate::connection::serve_connection(
            shard.clone(),
            conn,
            slot,
        ))
        .detach();
    }
}
