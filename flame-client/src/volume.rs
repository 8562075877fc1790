//! A volume: byte-addressed I/O on a replicated virtual disk.
//!
//! Every call checks its range against the size in the *current* map, so a resize
//! takes effect for the next request without reopening. A request is split at object
//! boundaries and at the message bound ([`crate::split`]); its pieces go to their
//! primaries concurrently and the call returns when all are done (or the first fails
//! finally). Any number of calls may be in flight at once, from any number of tasks
//! on the reactor thread.

use crate::cluster::Cluster;
use crate::error::ClientError;
use crate::io::{self, PieceOp, piece_io};
use crate::join::try_join_bounded;
use crate::metrics::{self, Op};
use crate::split::{Piece, split};
use flame_common::buffer::PayloadBuf;
use flame_common::clock;
use flame_common::ids::VolumeId;
use flame_common::map::VolumeInfo;
use flame_common::protocol::IO_BYTES_MAX;

/// Largest single read: the result is one buffer, so bound what one call may
/// allocate. (NBD requests are at most 32 MiB.)
pub const READ_BYTES_MAX: u64 = 1 << 30;
/// Pieces of one request in flight at once: enough to keep every OSD of a large
/// cluster busy, few enough that a whole-volume discard stays cheap.
const PIECES_WINDOW: usize = 64;

/// An open volume. Cheap to clone; `Send`, but its I/O methods must run on a
/// `flame_common::reactor` thread (they use that thread's OSD connections).
#[derive(Clone, Debug)]
pub struct Volume {
    cluster: Cluster,
    id: VolumeId,
    name: String,
    object_size: u32,
}

// Opening a volume is the cluster handle's job, but it lives here so that
// `cluster` (the map) does not depend on the volume and I/O layers above it.
impl Cluster {
    /// Opens a volume by name for I/O. A name missing from our map triggers one
    /// refresh first (the volume may have been created a moment ago). Must run on
    /// a reactor thread.
    pub async fn open_volume(&self, name: &str) -> Result<Volume, ClientError> {
        let info = match self.volume_info(name) {
            Some(v) => v,
            None => self
                .refresh_map_now()
                .await
                .volumes
                .get(name)
                .cloned()
                .ok_or_else(|| ClientError::NoSuchVolume(name.to_string()))?,
        };
        Ok(Volume::new(self.clone(), info))
    }
}

impl Volume {
    pub(crate) fn new(cluster: Cluster, info: VolumeInfo) -> Volume {
        // The pool layout is fixed at cluster creation, so the object size cannot
        // change under an open volume.
        let object_size = cluster.map().pool.object_size;
        Volume {
            cluster,
            id: info.id,
            name: info.name,
            object_size,
        }
    }

    /// The volume's name (also its NBD export name).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The volume's never-reused id.
    pub fn id(&self) -> VolumeId {
        self.id
    }

    /// Bytes per object.
    pub fn object_size(&self) -> u32 {
        self.object_size
    }

    /// The cluster this volume belongs to.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// Current size in bytes, from the newest map; 0 once the volume has been
    /// removed (or replaced by a new volume of the same name).
    pub fn size(&self) -> u64 {
        self.current_size().unwrap_or(0)
    }

    /// The size in the newest map, `None` if the volume is no longer there.
    fn current_size(&self) -> Option<u64> {
        self.cluster.with_map(|m| {
            m.volumes
                .get(&self.name)
                .filter(|v| v.id == self.id)
                .map(|v| v.size)
        })
    }

    /// Checks `[offset, offset + length)` against the current size.
    fn check_range(&self, offset: u64, length: u64) -> Result<(), ClientError> {
        let Some(size) = self.current_size() else {
            return Err(ClientError::NoSuchVolume(self.name.clone()));
        };
        match offset.checked_add(length) {
            Some(end) if end <= size => Ok(()),
            _ => Err(ClientError::OutOfRange {
                offset,
                length,
                size,
            }),
        }
    }

    fn pieces(&self, offset: u64, length: u64) -> crate::split::Pieces {
        split(offset, length, self.object_size, IO_BYTES_MAX)
    }

    /// Reads `length` bytes at `offset`. Never-written ranges read as zeroes.
    ///
    /// A convenience that gathers the reply buffers into one vector (one copy);
    /// [`Volume::read_bufs`] returns them as they arrived.
    pub async fn read_at(&self, offset: u64, length: usize) -> Result<Vec<u8>, ClientError> {
        let parts = self.read_bufs(offset, length).await?;
        let mut out = Vec::with_capacity(length);
        for part in &parts {
            out.extend_from_slice(part);
        }
        Ok(out)
    }

    /// Reads `length` bytes at `offset` without copying them: the reply buffers of
    /// the request's pieces, in order (one buffer unless the range crosses an object
    /// boundary or the message bound), each the memory the transport received it
    /// into. Their lengths add up to `length`.
    pub async fn read_bufs(
        &self,
        offset: u64,
        length: usize,
    ) -> Result<Vec<PayloadBuf>, ClientError> {
        let started = clock::now();
        let res = self.read_inner(offset, length as u64).await;
        metrics::record_op(
            Op::Read,
            res.is_ok(),
            length as u64,
            clock::elapsed(started),
        );
        res
    }

    async fn read_inner(&self, offset: u64, length: u64) -> Result<Vec<PayloadBuf>, ClientError> {
        if length > READ_BYTES_MAX {
            return Err(ClientError::InvalidArgument(format!(
                "read of {length} bytes is larger than the {READ_BYTES_MAX}-byte limit"
            )));
        }
        self.check_range(offset, length)?;
        let deadline = io::deadline_from_now(&self.cluster);
        let mut pieces = self.pieces(offset, length);
        let first = match pieces.next() {
            None => return Ok(Vec::new()),
            Some(p) => p,
        };
        if u64::from(first.length) == length {
            // The common case: one piece, its reply buffer is the result.
            let data = piece_io(&self.cluster, self.id, first, PieceOp::Read, deadline).await?;
            return Ok(vec![data]);
        }
        let all = std::iter::once(first).chain(pieces);
        try_join_bounded(all, PIECES_WINDOW, |p: Piece| {
            piece_io(&self.cluster, self.id, p, PieceOp::Read, deadline)
        })
        .await
    }

    /// Writes `data` at `offset`. With `fua`, returns only once the data is on
    /// stable storage on every copy. The write is acknowledged only after every OSD
    /// of each object's acting set has applied it.
    ///
    /// A convenience that copies `data` once into a payload buffer; a caller that
    /// has its data in a [`PayloadBuf`] already uses [`Volume::write_buf`].
    pub async fn write_at(&self, offset: u64, data: &[u8], fua: bool) -> Result<(), ClientError> {
        self.write_buf(offset, PayloadBuf::copy_from(data), fua)
            .await
    }

    /// Like [`Volume::write_at`], without a copy: every piece of the write (one per
    /// object touched) is a slice of `data`, sent from its memory, and a retry
    /// resends the same memory.
    pub async fn write_buf(
        &self,
        offset: u64,
        data: PayloadBuf,
        fua: bool,
    ) -> Result<(), ClientError> {
        let started = clock::now();
        let len = data.len() as u64;
        let res = self.write_inner(offset, data, fua).await;
        metrics::record_op(Op::Write, res.is_ok(), len, clock::elapsed(started));
        res
    }

    async fn write_inner(
        &self,
        offset: u64,
        data: PayloadBuf,
        fua: bool,
    ) -> Result<(), ClientError> {
        let length = data.len() as u64;
        self.check_range(offset, length)?;
        let deadline = io::deadline_from_now(&self.cluster);
        let mut pieces = self.pieces(offset, length);
        let Some(first) = pieces.next() else {
            return Ok(());
        };
        if u64::from(first.length) == length {
            let op = PieceOp::Write { data, fua };
            return piece_io(&self.cluster, self.id, first, op, deadline)
                .await
                .map(|_| ());
        }
        let all = std::iter::once(first).chain(pieces);
        try_join_bounded(all, PIECES_WINDOW, |p: Piece| {
            let start = p.request_offset as usize;
            let data = data.slice(start..start + p.length as usize);
            piece_io(
                &self.cluster,
                self.id,
                p,
                PieceOp::Write { data, fua },
                deadline,
            )
        })
        .await
        .map(|_| ())
    }

    /// Makes `[offset, offset + length)` read back as zeroes. With `fua`, stable on
    /// every copy before returning.
    pub async fn write_zeroes(
        &self,
        offset: u64,
        length: u64,
        fua: bool,
    ) -> Result<(), ClientError> {
        let started = clock::now();
        let res = self
            .range_op(offset, length, || PieceOp::WriteZeroes { fua })
            .await;
        metrics::record_op(
            Op::WriteZeroes,
            res.is_ok(),
            length,
            clock::elapsed(started),
        );
        res
    }

    /// Tells the cluster the range is no longer needed; it reads back as zeroes
    /// afterwards (Flame guarantees that, so TRIM can be used as cheap zeroing).
    pub async fn discard(&self, offset: u64, length: u64) -> Result<(), ClientError> {
        let started = clock::now();
        let res = self.range_op(offset, length, || PieceOp::Discard).await;
        metrics::record_op(Op::Discard, res.is_ok(), length, clock::elapsed(started));
        res
    }

    async fn range_op(
        &self,
        offset: u64,
        length: u64,
        make: impl Fn() -> PieceOp,
    ) -> Result<(), ClientError> {
        self.check_range(offset, length)?;
        let deadline = io::deadline_from_now(&self.cluster);
        try_join_bounded(self.pieces(offset, length), PIECES_WINDOW, |p| {
            piece_io(&self.cluster, self.id, p, make(), deadline)
        })
        .await
        .map(|_| ())
    }

    /// Makes every write completed before this call — on any connection, by any
    /// client thread — stable on every copy. See `io::flush_volume` for why this is
    /// what lets flame-nbd advertise `NBD_FLAG_CAN_MULTI_CONN`.
    pub async fn flush(&self) -> Result<(), ClientError> {
        io::flush_volume(&self.cluster, self.id).await
    }
}
