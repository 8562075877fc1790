//! The HTTP/JSON API (routes and bodies defined in `flame_common::mgr_api`).
//!
//! Handlers are thin: parse, call [`Shared::commit`] or read a snapshot, encode.
//! Every failure is an [`ApiError`] JSON body with a 4xx/5xx status, including
//! malformed bodies, unknown routes and wrong methods, so clients have one error
//! shape to handle.

use crate::shared::{MgrError, Shared};
use crate::state::{ClusterState, StateError};
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, FromRequest, MatchedPath, Path, Query, Request, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use flame_common::auth::EntityName;
use flame_common::ids::{Epoch, OsdId};
use flame_common::mgr_api::{
    ApiError, AuthEntityAdd, AuthEntityInfo, HeartbeatReply, OsdBoot, OsdBootReply,
    OsdFailureReply, OsdFailureReport, OsdHeartbeat, OsdOpReply, OsdReweight, PgRecoveredReply,
    PgRecoveredReport, TrimDone, VolumeCreate, VolumeResize,
};
use serde::Serialize;
use serde::de::DeserializeOwned;
use std::sync::Arc;
use std::time::Duration;
use tracing::{error, info, warn};

/// Largest request body accepted, on every route and from every caller (the
/// signature covers the body, so a caller without a key is found out only once
/// its body is read). Most API bodies are under 1 KiB; the largest, a
/// `POST /v1/pg/recovered` of `PG_RECOVERED_ENTRIES_MAX` entries, is under
/// 50 KiB.
pub const BODY_BYTES_MAX: usize = 64 << 10;
/// Log lines of refused requests (authentication, authorisation, replay): at
/// most 20 per 10 s; the rest are counted in `flame_mgr_auth_refusals_total`
/// and the next line says how many were left out.
static REFUSAL_LINES: flame_common::logging::LineBudget =
    flame_common::logging::LineBudget::new(Duration::from_secs(10), 20);
/// Longest a `GET /v1/map` long-poll may wait, whatever `wait_ms` asks for, so a
/// client (and a proxy between) never sees a request hang indefinitely.
pub const MAP_WAIT_MS_MAX: u64 = 30_000;

/// An error reply: status plus [`ApiError`] body.
#[derive(Debug)]
pub struct HttpError {
    status: StatusCode,
    message: String,
}

impl HttpError {
    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        HttpError {
            status,
            message: message.into(),
        }
    }
}

impl From<MgrError> for HttpError {
    fn from(e: MgrError) -> Self {
        let status = match &e {
            MgrError::State(StateError::Invalid(_)) => StatusCode::BAD_REQUEST,
            MgrError::State(StateError::NotFound(_)) => StatusCode::NOT_FOUND,
            MgrError::State(StateError::Conflict(_)) => StatusCode::CONFLICT,
            MgrError::Store(_) | MgrError::Internal(_) => {
                error!("{e}");
                StatusCode::INTERNAL_SERVER_ERROR
            }
        };
        HttpError::new(status, e.to_string())
    }
}

impl From<StateError> for HttpError {
    fn from(e: StateError) -> Self {
        MgrError::State(e).into()
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        json_response(
            self.status,
            &ApiError {
                error: self.message,
            },
        )
    }
}

/// Encodes `body` as a JSON response.
fn json_response<T: Serialize + ?Sized>(status: StatusCode, body: &T) -> Response {
    match serde_json::to_vec(body) {
        Ok(bytes) => (
            status,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            bytes,
        )
            .into_response(),
        // Our own types always serialize; answer rather than panic if one day not.
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("{{\"error\":\"cannot encode reply: {e}\"}}"),
        )
            .into_response(),
    }
}

fn ok_json<T: Serialize + ?Sized>(body: &T) -> Response {
    json_response(StatusCode::OK, body)
}

/// A JSON request body. Unlike axum's `Json`, it ignores the Content-Type (curl
/// users forget it) and turns every failure into an [`ApiError`] 400 (or 413 for
/// an oversized body) that says what was wrong.
pub struct ApiJson<T>(pub T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequest<S> for ApiJson<T> {
    type Rejection = HttpError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state)
            .await
            .map_err(|r| HttpError::new(r.status(), r.body_text()))?;
        serde_json::from_slice(&bytes).map(ApiJson).map_err(|e| {
            HttpError::new(
                StatusCode::BAD_REQUEST,
                format!("invalid JSON request body: {e}"),
            )
        })
    }
}

fn path_name(p: Result<Path<String>, PathRejection>) -> Result<String, HttpError> {
    p.map(|Path(name)| name)
        .map_err(|r| HttpError::new(StatusCode::BAD_REQUEST, r.body_text()))
}

/// An OSD id in a path: `3` or `osd.3`.
pub fn parse_osd_id(text: &str) -> Option<OsdId> {
    let digits = text.strip_prefix("osd.").unwrap_or(text);
    if digits.is_empty() || digits.len() > 10 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok().map(OsdId)
}

fn path_osd(p: Result<Path<String>, PathRejection>) -> Result<OsdId, HttpError> {
    let text = path_name(p)?;
    parse_osd_id(&text).ok_or_else(|| {
        let shown: String = text.chars().take(32).collect();
        HttpError::new(
            StatusCode::BAD_REQUEST,
            format!("`{shown}` is not an OSD id (expected e.g. 3 or osd.3)"),
        )
    })
}

/// Builds the router with every route of `flame_common::mgr_api`.
pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/v1/map", get(get_map))
        .route("/v1/status", get(get_status))
        .route("/v1/osds", get(get_osds))
        .route("/v1/osd/boot", post(osd_boot))
        .route("/v1/osd/heartbeat", post(osd_heartbeat))
        .route("/v1/osd/failure", post(osd_failure))
        .route("/v1/pg/recovered", post(pg_recovered))
        .route("/v1/osds/{id}", axum::routing::delete(osd_rm))
        .route("/v1/osds/{id}/out", post(osd_out))
        .route("/v1/osds/{id}/in", post(osd_in))
        .route("/v1/osds/{id}/reweight", post(osd_reweight))
        .route("/v1/volumes", get(list_volumes).post(create_volume))
        .route("/v1/volumes/{name}", get(get_volume).delete(delete_volume))
        .route("/v1/volumes/{name}/resize", post(resize_volume))
        .route(
            "/v1/volumes/{name}/trim",
            get(get_volume_trim).post(volume_trim_done),
        )
        .route("/v1/pgs", get(get_pgs))
        .route("/v1/pgs/{id}", get(get_pg))
        .route("/v1/auth/entities", get(list_entities).post(add_entity))
        .route("/v1/auth/ticket", post(issue_ticket))
        .route("/v1/auth/service-key", post(grant_service_key))
        .route("/v1/auth/entities/{name}/rotate", post(rotate_entity))
        .route("/v1/auth/entities/{name}/volumes", post(set_entity_volumes))
        .route(
            "/v1/auth/entities/{name}",
            axum::routing::delete(remove_entity),
        )
        .route("/metrics", get(get_metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        // Added after the routes, so they run after routing and see MatchedPath;
        // `track` (added last, outermost) also counts refused requests.
        .layer(middleware::from_fn_with_state(
            Arc::clone(&shared),
            authenticate,
        ))
        .layer(middleware::from_fn_with_state(Arc::clone(&shared), track))
        .layer(DefaultBodyLimit::max(BODY_BYTES_MAX))
        .with_state(shared)
}

/// Counts and times every request by route template (never by raw path or
/// arbitrary method, which would let clients create unbounded label values).
async fn track(State(shared): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let route = match req.extensions().get::<MatchedPath>() {
        Some(path) => {
            let method = match *req.method() {
                Method::GET => "GET",
                Method::POST => "POST",
                Method::DELETE => "DELETE",
                Method::PUT => "PUT",
                Method::HEAD => "HEAD",
                _ => "OTHER",
            };
            format!("{method} {}", path.as_str())
        }
        None => "unmatched".to_string(),
    };
    let start = flame_common::clock::Stopwatch::start();
    let resp = next.run(req).await;
    let m = &shared.metrics;
    m.api_latency
        .with_label_values(&[route.as_str()])
        .observe(start.elapsed().as_secs_f64());
    m.api_requests
        .with_label_values(&[route.as_str(), resp.status().as_str()])
        .inc();
    resp
}

/// Largest answer the manager signs (it buffers the body to sign it): well above
/// any map of [`crate::state::OSD_COUNT_MAX`] OSDs and
/// [`crate::state::VOLUME_COUNT_MAX`] volumes.
const SIGNED_ANSWER_BYTES_MAX: usize = 256 << 20;

/// Checks the request's signature and role ([`crate::auth`]) before the handler
/// runs, and signs the answer with the caller's key. With `auth: none` it passes
/// everything through. The header is checked before the body is read, so an
/// unauthenticated caller never makes the manager buffer a body.
async fn authenticate(State(shared): State<Arc<Shared>>, req: Request, next: Next) -> Response {
    let Some(verifier) = &shared.verifier else {
        return next.run(req).await;
    };
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string());
    let method = req.method().as_str().to_string();
    let access = crate::auth::required_access(&method, route.as_deref());
    if access == crate::auth::Access::Open {
        return next.run(req).await;
    }
    let refuse = |r: crate::auth::Refusal| -> Response {
        shared
            .metrics
            .auth_refusals
            .with_label_values(&[r.reason()])
            .inc();
        // Anyone can cause these: a bounded number of lines (the metric counts
        // every one).
        if let Some(left_out) = REFUSAL_LINES.admit(flame_common::clock::now()) {
            info!(
                left_out,
                "refused {method} {}: {r}",
                route.as_deref().unwrap_or("(no route)")
            );
        }
        let status = StatusCode::from_u16(r.status()).unwrap_or(StatusCode::UNAUTHORIZED);
        HttpError::new(status, r.to_string()).into_response()
    };
    let header = match req.headers().get(header::AUTHORIZATION).map(|v| v.to_str()) {
        None => None,
        Some(Ok(v)) => Some(v),
        Some(Err(_)) => {
            return refuse(crate::auth::Refusal::Malformed(
                "Authorization header is not ASCII".into(),
            ));
        }
    };
    let claim = match crate::auth::Verifier::claim(&shared.auth_table(), header) {
        Ok(c) => c,
        Err(r) => return refuse(r),
    };
    let (parts, body) = req.into_parts();
    let limit = BODY_BYTES_MAX;
    // Within the header timeout again: a caller that names a known entity and
    // then trickles its body holds its connection no longer than one that
    // trickles its headers.
    let read = tokio::time::timeout(shared.body_read_timeout, axum::body::to_bytes(body, limit));
    let body = match read.await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => {
            return HttpError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("request body over the limit of {limit} bytes, or unreadable: {e}"),
            )
            .into_response();
        }
        Err(_) => {
            return HttpError::new(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "request body not sent within {} ms",
                    shared.body_read_timeout.as_millis()
                ),
            )
            .into_response();
        }
    };
    let path_and_query = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let now_ms = flame_common::clock::unix_ms();
    let verified = verifier
        .lock()
        .verify(&claim, &method, path_and_query, &body, now_ms, access);
    let creds = match verified {
        Ok(c) => c,
        Err(r) => return refuse(r),
    };
    let mut req = Request::from_parts(parts, axum::body::Body::from(body));
    req.extensions_mut().insert(crate::auth::Caller {
        creds: creds.clone(),
        role: claim.role(),
    });
    let resp = next.run(req).await;
    let (mut parts, body) = resp.into_parts();
    let body = match axum::body::to_bytes(body, SIGNED_ANSWER_BYTES_MAX).await {
        Ok(b) => b,
        Err(e) => {
            error!("cannot sign an answer: {e}");
            return HttpError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "answer too large to sign",
            )
            .into_response();
        }
    };
    let sig = flame_common::auth::response_signature(
        &creds.key,
        claim.nonce(),
        parts.status.as_u16(),
        &body,
    );
    if let Ok(v) = HeaderValue::from_str(&sig) {
        parts
            .headers
            .insert(flame_common::auth::SIGNATURE_HEADER, v);
    }
    Response::from_parts(parts, axum::body::Body::from(body))
}

/// The verifier and the verified signer of a request to an auth route; 409
/// with `auth: none`, where there is neither (`what` says what is missing).
fn verified_caller<'a>(
    shared: &'a Shared,
    caller: Option<axum::Extension<crate::auth::Caller>>,
    what: &str,
) -> Result<
    (
        &'a parking_lot::Mutex<crate::auth::Verifier>,
        crate::auth::Caller,
    ),
    HttpError,
> {
    match (&shared.verifier, caller) {
        (Some(verifier), Some(axum::Extension(caller))) => Ok((verifier, caller)),
        _ => Err(HttpError::new(
            StatusCode::CONFLICT,
            format!("authentication is off on this cluster (auth: none): {what}"),
        )),
    }
}

/// The OSDs' service key, sealed for the signing OSD.
async fn grant_service_key(
    State(shared): State<Arc<Shared>>,
    caller: Option<axum::Extension<crate::auth::Caller>>,
) -> Result<Response, HttpError> {
    let (verifier, caller) = verified_caller(&shared, caller, "there is no service key")?;
    let grant = verifier
        .lock()
        .grant_service_key(&shared.auth_table(), &caller)
        .map_err(|e| HttpError::new(StatusCode::INTERNAL_SERVER_ERROR, e))?;
    Ok(ok_json(&grant))
}

/// Refuses (403, counted) a request on an OSD route whose signer may not act as
/// OSD `osd` ([`crate::auth::check_acts_for`]).
fn check_acts_for(
    shared: &Shared,
    caller: Option<&axum::Extension<crate::auth::Caller>>,
    osd: OsdId,
) -> Result<(), HttpError> {
    crate::auth::check_acts_for(caller.map(|c| &c.creds.entity), osd).map_err(|r| {
        shared
            .metrics
            .auth_refusals
            .with_label_values(&[r.reason()])
            .inc();
        info!("refused an OSD request: {r}");
        HttpError::new(StatusCode::FORBIDDEN, r.to_string())
    })
}

/// A ticket for the signer, to open OSD connections with.
async fn issue_ticket(
    State(shared): State<Arc<Shared>>,
    caller: Option<axum::Extension<crate::auth::Caller>>,
) -> Result<Response, HttpError> {
    let (verifier, caller) =
        verified_caller(&shared, caller, "OSDs take connections without tickets")?;
    let now_ms = flame_common::clock::unix_ms();
    let grant = verifier
        .lock()
        .issue_ticket(&shared.auth_table(), &caller, now_ms)
        .map_err(|e| HttpError::new(StatusCode::INTERNAL_SERVER_ERROR, e))?;
    Ok(ok_json(&grant))
}

fn path_entity(p: Result<Path<String>, PathRejection>) -> Result<EntityName, HttpError> {
    let text = path_name(p)?;
    EntityName::parse(&text).map_err(|e| HttpError::new(StatusCode::BAD_REQUEST, e))
}

fn entity_info(entity: EntityName, rec: crate::auth::EntityRecord) -> AuthEntityInfo {
    AuthEntityInfo {
        entity,
        role: rec.role,
        generation: rec.generation,
        volumes: rec.volumes,
    }
}

async fn list_entities(State(shared): State<Arc<Shared>>) -> Response {
    let table = shared.auth_table();
    let list: Vec<AuthEntityInfo> = table
        .entities
        .iter()
        .map(|(n, r)| entity_info(n.clone(), r.clone()))
        .collect();
    ok_json(&list)
}

async fn add_entity(
    State(shared): State<Arc<Shared>>,
    ApiJson(req): ApiJson<AuthEntityAdd>,
) -> Result<Response, HttpError> {
    let name = req.entity.clone();
    let (rec, epoch) = shared
        .commit_admin(move |s, _| Ok((s.auth_add(&req.entity, req.role, req.volumes)?, s.epoch())))
        .await?;
    info!(
        "entity {name} added, role {} (map {epoch})",
        rec.role.as_str()
    );
    Ok(ok_json(&entity_info(name, rec)))
}

async fn rotate_entity(
    State(shared): State<Arc<Shared>>,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, HttpError> {
    change_entity(
        shared,
        path_entity(name)?,
        "key rotated",
        ClusterState::auth_rotate,
    )
    .await
}

async fn set_entity_volumes(
    State(shared): State<Arc<Shared>>,
    name: Result<Path<String>, PathRejection>,
    ApiJson(req): ApiJson<flame_common::mgr_api::AuthEntityVolumes>,
) -> Result<Response, HttpError> {
    let name = path_entity(name)?;
    let n = name.clone();
    let (rec, epoch) = shared
        .commit_admin(move |s, _| Ok((s.auth_set_volumes(&n, req.volumes)?, s.epoch())))
        .await?;
    info!(
        "entity {name} may use volumes {} (map {epoch})",
        rec.volumes
    );
    Ok(ok_json(&entity_info(name, rec)))
}

async fn remove_entity(
    State(shared): State<Arc<Shared>>,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, HttpError> {
    change_entity(
        shared,
        path_entity(name)?,
        "removed",
        ClusterState::auth_remove,
    )
    .await
}

/// Commits `op` on entity `name` and answers with its record.
async fn change_entity(
    shared: Arc<Shared>,
    name: EntityName,
    what: &'static str,
    op: fn(&mut ClusterState, &EntityName) -> Result<crate::auth::EntityRecord, StateError>,
) -> Result<Response, HttpError> {
    let n = name.clone();
    let (rec, epoch) = shared
        .commit_admin(move |s, _| Ok((op(s, &n)?, s.epoch())))
        .await?;
    info!(
        "entity {name} {what}: generation {} (map {epoch})",
        rec.generation
    );
    Ok(ok_json(&entity_info(name, rec)))
}

async fn not_found(method: Method, uri: axum::http::Uri) -> HttpError {
    // Echo at most a bounded prefix of what the client sent.
    let path: String = uri.path().chars().take(128).collect();
    HttpError::new(
        StatusCode::NOT_FOUND,
        format!("no route {method} {path}; see flame_common::mgr_api"),
    )
}

async fn method_not_allowed(method: Method) -> HttpError {
    HttpError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("method {method} is not allowed on this path"),
    )
}

/// Query of `GET /v1/map`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct MapQuery {
    /// Epoch the caller wants to see.
    min_epoch: Option<u64>,
    /// How long to wait for it, capped at [`MAP_WAIT_MS_MAX`].
    wait_ms: Option<u64>,
}

async fn get_map(
    State(shared): State<Arc<Shared>>,
    query: Result<Query<MapQuery>, QueryRejection>,
) -> Result<Response, HttpError> {
    let Query(q) = query.map_err(|r| HttpError::new(StatusCode::BAD_REQUEST, r.body_text()))?;
    let map = match q.min_epoch {
        Some(min) => {
            let wait_ms = q.wait_ms.unwrap_or(0).min(MAP_WAIT_MS_MAX);
            shared
                .wait_map(Epoch(min), Duration::from_millis(wait_ms))
                .await
        }
        None => shared.map(),
    };
    Ok(ok_json(&*map))
}

async fn get_status(State(shared): State<Arc<Shared>>) -> Result<Response, HttpError> {
    let (state, pgs) = shared.snapshot().await?;
    Ok(ok_json(&state.status(&pgs, flame_common::clock::now())))
}

async fn get_pgs(State(shared): State<Arc<Shared>>) -> Result<Response, HttpError> {
    let (state, pgs) = shared.snapshot().await?;
    Ok(ok_json(&crate::pg_status::pg_statuses(&pgs, state.map())))
}

async fn get_pg(
    State(shared): State<Arc<Shared>>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, HttpError> {
    let text = path_name(id)?;
    // `12` or `pg.12`, as flame-admin prints them.
    let digits = text.strip_prefix("pg.").unwrap_or(&text);
    let pg = digits.parse::<u32>().map_err(|_| {
        let shown: String = text.chars().take(32).collect();
        HttpError::new(
            StatusCode::BAD_REQUEST,
            format!("`{shown}` is not a placement group number"),
        )
    })?;
    let (state, pgs) = shared.snapshot().await?;
    let entry = crate::pg_status::pg_status(&pgs, state.map(), flame_common::ids::PgId(pg))
        .ok_or_else(|| {
            StateError::NotFound(format!(
                "no placement group {pg}: the pool has {} (0..={})",
                pgs.pg_count(),
                pgs.pg_count().saturating_sub(1)
            ))
        })?;
    Ok(ok_json(&entry))
}

async fn get_osds(State(shared): State<Arc<Shared>>) -> Result<Response, HttpError> {
    let (state, pgs) = shared.snapshot().await?;
    Ok(ok_json(
        &state.osd_statuses(&pgs, flame_common::clock::now()),
    ))
}

async fn osd_boot(
    State(shared): State<Arc<Shared>>,
    caller: Option<axum::Extension<crate::auth::Caller>>,
    ApiJson(req): ApiJson<OsdBoot>,
) -> Result<Response, HttpError> {
    let key_of = caller.as_ref().and_then(|c| c.creds.entity.osd_id());
    if let Some(asked) = req.id {
        // A data directory that recorded another id than the key's.
        check_acts_for(&shared, caller.as_ref(), asked)?;
    }
    let (id, fsid, epoch, timings) = shared
        .commit(move |s, now| {
            let id = s.boot_as(&req, key_of, now)?;
            Ok((id, s.map().fsid.clone(), s.epoch(), s.timings()))
        })
        .await?;
    info!("{id} booted (map {epoch})");
    Ok(ok_json(&OsdBootReply {
        id,
        fsid,
        epoch,
        timings: Some(timings),
    }))
}

async fn osd_heartbeat(
    State(shared): State<Arc<Shared>>,
    caller: Option<axum::Extension<crate::auth::Caller>>,
    ApiJson(hb): ApiJson<OsdHeartbeat>,
) -> Result<Response, HttpError> {
    check_acts_for(&shared, caller.as_ref(), hb.id)?;
    let shared_key = caller
        .as_ref()
        .is_some_and(|c| c.creds.entity == flame_common::auth::EntityName::osd());
    let epoch = shared
        .commit(move |s, now| {
            s.heartbeat(&hb, now)?;
            s.note_osd_key(hb.id, shared_key);
            Ok(s.epoch())
        })
        .await?;
    let service_generation = shared.verifier.as_ref().and_then(|_| {
        shared
            .auth_table()
            .entities
            .get(&flame_common::auth::EntityName::osd())
            .map(|r| r.generation)
    });
    Ok(ok_json(&HeartbeatReply {
        epoch,
        service_generation,
    }))
}

async fn osd_failure(
    State(shared): State<Arc<Shared>>,
    caller: Option<axum::Extension<crate::auth::Caller>>,
    ApiJson(r): ApiJson<OsdFailureReport>,
) -> Result<Response, HttpError> {
    check_acts_for(&shared, caller.as_ref(), r.reporter)?;
    let reply = shared
        .commit(move |s, now| {
            let down = s.failure_report(&r, now)?;
            Ok(OsdFailureReply {
                epoch: s.epoch(),
                down,
            })
        })
        .await?;
    Ok(ok_json(&reply))
}

async fn pg_recovered(
    State(shared): State<Arc<Shared>>,
    caller: Option<axum::Extension<crate::auth::Caller>>,
    ApiJson(r): ApiJson<PgRecoveredReport>,
) -> Result<Response, HttpError> {
    check_acts_for(&shared, caller.as_ref(), r.reporter)?;
    let reporter = r.reporter;
    let reply = shared
        .commit(move |s, _| {
            let recorded = s.pg_recovered(&r)?;
            Ok(PgRecoveredReply {
                epoch: s.epoch(),
                recorded,
            })
        })
        .await?;
    if reply.recorded > 0 {
        info!(
            "{reporter} reports {} recovered copies (map {})",
            reply.recorded, reply.epoch
        );
    }
    Ok(ok_json(&reply))
}

async fn osd_out(
    State(shared): State<Arc<Shared>>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, HttpError> {
    osd_set_in(shared, path_osd(id)?, false).await
}

async fn osd_in(
    State(shared): State<Arc<Shared>>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, HttpError> {
    osd_set_in(shared, path_osd(id)?, true).await
}

async fn osd_set_in(shared: Arc<Shared>, id: OsdId, r#in: bool) -> Result<Response, HttpError> {
    let (changed, epoch) = shared
        .commit_admin(move |s, _| Ok((s.set_in(id, r#in)?, s.epoch())))
        .await?;
    if changed {
        let what = if r#in { "in" } else { "out" };
        info!("{id} marked {what} by an operator (map {epoch})");
    }
    Ok(ok_json(&OsdOpReply {
        osd: id,
        epoch,
        changed,
        lost_pgs: Vec::new(),
    }))
}

async fn osd_reweight(
    State(shared): State<Arc<Shared>>,
    id: Result<Path<String>, PathRejection>,
    ApiJson(req): ApiJson<OsdReweight>,
) -> Result<Response, HttpError> {
    let id = path_osd(id)?;
    let weight = req.weight;
    let (changed, epoch) = shared
        .commit_admin(move |s, _| Ok((s.reweight(id, weight)?, s.epoch())))
        .await?;
    if changed {
        info!("{id} reweighted to {weight} by an operator (map {epoch})");
    }
    Ok(ok_json(&OsdOpReply {
        osd: id,
        epoch,
        changed,
        lost_pgs: Vec::new(),
    }))
}

async fn osd_rm(
    State(shared): State<Arc<Shared>>,
    id: Result<Path<String>, PathRejection>,
) -> Result<Response, HttpError> {
    let id = path_osd(id)?;
    let (lost_pgs, epoch) = shared
        .commit_admin(move |s, _| Ok((s.remove_osd(id)?, s.epoch())))
        .await?;
    if lost_pgs.is_empty() {
        info!("{id} removed by an operator (map {epoch})");
    } else {
        warn!(
            "{id} removed by an operator (map {epoch}); it held the last complete copy of \
             {} placement groups, whose data is LOST: {:?}",
            lost_pgs.len(),
            lost_pgs
                .iter()
                .take(32)
                .map(ToString::to_string)
                .collect::<Vec<_>>()
        );
    }
    Ok(ok_json(&OsdOpReply {
        osd: id,
        epoch,
        changed: true,
        lost_pgs,
    }))
}

async fn list_volumes(State(shared): State<Arc<Shared>>) -> Response {
    let map = shared.map();
    let vols: Vec<_> = map.volumes.values().collect();
    ok_json(&vols)
}

async fn get_volume(
    State(shared): State<Arc<Shared>>,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, HttpError> {
    let name = path_name(name)?;
    let map = shared.map();
    let vol = map
        .volumes
        .get(&name)
        .ok_or_else(|| StateError::NotFound(format!("no volume named {name}")))?;
    Ok(ok_json(vol))
}

fn unix_now() -> u64 {
    flame_common::clock::unix_ms() / 1000
}

async fn create_volume(
    State(shared): State<Arc<Shared>>,
    ApiJson(req): ApiJson<VolumeCreate>,
) -> Result<Response, HttpError> {
    let (vol, epoch) = shared
        .commit_admin(move |s, _| Ok((s.create_volume(&req, unix_now())?, s.epoch())))
        .await?;
    info!(
        "volume {} created: {}, {} bytes (map {epoch})",
        vol.name, vol.id, vol.size
    );
    Ok(ok_json(&vol))
}

async fn resize_volume(
    State(shared): State<Arc<Shared>>,
    name: Result<Path<String>, PathRejection>,
    ApiJson(req): ApiJson<VolumeResize>,
) -> Result<Response, HttpError> {
    let name = path_name(name)?;
    let (vol, epoch) = shared
        .commit_admin(move |s, _| Ok((s.resize_volume(&name, &req)?, s.epoch())))
        .await?;
    info!(
        "volume {} resized to {} bytes (map {epoch})",
        vol.name, vol.size
    );
    Ok(ok_json(&vol))
}

async fn get_volume_trim(
    State(shared): State<Arc<Shared>>,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, HttpError> {
    let name = path_name(name)?;
    let (state, _) = shared.snapshot().await?;
    Ok(ok_json(&state.volume_trim(&name)?))
}

async fn volume_trim_done(
    State(shared): State<Arc<Shared>>,
    name: Result<Path<String>, PathRejection>,
    ApiJson(req): ApiJson<TrimDone>,
) -> Result<Response, HttpError> {
    let name = path_name(name)?;
    let (trim, epoch) = shared
        .commit_admin(move |s, _| Ok((s.trim_done(&name, &req)?, s.epoch())))
        .await?;
    match trim.pending {
        None => info!(
            "{}: shrink trimmed on every copy (map {epoch})",
            trim.volume
        ),
        Some(t) => info!(
            "{}: trim reported, but {}..{} is still pending (map {epoch})",
            trim.volume, t.from, t.to
        ),
    }
    Ok(ok_json(&trim))
}

async fn delete_volume(
    State(shared): State<Arc<Shared>>,
    name: Result<Path<String>, PathRejection>,
) -> Result<Response, HttpError> {
    let name = path_name(name)?;
    let (vol, epoch) = shared
        .commit_admin(move |s, _| Ok((s.delete_volume(&name)?, s.epoch())))
        .await?;
    info!("volume {} ({}) deleted (map {epoch})", vol.name, vol.id);
    Ok(ok_json(&vol))
}

async fn get_metrics(State(shared): State<Arc<Shared>>) -> Response {
    let text = shared.render_metrics().await;
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; version=0.0.4"),
        )],
        text,
    )
        .into_response()
}
