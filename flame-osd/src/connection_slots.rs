//! How many connections a shard holds, and from whom: a cap per shard, a cap
//! per source address (one host cannot take every slot), and slots kept for
//! OSD peers (clients may not take the last `reserved_for_peers` of them, so a
//! flood of client connections never stops replication). Pure: the accept loops
//! and the HELLO step drive it; [`SlotGuard`] gives a slot back when its
//! connection ends.

use flame_common::collections::HashMap;
use std::cell::{Cell, RefCell};
use std::net::IpAddr;
use std::rc::Rc;

/// A shard's connection slots.
#[derive(Debug)]
pub struct ConnectionSlots {
    max: u32,
    per_source_max: u32,
    reserved_for_peers: u32,
    total: u32,
    clients: u32,
    /// Connections per source address (entries removed at zero: bounded by
    /// `total`).
    by_source: HashMap<IpAddr, u32>,
}

/// Why a connection was refused a slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlotRefusal {
    /// The shard holds `max_connections_per_shard` connections.
    Full(u32),
    /// This source holds `max_connections_per_source` of them.
    SourceFull(IpAddr, u32),
    /// Only the slots kept for OSD peers are left, and this is a client.
    ReservedForPeers(u32),
}

impl std::fmt::Display for SlotRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SlotRefusal::Full(m) => write!(f, "the shard holds its {m} connections"),
            SlotRefusal::SourceFull(ip, m) => {
                write!(f, "{ip} holds its {m} connections to this shard")
            }
            SlotRefusal::ReservedForPeers(r) => write!(
                f,
                "only the {r} connections kept for OSD peers are left; clients are refused"
            ),
        }
    }
}

impl ConnectionSlots {
    /// Slots for at most `max` connections, `per_source_max` from one address,
    /// the last `reserved_for_peers` of them only for OSD peers.
    pub fn new(max: u32, per_source_max: u32, reserved_for_peers: u32) -> ConnectionSlots {
        debug_assert!(reserved_for_peers < max);
        ConnectionSlots {
            max,
            per_source_max,
            reserved_for_peers,
            total: 0,
            clients: 0,
            by_source: HashMap::default(),
        }
    }

    /// Connections held.
    pub fn total(&self) -> u32 {
        self.total
    }

    /// Takes a slot for a new connection from `source` (before its HELLO).
    pub fn accept(&mut self, source: IpAddr) -> Result<(), SlotRefusal> {
        if self.total >= self.max {
            return Err(SlotRefusal::Full(self.max));
        }
        let n = self.by_source.get(&source).copied().unwrap_or(0);
        if n >= self.per_source_max {
            return Err(SlotRefusal::SourceFull(source, self.per_source_max));
        }
        self.by_source.insert(source, n + 1);
        self.total += 1;
        debug_assert!(self.total <= self.max);
        Ok(())
    }

    /// After the HELLO: a client counts against the slots not kept for peers.
    pub fn hello(&mut self, is_peer: bool) -> Result<(), SlotRefusal> {
        if is_peer {
            return Ok(());
        }
        if self.clients >= self.max - self.reserved_for_peers {
            return Err(SlotRefusal::ReservedForPeers(self.reserved_for_peers));
        }
        self.clients += 1;
        Ok(())
    }

    /// Gives back a slot of `source` (a client's if `client`).
    pub fn release(&mut self, source: IpAddr, client: bool) {
        debug_assert!(self.total > 0);
        self.total = self.total.saturating_sub(1);
        if client {
            debug_assert!(self.clients > 0);
            self.clients = self.clients.saturating_sub(1);
        }
        if let Some(n) = self.by_source.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                self.by_source.remove(&source);
            }
        }
    }
}

/// A connection's slot, given back when it is dropped.
pub struct SlotGuard {
    slots: Rc<RefCell<ConnectionSlots>>,
    source: IpAddr,
    client: Cell<bool>,
}

impl SlotGuard {
    /// Takes a slot from `slots` for a connection from `source`.
    pub fn take(
        slots: &Rc<RefCell<ConnectionSlots>>,
        source: IpAddr,
    ) -> Result<SlotGuard, SlotRefusal> {
        slots.borrow_mut().accept(source)?;
        Ok(SlotGuard {
            slots: slots.clone(),
            source,
            client: Cell::new(false),
        })
    }

    /// A slot for a just-accepted `conn`, or `None` with the connection closed
    /// and the refusal logged (what both accept loops do).
    pub fn take_or_close(
        slots: &Rc<RefCell<ConnectionSlots>>,
        conn: &flame_common::transport::Conn,
        shard_id: u16,
    ) -> Option<SlotGuard> {
        match SlotGuard::take(slots, conn.peer().ip()) {
            Ok(s) => Some(s),
            Err(r) => {
                tracing::warn!(shard = shard_id, peer = %conn.peer(), "refusing a connection: {r}");
                conn.close();
                None
            }
        }
    }

    /// Records the connection's role after its HELLO ([`ConnectionSlots::hello`]).
    pub fn hello(&self, is_peer: bool) -> Result<(), SlotRefusal> {
        self.slots.borrow_mut().hello(is_peer)?;
        self.client.set(!is_peer);
        Ok(())
    }
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.slots
            .borrow_mut()
            .release(self.source, self.client.get());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, n])
    }

    #[test]
    fn every_cap_and_every_release() {
        let mut s = ConnectionSlots::new(6, 3, 2);
        for _ in 0..3 {
            s.accept(ip(1)).unwrap();
        }
        assert_eq!(s.accept(ip(1)), Err(SlotRefusal::SourceFull(ip(1), 3)));
        s.accept(ip(2)).unwrap();
        s.accept(ip(2)).unwrap();
        s.accept(ip(3)).unwrap();
        assert_eq!(s.total(), 6);
        assert_eq!(s.accept(ip(4)), Err(SlotRefusal::Full(6)));
        // Clients get at most 6 - 2 slots; peers any.
        for _ in 0..4 {
            s.hello(false).unwrap();
        }
        assert_eq!(s.hello(false), Err(SlotRefusal::ReservedForPeers(2)));
        s.hello(true).unwrap();
        s.hello(true).unwrap();
        // A client leaves: a client slot and a source slot are free again.
        s.release(ip(1), true);
        assert_eq!(s.total(), 5);
        s.accept(ip(1)).unwrap();
        s.hello(false).unwrap();
        // Sources at zero are forgotten.
        s.release(ip(3), false);
        assert!(!s.by_source.contains_key(&ip(3)));
        for r in [
            SlotRefusal::Full(1),
            SlotRefusal::SourceFull(ip(1), 1),
            SlotRefusal::ReservedForPeers(1),
        ] {
            assert!(!r.to_string().is_empty());
        }
    }

    #[test]
    fn a_guard_gives_its_slot_back() {
        let slots = Rc::new(RefCell::new(ConnectionSlots::new(2, 2, 1)));
        {
            let g = SlotGuard::take(&slots, ip(1)).unwrap();
            g.hello(false).unwrap();
            let h = SlotGuard::take(&slots, ip(1)).unwrap();
            assert_eq!(h.hello(false), Err(SlotRefusal::ReservedForPeers(1)));
            assert!(SlotGuard::take(&slots, ip(2)).is_err());
        }
        assert_eq!(slots.borrow().total(), 0);
        assert_eq!(slots.borrow().clients, 0);
        assert!(slots.borrow().by_source.is_empty());
    }
}
