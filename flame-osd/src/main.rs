//! `flame-osd`: stores objects and replicates writes. The daemon lives in the
//! `flame_osd` library (start at `daemon::run`), so its modules can be tested from
//! inside and from `tests/`.

use clap::Parser;
use std::path::PathBuf;

/// Flame object storage daemon.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Args {
    /// YAML configuration file (every key optional; see docs/configuration.md).
    #[arg(long)]
    config: Option<PathBuf>,
}

fn main() {
    flame_common::logging::init();
    flame_common::logging::abort_on_panic();
    // Every file and directory the daemon creates is its user's alone
    // (docs/security.md, "Data at rest").
    flame_common::private_dir::restrict_umask();
    let args = Args::parse();
    // A bad config: one plain line on stderr and exit status 2, as flame-mgr and
    // flame-nbd do (status 1 stays for run-time failures).
    let cfg: flame_osd::config::OsdConfig = match flame_common::config::load(args.config.as_deref())
    {
        Ok(c) => c,
        Err(e) => {
            eprintln!("flame-osd: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = flame_osd::daemon::run_with(cfg) {
        tracing::error!("{e}");
        eprintln!("flame-osd: {e}");
        std::process::exit(e.status);
    }
}
