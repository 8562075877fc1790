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
//! - OSD data and peer connections are authenticated at HELLO with **tickets**
//!   ([`ServiceKey`], cephx's scheme): the manager issues a client a ticket MACed
//!   with the OSDs' service key and sends its session key sealed under the
//!   client's key; the HELLO carries the ticket and a proof of the session key,
//!   the OSD answers with its own proof ([`handshake`]).
//!
//! Everything here is pure (no I/O) except [`Keyring::load`]/[`Keyring::save`]
//! and [`SecretKey::random`]; the crypto is RustCrypto's `hmac`, `sha2`
//! and `chacha20poly1305`.

pub mod caps;
mod entity;
pub mod handshake;
mod key;
mod keyring;
mod replay;
mod signature;
mod ticket;

pub use caps::VolumePatterns;
pub use entity::{ENTITY_NAME_BYTES_MAX, EntityName, Role, scoped_op_session};
pub use key::{KeyGeneration, SecretKey};
pub use keyring::{KEYRING_BYTES_MAX, Keyring, KeyringEntity};
pub use replay::{
    REPLAY_ENTRIES_MAX, REPLAY_WINDOW_MS, ReplayGuard, ReplayRefusal, ReplayShares, ShareLimits,
};
pub use signature::{
    AUTHORIZATION_SCHEME, Credentials, Nonce, RequestAuth, SIGNATURE_HEADER, body_digest,
    response_signature, verify_response,
};
pub use ticket::{
    SEALED_KEY_LEN, ServiceKey, SessionTicket, TICKET_BYTES_MAX, TICKET_CLOCK_SKEW_MS,
    TICKET_LIFETIME_MS, TicketClaims, TicketRefusal, decode_claims, open_session_key,
    seal_session_key,
};

/// Property tests of the decoders of outside input here: `Authorization` headers
/// ([`RequestAuth::parse`]), keyring files ([`Keyring::parse`]) and entity names,
/// from arbitrary text and from valid encodings with bytes flipped, inserted,
/// deleted or cut: a value or a clear error, never a panic; valid ones round-trip.
/// Seeded and bounded; the cargo-fuzz target is `fuzz/fuzz_targets/auth.rs`.
#[cfg(test)]
mod props {
    use super::*;
    use crate::fuzzing::mutate;
    use crate::fuzzing::props::{config, mutations};
    use proptest::prelude::*;

    /// This module's proptest seed.
    const SEED: u64 = 0xf1a3_0a07;

    fn valid_header(n: u8) -> String {
        let c = Credentials {
            entity: EntityName::admin(),
            generation: u64::from(n) + 1,
            key: SecretKey::from_hex(&"3c".repeat(32)).unwrap_or_else(|e| panic!("{e}")),
        };
        c.sign("GET", "/v1/map", b"", 1_800_000_000_000, Nonce([n; 16]))
            .to_header()
    }

    proptest! {
        #![proptest_config(config(256, SEED))]

        #[test]
        fn headers_parse_or_fail_cleanly(
            text in "[ -~]{0,300}",
            n in any::<u8>(),
            m in mutations(8),
        ) {
            let _ = RequestAuth::parse(&text);
            let good = valid_header(n);
            let back = RequestAuth::parse(&good).unwrap_or_else(|e| panic!("{e}"));
            prop_assert_eq!(back.to_header(), good.clone());
            let mut b = good.into_bytes();
            mutate(&mut b, &m);
            if let Ok(a) = RequestAuth::parse(&String::from_utf8_lossy(&b)) {
                // Whatever parses is a bounded, valid name and re-encodes.
                prop_assert!(a.entity.as_str().len() <= ENTITY_NAME_BYTES_MAX);
                prop_assert!(RequestAuth::parse(&a.to_header()).is_ok());
            }
        }

        #[test]
        fn tickets_open_only_unaltered(
            bytes in proptest::collection::vec(any::<u8>(), 0..200),
            m in mutations(8),
        ) {
            let service = ServiceKey::from_osd_key(
                &SecretKey::from_hex(&"42".repeat(32)).unwrap_or_else(|e| panic!("{e}")),
                1,
            );
            const NOW: u64 = 1_900_000_000_000;
            let _ = decode_claims(&bytes);
            prop_assert!(service.open(&bytes, NOW).is_err());
            let t = service.issue(&EntityName::admin(), Role::Admin, NOW, TICKET_LIFETIME_MS);
            prop_assert!(service.open(&t.bytes, NOW).is_ok());
            let mut b = t.bytes.clone();
            mutate(&mut b, &m);
            if b != t.bytes {
                prop_assert!(service.open(&b, NOW).is_err(), "an altered ticket opened");
            }
        }

        #[test]
        fn keyrings_and_names_parse_or_fail_cleanly(
            text in "[a-z0-9:. \n#_-]{0,200}",
            m in mutations(8),
        ) {
            let _ = Keyring::parse(&text, "t");
            let _ = EntityName::parse(&text);
            let k = Keyring {
                entity: KeyringEntity::Entity(EntityName::osd(), 7),
                key: SecretKey::from_hex(&"a5".repeat(32)).unwrap_or_else(|e| panic!("{e}")),
            };
            let mut b = k.to_text().into_bytes();
            mutate(&mut b, &m);
            if let Ok(back) = Keyring::parse(&String::from_utf8_lossy(&b), "t") {
                prop_assert!(Keyring::parse(&back.to_text(), "t").is_ok());
            }
        }
    }
}
