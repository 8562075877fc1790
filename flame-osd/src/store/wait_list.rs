//! Tasks of one shard thread waiting for "something changed" (the journal's writer
//! role came free, the store drained its in-flight writes), woken all at once.
//!
//! Waiters re-check their condition after every wake-up, so a spurious or early
//! wake costs a loop, never a wrong decision; no lock, because one thread owns it.

use std::cell::RefCell;
use std::task::{Poll, Waker};

/// Wakers of the tasks waiting for the next [`WaitList::wake_all`].
#[derive(Default)]
pub struct WaitList {
    waiters: RefCell<Vec<Waker>>,
}

impl WaitList {
    /// Wakes every task waiting now.
    pub fn wake_all(&self) {
        for w in self.waiters.borrow_mut().drain(..) {
            w.wake();
        }
    }

    /// Waits for the next [`WaitList::wake_all`].
    pub async fn wait(&self) {
        let mut registered = false;
        std::future::poll_fn(|cx| {
            if registered {
                Poll::Ready(())
            } else {
                registered = true;
                self.waiters.borrow_mut().push(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }
}
