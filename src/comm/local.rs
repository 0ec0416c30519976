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

/// The collectives of one stream kind: the one in progress, met by every rank in turn.
#[derive(Debug)]
struct Channel {
    generation: u64,
    arrived: usize,
    deposits: Vec<Option<(Fingerprint, Vec<u8>)>>,
}

#[derive(Debug)]
struct Round {
    channels: [Channel; 3],
    /// Ranks whose handle was dropped.
    dropped: Vec<bool>,
    /// Each rank's watch: an aborted rank, or one whose thread ended, is gone for the others.
    watches: Vec<Watch>,
}

impl Round {
    /// A rank waiting in a channel other than `channel` for the collective that `mine` is in
    /// the engine's numbering (the same step and place in it), and its fingerprint: each rank
    /// issues that collective once, so the ranks diverged, and no meeting can come.
    fn crossed(&self, channel: usize, mine: &Fingerprint) -> Option<(usize, Fingerprint)> {
        let same_place = |f: &Fingerprint| (f.tag.step, f.tag.seq) == (mine.tag.step, mine.tag.seq);
        self.channels
            .iter()
            .enumerate()
            .filter(|&(c, _)| c != channel)
            .flat_map(|(_, ch)| ch.deposits.iter().enumerate())
            .find_map(|(r, d)| match d {
                Some((f, _)) if same_place(f) && f != mine => Some((r, *f)),
                _ => None,
            })
    }

    /// The first rank other than `rank` that is gone.
    fn gone(&self, rank: usize) -> Option<usize> {
        (0..self.dropped.len())
            .find(|&r| r != rank && (self.dropped[r] || self.watches[r].has_left()))
    }
}

fn channel_index(stream: Stream) -> usize {
    match stream {
        Stream::Compute => 0,
        Stream::Gather => 1,
        Stream::Reduce => 2,
    }
}

#[derive(Debug)]
struct Shared {
    world_size: usize,
    round: Mutex<Round>,
    changed: Condvar,
}

/// One rank's part in a collective.
struct Meeting<'a> {
    shared: &'a Shared,
    rank: usize,
    channel: usize,
    fingerprint: Fingerprint,
    watch: &'a Watch,
}

impl Meeting<'_> {
    fn lock(&self) -> MutexGuard<'_, Round> {
        // A rank that panicked while holding the lock left the round as it was: keep going.
        self.shared
            .round
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Waits until every rank arrived at this barrier of the channel; fails if a rank is gone
    /// first, this rank is aborted, or the deadline passes.
    fn barrier<'a>(&'a self, mut round: MutexGuard<'a, Round>) -> Result<MutexGuard<'a, Round>> {
        if self.watch.has_left() {
            return Err(self.gone(self.rank));
        }
        let channel = &mut round.channels[self.channel];
        let generation = channel.generation;
        channel.arrived += 1;
        if channel.arrived == self.shared.world_size {
            channel.arrived = 0;
            channel.generation += 1;
            self.shared.changed.notify_all();
            return Ok(round);
        }
        let (c, rank) = (self.channel, self.rank);
        self.shared.changed.notify_all();
        let waited = self.watch.wait_while(
            round,
            &self.shared.changed,
            || self.fingerprint.to_string(),
            |round| {
                if round.channels[c].generation != generation {
                    return Ok(false);
                }
                if let Some(r) = round.gone(rank) {
                    return Err(self.gone(r));
                }
                match round.crossed(c, &self.fingerprint) {
                    Some((peer, theirs)) => Err(Error::CollectivesCrossed {
                        rank,
                        mine: self.fingerprint.to_string(),
                        peer,
                        theirs: theirs.to_string(),
                    }),
                    None => Ok(true),
                }
            },
        );
        if waited.is_err() {
            // This rank leaves the meeting it never completed, so that a later one (a retried
            // engine creation) starts from an empty channel.
            let mut round = self.lock();
            let channel = &mut round.channels[c];
            if channel.generation == generation {
                channel.arrived = channel.arrived.saturating_sub(1);
            }
        }
        waited
    }

    fn gone(&self, rank: usize) -> Error {
        Error::PeerGone {
            rank,
            op: self.fingerprint.to_string(),
        }
    }

    /// Deposits this rank's data, waits for all, checks they issued the same collective, and
    /// hands every rank's data to `read`; then waits until all have read.
    fn exchange(&self, data: Vec<u8>, read: impl FnOnce(&[&[u8]])) -> Result<()> {
        let c = self.channel;
        let mut round = self.lock();
        round.channels[c].deposits[self.rank] = Some((self.fingerprint, data));
        round = match self.barrier(round) {
            Ok(round) => round,
            Err(e) => {
                // No rank read it: the deposit goes with this rank's arrival.
                self.lock().channels[c].deposits[self.rank] = None;
                return Err(e);
            }
        };
        let deposits = &round.channels[c].deposits;
        let expected = deposits[0].as_ref().map(|(f, _)| f);
        let differing = deposits
            .iter()
            .position(|d| d.as_ref().map(|(f, _)| f) != expected);
        let failure = match differing {
            Some(rank) => Some(mismatch(
                rank,
                expected,
                deposits[rank].as_ref().map(|(f, _)| f),
            )),
            None => {
                let parts: Vec<&[u8]> = deposits
                    .iter()
                    .filter_map(|d| d.as_ref().map(|(_, bytes)| bytes.as_slice()))
                    .collect();
                read(&parts);
                None
            }
        };
        let mut round = self.barrier(round)?;
        round.channels[c].deposits[self.rank] = None;
        drop(round);
        failure.map_or(Ok(()), Err)
    }
}

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
    run: Box<dyn FnOnce() -> Result<()> + Send>,
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
        self.shared
            .round
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
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
    let take = move || copy_of(unsafe { from.bytes(src) }, "an all-gather's deposit");
    let give = move |parts: &[&[u8]]| {
        let out = unsafe { into.bytes_mut(dst) };
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
    take: impl FnOnce() -> Result<Vec<u8>> + Send + 'static,
    give: impl FnOnce(&[&[u8]]) + Send + 'static,
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
        meeting.exchange(take()?, give)
    };
    match &mut comm.batch {
        Some(batch) => {
            batch.try_reserve(1).map_err(|_| Error::OutOfMemory {
                bytes: std::mem::size_of::<Queued>(),
                what: "a batch of collectives".into(),
            })?;
            batch.push(Queued {
                stream,
                run: Box::new(collective),
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
            .try_for_each(|queued| backend.run(queued.stream, queued.run))
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
    let take = move || copy_of(unsafe { memory.bytes(all) }, "a reduction's deposit");
    // The deposits are byte copies, with no alignment to read them as f32 slices.
    let give = move |parts: &[&[u8]]| {
        let out = unsafe { written.bytes_mut(out) };
        for (i, at) in kept.enumerate() {
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
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::backend::Backend;
    use crate::comm::Purpose;
    use crate::types::DType;

    /// The tag of the `seq`th collective of step 0, for group `group`.
    fn tag(group: usize, seq: u64) -> Tag {
        Tag {
            purpose: Purpose::Group(group),
            step: 0,
            seq,
        }
    }

    /// Eager, then asynchronous backends of a few seeds.
    const EVERY_MODE: [Option<u64>; 4] = [None, Some(1), Some(2), Some(3)];

    /// Runs `f` on every rank of a group, one thread each, eagerly and then on asynchronous
    /// backends of a few seeds; returns each run's results in rank order.
    fn run<R: Send>(world: usize, f: impl Fn(LocalComm, CpuBackend) -> R + Sync) -> Vec<Vec<R>> {
        run_in(&EVERY_MODE, world, f)
    }

    /// As [`run`], in the given modes (`None` for eager, else a seed).
    fn run_in<R: Send>(
        modes: &[Option<u64>],
        world: usize,
        f: impl Fn(LocalComm, CpuBackend) -> R + Sync,
    ) -> Vec<Vec<R>> {
        let backends = |seed: Option<u64>| -> Vec<CpuBackend> {
            (0..world)
                .map(|rank| match seed {
                    None => CpuBackend::new(),
                    Some(s) => CpuBackend::asynchronous(s * 31 + rank as u64).unwrap(),
                })
                .collect()
        };
        modes
            .iter()
            .map(|&seed| {
                let comms = LocalComm::group(world).unwrap();
                std::thread::scope(|s| {
                    let handles: Vec<_> = comms
                        .into_iter()
                        .zip(backends(seed))
                        .map(|(c, b)| {
                            let f = &f;
                            s.spawn(move || f(c, b))
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().unwrap()).collect()
                })
            })
            .collect()
    }

    fn f32s(len: usize) -> Region {
        Region::new(0, len, DType::F32)
    }

    fn read(b: &CpuBackend, buf: &CpuBuffer, len: usize) -> Vec<f32> {
        let mut out = vec![0f32; len];
        b.download(buf, f32s(len), bytemuck::cast_slice_mut(&mut out))
            .unwrap();
        out
    }

    fn filled(b: &CpuBackend, values: &[f32]) -> CpuBuffer {
        let mut buf = b.alloc(values.len() * 4).unwrap();
        b.upload(&mut buf, f32s(values.len()), bytemuck::cast_slice(values))
            .unwrap();
        buf
    }

    #[test]
    fn a_batch_runs_its_collectives_in_order_only_when_it_ends() {
        let runs = run_in(&[None], 2, |mut c, b| {
            let r = c.rank() as f32;
            let shard = filled(&b, &[r]);
            let mut out = filled(&b, &[-1.0, -1.0]);
            let mut sums = filled(&b, &[r + 1.0, 10.0 * r]);
            c.begin_batch().unwrap();
            assert!(matches!(c.begin_batch(), Err(Error::Unsupported { .. })));
            unsafe {
                c.all_gather(
                    &b,
                    Stream::Gather,
                    tag(0, 0),
                    &shard,
                    f32s(1),
                    &mut out,
                    f32s(2),
                )
                .unwrap();
                c.reduce_scatter(&b, Stream::Reduce, tag(1, 1), &mut sums, f32s(2), 1.0)
                    .unwrap();
            }
            // The eager backend ran nothing yet: the collectives wait for the batch's end.
            let before = (read(&b, &out, 2), read(&b, &sums, 2));
            c.end_batch(&b).unwrap();
            (before, read(&b, &out, 2), read(&b, &sums, 2))
        });
        for (rank, (before, gathered, summed)) in runs[0].iter().enumerate() {
            let r = rank as f32;
            assert_eq!(before, &(vec![-1.0, -1.0], vec![r + 1.0, 10.0 * r]));
            assert_eq!(gathered, &vec![0.0, 1.0]);
            assert_eq!(summed[rank], [3.0, 10.0][rank], "rank {rank}");
        }
    }

    #[test]
    fn all_gather_places_each_rank_in_order() {
        let runs = run(3, |mut c, b| {
            let r = c.rank() as f32;
            let shard = filled(&b, &[r, r + 0.5]);
            let mut full = b.alloc(24).unwrap();
            // SAFETY: both buffers are used on the gather stream only, then downloaded.
            unsafe {
                c.all_gather(
                    &b,
                    Stream::Gather,
                    tag(0, 0),
                    &shard,
                    f32s(2),
                    &mut full,
                    f32s(6),
                )
            }
            .unwrap();
            read(&b, &full, 6)
        });
        for out in runs.into_iter().flatten() {
            assert_eq!(out, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
        }
    }

    #[test]
    fn reduce_scatter_sums_in_rank_order() {
        // Values whose sum depends on the order of addition in f32.
        let vals = [1e8f32, 1.0, -1e8, 1.0];
        let ordered = ((vals[0] + vals[1]) + vals[2]) + vals[3];
        let runs = run(4, |mut c, b| {
            let mut buf = filled(&b, &[vals[c.rank()]; 4]);
            // SAFETY: the buffer is used on the reduce stream only, then downloaded.
            unsafe { c.reduce_scatter(&b, Stream::Reduce, tag(0, 0), &mut buf, f32s(4), 1.0) }
                .unwrap();
            read(&b, &buf, 4)[c.rank()]
        });
        for out in runs {
            assert_eq!(out, vec![ordered; 4]);
        }
    }

    #[test]
    fn all_reduce_leaves_the_rank_ordered_sum_on_every_rank() {
        let vals = [1e8f32, 1.0, -1e8, 1.0];
        let ordered = ((vals[0] * 0.5 + vals[1] * 0.5) + vals[2] * 0.5) + vals[3] * 0.5;
        let runs = run(4, |mut c, b| {
            let mut buf = filled(&b, &[7.0, vals[c.rank()], vals[c.rank()], 7.0]);
            // SAFETY: the buffer is used on the reduce stream only, then downloaded.
            unsafe {
                c.all_reduce(
                    &b,
                    Stream::Reduce,
                    tag(0, 0),
                    &mut buf,
                    Region::new(1, 2, DType::F32),
                    0.5,
                )
            }
            .unwrap();
            read(&b, &buf, 4)
        });
        for out in runs {
            assert_eq!(out, vec![vec![7.0, ordered, ordered, 7.0]; 4]);
        }
        let f16 = run_in(&[None], 1, |mut c, b| {
            let mut buf = b.alloc(8).unwrap();
            let region = Region::new(0, 4, DType::F16);
            unsafe { c.all_reduce(&b, Stream::Reduce, tag(0, 0), &mut buf, region, 1.0) }
        });
        assert!(matches!(f16[0][0], Err(Error::Unsupported { .. })));
    }

    #[test]
    fn a_scaled_sum_keeps_a_finite_mean_where_the_plain_sum_overflows() {
        let big = 3e38f32;
        let runs = run(2, |mut c, b| {
            let mut buf = filled(&b, &[big; 2]);
            // SAFETY: the buffer is used on the reduce stream only, then downloaded.
            unsafe { c.reduce_scatter(&b, Stream::Reduce, tag(0, 0), &mut buf, f32s(2), 0.5) }
                .unwrap();
            read(&b, &buf, 2)[c.rank()]
        });
        assert!((big + big).is_infinite());
        for out in runs {
            assert_eq!(out, vec![0.5 * big + 0.5 * big; 2]);
            assert!(out[0].is_finite());
        }
    }

    #[test]
    fn a_gather_and_a_reduction_in_flight_at_once_each_meet_their_own() {
        // Rank 0 issues the reduction first, rank 1 the gather: each stream kind pairs its own.
        // (Eager ranks would each block in a different collective.)
        let runs = run_in(&EVERY_MODE[1..], 2, |mut c, b| {
            let rank = c.rank() as f32;
            let shard = filled(&b, &[rank]);
            let mut full = b.alloc(8).unwrap();
            let mut grads = filled(&b, &[rank + 1.0; 2]);
            // SAFETY: each buffer is used on one stream only, then downloaded.
            unsafe {
                let gather = |c: &mut LocalComm, full: &mut CpuBuffer| {
                    c.all_gather(
                        &b,
                        Stream::Gather,
                        tag(0, 0),
                        &shard,
                        f32s(1),
                        full,
                        f32s(2),
                    )
                };
                if c.rank() == 0 {
                    c.reduce_scatter(&b, Stream::Reduce, tag(1, 1), &mut grads, f32s(2), 1.0)
                        .unwrap();
                    gather(&mut c, &mut full).unwrap();
                } else {
                    gather(&mut c, &mut full).unwrap();
                    c.reduce_scatter(&b, Stream::Reduce, tag(1, 1), &mut grads, f32s(2), 1.0)
                        .unwrap();
                }
            }
            (read(&b, &full, 2), read(&b, &grads, 2)[c.rank()])
        });
        for out in runs {
            assert_eq!(out, vec![(vec![0.0, 1.0], 3.0); 2]);
        }
    }

    /// The error a collective gave: at once on an eager backend, at the next call otherwise.
    /// The collective's outcome once its stream is done, a stream's failure as its cause (on an
    /// asynchronous backend a failure may already show when the next call is issued).
    fn outcome(b: &CpuBackend, issued: Result<()>) -> Result<(), Arc<Error>> {
        let cause = |e: Error| match e {
            Error::StreamFailed { cause, .. } => cause,
            e => Arc::new(e),
        };
        issued.map_err(cause)?;
        b.synchronize(&b.record(Stream::Reduce).map_err(cause)?)
            .map_err(cause)
    }

    #[test]
    fn mismatched_collectives_are_reported_on_every_rank() {
        let runs = run(2, |mut c, b| {
            let n = 2 + c.rank() * 2;
            let mut buf = b.alloc(n * 4).unwrap();
            // SAFETY: the buffer is used on the reduce stream only.
            let issued =
                unsafe { c.reduce_scatter(&b, Stream::Reduce, tag(0, 0), &mut buf, f32s(n), 1.0) };
            outcome(&b, issued)
        });
        for r in runs.into_iter().flatten() {
            assert!(
                matches!(
                    r.as_ref().map_err(|e| &**e),
                    Err(Error::CollectiveMismatch { rank: 1, .. })
                ),
                "{r:?}"
            );
        }
    }

    #[test]
    fn a_rank_that_leaves_fails_the_others_instead_of_hanging() {
        let runs = run(2, |mut c, b| {
            if c.rank() == 1 {
                drop(c);
                return Ok(());
            }
            let mut buf = b.alloc(8).unwrap();
            // SAFETY: the buffer is used on the reduce stream only.
            let issued =
                unsafe { c.reduce_scatter(&b, Stream::Reduce, tag(0, 0), &mut buf, f32s(2), 1.0) };
            outcome(&b, issued)
        });
        for out in runs {
            let left = out[0].as_ref().map_err(|e| &**e);
            assert!(
                matches!(left, Err(Error::PeerGone { rank: 1, .. })),
                "{out:?}"
            );
        }
    }

    #[test]
    fn lengths_are_checked_before_communicating() {
        let mut comms = LocalComm::group(2).unwrap();
        let b = CpuBackend::new();
        let mut buf = b.alloc(12).unwrap();
        // SAFETY: refused before anything is queued.
        let err = unsafe {
            comms[0].reduce_scatter(&b, Stream::Reduce, tag(0, 0), &mut buf, f32s(3), 1.0)
        }
        .unwrap_err();
        assert!(matches!(err, Error::OutOfRange { len: 3, .. }));
        assert!(matches!(LocalComm::group(0), Err(Error::ZeroWorldSize)));
    }

    #[test]
    fn collectives_of_one_size_for_different_groups_are_a_mismatch_naming_both() {
        let runs = run(2, |mut c, b| {
            let mut buf = b.alloc(16).unwrap();
            // Rank 0 reduces group 0 first, rank 1 group 1: equal sizes, different purposes.
            let group = c.rank();
            // SAFETY: the buffer is used on the reduce stream only.
            let issued = unsafe {
                c.reduce_scatter(&b, Stream::Reduce, tag(group, 0), &mut buf, f32s(4), 1.0)
            };
            outcome(&b, issued)
        });
        for r in runs.into_iter().flatten() {
            match r.as_ref().map_err(|e| &**e) {
                Err(Error::CollectiveMismatch {
                    rank: 1,
                    expected,
                    got,
                }) => {
                    assert!(expected.contains("group 0"), "{expected}");
                    assert!(got.contains("group 1"), "{got}");
                }
                other => panic!("{other:?}"),
            }
        }
    }

    #[test]
    fn a_peer_that_never_comes_is_a_timeout_and_an_abort_ends_the_wait() {
        let runs = run(2, |mut c, b| {
            if c.rank() == 1 {
                // Stays in the group without taking part, past rank 0's deadline.
                std::thread::sleep(Duration::from_millis(300));
                return Ok(());
            }
            c.set_watch(&Watch::new(Duration::from_millis(50)));
            let mut buf = b.alloc(8).unwrap();
            // SAFETY: the buffer is used on the reduce stream only.
            let issued =
                unsafe { c.reduce_scatter(&b, Stream::Reduce, tag(0, 0), &mut buf, f32s(2), 1.0) };
            outcome(&b, issued)
        });
        for out in runs {
            let waited = out[0].as_ref().map_err(|e| &**e);
            assert!(
                matches!(waited, Err(Error::Timeout { op, .. }) if op.contains("reduce-scatter of group 0")),
                "{out:?}"
            );
        }
        let runs = run(2, |mut c, b| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(300));
                return Ok(());
            }
            let watch = Watch::default();
            c.set_watch(&watch);
            let aborter = watch.clone();
            let t = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                aborter.abort();
            });
            let mut buf = b.alloc(8).unwrap();
            // SAFETY: the buffer is used on the reduce stream only.
            let issued =
                unsafe { c.reduce_scatter(&b, Stream::Reduce, tag(0, 0), &mut buf, f32s(2), 1.0) };
            let r = outcome(&b, issued);
            t.join().unwrap();
            r
        });
        for out in runs {
            assert!(
                matches!(out[0].as_ref().map_err(|e| &**e), Err(Error::Aborted)),
                "{out:?}"
            );
        }
    }

    #[test]
    fn a_rank_whose_watch_left_fails_its_peers_at_once() {
        let runs = run(2, |mut c, b| {
            let watch = Watch::default();
            c.set_watch(&watch);
            if c.rank() == 1 {
                watch.leave();
                std::thread::sleep(Duration::from_millis(200));
                return Ok(());
            }
            let mut buf = b.alloc(8).unwrap();
            // SAFETY: the buffer is used on the reduce stream only.
            let issued =
                unsafe { c.reduce_scatter(&b, Stream::Reduce, tag(0, 0), &mut buf, f32s(2), 1.0) };
            outcome(&b, issued)
        });
        for out in runs {
            let gone = out[0].as_ref().map_err(|e| &**e);
            assert!(
                matches!(gone, Err(Error::PeerGone { rank: 1, .. })),
                "{out:?}"
            );
        }
    }
}
