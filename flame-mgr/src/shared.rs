//! The state shared by all request handlers, and the one way to change it.
//!
//! Every change goes through [`Shared::commit`], which (1) applies the operation to
//! a *copy* of the state under the state lock, (2) if the epoch moved, writes the
//! copy to disk with fsync, and only then (3) installs the copy and publishes the
//! new map. Hence:
//! - nothing is acknowledged, served or published before it is durable;
//! - a failed write leaves the old state in place (memory and disk agree);
//! - changes are persisted in the order they were made (the lock is held across
//!   the write, so a newer state can never be overwritten by an older one).
//!
//! Heartbeats first: what keeps the OSDs' leases alive (boot, heartbeat, failure
//! and recovery reports) goes straight to the state lock ([`Shared::commit`]);
//! everything an API client can flood (admin changes, [`Shared::commit_admin`],
//! and state snapshots for status, placement groups and metrics) first takes the
//! one low-priority permit, so at most one of them is ever queued on the lock and
//! an OSD's heartbeat waits behind at most one such operation (and other
//! heartbeats), whatever the API load.
//!
//! The work runs on a blocking thread (`spawn_blocking`), not in the request's
//! future: if the client hangs up mid-request, axum drops the future, but a save
//! that has started always finishes and is installed, so memory never falls behind
//! the disk.

use crate::auth::{AuthTable, Verifier};
use crate::state::{ClusterState, StateError};
use crate::store::{Store, StoreError};
use flame_common::ids::Epoch;
use flame_common::map::ClusterMap;
use flame_common::placement::PgTable;
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::{Mutex, watch};

/// Why a change or query failed.
#[derive(Debug, thiserror::Error)]
pub enum MgrError {
    /// The operation was refused; nothing changed.
    #[error(transparent)]
    State(#[from] StateError),
    /// The change could not be made durable; nothing changed.
    #[error("cannot persist the cluster state: {0}")]
    Store(#[from] StoreError),
    /// A worker thread failed (a bug); nothing changed.
    #[error("internal error: {0}")]
    Internal(String),
}

/// Every placement group's roles in one map (placed, acting, recovering...).
pub type ActingSets = Arc<PgTable>;

/// Everything the HTTP handlers and the failure detector share.
pub struct Shared {
    /// The live state. Holders of the lock only ever see durable state.
    state: Mutex<ClusterState>,
    store: Store,
    /// The latest durable map; GET /v1/map reads it without taking the state lock,
    /// and long-polls wait on it.
    map_tx: watch::Sender<Arc<ClusterMap>>,
    /// Placement-group roles of one epoch: computing them costs `pg_count × osds`
    /// hashes, and they only change with the map.
    acting_cache: parking_lot::Mutex<Option<(Epoch, ActingSets)>>,
    /// Prometheus metrics.
    pub metrics: crate::metrics::Metrics,
    /// The entity table as last committed; the authentication middleware reads it
    /// without the state lock.
    auth_tx: watch::Sender<Arc<AuthTable>>,
    /// The cluster secret and replay guard; `None` with `auth: none`.
    pub verifier: Option<parking_lot::Mutex<Verifier>>,
    /// The one permit of low-priority work on the state lock (see the module doc).
    low_priority: tokio::sync::Semaphore,
    /// How long a signed request's body may take to arrive once its headers
    /// did (`header_read_timeout_ms`: hyper bounds only the head).
    pub body_read_timeout: std::time::Duration,
}

impl Shared {
    /// Wraps a state that is already on disk.
    /// `verifier` is `None` when the manager runs with `auth: none`.
    pub fn new(
        store: Store,
        state: ClusterState,
        metrics: crate::metrics::Metrics,
        verifier: Option<Verifier>,
        body_read_timeout: std::time::Duration,
    ) -> Arc<Self> {
        let (map_tx, _) = watch::channel(Arc::new(state.map().clone()));
        let (auth_tx, _) = watch::channel(Arc::new(state.persisted.auth.clone()));
        Arc::new(Shared {
            state: Mutex::new(state),
            store,
            map_tx,
            acting_cache: parking_lot::Mutex::new(None),
            metrics,
            auth_tx,
            verifier: verifier.map(parking_lot::Mutex::new),
            low_priority: tokio::sync::Semaphore::new(1),
            body_read_timeout,
        })
    }

    /// The entity table as last committed.
    pub fn auth_table(&self) -> Arc<AuthTable> {
        self.auth_tx.borrow().clone()
    }

    /// [`Shared::commit`] for what an API client asks (volumes, OSD in/out and
    /// weights, entities): behind the low-priority permit, so a flood of them
    /// never queues more than one ahead of the OSDs' heartbeats.
    pub async fn commit_admin<T, F>(self: &Arc<Self>, op: F) -> Result<T, MgrError>
    where
        T: Send + 'static,
        F: FnOnce(&mut ClusterState, Instant) -> Result<T, StateError> + Send + 'static,
    {
        let _permit = self
            .low_priority
            .acquire()
            .await
            .map_err(|e| MgrError::Internal(format!("low-priority permit: {e}")))?;
        self.commit(op).await
    }

    /// Applies `op` (given the current time) durably; see the module doc. For
    /// what keeps OSDs alive; API changes use [`Shared::commit_admin`].
    pub async fn commit<T, F>(self: &Arc<Self>, op: F) -> Result<T, MgrError>
    where
        T: Send + 'static,
        F: FnOnce(&mut ClusterState, Instant) -> Result<T, StateError> + Send + 'static,
    {
        let shared = Arc::clone(self);
        tokio::task::spawn_blocking(move || shared.commit_blocking(op))
            .await
            .map_err(|e| MgrError::Internal(format!("state update task failed: {e}")))?
    }

    fn commit_blocking<T>(
        &self,
        op: impl FnOnce(&mut ClusterState, Instant) -> Result<T, StateError>,
    ) -> Result<T, MgrError> {
        let mut guard = self.state.blocking_lock();
        let mut next = guard.clone();
        // The clock is read under the lock so heartbeat times are monotonic in
        // commit order.
        let out = op(&mut next, flame_common::clock::now())?;
        let changed = next.epoch() != guard.epoch();
        if changed {
            self.store.save(&next.persisted)?;
        }
        *guard = next;
        if changed {
            self.map_tx.send_replace(Arc::new(guard.map().clone()));
            if **self.auth_tx.borrow() != guard.persisted.auth {
                self.auth_tx
                    .send_replace(Arc::new(guard.persisted.auth.clone()));
            }
        }
        Ok(out)
    }

    /// The latest durable map.
    pub fn map(&self) -> Arc<ClusterMap> {
        self.map_tx.borrow().clone()
    }

    /// Waits until the map epoch reaches `min_epoch` or `wait` passes, and returns
    /// the map as it is then (possibly older than `min_epoch`).
    pub async fn wait_map(&self, min_epoch: Epoch, wait: std::time::Duration) -> Arc<ClusterMap> {
        let mut rx = self.map_tx.subscribe();
        // Err (timeout, or the sender gone at shutdown) just means "reply now".
        let _ = tokio::time::timeout(wait, rx.wait_for(|m| m.epoch >= min_epoch)).await;
        rx.borrow().clone()
    }

    /// A consistent copy of the state with the placement-group roles of its map.
    pub async fn snapshot(&self) -> Result<(ClusterState, ActingSets), MgrError> {
        let snap = {
            let _permit = self
                .low_priority
                .acquire()
                .await
                .map_err(|e| MgrError::Internal(format!("low-priority permit: {e}")))?;
            self.state.lock().await.clone()
        };
        let acting = self.acting_sets(snap.map()).await?;
        Ok((snap, acting))
    }

    async fn acting_sets(&self, map: &ClusterMap) -> Result<ActingSets, MgrError> {
        if let Some((epoch, sets)) = &*self.acting_cache.lock()
            && *epoch == map.epoch
        {
            return Ok(Arc::clone(sets));
        }
        let m = map.clone();
        let sets = Arc::new(
            tokio::task::spawn_blocking(move || PgTable::new(&m))
                .await
                .map_err(|e| MgrError::Internal(format!("placement task failed: {e}")))?,
        );
        *self.acting_cache.lock() = Some((map.epoch, Arc::clone(&sets)));
        Ok(sets)
    }

    /// Refreshes the map gauges and renders every metric.
    pub async fn render_metrics(&self) -> String {
        match self.snapshot().await {
            Ok((state, pgs)) => self
                .metrics
                .refresh(&state, &pgs, flame_common::clock::now()),
            // The gauges keep their last values; the scrape still answers.
            Err(e) => tracing::error!("metrics: cannot compute placement: {e}"),
        }
        flame_common::metrics::render()
    }
}
