//! Scrub requests: `flame-admin scrub` and `flame-admin pg compare` ask the primary
//! of each placement group concerned to compare (and repair) its acting copies.

use super::{Try, back_off, bounded, exchange, target_for, timeout};
use crate::cluster::Cluster;
use crate::error::ClientError;
use crate::retry::{Backoff, RetryReason, Verdict, classify};
use flame_common::clock;
use flame_common::ids::{PgId, RequestId, VolumeId};
use flame_common::placement;
use flame_common::protocol::{Message, ScrubCounts};

/// How long one placement group's scrub may take at most (it reads every object
/// of every copy; a large group under a byte-rate limit takes a while).
const SCRUB_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

impl Cluster {
    /// Asks the primary of `pg` to compare its acting copies and, unless
    /// `dry_run`, repair the ones that differ from the agreeing majority. Retries
    /// while the group has no primary or the map is moving, until the deadline.
    pub async fn scrub_pg(&self, pg: PgId, dry_run: bool) -> Result<ScrubCounts, ClientError> {
        let deadline = clock::now() + SCRUB_TIMEOUT.max(self.config().io_timeout());
        let mut backoff = Backoff::new(deadline);
        let mut last: Option<String> = None;
        loop {
            let map = self.map();
            let primary = placement::PgMembers::compute(&map, pg).primary();
            let t = match primary.and_then(|p| map.osds.get(&p)) {
                None => super::Transient {
                    reason: RetryReason::OsdDown,
                    message: format!("{pg} has no primary up"),
                },
                Some(info) => {
                    let shard = info.shard_of(pg);
                    let target = target_for(self, &map, info, shard);
                    let osd = info.id;
                    let msg = Message::Scrub {
                        id: RequestId(0),
                        epoch: map.epoch,
                        pg,
                        dry_run,
                    };
                    let attempt = async {
                        match exchange(self, &target, &msg, super::Transfer::default()).await {
                            Ok(reply) => {
                                self.note_epoch(reply.epoch);
                                match classify(reply.status) {
                                    Verdict::Done => match ScrubCounts::decode(&reply.data) {
                                        Some(c) => Try::Done(c),
                                        None => Try::Fail(ClientError::Osd {
                                            osd,
                                            op: "scrub",
                                            status: flame_common::protocol::status::EIO,
                                        }),
                                    },
                                    Verdict::Retry(reason) => Try::Retry(super::Transient {
                                        reason,
                                        message: format!(
                                            "{osd} answered {} for {pg}",
                                            crate::error::errno_name(reply.status)
                                        ),
                                    }),
                                    Verdict::Fail => Try::Fail(ClientError::Osd {
                                        osd,
                                        op: "scrub",
                                        status: reply.status,
                                    }),
                                }
                            }
                            Err(t) => Try::Retry(t),
                        }
                    };
                    match bounded(deadline, attempt).await {
                        None => {
                            let why = last.unwrap_or_else(|| format!("no answer for {pg} in time"));
                            return Err(timeout(self, "scrub", why));
                        }
                        Some(Try::Done(c)) => return Ok(c),
                        Some(Try::Fail(e)) => return Err(e),
                        Some(Try::Retry(t)) => t,
                    }
                }
            };
            last = Some(t.message.clone());
            back_off(self, &mut backoff, "scrub", t).await?;
        }
    }

    /// The placement groups that can hold objects of `volume` (of `size` bytes).
    pub fn volume_pgs(&self, volume: VolumeId, size: u64) -> Vec<PgId> {
        super::volume_pgs(volume, size, &self.map().pool)
    }
}
