//! Resizing a volume without ever showing old bytes where zeroes are promised.
//!
//! Growing is a map change only: bytes past the old end were never written, so they
//! read as zeroes. Shrinking is not: the bytes past the new end stay in the OSDs'
//! objects, and a later grow would show them again. So a shrink is three steps,
//! each safe to interrupt:
//!
//! 1. The manager sets the new size and, in the same epoch (one persisted state
//!    write), records the cut-off range `[new size, old size)` as a *pending trim*.
//!    I/O sees the new size at once; the manager refuses to grow the volume while
//!    the trim is pending, whatever client asks.
//! 2. This module discards the range on every copy through the OSD protocol — the
//!    partial tail of the last object and every whole object after it, each piece
//!    sent to the object's primary, which applies it on every replica before it
//!    answers — and then flushes, so the removal is stable on every copy.
//! 3. It reports the range done; the manager clears the pending trim (if no further
//!    shrink widened it meanwhile) and growth is allowed again.
//!
//! A down OSD does not stop the trim: like any write, each discard is applied by the
//! placement group's complete copies that are up (at least `pool.min_size`) and its
//! recovering members, and a member that was down is recovered — which brings it the
//! discards it missed — before it serves again. A crash, or a timeout (a placement
//! group below `min_size` waits until enough copies are back), leaves the trim
//! pending: the volume cannot grow, health says so, and running the resize again
//! (any size, including the current one) completes the trim first.
//! [`resize_volume`] always does that before growing.
//!
//! Limits: the trim costs one request per object (4 MiB by default) of the removed
//! range, existing or not (thin volumes have no list of their objects). A client
//! still writing past the new end with a map older than the shrink cannot land a
//! write after the discard: the primary checks every write against the volume's
//! end in its own map, which is at least as new as the shrink once it serves the
//! trim (`flame_osd::pg::MapView::check_write_inside_volume`).

use crate::cluster::Cluster;
use crate::error::ClientError;
use crate::io::{self, PieceOp, piece_io};
use crate::join::try_join_bounded;
use crate::split::split;
use crate::{ClientConfig, MgrClient};
use flame_common::ids::VolumeId;
use flame_common::map::VolumeInfo;
use flame_common::mgr_api::{TrimDone, TrimRange};
use flame_common::protocol::IO_BYTES_MAX;
use flame_common::reactor::{Reactor, ReactorConfig};

/// Discards in flight at once during a trim.
const TRIM_WINDOW: usize = 64;
/// Pieces per batch (bounds the bookkeeping of one batch, whatever the range).
const TRIM_BATCH_PIECES: u64 = 4096;
/// Times [`resize_volume`] trims and reports before giving up, in case other
/// shrinks keep widening the pending range meanwhile.
const TRIM_ROUNDS_MAX: usize = 4;

/// Why a resize failed, with what state it left the volume in.
#[derive(Debug, thiserror::Error)]
pub enum ResizeError {
    /// Nothing changed (the manager refused, or could not be reached).
    #[error("{0}")]
    Refused(#[source] ClientError),
    /// The volume has its new (smaller) size for I/O, but the old bytes past it
    /// could not be removed on every copy yet; the trim stays pending.
    #[error(
        "volume {name} now has {size} bytes, but removing its old bytes {from}..{to} from \
         every OSD failed: {source}. The shrink stands and the volume cannot grow until the \
         trim completes: run the same resize again (once `flame-admin status` shows no \
         placement group waiting)"
    )]
    TrimIncomplete {
        /// Volume name.
        name: String,
        /// Its size now.
        size: u64,
        /// Start of the pending range.
        from: u64,
        /// End of the pending range.
        to: u64,
        /// What failed.
        #[source]
        source: ClientError,
    },
}

/// Resizes volume `name` to `size` bytes through the manager at `config.mgr`,
/// blocking until done; see the module documentation. Shrinking needs
/// `allow_shrink` and returns only once the cut-off bytes are gone from every copy.
/// Growing a volume with a pending trim (an earlier shrink that did not finish)
/// completes that trim first. Runs its own I/O reactor on the calling thread, so
/// call it from a plain thread, not from a reactor task.
pub fn resize_volume(
    config: &ClientConfig,
    name: &str,
    size: u64,
    allow_shrink: bool,
) -> Result<VolumeInfo, ResizeError> {
    let mgr = config.mgr_client().map_err(ResizeError::Refused)?;
    let mut vol = mgr.volume(name).map_err(ResizeError::Refused)?;
    if size < vol.size {
        // The manager checks allow_shrink and records the pending trim.
        vol = mgr
            .resize_volume(name, size, allow_shrink)
            .map_err(ResizeError::Refused)?;
    }
    complete_trim(config, &mgr, &vol)?;
    if size > vol.size {
        vol = mgr
            .resize_volume(name, size, allow_shrink)
            .map_err(ResizeError::Refused)?;
    }
    Ok(vol)
}

/// Trims and reports until the manager has no pending trim for `vol` (bounded).
fn complete_trim(
    config: &ClientConfig,
    mgr: &MgrClient,
    vol: &VolumeInfo,
) -> Result<(), ResizeError> {
    let mut trim = mgr.volume_trim(&vol.name).map_err(ResizeError::Refused)?;
    if trim.volume != vol.id {
        return Err(ResizeError::Refused(ClientError::NoSuchVolume(
            vol.name.clone(),
        )));
    }
    let Some(mut range) = trim.pending else {
        return Ok(());
    };
    let incomplete = |range: TrimRange, source: ClientError| ResizeError::TrimIncomplete {
        name: vol.name.clone(),
        size: range.from,
        from: range.from,
        to: range.to,
        source,
    };
    let cluster = Cluster::connect(config.clone()).map_err(|e| incomplete(range, e))?;
    let mut reactor = Reactor::new(ReactorConfig::default()).map_err(|e| {
        incomplete(
            range,
            ClientError::Io {
                context: "starting the I/O reactor".into(),
                source: e,
            },
        )
    })?;
    for _ in 0..TRIM_ROUNDS_MAX {
        let c = cluster.clone();
        let id = vol.id;
        reactor
            .block_on(async move { trim_range(&c, id, range).await })
            .map_err(|e| {
                incomplete(
                    range,
                    ClientError::Io {
                        context: "I/O reactor failed".into(),
                        source: e,
                    },
                )
            })?
            .map_err(|e| incomplete(range, e))?;
        trim = mgr
            .trim_done(
                &vol.name,
                &TrimDone {
                    volume: vol.id,
                    range,
                },
            )
            .map_err(|e| incomplete(range, e))?;
        match trim.pending {
            None => return Ok(()),
            Some(r) => range = r,
        }
    }
    Err(incomplete(
        range,
        ClientError::InvalidArgument(format!(
            "the pending range kept changing over {TRIM_ROUNDS_MAX} rounds (concurrent shrinks)"
        )),
    ))
}

/// Makes `range` of volume `volume` read as zeroes on every copy, stably: discards
/// every piece (the primary applies each on every member of the placement group's
/// write set before answering; members that are down get it through recovery), then
/// flushes. Must run on a reactor thread.
pub async fn trim_range(
    cluster: &Cluster,
    volume: VolumeId,
    range: TrimRange,
) -> Result<(), ClientError> {
    let map = cluster.map();
    let object_size = map.pool.object_size;
    let piece_bytes = u64::from(object_size.min(IO_BYTES_MAX));
    let mut at = range.from;
    while at < range.to {
        let end = range
            .to
            .min(at.saturating_add(piece_bytes.saturating_mul(TRIM_BATCH_PIECES)));
        let pieces = split(at, end - at, object_size, IO_BYTES_MAX);
        try_join_bounded(pieces, TRIM_WINDOW, |p| {
            piece_io(
                cluster,
                volume,
                p,
                PieceOp::Discard,
                io::deadline_from_now(cluster),
            )
        })
        .await?;
        at = end;
    }
    // The trimmed objects lie past the new end: flush the groups the old size
    // reaches, not only those of the new size.
    io::flush_volume_objects(cluster, volume, Some(range.to)).await
}
