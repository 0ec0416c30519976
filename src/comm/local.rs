//! Ranks as threads of one process, exchanging through shared host memory.
//!
//! A collective runs on the stream it is issued on: at once on an eager [`CpuBackend`], in the
//! stream's worker on an asynchronous one, where the ranks' workers meet. Each stream kind is its
//! own channel with its own sequence numbers (as separate communicators for gathers and
//! reductions are on a GPU), so a gather and a reduction in flight at once cannot pair up.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::backend::cpu::{CpuBackend, CpuBuffer, copy_of};
use crate::backend::{Region, Stream};
use crate::comm::{Communicator, check_all_gather, check_reduce_scatter};
use crate::dtype::DType;
use crate::error::{Error, Result};

#[derive(Clone, Debug, PartialEq, Eq)]
enum Op {
    AllGather { bytes: usize },
    ReduceScatter { numel: usize },
}

impl Op {
    fn describe(&self) -> String {
        match self {
            Op::AllGather { bytes } => format!("all-gather of {bytes} bytes per rank"),
            Op::ReduceScatter { numel } => format!("reduce-scatter of {numel} f32"),
        }
    }
}

/// The collectives of one stream kind: the one in progress, met by every rank in turn.
#[derive(Debug)]
struct Channel {
    generation: u64,
    arrived: usize,
    deposits: Vec<Option<(Op, Vec<u8>)>>,
}

#[derive(Debug)]
struct Round {
    channels: [Channel; 3],
    left: Vec<bool>,
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

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Round> {
        // A rank that panicked while holding the lock left the round as it was: keep going.
        self.round
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Waits until every rank arrived at this barrier of channel `c`; fails if a rank left first.
    fn barrier<'a>(
        &'a self,
        mut round: MutexGuard<'a, Round>,
        c: usize,
        seq: u64,
    ) -> Result<MutexGuard<'a, Round>> {
        let channel = &mut round.channels[c];
        let generation = channel.generation;
        channel.arrived += 1;
        if channel.arrived == self.world_size {
            channel.arrived = 0;
            channel.generation += 1;
            self.changed.notify_all();
            return Ok(round);
        }
        while round.channels[c].generation == generation {
            if let Some(rank) = round.left.iter().position(|&l| l) {
                return Err(Error::RankLeft { seq, rank });
            }
            round = self.changed.wait(round).unwrap_or_else(|p| p.into_inner());
        }
        Ok(round)
    }

    /// Deposits this rank's data, waits for all, checks they issued the same operation, and hands
    /// every rank's data to `read`; then waits until all have read.
    fn exchange(
        &self,
        rank: usize,
        stream: Stream,
        seq: u64,
        op: Op,
        data: Vec<u8>,
        read: impl FnOnce(&[&[u8]]),
    ) -> Result<()> {
        let c = channel_index(stream);
        let mut round = self.lock();
        round.channels[c].deposits[rank] = Some((op, data));
        round = self.barrier(round, c, seq)?;
        let deposits = &round.channels[c].deposits;
        let mut parts: Vec<&[u8]> = Vec::with_capacity(self.world_size);
        let mut mismatch = None;
        let expected = deposits[0].as_ref().map(|(op, _)| op.clone());
        for (rank, deposit) in deposits.iter().enumerate() {
            match deposit {
                Some((op, bytes)) if Some(op) == expected.as_ref() => parts.push(bytes),
                other => {
                    mismatch = Some(Error::CollectiveMismatch {
                        seq,
                        rank,
                        expected: expected.as_ref().map_or("nothing".into(), Op::describe),
                        got: other
                            .as_ref()
                            .map_or("nothing".into(), |(op, _)| op.describe()),
                    });
                    break;
                }
            }
        }
        if mismatch.is_none() {
            read(&parts);
        }
        drop(parts);
        let mut round = self.barrier(round, c, seq)?;
        round.channels[c].deposits[rank] = None;
        drop(round);
        mismatch.map_or(Ok(()), Err)
    }
}

/// One rank's handle on a group of threads. Dropping it tells the others it left.
#[derive(Debug)]
pub struct LocalComm {
    shared: Arc<Shared>,
    rank: usize,
    /// The next sequence number of each stream kind's collectives.
    seqs: [u64; 3],
}

impl LocalComm {
    /// Handles for `world_size` ranks, one per thread, in rank order.
    pub fn group(world_size: usize) -> Result<Vec<LocalComm>> {
        if world_size == 0 {
            return Err(Error::ZeroWorldSize);
        }
        let channel = || Channel {
            generation: 0,
            arrived: 0,
            deposits: vec![None; world_size],
        };
        let shared = Arc::new(Shared {
            world_size,
            round: Mutex::new(Round {
                channels: [channel(), channel(), channel()],
                left: vec![false; world_size],
            }),
            changed: Condvar::new(),
        });
        Ok((0..world_size)
            .map(|rank| LocalComm {
                shared: Arc::clone(&shared),
                rank,
                seqs: [0; 3],
            })
            .collect())
    }

    /// The sequence number of the next collective on `stream`.
    fn next_seq(&mut self, stream: Stream) -> u64 {
        let seq = &mut self.seqs[channel_index(stream)];
        *seq += 1;
        *seq - 1
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let mut round = self.shared.lock();
        round.left[self.rank] = true;
        self.shared.changed.notify_all();
    }
}

impl Communicator<CpuBackend> for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.world_size
    }

    unsafe fn all_gather(
        &mut self,
        backend: &CpuBackend,
        stream: Stream,
        shard: &CpuBuffer,
        shard_region: Region,
        out: &mut CpuBuffer,
        out_region: Region,
    ) -> Result<()> {
        check_all_gather(self.shared.world_size, shard_region, out_region)?;
        let src = shard_region.byte_range(shard.len())?;
        let dst = out_region.byte_range(out.len())?;
        let (shard, out) = (Arc::clone(shard.memory()), Arc::clone(out.memory()));
        let (shared, rank, seq) = (Arc::clone(&self.shared), self.rank, self.next_seq(stream));
        backend.run(stream, move || {
            // SAFETY: the caller ordered every other use of both regions (the trait's contract);
            // the two slices are of distinct buffers and live one after the other.
            let mine = copy_of(unsafe { shard.bytes(src) })?;
            let part = mine.len();
            shared.exchange(
                rank,
                stream,
                seq,
                Op::AllGather { bytes: part },
                mine,
                |parts| {
                    // SAFETY: as above.
                    let out = unsafe { out.bytes_mut(dst) };
                    for (rank, bytes) in parts.iter().enumerate() {
                        out[rank * part..(rank + 1) * part].copy_from_slice(bytes);
                    }
                },
            )
        })
    }

    unsafe fn reduce_scatter(
        &mut self,
        backend: &CpuBackend,
        stream: Stream,
        buf: &mut CpuBuffer,
        region: Region,
    ) -> Result<()> {
        let world = self.shared.world_size;
        check_reduce_scatter(world, region)?;
        let part = region.len / world;
        let all = region.byte_range(buf.len())?;
        let own = Region::new(region.offset + self.rank * part, part, DType::F32)
            .byte_range(buf.len())?;
        let start = self.rank * part;
        let memory = Arc::clone(buf.memory());
        let (shared, rank, seq) = (Arc::clone(&self.shared), self.rank, self.next_seq(stream));
        let op = Op::ReduceScatter { numel: region.len };
        backend.run(stream, move || {
            // SAFETY: the caller ordered every other use of the region (the trait's contract);
            // the copy's slice ends before the write's begins.
            let mine = copy_of(unsafe { memory.bytes(all) })?;
            shared.exchange(rank, stream, seq, op, mine, |parts| {
                let ranks: Vec<&[f32]> = parts.iter().map(|p| bytemuck::cast_slice(p)).collect();
                // SAFETY: as above.
                let out: &mut [f32] = bytemuck::cast_slice_mut(unsafe { memory.bytes_mut(own) });
                for (i, o) in out.iter_mut().enumerate() {
                    let mut acc = ranks[0][start + i];
                    for r in &ranks[1..] {
                        acc += r[start + i];
                    }
                    *o = acc;
                }
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;

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
    fn all_gather_places_each_rank_in_order() {
        let runs = run(3, |mut c, b| {
            let r = c.rank() as f32;
            let shard = filled(&b, &[r, r + 0.5]);
            let mut full = b.alloc(24).unwrap();
            // SAFETY: both buffers are used on the gather stream only, then downloaded.
            unsafe { c.all_gather(&b, Stream::Gather, &shard, f32s(2), &mut full, f32s(6)) }
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
            unsafe { c.reduce_scatter(&b, Stream::Reduce, &mut buf, f32s(4)) }.unwrap();
            read(&b, &buf, 4)[c.rank()]
        });
        for out in runs {
            assert_eq!(out, vec![ordered; 4]);
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
                    c.all_gather(&b, Stream::Gather, &shard, f32s(1), full, f32s(2))
                };
                if c.rank() == 0 {
                    c.reduce_scatter(&b, Stream::Reduce, &mut grads, f32s(2))
                        .unwrap();
                    gather(&mut c, &mut full).unwrap();
                } else {
                    gather(&mut c, &mut full).unwrap();
                    c.reduce_scatter(&b, Stream::Reduce, &mut grads, f32s(2))
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
    fn outcome(b: &CpuBackend, issued: Result<()>) -> Result<(), Arc<Error>> {
        issued.map_err(Arc::new)?;
        match b.synchronize(&b.record(Stream::Reduce).map_err(Arc::new)?) {
            Err(Error::StreamFailed { cause, .. }) => Err(cause),
            other => other.map_err(Arc::new),
        }
    }

    #[test]
    fn mismatched_collectives_are_reported_on_every_rank() {
        let runs = run(2, |mut c, b| {
            let n = 2 + c.rank() * 2;
            let mut buf = b.alloc(n * 4).unwrap();
            // SAFETY: the buffer is used on the reduce stream only.
            let issued = unsafe { c.reduce_scatter(&b, Stream::Reduce, &mut buf, f32s(n)) };
            outcome(&b, issued)
        });
        for r in runs.into_iter().flatten() {
            assert!(
                matches!(
                    r.as_ref().map_err(|e| &**e),
                    Err(Error::CollectiveMismatch {
                        seq: 0,
                        rank: 1,
                        ..
                    })
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
            let issued = unsafe { c.reduce_scatter(&b, Stream::Reduce, &mut buf, f32s(2)) };
            outcome(&b, issued)
        });
        for out in runs {
            let left = out[0].as_ref().map_err(|e| &**e);
            assert!(
                matches!(left, Err(Error::RankLeft { seq: 0, rank: 1 })),
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
        let err =
            unsafe { comms[0].reduce_scatter(&b, Stream::Reduce, &mut buf, f32s(3)) }.unwrap_err();
        assert!(matches!(err, Error::OutOfRange { len: 3, .. }));
        assert!(matches!(LocalComm::group(0), Err(Error::ZeroWorldSize)));
    }
}
