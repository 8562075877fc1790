//! A small block benchmark over the client library (`flame-admin bench`).
//!
//! It drives a volume directly — no NBD, no kernel — with `iodepth` concurrent
//! tasks on one reactor thread for a bounded time, and reports IOPS, throughput and
//! the latency distribution (HdrHistogram, so p99 and max are exact to 3 digits).
//! Reading never-written blocks is valid (they read as zeroes), so read benchmarks
//! need no fill pass; run a write benchmark first to measure reads of real data.

use crate::error::ClientError;
use crate::volume::Volume;
use flame_common::{clock, reactor};
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::time::{Duration, Instant};

/// Largest block size (one NBD request's worth, and well within memory).
pub const BLOCK_BYTES_MAX: u64 = 64 << 20;
/// Most concurrent tasks.
pub const IODEPTH_MAX: usize = 4096;
/// Longest run.
pub const RUNTIME_MAX: Duration = Duration::from_secs(24 * 3600);

/// Access pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Uniformly random reads.
    Randread,
    /// Uniformly random writes.
    Randwrite,
}

impl Pattern {
    /// Whether the pattern writes (and so destroys what the volume held).
    pub fn is_write(self) -> bool {
        matches!(self, Pattern::Write | Pattern::Randwrite)
    }

    fn is_random(self) -> bool {
        matches!(self, Pattern::Randread | Pattern::Randwrite)
    }

    /// Name as on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Read => "read",
            Pattern::Write => "write",
            Pattern::Randread => "randread",
            Pattern::Randwrite => "randwrite",
        }
    }
}

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Access pattern.
    pub pattern: Pattern,
    /// Bytes per I/O.
    pub block_bytes: u64,
    /// Concurrent I/Os.
    pub iodepth: usize,
    /// How long to run.
    pub runtime: Duration,
    /// Only touch the first this-many bytes of the volume (default: all of it).
    pub size_limit: Option<u64>,
    /// Seed of the random offsets and of the written data.
    pub seed: u64,
}

/// Latency percentiles in microseconds.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Latency {
    /// Median.
    pub p50_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// 99.9th percentile.
    pub p999_us: u64,
    /// Slowest.
    pub max_us: u64,
    /// Mean.
    pub mean_us: f64,
}

/// What a run measured.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct BenchReport {
    /// Volume name.
    pub volume: String,
    /// Pattern name.
    pub pattern: Pattern,
    /// Bytes per I/O.
    pub block_bytes: u64,
    /// Concurrent I/Os.
    pub iodepth: usize,
    /// Bytes of the volume the run spread over.
    pub region_bytes: u64,
    /// Measured wall time in seconds.
    pub elapsed_s: f64,
    /// I/Os completed.
    pub ops: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// I/Os per second.
    pub iops: f64,
    /// MiB per second.
    pub mib_per_s: f64,
    /// Latency distribution.
    pub latency: Latency,
}

/// Checks the configuration against the volume; returns the number of blocks.
fn blocks_for(cfg: &BenchConfig, volume_size: u64) -> Result<u64, ClientError> {
    let bad = |m: String| Err(ClientError::InvalidArgument(m));
    if cfg.block_bytes == 0 || cfg.block_bytes > BLOCK_BYTES_MAX {
        return bad(format!(
            "--bs must be 1 byte to {} ({BLOCK_BYTES_MAX} bytes)",
            crate::admin::size::describe_size(BLOCK_BYTES_MAX)
        ));
    }
    if cfg.iodepth == 0 || cfg.iodepth > IODEPTH_MAX {
        return bad(format!("--iodepth must be 1..={IODEPTH_MAX}"));
    }
    if cfg.runtime.is_zero() || cfg.runtime > RUNTIME_MAX {
        return bad("--runtime must be more than 0 and at most 24h".into());
    }
    let region = region_bytes(cfg, volume_size);
    let blocks = region / cfg.block_bytes;
    if blocks == 0 {
        return bad(format!(
            "the region ({}) is smaller than one block ({})",
            crate::admin::size::describe_size(region),
            crate::admin::size::describe_size(cfg.block_bytes)
        ));
    }
    Ok(blocks)
}

/// Bytes read at the start and at the end of the region when looking for data:
/// partition tables (MBR, GPT and its backup at the end), file-system superblocks
/// (ext4, XFS, Btrfs at 64 KiB), LVM and swap labels all live there.
pub const DATA_CHECK_EDGE_BYTES: u64 = 1 << 20;
/// Bytes read at the start of each sampled object.
pub const DATA_CHECK_OBJECT_BYTES: u64 = 4096;
/// Objects sampled at most (evenly spread); a 4 GiB volume of 4 MiB objects has
/// 1024, so each of its objects is sampled. At most 4 MiB + 2 × 1 MiB of reads.
pub const DATA_CHECK_OBJECTS_MAX: u64 = 1024;
/// Sample reads in flight at once.
const DATA_CHECK_IODEPTH: usize = 16;

/// Where [`find_data`] reads: `(offset, length)` ranges inside the first
/// `region_bytes` of a volume of `object_bytes` objects, in ascending order.
pub fn data_check_samples(region_bytes: u64, object_bytes: u64) -> Vec<(u64, u64)> {
    let mut ranges = Vec::new();
    if region_bytes == 0 {
        return ranges;
    }
    let edge = DATA_CHECK_EDGE_BYTES.min(region_bytes);
    ranges.push((0, edge));
    let object_bytes = object_bytes.max(1);
    let objects = region_bytes.div_ceil(object_bytes);
    let sampled = objects.min(DATA_CHECK_OBJECTS_MAX);
    for i in 0..sampled {
        // Evenly spread: object i × objects / sampled (all of them when sampled == objects).
        let index = (u128::from(i) * u128::from(objects) / u128::from(sampled)) as u64;
        let start = index * object_bytes;
        if start < edge {
            continue;
        }
        ranges.push((start, DATA_CHECK_OBJECT_BYTES.min(region_bytes - start)));
    }
    let tail = region_bytes.saturating_sub(DATA_CHECK_EDGE_BYTES).max(edge);
    if tail < region_bytes {
        ranges.push((tail, region_bytes - tail));
    }
    ranges
}

/// Looks for data a write benchmark would destroy: reads the samples of
/// [`data_check_samples`] and returns the offset of the first non-zero byte found,
/// or `None` if every sampled byte is zero.
///
/// This is a sample, not a proof: cheap (at most about 6 MiB of reads), and it
/// catches every partitioned or formatted volume, since partition tables and file
/// systems always write their first blocks; it misses data written only at places
/// it does not read. Never-written blocks read as zeroes, so a new volume passes.
pub async fn find_data(volume: &Volume, region_bytes: u64) -> Result<Option<u64>, ClientError> {
    let region = region_bytes.min(volume.size());
    let samples = Rc::new(data_check_samples(region, u64::from(volume.object_size())));
    let found: Rc<Cell<Option<u64>>> = Rc::new(Cell::new(None));
    let error: Rc<RefCell<Option<ClientError>>> = Rc::new(RefCell::new(None));
    let tasks: Vec<_> = (0..DATA_CHECK_IODEPTH)
        .map(|t| {
            let (volume, samples, found, error) = (
                volume.clone(),
                samples.clone(),
                found.clone(),
                error.clone(),
            );
            reactor::spawn(async move {
                for &(offset, len) in samples.iter().skip(t).step_by(DATA_CHECK_IODEPTH) {
                    if error.borrow().is_some() {
                        return;
                    }
                    match volume.read_at(offset, len as usize).await {
                        Ok(bytes) => {
                            if let Some(i) = bytes.iter().position(|&b| b != 0) {
                                let at = offset + i as u64;
                                found.set(Some(found.get().map_or(at, |f| f.min(at))));
                                return;
                            }
                        }
                        Err(e) => {
                            error.borrow_mut().get_or_insert(e);
                            return;
                        }
                    }
                }
            })
        })
        .collect();
    for t in tasks {
        t.await;
    }
    if let Some(e) = error.borrow_mut().take() {
        return Err(e);
    }
    Ok(found.get())
}

/// The bytes a run with `cfg` may write: the start of the volume, up to `--size-limit`.
pub fn region_bytes(cfg: &BenchConfig, volume_size: u64) -> u64 {
    cfg.size_limit.unwrap_or(volume_size).min(volume_size)
}

/// Shared state of the worker tasks (one thread, so `Rc`/`Cell`).
struct State {
    next_block: Cell<u64>,
    stop: Cell<bool>,
    error: RefCell<Option<ClientError>>,
    hist: RefCell<Histogram<u64>>,
    ops: Cell<u64>,
}

/// Runs the benchmark on the current reactor thread. Stops at the first I/O error
/// and returns it.
pub async fn run(volume: &Volume, cfg: &BenchConfig) -> Result<BenchReport, ClientError> {
    let blocks = blocks_for(cfg, volume.size())?;
    let hist = Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3)
        .map_err(|e| ClientError::InvalidArgument(format!("histogram: {e}")))?;
    let state = Rc::new(State {
        next_block: Cell::new(0),
        stop: Cell::new(false),
        error: RefCell::new(None),
        hist: RefCell::new(hist),
        ops: Cell::new(0),
    });
    let mut fill = vec![0u8; cfg.block_bytes as usize];
    SmallRng::seed_from_u64(cfg.seed ^ 0xf1a3e).fill(&mut fill[..]);
    // One payload buffer shared by every write (an application with its data in a
    // payload buffer already): the benchmark measures Flame, not a copy per write.
    let fill = flame_common::buffer::PayloadBuf::copy_from(&fill);
    let started = clock::now();
    let end = started + cfg.runtime;
    let tasks: Vec<_> = (0..cfg.iodepth)
        .map(|i| {
            let worker = Worker {
                volume: volume.clone(),
                cfg: cfg.clone(),
                blocks,
                state: state.clone(),
                fill: fill.clone(),
                rng: SmallRng::seed_from_u64(cfg.seed.wrapping_add(i as u64)),
                end,
            };
            reactor::spawn(worker.run())
        })
        .collect();
    for t in tasks {
        t.await;
    }
    let elapsed = clock::elapsed(started).as_secs_f64().max(1e-9);
    if let Some(e) = state.error.borrow_mut().take() {
        return Err(e);
    }
    let hist = state.hist.borrow();
    let ops = state.ops.get();
    let bytes = ops * cfg.block_bytes;
    Ok(BenchReport {
        volume: volume.name().to_string(),
        pattern: cfg.pattern,
        block_bytes: cfg.block_bytes,
        iodepth: cfg.iodepth,
        region_bytes: blocks * cfg.block_bytes,
        elapsed_s: elapsed,
        ops,
        bytes,
        iops: ops as f64 / elapsed,
        mib_per_s: bytes as f64 / elapsed / f64::from(1 << 20),
        latency: Latency {
            p50_us: hist.value_at_quantile(0.50),
            p99_us: hist.value_at_quantile(0.99),
            p999_us: hist.value_at_quantile(0.999),
            max_us: hist.max(),
            mean_us: hist.mean(),
        },
    })
}

struct Worker {
    volume: Volume,
    cfg: BenchConfig,
    blocks: u64,
    state: Rc<State>,
    fill: flame_common::buffer::PayloadBuf,
    rng: SmallRng,
    end: Instant,
}

impl Worker {
    async fn run(mut self) {
        let bs = self.cfg.block_bytes;
        while !self.state.stop.get() && clock::now() < self.end {
            let block = if self.cfg.pattern.is_random() {
                self.rng.random_range(0..self.blocks)
            } else {
                let b = self.state.next_block.get();
                self.state.next_block.set((b + 1) % self.blocks);
                b
            };
            let offset = block * bs;
            let t0 = clock::now();
            let res = if self.cfg.pattern.is_write() {
                self.volume
                    .write_buf(offset, self.fill.clone(), false)
                    .await
            } else {
                self.volume.read_bufs(offset, bs as usize).await.map(|_| ())
            };
            match res {
                Ok(()) => {
                    let us = clock::elapsed(t0).as_micros().max(1) as u64;
                    self.state.hist.borrow_mut().saturating_record(us);
                    self.state.ops.set(self.state.ops.get() + 1);
                }
                Err(e) => {
                    self.state.stop.set(true);
                    let mut slot = self.state.error.borrow_mut();
                    if slot.is_none() {
                        *slot = Some(e);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> BenchConfig {
        BenchConfig {
            pattern: Pattern::Randread,
            block_bytes: 4096,
            iodepth: 32,
            runtime: Duration::from_secs(1),
            size_limit: None,
            seed: 1,
        }
    }

    #[test]
    fn data_check_samples_cover_edges_and_objects() {
        let mib = 1u64 << 20;
        // 4 GiB of 4 MiB objects: the first MiB, then every object from the second
        // on, then the last MiB.
        let s = data_check_samples(4 << 30, 4 * mib);
        assert_eq!(s[0], (0, mib));
        assert_eq!(s[1], (4 * mib, 4096));
        assert_eq!(s.len(), 1 + 1023 + 1);
        assert_eq!(*s.last().unwrap(), ((4 << 30) - mib, mib));
        assert!(
            s.windows(2).all(|w| w[0].0 + w[0].1 <= w[1].0),
            "sorted, disjoint"
        );
        let total: u64 = s.iter().map(|r| r.1).sum();
        assert!(total <= 2 * mib + DATA_CHECK_OBJECTS_MAX * 4096);
        // A huge volume: still at most 1024 objects sampled, spread to the end.
        let s = data_check_samples(1 << 50, 4 * mib);
        assert!(s.len() <= 1026);
        assert!(s[s.len() - 2].0 > (1 << 50) - (1 << 50) / 512);
        // Smaller than the edges: one range, the whole region.
        assert_eq!(data_check_samples(8192, 4 * mib), vec![(0, 8192)]);
        assert_eq!(
            data_check_samples(mib + 4096, 4 * mib),
            vec![(0, mib), (mib, 4096)]
        );
        assert!(data_check_samples(0, 4 * mib).is_empty());
    }

    #[test]
    fn block_count_and_bounds() {
        assert_eq!(blocks_for(&cfg(), 1 << 20).unwrap(), 256);
        let limited = BenchConfig {
            size_limit: Some(8192 + 100),
            ..cfg()
        };
        assert_eq!(blocks_for(&limited, 1 << 20).unwrap(), 2);
        // A limit larger than the volume is clamped to it.
        let big = BenchConfig {
            size_limit: Some(1 << 40),
            ..cfg()
        };
        assert_eq!(blocks_for(&big, 1 << 20).unwrap(), 256);
        assert!(blocks_for(&cfg(), 100).is_err());
        let zero_depth = BenchConfig {
            iodepth: 0,
            ..cfg()
        };
        assert!(blocks_for(&zero_depth, 1 << 20).is_err());
        let zero_bs = BenchConfig {
            block_bytes: 0,
            ..cfg()
        };
        assert!(blocks_for(&zero_bs, 1 << 20).is_err());
    }
}
