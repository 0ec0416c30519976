//! Element-wise kernels: operands side by side, one host reference per element.

use super::*;

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

/// How an accumulation is launched: whole, or cut into pieces of many lengths (each starting
/// at an element offset of its own) that one `accumulate_many` call runs, in several launches
/// when the pieces are more than a launch takes, or into seven pieces of about a seventh each
/// (one launch).
#[derive(Clone, Copy, Debug)]
enum Launch {
    Whole,
    Pieces,
    Sevenths,
}

/// The pieces of `0..n`, as `(first element, length)`.
fn pieces(n: u64) -> Vec<(u64, u64)> {
    let lengths = [1, 255, 2, 4097, 3, 65537, 129];
    let mut out = Vec::new();
    let mut at = 0;
    for &length in lengths.iter().cycle() {
        if at >= n {
            break;
        }
        let length = length.min(n - at);
        out.push((at, length));
        at += length;
    }
    out
}

/// Seven pieces of `0..n` of about `n / 7` each, every other one starting an element late.
fn sevenths(n: u64) -> Vec<(u64, u64)> {
    let starts: Vec<u64> = (0..7).map(|k| (k * n / 7 + k % 2).min(n)).collect();
    let ends = starts.iter().skip(1).copied().chain([n]);
    starts
        .iter()
        .zip(ends)
        .map(|(&start, end)| (start, end - start))
        .collect()
}

fn accumulate_case(
    gpu: &Gpu,
    (src, dst): (DType, DType),
    (add, launch): (bool, Launch),
    pattern: &[u64],
    n: u64,
) {
    let scale = if add { 1.0f32 / 3.0 } else { 0.7 };
    let dst_fill = add.then_some(Fill::Finite);
    let expect = move |_: u64, v: &mut [u32]| {
        let out = accumulate_element(to_f32(dst, v[1]), to_f32(src, v[0]), scale, add);
        v[1] = from_f32(dst, out);
    };
    let case = Case {
        what: format!(
            "accumulate {src} into {dst} (add: {add}, {launch:?}) at offsets {pattern:?}"
        ),
        n,
        operands: Case::operands(gpu, pattern, &[(src, Some(Fill::Finite)), (dst, dst_fill)]),
        expect: &expect,
    };
    run_case(gpu, &case, |s| match launch {
        Launch::Whole => unsafe {
            gpu.kernels
                .accumulate(&gpu.stream, (src, dst), s[0], s[1], n as usize, scale, add)
        },
        Launch::Pieces | Launch::Sevenths => {
            let parts = match launch {
                Launch::Sevenths => sevenths(n),
                _ => pieces(n),
            };
            let entries: Vec<AccumulateEntry> = parts
                .into_iter()
                .map(|(at, len)| AccumulateEntry {
                    src: s[0] + at * src.size() as u64,
                    dst: s[1] + at * dst.size() as u64,
                    n: len,
                })
                .collect();
            unsafe {
                gpu.kernels
                    .accumulate_many(&gpu.stream, (src, dst), &entries, scale, add)
            }
        }
    });
}

/// `aliased`: an f32 param that is its own master copy; `moments` as the kernel stores them;
/// step `step` of the default AdamW for `group`; `skipped`: the device skipped the step, and
/// every operand stays as it was.
fn adamw_case(
    gpu: &Gpu,
    (param, aliased, moments): (DType, bool, MomentStorage),
    (group, step): (GroupUpdate, u64),
    pattern: &[u64],
    n: u64,
    skipped: bool,
) {
    let (values, device_values) = step_values(gpu, OptimizerConfig::default(), step);
    if skipped {
        skip_on_device(gpu, &device_values);
    }
    let Update::AdamW(c) = group.coefficients(OptimizerKind::AdamW, &values) else {
        unreachable!("AdamW's coefficients")
    };
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
        if skipped {
            return;
        }
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
            MomentStorage::Bf16Stochastic { group, first_index } => {
                let seed = moment_seed(values.step, group as usize);
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
            "adamw {param} (aliased: {aliased}, moments {moments:?}, skipped: {skipped}) at \
             offsets {pattern:?}"
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
                (device_values.ptr, group),
            )
        }
    });
}

/// Step 7 of SGD at 0.01 with weight decay 0.1, for `group`; `skipped` as for AdamW.
fn sgd_case(
    gpu: &Gpu,
    (param, aliased): (DType, bool),
    group: GroupUpdate,
    pattern: &[u64],
    n: u64,
    skipped: bool,
) {
    let sgd = OptimizerConfig::Sgd {
        lr: 0.01,
        weight_decay: 0.1,
    };
    let (values, device_values) = step_values(gpu, sgd, 7);
    if skipped {
        skip_on_device(gpu, &device_values);
    }
    let Update::Sgd {
        lr,
        weight_decay,
        grad_scale,
    } = group.coefficients(OptimizerKind::Sgd, &values)
    else {
        unreachable!("SGD's coefficients")
    };
    let f32_in = (DType::F32, Some(Fill::Finite));
    let mut specs = vec![f32_in, f32_in];
    if !aliased {
        specs.push((param, None));
    }
    let expect = move |_: u64, v: &mut [u32]| {
        if skipped {
            return;
        }
        let g = f32::from_bits(v[1]);
        let p = sgd_element(f32::from_bits(v[0]), g, lr, weight_decay, grad_scale);
        v[0] = p.to_bits();
        if !aliased {
            v[2] = from_f32(param, p);
        }
    };
    let case = Case {
        what: format!(
            "sgd {param} (aliased: {aliased}, skipped: {skipped}) at offsets {pattern:?}"
        ),
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
                (device_values.ptr, group),
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
                for_small_cases(|pattern, n| {
                    accumulate_case(&gpu, (src, dst), (add, Launch::Whole), pattern, n)
                });
            }
        }
    }
}

/// One launch of many accumulations computes each as its own launch does: the pieces start at
/// every alignment phase, and the largest sizes take more pieces than one launch holds.
#[test]
#[ignore = "needs a CUDA GPU"]
fn accumulate_many_matches_the_host() {
    let gpu = gpu();
    assert!(pieces((1 << 20) + 3).len() > 2 * BATCH_SPANS);
    for src in DTYPES {
        for dst in ACCUMULATORS {
            for add in [false, true] {
                for_small_cases(|pattern, n| {
                    accumulate_case(&gpu, (src, dst), (add, Launch::Pieces), pattern, n)
                });
            }
        }
    }
}

/// The `_wave` twins compute what their ops do, at sizes where the launches run them (which
/// `one_wave` decides from the grids asserted here): copies, casts, and accumulations without an
/// addition, whole and as seven pieces of one batched launch.
#[test]
#[ignore = "needs a CUDA GPU"]
fn one_wave_twins_match_the_host() {
    let gpu = gpu();
    let k = &gpu.kernels;
    for dtype in DTYPES {
        let d = dtype_index(dtype);
        let n = runs_as_one_wave(
            round_elements(MOVE_ROUND, dtype.size()),
            (k.copy[d].wave, dtype.size()),
        );
        for pattern in ONE_WAVE_OFFSETS {
            copy_case(&gpu, dtype, pattern, n);
        }
        for to in DTYPES.into_iter().filter(|&to| to != dtype) {
            let wave = k.cast[d][dtype_index(to)]
                .expect("a cast between two dtypes")
                .wave;
            let widest = dtype.size().max(to.size());
            let n = runs_as_one_wave(round_elements(ROUND, widest), (wave, widest));
            for pattern in ONE_WAVE_OFFSETS {
                cast_case(&gpu, dtype, to, pattern, n);
            }
        }
        for dst in ACCUMULATORS {
            let (wave, many) = match dst {
                DType::F32 => (k.accumulate_to_f32[d].wave, k.accumulate_many_to_f32[d]),
                _ => (k.accumulate_to_bf16[d].wave, k.accumulate_many_to_bf16[d]),
            };
            let tuned_elements = accumulate_round_elements((dtype, dst), false);
            let widest = dtype.size().max(dst.size());
            let n = runs_as_one_wave(tuned_elements, (wave, widest));
            // The seven pieces, one batch, run as the batched twin too.
            let pieces: Vec<crate::backend::cuda::kernels::Span> = sevenths(n)
                .into_iter()
                .map(|(_, len)| crate::backend::cuda::kernels::Span {
                    src: 0,
                    dst: 0,
                    n: len,
                })
                .collect();
            let span_kernel = |kernel, per_thread| SpanKernel {
                kernel,
                per_thread,
                args: &[],
            };
            assert!(
                batch_runs_as_twin(
                    span_kernel(many.tuned, tuned_elements),
                    span_kernel(many.wave, round_elements(WAVE_ROUND, widest)),
                    &pieces
                ),
                "{n} elements in seven pieces, {dtype} into {dst}"
            );
            for pattern in ONE_WAVE_OFFSETS {
                for launch in [Launch::Whole, Launch::Sevenths] {
                    accumulate_case(&gpu, (dtype, dst), (false, launch), pattern, n);
                }
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
                accumulate_case(
                    &gpu,
                    (src, dst),
                    (add, Launch::Whole),
                    &[3],
                    gib_of(DType::F32),
                );
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
    accumulate_case(
        &gpu,
        (DType::F32, DType::F32),
        (true, Launch::Whole),
        &[3],
        (1 << 31) + 5,
    );
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
        group: 3,
        first_index: (5 << 32) + 11,
    };
    // The bf16 moments' step past 2^32: its high word reaches the seed.
    let cases = [
        (MomentStorage::F32, (SCALED_LR, 7)),
        (bf16, (NO_DECAY, (3 << 32) + 7)),
    ];
    for (moments, step) in cases {
        for param in DTYPES {
            for_small_cases(|pattern, n| {
                adamw_case(&gpu, (param, false, moments), step, pattern, n, false)
            });
        }
        for_small_cases(|pattern, n| {
            adamw_case(&gpu, (DType::F32, true, moments), step, pattern, n, false)
        });
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn adamw_one_gib() {
    let gpu = gpu();
    let bf16 = MomentStorage::Bf16Stochastic {
        group: 0,
        first_index: 0,
    };
    for moments in [MomentStorage::F32, bf16] {
        for param in DTYPES {
            adamw_case(
                &gpu,
                (param, false, moments),
                (SCALED_LR, 7),
                &[3],
                gib_of(param),
                false,
            );
        }
        adamw_case(
            &gpu,
            (DType::F32, true, moments),
            (SCALED_LR, 7),
            &[3],
            gib_of(DType::F32),
            false,
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sgd_matches_the_host() {
    let gpu = gpu();
    for param in DTYPES {
        for_small_cases(|pattern, n| sgd_case(&gpu, (param, false), SCALED_LR, pattern, n, false));
    }
    for_small_cases(|pattern, n| sgd_case(&gpu, (DType::F32, true), NO_DECAY, pattern, n, false));
}

/// The params an update writes: of each dtype beside its master, and an f32 param that is its own.
const UPDATED: [(DType, bool); 4] = [
    (DType::Bf16, false),
    (DType::F16, false),
    (DType::F32, false),
    (DType::F32, true),
];

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_step_skipped_on_the_device_leaves_every_update_s_memory_as_it_is() {
    let gpu = gpu();
    let bf16 = MomentStorage::Bf16Stochastic {
        group: 1,
        first_index: 0,
    };
    for moments in [MomentStorage::F32, bf16] {
        for (param, aliased) in UPDATED {
            for_small_cases(|pattern, n| {
                adamw_case(
                    &gpu,
                    (param, aliased, moments),
                    (SCALED_LR, 7),
                    pattern,
                    n,
                    true,
                )
            });
        }
    }
    for (param, aliased) in UPDATED {
        for_small_cases(|pattern, n| sgd_case(&gpu, (param, aliased), SCALED_LR, pattern, n, true));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn sgd_one_gib() {
    let gpu = gpu();
    for param in DTYPES {
        sgd_case(&gpu, (param, false), SCALED_LR, &[3], gib_of(param), false);
    }
    sgd_case(
        &gpu,
        (DType::F32, true),
        SCALED_LR,
        &[3],
        gib_of(DType::F32),
        false,
    );
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
