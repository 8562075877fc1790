//! `flame-nbd`: serves Flame volumes over NBD (export name = volume name).
//!
//! ```text
//! flame-nbd --config /etc/flame/nbd.yaml
//! flame-nbd --config nbd.yaml --memory disk=1G --memory ro=64M:ro
//! ```
//!
//! `--memory NAME=SIZE[:ro]` is a test and benchmark mode: it serves in-process,
//! non-persistent exports and does not contact a cluster. Without it, exports are
//! the cluster's volumes.

use clap::Parser;
use flame_client::nbd::{FlameExports, MemoryExports, NbdConfig, Server};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Command line of flame-nbd.
#[derive(Parser, Debug)]
#[command(name = "flame-nbd", about = "NBD server for Flame volumes")]
struct Args {
    /// YAML configuration file (defaults for every key if omitted).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Serve an in-memory export NAME of SIZE bytes (suffix K/M/G/T; `:ro` for
    /// read-only) instead of cluster volumes. Test/benchmark mode: nothing persists.
    #[arg(long, value_name = "NAME=SIZE[:ro]")]
    memory: Vec<String>,
}

fn main() -> ExitCode {
    flame_common::logging::init();
    flame_common::logging::abort_on_panic();
    // The Unix socket export is created with no access for group and others
    // before its configured mode is set: never open to others in between.
    flame_common::private_dir::restrict_umask();
    // Before any thread exists, so every thread inherits the mask and SIGTERM/SIGINT
    // reach only the thread that waits for them.
    let signals = flame_client::bridge::block_stop_signals();
    let args = Args::parse();
    let config: NbdConfig = match flame_common::config::load(args.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("flame-nbd: {e}");
            return ExitCode::from(2);
        }
    };
    // `transport: rdma` without a device (or in a build without RDMA) is a
    // configuration error, named before anything starts.
    if let Err(e) = flame_common::transport::check_available(config.transport) {
        eprintln!("flame-nbd: {e}");
        return ExitCode::from(2);
    }
    let mut specs = Vec::new();
    for m in &args.memory {
        match MemoryExports::parse_spec(m) {
            Ok(s) => specs.push(s),
            Err(e) => {
                eprintln!("flame-nbd: {e}");
                return ExitCode::from(2);
            }
        }
    }
    // Cluster mode connects to the manager before listening, so a client that can
    // connect can also open volumes.
    let cluster = if specs.is_empty() {
        match flame_client::bridge::connect_cluster(config.client_config()) {
            Ok(c) => Some(c),
            // A keyring or CA that cannot be used, a bad manager address: the
            // operator's to fix, as a bad config is.
            Err(flame_client::ClientError::InvalidArgument(e)) => {
                eprintln!("flame-nbd: {e}");
                return ExitCode::from(2);
            }
            Err(e) => {
                eprintln!("flame-nbd: cannot reach the cluster at {}: {e}", config.mgr);
                return ExitCode::from(1);
            }
        }
    } else {
        None
    };
    let server = match Server::bind(config.clone()) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("flame-nbd: cannot serve: {e}");
            return ExitCode::from(1);
        }
    };
    match flame_common::metrics_server::serve(config.metrics_listen, None) {
        Ok(a) => tracing::info!("metrics on http://{a}/metrics"),
        Err(e) => {
            eprintln!(
                "flame-nbd: cannot serve metrics on {}: {e}",
                config.metrics_listen
            );
            return ExitCode::from(1);
        }
    }
    let addr = server.endpoints();
    if server.local_addr().is_some() && config.tls.is_none() {
        tracing::warn!(
            "tcp_without_tls: the TCP export is served in clear to anyone who reaches it, \
             every volume, read and write"
        );
    }
    tracing::info!(
        threads = config.thread_count(),
        mode = if cluster.is_some() {
            "cluster"
        } else {
            "memory"
        },
        "flame-nbd listening on {addr}"
    );
    if let Some(set) = signals {
        let conns = server.connections();
        let spawned = std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || drain_on_signal(set, conns));
        if let Err(e) = spawned {
            tracing::warn!("no graceful shutdown: cannot start the signal thread: {e}");
        }
    }
    // Tests and scripts read the bound address (useful with port 0) from stdout:
    // the TCP address first, when there is one, then the Unix socket.
    if let Some(tcp) = server.local_addr() {
        println!("flame-nbd listening on {tcp}");
    }
    if let Some(u) = &config.unix {
        println!("flame-nbd listening on unix:{}", u.path.display());
    }
    let _ = std::io::stdout().flush();
    let result = match cluster {
        Some(cluster) => server.run(move |_| FlameExports::new(cluster.clone())),
        None => {
            let exports = MemoryExports::new(specs);
            server.run(move |_| exports.clone())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flame-nbd: {e}");
            ExitCode::from(1)
        }
    }
}

/// How long a graceful shutdown waits for clients to disconnect.
const DRAIN_MAX: Duration = Duration::from_secs(10);

/// Waits for SIGTERM/SIGINT, then shuts down gracefully: no new connections, new
/// requests answered ESHUTDOWN (clients disconnect), requests in flight completed;
/// exits once every client is gone or after [`DRAIN_MAX`]. A second signal exits at
/// once.
fn drain_on_signal(set: libc::sigset_t, conns: std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let mut sig: libc::c_int = 0;
    // SAFETY: sigwait on a valid, blocked set.
    if unsafe { libc::sigwait(&set, &mut sig) } != 0 {
        return;
    }
    tracing::info!(
        signal = sig,
        "stopping: refusing new requests with ESHUTDOWN, finishing those in flight"
    );
    flame_client::nbd::shutdown::begin_shutdown();
    let conns2 = conns.clone();
    std::thread::spawn(move || {
        let mut again: libc::c_int = 0;
        // SAFETY: as above.
        if unsafe { libc::sigwait(&set, &mut again) } == 0 {
            tracing::warn!(
                open = conns2.load(std::sync::atomic::Ordering::SeqCst),
                "second signal: exiting now"
            );
            std::process::exit(1);
        }
    });
    let deadline = flame_common::clock::now() + DRAIN_MAX;
    while conns.load(std::sync::atomic::Ordering::SeqCst) > 0
        && flame_common::clock::now() < deadline
    {
        flame_common::clock::sleep_blocking(Duration::from_millis(20));
    }
    let left = conns.load(std::sync::atomic::Ordering::SeqCst);
    tracing::info!(connections_left = left, "stopped");
    std::process::exit(0);
}
