//! `flame-nbd`: an NBD server (spec: `NetworkBlockDevice/nbd` `doc/proto.md`) written
//! for Flame's io_uring reactor, because no spec-complete Rust NBD server exists.
//!
//! Layout:
//! * [`proto`] — constants, encoders/decoders and request validation; no I/O.
//! * [`handshake`] — fixed-newstyle negotiation (`EXPORT_NAME`, `ABORT`, `LIST`,
//!   `INFO`, `GO`, `STRUCTURED_REPLY`, `STARTTLS`; others `ERR_UNSUP`).
//! * [`access`] — who may open which export (pure): a Unix peer by its uid, a
//!   TCP client by its TLS client certificate ([`client_cert`]: the entity and
//!   capabilities the cluster CA signed).
//! * [`transmission`] — pipelined requests, out-of-order replies, simple and
//!   structured replies, bounded in-flight work.
//! * [`backend`] — the [`Backend`]/[`Exports`] traits the server is generic over;
//!   [`flame`] serves Flame volumes through them; [`memory`] implements them in
//!   memory (tests, benchmarks, `--memory`).
//! * [`server`] — one reactor thread per core, each with its own `SO_REUSEPORT`
//!   TCP listener and the shared Unix socket; a connection lives on one thread
//!   from accept to close.
//! * [`shutdown`] — the graceful-shutdown flag (SIGTERM).
//! * [`config`], [`metrics`] — YAML settings and Prometheus metrics.

pub mod access;
pub mod backend;
pub mod client_cert;
pub mod config;
mod conn;
pub mod flame;
pub mod handshake;
pub mod memory;
pub mod metrics;
pub mod proto;
pub mod server;
pub mod shutdown;
pub mod transmission;

pub use backend::{Backend, Errno, Exports, OpenError};
pub use config::NbdConfig;
pub use flame::{FlameBackend, FlameExports};
pub use memory::{MemoryBackend, MemoryExports};
pub use server::Server;
