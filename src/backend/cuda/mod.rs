//! The CUDA backend: one rank on one device, with three streams.
//!
//! - **compute**: the caller's stream (passed in, adopted from a raw handle, or created here);
//!   gradients are read and the optimizer runs on it.
//! - **gather**: created here, for all-gathers into gathered slots.
//! - **reduce**: created here at the device's highest priority, so reductions are not starved by
//!   compute; reduce-scatters and the accumulation into gradient shards run on it.
//!
//! Order between streams comes only from [`Backend::record`] / [`Backend::wait`]
//! (`cuEventRecord` / `cuStreamWaitEvent`). Only [`Backend::synchronize`], [`Backend::upload`],
//! [`Backend::download`] and a host-memory [`Input`] block the host, and each counts in
//! [`Backend::host_waits`]. Dropping a buffer frees it with `cuMemFree`, which waits for the device
//! work still using it; a buffer from the caller's [`DeviceAllocator`] goes back to it in stream
//! order instead, with no wait.

mod driver;
mod events;
pub mod kernels;
mod memory;
mod staging;
mod streams;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cudarc::driver::sys::{
    CUcontext, CUevent_flags, CUgraphInstantiate_flags, CUresult, CUstream, CUstreamCaptureMode,
    CUstreamCaptureStatus,
};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream, result};
use events::EventPool;
pub(crate) use events::PooledEvent;

use crate::backend::{
    Backend, HostFunc, Input, MemoryUsage, OptimizerShard, RawAddress, Region, Source, StepUpdate,
    Tracker,
};
use crate::error::{Error, Result};
use crate::optim::{OptimizerKind, STEP_VALUES_BYTES, StepValues};
// Every critical section of the backend leaves its data whole.
use crate::sync::lock;
use crate::types::{DType, Stream};
use crate::watch::Watch;

pub use driver::is_driver_present;
pub(crate) use driver::{bind, cuda, primary_context};
use kernels::{AccumulateEntry, Kernels};
pub(crate) use memory::DeviceMemory;
use memory::{BufferMemory, LentMemory};
pub use memory::{CudaBuffer, DeviceAllocator, PinnedHost};
use staging::Staging;
use streams::wait_for;

const NAME: &str = "cuda";

/// A point in one of a backend's streams: a CUDA event, timed only when made by
/// [`Backend::record_timed`] (the others are used again once dropped).
#[derive(Debug)]
pub struct CudaBackendEvent(PooledEvent);

/// The CUDA backend of one rank.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    gather: Arc<CudaStream>,
    reduce: Arc<CudaStream>,
    kernels: Kernels,
    tracker: Arc<Tracker>,
    host_waits: AtomicU64,
    staging: Mutex<Staging>,
    /// The caller's handle of the compute stream, kept alive while the backend uses it.
    caller_stream: Option<Arc<CudaStream>>,
    /// Where buffers come from, when not from `cuMemAlloc`.
    allocator: Option<Arc<dyn DeviceAllocator>>,
    /// The deadline and abort flag of the host's waits.
    watch: Watch,
    /// The events [`Backend::record`] marks the streams with.
    events: Arc<EventPool>,
    /// The stream a capture under way began on.
    capture: Mutex<Option<CaptureUnderWay>>,
}

/// The capture a backend is in: begun on `stream` by it, or by the caller and joined.
#[derive(Clone, Copy, Debug)]
struct CaptureUnderWay {
    stream: Stream,
    joined: bool,
}

/// A step captured on a backend's streams and instantiated, replayed with one launch.
pub struct CudaGraph(Mutex<cudarc::driver::CudaGraph>);

// SAFETY: a graph's handles may be used from any thread as long as no two threads use one at
// once (the driver's rule for graph objects), which the mutex ensures.
unsafe impl Send for CudaGraph {}
// SAFETY: as above.
unsafe impl Sync for CudaGraph {}

impl std::fmt::Debug for CudaGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CudaGraph")
    }
}

/// What a new buffer holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Contents {
    /// Zeros, as every stream sees them first.
    Zeroed,
    /// Whatever the memory held: the caller writes it before any read.
    Undefined,
}

/// The f32 view of `region`, as the gradient operations read it whatever its dtype says.
fn f32_region(region: Region) -> Region {
    Region {
        dtype: DType::F32,
        ..region
    }
}

/// The error for two lengths that must agree, as the CPU backend reports it.
fn length_mismatch(len: usize, capacity: usize) -> Error {
    Error::OutOfRange {
        offset: 0,
        len,
        capacity,
    }
}

/// The address of the `ranks` norm parts at the start of `parts`.
fn norm_parts(parts: &CudaBuffer, ranks: usize) -> Result<u64> {
    let words = ranks
        .checked_mul(crate::plan::NORM_PART_BYTES / 4)
        .ok_or(Error::SizeOverflow {
            what: "the ranks' norm parts",
        })?;
    parts.addr(Region::new(0, words, DType::F32))
}

/// The address of the [`StepValues`] at the start of `values`.
fn step_values(values: &CudaBuffer) -> Result<u64> {
    values.addr(Region::new(0, STEP_VALUES_BYTES / 4, DType::F32))
}

/// The address of the count of skipped steps at the start of `skipped`.
fn skipped_steps(skipped: &CudaBuffer) -> Result<u64> {
    let words = crate::plan::SKIPPED_STEPS_BYTES / 4;
    skipped.addr(Region::new(0, words, DType::F32))
}

impl Backend for CudaBackend {
    type Buffer = CudaBuffer;
    type Event = CudaBackendEvent;
    type HostBuffer = PinnedHost;
    type Graph = CudaGraph;

    fn name(&self) -> &'static str {
        NAME
    }

    /// A CUDA stream capture in thread-local mode: a call that is unsafe during a capture fails
    /// it when this thread makes it, while other threads (the engine's watchdog querying its
    /// collectives' events, other ranks' engines) go on. The calls of this backend that would
    /// fail it (an allocation, a free, a host wait, a host input's staging) are refused first
    /// with `Error::Capture`.
    fn begin_capture(&self, stream: Stream) -> Result<()> {
        let mut capture = lock(&self.capture);
        streams::no_capture_under_way(*capture, "a capture")?;
        self.stream_handle(stream)
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(cuda("cuStreamBeginCapture"))?;
        *capture = Some(CaptureUnderWay {
            stream,
            joined: false,
        });
        Ok(())
    }

    fn end_capture(&self) -> Result<CudaGraph> {
        let mut capture = lock(&self.capture);
        let origin = match *capture {
            Some(CaptureUnderWay {
                stream,
                joined: false,
            }) => stream,
            Some(_) => {
                return Err(Error::Capture {
                    what: "an end of the caller's capture (leave it; the caller ends it)".into(),
                });
            }
            None => {
                return Err(Error::Capture {
                    what: "an end with no capture under way".into(),
                });
            }
        };
        *capture = None;
        let graph = self
            .stream_handle(origin)
            .end_capture(CUgraphInstantiate_flags(0))
            .map_err(cuda("cuStreamEndCapture"))?;
        let graph = graph.ok_or_else(|| Error::Capture {
            what: "a capture that holds no work".into(),
        })?;
        Ok(CudaGraph(Mutex::new(graph)))
    }

    /// Checks with `cuStreamIsCapturing` that the stream's capture is active.
    fn join_capture(&self, stream: Stream) -> Result<()> {
        let mut capture = lock(&self.capture);
        streams::no_capture_under_way(*capture, "a join")?;
        self.check_capture_active(stream)?;
        *capture = Some(CaptureUnderWay {
            stream,
            joined: true,
        });
        Ok(())
    }

    fn leave_capture(&self) -> Result<()> {
        let mut capture = lock(&self.capture);
        let Some(CaptureUnderWay {
            stream,
            joined: true,
        }) = *capture
        else {
            return Err(Error::Capture {
                what: "a leave with no joined capture".into(),
            });
        };
        *capture = None;
        self.check_capture_active(stream)
    }

    unsafe fn replay(&self, graph: &CudaGraph) -> Result<()> {
        lock(&graph.0).launch().map_err(cuda("cuGraphLaunch"))
    }

    unsafe fn launch_host_func(
        &self,
        stream: Stream,
        func: HostFunc,
        user_data: *mut std::ffi::c_void,
    ) -> Result<()> {
        bind(&self.ctx)?;
        // SAFETY: a live stream of this backend; the caller's contract covers the function and
        // its data.
        unsafe {
            cudarc::driver::sys::cuLaunchHostFunc(
                self.stream_handle(stream).cu_stream(),
                Some(func),
                user_data,
            )
        }
        .result()
        .map_err(cuda("cuLaunchHostFunc"))
    }

    /// Allocates with `cuMemAlloc` (or the caller's allocator) and zero-fills on the compute stream; the gather and reduce
    /// streams wait for the fill, so the zeros are what any stream sees first.
    fn alloc(&self, bytes: usize) -> Result<CudaBuffer> {
        self.alloc_counted(bytes, &self.tracker, Contents::Zeroed)
    }

    /// No fill, and so no event: the other streams' first use of the memory is ordered after
    /// the compute stream's work at the allocation by the waits that order every use.
    fn alloc_unfilled(&self, bytes: usize) -> Result<CudaBuffer> {
        self.alloc_counted(bytes, &self.tracker, Contents::Undefined)
    }

    /// One join of the gather and reduce streams into the compute stream for them all (none for
    /// no buffers): lent memory goes back to the caller's allocator after it, with no join of its
    /// own.
    fn free(&self, buffers: impl IntoIterator<Item = CudaBuffer>) -> Result<()> {
        self.check_not_capturing("a free")?;
        let mut buffers = buffers.into_iter().peekable();
        if buffers.peek().is_none() {
            return Ok(());
        }
        let joined = self.join_on_compute();
        for buffer in buffers {
            if joined.is_ok() {
                buffer.free_joined();
            } else {
                // Each buffer tries a join of its own, and is leaked if that fails too.
                drop(buffer);
            }
        }
        joined
    }

    /// Lent memory goes back to the caller's allocator with no join: the compute stream is
    /// ordered after every use already.
    unsafe fn free_after_compute(
        &self,
        buffers: impl IntoIterator<Item = CudaBuffer>,
    ) -> Result<()> {
        self.check_not_capturing("a free")?;
        buffers.into_iter().for_each(CudaBuffer::free_joined);
        Ok(())
    }

    fn alloc_scratch(&self, bytes: usize) -> Result<CudaBuffer> {
        self.alloc_counted(bytes, &Arc::default(), Contents::Zeroed)
    }

    fn memory(&self) -> MemoryUsage {
        self.tracker.usage()
    }

    /// With a caller's allocator only: `cuMemFree` waits for the device.
    fn frees_in_stream_order(&self) -> bool {
        self.allocator.is_some()
    }

    fn alloc_host(&self, bytes: usize) -> Result<PinnedHost> {
        PinnedHost::alloc(&self.ctx, bytes)
    }

    unsafe fn host_bytes(buf: &PinnedHost) -> &[u8] {
        // SAFETY: the caller's contract.
        unsafe { buf.bytes() }
    }

    unsafe fn host_bytes_mut(buf: &mut PinnedHost) -> &mut [u8] {
        let bytes = buf.len();
        buf.range_mut(0, bytes).unwrap_or_default()
    }

    unsafe fn copy_to_host(
        &self,
        stream: Stream,
        src: &CudaBuffer,
        region: Region,
        dst: &mut PinnedHost,
        at: usize,
    ) -> Result<()> {
        let range = region.byte_range(src.bytes())?;
        let out = dst.range_mut(at, range.len())?;
        if out.is_empty() {
            return Ok(());
        }
        bind(&self.ctx)?;
        let from = src.ptr() + range.start as u64;
        // SAFETY: `from` holds `out.len()` bytes of a live buffer; `out` is page-locked memory
        // that the caller keeps until the copy completed and reads only then (its contract).
        unsafe { result::memcpy_dtoh_async(out, from, self.stream_handle(stream).cu_stream()) }
            .map_err(cuda("cuMemcpyDtoHAsync"))
    }

    unsafe fn copy_from_host(
        &self,
        stream: Stream,
        src: &PinnedHost,
        at: usize,
        dst: &mut CudaBuffer,
        region: Region,
    ) -> Result<()> {
        let to = dst.addr(region)?;
        let bytes = region.len * region.dtype.size();
        // SAFETY: no copy writes `src` (the caller's contract); the range is checked below.
        let all = unsafe { src.bytes() };
        let from = at
            .checked_add(bytes)
            .and_then(|end| all.get(at..end))
            .ok_or(Error::OutOfRange {
                offset: at,
                len: bytes,
                capacity: all.len(),
            })?;
        if from.is_empty() {
            return Ok(());
        }
        bind(&self.ctx)?;
        // SAFETY: `to` holds `bytes` bytes of `dst`, which `&mut` keeps alive; `from` is
        // page-locked memory the caller keeps unwritten until the copy completed.
        unsafe { result::memcpy_htod_async(to, from, self.stream_handle(stream).cu_stream()) }
            .map_err(cuda("cuMemcpyHtoDAsync"))
    }

    fn host_waits(&self) -> u64 {
        self.host_waits.load(Ordering::Relaxed)
    }

    fn set_watch(&mut self, watch: &Watch) {
        self.watch = watch.clone();
    }

    /// A `cuStreamWaitValue32` on a page-locked word mapped into the device, which the release
    /// sets from the host.
    #[cfg(feature = "fault-injection")]
    fn hold(&self, stream: Stream, release: &crate::backend::hold::Release) -> Result<()> {
        use cudarc::driver::sys;
        let check = |call: &'static str, r: CUresult| match r {
            CUresult::CUDA_SUCCESS => Ok(()),
            code => Err(driver::cuda_error(call, code, format!("{code:?}"))),
        };
        bind(&self.ctx)?;
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        let mut device: sys::CUdeviceptr = 0;
        // SAFETY: a fresh page-locked word mapped into the device, 0 before the stream waits on
        // it and never freed: the release writes it whenever it comes (holding the context, so
        // that its memory stays mapped), the stream reads it until then.
        unsafe {
            check(
                "cuMemHostAlloc",
                sys::cuMemHostAlloc(&mut host, 4, sys::CU_MEMHOSTALLOC_DEVICEMAP),
            )?;
            host.cast::<u32>().write_volatile(0);
            check(
                "cuMemHostGetDevicePointer",
                sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0),
            )?;
            release.add_word(host.cast(), Arc::clone(&self.ctx) as _);
        }
        // SAFETY: the stream is live; the word outlives the wait.
        unsafe {
            check(
                "cuStreamWaitValue32",
                sys::cuStreamWaitValue32_v2(
                    self.stream_handle(stream).cu_stream(),
                    device,
                    1,
                    sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
                ),
            )
        }
    }

    fn record(&self, stream: Stream) -> Result<CudaBackendEvent> {
        Ok(CudaBackendEvent(self.record_raw(stream)?))
    }

    fn wait(&self, stream: Stream, event: &CudaBackendEvent) -> Result<()> {
        self.stream_handle(stream)
            .wait(&event.0)
            .map_err(cuda("cuStreamWaitEvent"))
    }

    fn reached(event: &CudaBackendEvent) -> Result<bool> {
        event.0.try_is_complete().map_err(cuda("cuEventQuery"))
    }

    fn synchronize(&self, event: &CudaBackendEvent) -> Result<()> {
        self.wait_for(&event.0)
    }

    fn record_timed(&self, stream: Stream) -> Result<CudaBackendEvent> {
        self.stream_handle(stream)
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map(|event| CudaBackendEvent(PooledEvent::unpooled(event)))
            .map_err(cuda("cuEventRecord"))
    }

    /// Blocks until `end` completed (counted as a host wait).
    fn elapsed_ms(&self, start: &CudaBackendEvent, end: &CudaBackendEvent) -> Result<f32> {
        self.wait_for(&end.0)?;
        wait_for(&self.watch, &start.0)?;
        start
            .0
            .elapsed_ms(&end.0)
            .map_err(cuda("cuEventElapsedTime"))
    }

    unsafe fn zero(&self, stream: Stream, buf: &mut CudaBuffer, region: Region) -> Result<()> {
        let dst = buf.addr(region)?;
        let bytes = region.len * region.dtype.size();
        if bytes == 0 {
            return Ok(());
        }
        bind(&self.ctx)?;
        // SAFETY: `dst` is checked to hold `bytes` bytes of `buf`, which `&mut` keeps alive.
        unsafe {
            self.kernels
                .fill_zero(self.stream_handle(stream), dst, bytes)
        }
    }

    /// Copies on the compute stream after every stream's earlier work, and blocks until done.
    fn upload(&self, buf: &mut CudaBuffer, region: Region, data: &[u8]) -> Result<()> {
        self.check_not_capturing("a host wait")?;
        let range = region.byte_range(buf.bytes())?;
        if range.len() != data.len() {
            return Err(length_mismatch(
                data.len() / region.dtype.size(),
                region.len,
            ));
        }
        if data.is_empty() {
            return Ok(());
        }
        bind(&self.ctx)?;
        self.join_on_compute()?;
        let dst = buf.ptr() + range.start as u64;
        // SAFETY: `dst` holds `data.len()` bytes; `data` outlives the copy (synchronized below).
        unsafe { result::memcpy_htod_async(dst, data, self.compute.cu_stream()) }
            .map_err(cuda("cuMemcpyHtoDAsync"))?;
        self.block_on(Stream::Compute)
    }

    /// Copies on the compute stream after every stream's earlier work, and blocks until done.
    fn download(&self, buf: &CudaBuffer, region: Region, out: &mut [u8]) -> Result<()> {
        self.check_not_capturing("a host wait")?;
        bind(&self.ctx)?;
        self.join_on_compute()?;
        self.download_on_compute(buf, region, out)
    }

    fn download_on_compute(&self, buf: &CudaBuffer, region: Region, out: &mut [u8]) -> Result<()> {
        self.check_not_capturing("a host wait")?;
        let range = region.byte_range(buf.bytes())?;
        if range.len() != out.len() {
            return Err(length_mismatch(region.len, out.len() / region.dtype.size()));
        }
        if out.is_empty() {
            return Ok(());
        }
        bind(&self.ctx)?;
        let src = buf.ptr() + range.start as u64;
        // SAFETY: `src` holds `out.len()` bytes; `out` outlives the copy (synchronized below).
        unsafe { result::memcpy_dtoh_async(out, src, self.compute.cu_stream()) }
            .map_err(cuda("cuMemcpyDtoHAsync"))?;
        self.block_on(Stream::Compute)
    }

    /// A device input is read in place on `stream`. A host input is copied into a staging area
    /// first, which blocks the host (counted as a host wait): pass device gradients to keep the
    /// host free.
    unsafe fn accumulate_input(
        &self,
        stream: Stream,
        src: Input<'_>,
        dst: &mut CudaBuffer,
        dst_region: Region,
        scale: f32,
        add: bool,
    ) -> Result<()> {
        let dst_ptr = dst.addr(dst_region)?;
        let dtypes = (src.dtype(), dst_region.dtype);
        let (dtype, numel) = (src.dtype(), src.numel());
        let exact = match src.0 {
            Source::Host { bytes, .. } => bytes.len() == numel * dtype.size(),
            Source::Device { .. } => true,
        };
        if !exact || numel != dst_region.len {
            return Err(length_mismatch(numel, dst_region.len));
        }
        if numel == 0 {
            return Ok(());
        }
        let on = self.stream_handle(stream);
        bind(&self.ctx)?;
        match src.0 {
            Source::Device { ptr, .. } => {
                if ptr == 0 {
                    return Err(Error::Unsupported {
                        backend: NAME,
                        what: "a null device address as input",
                    });
                }
                // SAFETY: the caller vouches that `ptr` holds `numel` elements of `dtype` until
                // `stream` consumed them (the contract of `Input::device`); `dst_ptr` is checked
                // to hold `numel` elements of its region's dtype.
                unsafe {
                    self.kernels
                        .accumulate(on, dtypes, ptr, dst_ptr, numel, scale, add)
                }
            }
            Source::Host { bytes, .. } => {
                self.check_not_capturing("a host input, which the host copies and waits for")?;
                self.host_waits.fetch_add(1, Ordering::Relaxed);
                let copied = |event: &CudaEvent| wait_for(&self.watch, event);
                self.staging()
                    .with_staged(&self.ctx, on, bytes, copied, |staged| {
                        // SAFETY: the staging area holds the `numel` elements just copied, and
                        // `dst_ptr` is checked to hold `numel` elements of its region's dtype.
                        unsafe {
                            self.kernels
                                .accumulate(on, dtypes, staged, dst_ptr, numel, scale, add)
                        }
                    })
            }
        }
    }

    unsafe fn accumulate_inputs(
        &self,
        stream: Stream,
        writes: &[(Input<'_>, Region)],
        dst: &mut CudaBuffer,
        scale: f32,
        add: bool,
    ) -> Result<()> {
        // One launch needs device tensors of one dtype into regions of one dtype.
        let dtypes = writes
            .first()
            .map(|(src, region)| (src.dtype(), region.dtype));
        let one_launch = writes.len() > 1
            && writes.iter().all(|(src, region)| {
                matches!(src.0, Source::Device { .. })
                    && Some((src.dtype(), region.dtype)) == dtypes
            });
        let Some(dtypes) = dtypes.filter(|_| one_launch) else {
            for &(src, region) in writes {
                // SAFETY: the caller's contract, for this write.
                unsafe { self.accumulate_input(stream, src, dst, region, scale, add) }?;
            }
            return Ok(());
        };
        let mut entries = crate::fallible::with_capacity(writes.len(), "a batch of accumulations")?;
        for &(src, region) in writes {
            let Source::Device { ptr, numel, .. } = src.0 else {
                continue;
            };
            if numel != region.len {
                return Err(length_mismatch(numel, region.len));
            }
            if ptr == 0 {
                return Err(Error::Unsupported {
                    backend: NAME,
                    what: "a null device address as input",
                });
            }
            entries.push(AccumulateEntry {
                src: ptr,
                dst: dst.addr(region)?,
                n: numel as u64,
            });
        }
        let on = self.stream_handle(stream);
        bind(&self.ctx)?;
        // SAFETY: each source as `accumulate_input` requires (the caller vouches for device
        // inputs), each destination checked to hold its region; the regions do not overlap.
        unsafe {
            self.kernels
                .accumulate_many(on, dtypes, &entries, scale, add)
        }
    }

    unsafe fn accumulate(
        &self,
        stream: Stream,
        src: &CudaBuffer,
        src_region: Region,
        dst: &mut CudaBuffer,
        dst_region: Region,
        scale: f32,
        add: bool,
    ) -> Result<()> {
        let src_ptr = src.addr(src_region)?;
        let dst_ptr = dst.addr(dst_region)?;
        if src_region.len != dst_region.len {
            return Err(length_mismatch(src_region.len, dst_region.len));
        }
        if src_region.len == 0 {
            return Ok(());
        }
        bind(&self.ctx)?;
        // SAFETY: both addresses are checked to hold `len` elements of their regions' dtypes,
        // in distinct live buffers.
        unsafe {
            self.kernels.accumulate(
                self.stream_handle(stream),
                (src_region.dtype, dst_region.dtype),
                src_ptr,
                dst_ptr,
                src_region.len,
                scale,
                add,
            )
        }
    }

    unsafe fn write_step_values(
        &self,
        stream: Stream,
        dst: &mut CudaBuffer,
        values: &StepValues,
    ) -> Result<()> {
        let dst = step_values(dst)?;
        bind(&self.ctx)?;
        // SAFETY: `dst` is checked to hold the values, of a buffer borrowed for this call; the
        // caller orders other uses.
        unsafe {
            self.kernels
                .write_step_values(self.stream_handle(stream), dst, values)
        }
    }

    unsafe fn optimizer_step(
        &self,
        stream: Stream,
        update: StepUpdate<'_, CudaBackend>,
        shard: OptimizerShard<'_, CudaBackend>,
    ) -> Result<()> {
        let n = shard.numel;
        let whole = Region::new(0, n, DType::F32);
        let param = shard.param.addr(Region::new(0, n, shard.dtype))?;
        let grad = shard.grad.addr(whole)?;
        let values = step_values(update.values)?;
        let master = match (shard.master, shard.dtype) {
            (Some(master), _) => master.addr(whole)?,
            // An f32 shard is its own master copy.
            (None, DType::F32) => param,
            (None, _) => {
                return Err(Error::Unsupported {
                    backend: NAME,
                    what: "a bf16/f16 optimizer step without an fp32 master copy",
                });
            }
        };
        let moments = match shard.moments {
            Some(m) => {
                let region = Region::new(0, n, m.storage.dtype());
                Some((m.first.addr(region)?, m.second.addr(region)?, m.storage))
            }
            None => None,
        };
        if n == 0 {
            return Ok(());
        }
        let on = self.stream_handle(stream);
        bind(&self.ctx)?;
        let step = (values, update.group);
        // SAFETY (both arms): every address is checked to hold `n` elements (the values theirs)
        // of a live buffer borrowed for this call.
        match (update.kind, moments) {
            (OptimizerKind::Sgd, _) => unsafe {
                (self.kernels).sgd(on, shard.dtype, master, grad, param, n, step)
            },
            (OptimizerKind::AdamW, Some(moments)) => unsafe {
                (self.kernels).adamw(on, shard.dtype, master, moments, grad, param, n, step)
            },
            (OptimizerKind::AdamW, None) => Err(Error::InvalidConfig {
                field: "optimizer",
                reason: "AdamW needs moment buffers".into(),
            }),
        }
    }

    unsafe fn clip_step_values(
        &self,
        stream: Stream,
        (parts, ranks): (&CudaBuffer, usize),
        max_norm: f32,
        values: &mut CudaBuffer,
    ) -> Result<()> {
        let parts = norm_parts(parts, ranks)?;
        let values = step_values(values)?;
        bind(&self.ctx)?;
        // SAFETY: both addresses are checked to hold the parts and the values, of buffers
        // borrowed for this call; the caller orders other uses.
        unsafe {
            self.kernels.clip_step_values(
                self.stream_handle(stream),
                (parts, ranks),
                max_norm,
                values,
            )
        }
    }

    unsafe fn skip_nonfinite_step(
        &self,
        stream: Stream,
        (parts, ranks): (&CudaBuffer, usize),
        skipped: &mut CudaBuffer,
        values: &mut CudaBuffer,
    ) -> Result<()> {
        let parts = norm_parts(parts, ranks)?;
        let skipped = skipped_steps(skipped)?;
        let values = step_values(values)?;
        bind(&self.ctx)?;
        // SAFETY: the three addresses are checked to hold what the kernel reads and writes, of
        // buffers borrowed for this call; the caller orders other uses.
        unsafe {
            self.kernels.skip_nonfinite_step(
                self.stream_handle(stream),
                (parts, ranks),
                skipped,
                values,
            )
        }
    }

    unsafe fn correct_step_values(
        &self,
        stream: Stream,
        skipped: &CudaBuffer,
        values: &mut CudaBuffer,
    ) -> Result<()> {
        let skipped = skipped_steps(skipped)?;
        let values = step_values(values)?;
        bind(&self.ctx)?;
        // SAFETY: both addresses are checked to hold what the kernel reads and writes, of
        // buffers borrowed for this call; the caller orders other uses.
        unsafe { (self.kernels).correct_step_values(self.stream_handle(stream), skipped, values) }
    }

    unsafe fn norm_partials(
        &self,
        stream: Stream,
        src: &CudaBuffer,
        region: Region,
        out: &mut CudaBuffer,
    ) -> Result<()> {
        let src_ptr = src.addr(f32_region(region))?;
        let out_ptr = out.addr(Region::new(0, 4, DType::F32))?;
        bind(&self.ctx)?;
        // SAFETY: `src_ptr` is checked to hold `region.len` f32 and `out_ptr` 16 bytes, of
        // buffers borrowed for this call; the caller orders other uses.
        unsafe {
            self.kernels
                .norm_partials(self.stream_handle(stream), src_ptr, region.len, out_ptr)
        }
    }

    unsafe fn count_nonfinite(
        &self,
        stream: Stream,
        src: &CudaBuffer,
        region: Region,
        counter: &mut CudaBuffer,
    ) -> Result<()> {
        let src_ptr = src.addr(f32_region(region))?;
        let counter_ptr = counter.addr(Region::new(0, 2, DType::F32))?;
        bind(&self.ctx)?;
        // SAFETY: `src_ptr` is checked to hold `region.len` f32 and `counter_ptr` a u64, of
        // distinct buffers; the caller ordered their other uses.
        unsafe {
            self.kernels.count_nonfinite(
                self.stream_handle(stream),
                src_ptr,
                region.len,
                counter_ptr,
            )
        }
    }

    unsafe fn cast(
        &self,
        stream: Stream,
        src: &CudaBuffer,
        src_region: Region,
        dst: &mut CudaBuffer,
        dst_region: Region,
    ) -> Result<()> {
        let n = src_region.len;
        let src_ptr = src.addr(src_region)?;
        let dst_ptr = dst.addr(dst_region)?;
        if n != dst_region.len {
            return Err(length_mismatch(n, dst_region.len));
        }
        if n == 0 {
            return Ok(());
        }
        bind(&self.ctx)?;
        // SAFETY: both addresses are checked to hold `n` elements of distinct live buffers.
        unsafe {
            self.kernels.cast(
                self.stream_handle(stream),
                src_region.dtype,
                src_ptr,
                dst_region.dtype,
                dst_ptr,
                n,
            )
        }
    }
}

/// Device addresses, for the caller's kernels on the compute stream.
impl RawAddress for CudaBackend {
    fn address(&self, buf: &CudaBuffer, region: Region) -> Result<u64> {
        buf.addr(region)
    }

    fn address_mut(&self, buf: &mut CudaBuffer, region: Region) -> Result<u64> {
        buf.addr(region)
    }

    fn stream_address(&self, buf: &CudaBuffer, region: Region) -> Result<u64> {
        buf.addr(region)
    }
}
