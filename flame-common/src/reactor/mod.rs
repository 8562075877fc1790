//! The per-thread io_uring reactor every data-path thread runs on.
//!
//! Flame's penetrating model needs one thread to carry a request from the socket
//! through decoding, storage I/O and replication to the reply, with no hand-off to
//! another thread and no lock. This module gives such a thread an executor: tasks
//! are `!Send` futures spawned on the current thread (`async-task`), and every
//! operation that would block — socket receive and send, accept, connect, file reads
//! and writes, fsync, fallocate, timers — is an io_uring submission whose completion
//! wakes the task that issued it. Submissions are batched: the loop runs every ready
//! task, then enters the kernel once for all the operations they queued.
//!
//! When no task is ready the thread waits for completions according to its
//! [`PollMode`]: block in the kernel (`interrupt`), spin on the completion queue
//! (`busy`), or spin for an adaptively chosen number of empty polls and then block
//! (`adaptive`, the Flame thesis's dynamic counting polling; see [`poll`]).
//!
//! Other threads reach a reactor only through a [`Handle`]: they push a closure onto
//! a lock-free queue and wake the reactor through an eventfd. That is for control
//! work (opening volumes, map updates); the data path never crosses threads.

mod buf;
mod executor;
mod op;
pub mod poll;
mod slot;
mod source;
mod timer;

pub use buf::{AlignedBuf, DIRECT_IO_ALIGN, IoBuf, IoBufMut};
pub use executor::{
    Handle, Reactor, ReactorConfig, current_id, fixed_ops, poll_stats, register_fixed_buffers,
    spawn, yield_now,
};
pub use op::{
    accept, close, connect, fallocate, file_size, fsync, mkdir, open, poll_readable, read_at, recv,
    recv_range, send, submit_entry, unlink, write_at, writev, writev_all,
};
pub use poll::PollMode;
pub use source::{PollSource, PollSourceId, add_poll_source, remove_poll_source};
pub use timer::{Sleep, sleep};

/// A spawned task; await it for the output, or `detach()` it to let it run on.
pub type Task<T> = async_task::Task<T>;
