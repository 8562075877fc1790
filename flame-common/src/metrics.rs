//! Prometheus metrics: what every daemon's `/metrics` endpoint renders
//! (served by `metrics_server`).
//!
//! Metrics are registered in the `prometheus` crate's default registry. Counters on
//! the data path are per shard thread (a `shard` label, the child resolved once per
//! thread), so shards never write the same cache line.

use prometheus::{Encoder, TextEncoder};

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
