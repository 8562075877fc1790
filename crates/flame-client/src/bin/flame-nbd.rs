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
use flame_client::{ClientConfig, ClientError, Cluster};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

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
    let args = Args::parse();
    let config: NbdConfig = match flame_common::config::load(args.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("flame-nbd: {e}");
            return ExitCode::from(2);
        }
    };
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
        match connect_cluster(&config) {
            Ok(c) => Some(c),
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
            eprintln!("flame-nbd: cannot listen on {}: {e}", config.listen);
            return ExitCode::from(1);
        }
    };
    match flame_common::metrics::serve(config.metrics_listen) {
        Ok(a) => tracing::info!("metrics on http://{a}/metrics"),
        Err(e) => {
            eprintln!(
                "flame-nbd: cannot serve metrics on {}: {e}",
                config.metrics_listen
            );
            return ExitCode::from(1);
        }
    }
    let addr = server.local_addr();
    tracing::info!(
        threads = config.thread_count(),
        mode = if cluster.is_some() {
            "cluster"
        } else {
            "memory"
        },
        "flame-nbd listening on {addr}"
    );
    // Tests and scripts read the bound address (useful with port 0) from stdout.
    println!("flame-nbd listening on {addr}");
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

/// How long start-up keeps trying to reach the manager (it may be starting too).
const MGR_CONNECT_PATIENCE: Duration = Duration::from_secs(30);

/// Connects the client library to the cluster, retrying while the manager comes up.
fn connect_cluster(config: &NbdConfig) -> Result<Cluster, ClientError> {
    let client = ClientConfig {
        mgr: config.mgr.clone(),
        transport: config.transport,
        io_timeout_ms: config.io_timeout_ms,
        connect_timeout_ms: config.connect_timeout_ms,
        ..ClientConfig::default()
    };
    let deadline = Instant::now() + MGR_CONNECT_PATIENCE;
    loop {
        match Cluster::connect(client.clone()) {
            Ok(c) => return Ok(c),
            Err(e @ ClientError::InvalidArgument(_)) => return Err(e),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(e) => {
                tracing::warn!("manager at {} not reachable yet: {e}", config.mgr);
                std::thread::sleep(Duration::from_millis(500));
            }
        }
    }
}
