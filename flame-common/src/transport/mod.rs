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
//! Today there is one implementation, [`tcp`]. The OSD and the client only see
//! [`Conn`] and [`Listener`]; adding a transport means adding a variant here.

#[cfg(feature = "rdma")]
pub mod rdma;
pub mod tcp;

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
}

/// A connection of any transport.
#[derive(Clone)]
pub enum Conn {
    /// TCP.
    Tcp(Rc<tcp::TcpConn>),
}

impl Conn {
    /// Queues `msg` for sending, in order after every message queued before it.
    /// The payload (write data, read reply) is queued by reference: the send queue
    /// holds one more reference to its [`crate::buffer::PayloadBuf`], never a copy.
    pub fn send(&self, msg: &Message) -> Result<(), TransportError> {
        match self {
            Conn::Tcp(c) => c.send(msg),
        }
    }

    /// Like [`Conn::send`], but takes the message: its payload reference moves into
    /// the send queue.
    pub fn send_owned(&self, msg: Message) -> Result<(), TransportError> {
        match self {
            Conn::Tcp(c) => c.send_owned(msg),
        }
    }

    /// Queues raw bytes: only for answering a peer of another protocol version in
    /// its own format ([`crate::protocol::version_refusal`]).
    pub fn send_raw(&self, bytes: Vec<u8>) -> Result<(), TransportError> {
        match self {
            Conn::Tcp(c) => c.send_raw(bytes),
        }
    }

    /// Receives the next message. Only one task may receive on a connection.
    pub async fn recv(&self) -> Result<Message, TransportError> {
        match self {
            Conn::Tcp(c) => c.recv().await,
        }
    }

    /// Closes the connection: pending and future receives fail, queued sends are
    /// dropped.
    pub fn close(&self) {
        match self {
            Conn::Tcp(c) => c.close(),
        }
    }

    /// Closes the connection once every message queued so far has been sent — for
    /// a last answer (a refusal) that must reach the peer before the close.
    pub fn close_after_send(&self) {
        match self {
            Conn::Tcp(c) => c.close_after_send(),
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
        }
    }

    /// Whether the connection has failed or been closed.
    pub fn is_closed(&self) -> bool {
        match self {
            Conn::Tcp(c) => c.is_closed(),
        }
    }

    /// The peer's address, for logs.
    pub fn peer(&self) -> SocketAddr {
        match self {
            Conn::Tcp(c) => c.peer(),
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
        match kind {
            TransportKind::Tcp => Ok(Conn::Tcp(
                tcp::TcpConn::connect_from(addr, source, timeout).await?,
            )),
        }
    }
}

/// A listening endpoint.
pub enum Listener {
    /// TCP.
    Tcp(tcp::TcpListener),
}

impl Listener {
    /// Binds `addr`.
    pub fn bind(kind: TransportKind, addr: SocketAddr) -> Result<Listener, TransportError> {
        match kind {
            TransportKind::Tcp => Ok(Listener::Tcp(bind_retrying(|| {
                tcp::TcpListener::bind(addr)
            })?)),
        }
    }

    /// Accepts the next connection.
    pub async fn accept(&self) -> Result<Conn, TransportError> {
        match self {
            Listener::Tcp(l) => Ok(Conn::Tcp(l.accept().await?)),
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        match self {
            Listener::Tcp(l) => l.local_addr(),
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
    let deadline = std::time::Instant::now() + Duration::from_millis(BIND_RETRY_MS_MAX);
    loop {
        match bind() {
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(20));
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
