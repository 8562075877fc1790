//! The manager's HTTP server: the API router under hyper, with what
//! `axum::serve` does not bound — how long a client may take to send a
//! request's headers (a slowloris flood of half-sent requests would otherwise
//! hold connections, memory and file descriptors forever), and how many
//! connections are open at once (beyond the cap, new connections wait in the
//! listen backlog instead of exhausting descriptors), and how many of them
//! one address may hold (beyond, closed at once); with `tls:`, every
//! connection is a TLS one (rustls), its handshake bounded like the headers.
//! HTTP/1.1 only (every Flame client and Prometheus speak it): no protocol
//! sniffing, which waits for a first byte without a timer, and no HTTP/2
//! connection, which hyper keeps open without one. A connection with no
//! request in service and no byte moving for `idle_timeout_ms` is closed, so
//! a peer that connects and sends nothing, or stops between requests, holds
//! its slot no longer than that.
//! Requests are bounded
//! further in [`crate::api`] (body sizes) and [`crate::shared`] (heartbeats
//! ahead of everything an API client can flood).

use axum::Router;
use flame_common::collections::HashMap;
use flame_common::transport::bring_up::Source;
use flame_common::transport::receive_share::share_key;
use hyper::server::conn::http1::Builder;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};
use tower::ServiceExt;
use tracing::{info, warn};

/// What one manager's server allows.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Open connections at most (`connections_max`).
    pub connections_max: usize,
    /// Open connections from one address at most
    /// (`connections_per_source_max`).
    pub connections_per_source_max: usize,
    /// How long a client may take to send a request's headers
    /// (`header_read_timeout_ms`).
    pub header_read_timeout: Duration,
    /// How long a connection may sit with no request in service and no byte
    /// moving before it is closed (`idle_timeout_ms`).
    pub idle_timeout: Duration,
    /// After a stop is asked for, how long open requests may still run.
    pub shutdown_wait: Duration,
}

/// What a connection's idle watch sees: when a byte last moved and how many
/// requests are in service.
struct Activity {
    /// When the connection began.
    start: tokio::time::Instant,
    /// Milliseconds from `start` to the last byte moved.
    last_ms: AtomicU64,
    requests: AtomicUsize,
}

impl Activity {
    fn new() -> Arc<Activity> {
        Arc::new(Activity {
            start: tokio::time::Instant::now(),
            last_ms: AtomicU64::new(0),
            requests: AtomicUsize::new(0),
        })
    }

    fn elapsed_ms(&self) -> u64 {
        self.start.elapsed().as_millis() as u64
    }

    fn touch(&self) {
        self.last_ms.store(self.elapsed_ms(), Ordering::Relaxed);
    }

    /// Returns once the connection has been idle for `idle`: no request in
    /// service and no byte moved. Wakes at most every `idle / 4`.
    async fn idle_for(&self, idle: Duration) {
        let idle_ms = idle.as_millis() as u64;
        loop {
            tokio::time::sleep(idle / 4).await;
            let quiet_ms = self
                .elapsed_ms()
                .saturating_sub(self.last_ms.load(Ordering::Relaxed));
            if self.requests.load(Ordering::Acquire) == 0 && quiet_ms >= idle_ms {
                return;
            }
        }
    }
}

/// A connection's stream that marks every byte it moves in its [`Activity`].
struct Watched<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Counts a request in service for as long as it lives.
struct InService(Arc<Activity>);

impl InService {
    fn start(a: &Arc<Activity>) -> InService {
        a.requests.fetch_add(1, Ordering::AcqRel);
        InService(Arc::clone(a))
    }
}

impl Drop for InService {
    fn drop(&mut self) {
        self.0.requests.fetch_sub(1, Ordering::AcqRel);
        self.0.touch();
    }
}

/// Open connections per source address (an IPv6 host by its /64).
#[derive(Default)]
struct PerSource(std::sync::Mutex<HashMap<Source, usize>>);

/// One connection's place in [`PerSource`]; given back on drop.
struct SourceSlot {
    table: Arc<PerSource>,
    source: Source,
}

impl PerSource {
    /// A place for a connection from `ip`, unless it holds `max` already.
    fn take(table: &Arc<PerSource>, ip: IpAddr, max: usize) -> Option<SourceSlot> {
        let source = share_key(Source::Ip(ip));
        let mut t = table.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = t.entry(source).or_insert(0);
        if *n >= max {
            return None;
        }
        *n += 1;
        Some(SourceSlot {
            table: Arc::clone(table),
            source,
        })
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut t = self.table.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = t.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                t.remove(&self.source);
            }
        }
    }
}

/// Serves `router` on `listener` until `stop` turns true, then lets open
/// requests finish for at most `limits.shutdown_wait`.
pub async fn run(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    tls: Option<Arc<rustls::ServerConfig>>,
    mut stop: watch::Receiver<bool>,
) {
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    crate::metrics::register_statics();
    let slots = Arc::new(Semaphore::new(limits.connections_max));
    let per_source = Arc::new(PerSource::default());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut builder = Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let builder = Arc::new(builder);
    let mut full_logged = false;
    loop {
        // A slot first: at the cap, stop accepting (the kernel's backlog holds
        // the rest) rather than take connections that cannot be served.
        if slots.available_permits() == 0 && !full_logged {
            warn!(
                connections_max = limits.connections_max,
                "connection cap reached; new connections wait until one closes"
            );
            full_logged = true;
        }
        let permit = tokio::select! {
            p = Arc::clone(&slots).acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
            _ = stop.wait_for(|s| *s) => break,
        };
        let (stream, peer) = tokio::select! {
            r = listener.accept() => match r {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and the like: say so, back off a little, go on.
                    warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.wait_for(|s| *s) => break,
        };
        full_logged = false;
        let Some(source_slot) =
            PerSource::take(&per_source, peer.ip(), limits.connections_per_source_max)
        else {
            // Closed unserved: this address holds its share of the slots.
            crate::metrics::connection_refused();
            tracing::debug!(%peer, "connection refused: connections_per_source_max reached");
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let activity = Activity::new();
        let in_service = Arc::clone(&activity);
        let service =
            hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let guard = InService::start(&in_service);
                let call = router.clone().oneshot(req.map(axum::body::Body::new));
                async move {
                    let r = call.await;
                    drop(guard);
                    r
                }
            });
        let stream = Watched {
            inner: stream,
            activity: Arc::clone(&activity),
        };
        let idle = limits.idle_timeout;
        match &acceptor {
            None => {
                let conn = builder.serve_connection(TokioIo::new(stream), service);
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    // Errors are the client's (a reset, a header timeout).
                    tokio::select! {
                        _ = conn => {}
                        _ = activity.idle_for(idle) => crate::metrics::idle_connection_closed(),
                    }
                    drop((permit, source_slot));
                });
            }
            Some(acceptor) => {
                // The handshake in the connection's own task, within the header
                // timeout: a client that connects and sends nothing holds its
                // slot no longer than one that sends half a request.
                let handshake = acceptor.accept(stream);
                let (builder, watcher) = (Arc::clone(&builder), graceful.watcher());
                let bound = limits.header_read_timeout;
                tokio::spawn(async move {
                    let _slots = (permit, source_slot);
                    let stream = match tokio::time::timeout(bound, handshake).await {
                        Ok(Ok(s)) => s,
                        // Not TLS, a wrong CA on the client's side, too slow.
                        Ok(Err(e)) => {
                            tracing::debug!("TLS handshake failed: {e}");
                            return;
                        }
                        Err(_) => return,
                    };
                    let conn = builder.serve_connection(TokioIo::new(stream), service);
                    tokio::select! {
                        _ = watcher.watch(conn) => {}
                        _ = activity.idle_for(idle) => crate::metrics::idle_connection_closed(),
                    }
                });
            }
        }
    }
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(limits.shutdown_wait) => info!("not waiting longer for open requests"),
    }
}
