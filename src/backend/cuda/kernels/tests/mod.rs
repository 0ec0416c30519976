//! The kernels against the host arithmetic (`crate::optim`, `half`), bit for bit.
//!
//! Every run draws fresh random inputs (the seed is printed; `FSDP_TEST_SEED=<n>` replays a run),
//! places each operand at an element offset inside a larger allocation filled with 0xFF bytes,
//! and checks every element of every operand (inputs must come back unchanged) and the poisoned
//! guards around them. Inputs come from a counter-based generator, so buffers of a GiB are
//! generated, uploaded and checked chunk by chunk, on all host cores, in little host memory.
//!
//! All but the first test need a GPU: `cargo test -- --include-ignored` on a machine with one.
//! `elementwise`: the kernels that map operands side by side; `layout`: the ones that read or
//! write a buffer as spans (packing, zero fills, counts and norms).

use std::ops::Range;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use cudarc::driver::{CudaContext, CudaStream, result};
use half::{bf16, f16};

use super::*;
use crate::optim::{
    GroupUpdate, MomentStorage, OptimizerConfig, OptimizerKind, STEP_VALUES_BYTES, Update,
    accumulate_element, adamw_element, bf16_stochastic, moment_seed, rounding_bits, sgd_element,
};

#[test]
fn element_wise_grids_give_each_thread_one_round_and_reductions_fill_the_gpu_once() {
    // A bf16 cast's round: two 16-byte vectors of its widest operand, 16 elements.
    let round = round_elements(ROUND, 2);
    assert_eq!(round, 16);
    let per_block = BLOCK as usize * 16;
    assert_eq!(elementwise_grid(1, round), 1);
    assert_eq!(elementwise_grid(per_block, round), 1);
    assert_eq!(elementwise_grid(per_block + 1, round), 2);
    // 1 GiB of bf16: far past a full GPU's grid.
    assert_eq!(
        elementwise_grid(1 << 29, round),
        (1 << 29) / per_block as u32
    );
    // Past the largest grid the kernels stride over the rest.
    assert_eq!(elementwise_grid(usize::MAX, round), MAX_GRID);
    let kernel = Kernel {
        function: std::ptr::null_mut(),
        full_grid: 1056,
    };
    assert_eq!(kernel.reduction_grid(1 << 29), 1056);
    assert_eq!(kernel.reduction_grid(1), 1);
}

#[test]
fn rounds_are_the_kernels_own() {
    use DType::{Bf16, F16, F32};
    // Two chunks where one operand is loaded and a 16-bit one converted; else one.
    assert_eq!(accumulate_round_elements((Bf16, F32), false), 8);
    assert_eq!(accumulate_round_elements((F16, F32), false), 8);
    assert_eq!(accumulate_round_elements((Bf16, F32), true), 4);
    assert_eq!(accumulate_round_elements((F32, F32), false), 4);
    assert_eq!(accumulate_round_elements((F32, Bf16), false), 8);
    assert_eq!(accumulate_round_elements((F32, Bf16), true), 4);
    // Between 16-bit types a chunk is 8 elements.
    assert_eq!(accumulate_round_elements((Bf16, Bf16), false), 16);
    assert_eq!(accumulate_round_elements((F16, Bf16), true), 8);
    assert_eq!(OPTIMIZER_ROUND, 1);
    assert_eq!(sum_round(F32), 1);
    assert_eq!(sum_round(Bf16), 2);
    assert_eq!(round_elements(MOVE_ROUND, 1), 16);
    // Pack and unpack: two rounds of one chunk, one after the other.
    assert_eq!(MOVE_SPAN_ROUNDS * round_elements(MOVE_ROUND, 2), 16);
    // The `_wave` twins: four chunks, 16 f32 or 32 bf16.
    assert_eq!(round_elements(WAVE_ROUND, 4), 16);
    assert_eq!(round_elements(WAVE_ROUND, 2), 32);
}

#[test]
fn a_batch_of_spans_gives_each_span_the_blocks_of_its_own_length() {
    let span = |n| super::Span { src: 0, dst: 0, n };
    // A block per 100 elements.
    let blocks = |n: u64| n.div_ceil(100) as u32;
    let first = first_blocks(&[span(1), span(0), span(250), span(100)], blocks).unwrap();
    // One block ahead of the bodies takes the four spans' edges.
    assert_eq!(first[..5], [1, 2, 2, 5, 6]);
    // The grid's size in every unused place, where the kernel's lookup stops.
    assert!(first[5..].iter().all(|&b| b == 6), "{first:?}");
    // Nine spans' edges take two blocks.
    let nine = first_blocks(&[span(100); 9], blocks).unwrap();
    assert_eq!(nine[..10], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
    // No element, no block: nothing is launched.
    let nothing = first_blocks(&[span(0), span(0)], blocks).unwrap();
    assert!(nothing.iter().all(|&b| b == 0));
    // Blocks past the largest grid are refused, not wrapped.
    let huge = |_: u64| MAX_GRID / 2 + 1;
    assert_eq!(first_blocks(&[span(1), span(1)], huge), None);
}

#[test]
fn a_launch_runs_as_one_wave_where_its_own_grid_takes_more_and_its_twin_s_fits_in_one() {
    let kernel = |full_grid| Kernel {
        function: std::ptr::null_mut(),
        full_grid,
    };
    let wave = kernel(1056);
    let twins = Twins {
        tuned: kernel(1056),
        wave,
    };
    // 16 MiB of f32 copied: 4096 blocks at one chunk a thread, 1024 at four.
    assert!(one_wave(4096, (wave, 1024)));
    assert_eq!(twins.pick(4096, 1024).1, 1024);
    assert!(one_wave(1057, (wave, 1056)));
    // One wave already at the op's own round.
    assert!(!one_wave(1056, (wave, 264)));
    // The twin would take more than a wave too.
    assert!(!one_wave(8192, (wave, 2048)));
    assert_eq!(twins.pick(8192, 2048).1, 8192);
    // The twin's wave decides both sides: fewer resident blocks of it, no twin on a grid of
    // less than a quarter of its wave.
    assert!(!one_wave(4096, (kernel(792), 1024)));
    assert!(!one_wave(792, (kernel(792), 198)));
    assert!(one_wave(793, (kernel(792), 199)));
}

#[test]
fn a_batch_runs_as_its_twin_where_its_table_with_the_edge_blocks_fits_one_wave() {
    let span_kernel = |per_thread| SpanKernel {
        kernel: Kernel {
            function: std::ptr::null_mut(),
            full_grid: 1056,
        },
        per_thread,
        args: &[],
    };
    // 1024 elements a block for the op's own kernel, 4096 for its twin.
    let (tuned, wave) = (span_kernel(4), span_kernel(16));
    let spans = |count, blocks: u64| -> Vec<super::Span> {
        let span = super::Span {
            src: 0,
            dst: 0,
            n: blocks * 4096,
        };
        vec![span; count]
    };
    // Seven spans of 150 twin blocks, after one block of their edges.
    let (chosen, first) = batch_kernel(tuned, Some(wave), &spans(7, 150)).unwrap();
    assert_eq!(chosen.per_thread, 16);
    assert_eq!(first[..8], [1, 151, 301, 451, 601, 751, 901, 1051]);
    // Eight spans of 132: 1056 blocks of bodies fill the wave, and the edges' block is one more.
    let (chosen, first) = batch_kernel(tuned, Some(wave), &spans(8, 132)).unwrap();
    assert_eq!(chosen.per_thread, 4);
    assert_eq!(first[BATCH_SPANS], 1 + 8 * 528);
    // No twin: the op's own kernel.
    let (chosen, _) = batch_kernel(tuned, None, &spans(7, 150)).unwrap();
    assert_eq!(chosen.per_thread, 4);
}

#[test]
fn pack_spans_copy_each_param_zero_its_padding_and_refuse_what_cannot_be_packed() {
    use super::Span as S;
    use super::launches::{pack_spans, unpack_spans};
    let entry = |ptr, offset, numel, padded| PackEntry {
        ptr,
        offset,
        numel,
        padded,
    };
    let flat = 0x1000;
    // Bf16: a param with padding, one at an odd element of its own storage with none, an
    // empty one.
    let entries = [
        entry(0x9000, 0, 3, 8),
        entry(0xA002, 8, 8, 8),
        entry(0, 16, 0, 0),
    ];
    let spans: Vec<S> = pack_spans(DType::Bf16, &entries, flat)
        .collect::<Result<_>>()
        .unwrap();
    assert_eq!(
        spans,
        [
            S {
                src: 0x9000,
                dst: 0x1000,
                n: 3
            },
            S {
                src: 0,
                dst: 0x1006,
                n: 5
            },
            S {
                src: 0xA002,
                dst: 0x1010,
                n: 8
            },
        ]
    );
    let back: Vec<S> = unpack_spans(DType::Bf16, &entries, flat)
        .collect::<Result<_>>()
        .unwrap();
    assert_eq!(
        back,
        [
            S {
                src: 0x1000,
                dst: 0x9000,
                n: 3
            },
            S {
                src: 0x1010,
                dst: 0xA002,
                n: 8
            },
        ]
    );
    // Nothing to move needs no address.
    assert_eq!(pack_spans(DType::F32, &[entry(0, 0, 0, 0)], 0).count(), 0);
    let what = |first: Option<Error>| match first {
        Some(Error::Unsupported {
            backend: "cuda",
            what,
        }) => what,
        other => panic!("{other:?}"),
    };
    let pack = |entries: &[PackEntry], flat| {
        what(pack_spans(DType::F32, entries, flat).find_map(Result::err))
    };
    let unpack = |entries: &[PackEntry], flat| {
        what(unpack_spans(DType::F32, entries, flat).find_map(Result::err))
    };
    for (entries, flat, words) in [
        ([entry(0, 0, 4, 4)], flat, "null parameter"),
        ([entry(0x9000, 0, 4, 4)], 0, "null flat"),
        ([entry(0x9002, 0, 4, 4)], flat, "aligned"),
        ([entry(0x9000, 0, 4, 4)], flat + 2, "aligned"),
        ([entry(0x9000, u64::MAX / 2, 4, 4)], flat, "address space"),
    ] {
        for refused in [pack(&entries, flat), unpack(&entries, flat)] {
            assert!(refused.contains(words), "{refused}");
        }
    }
    // Only a pack writes the padding.
    let short = [entry(0x9000, 0, 4, 2)];
    assert!(pack(&short, flat).contains("padded to fewer"));
    assert_eq!(unpack_spans(DType::F32, &short, flat).count(), 1);
}

#[test]
fn load_fails_cleanly_without_a_gpu_or_kernels() {
    assert!(matches!(available(&[]), Err(Error::KernelsUnavailable)));
    match available(&FATBIN.0) {
        Err(Error::KernelsUnavailable | Error::CudaUnavailable { .. }) => {}
        Err(other) => panic!("unexpected error: {other}"),
        // A driver and kernels are here: with a device, loading must succeed.
        Ok(()) => {
            if let Ok(ctx) = CudaContext::new(0) {
                let kernels = Kernels::load(&ctx).expect("the kernels load on a GPU");
                assert!(kernels.sm_count() > 0);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Fixtures: the device, its memory, the generator.

const DTYPES: [DType; 3] = [DType::Bf16, DType::F16, DType::F32];
/// Element counts every kernel is checked at (besides 1 GiB, in tests of their own).
const SIZES: [u64; 5] = [0, 1, 7, 4095, (1 << 20) + 3];
const GIB: u64 = 1 << 30;
/// The destinations an accumulation rounds into.
const ACCUMULATORS: [DType; 2] = [DType::F32, DType::Bf16];
/// Element offsets of the operands, by operand (cycling): shared phases take the vector path
/// with a scalar head and tail, different phases take the scalar path.
const OFFSETS: [&[u64]; 7] = [&[0], &[3], &[5], &[1, 0], &[0, 5], &[4, 0], &[2, 7]];
/// The offsets the `_wave` twins are checked at: the vector path without and with a head and a
/// tail, and the scalar path.
const ONE_WAVE_OFFSETS: [&[u64]; 3] = [&[0], &[3], &[0, 5]];

/// Whether a batch of `spans` runs as `wave`: the launch's own choice ([`batch_kernel`]).
fn batch_runs_as_twin(tuned: SpanKernel<'_>, wave: SpanKernel<'_>, spans: &[super::Span]) -> bool {
    let (chosen, _) = batch_kernel(tuned, Some(wave), spans).expect("a batch's grid");
    chosen.kernel.function == wave.kernel.function
}

/// Elements of an op that runs as its `_wave` twin: `tuned` is the op's own elements a thread,
/// `wave` the twin and the op's widest operand's bytes. The twin's grid fills its wave but for
/// eight blocks (room for the extra blocks of a batch's spans), and the count is odd; asserted
/// to run as one wave, by the decision and the grids of the launches (the launch itself does not
/// say which kernel ran).
fn runs_as_one_wave(tuned: usize, wave: (Kernel, usize)) -> u64 {
    let per_block = BLOCK as usize * round_elements(WAVE_ROUND, wave.1);
    let blocks = (wave.0.full_grid as usize)
        .checked_sub(8)
        .expect("a GPU of more than 8 resident blocks");
    let n = blocks * per_block - 3;
    let tuned_grid = elementwise_grid(n, tuned);
    let wave_grid = elementwise_grid(n, round_elements(WAVE_ROUND, wave.1));
    assert!(
        one_wave(tuned_grid, (wave.0, wave_grid)),
        "{n} elements: {tuned_grid} blocks, {wave_grid} of the twin's {}",
        wave.0.full_grid
    );
    n as u64
}
/// Poisoned elements checked after each operand.
const GUARD: u64 = 16;
/// Elements per upload, download and check.
const CHUNK: u64 = 1 << 24;
/// Most operands of one kernel: a sum of 8 sources and its destination.
const MAX_OPERANDS: usize = 9;

struct Gpu {
    stream: Arc<CudaStream>,
    kernels: Kernels,
    seed: u64,
}

fn gpu() -> Gpu {
    let ctx = CudaContext::new(0).expect("a CUDA device");
    ctx.bind_to_thread().expect("the context is current");
    let stream = ctx.new_stream().expect("a stream");
    let kernels = Kernels::load(&ctx).expect("the kernels");
    let seed = std::env::var("FSDP_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .expect("a clock");
            now.as_nanos() as u64
        });
    eprintln!("FSDP_TEST_SEED={seed}");
    Gpu {
        stream,
        kernels,
        seed,
    }
}

impl Gpu {
    fn sync(&self) {
        self.stream.synchronize().expect("the stream completes");
    }

    fn upload(&self, ptr: u64, bytes: &[u8]) {
        // SAFETY: `ptr` is inside a live allocation with room for `bytes`; the sync below keeps
        // `bytes` alive until the copy is done.
        unsafe { result::memcpy_htod_async(ptr, bytes, self.stream.cu_stream()) }.expect("upload");
        self.sync();
    }

    fn download(&self, ptr: u64, bytes: &mut [u8]) {
        // SAFETY: as `upload`.
        unsafe { result::memcpy_dtoh_async(bytes, ptr, self.stream.cu_stream()) }
            .expect("download");
        self.sync();
    }
}

/// A plain device allocation (cuMemAlloc), filled with 0xFF bytes.
struct DeviceBuffer {
    ptr: u64,
}

impl DeviceBuffer {
    fn poisoned(gpu: &Gpu, bytes: u64) -> DeviceBuffer {
        let bytes = bytes.max(1) as usize;
        // SAFETY: a fresh allocation, freed on drop.
        let ptr = unsafe { result::malloc_sync(bytes) }.expect("device memory");
        // SAFETY: `ptr` holds `bytes` bytes.
        unsafe { result::memset_d8_async(ptr, 0xFF, bytes, gpu.stream.cu_stream()) }
            .expect("memset");
        gpu.sync();
        DeviceBuffer { ptr }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: allocated by `poisoned`, freed once; the tests synchronize before dropping.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// SplitMix64 of `seed + i`: random access into one random sequence.
fn hash(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add(i.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn mask(width: usize) -> u32 {
    u32::MAX >> (32 - 8 * width)
}

/// What an input holds.
#[derive(Clone, Copy)]
enum Fill {
    /// Any bit pattern: NaNs, infinities, subnormals included. For moves and casts.
    Bits,
    /// Finite values of both signs over a wide range (f32 subnormals included). For arithmetic,
    /// where NaN payloads are not specified.
    Finite,
    /// As `Finite`, never negative: AdamW's second moment.
    Positive,
}

/// Element `i` of the sequence `seed`, as the bits of `dtype`.
fn generate(fill: Fill, dtype: DType, seed: u64, i: u64) -> u32 {
    let h = hash(seed, i);
    if let Fill::Bits = fill {
        return h as u32 & mask(dtype.size());
    }
    // f16 stays within its range so that no input is infinite.
    let (lo, hi) = if dtype == DType::F16 {
        (-26, 15)
    } else {
        (-140, 20)
    };
    let exponent = lo + ((h >> 32) % (hi - lo) as u64) as i32;
    let mantissa = 1.0 + (h & 0x7F_FFFF) as f64 / f64::from(1u32 << 23);
    let magnitude = (mantissa * 2f64.powi(exponent)) as f32;
    let negative = matches!(fill, Fill::Finite) && h >> 63 == 1;
    from_f32(dtype, if negative { -magnitude } else { magnitude })
}

fn to_f32(dtype: DType, bits: u32) -> f32 {
    match dtype {
        DType::Bf16 => bf16::from_bits(bits as u16).to_f32(),
        DType::F16 => f16::from_bits(bits as u16).to_f32(),
        DType::F32 => f32::from_bits(bits),
    }
}

fn from_f32(dtype: DType, x: f32) -> u32 {
    match dtype {
        DType::Bf16 => u32::from(bf16::from_f32(x).to_bits()),
        DType::F16 => u32::from(f16::from_f32(x).to_bits()),
        DType::F32 => x.to_bits(),
    }
}

fn encode(bits: u32, width: usize, out: &mut [u8]) {
    out.copy_from_slice(&bits.to_le_bytes()[..width]);
}

fn decode(bytes: &[u8]) -> u32 {
    let mut word = [0u8; 4];
    word[..bytes.len()].copy_from_slice(bytes);
    u32::from_le_bytes(word)
}

/// Runs `check` over `0..len` split among the host's cores; the first failure, if any.
fn par_check(len: usize, check: impl Fn(Range<usize>) -> Option<String> + Sync) -> Option<String> {
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let per = len.div_ceil(threads).max(1 << 14);
    std::thread::scope(|s| {
        let parts: Vec<_> = (0..len)
            .step_by(per)
            .map(|a| {
                let check = &check;
                s.spawn(move || check(a..(a + per).min(len)))
            })
            .collect();
        parts
            .into_iter()
            .find_map(|p| p.join().expect("a checker thread"))
    })
}

/// Fills `out` (elements of `width` bytes) with `value(first + k)`, on all cores.
fn par_encode(out: &mut [u8], width: usize, first: u64, value: impl Fn(u64) -> u32 + Sync) {
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let per = (out.len() / width).div_ceil(threads).max(1 << 14) * width;
    std::thread::scope(|s| {
        for (k, part) in out.chunks_mut(per).enumerate() {
            let value = &value;
            s.spawn(move || {
                let start = first + (k * per / width) as u64;
                for (j, element) in part.chunks_exact_mut(width).enumerate() {
                    encode(value(start + j as u64), width, element);
                }
            });
        }
    });
}

/// Uploads `value(i)` for `i` in `0..n` to `ptr`, chunk by chunk.
fn upload_generated(gpu: &Gpu, ptr: u64, width: usize, n: u64, value: impl Fn(u64) -> u32 + Sync) {
    let mut bytes = Vec::new();
    for first in (0..n).step_by(CHUNK as usize) {
        let len = CHUNK.min(n - first);
        bytes.resize(len as usize * width, 0);
        par_encode(&mut bytes, width, first, &value);
        gpu.upload(ptr + first * width as u64, &bytes);
    }
}

/// Elements of `dtype` in 1 GiB.
fn gib_of(dtype: DType) -> u64 {
    GIB / dtype.size() as u64
}

/// A group at 0.3 of the learning rate (not exact in f32, so that the product's rounding shows),
/// with weight decay.
const SCALED_LR: GroupUpdate = GroupUpdate {
    lr_scale: 0.3,
    decay: true,
};

/// A group at the learning rate, without weight decay.
const NO_DECAY: GroupUpdate = GroupUpdate {
    lr_scale: 1.0,
    decay: false,
};

/// `optimizer`'s values of step `step` with gradients scaled by 0.75, as clipping scales them,
/// in a device buffer of their own, written by the kernel the engine writes them with.
fn step_values(gpu: &Gpu, optimizer: OptimizerConfig, step: u64) -> (StepValues, DeviceBuffer) {
    let values = optimizer.step_values(step, 0.75);
    let buf = DeviceBuffer::poisoned(gpu, STEP_VALUES_BYTES as u64);
    // SAFETY: the buffer holds the values.
    unsafe { gpu.kernels.write_step_values(&gpu.stream, buf.ptr, &values) }
        .expect("write_step_values");
    gpu.sync();
    (values, buf)
}

// ---------------------------------------------------------------------------------------------
// Layout checks: a buffer as a run of spans of known content.

#[derive(Clone, Copy)]
enum Content {
    Poison,
    Zero,
    /// `Fill::Bits` of sequence `seed` from element 0.
    Data {
        seed: u64,
    },
}

/// Elements `start..start + len` of a buffer.
#[derive(Clone, Copy)]
struct Span {
    start: u64,
    len: u64,
    content: Content,
}

impl Span {
    fn expected(&self, width: usize, k: u64) -> u32 {
        match self.content {
            Content::Poison => mask(width),
            Content::Zero => 0,
            Content::Data { seed } => hash(seed, k) as u32 & mask(width),
        }
    }
}

fn upload_span(gpu: &Gpu, base: u64, width: usize, span: &Span) {
    upload_generated(
        gpu,
        base + span.start * width as u64,
        width,
        span.len,
        |k| span.expected(width, k),
    );
}

/// Checks every element of every span of the buffer at `base`, chunk by chunk.
fn check_spans(gpu: &Gpu, base: u64, width: usize, spans: &[Span], what: &str) {
    let mut bytes = Vec::new();
    for span in spans {
        for first in (0..span.len).step_by(CHUNK as usize) {
            let len = CHUNK.min(span.len - first);
            bytes.resize(len as usize * width, 0);
            gpu.download(base + (span.start + first) * width as u64, &mut bytes);
            let failure = par_check(len as usize, |range| {
                range.into_iter().find_map(|k| {
                    let got = decode(&bytes[k * width..(k + 1) * width]);
                    let want = span.expected(width, first + k as u64);
                    (got != want).then(|| {
                        format!(
                            "element {} of the buffer: got {got:#x}, expected {want:#x}",
                            span.start + first + k as u64
                        )
                    })
                })
            });
            if let Some(failure) = failure {
                panic!("{what} (seed {}): {failure}", gpu.seed);
            }
        }
    }
}

mod elementwise;
mod layout;

// ---------------------------------------------------------------------------------------------
// Errors and no-ops.

#[test]
#[ignore = "needs a CUDA GPU"]
fn step_values_come_back_as_written() {
    let gpu = gpu();
    for optimizer in [OptimizerConfig::default(), OptimizerConfig::sgd(0.5)] {
        let (values, buf) = step_values(&gpu, optimizer, (5 << 32) + 7);
        let mut back = [0u8; STEP_VALUES_BYTES];
        gpu.download(buf.ptr, &mut back);
        assert_eq!(back, bytemuck::bytes_of(&values), "{optimizer:?}");
    }
}

/// Norm parts of ranks as the device keeps them, 16 bytes a rank: the f64 sum of squares, the
/// u32 bits of the largest magnitude, 4 bytes unused.
fn norm_part_bytes(parts: &[(f64, f32)]) -> Vec<u8> {
    let part = |&(sum, max): &(f64, f32)| {
        let mut p = sum.to_le_bytes().to_vec();
        p.extend(max.to_bits().to_le_bytes());
        p.extend([0u8; 4]);
        p
    };
    parts.iter().flat_map(part).collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_clipping_coefficient_is_the_host_s() {
    let gpu = gpu();
    let cases: [&[(f64, f32)]; 4] = [
        &[(0.1, 0.3)],
        &[(9.0, 2.0), (16.0, 3.5), (1e-9, 1e-5)],
        &[(1e-14, 1e-7), (2e-14, 1e-7)],
        &[(f64::NAN, f32::NAN), (1.0, 1.0)],
    ];
    for parts in cases {
        let bytes = norm_part_bytes(parts);
        let buf = DeviceBuffer::poisoned(&gpu, bytes.len() as u64);
        gpu.upload(buf.ptr, &bytes);
        let norm = crate::engine::GradNorm::of_parts(bytes.chunks_exact(16));
        for max_norm in [0.5f32, 1.0, 1e6] {
            let (mut values, device) = step_values(&gpu, OptimizerConfig::default(), 7);
            // SAFETY: the parts and the values are in live buffers of their sizes.
            unsafe {
                gpu.kernels.clip_step_values(
                    &gpu.stream,
                    (buf.ptr, parts.len()),
                    max_norm,
                    device.ptr,
                )
            }
            .expect("clip_step_values");
            let mut back = [0u8; STEP_VALUES_BYTES];
            gpu.download(device.ptr, &mut back);
            values.grad_scale = norm.clip_coefficient(max_norm);
            let got: StepValues = bytemuck::pod_read_unaligned(&back);
            // NaN payloads are not specified: a NaN is a NaN.
            let (got_scale, want) = (got.grad_scale, values.grad_scale);
            assert!(
                got_scale.to_bits() == want.to_bits() || (got_scale.is_nan() && want.is_nan()),
                "{parts:?}, {max_norm}: {got_scale} against {want}"
            );
            assert_eq!(
                bytemuck::bytes_of(&got)[..40],
                bytemuck::bytes_of(&values)[..40]
            );
        }
    }
}

/// Launches `skip_nonfinite_step` on the step's values in `values`, deciding from the norm parts
/// `bytes` of `ranks` ranks, with `count` skips before; the count it leaves.
fn decide(gpu: &Gpu, values: &DeviceBuffer, (bytes, ranks): (&[u8], usize), count: u64) -> u64 {
    let parts = DeviceBuffer::poisoned(gpu, bytes.len() as u64);
    gpu.upload(parts.ptr, bytes);
    let skipped = DeviceBuffer::poisoned(gpu, 8);
    gpu.upload(skipped.ptr, &count.to_le_bytes());
    // SAFETY: the parts, the count and the values are in live buffers of their sizes.
    unsafe {
        gpu.kernels
            .skip_nonfinite_step(&gpu.stream, (parts.ptr, ranks), skipped.ptr, values.ptr)
    }
    .expect("skip_nonfinite_step");
    let mut back = [0u8; 8];
    gpu.download(skipped.ptr, &mut back);
    u64::from_le_bytes(back)
}

/// Marks the step's values in `values` skipped, as the device does where a rank's gradients hold
/// a NaN.
fn skip_on_device(gpu: &Gpu, values: &DeviceBuffer) {
    let nan = norm_part_bytes(&[(1.0, 1.0), (f64::NAN, f32::NAN)]);
    assert_eq!(decide(gpu, values, (&nan, 2), 0), 1, "the skip counted");
}

/// The device skips a step where the host would ([`crate::engine::GradNorm::is_finite`] of the
/// combined parts), counts it, and leaves the rest of the step's values as written.
#[test]
#[ignore = "needs a CUDA GPU"]
fn the_skip_decision_is_the_host_s() {
    let gpu = gpu();
    let cases: [&[(f64, f32)]; 7] = [
        &[(0.1, 0.3)],
        &[(9.0, 2.0), (16.0, 3.5), (1e-9, 1e-5)],
        &[(f64::NAN, f32::NAN), (1.0, 1.0)],
        &[(1.0, 1.0), (2.0, f32::INFINITY)],
        // Finite values whose 2-norm overflows f32.
        &[(1e77, 1e38), (1e77, 1e38)],
        &[(0.0, 0.0)],
        &[(1.0, 1.0), (f64::INFINITY, 1.0)],
    ];
    for parts in cases {
        let bytes = norm_part_bytes(parts);
        let skip = !crate::engine::GradNorm::of_parts(bytes.chunks_exact(16)).is_finite();
        let (mut written, values) = step_values(&gpu, OptimizerConfig::default(), 7);
        let count = decide(&gpu, &values, (&bytes, parts.len()), 5);
        let mut back = [0u8; STEP_VALUES_BYTES];
        gpu.download(values.ptr, &mut back);
        let got: StepValues = bytemuck::pod_read_unaligned(&back);
        written.skip = u32::from(skip);
        assert_eq!(
            bytemuck::bytes_of(&got),
            bytemuck::bytes_of(&written),
            "{parts:?}: the step's values"
        );
        assert_eq!(count, 5 + u64::from(skip), "{parts:?}: the skip count");
    }
}

/// Counting `k` skipped steps out of step `s`'s values gives the host's values of step `s - k`,
/// bias corrections bit for bit, for AdamW and SGD; no skip leaves them as written.
#[test]
#[ignore = "needs a CUDA GPU"]
fn counting_skips_out_gives_the_host_s_step_values() {
    let gpu = gpu();
    let adamw = OptimizerConfig::default();
    for optimizer in [adamw, OptimizerConfig::sgd(0.5)] {
        for (step, skipped) in [(7, 0), (7, 1), (7, 6), (1000, 3), ((5 << 32) + 7, 3 << 32)] {
            let (_, device) = step_values(&gpu, optimizer, step);
            let count = DeviceBuffer::poisoned(&gpu, 8);
            gpu.upload(count.ptr, &u64::to_le_bytes(skipped));
            // SAFETY: the count and the values are in live buffers of their sizes.
            unsafe {
                gpu.kernels
                    .correct_step_values(&gpu.stream, count.ptr, device.ptr)
            }
            .expect("correct_step_values");
            let mut back = [0u8; STEP_VALUES_BYTES];
            gpu.download(device.ptr, &mut back);
            let want = optimizer.step_values(step - skipped, 0.75);
            assert_eq!(
                back,
                bytemuck::bytes_of(&want),
                "{optimizer:?}: step {step}, {skipped} skipped"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn misaligned_addresses_are_refused_before_launch() {
    let gpu = gpu();
    let buf = DeviceBuffer::poisoned(&gpu, 256);
    let (p, odd) = (buf.ptr, buf.ptr + 2);
    let k = &gpu.kernels;
    let s = &gpu.stream;
    let values = (p, SCALED_LR);
    let bf16_moments = MomentStorage::Bf16Stochastic {
        group: 1,
        first_index: 0,
    };
    let entry = |ptr| PackEntry {
        ptr,
        offset: 0,
        numel: 4,
        padded: 4,
    };
    let results = unsafe {
        [
            k.copy(s, DType::F32, odd, p, 4),
            k.copy(s, DType::Bf16, p + 1, p + 64, 4),
            k.cast(s, DType::Bf16, p, DType::F32, odd, 4),
            k.accumulate(s, (DType::Bf16, DType::F32), p, odd, 4, 1.0, true),
            k.accumulate(s, (DType::F32, DType::Bf16), p, p + 1, 4, 1.0, true),
            k.adamw(
                s,
                DType::Bf16,
                p,
                (p + 64, odd, MomentStorage::F32),
                p + 128,
                p + 192,
                4,
                values,
            ),
            k.adamw(
                s,
                DType::Bf16,
                p,
                (p + 64, p + 1, bf16_moments),
                p + 128,
                p + 192,
                4,
                values,
            ),
            k.sgd(s, DType::F16, p, p + 64, p + 129, 4, values),
            k.sgd(s, DType::F32, p, p + 64, p + 128, 4, (odd, SCALED_LR)),
            k.write_step_values(s, p + 4, &OptimizerConfig::default().step_values(1, 1.0)),
            k.pack(s, DType::F32, &[entry(odd)], p + 64),
            k.pack(s, DType::F32, &[entry(p)], odd),
            k.unpack(s, DType::F32, &[entry(p)], odd),
            k.unpack(s, DType::F32, &[entry(odd)], p + 64),
            k.reduce_sum(s, DType::F32, p + 4, 1, p + 64, 4, 1.0),
            k.reduce_sum(s, DType::Bf16, p, 1, p + 65, 4, 1.0),
        ]
    };
    for (i, r) in results.into_iter().enumerate() {
        assert!(
            matches!(r, Err(Error::Unsupported { backend: "cuda", what }) if what.contains("aligned")),
            "call {i}: {r:?}"
        );
    }
    gpu.sync();
}

/// A param or a flat buffer with no address would be read as zeros, and padding shorter than its
/// data would wrap: each is refused before anything is launched.
#[test]
#[ignore = "needs a CUDA GPU"]
fn pack_entries_with_no_address_or_less_padding_than_data_are_refused() {
    let gpu = gpu();
    let flat = DeviceBuffer::poisoned(&gpu, 64);
    let null = PackEntry {
        ptr: 0,
        offset: 0,
        numel: 4,
        padded: 4,
    };
    let short_of = |padded| PackEntry {
        ptr: flat.ptr + 32,
        offset: 0,
        numel: 4,
        padded,
    };
    let short = short_of(2);
    let (k, s) = (&gpu.kernels, &gpu.stream);
    let results = unsafe {
        [
            k.pack(s, DType::F32, &[null], flat.ptr),
            k.unpack(s, DType::F32, &[null], flat.ptr),
            k.pack(s, DType::F32, &[short], flat.ptr),
            k.pack(s, DType::F32, &[short_of(4)], 0),
            k.unpack(s, DType::F32, &[short_of(4)], 0),
        ]
    };
    let whats: Vec<_> = results
        .into_iter()
        .map(|r| match r {
            Err(Error::Unsupported {
                backend: "cuda",
                what,
            }) => what,
            other => panic!("{other:?}"),
        })
        .collect();
    assert!(
        whats[0].contains("null") && whats[1].contains("null"),
        "{whats:?}"
    );
    assert!(whats[2].contains("padded to fewer"), "{whats:?}");
    assert!(
        whats[3..].iter().all(|w| w.contains("null flat")),
        "{whats:?}"
    );
    gpu.sync();
    check_spans(
        &gpu,
        flat.ptr,
        1,
        &[Span {
            start: 0,
            len: 64,
            content: Content::Poison,
        }],
        "the flat buffer after refused packs",
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_sum_of_no_sources_is_refused() {
    let gpu = gpu();
    let buf = DeviceBuffer::poisoned(&gpu, 64);
    let r = unsafe {
        gpu.kernels
            .reduce_sum(&gpu.stream, DType::F32, buf.ptr, 0, buf.ptr + 32, 4, 1.0)
    };
    assert!(
        matches!(r, Err(Error::Unsupported { backend: "cuda", what }) if what.contains("zero sources")),
        "{r:?}"
    );
}

/// Null addresses would fault if anything were launched.
#[test]
#[ignore = "needs a CUDA GPU"]
fn zero_length_calls_launch_nothing() {
    let gpu = gpu();
    let (k, s) = (&gpu.kernels, &gpu.stream);
    let values = (0, SCALED_LR);
    for dtype in DTYPES {
        unsafe {
            k.copy(s, dtype, 0, 0, 0).expect("copy");
            k.cast(s, dtype, 0, DType::F32, 0, 0).expect("cast");
            for dst in ACCUMULATORS {
                k.accumulate(s, (dtype, dst), 0, 0, 0, 1.0, true)
                    .expect("accumulate");
            }
            k.adamw(s, dtype, 0, (0, 0, MomentStorage::F32), 0, 0, 0, values)
                .expect("adamw");
            k.sgd(s, dtype, 0, 0, 0, 0, values).expect("sgd");
            k.pack(s, dtype, &[], 0).expect("pack");
            k.unpack(s, dtype, &[], 0).expect("unpack");
            let empty = PackEntry::default();
            k.pack(s, dtype, &[empty], 0)
                .expect("pack of an empty entry");
            k.unpack(s, dtype, &[empty], 0)
                .expect("unpack of an empty entry");
        }
    }
    unsafe {
        k.fill_zero(s, 0, 0).expect("fill_zero");
        for dtype in ACCUMULATORS {
            k.reduce_sum(s, dtype, 0, 0, 0, 0, 1.0).expect("reduce_sum");
        }
    }
    gpu.sync();
}
