//! The device seam: memory, streams, events and the data operations the engine issues.
//!
//! Every operation goes on a named [`Stream`]; order across streams comes only from events
//! ([`Backend::record`] on one stream, [`Backend::wait`] on another). A backend may run eagerly
//! (the CPU backend completes each operation before returning), but the engine never relies on it.

pub mod cpu;
pub mod cuda;

use crate::dtype::DType;
use crate::error::Result;
use crate::optim::Update;

/// The three streams of a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stream {
    /// The caller's compute: gradients are written and the optimizer runs here.
    Compute,
    /// All-gathers of parameter shards into gathered slots.
    Gather,
    /// Reduce-scatters of gradients and accumulation into the gradient shards.
    Reduce,
}

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

    /// The byte range of the region.
    pub fn bytes(&self) -> std::ops::Range<usize> {
        self.offset * self.dtype.size()..(self.offset + self.len) * self.dtype.size()
    }
}

/// A caller's tensor handed to the engine: host memory, or device memory on the compute stream.
#[derive(Clone, Copy, Debug)]
pub enum Input<'a> {
    Host {
        bytes: &'a [u8],
        dtype: DType,
    },
    /// A device address valid for `numel` elements until the compute stream has consumed it.
    Device {
        ptr: u64,
        numel: usize,
        dtype: DType,
    },
}

impl<'a> Input<'a> {
    /// A host slice of any element type.
    pub fn host<T: crate::dtype::Element>(data: &'a [T]) -> Input<'a> {
        Input::Host {
            bytes: bytemuck::cast_slice(data),
            dtype: T::DTYPE,
        }
    }

    pub fn dtype(&self) -> DType {
        match *self {
            Input::Host { dtype, .. } | Input::Device { dtype, .. } => dtype,
        }
    }

    pub fn numel(&self) -> usize {
        match *self {
            Input::Host { bytes, dtype } => bytes.len() / dtype.size(),
            Input::Device { numel, .. } => numel,
        }
    }
}

/// Bytes a backend holds now and at most since it was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    pub current: usize,
    pub peak: usize,
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
    pub moments: Option<(&'a mut B::Buffer, &'a mut B::Buffer)>,
}

/// Memory, streams, events and data operations of one rank's device.
pub trait Backend: Send {
    /// A device allocation, untyped; regions give it a dtype.
    type Buffer: Send;
    type Event: Send;

    /// A short name for errors and reports.
    fn name(&self) -> &'static str;

    /// Allocates `bytes` bytes, zero-filled.
    fn alloc(&self, bytes: usize) -> Result<Self::Buffer>;

    fn memory(&self) -> MemoryUsage;

    /// Times the host blocked on the device.
    fn host_waits(&self) -> u64;

    /// Marks the current end of `stream`'s work.
    fn record(&self, stream: Stream) -> Result<Self::Event>;

    /// Makes `stream`'s later work wait for `event`, without blocking the host.
    fn wait(&self, stream: Stream, event: &Self::Event) -> Result<()>;

    /// Blocks the host until `event` completed.
    fn synchronize(&self, event: &Self::Event) -> Result<()>;

    /// As [`Backend::record`], with a timestamp, for traces and measurements.
    fn record_timed(&self, stream: Stream) -> Result<Self::Event>;

    /// Milliseconds from `start` to `end`, both from [`Backend::record_timed`]. Blocks the host
    /// until `end` completed: read timings after the work they measure.
    fn elapsed_ms(&self, start: &Self::Event, end: &Self::Event) -> Result<f32>;

    /// Zero-fills `region` of `buf`.
    fn zero(&self, stream: Stream, buf: &mut Self::Buffer, region: Region) -> Result<()>;

    /// Copies host bytes into `region` of `buf`; blocks until done.
    fn upload(&self, buf: &mut Self::Buffer, region: Region, data: &[u8]) -> Result<()>;

    /// Copies `region` of `buf` to the host; blocks until done.
    fn download(&self, buf: &Self::Buffer, region: Region, out: &mut [u8]) -> Result<()>;

    /// `dst = scale * src` (or `dst += scale * src` when `add`), `dst` an f32 region, `src` a
    /// caller's tensor of any dtype with `dst.len` elements.
    fn accumulate_input(
        &self,
        stream: Stream,
        src: Input<'_>,
        dst: &mut Self::Buffer,
        dst_region: Region,
        scale: f32,
        add: bool,
    ) -> Result<()>;

    /// `dst = scale * src` (or `dst += scale * src` when `add`), both f32 regions of one length.
    #[allow(clippy::too_many_arguments)]
    fn accumulate(
        &self,
        stream: Stream,
        src: &Self::Buffer,
        src_region: Region,
        dst: &mut Self::Buffer,
        dst_region: Region,
        scale: f32,
        add: bool,
    ) -> Result<()>;

    /// Applies one optimizer update to a shard.
    fn optimizer_step(
        &self,
        stream: Stream,
        update: &Update,
        shard: OptimizerShard<'_, Self>,
    ) -> Result<()>;

    /// Copies `region` of `src` (any dtype) to f32 `dst`.
    fn widen(
        &self,
        stream: Stream,
        src: &Self::Buffer,
        src_region: Region,
        dst: &mut Self::Buffer,
    ) -> Result<()>;
}

/// Addresses of buffer regions for callers outside Rust (the C API): host addresses on the CPU,
/// device addresses on a GPU. A region past the end of its buffer is an error.
pub trait RawAddress: Backend {
    fn address(buf: &Self::Buffer, region: Region) -> Result<u64>;
    /// An address the caller may write through.
    fn address_mut(buf: &mut Self::Buffer, region: Region) -> Result<u64>;
}
