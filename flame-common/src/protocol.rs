//! The Flame wire protocol between clients and OSDs, and between OSDs.
//!
//! Every message is one fixed 64-byte header (one cache line, as in the Flame
//! thesis's command format) followed by `payload_len` bytes of payload — the data of
//! a write or of a read reply, nothing else. Fixed headers make decoding a bounds
//! check and a few loads, and let a transport post the header and the data
//! separately (inline header, data by one-sided transfer).
//!
//! Header layout, little-endian:
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `FLME` (0x454d_4c46 read LE) |
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
//!
//! The header checksum makes garbage on a port fail fast with a clear error, before
//! any length in it is trusted.

use crate::buffer::PayloadBuf;
use crate::ids::{Epoch, ObjectId, PgId, RequestId, VolumeId};

/// `FLME` in ASCII, read as a little-endian u32.
pub const MAGIC: u32 = u32::from_le_bytes(*b"FLME");
/// Protocol version; a peer speaking another version is refused at the first header.
pub const VERSION: u8 = 1;
/// Header size in bytes.
pub const HEADER_LEN: usize = 64;
/// Largest payload of one message: one I/O never spans objects and the client splits
/// I/O into pieces of at most this size, so 4 MiB bounds every receive buffer.
pub const PAYLOAD_BYTES_MAX: u32 = 4 << 20;
/// Largest byte range one request may name (reads, zeroing, discards).
pub const IO_BYTES_MAX: u32 = PAYLOAD_BYTES_MAX;

/// Bit 7 of the opcode byte marks a reply.
const REPLY_BIT: u8 = 0x80;

/// Header flag bits.
pub mod flags {
    /// Forced unit access: reply only once the data is on stable storage on every copy.
    pub const FUA: u16 = 1 << 0;
    /// Sent by a primary to a replica: apply locally, do not forward.
    pub const REPLICA: u16 = 1 << 1;
    /// All flags this version knows; others are rejected.
    pub const KNOWN: u16 = FUA | REPLICA;
}

/// What a message asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpCode {
    /// First message on a connection: the client names the shard it expects.
    Hello = 1,
    /// Read a byte range of an object.
    Read = 2,
    /// Write the payload at an offset of an object.
    Write = 3,
    /// Make a byte range read back as zeroes.
    WriteZeroes = 4,
    /// The byte range is no longer needed (reads back as zeroes in Flame).
    Discard = 5,
    /// Make every write acknowledged so far on this connection's shard stable.
    Flush = 6,
    /// Remove every object of a volume owned by this shard.
    DeleteVolume = 7,
    /// Liveness probe; also carries the epoch.
    Ping = 8,
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
        }
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
    /// Peer speaks another protocol version.
    #[error("unsupported protocol version {0} (this build speaks {VERSION})")]
    BadVersion(u8),
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
    /// Fields that contradict each other (e.g. a write whose payload is not its length).
    #[error("inconsistent message: {0}")]
    Inconsistent(&'static str),
}

/// The decoded 64-byte header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Header {
    /// Opcode byte including the reply bit.
    pub opcode: u8,
    /// Flag bits.
    pub flags: u16,
    /// Request id.
    pub request_id: u64,
    /// Sender's epoch.
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
}

impl Header {
    /// Encodes into exactly [`HEADER_LEN`] bytes, checksum included.
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
        b
    }

    /// Decodes and validates a header. After this returns `Ok`, `payload_len` is
    /// within [`PAYLOAD_BYTES_MAX`] and the opcode and flags are known, so the caller
    /// may allocate `payload_len` bytes.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<Header, ProtocolError> {
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let magic = u32_at(0);
        if magic != MAGIC {
            return Err(ProtocolError::BadMagic(magic));
        }
        if crc32c::crc32c(&b[0..60]) != u32_at(60) {
            return Err(ProtocolError::BadChecksum);
        }
        if b[4] != VERSION {
            return Err(ProtocolError::BadVersion(b[4]));
        }
        let h = Header {
            opcode: b[5],
            flags: u16::from_le_bytes([b[6], b[7]]),
            request_id: u64_at(8),
            epoch: u64_at(16),
            volume: u64_at(24),
            object: u64_at(32),
            offset: u32_at(40),
            length: u32_at(44),
            payload_len: u32_at(48),
            status: u32_at(52) as i32,
            pg: u32_at(56),
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

/// Every message of the protocol. One enum, so a new message is one variant and the
/// compiler finds every place that must handle it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Opens a connection to one shard of an OSD.
    Hello {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// The shard the sender believes it reached (its port); a mismatch means the
        /// sender's map is stale.
        shard: u16,
        /// Sent by another OSD (a replication connection, which multiplexes many
        /// clients' writes and so gets a larger in-flight bound). Encoded as the
        /// [`flags::REPLICA`] bit.
        peer: bool,
        /// Who is connecting (random per client thread or OSD shard; 0 = no
        /// fencing). Encoded in the header's volume field.
        session: u64,
        /// Increases with every connection a session opens. When a session
        /// reconnects, the receiver stops executing requests still arriving on its
        /// older connections: a request resent on the new connection must never be
        /// overtaken by its stale original. Encoded in the object field.
        generation: u64,
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
    },
    /// Write `data` (whose length is `target.length`).
    Write {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// Where to write.
        target: IoTarget,
        /// Flag bits ([`flags::FUA`], [`flags::REPLICA`]).
        flags: u16,
        /// The bytes: a shared buffer, so forwarding it to every replica and
        /// writing it to the disk use the memory it was received into.
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
    },
    /// Make acknowledged writes stable.
    Flush {
        /// Request id.
        id: RequestId,
        /// Sender's epoch.
        epoch: Epoch,
        /// Flag bits ([`flags::REPLICA`] when forwarded).
        flags: u16,
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
    /// Answer to any request.
    Reply {
        /// Which request kind this answers.
        op: OpCode,
        /// The request's id.
        id: RequestId,
        /// Replier's epoch: a client seeing a newer epoch refreshes its map.
        epoch: Epoch,
        /// 0 or a negative errno ([`status`]).
        status: i32,
        /// For `Hello`: the replier's shard count in `length`, its shard in `offset`.
        /// Unused otherwise.
        info: u32,
        /// Read data (empty otherwise), in the buffer it was read from the disk into.
        data: PayloadBuf,
    },
}

impl Message {
    /// The request id, for matching replies.
    pub fn id(&self) -> RequestId {
        match self {
            Message::Hello { id, .. }
            | Message::Read { id, .. }
            | Message::Write { id, .. }
            | Message::WriteZeroes { id, .. }
            | Message::Discard { id, .. }
            | Message::Flush { id, .. }
            | Message::DeleteVolume { id, .. }
            | Message::Ping { id, .. }
            | Message::Reply { id, .. } => *id,
        }
    }

    /// Gives the message request id `new` (ids are per connection, so a message
    /// resent on another connection gets a new one).
    pub fn set_id(&mut self, new: RequestId) {
        match self {
            Message::Hello { id, .. }
            | Message::Read { id, .. }
            | Message::Write { id, .. }
            | Message::WriteZeroes { id, .. }
            | Message::Discard { id, .. }
            | Message::Flush { id, .. }
            | Message::DeleteVolume { id, .. }
            | Message::Ping { id, .. }
            | Message::Reply { id, .. } => *id = new,
        }
    }

    /// The sender's map epoch.
    pub fn epoch(&self) -> Epoch {
        match self {
            Message::Hello { epoch, .. }
            | Message::Read { epoch, .. }
            | Message::Write { epoch, .. }
            | Message::WriteZeroes { epoch, .. }
            | Message::Discard { epoch, .. }
            | Message::Flush { epoch, .. }
            | Message::DeleteVolume { epoch, .. }
            | Message::Ping { epoch, .. }
            | Message::Reply { epoch, .. } => *epoch,
        }
    }

    /// The header describing this message, and its payload.
    pub fn to_header(&self) -> (Header, &[u8]) {
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
                payload_len: 0,
                status: 0,
                pg: t.pg.0,
            }
        }
        match self {
            Message::Hello {
                id,
                epoch,
                shard,
                peer,
                session,
                generation,
            } => (
                Header {
                    opcode: OpCode::Hello as u8,
                    volume: *session,
                    object: *generation,
                    flags: if *peer { flags::REPLICA } else { 0 },
                    request_id: id.0,
                    epoch: epoch.0,
                    offset: u32::from(*shard),
                    ..Header::default()
                },
                &[],
            ),
            Message::Read {
                id,
                epoch,
                target,
                flags,
            } => (io(OpCode::Read, *id, *epoch, target, *flags), &[]),
            Message::Write {
                id,
                epoch,
                target,
                flags,
                data,
            } => {
                let mut h = io(OpCode::Write, *id, *epoch, target, *flags);
                h.payload_len = data.len() as u32;
                (h, data.as_slice())
            }
            Message::WriteZeroes {
                id,
                epoch,
                target,
                flags,
            } => (io(OpCode::WriteZeroes, *id, *epoch, target, *flags), &[]),
            Message::Discard {
                id,
                epoch,
                target,
                flags,
            } => (io(OpCode::Discard, *id, *epoch, target, *flags), &[]),
            Message::Flush { id, epoch, flags } => (
                Header {
                    opcode: OpCode::Flush as u8,
                    flags: *flags,
                    request_id: id.0,
                    epoch: epoch.0,
                    ..Header::default()
                },
                &[],
            ),
            Message::DeleteVolume { id, epoch, volume } => (
                Header {
                    opcode: OpCode::DeleteVolume as u8,
                    request_id: id.0,
                    epoch: epoch.0,
                    volume: volume.0,
                    ..Header::default()
                },
                &[],
            ),
            Message::Ping { id, epoch } => (
                Header {
                    opcode: OpCode::Ping as u8,
                    request_id: id.0,
                    epoch: epoch.0,
                    ..Header::default()
                },
                &[],
            ),
            Message::Reply {
                op,
                id,
                epoch,
                status,
                info,
                data,
            } => (
                Header {
                    opcode: *op as u8 | REPLY_BIT,
                    request_id: id.0,
                    epoch: epoch.0,
                    status: *status,
                    length: *info,
                    payload_len: data.len() as u32,
                    ..Header::default()
                },
                data.as_slice(),
            ),
        }
    }

    /// The payload buffer of a write or a reply (`None` for other messages), so a
    /// transport can send it by reference instead of copying it.
    pub fn payload_buf(&self) -> Option<&PayloadBuf> {
        match self {
            Message::Write { data, .. } | Message::Reply { data, .. } => Some(data),
            _ => None,
        }
    }

    /// Builds a message from a decoded header and its payload, checking that the
    /// fields agree. `payload.len()` must equal `header.payload_len`.
    pub fn from_parts(h: &Header, payload: PayloadBuf) -> Result<Message, ProtocolError> {
        if payload.len() != h.payload_len as usize {
            return Err(ProtocolError::Inconsistent(
                "payload length differs from header",
            ));
        }
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
        let no_payload = |m: Message| {
            if h.payload_len != 0 {
                Err(ProtocolError::Inconsistent("unexpected payload"))
            } else {
                Ok(m)
            }
        };
        if h.is_reply() {
            return Ok(Message::Reply {
                op: h.op(),
                id,
                epoch,
                status: h.status,
                info: h.length,
                data: payload,
            });
        }
        let flags = h.flags;
        match h.op() {
            OpCode::Hello => {
                let shard = u16::try_from(h.offset)
                    .map_err(|_| ProtocolError::Inconsistent("shard number out of range"))?;
                let peer = flags & flags::REPLICA != 0;
                no_payload(Message::Hello {
                    id,
                    epoch,
                    shard,
                    peer,
                    session: h.volume,
                    generation: h.object,
                })
            }
            OpCode::Read => no_payload(Message::Read {
                id,
                epoch,
                target: target()?,
                flags,
            }),
            OpCode::Write => {
                let target = target()?;
                if target.length != h.payload_len {
                    return Err(ProtocolError::Inconsistent(
                        "write length differs from payload",
                    ));
                }
                Ok(Message::Write {
                    id,
                    epoch,
                    target,
                    flags,
                    data: payload,
                })
            }
            OpCode::WriteZeroes => no_payload(Message::WriteZeroes {
                id,
                epoch,
                target: target()?,
                flags,
            }),
            OpCode::Discard => no_payload(Message::Discard {
                id,
                epoch,
                target: target()?,
                flags,
            }),
            OpCode::Flush => no_payload(Message::Flush { id, epoch, flags }),
            OpCode::DeleteVolume => no_payload(Message::DeleteVolume {
                id,
                epoch,
                volume: VolumeId(h.volume),
            }),
            OpCode::Ping => no_payload(Message::Ping { id, epoch }),
        }
    }

    /// A reply to this request with the given status and no data.
    pub fn reply(&self, epoch: Epoch, status: i32) -> Message {
        Message::Reply {
            op: self.op(),
            id: self.id(),
            epoch,
            status,
            info: 0,
            data: PayloadBuf::empty(),
        }
    }

    /// The opcode of this message.
    pub fn op(&self) -> OpCode {
        match self {
            Message::Hello { .. } => OpCode::Hello,
            Message::Read { .. } => OpCode::Read,
            Message::Write { .. } => OpCode::Write,
            Message::WriteZeroes { .. } => OpCode::WriteZeroes,
            Message::Discard { .. } => OpCode::Discard,
            Message::Flush { .. } => OpCode::Flush,
            Message::DeleteVolume { .. } => OpCode::DeleteVolume,
            Message::Ping { .. } => OpCode::Ping,
            Message::Reply { op, .. } => *op,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(m: Message) {
        let (h, payload) = m.to_header();
        let bytes = h.encode();
        let h2 = Header::decode(&bytes).unwrap();
        let m2 = Message::from_parts(&h2, PayloadBuf::copy_from(payload)).unwrap();
        assert_eq!(m, m2);
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

    #[test]
    fn all_messages_roundtrip() {
        let id = RequestId(42);
        let epoch = Epoch(5);
        roundtrip(Message::Hello {
            id,
            epoch,
            shard: 3,
            peer: false,
            session: 0,
            generation: 0,
        });
        roundtrip(Message::Hello {
            id,
            epoch,
            shard: 3,
            peer: true,
            session: 0xdead_beef,
            generation: 7,
        });
        roundtrip(Message::Read {
            id,
            epoch,
            target: target(),
            flags: 0,
        });
        roundtrip(Message::Write {
            id,
            epoch,
            target: target(),
            flags: flags::FUA,
            data: PayloadBuf::copy_from(&[7; 8]),
        });
        roundtrip(Message::WriteZeroes {
            id,
            epoch,
            target: target(),
            flags: 0,
        });
        roundtrip(Message::Discard {
            id,
            epoch,
            target: target(),
            flags: 0,
        });
        roundtrip(Message::Flush {
            id,
            epoch,
            flags: flags::REPLICA,
        });
        roundtrip(Message::DeleteVolume {
            id,
            epoch,
            volume: VolumeId(3),
        });
        roundtrip(Message::Ping { id, epoch });
        roundtrip(Message::Reply {
            op: OpCode::Read,
            id,
            epoch,
            status: status::EIO,
            info: 0,
            data: PayloadBuf::copy_from(&[1, 2, 3]),
        });
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

    #[test]
    fn inconsistent_write_rejected() {
        let h = Header {
            opcode: OpCode::Write as u8,
            length: 16,
            payload_len: 8,
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
    }

    #[test]
    fn every_single_byte_corruption_is_caught() {
        let m = Message::Read {
            id: RequestId(1),
            epoch: Epoch(2),
            target: target(),
            flags: 0,
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
}
