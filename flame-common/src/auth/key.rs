//! Secret keys and the derivation of entity keys from the cluster secret.

use super::EntityName;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fmt;

pub(crate) type HmacSha256 = Hmac<Sha256>;

/// Which key of an entity is current: the manager's entity table holds it, and a
/// rotation increments it (the old key then stops working at once).
pub type KeyGeneration = u64;

/// Domain separation of entity-key derivation from every other use of a key.
const ENTITY_KEY_CONTEXT: &[u8] = b"flame-entity-key-v1\0";

/// A 256-bit secret: the cluster secret or an entity's key.
///
/// Never printed: `Debug` shows only that it is a key, so a key cannot leak into a
/// log through a `{:?}` of a config or an error. Not comparable either (a `==` on
/// secrets would be a timing side channel); signatures are checked with
/// [`hmac::Mac::verify_slice`], which is constant-time.
#[derive(Clone)]
pub struct SecretKey([u8; 32]);

impl SecretKey {
    /// A fresh key from the operating system's random source (getrandom(2)).
    /// Never from a user-space generator seeded by time or pid.
    pub fn random() -> Result<SecretKey, String> {
        os_random().map(SecretKey)
    }

    /// Parses 64 hex digits.
    pub fn from_hex(text: &str) -> Result<SecretKey, String> {
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(text.trim(), &mut bytes)
            .map_err(|e| format!("a key is 64 hex digits ({e})"))?;
        Ok(SecretKey(bytes))
    }

    /// A key from 32 bytes (a derivation's output).
    pub(crate) fn from_bytes(bytes: [u8; 32]) -> SecretKey {
        SecretKey(bytes)
    }

    /// The key's bytes (for a cipher's key schedule).
    pub(crate) fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The key as 64 lower-case hex digits (for keyring files only).
    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The key of `entity` at `generation`, derived from this cluster secret:
    /// HMAC-SHA256(secret, "flame-entity-key-v1\0" ‖ name ‖ "\0" ‖ generation as 8
    /// little-endian bytes). One-way: an entity key reveals neither the cluster
    /// secret nor any other entity's key.
    pub fn derive_entity_key(&self, entity: &EntityName, generation: KeyGeneration) -> SecretKey {
        let mut mac = self.mac();
        mac.update(ENTITY_KEY_CONTEXT);
        mac.update(entity.as_str().as_bytes());
        mac.update(b"\0");
        mac.update(&generation.to_le_bytes());
        SecretKey(mac.finalize().into_bytes().into())
    }

    /// A MAC keyed with this key.
    pub(crate) fn mac(&self) -> HmacSha256 {
        // HMAC accepts keys of any length; 32 bytes never fails.
        <HmacSha256 as Mac>::new_from_slice(&self.0).unwrap_or_else(|_| unreachable!())
    }
}

/// `N` bytes from the operating system's random source (getrandom(2)): the only
/// source of keys and nonces.
pub(crate) fn os_random<const N: usize>() -> Result<[u8; N], String> {
    let mut bytes = [0u8; N];
    getrandom::fill(&mut bytes)
        .map_err(|e| format!("cannot read the system's random source: {e}"))?;
    Ok(bytes)
}

impl fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SecretKey(…)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip_and_errors() {
        let k = SecretKey::random().unwrap();
        assert_eq!(
            SecretKey::from_hex(&k.to_hex()).unwrap().to_hex(),
            k.to_hex()
        );
        assert!(SecretKey::from_hex("00").is_err());
        assert!(SecretKey::from_hex(&"g".repeat(64)).is_err());
        assert_ne!(SecretKey::random().unwrap().to_hex(), k.to_hex());
    }

    #[test]
    fn debug_hides_the_key() {
        let k = SecretKey::from_hex(&"ab".repeat(32)).unwrap();
        assert!(!format!("{k:?}").contains("ab"));
    }

    #[test]
    fn derivation_depends_on_secret_name_and_generation() {
        let s = SecretKey::from_hex(&"11".repeat(32)).unwrap();
        let t = SecretKey::from_hex(&"12".repeat(32)).unwrap();
        let a = EntityName::admin();
        let o = EntityName::osd();
        let k = s.derive_entity_key(&a, 1).to_hex();
        assert_eq!(k, s.derive_entity_key(&a, 1).to_hex(), "deterministic");
        assert_ne!(k, s.derive_entity_key(&a, 2).to_hex());
        assert_ne!(k, s.derive_entity_key(&o, 1).to_hex());
        assert_ne!(k, t.derive_entity_key(&a, 1).to_hex());
        // Pinned: a change of the derivation would lock every deployed client out.
        assert_eq!(s.derive_entity_key(&a, 1).to_hex(), {
            let mut m = s.mac();
            m.update(b"flame-entity-key-v1\0client.admin\0\x01\0\0\0\0\0\0\0");
            hex::encode(m.finalize().into_bytes())
        });
    }
}
