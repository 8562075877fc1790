//! `simulate`: runs seeds of the deterministic simulator (`flame_tests::sim`) and
//! prints one line per seed (a failing one with its errors, last events and the
//! command that replays it). `scripts/simulate.sh` wraps it.
//!
//! ```text
//! simulate --seed 42                 # one seed (replay)
//! simulate --seeds 200 --from 1000   # seeds 1000..1200
//! simulate --seeds 50 --no-faults --ops 1000
//! ```
//! `RUST_LOG=debug` prints the simulated daemons' logs (one seed at a time),
//! each line with its virtual time and node; `--trace-file NAME` (with
//! `RUST_LOG=info`) adds every disk operation on the files of that name on
//! every OSD — an object's file is `<volume, 16 hex>.<index, 16 hex>`, as a
//! failed block's error names it.

use flame_tests::sim::{SimConfig, run};
use std::process::ExitCode;

fn usage() -> ExitCode {
    eprintln!(
        "usage: simulate [--seed N | --seeds COUNT [--from FIRST]] [--ops N] [--pg-log N] [--clients N] [--writers N] [--no-faults] [--no-disk-faults] [--no-resizes] [--no-tcp-holds] [--no-shrunk-wait] [--no-scrubs] [--no-bit-rot] [--no-slow-disks] [--doubt-does-not-impair] [--no-rewrites] [--no-tcp-backoff] [--trace-file NAME] [--no-swarm] [--twice] [--events]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut first, mut count) = (1u64, 1u64);
    let (mut ops, mut writers, mut faults, mut twice) = (None, None, true, false);
    let mut clients = None;
    let mut pg_log = None;
    let mut events = false;
    let mut disk_faults = true;
    let mut resizes = true;
    let mut tcp_holds = true;
    let mut shrunk_wait = true;
    let mut scrubs = true;
    let mut bit_rot = true;
    let mut slow_disks = true;
    let mut swarm = true;
    let mut trace_file = None;
    let mut doubt_impairs = true;
    let mut rewrites = true;
    let mut tcp_backoff = true;
    while let Some(a) = args.next() {
        let mut num = || args.next().and_then(|v| v.parse::<u64>().ok());
        match a.as_str() {
            "--seed" => match num() {
                Some(s) => (first, count) = (s, 1),
                None => return usage(),
            },
            "--seeds" => match num() {
                Some(n) => count = n,
                None => return usage(),
            },
            "--from" => match num() {
                Some(s) => first = s,
                None => return usage(),
            },
            "--ops" => match num() {
                Some(n) => ops = Some(n),
                None => return usage(),
            },
            "--pg-log" => match num() {
                Some(n) if (1..=1_000_000).contains(&n) => pg_log = Some(n as u32),
                _ => return usage(),
            },
            "--clients" => match num() {
                Some(n) if n >= 1 => clients = Some(n as usize),
                _ => return usage(),
            },
            "--writers" => match num() {
                Some(n) => writers = Some(n as usize),
                None => return usage(),
            },
            "--no-faults" => faults = false,
            "--no-disk-faults" => disk_faults = false,
            "--no-resizes" => resizes = false,
            "--no-tcp-holds" => tcp_holds = false,
            "--no-shrunk-wait" => shrunk_wait = false,
            "--no-scrubs" => scrubs = false,
            "--no-bit-rot" => bit_rot = false,
            "--no-slow-disks" => slow_disks = false,
            // The default since the seeds they found were fixed (kept so
            // that older replay commands still run).
            "--slow-disks" => {}
            "--doubt-does-not-impair" => doubt_impairs = false,
            "--no-rewrites" => rewrites = false,
            "--no-tcp-backoff" => tcp_backoff = false,
            "--trace-file" => match args.next() {
                Some(name) => trace_file = Some(name),
                None => return usage(),
            },
            "--no-swarm" => swarm = false,
            "--twice" => twice = true,
            "--events" => events = true,
            _ => return usage(),
        }
    }
    if std::env::var_os("RUST_LOG").is_some() {
        flame_common::logging::init();
    }
    let started = flame_common::clock::Stopwatch::start();
    let (mut passed, mut failed) = (0u64, Vec::new());
    let mut virtual_secs = 0.0;
    for seed in first..first.saturating_add(count) {
        let mut cfg = if swarm {
            SimConfig::new(seed)
        } else {
            SimConfig::legacy(seed)
        };
        cfg.faults = faults;
        cfg.disk_faults = disk_faults;
        cfg.resizes = resizes;
        cfg.tcp_holds = tcp_holds;
        cfg.resize_stays_shrunk = shrunk_wait;
        cfg.scrubs = scrubs;
        cfg.bit_rot = bit_rot;
        cfg.slow_disks &= slow_disks;
        cfg.doubt_impairs &= doubt_impairs;
        cfg.rewrites &= rewrites;
        cfg.tcp_backoff &= tcp_backoff;
        cfg.trace_file.clone_from(&trace_file);
        if let Some(n) = ops {
            cfg.ops = n;
        }
        if let Some(n) = pg_log {
            cfg.pg_log_entries_max = n;
        }
        if let Some(n) = writers {
            cfg.writers = n;
        }
        if let Some(n) = clients {
            cfg.clients = n;
        }
        let report = run(cfg.clone());
        print!("{report}");
        if events && report.passed() {
            for e in &report.events {
                println!("    {e}");
            }
        }
        virtual_secs += report.virtual_time.as_secs_f64();
        let mut ok = report.passed();
        if twice {
            let again = run(cfg);
            if again.trace_hash != report.trace_hash || again.deliveries != report.deliveries {
                println!(
                    "seed {seed}: NOT DETERMINISTIC: trace {:016x} ({} deliveries) then {:016x} ({})",
                    report.trace_hash, report.deliveries, again.trace_hash, again.deliveries
                );
                ok = false;
            }
        }
        if ok {
            passed += 1;
        } else {
            failed.push(seed);
        }
    }
    let wall = started.elapsed().as_secs_f64();
    println!(
        "{passed} of {count} seeds passed in {wall:.1} s ({:.0} seeds/min, {virtual_secs:.0} s virtual)",
        count as f64 / wall.max(1e-9) * 60.0
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        println!("failed seeds: {failed:?}");
        ExitCode::FAILURE
    }
}
