//! Nobody in without a key: flame-nbd's exports, driven by real NBD clients.
//!
//! One cluster whose flame-nbd has both exports: the Unix socket (peers
//! admitted by uid) and TCP requiring TLS (NBD `STARTTLS`, client
//! certificates from the cluster CA carrying the entity's volumes and
//! access). A client without a certificate, another local user, a client
//! whose certificate does not cover the volume, one whose certificate is
//! read-only writing, and one with another CA's certificate are each refused
//! with the NBD error the spec names, and nothing they tried changed the
//! volume; the legitimate clients (qemu-io with `tls-creds-x509`, nbdinfo
//! and nbdcopy with `nbds://` and `nbd+unix://`) read and write.

// Test code may read the real clock and sleep (the clock rule, clippy.toml, covers
// production code).
#![allow(clippy::disallowed_methods)]

use flame_tests::{
    ClusterOptions, TOOL_TIMEOUT, TestCluster, output_text, require_tool, run_bounded,
};
use std::path::Path;
use std::process::{Command, Output};

const MIB: u64 = 1 << 20;

/// `qemu-io` on `volume` over TLS with the credentials in `creds` (QEMU's
/// x509 layout): the image options QEMU takes for an NBD server with TLS.
fn qemu_io_tls(cluster: &TestCluster, creds: &Path, volume: &str, cmds: &[&str]) -> Output {
    let addr = cluster.nbd_addr();
    let mut cmd = Command::new(require_tool("qemu-io"));
    cmd.arg("--object").arg(format!(
        "tls-creds-x509,id=tls0,dir={},endpoint=client",
        creds.display()
    ));
    cmd.arg("--image-opts").arg(format!(
        "driver=nbd,server.type=inet,server.host={},server.port={},export={volume},tls-creds=tls0",
        addr.ip(),
        addr.port()
    ));
    for c in cmds {
        cmd.arg("-c").arg(c);
    }
    run_bounded(&mut cmd, TOOL_TIMEOUT)
}

/// Whether qemu-io did everything it was asked (it exits 0 even when a
/// command fails, printing the failure).
fn qemu_ok(out: &Output) -> bool {
    let text = output_text(out);
    out.status.success()
        && !text.contains("failed")
        && !text.contains("Pattern verification failed")
        && !text.contains("Could not open")
}

fn run(program: &str, args: &[&str]) -> Output {
    run_bounded(Command::new(require_tool(program)).args(args), TOOL_TIMEOUT)
}

/// Runs `program args` as the unprivileged user `nobody`.
fn run_as_nobody(program: &str, args: &[&str]) -> Output {
    let mut cmd = Command::new("setpriv");
    cmd.args(["--reuid=65534", "--regid=65534", "--clear-groups"])
        .arg(require_tool(program))
        .args(args);
    run_bounded(&mut cmd, TOOL_TIMEOUT)
}

#[test]
fn exports_admit_only_what_a_key_or_a_uid_allows() {
    // SAFETY: plain syscall.
    assert_eq!(
        unsafe { libc::geteuid() },
        0,
        "this test runs as root (as CI does), to act as another user"
    );
    let cluster = TestCluster::start_with(ClusterOptions {
        nbd_tls: true,
        ..ClusterOptions::with_nbd()
    });
    cluster.create_volume("vm1-root", 16 * MIB);
    cluster.create_volume("db", 16 * MIB);
    let unix_uri = cluster.nbd_unix_uri("vm1-root");

    // The Unix socket: the daemon's own user (root here) reads and writes.
    cluster.qemu_io_uri(&unix_uri, &["write -P 0x11 0 1M", "read -P 0x11 0 1M"]);

    // TLS with a certificate for vm1-*: reads and writes vm1-root, lists only it.
    let rw = cluster.client_cert_dir("client.vm1", "vm1-*", false);
    let out = qemu_io_tls(
        &cluster,
        &rw,
        "vm1-root",
        &[
            "read -P 0x11 0 1M",
            "write -P 0x22 1M 1M",
            "read -P 0x22 1M 1M",
        ],
    );
    assert!(qemu_ok(&out), "TLS client: {}", output_text(&out));
    let list = run("nbdinfo", &["--list", &cluster.nbd_tls_uri("", &rw)]);
    let text = output_text(&list);
    assert!(list.status.success(), "nbdinfo --list over TLS: {text}");
    assert!(
        text.contains("vm1-root") && !text.contains("export=\"db\""),
        "LIST shows only what the certificate opens: {text}"
    );
    // nbdcopy over nbds:// reads what qemu-io wrote.
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("copy.img");
    let out = run(
        "nbdcopy",
        &[
            &cluster.nbd_tls_uri("vm1-root", &rw),
            copy.to_str().unwrap(),
        ],
    );
    assert!(out.status.success(), "nbdcopy: {}", output_text(&out));
    let bytes = std::fs::read(&copy).unwrap();
    assert!(bytes[..MIB as usize].iter().all(|&b| b == 0x11));
    assert!(
        bytes[MIB as usize..2 * MIB as usize]
            .iter()
            .all(|&b| b == 0x22)
    );

    // No certificate: TLS is required (NBD_REP_ERR_TLS_REQD), nothing listed.
    let plain = format!("nbd://{}/vm1-root", cluster.nbd_addr());
    let out = run(
        "nbdinfo",
        &["--list", &format!("nbd://{}", cluster.nbd_addr())],
    );
    let text = output_text(&out);
    assert!(!out.status.success(), "a plain client listed: {text}");
    assert!(!text.contains("vm1-root"), "{text}");
    let out = run(
        "qemu-io",
        &["-f", "raw", &plain, "-c", "write -P 0x66 0 4k"],
    );
    let text = output_text(&out);
    assert!(!qemu_ok(&out), "a plain client wrote: {text}");
    assert!(text.contains("TLS"), "the refusal names TLS: {text}");

    // A certificate for another volume: refused (NBD_REP_ERR_POLICY).
    let other = cluster.client_cert_dir("client.db", "db", false);
    let out = qemu_io_tls(&cluster, &other, "vm1-root", &["write -P 0x77 0 4k"]);
    let text = output_text(&out);
    assert!(!qemu_ok(&out), "client.db opened vm1-root: {text}");
    assert!(text.contains("may not open"), "{text}");

    // A read-only certificate: the export is advertised read-only (QEMU
    // opens it only with -r), reads work, and a write sent anyway (libnbd
    // with its client-side checks off) fails with EPERM.
    let ro = cluster.client_cert_dir("client.reader", "vm1-*", true);
    let out = qemu_io_tls(&cluster, &ro, "vm1-root", &["write -P 0x88 0 4k"]);
    assert!(
        !qemu_ok(&out),
        "a read-only client wrote: {}",
        output_text(&out)
    );
    let uri = cluster.nbd_tls_uri("vm1-root", &ro);
    let script = format!(
        "import nbd\n\
         h = nbd.NBD()\n\
         h.set_strict_mode(0)\n\
         h.set_uri_allow_local_file(True)\n\
         h.connect_uri({uri:?})\n\
         assert h.is_read_only()\n\
         assert h.pread(4096, 0) == b'\\x11' * 4096\n\
         try:\n    h.pwrite(b'\\x88' * 4096, 0)\n    print('WROTE')\n\
         except nbd.Error as e:\n    print('REFUSED', e.errno, e.string)\n"
    );
    // The system's python3, where python3-libnbd is (scripts/test.sh).
    let out = run_bounded(
        Command::new("/usr/bin/python3").args(["-c", &script]),
        TOOL_TIMEOUT,
    );
    let text = output_text(&out);
    assert!(out.status.success(), "python3 libnbd: {text}");
    // From the server: libnbd's own check (off here) would say the server
    // does not support writes.
    assert!(
        text.contains("REFUSED EPERM") && !text.contains("does not support"),
        "a read-only client's write must fail with EPERM from the server: {text}"
    );

    // A certificate from another CA: the TLS handshake fails.
    let foreign_ca = tmp.path().join("foreign");
    flame_client::admin::tls::generate(&foreign_ca, &["127.0.0.1".into()]).unwrap();
    let claims = flame_client::nbd::client_cert::ClientClaims {
        entity: flame_common::auth::EntityName::parse("client.vm1").unwrap(),
        volumes: flame_common::auth::VolumePatterns::all(),
        read_only: false,
    };
    let files = flame_client::admin::tls::issue_client(&foreign_ca, &claims, 1).unwrap();
    let forged = tmp.path().join("forged");
    std::fs::create_dir(&forged).unwrap();
    std::fs::copy(rw.join("ca-cert.pem"), forged.join("ca-cert.pem")).unwrap();
    std::fs::copy(&files[0], forged.join("client-cert.pem")).unwrap();
    std::fs::copy(&files[1], forged.join("client-key.pem")).unwrap();
    let out = qemu_io_tls(&cluster, &forged, "vm1-root", &["write -P 0x99 0 4k"]);
    assert!(
        !qemu_ok(&out),
        "another CA's certificate wrote: {}",
        output_text(&out)
    );

    // Another local user on the Unix socket: with the socket file and its
    // directory opened to everyone (so the file modes do not stop it first),
    // its uid is refused (NBD_REP_ERR_POLICY) and it lists nothing.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(cluster.dir(), std::fs::Permissions::from_mode(0o711)).unwrap();
    std::fs::set_permissions(cluster.nbd_socket(), std::fs::Permissions::from_mode(0o666)).unwrap();
    let out = run_as_nobody("nbdinfo", &["--list", &unix_uri]);
    let text = output_text(&out);
    assert!(
        !out.status.success() && !text.contains("vm1-root"),
        "nobody listed: {text}"
    );
    let out = run_as_nobody(
        "qemu-io",
        &["-f", "raw", &unix_uri, "-c", "write -P 0x55 0 4k"],
    );
    let text = output_text(&out);
    assert!(!qemu_ok(&out), "nobody wrote: {text}");
    assert!(
        text.contains("uid 65534"),
        "the refusal names the uid: {text}"
    );

    // Nothing any refused client tried changed the volume.
    cluster.qemu_io_uri(&unix_uri, &["read -P 0x11 0 1M", "read -P 0x22 1M 1M"]);
}
