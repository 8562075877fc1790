//! Client metrics in the prometheus default registry (served by whichever daemon
//! embeds the client, e.g. flame-nbd's `/metrics`).
//!
//! * `flame_client_ops_total{op}` — volume operations completed (ok or not)
//! * `flame_client_errors_total{op}` — of those, the failed ones
//! * `flame_client_bytes_total{op}` — bytes moved by successful operations
//! * `flame_client_op_latency_seconds{op}` — latency of volume operations
//! * `flame_client_retries_total{reason}` — tries repeated, by [`RetryReason`]
//! * `flame_client_connections` — open OSD connections (all threads)
//!
//! Label children are resolved once per thread and kept in a thread-local, so the
//! data path pays an atomic add, not a label-hash lookup.

use crate::retry::RetryReason;
use flame_common::metrics::LATENCY_BUCKETS_S;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
};
use std::sync::LazyLock;
use std::time::Duration;

/// A volume-level operation, the `op` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// `read_at`.
    Read = 0,
    /// `write_at`.
    Write = 1,
    /// `write_zeroes`.
    WriteZeroes = 2,
    /// `discard`.
    Discard = 3,
    /// `flush`.
    Flush = 4,
    /// `delete_volume_objects`.
    DeleteVolume = 5,
}

impl Op {
    const ALL: [Op; 6] = [
        Op::Read,
        Op::Write,
        Op::WriteZeroes,
        Op::Discard,
        Op::Flush,
        Op::DeleteVolume,
    ];

    /// Label value.
    pub fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
            Op::WriteZeroes => "write_zeroes",
            Op::Discard => "discard",
            Op::Flush => "flush",
            Op::DeleteVolume => "delete_volume",
        }
    }
}

const REASONS: [RetryReason; 6] = [
    RetryReason::Stale,
    RetryReason::Again,
    RetryReason::Connection,
    RetryReason::OsdDown,
    RetryReason::NoOsds,
    RetryReason::Superseded,
];

struct Families {
    ops: IntCounterVec,
    errors: IntCounterVec,
    bytes: IntCounterVec,
    latency: HistogramVec,
    retries: IntCounterVec,
    connections: IntGauge,
}

/// Registers a collector; a second registration (two embedders in one process,
/// tests) keeps the first, which is the one being scraped.
fn register<C: prometheus::core::Collector + Clone + 'static>(c: &C) {
    let _ = prometheus::register(Box::new(c.clone()));
}

// The names, labels and buckets below are constants; a unit test creates them, so
// these `expect`s cannot fire at run time.
static FAMILIES: LazyLock<Families> = LazyLock::new(|| {
    let counter = |name: &str, help: &str, label: &str| {
        let c = IntCounterVec::new(Opts::new(name, help), &[label])
            .expect("static metric definition is valid");
        register(&c);
        c
    };
    let latency = HistogramVec::new(
        HistogramOpts::new(
            "flame_client_op_latency_seconds",
            "Latency of client volume operations, retries included",
        )
        .buckets(LATENCY_BUCKETS_S.to_vec()),
        &["op"],
    )
    .expect("static metric definition is valid");
    register(&latency);
    let connections = IntGauge::new(
        "flame_client_connections",
        "Open client connections to OSD shards",
    )
    .expect("static metric definition is valid");
    register(&connections);
    Families {
        ops: counter(
            "flame_client_ops_total",
            "Client volume operations completed",
            "op",
        ),
        errors: counter(
            "flame_client_errors_total",
            "Client volume operations that failed",
            "op",
        ),
        bytes: counter(
            "flame_client_bytes_total",
            "Bytes moved by successful client operations",
            "op",
        ),
        latency,
        retries: counter(
            "flame_client_retries_total",
            "Client tries repeated after a transient failure",
            "reason",
        ),
        connections,
    }
});

/// One thread's resolved children.
struct Local {
    ops: Vec<IntCounter>,
    errors: Vec<IntCounter>,
    bytes: Vec<IntCounter>,
    latency: Vec<Histogram>,
    retries: Vec<IntCounter>,
}

thread_local! {
    static LOCAL: Local = {
        let f = &*FAMILIES;
        let per_op = |v: &IntCounterVec| Op::ALL.iter().map(|o| v.with_label_values(&[o.name()])).collect();
        Local {
            ops: per_op(&f.ops),
            errors: per_op(&f.errors),
            bytes: per_op(&f.bytes),
            latency: Op::ALL
                .iter()
                .map(|o| f.latency.with_label_values(&[o.name()]))
                .collect(),
            retries: REASONS
                .iter()
                .map(|r| f.retries.with_label_values(&[r.name()]))
                .collect(),
        }
    };
}

/// Records one finished operation.
pub(crate) fn record_op(op: Op, ok: bool, bytes: u64, elapsed: Duration) {
    let i = op as usize;
    LOCAL.with(|l| {
        l.ops[i].inc();
        if ok {
            l.bytes[i].inc_by(bytes);
        } else {
            l.errors[i].inc();
        }
        l.latency[i].observe(elapsed.as_secs_f64());
    });
}

/// Records one retry.
pub(crate) fn record_retry(reason: RetryReason) {
    let i = REASONS.iter().position(|r| *r == reason).unwrap_or(0);
    LOCAL.with(|l| l.retries[i].inc());
}

/// Counts a connection opened (+1) or closed (-1).
pub(crate) fn connections_add(delta: i64) {
    FAMILIES.connections.add(delta);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_register_and_count() {
        record_op(Op::Write, true, 4096, Duration::from_micros(50));
        record_op(Op::Write, false, 4096, Duration::from_micros(50));
        record_retry(RetryReason::OsdDown);
        connections_add(1);
        connections_add(-1);
        let text = flame_common::metrics::render();
        for name in [
            "flame_client_ops_total",
            "flame_client_errors_total",
            "flame_client_bytes_total",
            "flame_client_op_latency_seconds",
            "flame_client_retries_total",
            "flame_client_connections",
        ] {
            assert!(text.contains(name), "{name} missing from\n{text}");
        }
        assert!(text.contains("reason=\"osd_down\""));
    }
}
