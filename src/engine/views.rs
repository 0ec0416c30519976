//! The gathered parameters and the gradient places as the caller reads and writes them: host
//! slices on the CPU, addresses for a caller outside Rust, device tensors on a GPU.

use super::Engine;
use super::gather::Placement;
use super::reduce::place_buffer;
use crate::backend::cpu::CpuBackend;
use crate::backend::{Backend, RawAddress, Region};
use crate::comm::Communicator;
use crate::dtype::Element;
use crate::error::{Error, Result};
use crate::plan::ParamLayout;
use crate::types::{BufferState, DType, ParamId, Stream};

/// A device tensor: `numel` elements of `dtype` at device address `ptr` (a host address on the
/// CPU).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceTensor {
    pub ptr: u64,
    pub numel: usize,
    pub dtype: DType,
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// The gathered view of a parameter: its slot, checked to be in use.
    fn gathered_view(&self, param: ParamId) -> Result<(&ParamLayout, &B::Buffer)> {
        self.healthy()?;
        let layout = self.plan.param(param)?;
        match (
            &self.gathering.groups[layout.group].placed,
            self.gathering.machine.state(layout.group),
        ) {
            (Some(Placement::Slot(slot)), BufferState::Using) => {
                Ok((layout, &self.gathering.slots[slot.buffer_index]))
            }
            (Some(Placement::Shard), BufferState::Using) => {
                Ok((layout, &self.param_shards[layout.group]))
            }
            _ => Err(Error::NotGathered {
                name: layout.name.clone(),
            }),
        }
    }

    /// A copy of the gathered values of `param`, as bytes in its dtype; allowed while one of its
    /// unit's hooks is open. The copy is the compute stream's work, as a model's kernel reading
    /// the parameter would be: it blocks the host until the compute stream's work so far and the
    /// copy are done, not the other streams' (a reduction or a prefetch still queued does not
    /// hold it).
    pub fn param_bytes(&self, param: ParamId) -> Result<Vec<u8>> {
        self.check_not_capturing("reading a parameter")?;
        let (layout, slot) = self.gathered_view(param)?;
        let bytes = layout.numel * layout.dtype.size();
        let mut out = crate::fallible::filled(bytes, 0u8, "a parameter's copy")?;
        let region = Region::new(layout.offset, layout.numel, layout.dtype);
        self.observe(self.backend.download_on_compute(slot, region, &mut out))?;
        Ok(out)
    }
}

impl<C: Communicator<CpuBackend>> Engine<CpuBackend, C> {
    /// The gathered values of `param`, readable while one of its unit's hooks is open.
    ///
    /// On an asynchronous backend it first waits for the compute stream (the host reads the view
    /// as compute-stream work).
    pub fn param<T: Element>(&self, param: ParamId) -> Result<&[T]> {
        self.check_not_capturing("a host view of a parameter")?;
        let (layout, slot) = self.gathered_view(param)?;
        if layout.dtype != T::DTYPE {
            return Err(Error::DtypeMismatch {
                name: layout.name.clone(),
                param: layout.dtype,
                requested: T::DTYPE,
            });
        }
        self.observe(self.backend.drain(Stream::Compute))?;
        let region = Region::new(layout.offset, layout.numel, layout.dtype);
        // SAFETY: the compute stream completed its work, which waited for the gather (the hook
        // that opened the unit); no stream writes a gathered buffer in use (a slot is reused only
        // once its group was evicted, which needs every hook of its unit closed, hence `&mut
        // self`), nor a shard viewed at world size 1 outside the optimizer (compute, drained).
        let bytes = unsafe { self.backend.host_bytes(slot, region) }?;
        bytemuck::try_cast_slice(bytes).map_err(|_| Error::OutOfRange {
            offset: layout.offset,
            len: layout.numel,
            capacity: bytes.len() / layout.dtype.size(),
        })
    }

    /// `param`'s fp32 place in its gradient slot, to overwrite whole with this pass's gradient
    /// before [`Engine::commit_grad`]. It is not zero-filled: it holds what an earlier gradient
    /// left there, so adding into it (as a GEMM with beta = 1 would) gives a wrong gradient.
    /// `Error::GradSlotUnavailable` where no such place exists (bf16 transport; a step's later
    /// passes at world size 1 or under no-sync accumulation): hand the gradient over instead.
    ///
    /// On an asynchronous backend it first waits for the compute stream (the host writes the slot
    /// as compute-stream work).
    pub fn grad_slot(&mut self, param: ParamId) -> Result<&mut [f32]> {
        self.check_not_capturing("a host view of a gradient slot")?;
        let (place, region) = self.open_grad_slot(param)?;
        self.effects(|e| e.backend.drain(Stream::Compute))?;
        let buffer = place_buffer(&mut self.reducing.slots, &mut self.reducing.groups, place)?;
        // SAFETY: the compute stream completed its work, which waited for the reduction that last
        // read the place (see `apply_grad_effects`); no stream touches the place again before
        // `commit_grad` queues its reduction after this write.
        let bytes = unsafe { self.backend.host_bytes_mut(buffer, region) }?;
        bytemuck::try_cast_slice_mut(bytes).map_err(|_| Error::OutOfRange {
            offset: region.offset,
            len: region.len,
            capacity: 0,
        })
    }
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Queues `func(user_data)` on the compute stream after the work queued there so far
    /// ([`Backend::launch_host_func`]): the caller's host work in stream order, such as a CPU
    /// model's math between the hooks, which reads [`Engine::param_device`]'s addresses and
    /// writes gradients handed over with [`crate::Input::device`]. During a capture it is
    /// captured with the step and runs at each replay.
    ///
    /// # Safety
    /// As [`Backend::launch_host_func`]: `func` may be called with `user_data` on another thread,
    /// once now or once per replay of a capture that holds it, while `user_data` stays valid.
    pub unsafe fn launch_host_func(
        &self,
        func: crate::backend::HostFunc,
        user_data: *mut std::ffi::c_void,
    ) -> Result<()> {
        self.healthy()?;
        // SAFETY: the caller's contract.
        let queued = unsafe { (self.backend).launch_host_func(Stream::Compute, func, user_data) };
        self.observe(queued)
    }
}

impl<B: RawAddress, C: Communicator<B>> Engine<B, C> {
    /// The gathered values of `param` on the device (host memory on the CPU), while one of its
    /// unit's hooks is open (`Error::NotGathered` otherwise).
    ///
    /// Use the address in work queued on the compute stream only (a GPU's kernels,
    /// [`CpuBackend::run`]'s jobs): the hook that opened the unit made that stream wait for the
    /// gather, and the memory is reused for another group once the unit's hooks close and
    /// compute passed that point. Read it, never write it: it is a copy of the shards.
    pub fn param_device(&self, param: ParamId) -> Result<DeviceTensor> {
        let (layout, slot) = self.gathered_view(param)?;
        let region = Region::new(layout.offset, layout.numel, layout.dtype);
        Ok(DeviceTensor {
            ptr: self.backend.stream_address(slot, region)?,
            numel: layout.numel,
            dtype: layout.dtype,
        })
    }

    /// The address of `param`'s gathered values (host on the CPU, device on a GPU), valid while
    /// one of its unit's hooks is open; read only.
    pub fn param_address(&self, param: ParamId) -> Result<u64> {
        self.check_not_capturing("a parameter's address")?;
        let (layout, slot) = self.gathered_view(param)?;
        let region = Region::new(layout.offset, layout.numel, layout.dtype);
        self.observe(self.backend.address(slot, region))
    }

    /// The address of `param`'s fp32 place in its gradient slot, for the caller to overwrite
    /// whole with this pass's gradient (on a GPU, on the compute stream) before
    /// [`Engine::commit_grad`]. It is not zero-filled: it holds what an earlier gradient left
    /// there, so adding into it (as a GEMM with beta = 1 would) gives a wrong gradient. Refused
    /// as [`Engine::grad_slot`] is. On the CPU it first waits for the compute stream.
    pub fn grad_slot_address(&mut self, param: ParamId) -> Result<u64> {
        self.check_not_capturing("a gradient slot's address")?;
        let (place, region) = self.open_grad_slot(param)?;
        self.effects(|e| {
            let buffer = place_buffer(&mut e.reducing.slots, &mut e.reducing.groups, place)?;
            e.backend.address_mut(buffer, region)
        })
    }

    /// `param`'s fp32 place in its gradient slot, for work the caller queues on the compute
    /// stream (a GPU's kernels, [`CpuBackend::run`]'s jobs) to overwrite whole with this
    /// pass's gradient before [`Engine::commit_grad`]: no wait, so a captured step may use it
    /// (the slot is the same in every replay, as the step's schedule is). Unlike
    /// [`Engine::grad_slot_address`] it is allowed during a capture; otherwise refused as that
    /// is, and holding what an earlier gradient left as it does.
    pub fn grad_slot_device(&mut self, param: ParamId) -> Result<DeviceTensor> {
        let (place, region) = self.open_grad_slot(param)?;
        self.effects(|e| {
            let buffer = place_buffer(&mut e.reducing.slots, &mut e.reducing.groups, place)?;
            Ok(DeviceTensor {
                ptr: e.backend.stream_address(buffer, region)?,
                numel: region.len,
                dtype: DType::F32,
            })
        })
    }
}
