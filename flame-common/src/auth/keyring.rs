//! Keyring files: one key per file, readable by its owner only.
//!
//! ```yaml
//! # Flame keyring: a secret. Mode 0600; never copy it to a shared place.
//! entity: client.admin
//! generation: 1
//! key: 3f1c…(64 hex digits)
//! ```
//!
//! `entity: cluster` is the cluster secret (the manager's; it has no generation).

use super::{EntityName, KeyGeneration, SecretKey};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Largest keyring file read: a real one is under 200 bytes.
pub const KEYRING_BYTES_MAX: u64 = 4 << 10;

/// Whose key a keyring holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyringEntity {
    /// The cluster secret, from which every entity key is derived.
    Cluster,
    /// One entity's key at one generation.
    Entity(EntityName, KeyGeneration),
}

/// A loaded keyring.
#[derive(Clone, Debug)]
pub struct Keyring {
    /// Whose key it is.
    pub entity: KeyringEntity,
    /// The key.
    pub key: SecretKey,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyringFile {
    entity: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    generation: Option<KeyGeneration>,
    key: String,
}

const HEADER: &str = "# Flame keyring: a secret. Mode 0600; never copy it to a shared place.\n";

impl Keyring {
    /// Parses a keyring's text (`what` names it in errors).
    pub fn parse(text: &str, what: &str) -> Result<Keyring, String> {
        let file: KeyringFile = serde_norway::from_str(text)
            .map_err(|e| format!("keyring {what} is not a keyring: {e}"))?;
        let key = SecretKey::from_hex(&file.key).map_err(|e| format!("keyring {what}: {e}"))?;
        let entity = if file.entity == "cluster" {
            if file.generation.is_some() {
                return Err(format!(
                    "keyring {what}: the cluster secret has no generation"
                ));
            }
            KeyringEntity::Cluster
        } else {
            let name =
                EntityName::parse(&file.entity).map_err(|e| format!("keyring {what}: {e}"))?;
            let generation = file.generation.ok_or_else(|| {
                format!("keyring {what}: `generation` is missing (the key of `{name}` needs one)")
            })?;
            if generation == 0 {
                return Err(format!("keyring {what}: generations start at 1"));
            }
            KeyringEntity::Entity(name, generation)
        };
        Ok(Keyring { entity, key })
    }

    /// The file's text.
    pub fn to_text(&self) -> String {
        let (entity, generation) = match &self.entity {
            KeyringEntity::Cluster => ("cluster".to_string(), None),
            KeyringEntity::Entity(name, g) => (name.to_string(), Some(*g)),
        };
        let body = serde_norway::to_string(&KeyringFile {
            entity,
            generation,
            key: self.key.to_hex(),
        })
        .unwrap_or_default();
        format!("{HEADER}{body}")
    }

    /// Reads a keyring file, refusing one that group or others may access (a key
    /// others can read is no longer a secret) or that is not a regular file.
    pub fn load(path: &Path) -> Result<Keyring, String> {
        let shown = path.display();
        let file = std::fs::File::open(path).map_err(|e| format!("keyring {shown}: {e}"))?;
        let meta = file
            .metadata()
            .map_err(|e| format!("keyring {shown}: {e}"))?;
        if !meta.is_file() {
            return Err(format!("keyring {shown} is not a regular file"));
        }
        let mode = meta.mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(format!(
                "keyring {shown} is accessible by group or others (mode {mode:04o}); \
                 a key others can read is not a secret: run `chmod 600 {shown}`"
            ));
        }
        let mut text = String::new();
        file.take(KEYRING_BYTES_MAX + 1)
            .read_to_string(&mut text)
            .map_err(|e| format!("keyring {shown}: {e}"))?;
        if text.len() as u64 > KEYRING_BYTES_MAX {
            return Err(format!(
                "keyring {shown} is larger than {KEYRING_BYTES_MAX} bytes: not a keyring"
            ));
        }
        Keyring::parse(&text, &shown.to_string())
    }

    /// Writes the keyring to `path` with mode 0600, durably. Refuses to replace an
    /// existing file unless `replace` (a lost key cannot be recovered).
    pub fn save(&self, path: &Path, replace: bool) -> Result<(), String> {
        let shown = path.display();
        let write = |target: &Path, create_new: bool| -> std::io::Result<()> {
            let mut opts = std::fs::OpenOptions::new();
            opts.write(true).mode(0o600);
            if create_new {
                opts.create_new(true);
            } else {
                opts.create(true).truncate(true);
            }
            let mut f = opts.open(target)?;
            // The mode of `open` is masked by the umask and ignored for an existing
            // file: set it explicitly.
            f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
            f.write_all(self.to_text().as_bytes())?;
            f.sync_all()
        };
        if !replace {
            return write(path, true).map_err(|e| match e.kind() {
                std::io::ErrorKind::AlreadyExists => format!(
                    "keyring {shown} already exists; not overwriting a key (move it away first)"
                ),
                _ => format!("cannot write keyring {shown}: {e}"),
            });
        }
        let tmp = path.with_extension("keyring.tmp");
        let _ = std::fs::remove_file(&tmp);
        write(&tmp, true)
            .and_then(|()| std::fs::rename(&tmp, path))
            .map_err(|e| format!("cannot write keyring {shown}: {e}"))?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| format!("cannot sync the directory of {shown}: {e}"))?;
        }
        Ok(())
    }

    /// The entity name and generation, or an error for the cluster secret (which
    /// signs nothing itself).
    pub fn signer(&self, what: &str) -> Result<(EntityName, KeyGeneration), String> {
        match &self.entity {
            KeyringEntity::Entity(name, g) => Ok((name.clone(), *g)),
            KeyringEntity::Cluster => Err(format!(
                "keyring {what} holds the cluster secret, not an entity's key; give the \
                 keyring of an entity (e.g. client.admin.keyring or osd.keyring)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let k = Keyring {
            entity: KeyringEntity::Entity(EntityName::admin(), 3),
            key: SecretKey::random().unwrap(),
        };
        let p = dir.path().join("a.keyring");
        k.save(&p, false).unwrap();
        let mode = std::fs::metadata(&p).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let back = Keyring::load(&p).unwrap();
        assert_eq!(back.entity, k.entity);
        assert_eq!(back.key.to_hex(), k.key.to_hex());
        assert!(k.save(&p, false).unwrap_err().contains("already exists"));
        k.save(&p, true).unwrap();

        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o640)).unwrap();
        let e = Keyring::load(&p).unwrap_err();
        assert!(e.contains("chmod 600") && e.contains("0640"), "{e}");

        let c = Keyring {
            entity: KeyringEntity::Cluster,
            key: SecretKey::random().unwrap(),
        };
        let text = c.to_text();
        assert!(!text.contains("generation"));
        assert_eq!(
            Keyring::parse(&text, "x").unwrap().entity,
            KeyringEntity::Cluster
        );
        assert!(c.signer("x").unwrap_err().contains("cluster secret"));
    }

    #[test]
    fn bad_files_are_clear_errors() {
        let key = "ab".repeat(32);
        for (text, want) in [
            ("entity: client.x\nkey: 00\n", "64 hex"),
            (&*format!("entity: client.x\nkey: {key}\n"), "generation"),
            (
                &*format!("entity: client.x\ngeneration: 0\nkey: {key}\n"),
                "start at 1",
            ),
            (
                &*format!("entity: cluster\ngeneration: 1\nkey: {key}\n"),
                "no generation",
            ),
            (
                &*format!("entity: nobody\ngeneration: 1\nkey: {key}\n"),
                "client.NAME",
            ),
            (
                &*format!("entity: osd\ngeneration: 1\nkey: {key}\nx: 1\n"),
                "unknown field",
            ),
            ("entity: osd\ngeneration: 1\nkey: zz\n", "64 hex"),
            ("[1, 2]", "not a keyring"),
        ] {
            let e = Keyring::parse(text, "F").unwrap_err();
            assert!(e.contains(want) && e.contains('F'), "{text}: {e}");
        }
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big");
        std::fs::write(&big, "#".repeat(5000)).unwrap();
        std::fs::set_permissions(&big, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(Keyring::load(&big).unwrap_err().contains("larger"));
        assert!(Keyring::load(dir.path()).is_err());
        assert!(Keyring::load(&dir.path().join("none")).is_err());
    }
}
