//! Flame's shared core.
//!
//! Everything two Flame processes must agree on lives here, so that the OSD, the
//! manager and the client cannot drift apart: the identifiers ([`ids`]), the wire
//! protocol ([`protocol`]), the cluster map and the placement function ([`map`],
//! [`placement`]) with the placement-group states operators see ([`pg_state`]), the
//! manager's JSON API types ([`mgr_api`]), configuration loading
//! ([`config`]) and the timing rules spanning two daemons' settings
//! ([`timing`]), the per-thread io_uring [`reactor`] every data-path thread runs on,
//! who may talk to whom ([`auth`]: entities, keyrings, signed manager requests),
//! the verbs-shaped [`transport`] layer with the request/reply multiplexer
//! above it ([`calls`]), the zero-copy payload [`buffer`]s every
//! write and read travels in, and the [`metrics`] endpoint.

// Unit tests may read the real clock and sleep; production code reads time
// through flame_common::clock (clippy.toml, docs/testing.md "The clock rule").
#![cfg_attr(test, allow(clippy::disallowed_methods))]

pub mod auth;
pub mod buffer;
pub mod calls;
pub mod clock;
pub mod collections;
pub mod config;
pub mod entropy;
#[doc(hidden)]
pub mod fuzzing;
pub mod http;
pub mod ids;
pub mod lineage;
pub mod logging;
pub mod map;
pub mod metrics;
pub mod metrics_server;
pub mod mgr_api;
pub mod node;
pub mod pg_state;
pub mod placement;
pub mod private_dir;
pub mod protocol;
pub mod reactor;
pub mod secret_file;
pub mod timing;
pub mod tls;
pub mod transport;
