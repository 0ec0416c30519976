//! The device area host inputs pass through on their way into a kernel.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, result};

use crate::backend::cuda::driver::{bind, cuda};
use crate::backend::cuda::memory::DeviceMemory;
use crate::error::Result;

/// One device area, reused by every host input of a backend and grown on demand.
#[derive(Debug, Default)]
pub(crate) struct Staging {
    memory: Option<DeviceMemory>,
    /// The end of the last work that read the area, on whichever stream it ran.
    last_read: Option<CudaEvent>,
}

impl Staging {
    /// Copies `data` into the area on `stream`, then runs `read` with the area's device address
    /// to enqueue the work that reads it. Blocks the host until the copy completed (`copied` waits
    /// for the event that follows it), so the caller may reuse `data` at once (whether pinned or
    /// not: a pageable copy may return before it is done, a pinned one is fully asynchronous).
    pub(crate) fn with_staged<T>(
        &mut self,
        ctx: &Arc<CudaContext>,
        stream: &CudaStream,
        data: &[u8],
        copied: impl FnOnce(&CudaEvent) -> Result<()>,
        read: impl FnOnce(u64) -> Result<T>,
    ) -> Result<T> {
        let capacity = self.memory.as_ref().map_or(0, DeviceMemory::bytes);
        if capacity < data.len() {
            // Growing frees the old area, which waits for its readers (cuMemFree synchronizes).
            // Powers of two keep regrowth rare as inputs get larger.
            self.memory = None;
            self.last_read = None;
            let bytes = data.len().checked_next_power_of_two().unwrap_or(data.len());
            self.memory = Some(DeviceMemory::alloc(ctx, bytes)?);
        }
        let ptr = self.memory.as_ref().map_or(0, DeviceMemory::ptr);
        if let Some(last) = &self.last_read {
            stream.wait(last).map_err(cuda("cuStreamWaitEvent"))?;
        }
        bind(ctx)?;
        // SAFETY: the area holds at least `data.len()` bytes and its last readers come first on
        // `stream`; `data` outlives the copy because the stream is synchronized right after.
        unsafe { result::memcpy_htod_async(ptr, data, stream.cu_stream()) }
            .map_err(cuda("cuMemcpyHtoDAsync"))?;
        copied(&stream.record_event(None).map_err(cuda("cuEventRecord"))?)?;
        let out = read(ptr);
        // Recorded even when `read` failed: whatever it enqueued may still read the area.
        self.last_read = Some(stream.record_event(None).map_err(cuda("cuEventRecord"))?);
        out
    }
}
