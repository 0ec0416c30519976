//! Device allocations: raw ones for internal scratch, counted ones for the engine's buffers.

use std::sync::Arc;

use cudarc::driver::CudaContext;
use cudarc::driver::result;
use cudarc::driver::sys::CUresult;

use crate::backend::cuda::driver::{bind, cuda};
use crate::backend::{Region, Tracker};
use crate::error::{Error, Result};

/// `bytes` bytes of plain device memory (`cuMemAlloc`, never managed memory), freed on drop.
/// The contents start undefined.
#[derive(Debug)]
pub(crate) struct DeviceMemory {
    ptr: u64,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceMemory {
    pub(crate) fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DeviceMemory> {
        // The driver refuses empty allocations; an empty buffer never reaches the device.
        let ptr = if bytes == 0 {
            0
        } else {
            bind(ctx)?;
            // SAFETY: a plain allocation in the current context; nothing reads it before a write.
            unsafe { result::malloc_sync(bytes) }.map_err(|e| match e.0 {
                CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory {
                    bytes,
                    what: "device memory".into(),
                },
                _ => cuda("cuMemAlloc")(e),
            })?
        };
        Ok(DeviceMemory {
            ptr,
            bytes,
            ctx: Arc::clone(ctx),
        })
    }

    pub(crate) fn ptr(&self) -> u64 {
        self.ptr
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        // cuMemFree waits for the device work that still uses the memory, so in-flight work never
        // reads freed memory. A failure here cannot be reported; the memory is then leaked.
        // SAFETY: `ptr` came from cuMemAlloc in `ctx` and is freed once.
        unsafe {
            if result::ctx::set_current(self.ctx.cu_ctx()).is_ok() {
                let _ = result::free_sync(self.ptr);
            }
        }
    }
}

/// A device buffer of the CUDA backend, counted by its backend while it lives.
#[derive(Debug)]
pub struct CudaBuffer {
    memory: DeviceMemory,
    tracker: Arc<Tracker>,
}

impl CudaBuffer {
    pub(crate) fn new(memory: DeviceMemory, tracker: &Arc<Tracker>) -> CudaBuffer {
        tracker.add(memory.bytes());
        CudaBuffer {
            memory,
            tracker: Arc::clone(tracker),
        }
    }

    /// The device address of the first byte (0 for an empty buffer).
    pub fn ptr(&self) -> u64 {
        self.memory.ptr()
    }

    /// The size in bytes.
    pub fn bytes(&self) -> usize {
        self.memory.bytes()
    }

    /// The device address of `region`'s first element, checked to lie inside the buffer.
    pub(crate) fn addr(&self, region: Region) -> Result<u64> {
        let range = region.byte_range(self.bytes())?;
        Ok(self.ptr() + range.start as u64)
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        self.tracker.remove(self.memory.bytes());
    }
}
