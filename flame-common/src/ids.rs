//! Typed identifiers.
//!
//! Every number that names something gets its own newtype, so an OSD id can never be
//! passed where a placement-group id is expected (borrowed from crucible's
//! `BlockIndex`/`JobId` style).

use serde::{Deserialize, Serialize};
use std::fmt;

/// Identifies one OSD for the life of the cluster. Assigned by the manager at first
/// boot and never reused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct OsdId(pub u32);

/// Identifies a volume. Never reused, so objects of a removed volume can never be
/// mistaken for objects of a new volume with the same name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct VolumeId(pub u64);

/// A placement group: the unit objects are hashed into and that is placed on OSDs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct PgId(pub u32);

/// Version of the cluster map. Every change to the map increments it.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Epoch(pub u64);

/// Matches a reply to its request on one connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct RequestId(pub u64);

/// Position of a write in its placement group's order, assigned by the primary.
///
/// Carried in every protocol-v2 write header so that recovery can order and
/// de-duplicate the writes of a placement group; `PgSeq(0)` means "not assigned"
/// (every sender sends 0 until recovery lands).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct PgSeq(pub u64);

/// The identity of one client operation (a write, write-zeroes or discard of one
/// object piece), the same on every resend of it, to any OSD: the client's
/// `session` (random per client instance, never 0) and the operation's `seq` in
/// that session (increasing in issue order, never 0). Carried in header bytes
/// 92..108 and recorded in the placement-group log, so a primary — also a new one
/// after a failover, which has the log through replication — recognises a retry
/// and answers it without applying it again, and refuses an operation of a session
/// older than an already applied overlapping one of the same session (a write the
/// client gave up on never lands after a newer one). `OpId::NONE` (both 0): no
/// identity (copies made by recovery and repair, and messages that are not writes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct OpId {
    /// The client instance (random, non-zero).
    pub session: u64,
    /// Position of the operation in the session's issue order (non-zero).
    pub seq: u64,
}

impl OpId {
    /// No identity.
    pub const NONE: OpId = OpId { session: 0, seq: 0 };

    /// Whether this is [`OpId::NONE`].
    pub fn is_none(&self) -> bool {
        *self == OpId::NONE
    }
}

impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "op.{:x}.{}", self.session, self.seq)
    }
}

/// One fixed-size object of a volume: bytes `[index * object_size, (index+1) * object_size)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ObjectId {
    /// The volume the object belongs to.
    pub volume: VolumeId,
    /// The object's position within the volume.
    pub index: u64,
}

macro_rules! display_inner {
    ($($t:ty => $fmt:literal),*) => {$(
        impl fmt::Display for $t {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, $fmt, self.0)
            }
        }
    )*};
}
display_inner!(OsdId => "osd.{}", VolumeId => "vol.{}", PgId => "pg.{}", Epoch => "e{}", RequestId => "req.{}", PgSeq => "seq.{}");

impl fmt::Display for ObjectId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}.{:016x}", self.volume.0, self.index)
    }
}
