//! The reactor's record of one submitted io_uring operation.
//!
//! Its own module so that the executor (which owns the table of slots and fills
//! them from completions) and the operation futures (which create and poll them)
//! both depend on it, and not on each other in a circle.

use std::any::Any;
use std::task::Waker;

/// State of one submitted operation, kept in the reactor's table under its
/// `user_data`.
pub(crate) struct OpSlot {
    /// Completion result once it arrived.
    pub(crate) result: Option<i32>,
    /// Task to wake on completion.
    pub(crate) waker: Option<Waker>,
    /// Memory the kernel may still touch; dropped only after completion.
    pub(crate) resources: Option<Box<dyn Any>>,
    /// The future was dropped: free the slot when the completion arrives.
    pub(crate) orphaned: bool,
    /// Cancel the operation in the kernel if its future is dropped (timers and
    /// socket waits; never writes, whose effect must not be left half-known).
    pub(crate) cancel_on_drop: bool,
}
