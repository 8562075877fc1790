//! The small HTTP server of every OSD, flame-nbd and flame-ublk: `/metrics`,
//! and a daemon's extra routes (the OSD's `/v1/pgs`, failpoints in failpoint
//! builds). Off the data path, on threads of its own, and bounded so that no
//! client can take it from the others:
//! * each connection is served on its own thread, so a slow one delays nobody;
//! * at most [`CONNECTIONS_MAX`] at once, [`CONNECTIONS_PER_SOURCE_MAX`] of
//!   them from one address — beyond, a new connection is closed at once and
//!   counted (`flame_metrics_http_refused_total`), so a flood from one place
//!   cannot keep a scraper from another out;
//! * one request per connection (`Connection: close`), which must arrive whole
//!   — head at most [`HEAD_BYTES_MAX`], body at most [`EXTRA_BODY_MAX`]
//!   — within [`REQUEST_TIMEOUT`], and whose answer must be taken within
//!   [`RESPONSE_TIMEOUT`]; a client that trickles or stops reading is cut off.
//!
//! The request head is parsed with `httparse` (hyper's parser); what to do with
//! a request is decided by [`route`] (pure, unit-tested).

use crate::collections::HashMap;
use crate::metrics::render;
use crate::transport::bring_up::Source;
use crate::transport::receive_share::share_key;
use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

/// Extra routes of a daemon's metrics server: given the method, the URL and the
/// body (bounded by [`EXTRA_BODY_MAX`]), `Some((status, text))` answers the request,
/// `None` leaves it to the default (404). The OSD's `/v1/pgs` and failpoint
/// control use it.
pub type ExtraRoutes =
    std::sync::Arc<dyn Fn(&str, &str, &str) -> Option<(u16, String)> + Send + Sync>;

/// Bytes of a request body the metrics server reads at most (routes take short
/// text, such as a failpoint action).
pub const EXTRA_BODY_MAX: u64 = 4096;

/// Connections served at once.
pub const CONNECTIONS_MAX: usize = 64;
/// Connections served at once from one address.
pub const CONNECTIONS_PER_SOURCE_MAX: usize = 8;
/// Time a client has to send its whole request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Time a client has to take the whole answer.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// Bytes of a request line and headers at most.
pub const HEAD_BYTES_MAX: usize = 8192;
/// Headers a request may have at most.
const HEADERS_MAX: usize = 32;

static REFUSED: LazyLock<prometheus::IntCounter> = LazyLock::new(|| {
    prometheus::register_int_counter!(
        "flame_metrics_http_refused_total",
        "Connections to this daemon's metrics server closed unserved: too many at once, or from one address"
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});

static CUT: LazyLock<prometheus::IntCounter> = LazyLock::new(|| {
    prometheus::register_int_counter!(
        "flame_metrics_http_cut_total",
        "Connections to this daemon's metrics server cut off: a request not whole in time or too large, or an answer not taken in time"
    )
    .unwrap_or_else(|e| panic!("metric registration: {e}"))
});

/// How long a client has for its request and for taking the answer.
#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub request: Duration,
    pub response: Duration,
}

impl Default for Timeouts {
    fn default() -> Timeouts {
        Timeouts {
            request: REQUEST_TIMEOUT,
            response: RESPONSE_TIMEOUT,
        }
    }
}

/// Connections being served, in all and per address (an IPv6 host by its /64,
/// [`share_key`]).
#[derive(Default)]
struct Slots {
    total: usize,
    per_source: HashMap<Source, usize>,
}

/// A connection's place among those served; given back on drop.
struct Slot {
    slots: Arc<Mutex<Slots>>,
    source: Source,
}

impl Slots {
    /// Takes a place for a connection from `ip`, if there is one.
    fn take(slots: &Arc<Mutex<Slots>>, ip: IpAddr) -> Option<Slot> {
        let source = share_key(Source::Ip(ip));
        let mut s = slots.lock().unwrap_or_else(|p| p.into_inner());
        let mine = s.per_source.get(&source).copied().unwrap_or(0);
        if s.total >= CONNECTIONS_MAX || mine >= CONNECTIONS_PER_SOURCE_MAX {
            return None;
        }
        s.total += 1;
        s.per_source.insert(source, mine + 1);
        Some(Slot {
            slots: slots.clone(),
            source,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        s.total -= 1;
        if let Some(n) = s.per_source.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                s.per_source.remove(&self.source);
            }
        }
    }
}

/// An answer: status, content type, body.
#[derive(Debug, PartialEq, Eq)]
pub struct Answer {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Answer {
    fn text(status: u16, body: impl Into<String>) -> Answer {
        Answer {
            status,
            content_type: "text/plain; charset=utf-8",
            body: body.into(),
        }
    }
}

/// What a request asks for: `GET /metrics` renders the metrics, anything else
/// goes to `extra` (404 when it does not answer).
pub fn route(method: &str, path: &str, body: &str, extra: Option<&ExtraRoutes>) -> Answer {
    if path == "/metrics" || path.starts_with("/metrics?") {
        return Answer {
            status: 200,
            content_type: "text/plain; version=0.0.4",
            body: render(),
        };
    }
    match extra.and_then(|route| route(method, path, body)) {
        Some((status, text)) => Answer::text(status, text),
        None => Answer::text(404, "not found; try /metrics\n"),
    }
}

/// A request read off a connection, or the answer that refuses it.
#[derive(Debug, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub body: String,
}

/// Parses `head` (the bytes up to and including the blank line): the method,
/// path and body length, or the answer that refuses the request.
pub fn parse_head(head: &[u8]) -> Result<(String, String, usize), Answer> {
    let mut headers = [httparse::EMPTY_HEADER; HEADERS_MAX];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => {
            return Err(Answer::text(400, "incomplete request head\n"));
        }
        Err(httparse::Error::TooManyHeaders) => {
            return Err(Answer::text(431, "too many headers\n"));
        }
        Err(e) => return Err(Answer::text(400, format!("bad request: {e}\n"))),
    }
    let (Some(method), Some(path)) = (req.method, req.path) else {
        return Err(Answer::text(400, "bad request line\n"));
    };
    let mut body_len = None;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(Answer::text(411, "send a Content-Length, not chunks\n"));
        }
        if h.name.eq_ignore_ascii_case("content-length") {
            let n = std::str::from_utf8(h.value)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| Answer::text(400, "bad Content-Length\n"))?;
            if n > EXTRA_BODY_MAX {
                return Err(Answer::text(
                    413,
                    format!("request body over {EXTRA_BODY_MAX} bytes\n"),
                ));
            }
            if body_len.is_some_and(|b| b != n as usize) {
                return Err(Answer::text(400, "conflicting Content-Length headers\n"));
            }
            body_len = Some(n as usize);
        }
    }
    Ok((method.to_string(), path.to_string(), body_len.unwrap_or(0)))
}

/// Why a connection ended without an answer worth sending.
enum Cut {
    /// Timed out or too large: answered with this, counted.
    Answer(Answer),
    /// The client went away.
    Gone,
}

/// Reads into `buf` until `done(buf)` or the deadline. Bounded: every read
/// either adds bytes, ends the connection, or fails at the deadline.
fn read_until(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    max: usize,
    deadline: Instant,
    done: impl Fn(&[u8]) -> bool,
) -> Result<(), Cut> {
    let mut chunk = [0u8; 2048];
    while !done(buf) {
        if buf.len() >= max {
            return Err(Cut::Answer(Answer::text(431, "request head too large\n")));
        }
        let left = deadline.saturating_duration_since(crate::clock::now());
        if left.is_zero() {
            return Err(Cut::Answer(Answer::text(408, "request not sent in time\n")));
        }
        if stream.set_read_timeout(Some(left)).is_err() {
            return Err(Cut::Gone);
        }
        let want = chunk.len().min(max - buf.len());
        match stream.read(&mut chunk[..want]) {
            Ok(0) => return Err(Cut::Gone),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return Err(Cut::Answer(Answer::text(408, "request not sent in time\n")));
            }
            Err(_) => return Err(Cut::Gone),
        }
    }
    Ok(())
}

/// The length of the request head at the start of `b` (through its blank
/// line, `\r\n\r\n` or a bare `\n\n`), if it is all there.
fn head_end(b: &[u8]) -> Option<usize> {
    let crlf = b.windows(4).position(|w| w == b"\r\n\r\n").map(|p| p + 4);
    let lf = b.windows(2).position(|w| w == b"\n\n").map(|p| p + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Reads one request off `stream`, within `timeout`.
fn read_request(stream: &mut TcpStream, timeout: Duration) -> Result<Request, Cut> {
    let deadline = crate::clock::now() + timeout;
    let mut buf = Vec::with_capacity(1024);
    read_until(stream, &mut buf, HEAD_BYTES_MAX, deadline, |b| {
        head_end(b).is_some()
    })?;
    let head_len = head_end(&buf).unwrap_or(buf.len());
    let (method, path, body_len) = parse_head(&buf[..head_len]).map_err(Cut::Answer)?;
    let want = head_len + body_len;
    read_until(stream, &mut buf, want, deadline, |b| b.len() >= want)?;
    let body = String::from_utf8(buf[head_len..want].to_vec())
        .map_err(|_| Cut::Answer(Answer::text(400, "request body is not UTF-8 text\n")))?;
    Ok(Request { method, path, body })
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Content Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    }
}

/// Writes `answer` and closes, within `timeout` in all. Returns whether it
/// all went.
fn respond(stream: &mut TcpStream, answer: &Answer, timeout: Duration) -> bool {
    let deadline = crate::clock::now() + timeout;
    let mut out = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        answer.status,
        reason(answer.status),
        answer.content_type,
        answer.body.len()
    )
    .into_bytes();
    out.extend_from_slice(answer.body.as_bytes());
    let mut sent = 0;
    // Bounded: every write sends bytes or fails, and the deadline ends a
    // client that takes a byte now and then.
    while sent < out.len() {
        let left = deadline.saturating_duration_since(crate::clock::now());
        if left.is_zero() || stream.set_write_timeout(Some(left)).is_err() {
            return false;
        }
        match stream.write(&out[sent..]) {
            Ok(0) => return false,
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
    true
}

/// Serves one connection: one request, one answer.
fn serve_connection(mut stream: TcpStream, extra: Option<&ExtraRoutes>, t: Timeouts) {
    match read_request(&mut stream, t.request) {
        Ok(req) => {
            let answer = route(&req.method, &req.path, &req.body, extra);
            if !respond(&mut stream, &answer, t.response) {
                CUT.inc();
            }
        }
        Err(Cut::Answer(a)) => {
            CUT.inc();
            let _ = respond(&mut stream, &a, t.response);
        }
        Err(Cut::Gone) => {}
    }
}

/// Serves `addr` from a background thread (one more per connection being
/// served). Returns the bound address (useful with port 0).
pub fn serve(addr: SocketAddr, extra: Option<ExtraRoutes>) -> std::io::Result<SocketAddr> {
    serve_timed(addr, extra, Timeouts::default())
}

/// Like [`serve`], with other timeouts (tests).
pub fn serve_timed(
    addr: SocketAddr,
    extra: Option<ExtraRoutes>,
    timeouts: Timeouts,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let bound = listener.local_addr()?;
    LazyLock::force(&REFUSED);
    LazyLock::force(&CUT);
    let slots = Arc::new(Mutex::new(Slots::default()));
    std::thread::Builder::new()
        .name("metrics-http".into())
        .spawn(move || {
            // Runs for the life of the process: every round takes one
            // connection (or one accept error, after a pause so that a process
            // out of descriptors does not spin).
            loop {
                let (stream, peer) = match listener.accept() {
                    Ok(a) => a,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        tracing::warn!("metrics server: accept failed: {e}");
                        crate::clock::sleep_blocking(Duration::from_millis(100));
                        continue;
                    }
                };
                let Some(slot) = Slots::take(&slots, peer.ip()) else {
                    REFUSED.inc();
                    drop(stream);
                    continue;
                };
                let extra = extra.clone();
                let spawned = std::thread::Builder::new()
                    .name("metrics-conn".into())
                    .spawn(move || {
                        let _slot = slot;
                        serve_connection(stream, extra.as_ref(), timeouts);
                    });
                if let Err(e) = spawned {
                    REFUSED.inc();
                    tracing::warn!("metrics server: cannot start a connection thread: {e}");
                }
            }
        })?;
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get(addr: SocketAddr, from: &str, path: &str) -> std::io::Result<String> {
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        sock.bind(&SocketAddr::new(from.parse().unwrap(), 0).into())?;
        sock.connect(&addr.into())?;
        let mut s: TcpStream = sock.into();
        s.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n")?;
        let mut out = String::new();
        s.read_to_string(&mut out)?;
        Ok(out)
    }

    #[test]
    fn heads_are_parsed_and_bounded() {
        assert_eq!(
            parse_head(b"GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n"),
            Ok(("GET".into(), "/metrics".into(), 0))
        );
        assert_eq!(
            parse_head(b"PUT /failpoints/x HTTP/1.1\r\nContent-Length: 12\r\n\r\n"),
            Ok(("PUT".into(), "/failpoints/x".into(), 12))
        );
        let status = |h: &[u8]| parse_head(h).unwrap_err().status;
        assert_eq!(
            status(b"PUT /x HTTP/1.1\r\nContent-Length: 4097\r\n\r\n"),
            413
        );
        assert_eq!(
            status(b"PUT /x HTTP/1.1\r\nContent-Length: -1\r\n\r\n"),
            400
        );
        assert_eq!(
            status(b"PUT /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
            411
        );
        assert_eq!(status(b"\x00\x01garbage\r\n\r\n"), 400);
        assert_eq!(
            status(b"PUT /x HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"),
            400
        );
        assert_eq!(head_end(b"GET / HTTP/1.1\n\nrest"), Some(16));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n\r\nx"), Some(24));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\nA: b\r\n"), None);
        let many: String = (0..40).map(|i| format!("H{i}: v\r\n")).collect();
        assert_eq!(
            status(format!("GET / HTTP/1.1\r\n{many}\r\n").as_bytes()),
            431
        );
    }

    #[test]
    fn routes_go_to_metrics_extra_or_404() {
        let extra: ExtraRoutes =
            Arc::new(|m: &str, p: &str, b: &str| (p == "/v1/x").then(|| (201, format!("{m} {b}"))));
        assert_eq!(route("GET", "/metrics", "", Some(&extra)).status, 200);
        assert_eq!(
            route("PUT", "/v1/x", "body", Some(&extra)),
            Answer::text(201, "PUT body")
        );
        assert_eq!(route("GET", "/nope", "", Some(&extra)).status, 404);
        assert_eq!(route("GET", "/v1/x", "", None).status, 404);
    }

    #[test]
    fn slots_are_bounded_in_all_and_per_source() {
        let slots = Arc::new(Mutex::new(Slots::default()));
        let a: IpAddr = "127.0.0.1".parse().unwrap();
        let held: Vec<Slot> = (0..CONNECTIONS_PER_SOURCE_MAX)
            .map(|_| Slots::take(&slots, a).unwrap())
            .collect();
        assert!(Slots::take(&slots, a).is_none(), "one source is capped");
        let mut others = Vec::new();
        for i in 0..(CONNECTIONS_MAX - CONNECTIONS_PER_SOURCE_MAX) {
            let ip = IpAddr::from([127, 0, 1, (i % 200) as u8 + 1]);
            let ip = if i >= 200 {
                IpAddr::from([127, 0, 2, 1])
            } else {
                ip
            };
            others.push(Slots::take(&slots, ip).unwrap());
        }
        assert!(
            Slots::take(&slots, "127.0.9.9".parse().unwrap()).is_none(),
            "and all of them"
        );
        drop(held);
        assert!(Slots::take(&slots, a).is_some(), "given back on drop");
    }

    /// Clients that send half a request and stop, from one address, neither
    /// hold the server from a scraper elsewhere nor stay beyond the timeout;
    /// over the per-source cap they are closed at once.
    const SHORT: Timeouts = Timeouts {
        request: Duration::from_millis(800),
        response: Duration::from_millis(800),
    };

    #[test]
    fn stalled_clients_neither_block_a_scraper_nor_stay() {
        let addr = serve_timed("127.0.0.1:0".parse().unwrap(), None, SHORT).unwrap();
        let started = Instant::now();
        let stalled: Vec<TcpStream> = (0..CONNECTIONS_PER_SOURCE_MAX + 4)
            .map(|_| {
                let mut s = TcpStream::connect(addr).unwrap();
                s.write_all(b"GET /metrics HTTP/1.1\r\nHo").unwrap();
                s
            })
            .collect();
        // A scraper from another address is served at once.
        let page = get(addr, "127.0.0.2", "/metrics").unwrap();
        assert!(page.starts_with("HTTP/1.1 200 OK"), "{page}");
        assert!(page.contains("flame_metrics_http_refused_total"), "{page}");
        assert!(started.elapsed() < SHORT.request, "the scraper waited");
        // Those over the cap were closed unserved; the others are cut off
        // with 408 at the request timeout.
        let mut refused = 0;
        let mut timed_out = 0;
        for mut s in stalled {
            s.set_read_timeout(Some(SHORT.request * 4)).unwrap();
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            if out.is_empty() {
                refused += 1;
            } else {
                assert!(out.starts_with("HTTP/1.1 408"), "{out}");
                timed_out += 1;
            }
        }
        assert_eq!((refused, timed_out), (4, CONNECTIONS_PER_SOURCE_MAX));
        assert!(started.elapsed() < SHORT.request + Duration::from_secs(2));
    }

    /// A client that never reads a large answer is cut off at the response
    /// timeout at the latest, and the server goes on serving.
    #[test]
    fn a_client_that_never_reads_is_cut_off() {
        let big = "x".repeat(8 << 20);
        let extra: ExtraRoutes =
            Arc::new(move |_: &str, p: &str, _: &str| (p == "/big").then(|| (200, big.clone())));
        let addr = serve_timed("127.0.0.1:0".parse().unwrap(), Some(extra), SHORT).unwrap();
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(b"GET /big HTTP/1.1\r\n\r\n").unwrap();
        // Not reading past the timeout: the server gives up, and what it had
        // handed the kernel is all that ever arrives.
        std::thread::sleep(SHORT.response + Duration::from_millis(700));
        let page = get(addr, "127.0.0.3", "/metrics").unwrap();
        assert!(page.starts_with("HTTP/1.1 200 OK"), "{page}");
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut got = Vec::new();
        let _ = s.read_to_end(&mut got);
        assert!(
            got.len() < 8 << 20,
            "the whole answer went: {} bytes",
            got.len()
        );
    }
}
