//! The Flame object storage daemon as a library: `flame-osd`'s `main` only parses
//! its arguments and calls [`daemon::run`].
//!
//! Where a request travels: [`connection`] (accept, HELLO — admitted by
//! [`hello_gate`], given a slot by [`connection_slots`] —, fencing, bounds) →
//! [`access`] (what the connection's entity may ask) → [`execute`] (one request, its reply) → [`pg`] (placement-group view and role
//! checks; primary reads heal bad blocks in [`read_repair`]) → [`replication`] (the primary forwards to the replicas through
//! [`peers`], ordered by [`ordering`]) → [`store`] (objects on disk, io_uring).
//! [`shard_thread`] starts a shard's thread and accepts its connections;
//! [`shard`] is what one thread owns; [`control`] talks to the manager;
//! [`liveness`] is the lease and the health state the two share.
//! [`activation`] has a new primary tell the previous one about its map;
//! [`pg_core`] makes every decision about a group's writes (admission, retries,
//! acknowledgement, a replica's fence, primacy) without I/O;
//! [`pg_log`] keeps each group's recent writes; [`restart_suspects`] is what a
//! restart left in doubt and when it is settled; [`recovery`] brings members up to
//! date (from the log or by backfill) and removes stray copies; [`scrub`] compares
//! and repairs the copies of a group.
//! [`failpoints`] injects disk and network faults in test builds (feature
//! `failpoints`).

// Unit tests may read the real clock and sleep; production code reads time
// through flame_common::clock (clippy.toml, docs/testing.md "The clock rule").
#![cfg_attr(test, allow(clippy::disallowed_methods))]

pub mod access;
pub mod activation;
pub mod byte_budget;
pub mod config;
pub mod connection;
pub mod connection_slots;
pub mod control;
pub mod daemon;
pub mod execute;
pub mod failpoints;
pub mod hello_gate;
pub mod liveness;
pub mod metrics;
pub mod ordering;
pub mod peers;
pub mod pg;
pub mod pg_core;
pub mod pg_log;
pub mod read_repair;
pub mod recovery;
pub mod replication;
pub mod restart_suspects;
pub mod scrub;
pub mod service_key;
pub mod session_fence;
pub mod shard;
pub mod shard_thread;
pub mod staged;
pub mod store;
pub mod tombstones;
