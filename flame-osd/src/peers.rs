//! Connections from this shard to the shards of other OSDs, for replication.
//!
//! Each shard owns its own peer connections (the penetrating model: the thread that
//! took a client's write also drives its replication and sees the replicas' replies),
//! one per (OSD, shard). Requests on a peer connection are matched to replies by
//! request id; a connection failure fails every request waiting on it, and the
//! primary answers its client with EAGAIN so the client retries.

use crate::liveness::Liveness;
use crate::metrics::ShardMetrics;
use crate::service_key::ServiceKeys;
use flame_common::auth::handshake::{self, HelloBinding};
use flame_common::auth::{EntityName, Role, TICKET_LIFETIME_MS};
use flame_common::clock;
use flame_common::collections::HashMap;
use flame_common::ids::{Epoch, OsdId, RequestId};
use flame_common::map::OsdInfo;
use flame_common::protocol::{Message, status};
use flame_common::reactor;
use flame_common::transport::{Conn, TransportKind};
use futures_channel::oneshot;
use std::cell::{Cell, RefCell};

use std::net::IpAddr;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

/// One connection to a peer shard.
pub struct Peer {
    conn: Conn,
    pending: RefCell<HashMap<u64, oneshot::Sender<Message>>>,
    next_id: Cell<u64>,
}

/// Peer connections of one shard.
pub struct Peers {
    transport: TransportKind,
    /// Local address peer connections leave from (the OSD's own).
    source: Option<IpAddr>,
    connect_timeout: Duration,
    call_timeout: Duration,
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
}

impl Peers {
    /// No connections yet; they open on first use.
    pub fn new(
        transport: TransportKind,
        source: Option<IpAddr>,
        connect_timeout: Duration,
        call_timeout: Duration,
        metrics: Rc<ShardMetrics>,
        liveness: Arc<Liveness>,
        service: Option<ServiceKeys>,
    ) -> Peers {
        Peers {
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
        let reply = {
            let id = peer.next_id.get();
            peer.next_id.set(id + 1);
            let mut msg = msg;
            msg.set_id(RequestId(id));
            let (tx, rx) = oneshot::channel();
            peer.pending.borrow_mut().insert(id, tx);
            // Only writes (a primary's forwards and recovery's copies): the
            // listing and checksum traffic of recovery and scrub, which a primary
            // also starts at boot, would otherwise use up a counted failpoint
            // before the write a test aims it at.
            let is_write = matches!(
                msg,
                Message::Write { .. } | Message::WriteZeroes { .. } | Message::Discard { .. }
            );
            if is_write && let Err(e) = crate::failpoints::check("peer_send") {
                // As a failed send on a real socket: the connection is gone, and
                // every request waiting on it fails (the primary answers EAGAIN and
                // the client resends).
                tracing::warn!(osd = %osd.id, shard, "peer send failed: {e}");
                peer.pending.borrow_mut().remove(&id);
                self.drop_peer(osd.id, shard, &peer);
                return Err(status::EAGAIN);
            }
            if peer.conn.send_owned(msg).is_err() {
                peer.pending.borrow_mut().remove(&id);
                return Err(status::EAGAIN);
            }
            let timeout = self.call_timeout;
            let wait = async { Some(rx.await.ok()) };
            let expire = async {
                reactor::sleep(timeout).await;
                Some(None)
            };
            let abandon = async {
                give_up.await;
                None
            };
            let r = futures_lite::future::or(futures_lite::future::or(wait, expire), abandon).await;
            let Some(r) = r else {
                // Abandoned: the connection stays (the peer may be fine, only no
                // longer needed); its late reply finds no waiter and is dropped.
                peer.pending.borrow_mut().remove(&id);
                return Err(status::EAGAIN);
            };
            if r.is_none() {
                peer.pending.borrow_mut().remove(&id);
            }
            r
        };
        match reply {
            Some(m) => Ok(m),
            None => {
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
        peer.conn.close();
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
        // which ends within connect_timeout.
        for _ in 0..4 {
            if let Some(p) = self.conns.borrow().get(&key)
                && !p.conn.is_closed()
            {
                return Ok(p.clone());
            }
            let waiting = self.connecting.borrow().get(&key).cloned();
            if let Some(ev) = waiting {
                ev.wait().await;
                continue;
            }
            let ev = Rc::new(crate::ordering::Event::default());
            self.connecting.borrow_mut().insert(key, ev.clone());
            let result = self.connect(osd, shard, epoch).await;
            self.connecting.borrow_mut().remove(&key);
            ev.set();
            return result;
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
                let ticket =
                    keys.current()
                        .issue(&EntityName::osd(), Role::Osd, now_ms, TICKET_LIFETIME_MS);
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
            conn,
            pending: RefCell::new(HashMap::default()),
            next_id: Cell::new(1),
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
                match p.conn.recv().await {
                    Ok(reply @ Message::Reply { .. }) => {
                        let tx = p.pending.borrow_mut().remove(&reply.id().0);
                        if let Some(tx) = tx {
                            let _ = tx.send(reply);
                        }
                    }
                    Ok(other) => {
                        tracing::warn!(osd = %osd_id, "peer sent a request on a replication connection: {:?}", other.op());
                        break;
                    }
                    Err(_) => break,
                }
            }
            // Fail everything still waiting (dropping the senders wakes them).
            p.pending.borrow_mut().clear();
            me.drop_peer(osd_id, shard, &p);
        })
        .detach();
        Ok(peer)
    }
}
