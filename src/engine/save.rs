//! Saving this rank's part of a sharded checkpoint at a step boundary, a collective
//! ([`super::agree`]): before anything is written, the ranks agree on the save's id and that
//! every writer's directory is free; once written, on its outcome, so that every rank reports
//! a save that failed anywhere, and the ranks that wrote remove their files. A blocking save
//! streams the state through two host pieces; an asynchronous one copies it into page-locked
//! memory and writes it on a thread.

use std::path::Path;

use super::Engine;
use super::agree::Proposal;
use super::parts::{Part, bytes_of, optimizer_name};
use crate::backend::{Backend, Region};
use crate::checkpoint::{self, RankManifest, SaveId, Section};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::threads::spawn_scoped;
use crate::types::Stream;

/// How often [`Engine::wait_save`] looks at the writer.
const SAVE_POLL: std::time::Duration = std::time::Duration::from_millis(1);

/// What saving owns: the files of an asynchronous save being written, and the host memory the
/// last one copied into.
pub(super) struct Saving<H> {
    /// The files of [`Engine::save_async`] being written.
    pub(super) pending: Option<PendingSave<H>>,
    /// The host memory the last asynchronous save copied into, and its bytes.
    pub(super) staging: Option<(H, usize)>,
}

/// An asynchronous save of this rank: its writer, which gives its staging area back, or its
/// outcome; dropping it waits for the files.
pub(super) struct PendingSave<H> {
    dir: std::path::PathBuf,
    rank: usize,
    thread: Option<std::thread::JoinHandle<Written<H>>>,
    /// The writer's outcome, once it ended, until the ranks agreed on the save's.
    written: Option<Result<()>>,
    /// The save failed on some rank while this rank's writer still ran: the files it wrote
    /// are removed once it ends.
    failed: bool,
}

impl<H> PendingSave<H> {
    /// The writer's outcome, waiting for it; its staging area goes back through `staging`.
    fn join(&mut self, staging: &mut Option<(H, usize)>) -> Option<&Result<()>> {
        if let Some(thread) = self.thread.take() {
            self.written = Some(match thread.join() {
                Ok((written, area)) => {
                    *staging = Some(area);
                    written
                }
                Err(_) => Err(Error::Panicked {
                    message: format!("the save into {} panicked", self.dir.display()),
                }),
            });
        }
        self.written.as_ref()
    }
}

/// This rank's part of an asynchronous save, as [`Engine::wait_save`]'s ranks agree on it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum OwnFiles {
    /// No save pending.
    None = 0,
    /// Written, on disk.
    Written = 1,
    /// The writer still runs.
    Writing = 2,
}

/// What the writer of an asynchronous save ends with: its outcome, and the staging area (with
/// its bytes) for the next save.
type Written<H> = (Result<()>, (H, usize));

impl<H> Drop for PendingSave<H> {
    fn drop(&mut self) {
        let wrote = matches!(self.join(&mut None), Some(Ok(())));
        if self.failed && wrote {
            // Best effort: the save's failure was reported.
            let _ = checkpoint::remove_rank(&self.dir, self.rank);
        }
    }
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Writes this rank's state into `dir` (made if missing): each group's values in its dtype (a
    /// trainable bf16/f16 group's fp32 master instead, which the values are rounded from), AdamW's
    /// moments, the optimizer's step count and settings and the plan's layout. A collective: every
    /// rank calls it with the same `dir`, and the ranks agree first on the save's id, which every
    /// manifest records, and that `dir` holds no rank file of any checkpoint (otherwise nothing is
    /// written: `Error::CheckpointExists` on the ranks that found one, `Error::PeerRefused`
    /// carrying it on the others). Each rank then writes its data and its manifest, each under a
    /// unique temporary name, flushed and linked into place, and the directory flushed: a part that
    /// a crash interrupts is never taken for a whole one, and no existing file is replaced. Then
    /// the ranks agree on the outcome: `Ok` on every rank once every rank's files are on disk;
    /// where a rank's write failed, its error there, `Error::PeerRefused` naming it on the others,
    /// and no rank's file of the save left (a rank that wrote removes its files); a failure that
    /// poisons a rank while it writes (its device, an abort) fails the agreement instead, on every
    /// rank, and the files already written stay (a load refuses them: the save is incomplete). The
    /// ranks' writes end within the engine's timeout of each other; under hybrid sharding the ranks
    /// of later replicas write nothing and wait for the writers' outcome within the timeout, so a
    /// rank's whole write must take less ([`Engine::save_async`] has no such bound: its
    /// [`Engine::wait_save`] reports a write still under way). Refused between a step's first hook
    /// and its `end_step` (`Error::MidStep`), and while an asynchronous save is pending
    /// (`Error::SavePending`). Blocks until every byte is on disk. Under hybrid sharding only the
    /// first replica's ranks write: every replica holds the same state.
    pub fn save(&mut self, dir: &Path) -> Result<()> {
        let parts = self.parts();
        let total: usize = parts.iter().map(bytes_of).sum();
        let piece = total.clamp(1, checkpoint::CHUNK_BYTES as usize);
        let started = self.begin_save(dir, |e| {
            Ok([e.backend.alloc_host(piece)?, e.backend.alloc_host(piece)?])
        })?;
        let written = match started {
            None => Ok(false),
            Some((manifest, pieces)) => checkpoint::write_rank(dir, manifest, |write| {
                self.stream_parts(&parts, (pieces, piece), write)
            })
            .map(|()| true),
        };
        self.agree_on_written(dir, written)
    }

    /// The ranks' agreement on a save's outcome, after this rank wrote its files (`Ok(true)`),
    /// wrote none (`Ok(false)`: a later replica's rank, or no save pending) or failed. Where the
    /// save failed on another rank, this rank's files are removed.
    fn agree_on_written(&mut self, dir: &Path, written: Result<bool>) -> Result<()> {
        let wrote = matches!(written, Ok(true));
        let rank = self.rank;
        let outcome = written.map(|_| ((), Proposal::default()));
        let undo = || {
            if wrote {
                // Best effort: the peer's failure is the error to report.
                let _ = checkpoint::remove_rank(dir, rank);
            }
        };
        self.agree_undoing(dir, outcome, undo).map(drop)
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
            let writer = spawn_scoped(s, "the checkpoint writer", move || -> Result<()> {
                for (buffer, bytes) in to_write {
                    // SAFETY: the copy into the buffer completed before it was sent.
                    write(&unsafe { B::host_bytes(&buffer) }[..bytes])?;
                    let _ = empty.send(buffer);
                }
                Ok(())
            })?;
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
    /// gives the save's outcome; one save is pending at a time, until `wait_save` gave its
    /// outcome (`Error::SavePending` on every rank while one rank's is). A failure on this rank
    /// after the ranks agreed to the save is its error here; its writer's start failing stays
    /// pending, for every rank's `wait_save` to report; its copy failing poisons the engine
    /// (the device failed), and the other ranks' `wait_save` fail at their deadline. Dropping
    /// the engine waits for the files.
    pub fn save_async(&mut self, dir: &Path) -> Result<()> {
        let parts = self.parts();
        let total: usize = parts.iter().map(bytes_of).sum();
        // New host memory only where the kept one is too small; the kept one is taken once the
        // ranks agreed, so that a refused save leaves it for the next.
        let started = self.begin_save(dir, |e| match &e.saving.staging {
            Some((_, bytes)) if *bytes >= total => Ok(None),
            _ => Ok(Some((e.backend.alloc_host(total)?, total))),
        })?;
        let Some((manifest, made)) = started else {
            return Ok(());
        };
        let Some(mut staging) = made.or_else(|| self.saving.staging.take()) else {
            let lost = Error::Panicked {
                message: "the asynchronous save's host memory went between its check and use"
                    .into(),
            };
            return self.pending_failure(dir, lost);
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
            return self.pending_failure(dir, e);
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
            });
        match thread {
            Ok(thread) => {
                self.saving.pending = Some(self.pending(dir, Some(thread), None));
                Ok(())
            }
            Err(e) => self.pending_failure(dir, e),
        }
    }

    /// A save into `dir` pending on this rank: its writer, or its outcome.
    fn pending(
        &self,
        dir: &Path,
        thread: Option<std::thread::JoinHandle<Written<B::HostBuffer>>>,
        written: Option<Result<()>>,
    ) -> PendingSave<B::HostBuffer> {
        PendingSave {
            dir: dir.to_path_buf(),
            rank: self.rank,
            thread,
            written,
            failed: false,
        }
    }

    /// `e`, a failure of this rank's asynchronous save after the ranks agreed to it: the save
    /// stays pending with it, so that every rank's [`Engine::wait_save`] reports it.
    fn pending_failure(&mut self, dir: &Path, e: Error) -> Result<()> {
        self.saving.pending = Some(self.pending(dir, None, Some(Err(e.clone()))));
        Err(e)
    }

    /// The start of a save on every rank: the checks (this rank writes into a free directory,
    /// no pending save of its own is in the way) and `prepare` (what the writing needs), then
    /// the ranks' agreement on both and on the save's id. `None` on a rank that writes nothing
    /// (a later replica's, under hybrid sharding); else this rank's manifest, to be completed as
    /// its data is written, and what `prepare` made.
    fn begin_save<T>(
        &mut self,
        dir: &Path,
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
            .and_then(|()| self.check_no_pending())
            .and_then(|()| match writes {
                true => checkpoint::check_free(dir),
                false => Ok(()),
            })
            // What the writing needs, on a rank that writes only.
            .and_then(|()| writes.then(|| prepare(self)).transpose())
            .map(|prepared| (prepared, SaveId::fresh().0));
        let (prepared, proposals) = self.agree(dir, checked)?;
        let Some(prepared) = prepared else {
            return Ok(None);
        };
        let id = SaveId(proposals.first().copied().unwrap_or_default());
        Ok(Some((self.manifest(&self.parts(), id), prepared)))
    }

    /// Gives the outcome of [`Engine::save_async`], a collective: every rank calls it, between
    /// steps. Each rank waits for its files (within half the engine's timeout above world size
    /// 1, so that the ranks' agreement after it meets within the timeout), then the ranks agree
    /// on the outcome: `Ok` on every rank once every rank's files are on disk, the save no
    /// longer pending; `Error::Timeout` on every rank, the save still pending and nothing
    /// removed, while a rank's files are still being written (call again); and where a rank's
    /// write failed, its error there and `Error::PeerRefused` naming it on the others, each
    /// rank's files of the save removed (a writer still running removes its own when it ends,
    /// at the next `wait_save` or the engine's drop; a failure of the agreement itself, which
    /// poisons the engine, before a peer's failure was seen removes nothing). `Ok` when no save
    /// is pending on any rank. Refused (`Error::MidStep`, `Error::Capture`) on a rank mid-step
    /// or capturing, before the exchange: every rank calls it between steps.
    pub fn wait_save(&mut self) -> Result<()> {
        self.healthy()?;
        self.check_step_boundary("waiting for a save")?;
        let dir = (self.saving.pending.as_ref()).map_or_else(
            || std::path::PathBuf::from("the asynchronous save"),
            |p| p.dir.clone(),
        );
        let own = self.wait_own_files();
        let (wrote, writing) = (
            matches!(own, Ok(OwnFiles::Written)),
            matches!(own, Ok(OwnFiles::Writing)),
        );
        // This rank's writer ended in failure: nothing of it is left to wait for or remove.
        let own_failed =
            (self.saving.pending.as_ref()).is_some_and(|p| matches!(p.written, Some(Err(_))));
        let rank = self.rank;
        // Whether a peer's write failed (seen before the failure's message is exchanged).
        let peer_failed = std::cell::Cell::new(false);
        let undo = || {
            peer_failed.set(true);
            if wrote {
                // Best effort: the peer's failure is the error to report.
                let _ = checkpoint::remove_rank(&dir, rank);
            }
        };
        let outcome = own.map(|files| ((), [files as u8; 16]));
        let agreed = self.agree_undoing(&dir, outcome, undo);
        if peer_failed.get()
            && writing
            && let Some(p) = self.saving.pending.as_mut()
        {
            // This rank's writer removes its files when it ends, whatever the rest of the
            // exchange did.
            p.failed = true;
        }
        match agreed {
            Ok(((), every)) => match every.iter().position(|p| p[0] == OwnFiles::Writing as u8) {
                Some(writing) => Err(Error::Timeout {
                    op: format!(
                        "the save into {}: rank {writing}'s files still being written (it stays \
                         pending)",
                        dir.display()
                    ),
                    waited: self.own_files_wait(),
                }),
                None => {
                    self.saving.pending = None;
                    Ok(())
                }
            },
            Err(e) => {
                // This rank's files went (the undo) or go when its writer ends; a failure of the
                // exchange before any peer's failure was seen leaves them (the outcome is not
                // known, and the engine is poisoned).
                if (peer_failed.get() && !writing) || own_failed {
                    self.saving.pending = None;
                }
                Err(e)
            }
        }
    }

    /// How long [`Engine::wait_save`] waits for this rank's files.
    fn own_files_wait(&self) -> std::time::Duration {
        match self.comm.grid_size() {
            1 => self.watch.timeout(),
            _ => self.watch.timeout() / 2,
        }
    }

    /// Waits for this rank's files of [`Engine::save_async`], as [`Engine::wait_save`] does:
    /// where they are. A failed save's writer that ended is done with (its files removed).
    fn wait_own_files(&mut self) -> Result<OwnFiles> {
        let within = self.own_files_wait();
        let Some(mut pending) = self.saving.pending.take() else {
            return Ok(OwnFiles::None);
        };
        let what = || format!("the save into {}", pending.dir.display());
        let ended = self.watch.poll_within(within, SAVE_POLL, what, || {
            Ok(pending.thread.as_ref().is_none_or(|t| t.is_finished()))
        });
        let own = match ended {
            // The wait's own deadline, not a failure of the rank.
            Err(Error::Timeout { .. }) if self.watch.check().is_ok() => Ok(OwnFiles::Writing),
            Err(e) => Err(e),
            Ok(()) => {
                let written = pending.join(&mut self.saving.staging).cloned();
                if pending.failed {
                    return Ok(OwnFiles::None);
                }
                written.unwrap_or(Ok(())).map(|()| OwnFiles::Written)
            }
        };
        self.saving.pending = Some(pending);
        own
    }

    /// Whether [`Engine::save_async`]'s files are still being written.
    pub fn save_pending(&self) -> bool {
        self.saving
            .pending
            .as_ref()
            .is_some_and(|p| p.thread.as_ref().is_some_and(|t| !t.is_finished()))
    }

    /// Refuses a save while this rank's asynchronous one has not had its outcome given.
    fn check_no_pending(&self) -> Result<()> {
        match &self.saving.pending {
            Some(p) => Err(Error::SavePending {
                dir: p.dir.display().to_string(),
            }),
            None => Ok(()),
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
