//! `flame-ublk`: exports a Flame volume as a Linux block device, `/dev/ublkbN`,
//! through ublk (the kernel's `ublk_drv`, Linux 6.0+; root).
//!
//! ```text
//! flame-ublk --config /etc/flame/ublk.yaml --volume demo       # add /dev/ublkbN
//! flame-ublk --config ublk.yaml --volume demo --recover 0      # after a crash: take over /dev/ublkb0
//! flame-ublk --config ublk.yaml --volume demo --device 0       # either: what a service manager runs
//! ```
//!
//! The device is created with user recovery: if this process dies, the kernel
//! keeps `/dev/ublkbN` and holds its I/O; `--recover N` (same volume) reattaches
//! a new process and the requests in flight are issued again. SIGTERM or SIGINT
//! stops and deletes the device.

use clap::Parser;
use flame_client::ublk::{Mode, UblkConfig};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// Command line of flame-ublk; the flags override the configuration's keys.
#[derive(Parser, Debug)]
#[command(name = "flame-ublk", about = "ublk block device for a Flame volume")]
struct Args {
    /// YAML configuration file (defaults for every key if omitted).
    #[arg(long)]
    config: Option<PathBuf>,
    /// The volume to export (the configuration's `volume`).
    #[arg(long)]
    volume: Option<String>,
    /// Queues, one thread each (the configuration's `queues`).
    #[arg(long)]
    queues: Option<u16>,
    /// Requests in flight per queue (the configuration's `queue_depth`).
    #[arg(long)]
    queue_depth: Option<u16>,
    /// Device number to create, /dev/ublkbN (the configuration's `dev_id`).
    #[arg(long, conflicts_with = "recover")]
    dev_id: Option<i32>,
    /// Take over device N, left by a flame-ublk that died, instead of adding one
    /// (its queue count and depth are the device's).
    #[arg(long, value_name = "N")]
    recover: Option<u32>,
    /// Device N whichever way it is: added if the kernel has no device N, taken
    /// over if it holds one whose flame-ublk died, refused (exit 2) if another
    /// live process serves it. What a service manager restarting flame-ublk
    /// runs (deploy/systemd/flame-ublk@.service).
    #[arg(long, value_name = "N", conflicts_with_all = ["recover", "dev_id"])]
    device: Option<u32>,
}

fn main() -> ExitCode {
    flame_common::logging::init();
    flame_common::logging::abort_on_panic();
    // Before any thread exists: only the control thread sees SIGTERM/SIGINT.
    let signals = flame_client::bridge::block_stop_signals();
    let args = Args::parse();
    let mut config: UblkConfig = match flame_common::config::load(args.config.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("flame-ublk: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(v) = args.volume {
        config.volume = v;
    }
    if let Some(q) = args.queues {
        config.queues = q;
    }
    if let Some(d) = args.queue_depth {
        config.queue_depth = d;
    }
    if let Some(id) = args.dev_id {
        config.dev_id = id;
    }
    if let Some(id) = args.device {
        match i32::try_from(id) {
            Ok(id) => config.dev_id = id,
            Err(_) => {
                eprintln!("flame-ublk: invalid --device {id}");
                return ExitCode::from(2);
            }
        }
    }
    // The flags are checked like the file's keys.
    if let Err((key, msg)) = flame_common::config::Validate::validate(&config) {
        eprintln!("flame-ublk: invalid {key}: {msg}");
        return ExitCode::from(2);
    }
    if config.volume.is_empty() {
        eprintln!("flame-ublk: no volume: give --volume NAME or `volume:` in the configuration");
        return ExitCode::from(2);
    }
    if let Err(e) = flame_common::transport::check_available(config.transport) {
        eprintln!("flame-ublk: {e}");
        return ExitCode::from(2);
    }
    // Before the cluster (whose connection retries for 30 s): the first thing a
    // host without the driver gets wrong.
    if !std::path::Path::new("/dev/ublk-control").exists() {
        eprintln!(
            "flame-ublk: /dev/ublk-control does not exist: load the ublk driver (modprobe ublk_drv; Linux 6.0 or later)"
        );
        return ExitCode::from(1);
    }
    // Before the cluster and the metrics port: a device another process serves
    // is refused at once.
    let mode = match (args.recover, args.device) {
        (Some(id), _) => Mode::Recover(id),
        (None, Some(id)) => {
            let found = match flame_client::ublk::probe_device(id) {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("flame-ublk: {e}");
                    return ExitCode::from(1);
                }
            };
            match Mode::for_device(id, found) {
                Ok(m) => m,
                Err(e) => {
                    // Not restartable into: a service manager must not loop on it.
                    eprintln!("flame-ublk: {e}");
                    return ExitCode::from(2);
                }
            }
        }
        (None, None) => Mode::Add,
    };
    let cluster = match flame_client::bridge::connect_cluster(config.client_config()) {
        Ok(c) => c,
        // A keyring or CA that cannot be used, a bad manager address: the
        // operator's to fix, as a bad config is.
        Err(flame_client::ClientError::InvalidArgument(e)) => {
            eprintln!("flame-ublk: {e}");
            return ExitCode::from(2);
        }
        Err(e) => {
            eprintln!(
                "flame-ublk: cannot reach the cluster at {}: {e}",
                config.mgr
            );
            return ExitCode::from(1);
        }
    };
    match flame_common::metrics_server::serve(config.metrics_listen, None) {
        Ok(a) => tracing::info!("metrics on http://{a}/metrics"),
        Err(e) => {
            eprintln!(
                "flame-ublk: cannot serve metrics on {}: {e}",
                config.metrics_listen
            );
            return ExitCode::from(1);
        }
    }
    let volume = config.volume.clone();
    let result = flame_client::ublk::run(&config, mode, cluster, signals, |path, id| {
        let how = if matches!(mode, Mode::Recover(_)) {
            "recovered"
        } else {
            "ready"
        };
        tracing::info!("{path} {how}: volume {volume}");
        // Scripts wait for this line on stdout.
        println!("flame-ublk: {path} {how} (volume {volume}, dev_id {id})");
        let _ = std::io::stdout().flush();
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flame-ublk: {e}");
            ExitCode::from(1)
        }
    }
}
