//! Expert groups through the C API.

use super::*;

/// A dense parameter `w` and an expert parameter `e` sharded over groups of 2 ranks.
const EXPERT_MODEL: &str = r#"{"params": [
    {"name": "w", "shape": [8], "dtype": "f32", "unit": 0},
    {"name": "e", "shape": [8], "dtype": "f32", "unit": 0, "group": "experts"}
], "process_groups": [{"name": "experts", "size": 2}]}"#;

fn expert_plan(world: usize) -> *mut fsdp_plan {
    let json = CString::new(EXPERT_MODEL).unwrap();
    let mut plan = null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { fsdp_plan_from_json(json.as_ptr(), world, &mut plan) });
    plan
}

/// Group `group` of `engine` gathered (a collective), as f32.
fn gathered(engine: *mut fsdp_engine, group: usize) -> Vec<f32> {
    let mut bytes = vec![0u8; 1 << 16];
    let mut written = 0usize;
    // SAFETY: valid pointers.
    ok(unsafe {
        fsdp_engine_gather_group(
            engine,
            group,
            bytes.as_mut_ptr().cast(),
            bytes.len(),
            &mut written,
        )
    });
    bytes[..written]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// One SGD step (lr 0.5) of rank `rank` of the expert model: `w` starts at 1, `e` at its copy's
/// number plus 1 (rank / 2 + 1), and both gradients are `rank + 1`. Returns the view of `e` in
/// the forward and, after the step, both groups gathered (`w` first: the dense group sorts
/// first), each parameter's 8 values.
fn expert_step(engine: *mut fsdp_engine, rank: usize, memory: &impl CallerMemory) -> [Vec<f32>; 3] {
    let copy = (rank / 2) as f32;
    let grad = memory.gradient(&[(rank + 1) as f32; 8]);
    let (mut data, mut numel, mut dtype): (*const c_void, usize, u32) = (null(), 0, 0);
    // SAFETY: valid pointers; the gradient lives until the step is over.
    let view = unsafe {
        load_values(engine, &[vec![1.0; 8], vec![copy + 1.0; 8]]);
        ok(fsdp_engine_pre_forward(engine, 0));
        ok(fsdp_engine_param(
            engine, 1, &mut data, &mut numel, &mut dtype,
        ));
        let view = memory.read(data as u64, numel);
        ok(fsdp_engine_post_forward(engine, 0));
        ok(fsdp_engine_pre_backward(engine, 0));
        for param in [0, 1] {
            ok(fsdp_engine_grad(
                engine,
                param,
                grad as *const c_void,
                8,
                FSDP_F32,
            ));
        }
        ok(fsdp_engine_post_backward(engine, 0));
        end_the_step(engine);
        view
    };
    let [w, e] = [0, 1].map(|group| gathered(engine, group)[..8].to_vec());
    [view, w, e]
}

/// What every rank of 4 should see: its copy's `e` in the forward; `w` less 0.5 times the mean
/// of the 4 gradients; `e` less 0.5 times its copy's 2 gradients summed over the 4 ranks.
fn check_expert_steps(outcomes: &[[Vec<f32>; 3]]) {
    for (rank, [view, w, e]) in outcomes.iter().enumerate() {
        let copy = rank / 2;
        assert_close(view, &[(copy + 1) as f32; 8]);
        assert_close(w, &[1.0 - 0.5 * (1 + 2 + 3 + 4) as f32 / 4.0; 8]);
        let own = (2 * copy + 1 + 2 * copy + 2) as f32;
        assert_close(e, &[(copy + 1) as f32 - 0.5 * own / 4.0; 8]);
    }
}

#[test]
fn cpu_engines_with_an_expert_group_train_a_copy_per_group_through_the_c_api() {
    for_each_mode(|mode| {
        let plan = expert_plan(4) as usize;
        let group = local_group(mode, 4) as usize;
        let outcomes =
            within_deadline("four CPU ranks with experts through the C API", move || {
                let ranks: Vec<_> = (0..4)
                    .map(|rank| {
                        std::thread::spawn(move || {
                            let mut engine = null_mut();
                            // SAFETY: valid pointers.
                            ok(unsafe {
                                fsdp_engine_create_cpu(
                                    plan as *mut fsdp_plan,
                                    &sgd_config(),
                                    group as *mut fsdp_local_group,
                                    rank,
                                    &mut engine,
                                )
                            });
                            let outcome = expert_step(engine, rank, &Host::default());
                            ok(fsdp_engine_destroy(engine));
                            outcome
                        })
                    })
                    .collect();
                ranks
                    .into_iter()
                    .map(|r| r.join().expect("rank thread"))
                    .collect::<Vec<_>>()
            });
        check_expert_steps(&outcomes);
        ok(fsdp_local_group_destroy(group as *mut fsdp_local_group));
        ok(fsdp_plan_destroy(plan as *mut fsdp_plan));
    });
}

#[test]
fn an_expert_group_that_does_not_divide_the_world_or_a_rank_taken_twice_is_refused() {
    let json = CString::new(EXPERT_MODEL.replace("\"size\": 2", "\"size\": 3")).unwrap();
    let mut plan = null_mut();
    // SAFETY: valid pointers.
    unsafe {
        expect(
            fsdp_plan_from_json(json.as_ptr(), 4, &mut plan),
            fsdp_status::FSDP_INVALID_ARGUMENT,
            "3 ranks, which do not divide the 4",
        );
    }
    // A plan of 4 ranks in a group of 2 is refused as such, before any group of experts is made.
    let four = expert_plan(4);
    let pair = local_group(Mode::Eager, 2);
    let mut engine = null_mut();
    // SAFETY: valid pointers.
    unsafe {
        expect(
            fsdp_engine_create_cpu(four, &sgd_config(), pair, 0, &mut engine),
            fsdp_status::FSDP_INVALID_ARGUMENT,
            "world size 4, the communicator 2",
        );
    }
    ok(fsdp_local_group_destroy(pair));
    ok(fsdp_plan_destroy(four));
    // A refused engine gives its communicators back; a rank's second engine finds them taken.
    let json = CString::new(EXPERT_MODEL.replace("\"size\": 2", "\"size\": 1")).unwrap();
    let mut plan = null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { fsdp_plan_from_json(json.as_ptr(), 1, &mut plan) });
    let group = local_group(Mode::Eager, 1);
    let bad = fsdp_config {
        lr: -1.0,
        ..sgd_config()
    };
    // SAFETY: valid pointers.
    unsafe {
        expect(
            fsdp_engine_create_cpu(plan, &bad, group, 0, &mut engine),
            fsdp_status::FSDP_INVALID_ARGUMENT,
            "lr",
        );
        ok(fsdp_engine_create_cpu(
            plan,
            &sgd_config(),
            group,
            0,
            &mut engine,
        ));
        let mut second = null_mut();
        expect(
            fsdp_engine_create_cpu(plan, &sgd_config(), group, 0, &mut second),
            fsdp_status::FSDP_INVALID_ARGUMENT,
            "already taken",
        );
        ok(fsdp_engine_destroy(engine));
    }
    ok(fsdp_local_group_destroy(group));
    ok(fsdp_plan_destroy(plan));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_loopback_engines_with_an_expert_group_train_a_copy_per_group_through_the_c_api() {
    let plan = expert_plan(4) as usize;
    let mut group = null_mut();
    // SAFETY: valid pointer.
    unsafe { ok(fsdp_loopback_group_create(4, &mut group)) };
    let group = group as usize;
    let ranks: Vec<_> = (0..4)
        .map(|rank| {
            std::thread::spawn(move || {
                let _ctx = device::context();
                let stream = device::stream();
                let mut engine = null_mut();
                // SAFETY: valid pointers; the stream outlives the engine.
                unsafe {
                    ok(fsdp_engine_create_cuda_loopback(
                        plan as *mut fsdp_plan,
                        &sgd_config(),
                        0,
                        group as *mut fsdp_loopback_group,
                        rank,
                        stream,
                        null(),
                        &mut engine,
                    ));
                }
                let outcome = expert_step(engine, rank, &Device::on(stream));
                ok(fsdp_engine_destroy(engine));
                device::destroy_stream(stream);
                outcome
            })
        })
        .collect();
    let outcomes: Vec<_> = ranks
        .into_iter()
        .map(|r| r.join().expect("rank thread"))
        .collect();
    check_expert_steps(&outcomes);
    ok(fsdp_loopback_group_destroy(
        group as *mut fsdp_loopback_group,
    ));
    ok(fsdp_plan_destroy(plan as *mut fsdp_plan));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_nccl_engine_splits_its_communicators_for_an_expert_group_through_the_c_api() {
    let _ctx = device::context();
    let json = CString::new(EXPERT_MODEL.replace("\"size\": 2", "\"size\": 1")).unwrap();
    let mut plan = null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { fsdp_plan_from_json(json.as_ptr(), 1, &mut plan) });
    let engine = cuda_nccl_engine(plan, &sgd_config(), 0);
    let [view, w, e] = expert_step(engine, 0, &Device::on(0));
    assert_close(&view, &[1.0; 8]);
    assert_close(&w, &[0.5; 8]);
    assert_close(&e, &[0.5; 8]);
    ok(fsdp_engine_destroy(engine));
    ok(fsdp_plan_destroy(plan));
}
