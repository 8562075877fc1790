//! A client write to an object being recovered waits for the object's copy: a
//! scripted member (a TCP peer in this test) answers the recovery copy slowly and
//! records when each message arrives; the client write must not reach it before
//! the copy was answered.

use crate::metrics::ShardMetrics;
use crate::ordering::WriteGate;
use crate::peers::Peers;
use crate::pg::MapView;
use crate::shard::Shard;
use crate::store::{ObjectStore, StoreOptions};
use arc_swap::ArcSwap;
use flame_common::buffer::PayloadBuf;
use flame_common::clock;
use flame_common::ids::{Epoch, ObjectId, OsdId, PgId, PgSeq, RequestId, VolumeId};
use flame_common::map::{ClusterMap, OsdInfo, PoolConfig, VolumeInfo};
use flame_common::protocol::{HEADER_LEN, Header, IoTarget, Message, VERSIONS, status};
use flame_common::reactor::{self, Reactor};
use flame_common::transport::TransportKind;
use std::cell::{Cell, RefCell};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::rc::Rc;
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

/// What the scripted member saw: (seq of a WRITE/DISCARD, received at, answered at).
type Seen = Arc<Mutex<Vec<(u64, Instant, Option<Instant>)>>>;

pub(super) fn read_msg(s: &mut TcpStream) -> Option<Message> {
    let mut hb = [0u8; HEADER_LEN];
    s.read_exact(&mut hb).ok()?;
    let h = Header::decode(&hb).ok()?;
    let mut p = vec![0u8; h.payload_len as usize];
    s.read_exact(&mut p).ok()?;
    Message::from_parts(&h, PayloadBuf::copy_from(&p)).ok()
}

/// A scripted member's answer to HELLO: epoch 5, one shard.
pub(super) fn hello_reply(id: RequestId) -> Message {
    Message::HelloReply {
        id,
        epoch: Epoch(5),
        status: 0,
        versions: VERSIONS,
        shard: 0,
        shards: 1,
        proof: None,
    }
}

/// A scripted complete copy on loopback, one connection: answers HELLO, then
/// each message with `answer`'s payload (status OK) or, where it says `None`,
/// the message's own default reply. For the tests of one real shard against
/// a copy whose answers they choose (`newest_copy`, `suspects`).
pub(super) fn scripted_copy(
    answer: impl Fn(&Message) -> Option<Vec<u8>> + Send + 'static,
) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let Ok((mut conn, _)) = listener.accept() else {
            return;
        };
        let mut out = conn.try_clone().unwrap();
        while let Some(msg) = read_msg(&mut conn) {
            let reply = match (&msg, answer(&msg)) {
                (Message::Hello { id, .. }, _) => hello_reply(*id),
                (_, Some(d)) => Message::Reply {
                    op: msg.op(),
                    id: msg.id(),
                    epoch: Epoch(5),
                    status: status::OK,
                    data: PayloadBuf::copy_from(&d),
                },
                (m, None) => m.reply(Epoch(5), status::OK),
            };
            let _ = out.write_all(&reply.encode());
        }
    });
    addr
}

/// The bytes a scripted copy holding `bytes` from offset 0 answers a read of
/// `target` with (zeroes past them).
pub(super) fn read_of(bytes: &[u8], target: &IoTarget) -> Vec<u8> {
    let (at, n) = (target.offset as usize, target.length as usize);
    let mut d = vec![0u8; n];
    let have = bytes.len().saturating_sub(at).min(n);
    d[..have].copy_from_slice(&bytes[at..at + have]);
    d
}

/// A member that answers writes after `delay`, each on its own thread.
fn scripted_member(delay: Duration) -> (SocketAddr, Seen) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Seen = Arc::default();
    let s2 = seen.clone();
    std::thread::spawn(move || {
        let Ok((mut conn, _)) = listener.accept() else {
            return;
        };
        let out = Arc::new(Mutex::new(conn.try_clone().unwrap()));
        while let Some(msg) = read_msg(&mut conn) {
            let reply = match &msg {
                Message::Hello { id, .. } => hello_reply(*id),
                m => m.reply(Epoch(5), status::OK),
            };
            let seq = match &msg {
                Message::Write { seq, .. } | Message::Discard { seq, .. } => Some(seq.0),
                _ => None,
            };
            let Some(seq) = seq else {
                let _ = out.lock().unwrap().write_all(&reply.encode());
                continue;
            };
            let i = {
                let mut v = s2.lock().unwrap();
                v.push((seq, clock::now(), None));
                v.len() - 1
            };
            let (out, s3) = (out.clone(), s2.clone());
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                s3.lock().unwrap()[i].2 = Some(clock::now());
                let _ = out.lock().unwrap().write_all(&reply.encode());
            });
        }
    });
    (addr, seen)
}

fn osd(id: u32, addr: SocketAddr) -> OsdInfo {
    OsdInfo {
        id: OsdId(id),
        addr,
        shards: 1,
        host: format!("h{id}"),
        weight: 1.0,
        up: true,
        up_from: Epoch(1),
        r#in: true,
        metrics_addr: None,
    }
}

pub(super) fn shard(dir: &std::path::Path, member: SocketAddr) -> Rc<Shard> {
    crate::store::layout::open_data_dir(dir, "gate-test", true).unwrap();
    let mut map = ClusterMap::new(
        "t".into(),
        PoolConfig {
            size: 2,
            min_size: 1,
            pg_count: 1,
            object_size: 1 << 20,
        },
    );
    map.epoch = Epoch(5);
    map.osds
        .insert(OsdId(1), osd(1, "127.0.0.1:1".parse().unwrap()));
    map.osds.insert(OsdId(2), osd(2, member));
    // OSD 1 holds the only complete copy; OSD 2 is being recovered.
    map.pg_complete.insert(PgId(0), vec![OsdId(1)]);
    map.volumes.insert(
        "v".into(),
        VolumeInfo {
            id: VolumeId(1),
            name: "v".into(),
            size: 1 << 30,
            created_unix: 0,
        },
    );
    let metrics = Rc::new(ShardMetrics::new(0));
    let liveness = Arc::new(crate::liveness::Liveness::new(1));
    Rc::new(Shard {
        id: 0,
        osd: OsdId(1),
        view: RefCell::new(Rc::new(MapView::new(&map))),
        map_source: Arc::new(ArcSwap::from_pointee(map)),
        wanted_epoch: Arc::default(),
        peer_epoch: Cell::new(0),
        lease: Duration::from_secs(4),
        activation_wake: Default::default(),
        suspects: Default::default(),
        doubt_record: std::sync::Arc::new(crate::store::doubt_record::DoubtRecord::none(dir)),
        store: ObjectStore::new(
            dir,
            0,
            StoreOptions {
                direct_io: false,
                open_max: 64,
                checksums: true,
            },
        ),
        gate: Rc::new(WriteGate::default()),
        peers: Rc::new(Peers::new(
            TransportKind::Tcp,
            None,
            Duration::from_secs(2),
            Duration::from_secs(5),
            256,
            metrics.clone(),
            liveness.clone(),
            None,
            OsdId(0),
        )),
        hello_gate: crate::hello_gate::HelloGate::new(OsdId(0), None),
        stall_bounds: crate::config::OsdConfig::default().stall_bounds(),
        liveness,
        metrics,
        max_inflight: 16,
        reply_slots_max: 0,
        reply_slot_payload_max: 0,
        reply_area_over_emulated: false,
        slots: Rc::new(RefCell::new(crate::connection_slots::ConnectionSlots::new(
            16, 16, 1,
        ))),
        client_bytes: crate::byte_budget::ByteBudget::new(16 << 20, None),
        peer_bytes: crate::byte_budget::ByteBudget::new(16 << 20, None),
        sessions: RefCell::default(),
        pgs: RefCell::new(crate::pg_core::PgCores::new(16)),
        recovery: Default::default(),
        recovery_shared: Arc::default(),
        recovery_max_active: 2,
        recovery_bytes_per_sec: 0,
        scrub_interval: Duration::ZERO,
        scrub_bytes_per_sec: 0,
        stray_delete_delay: Duration::from_secs(5),
    })
}

#[test]
fn a_client_write_to_an_object_under_recovery_waits_for_its_copy() {
    let dir = tempfile::tempdir().unwrap();
    let (member, seen) = scripted_member(Duration::from_millis(300));
    let shard = shard(dir.path(), member);
    let object = ObjectId {
        volume: VolumeId(1),
        index: 0,
    };
    let target = move |offset| IoTarget {
        pg: PgId(0),
        object,
        offset,
        length: 4096,
    };
    let (tx, rx) = mpsc::channel();
    let mut r = Reactor::new(Default::default()).unwrap();
    r.block_on(async move {
        // Data the member lacks.
        shard
            .store
            .write(
                PgId(0),
                object,
                0,
                PayloadBuf::copy_from(&[7u8; 8192]),
                false,
            )
            .await
            .unwrap();
        let view = shard.view();
        let (s, v) = (shard.clone(), view.clone());
        let copy = reactor::spawn(async move {
            s.sync_object(&v, PgId(0), object, OsdId(2), Some(vec![(0, 8192)]))
                .await
        });
        reactor::sleep(Duration::from_millis(50)).await;
        // A client write to another byte range of the same object.
        let write = Message::Write {
            id: RequestId(9),
            epoch: Epoch(5),
            target: target(65536),
            flags: 0,
            seq: PgSeq(0),
            op: flame_common::ids::OpId::NONE,
            remote: None,
            data: PayloadBuf::copy_from(&[1u8; 4096]),
        };
        let st = shard.replicate(&view, write).await;
        tx.send((copy.await, st)).unwrap();
    })
    .unwrap();
    let (copied, st) = rx.recv().unwrap();
    assert_eq!(copied, Ok(true));
    assert_eq!(st, status::OK);
    let seen = seen.lock().unwrap().clone();
    let copy_answered = seen
        .iter()
        .filter(|(seq, _, _)| *seq == 0)
        .filter_map(|(_, _, answered)| *answered)
        .max()
        .expect("the member got no recovery copy");
    let (_, client_arrived, _) = seen
        .iter()
        .find(|(seq, _, _)| *seq > 0)
        .expect("the member got no client write");
    assert!(
        *client_arrived >= copy_answered,
        "the client write reached the member before its recovery copy finished: {seen:?}"
    );
}

/// A scrub runs only on a group peered under this shard's current primacy and
/// while the lease holds (seeds 230204, 231501): otherwise EAGAIN (the client
/// retries) before anything is compared.
#[test]
fn a_scrub_needs_the_peered_primacy_and_the_lease() {
    let dir = tempfile::tempdir().unwrap();
    // OSD 1 (this shard) holds the group's only complete copy: its primary.
    let shard = shard(dir.path(), scripted_copy(|_| None));
    let mut r = Reactor::new(Default::default()).unwrap();
    r.block_on(async move {
        let view = shard.view();
        let pg = PgId(0);
        let scrub = || shard.scrub_pg(&view, pg, false);
        // Neither peered nor leased.
        assert_eq!(scrub().await, Err(status::EAGAIN));
        // Peered, no lease (a primary cut from the manager may have been
        // replaced without knowing it).
        let primacy = shard.pgs.borrow().primacy(pg);
        shard.recovery.peered.borrow_mut().insert(pg, primacy);
        assert_eq!(scrub().await, Err(status::EAGAIN));
        // Both: it scrubs.
        shard.liveness.renew(shard.liveness.now_ms(), 60_000);
        assert!(scrub().await.is_ok());
        // Leased, but the primacy peered is not the current one.
        shard.recovery.peered.borrow_mut().insert(pg, primacy + 1);
        assert_eq!(scrub().await, Err(status::EAGAIN));
    })
    .unwrap();
}

/// Only members being recovered count as objects to recover: a comparison of
/// a complete copy (peering, a restarted member's doubt, a lagging member's
/// catch-up) shows apart. A primary that returned peers its groups after its
/// own recovery, when the map shows them clean, and the cluster's status went
/// from "finishing" back to objects to recover (a CI run at 266688f).
#[test]
fn comparisons_of_complete_copies_are_not_objects_to_recover() {
    let dir = tempfile::tempdir().unwrap();
    let shard = shard(dir.path(), scripted_copy(|_| None));
    let view = shard.view();
    let pg = PgId(0);
    // OSD 2 is being recovered (3 objects left); a complete copy (OSD 3 here,
    // any member not recovering) is being compared (4 left).
    let jobs = &shard.recovery.remaining_per_job;
    jobs.borrow_mut().insert((pg, OsdId(2)), 3);
    jobs.borrow_mut().insert((pg, OsdId(3)), 4);
    shard.publish_status(&view);
    let work = shard.recovery_shared.work();
    assert_eq!((work.objects, work.pgs_recovering), (3, 1));
    let status = shard.recovery_shared.pgs.lock().unwrap()[&pg].clone();
    assert_eq!((status.objects_remaining, status.objects_comparing), (3, 4));
    // Only the comparison left: nothing to recover.
    jobs.borrow_mut().remove(&(pg, OsdId(2)));
    jobs.borrow_mut().insert((pg, OsdId(2)), 0);
    shard.publish_status(&view);
    assert_eq!(shard.recovery_shared.work().objects, 0);
}
