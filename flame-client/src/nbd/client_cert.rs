//! What a client certificate says: the entity it was issued to and the
//! capabilities that come with it on an NBD export.
//!
//! `flame-admin tls client` issues a certificate from the cluster CA whose
//! subject common name is the entity (`client.vm1`) and whose subject
//! alternative names hold one URI with its capabilities,
//! `urn:flame:nbd:access=rw:volumes=vm1-*,shared` (`volumes=*` for every
//! volume; `access=ro` to read only). The CA's signature binds them: flame-nbd
//! trusts what a certificate that chains to the cluster CA says, as an OSD
//! trusts the capabilities in a ticket the manager sealed. Kept readable by
//! `openssl x509 -text`. Revoking a certificate before it expires is not done
//! yet (issue 31, item 4): keep client certificates' lifetimes short.

use super::access::Grant;
use flame_common::auth::{EntityName, VolumePatterns};

/// The prefix of the capabilities URI.
pub const CAPS_URI_PREFIX: &str = "urn:flame:nbd:";
/// Bytes of a client certificate parsed at most (rustls bounds what it takes;
/// this bounds what Flame looks at).
pub const CERT_BYTES_MAX: usize = 16 << 10;

/// The entity and capabilities a client certificate carries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientClaims {
    /// Whom it was issued to (`client.NAME`).
    pub entity: EntityName,
    /// Volumes it may open.
    pub volumes: VolumePatterns,
    /// Whether only to read.
    pub read_only: bool,
}

impl ClientClaims {
    /// The capabilities URI that goes in the certificate.
    pub fn caps_uri(&self) -> String {
        format!(
            "{CAPS_URI_PREFIX}access={}:volumes={}",
            if self.read_only { "ro" } else { "rw" },
            self.volumes
        )
    }

    /// What it grants on an export.
    pub fn grant(&self) -> Grant {
        Grant {
            who: self.entity.to_string(),
            volumes: self.volumes.clone(),
            read_only: self.read_only,
        }
    }

    /// Reads the claims of a certificate (DER) that rustls already verified
    /// against the cluster CA: its common name must be a `client.NAME` entity,
    /// and it must carry exactly one capabilities URI.
    pub fn from_der(der: &[u8]) -> Result<ClientClaims, String> {
        if der.len() > CERT_BYTES_MAX {
            return Err(format!(
                "client certificate of {} bytes (at most {CERT_BYTES_MAX})",
                der.len()
            ));
        }
        let (_, cert) = x509_parser::parse_x509_certificate(der)
            .map_err(|e| format!("client certificate: {e}"))?;
        let cn = cert
            .subject()
            .iter_common_name()
            .next()
            .and_then(|cn| cn.as_str().ok())
            .ok_or("client certificate has no common name")?;
        let entity = EntityName::parse(cn)?;
        if !cn.starts_with("client.") {
            return Err(format!(
                "client certificate of {cn}: only client.NAME entities open exports"
            ));
        }
        let san = cert
            .subject_alternative_name()
            .map_err(|e| format!("client certificate of {cn}: {e}"))?
            .ok_or_else(|| format!("client certificate of {cn} carries no capabilities"))?;
        let mut uris = san.value.general_names.iter().filter_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) if u.starts_with(CAPS_URI_PREFIX) => {
                Some(*u)
            }
            _ => None,
        });
        let (Some(uri), None) = (uris.next(), uris.next()) else {
            return Err(format!(
                "client certificate of {cn} must carry exactly one {CAPS_URI_PREFIX} URI"
            ));
        };
        let (volumes, read_only) = parse_caps_uri(uri)?;
        Ok(ClientClaims {
            entity,
            volumes,
            read_only,
        })
    }
}

/// Parses `urn:flame:nbd:access=rw|ro:volumes=PATTERNS` (both fields, once
/// each, in any order).
pub fn parse_caps_uri(uri: &str) -> Result<(VolumePatterns, bool), String> {
    let rest = uri
        .strip_prefix(CAPS_URI_PREFIX)
        .ok_or_else(|| format!("capabilities {uri:?} do not start with {CAPS_URI_PREFIX}"))?;
    let (mut access, mut volumes) = (None, None);
    for field in rest.split(':') {
        match field.split_once('=') {
            Some(("access", "rw")) if access.is_none() => access = Some(false),
            Some(("access", "ro")) if access.is_none() => access = Some(true),
            // Never empty: an empty list would mean every volume, and a
            // certificate for every volume says `*`.
            Some(("volumes", v)) if volumes.is_none() && !v.trim().is_empty() => {
                volumes = Some(VolumePatterns::parse_list(v)?)
            }
            _ => return Err(format!("capabilities {uri:?}: unexpected field {field:?}")),
        }
    }
    match (volumes, access) {
        (Some(v), Some(ro)) => Ok((v, ro)),
        _ => Err(format!(
            "capabilities {uri:?} need both access= and volumes="
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn caps_uris_round_trip_and_bad_ones_are_refused() {
        let c = ClientClaims {
            entity: EntityName::parse("client.vm1").unwrap(),
            volumes: VolumePatterns::parse_list("vm1-*,shared").unwrap(),
            read_only: true,
        };
        assert_eq!(c.caps_uri(), "urn:flame:nbd:access=ro:volumes=vm1-*,shared");
        assert_eq!(
            parse_caps_uri(&c.caps_uri()).unwrap(),
            (c.volumes.clone(), true)
        );
        let (all, ro) = parse_caps_uri("urn:flame:nbd:volumes=*:access=rw").unwrap();
        assert!(all.is_all() && !ro);
        for bad in [
            "urn:flame:nbd:access=rw",
            "urn:flame:nbd:volumes=*",
            "urn:flame:nbd:access=rw:access=ro:volumes=*",
            "urn:flame:nbd:access=rwx:volumes=*",
            "urn:flame:nbd:access=rw:volumes=a b",
            "urn:other:access=rw:volumes=*",
            "urn:flame:nbd:access=rw:volumes=*:x=y",
            "urn:flame:nbd:access=rw:volumes=",
        ] {
            assert!(parse_caps_uri(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn garbage_is_not_a_certificate() {
        assert!(ClientClaims::from_der(b"junk").is_err());
        assert!(ClientClaims::from_der(&vec![0x30; CERT_BYTES_MAX + 1]).is_err());
    }
}
