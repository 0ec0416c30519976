//! Device allocations: raw ones for internal scratch, counted ones for the engine's buffers
//! (from the driver, or from the caller's allocator).

use std::sync::Arc;

use cudarc::driver::result;
use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaContext, CudaStream};

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

/// Page-locked host memory (`cuMemHostAlloc`), freed on drop: device-to-host copies into it run
/// asynchronously at the link's speed.
pub struct PinnedHost {
    ptr: *mut u8,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: `PinnedHost` owns its allocation; its bytes are reached only through `bytes`, whose
// callers order the copies into it before any read.
unsafe impl Send for PinnedHost {}

impl PinnedHost {
    pub(crate) fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<PinnedHost> {
        let ptr = if bytes == 0 {
            std::ptr::NonNull::<u8>::dangling().as_ptr()
        } else {
            bind(ctx)?;
            // SAFETY: a plain page-locked allocation in the current context.
            unsafe { result::malloc_host(bytes, 0) }
                .map_err(|e| match e.0 {
                    CUresult::CUDA_ERROR_OUT_OF_MEMORY => Error::OutOfMemory {
                        bytes,
                        what: "page-locked host memory".into(),
                    },
                    _ => cuda("cuMemHostAlloc")(e),
                })?
                .cast()
        };
        Ok(PinnedHost {
            ptr,
            bytes,
            ctx: Arc::clone(ctx),
        })
    }

    pub(crate) fn len(&self) -> usize {
        self.bytes
    }

    /// # Safety
    /// No copy into the memory is still running.
    pub(crate) unsafe fn bytes(&self) -> &[u8] {
        // SAFETY: `bytes` bytes at `ptr`, allocated above; no writer by the caller's contract.
        unsafe { std::slice::from_raw_parts(self.ptr, self.bytes) }
    }

    /// The bytes from `at`, `len` of them, as the destination of a copy.
    pub(crate) fn range_mut(&mut self, at: usize, len: usize) -> Result<&mut [u8]> {
        let end = at.checked_add(len).filter(|&end| end <= self.bytes);
        let Some(end) = end else {
            return Err(Error::OutOfRange {
                offset: at,
                len,
                capacity: self.bytes,
            });
        };
        // SAFETY: inside the allocation; `&mut self` keeps other Rust accesses away.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr.add(at), end - at) })
    }
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        // SAFETY: allocated by cuMemHostAlloc in `ctx`, freed once. cuMemFreeHost waits for the
        // copies still writing it.
        unsafe {
            if result::ctx::set_current(self.ctx.cu_ctx()).is_ok() {
                let _ = result::free_host(self.ptr.cast());
            }
        }
    }
}

/// Device memory from the caller: a framework's caching allocator, say, so that the engine's
/// buffers and the framework's tensors share one pool (and its accounting).
///
/// One allocator per compute stream: the backend asks for memory on the host, in the order of
/// its compute stream (from whichever thread calls the engine), and gives it back
/// once its compute stream is ordered after every use of it on the backend's streams: the
/// allocator may hand it out again for work queued on the compute stream later, with no wait
/// (as PyTorch's caching allocator does with a block allocated on a stream).
///
/// # Safety
/// `allocate` returns the address of `bytes` bytes of device memory on the backend's device (its
/// primary context), 256-byte aligned, that nothing else uses until it is given back with
/// `release`; memory given back is used again only by work queued on the backend's compute stream
/// after the call, or after that work is complete.
pub unsafe trait DeviceAllocator: Send + Sync {
    /// `bytes` (> 0) bytes; `Error::OutOfMemory` when there are not.
    fn allocate(&self, bytes: usize) -> Result<u64>;

    /// Gives back what `allocate` returned for `bytes`.
    fn release(&self, ptr: u64, bytes: usize);
}

/// Memory from a [`DeviceAllocator`], given back on drop once the compute stream is ordered
/// after the gather and reduce streams' work.
pub(crate) struct LentMemory {
    ptr: u64,
    bytes: usize,
    allocator: Arc<dyn DeviceAllocator>,
    /// The compute stream, then the streams it waits for before the memory goes back.
    streams: [Arc<CudaStream>; 3],
    /// The caller's stream that the compute stream wraps without owning it (`with_stream`), kept
    /// alive for the wait on it when the memory goes back, which may be after the backend is gone.
    _caller_stream: Option<Arc<CudaStream>>,
    /// The compute stream already waits for the other streams' every use of the memory.
    joined: bool,
}

impl LentMemory {
    pub(crate) fn allocate(
        allocator: &Arc<dyn DeviceAllocator>,
        bytes: usize,
        streams: [Arc<CudaStream>; 3],
        caller_stream: Option<Arc<CudaStream>>,
    ) -> Result<LentMemory> {
        let ptr = if bytes == 0 {
            0
        } else {
            allocator.allocate(bytes)?
        };
        Ok(LentMemory {
            ptr,
            bytes,
            allocator: Arc::clone(allocator),
            streams,
            _caller_stream: caller_stream,
            joined: false,
        })
    }

    /// Orders the compute stream after the other streams' work so far.
    fn join_on_compute(&self) -> Result<()> {
        let [compute, others @ ..] = &self.streams;
        for other in others {
            let event = other.record_event(None).map_err(cuda("cuEventRecord"))?;
            compute.wait(&event).map_err(cuda("cuStreamWaitEvent"))?;
        }
        Ok(())
    }
}

impl Drop for LentMemory {
    fn drop(&mut self) {
        if self.bytes == 0 {
            return;
        }
        // Memory whose last uses cannot be ordered before the compute stream's next work is
        // leaked rather than handed out again while the device may still use it.
        if self.joined || self.join_on_compute().is_ok() {
            self.allocator.release(self.ptr, self.bytes);
        }
    }
}

/// Where a buffer's memory came from.
pub(crate) enum BufferMemory {
    Driver(DeviceMemory),
    Lent(LentMemory),
}

impl BufferMemory {
    fn ptr(&self) -> u64 {
        match self {
            BufferMemory::Driver(m) => m.ptr(),
            BufferMemory::Lent(m) => m.ptr,
        }
    }

    fn bytes(&self) -> usize {
        match self {
            BufferMemory::Driver(m) => m.bytes(),
            BufferMemory::Lent(m) => m.bytes,
        }
    }
}

/// A device buffer of the CUDA backend, counted by its backend while it lives.
pub struct CudaBuffer {
    memory: BufferMemory,
    tracker: Arc<Tracker>,
}

impl std::fmt::Debug for CudaBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("ptr", &self.ptr())
            .field("bytes", &self.bytes())
            .field("lent", &matches!(self.memory, BufferMemory::Lent(_)))
            .finish()
    }
}

impl CudaBuffer {
    pub(crate) fn new(memory: BufferMemory, tracker: &Arc<Tracker>) -> CudaBuffer {
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

impl CudaBuffer {
    /// Drops the buffer once the compute stream was made to wait for the gather and reduce
    /// streams' work so far (every use of the buffer among it): lent memory goes back to its
    /// allocator with no join of its own.
    pub(crate) fn free_joined(mut self) {
        if let BufferMemory::Lent(lent) = &mut self.memory {
            lent.joined = true;
        }
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        self.tracker.remove(self.memory.bytes());
    }
}
