//! What the block bridges — `flame-nbd` and `flame-ublk` — share: connecting the
//! client library to the cluster at start-up, and the stop signals.
//!
//! Both bridges are one process holding one [`Cluster`] handle, cloned into each
//! data-path thread, and both stop on SIGTERM/SIGINT, which every thread must have
//! blocked so that only the thread waiting for them sees them.

use crate::{ClientConfig, ClientError, Cluster};
use std::time::Duration;

/// How long start-up keeps trying to reach the manager (it may be starting too).
pub const MGR_CONNECT_PATIENCE: Duration = Duration::from_secs(30);

/// Connects the client library to the cluster, retrying for
/// [`MGR_CONNECT_PATIENCE`] while the manager comes up; a configuration error and
/// a refused key (401/403: retrying with the same key cannot help) are returned at
/// once.
pub fn connect_cluster(client: ClientConfig) -> Result<Cluster, ClientError> {
    let deadline = flame_common::clock::now() + MGR_CONNECT_PATIENCE;
    loop {
        match Cluster::connect(client.clone()) {
            Ok(c) => return Ok(c),
            Err(e @ ClientError::InvalidArgument(_)) => return Err(e),
            Err(
                e @ ClientError::Api {
                    status: 401 | 403, ..
                },
            ) => return Err(e),
            Err(e) if flame_common::clock::now() >= deadline => return Err(e),
            Err(e) => {
                tracing::warn!("manager at {} not reachable yet: {e}", client.mgr);
                flame_common::clock::sleep_blocking(Duration::from_millis(500));
            }
        }
    }
}

/// Blocks SIGTERM and SIGINT in the calling thread (and the threads it spawns
/// later), returning the set to wait on; `None` if that fails (then signals keep
/// their default effect: immediate exit). Call it before any thread exists.
pub fn block_stop_signals() -> Option<libc::sigset_t> {
    // SAFETY: plain sigset manipulation on a zeroed set we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        (libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) == 0).then_some(set)
    }
}

/// Waits up to `timeout` for one of the signals of `set` (blocked, see
/// [`block_stop_signals`]); returns it, or `None` when the time passed first.
pub fn wait_signal(set: &libc::sigset_t, timeout: Duration) -> Option<libc::c_int> {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: a valid set and timespec; no siginfo is asked for.
    let sig = unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &ts) };
    (sig > 0).then_some(sig)
}
