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

/// Extra routes of a daemon's metrics server: given the method, the URL and the
/// body (bounded by [`EXTRA_BODY_MAX`]), `Some((status, text))` answers the request,
/// `None` leaves it to the default (404). The OSD's failpoint control uses it.
pub type ExtraRoutes =
    std::sync::Arc<dyn Fn(&str, &str, &str) -> Option<(u16, String)> + Send + Sync>;

/// Bytes of a request body the metrics server reads at most (routes take short
/// text, such as a failpoint action).
pub const EXTRA_BODY_MAX: u64 = 4096;

/// Serves `GET /metrics` on `addr` from background threads, bounded
/// ([`crate::metrics_server`]). Returns the bound address (useful with port 0).
/// Any other path gets 404. The server is off the data path.
pub fn serve(addr: SocketAddr) -> std::io::Result<SocketAddr> {
    serve_with(addr, None)
}

/// Like [`serve`], with `extra` routes tried for every request but `/metrics`.
pub fn serve_with(addr: SocketAddr, extra: Option<ExtraRoutes>) -> std::io::Result<SocketAddr> {
    crate::metrics_server::serve(addr, extra)
}
