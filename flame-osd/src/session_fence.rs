//! Which client connections of a shard may still execute requests: the
//! newest connection of each session, of the newest incarnation of each
//! lineage (`flame_common::lineage`). Pure state, no I/O: the connection loops
//! (`crate::connection`, `crate::staged`) ask it at each HELLO and before each
//! request.
//!
//! Two rules, both about requests a client can no longer stand behind:
//! * a session that reconnected leaves its older connections behind: what
//!   still arrives on them may have been resent on the new one, and must not
//!   overtake (then overwrite) the resend;
//! * a lineage whose newer incarnation connected leaves its older
//!   incarnations behind: a crashed client's writes still on the wire must not
//!   land over what its successor wrote (simulator seed 200188).

use flame_common::collections::HashMap;
use flame_common::lineage;
use std::cell::Cell;
use std::rc::Rc;

/// Sessions (and lineages) one shard remembers beyond those with a live
/// connection.
const REMEMBERED_MAX: usize = 65_536;

/// A session as a shard keys it: the id the client chose, scoped to the
/// entity that said it by the same function that scopes its op ids
/// ([`flame_common::auth::scoped_op_session`]; the id as sent without
/// authentication). Session ids travel in clear in HELLO, so keyed by id
/// alone, anyone holding *some* valid ticket could fence another client's
/// connections by claiming its id with a higher generation; scoped, a claim only
/// ever reaches the claimer's own sessions. Computed once per HELLO; `Copy`, so
/// the staged mode's per-request check costs two lookups and no allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SessionKey {
    /// Whether `scoped` is an entity's (never equal to an unauthenticated id).
    authenticated: bool,
    scoped: u64,
    id: u64,
}

impl SessionKey {
    /// The session `id` of the connection `who` authenticated as (`None`:
    /// without authentication).
    pub fn new(who: Option<&flame_common::auth::handshake::Authenticated>, id: u64) -> SessionKey {
        SessionKey {
            authenticated: who.is_some(),
            scoped: who.map_or(id, |w| flame_common::auth::scoped_op_session(&w.entity, id)),
            id,
        }
    }

    /// The id the client chose (for logs).
    pub fn id(&self) -> u64 {
        self.id
    }
}

/// Who a HELLO says is connecting, keyed as a shard keeps it: its session,
/// its lineage (both scoped to the entity that said them) and its connection
/// generation. Computed once per HELLO; `Copy`, so the staged mode's
/// per-request check costs two lookups and no allocation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloIdentity {
    session: SessionKey,
    lineage: SessionKey,
    generation: u64,
}

impl HelloIdentity {
    /// The identity of a HELLO of `session` and `generation` said by `who`
    /// (`None`: without authentication).
    pub fn new(
        who: Option<&flame_common::auth::handshake::Authenticated>,
        session: u64,
        generation: u64,
    ) -> HelloIdentity {
        HelloIdentity {
            session: SessionKey::new(who, session),
            lineage: SessionKey::new(who, lineage::lineage_of(session)),
            generation,
        }
    }

    /// The session id the client chose (for logs).
    pub fn session_id(&self) -> u64 {
        self.session.id()
    }

    /// The connection generation (for logs).
    pub fn generation(&self) -> u64 {
        self.generation
    }
}

/// A connection's place in its session and lineage: it may execute requests
/// only while its generation is its session's newest and its incarnation its
/// lineage's newest.
pub struct Fence {
    current: Rc<Cell<u64>>,
    generation: u64,
    newest_incarnation: Rc<Cell<u64>>,
    incarnation: u64,
}

impl Fence {
    /// Whether the connection is still its session's newest, of its lineage's
    /// newest incarnation.
    pub fn holds(&self) -> bool {
        self.current.get() == self.generation && self.newest_incarnation.get() == self.incarnation
    }
}

/// Why a HELLO was refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Superseded {
    /// Its session already has a newer connection.
    Connection,
    /// Its lineage already has a newer incarnation.
    Incarnation,
}

/// The sessions and lineages of one shard.
#[derive(Default)]
pub struct SessionFences {
    sessions: HashMap<SessionKey, Rc<Cell<u64>>>,
    lineages: HashMap<SessionKey, Rc<Cell<u64>>>,
}

impl SessionFences {
    /// Records `hello`; the connection's fence, or why it is refused (the
    /// HELLO is itself stale).
    pub fn register(&mut self, hello: HelloIdentity) -> Result<Fence, Superseded> {
        let HelloIdentity {
            session,
            lineage: lineage_key,
            generation,
        } = hello;
        let incarnation = lineage::incarnation_of(generation);
        for map in [&mut self.sessions, &mut self.lineages] {
            if map.len() >= REMEMBERED_MAX {
                // Forget entries without a live connection (only their
                // fences hold a second reference).
                map.retain(|_, c| Rc::strong_count(c) > 1);
            }
        }
        let newest_incarnation = self
            .lineages
            .entry(lineage_key)
            .or_insert_with(|| Rc::new(Cell::new(0)))
            .clone();
        if incarnation < newest_incarnation.get() {
            return Err(Superseded::Incarnation);
        }
        let current = self
            .sessions
            .entry(session)
            .or_insert_with(|| Rc::new(Cell::new(0)))
            .clone();
        if generation < current.get() {
            return Err(Superseded::Connection);
        }
        newest_incarnation.set(incarnation);
        current.set(generation);
        Ok(Fence {
            current,
            generation,
            newest_incarnation,
            incarnation,
        })
    }

    /// Whether the connection `hello` opened may execute a request (the
    /// staged mode's check; a forgotten session or lineage does not: refusing
    /// is the safe side, the client reconnects).
    pub fn holds(&self, hello: &HelloIdentity) -> bool {
        self.sessions.get(&hello.session).map(|c| c.get()) == Some(hello.generation)
            && self.lineages.get(&hello.lineage).map(|c| c.get())
                == Some(lineage::incarnation_of(hello.generation))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::lineage::{generation, session};

    use flame_common::auth::handshake::Authenticated;
    use flame_common::auth::{EntityName, Role};

    fn who(name: &str) -> Authenticated {
        Authenticated {
            entity: EntityName::parse(name).unwrap(),
            role: Role::Client,
        }
    }

    #[test]
    fn a_session_is_keyed_by_its_entity_and_its_id() {
        let a = who("client.a");
        let b = who("client.b");
        assert_eq!(SessionKey::new(Some(&a), 7), SessionKey::new(Some(&a), 7));
        assert_ne!(SessionKey::new(Some(&a), 7), SessionKey::new(Some(&b), 7));
        assert_ne!(SessionKey::new(Some(&a), 7), SessionKey::new(Some(&a), 8));
        // Without authentication, one namespace.
        assert_eq!(SessionKey::new(None, 7), SessionKey::new(None, 7));
        assert_ne!(SessionKey::new(None, 7), SessionKey::new(Some(&a), 7));
        assert_eq!(SessionKey::new(Some(&b), 9).id(), 9);
    }

    fn id(s: u64, g: u64) -> HelloIdentity {
        HelloIdentity::new(None, s, g)
    }

    #[test]
    fn a_reconnection_fences_the_older_connection_of_its_session() {
        let mut f = SessionFences::default();
        let s = session(5, 1);
        let old = f.register(id(s, generation(100, 1))).unwrap();
        assert!(old.holds());
        let new = f.register(id(s, generation(100, 2))).unwrap();
        assert!(!old.holds() && new.holds());
        assert!(!f.holds(&id(s, generation(100, 1))));
        assert!(f.holds(&id(s, generation(100, 2))));
        // The older connection's HELLO arriving late is refused.
        assert_eq!(
            f.register(id(s, generation(100, 1))).err(),
            Some(Superseded::Connection)
        );
    }

    #[test]
    fn threads_of_one_incarnation_do_not_fence_each_other() {
        let mut f = SessionFences::default();
        let a = f.register(id(session(5, 1), generation(100, 7))).unwrap();
        let b = f.register(id(session(5, 2), generation(100, 1))).unwrap();
        assert!(a.holds() && b.holds());
    }

    /// Simulator seed 200188: a crashed client's write still on the wire
    /// landed over its successor's acknowledged write.
    #[test]
    fn a_newer_incarnation_fences_every_thread_of_the_older_one() {
        let mut f = SessionFences::default();
        let t1 = f.register(id(session(5, 1), generation(100, 3))).unwrap();
        let t2 = f.register(id(session(5, 2), generation(100, 9))).unwrap();
        // The successor's first thread connects, with a lower connection count.
        let next = f.register(id(session(5, 1), generation(250, 1))).unwrap();
        assert!(next.holds());
        assert!(
            !t1.holds(),
            "the older incarnation's thread 1 still executes"
        );
        assert!(
            !t2.holds(),
            "the older incarnation's thread 2 still executes"
        );
        assert!(!f.holds(&id(session(5, 2), generation(100, 9))));
        // Its HELLOs still on the wire are refused.
        assert_eq!(
            f.register(id(session(5, 2), generation(100, 10))).err(),
            Some(Superseded::Incarnation)
        );
        // Another lineage is not touched.
        let other = f.register(id(session(6, 1), generation(100, 1))).unwrap();
        assert!(other.holds() && next.holds());
    }

    #[test]
    fn a_lineage_is_scoped_to_the_entity_that_says_it() {
        let a = who("client.a");
        let b = who("client.b");
        let mut f = SessionFences::default();
        let s = session(5, 1);
        let mine = f
            .register(HelloIdentity::new(Some(&a), s, generation(100, 1)))
            .unwrap();
        // Another key holder claiming the same lineage with a newer incarnation
        // fences only its own.
        f.register(HelloIdentity::new(Some(&b), s, generation(900, 1)))
            .unwrap();
        assert!(mine.holds());
    }

    #[test]
    fn the_tables_stay_bounded() {
        let mut f = SessionFences::default();
        let live = f.register(id(session(1, 1), generation(1, 1))).unwrap();
        for i in 0..(REMEMBERED_MAX as u64 + 10) {
            drop(f.register(id(session(i + 2, 1), generation(1, 1))));
        }
        assert!(f.sessions.len() <= REMEMBERED_MAX && f.lineages.len() <= REMEMBERED_MAX);
        assert!(live.holds());
    }
}
