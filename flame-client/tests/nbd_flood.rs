//! A client that sends and never reads cannot make flame-nbd queue replies without
//! bound: the server stops reading it once its replies back up, so the client's own
//! writes block after a bounded amount. (Without that, one such connection grew the
//! server by hundreds of MiB in seconds.)

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

mod nbd_common;

use flame_client::nbd::proto::*;
use nbd_common::*;
use std::io::Write;
use std::time::{Duration, Instant};

/// Writes `unit` repeatedly for up to `for_how_long`, stopping when the socket
/// blocks longer than its write timeout. Returns the bytes the server took.
fn write_until_blocked(r: &mut Raw, unit: &[u8], for_how_long: Duration) -> usize {
    r.s.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let batch: Vec<u8> = unit
        .iter()
        .copied()
        .cycle()
        .take(unit.len() * 1024)
        .collect();
    let t0 = Instant::now();
    let mut sent = 0usize;
    while t0.elapsed() < for_how_long {
        match r.s.write(&batch) {
            Ok(n) => sent += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                break;
            }
            Err(e) => panic!("write failed: {e}"),
        }
    }
    sent
}

/// Far above what socket buffers on both ends hold (a few MiB), far below what an
/// unbounded server would take in the time allowed.
const ACCEPTED_BYTES_MAX: usize = 48 << 20;

#[test]
fn option_flood_without_reading_blocks_the_sender() {
    let mut srv = NbdServer::start(&["disk=1M"], "handshake_timeout_ms: 30000\n");
    let mut r = Raw::connect(srv.port);
    r.start(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES);
    // An unknown option: each one earns an ERR_UNSUP reply we never read.
    let mut opt = IHAVEOPT.to_be_bytes().to_vec();
    opt.extend_from_slice(&99u32.to_be_bytes());
    opt.extend_from_slice(&0u32.to_be_bytes());
    let sent = write_until_blocked(&mut r, &opt, Duration::from_secs(15));
    assert!(
        sent < ACCEPTED_BYTES_MAX,
        "server kept reading options: {} MiB",
        sent >> 20
    );
    srv.assert_alive();
}

#[test]
fn refused_request_flood_without_reading_blocks_the_sender() {
    let mut srv = NbdServer::start(&["disk=1M"], "");
    let mut r = Raw::connect(srv.port);
    r.go("disk", true);
    // Reads far past the end: each is refused with an error chunk we never read.
    let req = encode_request(&Request {
        flags: 0,
        cmd: CMD_READ,
        cookie: 1,
        offset: 1 << 40,
        len: 4096,
    });
    let sent = write_until_blocked(&mut r, &req, Duration::from_secs(15));
    assert!(
        sent < ACCEPTED_BYTES_MAX,
        "server kept reading requests: {} MiB",
        sent >> 20
    );
    srv.assert_alive();
}
