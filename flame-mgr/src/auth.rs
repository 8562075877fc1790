//! Who may call which route of the API: the entity table, the rule per route, and
//! the check of a signed request — pure (no I/O, the time is an argument), so
//! every branch is unit-tested; [`crate::api`] drives it from a middleware.
//!
//! Roles: `admin` may do everything; `osd` may read and do what an OSD does
//! (boot, heartbeat, failure reports, recovered copies, finishing a trim is the
//! admin's); `client` may only read (the map, status, volumes). `/metrics` is
//! open, as Prometheus scrapes it without a key. An `osd.N` entity acts only as
//! OSD N ([`check_acts_for`]); the shared `osd` entity, as any OSD.

pub use flame_common::auth::Role;
use flame_common::auth::{
    Credentials, EntityName, KeyGeneration, Nonce, REPLAY_ENTRIES_MAX, ReplayRefusal, ReplayShares,
    RequestAuth, SecretKey, ShareLimits, VolumePatterns,
};
use flame_common::ids::OsdId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Most entities a cluster may have: bounds the table in `state.json` and in
/// every `GET /v1/auth/entities`.
pub const ENTITY_COUNT_MAX: usize = 4096;

/// One entity: its role, current key generation and the volumes it may use.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EntityRecord {
    /// What it may do.
    pub role: Role,
    /// Its current key generation (≥ 1); a rotation increments it.
    pub generation: KeyGeneration,
    /// The volumes it may read and write on the OSDs (in its tickets); absent
    /// or empty: every volume.
    #[serde(default, skip_serializing_if = "VolumePatterns::is_all")]
    pub volumes: VolumePatterns,
}

/// Every entity of the cluster, persisted in `state.json` (older files have none:
/// the two built-ins below).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct AuthTable {
    /// By name.
    pub entities: BTreeMap<EntityName, EntityRecord>,
}

impl Default for AuthTable {
    /// `client.admin` (admin) and `osd` (osd), both at generation 1.
    fn default() -> Self {
        let mut entities = BTreeMap::new();
        let first = |role| EntityRecord {
            role,
            generation: 1,
            volumes: VolumePatterns::all(),
        };
        entities.insert(EntityName::admin(), first(Role::Admin));
        entities.insert(EntityName::osd(), first(Role::Osd));
        AuthTable { entities }
    }
}

impl AuthTable {
    /// Checks a loaded table: the built-ins exist with their roles, generations
    /// are at least 1, and the count is bounded.
    pub fn check(&self) -> Result<(), String> {
        if self.entities.len() > ENTITY_COUNT_MAX {
            return Err(format!("more than {ENTITY_COUNT_MAX} entities"));
        }
        for (name, role) in [
            (EntityName::admin(), Role::Admin),
            (EntityName::osd(), Role::Osd),
        ] {
            if self.entities.get(&name).map(|r| r.role) != Some(role) {
                return Err(format!(
                    "entity {name} is missing or not of role {}",
                    role.as_str()
                ));
            }
        }
        if let Some((name, _)) = self.entities.iter().find(|(_, r)| r.generation == 0) {
            return Err(format!("entity {name} has key generation 0"));
        }
        if let Some((name, _)) = self
            .entities
            .iter()
            .find(|(n, r)| n.is_osd() != (r.role == Role::Osd))
        {
            return Err(format!(
                "entity {name}: `osd` and `osd.N` have the osd role, and nothing else"
            ));
        }
        Ok(())
    }

    /// Adds a `client.NAME` entity with `role` (client or admin), or an `osd.N`
    /// entity with role osd, at generation 1, allowed `volumes`.
    pub fn add(
        &mut self,
        name: &EntityName,
        role: Role,
        volumes: VolumePatterns,
    ) -> Result<EntityRecord, String> {
        self.add_at(name, role, volumes, 1)
    }

    /// [`Self::add`] at key generation `generation` (≥ 1): above the last one a
    /// removed entity of the same name had, so its old key never works again.
    pub fn add_at(
        &mut self,
        name: &EntityName,
        role: Role,
        volumes: VolumePatterns,
        generation: KeyGeneration,
    ) -> Result<EntityRecord, String> {
        if generation == 0 {
            return Err(format!("entity {name}: key generation 0"));
        }
        if *name == EntityName::osd() {
            return Err("entity osd is built in".into());
        }
        if name.is_osd() != (role == Role::Osd) {
            return Err(format!(
                "entity {name}: osd.N entities have the osd role, and only they (add \
                 osd.N with --role osd)"
            ));
        }
        if let Some(id) = name.osd_id()
            && id.0 >= crate::state::OSD_ID_MAX
        {
            return Err(format!(
                "entity {name}: OSD ids are below {}",
                crate::state::OSD_ID_MAX
            ));
        }
        if name.is_osd() && !volumes.is_all() {
            return Err(format!("entity {name}: an OSD serves every volume"));
        }
        if self.entities.contains_key(name) {
            return Err(format!("entity {name} exists already"));
        }
        if self.entities.len() >= ENTITY_COUNT_MAX {
            return Err(format!(
                "the cluster has {ENTITY_COUNT_MAX} entities, the most allowed"
            ));
        }
        let rec = EntityRecord {
            role,
            generation,
            volumes,
        };
        self.entities.insert(name.clone(), rec.clone());
        Ok(rec)
    }

    /// Sets the volumes an entity may use (its next tickets carry them).
    pub fn set_volumes(
        &mut self,
        name: &EntityName,
        volumes: VolumePatterns,
    ) -> Result<EntityRecord, String> {
        if name.is_osd() {
            return Err(format!("entity {name}: an OSD serves every volume"));
        }
        let rec = self
            .entities
            .get_mut(name)
            .ok_or_else(|| format!("no entity {name}"))?;
        rec.volumes = volumes;
        Ok(rec.clone())
    }

    /// Moves an entity to its next key generation: its old key stops working.
    pub fn rotate(&mut self, name: &EntityName) -> Result<EntityRecord, String> {
        let rec = self
            .entities
            .get_mut(name)
            .ok_or_else(|| format!("no entity {name}"))?;
        rec.generation = rec
            .generation
            .checked_add(1)
            .ok_or_else(|| format!("entity {name}: key generation exhausted"))?;
        Ok(rec.clone())
    }

    /// Removes an entity (not a built-in).
    pub fn remove(&mut self, name: &EntityName) -> Result<EntityRecord, String> {
        if *name == EntityName::admin() || *name == EntityName::osd() {
            return Err(format!(
                "entity {name} is built in and cannot be removed (rotate its key instead)"
            ));
        }
        self.entities
            .remove(name)
            .ok_or_else(|| format!("no entity {name}"))
    }
}

/// What a route needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Nothing (`/metrics`).
    Open,
    /// A valid signature of any entity.
    Any,
    /// The osd role (or admin).
    Osd,
    /// The osd role only (the service key: not even an admin needs it).
    OsdOnly,
    /// The admin role.
    Admin,
}

/// The rule of `method` on the route template `route` (axum's `MatchedPath`;
/// `None` for an unmatched path, which still needs a signature so that probing
/// for routes needs a key too).
pub fn required_access(method: &str, route: Option<&str>) -> Access {
    let Some(route) = route else {
        return Access::Any;
    };
    match (method, route) {
        (_, "/metrics") => Access::Open,
        ("POST", "/v1/auth/ticket") => Access::Any,
        ("POST", "/v1/auth/service-key") => Access::OsdOnly,
        ("GET" | "HEAD", r) if !r.starts_with("/v1/auth/") => Access::Any,
        ("POST", "/v1/osd/boot" | "/v1/osd/heartbeat" | "/v1/osd/failure" | "/v1/pg/recovered") => {
            Access::Osd
        }
        _ => Access::Admin,
    }
}

/// Whether `role` satisfies `access`.
pub fn permits(role: Role, access: Access) -> bool {
    match access {
        Access::Open | Access::Any => true,
        Access::Osd => matches!(role, Role::Osd | Role::Admin),
        Access::OsdOnly => role == Role::Osd,
        Access::Admin => role == Role::Admin,
    }
}

/// Whether the signer of a request on an OSD route (boot, heartbeat, failure
/// report, recovered copies) may act as OSD `osd`: an `osd.N` entity only as
/// OSD N; the shared `osd` entity and admins as any; `None` (auth: none) too.
/// The one place this rule lives, so every OSD route applies the same.
pub fn check_acts_for(signer: Option<&EntityName>, osd: OsdId) -> Result<(), Refusal> {
    match signer.and_then(|e| e.osd_id().map(|own| (e, own))) {
        Some((entity, own)) if own != osd => Err(Refusal::OtherOsd {
            entity: entity.clone(),
            osd,
        }),
        _ => Ok(()),
    }
}

/// Why a request was refused. Nothing it asked for was done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization` header.
    Missing,
    /// The header does not parse.
    Malformed(String),
    /// The entity is not in the table.
    UnknownEntity(EntityName),
    /// The entity's key was rotated past the signer's generation.
    OldGeneration {
        /// Who.
        entity: EntityName,
        /// The generation it signed with.
        signed: KeyGeneration,
        /// The current one.
        current: KeyGeneration,
    },
    /// The signature is not the entity's key's.
    BadSignature(EntityName),
    /// A stale, future or replayed request.
    Replay(EntityName, ReplayRefusal),
    /// An `osd.N` entity acting for another OSD.
    OtherOsd {
        /// Who (`osd.N`).
        entity: EntityName,
        /// The OSD it acted for.
        osd: OsdId,
    },
    /// Authenticated, but the role does not allow this route.
    Forbidden {
        /// Who.
        entity: EntityName,
        /// Its role.
        role: Role,
        /// What the route needs.
        needed: Access,
    },
}

impl Refusal {
    /// The HTTP status: 401 for who-are-you, 403 for not-allowed, 429 when the
    /// replay window is full (retry), 400 for malformed.
    pub fn status(&self) -> u16 {
        match self {
            Refusal::Forbidden { .. } | Refusal::OtherOsd { .. } => 403,
            Refusal::Malformed(_) => 400,
            Refusal::Replay(_, ReplayRefusal::Full) => 429,
            _ => 401,
        }
    }

    /// The metric label (a fixed set).
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Malformed(_) => "malformed",
            Refusal::UnknownEntity(_) => "unknown_entity",
            Refusal::OldGeneration { .. } => "rotated_key",
            Refusal::BadSignature(_) => "bad_signature",
            Refusal::Replay(_, ReplayRefusal::Replayed) => "replayed",
            Refusal::Replay(_, ReplayRefusal::Full) => "replay_window_full",
            Refusal::Replay(..) => "clock",
            Refusal::Forbidden { .. } => "forbidden",
            Refusal::OtherOsd { .. } => "other_osd",
        }
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refusal::Missing => f.write_str(
                "authentication required: this manager runs with `auth: required`; give \
                 a keyring (flame-admin --keyring FILE, `keyring:` in a daemon's config)",
            ),
            Refusal::Malformed(m) => write!(f, "{m}"),
            Refusal::UnknownEntity(e) => write!(
                f,
                "entity {e} is not known to this cluster (see `flame-admin auth ls`)"
            ),
            Refusal::OldGeneration {
                entity,
                signed,
                current,
            } => write!(
                f,
                "entity {entity}: key generation {signed} was rotated; the current one is \
                 {current} (get the new keyring with `flame-admin auth key {entity}`)"
            ),
            Refusal::BadSignature(e) => write!(
                f,
                "entity {e}: wrong signature (the keyring is not this cluster's, or the \
                 request was altered)"
            ),
            Refusal::Replay(e, r) => write!(f, "entity {e}: {r}"),
            Refusal::OtherOsd { entity, osd } => write!(
                f,
                "entity {entity} may act only as its own OSD, not as {osd} (an OSD's \
                 keyring must be its own: `flame-admin auth add {}`)",
                EntityName::of_osd(*osd)
            ),
            Refusal::Forbidden {
                entity,
                role,
                needed,
            } => write!(
                f,
                "entity {entity} (role {}) may not do this: it needs {}",
                role.as_str(),
                match needed {
                    Access::Admin => "the admin role",
                    Access::Osd | Access::OsdOnly => "the osd role",
                    Access::Any | Access::Open => "a key",
                }
            ),
        }
    }
}

/// The manager's side of authentication: the cluster secret and the replay
/// guards, one per entity in one share per role ([`ReplayShares`]): a client
/// key signing requests as fast as it can fills its own guard, never the
/// OSDs' (their heartbeats and map fetches) or the administrators'.
#[derive(Debug)]
pub struct Verifier {
    secret: SecretKey,
    replay: ReplayShares,
}

/// How much of the replay window each role may hold at the manager: one
/// entity at most a quarter of a share (65 536 requests in two minutes, 546 a
/// second: far above any legitimate caller; an OSD signs about two a second,
/// and the shared `osd` entity of older deployments signs for every OSD), so
/// four keys of one role are needed to fill its share, and none can touch
/// another role's. At most 640 Ki entries (about 32 MiB) in all.
pub fn replay_limits(role: Role) -> ShareLimits {
    match role {
        Role::Osd => ShareLimits {
            entity_entries_max: REPLAY_ENTRIES_MAX / 4,
            share_entries_max: REPLAY_ENTRIES_MAX,
        },
        Role::Client => ShareLimits {
            entity_entries_max: REPLAY_ENTRIES_MAX / 4,
            share_entries_max: REPLAY_ENTRIES_MAX,
        },
        Role::Admin => ShareLimits {
            entity_entries_max: REPLAY_ENTRIES_MAX / 4,
            share_entries_max: REPLAY_ENTRIES_MAX / 2,
        },
    }
}

/// A request header that names a known entity at its current generation, not yet
/// checked against the body.
#[derive(Debug)]
pub struct Claim {
    auth: RequestAuth,
    role: Role,
}

impl Claim {
    /// Who claims to sign.
    pub fn entity(&self) -> &EntityName {
        &self.auth.entity
    }

    /// The request's nonce (the answer's signature covers it).
    pub fn nonce(&self) -> Nonce {
        self.auth.nonce
    }

    /// The claimed entity's role in the table.
    pub fn role(&self) -> Role {
        self.role
    }
}

impl Verifier {
    /// A verifier holding the cluster secret.
    pub fn new(secret: SecretKey) -> Verifier {
        Verifier {
            secret,
            replay: ReplayShares::new(replay_limits),
        }
    }

    /// First step, before the body is read: the header parses and names a known
    /// entity at its current key generation.
    pub fn claim(table: &AuthTable, header: Option<&str>) -> Result<Claim, Refusal> {
        let header = header.ok_or(Refusal::Missing)?;
        let auth = RequestAuth::parse(header).map_err(Refusal::Malformed)?;
        let rec = table
            .entities
            .get(&auth.entity)
            .ok_or_else(|| Refusal::UnknownEntity(auth.entity.clone()))?;
        if auth.generation != rec.generation {
            return Err(Refusal::OldGeneration {
                entity: auth.entity.clone(),
                signed: auth.generation,
                current: rec.generation,
            });
        }
        Ok(Claim {
            role: rec.role,
            auth,
        })
    }

    /// Second step: the signature over `method path body` is the entity's key's,
    /// the request is within the window and new, and the role allows `access`.
    /// Returns the signer's credentials, to sign the answer with.
    pub fn verify(
        &mut self,
        claim: &Claim,
        method: &str,
        path_and_query: &str,
        body: &[u8],
        now_ms: u64,
        access: Access,
    ) -> Result<Credentials, Refusal> {
        let a = &claim.auth;
        let key = self.secret.derive_entity_key(&a.entity, a.generation);
        if !a.verify(&key, method, path_and_query, body) {
            return Err(Refusal::BadSignature(a.entity.clone()));
        }
        // The role before the replay guard: a request its signer may not make
        // takes no room in it.
        if !permits(claim.role, access) {
            return Err(Refusal::Forbidden {
                entity: a.entity.clone(),
                role: claim.role,
                needed: access,
            });
        }
        self.replay
            .check(&a.entity, claim.role, now_ms, a.time_ms, a.nonce)
            .map_err(|r| Refusal::Replay(a.entity.clone(), r))?;
        Ok(Credentials {
            entity: a.entity.clone(),
            generation: a.generation,
            key,
        })
    }
}

/// Who signed a verified request: what the ticket route needs (put in the
/// request's extensions by the API's middleware).
#[derive(Clone, Debug)]
pub struct Caller {
    /// The signer's credentials (its key signs the answer and seals tickets).
    pub creds: Credentials,
    /// Its role.
    pub role: Role,
}

impl Verifier {
    /// The OSDs' service key: derived from the `osd` key of the generation in
    /// `table` (so rotating `osd` changes it, and OSDs holding the shared `osd`
    /// key derive it themselves).
    fn service_key(&self, table: &AuthTable) -> Result<flame_common::auth::ServiceKey, String> {
        let osd = EntityName::osd();
        let generation = table
            .entities
            .get(&osd)
            .map(|r| r.generation)
            .ok_or("the entity table has no osd entity")?;
        Ok(flame_common::auth::ServiceKey::from_osd_key(
            &self.secret.derive_entity_key(&osd, generation),
            generation,
        ))
    }

    /// The service key sealed for `caller` (an OSD: the route needs role osd),
    /// so an OSD holding only its own `osd.N` key can check tickets.
    pub fn grant_service_key(
        &self,
        table: &AuthTable,
        caller: &Caller,
    ) -> Result<flame_common::mgr_api::ServiceKeyGrant, String> {
        let service = self.service_key(table)?;
        Ok(flame_common::mgr_api::ServiceKeyGrant {
            generation: service.generation(),
            sealed_key: hex::encode(service.seal_for(&caller.creds.key)?),
        })
    }

    /// A ticket for `caller` at `now_ms`, under the service key of the `osd` key
    /// generation in `table`, its session key sealed under the caller's key.
    pub fn issue_ticket(
        &self,
        table: &AuthTable,
        caller: &Caller,
        now_ms: u64,
    ) -> Result<flame_common::mgr_api::TicketGrant, String> {
        let service = self.service_key(table)?;
        let volumes = table
            .entities
            .get(&caller.creds.entity)
            .map(|r| r.volumes.clone())
            .ok_or("the caller is not in the entity table")?;
        let t = service.issue_for(
            &caller.creds.entity,
            caller.role,
            &volumes,
            now_ms,
            flame_common::auth::TICKET_LIFETIME_MS,
        );
        let sealed =
            flame_common::auth::seal_session_key(&caller.creds.key, &t.bytes, &t.session_key)?;
        Ok(flame_common::mgr_api::TicketGrant {
            ticket: hex::encode(&t.bytes),
            sealed_session_key: hex::encode(sealed),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret() -> SecretKey {
        SecretKey::from_hex(&"5a".repeat(32)).unwrap()
    }

    fn creds(name: &str, generation: KeyGeneration) -> Credentials {
        let entity = EntityName::parse(name).unwrap();
        Credentials {
            key: secret().derive_entity_key(&entity, generation),
            entity,
            generation,
        }
    }

    /// A ticket names its caller, role and volumes, is made with the service
    /// key of the table's `osd` generation, and its session key opens only with
    /// the caller's key.
    #[test]
    fn tickets_carry_the_callers_entity_role_and_volumes() {
        let mut table = AuthTable::default();
        let vm = EntityName::parse("client.vm").unwrap();
        let pats = VolumePatterns::parse_list("vm-*").unwrap();
        table.add(&vm, Role::Client, pats.clone()).unwrap();
        table.rotate(&EntityName::osd()).unwrap();
        let v = Verifier::new(secret());
        let caller = Caller {
            creds: creds("client.vm", 1),
            role: Role::Client,
        };
        const NOW: u64 = 1_900_000_000_000;
        let g = v.issue_ticket(&table, &caller, NOW).unwrap();
        let bytes = hex::decode(&g.ticket).unwrap();
        let osd_key = secret().derive_entity_key(&EntityName::osd(), 2);
        let service = flame_common::auth::ServiceKey::from_osd_key(&osd_key, 2);
        let (claims, key) = service.open(&bytes, NOW).unwrap();
        assert_eq!(claims.entity, vm);
        assert_eq!(claims.role, Role::Client);
        assert_eq!(claims.volumes, pats);
        assert_eq!(claims.service_generation, 2);
        let sealed = hex::decode(&g.sealed_session_key).unwrap();
        let opened =
            flame_common::auth::open_session_key(&caller.creds.key, &bytes, &sealed).unwrap();
        assert_eq!(opened.to_hex(), key.to_hex());
        assert!(
            flame_common::auth::open_session_key(&creds("client.admin", 1).key, &bytes, &sealed)
                .is_err()
        );
        // The old osd generation's service key does not open it.
        let old = flame_common::auth::ServiceKey::from_osd_key(
            &secret().derive_entity_key(&EntityName::osd(), 1),
            1,
        );
        assert!(old.open(&bytes, NOW).is_err());
        let stranger = Caller {
            creds: creds("client.nobody", 1),
            role: Role::Client,
        };
        assert!(v.issue_ticket(&table, &stranger, NOW).is_err());
    }

    fn header(c: &Credentials, method: &str, path: &str, body: &[u8], t: u64, n: u8) -> String {
        c.sign(method, path, body, t, Nonce([n; 16])).to_header()
    }

    #[test]
    fn routes_need_what_they_should() {
        use Access::*;
        for (m, r, want) in [
            ("GET", Some("/metrics"), Open),
            ("GET", Some("/v1/map"), Any),
            ("GET", Some("/v1/status"), Any),
            ("GET", Some("/v1/volumes/{name}"), Any),
            ("GET", Some("/v1/auth/entities"), Admin),
            ("GET", None, Any),
            ("POST", Some("/v1/osd/boot"), Osd),
            ("POST", Some("/v1/osd/heartbeat"), Osd),
            ("POST", Some("/v1/osd/failure"), Osd),
            ("POST", Some("/v1/pg/recovered"), Osd),
            ("POST", Some("/v1/auth/service-key"), OsdOnly),
            ("POST", Some("/v1/volumes"), Admin),
            ("DELETE", Some("/v1/volumes/{name}"), Admin),
            ("POST", Some("/v1/volumes/{name}/resize"), Admin),
            ("POST", Some("/v1/volumes/{name}/trim"), Admin),
            ("POST", Some("/v1/osds/{id}/out"), Admin),
            ("DELETE", Some("/v1/osds/{id}"), Admin),
            ("POST", Some("/v1/auth/entities"), Admin),
            ("PUT", Some("/v1/map"), Admin),
        ] {
            assert_eq!(required_access(m, r), want, "{m} {r:?}");
        }
        assert!(permits(Role::Client, Any) && !permits(Role::Client, Osd));
        assert!(permits(Role::Osd, Osd) && !permits(Role::Osd, Admin));
        assert!(permits(Role::Admin, Admin) && permits(Role::Admin, Osd));
    }

    /// One client key signing requests as fast as it can fills its own replay
    /// guard and is refused (429) alone: an OSD's heartbeat and an admin's
    /// request still pass, and forbidden requests take no room at all.
    #[test]
    fn a_flooding_client_key_cannot_shut_out_the_osds() {
        let mut table = AuthTable::default();
        let vm = EntityName::parse("client.vm").unwrap();
        table.add(&vm, Role::Client, VolumePatterns::all()).unwrap();
        table
            .add(
                &EntityName::parse("osd.1").unwrap(),
                Role::Osd,
                VolumePatterns::all(),
            )
            .unwrap();
        let mut v = Verifier::new(secret());
        let now = 1_000_000_000;
        let client = creds("client.vm", 1);
        let limit = replay_limits(Role::Client).entity_entries_max;
        let mut full_at = None;
        for i in 0..=limit as u64 {
            let sig = client.sign("GET", "/v1/map", b"", now, Nonce((i as u128).to_le_bytes()));
            let c = Verifier::claim(&table, Some(&sig.to_header())).unwrap();
            if let Err(e) = v.verify(&c, "GET", "/v1/map", b"", now, Access::Any) {
                assert_eq!(e.status(), 429, "{e}");
                full_at = Some(i);
                break;
            }
        }
        assert_eq!(
            full_at,
            Some(limit as u64),
            "its own guard is full at its bound"
        );
        // Forbidden requests are refused before the guard: no room taken.
        let held = v.replay.held(Role::Client);
        let sig = client.sign("POST", "/v1/volumes", b"{}", now, Nonce([0xfe; 16]));
        let c = Verifier::claim(&table, Some(&sig.to_header())).unwrap();
        assert!(matches!(
            v.verify(&c, "POST", "/v1/volumes", b"{}", now, Access::Admin),
            Err(Refusal::Forbidden { .. })
        ));
        assert_eq!(v.replay.held(Role::Client), held);
        // The OSD and the administrator are untouched.
        for (who, access) in [("osd.1", Access::Osd), ("client.admin", Access::Admin)] {
            let c = creds(who, 1);
            let sig = c.sign("POST", "/v1/osd/heartbeat", b"{}", now, Nonce([7; 16]));
            let claim = Verifier::claim(&table, Some(&sig.to_header())).unwrap();
            v.verify(&claim, "POST", "/v1/osd/heartbeat", b"{}", now, access)
                .unwrap_or_else(|e| panic!("{who}: {e}"));
        }
    }

    #[test]
    fn every_refusal() {
        let mut table = AuthTable::default();
        let vm = EntityName::parse("client.vm").unwrap();
        table.add(&vm, Role::Client, VolumePatterns::all()).unwrap();
        let mut v = Verifier::new(secret());
        let now = 1_000_000_000;
        let admin = creds("client.admin", 1);

        assert_eq!(Verifier::claim(&table, None).unwrap_err(), Refusal::Missing);
        assert!(matches!(
            Verifier::claim(&table, Some("Basic x")),
            Err(Refusal::Malformed(_))
        ));
        let stranger = creds("client.stranger", 1);
        let h = header(&stranger, "GET", "/v1/map", b"", now, 1);
        assert!(matches!(
            Verifier::claim(&table, Some(&h)),
            Err(Refusal::UnknownEntity(_))
        ));

        // A right signature, then its replay.
        let h = header(&admin, "POST", "/v1/volumes", b"{}", now, 2);
        let c = Verifier::claim(&table, Some(&h)).unwrap();
        let got = v
            .verify(&c, "POST", "/v1/volumes", b"{}", now, Access::Admin)
            .unwrap();
        assert_eq!(got.key.to_hex(), admin.key.to_hex());
        assert_eq!(
            v.verify(&c, "POST", "/v1/volumes", b"{}", now, Access::Admin)
                .unwrap_err()
                .reason(),
            "replayed"
        );
        // Altered body; wrong key (another cluster's secret).
        let h = header(&admin, "POST", "/v1/volumes", b"{}", now, 3);
        let c = Verifier::claim(&table, Some(&h)).unwrap();
        assert_eq!(
            v.verify(&c, "POST", "/v1/volumes", b"{\"a\":1}", now, Access::Admin)
                .unwrap_err(),
            Refusal::BadSignature(EntityName::admin())
        );
        let mut other = Verifier::new(SecretKey::from_hex(&"5b".repeat(32)).unwrap());
        assert_eq!(
            other
                .verify(&c, "POST", "/v1/volumes", b"{}", now, Access::Admin)
                .unwrap_err()
                .status(),
            401
        );
        // Clock skew.
        let h = header(&admin, "GET", "/v1/map", b"", now - 120_000, 4);
        let c = Verifier::claim(&table, Some(&h)).unwrap();
        let e = v
            .verify(&c, "GET", "/v1/map", b"", now, Access::Any)
            .unwrap_err();
        assert_eq!((e.reason(), e.status()), ("clock", 401));
        // A client may read, not write; the OSD may heartbeat, not delete.
        let cv = creds("client.vm", 1);
        let h = header(&cv, "GET", "/v1/map", b"", now, 5);
        let c = Verifier::claim(&table, Some(&h)).unwrap();
        assert!(
            v.verify(&c, "GET", "/v1/map", b"", now, Access::Any)
                .is_ok()
        );
        let h = header(&cv, "DELETE", "/v1/volumes/x", b"", now, 6);
        let c = Verifier::claim(&table, Some(&h)).unwrap();
        let e = v
            .verify(&c, "DELETE", "/v1/volumes/x", b"", now, Access::Admin)
            .unwrap_err();
        assert_eq!((e.status(), e.reason()), (403, "forbidden"));
        assert!(e.to_string().contains("client.vm") && e.to_string().contains("admin role"));
        let osd = creds("osd", 1);
        let h = header(&osd, "POST", "/v1/osd/heartbeat", b"{}", now, 7);
        let c = Verifier::claim(&table, Some(&h)).unwrap();
        assert!(
            v.verify(&c, "POST", "/v1/osd/heartbeat", b"{}", now, Access::Osd)
                .is_ok()
        );
        // Rotation: the old key is refused by name, the new one works.
        table.rotate(&vm).unwrap();
        let h = header(&cv, "GET", "/v1/map", b"", now, 8);
        let e = Verifier::claim(&table, Some(&h)).unwrap_err();
        assert!(
            matches!(
                e,
                Refusal::OldGeneration {
                    signed: 1,
                    current: 2,
                    ..
                }
            ),
            "{e}"
        );
        let h = header(&creds("client.vm", 2), "GET", "/v1/map", b"", now, 9);
        let c = Verifier::claim(&table, Some(&h)).unwrap();
        assert!(
            v.verify(&c, "GET", "/v1/map", b"", now, Access::Any)
                .is_ok()
        );
    }

    /// `osd.N` entities: only with role osd, every volume, removable; they act
    /// only as their own OSD, and get the service key sealed under their key.
    #[test]
    fn per_osd_entities_act_only_as_their_own_osd() {
        let mut t = AuthTable::default();
        let o3 = EntityName::parse("osd.3").unwrap();
        for role in [Role::Client, Role::Admin] {
            let e = t.add(&o3, role, VolumePatterns::all()).unwrap_err();
            assert!(e.contains("osd role"), "{e}");
        }
        let e = t
            .add(&o3, Role::Osd, VolumePatterns::parse_list("vm-*").unwrap())
            .unwrap_err();
        assert!(e.contains("every volume"), "{e}");
        assert!(
            t.add(&EntityName::osd(), Role::Osd, VolumePatterns::all())
                .is_err()
        );
        let too_big = EntityName::of_osd(OsdId(crate::state::OSD_ID_MAX));
        let e = t
            .add(&too_big, Role::Osd, VolumePatterns::all())
            .unwrap_err();
        assert!(e.contains("below"), "{e}");
        t.add(&o3, Role::Osd, VolumePatterns::all()).unwrap();
        t.check().unwrap();
        assert!(
            t.set_volumes(&o3, VolumePatterns::parse_list("x").unwrap())
                .is_err()
        );
        // A table where a client holds the osd role, or osd.N another, is refused.
        let mut bad = t.clone();
        bad.entities.get_mut(&o3).unwrap().role = Role::Admin;
        assert!(bad.check().is_err());

        assert_eq!(check_acts_for(Some(&o3), OsdId(3)), Ok(()));
        let e = check_acts_for(Some(&o3), OsdId(4)).unwrap_err();
        assert_eq!((e.status(), e.reason()), (403, "other_osd"));
        assert!(
            e.to_string().contains("osd.3") && e.to_string().contains("osd.4"),
            "{e}"
        );
        for anyone in [EntityName::osd(), EntityName::admin()] {
            assert_eq!(check_acts_for(Some(&anyone), OsdId(4)), Ok(()));
        }
        assert_eq!(check_acts_for(None, OsdId(4)), Ok(()));

        // The service key: only the osd role asks; it opens with the OSD's key.
        assert_eq!(
            required_access("POST", Some("/v1/auth/service-key")),
            Access::OsdOnly
        );
        assert!(permits(Role::Osd, Access::OsdOnly));
        assert!(!permits(Role::Admin, Access::OsdOnly) && !permits(Role::Client, Access::OsdOnly));
        let v = Verifier::new(secret());
        let caller = Caller {
            creds: creds("osd.3", 1),
            role: Role::Osd,
        };
        let g = v.grant_service_key(&t, &caller).unwrap();
        let sealed = hex::decode(&g.sealed_key).unwrap();
        let got =
            flame_common::auth::ServiceKey::open_sealed(&caller.creds.key, g.generation, &sealed)
                .unwrap();
        let ticket = v
            .issue_ticket(
                &t,
                &Caller {
                    creds: creds("client.admin", 1),
                    role: Role::Admin,
                },
                1_900_000_000_000,
            )
            .unwrap();
        let bytes = hex::decode(&ticket.ticket).unwrap();
        assert!(
            got.open(&bytes, 1_900_000_000_000).is_ok(),
            "the same key tickets are made with"
        );
        assert!(
            flame_common::auth::ServiceKey::open_sealed(
                &creds("osd.4", 1).key,
                g.generation,
                &sealed
            )
            .is_err()
        );
        assert_eq!(t.remove(&o3).unwrap().role, Role::Osd);
    }

    #[test]
    fn table_operations() {
        let mut t = AuthTable::default();
        t.check().unwrap();
        let x = EntityName::parse("client.x").unwrap();
        assert_eq!(
            t.add(&x, Role::Admin, VolumePatterns::all())
                .unwrap()
                .generation,
            1
        );
        assert!(
            t.add(&x, Role::Client, VolumePatterns::all())
                .unwrap_err()
                .contains("exists")
        );
        assert!(
            t.add(
                &EntityName::parse("client.y").unwrap(),
                Role::Osd,
                VolumePatterns::all()
            )
            .is_err()
        );
        assert!(
            t.add(&EntityName::osd(), Role::Client, VolumePatterns::all())
                .is_err()
        );
        assert_eq!(t.rotate(&x).unwrap().generation, 2);
        assert!(
            t.remove(&EntityName::admin())
                .unwrap_err()
                .contains("built in")
        );
        assert!(t.remove(&EntityName::osd()).is_err());
        assert_eq!(t.remove(&x).unwrap().role, Role::Admin);
        assert!(t.remove(&x).unwrap_err().contains("no entity"));
        assert!(t.rotate(&x).is_err());
        t.check().unwrap();
        let mut bad = t.clone();
        bad.entities.remove(&EntityName::admin());
        assert!(bad.check().is_err());
        let mut bad = t.clone();
        bad.entities.get_mut(&EntityName::osd()).unwrap().generation = 0;
        assert!(bad.check().is_err());
        let mut bad = t.clone();
        bad.entities.insert(
            EntityName::parse("client.z").unwrap(),
            EntityRecord {
                role: Role::Osd,
                generation: 1,
                volumes: VolumePatterns::all(),
            },
        );
        assert!(bad.check().is_err());
        // The persisted form.
        let text = serde_json::to_string(&AuthTable::default()).unwrap();
        assert_eq!(
            text,
            r#"{"client.admin":{"role":"admin","generation":1},"osd":{"role":"osd","generation":1}}"#
        );
    }
}
