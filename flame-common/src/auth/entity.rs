//! Entity names: who signs a request.

use crate::ids::OsdId;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// Longest entity name, `client.` included: names travel in every request header
/// and are keys of the manager's entity table.
pub const ENTITY_NAME_BYTES_MAX: usize = 64;

/// The name of an authenticated party: `osd.N` (the key of OSD N alone), `osd`
/// (the key shared by every OSD of older deployments, which may act as any OSD),
/// or `client.NAME` with NAME of letters, digits, `_`, `-` and `.`
/// (`client.admin` is the administrator). N is written in canonical decimal
/// (`osd.3`, never `osd.03`), so one OSD has one name. Validated on construction,
/// so a name that reached a table, a header or a log is always well-formed and
/// bounded.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EntityName(String);

impl EntityName {
    /// The administrator every cluster starts with.
    pub const ADMIN: &'static str = "client.admin";
    /// The entity every OSD authenticates as.
    pub const OSD: &'static str = "osd";

    /// Parses and validates a name.
    pub fn parse(text: &str) -> Result<EntityName, String> {
        let shown: String = text.chars().take(ENTITY_NAME_BYTES_MAX).collect();
        if text.len() > ENTITY_NAME_BYTES_MAX {
            return Err(format!(
                "entity name `{shown}…` is longer than {ENTITY_NAME_BYTES_MAX} bytes"
            ));
        }
        if text == Self::OSD {
            return Ok(EntityName(text.to_string()));
        }
        if let Some(digits) = text.strip_prefix("osd.") {
            return match canonical_osd_number(digits) {
                Some(_) => Ok(EntityName(text.to_string())),
                None => Err(format!(
                    "entity name `{shown}`: expected osd.N with N an OSD id in decimal \
                     without leading zeros (e.g. osd.3)"
                )),
            };
        }
        let Some(rest) = text.strip_prefix("client.") else {
            return Err(format!(
                "entity name `{shown}`: expected `osd.N` or `client.NAME` (e.g. osd.3, client.vm1)"
            ));
        };
        let ok = !rest.is_empty()
            && rest
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
            && !rest.starts_with('.');
        if !ok {
            return Err(format!(
                "entity name `{shown}`: NAME must be letters, digits, `_`, `-` or `.`, \
                 not starting with `.`"
            ));
        }
        Ok(EntityName(text.to_string()))
    }

    /// `client.admin`.
    pub fn admin() -> EntityName {
        EntityName(Self::ADMIN.to_string())
    }

    /// `osd`, the key every OSD may share (see [`EntityName`]).
    pub fn osd() -> EntityName {
        EntityName(Self::OSD.to_string())
    }

    /// `osd.N`: the entity of OSD `id` alone.
    pub fn of_osd(id: OsdId) -> EntityName {
        EntityName(format!("osd.{}", id.0))
    }

    /// The OSD an `osd.N` entity is bound to; `None` for every other name
    /// (`osd` included: it is bound to none, and may act as any).
    pub fn osd_id(&self) -> Option<OsdId> {
        self.0
            .strip_prefix("osd.")
            .and_then(canonical_osd_number)
            .map(OsdId)
    }

    /// Whether this is an OSD's entity (`osd` or `osd.N`): the only names that
    /// may hold the osd role.
    pub fn is_osd(&self) -> bool {
        self.0 == Self::OSD || self.osd_id().is_some()
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// N of `osd.N`: a u32 in canonical decimal (no sign, no leading zero but `0`).
fn canonical_osd_number(digits: &str) -> Option<u32> {
    let canonical = !digits.is_empty()
        && digits.len() <= 10
        && digits.bytes().all(|b| b.is_ascii_digit())
        && (digits == "0" || !digits.starts_with('0'));
    canonical.then(|| digits.parse().ok()).flatten()
}

impl fmt::Display for EntityName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for EntityName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "EntityName({})", self.0)
    }
}

impl Serialize for EntityName {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for EntityName {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        EntityName::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// What an entity may do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Read only: map, status, volumes (what flame-nbd and flame-ublk need).
    Client,
    /// What an OSD does: boot, heartbeat, report failures and recovered copies.
    Osd,
    /// Everything.
    Admin,
}

impl Role {
    /// The role's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Client => "client",
            Role::Osd => "osd",
            Role::Admin => "admin",
        }
    }
}

/// The op session a placement group's log records for session `session` of
/// `entity`, and the session an OSD shard fences connections by (both are
/// client-chosen ids scoped to who said them): the first 8 bytes of SHA-256(`flame-op-session-v1\0` ‖ name ‖
/// `\0` ‖ session, little-endian), never 0 (0 means "no op id").
///
/// Clients choose their session ids, and they travel in clear. Recorded raw, a
/// writer of any volume that reuses a sniffed client's session id with a huge
/// sequence number makes the group refuse that client's writes as superseded;
/// scoped by the entity, the same id said by another entity is another session
/// in every log. Deterministic and the same on every OSD, so retries and
/// supersession work across primaries; a preimage for another entity's value
/// costs 2^64 hashes.
pub fn scoped_op_session(entity: &EntityName, session: u64) -> u64 {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(b"flame-op-session-v1\0");
    h.update(entity.as_str().as_bytes());
    h.update(b"\0");
    h.update(session.to_le_bytes());
    let digest = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    match u64::from_le_bytes(first) {
        0 => 1,
        v => v,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert_eq!(EntityName::parse("osd").unwrap().as_str(), "osd");
        assert_eq!(
            EntityName::parse("client.admin").unwrap(),
            EntityName::admin()
        );
        assert!(EntityName::parse("client.vm-1_a.b").is_ok());
        for bad in [
            "",
            "client.",
            "client..x",
            "client.a b",
            "client.a/b",
            "osd.",
            "osd.03",
            "osd.-1",
            "osd.+1",
            "osd.3a",
            "osd.4294967296",
            "osd.3.1",
            "mgr",
            "admin",
            "client.é",
        ] {
            assert!(EntityName::parse(bad).is_err(), "{bad}");
        }
        for (name, id) in [("osd.0", 0), ("osd.3", 3), ("osd.4294967295", u32::MAX)] {
            let n = EntityName::parse(name).unwrap();
            assert_eq!(n.osd_id(), Some(OsdId(id)), "{name}");
            assert_eq!(EntityName::of_osd(OsdId(id)), n);
            assert!(n.is_osd());
        }
        assert_eq!(EntityName::osd().osd_id(), None);
        assert!(EntityName::osd().is_osd());
        assert!(!EntityName::admin().is_osd());
        assert_eq!(EntityName::admin().osd_id(), None);
        let long = format!("client.{}", "a".repeat(ENTITY_NAME_BYTES_MAX));
        assert!(EntityName::parse(&long).unwrap_err().contains("longer"));
        let max = format!("client.{}", "a".repeat(ENTITY_NAME_BYTES_MAX - 7));
        assert!(EntityName::parse(&max).is_ok());
    }

    #[test]
    fn serde_validates() {
        let n: EntityName = serde_json::from_str("\"client.x\"").unwrap();
        assert_eq!(serde_json::to_string(&n).unwrap(), "\"client.x\"");
        assert!(serde_json::from_str::<EntityName>("\"bogus\"").is_err());
    }

    #[test]
    fn op_sessions_are_scoped_by_entity_deterministically() {
        let a = EntityName::parse("client.a").unwrap();
        let b = EntityName::parse("client.b").unwrap();
        assert_eq!(scoped_op_session(&a, 7), scoped_op_session(&a, 7));
        assert_ne!(scoped_op_session(&a, 7), scoped_op_session(&b, 7));
        assert_ne!(scoped_op_session(&a, 7), scoped_op_session(&a, 8));
        assert_ne!(scoped_op_session(&a, 7), 0);
        assert_ne!(scoped_op_session(&a, 7), 7);
    }
}
