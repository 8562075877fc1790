//! `flame-admin auth …`: a cluster's keys and entities.
//!
//! `init` runs offline (before the manager exists): it writes the cluster secret
//! and the two built-in entities' keyrings. The others ask the manager (as
//! `client.admin`) to add, rotate or remove an entity; a key itself is derived
//! locally from the cluster keyring (`key`), so no secret ever crosses the
//! network.

use super::{AdminError, Result, fields, json, table};
use crate::MgrClient;
use flame_common::auth::{
    EntityName, KeyGeneration, Keyring, KeyringEntity, Role, SecretKey, VolumePatterns,
};
use serde::Serialize;
use std::path::{Path, PathBuf};

/// `flame-admin auth …`
#[derive(clap::Subcommand, Debug)]
pub enum AuthCommand {
    /// Create a new cluster's keys in DIR (offline, once): cluster.keyring (the
    /// secret, for the manager's `keyring:`) and client.admin.keyring (for
    /// flame-admin). Each OSD then gets its own key once the manager runs
    /// (`auth add osd.N`). DIR is created with mode 0700; existing keyrings are
    /// never overwritten.
    Init {
        /// Directory to write the keyrings to.
        #[arg(long)]
        dir: PathBuf,
    },
    /// Every entity with its role and key generation.
    Ls,
    /// Add an entity: `osd.N` (OSD N's own key: it may boot, heartbeat and
    /// report only as OSD N), or `client.NAME` with role `client` (read-only:
    /// what flame-nbd and flame-ublk need) or `admin`. With --cluster-keyring
    /// and --out, also writes its keyring.
    Add {
        /// `osd.N` or `client.NAME`.
        #[arg(value_parser = entity_arg)]
        entity: EntityName,
        /// `client` or `admin` for a client (default `client`); `osd` for
        /// `osd.N` (the default, and the only role it may have).
        #[arg(long, value_parser = role_arg)]
        role: Option<Role>,
        /// The volumes it may read and write on the OSDs: names or `prefix*`,
        /// comma-separated (default: every volume).
        #[arg(long, default_value = "", value_parser = volumes_arg)]
        volumes: VolumePatterns,
        #[command(flatten)]
        write: WriteKey,
    },
    /// Set the volumes an entity may read and write (names or `prefix*`,
    /// comma-separated; `*` for every volume). Its connections opened from its
    /// next ticket on (within half an hour, or at its restart) follow them.
    Volumes {
        /// The entity.
        #[arg(value_parser = entity_arg)]
        entity: EntityName,
        /// The patterns.
        #[arg(value_parser = volumes_arg)]
        volumes: VolumePatterns,
    },
    /// Move an entity to its next key: the old key stops working at once. With
    /// --cluster-keyring and --out, also writes the new keyring.
    Rotate {
        /// The entity.
        #[arg(value_parser = entity_arg)]
        entity: EntityName,
        /// Needed to rotate `osd`, whose generation is the OSDs' service key's:
        /// every ticket issued before stops working (clients renew), OSDs with
        /// their own keys follow at their next heartbeat, and an OSD still on
        /// the shared `osd` keyring is refused by the manager until it has the
        /// new one and is restarted.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        write: WriteKey,
    },
    /// Remove an entity (not `client.admin` or `osd`): its key stops working.
    Rm {
        /// The entity.
        #[arg(value_parser = entity_arg)]
        entity: EntityName,
    },
    /// Write an entity's current keyring, derived from the cluster keyring (run
    /// where the cluster keyring is). Asks the manager for the current key
    /// generation unless --generation is given.
    Key {
        /// The entity.
        #[arg(value_parser = entity_arg)]
        entity: EntityName,
        /// The key generation (default: the manager's current one).
        #[arg(long)]
        generation: Option<KeyGeneration>,
        #[command(flatten)]
        write: WriteKey,
    },
}

/// Where to derive a keyring from and write it to.
#[derive(clap::Args, Debug, Default)]
pub struct WriteKey {
    /// The cluster keyring (`auth init`'s cluster.keyring).
    #[arg(long)]
    pub cluster_keyring: Option<PathBuf>,
    /// The keyring file to write (mode 0600; refuses to overwrite).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

fn entity_arg(s: &str) -> std::result::Result<EntityName, String> {
    EntityName::parse(s)
}

fn volumes_arg(s: &str) -> std::result::Result<VolumePatterns, String> {
    VolumePatterns::parse_list(s)
}

fn role_arg(s: &str) -> std::result::Result<Role, String> {
    match s {
        "client" => Ok(Role::Client),
        "admin" => Ok(Role::Admin),
        "osd" => Ok(Role::Osd),
        _ => Err(format!(
            "`{s}`: a role is `client`, `admin` or `osd` (osd only for osd.N entities)"
        )),
    }
}

#[derive(Serialize)]
struct Written {
    entity: String,
    generation: Option<KeyGeneration>,
    path: PathBuf,
}

/// Runs `init` (which needs no manager).
pub fn init(dir: &Path, as_json: bool) -> Result<String> {
    let (_, files) = Keyring::init_cluster(dir).map_err(AdminError)?;
    let written: Vec<Written> = files
        .into_iter()
        .map(|(entity, path)| {
            let (entity, generation) = match entity {
                KeyringEntity::Cluster => ("cluster".to_string(), None),
                KeyringEntity::Entity(e, g) => (e.to_string(), Some(g)),
            };
            Written {
                entity,
                generation,
                path,
            }
        })
        .collect();
    if as_json {
        return json(&written);
    }
    let d = dir.display();
    Ok(format!(
        "{}\nNext: set `keyring: {d}/cluster.keyring` in the manager's config and run \
         flame-admin with `--keyring {d}/client.admin.keyring` (or FLAME_KEYRING). Once \
         the manager runs, give each OSD a key of its own: `flame-admin auth add osd.N \
         --cluster-keyring {d}/cluster.keyring --out {d}/osd.N.keyring`, and set it as \
         `keyring:` in OSD N's config. Keep cluster.keyring on the manager's host only.\n",
        table(
            &["ENTITY", "GEN", "KEYRING"],
            &written
                .iter()
                .map(|w| {
                    vec![
                        w.entity.clone(),
                        w.generation.map_or("-".into(), |g| g.to_string()),
                        w.path.display().to_string(),
                    ]
                })
                .collect::<Vec<_>>()
        )
    ))
}

/// Runs every other `auth` command against the manager.
pub fn run(mgr: &MgrClient, cmd: &AuthCommand, as_json: bool) -> Result<String> {
    match cmd {
        AuthCommand::Init { dir } => init(dir, as_json),
        AuthCommand::Ls => {
            let list = mgr.auth_entities()?;
            if as_json {
                return json(&list);
            }
            Ok(table(
                &["ENTITY", "ROLE", "GEN", "VOLUMES"],
                &list
                    .iter()
                    .map(|e| {
                        vec![
                            e.entity.to_string(),
                            e.role.as_str().to_string(),
                            e.generation.to_string(),
                            e.volumes.to_string(),
                        ]
                    })
                    .collect::<Vec<_>>(),
            ))
        }
        AuthCommand::Volumes { entity, volumes } => {
            let info = mgr.auth_set_volumes(entity, volumes.clone())?;
            if as_json {
                return json(&info);
            }
            Ok(format!(
                "{entity} may use volumes {} (from its next ticket)\n",
                info.volumes
            ))
        }
        AuthCommand::Add {
            entity,
            role,
            volumes,
            write,
        } => {
            check_write(write)?;
            let role = role.unwrap_or(if entity.is_osd() {
                Role::Osd
            } else {
                Role::Client
            });
            let info = mgr.auth_add(entity, role, volumes.clone())?;
            changed(
                &format!("{entity} added with role {}", info.role.as_str()),
                entity,
                info.generation,
                write,
                as_json,
            )
        }
        AuthCommand::Rotate {
            entity,
            force,
            write,
        } => {
            if *entity == EntityName::osd() && !force {
                return Err(AdminError(
                    "rotating `osd` changes the OSDs' service key: every ticket issued \
                     before stops working (clients renew theirs), OSDs with their own osd.N \
                     keys follow at their next heartbeat, and an OSD on the shared osd key \
                     is refused by the manager (it stops serving when its lease runs out) \
                     until it has the new keyring and is restarted: pass --force to do it \
                     anyway"
                        .into(),
                ));
            }
            check_write(write)?;
            let info = mgr.auth_rotate(entity)?;
            changed(
                &format!("{entity}: key rotated to generation {}", info.generation),
                entity,
                info.generation,
                write,
                as_json,
            )
        }
        AuthCommand::Rm { entity } => {
            let info = mgr.auth_remove(entity)?;
            if as_json {
                return json(&info);
            }
            Ok(format!("{entity} removed: its key no longer works\n"))
        }
        AuthCommand::Key {
            entity,
            generation,
            write,
        } => {
            let (Some(_), Some(_)) = (&write.cluster_keyring, &write.out) else {
                return Err(AdminError(
                    "auth key needs --cluster-keyring FILE and --out FILE".into(),
                ));
            };
            let generation = match generation {
                Some(g) => *g,
                None => mgr
                    .auth_entities()?
                    .into_iter()
                    .find(|e| e.entity == *entity)
                    .map(|e| e.generation)
                    .ok_or_else(|| AdminError(format!("the manager knows no entity {entity}")))?,
            };
            changed(
                &format!("{entity} generation {generation}"),
                entity,
                generation,
                write,
                as_json,
            )
        }
    }
}

/// --cluster-keyring and --out go together; checked before the manager changes
/// anything, so a typo does not leave a rotated key nobody has.
fn check_write(w: &WriteKey) -> Result<()> {
    match (&w.cluster_keyring, &w.out) {
        (Some(c), Some(out)) => {
            load_cluster(c)?;
            if out.exists() {
                return Err(AdminError(format!(
                    "{} already exists; not overwriting a keyring",
                    out.display()
                )));
            }
            Ok(())
        }
        (None, None) => Ok(()),
        _ => Err(AdminError("--cluster-keyring and --out go together".into())),
    }
}

fn load_cluster(path: &Path) -> Result<SecretKey> {
    let k = Keyring::load(path).map_err(AdminError)?;
    match k.entity {
        KeyringEntity::Cluster => Ok(k.key),
        KeyringEntity::Entity(e, _) => Err(AdminError(format!(
            "{} is the keyring of {e}, not the cluster keyring",
            path.display()
        ))),
    }
}

fn changed(
    what: &str,
    entity: &EntityName,
    generation: KeyGeneration,
    write: &WriteKey,
    as_json: bool,
) -> Result<String> {
    let path = match (&write.cluster_keyring, &write.out) {
        (Some(c), Some(out)) => {
            let secret = load_cluster(c)?;
            Keyring::derived(&secret, entity, generation)
                .save(out)
                .map_err(AdminError)?;
            Some(out.clone())
        }
        _ => None,
    };
    if as_json {
        return json(&Written {
            entity: entity.to_string(),
            generation: Some(generation),
            path: path.unwrap_or_default(),
        });
    }
    let next = match &path {
        Some(p) => format!("keyring written to {}", p.display()),
        None => format!(
            "write its keyring where the cluster keyring is: flame-admin auth key {entity} \
             --cluster-keyring CLUSTER.keyring --out {entity}.keyring"
        ),
    };
    Ok(fields(&[("done", what.to_string()), ("next", next)]))
}
