//! Flame client library.
//!
//! A client computes placement itself from the cluster map and talks straight to the
//! OSDs; the manager is only asked for the map (and for admin operations). The
//! pieces:
//!
//! * [`Cluster`] — connects to the manager, keeps the newest [`ClusterMap`] in an
//!   `ArcSwap` (lock-free reads), refreshed by background threads.
//! * [`Volume`] — byte-addressed I/O (`read_at`, `write_at`, `write_zeroes`,
//!   `discard`, `flush`) on a reactor thread: requests are split at object
//!   boundaries, sent to each object's primary on the owning shard's connection, and
//!   retried through map changes and connection failures until `io_timeout_ms`.
//!   `write_buf` and `read_bufs` take and return [`flame_common::buffer::PayloadBuf`]s,
//!   so data travels between the caller and the sockets without a copy.
//! * [`MgrClient`] — the manager's HTTP/JSON API (volumes, status, OSDs).
//! * [`bench`] and [`admin`] — the `flame-admin` CLI and its benchmark.
//!
//! ```no_run
//! use flame_client::{Cluster, ClientConfig};
//! use flame_common::reactor::{Reactor, ReactorConfig};
//!
//! let cluster = Cluster::connect(ClientConfig::new("127.0.0.1:6800"))?;
//! let mut reactor = Reactor::new(ReactorConfig::default()).expect("reactor");
//! reactor.block_on(async move {
//!     let vol = cluster.open_volume("demo").await?;
//!     vol.write_at(0, b"hello", false).await?;
//!     vol.flush().await?;
//!     assert_eq!(vol.read_at(0, 5).await?, b"hello");
//!     Ok::<_, flame_client::ClientError>(())
//! }).expect("reactor")?;
//! # Ok::<_, flame_client::ClientError>(())
//! ```
//!
//! [`ClusterMap`]: flame_common::map::ClusterMap

// Unit tests may read the real clock and sleep; production code reads time
// through flame_common::clock (clippy.toml, docs/testing.md "The clock rule").
#![cfg_attr(test, allow(clippy::disallowed_methods))]

pub mod admin;
pub mod bench;
pub mod bridge;
pub mod cluster;
pub mod config;
pub mod connection;
pub mod deadline;
pub mod error;
mod io;
mod join;
pub mod metrics;
pub mod mgr_client;
pub mod nbd;
pub mod resize;
pub mod retry;
pub mod split;
#[cfg(feature = "ublk")]
pub mod ublk;
pub mod volume;

pub use cluster::Cluster;
pub use config::{ClientConfig, ConvertThresholds, ReplyMode, TransferMode};
pub use error::ClientError;
pub use mgr_client::MgrClient;
pub use volume::Volume;
