//! Too little memory is an error the process survives, never an abort: checked in a child process
//! whose address space is limited to less than what it asks for.

use std::process::Command;
use std::sync::Arc;

use fsdp_fusion::ffi::{fsdp_local_group, fsdp_local_group_create, fsdp_status};
use fsdp_fusion::{Backend, CpuBackend, DType, Engine, EngineConfig, Error, LocalComm, ModelSpec};
use fsdp_fusion::{ParamSpec, Plan};

/// Set in the child: it makes the requests instead of spawning.
const CHILD: &str = "FSDP_OUT_OF_MEMORY_CHILD";

/// The child's address space, in KiB: 1.5 GiB, well under the engine it asks for.
const LIMIT_KIB: u64 = 1536 * 1024;

#[test]
fn under_a_memory_limit_large_requests_are_errors_and_the_process_goes_on() {
    if std::env::var_os(CHILD).is_some() {
        make_requests();
        return;
    }
    let exe = std::env::current_exe().expect("the test executable");
    let name = "under_a_memory_limit_large_requests_are_errors_and_the_process_goes_on";
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "ulimit -v {LIMIT_KIB} && exec \"$0\" --exact {name} --nocapture --test-threads=1"
        ))
        .arg(exe)
        .env(CHILD, "1")
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the child failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("every request was refused and the process went on"),
        "{stdout}"
    );
}

/// What the child asks for, each past its address-space limit.
fn make_requests() {
    // A local group of 2^40 ranks.
    let err = LocalComm::group(1 << 40).unwrap_err();
    assert!(
        matches!(&err, Error::OutOfMemory { what, .. } if what == "a local group"),
        "{err:?}"
    );
    // The same through the C API.
    let mut group: *mut fsdp_local_group = std::ptr::null_mut();
    // SAFETY: a valid out-pointer.
    let status = unsafe { fsdp_local_group_create(1 << 40, &mut group) };
    assert_eq!(status, fsdp_status::FSDP_OUT_OF_MEMORY);
    // An engine of 4 GiB of parameters (and as much again in gradients and optimizer state).
    let model = ModelSpec::new(vec![ParamSpec::new("w", &[1 << 30], DType::F32)]).unwrap();
    let plan = Arc::new(Plan::new(&model, 1).unwrap());
    let comm = LocalComm::group(1).unwrap().pop().unwrap();
    let refused = Engine::try_new(plan, EngineConfig::default(), CpuBackend::new(), comm)
        .err()
        .expect("a 4 GiB engine under a 1.5 GiB limit");
    assert!(
        matches!(&refused.error, Error::OutOfMemory { bytes, what } if *bytes == 4 << 30 && what == "the parameter shard of group 0"),
        "{:?}",
        refused.error
    );
    // Nothing was half-built: the backend holds nothing, and small work goes on.
    assert_eq!(refused.backend.memory().current, 0);
    let small = Arc::new(
        Plan::new(
            &ModelSpec::new(vec![ParamSpec::new("v", &[16], DType::F32)]).unwrap(),
            1,
        )
        .unwrap(),
    );
    let e = Engine::new(
        small,
        EngineConfig::default(),
        refused.backend,
        refused.comm,
    )
    .unwrap();
    assert_eq!(e.param_shard(0).unwrap(), vec![0u8; 256]);
    println!("every request was refused and the process went on");
}
