//! Threads, listeners and connections.
//!
//! Penetrating model: `threads` reactor threads, each with its own listening socket
//! bound to the same address with `SO_REUSEPORT`. The kernel spreads incoming
//! connections over the sockets, and each connection then lives on the thread that
//! accepted it — negotiation, requests, backend I/O and replies — until it closes.
//! Nothing on the data path crosses threads; the only shared state is the
//! connection count (an atomic, touched at accept and close).
//!
//! Two exports, each optional: the Unix socket (`unix:`; every thread accepts
//! on a duplicate of the one socket), whose peers are admitted by their uid
//! (`SO_PEERCRED`), and the TCP address (`listen:`), where a client is admitted
//! only by `STARTTLS` with a certificate from the cluster CA unless the
//! configuration serves it in clear by name ([`super::access`]).

use super::access::{Admission, Grant, UidGrant, unix_admission};
use super::backend::Exports;
use super::config::{NbdConfig, UnixExport};
use super::conn::{Conn, Reader};
use super::handshake::{self, HandshakeError, Outcome};
use super::metrics::OpMetrics;
use super::{shutdown, transmission};
use flame_common::reactor::{self, Reactor, ReactorConfig};
use flame_common::transport::bring_up::Source;
use socket2::{Domain, Protocol, SockRef, Socket, Type};
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
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
    /// One TCP listener per thread (empty without `listen:`).
    listeners: Vec<TcpListener>,
    /// The Unix socket export's listener (each thread accepts on a duplicate).
    unix: Option<UnixListener>,
    addr: Option<SocketAddr>,
    tls: Option<Arc<rustls::ServerConfig>>,
    conns: Arc<AtomicUsize>,
}

/// Why the server cannot start: its message names the setting.
fn setting_error(what: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("{what}: {e}"))
}

/// Creates the Unix socket export: a stale socket at its path (no one
/// listening) is replaced, anything else there is an error; the new socket
/// gets the configured mode and group.
fn unix_listener(u: &UnixExport) -> io::Result<UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let path = &u.path;
    let shown = path.display();
    match std::fs::symlink_metadata(path) {
        Ok(md) if md.file_type().is_socket() => {
            if UnixStream::connect(path).is_ok() {
                return Err(io::Error::new(
                    io::ErrorKind::AddrInUse,
                    format!("unix.path {shown}: another server is listening on it"),
                ));
            }
            std::fs::remove_file(path)
                .map_err(|e| setting_error(&format!("unix.path {shown} (stale)"), e))?;
        }
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("unix.path {shown} exists and is not a socket"),
            ));
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(setting_error(&format!("unix.path {shown}"), e)),
    }
    let listener =
        UnixListener::bind(path).map_err(|e| setting_error(&format!("unix.path {shown}"), e))?;
    let mode = u.mode_bits().map_err(|e| setting_error("unix.mode", e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .map_err(|e| setting_error(&format!("unix.mode of {shown}"), e))?;
    if let Some(gid) = u.gid {
        std::os::unix::fs::lchown(path, None, Some(gid))
            .map_err(|e| setting_error(&format!("unix.gid {gid} of {shown}"), e))?;
    }
    Ok(listener)
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
    /// Loads the TLS files, creates the Unix socket export and binds one
    /// `SO_REUSEPORT` socket per thread on `config.listen` (port 0 picks a
    /// free port, shared by all threads).
    pub fn bind(config: NbdConfig) -> io::Result<Server> {
        let threads = config.thread_count().max(1);
        let tls = match &config.tls {
            Some(t) => Some(
                flame_common::tls::client_auth_server_config(
                    &t.cert_file,
                    &t.key_file,
                    &t.client_ca_file,
                )
                .map_err(|e| setting_error("tls", e))?,
            ),
            None => None,
        };
        let mut listeners = Vec::new();
        let mut addr = None;
        if let Some(listen) = config.listen {
            let first = flame_common::transport::bind_retrying(|| reuseport_listener(listen))
                .map_err(|e| setting_error(&format!("listen {listen}"), e))?;
            let bound = first.local_addr()?;
            listeners.push(first);
            for _ in 1..threads {
                listeners.push(reuseport_listener(bound)?);
            }
            addr = Some(bound);
        }
        let unix = config.unix.as_ref().map(unix_listener).transpose()?;
        Ok(Server {
            config,
            listeners,
            unix,
            addr,
            tls,
            conns: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Open connections, across all threads (for draining at shutdown).
    pub fn connections(&self) -> Arc<AtomicUsize> {
        self.conns.clone()
    }

    /// The TCP export's address, if it has one.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.addr
    }

    /// Where clients connect, for logs and scripts: `unix:PATH` and
    /// `tcp:ADDR (tls)` / `tcp:ADDR (clear)`, comma-separated.
    pub fn endpoints(&self) -> String {
        let mut e = Vec::new();
        if let Some(u) = &self.config.unix {
            e.push(format!("unix:{}", u.path.display()));
        }
        if let Some(a) = self.addr {
            let mode = if self.tls.is_some() { "tls" } else { "clear" };
            e.push(format!("tcp:{a} ({mode})"));
        }
        e.join(", ")
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
        let threads = self.config.thread_count().max(1);
        let mut tcp = self.listeners.into_iter();
        let mut handles = Vec::new();
        for i in 0..threads {
            let make = make.clone();
            let pool = pool.clone();
            let conns = conns.clone();
            let config = self.config.clone();
            let listeners = ThreadListeners {
                tcp: tcp.next(),
                unix: self
                    .unix
                    .as_ref()
                    .map(UnixListener::try_clone)
                    .transpose()?,
            };
            let tls = self.tls.clone();
            let h = std::thread::Builder::new()
                .name(format!("nbd-{i}"))
                .spawn(move || {
                    // Payloads received from NBD clients and read replies from the
                    // OSDs come from this thread's registered pool.
                    pool.install()?;
                    thread_main(i, listeners, config, tls, conns, move |i| make(i))
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

/// The listening sockets one thread accepts on.
struct ThreadListeners {
    tcp: Option<TcpListener>,
    unix: Option<UnixListener>,
}

/// What the tasks of one thread share.
struct ThreadCtx {
    /// TLS on the TCP export (`None`: it is served in clear).
    tls: Option<Arc<rustls::ServerConfig>>,
    /// The Unix socket export's allowlist.
    unix_allow: Vec<UidGrant>,
    /// This process's uid (admitted on the Unix socket when the list is empty).
    own_uid: u32,
    metrics: Rc<OpMetrics>,
    conns: Arc<AtomicUsize>,
    max_connections: usize,
    handshake_timeout: Duration,
    stall_bounds: flame_common::transport::StallBounds,
}

fn thread_main<E: Exports>(
    index: usize,
    listeners: ThreadListeners,
    config: NbdConfig,
    tls: Option<Arc<rustls::ServerConfig>>,
    conns: Arc<AtomicUsize>,
    make_exports: impl FnOnce(usize) -> E,
) -> io::Result<()> {
    let mut r = Reactor::new(ReactorConfig {
        poll_mode: config.poll_mode,
        ..ReactorConfig::default()
    })?;
    let exports = Rc::new(make_exports(index));
    let ctx = Rc::new(ThreadCtx {
        tls,
        unix_allow: config
            .unix
            .as_ref()
            .map(|u| u.allow.clone())
            .unwrap_or_default(),
        // SAFETY: plain syscall.
        own_uid: unsafe { libc::geteuid() },
        metrics: Rc::new(OpMetrics::new()),
        conns,
        max_connections: config.max_connections,
        handshake_timeout: Duration::from_millis(config.handshake_timeout_ms),
        stall_bounds: config.stall_bounds(),
    });
    r.block_on(async move {
        reactor::spawn(async move {
            let mut m = crate::metrics::ReactorMetrics::new(index);
            loop {
                reactor::sleep(REACTOR_METRICS_INTERVAL).await;
                m.update(reactor::poll_stats());
            }
        })
        .detach();
        let tcp = listeners
            .tcp
            .map(|l| accept_loop(Listening::Tcp(l), exports.clone(), ctx.clone()));
        let unix = listeners
            .unix
            .map(|l| accept_loop(Listening::Unix(l), exports.clone(), ctx.clone()));
        match (tcp, unix) {
            (Some(t), Some(u)) => futures_lite::future::zip(t, u).await.0,
            (Some(t), None) => t.await,
            (None, Some(u)) => u.await,
            (None, None) => {}
        }
    })?;
    Ok(())
}

/// A listening socket of one thread.
enum Listening {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl Listening {
    fn fd(&self) -> i32 {
        match self {
            Listening::Tcp(l) => l.as_raw_fd(),
            Listening::Unix(l) => l.as_raw_fd(),
        }
    }
}

/// How often an NBD thread publishes its reactor's run-loop counters.
const REACTOR_METRICS_INTERVAL: Duration = Duration::from_secs(1);

async fn accept_loop<E: Exports>(listener: Listening, exports: Rc<E>, ctx: Rc<ThreadCtx>) {
    let lfd = listener.fd();
    let unix = matches!(listener, Listening::Unix(_));
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
                reactor::spawn(connection(fd, unix, exports.clone(), ctx.clone())).detach();
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

/// Who a new connection is and what it may do before negotiation: a Unix
/// peer by its uid, a TCP peer by the export's TLS rule.
fn admit(fd: OwnedFd, unix: bool, ctx: &ThreadCtx) -> (OwnedFd, Source, String, Admission) {
    if unix {
        let admission = match flame_common::transport::shm::peer_uid(&fd) {
            Ok(uid) => unix_admission(&ctx.unix_allow, uid, ctx.own_uid),
            Err(e) => Admission::Refused(format!("cannot tell the peer's uid: {e}")),
        };
        let who = match &admission {
            Admission::Granted(g) => g.who.clone(),
            _ => "unix peer".into(),
        };
        return (fd, Source::Local, who, admission);
    }
    let _ = SockRef::from(&fd).set_tcp_nodelay(true);
    let stream = TcpStream::from(fd);
    // A client whose host went away is noticed within about a minute.
    if let Err(e) = flame_common::transport::tcp::set_liveness(&stream) {
        tracing::debug!("cannot set keepalive on an NBD connection: {e}");
    }
    let (peer, source) = match stream.peer_addr() {
        Ok(a) => (a.to_string(), Source::Ip(a.ip())),
        Err(_) => ("?".into(), Source::Local),
    };
    let admission = if ctx.tls.is_some() {
        Admission::TlsRequired
    } else {
        Admission::Granted(Grant::everything(format!("tcp peer {peer}")))
    };
    (OwnedFd::from(stream), source, peer, admission)
}

async fn connection<E: Exports>(fd: OwnedFd, unix: bool, exports: Rc<E>, ctx: Rc<ThreadCtx>) {
    ctx.metrics.connections().inc();
    let _guard = ConnGuard { ctx: ctx.clone() };
    let (fd, source, peer, admission) = admit(fd, unix, &ctx);
    let conn = Conn::new(fd, source);
    let mut rd = Reader::new(conn.clone());
    let negotiation = handshake::negotiate(
        &conn,
        &mut rd,
        &*exports,
        admission,
        ctx.tls.as_ref().filter(|_| !unix),
    );
    let timeout = async {
        reactor::sleep(ctx.handshake_timeout).await;
        Err(HandshakeError::Timeout)
    };
    match futures_lite::future::or(negotiation, timeout).await {
        Ok(Outcome::Transmission {
            backend,
            structured,
            name,
            read_only,
            who,
        }) => {
            tracing::debug!(%peer, %who, export = %name, structured, read_only, "transmission");
            watch_stalls(&conn, ctx.stall_bounds, &peer);
            let res = transmission::serve(
                conn.clone(),
                rd,
                Rc::new(backend),
                structured,
                read_only,
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
    // A TLS alert or close_notify, and any last reply, get a moment to leave.
    conn.finish(FINISH_MAX).await;
}

/// How long a closing connection's last bytes (a TLS alert, `close_notify`)
/// may take to leave.
const FINISH_MAX: Duration = Duration::from_secs(1);
