//! The systemd units in deploy/systemd point at documentation that exists: every
//! `Documentation=` is a file their own install steps put under
//! /usr/local/share/doc/flame (there is no public project page to link to), and a
//! bad config (exit status 2) is not restarted in a loop; flame-ublk's unit
//! restarts into the device the kernel kept.

use std::path::Path;

const DOC_DIR: &str = "/usr/local/share/doc/flame/";
const INSTALL_DOCS: &str = "install -D -m 0644 -t /usr/local/share/doc/flame README.md docs/*.md";

#[test]
fn systemd_units_document_installed_files() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let units: Vec<_> = std::fs::read_dir(repo.join("deploy/systemd"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "service"))
        .collect();
    assert_eq!(units.len(), 4, "{units:?}");
    for unit in units {
        let text = std::fs::read_to_string(&unit).unwrap();
        let name = unit.display();
        assert!(
            text.contains(INSTALL_DOCS),
            "{name}: install steps must install the docs"
        );
        assert!(
            text.lines().any(|l| l == "RestartPreventExitStatus=2"),
            "{name}: a bad config (exit 2) must not restart in a loop"
        );
        if unit.ends_with("flame-ublk@.service") {
            // A restart after a crash must take over the device the kernel kept
            // (the `--device` path tests/vm/ublk.sh runs after its kill -9).
            assert!(
                text.lines().any(|l| l.starts_with("ExecStart=")
                    && l.contains("--device %i")
                    && l.contains("/etc/flame/ublk-%i.yaml")),
                "{name}: ExecStart must run --device %i with the instance's config"
            );
        }
        let docs: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("Documentation="))
            .flat_map(str::split_whitespace)
            .collect();
        assert!(!docs.is_empty(), "{name}: no Documentation=");
        for uri in docs {
            let file = uri
                .strip_prefix("file://")
                .and_then(|p| p.strip_prefix(DOC_DIR))
                .unwrap_or_else(|| panic!("{name}: {uri} is not an installed doc under {DOC_DIR}"));
            let source = if file == "README.md" {
                repo.join("README.md")
            } else {
                repo.join("docs").join(file)
            };
            assert!(
                source.is_file(),
                "{name}: {uri}: {} does not exist",
                source.display()
            );
        }
    }
}

/// The Grafana dashboard is valid JSON that Grafana can lay out: unique panel ids,
/// panels inside the 24-column grid and not overlapping, every query naming a
/// Flame metric. (Which manager metrics exist is checked against a running
/// manager in flame-mgr's API test.)
#[test]
fn grafana_dashboard_is_valid() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let text = std::fs::read_to_string(repo.join("deploy/grafana/flame-dashboard.json")).unwrap();
    let d: serde_json::Value = serde_json::from_str(&text).expect("dashboard is not JSON");
    let panels = d["panels"].as_array().expect("panels");
    let mut ids = std::collections::BTreeSet::new();
    let mut cells = std::collections::BTreeMap::new();
    for p in panels {
        let id = p["id"].as_u64().expect("panel id");
        assert!(ids.insert(id), "duplicate panel id {id}");
        let g = &p["gridPos"];
        let (x, y, w, h) = (
            g["x"].as_u64().unwrap(),
            g["y"].as_u64().unwrap(),
            g["w"].as_u64().unwrap(),
            g["h"].as_u64().unwrap(),
        );
        assert!(x + w <= 24 && w > 0 && h > 0, "panel {id} outside the grid");
        for cx in x..x + w {
            for cy in y..y + h {
                if let Some(other) = cells.insert((cx, cy), id) {
                    panic!("panels {other} and {id} overlap at ({cx}, {cy})");
                }
            }
        }
        if p["type"] != "row" {
            let targets = p["targets"].as_array().expect("targets");
            assert!(!targets.is_empty(), "panel {id} has no query");
            for t in targets {
                let expr = t["expr"].as_str().unwrap();
                assert!(expr.contains("flame_"), "panel {id}: {expr}");
            }
        }
    }
    // The failure-handling panels are there.
    for title in [
        "PGs by state",
        "Recovery rate",
        "Objects to recover",
        "OSDs up / down / in / out",
    ] {
        assert!(
            panels.iter().any(|p| p["title"] == title),
            "no panel titled {title}"
        );
    }
}
