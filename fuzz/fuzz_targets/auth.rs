//! Fuzzes the authentication decoders of outside input
//! (`flame-common/src/auth/`): the `Authorization: Flame …` header
//! (`RequestAuth::parse`), keyring files (`Keyring::parse`), entity names, and
//! tickets as an OSD opens them from a HELLO (`decode_claims`,
//! `ServiceKey::open`: never accepted without the key). Input byte 0 picks which. Nothing may panic; a header that parses re-encodes
//! to one that parses. Property tests: `flame_common::auth::props`.
#![no_main]

use flame_common::auth::{EntityName, Keyring, RequestAuth, SecretKey, ServiceKey, decode_claims};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    match mode % 4 {
        3 => {
            let _ = decode_claims(rest);
            let key = SecretKey::from_hex(&"42".repeat(32)).unwrap_or_else(|e| panic!("{e}"));
            let service = ServiceKey::from_osd_key(&key, 1);
            // Random bytes are never a ticket made with this key.
            assert!(service.open(rest, 1_900_000_000_000).is_err());
        }
        0 => {
            if let Ok(a) = RequestAuth::parse(&text) {
                assert!(RequestAuth::parse(&a.to_header()).is_ok());
            }
        }
        1 => {
            let _ = Keyring::parse(&text, "fuzz");
        }
        _ => {
            let _ = EntityName::parse(&text);
        }
    }
});
