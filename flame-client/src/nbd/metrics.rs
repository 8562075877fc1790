//! Prometheus metrics of the NBD server.
//!
//! Families are registered once per process in the default registry (served by
//! `flame_common::metrics::serve`). Label children are resolved once per reactor
//! thread into [`OpMetrics`], so a request costs a few atomic adds and no label
//! lookup by string.

use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
};
use std::sync::OnceLock;

/// Operation labels, indexed by [`Op`].
const OP_NAMES: [&str; 7] = [
    "read",
    "write",
    "flush",
    "trim",
    "write_zeroes",
    "cache",
    "other",
];

/// Which operation a metric sample belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// NBD_CMD_READ.
    Read = 0,
    /// NBD_CMD_WRITE.
    Write = 1,
    /// NBD_CMD_FLUSH.
    Flush = 2,
    /// NBD_CMD_TRIM.
    Trim = 3,
    /// NBD_CMD_WRITE_ZEROES.
    WriteZeroes = 4,
    /// NBD_CMD_CACHE.
    Cache = 5,
    /// Rejected or unknown commands.
    Other = 6,
}

struct Families {
    connections: IntGauge,
    ops: IntCounterVec,
    bytes: IntCounterVec,
    latency: HistogramVec,
    errors: IntCounterVec,
}

fn families() -> &'static Families {
    static F: OnceLock<Families> = OnceLock::new();
    F.get_or_init(|| {
        // Construction with constant, valid names cannot fail; if registration fails
        // (a duplicate in a test binary) the metrics still count, just unexported.
        let connections = IntGauge::new("flame_nbd_connections", "Open NBD connections.")
            .unwrap_or_else(|_| unreachable_metric());
        let ops = IntCounterVec::new(
            Opts::new(
                "flame_nbd_ops_total",
                "NBD requests completed, by operation.",
            ),
            &["op"],
        )
        .unwrap_or_else(|_| unreachable_metric());
        let bytes = IntCounterVec::new(
            Opts::new(
                "flame_nbd_bytes_total",
                "Bytes read, written, trimmed or zeroed, by operation.",
            ),
            &["op"],
        )
        .unwrap_or_else(|_| unreachable_metric());
        let latency = HistogramVec::new(
            HistogramOpts::new(
                "flame_nbd_op_latency_seconds",
                "NBD request latency from request decoded to reply queued, by operation.",
            )
            .buckets(flame_common::metrics::LATENCY_BUCKETS_S.to_vec()),
            &["op"],
        )
        .unwrap_or_else(|_| unreachable_metric());
        let errors = IntCounterVec::new(
            Opts::new(
                "flame_nbd_errors_total",
                "NBD requests answered with an error, by operation.",
            ),
            &["op"],
        )
        .unwrap_or_else(|_| unreachable_metric());
        let r = prometheus::default_registry();
        let _ = r.register(Box::new(connections.clone()));
        let _ = r.register(Box::new(ops.clone()));
        let _ = r.register(Box::new(bytes.clone()));
        let _ = r.register(Box::new(latency.clone()));
        let _ = r.register(Box::new(errors.clone()));
        Families {
            connections,
            ops,
            bytes,
            latency,
            errors,
        }
    })
}

#[cold]
fn unreachable_metric<T>() -> T {
    // Metric names and label sets above are constants checked by the unit test.
    unreachable!("invalid constant metric definition")
}

/// Resolved children of one operation.
#[derive(Clone)]
pub struct OneOp {
    ops: IntCounter,
    bytes: IntCounter,
    latency: Histogram,
    errors: IntCounter,
}

/// Every operation's children, resolved once per thread.
#[derive(Clone)]
pub struct OpMetrics {
    ops: Vec<OneOp>,
    connections: IntGauge,
}

impl OpMetrics {
    /// Resolves the children (call once per reactor thread).
    pub fn new() -> OpMetrics {
        let f = families();
        OpMetrics {
            ops: OP_NAMES
                .iter()
                .map(|n| OneOp {
                    ops: f.ops.with_label_values(&[n]),
                    bytes: f.bytes.with_label_values(&[n]),
                    latency: f.latency.with_label_values(&[n]),
                    errors: f.errors.with_label_values(&[n]),
                })
                .collect(),
            connections: f.connections.clone(),
        }
    }

    /// Records one completed request.
    pub fn record(&self, op: Op, bytes: u64, seconds: f64, error: bool) {
        let m = &self.ops[op as usize];
        m.ops.inc();
        m.bytes.inc_by(bytes);
        m.latency.observe(seconds);
        if error {
            m.errors.inc();
        }
    }

    /// The open-connections gauge.
    pub fn connections(&self) -> &IntGauge {
        &self.connections
    }
}

impl Default for OpMetrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_renders() {
        let m = OpMetrics::new();
        m.record(Op::Write, 4096, 0.001, false);
        m.record(Op::Read, 0, 0.002, true);
        let text = flame_common::metrics::render();
        assert!(text.contains("flame_nbd_ops_total{op=\"write\"}"), "{text}");
        assert!(
            text.contains("flame_nbd_errors_total{op=\"read\"}"),
            "{text}"
        );
        assert!(
            text.contains("flame_nbd_op_latency_seconds_bucket"),
            "{text}"
        );
        assert!(text.contains("flame_nbd_connections"), "{text}");
    }
}
