//! Loading this rank's part of a sharded checkpoint at a step boundary, a collective
//! ([`super::agree`]): before anything changes, every rank has read and checked all it needs,
//! so all ranks load or none does.

use std::path::Path;

use super::Engine;
use super::agree::check_one_source;
use super::parts::{Part, bytes_of, optimizer_name, state_buffer_mut};
use crate::backend::{Backend, Region};
use crate::checkpoint::{self, FileRange, SaveId, Saved};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::optim::OptimizerConfig;
use crate::threads::spawn_scoped;
use crate::types::{DType, Stream};

/// Bytes of each page-locked buffer a load uploads through, two of them.
const UPLOAD_PIECE: usize = 64 << 20;

/// Copies `src` into `dst` (as long), on several threads where it is large: one thread does not
/// reach the host memory's bandwidth.
fn parallel_copy(dst: &mut [u8], src: &[u8]) -> Result<()> {
    let threads = match src.len() < 8 << 20 {
        true => 1,
        false => std::thread::available_parallelism().map_or(1, |n| n.get().min(8)),
    };
    let part = src.len().div_ceil(threads).max(1);
    std::thread::scope(|s| {
        for (d, from) in dst.chunks_mut(part).zip(src.chunks(part)) {
            spawn_scoped(s, "a thread of a load's copy", move || {
                d.copy_from_slice(from)
            })?;
        }
        Ok(())
    })
}

/// The host memory a load reads this rank's state into.
enum LoadMemory<B: Backend> {
    /// The asynchronous saves' staging area, and its bytes.
    Staging(B::HostBuffer, usize),
    /// Memory of its own, and two page-locked buffers to upload it through.
    Owned(Vec<u8>, [B::HostBuffer; 2]),
}

impl<B: Backend> LoadMemory<B> {
    /// The first `total` bytes, all zero: the read fills the parameters' elements, and the
    /// padding stays zero (page-locked memory comes uninitialised, or with a save's bytes).
    fn zeroed(&mut self, total: usize) -> &mut [u8] {
        let staged = matches!(self, LoadMemory::Staging(..));
        let all = match self {
            // SAFETY: no copy is queued into the staging area: an asynchronous save's copies
            // completed before it went to the writer, which gave it back.
            LoadMemory::Staging(staging, _) => unsafe { B::host_bytes_mut(staging) },
            LoadMemory::Owned(owned, _) => owned,
        };
        let bytes = &mut all[..total];
        if staged {
            bytes.fill(0);
        }
        bytes
    }
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Restores this rank's state from the checkpoint in `dir`, saved by engines of the same model
    /// (the same parameters, declared in the same order) and optimizer, at this world size or
    /// another: each rank takes its shard of every group from the saved ranks' parts that hold it,
    /// reading only those bytes, each once. A collective: every rank calls it, and nothing changes
    /// on any rank unless every rank's part checked out: every saved rank's manifest present,
    /// unchanged (its own checksum) and of one save (one save id), its fields consistent with the
    /// layout they describe; each chunk of data read of its manifest's checksum; the parameters
    /// equal to the plan's (`Error::CheckpointMismatch` lists what differs). Ranks may read
    /// different directories (node-local copies of one checkpoint); copies of two saves are
    /// `Error::CheckpointMismatch` on every rank, naming both saves' ids. A rank whose part failed
    /// returns its error, the others `Error::PeerRefused` naming it; a rank whose upload fails
    /// after the ranks agreed (its device, or a thread of its copy that the system refused) is
    /// poisoned, its state half loaded, while the others have loaded. The optimizer continues from
    /// the saved step with the saved learning rate and weight decay. Allowed at a step boundary
    /// only; holds this rank's state in host memory while it reads; blocks until the state is on
    /// the device.
    pub fn load(&mut self, dir: &Path) -> Result<()> {
        self.healthy()?;
        self.check_step_boundary("loading a checkpoint")?;
        let parts = self.parts();
        let total = parts.iter().map(bytes_of).sum();
        let mut host = self.load_memory(total);
        let read = match &mut host {
            Ok(host) => self.read_checkpoint(dir, &parts, host.zeroed(total)),
            Err(e) => Err(e.clone()),
        };
        let agreed = self.agree(dir, read.map(|(settings, id)| (settings, id.0)));
        let loaded = agreed.and_then(|((optimizer, steps), ids)| {
            check_one_source(&ids, "saves")?;
            let memory = host.as_mut().map_err(|e| e.clone())?;
            self.effects(|e| {
                e.upload_parts(&parts, memory, total)?;
                e.values_from_masters()?;
                // The loaded step count is the whole count: the device's skips before it are
                // only counted.
                e.take_device_skips().map(drop)
            })?;
            self.config.optimizer = optimizer;
            self.optimizer.steps = steps;
            Ok(())
        });
        if let Ok(LoadMemory::Staging(staging, bytes)) = host {
            self.saving.staging = Some((staging, bytes));
        }
        loaded
    }

    /// Host memory for `total` bytes of this rank's state read from a checkpoint: the
    /// asynchronous saves' page-locked staging area where it is free and large enough (the
    /// uploads from it then run at the link's speed), else memory of its own.
    fn load_memory(&mut self, total: usize) -> Result<LoadMemory<B>> {
        match self.saving.staging.take() {
            Some((staging, bytes)) if bytes >= total => Ok(LoadMemory::Staging(staging, bytes)),
            other => {
                self.saving.staging = other;
                let owned = crate::fallible::zeroed(total, "this rank's state from a checkpoint")?;
                let piece = total.clamp(1, UPLOAD_PIECE);
                let bounce = [
                    self.backend.alloc_host(piece)?,
                    self.backend.alloc_host(piece)?,
                ];
                Ok(LoadMemory::Owned(owned, bounce))
            }
        }
    }

    /// Reads and checks this rank's `parts` of the checkpoint in `dir` into `bytes` (see
    /// [`Engine::load`]), with the optimizer settings and step count to take and the save's id;
    /// nothing changes.
    fn read_checkpoint(
        &self,
        dir: &Path,
        parts: &[Part],
        bytes: &mut [u8],
    ) -> Result<((OptimizerConfig, u64), SaveId)> {
        let saved = checkpoint::read_saved(dir)?;
        let first = &saved.manifests[0];
        let id = SaveId::from_hex(&first.save_id).ok_or_else(|| {
            checkpoint::unreadable(&checkpoint::manifest_path(dir, 0), "field `save_id`")
        })?;
        let mut differences = Vec::new();
        if first.optimizer != optimizer_name(&self.config.optimizer) {
            differences.push(format!(
                "saved with {}, loaded with {}",
                first.optimizer,
                optimizer_name(&self.config.optimizer)
            ));
        }
        if self.config.optimizer.has_moments()
            && first.moment_dtype != self.config.moment_dtype.to_string()
        {
            differences.push(format!(
                "moments saved in {}, loaded into {}",
                first.moment_dtype, self.config.moment_dtype
            ));
        }
        differences.extend(checkpoint::differences(
            &first.params,
            &checkpoint::records(&self.plan),
        ));
        if !differences.is_empty() {
            return Err(Error::CheckpointMismatch { differences });
        }
        let optimizer = self
            .config
            .optimizer
            .with_lr_and_decay(first.lr, first.weight_decay)?;
        checkpoint::read_ranges(&saved, &self.saved_ranges(&saved, parts)?, bytes)?;
        Ok(((optimizer, first.optimizer_steps), id))
    }

    /// Where each element of this rank's `parts` (one after another) lies in the saved ranks'
    /// data: for every parameter, the elements of this rank's shard range, found in the saved
    /// layout of the copy of its group that this rank holds. Padding stays zero.
    fn saved_ranges(&self, saved: &Saved, parts: &[Part]) -> Result<Vec<FileRange>> {
        let mut ranges = Vec::new();
        let mut part_start = 0;
        for p in parts {
            let size = p.region.dtype.size();
            let group = &self.plan.groups()[p.group];
            let block = checkpoint::saved_block(&saved.manifests[0], &self.plan, group, self.rank)?;
            let mine = self.plan.shard_range(group, self.rank)?;
            for &id in &group.params {
                let layout = &self.plan.params()[id.0];
                let held = self.held_elements(id)?;
                // The manifests' parameters are the plan's, in its order (`differences`).
                for run in saved.runs(id.0, p.kind, block.start, held)? {
                    ranges.push(FileRange {
                        rank: run.rank,
                        from: run.offset,
                        to: part_start + (layout.offset + run.elements.start - mine.start) * size,
                        bytes: run.elements.len() * size,
                    });
                }
            }
            part_start += bytes_of(p);
        }
        Ok(ranges)
    }

    /// Uploads `bytes` (this rank's `parts`, one after another, read from a checkpoint) into
    /// its state: straight from `memory` where it is page-locked, else piece by piece through
    /// its two page-locked buffers, each piece copied in by several threads while the device
    /// takes the one before.
    fn upload_parts(
        &mut self,
        parts: &[Part],
        memory: &mut LoadMemory<B>,
        total: usize,
    ) -> Result<()> {
        let (bytes, bounce) = match memory {
            LoadMemory::Staging(staging, _) => {
                // SAFETY: as in `LoadMemory::zeroed`.
                let bytes = unsafe { B::host_bytes(staging) };
                let mut at = 0;
                for p in parts {
                    let n = bytes_of(p);
                    let state = (&mut self.param_shards[..], &mut self.optimizer.groups[..]);
                    let buffer = state_buffer_mut::<B>(state, p)?;
                    self.backend.upload(buffer, p.region, &bytes[at..at + n])?;
                    at += n;
                }
                return Ok(());
            }
            LoadMemory::Owned(owned, bounce) => (&owned[..total], bounce),
        };
        self.join_streams_on_compute()?;
        let mut done: [Option<B::Event>; 2] = [None, None];
        let mut next = 0;
        let mut at = 0;
        for p in parts {
            let (dtype, n) = (p.region.dtype, bytes_of(p));
            let per_piece = UPLOAD_PIECE / dtype.size();
            let mut element = 0;
            while element < p.region.len {
                let count = per_piece.min(p.region.len - element);
                let from = &bytes[at + element * dtype.size()..][..count * dtype.size()];
                let (buffer, event) = (&mut bounce[next], &mut done[next]);
                if let Some(copied) = event.take() {
                    self.backend.synchronize(&copied)?;
                }
                // SAFETY: the copy out of it that the buffer last went to completed (above).
                parallel_copy(
                    &mut unsafe { B::host_bytes_mut(buffer) }[..from.len()],
                    from,
                )?;
                let state = (&mut self.param_shards[..], &mut self.optimizer.groups[..]);
                let target = state_buffer_mut::<B>(state, p)?;
                // SAFETY: on the compute stream, after every stream's work (joined above); the
                // bounce buffer is written again only once this copy completed (its event).
                unsafe {
                    self.backend.copy_from_host(
                        Stream::Compute,
                        buffer,
                        0,
                        target,
                        Region::new(element, count, dtype),
                    )
                }?;
                *event = Some(self.backend.record(Stream::Compute)?);
                next = 1 - next;
                element += count;
            }
            at += n;
        }
        // The bounce buffers live on in `memory`; they are freed once these copies are done.
        done.iter()
            .flatten()
            .try_for_each(|e| self.backend.synchronize(e))
    }

    /// A bf16/f16 shard beside its loaded master becomes the master rounded, as the optimizer
    /// leaves it; the next gather waits for the casts.
    fn values_from_masters(&mut self) -> Result<()> {
        for g in self.plan.groups() {
            let (Some(master), false) = (
                self.optimizer.groups[g.index].master.as_ref(),
                self.policy.master_only(g.index),
            ) else {
                continue;
            };
            let (f32s, values) = (
                Region::new(0, g.shard_numel, DType::F32),
                Region::new(0, g.shard_numel, g.dtype),
            );
            // SAFETY: on the compute stream; every stream's earlier work finished in the uploads
            // above (they block), and the next gather waits for this cast (`shards_updated`).
            unsafe {
                self.backend.cast(
                    Stream::Compute,
                    master,
                    f32s,
                    &mut self.param_shards[g.index],
                    values,
                )
            }?;
        }
        self.gathering.shards_updated = Some(self.backend.record(Stream::Compute)?);
        Ok(())
    }
}
