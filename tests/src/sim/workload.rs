//! The simulated clients' workload: writers on disjoint blocks with the per-block
//! write oracle (data writes, FUA or not, and a tenth write-zeroes or discard),
//! reads of any block, FLUSHes; then a full read-back.
//!
//! Each writer has one request in flight, so "issued" and "acknowledged" are
//! well defined per block (`crate::oracle`). The writers are spread over the
//! client processes (writer `i` runs in client `i % clients`) and share one
//! oracle, so one client's reads check what another acknowledged: a client
//! whose map lags must not read a block older than a write another client
//! completed through the new primary. Every operation's result is checked: a
//! failed operation is an error (the simulator keeps `min_size` copies), a read
//! is checked block by block against the oracle.

use crate::oracle::OracleState;
use flame_client::{Cluster, Volume};
use flame_common::reactor;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cell::{Cell, RefCell};
use std::future::poll_fn;
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::Duration;

const BLOCK: u64 = crate::oracle::BLOCK as u64;
/// Blocks per read of the final read-back.
const VERIFY_BLOCKS: u64 = 16;
/// Longest pause of a writer between two operations.
const THINK_MS_MAX: u64 = 80;
/// Complaints kept in full (the count is exact).
const ERRORS_KEPT: usize = 20;

/// What the workload did.
#[derive(Clone, Copy, Debug, Default)]
pub struct WorkloadFigures {
    /// Writes acknowledged.
    pub writes: u64,
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
    /// Writes refused with ENOSPC while a file system was full (issued, never
    /// acknowledged: the copies that took one may keep it).
    pub refused_full: u64,
    /// Reads and writes refused for reaching past the volume's end while a
    /// shrink had cut their blocks off (given up on, for a write).
    pub outside: u64,
}

impl std::fmt::Display for WorkloadFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} writes ({} abandoned, {} refused for a full disk), {} reads, {} flushes, {} blocks checked, {} failed, {} outside a shrunk volume",
            self.writes,
            self.abandoned,
            self.refused_full,
            self.reads,
            self.flushes,
            self.blocks_checked,
            self.failed,
            self.outside
        )
    }
}

/// The workload's state, shared by its tasks and the simulator.
pub struct Workload {
    seed: u64,
    writers: usize,
    ops_per_writer: u64,
    blocks: u64,
    oracle: RefCell<OracleState>,
    figures: Cell<WorkloadFigures>,
    /// Writers that have done their operations.
    writers_done: Cell<usize>,
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

impl Workload {
    /// `ops` operations in all over `writers` writers, on a volume of `size` bytes.
    pub fn new(seed: u64, writers: usize, ops: u64, size: u64, may_time_out: bool) -> Workload {
        let writers = writers.max(1);
        Workload {
            seed,
            writers,
            ops_per_writer: ops.div_ceil(writers as u64),
            blocks: size / BLOCK,
            oracle: RefCell::new(OracleState::new(seed | 1, size)),
            figures: Cell::new(WorkloadFigures::default()),
            writers_done: Cell::new(0),
            errors: RefCell::new(Vec::new()),
            error_count: Cell::new(0),
            finished: Cell::new(false),
            verify: Cell::new(false),
            verify_waker: RefCell::new(None),
            verified: Cell::new(false),
            may_time_out: Cell::new(may_time_out),
            enospc_allowed: Cell::new(false),
            cut_from: Cell::new(None),
            shrunk_from: Cell::new(None),
        }
    }

    /// Every writer (of every client) has done its operations, or the workload
    /// could not start.
    pub fn finished(&self) -> bool {
        self.finished.get() || self.writers_done.get() == self.writers
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

    /// A shrink to `blocks` blocks starts (the manager has the new size): every
    /// block past it is zeroed as one write issued now, acknowledged when the
    /// trim completed ([`Workload::trimmed`]) — its old bytes must never be read
    /// again once the volume grows back. Returns the write's first block and
    /// counters.
    pub fn shrinking(&self, blocks: u64) -> (u64, Vec<u64>) {
        let first = blocks.min(self.blocks);
        self.cut_from
            .set(Some(self.cut_from.get().map_or(first, |c| c.min(first))));
        (
            first,
            self.oracle.borrow_mut().issue_zero(first..self.blocks),
        )
    }

    /// The shrink's trim completed on every copy (and stably).
    pub fn trimmed(&self, first: u64, counters: &[u64]) {
        self.oracle.borrow_mut().ack_write(first, counters);
        self.shrunk_from.set(Some(first));
    }

    /// The volume has grown back to its size: writes past the old cut land again.
    pub fn grown(&self) {
        self.shrunk_from.set(None);
    }

    /// Whether I/O to `n` blocks from `first` may be refused as outside the
    /// volume.
    fn may_be_outside(&self, first: u64, n: u64) -> bool {
        self.cut_from.get().is_some_and(|c| first + n > c)
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

    /// Reads `blocks` and checks them against the oracle.
    async fn checked_read(&self, vol: &Volume, first: u64, n: u64) {
        let range = first..first + n;
        let lower = self.oracle.borrow().lower_bounds(range.clone());
        match vol.read_at(first * BLOCK, (n * BLOCK) as usize).await {
            Ok(data) => {
                let errs = self.oracle.borrow().check_read(range, &lower, &data);
                self.count(|f| {
                    f.reads += 1;
                    f.blocks_checked += n;
                });
                for e in errs {
                    self.complain(format!("read of blocks {first}+{n}: {e}"));
                }
            }
            Err(e) if self.may_time_out.get() && is_timeout(&e) => {
                self.count(|f| f.failed += 1);
            }
            Err(e) if self.may_be_outside(first, n) && is_outside(&e) => {
                self.count(|f| f.outside += 1);
            }
            Err(e) => {
                self.count(|f| f.failed += 1);
                self.complain(format!("read of blocks {first}+{n} failed: {e}"));
            }
        }
    }

    /// Writes `n` blocks from `first` with the oracle's next counters (or
    /// zeroes them, as `how` says).
    async fn write(self: Rc<Self>, vol: Rc<Volume>, first: u64, n: u64, how: WriteKind) {
        let range = first..first + n;
        let (offset, len) = (first * BLOCK, n * BLOCK);
        // Data only: OSDs take discards and write-zeroes past the end (a shrink's
        // trim is made of them), which cannot bring old bytes back.
        let data = matches!(how, WriteKind::Data { .. });
        let past_the_trimmed_end =
            |w: &Self| data && w.shrunk_from.get().is_some_and(|c| first + n > c);
        let issued_past_the_trimmed_end = past_the_trimmed_end(&self);
        let (res, counters) = match how {
            WriteKind::Data { fua } => {
                let (data, counters) = self.oracle.borrow_mut().issue_write(range);
                (vol.write_at(offset, &data, fua).await, counters)
            }
            WriteKind::Zeroes { fua } => {
                let counters = self.oracle.borrow_mut().issue_zero(range);
                (vol.write_zeroes(offset, len, fua).await, counters)
            }
            WriteKind::Discard => {
                let counters = self.oracle.borrow_mut().issue_zero(range);
                (vol.discard(offset, len).await, counters)
            }
        };
        match res {
            Ok(()) => {
                self.oracle.borrow_mut().ack_write(first, &counters);
                self.count(|f| f.writes += 1);
                if issued_past_the_trimmed_end && past_the_trimmed_end(&self) {
                    self.complain(format!(
                        "write of blocks {first}+{n}, past the end of the shrunk and trimmed \
                         volume, was acknowledged before the volume grew back"
                    ));
                }
            }
            Err(e) if self.may_time_out.get() && is_timeout(&e) => {
                // Abandoned: issued, never acknowledged; it may still land.
                self.oracle.borrow_mut().give_up_write(first, &counters);
                self.count(|f| f.abandoned += 1);
            }
            Err(e) if self.enospc_allowed.get() && e.errno() == libc::ENOSPC => {
                // Refused for a full disk: the copies that took it before the
                // refusal may keep it, so it may still be read (never over a
                // newer write).
                self.oracle.borrow_mut().give_up_write(first, &counters);
                self.count(|f| f.refused_full += 1);
            }
            Err(e) if self.may_be_outside(first, n) && is_outside(&e) => {
                // Past the end of the shrunk volume (in this client's map or the
                // primary's): refused; it may have landed before the trim, never
                // after it.
                self.oracle.borrow_mut().give_up_write(first, &counters);
                self.count(|f| f.outside += 1);
            }
            Err(e) => {
                self.oracle.borrow_mut().give_up_write(first, &counters);
                self.count(|f| f.failed += 1);
                self.complain(format!("write of blocks {first}+{n} failed: {e}"));
            }
        }
    }

    /// Reads random blocks until every writer is done (and at most
    /// `ops_per_writer` times).
    async fn reader(self: Rc<Self>, vol: Rc<Volume>, client: usize) {
        let mut rng = StdRng::seed_from_u64(self.seed.wrapping_mul(37).wrapping_add(client as u64));
        for _ in 0..self.ops_per_writer {
            reactor::sleep(Duration::from_millis(rng.random_range(0..THINK_MS_MAX))).await;
            if self.finished() {
                return;
            }
            let n = rng.random_range(1..=8u64).min(self.blocks);
            let first = rng.random_range(0..=self.blocks - n);
            self.checked_read(&vol, first, n).await;
        }
    }

    async fn writer(self: Rc<Self>, vol: Rc<Volume>, index: usize) {
        let mut rng = StdRng::seed_from_u64(self.seed.wrapping_mul(31).wrapping_add(index as u64));
        let per = (self.blocks / self.writers as u64).max(1);
        let own = index as u64 * per..((index as u64 + 1) * per).min(self.blocks);
        // A write left in flight while the writer goes on (at most one): two
        // writes of one writer, often overlapping, run together, and their order
        // is the OSDs' to choose, the same on every copy.
        let mut pending: Option<(reactor::Task<()>, u64)> = None;
        for _ in 0..self.ops_per_writer {
            // Think time: spreads the operations over the faults' schedule (it
            // costs nothing in virtual time).
            reactor::sleep(Duration::from_millis(rng.random_range(0..THINK_MS_MAX))).await;
            let kind = rng.random_range(0..10);
            if pending.is_some()
                && (kind == 9 || rng.random_bool(0.4))
                && let Some((t, _)) = pending.take()
            {
                t.await;
            }
            match kind {
                0..6 => {
                    let n = rng.random_range(1..=4u64).min(own.end - own.start);
                    let first = match &pending {
                        // Overlap the write in flight, mostly.
                        Some((_, at)) if rng.random_bool(0.7) => {
                            let lo = at.saturating_sub(n - 1).max(own.start);
                            let hi = (*at).min(own.end - n);
                            rng.random_range(lo..=hi.max(lo))
                        }
                        _ => rng.random_range(own.start..=own.end - n),
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
                    let w = self.clone().write(vol.clone(), first, n, how);
                    if pending.is_none() && rng.random_bool(0.3) {
                        pending = Some((reactor::spawn(w), first));
                    } else {
                        w.await;
                    }
                }
                6..9 => {
                    let n = rng.random_range(1..=8u64).min(self.blocks);
                    let first = rng.random_range(0..=self.blocks - n);
                    self.checked_read(&vol, first, n).await;
                }
                _ => match vol.flush().await {
                    Ok(()) => self.count(|f| f.flushes += 1),
                    Err(e) if self.may_time_out.get() && is_timeout(&e) => {
                        self.count(|f| f.failed += 1);
                    }
                    Err(e) => {
                        self.count(|f| f.failed += 1);
                        self.complain(format!("flush failed: {e}"));
                    }
                },
            }
        }
        if let Some((t, _)) = pending.take() {
            t.await;
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

/// Client process `client` (of `clients`)'s main task: its writers, then in
/// client 0 the final read-back when the simulator asks for it.
pub async fn run(cluster: Cluster, w: Rc<Workload>, client: usize, clients: usize) {
    let vol = match cluster.open_volume("sim").await {
        Ok(v) => Rc::new(v),
        Err(e) => {
            w.complain(format!("cannot open the volume: {e}"));
            w.finished.set(true);
            w.verified.set(true);
            return;
        }
    };
    let tasks: Vec<_> = (0..w.writers)
        .filter(|i| i % clients.max(1) == client)
        .map(|i| reactor::spawn(w.clone().writer(vol.clone(), i)))
        .collect();
    // A reader of its own: a client whose writers all wait (on a primary that
    // cannot reach its replicas, say) still reads.
    let reader = reactor::spawn(w.clone().reader(vol.clone(), client));
    for t in tasks {
        t.await;
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
    // First a FLUSH: every copy's checksums go to disk (the copies are compared
    // whole after the read-back).
    if let Err(e) = vol.flush().await {
        w.complain(format!("the final flush failed: {e}"));
    }
    let mut first = 0;
    while first < w.blocks {
        let n = VERIFY_BLOCKS.min(w.blocks - first);
        w.checked_read(&vol, first, n).await;
        first += n;
    }
    w.verified.set(true);
}
