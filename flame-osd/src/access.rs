//! What an admitted connection may ask, checked on every request before it is
//! executed (one place for both threading modes):
//! * replica-flagged requests only on a peer connection (from a client they would
//!   write one copy outside the primary's ordering gate) — EINVAL;
//! * with authentication: the group-internal requests (object lists, suspects,
//!   sums, object removal) only from OSDs, `DELETE_VOLUME` and `SCRUB` only from
//!   an admin or an OSD, and reads and writes only of the volumes the entity's
//!   ticket names (`flame_common::auth::VolumePatterns`) — EPERM. Anything
//!   else (PING, MAP_REQUEST: the map is what `GET /v1/map` gives every
//!   entity) is open to every authenticated entity.
//!
//! The volume check costs nothing for an entity allowed every volume (the
//! usual case) and one lookup in a per-connection cache otherwise (filled once
//! per volume and map epoch). Pure: the map is an argument.

use flame_common::auth::{EntityName, Role, VolumePatterns, scoped_op_session};
use flame_common::collections::HashMap;
use flame_common::ids::{Epoch, VolumeId};
use flame_common::map::ClusterMap;
use flame_common::protocol::{Message, flags, status};
use std::cell::RefCell;

/// Whether a request was forwarded by a primary (the [`flags::REPLICA`] bit): it is
/// applied locally and not forwarded again. Only peer connections may send such
/// requests (checked here, [`ConnAccess::check`]): from a client, it would bypass the
/// primary's ordering gate and write one copy only.
pub fn is_forwarded(msg: &Message) -> bool {
    match msg {
        Message::Write { flags: f, .. }
        | Message::WriteZeroes { flags: f, .. }
        | Message::Discard { flags: f, .. }
        | Message::Flush { flags: f, .. }
        | Message::RemoveObject { flags: f, .. }
        | Message::Read { flags: f, .. } => f & flags::REPLICA != 0,
        _ => false,
    }
}

/// Volumes remembered per connection (a client uses a handful).
const VOLUME_CACHE_ENTRIES_MAX: usize = 1024;

/// One connection's rights.
#[derive(Debug)]
pub struct ConnAccess {
    is_peer: bool,
    /// `None`: the OSD runs without authentication (no role is known).
    role: Option<Role>,
    /// The authenticated entity of a client connection, whose op ids are
    /// scoped to it ([`ConnAccess::scope_op`]); `None` for peers and without
    /// authentication.
    op_entity: Option<EntityName>,
    /// The last (session, scoped session) pair: a client connection uses one
    /// session, so the hash runs once per connection, not per write.
    op_scoped: std::cell::Cell<(u64, u64)>,
    volumes: VolumePatterns,
    /// `(epoch, volume) → allowed`, for restricted entities.
    cache: RefCell<(Epoch, HashMap<VolumeId, bool>)>,
}

/// Something that holds the current map (a shard's view, a loaded map).
pub trait MapRef {
    /// The map.
    fn map(&self) -> &ClusterMap;
}

impl MapRef for &ClusterMap {
    fn map(&self) -> &ClusterMap {
        self
    }
}

impl MapRef for std::rc::Rc<crate::pg::MapView> {
    fn map(&self) -> &ClusterMap {
        &self.map
    }
}

impl MapRef for arc_swap::Guard<std::sync::Arc<ClusterMap>> {
    fn map(&self) -> &ClusterMap {
        self
    }
}

/// Why a request was refused: the status to answer and what to log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The reply status.
    pub status: i32,
    /// Why.
    pub why: &'static str,
}

impl ConnAccess {
    /// The rights of a connection: a peer's or a client's, of `who` (`None`
    /// without authentication), limited to `volumes`.
    pub fn new(
        is_peer: bool,
        who: Option<&flame_common::auth::handshake::Authenticated>,
        volumes: VolumePatterns,
    ) -> ConnAccess {
        ConnAccess {
            is_peer,
            role: who.map(|w| w.role),
            op_entity: who.filter(|_| !is_peer).map(|w| w.entity.clone()),
            op_scoped: std::cell::Cell::new((0, 0)),
            volumes,
            cache: RefCell::new((Epoch(0), HashMap::default())),
        }
    }

    /// Whether this is a replication connection.
    pub fn is_peer(&self) -> bool {
        self.is_peer
    }

    /// Scopes the op id of a client's write to its entity
    /// ([`scoped_op_session`]), before anything records it: the group's log,
    /// replicas and retries then see the scoped session. Peers' requests carry
    /// ids a primary scoped already; without authentication ids stay as sent.
    pub fn scope_op(&self, msg: &mut Message) {
        let Some(entity) = &self.op_entity else {
            return;
        };
        let op = match msg {
            Message::Write { op, .. }
            | Message::WriteZeroes { op, .. }
            | Message::Discard { op, .. } => op,
            _ => return,
        };
        if op.is_none() {
            return;
        }
        let (raw, scoped) = self.op_scoped.get();
        op.session = if raw == op.session && scoped != 0 {
            scoped
        } else {
            let scoped = scoped_op_session(entity, op.session);
            self.op_scoped.set((op.session, scoped));
            scoped
        };
    }

    /// Checks `msg` against these rights; `map` gives the current map, and is
    /// called only when a volume must be looked up (a restricted entity), so
    /// the usual request costs no map access here.
    pub fn check<M: MapRef>(&self, msg: &Message, map: impl FnOnce() -> M) -> Result<(), Refusal> {
        if self.is_peer {
            return Ok(());
        }
        if is_forwarded(msg) {
            return Err(Refusal {
                status: status::EINVAL,
                why: "replica-flagged request on a client connection",
            });
        }
        let Some(role) = self.role else {
            return Ok(());
        };
        let perm = |why| {
            Err(Refusal {
                status: status::EPERM,
                why,
            })
        };
        let volume = match msg {
            Message::PgList { .. }
            | Message::PgSuspects { .. }
            | Message::PgLogOps { .. }
            | Message::ObjectSums { .. }
            | Message::RemoveObject { .. } => {
                return perm("a group-internal request from a client");
            }
            Message::DeleteVolume { .. } | Message::Scrub { .. } if role != Role::Admin => {
                return perm("DELETE_VOLUME and SCRUB need the admin role");
            }
            Message::Read { target, .. }
            | Message::Write { target, .. }
            | Message::WriteZeroes { target, .. }
            | Message::Discard { target, .. } => target.object.volume,
            Message::Flush { volume, .. } => *volume,
            _ => return Ok(()),
        };
        if self.volumes.is_all() || self.volume_allowed(volume, msg.epoch(), map().map()) {
            Ok(())
        } else {
            perm("a volume this entity may not use, or one its map does not have")
        }
    }

    /// Whether a restricted entity may use `volume`, asked by a request of
    /// map `epoch`: a volume of the map whose name its patterns allow; a
    /// volume this map does not have only if the request's map is newer (the
    /// volume may have been created since: execution answers it as it answers
    /// any request from a newer map, and the retry meets this check again once
    /// this OSD has that map). A removed volume's leftovers, whose name is
    /// gone, are never read or written by a restricted entity.
    fn volume_allowed(&self, volume: VolumeId, epoch: Epoch, map: &ClusterMap) -> bool {
        debug_assert!(!self.volumes.is_all());
        let mut cache = self.cache.borrow_mut();
        if cache.0 != map.epoch || cache.1.len() >= VOLUME_CACHE_ENTRIES_MAX {
            *cache = (map.epoch, HashMap::default());
        }
        if let Some(&allowed) = cache.1.get(&volume) {
            return allowed;
        }
        // Not cached: the answer changes with the request's epoch.
        let Some(v) = map.volume_by_id(volume) else {
            return epoch > map.epoch;
        };
        let allowed = self.volumes.allows(&v.name);
        cache.1.insert(volume, allowed);
        allowed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::buffer::PayloadBuf;
    use flame_common::ids::{ObjectId, OpId, PgId, PgSeq, RequestId};
    use flame_common::map::{PoolConfig, VolumeInfo};
    use flame_common::protocol::IoTarget;

    fn map() -> ClusterMap {
        let mut m = ClusterMap::new("t".into(), PoolConfig::default());
        m.epoch = Epoch(3);
        for (id, name) in [(1, "vm1-root"), (2, "other")] {
            m.volumes.insert(
                name.into(),
                VolumeInfo {
                    id: VolumeId(id),
                    name: name.into(),
                    size: 1 << 20,
                    created_unix: 0,
                },
            );
        }
        m
    }

    fn write(volume: u64, f: u16) -> Message {
        Message::Write {
            id: RequestId(1),
            epoch: Epoch(3),
            target: IoTarget {
                pg: PgId(0),
                object: ObjectId {
                    volume: VolumeId(volume),
                    index: 0,
                },
                offset: 0,
                length: 4,
            },
            flags: f,
            seq: PgSeq(0),
            op: OpId::NONE,
            remote: None,
            data: PayloadBuf::copy_from(&[0; 4]),
        }
    }

    fn who(name: &str, role: Role) -> flame_common::auth::handshake::Authenticated {
        flame_common::auth::handshake::Authenticated {
            entity: EntityName::parse(name).unwrap(),
            role,
        }
    }

    fn op_of(msg: &Message) -> OpId {
        match msg {
            Message::Write { op, .. } => *op,
            _ => unreachable!(),
        }
    }

    #[test]
    fn a_clients_op_ids_are_scoped_to_its_entity() {
        let with_op = |session| {
            let mut m = write(1, 0);
            if let Message::Write { op, .. } = &mut m {
                *op = OpId { session, seq: 9 };
            }
            m
        };
        let a = ConnAccess::new(
            false,
            Some(&who("client.a", Role::Client)),
            VolumePatterns::all(),
        );
        let b = ConnAccess::new(
            false,
            Some(&who("client.b", Role::Client)),
            VolumePatterns::all(),
        );
        let (mut ma, mut mb, mut ma2) = (with_op(7), with_op(7), with_op(7));
        a.scope_op(&mut ma);
        b.scope_op(&mut mb);
        a.scope_op(&mut ma2);
        assert_ne!(op_of(&ma).session, 7, "scoped");
        assert_ne!(
            op_of(&ma).session,
            op_of(&mb).session,
            "another entity, another session"
        );
        assert_eq!(
            op_of(&ma),
            op_of(&ma2),
            "the same on every write (and every OSD)"
        );
        assert_eq!(op_of(&ma).seq, 9);
        assert_eq!(
            op_of(&ma).session,
            scoped_op_session(&EntityName::parse("client.a").unwrap(), 7)
        );
        // Another session of the same connection after the cached one.
        let mut m8 = with_op(8);
        a.scope_op(&mut m8);
        assert_ne!(op_of(&m8).session, op_of(&ma).session);
        // No op id, a peer's forwarded write, no authentication: unchanged.
        let mut none = write(1, 0);
        a.scope_op(&mut none);
        assert!(op_of(&none).is_none());
        let peer = ConnAccess::new(true, Some(&who("osd", Role::Osd)), VolumePatterns::all());
        let open = ConnAccess::new(false, None, VolumePatterns::all());
        for access in [&peer, &open] {
            let mut m = with_op(7);
            access.scope_op(&mut m);
            assert_eq!(op_of(&m).session, 7);
        }
    }

    #[test]
    fn every_rule() {
        let m = map();
        let vm1 = VolumePatterns::parse_list("vm1-*").unwrap();
        let client = ConnAccess::new(false, Some(&who("client.vm1", Role::Client)), vm1.clone());
        assert_eq!(client.check(&write(1, 0), || &m), Ok(()));
        assert_eq!(
            client.check(&write(2, 0), || &m).unwrap_err().status,
            status::EPERM
        );
        // A volume the map does not have: a removed one's leftovers are
        // refused (same epoch); from a newer map it may be new, and is left to
        // execution (which waits for or asks for that map).
        assert_eq!(
            client.check(&write(9, 0), || &m).unwrap_err().status,
            status::EPERM,
            "a removed volume's leftovers"
        );
        let read9 = |epoch| Message::Read {
            id: RequestId(1),
            epoch: Epoch(epoch),
            target: IoTarget {
                pg: PgId(0),
                object: ObjectId {
                    volume: VolumeId(9),
                    index: 0,
                },
                offset: 0,
                length: 4,
            },
            flags: 0,
            remote: None,
        };
        assert!(client.check(&read9(3), || &m).is_err());
        assert!(client.check(&read9(2), || &m).is_err());
        assert_eq!(
            client.check(&read9(4), || &m),
            Ok(()),
            "from a newer map: left to execution"
        );
        let flush = |v| Message::Flush {
            id: RequestId(1),
            epoch: Epoch(3),
            flags: 0,
            volume: VolumeId(v),
        };
        assert_eq!(client.check(&flush(1), || &m), Ok(()));
        assert!(client.check(&flush(2), || &m).is_err());
        assert_eq!(
            client
                .check(&write(1, flags::REPLICA), || &m)
                .unwrap_err()
                .status,
            status::EINVAL
        );
        let delete = Message::DeleteVolume {
            id: RequestId(1),
            epoch: Epoch(3),
            volume: VolumeId(1),
        };
        assert!(client.check(&delete, || &m).is_err());
        let admin = ConnAccess::new(
            false,
            Some(&who("client.admin", Role::Admin)),
            VolumePatterns::all(),
        );
        assert_eq!(admin.check(&delete, || &m), Ok(()));
        assert_eq!(admin.check(&write(2, 0), || &m), Ok(()));
        let sums = Message::PgList {
            id: RequestId(1),
            epoch: Epoch(3),
            pg: PgId(0),
            start: ObjectId {
                volume: VolumeId(0),
                index: 0,
            },
            max: 16,
        };
        assert!(
            admin.check(&sums, || &m).is_err(),
            "group-internal: peers only"
        );
        let log_ops = Message::PgLogOps {
            id: RequestId(1),
            epoch: Epoch(3),
            pg: PgId(0),
        };
        assert!(
            admin.check(&log_ops, || &m).is_err(),
            "a group's log: peers only"
        );
        let peer = ConnAccess::new(true, Some(&who("osd", Role::Osd)), VolumePatterns::all());
        assert!(peer.is_peer());
        assert_eq!(peer.check(&sums, || &m), Ok(()));
        assert_eq!(peer.check(&log_ops, || &m), Ok(()));
        assert_eq!(peer.check(&write(2, flags::REPLICA), || &m), Ok(()));
        // Without authentication: only the replica rule.
        let open = ConnAccess::new(false, None, VolumePatterns::all());
        assert_eq!(open.check(&sums, || &m), Ok(()));
        assert_eq!(open.check(&delete, || &m), Ok(()));
        assert!(open.check(&write(1, flags::REPLICA), || &m).is_err());
        // The cache follows the map: a volume renamed out of the patterns in a
        // newer epoch is refused then.
        let mut m2 = m.clone();
        m2.epoch = Epoch(4);
        let mut v = m2.volumes.remove("vm1-root").unwrap();
        v.name = "renamed".into();
        m2.volumes.insert("renamed".into(), v);
        assert_eq!(client.check(&write(1, 0), || &m), Ok(()));
        assert!(client.check(&write(1, 0), || &m2).is_err());
    }
}
