use super::*;
use crate::optim::{GroupUpdate, OptimizerKind};

/// An eager backend and asynchronous ones of a few seeds.
fn backends() -> Vec<CpuBackend> {
    let mut all = vec![CpuBackend::new()];
    all.extend((0..4).map(|seed| CpuBackend::asynchronous(seed).unwrap()));
    all
}

fn f32_region(len: usize) -> Region {
    Region::new(0, len, DType::F32)
}

fn download_f32(b: &CpuBackend, buf: &CpuBuffer, len: usize) -> Vec<f32> {
    let mut out = vec![0f32; len];
    b.download(buf, f32_region(len), bytemuck::cast_slice_mut(&mut out))
        .unwrap();
    out
}

#[test]
fn memory_is_counted_while_buffers_live_and_starts_zeroed() {
    let b = CpuBackend::new();
    let x = b.alloc(100).unwrap();
    let y = b.alloc(28).unwrap();
    assert_eq!(
        b.memory(),
        MemoryUsage {
            current: 128,
            peak: 128
        }
    );
    drop(x);
    assert_eq!(
        b.memory(),
        MemoryUsage {
            current: 28,
            peak: 128
        }
    );
    let mut out = [1u8; 28];
    b.download(&y, Region::new(0, 14, DType::Bf16), &mut out)
        .unwrap();
    assert_eq!(out, [0u8; 28]);
}

#[test]
fn freed_memory_goes_to_the_next_unfilled_buffer_of_its_size_where_a_late_write_lands() {
    let b = CpuBackend::asynchronous(1).unwrap();
    let x = b.alloc_unfilled(16).unwrap();
    let at = |buf: &CpuBuffer| buf.addr(Region::new(0, 4, DType::F32)).unwrap();
    let freed_at = at(&x);
    // A write on the reduce stream that the free is not ordered after (a missing wait): it
    // waits for the next owner's fill before it writes.
    let (memory, gate) = (
        Arc::clone(x.memory()),
        Arc::new(std::sync::atomic::AtomicBool::new(false)),
    );
    let opened = Arc::clone(&gate);
    b.run(Stream::Reduce, move || {
        while !opened.load(std::sync::atomic::Ordering::SeqCst) {
            std::thread::yield_now();
        }
        // SAFETY: nothing else touches the bytes now (the test orders them by hand).
        unsafe { memory.bytes_mut(0..4) }.copy_from_slice(&1.0f32.to_le_bytes());
        Ok(())
    })
    .unwrap();
    // SAFETY: deliberately not after the reduce stream's write: the case the reuse shows.
    unsafe { b.free_after_compute([x]) }.unwrap();
    assert_eq!(b.memory().current, 0);
    let y = b.alloc_unfilled(16).unwrap();
    assert_eq!((at(&y), b.memory().current), (freed_at, 16));
    b.synchronize(&b.record(Stream::Compute).unwrap()).unwrap();
    gate.store(true, std::sync::atomic::Ordering::SeqCst);
    b.synchronize(&b.record(Stream::Reduce).unwrap()).unwrap();
    let values = download_f32(&b, &y, 4);
    assert_eq!(
        values[0], 1.0,
        "the late write is in the next owner's bytes"
    );
    assert!(values[1..].iter().all(|v| v.is_nan()), "{values:?}");
    // Another size takes fresh memory.
    assert_ne!(at(&b.alloc_unfilled(32).unwrap()), freed_at);
}

#[test]
fn an_unfilled_buffer_is_counted_and_holds_nan_until_written_and_free_drops_buffers() {
    let b = CpuBackend::new();
    let x = b.alloc_unfilled(16).unwrap();
    let y = b.alloc(8).unwrap();
    assert_eq!(b.memory().current, 24);
    let values = download_f32(&b, &x, 4);
    assert!(values.iter().all(|v| v.is_nan()), "{values:?}");
    let mut halves = [0u8; 16];
    b.download(&x, Region::new(0, 8, DType::Bf16), &mut halves)
        .unwrap();
    assert_eq!(halves, [0xFF; 16], "a NaN in every bf16 too");
    b.free(vec![x, y]).unwrap();
    assert_eq!(
        b.memory(),
        MemoryUsage {
            current: 0,
            peak: 24
        }
    );
}

#[test]
fn an_allocation_larger_than_memory_is_an_error() {
    let b = CpuBackend::new();
    assert!(matches!(
        b.alloc(usize::MAX - 4),
        Err(Error::OutOfMemory { .. })
    ));
    assert_eq!(b.memory().current, 0);
}

#[test]
fn regions_past_the_end_are_errors() {
    for b in backends() {
        let mut x = b.alloc(16).unwrap();
        let r = Region::new(3, 2, DType::F32);
        // SAFETY: nothing else uses the buffer.
        let err = unsafe { b.zero(Stream::Compute, &mut x, r) }.unwrap_err();
        assert!(
            matches!(
                err,
                Error::OutOfRange {
                    offset: 3,
                    len: 2,
                    capacity: 4
                }
            ),
            "{err:?}"
        );
    }
}

#[test]
fn accumulate_input_widens_and_scales() {
    for b in backends() {
        let mut dst = b.alloc(12).unwrap();
        let g = [
            half::bf16::from_f32(1.5),
            half::bf16::from_f32(-2.0),
            half::bf16::from_f32(0.25),
        ];
        // SAFETY: both on the compute stream, in order; nothing else uses the buffer.
        unsafe {
            b.accumulate_input(
                Stream::Compute,
                Input::host(&g),
                &mut dst,
                f32_region(3),
                2.0,
                false,
            )
            .unwrap();
            b.accumulate_input(
                Stream::Compute,
                Input::host(&g),
                &mut dst,
                f32_region(3),
                1.0,
                true,
            )
            .unwrap();
        }
        assert_eq!(download_f32(&b, &dst, 3), [4.5, -6.0, 0.75]);
    }
}

/// A device input of no elements (a zero-size parameter's gradient) may come with no address:
/// it adds nothing and reads nothing.
#[test]
fn a_device_input_of_no_elements_needs_no_address() {
    for b in backends() {
        let mut dst = b.alloc(8).unwrap();
        b.upload(
            &mut dst,
            f32_region(2),
            bytemuck::cast_slice(&[1.5f32, -2.0]),
        )
        .unwrap();
        for add in [false, true] {
            // SAFETY: no element is read; nothing else uses the buffer.
            unsafe {
                b.accumulate_input(
                    Stream::Compute,
                    Input::device(0, 0, DType::Bf16),
                    &mut dst,
                    Region::new(1, 0, DType::F32),
                    1.0,
                    add,
                )
            }
            .unwrap();
        }
        assert_eq!(download_f32(&b, &dst, 2), [1.5, -2.0]);
    }
}

#[test]
fn accumulation_rounds_into_bf16_once_and_refuses_f16() {
    for b in backends() {
        let mut slot = b.alloc(6).unwrap();
        let bf16 = |n| Region::new(0, n, DType::Bf16);
        // 1 + 2^-9 rounds (to even) to 1 in bf16; 3 * (1 + 2^-9) is computed in f32 first.
        let g = [1.0 + 1.0 / 512.0, -3.0, 0.1];
        // SAFETY: on the compute stream, in order; nothing else uses the buffers.
        unsafe {
            b.accumulate_input(
                Stream::Compute,
                Input::host(&g),
                &mut slot,
                bf16(3),
                3.0,
                false,
            )
            .unwrap();
        }
        let mut out = [0u8; 6];
        b.download(&slot, bf16(3), &mut out).unwrap();
        let got: Vec<f32> = out
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        let want: Vec<f32> = g
            .iter()
            .map(|&x| half::bf16::from_f32(3.0 * x).to_f32())
            .collect();
        assert_eq!(got, want);
        let mut shard = b.alloc(12).unwrap();
        // SAFETY: as above.
        unsafe {
            b.accumulate(
                Stream::Compute,
                &slot,
                bf16(3),
                &mut shard,
                f32_region(3),
                0.5,
                false,
            )
            .unwrap();
        }
        let halves: Vec<f32> = want.iter().map(|w| 0.5 * w).collect();
        assert_eq!(download_f32(&b, &shard, 3), halves[..]);
        // SAFETY: refused before anything is queued.
        let refused = unsafe {
            b.accumulate(
                Stream::Compute,
                &shard,
                f32_region(3),
                &mut slot,
                Region::new(0, 3, DType::F16),
                1.0,
                false,
            )
        };
        assert!(
            matches!(refused, Err(Error::Unsupported { .. })),
            "{refused:?}"
        );
    }
}

/// Queues on `stream` `times` additions of `scale` to each of the 64 f32 of `x`.
///
/// # Safety
/// As [`Backend::accumulate_input`]: the caller orders `x`'s uses on other streams with events.
unsafe fn add_ones(b: &CpuBackend, stream: Stream, x: &mut CpuBuffer, scale: f32, times: usize) {
    let ones = [1f32; 64];
    for _ in 0..times {
        // SAFETY: the caller's contract.
        unsafe { b.accumulate_input(stream, Input::host(&ones), x, f32_region(64), scale, true) }
            .unwrap();
    }
}

#[test]
fn an_event_wait_orders_work_across_streams() {
    for seed in 0..16 {
        let b = CpuBackend::asynchronous(seed).unwrap();
        let mut x = b.alloc(64 * 4).unwrap();
        let mut y = b.alloc(64 * 4).unwrap();
        // SAFETY: the reduce stream reads x only after the compute stream's event for its write.
        unsafe {
            add_ones(&b, Stream::Compute, &mut x, 1.0, 8);
            let written = b.record(Stream::Compute).unwrap();
            b.wait(Stream::Reduce, &written).unwrap();
            b.accumulate(
                Stream::Reduce,
                &x,
                f32_region(64),
                &mut y,
                f32_region(64),
                0.5,
                false,
            )
            .unwrap();
        }
        assert_eq!(download_f32(&b, &y, 64), [4f32; 64], "seed {seed}");
    }
}

#[test]
fn without_a_wait_the_streams_run_apart() {
    // The compute stream has thousands of delayed operations queued; the gather stream's one
    // point, queued after them, is reached first.
    for seed in 0..4 {
        let b = CpuBackend::asynchronous(seed).unwrap();
        let mut last = None;
        for _ in 0..2000 {
            last = Some(b.record_timed(Stream::Compute).unwrap());
        }
        let gather = b.record_timed(Stream::Gather).unwrap();
        let last = last.unwrap();
        let ms = b.elapsed_ms(&gather, &last).unwrap();
        assert!(
            ms > 0.0,
            "seed {seed}: compute reached its end {ms} ms after gather"
        );
    }
}

#[test]
fn a_download_on_compute_waits_for_the_compute_stream_and_what_it_waited_for_only() {
    for seed in 0..8 {
        let b = CpuBackend::asynchronous(seed).unwrap();
        let mut x = b.alloc(64 * 4).unwrap();
        // The reduce stream is held until the download returned: a download that waited for it
        // would never return, and the release's deadline fails the test instead.
        let (release, held) = std::sync::mpsc::channel::<()>();
        let held = std::sync::Mutex::new(held);
        b.run(Stream::Reduce, move || {
            let held = crate::sync::lock(&held);
            held.recv_timeout(std::time::Duration::from_secs(10))
                .map_err(|_| Error::Panicked {
                    message: "the download waited for the reduce stream".into(),
                })
        })
        .unwrap();
        // SAFETY: the compute stream writes x only after the gather stream's event for its write.
        unsafe {
            add_ones(&b, Stream::Gather, &mut x, 1.0, 4);
            let gathered = b.record(Stream::Gather).unwrap();
            b.wait(Stream::Compute, &gathered).unwrap();
            add_ones(&b, Stream::Compute, &mut x, 0.5, 1);
        }
        let mut out = vec![0f32; 64];
        b.download_on_compute(&x, f32_region(64), bytemuck::cast_slice_mut(&mut out))
            .unwrap();
        assert_eq!(out, [4.5f32; 64], "seed {seed}");
        release.send(()).unwrap();
        assert_eq!(download_f32(&b, &x, 64), [4.5f32; 64], "seed {seed}");
    }
}

#[test]
fn a_failed_operation_fails_every_later_call_and_skips_queued_work() {
    let b = CpuBackend::asynchronous(3).unwrap();
    let mut x = b.alloc(16).unwrap();
    b.run(Stream::Reduce, || Err(Error::ZeroWorldSize)).unwrap();
    let failed = |r: Result<()>| match r {
        Err(Error::StreamFailed {
            stream: Stream::Reduce,
            cause,
        }) => matches!(*cause, Error::ZeroWorldSize),
        _ => false,
    };
    // SAFETY: every use of x is on the reduce stream.
    let queued = unsafe {
        b.accumulate_input(
            Stream::Reduce,
            Input::host(&[2f32; 4]),
            &mut x,
            f32_region(4),
            1.0,
            false,
        )
    };
    // Queued behind the failure, or refused if the stream already failed when it came.
    assert!(queued.is_ok() || failed(queued));
    let done = b.record(Stream::Reduce);
    assert!(failed(done.and_then(|done| b.synchronize(&done))));
    assert!(failed(b.record(Stream::Compute).map(drop)));
    let mut out = [7u8; 16];
    assert!(failed(b.download(&x, f32_region(4), &mut out)));
    assert_eq!(out, [7u8; 16], "a failed download wrote its output");
}

#[test]
fn a_panicking_operation_fails_the_backend() {
    let b = CpuBackend::asynchronous(5).unwrap();
    b.run(Stream::Gather, || panic!("deliberate")).unwrap();
    let done = b.record(Stream::Gather).unwrap();
    assert!(matches!(
        b.synchronize(&done),
        Err(Error::StreamFailed { cause, .. }) if matches!(*cause, Error::WorkerPanicked { stream: Stream::Gather })
    ));
}

#[test]
fn dropping_the_backend_finishes_queued_work_on_memory_already_released() {
    let b = CpuBackend::asynchronous(9).unwrap();
    let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
    {
        let mut x = b.alloc(4096).unwrap();
        for _ in 0..32 {
            // SAFETY: every use of x is on the compute stream.
            unsafe { b.zero(Stream::Compute, &mut x, Region::new(0, 1024, DType::F32)) }.unwrap();
        }
    }
    assert_eq!(b.memory().current, 0);
    let seen = Arc::clone(&flag);
    b.run(Stream::Compute, move || {
        seen.store(true, Ordering::SeqCst);
        Ok(())
    })
    .unwrap();
    drop(b);
    assert!(flag.load(Ordering::SeqCst), "queued work was dropped");
}

/// SGD's update of one f32 element `p` with gradient `g` at `values`, as the host computes it.
fn sgd_on_host(values: &StepValues, group: GroupUpdate, p: f32, g: f32) -> f32 {
    let crate::optim::Update::Sgd {
        lr,
        weight_decay,
        grad_scale,
    } = group.coefficients(OptimizerKind::Sgd, values)
    else {
        unreachable!("SGD's coefficients")
    };
    crate::optim::sgd_element(p, g, lr, weight_decay, grad_scale)
}

#[test]
fn updates_read_the_step_values_the_stream_wrote_before_them() {
    use crate::optim::OptimizerConfig;
    let group = GroupUpdate {
        lr_scale: 0.3,
        decay: true,
    };
    let sgd = |lr| OptimizerConfig::Sgd {
        lr,
        weight_decay: 0.25,
    };
    // Two steps at different rates and clip factors, each written right before its update:
    // the second write must not reach the first update, however the stream runs.
    let steps = [sgd(0.5).step_values(1, 1.0), sgd(0.125).step_values(2, 0.5)];
    for b in backends() {
        let mut param = b.alloc(4).unwrap();
        let mut grad = b.alloc(4).unwrap();
        let mut values = b.alloc(STEP_VALUES_BYTES).unwrap();
        b.upload(&mut param, f32_region(1), &3.0f32.to_le_bytes())
            .unwrap();
        b.upload(&mut grad, f32_region(1), &2.0f32.to_le_bytes())
            .unwrap();
        for step in &steps {
            // SAFETY: every buffer is used on the compute stream only.
            unsafe { b.write_step_values(Stream::Compute, &mut values, step) }.unwrap();
            let shard = OptimizerShard {
                param: &mut param,
                dtype: DType::F32,
                numel: 1,
                grad: &grad,
                master: None,
                moments: None,
            };
            let update = StepUpdate {
                kind: OptimizerKind::Sgd,
                values: &values,
                group,
            };
            // SAFETY: as above.
            unsafe { b.optimizer_step(Stream::Compute, update, shard) }.unwrap();
        }
        let first = sgd_on_host(&steps[0], group, 3.0, 2.0);
        let expected = sgd_on_host(&steps[1], group, first, 2.0);
        assert_eq!(download_f32(&b, &param, 1), [expected]);
        assert_ne!(expected, sgd_on_host(&steps[1], group, 3.0, 2.0));
        let mut written = [0u8; STEP_VALUES_BYTES];
        b.download(&values, Region::new(0, 12, DType::F32), &mut written)
            .unwrap();
        assert_eq!(written, bytemuck::bytes_of(&steps[1]));
    }
}

#[test]
fn step_values_that_do_not_fit_their_buffer_are_refused() {
    for b in backends() {
        let mut short = b.alloc(STEP_VALUES_BYTES - 8).unwrap();
        let values = crate::optim::OptimizerConfig::default().step_values(1, 1.0);
        // SAFETY: nothing else uses the buffer.
        let r = unsafe { b.write_step_values(Stream::Compute, &mut short, &values) };
        assert!(
            matches!(
                r,
                Err(Error::OutOfRange {
                    offset: 0,
                    len: 48,
                    capacity: 40
                })
            ),
            "{r:?}"
        );
    }
}

/// Asynchronous backends of a few seeds.
fn asynchronous() -> Vec<CpuBackend> {
    (0..4)
        .map(|seed| CpuBackend::asynchronous(seed).unwrap())
        .collect()
}

#[test]
fn a_capture_runs_nothing_until_replayed_and_each_replay_runs_it_again_in_order() {
    for b in asynchronous() {
        let (mut x, mut y) = (b.alloc(4).unwrap(), b.alloc(4).unwrap());
        let mut one = b.alloc(4).unwrap();
        b.upload(&mut one, f32_region(1), &1.0f32.to_le_bytes())
            .unwrap();
        let one_address = b.stream_address(&one, f32_region(1)).unwrap();
        b.begin_capture(Stream::Compute).unwrap();
        // SAFETY (each call): `x` is written on compute, then read on gather after an event of
        // compute's; `y` is used on gather only; compute waits for gather before the end; `one`
        // outlives every replay.
        unsafe {
            (b.accumulate_input(
                Stream::Compute,
                Input::device(one_address, 1, DType::F32),
                &mut x,
                f32_region(1),
                1.0,
                true,
            ))
            .unwrap();
            let written = b.record(Stream::Compute).unwrap();
            b.wait(Stream::Gather, &written).unwrap();
            (b.accumulate(
                Stream::Gather,
                &x,
                f32_region(1),
                &mut y,
                f32_region(1),
                1.0,
                true,
            ))
            .unwrap();
        }
        let added = b.record(Stream::Gather).unwrap();
        b.wait(Stream::Compute, &added).unwrap();
        let graph = b.end_capture().unwrap();
        assert_eq!(download_f32(&b, &x, 1), [0.0], "nothing ran in the capture");
        for _ in 0..3 {
            // SAFETY: this backend captured the graph; its buffers live to the end of the test.
            unsafe { b.replay(&graph) }.unwrap();
        }
        // Each replay adds 1 to x, then x to y: y is 1 + 2 + 3.
        assert_eq!(download_f32(&b, &x, 1), [3.0]);
        assert_eq!(download_f32(&b, &y, 1), [6.0]);
    }
}

/// The error of `r`, which must be a capture's naming `what`.
fn assert_capture_error<T: std::fmt::Debug>(r: Result<T>, what: &str) {
    match r {
        Err(Error::Capture { what: message }) => {
            assert!(message.contains(what), "{message:?} names no {what:?}")
        }
        other => panic!("expected a capture error naming {what:?}, got {other:?}"),
    }
}

#[test]
fn what_a_capture_cannot_hold_is_an_error() {
    for b in asynchronous() {
        let mut x = b.alloc(4).unwrap();
        let scratch = b.alloc_scratch(4).unwrap();
        let outside = b.record(Stream::Gather).unwrap();
        assert_capture_error(b.end_capture(), "no capture under way");
        b.begin_capture(Stream::Compute).unwrap();
        assert_capture_error(b.begin_capture(Stream::Gather), "inside the capture");
        // SAFETY: nothing else uses `x`.
        let unjoined = unsafe { b.zero(Stream::Reduce, &mut x, f32_region(1)) };
        assert_capture_error(unjoined, "Reduce stream, which did not join");
        assert_capture_error(b.wait(Stream::Compute, &outside), "outside the capture");
        assert_capture_error(b.alloc(4), "an allocation");
        assert_capture_error(b.alloc_scratch(4), "an allocation");
        let host = [1.0f32];
        // SAFETY: nothing else uses `x`.
        let baked = unsafe {
            b.accumulate_input(
                Stream::Compute,
                Input::host(&host),
                &mut x,
                f32_region(1),
                1.0,
                true,
            )
        };
        assert_capture_error(baked, "a host input");
        assert_capture_error(b.free([scratch]), "a free");
        let mut out = [0u8; 4];
        assert_capture_error(b.download(&x, f32_region(1), &mut out), "a host wait");
        let point = b.record(Stream::Compute).unwrap();
        assert_capture_error(b.synchronize(&point), "a host wait");
        assert_capture_error(CpuBackend::reached(&point), "a query");
        // Gather joins, works, and is not joined back.
        b.wait(Stream::Gather, &point).unwrap();
        // SAFETY: as above.
        unsafe { b.zero(Stream::Gather, &mut x, f32_region(1)) }.unwrap();
        assert_capture_error(b.end_capture(), "Gather stream's work, not joined back");
        // The capture is over: the backend works as before, and nothing captured ran.
        b.upload(&mut x, f32_region(1), &2.5f32.to_le_bytes())
            .unwrap();
        assert_eq!(download_f32(&b, &x, 1), [2.5]);
        assert!(CpuBackend::reached(&outside).unwrap());
        // A point of the capture, waited for after it: refused, and the stream goes on.
        assert_capture_error(b.wait(Stream::Reduce, &point), "outside it");
        // SAFETY: as above.
        unsafe { b.zero(Stream::Reduce, &mut x, f32_region(1)) }.unwrap();
        assert_eq!(download_f32(&b, &x, 1), [0.0]);
    }
    let eager = CpuBackend::new();
    assert!(matches!(
        eager.begin_capture(Stream::Compute),
        Err(Error::Unsupported {
            backend: "cpu",
            what: "a capture"
        })
    ));
}
