//! The Flame manager as a library: `flame-mgr`'s `main` starts the HTTP server
//! around it, and the deterministic simulator (`tests/src/sim/`) drives its pure
//! state machine ([`state::ClusterState`]) directly, in virtual time.
//!
//! Layout: [`config`] (YAML settings), [`state`] (the map and every rule on it, pure
//! logic), [`store`] (crash-safe `state.json`), [`shared`] (lock, persist-then-
//! publish, heartbeats first), [`api`] (axum routes), [`server`] (hyper under them:
//! header timeout, connection cap), [`auth`] (entities, roles, request checks), [`failure`] (heartbeat grace), [`metrics`].

// Unit tests may read the real clock and sleep; production code reads time
// through flame_common::clock (clippy.toml, docs/testing.md "The clock rule").
#![cfg_attr(test, allow(clippy::disallowed_methods))]

pub mod api;
pub mod auth;
pub mod config;
pub mod failure;
pub mod metrics;
pub mod pg_status;
pub mod server;
pub mod shared;
pub mod state;
pub mod store;
