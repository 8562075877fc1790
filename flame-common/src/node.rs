//! Per-process state that lives in thread-locals, made separate per simulated
//! node.
//!
//! A daemon keeps some of its state in thread-locals: the client's table of OSD
//! connections and its sessions, its deadline wheel and placement caches, a
//! reactor thread's receive shares, its listeners' bring-ups, its memory pool.
//! In production a thread belongs to one process, so a thread-local is that
//! process's (or that reactor thread's) own. The deterministic simulator
//! (`tests/src/sim/`) runs every OSD, client and the manager on *one* thread: a
//! plain thread-local would be one state shared by all of them — two clients
//! sharing one connection table see each other's connections come and go, which
//! makes resends no deployment has and hides those it has.
//!
//! Such state is declared as a [`NodeLocal`] inside `thread_local!` and read
//! with [`NodeLocalKey::with_node`]. Outside the simulator nothing else
//! happens: the value is the thread's, at the cost of the thread-local read the
//! plain version made (plus a borrow flag and an `Option` check on the same
//! cache line). The simulator names the node it is about to step with
//! [`switch_to`] (through `transport::sim::set_current_node`): every
//! `NodeLocal` value of the node it leaves is parked, and the values of the node
//! it enters are put back (a node seen for the first time starts with none: its
//! values are made on first use, as in a new process). When a simulated process
//! dies ([`end_current`]), its values are dropped, as a process's memory is: a
//! restarted OSD or client starts with nothing of the old one's.
//!
//! What is *not* here, on purpose (docs/testing.md lists it): the virtual clock
//! and the simulated network, which every node shares as machines share time and
//! a wire; the seeded generator of [`crate::entropy`] and the hash keys of
//! [`crate::collections`], per-thread in production too (sharing them changes
//! which values are drawn, never who sees whose state); the reactor's current
//! reactor, which each node's own `Reactor` sets while it runs; the heap pool's
//! recycled mappings (memory reuse only); and the Prometheus registries, which
//! count and are never read back by any decision.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::thread::LocalKey;

/// A simulated node's name: its address, as the simulated network knows it.
pub type NodeId = IpAddr;

/// Per-process state in a thread-local: the thread's own value in production,
/// one value per node in the simulator (see the module docs). Made on first use
/// by its `init`.
pub struct NodeLocal<T: 'static> {
    value: RefCell<Option<T>>,
    init: fn() -> T,
    registered: Cell<bool>,
}

impl<T: 'static> NodeLocal<T> {
    /// A slot whose value `init` makes on first use (in each simulated node).
    pub const fn new(init: fn() -> T) -> NodeLocal<T> {
        NodeLocal {
            value: RefCell::new(None),
            init,
            registered: Cell::new(false),
        }
    }
}

/// Access to a thread-local [`NodeLocal`].
pub trait NodeLocalKey<T: 'static> {
    /// Runs `f` with the current node's value, made first if it has none.
    /// Panics during the thread's teardown, like `LocalKey::with`.
    fn with_node<R>(&'static self, f: impl FnOnce(&T) -> R) -> R;

    /// Like [`NodeLocalKey::with_node`], but `None` instead of panicking when
    /// the thread-local is gone (teardown) or being switched (drop paths).
    fn try_with_node<R>(&'static self, f: impl FnOnce(&T) -> R) -> Option<R>;
}

impl<T: 'static> NodeLocalKey<T> for LocalKey<NodeLocal<T>> {
    #[inline]
    fn with_node<R>(&'static self, f: impl FnOnce(&T) -> R) -> R {
        self.with(|n| {
            if let Some(v) = n.value.borrow().as_ref() {
                return f(v);
            }
            made(self, n);
            let v = n.value.borrow();
            match v.as_ref() {
                Some(v) => f(v),
                None => unreachable!("a node-local value was just made"),
            }
        })
    }

    #[inline]
    fn try_with_node<R>(&'static self, f: impl FnOnce(&T) -> R) -> Option<R> {
        self.try_with(|n| {
            if n.value.try_borrow().ok()?.is_none() {
                let mut v = n.value.try_borrow_mut().ok()?;
                *v = Some((n.init)());
                drop(v);
                register(self, n);
            }
            let v = n.value.try_borrow().ok()?;
            v.as_ref().map(f)
        })
        .ok()
        .flatten()
    }
}

/// Makes `n`'s value (first use in this node) and registers the slot with the
/// thread's switcher.
#[cold]
fn made<T: 'static>(key: &'static LocalKey<NodeLocal<T>>, n: &NodeLocal<T>) {
    let v = (n.init)();
    *n.value.borrow_mut() = Some(v);
    register(key, n);
}

fn register<T: 'static>(key: &'static LocalKey<NodeLocal<T>>, n: &NodeLocal<T>) {
    if !n.registered.replace(true) {
        let _ = SLOTS.try_with(|s| s.borrow_mut().push(key));
    }
}

/// What the switcher does with one registered slot, type-erased.
trait Slot {
    /// Takes the loaded value out (`None`: none made in this node).
    fn take(&'static self) -> Option<Box<dyn Any>>;
    /// Puts a parked value in (the slot is empty).
    fn put(&'static self, v: Option<Box<dyn Any>>);
    /// The value's type, for a diagnostic.
    fn name(&'static self) -> &'static str;
}

impl<T: 'static> Slot for LocalKey<NodeLocal<T>> {
    fn take(&'static self) -> Option<Box<dyn Any>> {
        self.try_with(|n| {
            let mut v = n.value.try_borrow_mut().unwrap_or_else(|_| {
                panic!(
                    "switching simulated nodes while {} is in use",
                    std::any::type_name::<T>()
                )
            });
            v.take().map(|v| Box::new(v) as Box<dyn Any>)
        })
        .ok()
        .flatten()
    }

    fn put(&'static self, v: Option<Box<dyn Any>>) {
        let v = v.and_then(|b| b.downcast::<T>().ok()).map(|b| *b);
        let _ = self.try_with(|n| *n.value.borrow_mut() = v);
    }

    fn name(&'static self) -> &'static str {
        std::any::type_name::<T>()
    }
}

/// The values of one node while another is loaded, by slot index (slots
/// registered since it was parked have none).
type Parked = Vec<Option<Box<dyn Any>>>;

thread_local! {
    /// Every `NodeLocal` this thread has used, in order of first use.
    static SLOTS: RefCell<Vec<&'static dyn Slot>> = const { RefCell::new(Vec::new()) };
    /// The node whose values are loaded (`None`: outside any node — production,
    /// or the simulator's own code).
    static CURRENT: Cell<Option<NodeId>> = const { Cell::new(None) };
    /// Every other node's values (`None`: the outside's).
    static PARKED: RefCell<BTreeMap<Option<NodeId>, Parked>> = const { RefCell::new(BTreeMap::new()) };
}

/// The node whose per-process state is loaded on this thread (`None` outside
/// the simulator, or between its nodes' steps).
pub fn current() -> Option<NodeId> {
    CURRENT.with(Cell::get)
}

fn slots() -> Vec<&'static dyn Slot> {
    SLOTS.with(|s| s.borrow().clone())
}

/// The simulator: makes `node` the node whose per-process state the thread's
/// [`NodeLocal`]s hold, parking the previous node's (see the module docs).
///
/// Panics (a simulator bug, which the simulator reports as the seed's failure)
/// when entering a node finds per-process state made outside any node: code of
/// no process — the simulator's own — made or kept process state, which would
/// then be nobody's, or leak into whichever node used it next.
pub fn switch_to(node: Option<NodeId>) {
    let was = current();
    if was == node {
        return;
    }
    let slots = slots();
    let out: Parked = slots.iter().map(|s| s.take()).collect();
    if was.is_none() && node.is_some() {
        let made: Vec<&str> = slots
            .iter()
            .zip(&out)
            .filter(|(_, v)| v.is_some())
            .map(|(s, _)| s.name())
            .collect();
        assert!(
            made.is_empty(),
            "per-process state made outside any simulated node: {}",
            made.join(", ")
        );
    }
    let mut incoming = PARKED.with(|p| {
        let mut p = p.borrow_mut();
        if out.iter().any(Option::is_some) {
            p.insert(was, out);
        }
        p.remove(&node).unwrap_or_default()
    });
    for (i, s) in slots.iter().enumerate() {
        s.put(incoming.get_mut(i).and_then(Option::take));
    }
    CURRENT.with(|c| c.set(node));
}

/// The simulator: the current node's process died (kill -9, power loss, a
/// stop): drops every per-process value it had, as the kernel frees a dead
/// process's memory, so that a process started again on the node starts with
/// none. Drops run with the node still current (what they touch is the node's
/// own); values made again by those drops are dropped too.
///
/// Call it after dropping the process's reactor (with the node current too:
/// its tasks' drops touch its state).
pub fn end_current() {
    for _ in 0..16 {
        let values: Vec<Box<dyn Any>> = slots().iter().filter_map(|s| s.take()).collect();
        if values.is_empty() {
            return;
        }
        drop(values);
    }
    panic!("a dead process's state keeps being made again by its own drops");
}

/// How many per-process values `node` holds (loaded or parked): 0 for a node
/// never run or whose process [`end_current`] ended and nothing ran since.
pub fn values_held(node: Option<NodeId>) -> usize {
    if current() == node {
        return SLOTS.with(|s| {
            s.borrow()
                .iter()
                .filter(|s| {
                    let v = s.take();
                    let held = v.is_some();
                    s.put(v);
                    held
                })
                .count()
        });
    }
    PARKED.with(|p| {
        p.borrow()
            .get(&node)
            .map_or(0, |v| v.iter().filter(|v| v.is_some()).count())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv4Addr;
    use std::rc::Rc;

    const A: NodeId = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1));
    const B: NodeId = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2));

    thread_local! {
        static COUNT: NodeLocal<Cell<u64>> = const { NodeLocal::new(|| Cell::new(0)) };
        static DROPS: NodeLocal<RefCell<Vec<Rc<()>>>> = const { NodeLocal::new(|| RefCell::new(Vec::new())) };
    }

    fn bump() -> u64 {
        COUNT.with_node(|c| {
            c.set(c.get() + 1);
            c.get()
        })
    }

    fn on_thread(f: impl FnOnce() + Send + 'static) {
        std::thread::spawn(f).join().unwrap();
    }

    #[test]
    fn outside_the_simulator_a_node_local_is_the_threads() {
        on_thread(|| {
            assert_eq!(current(), None);
            assert_eq!((bump(), bump()), (1, 2));
            // Another thread has its own.
            on_thread(|| assert_eq!(bump(), 1));
            assert_eq!(bump(), 3);
        });
    }

    #[test]
    fn each_node_has_its_own_values_and_they_survive_switches() {
        on_thread(|| {
            switch_to(Some(A));
            assert_eq!((bump(), bump()), (1, 2));
            switch_to(Some(B));
            assert_eq!(bump(), 1, "B sees none of A's state");
            switch_to(None);
            switch_to(Some(A));
            assert_eq!(bump(), 3, "A finds its own again");
            switch_to(Some(B));
            assert_eq!(bump(), 2);
            assert_eq!(values_held(Some(A)), 1);
            assert_eq!(values_held(Some(B)), 1);
        });
    }

    #[test]
    fn a_dead_process_s_state_is_dropped_and_a_new_one_starts_empty() {
        on_thread(|| {
            let kept = Rc::new(());
            switch_to(Some(A));
            bump();
            DROPS.with_node(|d| d.borrow_mut().push(kept.clone()));
            switch_to(Some(B));
            bump();
            assert_eq!(Rc::strong_count(&kept), 2, "parked, not dropped");
            switch_to(Some(A));
            end_current();
            assert_eq!(Rc::strong_count(&kept), 1, "dropped with the process");
            assert_eq!(values_held(Some(A)), 0);
            assert_eq!(bump(), 1, "a new process on A starts afresh");
            switch_to(Some(B));
            assert_eq!(bump(), 2, "B's untouched");
        });
    }

    #[test]
    #[should_panic(expected = "per-process state made outside any simulated node")]
    fn state_made_outside_any_node_is_refused_when_a_node_is_entered() {
        // On this (test) thread: the panic must reach the test harness.
        switch_to(None);
        bump();
        switch_to(Some(A));
    }
}
