//! Too little memory is an error the process survives, never an abort, and a call it fails
//! changes nothing: checked in a child process whose address space is limited.

use std::process::Command;
use std::sync::Arc;

use fsdp_fusion::ffi::{fsdp_local_group, fsdp_local_group_create, fsdp_status};
use fsdp_fusion::{Backend, CpuBackend, DType, Engine, EngineConfig, Error, Input, LocalComm};
use fsdp_fusion::{ModelSpec, ParamId, ParamSpec, Plan};
use fsdp_fusion_support::scratch::Scratch;

/// Set in the child: it makes the requests instead of spawning.
const CHILD: &str = "FSDP_OUT_OF_MEMORY_CHILD";

/// The child's address space, in KiB: 1.5 GiB, well under the engine it asks for.
const LIMIT_KIB: u64 = 1536 * 1024;

/// Runs `requests`, the body of the test `name`, alone in a child process (under `ulimit -v` of
/// `limit_kib` where given), which must succeed and print `done`; in the child, runs it.
fn in_child(name: &str, limit_kib: Option<u64>, requests: fn(), done: &str) {
    if std::env::var_os(CHILD).is_some() {
        requests();
        return;
    }
    let exe = std::env::current_exe().expect("the test executable");
    let limit = limit_kib.map_or_else(String::new, |kib| format!("ulimit -v {kib} && "));
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "{limit}exec \"$0\" --exact {name} --nocapture --test-threads=1"
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
    assert!(stdout.contains(done), "{stdout}");
}

#[test]
fn under_a_memory_limit_large_requests_are_errors_and_the_process_goes_on() {
    in_child(
        "under_a_memory_limit_large_requests_are_errors_and_the_process_goes_on",
        Some(LIMIT_KIB),
        make_requests,
        "every request was refused and the process went on",
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

#[test]
fn an_import_with_too_little_memory_to_widen_its_masters_changes_nothing() {
    in_child(
        "an_import_with_too_little_memory_to_widen_its_masters_changes_nothing",
        None,
        import_under_a_limit,
        "the import was refused whole, and went through once the memory was there",
    );
}

/// Imports a small parameter and a large one, both bf16 with fp32 masters, with room in the
/// address space for the file's values but not for the large one's values widened: the import
/// fails before the first parameter changes, and the engine goes on.
fn import_under_a_limit() {
    /// Elements of the large parameter: its values (64 MiB) and their widening (128 MiB) are
    /// each past the 32 MiB up to which the allocator may reuse freed memory.
    const LARGE: usize = 32 << 20;
    /// Room past the values for the import's small requests, under the widening's.
    const MARGIN: u64 = 32 << 20;
    let model = ModelSpec::new(vec![
        ParamSpec::new("small", &[16], DType::Bf16),
        ParamSpec::new("large", &[LARGE as u64], DType::Bf16),
    ])
    .unwrap();
    let plan = Arc::new(Plan::new(&model, 1).unwrap());
    let comm = LocalComm::group(1).unwrap().pop().unwrap();
    let mut e = Engine::new(plan, EngineConfig::default(), CpuBackend::new(), comm).unwrap();
    let bf16 = |value: f32, n: usize| half::bf16::from_f32(value).to_le_bytes().repeat(n);
    let load = |e: &mut Engine<CpuBackend, LocalComm>, value: f32| {
        for (id, n) in [(ParamId(0), 16), (ParamId(1), LARGE)] {
            e.load_param(id, Input::host_bytes(&bf16(value, n), DType::Bf16))
                .unwrap();
        }
    };
    let scratch = Scratch::new("out-of-memory-import");
    std::fs::create_dir_all(scratch.path()).unwrap();
    let file = scratch.join("model.safetensors");
    load(&mut e, 1.0);
    e.export_safetensors(&file).unwrap();
    let exported = e.param_shard(0).unwrap();
    load(&mut e, 2.0);
    let loaded = e.param_shard(0).unwrap();

    let values = 2 * (16 + LARGE as u64);
    let unlimited = limit_address_space(address_space() + values + MARGIN);
    let refused = e.import_safetensors(&file);
    limit_address_space(unlimited);
    assert!(
        matches!(&refused, Err(Error::OutOfMemory { what, .. }) if what == "a master"),
        "{refused:?}"
    );
    assert!(
        e.param_shard(0).unwrap() == loaded,
        "the import changed a parameter"
    );

    e.import_safetensors(&file).unwrap();
    assert!(e.param_shard(0).unwrap() == exported);
    println!("the import was refused whole, and went through once the memory was there");
}

/// This process's address space in bytes.
fn address_space() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmSize:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// Sets the soft limit of this process's address space to `bytes`; the one it replaces.
fn limit_address_space(bytes: u64) -> u64 {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid out-pointer.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut old) }, 0);
    let new = libc::rlimit {
        rlim_cur: bytes,
        rlim_max: old.rlim_max,
    };
    // SAFETY: a valid pointer to a limit at or under the hard one.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &new) }, 0);
    old.rlim_cur
}
