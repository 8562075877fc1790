//! TLS on the manager's API: the cluster's certificate authority, the
//! manager's certificate, and what a client trusts.
//!
//! Requests and answers are signed with the entities' keys whether or not TLS
//! is on ([`crate::auth`]), so integrity and authenticity never depend on it;
//! TLS adds confidentiality (the map, volume names, who asks what) and keeps a
//! passive listener from learning anything. The cluster has its own CA
//! (`flame-admin tls init`): the manager serves a certificate it
//! signed for the manager's addresses, and every client trusts that CA only —
//! never the system's roots — through `mgr_tls_ca` (OSD and client configs) or
//! `--mgr-ca` / `FLAME_MGR_CA` (flame-admin). A manager group later gets one
//! certificate per manager from the same CA.
//!
//! One crypto provider, ring, chosen explicitly ([`provider`]): no process-wide
//! default to race over, and no C toolchain beyond `cc` to build it.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
#[cfg(test)]
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Bytes of a certificate or key file read at most (a CA and a chain are a few
/// KiB): a wrong path to a large file is an error, not a read of all of it.
pub const PEM_FILE_BYTES_MAX: u64 = 256 << 10;

/// The crypto provider every TLS config of Flame uses. rustls deprecates
/// ring's provider for lacking post-quantum key exchange; aws-lc-rs has it but
/// builds a large C library on every fresh machine. The manager's API carries
/// no long-lived secret (keys never cross it; the service key goes sealed), so
/// classical key exchange is what it needs today: revisit with aws-lc-rs.
#[allow(deprecated)]
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads a PEM file of at most [`PEM_FILE_BYTES_MAX`] bytes; with `secret`,
/// refuses one group or others may access (as keyrings are).
pub fn read_pem(path: &Path, what: &str, secret: bool) -> Result<Vec<u8>, String> {
    crate::secret_file::read(path, what, PEM_FILE_BYTES_MAX, secret)
}

/// Every certificate of a PEM file (`what` names it in errors); at least one.
fn certificates(path: &Path, what: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = read_pem(path, what, false)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{what} {}: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{what} {} holds no certificate (expected PEM `BEGIN CERTIFICATE`)",
            path.display()
        ));
    }
    Ok(certs)
}

/// What a client trusts for the manager's certificate: the cluster CA, and
/// nothing else (not the system's roots).
#[derive(Clone)]
pub struct MgrTrust {
    /// The file it came from, for messages.
    pub path: PathBuf,
    certs: Vec<ureq::tls::Certificate<'static>>,
}

impl std::fmt::Debug for MgrTrust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MgrTrust")
            .field("path", &self.path)
            .finish()
    }
}

impl MgrTrust {
    /// Loads the CA certificate(s) of `path` (PEM).
    pub fn load(path: &Path) -> Result<MgrTrust, String> {
        let certs = certificates(path, "manager CA")?;
        // Each must be a certificate rustls accepts as a root, checked now
        // rather than at the first connection.
        let mut roots = rustls::RootCertStore::empty();
        for c in &certs {
            roots
                .add(c.clone())
                .map_err(|e| format!("manager CA {}: {e}", path.display()))?;
        }
        Ok(MgrTrust {
            path: path.to_path_buf(),
            certs: certs
                .iter()
                .map(|c| ureq::tls::Certificate::from_der(c.as_ref()).to_owned())
                .collect(),
        })
    }
}

/// The TLS settings of an HTTP agent: the trusted CA when given (`https://`
/// is verified against it only), else no root at all (any `https://` fails
/// with an error instead of reaching ureq's absent default roots), and always
/// Flame's crypto provider.
pub fn agent_tls_config(trust: Option<&MgrTrust>) -> ureq::tls::TlsConfig {
    let roots = trust.map_or(&[][..], |t| &t.certs[..]);
    ureq::tls::TlsConfig::builder()
        .unversioned_rustls_crypto_provider(provider())
        .root_certs(ureq::tls::RootCerts::new_with_certs(roots))
        .build()
}

/// The manager's TLS server configuration from its certificate chain and
/// private key (PEM files; the key must be mode 0600).
pub fn server_config(
    cert_file: &Path,
    key_file: &Path,
) -> Result<Arc<rustls::ServerConfig>, String> {
    server_config_with(cert_file, key_file, None)
}

/// flame-nbd's TLS server configuration: its certificate and key (as
/// [`server_config`]), and the CA whose certificates clients must present
/// (mandatory client authentication: a client without one fails the
/// handshake). No session resumption: NBD clients hold one long connection,
/// and every connection's certificate is checked.
pub fn client_auth_server_config(
    cert_file: &Path,
    key_file: &Path,
    client_ca_file: &Path,
) -> Result<Arc<rustls::ServerConfig>, String> {
    server_config_with(cert_file, key_file, Some(client_ca_file))
}

fn server_config_with(
    cert_file: &Path,
    key_file: &Path,
    client_ca_file: Option<&Path>,
) -> Result<Arc<rustls::ServerConfig>, String> {
    let chain = certificates(cert_file, "server certificate")?;
    let pem = read_pem(key_file, "server private key", true)?;
    let key = PrivateKeyDer::from_pem_slice(&pem)
        .map_err(|e| format!("server private key {}: {e}", key_file.display()))?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS: {e}"))?;
    let builder = match client_ca_file {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in certificates(ca, "client CA")? {
                roots
                    .add(c)
                    .map_err(|e| format!("client CA {}: {e}", ca.display()))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider(),
            )
            .build()
            .map_err(|e| format!("client CA {}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(chain, key).map_err(|e| {
        format!(
            "certificate {} and key {}: {e}",
            cert_file.display(),
            key_file.display()
        )
    })?;
    if client_ca_file.is_some() {
        // No resumption at all (no TLS 1.3 tickets, no TLS 1.2 session ids):
        // a resumed session would carry the client certificate of the first
        // handshake without checking it again (its expiry included).
        config.send_tls13_tickets = 0;
        config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    }
    Ok(Arc::new(config))
}

/// The files `flame-admin tls init` writes in its directory: the CA's
/// certificate, what every client trusts.
pub const CA_CERT_FILE: &str = "ca.crt";
/// The CA's private key (mode 0600): only to issue more manager certificates.
pub const CA_KEY_FILE: &str = "ca.key";
/// The manager's certificate, signed by the CA.
pub const MGR_CERT_FILE: &str = "mgr.crt";
/// The manager's private key (mode 0600).
pub const MGR_KEY_FILE: &str = "mgr.key";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_files_are_clear_errors() {
        let tmp = tempfile::tempdir().unwrap();
        let junk = tmp.path().join("junk.pem");
        std::fs::write(&junk, b"not a certificate").unwrap();
        let e = MgrTrust::load(&junk).unwrap_err();
        assert!(e.contains("no certificate"), "{e}");
        let e = MgrTrust::load(&tmp.path().join("missing")).unwrap_err();
        assert!(e.contains("missing"), "{e}");
        let e = MgrTrust::load(tmp.path()).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
        let big = tmp.path().join("big.pem");
        std::fs::write(&big, vec![b'a'; PEM_FILE_BYTES_MAX as usize + 1]).unwrap();
        let e = MgrTrust::load(&big).unwrap_err();
        assert!(e.contains("larger than"), "{e}");
        let key = tmp.path().join("key.pem");
        std::fs::write(
            &key,
            b"-----BEGIN PRIVATE KEY-----\n-----END PRIVATE KEY-----\n",
        )
        .unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = server_config(&junk, &key).unwrap_err();
        assert!(e.contains("no certificate"), "{e}");
    }
}
