//! `transport: rdma` where RDMA cannot run: flame-osd and flame-nbd refuse to start
//! with exit status 2 and one line naming what is missing, before they create
//! anything or contact the manager.
//!
//! Which line depends on the build: binaries built without the `rdma` feature (the
//! default, as in `cargo test --workspace`) say the build has no RDMA support;
//! binaries built with it (`cargo build --bins --features flame-osd/rdma,
//! flame-client/rdma`, which scripts/test.sh does before running this test with
//! `FLAME_TEST_RDMA_BUILD=1`) say that no RDMA device was found. On a machine that
//! has an RDMA device the refusal cannot be shown, and the test says so and skips.

use flame_tests::{bin_dir, free_ports, output_text, run_bounded};
use std::process::Command;
use std::time::Duration;

/// Whether this machine has RDMA devices (the kernel lists them here).
fn has_rdma_device() -> bool {
    std::fs::read_dir("/sys/class/infiniband")
        .map(|mut d| d.next().is_some())
        .unwrap_or(false)
}

/// The reason the binaries under test must give.
fn expected_reason() -> &'static str {
    if std::env::var("FLAME_TEST_RDMA_BUILD").is_ok_and(|v| v == "1") {
        "transport rdma: no RDMA device found"
    } else {
        "transport rdma: this build has no RDMA support"
    }
}

fn check_refusal(bin: &str, out: &std::process::Output) {
    let text = output_text(out);
    assert_eq!(
        out.status.code(),
        Some(2),
        "{bin}: exit status; output:\n{text}"
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| l.starts_with(bin)).collect();
    assert_eq!(
        lines.len(),
        1,
        "{bin}: want one `{bin}: ` line, got:\n{stderr}"
    );
    let want = format!("{bin}: {}", expected_reason());
    assert!(
        lines[0].starts_with(&want),
        "{bin}: the refusal must name what is missing: want {want:?}, got {:?}",
        lines[0]
    );
    assert!(
        !lines[0].contains("  "),
        "{bin}: the line is mangled (runs of spaces): {:?}",
        lines[0]
    );
}

#[test]
fn rdma_without_a_device_the_daemons_refuse_to_start_and_say_why() {
    if has_rdma_device() {
        eprintln!(
            "SKIP rdma_unavailable: this machine has an RDMA device (/sys/class/infiniband), \
             so `transport: rdma` does not fail here"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    // The manager address is never contacted: the refusal comes first.
    let mgr_port = free_ports(1);
    let data_dir = dir.path().join("osd-data");
    let osd_yaml = dir.path().join("osd.yaml");
    std::fs::write(
        &osd_yaml,
        format!(
            "mgr: \"127.0.0.1:{mgr_port}\"\nlisten: \"127.0.0.1:{}\"\nmetrics_listen: \
             \"127.0.0.1:{}\"\ndata_dir: \"{}\"\nshards: 1\ntransport: rdma\n",
            free_ports(1),
            free_ports(1),
            data_dir.display()
        ),
    )
    .unwrap();
    let out = run_bounded(
        Command::new(bin_dir().join("flame-osd"))
            .arg("--config")
            .arg(&osd_yaml)
            .env("RUST_LOG", "warn"),
        Duration::from_secs(20),
    );
    check_refusal("flame-osd", &out);
    assert!(
        !data_dir.exists(),
        "flame-osd created its data directory before refusing"
    );

    let nbd_yaml = dir.path().join("nbd.yaml");
    std::fs::write(
        &nbd_yaml,
        format!(
            "mgr: \"127.0.0.1:{mgr_port}\"\nlisten: \"127.0.0.1:{}\"\ntcp_without_tls: true\nunix: null\nmetrics_listen: \
             \"127.0.0.1:{}\"\ntransport: rdma\n",
            free_ports(1),
            free_ports(1)
        ),
    )
    .unwrap();
    let out = run_bounded(
        Command::new(bin_dir().join("flame-nbd"))
            .arg("--config")
            .arg(&nbd_yaml)
            .env("RUST_LOG", "warn"),
        Duration::from_secs(20),
    );
    check_refusal("flame-nbd", &out);
}
