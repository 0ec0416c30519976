//! Device allocations: raw ones for internal scratch, counted ones for the engine's buffers.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use cudarc::driver::CudaContext;
use cudarc::driver::result;

use crate::backend::Region;
use crate::backend::cuda::driver::{bind, cuda};
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
            unsafe { result::malloc_sync(bytes) }.map_err(cuda("cuMemAlloc"))?
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

/// Bytes a backend's buffers hold now and at most.
#[derive(Debug, Default)]
pub(crate) struct Tracker {
    current: AtomicUsize,
    peak: AtomicUsize,
}

impl Tracker {
    fn add(&self, bytes: usize) {
        let current = self.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(current, Ordering::Relaxed);
    }

    pub(crate) fn current(&self) -> usize {
        self.current.load(Ordering::Relaxed)
    }

    pub(crate) fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
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
        let range = byte_range(region, self.bytes())?;
        Ok(self.ptr() + range.start as u64)
    }
}

impl Drop for CudaBuffer {
    fn drop(&mut self) {
        self.tracker
            .current
            .fetch_sub(self.memory.bytes(), Ordering::Relaxed);
    }
}

/// The byte range of `region` in a buffer of `capacity` bytes, or the error the CPU backend gives
/// for a region past the end.
pub(crate) fn byte_range(region: Region, capacity: usize) -> Result<Range<usize>> {
    let size = region.dtype.size();
    let fits = region
        .offset
        .checked_add(region.len)
        .and_then(|end| end.checked_mul(size))
        .is_some_and(|end| end <= capacity);
    if !fits {
        return Err(Error::OutOfRange {
            offset: region.offset,
            len: region.len,
            capacity: capacity / size,
        });
    }
    Ok(region.bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    #[test]
    fn regions_inside_the_buffer_give_their_bytes() {
        let r = byte_range(Region::new(3, 2, DType::Bf16), 10).unwrap();
        assert_eq!(r, 6..10);
        assert_eq!(byte_range(Region::new(0, 0, DType::F32), 0).unwrap(), 0..0);
    }

    #[test]
    fn regions_past_the_end_or_overflowing_are_out_of_range() {
        assert!(matches!(
            byte_range(Region::new(3, 2, DType::F32), 16),
            Err(Error::OutOfRange {
                offset: 3,
                len: 2,
                capacity: 4
            })
        ));
        assert!(matches!(
            byte_range(Region::new(usize::MAX, 2, DType::F32), 16),
            Err(Error::OutOfRange {
                offset: usize::MAX,
                len: 2,
                capacity: 4
            })
        ));
        assert!(matches!(
            byte_range(Region::new(0, usize::MAX / 2, DType::F32), 16),
            Err(Error::OutOfRange { capacity: 4, .. })
        ));
    }
}
