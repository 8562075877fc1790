//! `flame-admin tls init`: a cluster's certificate authority and the
//! manager's certificate (offline, like `auth init`), for TLS on the
//! manager's API ([`flame_common::tls`]); `flame-admin tls issue`: another
//! server certificate from that CA (a second manager, a new address).

use super::{AdminError, Result, json, table};
use crate::nbd::client_cert::ClientClaims;
use flame_common::auth::{EntityName, VolumePatterns};
use flame_common::tls::{CA_CERT_FILE, CA_KEY_FILE, MGR_CERT_FILE, MGR_KEY_FILE};
use serde::Serialize;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// `flame-admin tls …`
#[derive(clap::Subcommand, Debug)]
pub enum TlsCommand {
    /// Create the cluster's CA and the manager's certificate in DIR (offline,
    /// once): ca.crt (what every client trusts: `mgr_tls_ca`, `--mgr-ca`),
    /// ca.key, mgr.crt and mgr.key (the manager's `tls:`). DIR is created with
    /// mode 0700; the keys are 0600; nothing is ever overwritten.
    Init {
        /// Directory to write them to.
        #[arg(long)]
        dir: PathBuf,
        /// An address or DNS name clients reach the manager by (repeat for
        /// each; at least one).
        #[arg(long = "name", required = true)]
        names: Vec<String>,
    },
    /// Issue another server certificate from the CA in DIR (its ca.crt and
    /// ca.key): AS.crt and AS.key in DIR, for a second manager or a manager
    /// reached by a new address. Nothing is ever overwritten.
    Issue {
        /// Directory holding ca.crt and ca.key; the new files go there too.
        #[arg(long)]
        dir: PathBuf,
        /// File name stem of the new certificate and key (letters, digits,
        /// `.`, `-`, `_`): `--as mgr2` writes mgr2.crt and mgr2.key.
        #[arg(long = "as")]
        stem: String,
        /// An address or DNS name clients reach that server by (repeat for
        /// each; at least one).
        #[arg(long = "name", required = true)]
        names: Vec<String>,
    },
    /// Issue a client certificate from the CA in DIR for an NBD client (QEMU
    /// `tls-creds-x509`, libnbd `nbds://`): ENTITY.crt and ENTITY.key in DIR,
    /// bound to the entity and the volumes it may open (read-only with
    /// --read-only). flame-nbd admits it on a TLS export and serves it
    /// nothing else. Valid for --days (default 90): issue a new one before.
    Client {
        /// Directory holding ca.crt and ca.key; the new files go there too.
        #[arg(long)]
        dir: PathBuf,
        /// `client.NAME`.
        #[arg(value_parser = entity_arg)]
        entity: EntityName,
        /// Volumes it may open: names or `prefix*`, comma-separated (`*`:
        /// every volume).
        #[arg(long, value_parser = volumes_arg)]
        volumes: VolumePatterns,
        /// Only reads: the export is read-only and writes fail with EPERM.
        #[arg(long)]
        read_only: bool,
        /// Days it is valid, from now (1..=825).
        #[arg(long, default_value_t = 90)]
        days: u32,
    },
}

fn entity_arg(s: &str) -> std::result::Result<EntityName, String> {
    let e = EntityName::parse(s)?;
    if !s.starts_with("client.") {
        return Err(format!(
            "`{s}`: a client certificate is for a client.NAME entity"
        ));
    }
    Ok(e)
}

fn volumes_arg(s: &str) -> std::result::Result<VolumePatterns, String> {
    // An empty list would grant every volume (`--volumes "$UNSET"`): say `*`.
    if s.trim().is_empty() {
        return Err("an empty list: name the volumes, or `*` for every volume".into());
    }
    VolumePatterns::parse_list(s)
}

/// Longest validity of a client certificate (what browsers allow servers).
pub const CLIENT_CERT_DAYS_MAX: u32 = 825;

/// Runs `tls init` or `tls issue`.
pub fn init(cmd: &TlsCommand, as_json: bool) -> Result<String> {
    let (dir, files, cert, key, issued) = match cmd {
        TlsCommand::Init { dir, names } => (
            dir,
            generate(dir, names).map_err(AdminError)?,
            MGR_CERT_FILE.to_string(),
            MGR_KEY_FILE.to_string(),
            false,
        ),
        TlsCommand::Issue { dir, stem, names } => (
            dir,
            issue(dir, stem, names).map_err(AdminError)?,
            format!("{stem}.crt"),
            format!("{stem}.key"),
            true,
        ),
        TlsCommand::Client {
            dir,
            entity,
            volumes,
            read_only,
            days,
        } => {
            let claims = ClientClaims {
                entity: entity.clone(),
                volumes: volumes.clone(),
                read_only: *read_only,
            };
            let files = issue_client(dir, &claims, *days).map_err(AdminError)?;
            if as_json {
                return json(&files);
            }
            let d = dir.display();
            return Ok(format!(
                "{}\nNext: give the client {d}/{CA_CERT_FILE} and these two files. QEMU: \
                 --object tls-creds-x509,id=tls0,dir=DIR,endpoint=client (DIR holding them as \
                 ca-cert.pem, client-cert.pem, client-key.pem); libnbd: \
                 nbds://HOST:PORT/VOLUME?tls-certificates=DIR. It opens {} ({}).\n",
                files_table(&files),
                claims.volumes,
                if claims.read_only {
                    "read-only"
                } else {
                    "read and write"
                }
            ));
        }
    };
    #[derive(Serialize)]
    struct Written {
        file: PathBuf,
    }
    if as_json {
        let w: Vec<Written> = files.into_iter().map(|file| Written { file }).collect();
        return json(&w);
    }
    let d = dir.display();
    let next = if issued {
        format!(
            "Next: set `tls: {{cert_file: {d}/{cert}, key_file: {d}/{key}}}` in the config of \
             the manager it is for. Clients already trust {d}/{CA_CERT_FILE}: nothing changes \
             for them. Keep {CA_KEY_FILE} offline.\n"
        )
    } else {
        format!(
            "Next: set `tls: {{cert_file: {d}/{cert}, key_file: {d}/{key}}}` in \
             the manager's config, copy {d}/{CA_CERT_FILE} to every host and set \
             `mgr_tls_ca: …/{CA_CERT_FILE}` in the OSD, flame-nbd and flame-ublk configs \
             (flame-admin: --mgr-ca or FLAME_MGR_CA). Keep {CA_KEY_FILE} offline.\n"
        )
    };
    Ok(format!("{}\n{next}", files_table(&files)))
}

/// The files written, as a table.
fn files_table(files: &[PathBuf]) -> String {
    table(
        &["FILE"],
        &files
            .iter()
            .map(|f| vec![f.display().to_string()])
            .collect::<Vec<_>>(),
    )
}

/// The manager's certificate: `names` are every address or DNS name clients
/// reach it by.
fn server_params(names: &[String]) -> std::result::Result<rcgen::CertificateParams, String> {
    if names.is_empty() {
        return Err("the manager's certificate needs at least one address or name".into());
    }
    let mut mgr = rcgen::CertificateParams::new(names.to_vec())
        .map_err(|e| format!("the certificate's names: {e}"))?;
    mgr.distinguished_name
        .push(rcgen::DnType::CommonName, "flame-mgr");
    mgr.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    Ok(mgr)
}

/// Writes `contents` (text, whether secret) to `files`, certificates 0644 and
/// keys 0600, never over an existing file.
fn write_all(files: &[PathBuf], contents: Vec<(String, bool)>) -> std::result::Result<(), String> {
    for (path, (text, secret)) in files.iter().zip(contents) {
        let (what, mode) = if secret {
            ("private key", 0o600)
        } else {
            ("certificate", 0o644)
        };
        flame_common::secret_file::write_new(path, what, text.as_bytes(), mode)?;
    }
    Ok(())
}

/// Refuses, before anything is written, if one of `files` exists.
fn refuse_existing(files: &[PathBuf]) -> std::result::Result<(), String> {
    match files.iter().find(|f| f.exists()) {
        Some(f) => Err(format!(
            "{} already exists; not overwriting a certificate or key (move it away first)",
            f.display()
        )),
        None => Ok(()),
    }
}

/// Issues a server certificate for `names` from the CA in `dir` (`ca.crt`,
/// `ca.key`) into `dir/STEM.crt` and `dir/STEM.key`. Refuses before writing
/// anything if either exists. Returns the files written.
pub fn issue(
    dir: &Path,
    stem: &str,
    names: &[String],
) -> std::result::Result<Vec<PathBuf>, String> {
    let stem_ok = !stem.is_empty()
        && stem.len() <= 64
        && !stem.starts_with('.')
        && stem
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
    if !stem_ok || stem == "ca" {
        return Err(format!(
            "--as {stem:?}: a file name stem of letters, digits, '.', '-' and '_' (not 'ca'), like mgr2"
        ));
    }
    let params = server_params(names)?;
    let files = vec![
        dir.join(format!("{stem}.crt")),
        dir.join(format!("{stem}.key")),
    ];
    sign_with_ca(dir, params, files)
}

/// Issues a client certificate for `claims` from the CA in `dir` into
/// `dir/ENTITY.crt` and `dir/ENTITY.key`, valid for `days` from now
/// ([`ClientClaims`] says what it carries). Refuses before writing anything
/// if either exists.
pub fn issue_client(
    dir: &Path,
    claims: &ClientClaims,
    days: u32,
) -> std::result::Result<Vec<PathBuf>, String> {
    if days == 0 || days > CLIENT_CERT_DAYS_MAX {
        return Err(format!(
            "--days {days}: between 1 and {CLIENT_CERT_DAYS_MAX}"
        ));
    }
    let uri = rcgen::string::Ia5String::try_from(claims.caps_uri())
        .map_err(|e| format!("the capabilities URI: {e}"))?;
    let mut params = rcgen::CertificateParams::default();
    params.subject_alt_names = vec![rcgen::SanType::URI(uri)];
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, claims.entity.to_string());
    params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let now_s = (flame_common::clock::unix_ms() / 1000) as i64;
    let at =
        |s: i64| time::OffsetDateTime::from_unix_timestamp(s).map_err(|e| format!("the date: {e}"));
    // An hour back, for clocks a little behind the issuer's.
    params.not_before = at(now_s - 3600)?;
    params.not_after = at(now_s + i64::from(days) * 86_400)?;
    let files = vec![
        dir.join(format!("{}.crt", claims.entity)),
        dir.join(format!("{}.key", claims.entity)),
    ];
    sign_with_ca(dir, params, files)
}

/// Signs `params` with the CA in `dir` (its `ca.crt` and `ca.key`) and writes
/// the certificate and its new key to `files` (`[cert, key]`), refusing
/// before anything is written if either exists.
fn sign_with_ca(
    dir: &Path,
    params: rcgen::CertificateParams,
    files: Vec<PathBuf>,
) -> std::result::Result<Vec<PathBuf>, String> {
    refuse_existing(&files)?;
    let ca_cert_path = dir.join(CA_CERT_FILE);
    let ca_key_path = dir.join(CA_KEY_FILE);
    let ca_pem = flame_common::tls::read_pem(&ca_cert_path, "CA certificate", false)?;
    let ca_key_pem = flame_common::tls::read_pem(&ca_key_path, "CA private key", true)?;
    let text = |b: Vec<u8>, path: &Path| {
        String::from_utf8(b).map_err(|_| format!("{}: not PEM text", path.display()))
    };
    let ca_key = rcgen::KeyPair::from_pem(&text(ca_key_pem, &ca_key_path)?)
        .map_err(|e| format!("{}: not a private key: {e}", ca_key_path.display()))?;
    let issuer = rcgen::Issuer::from_ca_cert_pem(&text(ca_pem, &ca_cert_path)?, &ca_key)
        .map_err(|e| format!("{}: not a CA certificate: {e}", ca_cert_path.display()))?;
    let gen_err = |e: rcgen::Error| format!("generating the certificate: {e}");
    let key = rcgen::KeyPair::generate().map_err(gen_err)?;
    let cert = params.signed_by(&key, &issuer).map_err(gen_err)?;
    // The key first: a failure then leaves no certificate without its key.
    write_all(&files[1..], vec![(key.serialize_pem(), true)])?;
    write_all(&files[..1], vec![(cert.pem(), false)])?;
    Ok(files)
}

/// Creates a cluster CA and a manager certificate it signs, valid for
/// `names` (IP addresses or DNS names: every address clients reach the
/// manager by), in `dir` (created 0700 if missing): `ca.crt`, `ca.key`,
/// `mgr.crt`, `mgr.key`. Refuses before writing
/// anything if any exists. Returns the files written.
pub fn generate(dir: &Path, names: &[String]) -> std::result::Result<Vec<PathBuf>, String> {
    let mgr = server_params(names)?;
    let files: Vec<PathBuf> = [CA_CERT_FILE, CA_KEY_FILE, MGR_CERT_FILE, MGR_KEY_FILE]
        .iter()
        .map(|f| dir.join(f))
        .collect();
    refuse_existing(&files)?;
    if !dir.exists() {
        std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    let gen_err = |e: rcgen::Error| format!("generating the certificates: {e}");
    let ca_key = rcgen::KeyPair::generate().map_err(gen_err)?;
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(gen_err)?;
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, "Flame cluster CA");
    ca.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
    ];
    let ca_cert = ca.self_signed(&ca_key).map_err(gen_err)?;
    let issuer = rcgen::Issuer::new(ca, &ca_key);

    let mgr_key = rcgen::KeyPair::generate().map_err(gen_err)?;
    let mgr_cert = mgr.signed_by(&mgr_key, &issuer).map_err(gen_err)?;
    write_all(
        &files,
        vec![
            (ca_cert.pem(), false),
            (ca_key.serialize_pem(), true),
            (mgr_cert.pem(), false),
            (mgr_key.serialize_pem(), true),
        ],
    )?;
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::tls::{MgrTrust, server_config};
    use std::os::unix::fs::MetadataExt;
    use std::sync::Arc;

    /// Whether `cert` is valid for `name` under the CA `ca` (what a client
    /// trusting only that CA checks).
    fn verifies(ca: &Path, cert: &Path, name: &str) -> std::result::Result<(), String> {
        use rustls::client::danger::ServerCertVerifier;
        use rustls::pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls::pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
            roots.add(c.unwrap()).unwrap();
        }
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            flame_common::tls::provider(),
        )
        .build()
        .unwrap();
        let end = rustls::pki_types::CertificateDer::from_pem_file(cert).unwrap();
        verifier
            .verify_server_cert(
                &end,
                &[],
                &rustls::pki_types::ServerName::try_from(name.to_string()).unwrap(),
                &[],
                rustls::pki_types::UnixTime::now(),
            )
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// `tls issue` signs with the CA of `tls init`: a client trusting only
    /// that CA accepts the new certificate for its names and no other, and
    /// refuses one from another cluster's CA.
    #[test]
    fn an_issued_certificate_chains_to_the_cluster_ca() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("tls");
        generate(&dir, &["127.0.0.1".into()]).unwrap();
        issue(&dir, "mgr2", &["127.0.0.2".into(), "mgr2.example".into()]).unwrap();
        let ca = dir.join(CA_CERT_FILE);
        verifies(&ca, &dir.join("mgr2.crt"), "127.0.0.2").unwrap();
        verifies(&ca, &dir.join("mgr2.crt"), "mgr2.example").unwrap();
        verifies(&ca, &dir.join(MGR_CERT_FILE), "127.0.0.1").unwrap();
        let e = verifies(&ca, &dir.join("mgr2.crt"), "127.0.0.1").unwrap_err();
        assert!(e.contains("not valid for name"), "{e}");
        let other = tmp.path().join("other");
        generate(&other, &["127.0.0.2".into()]).unwrap();
        assert!(verifies(&ca, &other.join(MGR_CERT_FILE), "127.0.0.2").is_err());
        // Bad stems, no names, no CA.
        for stem in ["", "ca", "../x", ".hidden", "a/b"] {
            assert!(
                issue(&dir, stem, &["127.0.0.3".into()]).is_err(),
                "{stem:?}"
            );
        }
        assert!(issue(&dir, "mgr3", &[]).is_err());
        let e = issue(&tmp.path().join("none"), "mgr3", &["127.0.0.3".into()]).unwrap_err();
        assert!(e.contains("ca.crt"), "{e}");
        // A CA key others can read is refused.
        std::fs::set_permissions(
            dir.join(CA_KEY_FILE),
            std::fs::Permissions::from_mode(0o644),
        )
        .unwrap();
        let e = issue(&dir, "mgr3", &["127.0.0.3".into()]).unwrap_err();
        assert!(e.contains("chmod 600"), "{e}");
        assert!(!dir.join("mgr3.crt").exists());
    }

    #[test]
    fn a_generated_ca_and_certificate_load_and_are_never_overwritten() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("tls");
        let files = generate(&dir, &["127.0.0.1".into(), "mgr.example".into()]).unwrap();
        assert_eq!(files.len(), 4);
        assert_eq!(std::fs::metadata(&dir).unwrap().mode() & 0o777, 0o700);
        for (f, mode) in files.iter().zip([0o644, 0o600, 0o644, 0o600]) {
            assert_eq!(std::fs::metadata(f).unwrap().mode() & 0o777, mode, "{f:?}");
        }
        server_config(&dir.join(MGR_CERT_FILE), &dir.join(MGR_KEY_FILE)).unwrap();
        MgrTrust::load(&dir.join(CA_CERT_FILE)).unwrap();
        let again = generate(&dir, &["127.0.0.1".into()]).unwrap_err();
        assert!(again.contains("already exists"), "{again}");
        // Another server certificate from the same CA.
        let more = issue(&dir, "mgr2", &["127.0.0.2".into()]).unwrap();
        assert_eq!(more, vec![dir.join("mgr2.crt"), dir.join("mgr2.key")]);
        assert_eq!(std::fs::metadata(&more[1]).unwrap().mode() & 0o777, 0o600);
        server_config(&more[0], &more[1]).unwrap();
        let again = issue(&dir, "mgr2", &["127.0.0.2".into()]).unwrap_err();
        assert!(again.contains("already exists"), "{again}");
        assert!(generate(&tmp.path().join("x"), &[]).is_err());
        // A manager key others can read is refused.
        let key = dir.join(MGR_KEY_FILE);
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = server_config(&dir.join(MGR_CERT_FILE), &key).unwrap_err();
        assert!(e.contains("chmod 600"), "{e}");
    }
}
