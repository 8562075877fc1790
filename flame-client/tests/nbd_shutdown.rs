//! Graceful shutdown: on SIGTERM flame-nbd answers new requests with ESHUTDOWN (so
//! clients disconnect cleanly), refuses new connections, and exits once its
//! clients are gone.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

mod nbd_common;

use flame_client::nbd::proto::*;
use nbd_common::*;
use std::time::Duration;

#[test]
fn sigterm_answers_eshutdown_then_exits_when_clients_leave() {
    let mut srv = NbdServer::start(&["disk=1M"], "");
    let mut r = Raw::connect(srv.port);
    r.go("disk", false);
    r.request(CMD_WRITE, 0, 1, 0, 4096, &[7u8; 4096]);
    assert_eq!(r.simple_reply(), (0, 1));

    // SAFETY: signalling the child process this test started.
    assert_eq!(unsafe { libc::kill(srv.pid() as i32, libc::SIGTERM) }, 0);
    std::thread::sleep(Duration::from_millis(200));
    // Still running while a client is connected; new work is refused.
    srv.assert_alive();
    r.request(CMD_WRITE, 0, 2, 0, 4096, &[8u8; 4096]);
    assert_eq!(r.simple_reply(), (errno::ESHUTDOWN, 2));
    r.request(CMD_READ, 0, 3, 0, 4096, &[]);
    assert_eq!(r.simple_reply(), (errno::ESHUTDOWN, 3));
    // The client disconnects as the spec asks; the server then exits cleanly.
    r.request(CMD_DISC, 0, 4, 0, 0, &[]);
    let status = srv
        .wait_exit(Duration::from_secs(5))
        .expect("flame-nbd did not exit after its last client left");
    assert!(status.success(), "exit status {status}");
}
