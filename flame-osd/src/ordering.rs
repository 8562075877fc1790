//! One order for overlapping writes on every copy.
//!
//! Two writes to overlapping bytes of an object, in flight together, could land in
//! different orders on the primary and on a replica (io_uring does not order
//! independent operations), leaving the copies different. The primary therefore
//! admits a write only after every earlier overlapping write has finished on all
//! copies. The replica needs no gate of its own: the primary never has two
//! overlapping writes outstanding, so a replica never sees them concurrently either.
//! Non-overlapping writes run in parallel.

use flame_common::collections::HashMap;
use flame_common::ids::ObjectId;
use std::cell::{Cell, RefCell};

use std::rc::Rc;
use std::task::{Poll, Waker};

/// A one-shot, single-thread event: set once, wakes every waiter.
#[derive(Default)]
pub struct Event {
    set: Cell<bool>,
    waiters: RefCell<Vec<Waker>>,
}

impl Event {
    /// Sets the event and wakes all waiters.
    pub fn set(&self) {
        self.set.set(true);
        for w in self.waiters.borrow_mut().drain(..) {
            w.wake();
        }
    }

    /// Waits until the event is set.
    pub async fn wait(&self) {
        std::future::poll_fn(|cx| {
            if self.set.get() {
                Poll::Ready(())
            } else {
                self.waiters.borrow_mut().push(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }
}

struct Entry {
    id: u64,
    start: u32,
    end: u32,
    done: Rc<Event>,
}

/// The in-flight writes of one shard, per object.
#[derive(Default)]
pub struct WriteGate {
    inflight: RefCell<HashMap<ObjectId, Vec<Entry>>>,
    next_id: Cell<u64>,
}

/// Held while a write is in flight; dropping it (completion, error or a cancelled
/// task) releases the writes waiting behind it.
pub struct GateGuard {
    gate: Rc<WriteGate>,
    object: ObjectId,
    id: u64,
    done: Rc<Event>,
}

impl WriteGate {
    /// Registers a write of `[start, end)`. Must be called before the request's
    /// first await, so admission order is arrival order. Returns the guard and the
    /// earlier overlapping writes to wait for.
    pub fn enter(
        self: &Rc<Self>,
        object: ObjectId,
        start: u32,
        end: u32,
    ) -> (GateGuard, Vec<Rc<Event>>) {
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        let done = Rc::new(Event::default());
        let mut inflight = self.inflight.borrow_mut();
        let list = inflight.entry(object).or_default();
        let waits = list
            .iter()
            .filter(|e| e.start < end && start < e.end)
            .map(|e| e.done.clone())
            .collect();
        list.push(Entry {
            id,
            start,
            end,
            done: done.clone(),
        });
        (
            GateGuard {
                gate: self.clone(),
                object,
                id,
                done,
            },
            waits,
        )
    }

    /// Writes in flight.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inflight.borrow().values().map(Vec::len).sum()
    }
}

impl Drop for GateGuard {
    fn drop(&mut self) {
        let mut inflight = self.gate.inflight.borrow_mut();
        if let Some(list) = inflight.get_mut(&self.object) {
            list.retain(|e| e.id != self.id);
            if list.is_empty() {
                inflight.remove(&self.object);
            }
        }
        drop(inflight);
        self.done.set();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::ids::VolumeId;

    #[test]
    fn only_overlaps_wait_and_release_on_drop() {
        let g = Rc::new(WriteGate::default());
        let o = ObjectId {
            volume: VolumeId(1),
            index: 0,
        };
        let (a, wa) = g.enter(o, 0, 4096);
        assert!(wa.is_empty());
        let (_b, wb) = g.enter(o, 4096, 8192);
        assert!(wb.is_empty(), "adjacent ranges do not overlap");
        let (_c, wc) = g.enter(o, 4000, 4100);
        assert_eq!(wc.len(), 2);
        let other = ObjectId {
            volume: VolumeId(1),
            index: 1,
        };
        let (_d, wd) = g.enter(other, 0, 4096);
        assert!(wd.is_empty());
        assert!(!wc[0].set.get());
        drop(a);
        assert!(wc[0].set.get());
        assert_eq!(g.len(), 3);
    }
}
