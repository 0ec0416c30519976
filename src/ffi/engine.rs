//! Engines from C: made on the CPU or CUDA backend, driven through their hooks, read and
//! destroyed.

use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::allocator::{allocator_of, fsdp_device_allocator};
use super::comms::{Comms, Takeable, give_back, take_comms};
use super::group::{device_ordinal, unique_id_of};
use super::handles::{
    AnyEngine, TensorMemory, abort_engine, destroy, engine_report, object, on_engine, plan_of,
    store_engine, tensor_memory, with_engine, wrong_kind,
};
use super::registry::Object;
use super::status::{Failure, Outcome, boundary, fsdp_status, invalid, null, put};
use super::types::{
    config_of, dtype_code, dtype_of, fsdp_config, fsdp_counters, fsdp_engine, fsdp_grad,
    fsdp_local_group, fsdp_loopback_group, fsdp_plan, unit_of,
};
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::backend::{Backend, Input};
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
use crate::types::{DType, ParamId};

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
/// keeps it alive until the engine is destroyed and launches the model's work on it: the engine
/// makes it wait for gathers, reads gradients and runs the optimizer on it. The engine creates its
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
/// `fsdp_device_allocator` until the engine is destroyed.
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
        let place = Place {
            device,
            rank,
            world_size,
        };
        // SAFETY: the caller's contract.
        unsafe { nccl_engine(plan, config, place, stream, allocator, out, |_| Ok(id)) }
    })
}

/// Creates this process's engine as `fsdp_engine_create_cuda_nccl` does, its place read from
/// the environment a launcher such as torchrun sets: `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (the
/// CUDA device), `MASTER_ADDR` and `MASTER_PORT`. Rank 0 makes the NCCL unique id and serves it
/// over TCP on `MASTER_ADDR:MASTER_PORT` (the next port when `TORCHELASTIC_USE_AGENT_STORE` is
/// `True`: torchrun's own store holds `MASTER_PORT` then) until every rank fetched it; each
/// other rank fetches it, retrying until rank 0 listens. Each exchange waits at most
/// `config->timeout_seconds` (`FSDP_TIMEOUT`). A variable missing or malformed, or a world size
/// other than the plan's, is `FSDP_INVALID_ARGUMENT` naming it; ranks whose `WORLD_SIZE`
/// differ, or two with one `RANK`, are `FSDP_COMM_ERROR` naming both values. `stream` and
/// `allocator` as for `fsdp_engine_create_cuda_nccl`.
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
        let place = Place {
            device: env.local_rank,
            rank: env.rank,
            world_size: env.world_size,
        };
        let share = |timeout| env.share_id(NcclComm::unique_id, timeout);
        // SAFETY: the caller's contract.
        unsafe { nccl_engine(plan, config, place, stream, allocator, out, share) }
    })
}

/// Where an NCCL rank runs.
struct Place {
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
    place: Place,
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
    let Place {
        device,
        rank,
        world_size,
    } = place;
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
/// allocator keeps the contract of `fsdp_device_allocator` until the engine is destroyed.
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
/// handle. A call still running on the engine in another thread (blocked in a collective, say) is
/// aborted and returns `FSDP_ABORTED`; the engine goes when it returns. An idle engine finishes
/// the work it queued first (on a GPU, the device work still using its memory; memory from an
/// allocator goes back to it in stream order instead). CPU and loopback
/// ranks still in a collective with it fail with `FSDP_COMM_ERROR` instead of waiting; NCCL ranks
/// must all destroy their engines at the same point of the training.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_destroy(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| destroy(engine as u64, |o| matches!(o, Object::Engine(_)), "engine"))
}

/// Before `unit`'s forward (`FSDP_ROOT` for the root): gathers its groups, prefetches the next
/// unit. Takes part in collectives: every rank must call it. On a GPU it does not block the host.
/// A forward while a unit's backward is open (a recompute, for activation checkpointing) stays
/// part of that backward pass.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_pre_forward(engine: *mut fsdp_engine, unit: i64) -> fsdp_status {
    boundary(|| {
        let unit = unit_of(unit)?;
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.pre_forward(unit))?)
        })
    })
}

/// After `unit`'s forward: its parameter views stay valid only while another of its hooks is open.
/// Does not block the host.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_post_forward(engine: *mut fsdp_engine, unit: i64) -> fsdp_status {
    boundary(|| {
        let unit = unit_of(unit)?;
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.post_forward(unit))?)
        })
    })
}

/// Before `unit`'s backward: as `fsdp_engine_pre_forward`, prefetching in backward order.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_pre_backward(engine: *mut fsdp_engine, unit: i64) -> fsdp_status {
    boundary(|| {
        let unit = unit_of(unit)?;
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.pre_backward(unit))?)
        })
    })
}

/// After `unit`'s backward. Optional: `fsdp_engine_finish_grad_sync` ends any still open. Does
/// not block the host.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_post_backward(engine: *mut fsdp_engine, unit: i64) -> fsdp_status {
    boundary(|| {
        let unit = unit_of(unit)?;
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.post_backward(unit))?)
        })
    })
}

/// Writes `numel` elements of `dtype` (the parameter's whole value) into this rank's shard; only
/// the rank's part is kept. `data` is host memory on every backend, read before the call returns.
/// Every rank loads every parameter, between steps. Blocks: on a GPU, until the copy to the device
/// is done (after the work already queued on the engine's streams).
///
/// # Safety
/// `data` is NULL or valid for `numel` elements of `dtype`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_load_param(
    engine: *mut fsdp_engine,
    param: usize,
    data: *const c_void,
    numel: usize,
    dtype: u32,
) -> fsdp_status {
    boundary(|| {
        let dtype = dtype_of(dtype)?;
        // SAFETY: the caller's contract.
        let bytes = unsafe { host_bytes(data, numel, dtype, "data") }?;
        let input = Input::host_bytes(bytes, dtype);
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.load_param(ParamId(param), input))?)
        })
    })
}

/// # Safety
/// `data` is NULL or valid for `numel` elements of `dtype`.
unsafe fn host_bytes<'a>(
    data: *const c_void,
    numel: usize,
    dtype: DType,
    what: &'static str,
) -> Outcome<&'a [u8]> {
    let len = numel
        .checked_mul(dtype.size())
        .ok_or_else(|| invalid(format!("{numel} elements of {dtype} overflow")))?;
    if len == 0 {
        return Ok(&[]);
    }
    if data.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-null and valid for `len` bytes by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(data.cast::<u8>(), len) })
}

/// The address of `param`'s gathered values and their count and dtype, valid while one of the
/// parameter's unit's hooks is open; read only (it is a copy of the shards). The engine owns the
/// memory, which holds another group once the unit's hooks closed and the unit was evicted.
///
/// CPU engine: host memory (on an asynchronous group, the call first waits for the engine's
/// compute stream). CUDA engine: a device address, to read on the compute stream only (the hook
/// that opened the unit made that stream wait for the gather); does not block.
///
/// # Safety
/// Each out-pointer is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_param(
    engine: *mut fsdp_engine,
    param: usize,
    data: *mut *const c_void,
    numel: *mut usize,
    dtype: *mut u32,
) -> fsdp_status {
    boundary(|| {
        if data.is_null() || numel.is_null() || dtype.is_null() {
            return Err(null("data, numel or dtype"));
        }
        let (address, layout) = on_engine(engine, |any| {
            with_engine!(any, e => {
                let address = e.param_address(ParamId(param))?;
                Ok((address, e.plan().param(ParamId(param))?.clone()))
            })
        })?;
        // SAFETY: checked non-null; the caller's contract.
        unsafe {
            put(data, "data", address as *const c_void)?;
            put(numel, "numel", layout.numel)?;
            put(dtype, "dtype", dtype_code(layout.dtype))
        }
    })
}

/// Hands over `param`'s gradient for this backward pass: `numel` elements of `dtype` (the
/// parameter's dtype or `FSDP_F32`); it is added in fp32 to this pass's reduction. The group's
/// last gradient launches its reduce-scatter (a collective). The caller keeps ownership of `data`.
///
/// CPU engine: `data` is host memory, read before the call returns. CUDA engine: `data` is a
/// device address, read on the compute stream (the caller's stream) after the work already queued
/// there; it must stay valid until that stream passed this point, which PyTorch's caching
/// allocator ensures for a tensor made on that stream. Does not block the host.
///
/// # Safety
/// CPU engine: `data` is NULL or valid for `numel` elements of `dtype`. CUDA engine: `data` is 0
/// or a device address valid for `numel` elements of `dtype` until the compute stream read them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_grad(
    engine: *mut fsdp_engine,
    param: usize,
    data: *const c_void,
    numel: usize,
    dtype: u32,
) -> fsdp_status {
    boundary(|| {
        let dtype = dtype_of(dtype)?;
        // SAFETY: the caller's contract.
        let input = unsafe { caller_input(tensor_memory(engine)?, data, numel, dtype) }?;
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.grad(ParamId(param), input))?)
        })
    })
}

/// Hands over several gradients of this backward pass at once: as `fsdp_engine_grad` on each
/// entry in order, for one call per unit instead of one per parameter. Every entry is checked
/// (its parameter, dtype, length, and no parameter twice) before any is taken, so a refused
/// batch changes nothing. `count` 0 does nothing.
///
/// # Safety
/// `grads` is NULL (with `count` 0) or valid for `count` entries, each of whose `data` is as
/// `fsdp_engine_grad` requires.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_grads(
    engine: *mut fsdp_engine,
    grads: *const fsdp_grad,
    count: usize,
) -> fsdp_status {
    boundary(|| {
        // SAFETY: the caller's contract.
        let entries = unsafe { entries(grads, count, "grads") }?;
        let memory = tensor_memory(engine)?;
        let mut batch = crate::fallible::with_capacity(entries.len(), "a gradient batch")?;
        for (i, g) in entries.iter().enumerate() {
            let dtype =
                dtype_of(g.dtype).map_err(|f| invalid(format!("grads[{i}]: {}", f.message)))?;
            // SAFETY: the caller's contract for each entry.
            let input = unsafe { caller_input(memory, g.data, g.numel, dtype) }
                .map_err(|f| Failure::new(f.status, format!("grads[{i}]: {}", f.message)))?;
            batch.push((ParamId(g.param), input));
        }
        on_engine(engine, |any| Ok(with_engine!(any, e => e.grads(&batch))?))
    })
}

/// The gathered addresses of `count` parameters at once, `data[i]` for `params[i]`: as
/// `fsdp_engine_param` on each, for one call per unit instead of one per parameter. Every
/// parameter's unit must have a hook open; on failure nothing is written.
///
/// # Safety
/// `params` and `data` are NULL (with `count` 0) or valid for `count` reads and writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_params(
    engine: *mut fsdp_engine,
    params: *const usize,
    count: usize,
    data: *mut *const c_void,
) -> fsdp_status {
    boundary(|| {
        // SAFETY: the caller's contract.
        let ids = unsafe { entries(params, count, "params") }?;
        if data.is_null() && count > 0 {
            return Err(null("data"));
        }
        let addresses = on_engine(engine, |any| {
            let mut addresses = crate::fallible::with_capacity(ids.len(), "addresses")?;
            for &id in ids {
                addresses.push(with_engine!(any, e => e.param_address(ParamId(id)))?);
            }
            Ok(addresses)
        })?;
        for (i, address) in addresses.into_iter().enumerate() {
            // SAFETY: `data` is non-null and valid for `count` writes by the caller's contract.
            unsafe { data.add(i).write(address as *const c_void) };
        }
        Ok(())
    })
}

/// `count` entries at `ptr`: empty for `count` 0 (whatever `ptr`), else `ptr` must not be NULL.
///
/// # Safety
/// `ptr` is NULL or valid for `count` reads of `T` for the returned lifetime.
unsafe fn entries<'a, T>(ptr: *const T, count: usize, what: &str) -> Outcome<&'a [T]> {
    if count == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-null and valid for `count` entries by the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr, count) })
}

/// A caller's tensor in `memory`: host memory for a CPU engine, a device address on the compute
/// stream for a CUDA engine.
///
/// # Safety
/// Host memory: `data` is NULL or valid for `numel` elements of `dtype`. Device memory: as
/// `Input::Device` requires.
unsafe fn caller_input<'a>(
    memory: TensorMemory,
    data: *const c_void,
    numel: usize,
    dtype: DType,
) -> Outcome<Input<'a>> {
    match memory {
        TensorMemory::Host => {
            // SAFETY: the caller's contract.
            let bytes = unsafe { host_bytes(data, numel, dtype, "data") }?;
            Ok(Input::host_bytes(bytes, dtype))
        }
        TensorMemory::Device => {
            if data.is_null() && numel > 0 {
                return Err(null("data"));
            }
            // SAFETY: the caller's contract, which is `Input::device`'s.
            Ok(unsafe { Input::device(data as u64, numel, dtype) })
        }
    }
}

/// Opens `param`'s fp32 place in its gradient slot (`numel` floats at `*out`) for the caller to
/// write this pass's gradient into; `fsdp_engine_commit_grad` must follow before any other
/// gradient or hook. The place is NOT zero-filled: it holds what an earlier gradient left there,
/// so write every element and never add into it (a GEMM with beta = 1 would add those values to
/// the gradient). The engine owns the memory; it is the caller's to write until the commit.
/// CPU engine: host memory, written by the host (on an asynchronous group, the call first waits
/// for the engine's compute stream). CUDA engine: a device address, to write on the compute
/// stream; does not block. `FSDP_MISUSE`, with nothing opened, where gradients travel in bf16
/// (`reduce_dtype`) above world size 1, and for a step's later passes at world size 1 or under
/// `FSDP_NO_SYNC` (where they add into the earlier passes'): hand them over with
/// `fsdp_engine_grad` there.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_grad_slot(
    engine: *mut fsdp_engine,
    param: usize,
    out: *mut *mut f32,
) -> fsdp_status {
    boundary(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        let address = on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.grad_slot_address(ParamId(param)))?)
        })?;
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", address as *mut f32) }
    })
}

/// Declares the gradient written into the slot `fsdp_engine_grad_slot` opened (on a GPU: queued
/// on the compute stream before this call). Does not block.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_commit_grad(engine: *mut fsdp_engine, param: usize) -> fsdp_status {
    boundary(|| {
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.commit_grad(ParamId(param)))?)
        })
    })
}

/// Ends the step's backward passes: reduces every group and orders the optimizer after the
/// reductions. A collective. On a GPU it does not block the host.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_finish_grad_sync(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| {
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.finish_grad_sync())?)
        })
    })
}

/// Steps the optimizer on this rank's shards, once per step, after the gradient sync. On a GPU it
/// runs on the compute stream and does not block the host.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_optimizer_step(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| {
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.optimizer_step())?)
        })
    })
}

/// Ends the step: gathered buffers are released (views from `fsdp_engine_param` are stale); the
/// next step starts. Does not block the host.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_end_step(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| on_engine(engine, |any| Ok(with_engine!(any, e => e.end_step())?)))
}

/// What the engine did, as of the end of its last call: never waits for a call in progress on
/// another thread, and works on a poisoned engine too.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_counters(
    engine: *mut fsdp_engine,
    out: *mut fsdp_counters,
) -> fsdp_status {
    boundary(|| {
        let (counters, _) = engine_report(engine)?;
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", counters) }
    })
}

/// Bytes the engine's backend held at the end of its last call, and at its peak; as
/// `fsdp_engine_counters`, never waits.
///
/// # Safety
/// Each out-pointer is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_memory(
    engine: *mut fsdp_engine,
    current: *mut usize,
    peak: *mut usize,
) -> fsdp_status {
    boundary(|| {
        if current.is_null() || peak.is_null() {
            return Err(null("current or peak"));
        }
        let (_, m) = engine_report(engine)?;
        // SAFETY: checked non-null; the caller's contract.
        unsafe {
            put(current, "current", m.current)?;
            put(peak, "peak", m.peak)
        }
    })
}

/// Copies this rank's parameter shard of group `group` (bytes in the group's dtype) into `out`,
/// host memory of `capacity` bytes; `*written` gets the shard's size. Blocks until the copy is
/// done (on a GPU, after the work already queued on the engine's streams).
///
/// # Safety
/// `out` is NULL or valid for `capacity` bytes; `written` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_param_shard(
    engine: *mut fsdp_engine,
    group: usize,
    out: *mut c_void,
    capacity: usize,
    written: *mut usize,
) -> fsdp_status {
    // SAFETY: the caller's contract.
    unsafe { group_bytes(engine, (group, false), (out, capacity), written) }
}

/// Copies group `group`'s whole padded buffer (bytes in its dtype), gathered from every rank's
/// shard (of a process group's group, from the shards of this rank's copy), into `out`, host
/// memory of `capacity` bytes; `*written` gets its size. A collective: every rank calls it for
/// the same groups in the same order, between steps (`FSDP_MISUSE` inside one). Blocks until the
/// bytes are there.
///
/// # Safety
/// `out` is NULL or valid for `capacity` bytes; `written` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_gather_group(
    engine: *mut fsdp_engine,
    group: usize,
    out: *mut c_void,
    capacity: usize,
    written: *mut usize,
) -> fsdp_status {
    // SAFETY: the caller's contract.
    unsafe { group_bytes(engine, (group, true), (out, capacity), written) }
}

/// Copies this rank's shard of `group` (or, `gathered`, the whole group from every rank's) into
/// the caller's `out` of `capacity` bytes and their count into `written`.
///
/// # Safety
/// `out` is NULL or valid for `capacity` bytes; `written` is NULL or valid for a write.
unsafe fn group_bytes(
    engine: *mut fsdp_engine,
    (group, gathered): (usize, bool),
    (out, capacity): (*mut c_void, usize),
    written: *mut usize,
) -> fsdp_status {
    boundary(|| {
        if out.is_null() || written.is_null() {
            return Err(null("out or written"));
        }
        let bytes = on_engine(engine, |any| {
            Ok(with_engine!(any, e => if gathered {
                e.gather_group(group)
            } else {
                e.param_shard(group)
            })?)
        })?;
        // SAFETY: the caller's contract.
        unsafe { copy_out(&bytes, (out, capacity), written) }
    })
}

/// Copies `bytes` into the caller's `out` of `capacity` bytes and their count into `written`.
///
/// # Safety
/// `out` is valid for `capacity` bytes and `written` for a write, both non-null.
unsafe fn copy_out(
    bytes: &[u8],
    (out, capacity): (*mut c_void, usize),
    written: *mut usize,
) -> Outcome {
    if bytes.len() > capacity {
        return Err(invalid(format!(
            "the copy has {} bytes, out holds {capacity}",
            bytes.len()
        )));
    }
    // SAFETY: non-null, valid for `capacity` >= `bytes.len()` bytes by the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.cast::<u8>(), bytes.len()) };
    // SAFETY: the caller's contract.
    unsafe { put(written, "written", bytes.len()) }
}

/// Writes to `out` the number of infinite or NaN values in this rank's gradient shards as synced
/// this step (a non-finite gradient on any rank shows on the rank holding its element). Allowed
/// from `fsdp_engine_finish_grad_sync` to `fsdp_engine_end_step` (`FSDP_MISUSE` otherwise);
/// blocks the host for the count.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_nonfinite_grads(
    engine: *mut fsdp_engine,
    out: *mut u64,
) -> fsdp_status {
    boundary(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        let count = on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.nonfinite_grads())?)
        })?;
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", count) }
    })
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
