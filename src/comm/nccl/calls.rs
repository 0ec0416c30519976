//! The arguments of each NCCL call, worked out and checked from the engine's buffers and regions
//! before anything is queued: pure.

use cudarc::nccl::sys::ncclDataType_t;

use crate::backend::Region;
use crate::backend::cuda::CudaBuffer;
use crate::comm::{check_all_gather, check_all_reduce, check_reduce_scatter, own_part};
use crate::error::Result;
use crate::types::DType;

pub(super) fn nccl_dtype(dtype: DType) -> ncclDataType_t {
    match dtype {
        DType::Bf16 => ncclDataType_t::ncclBfloat16,
        DType::F16 => ncclDataType_t::ncclFloat16,
        DType::F32 => ncclDataType_t::ncclFloat32,
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Kind {
    AllGather,
    /// Each rank's values times `scale`, summed.
    ReduceScatter {
        scale: f32,
    },
    /// As a reduce-scatter, the whole sum kept on every rank.
    AllReduce {
        scale: f32,
    },
}

/// One NCCL call, its arguments checked: device addresses, and `count` elements per rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) struct Call {
    pub(super) kind: Kind,
    pub(super) send: u64,
    pub(super) recv: u64,
    pub(super) count: usize,
    pub(super) dtype: DType,
}

/// A buffer's base address and size in bytes.
#[derive(Clone, Copy, Debug)]
pub(super) struct Extent {
    pub(super) base: u64,
    pub(super) bytes: usize,
}

impl Extent {
    pub(super) fn of(buf: &CudaBuffer) -> Extent {
        Extent {
            base: buf.ptr(),
            bytes: buf.bytes(),
        }
    }

    /// The address of `region`, checked to lie inside.
    pub(super) fn addr(self, region: Region) -> Result<u64> {
        Ok(self.base + region.byte_range(self.bytes)?.start as u64)
    }
}

pub(super) fn all_gather_call(
    world_size: usize,
    shard: Extent,
    shard_region: Region,
    out: Extent,
    out_region: Region,
) -> Result<Call> {
    check_all_gather(world_size, shard_region, out_region)?;
    Ok(Call {
        kind: Kind::AllGather,
        send: shard.addr(shard_region)?,
        recv: out.addr(out_region)?,
        count: shard_region.len,
        dtype: shard_region.dtype,
    })
}

/// NCCL's in-place all-gather: the rank sends its own part of the output.
pub(super) fn all_gather_in_place_call(
    world_size: usize,
    rank: usize,
    buf: Extent,
    region: Region,
) -> Result<Call> {
    let own = own_part(world_size, rank, region)?;
    Ok(Call {
        kind: Kind::AllGather,
        send: buf.addr(own)?,
        recv: buf.addr(region)?,
        count: own.len,
        dtype: own.dtype,
    })
}

/// NCCL's in-place form: the rank's result lands at its own part of the input.
pub(super) fn reduce_scatter_call(
    world_size: usize,
    rank: usize,
    buf: Extent,
    region: Region,
    scale: f32,
) -> Result<Call> {
    check_reduce_scatter(world_size, region)?;
    let send = buf.addr(region)?;
    let count = region.len / world_size;
    Ok(Call {
        kind: Kind::ReduceScatter { scale },
        send,
        recv: send + (rank * count * region.dtype.size()) as u64,
        count,
        dtype: region.dtype,
    })
}

/// NCCL's in-place all-reduce of the region.
pub(super) fn all_reduce_call(buf: Extent, region: Region, scale: f32) -> Result<Call> {
    check_all_reduce(region)?;
    let at = buf.addr(region)?;
    Ok(Call {
        kind: Kind::AllReduce { scale },
        send: at,
        recv: at,
        count: region.len,
        dtype: region.dtype,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    const BASE: u64 = 0x7f00_0000_0000;

    fn extent(bytes: usize) -> Extent {
        Extent { base: BASE, bytes }
    }

    #[test]
    fn reduce_scatter_is_in_place_at_the_ranks_part() {
        let region = Region::new(8, 12, DType::F32);
        let call = reduce_scatter_call(3, 2, extent(80), region, 0.5).unwrap();
        assert_eq!(
            call,
            Call {
                kind: Kind::ReduceScatter { scale: 0.5 },
                send: BASE + 32,
                recv: BASE + 32 + 2 * 4 * 4,
                count: 4,
                dtype: DType::F32,
            }
        );
    }

    #[test]
    fn reduce_scatter_arguments_are_checked() {
        let err =
            reduce_scatter_call(2, 0, extent(64), Region::new(0, 3, DType::F32), 1.0).unwrap_err();
        assert!(matches!(err, Error::OutOfRange { len: 3, .. }), "{err:?}");
        let err =
            reduce_scatter_call(2, 0, extent(64), Region::new(0, 4, DType::F16), 1.0).unwrap_err();
        assert!(matches!(err, Error::Unsupported { .. }), "{err:?}");
        // bf16: this rank's part is counted in 2-byte elements.
        let call = reduce_scatter_call(2, 1, extent(64), Region::new(2, 8, DType::Bf16), 1.0);
        assert!(
            matches!(call, Ok(Call { recv, count: 4, dtype: DType::Bf16, .. }) if recv == BASE + 4 + 8),
            "{call:?}"
        );
        let err =
            reduce_scatter_call(2, 1, extent(16), Region::new(2, 4, DType::F32), 1.0).unwrap_err();
        assert!(
            matches!(
                err,
                Error::OutOfRange {
                    offset: 2,
                    len: 4,
                    capacity: 4
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn all_gather_is_out_of_place_with_a_count_per_rank() {
        let call = all_gather_call(
            4,
            extent(8),
            Region::new(1, 3, DType::Bf16),
            Extent {
                base: BASE + 4096,
                bytes: 64,
            },
            Region::new(2, 12, DType::Bf16),
        )
        .unwrap();
        assert_eq!(
            call,
            Call {
                kind: Kind::AllGather,
                send: BASE + 2,
                recv: BASE + 4096 + 4,
                count: 3,
                dtype: DType::Bf16,
            }
        );
    }

    #[test]
    fn all_gather_arguments_are_checked() {
        let shard = Region::new(0, 2, DType::F32);
        let err = all_gather_call(
            2,
            extent(8),
            shard,
            extent(64),
            Region::new(0, 5, DType::F32),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                Error::OutOfRange {
                    len: 5,
                    capacity: 4,
                    ..
                }
            ),
            "{err:?}"
        );
        let err = all_gather_call(
            2,
            extent(8),
            shard,
            extent(64),
            Region::new(0, 4, DType::F16),
        )
        .unwrap_err();
        assert!(matches!(err, Error::OutOfRange { .. }), "{err:?}");
        let err = all_gather_call(
            2,
            extent(4),
            shard,
            extent(64),
            Region::new(0, 4, DType::F32),
        )
        .unwrap_err();
        assert!(
            matches!(
                err,
                Error::OutOfRange {
                    offset: 0,
                    len: 2,
                    capacity: 1
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn dtypes_map_to_nccls() {
        assert_eq!(nccl_dtype(DType::Bf16), ncclDataType_t::ncclBfloat16);
        assert_eq!(nccl_dtype(DType::F16), ncclDataType_t::ncclFloat16);
        assert_eq!(nccl_dtype(DType::F32), ncclDataType_t::ncclFloat32);
    }
}
