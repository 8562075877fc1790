//! The transport layer: how Flame messages move between a client and an OSD, or
//! between two OSDs.
//!
//! The shape follows RDMA verbs so that RDMA and shared-memory transports slot in
//! without touching the OSD or the client: a connection is a queue pair on which
//! messages are *posted* (`send` never blocks: it queues, and the connection's own
//! writer drains the queue in order, batching many messages into one system call)
//! and *completed* (`recv` yields whole, validated messages). All of it runs on the
//! owning thread's [`crate::reactor`]; a connection is never touched by another
//! thread.
//!
//! Implementations: [`tcp`], [`shm`], and `rdma` with the cargo feature of that
//! name (an RDMA device is needed at run time; [`check_available`] says why not).
//! The OSD and the client only see [`Conn`] and [`Listener`]; adding a transport
//! means adding a variant here.

pub mod bring_up;
pub mod grant;
#[cfg(feature = "rdma")]
pub mod rdma;
pub mod receive;
pub mod receive_share;
pub mod send_queue;
pub mod shm;
pub mod sim;
pub mod stall;
pub mod stream_send;
pub mod tcp;

pub use crate::protocol::RemoteBuf;
pub use grant::{Grant, Refusal, SharedArea, WriteGrant};
pub use stall::{Stall, StallBounds, StallMarks};

use crate::buffer::{PayloadBuf, PayloadBufMut};
use crate::protocol::{Message, ProtocolError};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

/// Which transport a daemon uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TransportKind {
    /// TCP sockets through io_uring.
    #[default]
    Tcp,
    /// Shared memory with peers on the same host (memfd rings and regions, handshake
    /// over a Unix socket); TCP for a peer that cannot be reached that way.
    Shm,
    /// RDMA reliable connections (cargo feature `rdma`; needs an RDMA device or
    /// Soft-RoCE). Accepted in every build's configuration so that a build without
    /// the feature can say so instead of rejecting the word.
    Rdma,
    /// The deterministic simulator's network ([`sim`]): only on a thread where a
    /// simulated network is installed.
    Sim,
}

/// Why `kind` cannot be used by this process, or `Ok` when it can: a daemon calls
/// this before anything else so that `transport: rdma` without a device (or in a
/// build without RDMA support) stops it with one clear message.
pub fn check_available(kind: TransportKind) -> Result<(), String> {
    match kind {
        TransportKind::Tcp | TransportKind::Shm => Ok(()),
        TransportKind::Sim => sim::check_installed(),
        #[cfg(feature = "rdma")]
        TransportKind::Rdma => rdma::device::device().map(|_| ()),
        #[cfg(not(feature = "rdma"))]
        TransportKind::Rdma => Err(NO_RDMA_BUILD.to_string()),
    }
}

/// What a build without the `rdma` feature says when asked for RDMA.
#[cfg(not(feature = "rdma"))]
const NO_RDMA_BUILD: &str = "transport rdma: this build has no RDMA support (rebuild with \
                             `--features flame-osd/rdma,flame-client/rdma`)";

impl TransportKind {
    /// The configuration spelling.
    pub fn name(self) -> &'static str {
        match self {
            TransportKind::Tcp => "tcp",
            TransportKind::Shm => "shm",
            TransportKind::Rdma => "rdma",
            TransportKind::Sim => "sim",
        }
    }
}

/// Why a connection failed. Every variant ends the connection.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The peer closed the connection.
    #[error("connection closed by peer")]
    Closed,
    /// The peer sent bytes that are not a valid message.
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
    /// A socket operation failed.
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// Connecting took longer than allowed.
    #[error("connect to {0} timed out")]
    ConnectTimeout(SocketAddr),
    /// The send queue is over its bound: the peer is not reading.
    #[error("send queue over {0} bytes: peer is not reading")]
    Backlog(usize),
    /// A one-sided access was refused (by the grantor, or by this side's check of
    /// the grantor's table); the connection is closed.
    #[error("one-sided access refused: {0}")]
    Refused(&'static str),
    /// A grant could not be made (too large, or too many live); the connection
    /// stays up.
    #[error("grant refused: {0}")]
    Grant(String),
    /// The transport cannot be used here (no RDMA device, or a build without it).
    #[error("{0}")]
    Unavailable(String),
}

/// A connection of any transport.
#[derive(Clone)]
pub enum Conn {
    /// TCP.
    Tcp(Rc<tcp::TcpConn>),
    /// Shared memory (same host).
    Shm(Rc<shm::ShmConn>),
    /// RDMA.
    #[cfg(feature = "rdma")]
    Rdma(Rc<rdma::RdmaConn>),
    /// The simulator's network.
    Sim(Rc<sim::SimConn>),
}

impl Conn {
    /// Queues `msg` for sending, in order after every message queued before it.
    /// The payload (write data, read reply) is queued by reference: the send queue
    /// holds one more reference to its [`crate::buffer::PayloadBuf`], never a copy.
    pub fn send(&self, msg: &Message) -> Result<(), TransportError> {
        match self {
            Conn::Tcp(c) => c.send(msg),
            Conn::Shm(c) => c.send(msg),
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.send(msg),
            Conn::Sim(c) => c.send(msg),
        }
    }

    /// Like [`Conn::send`], but takes the message: its payload reference moves into
    /// the send queue.
    pub fn send_owned(&self, msg: Message) -> Result<(), TransportError> {
        match self {
            Conn::Tcp(c) => c.send_owned(msg),
            Conn::Shm(c) => c.send(&msg),
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.send_owned(msg),
            Conn::Sim(c) => c.send(&msg),
        }
    }

    /// Queues raw bytes: only for answering a peer of another protocol version in
    /// its own format ([`crate::protocol::version_refusal`]).
    pub fn send_raw(&self, bytes: Vec<u8>) -> Result<(), TransportError> {
        match self {
            Conn::Tcp(c) => c.send_raw(bytes),
            Conn::Shm(c) => c.send_raw(bytes),
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.send_raw(bytes),
            Conn::Sim(c) => c.send_raw(bytes),
        }
    }

    /// Receives the next message. Only one task may receive on a connection.
    pub async fn recv(&self) -> Result<Message, TransportError> {
        match self {
            Conn::Tcp(c) => c.recv().await,
            Conn::Shm(c) => c.recv().await,
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.recv().await,
            Conn::Sim(c) => c.recv().await,
        }
    }

    /// Closes the connection: pending and future receives fail, queued sends are
    /// dropped.
    pub fn close(&self) {
        match self {
            Conn::Tcp(c) => c.close(),
            Conn::Shm(c) => c.close(),
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.close(),
            Conn::Sim(c) => c.close(),
        }
    }

    /// Closes the connection once every message queued so far has been sent — for
    /// a last answer (a refusal) that must reach the peer before the close.
    pub fn close_after_send(&self) {
        match self {
            Conn::Tcp(c) => c.close_after_send(),
            Conn::Shm(c) => c.close_after_send(),
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.close_after_send(),
            Conn::Sim(c) => c.close_after_send(),
        }
    }

    /// With `on`, a payload received while the thread's memory pool is exhausted
    /// goes to heap memory (counted in `flame_pool_heap_fallbacks_total`) instead of
    /// waiting for frees. For OSD-to-OSD connections only: their requests and
    /// replies are what frees the primaries' buffers, so waiting on them could
    /// deadlock two OSDs whose pools are full of writes waiting for each other;
    /// their volume is bounded by the sending primaries' in-flight bounds.
    pub fn set_never_wait_for_memory(&self, on: bool) {
        match self {
            Conn::Tcp(c) => c.set_never_wait_for_memory(on),
            Conn::Shm(c) => c.set_never_wait_for_memory(on),
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.set_never_wait_for_memory(on),
            Conn::Sim(_) => {}
        }
    }

    /// What this connection is waiting on, if anything, with a progress mark: a
    /// payload whose header arrived but whose bytes have not all come
    /// ([`Stall::Receive`]; the mark counts completed slow payloads), or a batch
    /// of sends the peer does not take ([`Stall::Send`]; the mark counts written
    /// batches), or nothing ([`Stall::Idle`]; the mark counts frames received
    /// and batches sent). The owner's watchdog closes a connection whose answer
    /// stays the same longer than its bound, so a trickling or never-reading
    /// peer cannot hold pool memory and a slot forever; the data path reads no
    /// clock for it. tcp, rdma and shm are watched (over shm a message is
    /// always whole in the ring, so it never shows a receive stall; its
    /// backlog waits on room in the peer's ring); the simulator's links say
    /// `None`.
    pub fn stall(&self) -> Option<(Stall, u64)> {
        match self {
            Conn::Tcp(c) => c.stall(),
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => Some(c.stall()),
            Conn::Shm(c) => Some(c.stall()),
            Conn::Sim(_) => None,
        }
    }

    /// Bytes queued for sending and not yet handed to the link (the
    /// simulator's links: none, a send is on the wire at once).
    pub fn send_queued_bytes(&self) -> usize {
        match self {
            Conn::Tcp(c) => c.send_queued_bytes(),
            Conn::Shm(c) => c.send_queued_bytes(),
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.send_queued_bytes(),
            Conn::Sim(_) => 0,
        }
    }

    /// Waits until at most `bytes_max` bytes wait in the send queue (or the
    /// connection is closed): a server reads no more requests from a peer
    /// that does not take its answers.
    pub async fn wait_sent_below(&self, bytes_max: usize) {
        match self {
            Conn::Tcp(c) => c.wait_sent_below(bytes_max).await,
            Conn::Shm(c) => c.wait_sent_below(bytes_max).await,
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.wait_sent_below(bytes_max).await,
            Conn::Sim(_) => {}
        }
    }

    /// Whether the connection has failed or been closed.
    pub fn is_closed(&self) -> bool {
        match self {
            Conn::Tcp(c) => c.is_closed(),
            Conn::Shm(c) => c.is_closed(),
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.is_closed(),
            Conn::Sim(c) => c.is_closed(),
        }
    }

    /// The peer's address, for logs.
    pub fn peer(&self) -> SocketAddr {
        match self {
            Conn::Tcp(c) => c.peer(),
            Conn::Shm(c) => c.peer(),
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.peer(),
            Conn::Sim(c) => c.peer(),
        }
    }

    /// Whether one-sided READ/WRITE are done by the initiator without the peer's CPU
    /// (shm, rdma), or emulated by the peer's connection thread (tcp: a request
    /// frame and a reply, served while the peer's task receives on the connection).
    pub fn one_sided_native(&self) -> bool {
        match self {
            Conn::Tcp(_) => false,
            Conn::Shm(_) => true,
            #[cfg(feature = "rdma")]
            Conn::Rdma(_) => true,
            Conn::Sim(_) => false,
        }
    }

    /// The transport this connection actually uses (a `shm` connect falls back to
    /// tcp when the peer is not reachable through shared memory).
    pub fn kind(&self) -> TransportKind {
        match self {
            Conn::Tcp(_) => TransportKind::Tcp,
            Conn::Shm(_) => TransportKind::Shm,
            #[cfg(feature = "rdma")]
            Conn::Rdma(_) => TransportKind::Rdma,
            Conn::Sim(_) => TransportKind::Sim,
        }
    }

    /// Lets the peer READ `buf` (1..=[`crate::protocol::PAYLOAD_BYTES_MAX`] bytes)
    /// until the returned grant is dropped; send [`Grant::remote`] to it. A client
    /// write in convert mode: the OSD pulls the payload.
    pub fn grant_read(&self, buf: &PayloadBuf) -> Result<Grant, TransportError> {
        match self {
            Conn::Tcp(c) => c.grant_read(buf),
            Conn::Shm(c) => c.grant_read(buf),
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.grant_read(buf),
            Conn::Sim(_) => Err(sim::no_one_sided()),
        }
    }

    /// Lets the peer WRITE into `buf` until [`WriteGrant::finish`] takes it back
    /// with the bytes written. A client read in convert mode: the OSD pushes the
    /// data.
    pub fn grant_write(&self, buf: PayloadBufMut) -> Result<WriteGrant, TransportError> {
        match self {
            Conn::Tcp(c) => c.grant_write(buf),
            Conn::Shm(c) => c.grant_write(buf),
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.grant_write(buf),
            Conn::Sim(_) => Err(sim::no_one_sided()),
        }
    }

    /// Lets the peer READ `len` bytes (1..=[`crate::protocol::PAYLOAD_BYTES_MAX`])
    /// that this side keeps writing, for as long as the returned area lives: the
    /// reply area of remote fetching.
    pub fn grant_area(&self, len: usize) -> Result<SharedArea, TransportError> {
        match self {
            Conn::Tcp(c) => c.grant_area(len),
            Conn::Shm(c) => c.grant_area(len),
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.grant_area(len),
            Conn::Sim(_) => Err(sim::no_one_sided()),
        }
    }

    /// One-sided READ of `remote.len` bytes at `remote.addr` of a buffer the peer
    /// granted (the whole grant, or a part of it under the same key) into fresh
    /// local memory. A refusal closes the connection.
    pub async fn read_remote(&self, remote: RemoteBuf) -> Result<PayloadBufMut, TransportError> {
        match self {
            Conn::Tcp(c) => c.read_remote(remote).await,
            Conn::Shm(c) => c.read_remote(remote),
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.read_remote(remote).await,
            Conn::Sim(_) => Err(sim::no_one_sided()),
        }
    }

    /// One-sided WRITE of `data` at `offset` into the peer's granted buffer
    /// `remote` (`offset + data.len() <= remote.len`). A refusal closes the
    /// connection.
    pub async fn write_remote(
        &self,
        remote: RemoteBuf,
        offset: u32,
        data: &PayloadBuf,
    ) -> Result<(), TransportError> {
        let addr = remote_range(remote, offset, data.len())?;
        match self {
            Conn::Tcp(c) => c.write_remote(remote.key, addr, data).await,
            Conn::Shm(c) => c.write_remote(remote.key, addr, data),
            #[cfg(feature = "rdma")]
            Conn::Rdma(c) => c.write_remote(remote.key, addr, data).await,
            Conn::Sim(_) => Err(sim::no_one_sided()),
        }
    }

    /// Connects to `addr` with `kind`, giving up after `timeout`.
    pub async fn connect(
        kind: TransportKind,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<Conn, TransportError> {
        Self::connect_from(kind, addr, None, timeout).await
    }

    /// Like [`Conn::connect`], leaving from local address `source` when given (a
    /// daemon's own advertised address, or a client's `bind_addr`).
    pub async fn connect_from(
        kind: TransportKind,
        addr: SocketAddr,
        source: Option<std::net::IpAddr>,
        timeout: Duration,
    ) -> Result<Conn, TransportError> {
        if kind == TransportKind::Sim {
            return Ok(Conn::Sim(sim::SimConn::connect(addr, timeout).await?));
        }
        if kind == TransportKind::Rdma {
            #[cfg(feature = "rdma")]
            return Ok(Conn::Rdma(
                rdma::RdmaConn::connect_from(addr, source, timeout).await?,
            ));
            #[cfg(not(feature = "rdma"))]
            return Err(TransportError::Unavailable(NO_RDMA_BUILD.to_string()));
        }
        if kind == TransportKind::Shm
            && let Some(c) = shm::ShmConn::connect(addr).await?
        {
            return Ok(Conn::Shm(c));
        }
        // tcp, or shm to a peer not reachable through shared memory.
        Ok(Conn::Tcp(
            tcp::TcpConn::connect_from(addr, source, timeout).await?,
        ))
    }
}

/// The peer address a WRITE of `len` bytes at `offset` of `remote` goes to, after
/// checking it stays inside `remote` (a caller bug, reported without closing).
fn remote_range(remote: RemoteBuf, offset: u32, len: usize) -> Result<u64, TransportError> {
    let end = u64::from(offset) + len as u64;
    if len == 0 || end > u64::from(remote.len) {
        return Err(TransportError::Grant(format!(
            "write of {len} bytes at offset {offset} does not fit a {}-byte remote buffer",
            remote.len
        )));
    }
    remote
        .addr
        .checked_add(u64::from(offset))
        .ok_or_else(|| TransportError::Grant("remote address overflows".into()))
}

/// A listening endpoint.
pub enum Listener {
    /// TCP.
    Tcp(tcp::TcpListener),
    /// TCP plus the shm Unix socket of the same address.
    Shm(shm::ShmListener),
    /// RDMA (a TCP listener for the bootstrap exchange), and TCP on the same port.
    #[cfg(feature = "rdma")]
    Rdma(rdma::RdmaListener),
    /// The simulator's network.
    Sim(sim::SimListener),
}

impl Listener {
    /// Binds `addr`.
    pub fn bind(kind: TransportKind, addr: SocketAddr) -> Result<Listener, TransportError> {
        match kind {
            TransportKind::Tcp => Ok(Listener::Tcp(bind_retrying(|| {
                tcp::TcpListener::bind(addr)
            })?)),
            TransportKind::Shm => Ok(Listener::Shm(bind_retrying(|| {
                shm::ShmListener::bind(addr)
            })?)),
            #[cfg(feature = "rdma")]
            TransportKind::Rdma => Ok(Listener::Rdma(rdma::RdmaListener::bind(addr)?)),
            #[cfg(not(feature = "rdma"))]
            TransportKind::Rdma => Err(TransportError::Unavailable(NO_RDMA_BUILD.to_string())),
            TransportKind::Sim => Ok(Listener::Sim(sim::SimListener::bind(addr)?)),
        }
    }

    /// Accepts the next connection.
    pub async fn accept(&self) -> Result<Conn, TransportError> {
        match self {
            Listener::Tcp(l) => Ok(Conn::Tcp(l.accept().await?)),
            Listener::Shm(l) => l.accept().await,
            #[cfg(feature = "rdma")]
            Listener::Rdma(l) => l.accept().await,
            Listener::Sim(l) => Ok(Conn::Sim(l.accept().await?)),
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        match self {
            Listener::Tcp(l) => l.local_addr(),
            Listener::Shm(l) => l.local_addr(),
            #[cfg(feature = "rdma")]
            Listener::Rdma(l) => l.local_addr(),
            Listener::Sim(l) => l.local_addr(),
        }
    }
}

/// How long a daemon keeps retrying a bind that fails with "address in use".
///
/// A daemon killed with `kill -9` holds its listening ports for a few milliseconds
/// after it dies (the kernel tears its io_uring down in the background), so a
/// supervisor's immediate restart would otherwise fail.
pub const BIND_RETRY_MS_MAX: u64 = 3000;

/// Runs `bind` until it succeeds, fails with something other than `AddrInUse`, or
/// [`BIND_RETRY_MS_MAX`] passes.
pub fn bind_retrying<T>(mut bind: impl FnMut() -> std::io::Result<T>) -> std::io::Result<T> {
    let deadline = crate::clock::now() + Duration::from_millis(BIND_RETRY_MS_MAX);
    loop {
        match bind() {
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse && crate::clock::now() < deadline =>
            {
                crate::clock::sleep_blocking(Duration::from_millis(20));
            }
            other => return other,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bind_retry_waits_for_a_port_to_free_up() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = held.local_addr().unwrap();
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            drop(held);
        });
        let l = bind_retrying(|| std::net::TcpListener::bind(addr)).unwrap();
        assert_eq!(l.local_addr().unwrap(), addr);
        releaser.join().unwrap();
        // Other errors are returned at once.
        let bad: std::io::Result<()> = bind_retrying(|| Err(std::io::Error::other("boom")));
        assert!(bad.is_err());
    }
}
