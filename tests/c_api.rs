//! Misuse at the C boundary, driven from Rust through the exported functions: every case returns
//! a status and a message, never a crash. The CPU cases run on eager and asynchronous groups.

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_void};
use std::ptr::{null, null_mut};

use fsdp_fusion::ffi::*;
use fsdp_fusion_support::ranks::{Mode, for_each_mode, within_deadline};

const MODEL: &str = r#"{"params": [
    {"name": "embed", "shape": [4, 3], "dtype": "f32", "tied": true},
    {"name": "w", "shape": [3, 3], "dtype": "f32", "unit": 0},
    {"name": "g", "shape": [3], "dtype": "f32", "unit": 0, "trainable": false}
]}"#;

fn last_error() -> String {
    // SAFETY: never NULL, NUL-terminated.
    unsafe { CStr::from_ptr(fsdp_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// Checks a status, and that the thread's message mentions `words`.
#[track_caller]
fn expect(status: fsdp_status, want: fsdp_status, words: &str) {
    assert_eq!(status, want, "message: {}", last_error());
    let message = last_error();
    assert!(
        message.contains(words),
        "{message:?} does not mention {words:?}"
    );
}

fn ok(status: fsdp_status) {
    assert_eq!(status, fsdp_status::FSDP_OK, "{}", last_error());
}

fn plan(world: usize) -> *mut fsdp_plan {
    let json = CString::new(MODEL).unwrap();
    let mut plan = null_mut();
    // SAFETY: valid pointers.
    ok(unsafe { fsdp_plan_from_json(json.as_ptr(), world, &mut plan) });
    plan
}

fn config() -> fsdp_config {
    let mut c = std::mem::MaybeUninit::uninit();
    // SAFETY: valid pointer.
    ok(unsafe { fsdp_config_default(c.as_mut_ptr()) });
    // SAFETY: written by the call above.
    unsafe { c.assume_init() }
}

/// A local group of `world` ranks whose engines run in `mode`.
fn local_group(mode: Mode, world: usize) -> *mut fsdp_local_group {
    let mut group = null_mut();
    // SAFETY: valid pointers.
    unsafe {
        ok(match mode {
            Mode::Eager => fsdp_local_group_create(world, &mut group),
            Mode::Async(seed) => fsdp_local_group_create_async(world, seed, &mut group),
        })
    };
    group
}

/// One rank's engine at world size 1 in `mode`, with its plan and group.
fn engine(mode: Mode) -> (*mut fsdp_plan, *mut fsdp_local_group, *mut fsdp_engine) {
    let plan = plan(1);
    let group = local_group(mode, 1);
    let mut engine = null_mut();
    let config = config();
    // SAFETY: valid pointers.
    unsafe { ok(fsdp_engine_create_cpu(plan, &config, group, 0, &mut engine)) };
    (plan, group, engine)
}

const NULL: fsdp_status = fsdp_status::FSDP_NULL_POINTER;

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
            ok(fsdp_engine_pre_backward(engine, 0));
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
                fsdp_engine_load_param(engine, 0, values.as_ptr().cast(), 11, FSDP_F32),
                bad,
                "11 elements",
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
fn views_and_plan_queries_return_the_values() {
    for_each_mode(|mode| {
        let (plan, group, engine) = engine(mode);
        let w: Vec<f32> = (0..9).map(|i| i as f32 - 4.0).collect();
        let name = CString::new("w").unwrap();
        let mut id = 0usize;
        let mut count = 0usize;
        let mut info = fsdp_param_info::default();
        let mut data: *const c_void = null();
        let mut numel = 0usize;
        let mut dtype = 9u32;
        // SAFETY: valid pointers; the view is read while unit 0's forward is open.
        unsafe {
            ok(fsdp_plan_param_count(plan, &mut count));
            ok(fsdp_plan_param_id(plan, name.as_ptr(), &mut id));
            ok(fsdp_plan_param_info(plan, id, &mut info));
            assert_eq!(
                (count, id, info.numel, info.unit, info.trainable),
                (3, 1, 9, 0, true)
            );
            ok(fsdp_engine_load_param(
                engine,
                id,
                w.as_ptr().cast(),
                9,
                FSDP_F32,
            ));
            ok(fsdp_engine_pre_forward(engine, 0));
            ok(fsdp_engine_param(
                engine, id, &mut data, &mut numel, &mut dtype,
            ));
            assert_eq!((numel, dtype), (9, FSDP_F32));
            assert_eq!(
                std::slice::from_raw_parts(data.cast::<f32>(), numel),
                &w[..]
            );
            ok(fsdp_engine_post_forward(engine, 0));
            ok(fsdp_engine_end_step(engine));
            ok(fsdp_engine_destroy(engine));
            ok(fsdp_local_group_destroy(group));
            ok(fsdp_plan_destroy(plan));
        }
    });
}

const BAD: fsdp_status = fsdp_status::FSDP_INVALID_ARGUMENT;
const UNAVAILABLE: fsdp_status = fsdp_status::FSDP_UNAVAILABLE;

fn gpu_present() -> bool {
    fsdp_fusion::backend::cuda::is_driver_present()
}

#[test]
fn nccl_unique_id_checks_its_buffer_and_reports_a_missing_nccl() {
    let mut id = [0u8; 128];
    // SAFETY: valid pointers, or NULL on purpose.
    unsafe {
        expect(fsdp_nccl_unique_id(null_mut(), 128), NULL, "out");
        expect(
            fsdp_nccl_unique_id(id.as_mut_ptr(), 64),
            BAD,
            "128 bytes, not 64",
        );
        match fsdp_nccl_unique_id(id.as_mut_ptr(), 128) {
            fsdp_status::FSDP_OK => assert!(id.iter().any(|&b| b != 0), "an empty id"),
            status => expect(status, UNAVAILABLE, "NCCL is not available"),
        }
    }
}

#[test]
fn cuda_nccl_engine_checks_its_arguments_before_touching_a_device() {
    let plan = plan(1);
    let config = config();
    let id = [0u8; 128];
    let mut engine = null_mut();
    // SAFETY: valid pointers, or NULL on purpose.
    unsafe {
        let create = |plan, config, device, id, id_len, rank, world, out| {
            fsdp_engine_create_cuda_nccl(
                plan,
                config,
                device,
                id,
                id_len,
                rank,
                world,
                0,
                null(),
                out,
            )
        };
        let id = id.as_ptr();
        expect(
            create(null(), &config, 0, id, 128, 0, 1, &mut engine),
            NULL,
            "plan",
        );
        expect(
            create(plan, null(), 0, id, 128, 0, 1, &mut engine),
            NULL,
            "config",
        );
        expect(
            create(plan, &config, 0, null(), 128, 0, 1, &mut engine),
            NULL,
            "unique_id",
        );
        expect(
            create(plan, &config, 0, id, 128, 0, 1, null_mut()),
            NULL,
            "out",
        );
        expect(
            create(plan, &config, 0, id, 127, 0, 1, &mut engine),
            BAD,
            "128 bytes, not 127",
        );
        expect(
            create(plan, &config, -1, id, 128, 0, 1, &mut engine),
            BAD,
            "device -1",
        );
        expect(
            create(plan, &config, 0, id, 128, 0, 2, &mut engine),
            BAD,
            "world size 1, the communicator 2",
        );
        expect(
            create(plan, &config, 0, id, 128, 1, 1, &mut engine),
            BAD,
            "rank 1 is out of range",
        );
        if !gpu_present() {
            expect(
                create(plan, &config, 0, id, 128, 0, 1, &mut engine),
                UNAVAILABLE,
                "CUDA is not available",
            );
            assert!(engine.is_null(), "no engine on failure");
        }
        ok(fsdp_plan_destroy(plan));
    }
}

#[test]
fn cuda_loopback_engine_checks_its_group_and_keeps_it_when_the_device_fails() {
    let plan = plan(2);
    let config = config();
    let mut loopback = null_mut();
    let mut local = null_mut();
    let mut engine = null_mut();
    // SAFETY: valid pointers, or NULL and wrong handles on purpose.
    unsafe {
        expect(fsdp_loopback_group_create(2, null_mut()), NULL, "out");
        expect(
            fsdp_loopback_group_create(0, &mut loopback),
            BAD,
            "world size",
        );
        ok(fsdp_loopback_group_create(2, &mut loopback));
        ok(fsdp_local_group_create(2, &mut local));
        let create = |plan, config, device, group, rank, out| {
            fsdp_engine_create_cuda_loopback(plan, config, device, group, rank, 0, null(), out)
        };
        expect(
            create(null(), &config, 0, loopback, 0, &mut engine),
            NULL,
            "plan",
        );
        expect(
            create(plan, null(), 0, loopback, 0, &mut engine),
            NULL,
            "config",
        );
        expect(
            create(plan, &config, 0, null_mut(), 0, &mut engine),
            NULL,
            "group",
        );
        expect(
            create(plan, &config, 0, loopback, 0, null_mut()),
            NULL,
            "out",
        );
        expect(
            create(plan, &config, -3, loopback, 0, &mut engine),
            BAD,
            "device -3",
        );
        let stale = fsdp_status::FSDP_INVALID_HANDLE;
        expect(
            create(plan, &config, 0, local.cast(), 0, &mut engine),
            stale,
            "another kind",
        );
        expect(
            fsdp_engine_create_cpu(plan, &config, loopback.cast(), 0, &mut engine),
            stale,
            "another kind",
        );
        expect(
            fsdp_local_group_destroy(loopback.cast()),
            stale,
            "another kind",
        );
        expect(
            fsdp_loopback_group_destroy(local.cast()),
            stale,
            "another kind",
        );
        if !gpu_present() {
            // Twice: the failed call left rank 0's communicator in the group.
            for _ in 0..2 {
                expect(
                    create(plan, &config, 0, loopback, 0, &mut engine),
                    UNAVAILABLE,
                    "CUDA is not available",
                );
            }
        }
        ok(fsdp_loopback_group_destroy(loopback));
        ok(fsdp_loopback_group_destroy(null_mut()));
        ok(fsdp_local_group_destroy(local));
        ok(fsdp_plan_destroy(plan));
    }
}

/// Device memory for the GPU tests, through the driver as a C caller would use it.
mod device {
    use cudarc::driver::sys::CUstream;
    use cudarc::driver::{CudaContext, result};
    use std::sync::Arc;

    /// Device 0's primary context, current on the calling thread.
    pub fn context() -> Arc<CudaContext> {
        let ctx = CudaContext::new(0).unwrap_or_else(|e| panic!("device 0: {e}"));
        ctx.bind_to_thread().unwrap();
        ctx
    }

    /// Waits for the engine's compute stream: views were gathered before it, gradients and slots
    /// are read and zeroed on it.
    pub fn sync(stream: u64) {
        // SAFETY: a live stream of the current context (0: the legacy default stream).
        unsafe { result::stream::synchronize(stream as CUstream) }.unwrap();
    }

    /// A fresh device copy of `values`, written on `stream`.
    pub fn upload(stream: u64, values: &[f32]) -> u64 {
        // SAFETY: a fresh allocation of exactly the bytes copied.
        let ptr = unsafe { result::malloc_sync(values.len() * 4) }.unwrap();
        write(stream, ptr, values);
        ptr
    }

    /// Copies `values` to `ptr` on `stream`, after the work queued there, and waits.
    pub fn write(stream: u64, ptr: u64, values: &[f32]) {
        // SAFETY: `ptr` holds `values.len()` floats (the engine or `upload` vouches); `values`
        // outlives the copy, waited for below.
        unsafe { result::memcpy_htod_async(ptr, values, stream as CUstream) }.unwrap();
        sync(stream);
    }

    /// Copies `numel` floats from `ptr` on `stream`, after the work queued there, and waits.
    pub fn download(stream: u64, ptr: u64, numel: usize) -> Vec<f32> {
        let mut out = vec![0f32; numel];
        // SAFETY: `ptr` holds `numel` floats (the engine vouches); `out` outlives the copy,
        // waited for below.
        unsafe { result::memcpy_dtoh_async(&mut out, ptr, stream as CUstream) }.unwrap();
        sync(stream);
        out
    }

    pub fn free(stream: u64, ptr: u64) {
        sync(stream);
        // SAFETY: allocated by `upload`, no longer used once the device is idle.
        unsafe { result::free_sync(ptr) }.unwrap();
    }

    /// A non-blocking stream of the current context; the caller destroys it.
    pub fn stream() -> u64 {
        let s = result::stream::create(result::stream::StreamKind::NonBlocking).unwrap();
        s as u64
    }

    pub fn destroy_stream(stream: u64) {
        sync(stream);
        // SAFETY: made by `stream`, idle after the sync.
        unsafe { result::stream::destroy(stream as CUstream) }.unwrap();
    }
}

/// The values of the test model's parameters: embed, w, g.
fn initial_values() -> [Vec<f32>; 3] {
    [
        (0..12).map(|i| i as f32 * 0.25).collect(),
        (0..9).map(|i| 1.0 - i as f32 * 0.125).collect(),
        vec![1.0; 3],
    ]
}

/// Loads parameter `i` of `engine` from `values[i]` (f32).
fn load_values(engine: *mut fsdp_engine, values: &[Vec<f32>]) {
    for (id, v) in values.iter().enumerate() {
        // SAFETY: `v` holds `v.len()` floats.
        ok(unsafe { fsdp_engine_load_param(engine, id, v.as_ptr().cast(), v.len(), FSDP_F32) });
    }
}

/// The memory an engine's views, gradients and slots live in, as a C caller reaches it.
trait CallerMemory {
    /// A gradient of `values` for the engine to read; valid until the step is over.
    fn gradient(&self, values: &[f32]) -> u64;
    fn read(&self, addr: u64, numel: usize) -> Vec<f32>;
    fn write(&self, addr: u64, values: &[f32]);
}

/// Host memory (a CPU engine); gradients stay alive as long as the value.
#[derive(Default)]
struct Host(RefCell<Vec<Vec<f32>>>);

impl CallerMemory for Host {
    fn gradient(&self, values: &[f32]) -> u64 {
        let kept = values.to_vec();
        let addr = kept.as_ptr() as u64;
        self.0.borrow_mut().push(kept);
        addr
    }

    fn read(&self, addr: u64, numel: usize) -> Vec<f32> {
        // SAFETY: the engine vouches for `numel` floats at a view's address while it is valid.
        unsafe { std::slice::from_raw_parts(addr as *const f32, numel) }.to_vec()
    }

    fn write(&self, addr: u64, values: &[f32]) {
        // SAFETY: the engine vouches for the slot's floats until the commit.
        unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), addr as *mut f32, values.len()) };
    }
}

/// Device memory on a CUDA engine's compute stream; gradients are freed with the value.
struct Device {
    stream: u64,
    gradients: RefCell<Vec<u64>>,
}

impl Device {
    fn on(stream: u64) -> Device {
        Device {
            stream,
            gradients: RefCell::default(),
        }
    }
}

impl CallerMemory for Device {
    fn gradient(&self, values: &[f32]) -> u64 {
        let ptr = device::upload(self.stream, values);
        self.gradients.borrow_mut().push(ptr);
        ptr
    }

    fn read(&self, addr: u64, numel: usize) -> Vec<f32> {
        device::download(self.stream, addr, numel)
    }

    fn write(&self, addr: u64, values: &[f32]) {
        device::write(self.stream, addr, values)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        for &ptr in self.gradients.borrow().iter() {
            device::free(self.stream, ptr);
        }
    }
}

/// One SGD step (lr 0.5) through the C functions: views, a gradient handed over for `w`, the slot
/// for `embed`; returns what the updated shards hold for `embed` and `w`.
fn sgd_step(
    engine: *mut fsdp_engine,
    plan: *mut fsdp_plan,
    rank: usize,
    memory: &impl CallerMemory,
) -> [Vec<f32>; 2] {
    let values = initial_values();
    let scale = (rank + 1) as f32;
    let w_grad: Vec<f32> = (0..9).map(|i| scale * 0.1 * i as f32).collect();
    let embed_grad: Vec<f32> = (0..12).map(|i| scale * 0.01 * i as f32).collect();
    let mut data: *const c_void = null();
    let mut numel = 0usize;
    let mut dtype = 9u32;
    let mut slot: *mut f32 = null_mut();
    // SAFETY: valid pointers; device addresses are used while the engine says they are valid.
    unsafe {
        load_values(engine, &values);
        ok(fsdp_engine_pre_forward(engine, FSDP_ROOT));
        ok(fsdp_engine_param(
            engine, 0, &mut data, &mut numel, &mut dtype,
        ));
        assert_eq!((numel, dtype), (12, FSDP_F32));
        assert_eq!(memory.read(data as u64, numel), values[0]);
        ok(fsdp_engine_post_forward(engine, FSDP_ROOT));
        ok(fsdp_engine_pre_forward(engine, 0));
        ok(fsdp_engine_param(
            engine, 1, &mut data, &mut numel, &mut dtype,
        ));
        assert_eq!(memory.read(data as u64, numel), values[1]);
        ok(fsdp_engine_post_forward(engine, 0));

        ok(fsdp_engine_pre_backward(engine, 0));
        expect(
            fsdp_engine_grad(engine, 1, null(), 9, FSDP_F32),
            NULL,
            "data",
        );
        let grad = memory.gradient(&w_grad);
        ok(fsdp_engine_grad(
            engine,
            1,
            grad as *const c_void,
            9,
            FSDP_F32,
        ));
        ok(fsdp_engine_post_backward(engine, 0));
        ok(fsdp_engine_pre_backward(engine, FSDP_ROOT));
        ok(fsdp_engine_grad_slot(engine, 0, &mut slot));
        memory.write(slot as u64, &embed_grad);
        ok(fsdp_engine_commit_grad(engine, 0));
        ok(fsdp_engine_post_backward(engine, FSDP_ROOT));
        ok(fsdp_engine_finish_grad_sync(engine));
        ok(fsdp_engine_optimizer_step(engine));
        ok(fsdp_engine_end_step(engine));
    }
    [0, 1].map(|id| shard_values(engine, plan, id))
}

/// Parameter `id`'s part of this rank's shard (the whole parameter at world size 1).
fn shard_values(engine: *mut fsdp_engine, plan: *mut fsdp_plan, id: usize) -> Vec<f32> {
    let mut info = fsdp_param_info::default();
    let mut bytes = vec![0u8; 1 << 16];
    let mut written = 0usize;
    // SAFETY: valid pointers.
    unsafe {
        ok(fsdp_plan_param_info(plan, id, &mut info));
        ok(fsdp_engine_param_shard(
            engine,
            info.group,
            bytes.as_mut_ptr().cast(),
            bytes.len(),
            &mut written,
        ));
    }
    let floats: Vec<f32> = bytes[..written]
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    floats[info.offset..(info.offset + info.numel).min(floats.len())].to_vec()
}

fn sgd_config() -> fsdp_config {
    fsdp_config {
        optimizer: FSDP_SGD,
        lr: 0.5,
        weight_decay: 0.0,
        ..config()
    }
}

/// `initial - 0.5 * mean gradient`, the gradient of rank r being `(r + 1)` times the base one.
fn after_sgd(initial: &[f32], base: impl Fn(usize) -> f32, world: usize) -> Vec<f32> {
    let mean = (1..=world).sum::<usize>() as f32 / world as f32;
    initial
        .iter()
        .enumerate()
        .map(|(i, v)| v - 0.5 * mean * base(i))
        .collect()
}

#[track_caller]
fn assert_close(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() <= 1e-6, "{got:?} != {want:?}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_nccl_engine_at_world_size_1_trains_a_step_through_the_c_api() {
    let _ctx = device::context();
    let plan = plan(1);
    let config = sgd_config();
    let mut id = [0u8; 128];
    let mut engine = null_mut();
    // SAFETY: valid pointers.
    unsafe {
        ok(fsdp_nccl_unique_id(id.as_mut_ptr(), id.len()));
        ok(fsdp_engine_create_cuda_nccl(
            plan,
            &config,
            0,
            id.as_ptr(),
            id.len(),
            0,
            1,
            0,
            null(),
            &mut engine,
        ));
    }
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
            ok(fsdp_engine_finish_grad_sync(engine));
            ok(fsdp_engine_optimizer_step(engine));
            ok(fsdp_engine_end_step(engine));
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

/// Runs `rank_0` and `rank_1` on threads of their own, each with its engine of a two-rank group
/// in `mode` (handles travel as numbers); returns what they return.
fn two_ranks<R: Send + 'static>(
    mode: Mode,
    rank_0: impl FnOnce(usize) -> R + Send + 'static,
    rank_1: impl FnOnce(usize) -> R + Send + 'static,
) -> (R, R) {
    two_ranks_with(mode, sgd_config(), rank_0, rank_1)
}

/// As [`two_ranks`], with engines of `config`.
fn two_ranks_with<R: Send + 'static>(
    mode: Mode,
    config: fsdp_config,
    rank_0: impl FnOnce(usize) -> R + Send + 'static,
    rank_1: impl FnOnce(usize) -> R + Send + 'static,
) -> (R, R) {
    let plan = plan(2) as usize;
    let group = local_group(mode, 2) as usize;
    let outcome = within_deadline("two ranks through the C API", move || {
        let spawn = |rank: usize, body: Box<dyn FnOnce(usize) -> R + Send>| {
            std::thread::spawn(move || {
                let mut engine = null_mut();
                // SAFETY: valid pointers.
                ok(unsafe {
                    fsdp_engine_create_cpu(
                        plan as *mut fsdp_plan,
                        &config,
                        group as *mut fsdp_local_group,
                        rank,
                        &mut engine,
                    )
                });
                body(engine as usize)
            })
        };
        let r0 = spawn(0, Box::new(rank_0));
        let r1 = spawn(1, Box::new(rank_1));
        (r0.join().unwrap(), r1.join().unwrap())
    });
    ok(fsdp_local_group_destroy(group as *mut fsdp_local_group));
    ok(fsdp_plan_destroy(plan as *mut fsdp_plan));
    outcome
}

fn handle(engine: usize) -> *mut fsdp_engine {
    engine as *mut fsdp_engine
}

/// The forward of both units of the test model on `engine`, then `w`'s gradient (at world size
/// 2 its group's reduction needs the other rank) and a read of a shard, which waits for the
/// streams: returns the first status that is not `FSDP_OK`, or `FSDP_OK`.
fn forward_then_gradient(engine: usize) -> fsdp_status {
    for unit in [FSDP_ROOT, 0] {
        for status in [
            fsdp_engine_pre_forward(handle(engine), unit),
            fsdp_engine_post_forward(handle(engine), unit),
        ] {
            if status != fsdp_status::FSDP_OK {
                return status;
            }
        }
    }
    gradient_after_forward(engine)
}

/// `w`'s gradient after the forward, then a read of its shard (a host wait).
fn gradient_after_forward(engine: usize) -> fsdp_status {
    let e = handle(engine);
    let g = [0.5f32; 9];
    let mut bytes = [0u8; 4096];
    let mut written = 0usize;
    // SAFETY: a valid host gradient of `w`'s 9 elements, and valid out-pointers.
    unsafe {
        match fsdp_engine_grad(e, 1, g.as_ptr().cast(), 9, FSDP_F32) {
            fsdp_status::FSDP_OK => {
                fsdp_engine_param_shard(e, 1, bytes.as_mut_ptr().cast(), bytes.len(), &mut written)
            }
            failed => failed,
        }
    }
}

fn forward_only(engine: usize) {
    for (pre, post) in [(FSDP_ROOT, FSDP_ROOT), (0, 0)] {
        ok(fsdp_engine_pre_forward(handle(engine), pre));
        ok(fsdp_engine_post_forward(handle(engine), post));
    }
}

#[test]
fn a_blocked_call_is_aborted_and_counters_never_wait_for_it() {
    for_each_mode(|mode| {
        let (blocked, other) = two_ranks(
            mode,
            |engine| {
                let aborter = std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_millis(200));
                    // Another thread reads the counters of the blocked engine, hands it a
                    // gradient that is refused before the engine's lock, then aborts it.
                    let mut counters = fsdp_counters::default();
                    // SAFETY: valid pointers.
                    ok(unsafe { fsdp_engine_counters(handle(engine), &mut counters) });
                    let started = std::time::Instant::now();
                    // SAFETY: a NULL gradient, which the call refuses.
                    let refused =
                        unsafe { fsdp_engine_grad(handle(engine), 1, null(), 9, FSDP_F32) };
                    let refused_after = started.elapsed();
                    ok(fsdp_engine_abort(handle(engine)));
                    (counters.all_gathers, refused, refused_after)
                });
                let status = forward_then_gradient(engine);
                let (gathers, refused, refused_after) = aborter.join().unwrap();
                assert_eq!(refused, NULL);
                assert!(
                    refused_after.as_millis() < 100,
                    "refused after {refused_after:?}"
                );
                let later = fsdp_engine_end_step(handle(engine));
                let message = last_error();
                ok(fsdp_engine_destroy(handle(engine)));
                (status, gathers, later, message)
            },
            |engine| {
                forward_only(engine);
                std::thread::sleep(std::time::Duration::from_millis(600));
                ok(fsdp_engine_destroy(handle(engine)));
                (fsdp_status::FSDP_OK, 0, fsdp_status::FSDP_OK, String::new())
            },
        );
        let (status, gathers, later, message) = blocked;
        assert_eq!(status, fsdp_status::FSDP_ABORTED, "{mode:?}");
        assert!(gathers >= 2, "the counters read while blocked: {gathers}");
        assert_eq!(later, fsdp_status::FSDP_POISONED);
        assert!(message.contains("aborted"), "{message}");
        assert_eq!(other.0, fsdp_status::FSDP_OK);
    });
}

/// A collective made to hang (`fsdp_engine_hang_collective`) on rank 0 of two, whose engines
/// wait `timeout_seconds` = 1: the call that queued it returns at once, the watchdog fails it at
/// the deadline, the next call names it, the peer fails instead of waiting, and destroy works. On
/// eager ranks the call that queues it refuses the hold instead of blocking for good.
#[test]
fn a_collective_hung_through_the_c_api_fails_at_its_deadline_and_poisons_the_engine() {
    let config = fsdp_config {
        timeout_seconds: 1.0,
        ..sgd_config()
    };
    for_each_mode(|mode| {
        let (hung, peer) = two_ranks_with(
            mode,
            config,
            |engine| {
                ok(fsdp_engine_hang_collective(handle(engine), 0));
                let issued = std::time::Instant::now();
                let queued = fsdp_engine_pre_forward(handle(engine), FSDP_ROOT);
                let queued_message = last_error();
                let returned_after = issued.elapsed();
                std::thread::sleep(std::time::Duration::from_millis(1600));
                let next = fsdp_engine_post_forward(handle(engine), FSDP_ROOT);
                let next_message = last_error();
                let later = fsdp_engine_end_step(handle(engine));
                ok(fsdp_engine_destroy(handle(engine)));
                let outcome = (queued, next, later);
                (
                    outcome,
                    returned_after,
                    format!("{queued_message} / {next_message}"),
                )
            },
            |engine| {
                let started = std::time::Instant::now();
                let status = forward_then_gradient(engine);
                ok(fsdp_engine_destroy(handle(engine)));
                let outcome = (status, fsdp_status::FSDP_OK, fsdp_status::FSDP_OK);
                (outcome, started.elapsed(), last_error())
            },
        );
        let ((queued, next, later), returned_after, messages) = hung;
        match mode {
            Mode::Eager => {
                assert_eq!(queued, fsdp_status::FSDP_UNAVAILABLE, "{messages}");
                assert!(messages.contains("eager"), "{messages}");
            }
            Mode::Async(_) => {
                assert_eq!(queued, fsdp_status::FSDP_OK, "{mode:?}: {messages}");
                assert!(returned_after.as_secs_f64() < 0.5, "{returned_after:?}");
                assert_eq!(next, fsdp_status::FSDP_TIMEOUT, "{mode:?}: {messages}");
                assert!(
                    messages.contains("all-gather") && messages.contains("still in flight"),
                    "{messages}"
                );
                assert_eq!(later, fsdp_status::FSDP_POISONED);
            }
        }
        let ((status, ..), waited, message) = peer;
        // The peer fails in its next gather: at rank 0's leaving, or at its own deadline.
        assert!(
            matches!(
                status,
                fsdp_status::FSDP_COMM_ERROR | fsdp_status::FSDP_TIMEOUT
            ) && message.contains("all-gather of group 1"),
            "{mode:?}: {status:?}, {message}"
        );
        assert!(
            waited.as_secs_f64() < 3.0,
            "the peer waited {waited:?}: {message}"
        );
    });
}

#[test]
fn destroying_an_engine_blocked_in_another_thread_unblocks_it() {
    for_each_mode(|mode| {
        let (blocked, _) = two_ranks(
            mode,
            |engine| {
                let destroyer = std::thread::spawn(move || {
                    std::thread::sleep(std::time::Duration::from_millis(200));
                    fsdp_engine_destroy(handle(engine))
                });
                let status = forward_then_gradient(engine);
                (status, destroyer.join().unwrap())
            },
            |engine| {
                forward_only(engine);
                std::thread::sleep(std::time::Duration::from_millis(600));
                ok(fsdp_engine_destroy(handle(engine)));
                (fsdp_status::FSDP_OK, fsdp_status::FSDP_OK)
            },
        );
        assert_eq!(blocked, (fsdp_status::FSDP_ABORTED, fsdp_status::FSDP_OK));
    });
}

#[test]
fn a_step_driven_by_threads_in_turn_that_end_mid_step_goes_on() {
    for_each_mode(|mode| {
        // Each rank's step: its forward on one thread, which ends, its gradient on another.
        let in_turn = |engine: usize| {
            std::thread::spawn(move || forward_only(engine))
                .join()
                .unwrap();
            let (status, message) =
                std::thread::spawn(move || (gradient_after_forward(engine), last_error()))
                    .join()
                    .unwrap();
            (status, message, engine)
        };
        let (first, second) = two_ranks(mode, in_turn, in_turn);
        for (status, message, engine) in [first, second] {
            assert_eq!(status, fsdp_status::FSDP_OK, "{mode:?}: {message}");
            ok(fsdp_engine_destroy(handle(engine)));
        }
    });
}

#[test]
fn a_failed_creation_gives_the_communicator_back() {
    let huge = CString::new(
        r#"{"params": [{"name": "w", "shape": [33554432, 16777216], "dtype": "f32"}]}"#,
    )
    .unwrap();
    let mut huge_plan = null_mut();
    let config = config();
    let mut engine = null_mut();
    // SAFETY: valid pointers.
    unsafe {
        ok(fsdp_plan_from_json(huge.as_ptr(), 1, &mut huge_plan));
        let group = local_group(Mode::Eager, 1);
        expect(
            fsdp_engine_create_cpu(huge_plan, &config, group, 0, &mut engine),
            fsdp_status::FSDP_OUT_OF_MEMORY,
            "parameter shard of group 0",
        );
        let plan = plan(1);
        ok(fsdp_engine_create_cpu(plan, &config, group, 0, &mut engine));
        ok(fsdp_engine_destroy(engine));
        ok(fsdp_local_group_destroy(group));
        ok(fsdp_plan_destroy(plan));
        ok(fsdp_plan_destroy(huge_plan));
    }
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

/// Unit 0 holds two trainable parameters and a frozen one; the root holds `r`.
const BATCH_MODEL: &str = r#"{"params": [
    {"name": "a", "shape": [2, 3], "dtype": "f32", "unit": 0},
    {"name": "b", "shape": [3], "dtype": "f32", "unit": 0},
    {"name": "f", "shape": [2], "dtype": "f32", "unit": 0, "trainable": false},
    {"name": "r", "shape": [4], "dtype": "f32"}
]}"#;

fn grad_entry(param: usize, values: &[f32], numel: usize, dtype: u32) -> fsdp_grad {
    fsdp_grad {
        param,
        data: values.as_ptr().cast(),
        numel,
        dtype,
    }
}

#[test]
fn batched_views_and_gradients_act_as_the_single_calls_and_a_refused_batch_takes_nothing() {
    for_each_mode(|mode| {
        let json = CString::new(BATCH_MODEL).unwrap();
        let mut plan = null_mut();
        let group = local_group(mode, 1);
        let mut engine = null_mut();
        let values: [Vec<f32>; 4] = [
            (0..6).map(|i| i as f32).collect(),
            vec![-1.0, -2.0, -3.0],
            vec![7.0, 8.0],
            vec![0.5; 4],
        ];
        let ga: Vec<f32> = (0..6).map(|i| 0.1 * i as f32).collect();
        let gb = vec![1.0f32, 2.0, 3.0];
        let stale = 0xdead as *const c_void;
        // SAFETY: valid pointers throughout; views are read while unit 0's forward is open.
        unsafe {
            ok(fsdp_plan_from_json(json.as_ptr(), 1, &mut plan));
            ok(fsdp_engine_create_cpu(
                plan,
                &sgd_config(),
                group,
                0,
                &mut engine,
            ));
            load_values(engine, &values);
            ok(fsdp_engine_pre_forward(engine, 0));
            let ids = [2usize, 0, 1];
            let mut addresses = [stale; 3];
            ok(fsdp_engine_params(
                engine,
                ids.as_ptr(),
                3,
                addresses.as_mut_ptr(),
            ));
            for (&id, &address) in ids.iter().zip(&addresses) {
                let (mut data, mut numel, mut dtype) = (null(), 0usize, 0u32);
                ok(fsdp_engine_param(
                    engine, id, &mut data, &mut numel, &mut dtype,
                ));
                assert_eq!(address, data, "param {id}");
                let seen = std::slice::from_raw_parts(address.cast::<f32>(), numel);
                assert_eq!(seen, &values[id][..]);
            }
            // The root is not open: nothing is written, not even the entries before it.
            let mut untouched = [stale; 2];
            let with_root = [0usize, 3];
            expect(
                fsdp_engine_params(engine, with_root.as_ptr(), 2, untouched.as_mut_ptr()),
                fsdp_status::FSDP_MISUSE,
                "r",
            );
            assert_eq!(untouched, [stale; 2]);
            expect(
                fsdp_engine_params(engine, null(), 2, untouched.as_mut_ptr()),
                NULL,
                "params",
            );
            expect(
                fsdp_engine_params(engine, ids.as_ptr(), 2, null_mut()),
                NULL,
                "data",
            );
            ok(fsdp_engine_params(engine, null(), 0, null_mut()));
            ok(fsdp_engine_post_forward(engine, 0));

            ok(fsdp_engine_pre_backward(engine, 0));
            let refused: [(Vec<fsdp_grad>, fsdp_status, &str); 5] = [
                (
                    vec![
                        grad_entry(0, &ga, 6, FSDP_F32),
                        grad_entry(1, &gb, 2, FSDP_F32),
                    ],
                    BAD,
                    "b",
                ),
                (
                    vec![
                        grad_entry(0, &ga, 6, FSDP_F32),
                        grad_entry(0, &ga, 6, FSDP_F32),
                    ],
                    fsdp_status::FSDP_MISUSE,
                    "a",
                ),
                (
                    vec![
                        grad_entry(0, &ga, 6, FSDP_F32),
                        grad_entry(2, &gb, 2, FSDP_F32),
                    ],
                    fsdp_status::FSDP_MISUSE,
                    "frozen",
                ),
                (
                    vec![grad_entry(0, &ga, 6, FSDP_F32), grad_entry(1, &gb, 3, 7)],
                    BAD,
                    "grads[1]",
                ),
                (
                    vec![
                        grad_entry(0, &ga, 6, FSDP_F32),
                        grad_entry(9, &gb, 3, FSDP_F32),
                    ],
                    BAD,
                    "9",
                ),
            ];
            for (batch, status, words) in &refused {
                expect(
                    fsdp_engine_grads(engine, batch.as_ptr(), batch.len()),
                    *status,
                    words,
                );
            }
            expect(fsdp_engine_grads(engine, null(), 1), NULL, "grads");
            ok(fsdp_engine_grads(engine, null(), 0));
            // Nothing of the refused batches was taken: both gradients are still welcome.
            let batch = [
                grad_entry(1, &gb, 3, FSDP_F32),
                grad_entry(0, &ga, 6, FSDP_F32),
            ];
            ok(fsdp_engine_grads(engine, batch.as_ptr(), 2));
            expect(
                fsdp_engine_grads(engine, batch.as_ptr(), 1),
                fsdp_status::FSDP_MISUSE,
                "already received",
            );
            ok(fsdp_engine_post_backward(engine, 0));
            ok(fsdp_engine_finish_grad_sync(engine));
            ok(fsdp_engine_optimizer_step(engine));
            ok(fsdp_engine_end_step(engine));
            let sgd = |v: &[f32], g: &[f32]| -> Vec<f32> {
                v.iter().zip(g).map(|(v, g)| v - 0.5 * g).collect()
            };
            assert_close(&shard_values(engine, plan, 0), &sgd(&values[0], &ga));
            assert_close(&shard_values(engine, plan, 1), &sgd(&values[1], &gb));
            assert_eq!(shard_values(engine, plan, 2), values[2]);
            ok(fsdp_engine_destroy(engine));
            ok(fsdp_local_group_destroy(group));
            ok(fsdp_plan_destroy(plan));
        }
    });
}

#[test]
fn rates_norms_clipping_and_skipped_steps_through_the_c_api() {
    for_each_mode(|mode| {
        let plan = plan(1);
        let group = local_group(mode, 1);
        let mut engine = null_mut();
        let values = initial_values();
        let g = [2.0f32; 9];
        let mut norm = fsdp_grad_norm::default();
        // SAFETY: valid pointers throughout.
        unsafe {
            ok(fsdp_engine_create_cpu(
                plan,
                &sgd_config(),
                group,
                0,
                &mut engine,
            ));
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
            let mut counters = fsdp_counters::default();
            ok(fsdp_engine_counters(engine, &mut counters));
            assert_eq!((counters.steps, counters.skipped_steps), (2, 1));
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
    assert!(keep.gathered_slots > f32s.gathered_slots);
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

#[test]
fn a_checkpoint_saved_and_loaded_through_the_c_api_continues_the_optimizer() {
    for_each_mode(|mode| {
        let dir = std::env::temp_dir().join(format!(
            "fsdp-fusion-c-checkpoint-{}-{mode:?}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let path = CString::new(dir.to_str().unwrap()).unwrap();
        let (plan, group, saved) = engine(mode);
        sgd_step(saved, plan, 0, &Host::default());
        let background = CString::new(dir.join("background").to_str().unwrap()).unwrap();
        // SAFETY: valid pointers throughout.
        unsafe {
            ok(fsdp_engine_save(saved, path.as_ptr()));
            expect(
                fsdp_engine_save(saved, path.as_ptr()),
                fsdp_status::FSDP_INVALID_ARGUMENT,
                "never overwrites",
            );
            ok(fsdp_engine_save_async(saved, background.as_ptr()));
            expect(
                fsdp_engine_save_async(saved, path.as_ptr()),
                fsdp_status::FSDP_MISUSE,
                "still being written",
            );
            ok(fsdp_engine_wait_save(saved));
            ok(fsdp_engine_wait_save(saved));
        }
        let data = |name: &str| std::fs::read(dir.join(name).join("rank-00000.bin")).unwrap();
        assert_eq!(
            data("background"),
            std::fs::read(dir.join("rank-00000.bin")).unwrap()
        );
        // The same initial values again, then a second step: it runs on the saved moments and
        // step count in both engines.
        let straight = sgd_step(saved, plan, 0, &Host::default());
        let other_group = local_group(mode, 1);
        let mut loaded = null_mut();
        // SAFETY: valid pointers throughout.
        unsafe {
            ok(fsdp_engine_create_cpu(
                plan,
                &config(),
                other_group,
                0,
                &mut loaded,
            ));
            let missing = CString::new(dir.join("nowhere").to_str().unwrap()).unwrap();
            expect(
                fsdp_engine_load(loaded, missing.as_ptr()),
                fsdp_status::FSDP_IO_ERROR,
                "no checkpoint directory",
            );
            expect(fsdp_engine_load(loaded, null()), NULL, "dir");
            ok(fsdp_engine_load(loaded, path.as_ptr()));
        }
        assert_eq!(sgd_step(loaded, plan, 0, &Host::default()), straight);
        ok(fsdp_engine_destroy(loaded));
        ok(fsdp_engine_destroy(saved));
        ok(fsdp_local_group_destroy(other_group));
        ok(fsdp_local_group_destroy(group));
        ok(fsdp_plan_destroy(plan));
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// Group 0's shard of `engine`, as bytes.
fn shard_bytes(engine: *mut fsdp_engine) -> Vec<u8> {
    let mut out = vec![0u8; 4096];
    let mut written = 0usize;
    // SAFETY: valid pointers.
    ok(unsafe {
        fsdp_engine_param_shard(engine, 0, out.as_mut_ptr().cast(), out.len(), &mut written)
    });
    out.truncate(written);
    out
}

#[test]
fn a_bf16_model_loaded_and_saved_before_any_step_loads_as_loaded_through_the_c_api() {
    for_each_mode(|mode| {
        let json = CString::new(
            r#"{"params": [{"name": "w", "shape": [5, 7], "dtype": "bf16", "unit": 0}]}"#,
        )
        .unwrap();
        let mut plan = null_mut();
        // SAFETY: valid pointers.
        ok(unsafe { fsdp_plan_from_json(json.as_ptr(), 1, &mut plan) });
        let engine = |group| {
            let mut engine = null_mut();
            // SAFETY: valid pointers.
            ok(unsafe { fsdp_engine_create_cpu(plan, &config(), group, 0, &mut engine) });
            engine
        };
        let (first, second) = (local_group(mode, 1), local_group(mode, 1));
        let (saved, loaded) = (engine(first), engine(second));
        let values: Vec<u16> = (0..35u16).map(|i| 0x3f80 + i).collect();
        let dir = std::env::temp_dir().join(format!(
            "fsdp-fusion-c-fresh-{}-{mode:?}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let path = CString::new(dir.to_str().unwrap()).unwrap();
        let empty = CString::new("").unwrap();
        // SAFETY: valid pointers throughout.
        unsafe {
            ok(fsdp_engine_load_param(
                saved,
                0,
                values.as_ptr().cast(),
                35,
                FSDP_BF16,
            ));
            expect(
                fsdp_engine_save(saved, empty.as_ptr()),
                fsdp_status::FSDP_INVALID_ARGUMENT,
                "empty path",
            );
            expect(
                fsdp_engine_load(loaded, empty.as_ptr()),
                fsdp_status::FSDP_INVALID_ARGUMENT,
                "empty path",
            );
            ok(fsdp_engine_save(saved, path.as_ptr()));
            ok(fsdp_engine_load(loaded, path.as_ptr()));
        }
        assert!(!std::path::Path::new("rank-00000.json").exists());
        let expected: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(&shard_bytes(loaded)[..70], &expected[..]);
        assert_eq!(shard_bytes(loaded), shard_bytes(saved));
        let _ = std::fs::remove_dir_all(&dir);
        ok(fsdp_engine_destroy(loaded));
        ok(fsdp_engine_destroy(saved));
        ok(fsdp_local_group_destroy(first));
        ok(fsdp_local_group_destroy(second));
        ok(fsdp_plan_destroy(plan));
    });
}

#[test]
fn a_model_exported_through_the_c_api_imports_into_a_fresh_engine() {
    for_each_mode(|mode| {
        let dir = std::env::temp_dir().join(format!(
            "fsdp-fusion-c-export-{}-{mode:?}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = CString::new(dir.join("model.safetensors").to_str().unwrap()).unwrap();
        let (plan, group, trained) = engine(mode);
        sgd_step(trained, plan, 0, &Host::default());
        let (other_plan, other_group, fresh) = engine(mode);
        let shard = shard_bytes;
        // SAFETY: valid pointers throughout.
        unsafe {
            expect(
                fsdp_engine_export_safetensors(trained, null()),
                NULL,
                "path",
            );
            ok(fsdp_engine_export_safetensors(trained, file.as_ptr()));
            expect(
                fsdp_engine_export_safetensors(trained, file.as_ptr()),
                fsdp_status::FSDP_INVALID_ARGUMENT,
                "exists",
            );
            assert_ne!(shard(fresh), shard(trained), "a step moved the values");
            let missing = CString::new(dir.join("none").to_str().unwrap()).unwrap();
            expect(
                fsdp_engine_import_safetensors(fresh, missing.as_ptr()),
                fsdp_status::FSDP_IO_ERROR,
                "none",
            );
            ok(fsdp_engine_import_safetensors(fresh, file.as_ptr()));
        }
        assert_eq!(shard(fresh), shard(trained));
        for e in [trained, fresh] {
            ok(fsdp_engine_destroy(e));
        }
        for g in [group, other_group] {
            ok(fsdp_local_group_destroy(g));
        }
        for p in [plan, other_plan] {
            ok(fsdp_plan_destroy(p));
        }
        let _ = std::fs::remove_dir_all(&dir);
    });
}

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
        ok(fsdp_engine_finish_grad_sync(engine));
        ok(fsdp_engine_optimizer_step(engine));
        ok(fsdp_engine_end_step(engine));
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
    let mut id = [0u8; 128];
    let mut engine = null_mut();
    // SAFETY: valid pointers.
    unsafe {
        ok(fsdp_plan_from_json(json.as_ptr(), 1, &mut plan));
        ok(fsdp_nccl_unique_id(id.as_mut_ptr(), id.len()));
        ok(fsdp_engine_create_cuda_nccl(
            plan,
            &sgd_config(),
            0,
            id.as_ptr(),
            id.len(),
            0,
            1,
            0,
            null(),
            &mut engine,
        ));
    }
    let [view, w, e] = expert_step(engine, 0, &Device::on(0));
    assert_close(&view, &[1.0; 8]);
    assert_close(&w, &[0.5; 8]);
    assert_close(&e, &[0.5; 8]);
    ok(fsdp_engine_destroy(engine));
    ok(fsdp_plan_destroy(plan));
}

#[test]
fn destroying_a_group_while_a_rank_is_inside_its_creation_fails_it_at_once() {
    within_deadline("a group destroyed under a creation", || {
        for_each_mode(destroy_the_group_under_a_creation)
    });
}

/// A creation of rank 0 in `mode` that waits for rank 1 while the group is destroyed.
fn destroy_the_group_under_a_creation(mode: Mode) {
    let plan = plan(2);
    let group = local_group(mode, 2);
    let (plan_handle, group_handle) = (plan as usize, group as usize);
    let creating = std::thread::spawn(move || {
        let mut engine = null_mut();
        let started = std::time::Instant::now();
        // SAFETY: valid pointers; the group is destroyed while this call waits in it.
        let status = unsafe {
            fsdp_engine_create_cpu(
                plan_handle as *mut fsdp_plan,
                &config(),
                group_handle as *mut fsdp_local_group,
                0,
                &mut engine,
            )
        };
        (status, last_error(), started.elapsed())
    });
    std::thread::sleep(std::time::Duration::from_millis(200));
    ok(fsdp_local_group_destroy(group));
    let (status, message, waited) = creating.join().unwrap();
    assert_eq!(status, fsdp_status::FSDP_COMM_ERROR, "{mode:?}: {message}");
    assert!(message.contains("group destroyed"), "{mode:?}: {message}");
    assert!(
        waited < std::time::Duration::from_secs(10),
        "{mode:?}: waited {waited:?} (the default deadline is 600 s)"
    );
    ok(fsdp_plan_destroy(plan));
}
