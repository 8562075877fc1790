//! Harness helpers for fault tests: the OSDs' failpoints (flame-osd built with
//! `--features flame-osd/failpoints`, as scripts/test.sh builds it), exit statuses,
//! metrics and which OSD process serves an object.

use crate::{HTTP_TIMEOUT, TestCluster};
use flame_common::ids::{ObjectId, OsdId};
use std::net::SocketAddr;
use std::process::ExitStatus;

/// `METHOD http://<addr><path>` with `body` → `(status, body)`; errors are
/// transport failures.
pub fn http_request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> Result<(u16, String), String> {
    let url = format!("http://{addr}{path}");
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(HTTP_TIMEOUT))
        .build()
        .into();
    let resp = match method {
        "PUT" => agent.put(&url).send(body),
        "DELETE" => agent.delete(&url).call(),
        "GET" => agent.get(&url).call(),
        other => return Err(format!("unsupported method {other}")),
    };
    let mut resp = resp.map_err(|e| format!("{method} {url}: {e}"))?;
    let code = resp.status().as_u16();
    let text = resp
        .body_mut()
        .read_to_string()
        .map_err(|e| format!("{method} {url}: reading body: {e}"))?;
    Ok((code, text))
}

impl TestCluster {
    /// Sets failpoint `name` of OSD process `i` to `action` (a `fail` crate action
    /// such as `return(EIO)`). Panics, saying how to build it, when the OSD has no
    /// failpoints compiled in.
    pub fn set_failpoint(&self, i: usize, name: &str, action: &str) {
        let addr = self.osd_metrics_addr(i);
        let (code, text) = http_request(addr, "PUT", &format!("/failpoints/{name}"), action)
            .unwrap_or_else(|e| panic!("osd process {i}: {e}"));
        assert!(
            code != 404,
            "osd process {i} has no failpoints: build the daemons with \
             `cargo build --workspace --bins --features flame-osd/failpoints` (scripts/test.sh does)"
        );
        assert_eq!(
            code, 200,
            "failpoint {name}={action} on osd process {i}: {text}"
        );
    }

    /// Turns failpoint `name` of OSD process `i` off.
    pub fn clear_failpoint(&self, i: usize, name: &str) {
        let addr = self.osd_metrics_addr(i);
        let (code, text) = http_request(addr, "DELETE", &format!("/failpoints/{name}"), "")
            .unwrap_or_else(|e| panic!("osd process {i}: {e}"));
        assert_eq!(
            code, 200,
            "clearing failpoint {name} on osd process {i}: {text}"
        );
    }

    /// How OSD process `i` exited on its own (`None`: still running or not started).
    pub fn osd_exit_status(&mut self, i: usize) -> Option<ExitStatus> {
        self.osds[i].exited()
    }

    /// Waits up to `timeout` for OSD process `i` to exit on its own; how it
    /// exited, or `None` if it is still running.
    pub fn wait_osd_exit(&mut self, i: usize, timeout: std::time::Duration) -> Option<ExitStatus> {
        let deadline = std::time::Instant::now() + timeout;
        loop {
            if let Some(s) = self.osd_exit_status(i) {
                return Some(s);
            }
            if std::time::Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// The OSD process index serving OSD `id` of `map` (by its data address).
    pub fn osd_process(&self, map: &flame_common::map::ClusterMap, id: OsdId) -> usize {
        self.osd_index(map, id)
            .unwrap_or_else(|| panic!("no OSD process serves {id}"))
    }

    /// OSD processes holding `object`, the primary first (placement of the current
    /// map, every OSD up).
    pub fn object_osds(&self, object: ObjectId) -> Vec<usize> {
        let map = self.map();
        let loc = flame_common::placement::locate(&map, object);
        loc.osds
            .iter()
            .map(|&id| self.osd_process(&map, id))
            .collect()
    }

    /// The value of the metric line `name` (with its labels, e.g.
    /// `flame_osd_read_errors_total{result="repaired"}`) of OSD process `i`; 0 when
    /// absent.
    pub fn osd_metric(&self, i: usize, name: &str) -> f64 {
        let (code, body) = crate::http_get(self.osd_metrics_addr(i), "/metrics")
            .unwrap_or_else(|e| panic!("osd process {i}: {e}"));
        assert_eq!(code, 200, "osd process {i} metrics: HTTP {code}");
        let want = format!("{name} ");
        body.lines()
            .find_map(|l| l.strip_prefix(&want))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    }
}
