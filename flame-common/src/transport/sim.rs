//! The simulated network of the deterministic simulator: every connection between
//! simulated processes on the simulator's one thread, in virtual time
//! ([`crate::clock`]).
//!
//! It behaves like TCP where the OSD and the client can tell: messages of one
//! connection arrive whole and in order, each after a latency drawn from the
//! network's seeded generator; a connection to an address nobody listens on is
//! refused; a process that dies resets its connections after what it had already
//! sent has arrived. On top of that the simulator injects what TCP on a real
//! network does when it goes wrong, between any two addresses and in one
//! direction or both:
//!
//! * [`LinkFault::Reject`] — the path refuses (an iptables `REJECT`): connects
//!   are refused, and a connection used across it is reset at once;
//! * [`LinkFault::BlackHole`] — the path drops everything silently (a cable cut,
//!   iptables `DROP`): connects time out, sends vanish, and nothing is reported —
//!   only the peers' own timeouts notice. A connection a send vanished on is
//!   reset when the path heals: TCP never delivers a stream with a gap in it (it
//!   retransmits, or gives up and resets), so a reply lost in the hole is never
//!   silently missing from a connection that goes on working (simulator seed
//!   45377: a client waited for it forever). With [`set_hold_black_holes`] a
//!   black hole instead holds what is sent into it and delivers it, in order,
//!   0–4 s after the path heals — TCP retransmitting once the `DROP` is
//!   removed — also for connection ends that were closed or whose process was
//!   killed meanwhile (the kernel keeps sending an orphaned socket's data and
//!   its FIN; [`power_off`] loses it): a request a client gave up on can arrive
//!   long after it resent it elsewhere (simulator seed 1617).
//!
//! Messages go through the real codec ([`Message::encode`] and
//! [`Message::decode`]), so the receiver owns its own bytes, as over a socket.
//! One-sided access (grants) is not simulated: a simulated client runs with
//! conversion off. The network belongs to the thread that [`install`]ed it;
//! every message delivered is folded into its trace hash ([`trace_hash`]), which
//! a determinism test compares between two runs of one seed.
//!
//! Which process a task belongs to is [`set_current_node`], set by the simulator
//! before it steps that process's reactor: a connection made by a task leaves
//! from that address, and [`crash`] of that address resets exactly its
//! connections.

use super::TransportError;
use crate::clock;
use crate::protocol::{Message, ProtocolError};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, VecDeque};
use std::future::poll_fn;
use std::net::{IpAddr, SocketAddr};
use std::rc::{Rc, Weak};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

/// What a faulty path between two addresses does (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinkFault {
    /// Refuses: connects fail at once, a connection used across it is reset.
    Reject,
    /// Drops everything silently: connects time out, sends vanish.
    BlackHole,
}

/// What a flaky path near one address does to the frames sent to or from it:
/// chances per frame. Not what TCP on a sound network does — it is what the
/// receivers' checks must survive: a corrupted frame must fail its checksums
/// (the connection closes, the message is never applied), a duplicated one
/// must change nothing a client can read, a delayed one holds up its
/// connection while others overtake it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Weather {
    /// Chance that one bit of the frame flips.
    pub corrupt: f64,
    /// Chance that the frame arrives twice.
    pub duplicate: f64,
    /// Chance that the frame (and its connection behind it) is delayed by up to
    /// `delay_max`.
    pub delay: f64,
    /// The longest such delay.
    pub delay_max: Duration,
}

/// Frames [`Weather`] corrupted, and how many of them the codec nevertheless
/// decoded (must stay zero: the frame checksums catch every flipped bit).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CorruptionFigures {
    /// Frames with a bit flipped.
    pub corrupted: u64,
    /// Of those, frames that still decoded as a message.
    pub undetected: u64,
    /// Frames delivered twice.
    pub duplicated: u64,
}

/// How the network behaves when no fault is injected.
#[derive(Clone, Copy, Debug)]
pub struct NetConfig {
    /// The generator's seed (latencies).
    pub seed: u64,
    /// One-way latency of a message, drawn uniformly from this range (µs).
    pub latency_us_min: u64,
    /// See `latency_us_min`.
    pub latency_us_max: u64,
}

/// One end of a direction of a connection: the bytes that arrived, in order.
#[derive(Default)]
struct Pipe {
    frames: RefCell<VecDeque<Vec<u8>>>,
    /// The peer closed (or reset) this direction; arrives after its frames.
    closed: Cell<bool>,
    waker: RefCell<Option<Waker>>,
}

impl Pipe {
    fn wake(&self) {
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
    }
}

/// What travels: a frame, or the end of the direction (FIN or RST).
enum Cargo {
    Frame(Vec<u8>),
    End,
}

struct Delivery {
    to: Weak<Pipe>,
    cargo: Cargo,
    from: SocketAddr,
    dest: SocketAddr,
}

struct ListenerState {
    id: u64,
    backlog: RefCell<VecDeque<Rc<SimConn>>>,
    waker: RefCell<Option<Waker>>,
}

/// The network: listeners, faults, and the messages on the wire.
struct Net {
    config: NetConfig,
    rng: RefCell<StdRng>,
    listeners: RefCell<BTreeMap<SocketAddr, Rc<ListenerState>>>,
    faults: RefCell<BTreeMap<(IpAddr, IpAddr), LinkFault>>,
    /// Extra one-way latency of everything sent to or from an address (a slow
    /// or overloaded node).
    slow: RefCell<BTreeMap<IpAddr, Duration>>,
    /// On the wire, by arrival time (then send order).
    wire: RefCell<BTreeMap<(Instant, u64), Delivery>>,
    seq: Cell<u64>,
    /// Every connection end, to reset a crashed process's (pruned as they go).
    ends: RefCell<Vec<Weak<SimConn>>>,
    next_port: Cell<u16>,
    current_node: Cell<Option<IpAddr>>,
    trace: Cell<u64>,
    delivered: Cell<u64>,
    /// `FLAME_SIM_DUMP` was set: every delivery is printed to stderr (to diff two
    /// runs that should have been identical).
    dump: bool,
    /// Virtual time zero of the trace (instants are folded in relative to it).
    epoch: Instant,
    /// Black holes hold what is sent into them and deliver it, in order, some
    /// time after the path heals (TCP retransmitting after an iptables DROP is
    /// removed) instead of resetting the connection ([`set_hold_black_holes`]).
    hold: Cell<bool>,
    /// A held path's retransmission delay grows with how long it was held, as
    /// TCP's exponential backoff makes it ([`set_tcp_backoff`]).
    backoff: Cell<bool>,
    /// Held cargo of connection ends dropped before their path healed (the
    /// kernel keeps retransmitting an orphaned socket's data).
    orphans: RefCell<Vec<Orphan>>,
    /// Flaky paths, by the address near which they are ([`set_weather`]).
    weather: RefCell<BTreeMap<IpAddr, Weather>>,
    /// Draws of the weather: a stream of its own, so that a run without any
    /// draws its latencies as before.
    weather_rng: RefCell<StdRng>,
    /// What the weather did.
    corruption: Cell<CorruptionFigures>,
}

/// What a holding black hole kept of a connection end that is gone.
struct Orphan {
    from: SocketAddr,
    to: SocketAddr,
    /// The peer's inbox.
    inbox: Weak<Pipe>,
    held: Vec<Cargo>,
    /// When the first of it was held.
    held_since: Instant,
}

thread_local! {
    static NET: RefCell<Option<Rc<Net>>> = const { RefCell::new(None) };
}

fn net() -> Result<Rc<Net>, TransportError> {
    NET.with(|n| n.borrow().clone()).ok_or_else(|| {
        TransportError::Unavailable("transport sim: no simulated network on this thread".into())
    })
}

/// `Ok` on a thread with a simulated network ([`super::check_available`]).
pub fn check_installed() -> Result<(), String> {
    net().map(|_| ()).map_err(|e| e.to_string())
}

/// Installs a fresh simulated network on this thread (replacing any earlier one).
pub fn install(config: NetConfig) {
    let net = Net {
        config,
        rng: RefCell::new(StdRng::seed_from_u64(config.seed)),
        listeners: RefCell::default(),
        faults: RefCell::default(),
        slow: RefCell::default(),
        wire: RefCell::default(),
        seq: Cell::new(0),
        ends: RefCell::default(),
        next_port: Cell::new(40_000),
        current_node: Cell::new(None),
        trace: Cell::new(FNV_OFFSET),
        delivered: Cell::new(0),
        epoch: clock::sim_now(),
        dump: std::env::var_os("FLAME_SIM_DUMP").is_some(),
        hold: Cell::new(false),
        backoff: Cell::new(false),
        orphans: RefCell::default(),
        weather: RefCell::default(),
        weather_rng: RefCell::new(StdRng::seed_from_u64(config.seed ^ 0x3ea7_4e2f)),
        corruption: Cell::new(CorruptionFigures::default()),
    };
    NET.with(|n| *n.borrow_mut() = Some(Rc::new(net)));
}

/// Removes this thread's network (the end of a simulation): listeners and
/// connections left are dropped.
pub fn uninstall() {
    let net = NET.with(|n| n.borrow_mut().take());
    drop(net);
}

/// The process whose tasks run next (its address): connections they make leave
/// from it, and its per-process state is the one loaded ([`crate::node`]): the
/// node switch of the simulator, so that no node ever runs with another's
/// thread-locals.
pub fn set_current_node(ip: Option<IpAddr>) {
    crate::node::switch_to(ip);
    if let Ok(n) = net() {
        n.current_node.set(ip);
    }
}

/// Sets (or with `None` clears) the fault of the path from `from` to `to` (one
/// direction: call it twice for a symmetric partition).
pub fn set_fault(from: IpAddr, to: IpAddr, fault: Option<LinkFault>) {
    if let Ok(n) = net() {
        match fault {
            Some(f) => n.faults.borrow_mut().insert((from, to), f),
            None => n.faults.borrow_mut().remove(&(from, to)),
        };
        if fault.is_none() {
            release_held(&n, |c| c.local.ip() == from && c.peer.ip() == to);
        }
        if fault != Some(LinkFault::BlackHole) {
            reset_lossy(&n, |c| c.local.ip() == from && c.peer.ip() == to);
        }
    }
}

/// Whether black holes hold what is sent into them (see `Net::hold`).
pub fn set_hold_black_holes(on: bool) {
    if let Ok(n) = net() {
        n.hold.set(on);
    }
}

/// Whether a held path's retransmission delay grows with how long it was held
/// (see [`Net::post_held`]); off: 0-4 s whatever the hold lasted.
pub fn set_tcp_backoff(on: bool) {
    if let Ok(n) = net() {
        n.backoff.set(on);
    }
}

/// Delivers what black holes held on the connections chosen by `which` whose
/// path is open again: in order, after a retransmission delay of 0-4 s; what is
/// sent on them later arrives after it.
fn release_held(n: &Net, which: impl Fn(&SimConn) -> bool) {
    let ends: Vec<Rc<SimConn>> = n
        .ends
        .borrow()
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|c| !c.held.borrow().is_empty() && which(c))
        .filter(|c| n.fault(c.local.ip(), c.peer.ip()).is_none())
        .collect();
    let orphans: Vec<Orphan> = {
        let mut o = n.orphans.borrow_mut();
        let (go, stay): (Vec<Orphan>, Vec<Orphan>) = std::mem::take(&mut *o)
            .into_iter()
            .partition(|o| n.fault(o.from.ip(), o.to.ip()).is_none());
        *o = stay;
        go
    };
    for o in orphans {
        let last = Cell::new(clock::sim_now());
        n.post_held(&last, &o.inbox, (o.from, o.to), o.held, o.held_since);
    }
    for c in ends {
        let held = std::mem::take(&mut *c.held.borrow_mut());
        let since = c.held_since.take().unwrap_or_else(clock::sim_now);
        n.post_held(&c.last_arrival, &c.outbox, (c.local, c.peer), held, since);
    }
}

/// Resets the connections (chosen by `which`) that lost a send in a black hole.
fn reset_lossy(n: &Net, which: impl Fn(&SimConn) -> bool) {
    let ends: Vec<Rc<SimConn>> = n
        .ends
        .borrow()
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|c| c.lost.get() && which(c))
        .collect();
    for c in ends {
        c.shut();
    }
}

/// The fault of the path from `from` to `to`, if any (the simulator consults it
/// for paths it models itself, such as a process's to the manager).
pub fn fault(from: IpAddr, to: IpAddr) -> Option<LinkFault> {
    net().ok()?.fault(from, to)
}

/// Makes everything sent to or from `ip` take `extra` longer (`None`: normal).
pub fn set_slow(ip: IpAddr, extra: Option<Duration>) {
    if let Ok(n) = net() {
        match extra {
            Some(d) => n.slow.borrow_mut().insert(ip, d),
            None => n.slow.borrow_mut().remove(&ip),
        };
    }
}

/// Makes the paths to and from `ip` flaky ([`Weather`]; `None`: sound again).
pub fn set_weather(ip: IpAddr, weather: Option<Weather>) {
    if let Ok(n) = net() {
        match weather {
            Some(w) => n.weather.borrow_mut().insert(ip, w),
            None => n.weather.borrow_mut().remove(&ip),
        };
    }
}

/// What the weather did to frames so far.
pub fn corruption() -> CorruptionFigures {
    net().map_or_else(|_| CorruptionFigures::default(), |n| n.corruption.get())
}

/// Whether `ip` is slow ([`set_slow`]).
pub fn is_slow(ip: IpAddr) -> bool {
    net().is_ok_and(|n| n.slow.borrow().contains_key(&ip))
}

/// Clears every fault.
pub fn heal_all() {
    if let Ok(n) = net() {
        n.faults.borrow_mut().clear();
        n.slow.borrow_mut().clear();
        n.weather.borrow_mut().clear();
        release_held(&n, |_| true);
        reset_lossy(&n, |_| true);
    }
}

/// The process at `ip` died: its listeners go away, and each of its connections
/// ends for the peer once what it had already sent has arrived.
pub fn crash(ip: IpAddr) {
    let Ok(n) = net() else { return };
    n.listeners.borrow_mut().retain(|a, _| a.ip() != ip);
    let ends: Vec<Rc<SimConn>> = n
        .ends
        .borrow()
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|c| c.local.ip() == ip)
        .collect();
    for c in ends {
        c.shut();
    }
    n.prune();
}

/// The node at `ip` lost its power: as [`crash`], but what holding black holes
/// kept of its connections is lost with its kernel.
pub fn power_off(ip: IpAddr) {
    let Ok(n) = net() else { return };
    for c in n.ends.borrow().iter().filter_map(Weak::upgrade) {
        if c.local.ip() == ip {
            c.held.borrow_mut().clear();
        }
    }
    n.orphans.borrow_mut().retain(|o| o.from.ip() != ip);
    crash(ip);
}

/// The process whose tasks run now stops at once (its storage failed and it
/// exits): its listeners and connections go, as in [`crash`], so nothing it
/// would still send before the simulator drops it leaves it. Nothing without a
/// current process.
pub fn crash_current() {
    let Ok(n) = net() else { return };
    if let Some(ip) = n.current_node.get() {
        crash(ip);
    }
}

/// The ends at `from` of its connections to `to` are reset on `from`'s side only
/// (a client's TCP timeout, a middlebox's reset towards it): `from` sees them
/// closed at once and reconnects, while what it had already sent is still on
/// the wire and reaches `to` before the end does — possibly after what `from`
/// sends on its new connections, if the old path was slower.
pub fn reset_from(from: IpAddr, to: IpAddr) {
    let Ok(n) = net() else { return };
    let ends: Vec<Rc<SimConn>> = n
        .ends
        .borrow()
        .iter()
        .filter_map(Weak::upgrade)
        .filter(|c| c.local.ip() == from && c.peer.ip() == to)
        .collect();
    for c in ends {
        c.shut();
    }
    n.prune();
}

/// Delivers every message due by [`clock::sim_now`] (the network runs on the
/// simulator's clock, whatever a node's clock reads); returns how many.
pub fn deliver_due() -> usize {
    let Ok(n) = net() else { return 0 };
    let now = clock::sim_now();
    let mut count = 0;
    loop {
        let due = {
            let mut wire = n.wire.borrow_mut();
            match wire.first_key_value() {
                Some((&(at, _), _)) if at <= now => wire.pop_first(),
                _ => None,
            }
        };
        let Some(((at, _), d)) = due else {
            return count;
        };
        count += 1;
        let Some(pipe) = d.to.upgrade() else { continue };
        if pipe.closed.get() {
            continue;
        }
        let mut h = n.trace.get();
        h = fnv(h, &(at - n.epoch).as_nanos().to_le_bytes());
        h = fnv(h, d.from.to_string().as_bytes());
        h = fnv(h, d.dest.to_string().as_bytes());
        match d.cargo {
            Cargo::Frame(bytes) => {
                h = fnv(h, &bytes);
                if n.dump {
                    eprintln!(
                        "{:?} {} {} {:02x?}",
                        at - n.epoch,
                        d.from,
                        d.dest,
                        &bytes[..bytes.len().min(128)]
                    );
                }
                pipe.frames.borrow_mut().push_back(bytes);
            }
            Cargo::End => {
                h = fnv(h, b"end");
                pipe.closed.set(true);
            }
        }
        n.trace.set(h);
        n.delivered.set(n.delivered.get() + 1);
        pipe.wake();
    }
}

/// When the next message arrives (`None`: nothing on the wire).
pub fn next_delivery() -> Option<Instant> {
    net()
        .ok()?
        .wire
        .borrow()
        .first_key_value()
        .map(|(&(at, _), _)| at)
}

/// The hash of every delivery so far (time, ends, bytes), and how many: equal
/// for two runs of one seed.
pub fn trace_hash() -> (u64, u64) {
    net().map_or((0, 0), |n| (n.trace.get(), n.delivered.get()))
}

/// Folds `extra` into the trace (the simulator's own events: faults, crashes).
pub fn trace_event(extra: &[u8]) {
    if let Ok(n) = net() {
        n.trace.set(fnv(n.trace.get(), extra));
    }
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
/// Longest retransmission delay of a held path after it heals, without
/// [`set_tcp_backoff`].
const HELD_DELAY_MS: u64 = 4000;
/// Longest gap between two retransmissions (Linux's `TCP_RTO_MAX`).
const RETRANSMIT_GAP_MAX: Duration = Duration::from_secs(120);

/// The trace's hash step: FNV-1a's prime over 8-byte words (a byte at a time
/// for the tail), folded so that high bits reach low ones. Every frame's bytes
/// go through it, so word-at-a-time matters: byte-wise it took a tenth of a
/// seed's time.
fn fnv(mut h: u64, bytes: &[u8]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let w = u64::from_le_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        h = (h ^ w).wrapping_mul(PRIME);
        h ^= h >> 29;
    }
    for &b in words.remainder() {
        h ^= u64::from(b);
        h = h.wrapping_mul(PRIME);
    }
    h
}

impl Net {
    fn fault(&self, from: IpAddr, to: IpAddr) -> Option<LinkFault> {
        self.faults.borrow().get(&(from, to)).copied()
    }

    fn latency(&self) -> Duration {
        let (lo, hi) = (self.config.latency_us_min, self.config.latency_us_max);
        let us = if hi > lo {
            self.rng.borrow_mut().random_range(lo..=hi)
        } else {
            lo
        };
        Duration::from_micros(us)
    }

    /// Puts what a black hole held since `held_since` on the wire once its
    /// path healed: after a retransmission delay, in order, and before anything
    /// sent on the same direction (`last`) later. The delay is 0-4 s, or with
    /// [`set_tcp_backoff`] up to as long as the hold lasted (at most
    /// [`RETRANSMIT_GAP_MAX`]): TCP doubles its retransmission timeout with
    /// each try, so the try after the heal comes up to about the time already
    /// waited later (seconds after a long cut, while the cluster moved on).
    fn post_held(
        &self,
        last: &Cell<Instant>,
        to: &Weak<Pipe>,
        (from, dest): (SocketAddr, SocketAddr),
        held: Vec<Cargo>,
        held_since: Instant,
    ) {
        let mut most = HELD_DELAY_MS;
        if self.backoff.get() {
            let waited = clock::sim_now().saturating_duration_since(held_since);
            let waited_ms = u64::try_from(waited.min(RETRANSMIT_GAP_MAX).as_millis()).unwrap_or(0);
            most = most.max(waited_ms);
        }
        let delay = Duration::from_millis(self.rng.borrow_mut().random_range(0..=most));
        last.set(last.get().max(clock::sim_now() + delay));
        for cargo in held {
            self.post(
                last,
                Delivery {
                    to: to.clone(),
                    cargo,
                    from,
                    dest,
                },
            );
        }
    }

    /// Puts `cargo` on the wire to arrive no earlier than anything sent before it
    /// on the same direction (`last`).
    fn post(&self, last: &Cell<Instant>, mut d: Delivery) {
        let mut extra = {
            let slow = self.slow.borrow();
            let of = |ip: IpAddr| slow.get(&ip).copied().unwrap_or_default();
            of(d.from.ip()) + of(d.dest.ip())
        };
        let weather = {
            let w = self.weather.borrow();
            w.get(&d.from.ip()).or_else(|| w.get(&d.dest.ip())).copied()
        };
        let mut twice = false;
        if let (Some(w), Cargo::Frame(bytes)) = (weather, &mut d.cargo) {
            let mut rng = self.weather_rng.borrow_mut();
            let mut figures = self.corruption.get();
            if !bytes.is_empty() && rng.random_bool(w.corrupt.clamp(0.0, 1.0)) {
                let at = rng.random_range(0..bytes.len());
                bytes[at] ^= 1 << rng.random_range(0..8);
                figures.corrupted += 1;
                if decode(bytes).is_ok() {
                    figures.undetected += 1;
                }
            }
            if rng.random_bool(w.duplicate.clamp(0.0, 1.0)) {
                twice = true;
                figures.duplicated += 1;
            }
            if !w.delay_max.is_zero() && rng.random_bool(w.delay.clamp(0.0, 1.0)) {
                extra += Duration::from_micros(
                    rng.random_range(1..=u64::try_from(w.delay_max.as_micros()).unwrap_or(1)),
                );
            }
            self.corruption.set(figures);
        }
        let at = (clock::sim_now() + self.latency() + extra).max(last.get());
        last.set(at);
        if twice && let Cargo::Frame(bytes) = &d.cargo {
            let copy = Delivery {
                to: d.to.clone(),
                cargo: Cargo::Frame(bytes.clone()),
                from: d.from,
                dest: d.dest,
            };
            let seq = self.seq.get();
            self.seq.set(seq + 1);
            self.wire.borrow_mut().insert((at, seq), copy);
        }
        let seq = self.seq.get();
        self.seq.set(seq + 1);
        self.wire.borrow_mut().insert((at, seq), d);
    }

    fn local_addr(&self) -> SocketAddr {
        let ip = self
            .current_node
            .get()
            .unwrap_or(IpAddr::from([127, 0, 0, 1]));
        let port = self.next_port.get();
        self.next_port.set(port.checked_add(1).unwrap_or(40_000));
        SocketAddr::new(ip, port)
    }

    fn prune(&self) {
        self.ends.borrow_mut().retain(|w| w.strong_count() > 0);
    }
}

/// One end of a simulated connection.
pub struct SimConn {
    local: SocketAddr,
    peer: SocketAddr,
    inbox: Rc<Pipe>,
    /// The peer's inbox.
    outbox: Weak<Pipe>,
    /// Arrival time of the last thing sent (keeps the direction in order).
    last_arrival: Cell<Instant>,
    /// This end is closed: receives fail, sends are refused.
    closed: Cell<bool>,
    /// A send on this end vanished in a black hole: reset when the path heals.
    lost: Cell<bool>,
    /// What a holding black hole keeps until the path heals (`Net::hold`).
    held: RefCell<Vec<Cargo>>,
    /// When the first of `held` was held.
    held_since: Cell<Option<Instant>>,
    net: Weak<Net>,
}

impl SimConn {
    /// Connects to `addr` from this process's address, after one latency (a
    /// black-holed path: after `timeout`).
    pub async fn connect(
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<Rc<SimConn>, TransportError> {
        let net = net()?;
        let local = net.local_addr();
        let fault = net
            .fault(local.ip(), addr.ip())
            .or(net.fault(addr.ip(), local.ip()));
        match fault {
            Some(LinkFault::BlackHole) => {
                crate::reactor::sleep(timeout).await;
                return Err(TransportError::ConnectTimeout(addr));
            }
            Some(LinkFault::Reject) => {
                return Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into());
            }
            None => {}
        }
        let rtt = net.latency() + net.latency();
        if rtt >= timeout {
            crate::reactor::sleep(timeout).await;
            return Err(TransportError::ConnectTimeout(addr));
        }
        crate::reactor::sleep(rtt).await;
        let Some(listener) = net.listeners.borrow().get(&addr).cloned() else {
            return Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused).into());
        };
        let now = clock::sim_now();
        let a = Rc::new(Pipe::default());
        let b = Rc::new(Pipe::default());
        let mine = Rc::new(SimConn {
            local,
            peer: addr,
            inbox: a.clone(),
            outbox: Rc::downgrade(&b),
            last_arrival: Cell::new(now),
            closed: Cell::new(false),
            lost: Cell::new(false),
            held: RefCell::default(),
            held_since: Cell::new(None),
            net: Rc::downgrade(&net),
        });
        let theirs = Rc::new(SimConn {
            local: addr,
            peer: local,
            inbox: b,
            outbox: Rc::downgrade(&a),
            last_arrival: Cell::new(now),
            closed: Cell::new(false),
            lost: Cell::new(false),
            held: RefCell::default(),
            held_since: Cell::new(None),
            net: Rc::downgrade(&net),
        });
        // The accepting side keeps the other pipe alive through its end.
        {
            let mut ends = net.ends.borrow_mut();
            ends.push(Rc::downgrade(&mine));
            ends.push(Rc::downgrade(&theirs));
        }
        listener.backlog.borrow_mut().push_back(theirs);
        if let Some(w) = listener.waker.borrow_mut().take() {
            w.wake();
        }
        Ok(mine)
    }

    /// Queues `msg`: it arrives after a latency, after everything sent before it.
    pub fn send(&self, msg: &Message) -> Result<(), TransportError> {
        self.send_raw(msg.encode())
    }

    /// Queues raw bytes (a refusal in another version's format).
    pub fn send_raw(&self, bytes: Vec<u8>) -> Result<(), TransportError> {
        if self.closed.get() {
            return Err(TransportError::Closed);
        }
        let Some(net) = self.net.upgrade() else {
            return Err(TransportError::Closed);
        };
        if self.holds(&net) {
            self.hold(Cargo::Frame(bytes));
            return Ok(());
        }
        match net.fault(self.local.ip(), self.peer.ip()) {
            Some(LinkFault::BlackHole) => {
                self.lost.set(true);
                return Ok(());
            }
            Some(LinkFault::Reject) => {
                self.shut();
                return Err(std::io::Error::from(std::io::ErrorKind::ConnectionReset).into());
            }
            None => {}
        }
        net.post(
            &self.last_arrival,
            Delivery {
                to: self.outbox.clone(),
                cargo: Cargo::Frame(bytes),
                from: self.local,
                dest: self.peer,
            },
        );
        Ok(())
    }

    /// Receives the next message (one receiver at a time).
    pub async fn recv(&self) -> Result<Message, TransportError> {
        poll_fn(|cx| {
            if self.closed.get() {
                return Poll::Ready(Err(TransportError::Closed));
            }
            if let Some(frame) = self.inbox.frames.borrow_mut().pop_front() {
                return Poll::Ready(decode(&frame));
            }
            if self.inbox.closed.get() {
                self.closed.set(true);
                return Poll::Ready(Err(TransportError::Closed));
            }
            *self.inbox.waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// Closes this end: receives fail; the peer's end closes once what was sent
    /// before has arrived.
    pub fn close(&self) {
        self.shut();
    }

    /// Closes after what was queued has been sent — here at once, since a send
    /// is on the wire as soon as it is queued.
    pub fn close_after_send(&self) {
        self.shut();
    }

    fn shut(&self) {
        if self.closed.replace(true) {
            return;
        }
        self.inbox.wake();
        if let Some(net) = self.net.upgrade() {
            if self.holds(&net) {
                self.hold(Cargo::End);
                return;
            }
            net.post(
                &self.last_arrival,
                Delivery {
                    to: self.outbox.clone(),
                    cargo: Cargo::End,
                    from: self.local,
                    dest: self.peer,
                },
            );
        }
    }

    /// Keeps `cargo` until the path heals, noting when the first was held.
    fn hold(&self, cargo: Cargo) {
        let mut held = self.held.borrow_mut();
        if held.is_empty() {
            self.held_since.set(Some(clock::sim_now()));
        }
        held.push(cargo);
    }

    /// Whether what this end sends now is held (`Net::hold`): its path is a
    /// black hole, or what it sent before is still held (order is kept).
    fn holds(&self, net: &Net) -> bool {
        net.hold.get()
            && (net.fault(self.local.ip(), self.peer.ip()) == Some(LinkFault::BlackHole)
                || !self.held.borrow().is_empty())
    }

    /// Whether this end is closed (or the peer's end arrived).
    pub fn is_closed(&self) -> bool {
        self.closed.get() || (self.inbox.closed.get() && self.inbox.frames.borrow().is_empty())
    }

    /// The peer's address.
    pub fn peer(&self) -> SocketAddr {
        self.peer
    }
}

impl Drop for SimConn {
    fn drop(&mut self) {
        self.shut();
        let held = std::mem::take(&mut *self.held.borrow_mut());
        if !held.is_empty()
            && let Some(net) = self.net.upgrade()
        {
            net.orphans.borrow_mut().push(Orphan {
                from: self.local,
                to: self.peer,
                inbox: self.outbox.clone(),
                held,
                held_since: self.held_since.get().unwrap_or_else(clock::sim_now),
            });
        }
    }
}

fn decode(frame: &[u8]) -> Result<Message, TransportError> {
    match Message::decode(frame)? {
        Some((msg, used)) if used == frame.len() => Ok(msg),
        _ => Err(TransportError::Protocol(ProtocolError::Inconsistent(
            "a simulated frame is not exactly one message",
        ))),
    }
}

/// A bound simulated address. Holds no reference into the network (so that it is
/// `Send` like the other listeners): it finds its state by address and bind id.
pub struct SimListener {
    addr: SocketAddr,
    id: u64,
}

impl SimListener {
    /// Binds `addr` (refused while another listener holds it).
    pub fn bind(addr: SocketAddr) -> Result<SimListener, TransportError> {
        let net = net()?;
        let mut listeners = net.listeners.borrow_mut();
        if listeners.contains_key(&addr) {
            return Err(std::io::Error::from(std::io::ErrorKind::AddrInUse).into());
        }
        let id = net.seq.get();
        net.seq.set(id + 1);
        listeners.insert(
            addr,
            Rc::new(ListenerState {
                id,
                backlog: RefCell::default(),
                waker: RefCell::default(),
            }),
        );
        Ok(SimListener { addr, id })
    }

    fn state(&self) -> Option<Rc<ListenerState>> {
        let net = net().ok()?;
        let listeners = net.listeners.borrow();
        listeners
            .get(&self.addr)
            .filter(|s| s.id == self.id)
            .cloned()
    }

    /// The next connection. Fails once the address is gone (its process crashed).
    pub async fn accept(&self) -> Result<Rc<SimConn>, TransportError> {
        poll_fn(|cx| {
            let Some(state) = self.state() else {
                return Poll::Ready(Err(TransportError::Closed));
            };
            if let Some(c) = state.backlog.borrow_mut().pop_front() {
                return Poll::Ready(Ok(c));
            }
            *state.waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for SimListener {
    fn drop(&mut self) {
        if let Ok(net) = net() {
            let mut listeners = net.listeners.borrow_mut();
            if listeners.get(&self.addr).is_some_and(|s| s.id == self.id) {
                listeners.remove(&self.addr);
            }
        }
    }
}

/// What grants answer on the simulated transport.
pub(crate) fn no_one_sided() -> TransportError {
    TransportError::Grant("the simulated transport has no one-sided access".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Message;
    use crate::reactor::{Reactor, spawn};

    fn ping(id: u64) -> Message {
        Message::Ping {
            id: crate::ids::RequestId(id),
            epoch: crate::ids::Epoch(1),
        }
    }

    /// Runs two simulated processes until both are idle and nothing is on the
    /// wire, advancing the virtual clock; returns the virtual time taken.
    fn run(reactors: &mut [(&mut Reactor, IpAddr)]) -> Duration {
        let t0 = clock::now();
        for _ in 0..10_000 {
            let mut ran = 0;
            for (r, ip) in reactors.iter_mut() {
                set_current_node(Some(*ip));
                ran += r.run_ready(1000).unwrap();
            }
            ran += deliver_due();
            if ran > 0 {
                continue;
            }
            let next = reactors
                .iter()
                .filter_map(|(r, _)| r.next_timer())
                .chain(next_delivery())
                .min();
            match next {
                Some(t) => clock::advance_to(t),
                None => return clock::now() - t0,
            }
        }
        panic!("did not settle");
    }

    fn sim_thread(f: impl FnOnce() + Send + 'static) {
        std::thread::spawn(move || {
            clock::simulated();
            install(NetConfig {
                seed: 7,
                latency_us_min: 50,
                latency_us_max: 500,
            });
            f();
            uninstall();
            clock::real();
        })
        .join()
        .unwrap();
    }

    const A: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 2));
    const B: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(127, 0, 0, 3));

    /// Messages arrive whole and in order despite random latencies; a crash ends
    /// the peer's connection after what was sent before it; the trace hash is
    /// the same for the same seed.
    #[test]
    fn in_order_delivery_crash_reset_and_a_repeatable_trace() {
        let mut hashes = Vec::new();
        for _ in 0..2 {
            let (tx, rx) = std::sync::mpsc::channel();
            sim_thread(move || {
                let mut a = Reactor::new_simulated().unwrap();
                let mut b = Reactor::new_simulated().unwrap();
                let addr = SocketAddr::new(B, 7000);
                let got = Rc::new(RefCell::new(Vec::new()));
                let g = got.clone();
                let l = b.enter(|| SimListener::bind(addr)).unwrap();
                b.enter(|| {
                    spawn(async move {
                        let c = l.accept().await.unwrap();
                        loop {
                            match c.recv().await {
                                Ok(m) => g.borrow_mut().push(m.id().0),
                                Err(TransportError::Closed) => {
                                    g.borrow_mut().push(u64::MAX);
                                    return;
                                }
                                Err(e) => panic!("{e}"),
                            }
                        }
                    })
                    .detach()
                });
                set_current_node(Some(A));
                a.enter(|| {
                    spawn(async move {
                        let c = SimConn::connect(addr, Duration::from_secs(1))
                            .await
                            .unwrap();
                        for i in 0..100 {
                            c.send(&ping(i)).unwrap();
                        }
                        std::future::pending::<()>().await;
                        drop(c);
                    })
                    .detach()
                });
                let took = run(&mut [(&mut a, A), (&mut b, B)]);
                assert!(took < Duration::from_millis(50), "{took:?}");
                assert_eq!(*got.borrow(), (0..100).collect::<Vec<_>>());
                crash(A);
                run(&mut [(&mut a, A), (&mut b, B)]);
                assert_eq!(got.borrow().last(), Some(&u64::MAX), "the crash reset it");
                tx.send(trace_hash()).unwrap();
            });
            hashes.push(rx.recv().unwrap());
        }
        assert_eq!(hashes[0], hashes[1]);
        assert!(hashes[0].1 >= 101);
    }

    /// A rejected path refuses connects; a black hole makes them time out after
    /// the caller's timeout and swallows sends on an existing connection.
    #[test]
    fn rejected_and_black_holed_paths() {
        sim_thread(|| {
            let mut a = Reactor::new_simulated().unwrap();
            let mut b = Reactor::new_simulated().unwrap();
            let addr = SocketAddr::new(B, 7000);
            let l = b.enter(|| SimListener::bind(addr)).unwrap();
            let got = Rc::new(Cell::new(0u32));
            let g = got.clone();
            b.enter(|| {
                spawn(async move {
                    let c = l.accept().await.unwrap();
                    while c.recv().await.is_ok() {
                        g.set(g.get() + 1);
                    }
                })
                .detach()
            });
            let out = Rc::new(RefCell::new(Vec::new()));
            let o = out.clone();
            set_fault(A, B, Some(LinkFault::Reject));
            a.enter(|| {
                spawn(async move {
                    let r = SimConn::connect(addr, Duration::from_secs(1)).await;
                    o.borrow_mut()
                        .push(format!("{:?}", r.err().map(|e| e.to_string())));
                    set_fault(A, B, Some(LinkFault::BlackHole));
                    let t = clock::now();
                    let r = SimConn::connect(addr, Duration::from_secs(2)).await;
                    assert!(matches!(r, Err(TransportError::ConnectTimeout(_))));
                    o.borrow_mut()
                        .push(format!("{}", clock::elapsed(t).as_secs()));
                    set_fault(A, B, None);
                    let c = SimConn::connect(addr, Duration::from_secs(1))
                        .await
                        .unwrap();
                    c.send(&ping(1)).unwrap();
                    crate::reactor::sleep(Duration::from_millis(10)).await;
                    set_fault(A, B, Some(LinkFault::BlackHole));
                    c.send(&ping(2)).unwrap(); // vanishes
                    crate::reactor::sleep(Duration::from_millis(10)).await;
                    set_fault(A, B, Some(LinkFault::Reject));
                    assert!(c.send(&ping(3)).is_err(), "reset");
                    assert!(c.is_closed());
                })
                .detach()
            });
            run(&mut [(&mut a, A), (&mut b, B)]);
            let out = out.borrow();
            assert!(out[0].contains("refused"), "{out:?}");
            assert_eq!(out[1], "2");
            assert_eq!(got.get(), 1, "only the message sent before the black hole");
        });
    }

    /// A holding black hole delivers what it held once the path heals, in order
    /// and before anything sent later — also what was sent on a connection its
    /// sender has dropped meanwhile (an orphaned socket's data, then its end);
    /// a power-off loses it.
    #[test]
    fn a_holding_black_hole_delivers_after_the_heal_even_for_a_dropped_end() {
        for power in [false, true] {
            sim_thread(move || {
                set_hold_black_holes(true);
                let mut a = Reactor::new_simulated().unwrap();
                let mut b = Reactor::new_simulated().unwrap();
                let addr = SocketAddr::new(B, 7000);
                let l = b.enter(|| SimListener::bind(addr)).unwrap();
                let got = Rc::new(RefCell::new(Vec::new()));
                let g = got.clone();
                b.enter(|| {
                    spawn(async move {
                        loop {
                            let c = l.accept().await.unwrap();
                            let g = g.clone();
                            spawn(async move {
                                while let Ok(m) = c.recv().await {
                                    g.borrow_mut().push(m.id().0);
                                }
                                g.borrow_mut().push(u64::MAX);
                            })
                            .detach();
                        }
                    })
                    .detach()
                });
                set_current_node(Some(A));
                a.enter(|| {
                    spawn(async move {
                        let c = SimConn::connect(addr, Duration::from_secs(1))
                            .await
                            .unwrap();
                        c.send(&ping(1)).unwrap();
                        crate::reactor::sleep(Duration::from_millis(10)).await;
                        set_fault(A, B, Some(LinkFault::BlackHole));
                        c.send(&ping(2)).unwrap();
                        c.send(&ping(3)).unwrap();
                        // The client gives up on this connection.
                        drop(c);
                    })
                    .detach()
                });
                run(&mut [(&mut a, A), (&mut b, B)]);
                assert_eq!(*got.borrow(), vec![1], "nothing crosses the hole");
                if power {
                    power_off(A);
                }
                set_fault(A, B, None);
                let took = run(&mut [(&mut a, A), (&mut b, B)]);
                if power {
                    assert_eq!(*got.borrow(), vec![1], "lost with the power");
                } else {
                    assert_eq!(
                        *got.borrow(),
                        vec![1, 2, 3, u64::MAX],
                        "held, then delivered in order with the end"
                    );
                    assert!(took <= Duration::from_millis(4_500), "{took:?}");
                }
            });
        }
    }
}
