//! Saving this rank's part of a sharded checkpoint at a step boundary, a collective
//! ([`super::agree`]): before anything is written, the ranks agree on the save's id and that
//! every writer's directory is free. A blocking save streams the state through two host pieces;
//! an asynchronous one copies it into page-locked memory and writes it on a thread.

use std::path::Path;

use super::Engine;
use super::parts::{Part, bytes_of, optimizer_name};
use crate::backend::{Backend, Region};
use crate::checkpoint::{self, RankManifest, SaveId, Section};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::types::Stream;

/// How often [`Engine::wait_save`] looks at the writer.
const SAVE_POLL: std::time::Duration = std::time::Duration::from_millis(1);

/// The writer of an asynchronous save, which gives its staging area back; dropping it waits for
/// the files.
/// What saving owns: the files of an asynchronous save being written, and the host memory the
/// last one copied into.
pub(super) struct Saving<H> {
    /// The files of [`Engine::save_async`] being written.
    pub(super) pending: Option<PendingSave<H>>,
    /// The host memory the last asynchronous save copied into, and its bytes.
    pub(super) staging: Option<(H, usize)>,
}

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
        let parts = self.parts();
        let total: usize = parts.iter().map(bytes_of).sum();
        let piece = total.clamp(1, checkpoint::CHUNK_BYTES as usize);
        let started = self.begin_save(dir, Pending::SameDirRefused, |e| {
            Ok([e.backend.alloc_host(piece)?, e.backend.alloc_host(piece)?])
        })?;
        let Some((manifest, pieces)) = started else {
            return Ok(());
        };
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
    pub(super) fn join_streams_on_compute(&self) -> Result<()> {
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
        let started =
            self.begin_save(dir, Pending::Refused, |e| match e.saving.staging.take() {
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
        self.saving.pending = Some(PendingSave {
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
        // The saved step count leaves out the steps the device skipped. Read before this rank's
        // own checks, so that a save another rank's checks fail leaves every rank's counts alike.
        let checked = self
            .read_device_skips()
            .map(drop)
            .and_then(|()| checkpoint::check_path(dir, "the checkpoint directory"))
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
        self.healthy()?;
        let Some(mut pending) = self.saving.pending.take() else {
            return Ok(());
        };
        let what = || format!("the save into {}", pending.dir.display());
        let waited = self.watch.poll(SAVE_POLL, what, || {
            Ok(pending.thread.as_ref().is_none_or(|t| t.is_finished()))
        });
        if let Err(e) = waited {
            self.saving.pending = Some(pending);
            return Err(e);
        }
        match pending.thread.take().map(std::thread::JoinHandle::join) {
            None => Ok(()),
            Some(Ok((written, staging))) => {
                self.saving.staging = Some(staging);
                written
            }
            Some(Err(_)) => Err(Error::Panicked {
                message: what() + " panicked",
            }),
        }
    }

    /// Whether [`Engine::save_async`]'s files are still being written.
    pub fn save_pending(&self) -> bool {
        self.saving
            .pending
            .as_ref()
            .is_some_and(|p| p.thread.as_ref().is_some_and(|t| !t.is_finished()))
    }

    /// Refuses a save that this rank's asynchronous save, not yet waited for, is in the way of.
    fn check_pending(&self, dir: &Path, refused: Pending) -> Result<()> {
        match &self.saving.pending {
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
            optimizer_steps: self.optimizer.steps,
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
}
