//! Cutting a byte range of a volume into per-object pieces.
//!
//! An OSD request names one object, and one message carries at most
//! [`flame_common::protocol::IO_BYTES_MAX`] bytes, so every volume request becomes
//! one or more pieces that never cross an object boundary and are never longer than
//! that bound. The pieces are independent (different objects usually live on
//! different OSDs), which is what lets the volume issue them concurrently.

/// One piece of a volume request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index of the object within the volume.
    pub object_index: u64,
    /// Offset within that object.
    pub object_offset: u32,
    /// Bytes in this piece (≥ 1).
    pub length: u32,
    /// Offset of this piece within the caller's request (and its buffer).
    pub request_offset: u64,
}

/// Iterator over the pieces of `[offset, offset + length)`.
#[derive(Clone, Debug)]
pub struct Pieces {
    pos: u64,
    end: u64,
    start: u64,
    object_size: u64,
    piece_bytes_max: u64,
}

/// Splits `[offset, offset + length)` at multiples of `object_size` and into pieces
/// of at most `piece_bytes_max` bytes. `object_size` and `piece_bytes_max` must be
/// positive and ≤ u32::MAX (the map and the protocol guarantee both); a range that
/// overflows u64 yields pieces up to u64::MAX only — callers check ranges against the
/// volume size first.
pub fn split(offset: u64, length: u64, object_size: u32, piece_bytes_max: u32) -> Pieces {
    Pieces {
        pos: offset,
        end: offset.saturating_add(length),
        start: offset,
        object_size: u64::from(object_size.max(1)),
        piece_bytes_max: u64::from(piece_bytes_max.max(1)),
    }
}

impl Iterator for Pieces {
    type Item = Piece;

    fn next(&mut self) -> Option<Piece> {
        if self.pos >= self.end {
            return None;
        }
        let object_index = self.pos / self.object_size;
        let object_offset = self.pos % self.object_size;
        let to_object_end = self.object_size - object_offset;
        let len = (self.end - self.pos)
            .min(to_object_end)
            .min(self.piece_bytes_max);
        let piece = Piece {
            object_index,
            // Both < object_size ≤ u32::MAX.
            object_offset: object_offset as u32,
            length: len as u32,
            request_offset: self.pos - self.start,
        };
        self.pos += len;
        Some(piece)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        if self.pos >= self.end {
            return (0, Some(0));
        }
        // At least one piece per piece_bytes_max bytes; at most one more per object.
        let bytes = self.end - self.pos;
        let lo = bytes.div_ceil(self.piece_bytes_max);
        let hi = lo + bytes / self.object_size + 1;
        (
            usize::try_from(lo).unwrap_or(usize::MAX),
            usize::try_from(hi).ok(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn all(offset: u64, len: u64, obj: u32, max: u32) -> Vec<Piece> {
        split(offset, len, obj, max).collect()
    }

    /// Every byte covered exactly once, in order, no piece crossing an object or
    /// exceeding the bound.
    fn check_cover(offset: u64, len: u64, obj: u32, max: u32) {
        let pieces = all(offset, len, obj, max);
        let mut next = 0u64;
        for p in &pieces {
            assert_eq!(p.request_offset, next, "{pieces:?}");
            assert!(p.length >= 1 && p.length <= max);
            let abs = offset + p.request_offset;
            assert_eq!(abs / u64::from(obj), p.object_index);
            assert_eq!(abs % u64::from(obj), u64::from(p.object_offset));
            assert!(u64::from(p.object_offset) + u64::from(p.length) <= u64::from(obj));
            next += u64::from(p.length);
        }
        assert_eq!(next, len);
        let (lo, hi) = split(offset, len, obj, max).size_hint();
        assert!(lo <= pieces.len() && pieces.len() <= hi.unwrap());
    }

    #[test]
    fn empty_range_has_no_pieces() {
        assert!(all(123, 0, 4 << 20, 4 << 20).is_empty());
    }

    #[test]
    fn within_one_object() {
        assert_eq!(
            all(4096, 8192, 4 << 20, 4 << 20),
            vec![Piece {
                object_index: 0,
                object_offset: 4096,
                length: 8192,
                request_offset: 0
            }]
        );
    }

    #[test]
    fn crossing_an_object_boundary() {
        let p = all(4 * MIB - 512, 1024, 4 << 20, 4 << 20);
        assert_eq!(
            p,
            vec![
                Piece {
                    object_index: 0,
                    object_offset: (4 << 20) - 512,
                    length: 512,
                    request_offset: 0
                },
                Piece {
                    object_index: 1,
                    object_offset: 0,
                    length: 512,
                    request_offset: 512
                },
            ]
        );
    }

    #[test]
    fn large_objects_are_cut_at_the_message_bound() {
        // 16 MiB objects, 4 MiB messages: a 10 MiB read from 1 MiB is 4+4+2.
        let p = all(MIB, 10 * MIB, 16 << 20, 4 << 20);
        let lens: Vec<u32> = p.iter().map(|p| p.length).collect();
        assert_eq!(lens, vec![4 << 20, 4 << 20, 2 << 20]);
        assert!(p.iter().all(|p| p.object_index == 0));
        assert_eq!(p[2].object_offset, 9 << 20);
    }

    #[test]
    fn exact_object_multiples() {
        let p = all(8 * MIB, 8 * MIB, 4 << 20, 4 << 20);
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].object_index, p[1].object_index), (2, 3));
        assert!(
            p.iter()
                .all(|p| p.object_offset == 0 && p.length == 4 << 20)
        );
    }

    #[test]
    fn many_shapes_cover_exactly() {
        let objs = [64 << 10, 4 << 20, 64 << 20];
        let maxes = [4096, 64 << 10, 4 << 20];
        let offsets = [0, 1, 4095, 65_535, 4 * MIB - 1, 5 * MIB + 3, (1 << 40) - 7];
        let lens = [1, 511, 4096, 65_536, 4 * MIB + 1, 9 * MIB - 3];
        for &o in &objs {
            for &m in &maxes {
                for &off in &offsets {
                    for &len in &lens {
                        check_cover(off, len, o, m);
                    }
                }
            }
        }
    }

    #[test]
    fn huge_offsets_do_not_overflow() {
        let p = all(u64::MAX - 10, 100, 4 << 20, 4 << 20);
        let total: u64 = p.iter().map(|p| u64::from(p.length)).sum();
        assert_eq!(total, 10);
    }
}
