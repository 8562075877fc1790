//! Who may talk to a Flame daemon: entities, their keys, keyring files, and the
//! signatures that prove a manager API request (and its answer) came from the
//! holder of a key.
//!
//! The scheme (docs/security.md):
//! - A cluster has one **cluster secret** ([`SecretKey`]), held only by the
//!   manager (`cluster.keyring`). Every entity's key is derived from it
//!   ([`SecretKey::derive_entity_key`]: HMAC-SHA256 of the entity name and a key
//!   generation), so the manager never stores per-entity secrets and a rotation
//!   is a generation bump.
//! - An **entity** ([`EntityName`]) is `osd` (every OSD) or `client.NAME`
//!   (`client.admin` is the administrator). Its key lives in a keyring file
//!   ([`Keyring`], mode 0600, refused when group or others may read it).
//! - Every manager API request carries an `Authorization: Flame …` header
//!   ([`RequestAuth`]) with an HMAC over the method, path, body digest, a time
//!   and a nonce; the manager refuses a wrong, stale or replayed one
//!   ([`ReplayGuard`]) and signs its answer ([`response_signature`]) with the same
//!   key, so a client knows the map it got is the manager's.
//!
//! Everything here is pure (no I/O) except [`Keyring::load`]/[`Keyring::save`]
//! and [`SecretKey::random`]; the crypto is RustCrypto's `hmac` and `sha2`.

mod entity;
mod key;
mod keyring;
mod replay;
mod signature;

pub use entity::{ENTITY_NAME_BYTES_MAX, EntityName, Role};
pub use key::{KeyGeneration, SecretKey};
pub use keyring::{KEYRING_BYTES_MAX, Keyring, KeyringEntity};
pub use replay::{REPLAY_ENTRIES_MAX, REPLAY_WINDOW_MS, ReplayGuard, ReplayRefusal};
pub use signature::{
    AUTHORIZATION_SCHEME, Credentials, Nonce, RequestAuth, SIGNATURE_HEADER, body_digest,
    response_signature, verify_response,
};
