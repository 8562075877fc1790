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
use flame_client::nbd::{MemoryExports, NbdConfig, Server};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

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
    if specs.is_empty() {
        // Cluster mode: exports are Flame volumes (FlameExports over
        // flame_client::Cluster/Volume). Wired in once the client library lands.
        eprintln!(
            "flame-nbd: serving cluster volumes is not available yet in this build; \
             use --memory NAME=SIZE for the in-memory test mode"
        );
        return ExitCode::from(2);
    }
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
        exports = specs.len(),
        "flame-nbd (memory mode) listening on {addr}"
    );
    // Tests and scripts read the bound address (useful with port 0) from stdout.
    println!("flame-nbd listening on {addr}");
    let _ = std::io::stdout().flush();
    let exports = MemoryExports::new(specs);
    match server.run(move |_| exports.clone()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flame-nbd: {e}");
            ExitCode::from(1)
        }
    }
}
