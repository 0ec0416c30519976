//! `fsdp_engine_create_cuda_nccl_env`: an engine whose place comes from the environment a
//! launcher such as torchrun sets. The process's environment is changed here, so this binary
//! holds these tests alone, run one at a time under one lock.

use std::ffi::{CStr, CString};
use std::ptr::{null, null_mut};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use fsdp_fusion::ffi::*;

const MODEL: &str = r#"{"params": [{"name": "w", "shape": [3, 3], "dtype": "f32", "unit": 0}]}"#;

/// Held by each test while it changes and reads the environment.
static ENVIRONMENT: Mutex<()> = Mutex::new(());

const LAUNCH_VARIABLES: [&str; 6] = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
];

/// Sets the launch variables to `vars`, removing the others.
fn launch_environment(vars: &[(&str, &str)]) {
    for name in LAUNCH_VARIABLES {
        // SAFETY: the tests of this binary change and read the environment one at a time under
        // `ENVIRONMENT`, and nothing else of the process runs meanwhile.
        unsafe { std::env::remove_var(name) };
    }
    for (name, value) in vars {
        // SAFETY: as above.
        unsafe { std::env::set_var(name, value) };
    }
}

fn last_error() -> String {
    // SAFETY: never NULL, NUL-terminated.
    unsafe { CStr::from_ptr(fsdp_last_error()) }
        .to_string_lossy()
        .into_owned()
}

#[track_caller]
fn expect(status: fsdp_status, want: fsdp_status, words: &str) {
    let message = last_error();
    assert_eq!(status, want, "message: {message}");
    assert!(message.contains(words), "{message:?} lacks {words:?}");
}

fn plan(world: usize) -> *mut fsdp_plan {
    let json = CString::new(MODEL).unwrap();
    let mut plan = null_mut();
    // SAFETY: valid pointers.
    let status = unsafe { fsdp_plan_from_json(json.as_ptr(), world, &mut plan) };
    assert_eq!(status, fsdp_status::FSDP_OK, "{}", last_error());
    plan
}

fn config(timeout_seconds: f64) -> fsdp_config {
    let mut c = std::mem::MaybeUninit::uninit();
    // SAFETY: valid pointer.
    assert_eq!(
        unsafe { fsdp_config_default(c.as_mut_ptr()) },
        fsdp_status::FSDP_OK
    );
    // SAFETY: written by the call above.
    let mut c = unsafe { c.assume_init() };
    c.timeout_seconds = timeout_seconds;
    c
}

fn create(plan: *const fsdp_plan, config: &fsdp_config) -> (fsdp_status, *mut fsdp_engine) {
    let mut engine = null_mut();
    // SAFETY: valid pointers; the legacy default stream; no allocator.
    let status = unsafe { fsdp_engine_create_cuda_nccl_env(plan, config, 0, null(), &mut engine) };
    (status, engine)
}

/// A TCP port nothing listens on now.
fn free_port() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port().to_string()
}

fn torchrun(rank: &'static str, world: &'static str, port: &str) -> Vec<(&'static str, String)> {
    vec![
        ("RANK", rank.into()),
        ("WORLD_SIZE", world.into()),
        ("LOCAL_RANK", "0".into()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.into()),
    ]
}

fn set(vars: &[(&'static str, String)]) {
    let pairs: Vec<(&str, &str)> = vars.iter().map(|(k, v)| (*k, v.as_str())).collect();
    launch_environment(&pairs);
}

use fsdp_status::*;

#[test]
fn a_launch_environment_that_is_missing_or_wrong_is_named_before_any_device_is_touched() {
    let _env = ENVIRONMENT.lock().unwrap_or_else(|p| p.into_inner());
    let (plan1, config) = (plan(1), config(5.0));
    let port = free_port();
    for missing in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
    ] {
        let mut vars = torchrun("0", "1", &port);
        vars.retain(|(k, _)| *k != missing);
        set(&vars);
        let (status, engine) = create(plan1, &config);
        expect(status, FSDP_INVALID_ARGUMENT, missing);
        assert!(engine.is_null());
    }
    set(&torchrun("1", "1", &port));
    expect(
        create(plan1, &config).0,
        FSDP_INVALID_ARGUMENT,
        "RANK is 1, not below WORLD_SIZE 1",
    );
    set(&torchrun("0", "2", &port));
    expect(
        create(plan1, &config).0,
        FSDP_INVALID_ARGUMENT,
        "the plan has world size 1, the communicator 2",
    );
    let mut vars = torchrun("0", "1", &port);
    vars[4].1 = "http".into();
    set(&vars);
    expect(
        create(plan1, &config).0,
        FSDP_INVALID_ARGUMENT,
        "MASTER_PORT",
    );
    // SAFETY: a live plan.
    assert_eq!(fsdp_plan_destroy(plan1), FSDP_OK);
    launch_environment(&[]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_engine_made_from_the_launch_environment_joins_and_a_lone_rank_times_out() {
    let _env = ENVIRONMENT.lock().unwrap_or_else(|p| p.into_inner());
    // World size 1: rank 0 serves no one, makes the id and joins alone.
    let plan1 = plan(1);
    set(&torchrun("0", "1", &free_port()));
    let (status, engine) = create(plan1, &config(30.0));
    assert_eq!(status, FSDP_OK, "{}", last_error());
    let (mut current, mut peak) = (0usize, 0usize);
    // SAFETY: a live engine; valid pointers.
    assert_eq!(
        unsafe { fsdp_engine_memory(engine, &mut current, &mut peak) },
        FSDP_OK
    );
    // The plan's shard of 9 f32 weights, its gradient and AdamW's two moments, at least.
    assert!(current >= 4 * 9 * 4, "{current} bytes held");
    assert_eq!(fsdp_engine_destroy(engine), FSDP_OK);
    // Rank 1 of 2 with no rank 0: the fetch of the id times out within the config's deadline,
    // and the process goes on.
    let plan2 = plan(2);
    set(&torchrun("1", "2", &free_port()));
    let started = Instant::now();
    let (status, engine) = create(plan2, &config(1.0));
    expect(
        status,
        FSDP_TIMEOUT,
        "fetching the NCCL unique id from rank 0",
    );
    assert!(engine.is_null());
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_eq!(fsdp_plan_destroy(plan1), FSDP_OK);
    assert_eq!(fsdp_plan_destroy(plan2), FSDP_OK);
    launch_environment(&[]);
}
