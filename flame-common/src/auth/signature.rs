//! Signed manager API requests and answers.
//!
//! A request carries
//! `Authorization: Flame entity=NAME,gen=G,time=MS,nonce=HEX32,sig=HEX64` where
//! `sig` is HMAC-SHA256(entity key, the lines
//! `flame-request-v1`, NAME, G, MS, nonce, METHOD, PATH?QUERY, sha256(body) hex).
//! The answer carries `X-Flame-Signature: HEX64` = HMAC-SHA256(the same key,
//! `flame-response-v1`, nonce, status, sha256(body) hex): only the manager (which
//! derives the key) can produce it, and it is bound to this request's nonce, so an
//! old answer cannot be passed off as a new one.

use super::key::HmacSha256;
use super::{EntityName, KeyGeneration, Keyring, SecretKey};
use hmac::Mac;
use sha2::{Digest, Sha256};

/// The `Authorization` scheme name.
pub const AUTHORIZATION_SCHEME: &str = "Flame";
/// The header of the manager's answer signature.
pub const SIGNATURE_HEADER: &str = "x-flame-signature";
/// Longest `Authorization` value parsed: a real one is under 200 bytes.
const AUTHORIZATION_BYTES_MAX: usize = 256;

/// 128 random bits naming one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Nonce(pub [u8; 16]);

impl Nonce {
    /// A fresh nonce from the OS's random source.
    pub fn random() -> Result<Nonce, String> {
        super::key::os_random().map(Nonce)
    }
}

/// SHA-256 of a body, as hex (what the signatures cover).
pub fn body_digest(body: &[u8]) -> String {
    hex::encode(Sha256::digest(body))
}

/// What a caller signs with: an entity's name, key generation and key.
#[derive(Clone, Debug)]
pub struct Credentials {
    /// Who signs.
    pub entity: EntityName,
    /// Which of its keys (the manager refuses a rotated-away one by name).
    pub generation: KeyGeneration,
    /// The key.
    pub key: SecretKey,
}

impl Credentials {
    /// The credentials of an entity keyring (`what` names it in errors).
    pub fn from_keyring(k: &Keyring, what: &str) -> Result<Credentials, String> {
        let (entity, generation) = k.signer(what)?;
        Ok(Credentials {
            entity,
            generation,
            key: k.key.clone(),
        })
    }

    /// Loads an entity keyring file.
    pub fn load(path: &std::path::Path) -> Result<Credentials, String> {
        Credentials::from_keyring(&Keyring::load(path)?, &path.display().to_string())
    }

    /// Signs one request.
    pub fn sign(
        &self,
        method: &str,
        path_and_query: &str,
        body: &[u8],
        time_ms: u64,
        nonce: Nonce,
    ) -> RequestAuth {
        let mut auth = RequestAuth {
            entity: self.entity.clone(),
            generation: self.generation,
            time_ms,
            nonce,
            sig: [0; 32],
        };
        let mac = auth.mac(&self.key, method, path_and_query, &body_digest(body));
        auth.sig = mac.finalize().into_bytes().into();
        auth
    }
}

/// A parsed `Authorization: Flame …` header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestAuth {
    /// Who claims to have signed.
    pub entity: EntityName,
    /// With which key generation.
    pub generation: KeyGeneration,
    /// When (Unix milliseconds, the signer's clock).
    pub time_ms: u64,
    /// The request's nonce.
    pub nonce: Nonce,
    /// The HMAC.
    pub sig: [u8; 32],
}

impl RequestAuth {
    /// The header value.
    pub fn to_header(&self) -> String {
        format!(
            "{AUTHORIZATION_SCHEME} entity={},gen={},time={},nonce={},sig={}",
            self.entity,
            self.generation,
            self.time_ms,
            hex::encode(self.nonce.0),
            hex::encode(self.sig)
        )
    }

    /// Parses a header value; the error says what is malformed (never echoes more
    /// than a bounded prefix).
    pub fn parse(value: &str) -> Result<RequestAuth, String> {
        if value.len() > AUTHORIZATION_BYTES_MAX {
            return Err(format!(
                "Authorization header longer than {AUTHORIZATION_BYTES_MAX} bytes"
            ));
        }
        let Some(rest) = value
            .strip_prefix(AUTHORIZATION_SCHEME)
            .and_then(|r| r.strip_prefix(' '))
        else {
            return Err(format!(
                "Authorization header is not of the `{AUTHORIZATION_SCHEME}` scheme"
            ));
        };
        let mut fields = rest.split(',');
        let mut field = |name: &str| -> Result<&str, String> {
            fields
                .next()
                .and_then(|f| f.trim().strip_prefix(name))
                .and_then(|f| f.strip_prefix('='))
                .ok_or_else(|| format!("Authorization header: expected `{name}=` in order"))
        };
        let entity = EntityName::parse(field("entity")?)?;
        let generation = field("gen")?
            .parse()
            .map_err(|_| "Authorization header: gen is not a number".to_string())?;
        let time_ms = field("time")?
            .parse()
            .map_err(|_| "Authorization header: time is not a number".to_string())?;
        let mut nonce = [0u8; 16];
        hex::decode_to_slice(field("nonce")?, &mut nonce)
            .map_err(|_| "Authorization header: nonce is not 32 hex digits".to_string())?;
        let mut sig = [0u8; 32];
        hex::decode_to_slice(field("sig")?, &mut sig)
            .map_err(|_| "Authorization header: sig is not 64 hex digits".to_string())?;
        if fields.next().is_some() {
            return Err("Authorization header: unexpected fields after sig".into());
        }
        Ok(RequestAuth {
            entity,
            generation,
            time_ms,
            nonce: Nonce(nonce),
            sig,
        })
    }

    fn mac(&self, key: &SecretKey, method: &str, path_and_query: &str, digest: &str) -> HmacSha256 {
        let mut mac = key.mac();
        mac.update(
            format!(
                "flame-request-v1\n{}\n{}\n{}\n{}\n{method}\n{path_and_query}\n{digest}",
                self.entity,
                self.generation,
                self.time_ms,
                hex::encode(self.nonce.0)
            )
            .as_bytes(),
        );
        mac
    }

    /// Whether the signature is `key`'s over this request (constant-time).
    pub fn verify(&self, key: &SecretKey, method: &str, path_and_query: &str, body: &[u8]) -> bool {
        self.mac(key, method, path_and_query, &body_digest(body))
            .verify_slice(&self.sig)
            .is_ok()
    }
}

fn response_mac(key: &SecretKey, nonce: Nonce, status: u16, body: &[u8]) -> HmacSha256 {
    let mut mac = key.mac();
    mac.update(
        format!(
            "flame-response-v1\n{}\n{status}\n{}",
            hex::encode(nonce.0),
            body_digest(body)
        )
        .as_bytes(),
    );
    mac
}

/// The [`SIGNATURE_HEADER`] value of an answer to the request with `nonce`.
pub fn response_signature(key: &SecretKey, nonce: Nonce, status: u16, body: &[u8]) -> String {
    hex::encode(
        response_mac(key, nonce, status, body)
            .finalize()
            .into_bytes(),
    )
}

/// Checks an answer's signature (`header`: the [`SIGNATURE_HEADER`] value, if
/// any).
pub fn verify_response(
    key: &SecretKey,
    nonce: Nonce,
    status: u16,
    body: &[u8],
    header: Option<&str>,
) -> Result<(), String> {
    let Some(value) = header else {
        return Err(
            "the answer is not signed: the manager runs with `auth: none`, or this \
                    is not the manager"
                .into(),
        );
    };
    let mut sig = [0u8; 32];
    hex::decode_to_slice(value.trim(), &mut sig)
        .map_err(|_| "the answer's signature is not 64 hex digits".to_string())?;
    response_mac(key, nonce, status, body)
        .verify_slice(&sig)
        .map_err(|_| {
            "the answer's signature is wrong: it was altered on the way, or the manager \
             holds another cluster's secret"
                .to_string()
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds() -> Credentials {
        Credentials {
            entity: EntityName::admin(),
            generation: 2,
            key: SecretKey::from_hex(&"42".repeat(32)).unwrap(),
        }
    }

    #[test]
    fn sign_parse_verify() {
        let c = creds();
        let a = c.sign("POST", "/v1/volumes?x=1", b"{}", 1234, Nonce([7; 16]));
        let header = a.to_header();
        assert!(header.starts_with("Flame entity=client.admin,gen=2,time=1234,nonce=0707"));
        let back = RequestAuth::parse(&header).unwrap();
        assert_eq!(back, a);
        assert!(back.verify(&c.key, "POST", "/v1/volumes?x=1", b"{}"));
        // Every signed part matters.
        assert!(!back.verify(&c.key, "DELETE", "/v1/volumes?x=1", b"{}"));
        assert!(!back.verify(&c.key, "POST", "/v1/volumes?x=2", b"{}"));
        assert!(!back.verify(&c.key, "POST", "/v1/volumes?x=1", b"{ }"));
        let other = SecretKey::from_hex(&"43".repeat(32)).unwrap();
        assert!(!back.verify(&other, "POST", "/v1/volumes?x=1", b"{}"));
        for changed in [
            RequestAuth {
                time_ms: 1235,
                ..back.clone()
            },
            RequestAuth {
                generation: 3,
                ..back.clone()
            },
            RequestAuth {
                nonce: Nonce([8; 16]),
                ..back.clone()
            },
            RequestAuth {
                entity: EntityName::osd(),
                ..back.clone()
            },
        ] {
            assert!(!changed.verify(&c.key, "POST", "/v1/volumes?x=1", b"{}"));
        }
    }

    #[test]
    fn malformed_headers() {
        let good = creds().sign("GET", "/", b"", 1, Nonce([1; 16])).to_header();
        assert!(RequestAuth::parse(&good).is_ok());
        for bad in [
            "".to_string(),
            "Bearer x".to_string(),
            "Flame".to_string(),
            good.replace("entity=", "who="),
            good.replace("gen=2", "gen=x"),
            good.replace("time=1", "time=-1"),
            good.replace("nonce=01", "nonce=zz"),
            good.replace("client.admin", "root"),
            format!("{good},extra=1"),
            good[..good.len() - 2].to_string(),
            "Flame ".to_string() + &"a".repeat(300),
        ] {
            assert!(RequestAuth::parse(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn responses() {
        let k = creds().key;
        let n = Nonce([3; 16]);
        let s = response_signature(&k, n, 200, b"{\"epoch\":3}");
        assert!(verify_response(&k, n, 200, b"{\"epoch\":3}", Some(&s)).is_ok());
        assert!(verify_response(&k, n, 200, b"{\"epoch\":4}", Some(&s)).is_err());
        assert!(verify_response(&k, n, 404, b"{\"epoch\":3}", Some(&s)).is_err());
        assert!(verify_response(&k, Nonce([4; 16]), 200, b"{\"epoch\":3}", Some(&s)).is_err());
        assert!(
            verify_response(&k, n, 200, b"", None)
                .unwrap_err()
                .contains("auth: none")
        );
        assert!(verify_response(&k, n, 200, b"", Some("xyz")).is_err());
    }
}
