//! Contention-free vs locked memory pool, 2 threads (issue 7's "contention-free vs
//! locked pool" pair, thesis: IOPS +32 … 34 %).
//!
//! Each of two threads runs a request loop the way a data-path thread does: it
//! allocates a payload buffer, writes a header-sized part of it, keeps it "in
//! flight" in a queue of `--depth` buffers and, when it completes, either frees it
//! itself or hands it to the other thread (a reply sent by another thread's
//! connection: a remote free) — `--cross-percent` of them. Rounds of `percpu` and
//! `locked` (and, with `--heap`, the heap pool) are interleaved, so both see the
//! same machine load; the program prints each round, then per mode the median
//! ops/s over rounds, the p99 of sampled allocate+free latencies, and the ratio.
//!
//! ```text
//! cargo run --release -p flame-common --example pool_bench -- --rounds 9 --ops 2000000
//! ```

// A benchmark measures real time (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use crossbeam_queue::ArrayQueue;
use flame_common::buffer::registered::{MemoryPoolConfig, PoolInstaller, PoolMode};
use flame_common::buffer::{PayloadBuf, PayloadBufMut};
use std::collections::VecDeque;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

struct Args {
    rounds: usize,
    ops: usize,
    size: usize,
    depth: usize,
    cross_percent: usize,
    heap: bool,
    /// Run only this mode (for profiling one of them).
    only: Option<PoolMode>,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        rounds: 7,
        ops: 1_000_000,
        size: 4096,
        depth: 32,
        cross_percent: 50,
        heap: false,
        only: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        if k == "--heap" {
            a.heap = true;
            continue;
        }
        if k == "--only" {
            let v = it.next().ok_or("--only needs a mode")?;
            a.only = Some(match v.as_str() {
                "percpu" => PoolMode::Percpu,
                "locked" => PoolMode::Locked,
                "heap" => PoolMode::Heap,
                _ => return Err(format!("--only: unknown mode {v}")),
            });
            continue;
        }
        let v = it.next().ok_or(format!("{k} needs a value"))?;
        let n: usize = v.parse().map_err(|_| format!("{k}: not a number: {v}"))?;
        match k.as_str() {
            "--rounds" => a.rounds = n.clamp(1, 1000),
            "--ops" => a.ops = n.clamp(1, 1 << 32),
            "--size" => a.size = n.clamp(1, 4 << 20),
            "--depth" => a.depth = n.clamp(1, 4096),
            "--cross-percent" => a.cross_percent = n.min(100),
            _ => return Err(format!("unknown option {k}")),
        }
    }
    Ok(a)
}

/// One thread's result: elapsed time and sampled allocate latencies (ns).
struct ThreadResult {
    elapsed: Duration,
    samples_ns: Vec<u64>,
}

fn worker(
    args: &Args,
    seed: usize,
    installer: Arc<PoolInstaller>,
    outbox: Arc<ArrayQueue<PayloadBuf>>,
    inbox: Arc<ArrayQueue<PayloadBuf>>,
    start: Arc<Barrier>,
) -> ThreadResult {
    if let Err(e) = installer.install() {
        eprintln!("cannot install the pool: {e}");
        std::process::exit(1);
    }
    let mut inflight: VecDeque<PayloadBuf> = VecDeque::with_capacity(args.depth);
    let mut samples_ns = Vec::with_capacity(args.ops / 64 + 1);
    let mut x = seed as u64 * 0x9e37_79b9_7f4a_7c15 + 1;
    start.wait();
    let t0 = Instant::now();
    for i in 0..args.ops {
        // Take back what the other thread handed over (it frees them here:
        // for this thread's pool those are local frees, for the other's remote).
        while let Some(b) = inbox.pop() {
            drop(b);
        }
        let sample = i % 64 == 0;
        let ts = sample.then(Instant::now);
        let mut b = PayloadBufMut::for_overwrite(args.size);
        if let Some(ts) = ts {
            samples_ns.push(ts.elapsed().as_nanos() as u64);
        }
        let n = b.len().min(64);
        b.as_mut_slice()[..n].fill(i as u8);
        inflight.push_back(b.freeze());
        if inflight.len() >= args.depth
            && let Some(done) = inflight.pop_front()
        {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            if (x % 100) < args.cross_percent as u64 {
                if let Err(back) = outbox.push(done) {
                    drop(back);
                }
            } else {
                drop(done);
            }
        }
    }
    let elapsed = t0.elapsed();
    drop(inflight);
    ThreadResult {
        elapsed,
        samples_ns,
    }
}

/// Runs one round of `mode`; returns total ops/s and the latency samples.
fn round(args: &Args, mode: PoolMode) -> (f64, Vec<u64>) {
    let cfg = MemoryPoolConfig {
        mode,
        bytes_per_thread: 64 << 20,
        ..MemoryPoolConfig::default()
    };
    let installer = match PoolInstaller::new(&cfg, 2) {
        Ok(i) => Arc::new(i),
        Err(e) => {
            eprintln!("cannot create the pool: {e}");
            std::process::exit(1);
        }
    };
    let q = |n| Arc::new(ArrayQueue::new(n));
    let (ab, ba) = (q(args.depth * 4), q(args.depth * 4));
    let start = Arc::new(Barrier::new(2));
    let handles: Vec<_> = [(ab.clone(), ba.clone()), (ba, ab)]
        .into_iter()
        .enumerate()
        .map(|(t, (out, inb))| {
            let (installer, start) = (installer.clone(), start.clone());
            let a = Args { ..*args };
            std::thread::Builder::new()
                .name(format!("bench-{t}"))
                .spawn(move || worker(&a, t + 1, installer, out, inb, start))
        })
        .collect();
    let mut ops_s = 0.0;
    let mut samples = Vec::new();
    for h in handles {
        match h.map(|h| h.join()) {
            Ok(Ok(r)) => {
                ops_s += args.ops as f64 / r.elapsed.as_secs_f64();
                samples.extend(r.samples_ns);
            }
            _ => {
                eprintln!("a benchmark thread failed");
                std::process::exit(1);
            }
        }
    }
    (ops_s, samples)
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("pool_bench: {e}");
            std::process::exit(2);
        }
    };
    let mut modes = vec![PoolMode::Percpu, PoolMode::Locked];
    if args.heap {
        modes.push(PoolMode::Heap);
    }
    if let Some(m) = args.only {
        modes = vec![m];
    }
    println!(
        "pool_bench: 2 threads, {} ops each per round, {} B buffers, depth {}, {}% freed remotely, {} rounds, {} cores",
        args.ops,
        args.size,
        args.depth,
        args.cross_percent,
        args.rounds,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    let mut lat: Vec<Vec<f64>> = vec![Vec::new(); modes.len()];
    for r in 0..args.rounds {
        // Interleaved, and the order alternates so neither mode always goes first.
        let order: Vec<usize> = if r % 2 == 0 {
            (0..modes.len()).collect()
        } else {
            (0..modes.len()).rev().collect()
        };
        for m in order {
            let (ops_s, samples) = round(&args, modes[m]);
            println!("round {r:>2} {:>6}: {:>12.0} ops/s", modes[m].name(), ops_s);
            rates[m].push(ops_s);
            lat[m].extend(samples.into_iter().map(|ns| ns as f64));
        }
    }
    println!("\nmode     median ops/s   p99 alloc ns   p50 alloc ns");
    let mut medians = Vec::new();
    for (m, mode) in modes.iter().enumerate() {
        let med = percentile(&mut rates[m], 0.5);
        let p99 = percentile(&mut lat[m], 0.99);
        let p50 = percentile(&mut lat[m], 0.5);
        println!("{:<8} {med:>12.0} {p99:>14.0} {p50:>14.0}", mode.name());
        medians.push(med);
    }
    if medians.len() > 1 && medians[1] > 0.0 {
        println!(
            "\npercpu / locked = {:.3} ({:+.1} %)",
            medians[0] / medians[1],
            (medians[0] / medians[1] - 1.0) * 100.0
        );
    }
}
