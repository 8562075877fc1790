//! The cluster handle: the current map, kept fresh by background threads.
//!
//! Clients compute placement themselves from the map, so the one thing the client
//! needs from the manager is the newest map, quickly. Two plain threads keep it:
//!
//! * the **watcher** long-polls `GET /v1/map?min_epoch=<current+1>&wait_ms=...`, so
//!   a new epoch arrives as soon as the manager publishes it. A manager that ignores
//!   the long-poll parameters answers at once with the map it has; the watcher then
//!   waits `map_refresh_ms` before asking again, which degrades to plain polling.
//! * the **refresher** serves on-demand refreshes ([`Cluster::request_map_refresh`]):
//!   when an OSD answers ESTALE the data path must not wait up to a long poll's
//!   duration, so this thread does an immediate `GET /v1/map`. Requests that arrive
//!   while a fetch is running are coalesced into the next one, and fetches are
//!   spaced at least [`REFRESH_INTERVAL_MIN`] apart, so a storm of ESTALE replies
//!   costs the manager a bounded number of requests.
//!
//! Both publish through an [`ArcSwap`], so the data path reads the map with one
//! atomic load and no lock, from any thread. A map is published only if its epoch is
//! newer, its fsid is this cluster's and its pool settings are valid: placement
//! must never run over a map it cannot trust.

use crate::config::ClientConfig;
use crate::error::ClientError;
use crate::mgr_client::MgrClient;
use arc_swap::ArcSwap;
use flame_common::auth::SessionTicket;
use flame_common::clock;
use flame_common::ids::{Epoch, OpId};
use flame_common::map::{ClusterMap, VolumeInfo};
use flame_common::reactor;
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Smallest spacing of two on-demand map fetches.
pub const REFRESH_INTERVAL_MIN: Duration = Duration::from_millis(20);
/// Longest a data-path task waits for an on-demand refresh before carrying on with
/// the map it has (the retry loop will come back).
const REFRESH_WAIT_MAX: Duration = Duration::from_secs(2);

/// The ticket this client opens OSD connections with (`None`: the cluster runs
/// without authentication). Read once per new connection, never per I/O.
pub(crate) type Tickets = arc_swap::ArcSwapOption<ClientTicket>;

/// Shortest spacing of two ticket renewals asked for by refusals: a client whose
/// key was removed must not flood the manager.
const TICKET_RENEW_INTERVAL_MIN: Duration = Duration::from_secs(5);

/// A ticket, and whether an OSD refused it (then the next map refresh renews
/// it: an `osd` key rotation, or a clock that jumped, must not wait for the
/// half-life renewal).
#[derive(Debug)]
pub(crate) struct ClientTicket {
    pub ticket: SessionTicket,
    pub refused: AtomicBool,
}

impl ClientTicket {
    fn new(ticket: SessionTicket) -> Arc<ClientTicket> {
        Arc::new(ClientTicket {
            ticket,
            refused: AtomicBool::new(false),
        })
    }
}

/// Gives every `Cluster` a process-unique number, so per-thread connection tables
/// never mix up two clusters' OSDs that happen to share ids.
static NEXT_UID: AtomicU64 = AtomicU64::new(1);

/// A connection to one Flame cluster. Cheap to clone and shareable between threads;
/// the data path ([`Cluster::open_volume`], [`Volume`](crate::Volume)) must run on a
/// `flame_common::reactor` thread.
#[derive(Clone)]
pub struct Cluster {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("mgr", &self.inner.shared.mgr.base())
            .field("epoch", &self.inner.shared.map.load().epoch)
            .finish()
    }
}

/// Owned by the `Cluster` clones only: dropping the last one stops the threads.
struct Inner {
    shared: Arc<Shared>,
    uid: u64,
    /// This client instance's op session ([`OpId::session`]): random, non-zero.
    op_session: u64,
    /// The last op sequence number handed out ([`Cluster::next_op`]).
    op_seq: AtomicU64,
    /// The lineage of `config.instance` (`flame_common::lineage`), if set.
    lineage: Option<u64>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        // Notify under each condvar's mutex, so a thread between its check of `stop`
        // and its wait cannot miss the wake-up.
        {
            let _g = self.shared.refresh_requested.lock();
            self.shared.refresh_cv.notify_all();
        }
        let _g = self.shared.stop_lock.lock();
        self.shared.stop_cv.notify_all();
    }
}

/// What the background threads share with the handles.
struct Shared {
    config: ClientConfig,
    mgr: MgrClient,
    fsid: String,
    map: ArcSwap<ClusterMap>,
    /// The current ticket (renewed by the watcher when half its life is gone,
    /// by the refresher when an OSD refused it).
    tickets: Tickets,
    /// When a renewal was last tried.
    last_renewal: Mutex<Option<Instant>>,
    /// Serializes the compare-and-publish of the two writer threads.
    publish_lock: Mutex<()>,
    /// Highest refresh ticket handed out.
    refresh_requested: Mutex<u64>,
    refresh_cv: Condvar,
    /// Highest ticket whose fetch attempt has finished (successfully or not).
    refresh_done: AtomicU64,
    /// An OSD that answered with a newer epoch than ours, and that epoch: the
    /// data path asks it for its map ([`Cluster::take_newer_map_source`]).
    newer_map_at: Mutex<Option<(Epoch, crate::connection::Target)>>,
    /// The highest epoch an OSD was asked for (or is being asked for): a burst
    /// of stale replies under one epoch makes one request, not one per piece.
    newer_map_asked: AtomicU64,
    stop: AtomicBool,
    stop_lock: Mutex<()>,
    stop_cv: Condvar,
}

impl Shared {
    fn new(
        config: ClientConfig,
        mgr: MgrClient,
        map: ClusterMap,
        ticket: Option<SessionTicket>,
    ) -> Arc<Shared> {
        Arc::new(Shared {
            fsid: map.fsid.clone(),
            map: ArcSwap::from_pointee(map),
            tickets: Tickets::from(ticket.map(ClientTicket::new)),
            last_renewal: Mutex::new(None),
            config,
            mgr,
            publish_lock: Mutex::new(()),
            refresh_requested: Mutex::new(0),
            refresh_cv: Condvar::new(),
            refresh_done: AtomicU64::new(0),
            newer_map_at: Mutex::new(None),
            newer_map_asked: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            stop_lock: Mutex::new(()),
            stop_cv: Condvar::new(),
        })
    }

    /// Publishes `map` if it is newer and trustworthy. Returns whether it was.
    fn publish(&self, map: ClusterMap) -> bool {
        if map.fsid != self.fsid {
            tracing::error!(
                expected = %self.fsid, got = %map.fsid,
                "manager served a map of another cluster; ignoring it"
            );
            return false;
        }
        if let Err((key, msg)) = map.pool.validate() {
            tracing::error!(%key, %msg, epoch = %map.epoch, "manager served an invalid map; ignoring it");
            return false;
        }
        let _g = self.publish_lock.lock();
        let cur = self.map.load();
        if map.epoch <= cur.epoch {
            return false;
        }
        tracing::debug!(from = %cur.epoch, to = %map.epoch, "new cluster map");
        self.map.store(Arc::new(map));
        true
    }

    /// Fetches a new ticket once half of the current one's life is gone (every
    /// watcher round checks; a failure keeps the old one and says so).
    fn renew_ticket_if_due(&self) {
        let due = self.tickets.load().as_ref().is_some_and(|t| {
            let since_last_renewal = self.last_renewal.lock().map(clock::elapsed);
            renewal_due(
                &t.ticket.claims,
                t.refused.load(Ordering::Acquire),
                since_last_renewal,
                clock::unix_ms(),
            )
        });
        if !due {
            return;
        }
        *self.last_renewal.lock() = Some(clock::now());
        match self.mgr.ticket() {
            Ok(Some(t)) => {
                tracing::debug!(entity = %t.claims.entity, expires_ms = t.claims.expires_ms, "ticket renewed");
                self.tickets.store(Some(ClientTicket::new(t)));
            }
            Ok(None) => tracing::warn!("the manager issues no tickets any more (auth: none?)"),
            Err(e) => {
                tracing::warn!(error = %e, "cannot renew the ticket; keeping the current one")
            }
        }
    }

    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Sleeps up to `d`, waking early when the cluster is dropped.
    fn sleep(&self, d: Duration) {
        let mut g = self.stop_lock.lock();
        if !self.stopped() {
            self.stop_cv.wait_for(&mut g, d);
        }
    }
}

/// Whether a ticket should be renewed now: from half its lifetime on (so an
/// outage of the manager shorter than the other half costs nothing), or at once
/// when an OSD refused it — but then at most every
/// [`TICKET_RENEW_INTERVAL_MIN`] (`since_last_renewal`: `None` when this client
/// never renewed), so a refusing OSD cannot make it hammer the manager. A ticket
/// issued after it expires (a bad clock) is due at once.
fn renewal_due(
    claims: &flame_common::auth::TicketClaims,
    refused: bool,
    since_last_renewal: Option<Duration>,
    now_ms: u64,
) -> bool {
    let half = (claims.expires_ms - claims.issued_ms.min(claims.expires_ms)) / 2;
    let refused_and_free =
        refused && since_last_renewal.is_none_or(|d| d >= TICKET_RENEW_INTERVAL_MIN);
    refused_and_free || now_ms >= claims.issued_ms.saturating_add(half)
}

/// Checks a freshly fetched first map.
fn check_first_map(map: &ClusterMap) -> Result<(), ClientError> {
    map.pool.validate().map_err(|(key, msg)| ClientError::Mgr {
        url: "/v1/map".into(),
        message: format!("the map's {key} is invalid: {msg}"),
    })
}

impl Cluster {
    /// Fetches the map from the manager and starts the threads that keep it fresh.
    /// Blocking (one HTTP call): call it at start-up, not on a reactor thread.
    pub fn connect(config: ClientConfig) -> Result<Cluster, ClientError> {
        config.validate()?;
        let lineage = config
            .instance
            .as_deref()
            .map(flame_common::lineage::lineage_of_name);
        let mgr = config.mgr_client()?;
        let map = mgr.map()?;
        check_first_map(&map)?;
        let ticket = mgr.ticket()?;
        let shared = Shared::new(config, mgr, map, ticket);
        let spawn = |name: &str, f: fn(Arc<Shared>)| {
            let s = shared.clone();
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || f(s))
                .map_err(|source| ClientError::Io {
                    context: format!("starting thread {name}"),
                    source,
                })
        };
        spawn("flame-map-watch", watch_loop)?;
        spawn("flame-map-fetch", refresh_loop)?;
        Ok(Cluster {
            inner: Arc::new(Inner {
                shared,
                uid: NEXT_UID.fetch_add(1, Ordering::Relaxed),
                op_session: new_op_session(),
                op_seq: AtomicU64::new(0),
                lineage,
            }),
        })
    }

    /// A handle for the deterministic simulator: no threads and no manager
    /// connection. It starts with `map`, the simulator publishes newer maps with
    /// [`Cluster::publish_map`] and serves refresh requests
    /// ([`Cluster::pending_refresh`], [`Cluster::refresh_served`]) in virtual
    /// time; `op_session` replaces the random session so a seed replays exactly.
    pub fn simulated(
        config: ClientConfig,
        map: ClusterMap,
        op_session: u64,
    ) -> Result<Cluster, ClientError> {
        config.validate()?;
        let lineage = config
            .instance
            .as_deref()
            .map(flame_common::lineage::lineage_of_name);
        check_first_map(&map)?;
        let mgr = MgrClient::new_from(&config.mgr, config.bind_addr, None)?;
        let shared = Shared::new(config, mgr, map, None);
        Ok(Cluster {
            inner: Arc::new(Inner {
                shared,
                // Drawn from the seed, not the process's counter: a seed's run
                // must not depend on the runs before it in the process.
                uid: flame_common::entropy::u64(),
                op_session: op_session.max(1),
                op_seq: AtomicU64::new(0),
                lineage,
            }),
        })
    }

    /// Replaces the ticket new OSD connections are opened with (the simulator's
    /// manager issues them; the watcher renews them otherwise).
    pub fn set_ticket(&self, ticket: Option<SessionTicket>) {
        self.inner
            .shared
            .tickets
            .store(ticket.map(ClientTicket::new));
    }

    /// The ticket holder, read by the connection table when it connects.
    pub(crate) fn tickets(&self) -> &Tickets {
        &self.inner.shared.tickets
    }

    /// Publishes `map` if it is newer and valid (what the map threads do with a
    /// fetched map); returns whether it was. For the simulator.
    pub fn publish_map(&self, map: ClusterMap) -> bool {
        self.inner.shared.publish(map)
    }

    /// The newest refresh ticket not yet served, if any. For the simulator.
    pub fn pending_refresh(&self) -> Option<u64> {
        let requested = *self.inner.shared.refresh_requested.lock();
        (requested > self.inner.shared.refresh_done.load(Ordering::Acquire)).then_some(requested)
    }

    /// Marks refresh tickets up to `ticket` served (after the simulator published
    /// the manager's map, or failed to reach it).
    pub fn refresh_served(&self, ticket: u64) {
        self.inner
            .shared
            .refresh_done
            .fetch_max(ticket, Ordering::AcqRel);
    }

    /// The settings this handle was made with.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.shared.config
    }

    /// The manager client (admin operations).
    pub fn mgr(&self) -> &MgrClient {
        &self.inner.shared.mgr
    }

    /// The newest map this client has. Lock-free; callable from any thread.
    pub fn map(&self) -> Arc<ClusterMap> {
        self.inner.shared.map.load_full()
    }

    /// Runs `f` on the newest map without taking a reference count (the data
    /// path's per-request checks).
    pub fn with_map<R>(&self, f: impl FnOnce(&ClusterMap) -> R) -> R {
        f(&self.inner.shared.map.load())
    }

    /// The current epoch.
    pub fn epoch(&self) -> Epoch {
        self.inner.shared.map.load().epoch
    }

    /// A volume as the current map describes it.
    pub fn volume_info(&self, name: &str) -> Option<VolumeInfo> {
        self.inner.shared.map.load().volumes.get(name).cloned()
    }

    /// Asks the refresher thread for an immediate map fetch and returns a ticket that
    /// [`Cluster::refresh_map_now`] waits on. Never blocks (beyond a short mutex).
    pub fn request_map_refresh(&self) -> u64 {
        let s = &self.inner.shared;
        let mut req = s.refresh_requested.lock();
        *req += 1;
        let ticket = *req;
        drop(req);
        s.refresh_cv.notify_one();
        ticket
    }

    /// Notes an epoch seen in an OSD reply: a newer one than ours means our map is
    /// behind, so ask for a fresh one.
    pub(crate) fn note_epoch(&self, epoch: Epoch) {
        if epoch > self.epoch() {
            self.request_map_refresh();
        }
    }

    /// [`Cluster::note_epoch`] for a reply from `target`: a newer epoch also
    /// makes that OSD a source of the newer map, should the manager be out of
    /// reach (a client cut off from it).
    pub(crate) fn note_epoch_from(&self, epoch: Epoch, target: &crate::connection::Target) {
        if epoch > self.epoch() {
            let s = &self.inner.shared;
            let mut at = s.newer_map_at.lock();
            if epoch.0 > s.newer_map_asked.load(Ordering::Acquire)
                && at.as_ref().is_none_or(|(e, _)| *e < epoch)
            {
                *at = Some((epoch, *target));
            }
            drop(at);
            self.request_map_refresh();
        }
    }

    /// The OSD last seen with a newer map than ours, and its epoch; taken, so
    /// one task asks it. `None` when there is none or our map caught up.
    pub(crate) fn take_newer_map_source(&self) -> Option<(Epoch, crate::connection::Target)> {
        let s = &self.inner.shared;
        let at = s.newer_map_at.lock().take()?;
        s.newer_map_asked.fetch_max(at.0.0, Ordering::AcqRel);
        (at.0 > self.epoch()).then_some(at)
    }

    /// Publishes a map an OSD handed over (checked as the manager's are: this
    /// cluster's, newer, valid) and, if it was newer, counts every refresh asked
    /// for so far as served: the tasks waiting for the manager's map go on with
    /// this one. Returns whether it was published.
    pub(crate) fn publish_osd_map(&self, map: ClusterMap) -> bool {
        let s = &self.inner.shared;
        if !s.publish(map) {
            return false;
        }
        let requested = *s.refresh_requested.lock();
        s.refresh_done.fetch_max(requested, Ordering::AcqRel);
        true
    }

    /// Whether the fetch for `ticket` has been attempted.
    fn refreshed(&self, ticket: u64) -> bool {
        self.inner.shared.refresh_done.load(Ordering::Acquire) >= ticket
    }

    /// Fetches a fresh map now and returns the newest map (fresh or not, if the
    /// manager is unreachable). Must run on a reactor thread: it waits with reactor
    /// sleeps, never blocking the thread, and gives up after a bounded time.
    pub async fn refresh_map_now(&self) -> Arc<ClusterMap> {
        let ticket = self.request_map_refresh();
        self.wait_refreshed(ticket, clock::now() + REFRESH_WAIT_MAX)
            .await;
        self.map()
    }

    /// Waits (on the reactor) until `ticket` is served or `until` passes.
    pub(crate) async fn wait_refreshed(&self, ticket: u64, until: Instant) {
        let mut nap = Duration::from_millis(1);
        let until = until.min(clock::now() + REFRESH_WAIT_MAX);
        while !self.refreshed(ticket) {
            let now = clock::now();
            let Some(left) = until.checked_duration_since(now) else {
                return;
            };
            if left.is_zero() {
                return;
            }
            reactor::sleep(nap.min(left)).await;
            nap = (nap * 2).min(Duration::from_millis(8));
        }
    }

    /// Fetches the map on the calling thread (blocking; for tools and control
    /// threads, not the reactor) and returns the newest map.
    pub fn refresh_map_blocking(&self) -> Result<Arc<ClusterMap>, ClientError> {
        let map = self.inner.shared.mgr.map()?;
        self.inner.shared.publish(map);
        Ok(self.map())
    }

    /// Process-unique number of this cluster handle (connection-table key).
    pub(crate) fn uid(&self) -> u64 {
        self.inner.uid
    }

    /// The lineage its connections' sessions belong to (`None`: a random one
    /// per thread): the same across restarts when `instance` is set.
    pub(crate) fn lineage(&self) -> Option<u64> {
        self.inner.lineage
    }

    /// A new identity for one write, write-zeroes or discard: this instance's
    /// session and the next op sequence number. Taken once per operation and kept
    /// on every resend of it (to any OSD), so a primary can tell a retry from a new
    /// write; increasing in issue order across all threads of this instance, so a
    /// primary can tell an older write of this client from a newer one.
    pub(crate) fn next_op(&self) -> OpId {
        OpId {
            session: self.inner.op_session,
            seq: self.inner.op_seq.fetch_add(1, Ordering::Relaxed) + 1,
        }
    }

    /// This instance's op session ([`OpId::session`]).
    pub fn op_session(&self) -> u64 {
        self.inner.op_session
    }
}

/// A random, non-zero op session: two client instances (processes, or handles in
/// one process) must never share one, or one's writes could be taken for retries
/// or newer writes of the other.
fn new_op_session() -> u64 {
    rand::random::<u64>().max(1)
}

/// The watcher thread: long-polls for newer maps until the cluster is dropped.
fn watch_loop(s: Arc<Shared>) {
    let refresh = Duration::from_millis(s.config.map_refresh_ms);
    let mut failures: u32 = 0;
    while !s.stopped() {
        let started = clock::now();
        s.renew_ticket_if_due();
        let cur = s.map.load().epoch.0;
        match s.mgr.wait_map(cur + 1, s.config.map_wait_ms) {
            Ok(map) => {
                failures = 0;
                if s.publish(map) {
                    continue;
                }
            }
            Err(e) => {
                failures += 1;
                // First failure loudly, then every minute or so: the manager being
                // away is not an I/O error as long as the map stays valid.
                if failures == 1 || failures.is_multiple_of(60) {
                    tracing::warn!(error = %e, failures, "cannot fetch the cluster map");
                }
            }
        }
        if let Some(left) = refresh.checked_sub(clock::elapsed(started)) {
            s.sleep(left);
        }
    }
}

/// The refresher thread: serves on-demand refresh tickets.
fn refresh_loop(s: Arc<Shared>) {
    let mut served: u64 = 0;
    let mut last_fetch: Option<Instant> = None;
    loop {
        let ticket = {
            let mut req = s.refresh_requested.lock();
            while *req <= served && !s.stopped() {
                s.refresh_cv.wait(&mut req);
            }
            *req
        };
        if s.stopped() {
            return;
        }
        if let Some(t) = last_fetch
            && let Some(left) = REFRESH_INTERVAL_MIN.checked_sub(clock::elapsed(t))
        {
            clock::sleep_blocking(left);
        }
        // Every ticket handed out up to here is covered by this fetch.
        let ticket = ticket.max(*s.refresh_requested.lock());
        last_fetch = Some(clock::now());
        match s.mgr.map() {
            Ok(map) => {
                s.publish(map);
            }
            Err(e) => tracing::debug!(error = %e, "on-demand map refresh failed"),
        }
        // A refused ticket shows as failed connections, which ask for a
        // refresh: renew it here rather than at its half-life.
        s.renew_ticket_if_due();
        served = ticket;
        // Never backwards: an OSD's map may have served later tickets meanwhile
        // (`publish_osd_map`).
        s.refresh_done.fetch_max(ticket, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod renewal_tests {
    use super::*;
    use flame_common::auth::{EntityName, Role, TicketClaims, VolumePatterns};

    fn claims(issued_ms: u64, expires_ms: u64) -> TicketClaims {
        TicketClaims {
            entity: EntityName::parse("client.t").unwrap(),
            role: Role::Client,
            service_generation: 1,
            issued_ms,
            expires_ms,
            volumes: VolumePatterns::default(),
        }
    }

    #[test]
    fn a_ticket_is_renewed_from_half_its_lifetime_on() {
        let c = claims(1_000, 3_601_000);
        assert!(!renewal_due(&c, false, None, 1_000));
        assert!(!renewal_due(&c, false, None, 1_800_999));
        assert!(renewal_due(&c, false, None, 1_801_000), "half-life");
        assert!(
            renewal_due(&c, false, Some(Duration::ZERO), 4_000_000),
            "expired"
        );
    }

    #[test]
    fn a_refused_ticket_is_renewed_at_once_but_not_more_often_than_the_minimum_interval() {
        let c = claims(1_000, 3_601_000);
        assert!(renewal_due(&c, true, None, 2_000), "never renewed: at once");
        assert!(renewal_due(
            &c,
            true,
            Some(TICKET_RENEW_INTERVAL_MIN),
            2_000
        ));
        assert!(
            !renewal_due(&c, true, Some(Duration::from_secs(1)), 2_000),
            "renewed a second ago: wait"
        );
        assert!(
            renewal_due(&c, true, Some(Duration::from_secs(1)), 1_801_000),
            "half-life wins over the interval"
        );
    }

    #[test]
    fn a_ticket_issued_after_its_expiry_is_due_at_once() {
        assert!(renewal_due(&claims(5_000, 4_000), false, None, 5_000));
    }
}

#[cfg(test)]
mod osd_map_tests {
    use super::*;
    use crate::connection::{ConnKey, Target};
    use flame_common::ids::OsdId;
    use flame_common::map::PoolConfig;
    use flame_common::transport::TransportKind;

    fn target(osd: u32) -> Target {
        Target {
            key: ConnKey {
                cluster: 1,
                osd: OsdId(osd),
                shard: 0,
            },
            addr: "127.0.0.1:6900".parse().unwrap(),
            transport: TransportKind::Tcp,
            source: None,
            timeout: Duration::from_secs(1),
            epoch: Epoch(5),
            shards: 1,
            fetch: None,
            lineage: None,
        }
    }

    fn map_at(epoch: u64) -> ClusterMap {
        let mut m = ClusterMap::new("f".into(), PoolConfig::default());
        m.epoch = Epoch(epoch);
        m
    }

    #[test]
    fn a_newer_epoch_is_asked_of_one_osd_once() {
        let c = Cluster::simulated(ClientConfig::default(), map_at(5), 1).unwrap();
        c.note_epoch_from(Epoch(5), &target(1));
        assert!(c.take_newer_map_source().is_none(), "not newer than ours");
        c.note_epoch_from(Epoch(7), &target(1));
        c.note_epoch_from(Epoch(6), &target(2));
        let (epoch, t) = c.take_newer_map_source().unwrap();
        assert_eq!((epoch, t.key.osd), (Epoch(7), OsdId(1)), "the newest seen");
        assert!(c.take_newer_map_source().is_none(), "taken: one task asks");
        // More stale replies under the epoch already asked for: no second request.
        c.note_epoch_from(Epoch(7), &target(3));
        assert!(c.take_newer_map_source().is_none());
        c.note_epoch_from(Epoch(8), &target(3));
        assert_eq!(c.take_newer_map_source().map(|(e, _)| e), Some(Epoch(8)));
    }

    #[test]
    fn an_osds_map_is_checked_as_the_managers_and_serves_the_waiting_refreshes() {
        let c = Cluster::simulated(ClientConfig::default(), map_at(5), 1).unwrap();
        let ticket = c.request_map_refresh();
        let mut foreign = map_at(7);
        foreign.fsid = "another cluster".into();
        assert!(!c.publish_osd_map(foreign));
        assert!(!c.publish_osd_map(map_at(5)), "not newer");
        assert_eq!(c.epoch(), Epoch(5));
        assert!(
            !c.refreshed(ticket),
            "nothing published: the refresh still waits"
        );
        assert!(c.publish_osd_map(map_at(7)));
        assert_eq!(c.epoch(), Epoch(7));
        assert!(
            c.refreshed(ticket),
            "a newer map serves the waiting refresh"
        );
    }
}
