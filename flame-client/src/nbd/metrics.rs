//! Prometheus metrics of the NBD server.
//!
//! Families are registered once per process in the default registry (served by
//! `flame_common::metrics_server::serve`). Label children are resolved once per reactor
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

/// Which bridge's metric families: `flame_nbd_*` or `flame_ublk_*` (one set of
/// operations, one shape; flame-ublk's discard is counted as `trim`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bridge {
    /// flame-nbd; the gauge is `flame_nbd_connections`.
    Nbd,
    /// flame-ublk; the gauge is `flame_ublk_inflight` (requests being served).
    Ublk,
}

fn families(bridge: Bridge) -> &'static Families {
    static NBD: OnceLock<Families> = OnceLock::new();
    static UBLK: OnceLock<Families> = OnceLock::new();
    match bridge {
        Bridge::Nbd => NBD.get_or_init(|| {
            make_families("flame_nbd", "NBD", ("connections", "Open NBD connections."))
        }),
        Bridge::Ublk => UBLK.get_or_init(|| {
            make_families(
                "flame_ublk",
                "ublk",
                ("inflight", "ublk requests being served."),
            )
        }),
    }
}

fn make_families(prefix: &str, what: &str, gauge: (&str, &str)) -> Families {
    // Construction with constant, valid names cannot fail; if registration fails
    // (a duplicate in a test binary) the metrics still count, just unexported.
    let connections = IntGauge::new(format!("{prefix}_{}", gauge.0), gauge.1)
        .unwrap_or_else(|_| unreachable_metric());
    let ops = IntCounterVec::new(
        Opts::new(
            format!("{prefix}_ops_total"),
            format!("{what} requests completed, by operation."),
        ),
        &["op"],
    )
    .unwrap_or_else(|_| unreachable_metric());
    let bytes = IntCounterVec::new(
        Opts::new(
            format!("{prefix}_bytes_total"),
            "Bytes read, written, trimmed or zeroed, by operation.",
        ),
        &["op"],
    )
    .unwrap_or_else(|_| unreachable_metric());
    let latency = HistogramVec::new(
        HistogramOpts::new(
            format!("{prefix}_op_latency_seconds"),
            format!("{what} request latency from request decoded to reply queued, by operation."),
        )
        .buckets(flame_common::metrics::LATENCY_BUCKETS_S.to_vec()),
        &["op"],
    )
    .unwrap_or_else(|_| unreachable_metric());
    let errors = IntCounterVec::new(
        Opts::new(
            format!("{prefix}_errors_total"),
            format!("{what} requests answered with an error, by operation."),
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
}

/// Counts a connection the stall watchdog closed (`reason`: the stall's label,
/// `payload_stall` or `send_stall`).
pub fn stalled_connection_closed(reason: &str) {
    static STALL_CLOSES: OnceLock<IntCounterVec> = OnceLock::new();
    let counter = STALL_CLOSES.get_or_init(|| {
        let c = IntCounterVec::new(
            Opts::new(
                "flame_nbd_stalled_connections_closed_total",
                "NBD connections closed for being stuck past their bound: payload_stall (a \
                 WRITE payload not delivered within payload_recv_timeout_ms of its header), \
                 send_stall (replies not read within send_stall_timeout_ms)",
            ),
            &["reason"],
        )
        .unwrap_or_else(|_| unreachable_metric());
        let _ = prometheus::default_registry().register(Box::new(c.clone()));
        c
    });
    counter.with_label_values(&[reason]).inc();
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
    /// Resolves flame-nbd's children (call once per reactor thread).
    pub fn new() -> OpMetrics {
        Self::of(Bridge::Nbd)
    }

    /// Resolves the children of `bridge`'s families (once per thread).
    pub fn of(bridge: Bridge) -> OpMetrics {
        let f = families(bridge);
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

    /// The gauge: open connections (flame-nbd), requests being served (flame-ublk).
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
        let u = OpMetrics::of(Bridge::Ublk);
        u.record(Op::Trim, 8192, 0.001, false);
        let text = flame_common::metrics::render();
        assert!(text.contains("flame_ublk_ops_total{op=\"trim\"}"), "{text}");
        assert!(text.contains("flame_ublk_inflight"), "{text}");
    }
}
