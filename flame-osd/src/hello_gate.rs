//! Who may open a connection to a shard. An OSD with a keyring holds the
//! service key and admits a HELLO only with a valid ticket and proof
//! (`flame_common::auth::handshake`), the replication role only for OSDs; its
//! answer carries its own proof. An OSD without a keyring (a cluster with
//! `auth: none`) admits every HELLO, as before authentication existed.
//!
//! One gate per shard (penetrating mode) or per listener (staged mode's network
//! threads), with that shard's replay guard. A proof names the OSD and the shard
//! the sender meant: replayed at another OSD it fails, at another shard of this
//! one it is answered ESTALE (the shard number does not match) and closed.

use crate::service_key::ServiceKeys;
use flame_common::auth::handshake::{Authenticated, HelloBinding, HelloRefusal, HelloVerifier};
use flame_common::clock;
use flame_common::ids::OsdId;
use flame_common::protocol::{HELLO_PROOF_LEN, Message};
use std::cell::RefCell;

/// A shard's HELLO check.
#[derive(Debug)]
pub struct HelloGate {
    osd: OsdId,
    /// The verifier, and the shared key it follows.
    verifier: Option<(RefCell<HelloVerifier>, ServiceKeys)>,
}

/// What an admitted HELLO brings.
#[derive(Clone, Debug, Default)]
pub struct Admitted {
    /// The proof to put in the HELLO reply (`None` without authentication).
    pub proof: Option<[u8; HELLO_PROOF_LEN]>,
    /// Who connected (`None` without authentication).
    pub who: Option<Authenticated>,
    /// The volumes its ticket allows (every volume without authentication).
    pub volumes: flame_common::auth::VolumePatterns,
}

impl HelloGate {
    /// A gate of a shard of `osd`; `service`: the OSD's service key (followed
    /// when it is replaced), `None` when it runs without a keyring.
    pub fn new(osd: OsdId, service: Option<ServiceKeys>) -> HelloGate {
        HelloGate {
            osd,
            verifier: service.map(|keys| {
                let current = (*keys.current()).clone();
                (RefCell::new(HelloVerifier::new(current)), keys)
            }),
        }
    }

    /// Admits or refuses `hello` (a `Message::Hello`) now.
    pub fn check(&self, hello: &Message) -> Result<Admitted, HelloRefusal> {
        let Some((verifier, keys)) = &self.verifier else {
            return Ok(Admitted::default());
        };
        if keys.generation() != verifier.borrow().service().generation() {
            // The `osd` key was rotated: check with the new service key.
            verifier.borrow_mut().set_service((*keys.current()).clone());
        }
        let (Message::Hello { peer, auth, .. }, Some(binding)) =
            (hello, HelloBinding::of(self.osd.0, hello))
        else {
            return Err(HelloRefusal::Missing);
        };
        // The shard is the one the sender names: a HELLO for another shard (a
        // stale map, or one replayed here from another shard) passes this check
        // and is then answered ESTALE and closed, which is what tells a client
        // its map is stale. The OSD is this one.
        let accepted = verifier
            .borrow_mut()
            .verify(auth.as_deref(), &binding, clock::unix_ms())?;
        debug_assert!(!*peer || accepted.who.role == flame_common::auth::Role::Osd);
        Ok(Admitted {
            proof: Some(accepted.proof),
            who: Some(accepted.who),
            volumes: accepted.claims.volumes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::auth::handshake::hello_auth;
    use flame_common::auth::{EntityName, Nonce, Role, SecretKey, ServiceKey, TICKET_LIFETIME_MS};
    use flame_common::ids::{Epoch, RequestId};
    use flame_common::protocol::VERSIONS;

    fn service_of(generation: u64) -> ServiceKey {
        let osd_key = SecretKey::from_hex(&"77".repeat(32))
            .unwrap()
            .derive_entity_key(&EntityName::osd(), generation);
        ServiceKey::from_osd_key(&osd_key, generation)
    }

    fn service() -> ServiceKey {
        service_of(1)
    }

    fn keys() -> ServiceKeys {
        ServiceKeys::new(service())
    }

    fn hello(shard: u16, peer: bool, role: Option<Role>) -> Message {
        hello_under(&service(), shard, peer, role)
    }

    fn hello_under(service: &ServiceKey, shard: u16, peer: bool, role: Option<Role>) -> Message {
        let binding = HelloBinding {
            osd: 4,
            shard,
            peer,
            session: 9,
            generation: 1,
        };
        let auth = role.map(|r| {
            let name = if r == Role::Osd {
                EntityName::osd()
            } else {
                EntityName::parse("client.t").unwrap()
            };
            let t = service.issue(&name, r, clock::unix_ms(), TICKET_LIFETIME_MS);
            Box::new(hello_auth(
                &t,
                &binding,
                clock::unix_ms(),
                Nonce::random().unwrap(),
            ))
        });
        Message::Hello {
            id: RequestId(0),
            epoch: Epoch(1),
            versions: VERSIONS,
            shard,
            peer,
            session: 9,
            generation: 1,
            auth,
        }
    }

    #[test]
    fn without_a_key_everything_is_admitted() {
        let g = HelloGate::new(OsdId(4), None);
        let a = g.check(&hello(0, true, None)).unwrap();
        assert!(a.proof.is_none() && a.who.is_none());
    }

    #[test]
    fn with_a_key_only_valid_tickets_and_osds_as_peers() {
        let g = HelloGate::new(OsdId(4), Some(keys()));
        assert_eq!(
            g.check(&hello(0, false, None)).unwrap_err(),
            HelloRefusal::Missing
        );
        let a = g.check(&hello(0, false, Some(Role::Client))).unwrap();
        assert!(a.proof.is_some());
        assert_eq!(a.who.unwrap().role, Role::Client);
        assert_eq!(
            g.check(&hello(0, true, Some(Role::Client)))
                .unwrap_err()
                .label(),
            "not_an_osd"
        );
        assert!(g.check(&hello(0, true, Some(Role::Osd))).is_ok());
        // Made for shard 1 and naming it: admitted here (then answered ESTALE
        // by the shard, which is not shard 1).
        assert!(g.check(&hello(1, false, Some(Role::Client))).is_ok());
        // Made for another OSD.
        let g5 = HelloGate::new(OsdId(5), Some(keys()));
        assert_eq!(
            g5.check(&hello(0, false, Some(Role::Client)))
                .unwrap_err()
                .label(),
            "bad_proof"
        );
        // Another cluster's OSD key.
        let other = HelloGate::new(
            OsdId(4),
            Some(ServiceKeys::new(ServiceKey::from_osd_key(
                &SecretKey::from_hex(&"78".repeat(32)).unwrap(),
                1,
            ))),
        );
        assert_eq!(
            other
                .check(&hello(0, false, Some(Role::Client)))
                .unwrap_err()
                .label(),
            "forged_ticket"
        );
    }

    /// A rotated `osd` key reaches the gate through the shared cell, without a
    /// new gate: tickets of the new generation are admitted from then on, the
    /// old generation's refused (as `ticket_generation`).
    #[test]
    fn the_gate_follows_a_replaced_service_key() {
        let keys = keys();
        let g = HelloGate::new(OsdId(4), Some(keys.clone()));
        let (old, new) = (service_of(1), service_of(2));
        assert!(
            g.check(&hello_under(&old, 0, false, Some(Role::Client)))
                .is_ok()
        );
        assert_eq!(
            g.check(&hello_under(&new, 0, false, Some(Role::Client)))
                .unwrap_err()
                .label(),
            "ticket_generation"
        );
        keys.replace(new.clone());
        assert!(
            g.check(&hello_under(&new, 0, false, Some(Role::Client)))
                .is_ok()
        );
        assert_eq!(
            g.check(&hello_under(&old, 0, false, Some(Role::Client)))
                .unwrap_err()
                .label(),
            "ticket_generation"
        );
    }
}
