//! Misuse: NULL pointers, destroyed handles, bad sizes and values, hooks out of order, flags and
//! timeouts that are not what they say.

use super::*;

#[test]
fn null_for_every_pointer_argument() {
    for_each_mode(|mode| {
        let (plan, group, engine) = engine(mode);
        let config = config();
        let json = CString::new(MODEL).unwrap();
        let name = CString::new("w").unwrap();
        let mut out_plan = null_mut();
        let mut out_engine = null_mut();
        let mut size = 0usize;
        let mut info = fsdp_param_info::default();
        let mut memory = fsdp_memory::default();
        let mut counters = fsdp_counters::default();
        let mut data: *const c_void = null();
        let mut dtype = 0u32;
        let mut slot: *mut f32 = null_mut();
        let mut buf = [0u8; 64];
        let shape = [3u64];
        let spec = |name: *const std::ffi::c_char, shape: *const u64| fsdp_param_spec {
            name,
            shape,
            ndim: 1,
            dtype: FSDP_F32,
            unit: FSDP_ROOT,
            trainable: 1,
            tied: 0,
            no_weight_decay: 0,
            lr_scale: 0.0,
        };
        let nameless = [spec(null(), shape.as_ptr())];
        // SAFETY: every pointer is valid or NULL; NULL is what is being tested.
        unsafe {
            expect(fsdp_config_default(null_mut()), NULL, "out");
            expect(fsdp_plan_from_json(null(), 1, &mut out_plan), NULL, "json");
            expect(
                fsdp_plan_from_json(json.as_ptr(), 1, null_mut()),
                NULL,
                "out",
            );
            expect(fsdp_plan_from_file(null(), 1, &mut out_plan), NULL, "path");
            expect(
                fsdp_plan_from_file(json.as_ptr(), 1, null_mut()),
                NULL,
                "out",
            );
            expect(
                fsdp_plan_from_specs(null(), 1, 1, &mut out_plan),
                NULL,
                "specs",
            );
            expect(
                fsdp_plan_from_specs(nameless.as_ptr(), 1, 1, &mut out_plan),
                NULL,
                "name",
            );
            let good = [spec(name.as_ptr(), shape.as_ptr())];
            expect(
                fsdp_plan_from_specs(good.as_ptr(), 1, 1, null_mut()),
                NULL,
                "out",
            );
            expect(fsdp_plan_param_count(null(), &mut size), NULL, "plan");
            expect(fsdp_plan_param_count(plan, null_mut()), NULL, "out");
            expect(
                fsdp_plan_param_id(null(), name.as_ptr(), &mut size),
                NULL,
                "plan",
            );
            expect(fsdp_plan_param_id(plan, null(), &mut size), NULL, "name");
            expect(
                fsdp_plan_param_id(plan, name.as_ptr(), null_mut()),
                NULL,
                "out",
            );
            expect(fsdp_plan_param_info(null(), 0, &mut info), NULL, "plan");
            expect(fsdp_plan_param_info(plan, 0, null_mut()), NULL, "out");
            expect(fsdp_plan_memory(null(), &config, &mut memory), NULL, "plan");
            expect(fsdp_plan_memory(plan, null(), &mut memory), NULL, "config");
            expect(fsdp_plan_memory(plan, &config, null_mut()), NULL, "out");
            expect(fsdp_local_group_create(1, null_mut()), NULL, "out");
            expect(
                fsdp_engine_create_cpu(null(), &config, group, 0, &mut out_engine),
                NULL,
                "plan",
            );
            expect(
                fsdp_engine_create_cpu(plan, null(), group, 0, &mut out_engine),
                NULL,
                "config",
            );
            expect(
                fsdp_engine_create_cpu(plan, &config, null_mut(), 0, &mut out_engine),
                NULL,
                "group",
            );
            expect(
                fsdp_engine_create_cpu(plan, &config, group, 0, null_mut()),
                NULL,
                "out",
            );
            for hook in [
                fsdp_engine_pre_forward,
                fsdp_engine_post_forward,
                fsdp_engine_pre_backward,
                fsdp_engine_post_backward,
            ] {
                expect(hook(null_mut(), 0), NULL, "engine");
            }
            expect(
                fsdp_engine_load_param(null_mut(), 1, buf.as_ptr().cast(), 9, FSDP_F32),
                NULL,
                "engine",
            );
            expect(
                fsdp_engine_load_param(engine, 1, null(), 9, FSDP_F32),
                NULL,
                "data",
            );
            expect(
                fsdp_engine_param(null_mut(), 1, &mut data, &mut size, &mut dtype),
                NULL,
                "engine",
            );
            expect(
                fsdp_engine_param(engine, 1, null_mut(), &mut size, &mut dtype),
                NULL,
                "data",
            );
            expect(
                fsdp_engine_param(engine, 1, &mut data, null_mut(), &mut dtype),
                NULL,
                "numel",
            );
            expect(
                fsdp_engine_param(engine, 1, &mut data, &mut size, null_mut()),
                NULL,
                "dtype",
            );
            expect(
                fsdp_engine_grad(null_mut(), 1, buf.as_ptr().cast(), 9, FSDP_F32),
                NULL,
                "engine",
            );
            expect(
                fsdp_engine_grad(engine, 1, null(), 9, FSDP_F32),
                NULL,
                "data",
            );
            expect(
                fsdp_engine_grad_slot(null_mut(), 1, &mut slot),
                NULL,
                "engine",
            );
            expect(fsdp_engine_grad_slot(engine, 1, null_mut()), NULL, "out");
            expect(fsdp_engine_commit_grad(null_mut(), 1), NULL, "engine");
            expect(fsdp_engine_finish_grad_sync(null_mut()), NULL, "engine");
            expect(fsdp_engine_optimizer_step(null_mut()), NULL, "engine");
            expect(fsdp_engine_end_step(null_mut()), NULL, "engine");
            expect(
                fsdp_engine_counters(null_mut(), &mut counters),
                NULL,
                "engine",
            );
            expect(fsdp_engine_counters(engine, null_mut()), NULL, "out");
            expect(
                fsdp_engine_memory(null_mut(), &mut size, &mut size),
                NULL,
                "engine",
            );
            expect(
                fsdp_engine_memory(engine, null_mut(), &mut size),
                NULL,
                "current",
            );
            expect(
                fsdp_engine_memory(engine, &mut size, null_mut()),
                NULL,
                "peak",
            );
            expect(
                fsdp_engine_param_shard(null_mut(), 0, buf.as_mut_ptr().cast(), 64, &mut size),
                NULL,
                "engine",
            );
            expect(
                fsdp_engine_param_shard(engine, 0, null_mut(), 64, &mut size),
                NULL,
                "out",
            );
            expect(
                fsdp_engine_param_shard(engine, 0, buf.as_mut_ptr().cast(), 64, null_mut()),
                NULL,
                "written",
            );
            // Too small: the size needed comes back, `out` untouched.
            let mut needed = 0usize;
            let mut small = [7u8; 1];
            expect(
                fsdp_engine_param_shard(engine, 0, small.as_mut_ptr().cast(), 1, &mut needed),
                fsdp_status::FSDP_INVALID_ARGUMENT,
                "out holds 1",
            );
            assert_eq!(small, [7]);
            // A NULL `out` of no bytes asks the size.
            let mut asked = 0usize;
            expect(
                fsdp_engine_param_shard(engine, 0, null_mut(), 0, &mut asked),
                fsdp_status::FSDP_INVALID_ARGUMENT,
                "out holds 0",
            );
            assert_eq!(asked, needed);
            let mut whole = vec![0u8; needed];
            ok(fsdp_engine_param_shard(
                engine,
                0,
                whole.as_mut_ptr().cast(),
                whole.len(),
                &mut size,
            ));
            assert_eq!(size, needed);
            // Destroying NULL is allowed.
            ok(fsdp_engine_destroy(null_mut()));
            ok(fsdp_local_group_destroy(null_mut()));
            ok(fsdp_plan_destroy(null_mut()));
            // After all that, the engine still works.
            ok(fsdp_engine_pre_forward(engine, 0));
            ok(fsdp_engine_post_forward(engine, 0));
            ok(fsdp_engine_end_step(engine));
            ok(fsdp_engine_destroy(engine));
            ok(fsdp_local_group_destroy(group));
            ok(fsdp_plan_destroy(plan));
        }
    });
}

#[test]
fn a_destroyed_handle_is_reported_on_every_later_call() {
    for_each_mode(|mode| {
        let (plan, group, engine) = engine(mode);
        let mut size = 0usize;
        let mut counters = fsdp_counters::default();
        // SAFETY: valid pointers; the handles are stale on purpose.
        unsafe {
            ok(fsdp_engine_destroy(engine));
            let stale = fsdp_status::FSDP_INVALID_HANDLE;
            expect(fsdp_engine_pre_forward(engine, 0), stale, "not live");
            expect(
                fsdp_engine_counters(engine, &mut counters),
                stale,
                "not live",
            );
            expect(fsdp_engine_destroy(engine), stale, "not live");
            ok(fsdp_plan_destroy(plan));
            expect(fsdp_plan_param_count(plan, &mut size), stale, "not live");
            expect(fsdp_plan_destroy(plan), stale, "not live");
            // A made-up handle, and a live handle of the wrong kind.
            expect(
                fsdp_engine_end_step(0x1234 as *mut fsdp_engine),
                stale,
                "not live",
            );
            expect(fsdp_engine_end_step(group.cast()), stale, "another kind");
            expect(fsdp_plan_destroy(group.cast()), stale, "another kind");
            ok(fsdp_local_group_destroy(group));
        }
    });
}

#[test]
fn wrong_sizes_and_values() {
    for_each_mode(|mode| {
        let (plan, group, engine) = engine(mode);
        let config = config();
        let values = [0.5f32; 12];
        let mut out_plan = null_mut();
        let mut out_engine = null_mut();
        let mut buf = [0u8; 8];
        let mut written = 0usize;
        let bad = fsdp_status::FSDP_INVALID_ARGUMENT;
        // SAFETY: valid pointers throughout.
        unsafe {
            // Between steps: a load inside one is refused as such first.
            expect(
                fsdp_engine_load_param(engine, 0, values.as_ptr().cast(), 11, FSDP_F32),
                bad,
                "11 elements",
            );
            // Lengths and addresses no slice can take are refused before any is read.
            expect(
                fsdp_engine_load_param(engine, 0, values.as_ptr().cast(), 1 << 62, FSDP_BF16),
                bad,
                "more than memory holds",
            );
            let grads = [fsdp_grad {
                param: 1,
                data: values.as_ptr().cast(),
                numel: 9,
                dtype: FSDP_F32,
            }; 2];
            let misaligned = grads
                .as_ptr()
                .cast::<u8>()
                .wrapping_add(1)
                .cast::<fsdp_grad>();
            expect(fsdp_engine_grads(engine, misaligned, 1), bad, "not aligned");
            ok(fsdp_engine_pre_backward(engine, 0));
            expect(
                fsdp_engine_load_param(engine, 0, values.as_ptr().cast(), 12, FSDP_F32),
                fsdp_status::FSDP_MISUSE,
                "between end_step and the next step's first hook",
            );
            expect(
                fsdp_engine_grad(engine, 1, values.as_ptr().cast(), 8, FSDP_F32),
                bad,
                "8 elements",
            );
            expect(
                fsdp_engine_grad(engine, 1, values.as_ptr().cast(), 9, 7),
                bad,
                "dtype 7",
            );
            expect(
                fsdp_engine_grad(engine, 9, values.as_ptr().cast(), 9, FSDP_F32),
                bad,
                "out of range",
            );
            expect(
                fsdp_engine_param_shard(engine, 0, buf.as_mut_ptr().cast(), 8, &mut written),
                bad,
                "out holds 8",
            );
            expect(fsdp_engine_pre_forward(engine, -2), bad, "unit -2");
            let mut c = config;
            c.optimizer = 5;
            let json = CString::new(MODEL).unwrap();
            expect(
                fsdp_plan_memory(plan, &c, &mut fsdp_memory::default()),
                bad,
                "optimizer 5",
            );
            c = config;
            c.grad_reduction = FSDP_SCALED;
            c.grad_scale = f32::NAN;
            expect(
                fsdp_plan_memory(plan, &c, &mut fsdp_memory::default()),
                bad,
                "a scale of NaN",
            );
            c.grad_reduction = 3;
            expect(
                fsdp_plan_memory(plan, &c, &mut fsdp_memory::default()),
                bad,
                "grad_reduction 3",
            );
            // A dtype field names itself and lists only what it takes.
            type Set = fn(&mut fsdp_config, u32);
            let fields: [(&str, Set); 2] = [
                ("reduce_dtype", |c, code| c.reduce_dtype = code),
                ("moment_dtype", |c, code| c.moment_dtype = code),
            ];
            for ((field, set), code) in fields.into_iter().flat_map(|f| [(f, FSDP_F16), (f, 9)]) {
                c = config;
                set(&mut c, code);
                expect(
                    fsdp_plan_memory(plan, &c, &mut fsdp_memory::default()),
                    bad,
                    &format!("{field} is {code}, not FSDP_F32 or FSDP_BF16"),
                );
            }
            c = config;
            c.accumulation = 7;
            expect(
                fsdp_plan_memory(plan, &c, &mut fsdp_memory::default()),
                bad,
                "accumulation 7",
            );
            c = config;
            c.grad_shard_memory = 2;
            expect(
                fsdp_plan_memory(plan, &c, &mut fsdp_memory::default()),
                bad,
                "grad_shard_memory 2",
            );
            c = config;
            c.double_buffer_limit = 0;
            expect(
                fsdp_engine_create_cpu(plan, &c, group, 0, &mut out_engine),
                bad,
                "double_buffer_limit",
            );
            expect(
                fsdp_plan_from_json(json.as_ptr(), 0, &mut out_plan),
                bad,
                "world size",
            );
            let broken = CString::new("{\"params\": [\n  {\"name\": 1}]}").unwrap();
            expect(
                fsdp_plan_from_json(broken.as_ptr(), 1, &mut out_plan),
                bad,
                "line 2",
            );
            expect(
                fsdp_engine_create_cpu(plan, &config, group, 1, &mut out_engine),
                bad,
                "rank 1",
            );
            expect(
                fsdp_engine_create_cpu(plan, &config, group, 0, &mut out_engine),
                bad,
                "already taken",
            );
            let missing = CString::new("no/such/model.json").unwrap();
            expect(
                fsdp_plan_from_file(missing.as_ptr(), 1, &mut out_plan),
                fsdp_status::FSDP_IO_ERROR,
                "no/such",
            );
            ok(fsdp_engine_destroy(engine));
            ok(fsdp_local_group_destroy(group));
            ok(fsdp_plan_destroy(plan));
        }
    });
}

#[test]
fn hooks_out_of_order() {
    for_each_mode(|mode| {
        let (plan, group, engine) = engine(mode);
        let misuse = fsdp_status::FSDP_MISUSE;
        let g = [1.0f32; 9];
        let mut slot = null_mut();
        // SAFETY: valid pointers throughout.
        unsafe {
            expect(fsdp_engine_post_forward(engine, 0), misuse, "not started");
            expect(fsdp_engine_pre_forward(engine, 5), misuse, "unit 5");
            expect(
                fsdp_engine_grad(engine, 2, g.as_ptr().cast(), 3, FSDP_F32),
                misuse,
                "frozen",
            );
            ok(fsdp_engine_grad(engine, 1, g.as_ptr().cast(), 9, FSDP_F32));
            expect(
                fsdp_engine_grad(engine, 1, g.as_ptr().cast(), 9, FSDP_F32),
                misuse,
                "already received",
            );
            expect(fsdp_engine_end_step(engine), misuse, "finish_grad_sync");
            expect(
                fsdp_engine_optimizer_step(engine),
                misuse,
                "finish_grad_sync",
            );
            expect(
                fsdp_engine_commit_grad(engine, 0),
                misuse,
                "no open gradient slot",
            );
            ok(fsdp_engine_grad_slot(engine, 0, &mut slot));
            expect(fsdp_engine_finish_grad_sync(engine), misuse, "commit");
            ok(fsdp_engine_commit_grad(engine, 0));
            ok(fsdp_engine_finish_grad_sync(engine));
            ok(fsdp_engine_optimizer_step(engine));
            expect(
                fsdp_engine_optimizer_step(engine),
                misuse,
                "already stepped",
            );
            ok(fsdp_engine_end_step(engine));
            let mut counters = fsdp_counters::default();
            ok(fsdp_engine_counters(engine, &mut counters));
            // At world size 1 the step's gradients went straight into the shards: no reduction.
            assert_eq!((counters.steps, counters.reduce_scatters), (1, 0));
            ok(fsdp_engine_destroy(engine));
            ok(fsdp_local_group_destroy(group));
            ok(fsdp_plan_destroy(plan));
        }
    });
}

#[test]
fn flags_and_timeouts_that_are_not_what_they_say_are_refused() {
    let plan = plan(1);
    let group = local_group(Mode::Eager, 1);
    let mut engine = null_mut();
    let mut out_plan = null_mut();
    let name = CString::new("w").unwrap();
    let shape = [3u64];
    let spec = fsdp_param_spec {
        name: name.as_ptr(),
        shape: shape.as_ptr(),
        ndim: 1,
        dtype: FSDP_F32,
        unit: FSDP_ROOT,
        trainable: 2,
        tied: 0,
        no_weight_decay: 0,
        lr_scale: 0.0,
    };
    // SAFETY: valid pointers.
    unsafe {
        expect(
            fsdp_plan_from_specs(&spec, 1, 1, &mut out_plan),
            BAD,
            "specs[0].trainable is 2, not 0 or 1",
        );
        let undecided = fsdp_param_spec {
            trainable: 1,
            no_weight_decay: 3,
            ..spec
        };
        expect(
            fsdp_plan_from_specs(&undecided, 1, 1, &mut out_plan),
            BAD,
            "specs[0].no_weight_decay is 3, not 0 or 1",
        );
        for scale in [-1.0f32, f32::NAN, f32::INFINITY] {
            let scaled = fsdp_param_spec {
                trainable: 1,
                lr_scale: scale,
                ..spec
            };
            expect(
                fsdp_plan_from_specs(&scaled, 1, 1, &mut out_plan),
                BAD,
                "lr_scale",
            );
        }
        let nameless = fsdp_param_spec {
            name: null(),
            trainable: 1,
            ..spec
        };
        let specs = [
            fsdp_param_spec {
                trainable: 1,
                ..spec
            },
            nameless,
        ];
        expect(
            fsdp_plan_from_specs(specs.as_ptr(), 2, 1, &mut out_plan),
            NULL,
            "specs[1].name",
        );
        for (overlap, timeout, words) in [
            (7u8, 600.0, "overlap is 7"),
            (1, 0.0, "timeout_seconds is 0"),
            (1, -1.0, "timeout_seconds is -1"),
            (1, f64::NAN, "timeout_seconds is NaN"),
        ] {
            let c = fsdp_config {
                overlap,
                timeout_seconds: timeout,
                ..config()
            };
            expect(
                fsdp_engine_create_cpu(plan, &c, group, 0, &mut engine),
                BAD,
                words,
            );
        }
        let staged = fsdp_config {
            save_staging: 2,
            ..config()
        };
        expect(
            fsdp_engine_create_cpu(plan, &staged, group, 0, &mut engine),
            BAD,
            "save_staging is 2",
        );
        let in_backward = fsdp_config {
            step_in_backward: 2,
            ..config()
        };
        expect(
            fsdp_engine_create_cpu(plan, &in_backward, group, 0, &mut engine),
            BAD,
            "step_in_backward is 2",
        );
        // Nothing was taken: the rank's communicator is still in the group.
        ok(fsdp_engine_create_cpu(
            plan,
            &config(),
            group,
            0,
            &mut engine,
        ));
        ok(fsdp_engine_destroy(engine));
        ok(fsdp_local_group_destroy(group));
        ok(fsdp_plan_destroy(plan));
    }
}
