//! Saving and loading this rank's part of a sharded checkpoint at a step boundary.

use std::path::Path;

use super::Engine;
use crate::backend::{Backend, Region};
use crate::checkpoint::{self, RankManifest, Section, SectionKind};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::optim::OptimizerConfig;
use crate::types::{BufferState, DType, Stream};

/// A run of a saved rank's data that belongs at byte `to` of this rank's part `part`.
struct SavedRun {
    rank: usize,
    from: checkpoint::Wanted,
    part: usize,
    to: usize,
}

/// How often [`Engine::wait_save`] looks at the writer.
const SAVE_POLL: std::time::Duration = std::time::Duration::from_millis(1);

/// The writer of an asynchronous save, which gives its staging area back; dropping it waits for
/// the files.
pub(super) struct PendingSave<H> {
    dir: std::path::PathBuf,
    thread: Option<std::thread::JoinHandle<Written<H>>>,
}

/// What the writer of an asynchronous save ends with: its outcome, and the staging area (with
/// its bytes) for the next save.
type Written<H> = (Result<()>, (H, usize));

impl<H> Drop for PendingSave<H> {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The bytes of the largest of `parts`.
fn largest(parts: &[Part]) -> usize {
    parts
        .iter()
        .map(|p| p.region.len * p.region.dtype.size())
        .max()
        .unwrap_or(0)
}

/// A section of this rank's state: which buffer, and its region.
struct Part {
    group: usize,
    kind: SectionKind,
    region: Region,
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Writes this rank's state into `dir` (made if missing): each group's values in its dtype,
    /// the fp32 masters and AdamW's moments, with the optimizer's step count and settings and
    /// the plan's layout. No communication: every rank saves its own part, data first, its
    /// manifest last, each under a temporary name, flushed and renamed, so a part that a crash
    /// interrupts is never taken for a whole one. Refused (`Error::CheckpointExists`) where
    /// `dir` holds this rank's part already, and between a step's first hook and its
    /// `end_step`. Blocks until every byte is on disk. Under hybrid sharding only the first
    /// replica's ranks write: every replica holds the same state.
    pub fn save(&self, dir: &Path) -> Result<()> {
        self.healthy()?;
        self.check_step_boundary("saving a checkpoint")?;
        if self.comm.replica().index > 0 {
            return Ok(());
        }
        self.check_no_save_into(dir)?;
        checkpoint::prepare(dir, self.rank)?;
        let parts = self.parts();
        let manifest = self.manifest(&parts);
        let mut buffer = crate::fallible::filled(largest(&parts), 0u8, "a checkpoint section")?;
        checkpoint::write_rank(dir, manifest, |write| {
            // One part at a time through one host buffer.
            for p in &parts {
                let part = &mut buffer[..p.region.len * p.region.dtype.size()];
                self.read_part(p, part)?;
                write(part)?;
            }
            Ok(())
        })
    }

    /// As [`Engine::save`], with the files written on a thread of their own while training
    /// goes on: this rank's state is first copied on the compute stream into host memory
    /// (page-locked on a GPU; made at the first such save, the size of the rank's state, and
    /// kept for the next ones), the call returning once the copy is done. [`Engine::wait_save`]
    /// gives the save's outcome; one save is written at a time (`Error::SavePending` while one
    /// is). Dropping the engine waits for the files.
    pub fn save_async(&mut self, dir: &Path) -> Result<()> {
        self.healthy()?;
        self.check_step_boundary("saving a checkpoint")?;
        if let Some(pending) = &self.pending_save {
            return Err(Error::SavePending {
                dir: pending.dir.display().to_string(),
            });
        }
        if self.comm.replica().index > 0 {
            return Ok(());
        }
        checkpoint::prepare(dir, self.rank)?;
        let parts = self.parts();
        let manifest = self.manifest(&parts);
        let total: usize = manifest.sections.iter().map(|s| s.bytes as usize).sum();
        let mut staging = match self.save_staging.take() {
            Some((staging, bytes)) if bytes >= total => (staging, bytes),
            _ => (self.backend.alloc_host(total)?, total),
        };
        self.effects(|e| {
            // After every stream's work so far, in the compute stream's order (before the next
            // optimizer step writes the state).
            for other in [Stream::Gather, Stream::Reduce] {
                let reached = e.backend.record(other)?;
                e.backend.wait(Stream::Compute, &reached)?;
            }
            for (p, section) in parts.iter().zip(&manifest.sections) {
                let buffer = e.state_buffer(p)?;
                let at = section.offset as usize;
                // SAFETY: ordered after every stream's work above; the staging area is read
                // only once the copies completed (synchronized below).
                unsafe {
                    e.backend
                        .copy_to_host(Stream::Compute, buffer, p.region, &mut staging.0, at)
                }?;
            }
            let copied = e.backend.record(Stream::Compute)?;
            e.backend.synchronize(&copied)
        })?;
        let target = dir.to_path_buf();
        let sections = manifest.sections.clone();
        let thread = std::thread::Builder::new()
            .name(format!("fsdp-save-rank-{}", self.rank))
            .spawn(move || {
                // SAFETY: the copies into the staging area completed (synchronized above).
                let bytes = unsafe { B::host_bytes(&staging.0) };
                let written = checkpoint::write_rank(&target, manifest, |write| {
                    sections.iter().try_for_each(|s| {
                        write(&bytes[s.offset as usize..(s.offset + s.bytes) as usize])
                    })
                });
                (written, staging)
            })
            .map_err(|e| Error::Spawn {
                what: "the checkpoint writer",
                source: std::sync::Arc::new(e),
            })?;
        self.pending_save = Some(PendingSave {
            dir: dir.to_path_buf(),
            thread: Some(thread),
        });
        Ok(())
    }

    /// Waits for the files of [`Engine::save_async`] (within the engine's timeout:
    /// `Error::Timeout` leaves the save pending) and returns its outcome; `Ok` when no save is
    /// pending.
    pub fn wait_save(&mut self) -> Result<()> {
        let Some(mut pending) = self.pending_save.take() else {
            return Ok(());
        };
        let what = || format!("the save into {}", pending.dir.display());
        let waited = self.watch.poll(SAVE_POLL, what, || {
            Ok(pending.thread.as_ref().is_none_or(|t| t.is_finished()))
        });
        if let Err(e) = waited {
            self.pending_save = Some(pending);
            return Err(e);
        }
        match pending.thread.take().map(std::thread::JoinHandle::join) {
            None => Ok(()),
            Some(Ok((written, staging))) => {
                self.save_staging = Some(staging);
                written
            }
            Some(Err(_)) => Err(Error::Panicked {
                message: what() + " panicked",
            }),
        }
    }

    /// Whether [`Engine::save_async`]'s files are still being written.
    pub fn save_pending(&self) -> bool {
        self.pending_save
            .as_ref()
            .is_some_and(|p| p.thread.as_ref().is_some_and(|t| !t.is_finished()))
    }

    /// Refuses a save into the directory a pending one writes (their temporary files would
    /// meet).
    fn check_no_save_into(&self, dir: &Path) -> Result<()> {
        match &self.pending_save {
            Some(pending) if pending.dir == dir => Err(Error::SavePending {
                dir: dir.display().to_string(),
            }),
            _ => Ok(()),
        }
    }

    /// This rank's manifest of `parts`, before its data's length and checksum.
    fn manifest(&self, parts: &[Part]) -> RankManifest {
        let mut sections = Vec::with_capacity(parts.len());
        let mut offset = 0u64;
        for p in parts {
            let bytes = (p.region.len * p.region.dtype.size()) as u64;
            sections.push(Section {
                group: p.group,
                kind: p.kind,
                offset,
                bytes,
            });
            offset += bytes;
        }
        RankManifest {
            format: checkpoint::FORMAT,
            rank: self.rank,
            world_size: self.plan.world_size(),
            optimizer_steps: self.optimizer_steps,
            lr: self.config.optimizer.lr(),
            weight_decay: self.config.optimizer.weight_decay(),
            optimizer: optimizer_name(&self.config.optimizer).into(),
            moment_dtype: self.config.moment_dtype.to_string(),
            params: checkpoint::records(&self.plan),
            process_groups: self.plan.process_groups().to_vec(),
            sections,
            data_bytes: 0,
            data_xxh3: String::new(),
        }
    }

    /// Restores this rank's state from the checkpoint in `dir`, saved by engines of the same
    /// model (the same parameters, declared in the same order) and optimizer, at this world size
    /// or another: each rank takes its shard of every group from the saved ranks' parts that
    /// hold it, reading each file it needs once. Everything is checked before anything
    /// changes: every saved rank's manifest present and agreeing (a save that did not finish is
    /// refused), each file read of its manifest's length and checksum, the parameters equal to
    /// the plan's (`Error::CheckpointMismatch` lists what differs). The optimizer continues from
    /// the saved step with the saved learning rate and weight decay. Allowed at a step boundary
    /// only; blocks until the state is on the device.
    pub fn load(&mut self, dir: &Path) -> Result<()> {
        self.healthy()?;
        self.check_step_boundary("loading a checkpoint")?;
        let first = checkpoint::read_manifest(dir, 0)?;
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
        let saved = checkpoint::read_manifests(dir)?;
        let parts = self.parts();
        let copies = self.copies(dir, &saved, &parts)?;
        // Every file this rank reads is checked whole before anything is loaded.
        let mut files = Vec::with_capacity(saved.len());
        for (rank, m) in saved.iter().enumerate() {
            let needed = copies.iter().any(|c| c.rank == rank);
            files.push(
                needed
                    .then(|| checkpoint::verified_data(dir, m))
                    .transpose()?,
            );
        }
        let mut buffer = crate::fallible::filled(largest(&parts), 0u8, "a checkpoint section")?;
        let optimizer = self
            .config
            .optimizer
            .with_lr_and_decay(first.lr, first.weight_decay)?;
        self.effects(|e| {
            // One part at a time through one host buffer: read its runs, upload it.
            for (index, p) in parts.iter().enumerate() {
                let part = &mut buffer[..p.region.len * p.region.dtype.size()];
                part.fill(0);
                for c in copies.iter().filter(|c| c.part == index) {
                    let to = &mut part[c.to..c.to + c.from.len as usize];
                    let file = files[c.rank].as_mut().ok_or(Error::GroupOutOfRange {
                        group: p.group,
                        count: e.plan.groups().len(),
                    })?;
                    checkpoint::read_range(dir, c.rank, file, c.from, to)?;
                }
                e.write_part(p, part)?;
            }
            e.values_from_masters()
        })?;
        self.config.optimizer = optimizer;
        self.optimizer_steps = first.optimizer_steps;
        // The masters were loaded: nothing is widened from the shards at the next step.
        self.master_stale.fill(false);
        Ok(())
    }

    /// Where each element of this rank's `parts` lies in the saved ranks' data: for every
    /// parameter, the elements of this rank's shard range, found in the saved layout (each
    /// saved rank of the block that held this rank's copy holding `section bytes / element
    /// size` of the group), run by run. Padding stays zero.
    fn copies(&self, dir: &Path, saved: &[RankManifest], parts: &[Part]) -> Result<Vec<SavedRun>> {
        let unreadable = |rank: usize, reason: String| {
            checkpoint::unreadable(&checkpoint::manifest_path(dir, rank), reason)
        };
        let mut copies = Vec::new();
        for (index, p) in parts.iter().enumerate() {
            let size = p.region.dtype.size();
            let section = |rank: usize| -> Result<&Section> {
                saved[rank]
                    .sections
                    .iter()
                    .find(|s| (s.group, s.kind) == (p.group, p.kind))
                    .ok_or_else(|| {
                        unreadable(
                            rank,
                            format!("no {:?} section of group {}", p.kind, p.group),
                        )
                    })
            };
            let group = &self.plan.groups()[p.group];
            let block = checkpoint::saved_block(&saved[0], &self.plan, group, self.rank)?;
            let saved_shard = (section(block.start)?.bytes / size as u64) as usize;
            if saved_shard == 0 && group.padded_numel > 0 {
                return Err(unreadable(
                    block.start,
                    format!("an empty section of group {}", p.group),
                ));
            }
            let mine = self.plan.shard_range(group, self.rank);
            for &id in &group.params {
                let layout = &self.plan.params()[id.0];
                let Some(old) = saved[0].params.iter().find(|r| r.name == layout.name) else {
                    continue;
                };
                let lo = layout.offset.max(mine.start);
                let hi = (layout.offset + layout.numel).min(mine.end);
                let mut i = lo.saturating_sub(layout.offset);
                let end = hi.saturating_sub(layout.offset);
                while i < end {
                    let position = old.offset + i;
                    let (place, within) = (position / saved_shard, position % saved_shard);
                    let rank = block.start + place;
                    if rank >= block.end {
                        return Err(unreadable(
                            block.start,
                            format!("group {} is longer than its saved shards", p.group),
                        ));
                    }
                    let run = (end - i).min(saved_shard - within);
                    let s = section(rank)?;
                    if s.bytes != (saved_shard * size) as u64 {
                        return Err(unreadable(rank, format!("section {s:?} of another size")));
                    }
                    copies.push(SavedRun {
                        rank,
                        from: checkpoint::Wanted {
                            offset: s.offset + (within * size) as u64,
                            len: (run * size) as u64,
                        },
                        part: index,
                        to: (layout.offset + i - mine.start) * size,
                    });
                    i += run;
                }
            }
        }
        Ok(copies)
    }

    /// Every section of this rank's state, in group order.
    fn parts(&self) -> Vec<Part> {
        let mut parts = Vec::new();
        for g in self.plan.groups() {
            let (group, n) = (g.index, g.shard_numel);
            // A bf16/f16 group's values are its master rounded: the master alone is saved.
            if self.masters[group].is_none() {
                parts.push(Part {
                    group,
                    kind: SectionKind::Values,
                    region: Region::new(0, n, g.dtype),
                });
            }
            if !g.trainable {
                continue;
            }
            if self.masters[group].is_some() {
                parts.push(Part {
                    group,
                    kind: SectionKind::Master,
                    region: Region::new(0, n, DType::F32),
                });
            }
            if self.moments[group].is_some() {
                for kind in [SectionKind::FirstMoment, SectionKind::SecondMoment] {
                    parts.push(Part {
                        group,
                        kind,
                        region: Region::new(0, n, self.config.moment_dtype),
                    });
                }
            }
        }
        parts
    }

    /// Copies part `p` of this rank's state into `out` (its size).
    fn read_part(&self, p: &Part, out: &mut [u8]) -> Result<()> {
        if p.kind == SectionKind::Values {
            out.copy_from_slice(&self.param_shard(p.group)?);
            return Ok(());
        }
        let buffer = self.state_buffer(p)?;
        self.observe(self.backend.download(buffer, p.region, out))
    }

    fn write_part(&mut self, p: &Part, bytes: &[u8]) -> Result<()> {
        let g = p.group;
        let master_only = self.plan.master_only(&self.config, &self.plan.groups()[g]);
        let missing = Error::GroupOutOfRange {
            group: g,
            count: self.plan.groups().len(),
        };
        let buffer = match p.kind {
            // A master-only group's values are its master rounded: the master section has them.
            SectionKind::Values if master_only => return Ok(()),
            SectionKind::Values => &mut self.shards[g],
            SectionKind::Master => self.masters[g].as_mut().ok_or(missing)?,
            SectionKind::FirstMoment => {
                self.moments[g].as_mut().map(|m| &mut m.0).ok_or(missing)?
            }
            SectionKind::SecondMoment => {
                self.moments[g].as_mut().map(|m| &mut m.1).ok_or(missing)?
            }
        };
        self.backend.upload(buffer, p.region, bytes)
    }

    /// A bf16/f16 shard beside its loaded master becomes the master rounded, as the optimizer
    /// leaves it; the next gather waits for the casts.
    fn values_from_masters(&mut self) -> Result<()> {
        for g in self.plan.groups() {
            let (Some(master), false) = (
                self.masters[g.index].as_ref(),
                self.plan.master_only(&self.config, g),
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
                    &mut self.shards[g.index],
                    values,
                )
            }?;
        }
        self.shards_updated = Some(self.backend.record(Stream::Compute)?);
        Ok(())
    }

    fn state_buffer(&self, p: &Part) -> Result<&B::Buffer> {
        let missing = Error::GroupOutOfRange {
            group: p.group,
            count: self.plan.groups().len(),
        };
        match p.kind {
            SectionKind::Values => Ok(&self.shards[p.group]),
            SectionKind::Master => self.masters[p.group].as_ref().ok_or(missing),
            SectionKind::FirstMoment => self.moments[p.group].as_ref().map(|m| &m.0).ok_or(missing),
            SectionKind::SecondMoment => {
                self.moments[p.group].as_ref().map(|m| &m.1).ok_or(missing)
            }
        }
    }

    /// Refuses `action` between a step's first hook or gradient and its `end_step`.
    pub(super) fn check_step_boundary(&self, action: &'static str) -> Result<()> {
        self.check_not_stepped(action)?;
        let open = self
            .forward_open
            .iter()
            .chain(&self.backward_open)
            .any(|&o| o);
        let gathered =
            (0..self.plan.groups().len()).any(|g| self.gathers.state(g) != BufferState::Freed);
        if open || gathered || self.grads.pending() || self.grads.synced() {
            return Err(Error::MidStep { action });
        }
        Ok(())
    }
}

fn optimizer_name(optimizer: &OptimizerConfig) -> &'static str {
    match optimizer {
        OptimizerConfig::AdamW { .. } => "adamw",
        OptimizerConfig::Sgd { .. } => "sgd",
    }
}
