//! A client's or peer's connection to one shard, from accept to close: the first
//! message must be a HELLO naming this shard; sessions fence superseded connections
//! (a request resent on a new connection must never be overtaken by its stale
//! original); each connection and the shard bound what is in flight, so a fast
//! sender is slowed by TCP instead of growing memory.
//!
//! The connection is also where the communication layer's one-sided techniques
//! are resolved, so the request executor only ever sees inline data and returns
//! inline replies:
//! * **Read-write conversion.** A write naming a remote buffer has its payload
//!   pulled with a one-sided READ before it executes (then it is stored and
//!   forwarded to the replicas inline: the data is in this OSD's memory by then,
//!   and a replica pulling it from the primary would add a round trip to every
//!   replicated write); a read naming one has its data pushed with a one-sided
//!   WRITE into the client's buffer, and the reply goes without payload. A
//!   descriptor the transport refuses (unknown key, out of the grant's bounds)
//!   ends this connection only.
//! * **Remote fetching.** A connection may ask for a reply area (granted memory
//!   the client reads one-sidedly); a request flagged [`flags::FETCH_REPLY`] then
//!   has its reply written into its slot instead of sent, unless it does not fit
//!   or the client asked for it to be pushed ([`Message::PushReply`]).

use crate::metrics::FetchReply;
use crate::session_fence::{Fence, HelloIdentity, Superseded};
use crate::shard::Shard;
use flame_common::collections::HashSet;
use flame_common::protocol::{
    self, HEADER_LEN, Message, OpCode, ProtocolError, RemoteBuf, ReplyAreaInfo, flags, status,
};
use flame_common::reactor;
use flame_common::transport::{Conn, SharedArea, TransportError};
use std::cell::{Cell, RefCell};

use std::rc::Rc;
use std::time::Duration;

use crate::peers::PEER_INFLIGHT_FACTOR;

/// How long a new connection may take to send its `Hello`.
pub(crate) const HELLO_TIMEOUT: Duration = Duration::from_secs(10);

/// Counts a connection in the gauge while it lives.
struct ConnectionGauge(Rc<Shard>);

impl Drop for ConnectionGauge {
    fn drop(&mut self) {
        self.0.metrics.client_connections.dec();
    }
}

pub(crate) async fn serve_connection(
    shard: Rc<Shard>,
    conn: Conn,
    slot: crate::connection_slots::SlotGuard,
) {
    shard.metrics.client_connections.inc();
    let _gauge = ConnectionGauge(shard.clone());
    let peer = conn.peer();
    // The first message must be a Hello naming this shard.
    let mut max_inflight = shard.max_inflight;
    let mut is_peer = false;
    let mut fence: Option<Fence> = None;
    let Some((hello, admitted)) =
        receive_hello(&conn, &shard.hello_gate, &slot, shard.id, peer).await
    else {
        return;
    };
    if matches!(hello, Message::Hello { peer: true, .. }) {
        // One replication connection carries the writes of every client of
        // the sending shard: give it room for all of them.
        max_inflight = max_inflight.saturating_mul(PEER_INFLIGHT_FACTOR);
        is_peer = true;
        // Forwarded writes must not wait on this shard's memory pool
        // either (the same deadlock as the byte bound below).
        conn.set_never_wait_for_memory(true);
        // Peers mint their tickets as their own `osd.N`.
        tracing::debug!(shard = shard.id, %peer,
            entity = admitted.who.as_ref().map_or("unauthenticated", |w| w.entity.as_str()),
            "replication connection");
    }
    let mut reply = shard.hello(&hello);
    if let Message::HelloReply {
        status: 0, proof, ..
    } = &mut reply
    {
        *proof = admitted.proof;
    }
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
        match shard.register_session(HelloIdentity::new(
            admitted.who.as_ref(),
            *session,
            *generation,
        )) {
            Ok(f) => fence = Some(f),
            Err(why) => {
                if let Some(left_out) = refusal_line() {
                    tracing::warn!(shard = shard.id, %peer, session, generation, ?why, left_out, "hello from a superseded connection; refusing");
                }
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
    let inflight = Rc::new(Inflight::default());
    watch_stalls(&conn, shard.stall_bounds, shard.id, &inflight);
    let access =
        crate::access::ConnAccess::new(is_peer, admitted.who.as_ref(), admitted.volumes.clone());
    let fetching: Rc<RefCell<Option<Fetching>>> = Rc::new(RefCell::new(None));
    let _area_gauge = AreaGauge(shard.clone(), fetching.clone());
    loop {
        // Back-pressure: stop reading while the connection has too much in flight;
        // the unread requests wait in the socket and slow the sender down.
        // Replication connections never wait on the clients' byte bound: their
        // requests are what frees other shards' (and this one's) primaries, so
        // blocking them could deadlock two OSDs waiting on each other. They have
        // a byte bound of their own (crate::byte_budget), which frees by itself.
        //
        // Exception: while a converted request's one-sided transfer is running on
        // an emulated transport (tcp), its completion arrives through this
        // connection's receive, so the loop keeps receiving; requests beyond the
        // bound are then answered EAGAIN (the client retries) instead of run.
        inflight
            .room_or_transfers(max_inflight, is_peer, &shard)
            .await;
        // And while the sender does not take its replies (no exception for
        // transfers: their completions come from a peer that reads, and a
        // peer that does not read gets nothing more until it does, or until
        // the stall watchdog closes it).
        wait_for_replies_taken(&conn).await;
        let mut msg = match conn.recv().await {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(shard = shard.id, %peer, "connection ended: {e}");
                conn.close();
                return;
            }
        };
        if let Some(f) = &fence
            && !f.holds()
        {
            // The same session has connected again: whatever still arrives here was
            // sent before the sender gave up on this connection and may have been
            // resent on the new one. Executing it now could let a stale write
            // overtake (and then overwrite) its newer copy. Or a newer
            // incarnation of its client connected: this one crashed, and its
            // writes must not land over its successor's
            // (crate::session_fence).
            tracing::info!(shard = shard.id, %peer, "connection superseded by a newer one of its session or client; closing");
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
        match msg {
            Message::ReplyArea { .. } => {
                let reply = shard.grant_reply_area(&conn, &msg, is_peer, &fetching);
                if conn.send_owned(reply).is_err() {
                    conn.close();
                    return;
                }
                continue;
            }
            Message::PushReply { of, .. } => {
                if let Err(why) = shard.push_reply(&conn, &fetching, of.0) {
                    tracing::warn!(shard = shard.id, %peer, "{why}; closing");
                    conn.close();
                    return;
                }
                continue;
            }
            _ => {}
        }
        let over_bound =
            inflight.count.get() >= max_inflight || !shard.bytes_of(is_peer).has_room();
        if over_bound {
            if conn
                .send_owned(msg.reply(shard.epoch(), status::EAGAIN))
                .is_err()
            {
                conn.close();
                return;
            }
            continue;
        }
        let fetch = take_fetch_flag(&mut msg);
        if fetch
            && fetching
                .borrow()
                .as_ref()
                .is_none_or(|f| f.slot_of(msg.id().0).is_none())
        {
            // A fetched reply needs a reply area and an id naming one of its slots.
            tracing::warn!(shard = shard.id, %peer, "fetch-flagged request without a slot; refusing");
            if conn
                .send_owned(msg.reply(shard.epoch(), status::EINVAL))
                .is_err()
            {
                conn.close();
                return;
            }
            continue;
        }
        if let Err(r) = access.check(&msg, || shard.view()) {
            // Refused (crate::access): the connection stays; the sender learns
            // why from the status and the log.
            if let Some(left_out) = refusal_line() {
                tracing::warn!(shard = shard.id, %peer, op = ?msg.op(), left_out, "refusing: {}", r.why);
            }
            if conn.send_owned(msg.reply(shard.epoch(), r.status)).is_err() {
                conn.close();
                return;
            }
            continue;
        }
        access.scope_op(&mut msg);
        inflight.enter();
        let bytes = payload_bytes(&msg);
        shard.bytes_of(is_peer).take(bytes);
        let shard = shard.clone();
        let conn = conn.clone();
        let inflight = inflight.clone();
        let fetching = fetching.clone();
        reactor::spawn(async move {
            let client_write = !is_peer
                && matches!(
                    msg,
                    Message::Write { .. } | Message::WriteZeroes { .. } | Message::Discard { .. }
                );
            let hold = if client_write {
                crate::failpoints::hold_ms("write_hold")
            } else if is_peer && matches!(msg, Message::Write { .. }) {
                crate::failpoints::hold_ms("forward_hold")
            } else {
                None
            };
            if let Some(ms) = hold {
                reactor::sleep(Duration::from_millis(ms)).await;
            }
            if let Some(reply) = shard.execute_converting(&conn, &inflight, msg).await {
                if client_write && crate::failpoints::check("reply_drop").is_err() {
                    // Applied, but the client never hears of it: it resends.
                    conn.close();
                } else if fetch {
                    shard.leave_reply(&conn, &fetching, reply);
                } else {
                    let _ = conn.send_owned(reply);
                }
            }
            shard.bytes_of(is_peer).release(bytes);
            inflight.leave();
        })
        .detach();
    }
}

/// Watches an admitted connection until it closes: one that stays stuck on a
/// payload or on its replies past its bound (a trickling or never-reading peer,
/// which would hold a pool buffer or queued replies and a slot) is closed,
/// logged and counted, and so is one idle past `idle_timeout_ms` with nothing
/// in flight (`inflight`: a request the shard still works on is not idleness).
/// One timer per connection, waking a few times per bound: nothing on the data
/// path. tcp, rdma and shm connections are watched (those whose transport
/// keeps [`Conn::stall`] marks); the simulator's links are not.
pub(crate) fn watch_stalls(
    conn: &Conn,
    bounds: flame_common::transport::StallBounds,
    shard_id: u16,
    inflight: &Rc<Inflight>,
) {
    use flame_common::transport::Stall;
    if conn.stall().is_none() {
        // Not a watched transport (the simulator's links).
        return;
    }
    let (sampled, watched, stuck) = (conn.clone(), conn.clone(), conn.clone());
    let inflight = inflight.clone();
    flame_common::transport::stall::watch(
        bounds,
        move || {
            sampled
                .stall()
                .filter(|&(s, _)| s != Stall::Idle || inflight.is_empty())
        },
        move || watched.is_closed(),
        move |stall, took| {
            let bound = bounds.of(stall).unwrap_or_default();
            tracing::warn!(shard = shard_id, peer = %stuck.peer(), "closing a connection stuck for {took:?} ({}, bound {bound:?})", stall.label());
            crate::metrics::stalled_connection_closed(stall.label());
            stuck.close();
        },
    );
}

/// Waits (at most [`HELLO_TIMEOUT`]) for a new connection's first message, which
/// must be a `Hello` that `gate` admits; shared by the penetrating shards and the
/// staged mode's network threads. Every other outcome is settled here and gives
/// `None`, with the connection closed: another message, a peer of another protocol
/// version (answered in its own format first, so it can say why), a HELLO without
/// a valid ticket (answered `EPERM`, counted, logged naming the entity), an error,
/// silence. A replication connection (an admitted peer's hello) is switched to
/// never wait for pool memory: forwarded writes are what frees the primaries'
/// buffers, so waiting on them could deadlock two OSDs (the same reason they skip
/// the byte bound).
pub(crate) async fn receive_hello(
    conn: &Conn,
    gate: &crate::hello_gate::HelloGate,
    slot: &crate::connection_slots::SlotGuard,
    shard_id: u16,
    peer: std::net::SocketAddr,
) -> Option<(Message, crate::hello_gate::Admitted)> {
    let first = futures_lite::future::or(async { Some(conn.recv().await) }, async {
        reactor::sleep(HELLO_TIMEOUT).await;
        None
    })
    .await;
    match first {
        Some(Ok(hello @ Message::Hello { .. })) => match gate.check(&hello) {
            Ok(admitted) => {
                let is_peer = matches!(hello, Message::Hello { peer: true, .. });
                if let Err(r) = slot.hello(is_peer) {
                    // Over the client share: the client retries (EAGAIN) later
                    // or elsewhere; the peers' slots stay free.
                    if let Some(left_out) = refusal_line() {
                        tracing::warn!(shard = shard_id, %peer, left_out, "refusing a client connection: {r}");
                    }
                    let _ = conn.send(&hello.reply(flame_common::ids::Epoch(0), status::EAGAIN));
                    conn.close_after_send();
                    return None;
                }
                if is_peer {
                    conn.set_never_wait_for_memory(true);
                }
                Some((hello, admitted))
            }
            Err(refusal) => {
                crate::metrics::hello_refused(refusal.label());
                if let Some(left_out) = refusal_line() {
                    tracing::warn!(shard = shard_id, %peer, left_out, "refusing connection: {refusal}");
                }
                let _ = conn.send(&hello.reply(flame_common::ids::Epoch(0), status::EPERM));
                conn.close_after_send();
                None
            }
        },
        Some(Ok(other)) => {
            if let Some(left_out) = refusal_line() {
                tracing::warn!(shard = shard_id, %peer, left_out, "first message was {:?}, not hello; closing", other.op());
            }
            conn.close();
            None
        }
        Some(Err(TransportError::Protocol(
            e @ ProtocolError::ForeignVersion {
                peer_version,
                request_id,
            },
        ))) => {
            if let Some(left_out) = refusal_line() {
                tracing::warn!(shard = shard_id, %peer, left_out, "refusing connection: {e}");
            }
            let _ = conn.send_raw(protocol::version_refusal(peer_version, request_id));
            conn.close_after_send();
            None
        }
        Some(Err(e)) => {
            tracing::debug!(shard = shard_id, %peer, "connection failed before hello: {e}");
            None
        }
        None => {
            if let Some(left_out) = refusal_line() {
                tracing::warn!(shard = shard_id, %peer, left_out, "no hello within {HELLO_TIMEOUT:?}; closing");
            }
            conn.close();
            None
        }
    }
}

/// Log lines of refused connections and requests, which anyone who reaches a
/// port can cause: at most 20 per 10 s for the whole process (the metrics
/// count every refusal); the next line allowed says how many were left out.
static REFUSAL_LINES: flame_common::logging::LineBudget =
    flame_common::logging::LineBudget::new(Duration::from_secs(10), 20);

/// Whether a refusal may be logged now: `Some(lines left out before it)`.
fn refusal_line() -> Option<u64> {
    REFUSAL_LINES.admit(flame_common::clock::now())
}

/// Clears [`flags::FETCH_REPLY`] from a request (it must never reach a replica)
/// and says whether it was set.
fn take_fetch_flag(msg: &mut Message) -> bool {
    if let Message::Read { flags: f, .. }
    | Message::Write { flags: f, .. }
    | Message::WriteZeroes { flags: f, .. }
    | Message::Discard { flags: f, .. }
    | Message::Flush { flags: f, .. } = msg
    {
        let set = *f & flags::FETCH_REPLY != 0;
        *f &= !flags::FETCH_REPLY;
        return set;
    }
    false
}

/// A connection's reply area (remote fetching).
struct Fetching {
    area: SharedArea,
    info: ReplyAreaInfo,
    /// Per slot: the id of the reply it holds (0: none) and that reply, kept to
    /// push it when the client asks.
    slots: Vec<(u64, Option<Message>)>,
    /// Requests whose reply the client asked to be pushed before it was ready.
    push_wanted: HashSet<u64>,
}

impl Fetching {
    /// The slot request `id` uses, if its id names one.
    fn slot_of(&self, id: u64) -> Option<usize> {
        let slot = id % self.info.modulus();
        (slot < u64::from(self.info.slots)).then_some(slot as usize)
    }
}

/// Keeps `flame_osd_reply_areas` right when a connection with an area ends.
struct AreaGauge(Rc<Shard>, Rc<RefCell<Option<Fetching>>>);

impl Drop for AreaGauge {
    fn drop(&mut self) {
        if self.1.borrow().is_some() {
            self.0.metrics.reply_areas.dec();
        }
    }
}

/// Bytes of a reply slot holding up to `payload` bytes: a header plus the payload,
/// rounded up to a cache line so slots never share one.
fn slot_bytes(payload: u32) -> u32 {
    (HEADER_LEN as u32 + payload).next_multiple_of(64)
}

impl Shard {
    /// Runs a request whose data may travel one-sidedly: pulls a converted write's
    /// payload first, pushes a converted read's data after, and returns the reply
    /// to send (`None` when a transfer failed: the transport has closed the
    /// connection, which is all a bad descriptor deserves).
    async fn execute_converting(
        self: &Rc<Self>,
        conn: &Conn,
        inflight: &Inflight,
        mut msg: Message,
    ) -> Option<Message> {
        let (dest, pulled) = pull_converted(conn, inflight, self.id, &mut msg).await?;
        if pulled > 0 {
            self.metrics.converted[1].inc();
            self.metrics.converted_bytes.inc_by(u64::from(pulled));
        }
        let mut reply = self.execute(msg).await;
        let pushed = push_converted(conn, inflight, self.id, dest, &mut reply).await?;
        if pushed > 0 {
            self.metrics.converted[0].inc();
            self.metrics.converted_bytes.inc_by(u64::from(pushed));
        }
        Some(reply)
    }

    /// Answers a [`Message::ReplyArea`]: grants the connection a reply area within
    /// this shard's bounds, or says why not.
    fn grant_reply_area(
        &self,
        conn: &Conn,
        msg: &Message,
        is_peer: bool,
        fetching: &RefCell<Option<Fetching>>,
    ) -> Message {
        let Message::ReplyArea {
            slots,
            slot_payload_bytes,
            ..
        } = *msg
        else {
            return msg.reply(self.epoch(), status::EINVAL);
        };
        if is_peer || fetching.borrow().is_some() {
            // One area per client connection.
            return msg.reply(self.epoch(), status::EINVAL);
        }
        if self.reply_slots_max == 0 || !(conn.one_sided_native() || self.reply_area_over_emulated)
        {
            // Over an emulated one-sided READ every fetch is a round trip through
            // this thread: more work than pushing the reply.
            return msg.reply(self.epoch(), status::EOPNOTSUPP);
        }
        let slots = slots.min(self.reply_slots_max);
        let payload = slot_payload_bytes.min(self.reply_slot_payload_max);
        let slot_bytes = slot_bytes(payload);
        let len = slots as usize * slot_bytes as usize;
        let area = match conn.grant_area(len) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(shard = self.id, peer = %conn.peer(), "cannot grant a reply area: {e}");
                return msg.reply(self.epoch(), status::EOPNOTSUPP);
            }
        };
        let info = ReplyAreaInfo {
            remote: area.remote(),
            slots,
            slot_bytes,
        };
        debug_assert_eq!(info.remote.len as usize, len);
        *fetching.borrow_mut() = Some(Fetching {
            area,
            info,
            slots: (0..slots).map(|_| (0, None)).collect(),
            push_wanted: HashSet::default(),
        });
        self.metrics.reply_areas.inc();
        Message::Reply {
            op: OpCode::ReplyArea,
            id: msg.id(),
            epoch: self.epoch(),
            status: status::OK,
            data: flame_common::buffer::PayloadBuf::copy_from(&info.encode()),
        }
    }

    /// Handles [`Message::PushReply`]: pushes the reply of `of` now if its slot
    /// holds it, or when it is ready. An error (no area, a request id naming no
    /// slot, more pending pushes than slots) ends the connection.
    fn push_reply(
        &self,
        conn: &Conn,
        fetching: &RefCell<Option<Fetching>>,
        of: u64,
    ) -> Result<(), String> {
        let mut guard = fetching.borrow_mut();
        let f = guard.as_mut().ok_or("push asked without a reply area")?;
        let slot = f
            .slot_of(of)
            .ok_or_else(|| format!("push asked for request {of}, which names no slot"))?;
        let (held, reply) = &f.slots[slot];
        if *held == of {
            if let Some(r) = reply.clone() {
                self.metrics.fetch_replies[FetchReply::Fallback as usize].inc();
                let _ = conn.send_owned(r);
            }
            return Ok(());
        }
        if *held > of {
            // Superseded: the client reused the slot, so nobody waits for `of`.
            return Ok(());
        }
        if f.push_wanted.len() >= f.info.slots as usize {
            return Err(format!(
                "more than {} pushes pending on one connection",
                f.info.slots
            ));
        }
        f.push_wanted.insert(of);
        Ok(())
    }

    /// Delivers the reply of a fetch-flagged request: into its slot, or pushed
    /// when the client asked for that meanwhile or it does not fit.
    fn leave_reply(&self, conn: &Conn, fetching: &RefCell<Option<Fetching>>, reply: Message) {
        let id = reply.id().0;
        let mut guard = fetching.borrow_mut();
        let Some(f) = guard.as_mut() else {
            let _ = conn.send_owned(reply);
            return;
        };
        if f.push_wanted.remove(&id) {
            self.metrics.fetch_replies[FetchReply::Fallback as usize].inc();
            let _ = conn.send_owned(reply);
            return;
        }
        let Some(slot) = f.slot_of(id) else {
            let _ = conn.send_owned(reply);
            return;
        };
        let (h, payload) = reply.to_header();
        if HEADER_LEN + payload.len() > f.info.slot_bytes as usize {
            drop(payload);
            self.metrics.fetch_replies[FetchReply::TooLarge as usize].inc();
            let _ = conn.send_owned(reply);
            return;
        }
        if f.slots[slot].0 > id {
            // A late reply of a request the client gave up on: its slot already
            // serves a newer one.
            return;
        }
        // Payload first, header last: a reader that sees the new header (its
        // request id) reads the new payload after it, and both are checksummed.
        let base = slot * f.info.slot_bytes as usize;
        let ok = f.area.write_at(base + HEADER_LEN, &payload) && f.area.write_at(base, &h.encode());
        drop(payload);
        if !ok {
            // Cannot happen (the slot was checked to fit); push rather than lose it.
            let _ = conn.send_owned(reply);
            return;
        }
        f.slots[slot] = (id, Some(reply));
        self.metrics.fetch_replies[FetchReply::Left as usize].inc();
    }
}

/// The first half of a converted request (read-write conversion), run where its
/// connection is (a penetrating shard, or a staged network thread): pulls a
/// write's payload into `msg` with a one-sided READ, or takes a read's destination
/// descriptor for [`push_converted`]. Returns that destination and the bytes pulled
/// (0 when nothing was), or `None` when the transfer failed: the connection is then
/// closed, which is all a bad descriptor deserves. The transfer is counted in
/// `inflight` so the receive loop keeps running for an emulated transport.
pub(crate) async fn pull_converted(
    conn: &Conn,
    inflight: &Inflight,
    shard: u16,
    msg: &mut Message,
) -> Option<(Option<RemoteBuf>, u32)> {
    match msg {
        Message::Write {
            remote: remote @ Some(_),
            data,
            target,
            ..
        } => {
            let r = remote.take()?;
            let pulled = {
                let _t = inflight.transfer(conn);
                conn.read_remote(r).await
            };
            match pulled {
                Ok(buf) if buf.len() == target.length as usize => {
                    *data = buf.freeze();
                    Some((None, r.len))
                }
                Ok(buf) => {
                    tracing::warn!(shard, peer = %conn.peer(), "pulled {} bytes for a {}-byte write; closing", buf.len(), target.length);
                    conn.close();
                    None
                }
                Err(e) => {
                    tracing::warn!(shard, peer = %conn.peer(), "pulling a converted write's payload failed: {e}; closing");
                    conn.close();
                    None
                }
            }
        }
        Message::Read { remote, .. } => Some((remote.take(), 0)),
        _ => Some((None, 0)),
    }
}

/// The second half of a converted request: pushes a successful read's data into
/// the client's buffer `dest` with a one-sided WRITE and empties the reply's data.
/// Returns the bytes pushed (0 when nothing was), or `None` when the transfer
/// failed (the connection is closed).
pub(crate) async fn push_converted(
    conn: &Conn,
    inflight: &Inflight,
    shard: u16,
    dest: Option<RemoteBuf>,
    reply: &mut Message,
) -> Option<u32> {
    let (
        Some(d),
        Message::Reply {
            status: status::OK,
            data,
            ..
        },
    ) = (dest, reply)
    else {
        return Some(0);
    };
    if data.len() != d.len as usize {
        return Some(0);
    }
    let pushed = {
        let _t = inflight.transfer(conn);
        conn.write_remote(d, 0, data).await
    };
    if let Err(e) = pushed {
        tracing::warn!(shard, peer = %conn.peer(), "pushing a converted read's data failed: {e}; closing");
        conn.close();
        return None;
    }
    *data = flame_common::buffer::PayloadBuf::empty();
    Some(d.len)
}

/// Requests in flight on one connection, and the reader waiting for room (shared
/// with the staged mode's network threads, [`crate::staged`]).
#[derive(Default)]
pub(crate) struct Inflight {
    count: Cell<u32>,
    /// One-sided transfers running whose completion needs this connection's
    /// receive (an emulated transport).
    transfers: Cell<u32>,
    reader: Cell<Option<std::task::Waker>>,
}

/// Counts one transfer in [`Inflight::transfers`] while it lives.
pub(crate) struct TransferGuard<'a>(Option<&'a Inflight>);

impl Drop for TransferGuard<'_> {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            i.transfers.set(i.transfers.get() - 1);
        }
    }
}

impl Inflight {
    /// Nothing is in flight: no request running, no transfer.
    pub(crate) fn is_empty(&self) -> bool {
        self.count.get() == 0 && self.transfers.get() == 0
    }

    /// A request was read and started.
    pub(crate) fn enter(&self) {
        self.count.set(self.count.get() + 1);
    }

    /// A request was answered: make room for the reader.
    pub(crate) fn leave(&self) {
        debug_assert!(self.count.get() > 0, "more replies than requests");
        self.count.set(self.count.get().saturating_sub(1));
        if let Some(w) = self.reader.take() {
            w.wake();
        }
    }

    /// Waits until fewer than `max` requests are in flight, or until a one-sided
    /// transfer needs the receive loop (the staged mode's network threads).
    pub(crate) async fn below(&self, max: u32) {
        std::future::poll_fn(|cx| {
            if self.transfers.get() > 0 || self.count.get() < max {
                std::task::Poll::Ready(())
            } else {
                self.reader.set(Some(cx.waker().clone()));
                std::task::Poll::Pending
            }
        })
        .await
    }

    /// Waits until the connection has room (in-flight count below `max` and the
    /// shard's client or peer bytes below their bound), or until a transfer
    /// needs the receive loop.
    async fn room_or_transfers(&self, max: u32, is_peer: bool, shard: &Shard) {
        std::future::poll_fn(|cx| {
            if self.transfers.get() > 0 {
                return std::task::Poll::Ready(());
            }
            let bytes_ok = shard.bytes_of(is_peer).poll_room(cx).is_ready();
            if self.count.get() < max && bytes_ok {
                return std::task::Poll::Ready(());
            }
            self.reader.set(Some(cx.waker().clone()));
            std::task::Poll::Pending
        })
        .await
    }

    /// Marks a one-sided transfer on `conn` as running until the guard drops.
    /// Only an emulated transport's transfers need the receive loop.
    pub(crate) fn transfer(&self, conn: &Conn) -> TransferGuard<'_> {
        if conn.one_sided_native() {
            return TransferGuard(None);
        }
        self.transfers.set(self.transfers.get() + 1);
        if let Some(w) = self.reader.take() {
            w.wake();
        }
        TransferGuard(Some(self))
    }
}

/// Back-pressure on answers: a sender that does not take its replies gets no
/// more requests read once its queued replies pass its share of the thread's
/// memory pool (a quarter of it, at least 8 MiB: what one source may also hold
/// in unfinished payloads, [`flame_common::buffer::registered::source_share_bytes`]).
/// Replies queued beyond that are those of requests already in flight (bounded
/// by the shard's byte budget); the stall watchdog ends the connection at
/// `send_stall_timeout_ms`. Without it a non-reader could queue up to the send
/// queue's bound (256 MiB) of pool buffers per connection. One comparison per
/// request while no backlog builds up.
pub(crate) async fn wait_for_replies_taken(conn: &Conn) {
    let backlog_max = flame_common::buffer::registered::thread_source_share_bytes() as usize;
    if conn.send_queued_bytes() > backlog_max {
        conn.wait_sent_below(backlog_max).await;
    }
}

/// Memory a request holds while it runs: its write data or its read result.
pub(crate) fn payload_bytes(msg: &Message) -> u64 {
    match msg {
        Message::Write { target, .. } | Message::Read { target, .. } => u64::from(target.length),
        _ => 0,
    }
}

impl Shard {
    /// Records the connection `hello` opens; why not, if the HELLO is itself
    /// stale
    /// ([`crate::session_fence::SessionFences::register`]).
    pub(crate) fn register_session(&self, hello: HelloIdentity) -> Result<Fence, Superseded> {
        self.sessions.borrow_mut().register(hello)
    }

    /// Whether the connection `hello` opened may still execute requests.
    pub(crate) fn session_holds(&self, hello: &HelloIdentity) -> bool {
        self.sessions.borrow().holds(hello)
    }

    pub(crate) fn hello(&self, hello: &Message) -> Message {
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
            // Set by the connection from its gate's verdict.
            proof: None,
        }
    }
}
