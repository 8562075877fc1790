//! The `rdma` transport for real: Soft-RoCE (`rdma_rxe`) in the test VM
//! (`scripts/vm.sh`; this machine's kernel has no RDMA modules). Everything runs
//! inside the guest, on a Soft-RoCE device over a guest-local dummy netdev
//! (`tests/vm/soft_roce.sh`), so no packet leaves the VM:
//!
//! * the transport conformance suite's rdma cases (`tests/vm/rdma_conformance.sh`
//!   runs flame-common's `transport_conformance` executable built with `--features
//!   rdma`);
//! * a three-OSD cluster and flame-nbd on `transport: rdma` with read-write
//!   conversion and fetched replies, a verified data test through NBD, the
//!   counters that show the one-sided verbs ran, and a read-back with one copy
//!   killed (`tests/vm/rdma_cluster.sh`);
//! * the Rust cluster suites `replication` and `nbd_cluster` with
//!   `FLAME_TEST_TRANSPORT=rdma` (`tests/vm/rdma_suites.sh`): the harness's own
//!   clusters, every OSD and flame-nbd on `transport: rdma`.
//!
//! They need builds `cargo test --workspace` does not make — the daemons with
//! `--features flame-osd/rdma,flame-client/rdma` (which replace the failpoints
//! build in the target directory) and the conformance executable with `--features
//! rdma` — so they are ignored in the main pass, and scripts/test.sh runs them
//! with `--ignored` in its rdma section, after those builds:
//!
//! ```sh
//! cargo build -p flame-mgr -p flame-osd -p flame-client --bins --features flame-osd/rdma,flame-client/rdma
//! cargo test -p flame-common --features rdma --test transport_conformance --no-run
//! cargo test -p flame-tests --test replication --test nbd_cluster --no-run
//! cargo test -p flame-tests --test rdma_vm -- --ignored --test-threads 1
//! ```
//!
//! Run with binaries built without the feature, the daemons refuse `transport:
//! rdma` and the cluster tests fail saying so; without the conformance build or
//! the suites' executables, those tests fail naming the command that makes them.
//! Nothing is skipped.

use flame_tests::bin_dir;
use flame_tests::vm::{self, VmCommand};
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// The guest's bounds: on two emulated cores the conformance run takes 30-70 s
/// in the guest, the cluster test 25-50 s (docs/testing.md, "rdma over
/// Soft-RoCE").
const CONFORMANCE_TIMEOUT: Duration = Duration::from_secs(300);
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(300);
/// The two cluster suites: about 170 s in the guest on a quiet host, 250 s
/// loaded.
const SUITES_TIMEOUT: Duration = Duration::from_secs(900);

/// flame-common's `transport_conformance` executable built with `--features
/// rdma`: `FLAME_RDMA_CONFORMANCE` when set, else the newest one in the target
/// directory's `deps/` whose test list has the rdma cases.
fn conformance_exe() -> PathBuf {
    if let Some(p) = std::env::var_os("FLAME_RDMA_CONFORMANCE") {
        return PathBuf::from(p);
    }
    // Only an rdma build lists the rdma cases (they are ignored there).
    newest_test_exe("transport_conformance", |path| {
        Command::new(path)
            .args(["--list", "--ignored", "rdma::ordering"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).contains("rdma::ordering: test"))
            .unwrap_or(false)
    })
    .unwrap_or_else(|| {
        panic!(
            "no transport_conformance executable built with --features rdma in {}: \
             cargo test -p flame-common --features rdma --test transport_conformance --no-run",
            bin_dir().join("deps").display()
        )
    })
}

/// The newest executable of integration test `name` in the target directory's
/// `deps/` that `accept` takes (cargo names them `NAME-HASH`).
fn newest_test_exe(name: &str, accept: impl Fn(&std::path::Path) -> bool) -> Option<PathBuf> {
    let deps = bin_dir().join("deps");
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = Vec::new();
    let entries =
        std::fs::read_dir(&deps).unwrap_or_else(|e| panic!("cannot list {}: {e}", deps.display()));
    let prefix = format!("{name}-");
    for entry in entries.flatten() {
        let path = entry.path();
        let file = entry.file_name().to_string_lossy().into_owned();
        if !file.starts_with(&prefix) || file.contains('.') {
            continue;
        }
        let Ok(meta) = entry.metadata() else { continue };
        if accept(&path)
            && let Ok(mtime) = meta.modified()
        {
            found.push((mtime, path));
        }
    }
    found.sort();
    found.pop().map(|(_, p)| p)
}

/// The cluster suites' executables (built by `cargo test`, or `cargo test -p
/// flame-tests --test replication --test nbd_cluster --no-run`).
fn suite_exe(name: &str) -> PathBuf {
    newest_test_exe(name, |_| true).unwrap_or_else(|| {
        panic!(
            "no {name} test executable in {}: cargo test -p flame-tests --test {name} --no-run",
            bin_dir().join("deps").display()
        )
    })
}

fn require_rdma_daemons() {
    for b in ["flame-mgr", "flame-osd", "flame-nbd", "flame-admin"] {
        assert!(
            bin_dir().join(b).is_file(),
            "{} missing: cargo build -p flame-mgr -p flame-osd -p flame-client --bins \
             --features flame-osd/rdma,flame-client/rdma first",
            bin_dir().join(b).display()
        );
    }
}

fn check_vm_run(name: &str, out: &vm::VmOutput) {
    eprintln!("{}", out.output);
    eprintln!(
        "{name}: the VM run took {:.1} s wall",
        out.wall.as_secs_f64()
    );
    assert_eq!(
        out.code(),
        Some(0),
        "tests/vm/{name}.sh failed in the VM ({}); its output is above",
        out.status
    );
    assert!(
        out.output.contains(&format!("\n{name}: OK\n")),
        "the guest script exited 0 without its OK line; output above"
    );
}

#[test]
#[ignore = "needs the conformance executable built with --features rdma and the test VM: scripts/test.sh runs it with --ignored (see the module documentation)"]
fn rdma_transport_conformance_over_soft_roce() {
    let exe = conformance_exe();
    let prep = vm::prepare().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{}", prep.output.trim_end());
    let cmd = VmCommand::new(["bash", "tests/vm/rdma_conformance.sh"])
        .env("FLAME_RDMA_CONFORMANCE", exe.to_string_lossy().into_owned())
        .env("RUST_BACKTRACE", "1")
        .timeout(CONFORMANCE_TIMEOUT);
    let out = vm::run(&cmd).unwrap_or_else(|e| panic!("{e}"));
    check_vm_run("rdma_conformance", &out);
}

#[test]
#[ignore = "needs the daemons built with --features flame-osd/rdma,flame-client/rdma and the test VM: scripts/test.sh runs it with --ignored (see the module documentation)"]
fn rdma_cluster_nbd_data_with_conversion_and_fetched_replies_over_soft_roce() {
    require_rdma_daemons();
    let prep = vm::prepare().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{}", prep.output.trim_end());
    let cmd = VmCommand::new(["bash", "tests/vm/rdma_cluster.sh"])
        .env("FLAME_BIN", bin_dir().to_string_lossy().into_owned())
        .env("RUST_BACKTRACE", "1")
        .timeout(CLUSTER_TIMEOUT);
    let out = vm::run(&cmd).unwrap_or_else(|e| panic!("{e}"));
    check_vm_run("rdma_cluster", &out);
}

/// The Rust cluster suites on `transport: rdma`, the same tests CI runs on tcp
/// and shm with the daemons' queue pairs on rxe0: `replication` with fetched
/// replies, `nbd_cluster` (qemu-io, qemu-img, nbdcopy, nbdinfo, fio, nbdfuse)
/// with flame-nbd's defaults, which on rdma convert every request of 4 KiB and
/// more (fetching there too costs the emulated guest another minute; the
/// cluster test above fetches and counts the RDMA READs).
#[test]
#[ignore = "needs the daemons built with --features flame-osd/rdma,flame-client/rdma and the test VM: scripts/test.sh runs it with --ignored (see the module documentation)"]
fn rdma_replication_and_nbd_cluster_suites_over_soft_roce() {
    require_rdma_daemons();
    let replication = suite_exe("replication");
    let nbd_cluster = suite_exe("nbd_cluster");
    let prep = vm::prepare().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("{}", prep.output.trim_end());
    let cmd = VmCommand::new([
        "bash".to_string(),
        "tests/vm/rdma_suites.sh".to_string(),
        "FLAME_TEST_REPLY_MODE=fetch".to_string(),
        replication.to_string_lossy().into_owned(),
        nbd_cluster.to_string_lossy().into_owned(),
    ])
    .env("RUST_BACKTRACE", "1")
    .timeout(SUITES_TIMEOUT);
    let out = vm::run(&cmd).unwrap_or_else(|e| panic!("{e}"));
    check_vm_run("rdma_suites", &out);
}
