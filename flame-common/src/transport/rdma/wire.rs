//! The RDMA transport's own wire formats and bookkeeping, kept free of verbs calls so
//! that they are unit-tested on machines without an RDMA device (CI included):
//!
//! - [`ConnInfo`]: what two ends exchange over the TCP bootstrap connection to bring
//!   their reliable-connection queue pairs up (QP number, packet sequence number,
//!   LID/GID, MTU, receive depth).
//! - [`FrameHeader`]: the 8 bytes in front of every two-sided SEND. A SEND carries a
//!   chunk of the Flame byte stream (headers and inline payloads, exactly what TCP
//!   would carry) plus the credits the sender returns.
//! - [`Credits`]: the credit flow control that keeps a sender from posting a SEND
//!   the receiver has no posted buffer for (which would stall the queue pair in
//!   receiver-not-ready retries).
//! - [`StreamDecoder`]: cuts Flame messages out of the received chunks, bounded by
//!   the protocol's header checks before any allocation.
//! - [`WrId`]: the 64-bit work-request id: which connection, which kind of work
//!   request, which slot — so a completion on the thread's shared completion queue
//!   finds its owner.

use crate::buffer::PayloadBufMut;
use crate::protocol::{HEADER_LEN, HEADER_PREFIX_LEN, Header, Message, ProtocolError};

/// Magic at the start of a [`ConnInfo`]: `FLRD` (Flame RDMA), little-endian.
pub const CONN_INFO_MAGIC: u32 = u32::from_le_bytes(*b"FLRD");
/// Version of the bootstrap exchange and of the framing. A peer of another version is
/// refused with a message naming both.
pub const CONN_INFO_VERSION: u16 = 1;
/// Encoded size of a [`ConnInfo`].
pub const CONN_INFO_LEN: usize = 48;
/// Size of the [`FrameHeader`] in front of every SEND.
pub const FRAME_HEADER_LEN: usize = 8;
/// Largest receive depth a peer may announce (bounds what we allocate for credits).
pub const RECV_SLOTS_MAX: u16 = 1024;
/// Smallest receive depth: the credit scheme needs a threshold of at least 2 below
/// the window (see [`Credits`]).
pub const RECV_SLOTS_MIN: u16 = 3;
/// Smallest and largest receive slot a peer may announce.
pub const SLOT_BYTES_MIN: u32 = 4096;
/// See [`SLOT_BYTES_MIN`].
pub const SLOT_BYTES_MAX: u32 = 1 << 20;
/// Queue pair numbers and packet sequence numbers are 24-bit quantities in verbs.
pub const QP_NUM_MASK: u32 = 0x00FF_FFFF;

/// One end's queue pair as the other end needs it to connect (the verbs
/// "out-of-band" connection exchange, done over Flame's TCP bootstrap connection).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnInfo {
    /// Local identifier of the port (InfiniBand; 0 on RoCE, where the GID routes).
    pub lid: u16,
    /// Queue pair number (24 bits).
    pub qp_num: u32,
    /// First packet sequence number this end sends with (24 bits, random).
    pub psn: u32,
    /// Global identifier of the port (RoCE: derived from an IP address).
    pub gid: [u8; 16],
    /// Path MTU as the verbs enum value (1 = 256 bytes … 5 = 4096 bytes).
    pub mtu: u8,
    /// Receive buffers this end keeps posted: the peer's initial send credits.
    pub recv_slots: u16,
    /// Size of each receive buffer, frame header included: the peer never sends a
    /// larger SEND.
    pub slot_bytes: u32,
}

impl ConnInfo {
    /// Fixed little-endian encoding with a crc32c, so a stray or truncated peer is
    /// recognised instead of bringing a queue pair up with garbage.
    pub fn encode(&self) -> [u8; CONN_INFO_LEN] {
        let mut b = [0u8; CONN_INFO_LEN];
        b[0..4].copy_from_slice(&CONN_INFO_MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&CONN_INFO_VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.lid.to_le_bytes());
        b[8..12].copy_from_slice(&self.qp_num.to_le_bytes());
        b[12..16].copy_from_slice(&self.psn.to_le_bytes());
        b[16..32].copy_from_slice(&self.gid);
        b[32] = self.mtu;
        b[34..36].copy_from_slice(&self.recv_slots.to_le_bytes());
        b[36..40].copy_from_slice(&self.slot_bytes.to_le_bytes());
        let crc = crc32c::crc32c(&b[..44]);
        b[44..48].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decodes and bounds-checks a peer's [`ConnInfo`]; every field that sizes
    /// something on this side is checked here.
    pub fn decode(b: &[u8; CONN_INFO_LEN]) -> Result<ConnInfo, String> {
        let u16_at = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let magic = u32_at(0);
        if magic != CONN_INFO_MAGIC {
            return Err(format!(
                "bad RDMA bootstrap magic {magic:#010x}: the peer is not a Flame RDMA endpoint \
                 (is it configured with transport: rdma?)"
            ));
        }
        let crc = crc32c::crc32c(&b[..44]);
        if crc != u32_at(44) {
            return Err("RDMA bootstrap message fails its checksum".into());
        }
        let version = u16_at(4);
        if version != CONN_INFO_VERSION {
            return Err(format!(
                "peer speaks RDMA bootstrap version {version}, this build speaks {CONN_INFO_VERSION}"
            ));
        }
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[16..32]);
        let info = ConnInfo {
            lid: u16_at(6),
            qp_num: u32_at(8),
            psn: u32_at(12),
            gid,
            mtu: b[32],
            recv_slots: u16_at(34),
            slot_bytes: u32_at(36),
        };
        if info.qp_num & !QP_NUM_MASK != 0 || info.psn & !QP_NUM_MASK != 0 {
            return Err("peer's queue pair number or PSN exceeds 24 bits".into());
        }
        if !(1..=5).contains(&info.mtu) {
            return Err(format!("peer's path MTU code {} is not 1..=5", info.mtu));
        }
        if info.recv_slots < RECV_SLOTS_MIN || info.recv_slots > RECV_SLOTS_MAX {
            return Err(format!(
                "peer announces {} receive slots (must be {RECV_SLOTS_MIN}..={RECV_SLOTS_MAX})",
                info.recv_slots
            ));
        }
        if !(SLOT_BYTES_MIN..=SLOT_BYTES_MAX).contains(&info.slot_bytes) {
            return Err(format!(
                "peer announces {}-byte receive slots (must be {SLOT_BYTES_MIN}..={SLOT_BYTES_MAX})",
                info.slot_bytes
            ));
        }
        Ok(info)
    }
}

/// What a SEND carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    /// A chunk of the Flame byte stream (and piggybacked credits).
    Data = 1,
    /// Credits only (no data was going the other way to carry them).
    Credit = 2,
}

/// The 8 bytes in front of every SEND: kind, returned credits, data length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    /// What follows.
    pub kind: FrameKind,
    /// Receive buffers the sender has re-posted since its last frame: the receiver
    /// of this frame may post that many more SENDs.
    pub credits: u16,
    /// Bytes of stream data after the header (0 for [`FrameKind::Credit`]).
    pub len: u32,
}

impl FrameHeader {
    /// Encodes the header.
    pub fn encode(&self) -> [u8; FRAME_HEADER_LEN] {
        let mut b = [0u8; FRAME_HEADER_LEN];
        b[0] = self.kind as u8;
        b[2..4].copy_from_slice(&self.credits.to_le_bytes());
        b[4..8].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    /// Decodes the header of a received SEND of `byte_len` bytes (from its
    /// completion) into a slot of `slot_bytes`; anything inconsistent is a broken or
    /// hostile peer and fails the connection.
    pub fn decode(b: &[u8], byte_len: u32, slot_bytes: u32) -> Result<FrameHeader, String> {
        if byte_len as usize > slot_bytes as usize || (byte_len as usize) < FRAME_HEADER_LEN {
            return Err(format!(
                "received a {byte_len}-byte SEND (frames are {FRAME_HEADER_LEN}..={slot_bytes} bytes)"
            ));
        }
        let Some(h) = b.get(..FRAME_HEADER_LEN) else {
            return Err("receive slot shorter than a frame header".into());
        };
        let kind = match h[0] {
            1 => FrameKind::Data,
            2 => FrameKind::Credit,
            k => return Err(format!("unknown RDMA frame kind {k}")),
        };
        if h[1] != 0 {
            return Err(format!("RDMA frame flags {:#x} are not zero", h[1]));
        }
        let credits = u16::from_le_bytes([h[2], h[3]]);
        let len = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
        if len as usize + FRAME_HEADER_LEN != byte_len as usize {
            return Err(format!(
                "RDMA frame says {len} data bytes but the SEND carried {byte_len}"
            ));
        }
        if kind == FrameKind::Credit && len != 0 {
            return Err("RDMA credit frame carries data".into());
        }
        Ok(FrameHeader { kind, credits, len })
    }
}

/// Credit flow control of one connection.
///
/// `send` credits are the peer's receive buffers we know to be posted; every SEND
/// (data or credit) uses one. `owed` are our receive buffers re-posted since we last
/// told the peer; every frame we send carries them back. Data frames keep one credit
/// in reserve so a credit frame can always be sent; a credit frame goes out when at
/// least `threshold` credits are owed and no data frame is about to carry them.
/// With `2 <= threshold <= window - 1` (so a window of at least 3) neither side can end up waiting for the
/// other's credits (checked exhaustively over small windows in the tests), and a
/// credit frame never triggers a credit frame in answer (it makes the peer owe 1,
/// below the threshold).
#[derive(Clone, Debug)]
pub struct Credits {
    send: u32,
    owed: u32,
    window: u32,
    threshold: u32,
}

impl Credits {
    /// `peer_recv_slots`: the peer's announced receive depth (our initial credits);
    /// `own_recv_slots`: ours (bounds what we can owe).
    pub fn new(peer_recv_slots: u16, own_recv_slots: u16) -> Credits {
        let window = u32::from(own_recv_slots.max(RECV_SLOTS_MIN));
        Credits {
            send: u32::from(peer_recv_slots),
            owed: 0,
            window,
            threshold: (window / 2).clamp(2, window - 1),
        }
    }

    /// Whether a data frame may be posted now (one credit stays in reserve).
    pub fn can_send_data(&self) -> bool {
        self.send >= 2
    }

    /// Whether a credit-only frame should be posted now.
    pub fn needs_credit_frame(&self) -> bool {
        self.owed >= self.threshold && self.send >= 1
    }

    /// Takes one send credit for a frame and the owed credits it carries back.
    /// Call only after [`Credits::can_send_data`] or [`Credits::needs_credit_frame`].
    pub fn take_for_frame(&mut self) -> u16 {
        debug_assert!(self.send >= 1, "frame posted without a credit");
        self.send = self.send.saturating_sub(1);
        let back = self.owed.min(u32::from(u16::MAX));
        self.owed -= back;
        back as u16
    }

    /// The peer returned `n` credits (from a received frame's header). More than
    /// the peer's window in total is a protocol violation.
    pub fn returned(&mut self, n: u16, peer_window: u16) -> Result<(), String> {
        let total = self.send + u32::from(n);
        if total > u32::from(peer_window) {
            return Err(format!(
                "peer returned credits beyond its {peer_window} receive slots"
            ));
        }
        self.send = total;
        Ok(())
    }

    /// One of our receive buffers was re-posted: owe the peer one credit.
    pub fn reposted(&mut self) {
        self.owed += 1;
        debug_assert!(self.owed <= self.window, "owe more credits than slots");
    }

    /// Credits we may still spend.
    pub fn send_credits(&self) -> u32 {
        self.send
    }
}

/// Kind of a work request, in its [`WrId`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum WrKind {
    /// A posted receive buffer (index = receive slot).
    Recv = 1,
    /// A SEND from a send slot (index = send slot).
    Send = 2,
    /// A one-sided READ or WRITE (index = operation slot).
    OneSided = 3,
}

/// A work request id: connection id (32 bits), kind (8 bits), slot index (24 bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WrId {
    /// The connection's id on its thread (never reused while the thread lives).
    pub conn: u32,
    /// What the work request was.
    pub kind: WrKind,
    /// Its slot.
    pub index: u32,
}

impl WrId {
    /// Packs the id (`index` must fit 24 bits).
    pub fn encode(&self) -> u64 {
        debug_assert!(self.index <= 0x00FF_FFFF);
        (u64::from(self.conn) << 32) | (u64::from(self.kind as u8) << 24) | u64::from(self.index)
    }

    /// Unpacks an id from a completion; `None` for ids this transport never posts.
    pub fn decode(v: u64) -> Option<WrId> {
        let kind = match (v >> 24) as u8 {
            1 => WrKind::Recv,
            2 => WrKind::Send,
            3 => WrKind::OneSided,
            _ => return None,
        };
        Some(WrId {
            conn: (v >> 32) as u32,
            kind,
            index: (v & 0x00FF_FFFF) as u32,
        })
    }
}

/// Cuts Flame messages out of a byte stream that arrives in chunks (the data of
/// received frames). The header is checked (prefix first, like TCP, so a peer of
/// another protocol version is named) before the payload buffer is allocated, and
/// the payload length is bounded by [`Header::decode`].
#[derive(Default)]
pub struct StreamDecoder {
    head: Vec<u8>,
    body: Option<(Header, PayloadBufMut, usize)>,
    /// A decoded header whose payload buffer the pool could not give yet
    /// ([`PayloadAlloc::PoolOrWait`]).
    pending: Option<Header>,
}

/// Where [`StreamDecoder::feed`] takes a message's payload buffer from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PayloadAlloc {
    /// The thread's pool, or heap memory when it is exhausted (never waits).
    Fallback,
    /// The thread's pool only: when it is exhausted the decoder stops before the
    /// payload ([`StreamDecoder::needs_memory`]) until [`StreamDecoder::supply`]
    /// gives it a buffer. The caller waits for pool memory meanwhile and consumes
    /// no more received bytes, which keeps the receive slots (and so the peer's
    /// credits) held: the sender is back-pressured, as a tcp sender is by a socket
    /// that is not read.
    PoolOrWait,
}

impl StreamDecoder {
    /// Consumes bytes of `input` until one message is complete (returned with the
    /// bytes consumed), `input` is used up (`None`, all consumed), or the payload
    /// needs memory the pool does not have (`None` with bytes left;
    /// [`StreamDecoder::needs_memory`] says how much). Consumes nothing while a
    /// payload waits for memory.
    pub fn feed(
        &mut self,
        input: &[u8],
        alloc: PayloadAlloc,
    ) -> (usize, Option<Result<Message, ProtocolError>>) {
        let mut used = 0;
        loop {
            if self.pending.is_some() {
                return (used, None);
            }
            if let Some((_, payload, filled)) = self.body.as_mut() {
                let want = payload.len() - *filled;
                let n = want.min(input.len() - used);
                payload.as_mut_slice()[*filled..*filled + n]
                    .copy_from_slice(&input[used..used + n]);
                *filled += n;
                used += n;
                if *filled < payload.len() {
                    return (used, None);
                }
                let Some((header, payload, _)) = self.body.take() else {
                    unreachable!("body checked above");
                };
                return (used, Some(Message::from_parts(&header, payload.freeze())));
            }
            let target = if self.head.len() < HEADER_PREFIX_LEN {
                HEADER_PREFIX_LEN
            } else {
                HEADER_LEN
            };
            let n = (target - self.head.len()).min(input.len() - used);
            self.head.extend_from_slice(&input[used..used + n]);
            used += n;
            if self.head.len() < target {
                return (used, None);
            }
            if target == HEADER_PREFIX_LEN {
                let mut prefix = [0u8; HEADER_PREFIX_LEN];
                prefix.copy_from_slice(&self.head);
                if let Err(e) = Header::check_prefix(&prefix) {
                    return (used, Some(Err(e)));
                }
                continue;
            }
            let mut hb = [0u8; HEADER_LEN];
            hb.copy_from_slice(&self.head);
            self.head.clear();
            let header = match Header::decode(&hb) {
                Ok(h) => h,
                Err(e) => return (used, Some(Err(e))),
            };
            // Bounded by Header::decode (PAYLOAD_BYTES_MAX) before this allocation.
            let len = header.payload_len as usize;
            let payload = match alloc {
                PayloadAlloc::Fallback => PayloadBufMut::for_overwrite(len),
                PayloadAlloc::PoolOrWait => match PayloadBufMut::try_for_overwrite(len) {
                    Some(b) => b,
                    None => {
                        self.pending = Some(header);
                        return (used, None);
                    }
                },
            };
            self.body = Some((header, payload, 0));
        }
    }

    /// The payload length a decoded header waits for memory for, if any.
    pub fn needs_memory(&self) -> Option<usize> {
        self.pending.as_ref().map(|h| h.payload_len as usize)
    }

    /// Gives the waiting payload ([`StreamDecoder::needs_memory`]) its buffer;
    /// `buf` must be of that length (a buffer of another length, or one given
    /// while nothing waits, is refused and returned).
    pub fn supply(&mut self, buf: PayloadBufMut) -> Result<(), PayloadBufMut> {
        match self.pending.take() {
            Some(h) if h.payload_len as usize == buf.len() => {
                self.body = Some((h, buf, 0));
                Ok(())
            }
            other => {
                self.pending = other;
                Err(buf)
            }
        }
    }

    /// Whether a message is partly received (a connection closing now loses it).
    pub fn in_message(&self) -> bool {
        !self.head.is_empty() || self.body.is_some() || self.pending.is_some()
    }

    /// Whether a payload is partly received: its header decoded, its buffer
    /// given, some of its bytes still to come from the peer.
    pub fn in_payload(&self) -> bool {
        self.body.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::buffer::PayloadBuf;
    use crate::ids::{Epoch, ObjectId, PgId, PgSeq, RequestId, VolumeId};
    use crate::protocol::IoTarget;

    fn info() -> ConnInfo {
        ConnInfo {
            lid: 7,
            qp_num: 0x12_3456,
            psn: 0xAB_CDEF,
            gid: [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8],
            mtu: 3,
            recv_slots: 32,
            slot_bytes: 16 << 10,
        }
    }

    #[test]
    fn rdma_conn_info_round_trips_and_rejects_bad_fields() {
        let i = info();
        assert_eq!(ConnInfo::decode(&i.encode()).unwrap(), i);
        // A flipped bit anywhere fails the checksum (or the magic).
        for byte in 0..CONN_INFO_LEN {
            let mut b = i.encode();
            b[byte] ^= 0x10;
            assert!(ConnInfo::decode(&b).is_err(), "bit flip at {byte} accepted");
        }
        // Fields that size things here are bounded even with a valid checksum.
        let bad = [
            ConnInfo {
                qp_num: 1 << 24,
                ..i
            },
            ConnInfo { psn: u32::MAX, ..i },
            ConnInfo { mtu: 0, ..i },
            ConnInfo { mtu: 6, ..i },
            ConnInfo { recv_slots: 2, ..i },
            ConnInfo {
                recv_slots: RECV_SLOTS_MAX + 1,
                ..i
            },
            ConnInfo {
                slot_bytes: SLOT_BYTES_MIN - 1,
                ..i
            },
            ConnInfo {
                slot_bytes: SLOT_BYTES_MAX + 1,
                ..i
            },
        ];
        for b in bad {
            assert!(ConnInfo::decode(&b.encode()).is_err(), "{b:?} accepted");
        }
        // A TCP Flame peer (a v2 header) is named as such.
        let mut tcp = [0u8; CONN_INFO_LEN];
        tcp[..4].copy_from_slice(b"FLME");
        let e = ConnInfo::decode(&tcp).unwrap_err();
        assert!(e.contains("not a Flame RDMA endpoint"), "{e}");
    }

    #[test]
    fn rdma_frame_header_checks_length_kind_and_flags() {
        let h = FrameHeader {
            kind: FrameKind::Data,
            credits: 5,
            len: 100,
        };
        let mut b = h.encode().to_vec();
        b.resize(108, 0);
        assert_eq!(FrameHeader::decode(&b, 108, 4096).unwrap(), h);
        assert!(
            FrameHeader::decode(&b, 107, 4096).is_err(),
            "length mismatch"
        );
        assert!(FrameHeader::decode(&b, 5000, 4096).is_err(), "beyond slot");
        assert!(
            FrameHeader::decode(&b, 4, 4096).is_err(),
            "shorter than header"
        );
        let mut k = b.clone();
        k[0] = 9;
        assert!(FrameHeader::decode(&k, 108, 4096).is_err(), "unknown kind");
        let mut f = b.clone();
        f[1] = 1;
        assert!(FrameHeader::decode(&f, 108, 4096).is_err(), "flags");
        let c = FrameHeader {
            kind: FrameKind::Credit,
            credits: 3,
            len: 0,
        };
        assert_eq!(FrameHeader::decode(&c.encode(), 8, 4096).unwrap(), c);
    }

    #[test]
    fn rdma_wr_ids_round_trip() {
        for kind in [WrKind::Recv, WrKind::Send, WrKind::OneSided] {
            for (conn, index) in [(0, 0), (u32::MAX, 0x00FF_FFFF), (77, 1234)] {
                let id = WrId { conn, kind, index };
                assert_eq!(WrId::decode(id.encode()), Some(id));
            }
        }
        assert_eq!(WrId::decode(0), None);
        assert_eq!(WrId::decode(0xFF << 24), None);
    }

    /// Two ends exchanging frames under every small window and a deterministic
    /// pseudo-random schedule (who acts, whether it has data, which in-flight frame
    /// lands): no end ever posts without a credit, credits never exceed the window,
    /// and whenever data is waiting the system can make progress (no deadlock).
    #[test]
    fn rdma_credits_never_overrun_and_never_deadlock() {
        struct End {
            credits: Credits,
            /// Frames sent to this end, not yet received (in order: RC).
            inbox: std::collections::VecDeque<(FrameKind, u16)>,
            /// Receive slots holding a received frame not yet consumed.
            held: u32,
            free_slots: u32,
            data_to_send: u32,
            data_received: u32,
        }
        for window in RECV_SLOTS_MIN..=8 {
            let mut seed = 0x9E37_79B9_7F4A_7C15u64 ^ u64::from(window);
            let mut rnd = move |n: u64| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                seed % n
            };
            let mk = || End {
                credits: Credits::new(window, window),
                inbox: Default::default(),
                held: 0,
                free_slots: u32::from(window),
                data_to_send: 200,
                data_received: 0,
            };
            let mut ends = [mk(), mk()];
            let mut steps = 0;
            while ends.iter().any(|e| e.data_to_send > 0)
                || ends.iter().any(|e| !e.inbox.is_empty())
            {
                steps += 1;
                assert!(steps < 200_000, "window {window}: no progress (deadlock)");
                let me = rnd(2) as usize;
                let other = 1 - me;
                match rnd(3) {
                    // Send a data frame if allowed, else a credit frame if needed.
                    0 => {
                        let e = &mut ends[me];
                        let kind = if e.data_to_send > 0 && e.credits.can_send_data() {
                            e.data_to_send -= 1;
                            Some(FrameKind::Data)
                        } else if e.credits.needs_credit_frame() {
                            Some(FrameKind::Credit)
                        } else {
                            None
                        };
                        if let Some(kind) = kind {
                            let back = e.credits.take_for_frame();
                            let o = &mut ends[other];
                            assert!(
                                o.free_slots > 0,
                                "window {window}: SEND without a posted slot"
                            );
                            o.free_slots -= 1;
                            o.inbox.push_back((kind, back));
                        }
                    }
                    // Receive the oldest in-flight frame.
                    1 => {
                        let e = &mut ends[me];
                        if let Some((kind, back)) = e.inbox.pop_front() {
                            e.credits.returned(back, window).unwrap();
                            assert!(e.credits.send_credits() <= u32::from(window));
                            match kind {
                                FrameKind::Data => {
                                    e.held += 1;
                                    e.data_received += 1;
                                }
                                FrameKind::Credit => {
                                    e.free_slots += 1;
                                    e.credits.reposted();
                                }
                            }
                        }
                    }
                    // The application consumes a held frame; its slot is re-posted.
                    _ => {
                        let e = &mut ends[me];
                        if e.held > 0 {
                            e.held -= 1;
                            e.free_slots += 1;
                            e.credits.reposted();
                        }
                    }
                }
                // Once the applications have consumed everything, the remaining
                // traffic must still drain: checked by the loop condition together
                // with the step bound.
                for e in ends.iter_mut() {
                    if e.data_to_send == 0 && e.inbox.is_empty() && e.held > 0 && rnd(4) == 0 {
                        e.held -= 1;
                        e.free_slots += 1;
                        e.credits.reposted();
                    }
                }
            }
            assert_eq!(ends[0].data_received, 200);
            assert_eq!(ends[1].data_received, 200);
        }
    }

    fn write(i: u64, len: usize) -> Message {
        Message::Write {
            id: RequestId(i),
            epoch: Epoch(1),
            target: IoTarget {
                pg: PgId(1),
                object: ObjectId {
                    volume: VolumeId(1),
                    index: i,
                },
                offset: 0,
                length: len as u32,
            },
            flags: 0,
            seq: PgSeq(0),
            op: crate::ids::OpId::NONE,
            remote: None,
            data: PayloadBuf::copy_from(
                &(0..len)
                    .map(|j| (j as u64 * 31 + i) as u8)
                    .collect::<Vec<_>>(),
            ),
        }
    }

    #[test]
    fn rdma_stream_decoder_reassembles_messages_across_any_chunking() {
        let sent: Vec<Message> = (0..20u64)
            .map(|i| write(i, [0, 1, 100, 4096, 70_000][i as usize % 5]))
            .collect();
        let stream: Vec<u8> = sent.iter().flat_map(|m| m.encode()).collect();
        for chunk in [1usize, 7, 63, 64, 65, 128, 4088, 16_376, 1 << 20] {
            let mut d = StreamDecoder::default();
            let mut got = Vec::new();
            for part in stream.chunks(chunk) {
                let mut at = 0;
                // Bounded: every round consumes bytes or ends the part.
                while at < part.len() {
                    let (n, msg) = d.feed(&part[at..], PayloadAlloc::Fallback);
                    at += n;
                    if let Some(m) = msg {
                        got.push(m.unwrap());
                    } else {
                        assert_eq!(at, part.len());
                    }
                }
            }
            assert!(!d.in_message());
            assert_eq!(got, sent, "chunk {chunk}");
        }
    }

    #[test]
    fn rdma_stream_decoder_waits_for_pool_memory_before_the_payload() {
        let cfg = crate::buffer::registered::MemoryPoolConfig {
            bytes_per_thread: 4 << 20,
            ..Default::default()
        };
        crate::buffer::registered::install_on_this_thread(&cfg).unwrap();
        let sent = [write(1, 70_000), write(2, 100)];
        let stream: Vec<u8> = sent.iter().flat_map(|m| m.encode()).collect();
        // Hold the whole pool.
        let mut hold = Vec::new();
        while let Some(b) = PayloadBufMut::try_for_overwrite(64 << 10) {
            hold.push(b);
            assert!(hold.len() <= 64, "the pool is larger than configured");
        }
        let mut d = StreamDecoder::default();
        let (n, msg) = d.feed(&stream, PayloadAlloc::PoolOrWait);
        assert!(msg.is_none());
        assert_eq!(
            n, HEADER_LEN,
            "stopped after the header, before the payload"
        );
        assert_eq!(d.needs_memory(), Some(70_000));
        assert!(d.in_message());
        // Waiting for this side's memory is not a payload the peer owes.
        assert!(!d.in_payload());
        // Nothing more is consumed while it waits, and a wrong buffer is refused.
        assert_eq!(d.feed(&stream[n..], PayloadAlloc::PoolOrWait).0, 0);
        assert!(d.supply(PayloadBufMut::for_overwrite(4096)).is_err());
        drop(hold);
        let buf = PayloadBufMut::try_for_overwrite(70_000).expect("memory freed");
        assert!(d.supply(buf).is_ok());
        assert_eq!(d.needs_memory(), None);
        assert!(
            d.in_payload(),
            "the payload's bytes are now the peer's to send"
        );
        let mut got = Vec::new();
        let mut at = n;
        // Bounded: every round consumes bytes or ends the stream.
        while at < stream.len() {
            let (n, msg) = d.feed(&stream[at..], PayloadAlloc::PoolOrWait);
            at += n;
            if let Some(m) = msg {
                got.push(m.unwrap());
            } else {
                assert_eq!(at, stream.len());
            }
        }
        assert_eq!(got, sent);
        assert!(!d.in_message());
    }

    #[test]
    fn rdma_stream_decoder_refuses_garbage_before_allocating() {
        let mut d = StreamDecoder::default();
        let (n, msg) = d.feed(&[0xAB; 200], PayloadAlloc::Fallback);
        assert_eq!(n, HEADER_PREFIX_LEN, "judged on the prefix alone");
        assert!(matches!(msg, Some(Err(ProtocolError::BadMagic(_)))));
    }
}
