//! What the NBD server serves: a [`Backend`] per open export, found through
//! [`Exports`].
//!
//! The server knows nothing about Flame: it is generic over these two traits, so the
//! protocol code is tested against the in-memory backend ([`super::memory`]) and
//! served in production by the Flame volume backend. Futures are `!Send` on purpose:
//! each NBD connection lives on one reactor thread from accept to close, and a
//! backend runs its I/O on that same thread (penetrating model, no hand-off).

use flame_common::buffer::PayloadBuf;

/// A positive errno (`libc::EIO`, …). The server maps it to one the NBD protocol
/// allows (see [`super::proto::wire_errno`]).
pub type Errno = i32;

/// One open export (a volume), used by one connection.
///
/// # Multi-connection contract
///
/// The server advertises `NBD_FLAG_CAN_MULTI_CONN`, which promises that when a FLUSH
/// (or a FUA command) is answered on one connection, every write *answered* on any
/// connection to the same export is durable and visible to reads on every
/// connection. Implementations must therefore keep no per-connection write cache:
/// `write` must reach the shared store (the cluster, or the shared memory map)
/// before it returns, and `flush` must cover every completed write of the export,
/// whichever connection or thread issued it.
#[allow(async_fn_in_trait)] // futures are reactor-local (!Send) by design.
pub trait Backend {
    /// Export size in bytes.
    fn size(&self) -> u64;

    /// Whether writes are refused (`EPERM`, and `NBD_FLAG_READ_ONLY` advertised).
    fn read_only(&self) -> bool {
        false
    }

    /// Reads `len` bytes at `offset` (the server checked the range). Returns the
    /// bytes as one or more buffers, in order, whose lengths add up to exactly `len`:
    /// the server sends them to the client as they are (no gathering copy), so a
    /// backend returns the buffers its data arrived in.
    async fn read(&self, offset: u64, len: u32) -> Result<Vec<PayloadBuf>, Errno>;

    /// Writes `data` at `offset`. With `fua` the data is durable when this returns.
    /// `data` is the buffer the request's payload was received into from the NBD
    /// socket; a backend that forwards it (Flame) sends that memory on.
    async fn write(&self, offset: u64, data: PayloadBuf, fua: bool) -> Result<(), Errno>;

    /// Makes every write completed so far (on any connection) durable.
    async fn flush(&self) -> Result<(), Errno>;

    /// Discards a range (contents afterwards are unspecified; zeroes are fine).
    async fn trim(&self, offset: u64, len: u32, fua: bool) -> Result<(), Errno>;

    /// Zeroes a range: later reads must return zeroes.
    async fn write_zeroes(&self, offset: u64, len: u32, fua: bool) -> Result<(), Errno>;
}

/// Why an export could not be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// No export has this name (`NBD_REP_ERR_UNKNOWN`; hard disconnect after
    /// `EXPORT_NAME`).
    #[error("unknown export")]
    Unknown,
    /// The export exists but could not be opened (cluster unreachable, …).
    #[error("cannot open export: {0}")]
    Other(String),
}

/// The set of exports a server thread can open. One instance per reactor thread
/// (created by the factory given to [`super::server::Server::run`]), so an
/// implementation may keep reactor-local state (connections to OSDs, open volumes).
#[allow(async_fn_in_trait)] // futures are reactor-local (!Send) by design.
pub trait Exports: 'static {
    /// The backend of an open export.
    type B: Backend + 'static;

    /// Names for `NBD_OPT_LIST`.
    async fn list(&self) -> Result<Vec<String>, OpenError>;

    /// Opens export `name` (`""` is the default export, if the implementation has
    /// one).
    async fn open(&self, name: &str) -> Result<Self::B, OpenError>;

    /// Text for `NBD_INFO_DESCRIPTION`.
    fn description(&self, _name: &str) -> String {
        String::new()
    }
}
