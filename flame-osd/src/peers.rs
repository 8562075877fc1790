//! Connections from this shard to the shards of other OSDs, for replication.
//!
//! Each shard owns its own peer connections (the penetrating model: the thread that
//! took a client's write also drives its replication and sees the replicas' replies),
//! one per (OSD, shard). Requests on a peer connection are matched to replies by
//! the same multiplexer as a client's ([`flame_common::calls`]: bounded in
//! requests and bytes, replies checked against their requests); a connection
//! failure fails every request waiting on it, and the primary answers its client
//! with EAGAIN so the client retries.

use crate::liveness::Liveness;
use crate::metrics::ShardMetrics;
use crate::service_key::ServiceKeys;
use flame_common::auth::handshake::{self, HelloBinding};
use flame_common::auth::{EntityName, Role, TICKET_LIFETIME_MS};
use flame_common::calls::{CallFailed, CallLimits, Calls};
use flame_common::clock;
use flame_common::collections::HashMap;
use flame_common::ids::{Epoch, OsdId, RequestId};
use flame_common::map::OsdInfo;
use flame_common::protocol::{Message, status};
use flame_common::reactor;
use flame_common::transport::{Conn, TransportKind};
use std::cell::{Cell, RefCell};
use std::convert::Infallible;

use std::net::IpAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

/// A replication connection may have this many times a client's in-flight
/// bound: it carries the writes of every client of the sending shard. The
/// receiving shard gives it as much room.
pub(crate) const PEER_INFLIGHT_FACTOR: u32 = 16;

/// Payload bytes one replication connection has waiting for replies at most
/// (a larger request goes alone); beyond, forwards wait here for room.
pub const PEER_PENDING_BYTES_MAX: u64 = 64 << 20;

/// One connection to a peer shard: its requests, each waiting for its reply
/// (nothing is kept for an abandoned one: a replica is never granted memory).
pub struct Peer {
    calls: Calls<Message, Infallible>,
}

/// Peer connections of one shard.
pub struct Peers {
    transport: TransportKind,
    /// Local address peer connections leave from (the OSD's own).
    source: Option<IpAddr>,
    connect_timeout: Duration,
    call_timeout: Duration,
    /// How much each connection may have waiting for replies.
    limits: CallLimits,
    conns: RefCell<HashMap<(OsdId, u16), Rc<Peer>>>,
    /// Peers being connected: later callers wait for the first attempt rather than
    /// opening a second connection (one connection keeps one order).
    connecting: RefCell<HashMap<(OsdId, u16), Rc<crate::ordering::Event>>>,
    metrics: Rc<ShardMetrics>,
    /// This shard's replication session (random per process and shard), and the
    /// generation of its newest connection: a replica stops executing requests from
    /// a connection this shard has replaced, so a forward that timed out here and was
    /// resent on a new connection can never be overtaken by its stale original.
    session: u64,
    generation: Cell<u64>,
    /// Where unreachable peers are noted (the control thread reports them) and
    /// newer epochs seen in replies are asked for.
    liveness: Arc<Liveness>,
    /// The service key this OSD mints its own peer tickets with (`None`: no
    /// keyring, unauthenticated HELLOs).
    service: Option<ServiceKeys>,
    /// The entity those tickets name: this OSD's own (`osd.N`), so a replica
    /// knows which OSD a replication connection speaks for.
    me: EntityName,
}

/// One task's attempt to connect to a peer shard, noted in
/// [`Peers::connecting`] so that other callers wait for it rather than open a
/// second connection. It ends when dropped — its note removed, its waiters woken
/// — however the attempt ends, also when the task making it is cancelled
/// mid-connect (recovery drops the sibling copies of an object batch one of
/// which failed). Ending it only after the awaited connect returned left a
/// cancelled attempt's note behind for good: every later call to that peer
/// waited on it forever, and the shard's recovery loop with it (seed 109).
struct ConnectAttempt<'a> {
    connecting: &'a RefCell<HashMap<(OsdId, u16), Rc<crate::ordering::Event>>>,
    key: (OsdId, u16),
    done: Rc<crate::ordering::Event>,
}

impl<'a> ConnectAttempt<'a> {
    fn start(
        connecting: &'a RefCell<HashMap<(OsdId, u16), Rc<crate::ordering::Event>>>,
        key: (OsdId, u16),
    ) -> ConnectAttempt<'a> {
        let done = Rc::new(crate::ordering::Event::default());
        connecting.borrow_mut().insert(key, done.clone());
        ConnectAttempt {
            connecting,
            key,
            done,
        }
    }
}

impl Drop for ConnectAttempt<'_> {
    fn drop(&mut self) {
        let mut connecting = self.connecting.borrow_mut();
        if connecting
            .get(&self.key)
            .is_some_and(|e| Rc::ptr_eq(e, &self.done))
        {
            connecting.remove(&self.key);
        }
        drop(connecting);
        self.done.set();
    }
}

impl Peers {
    /// No connections yet; they open on first use. `max_inflight` is a
    /// client connection's in-flight bound (`max_inflight_per_connection`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        transport: TransportKind,
        source: Option<IpAddr>,
        connect_timeout: Duration,
        call_timeout: Duration,
        max_inflight: u32,
        metrics: Rc<ShardMetrics>,
        liveness: Arc<Liveness>,
        service: Option<ServiceKeys>,
        me: OsdId,
    ) -> Peers {
        let in_flight_max = max_inflight.saturating_mul(PEER_INFLIGHT_FACTOR).max(1) as usize;
        Peers {
            me: EntityName::of_osd(me),
            limits: CallLimits {
                in_flight_max,
                bytes_max: PEER_PENDING_BYTES_MAX,
                abandoned_max: in_flight_max,
            },
            service,
            transport,
            source,
            liveness,
            connect_timeout,
            call_timeout,
            conns: RefCell::new(HashMap::default()),
            connecting: RefCell::new(HashMap::default()),
            metrics,
            session: flame_common::entropy::u64() | 1,
            generation: Cell::new(0),
        }
    }

    /// Sends `msg` to shard `shard` of `osd` and waits for the reply's status.
    /// Connection problems and timeouts come back as EAGAIN.
    pub async fn call(
        self: &Rc<Self>,
        osd: &OsdInfo,
        shard: u16,
        epoch: Epoch,
        msg: Message,
    ) -> i32 {
        match self.call_reply(osd, shard, epoch, msg).await {
            Ok(Message::Reply { status, .. }) => status,
            Ok(_) => status::EIO,
            Err(st) => st,
        }
    }

    /// Like [`Peers::call`], but returns the whole reply (a read's data), or the
    /// status that stands for a failed call (EAGAIN: no connection or no answer).
    pub async fn call_reply(
        self: &Rc<Self>,
        osd: &OsdInfo,
        shard: u16,
        epoch: Epoch,
        msg: Message,
    ) -> Result<Message, i32> {
        self.call_reply_until(osd, shard, epoch, msg, std::future::pending())
            .await
    }

    /// Like [`Peers::call_reply`], but gives up with EAGAIN as soon as `give_up`
    /// completes (the replica left the write set in a newer map: a black-holed
    /// peer must not hold the client's write for the whole `replica_timeout_ms`).
    pub async fn call_reply_until(
        self: &Rc<Self>,
        osd: &OsdInfo,
        shard: u16,
        epoch: Epoch,
        msg: Message,
        give_up: impl std::future::Future<Output = ()>,
    ) -> Result<Message, i32> {
        let peer = match self.get(osd, shard, epoch).await {
            Ok(p) => p,
            Err(()) => return Err(status::EAGAIN),
        };
        let mut msg = msg;
        msg.set_id(peer.calls.next_id(None));
        // Only writes (a primary's forwards and recovery's copies): the
        // listing and checksum traffic of recovery and scrub, which a primary
        // also starts at boot, would otherwise use up a counted failpoint
        // before the write a test aims it at.
        let bytes = match &msg {
            Message::Write { data, .. } => Some(data.len() as u64),
            Message::WriteZeroes { .. } | Message::Discard { .. } => Some(0),
            _ => None,
        };
        if bytes.is_some()
            && let Err(e) = crate::failpoints::check("peer_send")
        {
            // As a failed send on a real socket: the connection is gone, and
            // every request waiting on it fails (the primary answers EAGAIN and
            // the client resends).
            tracing::warn!(osd = %osd.id, shard, "peer send failed: {e}");
            peer.calls
                .fail(CallFailed(format!("peer send failed: {e}")));
            self.drop_peer(osd.id, shard, &peer);
            return Err(status::EAGAIN);
        }
        /// How a call ended, short of its reply.
        enum Ended {
            Reply(Message),
            /// The send failed (the connection is failing already).
            NotSent,
            /// The connection failed, or the call timed out (also while waiting
            /// for room): the replica is not answering.
            Lost,
            /// The caller gave up: the connection stays (the peer may be fine,
            /// only no longer needed); a late reply finds no waiter.
            Abandoned,
        }
        let timeout = self.call_timeout;
        let exchange = async {
            match peer.calls.start(msg, bytes.unwrap_or(0), None).await {
                Ok(call) => match call.reply().await {
                    Ok(m) => Ended::Reply(m),
                    Err(_) => Ended::Lost,
                },
                Err(_) => Ended::NotSent,
            }
        };
        let expire = async {
            reactor::sleep(timeout).await;
            Ended::Lost
        };
        let abandon = async {
            give_up.await;
            Ended::Abandoned
        };
        match futures_lite::future::or(futures_lite::future::or(exchange, expire), abandon).await {
            Ended::Reply(m) => Ok(m),
            Ended::NotSent | Ended::Abandoned => Err(status::EAGAIN),
            Ended::Lost => {
                // Timed out or the connection died: drop the connection so the next
                // call starts afresh, and tell the manager (it may be down).
                tracing::warn!(osd = %osd.id, shard, "replica did not answer; closing connection");
                self.drop_peer(osd.id, shard, &peer);
                self.liveness.peer_failed(osd.id);
                Err(status::EAGAIN)
            }
        }
    }

    fn drop_peer(&self, osd: OsdId, shard: u16, peer: &Rc<Peer>) {
        peer.calls
            .fail(CallFailed("replication connection dropped".into()));
        let mut conns = self.conns.borrow_mut();
        if conns
            .get(&(osd, shard))
            .is_some_and(|p| Rc::ptr_eq(p, peer))
        {
            conns.remove(&(osd, shard));
            self.metrics.peer_connections.dec();
        }
    }

    async fn get(self: &Rc<Self>, osd: &OsdInfo, shard: u16, epoch: Epoch) -> Result<Rc<Peer>, ()> {
        let key = (osd.id, shard);
        // Bounded: each round either returns or waits for another task's attempt,
        // which ends within connect_timeout (or when that task is cancelled).
        for _ in 0..4 {
            if let Some(p) = self.conns.borrow().get(&key)
                && !p.calls.is_failed()
                && !p.calls.conn().is_closed()
            {
                return Ok(p.clone());
            }
            let waiting = self.connecting.borrow().get(&key).cloned();
            if let Some(ev) = waiting {
                ev.wait().await;
                continue;
            }
            // Ended when dropped: also if this task is cancelled mid-connect.
            let _attempt = ConnectAttempt::start(&self.connecting, key);
            return self.connect(osd, shard, epoch).await;
        }
        Err(())
    }

    async fn connect(
        self: &Rc<Self>,
        osd: &OsdInfo,
        shard: u16,
        epoch: Epoch,
    ) -> Result<Rc<Peer>, ()> {
        let addr = osd.shard_addr(shard);
        let conn = match Conn::connect_from(self.transport, addr, self.source, self.connect_timeout)
            .await
        {
            Ok(c) => {
                // Replies (replica reads for repair and recovery) must not wait on
                // this shard's pool: see `Conn::set_never_wait_for_memory`.
                c.set_never_wait_for_memory(true);
                c
            }
            Err(e) => {
                tracing::debug!(osd = %osd.id, %addr, "peer connect failed: {e}");
                self.liveness.peer_failed(osd.id);
                return Err(());
            }
        };
        let binding = HelloBinding {
            osd: osd.id.0,
            shard,
            peer: true,
            session: self.session,
            generation: {
                let g = self.generation.get() + 1;
                self.generation.set(g);
                g
            },
        };
        // A ticket of its own per connection: this OSD holds the service key.
        let now_ms = clock::unix_ms();
        let auth = match &self.service {
            Some(keys) => {
                let ticket = keys
                    .current()
                    .issue(&self.me, Role::Osd, now_ms, TICKET_LIFETIME_MS);
                let auth =
                    handshake::hello_auth(&ticket, &binding, now_ms, handshake::hello_nonce());
                Some((ticket, auth))
            }
            None => None,
        };
        if conn
            .send(&Message::Hello {
                id: RequestId(0),
                epoch,
                versions: flame_common::protocol::VERSIONS,
                shard,
                peer: true,
                session: binding.session,
                generation: binding.generation,
                auth: auth.as_ref().map(|(_, a)| Box::new(a.clone())),
            })
            .is_err()
        {
            return Err(());
        }
        let hello = futures_lite::future::or(async { conn.recv().await.ok() }, async {
            reactor::sleep(self.connect_timeout).await;
            None
        })
        .await;
        match hello {
            Some(Message::HelloReply {
                status: 0, proof, ..
            }) if auth.as_ref().is_none_or(|(t, a)| {
                proof.is_some_and(|p| handshake::check_server_proof(t, &binding, a, &p))
            }) => {}
            Some(Message::HelloReply { status: 0, .. }) => {
                tracing::error!(osd = %osd.id, %addr, "peer answered without a valid proof of the OSD key (not this cluster's OSD, or one without its keyring); not using it");
                conn.close();
                return Err(());
            }
            None => {
                tracing::warn!(osd = %osd.id, %addr, "peer did not answer hello");
                self.liveness.peer_failed(osd.id);
                conn.close();
                return Err(());
            }
            other => {
                tracing::warn!(osd = %osd.id, %addr, "peer refused hello: {other:?}");
                conn.close();
                return Err(());
            }
        }
        let peer = Rc::new(Peer {
            calls: Calls::new(conn, self.limits),
        });
        let replaced = self
            .conns
            .borrow_mut()
            .insert((osd.id, shard), peer.clone());
        // A closed connection still in the table is replaced here; its reader will
        // not find itself in the table any more, so it is uncounted here instead.
        if replaced.is_none() {
            self.metrics.peer_connections.inc();
        }
        let me = self.clone();
        let osd_id = osd.id;
        let p = peer.clone();
        reactor::spawn(async move {
            loop {
                match p.calls.conn().recv().await {
                    Ok(reply @ Message::Reply { op, id, .. }) => {
                        if let Err(why) = p.calls.deliver(op, id, |_| reply) {
                            tracing::warn!(osd = %osd_id, shard, "replica broke the protocol: {why}; closing");
                            break;
                        }
                    }
                    Ok(other) => {
                        tracing::warn!(osd = %osd_id, "peer sent a request on a replication connection: {:?}", other.op());
                        break;
                    }
                    Err(_) => break,
                }
            }
            // Fail everything still waiting.
            me.drop_peer(osd_id, shard, &p);
        })
        .detach();
        Ok(peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::auth::{SecretKey, ServiceKey};
    use flame_common::reactor::{Reactor, ReactorConfig, spawn};
    use flame_common::transport::Listener;

    /// osd.3, one shard, listening at `addr`.
    fn replica_at(addr: std::net::SocketAddr) -> OsdInfo {
        OsdInfo {
            id: OsdId(3),
            addr,
            shards: 1,
            host: "h3".into(),
            weight: 1.0,
            up: true,
            up_from: Epoch(1),
            r#in: true,
            metrics_addr: None,
        }
    }

    /// osd.7's peer table over TCP, 300 ms timeouts.
    fn osd7_peers(keys: Option<ServiceKeys>) -> Rc<Peers> {
        Rc::new(Peers::new(
            TransportKind::Tcp,
            None,
            Duration::from_millis(300),
            Duration::from_millis(300),
            256,
            Rc::new(ShardMetrics::new(0)),
            Arc::new(Liveness::new(1)),
            keys,
            OsdId(7),
        ))
    }

    /// A replication connection's HELLO carries a ticket this OSD minted for
    /// its own entity (`osd.N`, role `osd`), which the replica's gate admits
    /// and names.
    #[test]
    fn a_peer_hello_speaks_for_this_osd() {
        let osd_key = SecretKey::from_hex(&"5a".repeat(32))
            .unwrap()
            .derive_entity_key(&EntityName::osd(), 1);
        let keys = ServiceKeys::new(ServiceKey::from_osd_key(&osd_key, 1));
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async move {
            let l = Listener::bind(TransportKind::Tcp, "127.0.0.1:0".parse().unwrap()).unwrap();
            let replica = replica_at(l.local_addr());
            let far = spawn(async move {
                let c = l.accept().await.unwrap();
                c.recv().await.unwrap()
            });
            let peers = osd7_peers(Some(keys.clone()));
            let ping = Message::Ping {
                id: RequestId(0),
                epoch: Epoch(1),
            };
            // Nobody answers the HELLO: the call fails, retryable.
            let call = spawn({
                let peers = peers.clone();
                let replica = replica.clone();
                async move { peers.call(&replica, 0, Epoch(1), ping).await }
            });
            let hello = far.await;
            let admitted = crate::hello_gate::HelloGate::new(OsdId(3), Some(keys))
                .check(&hello)
                .expect("the replica admits the HELLO");
            let who = admitted.who.expect("authenticated");
            assert_eq!(who.entity.as_str(), "osd.7");
            assert_eq!(who.role, Role::Osd);
            assert_eq!(call.await, status::EAGAIN);
        })
        .unwrap();
    }

    /// A call cancelled while it connects (its task dropped, as recovery drops
    /// the sibling copies of a batch one of which failed) does not leave the
    /// later calls to that peer waiting for its attempt for good (seed 109: the
    /// primary's recovery loop hung on its next call to the replica).
    #[test]
    fn a_call_cancelled_mid_connect_does_not_hold_the_later_ones() {
        let mut r = Reactor::new(ReactorConfig::default()).unwrap();
        r.block_on(async move {
            // Accepts nothing, answers no HELLO: each attempt ends after the
            // connect timeout.
            let l = Listener::bind(TransportKind::Tcp, "127.0.0.1:0".parse().unwrap()).unwrap();
            let replica = replica_at(l.local_addr());
            let peers = osd7_peers(None);
            let ping = Message::Ping {
                id: RequestId(0),
                epoch: Epoch(1),
            };
            let first = spawn({
                let peers = peers.clone();
                let replica = replica.clone();
                let ping = ping.clone();
                async move { peers.call(&replica, 0, Epoch(1), ping).await }
            });
            // The first call waits for the HELLO's answer; then it is cancelled.
            reactor::sleep(Duration::from_millis(50)).await;
            assert!(peers.connecting.borrow().contains_key(&(OsdId(3), 0)));
            assert_eq!(first.cancel().await, None);
            assert!(peers.connecting.borrow().is_empty());
            let second = futures_lite::future::or(
                async { Some(peers.call(&replica, 0, Epoch(1), ping).await) },
                async {
                    reactor::sleep(Duration::from_secs(3)).await;
                    None
                },
            )
            .await;
            assert_eq!(
                second,
                Some(status::EAGAIN),
                "the second call waited for the cancelled one's connection attempt"
            );
            drop(l);
        })
        .unwrap();
    }
}
