//! `flame-mgr`: the Flame manager daemon.
//!
//! Holds the cluster map (OSDs, pool, volumes, epoch) durably in
//! `data_dir/state.json`, registers OSDs and tracks their heartbeats, marks silent
//! OSDs down, and serves the map and the admin API over HTTP/JSON. It is off the
//! data path: clients and OSDs compute placement from the map themselves.
//!
//! Layout: [`config`] (YAML settings), [`state`] (the map and every rule on it, pure
//! logic), [`store`] (crash-safe `state.json`), [`shared`] (lock, persist-then-
//! publish), [`api`] (axum routes), [`failure`] (heartbeat grace), [`metrics`].

use flame_mgr::{api, config, failure, metrics, shared, state, store};

use clap::Parser;
use config::MgrConfig;
use state::{ClusterState, PersistedState};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;
use store::Store;
use tracing::{error, info, warn};

/// How long shutdown waits for open requests (e.g. map long-polls) before exiting.
/// Exiting early is safe: every acknowledged change is already on disk.
const SHUTDOWN_WAIT: Duration = Duration::from_secs(2);

/// Command line.
#[derive(Parser, Debug)]
#[command(
    name = "flame-mgr",
    version,
    about = "Flame manager: cluster map, OSD heartbeats, volumes, admin API"
)]
struct Args {
    /// YAML configuration file; without it every setting has its default.
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

fn main() -> ExitCode {
    let args = Args::parse();
    flame_common::logging::init();
    flame_common::logging::abort_on_panic();
    // Every file and directory the daemon creates is its user's alone
    // (docs/security.md, "Data at rest").
    flame_common::private_dir::restrict_umask();
    // A bad config is the operator's to fix, not a crash: one plain line on stderr
    // (no log prefix) and exit status 2, the same for all three daemons, so a
    // supervisor or script can tell it from a run-time failure (status 1).
    let config: MgrConfig = match flame_common::config::load(args.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("flame-mgr: {e}");
            return ExitCode::from(2);
        }
    };
    // An unreadable, world-readable or wrong keyring is a configuration error too.
    let verifier = match load_verifier(&config) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("flame-mgr: {e}");
            return ExitCode::from(2);
        }
    };
    // So are TLS files that are missing, open to others or do not match:
    // before anything is created.
    let tls = match config
        .tls
        .as_ref()
        .map(|t| flame_common::tls::server_config(&t.cert_file, &t.key_file))
        .transpose()
    {
        Ok(t) => t,
        Err(e) => {
            eprintln!("flame-mgr: {e}");
            return ExitCode::from(2);
        }
    };
    match run(config, verifier, tls) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("flame-mgr: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A random RFC 4122 version-4 uuid, the default cluster id.
fn generate_fsid() -> String {
    let mut b = rand::random::<u128>().to_be_bytes();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Loads the existing cluster from `store`, or creates (and persists) a new one.
fn load_or_create(config: &MgrConfig, store: &Store) -> Result<PersistedState, BoxError> {
    if let Some(state) = store.load()? {
        if let Some(fsid) = &config.fsid
            && *fsid != state.map.fsid
        {
            return Err(format!(
                "config fsid {fsid} does not match the cluster in {} (fsid {}): wrong data_dir?",
                store.state_path().display(),
                state.map.fsid
            )
            .into());
        }
        if config.pool != state.map.pool {
            warn!(
                "config pool {:?} differs from the cluster's {:?}; pool settings are fixed at creation, keeping the cluster's",
                config.pool, state.map.pool
            );
        }
        info!(
            "loaded cluster {} at map {} from {}: {} OSDs, {} volumes",
            state.map.fsid,
            state.map.epoch,
            store.state_path().display(),
            state.map.osds.len(),
            state.map.volumes.len()
        );
        return Ok(state);
    }
    let fsid = config.fsid.clone().unwrap_or_else(generate_fsid);
    config
        .pool
        .validate()
        .map_err(|(k, m)| format!("invalid {k}: {m}"))?;
    let state = PersistedState::new_cluster(fsid, config.pool.clone());
    // Persist before serving, so the fsid handed to OSDs is the one a restart sees.
    store.save(&state)?;
    info!(
        "created new cluster {} in {} (pool size {}, min_size {}, {} PGs, {} byte objects)",
        state.map.fsid,
        store.state_path().display(),
        state.map.pool.size,
        state.map.pool.min_size,
        state.map.pool.pg_count,
        state.map.pool.object_size
    );
    Ok(state)
}

/// The request verifier of `auth: required` (the cluster keyring loaded and
/// checked), `None` with `auth: none`. Done before the data directory is touched,
/// so a bad keyring never creates a cluster.
fn load_verifier(config: &MgrConfig) -> Result<Option<flame_mgr::auth::Verifier>, BoxError> {
    let path = match (config.auth, &config.keyring) {
        (config::AuthMode::None, _) => return Ok(None),
        (config::AuthMode::Required, None) => {
            return Err("auth: required needs `keyring:` (flame-admin auth init --dir DIR)".into());
        }
        (config::AuthMode::Required, Some(path)) => path,
    };
    let keyring = flame_common::auth::Keyring::load(path)?;
    if keyring.entity != flame_common::auth::KeyringEntity::Cluster {
        return Err(format!(
            "keyring {} is an entity's key, not the cluster secret; give the \
             cluster.keyring that `flame-admin auth init` wrote",
            path.display()
        )
        .into());
    }
    Ok(Some(flame_mgr::auth::Verifier::new(keyring.key)))
}

fn run(
    config: MgrConfig,
    verifier: Option<flame_mgr::auth::Verifier>,
    tls: Option<std::sync::Arc<rustls::ServerConfig>>,
) -> Result<(), BoxError> {
    let store = Store::open(&config.data_dir)?;
    let persisted = load_or_create(&config, &store)?;
    let metrics = metrics::Metrics::new()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("flame-mgr")
        .build()?;
    runtime.block_on(serve(config, store, persisted, metrics, (verifier, tls)))
}

async fn serve(
    config: MgrConfig,
    store: Store,
    persisted: PersistedState,
    metrics: metrics::Metrics,
    (verifier, tls): (
        Option<flame_mgr::auth::Verifier>,
        Option<std::sync::Arc<rustls::ServerConfig>>,
    ),
) -> Result<(), BoxError> {
    let fsid = persisted.map.fsid.clone();
    // Start time counts as every OSD's last heartbeat: they get a full grace period
    // to find the restarted manager.
    let mut cluster_state = ClusterState::new(persisted, flame_common::clock::now());
    cluster_state.min_down_reporters = config.min_down_reporters;
    cluster_state.heartbeat_grace = Duration::from_millis(config.heartbeat_grace_ms);
    cluster_state.report_min_silence = Duration::from_millis(config.failure_report_min_silence_ms);
    cluster_state.full_ratios = state::FullRatios {
        nearfull: config.nearfull_ratio,
        full: config.full_ratio,
    };
    if verifier.is_none() {
        warn!(
            "authentication is OFF (auth: none): anyone who can reach {} can change or \
             delete everything",
            config.listen
        );
        cluster_state.auth_disabled = true;
    }
    if tls.is_none() {
        info!("the API serves plain HTTP (no `tls:`): requests are signed, not private");
    }
    let shared = shared::Shared::new(
        store,
        cluster_state,
        metrics,
        verifier,
        Duration::from_millis(config.header_read_timeout_ms),
    );
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", config.listen))?;
    let addr = listener.local_addr()?;
    // Tests and scripts parse this line to find a port-0 listener.
    let scheme = if tls.is_some() { "https" } else { "http" };
    info!("flame-mgr listening on {scheme}://{addr} (cluster {fsid})");

    tokio::spawn(failure::run(
        std::sync::Arc::clone(&shared),
        failure::Timing {
            grace: Duration::from_millis(config.heartbeat_grace_ms),
            interval: Duration::from_millis(config.failure_check_interval_ms),
            down_out: Duration::from_millis(config.down_out_interval_ms),
        },
    ));

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = stop_tx.send(true);
    });
    flame_mgr::server::run(
        listener,
        api::router(shared),
        flame_mgr::server::Limits {
            connections_max: config.connections_max as usize,
            connections_per_source_max: config.connections_per_source_max as usize,
            header_read_timeout: Duration::from_millis(config.header_read_timeout_ms),
            idle_timeout: Duration::from_millis(config.idle_timeout_ms),
            shutdown_wait: SHUTDOWN_WAIT,
        },
        tls,
        stop_rx,
    )
    .await;
    info!("flame-mgr stopped");
    Ok(())
}

/// Resolves on SIGINT or SIGTERM. If the handlers cannot be installed, never
/// resolves (the process is then stopped by SIGKILL, which is safe).
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (mut term, mut int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(t), Ok(i)) => (t, i),
        (Err(e), _) | (_, Err(e)) => {
            warn!("cannot install signal handlers ({e}); stop with SIGKILL");
            return std::future::pending().await;
        }
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM: shutting down"),
        _ = int.recv() => info!("SIGINT: shutting down"),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn fsid_is_a_v4_uuid() {
        let a = super::generate_fsid();
        assert_eq!(a.len(), 36);
        assert_eq!(&a[14..15], "4");
        assert!(crate::config::validate_fsid(&a).is_ok());
        assert_ne!(a, super::generate_fsid());
    }
}
