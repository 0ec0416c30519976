//! Steps through the C API on every backend: the values they leave, gradient slots, non-finite
//! gradients, rates, norms, clipping, and the memory report.

use super::*;

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_nccl_engine_at_world_size_1_trains_a_step_through_the_c_api() {
    let _ctx = device::context();
    let plan = plan(1);
    let engine = cuda_nccl_engine(plan, &sgd_config(), 0);
    check_world_size_1_step(engine, plan, &Device::on(0));
    ok(fsdp_plan_destroy(plan));
}

/// One SGD step at world size 1 gives the expected shards, with no reduction; destroys the engine.
fn check_world_size_1_step(
    engine: *mut fsdp_engine,
    plan: *mut fsdp_plan,
    memory: &impl CallerMemory,
) {
    let [embed, w] = sgd_step(engine, plan, 0, memory);
    let values = initial_values();
    assert_close(&w, &after_sgd(&values[1], |i| 0.1 * i as f32, 1));
    assert_close(&embed, &after_sgd(&values[0], |i| 0.01 * i as f32, 1));
    let mut counters = fsdp_counters::default();
    // SAFETY: valid pointers.
    unsafe {
        ok(fsdp_engine_counters(engine, &mut counters));
        // At world size 1 the step's gradients went straight into the shards: no reduction.
        assert_eq!((counters.steps, counters.reduce_scatters), (1, 0));
        ok(fsdp_engine_destroy(engine));
    }
}

#[test]
fn a_cpu_engine_at_world_size_1_trains_a_step_through_the_c_api() {
    for_each_mode(|mode| {
        let plan = plan(1);
        let group = local_group(mode, 1);
        let mut engine = null_mut();
        // SAFETY: valid pointers.
        unsafe {
            ok(fsdp_engine_create_cpu(
                plan,
                &sgd_config(),
                group,
                0,
                &mut engine,
            ))
        };
        check_world_size_1_step(engine, plan, &Host::default());
        ok(fsdp_local_group_destroy(group));
        ok(fsdp_plan_destroy(plan));
    });
}

#[test]
fn cpu_engines_of_2_ranks_average_their_gradients_through_the_c_api() {
    for_each_mode(|mode| {
        let plan = plan(2);
        let group = local_group(mode, 2);
        let (plan_handle, group_handle) = (plan as usize, group as usize);
        let shards = within_deadline("two CPU ranks through the C API", move || {
            let ranks: Vec<_> = (0..2)
                .map(|rank| {
                    std::thread::spawn(move || {
                        let (plan, group) = (plan_handle as *mut fsdp_plan, group_handle as *mut _);
                        let mut engine = null_mut();
                        // SAFETY: valid pointers.
                        unsafe {
                            ok(fsdp_engine_create_cpu(
                                plan,
                                &sgd_config(),
                                group,
                                rank,
                                &mut engine,
                            ))
                        };
                        let [_, w] = sgd_step(engine, plan, rank, &Host::default());
                        ok(fsdp_engine_destroy(engine));
                        w
                    })
                })
                .collect();
            ranks
                .into_iter()
                .map(|r| r.join().expect("rank thread"))
                .collect::<Vec<_>>()
        });
        check_rank_shards_of_w(plan, &shards);
        ok(fsdp_local_group_destroy(group));
        ok(fsdp_plan_destroy(plan));
    });
}

/// Each rank's part of `w` after one SGD step on two ranks.
fn check_rank_shards_of_w(plan: *mut fsdp_plan, shards: &[Vec<f32>]) {
    let values = initial_values();
    let w = after_sgd(&values[1], |i| 0.1 * i as f32, 2);
    // Rank r holds its part of w's padded group: here the part of the 9 values it owns.
    let mut info = fsdp_param_info::default();
    // SAFETY: valid pointers.
    unsafe { ok(fsdp_plan_param_info(plan, 1, &mut info)) };
    let part = info.padded_numel / 2;
    for (rank, shard) in shards.iter().enumerate() {
        let own = (rank * part).min(9)..((rank + 1) * part).min(9);
        assert_close(&shard[..own.len()], &w[own]);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_loopback_engines_of_2_ranks_average_their_gradients_through_the_c_api() {
    let plan = plan(2);
    let config = sgd_config();
    let mut group = null_mut();
    // SAFETY: valid pointer.
    unsafe { ok(fsdp_loopback_group_create(2, &mut group)) };
    let (plan_handle, group_handle) = (plan as usize, group as usize);
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            std::thread::spawn(move || {
                let _ctx = device::context();
                let (plan, group) = (plan_handle as *mut fsdp_plan, group_handle as *mut _);
                let stream = device::stream();
                let mut engine = null_mut();
                // SAFETY: valid pointers; the stream outlives the engine.
                unsafe {
                    ok(fsdp_engine_create_cuda_loopback(
                        plan,
                        &config,
                        0,
                        group,
                        rank,
                        stream,
                        null(),
                        &mut engine,
                    ));
                }
                let [_, w] = sgd_step(engine, plan, rank, &Device::on(stream));
                ok(fsdp_engine_destroy(engine));
                device::destroy_stream(stream);
                w
            })
        })
        .collect();
    let shards: Vec<_> = ranks
        .into_iter()
        .map(|r| r.join().expect("rank thread"))
        .collect();
    check_rank_shards_of_w(plan, &shards);
    ok(fsdp_loopback_group_destroy(group));
    ok(fsdp_plan_destroy(plan));
}

#[test]
fn a_gradient_slot_holds_what_an_earlier_gradient_left_as_the_header_says() {
    for_each_mode(|mode| {
        let (plan, group, engine) = engine(mode);
        let g: Vec<f32> = (0..9).map(|i| i as f32 * 0.5 - 1.0).collect();
        let mut slot: *mut f32 = null_mut();
        // SAFETY: valid pointers; the slot is read between its opening and its commit.
        unsafe {
            ok(fsdp_engine_pre_backward(engine, 0));
            ok(fsdp_engine_grad(engine, 1, g.as_ptr().cast(), 9, FSDP_F32));
            end_the_step(engine);
            // At world size 1 the step's gradient of `w` went into its gradient shard, which is
            // the next step's slot for `w`: it is not zero-filled.
            ok(fsdp_engine_pre_backward(engine, 0));
            ok(fsdp_engine_grad_slot(engine, 1, &mut slot));
            assert_eq!(std::slice::from_raw_parts(slot, 9), &g[..]);
            ok(fsdp_engine_commit_grad(engine, 1));
            ok(fsdp_engine_destroy(engine));
            ok(fsdp_local_group_destroy(group));
            ok(fsdp_plan_destroy(plan));
        }
    });
}

#[test]
fn non_finite_gradients_are_counted_through_the_c_api() {
    for_each_mode(|mode| {
        let (plan, group, engine) = engine(mode);
        let mut g = [1.0f32; 9];
        g[4] = f32::NEG_INFINITY;
        let mut count = 0u64;
        // SAFETY: valid pointers.
        unsafe {
            expect(
                fsdp_engine_nonfinite_grads(engine, &mut count),
                fsdp_status::FSDP_MISUSE,
                "finish_grad_sync",
            );
            ok(fsdp_engine_grad(engine, 1, g.as_ptr().cast(), 9, FSDP_F32));
            ok(fsdp_engine_finish_grad_sync(engine));
            ok(fsdp_engine_nonfinite_grads(engine, &mut count));
            assert_eq!(count, 1);
            ok(fsdp_engine_destroy(engine));
            ok(fsdp_local_group_destroy(group));
            ok(fsdp_plan_destroy(plan));
        }
    });
}

/// A step whose gradient holds a NaN, skipped on the device through the C API, leaves the
/// shards as they were; the host counts it once it reads it, and the next step trains. Refused:
/// a read mid-step, a NULL out-pointer, the decision before the gradients are synced.
#[test]
fn a_step_with_a_nan_gradient_is_skipped_on_the_device_through_the_c_api() {
    for_each_mode(|mode| {
        let (plan, group, engine) = engine_with(mode, &sgd_config());
        let mut g = [1.0f32; 9];
        g[4] = f32::NAN;
        let (mut skipped, mut counters) = (0u64, fsdp_counters::default());
        let misuse = fsdp_status::FSDP_MISUSE;
        // The step's end, its update decided on the device.
        let skipping_on_the_device = |engine| {
            ok(fsdp_engine_finish_grad_sync(engine));
            ok(fsdp_engine_skip_nonfinite_on_device(engine));
            ok(fsdp_engine_optimizer_step(engine));
            ok(fsdp_engine_end_step(engine));
        };
        // SAFETY: valid pointers, or NULL on purpose.
        unsafe {
            load_values(engine, &initial_values());
            let before = shard_values(engine, plan, 1);
            ok(fsdp_engine_grad(engine, 1, g.as_ptr().cast(), 9, FSDP_F32));
            expect(
                fsdp_engine_skip_nonfinite_on_device(engine),
                misuse,
                "finish_grad_sync",
            );
            expect(
                fsdp_engine_read_device_skips(engine, &mut skipped),
                misuse,
                "step",
            );
            skipping_on_the_device(engine);
            assert_eq!(shard_values(engine, plan, 1), before, "the skipped step");
            ok(fsdp_engine_counters(engine, &mut counters));
            assert_eq!(counters.skipped_steps, 0, "not read yet");
            expect(
                fsdp_engine_read_device_skips(engine, null_mut()),
                NULL,
                "out",
            );
            ok(fsdp_engine_read_device_skips(engine, &mut skipped));
            assert_eq!(skipped, 1);
            ok(fsdp_engine_read_device_skips(engine, &mut skipped));
            assert_eq!(skipped, 0, "read once");
            ok(fsdp_engine_counters(engine, &mut counters));
            assert_eq!(counters.skipped_steps, 1);
            g[4] = 1.0;
            ok(fsdp_engine_grad(engine, 1, g.as_ptr().cast(), 9, FSDP_F32));
            skipping_on_the_device(engine);
            assert_ne!(
                shard_values(engine, plan, 1),
                before,
                "a finite step trains"
            );
            ok(fsdp_engine_destroy(engine));
        }
        ok(fsdp_local_group_destroy(group));
        ok(fsdp_plan_destroy(plan));
    });
}

#[test]
fn rates_norms_clipping_and_skipped_steps_through_the_c_api() {
    for_each_mode(|mode| {
        let (plan, group, engine) = engine_with(mode, &sgd_config());
        let values = initial_values();
        let g = [2.0f32; 9];
        let mut norm = fsdp_grad_norm::default();
        // SAFETY: valid pointers throughout.
        unsafe {
            load_values(engine, &values);
            expect(fsdp_engine_set_lr(engine, -1.0), BAD, "lr");
            expect(
                fsdp_engine_set_weight_decay(engine, f32::NAN),
                BAD,
                "weight_decay",
            );
            ok(fsdp_engine_set_lr(engine, 0.25));
            expect(
                fsdp_engine_grad_norm(engine, &mut norm),
                fsdp_status::FSDP_MISUSE,
                "finish_grad_sync",
            );
            ok(fsdp_engine_grad(engine, 1, g.as_ptr().cast(), 9, FSDP_F32));
            ok(fsdp_engine_finish_grad_sync(engine));
            expect(
                fsdp_engine_clip_grad_norm(engine, 1.0, null_mut()),
                NULL,
                "out",
            );
            expect(
                fsdp_engine_clip_grad_norm(engine, 0.0, &mut norm),
                BAD,
                "max_norm",
            );
            ok(fsdp_engine_clip_grad_norm(engine, 1.0, &mut norm));
            // Only w has a gradient: nine 2s.
            assert_eq!((norm.l2, norm.max), (6.0, 2.0));
            ok(fsdp_engine_optimizer_step(engine));
            ok(fsdp_engine_end_step(engine));
            let coefficient = 1.0f32 / (6.0 + 1e-6);
            let want: Vec<f32> = values[1]
                .iter()
                .map(|w| w - 0.25 * (2.0 * coefficient))
                .collect();
            assert_close(&shard_values(engine, plan, 1), &want);
            // A step whose gradients are synced but never applied is skipped and counted.
            ok(fsdp_engine_grad(engine, 1, g.as_ptr().cast(), 9, FSDP_F32));
            ok(fsdp_engine_finish_grad_sync(engine));
            ok(fsdp_engine_end_step(engine));
            assert_close(&shard_values(engine, plan, 1), &want);
            // Clipped on the device: the same coefficient, and the host waits for nothing.
            ok(fsdp_engine_grad(engine, 1, g.as_ptr().cast(), 9, FSDP_F32));
            ok(fsdp_engine_finish_grad_sync(engine));
            expect(
                fsdp_engine_clip_grad_norm_on_device(engine, f32::NAN),
                BAD,
                "max_norm",
            );
            ok(fsdp_engine_clip_grad_norm_on_device(engine, 1.0));
            ok(fsdp_engine_optimizer_step(engine));
            ok(fsdp_engine_end_step(engine));
            let want: Vec<f32> = want
                .iter()
                .map(|w| w - 0.25 * (2.0 * coefficient))
                .collect();
            assert_close(&shard_values(engine, plan, 1), &want);
            let mut counters = fsdp_counters::default();
            ok(fsdp_engine_counters(engine, &mut counters));
            assert_eq!((counters.steps, counters.skipped_steps), (3, 1));
            ok(fsdp_engine_destroy(engine));
            ok(fsdp_local_group_destroy(group));
            ok(fsdp_plan_destroy(plan));
        }
    });
}

#[test]
fn the_optimizer_steps_inside_the_backward_through_the_c_api() {
    for_each_mode(|mode| {
        let config = fsdp_config {
            step_in_backward: 1,
            ..sgd_config()
        };
        let (plan, group, engine) = engine_with(mode, &config);
        let values = initial_values();
        let g = [2.0f32; 9];
        let mut norm = fsdp_grad_norm::default();
        // SAFETY: valid pointers throughout.
        unsafe {
            load_values(engine, &values);
            ok(fsdp_engine_pre_backward(engine, 0));
            ok(fsdp_engine_grad(engine, 1, g.as_ptr().cast(), 9, FSDP_F32));
            // w is its group's only parameter: updated by the gradient's call, in the backward.
            let want: Vec<f32> = values[1].iter().map(|w| w - 0.5 * 2.0).collect();
            assert_close(&shard_values(engine, plan, 1), &want);
            expect(
                fsdp_engine_set_lr(engine, 0.25),
                fsdp_status::FSDP_MISUSE,
                "step_in_backward",
            );
            ok(fsdp_engine_post_backward(engine, 0));
            ok(fsdp_engine_finish_grad_sync(engine));
            expect(
                fsdp_engine_grad_norm(engine, &mut norm),
                fsdp_status::FSDP_MISUSE,
                "step_in_backward",
            );
            ok(fsdp_engine_optimizer_step(engine));
            ok(fsdp_engine_end_step(engine));
            // The embedding got no gradient: a zero one, as the ordinary step gives it.
            assert_close(&shard_values(engine, plan, 0), &values[0]);
            assert_close(&shard_values(engine, plan, 1), &want);
            let mut counters = fsdp_counters::default();
            ok(fsdp_engine_counters(engine, &mut counters));
            assert_eq!(counters.steps, 1);
            ok(fsdp_engine_destroy(engine));
            ok(fsdp_local_group_destroy(group));
            ok(fsdp_plan_destroy(plan));
        }
    });
}

#[test]
fn the_memory_report_follows_the_transport_and_the_accumulation_mode() {
    let plan = plan(2);
    let memory = |edit: &dyn Fn(&mut fsdp_config)| {
        let mut c = config();
        edit(&mut c);
        let mut m = fsdp_memory::default();
        // SAFETY: valid pointers.
        ok(unsafe { fsdp_plan_memory(plan, &c, &mut m) });
        m
    };
    let f32s = memory(&|_| {});
    let bf16 = memory(&|c| c.reduce_dtype = FSDP_BF16);
    let no_sync = memory(&|c| c.accumulation = FSDP_NO_SYNC);
    let staged = memory(&|c| {
        c.accumulation = FSDP_NO_SYNC;
        c.reduce_dtype = FSDP_BF16;
    });
    let keep = memory(&|c| c.accumulation = FSDP_KEEP_GATHERED);
    assert!(f32s.grad_slots > 0 && f32s.grad_accumulators == 0);
    assert_eq!(bf16.grad_slots * 2, f32s.grad_slots, "bf16 slots are half");
    assert_eq!(f32s.peak - bf16.peak, bf16.grad_slots);
    // fp32 accumulators reduced in place need no slot; bf16 transport stages them into one.
    assert_eq!(no_sync.grad_slots, 0);
    assert!(no_sync.grad_accumulators > 0);
    assert_eq!(staged.grad_slots, bf16.grad_slots);
    assert_eq!(staged.grad_accumulators, no_sync.grad_accumulators);
    // Keeping every group gathered takes a slot for each, as gathering the root's and the
    // unit's one unit at a time does here: they are all three.
    assert_eq!(keep.gathered_slots, f32s.gathered_slots);
    assert!(keep.gathered_slots > 0);
    let sum = |m: &fsdp_memory| {
        m.param_shards
            + m.grad_shards
            + m.optimizer_state
            + m.gathered_slots
            + m.grad_slots
            + m.grad_accumulators
    };
    for m in [f32s, bf16, no_sync, staged, keep] {
        assert_eq!(sum(&m), m.peak, "{m:?}");
        assert_eq!(m.between_steps, m.peak, "persistent gradient shards");
    }
    let per_step = memory(&|c| c.grad_shard_memory = FSDP_GRAD_SHARDS_PER_STEP);
    assert_eq!(per_step.peak, f32s.peak);
    assert_eq!(per_step.between_steps, f32s.peak - f32s.grad_shards);
    ok(fsdp_plan_destroy(plan));
}

#[test]
fn a_cpu_engine_with_per_step_gradient_shards_holds_them_only_within_a_step() {
    for_each_mode(|mode| {
        let plan = plan(1);
        let group = local_group(mode, 1);
        let mut c = config();
        c.grad_shard_memory = FSDP_GRAD_SHARDS_PER_STEP;
        let mut engine = null_mut();
        let mut m = fsdp_memory::default();
        let (mut current, mut peak) = (0usize, 0usize);
        // SAFETY: valid pointers.
        unsafe {
            ok(fsdp_engine_create_cpu(plan, &c, group, 0, &mut engine));
            ok(fsdp_plan_memory(plan, &c, &mut m));
            ok(fsdp_engine_memory(engine, &mut current, &mut peak));
        }
        assert!(m.grad_shards > 0);
        assert_eq!((current, peak), (m.between_steps, m.between_steps));
        sgd_step(engine, plan, 0, &Host::default());
        // SAFETY: valid pointers.
        unsafe { ok(fsdp_engine_memory(engine, &mut current, &mut peak)) };
        assert_eq!((current, peak), (m.between_steps, m.peak));
        ok(fsdp_engine_destroy(engine));
        ok(fsdp_local_group_destroy(group));
        ok(fsdp_plan_destroy(plan));
    });
}

/// The caller's capture through the C API: refused before a whole step and with no captured
/// step to replay; a step whose first work finds no capture of the compute stream is refused
/// with nothing changed, and the engine, given the capture up, trains on.
#[test]
fn a_callers_capture_through_the_c_api_refuses_and_gives_up_cleanly() {
    for_each_mode(|mode| {
        let (plan, group, engine) = engine_with(mode, &sgd_config());
        let values = initial_values();
        let g = [2.0f32; 9];
        let step = |engine| {
            // SAFETY: valid pointers.
            unsafe {
                ok(fsdp_engine_grad(engine, 1, g.as_ptr().cast(), 9, FSDP_F32));
                end_the_step(engine);
            }
        };
        // SAFETY: valid pointers throughout.
        unsafe {
            load_values(engine, &values);
            let misuse = fsdp_status::FSDP_MISUSE;
            expect(fsdp_engine_join_capture(engine), misuse, "warm-up");
            expect(
                fsdp_engine_before_replay(engine),
                misuse,
                "no captured step",
            );
            expect(fsdp_engine_replayed(engine), misuse, "no captured step");
            step(engine);
            let trained = shard_values(engine, plan, 1);
            ok(fsdp_engine_join_capture(engine));
            expect(fsdp_engine_join_capture(engine), misuse, "inside another");
            // No capture of the compute stream is under way (none on the eager backend).
            let refused = fsdp_engine_grad(engine, 1, g.as_ptr().cast(), 9, FSDP_F32);
            assert_ne!(refused, fsdp_status::FSDP_OK);
            assert_ne!(refused, fsdp_status::FSDP_POISONED);
            ok(fsdp_engine_abandon_capture(engine));
            ok(fsdp_engine_abandon_capture(engine));
            expect(
                fsdp_engine_leave_capture(engine),
                misuse,
                "no capture under way",
            );
            assert_eq!(shard_values(engine, plan, 1), trained);
            step(engine);
            assert_ne!(
                shard_values(engine, plan, 1),
                trained,
                "the engine trains on"
            );
            ok(fsdp_engine_destroy(engine));
            ok(fsdp_local_group_destroy(group));
            ok(fsdp_plan_destroy(plan));
        }
    });
}

/// What a host function of the test computes on the compute stream: `grad = 0.5 * values +
/// offset`, from the gathered values of `w` and an offset the host writes between steps.
struct GradJob {
    values: *const f32,
    grad: *mut f32,
    offset: *const f32,
    numel: usize,
}

unsafe extern "C" fn gradient_of_w(job: *mut c_void) {
    // SAFETY: a `GradJob` the test keeps alive until the engine is gone; its addresses are valid
    // in the compute stream's order (the gathered values between their unit's hooks).
    unsafe {
        let job = &*job.cast::<GradJob>();
        for i in 0..job.numel {
            *job.grad.add(i) = 0.5 * *job.values.add(i) + *job.offset;
        }
    }
}

/// Opens unit 0's backward: the address of `w`'s gathered values for the compute stream's work.
fn backward_of_w(engine: *mut fsdp_engine) -> *const f32 {
    let (mut values, mut numel, mut dtype) = (null(), 0usize, 0u32);
    ok(fsdp_engine_pre_backward(engine, 0));
    // SAFETY: valid pointers.
    ok(unsafe { fsdp_engine_param_device(engine, 1, &mut values, &mut numel, &mut dtype) });
    assert_eq!((numel, dtype), (9, FSDP_F32));
    values.cast()
}

/// One step whose gradient of `w` a host function computes on the compute stream from its
/// gathered values (`fsdp_engine_param_device`) and the engine reads there
/// (`fsdp_engine_grad_device`). `memory` holds the gradient's 9 floats, then the offset; each
/// queued job is kept in `jobs`, where it does not move.
///
/// # Safety
/// `memory` is valid for 10 floats until the engine is gone.
unsafe fn step_on_the_stream(
    engine: *mut fsdp_engine,
    memory: *mut f32,
    jobs: &mut Vec<std::pin::Pin<Box<GradJob>>>,
) {
    // SAFETY: valid pointers; the job outlives every call of it (kept in `jobs`).
    unsafe {
        jobs.push(Box::pin(GradJob {
            values: backward_of_w(engine),
            grad: memory,
            offset: memory.add(9),
            numel: 9,
        }));
        let job: *mut GradJob = &mut **jobs.last_mut().unwrap();
        ok(fsdp_engine_launch_host_func(
            engine,
            Some(gradient_of_w),
            job.cast(),
        ));
        ok(fsdp_engine_grad_device(
            engine,
            1,
            memory.cast(),
            9,
            FSDP_F32,
        ));
        ok(fsdp_engine_post_backward(engine, 0));
        end_the_step(engine);
    }
}

/// The engine's own capture through the C API, the model's work a host function on the compute
/// stream: on an asynchronous group the replays of the second step train as the same steps run
/// eagerly, bit for bit, under a learning rate changed every step; an eager group runs the host
/// function at once and cannot capture; a capture is refused before a whole step, a replay
/// without a captured step, a host read during the capture.
#[test]
fn an_engines_own_capture_through_the_c_api_replays_host_functions_as_eager_steps() {
    const STEPS: usize = 5;
    for_each_mode(|mode| {
        let train = |captured: bool| -> Vec<Vec<f32>> {
            let (plan, group, engine) = engine_with(mode, &sgd_config());
            let memory = Box::into_raw(vec![0f32; 10].into_boxed_slice()).cast::<f32>();
            let mut jobs = Vec::new();
            let mut shards = Vec::new();
            // SAFETY: valid pointers throughout; `memory` and the jobs outlive the engine.
            unsafe {
                load_values(engine, &initial_values());
                let misuse = fsdp_status::FSDP_MISUSE;
                expect(
                    fsdp_engine_replay(engine),
                    misuse,
                    "no step the engine captured",
                );
                expect(fsdp_engine_begin_capture(engine), misuse, "warm-up");
                expect(
                    fsdp_engine_launch_host_func(engine, None, null_mut()),
                    NULL,
                    "func",
                );
                for step in 0..STEPS {
                    memory.add(9).write(0.25 * step as f32 - 0.5);
                    ok(fsdp_engine_set_lr(engine, 0.5 / (1.0 + step as f32)));
                    match (captured, step) {
                        (true, 1) => {
                            ok(fsdp_engine_begin_capture(engine));
                            ok(fsdp_engine_pre_forward(engine, 0));
                            let (mut data, mut n, mut d) = (null(), 0usize, 0u32);
                            expect(
                                fsdp_engine_param(engine, 1, &mut data, &mut n, &mut d),
                                misuse,
                                "captur",
                            );
                            ok(fsdp_engine_post_forward(engine, 0));
                            step_on_the_stream(engine, memory, &mut jobs);
                            ok(fsdp_engine_end_capture(engine));
                            ok(fsdp_engine_replay(engine));
                        }
                        (true, 2..) => ok(fsdp_engine_replay(engine)),
                        _ => {
                            ok(fsdp_engine_pre_forward(engine, 0));
                            ok(fsdp_engine_post_forward(engine, 0));
                            step_on_the_stream(engine, memory, &mut jobs);
                        }
                    }
                    // A read of the shard waits for the stream: the host writes the next offset
                    // after the step's work.
                    shards.push(shard_values(engine, plan, 1));
                }
                ok(fsdp_engine_destroy(engine));
                drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                    memory, 10,
                )));
            }
            ok(fsdp_local_group_destroy(group));
            ok(fsdp_plan_destroy(plan));
            shards
        };
        let eager = train(false);
        for pair in eager.windows(2) {
            assert_ne!(pair[0], pair[1], "every step moves w");
        }
        match mode {
            Mode::Async(_) => assert_eq!(train(true), eager, "replays against eager steps"),
            Mode::Eager => {
                let (plan, group, engine) = engine_with(mode, &sgd_config());
                let mut memory = [0f32; 10];
                let mut jobs = Vec::new();
                // SAFETY: valid pointers; the engine is gone before `memory` and the jobs.
                unsafe {
                    load_values(engine, &initial_values());
                    ok(fsdp_engine_pre_forward(engine, 0));
                    ok(fsdp_engine_post_forward(engine, 0));
                    step_on_the_stream(engine, memory.as_mut_ptr(), &mut jobs);
                    // The eager group ran the host function within its call.
                    let w = &initial_values()[1];
                    let want: Vec<f32> = w.iter().map(|v| 0.5 * v).collect();
                    assert_eq!(&memory[..9], &want[..]);
                    expect(fsdp_engine_begin_capture(engine), UNAVAILABLE, "capture");
                    ok(fsdp_engine_destroy(engine));
                }
                ok(fsdp_local_group_destroy(group));
                ok(fsdp_plan_destroy(plan));
            }
        }
    });
}

unsafe extern "C" fn count_a_call(counter: *mut c_void) {
    // SAFETY: an `AtomicUsize` the test keeps alive until its engine is gone.
    unsafe { &*counter.cast::<std::sync::atomic::AtomicUsize>() }
        .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

/// A CUDA engine's own capture through the C API: a host function queued on its compute stream
/// (`cuLaunchHostFunc`) is called once a step, eager or replayed, and the replays train as the
/// same steps run eagerly, bit for bit, under a learning rate changed every step (the gradient a
/// device buffer holds, handed over with `fsdp_engine_grad_device`, the values read with
/// `fsdp_engine_param_device`).
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_cuda_engines_own_capture_through_the_c_api_replays_its_host_functions() {
    const STEPS: usize = 5;
    let _ctx = device::context();
    let train = |captured: bool| -> (Vec<Vec<f32>>, usize) {
        let plan = plan(1);
        let stream = device::stream();
        let gradient = device::upload(stream, &(0..9).map(|i| 0.1 * i as f32).collect::<Vec<_>>());
        let calls = std::sync::atomic::AtomicUsize::new(0);
        let counter = (&calls as *const std::sync::atomic::AtomicUsize)
            .cast_mut()
            .cast();
        let engine = cuda_nccl_engine(plan, &sgd_config(), stream);
        let mut shards = Vec::new();
        // SAFETY: valid pointers throughout; the gradient buffer and the counter outlive the
        // engine.
        unsafe {
            load_values(engine, &initial_values());
            let step = |engine| {
                ok(fsdp_engine_pre_forward(engine, 0));
                ok(fsdp_engine_post_forward(engine, 0));
                backward_of_w(engine);
                ok(fsdp_engine_launch_host_func(
                    engine,
                    Some(count_a_call),
                    counter,
                ));
                ok(fsdp_engine_grad_device(
                    engine,
                    1,
                    gradient as *const c_void,
                    9,
                    FSDP_F32,
                ));
                ok(fsdp_engine_post_backward(engine, 0));
                end_the_step(engine);
            };
            for s in 0..STEPS {
                ok(fsdp_engine_set_lr(engine, 0.5 / (1.0 + s as f32)));
                match (captured, s) {
                    (true, 1) => {
                        ok(fsdp_engine_begin_capture(engine));
                        step(engine);
                        ok(fsdp_engine_end_capture(engine));
                        ok(fsdp_engine_replay(engine));
                    }
                    (true, 2..) => ok(fsdp_engine_replay(engine)),
                    _ => step(engine),
                }
                shards.push(shard_values(engine, plan, 1));
            }
            ok(fsdp_engine_destroy(engine));
        }
        device::free(stream, gradient);
        device::destroy_stream(stream);
        ok(fsdp_plan_destroy(plan));
        (shards, calls.into_inner())
    };
    let (eager, eager_calls) = train(false);
    let (replayed, replayed_calls) = train(true);
    assert_eq!((eager_calls, replayed_calls), (STEPS, STEPS));
    for pair in eager.windows(2) {
        assert_ne!(pair[0], pair[1], "every step moves w");
    }
    assert_eq!(replayed, eager, "replays against eager steps");
    // An engine destroyed during its capture, between steps and mid-step, gives the capture up:
    // the caller's stream is not left capturing.
    for mid_step in [false, true] {
        let plan = plan(1);
        let stream = device::stream();
        let gradient = device::upload(stream, &[0.25; 9]);
        let engine = cuda_nccl_engine(plan, &sgd_config(), stream);
        load_values(engine, &initial_values());
        let step = |engine| {
            ok(fsdp_engine_pre_forward(engine, 0));
            ok(fsdp_engine_post_forward(engine, 0));
            backward_of_w(engine);
            // SAFETY: the gradient holds 9 floats and outlives the engine.
            let g = gradient as *const c_void;
            ok(unsafe { fsdp_engine_grad_device(engine, 1, g, 9, FSDP_F32) });
            ok(fsdp_engine_post_backward(engine, 0));
            end_the_step(engine);
        };
        step(engine);
        ok(fsdp_engine_begin_capture(engine));
        match mid_step {
            true => ok(fsdp_engine_pre_forward(engine, 0)),
            false => step(engine),
        }
        assert!(
            device::capturing(stream),
            "mid-step {mid_step}: the capture began"
        );
        ok(fsdp_engine_destroy(engine));
        assert!(
            !device::capturing(stream),
            "mid-step {mid_step}: left capturing"
        );
        device::free(stream, gradient);
        device::destroy_stream(stream);
        ok(fsdp_plan_destroy(plan));
    }
}

/// The calls for work on the stream and the engine's own capture refuse what they cannot do,
/// with a status and a message: NULL pointers, a view outside its unit's hooks, an end with no
/// capture of the engine's, mid-step or of the caller's capture, a replay mid-step; a capture
/// given up mid-step poisons the engine (its abandon says so), and a poisoned or aborted engine
/// queues nothing.
#[test]
fn stream_work_and_the_engines_capture_refuse_with_a_status() {
    let misuse = fsdp_status::FSDP_MISUSE;
    let g = [1.0f32; 9];
    let counter = std::sync::atomic::AtomicUsize::new(0);
    let count = (&counter as *const std::sync::atomic::AtomicUsize)
        .cast_mut()
        .cast();
    // An engine of an asynchronous group after one whole step.
    let stepped = || {
        let (plan, group, engine) = engine_with(Mode::Async(0), &sgd_config());
        load_values(engine, &initial_values());
        // SAFETY: `g` holds 9 floats.
        ok(unsafe { fsdp_engine_grad(engine, 1, g.as_ptr().cast(), 9, FSDP_F32) });
        end_the_step(engine);
        (plan, group, engine)
    };
    let (mut data, mut numel, mut dtype) = (null(), 0usize, 0u32);
    let (plan, group, engine) = stepped();
    // SAFETY: valid pointers, or NULL on purpose; `g` outlives the engine.
    unsafe {
        let view = |d, n, t| fsdp_engine_param_device(engine, 1, d, n, t);
        expect(view(null_mut(), &mut numel, &mut dtype), NULL, "data");
        expect(view(&mut data, null_mut(), &mut dtype), NULL, "numel");
        expect(view(&mut data, &mut numel, &mut dtype), misuse, "gathered");
        expect(
            fsdp_engine_grad_device(engine, 1, null(), 9, FSDP_F32),
            NULL,
            "data",
        );
        expect(fsdp_engine_end_capture(engine), misuse, "capture");
        ok(fsdp_engine_begin_capture(engine));
        ok(fsdp_engine_grad_device(
            engine,
            1,
            g.as_ptr().cast(),
            9,
            FSDP_F32,
        ));
        end_the_step(engine);
        ok(fsdp_engine_end_capture(engine));
        ok(fsdp_engine_pre_forward(engine, 0));
        expect(fsdp_engine_replay(engine), misuse, "a step is under way");
        ok(fsdp_engine_post_forward(engine, 0));
        ok(fsdp_engine_abort(engine));
        // An aborted engine is poisoned by its abort.
        expect(
            fsdp_engine_launch_host_func(engine, Some(count_a_call), count),
            fsdp_status::FSDP_POISONED,
            "aborted",
        );
        ok(fsdp_engine_destroy(engine));
    }
    ok(fsdp_local_group_destroy(group));
    ok(fsdp_plan_destroy(plan));
    let (plan, group, engine) = stepped();
    // SAFETY: valid pointers.
    unsafe {
        ok(fsdp_engine_join_capture(engine));
        expect(fsdp_engine_end_capture(engine), misuse, "caller");
        ok(fsdp_engine_abandon_capture(engine));
        ok(fsdp_engine_begin_capture(engine));
        ok(fsdp_engine_pre_forward(engine, 0));
        expect(
            fsdp_engine_end_capture(engine),
            misuse,
            "a step is under way",
        );
        let poisoned = fsdp_status::FSDP_POISONED;
        expect(fsdp_engine_abandon_capture(engine), poisoned, "abandoned");
        expect(
            fsdp_engine_launch_host_func(engine, Some(count_a_call), count),
            poisoned,
            "abandoned",
        );
        // A poisoned engine says so before anything else is checked: it keeps no step, and
        // steps in the backward are not asked about.
        for refused in [
            fsdp_engine_replay(engine),
            fsdp_engine_before_replay(engine),
            fsdp_engine_replayed(engine),
            fsdp_engine_skip_nonfinite_on_device(engine),
            fsdp_engine_clip_grad_norm_on_device(engine, -1.0),
        ] {
            expect(refused, poisoned, "abandoned");
        }
        ok(fsdp_engine_destroy(engine));
    }
    assert_eq!(
        counter.into_inner(),
        0,
        "a failed engine queued the function"
    );
    ok(fsdp_local_group_destroy(group));
    ok(fsdp_plan_destroy(plan));
}
