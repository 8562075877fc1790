//! Buffers the kernel may read or write during an operation.
//!
//! An operation takes ownership of its buffer and gives it back on completion, so
//! the buffer cannot move or be freed while the kernel uses it. `Vec<u8>` serves
//! buffered I/O and sockets; [`AlignedBuf`] serves `O_DIRECT`, which needs the
//! memory address, the length and the file offset aligned to the device's block.
//! Payloads (write data, read replies) use [`crate::buffer`]'s payload buffers, which
//! are aligned too and implement these traits, so the data path needs no
//! `AlignedBuf` copy.

use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

/// Memory an operation may read from.
///
/// # Safety
/// `as_ptr` must stay valid for `len` bytes while the value is moved around (the
/// kernel holds the address during the operation): heap memory, not inline arrays.
pub unsafe trait IoBuf: 'static {
    /// Start of the bytes.
    fn as_ptr(&self) -> *const u8;
    /// Number of bytes.
    fn len(&self) -> usize;
    /// Whether there are no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Memory an operation may write into.
///
/// # Safety
/// As for [`IoBuf`].
pub unsafe trait IoBufMut: IoBuf {
    /// Start of the bytes.
    fn as_mut_ptr(&mut self) -> *mut u8;
}

// SAFETY: a Vec's heap buffer does not move when the Vec does.
unsafe impl IoBuf for Vec<u8> {
    fn as_ptr(&self) -> *const u8 {
        self.as_slice().as_ptr()
    }
    fn len(&self) -> usize {
        Vec::len(self)
    }
}

// SAFETY: as above.
unsafe impl IoBufMut for Vec<u8> {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_slice().as_mut_ptr()
    }
}

/// Alignment of [`AlignedBuf`]: 4 KiB covers every logical block size in use.
pub const DIRECT_IO_ALIGN: usize = 4096;

/// A zero-initialised buffer aligned to [`DIRECT_IO_ALIGN`], for `O_DIRECT`.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// Allocated bytes (≥ `len`, ≥ 1).
    cap: usize,
}

// SAFETY: AlignedBuf owns its allocation exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zero bytes.
    pub fn zeroed(len: usize) -> AlignedBuf {
        let cap = len.max(1);
        let layout = Self::layout(cap);
        // SAFETY: layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout);
        };
        AlignedBuf { ptr, len, cap }
    }

    /// Copies `data` into a new aligned buffer of the same length.
    pub fn copy_from(data: &[u8]) -> AlignedBuf {
        let mut b = AlignedBuf::zeroed(data.len());
        b.as_mut_slice().copy_from_slice(data);
        b
    }

    fn layout(len: usize) -> Layout {
        match Layout::from_size_align(len, DIRECT_IO_ALIGN) {
            Ok(l) => l,
            Err(_) => panic!("aligned buffer of {len} bytes is not allocatable"),
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and we hold &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with the same layout.
        unsafe { dealloc(self.ptr.as_ptr(), Self::layout(self.cap)) }
    }
}

// SAFETY: the allocation is owned and never moves.
unsafe impl IoBuf for AlignedBuf {
    fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

// SAFETY: as above.
unsafe impl IoBufMut for AlignedBuf {
    fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_zeroed() {
        let b = AlignedBuf::zeroed(8192);
        assert_eq!(b.as_ptr() as usize % DIRECT_IO_ALIGN, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
        let c = AlignedBuf::copy_from(b"abc");
        assert_eq!(c.as_slice(), b"abc");
        assert!(AlignedBuf::copy_from(&[]).is_empty());
    }
}
