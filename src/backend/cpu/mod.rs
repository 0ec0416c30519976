//! The CPU backend: host memory, and three streams that run eagerly or apart.
//!
//! - [`CpuBackend::new`] is eager: every operation completes before it returns, and every event
//!   is complete when it is recorded.
//! - [`CpuBackend::asynchronous`] gives each stream a worker thread that runs its queue in order,
//!   each operation after a delay drawn from a seed. Work is ordered across streams only by events
//!   ([`Backend::record`] / [`Backend::wait`]), and [`crate::LocalComm`]'s collectives run on the
//!   streams too, so an event wait the engine forgot shows as a wrong value instead of passing
//!   because the backend happened to be eager. A failed operation (a collective whose peers
//!   disagree, a wait past its deadline) fails the backend: later work is skipped and every later
//!   call returns [`Error::StreamFailed`] naming the first failure.
//!
//! On both, the host reads and writes buffer memory as the compute stream's work:
//! [`Backend::upload`] and [`Backend::download`] first order the compute stream after the other
//! two and wait for it, and the engine's host views wait for the compute stream (counted in
//! [`Backend::host_waits`]).

mod math;
mod memory;
mod streams;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::backend::{
    Backend, HostFunc, Input, MemoryUsage, OptimizerShard, RawAddress, Region, Source, StepUpdate,
    Tracker,
};
use crate::error::{Error, Result};
use crate::optim::{MomentStorage, STEP_VALUES_BYTES, StepValues, moment_seed};
use crate::types::{DType, Stream};
use crate::watch::Watch;
use math::OptimizerSlices;
pub use memory::CpuBuffer;
pub(crate) use memory::Memory;
pub use streams::CpuGraph;
use streams::{Marker, Streams};

const NAME: &str = "cpu";

/// A point in one of a CPU backend's streams.
#[derive(Clone, Debug)]
pub struct CpuEvent(Point);

#[derive(Clone, Debug)]
enum Point {
    /// Reached when recorded (eager backend).
    Reached(Instant),
    /// Reached when its stream's worker gets there.
    Queued(Arc<Marker>),
}

/// A host function and its data, which its queuer lets any thread call it with
/// ([`Backend::launch_host_func`]).
#[derive(Clone, Copy)]
struct HostCall {
    func: HostFunc,
    user_data: *mut std::ffi::c_void,
}

// SAFETY: `Backend::launch_host_func`'s caller lets `func` be called with `user_data` on
// another thread.
unsafe impl Send for HostCall {}
// SAFETY: as above; a call reads the two fields only.
unsafe impl Sync for HostCall {}

impl HostCall {
    /// A method, so that a closure calling it holds the whole call, which is `Send`, not its
    /// two fields apart.
    ///
    /// # Safety
    /// As [`Backend::launch_host_func`] requires of its caller.
    unsafe fn call(&self) {
        // SAFETY: as the caller promises.
        unsafe { (self.func)(self.user_data) }
    }
}

/// The CPU backend of one rank.
#[derive(Debug, Default)]
pub struct CpuBackend {
    tracker: Arc<Tracker>,
    /// Memory of freed buffers by size, for the next unfilled allocations (kept until the
    /// backend goes).
    freed: Mutex<HashMap<usize, Vec<Arc<Memory>>>>,
    host_waits: AtomicU64,
    /// The stream workers; none when eager.
    streams: Option<Streams>,
}

impl CpuBackend {
    /// The eager backend: every operation completes before it returns.
    pub fn new() -> CpuBackend {
        CpuBackend::default()
    }

    /// A backend whose three streams run apart, each on a worker thread that sleeps before every
    /// operation for a delay drawn from `seed` (mostly none, sometimes tens of microseconds, now
    /// and then milliseconds). A wait of a worker or of the host for the streams fails with
    /// [`Error::Timeout`] past four times its engine's deadline (`EngineConfig::timeout`: the
    /// work it waits for has deadlines of its own, and the one that fails first names what it
    /// waited for), at once when a stream failed, and with [`Error::Aborted`] once the engine is
    /// aborted. Dropping the backend lets the workers finish their queues.
    pub fn asynchronous(seed: u64) -> Result<CpuBackend> {
        Ok(CpuBackend {
            streams: Some(Streams::start(seed)?),
            ..CpuBackend::default()
        })
    }

    /// Whether the streams run apart ([`CpuBackend::asynchronous`]).
    pub fn is_asynchronous(&self) -> bool {
        self.streams.is_some()
    }

    /// Runs `job` on `stream`: now when eager, else after the stream's work so far, as a host
    /// function on a GPU stream would (`cudaLaunchHostFunc`); its error fails the stream, and
    /// every later call of the backend reports it.
    pub fn run(
        &self,
        stream: Stream,
        job: impl Fn() -> Result<()> + Send + Sync + 'static,
    ) -> Result<()> {
        match &self.streams {
            None => job(),
            Some(streams) => streams.run(stream, Arc::new(job)),
        }
    }

    /// The streams of an asynchronous backend; `Error::Unsupported` naming `what` on an eager
    /// one.
    fn asynchronous_streams(&self, what: &'static str) -> Result<&Streams> {
        self.streams.as_ref().ok_or(Error::Unsupported {
            backend: NAME,
            what,
        })
    }

    /// `Error::Capture` naming `what` while a capture is under way.
    fn check_not_capturing(&self, what: &str) -> Result<()> {
        match &self.streams {
            Some(streams) => streams.check_not_capturing(what),
            None => Ok(()),
        }
    }

    /// Blocks the host until `stream`'s work so far completed (a host wait when asynchronous).
    pub(crate) fn drain(&self, stream: Stream) -> Result<()> {
        let Some(streams) = &self.streams else {
            return Ok(());
        };
        streams.check_not_capturing("a host wait")?;
        self.host_waits.fetch_add(1, Ordering::Relaxed);
        streams.synchronize(&*streams.record(stream)?).map(drop)
    }

    /// Orders the compute stream after the other two streams' work so far, then blocks until it
    /// completed: afterwards no queued work touches any buffer.
    fn quiesce(&self) -> Result<()> {
        self.check_not_capturing("a host wait")?;
        self.join_on_compute()?;
        self.drain(Stream::Compute)
    }

    /// Orders the compute stream after the other two streams' work so far.
    fn join_on_compute(&self) -> Result<()> {
        if let Some(streams) = &self.streams {
            for other in [Stream::Gather, Stream::Reduce] {
                streams.wait(Stream::Compute, &streams.record(other)?)?;
            }
        }
        Ok(())
    }

    /// The bytes of `region` of `buf`, read by the host as the compute stream's work.
    ///
    /// # Safety
    /// The compute stream has completed its work so far (see [`CpuBackend::drain`]), and no other
    /// stream writes the region while the slice lives.
    pub(crate) unsafe fn host_bytes<'b>(
        &self,
        buf: &'b CpuBuffer,
        region: Region,
    ) -> Result<&'b [u8]> {
        let range = region.byte_range(buf.len())?;
        // SAFETY: the caller's contract.
        Ok(unsafe { buf.memory().bytes(range) })
    }

    /// The bytes of `region` of `buf`, written by the host as the compute stream's work.
    ///
    /// # Safety
    /// The compute stream has completed its work so far, and no other stream reads or writes the
    /// region while the slice lives.
    pub(crate) unsafe fn host_bytes_mut<'b>(
        &self,
        buf: &'b mut CpuBuffer,
        region: Region,
    ) -> Result<&'b mut [u8]> {
        let range = region.byte_range(buf.len())?;
        // SAFETY: the caller's contract; `&mut buf` keeps this thread from making another slice.
        Ok(unsafe { buf.memory().bytes_mut(range) })
    }
}

/// The `ranks` norm parts at the start of `parts`.
fn norm_parts(parts: &CpuBuffer, ranks: usize) -> Result<(Arc<Memory>, Range<usize>)> {
    let all = ranks
        .checked_mul(crate::plan::NORM_PART_BYTES)
        .ok_or(Error::SizeOverflow {
            what: "the ranks' norm parts",
        })?;
    byte_part(parts, 0, all)
}

/// The norms of the parts in `bytes`, as the host combines them.
fn norm_of(bytes: &[u8]) -> crate::engine::GradNorm {
    crate::engine::GradNorm::of_parts(bytes.chunks_exact(crate::plan::NORM_PART_BYTES))
}

/// The `bytes` bytes of `buf` from `at`, checked to lie inside it.
fn byte_part(buf: &CpuBuffer, at: usize, bytes: usize) -> Result<(Arc<Memory>, Range<usize>)> {
    let end = at.checked_add(bytes).filter(|&end| end <= buf.len());
    let range = end.map(|end| at..end).ok_or(Error::OutOfRange {
        offset: at,
        len: bytes,
        capacity: buf.len(),
    })?;
    Ok((Arc::clone(buf.memory()), range))
}

impl CpuBackend {
    /// Queues on `stream` a copy of the bytes `from` into `to` (of another buffer, as long).
    ///
    /// # Safety
    /// The caller ordered every other use of both ranges.
    unsafe fn copy_bytes(
        &self,
        stream: Stream,
        (from_memory, from): (Arc<Memory>, Range<usize>),
        (to_memory, to): (Arc<Memory>, Range<usize>),
    ) -> Result<()> {
        self.run(stream, move || {
            // SAFETY: distinct buffers; the caller ordered every other use of both ranges.
            let (from, to) = unsafe {
                (
                    from_memory.bytes(from.clone()),
                    to_memory.bytes_mut(to.clone()),
                )
            };
            to.copy_from_slice(from);
            Ok(())
        })
    }
}

impl CpuBackend {
    /// Queues on `stream` the accumulation of `numel` elements of `dtype` at host address `ptr`
    /// (a device input: read when the stream runs the work) into `dst_region` of `dst`, as
    /// [`Backend::accumulate_input`] does.
    ///
    /// # Safety
    /// As [`Input::device`]: `ptr` holds the elements until the stream has read them; the
    /// caller ordered every other use of the region.
    unsafe fn accumulate_device(
        &self,
        stream: Stream,
        (ptr, numel, dtype): (u64, usize, DType),
        (dst, dst_region): (&CpuBuffer, Region),
        scale: f32,
        add: bool,
    ) -> Result<()> {
        check_accumulator(dst_region.dtype)?;
        if numel != dst_region.len {
            return Err(length_mismatch(numel, dst_region.len));
        }
        let len = numel.checked_mul(dtype.size()).ok_or(Error::SizeOverflow {
            what: "a device input",
        })?;
        let dst_dtype = dst_region.dtype;
        let (memory, range) = part(dst, dst_region)?;
        // An input of no elements may have no address (C's NULL with 0), which no slice may
        // start at: there is nothing to add.
        if len == 0 {
            return Ok(());
        }
        self.run(stream, move || {
            // SAFETY: the caller's contract: the elements are there until this work read them;
            // the caller ordered every other use of the region (the trait's contract).
            let (src, dst) = unsafe {
                (
                    std::slice::from_raw_parts(ptr as *const u8, len),
                    memory.bytes_mut(range.clone()),
                )
            };
            math::accumulate((dst, dst_dtype), (src, dtype), scale, add);
            Ok(())
        })
    }
}

/// Accumulations compute in f32 and round into f32 or bf16: an f16 sum would overflow at 65504.
fn check_accumulator(dtype: DType) -> Result<()> {
    if dtype == DType::F16 {
        return Err(Error::Unsupported {
            backend: NAME,
            what: "accumulating into f16",
        });
    }
    Ok(())
}

/// A byte range of a buffer and the memory behind it, for work queued on a stream.
fn part(buf: &CpuBuffer, region: Region) -> Result<(Arc<Memory>, Range<usize>)> {
    Ok((Arc::clone(buf.memory()), region.byte_range(buf.len())?))
}

/// The error for two lengths that must agree.
fn length_mismatch(len: usize, capacity: usize) -> Error {
    Error::OutOfRange {
        offset: 0,
        len,
        capacity,
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;
    type Event = CpuEvent;
    type HostBuffer = CpuBuffer;
    type Graph = CpuGraph;

    fn name(&self) -> &'static str {
        NAME
    }

    /// On the asynchronous backend only: an eager one runs its streams' work on the caller's
    /// thread as it is queued.
    fn begin_capture(&self, stream: Stream) -> Result<()> {
        self.asynchronous_streams("a capture")?
            .begin_capture(stream)
    }

    fn end_capture(&self) -> Result<CpuGraph> {
        self.asynchronous_streams("a capture")?.end_capture()
    }

    /// A capture of `stream` begun by [`Backend::begin_capture`] (the caller's, on this
    /// backend): this backend's refusals already hold for it.
    fn join_capture(&self, stream: Stream) -> Result<()> {
        match self.asynchronous_streams("a capture")?.capture_origin() {
            Some(origin) if origin == stream => Ok(()),
            origin => Err(Error::Capture {
                what: format!(
                    "a join of a capture of the {stream:?} stream, with {origin:?} under way"
                ),
            }),
        }
    }

    fn leave_capture(&self) -> Result<()> {
        match self.asynchronous_streams("a capture")?.capture_origin() {
            Some(_) => Ok(()),
            None => Err(Error::Capture {
                what: "a capture left after it ended".into(),
            }),
        }
    }

    unsafe fn replay(&self, graph: &CpuGraph) -> Result<()> {
        self.asynchronous_streams("a replay")?.replay(graph)
    }

    unsafe fn launch_host_func(
        &self,
        stream: Stream,
        func: HostFunc,
        user_data: *mut std::ffi::c_void,
    ) -> Result<()> {
        let call = HostCall { func, user_data };
        self.run(stream, move || {
            // SAFETY: the caller's contract: `func` may be called with its data on the stream's
            // thread, once per run of the job.
            unsafe { call.call() };
            Ok(())
        })
    }

    fn alloc(&self, bytes: usize) -> Result<CpuBuffer> {
        self.check_not_capturing("an allocation")?;
        CpuBuffer::zeroed(bytes, &self.tracker)
    }

    /// Every byte 0xFF: a NaN in every element, so that a read before the first write shows.
    /// The memory of a freed buffer of the size where there is one, as a GPU's stream-ordered
    /// allocator hands it on at once: its fill is still queued on the compute stream then.
    fn alloc_unfilled(&self, bytes: usize) -> Result<CpuBuffer> {
        self.check_not_capturing("an allocation")?;
        let reused = crate::sync::lock(&self.freed)
            .get_mut(&bytes)
            .and_then(Vec::pop);
        match reused {
            Some(memory) => Ok(CpuBuffer::reusing(memory, &self.tracker)),
            None => CpuBuffer::poisoned(bytes, &self.tracker),
        }
    }

    /// Orders the compute stream after the other streams' work so far, then frees the buffers
    /// as [`Backend::free_after_compute`] does.
    fn free(&self, buffers: impl IntoIterator<Item = CpuBuffer>) -> Result<()> {
        self.check_not_capturing("a free")?;
        let mut buffers = buffers.into_iter().peekable();
        if buffers.peek().is_none() {
            return Ok(());
        }
        self.join_on_compute()?;
        // SAFETY: the compute stream now follows every stream's use of the buffers so far.
        unsafe { self.free_after_compute(buffers) }
    }

    /// Fills each buffer with 0xFF on the compute stream and keeps its memory for the next
    /// unfilled allocation of its size, as a GPU hands freed memory to its next user: a read on
    /// another stream not ordered before the free reads NaNs here, and a write lands in the next
    /// owner's bytes (and fails the parity suites) instead of passing unseen.
    unsafe fn free_after_compute(
        &self,
        buffers: impl IntoIterator<Item = CpuBuffer>,
    ) -> Result<()> {
        self.check_not_capturing("a free")?;
        for buffer in buffers {
            let memory = Arc::clone(buffer.memory());
            let len = buffer.len();
            let filled = Arc::clone(&memory);
            self.run(Stream::Compute, move || {
                // SAFETY: the buffer is freed: every use of it so far is ordered before this job
                // (the caller's contract), and its next owner's work follows it on the stream.
                unsafe { filled.bytes_mut(0..len) }.fill(0xFF);
                Ok(())
            })?;
            if len > 0 {
                (crate::sync::lock(&self.freed).entry(len).or_default()).push(memory);
            }
        }
        Ok(())
    }

    fn alloc_scratch(&self, bytes: usize) -> Result<CpuBuffer> {
        self.check_not_capturing("an allocation")?;
        CpuBuffer::zeroed(bytes, &Arc::default())
    }

    fn memory(&self) -> MemoryUsage {
        self.tracker.usage()
    }

    fn alloc_host(&self, bytes: usize) -> Result<CpuBuffer> {
        self.check_not_capturing("an allocation")?;
        CpuBuffer::zeroed(bytes, &Arc::default())
    }

    unsafe fn host_bytes(buf: &CpuBuffer) -> &[u8] {
        // SAFETY: the caller's contract: no copy into it is still queued.
        unsafe { buf.memory().bytes(0..buf.len()) }
    }

    unsafe fn host_bytes_mut(buf: &mut CpuBuffer) -> &mut [u8] {
        let bytes = buf.len();
        // SAFETY: the caller's contract: no copy into it is still queued; `&mut` keeps this
        // thread from making another slice of it.
        unsafe { buf.memory().bytes_mut(0..bytes) }
    }

    unsafe fn copy_to_host(
        &self,
        stream: Stream,
        src: &CpuBuffer,
        region: Region,
        dst: &mut CpuBuffer,
        at: usize,
    ) -> Result<()> {
        let device = part(src, region)?;
        let host = byte_part(dst, at, device.1.len())?;
        // SAFETY: the caller's contract, passed on.
        unsafe { self.copy_bytes(stream, device, host) }
    }

    unsafe fn copy_from_host(
        &self,
        stream: Stream,
        src: &CpuBuffer,
        at: usize,
        dst: &mut CpuBuffer,
        region: Region,
    ) -> Result<()> {
        let device = part(dst, region)?;
        let host = byte_part(src, at, device.1.len())?;
        // SAFETY: the caller's contract, passed on.
        unsafe { self.copy_bytes(stream, host, device) }
    }

    /// A buffer's bytes live on while queued work refers to them.
    fn frees_in_stream_order(&self) -> bool {
        true
    }

    fn host_waits(&self) -> u64 {
        self.host_waits.load(Ordering::Relaxed)
    }

    fn set_watch(&mut self, watch: &Watch) {
        if let Some(streams) = &self.streams {
            streams.set_watch(watch);
        }
    }

    #[cfg(feature = "fault-injection")]
    fn hold(&self, stream: Stream, release: &crate::backend::hold::Release) -> Result<()> {
        if self.streams.is_none() {
            return Err(Error::Unsupported {
                backend: NAME,
                what: "a hold on an eager backend's stream, which runs on the caller's thread",
            });
        }
        let release = release.clone();
        self.run(stream, move || {
            while !release.is_set() {
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            Ok(())
        })
    }

    fn record(&self, stream: Stream) -> Result<CpuEvent> {
        Ok(CpuEvent(match &self.streams {
            None => Point::Reached(Instant::now()),
            Some(streams) => Point::Queued(streams.record(stream)?),
        }))
    }

    fn wait(&self, stream: Stream, event: &CpuEvent) -> Result<()> {
        match (&self.streams, &event.0) {
            (Some(streams), Point::Queued(marker)) => streams.wait(stream, marker),
            _ => Ok(()),
        }
    }

    fn reached(event: &CpuEvent) -> Result<bool> {
        Ok(match &event.0 {
            Point::Reached(_) => true,
            Point::Queued(marker) => marker.is_reached()?,
        })
    }

    fn synchronize(&self, event: &CpuEvent) -> Result<()> {
        self.host_waits.fetch_add(1, Ordering::Relaxed);
        match (&self.streams, &event.0) {
            (Some(streams), Point::Queued(marker)) => streams.synchronize(marker).map(drop),
            _ => Ok(()),
        }
    }

    fn record_timed(&self, stream: Stream) -> Result<CpuEvent> {
        self.record(stream)
    }

    fn elapsed_ms(&self, start: &CpuEvent, end: &CpuEvent) -> Result<f32> {
        let reached = |event: &CpuEvent| match (&self.streams, &event.0) {
            (_, Point::Reached(at)) => Ok(*at),
            (Some(streams), Point::Queued(marker)) => streams.synchronize(marker),
            (None, Point::Queued(marker)) => marker.wait(&Watch::default(), "a timed CPU event"),
        };
        let (start, end) = (reached(start)?, reached(end)?);
        Ok(if end >= start {
            (end - start).as_secs_f32() * 1e3
        } else {
            -((start - end).as_secs_f32() * 1e3)
        })
    }

    unsafe fn zero(&self, stream: Stream, buf: &mut CpuBuffer, region: Region) -> Result<()> {
        let (memory, range) = part(buf, region)?;
        self.run(stream, move || {
            // SAFETY: the caller ordered every other use of the region (the trait's contract).
            unsafe { memory.bytes_mut(range.clone()) }.fill(0);
            Ok(())
        })
    }

    fn upload(&self, buf: &mut CpuBuffer, region: Region, data: &[u8]) -> Result<()> {
        let range = region.byte_range(buf.len())?;
        if range.len() != data.len() {
            return Err(length_mismatch(
                data.len() / region.dtype.size(),
                region.len,
            ));
        }
        self.quiesce()?;
        // SAFETY: no queued work touches the buffer any more (quiesced), and `&mut buf` keeps
        // anything new from being queued on it during the copy.
        unsafe { buf.memory().bytes_mut(range) }.copy_from_slice(data);
        Ok(())
    }

    fn download(&self, buf: &CpuBuffer, region: Region, out: &mut [u8]) -> Result<()> {
        self.check_not_capturing("a host wait")?;
        self.join_on_compute()?;
        self.download_on_compute(buf, region, out)
    }

    fn download_on_compute(&self, buf: &CpuBuffer, region: Region, out: &mut [u8]) -> Result<()> {
        let range = region.byte_range(buf.len())?;
        if range.len() != out.len() {
            return Err(length_mismatch(region.len, out.len() / region.dtype.size()));
        }
        self.drain(Stream::Compute)?;
        // SAFETY: the compute stream completed its work so far, which the caller ordered after
        // every other stream's writes of the region; writing to it from the host needs `&mut
        // buf`, which the caller's `&buf` excludes.
        out.copy_from_slice(unsafe { buf.memory().bytes(range) });
        Ok(())
    }

    unsafe fn accumulate_input(
        &self,
        stream: Stream,
        src: Input<'_>,
        dst: &mut CpuBuffer,
        dst_region: Region,
        scale: f32,
        add: bool,
    ) -> Result<()> {
        let (bytes, dtype) = match src.0 {
            Source::Host { bytes, dtype } => {
                // A replay would add the bytes taken now again, whatever the host holds then.
                self.check_not_capturing("a host input, which the work takes a copy of")?;
                (bytes, dtype)
            }
            Source::Device { ptr, numel, dtype } => {
                let src = (ptr, numel, dtype);
                // SAFETY: the caller's contract, passed on.
                return unsafe {
                    self.accumulate_device(stream, src, (dst, dst_region), scale, add)
                };
            }
        };
        check_accumulator(dst_region.dtype)?;
        let dst_dtype = dst_region.dtype;
        let (memory, range) = part(dst, dst_region)?;
        if bytes.len() != dst_region.len * dtype.size() {
            return Err(length_mismatch(bytes.len() / dtype.size(), dst_region.len));
        }
        // The host input is the caller's only until the call returns: queued work takes a copy.
        let bytes = match &self.streams {
            None => {
                // SAFETY: eager: nothing else runs; the caller ordered every use of the region.
                math::accumulate(
                    (unsafe { memory.bytes_mut(range) }, dst_dtype),
                    (bytes, dtype),
                    scale,
                    add,
                );
                return Ok(());
            }
            Some(_) => crate::fallible::copy_of(bytes, "a queued gradient")?,
        };
        self.run(stream, move || {
            // SAFETY: the caller ordered every other use of the region (the trait's contract).
            let dst = unsafe { memory.bytes_mut(range.clone()) };
            math::accumulate((dst, dst_dtype), (&bytes, dtype), scale, add);
            Ok(())
        })
    }

    unsafe fn accumulate(
        &self,
        stream: Stream,
        src: &CpuBuffer,
        src_region: Region,
        dst: &mut CpuBuffer,
        dst_region: Region,
        scale: f32,
        add: bool,
    ) -> Result<()> {
        check_accumulator(dst_region.dtype)?;
        let (src_memory, src_range) = part(src, src_region)?;
        let (dst_memory, dst_range) = part(dst, dst_region)?;
        if src_region.len != dst_region.len {
            return Err(length_mismatch(src_region.len, dst_region.len));
        }
        self.run(stream, move || {
            // SAFETY: distinct buffers; the caller ordered every other use of both regions.
            let (src, dst) = unsafe {
                (
                    src_memory.bytes(src_range.clone()),
                    dst_memory.bytes_mut(dst_range.clone()),
                )
            };
            math::accumulate((dst, dst_region.dtype), (src, src_region.dtype), scale, add);
            Ok(())
        })
    }

    unsafe fn write_step_values(
        &self,
        stream: Stream,
        dst: &mut CpuBuffer,
        values: &StepValues,
    ) -> Result<()> {
        let (memory, range) = byte_part(dst, 0, STEP_VALUES_BYTES)?;
        let values = *values;
        self.run(stream, move || {
            // SAFETY: the caller ordered every other use of the bytes.
            let bytes = unsafe { memory.bytes_mut(range.clone()) };
            bytes.copy_from_slice(bytemuck::bytes_of(&values));
            Ok(())
        })
    }

    unsafe fn optimizer_step(
        &self,
        stream: Stream,
        update: StepUpdate<'_, CpuBackend>,
        shard: OptimizerShard<'_, CpuBackend>,
    ) -> Result<()> {
        math::check_optimizer(update.kind, &shard)?;
        let n = shard.numel;
        let whole = Region::new(0, n, DType::F32);
        let dtype = shard.dtype;
        let param = part(shard.param, Region::new(0, n, dtype))?;
        let grad = part(shard.grad, whole)?;
        let master = shard.master.map(|m| part(m, whole)).transpose()?;
        let moments = match shard.moments {
            Some(m) => {
                let region = Region::new(0, n, m.storage.dtype());
                Some((part(m.first, region)?, part(m.second, region)?, m.storage))
            }
            None => None,
        };
        let values = byte_part(update.values, 0, STEP_VALUES_BYTES)?;
        let (kind, group) = (update.kind, update.group);
        self.run(stream, move || {
            // SAFETY: the caller ordered the write of the values before this update.
            let values: StepValues =
                bytemuck::pod_read_unaligned(unsafe { values.0.bytes(values.1.clone()) });
            if values.skip != 0 {
                // The device skipped the step: every shard, master and moment stays.
                return Ok(());
            }
            let seed = |storage| match storage {
                MomentStorage::Bf16Stochastic { group, .. } => {
                    moment_seed(values.step, group as usize)
                }
                MomentStorage::F32 => 0,
            };
            // SAFETY: distinct buffers, every one a whole shard of the group; the caller ordered
            // every other use of them (the trait's contract).
            let slices = unsafe {
                OptimizerSlices {
                    param: param.0.bytes_mut(param.1.clone()),
                    dtype,
                    grad: math::f32s(grad.0.bytes(grad.1.clone())),
                    master: master
                        .as_ref()
                        .map(|(m, r)| math::f32s_mut(m.bytes_mut(r.clone()))),
                    moments: moments.as_ref().map(|((m, mr), (v, vr), storage)| {
                        math::MomentSlices {
                            first: m.bytes_mut(mr.clone()),
                            second: v.bytes_mut(vr.clone()),
                            storage: *storage,
                            seed: seed(*storage),
                        }
                    }),
                }
            };
            math::optimizer_step(&group.coefficients(kind, &values), slices);
            Ok(())
        })
    }

    unsafe fn clip_step_values(
        &self,
        stream: Stream,
        (parts, ranks): (&CpuBuffer, usize),
        max_norm: f32,
        values: &mut CpuBuffer,
    ) -> Result<()> {
        let parts = norm_parts(parts, ranks)?;
        let values = byte_part(values, 0, STEP_VALUES_BYTES)?;
        self.run(stream, move || {
            // SAFETY: distinct buffers; the caller ordered every other use of both.
            let (parts, values) = unsafe {
                (
                    parts.0.bytes(parts.1.clone()),
                    values.0.bytes_mut(values.1.clone()),
                )
            };
            let norm = norm_of(parts);
            let mut step: StepValues = bytemuck::pod_read_unaligned(values);
            step.grad_scale = norm.clip_coefficient(max_norm);
            values.copy_from_slice(bytemuck::bytes_of(&step));
            Ok(())
        })
    }

    unsafe fn skip_nonfinite_step(
        &self,
        stream: Stream,
        (parts, ranks): (&CpuBuffer, usize),
        skipped: &mut CpuBuffer,
        values: &mut CpuBuffer,
    ) -> Result<()> {
        let parts = norm_parts(parts, ranks)?;
        let skipped = byte_part(skipped, 0, crate::plan::SKIPPED_STEPS_BYTES)?;
        let values = byte_part(values, 0, STEP_VALUES_BYTES)?;
        self.run(stream, move || {
            // SAFETY: distinct buffers; the caller ordered every other use of the three.
            let (parts, skipped, values) = unsafe {
                (
                    parts.0.bytes(parts.1.clone()),
                    skipped.0.bytes_mut(skipped.1.clone()),
                    values.0.bytes_mut(values.1.clone()),
                )
            };
            let skip = !norm_of(parts).is_finite();
            let mut step: StepValues = bytemuck::pod_read_unaligned(values);
            step.skip = u32::from(skip);
            values.copy_from_slice(bytemuck::bytes_of(&step));
            let count: u64 = bytemuck::pod_read_unaligned(skipped);
            skipped.copy_from_slice(&(count + u64::from(skip)).to_le_bytes());
            Ok(())
        })
    }

    unsafe fn correct_step_values(
        &self,
        stream: Stream,
        skipped: &CpuBuffer,
        values: &mut CpuBuffer,
    ) -> Result<()> {
        let skipped = byte_part(skipped, 0, crate::plan::SKIPPED_STEPS_BYTES)?;
        let values = byte_part(values, 0, STEP_VALUES_BYTES)?;
        self.run(stream, move || {
            // SAFETY: distinct buffers; the caller ordered every other use of both.
            let (skipped, values) = unsafe {
                (
                    skipped.0.bytes(skipped.1.clone()),
                    values.0.bytes_mut(values.1.clone()),
                )
            };
            let count: u64 = bytemuck::pod_read_unaligned(skipped);
            if count > 0 {
                let mut step: StepValues = bytemuck::pod_read_unaligned(values);
                step.step = step.step.saturating_sub(count);
                (step.bias1, step.sqrt_bias2) =
                    crate::optim::bias_corrections(step.beta1, step.beta2, step.step);
                values.copy_from_slice(bytemuck::bytes_of(&step));
            }
            Ok(())
        })
    }

    unsafe fn norm_partials(
        &self,
        stream: Stream,
        src: &CpuBuffer,
        region: Region,
        out: &mut CpuBuffer,
    ) -> Result<()> {
        let (src_memory, src_range) =
            part(src, Region::new(region.offset, region.len, DType::F32))?;
        let (out_memory, out_range) = part(out, Region::new(0, 4, DType::F32))?;
        self.run(stream, move || {
            // SAFETY: distinct buffers; the caller ordered every other use of both.
            let (src, out) = unsafe {
                (
                    math::f32s(src_memory.bytes(src_range.clone())),
                    out_memory.bytes_mut(out_range.clone()),
                )
            };
            math::norm_partials(src, out);
            Ok(())
        })
    }

    unsafe fn count_nonfinite(
        &self,
        stream: Stream,
        src: &CpuBuffer,
        region: Region,
        counter: &mut CpuBuffer,
    ) -> Result<()> {
        let (src_memory, src_range) =
            part(src, Region::new(region.offset, region.len, DType::F32))?;
        let (counter_memory, counter_range) = part(counter, Region::new(0, 2, DType::F32))?;
        self.run(stream, move || {
            // SAFETY: distinct buffers; the caller ordered every other use of both.
            let (src, counter) = unsafe {
                (
                    math::f32s(src_memory.bytes(src_range.clone())),
                    counter_memory.bytes_mut(counter_range.clone()),
                )
            };
            let found = src.iter().filter(|x| !x.is_finite()).count() as u64;
            let total = u64::from_le_bytes(counter[..8].try_into().unwrap_or([0; 8])) + found;
            counter.copy_from_slice(&total.to_le_bytes());
            Ok(())
        })
    }

    unsafe fn cast(
        &self,
        stream: Stream,
        src: &CpuBuffer,
        src_region: Region,
        dst: &mut CpuBuffer,
        dst_region: Region,
    ) -> Result<()> {
        let (src_memory, src_range) = part(src, src_region)?;
        let (dst_memory, dst_range) = part(dst, dst_region)?;
        if src_region.len != dst_region.len {
            return Err(length_mismatch(src_region.len, dst_region.len));
        }
        let dtypes = (src_region.dtype, dst_region.dtype);
        self.run(stream, move || {
            // SAFETY: distinct buffers; the caller ordered every other use of both regions.
            let (src, dst) = unsafe {
                (
                    src_memory.bytes(src_range.clone()),
                    dst_memory.bytes_mut(dst_range.clone()),
                )
            };
            crate::dtype::convert((dst, dtypes.1), (src, dtypes.0));
            Ok(())
        })
    }
}

/// Host addresses, for a caller outside Rust; each waits for the compute stream first, since the
/// caller reads or writes through it right away, as compute-stream work.
impl RawAddress for CpuBackend {
    fn address(&self, buf: &CpuBuffer, region: Region) -> Result<u64> {
        let range = region.byte_range(buf.len())?;
        self.drain(Stream::Compute)?;
        // SAFETY: only an address is made; the caller's accesses through it are its own contract.
        Ok(unsafe { buf.memory().bytes(range) }.as_ptr() as u64)
    }

    fn address_mut(&self, buf: &mut CpuBuffer, region: Region) -> Result<u64> {
        let range = region.byte_range(buf.len())?;
        self.drain(Stream::Compute)?;
        // SAFETY: as above.
        Ok(unsafe { buf.memory().bytes_mut(range) }.as_mut_ptr() as u64)
    }

    fn stream_address(&self, buf: &CpuBuffer, region: Region) -> Result<u64> {
        buf.addr(region)
    }
}

#[cfg(test)]
mod tests;
