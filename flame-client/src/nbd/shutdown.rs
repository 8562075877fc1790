//! The graceful-shutdown flag, in a module of its own so that the accept loop
//! ([`super::server`]) and the request loop ([`super::transmission`]) both read it
//! without depending on each other.

use std::sync::atomic::Ordering;

/// Set when the server is asked to stop (SIGTERM): new connections are refused and
/// every new request is answered `ESHUTDOWN`, so clients disconnect cleanly, while
/// requests already in flight finish and get their replies.
static SHUTTING_DOWN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Starts a graceful shutdown: new connections are refused and new requests are
/// answered `ESHUTDOWN`, while requests in flight finish.
pub fn begin_shutdown() {
    SHUTTING_DOWN.store(true, Ordering::SeqCst);
}

/// Whether a graceful shutdown has begun.
pub fn shutting_down() -> bool {
    SHUTTING_DOWN.load(Ordering::SeqCst)
}
