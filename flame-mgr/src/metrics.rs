//! The manager's Prometheus metrics.
//!
//! Gauges that describe the map (epoch, OSD and volume counts, bytes) are set from
//! the state at scrape time, so they can never drift from what `/v1/status` says;
//! only the request counters and latencies are updated as requests happen.

use crate::state::ClusterState;
use flame_common::placement::PgTable;
use prometheus::{Gauge, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts};
use std::time::Instant;

/// Every metric the manager exports, registered in the default registry.
pub struct Metrics {
    map_epoch: IntGauge,
    osds: IntGaugeVec,
    volumes: IntGauge,
    provisioned_bytes: IntGauge,
    used_bytes: IntGauge,
    pgs: IntGaugeVec,
    pgs_degraded: IntGauge,
    pgs_inactive: IntGauge,
    objects_to_recover: IntGauge,
    objects: IntGauge,
    object_copies: IntGaugeVec,
    pgs_uncounted: IntGauge,
    recovery_bytes_per_second: Gauge,
    recovery_objects_per_second: Gauge,
    scrub_errors: IntGauge,
    /// `flame_mgr_api_requests_total{route,status}`.
    pub api_requests: IntCounterVec,
    /// `flame_mgr_api_latency_seconds{route}`.
    pub api_latency: HistogramVec,
    /// `flame_mgr_auth_refusals_total{reason}` ([`crate::auth::Refusal::reason`]).
    pub auth_refusals: IntCounterVec,
}

static CONNECTIONS_REFUSED: std::sync::LazyLock<prometheus::IntCounter> = std::sync::LazyLock::new(
    || {
        prometheus::register_int_counter!(
            "flame_mgr_connections_refused_total",
            "API connections closed unserved because their address held connections_per_source_max already"
        )
        .unwrap_or_else(|e| panic!("metric registration: {e}"))
    },
);

static IDLE_CONNECTIONS_CLOSED: std::sync::LazyLock<prometheus::IntCounter> =
    std::sync::LazyLock::new(|| {
        prometheus::register_int_counter!(
            "flame_mgr_idle_connections_closed_total",
            "API connections closed after idle_timeout_ms with no request in service and no byte moving"
        )
        .unwrap_or_else(|e| panic!("metric registration: {e}"))
    });

/// Counts an API connection closed unserved (its address holds its share).
pub fn connection_refused() {
    CONNECTIONS_REFUSED.inc();
}

/// Counts an API connection closed for idling (`idle_timeout_ms`).
pub fn idle_connection_closed() {
    IDLE_CONNECTIONS_CLOSED.inc();
}

/// Registers the counters that are not part of [`Metrics`], so `/metrics`
/// shows them from the start.
pub fn register_statics() {
    std::sync::LazyLock::force(&CONNECTIONS_REFUSED);
    std::sync::LazyLock::force(&IDLE_CONNECTIONS_CLOSED);
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
                Opts::new(
                    "flame_mgr_osds",
                    "OSDs in the map: state=total, up, down, in or out.",
                ),
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
            pgs: register(IntGaugeVec::new(
                Opts::new(
                    "flame_mgr_pgs",
                    "Placement groups by state string (active+clean, \
                     active+recovering+degraded, inactive+degraded, ...), from the map.",
                ),
                &["state"],
            )?)?,
            pgs_degraded: register(IntGauge::new(
                "flame_mgr_pgs_degraded",
                "Placement groups with fewer than pool.size complete copies up.",
            )?)?,
            pgs_inactive: register(IntGauge::new(
                "flame_mgr_pgs_inactive",
                "Placement groups with fewer than pool.min_size complete copies up: I/O waits.",
            )?)?,
            objects_to_recover: register(IntGauge::new(
                "flame_mgr_objects_to_recover",
                "Objects the up OSDs last reported they still have to recover.",
            )?)?,
            objects: register(IntGauge::new(
                "flame_mgr_objects",
                "Objects in the pool (each once), as the primaries last counted them.",
            )?)?,
            object_copies: register(IntGaugeVec::new(
                Opts::new(
                    "flame_mgr_object_copies",
                    "Object copies: state=expected (objects x pool.size), degraded (missing: \
                     groups below pool.size), misplaced (on an OSD placement no longer \
                     chooses), recovering (being made).",
                ),
                &["state"],
            )?)?,
            pgs_uncounted: register(IntGauge::new(
                "flame_mgr_pgs_uncounted",
                "Placement groups whose primary has not reported an object count yet \
                 (missing from flame_mgr_objects and flame_mgr_object_copies).",
            )?)?,
            recovery_bytes_per_second: register(Gauge::new(
                "flame_mgr_recovery_bytes_per_second",
                "Bytes recovered per second, cluster-wide, over the last 30 s of heartbeats.",
            )?)?,
            recovery_objects_per_second: register(Gauge::new(
                "flame_mgr_recovery_objects_per_second",
                "Objects recovered per second, cluster-wide, over the last 30 s of heartbeats.",
            )?)?,
            scrub_errors: register(IntGauge::new(
                "flame_mgr_scrub_errors",
                "Scrub errors the up OSDs found since they started (sum of their counters).",
            )?)?,
            api_requests: register(IntCounterVec::new(
                Opts::new(
                    "flame_mgr_api_requests_total",
                    "API requests by route (method and path template) and HTTP status.",
                ),
                &["route", "status"],
            )?)?,
            auth_refusals: register(IntCounterVec::new(
                Opts::new(
                    "flame_mgr_auth_refusals_total",
                    "API requests refused by authentication, by reason (missing, \
                     malformed, unknown_entity, rotated_key, bad_signature, replayed, \
                     replay_window_full, clock, forbidden, other_osd).",
                ),
                &["reason"],
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

    /// Sets the map gauges from `state` and its placement table `pgs`; called
    /// right before rendering.
    pub fn refresh(&self, state: &ClusterState, pgs: &PgTable, now: Instant) {
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
            .with_label_values(&["down"])
            .set(count(map.osds.values().filter(|o| !o.up).count()));
        self.osds
            .with_label_values(&["in"])
            .set(count(map.osds.values().filter(|o| o.r#in).count()));
        self.osds
            .with_label_values(&["out"])
            .set(count(map.osds.values().filter(|o| !o.r#in).count()));
        self.volumes.set(count(map.volumes.len()));
        // The status computation holds the one definition of these sums.
        let st = state.status(pgs, now);
        self.provisioned_bytes.set(clamp(st.provisioned_bytes));
        self.used_bytes.set(clamp(st.used_bytes));
        // A state no group is in any more must not keep its last count: start
        // from nothing. `active+clean` is always exported, so a dashboard has a
        // series even when every group is elsewhere.
        self.pgs.reset();
        self.pgs.with_label_values(&["active+clean"]).set(0);
        for (state_name, n) in &st.pgs_by_state {
            self.pgs
                .with_label_values(&[state_name.as_str()])
                .set(i64::from(*n));
        }
        self.pgs_degraded.set(i64::from(st.pg_summary.degraded));
        self.pgs_inactive.set(i64::from(st.pg_summary.inactive));
        self.objects_to_recover
            .set(clamp(st.recovery.objects_to_recover));
        let r = &st.recovery;
        self.objects.set(clamp(r.objects));
        for (state, n) in [
            ("expected", r.object_copies),
            ("degraded", r.degraded_copies),
            ("misplaced", r.misplaced_copies),
            ("recovering", r.recovering_copies),
        ] {
            self.object_copies.with_label_values(&[state]).set(clamp(n));
        }
        self.pgs_uncounted.set(i64::from(r.pgs_uncounted));
        self.recovery_bytes_per_second
            .set(st.recovery.bytes_per_second);
        self.recovery_objects_per_second
            .set(st.recovery.objects_per_second);
        self.scrub_errors.set(clamp(st.recovery.scrub_errors));
    }
}
