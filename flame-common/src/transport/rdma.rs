//! The `rdma` transport (cargo feature `rdma`, crate `sideway`): Flame connections
//! over RDMA reliable-connection queue pairs, with two-sided SEND/RECV for messages
//! and one-sided READ/WRITE against registered, granted buffers.
//!
//! `sideway` loads libibverbs at run time, so a build with this feature runs on
//! machines without RDMA hardware: opening the device then fails with a message that
//! names what is missing ([`device`]), and a daemon configured with `transport: rdma`
//! refuses to start with it. What has and has not been exercised is listed in
//! docs/architecture.md ("RDMA transport").
//!
//! - [`device`]: the process's device, protection domain and port addressing.
//! - [`wire`]: bootstrap exchange, framing, credits, work-request ids (pure code,
//!   tested without a device).
//! - [`conn`]: connections, listener, grants, the per-thread completion queue.

pub mod conn;
pub mod device;
pub mod wire;

pub use conn::{RdmaConn, RdmaListener, ThreadCq};
pub use device::{RdmaDevice, RdmaSettings, devices};
