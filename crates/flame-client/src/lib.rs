//! Flame client library.
