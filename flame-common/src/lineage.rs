//! What a HELLO's `session` and `generation` say about who is connecting: a
//! client's *lineage* (the same across its restarts), the thread within it, the
//! process *incarnation*, and the connection within that.
//!
//! An OSD fences the connections a client gave up on: when a session
//! reconnects, nothing more is executed from its older connections (a resent
//! write must never be overtaken by its stale original). A client process that
//! crashed leaves connections too, with writes still on the wire (a TCP
//! retransmission after a cut, a slow path): a write it never had acknowledged
//! must not land over what its successor wrote and had acknowledged since
//! (simulator seed 200188: a crashed client's zeroing arrived after its new
//! incarnation's write of the same blocks, and erased an acknowledged write).
//! So a client configured with an instance name (`instance:`, the same across
//! its restarts) sends sessions of one lineage, and generations whose high bits
//! are its incarnation (its start time, in milliseconds): an OSD that sees a
//! HELLO of a newer incarnation of a lineage stops executing everything its
//! older incarnations still send, and refuses their HELLOs.
//!
//! Packed into the two existing 64-bit fields, so the wire format is unchanged:
//! a client without an instance name draws a random lineage per thread (no
//! other process shares it: nothing changes for it), and a generation of an
//! older client (a plain counter from 1) reads as incarnation 0.

/// Low bits of a session that number the thread within its lineage.
pub const THREAD_BITS: u32 = 16;
/// Low bits of a generation that number the session's connections within one
/// incarnation (4 194 304; the counter then stays at its last value).
pub const CONNECTION_BITS: u32 = 22;

/// The session of thread `thread` of `lineage` (its low 48 bits are used).
pub fn session(lineage: u64, thread: u16) -> u64 {
    (lineage << THREAD_BITS) | u64::from(thread)
}

/// The lineage of `session`: the session with its thread bits cleared (a key
/// an OSD can scope like a session).
pub fn lineage_of(session: u64) -> u64 {
    session & !((1u64 << THREAD_BITS) - 1)
}

/// The largest incarnation a generation holds (42 bits: milliseconds until
/// the year 2109).
pub const INCARNATION_MAX: u64 = (1u64 << (64 - CONNECTION_BITS)) - 1;
/// The largest connection number a generation holds; the sender steps its
/// incarnation up rather than go past it (a repeated generation would let a
/// resend and its stale original both execute).
pub const CONNECTION_MAX: u64 = (1u64 << CONNECTION_BITS) - 1;

/// The generation of connection `connection` of incarnation `incarnation`,
/// each held at its largest ([`INCARNATION_MAX`], [`CONNECTION_MAX`]).
pub fn generation(incarnation: u64, connection: u64) -> u64 {
    (incarnation.min(INCARNATION_MAX) << CONNECTION_BITS) | connection.min(CONNECTION_MAX)
}

/// The incarnation a generation was sent by.
pub fn incarnation_of(generation: u64) -> u64 {
    generation >> CONNECTION_BITS
}

/// A lineage number for the instance name `name`: the same in every process
/// that names itself so (never 0).
pub fn lineage_of_name(name: &str) -> u64 {
    let h = crc32c::crc32c(name.as_bytes());
    let h2 = crc32c::crc32c_append(h, b"flame-lineage");
    (crate::placement::mix64((u64::from(h) << 32) | u64::from(h2)) >> THREAD_BITS).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip_and_order() {
        let s = session(0xabc, 7);
        assert_eq!(lineage_of(s), lineage_of(session(0xabc, 9)));
        assert_ne!(lineage_of(s), lineage_of(session(0xabd, 7)));
        let g = generation(1_700_000_000_000, 5);
        assert_eq!(incarnation_of(g), 1_700_000_000_000);
        // A newer incarnation's first connection is above every connection of
        // the older one, even one past the counter's room.
        assert!(generation(1_700_000_000_001, 1) > generation(1_700_000_000_000, u64::MAX));
        assert_eq!(generation(3, u64::MAX), generation(3, CONNECTION_MAX));
        // An incarnation past the room is held at the largest, not wrapped to
        // a small one.
        assert_eq!(incarnation_of(generation(u64::MAX, 1)), INCARNATION_MAX);
        // An older client's plain counter is incarnation 0.
        assert_eq!(incarnation_of(42), 0);
    }

    #[test]
    fn names_give_stable_distinct_lineages() {
        assert_eq!(lineage_of_name("nbd@a"), lineage_of_name("nbd@a"));
        assert_ne!(lineage_of_name("nbd@a"), lineage_of_name("nbd@b"));
        assert!(lineage_of_name("") > 0);
        assert!(lineage_of_name("x") < (1 << (64 - THREAD_BITS)));
    }
}
