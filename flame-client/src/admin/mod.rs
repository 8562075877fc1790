//! `flame-admin`: the cluster's command-line tool.
//!
//! Admin commands talk to the manager's HTTP API ([`MgrClient`]); the two that need
//! the OSDs — `volume rm` (delete the objects) and `bench` — also connect a
//! [`Cluster`] and run the data path on a reactor on the main thread. Every command
//! prints an aligned table (or `key value` lines) by default and the same data as
//! JSON with `--json`, so scripts never parse the human format.

pub mod auth;
pub mod format;
pub mod pg;
pub mod scrub;
pub mod size;
pub mod tls;
pub mod watch;

use crate::bench::{self, BenchConfig, BenchReport, Pattern};
use crate::{ClientConfig, ClientError, Cluster, MgrClient};
use clap::{Parser, Subcommand};
use flame_common::ids::{ObjectId, OsdId, PgId, VolumeId};
use flame_common::map::VOLUME_SIZE_MAX;
use flame_common::map::{ClusterMap, VolumeInfo};
use flame_common::mgr_api::{ClusterStatus, format_size};
use flame_common::placement;
use flame_common::reactor::{Reactor, ReactorConfig};
use format::{fields, table, utc_time};
use serde::Serialize;
use std::io::Write;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

/// Command line of flame-admin.
#[derive(Parser, Debug)]
#[command(
    name = "flame-admin",
    version,
    about = "Administer a Flame cluster: status, OSDs, volumes, placement, benchmarks",
    after_help = "Sizes use binary units only: K/KiB = 1024, M/MiB, G/GiB, T/TiB, P/PiB \
                  (1.5G is exact; GB, MB... are refused).\n\
                  Exit status: 0 ok, 1 the command failed, 2 bad command line. With --json, \
                  errors are {\"error\": \"...\"} on stdout.\n\
                  A dev cluster started with --port-base: `source DIR/env` sets FLAME_MGR."
)]
pub struct Cli {
    /// Manager address (HOST:PORT, http://HOST:PORT or https://HOST:PORT).
    #[arg(
        long,
        global = true,
        env = "FLAME_MGR",
        default_value = "127.0.0.1:6800"
    )]
    pub mgr: String,
    /// Keyring to sign requests with (`client.admin.keyring` from `auth init`, or
    /// another entity's). Default: `/etc/flame/keys/client.admin.keyring` if it
    /// exists (the documented place); none only against a manager with
    /// `auth: none`.
    #[arg(long, global = true, env = "FLAME_KEYRING")]
    pub keyring: Option<std::path::PathBuf>,
    /// The cluster CA (`tls init`'s ca.crt) when the manager serves TLS: its
    /// certificate is verified against this CA only. Default:
    /// `/etc/flame/tls/ca.crt` if it exists, unless --mgr says `http://`.
    #[arg(long, global = true, env = "FLAME_MGR_CA")]
    pub mgr_ca: Option<std::path::PathBuf>,
    /// Print JSON instead of tables. Errors too: `{"error": "..."}` on stdout (nothing
    /// on stderr), exit status 1 (2 for a bad command line).
    #[arg(long, global = true)]
    pub json: bool,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level commands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Cluster health, map epoch, OSDs, volumes, capacity, placement-group states
    /// and recovery progress (`--watch` to follow it).
    Status(StatusArgs),
    /// OSD commands.
    #[command(subcommand)]
    Osd(OsdCommand),
    /// Volume commands.
    #[command(subcommand)]
    Volume(VolumeCommand),
    /// Placement-group commands: states, roles, log bounds.
    #[command(subcommand)]
    Pg(PgCommand),
    /// Which object, placement group and OSDs hold a byte of a volume.
    Locate {
        /// Volume name.
        volume: String,
        /// Byte offset (binary units: K = 1024, M, G, ...; `GB` etc. are refused).
        #[arg(value_parser = size_arg)]
        offset: u64,
    },
    /// Benchmark a volume through the client library.
    Bench(BenchArgs),
    /// Compare every copy of placement groups block by block and repair copies
    /// that differ from the agreeing majority: `scrub` (all), `scrub VOLUME`,
    /// `scrub pg ID`. `--dry-run` only compares.
    Scrub(scrub::ScrubArgs),
    /// Keys and entities: `auth init --dir DIR` (a new cluster's keyrings), `ls`,
    /// `add client.NAME`, `rotate`, `rm`, `key` (write an entity's keyring).
    #[command(subcommand)]
    Auth(auth::AuthCommand),
    /// TLS on the manager's API: `tls init --dir DIR --name ADDR` (the
    /// cluster's CA and the manager's certificate).
    #[command(subcommand)]
    Tls(tls::TlsCommand),
}

/// `flame-admin status ...`
#[derive(clap::Args, Debug, Default)]
pub struct StatusArgs {
    /// Redraw the status every interval: on a terminal the screen is cleared and a
    /// recovery progress bar drawn; otherwise one line per interval (with --json,
    /// one JSON object per line).
    #[arg(long)]
    pub watch: bool,
    /// Milliseconds between redraws with --watch.
    #[arg(
        long,
        default_value_t = 1000,
        value_parser = clap::value_parser!(u64)
            .range(watch::WATCH_INTERVAL_MS_MIN..=watch::WATCH_INTERVAL_MS_MAX)
    )]
    pub interval_ms: u64,
    /// With --watch: stop after this many redraws (default: until interrupted).
    #[arg(long, requires = "watch", value_parser = clap::value_parser!(u64).range(1..))]
    pub count: Option<u64>,
}

/// `flame-admin pg ...`
#[derive(Subcommand, Debug)]
pub enum PgCommand {
    /// List placement groups with their state, primary, acting set, recovering
    /// members, placement and down complete copies.
    Ls {
        /// Only groups with these state flags: one of active, inactive, clean,
        /// recovering, remapped, degraded, incomplete, or several joined by +
        /// (active+degraded).
        #[arg(long, value_parser = state_filter_arg)]
        state: Option<String>,
    },
    /// One placement group, with the log bounds its primary reports.
    Info {
        /// Placement group number (12 or pg.12).
        #[arg(value_parser = pg::parse_pg)]
        id: PgId,
    },
    /// Whether all acting copies of placement groups are identical (`pg compare`,
    /// `pg compare VOLUME`, `pg compare pg ID`); exit status 1 if any differ.
    Compare {
        /// Nothing: every group; `VOLUME`; or `pg ID`.
        #[arg(num_args = 0..=2)]
        what: Vec<String>,
    },
}

fn state_filter_arg(s: &str) -> std::result::Result<String, String> {
    flame_common::pg_state::validate_state_filter(s)?;
    Ok(s.to_string())
}

/// `flame-admin osd ...`
#[derive(Subcommand, Debug)]
pub enum OsdCommand {
    /// List OSDs.
    Ls,
    /// Take an OSD out of placement: its placement groups move to other OSDs and
    /// are recovered there; its copies serve until the new ones are complete.
    Out {
        /// OSD id (`3` or `osd.3`).
        #[arg(value_parser = osd_id_arg)]
        id: OsdId,
    },
    /// Put an OSD back into placement (it gets its share of placement groups,
    /// recovered onto it).
    In {
        /// OSD id (`3` or `osd.3`).
        #[arg(value_parser = osd_id_arg)]
        id: OsdId,
    },
    /// Remove a down OSD from the cluster for good (refused while it is up).
    /// Placement groups whose only complete copy it held lose their data: the
    /// command says which.
    Rm {
        /// OSD id (`3` or `osd.3`).
        #[arg(value_parser = osd_id_arg)]
        id: OsdId,
    },
    /// Set an OSD's placement weight: its share of placement groups relative to
    /// the others (0 moves all of them away). Data moves and is recovered.
    Reweight {
        /// OSD id (`3` or `osd.3`).
        #[arg(value_parser = osd_id_arg)]
        id: OsdId,
        /// New weight, 0 to 100.
        #[arg(value_parser = weight_arg)]
        weight: f64,
    },
}

/// An OSD id: `3` or `osd.3`.
fn osd_id_arg(s: &str) -> std::result::Result<OsdId, String> {
    let digits = s.strip_prefix("osd.").unwrap_or(s);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("`{s}` is not an OSD id (expected e.g. 3 or osd.3)"));
    }
    digits
        .parse::<u32>()
        .map(OsdId)
        .map_err(|_| format!("`{s}` is not an OSD id (too large)"))
}

/// An OSD weight: a finite number in `0..=OSD_WEIGHT_MAX`.
fn weight_arg(s: &str) -> std::result::Result<f64, String> {
    let max = flame_common::mgr_api::OSD_WEIGHT_MAX;
    match s.parse::<f64>() {
        Ok(w) if w.is_finite() && (0.0..=max).contains(&w) => Ok(w),
        _ => Err(format!("`{s}` is not a weight from 0 to {max}")),
    }
}

/// `flame-admin volume ...`
#[derive(Subcommand, Debug)]
pub enum VolumeCommand {
    /// Create a thin-provisioned volume.
    Create {
        /// Volume name (flame-nbd exports it under this name; flame-ublk takes it as `--volume`).
        name: String,
        /// Size, e.g. 10G or 1.5GiB: a multiple of 512 bytes, at most 1 PiB. Units are
        /// binary (K/KiB = 1024, M/MiB, G/GiB, T/TiB, P/PiB); fractions are accepted
        /// when they come to whole bytes; decimal units (KB, MB, GB) are refused.
        #[arg(long, value_parser = volume_size_arg)]
        size: u64,
    },
    /// List volumes.
    Ls,
    /// Show one volume.
    Info {
        /// Volume name.
        name: String,
    },
    /// Grow (or, with --allow-shrink, shrink) a volume.
    Resize {
        /// Volume name.
        name: String,
        /// New size, e.g. 20G: a multiple of 512 bytes, at most 1 PiB, binary units
        /// as for `volume create`.
        #[arg(long, value_parser = volume_size_arg)]
        size: u64,
        /// Allow making the volume smaller (data past the new end is lost).
        #[arg(long)]
        allow_shrink: bool,
    },
    /// Remove a volume and delete its objects on every OSD (those down delete theirs
    /// when they are back).
    Rm {
        /// Volume name.
        name: String,
    },
}

/// `flame-admin bench ...`
#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    /// Volume name.
    pub volume: String,
    /// Access pattern.
    #[arg(long, value_enum, default_value = "randread")]
    pub rw: Pattern,
    /// Bytes per I/O (binary units: 4k = 4096, 1M = 1048576).
    #[arg(long, value_parser = size_arg, default_value = "4k")]
    pub bs: u64,
    /// Concurrent I/Os.
    #[arg(long, default_value_t = 32)]
    pub iodepth: usize,
    /// How long to run (e.g. 10s, 500ms, 1m).
    #[arg(long, value_parser = duration_arg, default_value = "10s")]
    pub runtime: Duration,
    /// Only use the first BYTES of the volume (binary units, e.g. 1G).
    #[arg(long, value_parser = size_arg)]
    pub size_limit: Option<u64>,
    /// Seed for random offsets and written data.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Let a write benchmark (`--rw write` or `randwrite`) overwrite a volume that
    /// holds data. Without it, flame-admin first reads a sample of the region
    /// (its first and last MiB and the first 4 KiB of up to 1024 objects) and
    /// refuses if any byte is non-zero. The sample catches any partitioned or
    /// formatted volume but not data written only elsewhere.
    #[arg(long)]
    pub force_overwrite: bool,
    /// How data travels: inline, or convert (read-write conversion at or above
    /// the transport's threshold; the default, as in the client library).
    #[arg(long, value_enum, default_value = "convert")]
    pub transfer_mode: crate::config::TransferMode,
    /// Smallest converted I/O (binary units), on every transport; default: the
    /// client library's per-transport default.
    #[arg(long, value_parser = size_arg)]
    pub convert_threshold: Option<u64>,
    /// How replies come back: push, or fetch (remote fetching; shm/rdma only).
    #[arg(long, value_enum, default_value = "push")]
    pub reply_mode: crate::config::ReplyMode,
    /// Allow `--reply-mode fetch` over tcp's emulated one-sided READ (to measure
    /// what fetching costs there; the OSDs need `reply_area_over_emulated: true`).
    #[arg(long)]
    pub fetch_over_emulated: bool,
    /// Transport to the OSDs: `tcp`, or `shm` (shared memory to OSDs on this host
    /// that listen with `transport: shm`; tcp to the others).
    #[arg(long, value_parser = transport_arg, default_value = "tcp")]
    pub transport: flame_common::transport::TransportKind,
}

fn transport_arg(s: &str) -> std::result::Result<flame_common::transport::TransportKind, String> {
    use flame_common::transport::TransportKind;
    match s {
        "tcp" => Ok(TransportKind::Tcp),
        "shm" => Ok(TransportKind::Shm),
        _ => Err(format!("unknown transport `{s}`: expected tcp or shm")),
    }
}

fn size_arg(s: &str) -> std::result::Result<u64, String> {
    size::parse_size(s)
}

/// A volume size: binary units, a whole number of 512-byte sectors (the manager's
/// rule, checked here so the message can name the nearest valid sizes), at most
/// [`VOLUME_SIZE_MAX`].
fn volume_size_arg(s: &str) -> std::result::Result<u64, String> {
    let bytes = size::parse_size(s)?;
    size::check_max("a volume", bytes, VOLUME_SIZE_MAX)?;
    size::check_multiple("a volume's size", bytes, VOLUME_SECTOR_BYTES)?;
    Ok(bytes)
}

/// Volumes are whole 512-byte sectors (the manager refuses anything else).
const VOLUME_SECTOR_BYTES: u64 = 512;

fn duration_arg(s: &str) -> std::result::Result<Duration, String> {
    format::parse_duration(s)
}

/// An error for the user: one line on stderr, exit code 1.
#[derive(Debug)]
pub struct AdminError(pub String);

impl std::fmt::Display for AdminError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<ClientError> for AdminError {
    fn from(e: ClientError) -> Self {
        AdminError(e.to_string())
    }
}

type Result<T> = std::result::Result<T, AdminError>;

/// Parses the process arguments, runs the command and returns the exit code:
/// 0 on success, 1 on any error, 2 on a usage error. The error message is one line
/// on stderr, or with `--json` an [`ErrorJson`] object on stdout, so a script that
/// parses stdout always gets JSON.
pub fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // Known before parsing, so a usage error can be JSON too.
    let wants_json = args.iter().any(|a| a == "--json");
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let cli = match Cli::try_parse_from(&args) {
        Ok(c) => c,
        Err(e) => {
            // --help and --version are "errors" that print to stdout and succeed.
            if !e.use_stderr() {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            if wants_json {
                let message = e.kind().to_string();
                let detail = e.render().to_string();
                let _ = write_error_json(&mut out, &first_error_line(&detail, &message));
            } else {
                let _ = e.print();
            }
            return ExitCode::from(2);
        }
    };
    match execute(&cli, &mut out) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if cli.json {
                let _ = write_error_json(&mut out, &e.0);
            } else {
                let _ = out.flush();
                eprintln!("flame-admin: error: {e}");
            }
            ExitCode::from(1)
        }
    }
}

/// What flame-admin prints on stdout for a failed command under `--json`.
#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct ErrorJson {
    /// The message the table mode prints after `flame-admin: error:`.
    pub error: String,
}

fn write_error_json(out: &mut dyn Write, message: &str) -> std::io::Result<()> {
    let body = serde_json::to_string_pretty(&ErrorJson {
        error: message.to_string(),
    })
    .unwrap_or_else(|_| String::from("{\"error\": \"unprintable error\"}"));
    writeln!(out, "{body}")?;
    out.flush()
}

/// The `error: ...` line of a rendered clap error, without the prefix (clap's full
/// rendering adds usage and tips over several lines).
fn first_error_line(rendered: &str, fallback: &str) -> String {
    rendered
        .lines()
        .find_map(|l| l.strip_prefix("error: "))
        .map_or_else(|| fallback.to_string(), str::to_string)
}

/// Runs one parsed command, writing its output to `out`.
pub fn execute(cli: &Cli, out: &mut dyn Write) -> Result<()> {
    let text = match &cli.command {
        // Offline: the manager cannot start before its keyring exists.
        Command::Auth(auth::AuthCommand::Init { dir }) => Some(auth::init(dir, cli.json)?),
        Command::Tls(t) => Some(tls::init(t, cli.json)?),
        _ => None,
    };
    let text = match text {
        Some(t) => t,
        None => command(
            cli,
            &admin_client_config(cli).mgr_client()?,
            &cli.command,
            out,
        )?,
    };
    out.write_all(text.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| AdminError(format!("writing output: {e}")))
}

/// Runs a command that talks to the manager; `None`-output commands (watch) wrote
/// already.
fn command(cli: &Cli, mgr: &MgrClient, cmd: &Command, out: &mut dyn Write) -> Result<String> {
    let mgr = mgr.clone();
    let text = match cmd {
        Command::Status(args) if args.watch => {
            let mode = if cli.json {
                watch::WatchMode::Json
            } else if std::io::IsTerminal::is_terminal(&std::io::stdout()) {
                watch::WatchMode::Terminal
            } else {
                watch::WatchMode::Lines
            };
            let opts = watch::WatchOptions {
                interval: Duration::from_millis(args.interval_ms),
                count: args.count,
                mode,
            };
            watch::watch(&mgr, opts, out)?;
            String::new()
        }
        Command::Auth(a) => auth::run(&mgr, a, cli.json)?,
        Command::Tls(t) => tls::init(t, cli.json)?,
        Command::Status(_) => status(&mgr, cli.json)?,
        Command::Pg(PgCommand::Ls { state }) => pg::pg_ls(&mgr, state.as_deref(), cli.json)?,
        Command::Pg(PgCommand::Info { id }) => pg::pg_info(&mgr, *id, cli.json)?,
        Command::Osd(OsdCommand::Ls) => osd_ls(&mgr, cli.json)?,
        Command::Osd(cmd) => osd_op(&mgr, cmd, cli.json)?,
        Command::Volume(v) => volume(cli, &mgr, v)?,
        Command::Locate { volume, offset } => locate(&mgr, volume, *offset, cli.json)?,
        Command::Bench(b) => run_bench(cli, b)?,
        Command::Scrub(a) => scrub::run(cli, &mgr, a)?,
        Command::Pg(PgCommand::Compare { what }) => scrub::run(
            cli,
            &mgr,
            &scrub::ScrubArgs {
                what: what.clone(),
                dry_run: true,
            },
        )?,
    };
    Ok(text)
}

fn json<T: Serialize>(v: &T) -> Result<String> {
    serde_json::to_string_pretty(v)
        .map(|s| s + "\n")
        .map_err(|e| AdminError(format!("encoding JSON: {e}")))
}

fn status(mgr: &MgrClient, as_json: bool) -> Result<String> {
    let s = mgr.status()?;
    if as_json {
        return json(&s);
    }
    Ok(watch::status_text(&s))
}

/// The `osds` line of `status`. OSDs not heard from since the manager started are
/// counted `up` only because the map last said so: say that, rather than present
/// it as fresh.
pub fn osds_line(s: &ClusterStatus) -> String {
    let mut line = format!("{} total, {} up, {} in", s.osds, s.osds_up, s.osds_in);
    if s.osds_awaiting_first_report > 0 {
        line.push_str(&format!(
            "; {} waiting for first report (up/down is the last recorded state)",
            s.osds_awaiting_first_report
        ));
    }
    line
}

/// The `usage` line of `status`: unknown while no OSD has reported since the
/// manager started (right after `up`, after a manager restart), partial while some
/// have not, instead of a made-up `0 B used of 0 B`.
pub fn usage_line(s: &ClusterStatus) -> String {
    let waiting = s.osds_awaiting_first_report.min(s.osds);
    if s.osds == 0 {
        return "none: no OSDs".into();
    }
    if waiting == s.osds {
        return format!(
            "unknown: waiting for first report from {} OSD{}",
            waiting,
            if waiting == 1 { "" } else { "s" }
        );
    }
    let mut line = format!(
        "{} used of {} (all copies)",
        format_size(s.used_bytes),
        format_size(s.capacity_bytes)
    );
    if waiting > 0 {
        line.push_str(&format!(
            " from {} of {} OSDs; {waiting} waiting for first report",
            s.osds - waiting,
            s.osds
        ));
    }
    line
}

fn osd_ls(mgr: &MgrClient, as_json: bool) -> Result<String> {
    let osds = mgr.osds()?;
    if as_json {
        return json(&osds);
    }
    let rows: Vec<Vec<String>> = osds
        .iter()
        .map(|o| {
            vec![
                o.info.id.to_string(),
                o.info.host.clone(),
                o.info.addr.to_string(),
                o.info.shards.to_string(),
                format!("{:.2}", o.info.weight),
                match (o.info.up, o.awaiting_first_report) {
                    (true, false) => "up",
                    (true, true) => "up?",
                    (false, _) => "down",
                }
                .into(),
                if o.info.r#in { "in" } else { "out" }.into(),
                o.pgs.to_string(),
                if o.awaiting_first_report {
                    "unknown".into()
                } else {
                    format!(
                        "{} / {}",
                        format_size(o.used_bytes),
                        format_size(o.capacity_bytes)
                    )
                },
                o.last_heartbeat_ms_ago.map_or_else(
                    || "waiting for first report".into(),
                    |ms| format!("{ms} ms ago"),
                ),
            ]
        })
        .collect();
    let mut text = table(
        &[
            "ID",
            "HOST",
            "ADDR",
            "SHARDS",
            "WEIGHT",
            "STATUS",
            "IN",
            "PGS",
            "USED",
            "HEARTBEAT",
        ],
        &rows,
    );
    if osds.iter().any(|o| o.info.up && o.awaiting_first_report) {
        text.push_str("up? = recorded up, but no heartbeat since the manager started (yet)\n");
    }
    Ok(text)
}

/// `osd out|in|rm|reweight`: one manager call, then what it did.
fn osd_op(mgr: &MgrClient, cmd: &OsdCommand, as_json: bool) -> Result<String> {
    let (reply, done) = match cmd {
        OsdCommand::Ls => return osd_ls(mgr, as_json),
        OsdCommand::Out { id } => (mgr.osd_set_in(*id, false)?, format!("{id} is out")),
        OsdCommand::In { id } => (mgr.osd_set_in(*id, true)?, format!("{id} is in")),
        OsdCommand::Rm { id } => (mgr.osd_rm(*id)?, format!("{id} removed")),
        OsdCommand::Reweight { id, weight } => (
            mgr.osd_reweight(*id, *weight)?,
            format!("{id} has weight {weight}"),
        ),
    };
    if as_json {
        return json(&reply);
    }
    let mut text = if reply.changed {
        format!("{done} (map epoch {})\n", reply.epoch.0)
    } else {
        format!(
            "{done} already; nothing changed (map epoch {})\n",
            reply.epoch.0
        )
    };
    if !reply.lost_pgs.is_empty() {
        let shown: Vec<String> = reply
            .lost_pgs
            .iter()
            .take(LOST_PGS_SHOWN_MAX)
            .map(ToString::to_string)
            .collect();
        let more = reply.lost_pgs.len().saturating_sub(LOST_PGS_SHOWN_MAX);
        text.push_str(&format!(
            "WARNING: DATA LOST: {} held the only complete copy of {} placement groups; \
             their data is gone and they start again empty: {}{}\n",
            reply.osd,
            reply.lost_pgs.len(),
            shown.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        ));
    }
    Ok(text)
}

/// Lost placement groups named in `osd rm`'s warning (the rest are counted).
const LOST_PGS_SHOWN_MAX: usize = 32;

/// A volume as flame-admin shows it.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct VolumeView {
    /// Id.
    pub id: VolumeId,
    /// Name.
    pub name: String,
    /// Size in bytes.
    pub size: u64,
    /// Objects the volume spans: ceil(size / object_size) (thin: not all exist).
    pub objects: u64,
    /// Bytes per object.
    pub object_size: u32,
    /// Creation time, seconds since the Unix epoch.
    pub created_unix: u64,
}

impl VolumeView {
    fn new(v: &VolumeInfo, object_size: u32) -> VolumeView {
        VolumeView {
            id: v.id,
            name: v.name.clone(),
            size: v.size,
            objects: v.size.div_ceil(u64::from(object_size.max(1))),
            object_size,
            created_unix: v.created_unix,
        }
    }

    fn fields(&self) -> String {
        fields(&[
            ("name", self.name.clone()),
            ("id", self.id.to_string()),
            (
                "size",
                format!("{} ({} bytes)", format_size(self.size), self.size),
            ),
            (
                "objects",
                format!(
                    "{} of {}",
                    self.objects,
                    format_size(u64::from(self.object_size))
                ),
            ),
            ("created", utc_time(self.created_unix)),
        ])
    }
}

fn volume(cli: &Cli, mgr: &MgrClient, cmd: &VolumeCommand) -> Result<String> {
    // Object size is fixed per cluster; the map has it.
    let object_size = || -> Result<u32> { Ok(mgr.map()?.pool.object_size) };
    match cmd {
        VolumeCommand::Create { name, size } => {
            let v = mgr.create_volume(name, *size)?;
            let view = VolumeView::new(&v, object_size()?);
            if cli.json {
                return json(&view);
            }
            Ok(format!("created volume {name}\n{}", view.fields()))
        }
        VolumeCommand::Ls => {
            let vols = mgr.volumes()?;
            let os = object_size()?;
            let views: Vec<VolumeView> = vols.iter().map(|v| VolumeView::new(v, os)).collect();
            if cli.json {
                return json(&views);
            }
            let rows: Vec<Vec<String>> = views
                .iter()
                .map(|v| {
                    vec![
                        v.name.clone(),
                        v.id.to_string(),
                        format_size(v.size),
                        v.objects.to_string(),
                        utc_time(v.created_unix),
                    ]
                })
                .collect();
            Ok(table(&["NAME", "ID", "SIZE", "OBJECTS", "CREATED"], &rows))
        }
        VolumeCommand::Info { name } => {
            let v = mgr.volume(name)?;
            let view = VolumeView::new(&v, object_size()?);
            if cli.json {
                return json(&view);
            }
            Ok(view.fields())
        }
        VolumeCommand::Resize {
            name,
            size,
            allow_shrink,
        } => {
            let config = admin_client_config(cli);
            let v = crate::resize::resize_volume(&config, name, *size, *allow_shrink)
                .map_err(|e| AdminError(format!("cannot resize volume `{name}`: {e}")))?;
            let view = VolumeView::new(&v, object_size()?);
            if cli.json {
                return json(&view);
            }
            Ok(format!("resized volume {name}\n{}", view.fields()))
        }
        VolumeCommand::Rm { name } => volume_rm(cli, mgr, name),
    }
}

/// Removes the volume from the map, which keeps a tombstone of its id, then
/// deletes its objects on every OSD that is up through the data path (OSDs
/// delete a volume's objects only once their map has its tombstone, so that no
/// raw message can erase a live volume). Every OSD also deletes the objects of
/// tombstoned volumes on its own when it sees the map, so a deletion that
/// fails part-way (or an OSD that is down) is finished without another command.
fn volume_rm(cli: &Cli, mgr: &MgrClient, name: &str) -> Result<String> {
    mgr.volume(name)?;
    let removed = mgr.remove_volume(name)?;
    let fail = |e: ClientError| {
        AdminError(format!(
            "removed volume `{name}` from the map; deleting its objects now failed ({e}): \
             the OSDs delete them on their own as they see the map"
        ))
    };
    // Connected after the removal: the map it sends under has the tombstone.
    let cluster = Cluster::connect(admin_client_config(cli)).map_err(fail)?;
    let down: Vec<String> = cluster
        .map()
        .osds
        .values()
        .filter(|o| !o.up)
        .map(|o| o.id.to_string())
        .collect();
    let mut reactor = Reactor::new(ReactorConfig::default())
        .map_err(|e| AdminError(format!("starting the I/O reactor: {e}")))?;
    let c = cluster.clone();
    let id = removed.id;
    reactor
        .block_on(async move { c.delete_volume_objects(id).await })
        .map_err(|e| AdminError(format!("I/O reactor failed: {e}")))?
        .map_err(fail)?;
    let view = VolumeView::new(&removed, cluster.map().pool.object_size);
    if cli.json {
        return json(&view);
    }
    let where_ = if down.is_empty() {
        "every OSD".to_string()
    } else {
        format!(
            "every OSD that is up; {} (down) will delete theirs when they are back",
            down.join(", ")
        )
    };
    Ok(format!(
        "removed volume {name} ({}, {}); its objects were deleted on {where_}\n",
        view.id,
        format_size(view.size)
    ))
}

/// One OSD of a located object.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct LocatedOsd {
    /// OSD id.
    pub id: OsdId,
    /// `primary` (takes client I/O) or `replica`.
    pub role: &'static str,
    /// Address of the shard that owns the PG.
    pub addr: SocketAddr,
    /// That shard.
    pub shard: u16,
    /// Heartbeating.
    pub up: bool,
    /// Part of placement.
    pub r#in: bool,
}

/// `flame-admin locate` output.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Location {
    /// Volume name.
    pub volume: String,
    /// Volume id.
    pub volume_id: VolumeId,
    /// Byte offset asked about.
    pub offset: u64,
    /// Object index within the volume.
    pub object_index: u64,
    /// Offset within that object.
    pub object_offset: u64,
    /// Object name (`<volume id>.<index>` in hex), as OSDs name it.
    pub object: String,
    /// Placement group.
    pub pg: PgId,
    /// Map epoch the placement was computed from.
    pub epoch: u64,
    /// Acting set, primary first.
    pub osds: Vec<LocatedOsd>,
}

/// Computes where byte `offset` of `volume` lives in `map`.
pub fn locate_in(map: &ClusterMap, volume: &str, offset: u64) -> Result<Location> {
    let v = map
        .volumes
        .get(volume)
        .ok_or_else(|| AdminError(ClientError::NoSuchVolume(volume.to_string()).to_string()))?;
    if offset >= v.size {
        return Err(AdminError(format!(
            "offset {offset} is beyond the end of volume `{volume}` ({} bytes)",
            v.size
        )));
    }
    let os = u64::from(map.pool.object_size);
    let object = ObjectId {
        volume: v.id,
        index: offset / os,
    };
    let loc = placement::locate(map, object);
    let osds = loc
        .osds
        .iter()
        .enumerate()
        .filter_map(|(i, id)| map.osds.get(id).map(|o| (i, o)))
        .map(|(i, o)| {
            let shard = o.shard_of(loc.pg);
            LocatedOsd {
                id: o.id,
                role: if i == 0 { "primary" } else { "replica" },
                addr: o.shard_addr(shard),
                shard,
                up: o.up,
                r#in: o.r#in,
            }
        })
        .collect();
    Ok(Location {
        volume: volume.to_string(),
        volume_id: v.id,
        offset,
        object_index: object.index,
        object_offset: offset % os,
        object: object.to_string(),
        pg: loc.pg,
        epoch: map.epoch.0,
        osds,
    })
}

fn locate(mgr: &MgrClient, volume: &str, offset: u64, as_json: bool) -> Result<String> {
    let map = mgr.map()?;
    let l = locate_in(&map, volume, offset)?;
    if as_json {
        return json(&l);
    }
    let mut s = fields(&[
        ("volume", format!("{} ({})", l.volume, l.volume_id)),
        (
            "offset",
            format!(
                "{} = object {} + {}",
                l.offset, l.object_index, l.object_offset
            ),
        ),
        ("object", l.object.clone()),
        ("pg", format!("{} (map epoch {})", l.pg, l.epoch)),
    ]);
    if l.osds.is_empty() {
        s.push_str("osds    none: no OSD is in\n");
        return Ok(s);
    }
    let rows: Vec<Vec<String>> = l
        .osds
        .iter()
        .map(|o| {
            vec![
                o.role.to_string(),
                o.id.to_string(),
                o.addr.to_string(),
                o.shard.to_string(),
                format!(
                    "{},{}",
                    if o.up { "up" } else { "down" },
                    if o.r#in { "in" } else { "out" }
                ),
            ]
        })
        .collect();
    s.push('\n');
    s.push_str(&table(&["ROLE", "OSD", "ADDR", "SHARD", "STATE"], &rows));
    Ok(s)
}

fn run_bench(cli: &Cli, b: &BenchArgs) -> Result<String> {
    let mut client = ClientConfig {
        transport: b.transport,
        ..admin_client_config(cli)
    };
    client.transfer_mode = b.transfer_mode;
    client.reply_mode = b.reply_mode;
    client.fetch_over_emulated = b.fetch_over_emulated;
    if let Some(t) = b.convert_threshold {
        let t = u32::try_from(t)
            .ok()
            .filter(|&t| t > 0)
            .ok_or_else(|| AdminError(format!("--convert-threshold: must be 1..=4G, got {t}")))?;
        client.convert_threshold_bytes = crate::config::ConvertThresholds {
            tcp: t,
            shm: t,
            rdma: t,
        };
    }
    let cluster = Cluster::connect(client)?;
    let cfg = BenchConfig {
        pattern: b.rw,
        block_bytes: b.bs,
        iodepth: b.iodepth,
        runtime: b.runtime,
        size_limit: b.size_limit,
        seed: b.seed,
    };
    let mut reactor = Reactor::new(ReactorConfig::default())
        .map_err(|e| AdminError(format!("starting the I/O reactor: {e}")))?;
    let name = b.volume.clone();
    let check_first = cfg.pattern.is_write() && !b.force_overwrite;
    let report = reactor
        .block_on(async move {
            let vol = cluster.open_volume(&name).await?;
            if check_first {
                let region = bench::region_bytes(&cfg, vol.size());
                if let Some(at) = bench::find_data(&vol, region).await? {
                    return Ok(Err(AdminError(format!(
                        "volume `{name}` holds data (a non-zero byte at offset {at}): a {} \
                         benchmark would overwrite it. Benchmark a scratch volume \
                         (flame-admin volume create bench --size 4G), or pass \
                         --force-overwrite to destroy what `{name}` holds",
                        cfg.pattern.name()
                    ))));
                }
            }
            bench::run(&vol, &cfg).await.map(Ok)
        })
        .map_err(|e| AdminError(format!("I/O reactor failed: {e}")))???;
    if cli.json {
        return json(&report);
    }
    Ok(bench_text(&report))
}

/// The human summary of a benchmark run.
pub fn bench_text(r: &BenchReport) -> String {
    fields(&[
        (
            "job",
            format!(
                "{} {} bs={} iodepth={} over {}",
                r.volume,
                r.pattern.name(),
                format_size(r.block_bytes),
                r.iodepth,
                format_size(r.region_bytes)
            ),
        ),
        ("done", format!("{} ops in {:.2} s", r.ops, r.elapsed_s)),
        ("iops", format!("{:.0}", r.iops)),
        ("bandwidth", format!("{:.1} MiB/s", r.mib_per_s)),
        (
            "latency",
            format!(
                "p50 {} us, p99 {} us, p99.9 {} us, max {} us, mean {:.0} us",
                r.latency.p50_us,
                r.latency.p99_us,
                r.latency.p999_us,
                r.latency.max_us,
                r.latency.mean_us
            ),
        ),
    ])
}

/// How long an admin command's data-path request may take before the command
/// fails: an operator at a terminal wants an answer, unlike a block device.
const ADMIN_IO_TIMEOUT_MS: u64 = 30_000;

/// The client settings of admin commands: the library's defaults, but giving up
/// after [`ADMIN_IO_TIMEOUT_MS`] (the library's default is to never give up).
/// Where `flame-admin` looks for a keyring when none is given (where the docs and
/// the systemd units put the admin's).
pub const DEFAULT_ADMIN_KEYRING: &str = "/etc/flame/keys/client.admin.keyring";

/// Where `flame-admin` looks for the cluster CA when none is given.
pub const DEFAULT_MGR_CA: &str = "/etc/flame/tls/ca.crt";

/// The client configuration of flame-admin's data-path commands: its manager and
/// keyring, and a bounded I/O timeout.
pub(crate) fn admin_client_config(cli: &Cli) -> ClientConfig {
    ClientConfig {
        io_timeout_ms: ADMIN_IO_TIMEOUT_MS,
        keyring: cli.keyring.clone().or_else(|| {
            let default = std::path::Path::new(DEFAULT_ADMIN_KEYRING);
            default.exists().then(|| default.to_path_buf())
        }),
        // The default CA only where the address does not say plain HTTP.
        mgr_tls_ca: cli.mgr_ca.clone().or_else(|| {
            let default = std::path::Path::new(DEFAULT_MGR_CA);
            (default.exists() && !cli.mgr.trim().starts_with("http://"))
                .then(|| default.to_path_buf())
        }),
        ..ClientConfig::new(cli.mgr.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::ids::Epoch;
    use flame_common::map::{OsdInfo, PoolConfig};

    fn parse(args: &[&str]) -> std::result::Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("flame-admin").chain(args.iter().copied()))
    }

    #[test]
    fn cli_parses_every_command() {
        let c = parse(&["status"]).unwrap();
        assert!(matches!(
            c.command,
            Command::Status(StatusArgs { watch: false, .. })
        ));
        assert!(!c.json);
        let c = parse(&["--json", "osd", "ls"]).unwrap();
        assert!(c.json);
        assert!(matches!(c.command, Command::Osd(OsdCommand::Ls)));
        // Global flags go after the subcommand too.
        let c = parse(&[
            "volume", "create", "demo", "--size", "10G", "--mgr", "h:1", "--json",
        ])
        .unwrap();
        assert_eq!(c.mgr, "h:1");
        assert!(c.json);
        match c.command {
            Command::Volume(VolumeCommand::Create { name, size }) => {
                assert_eq!(name, "demo");
                assert_eq!(size, 10 << 30);
            }
            other => panic!("{other:?}"),
        }
        match parse(&["volume", "resize", "v", "--size", "1T", "--allow-shrink"])
            .unwrap()
            .command
        {
            Command::Volume(VolumeCommand::Resize {
                size, allow_shrink, ..
            }) => {
                assert_eq!(size, 1 << 40);
                assert!(allow_shrink);
            }
            other => panic!("{other:?}"),
        }
        match parse(&["locate", "v", "4M"]).unwrap().command {
            Command::Locate { volume, offset } => {
                assert_eq!(volume, "v");
                assert_eq!(offset, 4 << 20);
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            parse(&["volume", "rm", "v"]).unwrap().command,
            Command::Volume(VolumeCommand::Rm { .. })
        ));
        assert!(matches!(
            parse(&["volume", "ls"]).unwrap().command,
            Command::Volume(VolumeCommand::Ls)
        ));
    }

    #[test]
    fn osd_commands_parse_ids_and_weights() {
        match parse(&["osd", "out", "osd.3"]).unwrap().command {
            Command::Osd(OsdCommand::Out { id }) => assert_eq!(id, OsdId(3)),
            other => panic!("{other:?}"),
        }
        match parse(&["osd", "in", "3"]).unwrap().command {
            Command::Osd(OsdCommand::In { id }) => assert_eq!(id, OsdId(3)),
            other => panic!("{other:?}"),
        }
        match parse(&["osd", "rm", "12", "--json"]).unwrap().command {
            Command::Osd(OsdCommand::Rm { id }) => assert_eq!(id, OsdId(12)),
            other => panic!("{other:?}"),
        }
        match parse(&["osd", "reweight", "osd.1", "0.5"]).unwrap().command {
            Command::Osd(OsdCommand::Reweight { id, weight }) => {
                assert_eq!((id, weight), (OsdId(1), 0.5));
            }
            other => panic!("{other:?}"),
        }
        for bad in [
            &["osd", "out", "x"][..],
            &["osd", "out", "osd."],
            &["osd", "out", "-1"],
            &["osd", "out", "99999999999"],
            &["osd", "reweight", "1", "101"],
            &["osd", "reweight", "1", "-1"],
            &["osd", "reweight", "1", "nan"],
            &["osd", "reweight", "1", "inf"],
            &["osd", "reweight", "1"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn status_watch_and_pg_commands_parse() {
        let Command::Status(a) =
            parse(&["status", "--watch", "--interval-ms", "200", "--count", "3"])
                .unwrap()
                .command
        else {
            panic!()
        };
        assert!(a.watch);
        assert_eq!((a.interval_ms, a.count), (200, Some(3)));
        let Command::Status(a) = parse(&["status"]).unwrap().command else {
            panic!()
        };
        assert_eq!((a.interval_ms, a.count), (1000, None));
        assert!(parse(&["status", "--watch", "--interval-ms", "5"]).is_err());
        assert!(parse(&["status", "--watch", "--count", "0"]).is_err());
        assert!(
            parse(&["status", "--count", "2"]).is_err(),
            "--count needs --watch"
        );
        match parse(&["pg", "ls", "--state", "active+degraded"])
            .unwrap()
            .command
        {
            Command::Pg(PgCommand::Ls { state }) => {
                assert_eq!(state.as_deref(), Some("active+degraded"));
            }
            other => panic!("{other:?}"),
        }
        assert!(parse(&["pg", "ls", "--state", "peering"]).is_err());
        match parse(&["pg", "info", "pg.7"]).unwrap().command {
            Command::Pg(PgCommand::Info { id }) => assert_eq!(id, PgId(7)),
            other => panic!("{other:?}"),
        }
        assert!(parse(&["pg", "info", "seven"]).is_err());
    }

    #[test]
    fn bench_defaults_and_options() {
        let Command::Bench(b) = parse(&["bench", "v"]).unwrap().command else {
            panic!()
        };
        assert_eq!(b.rw, Pattern::Randread);
        assert_eq!(b.bs, 4096);
        assert_eq!(b.iodepth, 32);
        assert_eq!(b.runtime, Duration::from_secs(10));
        assert_eq!(b.size_limit, None);
        assert!(!b.force_overwrite, "overwriting data is opt-in");
        let Command::Bench(b) = parse(&[
            "bench",
            "v",
            "--rw",
            "randwrite",
            "--bs",
            "1M",
            "--iodepth",
            "4",
            "--runtime",
            "500ms",
            "--size-limit",
            "1G",
            "--seed",
            "7",
        ])
        .unwrap()
        .command
        else {
            panic!()
        };
        assert_eq!(b.rw, Pattern::Randwrite);
        assert_eq!(b.bs, 1 << 20);
        assert_eq!(b.runtime, Duration::from_millis(500));
        assert_eq!(b.size_limit, Some(1 << 30));
        assert_eq!(b.seed, 7);
    }

    #[test]
    fn volume_sizes_are_binary_aligned_and_bounded() {
        let size = |s: &str| match parse(&["volume", "create", "v", "--size", s]) {
            Ok(Cli {
                command: Command::Volume(VolumeCommand::Create { size, .. }),
                ..
            }) => Ok(size),
            Ok(other) => panic!("{other:?}"),
            Err(e) => Err(e.to_string()),
        };
        assert_eq!(size("1.5G"), Ok(3 << 29));
        assert_eq!(size("10GiB"), Ok(10 << 30));
        assert_eq!(size("1P"), Ok(1 << 50));
        let e = size("10GB").unwrap_err();
        assert!(e.contains("decimal units are not accepted"), "{e}");
        let e = size("100P").unwrap_err();
        assert!(e.contains("100 PiB") && e.contains("1 PiB"), "{e}");
        let e = size("1000").unwrap_err();
        assert!(
            e.contains("multiple of 512") && e.contains("1024 (1 KiB)"),
            "{e}"
        );
        assert!(size("0").is_err());
        assert!(size("0.1G").is_err());
    }

    #[test]
    fn usage_and_osds_lines_say_when_nothing_is_known() {
        let mut s = ClusterStatus {
            fsid: "f".into(),
            health: "HEALTH_OK".into(),
            epoch: Epoch(1),
            osds: 3,
            osds_up: 3,
            osds_in: 3,
            osds_awaiting_first_report: 3,
            ..Default::default()
        };
        assert_eq!(
            usage_line(&s),
            "unknown: waiting for first report from 3 OSDs"
        );
        assert!(osds_line(&s).contains("3 waiting for first report"));
        s.osds_awaiting_first_report = 1;
        s.used_bytes = 1 << 20;
        s.capacity_bytes = 1 << 30;
        assert_eq!(
            usage_line(&s),
            "1.0 MiB used of 1.0 GiB (all copies) from 2 of 3 OSDs; 1 waiting for first report"
        );
        s.osds_awaiting_first_report = 0;
        assert_eq!(usage_line(&s), "1.0 MiB used of 1.0 GiB (all copies)");
        assert_eq!(osds_line(&s), "3 total, 3 up, 3 in");
        s.osds = 0;
        assert_eq!(usage_line(&s), "none: no OSDs");
    }

    #[test]
    fn bad_arguments_are_usage_errors() {
        assert!(parse(&["volume", "create", "v", "--size", "ten"]).is_err());
        assert!(parse(&["volume", "create", "v"]).is_err());
        assert!(parse(&["bench", "v", "--rw", "sideways"]).is_err());
        assert!(parse(&["bench", "v", "--runtime", "soon"]).is_err());
        assert!(parse(&["frobnicate"]).is_err());
    }

    fn map() -> ClusterMap {
        let mut m = ClusterMap::new("f".into(), PoolConfig::default());
        m.epoch = Epoch(9);
        for i in 0..4u32 {
            m.osds.insert(
                OsdId(i),
                OsdInfo {
                    id: OsdId(i),
                    addr: format!("127.0.0.1:{}", 6900 + 10 * i).parse().unwrap(),
                    shards: 2,
                    host: format!("h{i}"),
                    weight: 1.0,
                    up: i != 3,
                    up_from: Epoch(1),
                    r#in: true,
                    metrics_addr: None,
                },
            );
        }
        m.volumes.insert(
            "demo".into(),
            VolumeInfo {
                id: VolumeId(5),
                name: "demo".into(),
                size: 10 << 20,
                created_unix: 0,
            },
        );
        m
    }

    #[test]
    fn locate_matches_placement() {
        let m = map();
        let l = locate_in(&m, "demo", (4 << 20) + 17).unwrap();
        assert_eq!(l.object_index, 1);
        assert_eq!(l.object_offset, 17);
        assert_eq!(l.object, "0000000000000005.0000000000000001");
        let want = placement::locate(
            &m,
            ObjectId {
                volume: VolumeId(5),
                index: 1,
            },
        );
        assert_eq!(l.pg, want.pg);
        let ids: Vec<OsdId> = l.osds.iter().map(|o| o.id).collect();
        assert_eq!(ids, want.osds);
        assert_eq!(l.osds[0].role, "primary");
        assert!(l.osds[1..].iter().all(|o| o.role == "replica"));
        for o in &l.osds {
            assert_eq!(u32::from(o.shard), l.pg.0 % 2);
            assert_eq!(o.addr.port(), m.osds[&o.id].addr.port() + o.shard);
        }
        assert!(locate_in(&m, "demo", 10 << 20).is_err());
        assert!(locate_in(&m, "nope", 0).is_err());
    }

    #[test]
    fn volume_view_counts_objects() {
        let m = map();
        let v = VolumeView::new(&m.volumes["demo"], 4 << 20);
        assert_eq!(v.objects, 3); // 10 MiB / 4 MiB, rounded up
        assert!(v.fields().contains("1970-01-01"));
    }
}
