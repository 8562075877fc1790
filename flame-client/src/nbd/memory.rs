//! In-memory exports: a test and benchmark mode that serves NBD without a cluster
//! (`flame-nbd --memory NAME=SIZE`).
//!
//! Data lives in a sparse map of 4 KiB blocks shared by every reactor thread of the
//! process (connections to one export may land on different threads, and
//! `CAN_MULTI_CONN` requires all of them to see one store). The map is split into
//! stripes, each behind its own mutex, so threads rarely contend; every block is
//! updated under its stripe lock, so concurrent writes to different bytes of one
//! block never lose each other's bytes. Nothing survives the process: FLUSH and FUA
//! are trivially satisfied because a completed write is already in the shared map.

use super::backend::{Backend, Errno, Exports, OpenError};
use flame_common::buffer::{PayloadBuf, PayloadBufMut};
use flame_common::collections::HashMap;
use parking_lot::Mutex;

use std::sync::Arc;

/// Block size of the sparse map.
const BLOCK_BYTES: usize = 4096;
/// Stripes of the map (a power of two).
const STRIPES: usize = 64;
/// Largest in-memory export (sparse, so only written blocks cost memory).
pub const MEMORY_EXPORT_BYTES_MAX: u64 = 1 << 50;

type Block = Box<[u8; BLOCK_BYTES]>;

/// One in-memory disk, shared by all threads.
pub struct MemoryDisk {
    size: u64,
    read_only: bool,
    stripes: Vec<Mutex<HashMap<u64, Block>>>,
}

impl MemoryDisk {
    /// A zero-filled disk of `size` bytes.
    pub fn new(size: u64, read_only: bool) -> MemoryDisk {
        MemoryDisk {
            size,
            read_only,
            stripes: (0..STRIPES)
                .map(|_| Mutex::new(HashMap::default()))
                .collect(),
        }
    }

    fn stripe(&self, block: u64) -> &Mutex<HashMap<u64, Block>> {
        &self.stripes[(block as usize) & (STRIPES - 1)]
    }

    /// Calls `f(block, start_in_block, len, position_in_range)` for every block piece
    /// of `[offset, offset+len)`.
    fn for_each_piece(offset: u64, len: usize, mut f: impl FnMut(u64, usize, usize, usize)) {
        let mut pos = 0usize;
        while pos < len {
            let at = offset + pos as u64;
            let block = at / BLOCK_BYTES as u64;
            let start = (at % BLOCK_BYTES as u64) as usize;
            let n = (BLOCK_BYTES - start).min(len - pos);
            f(block, start, n, pos);
            pos += n;
        }
    }

    /// Copies `[offset, offset+len)` out (holes read as zeroes).
    pub fn read(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        self.read_into(offset, &mut out);
        out
    }

    /// Copies `[offset, offset+out.len())` into `out` (holes read as zeroes).
    pub fn read_into(&self, offset: u64, out: &mut [u8]) {
        Self::for_each_piece(offset, out.len(), |block, start, n, pos| {
            let map = self.stripe(block).lock();
            match map.get(&block) {
                Some(b) => out[pos..pos + n].copy_from_slice(&b[start..start + n]),
                None => out[pos..pos + n].fill(0),
            }
        });
    }

    /// Copies `data` in at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) {
        Self::for_each_piece(offset, data.len(), |block, start, n, pos| {
            let mut map = self.stripe(block).lock();
            let b = map
                .entry(block)
                .or_insert_with(|| Box::new([0u8; BLOCK_BYTES]));
            b[start..start + n].copy_from_slice(&data[pos..pos + n]);
        });
    }

    /// Zeroes a range, dropping whole blocks so zeroing costs no memory.
    pub fn zero(&self, offset: u64, len: usize) {
        Self::for_each_piece(offset, len, |block, start, n, _| {
            let mut map = self.stripe(block).lock();
            if n == BLOCK_BYTES {
                map.remove(&block);
            } else if let Some(b) = map.get_mut(&block) {
                b[start..start + n].fill(0);
            }
        });
    }

    /// Export size.
    pub fn size(&self) -> u64 {
        self.size
    }
}

/// A connection's handle on a [`MemoryDisk`].
#[derive(Clone)]
pub struct MemoryBackend {
    disk: Arc<MemoryDisk>,
}

impl MemoryBackend {
    /// A backend on `disk`.
    pub fn new(disk: Arc<MemoryDisk>) -> MemoryBackend {
        MemoryBackend { disk }
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), Errno> {
        match offset.checked_add(len) {
            Some(end) if end <= self.disk.size => Ok(()),
            _ => Err(libc::EINVAL),
        }
    }

    fn check_write(&self, offset: u64, len: u64) -> Result<(), Errno> {
        if self.disk.read_only {
            return Err(libc::EPERM);
        }
        self.check(offset, len).map_err(|_| libc::ENOSPC)
    }
}

impl Backend for MemoryBackend {
    fn size(&self) -> u64 {
        self.disk.size
    }

    fn read_only(&self) -> bool {
        self.disk.read_only
    }

    async fn read(&self, offset: u64, len: u32) -> Result<Vec<PayloadBuf>, Errno> {
        self.check(offset, u64::from(len))?;
        let mut buf = PayloadBufMut::for_overwrite(len as usize);
        self.disk.read_into(offset, buf.as_mut_slice());
        Ok(vec![buf.freeze()])
    }

    async fn write(&self, offset: u64, data: PayloadBuf, _fua: bool) -> Result<(), Errno> {
        self.check_write(offset, data.len() as u64)?;
        self.disk.write(offset, &data);
        Ok(())
    }

    async fn flush(&self) -> Result<(), Errno> {
        // Every completed write is already in the map all connections share.
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u32, _fua: bool) -> Result<(), Errno> {
        self.check_write(offset, u64::from(len))?;
        self.disk.zero(offset, len as usize);
        Ok(())
    }

    async fn write_zeroes(&self, offset: u64, len: u32, _fua: bool) -> Result<(), Errno> {
        self.check_write(offset, u64::from(len))?;
        self.disk.zero(offset, len as usize);
        Ok(())
    }
}

/// A fixed set of named in-memory disks. Cheap to clone (one per reactor thread);
/// every clone sees the same disks.
#[derive(Clone, Default)]
pub struct MemoryExports {
    disks: Arc<Vec<(String, Arc<MemoryDisk>)>>,
}

/// Why a `--memory NAME=SIZE[:ro]` argument is invalid.
#[derive(Debug, thiserror::Error)]
#[error("invalid --memory `{arg}`: {reason} (expected NAME=SIZE[:ro], SIZE like 64M, 1G, 4096)")]
pub struct MemorySpecError {
    arg: String,
    reason: String,
}

impl MemoryExports {
    /// Exports from `(name, size, read_only)` triples. The first one is also the
    /// default export (empty name).
    pub fn new(specs: Vec<(String, u64, bool)>) -> MemoryExports {
        MemoryExports {
            disks: Arc::new(
                specs
                    .into_iter()
                    .map(|(n, s, ro)| (n, Arc::new(MemoryDisk::new(s, ro))))
                    .collect(),
            ),
        }
    }

    /// Parses `NAME=SIZE[:ro]` (SIZE in bytes with an optional K/M/G/T suffix,
    /// powers of 1024).
    pub fn parse_spec(arg: &str) -> Result<(String, u64, bool), MemorySpecError> {
        let err = |reason: &str| MemorySpecError {
            arg: arg.to_string(),
            reason: reason.to_string(),
        };
        let (name, rest) = arg.split_once('=').ok_or_else(|| err("missing `=`"))?;
        if name.is_empty() || name.len() > super::proto::STRING_BYTES_MAX {
            return Err(err("name must be 1..4096 bytes"));
        }
        let (size, ro) = match rest.strip_suffix(":ro") {
            Some(s) => (s, true),
            None => (rest, false),
        };
        let (digits, mult) = match size.chars().last() {
            Some('k' | 'K') => (&size[..size.len() - 1], 1u64 << 10),
            Some('m' | 'M') => (&size[..size.len() - 1], 1 << 20),
            Some('g' | 'G') => (&size[..size.len() - 1], 1 << 30),
            Some('t' | 'T') => (&size[..size.len() - 1], 1 << 40),
            _ => (size, 1),
        };
        let n: u64 = digits.parse().map_err(|_| err("size is not a number"))?;
        let bytes = n
            .checked_mul(mult)
            .filter(|b| *b <= MEMORY_EXPORT_BYTES_MAX)
            .ok_or_else(|| err("size too large"))?;
        Ok((name.to_string(), bytes, ro))
    }
}

impl Exports for MemoryExports {
    type B = MemoryBackend;

    async fn list(&self) -> Result<Vec<String>, OpenError> {
        Ok(self.disks.iter().map(|(n, _)| n.clone()).collect())
    }

    async fn open(&self, name: &str) -> Result<MemoryBackend, OpenError> {
        let found = if name.is_empty() {
            self.disks.first()
        } else {
            self.disks.iter().find(|(n, _)| n == name)
        };
        match found {
            Some((_, d)) => Ok(MemoryBackend::new(d.clone())),
            None => Err(OpenError::Unknown),
        }
    }

    fn description(&self, _name: &str) -> String {
        "flame-nbd in-memory export (test mode, not persistent)".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_read_write_zero() {
        let d = MemoryDisk::new(1 << 20, false);
        assert_eq!(d.read(100, 10), vec![0; 10]);
        let data: Vec<u8> = (0..10000u32).map(|i| i as u8).collect();
        d.write(4000, &data);
        assert_eq!(d.read(4000, 10000), data);
        assert_eq!(d.read(3990, 10)[..], [0; 10]);
        d.zero(4096, 4096);
        let got = d.read(4000, 10000);
        assert_eq!(&got[..96], &data[..96]);
        assert!(got[96..96 + 4096].iter().all(|&b| b == 0));
        assert_eq!(&got[96 + 4096..], &data[96 + 4096..]);
        d.zero(4001, 2);
        assert_eq!(d.read(4000, 4), vec![data[0], 0, 0, data[3]]);
    }

    #[test]
    fn concurrent_writers_same_block_keep_all_bytes() {
        let d = Arc::new(MemoryDisk::new(8192, false));
        let threads: Vec<_> = (0..8u8)
            .map(|t| {
                let d = d.clone();
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        d.write(u64::from(t) * 512, &[t + 1; 512]);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let got = d.read(0, 4096);
        for t in 0..8u8 {
            assert!(
                got[t as usize * 512..(t as usize + 1) * 512]
                    .iter()
                    .all(|&b| b == t + 1)
            );
        }
    }

    #[test]
    fn spec_parsing() {
        assert_eq!(
            MemoryExports::parse_spec("a=64M").unwrap(),
            ("a".into(), 64 << 20, false)
        );
        assert_eq!(
            MemoryExports::parse_spec("b=4096:ro").unwrap(),
            ("b".into(), 4096, true)
        );
        assert_eq!(
            MemoryExports::parse_spec("c=1g").unwrap(),
            ("c".into(), 1 << 30, false)
        );
        assert!(MemoryExports::parse_spec("noequals").is_err());
        assert!(MemoryExports::parse_spec("=1M").is_err());
        assert!(MemoryExports::parse_spec("x=").is_err());
        assert!(MemoryExports::parse_spec("x=12Q").is_err());
        assert!(MemoryExports::parse_spec("x=99999999999T").is_err());
    }
}
