//! Ranks as threads of one process, exchanging through shared host memory.

use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crate::backend::cpu::{CpuBackend, CpuBuffer};
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

#[derive(Debug)]
struct Round {
    generation: u64,
    arrived: usize,
    deposits: Vec<Option<(Op, Vec<u8>)>>,
    left: Vec<bool>,
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

    /// Waits until every rank arrived at this barrier; fails if a rank left first.
    fn barrier<'a>(
        &'a self,
        mut round: MutexGuard<'a, Round>,
        seq: u64,
    ) -> Result<MutexGuard<'a, Round>> {
        let generation = round.generation;
        round.arrived += 1;
        if round.arrived == self.world_size {
            round.arrived = 0;
            round.generation += 1;
            self.changed.notify_all();
            return Ok(round);
        }
        while round.generation == generation {
            if let Some(rank) = round.left.iter().position(|&l| l) {
                return Err(Error::RankLeft { seq, rank });
            }
            round = self.changed.wait(round).unwrap_or_else(|p| p.into_inner());
        }
        Ok(round)
    }
}

/// One rank's handle on a group of threads. Dropping it tells the others it left.
#[derive(Debug)]
pub struct LocalComm {
    shared: Arc<Shared>,
    rank: usize,
    seq: u64,
}

impl LocalComm {
    /// Handles for `world_size` ranks, one per thread, in rank order.
    pub fn group(world_size: usize) -> Result<Vec<LocalComm>> {
        if world_size == 0 {
            return Err(Error::ZeroWorldSize);
        }
        let shared = Arc::new(Shared {
            world_size,
            round: Mutex::new(Round {
                generation: 0,
                arrived: 0,
                deposits: vec![None; world_size],
                left: vec![false; world_size],
            }),
            changed: Condvar::new(),
        });
        Ok((0..world_size)
            .map(|rank| LocalComm {
                shared: Arc::clone(&shared),
                rank,
                seq: 0,
            })
            .collect())
    }

    /// Deposits this rank's data, waits for all, checks they issued the same operation, and hands
    /// every rank's data to `read`; then waits until all have read.
    fn exchange(&mut self, op: Op, data: Vec<u8>, read: impl FnOnce(&[&[u8]])) -> Result<()> {
        let seq = self.seq;
        self.seq += 1;
        let shared = Arc::clone(&self.shared);
        let mut round = shared.lock();
        round.deposits[self.rank] = Some((op, data));
        round = shared.barrier(round, seq)?;
        let mut parts: Vec<&[u8]> = Vec::with_capacity(shared.world_size);
        let mut mismatch = None;
        let expected = round.deposits[0].as_ref().map(|(op, _)| op.clone());
        for (rank, deposit) in round.deposits.iter().enumerate() {
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
        let mut round = shared.barrier(round, seq)?;
        round.deposits[self.rank] = None;
        drop(round);
        mismatch.map_or(Ok(()), Err)
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

    fn all_gather(
        &mut self,
        _backend: &CpuBackend,
        _stream: Stream,
        shard: &CpuBuffer,
        shard_region: Region,
        out: &mut CpuBuffer,
        out_region: Region,
    ) -> Result<()> {
        check_all_gather(self.shared.world_size, shard_region, out_region)?;
        let mine = shard.region(shard_region)?.to_vec();
        let out = out.region_mut(out_region)?;
        let part = mine.len();
        self.exchange(Op::AllGather { bytes: part }, mine, |parts| {
            for (rank, bytes) in parts.iter().enumerate() {
                out[rank * part..(rank + 1) * part].copy_from_slice(bytes);
            }
        })
    }

    fn reduce_scatter(
        &mut self,
        _backend: &CpuBackend,
        _stream: Stream,
        buf: &mut CpuBuffer,
        region: Region,
    ) -> Result<()> {
        let world = self.shared.world_size;
        check_reduce_scatter(world, region)?;
        let part = region.len / world;
        let mine = buf.region(region)?.to_vec();
        let own = Region::new(region.offset + self.rank * part, part, DType::F32);
        let out: &mut [f32] = bytemuck::cast_slice_mut(buf.region_mut(own)?);
        let start = self.rank * part;
        self.exchange(Op::ReduceScatter { numel: region.len }, mine, |parts| {
            let ranks: Vec<&[f32]> = parts.iter().map(|p| bytemuck::cast_slice(p)).collect();
            for (i, o) in out.iter_mut().enumerate() {
                let mut acc = ranks[0][start + i];
                for r in &ranks[1..] {
                    acc += r[start + i];
                }
                *o = acc;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::Backend;

    fn run<R: Send>(world: usize, f: impl Fn(LocalComm, CpuBackend) -> R + Sync) -> Vec<R> {
        let comms = LocalComm::group(world).unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|c| {
                    let f = &f;
                    s.spawn(move || f(c, CpuBackend::new()))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn all_gather_places_each_rank_in_order() {
        let out = run(3, |mut c, b| {
            let r = c.rank() as f32;
            let mut shard = b.alloc(8).unwrap();
            b.upload(
                &mut shard,
                Region::new(0, 2, DType::F32),
                bytemuck::cast_slice(&[r, r + 0.5]),
            )
            .unwrap();
            let mut full = b.alloc(24).unwrap();
            c.all_gather(
                &b,
                Stream::Gather,
                &shard,
                Region::new(0, 2, DType::F32),
                &mut full,
                Region::new(0, 6, DType::F32),
            )
            .unwrap();
            bytemuck::cast_slice::<u8, f32>(full.bytes()).to_vec()
        });
        for o in out {
            assert_eq!(o, vec![0.0, 0.5, 1.0, 1.5, 2.0, 2.5]);
        }
    }

    #[test]
    fn reduce_scatter_sums_in_rank_order() {
        // Values whose sum depends on the order of addition in f32.
        let vals = [1e8f32, 1.0, -1e8, 1.0];
        let out = run(4, |mut c, b| {
            let v = vals[c.rank()];
            let mut buf = b.alloc(16).unwrap();
            b.upload(
                &mut buf,
                Region::new(0, 4, DType::F32),
                bytemuck::cast_slice(&[v; 4]),
            )
            .unwrap();
            c.reduce_scatter(&b, Stream::Reduce, &mut buf, Region::new(0, 4, DType::F32))
                .unwrap();
            bytemuck::cast_slice::<u8, f32>(buf.bytes())[c.rank()]
        });
        let ordered = ((vals[0] + vals[1]) + vals[2]) + vals[3];
        assert_eq!(out, vec![ordered; 4]);
    }

    #[test]
    fn mismatched_collectives_are_reported_on_every_rank() {
        let out = run(2, |mut c, b| {
            let n = 2 + c.rank() * 2;
            let mut buf = b.alloc(n * 4).unwrap();
            c.reduce_scatter(&b, Stream::Reduce, &mut buf, Region::new(0, n, DType::F32))
        });
        for r in out {
            assert!(
                matches!(
                    &r,
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
        let out = run(2, |mut c, b| {
            if c.rank() == 1 {
                drop(c);
                return Ok(());
            }
            let mut buf = b.alloc(8).unwrap();
            c.reduce_scatter(&b, Stream::Reduce, &mut buf, Region::new(0, 2, DType::F32))
        });
        assert!(matches!(out[0], Err(Error::RankLeft { seq: 0, rank: 1 })));
    }

    #[test]
    fn lengths_are_checked_before_communicating() {
        let mut comms = LocalComm::group(2).unwrap();
        let b = CpuBackend::new();
        let mut buf = b.alloc(12).unwrap();
        let err = comms[0]
            .reduce_scatter(&b, Stream::Reduce, &mut buf, Region::new(0, 3, DType::F32))
            .unwrap_err();
        assert!(matches!(err, Error::OutOfRange { len: 3, .. }));
        assert!(matches!(LocalComm::group(0), Err(Error::ZeroWorldSize)));
    }
}
