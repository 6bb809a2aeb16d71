//! One extent made to agree again on every in-sync replica, under the
//! extent's stripe held exclusively (S11: no write to it interleaves).
//!
//! Not the scrub itself: [`crate::replica::mirror::scrub`] paces the
//! background pass over every extent and logs what it finds; it calls
//! [`Engine::scrub_extent`] here for each extent, which compares the
//! digests and repairs the odd copies from the one a majority holds (or
//! the writer's own). [`Engine::repair_unsure`] repairs, within the term,
//! the extents an unacknowledged write of this term may have left
//! different (S5 could not drop the members it missed), so mark
//! retirement (`marks.rs`) can retire them.
//!
//! Both write with the engine's stamp (S2, S3) and flush the copies they
//! wrote before the extent's marks are retired like a write's (S6), and
//! both make a rebuild running meanwhile start over, since it may have
//! copied the extent before the repair.

use std::sync::Arc;

use bytes::Bytes;
use futures::future::join_all;

use super::{Engine, STRIPES};
use crate::ids::NodeId;
use crate::replica::mirror::quorum;
use crate::replica::{Replica, ReplicaError};
use crate::volume::DeviceError;

/// What the scrub found on one extent whose in-sync copies differed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScrubFinding {
    /// The extent's index.
    pub extent: u64,
    /// The in-sync replicas whose copy differed from the one kept.
    pub differing: Vec<NodeId>,
    /// The replica whose copy was kept: the majority's, or the writer's.
    pub source: NodeId,
    /// Whether more than half of the in-sync copies agreed on the one kept.
    pub majority: bool,
    /// Whether every differing copy was overwritten and flushed.
    pub repaired: bool,
    /// Without a majority, the bytes each overwritten copy held before, so
    /// that nothing is lost if the writer's copy was the wrong one.
    pub replaced: Vec<(NodeId, Bytes)>,
}

/// Why the scrub could not check an extent; the pass goes on, or ends.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScrubError {
    /// The engine has no term: this node is not the writer.
    #[error("the engine is not active")]
    Inactive,
    /// The in-sync set is empty.
    #[error("no in-sync replica to compare")]
    NoSource,
    /// A replica did not answer, or answered for other extents.
    #[error("{step} {replica}: {cause}")]
    Replica {
        step: &'static str,
        replica: NodeId,
        cause: ReplicaError,
    },
}

impl Engine {
    /// Compares extent `extent` on every in-sync replica under the
    /// extent's stripe (no write to it in flight) and, where the copies
    /// differ, overwrites the odd ones from the copy kept: the one a
    /// majority holds, or else the first in read order (the writer's own
    /// while it is in sync), after reading what the others held so the
    /// caller can keep it. The repaired copies are flushed, and the
    /// extent's marks retired like a write's; a rebuild running meanwhile
    /// starts over, since it may have copied the extent before the repair.
    /// An extent with an unacknowledged write of this term is left to
    /// [`Engine::repair_unsure`]. Returns `None` when the copies agree.
    pub async fn scrub_extent(&self, extent: u64) -> Result<Option<ScrubFinding>, ScrubError> {
        let _exclusive = self.stripes[(extent % STRIPES) as usize].write().await;
        let term = self.term().ok_or(ScrubError::Inactive)?;
        let offset = extent.saturating_mul(self.extent_size);
        let size = self.current_size();
        if offset >= size || self.lock().activity.unsure.contains(&extent) {
            return Ok(None);
        }
        let len = self.extent_size.min(size - offset);
        let members = self.read_order();
        let answers = join_all(
            members
                .iter()
                .map(|r| self.bounded(r.id(), r.digests(offset, len))),
        )
        .await;
        let mut copies = Vec::with_capacity(members.len());
        for (replica, answer) in members.iter().zip(answers) {
            let (_, digests) = answer.map_err(|cause| ScrubError::Replica {
                step: "digesting",
                replica: replica.id(),
                cause,
            })?;
            copies.push((replica.id(), digests.into_iter().next().unwrap_or_default()));
        }
        let Some((kept, majority)) = quorum::copy_to_keep(&copies) else {
            return Ok(None);
        };
        let differing: Vec<NodeId> = copies
            .iter()
            .filter(|(_, digest)| *digest != kept)
            .map(|(id, _)| *id)
            .collect();
        if differing.is_empty() {
            return Ok(None);
        }
        let source = copies
            .iter()
            .find(|(_, digest)| *digest == kept)
            .and_then(|(id, _)| members.iter().find(|r| r.id() == *id))
            .cloned()
            .ok_or(ScrubError::NoSource)?;
        let mut finding = ScrubFinding {
            extent,
            differing: differing.clone(),
            source: source.id(),
            majority,
            repaired: false,
            replaced: Vec::new(),
        };
        let read = self.bounded(source.id(), source.read(offset, len)).await;
        let data = read.map_err(|cause| ScrubError::Replica {
            step: "reading",
            replica: source.id(),
            cause,
        })?;
        if blake3::hash(&data).as_bytes()[..] != kept[..] {
            // The source's bytes changed between the digest and the read
            // (its disk, not a write: the stripe is held). Keep nothing.
            return Ok(Some(finding));
        }
        let targets: Vec<&Arc<dyn Replica>> = members
            .iter()
            .filter(|r| differing.contains(&r.id()))
            .collect();
        if !majority {
            // Nothing says the kept copy is the right one: keep what it
            // replaces, or do not replace it.
            for target in &targets {
                let read = self.bounded(target.id(), target.read(offset, len)).await;
                let bytes = read.map_err(|cause| ScrubError::Replica {
                    step: "reading",
                    replica: target.id(),
                    cause,
                })?;
                finding.replaced.push((target.id(), bytes));
            }
        }
        let repairs = targets.iter().map(|replica| {
            let data = data.clone();
            async move {
                self.stamped(term, replica, |stamp| {
                    replica.write(stamp, offset, data, false)
                })
                .await?;
                self.stamped(term, replica, |stamp| replica.flush(stamp))
                    .await
            }
        });
        finding.repaired = join_all(repairs).await.iter().all(Result::is_ok);
        let mut state = self.lock();
        if finding.repaired {
            // The repair marked the extent with this term on its targets.
            state.activity.done.insert(extent);
        }
        // A replica being rebuilt may have copied the extent before the
        // repair; it must compare it again.
        for rebuild in state.rebuilding.values_mut() {
            rebuild.failed = true;
        }
        Ok(Some(finding))
    }

    /// Makes the in-sync replicas agree again on extents that one of this
    /// term's writes may have left different (it was not acknowledged: it
    /// reached some members and not others, and the ones it missed could not
    /// be dropped). Under the extent's stripe, so no write to it is in
    /// flight, the extent is copied from the first replica in read order —
    /// an in-sync copy, so it holds every acknowledged write — to every
    /// other member, and all of them flush. A repaired extent's marks are
    /// then retired like a write's; one that could not be repaired stays
    /// marked for the next pass or the next promotion. Without this, a
    /// rebuild could copy one member's version and the set would disagree
    /// until the next failover. A running rebuild starts over after a
    /// repair, as after a scrub's. Returns how many extents were repaired.
    pub async fn repair_unsure(&self) -> Result<usize, DeviceError> {
        let (term, unsure) = {
            let state = self.lock();
            let term = state.term.ok_or(DeviceError::Inactive)?;
            let unsure: Vec<u64> = state.activity.unsure.iter().copied().take(64).collect();
            (term, unsure)
        };
        let mut repaired = 0;
        for extent in unsure {
            let _exclusive = self.stripes[(extent % STRIPES) as usize].write().await;
            if self.term() != Some(term) {
                break;
            }
            let offset = extent * self.extent_size;
            let size = self.current_size();
            if offset >= size {
                self.lock().activity.unsure.remove(&extent);
                continue;
            }
            let len = self.extent_size.min(size - offset);
            let mut order = self.read_order().into_iter();
            let Some(source) = order.next() else {
                break;
            };
            let others: Vec<Arc<dyn Replica>> = order.collect();
            let Ok(data) = self.bounded(source.id(), source.read(offset, len)).await else {
                continue;
            };
            let writes = others.iter().map(|replica| {
                let data = data.clone();
                self.stamped(term, replica, move |stamp| {
                    replica.write(stamp, offset, data, false)
                })
            });
            if join_all(writes).await.iter().any(Result::is_err) {
                continue;
            }
            let flushes = std::iter::once(&source)
                .chain(&others)
                .map(|replica| self.stamped(term, replica, |stamp| replica.flush(stamp)));
            if join_all(flushes).await.iter().any(Result::is_err) {
                continue;
            }
            let mut state = self.lock();
            state.activity.unsure.remove(&extent);
            state.activity.done.insert(extent);
            // A replica being rebuilt may hold the write the repair undid
            // on the others (it reached the target, not the source), and
            // may have compared the extent before: as after a scrub repair,
            // it must compare it again (its mark, or the map, names it).
            for rebuild in state.rebuilding.values_mut() {
                rebuild.failed = true;
            }
            repaired += 1;
        }
        Ok(repaired)
    }
}
