//! Ranks as threads of one process, exchanging through shared host memory.
//!
//! A collective runs on the stream it is issued on: at once on an eager [`CpuBackend`], in the
//! stream's worker on an asynchronous one, where the ranks' workers meet. Each stream kind is its
//! own channel (as separate communicators for gathers and reductions are on a GPU), so a gather
//! and a reduction in flight at once cannot pair up. The ranks compare every collective's
//! [`Fingerprint`] and all fail, naming both versions, on a difference; a rank that left (dropped,
//! aborted, its thread gone) fails its peers' waits at once, and every wait has the rank's
//! deadline.

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::backend::Region;
use crate::backend::cpu::{CpuBackend, CpuBuffer, Memory};
use crate::comm::{
    Communicator, Fingerprint, Tag, check_all_gather, check_all_reduce, check_reduce_scatter,
    mismatch, own_part,
};
use crate::dtype::{load_f32, store_f32};
use crate::error::{Error, Result};
use crate::fallible::{copy_of, filled};
use crate::types::Stream;
use crate::watch::Watch;
use meeting::{Channel, Meeting, Round, Shared, channel_index};

mod meeting;

/// One rank's handle on a group of threads. Dropping it tells the others it left.
#[derive(Debug)]
pub struct LocalComm {
    shared: Arc<Shared>,
    rank: usize,
    watch: Watch,
    /// The collectives of the batch under way, queued at its end.
    batch: Option<Vec<Queued>>,
}

/// One rank's part of a collective, kept for its stream until its batch ends.
struct Queued {
    stream: Stream,
    run: Arc<dyn Fn() -> Result<()> + Send + Sync>,
}

impl std::fmt::Debug for Queued {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a collective for the {:?} stream", self.stream)
    }
}

impl LocalComm {
    /// Handles for `world_size` ranks, one per thread, in rank order.
    pub fn group(world_size: usize) -> Result<Vec<LocalComm>> {
        if world_size == 0 {
            return Err(Error::ZeroWorldSize);
        }
        let what = "a local group";
        let channel = || -> Result<Channel> {
            Ok(Channel {
                generation: 0,
                arrived: 0,
                deposits: filled(world_size, None, what)?,
            })
        };
        let watches = filled(world_size, Watch::default(), what)?;
        let shared = Arc::new(Shared {
            world_size,
            round: Mutex::new(Round {
                channels: [channel()?, channel()?, channel()?],
                dropped: filled(world_size, false, what)?,
                watches: watches.clone(),
            }),
            changed: Condvar::new(),
        });
        let mut comms = crate::fallible::with_capacity(world_size, what)?;
        comms.extend(
            watches
                .into_iter()
                .enumerate()
                .map(|(rank, watch)| LocalComm {
                    shared: Arc::clone(&shared),
                    rank,
                    watch,
                    batch: None,
                }),
        );
        Ok(comms)
    }

    fn lock(&self) -> MutexGuard<'_, Round> {
        // A rank that panicked while holding the lock left the round as it was: keep going.
        crate::sync::lock(&self.shared.round)
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        self.lock().dropped[self.rank] = true;
        self.shared.changed.notify_all();
    }
}

/// Runs one collective on `stream`: the meeting happens where the stream runs it.
/// An all-gather of the bytes `src` of `from` into `dst` of `into`, rank `r`'s part at `r` times
/// their length; `src` may lie inside `dst` (in place): it is copied before anything is written.
fn gather_bytes(
    comm: &mut LocalComm,
    (backend, stream): (&CpuBackend, Stream),
    fingerprint: Fingerprint,
    (from, src): (Arc<Memory>, Range<usize>),
    (into, dst): (Arc<Memory>, Range<usize>),
) -> Result<()> {
    let part = src.len();
    // SAFETY (both closures): the caller ordered every other use of both ranges (the trait's
    // contract); the deposit is a copy, taken before the parts are written.
    let take = move || {
        copy_of(
            unsafe { from.bytes(src.clone()) },
            "an all-gather's deposit",
        )
    };
    let give = move |parts: &[&[u8]]| {
        let out = unsafe { into.bytes_mut(dst.clone()) };
        for (rank, bytes) in parts.iter().enumerate() {
            out[rank * part..(rank + 1) * part].copy_from_slice(bytes);
        }
    };
    meet(comm, backend, stream, fingerprint, take, give)
}

/// Queues the rank's part of one collective on `stream`, or keeps it for the end of the batch
/// under way.
fn meet(
    comm: &mut LocalComm,
    backend: &CpuBackend,
    stream: Stream,
    fingerprint: Fingerprint,
    take: impl Fn() -> Result<Vec<u8>> + Send + Sync + 'static,
    give: impl Fn(&[&[u8]]) + Send + Sync + 'static,
) -> Result<()> {
    let (shared, rank, watch) = (Arc::clone(&comm.shared), comm.rank, comm.watch.clone());
    let collective = move || {
        let meeting = Meeting {
            shared: &shared,
            rank,
            channel: channel_index(stream),
            fingerprint,
            watch: &watch,
        };
        meeting.exchange(take()?, &give)
    };
    match &mut comm.batch {
        Some(batch) => {
            batch.try_reserve(1).map_err(|_| Error::OutOfMemory {
                bytes: std::mem::size_of::<Queued>(),
                what: "a batch of collectives".into(),
            })?;
            batch.push(Queued {
                stream,
                run: Arc::new(collective),
            });
            Ok(())
        }
        None => backend.run(stream, collective),
    }
}

impl Communicator<CpuBackend> for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    fn set_watch(&mut self, watch: &Watch) {
        self.watch = watch.clone();
        self.lock().watches[self.rank] = watch.clone();
        self.shared.changed.notify_all();
    }

    /// The rank leaves the group: its peers' waits for it fail at once.
    fn abort(&self) {
        self.watch.leave();
        self.shared.changed.notify_all();
    }

    /// The batch's collectives run when it ends, as NCCL's group call launches them, so that
    /// the engine's order of work around a batch is checked on the CPU too.
    fn begin_batch(&mut self) -> Result<()> {
        if self.batch.is_some() {
            return Err(Error::Unsupported {
                backend: "communicator",
                what: "a batch of collectives inside another",
            });
        }
        self.batch = Some(Vec::new());
        Ok(())
    }

    fn end_batch(&mut self, backend: &CpuBackend) -> Result<()> {
        self.batch
            .take()
            .into_iter()
            .flatten()
            .try_for_each(|queued| backend.run(queued.stream, move || (queued.run)()))
    }

    unsafe fn all_gather(
        &mut self,
        backend: &CpuBackend,
        stream: Stream,
        tag: Tag,
        shard: &CpuBuffer,
        shard_region: Region,
        out: &mut CpuBuffer,
        out_region: Region,
    ) -> Result<()> {
        check_all_gather(self.shared.world_size, shard_region, out_region)?;
        let src = shard_region.byte_range(shard.len())?;
        let dst = out_region.byte_range(out.len())?;
        let fingerprint = Fingerprint::all_gather(tag, shard_region);
        let (shard, out) = (Arc::clone(shard.memory()), Arc::clone(out.memory()));
        gather_bytes(
            self,
            (backend, stream),
            fingerprint,
            (shard, src),
            (out, dst),
        )
    }

    unsafe fn all_gather_in_place(
        &mut self,
        backend: &CpuBackend,
        stream: Stream,
        tag: Tag,
        buf: &mut CpuBuffer,
        region: Region,
    ) -> Result<()> {
        let own = own_part(self.shared.world_size, self.rank, region)?;
        let src = own.byte_range(buf.len())?;
        let dst = region.byte_range(buf.len())?;
        let fingerprint = Fingerprint::all_gather(tag, Region::new(0, own.len, own.dtype));
        let (memory, written) = (Arc::clone(buf.memory()), Arc::clone(buf.memory()));
        gather_bytes(
            self,
            (backend, stream),
            fingerprint,
            (memory, src),
            (written, dst),
        )
    }

    unsafe fn reduce_scatter(
        &mut self,
        backend: &CpuBackend,
        stream: Stream,
        tag: Tag,
        buf: &mut CpuBuffer,
        region: Region,
        scale: f32,
    ) -> Result<()> {
        let world = self.shared.world_size;
        check_reduce_scatter(world, region)?;
        let part = region.len / world;
        let fingerprint = Fingerprint::reduce_scatter(tag, region);
        let kept = self.rank * part..(self.rank + 1) * part;
        reduce(
            self,
            (backend, stream),
            fingerprint,
            (buf, region),
            kept,
            scale,
        )
    }

    unsafe fn all_reduce(
        &mut self,
        backend: &CpuBackend,
        stream: Stream,
        tag: Tag,
        buf: &mut CpuBuffer,
        region: Region,
        scale: f32,
    ) -> Result<()> {
        check_all_reduce(region)?;
        let fingerprint = Fingerprint::all_reduce(tag, region);
        reduce(
            self,
            (backend, stream),
            fingerprint,
            (buf, region),
            0..region.len,
            scale,
        )
    }
}

/// Sums `scale` times every rank's `region` of its buffer, in f32 in rank order, and writes the
/// elements `kept` (of the region) of the sum in place, rounded once.
fn reduce(
    comm: &mut LocalComm,
    (backend, stream): (&CpuBackend, Stream),
    fingerprint: Fingerprint,
    (buf, region): (&mut CpuBuffer, Region),
    kept: Range<usize>,
    scale: f32,
) -> Result<()> {
    let dtype = region.dtype;
    let all = region.byte_range(buf.len())?;
    let out = Region::new(region.offset + kept.start, kept.len(), dtype).byte_range(buf.len())?;
    let (memory, written) = (Arc::clone(buf.memory()), Arc::clone(buf.memory()));
    // SAFETY (both closures): the caller ordered every other use of the region (the trait's
    // contract); every rank's deposit is a copy, taken before any rank writes.
    let take = move || {
        copy_of(
            unsafe { memory.bytes(all.clone()) },
            "a reduction's deposit",
        )
    };
    // The deposits are byte copies, with no alignment to read them as f32 slices.
    let give = move |parts: &[&[u8]]| {
        let out = unsafe { written.bytes_mut(out.clone()) };
        for (i, at) in kept.clone().enumerate() {
            let value = |part: &[u8]| load_f32(part, dtype, at);
            let mut acc = scale * value(parts[0]);
            for part in &parts[1..] {
                acc += scale * value(part);
            }
            store_f32(out, dtype, i, acc);
        }
    };
    meet(comm, backend, stream, fingerprint, take, give)
}

#[cfg(test)]
mod tests;
