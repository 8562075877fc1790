//! Prometheus metrics: a `/metrics` HTTP endpoint every daemon serves.
//!
//! Metrics are registered in the `prometheus` crate's default registry. Counters on
//! the data path are per shard thread (a `shard` label, the child resolved once per
//! thread), so shards never write the same cache line.

use prometheus::{Encoder, TextEncoder};
use std::net::SocketAddr;

/// Latency buckets in seconds, 10 µs … 2 s: block I/O latencies span that range.
pub const LATENCY_BUCKETS_S: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0,
];

/// Renders every registered metric in the Prometheus text format.
pub fn render() -> String {
    let mut buf = Vec::new();
    let encoder = TextEncoder::new();
    if let Err(e) = encoder.encode(&prometheus::gather(), &mut buf) {
        return format!("# error encoding metrics: {e}\n");
    }
    String::from_utf8(buf).unwrap_or_default()
}

/// Serves `GET /metrics` on `addr` from a background thread. Returns the bound
/// address (useful with port 0). Any other path gets 404. The server is off the data
/// path: a slow scraper only delays other scrapes.
pub fn serve(addr: SocketAddr) -> std::io::Result<SocketAddr> {
    serve_with(addr, std::sync::Arc::new(|_: &str| None))
}

/// A daemon's own HTTP API served next to `/metrics`: given the request's URL,
/// `Some((status, JSON body))` answers it, `None` leaves it to the 404.
pub type ApiHandler = std::sync::Arc<dyn Fn(&str) -> Option<(u16, String)> + Send + Sync>;

/// Like [`serve`], and answers other `GET` paths with `api` (the OSD serves its
/// placement groups' status this way).
pub fn serve_with(addr: SocketAddr, api: ApiHandler) -> std::io::Result<SocketAddr> {
    let server = tiny_http::Server::http(addr).map_err(std::io::Error::other)?;
    let bound = server
        .server_addr()
        .to_ip()
        .ok_or_else(|| std::io::Error::other("metrics server bound to a non-IP address"))?;
    std::thread::Builder::new()
        .name("metrics-http".into())
        .spawn(move || {
            for request in server.incoming_requests() {
                let response =
                    if request.url() == "/metrics" || request.url().starts_with("/metrics?") {
                        let header = tiny_http::Header::from_bytes(
                            &b"Content-Type"[..],
                            &b"text/plain; version=0.0.4"[..],
                        )
                        .ok();
                        let mut r = tiny_http::Response::from_string(render());
                        if let Some(h) = header {
                            r = r.with_header(h);
                        }
                        r
                    } else if let Some((code, body)) = api(request.url()) {
                        let header = tiny_http::Header::from_bytes(
                            &b"Content-Type"[..],
                            &b"application/json"[..],
                        )
                        .ok();
                        let mut r = tiny_http::Response::from_string(body).with_status_code(code);
                        if let Some(h) = header {
                            r = r.with_header(h);
                        }
                        r
                    } else {
                        tiny_http::Response::from_string("not found; try /metrics\n")
                            .with_status_code(404)
                    };
                // A scraper that hung up is not our problem.
                let _ = request.respond(response);
            }
        })?;
    Ok(bound)
}
