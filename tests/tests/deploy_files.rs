//! The systemd units in deploy/systemd point at documentation that exists: every
//! `Documentation=` is a file their own install steps put under
//! /usr/local/share/doc/flame (there is no public project page to link to), and a
//! bad config (exit status 2) is not restarted in a loop.

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
    assert_eq!(units.len(), 3, "{units:?}");
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
