//! Gathered parameters as device tensors, for a caller's kernels on the compute stream.

use crate::backend::Region;
use crate::backend::cuda::CudaBackend;
use crate::comm::Communicator;
use crate::dtype::DType;
use crate::engine::Engine;
use crate::error::Result;
use crate::plan::ParamId;

/// A device tensor: `numel` elements of `dtype` at device address `ptr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceTensor {
    pub ptr: u64,
    pub numel: usize,
    pub dtype: DType,
}

impl<C: Communicator<CudaBackend>> Engine<CudaBackend, C> {
    /// The gathered values of `param` on the device, while one of its unit's hooks is open
    /// (`Error::NotGathered` otherwise).
    ///
    /// Use the address on the compute stream only: the hook that opened the unit made that stream
    /// wait for the gather, and the memory is reused for another group once the unit's hooks
    /// close and compute passed that point. Read it, never write it: it is a copy of the shards.
    pub fn param_device(&self, param: ParamId) -> Result<DeviceTensor> {
        let (layout, slot) = self.gathered_view(param)?;
        let ptr = slot.addr(Region::new(layout.offset, layout.numel, layout.dtype))?;
        Ok(DeviceTensor {
            ptr,
            numel: layout.numel,
            dtype: layout.dtype,
        })
    }
}
