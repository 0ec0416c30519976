//! Engines from C: made on the CPU or CUDA backend (with NCCL, or loopback ranks on one GPU),
//! aborted and destroyed. Their hooks are in `engine_hooks`, their values in `engine_values`.

use std::ffi::c_int;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::allocator::{allocator_of, fsdp_device_allocator};
use super::comms::{Comms, Takeable, give_back, take_comms};
use super::group::{device_ordinal, unique_id_of};
use super::handles::{AnyEngine, abort_engine, destroy, object, plan_of, store_engine, wrong_kind};
use super::registry::Object;
use super::status::{Outcome, boundary, fsdp_status, null};
use super::types::{
    config_of, fsdp_config, fsdp_engine, fsdp_local_group, fsdp_loopback_group, fsdp_plan,
};
use crate::backend::Backend;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::comm::Communicator;
use crate::comm::launch::LaunchEnv;
use crate::comm::local::LocalComm;
use crate::comm::loopback::LoopbackComm;
use crate::comm::nccl::{NcclComm, UNIQUE_ID_BYTES};
use crate::config::EngineConfig;
use crate::config::GradShardMemory;
use crate::engine::Engine;
use crate::error::Error;
use crate::plan::Plan;

/// Creates rank `rank`'s engine on the CPU backend, taking the rank's communicator from `group`
/// (once per rank). Allocates every buffer the plan predicts, then compares the ranks' plans (a
/// collective: every rank of the group makes its engine) and fails with `FSDP_INVALID_ARGUMENT`,
/// naming the first differing parameter, where they differ. Parameters start at zero until
/// `fsdp_engine_load_param`. Release with `fsdp_engine_destroy`. A failed call gives the
/// communicator back to the group: the rank can try again (with a smaller configuration after
/// `FSDP_OUT_OF_MEMORY`, say). For a plan with process groups the group makes every rank's
/// communicators of each when the first rank asks, and each rank takes its own with the
/// world's.
///
/// # Safety
/// `config` is NULL or valid for a read; `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_create_cpu(
    plan: *const fsdp_plan,
    config: *const fsdp_config,
    group: *mut fsdp_local_group,
    rank: usize,
    out: *mut *mut fsdp_engine,
) -> fsdp_status {
    boundary(|| {
        let plan = plan_of(plan)?;
        // SAFETY: the caller's contract.
        let config = config_of(unsafe { config.as_ref() }.ok_or_else(|| null("config"))?)?;
        if out.is_null() {
            return Err(null("out"));
        }
        let group = object(group as u64, "group")?;
        let Object::Group(Comms::Local { comms, seed }) = &*group else {
            return Err(wrong_kind("group"));
        };
        let backend = match seed {
            None => CpuBackend::new(),
            Some(seed) => CpuBackend::asynchronous(seed.wrapping_add(rank as u64))?,
        };
        let made = from_group(comms, rank, (plan, config), backend, LocalComm::group)?;
        store_engine(AnyEngine::Cpu(made), out)
    })
}

/// Creates rank `rank` of `world_size` on CUDA device `device` with NCCL: one process (or thread)
/// per GPU, every rank with the same `unique_id` (`id_len` bytes, 128, from
/// `fsdp_nccl_unique_id` on one rank) and a plan made for `world_size`.
///
/// `stream` is the compute stream: a `CUstream` / `cudaStream_t` of the device's primary context,
/// e.g. `torch.cuda.current_stream().cuda_stream`; 0 is the legacy default stream. The caller
/// keeps it alive until the engine has gone (as `fsdp_device_allocator.context` says) and
/// launches the model's work on it: the engine makes it wait for gathers, reads gradients and
/// runs the optimizer on it. The engine creates its
/// own gather and reduce streams, and two NCCL communicators (one for gathers, one for
/// reductions, so that neither waits behind the other), and for each process group of the plan
/// two more, split from those (`ncclCommSplit`, a collective of every rank: ranks whose plans
/// declare other process groups time out there, before the plans are compared). `allocator` is
/// NULL (buffers from `cuMemAlloc`) or the caller's device allocator, which every buffer of the
/// engine then comes from; it is copied.
///
/// Blocks until every rank joined the NCCL group, at most `config->timeout_seconds`
/// (`FSDP_TIMEOUT` past it). Allocates every buffer the plan predicts on the device (per-step
/// gradient shards, which need an allocator, each step); parameters start at zero until
/// `fsdp_engine_load_param`. Release with `fsdp_engine_destroy`. `FSDP_UNAVAILABLE` when the
/// CUDA driver, the kernels or NCCL (2.18 or later) are missing, `FSDP_DEVICE_ERROR` for a device
/// that does not exist or a stream of another context.
///
/// Once made, NCCL's asynchronous errors are looked for at every call and, by a watchdog thread,
/// while the host waits; such an error, a timeout or any failure that poisons the engine aborts
/// its communicators (`ncclCommAbort`), so that its streams drain and destroying it does not wait
/// for peers.
///
/// # Safety
/// `config` and `allocator` are NULL or valid for a read; `unique_id` is NULL or valid for
/// `id_len` bytes; `out` is NULL or valid for a write; an allocator keeps the contract of
/// `fsdp_device_allocator` until the engine has gone.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_create_cuda_nccl(
    plan: *const fsdp_plan,
    config: *const fsdp_config,
    device: c_int,
    unique_id: *const u8,
    id_len: usize,
    rank: usize,
    world_size: usize,
    stream: u64,
    allocator: *const fsdp_device_allocator,
    out: *mut *mut fsdp_engine,
) -> fsdp_status {
    boundary(|| {
        // SAFETY: the caller's contract.
        let id = unsafe { unique_id_of(unique_id, id_len) }?;
        let device = device_ordinal(device)?;
        let membership = Membership {
            device,
            rank,
            world_size,
        };
        // SAFETY: the caller's contract.
        unsafe { nccl_engine(plan, config, membership, stream, allocator, out, |_| Ok(id)) }
    })
}

/// Creates this process's engine as `fsdp_engine_create_cuda_nccl` does, its rank, world size and
/// device read from the environment a launcher such as torchrun sets: `RANK`, `WORLD_SIZE`,
/// `LOCAL_RANK` (the CUDA device), `MASTER_ADDR` and `MASTER_PORT`. Rank 0 makes the NCCL unique id
/// and serves it over TCP on `MASTER_ADDR:MASTER_PORT` (the next port when
/// `TORCHELASTIC_USE_AGENT_STORE` is `True`: torchrun's own store holds `MASTER_PORT` then) until
/// every rank fetched it; each other rank fetches it, looking `MASTER_ADDR` up and connecting again
/// until rank 0's name resolves and rank 0 listens (a name that never resolves is `FSDP_TIMEOUT` at
/// the deadline). Each exchange waits at most `config->timeout_seconds` (`FSDP_TIMEOUT`). A
/// variable missing or malformed, or a world size other than the plan's, is `FSDP_INVALID_ARGUMENT`
/// naming it; ranks whose `WORLD_SIZE` differ, or two with one `RANK`, are `FSDP_COMM_ERROR` naming
/// both values. `stream` and `allocator` as for `fsdp_engine_create_cuda_nccl`.
///
/// # Safety
/// As `fsdp_engine_create_cuda_nccl`, for `config`, `allocator` and `out`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_create_cuda_nccl_env(
    plan: *const fsdp_plan,
    config: *const fsdp_config,
    stream: u64,
    allocator: *const fsdp_device_allocator,
    out: *mut *mut fsdp_engine,
) -> fsdp_status {
    boundary(|| {
        let env = LaunchEnv::from_env()?;
        let membership = Membership {
            device: env.local_rank,
            rank: env.rank,
            world_size: env.world_size,
        };
        let share = |timeout| env.share_id(NcclComm::unique_id, timeout);
        // SAFETY: the caller's contract.
        unsafe { nccl_engine(plan, config, membership, stream, allocator, out, share) }
    })
}

/// Which rank of how many an NCCL rank is, and on which device.
struct Membership {
    device: usize,
    rank: usize,
    world_size: usize,
}

/// The body of both NCCL constructors: every argument checked, and the backend made, before
/// `unique_id` is fetched (with the config's timeout) and the rank joins its group.
///
/// # Safety
/// As `fsdp_engine_create_cuda_nccl`, for `config`, `allocator` and `out`.
unsafe fn nccl_engine(
    plan: *const fsdp_plan,
    config: *const fsdp_config,
    membership: Membership,
    stream: u64,
    allocator: *const fsdp_device_allocator,
    out: *mut *mut fsdp_engine,
    unique_id: impl FnOnce(Duration) -> crate::error::Result<[u8; UNIQUE_ID_BYTES]>,
) -> Outcome {
    let plan = plan_of(plan)?;
    // SAFETY: the caller's contract.
    let config = config_of(unsafe { config.as_ref() }.ok_or_else(|| null("config"))?)?;
    if out.is_null() {
        return Err(null("out"));
    }
    let Membership {
        device,
        rank,
        world_size,
    } = membership;
    // Checked before joining: a rank that joins with the wrong world size hangs the others.
    if world_size != plan.world_size() {
        return Err(Error::WorldSizeMismatch {
            plan: plan.world_size(),
            comm: world_size,
        }
        .into());
    }
    if rank >= world_size {
        return Err(Error::RankOutOfRange { rank, world_size }.into());
    }
    // SAFETY: the function's contract.
    let backend = unsafe { cuda_backend(device, stream, allocator) }?;
    // Refused before joining, as the engine would refuse it after.
    if config.grad_shard_memory == GradShardMemory::PerStep && !backend.frees_in_stream_order() {
        return Err(Error::InvalidConfig {
            field: "grad_shard_memory",
            reason: "per step, but no allocator was given".into(),
        }
        .into());
    }
    let id = unique_id(config.timeout)?;
    let comm = NcclComm::new(&id, rank, world_size, &backend, config.timeout)?;
    let groups = comm.process_groups(plan.process_groups(), config.timeout)?;
    let engine = Engine::with_process_groups(plan, config, backend, comm, groups)?;
    store_engine(AnyEngine::CudaNccl(engine), out)
}

/// Creates rank `rank`'s engine on CUDA device `device`, taking the rank's communicator from
/// `group` (once per rank, and only once the device is found usable: a failed call leaves it in
/// the group). `stream` is the rank's compute stream, as for `fsdp_engine_create_cuda_nccl`; give
/// each rank its own; `allocator` as there. Process groups as for `fsdp_engine_create_cpu`.
/// Release with `fsdp_engine_destroy`.
///
/// # Safety
/// `config` and `allocator` are NULL or valid for a read; `out` is NULL or valid for a write; an
/// allocator keeps the contract of `fsdp_device_allocator` until the engine has gone.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_create_cuda_loopback(
    plan: *const fsdp_plan,
    config: *const fsdp_config,
    device: c_int,
    group: *mut fsdp_loopback_group,
    rank: usize,
    stream: u64,
    allocator: *const fsdp_device_allocator,
    out: *mut *mut fsdp_engine,
) -> fsdp_status {
    boundary(|| {
        let plan = plan_of(plan)?;
        // SAFETY: the caller's contract.
        let config = config_of(unsafe { config.as_ref() }.ok_or_else(|| null("config"))?)?;
        if out.is_null() {
            return Err(null("out"));
        }
        let device = device_ordinal(device)?;
        let group = object(group as u64, "group")?;
        let Object::Group(Comms::Loopback(comms)) = &*group else {
            return Err(wrong_kind("group"));
        };
        // SAFETY: the function's contract.
        let backend = unsafe { cuda_backend(device, stream, allocator) }?;
        let made = from_group(comms, rank, (plan, config), backend, LoopbackComm::group)?;
        store_engine(AnyEngine::CudaLoopback(made), out)
    })
}

/// Rank `rank`'s engine on `backend` with its communicators taken from a group (those of the
/// plan's process groups made by `make` where no rank made them yet); given back when the
/// engine is refused, so that the rank can try again.
fn from_group<B: Backend, C: Communicator<B>>(
    comms: &Mutex<Takeable<C>>,
    rank: usize,
    (plan, config): (Arc<Plan>, EngineConfig),
    backend: B,
    make: fn(usize) -> crate::error::Result<Vec<C>>,
) -> Outcome<Engine<B, C>> {
    let declared = plan.process_groups().to_vec();
    let (comm, groups) = take_comms(comms, (rank, plan.world_size()), &declared, make)?;
    Engine::try_with_process_groups(plan, config, backend, comm, groups).or_else(|refused| {
        let comms_back = (refused.comm, refused.process_groups);
        give_back(comms, rank, &declared, comms_back)?;
        Err(refused.error.into())
    })
}

/// The CUDA backend of a C engine: on `device`, with `stream` as its compute stream and its
/// buffers from `allocator` when one is given.
///
/// # Safety
/// `stream` is 0 or a live stream that outlives the engine; `allocator` is NULL or valid for a
/// read, keeping its contract for the engine's life.
unsafe fn cuda_backend(
    device: usize,
    stream: u64,
    allocator: *const fsdp_device_allocator,
) -> Outcome<CudaBackend> {
    // SAFETY: the caller's contract.
    let allocator = unsafe { allocator_of(allocator) }?;
    // SAFETY: the caller's contract.
    let backend = unsafe { CudaBackend::with_raw_stream(device, stream) }?;
    Ok(match allocator {
        Some(allocator) => backend.with_allocator(allocator),
        None => backend,
    })
}

/// Releases an engine and everything it allocated; NULL is accepted. Never waits for another
/// handle. A capture still under way is given up first, as `fsdp_engine_abandon_capture` does
/// (the engine's own capture only on the thread that began it: give it up there first, as a
/// call on another thread may be the one that drops the engine). Calls still running on the
/// engine in other threads (blocked in a collective, say) are aborted and return
/// `FSDP_ABORTED`; the engine goes when the last of them returns, on its thread. Otherwise the
/// engine goes before this returns, here (never on a thread that only reads its counters or
/// aborts it): an idle engine finishes the work it queued first (on a GPU, the device work
/// still using its memory; memory from an allocator goes back to it in stream order instead)
/// and waits for an asynchronous save's files. A call that found the handle before it went,
/// and had not begun, returns `FSDP_INVALID_HANDLE`. CPU and loopback ranks still in a collective with it fail
/// with `FSDP_COMM_ERROR` instead of waiting; NCCL ranks must all destroy their engines at the
/// same point of the training.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_destroy(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| destroy(engine as u64, |o| matches!(o, Object::Engine(_)), "engine"))
}

/// Aborts the engine from any thread, without waiting for it: a call blocked on it (in a
/// collective, or waiting for the device) returns `FSDP_ABORTED`, every later call
/// `FSDP_POISONED`, and its peers see the rank gone. Its communicators are aborted at once
/// (`ncclCommAbort`), so collectives stuck on the device end, its streams drain, and the
/// caller's own waits on them return. The engine must still be destroyed.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_abort(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| abort_engine(engine))
}
