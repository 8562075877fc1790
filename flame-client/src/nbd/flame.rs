//! Flame volumes as NBD exports: export name = volume name.
//!
//! Each reactor thread gets its own [`FlameExports`] (a clone of the process's
//! [`Cluster`] handle); a connection opens its volume on the thread that accepted it,
//! and the volume's I/O runs on that thread's connections to the OSDs — no hand-off.
//!
//! `CAN_MULTI_CONN` holds because the client keeps no write cache: a write is
//! acknowledged only once every OSD of the acting set applied it, and
//! [`Volume::flush`] makes every write completed before it — on any connection, by
//! any thread — stable on every copy (it flushes every OSD shard that holds one of
//! the volume's placement groups, not just those this connection wrote to).

use super::backend::{Backend, Errno, Exports, OpenError};
use crate::{ClientError, Cluster, Volume};

/// The exports of a Flame cluster, for one reactor thread.
#[derive(Clone)]
pub struct FlameExports {
    cluster: Cluster,
}

impl FlameExports {
    /// Exports of `cluster` (connected once per process, cloned per thread).
    pub fn new(cluster: Cluster) -> FlameExports {
        FlameExports { cluster }
    }
}

/// One open volume behind an NBD connection.
pub struct FlameBackend {
    volume: Volume,
    /// Size at open: the NBD export size is fixed for the connection's lifetime.
    size: u64,
}

fn errno(e: ClientError) -> Errno {
    tracing::debug!("volume I/O failed: {e}");
    e.errno()
}

impl Backend for FlameBackend {
    fn size(&self) -> u64 {
        self.size
    }

    async fn read(&self, offset: u64, len: u32) -> Result<Vec<u8>, Errno> {
        self.volume
            .read_at(offset, len as usize)
            .await
            .map_err(errno)
    }

    async fn write(&self, offset: u64, data: Vec<u8>, fua: bool) -> Result<(), Errno> {
        self.volume
            .write_vec(offset, data, fua)
            .await
            .map_err(errno)
    }

    async fn flush(&self) -> Result<(), Errno> {
        self.volume.flush().await.map_err(errno)
    }

    async fn trim(&self, offset: u64, len: u32, fua: bool) -> Result<(), Errno> {
        self.volume
            .discard(offset, u64::from(len))
            .await
            .map_err(errno)?;
        if fua {
            // Discard has no FUA form; a flush makes it (and everything before) stable.
            self.volume.flush().await.map_err(errno)?;
        }
        Ok(())
    }

    async fn write_zeroes(&self, offset: u64, len: u32, fua: bool) -> Result<(), Errno> {
        self.volume
            .write_zeroes(offset, u64::from(len), fua)
            .await
            .map_err(errno)
    }
}

impl Exports for FlameExports {
    type B = FlameBackend;

    async fn list(&self) -> Result<Vec<String>, OpenError> {
        // A fresh map, so a volume created a moment ago is listed.
        let map = self.cluster.refresh_map_now().await;
        let mut names: Vec<String> = map.volumes.keys().cloned().collect();
        names.sort();
        Ok(names)
    }

    async fn open(&self, name: &str) -> Result<FlameBackend, OpenError> {
        if name.is_empty() {
            // No default export: a volume must be named.
            return Err(OpenError::Unknown);
        }
        match self.cluster.open_volume(name).await {
            Ok(volume) => {
                let size = volume.size();
                Ok(FlameBackend { volume, size })
            }
            Err(ClientError::NoSuchVolume(_)) => Err(OpenError::Unknown),
            Err(e) => Err(OpenError::Other(e.to_string())),
        }
    }

    fn description(&self, name: &str) -> String {
        format!("Flame volume {name}")
    }
}
