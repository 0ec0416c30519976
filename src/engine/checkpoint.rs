//! Saving and loading this rank's part of a sharded checkpoint at a step boundary. Both are
//! collectives ([`super::agree`]): before anything is written, the ranks agree on the save's
//! id and that every writer's directory is free; before anything changes, every rank has read
//! and checked all it needs, so all ranks load or none does.

use std::path::Path;

use super::Engine;
use super::agree::Proposal;
use crate::backend::{Backend, Region};
use crate::checkpoint::{self, FileRange, RankManifest, SaveId, Saved, Section, SectionKind};
use crate::comm::Communicator;
use crate::config::EngineConfig;
use crate::error::{Error, Result};
use crate::optim::OptimizerConfig;
use crate::plan::Plan;
use crate::types::{BufferState, DType, Stream};

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

/// Which pending asynchronous save refuses a new one.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pending {
    /// Any: one asynchronous save is written at a time.
    Refused,
    /// One into the same directory, whose temporary files the new one's would meet.
    SameDirRefused,
}

/// The bytes of `part`.
fn bytes_of(part: &Part) -> usize {
    part.region.len * part.region.dtype.size()
}

/// A section of this rank's state: which buffer, and its region.
struct Part {
    group: usize,
    kind: SectionKind,
    region: Region,
}

/// Every section of a rank's state under `plan` and `config`, in group order: each group's
/// values (a trainable bf16/f16 group's fp32 master instead, which they are rounded from), then
/// AdamW's moments of a trainable group.
fn parts_of(plan: &Plan, config: &EngineConfig) -> Vec<Part> {
    let mut parts = Vec::new();
    for g in plan.groups() {
        let (group, n) = (g.index, g.shard_numel);
        let has_master = g.trainable && g.dtype != DType::F32;
        parts.push(match has_master {
            true => Part {
                group,
                kind: SectionKind::Master,
                region: Region::new(0, n, DType::F32),
            },
            false => Part {
                group,
                kind: SectionKind::Values,
                region: Region::new(0, n, g.dtype),
            },
        });
        if g.trainable && config.optimizer.has_moments() {
            for kind in [SectionKind::FirstMoment, SectionKind::SecondMoment] {
                parts.push(Part {
                    group,
                    kind,
                    region: Region::new(0, n, config.moment_dtype),
                });
            }
        }
    }
    parts
}

/// The bytes of a rank's state under `plan` and `config`: what a save writes, and what
/// [`EngineConfig::save_staging`] makes ahead.
pub(super) fn state_bytes(plan: &Plan, config: &EngineConfig) -> usize {
    parts_of(plan, config).iter().map(bytes_of).sum()
}

/// The host memory a load reads this rank's state into.
enum LoadMemory<B: Backend> {
    /// The asynchronous saves' staging area, and its bytes.
    Staging(B::HostBuffer, usize),
    Owned(Vec<u8>),
}

impl<B: Backend> LoadMemory<B> {
    fn bytes_mut(&mut self, total: usize) -> &mut [u8] {
        let all = match self {
            // SAFETY: no copy is queued into the staging area: an asynchronous save's copies
            // completed before it went to the writer, which gave it back.
            LoadMemory::Staging(staging, _) => unsafe { B::host_bytes_mut(staging) },
            LoadMemory::Owned(owned) => owned,
        };
        &mut all[..total]
    }

    fn bytes(&self, total: usize) -> &[u8] {
        let all = match self {
            // SAFETY: as above.
            LoadMemory::Staging(staging, _) => unsafe { B::host_bytes(staging) },
            LoadMemory::Owned(owned) => owned,
        };
        &all[..total]
    }
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Writes this rank's state into `dir` (made if missing): each group's values in its dtype
    /// (a trainable bf16/f16 group's fp32 master instead, which the values are rounded from),
    /// AdamW's moments, the optimizer's step count and settings and the plan's layout. A
    /// collective: every rank calls it with the same `dir`, and the ranks agree first on the
    /// save's id, which every manifest records, and that `dir` holds no rank file of any
    /// checkpoint (`Error::CheckpointExists` on every rank, nothing written, otherwise). Each
    /// rank then writes its data and its manifest, each under a unique temporary name, flushed
    /// and linked into place, and the directory flushed: a part that a crash interrupts is never
    /// taken for a whole one, and no existing file is replaced. Refused between a step's first
    /// hook and its `end_step` (`Error::MidStep`). Blocks until every byte is on disk. Under
    /// hybrid sharding only the first replica's ranks write: every replica holds the same state.
    pub fn save(&mut self, dir: &Path) -> Result<()> {
        let total: usize = self.parts().iter().map(bytes_of).sum();
        let piece = total.clamp(1, checkpoint::CHUNK_BYTES as usize);
        let started = self.begin_save(dir, Pending::SameDirRefused, |e| {
            Ok([e.backend.alloc_host(piece)?, e.backend.alloc_host(piece)?])
        })?;
        let Some((manifest, pieces)) = started else {
            return Ok(());
        };
        let parts = self.parts();
        checkpoint::write_rank(dir, manifest, |write| {
            self.stream_parts(&parts, (pieces, piece), write)
        })
    }

    /// Hands `parts` to `write` in order, piece by piece through the two host buffers `pieces`
    /// of `piece` bytes each: one is written (on a thread of its own) while the device copies
    /// the next piece into the other.
    fn stream_parts(
        &self,
        parts: &[Part],
        (pieces, piece): ([B::HostBuffer; 2], usize),
        write: &mut (dyn FnMut(&[u8]) -> Result<()> + Send),
    ) -> Result<()> {
        let (full, to_write) = std::sync::mpsc::sync_channel::<(B::HostBuffer, usize)>(2);
        let (empty, to_fill) = std::sync::mpsc::channel();
        for buffer in pieces {
            let _ = empty.send(buffer);
        }
        std::thread::scope(|s| {
            let writer = s.spawn(move || -> Result<()> {
                for (buffer, bytes) in to_write {
                    // SAFETY: the copy into the buffer completed before it was sent.
                    write(&unsafe { B::host_bytes(&buffer) }[..bytes])?;
                    let _ = empty.send(buffer);
                }
                Ok(())
            });
            let copied = self.join_streams_on_compute().and_then(|()| {
                for p in parts {
                    let source = self.state_buffer(p)?;
                    let (dtype, per_piece) = (p.region.dtype, piece / p.region.dtype.size());
                    let mut at = 0;
                    while at < p.region.len {
                        let n = per_piece.min(p.region.len - at);
                        // A writer gone has failed: its error is the save's.
                        let Ok(mut buffer) = to_fill.recv() else {
                            return Ok(());
                        };
                        // SAFETY: ordered after every stream's work (joined above); the buffer
                        // is read only once the copy completed (synchronized before it goes).
                        let queued = unsafe {
                            self.backend.copy_to_host(
                                Stream::Compute,
                                source,
                                Region::new(at, n, dtype),
                                &mut buffer,
                                0,
                            )
                        };
                        let done = queued.and_then(|()| self.compute_drained());
                        if let Err(e) = done {
                            self.settle(buffer);
                            return Err(e);
                        }
                        if full.send((buffer, n * dtype.size())).is_err() {
                            return Ok(());
                        }
                        at += n;
                    }
                }
                Ok(())
            });
            drop(full);
            let written = writer.join().unwrap_or_else(|_| {
                Err(Error::Panicked {
                    message: "the checkpoint writer panicked".into(),
                })
            });
            self.observe(copied).and(written)
        })
    }

    /// Orders the compute stream's next work after every stream's work so far.
    fn join_streams_on_compute(&self) -> Result<()> {
        for other in [Stream::Gather, Stream::Reduce] {
            let reached = self.backend.record(other)?;
            self.backend.wait(Stream::Compute, &reached)?;
        }
        Ok(())
    }

    /// Blocks until the compute stream's work so far completed.
    fn compute_drained(&self) -> Result<()> {
        let done = self.backend.record(Stream::Compute)?;
        self.backend.synchronize(&done)
    }

    /// Frees host memory that copies queued on the compute stream may still be writing once
    /// they are known to be done; never, when that cannot be known.
    fn settle(&self, buffer: B::HostBuffer) {
        match self.compute_drained() {
            Ok(()) => drop(buffer),
            Err(_) => std::mem::forget(buffer),
        }
    }

    /// As [`Engine::save`], with the files written on a thread of their own while training
    /// goes on: this rank's state is first copied on the compute stream into host memory
    /// (page-locked on a GPU; made at the first such save, the size of the rank's state, and
    /// kept for the next ones), the call returning once the copy is done. [`Engine::wait_save`]
    /// gives the save's outcome; one save is written at a time (`Error::SavePending` on every
    /// rank while one rank's is). Dropping the engine waits for the files.
    pub fn save_async(&mut self, dir: &Path) -> Result<()> {
        let parts = self.parts();
        let total: usize = parts.iter().map(bytes_of).sum();
        let started = self.begin_save(dir, Pending::Refused, |e| match e.save_staging.take() {
            Some((staging, bytes)) if bytes >= total => Ok((staging, bytes)),
            _ => Ok((e.backend.alloc_host(total)?, total)),
        })?;
        let Some((manifest, mut staging)) = started else {
            return Ok(());
        };
        let queued = self.effects(|e| {
            // After every stream's work so far, in the compute stream's order (before the next
            // optimizer step writes the state).
            e.join_streams_on_compute()?;
            for (p, section) in parts.iter().zip(&manifest.sections) {
                let buffer = e.state_buffer(p)?;
                // SAFETY: ordered after every stream's work above; the staging area is read
                // only once the copies completed (synchronized below).
                unsafe {
                    e.backend.copy_to_host(
                        Stream::Compute,
                        buffer,
                        p.region,
                        &mut staging.0,
                        section.offset as usize,
                    )
                }?;
            }
            Ok(())
        });
        let copied = self.compute_drained();
        if let Err(e) = queued.and(self.observe(copied)) {
            // Copies queued before the failure may still be writing the staging area.
            self.settle(staging.0);
            return Err(e);
        }
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

    /// The start of a save on every rank: the checks (this rank writes into a free directory,
    /// no pending save of its own is in the way) and `prepare` (what the writing needs), then
    /// the ranks' agreement on both and on the save's id. `None` on a rank that writes nothing
    /// (a later replica's, under hybrid sharding); else this rank's manifest, to be completed as
    /// its data is written, and what `prepare` made.
    fn begin_save<T>(
        &mut self,
        dir: &Path,
        pending: Pending,
        prepare: impl FnOnce(&mut Self) -> Result<T>,
    ) -> Result<Option<(RankManifest, T)>> {
        self.healthy()?;
        self.check_step_boundary("saving a checkpoint")?;
        let writes = self.comm.replica().index == 0;
        let checked = checkpoint::check_path(dir, "the checkpoint directory")
            .and_then(|()| self.check_pending(dir, pending))
            .and_then(|()| match writes {
                true => checkpoint::check_free(dir),
                false => Ok(()),
            })
            .and_then(|()| prepare(self))
            .map(|prepared| (prepared, SaveId::fresh().0));
        let (prepared, proposals) = self.agree(dir, checked)?;
        if !writes {
            return Ok(None);
        }
        let id = SaveId(proposals.first().copied().unwrap_or_default());
        Ok(Some((self.manifest(&self.parts(), id), prepared)))
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

    /// Refuses a save that this rank's asynchronous save, not yet waited for, is in the way of.
    fn check_pending(&self, dir: &Path, refused: Pending) -> Result<()> {
        match &self.pending_save {
            Some(p) if refused == Pending::Refused || p.dir == dir => Err(Error::SavePending {
                dir: p.dir.display().to_string(),
            }),
            _ => Ok(()),
        }
    }

    /// This rank's manifest of `parts` for save `id`, before its data's length and digests.
    fn manifest(&self, parts: &[Part], id: SaveId) -> RankManifest {
        let mut sections = Vec::with_capacity(parts.len());
        let mut offset = 0u64;
        for p in parts {
            let bytes = bytes_of(p) as u64;
            sections.push(Section {
                group: p.group,
                kind: p.kind,
                offset,
                bytes,
            });
            offset += bytes;
        }
        RankManifest {
            save_id: id.to_hex(),
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
            chunk_bytes: 0,
            chunk_xxh3: Vec::new(),
        }
    }

    /// Restores this rank's state from the checkpoint in `dir`, saved by engines of the same
    /// model (the same parameters, declared in the same order) and optimizer, at this world size
    /// or another: each rank takes its shard of every group from the saved ranks' parts that
    /// hold it, reading only those bytes, each once. A collective: every rank calls it, and
    /// nothing changes on any rank unless every rank's part checked out: every saved rank's
    /// manifest present, unchanged (its own checksum) and of one save (one save id), its
    /// fields consistent with the layout they describe; each chunk of data read of its
    /// manifest's checksum; the parameters equal to the plan's (`Error::CheckpointMismatch`
    /// lists what differs). A rank whose part failed returns its error, the others
    /// `Error::PeerRefused` naming it. The optimizer continues from the saved step with the
    /// saved learning rate and weight decay. Allowed at a step boundary only; holds this rank's
    /// state in host memory while it reads; blocks until the state is on the device.
    pub fn load(&mut self, dir: &Path) -> Result<()> {
        self.healthy()?;
        self.check_step_boundary("loading a checkpoint")?;
        let parts = self.parts();
        let total = parts.iter().map(bytes_of).sum();
        let mut host = self.load_memory(total);
        let read = match &mut host {
            Ok(host) => self.read_checkpoint(dir, &parts, host.bytes_mut(total)),
            Err(e) => Err(e.clone()),
        };
        let agreed = self.agree(dir, read.map(|settings| (settings, Proposal::default())));
        let loaded = agreed.and_then(|((optimizer, steps), _)| {
            let bytes = host.as_ref().map_or(&[][..], |h| h.bytes(total));
            self.effects(|e| {
                let mut at = 0;
                for p in &parts {
                    e.write_part(p, &bytes[at..at + bytes_of(p)])?;
                    at += bytes_of(p);
                }
                e.values_from_masters()
            })?;
            self.config.optimizer = optimizer;
            self.optimizer_steps = steps;
            Ok(())
        });
        if let Ok(LoadMemory::Staging(staging, bytes)) = host {
            self.save_staging = Some((staging, bytes));
        }
        loaded
    }

    /// Host memory for `total` bytes of this rank's state read from a checkpoint: the
    /// asynchronous saves' page-locked staging area where it is free and large enough (the
    /// uploads from it then run at the link's speed), else memory of its own.
    fn load_memory(&mut self, total: usize) -> Result<LoadMemory<B>> {
        match self.save_staging.take() {
            Some((staging, bytes)) if bytes >= total => Ok(LoadMemory::Staging(staging, bytes)),
            other => {
                self.save_staging = other;
                let owned = crate::fallible::zeroed(total, "this rank's state from a checkpoint")?;
                Ok(LoadMemory::Owned(owned))
            }
        }
    }

    /// Reads and checks this rank's `parts` of the checkpoint in `dir` into `bytes` (see
    /// [`Engine::load`]), with the optimizer settings and step count to take; nothing changes.
    fn read_checkpoint(
        &self,
        dir: &Path,
        parts: &[Part],
        bytes: &mut [u8],
    ) -> Result<(OptimizerConfig, u64)> {
        let saved = checkpoint::read_saved(dir)?;
        let first = &saved.manifests[0];
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
        checkpoint::read_copies(&saved, &self.copies(&saved, parts)?, bytes)?;
        Ok((optimizer, first.optimizer_steps))
    }

    /// Where each element of this rank's `parts` (one after another) lies in the saved ranks'
    /// data: for every parameter, the elements of this rank's shard range, found in the saved
    /// layout of the copy of its group that this rank holds. Padding stays zero.
    fn copies(&self, saved: &Saved, parts: &[Part]) -> Result<Vec<FileRange>> {
        let mut copies = Vec::new();
        let mut part_start = 0;
        for p in parts {
            let size = p.region.dtype.size();
            let group = &self.plan.groups()[p.group];
            let block = checkpoint::saved_block(&saved.manifests[0], &self.plan, group, self.rank)?;
            let mine = self.plan.shard_range(group, self.rank);
            for &id in &group.params {
                let layout = &self.plan.params()[id.0];
                let held = self.held_elements(id)?;
                // The manifests' parameters are the plan's, in its order (`differences`).
                for run in saved.runs(id.0, p.kind, block.start, held)? {
                    copies.push(FileRange {
                        rank: run.rank,
                        from: run.offset,
                        to: part_start + (layout.offset + run.elements.start - mine.start) * size,
                        bytes: run.elements.len() * size,
                    });
                }
            }
            part_start += bytes_of(p);
        }
        Ok(copies)
    }

    /// Every section of this rank's state, in group order.
    fn parts(&self) -> Vec<Part> {
        parts_of(&self.plan, &self.config)
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
