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
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

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
        let bytes = crate::secret_file::read(path, "keyring", KEYRING_BYTES_MAX, true)?;
        let shown = path.display().to_string();
        let text = String::from_utf8(bytes).map_err(|e| format!("keyring {shown}: {e}"))?;
        Keyring::parse(&text, &shown)
    }

    /// The keyring of `entity` at `generation`, derived from the cluster secret.
    pub fn derived(secret: &SecretKey, entity: &EntityName, generation: KeyGeneration) -> Keyring {
        Keyring {
            entity: KeyringEntity::Entity(entity.clone(), generation),
            key: secret.derive_entity_key(entity, generation),
        }
    }

    /// Writes the keyring to a new file `path` with mode 0600 from its creation,
    /// durably. Never replaces an existing file (a lost key cannot be recovered).
    pub fn save(&self, path: &Path) -> Result<(), String> {
        crate::secret_file::write_new(path, "keyring", self.to_text().as_bytes(), 0o600)
    }

    /// Creates a new cluster's keys in `dir` (created with mode 0700 if missing):
    /// a fresh cluster secret in `cluster.keyring` and, derived from it,
    /// `client.admin.keyring` at generation 1. (Each OSD gets a key of its own,
    /// `osd.N`, once the manager runs: `flame-admin auth add osd.N`.) Refuses before
    /// writing anything if any of them exists (a half-written set would mix two
    /// secrets). Returns the secret and the files written, cluster first.
    pub fn init_cluster(dir: &Path) -> Result<(SecretKey, Vec<(KeyringEntity, PathBuf)>), String> {
        if !dir.exists() {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                .map_err(|e| format!("cannot chmod {}: {e}", dir.display()))?;
        }
        let names = ["cluster", EntityName::ADMIN];
        for name in names {
            let p = dir.join(format!("{name}.keyring"));
            if p.exists() {
                return Err(format!(
                    "{} already exists: this directory holds a cluster's keys already; \
                     not overwriting them (a lost cluster secret locks every entity out)",
                    p.display()
                ));
            }
        }
        let secret = SecretKey::random()?;
        let mut written = Vec::new();
        for name in names {
            let keyring = match EntityName::parse(name) {
                Ok(entity) => Keyring::derived(&secret, &entity, 1),
                Err(_) => Keyring {
                    entity: KeyringEntity::Cluster,
                    key: secret.clone(),
                },
            };
            let path = dir.join(format!("{name}.keyring"));
            keyring.save(&path)?;
            written.push((keyring.entity, path));
        }
        Ok((secret, written))
    }

    /// The entity name and generation, or an error for the cluster secret (which
    /// signs nothing itself).
    pub fn signer(&self, what: &str) -> Result<(EntityName, KeyGeneration), String> {
        match &self.entity {
            KeyringEntity::Entity(name, g) => Ok((name.clone(), *g)),
            KeyringEntity::Cluster => Err(format!(
                "keyring {what} holds the cluster secret, not an entity's key; give the \
                 keyring of an entity (e.g. client.admin.keyring or osd.3.keyring)"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::MetadataExt;

    #[test]
    fn round_trip_and_refusals() {
        let dir = tempfile::tempdir().unwrap();
        let k = Keyring {
            entity: KeyringEntity::Entity(EntityName::admin(), 3),
            key: SecretKey::random().unwrap(),
        };
        let p = dir.path().join("a.keyring");
        k.save(&p).unwrap();
        let mode = std::fs::metadata(&p).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let back = Keyring::load(&p).unwrap();
        assert_eq!(back.entity, k.entity);
        assert_eq!(back.key.to_hex(), k.key.to_hex());
        assert!(k.save(&p).unwrap_err().contains("already exists"));

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
    fn a_new_clusters_keys_derive_from_its_secret_and_are_never_overwritten() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().join("keys");
        let (secret, written) = Keyring::init_cluster(&d).unwrap();
        assert_eq!(std::fs::metadata(&d).unwrap().mode() & 0o777, 0o700);
        assert_eq!(written.len(), 2);
        assert_eq!(written[0].0, KeyringEntity::Cluster);
        for (entity, path) in &written {
            let k = Keyring::load(path).unwrap();
            assert_eq!(&k.entity, entity);
            let want = match entity {
                KeyringEntity::Cluster => secret.to_hex(),
                KeyringEntity::Entity(e, g) => secret.derive_entity_key(e, *g).to_hex(),
            };
            assert_eq!(k.key.to_hex(), want);
        }
        std::fs::remove_file(d.join("client.admin.keyring")).unwrap();
        let e = Keyring::init_cluster(&d).unwrap_err();
        assert!(e.contains("cluster.keyring already exists"), "{e}");
        assert!(
            !d.join("client.admin.keyring").exists(),
            "nothing written after a refusal"
        );
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
