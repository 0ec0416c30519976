//! Collectives on a stream, between the ranks of one data-parallel group.

pub mod local;
pub mod loopback;
pub mod nccl;

use crate::backend::{Backend, Region, Stream};
use crate::error::{Error, Result};

/// All-gather and reduce-scatter for one rank, over buffers of backend `B`.
///
/// Every rank must issue the same collectives, with the same lengths, in the same order. A
/// collective is queued on a stream like the backend's data operations, and runs when the stream
/// gets there; so, like them, it is `unsafe`: the caller orders every use of its buffers on other
/// streams with events.
pub trait Communicator<B: Backend>: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;

    /// Gathers every rank's `shard_region` of `shard` into `out_region` of `out`, rank `r`'s part
    /// at `r * shard_region.len`. `out_region.len` is `world_size * shard_region.len`.
    ///
    /// # Safety
    /// No work on another stream uses either region concurrently (see [`Backend::zero`]).
    #[allow(clippy::too_many_arguments)]
    unsafe fn all_gather(
        &mut self,
        backend: &B,
        stream: Stream,
        shard: &B::Buffer,
        shard_region: Region,
        out: &mut B::Buffer,
        out_region: Region,
    ) -> Result<()>;

    /// Sums the f32 `region` of `buf` over the ranks, adding in rank order 0, 1, 2, ..., and
    /// leaves this rank's part (`region.len / world_size` elements at `rank` times that) in place.
    ///
    /// # Safety
    /// As [`Communicator::all_gather`], for the region.
    unsafe fn reduce_scatter(
        &mut self,
        backend: &B,
        stream: Stream,
        buf: &mut B::Buffer,
        region: Region,
    ) -> Result<()>;
}

/// Checks the lengths of an all-gather before any communication.
pub(crate) fn check_all_gather(world_size: usize, shard: Region, out: Region) -> Result<()> {
    if shard.dtype != out.dtype || shard.len.checked_mul(world_size) != Some(out.len) {
        return Err(Error::OutOfRange {
            offset: out.offset,
            len: out.len,
            capacity: shard.len.saturating_mul(world_size),
        });
    }
    Ok(())
}

/// Checks the length of a reduce-scatter before any communication.
pub(crate) fn check_reduce_scatter(world_size: usize, region: Region) -> Result<()> {
    if region.dtype != crate::dtype::DType::F32 || region.len % world_size != 0 {
        return Err(Error::OutOfRange {
            offset: region.offset,
            len: region.len,
            capacity: region.len / world_size * world_size,
        });
    }
    Ok(())
}
