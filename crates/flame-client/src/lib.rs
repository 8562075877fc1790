//! Flame client library.
pub mod nbd;
