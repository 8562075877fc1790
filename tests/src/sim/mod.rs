//! The deterministic simulator: a whole Flame cluster — OSD processes, the
//! manager's state machine and client processes — in one process, on one thread,
//! in virtual time, driven by one seed.
//!
//! What runs is the real code: each simulated OSD is the real shard
//! (`flame_osd::shard_thread::build_shard` and `serve`: execute, replication,
//! the decision core, recovery, activation, scrub, the store and its journal and
//! placement-group log) on its own simulated reactor, with its store on the
//! simulated disk (`Fs::Sim`); the client is the real `flame-client` library
//! (placement, retries, resends, map refreshes) on its own reactor; the manager is
//! the real `ClusterState` (registration, heartbeats, failure detection,
//! intervals, volumes). They talk over the simulated network
//! (`flame_common::transport::sim`), and every timer reads the virtual clock
//! (`flame_common::clock`), which jumps to the next timer or delivery whenever
//! every process is idle.
//!
//! What is modelled rather than run: the OSD's control thread and the manager's
//! HTTP layer. The simulator calls the manager's state machine directly where the
//! control thread would post (boot, heartbeat, recovered members, failed peers),
//! renews the OSD's lease as the control thread does on an answered heartbeat,
//! and hands out maps where the long-poll and on-demand fetches would — each only
//! while the path between that process and the manager is not cut.
//!
//! Faults, drawn from the seed: an OSD crashes (its reactor and every task on it
//! dropped, its disk kept as the kernel's page cache keeps it) and restarts
//! later; an OSD loses power (its disk keeps a random part of what was not made
//! stable); an OSD is cut off from some or all of the others and the manager,
//! by refusal or by a black hole. Mostly one OSD is impaired at a time, so every
//! group keeps `min_size` copies and no I/O may fail; with four OSDs a second
//! fault (a kill -9 or a cut) sometimes overlaps the first on another OSD, as in
//! the chaos runs: the groups of both then have one copy and wait (or time out)
//! until one comes back.
//!
//! Checkers: every read against the per-block write oracle (`crate::oracle`): no
//! block older than its last acknowledged write or newer than its last issued
//! one; no client operation fails; no panic or assertion anywhere; after the
//! faults stop, every group's copies converge and a read-back of every block
//! written (and a sample of the others) verifies. A
//! failing seed is replayed with `scripts/simulate.sh --seed N` (the same events,
//! in the same order: the trace hash says so).

pub mod clocks;
mod faults;
mod workload;

pub use faults::{FaultKind, SideFaults, Swarm};

use arc_swap::ArcSwap;
use flame_client::{ClientConfig, Cluster};
use flame_common::auth::{EntityName, Role, SecretKey, ServiceKey, TICKET_LIFETIME_MS};
use flame_common::clock;
use flame_common::ids::{Epoch, OsdId};
use flame_common::map::{ClusterMap, PoolConfig};
use flame_common::mgr_api::{
    OsdBoot, OsdFailureReport, OsdHeartbeat, PG_RECOVERED_ENTRIES_MAX, PgRecoveredReport, TrimDone,
    TrimRange, VolumeCreate, VolumeResize, VolumeTrim,
};
use flame_common::reactor::{self, Reactor};
use flame_common::transport::sim::{self as net, LinkFault, NetConfig};
use flame_common::transport::{Listener, TransportKind};
use flame_mgr::state::{ClusterState, PersistedState};
use flame_osd::config::OsdConfig;
use flame_osd::liveness::Liveness;
use flame_osd::recovery::RecoveryShared;
use flame_osd::shard_thread::{ShardParts, build_shard, serve};
use flame_osd::store::fs::{Fs, SimFs};
use flame_osd::store::{ObjectStore, StoreOptions, layout};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cell::RefCell;
use std::collections::{BTreeSet, VecDeque};
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use workload::{WorkloadFigures, WorkloadShape};

/// The manager's address on the simulated network (for cutting paths to it).
const MGR_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(127, 0, 9, 1));
/// Client process `k`'s address.
fn client_ip(k: usize) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(127, 0, 8, 1 + k as u8))
}
/// Every OSD's data port.
const OSD_PORT: u16 = 6900;
/// How often the modelled control plane runs: map pushes, heartbeats due,
/// reports, the manager's failure check.
const TICK: Duration = Duration::from_millis(50);
/// The timings of the model before the swarm (the regression seeds'): they
/// break the rule `lease_ms + heartbeat_interval_ms < heartbeat_grace_ms`
/// (1500 + 500 = 2000), which the swarm's drawn timings keep.
const LEGACY_TIMINGS: SimTimings = SimTimings {
    heartbeat_interval_ms: 500,
    lease_ms: 1500,
    heartbeat_grace_ms: 2000,
    report_min_silence_ms: 1600,
};
/// Virtual time the cluster runs on after it looks clean, before the copies are
/// compared (several recovery passes), besides three leases: a complete member
/// that failed writes is caught up once it has stayed complete for two leases
/// (`recovery_pass`), so the wait grows with the seed's drawn lease.
const SETTLE_QUIET: Duration = Duration::from_secs(8);
/// Tasks one reactor runs per step before the others get a turn.
const TASKS_PER_STEP_MAX: usize = 4096;
/// The simulated disk's latency per data operation, in virtual microseconds.
const DISK_LATENCY_US_MIN: u64 = 5;
const DISK_LATENCY_US_MAX: u64 = 600;
/// How long a flaky path ([`FaultKind::CorruptFrames`] and its kin) may delay
/// one frame.
const WEATHER_DELAY_MAX: Duration = Duration::from_millis(200);
/// Virtual time after which no new fault is injected and every impairment
/// ends: a seed whose swarm faults without pause (a fault every 0.1-1 s) on a
/// large workload would otherwise not finish within
/// [`SimConfig::virtual_time_max`] (seed 522: 173 faults in 600 s, its writers
/// still at work).
const FAULT_PHASE_MAX: Duration = Duration::from_secs(120);
/// Events kept for the report of a failing seed.
const EVENTS_KEPT: usize = 64;
/// Client operations per seed, drawn (the CLI's `--ops` overrides).
const OPS_MIN: u64 = 1000;
const OPS_MAX: u64 = 2000;

/// The OSDs' heartbeat interval and lease and the manager's grace and report
/// silence of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SimTimings {
    /// Every OSD's `heartbeat_interval_ms`.
    pub heartbeat_interval_ms: u64,
    /// Every OSD's `lease_ms`.
    pub lease_ms: u64,
    /// The manager's `heartbeat_grace_ms`.
    pub heartbeat_grace_ms: u64,
    /// The manager's `failure_report_min_silence_ms`.
    pub report_min_silence_ms: u64,
}

impl SimTimings {
    /// Draws timings from the valid ranges: an interval of 100-1000 ms, a lease
    /// of 2-5 intervals, a grace 1-2000 ms past lease + interval, a report
    /// silence from lease + interval up to the grace. Checked against the
    /// daemons' own rules (`flame_common::timing`): the drawn timings are ones a
    /// deployment may run.
    pub fn draw(rng: &mut StdRng) -> SimTimings {
        let heartbeat_interval_ms = rng.random_range(100..=1000);
        let lease_ms = heartbeat_interval_ms * rng.random_range(2..=5);
        let floor = lease_ms + heartbeat_interval_ms;
        let heartbeat_grace_ms = floor + rng.random_range(1..=2000);
        let report_min_silence_ms = rng.random_range(floor..heartbeat_grace_ms);
        let t = SimTimings {
            heartbeat_interval_ms,
            lease_ms,
            heartbeat_grace_ms,
            report_min_silence_ms,
        };
        if let Err(e) = t.check() {
            panic!("drawn timings {t:?} break a rule: {e}");
        }
        t
    }

    /// The daemons' timing rules ([`flame_common::timing::check_osd_against_mgr`]).
    pub fn check(&self) -> Result<(), flame_common::timing::TimingError> {
        flame_common::timing::check_osd_against_mgr(
            flame_common::timing::OsdTimings {
                lease_ms: self.lease_ms,
                heartbeat_interval_ms: self.heartbeat_interval_ms,
            },
            flame_common::timing::MgrTimings {
                heartbeat_grace_ms: self.heartbeat_grace_ms,
                failure_report_min_silence_ms: self.report_min_silence_ms,
            },
        )
    }
}

impl std::fmt::Display for SimTimings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "heartbeat {} ms, lease {} ms, grace {} ms, report silence {} ms",
            self.heartbeat_interval_ms,
            self.lease_ms,
            self.heartbeat_grace_ms,
            self.report_min_silence_ms
        )
    }
}

/// What one simulated run does.
#[derive(Clone, Debug)]
pub struct SimConfig {
    /// Everything random in the run derives from it.
    pub seed: u64,
    /// OSD processes (pool size 3, `min_size` 2).
    pub osds: usize,
    /// Client processes (each its own `flame-client` instance, session and map).
    pub clients: usize,
    /// Client tasks, each writing its own blocks and reading any (spread over
    /// the clients).
    pub writers: usize,
    /// Client operations in all (the workload's bound).
    pub ops: u64,
    /// Inject faults (crashes, power loss, partitions).
    pub faults: bool,
    /// Placement groups (drawn: 8-64).
    pub pg_count: u32,
    /// Shards (threads, each with its own reactor, store and groups) per OSD.
    pub shards: u16,
    /// The OSDs' and the manager's timings.
    pub timings: SimTimings,
    /// Hosts the OSDs are spread over (OSD `i` on host `i % hosts`): placement
    /// puts a group's copies on distinct hosts first.
    pub hosts: usize,
    /// The workload's volumes (1-3 of 64 MiB-1 GiB), object size (64-256 KiB),
    /// ownership stripes and writers' windows, drawn from the seed.
    pub shape: WorkloadShape,
    /// The OSDs' bound on each group's log (`OsdConfig::pg_log_entries_max`),
    /// drawn small (8-256), so that logs trim under the workload and a member
    /// that missed more than the log keeps catches up by backfill.
    pub pg_log_entries_max: u32,
    /// Virtual time after which the run fails as stuck.
    pub virtual_time_max: Duration,
    /// The client's `io_timeout_ms` (0: never give up). With a timeout, an
    /// operation a fault stalls fails: a write is then abandoned (issued, never
    /// acknowledged; it may still land, but never over a newer one).
    pub io_timeout_ms: u64,
    /// Disk faults besides read errors: a disk that fails writes and syncs
    /// (its OSD stops, as the daemon does, and restarts later) and a full file
    /// system (writes fail with ENOSPC). Off for the seeds that found bugs in
    /// the model before these existed, so that they replay as they did.
    pub disk_faults: bool,
    /// Slow disks: beside a fault, sometimes one OSD's data operations take
    /// 50 ms-2 s each (a disk remapping sectors, a saturated array, a stalling
    /// controller): writes stay in flight on one copy while the rest of the
    /// cluster moves on (a backfill lists a group while a creating write is
    /// still on the primary's disk). Off for the seeds that found bugs before.
    pub slow_disks: bool,
    /// An OSD whose power cut (or failed disk) left it in doubt stays impaired
    /// until its doubt is settled — its primaries compared it, or, as a
    /// primary, it pulled what it was in doubt about — so no other fault comes
    /// meanwhile: a second copy losing the same unflushed write before then is
    /// a double fault (two disks' volatile caches lost), beyond the model
    /// (seed 230811, with slow disks: the primary compared the restarted copy
    /// too late, and lost power itself). Off for the seeds found before it.
    pub doubt_impairs: bool,
    /// Hot rewrites: a fifth of the writes (when none is left in flight)
    /// rewrite a range the same writer wrote among its last few, as a file
    /// system rewrites its journal and metadata blocks. A write a fault held
    /// back (the network, a slow disk, a deposed primary) that lands after
    /// its own rewrite ages the block — what the interval fence
    /// (`admit_client_write`) and the log's deduplication keep from happening.
    /// Off for the seeds found before it, so that they replay as they did.
    pub rewrites: bool,
    /// A held black hole's frames arrive up to as long after the heal as the
    /// hold lasted (TCP's exponential backoff), not only 0-4 s: a write held
    /// through a long cut lands after its OSD returned and became primary
    /// again (what the interval fence is for). Off for the seeds found before
    /// it, so that they replay as they did.
    pub tcp_backoff: bool,
    /// Half the seeds shrink the volume once while the workload runs (the
    /// manager's new size, the client library's trim of the cut-off range on
    /// every copy), and grow it back once the trim is done. Off for the seeds
    /// that found bugs before resizes existed.
    pub resizes: bool,
    /// Half the seeds' black holes hold what is sent into them and deliver it,
    /// in order, 0-4 s after the path heals — TCP retransmitting once an
    /// iptables DROP is removed, also for sockets their process closed or lost
    /// meanwhile — instead of losing it and resetting the connection. Off for
    /// the seeds that found bugs before it existed.
    pub tcp_holds: bool,
    /// A resize keeps the volume shrunk 0.2-2 s after its trim before it grows
    /// back, and in half of them the last client gets no map from the shrink
    /// to the grow (its writes past the new end must be refused by the OSDs).
    /// Off for the seeds that found bugs before it existed.
    pub resize_stays_shrunk: bool,
    /// Half the seeds' OSDs scrub each group they are the primary of every
    /// 1-3 s of virtual time (background scrub: compare every acting copy,
    /// repair the minority), under the workload and the faults. Off for the
    /// seeds that found bugs before it existed.
    pub scrubs: bool,
    /// Bit rot: with some faults, one bit of a checksummed data block of one
    /// copy flips on its disk (silently: the file system reports nothing).
    /// Reads must never return it (the store's checksums, read repair) and
    /// scrubs repair it. Off for the seeds that found bugs before it existed.
    pub bit_rot: bool,
    /// Swarm faults: the seed draws which fault kinds are on and their
    /// weights ([`Swarm`]), from every kind, the network's corrupted,
    /// duplicated and delayed frames and repeated power losses included. Off:
    /// the fixed draw of the model before it, for the seeds that found bugs
    /// there, so that they replay as they did.
    pub swarm: bool,
    /// Files of this name (an object's, `<volume>.<index>` in 16 hex digits
    /// each) are traced on every OSD's disk: each write (with the workload's
    /// block counters), punch, sync, unlink and power cut is logged (`info`,
    /// target `simfs`). Only for following a failing seed; changes nothing else.
    pub trace_file: Option<String>,
}

impl SimConfig {
    /// The `scripts/simulate.sh` command that runs this configuration.
    pub fn replay_command(&self) -> String {
        let d = if self.swarm {
            SimConfig::new(self.seed)
        } else {
            SimConfig::legacy(self.seed)
        };
        let mut c = format!("scripts/simulate.sh --seed {}", self.seed);
        if self.ops != d.ops {
            c += &format!(" --ops {}", self.ops);
        }
        if self.pg_log_entries_max != d.pg_log_entries_max {
            c += &format!(" --pg-log {}", self.pg_log_entries_max);
        }
        if self.clients != d.clients {
            c += &format!(" --clients {}", self.clients);
        }
        if self.writers != d.writers {
            c += &format!(" --writers {}", self.writers);
        }
        if !self.faults {
            c += " --no-faults";
        }
        if !self.disk_faults {
            c += " --no-disk-faults";
        }
        if !self.resizes {
            c += " --no-resizes";
        }
        if !self.tcp_holds {
            c += " --no-tcp-holds";
        }
        if !self.resize_stays_shrunk {
            c += " --no-shrunk-wait";
        }
        if !self.scrubs {
            c += " --no-scrubs";
        }
        if !self.bit_rot {
            c += " --no-bit-rot";
        }
        if !self.slow_disks && d.slow_disks {
            c += " --no-slow-disks";
        }
        if !self.doubt_impairs && d.doubt_impairs {
            c += " --doubt-does-not-impair";
        }
        if !self.rewrites && d.rewrites {
            c += " --no-rewrites";
        }
        if !self.tcp_backoff && d.tcp_backoff {
            c += " --no-tcp-backoff";
        }
        if !self.swarm {
            c += " --no-swarm";
        }
        c
    }

    /// The defaults CI runs, for `seed`.
    pub fn new(seed: u64) -> SimConfig {
        // The workload's shape: a stream of its own.
        let mut rng = StdRng::seed_from_u64(seed ^ 0x3017_10ad);
        let object_size = 1u64 << rng.random_range(16..=18u32);
        let volumes = (0..rng.random_range(1..=3))
            .map(|_| {
                // 64 MiB-1 GiB, each power of two as likely, whole objects.
                let low = 1u64 << rng.random_range(26..=29u32);
                let bytes = rng.random_range(low..=2 * low);
                bytes / object_size * object_size
            })
            .collect();
        let writers = rng.random_range(3..=8);
        let stripe_blocks = rng.random_range(2..=12);
        let window_objects = rng.random_range(2..=8);
        let pg_count = rng.random_range(8..=64);
        let log_low = 1u32 << rng.random_range(3..=7u32);
        let pg_log_entries_max = rng.random_range(log_low..=2 * log_low);
        let ops = rng.random_range(OPS_MIN..=OPS_MAX);
        let mut c = SimConfig {
            seed,
            // Every other seed has a fourth OSD: placement changes (out/in) move
            // groups to new members, which backfill.
            osds: if seed.is_multiple_of(2) { 4 } else { 3 },
            clients: 2,
            writers,
            ops,
            faults: true,
            pg_count,
            shards: 1,
            timings: LEGACY_TIMINGS,
            hosts: if seed.is_multiple_of(2) { 4 } else { 3 },
            shape: WorkloadShape {
                volumes,
                object_size,
                stripe_blocks,
                window_objects,
            },
            pg_log_entries_max,
            virtual_time_max: Duration::from_secs(600),
            // Every third seed gives up on stalled I/O: abandoned writes.
            io_timeout_ms: if seed.is_multiple_of(3) {
                1500 + (seed % 7) * 500
            } else {
                0
            },
            disk_faults: true,
            resizes: true,
            tcp_holds: true,
            resize_stays_shrunk: true,
            scrubs: true,
            bit_rot: true,
            swarm: true,
            trace_file: None,
            doubt_impairs: true,
            slow_disks: true,
            rewrites: true,
            tcp_backoff: true,
        };
        c.draw_shape();
        c
    }

    /// The model the regression seeds found their bugs in, before issue 30's
    /// widening (no swarm; three or four OSDs, one shard each, each its own
    /// host): they replay as they did.
    /// Its workload is as close to the old one as the new workload makes it:
    /// one 4 MiB volume of 1 MiB objects in 8 groups, four writers each owning
    /// one contiguous quarter (a 256-block stripe), 300 operations, a log that
    /// never trims.
    pub fn legacy(seed: u64) -> SimConfig {
        let osds = if seed.is_multiple_of(2) { 4 } else { 3 };
        SimConfig {
            swarm: false,
            trace_file: None,
            slow_disks: false,
            doubt_impairs: false,
            rewrites: false,
            tcp_backoff: false,
            osds,
            shards: 1,
            hosts: osds,
            writers: 4,
            ops: 300,
            pg_count: 8,
            pg_log_entries_max: 2048,
            shape: WorkloadShape {
                volumes: vec![4 << 20],
                object_size: 1 << 20,
                stripe_blocks: 256,
                window_objects: 4,
            },
            timings: LEGACY_TIMINGS,
            ..SimConfig::new(seed)
        }
    }

    /// Draws the cluster's shape (its own stream): 3-9 OSDs (mostly few: a
    /// seed with nine costs three times one with three), 1-4 shards each, over
    /// 1-3 hosts or one host each.
    fn draw_shape(&mut self) {
        let mut rng = StdRng::seed_from_u64(self.seed ^ 0x05d5_4a9e);
        self.osds = match rng.random_range(0..20) {
            0..10 => rng.random_range(3..=4),
            10..17 => rng.random_range(5..=6),
            _ => rng.random_range(7..=9),
        };
        self.shards = if rng.random_bool(0.5) {
            1
        } else {
            rng.random_range(2..=4)
        };
        self.hosts = match rng.random_range(0..4) {
            0 => 1,
            1 => 2,
            2 => 3,
            _ => self.osds,
        };
        self.timings = SimTimings::draw(&mut rng);
    }

    /// The seed's swarm: drawn from a stream of its own (the legacy draw
    /// without [`SimConfig::swarm`]).
    pub fn swarm(&self) -> Swarm {
        if !self.swarm || !self.faults {
            return Swarm::legacy();
        }
        Swarm::draw(
            &mut StdRng::seed_from_u64(self.seed ^ 0x5a4e_3000),
            self.osds,
        )
    }

    /// What the seed's workload and cluster look like, for its report line.
    pub fn describe(&self) -> String {
        let sizes: Vec<String> = self
            .shape
            .volumes
            .iter()
            .map(|b| format!("{}", b >> 20))
            .collect();
        format!(
            "{} OSDs, {} volume{} of {} MiB, {} KiB objects, {} groups, PG log {}, {} writers \
             on {}-block stripes in {}-object windows, {} ops",
            self.osds,
            sizes.len(),
            if sizes.len() == 1 { "" } else { "s" },
            sizes.join("+"),
            self.shape.object_size >> 10,
            self.pg_count,
            self.pg_log_entries_max,
            self.writers,
            self.shape.stripe_blocks,
            self.shape.window_objects,
            self.ops,
        )
    }

    /// The background scrub interval of this seed's OSDs, if it scrubs: drawn
    /// from a stream of its own, so seeds that do not scrub run as before.
    fn scrub_interval_s(&self) -> Option<u64> {
        let mut rng = StdRng::seed_from_u64(self.seed ^ 0x5c2b_d0e5);
        // Every 1-3 s suited one 4 MiB volume; a scrub compares every object of
        // a group on every copy, and the disk-like workload's thousands of
        // objects made such seeds a hundred times slower (seed 6: 1.3 s
        // without scrubs, minutes with; seed 522 still 2 minutes at 10-30 s):
        // every 30-90 s there.
        let (lo, hi) = if self.swarm { (30, 90) } else { (1, 3) };
        (self.scrubs && rng.random_bool(0.5)).then(|| rng.random_range(lo..=hi))
    }
}

/// What a run found.
#[derive(Debug, Default)]
pub struct SimReport {
    /// The seed.
    pub seed: u64,
    /// Hash of every message delivered and every fault injected, in order: two
    /// runs of one seed must agree.
    pub trace_hash: u64,
    /// Messages delivered.
    pub deliveries: u64,
    /// Virtual time the run took.
    pub virtual_time: Duration,
    /// What the workload did.
    pub workload: WorkloadFigures,
    /// Faults injected.
    pub faults: u64,
    /// What the OSDs' background scrubs did.
    pub scrubs: ScrubFigures,
    /// Bit rot injected, and how much was left unrepaired.
    pub rot: RotFigures,
    /// Objects new primaries took from a complete copy with newer writes
    /// before peering (`flame-osd/src/recovery/newest_copy.rs`).
    pub newer_copies_taken: u64,
    /// The seed's fault kinds and weights, and the cluster's shape.
    pub swarm: String,
    /// Frames the network corrupted and duplicated (a corrupted frame that
    /// still decoded fails the seed).
    pub frames: net::CorruptionFigures,
    /// Reads and writes the OSDs refused because their lease had run out
    /// (`Liveness::lease_refusals`): the fence of a cut-off OSD at work.
    pub lease_refusals: u64,
    /// Every checker's complaint (empty: the seed passed).
    pub errors: Vec<String>,
    /// The last events before the end (faults, restarts, epochs), for a failure.
    pub events: Vec<String>,
    /// The command that replays this run (with its options that differ from the
    /// defaults).
    pub replay: String,
    /// What the seed ran ([`SimConfig::describe`]): its drawn volumes, object
    /// size, groups, log bound, writers and operations.
    pub setup: String,
}

/// A block the simulator rotted: on OSD `osd`'s disk, in `path`, the block at
/// `start` in the file, bit `bit` of byte `at` flipped, which left it `rotted`.
struct Rot {
    osd: usize,
    path: PathBuf,
    start: usize,
    at: u64,
    bit: u8,
    rotted: Vec<u8>,
}

/// Bit rot over a run.
#[derive(Debug, Default, Clone, Copy)]
pub struct RotFigures {
    /// Blocks rotted.
    pub injected: u64,
    /// Of those, still rotted at the end (nothing read or scrubbed them since):
    /// undone before the copies are compared.
    pub unrepaired: u64,
}

/// Background scrubs over a run, summed over every OSD process.
#[derive(Debug, Default, Clone, Copy)]
pub struct ScrubFigures {
    /// Group scrubs finished.
    pub groups: u64,
    /// Objects found with copies that did not agree.
    pub inconsistent: u64,
    /// Objects repaired.
    pub repaired: u64,
    /// Blocks found differing with no known reason (`RecoveryShared::scrub_unexplained`).
    pub unexplained: u64,
}

impl SimReport {
    /// Whether every checker passed.
    pub fn passed(&self) -> bool {
        self.errors.is_empty()
    }
}

impl std::fmt::Display for SimReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "seed {}: {} in {:.1} s virtual, {} deliveries, {} faults, trace {:016x}; {}; {}; {} group scrubs ({} objects inconsistent, {} repaired); {} blocks rotted ({} left at the end); {} newer copies taken by peering; {} frames corrupted, {} duplicated; {} requests refused for a lease run out; {}",
            self.seed,
            if self.passed() { "passed" } else { "FAILED" },
            self.virtual_time.as_secs_f64(),
            self.deliveries,
            self.faults,
            self.trace_hash,
            self.setup,
            self.workload,
            self.scrubs.groups,
            self.scrubs.inconsistent,
            self.scrubs.repaired,
            self.rot.injected,
            self.rot.unrepaired,
            self.newer_copies_taken,
            self.frames.corrupted,
            self.frames.duplicated,
            self.lease_refusals,
            self.swarm,
        )?;
        for e in &self.errors {
            writeln!(f, "  error: {e}")?;
        }
        if !self.passed() {
            writeln!(f, "  last events:")?;
            for e in &self.events {
                writeln!(f, "    {e}")?;
            }
            writeln!(f, "  replay: {}", self.replay)?;
        }
        Ok(())
    }
}

/// Runs one seed on a fresh thread (the virtual clock and the network are the
/// thread's) and returns its report. A panic in any simulated process is caught
/// and reported as the seed's failure.
pub fn run(config: SimConfig) -> SimReport {
    let seed = config.seed;
    let replay = config.replay_command();
    let setup = config.describe();
    let res = std::thread::Builder::new()
        .name(format!("sim-{seed}"))
        .spawn(move || {
            clock::simulated();
            flame_common::entropy::seed_thread(Some(seed));
            net::install(NetConfig {
                seed,
                latency_us_min: 20,
                latency_us_max: 400,
            });
            // Its own stream, so that seeds whose black holes lose run as before.
            if config.tcp_holds && StdRng::seed_from_u64(seed ^ 0x7c90_1d00).random_bool(0.5) {
                net::set_hold_black_holes(true);
                net::set_tcp_backoff(config.tcp_backoff);
            }
            let report = Sim::new(config).run();
            net::uninstall();
            report
        })
        .map_err(|e| e.to_string())
        .and_then(|h| {
            h.join().map_err(|p| {
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "a panic".into())
            })
        });
    res.unwrap_or_else(|panic| SimReport {
        seed,
        errors: vec![format!("panicked: {panic}")],
        replay,
        setup,
        ..SimReport::default()
    })
}

/// One OSD process while it runs: what dies with it.
struct LiveOsd {
    /// One per shard.
    reactors: Vec<Reactor>,
    map: Arc<ArcSwap<ClusterMap>>,
    wanted_epoch: Arc<AtomicU64>,
    liveness: Arc<Liveness>,
    recovery: Arc<RecoveryShared>,
    /// Its restart-doubt record: what it still doubts.
    doubt: Arc<flame_osd::store::doubt_record::DoubtRecord>,
    next_heartbeat: Instant,
}

/// One simulated OSD: its identity and disk outlive its processes.
struct SimOsd {
    index: usize,
    ip: IpAddr,
    uuid: String,
    id: Option<OsdId>,
    fs: Rc<SimFs>,
    root: PathBuf,
    config: Arc<OsdConfig>,
    incarnation: u64,
    live: Option<LiveOsd>,
    /// When a crashed or powered-off OSD starts again.
    restart_at: Option<Instant>,
    /// A power cut (or a failed disk) left this OSD in doubt, and that doubt
    /// may not be settled yet ([`Sim::doubt_settled`]).
    in_doubt: bool,
    /// When this OSD's slow disk is fast again: a fault's end leaves it slow
    /// 0-3 s longer, so the operations it holds land after the cluster moved
    /// on (a member back in its groups, a backfill listing them).
    slow_disk_until: Option<Instant>,
    /// This OSD host's clock: skew and drift ([`clocks`]); kept across restarts.
    clock: clock::NodeClock,
}

/// A client process.
struct SimClient {
    ip: IpAddr,
    reactor: Reactor,
    cluster: Cluster,
    /// Its process incarnation (a crash and restart starts the next).
    incarnation: u64,
    /// Crashed: nothing runs until it restarts at the end of the fault.
    down: bool,
}

/// A shrink of a volume and its growth back, step by step.
struct Resize {
    /// Which volume (of [`SimConfig::shape`]).
    volume: usize,
    /// When the next step is due.
    at: Instant,
    /// The size to shrink to.
    shrink_to: u64,
    /// How long the volume stays shrunk after its trim, before it grows back.
    shrunk_for: Duration,
    /// The last client gets no map from the shrink to the grow: its writes past
    /// the new end go out under the old size, for the OSDs to refuse.
    stale_client: bool,
    step: ResizeStep,
}

enum ResizeStep {
    /// Not started.
    Due,
    /// The manager has the new size; client 0 trims the cut-off range (the
    /// oracle's zeroing write from `first` with `counters`).
    Trimming {
        range: TrimRange,
        first: u64,
        counters: Vec<u64>,
        result: Rc<RefCell<Option<Result<(), String>>>>,
    },
    /// Trimmed, reported, and small until `Resize::at`.
    Shrunk,
    /// Grown back to the full size.
    Done,
}

/// An impairment in force, undone at `until`.
struct Impairment {
    osd: usize,
    until: Instant,
    /// The links it cut, each with how.
    cut: Vec<(IpAddr, IpAddr, LinkFault)>,
    /// The manager is down: at `until` it restarts from what it had persisted.
    manager: bool,
    /// This OSD was marked out: at `until` it is marked in again.
    out: Option<OsdId>,
    /// The clients' connections to this (slow) OSD reset on their side at
    /// `until`.
    reset_clients: bool,
    /// This OSD's disk fails data reads meanwhile (bad sectors).
    read_errors_on: Option<usize>,
    /// This OSD's disk fails writes and syncs meanwhile (it stops at the first).
    write_errors_on: Option<usize>,
    /// This OSD's file system is full meanwhile.
    full_on: Option<usize>,
    /// This OSD's disk is slow meanwhile.
    slow_disk_on: Option<usize>,
    /// The paths near this address are flaky meanwhile ([`net::Weather`]).
    weather_on: Option<IpAddr>,
    /// This OSD lost power and loses it again soon after it restarts.
    repeat_power_loss: bool,
    /// This client process crashed: it restarts when the fault ends.
    client_crashed: Option<usize>,
}

impl Impairment {
    /// An impairment of OSD `osd` until `until` with the cuts `cut` and nothing
    /// else (a crash, a power loss, a cut).
    fn plain(osd: usize, until: Instant, cut: Vec<(IpAddr, IpAddr, LinkFault)>) -> Impairment {
        Impairment {
            osd,
            until,
            cut,
            manager: false,
            out: None,
            reset_clients: false,
            read_errors_on: None,
            write_errors_on: None,
            full_on: None,
            slow_disk_on: None,
            weather_on: None,
            repeat_power_loss: false,
            client_crashed: None,
        }
    }
}

struct Sim {
    config: SimConfig,
    rng: StdRng,
    mgr: ClusterState,
    osds: Vec<SimOsd>,
    /// The client processes; the first one also does the final read-back.
    clients: Vec<SimClient>,
    /// The workload every client runs its part of.
    workload: Option<Rc<workload::Workload>>,
    /// The impairments in force: one, or two while an overlapping one runs.
    impaired: Vec<Impairment>,
    /// When the overlapping fault drawn with the current impairment starts.
    overlap_at: Option<Instant>,
    /// Draws the overlapping faults: its own stream, so that a seed without one
    /// runs exactly as it did before they existed.
    overlap_rng: StdRng,
    /// Draws the disks' read errors, for the same reason.
    disk_rng: StdRng,
    /// Draws the disks' write errors and full file systems, and what a stopped
    /// OSD's disk keeps, for the same reason.
    disk_fault_rng: StdRng,
    /// Draws slow disks ([`SimConfig::slow_disks`]).
    slow_disk_rng: StdRng,
    /// Chance that a fault comes with a slow disk (drawn per seed: 0, 0.15 or 0.3).
    slow_disk_chance: f64,
    /// Bit rot's draws: a stream of its own, so seeds that draw none run as
    /// before.
    rot_rng: StdRng,
    /// Every block the simulator rotted.
    rots: Vec<Rot>,
    /// What became of them.
    rot_figures: RotFigures,
    next_fault: Instant,
    next_tick: Instant,
    started: Instant,
    events: VecDeque<String>,
    errors: Vec<String>,
    faults: u64,
    /// Every OSD process's recovery figures, for the scrub counts.
    recoveries: Vec<Arc<RecoveryShared>>,
    /// Every OSD start's lease state, for the report's lease refusals.
    leases: Vec<Arc<Liveness>>,
    last_epoch: Epoch,
    /// The shrink and growth of the volume, if this seed has one.
    resize: Option<Resize>,
    /// The seed's fault kinds and weights.
    swarm: Swarm,
    /// The manager's disk: its `state.json` as the real store encodes it
    /// (`flame_mgr::store::encode`), written whenever the map's epoch moved,
    /// before the new map reaches anyone. A restarted manager loads it through
    /// the real decoder and its checks, as the daemon does.
    mgr_disk: Vec<u8>,
    /// The epoch `mgr_disk` holds.
    mgr_disk_epoch: Epoch,
    /// A second power loss due: of which OSD, and when.
    power_loss_again: Option<(usize, Instant)>,
    /// The faults have stopped: no OSD starts a new scrub.
    scrubs_paused: bool,
    /// The fault phase ([`FAULT_PHASE_MAX`]) is over: no new fault.
    faults_over: bool,
    /// The OSDs' service key: every OSD checks HELLOs with it and makes its peer
    /// tickets with it, every client gets a ticket made with it (as the manager
    /// issues them), so every simulated connection is authenticated.
    service: ServiceKey,
}

impl Sim {
    fn new(config: SimConfig) -> Sim {
        let now = clock::now();
        let pool = PoolConfig {
            size: 3,
            min_size: 2,
            pg_count: config.pg_count,
            object_size: u32::try_from(config.shape.object_size).unwrap_or(1 << 20),
        };
        let fsid = format!("sim-{:016x}", config.seed);
        let mgr = manager(PersistedState::new_cluster(fsid, pool), now, config.timings);
        let scrub_interval_s = config.scrub_interval_s();
        // The legacy model predates clock skew and drift: its seeds replay
        // with exact clocks.
        let clock_draws = if config.swarm {
            clocks::draw(
                config.seed,
                config.osds,
                clocks::drift_bound_ppm(
                    config.timings.lease_ms,
                    config.timings.heartbeat_interval_ms,
                ),
            )
        } else {
            vec![(0, 0); config.osds]
        };
        let osds = (0..config.osds)
            .map(|i| {
                let ip = IpAddr::V4(Ipv4Addr::new(127, 0, 1, 10 + i as u8));
                let root = PathBuf::from(format!("/sim/osd.{i}"));
                let fs = SimFs::new(&[
                    root.clone(),
                    layout::pgs_dir(&root),
                    layout::journal_dir(&root),
                ]);
                if let Some(name) = &config.trace_file {
                    fs.trace_files_named(name);
                }
                // Disk operations complete out of order, as io_uring's do.
                fs.set_latency(
                    DISK_LATENCY_US_MIN..=DISK_LATENCY_US_MAX,
                    config.seed.wrapping_mul(0x9e37_79b9).wrapping_add(i as u64),
                );
                let config = OsdConfig {
                    mgr: "sim".into(),
                    listen: SocketAddr::new(ip, OSD_PORT),
                    data_dir: root.clone(),
                    host: Some(format!("host-{}", i % config.hosts.max(1))),
                    shards: config.shards,
                    transport: TransportKind::Sim,
                    heartbeat_interval_ms: config.timings.heartbeat_interval_ms,
                    lease_ms: config.timings.lease_ms,
                    connect_timeout_ms: 1000,
                    replica_timeout_ms: 3000,
                    stray_delete_delay_ms: 2000,
                    scrub_interval_s: scrub_interval_s
                        .unwrap_or(OsdConfig::default().scrub_interval_s),
                    pg_log_entries_max: config.pg_log_entries_max,
                    ..OsdConfig::default()
                };
                SimOsd {
                    index: i,
                    ip,
                    uuid: format!("osd-uuid-{i}"),
                    id: None,
                    fs,
                    root,
                    config: Arc::new(config),
                    incarnation: 0,
                    live: None,
                    restart_at: None,
                    in_doubt: false,
                    slow_disk_until: None,
                    clock: clock::NodeClock::exact(),
                }
            })
            .collect();
        let swarm = config.swarm();
        // A stream of its own: seeds whose draw turns slow disks off replay as
        // before they existed.
        let mut slow_disk_rng = StdRng::seed_from_u64(config.seed ^ 0x5107_d15c);
        let slow_disk_chance = if config.slow_disks && config.faults {
            [0.0, 0.15, 0.3][slow_disk_rng.random_range(0..3)]
        } else {
            0.0
        };
        let mut sim = Sim {
            rng: StdRng::seed_from_u64(config.seed ^ 0x5eed_f1a3e),
            mgr,
            osds,
            clients: Vec::new(),
            workload: None,
            impaired: Vec::new(),
            overlap_at: None,
            overlap_rng: StdRng::seed_from_u64(config.seed ^ 0x0e71_a9f5),
            disk_rng: StdRng::seed_from_u64(config.seed ^ 0xd15c_e770),
            disk_fault_rng: StdRng::seed_from_u64(config.seed ^ 0xd15c_fa11),
            slow_disk_rng,
            slow_disk_chance,
            rot_rng: StdRng::seed_from_u64(config.seed ^ 0x0b17_2071),
            rots: Vec::new(),
            rot_figures: RotFigures::default(),
            config,
            next_fault: now + Duration::from_millis(200),
            next_tick: now,
            started: now,
            events: VecDeque::new(),
            errors: Vec::new(),
            faults: 0,
            recoveries: Vec::new(),
            leases: Vec::new(),
            last_epoch: Epoch(0),
            resize: None,
            swarm,
            mgr_disk: Vec::new(),
            mgr_disk_epoch: Epoch(0),
            power_loss_again: None,
            scrubs_paused: false,
            faults_over: false,
            service: {
                // A fixed cluster secret: keys are not what the simulator
                // explores, and a seed must replay exactly.
                let secret = SecretKey::from_hex(&"5e".repeat(32))
                    .unwrap_or_else(|e| panic!("fixed key: {e}"));
                ServiceKey::from_osd_key(&secret.derive_entity_key(&EntityName::osd(), 1), 1)
            },
        };
        // Every OSD host's clock is off the manager's, within the bounds.
        for (i, (skew_ms, drift_ppm)) in clock_draws.into_iter().enumerate() {
            sim.set_osd_clock(i, skew_ms, drift_ppm);
        }
        sim
    }

    fn event(&mut self, what: String) {
        net::trace_event(what.as_bytes());
        let at = clock::elapsed(self.started).as_secs_f64();
        if self.events.len() == EVENTS_KEPT {
            self.events.pop_front();
        }
        self.events.push_back(format!("{at:9.3} s  {what}"));
    }

    fn run(mut self) -> SimReport {
        for i in 0..self.osds.len() {
            self.start_osd(i);
        }
        if let Err(e) = self.start_clients() {
            self.errors.push(e);
            return self.report();
        }
        // The workload, with faults.
        let deadline = self.started + self.config.virtual_time_max;
        let finished = self.drive(deadline, true, |s| {
            s.workload.as_ref().is_some_and(|w| w.finished()) && s.resize_done()
        });
        if !finished {
            self.errors.push(format!(
                "the workload did not finish within {:?} of virtual time",
                self.config.virtual_time_max
            ));
            return self.report();
        }
        // The faults stop: everything comes back and settles. No scrub runs
        // from here on, so the copies compared below are what recovery made of
        // them, before any scrub repair.
        self.end_all_faults("the workload is done");
        self.scrubs_paused = true;
        for o in self.osds.iter().filter_map(|o| o.live.as_ref()) {
            o.recovery.scrubs_paused.store(true, Ordering::Relaxed);
        }
        let settle = clock::now() + Duration::from_secs(60);
        let mut clean = self.drive(settle, false, |s| s.all_clean());
        if clean {
            // The map being clean does not mean every primary is done: a complete
            // member that failed writes is caught up without a map change. Give
            // the recovery loops a quiet while, then look again.
            let quiet = clock::now()
                + SETTLE_QUIET
                + Duration::from_millis(3 * self.config.timings.lease_ms);
            self.drive(quiet, false, |_| false);
            clean = self.all_clean();
        }
        if !clean {
            self.errors
                .push("the cluster did not return to clean within 60 s after the faults".into());
        }
        // Every copy compared before anything reads or repairs it: a FLUSH of
        // every volume puts each copy's checksums on disk, then whole files are
        // compared (a rotted block nothing read yet counts as its unrotted
        // self: the medium's fault, not a divergence).
        if clean {
            if self.flush_all_volumes() {
                let differing = self.compare_copies(true);
                self.errors.extend(
                    differing
                        .into_iter()
                        .map(|e| format!("before the read-back: {e}")),
                );
                if !self.errors.is_empty() {
                    return self.report();
                }
            } else {
                self.errors
                    .push("the FLUSH before the first comparison did not finish".into());
            }
        }
        // Read back through the client every block a write was issued to, and a
        // sample of the others.
        if let Some(w) = &self.workload {
            w.start_verify();
        }
        let verify_by = clock::now() + Duration::from_secs(120);
        let verified = self.drive(verify_by, false, |s| {
            s.workload.as_ref().is_some_and(|w| w.verified())
        });
        if !verified {
            self.errors
                .push("the final read-back did not finish within 120 s".into());
        }
        // The read-back began with a FLUSH: every copy's checksums are on disk too,
        // so whole files are compared, header and checksums included.
        if clean && verified {
            // Before the rots are forgotten.
            self.check_checksum_mismatches();
            self.undo_unrepaired_rot();
            let differing = self.compare_copies(false);
            self.errors.extend(differing);
        }
        self.report()
    }

    /// Every checksum mismatch an OSD found must be on a block the simulator
    /// rotted: any other is the store losing track of its own bytes (a
    /// start-up that did not recompute an interrupted write's checksums),
    /// which read repair and scrub would otherwise hide.
    fn check_checksum_mismatches(&mut self) {
        let data_at = flame_osd::store::meta::DATA_OFFSET as usize;
        let mut unexplained = std::collections::BTreeSet::new();
        for (j, o) in self.osds.iter().enumerate() {
            for (path, block) in o.fs.take_checksum_mismatches() {
                let start = data_at + block as usize * 4096;
                if !self
                    .rots
                    .iter()
                    .any(|r| r.osd == j && r.path == path && r.start == start)
                {
                    unexplained.insert((j, path, block));
                }
            }
        }
        for (j, path, block) in unexplained {
            self.errors.push(format!(
                "osd.{j}: checksum mismatch in {} block {block}, which no fault rotted",
                path.display()
            ));
        }
    }

    fn report(mut self) -> SimReport {
        let (trace_hash, deliveries) = net::trace_hash();
        let workload = self
            .workload
            .as_ref()
            .map(|w| w.figures())
            .unwrap_or_default();
        if let Some(w) = &self.workload {
            self.errors.extend(w.errors());
        }
        let virtual_time = clock::elapsed(self.started);
        let frames = net::corruption();
        if frames.undetected > 0 {
            self.errors.push(format!(
                "{} of {} corrupted frames decoded as messages: the frame checksums missed them",
                frames.undetected, frames.corrupted
            ));
        }
        self.check_checksum_mismatches();
        let mut scrubs = ScrubFigures::default();
        let mut newer_copies_taken = 0;
        for r in &self.recoveries {
            newer_copies_taken += r.newer_copies_taken.load(Ordering::Relaxed);
            scrubs.groups += r.scrubs.load(Ordering::Relaxed);
            scrubs.inconsistent += r.scrub_errors.load(Ordering::Relaxed);
            scrubs.repaired += r.scrub_repaired.load(Ordering::Relaxed);
            scrubs.unexplained += r.scrub_unexplained.load(Ordering::Relaxed);
        }
        if scrubs.unexplained > 0 {
            self.errors.push(format!(
                "scrubs found {} blocks differing between copies that each match their \
                 checksums, where no missed write or restart doubt explains it (repaired \
                 out of sight: the copies had diverged)",
                scrubs.unexplained
            ));
        }
        // End every process before the network goes.
        for c in std::mem::take(&mut self.clients) {
            end_process(c.ip, c);
        }
        self.workload = None;
        for o in &mut self.osds {
            end_process(o.ip, o.live.take());
        }
        SimReport {
            seed: self.config.seed,
            trace_hash,
            deliveries,
            virtual_time,
            workload,
            faults: self.faults,
            scrubs,
            rot: self.rot_figures,
            newer_copies_taken,
            swarm: format!(
                "{} OSDs × {} shards over {} hosts; {}; {}",
                self.config.osds,
                self.config.shards,
                self.config.hosts,
                self.config.timings,
                self.swarm
            ),
            frames,
            lease_refusals: self
                .leases
                .iter()
                .map(|l| l.lease_refusals.load(Ordering::Relaxed))
                .sum(),
            errors: std::mem::take(&mut self.errors),
            events: self.events.drain(..).collect(),
            replay: self.config.replay_command(),
            setup: self.config.describe(),
        }
    }

    /// Steps every process until `done` holds (true) or virtual time reaches
    /// `deadline` (false). With `faults`, injects them on schedule.
    fn drive(&mut self, deadline: Instant, faults: bool, done: impl Fn(&Sim) -> bool) -> bool {
        loop {
            let mut ran = 0;
            for o in &mut self.osds {
                if let Some(live) = &mut o.live {
                    net::set_current_node(Some(o.ip));
                    clock::set_node_clock(Some(o.clock));
                    for r in &mut live.reactors {
                        ran += step(r);
                    }
                }
            }
            clock::set_node_clock(None);
            for c in self.clients.iter_mut().filter(|c| !c.down) {
                net::set_current_node(Some(c.ip));
                if let Err(e) = flame_client::connection::thread_connections_only_of(&c.cluster) {
                    self.errors.push(format!("client {}: {e}", c.ip));
                }
                ran += step(&mut c.reactor);
            }
            net::set_current_node(None);
            for i in 0..self.osds.len() {
                if self.osds[i].fs.take_fail_stop() {
                    self.fail_stopped(i);
                    ran += 1;
                }
            }
            ran += net::deliver_due();
            let now = clock::now();
            self.persist_manager();
            if now >= self.next_tick {
                self.tick();
                self.next_tick = now + TICK;
                ran += 1;
            }
            if faults && !self.faults_over && clock::elapsed(self.started) >= FAULT_PHASE_MAX {
                self.faults_over = true;
                self.end_all_faults("the fault phase is over");
                ran += 1;
            }
            if faults && !self.faults_over && now >= self.next_fault {
                self.fault();
                ran += 1;
            }
            if !self.errors.is_empty() {
                return false;
            }
            if ran > 0 {
                continue;
            }
            if done(self) {
                return true;
            }
            if now >= deadline {
                return false;
            }
            let mut next = self.next_tick.min(deadline);
            if faults && !self.faults_over {
                next = next.min(self.next_fault);
            }
            for o in &self.osds {
                for t in o
                    .live
                    .iter()
                    .flat_map(|l| &l.reactors)
                    .filter_map(Reactor::next_timer)
                {
                    // The timer is on the OSD's clock: due where that reads it.
                    next = next.min(o.clock.sim_instant(t));
                }
            }
            for t in self.clients.iter().filter_map(|c| c.reactor.next_timer()) {
                next = next.min(t);
            }
            if let Some(t) = net::next_delivery() {
                next = next.min(t);
            }
            if next <= now {
                // Nothing ran and nothing is due later: virtual time would stand
                // still forever (a livelock of the simulator, not of the cluster).
                self.errors.push(format!(
                    "simulator stalled at {:?}: nothing ran and the next event is not later",
                    clock::elapsed(self.started)
                ));
                return false;
            }
            clock::advance_to(next);
        }
    }

    /// Whether the volume is at its full size again (or never shrinks).
    fn resize_done(&self) -> bool {
        self.resize
            .as_ref()
            .is_none_or(|r| matches!(r.step, ResizeStep::Done))
    }

    /// The next step of the seed's resize, when due: an administrator shrinks
    /// the volume through the manager, client 0 runs the client library's trim
    /// of the cut-off range (retried until it succeeds), reports it done, and
    /// the volume is grown back. Only while client 0 reaches the manager.
    fn resize_step(&mut self, now: Instant) {
        let Some(mut r) = self.resize.take() else {
            return;
        };
        if now >= r.at
            && self
                .clients
                .first()
                .is_some_and(|c| Self::reaches_mgr(c.ip))
        {
            let v = r.volume;
            r.step = match std::mem::replace(&mut r.step, ResizeStep::Done) {
                ResizeStep::Due => self.shrink(v, r.shrink_to, now),
                ResizeStep::Trimming {
                    range,
                    first,
                    counters,
                    result,
                } => {
                    let outcome = result.borrow_mut().take();
                    match outcome {
                        None => ResizeStep::Trimming {
                            range,
                            first,
                            counters,
                            result,
                        },
                        Some(Err(e)) => {
                            self.event(format!("the trim failed ({e}); again"));
                            self.trim(v, range, first, counters)
                        }
                        Some(Ok(())) => match self.trim_reported(v, range, first, &counters) {
                            ResizeStep::Shrunk if r.shrunk_for.is_zero() => self.grow_back(v),
                            step => {
                                r.at = now + r.shrunk_for;
                                step
                            }
                        },
                    }
                }
                ResizeStep::Shrunk => self.grow_back(v),
                ResizeStep::Done => ResizeStep::Done,
            };
        }
        self.resize = Some(r);
    }

    fn shrink(&mut self, v: usize, size: u64, now: Instant) -> ResizeStep {
        let name = workload::volume_name(v);
        let req = VolumeResize {
            size,
            allow_shrink: true,
        };
        if let Err(e) = self.mgr.resize_volume(&name, &req) {
            self.errors.push(format!("shrinking volume {name}: {e}"));
            return ResizeStep::Done;
        }
        let Ok(VolumeTrim {
            pending: Some(range),
            ..
        }) = self.mgr.volume_trim(&name)
        else {
            self.errors
                .push("a shrink left no pending trim".to_string());
            return ResizeStep::Done;
        };
        let (first, counters) = match &self.workload {
            Some(w) => w.shrinking(v, size / crate::oracle::BLOCK as u64),
            None => (0, Vec::new()),
        };
        let _ = now;
        self.event(format!(
            "volume {name} shrinks to {size} bytes (trim {}..{})",
            range.from, range.to
        ));
        self.trim(v, range, first, counters)
    }

    /// Starts client 0's trim of `range` of volume `v`.
    fn trim(&mut self, v: usize, range: TrimRange, first: u64, counters: Vec<u64>) -> ResizeStep {
        let result: Rc<RefCell<Option<Result<(), String>>>> = Rc::new(RefCell::new(None));
        let out = result.clone();
        let volume = self
            .mgr
            .map()
            .volumes
            .get(&workload::volume_name(v))
            .map(|v| v.id);
        if let (Some(c), Some(volume)) = (self.clients.first(), volume) {
            let cluster = c.cluster.clone();
            c.reactor.enter(|| {
                reactor::spawn(async move {
                    let r = flame_client::resize::trim_range(&cluster, volume, range)
                        .await
                        .map_err(|e| e.to_string());
                    *out.borrow_mut() = Some(r);
                })
                .detach()
            });
        }
        ResizeStep::Trimming {
            range,
            first,
            counters,
            result,
        }
    }

    /// Reports the trim of volume `v` done to the manager and the oracle.
    fn trim_reported(
        &mut self,
        v: usize,
        range: TrimRange,
        first: u64,
        counters: &[u64],
    ) -> ResizeStep {
        let name = workload::volume_name(v);
        let Some(volume) = self.mgr.map().volumes.get(&name).map(|v| v.id) else {
            return ResizeStep::Done;
        };
        if let Err(e) = self.mgr.trim_done(&name, &TrimDone { volume, range }) {
            self.errors
                .push(format!("reporting the trim of {name}: {e}"));
            return ResizeStep::Done;
        }
        if let Some(w) = &self.workload {
            w.trimmed(v, first, counters);
        }
        self.event(format!("the trim of {name} is done"));
        ResizeStep::Shrunk
    }

    fn grow_back(&mut self, v: usize) -> ResizeStep {
        if let Some(w) = &self.workload {
            w.grown(v);
        }
        let name = workload::volume_name(v);
        let size = self.config.shape.volumes.get(v).copied().unwrap_or(0);
        let req = VolumeResize {
            size,
            allow_shrink: false,
        };
        if let Err(e) = self.mgr.resize_volume(&name, &req) {
            self.errors.push(format!("growing volume {name} back: {e}"));
        }
        self.event(format!("volume {name} grows back to {size} bytes"));
        ResizeStep::Done
    }

    /// Writes the manager's state to its disk if its epoch moved (the daemon
    /// persists every change before it answers or publishes).
    fn persist_manager(&mut self) {
        let epoch = self.mgr.epoch();
        if epoch == self.mgr_disk_epoch && !self.mgr_disk.is_empty() {
            return;
        }
        match flame_mgr::store::encode(&self.mgr.persisted) {
            Ok(bytes) => {
                self.mgr_disk = bytes;
                self.mgr_disk_epoch = epoch;
            }
            Err(e) => self
                .errors
                .push(format!("the manager cannot encode its state: {e}")),
        }
    }

    /// The manager process starts again from its disk: what it persisted,
    /// through the real decoder; its runtime state (heartbeat times, failure
    /// reports) is gone, and every OSD counts as just heard from.
    fn restart_manager(&mut self, now: Instant) {
        match flame_mgr::store::decode(&self.mgr_disk) {
            Ok(persisted) => {
                self.mgr = manager(persisted, now, self.config.timings);
                self.event(format!(
                    "the manager restarts from its disk (epoch {})",
                    self.mgr.epoch()
                ));
            }
            Err(e) => self.errors.push(format!(
                "the manager cannot load its state from its disk: {e}"
            )),
        }
    }

    /// Whether the manager is stopped (an impairment in force).
    fn manager_stopped(&self) -> bool {
        self.impaired.iter().any(|imp| imp.manager)
    }

    fn reaches_mgr(ip: IpAddr) -> bool {
        net::fault(ip, MGR_IP).is_none() && net::fault(MGR_IP, ip).is_none()
    }

    /// The modelled control plane: the manager's failure check, every OSD's
    /// heartbeat, reports and map fetch, the client's map.
    fn tick(&mut self) {
        let now = clock::now();
        // A stopped manager decides nothing: it marks no OSD down for the
        // heartbeats it does not hear (it restarts counting every OSD as just
        // heard from).
        if !self.manager_stopped() {
            let (down, out) = self.mgr.check_failures(
                now,
                Duration::from_millis(self.config.timings.heartbeat_grace_ms),
                Duration::ZERO,
            );
            for id in down {
                self.event(format!("manager marks {id} down"));
            }
            for id in out {
                self.event(format!("manager marks {id} out"));
            }
        }
        for i in 0..self.osds.len() {
            if self.osds[i].slow_disk_until.is_some_and(|t| now >= t) {
                self.fast_disk_again(i);
            }
            // A restarted daemon boots with the manager before it serves: it
            // retries until it reaches the manager.
            if self.osds[i].live.is_none()
                && self.osds[i].restart_at.is_some_and(|t| now >= t)
                && Self::reaches_mgr(self.osds[i].ip)
            {
                self.event(format!("osd.{i} restarts"));
                self.start_osd(i);
            }
            self.control(i, now);
        }
        self.resize_step(now);
        // The resize's stale client gets no map from the shrink to the grow.
        let stale = self.resize.as_ref().and_then(|r| {
            (r.stale_client && matches!(r.step, ResizeStep::Trimming { .. } | ResizeStep::Shrunk))
                .then(|| self.clients.len() - 1)
        });
        for (k, c) in self.clients.iter().enumerate() {
            if Some(k) != stale && Self::reaches_mgr(c.ip) {
                c.cluster.publish_map(self.mgr.map().clone());
                if let Some(ticket) = c.cluster.pending_refresh() {
                    c.cluster.refresh_served(ticket);
                }
            }
        }
        let epoch = self.mgr.epoch();
        if epoch != self.last_epoch {
            self.last_epoch = epoch;
            let m = self.mgr.map();
            let up: Vec<String> = m
                .osds
                .values()
                .map(|o| {
                    format!(
                        "{}{}{}",
                        o.id,
                        if o.up { "" } else { "↓" },
                        if o.r#in { "" } else { "(out)" }
                    )
                })
                .collect();
            self.event(format!("map {epoch}: {}", up.join(" ")));
        }
    }

    /// One OSD's control thread, as far as the manager sees it.
    fn control(&mut self, i: usize, now: Instant) {
        let timings = self.config.timings;
        let ip = self.osds[i].ip;
        if !Self::reaches_mgr(ip) {
            return;
        }
        let o = &mut self.osds[i];
        let (Some(live), Some(id)) = (&mut o.live, o.id) else {
            return;
        };
        let mgr_map = self.mgr.map();
        if mgr_map.epoch > live.map.load().epoch {
            live.map.store(Arc::new(mgr_map.clone()));
        }
        let wanted = live.wanted_epoch.load(Ordering::Relaxed);
        if wanted > 0 && wanted <= live.map.load().epoch.0 {
            live.wanted_epoch.store(0, Ordering::Relaxed);
        }
        let reports = live.recovery.take_reports();
        let failed = live.liveness.take_failed_peers();
        let hb_due = now >= live.next_heartbeat;
        let epoch = live.map.load().epoch;
        if hb_due {
            live.next_heartbeat = now + Duration::from_millis(timings.heartbeat_interval_ms);
        }
        let liveness = live.liveness.clone();
        let node_clock = o.clock;
        let uuid = o.uuid.clone();
        let full = o.fs.is_full();
        let mut by_epoch: std::collections::BTreeMap<Epoch, Vec<_>> = Default::default();
        for (e, pg, member) in reports {
            by_epoch.entry(e).or_default().push((pg, member));
        }
        for (e, entries) in by_epoch {
            for chunk in entries.chunks(PG_RECOVERED_ENTRIES_MAX) {
                let r = PgRecoveredReport {
                    reporter: id,
                    uuid: uuid.clone(),
                    epoch: e,
                    recovered: chunk.to_vec(),
                };
                let _ = self.mgr.pg_recovered(&r);
            }
        }
        for f in failed {
            let r = OsdFailureReport {
                reporter: id,
                uuid: uuid.clone(),
                failed: f,
                epoch,
            };
            let _ = self.mgr.failure_report(&r, now);
        }
        if hb_due {
            // On the OSD's clock, as its lease is.
            let sent_ms = clock::with_node_clock(Some(node_clock), || liveness.now_ms());
            let hb = OsdHeartbeat {
                id,
                uuid,
                epoch,
                // A full file system says so: the manager marks the OSD full
                // and primaries refuse writes to its groups.
                used_bytes: if full { 1 << 40 } else { 0 },
                capacity_bytes: 1 << 40,
                object_bytes: 0,
                recovery: None,
            };
            if self.mgr.heartbeat(&hb, now).is_ok() {
                liveness.renew(sent_ms, timings.lease_ms);
            }
        }
    }

    fn start_osd(&mut self, i: usize) {
        let now = clock::now();
        // Start-up recovery runs to its end before anything else moves
        // (`run_to_end`): on a slow disk it would hold the whole simulated
        // cluster still for minutes of virtual time (seed 114 with slow disks:
        // every OSD marked down at once). A restarted disk is fast.
        if self.osds[i].slow_disk_until.is_some()
            || self.impaired.iter().any(|m| m.slow_disk_on == Some(i))
        {
            self.fast_disk_again(i);
        }
        let fsid = self.mgr.map().fsid.clone();
        let o = &mut self.osds[i];
        o.incarnation += 1;
        o.restart_at = None;
        // A process starts with nothing of the one before it (`end_process`).
        let inherited = flame_common::node::values_held(Some(o.ip));
        if inherited > 0 {
            self.errors.push(format!(
                "osd.{i} starts with {inherited} per-process values of its previous process"
            ));
        }
        let mut reactor = match Reactor::new_simulated() {
            Ok(r) => r,
            Err(e) => {
                self.errors.push(format!("simulated reactor: {e}"));
                return;
            }
        };
        net::set_current_node(Some(o.ip));
        clock::set_node_clock(Some(o.clock));
        // The cause of a stop for a disk error is gone (a controller reset, a
        // replaced cable): the restarted OSD's writes work.
        o.fs.set_write_errors(0.0, 0);
        o.fs.take_fail_stop();
        // The daemon's start: syncfs, recover the store from its journal, then
        // boot.
        o.fs.syncfs();
        let fs = Fs::Sim(o.fs.clone());
        let root = o.root.clone();
        let fs2 = fs.clone();
        let shard_count = usize::from(o.config.shards);
        let suspects = match run_to_end(&mut reactor, async move {
            flame_osd::store::recover(&fs2, &root, shard_count).await
        }) {
            Ok(s) => Arc::new(s),
            Err(e) => {
                self.errors
                    .push(format!("osd.{i}: store recovery failed: {e}"));
                return;
            }
        };
        let shards = o.config.shards;
        let boot = OsdBoot {
            uuid: o.uuid.clone(),
            id: o.id,
            addr: SocketAddr::new(o.ip, OSD_PORT),
            shards,
            host: format!("host-{}", i % self.config.hosts.max(1)),
            weight: 1.0,
            metrics_addr: None,
            fsid: o.id.map(|_| fsid),
            incarnation: o.incarnation,
        };
        let id = match self.mgr.boot(&boot, now) {
            Ok(id) => id,
            Err(e) => {
                self.errors.push(format!("osd.{i}: boot refused: {e}"));
                return;
            }
        };
        o.id = Some(id);
        let map = Arc::new(ArcSwap::from_pointee(self.mgr.map().clone()));
        let wanted_epoch = Arc::new(AtomicU64::new(0));
        let liveness = Arc::new(Liveness::new(shards));
        liveness.renew(liveness.now_ms(), self.config.timings.lease_ms);
        let recovery = Arc::new(RecoveryShared::default());
        recovery
            .scrubs_paused
            .store(self.scrubs_paused, Ordering::Relaxed);
        self.recoveries.push(recovery.clone());
        self.leases.push(liveness.clone());
        let cfg = o.config.clone();
        // Each shard is a thread of the process with its own reactor (and
        // store, listener and groups: `pg % shards`), as in the daemon.
        let mut reactors = vec![reactor];
        for shard in 0..shards {
            if usize::from(shard) == reactors.len() {
                match Reactor::new_simulated() {
                    Ok(r) => reactors.push(r),
                    Err(e) => {
                        self.errors.push(format!("simulated reactor: {e}"));
                        return;
                    }
                }
            }
            let store = ObjectStore::with_fs(
                fs.clone(),
                &o.root,
                shard,
                StoreOptions {
                    direct_io: false,
                    open_max: 64,
                    checksums: true,
                },
            );
            let parts = ShardParts {
                id: shard,
                osd: id,
                map: map.clone(),
                wanted_epoch: wanted_epoch.clone(),
                config: cfg.clone(),
                recovery: recovery.clone(),
                liveness: liveness.clone(),
                restart_doubt: &suspects,
                service: Some(flame_osd::service_key::ServiceKeys::new(
                    self.service.clone(),
                )),
            };
            let reactor = &mut reactors[usize::from(shard)];
            let handle = reactor.handle();
            let mut addr = cfg.listen;
            addr.set_port(cfg.listen.port() + shard);
            let started = reactor.enter(|| -> Result<(), String> {
                let shard = build_shard(parts, store);
                let listener =
                    Listener::bind(TransportKind::Sim, addr).map_err(|e| e.to_string())?;
                reactor::spawn(serve(shard, listener, handle)).detach();
                Ok(())
            });
            if let Err(e) = started {
                self.errors
                    .push(format!("osd.{i}: cannot start shard {shard}: {e}"));
                return;
            }
        }
        o.live = Some(LiveOsd {
            reactors,
            map,
            wanted_epoch,
            liveness,
            recovery,
            doubt: suspects.clone(),
            next_heartbeat: now + Duration::from_millis(self.config.timings.heartbeat_interval_ms),
        });
        clock::set_node_clock(None);
        let what = format!(
            "osd.{i} starts as {id} (incarnation {})",
            self.osds[i].incarnation
        );
        self.event(what);
    }

    fn start_clients(&mut self) -> Result<(), String> {
        let now_unix = 1_700_000_000;
        // The simulated manager creates every volume (an administrator's
        // `flame-admin volume create`).
        for (v, &size) in self.config.shape.volumes.iter().enumerate() {
            self.mgr
                .create_volume(
                    &VolumeCreate {
                        name: workload::volume_name(v),
                        size,
                    },
                    now_unix,
                )
                .map_err(|e| format!("create volume {v}: {e}"))?;
        }
        let workload = Rc::new(workload::Workload::new(
            self.config.seed,
            self.config.writers,
            self.config.ops,
            &self.config.shape,
            self.config.io_timeout_ms > 0,
            self.config.rewrites,
        ));
        if self.config.resizes {
            // Its own stream, so that seeds without one run as before.
            let mut rng = StdRng::seed_from_u64(self.config.seed ^ 0x5e51_2e00);
            if rng.random_bool(0.5) {
                let block = crate::oracle::BLOCK as u64;
                let v = rng.random_range(0..self.config.shape.volumes.len());
                let size = self.config.shape.volumes[v];
                let blocks = size / block;
                let object_blocks = self.config.shape.object_size / block;
                // 1 block to 64 objects (at most a quarter of the volume): often
                // part of an object, sometimes whole ones. The trim discards
                // every object past the cut, one request each.
                let cut = rng.random_range(1..=(blocks / 4).min(64 * object_blocks));
                // The last writer works up to the cut (its window drifts into it).
                workload.start_writer_near(
                    self.config.writers.max(1) - 1,
                    v,
                    (blocks - cut).saturating_sub(rng.random_range(0..=4) * object_blocks),
                );
                let at = clock::now() + Duration::from_millis(rng.random_range(300..6000));
                let (shrunk_for, stale_client) = if self.config.resize_stays_shrunk {
                    (
                        Duration::from_millis(rng.random_range(200..2000)),
                        self.config.clients > 1 && rng.random_bool(0.5),
                    )
                } else {
                    (Duration::ZERO, false)
                };
                self.resize = Some(Resize {
                    volume: v,
                    at,
                    shrink_to: size - cut * block,
                    shrunk_for,
                    stale_client,
                    step: ResizeStep::Due,
                });
            }
        }
        let clients = self.config.clients.max(1);
        self.workload = Some(workload);
        for k in 0..clients {
            let c = self.start_client(k, 1)?;
            self.clients.push(c);
        }
        net::set_current_node(None);
        Ok(())
    }

    /// Starts incarnation `incarnation` of client process `k`: a new
    /// `flame-client` instance (its own op session, connections and map) on
    /// a new reactor, running its part of the workload.
    fn start_client(&mut self, k: usize, incarnation: u64) -> Result<SimClient, String> {
        let clients = self.config.clients.max(1);
        let Some(workload) = self.workload.clone() else {
            return Err("no workload".into());
        };
        let config = ClientConfig {
            mgr: "127.0.9.1:1".into(),
            transport: TransportKind::Sim,
            io_timeout_ms: self.config.io_timeout_ms,
            connect_timeout_ms: 1000,
            // The same name in every incarnation, as flame-nbd's endpoint is:
            // a restarted client fences what its predecessor left on the wire
            // (seed 200188).
            instance: Some(format!("sim-client-{k}")),
            ..ClientConfig::default()
        };
        // Each client its own op session (as two processes would have), and
        // each incarnation of it a new one.
        let session = (self.config.seed | 1)
            .wrapping_add(2 * k as u64)
            .wrapping_add(1_000_000 * (incarnation - 1));
        let cluster = Cluster::simulated(config, self.mgr.map().clone(), session)
            .map_err(|e| e.to_string())?;
        let entity = EntityName::parse(&format!("client.sim{k}")).map_err(|e| e.to_string())?;
        cluster.set_ticket(Some(self.service.issue(
            &entity,
            Role::Client,
            clock::unix_ms(),
            TICKET_LIFETIME_MS,
        )));
        let mut reactor = Reactor::new_simulated().map_err(|e| e.to_string())?;
        let ip = client_ip(k);
        net::set_current_node(Some(ip));
        let c = cluster.clone();
        reactor.enter(|| reactor::spawn(workload::run(c, workload, k, clients)).detach());
        let _ = step(&mut reactor);
        net::set_current_node(None);
        Ok(SimClient {
            ip,
            reactor,
            cluster,
            incarnation,
            down: false,
        })
    }

    /// Client process `k` crashes: its reactor and every task on it go (the
    /// writes it had in flight are given up on in the oracle: they may still
    /// land), its connections reset, its per-process state is dropped.
    fn crash_client(&mut self, k: usize) {
        let Ok(empty) = Reactor::new_simulated() else {
            self.errors
                .push("simulated reactor for a crashed client".into());
            return;
        };
        let ip = self.clients[k].ip;
        net::crash(ip);
        let old = std::mem::replace(&mut self.clients[k].reactor, empty);
        end_process(ip, old);
        self.clients[k].down = true;
        self.event(format!(
            "client {k} crashes (incarnation {})",
            self.clients[k].incarnation
        ));
    }

    /// Client process `k` starts again after a crash: a new incarnation, a new
    /// session, re-issuing the writes its writers had not finished.
    fn restart_client(&mut self, k: usize) {
        if !self.clients[k].down {
            return;
        }
        let incarnation = self.clients[k].incarnation + 1;
        match self.start_client(k, incarnation) {
            Ok(c) => {
                self.clients[k] = c;
                self.event(format!("client {k} restarts (incarnation {incarnation})"));
            }
            Err(e) => self.errors.push(format!("client {k} cannot restart: {e}")),
        }
    }

    /// Whether OSD `i`'s restart doubt is settled where it matters: it is up,
    /// and in every group it is a complete copy of, either its primary (another
    /// OSD) compared its doubt for this incarnation, or it is the primary and
    /// doubts nothing of the group any more. A group where it is recovering is
    /// settled by that recovery (its copy is not complete till then).
    fn doubt_settled(&self, i: usize) -> bool {
        let (Some(live), Some(id)) = (&self.osds[i].live, self.osds[i].id) else {
            return false;
        };
        let m = self.mgr.map();
        let Some(up_from) = m.osds.get(&id).filter(|o| o.up).map(|o| o.up_from) else {
            return false;
        };
        let doubted: BTreeSet<flame_common::ids::PgId> = live
            .doubt
            .entries()
            .into_iter()
            .map(|(pg, _, _)| pg)
            .collect();
        let table = flame_common::placement::PgTable::new(m);
        (0..m.pool.pg_count).all(|pg| {
            let pg = flame_common::ids::PgId(pg);
            let members = table.pg(pg);
            if !members.acting.contains(&id) {
                return true;
            }
            match members.primary() {
                Some(p) if p == id => !doubted.contains(&pg),
                Some(p) => self
                    .osds
                    .iter()
                    .find(|o| o.id == Some(p))
                    .and_then(|o| o.live.as_ref())
                    .is_some_and(|l| l.recovery.suspects_compared(pg, id) == Some(up_from)),
                None => false,
            }
        })
    }

    /// Whether every placement group has every member complete and up.
    fn all_clean(&self) -> bool {
        let m = self.mgr.map();
        if m.osds.values().any(|o| !o.up || !o.r#in) {
            return false;
        }
        let table = flame_common::placement::PgTable::new(m);
        (0..m.pool.pg_count).all(|pg| {
            let members = table.pg(flame_common::ids::PgId(pg));
            members.recovering.is_empty() && members.acting == members.placed
        })
    }

    /// Sometimes (drawn from `rot_rng`, with [`SimConfig::bit_rot`]) one bit of
    /// a checksummed data block of one copy of one object flips on disk.
    fn bit_rot(&mut self) {
        if !self.config.bit_rot || !self.rot_rng.random_bool(self.swarm.side.bit_rot) {
            return;
        }
        let j = self.rot_rng.random_range(0..self.osds.len());
        let pgs = layout::pgs_dir(&self.osds[j].root);
        let files: Vec<PathBuf> = self.osds[j]
            .fs
            .paths()
            .into_iter()
            .filter(|p| {
                p.strip_prefix(&pgs).is_ok_and(|rel| {
                    rel.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| layout::parse_object_name(n).is_some())
                })
            })
            .collect();
        if files.is_empty() {
            return;
        }
        let path = files[self.rot_rng.random_range(0..files.len())].clone();
        let Some(d) = self.osds[j].fs.contents(&path) else {
            return;
        };
        // Only blocks the store holds a checksum of: rot elsewhere (a block
        // never written) is beyond what any store without a checksum of it
        // can see.
        let crc_count = crc_count(&d) as usize;
        let data_at = flame_osd::store::meta::DATA_OFFSET as usize;
        let blocks = crc_count.min(d.len().saturating_sub(data_at) / 4096);
        if blocks == 0 {
            return;
        }
        let block = self.rot_rng.random_range(0..blocks);
        let start = data_at + block * 4096;
        let at = (start + self.rot_rng.random_range(0..4096)) as u64;
        let bit: u8 = self.rot_rng.random_range(0..8);
        // One rot per block at a time, so each can be told apart at the end.
        if self
            .rots
            .iter()
            .any(|r| r.osd == j && r.path == path && r.start == start)
        {
            return;
        }
        if !self.osds[j].fs.flip_bit(&path, at, bit) {
            return;
        }
        let rotted = self.osds[j]
            .fs
            .contents(&path)
            .and_then(|d| d.get(start..start + 4096).map(<[u8]>::to_vec))
            .unwrap_or_default();
        self.rot_figures.injected += 1;
        self.rots.push(Rot {
            osd: j,
            path: path.clone(),
            start,
            at,
            bit,
            rotted,
        });
        self.event(format!(
            "bit rot on osd.{j}: {} block {block}",
            path.display()
        ));
    }

    /// Undoes, in `data` (the contents of `path` on OSD `osd`), every rot the
    /// simulator injected there that is still in place.
    fn unrot(&self, osd: usize, path: &std::path::Path, data: &mut [u8]) {
        for r in self.rots.iter().filter(|r| r.osd == osd && r.path == path) {
            if data.get(r.start..r.start + 4096) == Some(&r.rotted[..])
                && let Some(b) = data.get_mut(r.at as usize)
            {
                *b ^= 1 << r.bit;
            }
        }
    }

    /// A FLUSH of every volume through client 0 (put every copy's checksums
    /// on disk); false if it failed or did not finish within 60 s.
    fn flush_all_volumes(&mut self) -> bool {
        let Some(c) = self.clients.first() else {
            return false;
        };
        let names: Vec<String> = self.mgr.map().volumes.keys().cloned().collect();
        let done: Rc<RefCell<Option<Result<(), String>>>> = Rc::new(RefCell::new(None));
        let out = done.clone();
        let cluster = c.cluster.clone();
        c.reactor.enter(|| {
            reactor::spawn(async move {
                let mut r = Ok(());
                for name in names {
                    let flushed = match cluster.open_volume(&name).await {
                        Ok(v) => v.flush().await.map_err(|e| format!("{name}: {e}")),
                        Err(e) => Err(format!("{name}: {e}")),
                    };
                    if flushed.is_err() {
                        r = flushed;
                        break;
                    }
                }
                *out.borrow_mut() = Some(r);
            })
            .detach()
        });
        let by = clock::now() + Duration::from_secs(60);
        self.drive(by, false, |_| done.borrow().is_some());
        let r = done.borrow_mut().take();
        match r {
            Some(Ok(())) => true,
            Some(Err(e)) => {
                self.errors
                    .push(format!("the FLUSH before the comparison failed: {e}"));
                false
            }
            None => false,
        }
    }

    /// A rotted block that nothing read or scrubbed since it rotted still
    /// holds the rot: the medium's fault, not a divergence of the copies.
    /// Undone before the copies are compared (any other difference counts);
    /// counted in the report.
    fn undo_unrepaired_rot(&mut self) {
        for r in std::mem::take(&mut self.rots) {
            let fs = &self.osds[r.osd].fs;
            let now = fs
                .contents(&r.path)
                .and_then(|d| d.get(r.start..r.start + 4096).map(<[u8]>::to_vec));
            if now.as_deref() == Some(&r.rotted[..]) {
                self.rot_figures.unrepaired += 1;
                fs.flip_bit(&r.path, r.at, r.bit);
            }
        }
    }

    /// After the cluster is clean and flushed: every object file is the same on
    /// every member of its group — header, checksums and data. Bytes past a
    /// copy's end read as zeroes; a member without the file holds zeroes. Copies
    /// on OSDs that are no longer members (strays, deleted later) are not looked at.
    fn compare_copies(&self, mask_rot: bool) -> Vec<String> {
        let data_at = flame_osd::store::meta::DATA_OFFSET as usize;
        let describe = |at: usize| {
            if at < data_at {
                format!("header or checksums, byte {at}")
            } else {
                format!("data byte {}", at - data_at)
            }
        };
        let map = self.mgr.map();
        let table = flame_common::placement::PgTable::new(map);
        let index_of = |id: OsdId| self.osds.iter().position(|o| o.id == Some(id));
        // Every object file anywhere, by group.
        let mut objects = std::collections::BTreeSet::new();
        for o in &self.osds {
            let pgs = layout::pgs_dir(&o.root);
            for p in o.fs.paths() {
                let Ok(rel) = p.strip_prefix(&pgs) else {
                    continue;
                };
                let mut parts = rel.iter().filter_map(|c| c.to_str());
                let (Some(dir), Some(name)) = (parts.next(), parts.next()) else {
                    continue;
                };
                if let (Some(pg), Some(_)) =
                    (layout::parse_pg_name(dir), layout::parse_object_name(name))
                {
                    objects.insert((pg, rel.to_path_buf()));
                }
            }
        }
        let mut complaints = Vec::new();
        for (pg, rel) in &objects {
            let members: Vec<usize> = table
                .pg(*pg)
                .acting
                .iter()
                .filter_map(|&m| index_of(m))
                .collect();
            let found: Vec<(usize, Option<Vec<u8>>)> = members
                .iter()
                .map(|&i| {
                    let o = &self.osds[i];
                    let path = layout::pgs_dir(&o.root).join(rel);
                    let mut d = o.fs.contents(&path);
                    if mask_rot && let Some(d) = &mut d {
                        self.unrot(i, &path, d);
                    }
                    (i, d)
                })
                .collect();
            // A copy without the file reads as zeroes, as does one whose file
            // holds no checksummed block and only zeroes (a write that created
            // it on some copies was refused on another and caught up from
            // zeroes there, which creates no file): the same object. Any other
            // difference with a missing file is one.
            let reads_as_zeroes = |d: &Vec<u8>| {
                d.get(36..40) == Some(&[0u8; 4][..]) && d.iter().skip(data_at).all(|&b| b == 0)
            };
            if found.iter().any(|(_, d)| d.is_none())
                && found
                    .iter()
                    .all(|(_, d)| d.as_ref().is_none_or(reads_as_zeroes))
            {
                continue;
            }
            let copies: Vec<(usize, Vec<u8>)> = found
                .into_iter()
                .map(|(i, d)| (i, d.unwrap_or_default()))
                .collect();
            let len = copies.iter().map(|(_, c)| c.len()).max().unwrap_or(0);
            let padded: Vec<(usize, Vec<u8>)> = copies
                .into_iter()
                .map(|(i, mut d)| {
                    d.resize(len, 0);
                    (i, d)
                })
                .collect();
            let Some((first, reference)) = padded.first() else {
                continue;
            };
            for (i, c) in padded.iter().skip(1) {
                if c == reference {
                    continue;
                }
                let at = c
                    .iter()
                    .zip(reference)
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                let block = at.saturating_sub(data_at) / 4096;
                // The oracle's write counter of that block in each copy.
                let counter = |d: &[u8]| {
                    let b = data_at + block * 4096;
                    d.get(b + 16..b + 24)
                        .and_then(|b| b.try_into().ok())
                        .map_or(0, u64::from_le_bytes)
                };
                // Where the data (past the header and checksums) first differs.
                let data_diff = c
                    .iter()
                    .zip(reference)
                    .skip(data_at)
                    .position(|(a, b)| a != b)
                    .map_or("data equal".to_string(), |d| {
                        format!("data differs from byte {d}")
                    });
                // A differing checksum slot: does each copy's stored checksum
                // match its own data (which one would fail a read)?
                let header = flame_osd::store::meta::HEADER_LEN;
                let sums = if (header..data_at).contains(&at) {
                    let slot = (at - header) / 4;
                    let verifies = |d: &[u8]| {
                        let stored = d
                            .get(header + slot * 4..header + slot * 4 + 4)
                            .and_then(|b| b.try_into().ok())
                            .map_or(0, u32::from_le_bytes);
                        let b = data_at + slot * 4096;
                        let block = d.get(b..b + 4096).unwrap_or(&[0; 4096]);
                        if stored == flame_osd::store::meta::block_sum(block) {
                            "matches its data"
                        } else {
                            "does not match its data"
                        }
                    };
                    format!(
                        "; checksum of block {slot}: osd.{first}'s {}, osd.{i}'s {}",
                        verifies(reference),
                        verifies(c)
                    )
                } else {
                    String::new()
                };
                complaints.push(format!(
                    "object {} differs between osd.{first} and osd.{i} from {} \
                     (block {block}: write {} on osd.{first}, {} on osd.{i}; \
                     checksummed blocks {} and {}; {data_diff}{sums})",
                    rel.display(),
                    describe(at),
                    counter(reference),
                    counter(c),
                    crc_count(reference),
                    crc_count(c),
                ));
            }
        }
        complaints
    }

    /// Every impairment ends, every path heals, every stopped process starts
    /// again (`why` goes into the event log).
    fn end_all_faults(&mut self, why: &str) {
        self.event(format!("{why}: no more faults"));
        self.heal_all();
        for i in 0..self.osds.len() {
            if self.osds[i].live.is_none() {
                self.start_osd(i);
            }
        }
    }

    fn heal_all(&mut self) {
        net::heal_all();
        self.overlap_at = None;
        self.power_loss_again = None;
        for imp in std::mem::take(&mut self.impaired) {
            if let Some(k) = imp.client_crashed {
                self.restart_client(k);
            }
            if let Some(j) = imp.read_errors_on {
                self.osds[j].fs.set_read_errors(0.0, 0);
            }
            self.end_disk_faults(&imp);
            if imp.manager {
                self.restart_manager(clock::now());
            }
            if let Some(id) = imp.out {
                let _ = self.mgr.set_in(id, true);
                self.event(format!("{id} marked in"));
            }
        }
        for i in 0..self.osds.len() {
            if self.osds[i].slow_disk_until.is_some() {
                self.fast_disk_again(i);
            }
        }
        self.event("faults stop; every path healed".into());
    }

    /// Injects the next fault (or ends the current impairment).
    fn fault(&mut self) {
        let now = clock::now();
        if let Some((i, at)) = self.power_loss_again
            && now >= at
        {
            self.power_loss_again = None;
            if self.osds[i].live.is_some() {
                self.faults += 1;
                self.event(format!("osd.{i} loses power again while it recovers"));
                self.crash(i, true);
                let hold = Duration::from_millis(self.rng.random_range(300..3000));
                self.impaired
                    .push(Impairment::plain(i, now + hold, Vec::new()));
            }
            self.next_fault = self.next_impairment_change();
            return;
        }
        if let Some(k) = self.impaired.iter().position(|imp| now >= imp.until) {
            let imp = self.impaired.remove(k);
            self.end_impairment(imp, now);
            return;
        }
        if let Some(at) = self.overlap_at
            && now >= at
        {
            self.overlap_at = None;
            self.overlapping_fault(now);
        }
        if !self.impaired.is_empty() || self.power_loss_again.is_some() {
            self.next_fault = self.next_impairment_change();
            return;
        }
        // An OSD its failing disk stopped (`fail_stopped`) is down, with its
        // unstable writes partly lost, until it restarts: a new fault on another
        // OSD meanwhile would leave a group no complete copy up, one of them
        // having lost acknowledged writes no FLUSH covered — beyond the model
        // (mostly one OSD at a time). Seed 277 crashed the only other complete
        // copy then, and the group's acknowledged write was gone.
        if self
            .osds
            .iter()
            .any(|o| o.live.is_none() && o.restart_at.is_some())
        {
            self.next_fault = now + Duration::from_millis(500);
            return;
        }
        if self.config.doubt_impairs {
            for i in 0..self.osds.len() {
                if self.osds[i].in_doubt && self.doubt_settled(i) {
                    self.osds[i].in_doubt = false;
                }
            }
            if self.osds.iter().any(|o| o.in_doubt) {
                self.next_fault = now + Duration::from_millis(500);
                return;
            }
        }
        self.new_fault(now);
    }

    /// When the next impairment ends or the overlapping one starts.
    fn next_impairment_change(&self) -> Instant {
        self.impaired
            .iter()
            .map(|imp| imp.until)
            .chain(self.overlap_at)
            .chain(self.power_loss_again.map(|(_, at)| at))
            .min()
            .unwrap_or_else(clock::now)
    }

    /// Undoes `imp` (its cuts, slowness, out, a stopped manager or process).
    fn end_impairment(&mut self, imp: Impairment, now: Instant) {
        if let Some(j) = imp.read_errors_on {
            self.osds[j].fs.set_read_errors(0.0, 0);
            self.event(format!("osd.{j}'s disk reads well again"));
        }
        self.end_disk_faults(&imp);
        if let Some(ip) = imp.weather_on {
            net::set_weather(ip, None);
        }
        if let Some(k) = imp.client_crashed {
            self.restart_client(k);
        }
        for &(a, b, _) in &imp.cut {
            net::set_fault(a, b, None);
        }
        // A link both impairments cut stays cut by the other.
        for other in &self.impaired {
            for &(a, b, f) in &other.cut {
                net::set_fault(a, b, Some(f));
            }
        }
        let was_slow = net::is_slow(self.osds[imp.osd].ip);
        net::set_slow(self.osds[imp.osd].ip, None);
        if was_slow && (imp.reset_clients || self.rng.random_bool(0.3)) {
            // The path is fast again and the clients' connections to the
            // OSD are reset on their side: they resend on new connections,
            // which overtake what is still on the slow old ones.
            for c in &self.clients {
                net::reset_from(c.ip, self.osds[imp.osd].ip);
            }
            self.event(format!(
                "osd.{} fast again; the clients' connections to it reset on their side",
                imp.osd
            ));
        }
        if let Some(id) = imp.out {
            let _ = self.mgr.set_in(id, true);
            self.event(format!("{id} marked in"));
        } else if imp.manager {
            // It lost its runtime state (heartbeat times, failure reports);
            // every OSD counts as just heard from, as at a real start.
            self.restart_manager(now);
        } else if self.osds[imp.osd].live.is_none() {
            if imp.repeat_power_loss {
                let after = Duration::from_millis(self.rng.random_range(50..1500));
                self.power_loss_again = Some((imp.osd, now + after));
            }
            if Self::reaches_mgr(self.osds[imp.osd].ip) {
                self.start_osd(imp.osd);
            } else {
                // It boots once it reaches the manager (`tick`).
                self.osds[imp.osd].restart_at = Some(now);
            }
        } else {
            self.event(format!("osd.{} reconnected", imp.osd));
        }
        if self.impaired.is_empty() && self.power_loss_again.is_none() {
            self.overlap_at = None;
            let (lo, hi) = self.swarm.gap_ms;
            self.next_fault = now + Duration::from_millis(self.rng.random_range(lo..hi));
        } else {
            self.next_fault = self.next_impairment_change();
        }
    }

    /// The addresses of every OSD but `i`.
    /// Sets OSD `i`'s host clock from now on: its wall clock `skew_ms` off the
    /// manager's, its monotonic clock `drift_ppm` fast (slow when negative).
    /// Within ±[`clocks::drift_bound_ppm`] the lease argument holds; beyond it
    /// the documented outcome is a refusal, not a stale read. The clock never
    /// jumps back ([`clock::NodeClock::set`]). Drawn per OSD at the start; for
    /// the fault model to change later.
    fn set_osd_clock(&mut self, i: usize, skew_ms: i64, drift_ppm: i64) {
        if let Some(o) = self.osds.get_mut(i) {
            o.clock.set(skew_ms, drift_ppm);
            self.event(format!(
                "osd.{i} clock: skew {skew_ms} ms, drift {drift_ppm} ppm"
            ));
        }
    }

    fn other_osd_ips(&self, i: usize) -> Vec<IpAddr> {
        self.osds
            .iter()
            .filter(|o| o.index != i)
            .map(|o| o.ip)
            .collect()
    }

    /// Injects a fault while none is in force.
    fn new_fault(&mut self, now: Instant) {
        let i = self.rng.random_range(0..self.osds.len());
        let mut hold = Duration::from_millis(self.rng.random_range(300..6000));
        let ip = self.osds[i].ip;
        self.faults += 1;
        let kind = if self.swarm.kinds.is_empty() {
            FaultKind::legacy(self.rng.random_range(0..16), self.osds.len())
        } else {
            self.swarm.pick(&mut self.rng)
        };
        let mut cut = Vec::new();
        let mut out = None;
        let mut weather_on = None;
        let mut repeat_power_loss = false;
        let mut client_crashed = None;
        match kind {
            FaultKind::Out => {
                // Out (operator or down-out): its groups move to the others and
                // backfill there; it keeps serving its old copies meanwhile.
                if let Some(id) = self.osds[i].id
                    && self.mgr.set_in(id, false).is_ok()
                {
                    out = Some(id);
                    let stale = if self.rng.random_bool(0.5) {
                        self.stale_client_map(&mut cut)
                    } else {
                        String::new()
                    };
                    self.event(format!(
                        "{id} marked out{stale} for {} ms",
                        hold.as_millis()
                    ));
                }
            }
            FaultKind::Slow | FaultKind::SlowThenReset => {
                // Slow: everything to and from it takes longer (an overloaded
                // node or link); nothing is lost. Then (SlowThenReset) the clients'
                // connections to it reset on their side: what they resend on new
                // connections overtakes what is still on the old ones.
                let extra = Duration::from_millis(self.rng.random_range(50..2500));
                net::set_slow(ip, Some(extra));
                if kind == FaultKind::SlowThenReset {
                    hold = hold.min(Duration::from_millis(self.rng.random_range(300..2000)));
                }
                self.event(format!(
                    "osd.{i} slow (+{} ms each way) for {} ms{}",
                    extra.as_millis(),
                    hold.as_millis(),
                    if kind == FaultKind::SlowThenReset {
                        ", then the clients' connections to it reset"
                    } else {
                        ""
                    }
                ));
            }
            FaultKind::ManagerStop => {
                // The manager stops: nobody reaches it until it restarts.
                let mut all: Vec<IpAddr> = self.osds.iter().map(|o| o.ip).collect();
                all.extend(self.clients.iter().map(|c| c.ip));
                for p in all {
                    cut.push((p, MGR_IP, LinkFault::Reject));
                    cut.push((MGR_IP, p, LinkFault::Reject));
                }
                for &(a, b, f) in &cut {
                    net::set_fault(a, b, Some(f));
                }
                self.event(format!("the manager stops for {} ms", hold.as_millis()));
            }
            FaultKind::Crash => {
                self.crash(i, false);
            }
            FaultKind::PowerLoss => {
                self.crash(i, true);
            }
            FaultKind::RepeatedPowerLoss => {
                // Back soon, to lose power again while it recovers.
                hold = hold.min(Duration::from_millis(self.rng.random_range(300..2000)));
                self.crash(i, true);
                repeat_power_loss = true;
            }
            FaultKind::ClientCrash => {
                // Never client 0: it runs the resize's trim and the final
                // read-back.
                if self.clients.len() > 1 {
                    let k = self.rng.random_range(1..self.clients.len());
                    hold = hold.min(Duration::from_millis(self.rng.random_range(0..3000)));
                    self.crash_client(k);
                    client_crashed = Some(k);
                }
            }
            FaultKind::CutFromManager => {
                // Only the manager is cut: peers and clients still reach it.
                let one_way = self.rng.random_bool(0.3);
                let fault = if self.rng.random_bool(0.5) {
                    LinkFault::Reject
                } else {
                    LinkFault::BlackHole
                };
                cut.push((ip, MGR_IP, fault));
                if !one_way {
                    cut.push((MGR_IP, ip, fault));
                }
                for &(a, b, f) in &cut {
                    net::set_fault(a, b, Some(f));
                }
                // Long enough, mostly, for its lease to run out and the manager
                // to mark it down.
                if self.rng.random_bool(0.7) {
                    hold = hold.max(Duration::from_millis(self.rng.random_range(2500..7000)));
                }
                self.event(format!(
                    "osd.{i} cut from the manager only ({fault:?}{}) for {} ms",
                    if one_way { ", its sends only" } else { "" },
                    hold.as_millis()
                ));
            }
            FaultKind::OneWayPairCut => {
                let j = (i + self.rng.random_range(1..self.osds.len())) % self.osds.len();
                let fault = if self.rng.random_bool(0.5) {
                    LinkFault::Reject
                } else {
                    LinkFault::BlackHole
                };
                let peer = self.osds[j].ip;
                cut.push((ip, peer, fault));
                net::set_fault(ip, peer, Some(fault));
                self.event(format!(
                    "osd.{i}'s sends to osd.{j} cut ({fault:?}, one way) for {} ms",
                    hold.as_millis()
                ));
            }
            FaultKind::CorruptFrames | FaultKind::DuplicateFrames | FaultKind::DelayedFrames => {
                let chance = self.rng.random_range(0.005..0.1);
                let mut w = net::Weather {
                    delay_max: WEATHER_DELAY_MAX,
                    ..net::Weather::default()
                };
                match kind {
                    FaultKind::CorruptFrames => w.corrupt = chance,
                    FaultKind::DuplicateFrames => w.duplicate = chance,
                    _ => w.delay = chance * 3.0,
                }
                net::set_weather(ip, Some(w));
                weather_on = Some(ip);
                self.event(format!(
                    "osd.{i}'s paths {:?}: {:.1} % of frames, for {} ms",
                    kind,
                    chance * 100.0,
                    hold.as_millis()
                ));
            }
            FaultKind::PairCutReject | FaultKind::PairCutBlackHole => {
                // Between two OSDs only: both still heartbeat the manager, which
                // learns of the cut from their failure reports.
                let j = (i + self.rng.random_range(1..self.osds.len())) % self.osds.len();
                let fault = if kind == FaultKind::PairCutReject {
                    LinkFault::Reject
                } else {
                    LinkFault::BlackHole
                };
                let peer = self.osds[j].ip;
                cut.push((ip, peer, fault));
                cut.push((peer, ip, fault));
                for &(a, b, f) in &cut {
                    net::set_fault(a, b, Some(f));
                }
                self.event(format!(
                    "osd.{i} and osd.{j} cut from each other ({fault:?}) for {} ms",
                    hold.as_millis()
                ));
            }
            FaultKind::Cut => {
                let fault = if self.rng.random_bool(0.5) {
                    LinkFault::Reject
                } else {
                    LinkFault::BlackHole
                };
                let from_mgr = self.rng.random_bool(0.5);
                let one_way = self.rng.random_bool(0.3);
                // Sometimes the client still reaches it: cut off from the manager
                // and its peers only, it must stop serving when its lease runs out
                // while clients keep sending it requests.
                let keeps_client = from_mgr && self.rng.random_bool(0.5);
                let mut peers = self.other_osd_ips(i);
                if !keeps_client {
                    peers.extend(self.clients.iter().map(|c| c.ip));
                }
                if from_mgr {
                    peers.push(MGR_IP);
                }
                for p in peers {
                    cut.push((ip, p, fault));
                    if !one_way {
                        cut.push((p, ip, fault));
                    }
                }
                for &(a, b, f) in &cut {
                    net::set_fault(a, b, Some(f));
                }
                // And sometimes a client that still reaches it gets no new map
                // either: it keeps sending reads to the deposed primary while
                // the other client writes through the new one.
                let stale = if keeps_client && self.rng.random_bool(0.75) {
                    // Long enough for the manager to mark it down (grace), the
                    // new primaries to wait out its lease, and the other client
                    // to write through them.
                    hold = hold.max(Duration::from_millis(self.rng.random_range(5000..9000)));
                    self.stale_client_map(&mut cut)
                } else {
                    String::new()
                };
                self.event(format!(
                    "osd.{i} cut off ({fault:?}{}{}{}{stale}) for {} ms",
                    if one_way { ", its sends only" } else { "" },
                    if from_mgr { ", manager too" } else { "" },
                    if keeps_client {
                        ", not from the clients"
                    } else {
                        ""
                    },
                    hold.as_millis()
                ));
            }
        }
        let read_errors_on = self.read_errors(i);
        let (write_errors_on, full_on) = self.disk_faults(i);
        let slow_disk_on = self.slow_disk(i);
        self.bit_rot();
        self.impaired.push(Impairment {
            osd: i,
            until: now + hold,
            cut,
            manager: kind == FaultKind::ManagerStop,
            out,
            reset_clients: kind == FaultKind::SlowThenReset,
            read_errors_on,
            write_errors_on,
            full_on,
            slow_disk_on,
            weather_on,
            repeat_power_loss,
            client_crashed,
        });
        // Sometimes a second fault on another OSD overlaps this crash, power
        // loss or cut (never the manager's stop, an out or a slow OSD).
        if self.osds.len() >= 4
            && kind.may_overlap()
            && self.overlap_rng.random_bool(self.swarm.side.overlap)
        {
            let after = hold.mul_f64(self.overlap_rng.random_range(0.1..0.9));
            self.overlap_at = Some(now + after);
        }
        self.next_fault = self.next_impairment_change();
    }

    /// Sometimes (drawn from `disk_rng`) an OSD's disk — the impaired one's or
    /// another's — fails 1–10 % of its data reads while the impairment lasts.
    fn read_errors(&mut self, impaired: usize) -> Option<usize> {
        if !self.disk_rng.random_bool(self.swarm.side.read_errors) {
            return None;
        }
        let j = if self.disk_rng.random_bool(0.5) {
            impaired
        } else {
            self.disk_rng.random_range(0..self.osds.len())
        };
        let p = self.disk_rng.random_range(0.01..0.10);
        let seed = self.disk_rng.random();
        self.osds[j].fs.set_read_errors(p, seed);
        self.event(format!(
            "osd.{j}'s disk fails {:.0} % of its data reads meanwhile",
            p * 100.0
        ));
        Some(j)
    }

    /// Sometimes (drawn from `slow_disk_rng`, with [`SimConfig::slow_disks`])
    /// an OSD's disk — the impaired one's or another's — takes 50 ms-2 s per
    /// data operation while the impairment lasts.
    fn slow_disk(&mut self, impaired: usize) -> Option<usize> {
        if self.slow_disk_chance == 0.0 || !self.slow_disk_rng.random_bool(self.slow_disk_chance) {
            return None;
        }
        let j = if self.slow_disk_rng.random_bool(0.5) {
            impaired
        } else {
            self.slow_disk_rng.random_range(0..self.osds.len())
        };
        let low_ms = self.slow_disk_rng.random_range(50..=500u64);
        let seed = self.slow_disk_rng.random();
        self.osds[j]
            .fs
            .set_latency(low_ms * 1000..=low_ms * 4000, seed);
        self.event(format!(
            "osd.{j}'s disk slow ({low_ms}-{} ms per operation) meanwhile",
            low_ms * 4
        ));
        Some(j)
    }

    /// OSD `i`'s slow disk takes its usual latency again.
    fn fast_disk_again(&mut self, i: usize) {
        self.osds[i].slow_disk_until = None;
        let seed = self.slow_disk_rng.random();
        self.osds[i]
            .fs
            .set_latency(DISK_LATENCY_US_MIN..=DISK_LATENCY_US_MAX, seed);
        self.event(format!("osd.{i}'s disk fast again"));
    }

    /// Sometimes (drawn from `disk_fault_rng`, and only with
    /// [`SimConfig::disk_faults`]) an OSD's disk — the impaired one's or
    /// another's — fails some of its writes and syncs while the impairment
    /// lasts (the OSD stops at the first: [`Sim::fail_stopped`]), or its file
    /// system is full (writes needing new space fail with ENOSPC, and its
    /// heartbeats say so).
    fn disk_faults(&mut self, impaired: usize) -> (Option<usize>, Option<usize>) {
        if !self.config.disk_faults {
            return (None, None);
        }
        let r: f64 = self.disk_fault_rng.random();
        let side = self.swarm.side;
        if r >= side.write_errors + side.full {
            return (None, None);
        }
        let j = if self.disk_fault_rng.random_bool(0.5) {
            impaired
        } else {
            self.disk_fault_rng.random_range(0..self.osds.len())
        };
        if r < side.write_errors {
            let p = self.disk_fault_rng.random_range(0.002..0.05);
            let seed = self.disk_fault_rng.random();
            self.osds[j].fs.set_write_errors(p, seed);
            self.event(format!(
                "osd.{j}'s disk fails {:.1} % of its writes and syncs meanwhile",
                p * 100.0
            ));
            (Some(j), None)
        } else {
            self.osds[j].fs.set_full(true);
            if let Some(w) = &self.workload {
                w.allow_enospc();
            }
            self.event(format!("osd.{j}'s file system is full meanwhile"));
            (None, Some(j))
        }
    }

    /// Ends `imp`'s disk faults.
    fn end_disk_faults(&mut self, imp: &Impairment) {
        if let Some(j) = imp.slow_disk_on {
            let after = Duration::from_millis(self.slow_disk_rng.random_range(0..=3000));
            self.osds[j].slow_disk_until = Some(clock::now() + after);
        }
        if let Some(j) = imp.write_errors_on {
            self.osds[j].fs.set_write_errors(0.0, 0);
            self.event(format!("osd.{j}'s disk writes well again"));
        }
        if let Some(j) = imp.full_on {
            self.osds[j].fs.set_full(false);
            self.event(format!("osd.{j}'s file system has space again"));
        }
    }

    /// OSD `i`'s store met a failed write or sync and stopped the process (the
    /// daemon exits with status 74): its tasks go, and its disk keeps what the
    /// kernel had written back (a random part of what was not stable, as after
    /// a power cut: pages whose writeback failed are lost, others may be). It
    /// restarts 0.3–3 s later, as a service manager would start it again.
    fn fail_stopped(&mut self, i: usize) {
        let ip = self.osds[i].ip;
        net::crash(ip);
        end_process(ip, self.osds[i].live.take());
        let rng = &mut self.disk_fault_rng;
        self.osds[i].fs.power_cut(&mut || rng.random_bool(0.5));
        self.osds[i].in_doubt = true;
        self.osds[i].fs.set_write_errors(0.0, 0);
        let after = Duration::from_millis(self.disk_fault_rng.random_range(300..3000));
        self.osds[i].restart_at = Some(clock::now() + after);
        self.event(format!(
            "osd.{i} stops: its disk failed a write or sync; it restarts in {} ms",
            after.as_millis()
        ));
    }

    /// A second fault while one is in force, on another OSD: a kill -9, a cut
    /// from one other OSD, or a cut from everyone (its draws are
    /// `overlap_rng`'s).
    fn overlapping_fault(&mut self, now: Instant) {
        let Some(first) = self.impaired.first().map(|imp| imp.osd) else {
            return;
        };
        let n = self.osds.len();
        let i = (first + self.overlap_rng.random_range(1..n)) % n;
        let ip = self.osds[i].ip;
        let hold = Duration::from_millis(self.overlap_rng.random_range(300..6000));
        let fault = if self.overlap_rng.random_bool(0.5) {
            LinkFault::Reject
        } else {
            LinkFault::BlackHole
        };
        self.faults += 1;
        let mut cut = Vec::new();
        let what = match self.overlap_rng.random_range(0..10) {
            0..4 => {
                self.crash(i, false);
                "crash".to_string()
            }
            4..7 => {
                let j = (i + self.overlap_rng.random_range(1..n)) % n;
                let peer = self.osds[j].ip;
                cut.push((ip, peer, fault));
                cut.push((peer, ip, fault));
                format!("osd.{i} and osd.{j} cut from each other ({fault:?})")
            }
            _ => {
                let mut peers = self.other_osd_ips(i);
                peers.extend(self.clients.iter().map(|c| c.ip));
                peers.push(MGR_IP);
                for p in peers {
                    cut.push((ip, p, fault));
                    cut.push((p, ip, fault));
                }
                format!("osd.{i} cut off ({fault:?}, manager too)")
            }
        };
        for &(a, b, f) in &cut {
            net::set_fault(a, b, Some(f));
        }
        if what != "crash" {
            self.event(format!(
                "{what} for {} ms, overlapping osd.{first}'s fault",
                hold.as_millis()
            ));
        } else {
            self.event(format!(
                "(osd.{i}'s crash overlaps osd.{first}'s fault; it restarts in {} ms)",
                hold.as_millis()
            ));
        }
        self.impaired.push(Impairment::plain(i, now + hold, cut));
        self.next_fault = self.next_impairment_change();
    }

    /// Cuts a random client from the manager (both ways, refused), adding the
    /// cut to `cut`: its map stops moving. Returns the event's words.
    fn stale_client_map(&mut self, cut: &mut Vec<(IpAddr, IpAddr, LinkFault)>) -> String {
        if self.clients.is_empty() {
            return String::new();
        }
        let k = self.rng.random_range(0..self.clients.len());
        let ip = self.clients[k].ip;
        for (a, b) in [(ip, MGR_IP), (MGR_IP, ip)] {
            net::set_fault(a, b, Some(LinkFault::Reject));
            cut.push((a, b, LinkFault::Reject));
        }
        format!(", client {k} gets no map")
    }

    /// Kills OSD `i`'s process (kill -9: the page cache survives), or with
    /// `power` cuts its power (the disk keeps a random part of what was not
    /// stable).
    fn crash(&mut self, i: usize, power: bool) {
        let ip = self.osds[i].ip;
        if power {
            net::power_off(ip);
        } else {
            net::crash(ip);
        }
        end_process(ip, self.osds[i].live.take());
        // Started again when the fault that crashed it ends.
        self.osds[i].restart_at = None;
        if power {
            let rng = &mut self.rng;
            self.osds[i].fs.power_cut(&mut || rng.random_bool(0.5));
            self.osds[i].in_doubt = true;
        }
        self.event(format!(
            "osd.{i} {}",
            if power {
                "loses power"
            } else {
                "crashes (kill -9)"
            }
        ));
    }
}

/// The checksum count of an object file's header (bytes 36..40,
/// docs/on-disk-format.md): how many of its blocks the store holds a checksum
/// of. 0 for a file too short to have one.
fn crc_count(file: &[u8]) -> u32 {
    file.get(36..40)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u32::from_le_bytes)
}

/// The manager's state machine on `persisted` (what `state.json` holds), with the
/// simulation's timing (as `flame-mgr`'s main sets it from its configuration).
fn manager(persisted: PersistedState, now: Instant, timings: SimTimings) -> ClusterState {
    let mut m = ClusterState::new(persisted, now);
    m.heartbeat_grace = Duration::from_millis(timings.heartbeat_grace_ms);
    m.report_min_silence = Duration::from_millis(timings.report_min_silence_ms);
    m
}

/// The process at `ip` ends (kill -9, power loss, a stop, the end of the run):
/// `process` — its reactor, and with it every task — and its per-process
/// thread-local state ([`flame_common::node`]) are dropped with its node
/// current, as the kernel tears a dead process down: what the drops touch is
/// its own, and a process started again there inherits nothing.
fn end_process<T>(ip: IpAddr, process: T) {
    let was = flame_common::node::current();
    net::set_current_node(Some(ip));
    drop(process);
    flame_common::node::end_current();
    net::set_current_node(was);
}

/// Runs one reactor's ready tasks; a reactor error is a simulator bug.
fn step(r: &mut Reactor) -> usize {
    r.run_ready(TASKS_PER_STEP_MAX)
        .unwrap_or_else(|e| panic!("simulated reactor failed: {e}"))
}

/// Runs `fut` on `reactor` to its end, advancing virtual time to the reactor's
/// own timers only (a process's start-up, before it talks to anyone).
fn run_to_end<T: 'static>(reactor: &mut Reactor, fut: impl Future<Output = T> + 'static) -> T {
    let out: Rc<RefCell<Option<T>>> = Rc::new(RefCell::new(None));
    let o = out.clone();
    reactor.enter(|| {
        reactor::spawn(async move {
            let v = fut.await;
            *o.borrow_mut() = Some(v);
        })
        .detach()
    });
    for _ in 0..100_000 {
        step(reactor);
        if let Some(v) = out.borrow_mut().take() {
            return v;
        }
        match reactor.next_timer() {
            // On the clock of the node it runs for.
            Some(t) => clock::advance_to(clock::to_sim(t)),
            None if !reactor.has_ready() => panic!("a start-up task waits for nothing"),
            None => {}
        }
    }
    panic!("a start-up task did not finish");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drawn_timings_keep_every_rule_and_the_legacy_ones_break_the_lease_rule() {
        for seed in 0..5000 {
            let t = SimTimings::draw(&mut StdRng::seed_from_u64(seed));
            assert!(t.check().is_ok(), "{t}");
            assert!(t.lease_ms + t.heartbeat_interval_ms < t.heartbeat_grace_ms);
        }
        assert!(LEGACY_TIMINGS.check().is_err());
    }
}
