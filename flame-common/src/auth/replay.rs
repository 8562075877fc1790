//! Refusing replayed and stale signed requests.

use super::{EntityName, Nonce, Role};
use std::collections::{BTreeSet, HashMap};

/// How far a request's time may be from the manager's clock, either way. Clocks of
/// a cluster's hosts must agree within this (NTP keeps them within milliseconds);
/// a captured request can be replayed at most this long, and the guard below
/// refuses even that.
pub const REPLAY_WINDOW_MS: u64 = 60_000;
/// Most requests remembered at once: `2 × REPLAY_WINDOW_MS` of requests at ~2 000
/// per second, about 10 MiB. Only signed (verified) requests are remembered, so
/// only a key holder can fill it; a full guard refuses new requests (the caller
/// retries) rather than forgetting one that could then be replayed.
pub const REPLAY_ENTRIES_MAX: usize = 262_144;

/// Why a request's time or nonce was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayRefusal {
    /// Older than the window: replayed, or the sender's clock is behind.
    Stale {
        /// How far behind, in milliseconds.
        behind_ms: u64,
    },
    /// Newer than the window: the sender's clock is ahead.
    Future {
        /// How far ahead, in milliseconds.
        ahead_ms: u64,
    },
    /// The same time and nonce were seen already.
    Replayed,
    /// The guard holds [`REPLAY_ENTRIES_MAX`] requests.
    Full,
}

impl std::fmt::Display for ReplayRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReplayRefusal::Stale { behind_ms } => write!(
                f,
                "request time is {behind_ms} ms behind the manager's clock (more than \
                 {REPLAY_WINDOW_MS} ms): a replayed request, or this host's clock is wrong"
            ),
            ReplayRefusal::Future { ahead_ms } => write!(
                f,
                "request time is {ahead_ms} ms ahead of the manager's clock (more than \
                 {REPLAY_WINDOW_MS} ms): this host's clock is wrong"
            ),
            ReplayRefusal::Replayed => f.write_str("request replayed (its nonce was seen)"),
            ReplayRefusal::Full => f.write_str("too many requests in the replay window; retry"),
        }
    }
}

/// The signed requests of the last window, by (time, nonce). Pure: the caller
/// gives the time, so tests drive it directly.
#[derive(Debug)]
pub struct ReplayGuard {
    /// Ordered by time first, so expiry pops from the front.
    seen: BTreeSet<(u64, Nonce)>,
    /// Most entries held ([`ReplayRefusal::Full`] beyond).
    entries_max: usize,
}

impl Default for ReplayGuard {
    fn default() -> ReplayGuard {
        ReplayGuard::with_capacity(REPLAY_ENTRIES_MAX)
    }
}

impl ReplayGuard {
    /// An empty guard of [`REPLAY_ENTRIES_MAX`] entries (the manager's).
    pub fn new() -> ReplayGuard {
        ReplayGuard::default()
    }

    /// An empty guard of at most `entries_max` entries (an OSD shard's, which
    /// sees connections, not requests).
    pub fn with_capacity(entries_max: usize) -> ReplayGuard {
        ReplayGuard {
            seen: BTreeSet::new(),
            entries_max,
        }
    }

    /// Forgets the entries older than the window around `now_ms`.
    pub fn expire(&mut self, now_ms: u64) {
        let oldest_ms = now_ms.saturating_sub(REPLAY_WINDOW_MS);
        // Bounded by the set's size; each entry is removed once.
        while let Some(&(t, _)) = self.seen.first() {
            if t >= oldest_ms {
                break;
            }
            self.seen.pop_first();
        }
    }

    /// Accepts a request signed at `time_ms` with `nonce` if it is within the
    /// window around `now_ms` and new, and remembers it.
    pub fn check(&mut self, now_ms: u64, time_ms: u64, nonce: Nonce) -> Result<(), ReplayRefusal> {
        self.expire(now_ms);
        let oldest_ms = now_ms.saturating_sub(REPLAY_WINDOW_MS);
        if time_ms < oldest_ms {
            return Err(ReplayRefusal::Stale {
                behind_ms: now_ms - time_ms,
            });
        }
        if time_ms > now_ms.saturating_add(REPLAY_WINDOW_MS) {
            return Err(ReplayRefusal::Future {
                ahead_ms: time_ms - now_ms,
            });
        }
        if self.seen.contains(&(time_ms, nonce)) {
            return Err(ReplayRefusal::Replayed);
        }
        if self.seen.len() >= self.entries_max {
            return Err(ReplayRefusal::Full);
        }
        self.seen.insert((time_ms, nonce));
        debug_assert!(self.seen.len() <= self.entries_max);
        Ok(())
    }

    /// Requests remembered.
    pub fn len(&self) -> usize {
        self.seen.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }
}

/// How much of a replay window one role's entities may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShareLimits {
    /// Entries one entity may hold (beyond: [`ReplayRefusal::Full`] for it
    /// alone).
    pub entity_entries_max: usize,
    /// Entries all the role's entities together may hold.
    pub share_entries_max: usize,
}

/// Guards whose number triggers a sweep of the empty ones (entities removed
/// from the table leave theirs behind until then).
const GUARDS_SWEEP_AT: usize = 8192;

/// Replay guards per entity, in one share per role: an entity that signs
/// requests as fast as it can fills its own guard (and at most its role's
/// share), never another role's — so no client key can make the manager
/// refuse the OSDs' heartbeats, or an OSD shard refuse its peers' HELLOs.
/// Only requests whose signature and role already checked reach it. Pure:
/// the caller gives the time.
#[derive(Debug)]
pub struct ReplayShares {
    guards: HashMap<EntityName, (Role, ReplayGuard)>,
    /// Entries held per role (`Role::index`).
    held: [usize; 3],
    limits: fn(Role) -> ShareLimits,
    /// When every guard was last expired (entities that went quiet hold
    /// entries only their own next request would expire otherwise).
    swept_ms: u64,
}

/// How often a full share is swept before it refuses (a full share swept on
/// every request would cost a pass over every guard per request).
const FULL_SWEEP_INTERVAL_MS: u64 = 1_000;

fn role_index(role: Role) -> usize {
    match role {
        Role::Client => 0,
        Role::Osd => 1,
        Role::Admin => 2,
    }
}

impl ReplayShares {
    /// Empty guards, each role's bounded by `limits`.
    pub fn new(limits: fn(Role) -> ShareLimits) -> ReplayShares {
        ReplayShares {
            guards: HashMap::new(),
            held: [0; 3],
            limits,
            swept_ms: 0,
        }
    }

    /// Accepts a request of `entity` (of `role`) signed at `time_ms` with
    /// `nonce` if it is within the window around `now_ms`, new for that
    /// entity, and both the entity and its role have room; remembers it.
    pub fn check(
        &mut self,
        entity: &EntityName,
        role: Role,
        now_ms: u64,
        time_ms: u64,
        nonce: Nonce,
    ) -> Result<(), ReplayRefusal> {
        // Every window, and when a new entity would pass the bound: what
        // quiet entities hold expires even if they never ask again.
        if now_ms.saturating_sub(self.swept_ms) >= REPLAY_WINDOW_MS
            || (self.guards.len() >= GUARDS_SWEEP_AT && !self.guards.contains_key(entity))
        {
            self.sweep(now_ms);
        }
        let limits = (self.limits)(role);
        // A full share may be full of expired entries of quiet entities:
        // look (at most once a second) before refusing.
        if self.held[role_index(role)] >= limits.share_entries_max
            && now_ms.saturating_sub(self.swept_ms) >= FULL_SWEEP_INTERVAL_MS
        {
            self.sweep(now_ms);
        }
        let (guard_role, guard) = self
            .guards
            .entry(entity.clone())
            .or_insert_with(|| (role, ReplayGuard::with_capacity(limits.entity_entries_max)));
        if *guard_role != role {
            // The entity was removed and added again with another role: its
            // entries move to the new role's share.
            self.held[role_index(*guard_role)] -= guard.len();
            self.held[role_index(role)] += guard.len();
            *guard_role = role;
            guard.entries_max = limits.entity_entries_max;
        }
        let before = guard.len();
        guard.expire(now_ms);
        let held = &mut self.held[role_index(role)];
        *held -= before - guard.len();
        if *held >= limits.share_entries_max {
            return Err(ReplayRefusal::Full);
        }
        guard.check(now_ms, time_ms, nonce)?;
        *held += 1;
        debug_assert_eq!(
            self.held.iter().sum::<usize>(),
            self.guards.values().map(|(_, g)| g.len()).sum::<usize>()
        );
        Ok(())
    }

    /// Entries the role's entities hold.
    pub fn held(&self, role: Role) -> usize {
        self.held[role_index(role)]
    }

    /// Entities with a guard.
    pub fn entities(&self) -> usize {
        self.guards.len()
    }

    /// Expires every guard and drops the empty ones.
    fn sweep(&mut self, now_ms: u64) {
        self.swept_ms = now_ms;
        let held = &mut self.held;
        self.guards.retain(|_, (role, g)| {
            let before = g.len();
            g.expire(now_ms);
            held[role_index(*role)] -= before - g.len();
            !g.is_empty()
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(i: u8) -> Nonce {
        Nonce([i; 16])
    }

    #[test]
    fn every_branch() {
        let mut g = ReplayGuard::new();
        let now = 1_000_000;
        assert_eq!(g.check(now, now, n(1)), Ok(()));
        assert_eq!(g.check(now, now, n(1)), Err(ReplayRefusal::Replayed));
        // Same nonce at another time is another request (the time is signed).
        assert_eq!(g.check(now, now + 1, n(1)), Ok(()));
        assert_eq!(
            g.check(now, now - REPLAY_WINDOW_MS - 1, n(2)),
            Err(ReplayRefusal::Stale {
                behind_ms: REPLAY_WINDOW_MS + 1
            })
        );
        assert_eq!(g.check(now, now - REPLAY_WINDOW_MS, n(2)), Ok(()));
        assert_eq!(
            g.check(now, now + REPLAY_WINDOW_MS + 1, n(3)),
            Err(ReplayRefusal::Future {
                ahead_ms: REPLAY_WINDOW_MS + 1
            })
        );
        assert_eq!(g.check(now, now + REPLAY_WINDOW_MS, n(3)), Ok(()));
        assert_eq!(g.len(), 4);
        // Later, the old entries expire, and a replay of them is stale, not new.
        let later = now + REPLAY_WINDOW_MS + 2;
        assert!(matches!(
            g.check(later, now, n(1)),
            Err(ReplayRefusal::Stale { .. })
        ));
        assert_eq!(g.len(), 1, "only the one from the future is left");
        // A clock before the window's size does not underflow.
        assert_eq!(ReplayGuard::new().check(5, 0, n(9)), Ok(()));
    }

    #[test]
    fn full_refuses_rather_than_forgets() {
        let mut g = ReplayGuard::new();
        let now = 10 * REPLAY_WINDOW_MS;
        for i in 0..REPLAY_ENTRIES_MAX as u64 {
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&i.to_le_bytes());
            assert_eq!(g.check(now, now, Nonce(b)), Ok(()));
        }
        assert_eq!(g.check(now, now, n(0xee)), Err(ReplayRefusal::Full));
        // Once the window moves on, there is room again.
        assert_eq!(
            g.check(
                now + REPLAY_WINDOW_MS + 1,
                now + REPLAY_WINDOW_MS + 1,
                n(0xee)
            ),
            Ok(())
        );
        assert_eq!(g.len(), 1);
    }
}

#[cfg(test)]
mod share_tests {
    use super::*;

    fn limits(role: Role) -> ShareLimits {
        match role {
            Role::Osd => ShareLimits {
                entity_entries_max: 8,
                share_entries_max: 16,
            },
            _ => ShareLimits {
                entity_entries_max: 3,
                share_entries_max: 5,
            },
        }
    }

    fn nonce(i: u32) -> Nonce {
        let mut b = [0u8; 16];
        b[..4].copy_from_slice(&i.to_le_bytes());
        Nonce(b)
    }

    fn e(name: &str) -> EntityName {
        EntityName::parse(name).unwrap()
    }

    #[test]
    fn a_flooding_client_fills_its_own_guard_and_no_one_elses() {
        let mut s = ReplayShares::new(limits);
        let now = 10 * REPLAY_WINDOW_MS;
        let (a, b, osd) = (e("client.a"), e("client.b"), e("osd.1"));
        for i in 0..3 {
            assert_eq!(s.check(&a, Role::Client, now, now, nonce(i)), Ok(()));
        }
        // Its own bound first.
        assert_eq!(
            s.check(&a, Role::Client, now, now, nonce(3)),
            Err(ReplayRefusal::Full)
        );
        // Another client still gets in, up to the clients' share.
        assert_eq!(s.check(&b, Role::Client, now, now, nonce(0)), Ok(()));
        assert_eq!(s.check(&b, Role::Client, now, now, nonce(1)), Ok(()));
        assert_eq!(
            s.check(&b, Role::Client, now, now, nonce(2)),
            Err(ReplayRefusal::Full),
            "the clients' share is full"
        );
        // The OSDs' share is untouched.
        for i in 0..8 {
            assert_eq!(s.check(&osd, Role::Osd, now, now, nonce(i)), Ok(()));
        }
        assert_eq!((s.held(Role::Client), s.held(Role::Osd)), (5, 8));
        // A nonce is per entity: the same one from another entity is new.
        assert_eq!(s.check(&e("osd.2"), Role::Osd, now, now, nonce(0)), Ok(()));
        assert_eq!(
            s.check(&osd, Role::Osd, now, now, nonce(0)),
            Err(ReplayRefusal::Replayed)
        );
        // The window moves on: everything expires and there is room again.
        let later = now + 2 * REPLAY_WINDOW_MS + 1;
        assert_eq!(s.check(&a, Role::Client, later, later, nonce(9)), Ok(()));
        assert_eq!(s.check(&b, Role::Client, later, later, nonce(9)), Ok(()));
        assert_eq!(s.held(Role::Client), 2);
    }

    /// Entities that fill their role's share and go quiet do not hold it
    /// after the window: a newcomer gets in without them asking again.
    #[test]
    fn a_share_filled_by_quiet_entities_frees_itself() {
        let mut s = ReplayShares::new(limits);
        let now = 10 * REPLAY_WINDOW_MS;
        let (a, b, c) = (e("client.a"), e("client.b"), e("client.c"));
        for i in 0..3 {
            s.check(&a, Role::Client, now, now, nonce(i)).unwrap();
        }
        for i in 0..2 {
            s.check(&b, Role::Client, now, now, nonce(i)).unwrap();
        }
        assert_eq!(
            s.check(&c, Role::Client, now + 10, now + 10, nonce(0)),
            Err(ReplayRefusal::Full)
        );
        // a and b never ask again; once their entries are out of the window,
        // c gets in (the full share is swept before refusing).
        let later = now + REPLAY_WINDOW_MS + 1;
        assert_eq!(s.check(&c, Role::Client, later, later, nonce(1)), Ok(()));
        assert_eq!(s.held(Role::Client), 1);
        assert_eq!(s.entities(), 1, "the quiet entities' guards are gone");
    }

    #[test]
    fn a_role_change_moves_the_entries_and_sweeps_drop_empty_guards() {
        let mut s = ReplayShares::new(limits);
        let now = 10 * REPLAY_WINDOW_MS;
        let x = e("client.x");
        assert_eq!(s.check(&x, Role::Client, now, now, nonce(1)), Ok(()));
        assert_eq!(s.check(&x, Role::Admin, now, now, nonce(2)), Ok(()));
        assert_eq!(s.held(Role::Client), 0);
        assert_eq!(s.held(Role::Admin), 2);
        s.sweep(now + 2 * REPLAY_WINDOW_MS + 1);
        assert_eq!(s.entities(), 0);
        assert_eq!(s.held(Role::Admin), 0);
    }
}
