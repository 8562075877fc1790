//! The manager under a flood: half-sent requests, long-polls, signed commits and
//! status reads, all at once, while three OSDs heartbeat. The OSDs must stay up
//! (their heartbeats are answered ahead of the API load, flame-mgr/src/shared.rs)
//! and half-sent requests, silent connections and HTTP/2 prefaces must be cut
//! at the header timeout (flame-mgr/src/server.rs), not held. Bounded: 6 s of flood, every loop
//! counted.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_tests::{ClusterOptions, TestCluster};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const FLOOD: Duration = Duration::from_secs(6);

#[test]
fn a_flooded_manager_keeps_every_osd_up_and_cuts_half_sent_requests() {
    let cluster = TestCluster::start_with(ClusterOptions {
        mgr_extra_yaml:
            "header_read_timeout_ms: 1000\nidle_timeout_ms: 2000\nconnections_max: 512\n".into(),
        ..ClusterOptions::default()
    });
    let mgr = cluster.mgr_addr();
    let epoch0 = cluster.map().epoch;
    let stop = Arc::new(AtomicBool::new(false));
    let commits = Arc::new(AtomicU64::new(0));
    let polls = Arc::new(AtomicU64::new(0));
    let mut threads = Vec::new();
    // Signed commits: volume create and delete, as fast as they go.
    for t in 0..8 {
        let c = cluster.mgr_endpoint(cluster.keys().map(|k| k.creds("client.admin", 1)));
        let (stop, commits) = (stop.clone(), commits.clone());
        threads.push(std::thread::spawn(move || {
            for i in 0..100_000u64 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let name = format!("flood-{t}-{i}");
                let body = format!("{{\"name\":\"{name}\",\"size\":1048576}}");
                let _ = flame_tests::mgr_call_as(&c, "POST", "/v1/volumes", Some(body.as_bytes()));
                let _ =
                    flame_tests::mgr_call_as(&c, "DELETE", &format!("/v1/volumes/{name}"), None);
                commits.fetch_add(2, Ordering::Relaxed);
            }
        }));
    }
    // Long-polls for an epoch that will not come soon, and status reads.
    for t in 0..8 {
        let c = cluster.mgr_endpoint(cluster.keys().map(|k| k.creds("client.admin", 1)));
        let (stop, polls) = (stop.clone(), polls.clone());
        threads.push(std::thread::spawn(move || {
            for _ in 0..100_000u64 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let path = if t % 2 == 0 {
                    "/v1/map?min_epoch=999999999&wait_ms=2000".to_string()
                } else {
                    "/v1/status".to_string()
                };
                let _ = flame_tests::mgr_call_as(&c, "GET", &path, None);
                polls.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    // Half-sent requests, in waves of 200: each must be closed by the manager
    // within a few header timeouts.
    let started = Instant::now();
    let mut half_sent = 0u64;
    let mut cut = 0u64;
    let mut up_checks = 0u64;
    while started.elapsed() < FLOOD {
        let mut wave = Vec::new();
        for _ in 0..200 {
            if let Ok(mut s) = TcpStream::connect(mgr) {
                let _ = s.write_all(b"POST /v1/volumes HTTP/1.1\r\nHost: flood\r\nContent-Len");
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                wave.push(s);
            }
        }
        half_sent += wave.len() as u64;
        for mut s in wave {
            let mut b = [0u8; 256];
            // Closed (0 or an error) or an error answer, within the timeout.
            match s.read(&mut b) {
                Ok(_) => cut += 1,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => cut += 1,
                Err(e) => panic!("a half-sent request was held over 5 s: {e}"),
            }
        }
        // Every OSD up, all along.
        let map = cluster.map();
        let down: Vec<_> = map.osds.values().filter(|o| !o.up).map(|o| o.id).collect();
        assert!(down.is_empty(), "OSDs {down:?} marked down under the flood");
        up_checks += 1;
    }
    stop.store(true, Ordering::Relaxed);
    for t in threads {
        t.join().unwrap();
    }
    println!(
        "flood of {:?}: {half_sent} half-sent requests ({cut} cut), {} commits, {} long-polls and status reads, {up_checks} checks with every OSD up",
        started.elapsed(),
        commits.load(Ordering::Relaxed),
        polls.load(Ordering::Relaxed)
    );
    assert_eq!(cut, half_sent);
    assert!(commits.load(Ordering::Relaxed) > 0, "no commit got through");
    // Peers that send nothing, or only an HTTP/2 preface (which protocol
    // sniffing once took and held without a timer), are cut too.
    let mut quiet = Vec::new();
    for i in 0..100 {
        let mut s = TcpStream::connect(mgr).expect("connect");
        if i % 2 == 1 {
            let _ = s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
        }
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        quiet.push(s);
    }
    for (i, mut s) in quiet.into_iter().enumerate() {
        let mut b = [0u8; 256];
        // Bounded: the stream closes (0), errs, or the 5 s timeout panics.
        for _ in 0..64 {
            match s.read(&mut b) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
                Err(e) => panic!("a silent or HTTP/2 connection ({i}) was held over 5 s: {e}"),
            }
        }
    }
    // No OSD was marked down at any time: the map's OSDs never changed state
    // (each volume create and delete moved the epoch, nothing else did).
    let map = cluster.map();
    assert!(map.osds.values().all(|o| o.up));
    assert!(map.epoch > epoch0);
    // A client that pipelines requests and never reads the answers: once the
    // socket buffers are full nothing moves and no request is in service, so
    // the idle bound (2 s) closes it; without it the manager's write would
    // wait for good, and reading later would get every answer.
    let mut s = TcpStream::connect(mgr).expect("connect");
    const PIPELINED: usize = 2000;
    let request = b"GET /metrics HTTP/1.1\r\nHost: flood\r\n\r\n".repeat(PIPELINED);
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    let _ = s.write_all(&request);
    std::thread::sleep(Duration::from_secs(5));
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (mut got, mut b) = (Vec::new(), vec![0u8; 1 << 16]);
    // Bounded: the stream ends, or a 10 s read timeout ends the loop.
    for _ in 0..1_000_000 {
        match s.read(&mut b) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&b[..n]),
        }
    }
    let answers = got.windows(9).filter(|w| w == b"HTTP/1.1 ").count();
    assert!(
        answers < PIPELINED,
        "a client that read nothing for 5 s got all {answers} answers: never closed as idle"
    );
    // And I/O works after it.
    let vol = cluster.create_volume("after", 1 << 20);
    assert_eq!(vol.size, 1 << 20);
}

/// One address cannot take every connection of the manager: with
/// `connections_per_source_max: 16`, 16 silent connections from 127.0.0.5
/// hold their slots, the 17th from there is closed at once and counted, and
/// the manager goes on serving everyone else (the harness's map read, the
/// OSDs' heartbeats).
#[test]
fn one_address_holds_at_most_its_share_of_manager_connections() {
    let cluster = TestCluster::start_with(ClusterOptions {
        mgr_extra_yaml: "connections_per_source_max: 16\nheader_read_timeout_ms: 8000\n".into(),
        ..ClusterOptions::default()
    });
    let mgr = cluster.mgr_addr();
    let from = |ip: &str| -> std::io::Result<TcpStream> {
        let sock = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
        sock.bind(&std::net::SocketAddr::new(ip.parse().unwrap(), 0).into())?;
        sock.connect(&mgr.into())?;
        Ok(sock.into())
    };
    let held: Vec<TcpStream> = (0..16).map(|_| from("127.0.0.5").unwrap()).collect();
    // Let the manager accept them all.
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let mut extra = from("127.0.0.5").unwrap();
    extra
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let _ = extra.write_all(b"GET /metrics HTTP/1.1\r\nHost: m\r\n\r\n");
    let mut got = Vec::new();
    let _ = extra.read_to_end(&mut got);
    assert!(
        got.is_empty(),
        "the 17th connection from one address was served: {}",
        String::from_utf8_lossy(&got)
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "the 17th connection was held, not closed"
    );
    // Everyone else is served meanwhile.
    let epoch = cluster.map().epoch;
    assert!(epoch.0 > 0);
    let refused = flame_tests::metric_sum(mgr, "flame_mgr_connections_refused_total", "");
    assert!(refused >= 1, "refusals not counted");
    drop(held);
}

/// A signed request whose body trickles is cut at the header timeout, like one
/// whose headers trickle: a caller naming a known entity cannot hold a
/// connection by sending its body slowly (hyper bounds only the head).
#[test]
fn a_trickled_body_is_cut_at_the_timeout() {
    let cluster = TestCluster::start_with(ClusterOptions {
        mgr_extra_yaml: "header_read_timeout_ms: 1000\n".into(),
        ..ClusterOptions::default()
    });
    let Some(keys) = cluster.keys() else {
        // With `auth: none` the handlers read the body themselves.
        return;
    };
    let creds = keys.creds("client.admin", 1);
    let body = b"{\"name\":\"slow\",\"size\":1048576}";
    let auth = creds.sign(
        "POST",
        "/v1/volumes",
        body,
        flame_common::clock::unix_ms(),
        flame_common::auth::Nonce::random().unwrap(),
    );
    let mut s = TcpStream::connect(cluster.mgr_addr()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /v1/volumes HTTP/1.1\r\nHost: m\r\nContent-Type: application/json\r\n\
         Authorization: {}\r\nContent-Length: {}\r\n\r\n",
        auth.to_header(),
        body.len()
    )
    .unwrap();
    s.write_all(&body[..5]).unwrap();
    let started = Instant::now();
    let mut got = String::new();
    let _ = s.read_to_string(&mut got);
    let took = started.elapsed();
    assert!(got.starts_with("HTTP/1.1 408"), "answer: {got:?}");
    assert!(took < Duration::from_secs(4), "cut after {took:?}");
    assert!(
        !cluster.map().volumes.contains_key("slow"),
        "the cut request changed the map"
    );
}

/// Requests anyone can send and the manager refuses (no signature here) are
/// each counted, but logged at most 20 times per 10 s (`api.rs`,
/// REFUSAL_LINES), so that a flood of them neither fills the disk nor buries
/// the lines that matter.
#[test]
fn refused_requests_are_counted_each_but_logged_within_a_bound() {
    const REQUESTS: u64 = 100;
    let cluster = TestCluster::start_with(ClusterOptions {
        auth: true,
        ..ClusterOptions::default()
    });
    let mgr = cluster.mgr_addr();
    for _ in 0..REQUESTS {
        let (code, _) = flame_tests::http_get(mgr, "/v1/status").unwrap();
        assert_eq!(code, 401, "an unsigned status read");
    }
    let counted = flame_tests::metric_sum(mgr, "flame_mgr_auth_refusals_total", "");
    assert!(
        counted >= REQUESTS,
        "{counted} refusals counted of {REQUESTS}"
    );
    let lines = cluster.mgr_log().matches("refused GET /v1/status").count();
    assert!(
        (1..=40).contains(&lines),
        "{lines} log lines for {REQUESTS} refused requests"
    );
}
