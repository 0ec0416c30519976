//! The kernels against the host arithmetic (`crate::optim`, `half`), bit for bit.
//!
//! Every run draws fresh random inputs (the seed is printed; `FSDP_TEST_SEED=<n>` replays a run),
//! places each operand at an element offset inside a larger allocation filled with 0xFF bytes,
//! and checks every element of every operand (inputs must come back unchanged) and the poisoned
//! guards around them. Inputs come from a counter-based generator, so buffers of a GiB are
//! generated, uploaded and checked chunk by chunk, on all host cores, in little host memory.
//!
//! All but the first test need a GPU: `cargo test -- --include-ignored` on a machine with one.

use std::ops::Range;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use cudarc::driver::{CudaContext, CudaStream, result};
use half::{bf16, f16};

use super::*;
use crate::optim::{
    GroupSettings, MomentStorage, OptimizerConfig, Update, accumulate_element, adamw_element,
    bf16_stochastic, moment_seed, rounding_bits, sgd_element,
};

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
/// Element offsets of the operands, by operand (cycling): shared phases take the vector path
/// with a scalar head and tail, different phases take the scalar path.
const OFFSETS: [&[u64]; 7] = [&[0], &[3], &[5], &[1, 0], &[0, 5], &[4, 0], &[2, 7]];
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

// ---------------------------------------------------------------------------------------------
// Element-wise kernels: operands side by side, one host reference per element.

struct Operand {
    dtype: DType,
    /// Elements before the operand, inside its allocation.
    offset: u64,
    /// The input, or `None` for an output that starts poisoned.
    fill: Option<Fill>,
    seed: u64,
}

impl Operand {
    fn initial(&self, i: u64) -> u32 {
        match self.fill {
            Some(fill) => generate(fill, self.dtype, self.seed, i),
            None => mask(self.dtype.size()),
        }
    }
}

/// One launch over `n` elements. `expect` turns the operands' initial values at one index (its
/// first argument) into their final values (inputs are left as they are).
struct Case<'a> {
    what: String,
    n: u64,
    operands: Vec<Operand>,
    expect: &'a (dyn Fn(u64, &mut [u32]) + Sync),
}

impl Case<'_> {
    /// Operands of `dtypes` and `fills` at the offsets of `pattern`.
    fn operands(gpu: &Gpu, pattern: &[u64], specs: &[(DType, Option<Fill>)]) -> Vec<Operand> {
        specs
            .iter()
            .enumerate()
            .map(|(j, &(dtype, fill))| Operand {
                dtype,
                offset: pattern[j % pattern.len()],
                fill,
                seed: hash(gpu.seed, j as u64 + 1000),
            })
            .collect()
    }
}

/// Places the operands, runs `launch` with their start addresses, and checks every element of
/// every operand and of its guards.
fn run_case(gpu: &Gpu, case: &Case<'_>, launch: impl FnOnce(&[u64]) -> Result<()>) {
    let n = case.n;
    let buffers: Vec<DeviceBuffer> = case
        .operands
        .iter()
        .map(|op| DeviceBuffer::poisoned(gpu, (op.offset + n + GUARD) * op.dtype.size() as u64))
        .collect();
    let starts: Vec<u64> = case
        .operands
        .iter()
        .zip(&buffers)
        .map(|(op, buf)| buf.ptr + op.offset * op.dtype.size() as u64)
        .collect();
    for (op, &start) in case.operands.iter().zip(&starts) {
        if op.fill.is_some() {
            upload_generated(gpu, start, op.dtype.size(), n, |i| op.initial(i));
        }
    }
    launch(&starts).unwrap_or_else(|e| panic!("{}: launch failed: {e}", case.what));
    gpu.sync();

    for (op, buf) in case.operands.iter().zip(&buffers) {
        let width = op.dtype.size();
        let before = Span {
            start: 0,
            len: op.offset,
            content: Content::Poison,
        };
        let after = Span {
            start: op.offset + n,
            len: GUARD,
            content: Content::Poison,
        };
        check_spans(gpu, buf.ptr, width, &[before, after], &case.what);
    }
    let mut chunks: Vec<Vec<u8>> = vec![Vec::new(); case.operands.len()];
    for first in (0..n).step_by(CHUNK as usize) {
        let len = CHUNK.min(n - first);
        for ((op, &start), bytes) in case.operands.iter().zip(&starts).zip(&mut chunks) {
            let width = op.dtype.size();
            bytes.resize(len as usize * width, 0);
            gpu.download(start + first * width as u64, bytes);
        }
        let failure = par_check(len as usize, |range| {
            let mut values = [0u32; MAX_OPERANDS];
            for k in range {
                let i = first + k as u64;
                for (value, op) in values.iter_mut().zip(&case.operands) {
                    *value = op.initial(i);
                }
                (case.expect)(i, &mut values[..case.operands.len()]);
                for (j, (op, bytes)) in case.operands.iter().zip(&chunks).enumerate() {
                    let width = op.dtype.size();
                    let got = decode(&bytes[k * width..(k + 1) * width]);
                    if got != values[j] {
                        return Some(format!(
                            "operand {j} ({}) element {i}: got {got:#x}, expected {:#x}",
                            op.dtype, values[j]
                        ));
                    }
                }
            }
            None
        });
        if let Some(failure) = failure {
            panic!("{} (n = {n}, seed {}): {failure}", case.what, gpu.seed);
        }
    }
}

/// Runs `case_at(pattern, n)` for every offset pattern and size of [`SIZES`].
fn for_small_cases(mut case_at: impl FnMut(&[u64], u64)) {
    for pattern in OFFSETS {
        for n in SIZES {
            case_at(pattern, n);
        }
    }
}

fn copy_case(gpu: &Gpu, dtype: DType, pattern: &[u64], n: u64) {
    let case = Case {
        what: format!("copy {dtype} at offsets {pattern:?}"),
        n,
        operands: Case::operands(gpu, pattern, &[(dtype, Some(Fill::Bits)), (dtype, None)]),
        expect: &|_, v| v[1] = v[0],
    };
    run_case(gpu, &case, |s| unsafe {
        gpu.kernels.copy(&gpu.stream, dtype, s[0], s[1], n as usize)
    });
}

fn cast_case(gpu: &Gpu, from: DType, to: DType, pattern: &[u64], n: u64) {
    // A same-dtype cast is a copy: every bit pattern, signalling NaNs included, goes through.
    let expect = move |_: u64, v: &mut [u32]| {
        v[1] = if from == to {
            v[0]
        } else {
            from_f32(to, to_f32(from, v[0]))
        };
    };
    let case = Case {
        what: format!("cast {from} -> {to} at offsets {pattern:?}"),
        n,
        operands: Case::operands(gpu, pattern, &[(from, Some(Fill::Bits)), (to, None)]),
        expect: &expect,
    };
    run_case(gpu, &case, |s| unsafe {
        gpu.kernels
            .cast(&gpu.stream, from, s[0], to, s[1], n as usize)
    });
}

/// The destinations an accumulation rounds into.
const ACCUMULATORS: [DType; 2] = [DType::F32, DType::Bf16];

fn accumulate_case(gpu: &Gpu, (src, dst): (DType, DType), add: bool, pattern: &[u64], n: u64) {
    let scale = if add { 1.0f32 / 3.0 } else { 0.7 };
    let dst_fill = add.then_some(Fill::Finite);
    let expect = move |_: u64, v: &mut [u32]| {
        let out = accumulate_element(to_f32(dst, v[1]), to_f32(src, v[0]), scale, add);
        v[1] = from_f32(dst, out);
    };
    let case = Case {
        what: format!("accumulate {src} into {dst} (add: {add}) at offsets {pattern:?}"),
        n,
        operands: Case::operands(gpu, pattern, &[(src, Some(Fill::Finite)), (dst, dst_fill)]),
        expect: &expect,
    };
    run_case(gpu, &case, |s| unsafe {
        gpu.kernels
            .accumulate(&gpu.stream, (src, dst), s[0], s[1], n as usize, scale, add)
    });
}

/// Step 7's coefficients with gradients scaled by 0.75, as clipping scales them.
fn adamw_coefficients() -> AdamwCoefficients {
    let clipped = GroupSettings {
        grad_scale: 0.75,
        ..GroupSettings::default()
    };
    let Update::AdamW(c) = OptimizerConfig::default().coefficients(7, clipped) else {
        unreachable!("the default optimizer is AdamW")
    };
    c
}

/// `aliased`: an f32 param that is its own master copy; `moments` as the kernel stores them.
fn adamw_case(
    gpu: &Gpu,
    (param, aliased, moments): (DType, bool, MomentStorage),
    pattern: &[u64],
    n: u64,
) {
    let c = adamw_coefficients();
    let f32_in = (DType::F32, Some(Fill::Finite));
    let moment = moments.dtype();
    let mut specs = vec![
        f32_in,
        (moment, Some(Fill::Finite)),
        (moment, Some(Fill::Positive)),
        f32_in,
    ];
    if !aliased {
        specs.push((param, None));
    }
    let expect = move |i: u64, v: &mut [u32]| {
        let widen = |bits: u32| match moment {
            DType::Bf16 => half::bf16::from_bits(bits as u16).to_f32(),
            _ => f32::from_bits(bits),
        };
        let (p, m, s) = adamw_element(
            f32::from_bits(v[0]),
            widen(v[1]),
            widen(v[2]),
            f32::from_bits(v[3]),
            &c,
        );
        v[0] = p.to_bits();
        (v[1], v[2]) = match moments {
            MomentStorage::F32 => (m.to_bits(), s.to_bits()),
            MomentStorage::Bf16Stochastic { seed, first_index } => {
                let round = |x, which| {
                    u32::from(bf16_stochastic(
                        x,
                        rounding_bits(seed, first_index + i, which),
                    ))
                };
                (round(m, 0), round(s, 1))
            }
        };
        if !aliased {
            v[4] = from_f32(param, p);
        }
    };
    let case = Case {
        what: format!(
            "adamw {param} (aliased: {aliased}, moments {moments:?}) at offsets {pattern:?}"
        ),
        n,
        operands: Case::operands(gpu, pattern, &specs),
        expect: &expect,
    };
    run_case(gpu, &case, |s| {
        let param_ptr = if aliased { s[0] } else { s[4] };
        unsafe {
            gpu.kernels.adamw(
                &gpu.stream,
                param,
                s[0],
                (s[1], s[2], moments),
                s[3],
                param_ptr,
                n as usize,
                &c,
            )
        }
    });
}

fn sgd_case(gpu: &Gpu, param: DType, aliased: bool, pattern: &[u64], n: u64) {
    let (lr, weight_decay, grad_scale) = (0.01f32, 0.1f32, 0.75f32);
    let f32_in = (DType::F32, Some(Fill::Finite));
    let mut specs = vec![f32_in, f32_in];
    if !aliased {
        specs.push((param, None));
    }
    let expect = move |_: u64, v: &mut [u32]| {
        let g = f32::from_bits(v[1]);
        let p = sgd_element(f32::from_bits(v[0]), g, lr, weight_decay, grad_scale);
        v[0] = p.to_bits();
        if !aliased {
            v[2] = from_f32(param, p);
        }
    };
    let case = Case {
        what: format!("sgd {param} (aliased: {aliased}) at offsets {pattern:?}"),
        n,
        operands: Case::operands(gpu, pattern, &specs),
        expect: &expect,
    };
    run_case(gpu, &case, |s| {
        let param_ptr = if aliased { s[0] } else { s[2] };
        unsafe {
            gpu.kernels.sgd(
                &gpu.stream,
                param,
                s[0],
                s[1],
                param_ptr,
                n as usize,
                (lr, weight_decay, grad_scale),
            )
        }
    });
}

/// `count` sources of `dtype`, each scaled by `scale`, summed in f32 into a destination of
/// their own, or into source `into`, rounded once.
#[allow(clippy::too_many_arguments)]
fn reduce_sum_case(
    gpu: &Gpu,
    dtype: DType,
    count: usize,
    into: Option<usize>,
    scale: f32,
    pattern: &[u64],
    n: u64,
) {
    let mut specs = vec![(dtype, Some(Fill::Finite)); count];
    if into.is_none() {
        specs.push((dtype, None));
    }
    let expect = move |_: u64, v: &mut [u32]| {
        let sum = v[1..count]
            .iter()
            .fold(scale * to_f32(dtype, v[0]), |acc, &x| {
                acc + scale * to_f32(dtype, x)
            });
        v[into.unwrap_or(count)] = from_f32(dtype, sum);
    };
    let case = Case {
        what: format!(
            "reduce_sum of {count} {dtype} scaled by {scale} into {into:?} at offsets {pattern:?}"
        ),
        n,
        operands: Case::operands(gpu, pattern, &specs),
        expect: &expect,
    };
    let table = DeviceBuffer::poisoned(gpu, 8 * count as u64);
    run_case(gpu, &case, |s| {
        let addresses: Vec<u8> = s[..count].iter().flat_map(|a| a.to_le_bytes()).collect();
        gpu.upload(table.ptr, &addresses);
        let dst = s[into.unwrap_or(count)];
        unsafe {
            gpu.kernels
                .reduce_sum(&gpu.stream, dtype, table.ptr, count, dst, n as usize, scale)
        }
    });
}

/// Elements of `dtype` in 1 GiB.
fn gib_of(dtype: DType) -> u64 {
    GIB / dtype.size() as u64
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn copy_matches_the_host() {
    let gpu = gpu();
    for dtype in DTYPES {
        for_small_cases(|pattern, n| copy_case(&gpu, dtype, pattern, n));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn copy_one_gib() {
    let gpu = gpu();
    for dtype in DTYPES {
        copy_case(&gpu, dtype, &[3], gib_of(dtype));
    }
    // The scalar path, where the phases differ, over a GiB too.
    copy_case(&gpu, DType::Bf16, &[1, 0], gib_of(DType::Bf16));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cast_matches_the_host() {
    let gpu = gpu();
    for from in DTYPES {
        for to in DTYPES {
            for_small_cases(|pattern, n| cast_case(&gpu, from, to, pattern, n));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cast_one_gib() {
    let gpu = gpu();
    for from in DTYPES {
        for to in DTYPES.into_iter().filter(|&to| to != from) {
            cast_case(&gpu, from, to, &[3], gib_of(to));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn accumulate_matches_the_host() {
    let gpu = gpu();
    for src in DTYPES {
        for dst in ACCUMULATORS {
            for add in [false, true] {
                for_small_cases(|pattern, n| accumulate_case(&gpu, (src, dst), add, pattern, n));
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn accumulate_one_gib() {
    let gpu = gpu();
    for src in DTYPES {
        for dst in ACCUMULATORS {
            for add in [false, true] {
                accumulate_case(&gpu, (src, dst), add, &[3], gib_of(DType::F32));
            }
        }
    }
}

/// An f32 accumulation of more than 2^31 elements (8 GiB a buffer): an index or a size that
/// wraps at 32 bits shows as a wrong or missing element.
#[test]
#[ignore = "needs a CUDA GPU"]
fn accumulate_past_2_pow_31_elements() {
    let gpu = gpu();
    accumulate_case(&gpu, (DType::F32, DType::F32), true, &[3], (1 << 31) + 5);
}

/// A bf16 to f32 cast of more than 2^32 elements (8 GiB in, 16 GiB out).
#[test]
#[ignore = "needs a CUDA GPU"]
fn cast_bf16_to_f32_past_2_pow_32_elements() {
    let gpu = gpu();
    cast_case(&gpu, DType::Bf16, DType::F32, &[3], (1 << 32) + 3);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn adamw_matches_the_host() {
    let gpu = gpu();
    // Elements far into a shard of a large group: the index's high word reaches the hash.
    let bf16 = MomentStorage::Bf16Stochastic {
        seed: moment_seed(7, 3),
        first_index: (5 << 32) + 11,
    };
    for moments in [MomentStorage::F32, bf16] {
        for param in DTYPES {
            for_small_cases(|pattern, n| adamw_case(&gpu, (param, false, moments), pattern, n));
        }
        for_small_cases(|pattern, n| adamw_case(&gpu, (DType::F32, true, moments), pattern, n));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn adamw_one_gib() {
    let gpu = gpu();
    let bf16 = MomentStorage::Bf16Stochastic {
        seed: moment_seed(1, 0),
        first_index: 0,
    };
    for moments in [MomentStorage::F32, bf16] {
        for param in DTYPES {
            adamw_case(&gpu, (param, false, moments), &[3], gib_of(param));
        }
        adamw_case(&gpu, (DType::F32, true, moments), &[3], gib_of(DType::F32));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sgd_matches_the_host() {
    let gpu = gpu();
    for param in DTYPES {
        for_small_cases(|pattern, n| sgd_case(&gpu, param, false, pattern, n));
    }
    for_small_cases(|pattern, n| sgd_case(&gpu, DType::F32, true, pattern, n));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sgd_one_gib() {
    let gpu = gpu();
    for param in DTYPES {
        sgd_case(&gpu, param, false, &[3], gib_of(param));
    }
    sgd_case(&gpu, DType::F32, true, &[3], gib_of(DType::F32));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn reduce_sum_matches_the_host() {
    let gpu = gpu();
    for dtype in ACCUMULATORS {
        for count in [1, 2, 3, 8] {
            for into in [None, Some(0), Some(count - 1)] {
                for scale in [1.0, 0.125, 1.0 / 3.0] {
                    for_small_cases(|pattern, n| {
                        reduce_sum_case(&gpu, dtype, count, into, scale, pattern, n)
                    });
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn reduce_sum_one_gib() {
    let gpu = gpu();
    reduce_sum_case(&gpu, DType::F32, 4, None, 0.25, &[3], gib_of(DType::F32));
    reduce_sum_case(&gpu, DType::F32, 2, Some(1), 1.0, &[3], gib_of(DType::F32));
    reduce_sum_case(
        &gpu,
        DType::Bf16,
        8,
        Some(3),
        0.125,
        &[3],
        gib_of(DType::Bf16),
    );
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

/// Counts the non-finite values among `n` f32 of every bit pattern, at element `offset`, into a
/// counter that starts at 5 (the kernel adds to it).
fn count_nonfinite_case(gpu: &Gpu, offset: u64, n: u64) {
    let seed = gpu.seed ^ 0xC0FF_EE00 ^ n;
    let buf = DeviceBuffer::poisoned(gpu, (offset + n) * 4);
    let start = buf.ptr + offset * 4;
    upload_generated(gpu, start, 4, n, |i| {
        generate(Fill::Bits, DType::F32, seed, i)
    });
    let counter = DeviceBuffer::poisoned(gpu, 8);
    gpu.upload(counter.ptr, &5u64.to_le_bytes());
    unsafe {
        gpu.kernels
            .count_nonfinite(&gpu.stream, start, n as usize, counter.ptr)
    }
    .expect("count_nonfinite");
    gpu.sync();
    let mut got = [0u8; 8];
    gpu.download(counter.ptr, &mut got);
    let want = (0..n)
        .filter(|&i| !f32::from_bits(generate(Fill::Bits, DType::F32, seed, i)).is_finite())
        .count() as u64;
    assert_eq!(
        u64::from_le_bytes(got),
        5 + want,
        "count_nonfinite of {n} f32 at +{offset} (seed {seed})"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn count_nonfinite_counts_every_infinity_and_nan() {
    let gpu = gpu();
    for offset in [0, 1, 3] {
        for n in SIZES {
            count_nonfinite_case(&gpu, offset, n);
        }
    }
    count_nonfinite_case(&gpu, 3, gib_of(DType::F32));
}

/// The sum of squares and largest magnitude of `n` f32 at element `offset` (finite values, or
/// every bit pattern when `bits`), added to a part that starts at (2.5, bits of 0.25).
fn norm_partials_case(gpu: &Gpu, offset: u64, n: u64, bits: bool) {
    let fill = if bits { Fill::Bits } else { Fill::Finite };
    let seed = gpu.seed ^ 0x0042_0042 ^ n;
    let buf = DeviceBuffer::poisoned(gpu, (offset + n) * 4);
    let start = buf.ptr + offset * 4;
    upload_generated(gpu, start, 4, n, |i| generate(fill, DType::F32, seed, i));
    let part = DeviceBuffer::poisoned(gpu, 16);
    let mut initial = 2.5f64.to_le_bytes().to_vec();
    initial.extend(0.25f32.to_bits().to_le_bytes());
    initial.extend([0u8; 4]);
    gpu.upload(part.ptr, &initial);
    unsafe {
        gpu.kernels
            .norm_partials(&gpu.stream, start, n as usize, part.ptr)
    }
    .expect("norm_partials");
    gpu.sync();
    let mut got = [0u8; 16];
    gpu.download(part.ptr, &mut got);
    let values = (0..n).map(|i| f32::from_bits(generate(fill, DType::F32, seed, i)));
    let want_sum = 2.5
        + values
            .clone()
            .map(|x| f64::from(x) * f64::from(x))
            .sum::<f64>();
    let want_max = values
        .map(|x| x.to_bits() & 0x7FFF_FFFF)
        .fold(0.25f32.to_bits(), u32::max);
    let sum = f64::from_le_bytes(got[..8].try_into().expect("8 bytes"));
    let max = u32::from_le_bytes(got[8..12].try_into().expect("4 bytes"));
    let what = format!("norm_partials of {n} f32 at +{offset} (seed {seed})");
    assert_eq!(max, want_max, "{what}: largest magnitude");
    if want_sum.is_finite() {
        // The device adds in another order. Each order's sum of these non-negative terms is
        // within (n - 1) f64 epsilons (relative) of the exact one, so the two within twice that.
        let bound = 2.0 * n as f64 * f64::EPSILON;
        assert!(
            (sum - want_sum).abs() <= bound * want_sum,
            "{what}: {sum} != {want_sum}"
        );
    } else {
        assert_eq!(
            sum.is_nan(),
            want_sum.is_nan(),
            "{what}: {sum} != {want_sum}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn norm_partials_sum_squares_in_f64_and_keep_the_largest_magnitude() {
    let gpu = gpu();
    for offset in [0, 1, 3] {
        for n in SIZES {
            norm_partials_case(&gpu, offset, n, false);
            norm_partials_case(&gpu, offset, n, true);
        }
    }
    norm_partials_case(&gpu, 3, gib_of(DType::F32), false);
}

fn fill_zero_case(gpu: &Gpu, offset: u64, bytes: u64) {
    let buf = DeviceBuffer::poisoned(gpu, offset + bytes + GUARD);
    unsafe {
        gpu.kernels
            .fill_zero(&gpu.stream, buf.ptr + offset, bytes as usize)
    }
    .expect("fill_zero");
    gpu.sync();
    let spans = [
        Span {
            start: 0,
            len: offset,
            content: Content::Poison,
        },
        Span {
            start: offset,
            len: bytes,
            content: Content::Zero,
        },
        Span {
            start: offset + bytes,
            len: GUARD,
            content: Content::Poison,
        },
    ];
    check_spans(
        gpu,
        buf.ptr,
        1,
        &spans,
        &format!("fill_zero of {bytes} bytes at +{offset}"),
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fill_zero_writes_exactly_its_bytes() {
    let gpu = gpu();
    for offset in [0, 1, 3, 5, 8, 15] {
        for bytes in SIZES.into_iter().chain([15, 16, 17, 33]) {
            fill_zero_case(&gpu, offset, bytes);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fill_zero_one_gib() {
    let gpu = gpu();
    fill_zero_case(&gpu, 3, GIB);
}

/// Params of `numels` packed into a flat buffer and unpacked into fresh storage. Params sit at
/// gaps of random length in their arena; every even-numbered one shares the alignment phase of
/// its place in the flat buffer (the vector path), the others mostly do not. Paddings are random,
/// zero included, and the flat buffer starts 3 elements into its allocation.
fn pack_case(gpu: &Gpu, dtype: DType, numels: &[u64]) {
    let width = dtype.size();
    let per_vector = 16 / width as u64;
    let lead = 3;
    let mut entries = Vec::new();
    let mut arena_spans = Vec::new();
    let (mut flat_end, mut arena_end) = (0u64, 0u64);
    for (k, &numel) in numels.iter().enumerate() {
        let h = hash(gpu.seed, k as u64 + 7000);
        let at = if k % 2 == 0 {
            arena_end + (lead + flat_end + per_vector - arena_end % per_vector) % per_vector
        } else {
            arena_end + h % per_vector
        };
        let padded = numel + (h >> 8) % 9;
        let seed = hash(gpu.seed, k as u64 + 9000);
        arena_spans.push(Span {
            start: arena_end,
            len: at - arena_end,
            content: Content::Poison,
        });
        arena_spans.push(Span {
            start: at,
            len: numel,
            content: Content::Data { seed },
        });
        entries.push((at, flat_end, numel, padded, seed));
        flat_end += padded;
        arena_end = at + numel;
    }
    arena_spans.push(Span {
        start: arena_end,
        len: GUARD,
        content: Content::Poison,
    });
    let arena_bytes = (arena_end + GUARD) * width as u64;
    let what = format!(
        "pack {dtype} of {} params, {flat_end} elements",
        numels.len()
    );

    let arena = DeviceBuffer::poisoned(gpu, arena_bytes);
    for span in &arena_spans {
        if let Content::Data { .. } = span.content {
            upload_span(gpu, arena.ptr, width, span);
        }
    }
    let table_for = |base: u64| -> Vec<u8> {
        entries
            .iter()
            .flat_map(|&(at, offset, numel, padded, _)| {
                [base + at * width as u64, offset, numel, padded]
            })
            .flat_map(u64::to_le_bytes)
            .collect()
    };
    let table = DeviceBuffer::poisoned(gpu, 32 * entries.len() as u64);
    gpu.upload(table.ptr, &table_for(arena.ptr));
    let flat = DeviceBuffer::poisoned(gpu, (lead + flat_end + GUARD) * width as u64);
    let flat_ptr = flat.ptr + lead * width as u64;
    unsafe {
        gpu.kernels.pack(
            &gpu.stream,
            dtype,
            table.ptr,
            entries.len(),
            flat_ptr,
            flat_end as usize,
        )
    }
    .expect("pack");
    gpu.sync();

    let mut flat_spans = vec![Span {
        start: 0,
        len: lead,
        content: Content::Poison,
    }];
    for &(_, offset, numel, padded, seed) in &entries {
        flat_spans.push(Span {
            start: lead + offset,
            len: numel,
            content: Content::Data { seed },
        });
        flat_spans.push(Span {
            start: lead + offset + numel,
            len: padded - numel,
            content: Content::Zero,
        });
    }
    flat_spans.push(Span {
        start: lead + flat_end,
        len: GUARD,
        content: Content::Poison,
    });
    check_spans(gpu, flat.ptr, width, &flat_spans, &what);

    let unpacked = DeviceBuffer::poisoned(gpu, arena_bytes);
    gpu.upload(table.ptr, &table_for(unpacked.ptr));
    unsafe {
        gpu.kernels
            .unpack(&gpu.stream, dtype, table.ptr, entries.len(), flat_ptr)
    }
    .expect("unpack");
    gpu.sync();
    check_spans(gpu, unpacked.ptr, width, &arena_spans, &format!("un{what}"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pack_and_unpack_round_trip() {
    let gpu = gpu();
    for dtype in DTYPES {
        // Each size alone, then all of them among many small odd-sized params.
        for numel in SIZES {
            pack_case(&gpu, dtype, &[numel]);
        }
        let mut numels: Vec<u64> = (0..40)
            .map(|k| 1 + 2 * (hash(gpu.seed, k) % 3000))
            .collect();
        numels.extend(SIZES);
        numels.rotate_left(17);
        pack_case(&gpu, dtype, &numels);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn pack_and_unpack_one_gib() {
    let gpu = gpu();
    for dtype in DTYPES {
        let small: Vec<u64> = SIZES.into_iter().chain([999, 12_345]).collect();
        let big = gib_of(dtype) - small.iter().sum::<u64>() - 8 * small.len() as u64;
        let numels: Vec<u64> = [big].into_iter().chain(small).collect();
        pack_case(&gpu, dtype, &numels);
    }
}

// ---------------------------------------------------------------------------------------------
// Errors and no-ops.

#[test]
#[ignore = "needs a CUDA GPU"]
fn misaligned_addresses_are_refused_before_launch() {
    let gpu = gpu();
    let buf = DeviceBuffer::poisoned(&gpu, 256);
    let (p, odd) = (buf.ptr, buf.ptr + 2);
    let k = &gpu.kernels;
    let s = &gpu.stream;
    let c = adamw_coefficients();
    let bf16_moments = MomentStorage::Bf16Stochastic {
        seed: 1,
        first_index: 0,
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
                &c,
            ),
            k.adamw(
                s,
                DType::Bf16,
                p,
                (p + 64, p + 1, bf16_moments),
                p + 128,
                p + 192,
                4,
                &c,
            ),
            k.sgd(s, DType::F16, p, p + 64, p + 129, 4, (0.1, 0.0, 1.0)),
            k.pack(s, DType::F32, p + 4, 1, p + 64, 4),
            k.unpack(s, DType::F32, p, 1, odd),
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
    let c = adamw_coefficients();
    for dtype in DTYPES {
        unsafe {
            k.copy(s, dtype, 0, 0, 0).expect("copy");
            k.cast(s, dtype, 0, DType::F32, 0, 0).expect("cast");
            for dst in ACCUMULATORS {
                k.accumulate(s, (dtype, dst), 0, 0, 0, 1.0, true)
                    .expect("accumulate");
            }
            k.adamw(s, dtype, 0, (0, 0, MomentStorage::F32), 0, 0, 0, &c)
                .expect("adamw");
            k.sgd(s, dtype, 0, 0, 0, 0, (0.1, 0.0, 1.0)).expect("sgd");
            k.pack(s, dtype, 0, 0, 0, 0).expect("pack");
            k.unpack(s, dtype, 0, 0, 0).expect("unpack");
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
