//! `flame-admin pg ls` and `pg info`: each placement group's state and roles, from
//! the manager's `GET /v1/pgs`, plus — for one group — the log bounds its primary
//! reports on its metrics server.
//!
//! The log bounds are a courtesy: an OSD that is slow, down, or too old to serve
//! them must never make `pg info` fail, so they are fetched with a short timeout
//! and replaced by "unavailable (reason)".

use super::format::{fields, table};
use super::{Result, json};
use crate::MgrClient;
use flame_common::ids::{OsdId, PgId};
use flame_common::map::ClusterMap;
use flame_common::mgr_api::PgStatus;
use flame_common::pg_state::state_matches;
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::time::Duration;

/// How long `pg info` waits for the primary's log bounds (connect and answer).
pub const OSD_QUERY_TIMEOUT: Duration = Duration::from_millis(1500);
/// Largest answer accepted from an OSD's `GET /v1/pgs/{id}`.
const OSD_ANSWER_BYTES_MAX: u64 = 64 << 10;

/// Parses `12` or `pg.12`.
pub fn parse_pg(text: &str) -> std::result::Result<PgId, String> {
    let t = text.trim();
    let digits = t.strip_prefix("pg.").unwrap_or(t);
    digits
        .parse::<u32>()
        .map(PgId)
        .map_err(|_| format!("`{text}` is not a placement group (e.g. 12 or pg.12)"))
}

/// OSD ids as `0,2,1` (primary first where the list is ordered), `-` for none.
pub fn osd_ids(ids: &[OsdId]) -> String {
    if ids.is_empty() {
        return "-".into();
    }
    ids.iter()
        .map(|i| i.0.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The rows of `pg ls` whose state matches `filter` (see
/// [`flame_common::pg_state::state_matches`]); all of them without a filter.
pub fn filter_pgs<'a>(pgs: &'a [PgStatus], filter: Option<&str>) -> Vec<&'a PgStatus> {
    pgs.iter()
        .filter(|p| filter.is_none_or(|f| state_matches(&p.state, f)))
        .collect()
}

/// The `pg ls` table.
pub fn pg_table(pgs: &[&PgStatus]) -> String {
    let rows: Vec<Vec<String>> = pgs
        .iter()
        .map(|p| {
            vec![
                p.pg.0.to_string(),
                p.state.clone(),
                p.primary.map_or_else(|| "-".into(), |o| o.0.to_string()),
                osd_ids(&p.acting),
                osd_ids(&p.recovering),
                osd_ids(&p.placed),
                osd_ids(&p.down_complete),
            ]
        })
        .collect();
    table(
        &[
            "PG",
            "STATE",
            "PRIMARY",
            "ACTING",
            "RECOVERING",
            "PLACED",
            "DOWN_COMPLETE",
        ],
        &rows,
    )
}

/// `flame-admin pg ls [--state S]`.
pub fn pg_ls(mgr: &MgrClient, state: Option<&str>, as_json: bool) -> Result<String> {
    let all = mgr.pgs()?;
    let shown = filter_pgs(&all, state);
    if as_json {
        return json(&shown);
    }
    if shown.is_empty() {
        return Ok(match state {
            Some(s) => format!("no placement group is {s} (of {} in the pool)\n", all.len()),
            None => "the pool has no placement groups\n".into(),
        });
    }
    Ok(pg_table(&shown))
}

/// What an OSD's metrics server answers on `GET /v1/pgs/{id}` (served by the
/// recovery engine): the bounds of the group's write log. Unknown fields are kept
/// for `--json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OsdPgLog {
    /// The group.
    pub pg: PgId,
    /// Sequence number of the oldest write the log still holds.
    pub log_first_seq: Option<u64>,
    /// Sequence number of the newest write.
    pub log_last_seq: Option<u64>,
    /// Everything else the OSD reported.
    #[serde(flatten)]
    pub other: serde_json::Map<String, serde_json::Value>,
}

/// `pg info --json`.
#[derive(Clone, Debug, Serialize)]
pub struct PgInfoView {
    /// The manager's view.
    #[serde(flatten)]
    pub status: PgStatus,
    /// The primary's log, when it answered.
    pub log: Option<OsdPgLog>,
    /// Why `log` is missing.
    pub log_unavailable: Option<String>,
}

/// Asks the primary's metrics server for the group's log bounds.
fn fetch_log(map: &ClusterMap, status: &PgStatus) -> std::result::Result<OsdPgLog, String> {
    let primary = status
        .primary
        .ok_or_else(|| "no primary: no complete copy is up".to_string())?;
    let osd = map
        .osds
        .get(&primary)
        .ok_or_else(|| format!("{primary} is not in the map"))?;
    let addr = osd
        .metrics_addr
        .ok_or_else(|| format!("{primary} has no metrics address"))?;
    query_osd(addr, status.pg).map_err(|e| format!("{primary} at {addr}: {e}"))
}

/// `GET http://addr/v1/pgs/{pg}` with [`OSD_QUERY_TIMEOUT`].
pub fn query_osd(addr: SocketAddr, pg: PgId) -> std::result::Result<OsdPgLog, String> {
    let agent = flame_common::http::agent(
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(OSD_QUERY_TIMEOUT)),
        None,
        None,
    );
    let url = format!("http://{addr}/v1/pgs/{}", pg.0);
    let mut resp = agent.get(&url).call().map_err(|e| match e {
        ureq::Error::Io(io) if io.kind() == std::io::ErrorKind::ConnectionRefused => {
            "connection refused".to_string()
        }
        ureq::Error::Timeout(_) => format!("no answer within {} ms", OSD_QUERY_TIMEOUT.as_millis()),
        other => other.to_string(),
    })?;
    let status = resp.status().as_u16();
    let bytes = resp
        .body_mut()
        .with_config()
        .limit(OSD_ANSWER_BYTES_MAX)
        .read_to_vec()
        .map_err(|e| format!("reading the answer: {e}"))?;
    if !(200..300).contains(&status) {
        // The OSD's reason when it gives one as `{"error": ...}`.
        let reason = serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()
            .and_then(|v| v.get("error")?.as_str().map(str::to_string));
        let text = match reason {
            Some(r) => r,
            None if status == 404 => {
                "this OSD serves no details for this placement group".to_string()
            }
            None => String::from_utf8_lossy(&bytes).trim().to_string(),
        };
        let text: String = text.chars().take(200).collect();
        return Err(format!("HTTP {status}: {text}"));
    }
    let log: OsdPgLog =
        serde_json::from_slice(&bytes).map_err(|e| format!("unexpected answer: {e}"))?;
    if log.pg != pg {
        return Err(format!("answered for {} instead of {pg}", log.pg));
    }
    Ok(log)
}

/// The `log bounds` line of `pg info`.
pub fn log_line(log: &std::result::Result<OsdPgLog, String>) -> String {
    match log {
        Ok(l) => match (l.log_first_seq, l.log_last_seq) {
            (Some(a), Some(b)) if b < a => format!("empty (next write gets seq {})", b + 1),
            (Some(a), Some(b)) => {
                let entries = l
                    .other
                    .get("log_entries")
                    .and_then(serde_json::Value::as_u64)
                    .unwrap_or((b - a).saturating_add(1));
                format!("seq {a}..={b} ({entries} entries)")
            }
            (None, None) => "empty (no write logged since the OSD started)".into(),
            (a, b) => format!(
                "first {}, last {}",
                a.map_or_else(|| "-".into(), |v| v.to_string()),
                b.map_or_else(|| "-".into(), |v| v.to_string())
            ),
        },
        Err(reason) => format!("unavailable ({reason})"),
    }
}

/// `flame-admin pg info ID`.
pub fn pg_info(mgr: &MgrClient, pg: PgId, as_json: bool) -> Result<String> {
    let status = mgr.pg(pg)?;
    // The map names the primary's metrics address. A failure here only costs the
    // log bounds.
    let log = match mgr.map() {
        Ok(map) => fetch_log(&map, &status),
        Err(e) => Err(format!("cannot read the map: {e}")),
    };
    if as_json {
        let (log, log_unavailable) = match log {
            Ok(l) => (Some(l), None),
            Err(e) => (None, Some(e)),
        };
        return json(&PgInfoView {
            status,
            log,
            log_unavailable,
        });
    }
    Ok(pg_info_text(&status, &log))
}

/// The human form of `pg info`.
pub fn pg_info_text(s: &PgStatus, log: &std::result::Result<OsdPgLog, String>) -> String {
    let list = |ids: &[OsdId]| {
        if ids.is_empty() {
            "none".to_string()
        } else {
            ids.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        }
    };
    let mut pairs = vec![
        ("pg", format!("{} (map epoch {})", s.pg, s.epoch.0)),
        ("state", s.state.clone()),
        (
            "primary",
            s.primary
                .map_or_else(|| "none (no complete copy is up)".into(), |p| p.to_string()),
        ),
        ("acting", list(&s.acting)),
        ("recovering", list(&s.recovering)),
        ("placed", list(&s.placed)),
        ("down complete", list(&s.down_complete)),
        ("log bounds", log_line(log)),
    ];
    if s.state.starts_with("inactive") {
        pairs.push((
            "note",
            "I/O to this group waits (no error) until enough complete copies are up".to_string(),
        ));
    }
    fields(&pairs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::ids::Epoch;

    fn st(pg: u32, state: &str) -> PgStatus {
        PgStatus {
            pg: PgId(pg),
            state: state.into(),
            epoch: Epoch(7),
            placed: vec![OsdId(0), OsdId(1), OsdId(2)],
            acting: vec![OsdId(0), OsdId(2)],
            primary: Some(OsdId(0)),
            recovering: vec![OsdId(1)],
            down_complete: vec![],
        }
    }

    #[test]
    fn ids_and_filters() {
        assert_eq!(parse_pg("12"), Ok(PgId(12)));
        assert_eq!(parse_pg("pg.3"), Ok(PgId(3)));
        assert!(parse_pg("pg.x").is_err());
        assert!(parse_pg("-1").is_err());
        let pgs = vec![
            st(0, "active+clean"),
            st(1, "active+recovering+degraded"),
            st(2, "inactive+degraded"),
        ];
        let pick =
            |f: Option<&str>| -> Vec<u32> { filter_pgs(&pgs, f).iter().map(|p| p.pg.0).collect() };
        assert_eq!(pick(None), vec![0, 1, 2]);
        assert_eq!(pick(Some("degraded")), vec![1, 2]);
        assert_eq!(pick(Some("active+degraded")), vec![1]);
        assert_eq!(pick(Some("inactive")), vec![2]);
        let t = pg_table(&filter_pgs(&pgs, Some("recovering")));
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("PG  STATE"), "{t}");
        assert_eq!(
            lines[1].split_whitespace().collect::<Vec<_>>(),
            [
                "1",
                "active+recovering+degraded",
                "0",
                "0,2",
                "1",
                "0,1,2",
                "-"
            ]
        );
    }

    #[test]
    fn info_text_says_when_log_bounds_are_unavailable() {
        let s = st(1, "active+recovering+degraded");
        let t = pg_info_text(&s, &Err("osd.0 at 127.0.0.1:1: connection refused".into()));
        assert!(
            t.contains("log bounds     unavailable (osd.0 at 127.0.0.1:1: connection refused)"),
            "{t}"
        );
        assert!(t.contains("recovering     osd.1"), "{t}");
        let log: OsdPgLog = serde_json::from_str(
            r#"{"pg": 1, "log_first_seq": 5, "log_last_seq": 9, "entries": 5}"#,
        )
        .unwrap();
        assert_eq!(log.other.get("entries"), Some(&serde_json::json!(5)));
        let t = pg_info_text(&s, &Ok(log));
        assert!(t.contains("log bounds     seq 5..=9 (5 entries)"), "{t}");
        let empty: OsdPgLog =
            serde_json::from_str(r#"{"pg": 1, "log_first_seq": 1, "log_last_seq": 0}"#).unwrap();
        let t = pg_info_text(&s, &Ok(empty));
        assert!(
            t.contains("log bounds     empty (next write gets seq 1)"),
            "{t}"
        );
        let t = pg_info_text(&st(2, "inactive+degraded"), &Err("x".into()));
        assert!(t.contains("I/O to this group waits"), "{t}");
    }

    /// A refused connection and a server that answers 404 both come back as a
    /// reason, quickly; neither is an error of the command.
    #[test]
    fn osd_query_failures_are_reasons() {
        let free = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let e = query_osd(free, PgId(1)).unwrap_err();
        assert!(e.contains("refused"), "{e}");
        let server = tiny_http::Server::http("127.0.0.1:0").unwrap();
        let addr = server.server_addr().to_ip().unwrap();
        let t = std::thread::spawn(move || {
            for (i, req) in server.incoming_requests().enumerate() {
                let r = match i {
                    0 => {
                        tiny_http::Response::from_string(r#"{"error":"no placement group 4 here"}"#)
                            .with_status_code(404)
                    }
                    _ => tiny_http::Response::from_string(
                        r#"{"pg": 4, "log_first_seq": 1, "log_last_seq": 2}"#,
                    ),
                };
                let _ = req.respond(r);
                if i == 1 {
                    break;
                }
            }
        });
        let e = query_osd(addr, PgId(4)).unwrap_err();
        assert_eq!(e, "HTTP 404: no placement group 4 here");
        let log = query_osd(addr, PgId(4)).unwrap();
        assert_eq!((log.log_first_seq, log.log_last_seq), (Some(1), Some(2)));
        t.join().unwrap();
    }
}
