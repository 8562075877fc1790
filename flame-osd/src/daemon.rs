//! Start-up of one OSD process.
//!
//! Start-up order matters: bind every shard's listener first (so the address the
//! manager publishes is already served), then register with the manager, then start
//! the shard threads, then heartbeat on this thread forever.

use crate::config::OsdConfig;
use crate::{control, shard_thread, store};
use arc_swap::ArcSwap;
use flame_common::transport::Listener;
use std::path::Path;
use std::sync::Arc;

/// Each shard caches up to `open_files_per_shard_max` object files, twice with
/// `O_DIRECT`; the default soft limit (1024) is far below that. Raise it to the hard
/// limit, which needs no privilege.
fn raise_open_file_limit() {
    // SAFETY: getrlimit/setrlimit on a valid struct.
    unsafe {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                tracing::warn!(
                    "cannot raise the open-file limit: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
}

/// Makes everything a previous incarnation of this OSD wrote stable before serving.
///
/// The dirty set that FLUSH works from lives in memory. After a crash (kill -9) the
/// writes it acknowledged are still only in the page cache; without this, the first
/// FLUSH after the restart would find an empty dirty set and report success for
/// data that a power failure could still lose.
fn sync_data_fs(data_dir: &Path) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let dir = std::fs::File::open(data_dir)
        .map_err(|e| format!("cannot open data_dir {}: {e}", data_dir.display()))?;
    // SAFETY: syncfs on a descriptor we own.
    if unsafe { libc::syncfs(dir.as_raw_fd()) } != 0 {
        // The kernel reports a writeback error once: the next start would
        // not see it, so it must take what the journals name for lost.
        let error = std::io::Error::last_os_error();
        store::doubt_record::mark_writeback_failed(data_dir);
        return Err(format!(
            "syncfs of {} failed: {error}; refusing to serve data that may not be stable",
            data_dir.display(),
        ));
    }
    Ok(())
}

/// Why the OSD could not start, and the exit status that says so.
#[derive(Debug)]
pub struct StartError {
    /// One line for stderr and the log.
    pub message: String,
    /// 2 for a problem the operator must fix in the configuration or the data
    /// directory (such as a data directory of another on-disk format), 1 otherwise.
    pub status: i32,
}

impl From<String> for StartError {
    fn from(message: String) -> StartError {
        StartError { message, status: 1 }
    }
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Makes the store consistent after whatever stopped the previous incarnation:
/// objects named by the intent journals get checksums recomputed from their data
/// (docs/on-disk-format.md, "Crash consistency"). Before any shard starts.
/// Returns the restart doubt (those objects and what earlier restarts left
/// unsettled): each shard answers its primaries' `PgSuspects` with it until the
/// doubt is settled.
fn recover_store(
    data_dir: &Path,
    direct_io: bool,
    shards: usize,
) -> Result<store::doubt_record::DoubtRecord, String> {
    let mut reactor = flame_common::reactor::Reactor::new(Default::default())
        .map_err(|e| format!("cannot create io_uring: {e}"))?;
    let root = data_dir.to_path_buf();
    let fs = store::fs::Fs::Real { direct_io };
    let doubt = reactor
        .block_on(async move { store::recover(&fs, &root, shards).await })
        .map_err(|e| format!("cannot run store recovery: {e}"))?
        .map_err(|e| format!("store recovery of {} failed: {e}", data_dir.display()))?;
    let objects = doubt.objects().len();
    if objects > 0 {
        tracing::info!(
            objects,
            "objects written since their last flush (by this run or one before it whose \
             doubt no primary settled) may lack acknowledged writes: they are compared with \
             or copied again from the other copies before this OSD serves them"
        );
    }
    Ok(doubt)
}

/// Runs the OSD described by the configuration file at `config` (defaults when
/// `None`) until the process is stopped. Returns only on a start-up error.
pub fn run(config: Option<&Path>) -> Result<(), StartError> {
    let cfg: OsdConfig = flame_common::config::load(config).map_err(|e| StartError {
        message: e.to_string(),
        status: 2,
    })?;
    run_with(cfg)
}

/// Runs the OSD with an already loaded configuration (the binary loads it itself,
/// so a bad config gets its own report and exit status 2).
pub fn run_with(cfg: OsdConfig) -> Result<(), StartError> {
    // First, before anything is created: `transport: rdma` on a machine without an
    // RDMA device (or in a build without RDMA) is a configuration the operator must
    // fix, said in one line naming what is missing.
    flame_common::transport::check_available(cfg.transport)
        .map_err(|message| StartError { message, status: 2 })?;
    // The keyring too: a missing, unreadable or world-readable key is the
    // operator's to fix.
    let creds = cfg
        .keyring
        .as_deref()
        .map(flame_common::auth::Credentials::load)
        .transpose()
        .map_err(|message| StartError { message, status: 2 })?;
    // And the manager's CA and address.
    let mgr_trust = cfg
        .mgr_tls_ca
        .as_deref()
        .map(flame_common::tls::MgrTrust::load)
        .transpose()
        .map_err(|message| StartError { message, status: 2 })?;
    let mgr_base = flame_common::http::mgr_base_url(&cfg.mgr, mgr_trust.is_some())
        .map_err(|message| StartError { message, status: 2 })?;
    // The service key (what checks HELLO tickets): derived from the shared `osd`
    // key here, or, for an OSD's own `osd.N` key, asked of the manager after
    // the boot (below).
    let mut service = match &creds {
        Some(c) if c.entity == flame_common::auth::EntityName::osd() => {
            tracing::warn!(
                "this OSD signs with the shared `osd` key, with which any holder may act \
                 as any OSD; give each OSD its own (`flame-admin auth add osd.N`)"
            );
            Some(flame_common::auth::ServiceKey::from_osd_key(
                &c.key,
                c.generation,
            ))
        }
        Some(c) if c.entity.is_osd() => None,
        Some(c) => {
            return Err(StartError {
                message: format!(
                    "keyring {} is {}'s; an OSD needs its own osd.N keyring \
                     (`flame-admin auth add osd.N --cluster-keyring … --out osd.N.keyring`)",
                    cfg.keyring
                        .as_deref()
                        .map_or_else(String::new, |p| p.display().to_string()),
                    c.entity
                ),
                status: 2,
            });
        }
        None => {
            tracing::warn!(
                "no keyring: this OSD takes connections from anyone who can reach its ports (auth: none)"
            );
            None
        }
    };
    let own_key_of = creds.as_ref().and_then(|c| c.entity.osd_id());
    let cfg = Arc::new(cfg);
    raise_open_file_limit();
    // The objects are the volumes' bytes: only this daemon's user may reach
    // them (0700, repaired with a warning; files 0600 by the umask).
    flame_common::private_dir::open_logged(&cfg.data_dir, "data_dir")?;
    let identity = control::Identity::load_or_create(&cfg.data_dir)?;
    store::layout::open_data_dir(&cfg.data_dir, &identity.uuid, cfg.checksums)
        .map_err(|message| StartError { message, status: 2 })?;
    sync_data_fs(&cfg.data_dir)?;
    let direct_io =
        store::probe_direct_io(&cfg.data_dir, cfg.direct_io).map_err(|e| e.to_string())?;
    let shards = cfg.shard_count();
    let restart_doubt = Arc::new(recover_store(
        &cfg.data_dir,
        direct_io,
        usize::from(shards),
    )?);
    if cfg.poll_mode == flame_common::reactor::PollMode::Busy {
        // Measured (docs/benchmarks.md): with more spinning threads than cores,
        // latency rises 20-170x, because the thread that has the work waits for a
        // spinning one to be descheduled.
        tracing::warn!(
            shards,
            cores = flame_common::config::cores(),
            "poll_mode: busy spins every shard thread at 100% of a core; use it only when \
             every spinning thread on this machine (all daemons) has a core of its own"
        );
    }
    tracing::info!(uuid = %identity.uuid, shards, direct_io, data_dir = %cfg.data_dir.display(), "starting");

    let mut listeners = Vec::with_capacity(usize::from(shards));
    for i in 0..shards {
        let mut addr = cfg.listen;
        addr.set_port(cfg.listen.port() + i);
        let l = Listener::bind(cfg.transport, addr)
            .map_err(|e| format!("cannot listen on {addr} (shard {i}): {e}"))?;
        listeners.push(l);
    }
    crate::failpoints::setup_from_env().map_err(|message| StartError { message, status: 2 })?;
    let recovery = Arc::new(crate::recovery::RecoveryShared::default());
    let api = recovery.clone();
    let failpoint_routes = crate::failpoints::http_routes();
    // GET /v1/pgs[/{id}] (placement-group status), then the failpoint control.
    let routes: flame_common::metrics_server::ExtraRoutes =
        Arc::new(move |method: &str, url: &str, body: &str| {
            if method == "GET"
                && let Some(answer) = api.http(url)
            {
                return Some(answer);
            }
            failpoint_routes.as_ref().and_then(|f| f(method, url, body))
        });
    let metrics_addr = flame_common::metrics_server::serve(cfg.metrics_listen, Some(routes))
        .map_err(|e| format!("cannot serve metrics on {}: {e}", cfg.metrics_listen))?;

    let liveness = Arc::new(crate::liveness::Liveness::new(shards));
    let mut control = control::Control::new(
        cfg.clone(),
        identity,
        metrics_addr,
        liveness.clone(),
        creds,
        (mgr_base, mgr_trust.as_ref()),
    );
    if own_key_of.is_some() {
        // Before the boot, so a manager that refuses it (one with `auth:
        // none`, a removed key) stops this OSD as a configuration error
        // (status 2, which systemd does not restart) before it is marked up.
        service = Some(
            control
                .fetch_service_key(true)
                .map_err(|message| StartError { message, status: 2 })?,
        );
    }
    let (osd_id, map) = control.boot()?;
    tracing::info!(osd = %osd_id, epoch = %map.epoch, "registered with the manager");
    if let Some(own) = own_key_of
        && own != osd_id
    {
        // The manager refuses a boot signed with another OSD's key; this is
        // the hand-over's assertion.
        return Err(StartError {
            message: format!("the manager registered this OSD as {osd_id}, but its key is {own}'s"),
            status: 2,
        });
    }
    // One cell every shard reads; an OSD with its own key has it replaced when
    // the `osd` key is rotated (the control thread fetches the new one).
    let service = service.map(crate::service_key::ServiceKeys::new);
    if own_key_of.is_some() {
        control.follow_service_key(service.clone());
    }
    let map = Arc::new(ArcSwap::from_pointee(map));
    let wanted_epoch = Arc::new(std::sync::atomic::AtomicU64::new(0));

    let staged = cfg.threading == crate::config::Threading::Staged;
    let nets = usize::from(cfg.network_threads.max(1));
    let mut net_listeners: Vec<Vec<_>> = (0..nets).map(|_| Vec::new()).collect();
    let pool = Arc::new(
        flame_common::buffer::registered::PoolInstaller::new(&cfg.memory_pool, listeners.len())
            .map_err(|e| format!("cannot create the memory pool: {e}"))?,
    );
    for (i, listener) in listeners.into_iter().enumerate() {
        let intake = if staged {
            let q = Arc::new(crate::staged::Mailbox::new(
                crate::staged::REQUEST_QUEUE_LEN,
            ));
            net_listeners[i % nets].push((i as u16, listener, q.clone()));
            shard_thread::Intake::Queue(q)
        } else {
            shard_thread::Intake::Listener(listener)
        };
        shard_thread::spawn(shard_thread::ShardSetup {
            pool: pool.clone(),
            id: i as u16,
            osd: osd_id,
            intake,
            map: map.clone(),
            wanted_epoch: wanted_epoch.clone(),
            config: cfg.clone(),
            direct_io,
            recovery: recovery.clone(),
            liveness: liveness.clone(),
            restart_doubt: restart_doubt.clone(),
            service: service.clone(),
        })
        .map_err(|e| format!("cannot start shard {i}: {e}"))?;
    }
    if staged {
        tracing::info!(
            network_threads = nets,
            "threading: staged (for comparison only)"
        );
        for (index, listeners) in net_listeners.into_iter().enumerate() {
            if listeners.is_empty() {
                continue;
            }
            crate::staged::spawn_network_thread(crate::staged::NetSetup {
                index: index as u16,
                listeners,
                map: map.clone(),
                config: cfg.clone(),
                osd: osd_id,
                service: service.clone(),
            })
            .map_err(|e| format!("cannot start network thread {index}: {e}"))?;
        }
    }
    control.run(osd_id, map, wanted_epoch, recovery)
}
