//! TLS on the manager's API, black-box: a cluster whose manager serves only
//! HTTPS (`tls:`, the harness's cluster CA) boots its OSDs, serves flame-admin
//! and flame-nbd; what crosses the wire holds none of the API's plaintext; and
//! a client that does not trust the cluster CA, or speaks plain HTTP, gets
//! nothing.

use flame_tests::{ClusterOptions, TestCluster};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const MIB: u64 = 1 << 20;

/// A TCP relay on `ip` in front of `target` that records every byte both ways
/// (what a listener on the network sees), for the connections made while it
/// runs. Bounded: every socket has a 10 s read timeout, and the relay serves at
/// most 16 connections.
struct Tap {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<u8>>>,
}

impl Tap {
    fn start(ip: std::net::Ipv4Addr, target: SocketAddr) -> Tap {
        let listener = TcpListener::bind((ip, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = seen.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().take(16) {
                let Ok(client) = conn else { return };
                let Ok(server) = TcpStream::connect(target) else {
                    return;
                };
                for (from, to) in [
                    (client.try_clone().unwrap(), server.try_clone().unwrap()),
                    (server, client),
                ] {
                    let record = record.clone();
                    std::thread::spawn(move || relay(from, to, &record));
                }
            }
        });
        Tap { addr, seen }
    }

    fn seen(&self) -> Vec<u8> {
        self.seen.lock().unwrap().clone()
    }
}

fn relay(mut from: TcpStream, mut to: TcpStream, record: &Mutex<Vec<u8>>) {
    let _ = from.set_read_timeout(Some(Duration::from_secs(10)));
    let mut buf = [0u8; 16 << 10];
    loop {
        match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                record.lock().unwrap().extend_from_slice(&buf[..n]);
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn a_manager_serving_tls_is_reached_only_through_the_cluster_ca_and_nothing_travels_in_clear() {
    let cluster = TestCluster::start_with(ClusterOptions {
        mgr_tls: true,
        ..ClusterOptions::with_nbd()
    });
    // The OSDs booted and heartbeat over HTTPS (start_with waited for them up),
    // flame-admin creates a volume, and flame-nbd serves it.
    let secret_name = "tls-volume-name-nobody-sees";
    cluster.create_nbd_volume(secret_name, 16 * MIB);
    cluster.qemu_io(secret_name, &["write -P 0x5a 0 1M", "read -P 0x5a 0 1M"]);
    let log = std::fs::read_to_string(cluster.dir().join("mgr.log")).unwrap();
    assert!(
        log.contains(&format!("listening on https://{}", cluster.mgr_addr())),
        "the manager does not say it serves TLS:\n{log}"
    );

    // What a listener on the wire sees of flame-admin's calls: TLS records,
    // none of the requests or of the answer (the volume list).
    let tap = Tap::start(cluster.mgr_ip(), cluster.mgr_addr());
    let mut cmd = cluster.admin_command();
    cmd.args(["--mgr", &tap.addr.to_string(), "volume", "ls"]);
    let out = flame_tests::run_bounded(&mut cmd, Duration::from_secs(30));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains(secret_name),
        "flame-admin through the tap: {out:?}"
    );
    let seen = tap.seen();
    assert!(seen.len() > 1000, "the tap saw {} bytes", seen.len());
    assert_eq!(
        seen[0], 0x16,
        "the first byte is not a TLS handshake record"
    );
    for clear in [
        secret_name.as_bytes(),
        b"HTTP/1.1",
        b"/v1/",
        b"authorization",
    ] {
        assert!(
            !contains(&seen, clear),
            "`{}` crossed the wire in clear",
            String::from_utf8_lossy(clear)
        );
    }

    // A client that trusts another CA (another cluster's, for the same
    // address) refuses the manager's certificate and sends it nothing.
    let other = tempfile::tempdir().unwrap();
    flame_client::admin::tls::generate(other.path(), &[cluster.mgr_ip().to_string()]).unwrap();
    let mut cmd = cluster.admin_command();
    cmd.env("FLAME_MGR_CA", other.path().join("ca.crt")).args([
        "--mgr",
        &cluster.mgr_addr().to_string(),
        "status",
    ]);
    let out = flame_tests::run_bounded(&mut cmd, Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.to_lowercase().contains("certificate"),
        "a client trusting another CA: {out:?}"
    );

    // Plain HTTP to the TLS port gets no HTTP answer at all (not even to
    // /metrics, which a plain-HTTP manager serves unsigned).
    let mut raw = TcpStream::connect(cluster.mgr_addr()).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    raw.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n")
        .unwrap();
    let mut answer = Vec::new();
    let _ = raw.read_to_end(&mut answer);
    assert!(
        !contains(&answer, b"HTTP/"),
        "plain HTTP was answered: {}",
        String::from_utf8_lossy(&answer)
    );

    // An https:// address without a CA is refused before any connection.
    let mut cmd = cluster.admin_command();
    cmd.env_remove("FLAME_MGR_CA").args([
        "--mgr",
        &format!("https://{}", cluster.mgr_addr()),
        "status",
    ]);
    let out = flame_tests::run_bounded(&mut cmd, Duration::from_secs(30));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("needs the cluster CA"),
        "https without a CA: {out:?}"
    );
}
