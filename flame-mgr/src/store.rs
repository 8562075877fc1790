//! Crash-safe persistence of [`PersistedState`] in `data_dir/state.json`.
//!
//! Every save writes the whole state to `state.json.tmp`, fsyncs it, renames it over
//! `state.json` and fsyncs the directory. rename(2) is atomic, so after a crash at
//! any instant `state.json` is either the previous or the new version, complete;
//! the directory fsync makes the rename itself durable before the caller replies.
//! A leftover `state.json.tmp` is an interrupted save that was never acknowledged,
//! so loading ignores it.
//!
//! The directory is also locked (flock) for the life of the process, so two
//! managers can never overwrite each other's state.

use crate::state::PersistedState;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Name of the state file inside the data directory.
pub const STATE_FILE: &str = "state.json";
const TMP_FILE: &str = "state.json.tmp";
const LOCK_FILE: &str = "mgr.lock";
/// Largest state file accepted on load. The count limits in [`crate::state`] keep
/// a real state far below this; anything bigger is not ours.
pub const STATE_BYTES_MAX: u64 = 256 << 20;

/// Why the state could not be loaded or saved. Messages name the file.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A file-system operation failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file or directory involved.
        path: String,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The state file exists but is not a valid state. Never reset automatically:
    /// that would silently forget every volume and OSD.
    #[error(
        "state file {path} is corrupt: {message} (refusing to start; restore it from a backup or move it away to create a new cluster)"
    )]
    Corrupt {
        /// The state file.
        path: String,
        /// What is wrong with it.
        message: String,
    },
    /// The data directory belongs to another user or cannot be made private.
    #[error("{0}")]
    NotPrivate(String),
    /// Another process holds the data directory.
    #[error("data_dir {path} is in use by another flame-mgr")]
    Locked {
        /// The data directory.
        path: String,
    },
}

/// The data directory, locked for this process.
#[derive(Debug)]
pub struct Store {
    dir: PathBuf,
    /// Held open for the flock; the lock goes away when the process does.
    _lock: File,
}

fn io_err<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        what,
        path: path.display().to_string(),
        source,
    }
}

impl Store {
    /// Creates (if needed, mode 0700) and locks the data directory; one other
    /// users can enter is made private, with a warning
    /// ([`flame_common::private_dir`]).
    pub fn open(dir: &Path) -> Result<Store, StoreError> {
        flame_common::private_dir::open_logged(dir, "data_dir").map_err(StoreError::NotPrivate)?;
        let lock_path = dir.join(LOCK_FILE);
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_err("cannot open", &lock_path))?;
        // SAFETY: flock on a file descriptor we own and keep open; no memory involved.
        let rc = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(StoreError::Locked {
                    path: dir.display().to_string(),
                });
            }
            return Err(io_err("cannot lock", &lock_path)(err));
        }
        Ok(Store {
            dir: dir.to_path_buf(),
            _lock: lock,
        })
    }

    /// Path of `state.json`.
    pub fn state_path(&self) -> PathBuf {
        self.dir.join(STATE_FILE)
    }

    /// Loads the state, `None` if this directory never held one (first start).
    /// Unreadable, unparsable or inconsistent state is an error, never `None`.
    pub fn load(&self) -> Result<Option<PersistedState>, StoreError> {
        let path = self.state_path();
        let meta = match fs::metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_err("cannot stat", &path)(e)),
        };
        let corrupt = |message: String| StoreError::Corrupt {
            path: path.display().to_string(),
            message,
        };
        if meta.len() > STATE_BYTES_MAX {
            return Err(corrupt(format!(
                "{} bytes, more than the {STATE_BYTES_MAX} a state can be",
                meta.len()
            )));
        }
        let bytes = fs::read(&path).map_err(io_err("cannot read", &path))?;
        decode(&bytes).map(Some).map_err(corrupt)
    }

    /// Durably replaces the state. Returns only once the new state survives a
    /// crash or power loss; on error the previous `state.json` is intact.
    pub fn save(&self, state: &PersistedState) -> Result<(), StoreError> {
        let tmp = self.dir.join(TMP_FILE);
        let path = self.state_path();
        let bytes = encode(state).map_err(|e| StoreError::Io {
            what: "cannot encode state for",
            path: path.display().to_string(),
            source: std::io::Error::other(e),
        })?;
        let mut f = File::create(&tmp).map_err(io_err("cannot create", &tmp))?;
        f.write_all(&bytes).map_err(io_err("cannot write", &tmp))?;
        f.sync_all().map_err(io_err("cannot fsync", &tmp))?;
        drop(f);
        fs::rename(&tmp, &path).map_err(io_err("cannot rename over", &path))?;
        let dir = File::open(&self.dir).map_err(io_err("cannot open", &self.dir))?;
        dir.sync_all().map_err(io_err("cannot fsync", &self.dir))?;
        Ok(())
    }
}

/// `state.json`'s bytes for `state` (what [`Store::save`] writes; the
/// simulator keeps them on its manager's disk).
pub fn encode(state: &PersistedState) -> Result<Vec<u8>, serde_json::Error> {
    serde_json::to_vec_pretty(state)
}

/// The state `state.json`'s `bytes` hold, checked for consistency
/// ([`PersistedState::check`]); why not, otherwise (what [`Store::load`]
/// reports as corrupt; the simulator's manager restarts through it).
pub fn decode(bytes: &[u8]) -> Result<PersistedState, String> {
    if bytes.len() as u64 > STATE_BYTES_MAX {
        return Err(format!(
            "{} bytes, more than the {STATE_BYTES_MAX} a state can be",
            bytes.len()
        ));
    }
    let state: PersistedState = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    state.check()?;
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flame_common::map::PoolConfig;
    use flame_common::mgr_api::{OsdBoot, VolumeCreate};

    fn sample() -> PersistedState {
        let mut s = crate::state::ClusterState::new(
            PersistedState::new_cluster("fsid-1".into(), PoolConfig::default()),
            std::time::Instant::now(),
        );
        s.boot(
            &OsdBoot {
                fsid: None,
                uuid: "uuid-a".into(),
                id: None,
                addr: "127.0.0.1:6900".parse().unwrap(),
                shards: 2,
                host: "h".into(),
                weight: 1.0,
                metrics_addr: Some("127.0.0.1:9201".parse().unwrap()),
                incarnation: 1,
            },
            std::time::Instant::now(),
        )
        .unwrap();
        s.create_volume(
            &VolumeCreate {
                name: "v".into(),
                size: 4096,
            },
            7,
        )
        .unwrap();
        s.persisted
    }

    #[test]
    fn save_then_load_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        assert!(store.load().unwrap().is_none(), "fresh dir has no state");
        let s = sample();
        store.save(&s).unwrap();
        assert_eq!(store.load().unwrap().unwrap(), s);
        // A second save replaces the first and leaves no temp file behind.
        let mut s2 = s.clone();
        s2.map.volumes.clear();
        s2.map.epoch.0 += 1;
        store.save(&s2).unwrap();
        assert_eq!(store.load().unwrap().unwrap(), s2);
        assert!(!dir.path().join(TMP_FILE).exists());
    }

    #[test]
    fn leftover_temp_file_is_ignored() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let s = sample();
        store.save(&s).unwrap();
        // A crash mid-save leaves a partial temp file: it must not be read.
        fs::write(dir.path().join(TMP_FILE), b"{\"format\": 1, \"map\": {").unwrap();
        assert_eq!(store.load().unwrap().unwrap(), s);
        // ... and the next save simply replaces it.
        store.save(&s).unwrap();
        assert_eq!(store.load().unwrap().unwrap(), s);
    }

    #[test]
    fn temp_file_without_state_means_fresh() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(TMP_FILE), b"garbage").unwrap();
        let store = Store::open(dir.path()).unwrap();
        assert!(store.load().unwrap().is_none());
    }

    #[test]
    fn corrupt_state_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        for bad in [
            &b""[..],
            b"not json",
            b"{\"format\": 1}",
            b"{\"format\": 1, \"map\": {\"fsid\": \"x\"}}",
        ] {
            fs::write(store.state_path(), bad).unwrap();
            let e = store.load().unwrap_err();
            assert!(matches!(e, StoreError::Corrupt { .. }), "{e}");
            assert!(e.to_string().contains("state.json"), "{e}");
        }
        // Valid JSON but inconsistent (osd without uuid binding) is also refused.
        let mut s = sample();
        s.osd_uuids.clear();
        fs::write(store.state_path(), serde_json::to_vec(&s).unwrap()).unwrap();
        assert!(matches!(
            store.load().unwrap_err(),
            StoreError::Corrupt { .. }
        ));
    }

    #[test]
    fn second_open_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let _first = Store::open(dir.path()).unwrap();
        assert!(matches!(
            Store::open(dir.path()).unwrap_err(),
            StoreError::Locked { .. }
        ));
    }
}
