//! `flame-admin tls init`: a cluster's certificate authority and the
//! manager's certificate (offline, like `auth init`), for TLS on the
//! manager's API ([`flame_common::tls`]).

use super::{AdminError, Result, json, table};
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
}

/// Runs `tls init`.
pub fn init(cmd: &TlsCommand, as_json: bool) -> Result<String> {
    let TlsCommand::Init { dir, names } = cmd;
    let files = generate(dir, names).map_err(AdminError)?;
    #[derive(Serialize)]
    struct Written {
        file: PathBuf,
    }
    if as_json {
        let w: Vec<Written> = files.into_iter().map(|file| Written { file }).collect();
        return json(&w);
    }
    let d = dir.display();
    Ok(format!(
        "{}\nNext: set `tls: {{cert_file: {d}/{MGR_CERT_FILE}, key_file: {d}/{MGR_KEY_FILE}}}` in \
         the manager's config, copy {d}/{CA_CERT_FILE} to every host and set \
         `mgr_tls_ca: …/{CA_CERT_FILE}` in the OSD, flame-nbd and flame-ublk configs \
         (flame-admin: --mgr-ca or FLAME_MGR_CA). Keep {CA_KEY_FILE} offline.\n",
        table(
            &["FILE"],
            &files
                .iter()
                .map(|f| vec![f.display().to_string()])
                .collect::<Vec<_>>()
        )
    ))
}

/// Creates a cluster CA and a manager certificate it signs, valid for
/// `names` (IP addresses or DNS names: every address clients reach the
/// manager by), in `dir` (created 0700 if missing): `ca.crt`, `ca.key`,
/// `mgr.crt`, `mgr.key`. Refuses before writing
/// anything if any exists. Returns the files written.
pub fn generate(dir: &Path, names: &[String]) -> std::result::Result<Vec<PathBuf>, String> {
    if names.is_empty() {
        return Err("the manager's certificate needs at least one address or name".into());
    }
    let files: Vec<PathBuf> = [CA_CERT_FILE, CA_KEY_FILE, MGR_CERT_FILE, MGR_KEY_FILE]
        .iter()
        .map(|f| dir.join(f))
        .collect();
    if let Some(f) = files.iter().find(|f| f.exists()) {
        return Err(format!(
            "{} already exists; not overwriting a certificate or key (move it away first)",
            f.display()
        ));
    }
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
    let mut mgr = rcgen::CertificateParams::new(names.to_vec()).map_err(gen_err)?;
    mgr.distinguished_name
        .push(rcgen::DnType::CommonName, "flame-mgr");
    mgr.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    let mgr_cert = mgr.signed_by(&mgr_key, &issuer).map_err(gen_err)?;

    let contents = [
        (ca_cert.pem(), false),
        (ca_key.serialize_pem(), true),
        (mgr_cert.pem(), false),
        (mgr_key.serialize_pem(), true),
    ];
    for (path, (text, secret)) in files.iter().zip(contents) {
        let (what, mode) = if secret {
            ("private key", 0o600)
        } else {
            ("certificate", 0o644)
        };
        flame_common::secret_file::write_new(path, what, text.as_bytes(), mode)?;
    }
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::tls::{MgrTrust, server_config};
    use std::os::unix::fs::MetadataExt;

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
        assert!(generate(&tmp.path().join("x"), &[]).is_err());
        // A manager key others can read is refused.
        let key = dir.join(MGR_KEY_FILE);
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = server_config(&dir.join(MGR_CERT_FILE), &key).unwrap_err();
        assert!(e.contains("chmod 600"), "{e}");
    }
}
