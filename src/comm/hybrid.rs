//! Hybrid sharding (HSDP): ranks in a grid of `replicas x shard_size`, rank `r` in replica
//! `r / shard_size` at place `r % shard_size`. The ranks of a replica shard the parameters
//! among themselves (the plan is made for `shard_size`); every replica holds all of them. A
//! gradient is reduce-scattered within the replica, then its shard all-reduced across the
//! replicas: the same place of every replica ends with the same shard, and the optimizer keeps
//! the replicas equal.
//!
//! [`Hybrid`] is a communicator made of two: one for the replica's ranks, one for the ranks at
//! the same place of every replica. The engine sees the replica's group; its reduction's scale
//! counts every rank of the grid.

use crate::backend::{Backend, Region};
use crate::comm::{Communicator, Replica, Tag, check_all_gather, own_part};
use crate::error::{Error, Result};
use crate::types::Stream;
use crate::watch::Watch;

/// Ranks per replica when `ranks` form `replicas` replicas: refused unless it divides evenly.
pub fn shard_size(ranks: usize, replicas: usize) -> Result<usize> {
    if replicas == 0 || ranks % replicas != 0 {
        return Err(Error::InvalidConfig {
            field: "replicas",
            reason: format!("is {replicas}, which does not divide the {ranks} ranks"),
        });
    }
    Ok(ranks / replicas)
}

/// One rank's communicators under hybrid sharding.
#[derive(Debug)]
pub struct Hybrid<C> {
    /// The ranks of this rank's replica.
    shard: C,
    /// The ranks at this rank's place in every replica, in replica order.
    across: C,
}

impl<C> Hybrid<C> {
    /// A rank of replica `across.rank()` at place `shard.rank()`: `shard` joins the ranks of
    /// its replica, `across` the ranks at its place in every replica.
    pub fn new(shard: C, across: C) -> Hybrid<C> {
        Hybrid { shard, across }
    }

    /// Every rank's communicators of a grid of `replicas x shard_size`, in rank order, from
    /// `group(n)`, which makes the handles of one group of `n` ranks (such as
    /// [`crate::LocalComm::group`]).
    pub fn grid(
        replicas: usize,
        shard_size: usize,
        mut group: impl FnMut(usize) -> Result<Vec<C>>,
    ) -> Result<Vec<Hybrid<C>>> {
        if replicas == 0 || shard_size == 0 {
            return Err(Error::ZeroWorldSize);
        }
        let world = replicas
            .checked_mul(shard_size)
            .ok_or(Error::SizeOverflow {
                what: "the ranks of a replicas x shard grid",
            })?;
        let mut shards: Vec<std::vec::IntoIter<C>> = (0..replicas)
            .map(|_| group(shard_size).map(Vec::into_iter))
            .collect::<Result<_>>()?;
        let mut across: Vec<std::vec::IntoIter<C>> = (0..shard_size)
            .map(|_| group(replicas).map(Vec::into_iter))
            .collect::<Result<_>>()?;
        let mut ranks = crate::fallible::with_capacity(world, "a replicas x shard grid")?;
        for rank in 0..world {
            let (replica, place) = (rank / shard_size, rank % shard_size);
            match (shards[replica].next(), across[place].next()) {
                (Some(shard), Some(across)) => ranks.push(Hybrid { shard, across }),
                _ => {
                    return Err(Error::InvalidConfig {
                        field: "group",
                        reason: "made fewer handles than ranks asked for".into(),
                    });
                }
            }
        }
        Ok(ranks)
    }
}

impl<B: Backend, C: Communicator<B>> Communicator<B> for Hybrid<C> {
    fn rank(&self) -> usize {
        self.shard.rank()
    }

    fn world_size(&self) -> usize {
        self.shard.world_size()
    }

    fn replica(&self) -> Replica {
        Replica {
            index: self.across.rank(),
            count: self.across.world_size(),
        }
    }

    fn grid_size(&self) -> usize {
        self.shard
            .world_size()
            .saturating_mul(self.across.world_size())
    }

    fn meets_on_the_host(&self) -> bool {
        self.shard.meets_on_the_host() || self.across.meets_on_the_host()
    }

    /// Gathers within the replica into the replica's block of `out_region`, then the blocks
    /// across the replicas.
    unsafe fn all_gather_grid(
        &mut self,
        backend: &B,
        stream: Stream,
        tag: Tag,
        shard: &B::Buffer,
        shard_region: Region,
        out: &mut B::Buffer,
        out_region: Region,
    ) -> Result<()> {
        let grid = Communicator::<B>::grid_size(self);
        check_all_gather(grid, shard_region, out_region)?;
        let replica = own_part(self.across.world_size(), self.across.rank(), out_region)?;
        // SAFETY: the caller's contract, passed on; both gathers on the same stream.
        unsafe {
            self.shard
                .all_gather(backend, stream, tag, shard, shard_region, out, replica)?;
            self.across
                .all_gather_in_place(backend, stream, tag, out, out_region)
        }
    }

    fn set_watch(&mut self, watch: &Watch) {
        self.shard.set_watch(watch);
        self.across.set_watch(watch);
    }

    fn health(&self) -> Result<()> {
        self.shard.health().and(self.across.health())
    }

    fn abort(&self) {
        self.shard.abort();
        self.across.abort();
    }

    fn begin_batch(&mut self) -> Result<()> {
        self.shard.begin_batch()
    }

    fn end_batch(&mut self, backend: &B) -> Result<()> {
        self.shard.end_batch(backend)
    }

    unsafe fn all_gather(
        &mut self,
        backend: &B,
        stream: Stream,
        tag: Tag,
        shard: &B::Buffer,
        shard_region: Region,
        out: &mut B::Buffer,
        out_region: Region,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            self.shard
                .all_gather(backend, stream, tag, shard, shard_region, out, out_region)
        }
    }

    unsafe fn all_gather_in_place(
        &mut self,
        backend: &B,
        stream: Stream,
        tag: Tag,
        buf: &mut B::Buffer,
        region: Region,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on.
        unsafe {
            self.shard
                .all_gather_in_place(backend, stream, tag, buf, region)
        }
    }

    /// Reduce-scatters within the replica, `scale` on each rank's values, then sums this rank's
    /// part over the replicas: `scale` is the factor for the whole grid (a mean's divides by
    /// every rank of it).
    unsafe fn reduce_scatter(
        &mut self,
        backend: &B,
        stream: Stream,
        tag: Tag,
        buf: &mut B::Buffer,
        region: Region,
        scale: f32,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on; the all-reduce follows the reduce-scatter on
        // the same stream.
        unsafe {
            self.shard
                .reduce_scatter(backend, stream, tag, buf, region, scale)?;
            if self.across.world_size() > 1 {
                let own = own_part(self.shard.world_size(), self.shard.rank(), region)?;
                self.across
                    .all_reduce(backend, stream, tag, buf, own, 1.0)?;
            }
        }
        Ok(())
    }

    /// Sums over every rank of the grid: within the replica, then across the replicas.
    unsafe fn all_reduce(
        &mut self,
        backend: &B,
        stream: Stream,
        tag: Tag,
        buf: &mut B::Buffer,
        region: Region,
        scale: f32,
    ) -> Result<()> {
        // SAFETY: the caller's contract, passed on, both on the same stream.
        unsafe {
            self.shard
                .all_reduce(backend, stream, tag, buf, region, scale)?;
            self.across
                .all_reduce(backend, stream, tag, buf, region, 1.0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LocalComm;
    use crate::backend::cpu::CpuBackend;

    #[test]
    fn ranks_divide_into_replicas_evenly_or_not_at_all() {
        assert_eq!(shard_size(8, 2).unwrap(), 4);
        assert_eq!(shard_size(8, 8).unwrap(), 1);
        for replicas in [0, 3, 16] {
            assert!(
                matches!(
                    shard_size(8, replicas),
                    Err(Error::InvalidConfig {
                        field: "replicas",
                        ..
                    })
                ),
                "{replicas}"
            );
        }
    }

    #[test]
    fn a_grid_places_rank_r_in_replica_r_over_shard_size() {
        let grid = Hybrid::grid(2, 3, LocalComm::group).unwrap();
        let places: Vec<(usize, usize, Replica)> = grid
            .iter()
            .map(|h| {
                let c: &dyn Communicator<CpuBackend> = h;
                (c.rank(), c.world_size(), c.replica())
            })
            .collect();
        for (rank, &(place, size, replica)) in places.iter().enumerate() {
            assert_eq!((place, size), (rank % 3, 3), "rank {rank}");
            assert_eq!(
                replica,
                Replica {
                    index: rank / 3,
                    count: 2
                },
                "rank {rank}"
            );
        }
        assert!(matches!(
            Hybrid::grid(0, 3, LocalComm::group),
            Err(Error::ZeroWorldSize)
        ));
        // A group maker that makes too few handles is an error, not a short grid.
        let short = Hybrid::grid(2, 2, |n| {
            LocalComm::group(n).map(|mut g| {
                g.pop();
                g
            })
        });
        assert!(matches!(short, Err(Error::InvalidConfig { .. })));
    }
}
