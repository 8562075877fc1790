//! Threads, listeners and connections.
//!
//! Penetrating model: `threads` reactor threads, each with its own listening socket
//! bound to the same address with `SO_REUSEPORT`. The kernel spreads incoming
//! connections over the sockets, and each connection then lives on the thread that
//! accepted it — negotiation, requests, backend I/O and replies — until it closes.
//! Nothing on the data path crosses threads; the only shared state is the
//! connection count (an atomic, touched at accept and close).

use super::backend::Exports;
use super::config::NbdConfig;
use super::conn::{Conn, Reader};
use super::handshake::{self, HandshakeError, Outcome};
use super::metrics::OpMetrics;
use super::{shutdown, transmission};
use flame_common::reactor::{self, Reactor, ReactorConfig};
use socket2::{Domain, Protocol, SockRef, Socket, Type};
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// Pending connections the kernel queues per listening socket.
const LISTEN_BACKLOG: i32 = 1024;
/// Pause after a failed accept (e.g. out of descriptors) so the loop does not spin.
const ACCEPT_RETRY_MS: u64 = 10;

/// A bound, not yet running NBD server: every thread's listening socket is open, so
/// clients can connect as soon as [`Server::bind`] returns.
pub struct Server {
    config: NbdConfig,
    listeners: Vec<TcpListener>,
    addr: SocketAddr,
    conns: Arc<AtomicUsize>,
}

fn reuseport_listener(addr: SocketAddr) -> io::Result<TcpListener> {
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    sock.set_reuse_address(true)?;
    sock.set_reuse_port(true)?;
    sock.bind(&addr.into())?;
    sock.listen(LISTEN_BACKLOG)?;
    Ok(sock.into())
}

impl Server {
    /// Binds one `SO_REUSEPORT` socket per thread on `config.listen` (port 0 picks a
    /// free port, shared by all threads).
    pub fn bind(config: NbdConfig) -> io::Result<Server> {
        let threads = config.thread_count().max(1);
        let first = flame_common::transport::bind_retrying(|| reuseport_listener(config.listen))?;
        let addr = first.local_addr()?;
        let mut listeners = vec![first];
        for _ in 1..threads {
            listeners.push(reuseport_listener(addr)?);
        }
        Ok(Server {
            config,
            listeners,
            addr,
            conns: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Open connections, across all threads (for draining at shutdown).
    pub fn connections(&self) -> Arc<AtomicUsize> {
        self.conns.clone()
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Runs every thread; returns only if one fails. `make_exports(i)` is called on
    /// thread `i` to create that thread's (reactor-local) exports.
    pub fn run<E, F>(self, make_exports: F) -> io::Result<()>
    where
        E: Exports,
        F: Fn(usize) -> E + Send + Sync + 'static,
    {
        let make = Arc::new(make_exports);
        let conns = self.conns.clone();
        let pool = Arc::new(flame_common::buffer::registered::PoolInstaller::new(
            &self.config.memory_pool,
            self.listeners.len(),
        )?);
        let mut handles = Vec::new();
        for (i, l) in self.listeners.into_iter().enumerate() {
            let make = make.clone();
            let pool = pool.clone();
            let conns = conns.clone();
            let config = self.config.clone();
            let h = std::thread::Builder::new()
                .name(format!("nbd-{i}"))
                .spawn(move || {
                    // Payloads received from NBD clients and read replies from the
                    // OSDs come from this thread's registered pool.
                    pool.install()?;
                    thread_main(i, l, config, conns, move |i| make(i))
                })?;
            handles.push(h);
        }
        let mut result = Ok(());
        for h in handles {
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::error!("NBD thread failed: {e}");
                    result = Err(e);
                }
                Err(_) => result = Err(io::Error::other("NBD thread panicked")),
            }
        }
        result
    }
}

/// What the tasks of one thread share.
struct ThreadCtx {
    metrics: Rc<OpMetrics>,
    conns: Arc<AtomicUsize>,
    max_connections: usize,
    handshake_timeout: Duration,
    stall_bounds: flame_common::transport::StallBounds,
}

fn thread_main<E: Exports>(
    index: usize,
    listener: TcpListener,
    config: NbdConfig,
    conns: Arc<AtomicUsize>,
    make_exports: impl FnOnce(usize) -> E,
) -> io::Result<()> {
    let mut r = Reactor::new(ReactorConfig {
        poll_mode: config.poll_mode,
        ..ReactorConfig::default()
    })?;
    let exports = Rc::new(make_exports(index));
    let ctx = Rc::new(ThreadCtx {
        metrics: Rc::new(OpMetrics::new()),
        conns,
        max_connections: config.max_connections,
        handshake_timeout: Duration::from_millis(config.handshake_timeout_ms),
        stall_bounds: config.stall_bounds(),
    });
    r.block_on(accept_loop(index, listener, exports, ctx))?;
    Ok(())
}

/// How often an NBD thread publishes its reactor's run-loop counters.
const REACTOR_METRICS_INTERVAL: Duration = Duration::from_secs(1);

async fn accept_loop<E: Exports>(
    index: usize,
    listener: TcpListener,
    exports: Rc<E>,
    ctx: Rc<ThreadCtx>,
) {
    reactor::spawn(async move {
        let mut m = crate::metrics::ReactorMetrics::new(index);
        loop {
            reactor::sleep(REACTOR_METRICS_INTERVAL).await;
            m.update(reactor::poll_stats());
        }
    })
    .detach();
    let lfd = listener.as_raw_fd();
    loop {
        match reactor::accept(lfd).await {
            Ok(fd) if shutdown::shutting_down() => drop(fd),
            Ok(fd) => {
                let before = ctx.conns.fetch_add(1, Ordering::AcqRel);
                if before >= ctx.max_connections {
                    ctx.conns.fetch_sub(1, Ordering::AcqRel);
                    tracing::warn!(
                        max = ctx.max_connections,
                        "connection refused: max_connections reached"
                    );
                    drop(fd);
                    continue;
                }
                reactor::spawn(connection(fd, exports.clone(), ctx.clone())).detach();
            }
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                reactor::sleep(Duration::from_millis(ACCEPT_RETRY_MS)).await;
            }
        }
    }
}

/// Watches a connection in transmission until it closes: one that stays stuck on
/// a WRITE's payload or on its replies past its bound (a trickling or
/// never-reading client, holding pool memory) is closed, logged and counted.
/// Negotiation has its own deadline (`handshake_timeout_ms`).
fn watch_stalls(conn: &Rc<Conn>, bounds: flame_common::transport::StallBounds, peer: &str) {
    let (sampled, watched, stuck) = (conn.clone(), conn.clone(), conn.clone());
    let peer = peer.to_string();
    flame_common::transport::stall::watch(
        bounds,
        move || sampled.stall(),
        move || watched.is_closed(),
        move |stall, took| {
            let bound = bounds.of(stall).unwrap_or_default();
            tracing::warn!(%peer, "closing an NBD connection stuck for {took:?} ({}, bound {bound:?})", stall.label());
            super::metrics::stalled_connection_closed(stall.label());
            stuck.close();
        },
    );
}

/// Decrements the connection count and gauge however the connection ends.
struct ConnGuard {
    ctx: Rc<ThreadCtx>,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.ctx.conns.fetch_sub(1, Ordering::AcqRel);
        self.ctx.metrics.connections().dec();
    }
}

async fn connection<E: Exports>(fd: OwnedFd, exports: Rc<E>, ctx: Rc<ThreadCtx>) {
    ctx.metrics.connections().inc();
    let _guard = ConnGuard { ctx: ctx.clone() };
    let _ = SockRef::from(&fd).set_tcp_nodelay(true);
    let stream = TcpStream::from(fd);
    // A client whose host went away is noticed within about a minute.
    if let Err(e) = flame_common::transport::tcp::set_liveness(&stream) {
        tracing::debug!("cannot set keepalive on an NBD connection: {e}");
    }
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    let conn = Conn::new(stream);
    let mut rd = Reader::new(conn.clone());
    let negotiation = handshake::negotiate(&conn, &mut rd, &*exports);
    let timeout = async {
        reactor::sleep(ctx.handshake_timeout).await;
        Err(HandshakeError::Timeout)
    };
    match futures_lite::future::or(negotiation, timeout).await {
        Ok(Outcome::Transmission {
            backend,
            structured,
            name,
        }) => {
            tracing::debug!(%peer, export = %name, structured, "transmission");
            watch_stalls(&conn, ctx.stall_bounds, &peer);
            let res = transmission::serve(
                conn.clone(),
                rd,
                Rc::new(backend),
                structured,
                ctx.metrics.clone(),
            )
            .await;
            match res {
                Ok(()) => tracing::debug!(%peer, "client disconnected"),
                Err(e) => tracing::debug!(%peer, "connection ended: {e}"),
            }
        }
        Ok(Outcome::Aborted) => tracing::debug!(%peer, "client aborted negotiation"),
        Err(e @ HandshakeError::Io(_)) => tracing::debug!(%peer, "negotiation ended: {e}"),
        Err(e) => tracing::info!(%peer, "negotiation failed: {e}"),
    }
    conn.close();
}
