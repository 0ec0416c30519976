//! GPU bench of every kernel at 1 GiB and at 16 MiB, beside a device-to-device copy
//! (`cuMemcpyDtoDAsync`) of the same size measured in the same run.
//!
//!     cargo bench --bench kernels [-- --quick] [--only WORD]   (on the GPU machine: .gpu/bin/bench-kernels)
//!
//! `--only WORD` measures the kernels whose name or dtype column contains WORD (the copy is
//! always measured: every figure is a ratio to it). The driver's `cuMemsetD8Async` of each size
//! is measured beside the copy, as the fill's peer, and the last line names every kernel below
//! the bars: 0.97 of the copy at 1 GiB, 0.90 at 16 MiB.
//!
//! A size is the bytes of a kernel's output: the flat buffer for pack, the params for unpack, the
//! f32 destination for accumulate and reduce_sum, the param for the optimizers. Each figure is the
//! median of its repetitions, each timed alone between two CUDA events after a warm-up; bandwidth
//! counts the bytes the kernel must read plus those it writes, and the last column is that
//! bandwidth over the copy's. At 16 MiB, where a launch's fixed cost is a quarter to a third of the
//! copy's time (an empty launch of a full wave takes 4.2 us between two events on an H100), a
//! kernel that moves fewer or more bytes than the copy pays that cost on fewer or more: the last
//! column there is the bandwidth over a copy's that moves the kernel's own bytes (half read, half
//! written, rounded down to 256 bytes), timed in the same run. Repetitions rotate over buffer sets
//! that together far exceed the L2 cache, so that the 16 MiB figures measure memory, not cache, as
//! in training. Every measurement carves its buffers from one allocation made at the start, so that
//! every kernel runs on the same memory: on an H200, with buffers allocated for each measurement
//! after others of different sizes were freed, one kernel ran at 0.87 of the copy in one
//! measurement and at 0.97 in another of the same run.
//! Without a GPU (or without kernels in the build) it says so and exits 0.

use std::collections::HashMap;
use std::error::Error as StdError;
use std::process::ExitCode;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, result, sys};
use fsdp_fusion::backend::cuda::kernels::{AccumulateEntry, Kernels, PackEntry};
use fsdp_fusion::optim::{GroupUpdate, MomentStorage, STEP_VALUES_BYTES, StepValues};
use fsdp_fusion::{DType, Error};

type Outcome<T> = Result<T, Box<dyn StdError>>;
/// Work on one buffer set, given its operands' addresses.
type OnSet = Box<dyn Fn(&Gpu, &[u64]) -> Outcome<()>>;

const MIB: usize = 1 << 20;
const GIB: usize = 1 << 30;
/// The output sizes every kernel is measured at.
const SIZES: [usize; 2] = [GIB, 16 * MIB];
/// The buffer sets of one measurement add up to at least this: several times an H200's L2.
const ROTATION_BYTES: usize = 512 * MIB;
const DTYPES: [DType; 3] = [DType::Bf16, DType::F16, DType::F32];
/// Bytes zeroed ahead of the timed repetitions: long enough (over half a millisecond) for the host
/// to queue every repetition behind it.
const GATE_BYTES: usize = 2 * GIB;

struct Settings {
    warmup: usize,
    reps: usize,
    /// Measure only the kernels whose name or dtype column contains this.
    only: Option<String>,
}

/// The device and what the bench holds on it. Its drop waits for the stream first, so that no
/// queued work outlives the memory it uses, on an error path too.
struct Gpu {
    /// The gate and the pool come first, so that they are freed while the context is alive.
    gate: Device,
    /// The memory every measurement's buffer sets are carved from, `pool_bytes` long.
    pool: Device,
    pool_bytes: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    kernels: Kernels,
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let only = args
        .iter()
        .position(|a| a == "--only")
        .map(|at| args.get(at + 1).cloned());
    let only = match only {
        Some(None) => {
            eprintln!("kernels bench: --only takes a word");
            return ExitCode::FAILURE;
        }
        Some(word) => word,
        None => None,
    };
    let (warmup, reps) = if quick { (3, 20) } else { (10, 50) };
    let settings = Settings { warmup, reps, only };
    let result = open().and_then(|gpu| match gpu {
        Some(gpu) => run(&gpu, &settings),
        None => Ok(()),
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kernels bench failed: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The GPU, or `None` after saying why there is nothing to measure.
fn open() -> Outcome<Option<Gpu>> {
    // SAFETY: only tries to open the driver library.
    if !unsafe { sys::is_culib_present() } {
        println!("kernels bench: no CUDA driver on this machine, nothing to measure");
        return Ok(None);
    }
    let ctx = match CudaContext::new(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            println!("kernels bench: no CUDA device ({e}), nothing to measure");
            return Ok(None);
        }
    };
    let kernels = match Kernels::load(&ctx) {
        Ok(kernels) => kernels,
        Err(e @ Error::KernelsUnavailable) => {
            println!("kernels bench: {e}");
            return Ok(None);
        }
        Err(e) => return Err(e.into()),
    };
    let stream = ctx.new_stream()?;
    let gate = Device::alloc(&stream, GATE_BYTES)?;
    let pool_bytes = SIZES
        .into_iter()
        .flat_map(|size| {
            let items = items(size);
            let same_bytes: Vec<Item> = if size < GIB {
                items
                    .iter()
                    .map(|item| memcpy(same_bytes_copy(item.moved)))
                    .collect()
            } else {
                Vec::new()
            };
            items.into_iter().chain(same_bytes).chain([memcpy(size)])
        })
        .map(|item| sets_bytes(&item))
        .max()
        .unwrap_or(0);
    let pool = Device::alloc(&stream, pool_bytes)?;
    Ok(Some(Gpu {
        ctx,
        stream,
        kernels,
        gate,
        pool,
        pool_bytes,
    }))
}

fn run(gpu: &Gpu, settings: &Settings) -> Outcome<()> {
    println!(
        "device: {} ({} SMs); median of {} repetitions after {} warm-up",
        gpu.ctx.name()?,
        gpu.kernels.sm_count(),
        settings.reps,
        settings.warmup
    );
    println!(
        "{:<12} {:<14} {:>8} {:>9} {:>9} {:>8} {:>10}",
        "kernel", "dtype", "size", "ms", "GB/s", "of copy", "same bytes"
    );
    let mut short = Vec::new();
    // The copies that move each kernel's bytes, by bytes moved.
    let mut same_bytes: HashMap<usize, Figure> = HashMap::new();
    for size in SIZES {
        let label = if size >= GIB {
            format!("{} GiB", size / GIB)
        } else {
            format!("{} MiB", size / MIB)
        };
        let copy = measure(gpu, settings, &memcpy(size))?;
        print_row("cuMemcpyDtoD", "bytes", &label, copy, 1.0, None);
        let fill_peer = measure(gpu, settings, &memset(size))?;
        let fill_peer_fraction = fill_peer.gb_per_s / copy.gb_per_s;
        print_row(
            "cuMemsetD8",
            "bytes",
            &label,
            fill_peer,
            fill_peer_fraction,
            None,
        );
        let wanted = |item: &Item| {
            settings.only.as_ref().is_none_or(|word| {
                item.kernel.contains(word.as_str()) || item.dtype.contains(word.as_str())
            })
        };
        for item in items(size).into_iter().filter(wanted) {
            let figure = measure(gpu, settings, &item)?;
            let fraction = figure.gb_per_s / copy.gb_per_s;
            let of_same_bytes = if size < GIB {
                let peer = match same_bytes.get(&item.moved) {
                    Some(&peer) => peer,
                    None => {
                        let peer = measure(gpu, settings, &memcpy(same_bytes_copy(item.moved)))?;
                        same_bytes.insert(item.moved, peer);
                        peer
                    }
                };
                Some(figure.gb_per_s / peer.gb_per_s)
            } else {
                None
            };
            print_row(
                item.kernel,
                &item.dtype,
                &label,
                figure,
                fraction,
                of_same_bytes,
            );
            if fraction < target(size) {
                short.push(format!("{} {} at {label}", item.kernel, item.dtype));
            }
        }
    }
    let bars = format!(
        "{:.2} of the copy at 1 GiB, {:.2} at 16 MiB",
        target(GIB),
        target(16 * MIB)
    );
    if short.is_empty() {
        println!("every kernel reaches {bars}");
    } else {
        println!("below {bars}: {}", short.join(", "));
    }
    Ok(())
}

/// The bytes of the copy that moves `moved` bytes (half read, half written), rounded down to a
/// multiple of 256: on an H100 the driver copied a layer's 12591846 bytes (an odd count) at 1616
/// GB/s where it copied 12582912 at 1981, which made the layer's batch look faster than it is.
fn same_bytes_copy(moved: usize) -> usize {
    moved / 2 / 256 * 256
}

/// The fraction of the copy's bandwidth every kernel should reach at `size`: below 1 GiB a
/// launch's fixed cost is a part of the copy's time that no kernel can avoid.
fn target(size: usize) -> f64 {
    if size >= GIB { 0.97 } else { 0.90 }
}

#[derive(Clone, Copy)]
struct Figure {
    ms: f64,
    gb_per_s: f64,
}

fn print_row(
    kernel: &str,
    dtype: &str,
    size: &str,
    figure: Figure,
    fraction: f64,
    of_same_bytes: Option<f64>,
) {
    let same_bytes = of_same_bytes.map_or_else(|| "-".to_owned(), |f| format!("{f:.3}"));
    println!(
        "{kernel:<12} {dtype:<14} {size:>8} {:>9.4} {:>9.1} {:>8.3} {same_bytes:>10}",
        figure.ms, figure.gb_per_s, fraction
    );
}

/// One call to time. Each buffer set holds `operands` (bytes each, carved from the pool and filled
/// with finite values); `setup` writes a set's tables once, `call` launches on one set.
struct Item {
    kernel: &'static str,
    dtype: String,
    operands: Vec<usize>,
    /// Bytes the call reads plus bytes it writes.
    moved: usize,
    setup: OnSet,
    call: OnSet,
}

impl Item {
    fn new(
        kernel: &'static str,
        dtype: String,
        operands: Vec<usize>,
        moved: usize,
        call: impl Fn(&Gpu, &[u64]) -> Outcome<()> + 'static,
    ) -> Item {
        Item {
            kernel,
            dtype,
            operands,
            moved,
            setup: Box::new(|_, _| Ok(())),
            call: Box::new(call),
        }
    }
}

/// Device memory for the bench, freed on drop.
struct Device {
    ptr: u64,
}

impl Device {
    /// `bytes` bytes of 0x3F: finite, positive values in every dtype (0.75 as f32, 1.8 as f16).
    fn alloc(stream: &CudaStream, bytes: usize) -> Outcome<Device> {
        // SAFETY: a fresh allocation, freed on drop.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }?;
        let device = Device { ptr };
        // SAFETY: `ptr` holds `bytes` bytes.
        unsafe { result::memset_d8_async(ptr, 0x3F, bytes, stream.cu_stream()) }?;
        Ok(device)
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // Drop cannot report an error; the memory is freed after the wait either way.
        let _ = self.stream.synchronize();
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: allocated by `alloc`, freed once; the `Gpu` holding it waited for its stream.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

fn upload(gpu: &Gpu, ptr: u64, bytes: &[u8]) -> Outcome<()> {
    // SAFETY: `ptr` is a table operand sized for `bytes`; the sync keeps `bytes` alive until done.
    unsafe { result::memcpy_htod_async(ptr, bytes, gpu.stream.cu_stream()) }?;
    gpu.stream.synchronize()?;
    Ok(())
}

/// Bytes an operand takes in the pool: its own, rounded up so that the next one starts at 256.
fn carved(bytes: usize) -> usize {
    bytes.max(1).div_ceil(256) * 256
}

/// How many buffer sets `item` rotates over: enough to defeat the L2.
fn set_count(item: &Item) -> usize {
    let set_bytes: usize = item.operands.iter().map(|&b| carved(b)).sum();
    ROTATION_BYTES.div_ceil(set_bytes).clamp(1, 64)
}

/// The pool bytes `item`'s buffer sets take.
fn sets_bytes(item: &Item) -> usize {
    set_count(item) * item.operands.iter().map(|&b| carved(b)).sum::<usize>()
}

/// Carves enough buffer sets to defeat the L2 out of the pool, fills them, and times `item` on
/// them in rotation.
fn measure(gpu: &Gpu, settings: &Settings, item: &Item) -> Outcome<Figure> {
    if sets_bytes(item) > gpu.pool_bytes {
        return Err(format!(
            "{} {}: its buffer sets outgrow the pool",
            item.kernel, item.dtype
        )
        .into());
    }
    let mut at = gpu.pool.ptr;
    let mut sets = Vec::new();
    for _ in 0..set_count(item) {
        let mut addresses = Vec::new();
        for &bytes in &item.operands {
            // SAFETY: the pool holds the item's sets (checked above), carved in `sets_bytes`' order.
            unsafe { result::memset_d8_async(at, 0x3F, bytes, gpu.stream.cu_stream()) }?;
            addresses.push(at);
            at += carved(bytes) as u64;
        }
        (item.setup)(gpu, &addresses)?;
        sets.push(addresses);
    }
    gpu.stream.synchronize()?;
    let ms = time(gpu, settings, &sets, &item.call)?;
    Ok(Figure {
        ms,
        gb_per_s: item.moved as f64 / (ms * 1e-3) / 1e9,
    })
}

/// The median milliseconds of one call, each repetition between its own pair of events.
fn time(gpu: &Gpu, settings: &Settings, sets: &[Vec<u64>], call: &OnSet) -> Outcome<f64> {
    let mut set = sets.iter().cycle();
    for _ in 0..settings.warmup {
        call(gpu, set.next().ok_or("no buffer set")?)?;
    }
    let mut events = Vec::new();
    for _ in 0..settings.reps {
        let start = gpu
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        let end = gpu
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
        events.push((start, end));
    }
    // Busy the stream while the repetitions are queued, so that they run back to back and no
    // figure includes the host's launch latency.
    // SAFETY: the gate holds GATE_BYTES bytes.
    unsafe { result::memset_d8_async(gpu.gate.ptr, 0, GATE_BYTES, gpu.stream.cu_stream()) }?;
    for (start, end) in &events {
        start.record(&gpu.stream)?;
        call(gpu, set.next().ok_or("no buffer set")?)?;
        end.record(&gpu.stream)?;
    }
    gpu.stream.synchronize()?;
    let mut ms = Vec::new();
    for (start, end) in &events {
        ms.push(f64::from(start.elapsed_ms(end)?));
    }
    ms.sort_by(f64::total_cmp);
    Ok(ms[ms.len() / 2])
}

/// The peer every kernel is compared with: a device-to-device copy of `size` bytes.
fn memcpy(size: usize) -> Item {
    Item::new(
        "cuMemcpyDtoD",
        "bytes".into(),
        vec![size, size],
        2 * size,
        move |gpu, a| {
            // SAFETY: both operands hold `size` bytes.
            unsafe { result::memcpy_dtod_async(a[1], a[0], size, gpu.stream.cu_stream()) }?;
            Ok(())
        },
    )
}

/// Every kernel and dtype combination with a `size`-byte output.
fn items(size: usize) -> Vec<Item> {
    let mut items = Vec::new();
    for dtype in DTYPES {
        items.push(copy(size, dtype));
    }
    items.push(fill_zero(size));
    for from in DTYPES {
        for to in DTYPES.into_iter().filter(|&to| to != from) {
            items.push(cast(size, from, to));
        }
    }
    for src in DTYPES {
        for add in [false, true] {
            items.push(accumulate(size, (src, DType::F32), add));
        }
    }
    // A gradient written into a bf16 transport slot.
    for src in [DType::Bf16, DType::F32] {
        items.push(accumulate(size, (src, DType::Bf16), false));
    }
    items.push(accumulate_layer(size));
    items.push(accumulate_one_span(size));
    for param in DTYPES {
        items.push(adamw(size, param));
    }
    for param in DTYPES {
        items.push(sgd(size, param));
    }
    for dtype in DTYPES {
        items.push(pack(size, dtype, true));
        items.push(pack(size, dtype, false));
    }
    for dtype in [DType::F32, DType::Bf16] {
        for count in [2, 8] {
            items.push(reduce_sum(size, dtype, count));
        }
    }
    items
}

fn copy(size: usize, dtype: DType) -> Item {
    let n = size / dtype.size();
    Item::new(
        "copy",
        dtype.to_string(),
        vec![size, size],
        2 * size,
        move |gpu, a| {
            // SAFETY: both operands hold `n` elements of `dtype`.
            Ok(unsafe { gpu.kernels.copy(&gpu.stream, dtype, a[0], a[1], n) }?)
        },
    )
}

fn fill_zero(size: usize) -> Item {
    Item::new(
        "fill_zero",
        "bytes".into(),
        vec![size],
        size,
        move |gpu, a| {
            // SAFETY: the operand holds `size` bytes.
            Ok(unsafe { gpu.kernels.fill_zero(&gpu.stream, a[0], size) }?)
        },
    )
}

/// The fill's peer: the driver's `cuMemsetD8Async` of the same bytes.
fn memset(size: usize) -> Item {
    Item::new(
        "cuMemsetD8",
        "bytes".into(),
        vec![size],
        size,
        move |gpu, a| {
            // SAFETY: the operand holds `size` bytes.
            unsafe { result::memset_d8_async(a[0], 0, size, gpu.stream.cu_stream()) }?;
            Ok(())
        },
    )
}

fn cast(size: usize, from: DType, to: DType) -> Item {
    let n = size / to.size();
    let operands = vec![n * from.size(), size];
    let moved = n * (from.size() + to.size());
    Item::new(
        "cast",
        format!("{from} -> {to}"),
        operands,
        moved,
        move |gpu, a| {
            // SAFETY: each operand holds `n` elements of its dtype.
            Ok(unsafe { gpu.kernels.cast(&gpu.stream, from, a[0], to, a[1], n) }?)
        },
    )
}

fn accumulate(size: usize, (src, dst): (DType, DType), add: bool) -> Item {
    let n = size / dst.size();
    let operands = vec![n * src.size(), size];
    let moved = n * (src.size() + dst.size() + if add { dst.size() } else { 0 });
    let what = format!("{dst} {} {src}", if add { "+=" } else { "=" });
    Item::new("accumulate", what, operands, moved, move |gpu, a| {
        // SAFETY: `src` holds `n` elements of its dtype, `dst` `n` of its own.
        Ok(unsafe {
            gpu.kernels
                .accumulate(&gpu.stream, (src, dst), a[0], a[1], n, 0.5, add)
        }?)
    })
}

/// A layer's bf16 gradients (the params of [`Layer`], from 13 tensors of three sizes) written
/// into an f32 shard by one `accumulate_many` call, as a unit's gradients are handed over.
fn accumulate_layer(size: usize) -> Item {
    let layer = Layer::new(size / DType::F32.size(), DType::Bf16);
    let spans = layer
        .params
        .iter()
        .map(|&(at, offset, numel, _)| (at, offset, numel))
        .collect();
    accumulate_batch("f32 = bf16, a layer", spans)
}

/// The same bytes as one span of one `accumulate_many` call: what a batch's table and its span
/// lookup cost beside [`accumulate`] of the same pair, apart from the layer's many spans.
fn accumulate_one_span(size: usize) -> Item {
    let numel = size / DType::F32.size();
    accumulate_batch("f32 = bf16, one span", vec![(0, 0, numel)])
}

/// One `accumulate_many` call of bf16 gradients into f32, `dst = 0.5 * src`, over `spans`:
/// (element in the bf16 arena, element in the f32 flat buffer, elements), each destination apart.
fn accumulate_batch(what: &str, spans: Vec<(usize, usize, usize)>) -> Item {
    let arena_numel = spans.iter().map(|&(at, _, n)| at + n).max().unwrap_or(0);
    let flat_numel = spans
        .iter()
        .map(|&(_, offset, n)| offset + n)
        .max()
        .unwrap_or(0);
    let moved = spans.iter().map(|&(_, _, n)| n).sum::<usize>() * (2 + 4);
    let operands = vec![arena_numel * 2, flat_numel * 4];
    Item::new(
        "accumulate_many",
        what.into(),
        operands,
        moved,
        move |gpu, a| {
            let entries: Vec<AccumulateEntry> = spans
                .iter()
                .map(|&(at, offset, numel)| AccumulateEntry {
                    src: a[0] + (at * 2) as u64,
                    dst: a[1] + (offset * 4) as u64,
                    n: numel as u64,
                })
                .collect();
            // SAFETY: each entry's source lies in the bf16 arena (a[0]), its destination in the f32
            // flat buffer (a[1]); the destinations do not overlap.
            Ok(unsafe {
                gpu.kernels.accumulate_many(
                    &gpu.stream,
                    (DType::Bf16, DType::F32),
                    &entries,
                    0.5,
                    false,
                )
            }?)
        },
    )
}

/// Optimizer operands: the step's values ([`updating`] writes them; their 48 bytes are not
/// counted), f32 master (the param itself for f32), the f32 state, then a bf16/f16 param; the
/// dtype column says which.
fn optimizer_operands(
    size: usize,
    param: DType,
    f32_state: usize,
) -> (usize, Vec<usize>, usize, String) {
    let n = size / param.size();
    let mut operands = vec![STEP_VALUES_BYTES];
    operands.extend(vec![4 * n; 1 + f32_state]);
    let mut moved = n * 4 * (2 * (1 + f32_state) - 1);
    let what = if param == DType::F32 {
        "f32 (master)".to_owned()
    } else {
        operands.push(size);
        moved += size;
        param.to_string()
    };
    (n, operands, moved, what)
}

/// A group with weight decay at the learning rate.
const GROUP: GroupUpdate = GroupUpdate {
    lr_scale: 1.0,
    decay: true,
};

fn adamw(size: usize, param: DType) -> Item {
    // Reads master, m, v, grad; writes master, m, v and, apart from an f32 param, the param.
    let (n, operands, moved, what) = optimizer_operands(size, param, 3);
    let item = Item::new("adamw", what, operands, moved, move |gpu, a| {
        let param_ptr = a.get(5).copied().unwrap_or(a[1]);
        // SAFETY: every operand holds `n` elements of its dtype, the first the step's values.
        Ok(unsafe {
            gpu.kernels.adamw(
                &gpu.stream,
                param,
                a[1],
                (a[2], a[3], MomentStorage::F32),
                a[4],
                param_ptr,
                n,
                (a[0], GROUP),
            )
        }?)
    });
    updating(item)
}

fn sgd(size: usize, param: DType) -> Item {
    // Reads master and grad; writes master and, apart from an f32 param, the param.
    let (n, operands, moved, what) = optimizer_operands(size, param, 1);
    let item = Item::new("sgd", what, operands, moved, move |gpu, a| {
        let param_ptr = a.get(3).copied().unwrap_or(a[1]);
        // SAFETY: every operand holds `n` elements of its dtype, the first the step's values.
        Ok(unsafe {
            gpu.kernels
                .sgd(&gpu.stream, param, a[1], a[2], param_ptr, n, (a[0], GROUP))
        }?)
    });
    updating(item)
}

/// `item` (an optimizer's) with the values of a step that updates written into its first
/// operand: the pool's fill bytes would read as a step the device skips, which moves nothing.
fn updating(mut item: Item) -> Item {
    let values = StepValues {
        bias1: 0.1,
        step: 10,
        lr: 1e-4,
        weight_decay: 0.01,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        sqrt_bias2: 0.1,
        grad_scale: 1.0,
        skip: 0,
    };
    item.setup = Box::new(move |gpu, a| upload(gpu, a[0], bytemuck::bytes_of(&values)));
    item
}

/// A transformer layer's params in about `n` elements: four d x d attention weights, two
/// d x 4d MLP weights, six d-vectors and a 4d-vector. Each param sits at a 256-byte aligned
/// address of an arena, and is padded in the flat buffer to 256 bytes, as the plan does.
struct Layer {
    /// Elements: arena offset, flat offset, numel, padded.
    params: Vec<(usize, usize, usize, usize)>,
    arena_numel: usize,
    flat_numel: usize,
}

impl Layer {
    fn new(n: usize, dtype: DType) -> Layer {
        let d = ((n / 12) as f64).sqrt() as usize;
        let align = 256 / dtype.size();
        let mut numels = vec![d * d; 4];
        numels.extend([4 * d * d; 2]);
        numels.extend([d; 6]);
        numels.push(4 * d);
        let (mut arena, mut flat) = (0, 0);
        let mut params = Vec::new();
        for numel in numels {
            let padded = numel.div_ceil(align) * align;
            params.push((arena, flat, numel, padded));
            arena += padded;
            flat += padded;
        }
        Layer {
            params,
            arena_numel: arena,
            flat_numel: flat,
        }
    }

    fn numel(&self) -> usize {
        self.params.iter().map(|p| p.2).sum()
    }

    /// The pack entries of params in the arena at `arena`.
    fn entries(&self, arena: u64, dtype: DType) -> Vec<PackEntry> {
        let entry = |&(at, offset, numel, padded): &(usize, usize, usize, usize)| PackEntry {
            ptr: arena + (at * dtype.size()) as u64,
            offset: offset as u64,
            numel: numel as u64,
            padded: padded as u64,
        };
        self.params.iter().map(entry).collect()
    }
}

/// Pack (params into the flat buffer, padding zeroed) or unpack (back out), one call per layer.
fn pack(size: usize, dtype: DType, packing: bool) -> Item {
    let layer = Layer::new(size / dtype.size(), dtype);
    let w = dtype.size();
    let operands = vec![layer.arena_numel * w, layer.flat_numel * w];
    let moved = if packing {
        (layer.numel() + layer.flat_numel) * w
    } else {
        2 * layer.numel() * w
    };
    let kernel = if packing { "pack" } else { "unpack" };
    Item::new(kernel, dtype.to_string(), operands, moved, move |gpu, a| {
        let entries = layer.entries(a[0], dtype);
        // SAFETY: the entries lie in the arena (a[0]) and tile the flat buffer (a[1]).
        let done = unsafe {
            if packing {
                gpu.kernels.pack(&gpu.stream, dtype, &entries, a[1])
            } else {
                gpu.kernels.unpack(&gpu.stream, dtype, &entries, a[1])
            }
        };
        Ok(done?)
    })
}

fn reduce_sum(size: usize, dtype: DType, count: usize) -> Item {
    let n = size / dtype.size();
    let mut operands = vec![size; count + 1];
    operands.push(8 * count);
    let moved = (count + 1) * size;
    let mut item = Item::new(
        "reduce_sum",
        format!("{dtype} x{count}"),
        operands,
        moved,
        move |gpu, a| {
            // SAFETY: the table (last operand) holds the `count` source addresses, each of `n`
            // elements of `dtype`, and a[count] is the destination.
            Ok(unsafe {
                gpu.kernels
                    .reduce_sum(&gpu.stream, dtype, a[count + 1], count, a[count], n, 0.25)
            }?)
        },
    );
    item.setup = Box::new(move |gpu, a| {
        let table: Vec<u8> = a[..count].iter().flat_map(|p| p.to_le_bytes()).collect();
        upload(gpu, a[count + 1], &table)
    });
    item
}
