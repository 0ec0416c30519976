//! A caller's device allocator for CUDA engines, as C function pointers.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use super::status::{Outcome, invalid};
use crate::backend::cuda::DeviceAllocator;
use crate::error::{Error, Result};

/// Device memory from the caller for a CUDA engine's buffers: a framework's caching allocator,
/// say, so that the engine's buffers and the framework's tensors share one pool and its
/// accounting (PyTorch: `torch.cuda.caching_allocator_alloc` on the engine's compute stream).
///
/// The engine asks for memory in the order of its compute stream and gives it back once its
/// compute stream is ordered after every use of it on the engine's streams: memory given back
/// may be handed out again, with no wait, to work queued on the compute stream later. Both
/// functions are called on the threads that call the engine's functions, `fsdp_engine_destroy`
/// included; with `FSDP_GRAD_SHARDS_PER_STEP` every step allocates and releases the gradient
/// shards.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fsdp_device_allocator {
    /// Passed to both functions as is; valid until the engine is destroyed.
    pub context: *mut c_void,
    /// Writes to `*out` the address of `bytes` (> 0) bytes of device memory on the engine's
    /// device, 256-byte aligned, that nothing else uses until it is released; returns 0, or
    /// nonzero when it has none (the engine's call fails with `FSDP_OUT_OF_MEMORY`).
    pub allocate:
        Option<unsafe extern "C" fn(context: *mut c_void, bytes: usize, out: *mut u64) -> c_int>,
    /// Takes back what `allocate` gave for `bytes`.
    pub release: Option<unsafe extern "C" fn(context: *mut c_void, address: u64, bytes: usize)>,
}

type Allocate = unsafe extern "C" fn(*mut c_void, usize, *mut u64) -> c_int;
type Release = unsafe extern "C" fn(*mut c_void, u64, usize);

/// An `fsdp_device_allocator` whose functions are both given.
struct ForeignAllocator {
    context: *mut c_void,
    allocate: Allocate,
    release: Release,
}

// SAFETY: the engine-creating functions' contract: the context and functions may be used from any
// thread that calls the engine's functions.
unsafe impl Send for ForeignAllocator {}
// SAFETY: as above; the engine serializes its calls.
unsafe impl Sync for ForeignAllocator {}

// SAFETY: the engine-creating functions' contract is `DeviceAllocator`'s, and every address is
// checked to be non-null and aligned before it is used.
unsafe impl DeviceAllocator for ForeignAllocator {
    fn allocate(&self, bytes: usize) -> Result<u64> {
        let mut address = 0u64;
        // SAFETY: the caller's functions, with the context they gave and a valid `out`.
        let failed = unsafe { (self.allocate)(self.context, bytes, &mut address) };
        if failed != 0 {
            return Err(Error::OutOfMemory {
                bytes,
                what: "device memory from the caller's allocator".into(),
            });
        }
        if address == 0 || address % 256 != 0 {
            if address != 0 {
                self.release(address, bytes);
            }
            return Err(Error::BadAllocation { address, bytes });
        }
        Ok(address)
    }

    fn release(&self, ptr: u64, bytes: usize) {
        // SAFETY: as above.
        unsafe { (self.release)(self.context, ptr, bytes) }
    }
}

/// The allocator `raw` points at, or none for NULL (buffers from `cuMemAlloc`).
///
/// # Safety
/// `raw` is NULL or valid for a read, and its functions keep the contract of
/// [`fsdp_device_allocator`].
pub(crate) unsafe fn allocator_of(
    raw: *const fsdp_device_allocator,
) -> Outcome<Option<Arc<dyn DeviceAllocator>>> {
    // SAFETY: the caller's contract.
    let Some(raw) = (unsafe { raw.as_ref() }) else {
        return Ok(None);
    };
    match (raw.allocate, raw.release) {
        (Some(allocate), Some(release)) => Ok(Some(Arc::new(ForeignAllocator {
            context: raw.context,
            allocate,
            release,
        }))),
        _ => Err(invalid(
            "the allocator needs both its allocate and release functions".to_string(),
        )),
    }
}
