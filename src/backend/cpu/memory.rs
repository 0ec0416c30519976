//! Host memory that the CPU backend's streams share: a buffer's bytes stay alive while work queued
//! on any stream still refers to them, and every access to them is one its caller has ordered.

use std::alloc::Layout;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

use crate::backend::Tracker;
use crate::error::{Error, Result};

/// Zero-filled host bytes, 8-byte aligned, reached from several threads through raw pointers.
#[derive(Debug)]
pub(crate) struct Memory {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: `Memory` owns its allocation; the bytes are only reached through the unsafe accessors,
// whose callers order every access that could conflict (see `bytes` and `bytes_mut`).
unsafe impl Send for Memory {}
// SAFETY: as above.
unsafe impl Sync for Memory {}

impl Memory {
    /// `bytes` zero-filled bytes, or `Error::OutOfMemory` when the host has too little.
    fn zeroed(bytes: usize) -> Result<Memory> {
        let out_of_memory = || Error::OutOfMemory {
            bytes,
            what: "a CPU buffer".into(),
        };
        let layout = Layout::from_size_align(bytes, 8).map_err(|_| out_of_memory())?;
        if bytes == 0 {
            return Ok(Memory {
                ptr: NonNull::<u64>::dangling().cast(),
                layout,
            });
        }
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(ptr).ok_or_else(out_of_memory)?;
        Ok(Memory { ptr, layout })
    }

    /// The bytes of `range`, which lies inside the memory (checked by the buffer that made it).
    ///
    /// # Safety
    /// No thread writes any byte of `range` while the slice lives.
    pub(crate) unsafe fn bytes(&self, range: Range<usize>) -> &[u8] {
        debug_assert!(range.start <= range.end && range.end <= self.layout.size());
        // SAFETY: the range lies inside the allocation; no writer, by the caller's contract.
        unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr().add(range.start), range.end - range.start)
        }
    }

    /// The bytes of `range`, for writing.
    ///
    /// # Safety
    /// No other thread reads or writes any byte of `range` while the slice lives, and this thread
    /// holds no other slice over it.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn bytes_mut(&self, range: Range<usize>) -> &mut [u8] {
        debug_assert!(range.start <= range.end && range.end <= self.layout.size());
        // SAFETY: the range lies inside the allocation; exclusive, by the caller's contract.
        unsafe {
            std::slice::from_raw_parts_mut(
                self.ptr.as_ptr().add(range.start),
                range.end - range.start,
            )
        }
    }
}

impl Drop for Memory {
    fn drop(&mut self) {
        if self.layout.size() > 0 {
            // SAFETY: allocated in `zeroed` with this layout, freed once.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
        }
    }
}

/// A CPU backend's buffer: host memory, counted by its backend while the buffer lives. Its bytes
/// are reached only through the backend's operations, which order them on the backend's streams.
#[derive(Debug)]
pub struct CpuBuffer {
    memory: Arc<Memory>,
    tracker: Arc<Tracker>,
}

impl CpuBuffer {
    /// Allocates `bytes` zero-filled bytes, counted by `tracker`.
    pub(crate) fn zeroed(bytes: usize, tracker: &Arc<Tracker>) -> Result<CpuBuffer> {
        let memory = Arc::new(Memory::zeroed(bytes)?);
        tracker.add(bytes);
        Ok(CpuBuffer {
            memory,
            tracker: Arc::clone(tracker),
        })
    }

    /// Allocates `bytes` bytes of `0xFF`, counted by `tracker`: what a buffer whose contents are
    /// undefined holds on the CPU, a NaN in every f32, bf16 and f16, so that a read before the
    /// first write shows in the values.
    pub(crate) fn poisoned(bytes: usize, tracker: &Arc<Tracker>) -> Result<CpuBuffer> {
        let buffer = CpuBuffer::zeroed(bytes, tracker)?;
        // SAFETY: the memory was just made; no other thread knows it.
        unsafe { buffer.memory.bytes_mut(0..bytes) }.fill(0xFF);
        Ok(buffer)
    }

    /// A buffer over `memory`, freed by an earlier one, counted by `tracker` again.
    pub(crate) fn reusing(memory: Arc<Memory>, tracker: &Arc<Tracker>) -> CpuBuffer {
        tracker.add(memory.layout.size());
        CpuBuffer {
            memory,
            tracker: Arc::clone(tracker),
        }
    }

    /// The size in bytes.
    pub fn len(&self) -> usize {
        self.memory.layout.size()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The shared memory, for work queued on a stream.
    pub(crate) fn memory(&self) -> &Arc<Memory> {
        &self.memory
    }

    /// The host address of `region`, checked to lie inside the buffer.
    pub(crate) fn addr(&self, region: crate::backend::Region) -> Result<u64> {
        let range = region.byte_range(self.len())?;
        Ok(self.memory.ptr.as_ptr() as u64 + range.start as u64)
    }
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        self.tracker.remove(self.len());
    }
}
