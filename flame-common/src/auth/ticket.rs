//! Tickets: how a client proves to an OSD who it is, although no OSD holds any
//! client's key (cephx's scheme, with RustCrypto primitives).
//!
//! * Every OSD holds the `osd` entity key; the **service key** is derived from it
//!   ([`ServiceKey::from_osd_key`]), so the manager (which derives every entity
//!   key from the cluster secret) and every OSD know it, and nothing else does.
//! * A client asks the manager (a signed request) for a **ticket**: its entity
//!   name, role, issue and expiry times, MACed with the service key. The ticket
//!   travels in clear; its **session key** is HMAC(service key, ticket), so an OSD
//!   recomputes it from the ticket alone, and the manager sends it to the client
//!   sealed (ChaCha20-Poly1305, [`seal_session_key`]) under a key derived from the
//!   client's own entity key: only the entity named in the ticket can use it.
//! * OSDs mint their own tickets for replication connections
//!   ([`ServiceKey::issue`]): they hold the service key.
//!
//! Rotating the `osd` key changes the service key, so every outstanding ticket
//! stops working; removing or rotating a client's key stops new tickets at once
//! and old ones at their expiry ([`TICKET_LIFETIME_MS`]).

use super::key::HmacSha256;
use super::{EntityName, KeyGeneration, Role, SecretKey};
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use chacha20poly1305::{ChaCha20Poly1305, Key, Nonce as AeadNonce};
use hmac::Mac;

/// How long a ticket the manager issues is valid. A client renews it when half
/// is left; connections opened with it outlive it (they were authenticated when
/// opened), so this bounds how long a removed client can still open connections.
pub const TICKET_LIFETIME_MS: u64 = 3_600_000;
/// How far an OSD's clock may be from the manager's when it checks a ticket's
/// times (the same tolerance as signed requests).
pub const TICKET_CLOCK_SKEW_MS: u64 = super::REPLAY_WINDOW_MS;
/// Largest volume-patterns section of a ticket: each pattern a length byte and
/// its bytes.
const CAPS_BYTES_MAX: usize =
    super::caps::VOLUME_PATTERNS_MAX * (1 + super::caps::VOLUME_PATTERN_BYTES_MAX);
/// Largest encoded ticket: the fixed part, the longest entity name, the most
/// volume patterns and the MAC.
pub const TICKET_BYTES_MAX: usize =
    TICKET_FIXED_LEN + super::ENTITY_NAME_BYTES_MAX + CAPS_BYTES_MAX + MAC_LEN;
// The HELLO decoder bounds tickets by its own constant: they must agree.
const _: () = assert!(TICKET_BYTES_MAX == crate::protocol::HELLO_TICKET_BYTES_MAX);

/// Size of a sealed session key: nonce, key, tag.
pub const SEALED_KEY_LEN: usize = 12 + 32 + 16;

const TICKET_MAGIC: [u8; 4] = *b"FTK1";
const TICKET_FIXED_LEN: usize = 32;
const MAC_LEN: usize = 32;
const SERVICE_KEY_CONTEXT: &[u8] = b"flame-osd-service-key-v1\0";
const TICKET_MAC_CONTEXT: &[u8] = b"flame-ticket-mac-v1\0";
const SESSION_KEY_CONTEXT: &[u8] = b"flame-session-key-v1\0";
const SEAL_KEY_CONTEXT: &[u8] = b"flame-ticket-seal-v1\0";
/// The associated data a sealed service key is bound to (with its generation):
/// never a ticket (those start `FTK1`), so neither opens as the other.
const SERVICE_SEAL_CONTEXT: &[u8] = b"flame-service-key-seal-v1\0";

/// The key that makes and checks tickets, known to the manager and the OSDs.
#[derive(Clone, Debug)]
pub struct ServiceKey {
    key: SecretKey,
    /// The `osd` key generation it was derived from (carried in tickets, so an
    /// OSD can tell "issued under another key generation" from "forged").
    generation: KeyGeneration,
}

/// What a ticket says, after its MAC was checked.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TicketClaims {
    /// Who holds it.
    pub entity: EntityName,
    /// What it may do.
    pub role: Role,
    /// The `osd` key generation of the service key that made it.
    pub service_generation: KeyGeneration,
    /// When it was issued (Unix ms).
    pub issued_ms: u64,
    /// When it stops opening connections (Unix ms).
    pub expires_ms: u64,
    /// The volumes it may read and write (empty: every volume).
    pub volumes: super::VolumePatterns,
}

/// A ticket with its session key: what a client (or an OSD's peer side) needs to
/// open authenticated connections.
#[derive(Clone, Debug)]
pub struct SessionTicket {
    /// The encoded ticket (sent in clear in every HELLO).
    pub bytes: Vec<u8>,
    /// The key both sides of a connection prove possession of.
    pub session_key: SecretKey,
    /// What the ticket says.
    pub claims: TicketClaims,
}

/// Why an OSD refused a ticket.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TicketRefusal {
    /// Not a ticket (size, magic, role byte or entity name).
    Malformed(&'static str),
    /// Issued under another `osd` key generation than this OSD's.
    Generation {
        /// The ticket's.
        ticket: KeyGeneration,
        /// This OSD's.
        ours: KeyGeneration,
    },
    /// The MAC does not match: forged, or made with another cluster's key.
    Forged,
    /// Past its expiry (by this OSD's clock, with the skew allowed).
    Expired {
        /// Who it was issued to.
        entity: EntityName,
        /// How long ago it expired.
        ago_ms: u64,
    },
    /// Issued in the future (this OSD's clock is behind, or the manager's ahead).
    NotYetValid {
        /// Who it was issued to.
        entity: EntityName,
    },
}

impl std::fmt::Display for TicketRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TicketRefusal::Malformed(what) => write!(f, "malformed ticket: {what}"),
            TicketRefusal::Generation { ticket, ours } => write!(
                f,
                "ticket made under osd key generation {ticket}, this OSD has generation {ours} \
                 (the osd key was rotated: update the keyrings, or fetch a new ticket)"
            ),
            TicketRefusal::Forged => {
                f.write_str("ticket MAC does not match (another cluster's ticket, or forged)")
            }
            TicketRefusal::Expired { entity, ago_ms } => {
                write!(f, "{entity}'s ticket expired {ago_ms} ms ago")
            }
            TicketRefusal::NotYetValid { entity } => write!(
                f,
                "{entity}'s ticket was issued in the future (clocks differ by more than {} s)",
                TICKET_CLOCK_SKEW_MS / 1000
            ),
        }
    }
}

impl TicketRefusal {
    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            TicketRefusal::Malformed(_) => "malformed_ticket",
            TicketRefusal::Generation { .. } => "ticket_generation",
            TicketRefusal::Forged => "forged_ticket",
            TicketRefusal::Expired { .. } => "expired_ticket",
            TicketRefusal::NotYetValid { .. } => "future_ticket",
        }
    }
}

fn role_byte(role: Role) -> u8 {
    match role {
        Role::Client => 1,
        Role::Osd => 2,
        Role::Admin => 3,
    }
}

fn role_of(byte: u8) -> Option<Role> {
    match byte {
        1 => Some(Role::Client),
        2 => Some(Role::Osd),
        3 => Some(Role::Admin),
        _ => None,
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

impl ServiceKey {
    /// The service key of the `osd` key of `generation`:
    /// HMAC-SHA256(osd key, "flame-osd-service-key-v1\0").
    pub fn from_osd_key(osd_key: &SecretKey, generation: KeyGeneration) -> ServiceKey {
        let mut mac = osd_key.mac();
        mac.update(SERVICE_KEY_CONTEXT);
        ServiceKey {
            key: SecretKey::from_bytes(mac.finalize().into_bytes().into()),
            generation,
        }
    }

    /// The `osd` key generation this key belongs to.
    pub fn generation(&self) -> KeyGeneration {
        self.generation
    }

    /// This key sealed for the holder of `entity_key` (ChaCha20-Poly1305, bound
    /// to the generation): how the manager hands it to an OSD that holds only
    /// its own `osd.N` key (`POST /v1/auth/service-key`). Only that OSD opens it.
    pub fn seal_for(&self, entity_key: &SecretKey) -> Result<Vec<u8>, String> {
        seal_session_key(entity_key, &service_seal_aad(self.generation), &self.key)
    }

    /// Opens a service key of `generation` sealed by [`ServiceKey::seal_for`] for
    /// `entity_key`; an error if it was sealed for another key or generation, or
    /// altered.
    pub fn open_sealed(
        entity_key: &SecretKey,
        generation: KeyGeneration,
        sealed: &[u8],
    ) -> Result<ServiceKey, String> {
        let key = open_session_key(entity_key, &service_seal_aad(generation), sealed)
            .map_err(|e| format!("the sealed service key: {e}"))?;
        Ok(ServiceKey { key, generation })
    }

    fn ticket_mac(&self, body: &[u8]) -> HmacSha256 {
        let mut mac = self.key.mac();
        mac.update(TICKET_MAC_CONTEXT);
        mac.update(body);
        mac
    }

    fn session_key(&self, ticket: &[u8]) -> SecretKey {
        let mut mac = self.key.mac();
        mac.update(SESSION_KEY_CONTEXT);
        mac.update(ticket);
        SecretKey::from_bytes(mac.finalize().into_bytes().into())
    }

    /// A ticket for `entity` with `role` and every volume, valid from `now_ms`
    /// for `lifetime_ms` (an OSD's own, and tests').
    pub fn issue(
        &self,
        entity: &EntityName,
        role: Role,
        now_ms: u64,
        lifetime_ms: u64,
    ) -> SessionTicket {
        self.issue_for(
            entity,
            role,
            &super::VolumePatterns::all(),
            now_ms,
            lifetime_ms,
        )
    }

    /// A ticket for `entity` with `role`, limited to `volumes`, valid from
    /// `now_ms` for `lifetime_ms`.
    pub fn issue_for(
        &self,
        entity: &EntityName,
        role: Role,
        volumes: &super::VolumePatterns,
        now_ms: u64,
        lifetime_ms: u64,
    ) -> SessionTicket {
        let name = entity.as_str().as_bytes();
        debug_assert!(name.len() <= super::ENTITY_NAME_BYTES_MAX);
        let claims = TicketClaims {
            entity: entity.clone(),
            role,
            service_generation: self.generation,
            issued_ms: now_ms,
            expires_ms: now_ms.saturating_add(lifetime_ms),
            volumes: volumes.clone(),
        };
        let mut caps = Vec::new();
        for p in volumes.as_slice() {
            // Bounded by VOLUME_PATTERN_BYTES_MAX (checked when parsed).
            caps.push(u8::try_from(p.len()).unwrap_or(u8::MAX));
            caps.extend_from_slice(p.as_bytes());
        }
        debug_assert!(caps.len() <= CAPS_BYTES_MAX);
        let mut b = Vec::with_capacity(TICKET_FIXED_LEN + name.len() + caps.len() + MAC_LEN);
        b.extend_from_slice(&TICKET_MAGIC);
        b.push(role_byte(role));
        // Bounded by ENTITY_NAME_BYTES_MAX (64), checked when the name was parsed.
        b.push(u8::try_from(name.len()).unwrap_or(u8::MAX));
        b.extend_from_slice(&u16::try_from(caps.len()).unwrap_or(u16::MAX).to_le_bytes());
        b.extend_from_slice(&self.generation.to_le_bytes());
        b.extend_from_slice(&claims.issued_ms.to_le_bytes());
        b.extend_from_slice(&claims.expires_ms.to_le_bytes());
        b.extend_from_slice(name);
        b.extend_from_slice(&caps);
        let tag = self.ticket_mac(&b).finalize().into_bytes();
        b.extend_from_slice(&tag);
        debug_assert!(b.len() <= TICKET_BYTES_MAX);
        SessionTicket {
            session_key: self.session_key(&b),
            bytes: b,
            claims,
        }
    }

    /// Checks a ticket at `now_ms` and recomputes its session key.
    pub fn open(
        &self,
        ticket: &[u8],
        now_ms: u64,
    ) -> Result<(TicketClaims, SecretKey), TicketRefusal> {
        let claims = decode_claims(ticket)?;
        if claims.service_generation != self.generation {
            return Err(TicketRefusal::Generation {
                ticket: claims.service_generation,
                ours: self.generation,
            });
        }
        let (body, tag) = ticket.split_at(ticket.len() - MAC_LEN);
        self.ticket_mac(body)
            .verify_slice(tag)
            .map_err(|_| TicketRefusal::Forged)?;
        if now_ms > claims.expires_ms.saturating_add(TICKET_CLOCK_SKEW_MS) {
            return Err(TicketRefusal::Expired {
                ago_ms: now_ms - claims.expires_ms,
                entity: claims.entity,
            });
        }
        if claims.issued_ms > now_ms.saturating_add(TICKET_CLOCK_SKEW_MS) {
            return Err(TicketRefusal::NotYetValid {
                entity: claims.entity,
            });
        }
        let key = self.session_key(ticket);
        Ok((claims, key))
    }
}

/// Decodes a ticket's claims without checking its MAC (a client reads its own
/// ticket's expiry; an OSD checks the MAC in [`ServiceKey::open`]).
pub fn decode_claims(ticket: &[u8]) -> Result<TicketClaims, TicketRefusal> {
    if ticket.len() < TICKET_FIXED_LEN + MAC_LEN || ticket.len() > TICKET_BYTES_MAX {
        return Err(TicketRefusal::Malformed("size"));
    }
    if ticket[0..4] != TICKET_MAGIC {
        return Err(TicketRefusal::Malformed("magic"));
    }
    let role = role_of(ticket[4]).ok_or(TicketRefusal::Malformed("role"))?;
    let name_len = usize::from(ticket[5]);
    let caps_len = usize::from(u16::from_le_bytes([ticket[6], ticket[7]]));
    if caps_len > CAPS_BYTES_MAX {
        return Err(TicketRefusal::Malformed("volume patterns too long"));
    }
    if ticket.len() != TICKET_FIXED_LEN + name_len + caps_len + MAC_LEN {
        return Err(TicketRefusal::Malformed("name length"));
    }
    let name = std::str::from_utf8(&ticket[TICKET_FIXED_LEN..TICKET_FIXED_LEN + name_len])
        .map_err(|_| TicketRefusal::Malformed("entity name"))?;
    let entity = EntityName::parse(name).map_err(|_| TicketRefusal::Malformed("entity name"))?;
    let mut caps = &ticket[TICKET_FIXED_LEN + name_len..TICKET_FIXED_LEN + name_len + caps_len];
    let mut patterns = Vec::new();
    // Bounded: every round consumes at least one byte.
    while let Some((&len, rest)) = caps.split_first() {
        let len = usize::from(len);
        if len > rest.len() {
            return Err(TicketRefusal::Malformed("volume pattern length"));
        }
        let p = std::str::from_utf8(&rest[..len])
            .map_err(|_| TicketRefusal::Malformed("volume pattern"))?;
        patterns.push(p.to_string());
        caps = &rest[len..];
    }
    let volumes = super::VolumePatterns::new(patterns)
        .map_err(|_| TicketRefusal::Malformed("volume pattern"))?;
    Ok(TicketClaims {
        entity,
        role,
        service_generation: u64_at(ticket, 8),
        issued_ms: u64_at(ticket, 16),
        expires_ms: u64_at(ticket, 24),
        volumes,
    })
}

fn service_seal_aad(generation: KeyGeneration) -> Vec<u8> {
    let mut aad = SERVICE_SEAL_CONTEXT.to_vec();
    aad.extend_from_slice(&generation.to_le_bytes());
    aad
}

/// The ChaCha20-Poly1305 key that seals `entity_key`'s session keys.
fn seal_cipher(entity_key: &SecretKey) -> ChaCha20Poly1305 {
    let mut mac = entity_key.mac();
    mac.update(SEAL_KEY_CONTEXT);
    let k: [u8; 32] = mac.finalize().into_bytes().into();
    ChaCha20Poly1305::new(Key::from_slice(&k))
}

/// Seals `session_key` for the holder of `entity_key`, bound to `ticket` (the
/// associated data): 12 random nonce bytes, then ciphertext and tag.
pub fn seal_session_key(
    entity_key: &SecretKey,
    ticket: &[u8],
    session_key: &SecretKey,
) -> Result<Vec<u8>, String> {
    let nonce: [u8; 12] = super::key::os_random()?;
    let sealed = seal_cipher(entity_key)
        .encrypt(
            AeadNonce::from_slice(&nonce),
            Payload {
                msg: session_key.as_bytes(),
                aad: ticket,
            },
        )
        .map_err(|_| "cannot seal a session key".to_string())?;
    let mut out = Vec::with_capacity(SEALED_KEY_LEN);
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&sealed);
    debug_assert_eq!(out.len(), SEALED_KEY_LEN);
    Ok(out)
}

/// Opens a session key sealed by [`seal_session_key`] for `ticket`; an error if
/// it was sealed for another key or another ticket, or altered.
pub fn open_session_key(
    entity_key: &SecretKey,
    ticket: &[u8],
    sealed: &[u8],
) -> Result<SecretKey, String> {
    if sealed.len() != SEALED_KEY_LEN {
        return Err(format!(
            "a sealed session key is {SEALED_KEY_LEN} bytes, got {}",
            sealed.len()
        ));
    }
    let (nonce, ct) = sealed.split_at(12);
    let plain = seal_cipher(entity_key)
        .decrypt(
            AeadNonce::from_slice(nonce),
            Payload {
                msg: ct,
                aad: ticket,
            },
        )
        .map_err(|_| {
            "the session key does not open with this key (wrong keyring, or altered)".to_string()
        })?;
    let bytes: [u8; 32] = plain
        .try_into()
        .map_err(|_| "a session key is 32 bytes".to_string())?;
    Ok(SecretKey::from_bytes(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(g: KeyGeneration) -> ServiceKey {
        let osd = SecretKey::from_hex(&"0f".repeat(32)).unwrap();
        ServiceKey::from_osd_key(&osd, g)
    }

    fn client() -> EntityName {
        EntityName::parse("client.vm1").unwrap()
    }

    const NOW: u64 = 1_900_000_000_000;

    #[test]
    fn issued_tickets_open_with_the_same_session_key() {
        let s = service(3);
        let t = s.issue(&client(), Role::Client, NOW, TICKET_LIFETIME_MS);
        assert!(t.bytes.len() <= TICKET_BYTES_MAX);
        let (claims, key) = s.open(&t.bytes, NOW + 1).unwrap();
        assert_eq!(claims, t.claims);
        assert_eq!(claims.expires_ms, NOW + TICKET_LIFETIME_MS);
        assert_eq!(key.to_hex(), t.session_key.to_hex());
        assert_eq!(decode_claims(&t.bytes).unwrap(), t.claims);
        // Another ticket, another session key.
        let u = s.issue(&client(), Role::Client, NOW + 1, TICKET_LIFETIME_MS);
        assert_ne!(u.session_key.to_hex(), t.session_key.to_hex());
    }

    #[test]
    fn every_refusal() {
        let s = service(3);
        let t = s.issue(&client(), Role::Client, NOW, 1000);
        // Any flipped bit: malformed or forged, never accepted.
        for i in 0..t.bytes.len() {
            let mut b = t.bytes.clone();
            b[i] ^= 0x01;
            assert!(s.open(&b, NOW).is_err(), "byte {i}");
        }
        // A role raised from client to admin (byte 4) without the key.
        let mut b = t.bytes.clone();
        b[4] = 3;
        assert_eq!(s.open(&b, NOW).err(), Some(TicketRefusal::Forged));
        assert_eq!(
            service(4).open(&t.bytes, NOW).err(),
            Some(TicketRefusal::Generation { ticket: 3, ours: 4 })
        );
        let other = ServiceKey::from_osd_key(&SecretKey::from_hex(&"10".repeat(32)).unwrap(), 3);
        assert_eq!(other.open(&t.bytes, NOW).err(), Some(TicketRefusal::Forged));
        // Expiry, with the skew allowed.
        assert!(s.open(&t.bytes, NOW + 1000 + TICKET_CLOCK_SKEW_MS).is_ok());
        assert_eq!(
            s.open(&t.bytes, NOW + 1001 + TICKET_CLOCK_SKEW_MS).err(),
            Some(TicketRefusal::Expired {
                entity: client(),
                ago_ms: 1 + TICKET_CLOCK_SKEW_MS
            })
        );
        assert!(s.open(&t.bytes, NOW - TICKET_CLOCK_SKEW_MS).is_ok());
        assert_eq!(
            s.open(&t.bytes, NOW - TICKET_CLOCK_SKEW_MS - 1).err(),
            Some(TicketRefusal::NotYetValid { entity: client() })
        );
        for (bad, what) in [
            (&t.bytes[..10], "size"),
            (&[0u8; TICKET_BYTES_MAX + 1][..], "size"),
        ] {
            assert_eq!(s.open(bad, NOW).err(), Some(TicketRefusal::Malformed(what)));
        }
        let mut b = t.bytes.clone();
        b[0] = b'X';
        assert_eq!(
            s.open(&b, NOW).err(),
            Some(TicketRefusal::Malformed("magic"))
        );
        b = t.bytes.clone();
        b[4] = 9;
        assert_eq!(
            s.open(&b, NOW).err(),
            Some(TicketRefusal::Malformed("role"))
        );
        b = t.bytes.clone();
        b[6] = 1;
        assert_eq!(
            s.open(&b, NOW).err(),
            Some(TicketRefusal::Malformed("name length"))
        );
        b = t.bytes.clone();
        b[7] = 0xff;
        assert_eq!(
            s.open(&b, NOW).err(),
            Some(TicketRefusal::Malformed("volume patterns too long"))
        );
        b = t.bytes.clone();
        b[5] += 1;
        assert_eq!(
            s.open(&b, NOW).err(),
            Some(TicketRefusal::Malformed("name length"))
        );
        b = t.bytes.clone();
        b[TICKET_FIXED_LEN] = b'X';
        assert_eq!(
            s.open(&b, NOW).err(),
            Some(TicketRefusal::Malformed("entity name"))
        );
        for r in [
            TicketRefusal::Forged,
            TicketRefusal::Malformed("x"),
            TicketRefusal::Generation { ticket: 1, ours: 2 },
            TicketRefusal::NotYetValid { entity: client() },
        ] {
            assert!(!r.to_string().is_empty() && !r.label().is_empty());
        }
    }

    #[test]
    fn volume_patterns_travel_in_the_ticket_under_its_mac() {
        let s = service(1);
        let v = crate::auth::VolumePatterns::parse_list("vm1-*,shared").unwrap();
        let t = s.issue_for(&client(), Role::Client, &v, NOW, 1000);
        let (claims, _) = s.open(&t.bytes, NOW).unwrap();
        assert_eq!(claims.volumes, v);
        // The most patterns of the longest kind fit the bound.
        let long: Vec<String> = (0..crate::auth::caps::VOLUME_PATTERNS_MAX)
            .map(|i| format!("{i:0>63}*"))
            .collect();
        let v = crate::auth::VolumePatterns::new(long).unwrap();
        let name = EntityName::parse(&format!("client.{}", "n".repeat(57))).unwrap();
        let t = s.issue_for(&name, Role::Client, &v, NOW, 1000);
        assert!(t.bytes.len() <= TICKET_BYTES_MAX, "{}", t.bytes.len());
        assert_eq!(s.open(&t.bytes, NOW).unwrap().0.volumes, v);
        // A pattern length past the section, or a bad pattern: malformed. A
        // pattern changed in place (MAC intact otherwise): forged.
        let t = s.issue_for(
            &client(),
            Role::Client,
            &crate::auth::VolumePatterns::parse_list("ab").unwrap(),
            NOW,
            1000,
        );
        let at = TICKET_FIXED_LEN + client().as_str().len();
        let mut b = t.bytes.clone();
        b[at] = 9;
        assert_eq!(
            s.open(&b, NOW).err(),
            Some(TicketRefusal::Malformed("volume pattern length"))
        );
        b = t.bytes.clone();
        b[at + 1] = b' ';
        assert_eq!(
            s.open(&b, NOW).err(),
            Some(TicketRefusal::Malformed("volume pattern"))
        );
        b = t.bytes.clone();
        b[at + 1] = b'x';
        assert_eq!(s.open(&b, NOW).err(), Some(TicketRefusal::Forged));
    }

    #[test]
    fn sealed_session_keys_open_only_for_their_entity_and_ticket() {
        let s = service(1);
        let t = s.issue(&client(), Role::Client, NOW, 1000);
        let mine = SecretKey::from_hex(&"21".repeat(32)).unwrap();
        let theirs = SecretKey::from_hex(&"22".repeat(32)).unwrap();
        let sealed = seal_session_key(&mine, &t.bytes, &t.session_key).unwrap();
        assert_eq!(sealed.len(), SEALED_KEY_LEN);
        assert_eq!(
            open_session_key(&mine, &t.bytes, &sealed).unwrap().to_hex(),
            t.session_key.to_hex()
        );
        assert!(open_session_key(&theirs, &t.bytes, &sealed).is_err());
        let u = s.issue(&client(), Role::Client, NOW + 1, 1000);
        assert!(
            open_session_key(&mine, &u.bytes, &sealed).is_err(),
            "bound to its ticket"
        );
        let mut bad = sealed.clone();
        bad[20] ^= 1;
        assert!(open_session_key(&mine, &t.bytes, &bad).is_err());
        assert!(open_session_key(&mine, &t.bytes, &sealed[1..]).is_err());
        // Fresh nonce every time.
        assert_ne!(
            seal_session_key(&mine, &t.bytes, &t.session_key).unwrap(),
            sealed
        );
    }

    #[test]
    fn sealed_service_keys_open_only_for_their_osd_and_generation() {
        let s = service(3);
        let osd2 = SecretKey::from_hex(&"23".repeat(32)).unwrap();
        let osd5 = SecretKey::from_hex(&"25".repeat(32)).unwrap();
        let sealed = s.seal_for(&osd2).unwrap();
        let opened = ServiceKey::open_sealed(&osd2, 3, &sealed).unwrap();
        assert_eq!(opened.generation(), 3);
        // The same key: a ticket of one opens with the other.
        let t = s.issue(&client(), Role::Client, NOW, 1000);
        let (claims, session) = opened.open(&t.bytes, NOW).unwrap();
        assert_eq!(claims, t.claims);
        assert_eq!(session.to_hex(), t.session_key.to_hex());
        assert!(
            ServiceKey::open_sealed(&osd5, 3, &sealed).is_err(),
            "another OSD's key"
        );
        assert!(
            ServiceKey::open_sealed(&osd2, 4, &sealed).is_err(),
            "another generation"
        );
        let mut bad = sealed.clone();
        bad[30] ^= 1;
        assert!(ServiceKey::open_sealed(&osd2, 3, &bad).is_err());
        // A sealed session key is not a sealed service key, nor the reverse.
        let sk = seal_session_key(&osd2, &t.bytes, &t.session_key).unwrap();
        assert!(ServiceKey::open_sealed(&osd2, 3, &sk).is_err());
        assert!(open_session_key(&osd2, &t.bytes, &sealed).is_err());
    }
}
