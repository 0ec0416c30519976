//! The device seam: memory, streams, events and the data operations the engine issues.
//!
//! Every operation goes on a named [`Stream`]; order across streams comes only from events
//! ([`Backend::record`] on one stream, [`Backend::wait`] on another). A backend may run eagerly
//! (the CPU backend completes each operation before returning), but the engine never relies on it.

pub mod cpu;
pub mod cuda;
#[cfg(feature = "fault-injection")]
pub mod hold;

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::error::{Error, Result};
use crate::optim::{GroupUpdate, OptimizerKind, StepValues};
use crate::types::DType;
use crate::types::Stream;
use crate::watch::Watch;

/// `len` elements of `dtype` starting at element `offset` of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Region {
    pub offset: usize,
    pub len: usize,
    pub dtype: DType,
}

impl Region {
    pub fn new(offset: usize, len: usize, dtype: DType) -> Region {
        Region { offset, len, dtype }
    }

    /// The byte range of the region in a buffer of `capacity` bytes, or `Error::OutOfRange` when
    /// it runs past the end (or its end overflows).
    pub fn byte_range(&self, capacity: usize) -> Result<std::ops::Range<usize>> {
        let size = self.dtype.size();
        let start = self.offset.checked_mul(size);
        let end = self
            .offset
            .checked_add(self.len)
            .and_then(|end| end.checked_mul(size));
        match (start, end) {
            (Some(start), Some(end)) if end <= capacity => Ok(start..end),
            _ => Err(Error::OutOfRange {
                offset: self.offset,
                len: self.len,
                capacity: capacity / size,
            }),
        }
    }
}

/// A host function queued on a stream ([`Backend::launch_host_func`]), called with its user
/// data.
pub type HostFunc = unsafe extern "C" fn(*mut std::ffi::c_void);

/// A caller's tensor handed to the engine: host memory, or device memory read on the compute
/// stream.
#[derive(Clone, Copy, Debug)]
pub struct Input<'a>(pub(crate) Source<'a>);

#[derive(Clone, Copy, Debug)]
pub(crate) enum Source<'a> {
    Host {
        bytes: &'a [u8],
        dtype: DType,
    },
    Device {
        ptr: u64,
        numel: usize,
        dtype: DType,
    },
}

impl<'a> Input<'a> {
    /// A host slice of any element type.
    pub fn host<T: crate::dtype::Element>(data: &'a [T]) -> Input<'a> {
        Input::host_bytes(bytemuck::cast_slice(data), T::DTYPE)
    }

    /// Host bytes holding elements of `dtype`, little-endian (a length that is not a whole number
    /// of elements is refused where the input is used).
    pub fn host_bytes(bytes: &'a [u8], dtype: DType) -> Input<'a> {
        Input(Source::Host { bytes, dtype })
    }

    /// `numel` elements of `dtype` at device address `ptr` (a host address on the CPU backend),
    /// read on the compute stream.
    ///
    /// # Safety
    /// `ptr` is a device address of the engine's device, valid for `numel` elements of `dtype`
    /// until the compute stream has read them (after the work queued on it when the input is
    /// handed over); after the hand-over nothing writes them before then, but work queued on
    /// the compute stream after that read. Handed over during a capture
    /// ([`crate::Engine::begin_capture`]), it is read again at every replay: it stays valid, and
    /// written only in stream order, while the captured step may be replayed.
    pub unsafe fn device(ptr: u64, numel: usize, dtype: DType) -> Input<'static> {
        Input(Source::Device { ptr, numel, dtype })
    }

    pub fn dtype(&self) -> DType {
        match self.0 {
            Source::Host { dtype, .. } | Source::Device { dtype, .. } => dtype,
        }
    }

    pub fn numel(&self) -> usize {
        match self.0 {
            Source::Host { bytes, dtype } => bytes.len() / dtype.size(),
            Source::Device { numel, .. } => numel,
        }
    }
}

/// Bytes a backend holds now and at most since it was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    pub current: usize,
    pub peak: usize,
}

/// Bytes a backend's buffers hold now and at most.
#[derive(Debug, Default)]
pub(crate) struct Tracker {
    current: AtomicUsize,
    peak: AtomicUsize,
}

impl Tracker {
    pub(crate) fn add(&self, bytes: usize) {
        let current = self.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(current, Ordering::Relaxed);
    }

    pub(crate) fn remove(&self, bytes: usize) {
        self.current.fetch_sub(bytes, Ordering::Relaxed);
    }

    pub(crate) fn usage(&self) -> MemoryUsage {
        MemoryUsage {
            current: self.current.load(Ordering::Relaxed),
            peak: self.peak.load(Ordering::Relaxed),
        }
    }
}

/// One trainable group's shard and optimizer state, for an optimizer step.
pub struct OptimizerShard<'a, B: Backend + ?Sized> {
    /// The parameter shard in its dtype; it is the master copy when the dtype is f32.
    pub param: &'a mut B::Buffer,
    pub dtype: DType,
    pub numel: usize,
    /// The fp32 gradient shard.
    pub grad: &'a B::Buffer,
    /// The fp32 master copy of a bf16/f16 shard.
    pub master: Option<&'a mut B::Buffer>,
    /// AdamW's first and second moments.
    pub moments: Option<Moments<'a, B>>,
}

/// Which update an optimizer step applies: `kind`'s, with the numbers of the [`StepValues`] at the
/// start of `values` as the stream finds them when the update runs, and `group`'s scale and
/// decay.
pub struct StepUpdate<'a, B: Backend + ?Sized> {
    pub kind: OptimizerKind,
    pub values: &'a B::Buffer,
    pub group: GroupUpdate,
}

/// AdamW's moments of a shard, `numel` elements each, stored as `storage` says.
pub struct Moments<'a, B: Backend + ?Sized> {
    pub first: &'a mut B::Buffer,
    pub second: &'a mut B::Buffer,
    pub storage: crate::optim::MomentStorage,
}

/// Memory, streams, events and data operations of one rank's device.
///
/// The data operations are queued on a stream and may still run after they return (on a GPU, and
/// on the asynchronous CPU backend), so they are `unsafe`: the caller orders every use of a buffer
/// on one stream after every conflicting use on another with events ([`Backend::record`],
/// [`Backend::wait`]). [`Backend::upload`] and [`Backend::download`] order themselves after every
/// stream's work and complete before they return.
pub trait Backend: Send {
    /// A device allocation, untyped; regions give it a dtype.
    type Buffer: Send;
    /// Shared with the engine's watchdog, which asks whether collectives are done
    /// ([`Backend::reached`]) from a thread of its own.
    type Event: Send + Sync + 'static;
    /// Host memory that device buffers are copied into in stream order (page-locked on a GPU,
    /// so that the copies run at the link's speed while the host goes on).
    type HostBuffer: Send + 'static;

    /// Work captured from the streams ([`Backend::end_capture`]), replayable.
    type Graph: Send + Sync;

    /// A short name for errors and reports.
    fn name(&self) -> &'static str;

    /// Begins capturing the work queued on `stream` and on each stream that joins the capture
    /// by waiting for an event recorded in it, as a CUDA stream capture does: nothing queued
    /// runs until a replay. Until the capture ends, a host wait, an allocation, a free, work on
    /// a stream that did not join and a wait for an event outside the capture are
    /// `Error::Capture`, and so is a query of an event recorded in it.
    fn begin_capture(&self, stream: Stream) -> Result<()>;

    /// Ends the capture under way: its graph, or `Error::Capture` where a stream that joined it
    /// was not joined back (the stream it began on waits for an event recorded after that
    /// stream's last work). The capture ends either way.
    fn end_capture(&self) -> Result<Self::Graph>;

    /// Joins a capture of `stream` that the caller began outside this backend (its own stream
    /// capture, or a framework's, such as `torch.cuda.graph` on that stream), in thread-local
    /// or relaxed mode (the backend's other threads query events during it): until
    /// [`Backend::leave_capture`], what would fail it is refused as during
    /// [`Backend::begin_capture`]'s, and another stream joins it by waiting for an event
    /// recorded in it. `Error::Capture` where no capture of `stream` is under way, or this
    /// backend is already in one.
    fn join_capture(&self, stream: Stream) -> Result<()>;

    /// Leaves the capture joined by [`Backend::join_capture`], which the caller then ends; every
    /// stream that joined it must be joined back first. `Error::Capture` where none was joined,
    /// or where the capture is no longer under way (it failed).
    fn leave_capture(&self) -> Result<()>;

    /// Queues `graph`'s work as one operation of the stream its capture began on: that stream's
    /// later work follows all of it, another stream's later work none of it (order it with an
    /// event of that stream).
    ///
    /// # Safety
    /// This backend captured `graph`; every buffer and address its work uses is alive until
    /// the replay completed; work on another stream that uses them is ordered against it with
    /// events, as for the data operations.
    unsafe fn replay(&self, graph: &Self::Graph) -> Result<()>;

    /// Queues `func(user_data)` on `stream` after the work queued there so far, as a host
    /// function of that stream (`cuLaunchHostFunc` on a GPU, where it must make no CUDA call; a
    /// job of the stream's worker on the asynchronous CPU backend; at once on the eager one).
    /// The stream's later work waits for it to return. Queued during a capture, it is captured
    /// and runs at each replay instead.
    ///
    /// # Safety
    /// `func` may be called with `user_data` on another thread, once for this call or once per
    /// replay of a capture that holds it; `user_data` stays valid for that until the last call
    /// returned.
    unsafe fn launch_host_func(
        &self,
        stream: Stream,
        func: HostFunc,
        user_data: *mut std::ffi::c_void,
    ) -> Result<()>;

    /// Allocates `bytes` bytes, zero-filled; `Error::OutOfMemory` when the device has too little.
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer>;

    /// As [`Backend::alloc`], the contents undefined until written: for a buffer the engine
    /// writes whole before it reads any of it (a per-step gradient shard), so that making it
    /// queues no fill. Its first use is on the compute stream, or on another stream after that
    /// stream waited for the compute stream's work queued after the allocation: a backend that
    /// reuses memory in stream order reuses it in the compute stream's.
    fn alloc_unfilled(&self, bytes: usize) -> Result<Self::Buffer>;

    /// Drops `buffers` as dropping each would; a backend that frees in stream order orders their
    /// memory after every stream's work so far once for them all, rather than once a buffer.
    fn free(&self, buffers: impl IntoIterator<Item = Self::Buffer>) -> Result<()> {
        buffers.into_iter().for_each(drop);
        Ok(())
    }

    /// Drops `buffers`, whose every use so far the compute stream is ordered after (it used
    /// them last, after waiting for the other streams' uses): a backend that frees in stream
    /// order gives their memory back with no wait of its own.
    ///
    /// # Safety
    /// The compute stream waited for every use of the buffers on another stream.
    unsafe fn free_after_compute(
        &self,
        buffers: impl IntoIterator<Item = Self::Buffer>,
    ) -> Result<()> {
        buffers.into_iter().for_each(drop);
        Ok(())
    }

    /// As [`Backend::alloc`], outside [`Backend::memory`]'s count: for the few bytes the ranks
    /// exchange to compare their plans and collectives, which no plan predicts.
    fn alloc_scratch(&self, bytes: usize) -> Result<Self::Buffer>;

    fn memory(&self) -> MemoryUsage;

    /// `bytes` bytes of host memory for [`Backend::copy_to_host`], outside [`Backend::memory`]'s
    /// count.
    fn alloc_host(&self, bytes: usize) -> Result<Self::HostBuffer>;

    /// The bytes of `buf`.
    ///
    /// # Safety
    /// Every copy queued into `buf` completed (its stream's event was synchronized).
    unsafe fn host_bytes(buf: &Self::HostBuffer) -> &[u8];

    /// The bytes of `buf`, for the host to write (a copy from it to a device buffer, say
    /// [`Backend::upload`], then runs at the link's speed).
    ///
    /// # Safety
    /// Every copy queued into `buf` completed (its stream's event was synchronized).
    unsafe fn host_bytes_mut(buf: &mut Self::HostBuffer) -> &mut [u8];

    /// Queues on `stream` a copy of `region` of `src` into `dst` from byte `at`.
    ///
    /// # Safety
    /// As [`Backend::zero`] for `src`; nothing reads `dst`'s range until the copy completed.
    unsafe fn copy_to_host(
        &self,
        stream: Stream,
        src: &Self::Buffer,
        region: Region,
        dst: &mut Self::HostBuffer,
        at: usize,
    ) -> Result<()>;

    /// Queues on `stream` a copy of `region.len` elements of host memory `src` from byte `at`
    /// into `region` of `dst` (from page-locked memory on a GPU, at the link's speed).
    ///
    /// # Safety
    /// As [`Backend::zero`] for `dst`; nothing writes `src`'s range until the copy completed.
    unsafe fn copy_from_host(
        &self,
        stream: Stream,
        src: &Self::HostBuffer,
        at: usize,
        dst: &mut Self::Buffer,
        region: Region,
    ) -> Result<()>;

    /// Whether dropping a buffer neither blocks the host nor lets its memory be used again before
    /// the work queued on any stream so far is done with it, so that buffers can come and go
    /// every step ([`crate::GradShardMemory::PerStep`]).
    fn frees_in_stream_order(&self) -> bool;

    /// Times the host blocked on the device.
    fn host_waits(&self) -> u64;

    /// The deadline and abort flag of the backend's blocking waits, from its engine.
    fn set_watch(&mut self, watch: &Watch);

    /// Marks the current end of `stream`'s work.
    fn record(&self, stream: Stream) -> Result<Self::Event>;

    /// Queues on `stream` work that completes only once `release` is set, as a collective whose
    /// peer is stuck never completes on the device; `Error::Unsupported` where the stream runs
    /// its work on the caller's thread (the eager CPU backend), which would block for good.
    #[cfg(feature = "fault-injection")]
    fn hold(&self, stream: Stream, release: &hold::Release) -> Result<()>;

    /// Makes `stream`'s later work wait for `event`, without blocking the host.
    fn wait(&self, stream: Stream, event: &Self::Event) -> Result<()>;

    /// Whether `event`'s stream got there, without blocking: from any thread.
    fn reached(event: &Self::Event) -> Result<bool>;

    /// Blocks the host until `event` completed.
    fn synchronize(&self, event: &Self::Event) -> Result<()>;

    /// As [`Backend::record`], with a timestamp, for traces and measurements.
    fn record_timed(&self, stream: Stream) -> Result<Self::Event>;

    /// Milliseconds from `start` to `end`, both from [`Backend::record_timed`]. Blocks the host
    /// until `end` completed: read timings after the work they measure.
    fn elapsed_ms(&self, start: &Self::Event, end: &Self::Event) -> Result<f32>;

    /// Zero-fills `region` of `buf`.
    ///
    /// # Safety
    /// No work on another stream uses the region concurrently: the caller orders the uses with
    /// events (the trait's contract).
    unsafe fn zero(&self, stream: Stream, buf: &mut Self::Buffer, region: Region) -> Result<()>;

    /// Copies host bytes into `region` of `buf`, after every stream's earlier work; blocks until
    /// done.
    fn upload(&self, buf: &mut Self::Buffer, region: Region, data: &[u8]) -> Result<()>;

    /// Copies `region` of `buf` to the host, after every stream's earlier work; blocks until done.
    fn download(&self, buf: &Self::Buffer, region: Region, out: &mut [u8]) -> Result<()>;

    /// Copies `region` of `buf` to the host as the compute stream's work, after that stream's
    /// earlier work only, as a model's kernel reads it; blocks until done. The caller made the
    /// compute stream wait for every other stream's writes of the region.
    fn download_on_compute(&self, buf: &Self::Buffer, region: Region, out: &mut [u8])
    -> Result<()>;

    /// `dst = scale * src` (or `dst += scale * src` when `add`) computed in f32 and rounded to
    /// `dst`'s dtype, f32 or bf16 (`Error::Unsupported` for f16), `src` a caller's tensor of any
    /// dtype with `dst.len` elements. Host input is copied before the call returns.
    ///
    /// # Safety
    /// As [`Backend::zero`], for `dst`; a device `src` is the caller's to keep valid (see
    /// [`Input::device`]).
    unsafe fn accumulate_input(
        &self,
        stream: Stream,
        src: Input<'_>,
        dst: &mut Self::Buffer,
        dst_region: Region,
        scale: f32,
        add: bool,
    ) -> Result<()>;

    /// [`Backend::accumulate_input`] of each `(src, dst_region)` of `writes` into `dst`, in order;
    /// a backend may run them as one operation (the CUDA backend: one launch for many device
    /// tensors of one dtype), with the same arithmetic.
    ///
    /// # Safety
    /// As [`Backend::accumulate_input`], for each write; the regions do not overlap.
    unsafe fn accumulate_inputs(
        &self,
        stream: Stream,
        writes: &[(Input<'_>, Region)],
        dst: &mut Self::Buffer,
        scale: f32,
        add: bool,
    ) -> Result<()> {
        for &(src, region) in writes {
            // SAFETY: the caller's contract, for this write.
            unsafe { self.accumulate_input(stream, src, dst, region, scale, add) }?;
        }
        Ok(())
    }

    /// `dst = scale * src` (or `dst += scale * src` when `add`) computed in f32 and rounded to
    /// `dst`'s dtype, f32 or bf16; `src` of any dtype, of `dst`'s length.
    ///
    /// # Safety
    /// As [`Backend::zero`], for both regions.
    #[allow(clippy::too_many_arguments)]
    unsafe fn accumulate(
        &self,
        stream: Stream,
        src: &Self::Buffer,
        src_region: Region,
        dst: &mut Self::Buffer,
        dst_region: Region,
        scale: f32,
        add: bool,
    ) -> Result<()>;

    /// Queues on `stream` a write of `values` into the first [`crate::optim::STEP_VALUES_BYTES`]
    /// of `dst`, which must hold them; `values` are taken before the call returns.
    ///
    /// # Safety
    /// As [`Backend::zero`], for those bytes of `dst`.
    unsafe fn write_step_values(
        &self,
        stream: Stream,
        dst: &mut Self::Buffer,
        values: &StepValues,
    ) -> Result<()>;

    /// Applies one optimizer update to a shard: the coefficients of
    /// [`GroupUpdate::coefficients`] of the step values it reads, exactly.
    ///
    /// # Safety
    /// As [`Backend::zero`], for every buffer of the shard, and for `update.values` read.
    unsafe fn optimizer_step(
        &self,
        stream: Stream,
        update: StepUpdate<'_, Self>,
        shard: OptimizerShard<'_, Self>,
    ) -> Result<()>;

    /// Adds to the u64 at the start of `counter` the number of infinite or NaN values in the f32
    /// `region` of `src`.
    ///
    /// # Safety
    /// As [`Backend::zero`], for both buffers.
    unsafe fn count_nonfinite(
        &self,
        stream: Stream,
        src: &Self::Buffer,
        region: Region,
        counter: &mut Self::Buffer,
    ) -> Result<()>;

    /// Adds the sum of the squares of the f32 `region` of `src` to the f64 at the start of
    /// `out` (16 bytes), and raises the u32 at its byte 8 to the bits of the largest magnitude
    /// (a NaN, its sign cleared, above every number): the rank's part of the gradient norms.
    ///
    /// # Safety
    /// As [`Backend::zero`], for both buffers.
    unsafe fn norm_partials(
        &self,
        stream: Stream,
        src: &Self::Buffer,
        region: Region,
        out: &mut Self::Buffer,
    ) -> Result<()>;

    /// Sets the `grad_scale` of the [`StepValues`] at the start of `values` to the clipping
    /// coefficient of `max_norm` for the norms of `ranks` parts at the start of `parts` (each
    /// [`crate::plan::NORM_PART_BYTES`] long, as [`Backend::norm_partials`] adds them up): the
    /// sums of squares added in rank order in f64, the square root rounded to f32, then
    /// `max_norm / (l2 + 1e-6)`, at most 1 (NaN stays NaN), as
    /// [`crate::engine::GradNorm::clip_coefficient`] computes it on the host.
    ///
    /// # Safety
    /// As [`Backend::zero`], for both buffers.
    unsafe fn clip_step_values(
        &self,
        stream: Stream,
        parts: (&Self::Buffer, usize),
        max_norm: f32,
        values: &mut Self::Buffer,
    ) -> Result<()>;

    /// Decides on the device whether the step is skipped: where the norms of the `ranks` norm
    /// parts at the start of `parts` are not finite ([`crate::engine::GradNorm::is_finite`] of
    /// the parts combined as [`Backend::clip_step_values`] combines them: the f32 2-norm or the
    /// largest magnitude infinite or NaN), sets the `skip` of the [`StepValues`] at the start of
    /// `values` to 1 and adds 1 to the u64 at the start of `skipped`; else sets `skip` to 0.
    ///
    /// # Safety
    /// As [`Backend::zero`], for the three buffers.
    unsafe fn skip_nonfinite_step(
        &self,
        stream: Stream,
        parts: (&Self::Buffer, usize),
        skipped: &mut Self::Buffer,
        values: &mut Self::Buffer,
    ) -> Result<()>;

    /// Counts out the steps skipped on the device from the [`StepValues`] at the start of
    /// `values`, written for update `step` by the host: where the u64 at the start of `skipped`
    /// is `k > 0`, the values become update `step - k`'s (`step`, and `bias1` and `sqrt_bias2`
    /// as [`crate::optim::bias_corrections`] computes them from the values' betas).
    ///
    /// # Safety
    /// As [`Backend::zero`], for both buffers.
    unsafe fn correct_step_values(
        &self,
        stream: Stream,
        skipped: &Self::Buffer,
        values: &mut Self::Buffer,
    ) -> Result<()>;

    /// Copies `src_region` of `src` to `dst_region` of `dst` (the same length), converting
    /// between their dtypes: exact when widening, rounding to nearest even when narrowing (as
    /// the `half` crate does, NaN payloads included).
    ///
    /// # Safety
    /// As [`Backend::zero`], for both buffers.
    unsafe fn cast(
        &self,
        stream: Stream,
        src: &Self::Buffer,
        src_region: Region,
        dst: &mut Self::Buffer,
        dst_region: Region,
    ) -> Result<()>;
}

/// Addresses of buffer regions for callers outside Rust (the C API): host addresses on the CPU,
/// device addresses on a GPU. A region past the end of its buffer is an error.
///
/// The caller uses an address as compute-stream work: on a GPU, kernels it queues on the compute
/// stream; on the CPU, where the host is the compute stream, the call first waits for the compute
/// stream's work so far.
pub trait RawAddress: Backend {
    fn address(&self, buf: &Self::Buffer, region: Region) -> Result<u64>;
    /// An address the caller may write through.
    fn address_mut(&self, buf: &mut Self::Buffer, region: Region) -> Result<u64>;
    /// An address for work the caller queues on the compute stream (its kernels on a GPU,
    /// [`cpu::CpuBackend::run`]'s jobs on the CPU): no wait, since that work is ordered where
    /// it runs.
    fn stream_address(&self, buf: &Self::Buffer, region: Region) -> Result<u64>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_inside_the_buffer_give_their_bytes() {
        let r = Region::new(3, 2, DType::Bf16).byte_range(10).unwrap();
        assert_eq!(r, 6..10);
        assert_eq!(Region::new(0, 0, DType::F32).byte_range(0).unwrap(), 0..0);
    }

    #[test]
    fn regions_past_the_end_or_overflowing_are_out_of_range() {
        assert!(matches!(
            Region::new(3, 2, DType::F32).byte_range(16),
            Err(Error::OutOfRange {
                offset: 3,
                len: 2,
                capacity: 4
            })
        ));
        assert!(matches!(
            Region::new(usize::MAX, 2, DType::F32).byte_range(16),
            Err(Error::OutOfRange {
                offset: usize::MAX,
                len: 2,
                capacity: 4
            })
        ));
        assert!(matches!(
            Region::new(0, usize::MAX / 2, DType::F32).byte_range(16),
            Err(Error::OutOfRange { capacity: 4, .. })
        ));
    }
}
