//! The Flame wire protocol (version 4) between clients and OSDs, and between OSDs.
//!
//! Every message is one fixed 128-byte header (two cache lines) followed by
//! `payload_len` bytes of payload: the data of a write or of a read reply, or the
//! fixed body of a HELLO and of its reply. Fixed headers make decoding a bounds check
//! and a few loads, and let a transport post the header and the data separately
//! (inline header, data by one-sided transfer — hence the remote buffer descriptor).
//!
//! The header is two 64-byte halves, each with its own crc32c:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `FLME` |
//! | 4 | 1 | protocol version ([`VERSION`]) |
//! | 5 | 1 | opcode ([`OpCode`]; replies have bit 7 set) |
//! | 6 | 2 | flags ([`flags`]) |
//! | 8 | 8 | request id |
//! | 16 | 8 | sender's map epoch |
//! | 24 | 8 | volume id |
//! | 32 | 8 | object index |
//! | 40 | 4 | offset within the object |
//! | 44 | 4 | length of the byte range |
//! | 48 | 4 | payload length |
//! | 52 | 4 | status (replies: 0 or a negative errno) |
//! | 56 | 4 | placement group |
//! | 60 | 4 | crc32c of bytes 0..60 |
//! | 64 | 8 | placement-group sequence number ([`PgSeq`]; 0 = none) |
//! | 72 | 4 | crc32c of the payload (0 for no payload) |
//! | 76 | 4 | remote buffer length (0 = no remote buffer) |
//! | 80 | 8 | remote buffer address |
//! | 88 | 4 | remote buffer key |
//! | 92 | 8 | op session ([`OpId`]; 0 = none) |
//! | 100 | 8 | op sequence in the session (0 = none) |
//! | 108 | 16 | reserved, zero |
//! | 124 | 4 | crc32c of bytes 64..124 |
//!
//! The first 64 bytes keep protocol version 1's layout up to the version byte and its
//! checksum at bytes 60..64. That is what makes a version mismatch recognisable in
//! both directions: a v1 peer reading a v2 header finds a valid magic and checksum
//! and reports "unsupported protocol version 2", and a v2 peer reading a v1 header
//! (it reads the first 64 bytes, checks them, and only then asks for the rest)
//! reports [`ProtocolError::ForeignVersion`] instead of waiting for 64 more bytes
//! that never come. See docs/protocol.md.

use crate::buffer::PayloadBuf;
use crate::ids::{Epoch, ObjectId, OpId, PgId, PgSeq, RequestId, VolumeId};
use std::borrow::Cow;

/// `FLME` in ASCII, read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"FLME");
/// The protocol version this build speaks and puts in every header. 4 added
/// [`OpCode::MapRequest`] and [`OpCode::PgLogOps`]: a version-3 peer would not
/// know them, so the two refuse each other at the first header instead.
pub const VERSION: u8 = 4;
/// The protocol versions this build accepts in a HELLO (a peer's range must contain
/// [`VERSION`]).
pub const VERSIONS: Versions = Versions {
    min: VERSION,
    max: VERSION,
};
/// Header size in bytes.
pub const HEADER_LEN: usize = 128;
/// The first part of a header, the same size and layout up to the version byte (and
/// with its checksum at the same place) in every protocol version. A receiver reads
/// this much, checks it with [`Header::check_prefix`], and only then reads the rest.
pub const HEADER_PREFIX_LEN: usize = 64;
/// Largest payload of one message: one I/O never spans objects and the client splits
/// I/O into pieces of at most this size, so 4 MiB bounds every receive buffer.
pub const PAYLOAD_BYTES_MAX: u32 = 4 << 20;
/// Largest byte range one request may name (reads, zeroing, discards).
pub const IO_BYTES_MAX: u32 = PAYLOAD_BYTES_MAX;

/// Largest map a [`Message::MapRequest`] reply carries (a frame's payload bound):
/// an OSD whose map is larger answers `E2BIG`, and the client waits for the
/// manager's map instead.
pub const MAP_REPLY_BYTES_MAX: usize = PAYLOAD_BYTES_MAX as usize;
/// Size of a HELLO's body (its payload) without authentication.
pub const HELLO_BODY_LEN: usize = 32;
/// Size of a HELLO reply's body (its payload) without the OSD's proof.
pub const HELLO_REPLY_BODY_LEN: usize = 16;
/// What a HELLO's [`HelloAuth`] adds to its body, besides the ticket.
pub const HELLO_AUTH_FIXED_LEN: usize = 64;
/// Largest ticket a HELLO may carry (`auth::TICKET_BYTES_MAX`, which is
/// asserted equal there: the wire does not depend on the auth module).
pub const HELLO_TICKET_BYTES_MAX: usize = 2208;
/// Size of the OSD's proof in a HELLO reply.
pub const HELLO_PROOF_LEN: usize = 32;
/// Bit of a HELLO body's byte 3 (and a HELLO reply body's byte 2): an
/// authentication section follows the fixed body.
const HELLO_FLAG_AUTH: u8 = 1;

/// Bit 7 of the opcode byte marks a reply.
const REPLY_BIT: u8 = 0x80;
/// Protocol version 1's header size, for answering a v1 peer in its own format.
const V1_HEADER_LEN: usize = 64;

/// Header flag bits.
pub mod flags {
    /// Forced unit access: reply only once the data is on stable storage on every copy.
    pub const FUA: u16 = 1 << 0;
    /// Sent by a primary to a replica: apply locally, do not forward.
    pub const REPLICA: u16 = 1 << 1;
    /// Remote fetching (RFP): do not send the reply; leave it in the connection's
    /// reply area (granted with [`super::Message::ReplyArea`]), in slot
    /// `request id % (slots + 1)`, where the client reads it one-sidedly. Only on a
    /// connection that has a reply area; the OSD clears it before executing, so it
    /// is never forwarded to a replica.
    pub const FETCH_REPLY: u16 = 1 << 2;
    /// All flags this version knows; others are rejected.
    pub const KNOWN: u16 = FUA | REPLICA | FETCH_REPLY;
}

/// A range of protocol versions a peer speaks. Carried in HELLO and its reply, so a
/// later build that speaks several versions can agree on one with an older peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Versions {
    /// Oldest version spoken.
    pub min: u8,
    /// Newest version spoken.
    pub max: u8,
}

impl Versions {
    /// Whether `v` is in the range.
    pub fn contains(self, v: u8) -> bool {
        self.min <= v && v <= self.max
    }
}

impl std::fmt::Display for Versions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.min == self.max {
            write!(f, "{}", self.min)
        } else {
            write!(f, "{}..={}", self.min, self.max)
        }
    }
}

/// A buffer in the sender's registered memory that the receiver may read or write
/// with a one-sided transfer (RDMA READ/WRITE) instead of receiving the data inline:
/// read-write conversion (a converted write names the client's payload, which the
/// OSD pulls; a converted read names the client's destination, which the OSD fills)
/// and remote fetching (a reply area's descriptor). It is only valid on the
/// connection it was granted on; the transport refuses (and closes the connection
/// on) any access outside a live grant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RemoteBuf {
    /// Address in the sender's address space (as registered).
    pub addr: u64,
    /// Length in bytes; never 0 (an all-zero descriptor means "none").
    pub len: u32,
    /// Remote key of the memory registration.
    pub key: u32,
}

/// What a message asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpCode {
    /// First message on a connection: the sender names the shard it expects and the
    /// protocol versions it speaks.
    Hello = 1,
    /// Read a byte range of an object.
    Read = 2,
    /// Write the payload at an offset of an object.
    Write = 3,
    /// Make a byte range read back as zeroes.
    WriteZeroes = 4,
    /// The byte range is no longer needed (reads back as zeroes in Flame).
    Discard = 5,
    /// Make every write of one volume acknowledged so far by this shard stable.
    Flush = 6,
    /// Remove every object of a volume owned by this shard.
    DeleteVolume = 7,
    /// Liveness probe; also carries the epoch.
    Ping = 8,
    /// List the objects of one placement group held by the receiving shard
    /// (recovery's backfill and scrub).
    PgList = 9,
    /// The per-block checksums of one object as its data on disk is now (recovery,
    /// scrub, `flame-admin pg compare`).
    ObjectSums = 10,
    /// Remove one object's copy (replica-flagged: recovery removing an object the
    /// primary does not have).
    RemoveObject = 11,
    /// Compare (and repair) every acting copy of one placement group (sent to its
    /// primary by `flame-admin scrub` and `flame-admin pg compare`).
    Scrub = 12,
    /// Transport-internal (tcp): a one-sided READ of a buffer the receiver granted,
    /// emulated by the receiver's connection thread. Header: `remote_*` name the
    /// bytes to read (within one grant, checked against the key); the reply's payload
    /// is the data. Never reaches the OSD or the client code (see
    /// [`crate::transport`]); [`Message::from_parts`] refuses it.
    RemoteRead = 13,
    /// Transport-internal (tcp): a one-sided WRITE of the payload into a buffer the
    /// receiver granted, at `remote_addr` (within one grant, checked against the
    /// key). The reply carries only a status.
    RemoteWrite = 14,
    /// Remote fetching: asks the receiving shard for a reply area on this
    /// connection (its reply carries a [`ReplyAreaInfo`]). Numbered far from the
    /// others so transport-internal opcodes can grow from 13.
    ReplyArea = 40,
    /// Remote fetching's fallback: push the reply of request `of` (which asked for
    /// [`flags::FETCH_REPLY`]) instead of leaving it for a fetch that keeps coming
    /// back empty. Not answered itself: the answer is that reply.
    PushReply = 41,
    /// The objects of one placement group whose copy on the receiving shard may
    /// have lost writes when its OSD last restarted: the objects its intent
    /// journal named at start-up (writes no FLUSH covered; a power cut may have
    /// kept each block old or new). Recovery copies them whole before the member
    /// counts as complete, whatever the log says it applied.
    PgSuspects = 42,
    /// The receiving OSD's cluster map, if it is newer than the sender's epoch
    /// (the reply's payload: the map as JSON, at most [`MAP_REPLY_BYTES_MAX`];
    /// empty when it has nothing newer). A client whose write was refused for
    /// a stale map gets the map from the OSD that refused it, as Ceph's OSDs
    /// share maps, so a client cut off from the manager can go on.
    MapRequest = 43,
    /// The client ops of one placement group's log on the receiving shard
    /// (the reply's payload: [`encode_log_ops`]). A new primary asks every other
    /// complete copy before peering, and first takes over an object from a copy
    /// whose log shows writes to it that its own does not (Ceph's authoritative
    /// log): peering then spreads the newest copy, not the primary's.
    PgLogOps = 44,
}

impl OpCode {
    /// Decodes an opcode byte (without the reply bit).
    pub fn from_u8(v: u8) -> Option<OpCode> {
        Some(match v {
            1 => OpCode::Hello,
            2 => OpCode::Read,
            3 => OpCode::Write,
            4 => OpCode::WriteZeroes,
            5 => OpCode::Discard,
            6 => OpCode::Flush,
            7 => OpCode::DeleteVolume,
            8 => OpCode::Ping,
            9 => OpCode::PgList,
            10 => OpCode::ObjectSums,
            11 => OpCode::RemoveObject,
            12 => OpCode::Scrub,
            13 => OpCode::RemoteRead,
            14 => OpCode::RemoteWrite,
            40 => OpCode::ReplyArea,
            41 => OpCode::PushReply,
            42 => OpCode::PgSuspects,
            43 => OpCode::MapRequest,
            44 => OpCode::PgLogOps,
            _ => return None,
        })
    }

    /// Label for metrics and logs.
    pub fn name(self) -> &'static str {
        match self {
            OpCode::Hello => "hello",
            OpCode::Read => "read",
            OpCode::Write => "write",
            OpCode::WriteZeroes => "write_zeroes",
            OpCode::Discard => "discard",
            OpCode::Flush => "flush",
            OpCode::DeleteVolume => "delete_volume",
            OpCode::Ping => "ping",
            OpCode::PgList => "pg_list",
            OpCode::ObjectSums => "object_sums",
            OpCode::RemoveObject => "remove_object",
            OpCode::Scrub => "scrub",
            OpCode::RemoteRead => "remote_read",
            OpCode::RemoteWrite => "remote_write",
            OpCode::ReplyArea => "reply_area",
            OpCode::PushReply => "push_reply",
            OpCode::PgSuspects => "pg_suspects",
            OpCode::MapRequest => "map_request",
            OpCode::PgLogOps => "pg_log_ops",
        }
    }

    /// Whether this opcode is a transport's own frame (a one-sided transfer emulated
    /// on tcp) rather than a message for the OSD or the client.
    pub fn is_transport_internal(self) -> bool {
        matches!(self, OpCode::RemoteRead | OpCode::RemoteWrite)
    }
}

/// Reply status codes: 0 or a negative Linux errno, so they map onto NBD errors.
pub mod status {
    /// Success.
    pub const OK: i32 = 0;
    /// Storage failure.
    pub const EIO: i32 = -libc::EIO;
    /// Malformed or out-of-range request.
    pub const EINVAL: i32 = -libc::EINVAL;
    /// The receiver is not the primary of this placement group in its map, or the
    /// sender's map is older than the receiver's: refresh the map and retry.
    pub const ESTALE: i32 = -libc::ESTALE;
    /// A replica could not be reached; the write was not acknowledged. Retry later.
    pub const EAGAIN: i32 = -libc::EAGAIN;
    /// The receiver has no room.
    pub const ENOSPC: i32 = -libc::ENOSPC;
    /// The receiver does not offer what was asked on this connection (a reply
    /// area on a transport whose one-sided READ needs the receiver's CPU).
    pub const EOPNOTSUPP: i32 = -libc::EOPNOTSUPP;
    /// HELLO refused: the peers have no protocol version in common. The reply's
    /// body names the replier's versions.
    pub const EPROTONOSUPPORT: i32 = -libc::EPROTONOSUPPORT;
    /// Not allowed: a HELLO without a valid ticket and proof on an OSD that
    /// requires them, or asking for a role its entity lacks; a request the
    /// connection's entity may not make (a replica write from a client, the
    /// deletion of a volume the map has not removed). Nothing changed.
    pub const EPERM: i32 = -libc::EPERM;
    /// A one-sided access was refused (unknown grant key, wrong access kind, or
    /// outside the grant); the refusing side closes the connection after it.
    pub const EACCES: i32 = -libc::EACCES;
    /// A write refused because a newer operation of the same client session
    /// ([`crate::ids::OpId`]) to overlapping bytes was already applied: applying
    /// it now would put older bytes over newer ones (it is a write the client gave
    /// up on, or one overtaken by a later one). Nothing was applied. A client that
    /// still wants it re-issues it under a new op sequence number (`ECANCELED`).
    pub const SUPERSEDED: i32 = -libc::ECANCELED;
    /// More than a reply can carry ([`super::Message::PgSuspects`]).
    pub const E2BIG: i32 = -libc::E2BIG;
}

/// Why bytes could not be decoded. Always ends the connection: after a bad header the
/// stream position is unknown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// Not a Flame peer (or the stream is out of step).
    #[error("bad magic {0:#010x}: not a Flame peer")]
    BadMagic(u32),
    /// Header checksum mismatch.
    #[error("header checksum mismatch")]
    BadChecksum,
    /// The payload does not match the crc32c in its header: corrupted in transit.
    #[error("payload checksum mismatch: header says {expected:#010x}, payload has {actual:#010x}")]
    BadPayloadChecksum {
        /// The crc32c the header carries.
        expected: u32,
        /// The crc32c of the bytes received.
        actual: u32,
    },
    /// The peer speaks another protocol version (its header prefix is valid, so the
    /// version byte can be trusted). Carries what is needed to answer it.
    #[error(
        "peer speaks Flame protocol version {peer_version}, this build speaks version {VERSION}"
    )]
    ForeignVersion {
        /// The version byte of the peer's header.
        peer_version: u8,
        /// The request id of the peer's header (bytes 8..16 in every version), to
        /// address the refusal.
        request_id: u64,
    },
    /// Unknown opcode.
    #[error("unknown opcode {0}")]
    BadOpcode(u8),
    /// Unknown flag bits.
    #[error("unknown flags {0:#06x}")]
    BadFlags(u16),
    /// A length beyond the protocol's bounds.
    #[error("{what} of {len} bytes exceeds the limit of {max}")]
    TooLong {
        /// Which length.
        what: &'static str,
        /// Claimed length.
        len: u64,
        /// Bound.
        max: u64,
    },
    /// Fields that contradict each other (e.g. a write whose payload is not its
    /// length), or a field the message does not use that is not zero.
    #[error("inconsistent message: {0}")]
    Inconsistent(&'static str),
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[i..i + 4]);
    u32::from_le_bytes(a)
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[i..i + 8]);
    u64::from_le_bytes(a)
}

/// The decoded 128-byte header. Every field has one meaning; a message leaves the
/// fields it does not use at zero, and the decoder rejects a message whose unused
/// fields are not zero (so decoding then encoding gives back the same bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Header {
    /// Opcode byte including the reply bit.
    pub opcode: u8,
    /// Flag bits.
    pub flags: u16,
    /// Request id.
    pub request_id: u64,
    /// Sender's map epoch.
    pub epoch: u64,
    /// Volume id.
    pub volume: u64,
    /// Object index.
    pub object: u64,
    /// Offset within the object.
    pub offset: u32,
    /// Length of the byte range.
    pub length: u32,
    /// Bytes following the header.
    pub payload_len: u32,
    /// Reply status.
    pub status: i32,
    /// Placement group.
    pub pg: u32,
    /// Position of a write in its placement group's order (0 = none).
    pub pg_seq: u64,
    /// crc32c of the payload (0 when there is none).
    pub payload_crc: u32,
    /// Remote buffer address (one-sided transfers).
    pub remote_addr: u64,
    /// Remote buffer length (0 = no remote buffer).
    pub remote_len: u32,
    /// Remote buffer key.
    pub remote_key: u32,
    /// The client session of the operation ([`OpId::session`]; 0 = none).
    pub op_session: u64,
    /// The operation's sequence number in its session ([`OpId::seq`]; 0 = none).
    pub op_seq: u64,
}

impl Header {
    /// Encodes into exactly [`HEADER_LEN`] bytes, both checksums included.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[5] = self.opcode;
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.request_id.to_le_bytes());
        b[16..24].copy_from_slice(&self.epoch.to_le_bytes());
        b[24..32].copy_from_slice(&self.volume.to_le_bytes());
        b[32..40].copy_from_slice(&self.object.to_le_bytes());
        b[40..44].copy_from_slice(&self.offset.to_le_bytes());
        b[44..48].copy_from_slice(&self.length.to_le_bytes());
        b[48..52].copy_from_slice(&self.payload_len.to_le_bytes());
        b[52..56].copy_from_slice(&self.status.to_le_bytes());
        b[56..60].copy_from_slice(&self.pg.to_le_bytes());
        let crc = crc32c::crc32c(&b[0..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b[64..72].copy_from_slice(&self.pg_seq.to_le_bytes());
        b[72..76].copy_from_slice(&self.payload_crc.to_le_bytes());
        b[76..80].copy_from_slice(&self.remote_len.to_le_bytes());
        b[80..88].copy_from_slice(&self.remote_addr.to_le_bytes());
        b[88..92].copy_from_slice(&self.remote_key.to_le_bytes());
        b[92..100].copy_from_slice(&self.op_session.to_le_bytes());
        b[100..108].copy_from_slice(&self.op_seq.to_le_bytes());
        // 108..124 reserved, zero.
        let crc = crc32c::crc32c(&b[64..124]);
        b[124..128].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Checks the first [`HEADER_PREFIX_LEN`] bytes of a header: magic, the prefix
    /// checksum, and the version. These three are at the same place in every
    /// protocol version, so a peer of another version is told apart from garbage
    /// ([`ProtocolError::ForeignVersion`] vs [`ProtocolError::BadMagic`] /
    /// [`ProtocolError::BadChecksum`]) before anything else is read.
    pub fn check_prefix(b: &[u8; HEADER_PREFIX_LEN]) -> Result<(), ProtocolError> {
        let magic = u32_at(b, 0);
        if magic != MAGIC {
            return Err(ProtocolError::BadMagic(magic));
        }
        if crc32c::crc32c(&b[0..60]) != u32_at(b, 60) {
            return Err(ProtocolError::BadChecksum);
        }
        if b[4] != VERSION {
            return Err(ProtocolError::ForeignVersion {
                peer_version: b[4],
                request_id: u64_at(b, 8),
            });
        }
        Ok(())
    }

    /// Decodes and validates a header. After this returns `Ok`, `payload_len` is
    /// within [`PAYLOAD_BYTES_MAX`] and the opcode and flags are known, so the caller
    /// may allocate `payload_len` bytes.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, ProtocolError> {
        let mut prefix = [0u8; HEADER_PREFIX_LEN];
        prefix.copy_from_slice(&b[..HEADER_PREFIX_LEN]);
        Header::check_prefix(&prefix)?;
        if crc32c::crc32c(&b[64..124]) != u32_at(b, 124) {
            return Err(ProtocolError::BadChecksum);
        }
        if b[108..124].iter().any(|&x| x != 0) {
            return Err(ProtocolError::Inconsistent(
                "reserved header bytes are not zero",
            ));
        }
        let h = Header {
            opcode: b[5],
            flags: u16::from_le_bytes([b[6], b[7]]),
            request_id: u64_at(b, 8),
            epoch: u64_at(b, 16),
            volume: u64_at(b, 24),
            object: u64_at(b, 32),
            offset: u32_at(b, 40),
            length: u32_at(b, 44),
            payload_len: u32_at(b, 48),
            status: u32_at(b, 52) as i32,
            pg: u32_at(b, 56),
            pg_seq: u64_at(b, 64),
            payload_crc: u32_at(b, 72),
            remote_len: u32_at(b, 76),
            remote_addr: u64_at(b, 80),
            remote_key: u32_at(b, 88),
            op_session: u64_at(b, 92),
            op_seq: u64_at(b, 100),
        };
        if OpCode::from_u8(h.opcode & !REPLY_BIT).is_none() {
            return Err(ProtocolError::BadOpcode(h.opcode));
        }
        if h.flags & !flags::KNOWN != 0 {
            return Err(ProtocolError::BadFlags(h.flags));
        }
        if h.payload_len > PAYLOAD_BYTES_MAX {
            return Err(ProtocolError::TooLong {
                what: "payload",
                len: u64::from(h.payload_len),
                max: u64::from(PAYLOAD_BYTES_MAX),
            });
        }
        Ok(h)
    }

    /// Whether this header is a reply.
    pub fn is_reply(&self) -> bool {
        self.opcode & REPLY_BIT != 0
    }

    /// The opcode without the reply bit (valid after [`Header::decode`]).
    pub fn op(&self) -> OpCode {
        OpCode::from_u8(self.opcode & !REPLY_BIT).unwrap_or(OpCode::Ping)
    }

    /// The remote buffer descriptor, if any (all-zero means none).
    pub fn remote(&self) -> Option<RemoteBuf> {
        if self.remote_addr == 0 && self.remote_len == 0 && self.remote_key == 0 {
            None
        } else {
            Some(RemoteBuf {
                addr: self.remote_addr,
                len: self.remote_len,
                key: self.remote_key,
            })
        }
    }

    fn set_remote(&mut self, r: Option<RemoteBuf>) {
        if let Some(r) = r {
            self.remote_addr = r.addr;
            self.remote_len = r.len;
            self.remote_key = r.key;
        }
    }
}

/// The refusal a peer that spoke protocol version `peer_version` gets, in bytes it
/// can decode, answering its request `request_id` (its HELLO).
///
/// * A version-1 peer gets a v1 HELLO reply (64-byte v1 header) with status
///   `EPROTONOSUPPORT`, this build's version in the v1 `length` field (where v1 put
///   a HELLO reply's information) and a UTF-8 payload naming both versions, so a v1
///   peer logs "status -93" and a human reading the bytes sees why.
/// * Any other version gets a v2 [`Message::HelloReply`] with `EPROTONOSUPPORT` and
///   this build's [`VERSIONS`]: every later version keeps the 64-byte prefix, so it
///   can read at least that this peer speaks its version.
pub fn version_refusal(peer_version: u8, request_id: u64) -> Vec<u8> {
    if peer_version == 1 {
        let text = format!(
            "Flame protocol version 1 is not supported: this peer speaks version {VERSION}"
        );
        let mut b = vec![0u8; V1_HEADER_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = 1;
        b[5] = OpCode::Hello as u8 | REPLY_BIT;
        b[8..16].copy_from_slice(&request_id.to_le_bytes());
        b[44..48].copy_from_slice(&u32::from(VERSION).to_le_bytes());
        b[48..52].copy_from_slice(&(text.len() as u32).to_le_bytes());
        b[52..56].copy_from_slice(&status::EPROTONOSUPPORT.to_le_bytes());
        let crc = crc32c::crc32c(&b[0..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b.extend_from_slice(text.as_bytes());
        return b;
    }
    Message::HelloReply {
        id: RequestId(request_id),
        epoch: Epoch(0),
        status: status::EPROTONOSUPPORT,
        versions: VERSIONS,
        shard: 0,
        shards: 0,
        proof: None,
    }
    .encode()
}

/// An I/O request addressed to one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IoTarget {
    /// Placement group the sender computed; the receiver checks it.
    pub pg: PgId,
    /// The object.
    pub object: ObjectId,
    /// Byte offset within the object.
    pub offset: u32,
    /// Byte count.
    pub length: u32,
}

/// The authentication section of a HELLO: the sender's ticket, and its proof
/// that it holds the ticket's session key, over the HELLO's fields, a time and a
/// nonce (computed and checked in `flame_common::auth::handshake`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HelloAuth {
    /// The encoded ticket (at most [`HELLO_TICKET_BYTES_MAX`] bytes).
    pub ticket: Vec<u8>,
    /// When the sender made the proof (Unix ms): with the nonce, what the OSD's
    /// replay guard remembers.
    pub time_ms: u64,
    /// Random per connection.
    pub nonce: [u8; 16],
    /// HMAC-SHA256 under the session key.
    pub proof: [u8; 32],
}

/// Every message of the protocol. One enum, so a new message is one variant and the
/// compiler finds every place that must handle it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Opens a connection to one shard of an OSD. Its fields travel in a fixed
    /// [`HELLO_BODY_LEN`]-byte body (the payload), not in header fields meant for I/O.
    Hello {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// The protocol versions the sender speaks; the receiver refuses the HELLO
        /// with `EPROTONOSUPPORT` unless it contains the receiver's version.
        versions: Versions,
        /// The sender's ticket and its proof of the session key
        /// (`flame_common::auth::handshake`); `None` on a cluster without
        /// authentication. Boxed: the common messages stay small.
        auth: Option<Box<HelloAuth>>,
        /// The shard the sender believes it reached (its port); a mismatch means the
        /// sender's map is stale.
        shard: u16,
        /// Sent by another OSD (a replication connection, which multiplexes many
        /// clients' writes and so gets a larger in-flight bound).
        peer: bool,
        /// Who is connecting (random per client thread or OSD shard; 0 = no
        /// fencing).
        session: u64,
        /// Increases with every connection a session opens. When a session
        /// reconnects, the receiver stops executing requests still arriving on its
        /// older connections: a request resent on the new connection must never be
        /// overtaken by its stale original.
        generation: u64,
    },
    /// Answer to a HELLO, with a fixed [`HELLO_REPLY_BODY_LEN`]-byte body.
    HelloReply {
        /// The HELLO's id.
        id: RequestId,
        /// Replier's epoch.
        epoch: Epoch,
        /// 0, `ESTALE` (wrong shard or superseded session) or `EPROTONOSUPPORT`
        /// (no common protocol version).
        status: i32,
        /// The protocol versions the replier speaks.
        versions: Versions,
        /// The replier's shard number.
        shard: u16,
        /// The replier OSD's shard count (the sender checks it against its map).
        shards: u16,
        /// The OSD's proof that it holds the service key (answer to an
        /// authenticated HELLO): the client checks it before sending anything.
        proof: Option<[u8; HELLO_PROOF_LEN]>,
    },
    /// Read `target.length` bytes.
    Read {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// What to read.
        target: IoTarget,
        /// Flag bits.
        flags: u16,
        /// Where to put the data by a one-sided transfer (`len == target.length`);
        /// `None`: the data comes back inline in the reply.
        remote: Option<RemoteBuf>,
    },
    /// Write `target.length` bytes.
    Write {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// Where to write.
        target: IoTarget,
        /// Flag bits ([`flags::FUA`], [`flags::REPLICA`]).
        flags: u16,
        /// Position in the placement group's order (0 = none).
        seq: PgSeq,
        /// The client operation this is (the same on every resend; `NONE` for
        /// recovery and repair copies).
        op: OpId,
        /// Where to fetch the data by a one-sided transfer (`len == target.length`,
        /// `data` empty); `None`: the data is inline.
        remote: Option<RemoteBuf>,
        /// The bytes (inline data): a shared buffer, so forwarding it to every
        /// replica and writing it to the disk use the memory it was received into.
        data: PayloadBuf,
    },
    /// Zero a byte range.
    WriteZeroes {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// Range.
        target: IoTarget,
        /// Flag bits.
        flags: u16,
        /// Position in the placement group's order (0 = none).
        seq: PgSeq,
        /// The client operation this is (`NONE` for recovery and repair copies).
        op: OpId,
    },
    /// Discard a byte range (reads back as zeroes).
    Discard {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// Range.
        target: IoTarget,
        /// Flag bits.
        flags: u16,
        /// Position in the placement group's order (0 = none).
        seq: PgSeq,
        /// The client operation this is (`NONE` for recovery and repair copies).
        op: OpId,
    },
    /// Make one volume's acknowledged writes stable on the receiving shard.
    Flush {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// Flag bits ([`flags::REPLICA`] when forwarded).
        flags: u16,
        /// The volume whose writes must become stable (header `volume` field).
        volume: VolumeId,
    },
    /// Remove a volume's objects held by the receiving shard.
    DeleteVolume {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// Volume to remove.
        volume: VolumeId,
    },
    /// Liveness probe.
    Ping {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
    },
    /// Asks for the receiver's map if it is newer than `epoch` ([`OpCode::MapRequest`]).
    MapRequest {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
    },
    /// List the objects of placement group `pg` held by the receiving shard, in
    /// ascending (volume, index) order, starting at `start` (inclusive), at most
    /// `max` of them ([`PG_LIST_MAX`]). The reply's payload is
    /// [`encode_object_list`]; fewer than `max` entries means the listing is done.
    /// Header: `pg`, `volume`/`object` = `start`, `length` = `max`.
    PgList {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// The placement group.
        pg: PgId,
        /// First object to list (inclusive).
        start: ObjectId,
        /// Most entries in the reply (1..=[`PG_LIST_MAX`]).
        max: u32,
    },
    /// The objects of placement group `pg` that the receiving shard's restart left
    /// in doubt ([`OpCode::PgSuspects`]). The reply's payload is
    /// [`encode_object_list`], at most [`PG_LIST_MAX`] entries; a shard with more
    /// answers `status::E2BIG` (the primary then backfills). Header: `pg`;
    /// `offset` 1 for `rebooted_only`.
    PgSuspects {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// The placement group.
        pg: PgId,
        /// Only the objects whose doubt is a reboot's (the machine rebooted
        /// since their writes, or the shard cannot tell) — not those of a
        /// process crash, whose writes the page cache kept. A shard that does
        /// not know the field answers every object: a superset, so a crash's
        /// doubt is never claimed for a reboot's.
        rebooted_only: bool,
    },
    /// The client ops of placement group `pg`'s log on the receiving shard
    /// ([`OpCode::PgLogOps`]). The reply's payload is [`encode_log_ops`].
    /// Header: `pg`.
    PgLogOps {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// The placement group.
        pg: PgId,
    },
    /// The checksums of every block of one object as its data on disk is now: the
    /// receiver reads the whole object and checksums each block. Reply payload:
    /// [`encode_block_sums`]. `target.length` is 0; `target.offset` is 0, or
    /// [`OBJECT_SUMS_REWRITTEN`] to have the blocks the receiver rewrote since
    /// its restart marked (a receiver that does not know it answers without).
    ObjectSums {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// The object (offset and length 0).
        target: IoTarget,
    },
    /// Remove the receiver's copy of one object. Only from a primary (the
    /// [`flags::REPLICA`] bit, only on peer connections).
    RemoveObject {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// The object (offset and length 0).
        target: IoTarget,
        /// Flag bits ([`flags::REPLICA`]).
        flags: u16,
    },
    /// Compare every acting copy of `pg` object by object, block by block, and
    /// (unless `dry_run`) repair copies that differ from the agreeing majority.
    /// Sent to the group's primary. Reply payload: [`ScrubCounts::encode`].
    /// Header: `pg`, `offset` = 1 for a dry run.
    Scrub {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// The placement group.
        pg: PgId,
        /// Only compare, change nothing.
        dry_run: bool,
    },
    /// Asks for a reply area on this connection (remote fetching): `slots` slots
    /// of at least `slot_payload_bytes` payload bytes each. The reply's payload is
    /// a [`ReplyAreaInfo`] (what the shard granted, possibly less), or the status
    /// says why not (`EOPNOTSUPP`: the transport has no one-sided READ that
    /// bypasses the shard's CPU, so fetching would cost more than a push).
    /// Header: `length` = slots, `offset` = slot payload bytes.
    ReplyArea {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// Slots wanted (1..=[`REPLY_SLOTS_MAX`]).
        slots: u32,
        /// Payload bytes per slot wanted (at most [`REPLY_SLOT_PAYLOAD_BYTES_MAX`]).
        slot_payload_bytes: u32,
    },
    /// Push the reply of request `of` (see [`OpCode::PushReply`]). Header:
    /// `object` = `of`.
    PushReply {
        /// Request id (not answered).
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// The request whose reply is wanted by push.
        of: RequestId,
    },
    /// Answer to any request but HELLO.
    Reply {
        /// Which request kind this answers (never `Hello`: see
        /// [`Message::HelloReply`]).
        op: OpCode,
        /// The request's id.
        id: RequestId,
        /// Replier's epoch: a client seeing a newer epoch refreshes its map.
        epoch: Epoch,
        /// 0 or a negative errno ([`status`]).
        status: i32,
        /// Read data (empty otherwise), in the buffer it was read from the disk into.
        data: PayloadBuf,
    },
}

fn hello_body_len(auth: Option<&HelloAuth>) -> usize {
    HELLO_BODY_LEN + auth.map_or(0, |a| HELLO_AUTH_FIXED_LEN + a.ticket.len())
}

fn hello_reply_body_len(proof: Option<&[u8; HELLO_PROOF_LEN]>) -> usize {
    HELLO_REPLY_BODY_LEN + proof.map_or(0, |_| HELLO_PROOF_LEN)
}

fn encode_hello_body(
    versions: Versions,
    shard: u16,
    peer: bool,
    session: u64,
    generation: u64,
    auth: Option<&HelloAuth>,
) -> Vec<u8> {
    let mut b = vec![0u8; hello_body_len(auth)];
    b[0] = versions.min;
    b[1] = versions.max;
    b[2] = u8::from(peer);
    b[4..6].copy_from_slice(&shard.to_le_bytes());
    b[8..16].copy_from_slice(&session.to_le_bytes());
    b[16..24].copy_from_slice(&generation.to_le_bytes());
    if let Some(a) = auth {
        debug_assert!(a.ticket.len() <= HELLO_TICKET_BYTES_MAX);
        b[3] = HELLO_FLAG_AUTH;
        let t = u16::try_from(a.ticket.len()).unwrap_or(u16::MAX);
        b[32..34].copy_from_slice(&t.to_le_bytes());
        b[40..48].copy_from_slice(&a.time_ms.to_le_bytes());
        b[48..64].copy_from_slice(&a.nonce);
        b[64..96].copy_from_slice(&a.proof);
        b[96..].copy_from_slice(&a.ticket);
    }
    b
}

/// Decodes a HELLO body's authentication section (`rest`: what follows the fixed
/// body), bounded by [`HELLO_TICKET_BYTES_MAX`].
fn decode_hello_auth(rest: &[u8]) -> Result<HelloAuth, ProtocolError> {
    if rest.len() < HELLO_AUTH_FIXED_LEN {
        return Err(ProtocolError::Inconsistent("hello auth section too short"));
    }
    let ticket_len = usize::from(u16::from_le_bytes([rest[0], rest[1]]));
    if ticket_len > HELLO_TICKET_BYTES_MAX {
        return Err(ProtocolError::Inconsistent("hello ticket too long"));
    }
    if rest.len() != HELLO_AUTH_FIXED_LEN + ticket_len {
        return Err(ProtocolError::Inconsistent("hello auth section size"));
    }
    if rest[2..8].iter().any(|&x| x != 0) {
        return Err(ProtocolError::Inconsistent(
            "reserved hello auth bytes are not zero",
        ));
    }
    let mut nonce = [0u8; 16];
    nonce.copy_from_slice(&rest[16..32]);
    let mut proof = [0u8; 32];
    proof.copy_from_slice(&rest[32..64]);
    Ok(HelloAuth {
        ticket: rest[64..].to_vec(),
        time_ms: u64_at(rest, 8),
        nonce,
        proof,
    })
}

fn encode_hello_reply_body(
    versions: Versions,
    shard: u16,
    shards: u16,
    proof: Option<&[u8; HELLO_PROOF_LEN]>,
) -> Vec<u8> {
    let mut b = vec![0u8; hello_reply_body_len(proof)];
    b[0] = versions.min;
    b[1] = versions.max;
    b[4..6].copy_from_slice(&shard.to_le_bytes());
    b[6..8].copy_from_slice(&shards.to_le_bytes());
    if let Some(p) = proof {
        b[2] = HELLO_FLAG_AUTH;
        b[HELLO_REPLY_BODY_LEN..].copy_from_slice(p);
    }
    b
}

impl Message {
    /// The request id, for matching replies.
    pub fn id(&self) -> RequestId {
        match self {
            Message::Hello { id, .. }
            | Message::HelloReply { id, .. }
            | Message::Read { id, .. }
            | Message::Write { id, .. }
            | Message::WriteZeroes { id, .. }
            | Message::Discard { id, .. }
            | Message::Flush { id, .. }
            | Message::DeleteVolume { id, .. }
            | Message::Ping { id, .. }
            | Message::MapRequest { id, .. }
            | Message::PgList { id, .. }
            | Message::PgSuspects { id, .. }
            | Message::PgLogOps { id, .. }
            | Message::ObjectSums { id, .. }
            | Message::RemoveObject { id, .. }
            | Message::Scrub { id, .. }
            | Message::ReplyArea { id, .. }
            | Message::PushReply { id, .. }
            | Message::Reply { id, .. } => *id,
        }
    }

    /// Gives the message request id `new` (ids are per connection, so a message
    /// resent on another connection gets a new one).
    pub fn set_id(&mut self, new: RequestId) {
        match self {
            Message::Hello { id, .. }
            | Message::HelloReply { id, .. }
            | Message::Read { id, .. }
            | Message::Write { id, .. }
            | Message::WriteZeroes { id, .. }
            | Message::Discard { id, .. }
            | Message::Flush { id, .. }
            | Message::DeleteVolume { id, .. }
            | Message::Ping { id, .. }
            | Message::MapRequest { id, .. }
            | Message::PgList { id, .. }
            | Message::PgSuspects { id, .. }
            | Message::PgLogOps { id, .. }
            | Message::ObjectSums { id, .. }
            | Message::RemoveObject { id, .. }
            | Message::Scrub { id, .. }
            | Message::ReplyArea { id, .. }
            | Message::PushReply { id, .. }
            | Message::Reply { id, .. } => *id = new,
        }
    }

    /// The sender's map epoch.
    pub fn epoch(&self) -> Epoch {
        match self {
            Message::Hello { epoch, .. }
            | Message::HelloReply { epoch, .. }
            | Message::Read { epoch, .. }
            | Message::Write { epoch, .. }
            | Message::WriteZeroes { epoch, .. }
            | Message::Discard { epoch, .. }
            | Message::Flush { epoch, .. }
            | Message::DeleteVolume { epoch, .. }
            | Message::Ping { epoch, .. }
            | Message::MapRequest { epoch, .. }
            | Message::PgList { epoch, .. }
            | Message::PgSuspects { epoch, .. }
            | Message::PgLogOps { epoch, .. }
            | Message::ObjectSums { epoch, .. }
            | Message::RemoveObject { epoch, .. }
            | Message::Scrub { epoch, .. }
            | Message::ReplyArea { epoch, .. }
            | Message::PushReply { epoch, .. }
            | Message::Reply { epoch, .. } => *epoch,
        }
    }

    /// The header fields of this message, with `payload_len` set and `payload_crc`
    /// left at 0 (see [`Message::to_header`]).
    fn header_fields(&self) -> Header {
        fn io(op: OpCode, id: RequestId, epoch: Epoch, t: &IoTarget, flags: u16) -> Header {
            Header {
                opcode: op as u8,
                flags,
                request_id: id.0,
                epoch: epoch.0,
                volume: t.object.volume.0,
                object: t.object.index,
                offset: t.offset,
                length: t.length,
                pg: t.pg.0,
                ..Header::default()
            }
        }
        let base = |op: u8, id: RequestId, epoch: Epoch| Header {
            opcode: op,
            request_id: id.0,
            epoch: epoch.0,
            ..Header::default()
        };
        match self {
            Message::Hello {
                id, epoch, auth, ..
            } => Header {
                // At most 32 + 64 + 128 bytes.
                payload_len: hello_body_len(auth.as_deref()) as u32,
                ..base(OpCode::Hello as u8, *id, *epoch)
            },
            Message::HelloReply {
                id,
                epoch,
                status,
                proof,
                ..
            } => Header {
                status: *status,
                payload_len: hello_reply_body_len(proof.as_ref()) as u32,
                ..base(OpCode::Hello as u8 | REPLY_BIT, *id, *epoch)
            },
            Message::Read {
                id,
                epoch,
                target,
                flags,
                remote,
            } => {
                let mut h = io(OpCode::Read, *id, *epoch, target, *flags);
                h.set_remote(*remote);
                h
            }
            Message::Write {
                id,
                epoch,
                target,
                flags,
                seq,
                op,
                remote,
                data,
            } => {
                let mut h = io(OpCode::Write, *id, *epoch, target, *flags);
                h.pg_seq = seq.0;
                h.op_session = op.session;
                h.op_seq = op.seq;
                h.set_remote(*remote);
                h.payload_len = data.len() as u32;
                h
            }
            Message::WriteZeroes {
                id,
                epoch,
                target,
                flags,
                seq,
                op,
            } => Header {
                pg_seq: seq.0,
                op_session: op.session,
                op_seq: op.seq,
                ..io(OpCode::WriteZeroes, *id, *epoch, target, *flags)
            },
            Message::Discard {
                id,
                epoch,
                target,
                flags,
                seq,
                op,
            } => Header {
                pg_seq: seq.0,
                op_session: op.session,
                op_seq: op.seq,
                ..io(OpCode::Discard, *id, *epoch, target, *flags)
            },
            Message::Flush {
                id,
                epoch,
                flags,
                volume,
            } => Header {
                flags: *flags,
                volume: volume.0,
                ..base(OpCode::Flush as u8, *id, *epoch)
            },
            Message::DeleteVolume { id, epoch, volume } => Header {
                volume: volume.0,
                ..base(OpCode::DeleteVolume as u8, *id, *epoch)
            },
            Message::Ping { id, epoch } => base(OpCode::Ping as u8, *id, *epoch),
            Message::MapRequest { id, epoch } => base(OpCode::MapRequest as u8, *id, *epoch),
            Message::PgList {
                id,
                epoch,
                pg,
                start,
                max,
            } => Header {
                pg: pg.0,
                volume: start.volume.0,
                object: start.index,
                length: *max,
                ..base(OpCode::PgList as u8, *id, *epoch)
            },
            Message::PgSuspects {
                id,
                epoch,
                pg,
                rebooted_only,
            } => Header {
                pg: pg.0,
                offset: u32::from(*rebooted_only),
                ..base(OpCode::PgSuspects as u8, *id, *epoch)
            },
            Message::PgLogOps { id, epoch, pg } => Header {
                pg: pg.0,
                ..base(OpCode::PgLogOps as u8, *id, *epoch)
            },
            Message::ObjectSums { id, epoch, target } => {
                io(OpCode::ObjectSums, *id, *epoch, target, 0)
            }
            Message::RemoveObject {
                id,
                epoch,
                target,
                flags,
            } => io(OpCode::RemoveObject, *id, *epoch, target, *flags),
            Message::Scrub {
                id,
                epoch,
                pg,
                dry_run,
            } => Header {
                pg: pg.0,
                offset: u32::from(*dry_run),
                ..base(OpCode::Scrub as u8, *id, *epoch)
            },
            Message::ReplyArea {
                id,
                epoch,
                slots,
                slot_payload_bytes,
            } => Header {
                length: *slots,
                offset: *slot_payload_bytes,
                ..base(OpCode::ReplyArea as u8, *id, *epoch)
            },
            Message::PushReply { id, epoch, of } => Header {
                object: of.0,
                ..base(OpCode::PushReply as u8, *id, *epoch)
            },
            Message::Reply {
                op,
                id,
                epoch,
                status,
                data,
            } => Header {
                status: *status,
                payload_len: data.len() as u32,
                ..base(*op as u8 | REPLY_BIT, *id, *epoch)
            },
        }
    }

    /// The payload bytes of this message: the data of a write or read reply, or the
    /// encoded body of a HELLO or HELLO reply.
    pub fn payload(&self) -> Cow<'_, [u8]> {
        match self {
            Message::Hello {
                versions,
                shard,
                peer,
                session,
                generation,
                auth,
                ..
            } => Cow::Owned(encode_hello_body(
                *versions,
                *shard,
                *peer,
                *session,
                *generation,
                auth.as_deref(),
            )),
            Message::HelloReply {
                versions,
                shard,
                shards,
                proof,
                ..
            } => Cow::Owned(encode_hello_reply_body(
                *versions,
                *shard,
                *shards,
                proof.as_ref(),
            )),
            Message::Write { data, .. } | Message::Reply { data, .. } => {
                Cow::Borrowed(data.as_slice())
            }
            _ => Cow::Borrowed(&[]),
        }
    }

    /// The header describing this message (payload checksum included), and its
    /// payload.
    pub fn to_header(&self) -> (Header, Cow<'_, [u8]>) {
        let mut h = self.header_fields();
        let payload = self.payload();
        h.payload_crc = match self {
            // Remembered when the payload arrived (verified), so forwarding a write
            // to each replica does not checksum it again.
            Message::Write { data, .. } | Message::Reply { data, .. } => data.crc32c(),
            _ => crc32c::crc32c(&payload),
        };
        debug_assert_eq!(h.payload_len as usize, payload.len());
        (h, payload)
    }

    /// The whole message as bytes: header then payload.
    pub fn encode(&self) -> Vec<u8> {
        let (h, payload) = self.to_header();
        let mut b = Vec::with_capacity(HEADER_LEN + payload.len());
        b.extend_from_slice(&h.encode());
        b.extend_from_slice(&payload);
        b
    }

    /// Decodes one message from the start of `bytes`: `Ok(None)` when more bytes are
    /// needed, otherwise the message and how many bytes it took. Allocates at most
    /// the (bounded) payload length, and only once the whole payload is present.
    pub fn decode(bytes: &[u8]) -> Result<Option<(Message, usize)>, ProtocolError> {
        let Some(prefix) = bytes.get(..HEADER_PREFIX_LEN) else {
            return Ok(None);
        };
        let mut p = [0u8; HEADER_PREFIX_LEN];
        p.copy_from_slice(prefix);
        Header::check_prefix(&p)?;
        let Some(hb) = bytes.get(..HEADER_LEN) else {
            return Ok(None);
        };
        let mut b = [0u8; HEADER_LEN];
        b.copy_from_slice(hb);
        let h = Header::decode(&b)?;
        let end = HEADER_LEN + h.payload_len as usize;
        let Some(payload) = bytes.get(HEADER_LEN..end) else {
            return Ok(None);
        };
        Ok(Some((
            Message::from_parts(&h, PayloadBuf::copy_from(payload))?,
            end,
        )))
    }

    /// The payload buffer of a write or a reply (`None` for other messages), so a
    /// transport can send it by reference instead of copying it.
    pub fn payload_buf(&self) -> Option<&PayloadBuf> {
        match self {
            Message::Write { data, .. } | Message::Reply { data, .. } => Some(data),
            _ => None,
        }
    }

    /// Builds a message from a decoded header and its payload, checking the payload
    /// checksum and that the fields agree. `payload.len()` must equal
    /// `header.payload_len`. Fields the message does not use must be zero, so a
    /// message that decodes encodes back to the same bytes.
    pub fn from_parts(h: &Header, payload: PayloadBuf) -> Result<Message, ProtocolError> {
        if payload.len() != h.payload_len as usize {
            return Err(ProtocolError::Inconsistent(
                "payload length differs from header",
            ));
        }
        let actual = crc32c::crc32c(&payload);
        if actual != h.payload_crc {
            return Err(ProtocolError::BadPayloadChecksum {
                expected: h.payload_crc,
                actual,
            });
        }
        let payload = payload.with_verified_crc32c(actual);
        let msg = Message::build(h, payload)?;
        let mut expect = msg.header_fields();
        expect.payload_crc = h.payload_crc;
        if expect != *h {
            return Err(ProtocolError::Inconsistent(
                "a header field this message does not use is not zero",
            ));
        }
        Ok(msg)
    }

    fn build(h: &Header, payload: PayloadBuf) -> Result<Message, ProtocolError> {
        let id = RequestId(h.request_id);
        let epoch = Epoch(h.epoch);
        let target = || -> Result<IoTarget, ProtocolError> {
            if h.length > IO_BYTES_MAX {
                return Err(ProtocolError::TooLong {
                    what: "I/O range",
                    len: u64::from(h.length),
                    max: u64::from(IO_BYTES_MAX),
                });
            }
            if h.offset.checked_add(h.length).is_none() {
                return Err(ProtocolError::Inconsistent("offset + length overflows"));
            }
            Ok(IoTarget {
                pg: PgId(h.pg),
                object: ObjectId {
                    volume: VolumeId(h.volume),
                    index: h.object,
                },
                offset: h.offset,
                length: h.length,
            })
        };
        let remote = h.remote();
        if let Some(r) = remote
            && (r.len != h.length || r.len == 0)
        {
            return Err(ProtocolError::Inconsistent(
                "remote buffer length differs from the I/O length",
            ));
        }
        let flags = h.flags;
        let seq = PgSeq(h.pg_seq);
        if h.op().is_transport_internal() {
            return Err(ProtocolError::Inconsistent(
                "a one-sided transfer frame is the transport's, not a message",
            ));
        }
        let op = OpId {
            session: h.op_session,
            seq: h.op_seq,
        };
        if (op.session == 0) != (op.seq == 0) {
            return Err(ProtocolError::Inconsistent(
                "op session and op sequence must both be zero or both non-zero",
            ));
        }
        if h.is_reply() {
            if h.op() == OpCode::Hello {
                let b = &payload;
                let with_proof = b.len() > 2 && b[2] == HELLO_FLAG_AUTH;
                let expected = HELLO_REPLY_BODY_LEN + if with_proof { HELLO_PROOF_LEN } else { 0 };
                if b.len() != expected {
                    return Err(ProtocolError::Inconsistent("hello reply body size"));
                }
                if b[3..4].iter().chain(&b[8..16]).any(|&x| x != 0) || b[2] > HELLO_FLAG_AUTH {
                    return Err(ProtocolError::Inconsistent(
                        "reserved hello reply bytes are not zero",
                    ));
                }
                let proof = with_proof.then(|| {
                    let mut p = [0u8; HELLO_PROOF_LEN];
                    p.copy_from_slice(&b[HELLO_REPLY_BODY_LEN..]);
                    p
                });
                return Ok(Message::HelloReply {
                    id,
                    epoch,
                    status: h.status,
                    versions: Versions {
                        min: b[0],
                        max: b[1],
                    },
                    shard: u16::from_le_bytes([b[4], b[5]]),
                    shards: u16::from_le_bytes([b[6], b[7]]),
                    proof,
                });
            }
            return Ok(Message::Reply {
                op: h.op(),
                id,
                epoch,
                status: h.status,
                data: payload,
            });
        }
        Ok(match h.op() {
            OpCode::Hello => {
                if payload.len() < HELLO_BODY_LEN {
                    return Err(ProtocolError::Inconsistent("hello body size"));
                }
                let b = &payload;
                let auth = match b[3] {
                    0 if b.len() == HELLO_BODY_LEN => None,
                    0 => return Err(ProtocolError::Inconsistent("hello body size")),
                    HELLO_FLAG_AUTH => Some(Box::new(decode_hello_auth(&b[HELLO_BODY_LEN..])?)),
                    _ => {
                        return Err(ProtocolError::Inconsistent(
                            "reserved hello bytes are not zero",
                        ));
                    }
                };
                if b[6..8].iter().chain(&b[24..32]).any(|&x| x != 0) {
                    return Err(ProtocolError::Inconsistent(
                        "reserved hello bytes are not zero",
                    ));
                }
                let peer = match b[2] {
                    0 => false,
                    1 => true,
                    _ => return Err(ProtocolError::Inconsistent("hello role is not 0 or 1")),
                };
                Message::Hello {
                    id,
                    epoch,
                    versions: Versions {
                        min: b[0],
                        max: b[1],
                    },
                    shard: u16::from_le_bytes([b[4], b[5]]),
                    peer,
                    session: u64_at(b, 8),
                    generation: u64_at(b, 16),
                    auth,
                }
            }
            OpCode::Read => Message::Read {
                id,
                epoch,
                target: target()?,
                flags,
                remote,
            },
            OpCode::Write => {
                let target = target()?;
                let inline = if remote.is_some() { 0 } else { target.length };
                if inline != h.payload_len {
                    return Err(ProtocolError::Inconsistent(
                        "write length differs from payload",
                    ));
                }
                Message::Write {
                    id,
                    epoch,
                    target,
                    flags,
                    seq,
                    op,
                    remote,
                    data: payload,
                }
            }
            OpCode::WriteZeroes => Message::WriteZeroes {
                id,
                epoch,
                target: target()?,
                flags,
                seq,
                op,
            },
            OpCode::Discard => Message::Discard {
                id,
                epoch,
                target: target()?,
                flags,
                seq,
                op,
            },
            OpCode::Flush => Message::Flush {
                id,
                epoch,
                flags,
                volume: VolumeId(h.volume),
            },
            OpCode::DeleteVolume => Message::DeleteVolume {
                id,
                epoch,
                volume: VolumeId(h.volume),
            },
            OpCode::Ping => Message::Ping { id, epoch },
            OpCode::MapRequest => Message::MapRequest { id, epoch },
            OpCode::PgSuspects => Message::PgSuspects {
                id,
                epoch,
                pg: PgId(h.pg),
                rebooted_only: match h.offset {
                    0 => false,
                    1 => true,
                    _ => {
                        return Err(ProtocolError::Inconsistent(
                            "pg_suspects selection is not 0 or 1",
                        ));
                    }
                },
            },
            OpCode::PgLogOps => Message::PgLogOps {
                id,
                epoch,
                pg: PgId(h.pg),
            },
            OpCode::PgList => {
                if h.length == 0 || h.length > PG_LIST_MAX {
                    return Err(ProtocolError::TooLong {
                        what: "object listing",
                        len: u64::from(h.length),
                        max: u64::from(PG_LIST_MAX),
                    });
                }
                Message::PgList {
                    id,
                    epoch,
                    pg: PgId(h.pg),
                    start: ObjectId {
                        volume: VolumeId(h.volume),
                        index: h.object,
                    },
                    max: h.length,
                }
            }
            OpCode::ObjectSums => Message::ObjectSums {
                id,
                epoch,
                target: target()?,
            },
            OpCode::RemoveObject => Message::RemoveObject {
                id,
                epoch,
                target: target()?,
                flags,
            },
            OpCode::RemoteRead | OpCode::RemoteWrite => {
                return Err(ProtocolError::Inconsistent(
                    "a one-sided transfer frame is the transport's, not a message",
                ));
            }
            OpCode::Scrub => Message::Scrub {
                id,
                epoch,
                pg: PgId(h.pg),
                dry_run: match h.offset {
                    0 => false,
                    1 => true,
                    _ => return Err(ProtocolError::Inconsistent("scrub mode is not 0 or 1")),
                },
            },
            OpCode::ReplyArea => {
                if h.length == 0 || h.length > REPLY_SLOTS_MAX {
                    return Err(ProtocolError::TooLong {
                        what: "reply area slots",
                        len: u64::from(h.length),
                        max: u64::from(REPLY_SLOTS_MAX),
                    });
                }
                if h.offset > REPLY_SLOT_PAYLOAD_BYTES_MAX {
                    return Err(ProtocolError::TooLong {
                        what: "reply slot payload",
                        len: u64::from(h.offset),
                        max: u64::from(REPLY_SLOT_PAYLOAD_BYTES_MAX),
                    });
                }
                Message::ReplyArea {
                    id,
                    epoch,
                    slots: h.length,
                    slot_payload_bytes: h.offset,
                }
            }
            OpCode::PushReply => Message::PushReply {
                id,
                epoch,
                of: RequestId(h.object),
            },
        })
    }

    /// A reply to this request with the given status and no data. A HELLO gets a
    /// [`Message::HelloReply`] naming this build's versions and no shard.
    pub fn reply(&self, epoch: Epoch, status: i32) -> Message {
        if let Message::Hello { .. } = self {
            return Message::HelloReply {
                id: self.id(),
                epoch,
                status,
                versions: VERSIONS,
                shard: 0,
                shards: 0,
                proof: None,
            };
        }
        Message::Reply {
            op: self.op(),
            id: self.id(),
            epoch,
            status,
            data: PayloadBuf::empty(),
        }
    }

    /// The opcode of this message.
    pub fn op(&self) -> OpCode {
        match self {
            Message::Hello { .. } | Message::HelloReply { .. } => OpCode::Hello,
            Message::Read { .. } => OpCode::Read,
            Message::Write { .. } => OpCode::Write,
            Message::WriteZeroes { .. } => OpCode::WriteZeroes,
            Message::Discard { .. } => OpCode::Discard,
            Message::Flush { .. } => OpCode::Flush,
            Message::DeleteVolume { .. } => OpCode::DeleteVolume,
            Message::Ping { .. } => OpCode::Ping,
            Message::MapRequest { .. } => OpCode::MapRequest,
            Message::PgList { .. } => OpCode::PgList,
            Message::PgSuspects { .. } => OpCode::PgSuspects,
            Message::PgLogOps { .. } => OpCode::PgLogOps,
            Message::ObjectSums { .. } => OpCode::ObjectSums,
            Message::RemoveObject { .. } => OpCode::RemoveObject,
            Message::Scrub { .. } => OpCode::Scrub,
            Message::ReplyArea { .. } => OpCode::ReplyArea,
            Message::PushReply { .. } => OpCode::PushReply,
            Message::Reply { op, .. } => *op,
        }
    }
}

/// Most slots of one connection's reply area (remote fetching).
pub const REPLY_SLOTS_MAX: u32 = 1024;
/// Most payload bytes one reply slot holds: a reply larger than its slot is pushed.
pub const REPLY_SLOT_PAYLOAD_BYTES_MAX: u32 = 1 << 20;

/// A reply area as granted (the payload of a [`Message::ReplyArea`] reply): where
/// the client reads replies left for it, and their layout. Slot `i` starts at
/// `remote.addr + i * slot_bytes` and holds one encoded reply (its 128-byte
/// header, then its payload); the header's request id and both checksums tell
/// the client whether the slot holds the reply it waits for, completely.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplyAreaInfo {
    /// The granted memory (`len == slots * slot_bytes`).
    pub remote: RemoteBuf,
    /// Number of slots.
    pub slots: u32,
    /// Bytes per slot: [`HEADER_LEN`] + the largest payload a slot holds.
    pub slot_bytes: u32,
}

/// Size of an encoded [`ReplyAreaInfo`].
pub const REPLY_AREA_INFO_LEN: usize = 24;

impl ReplyAreaInfo {
    /// The reply payload: addr u64, len u32, key u32, slots u32, slot_bytes u32.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(REPLY_AREA_INFO_LEN);
        b.extend_from_slice(&self.remote.addr.to_le_bytes());
        b.extend_from_slice(&self.remote.len.to_le_bytes());
        b.extend_from_slice(&self.remote.key.to_le_bytes());
        b.extend_from_slice(&self.slots.to_le_bytes());
        b.extend_from_slice(&self.slot_bytes.to_le_bytes());
        b
    }

    /// Decodes and checks a reply payload: `None` unless the layout is consistent
    /// (slots within [`REPLY_SLOTS_MAX`], each slot at least a header and at most a
    /// header plus [`REPLY_SLOT_PAYLOAD_BYTES_MAX`], and exactly covering `len`).
    pub fn decode(b: &[u8]) -> Option<ReplyAreaInfo> {
        if b.len() != REPLY_AREA_INFO_LEN {
            return None;
        }
        let info = ReplyAreaInfo {
            remote: RemoteBuf {
                addr: u64_at(b, 0),
                len: u32_at(b, 8),
                key: u32_at(b, 12),
            },
            slots: u32_at(b, 16),
            slot_bytes: u32_at(b, 20),
        };
        let slot_ok = info.slot_bytes as usize >= HEADER_LEN
            && info.slot_bytes <= HEADER_LEN as u32 + REPLY_SLOT_PAYLOAD_BYTES_MAX;
        let covers =
            u64::from(info.slots) * u64::from(info.slot_bytes) == u64::from(info.remote.len);
        (info.slots >= 1 && info.slots <= REPLY_SLOTS_MAX && slot_ok && covers).then_some(info)
    }

    /// The descriptor of the first `len` bytes of slot `slot` (`None` if out of the
    /// area).
    pub fn slot(&self, slot: u32, len: u32) -> Option<RemoteBuf> {
        if slot >= self.slots || len == 0 || len > self.slot_bytes {
            return None;
        }
        let offset = u64::from(slot) * u64::from(self.slot_bytes);
        Some(RemoteBuf {
            addr: self.remote.addr.checked_add(offset)?,
            len,
            key: self.remote.key,
        })
    }

    /// The id modulus of a connection with this area: request `id` uses slot
    /// `id % modulus` when it is below `slots`; the extra residue `slots` is for
    /// requests whose reply is pushed.
    pub fn modulus(&self) -> u64 {
        u64::from(self.slots) + 1
    }
}

/// Most objects one [`Message::PgList`] reply lists (16 bytes each: 1 MiB).
pub const PG_LIST_MAX: u32 = 65_536;

/// A [`Message::PgList`] reply's payload: 16 bytes per object, volume id then
/// object index (little-endian u64s).
pub fn encode_object_list(objects: &[ObjectId]) -> Vec<u8> {
    let mut b = Vec::with_capacity(objects.len() * 16);
    for o in objects {
        b.extend_from_slice(&o.volume.0.to_le_bytes());
        b.extend_from_slice(&o.index.to_le_bytes());
    }
    b
}

/// Decodes [`encode_object_list`]; `None` if the length is not a multiple of 16 or
/// the list is longer than [`PG_LIST_MAX`] (no PG_LIST or PG_SUSPECTS reply may be:
/// a longer one is a broken peer, and its list would be trusted as complete).
pub fn decode_object_list(b: &[u8]) -> Option<Vec<ObjectId>> {
    if !b.len().is_multiple_of(16) || b.len() / 16 > PG_LIST_MAX as usize {
        return None;
    }
    Some(
        b.chunks_exact(16)
            .map(|c| ObjectId {
                volume: VolumeId(u64_at(c, 0)),
                index: u64_at(c, 8),
            })
            .collect(),
    )
}

/// One client op of a placement group's log, as [`Message::PgLogOps`] reports
/// it: the log entry's sequence number, the op, and the object it wrote.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LogOp {
    /// The entry's placement-group sequence number.
    pub seq: u64,
    /// The client op (never [`OpId::NONE`]: entries without one are not reported).
    pub op: OpId,
    /// The object it wrote.
    pub object: ObjectId,
}

/// A [`Message::PgLogOps`] reply: the highest sequence number the log has
/// dropped (its entries at or below may be gone), then its client ops.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LogOps {
    /// Highest sequence number trimmed from the log (0: none).
    pub trimmed_through: u64,
    /// The retained entries' client ops.
    pub ops: Vec<LogOp>,
}

/// Bytes of one [`LogOp`] in [`encode_log_ops`].
const LOG_OP_BYTES: usize = 40;
const _: () = assert!(8 + LOG_OP_BYTES * PG_LIST_MAX as usize <= PAYLOAD_BYTES_MAX as usize);

/// A [`Message::PgLogOps`] reply's payload: `trimmed_through` (u64), then 40
/// bytes per op: seq, session, op seq, volume, object index (little-endian u64s).
/// At most [`PG_LIST_MAX`] ops (2.5 MiB, within [`PAYLOAD_BYTES_MAX`]; a
/// longer log reports its newest and counts the rest as trimmed).
pub fn encode_log_ops(log: &LogOps) -> Vec<u8> {
    let mut b = Vec::with_capacity(8 + log.ops.len() * LOG_OP_BYTES);
    b.extend_from_slice(&log.trimmed_through.to_le_bytes());
    for o in &log.ops {
        for v in [
            o.seq,
            o.op.session,
            o.op.seq,
            o.object.volume.0,
            o.object.index,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
    }
    b
}

/// Decodes [`encode_log_ops`]; `None` if the length does not fit, the list is
/// longer than [`PG_LIST_MAX`] or an op is [`OpId::NONE`] (a broken peer).
pub fn decode_log_ops(b: &[u8]) -> Option<LogOps> {
    let (head, rest) = b.split_at_checked(8)?;
    if !rest.len().is_multiple_of(LOG_OP_BYTES) || rest.len() / LOG_OP_BYTES > PG_LIST_MAX as usize
    {
        return None;
    }
    let ops = rest
        .chunks_exact(LOG_OP_BYTES)
        .map(|c| {
            let op = OpId {
                session: u64_at(c, 8),
                seq: u64_at(c, 16),
            };
            (!op.is_none()).then_some(LogOp {
                seq: u64_at(c, 0),
                op,
                object: ObjectId {
                    volume: VolumeId(u64_at(c, 24)),
                    index: u64_at(c, 32),
                },
            })
        })
        .collect::<Option<Vec<_>>>()?;
    Some(LogOps {
        trimmed_through: u64_at(head, 0),
        ops,
    })
}

/// One block of an object as a copy holds it: a fingerprint of its data now (a
/// non-linear 32-bit hash, 0 = all zeroes or a hole; not the stored crc32c, which
/// is the same for every block that ends with its own crc32c), and whether that data fails the copy's own stored checksum
/// (a corrupt block: its data must not be used, whatever its value).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct BlockSum {
    /// Fingerprint of the block's data (0: all zeroes), equal on two copies when
    /// their data is.
    pub sum: u32,
    /// The data does not match the checksum the copy recorded when it was written.
    pub bad: bool,
    /// The copy wrote this block whole since it last started, while its restart
    /// left the object in doubt: it holds that write whatever a power cut took
    /// (`flame-osd/src/store/rewritten.rs`). Only in answers to an
    /// [`Message::ObjectSums`] that asks for it; otherwise false.
    pub rewritten: bool,
}

/// [`Message::ObjectSums`]'s `target.offset` asking for
/// [`BlockSum::rewritten`].
pub const OBJECT_SUMS_REWRITTEN: u32 = 1;

/// Most blocks of one object (64 MiB of 4 KiB blocks).
pub const OBJECT_BLOCKS_MAX: usize = 16_384;

/// A [`Message::ObjectSums`] reply's payload: 8 bytes per block from block 0 (u32
/// sum, u32 flags with bit 0 = bad, bit 1 = rewritten), trailing all-zero good
/// blocks not rewritten left out (so an absent object is an empty payload).
pub fn encode_block_sums(sums: &[BlockSum]) -> Vec<u8> {
    let mut end = sums.len();
    while end > 0 && sums[end - 1] == BlockSum::default() {
        end -= 1;
    }
    let mut b = Vec::with_capacity(end * 8);
    for s in &sums[..end] {
        b.extend_from_slice(&s.sum.to_le_bytes());
        let flags = u32::from(s.bad) | u32::from(s.rewritten) << 1;
        b.extend_from_slice(&flags.to_le_bytes());
    }
    b
}

/// Decodes [`encode_block_sums`]; `None` for a malformed payload.
pub fn decode_block_sums(b: &[u8]) -> Option<Vec<BlockSum>> {
    if !b.len().is_multiple_of(8) || b.len() / 8 > OBJECT_BLOCKS_MAX {
        return None;
    }
    b.chunks(8)
        .map(|c| match u32_at(c, 4) {
            flags @ 0..=3 => Some(BlockSum {
                sum: u32_at(c, 0),
                bad: flags & 1 != 0,
                rewritten: flags & 2 != 0,
            }),
            _ => None,
        })
        .collect()
}

/// What a [`Message::Scrub`] found in one placement group (its reply payload:
/// five little-endian u64s in field order).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScrubCounts {
    /// Objects compared across the acting copies.
    pub objects_checked: u64,
    /// Objects whose copies did not all agree (or had a block failing its checksum).
    pub inconsistent: u64,
    /// Objects whose disagreeing copies were rewritten.
    pub repaired: u64,
    /// Objects where two copies disagreed with no majority: the primary's copy won.
    pub primary_won: u64,
    /// Objects that could not be compared or repaired (a copy unreachable, a read
    /// failing, or no copy of a block verifying).
    pub errors: u64,
}

/// Size of an encoded [`ScrubCounts`].
pub const SCRUB_COUNTS_LEN: usize = 40;

impl ScrubCounts {
    /// The reply payload.
    pub fn encode(&self) -> Vec<u8> {
        [
            self.objects_checked,
            self.inconsistent,
            self.repaired,
            self.primary_won,
            self.errors,
        ]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
    }

    /// Decodes a reply payload; `None` if it is not [`SCRUB_COUNTS_LEN`] bytes.
    pub fn decode(b: &[u8]) -> Option<ScrubCounts> {
        if b.len() != SCRUB_COUNTS_LEN {
            return None;
        }
        Some(ScrubCounts {
            objects_checked: u64_at(b, 0),
            inconsistent: u64_at(b, 8),
            repaired: u64_at(b, 16),
            primary_won: u64_at(b, 24),
            errors: u64_at(b, 32),
        })
    }

    /// Adds another group's counts. Saturating: the counts come from OSDs'
    /// replies, and a broken or hostile OSD's `u64::MAX` must not make the
    /// caller (flame-admin's total over every group) overflow and panic.
    pub fn add(&mut self, o: &ScrubCounts) {
        self.objects_checked = self.objects_checked.saturating_add(o.objects_checked);
        self.inconsistent = self.inconsistent.saturating_add(o.inconsistent);
        self.repaired = self.repaired.saturating_add(o.repaired);
        self.primary_won = self.primary_won.saturating_add(o.primary_won);
        self.errors = self.errors.saturating_add(o.errors);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    fn roundtrip(m: Message) {
        let bytes = m.encode();
        let (m2, used) = Message::decode(&bytes).unwrap().unwrap();
        assert_eq!(used, bytes.len());
        assert_eq!(m, m2);
        assert_eq!(m2.encode(), bytes);
    }

    fn target() -> IoTarget {
        IoTarget {
            pg: PgId(9),
            object: ObjectId {
                volume: VolumeId(3),
                index: 77,
            },
            offset: 4096,
            length: 8,
        }
    }

    fn examples() -> Vec<Message> {
        let id = RequestId(42);
        let epoch = Epoch(5);
        vec![
            Message::Hello {
                id,
                epoch,
                versions: VERSIONS,
                shard: 3,
                peer: false,
                session: 0,
                generation: 0,
                auth: None,
            },
            Message::Hello {
                id,
                epoch,
                versions: Versions { min: 2, max: 9 },
                shard: 3,
                peer: true,
                session: 0xdead_beef,
                generation: 7,
                auth: Some(Box::new(HelloAuth {
                    ticket: (0..120u8).collect(),
                    time_ms: 1_900_000_000_123,
                    nonce: [7; 16],
                    proof: [9; 32],
                })),
            },
            Message::HelloReply {
                id,
                epoch,
                status: 0,
                versions: VERSIONS,
                shard: 1,
                shards: 4,
                proof: None,
            },
            Message::HelloReply {
                id,
                epoch,
                status: 0,
                versions: VERSIONS,
                shard: 1,
                shards: 4,
                proof: Some([3; 32]),
            },
            Message::Read {
                id,
                epoch,
                target: target(),
                flags: 0,
                remote: None,
            },
            Message::Read {
                id,
                epoch,
                target: target(),
                flags: 0,
                remote: Some(RemoteBuf {
                    addr: 0x7f00_0000_1000,
                    len: 8,
                    key: 0x1234,
                }),
            },
            Message::Write {
                id,
                epoch,
                target: target(),
                flags: flags::FUA,
                seq: PgSeq(99),
                op: crate::ids::OpId {
                    session: 0xfeed_0000_0000_beef,
                    seq: 7,
                },
                remote: None,
                data: PayloadBuf::copy_from(&[7; 8]),
            },
            Message::Write {
                id,
                epoch,
                target: target(),
                flags: 0,
                seq: PgSeq(0),
                op: crate::ids::OpId::NONE,
                remote: Some(RemoteBuf {
                    addr: 1,
                    len: 8,
                    key: 2,
                }),
                data: PayloadBuf::empty(),
            },
            Message::WriteZeroes {
                id,
                epoch,
                target: target(),
                flags: 0,
                seq: PgSeq(1),
                op: crate::ids::OpId::NONE,
            },
            Message::Discard {
                id,
                epoch,
                target: target(),
                flags: 0,
                seq: PgSeq(2),
                op: crate::ids::OpId {
                    session: 1,
                    seq: u64::MAX,
                },
            },
            Message::Flush {
                id,
                epoch,
                flags: flags::REPLICA,
                volume: VolumeId(3),
            },
            Message::DeleteVolume {
                id,
                epoch,
                volume: VolumeId(3),
            },
            Message::PgSuspects {
                id,
                epoch,
                pg: PgId(4),
                rebooted_only: false,
            },
            Message::PgSuspects {
                id,
                epoch,
                pg: PgId(4),
                rebooted_only: true,
            },
            Message::PgLogOps {
                id,
                epoch,
                pg: PgId(5),
            },
            Message::Ping { id, epoch },
            Message::MapRequest { id, epoch },
            Message::PgList {
                id,
                epoch,
                pg: PgId(9),
                start: ObjectId {
                    volume: VolumeId(3),
                    index: 5,
                },
                max: 100,
            },
            Message::ObjectSums {
                id,
                epoch,
                target: IoTarget {
                    offset: 0,
                    length: 0,
                    ..target()
                },
            },
            Message::RemoveObject {
                id,
                epoch,
                target: IoTarget {
                    offset: 0,
                    length: 0,
                    ..target()
                },
                flags: flags::REPLICA,
            },
            Message::Scrub {
                id,
                epoch,
                pg: PgId(4),
                dry_run: true,
            },
            Message::ReplyArea {
                id,
                epoch,
                slots: 64,
                slot_payload_bytes: 4096,
            },
            Message::PushReply {
                id,
                epoch,
                of: RequestId(7),
            },
            Message::Read {
                id,
                epoch,
                target: target(),
                flags: flags::FETCH_REPLY,
                remote: None,
            },
            Message::Reply {
                op: OpCode::Read,
                id,
                epoch,
                status: status::EIO,
                data: PayloadBuf::copy_from(&[1, 2, 3]),
            },
        ]
    }

    #[test]
    fn reply_area_info_is_checked() {
        let info = ReplyAreaInfo {
            remote: RemoteBuf {
                addr: 0x1000,
                len: 4 * 4224,
                key: 9,
            },
            slots: 4,
            slot_bytes: 4224,
        };
        assert_eq!(ReplyAreaInfo::decode(&info.encode()), Some(info));
        assert_eq!(info.modulus(), 5);
        assert_eq!(
            info.slot(3, 128),
            Some(RemoteBuf {
                addr: 0x1000 + 3 * 4224,
                len: 128,
                key: 9
            })
        );
        assert_eq!(info.slot(4, 128), None);
        assert_eq!(info.slot(0, 4225), None);
        // A length that does not match the slots, or slots out of bounds: refused.
        let mut bad = info;
        bad.remote.len += 1;
        assert_eq!(ReplyAreaInfo::decode(&bad.encode()), None);
        let mut bad = info;
        bad.slots = 0;
        bad.remote.len = 0;
        assert_eq!(ReplyAreaInfo::decode(&bad.encode()), None);
        let mut bad = info;
        bad.slot_bytes = 64;
        bad.remote.len = 256;
        assert_eq!(ReplyAreaInfo::decode(&bad.encode()), None);
        assert_eq!(ReplyAreaInfo::decode(&[0; 23]), None);
    }

    #[test]
    fn recovery_payloads_roundtrip() {
        let objs = vec![
            ObjectId {
                volume: VolumeId(1),
                index: 2,
            },
            ObjectId {
                volume: VolumeId(u64::MAX),
                index: 0,
            },
        ];
        assert_eq!(
            decode_object_list(&encode_object_list(&objs)).unwrap(),
            objs
        );
        assert!(decode_object_list(&[0; 15]).is_none());
        let sums = vec![
            BlockSum {
                sum: 7,
                bad: false,
                rewritten: false,
            },
            BlockSum {
                sum: 0,
                bad: true,
                rewritten: false,
            },
            BlockSum {
                sum: 0,
                bad: false,
                rewritten: true,
            },
            BlockSum {
                sum: 9,
                bad: true,
                rewritten: true,
            },
            BlockSum::default(),
        ];
        let b = encode_block_sums(&sums);
        assert_eq!(b.len(), 32, "trailing zero blocks are left out");
        assert_eq!(decode_block_sums(&b).unwrap(), sums[..4].to_vec());
        assert_eq!(encode_block_sums(&sums[..2]).len(), 16);
        assert!(decode_block_sums(&[0, 0, 0, 0, 4, 0, 0, 0]).is_none());
        let c = ScrubCounts {
            objects_checked: 1,
            inconsistent: 2,
            repaired: 3,
            primary_won: 4,
            errors: 5,
        };
        assert_eq!(ScrubCounts::decode(&c.encode()), Some(c));
        assert!(ScrubCounts::decode(&[0; 8]).is_none());
    }

    #[test]
    fn all_messages_roundtrip() {
        for m in examples() {
            roundtrip(m);
        }
    }

    #[test]
    fn header_is_two_checked_cache_lines() {
        assert_eq!(HEADER_LEN % 64, 0);
        assert_eq!(HEADER_PREFIX_LEN, V1_HEADER_LEN);
    }

    #[test]
    fn garbage_is_rejected_before_lengths_are_trusted() {
        let mut b = [0xffu8; HEADER_LEN];
        assert!(matches!(
            Header::decode(&b),
            Err(ProtocolError::BadMagic(_))
        ));
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        assert_eq!(Header::decode(&b), Err(ProtocolError::BadChecksum));
    }

    #[test]
    fn oversized_payload_rejected() {
        let h = Header {
            opcode: OpCode::Write as u8,
            payload_len: PAYLOAD_BYTES_MAX + 1,
            ..Default::default()
        };
        assert!(matches!(
            Header::decode(&h.encode()),
            Err(ProtocolError::TooLong { .. })
        ));
    }

    #[test]
    fn unknown_opcode_and_flags_rejected() {
        let h = Header {
            opcode: 99,
            ..Default::default()
        };
        assert_eq!(
            Header::decode(&h.encode()),
            Err(ProtocolError::BadOpcode(99))
        );
        let h = Header {
            opcode: 2,
            flags: 0x100,
            ..Default::default()
        };
        assert_eq!(
            Header::decode(&h.encode()),
            Err(ProtocolError::BadFlags(0x100))
        );
    }

    /// A HELLO body with an authentication section is decoded only with its
    /// exact size, a bounded ticket and zero reserved bytes; a reply's proof
    /// only with the flag that announces it.
    #[test]
    fn hello_auth_sections_are_bounded_and_exact() {
        let hello_with = |body: Vec<u8>| {
            let h = Header {
                opcode: OpCode::Hello as u8,
                payload_len: body.len() as u32,
                payload_crc: crc32c::crc32c(&body),
                ..Default::default()
            };
            let h = Header::decode(&h.encode()).unwrap();
            Message::from_parts(&h, PayloadBuf::copy_from(&body))
        };
        let auth = HelloAuth {
            ticket: vec![7; HELLO_TICKET_BYTES_MAX],
            time_ms: 5,
            nonce: [1; 16],
            proof: [2; 32],
        };
        let good = encode_hello_body(VERSIONS, 1, false, 3, 4, Some(&auth));
        assert_eq!(
            good.len(),
            HELLO_BODY_LEN + HELLO_AUTH_FIXED_LEN + HELLO_TICKET_BYTES_MAX
        );
        match hello_with(good.clone()).unwrap() {
            Message::Hello { auth: Some(a), .. } => assert_eq!(*a, auth),
            other => panic!("{other:?}"),
        }
        let mut b = good.clone();
        b.push(0);
        assert!(hello_with(b).is_err(), "one byte more than the ticket says");
        let mut b = good.clone();
        b[32..34].copy_from_slice(&(HELLO_TICKET_BYTES_MAX as u16 + 1).to_le_bytes());
        b.push(7);
        assert!(hello_with(b).is_err(), "a ticket over the bound");
        let mut b = good.clone();
        b[36] = 1;
        assert!(hello_with(b).is_err(), "reserved auth bytes");
        let mut b = good.clone();
        b[3] = 0;
        assert!(
            hello_with(b).is_err(),
            "a body longer than 32 without the flag"
        );
        let mut b = good.clone();
        b[3] = 2;
        assert!(hello_with(b).is_err(), "an unknown flag");
        assert!(
            hello_with(good[..HELLO_BODY_LEN + 10].to_vec()).is_err(),
            "cut short"
        );
        // The reply's proof.
        let r = encode_hello_reply_body(VERSIONS, 0, 1, Some(&[9; 32]));
        let reply_with = |body: Vec<u8>| {
            let h = Header {
                opcode: OpCode::Hello as u8 | REPLY_BIT,
                payload_len: body.len() as u32,
                payload_crc: crc32c::crc32c(&body),
                ..Default::default()
            };
            let h = Header::decode(&h.encode()).unwrap();
            Message::from_parts(&h, PayloadBuf::copy_from(&body))
        };
        assert!(matches!(
            reply_with(r.clone()).unwrap(),
            Message::HelloReply { proof: Some(p), .. } if p == [9; 32]
        ));
        let mut b = r.clone();
        b[2] = 0;
        assert!(reply_with(b).is_err(), "a proof without its flag");
        assert!(
            reply_with(r[..20].to_vec()).is_err(),
            "a flag without its proof"
        );
    }

    #[test]
    fn inconsistent_messages_rejected() {
        let h = Header {
            opcode: OpCode::Write as u8,
            length: 16,
            payload_len: 8,
            payload_crc: crc32c::crc32c(&[0; 8]),
            ..Default::default()
        };
        let h = Header::decode(&h.encode()).unwrap();
        assert!(Message::from_parts(&h, PayloadBuf::zeroed(8)).is_err());
        let h = Header {
            opcode: OpCode::Read as u8,
            offset: u32::MAX,
            length: 2,
            ..Default::default()
        };
        let h = Header::decode(&h.encode()).unwrap();
        assert!(Message::from_parts(&h, PayloadBuf::empty()).is_err());
        // A field the message does not carry (a PING with a volume) is refused, not
        // silently dropped.
        let h = Header {
            opcode: OpCode::Ping as u8,
            volume: 5,
            ..Default::default()
        };
        let h = Header::decode(&h.encode()).unwrap();
        assert!(matches!(
            Message::from_parts(&h, PayloadBuf::empty()),
            Err(ProtocolError::Inconsistent(_))
        ));
    }

    #[test]
    fn op_ids_travel_in_bytes_92_to_108_and_half_ids_are_refused() {
        let op = OpId {
            session: 0x0102_0304_0506_0708,
            seq: 0x1112_1314_1516_1718,
        };
        let m = Message::Discard {
            id: RequestId(1),
            epoch: Epoch(2),
            target: target(),
            flags: 0,
            seq: PgSeq(0),
            op,
        };
        let b = m.encode();
        assert_eq!(u64_at(&b, 92), op.session);
        assert_eq!(u64_at(&b, 100), op.seq);
        assert!(b[108..124].iter().all(|&x| x == 0));
        assert_eq!(Message::decode(&b).unwrap().unwrap().0, m);
        // A session without a sequence (or the reverse) is malformed.
        for (session, seq) in [(5u64, 0u64), (0, 5)] {
            let h = Header {
                opcode: OpCode::Discard as u8,
                length: 16,
                op_session: session,
                op_seq: seq,
                ..Default::default()
            };
            let h = Header::decode(&h.encode()).unwrap();
            assert!(matches!(
                Message::from_parts(&h, PayloadBuf::empty()),
                Err(ProtocolError::Inconsistent(_))
            ));
        }
        // A read carries no op id: one there is refused, not ignored.
        let h = Header {
            opcode: OpCode::Read as u8,
            length: 16,
            op_session: 1,
            op_seq: 1,
            ..Default::default()
        };
        let h = Header::decode(&h.encode()).unwrap();
        assert!(Message::from_parts(&h, PayloadBuf::empty()).is_err());
        // Bytes 108..124 are still reserved.
        let mut b = m.encode();
        b[110] = 1;
        fix_checksums(&mut b);
        assert!(matches!(
            Message::decode(&b),
            Err(ProtocolError::Inconsistent(_))
        ));
    }

    /// PG_SUSPECTS's selection rides in `offset` (0 every object, 1 a reboot's
    /// only); another value is refused, not read as either.
    #[test]
    fn pg_suspects_selection_is_offset_0_or_1() {
        for (rebooted_only, offset) in [(false, 0u32), (true, 1)] {
            let m = Message::PgSuspects {
                id: RequestId(3),
                epoch: Epoch(2),
                pg: PgId(9),
                rebooted_only,
            };
            let (h, _) = m.to_header();
            assert_eq!((h.offset, h.pg), (offset, 9));
            assert_eq!(Message::decode(&m.encode()).unwrap().unwrap().0, m);
        }
        let h = Header {
            opcode: OpCode::PgSuspects as u8,
            offset: 2,
            ..Default::default()
        };
        let h = Header::decode(&h.encode()).unwrap();
        assert!(matches!(
            Message::from_parts(&h, PayloadBuf::empty()),
            Err(ProtocolError::Inconsistent(_))
        ));
    }

    #[test]
    fn corrupted_payload_is_caught() {
        let m = Message::Write {
            id: RequestId(1),
            epoch: Epoch(1),
            target: target(),
            flags: 0,
            seq: PgSeq(0),
            op: crate::ids::OpId::NONE,
            remote: None,
            data: PayloadBuf::copy_from(&[1, 2, 3, 4, 5, 6, 7, 8]),
        };
        let good = m.encode();
        for i in HEADER_LEN..good.len() {
            let mut b = good.clone();
            b[i] ^= 0x01;
            assert!(
                matches!(
                    Message::decode(&b),
                    Err(ProtocolError::BadPayloadChecksum { .. })
                ),
                "corrupting payload byte {i} went unnoticed"
            );
        }
    }

    #[test]
    fn every_single_byte_corruption_is_caught() {
        let m = Message::Read {
            id: RequestId(1),
            epoch: Epoch(2),
            target: target(),
            flags: 0,
            remote: None,
        };
        let good = m.to_header().0.encode();
        for i in 0..HEADER_LEN {
            let mut b = good;
            b[i] ^= 0x5a;
            assert!(
                Header::decode(&b).is_err(),
                "corrupting byte {i} went unnoticed"
            );
        }
    }

    /// A protocol-v1 HELLO, byte for byte as a v1 build sent it.
    fn v1_hello(request_id: u64) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = 1;
        b[5] = OpCode::Hello as u8;
        b[8..16].copy_from_slice(&request_id.to_le_bytes());
        let crc = crc32c::crc32c(&b[0..60]);
        b[60..64].copy_from_slice(&crc.to_le_bytes());
        b
    }

    #[test]
    fn a_v1_header_is_recognised_from_its_first_64_bytes() {
        let b = v1_hello(17);
        assert_eq!(
            Header::check_prefix(&b),
            Err(ProtocolError::ForeignVersion {
                peer_version: 1,
                request_id: 17
            })
        );
        // Message::decode needs no more than those 64 bytes to say so.
        assert!(matches!(
            Message::decode(&b),
            Err(ProtocolError::ForeignVersion {
                peer_version: 1,
                ..
            })
        ));
        let text = ProtocolError::ForeignVersion {
            peer_version: 1,
            request_id: 17,
        }
        .to_string();
        assert!(
            text.contains("version 1") && text.contains(&format!("version {VERSION}")),
            "{text}"
        );
    }

    #[test]
    fn a_v1_peer_can_decode_its_refusal() {
        let r = version_refusal(1, 17);
        // What a v1 decoder checks: magic, crc of 0..60, version 1, then the payload.
        assert_eq!(&r[0..4], b"FLME");
        assert_eq!(r[4], 1);
        assert_eq!(r[5], 0x81);
        assert_eq!(crc32c::crc32c(&r[0..60]), u32_at(&r, 60));
        assert_eq!(u64_at(&r, 8), 17);
        assert_eq!(u32_at(&r, 52) as i32, status::EPROTONOSUPPORT);
        assert_eq!(u32_at(&r, 44), u32::from(VERSION));
        let len = u32_at(&r, 48) as usize;
        assert_eq!(r.len(), 64 + len);
        let text = std::str::from_utf8(&r[64..]).unwrap();
        assert!(
            text.contains("version 1") && text.contains(&format!("version {VERSION}")),
            "{text}"
        );
        // A later version gets a HELLO reply of this version.
        let (m, _) = Message::decode(&version_refusal(VERSION + 1, 5))
            .unwrap()
            .unwrap();
        assert_eq!(
            m,
            Message::HelloReply {
                id: RequestId(5),
                epoch: Epoch(0),
                status: status::EPROTONOSUPPORT,
                versions: VERSIONS,
                shard: 0,
                shards: 0,
                proof: None,
            }
        );
    }

    /// Decoding must never panic, and what decodes must re-encode to the same bytes.
    fn check_bytes(b: &[u8]) {
        if let Some(hb) = b.get(..HEADER_LEN) {
            let hb: &[u8; HEADER_LEN] = hb.try_into().unwrap();
            if let Ok(h) = Header::decode(hb) {
                assert_eq!(&h.encode(), hb, "header re-encodes differently");
            }
        }
        if let Ok(Some((m, used))) = Message::decode(b) {
            assert!(used <= b.len());
            assert!(used - HEADER_LEN <= PAYLOAD_BYTES_MAX as usize);
            assert_eq!(m.encode(), &b[..used], "{m:?} re-encodes differently");
        }
    }

    /// Recomputes both header checksums and the payload checksum, so a mutation
    /// reaches the field checks instead of stopping at a checksum.
    fn fix_checksums(b: &mut [u8]) {
        if b.len() < HEADER_LEN {
            return;
        }
        let c = crc32c::crc32c(&b[0..60]);
        b[60..64].copy_from_slice(&c.to_le_bytes());
        let plen = (u32_at(b, 48) as usize).min(b.len() - HEADER_LEN);
        let c = crc32c::crc32c(&b[HEADER_LEN..HEADER_LEN + plen]);
        b[72..76].copy_from_slice(&c.to_le_bytes());
        let c = crc32c::crc32c(&b[64..124]);
        b[124..128].copy_from_slice(&c.to_le_bytes());
    }

    /// The property test run in CI (the cargo-fuzz target in fuzz/ runs the same
    /// check unboundedly): seeded, bounded, over (a) arbitrary bytes, (b) arbitrary
    /// bytes behind a valid magic and version, and (c) valid messages with random
    /// bytes changed and their checksums fixed up so the change reaches every field
    /// check. Each case also decodes every prefix-truncation of itself.
    #[test]
    fn decoding_arbitrary_bytes_never_panics_and_roundtrips() {
        const CASES: usize = 20_000;
        let seed = std::env::var("FLAME_PROTO_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0x5eed_f1a3_u64);
        let mut rng = StdRng::seed_from_u64(seed);
        let examples = examples();
        let mut decoded = 0usize;
        for case in 0..CASES {
            let mut b: Vec<u8> = match case % 3 {
                0 => (0..rng.random_range(0..300))
                    .map(|_| rng.random())
                    .collect(),
                1 => {
                    let mut b: Vec<u8> = (0..rng.random_range(128..300))
                        .map(|_| rng.random())
                        .collect();
                    b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
                    b[4] = if rng.random_ratio(1, 8) { 1 } else { VERSION };
                    b[48..52].copy_from_slice(&rng.random_range(0u32..200).to_le_bytes());
                    b[92..124].fill(0);
                    fix_checksums(&mut b);
                    b
                }
                _ => {
                    let mut b = examples[rng.random_range(0..examples.len())].encode();
                    for _ in 0..rng.random_range(1..4) {
                        let i = rng.random_range(0..b.len());
                        b[i] = if rng.random() { rng.random() } else { b[i] ^ 1 };
                    }
                    if rng.random_ratio(7, 8) {
                        fix_checksums(&mut b);
                    }
                    b
                }
            };
            if rng.random_ratio(1, 16) {
                b.truncate(rng.random_range(0..=b.len()));
            }
            if matches!(Message::decode(&b), Ok(Some(_))) {
                decoded += 1;
            }
            check_bytes(&b);
        }
        // The generator must reach the message builders, not only the checksums.
        assert!(
            decoded > CASES / 20,
            "only {decoded} of {CASES} cases decoded"
        );
    }
}

/// Property tests of the reply-payload decoders (object lists, block sums, scrub
/// counts, reply-area info): arbitrary bytes and mutated valid encodings decode to
/// `Some` or `None`, never a panic, and what decodes re-encodes to the same bytes;
/// `decode(encode(x)) == x` for arbitrary `x`. Seeded and bounded (a few hundred
/// cases each, well under a second in the debug profile); `PROPTEST_CASES` and
/// `PROPTEST_RNG_SEED` override for a longer run. The cargo-fuzz target of the same
/// decoders is `fuzz/fuzz_targets/payloads.rs`.
#[cfg(test)]
mod payload_props {
    use super::*;
    use crate::fuzzing::mutate;
    use crate::fuzzing::props::{config, mutations};
    use proptest::prelude::*;

    /// This file's proptest seed (`config`).
    const SEED: u64 = 0xf1a3_0001;

    fn object() -> impl Strategy<Value = ObjectId> {
        (any::<u64>(), any::<u64>()).prop_map(|(v, index)| ObjectId {
            volume: VolumeId(v),
            index,
        })
    }

    fn block_sum() -> impl Strategy<Value = BlockSum> {
        (any::<u32>(), any::<bool>(), any::<bool>()).prop_map(|(sum, bad, rewritten)| BlockSum {
            sum,
            bad,
            rewritten,
        })
    }

    /// Every decoder on `b`: whatever decodes must re-encode to exactly `b`.
    fn check_all(b: &[u8]) {
        if let Some(l) = decode_object_list(b) {
            assert!(l.len() <= PG_LIST_MAX as usize);
            assert_eq!(encode_object_list(&l), b);
        }
        if let Some(s) = decode_block_sums(b) {
            assert!(s.len() <= OBJECT_BLOCKS_MAX);
            // The encoder leaves trailing zero blocks out; the rest is exact.
            let e = encode_block_sums(&s);
            assert_eq!(&b[..e.len()], &e[..]);
            assert!(b[e.len()..].iter().all(|&x| x == 0));
        }
        if let Some(c) = ScrubCounts::decode(b) {
            assert_eq!(c.encode(), b);
        }
        if let Some(l) = decode_log_ops(b) {
            assert!(l.ops.len() <= PG_LIST_MAX as usize);
            assert!(l.ops.iter().all(|o| !o.op.is_none()));
            assert_eq!(encode_log_ops(&l), b);
        }
        if let Some(r) = ReplyAreaInfo::decode(b) {
            assert_eq!(r.encode(), b);
            assert!(r.slots >= 1 && r.slots <= REPLY_SLOTS_MAX);
            // Every slot a client may name lies inside the granted memory.
            for slot in [0, r.slots - 1, r.slots] {
                if let Some(d) = r.slot(slot, r.slot_bytes) {
                    assert!(
                        u64::from(slot + 1) * u64::from(r.slot_bytes) <= u64::from(r.remote.len)
                    );
                    assert_eq!(d.key, r.remote.key);
                }
            }
        }
    }

    proptest! {
        #![proptest_config(config(512, SEED))]

        #[test]
        fn payload_decoders_take_arbitrary_bytes(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            check_all(&b);
        }

        #[test]
        fn object_lists_round_trip_and_survive_mutation(
            l in proptest::collection::vec(object(), 0..40),
            m in mutations(6),
        ) {
            let mut b = encode_object_list(&l);
            prop_assert_eq!(decode_object_list(&b), Some(l));
            mutate(&mut b, &m);
            check_all(&b);
        }

        #[test]
        fn log_ops_round_trip_and_survive_mutation(
            trimmed_through in any::<u64>(),
            ops in proptest::collection::vec(
                (any::<u64>(), 1..u64::MAX, any::<u64>(), object()),
                0..40,
            ),
            m in mutations(6),
        ) {
            let l = LogOps {
                trimmed_through,
                ops: ops
                    .into_iter()
                    .map(|(seq, session, op_seq, object)| LogOp {
                        seq,
                        op: OpId { session, seq: op_seq },
                        object,
                    })
                    .collect(),
            };
            let mut b = encode_log_ops(&l);
            prop_assert_eq!(decode_log_ops(&b), Some(l));
            mutate(&mut b, &m);
            check_all(&b);
        }

        #[test]
        fn block_sums_round_trip_and_survive_mutation(
            s in proptest::collection::vec(block_sum(), 0..40),
            m in mutations(6),
        ) {
            let mut b = encode_block_sums(&s);
            let mut trimmed = s.clone();
            while trimmed.last() == Some(&BlockSum::default()) {
                trimmed.pop();
            }
            prop_assert_eq!(decode_block_sums(&b), Some(trimmed));
            mutate(&mut b, &m);
            check_all(&b);
        }

        #[test]
        fn scrub_counts_round_trip_survive_mutation_and_add(
            v in any::<[u64; 5]>(),
            m in mutations(6),
        ) {
            let c = ScrubCounts {
                objects_checked: v[0],
                inconsistent: v[1],
                repaired: v[2],
                primary_won: v[3],
                errors: v[4],
            };
            let mut b = c.encode();
            prop_assert_eq!(ScrubCounts::decode(&b), Some(c));
            // flame-admin adds what OSDs report: never an overflow panic.
            let mut total = c;
            total.add(&c);
            mutate(&mut b, &m);
            check_all(&b);
        }

        #[test]
        fn reply_area_info_round_trips_and_survives_mutation(
            slots in 1..=REPLY_SLOTS_MAX,
            slot_payload in 0..=REPLY_SLOT_PAYLOAD_BYTES_MAX,
            addr in any::<u64>(),
            key in any::<u32>(),
            m in mutations(6),
        ) {
            let slot_bytes = HEADER_LEN as u32 + slot_payload;
            let len = u64::from(slots) * u64::from(slot_bytes);
            prop_assume!(len <= u64::from(u32::MAX));
            let r = ReplyAreaInfo {
                remote: RemoteBuf { addr, len: len as u32, key },
                slots,
                slot_bytes,
            };
            let mut b = r.encode();
            prop_assert_eq!(ReplyAreaInfo::decode(&b), Some(r));
            mutate(&mut b, &m);
            check_all(&b);
        }
    }

    /// Regression: summing OSD-reported counts overflowed (a panic in debug
    /// builds of flame-admin); found by `scrub_counts_round_trip_survive_mutation_and_add`.
    #[test]
    fn scrub_count_totals_saturate() {
        let big = ScrubCounts {
            objects_checked: u64::MAX,
            ..ScrubCounts::default()
        };
        let mut total = big;
        total.add(&big);
        assert_eq!(total.objects_checked, u64::MAX);
    }

    /// Regression: an object list longer than any PG_LIST or PG_SUSPECTS reply may
    /// be (65 536 entries) was accepted.
    #[test]
    fn over_long_object_lists_are_refused() {
        let ok = vec![0u8; PG_LIST_MAX as usize * 16];
        assert_eq!(
            decode_object_list(&ok).map(|l| l.len()),
            Some(PG_LIST_MAX as usize)
        );
        let long = vec![0u8; (PG_LIST_MAX as usize + 1) * 16];
        assert_eq!(decode_object_list(&long), None);
    }
}
