//! A client's or peer's connection to one shard, from accept to close: the first
//! message must be a HELLO naming this shard; sessions fence superseded connections
//! (a request resent on a new connection must never be overtaken by its stale
//! original); each connection and the shard bound what is in flight, so a fast
//! sender is slowed by TCP instead of growing memory.

use crate::shard::Shard;
use flame_common::protocol::{self, Message, ProtocolError, status};
use flame_common::reactor;
use flame_common::transport::{Conn, TransportError};
use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

/// A replication connection may have this many times a client's in-flight bound.
const PEER_INFLIGHT_FACTOR: u32 = 16;

/// How long a new connection may take to send its `Hello`.
const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Counts a connection while it lives.
struct ConnectionSlot(Rc<Shard>);

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.0.connections.set(self.0.connections.get() - 1);
        self.0.metrics.client_connections.dec();
    }
}

pub(crate) async fn serve_connection(shard: Rc<Shard>, conn: Conn) {
    shard.connections.set(shard.connections.get() + 1);
    shard.metrics.client_connections.inc();
    let _slot = ConnectionSlot(shard.clone());
    let peer = conn.peer();
    // The first message must be a Hello naming this shard.
    let mut max_inflight = shard.max_inflight;
    let mut is_peer = false;
    let mut fence: Option<Fence> = None;
    let first = futures_lite::future::or(async { Some(conn.recv().await) }, async {
        reactor::sleep(HELLO_TIMEOUT).await;
        None
    })
    .await;
    match first {
        Some(Ok(hello @ Message::Hello { .. })) => {
            if matches!(hello, Message::Hello { peer: true, .. }) {
                // One replication connection carries the writes of every client of
                // the sending shard: give it room for all of them.
                max_inflight = max_inflight.saturating_mul(PEER_INFLIGHT_FACTOR);
                is_peer = true;
                // Forwarded writes must not wait on this shard's memory pool
                // either (the same deadlock as the byte bound below).
                conn.set_never_wait_for_memory(true);
            }
            let mut reply = shard.hello(&hello);
            if let (
                Message::Hello {
                    session,
                    generation,
                    ..
                },
                Message::HelloReply { status: st @ 0, .. },
            ) = (&hello, &mut reply)
                && *session != 0
            {
                match shard.register_session(*session, *generation) {
                    Some(f) => fence = Some(f),
                    None => {
                        tracing::warn!(shard = shard.id, %peer, session, generation, "hello from a superseded connection; refusing");
                        *st = status::ESTALE;
                    }
                }
            }
            let ok = matches!(reply, Message::HelloReply { status: 0, .. });
            if conn.send(&reply).is_err() {
                conn.close();
                return;
            }
            if !ok {
                // The refusal (wrong shard, superseded session) must reach the
                // sender, so it can tell a stale map from a network failure.
                conn.close_after_send();
                return;
            }
        }
        Some(Ok(other)) => {
            tracing::warn!(shard = shard.id, %peer, "first message was {:?}, not hello; closing", other.op());
            conn.close();
            return;
        }
        Some(Err(TransportError::Protocol(
            e @ ProtocolError::ForeignVersion {
                peer_version,
                request_id,
            },
        ))) => {
            // Answer in the peer's own format, so it can say why, then close.
            tracing::warn!(shard = shard.id, %peer, "refusing connection: {e}");
            let _ = conn.send_raw(protocol::version_refusal(peer_version, request_id));
            conn.close_after_send();
            return;
        }
        Some(Err(e)) => {
            tracing::debug!(shard = shard.id, %peer, "connection failed before hello: {e}");
            return;
        }
        None => {
            tracing::warn!(shard = shard.id, %peer, "no hello within {HELLO_TIMEOUT:?}; closing");
            conn.close();
            return;
        }
    }
    let inflight = Rc::new(Inflight {
        count: Cell::new(0),
        reader: Cell::new(None),
    });
    loop {
        // Back-pressure: stop reading while the connection has too much in flight;
        // the unread requests wait in the socket and slow the sender down.
        inflight.below(max_inflight).await;
        if !is_peer {
            // Replication connections never wait on the shard's byte bound: their
            // requests are what frees other shards' (and this one's) primaries, so
            // blocking them could deadlock two OSDs waiting on each other. Their
            // volume is bounded by the sending primaries' own bounds.
            shard.bytes_below_bound().await;
        }
        let msg = match conn.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(shard = shard.id, %peer, "connection ended: {e}");
                conn.close();
                return;
            }
        };
        if let Some(f) = &fence
            && f.current.get() != f.generation
        {
            // The same session has connected again: whatever still arrives here was
            // sent before the sender gave up on this connection and may have been
            // resent on the new one. Executing it now could let a stale write
            // overtake (and then overwrite) its newer copy.
            tracing::info!(shard = shard.id, %peer, "connection superseded by a newer one of its session; closing");
            conn.close();
            return;
        }
        if matches!(
            msg,
            Message::Reply { .. } | Message::Hello { .. } | Message::HelloReply { .. }
        ) {
            tracing::warn!(shard = shard.id, %peer, "unexpected {:?} mid-connection; closing", msg.op());
            conn.close();
            return;
        }
        if !is_peer && crate::execute::is_forwarded(&msg) {
            // A replica-flagged request from a client would be applied to this copy
            // alone, outside the primary's ordering gate: refuse it (the connection
            // stays; the sender learns why from the status and the log).
            tracing::warn!(shard = shard.id, %peer, op = ?msg.op(), "replica-flagged request on a client connection; refusing");
            if conn
                .send_owned(msg.reply(shard.epoch(), status::EINVAL))
                .is_err()
            {
                conn.close();
                return;
            }
            continue;
        }
        inflight.count.set(inflight.count.get() + 1);
        let bytes = payload_bytes(&msg);
        shard.inflight_bytes.set(shard.inflight_bytes.get() + bytes);
        let shard = shard.clone();
        let conn = conn.clone();
        let inflight = inflight.clone();
        reactor::spawn(async move {
            let reply = shard.execute(msg).await;
            let _ = conn.send_owned(reply);
            shard.release_bytes(bytes);
            inflight.count.set(inflight.count.get() - 1);
            if let Some(w) = inflight.reader.take() {
                w.wake();
            }
        })
        .detach();
    }
}

/// Requests in flight on one connection, and the reader waiting for room.
struct Inflight {
    count: Cell<u32>,
    reader: Cell<Option<std::task::Waker>>,
}

impl Inflight {
    async fn below(&self, max: u32) {
        std::future::poll_fn(|cx| {
            if self.count.get() < max {
                std::task::Poll::Ready(())
            } else {
                self.reader.set(Some(cx.waker().clone()));
                std::task::Poll::Pending
            }
        })
        .await
    }
}

/// A connection's place in its session: it may execute requests only while its
/// generation is the session's newest.
struct Fence {
    current: Rc<Cell<u64>>,
    generation: u64,
}

/// Sessions one shard remembers (beyond those with a live connection).
const SESSIONS_MAX: usize = 65_536;

/// Memory a request holds while it runs: its write data or its read result.
fn payload_bytes(msg: &Message) -> u64 {
    match msg {
        Message::Write { target, .. } | Message::Read { target, .. } => u64::from(target.length),
        _ => 0,
    }
}

impl Shard {
    /// Records that `session` opened connection `generation`. `None` if the session
    /// already has a newer connection (this hello is itself stale).
    fn register_session(&self, session: u64, generation: u64) -> Option<Fence> {
        let mut sessions = self.sessions.borrow_mut();
        if sessions.len() >= SESSIONS_MAX {
            // Forget sessions without a live connection (only their fences hold
            // a second reference).
            sessions.retain(|_, c| Rc::strong_count(c) > 1);
        }
        let current = sessions
            .entry(session)
            .or_insert_with(|| Rc::new(Cell::new(0)))
            .clone();
        if generation < current.get() {
            return None;
        }
        current.set(generation);
        Some(Fence {
            current,
            generation,
        })
    }

    fn hello(&self, hello: &Message) -> Message {
        let Message::Hello {
            shard, versions, ..
        } = hello
        else {
            return hello.reply(self.epoch(), status::EINVAL);
        };
        let view = self.view();
        let map = &view.map;
        let shards = map.osds.get(&self.osd).map_or(0, |o| o.shards);
        let st = if !versions.contains(protocol::VERSION) {
            tracing::warn!(
                shard = self.id,
                "refusing hello: peer speaks Flame protocol versions {versions}, this OSD speaks {}",
                protocol::VERSIONS
            );
            status::EPROTONOSUPPORT
        } else if *shard == self.id {
            status::OK
        } else {
            status::ESTALE
        };
        Message::HelloReply {
            id: hello.id(),
            epoch: map.epoch,
            status: st,
            versions: protocol::VERSIONS,
            shard: self.id,
            shards,
        }
    }
}
