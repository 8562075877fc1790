//! A small blocking client of the manager's HTTP/JSON API.
//!
//! The manager is off the data path, so a blocking client on plain threads (ureq) is
//! the simplest thing that works: the map watcher runs it on its own thread and
//! flame-admin runs it on its main thread. Every response body is read with a size
//! bound before parsing, and an error answer's [`ApiError`] text is passed through to
//! the user unchanged, because it is the manager that knows what was wrong.

use crate::error::ClientError;
use flame_common::auth::{Credentials, EntityName, Role, SessionTicket, VolumePatterns};
use flame_common::http::{Answer, CallError, MgrEndpoint};
use flame_common::ids::{OsdId, PgId};
use flame_common::map::{ClusterMap, VolumeInfo, validate_volume_name};
use flame_common::mgr_api::{
    ApiError, AuthEntityAdd, AuthEntityInfo, ClusterStatus, OsdOpReply, OsdReweight, OsdStatus,
    PgStatus, TicketGrant, TrimDone, VolumeCreate, VolumeResize, VolumeTrim,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::time::Duration;

/// Largest response body accepted. A map with thousands of OSDs and volumes is a
/// few MiB; anything larger is a wrong endpoint, not a map.
pub const RESPONSE_BYTES_MAX: u64 = 64 << 20;
/// Longest error text shown from a non-JSON error body.
const ERROR_TEXT_CHARS_MAX: usize = 500;
/// Bound on an ordinary (non-long-poll) call, connect included.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// A handle on one manager. Cheap to clone (the connection pool is shared).
/// Requests are signed when it has credentials ([`MgrClient::with_credentials`]),
/// and then only answers signed by the manager are believed.
#[derive(Clone, Debug)]
pub struct MgrClient {
    endpoint: MgrEndpoint,
}

impl MgrClient {
    /// A client of the manager at `addr` (`host:port` or `http://host:port`),
    /// over plain HTTP.
    pub fn new(addr: &str) -> Result<MgrClient, ClientError> {
        Self::new_from(addr, None, None)
    }

    /// Like [`MgrClient::new`], with connections leaving from local address
    /// `source` when given (the client's `bind_addr`), and over TLS verified
    /// against `trust` (the cluster CA) when given.
    pub fn new_from(
        addr: &str,
        source: Option<std::net::IpAddr>,
        trust: Option<&flame_common::tls::MgrTrust>,
    ) -> Result<MgrClient, ClientError> {
        let base = flame_common::http::mgr_base_url(addr, trust.is_some())
            .map_err(ClientError::InvalidArgument)?;
        let config = ureq::Agent::config_builder()
            // Error statuses carry an ApiError body we want to show.
            .http_status_as_error(false)
            .timeout_connect(Some(Duration::from_secs(3)));
        let agent = flame_common::http::agent(config, source, trust);
        Ok(MgrClient {
            endpoint: MgrEndpoint {
                agent,
                base,
                creds: None,
            },
        })
    }

    /// This client, signing every request with `creds` (from a keyring file:
    /// [`Credentials::load`]); `None` for a manager with `auth: none`.
    pub fn with_credentials(mut self, creds: Option<Credentials>) -> MgrClient {
        self.endpoint.creds = creds;
        self
    }

    /// The base URL, for messages.
    pub fn base(&self) -> &str {
        &self.endpoint.base
    }

    /// The current cluster map.
    pub fn map(&self) -> Result<ClusterMap, ClientError> {
        self.get("/v1/map", CALL_TIMEOUT)
    }

    /// A map of epoch `min_epoch` or newer, waiting up to `wait_ms` on the manager for
    /// one to appear. A manager without long-poll support answers at once with its
    /// current map, so callers must check the epoch they got.
    pub fn wait_map(&self, min_epoch: u64, wait_ms: u64) -> Result<ClusterMap, ClientError> {
        let path = format!("/v1/map?min_epoch={min_epoch}&wait_ms={wait_ms}");
        self.get(&path, CALL_TIMEOUT + Duration::from_millis(wait_ms))
    }

    /// Cluster health and totals.
    pub fn status(&self) -> Result<ClusterStatus, ClientError> {
        self.get("/v1/status", CALL_TIMEOUT)
    }

    /// Every OSD with its usage.
    pub fn osds(&self) -> Result<Vec<OsdStatus>, ClientError> {
        self.get("/v1/osds", CALL_TIMEOUT)
    }

    /// Every placement group's state and roles.
    pub fn pgs(&self) -> Result<Vec<PgStatus>, ClientError> {
        self.get("/v1/pgs", CALL_TIMEOUT)
    }

    /// One placement group's state and roles.
    pub fn pg(&self, pg: PgId) -> Result<PgStatus, ClientError> {
        self.get(&format!("/v1/pgs/{}", pg.0), CALL_TIMEOUT)
    }

    /// Every volume.
    pub fn volumes(&self) -> Result<Vec<VolumeInfo>, ClientError> {
        self.get("/v1/volumes", CALL_TIMEOUT)
    }

    /// One volume by name.
    pub fn volume(&self, name: &str) -> Result<VolumeInfo, ClientError> {
        check_name(name)?;
        self.get(&format!("/v1/volumes/{name}"), CALL_TIMEOUT)
    }

    /// Creates a volume of `size` bytes.
    pub fn create_volume(&self, name: &str, size: u64) -> Result<VolumeInfo, ClientError> {
        check_name(name)?;
        let body = VolumeCreate {
            name: name.to_string(),
            size,
        };
        self.post("/v1/volumes", &body)
    }

    /// The pending trim of a shrunk volume, if any (see [`crate::resize`]).
    pub fn volume_trim(&self, name: &str) -> Result<VolumeTrim, ClientError> {
        check_name(name)?;
        self.get(&format!("/v1/volumes/{name}/trim"), CALL_TIMEOUT)
    }

    /// Reports a trim done on every copy; answers what is still pending.
    pub fn trim_done(&self, name: &str, done: &TrimDone) -> Result<VolumeTrim, ClientError> {
        check_name(name)?;
        self.post(&format!("/v1/volumes/{name}/trim"), done)
    }

    /// Resizes a volume in the map only; shrinking needs `allow_shrink`. A shrink
    /// leaves a pending trim that [`crate::resize::resize_volume`] (which callers
    /// should use instead) completes.
    pub fn resize_volume(
        &self,
        name: &str,
        size: u64,
        allow_shrink: bool,
    ) -> Result<VolumeInfo, ClientError> {
        check_name(name)?;
        let body = VolumeResize { size, allow_shrink };
        self.post(&format!("/v1/volumes/{name}/resize"), &body)
    }

    /// Removes a volume from the map, which keeps a tombstone of its id: every
    /// OSD deletes the volume's objects when it sees it, and accepts a
    /// [`crate::Cluster::delete_volume_objects`] for it only from then on.
    pub fn remove_volume(&self, name: &str) -> Result<VolumeInfo, ClientError> {
        check_name(name)?;
        self.delete(&format!("/v1/volumes/{name}"))
    }

    /// Takes an OSD out of placement (`out == true`) or puts it back in. Its
    /// placement groups move and are recovered; the old copies serve meanwhile.
    pub fn osd_set_in(&self, id: OsdId, r#in: bool) -> Result<OsdOpReply, ClientError> {
        let what = if r#in { "in" } else { "out" };
        self.post(&format!("/v1/osds/{}/{what}", id.0), &())
    }

    /// Sets an OSD's placement weight (`0..=100`).
    pub fn osd_reweight(&self, id: OsdId, weight: f64) -> Result<OsdOpReply, ClientError> {
        self.post(
            &format!("/v1/osds/{}/reweight", id.0),
            &OsdReweight { weight },
        )
    }

    /// Removes a down OSD from the cluster. The reply lists the placement groups
    /// whose last complete copy it held (their data is lost).
    pub fn osd_rm(&self, id: OsdId) -> Result<OsdOpReply, ClientError> {
        self.delete(&format!("/v1/osds/{}", id.0))
    }

    /// Every entity with its role and key generation (admin only).
    pub fn auth_entities(&self) -> Result<Vec<AuthEntityInfo>, ClientError> {
        self.get("/v1/auth/entities", CALL_TIMEOUT)
    }

    /// Adds an entity (admin only). Its key is derived where the cluster keyring
    /// is: nothing secret comes back.
    pub fn auth_add(
        &self,
        entity: &EntityName,
        role: Role,
        volumes: VolumePatterns,
    ) -> Result<AuthEntityInfo, ClientError> {
        let body = AuthEntityAdd {
            entity: entity.clone(),
            role,
            volumes,
        };
        self.post("/v1/auth/entities", &body)
    }

    /// Sets the volumes an entity may read and write (from its next ticket).
    pub fn auth_set_volumes(
        &self,
        entity: &EntityName,
        volumes: VolumePatterns,
    ) -> Result<AuthEntityInfo, ClientError> {
        self.post(
            &format!("/v1/auth/entities/{entity}/volumes"),
            &flame_common::mgr_api::AuthEntityVolumes { volumes },
        )
    }

    /// Moves an entity to its next key generation: its old key stops working.
    pub fn auth_rotate(&self, entity: &EntityName) -> Result<AuthEntityInfo, ClientError> {
        self.post(&format!("/v1/auth/entities/{entity}/rotate"), &())
    }

    /// Removes an entity: its key stops working.
    pub fn auth_remove(&self, entity: &EntityName) -> Result<AuthEntityInfo, ClientError> {
        self.delete(&format!("/v1/auth/entities/{entity}"))
    }

    /// A ticket for this client's entity, to open OSD connections with; `None`
    /// without credentials or when the manager runs with `auth: none` (its OSDs
    /// then take connections without tickets).
    pub fn ticket(&self) -> Result<Option<SessionTicket>, ClientError> {
        let Some(creds) = &self.endpoint.creds else {
            return Ok(None);
        };
        let path = "/v1/auth/ticket";
        let answer =
            self.endpoint
                .call("POST", path, Some(b"{}"), CALL_TIMEOUT, RESPONSE_BYTES_MAX);
        if matches!(&answer, Ok(a) if a.status == 409) {
            return Ok(None);
        }
        let grant: TicketGrant = self.finish(path, answer)?;
        let bad = |message: String| ClientError::Mgr {
            url: self.url(path),
            message,
        };
        let bytes =
            hex::decode(&grant.ticket).map_err(|e| bad(format!("ticket is not hex: {e}")))?;
        let sealed = hex::decode(&grant.sealed_session_key)
            .map_err(|e| bad(format!("sealed key is not hex: {e}")))?;
        let session_key =
            flame_common::auth::open_session_key(&creds.key, &bytes, &sealed).map_err(bad)?;
        let claims = flame_common::auth::decode_claims(&bytes).map_err(|e| bad(e.to_string()))?;
        if claims.entity != creds.entity {
            return Err(bad(format!(
                "the manager issued a ticket for {}, not {}",
                claims.entity, creds.entity
            )));
        }
        Ok(Some(SessionTicket {
            bytes,
            session_key,
            claims,
        }))
    }

    /// `DELETE path`, with the call timeout, decoding the JSON reply.
    fn delete<R: serde::de::DeserializeOwned>(&self, path: &str) -> Result<R, ClientError> {
        let answer = self
            .endpoint
            .call("DELETE", path, None, CALL_TIMEOUT, RESPONSE_BYTES_MAX);
        self.finish(path, answer)
    }

    fn get<T: DeserializeOwned>(&self, path: &str, timeout: Duration) -> Result<T, ClientError> {
        let answer = self
            .endpoint
            .call("GET", path, None, timeout, RESPONSE_BYTES_MAX);
        self.finish(path, answer)
    }

    fn post<B: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<T, ClientError> {
        let bytes = serde_json::to_vec(body).map_err(|e| ClientError::Mgr {
            url: self.url(path),
            message: format!("cannot encode the request: {e}"),
        })?;
        let answer =
            self.endpoint
                .call("POST", path, Some(&bytes), CALL_TIMEOUT, RESPONSE_BYTES_MAX);
        self.finish(path, answer)
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.endpoint.base, path)
    }

    /// Reads a bounded body and turns it into `T` or the manager's error.
    fn finish<T: DeserializeOwned>(
        &self,
        path: &str,
        answer: Result<Answer, CallError>,
    ) -> Result<T, ClientError> {
        let mgr_err = |message: String| ClientError::Mgr {
            url: self.url(path),
            message,
        };
        let Answer {
            status,
            body: bytes,
            ..
        } = answer.map_err(|e| {
            mgr_err(match e {
                CallError::Transport(e) => describe_ureq(&e),
                CallError::Body(e) => format!("reading the answer: {}", describe_ureq(&e)),
                other => other.to_string(),
            })
        })?;
        if !(200..300).contains(&status) {
            let message = match serde_json::from_slice::<ApiError>(&bytes) {
                Ok(api) => api.error,
                Err(_) => {
                    let text = String::from_utf8_lossy(&bytes);
                    let text: String = text.trim().chars().take(ERROR_TEXT_CHARS_MAX).collect();
                    if text.is_empty() {
                        "no explanation given".into()
                    } else {
                        text
                    }
                }
            };
            return Err(ClientError::Api { status, message });
        }
        serde_json::from_slice(&bytes)
            .map_err(|e| mgr_err(format!("unexpected answer (is this a Flame manager?): {e}")))
    }
}

fn check_name(name: &str) -> Result<(), ClientError> {
    validate_volume_name(name)
        .map_err(|e| ClientError::InvalidArgument(format!("volume `{name}`: {e}")))?;
    // `.` and `..` pass the alphabet check but would be path segments in the URL.
    if name.chars().all(|c| c == '.') {
        return Err(ClientError::InvalidArgument(format!(
            "volume `{name}`: not a valid name"
        )));
    }
    Ok(())
}

/// A user-facing description of a transport-level failure.
fn describe_ureq(e: &ureq::Error) -> String {
    match e {
        ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
            "connection refused (is flame-mgr running there?)".into()
        }
        ureq::Error::Timeout(t) => format!("timed out ({t})"),
        ureq::Error::HostNotFound => "host not found".into(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls() {
        use flame_common::http::mgr_base_url;
        assert_eq!(
            mgr_base_url("127.0.0.1:6800", false).unwrap(),
            "http://127.0.0.1:6800"
        );
        assert_eq!(
            mgr_base_url("http://mgr:6800/", false).unwrap(),
            "http://mgr:6800"
        );
        assert_eq!(
            mgr_base_url("127.0.0.1:6800", true).unwrap(),
            "https://127.0.0.1:6800"
        );
        assert_eq!(
            mgr_base_url("https://mgr:6800", true).unwrap(),
            "https://mgr:6800"
        );
        assert!(mgr_base_url("", false).is_err());
        let e = mgr_base_url("https://x:1", false).unwrap_err();
        assert!(e.contains("CA"), "{e}");
        let e = mgr_base_url("http://x:1", true).unwrap_err();
        assert!(e.contains("serves TLS"), "{e}");
        assert!(mgr_base_url("ftp://x:1", false).is_err());
        assert!(mgr_base_url("http://x:1/v1", false).is_err());
    }

    #[test]
    fn names_are_checked_before_they_reach_a_url() {
        assert!(check_name("demo-1").is_ok());
        assert!(check_name("..").is_err());
        assert!(check_name("a/b").is_err());
        assert!(check_name("").is_err());
    }

    #[test]
    fn unreachable_manager_is_a_clear_error() {
        // A port nobody listens on.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let c = MgrClient::new(&port.to_string()).unwrap();
        let e = c.status().unwrap_err().to_string();
        assert!(e.contains("refused") || e.contains("connect"), "{e}");
    }
}
