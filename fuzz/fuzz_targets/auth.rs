//! Fuzzes the authentication decoders of outside input
//! (`flame-common/src/auth/`): the `Authorization: Flame …` header
//! (`RequestAuth::parse`), keyring files (`Keyring::parse`) and entity names.
//! Input byte 0 picks which. Nothing may panic; a header that parses re-encodes
//! to one that parses. Property tests: `flame_common::auth::props`.
#![no_main]

use flame_common::auth::{EntityName, Keyring, RequestAuth};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(rest);
    match mode % 3 {
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
