//! Reads that never return a block that fails its checksum, and heal it instead.
//!
//! The primary serves client reads. When its store reports blocks that do not match
//! their checksums, the primary — with the write gate held over those blocks, so no
//! write to them runs meanwhile — asks each replica in turn for the block (a
//! replica-flagged read: the replica verifies its own copy and answers EIO if it is
//! bad too, which is how a replica reports a mismatch). The first copy that
//! verifies is written over the primary's bad block and over every replica that
//! reported it bad, and the read is served again from the repaired store. Only when
//! no copy verifies does the read fail with EIO. A replica the group's log shows
//! missing a write over the bytes (a full disk refused it, say) is never the
//! source: its older bytes would undo the write on the primary only
//! ([`crate::pg_core::PgCore::repair_sources`]); if no other copy can be asked,
//! the read gets EAGAIN. Every block is counted in
//! `flame_osd_checksum_errors_total{result="repaired"|"unrepaired"}` and logged.

use crate::pg::MapView;
use crate::shard::Shard;
use crate::store::StoreError;
use crate::store::meta::BLOCK;
use flame_common::buffer::PayloadBuf;
use flame_common::ids::{OsdId, PgSeq, RequestId};
use flame_common::protocol::{IoTarget, Message, flags, status};
use std::rc::Rc;

/// Bad blocks one read repairs at most; a read finding more fails with EIO (an
/// object that corrupt is recovery's job, and the bound keeps one read's work small).
const REPAIR_BLOCKS_MAX: usize = 64;

impl Shard {
    /// Asks one replica for `target`'s bytes from its own copy (a REPLICA-flagged
    /// read: the replica verifies its checksums and answers EIO for a bad block).
    pub(crate) async fn read_replica(
        &self,
        osd: &flame_common::map::OsdInfo,
        target: IoTarget,
        epoch: flame_common::ids::Epoch,
    ) -> Result<Message, i32> {
        let shard = osd.shard_of(target.pg);
        let read = Message::Read {
            id: RequestId(0),
            epoch,
            target,
            flags: flags::REPLICA,
            remote: None,
        };
        self.peers.call_reply(osd, shard, epoch, read).await
    }

    /// The acting replicas whose copy of `target`'s bytes may replace the
    /// primary's, in the map's order ([`crate::pg_core::PgCore::repair_sources`]),
    /// and whether any replica was left out. Never `exclude`: the member
    /// recovery is bringing up to date with this copy (its bytes are what is
    /// in question).
    fn repair_sources(
        &self,
        view: &MapView,
        target: &IoTarget,
        exclude: Option<OsdId>,
    ) -> (Vec<OsdId>, bool) {
        let replicas: Vec<OsdId> = view
            .table
            .pg(target.pg)
            .acting
            .iter()
            .skip(1)
            .copied()
            .filter(|&m| Some(m) != exclude)
            .collect();
        let sources = match self.pgs.borrow().get(target.pg) {
            Some(core) => {
                core.repair_sources(&replicas, target.object, target.offset, target.length)
            }
            None => replicas.clone(),
        };
        let left_out = sources.len() < replicas.len();
        (sources, left_out)
    }

    /// Reads `target` on the primary, repairing bad blocks from the replicas.
    /// Returns the status and the data.
    pub(crate) async fn read_repairing(
        self: &Rc<Self>,
        view: &Rc<MapView>,
        target: &IoTarget,
    ) -> (i32, PayloadBuf) {
        let first = self
            .store
            .read(target.pg, target.object, target.offset, target.length)
            .await;
        let blocks = match first {
            Ok(data) => return (status::OK, data),
            Err(StoreError::Checksum { blocks, .. }) => blocks,
            // The shard's memory pool stayed exhausted: not a disk error, the
            // client tries again.
            Err(StoreError::Io(e)) if e.kind() == std::io::ErrorKind::OutOfMemory => {
                tracing::warn!(object = %target.object, "read deferred: {e}");
                return (status::EAGAIN, PayloadBuf::empty());
            }
            Err(StoreError::Io(e)) if e.kind() != std::io::ErrorKind::InvalidInput => {
                tracing::error!(object = %target.object, "read failed: {e}; reading another copy");
                return self.read_from_copy(view, target).await;
            }
            Err(e) => {
                tracing::error!(object = %target.object, "read failed: {e}");
                return (status::EIO, PayloadBuf::empty());
            }
        };
        if blocks.is_empty() || blocks.len() > REPAIR_BLOCKS_MAX {
            crate::metrics::checksum_errors(false, blocks.len() as u64);
            tracing::error!(object = %target.object, blocks = blocks.len(), "too many bad blocks to repair on read");
            return (status::EIO, PayloadBuf::empty());
        }
        let block_bytes = BLOCK as u32;
        let lo = blocks.iter().min().copied().unwrap_or(0) * block_bytes;
        let hi = (blocks.iter().max().copied().unwrap_or(0) + 1) * block_bytes;
        // No write to these blocks may run while they are being replaced: take the
        // same gate as writes (waiting for earlier overlapping ones).
        let (_guard, earlier) = self.gate.enter(target.object, lo, hi);
        for e in earlier {
            e.wait().await;
        }
        let mut unrepaired = 0u64;
        let mut unasked = false;
        for &block in &blocks {
            match self.repair_one(view, target, block, None).await {
                Ok(()) => {}
                Err(status::EAGAIN) => unasked = true,
                Err(_) => unrepaired += 1,
            }
        }
        if unrepaired == 0 && unasked {
            // Some block had no answer from another copy: the client retries.
            return (status::EAGAIN, PayloadBuf::empty());
        }
        if unrepaired > 0 {
            crate::metrics::checksum_errors(false, unrepaired);
            tracing::error!(object = %target.object, unrepaired, "no copy of some blocks verifies; read fails");
            return (status::EIO, PayloadBuf::empty());
        }
        match self
            .store
            .read(target.pg, target.object, target.offset, target.length)
            .await
        {
            Ok(data) => (status::OK, data),
            Err(e) => {
                tracing::error!(object = %target.object, "read failed after repair: {e}");
                (status::EIO, PayloadBuf::empty())
            }
        }
    }

    /// The primary's disk failed a read (an I/O error, not a mismatch): serves the
    /// whole blocks under `target` from the first replica that has them (the
    /// replica verifies its copy), rewrites them over the primary's copy (the device
    /// remaps a bad sector on a write) and counts it in
    /// `flame_osd_read_errors_total`. Holds the write gate over the blocks, as a
    /// checksum repair does. EIO only when no copy can be read.
    async fn read_from_copy(
        self: &Rc<Self>,
        view: &Rc<MapView>,
        target: &IoTarget,
    ) -> (i32, PayloadBuf) {
        let block_bytes = BLOCK as u32;
        let first = target.offset / block_bytes;
        let end = (target.offset + target.length).div_ceil(block_bytes);
        let (lo, hi) = (first * block_bytes, end * block_bytes);
        let (_guard, earlier) = self.gate.enter(target.object, lo, hi);
        for e in earlier {
            e.wait().await;
        }
        let span = IoTarget {
            pg: target.pg,
            object: target.object,
            offset: lo,
            length: hi - lo,
        };
        let epoch = view.map.epoch;
        // Replicas that could not be asked (unreachable, busy, another map), or
        // were not (their copy lacks a write this one holds, until it is caught
        // up): their copies may well be good.
        let (replicas, mut unasked) = self.repair_sources(view, &span, None);
        let mut good = None;
        for id in replicas {
            let Some(osd) = view.map.osds.get(&id) else {
                continue;
            };
            match self.read_replica(osd, span.clone(), epoch).await {
                Ok(Message::Reply {
                    status: status::OK,
                    data,
                    ..
                }) if data.len() == span.length as usize => {
                    good = Some(data);
                    break;
                }
                other => {
                    let st = match other {
                        Ok(Message::Reply { status, .. }) => status,
                        Ok(_) => status::EIO,
                        Err(st) => st,
                    };
                    unasked |= st != status::EIO;
                    tracing::warn!(object = %target.object, replica = %id, status = st, "replica could not provide the range");
                }
            }
        }
        let Some(good) = good else {
            if unasked {
                // Not every other copy answered: the client retries (perhaps at
                // another primary), rather than fail a read a copy could serve
                // (simulator seed 103: a primary cut off from its replicas).
                tracing::warn!(object = %target.object, "the disk failed a read and no other copy could be asked; the client retries");
                return (status::EAGAIN, PayloadBuf::empty());
            }
            crate::metrics::read_errors(false);
            tracing::error!(object = %target.object, "no other copy could be read; read fails");
            return (status::EIO, PayloadBuf::empty());
        };
        // Another copy's bytes replace these blocks: the log no longer proves
        // which ops this copy holds there (as in `repair_one`). Without this, a
        // retry of a write this copy held but the other did not would be
        // answered as a duplicate from the replaced, older bytes.
        self.forget_proof(target.pg, target.object, lo, hi - lo);
        match self
            .store
            .repair_range(target.pg, target.object, first, good.as_slice())
            .await
        {
            Ok(()) => {
                tracing::warn!(object = %target.object, blocks = end - first, "rewrote blocks the disk failed to read, from another copy")
            }
            // The data is still right: serve it; the next read tries again.
            Err(e) => {
                tracing::error!(object = %target.object, "rewriting blocks the disk failed to read failed: {e}")
            }
        }
        crate::metrics::read_errors(true);
        let start = (target.offset - lo) as usize;
        (
            status::OK,
            good.slice(start..start + target.length as usize),
        )
    }

    /// Fetches `block` from the first replica whose copy verifies, writes it over the
    /// primary's copy and over the copies of replicas that reported it bad. `Ok`:
    /// the primary's block is good now; `EAGAIN`: no copy verified but some could
    /// not be asked (unreachable, busy); `EIO`: none verifies, or the rewrite failed.
    /// `exclude`: a replica not to ask (recovery's target member).
    pub(crate) async fn repair_one(
        self: &Rc<Self>,
        view: &MapView,
        target: &IoTarget,
        block: u32,
        exclude: Option<OsdId>,
    ) -> Result<(), i32> {
        let block_target = IoTarget {
            pg: target.pg,
            object: target.object,
            offset: block * BLOCK as u32,
            length: BLOCK as u32,
        };
        let epoch = view.map.epoch;
        let mut bad_replicas = Vec::new();
        let mut good = None;
        // A replica whose copy lacks a write this one holds is not asked (nor
        // repaired here): its catch-up brings it this copy's bytes.
        let (sources, mut unasked) = self.repair_sources(view, &block_target, exclude);
        for id in sources {
            let Some(osd) = view.map.osds.get(&id) else {
                continue;
            };
            match self.read_replica(osd, block_target.clone(), epoch).await {
                Ok(Message::Reply {
                    status: status::OK,
                    data,
                    ..
                }) if data.len() == BLOCK => {
                    good = Some(data);
                    break;
                }
                Ok(Message::Reply {
                    status: status::EIO,
                    ..
                }) => {
                    tracing::warn!(object = %target.object, block, replica = %id, "replica reports its copy of the block bad too");
                    bad_replicas.push(id);
                }
                other => {
                    let st = match other {
                        Ok(Message::Reply { status, .. }) => status,
                        Ok(_) => status::EIO,
                        Err(st) => st,
                    };
                    unasked = true;
                    tracing::warn!(object = %target.object, block, replica = %id, status = st, "replica could not provide the block");
                }
            }
        }
        let Some(good) = good else {
            return Err(if unasked { status::EAGAIN } else { status::EIO });
        };
        // Another copy's bytes replace this block: the log no longer proves which
        // ops this copy holds there.
        self.forget_proof(
            target.pg,
            target.object,
            block_target.offset,
            block_target.length,
        );
        if let Err(e) = self
            .store
            .repair_block(target.pg, target.object, block, good.as_slice())
            .await
        {
            tracing::error!(object = %target.object, block, "repairing the primary's block failed: {e}");
            return Err(status::EIO);
        }
        for id in bad_replicas {
            let Some(osd) = view.map.osds.get(&id) else {
                continue;
            };
            let write = Message::Write {
                id: RequestId(0),
                epoch,
                target: block_target.clone(),
                flags: flags::REPLICA | flags::FUA,
                seq: PgSeq(0),
                op: flame_common::ids::OpId::NONE,
                remote: None,
                data: good.clone(),
            };
            let st = self
                .peers
                .call(osd, osd.shard_of(target.pg), epoch, write)
                .await;
            if st == status::OK {
                crate::metrics::checksum_errors(true, 1);
                tracing::warn!(object = %target.object, block, replica = %id, "repaired the replica's block from another copy");
            } else {
                tracing::error!(object = %target.object, block, replica = %id, status = st, "could not repair the replica's block");
            }
        }
        Ok(())
    }
}
