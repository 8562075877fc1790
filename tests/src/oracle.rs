//! A write oracle: a verified block workload through the real client library.
//!
//! Modelled on the write log of Crucible's test client (`crutest`): every 4 KiB
//! block written carries a per-block write counter, and the workload remembers, per
//! block, the counter of the last write that was **acknowledged** and of the last
//! write that was **issued**. A read of a block must return a counter `c` with
//! `last_acked <= c <= last_issued` (taken over the read's lifetime: `last_acked`
//! when the read was sent, `last_issued` when it returned), and the block's bytes
//! must be exactly what counter `c` encodes. So the oracle catches:
//!
//! * a lost acknowledged write (a stale read: `c < last_acked`);
//! * a write applied that was never issued, or a block from another volume or
//!   position (`c > last_issued`, wrong magic, wrong index);
//! * a torn or corrupt block (bytes that are not the encoding of any single write);
//! * a write the client gave up on that lands after a newer one (stale again).
//!
//! Block format (little-endian):
//!
//! | bytes | content |
//! |---|---|
//! | 0..8 | magic, unique per volume and run |
//! | 8..16 | block index in the volume |
//! | 16..24 | write counter (≥ 1; an all-zero block is counter 0: never written) |
//! | 24..4092 | pseudo-random pattern derived from (magic, index, counter) |
//! | 4092..4096 | crc32c of bytes 0..4092 |
//!
//! Writers own disjoint block ranges, so each block's counter is incremented by one
//! task only and "issued" and "acknowledged" are well defined; several writers run
//! concurrently on one reactor thread. Reads may cover any block, including ones
//! another writer is writing. Every loop is bounded by an operation count and a
//! duration.
//!
//! A writer may also have several overlapping writes in flight (the simulator's
//! writers do). Their order is then not defined — the client may re-issue an
//! earlier one after a later one landed (`status::SUPERSEDED`) — so a block may
//! legitimately end with an earlier counter than the newest acknowledged one.
//! The oracle keeps when each write was issued and acknowledged (a logical clock)
//! and accepts counter `c` for a read sent at `t` exactly when `c` could be the
//! block's last write in some order consistent with real time: no write
//! acknowledged before `t` was issued after `c` ended. A write ends when it is
//! acknowledged or given up on: one given up on (never acknowledged) was in flight
//! until then, so it may have landed after a write issued while it was in flight
//! (the client re-issues a superseded write as a new operation), but never after
//! one issued once it was given up (the OSDs refuse it as superseded). With one
//! write in flight per writer this is the same as `last_acked <= c <= last_issued`.

use crate::pattern;
use flame_client::{ClientConfig, Cluster, Volume};
use flame_common::placement::mix64;
use flame_common::reactor::{Reactor, ReactorConfig};
use std::cell::RefCell;
use std::fmt;
use std::ops::Range;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Bytes per oracle block (the client's and the OSDs' checksum block size).
pub const BLOCK: usize = 4096;
const BLOCK_U64: u64 = BLOCK as u64;
/// Where the crc32c sits in a block.
const CRC_AT: usize = BLOCK - 4;
/// Error messages kept in full in a report (the count is always exact).
const ERROR_SAMPLES_MAX: usize = 20;
/// Slow operations kept for the failover numbers.
const SLOW_OPS_MAX: usize = 10_000;
/// An operation slower than this is recorded as a stall.
pub const SLOW_OP: Duration = Duration::from_millis(100);
/// Blocks per request in the verification pass.
const VERIFY_CHUNK_BLOCKS: u64 = 256;

/// The bytes of block `index` at write `counter` of the volume identified by
/// `magic`. Counter 0 is the never-written block: all zero.
pub fn encode_block(magic: u64, index: u64, counter: u64) -> Vec<u8> {
    if counter == 0 {
        return vec![0; BLOCK];
    }
    let mut b = Vec::with_capacity(BLOCK);
    b.extend_from_slice(&magic.to_le_bytes());
    b.extend_from_slice(&index.to_le_bytes());
    b.extend_from_slice(&counter.to_le_bytes());
    let seed = mix64(magic ^ mix64(index ^ mix64(counter)));
    b.extend_from_slice(&pattern(seed, CRC_AT - 24));
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    debug_assert_eq!(b.len(), BLOCK);
    b
}

/// What is wrong with a block that was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlockError {
    /// The block is not the encoding of any single write of this block: torn,
    /// corrupt, or a different block's bytes.
    Torn {
        /// Block index.
        index: u64,
        /// What the header said (magic, index, counter) and what differed.
        detail: String,
    },
    /// Older than the last acknowledged write: an acknowledged write was lost (or a
    /// write the client gave up on landed after a newer one).
    Stale {
        /// Block index.
        index: u64,
        /// Counter read.
        read: u64,
        /// Last acknowledged counter when the read was sent.
        acked: u64,
    },
    /// Newer than the last issued write: data that was never written.
    TooNew {
        /// Block index.
        index: u64,
        /// Counter read.
        read: u64,
        /// Last issued counter when the read returned.
        issued: u64,
    },
}

impl fmt::Display for BlockError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlockError::Torn { index, detail } => write!(f, "block {index}: torn: {detail}"),
            BlockError::Stale { index, read, acked } => write!(
                f,
                "block {index}: stale: read counter {read} < last acknowledged {acked}"
            ),
            BlockError::TooNew {
                index,
                read,
                issued,
            } => write!(
                f,
                "block {index}: too new: read counter {read} > last issued {issued}"
            ),
        }
    }
}

/// Decodes and checks one block read at `index`: `Ok(counter)` if the bytes are
/// exactly the encoding of some counter within `[acked, issued]`.
pub fn check_block(
    magic: u64,
    index: u64,
    data: &[u8],
    acked: u64,
    issued: u64,
) -> Result<u64, BlockError> {
    let torn = |detail: String| BlockError::Torn { index, detail };
    if data.len() != BLOCK {
        return Err(torn(format!("{} bytes, not {BLOCK}", data.len())));
    }
    let word = |at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&data[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let (m, i, counter) = (word(0), word(8), word(16));
    let counter = if data.iter().all(|&b| b == 0) {
        0
    } else {
        if m != magic || i != index || counter == 0 {
            return Err(torn(format!(
                "header (magic {m:#x}, index {i}, counter {counter}) is not this block's \
                 (magic {magic:#x}, index {index})"
            )));
        }
        let want = encode_block(magic, index, counter);
        if let Some(at) = data.iter().zip(&want).position(|(a, b)| a != b) {
            let mut crc = [0u8; 4];
            crc.copy_from_slice(&data[CRC_AT..]);
            let crc_ok = u32::from_le_bytes(crc) == crc32c::crc32c(&data[..CRC_AT]);
            return Err(torn(format!(
                "counter {counter} in the header, but byte {at} differs from its pattern \
                 (block crc {})",
                if crc_ok { "matches" } else { "does not match" }
            )));
        }
        counter
    };
    if counter < acked {
        return Err(BlockError::Stale {
            index,
            read: counter,
            acked,
        });
    }
    if counter > issued {
        return Err(BlockError::TooNew {
            index,
            read: counter,
            issued,
        });
    }
    Ok(counter)
}

/// What the workload knows about one block.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BlockState {
    /// Highest counter of an acknowledged write (0: none).
    pub acked: u64,
    /// Counter of the last issued write (acknowledged, failed or in flight).
    pub issued: u64,
    /// The latest issue time ([`OracleState`]'s logical clock) of an
    /// acknowledged write: a write acknowledged before it is superseded.
    pub acked_issued_at: u64,
}

/// When one write of one block was issued and how it ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct WriteRecord {
    issued_at: u64,
    /// When it was acknowledged (0: not, or not yet).
    acked_at: u64,
    /// When the writer gave up on it (0: it did not, or not yet): never
    /// acknowledged, it was in flight until then.
    given_up_at: u64,
    /// A write-zeroes or discard: its content is all zero, like the
    /// never-written block's.
    zero: bool,
}

impl WriteRecord {
    /// When it stopped being in flight as far as real time can tell (`None`: it
    /// still is).
    fn ended_at(&self) -> Option<u64> {
        [self.acked_at, self.given_up_at]
            .into_iter()
            .find(|&t| t != 0)
    }
}

/// What a read must not go below, per block, taken when it is sent
/// ([`OracleState::lower_bounds`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadBound {
    /// Highest counter acknowledged.
    pub acked: u64,
    /// Latest issue time of an acknowledged write.
    pub acked_issued_at: u64,
}

/// The oracle's memory of a whole volume.
#[derive(Clone, Debug)]
pub struct OracleState {
    /// Volume-unique magic in every block written.
    pub magic: u64,
    /// Per block.
    pub blocks: Vec<BlockState>,
    /// Per block, per counter (`counter - 1`): its write's times.
    writes: Vec<Vec<WriteRecord>>,
    /// The logical clock: one tick per issue and acknowledgement.
    now: u64,
}

impl OracleState {
    /// A fresh (never written) volume of `size_bytes`.
    pub fn new(magic: u64, size_bytes: u64) -> OracleState {
        assert!(
            size_bytes.is_multiple_of(BLOCK_U64) && size_bytes > 0,
            "volume size {size_bytes} must be a positive multiple of {BLOCK}"
        );
        let n = usize::try_from(size_bytes / BLOCK_U64).unwrap_or(usize::MAX);
        OracleState {
            magic,
            blocks: vec![BlockState::default(); n],
            writes: vec![Vec::new(); n],
            now: 0,
        }
    }

    /// Number of blocks.
    pub fn block_count(&self) -> u64 {
        self.blocks.len() as u64
    }

    /// Blocks with at least one acknowledged write.
    pub fn written_blocks(&self) -> u64 {
        self.blocks.iter().filter(|b| b.acked > 0).count() as u64
    }

    /// Marks a write of `blocks` issued and returns its payload (each block's next
    /// counter).
    pub fn issue_write(&mut self, blocks: Range<u64>) -> (Vec<u8>, Vec<u64>) {
        let mut data = Vec::with_capacity((blocks.end - blocks.start) as usize * BLOCK);
        let mut counters = Vec::new();
        self.now += 1;
        for i in blocks {
            let b = &mut self.blocks[i as usize];
            assert!(b.acked <= b.issued, "block {i}: acked {b:?} > issued");
            b.issued += 1;
            let w = &mut self.writes[i as usize];
            // Counters are dense per block: record `c` sits at `c - 1`.
            w.resize(b.issued as usize - 1, WriteRecord::default());
            w.push(WriteRecord {
                issued_at: self.now,
                ..WriteRecord::default()
            });
            data.extend_from_slice(&encode_block(self.magic, i, b.issued));
            counters.push(b.issued);
        }
        (data, counters)
    }

    /// Marks a write-zeroes or discard of `blocks` issued (each block's next
    /// counter, whose content is all zero) and returns its counters, for
    /// [`OracleState::ack_write`] and [`OracleState::give_up_write`].
    pub fn issue_zero(&mut self, blocks: Range<u64>) -> Vec<u64> {
        let start = blocks.start;
        let (_, counters) = self.issue_write(blocks);
        for (k, &c) in counters.iter().enumerate() {
            if let Some(r) = self.writes[start as usize + k].get_mut(c as usize - 1) {
                r.zero = true;
            }
        }
        counters
    }

    /// Records the acknowledgement of a write issued with `counters` from `start`.
    pub fn ack_write(&mut self, start: u64, counters: &[u64]) {
        self.now += 1;
        for (k, &c) in counters.iter().enumerate() {
            let i = start as usize + k;
            let b = &mut self.blocks[i];
            assert!(
                c <= b.issued && c > 0,
                "ack of counter {c} never issued: {b:?}"
            );
            b.acked = b.acked.max(c);
            if let Some(r) = self.writes[i].get_mut(c as usize - 1) {
                assert!(r.ended_at().is_none(), "block {i}: counter {c} ended twice");
                r.acked_at = self.now;
                b.acked_issued_at = b.acked_issued_at.max(r.issued_at);
            }
        }
    }

    /// Records that the writer gave up on a write issued with `counters` from
    /// `start` (it failed or timed out): it is never acknowledged; it may have
    /// landed after writes issued while it was in flight, never after one issued
    /// from now on.
    pub fn give_up_write(&mut self, start: u64, counters: &[u64]) {
        self.now += 1;
        for (k, &c) in counters.iter().enumerate() {
            let i = start as usize + k;
            if let Some(r) = c
                .checked_sub(1)
                .and_then(|c| self.writes[i].get_mut(c as usize))
            {
                assert!(
                    r.ended_at().is_none(),
                    "block {i}: counter {c} given up after it ended"
                );
                r.given_up_at = self.now;
            }
        }
    }

    /// Block `i`'s history as the oracle saw it (its last writes, by counter, with
    /// logical issue, acknowledgement and give-up times): for a failure's report.
    pub fn history(&self, i: u64) -> String {
        let Some(b) = self.blocks.get(i as usize) else {
            return format!("block {i}: outside the volume");
        };
        let writes = &self.writes[i as usize];
        let mut out = format!(
            "block {i}: acked {}, issued {}; clock now {}; last writes:",
            b.acked, b.issued, self.now
        );
        for (k, r) in writes
            .iter()
            .enumerate()
            .skip(writes.len().saturating_sub(6))
        {
            out += &format!(
                " [{} {}issued@{}{}{}]",
                k + 1,
                if r.zero { "zeroing, " } else { "" },
                r.issued_at,
                if r.acked_at != 0 {
                    format!(" acked@{}", r.acked_at)
                } else {
                    String::new()
                },
                if r.given_up_at != 0 {
                    format!(" given up@{}", r.given_up_at)
                } else {
                    String::new()
                },
            );
        }
        out
    }

    /// Lower bounds of `blocks`, taken when a read is sent.
    pub fn lower_bounds(&self, blocks: Range<u64>) -> Vec<ReadBound> {
        blocks
            .map(|i| {
                let b = &self.blocks[i as usize];
                ReadBound {
                    acked: b.acked,
                    acked_issued_at: b.acked_issued_at,
                }
            })
            .collect()
    }

    /// Checks a read of `blocks` (`data` covering all of them) against `lower`
    /// (the bounds when it was sent) and what was issued and acknowledged since.
    /// Returns the errors found (empty: every block checks).
    pub fn check_read(
        &self,
        blocks: Range<u64>,
        lower: &[ReadBound],
        data: &[u8],
    ) -> Vec<BlockError> {
        let mut errors = Vec::new();
        for (k, i) in blocks.clone().enumerate() {
            let bytes = data.get(k * BLOCK..(k + 1) * BLOCK).unwrap_or(&[]);
            let issued = self.blocks[i as usize].issued;
            let bound = lower[k];
            match check_block(self.magic, i, bytes, 0, issued) {
                Err(e) => errors.push(e),
                Ok(c) if c > 0 && self.is_zero_write(i, c) => errors.push(BlockError::Torn {
                    index: i,
                    detail: format!("counter {c} was a write-zeroes or discard, not data"),
                }),
                // All zero: never written, or any zeroing write.
                Ok(0) if self.zero_may_be_last(i, bound) => {}
                Ok(c) if c > 0 && self.may_be_last(i, c, bound) => {}
                Ok(c) => errors.push(BlockError::Stale {
                    index: i,
                    read: c,
                    acked: bound.acked,
                }),
            }
        }
        errors
    }

    fn is_zero_write(&self, i: u64, c: u64) -> bool {
        c.checked_sub(1)
            .and_then(|c| self.writes[i as usize].get(c as usize))
            .is_some_and(|r| r.zero)
    }

    /// Whether an all-zero block `i` can be its content for a read sent when the
    /// bounds were `bound`: the never-written content, or a write-zeroes or
    /// discard that may be the last write.
    fn zero_may_be_last(&self, i: u64, bound: ReadBound) -> bool {
        self.may_be_last(i, 0, bound)
            || self.writes[i as usize]
                .iter()
                .enumerate()
                .any(|(k, r)| r.zero && self.may_be_last(i, k as u64 + 1, bound))
    }

    /// Whether counter `c` of block `i` can be the block's content for a read
    /// sent when the bounds were `bound` (see the module's doc).
    fn may_be_last(&self, i: u64, c: u64, bound: ReadBound) -> bool {
        if c >= bound.acked {
            return true;
        }
        let Some(r) = c
            .checked_sub(1)
            .and_then(|c| self.writes[i as usize].get(c as usize))
        else {
            // The never-written content, below an acknowledged write.
            return false;
        };
        match r.ended_at() {
            // Still in flight: it may land after the later one.
            None => true,
            // It may have landed after every write acknowledged before the read
            // was sent only if it was still in flight when they were issued (a
            // write given up on never lands after one issued once it was).
            Some(ended_at) => ended_at > bound.acked_issued_at,
        }
    }
}

/// How the workload runs.
#[derive(Clone, Debug)]
pub struct WorkloadConfig {
    /// Concurrent writer tasks (each with one request in flight).
    pub writers: usize,
    /// The blocks written and read; split into one contiguous range per writer.
    /// `None`: the whole volume.
    pub blocks: Option<Range<u64>>,
    /// Upper bound on operations (reads + writes + flushes) of all writers.
    pub max_ops: u64,
    /// Upper bound on the run time (no new operation starts after it).
    pub max_duration: Duration,
    /// Largest request, in blocks.
    pub max_blocks_per_io: u64,
    /// Reads per thousand operations.
    pub reads_per_mille: u32,
    /// A writer flushes after this many of its writes (0: never).
    pub flush_every: u64,
    /// Seed of the writers' random choices.
    pub seed: u64,
    /// The client library's `io_timeout_ms`.
    pub io_timeout_ms: u64,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        WorkloadConfig {
            writers: 4,
            blocks: None,
            max_ops: 1_000_000,
            max_duration: Duration::from_secs(30),
            max_blocks_per_io: 16,
            reads_per_mille: 300,
            flush_every: 32,
            seed: 1,
            io_timeout_ms: 60_000,
        }
    }
}

/// One stalled operation (slower than [`SLOW_OP`]), in microseconds since the
/// workload started.
#[derive(Clone, Copy, Debug)]
pub struct SlowOp {
    /// "read", "write" or "flush".
    pub kind: &'static str,
    /// When it was sent.
    pub start_us: u64,
    /// When it completed (successfully or not).
    pub end_us: u64,
}

/// Counters shared with the controlling thread while the workload runs.
#[derive(Debug, Default)]
pub struct Progress {
    /// Write requests sent.
    pub writes_issued: AtomicU64,
    /// Write requests acknowledged.
    pub writes_acked: AtomicU64,
    /// Write requests that failed (the client library gave up).
    pub writes_failed: AtomicU64,
    /// Read requests whose every block checked.
    pub reads_verified: AtomicU64,
    /// Read requests that failed.
    pub reads_failed: AtomicU64,
    /// Flushes that succeeded / failed.
    pub flushes_ok: AtomicU64,
    /// Flushes that failed.
    pub flushes_failed: AtomicU64,
    /// Blocks whose check failed.
    pub errors: AtomicU64,
    /// Microseconds since start of the last acknowledgement (any operation).
    pub last_ack_us: AtomicU64,
    /// Operations in flight now.
    pub in_flight: AtomicU64,
    /// Longest gap between two successive acknowledgements, microseconds.
    pub longest_pause_us: AtomicU64,
    /// Longest single operation, microseconds.
    pub op_latency_us_max: AtomicU64,
    /// Operations slower than [`SLOW_OP`] (bounded list).
    pub slow_ops: Mutex<Vec<SlowOp>>,
    /// The first error messages (bounded list).
    pub error_samples: Mutex<Vec<String>>,
    /// When the workload started: the origin of every `_us` time here.
    pub started: std::sync::OnceLock<Instant>,
}

impl Progress {
    fn note_error(&self, msg: String) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let mut s = self.error_samples.lock().unwrap_or_else(|e| e.into_inner());
        if s.len() < ERROR_SAMPLES_MAX {
            s.push(msg);
        }
    }

    fn note_failure(&self, msg: String) {
        let mut s = self.error_samples.lock().unwrap_or_else(|e| e.into_inner());
        if s.len() < ERROR_SAMPLES_MAX {
            s.push(msg);
        }
    }

    /// Records a completed operation that ran `[start_us, end_us]`.
    fn note_done(&self, kind: &'static str, start_us: u64, end_us: u64, ok: bool) {
        self.op_latency_us_max
            .fetch_max(end_us.saturating_sub(start_us), Ordering::Relaxed);
        if end_us.saturating_sub(start_us) >= SLOW_OP.as_micros() as u64 {
            let mut s = self.slow_ops.lock().unwrap_or_else(|e| e.into_inner());
            if s.len() < SLOW_OPS_MAX {
                s.push(SlowOp {
                    kind,
                    start_us,
                    end_us,
                });
            }
        }
        if ok {
            let prev = self.last_ack_us.swap(end_us, Ordering::Relaxed);
            self.longest_pause_us
                .fetch_max(end_us.saturating_sub(prev), Ordering::Relaxed);
        }
    }
}

/// What a workload did.
#[derive(Clone, Debug, Default)]
pub struct WorkloadReport {
    /// Wall time.
    pub elapsed: Duration,
    /// Write requests sent.
    pub writes_issued: u64,
    /// Write requests acknowledged.
    pub writes_acked: u64,
    /// Write requests that failed.
    pub writes_failed: u64,
    /// Read requests that returned and checked.
    pub reads_verified: u64,
    /// Read requests that failed.
    pub reads_failed: u64,
    /// Flushes that failed.
    pub flushes_failed: u64,
    /// Blocks that failed their check (must be 0).
    pub errors: u64,
    /// Longest gap between successive acknowledgements (the client-visible stall).
    pub longest_pause: Duration,
    /// Longest single operation.
    pub op_latency_max: Duration,
    /// Operations slower than [`SLOW_OP`].
    pub slow_ops: Vec<SlowOp>,
    /// First error messages (check failures and I/O failures).
    pub error_samples: Vec<String>,
    /// Blocks checked by the final verification pass.
    pub blocks_verified: u64,
}

impl WorkloadReport {
    /// Whether nothing at all went wrong: no check failed and no I/O failed.
    pub fn clean(&self) -> bool {
        self.errors == 0
            && self.writes_failed == 0
            && self.reads_failed == 0
            && self.flushes_failed == 0
    }
}

impl fmt::Display for WorkloadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:.1} s: writes issued {} acked {} failed {}, reads verified {} failed {}, \
             flushes failed {}, blocks verified at the end {}, longest pause between acks \
             {} ms, slowest op {} ms, errors {}",
            self.elapsed.as_secs_f64(),
            self.writes_issued,
            self.writes_acked,
            self.writes_failed,
            self.reads_verified,
            self.reads_failed,
            self.flushes_failed,
            self.blocks_verified,
            self.longest_pause.as_millis(),
            self.op_latency_max.as_millis(),
            self.errors,
        )?;
        for e in &self.error_samples {
            write!(f, "\n  {e}")?;
        }
        Ok(())
    }
}

/// A tiny deterministic generator (splitmix-style over [`mix64`]).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.0)
    }

    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Creates volume `name` of `size` bytes on `cluster` and writes every block of it
/// through the oracle (state seeded with `mix64(volume id ^ seed)`), so a test
/// starts from a full volume whose every block is known. Returns the volume and
/// the oracle state after the fill.
pub fn create_filled(
    cluster: &crate::TestCluster,
    name: &str,
    size: u64,
    seed: u64,
    io_timeout_ms: u64,
) -> (flame_common::map::VolumeInfo, OracleState) {
    let vol = cluster.create_volume(name, size);
    let state = fill(
        &cluster.client_target(),
        name,
        OracleState::new(mix64(vol.id.0 ^ seed), size),
        0..size / BLOCK as u64,
        io_timeout_ms,
    );
    (vol, state)
}

/// Which cluster a test client connects to, and as whom: the manager's address
/// and the keyring to sign with (none for a cluster with `auth: none`).
#[derive(Clone, Debug)]
pub struct ClientTarget {
    /// The manager's address.
    pub mgr: String,
    /// The keyring of the entity the client signs as.
    pub keyring: Option<std::path::PathBuf>,
    /// The cluster CA when the manager serves TLS.
    pub mgr_tls_ca: Option<std::path::PathBuf>,
}

impl std::fmt::Display for ClientTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.mgr)
    }
}

/// Connects to the cluster and runs `f` with the opened volume on a fresh reactor
/// thread (the calling thread). Errors are returned as text.
pub fn with_volume<T, F, Fut>(
    mgr: &ClientTarget,
    volume: &str,
    io_timeout_ms: u64,
    f: F,
) -> Result<T, String>
where
    F: FnOnce(Volume) -> Fut + 'static,
    Fut: Future<Output = T> + 'static,
    T: 'static,
{
    let config = ClientConfig {
        io_timeout_ms,
        keyring: mgr.keyring.clone(),
        mgr_tls_ca: mgr.mgr_tls_ca.clone(),
        ..ClientConfig::new(mgr.mgr.clone())
    };
    let cluster = Cluster::connect(config).map_err(|e| format!("connect to {mgr}: {e}"))?;
    let mut reactor =
        Reactor::new(ReactorConfig::default()).map_err(|e| format!("reactor: {e}"))?;
    let name = volume.to_string();
    reactor
        .block_on(async move {
            let vol = cluster
                .open_volume(&name)
                .await
                .map_err(|e| format!("open volume {name}: {e}"))?;
            Ok::<T, String>(f(vol).await)
        })
        .map_err(|e| format!("reactor: {e}"))?
}

/// Microseconds since `t0`.
fn us_since(t0: Instant) -> u64 {
    u64::try_from(t0.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// What every writer task of one workload shares.
struct Shared {
    vol: Volume,
    state: RefCell<OracleState>,
    cfg: WorkloadConfig,
    /// The blocks reads choose from.
    read_range: Range<u64>,
    /// Operations started by all writers.
    ops: RefCell<u64>,
    progress: Arc<Progress>,
    stop: Arc<AtomicBool>,
    t0: Instant,
}

/// One writer: owns `range` (writes only there), reads anywhere in `read_range`.
async fn writer(sh: Rc<Shared>, range: Range<u64>, w: usize) {
    let (vol, state, cfg, progress, stop, t0) =
        (&sh.vol, &sh.state, &sh.cfg, &sh.progress, &sh.stop, sh.t0);
    let read_range = sh.read_range.clone();
    let ops = &sh.ops;
    let mut rng = Rng(mix64(cfg.seed ^ (w as u64).wrapping_mul(0x1234_5678_9abc)));
    let mut writes_since_flush = 0u64;
    loop {
        if stop.load(Ordering::Relaxed) || t0.elapsed() >= cfg.max_duration {
            return;
        }
        {
            let mut n = ops.borrow_mut();
            if *n >= cfg.max_ops {
                return;
            }
            *n += 1;
        }
        let want_read = rng.below(1000) < u64::from(cfg.reads_per_mille);
        let pick = |rng: &mut Rng, r: &Range<u64>| {
            let len = 1 + rng.below(cfg.max_blocks_per_io.min(r.end - r.start));
            let start = r.start + rng.below(r.end - r.start - len + 1);
            start..start + len
        };
        let start_us = us_since(t0);
        progress.in_flight.fetch_add(1, Ordering::Relaxed);
        let ok;
        let kind;
        if cfg.flush_every > 0 && writes_since_flush >= cfg.flush_every {
            writes_since_flush = 0;
            kind = "flush";
            match vol.flush().await {
                Ok(()) => {
                    ok = true;
                    progress.flushes_ok.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    ok = false;
                    progress.flushes_failed.fetch_add(1, Ordering::Relaxed);
                    progress.note_failure(format!("writer {w}: flush failed: {e}"));
                }
            }
        } else if want_read || range.is_empty() {
            kind = "read";
            let blocks = pick(&mut rng, &read_range);
            let lower = state.borrow().lower_bounds(blocks.clone());
            let len = ((blocks.end - blocks.start) * BLOCK_U64) as usize;
            match vol.read_at(blocks.start * BLOCK_U64, len).await {
                Ok(data) => {
                    let errors = state.borrow().check_read(blocks.clone(), &lower, &data);
                    ok = true;
                    if errors.is_empty() {
                        progress.reads_verified.fetch_add(1, Ordering::Relaxed);
                    }
                    for e in errors {
                        progress.note_error(format!("writer {w}: read: {e}"));
                    }
                }
                Err(e) => {
                    ok = false;
                    progress.reads_failed.fetch_add(1, Ordering::Relaxed);
                    progress.note_failure(format!("writer {w}: read {blocks:?} failed: {e}"));
                }
            }
        } else {
            kind = "write";
            let blocks = pick(&mut rng, &range);
            let (data, counters) = state.borrow_mut().issue_write(blocks.clone());
            progress.writes_issued.fetch_add(1, Ordering::Relaxed);
            writes_since_flush += 1;
            match vol.write_at(blocks.start * BLOCK_U64, &data, false).await {
                Ok(()) => {
                    ok = true;
                    state.borrow_mut().ack_write(blocks.start, &counters);
                    progress.writes_acked.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    ok = false;
                    state.borrow_mut().give_up_write(blocks.start, &counters);
                    progress.writes_failed.fetch_add(1, Ordering::Relaxed);
                    progress.note_failure(format!("writer {w}: write {blocks:?} failed: {e}"));
                }
            }
        }
        progress.in_flight.fetch_sub(1, Ordering::Relaxed);
        progress.note_done(kind, start_us, us_since(t0), ok);
    }
}

/// Runs the workload on `vol` until `stop`, `max_ops` or `max_duration`, then the
/// final verification pass over every block. Returns the report and the oracle's
/// final state.
pub async fn run_workload(
    vol: Volume,
    state: OracleState,
    cfg: WorkloadConfig,
    progress: Arc<Progress>,
    stop: Arc<AtomicBool>,
) -> (WorkloadReport, OracleState) {
    let t0 = *progress.started.get_or_init(Instant::now);
    let total = state.block_count();
    let range = cfg.blocks.clone().unwrap_or(0..total);
    assert!(
        range.start < range.end && range.end <= total,
        "workload blocks {range:?} outside the volume's {total}"
    );
    assert!(cfg.writers > 0 && cfg.max_blocks_per_io > 0);
    let span = range.end - range.start;
    let writers = (cfg.writers as u64).min(span);
    let sh = Rc::new(Shared {
        vol: vol.clone(),
        state: RefCell::new(state),
        cfg,
        read_range: range.clone(),
        ops: RefCell::new(0),
        progress: progress.clone(),
        stop,
        t0,
    });
    let mut tasks = Vec::new();
    for w in 0..writers {
        let own = range.start + span * w / writers..range.start + span * (w + 1) / writers;
        tasks.push(flame_common::reactor::spawn(writer(
            sh.clone(),
            own,
            w as usize,
        )));
    }
    for t in tasks {
        t.await;
    }
    // A stall that lasted until the end counts too.
    progress.note_done("end", us_since(t0), us_since(t0), true);
    let elapsed = t0.elapsed();
    let state = sh.state.borrow().clone();
    let verified = verify_blocks(&vol, &state, 0..total, &progress).await;
    let report = make_report(&progress, elapsed, verified);
    (report, state)
}

fn make_report(progress: &Progress, elapsed: Duration, blocks_verified: u64) -> WorkloadReport {
    let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
    WorkloadReport {
        elapsed,
        writes_issued: get(&progress.writes_issued),
        writes_acked: get(&progress.writes_acked),
        writes_failed: get(&progress.writes_failed),
        reads_verified: get(&progress.reads_verified),
        reads_failed: get(&progress.reads_failed),
        flushes_failed: get(&progress.flushes_failed),
        errors: get(&progress.errors),
        longest_pause: Duration::from_micros(get(&progress.longest_pause_us)),
        op_latency_max: Duration::from_micros(get(&progress.op_latency_us_max)),
        slow_ops: progress
            .slow_ops
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone(),
        error_samples: progress
            .error_samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone(),
        blocks_verified,
    }
}

/// Reads every block of `blocks` and checks it against `state` (nothing may be in
/// flight). Check failures and read failures go to `progress`; returns the number
/// of blocks that checked.
pub async fn verify_blocks(
    vol: &Volume,
    state: &OracleState,
    blocks: Range<u64>,
    progress: &Progress,
) -> u64 {
    let mut verified = 0;
    let mut at = blocks.start;
    while at < blocks.end {
        let end = (at + VERIFY_CHUNK_BLOCKS).min(blocks.end);
        let lower = state.lower_bounds(at..end);
        match vol
            .read_at(at * BLOCK_U64, ((end - at) * BLOCK_U64) as usize)
            .await
        {
            Ok(data) => {
                let errors = state.check_read(at..end, &lower, &data);
                verified += (end - at) - errors.len() as u64;
                for e in errors {
                    progress.note_error(format!("verify: {e}"));
                }
            }
            Err(e) => {
                progress.reads_failed.fetch_add(1, Ordering::Relaxed);
                progress.note_failure(format!("verify: read of blocks {at}..{end} failed: {e}"));
            }
        }
        at = end;
    }
    verified
}

/// A workload running on its own thread, controlled from the test's thread.
pub struct Workload {
    stop: Arc<AtomicBool>,
    progress: Arc<Progress>,
    started: Instant,
    thread: Option<std::thread::JoinHandle<Result<(WorkloadReport, OracleState), String>>>,
}

impl Workload {
    /// Starts the workload on `volume` of the cluster whose manager is `mgr`,
    /// continuing from `state` (a fresh [`OracleState`] for a new volume).
    pub fn start(
        mgr: &ClientTarget,
        volume: &str,
        state: OracleState,
        cfg: WorkloadConfig,
    ) -> Workload {
        let stop = Arc::new(AtomicBool::new(false));
        let progress = Arc::new(Progress::default());
        let (mgr, volume) = (mgr.clone(), volume.to_string());
        let (stop2, progress2) = (stop.clone(), progress.clone());
        let thread = std::thread::Builder::new()
            .name("oracle".into())
            .spawn(move || {
                let io_timeout_ms = cfg.io_timeout_ms;
                with_volume(&mgr, &volume, io_timeout_ms, move |vol| {
                    run_workload(vol, state, cfg, progress2, stop2)
                })
            })
            .unwrap_or_else(|e| panic!("cannot start the oracle thread: {e}"));
        Workload {
            stop,
            progress,
            started: Instant::now(),
            thread: Some(thread),
        }
    }

    /// Live counters.
    pub fn progress(&self) -> &Progress {
        &self.progress
    }

    /// Acknowledged operations so far (writes + verified reads).
    pub fn acks(&self) -> u64 {
        self.progress.writes_acked.load(Ordering::Relaxed)
            + self.progress.reads_verified.load(Ordering::Relaxed)
    }

    /// Time since the workload was started.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// Microseconds on the workload's clock (the origin of [`SlowOp`] times and
    /// `last_ack_us`); 0 before its first operation.
    pub fn now_us(&self) -> u64 {
        self.progress.started.get().map_or(0, |t0| us_since(*t0))
    }

    /// Waits until `n` more operations were acknowledged than now, up to `timeout`;
    /// returns whether they were.
    pub fn wait_more_acks(&self, n: u64, timeout: Duration) -> bool {
        let want = self.acks() + n;
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if self.acks() >= want {
                return true;
            }
            if self.thread.as_ref().is_none_or(|t| t.is_finished()) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.acks() >= want
    }

    /// Whether the workload thread has finished (its bounds ran out).
    pub fn finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Stops the workload, waits for it (in-flight requests end within the client's
    /// io timeout) and for the final verification pass; returns the report and the
    /// final oracle state. Panics if the workload could not run at all.
    pub fn stop(mut self) -> (WorkloadReport, OracleState) {
        self.stop.store(true, Ordering::Relaxed);
        let Some(thread) = self.thread.take() else {
            panic!("workload already stopped");
        };
        match thread.join() {
            Ok(Ok(r)) => r,
            Ok(Err(e)) => panic!("oracle workload could not run: {e}"),
            Err(_) => panic!("oracle workload thread panicked"),
        }
    }
}

impl Drop for Workload {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Reads and checks every block of the volume against `state` (nothing else may
/// write it meanwhile). Returns a report with `blocks_verified`, `errors` and
/// `reads_failed` set.
pub fn verify_volume(
    mgr: &ClientTarget,
    volume: &str,
    state: &OracleState,
    io_timeout_ms: u64,
) -> WorkloadReport {
    let progress = Arc::new(Progress::default());
    let (p2, s2) = (progress.clone(), state.clone());
    let t0 = Instant::now();
    let result = with_volume(mgr, volume, io_timeout_ms, move |vol| async move {
        let n = s2.block_count();
        verify_blocks(&vol, &s2, 0..n, &p2).await
    });
    match result {
        Ok(verified) => make_report(&progress, t0.elapsed(), verified),
        Err(e) => panic!("verify {volume}: {e}"),
    }
}

/// Writes every block of `blocks` once (sequentially, in requests of up to 1 MiB),
/// flushes, and returns the updated state. Panics if any write fails.
pub fn fill(
    mgr: &ClientTarget,
    volume: &str,
    mut state: OracleState,
    blocks: Range<u64>,
    io_timeout_ms: u64,
) -> OracleState {
    let result = with_volume(mgr, volume, io_timeout_ms, move |vol| async move {
        let mut at = blocks.start;
        while at < blocks.end {
            let end = (at + VERIFY_CHUNK_BLOCKS).min(blocks.end);
            let (data, counters) = state.issue_write(at..end);
            vol.write_at(at * BLOCK_U64, &data, false)
                .await
                .map_err(|e| format!("fill: write of blocks {at}..{end}: {e}"))?;
            state.ack_write(at, &counters);
            at = end;
        }
        vol.flush().await.map_err(|e| format!("fill: flush: {e}"))?;
        Ok::<_, String>(state)
    });
    match result {
        Ok(Ok(s)) => s,
        Ok(Err(e)) | Err(e) => panic!("fill {volume}: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAGIC: u64 = 0xf1a3_e000_0000_0001;

    #[test]
    fn encoded_blocks_check_at_their_counter() {
        for c in [0, 1, 2, 1000] {
            let b = encode_block(MAGIC, 7, c);
            assert_eq!(check_block(MAGIC, 7, &b, 0, 1000), Ok(c));
        }
        assert_ne!(encode_block(MAGIC, 7, 1), encode_block(MAGIC, 7, 2));
        assert_ne!(encode_block(MAGIC, 7, 1), encode_block(MAGIC, 8, 1));
    }

    #[test]
    fn stale_read_is_detected() {
        let b = encode_block(MAGIC, 3, 4);
        assert!(matches!(
            check_block(MAGIC, 3, &b, 5, 6),
            Err(BlockError::Stale {
                read: 4,
                acked: 5,
                ..
            })
        ));
        // A never-written block when a write was acknowledged: lost write.
        assert!(matches!(
            check_block(MAGIC, 3, &[0u8; BLOCK], 1, 1),
            Err(BlockError::Stale { read: 0, .. })
        ));
    }

    #[test]
    fn too_new_read_is_detected() {
        let b = encode_block(MAGIC, 3, 9);
        assert!(matches!(
            check_block(MAGIC, 3, &b, 5, 8),
            Err(BlockError::TooNew {
                read: 9,
                issued: 8,
                ..
            })
        ));
    }

    #[test]
    fn torn_block_is_detected() {
        // First half of write 2, second half of write 3.
        let mut b = encode_block(MAGIC, 3, 2);
        b[BLOCK / 2..].copy_from_slice(&encode_block(MAGIC, 3, 3)[BLOCK / 2..]);
        let e = check_block(MAGIC, 3, &b, 0, 10).unwrap_err();
        assert!(matches!(e, BlockError::Torn { .. }), "{e}");
        // One flipped bit.
        let mut b = encode_block(MAGIC, 3, 2);
        b[1000] ^= 1;
        assert!(matches!(
            check_block(MAGIC, 3, &b, 0, 10),
            Err(BlockError::Torn { .. })
        ));
        // A correct block of another index or volume.
        let b = encode_block(MAGIC, 4, 2);
        assert!(matches!(
            check_block(MAGIC, 3, &b, 0, 10),
            Err(BlockError::Torn { .. })
        ));
        let b = encode_block(MAGIC + 1, 3, 2);
        assert!(matches!(
            check_block(MAGIC, 3, &b, 0, 10),
            Err(BlockError::Torn { .. })
        ));
        // Short data.
        assert!(check_block(MAGIC, 3, &[0u8; 100], 0, 0).is_err());
    }

    #[test]
    fn state_tracks_issue_and_ack() {
        let mut s = OracleState::new(MAGIC, 8 * BLOCK_U64);
        let (data, counters) = s.issue_write(2..4);
        assert_eq!(counters, vec![1, 1]);
        assert_eq!(data.len(), 2 * BLOCK);
        // In flight: both the old (zero) and the new content are acceptable.
        let lower = s.lower_bounds(2..4);
        assert!(s.check_read(2..4, &lower, &vec![0u8; 2 * BLOCK]).is_empty());
        assert!(s.check_read(2..4, &lower, &data).is_empty());
        s.ack_write(2, &counters);
        // Acknowledged: zero is now a lost write.
        let lower = s.lower_bounds(2..4);
        assert_eq!(s.check_read(2..4, &lower, &vec![0u8; 2 * BLOCK]).len(), 2);
        assert!(s.check_read(2..4, &lower, &data).is_empty());
        // A failed write (issued, never acked) keeps both counters acceptable.
        let (data2, c2) = s.issue_write(3..4);
        s.give_up_write(3, &c2);
        let lower = s.lower_bounds(3..4);
        assert!(s.check_read(3..4, &lower, &data2).is_empty());
        assert!(s.check_read(3..4, &lower, &data[BLOCK..]).is_empty());
        assert_eq!(s.written_blocks(), 2);
        // ... but once a later write is acknowledged, neither may show.
        let (data3, c3) = s.issue_write(3..4);
        s.ack_write(3, &c3);
        let lower = s.lower_bounds(3..4);
        assert_eq!(s.check_read(3..4, &lower, &data2).len(), 1);
        assert_eq!(s.check_read(3..4, &lower, &data[BLOCK..]).len(), 1);
        assert!(s.check_read(3..4, &lower, &data3).is_empty());
    }

    #[test]
    fn overlapping_writes_in_flight_together_may_land_in_either_order() {
        let mut s = OracleState::new(MAGIC, 4 * BLOCK_U64);
        // Write 1 is issued, then write 2 while 1 is in flight; 2 is acked first.
        let (d1, c1) = s.issue_write(0..1);
        let (d2, c2) = s.issue_write(0..1);
        s.ack_write(0, &c2);
        let lower = s.lower_bounds(0..1);
        // 1 is still in flight: it may land after 2.
        assert!(s.check_read(0..1, &lower, &d1).is_empty());
        s.ack_write(0, &c1);
        let lower = s.lower_bounds(0..1);
        assert!(s.check_read(0..1, &lower, &d1).is_empty());
        assert!(s.check_read(0..1, &lower, &d2).is_empty());
        assert_eq!(s.check_read(0..1, &lower, &[0u8; BLOCK]).len(), 1);
        // A write issued after both were acked supersedes both.
        let (d3, c3) = s.issue_write(0..1);
        s.ack_write(0, &c3);
        let lower = s.lower_bounds(0..1);
        assert_eq!(s.check_read(0..1, &lower, &d1).len(), 1);
        assert_eq!(s.check_read(0..1, &lower, &d2).len(), 1);
        assert!(s.check_read(0..1, &lower, &d3).is_empty());
        // Write 4 acked before write 5 was issued: 4 is superseded by 5 even though
        // write 5's counter check alone would not say so.
        let (d4, c4) = s.issue_write(0..1);
        s.ack_write(0, &c4);
        let (d5, c5) = s.issue_write(0..1);
        let (_d6, c6) = s.issue_write(0..1);
        s.ack_write(0, &c5);
        s.give_up_write(0, &c6);
        let lower = s.lower_bounds(0..1);
        assert_eq!(s.check_read(0..1, &lower, &d4).len(), 1);
        assert!(s.check_read(0..1, &lower, &d5).is_empty());
    }

    #[test]
    fn a_zeroing_write_reads_back_as_zeroes_and_ages_like_any_write() {
        let mut s = OracleState::new(MAGIC, 4 * BLOCK_U64);
        let (d1, c1) = s.issue_write(0..2);
        s.ack_write(0, &c1);
        let z = s.issue_zero(1..2);
        let lower = s.lower_bounds(0..2);
        // In flight: the old data or zeroes.
        assert!(s.check_read(0..2, &lower, &d1).is_empty());
        let mut zeroed = d1.clone();
        zeroed[BLOCK..].fill(0);
        assert!(s.check_read(0..2, &lower, &zeroed).is_empty());
        s.ack_write(1, &z);
        let lower = s.lower_bounds(0..2);
        // Acknowledged: the old data is stale; block 0 (not zeroed) must not be zero.
        assert_eq!(s.check_read(0..2, &lower, &d1).len(), 1);
        assert!(s.check_read(0..2, &lower, &zeroed).is_empty());
        assert_eq!(s.check_read(0..2, &lower, &[0u8; 2 * BLOCK]).len(), 1);
        // A later write over the zeroes: zeroes are stale then.
        let (d3, c3) = s.issue_write(1..2);
        s.ack_write(1, &c3);
        let lower = s.lower_bounds(1..2);
        assert!(s.check_read(1..2, &lower, &d3).is_empty());
        assert_eq!(s.check_read(1..2, &lower, &[0u8; BLOCK]).len(), 1);
        // Data claiming the zeroing write's counter is corrupt.
        let fake = encode_block(MAGIC, 1, z[0]);
        assert!(matches!(
            s.check_read(1..2, &lower, &fake)[..],
            [BlockError::Torn { .. }]
        ));
    }

    /// Simulator seed 26202: write 1 is issued, then write 2 over it; 2 is
    /// acknowledged, 1 is refused as superseded and re-issued by the client (a new
    /// op, so it lands after 2 — allowed, the two were in flight together); then
    /// the client gives up on 1 (its I/O timeout). The block may read 1 from then
    /// on, until a write issued after the give-up is acknowledged.
    #[test]
    fn a_write_given_up_on_may_have_landed_after_one_issued_while_it_was_in_flight() {
        let mut s = OracleState::new(MAGIC, 4 * BLOCK_U64);
        let (d1, c1) = s.issue_write(0..1);
        let (d2, c2) = s.issue_write(0..1);
        s.ack_write(0, &c2);
        s.give_up_write(0, &c1);
        let lower = s.lower_bounds(0..1);
        assert!(s.check_read(0..1, &lower, &d1).is_empty());
        assert!(s.check_read(0..1, &lower, &d2).is_empty());
        // Write 3, issued once 1 was given up: 1 must never land over it.
        let (d3, c3) = s.issue_write(0..1);
        s.ack_write(0, &c3);
        let lower = s.lower_bounds(0..1);
        assert_eq!(s.check_read(0..1, &lower, &d1).len(), 1);
        assert_eq!(s.check_read(0..1, &lower, &d2).len(), 1);
        assert!(s.check_read(0..1, &lower, &d3).is_empty());
        // A write given up on before the later one was issued stays below it.
        let (d4, c4) = s.issue_write(0..1);
        s.give_up_write(0, &c4);
        let (_d5, c5) = s.issue_write(0..1);
        s.ack_write(0, &c5);
        let lower = s.lower_bounds(0..1);
        assert_eq!(s.check_read(0..1, &lower, &d4).len(), 1);
    }
}
