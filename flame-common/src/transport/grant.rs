//! Grants: the registered-memory half of the verbs-shaped API.
//!
//! A [`Grant`] lets the peer of one connection READ a buffer, a [`WriteGrant`] lets
//! it WRITE one, until the grant is dropped or finished. The peer names the buffer
//! with a [`RemoteBuf`] — address, length and a random key — that travels in a
//! message header. Every one-sided access is checked against a live grant: the key
//! must be known, the access kind must match and the byte range must lie inside the
//! grant. Anything else is refused and the connection closed, so a peer that guesses
//! (or a bug that computes a wrong descriptor) gets exactly one try.
//!
//! Keys are 32 random bits from the thread's CSPRNG (`rand`'s `ThreadRng`, seeded
//! from the OS), never sequential; with one guess per connection that is a 2^-32
//! chance per connection. The address is the grantor's own virtual address of the
//! bytes, as with RDMA memory registrations.

use super::TransportError;
use crate::buffer::{PayloadBuf, PayloadBufMut};
use crate::collections::HashMap;
use crate::protocol::{PAYLOAD_BYTES_MAX, RemoteBuf};
use std::cell::RefCell;

use std::rc::Rc;

/// Live grants one connection may hold at once. A caller that leaks grants hits
/// this bound (an error), not unbounded memory.
pub const GRANTS_PER_CONN_MAX: usize = 4096;

/// What a transport does when a grant ends.
pub(crate) trait GrantOwner {
    /// Ends the grant `key`. For a write grant, `into` receives the bytes the peer
    /// wrote (a transport that staged them elsewhere copies them now).
    fn revoke(&self, key: u32, into: Option<&mut PayloadBufMut>);
}

/// Lets the connection's peer READ a buffer until this value is dropped. Send
/// [`Grant::remote`] to the peer (in a request header).
pub struct Grant {
    remote: RemoteBuf,
    owner: Rc<dyn GrantOwner>,
}

impl Grant {
    pub(crate) fn new(remote: RemoteBuf, owner: Rc<dyn GrantOwner>) -> Grant {
        Grant { remote, owner }
    }

    /// The descriptor the peer uses to reach the granted bytes.
    pub fn remote(&self) -> RemoteBuf {
        self.remote
    }
}

impl Drop for Grant {
    fn drop(&mut self) {
        self.owner.revoke(self.remote.key, None);
    }
}

impl std::fmt::Debug for Grant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grant")
            .field("remote", &self.remote)
            .finish()
    }
}

/// Lets the connection's peer WRITE into a buffer until [`WriteGrant::finish`]
/// takes it back (dropping it also revokes, discarding the buffer).
pub struct WriteGrant {
    remote: RemoteBuf,
    owner: Rc<dyn GrantOwner>,
    /// The buffer. Shared with the transport's grant table where the transport
    /// writes into it in place (tcp); only this value holds it otherwise.
    buf: Rc<RefCell<PayloadBufMut>>,
    finished: bool,
}

impl WriteGrant {
    pub(crate) fn new(
        remote: RemoteBuf,
        owner: Rc<dyn GrantOwner>,
        buf: Rc<RefCell<PayloadBufMut>>,
    ) -> WriteGrant {
        WriteGrant {
            remote,
            owner,
            buf,
            finished: false,
        }
    }

    /// The descriptor the peer uses to reach the granted bytes.
    pub fn remote(&self) -> RemoteBuf {
        self.remote
    }

    /// Revokes the grant and returns the buffer with whatever the peer wrote into
    /// it. Call it once the peer said it is done (its reply arrived): bytes the peer
    /// writes after this are refused.
    pub fn finish(mut self) -> PayloadBufMut {
        self.finished = true;
        {
            let mut b = self.buf.borrow_mut();
            self.owner.revoke(self.remote.key, Some(&mut b));
        }
        let buf = std::mem::replace(
            &mut self.buf,
            Rc::new(RefCell::new(PayloadBufMut::zeroed(0))),
        );
        match Rc::try_unwrap(buf) {
            Ok(cell) => cell.into_inner(),
            // The transport dropped its reference in `revoke`; should another still
            // exist, move the buffer out rather than copy it.
            Err(shared) => std::mem::replace(&mut *shared.borrow_mut(), PayloadBufMut::zeroed(0)),
        }
    }
}

impl Drop for WriteGrant {
    fn drop(&mut self) {
        if !self.finished {
            self.owner.revoke(self.remote.key, None);
        }
    }
}

impl std::fmt::Debug for WriteGrant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteGrant")
            .field("remote", &self.remote)
            .finish()
    }
}

/// Why a one-sided access was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No live grant has this key.
    UnknownKey,
    /// The grant does not allow this kind of access (a READ of a write grant, or
    /// the reverse).
    WrongAccess,
    /// The byte range is not inside the grant (or is empty or too long).
    OutOfBounds,
}

impl Refusal {
    /// A short description for errors and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::UnknownKey => "unknown grant key",
            Refusal::WrongAccess => "access kind not granted",
            Refusal::OutOfBounds => "byte range outside the grant",
        }
    }
}

/// Checks that `[addr, addr + len)` is a non-empty range inside `[base, base +
/// base_len)`, and returns its offset from `base`.
pub fn check_bounds(base: u64, base_len: u32, addr: u64, len: u64) -> Result<usize, Refusal> {
    if len == 0 || len > u64::from(PAYLOAD_BYTES_MAX) || addr < base {
        return Err(Refusal::OutOfBounds);
    }
    let end = addr.checked_add(len).ok_or(Refusal::OutOfBounds)?;
    // `base` may come from a peer's grant table: never overflow on it.
    let base_end = base
        .checked_add(u64::from(base_len))
        .ok_or(Refusal::OutOfBounds)?;
    if end > base_end {
        return Err(Refusal::OutOfBounds);
    }
    Ok((addr - base) as usize)
}

/// A random key that is not 0 (an all-zero descriptor means "none") and for which
/// `taken` is false.
pub(crate) fn random_key(mut taken: impl FnMut(u32) -> bool) -> u32 {
    // Bounded: with at most GRANTS_PER_CONN_MAX keys taken out of 2^32, a collision
    // is rare; after 64 tries something is badly wrong with the generator.
    for _ in 0..64 {
        let k: u32 = rand::random();
        if k != 0 && !taken(k) {
            return k;
        }
    }
    // Unreachable in practice; fall back to a scan (still unpredictable start).
    let mut k: u32 = rand::random::<u32>() | 1;
    while k == 0 || taken(k) {
        k = k.wrapping_add(0x9E37_79B9);
    }
    k
}

/// The checks every grant request makes before a transport registers it.
pub(crate) fn check_grant_len(len: usize) -> Result<u32, TransportError> {
    if len == 0 || len > PAYLOAD_BYTES_MAX as usize {
        return Err(TransportError::Grant(format!(
            "cannot grant {len} bytes: a grant holds 1..={PAYLOAD_BYTES_MAX} bytes"
        )));
    }
    Ok(len as u32)
}

/// One grant in a table kept by the grantor (tcp: the connection thread serves
/// accesses from it).
pub(crate) enum GrantedBuf {
    /// READ access to these bytes.
    Read(PayloadBuf),
    /// WRITE access to this buffer.
    Write(Rc<RefCell<PayloadBufMut>>),
    /// READ access to memory the grantor keeps writing ([`SharedArea`]).
    Area(Rc<RefCell<PayloadBufMut>>),
}

/// Memory the grantor keeps writing and the peer may READ one-sidedly for as long
/// as the area lives: the reply area of remote fetching (RFP), where an OSD leaves
/// replies that the client fetches. Unlike a [`Grant`] of a [`PayloadBuf`] (shared,
/// immutable), the owner writes it in place with [`SharedArea::write_at`]; a peer
/// READ racing with a write may see a mix of old and new bytes, so what is written
/// must let the reader tell (Flame's replies carry their id and checksums).
pub struct SharedArea {
    remote: RemoteBuf,
    owner: Rc<dyn GrantOwner>,
    /// Copies bytes in at an offset (bounds already checked against `remote.len`).
    writer: AreaWriter,
}

/// How a [`SharedArea`] copies bytes in at an offset (transport-specific).
pub(crate) type AreaWriter = Box<dyn Fn(usize, &[u8])>;

/// The writer of an area whose bytes are a local buffer (tcp: the emulated READ
/// copies a snapshot of it).
pub(crate) fn buffer_writer(buf: Rc<RefCell<PayloadBufMut>>) -> AreaWriter {
    Box::new(move |offset, data| {
        buf.borrow_mut().as_mut_slice()[offset..offset + data.len()].copy_from_slice(data)
    })
}

impl SharedArea {
    pub(crate) fn new(
        remote: RemoteBuf,
        owner: Rc<dyn GrantOwner>,
        writer: AreaWriter,
    ) -> SharedArea {
        SharedArea {
            remote,
            owner,
            writer,
        }
    }

    /// The descriptor of the whole area (a peer may READ any part of it).
    pub fn remote(&self) -> RemoteBuf {
        self.remote
    }

    /// Size in bytes.
    pub fn len(&self) -> usize {
        self.remote.len as usize
    }

    /// Whether the area has no bytes (never: a grant has at least one).
    pub fn is_empty(&self) -> bool {
        self.remote.len == 0
    }

    /// Copies `data` into the area at `offset`; `false` (nothing written) if it
    /// does not fit.
    pub fn write_at(&self, offset: usize, data: &[u8]) -> bool {
        match offset.checked_add(data.len()) {
            Some(end) if end <= self.len() => {
                (self.writer)(offset, data);
                true
            }
            _ => false,
        }
    }
}

impl Drop for SharedArea {
    fn drop(&mut self) {
        self.owner.revoke(self.remote.key, None);
    }
}

impl std::fmt::Debug for SharedArea {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedArea")
            .field("remote", &self.remote)
            .finish()
    }
}

/// A grant table: key → (address, length, buffer).
#[derive(Default)]
pub(crate) struct GrantTable {
    map: RefCell<HashMap<u32, (u64, u32, GrantedBuf)>>,
}

impl GrantTable {
    /// Registers a grant, returning its descriptor.
    pub(crate) fn insert(
        &self,
        addr: u64,
        len: u32,
        buf: GrantedBuf,
    ) -> Result<RemoteBuf, TransportError> {
        let mut map = self.map.borrow_mut();
        if map.len() >= GRANTS_PER_CONN_MAX {
            return Err(TransportError::Grant(format!(
                "{GRANTS_PER_CONN_MAX} grants are live on this connection: release some first"
            )));
        }
        let key = random_key(|k| map.contains_key(&k));
        map.insert(key, (addr, len, buf));
        Ok(RemoteBuf { addr, len, key })
    }

    /// Ends a grant; returns whether it existed.
    pub(crate) fn remove(&self, key: u32) -> bool {
        self.map.borrow_mut().remove(&key).is_some()
    }

    /// Serves a READ of `[addr, addr + len)`: the bytes, by reference.
    pub(crate) fn read(&self, key: u32, addr: u64, len: u64) -> Result<PayloadBuf, Refusal> {
        let map = self.map.borrow();
        let (base, base_len, buf) = map.get(&key).ok_or(Refusal::UnknownKey)?;
        let off = check_bounds(*base, *base_len, addr, len)?;
        match buf {
            GrantedBuf::Read(data) => Ok(data.slice(off..off + len as usize)),
            // A snapshot: the owner keeps writing the area.
            GrantedBuf::Area(area) => Ok(PayloadBuf::copy_from(
                &area.borrow().as_slice()[off..off + len as usize],
            )),
            GrantedBuf::Write(_) => Err(Refusal::WrongAccess),
        }
    }

    /// Serves a WRITE of `data` at `addr`.
    pub(crate) fn write(&self, key: u32, addr: u64, data: &[u8]) -> Result<(), Refusal> {
        let map = self.map.borrow();
        let (base, base_len, buf) = map.get(&key).ok_or(Refusal::UnknownKey)?;
        let GrantedBuf::Write(target) = buf else {
            return Err(Refusal::WrongAccess);
        };
        let off = check_bounds(*base, *base_len, addr, data.len() as u64)?;
        target.borrow_mut().as_mut_slice()[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }

    /// Number of live grants.
    pub(crate) fn len(&self) -> usize {
        self.map.borrow().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_are_checked_without_overflow() {
        assert_eq!(check_bounds(1000, 100, 1000, 100), Ok(0));
        assert_eq!(check_bounds(1000, 100, 1050, 50), Ok(50));
        assert_eq!(check_bounds(1000, 100, 1050, 51), Err(Refusal::OutOfBounds));
        assert_eq!(check_bounds(1000, 100, 999, 1), Err(Refusal::OutOfBounds));
        assert_eq!(check_bounds(1000, 100, 1000, 0), Err(Refusal::OutOfBounds));
        assert_eq!(
            check_bounds(1000, 100, u64::MAX, 2),
            Err(Refusal::OutOfBounds)
        );
    }

    #[test]
    fn keys_are_random_and_not_zero() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..1000 {
            let k = random_key(|k| seen.contains(&k));
            assert_ne!(k, 0);
            assert!(seen.insert(k));
        }
        // Not sequential: consecutive keys differ by more than a small step.
        let ks: Vec<u32> = (0..100).map(|_| random_key(|_| false)).collect();
        let small = ks.windows(2).filter(|w| w[0].abs_diff(w[1]) < 1000).count();
        assert!(small < 5, "{small} near-sequential keys");
    }
}
