//! NBD wire format: constants, encoders and decoders, with no I/O.
//!
//! Everything here works on byte slices so that every message of the protocol —
//! handshake, options, option replies, requests, simple and structured replies — and
//! every way a peer can get one wrong is unit-tested without a socket. The I/O layers
//! ([`super::handshake`], [`super::transmission`]) only move bytes and call these.
//!
//! Numbers and names follow the specification (`NetworkBlockDevice/nbd`
//! `doc/proto.md`); all integers are big-endian.

/// `NBDMAGIC`, the first 8 bytes the server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: second server magic, and the prefix of every client option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of option replies.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of transmission requests.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of simple replies.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of structured reply chunks.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flag: the server speaks fixed newstyle.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Handshake flag: the server can omit the 124 zero bytes after `EXPORT_NAME`.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: the client speaks fixed newstyle.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: the client does not want the 124 zero bytes.
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Option: choose an export and enter transmission (no way to report errors).
pub const OPT_EXPORT_NAME: u32 = 1;
/// Option: end the session.
pub const OPT_ABORT: u32 = 2;
/// Option: list exports.
pub const OPT_LIST: u32 = 3;
/// Option: start TLS (refused: Flame's NBD server runs NOTLS on loopback/trusted nets).
pub const OPT_STARTTLS: u32 = 5;
/// Option: describe an export without entering transmission.
pub const OPT_INFO: u32 = 6;
/// Option: describe an export and enter transmission.
pub const OPT_GO: u32 = 7;
/// Option: switch to structured replies.
pub const OPT_STRUCTURED_REPLY: u32 = 8;
/// Option: list metadata contexts (not supported; answered `ERR_UNSUP`).
pub const OPT_LIST_META_CONTEXT: u32 = 9;
/// Option: select metadata contexts (not supported; answered `ERR_UNSUP`).
pub const OPT_SET_META_CONTEXT: u32 = 10;
/// Option: extended headers (experimental; answered `ERR_UNSUP`).
pub const OPT_EXTENDED_HEADERS: u32 = 11;

/// Option reply: success / end of a list.
pub const REP_ACK: u32 = 1;
/// Option reply: one export of a `LIST`.
pub const REP_SERVER: u32 = 2;
/// Option reply: one information item of `INFO`/`GO`.
pub const REP_INFO: u32 = 3;
/// Error replies have bit 31 set.
pub const REP_ERR_BIT: u32 = 1 << 31;
/// The option is not known.
pub const REP_ERR_UNSUP: u32 = REP_ERR_BIT | 1;
/// Server policy forbids the option.
pub const REP_ERR_POLICY: u32 = REP_ERR_BIT | 2;
/// The option was malformed.
pub const REP_ERR_INVALID: u32 = REP_ERR_BIT | 3;
/// Not supported on this platform.
pub const REP_ERR_PLATFORM: u32 = REP_ERR_BIT | 4;
/// TLS required first.
pub const REP_ERR_TLS_REQD: u32 = REP_ERR_BIT | 5;
/// No such export.
pub const REP_ERR_UNKNOWN: u32 = REP_ERR_BIT | 6;
/// The server is shutting down.
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR_BIT | 7;
/// The client must ask for block sizes.
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_ERR_BIT | 8;
/// The request or reply is too large.
pub const REP_ERR_TOO_BIG: u32 = REP_ERR_BIT | 9;

/// Info item: size and transmission flags (mandatory in every `INFO`/`GO` answer).
pub const INFO_EXPORT: u16 = 0;
/// Info item: canonical export name.
pub const INFO_NAME: u16 = 1;
/// Info item: human-readable description.
pub const INFO_DESCRIPTION: u16 = 2;
/// Info item: block size constraints.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flag: always set.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
/// Transmission flag: writes are refused.
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
/// Transmission flag: `FLUSH` supported.
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
/// Transmission flag: `FUA` supported.
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
/// Transmission flag: rotational medium.
pub const TFLAG_ROTATIONAL: u16 = 1 << 4;
/// Transmission flag: `TRIM` supported.
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
/// Transmission flag: `WRITE_ZEROES` supported.
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Transmission flag: `DF` supported (only with structured replies).
pub const TFLAG_SEND_DF: u16 = 1 << 7;
/// Transmission flag: FLUSH/FUA effects are visible on every connection.
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
/// Transmission flag: `CACHE` supported.
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;

/// Command: read.
pub const CMD_READ: u16 = 0;
/// Command: write.
pub const CMD_WRITE: u16 = 1;
/// Command: disconnect.
pub const CMD_DISC: u16 = 2;
/// Command: flush.
pub const CMD_FLUSH: u16 = 3;
/// Command: trim (discard).
pub const CMD_TRIM: u16 = 4;
/// Command: cache (prefetch hint).
pub const CMD_CACHE: u16 = 5;
/// Command: write zeroes.
pub const CMD_WRITE_ZEROES: u16 = 6;
/// Command: block status (not supported).
pub const CMD_BLOCK_STATUS: u16 = 7;

/// Command flag: force unit access.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Command flag: do not punch holes (`WRITE_ZEROES`).
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
/// Command flag: do not fragment a structured read.
pub const CMD_FLAG_DF: u16 = 1 << 2;
/// Command flag: one extent only (`BLOCK_STATUS`).
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
/// Command flag: fail fast if zeroing is slow (`WRITE_ZEROES`).
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// Structured reply flag: last chunk of the reply.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
/// Chunk type: no payload (must carry `DONE`).
pub const REPLY_TYPE_NONE: u16 = 0;
/// Chunk type: u64 offset + data.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// Chunk type: u64 offset + u32 hole size.
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
/// Chunk type: u32 error, u16 message length, message.
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;

/// Errno values the protocol allows on the wire.
pub mod errno {
    /// Operation not permitted (write to a read-only export).
    pub const EPERM: u32 = 1;
    /// I/O error.
    pub const EIO: u32 = 5;
    /// Out of memory.
    pub const ENOMEM: u32 = 12;
    /// Invalid argument (range, alignment, unknown command or flag).
    pub const EINVAL: u32 = 22;
    /// No space (write past the end).
    pub const ENOSPC: u32 = 28;
    /// Value too large (read over the maximum payload).
    pub const EOVERFLOW: u32 = 75;
    /// Operation not supported (only for `FAST_ZERO`).
    pub const ENOTSUP: u32 = 95;
    /// Server shutting down.
    pub const ESHUTDOWN: u32 = 108;
}

/// Length of the server greeting (`NBDMAGIC`, `IHAVEOPT`, u16 flags).
pub const GREETING_LEN: usize = 18;
/// Length of an option header (`IHAVEOPT`, u32 option, u32 length).
pub const OPTION_HEADER_LEN: usize = 16;
/// Length of a request header.
pub const REQUEST_LEN: usize = 28;
/// Length of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Length of a structured reply chunk header.
pub const STRUCTURED_HEADER_LEN: usize = 20;
/// Longest string (export name, description, message) the protocol allows.
pub const STRING_BYTES_MAX: usize = 4096;

/// Block sizes advertised in `INFO_BLOCK_SIZE`: any alignment works (min 1); 4 KiB is
/// the efficient unit; 32 MiB is the largest payload the spec asks servers to accept
/// without calling it a DoS.
pub const BLOCK_SIZE_MIN: u32 = 1;
/// Preferred block size.
pub const BLOCK_SIZE_PREFERRED: u32 = 4096;
/// Largest request payload (read length or write data) accepted.
pub const PAYLOAD_BYTES_MAX: u32 = 32 << 20;

/// Why bytes from a client could not be decoded. Each variant maps to one protocol
/// reaction (an error reply or a hard disconnect), chosen by the caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    /// A magic number was wrong: the peer is not speaking NBD (hard disconnect).
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    /// The client set handshake flags we did not offer (hard disconnect).
    #[error("unknown client flags {0:#x}")]
    BadClientFlags(u32),
    /// Option data is malformed (reply `ERR_INVALID`).
    #[error("malformed option data: {0}")]
    Invalid(&'static str),
}

fn be_u16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be_u32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be_u64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// The server's first message: `NBDMAGIC`, `IHAVEOPT` and handshake flags
/// (`FIXED_NEWSTYLE | NO_ZEROES`; oldstyle and plain newstyle are not offered).
pub fn encode_greeting() -> [u8; GREETING_LEN] {
    let mut b = [0u8; GREETING_LEN];
    b[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..18].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    b
}

/// What the client's flags negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientFlags {
    /// Fixed newstyle (replies to options other than `EXPORT_NAME`).
    pub fixed_newstyle: bool,
    /// Omit the 124 zero bytes after `EXPORT_NAME`.
    pub no_zeroes: bool,
}

/// Decodes the client's u32 flags; any bit we did not offer is an error (the spec says
/// the server MUST drop the connection).
pub fn decode_client_flags(b: &[u8; 4]) -> Result<ClientFlags, ProtoError> {
    let f = u32::from_be_bytes(*b);
    if f & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(ProtoError::BadClientFlags(f));
    }
    Ok(ClientFlags {
        fixed_newstyle: f & FLAG_C_FIXED_NEWSTYLE != 0,
        no_zeroes: f & FLAG_C_NO_ZEROES != 0,
    })
}

/// An option header: which option, and how many data bytes follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    /// Option number.
    pub option: u32,
    /// Length of the data that follows (not yet bounded: the caller checks it).
    pub len: u32,
}

/// Decodes an option header; a wrong magic is a protocol violation.
pub fn decode_option_header(b: &[u8; OPTION_HEADER_LEN]) -> Result<OptionHeader, ProtoError> {
    let magic = be_u64(b, 0);
    if magic != IHAVEOPT {
        return Err(ProtoError::BadMagic(magic));
    }
    Ok(OptionHeader {
        option: be_u32(b, 8),
        len: be_u32(b, 12),
    })
}

/// Encodes one option reply (header and data).
pub fn encode_option_reply(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&reply_type.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// Data of a `REP_SERVER` reply (one export of `LIST`).
pub fn encode_rep_server(name: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + name.len());
    b.extend_from_slice(&(name.len() as u32).to_be_bytes());
    b.extend_from_slice(name.as_bytes());
    b
}

/// Data of a `REP_INFO` / `INFO_EXPORT` item.
pub fn encode_info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut b = Vec::with_capacity(12);
    b.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    b.extend_from_slice(&size.to_be_bytes());
    b.extend_from_slice(&flags.to_be_bytes());
    b
}

/// Data of a `REP_INFO` / `INFO_NAME` or `INFO_DESCRIPTION` item.
pub fn encode_info_string(info: u16, s: &str) -> Vec<u8> {
    let s = &s.as_bytes()[..s.len().min(STRING_BYTES_MAX)];
    let mut b = Vec::with_capacity(2 + s.len());
    b.extend_from_slice(&info.to_be_bytes());
    b.extend_from_slice(s);
    b
}

/// Data of a `REP_INFO` / `INFO_BLOCK_SIZE` item.
pub fn encode_info_block_size(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(14);
    b.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    b.extend_from_slice(&min.to_be_bytes());
    b.extend_from_slice(&preferred.to_be_bytes());
    b.extend_from_slice(&max.to_be_bytes());
    b
}

/// The answer to `EXPORT_NAME`: size, transmission flags, and 124 zero bytes unless
/// `NO_ZEROES` was negotiated.
pub fn encode_export_name_reply(size: u64, flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut b = Vec::with_capacity(134);
    b.extend_from_slice(&size.to_be_bytes());
    b.extend_from_slice(&flags.to_be_bytes());
    if !no_zeroes {
        b.extend_from_slice(&[0u8; 124]);
    }
    b
}

/// A decoded `INFO`/`GO` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    /// Export name (raw bytes; the caller checks UTF-8).
    pub name: Vec<u8>,
    /// Information items the client asked for (unknown ones are ignored later).
    pub infos: Vec<u16>,
}

/// Decodes `INFO`/`GO` data: u32 name length, name, u16 count, count × u16. Every
/// length is checked against the data actually present, so inconsistent data is
/// `Invalid` (reply `ERR_INVALID`), never an out-of-bounds read.
pub fn decode_info_request(data: &[u8]) -> Result<InfoRequest, ProtoError> {
    if data.len() < 6 {
        return Err(ProtoError::Invalid("INFO/GO data shorter than 6 bytes"));
    }
    let name_len = be_u32(data, 0) as usize;
    if name_len > STRING_BYTES_MAX {
        return Err(ProtoError::Invalid("export name longer than 4096 bytes"));
    }
    if data.len() < 4 + name_len + 2 {
        return Err(ProtoError::Invalid(
            "export name length exceeds option data",
        ));
    }
    let name = data[4..4 + name_len].to_vec();
    let n = be_u16(data, 4 + name_len) as usize;
    let rest = &data[4 + name_len + 2..];
    if rest.len() != n * 2 {
        return Err(ProtoError::Invalid(
            "information request count does not match option length",
        ));
    }
    let infos = rest.chunks_exact(2).map(|c| be_u16(c, 0)).collect();
    Ok(InfoRequest { name, infos })
}

/// A transmission request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Command flags.
    pub flags: u16,
    /// Command type.
    pub cmd: u16,
    /// Client's cookie (handle), echoed in the reply.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Byte length (for `WRITE`, the payload that follows).
    pub len: u32,
}

/// Decodes a request header; a wrong magic means the stream is lost (hard
/// disconnect).
pub fn decode_request(b: &[u8; REQUEST_LEN]) -> Result<Request, ProtoError> {
    let magic = be_u32(b, 0);
    if magic != REQUEST_MAGIC {
        return Err(ProtoError::BadMagic(u64::from(magic)));
    }
    Ok(Request {
        flags: be_u16(b, 4),
        cmd: be_u16(b, 6),
        cookie: be_u64(b, 8),
        offset: be_u64(b, 16),
        len: be_u32(b, 24),
    })
}

/// Encodes a request (used by tests and tools acting as a client).
pub fn encode_request(r: &Request) -> [u8; REQUEST_LEN] {
    let mut b = [0u8; REQUEST_LEN];
    b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&r.flags.to_be_bytes());
    b[6..8].copy_from_slice(&r.cmd.to_be_bytes());
    b[8..16].copy_from_slice(&r.cookie.to_be_bytes());
    b[16..24].copy_from_slice(&r.offset.to_be_bytes());
    b[24..28].copy_from_slice(&r.len.to_be_bytes());
    b
}

/// A simple reply header (followed by data for a successful read).
pub fn encode_simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_LEN] {
    let mut b = [0u8; SIMPLE_REPLY_LEN];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// A structured reply chunk header.
pub fn encode_structured_header(
    flags: u16,
    chunk_type: u16,
    cookie: u64,
    len: u32,
) -> [u8; STRUCTURED_HEADER_LEN] {
    let mut b = [0u8; STRUCTURED_HEADER_LEN];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&chunk_type.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..20].copy_from_slice(&len.to_be_bytes());
    b
}

/// Header of a final `OFFSET_DATA` chunk: chunk header plus the u64 offset; the
/// `data_len` data bytes follow (sent as their own buffer, not copied).
pub fn encode_offset_data_header(cookie: u64, offset: u64, data_len: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(STRUCTURED_HEADER_LEN + 8);
    b.extend_from_slice(&encode_structured_header(
        REPLY_FLAG_DONE,
        REPLY_TYPE_OFFSET_DATA,
        cookie,
        data_len.saturating_add(8),
    ));
    b.extend_from_slice(&offset.to_be_bytes());
    b
}

/// A final `NONE` chunk (successful reply with no payload).
pub fn encode_none_chunk(cookie: u64) -> [u8; STRUCTURED_HEADER_LEN] {
    encode_structured_header(REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, 0)
}

/// A final `ERROR` chunk with a human-readable message.
pub fn encode_error_chunk(cookie: u64, error: u32, message: &str) -> Vec<u8> {
    let msg = &message.as_bytes()[..message.len().min(STRING_BYTES_MAX)];
    let mut b = Vec::with_capacity(STRUCTURED_HEADER_LEN + 6 + msg.len());
    b.extend_from_slice(&encode_structured_header(
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        cookie,
        6 + msg.len() as u32,
    ));
    b.extend_from_slice(&error.to_be_bytes());
    b.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    b.extend_from_slice(msg);
    b
}

/// Transmission flags of an export.
pub fn transmission_flags(read_only: bool, structured: bool) -> u16 {
    // CAN_MULTI_CONN: every backend must make FLUSH/FUA cover writes completed on any
    // connection (see `Backend` docs); the server itself caches nothing per
    // connection, so the guarantee is the backend's and holds for all of them.
    let mut f = TFLAG_HAS_FLAGS
        | TFLAG_SEND_FLUSH
        | TFLAG_SEND_FUA
        | TFLAG_CAN_MULTI_CONN
        | TFLAG_SEND_CACHE;
    if read_only {
        f |= TFLAG_READ_ONLY;
    } else {
        // Modifying commands are offered only where they can succeed.
        f |= TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES;
    }
    if structured {
        f |= TFLAG_SEND_DF;
    }
    f
}

/// A request that passed validation, ready for the backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Command {
    /// Read `len` bytes at `offset`.
    Read {
        /// Offset.
        offset: u64,
        /// Length.
        len: u32,
    },
    /// Write the payload at `offset`.
    Write {
        /// Offset.
        offset: u64,
        /// Length of the payload.
        len: u32,
        /// Durable before the reply.
        fua: bool,
    },
    /// Soft disconnect.
    Disc,
    /// Make every completed write durable.
    Flush,
    /// Discard a range.
    Trim {
        /// Offset.
        offset: u64,
        /// Length.
        len: u32,
        /// Durable before the reply.
        fua: bool,
    },
    /// Prefetch hint (no-op).
    Cache,
    /// Zero a range.
    WriteZeroes {
        /// Offset.
        offset: u64,
        /// Length.
        len: u32,
        /// Durable before the reply.
        fua: bool,
    },
}

/// Why a request is refused, with the errno to send and a message for the
/// structured `ERROR` chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// Errno for the reply.
    pub errno: u32,
    /// Human-readable reason.
    pub message: &'static str,
}

fn refuse(errno: u32, message: &'static str) -> Refusal {
    Refusal { errno, message }
}

/// What the negotiated session allows, for [`validate`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionInfo {
    /// Export size in bytes.
    pub size: u64,
    /// Export is read-only.
    pub read_only: bool,
    /// Structured replies negotiated.
    pub structured: bool,
}

/// Checks a request against the session: known command, allowed flags, range inside
/// the export, payload within bounds, writes allowed. Errors follow the spec: EINVAL
/// for bad flags/commands/ranges, ENOSPC for writes past the end, EOVERFLOW for an
/// over-long read, EPERM for writes to a read-only export.
pub fn validate(r: &Request, s: &SessionInfo) -> Result<Command, Refusal> {
    use errno::*;
    let fua = r.flags & CMD_FLAG_FUA != 0;
    // FUA is valid on every command; the others only where they mean something.
    let allowed = match r.cmd {
        CMD_READ if s.structured => CMD_FLAG_FUA | CMD_FLAG_DF,
        CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE,
        CMD_READ | CMD_WRITE | CMD_DISC | CMD_FLUSH | CMD_TRIM | CMD_CACHE => CMD_FLAG_FUA,
        _ => return Err(refuse(EINVAL, "unknown or unsupported command")),
    };
    if r.flags & !allowed != 0 {
        return Err(refuse(EINVAL, "unknown or unsupported command flag"));
    }
    let end = r.offset.checked_add(u64::from(r.len));
    let in_range = matches!(end, Some(e) if e <= s.size);
    let writes = matches!(r.cmd, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && s.read_only {
        return Err(refuse(EPERM, "export is read-only"));
    }
    match r.cmd {
        CMD_DISC => Ok(Command::Disc),
        CMD_FLUSH => {
            if r.offset != 0 || r.len != 0 {
                return Err(refuse(EINVAL, "flush must have offset and length 0"));
            }
            Ok(Command::Flush)
        }
        CMD_READ => {
            if r.len > PAYLOAD_BYTES_MAX {
                return Err(refuse(EOVERFLOW, "read longer than the maximum payload"));
            }
            if !in_range {
                return Err(refuse(EINVAL, "read beyond the end of the export"));
            }
            Ok(Command::Read {
                offset: r.offset,
                len: r.len,
            })
        }
        CMD_WRITE => {
            if r.len > PAYLOAD_BYTES_MAX {
                return Err(refuse(EINVAL, "write longer than the maximum payload"));
            }
            if !in_range {
                return Err(refuse(ENOSPC, "write beyond the end of the export"));
            }
            Ok(Command::Write {
                offset: r.offset,
                len: r.len,
                fua,
            })
        }
        CMD_TRIM => {
            if !in_range {
                return Err(refuse(EINVAL, "trim beyond the end of the export"));
            }
            Ok(Command::Trim {
                offset: r.offset,
                len: r.len,
                fua,
            })
        }
        CMD_WRITE_ZEROES => {
            if !in_range {
                return Err(refuse(ENOSPC, "write-zeroes beyond the end of the export"));
            }
            Ok(Command::WriteZeroes {
                offset: r.offset,
                len: r.len,
                fua,
            })
        }
        CMD_CACHE => {
            if !in_range {
                return Err(refuse(EINVAL, "cache beyond the end of the export"));
            }
            Ok(Command::Cache)
        }
        _ => Err(refuse(EINVAL, "unknown command")),
    }
}

/// Maps a backend errno to one the protocol allows (EDQUOT/EFBIG → ENOSPC, EROFS →
/// EPERM, anything unknown → EIO), so clients never see a value they cannot
/// interpret.
pub fn wire_errno(e: i32) -> u32 {
    match e {
        libc::EPERM
        | libc::EIO
        | libc::ENOMEM
        | libc::EINVAL
        | libc::ENOSPC
        | libc::EOVERFLOW
        | libc::ESHUTDOWN => e as u32,
        libc::EDQUOT | libc::EFBIG => errno::ENOSPC,
        libc::EROFS | libc::EACCES => errno::EPERM,
        _ => errno::EIO,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greeting_bytes() {
        let g = encode_greeting();
        assert_eq!(&g[0..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(&g[16..18], &[0, 3]);
    }

    #[test]
    fn client_flags() {
        assert_eq!(
            decode_client_flags(&[0, 0, 0, 3]).unwrap(),
            ClientFlags {
                fixed_newstyle: true,
                no_zeroes: true
            }
        );
        assert_eq!(
            decode_client_flags(&[0, 0, 0, 0]).unwrap(),
            ClientFlags {
                fixed_newstyle: false,
                no_zeroes: false
            }
        );
        assert_eq!(
            decode_client_flags(&[0, 0, 0, 4]),
            Err(ProtoError::BadClientFlags(4))
        );
        assert!(decode_client_flags(&[0x80, 0, 0, 1]).is_err());
    }

    #[test]
    fn option_header() {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(b"IHAVEOPT");
        b[8..12].copy_from_slice(&OPT_GO.to_be_bytes());
        b[12..16].copy_from_slice(&77u32.to_be_bytes());
        assert_eq!(
            decode_option_header(&b).unwrap(),
            OptionHeader {
                option: OPT_GO,
                len: 77
            }
        );
        b[0] = b'X';
        assert!(matches!(
            decode_option_header(&b),
            Err(ProtoError::BadMagic(_))
        ));
    }

    #[test]
    fn option_replies() {
        let r = encode_option_reply(OPT_LIST, REP_SERVER, &encode_rep_server("vol"));
        assert_eq!(&r[0..8], &OPT_REPLY_MAGIC.to_be_bytes());
        assert_eq!(be_u32(&r, 8), OPT_LIST);
        assert_eq!(be_u32(&r, 12), REP_SERVER);
        assert_eq!(be_u32(&r, 16), 7);
        assert_eq!(be_u32(&r, 20), 3);
        assert_eq!(&r[24..], b"vol");
        let ack = encode_option_reply(OPT_ABORT, REP_ACK, &[]);
        assert_eq!(ack.len(), 20);
        assert_eq!(be_u32(&ack, 16), 0);
        assert_eq!(REP_ERR_UNSUP, 0x8000_0001);
        assert_eq!(REP_ERR_TOO_BIG, 0x8000_0009);
        assert_eq!(REP_ERR_UNKNOWN, 0x8000_0006);
        assert_eq!(REP_ERR_POLICY, 0x8000_0002);
    }

    #[test]
    fn info_items() {
        let e = encode_info_export(1 << 30, 0x1234);
        assert_eq!(e.len(), 12);
        assert_eq!(be_u16(&e, 0), INFO_EXPORT);
        assert_eq!(be_u64(&e, 2), 1 << 30);
        assert_eq!(be_u16(&e, 10), 0x1234);
        let b = encode_info_block_size(1, 4096, 32 << 20);
        assert_eq!(b.len(), 14);
        assert_eq!(be_u16(&b, 0), INFO_BLOCK_SIZE);
        assert_eq!(be_u32(&b, 2), 1);
        assert_eq!(be_u32(&b, 6), 4096);
        assert_eq!(be_u32(&b, 10), 32 << 20);
        let n = encode_info_string(INFO_NAME, "abc");
        assert_eq!(n, vec![0, 1, b'a', b'b', b'c']);
        let long = "x".repeat(5000);
        assert_eq!(
            encode_info_string(INFO_DESCRIPTION, &long).len(),
            2 + STRING_BYTES_MAX
        );
    }

    #[test]
    fn export_name_reply() {
        assert_eq!(encode_export_name_reply(5, 1, true).len(), 10);
        let r = encode_export_name_reply(5, 1, false);
        assert_eq!(r.len(), 134);
        assert_eq!(be_u64(&r, 0), 5);
        assert_eq!(be_u16(&r, 8), 1);
        assert!(r[10..].iter().all(|&b| b == 0));
    }

    fn info_data(name: &[u8], infos: &[u16]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name);
        d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        for i in infos {
            d.extend_from_slice(&i.to_be_bytes());
        }
        d
    }

    #[test]
    fn info_request_ok_and_malformed() {
        let d = info_data(b"disk", &[INFO_NAME, INFO_BLOCK_SIZE, 999]);
        assert_eq!(
            decode_info_request(&d).unwrap(),
            InfoRequest {
                name: b"disk".to_vec(),
                infos: vec![INFO_NAME, INFO_BLOCK_SIZE, 999]
            }
        );
        // Empty name, no infos.
        assert_eq!(decode_info_request(&info_data(b"", &[])).unwrap().name, b"");
        // Too short.
        assert!(decode_info_request(&[0, 0, 0]).is_err());
        // Name length beyond the data.
        let mut bad = info_data(b"disk", &[]);
        bad[3] = 200;
        assert!(decode_info_request(&bad).is_err());
        // Name length huge (overflow attempt).
        let mut bad = info_data(b"disk", &[]);
        bad[0] = 0xff;
        assert!(decode_info_request(&bad).is_err());
        // Count says 2, one present.
        let mut bad = info_data(b"d", &[1]);
        let at = 4 + 1;
        bad[at + 1] = 2;
        assert!(decode_info_request(&bad).is_err());
        // Trailing junk.
        let mut bad = info_data(b"d", &[1]);
        bad.push(0);
        assert!(decode_info_request(&bad).is_err());
        // Over-long name.
        let name = vec![b'a'; STRING_BYTES_MAX + 1];
        assert!(decode_info_request(&info_data(&name, &[])).is_err());
    }

    #[test]
    fn request_roundtrip_and_bad_magic() {
        let r = Request {
            flags: CMD_FLAG_FUA,
            cmd: CMD_WRITE,
            cookie: 0xdead_beef_0102_0304,
            offset: 4096,
            len: 512,
        };
        let b = encode_request(&r);
        assert_eq!(decode_request(&b).unwrap(), r);
        let mut bad = b;
        bad[0] ^= 1;
        assert!(matches!(decode_request(&bad), Err(ProtoError::BadMagic(_))));
    }

    #[test]
    fn replies() {
        let s = encode_simple_reply(22, 7);
        assert_eq!(be_u32(&s, 0), SIMPLE_REPLY_MAGIC);
        assert_eq!(be_u32(&s, 4), 22);
        assert_eq!(be_u64(&s, 8), 7);
        let h = encode_offset_data_header(9, 4096, 100);
        assert_eq!(h.len(), 28);
        assert_eq!(be_u32(&h, 0), STRUCTURED_REPLY_MAGIC);
        assert_eq!(be_u16(&h, 4), REPLY_FLAG_DONE);
        assert_eq!(be_u16(&h, 6), REPLY_TYPE_OFFSET_DATA);
        assert_eq!(be_u64(&h, 8), 9);
        assert_eq!(be_u32(&h, 16), 108);
        assert_eq!(be_u64(&h, 20), 4096);
        let n = encode_none_chunk(3);
        assert_eq!(be_u16(&n, 4), REPLY_FLAG_DONE);
        assert_eq!(be_u16(&n, 6), REPLY_TYPE_NONE);
        assert_eq!(be_u32(&n, 16), 0);
        let e = encode_error_chunk(5, errno::EINVAL, "bad");
        assert_eq!(be_u16(&e, 6), REPLY_TYPE_ERROR);
        assert_eq!(be_u32(&e, 16), 9);
        assert_eq!(be_u32(&e, 20), 22);
        assert_eq!(be_u16(&e, 24), 3);
        assert_eq!(&e[26..], b"bad");
    }

    #[test]
    fn flags() {
        let f = transmission_flags(false, false);
        assert_eq!(f & TFLAG_HAS_FLAGS, TFLAG_HAS_FLAGS);
        assert_eq!(f & TFLAG_SEND_DF, 0);
        assert_eq!(f & TFLAG_READ_ONLY, 0);
        assert_ne!(f & TFLAG_CAN_MULTI_CONN, 0);
        let f = transmission_flags(true, true);
        assert_ne!(f & TFLAG_SEND_DF, 0);
        assert_ne!(f & TFLAG_READ_ONLY, 0);
        assert_eq!(f & (TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES), 0);
    }

    fn req(cmd: u16, flags: u16, offset: u64, len: u32) -> Request {
        Request {
            flags,
            cmd,
            cookie: 1,
            offset,
            len,
        }
    }

    #[test]
    fn validation() {
        use errno::*;
        let s = SessionInfo {
            size: 1 << 20,
            read_only: false,
            structured: false,
        };
        let ok = |r: Request| validate(&r, &s);
        let err = |r: Request| validate(&r, &s).unwrap_err().errno;
        assert_eq!(
            ok(req(CMD_READ, 0, 0, 4096)),
            Ok(Command::Read {
                offset: 0,
                len: 4096
            })
        );
        assert_eq!(
            ok(req(CMD_READ, CMD_FLAG_FUA, 1, 1)),
            Ok(Command::Read { offset: 1, len: 1 })
        );
        assert_eq!(err(req(CMD_READ, 0, (1 << 20) - 1, 2)), EINVAL);
        assert_eq!(err(req(CMD_READ, 0, u64::MAX, 2)), EINVAL);
        assert_eq!(err(req(CMD_READ, 0, 0, PAYLOAD_BYTES_MAX + 1)), EOVERFLOW);
        // DF only with structured replies.
        assert_eq!(err(req(CMD_READ, CMD_FLAG_DF, 0, 1)), EINVAL);
        let ss = SessionInfo {
            structured: true,
            ..s
        };
        assert!(validate(&req(CMD_READ, CMD_FLAG_DF, 0, 1), &ss).is_ok());
        assert_eq!(
            ok(req(CMD_WRITE, CMD_FLAG_FUA, 512, 512)),
            Ok(Command::Write {
                offset: 512,
                len: 512,
                fua: true
            })
        );
        assert_eq!(err(req(CMD_WRITE, 0, 1 << 20, 1)), ENOSPC);
        assert_eq!(err(req(CMD_WRITE, CMD_FLAG_DF, 0, 1)), EINVAL);
        assert_eq!(err(req(CMD_WRITE, 1 << 9, 0, 1)), EINVAL);
        assert_eq!(ok(req(CMD_FLUSH, 0, 0, 0)), Ok(Command::Flush));
        assert_eq!(ok(req(CMD_FLUSH, CMD_FLAG_FUA, 0, 0)), Ok(Command::Flush));
        assert_eq!(err(req(CMD_FLUSH, 0, 0, 1)), EINVAL);
        assert_eq!(ok(req(CMD_DISC, 0, 0, 0)), Ok(Command::Disc));
        assert_eq!(
            ok(req(CMD_TRIM, 0, 0, 1 << 20)),
            Ok(Command::Trim {
                offset: 0,
                len: 1 << 20,
                fua: false
            })
        );
        assert_eq!(err(req(CMD_TRIM, 0, 1, 1 << 20)), EINVAL);
        assert_eq!(
            ok(req(
                CMD_WRITE_ZEROES,
                CMD_FLAG_NO_HOLE | CMD_FLAG_FUA,
                0,
                10
            )),
            Ok(Command::WriteZeroes {
                offset: 0,
                len: 10,
                fua: true
            })
        );
        assert_eq!(
            err(req(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 10)),
            EINVAL
        );
        assert_eq!(err(req(CMD_WRITE_ZEROES, 0, 1 << 20, 10)), ENOSPC);
        assert_eq!(ok(req(CMD_CACHE, 0, 0, 10)), Ok(Command::Cache));
        assert_eq!(err(req(CMD_BLOCK_STATUS, 0, 0, 10)), EINVAL);
        assert_eq!(err(req(99, 0, 0, 10)), EINVAL);
        // Read-only export.
        let ro = SessionInfo {
            read_only: true,
            ..s
        };
        assert_eq!(
            validate(&req(CMD_WRITE, 0, 0, 1), &ro).unwrap_err().errno,
            EPERM
        );
        assert_eq!(
            validate(&req(CMD_TRIM, 0, 0, 1), &ro).unwrap_err().errno,
            EPERM
        );
        assert_eq!(
            validate(&req(CMD_WRITE_ZEROES, 0, 0, 1), &ro)
                .unwrap_err()
                .errno,
            EPERM
        );
        assert!(validate(&req(CMD_READ, 0, 0, 1), &ro).is_ok());
        assert!(validate(&req(CMD_FLUSH, 0, 0, 0), &ro).is_ok());
    }

    #[test]
    fn errno_mapping() {
        assert_eq!(wire_errno(libc::EIO), errno::EIO);
        assert_eq!(wire_errno(libc::EDQUOT), errno::ENOSPC);
        assert_eq!(wire_errno(libc::EFBIG), errno::ENOSPC);
        assert_eq!(wire_errno(libc::EROFS), errno::EPERM);
        assert_eq!(wire_errno(libc::ETIMEDOUT), errno::EIO);
        assert_eq!(wire_errno(-3), errno::EIO);
        assert_eq!(wire_errno(libc::ESHUTDOWN), errno::ESHUTDOWN);
    }
}

/// Property tests of every decoder here, and of [`validate`] on whatever they
/// decode: arbitrary bytes and mutated valid encodings give `Ok` or a
/// [`ProtoError`] (never a panic, never a read past the data), encodings round-trip,
/// and an accepted command's range lies inside the export. Seeded and bounded
/// (`PROPTEST_CASES` / `PROPTEST_RNG_SEED` override for a longer run). The
/// negotiation state machine as a whole is property-tested over a socket in
/// `flame-client/tests/nbd_handshake_props.rs`; the cargo-fuzz target of both is
/// `fuzz/fuzz_targets/nbd.rs`.
#[cfg(test)]
mod props {
    use super::*;
    use flame_common::fuzzing::mutate;
    use flame_common::fuzzing::props::{config, mutations};
    use proptest::prelude::*;

    /// This file's proptest seed (`config`).
    const SEED: u64 = 0xf1a3_0002;

    fn info_data(name: &[u8], infos: &[u16]) -> Vec<u8> {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name);
        d.extend_from_slice(&(infos.len() as u16).to_be_bytes());
        for i in infos {
            d.extend_from_slice(&i.to_be_bytes());
        }
        d
    }

    fn check_info(d: &[u8]) {
        if let Ok(r) = decode_info_request(d) {
            assert!(r.name.len() <= STRING_BYTES_MAX);
            assert_eq!(info_data(&r.name, &r.infos), d, "re-encodes differently");
        }
    }

    fn session() -> impl Strategy<Value = SessionInfo> {
        (
            prop_oneof![Just(0u64), Just(1 << 20), Just(u64::MAX), any::<u64>()],
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(size, read_only, structured)| SessionInfo {
                size,
                read_only,
                structured,
            })
    }

    fn check_request(b: &[u8; REQUEST_LEN], s: &SessionInfo) {
        let Ok(r) = decode_request(b) else {
            return;
        };
        assert_eq!(&encode_request(&r), b);
        match validate(&r, s) {
            Ok(
                Command::Read { offset, len }
                | Command::Write { offset, len, .. }
                | Command::Trim { offset, len, .. }
                | Command::WriteZeroes { offset, len, .. },
            ) => {
                let end = offset.checked_add(u64::from(len));
                assert!(matches!(end, Some(e) if e <= s.size), "{r:?} accepted");
                if matches!(r.cmd, CMD_READ | CMD_WRITE) {
                    assert!(len <= PAYLOAD_BYTES_MAX);
                }
            }
            Ok(_) => {}
            Err(refusal) => assert_ne!(refusal.errno, 0),
        }
    }

    proptest! {
        #![proptest_config(config(512, SEED))]

        #[test]
        fn client_flags_and_option_headers_take_any_bytes(
            f in any::<[u8; 4]>(),
            h in any::<[u8; OPTION_HEADER_LEN]>(),
            option in any::<u32>(),
            len in any::<u32>(),
        ) {
            if let Ok(c) = decode_client_flags(&f) {
                let back = (u32::from(c.fixed_newstyle) * FLAG_C_FIXED_NEWSTYLE)
                    | (u32::from(c.no_zeroes) * FLAG_C_NO_ZEROES);
                prop_assert_eq!(back.to_be_bytes(), f);
            }
            if let Ok(o) = decode_option_header(&h) {
                prop_assert_eq!(&h[0..8], &IHAVEOPT.to_be_bytes());
                prop_assert_eq!(&h[8..12], &o.option.to_be_bytes());
                prop_assert_eq!(&h[12..16], &o.len.to_be_bytes());
            }
            let mut valid = [0u8; OPTION_HEADER_LEN];
            valid[0..8].copy_from_slice(&IHAVEOPT.to_be_bytes());
            valid[8..12].copy_from_slice(&option.to_be_bytes());
            valid[12..16].copy_from_slice(&len.to_be_bytes());
            prop_assert_eq!(decode_option_header(&valid), Ok(OptionHeader { option, len }));
        }

        #[test]
        fn info_requests_take_arbitrary_bytes(d in proptest::collection::vec(any::<u8>(), 0..64)) {
            check_info(&d);
        }

        #[test]
        fn info_requests_round_trip_and_survive_mutation(
            name in proptest::collection::vec(any::<u8>(), 0..40),
            long in any::<bool>(),
            infos in proptest::collection::vec(any::<u16>(), 0..8),
            m in mutations(6),
        ) {
            // Sometimes at the name-length bound, where an off-by-one would show.
            let name = if long { vec![b'n'; STRING_BYTES_MAX] } else { name };
            let mut d = info_data(&name, &infos);
            prop_assert_eq!(decode_info_request(&d), Ok(InfoRequest { name, infos }));
            mutate(&mut d, &m);
            check_info(&d);
        }

        #[test]
        fn requests_round_trip_and_validate_safely(
            flags in any::<u16>(),
            cmd in prop_oneof![0u16..8, any::<u16>()],
            cookie in any::<u64>(),
            offset in prop_oneof![0u64..(2 << 20), any::<u64>()],
            len in prop_oneof![0u32..(2 << 20), any::<u32>()],
            s in session(),
            m in mutations(6),
        ) {
            let r = Request { flags, cmd, cookie, offset, len };
            let b = encode_request(&r);
            prop_assert_eq!(decode_request(&b), Ok(r));
            check_request(&b, &s);
            let mut v = b.to_vec();
            mutate(&mut v, &m);
            v.resize(REQUEST_LEN, 0);
            let mut mb = [0u8; REQUEST_LEN];
            mb.copy_from_slice(&v);
            check_request(&mb, &s);
        }
    }
}
