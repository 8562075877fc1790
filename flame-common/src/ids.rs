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
