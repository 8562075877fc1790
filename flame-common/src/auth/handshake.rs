//! Mutual authentication at HELLO on an OSD's data and peer ports, in one round
//! trip: the connecting side sends its ticket and a proof of the session key over
//! the HELLO's fields, a time and a nonce; the OSD checks the ticket
//! ([`ServiceKey::open`]), the proof, and that the (time, nonce) pair is new
//! ([`ReplayShares`]: one guard per entity in a share per role, so a captured HELLO cannot be replayed), and answers with its
//! own proof over the same nonce, which only a holder of the service key can make.
//! Connections are authenticated, not frames: nothing per request is added.
//!
//! Pure: the caller gives the time and the nonce.

use super::key::HmacSha256;
use super::ticket::{ServiceKey, SessionTicket, TicketClaims, TicketRefusal};
use super::{EntityName, Nonce, ReplayRefusal, Role, SecretKey};
use crate::protocol::{HELLO_PROOF_LEN, HelloAuth};
use hmac::Mac;

/// Connections an OSD shard remembers per replay window (2 minutes): far more
/// than a shard is ever opened, and 2 MiB at most.
pub const HELLO_REPLAY_ENTRIES_MAX: usize = 32_768;

/// How much of a shard's HELLO window each role may hold: one entity's
/// connections fill its own part (a client with one ticket opening connections
/// as fast as it can is refused alone), the clients' together at most
/// [`HELLO_REPLAY_ENTRIES_MAX`], and the OSDs' peer connections have a share
/// of their own.
pub fn hello_replay_limits(role: Role) -> super::ShareLimits {
    match role {
        Role::Osd => super::ShareLimits {
            entity_entries_max: 8_192,
            share_entries_max: 16_384,
        },
        Role::Client => super::ShareLimits {
            entity_entries_max: 1_024,
            share_entries_max: HELLO_REPLAY_ENTRIES_MAX,
        },
        Role::Admin => super::ShareLimits {
            entity_entries_max: 1_024,
            share_entries_max: 4_096,
        },
    }
}

const CLIENT_PROOF_CONTEXT: &[u8] = b"flame-hello-v1\0";
const SERVER_PROOF_CONTEXT: &[u8] = b"flame-hello-reply-v1\0";

/// The HELLO fields a proof covers: which OSD shard is meant (so a proof cannot
/// be replayed at another one), the role asked for, and the session fencing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HelloBinding {
    /// The OSD's id.
    pub osd: u32,
    /// The shard.
    pub shard: u16,
    /// Whether the replication role is asked for.
    pub peer: bool,
    /// The HELLO's session.
    pub session: u64,
    /// The HELLO's connection generation.
    pub generation: u64,
}

impl HelloBinding {
    /// The binding of a received `Message::Hello` at OSD `osd` (`None` for any
    /// other message). The shard is the one the sender names.
    pub fn of(osd: u32, hello: &crate::protocol::Message) -> Option<HelloBinding> {
        match hello {
            crate::protocol::Message::Hello {
                shard,
                peer,
                session,
                generation,
                ..
            } => Some(HelloBinding {
                osd,
                shard: *shard,
                peer: *peer,
                session: *session,
                generation: *generation,
            }),
            _ => None,
        }
    }

    fn feed(&self, mac: &mut HmacSha256) {
        mac.update(&self.osd.to_le_bytes());
        mac.update(&self.shard.to_le_bytes());
        mac.update(&[u8::from(self.peer)]);
        mac.update(&self.session.to_le_bytes());
        mac.update(&self.generation.to_le_bytes());
    }
}

fn client_mac(key: &SecretKey, b: &HelloBinding, time_ms: u64, nonce: &[u8; 16]) -> HmacSha256 {
    let mut mac = key.mac();
    mac.update(CLIENT_PROOF_CONTEXT);
    b.feed(&mut mac);
    mac.update(&time_ms.to_le_bytes());
    mac.update(nonce);
    mac
}

fn server_mac(key: &SecretKey, b: &HelloBinding, nonce: &[u8; 16]) -> HmacSha256 {
    let mut mac = key.mac();
    mac.update(SERVER_PROOF_CONTEXT);
    b.feed(&mut mac);
    mac.update(nonce);
    mac
}

/// A HELLO's nonce: unique, not secret (with the time, what the OSD's replay
/// guard remembers), so from [`crate::entropy`], which a simulated thread draws
/// from the seed (a seed replays byte for byte).
pub fn hello_nonce() -> Nonce {
    let mut n = [0u8; 16];
    n[..8].copy_from_slice(&crate::entropy::u64().to_le_bytes());
    n[8..].copy_from_slice(&crate::entropy::u64().to_le_bytes());
    Nonce(n)
}

/// The authentication section of a HELLO for `binding`, made with `ticket` at
/// `time_ms` with a fresh `nonce`.
pub fn hello_auth(
    ticket: &SessionTicket,
    binding: &HelloBinding,
    time_ms: u64,
    nonce: Nonce,
) -> HelloAuth {
    let proof = client_mac(&ticket.session_key, binding, time_ms, &nonce.0)
        .finalize()
        .into_bytes()
        .into();
    HelloAuth {
        ticket: ticket.bytes.clone(),
        time_ms,
        nonce: nonce.0,
        proof,
    }
}

/// Whether an OSD's HELLO reply proof is the one the holder of the service key
/// makes for this HELLO (checked by the connecting side before it sends
/// anything else: a squatter on an OSD's address cannot make it).
pub fn check_server_proof(
    ticket: &SessionTicket,
    binding: &HelloBinding,
    auth: &HelloAuth,
    proof: &[u8; HELLO_PROOF_LEN],
) -> bool {
    server_mac(&ticket.session_key, binding, &auth.nonce)
        .verify_slice(proof)
        .is_ok()
}

/// Who an authenticated connection belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Authenticated {
    /// The entity.
    pub entity: EntityName,
    /// Its role (only [`Role::Osd`] may open replication connections).
    pub role: Role,
}

/// Why an OSD refused a HELLO.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HelloRefusal {
    /// No ticket, on an OSD that requires one.
    Missing,
    /// The ticket was refused.
    Ticket(TicketRefusal),
    /// The proof does not match (not the ticket's holder, or altered fields).
    Proof {
        /// The ticket's entity.
        entity: EntityName,
    },
    /// The (time, nonce) pair is outside the window or seen before.
    Replay {
        /// The ticket's entity.
        entity: EntityName,
        /// Why.
        refusal: ReplayRefusal,
    },
    /// The replication role asked for by an entity that is not an OSD.
    NotAnOsd {
        /// The ticket's entity.
        entity: EntityName,
        /// Its role.
        role: Role,
    },
}

impl std::fmt::Display for HelloRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HelloRefusal::Missing => f.write_str(
                "no ticket: this OSD requires authentication (give the client a keyring)",
            ),
            HelloRefusal::Ticket(t) => write!(f, "{t}"),
            HelloRefusal::Proof { entity } => {
                write!(f, "{entity}'s hello proof does not match its ticket")
            }
            HelloRefusal::Replay { entity, refusal } => write!(f, "{entity}'s hello: {refusal}"),
            HelloRefusal::NotAnOsd { entity, role } => write!(
                f,
                "{entity} (role {}) asked for the replication role, which only OSDs have",
                role.as_str()
            ),
        }
    }
}

impl HelloRefusal {
    /// A short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            HelloRefusal::Missing => "missing",
            HelloRefusal::Ticket(t) => t.label(),
            HelloRefusal::Proof { .. } => "bad_proof",
            HelloRefusal::Replay { .. } => "replayed",
            HelloRefusal::NotAnOsd { .. } => "not_an_osd",
        }
    }
}

/// An OSD shard's side: the service key and the HELLOs of the window.
#[derive(Debug)]
pub struct HelloVerifier {
    service: ServiceKey,
    guard: super::ReplayShares,
}

/// An accepted HELLO: who, and the reply proof to send.
#[derive(Clone, Debug)]
pub struct Accepted {
    /// Who.
    pub who: Authenticated,
    /// What the ticket says.
    pub claims: TicketClaims,
    /// The HELLO reply's proof.
    pub proof: [u8; HELLO_PROOF_LEN],
}

impl HelloVerifier {
    /// A verifier with `service`'s key and an empty replay guard.
    pub fn new(service: ServiceKey) -> HelloVerifier {
        HelloVerifier {
            service,
            guard: super::ReplayShares::new(hello_replay_limits),
        }
    }

    /// The service key (for minting this OSD's own peer tickets).
    pub fn service(&self) -> &ServiceKey {
        &self.service
    }

    /// Checks HELLOs with `service` from now on (a rotated `osd` key), keeping
    /// the replay guard: a HELLO seen under the old key is still a replay.
    pub fn set_service(&mut self, service: ServiceKey) {
        self.service = service;
    }

    /// Checks a HELLO's authentication section for `binding` at `now_ms`. The
    /// replay guard remembers only HELLOs whose ticket and proof check, so only a
    /// key holder can fill it.
    pub fn verify(
        &mut self,
        auth: Option<&HelloAuth>,
        binding: &HelloBinding,
        now_ms: u64,
    ) -> Result<Accepted, HelloRefusal> {
        let auth = auth.ok_or(HelloRefusal::Missing)?;
        let (claims, key) = self
            .service
            .open(&auth.ticket, now_ms)
            .map_err(HelloRefusal::Ticket)?;
        if client_mac(&key, binding, auth.time_ms, &auth.nonce)
            .verify_slice(&auth.proof)
            .is_err()
        {
            return Err(HelloRefusal::Proof {
                entity: claims.entity,
            });
        }
        if binding.peer && claims.role != Role::Osd {
            return Err(HelloRefusal::NotAnOsd {
                entity: claims.entity,
                role: claims.role,
            });
        }
        self.guard
            .check(
                &claims.entity,
                claims.role,
                now_ms,
                auth.time_ms,
                Nonce(auth.nonce),
            )
            .map_err(|refusal| HelloRefusal::Replay {
                entity: claims.entity.clone(),
                refusal,
            })?;
        let proof = server_mac(&key, binding, &auth.nonce)
            .finalize()
            .into_bytes()
            .into();
        Ok(Accepted {
            who: Authenticated {
                entity: claims.entity.clone(),
                role: claims.role,
            },
            claims,
            proof,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::TICKET_LIFETIME_MS;

    const NOW: u64 = 1_900_000_000_000;

    fn service() -> ServiceKey {
        ServiceKey::from_osd_key(&SecretKey::from_hex(&"5a".repeat(32)).unwrap(), 1)
    }

    fn binding(peer: bool) -> HelloBinding {
        HelloBinding {
            osd: 2,
            shard: 1,
            peer,
            session: 77,
            generation: 3,
        }
    }

    fn ticket(role: Role) -> SessionTicket {
        let name = if role == Role::Osd {
            EntityName::osd()
        } else {
            EntityName::parse("client.vm").unwrap()
        };
        service().issue(&name, role, NOW, TICKET_LIFETIME_MS)
    }

    #[test]
    fn a_valid_hello_is_accepted_once_and_answered_with_a_proof_only_the_osd_can_make() {
        let mut v = HelloVerifier::new(service());
        let t = ticket(Role::Client);
        let b = binding(false);
        let a = hello_auth(&t, &b, NOW, Nonce([1; 16]));
        let ok = v.verify(Some(&a), &b, NOW + 5).unwrap();
        assert_eq!(ok.who.entity.as_str(), "client.vm");
        assert_eq!(ok.who.role, Role::Client);
        assert!(check_server_proof(&t, &b, &a, &ok.proof));
        // The proof is bound to the binding and the nonce.
        assert!(!check_server_proof(&t, &binding(true), &a, &ok.proof));
        let other = hello_auth(&t, &b, NOW, Nonce([2; 16]));
        assert!(!check_server_proof(&t, &b, &other, &ok.proof));
        // Replayed verbatim: refused.
        assert!(matches!(
            v.verify(Some(&a), &b, NOW + 6),
            Err(HelloRefusal::Replay {
                refusal: ReplayRefusal::Replayed,
                ..
            })
        ));
    }

    /// One client ticket opening connections as fast as it can fills its own
    /// part of the shard's HELLO guard and is refused alone; an OSD's peer
    /// HELLO still gets in.
    #[test]
    fn one_ticket_cannot_fill_a_shards_hello_guard() {
        let mut v = HelloVerifier::new(service());
        let t = ticket(Role::Client);
        let b = binding(false);
        let limit = hello_replay_limits(Role::Client).entity_entries_max;
        for i in 0..limit as u128 {
            let a = hello_auth(&t, &b, NOW, Nonce(i.to_le_bytes()));
            v.verify(Some(&a), &b, NOW).unwrap();
        }
        let a = hello_auth(&t, &b, NOW, Nonce([0xff; 16]));
        assert!(matches!(
            v.verify(Some(&a), &b, NOW),
            Err(HelloRefusal::Replay {
                refusal: ReplayRefusal::Full,
                ..
            })
        ));
        let o = ticket(Role::Osd);
        let p = binding(true);
        let a = hello_auth(&o, &p, NOW, Nonce([0xff; 16]));
        assert_eq!(v.verify(Some(&a), &p, NOW).unwrap().who.role, Role::Osd);
    }

    #[test]
    fn every_refusal() {
        let mut v = HelloVerifier::new(service());
        let t = ticket(Role::Client);
        let b = binding(false);
        assert_eq!(v.verify(None, &b, NOW).err(), Some(HelloRefusal::Missing));
        // A field changed after the proof was made (another shard, the peer role,
        // another session or generation): the proof no longer matches.
        let a = hello_auth(&t, &b, NOW, Nonce([1; 16]));
        for other in [
            HelloBinding { shard: 2, ..b },
            HelloBinding { osd: 3, ..b },
            HelloBinding { session: 78, ..b },
            HelloBinding { generation: 4, ..b },
        ] {
            assert!(matches!(
                v.verify(Some(&a), &other, NOW),
                Err(HelloRefusal::Proof { .. })
            ));
        }
        let mut bad = a.clone();
        bad.proof[0] ^= 1;
        assert!(matches!(
            v.verify(Some(&bad), &b, NOW),
            Err(HelloRefusal::Proof { .. })
        ));
        bad = a.clone();
        bad.time_ms += 1;
        assert!(matches!(
            v.verify(Some(&bad), &b, NOW),
            Err(HelloRefusal::Proof { .. })
        ));
        bad = a.clone();
        bad.ticket[30] ^= 1;
        assert!(matches!(
            v.verify(Some(&bad), &b, NOW),
            Err(HelloRefusal::Ticket(_))
        ));
        // A client asking for the peer role, with a correct proof.
        let p = binding(true);
        let a = hello_auth(&t, &p, NOW, Nonce([3; 16]));
        let r = v.verify(Some(&a), &p, NOW).unwrap_err();
        assert_eq!(r.label(), "not_an_osd");
        assert!(r.to_string().contains("client.vm"), "{r}");
        // An OSD may.
        let o = ticket(Role::Osd);
        let a = hello_auth(&o, &p, NOW, Nonce([3; 16]));
        assert_eq!(v.verify(Some(&a), &p, NOW).unwrap().who.role, Role::Osd);
        // Stale proof time.
        let a = hello_auth(
            &t,
            &b,
            NOW - crate::auth::REPLAY_WINDOW_MS - 1,
            Nonce([4; 16]),
        );
        assert!(matches!(
            v.verify(Some(&a), &b, NOW),
            Err(HelloRefusal::Replay {
                refusal: ReplayRefusal::Stale { .. },
                ..
            })
        ));
        // Expired ticket, correct proof.
        let a = hello_auth(&t, &b, NOW + 2 * TICKET_LIFETIME_MS, Nonce([5; 16]));
        assert!(matches!(
            v.verify(Some(&a), &b, NOW + 2 * TICKET_LIFETIME_MS),
            Err(HelloRefusal::Ticket(TicketRefusal::Expired { .. }))
        ));
        for r in [
            HelloRefusal::Missing,
            HelloRefusal::Ticket(TicketRefusal::Forged),
            HelloRefusal::Proof {
                entity: EntityName::osd(),
            },
        ] {
            assert!(!r.to_string().is_empty() && !r.label().is_empty());
        }
    }

    #[test]
    fn refused_hellos_are_not_remembered() {
        let mut v = HelloVerifier::new(service());
        let t = ticket(Role::Client);
        let b = binding(false);
        let mut bad = hello_auth(&t, &b, NOW, Nonce([1; 16]));
        bad.proof[0] ^= 1;
        for _ in 0..10 {
            assert!(v.verify(Some(&bad), &b, NOW).is_err());
        }
        assert_eq!(v.guard.entities(), 0);
    }
}
