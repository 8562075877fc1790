//! The manager's Prometheus metrics.
//!
//! Gauges that describe the map (epoch, OSD and volume counts, bytes) are set from
//! the state at scrape time, so they can never drift from what `/v1/status` says;
//! only the request counters and latencies are updated as requests happen.

use crate::state::ClusterState;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts};

/// Every metric the manager exports, registered in the default registry.
pub struct Metrics {
    map_epoch: IntGauge,
    osds: IntGaugeVec,
    volumes: IntGauge,
    provisioned_bytes: IntGauge,
    used_bytes: IntGauge,
    /// `flame_mgr_api_requests_total{route,status}`.
    pub api_requests: IntCounterVec,
    /// `flame_mgr_api_latency_seconds{route}`.
    pub api_latency: HistogramVec,
}

fn register<C: prometheus::core::Collector + Clone + 'static>(
    c: C,
) -> Result<C, prometheus::Error> {
    prometheus::register(Box::new(c.clone()))?;
    Ok(c)
}

impl Metrics {
    /// Creates and registers the metrics. Fails only if they are registered twice.
    pub fn new() -> Result<Metrics, prometheus::Error> {
        Ok(Metrics {
            map_epoch: register(IntGauge::new(
                "flame_mgr_map_epoch",
                "Current cluster map epoch.",
            )?)?,
            osds: register(IntGaugeVec::new(
                Opts::new("flame_mgr_osds", "OSDs in the map: state=total, up or in."),
                &["state"],
            )?)?,
            volumes: register(IntGauge::new("flame_mgr_volumes", "Volumes in the map.")?)?,
            provisioned_bytes: register(IntGauge::new(
                "flame_mgr_provisioned_bytes",
                "Sum of volume sizes.",
            )?)?,
            used_bytes: register(IntGauge::new(
                "flame_mgr_used_bytes",
                "Sum of object bytes last reported by OSDs (all copies).",
            )?)?,
            api_requests: register(IntCounterVec::new(
                Opts::new(
                    "flame_mgr_api_requests_total",
                    "API requests by route (method and path template) and HTTP status.",
                ),
                &["route", "status"],
            )?)?,
            api_latency: register(HistogramVec::new(
                HistogramOpts::new(
                    "flame_mgr_api_latency_seconds",
                    "API request latency by route, including the state fsync of mutations.",
                )
                .buckets(flame_common::metrics::LATENCY_BUCKETS_S.to_vec()),
                &["route"],
            )?)?,
        })
    }

    /// Sets the map gauges from `state`; called right before rendering.
    pub fn refresh(&self, state: &ClusterState) {
        let map = state.map();
        let clamp = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        self.map_epoch.set(clamp(map.epoch.0));
        self.osds
            .with_label_values(&["total"])
            .set(count(map.osds.len()));
        self.osds
            .with_label_values(&["up"])
            .set(count(map.osds.values().filter(|o| o.up).count()));
        self.osds
            .with_label_values(&["in"])
            .set(count(map.osds.values().filter(|o| o.r#in).count()));
        self.volumes.set(count(map.volumes.len()));
        // The status computation holds the one definition of these sums.
        let st = state.status(&[]);
        self.provisioned_bytes.set(clamp(st.provisioned_bytes));
        self.used_bytes.set(clamp(st.used_bytes));
    }
}
