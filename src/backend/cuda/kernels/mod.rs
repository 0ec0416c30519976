//! The hand-written kernels of `kernels/*.cu`, embedded as one fatbin and loaded per context;
//! their launches are in `launches`.

use std::ffi::{CStr, CString, c_void};
use std::sync::Arc;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaStream};

use crate::error::{Error, Result};
use crate::optim::{GroupUpdate, MomentStorage, StepValues};
use crate::types::DType;

mod launches;

/// One parameter of [`Kernels::pack`] and [`Kernels::unpack`], in elements of the group's dtype.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PackEntry {
    /// Device address of the parameter's own (unpadded) storage.
    pub ptr: u64,
    /// First element of the parameter in the flat buffer.
    pub offset: u64,
    pub numel: u64,
    /// Elements reserved in the flat buffer; `numel..padded` is written as zero by `pack`.
    pub padded: u64,
}

/// One accumulation of [`Kernels::accumulate_many`]: `n` elements from `src` into `dst`, device
/// addresses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct AccumulateEntry {
    pub src: u64,
    pub dst: u64,
    pub n: u64,
}

/// Spans in one launch of a batched kernel (`accumulate_many`, `move_many`): `fsdp::kBatchSpans`
/// in kernels/common.cuh.
pub const BATCH_SPANS: usize = 32;

/// One span of a batch: `n` elements from `src` to `dst`, device addresses (`fsdp::Span`); a move
/// with no source (0) writes zeros.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
struct Span {
    src: u64,
    dst: u64,
    n: u64,
}

/// The launch's table, passed by value as `fsdp::SpanBatch`: the spans, and the first block of
/// each one's body in a one-dimensional grid (the grid's size after the last); the blocks before
/// the first span's take the spans' unaligned edges, [`EDGE_SPANS_PER_BLOCK`] spans a block.
#[repr(C)]
struct SpanBatch {
    spans: [Span; BATCH_SPANS],
    first_block: [u32; BATCH_SPANS + 1],
}

const _: () = assert!(std::mem::size_of::<SpanBatch>() == 904);

/// Spans whose unaligned edges one block of a batched kernel takes, a warp each:
/// `fsdp::kEdgeSpans`.
const EDGE_SPANS_PER_BLOCK: usize = BLOCK as usize / 32;

/// Each span's first block when span `s` takes `blocks(spans[s].n)` blocks after the blocks of
/// the spans' edges, the grid's size after the last used span and in every unused place; all
/// zeros (no launch) when no span has an element; `None` when the blocks of `spans` (at most
/// [`BATCH_SPANS`]) do not fit in a grid.
fn first_blocks(spans: &[Span], blocks: impl Fn(u64) -> u32) -> Option<[u32; BATCH_SPANS + 1]> {
    let mut first = [0u32; BATCH_SPANS + 1];
    if spans.iter().all(|s| s.n == 0) {
        return Some(first);
    }
    let edge_blocks = spans.len().min(BATCH_SPANS).div_ceil(EDGE_SPANS_PER_BLOCK);
    let mut next = u32::try_from(edge_blocks).ok()?;
    for (place, s) in first.iter_mut().zip(spans) {
        *place = next;
        let taken = if s.n == 0 { 0 } else { blocks(s.n) };
        next = next.checked_add(taken).filter(|&n| n <= MAX_GRID)?;
    }
    first[spans.len().min(BATCH_SPANS)..].fill(next);
    Some(first)
}

/// A kernel over batches of spans, the elements a thread of it takes (a round's, or for pack and
/// unpack two rounds'), and its parameters after the batch.
#[derive(Clone, Copy)]
struct SpanKernel<'a> {
    kernel: Kernel,
    per_thread: usize,
    args: &'a [*mut c_void],
}

impl SpanKernel<'_> {
    /// Each span's first block, and the grid's size, at this kernel's elements a thread.
    fn first_blocks(&self, spans: &[Span]) -> Result<[u32; BATCH_SPANS + 1]> {
        // A span's share of a grid that every span's could fill: the kernel strides over the rest
        // of a longer one.
        let most_blocks = MAX_GRID / BATCH_SPANS as u32;
        let blocks = |n: u64| {
            let n = usize::try_from(n).unwrap_or(usize::MAX);
            elementwise_grid(n, self.per_thread).min(most_blocks)
        };
        first_blocks(spans, blocks).ok_or(Error::Unsupported {
            backend: "cuda",
            what: "a batch of spans past the largest grid",
        })
    }
}

/// The kernel a batch of `spans` runs and its table: the `wave` twin where [`one_wave`] says,
/// else `tuned`.
fn batch_kernel<'a>(
    tuned: SpanKernel<'a>,
    wave: Option<SpanKernel<'a>>,
    spans: &[Span],
) -> Result<(SpanKernel<'a>, [u32; BATCH_SPANS + 1])> {
    let tuned_first = tuned.first_blocks(spans)?;
    let Some(wave) = wave else {
        return Ok((tuned, tuned_first));
    };
    let wave_first = wave.first_blocks(spans)?;
    if one_wave(
        tuned_first[BATCH_SPANS],
        (wave.kernel, wave_first[BATCH_SPANS]),
    ) {
        Ok((wave, wave_first))
    } else {
        Ok((tuned, tuned_first))
    }
}

/// The fatbin that build.rs compiled; empty when nvcc was not found.
static FATBIN: &Aligned<[u8]> =
    &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/kernels.fatbin")));

/// The driver parses the fatbin in place, so give it the alignment of its headers and more.
#[repr(C, align(64))]
struct Aligned<T: ?Sized>(T);

/// Threads per block: `kBlock` in kernels/common.cuh.
const BLOCK: u32 = 256;

/// Bytes of one chunk of an element-wise kernel: a 16-byte vector of its widest operand.
const CHUNK_BYTES: usize = 16;

/// Chunks a thread of a copy, a fill or a move takes in its round: `kMoveRound` in
/// kernels/common.cuh.
const MOVE_ROUND: usize = 1;

/// Chunks a thread of a cast takes in its round: `kRound`.
const ROUND: usize = 2;

/// Rounds a thread of a pack or an unpack runs, one after the other (why: beside `SpanBatch` in
/// kernels/common.cuh).
const MOVE_SPAN_ROUNDS: usize = 2;

/// Chunks a thread of a `_wave` kernel takes in its one round: `kWaveRound` in
/// kernels/common.cuh, which says when and why these twins run.
const WAVE_ROUND: usize = 4;

/// Chunks a thread of an arithmetic op that loads `loaded` operands takes in its round:
/// `arithmetic_round` in kernels/common.cuh.
const fn arithmetic_round(loaded: usize, converts_16_bit: bool) -> usize {
    if loaded == 1 && converts_16_bit { 2 } else { 1 }
}

/// Chunks a thread of an optimizer takes in its round: `kOptimizerRound` in kernels/optim.cu.
const OPTIMIZER_ROUND: usize = arithmetic_round(2, true);

/// Chunks a thread of a sum of `dtype` takes in its round: `kSumRound` in kernels/grad.cu.
fn sum_round(dtype: DType) -> usize {
    if dtype.size() == 4 {
        arithmetic_round(2, false)
    } else {
        ROUND
    }
}

/// Elements in a round of `chunks` chunks of an op whose widest operand is `widest` bytes.
fn round_elements(chunks: usize, widest: usize) -> usize {
    chunks * CHUNK_BYTES / widest.max(1)
}

/// Elements a thread of an accumulation from `src` into `dst` takes in its round, as
/// `fsdp::accumulate` chooses: the chunk is one vector of the wider dtype, and an addition also
/// loads the destination.
fn accumulate_round_elements((src, dst): (DType, DType), add: bool) -> usize {
    let chunk = CHUNK_BYTES / src.size().max(dst.size());
    let converts = src.size() == 2 || dst.size() == 2;
    chunk * arithmetic_round(if add { 2 } else { 1 }, converts)
}

/// Elements each thread of a reduction (a non-finite count, the norms) takes, about: sizes the
/// grid of a small launch so that no block is left without work; large ones fill the GPU once,
/// and each warp adds to the result once.
const REDUCTION_ELEMENTS_PER_THREAD: usize = 16;

/// The most blocks of a launch's row (`gridDim.x`); the kernels stride over what lies past it.
const MAX_GRID: u32 = i32::MAX as u32;

/// Kernel names by dtype, in the order of [`dtype_index`]; an op with a `_wave` twin (see
/// [`one_wave`]) beside it.
const COPY: [(&CStr, &CStr); 3] = [
    (c"copy_bf16", c"copy_wave_bf16"),
    (c"copy_f16", c"copy_wave_f16"),
    (c"copy_f32", c"copy_wave_f32"),
];
const MOVE_MANY: [(&CStr, &CStr); 3] = [
    (c"move_many_bf16", c"move_many_wave_bf16"),
    (c"move_many_f16", c"move_many_wave_f16"),
    (c"move_many_f32", c"move_many_wave_f32"),
];
/// By source dtype, into f32 and into bf16; the twins compute `dst = scale * src` only.
const ACCUMULATE_TO_F32: [(&CStr, &CStr); 3] = [
    (c"accumulate_bf16_f32", c"accumulate_wave_bf16_f32"),
    (c"accumulate_f16_f32", c"accumulate_wave_f16_f32"),
    (c"accumulate_f32_f32", c"accumulate_wave_f32_f32"),
];
const ACCUMULATE_TO_BF16: [(&CStr, &CStr); 3] = [
    (c"accumulate_bf16_bf16", c"accumulate_wave_bf16_bf16"),
    (c"accumulate_f16_bf16", c"accumulate_wave_f16_bf16"),
    (c"accumulate_f32_bf16", c"accumulate_wave_f32_bf16"),
];
const ACCUMULATE_MANY_TO_F32: [(&CStr, &CStr); 3] = [
    (
        c"accumulate_many_bf16_f32",
        c"accumulate_many_wave_bf16_f32",
    ),
    (c"accumulate_many_f16_f32", c"accumulate_many_wave_f16_f32"),
    (c"accumulate_many_f32_f32", c"accumulate_many_wave_f32_f32"),
];
const ACCUMULATE_MANY_TO_BF16: [(&CStr, &CStr); 3] = [
    (
        c"accumulate_many_bf16_bf16",
        c"accumulate_many_wave_bf16_bf16",
    ),
    (
        c"accumulate_many_f16_bf16",
        c"accumulate_many_wave_f16_bf16",
    ),
    (
        c"accumulate_many_f32_bf16",
        c"accumulate_many_wave_f32_bf16",
    ),
];
const ADAMW: [&CStr; 3] = [c"adamw_bf16", c"adamw_f16", c"adamw_f32"];
const ADAMW_BF16_MOMENTS: [&CStr; 3] =
    [c"adamw_bf16m_bf16", c"adamw_bf16m_f16", c"adamw_bf16m_f32"];
const SGD: [&CStr; 3] = [c"sgd_bf16", c"sgd_f16", c"sgd_f32"];
/// `CAST[src][dst]`: each cast and its `_wave` twin; a same-dtype cast is a copy.
const CAST: [[Option<(&CStr, &CStr)>; 3]; 3] = [
    [
        None,
        Some((c"cast_bf16_f16", c"cast_wave_bf16_f16")),
        Some((c"cast_bf16_f32", c"cast_wave_bf16_f32")),
    ],
    [
        Some((c"cast_f16_bf16", c"cast_wave_f16_bf16")),
        None,
        Some((c"cast_f16_f32", c"cast_wave_f16_f32")),
    ],
    [
        Some((c"cast_f32_bf16", c"cast_wave_f32_bf16")),
        Some((c"cast_f32_f16", c"cast_wave_f32_f16")),
        None,
    ],
];

fn dtype_index(dtype: DType) -> usize {
    match dtype {
        DType::Bf16 => 0,
        DType::F16 => 1,
        DType::F32 => 2,
    }
}

/// A loaded kernel, and the grid that fills the GPU with it.
#[derive(Clone, Copy)]
struct Kernel {
    function: sys::CUfunction,
    full_grid: u32,
}

/// An op's kernel and its `_wave` twin.
#[derive(Clone, Copy)]
struct Twins {
    tuned: Kernel,
    wave: Kernel,
}

/// Blocks for `units` units of work at `per_block` units per block: at least one, at most `most`.
fn blocks(units: usize, per_block: usize, most: u32) -> u32 {
    let wanted = units.div_ceil(per_block.max(1)).max(1);
    u32::try_from(wanted).map_or(most, |w| w.min(most))
}

/// One round of `round_elements` elements per thread over `n` elements: the grid that ran the
/// element-wise ops nearest the memory's bandwidth (see `kRound`).
fn elementwise_grid(n: usize, round_elements: usize) -> u32 {
    blocks(n, BLOCK as usize * round_elements, MAX_GRID)
}

/// Whether a launch runs as its `_wave` twin: `tuned_grid` is its grid at the op's own round,
/// `wave` the twin and its grid at [`WAVE_ROUND`] chunks a thread. The twin runs where the op's
/// own grid would take more than one wave of the twin's resident blocks (a full SM's, as the op's
/// own kernels hold) and the twin's grid fits in one (why: `kWaveRound` in kernels/common.cuh).
/// One wave size decides both, so that a twin never runs on a grid of less than a quarter of its
/// wave (a half for the ops of two chunks), whatever the op's own kernel holds.
fn one_wave(tuned_grid: u32, wave: (Kernel, u32)) -> bool {
    tuned_grid > wave.0.full_grid && wave.1 <= wave.0.full_grid
}

impl Twins {
    /// The kernel and grid a launch runs, given its grid at the op's own round and at the twin's:
    /// the twin's where [`one_wave`] says, else the op's own.
    fn pick(self, tuned_grid: u32, wave_grid: u32) -> (Kernel, u32) {
        if one_wave(tuned_grid, (self.wave, wave_grid)) {
            (self.wave, wave_grid)
        } else {
            (self.tuned, tuned_grid)
        }
    }
}

impl Kernel {
    /// A reduction's grid over `n` elements: at most a full GPU.
    fn reduction_grid(&self, n: usize) -> u32 {
        blocks(
            n,
            BLOCK as usize * REDUCTION_ELEMENTS_PER_THREAD,
            self.full_grid,
        )
    }
}

/// The loaded module; unloaded when dropped.
struct Module {
    handle: sys::CUmodule,
    ctx: Arc<CudaContext>,
}

impl Module {
    /// Kernel `name`.
    fn kernel(&self, name: &CStr, sm_count: u32) -> Result<Kernel> {
        // SAFETY: the module is loaded and stays loaded while `self` lives.
        let function = unsafe { result::module::get_function(self.handle, CString::from(name)) }
            .map_err(|e| cuda_error_for("cuModuleGetFunction", name, e))?;
        // SAFETY: `function` was just returned by the driver.
        let per_sm = unsafe {
            result::occupancy::max_active_block_per_multiprocessor(function, BLOCK as i32, 0)
        }
        .map_err(|e| cuda_error_for("cuOccupancyMaxActiveBlocksPerMultiprocessor", name, e))?;
        let per_sm = u32::try_from(per_sm).unwrap_or(1).max(1);
        Ok(Kernel {
            function,
            full_grid: sm_count.saturating_mul(per_sm),
        })
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // Drop cannot report an error; a module that fails to unload is only leaked.
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the handle was loaded by `Kernels::load` and is unloaded only here.
            let _ = unsafe { result::module::unload(self.handle) };
        }
    }
}

/// The loaded kernels of one CUDA context.
pub struct Kernels {
    ctx: Arc<CudaContext>,
    sm_count: u32,
    fill_zero: Kernel,
    copy: [Twins; 3],
    move_many: [Twins; 3],
    accumulate_to_f32: [Twins; 3],
    accumulate_to_bf16: [Twins; 3],
    accumulate_many_to_f32: [Twins; 3],
    accumulate_many_to_bf16: [Twins; 3],
    adamw: [Kernel; 3],
    adamw_bf16_moments: [Kernel; 3],
    sgd: [Kernel; 3],
    write_step_values: Kernel,
    clip_step_values: Kernel,
    skip_nonfinite_step: Kernel,
    correct_step_values: Kernel,
    cast: [[Option<Twins>; 3]; 3],
    reduce_sum_f32: Kernel,
    reduce_sum_bf16: Kernel,
    count_nonfinite: Kernel,
    norm_partials: Kernel,
    /// Owns the functions above; unloaded when the kernels are dropped.
    _module: Module,
}

// SAFETY: module and function handles are plain driver handles, valid on any thread once the
// context is current, and every launch binds the context first; nothing here is mutated after load.
unsafe impl Send for Kernels {}
// SAFETY: as for Send: all methods take `&self` and only read the handles.
unsafe impl Sync for Kernels {}

/// Whether the kernels can be loaded at all: a non-empty fatbin and a CUDA driver library.
fn available(fatbin: &[u8]) -> Result<()> {
    if fatbin.is_empty() {
        return Err(Error::KernelsUnavailable);
    }
    // SAFETY: only tries to open the driver library by its usual names.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::CudaUnavailable {
            reason: "the CUDA driver library (libcuda) was not found".into(),
        });
    }
    Ok(())
}

fn describe(e: DriverError) -> String {
    let name = e.error_name().map_or_else(
        |_| format!("{:?}", e.0),
        |s| s.to_string_lossy().into_owned(),
    );
    let text = e.error_string().map_or_else(
        |_| "no description".to_owned(),
        |s| s.to_string_lossy().into_owned(),
    );
    format!("{name}: {text}")
}

fn cuda_error(call: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Cuda {
        call,
        code: e.0 as i32,
        message: describe(e),
    }
}

fn cuda_error_for(call: &'static str, kernel: &CStr, e: DriverError) -> Error {
    Error::Cuda {
        call,
        code: e.0 as i32,
        message: format!("{}: {}", kernel.to_string_lossy(), describe(e)),
    }
}

/// A misaligned address would fault on the device and poison the whole context; refuse it here.
fn check_aligned(addr: u64, align: usize) -> Result<()> {
    if addr % align as u64 == 0 {
        Ok(())
    } else {
        Err(Error::Unsupported {
            backend: "cuda",
            what: "a device address that is not aligned to its element size",
        })
    }
}

/// A kernel argument: the driver copies the value behind the pointer at launch.
fn arg<T>(value: &T) -> *mut c_void {
    (value as *const T).cast_mut().cast()
}

impl Kernels {
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Kernels> {
        available(&FATBIN.0)?;
        ctx.bind_to_thread()
            .map_err(cuda_error("cuCtxSetCurrent"))?;
        // SAFETY: FATBIN is a fatbin written by nvcc, aligned, and lives for the whole program.
        let handle = unsafe { result::module::load_data(FATBIN.0.as_ptr().cast()) }
            .map_err(cuda_error("cuModuleLoadData"))?;
        let module = Module {
            handle,
            ctx: Arc::clone(ctx),
        };
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_error("cuDeviceGetAttribute"))?;
        let sm_count = u32::try_from(sm_count).unwrap_or(1).max(1);
        let each = |names: &[&CStr; 3]| -> Result<[Kernel; 3]> {
            Ok([
                module.kernel(names[0], sm_count)?,
                module.kernel(names[1], sm_count)?,
                module.kernel(names[2], sm_count)?,
            ])
        };
        let twins = |(tuned, wave): (&CStr, &CStr)| -> Result<Twins> {
            Ok(Twins {
                tuned: module.kernel(tuned, sm_count)?,
                wave: module.kernel(wave, sm_count)?,
            })
        };
        let each_twins = |names: &[(&CStr, &CStr); 3]| -> Result<[Twins; 3]> {
            Ok([twins(names[0])?, twins(names[1])?, twins(names[2])?])
        };
        let mut cast = [[None; 3]; 3];
        for (row, names) in cast.iter_mut().zip(CAST) {
            for (slot, pair) in row.iter_mut().zip(names) {
                *slot = pair.map(twins).transpose()?;
            }
        }
        Ok(Kernels {
            ctx: Arc::clone(ctx),
            sm_count,
            fill_zero: module.kernel(c"fill_zero_bytes", sm_count)?,
            copy: each_twins(&COPY)?,
            move_many: each_twins(&MOVE_MANY)?,
            accumulate_to_f32: each_twins(&ACCUMULATE_TO_F32)?,
            accumulate_to_bf16: each_twins(&ACCUMULATE_TO_BF16)?,
            accumulate_many_to_f32: each_twins(&ACCUMULATE_MANY_TO_F32)?,
            accumulate_many_to_bf16: each_twins(&ACCUMULATE_MANY_TO_BF16)?,
            adamw: each(&ADAMW)?,
            adamw_bf16_moments: each(&ADAMW_BF16_MOMENTS)?,
            sgd: each(&SGD)?,
            write_step_values: module.kernel(c"write_step_values", sm_count)?,
            clip_step_values: module.kernel(c"clip_step_values", sm_count)?,
            skip_nonfinite_step: module.kernel(c"skip_nonfinite_step", sm_count)?,
            correct_step_values: module.kernel(c"correct_step_values", sm_count)?,
            cast,
            reduce_sum_f32: module.kernel(c"reduce_sum_f32", sm_count)?,
            reduce_sum_bf16: module.kernel(c"reduce_sum_bf16", sm_count)?,
            count_nonfinite: module.kernel(c"count_nonfinite_f32", sm_count)?,
            norm_partials: module.kernel(c"norm_partials_f32", sm_count)?,
            _module: module,
        })
    }

    /// Streaming multiprocessors of the context's device; grids are sized from it.
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// # Safety
    /// The arguments match the kernel's parameters, and the addresses are valid for the launch.
    unsafe fn launch(
        &self,
        stream: &CudaStream,
        kernel: Kernel,
        grid: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(cuda_error("cuCtxSetCurrent"))?;
        // SAFETY: the caller's contract; `kernel` belongs to this context's loaded module.
        unsafe {
            result::launch_kernel(
                kernel.function,
                (grid, 1, 1),
                (BLOCK, 1, 1),
                0,
                stream.cu_stream(),
                args,
            )
        }
        .map_err(cuda_error("cuLaunchKernel"))
    }
}

#[cfg(test)]
mod tests;
