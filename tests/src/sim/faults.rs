//! The simulator's fault kinds, typed, and the swarm rule that picks which of
//! them a seed injects and how often.
//!
//! Swarm testing (Groce et al., "Swarm Testing", ISSTA 2012; FoundationDB's and
//! TigerBeetle's simulators do the same): rather than every seed drawing from
//! every fault kind with the same fixed weights — where a bug that needs many
//! faults of one kind in a row, and none of another that would mask it, is
//! rarely reached — each seed first draws *which* kinds are on and their
//! weights, then draws its faults from those. Some seeds so hammer one kind
//! (forty partitions), others mix two or three, and the union over seeds still
//! covers every kind.
//!
//! The draw is pure (a function of an RNG), so it is unit-tested here and a
//! seed's swarm is printed with its report.

use rand::Rng;
use rand::rngs::StdRng;

/// One kind of primary fault: what happens to one OSD (or the manager, or the
/// network near one OSD) for the fault's hold time. Disk faults beside it (read
/// errors, write errors, a full file system, bit rot) and an overlapping second
/// fault are drawn on their own streams ([`SideFaults`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum FaultKind {
    /// kill -9: the process and its tasks go, the page cache stays; restarted
    /// when the fault ends.
    Crash,
    /// Power loss: as a crash, and the disk keeps a random half of what was not
    /// made stable.
    PowerLoss,
    /// Power loss, a restart when the fault ends, and a second power loss of the
    /// same OSD 50-1500 ms after it started again (while its start-up recovery
    /// and catch-up run).
    RepeatedPowerLoss,
    /// Cut from every other OSD and the clients (maybe the manager too; both
    /// ways or only its sends; refused or black-holed); or cut from the manager
    /// and its peers while the clients still reach it (its lease runs out while
    /// clients keep sending), sometimes with a client that gets no new map.
    Cut,
    /// Cut from one other OSD only, both ways, refused: both still heartbeat.
    PairCutReject,
    /// As [`FaultKind::PairCutReject`], black-holed.
    PairCutBlackHole,
    /// Cut from one other OSD in one direction only (its sends to that peer
    /// vanish or are refused; the peer's reach it).
    OneWayPairCut,
    /// Cut from the manager only (both ways or one): its peers and the clients
    /// still reach it, its heartbeats do not arrive, its lease runs out, the
    /// manager marks it down and its groups move — while it still runs.
    CutFromManager,
    /// The manager stops (nobody reaches it) and restarts from what it
    /// persisted.
    ManagerStop,
    /// Everything to and from the OSD takes 50-2500 ms longer each way.
    Slow,
    /// Slow, then the clients' connections to it reset on their side only.
    SlowThenReset,
    /// Marked out (its groups move and backfill elsewhere) and in again.
    Out,
    /// A client process (not the first: it runs the final read-back) crashes
    /// mid-write and a new incarnation — a new op session, the same instance
    /// name, as a restarted flame-nbd — starts 0-3 s later and re-issues the
    /// writes its writers had not finished; what the old one had in flight may
    /// still land, never over a newer write (its connections are fenced once
    /// the new incarnation connects: seed 200188).
    ClientCrash,
    /// Frames to and from the OSD are corrupted in flight now and then (a bit
    /// flips past TCP's checksum): the receiver's frame checksums must catch
    /// every one (the connection is closed; the message never applied).
    CorruptFrames,
    /// Frames to and from the OSD now and then arrive twice (a retransmission
    /// the stack did not drop, a replaying middlebox): a request applied twice
    /// must change nothing a client can read (dedup, idempotence), a reply twice
    /// is dropped as late.
    DuplicateFrames,
    /// Frames to and from the OSD are now and then delayed by up to 200 ms
    /// (their connection waits behind them): messages of different
    /// connections overtake each other far more than latency alone makes them.
    DelayedFrames,
}

impl FaultKind {
    /// Every kind, in a fixed order (the swarm's draw walks it).
    pub const ALL: [FaultKind; 16] = [
        FaultKind::Crash,
        FaultKind::PowerLoss,
        FaultKind::RepeatedPowerLoss,
        FaultKind::Cut,
        FaultKind::PairCutReject,
        FaultKind::PairCutBlackHole,
        FaultKind::OneWayPairCut,
        FaultKind::CutFromManager,
        FaultKind::ManagerStop,
        FaultKind::Slow,
        FaultKind::SlowThenReset,
        FaultKind::Out,
        FaultKind::ClientCrash,
        FaultKind::CorruptFrames,
        FaultKind::DuplicateFrames,
        FaultKind::DelayedFrames,
    ];

    /// The kind the simulator's fault model before swarms (one fixed draw of
    /// `0..16`) gave `draw`, so that the seeds that found bugs in it replay as
    /// they did (`SimConfig::swarm` off).
    pub fn legacy(draw: u32, osds: usize) -> FaultKind {
        match draw {
            0..3 => FaultKind::Crash,
            3 => FaultKind::PowerLoss,
            10 => FaultKind::PairCutReject,
            11 => FaultKind::PairCutBlackHole,
            12 => FaultKind::ManagerStop,
            13 => FaultKind::Slow,
            14 if osds > 3 => FaultKind::Out,
            14 | 15 => FaultKind::SlowThenReset,
            _ => FaultKind::Cut,
        }
    }

    /// Whether the kind needs a fourth OSD (to move groups to).
    fn needs_spare_osd(self) -> bool {
        self == FaultKind::Out
    }

    /// Whether a second fault may overlap this one (only the OSD-level faults
    /// the overlap was built for: never a stopped manager, an out or a slow
    /// OSD).
    pub fn may_overlap(self) -> bool {
        matches!(
            self,
            FaultKind::Crash
                | FaultKind::PowerLoss
                | FaultKind::RepeatedPowerLoss
                | FaultKind::Cut
                | FaultKind::PairCutReject
                | FaultKind::PairCutBlackHole
                | FaultKind::OneWayPairCut
                | FaultKind::CutFromManager
        )
    }
}

/// How likely each side fault is with a primary fault (each on its own stream).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SideFaults {
    /// A disk fails some of its data reads meanwhile.
    pub read_errors: f64,
    /// A disk fails some writes and syncs meanwhile (its OSD stops).
    pub write_errors: f64,
    /// A file system is full meanwhile.
    pub full: f64,
    /// One bit of one checksummed block of one copy flips.
    pub bit_rot: f64,
    /// A second fault on another OSD overlaps this one (four OSDs or more).
    pub overlap: f64,
}

impl SideFaults {
    /// The fixed chances of the model before swarms.
    pub const LEGACY: SideFaults = SideFaults {
        read_errors: 0.2,
        write_errors: 0.1,
        full: 0.08,
        bit_rot: 0.3,
        overlap: 0.35,
    };
}

/// A seed's swarm: which fault kinds are on, with what weights, and how likely
/// the side faults are.
#[derive(Clone, Debug, PartialEq)]
pub struct Swarm {
    /// The kinds that are on, each with its weight (1-10), in
    /// [`FaultKind::ALL`]'s order. Never empty.
    pub kinds: Vec<(FaultKind, u32)>,
    /// The side faults' chances.
    pub side: SideFaults,
    /// Pause between two faults, in ms (`min..max`).
    pub gap_ms: (u64, u64),
}

/// Chance that a kind is on in a seed's swarm.
const KIND_ON_CHANCE: f64 = 0.5;
/// Chance that a seed's swarm is focused: one or two kinds only.
const FOCUSED_CHANCE: f64 = 0.2;

impl Swarm {
    /// Draws a seed's swarm: each kind on with even odds (at least one), or
    /// in a fifth of the seeds only one or two kinds, with a weight of 1-10; each side fault off, at its legacy chance, or at twice
    /// it; the gap between faults short, as before, or long.
    pub fn draw(rng: &mut StdRng, osds: usize) -> Swarm {
        let possible: Vec<FaultKind> = FaultKind::ALL
            .into_iter()
            .filter(|k| osds > 3 || !k.needs_spare_osd())
            .collect();
        assert!(!possible.is_empty(), "no fault kind for {osds} OSDs");
        let mut kinds: Vec<(FaultKind, u32)> = Vec::new();
        if rng.random_bool(FOCUSED_CHANCE) {
            // A focused seed: one or two kinds only, hammered.
            for _ in 0..rng.random_range(1..=2) {
                let k = possible[rng.random_range(0..possible.len())];
                if kinds.iter().all(|&(o, _)| o != k) {
                    kinds.push((k, rng.random_range(1..=10)));
                }
            }
        } else {
            for &k in &possible {
                if rng.random_bool(KIND_ON_CHANCE) {
                    kinds.push((k, rng.random_range(1..=10)));
                }
            }
        }
        if kinds.is_empty() {
            let k = possible[rng.random_range(0..possible.len())];
            kinds.push((k, 1));
        }
        let mut scale = |chance: f64| match rng.random_range(0..3) {
            0 => 0.0,
            1 => chance,
            _ => (2.0 * chance).min(0.9),
        };
        let legacy = SideFaults::LEGACY;
        let side = SideFaults {
            read_errors: scale(legacy.read_errors),
            write_errors: scale(legacy.write_errors),
            full: scale(legacy.full),
            bit_rot: scale(legacy.bit_rot),
            overlap: scale(legacy.overlap),
        };
        let gap_ms = if rng.random_bool(0.7) {
            (500, 4000)
        } else {
            (100, 1000)
        };
        let swarm = Swarm {
            kinds,
            side,
            gap_ms,
        };
        assert!(swarm.kinds.iter().all(|&(_, w)| (1..=10).contains(&w)));
        swarm
    }

    /// The model before swarms: every kind of its fixed draw.
    pub fn legacy() -> Swarm {
        Swarm {
            kinds: Vec::new(),
            side: SideFaults::LEGACY,
            gap_ms: (500, 4000),
        }
    }

    /// Draws the next fault's kind by weight.
    pub fn pick(&self, rng: &mut StdRng) -> FaultKind {
        let total: u32 = self.kinds.iter().map(|&(_, w)| w).sum();
        assert!(total > 0, "a swarm without kinds draws nothing");
        let mut at = rng.random_range(0..total);
        for &(k, w) in &self.kinds {
            if at < w {
                return k;
            }
            at -= w;
        }
        unreachable!("a draw below the total weight falls in some kind")
    }
}

impl std::fmt::Display for Swarm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.kinds.is_empty() {
            return write!(f, "legacy faults");
        }
        let kinds: Vec<String> = self
            .kinds
            .iter()
            .map(|(k, w)| format!("{k:?}×{w}"))
            .collect();
        let s = self.side;
        write!(
            f,
            "swarm [{}] read-err {:.2} write-err {:.2} full {:.2} rot {:.2} overlap {:.2} gap {}-{} ms",
            kinds.join(" "),
            s.read_errors,
            s.write_errors,
            s.full,
            s.bit_rot,
            s.overlap,
            self.gap_ms.0,
            self.gap_ms.1
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn a_swarm_is_never_empty_and_weights_are_in_range() {
        for seed in 0..2000 {
            let mut rng = StdRng::seed_from_u64(seed);
            let s = Swarm::draw(&mut rng, 3 + (seed % 7) as usize);
            assert!(!s.kinds.is_empty());
            assert!(s.kinds.iter().all(|&(_, w)| (1..=10).contains(&w)));
        }
    }

    #[test]
    fn out_needs_a_fourth_osd() {
        for seed in 0..500 {
            let s = Swarm::draw(&mut StdRng::seed_from_u64(seed), 3);
            assert!(s.kinds.iter().all(|&(k, _)| k != FaultKind::Out), "{s}");
        }
    }

    #[test]
    fn over_many_seeds_every_kind_is_on_somewhere_and_alone_somewhere() {
        let mut on = std::collections::BTreeSet::new();
        let mut alone = std::collections::BTreeSet::new();
        for seed in 0..3000 {
            let s = Swarm::draw(&mut StdRng::seed_from_u64(seed), 4);
            on.extend(s.kinds.iter().map(|&(k, _)| k));
            if let [(k, _)] = s.kinds[..] {
                alone.insert(k);
            }
        }
        assert_eq!(on.len(), FaultKind::ALL.len());
        assert!(alone.len() >= FaultKind::ALL.len() / 2, "{alone:?}");
    }

    #[test]
    fn pick_only_draws_kinds_that_are_on_in_proportion() {
        let s = Swarm {
            kinds: vec![(FaultKind::Crash, 1), (FaultKind::Slow, 9)],
            side: SideFaults::LEGACY,
            gap_ms: (500, 4000),
        };
        let mut rng = StdRng::seed_from_u64(7);
        let slow = (0..10_000)
            .filter(|_| s.pick(&mut rng) == FaultKind::Slow)
            .count();
        assert!((8500..9500).contains(&slow), "{slow}");
    }

    #[test]
    fn the_legacy_draw_maps_as_the_old_match_did() {
        assert_eq!(FaultKind::legacy(0, 3), FaultKind::Crash);
        assert_eq!(FaultKind::legacy(3, 3), FaultKind::PowerLoss);
        assert_eq!(FaultKind::legacy(4, 3), FaultKind::Cut);
        assert_eq!(FaultKind::legacy(9, 3), FaultKind::Cut);
        assert_eq!(FaultKind::legacy(12, 4), FaultKind::ManagerStop);
        assert_eq!(FaultKind::legacy(14, 4), FaultKind::Out);
        assert_eq!(FaultKind::legacy(14, 3), FaultKind::SlowThenReset);
        assert_eq!(FaultKind::legacy(15, 4), FaultKind::SlowThenReset);
    }
}
