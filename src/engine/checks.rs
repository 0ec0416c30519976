//! The ranks' comparisons: of their plans when their engines are made, and (when
//! [`crate::EngineConfig::verify_collectives`] is on) of the collectives they issued in a step, so
//! that ranks that diverged fail with both versions named instead of pairing collectives wrongly.
//! Each comparison is one small all-gather of a digest; only on a difference do the ranks exchange
//! enough to name the first one.

use super::Engine;
use crate::backend::{Backend, Region};
use crate::comm::{Communicator, FINGERPRINT_BYTES, Fingerprint, Purpose, mismatch};
use crate::error::{Error, Result};
use crate::fallible::filled;
use crate::types::{DType, Stream};

/// Bytes of a parameter's description in a plan comparison.
const DESCRIPTION_BYTES: usize = 256;

/// FNV-1a: the same digest of the same bytes on every machine.
fn digest(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// A digest of `items` and their count, as exchanged first.
fn summary(items: &[u8], count: usize) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&digest(items).to_le_bytes());
    out[8..].copy_from_slice(&(count as u64).to_le_bytes());
    out
}

fn count_of(summary: &[u8]) -> usize {
    summary
        .get(8..16)
        .and_then(|b| b.try_into().ok())
        .map_or(0, |b| u64::from_le_bytes(b) as usize)
}

/// The first `(index, rank)` at which a rank's record of `width` bytes differs from rank 0's.
fn first_difference(lists: &[Vec<u8>], width: usize) -> Option<(usize, usize)> {
    let records = lists.first()?.len() / width;
    (0..records).find_map(|i| {
        let record = |list: &Vec<u8>| list.get(i * width..(i + 1) * width).map(<[u8]>::to_vec);
        let expected = record(&lists[0]);
        (1..lists.len())
            .find(|&r| record(&lists[r]) != expected)
            .map(|r| (i, r))
    })
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// All-gathers `bytes` (the same length on every rank) and returns every rank's, in rank
    /// order: over every rank of the grid (every replica's, under hybrid sharding) where `grid`,
    /// else over the ranks of this rank's replica. Blocks the host. Its buffers are scratch,
    /// outside the engine's counted memory.
    pub(super) fn exchange(
        &mut self,
        purpose: Purpose,
        bytes: &[u8],
        grid: bool,
    ) -> Result<Vec<Vec<u8>>> {
        let world = match grid {
            true => self.comm.grid_size(),
            false => self.plan.world_size(),
        };
        let words = bytes.len().div_ceil(4);
        let part = words * 4;
        let total = part.checked_mul(world).ok_or_else(|| Error::OutOfMemory {
            bytes: usize::MAX,
            what: "a comparison of the ranks".into(),
        })?;
        let shard_region = Region::new(0, words, DType::F32);
        let out_region = Region::new(0, words * world, DType::F32);
        let mut padded = filled(part, 0u8, "a comparison of the ranks")?;
        padded[..bytes.len()].copy_from_slice(bytes);
        let mut shard = self.backend.alloc_scratch(part)?;
        let mut out = self.backend.alloc_scratch(total)?;
        self.backend.upload(&mut shard, shard_region, &padded)?;
        let tag = self.next_tag(purpose, |tag| Fingerprint::all_gather(tag, shard_region));
        let gather = match grid {
            true => C::all_gather_grid,
            false => C::all_gather,
        };
        // SAFETY: both buffers belong to this call; the upload completed before the gather is
        // queued, and the download below orders itself after the gather stream.
        unsafe {
            gather(
                &mut self.comm,
                &self.backend,
                Stream::Gather,
                tag,
                &shard,
                shard_region,
                &mut out,
                out_region,
            )
        }?;
        let place = match grid {
            true => self.comm.replica().index * self.plan.world_size() + self.rank,
            false => self.rank,
        };
        let collective = (Fingerprint::all_gather(tag, shard_region), (place, world));
        self.record_collective(Stream::Gather, Some(collective))?;
        let mut all = filled(total, 0u8, "a comparison of the ranks")?;
        self.backend.download(&out, out_region, &mut all)?;
        Ok(all
            .chunks_exact(part.max(1))
            .take(world)
            .map(|c| c[..bytes.len()].to_vec())
            .collect())
    }

    /// The settings that shape the collectives a rank issues, as the ranks compare them.
    fn describe_settings(&self) -> String {
        let c = &self.config;
        let limits = self.policy.limits;
        format!(
            "settings: {} gathered and {} reductions in flight at most, overlap {}, {:?}, \
             gradients travelling in {}, {:?}, collectives verified {}, {:?}, moments in {}, \
             {:?}, the optimizer in the backward {}",
            limits.gathered,
            limits.reduces_in_flight,
            c.overlap,
            c.accumulation,
            c.reduce_dtype,
            c.param_storage,
            c.verify_collectives,
            c.optimizer,
            c.moment_dtype,
            c.grad_reduction,
            c.step_in_backward
        )
    }

    /// Refuses to start when the ranks' plans differ, naming the first differing parameter and
    /// both ranks' versions of it, or when the settings that shape their collectives differ
    /// (`Error::SettingsMismatch`).
    pub(super) fn check_plans(&mut self) -> Result<()> {
        if self.comm.grid_size() == 1 {
            return Ok(());
        }
        let params = self.plan.params().len();
        let descriptions: Vec<String> = (0..params)
            .map(|i| self.plan.describe_param(i))
            .chain([self.describe_settings()])
            .collect();
        let digests: Vec<u8> = descriptions
            .iter()
            .flat_map(|d| digest(d.as_bytes()).to_le_bytes())
            .collect();
        let summaries = self.exchange(
            Purpose::PlanCheck,
            &summary(&digests, descriptions.len()),
            true,
        )?;
        if summaries.iter().all(|s| *s == summaries[0]) {
            return Ok(());
        }
        // Every rank's digests, as long as the longest list (missing ones all ones).
        let longest = summaries.iter().map(|s| count_of(s)).max().unwrap_or(0);
        let mut mine = filled(longest * 8, 0xff, "a comparison of the ranks' plans")?;
        mine[..digests.len()].copy_from_slice(&digests);
        let lists = self.exchange(Purpose::PlanCheck, &mine, true)?;
        let (index, rank) = first_difference(&lists, 8).unwrap_or((longest, 1));
        let description = descriptions
            .get(index)
            .map_or("no parameter", String::as_str);
        let mut text = [0u8; DESCRIPTION_BYTES];
        let cut = floor_char_boundary(description, DESCRIPTION_BYTES);
        text[..cut].copy_from_slice(&description.as_bytes()[..cut]);
        let texts = self.exchange(Purpose::PlanCheck, &text, true)?;
        let read = |bytes: &[u8]| {
            let end = bytes.iter().position(|&b| b == 0).unwrap_or(bytes.len());
            String::from_utf8_lossy(&bytes[..end]).into_owned()
        };
        if index == params {
            return Err(Error::SettingsMismatch {
                rank,
                expected: read(&texts[0]),
                got: read(&texts[rank]),
            });
        }
        Err(Error::PlanMismatch {
            rank,
            index,
            expected: read(&texts[0]),
            got: read(&texts[rank]),
        })
    }

    /// Fails every rank when their collectives of this step differ, naming the first difference
    /// with both ranks' versions.
    pub(super) fn verify_collectives(&mut self) -> Result<()> {
        if self.comm.grid_size() == 1 {
            return Ok(());
        }
        let issued: Vec<u8> = self
            .collectives
            .issued
            .iter()
            .flat_map(Fingerprint::to_bytes)
            .collect();
        let count = self.collectives.issued.len();
        let summaries = self.exchange(Purpose::CollectiveCheck, &summary(&issued, count), true)?;
        if summaries.iter().all(|s| *s == summaries[0]) {
            return Ok(());
        }
        let longest = summaries.iter().map(|s| count_of(s)).max().unwrap_or(0);
        // Missing records are all ones, which no fingerprint encodes to.
        let bytes = longest * FINGERPRINT_BYTES;
        let mut mine = filled(bytes, 0xff, "a comparison of the ranks' collectives")?;
        mine[..issued.len()].copy_from_slice(&issued);
        let lists = self.exchange(Purpose::CollectiveCheck, &mine, true)?;
        let (index, rank) = first_difference(&lists, FINGERPRINT_BYTES).unwrap_or((longest, 1));
        let record = |list: &Vec<u8>| {
            list.get(index * FINGERPRINT_BYTES..(index + 1) * FINGERPRINT_BYTES)
                .and_then(Fingerprint::from_bytes)
        };
        Err(mismatch(
            rank,
            record(&lists[0]).as_ref(),
            record(&lists[rank]).as_ref(),
        ))
    }
}

/// The largest index at most `max` that falls on a character boundary of `s`.
fn floor_char_boundary(s: &str, max: usize) -> usize {
    (0..=max.min(s.len()))
        .rev()
        .find(|&i| s.is_char_boundary(i))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_differing_record_and_rank_are_found() {
        let lists = vec![vec![1, 2, 3, 4], vec![1, 2, 3, 4], vec![1, 2, 9, 4]];
        assert_eq!(first_difference(&lists, 2), Some((1, 2)));
        assert_eq!(first_difference(&lists[..2], 2), None);
        assert_eq!(count_of(&summary(&[5, 6], 7)), 7);
        assert_ne!(digest(b"a"), digest(b"b"));
        assert_eq!(floor_char_boundary("aé", 2), 1);
    }
}
