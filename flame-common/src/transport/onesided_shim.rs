//! TEMPORARY stand-in for i7-shm's one-sided API (COMMON.md's contract), so the
//! conversion and fetching paths build before that branch lands. Every operation
//! fails as unsupported; the merge of `i7-shm` deletes this file.

use super::{Conn, TransportError};
use crate::buffer::{PayloadBuf, PayloadBufMut};
use crate::protocol::RemoteBuf;

fn unsupported() -> TransportError {
    TransportError::Io(std::io::Error::from(std::io::ErrorKind::Unsupported))
}

/// A read grant (stand-in).
#[derive(Debug)]
pub struct Grant {
    remote: RemoteBuf,
}

impl Grant {
    /// The descriptor the peer uses.
    pub fn remote(&self) -> RemoteBuf {
        self.remote
    }
}

/// A write grant (stand-in).
#[derive(Debug)]
pub struct WriteGrant {
    remote: RemoteBuf,
    buf: PayloadBufMut,
}

impl WriteGrant {
    /// The descriptor the peer uses.
    pub fn remote(&self) -> RemoteBuf {
        self.remote
    }

    /// Takes the buffer back.
    pub fn finish(self) -> PayloadBufMut {
        self.buf
    }
}

impl Conn {
    /// Stand-in.
    pub fn one_sided_native(&self) -> bool {
        false
    }

    /// Stand-in.
    pub fn grant_read(&self, _buf: &PayloadBuf) -> Result<Grant, TransportError> {
        Err(unsupported())
    }

    /// Stand-in.
    pub fn grant_write(&self, _buf: PayloadBufMut) -> Result<WriteGrant, TransportError> {
        Err(unsupported())
    }

    /// Stand-in.
    pub async fn read_remote(&self, _remote: RemoteBuf) -> Result<PayloadBufMut, TransportError> {
        Err(unsupported())
    }

    /// Stand-in.
    pub async fn write_remote(
        &self,
        _remote: RemoteBuf,
        _offset: u32,
        _data: &PayloadBuf,
    ) -> Result<(), TransportError> {
        Err(unsupported())
    }
}

/// Memory this side keeps writing and the peer may READ one-sidedly for as long
/// as the area lives (a reply area of remote fetching). Stand-in.
#[derive(Debug)]
pub struct SharedArea {
    remote: RemoteBuf,
}

impl SharedArea {
    /// The descriptor the peer uses (the whole area).
    pub fn remote(&self) -> RemoteBuf {
        self.remote
    }

    /// Area size in bytes.
    pub fn len(&self) -> usize {
        self.remote.len as usize
    }

    /// Whether the area is empty (never: areas have at least one byte).
    pub fn is_empty(&self) -> bool {
        self.remote.len == 0
    }

    /// Copies `data` into the area at `offset`; `false` if it does not fit.
    pub fn write_at(&self, _offset: usize, _data: &[u8]) -> bool {
        false
    }
}

impl Conn {
    /// Stand-in: grants the peer READ access to `len` bytes this side writes.
    pub fn grant_area(&self, _len: usize) -> Result<SharedArea, TransportError> {
        Err(unsupported())
    }
}
