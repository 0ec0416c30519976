//! The CUDA backend against the CPU backend, op by op on the same random data (bit for bit), and
//! its streams, events, host waits, foreign streams and errors. Tests marked "needs a CUDA GPU"
//! run on the GPU machine (`bash .gpu/run-tests.sh`); the others run everywhere.
//!
//! The backends' data operations are `unsafe` because they run after they return: every test
//! here uses each buffer on one stream at a time (or orders the streams with events, where that is
//! what it tests), and reads results with a download, which orders itself after every stream.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use fsdp_fusion::backend::cpu::{CpuBackend, CpuBuffer};
use fsdp_fusion::backend::cuda::{CudaBackend, CudaBuffer, is_driver_present};
use fsdp_fusion::backend::{Backend, Input, Moments, OptimizerShard, Region, StepUpdate};
use fsdp_fusion::comm::loopback::LoopbackComm;
use fsdp_fusion::engine::DeviceTensor;
use fsdp_fusion::optim::{GroupUpdate, MomentStorage, OptimizerKind, STEP_VALUES_BYTES};
use fsdp_fusion::types::Stream;
use fsdp_fusion::{
    DType, Engine, EngineConfig, Error, ModelSpec, OptimizerConfig, ParamSpec, Plan, Unit,
};
use fsdp_fusion_support::rng::Rng;
use fsdp_fusion_support::values::narrow;
use half::bf16;

const DTYPES: [DType; 3] = [DType::Bf16, DType::F16, DType::F32];
const STREAMS: [Stream; 3] = [Stream::Compute, Stream::Gather, Stream::Reduce];

fn gpu() -> CudaBackend {
    CudaBackend::new(0).unwrap_or_else(|e| panic!("a CUDA backend on device 0: {e}"))
}

fn all(len: usize, dtype: DType) -> Region {
    Region::new(0, len, dtype)
}

/// Every byte of a CPU buffer (an even number of them).
fn cpu_download(b: &CpuBackend, buf: &CpuBuffer) -> Vec<u8> {
    let mut out = vec![0u8; buf.len()];
    b.download(buf, all(buf.len() / 2, DType::Bf16), &mut out)
        .unwrap();
    out
}

/// Every byte of `buf` (an even number of them).
fn download(b: &CudaBackend, buf: &CudaBuffer) -> Vec<u8> {
    let bytes = buf.bytes();
    assert_eq!(bytes % 2, 0, "the tests download whole 16-bit elements");
    let mut out = vec![0u8; bytes];
    b.download(buf, all(bytes / 2, DType::Bf16), &mut out)
        .unwrap_or_else(|e| panic!("download of {bytes} bytes: {e}"));
    out
}

/// Panics naming the first differing byte when the two differ.
fn assert_same(expected: &[u8], got: &[u8], what: &str) {
    assert_eq!(expected.len(), got.len(), "{what}: lengths differ");
    if let Some(i) = expected.iter().zip(got).position(|(a, b)| a != b) {
        let differing = expected.iter().zip(got).filter(|(a, b)| a != b).count();
        panic!(
            "{what}: {differing} of {} bytes differ, first at byte {i}: cpu {:#04x}, cuda {:#04x}",
            expected.len(),
            expected[i],
            got[i]
        );
    }
}

/// The same buffer on both backends.
struct Twin {
    cpu: CpuBuffer,
    gpu: CudaBuffer,
}

/// The two backends, to run each op on both.
struct Both {
    cpu: CpuBackend,
    gpu: CudaBackend,
}

impl Both {
    fn new() -> Both {
        Both {
            cpu: CpuBackend::new(),
            gpu: gpu(),
        }
    }

    /// A buffer holding `bytes` (elements of `dtype`) on both backends.
    fn twin(&self, dtype: DType, bytes: &[u8]) -> Twin {
        let mut t = Twin {
            cpu: self.cpu.alloc(bytes.len()).unwrap(),
            gpu: self.gpu.alloc(bytes.len()).unwrap(),
        };
        let region = all(bytes.len() / dtype.size(), dtype);
        self.cpu.upload(&mut t.cpu, region, bytes).unwrap();
        self.gpu.upload(&mut t.gpu, region, bytes).unwrap();
        t
    }

    fn zeros(&self, bytes: usize) -> Twin {
        self.twin(DType::F32, &vec![0u8; bytes])
    }

    fn assert_same(&self, t: &Twin, what: &str) {
        assert_same(
            &cpu_download(&self.cpu, &t.cpu),
            &download(&self.gpu, &t.gpu),
            what,
        );
    }
}

#[test]
fn without_a_driver_constructors_report_cuda_unavailable() {
    if is_driver_present() {
        eprintln!("a CUDA driver is installed: covered by the GPU tests");
        return;
    }
    // SAFETY: 0 is the legacy default stream, alive for the whole process.
    for result in [CudaBackend::new(0), unsafe {
        CudaBackend::with_raw_stream(0, 0)
    }] {
        match result {
            Err(Error::CudaUnavailable { reason }) => {
                assert!(reason.contains("libcuda"), "{reason}")
            }
            Err(other) => panic!("expected CudaUnavailable, got {other:?}"),
            Ok(_) => panic!("a CUDA backend without a driver"),
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_device_that_does_not_exist_is_a_cuda_error() {
    match CudaBackend::new(100_000) {
        Err(Error::Cuda { call, code, .. }) => assert_eq!((call, code), ("cuDeviceGet", 101)),
        Err(other) => panic!("expected Error::Cuda, got {other:?}"),
        Ok(_) => panic!("a backend on device 100000"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn allocations_start_zeroed_and_are_counted_while_they_live() {
    let b = gpu();
    let x = b.alloc(100).unwrap();
    let y = b.alloc(28).unwrap();
    let empty = b.alloc(0).unwrap();
    assert_eq!((b.memory().current, b.memory().peak), (128, 128));
    drop(x);
    assert_eq!((b.memory().current, b.memory().peak), (28, 128));
    assert_eq!(download(&b, &y), vec![0u8; 28]);
    assert_eq!(empty.bytes(), 0);
    b.download(&empty, all(0, DType::F32), &mut []).unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn upload_and_download_round_trip_with_one_host_wait_each() {
    let b = gpu();
    let data = Rng::new(1).mixed_bytes(DType::Bf16, 333);
    let mut buf = b.alloc(data.len() + 6).unwrap();
    let region = Region::new(3, 333, DType::Bf16);
    b.upload(&mut buf, region, &data).unwrap();
    assert_eq!(b.host_waits(), 1);
    let mut back = vec![0u8; data.len()];
    b.download(&buf, region, &mut back).unwrap();
    assert_eq!(b.host_waits(), 2);
    assert_same(&data, &back, "round trip");
    let whole = download(&b, &buf);
    assert_eq!(&whole[..6], &[0; 6], "bytes before the region");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn zero_matches_the_cpu_on_every_stream() {
    let both = Both::new();
    let mut rng = Rng::new(2);
    for (i, dtype) in DTYPES.into_iter().enumerate() {
        let mut t = both.twin(dtype, &rng.mixed_bytes(dtype, 1001));
        let region = Region::new(5 + i, 777, dtype);
        // SAFETY: see the module note.
        unsafe { both.cpu.zero(STREAMS[i], &mut t.cpu, region) }.unwrap();
        // SAFETY: see the module note.
        unsafe { both.gpu.zero(STREAMS[i], &mut t.gpu, region) }.unwrap();
        both.assert_same(&t, &format!("zero {dtype} on {:?}", STREAMS[i]));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn accumulate_matches_the_cpu() {
    let both = Both::new();
    let mut rng = Rng::new(3);
    let src = both.twin(DType::F32, &rng.mixed_bytes(DType::F32, 4099));
    let mut dst = both.twin(DType::F32, &rng.mixed_bytes(DType::F32, 4099));
    for (scale, add) in [(1.0, false), (0.5, true), (-3.25, true), (1.0 / 3.0, false)] {
        let (s, d) = (
            Region::new(7, 4001, DType::F32),
            Region::new(90, 4001, DType::F32),
        );
        // SAFETY: see the module note.
        unsafe {
            both.cpu
                .accumulate(Stream::Reduce, &src.cpu, s, &mut dst.cpu, d, scale, add)
        }
        .unwrap();
        // SAFETY: see the module note.
        unsafe {
            both.gpu
                .accumulate(Stream::Reduce, &src.gpu, s, &mut dst.gpu, d, scale, add)
        }
        .unwrap();
        both.assert_same(&dst, &format!("accumulate scale {scale} add {add}"));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn accumulating_a_bf16_sum_into_f32_matches_the_cpu_and_f16_is_refused() {
    let both = Both::new();
    let mut rng = Rng::new(13);
    let n = 3001;
    // A bf16 sum added into the fp32 shard.
    let src = both.twin(DType::Bf16, &rng.mixed_bytes(DType::Bf16, n));
    let mut dst = both.twin(DType::F32, &rng.mixed_bytes(DType::F32, n));
    let (s, d) = (all(n, DType::Bf16), all(n, DType::F32));
    // SAFETY: see the module note.
    unsafe {
        both.cpu
            .accumulate(Stream::Reduce, &src.cpu, s, &mut dst.cpu, d, 0.5, true)
    }
    .unwrap();
    // SAFETY: see the module note.
    unsafe {
        both.gpu
            .accumulate(Stream::Reduce, &src.gpu, s, &mut dst.gpu, d, 0.5, true)
    }
    .unwrap();
    both.assert_same(&dst, "bf16 into f32");
    // f16 accumulators are refused before anything is queued.
    let mut f16 = both.twin(DType::F16, &rng.mixed_bytes(DType::F16, n));
    // SAFETY: refused before anything is queued.
    let refused = unsafe {
        both.gpu.accumulate(
            Stream::Reduce,
            &src.gpu,
            s,
            &mut f16.gpu,
            all(n, DType::F16),
            1.0,
            false,
        )
    };
    assert!(
        matches!(refused, Err(Error::Unsupported { .. })),
        "{refused:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn accumulate_input_from_device_memory_matches_the_cpu() {
    let both = Both::new();
    let mut rng = Rng::new(4);
    // Into f32 (a gradient shard) and bf16 (a transport slot).
    for (dtype, into) in DTYPES
        .into_iter()
        .flat_map(|d| [(d, DType::F32), (d, DType::Bf16)])
    {
        let n = 2053;
        let data = rng.mixed_bytes(dtype, n + 3);
        let src = both.twin(dtype, &data);
        let mut dst = both.twin(into, &rng.mixed_bytes(into, n + 11));
        let d = Region::new(11, n, into);
        for (scale, add) in [(1.0, false), (0.25, true)] {
            let host = Input::host_bytes(&data[3 * dtype.size()..], dtype);
            // SAFETY: `src` holds `n + 3` elements and outlives the test's work.
            let device =
                unsafe { Input::device(src.gpu.ptr() + 3 * dtype.size() as u64, n, dtype) };
            // SAFETY: see the module note.
            unsafe {
                both.cpu
                    .accumulate_input(Stream::Compute, host, &mut dst.cpu, d, scale, add)
            }
            .unwrap();
            // SAFETY: see the module note.
            unsafe {
                both.gpu
                    .accumulate_input(Stream::Compute, device, &mut dst.gpu, d, scale, add)
            }
            .unwrap();
            both.assert_same(
                &dst,
                &format!("device input {dtype} into {into} scale {scale} add {add}"),
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn accumulate_input_from_host_memory_matches_the_cpu_with_one_host_wait() {
    let both = Both::new();
    let mut rng = Rng::new(5);
    for dtype in DTYPES {
        // Growing sizes make the staging area grow too.
        for n in [17, 4096, 100_003] {
            let data = rng.mixed_bytes(dtype, n);
            let input = Input::host_bytes(&data, dtype);
            let mut dst = both.twin(DType::F32, &rng.mixed_bytes(DType::F32, n));
            let before = both.gpu.host_waits();
            // SAFETY: see the module note.
            unsafe {
                both.cpu.accumulate_input(
                    Stream::Compute,
                    input,
                    &mut dst.cpu,
                    all(n, DType::F32),
                    2.0,
                    true,
                )
            }
            .unwrap();
            // SAFETY: see the module note.
            unsafe {
                both.gpu.accumulate_input(
                    Stream::Compute,
                    input,
                    &mut dst.gpu,
                    all(n, DType::F32),
                    2.0,
                    true,
                )
            }
            .unwrap();
            assert_eq!(
                both.gpu.host_waits(),
                before + 1,
                "host input {dtype} x {n}"
            );
            both.assert_same(&dst, &format!("host input {dtype} x {n}"));
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cast_matches_the_cpu_for_every_pair_of_dtypes() {
    let both = Both::new();
    let mut rng = Rng::new(6);
    for from in DTYPES {
        for to in DTYPES {
            let src = both.twin(from, &rng.mixed_bytes(from, 3000));
            let mut dst = both.zeros((2900 + 4) * to.size() + 8);
            let (s, d) = (Region::new(33, 2900, from), Region::new(3, 2900, to));
            // SAFETY: see the module note.
            unsafe { both.cpu.cast(Stream::Compute, &src.cpu, s, &mut dst.cpu, d) }.unwrap();
            // SAFETY: see the module note.
            unsafe { both.gpu.cast(Stream::Compute, &src.gpu, s, &mut dst.gpu, d) }.unwrap();
            both.assert_same(&dst, &format!("cast {from} to {to}"));
        }
    }
}

/// A shard's optimizer state on both backends.
struct ShardState {
    param: Twin,
    grad: Twin,
    master: Option<Twin>,
    moments: Option<(Twin, Twin)>,
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn optimizer_steps_match_the_cpu() {
    let both = Both::new();
    let mut rng = Rng::new(7);
    let n = 5003;
    // bf16 moments: the shard's elements at 4000..9003 of their group's layout.
    let storages = [
        MomentStorage::F32,
        MomentStorage::Bf16Stochastic {
            group: 2,
            first_index: 4000,
        },
    ];
    for (dtype, storage) in DTYPES.into_iter().flat_map(|d| storages.map(|s| (d, s))) {
        for config in [OptimizerConfig::sgd(0.01), OptimizerConfig::default()] {
            let mut s = ShardState {
                param: both.twin(dtype, &rng.mixed_bytes(dtype, n)),
                grad: both.zeros(n * 4),
                master: (dtype != DType::F32).then(|| both.zeros(n * 4)),
                moments: config
                    .has_moments()
                    .then(|| (both.zeros(n * 4), both.zeros(n * 4))),
            };
            let mut values = both.zeros(STEP_VALUES_BYTES);
            if let Some(m) = s.master.as_mut() {
                // SAFETY: see the module note.
                unsafe {
                    both.cpu.cast(
                        Stream::Compute,
                        &s.param.cpu,
                        all(n, dtype),
                        &mut m.cpu,
                        all(n, DType::F32),
                    )
                }
                .unwrap();
                // SAFETY: see the module note.
                unsafe {
                    both.gpu.cast(
                        Stream::Compute,
                        &s.param.gpu,
                        all(n, dtype),
                        &mut m.gpu,
                        all(n, DType::F32),
                    )
                }
                .unwrap();
            }
            for step in 1..=3 {
                let grad = rng.mixed_bytes(DType::F32, n);
                both.cpu
                    .upload(&mut s.grad.cpu, all(n, DType::F32), &grad)
                    .unwrap();
                both.gpu
                    .upload(&mut s.grad.gpu, all(n, DType::F32), &grad)
                    .unwrap();
                // Clipped on step 2, as a clipping coefficient does; the values written on the
                // stream the updates read them on.
                let step_values = config.step_values(step, if step == 2 { 0.625 } else { 1.0 });
                // SAFETY: see the module note.
                unsafe {
                    both.cpu
                        .write_step_values(Stream::Compute, &mut values.cpu, &step_values)
                }
                .unwrap();
                // SAFETY: see the module note.
                unsafe {
                    both.gpu
                        .write_step_values(Stream::Compute, &mut values.gpu, &step_values)
                }
                .unwrap();
                let group = GroupUpdate {
                    lr_scale: 0.3,
                    decay: step != 3,
                };
                let cpu = OptimizerShard {
                    param: &mut s.param.cpu,
                    dtype,
                    numel: n,
                    grad: &s.grad.cpu,
                    master: s.master.as_mut().map(|m| &mut m.cpu),
                    moments: s.moments.as_mut().map(|(m, v)| Moments {
                        first: &mut m.cpu,
                        second: &mut v.cpu,
                        storage,
                    }),
                };
                // SAFETY: see the module note.
                let update = StepUpdate {
                    kind: config.kind(),
                    values: &values.cpu,
                    group,
                };
                // SAFETY: see the module note.
                unsafe { both.cpu.optimizer_step(Stream::Compute, update, cpu) }.unwrap();
                let gpu = OptimizerShard {
                    param: &mut s.param.gpu,
                    dtype,
                    numel: n,
                    grad: &s.grad.gpu,
                    master: s.master.as_mut().map(|m| &mut m.gpu),
                    moments: s.moments.as_mut().map(|(m, v)| Moments {
                        first: &mut m.gpu,
                        second: &mut v.gpu,
                        storage,
                    }),
                };
                // SAFETY: see the module note.
                let update = StepUpdate {
                    kind: config.kind(),
                    values: &values.gpu,
                    group,
                };
                // SAFETY: see the module note.
                unsafe { both.gpu.optimizer_step(Stream::Compute, update, gpu) }.unwrap();
                let what = format!("{config:?} {dtype} {storage:?} step {step}");
                both.assert_same(&s.param, &format!("{what}: param"));
                if let Some(m) = &s.master {
                    both.assert_same(m, &format!("{what}: master"));
                }
                if let Some((m, v)) = &s.moments {
                    both.assert_same(m, &format!("{what}: m"));
                    both.assert_same(v, &format!("{what}: v"));
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn norm_partials_agree_with_the_cpu_backend() {
    let both = Both::new();
    let mut rng = Rng::new(21);
    for n in [0usize, 1, 7, 4099, 1 << 20] {
        let values = both.twin(DType::F32, &rng.mixed_bytes(DType::F32, n + 5));
        let mut parts = both.twin(DType::F32, &[0u8; 16]);
        let region = Region::new(5, n, DType::F32);
        for _ in 0..2 {
            // SAFETY: see the module note.
            unsafe {
                both.cpu
                    .norm_partials(Stream::Compute, &values.cpu, region, &mut parts.cpu)
            }
            .unwrap();
            // SAFETY: see the module note.
            unsafe {
                both.gpu
                    .norm_partials(Stream::Compute, &values.gpu, region, &mut parts.gpu)
            }
            .unwrap();
        }
        let read = |b: &dyn Fn(&mut [u8])| {
            let mut out = [0u8; 16];
            b(&mut out);
            (
                f64::from_le_bytes(out[..8].try_into().unwrap()),
                u32::from_le_bytes(out[8..12].try_into().unwrap()),
            )
        };
        let whole = Region::new(0, 4, DType::F32);
        let cpu = read(&|out| both.cpu.download(&parts.cpu, whole, out).unwrap());
        let gpu = read(&|out| both.gpu.download(&parts.gpu, whole, out).unwrap());
        // The largest magnitude is exact; the f64 sums of the 2n non-negative squares differ by
        // their order at most: each within 2n epsilons (relative) of the exact sum.
        assert_eq!(cpu.1, gpu.1, "n = {n}: largest magnitude");
        let bound = 4.0 * n as f64 * f64::EPSILON;
        assert!(
            (cpu.0 - gpu.0).abs() <= bound * cpu.0,
            "n = {n}: {} != {}",
            cpu.0,
            gpu.0
        );
        // A single value may be a zero; the longer runs are not all zeros.
        assert!(n < 7 || cpu.0 > 0.0, "n = {n}: nothing to sum");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn regions_past_the_end_are_errors_before_any_work() {
    let b = gpu();
    let mut x = b.alloc(64).unwrap();
    let mut y = b.alloc(64).unwrap();
    let past = Region::new(10, 7, DType::F32);
    let out_of_range = |r: Result<(), Error>, what: &str| match r {
        Err(Error::OutOfRange {
            offset: 10,
            len: 7,
            capacity: 16,
        }) => {}
        other => panic!("{what}: expected OutOfRange 10 + 7 > 16, got {other:?}"),
    };
    let ok = all(16, DType::F32);
    out_of_range(
        // SAFETY: refused before anything is queued.
        unsafe { b.zero(Stream::Compute, &mut x, past) },
        "zero",
    );
    out_of_range(b.upload(&mut x, past, &[0; 28]), "upload");
    out_of_range(b.download(&x, past, &mut [0; 28]), "download");
    out_of_range(
        // SAFETY: refused before anything is queued.
        unsafe { b.accumulate(Stream::Compute, &x, past, &mut y, ok, 1.0, false) },
        "accumulate src",
    );
    out_of_range(
        // SAFETY: refused before anything is queued.
        unsafe { b.accumulate(Stream::Compute, &x, ok, &mut y, past, 1.0, false) },
        "accumulate dst",
    );
    // SAFETY: a buffer of the backend that outlives the test's work.
    let input = unsafe { Input::device(x.ptr(), 7, DType::F32) };
    out_of_range(
        // SAFETY: refused before anything is queued.
        unsafe { b.accumulate_input(Stream::Compute, input, &mut y, past, 1.0, false) },
        "input",
    );
    out_of_range(
        // SAFETY: refused before anything is queued.
        unsafe { b.cast(Stream::Compute, &x, past, &mut y, ok) },
        "cast",
    );
    assert_eq!(b.host_waits(), 0, "a refused upload or download waited");
    assert_eq!(download(&b, &y), vec![0u8; 64], "a refused op wrote");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn lengths_that_disagree_are_errors() {
    let b = gpu();
    let mut x = b.alloc(64).unwrap();
    let mut y = b.alloc(64).unwrap();
    let (four, five) = (all(4, DType::F32), all(5, DType::F32));
    assert!(matches!(
        unsafe { b.accumulate(Stream::Compute, &x, four, &mut y, five, 1.0, true) },
        Err(Error::OutOfRange {
            offset: 0,
            len: 4,
            capacity: 5
        })
    ));
    // SAFETY: a buffer of the backend that outlives the test's work.
    let input = unsafe { Input::device(x.ptr(), 4, DType::Bf16) };
    assert!(matches!(
        unsafe { b.accumulate_input(Stream::Compute, input, &mut y, five, 1.0, true) },
        Err(Error::OutOfRange {
            offset: 0,
            len: 4,
            capacity: 5
        })
    ));
    assert!(matches!(
        b.upload(&mut x, five, &[0; 16]),
        Err(Error::OutOfRange {
            offset: 0,
            len: 4,
            capacity: 5
        })
    ));
    assert!(matches!(
        b.download(&x, five, &mut [0; 16]),
        Err(Error::OutOfRange {
            offset: 0,
            len: 5,
            capacity: 4
        })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_null_device_input_is_refused() {
    let b = gpu();
    let mut y = b.alloc(16).unwrap();
    // SAFETY: a null address, refused before any use.
    let input = unsafe { Input::device(0, 4, DType::F32) };
    let r = unsafe {
        b.accumulate_input(
            Stream::Compute,
            input,
            &mut y,
            all(4, DType::F32),
            1.0,
            true,
        )
    };
    assert!(
        matches!(
            r,
            Err(Error::Unsupported {
                backend: "cuda",
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn optimizer_steps_without_their_state_are_refused() {
    let b = gpu();
    let mut param = b.alloc(16).unwrap();
    let grad = b.alloc(16).unwrap();
    let shard = OptimizerShard {
        param: &mut param,
        dtype: DType::Bf16,
        numel: 4,
        grad: &grad,
        master: None,
        moments: None,
    };
    let values = b.alloc(STEP_VALUES_BYTES).unwrap();
    let update = |kind| StepUpdate {
        kind,
        values: &values,
        group: GroupUpdate {
            lr_scale: 1.0,
            decay: true,
        },
    };
    let r = unsafe { b.optimizer_step(Stream::Compute, update(OptimizerKind::Sgd), shard) };
    assert!(
        matches!(
            r,
            Err(Error::Unsupported {
                backend: "cuda",
                ..
            })
        ),
        "{r:?}"
    );
    let shard = OptimizerShard {
        param: &mut param,
        dtype: DType::F32,
        numel: 4,
        grad: &grad,
        master: None,
        moments: None,
    };
    let r = unsafe { b.optimizer_step(Stream::Compute, update(OptimizerKind::AdamW), shard) };
    assert!(
        matches!(
            r,
            Err(Error::InvalidConfig {
                field: "optimizer",
                ..
            })
        ),
        "{r:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn events_streams_and_launches_never_block_the_host() {
    let b = gpu();
    let n = 1 << 16;
    let mut f = b.alloc(n * 4).unwrap();
    let mut g = b.alloc(n * 4).unwrap();
    let mut h = b.alloc(n * 2).unwrap();
    let (mut m, mut v) = (b.alloc(n * 4).unwrap(), b.alloc(n * 4).unwrap());
    let r = all(n, DType::F32);
    for from in STREAMS {
        let e = b.record(from).unwrap();
        for to in STREAMS {
            b.wait(to, &e).unwrap();
        }
        // SAFETY: see the module note.
        unsafe { b.zero(from, &mut f, r) }.unwrap();
        // SAFETY: see the module note.
        unsafe { b.accumulate(from, &f, r, &mut g, r, 0.5, true) }.unwrap();
        // SAFETY: a buffer of the backend that outlives the test's work.
        let input = unsafe { Input::device(g.ptr(), n, DType::F32) };
        // SAFETY: see the module note.
        unsafe { b.accumulate_input(from, input, &mut f, r, 2.0, false) }.unwrap();
        // SAFETY: see the module note.
        unsafe { b.cast(from, &h, all(n, DType::Bf16), &mut f, all(n, DType::F32)) }.unwrap();
    }
    let shard = OptimizerShard {
        param: &mut h,
        dtype: DType::Bf16,
        numel: n,
        grad: &g,
        master: Some(&mut f),
        moments: Some(Moments {
            first: &mut m,
            second: &mut v,
            storage: MomentStorage::F32,
        }),
    };
    let mut values = b.alloc(STEP_VALUES_BYTES).unwrap();
    let step_values = OptimizerConfig::default().step_values(1, 1.0);
    // SAFETY: see the module note.
    unsafe { b.write_step_values(Stream::Compute, &mut values, &step_values) }.unwrap();
    let update = StepUpdate {
        kind: OptimizerKind::AdamW,
        values: &values,
        group: GroupUpdate {
            lr_scale: 1.0,
            decay: true,
        },
    };
    // SAFETY: see the module note.
    unsafe { b.optimizer_step(Stream::Compute, update, shard) }.unwrap();
    assert_eq!(
        b.host_waits(),
        0,
        "the host blocked on an asynchronous call"
    );
    let done = b.record(Stream::Compute).unwrap();
    b.synchronize(&done).unwrap();
    assert_eq!(b.host_waits(), 1, "synchronize counts one host wait");
}

/// Slow work on `from` (many passes over a large buffer), an event, a wait on `to`, and a copy on
/// `to`: the copy must see the finished work.
fn event_orders(from: Stream, to: Stream) {
    let b = gpu();
    let n = 1 << 24;
    let passes = 64;
    let r = all(n, DType::F32);
    // Every buffer is allocated (and zero-filled) first: allocation itself orders the streams.
    let mut acc = b.alloc(n * 4).unwrap();
    let mut ones = b.alloc(n * 4).unwrap();
    let mut copy = b.alloc(n * 4).unwrap();
    b.upload(&mut ones, r, bytemuck::cast_slice(&vec![1f32; n]))
        .unwrap();
    for _ in 0..passes {
        // SAFETY: see the module note.
        unsafe { b.accumulate(from, &ones, r, &mut acc, r, 1.0, true) }.unwrap();
    }
    let done = b.record(from).unwrap();
    b.wait(to, &done).unwrap();
    // SAFETY: see the module note.
    unsafe { b.accumulate(to, &acc, r, &mut copy, r, 1.0, false) }.unwrap();
    let got = download(&b, &copy);
    let got: &[f32] = bytemuck::cast_slice(&got);
    let early = got.iter().filter(|&&x| x != passes as f32).count();
    assert_eq!(
        early, 0,
        "{from:?} -> {to:?}: {early} of {n} elements copied before the work ended"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_gather_stream_waits_for_a_compute_event() {
    event_orders(Stream::Compute, Stream::Gather);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_reduce_stream_waits_for_a_compute_event() {
    event_orders(Stream::Compute, Stream::Reduce);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_compute_stream_waits_for_a_reduce_event() {
    event_orders(Stream::Reduce, Stream::Compute);
}

/// Runs a small accumulate through `b` and checks its result: the backend works end to end.
fn smoke(b: &CudaBackend) {
    let mut x = b.alloc(16).unwrap();
    let mut y = b.alloc(16).unwrap();
    let r = all(4, DType::F32);
    b.upload(&mut x, r, bytemuck::cast_slice(&[1f32, 2.0, 3.0, 4.0]))
        .unwrap();
    // SAFETY: see the module note.
    unsafe { b.accumulate(Stream::Compute, &x, r, &mut y, r, 2.0, false) }.unwrap();
    let got = download(b, &y);
    assert_eq!(bytemuck::cast_slice::<u8, f32>(&got), &[2.0, 4.0, 6.0, 8.0]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_callers_stream_becomes_the_compute_stream() {
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let b = CudaBackend::with_stream(Arc::clone(&stream)).unwrap();
    // SAFETY: the handles are only compared.
    let (compute, gather) = unsafe { (b.stream(Stream::Compute), b.stream(Stream::Gather)) };
    assert_eq!(compute.cu_stream(), stream.cu_stream());
    assert_ne!(gather.cu_stream(), stream.cu_stream());
    smoke(&b);
    // The caller's context handle keeps cudarc's event tracking, which its own slices rely on.
    assert!(ctx.is_event_tracking());
    drop(b);
    // The backend never owned the stream: it still works.
    stream.synchronize().unwrap();
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_raw_stream_of_the_primary_context_is_adopted() {
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let raw = stream.cu_stream() as u64;
    // SAFETY: `raw` is a live stream of device 0 that outlives the backend.
    let b = unsafe { CudaBackend::with_raw_stream(0, raw) }.unwrap();
    // SAFETY: the handle is only compared.
    assert_eq!(unsafe { b.stream(Stream::Compute) }.cu_stream() as u64, raw);
    smoke(&b);
    drop(b);
    // The backend never owned the stream: it still works.
    stream.synchronize().unwrap();
    // 0 is the legacy default stream.
    // SAFETY: 0 is the legacy default stream.
    smoke(&unsafe { CudaBackend::with_raw_stream(0, 0) }.unwrap());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_raw_stream_of_another_context_is_refused() {
    let other = CudaContext::new_non_primary(0, 0).unwrap();
    let stream = other.new_stream().unwrap();
    // SAFETY: the stream is live for the whole call.
    match unsafe { CudaBackend::with_raw_stream(0, stream.cu_stream() as u64) } {
        Err(Error::Cuda { call, code, .. }) => assert_eq!((call, code), ("cuStreamGetCtx", 201)),
        Err(other) => panic!("expected Error::Cuda from cuStreamGetCtx, got {other:?}"),
        Ok(_) => panic!("adopted a stream of another context"),
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn param_device_points_at_the_gathered_values_while_the_unit_is_open() {
    let model = ModelSpec::new(vec![
        ParamSpec::new("w", &[3, 5], DType::F32).in_unit(0),
        ParamSpec::new("b", &[7], DType::Bf16).in_unit(0),
    ])
    .unwrap();
    let plan = Arc::new(Plan::new(&model, 1).unwrap());
    let comm = LoopbackComm::group(1).unwrap().pop().unwrap();
    let mut e = Engine::new(plan, EngineConfig::default(), gpu(), comm).unwrap();
    let mut rng = Rng::new(9);
    let values = [rng.mixed_values(15), rng.mixed_values(7)];
    for (name, v, dtype) in [
        ("w", &values[0], DType::F32),
        ("b", &values[1], DType::Bf16),
    ] {
        let id = e.plan().param_id(name).unwrap();
        let bytes = narrow(dtype, v);
        e.load_param(id, Input::host_bytes(&bytes, dtype)).unwrap();
    }
    e.pre_forward(Unit::Layer(0)).unwrap();
    for (name, v, dtype) in [
        ("w", &values[0], DType::F32),
        ("b", &values[1], DType::Bf16),
    ] {
        let id = e.plan().param_id(name).unwrap();
        let t = e.param_device(id).unwrap();
        assert_eq!((t.numel, t.dtype), (v.len(), dtype), "{name}");
        assert_eq!(e.param_address(id).unwrap(), t.ptr, "{name}");
        // Read the values through the device address, widened to f32 on the compute stream.
        let b = e.backend();
        let mut out = b.alloc(t.numel * 4).unwrap();
        let DeviceTensor { ptr, numel, dtype } = t;
        // SAFETY: the gathered view, read on the compute stream after the hook's wait.
        let input = unsafe { Input::device(ptr, numel, dtype) };
        // SAFETY: see the module note.
        unsafe {
            b.accumulate_input(
                Stream::Compute,
                input,
                &mut out,
                all(numel, DType::F32),
                1.0,
                false,
            )
        }
        .unwrap();
        let expected: Vec<f32> = v
            .iter()
            .map(|&x| match dtype {
                DType::Bf16 => bf16::from_f32(x).to_f32(),
                _ => x,
            })
            .collect();
        assert_same(bytemuck::cast_slice(&expected), &download(b, &out), name);
    }
    e.post_forward(Unit::Layer(0)).unwrap();
    let id = e.plan().param_id("w").unwrap();
    assert!(matches!(e.param_device(id), Err(Error::NotGathered { .. })));
}
