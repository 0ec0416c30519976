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
/// may be handed out again, with no wait, to work queued on the compute stream later: give each
/// engine (compute stream) its own allocator context. Both functions are called on the threads
/// that call the engine's functions, `fsdp_engine_destroy` included, while the engine is locked:
/// they must not call the engine. With `FSDP_GRAD_SHARDS_PER_STEP` every step allocates the
/// gradient shards (in the gradient and sync calls) and releases them (`fsdp_engine_end_step`);
/// a refused allocation inside a step poisons the engine. Memory whose last uses could not be
/// ordered before the compute stream's next work (a failed event) is never released.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fsdp_device_allocator {
    /// Passed to both functions as is; valid until the engine has gone: when
    /// `fsdp_engine_destroy` returns, or, where calls were still running on the engine, when
    /// the last of them returns (the engine goes on that thread).
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

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// What the fake allocator gives next, and what it was given back.
    struct Fake {
        gives: u64,
        status: c_int,
        released: Mutex<Vec<(u64, usize)>>,
    }

    unsafe extern "C" fn allocate(context: *mut c_void, _bytes: usize, out: *mut u64) -> c_int {
        // SAFETY: the tests pass a live `Fake` and a valid `out`.
        let fake = unsafe { &*(context as *const Fake) };
        // SAFETY: as above.
        unsafe { *out = fake.gives };
        fake.status
    }

    unsafe extern "C" fn release(context: *mut c_void, address: u64, bytes: usize) {
        // SAFETY: as above.
        let fake = unsafe { &*(context as *const Fake) };
        fake.released.lock().unwrap().push((address, bytes));
    }

    fn through(fake: &Fake) -> Result<u64> {
        let raw = fsdp_device_allocator {
            context: fake as *const Fake as *mut c_void,
            allocate: Some(allocate),
            release: Some(release),
        };
        // SAFETY: the fake keeps the contract for this call.
        let allocator = unsafe { allocator_of(&raw) }.unwrap().unwrap();
        allocator.allocate(4096)
    }

    fn fake(gives: u64, status: c_int) -> Fake {
        Fake {
            gives,
            status,
            released: Mutex::default(),
        }
    }

    #[test]
    fn an_aligned_address_is_taken_and_bad_ones_are_refused_and_given_back() {
        assert_eq!(
            through(&fake(0x7f00_0000_0200, 0)).unwrap(),
            0x7f00_0000_0200
        );
        let refused = fake(0, 1);
        match through(&refused) {
            Err(Error::OutOfMemory { bytes: 4096, what }) => assert!(what.contains("caller")),
            other => panic!("{other:?}"),
        }
        let misaligned = fake(0x7f00_0000_0010, 0);
        match through(&misaligned) {
            Err(Error::BadAllocation {
                address: 0x7f00_0000_0010,
                bytes: 4096,
            }) => {}
            other => panic!("{other:?}"),
        }
        assert_eq!(
            *misaligned.released.lock().unwrap(),
            [(0x7f00_0000_0010, 4096)]
        );
        assert!(matches!(
            through(&fake(0, 0)),
            Err(Error::BadAllocation { address: 0, .. })
        ));
    }

    #[test]
    fn null_is_no_allocator_and_a_missing_function_is_refused() {
        // SAFETY: NULL is allowed.
        assert!(unsafe { allocator_of(std::ptr::null()) }.unwrap().is_none());
        let raw = fsdp_device_allocator {
            context: std::ptr::null_mut(),
            allocate: Some(allocate),
            release: None,
        };
        // SAFETY: a valid struct; nothing is called.
        let Err(refused) = (unsafe { allocator_of(&raw) }) else {
            panic!("an allocator without release")
        };
        assert!(refused.message.contains("release"), "{}", refused.message);
    }
}
