//! The simulated clients' workload, shaped like a disk's: several volumes of
//! small objects, writers on disjoint but interleaved blocks with the per-block
//! write oracle (data writes, FUA or not, and a tenth write-zeroes or discard),
//! each working in a window of objects that drifts, so that new objects are
//! created all through the run (during recoveries and backfills too); reads of
//! any block of any volume; FLUSHes; then a read-back of every block written and
//! a sample of the others.
//!
//! Ownership: each volume's blocks are cut into stripes of
//! [`WorkloadShape::stripe_blocks`] blocks, dealt round-robin to the writers
//! (stripe `s` of volume `v` is writer `(s + v) % writers`'s). A stripe that does
//! not divide the object size straddles objects, so a writer's write may cross
//! an object (and group) boundary; every object holds blocks of every writer,
//! so the writers share every group and its recovery. Each writer has one
//! request in flight but for one write left in flight while it goes on, so
//! "issued" and "acknowledged" are well defined per block (`crate::oracle`: each
//! block's counters come from one writer, or from the simulator's trim).
//!
//! Locality: writer `i` works on a window of [`WorkloadShape::window_objects`]
//! objects of one volume; the window moves one object on with 15 % of its
//! writes and jumps anywhere in any volume with 3 %. Reads land near a random
//! writer's window 70 % of the time (what is being written, by this client or
//! another), anywhere in any volume otherwise. Hot blocks: a fifth of the
//! writes rewrite one of the writer's last four data writes' ranges (new data),
//! so that a write a fault held back meets its own later rewrite.
//!
//! The writers are spread over the client processes (writer `i` runs in client
//! `i % clients`) and share one oracle per volume, so one client's reads check
//! what another acknowledged: a client whose map lags must not read a block
//! older than a write another client completed through the new primary. Every
//! operation's result is checked: a failed operation is an error (the simulator
//! keeps `min_size` copies), a read is checked block by block against the oracle.

use crate::oracle::{BlockError, OracleState};
use flame_client::{Cluster, Volume};
use flame_common::ids::{ObjectId, PgId};
use flame_common::placement::{PgMembers, mix64, object_pg};
use flame_common::reactor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::Duration;

const BLOCK: u64 = crate::oracle::BLOCK as u64;
/// Most blocks per read of the final read-back (of a run of written blocks).
const VERIFY_BLOCKS: u64 = 64;
/// Never-written blocks the final read-back reads per volume (each must read as
/// zeroes).
const VERIFY_NEVER_WRITTEN: u64 = 64;
/// Longest pause of a writer between two operations.
const THINK_MS_MAX: u64 = 80;
/// Complaints kept in full (the count is exact).
const ERRORS_KEPT: usize = 20;
/// Chance that a write moves its writer's window one object on.
const DRIFT_CHANCE: f64 = 0.15;
/// Chance that a write moves its writer's window anywhere in any volume.
const JUMP_CHANCE: f64 = 0.03;
/// Chance that a read lands near a writer's window (else anywhere).
const READ_NEAR_CHANCE: f64 = 0.7;
/// Most blocks per write.
const WRITE_BLOCKS_MAX: u64 = 6;
/// Chance that a write (none left in flight) rewrites one of its writer's
/// recent ranges, with [`Workload::rewrites`].
const REWRITE_CHANCE: f64 = 0.2;
/// The recent data writes a writer may rewrite.
const RECENT_WRITES_MAX: usize = 4;

/// What the workload did.
#[derive(Clone, Copy, Debug, Default)]
pub struct WorkloadFigures {
    /// Writes acknowledged.
    pub writes: u64,
    /// Writes issued as hot rewrites of a writer's recent range.
    pub rewrites: u64,
    /// Reads that returned (and were checked).
    pub reads: u64,
    /// FLUSHes acknowledged.
    pub flushes: u64,
    /// Blocks checked against the oracle (reads and the read-back).
    pub blocks_checked: u64,
    /// Operations that failed.
    pub failed: u64,
    /// Writes given up on (the client's I/O timeout): issued, never acknowledged.
    pub abandoned: u64,
    /// Writes in flight when their client process crashed (given up on).
    pub crashed: u64,
    /// Writes refused with ENOSPC while a file system was full (issued, never
    /// acknowledged: the copies that took one may keep it).
    pub refused_full: u64,
    /// Reads and writes refused for reaching past the volume's end while a
    /// shrink had cut their blocks off (given up on, for a write).
    pub outside: u64,
    /// Objects first written (a data write issued to an object no write had
    /// touched).
    pub objects_created: u64,
    /// Of those, objects whose group had a member being recovered (log
    /// catch-up or backfill) in the writer's client map when it was issued.
    pub created_while_recovering: u64,
}

impl std::fmt::Display for WorkloadFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} writes ({} rewrites, {} abandoned, {} cut short by a client crash, {} refused for a full disk), {} reads, {} flushes, {} blocks checked, {} failed, {} outside a shrunk volume, {} objects created ({} in a group being recovered)",
            self.writes,
            self.rewrites,
            self.abandoned,
            self.crashed,
            self.refused_full,
            self.reads,
            self.flushes,
            self.blocks_checked,
            self.failed,
            self.outside,
            self.objects_created,
            self.created_while_recovering,
        )
    }
}

/// The workload's shape, drawn from the seed (`SimConfig`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkloadShape {
    /// Each volume's size in bytes (a multiple of the object size).
    pub volumes: Vec<u64>,
    /// The pool's object size in bytes.
    pub object_size: u64,
    /// Blocks per stripe of the round-robin ownership.
    pub stripe_blocks: u64,
    /// Objects in a writer's window.
    pub window_objects: u64,
}

/// Volume `v`'s name.
pub fn volume_name(v: usize) -> String {
    if v == 0 {
        "sim".to_string()
    } else {
        format!("sim{v}")
    }
}

/// One volume's oracle and resize state.
struct VolumeState {
    name: String,
    blocks: u64,
    oracle: RefCell<OracleState>,
    /// Objects a data write was issued to.
    created: RefCell<Vec<bool>>,
    /// The first block a shrink of the volume cut off (`None`: never shrunk):
    /// from there on, I/O may be refused as outside the volume (by a client's
    /// own map, or by an OSD's) while the volume is small or a client's map
    /// still says so.
    cut_from: Cell<Option<u64>>,
    /// The first block cut off while the volume is shrunk and trimmed
    /// ([`Workload::trimmed`] to [`Workload::grown`]): no data write past it may
    /// be acknowledged then — every OSD that took the trim refuses it (a
    /// client's map that predates the shrink notwithstanding).
    shrunk_from: Cell<Option<u64>>,
}

impl VolumeState {
    /// Whether I/O to `n` blocks from `first` may be refused as outside the
    /// volume.
    fn may_be_outside(&self, first: u64, n: u64) -> bool {
        self.cut_from.get().is_some_and(|c| first + n > c)
    }
}

/// The workload's state, shared by its tasks and the simulator.
pub struct Workload {
    seed: u64,
    writers: usize,
    ops_per_writer: u64,
    volumes: Vec<VolumeState>,
    object_blocks: u64,
    stripe: u64,
    window: u64,
    /// Each writer's window: (volume, first object).
    windows: RefCell<Vec<(usize, u64)>>,
    figures: Cell<WorkloadFigures>,
    /// Writers that have done their operations.
    writers_done: Cell<usize>,
    /// Per writer: it did all its operations (a client's new incarnation after
    /// a crash starts only the writers not done).
    writer_done: RefCell<Vec<bool>>,
    errors: RefCell<Vec<String>>,
    error_count: Cell<u64>,
    finished: Cell<bool>,
    verify: Cell<bool>,
    verify_waker: RefCell<Option<Waker>>,
    verified: Cell<bool>,
    /// The client has an I/O timeout: an operation that times out is abandoned,
    /// not an error (any other failure still is).
    may_time_out: Cell<bool>,
    /// A file system has been full: a write may fail with ENOSPC (Flame's
    /// answer when a member of the group is full), which abandons it.
    enospc_allowed: Cell<bool>,
    /// Writers rewrite their recent ranges ([`crate::sim::SimConfig::rewrites`]).
    rewrites: bool,
}

impl Workload {
    /// `ops` operations in all over `writers` writers, on volumes of `shape`.
    pub fn new(
        seed: u64,
        writers: usize,
        ops: u64,
        shape: &WorkloadShape,
        may_time_out: bool,
        rewrites: bool,
    ) -> Workload {
        let writers = writers.max(1);
        let object_blocks = (shape.object_size / BLOCK).max(1);
        let volumes: Vec<VolumeState> = shape
            .volumes
            .iter()
            .enumerate()
            .map(|(v, &size)| VolumeState {
                name: volume_name(v),
                blocks: size / BLOCK,
                // A magic of its own: a block of another volume reads as torn.
                oracle: RefCell::new(OracleState::new(mix64(seed ^ mix64(v as u64)) | 1, size)),
                created: RefCell::new(vec![false; size.div_ceil(shape.object_size) as usize]),
                cut_from: Cell::new(None),
                shrunk_from: Cell::new(None),
            })
            .collect();
        // Each writer starts in a window of its own, anywhere.
        let mut rng = StdRng::seed_from_u64(seed ^ 0x3a7d_0b1e);
        let windows = (0..writers)
            .map(|_| {
                let v = rng.random_range(0..volumes.len().max(1));
                let objects = volumes
                    .get(v)
                    .map_or(1, |s| s.blocks.div_ceil(object_blocks));
                (v, rng.random_range(0..objects.max(1)))
            })
            .collect();
        Workload {
            seed,
            writers,
            ops_per_writer: ops.div_ceil(writers as u64),
            volumes,
            object_blocks,
            stripe: shape.stripe_blocks.max(1),
            window: shape.window_objects.max(1),
            windows: RefCell::new(windows),
            figures: Cell::new(WorkloadFigures::default()),
            writers_done: Cell::new(0),
            writer_done: RefCell::new(vec![false; writers]),
            errors: RefCell::new(Vec::new()),
            error_count: Cell::new(0),
            finished: Cell::new(false),
            verify: Cell::new(false),
            verify_waker: RefCell::new(None),
            verified: Cell::new(false),
            may_time_out: Cell::new(may_time_out),
            enospc_allowed: Cell::new(false),
            rewrites,
        }
    }

    /// Every writer (of every client) has done its operations, or the workload
    /// could not start.
    pub fn finished(&self) -> bool {
        self.finished.get() || self.writers_done.get() == self.writers
    }

    /// Starts writer `writer`'s window at block `block` of volume `v` (the
    /// simulator puts one just before a shrink's cut, so that it writes into it).
    pub fn start_writer_near(&self, writer: usize, v: usize, block: u64) {
        if let Some(w) = self.windows.borrow_mut().get_mut(writer) {
            *w = (v, block / self.object_blocks);
        }
    }

    /// Starts the final read-back.
    pub fn start_verify(&self) {
        self.verify.set(true);
        if let Some(w) = self.verify_waker.borrow_mut().take() {
            w.wake();
        }
    }

    /// A file system is full from now on (for a while): writes may fail with
    /// ENOSPC. Never taken back: the map may say "full" for a while after.
    pub fn allow_enospc(&self) {
        self.enospc_allowed.set(true);
    }

    /// A shrink of volume `v` to `blocks` blocks starts (the manager has the new
    /// size): every block past it is zeroed as one write issued now,
    /// acknowledged when the trim completed ([`Workload::trimmed`]) — its old
    /// bytes must never be read again once the volume grows back. Returns the
    /// write's first block and counters.
    pub fn shrinking(&self, v: usize, blocks: u64) -> (u64, Vec<u64>) {
        let Some(vol) = self.volumes.get(v) else {
            return (0, Vec::new());
        };
        let first = blocks.min(vol.blocks);
        vol.cut_from
            .set(Some(vol.cut_from.get().map_or(first, |c| c.min(first))));
        (first, vol.oracle.borrow_mut().issue_zero(first..vol.blocks))
    }

    /// Volume `v`'s shrink's trim completed on every copy (and stably).
    pub fn trimmed(&self, v: usize, first: u64, counters: &[u64]) {
        if let Some(vol) = self.volumes.get(v) {
            vol.oracle.borrow_mut().ack_write(first, counters);
            vol.shrunk_from.set(Some(first));
        }
    }

    /// Volume `v` has grown back to its size: writes past the old cut land again.
    pub fn grown(&self, v: usize) {
        if let Some(vol) = self.volumes.get(v) {
            vol.shrunk_from.set(None);
        }
    }

    /// The read-back is done.
    pub fn verified(&self) -> bool {
        self.verified.get()
    }

    /// What it did so far.
    pub fn figures(&self) -> WorkloadFigures {
        self.figures.get()
    }

    /// Every complaint (the first ones in full, then a count).
    pub fn errors(&self) -> Vec<String> {
        let mut e = self.errors.borrow().clone();
        let n = self.error_count.get();
        if n > e.len() as u64 {
            e.push(format!("… {} more", n - e.len() as u64));
        }
        e
    }

    fn complain(&self, what: String) {
        self.error_count.set(self.error_count.get() + 1);
        let mut e = self.errors.borrow_mut();
        if e.len() < ERRORS_KEPT {
            e.push(what);
        }
    }

    fn count(&self, f: impl FnOnce(&mut WorkloadFigures)) {
        let mut v = self.figures.get();
        f(&mut v);
        self.figures.set(v);
    }

    /// Reads `n` blocks from `first` of volume `v` and checks them against the
    /// oracle.
    async fn checked_read(&self, v: usize, vol: &Volume, first: u64, n: u64) {
        let state = &self.volumes[v];
        let range = first..first + n;
        let lower = state.oracle.borrow().lower_bounds(range.clone());
        match vol.read_at(first * BLOCK, (n * BLOCK) as usize).await {
            Ok(data) => {
                let oracle = state.oracle.borrow();
                let errs = oracle.check_read(range, &lower, &data);
                self.count(|f| {
                    f.reads += 1;
                    f.blocks_checked += n;
                });
                // Which phase, and the block's writes as the oracle saw them.
                let phase = if self.verify.get() {
                    "final read-back: "
                } else {
                    ""
                };
                for e in errs {
                    let index = match &e {
                        BlockError::Torn { index, .. }
                        | BlockError::Stale { index, .. }
                        | BlockError::TooNew { index, .. } => *index,
                    };
                    self.complain(format!(
                        "{phase}read of {} blocks {first}+{n}: {e} ({})",
                        state.name,
                        oracle.history(index)
                    ));
                }
            }
            Err(e) if self.may_time_out.get() && is_timeout(&e) => {
                self.count(|f| f.failed += 1);
            }
            Err(e) if state.may_be_outside(first, n) && is_outside(&e) => {
                self.count(|f| f.outside += 1);
            }
            Err(e) => {
                self.count(|f| f.failed += 1);
                self.complain(format!(
                    "read of {} blocks {first}+{n} failed: {e}",
                    state.name
                ));
            }
        }
    }

    /// Counts the objects a data write to blocks `first..first + n` of volume
    /// `v` writes first, and those of them whose group is being recovered in
    /// the client's map.
    fn note_created(&self, v: usize, vol: &Volume, first: u64, n: u64) {
        let state = &self.volumes[v];
        let (lo, hi) = (
            first / self.object_blocks,
            (first + n - 1) / self.object_blocks,
        );
        let mut created = state.created.borrow_mut();
        for o in lo..=hi {
            let Some(seen) = created.get_mut(o as usize) else {
                continue;
            };
            if *seen {
                continue;
            }
            *seen = true;
            let map = vol.cluster().map();
            let pg: PgId = object_pg(
                ObjectId {
                    volume: vol.id(),
                    index: o,
                },
                map.pool.pg_count,
            );
            let recovering = !PgMembers::compute(&map, pg).recovering.is_empty();
            self.count(|f| {
                f.objects_created += 1;
                f.created_while_recovering += u64::from(recovering);
            });
        }
    }

    /// Writes `n` blocks from `first` of volume `v` with the oracle's next
    /// counters (or zeroes them, as `how` says).
    async fn write(self: Rc<Self>, v: usize, vol: Rc<Volume>, first: u64, n: u64, how: WriteKind) {
        let state = &self.volumes[v];
        let range = first..first + n;
        let (offset, len) = (first * BLOCK, n * BLOCK);
        // Data only: OSDs take discards and write-zeroes past the end (a shrink's
        // trim is made of them), which cannot bring old bytes back.
        let data = matches!(how, WriteKind::Data { .. });
        let past_the_trimmed_end =
            |s: &VolumeState| data && s.shrunk_from.get().is_some_and(|c| first + n > c);
        let issued_past_the_trimmed_end = past_the_trimmed_end(state);
        let (data, counters) = match how {
            WriteKind::Data { .. } => {
                self.note_created(v, &vol, first, n);
                let (data, counters) = state.oracle.borrow_mut().issue_write(range);
                (data, counters)
            }
            WriteKind::Zeroes { .. } | WriteKind::Discard => {
                (Vec::new(), state.oracle.borrow_mut().issue_zero(range))
            }
        };
        // If the client process crashes while the write is in flight, its task
        // is dropped here: the write is given up on (it may still land).
        let mut in_flight = InFlight {
            w: &self,
            v,
            first,
            counters: &counters,
            ended: false,
        };
        let res = match how {
            WriteKind::Data { fua } => vol.write_at(offset, &data, fua).await,
            WriteKind::Zeroes { fua } => vol.write_zeroes(offset, len, fua).await,
            WriteKind::Discard => vol.discard(offset, len).await,
        };
        in_flight.ended = true;
        let name = &state.name;
        match res {
            Ok(()) => {
                state.oracle.borrow_mut().ack_write(first, &counters);
                self.count(|f| f.writes += 1);
                if issued_past_the_trimmed_end && past_the_trimmed_end(state) {
                    self.complain(format!(
                        "write of {name} blocks {first}+{n}, past the end of the shrunk and \
                         trimmed volume, was acknowledged before the volume grew back"
                    ));
                }
            }
            Err(e) if self.may_time_out.get() && is_timeout(&e) => {
                // Abandoned: issued, never acknowledged; it may still land.
                state.oracle.borrow_mut().give_up_write(first, &counters);
                self.count(|f| f.abandoned += 1);
            }
            Err(e) if self.enospc_allowed.get() && e.errno() == libc::ENOSPC => {
                // Refused for a full disk: the copies that took it before the
                // refusal may keep it, so it may still be read (never over a
                // newer write).
                state.oracle.borrow_mut().give_up_write(first, &counters);
                self.count(|f| f.refused_full += 1);
            }
            Err(e) if state.may_be_outside(first, n) && is_outside(&e) => {
                // Past the end of the shrunk volume (in this client's map or the
                // primary's): refused; it may have landed before the trim, never
                // after it.
                state.oracle.borrow_mut().give_up_write(first, &counters);
                self.count(|f| f.outside += 1);
            }
            Err(e) => {
                state.oracle.borrow_mut().give_up_write(first, &counters);
                self.count(|f| f.failed += 1);
                self.complain(format!("write of {name} blocks {first}+{n} failed: {e}"));
            }
        }
    }

    /// A read's volume and blocks: near a random writer's window mostly, else
    /// anywhere in any volume.
    fn read_target(&self, rng: &mut StdRng) -> (usize, u64, u64) {
        let (v, first) = if rng.random_bool(READ_NEAR_CHANCE) {
            let (v, o) = self.windows.borrow()[rng.random_range(0..self.writers)];
            let span = self.window * self.object_blocks;
            (v, o * self.object_blocks + rng.random_range(0..span))
        } else {
            let v = rng.random_range(0..self.volumes.len());
            (v, rng.random_range(0..self.volumes[v].blocks))
        };
        let blocks = self.volumes[v].blocks;
        let n = rng.random_range(1..=8u64).min(blocks);
        (v, first.min(blocks - n), n)
    }

    /// Reads random blocks until every writer is done (and at most
    /// `ops_per_writer` times).
    async fn reader(self: Rc<Self>, vols: Rc<Vec<Rc<Volume>>>, client: usize) {
        let mut rng = StdRng::seed_from_u64(self.seed.wrapping_mul(37).wrapping_add(client as u64));
        for _ in 0..self.ops_per_writer {
            reactor::sleep(Duration::from_millis(rng.random_range(0..THINK_MS_MAX))).await;
            if self.finished() {
                return;
            }
            let (v, first, n) = self.read_target(&mut rng);
            self.checked_read(v, &vols[v], first, n).await;
        }
    }

    /// Writer `index`'s stripe holding (or following) block `b` of volume `v`:
    /// its first block and its end.
    fn own_stripe(&self, index: usize, v: usize, b: u64) -> (u64, u64) {
        let blocks = self.volumes[v].blocks;
        let w = self.writers as u64;
        let stripes = blocks.div_ceil(self.stripe);
        let s = b / self.stripe;
        let mut own = s + (index as u64 + w - (s + v as u64) % w) % w;
        // Past the end: the writer's last stripe (every volume has many more
        // stripes than writers).
        while own >= stripes && own >= w {
            own -= w;
        }
        let start = own * self.stripe;
        (start.min(blocks - 1), (start + self.stripe).min(blocks))
    }

    async fn writer(self: Rc<Self>, vols: Rc<Vec<Rc<Volume>>>, index: usize) {
        let mut rng = StdRng::seed_from_u64(self.seed.wrapping_mul(31).wrapping_add(index as u64));
        // A write left in flight while the writer goes on (at most one): two
        // writes of one writer, often overlapping, run together, and their order
        // is the OSDs' to choose, the same on every copy.
        let mut pending: Option<(reactor::Task<()>, usize, u64)> = None;
        // Its last data writes (volume, first block, blocks), newest last.
        let mut recent: Vec<(usize, u64, u64)> = Vec::with_capacity(RECENT_WRITES_MAX);
        for _ in 0..self.ops_per_writer {
            // Think time: spreads the operations over the faults' schedule (it
            // costs nothing in virtual time).
            reactor::sleep(Duration::from_millis(rng.random_range(0..THINK_MS_MAX))).await;
            let kind = rng.random_range(0..10);
            if pending.is_some()
                && (kind == 9 || rng.random_bool(0.4))
                && let Some((t, _, _)) = pending.take()
            {
                t.await;
            }
            match kind {
                0..6 if self.rewrites
                    && pending.is_none()
                    && !recent.is_empty()
                    && rng.random_bool(REWRITE_CHANCE) =>
                {
                    // A hot block: the same range again, new data.
                    let (v, first, n) = recent[rng.random_range(0..recent.len())];
                    self.count(|f| f.rewrites += 1);
                    let how = WriteKind::Data {
                        fua: rng.random_bool(0.1),
                    };
                    self.clone().write(v, vols[v].clone(), first, n, how).await;
                }
                0..6 => {
                    let (v, start, end, at) = match &pending {
                        // Overlap the write in flight, mostly (in its stripe).
                        Some((_, v, at)) if rng.random_bool(0.7) => {
                            let (start, end) = self.own_stripe(index, *v, *at);
                            (*v, start, end, Some(*at))
                        }
                        _ => {
                            let (v, o) = self.move_window(index, &mut rng);
                            let b = (o + rng.random_range(0..self.window)) * self.object_blocks
                                + rng.random_range(0..self.object_blocks);
                            let b = b % self.volumes[v].blocks;
                            let (start, end) = self.own_stripe(index, v, b);
                            (v, start, end, None)
                        }
                    };
                    let n = rng.random_range(1..=WRITE_BLOCKS_MAX).min(end - start);
                    let first = match at {
                        Some(at) => {
                            let lo = at.saturating_sub(n - 1).max(start);
                            let hi = at.min(end - n);
                            rng.random_range(lo..=hi.max(lo))
                        }
                        None => rng.random_range(start..=end - n),
                    };
                    let how = match rng.random_range(0..20) {
                        0 => WriteKind::Zeroes {
                            fua: rng.random_bool(0.2),
                        },
                        1 => WriteKind::Discard,
                        _ => WriteKind::Data {
                            fua: rng.random_bool(0.1),
                        },
                    };
                    if self.rewrites && matches!(how, WriteKind::Data { .. }) {
                        if recent.len() == RECENT_WRITES_MAX {
                            recent.remove(0);
                        }
                        recent.push((v, first, n));
                    }
                    let w = self.clone().write(v, vols[v].clone(), first, n, how);
                    if pending.is_none() && rng.random_bool(0.3) {
                        pending = Some((reactor::spawn(w), v, first));
                    } else {
                        w.await;
                    }
                }
                6..9 => {
                    let (v, first, n) = self.read_target(&mut rng);
                    self.checked_read(v, &vols[v], first, n).await;
                }
                _ => {
                    let v = rng.random_range(0..vols.len());
                    match vols[v].flush().await {
                        Ok(()) => self.count(|f| f.flushes += 1),
                        Err(e) if self.may_time_out.get() && is_timeout(&e) => {
                            self.count(|f| f.failed += 1);
                        }
                        Err(e) => {
                            self.count(|f| f.failed += 1);
                            self.complain(format!("flush of {} failed: {e}", self.volumes[v].name));
                        }
                    }
                }
            }
        }
        if let Some((t, _, _)) = pending.take() {
            t.await;
        }
    }

    /// Writer `index`'s window for its next write: it drifts one object on
    /// sometimes (wrapping at the volume's end) and jumps anywhere rarely.
    fn move_window(&self, index: usize, rng: &mut StdRng) -> (usize, u64) {
        let mut windows = self.windows.borrow_mut();
        let (mut v, mut o) = windows[index];
        if rng.random_bool(JUMP_CHANCE) {
            v = rng.random_range(0..self.volumes.len());
            o = rng.random_range(0..self.volumes[v].blocks.div_ceil(self.object_blocks));
        } else if rng.random_bool(DRIFT_CHANCE) {
            o = (o + 1) % self.volumes[v].blocks.div_ceil(self.object_blocks);
        }
        windows[index] = (v, o);
        (v, o)
    }

    /// The final read-back of volume `v`: every block ever issued a write (in
    /// runs of at most [`VERIFY_BLOCKS`]), then a sample of never-written
    /// blocks, which must read as zeroes.
    async fn verify_volume(&self, v: usize, vol: &Volume) {
        let state = &self.volumes[v];
        let runs: Vec<(u64, u64)> = {
            let oracle = state.oracle.borrow();
            let mut runs = Vec::new();
            let mut run: Option<(u64, u64)> = None;
            for (i, b) in oracle.blocks.iter().enumerate() {
                let i = i as u64;
                if b.issued == 0 {
                    continue;
                }
                run = match run {
                    Some((first, n)) if first + n == i && n < VERIFY_BLOCKS => Some((first, n + 1)),
                    Some(r) => {
                        runs.push(r);
                        Some((i, 1))
                    }
                    None => Some((i, 1)),
                };
            }
            runs.extend(run);
            runs
        };
        for (first, n) in runs {
            self.checked_read(v, vol, first, n).await;
        }
        let mut rng = StdRng::seed_from_u64(self.seed ^ mix64(0x7e51_f000 + v as u64));
        let mut sampled = 0;
        for _ in 0..VERIFY_NEVER_WRITTEN * 4 {
            if sampled == VERIFY_NEVER_WRITTEN {
                break;
            }
            let b = rng.random_range(0..state.blocks);
            if state.oracle.borrow().blocks[b as usize].issued == 0 {
                sampled += 1;
                self.checked_read(v, vol, b, 1).await;
            }
        }
    }
}

/// A write in flight: if its task is dropped before it ended (its client
/// process crashed), the oracle learns it was given up on — issued, never
/// acknowledged, it may still land, never over a write issued after.
struct InFlight<'a> {
    w: &'a Workload,
    v: usize,
    first: u64,
    counters: &'a [u64],
    ended: bool,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.ended {
            self.w.volumes[self.v]
                .oracle
                .borrow_mut()
                .give_up_write(self.first, self.counters);
            self.w.count(|f| f.crashed += 1);
        }
    }
}

/// What a writer's write does to its blocks.
#[derive(Clone, Copy, Debug)]
enum WriteKind {
    /// New data (each block's next counter), FUA or not.
    Data { fua: bool },
    /// `WRITE_ZEROES`, FUA or not.
    Zeroes { fua: bool },
    /// `DISCARD` (TRIM): reads back as zeroes, as Flame guarantees.
    Discard,
}

/// Whether a client error says the range lies past the volume's end (the
/// client's own check, or an OSD's `EINVAL` for a write past the end in its map).
fn is_outside(e: &flame_client::error::ClientError) -> bool {
    matches!(e, flame_client::error::ClientError::OutOfRange { .. }) || e.errno() == libc::EINVAL
}

/// Whether a client error is its I/O timeout.
fn is_timeout(e: &flame_client::error::ClientError) -> bool {
    matches!(e, flame_client::error::ClientError::Timeout { .. })
}

/// Client process `client` (of `clients`)'s main task: it opens every volume,
/// runs its writers and its reader, then in client 0 the final read-back when
/// the simulator asks for it.
pub async fn run(cluster: Cluster, w: Rc<Workload>, client: usize, clients: usize) {
    let mut vols = Vec::new();
    for state in &w.volumes {
        match cluster.open_volume(&state.name).await {
            Ok(v) => vols.push(Rc::new(v)),
            Err(e) => {
                w.complain(format!("cannot open volume {}: {e}", state.name));
                w.finished.set(true);
                w.verified.set(true);
                return;
            }
        }
    }
    let vols = Rc::new(vols);
    // A new incarnation (after a crash) starts the writers its predecessor
    // did not finish: from their first operation again, so they re-issue the
    // writes the crash cut short, as new operations of a new session.
    let tasks: Vec<_> = (0..w.writers)
        .filter(|&i| i % clients.max(1) == client && !w.writer_done.borrow()[i])
        .map(|i| (i, reactor::spawn(w.clone().writer(vols.clone(), i))))
        .collect();
    // A reader of its own: a client whose writers all wait (on a primary that
    // cannot reach its replicas, say) still reads.
    let reader = reactor::spawn(w.clone().reader(vols.clone(), client));
    for (i, t) in tasks {
        t.await;
        w.writer_done.borrow_mut()[i] = true;
        w.writers_done.set(w.writers_done.get() + 1);
    }
    reader.await;
    if client != 0 {
        return;
    }
    poll_fn(|cx| {
        if w.verify.get() {
            Poll::Ready(())
        } else {
            *w.verify_waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        }
    })
    .await;
    // After the faults nothing may fail, time out included.
    w.may_time_out.set(false);
    // First a FLUSH of every volume: every copy's checksums go to disk (the
    // copies are compared whole after the read-back).
    for (v, vol) in vols.iter().enumerate() {
        if let Err(e) = vol.flush().await {
            w.complain(format!(
                "the final flush of {} failed: {e}",
                w.volumes[v].name
            ));
        }
    }
    for (v, vol) in vols.iter().enumerate() {
        w.verify_volume(v, vol).await;
    }
    w.verified.set(true);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The oracle needs each block written by one writer only: every writer's
    /// stripe is its own (round-robin, shifted per volume), whatever block it
    /// starts from, and the stripes of different writers never overlap.
    #[test]
    fn every_writer_gets_only_its_own_stripes() {
        for (writers, stripe, object_size) in
            [(3, 5, 64 << 10), (8, 12, 256 << 10), (4, 2, 128 << 10)]
        {
            let shape = WorkloadShape {
                volumes: vec![4 << 20, 3 << 20],
                object_size,
                stripe_blocks: stripe,
                window_objects: 2,
            };
            let w = Workload::new(7, writers, 100, &shape, false, true);
            for (v, vol) in w.volumes.iter().enumerate() {
                let mut owner = vec![None; vol.blocks as usize];
                for i in 0..writers {
                    for b in 0..vol.blocks {
                        let (start, end) = w.own_stripe(i, v, b);
                        assert!(start < end && end <= vol.blocks, "{start}..{end}");
                        assert_eq!((start / stripe + v as u64) % writers as u64, i as u64);
                        for x in start..end {
                            assert!(
                                owner[x as usize].is_none_or(|o| o == i),
                                "block {x} of volume {v} given to writers {owner:?} and {i}",
                                owner = owner[x as usize]
                            );
                            owner[x as usize] = Some(i);
                        }
                    }
                }
                // Every block is someone's.
                assert!(owner.iter().all(Option::is_some));
            }
        }
    }
}
