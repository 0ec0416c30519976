//! The kernels that read or write a buffer as spans: counts, norms, zero fills, packing.

use super::*;

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
    let table_for = |base: u64| -> Vec<PackEntry> {
        entries
            .iter()
            .map(|&(at, offset, numel, padded, _)| PackEntry {
                ptr: base + at * width as u64,
                offset,
                numel,
                padded,
            })
            .collect()
    };
    let flat = DeviceBuffer::poisoned(gpu, (lead + flat_end + GUARD) * width as u64);
    let flat_ptr = flat.ptr + lead * width as u64;
    unsafe {
        gpu.kernels
            .pack(&gpu.stream, dtype, &table_for(arena.ptr), flat_ptr)
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
    unsafe {
        gpu.kernels
            .unpack(&gpu.stream, dtype, &table_for(unpacked.ptr), flat_ptr)
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

/// Pack and unpack as their `_wave` twin: one param, then three beside each other.
#[test]
#[ignore = "needs a CUDA GPU"]
fn pack_and_unpack_run_as_one_wave() {
    use crate::backend::cuda::kernels::Span as S;
    use crate::backend::cuda::kernels::launches::{pack_spans, unpack_spans};
    let gpu = gpu();
    for dtype in DTYPES {
        let (tuned, wave) = gpu.kernels.moves_over_spans(dtype);
        let n = runs_as_one_wave(tuned.per_thread, (wave.kernel, dtype.size()));
        for numels in [vec![n], vec![n / 2 + 1, 7, n / 2 - 9]] {
            // The most spans `pack_case` can give these params (every one padded), through the
            // launch's own choice, then the case.
            let entries: Vec<PackEntry> = numels
                .iter()
                .scan(0, |offset, &numel| {
                    let entry = PackEntry {
                        ptr: 1 << 20,
                        offset: *offset,
                        numel,
                        padded: numel + 8,
                    };
                    *offset += numel + 8;
                    Some(entry)
                })
                .collect();
            let flat = 1 << 30;
            let packs: Vec<S> = pack_spans(dtype, &entries, flat)
                .collect::<Result<_>>()
                .expect("pack spans");
            let unpacks: Vec<S> = unpack_spans(dtype, &entries, flat)
                .collect::<Result<_>>()
                .expect("unpack spans");
            for spans in [packs, unpacks] {
                assert!(
                    batch_runs_as_twin(tuned, wave, &spans),
                    "{dtype} {numels:?}"
                );
            }
            pack_case(&gpu, dtype, &numels);
        }
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
