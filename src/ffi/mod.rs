//! The C ABI: `include/fsdp_fusion.h`, generated from this module by cbindgen.
//!
//! Conventions: every function returns an [`fsdp_status`]; on failure, [`fsdp_last_error`] gives
//! the calling thread's message. Handles (`fsdp_plan`, `fsdp_local_group`, `fsdp_loopback_group`,
//! `fsdp_engine`) are opaque numbers made by a `*_create` function and released by the matching
//! `*_destroy` (which accepts NULL); a destroyed handle is reported as `FSDP_INVALID_HANDLE`, never
//! dereferenced. Every function catches panics (`FSDP_PANIC`). Sizes are `size_t`. Handles may be
//! used from any thread; calls on one engine are serialized, and an engine is meant to be driven by
//! one thread at a time (one rank). Pointers passed in are borrowed for the call only unless a
//! function says otherwise.
//!
//! Engines run on the CPU backend (`fsdp_engine_create_cpu`: every address is host memory) or on
//! the CUDA backend (`fsdp_engine_create_cuda_nccl`, `fsdp_engine_create_cuda_loopback`): there
//! parameter views, gradients and gradient slots are device addresses used on the caller's stream,
//! while initial values and shard copies stay in host memory.

#![allow(non_camel_case_types)]

mod registry;

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::{Arc, LazyLock, Mutex};

use crate::backend::Input;
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::CudaBackend;
use crate::comm::local::LocalComm;
use crate::comm::loopback::LoopbackComm;
use crate::comm::nccl::{NcclComm, UNIQUE_ID_BYTES};
use crate::config::{EngineConfig, GradReduction};
use crate::dtype::DType;
use crate::engine::Engine;
use crate::error::Error;
use crate::optim::OptimizerConfig;
use crate::plan::{ParamId, Plan, Unit};
use crate::spec::{ModelSpec, ParamSpec};
use registry::{Object, Registry, lock};

/// The outcome of a call.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum fsdp_status {
    FSDP_OK = 0,
    /// A required pointer argument was NULL.
    FSDP_NULL_POINTER = 1,
    /// A handle that is not live, or of the wrong kind.
    FSDP_INVALID_HANDLE = 2,
    /// A bad value: size, dtype, name, shape, configuration, model file contents.
    FSDP_INVALID_ARGUMENT = 3,
    /// A call out of order: hooks, gradients, steps.
    FSDP_MISUSE = 4,
    /// CUDA, its kernels or NCCL are not available.
    FSDP_UNAVAILABLE = 5,
    FSDP_DEVICE_ERROR = 6,
    FSDP_COMM_ERROR = 7,
    FSDP_IO_ERROR = 8,
    /// The library panicked; the object involved should be destroyed.
    FSDP_PANIC = 9,
}

/// Element types, for the `dtype` arguments and fields.
pub const FSDP_BF16: u32 = 0;
pub const FSDP_F16: u32 = 1;
pub const FSDP_F32: u32 = 2;

/// `fsdp_config.optimizer` values.
pub const FSDP_ADAMW: u32 = 0;
pub const FSDP_SGD: u32 = 1;

/// `fsdp_config.grad_reduction` values.
pub const FSDP_MEAN: u32 = 0;
pub const FSDP_SUM: u32 = 1;

/// The unit index that names the root unit (parameters outside every layer).
pub const FSDP_ROOT: i64 = -1;

/// A plan: the grouped, padded layout of a model at one world size.
pub struct fsdp_plan {
    _opaque: [u8; 0],
}

/// The communicators of CPU ranks that run as threads of one process.
pub struct fsdp_local_group {
    _opaque: [u8; 0],
}

/// The communicators of ranks that share one GPU, each driven by its own thread of one process
/// (for tests of several ranks without several GPUs).
pub struct fsdp_loopback_group {
    _opaque: [u8; 0],
}

/// One rank's engine.
pub struct fsdp_engine {
    _opaque: [u8; 0],
}

/// One parameter's declaration.
#[repr(C)]
pub struct fsdp_param_spec {
    /// NUL-terminated UTF-8 name.
    pub name: *const c_char,
    /// `ndim` dimensions; may be NULL when `ndim` is 0 (a scalar).
    pub shape: *const u64,
    pub ndim: usize,
    /// `FSDP_BF16`, `FSDP_F16` or `FSDP_F32`.
    pub dtype: u32,
    /// The FSDP unit, or `FSDP_ROOT`.
    pub unit: i64,
    pub trainable: bool,
    pub tied: bool,
}

/// An engine's settings; start from `fsdp_config_default`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fsdp_config {
    pub double_buffer_limit: usize,
    pub max_reduces_in_flight: usize,
    pub overlap: bool,
    /// `FSDP_MEAN` or `FSDP_SUM`.
    pub grad_reduction: u32,
    /// `FSDP_ADAMW` or `FSDP_SGD` (which uses `lr` only).
    pub optimizer: u32,
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

/// Bytes one rank allocates, as the plan predicts them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct fsdp_memory {
    pub param_shards: usize,
    pub grad_shards: usize,
    pub optimizer_state: usize,
    pub gathered_slots: usize,
    pub grad_slots: usize,
    pub peak: usize,
}

/// What an engine did so far.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct fsdp_counters {
    pub all_gathers: u64,
    pub prefetches: u64,
    pub reuses: u64,
    pub evictions: u64,
    pub reduce_scatters: u64,
    pub extra_slots: u64,
    pub host_waits: u64,
    pub steps: u64,
}

/// One parameter's place in the plan.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct fsdp_param_info {
    pub numel: usize,
    pub dtype: u32,
    pub unit: i64,
    pub trainable: bool,
    pub group: usize,
    pub offset: usize,
    pub padded_numel: usize,
}

/// A failed call: its status and message.
#[derive(Debug)]
pub(crate) struct Failure {
    status: fsdp_status,
    message: String,
}

impl Failure {
    pub(crate) fn new(status: fsdp_status, message: String) -> Failure {
        Failure { status, message }
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        use fsdp_status::*;
        let status = match &e {
            Error::ModelFile { .. } | Error::Write { .. } => FSDP_IO_ERROR,
            Error::UnknownUnit { .. }
            | Error::ForwardAlreadyOpen { .. }
            | Error::ForwardNotOpen { .. }
            | Error::BackwardAlreadyOpen { .. }
            | Error::BackwardNotOpen { .. }
            | Error::ForwardStillOpen { .. }
            | Error::BackwardStillOpen { .. }
            | Error::FrozenGradient { .. }
            | Error::DuplicateGradient { .. }
            | Error::GradSlotOpen { .. }
            | Error::GradSlotNotOpen { .. }
            | Error::GradsNotSynced { .. }
            | Error::NotGathered { .. }
            | Error::Gathered { .. }
            | Error::OptimizerAlreadyStepped
            | Error::OptimizerStepped { .. }
            | Error::ForbiddenTransition { .. } => FSDP_MISUSE,
            Error::CudaUnavailable { .. }
            | Error::KernelsUnavailable
            | Error::NcclUnavailable { .. }
            | Error::Unsupported { .. } => FSDP_UNAVAILABLE,
            Error::Cuda { .. } => FSDP_DEVICE_ERROR,
            Error::Nccl { .. }
            | Error::CollectiveMismatch { .. }
            | Error::RankLeft { .. }
            | Error::RankPanicked { .. } => FSDP_COMM_ERROR,
            _ => FSDP_INVALID_ARGUMENT,
        };
        Failure::new(status, e.to_string())
    }
}

type Outcome<T = ()> = Result<T, Failure>;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn remember(message: String) {
    // A message with a NUL in it keeps what comes before the NUL.
    let message = CString::new(message).unwrap_or_else(|e| {
        let end = e.nul_position();
        CString::new(&e.into_vec()[..end]).unwrap_or_default()
    });
    LAST_ERROR.with(|m| *m.borrow_mut() = message);
}

/// Runs the body of an exported function: its failure or panic becomes a status and a message.
pub(crate) fn boundary(body: impl FnOnce() -> Outcome) -> fsdp_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => fsdp_status::FSDP_OK,
        Ok(Err(failure)) => {
            remember(failure.message);
            failure.status
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            remember(format!("panic inside fsdp-fusion: {what}"));
            fsdp_status::FSDP_PANIC
        }
    }
}

fn null(what: &'static str) -> Failure {
    Failure::new(fsdp_status::FSDP_NULL_POINTER, format!("{what} is NULL"))
}

fn invalid(message: String) -> Failure {
    Failure::new(fsdp_status::FSDP_INVALID_ARGUMENT, message)
}

/// Writes `value` through an out-pointer checked for NULL.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, what: &'static str, value: T) -> Outcome {
    if out.is_null() {
        return Err(null(what));
    }
    // SAFETY: checked non-null; the caller guarantees it is valid for a write.
    unsafe { out.write(value) };
    Ok(())
}

/// # Safety
/// `s` is NULL or a NUL-terminated string.
unsafe fn text<'a>(s: *const c_char, what: &'static str) -> Outcome<&'a str> {
    if s.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map_err(|_| invalid(format!("{what} is not UTF-8")))
}

fn dtype_of(code: u32) -> Outcome<DType> {
    match code {
        FSDP_BF16 => Ok(DType::Bf16),
        FSDP_F16 => Ok(DType::F16),
        FSDP_F32 => Ok(DType::F32),
        other => Err(invalid(format!(
            "dtype {other} is not FSDP_BF16, FSDP_F16 or FSDP_F32"
        ))),
    }
}

fn dtype_code(dtype: DType) -> u32 {
    match dtype {
        DType::Bf16 => FSDP_BF16,
        DType::F16 => FSDP_F16,
        DType::F32 => FSDP_F32,
    }
}

fn unit_of(unit: i64) -> Outcome<Unit> {
    match unit {
        FSDP_ROOT => Ok(Unit::Root),
        u => u32::try_from(u)
            .map(Unit::Layer)
            .map_err(|_| invalid(format!("unit {u} is neither FSDP_ROOT nor a u32 index"))),
    }
}

fn config_of(c: &fsdp_config) -> Outcome<EngineConfig> {
    let optimizer = match c.optimizer {
        FSDP_ADAMW => OptimizerConfig::AdamW {
            lr: c.lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
        },
        FSDP_SGD => OptimizerConfig::Sgd { lr: c.lr },
        other => {
            return Err(invalid(format!(
                "optimizer {other} is not FSDP_ADAMW or FSDP_SGD"
            )));
        }
    };
    let grad_reduction = match c.grad_reduction {
        FSDP_MEAN => GradReduction::Mean,
        FSDP_SUM => GradReduction::Sum,
        other => {
            return Err(invalid(format!(
                "grad_reduction {other} is not FSDP_MEAN or FSDP_SUM"
            )));
        }
    };
    let config = EngineConfig {
        double_buffer_limit: c.double_buffer_limit,
        max_reduces_in_flight: c.max_reduces_in_flight,
        overlap: c.overlap,
        grad_reduction,
        optimizer,
    };
    config.validate()?;
    Ok(config)
}

/// The engines the C API can create.
pub(crate) enum AnyEngine {
    Cpu(Engine<CpuBackend, LocalComm>),
    CudaNccl(Engine<CudaBackend, NcclComm>),
    CudaLoopback(Engine<CudaBackend, LoopbackComm>),
}

/// Runs `$body` with `$e` bound to the engine inside any variant.
macro_rules! with_engine {
    ($any:expr, $e:ident => $body:expr) => {
        match $any {
            AnyEngine::Cpu($e) => $body,
            AnyEngine::CudaNccl($e) => $body,
            AnyEngine::CudaLoopback($e) => $body,
        }
    };
}

/// The communicators of a group handle; each rank's engine takes its own once.
pub(crate) enum Comms {
    Local {
        comms: Mutex<Vec<Option<LocalComm>>>,
        /// The seed of the group's asynchronous backends; none for eager ones.
        seed: Option<u64>,
    },
    Loopback(Mutex<Vec<Option<LoopbackComm>>>),
}

/// What a live handle names.
type Entry = Object<Arc<Plan>, Comms, AnyEngine>;
type Handles = Registry<Arc<Plan>, Comms, AnyEngine>;

static HANDLES: LazyLock<Mutex<Handles>> = LazyLock::new(|| Mutex::new(Registry::new()));

fn handles() -> Outcome<std::sync::MutexGuard<'static, Handles>> {
    lock(&HANDLES)
}

fn object(handle: u64, what: &'static str) -> Outcome<Arc<Entry>> {
    if handle == 0 {
        return Err(null(what));
    }
    handles()?.get(handle)
}

fn wrong_kind(what: &'static str) -> Failure {
    Failure::new(
        fsdp_status::FSDP_INVALID_HANDLE,
        format!("{what} is a live handle of another kind"),
    )
}

fn plan_of(plan: *const fsdp_plan) -> Outcome<Arc<Plan>> {
    match &*object(plan as u64, "plan")? {
        Object::Plan(p) => Ok(Arc::clone(p)),
        _ => Err(wrong_kind("plan")),
    }
}

/// Runs `f` on the engine behind `engine`, holding its lock.
fn on_engine<T>(
    engine: *mut fsdp_engine,
    f: impl FnOnce(&mut AnyEngine) -> Outcome<T>,
) -> Outcome<T> {
    let object = object(engine as u64, "engine")?;
    match &*object {
        Object::Engine(m) => f(&mut *lock(m)?),
        _ => Err(wrong_kind("engine")),
    }
}

fn destroy(handle: u64, kind_ok: impl Fn(&Entry) -> bool, what: &'static str) -> Outcome {
    if handle == 0 {
        return Ok(());
    }
    let removed = {
        let mut handles = handles()?;
        if !kind_ok(&*handles.get(handle)?) {
            return Err(wrong_kind(what));
        }
        handles.remove(handle)?
    };
    // Dropped after the registry is unlocked: an engine's drop waits for its queued work, whose
    // collectives need the other ranks, whose calls need the registry.
    drop(removed);
    Ok(())
}

/// The calling thread's message for its last failed call; never NULL. The string stays valid
/// until the thread's next failed call.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_last_error() -> *const c_char {
    LAST_ERROR.with(|m| m.borrow().as_ptr())
}

/// Fills `out` with the defaults: limit 2, 2 reductions in flight, overlap on, mean, AdamW with
/// PyTorch's defaults (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01).
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_config_default(out: *mut fsdp_config) -> fsdp_status {
    boundary(|| {
        let d = EngineConfig::default();
        let (lr, beta1, beta2, eps, weight_decay) = match d.optimizer {
            OptimizerConfig::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => (lr, beta1, beta2, eps, weight_decay),
            OptimizerConfig::Sgd { lr } => (lr, 0.0, 0.0, 0.0, 0.0),
        };
        let config = fsdp_config {
            double_buffer_limit: d.double_buffer_limit,
            max_reduces_in_flight: d.max_reduces_in_flight,
            overlap: d.overlap,
            grad_reduction: FSDP_MEAN,
            optimizer: FSDP_ADAMW,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        };
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", config) }
    })
}

/// Stores a plan and writes its handle to `out`, which the caller checked for NULL first.
fn new_plan(model: &ModelSpec, world_size: usize, out: *mut *mut fsdp_plan) -> Outcome {
    let plan = Plan::new(model, world_size)?;
    let handle = handles()?.insert(Object::Plan(Arc::new(plan)));
    // SAFETY: the caller guarantees it is valid for a write.
    unsafe { put(out, "out", handle as *mut fsdp_plan) }
}

/// Creates a plan from a model file's JSON text (NUL-terminated). A malformed text fails with
/// `FSDP_INVALID_ARGUMENT` and a message giving its line and column. The plan is the caller's:
/// release it with `fsdp_plan_destroy` (engines keep what they need).
///
/// # Safety
/// `json` is NULL or NUL-terminated; `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_plan_from_json(
    json: *const c_char,
    world_size: usize,
    out: *mut *mut fsdp_plan,
) -> fsdp_status {
    boundary(|| {
        // SAFETY: the caller's contract.
        let json = unsafe { text(json, "json") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        new_plan(&ModelSpec::from_json(json)?, world_size, out)
    })
}

/// Creates a plan from a model file at `path`; as `fsdp_plan_from_json`. Reads the file.
///
/// # Safety
/// `path` is NULL or NUL-terminated; `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_plan_from_file(
    path: *const c_char,
    world_size: usize,
    out: *mut *mut fsdp_plan,
) -> fsdp_status {
    boundary(|| {
        // SAFETY: the caller's contract.
        let path = unsafe { text(path, "path") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        new_plan(&ModelSpec::from_path(Path::new(path))?, world_size, out)
    })
}

/// Creates a plan from `count` declarations in model order; as `fsdp_plan_from_json`.
///
/// # Safety
/// `specs` is NULL or valid for `count` entries, each with a NUL-terminated name and `ndim`
/// dimensions; `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_plan_from_specs(
    specs: *const fsdp_param_spec,
    count: usize,
    world_size: usize,
    out: *mut *mut fsdp_plan,
) -> fsdp_status {
    boundary(|| {
        if specs.is_null() {
            return Err(null("specs"));
        }
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: non-null and valid for `count` entries by the caller's contract.
        let specs = unsafe { std::slice::from_raw_parts(specs, count) };
        let params = specs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                // SAFETY: the caller's contract for each entry.
                let name = unsafe { text(s.name, "specs[i].name") }?;
                let shape = if s.ndim == 0 {
                    Vec::new()
                } else if s.shape.is_null() {
                    return Err(invalid(format!(
                        "specs[{i}].shape is NULL with ndim {}",
                        s.ndim
                    )));
                } else {
                    // SAFETY: non-null and valid for `ndim` entries by the caller's contract.
                    unsafe { std::slice::from_raw_parts(s.shape, s.ndim) }.to_vec()
                };
                let unit = match unit_of(s.unit)? {
                    Unit::Root => None,
                    Unit::Layer(u) => Some(u),
                };
                Ok(ParamSpec {
                    name: name.to_string(),
                    shape,
                    dtype: dtype_of(s.dtype)?,
                    unit,
                    trainable: s.trainable,
                    tied: s.tied,
                })
            })
            .collect::<Outcome<Vec<_>>>()?;
        new_plan(&ModelSpec::new(params)?, world_size, out)
    })
}

/// Releases a plan; NULL is accepted.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_plan_destroy(plan: *mut fsdp_plan) -> fsdp_status {
    boundary(|| destroy(plan as u64, |o| matches!(o, Object::Plan(_)), "plan"))
}

/// The number of parameters, in model order (ids `0..count`).
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_plan_param_count(
    plan: *const fsdp_plan,
    out: *mut usize,
) -> fsdp_status {
    boundary(|| {
        let plan = plan_of(plan)?;
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", plan.params().len()) }
    })
}

/// The id of the parameter named `name`.
///
/// # Safety
/// `name` is NULL or NUL-terminated; `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_plan_param_id(
    plan: *const fsdp_plan,
    name: *const c_char,
    out: *mut usize,
) -> fsdp_status {
    boundary(|| {
        let plan = plan_of(plan)?;
        // SAFETY: the caller's contract.
        let name = unsafe { text(name, "name") }?;
        let id = plan.param_id(name)?;
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", id.0) }
    })
}

/// Where parameter `param` lives in the plan.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_plan_param_info(
    plan: *const fsdp_plan,
    param: usize,
    out: *mut fsdp_param_info,
) -> fsdp_status {
    boundary(|| {
        let plan = plan_of(plan)?;
        let p = plan.param(ParamId(param))?;
        let info = fsdp_param_info {
            numel: p.numel,
            dtype: dtype_code(p.dtype),
            unit: p.unit.layer().map_or(FSDP_ROOT, i64::from),
            trainable: p.trainable,
            group: p.group,
            offset: p.offset,
            padded_numel: p.padded_numel,
        };
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", info) }
    })
}

/// The bytes one rank allocates for `plan` under `config`.
///
/// # Safety
/// `config` is NULL or valid for a read; `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_plan_memory(
    plan: *const fsdp_plan,
    config: *const fsdp_config,
    out: *mut fsdp_memory,
) -> fsdp_status {
    boundary(|| {
        let plan = plan_of(plan)?;
        // SAFETY: the caller's contract.
        let config = config_of(unsafe { config.as_ref() }.ok_or_else(|| null("config"))?)?;
        let m = plan.memory_per_rank(&config);
        let memory = fsdp_memory {
            param_shards: m.param_shards,
            grad_shards: m.grad_shards,
            optimizer_state: m.optimizer_state,
            gathered_slots: m.gathered_slots,
            grad_slots: m.grad_slots,
            peak: m.peak,
        };
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", memory) }
    })
}

/// The communicators of a group, each to be taken once.
fn takeable<C>(comms: Vec<C>) -> Mutex<Vec<Option<C>>> {
    Mutex::new(comms.into_iter().map(Some).collect())
}

/// Stores a group under a new handle and writes it to `out`, checked for NULL first.
fn new_group<H>(comms: Comms, out: *mut *mut H) -> Outcome {
    let handle = handles()?.insert(Object::Group(comms));
    // SAFETY: the caller checked `out` and guarantees it is valid for a write.
    unsafe { put(out, "out", handle as *mut H) }
}

/// Takes rank `rank`'s communicator out of a group, once.
fn take_comm<C>(comms: &Mutex<Vec<Option<C>>>, rank: usize) -> Outcome<C> {
    let mut comms = lock(comms)?;
    let world_size = comms.len();
    let slot = comms
        .get_mut(rank)
        .ok_or(Error::RankOutOfRange { rank, world_size })?;
    slot.take()
        .ok_or_else(|| invalid(format!("rank {rank}'s communicator was already taken")))
}

/// Stores an engine under a new handle and writes it to `out`, checked for NULL first.
fn store_engine(engine: AnyEngine, out: *mut *mut fsdp_engine) -> Outcome {
    let handle = handles()?.insert(Object::Engine(Mutex::new(engine)));
    // SAFETY: the caller checked `out` and guarantees it is valid for a write.
    unsafe { put(out, "out", handle as *mut fsdp_engine) }
}

/// A CUDA device ordinal from C's `int`.
fn device_ordinal(device: c_int) -> Outcome<usize> {
    usize::try_from(device).map_err(|_| invalid(format!("device {device} is not a device ordinal")))
}

/// Creates the communicators of `world_size` CPU ranks running as threads of this process. Each
/// rank's engine takes its communicator with `fsdp_engine_create_cpu`; every rank must then issue
/// the same hooks in the same order. Release with `fsdp_local_group_destroy` (engines keep theirs).
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_local_group_create(
    world_size: usize,
    out: *mut *mut fsdp_local_group,
) -> fsdp_status {
    boundary(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        let comms = takeable(LocalComm::group(world_size)?);
        new_group(Comms::Local { comms, seed: None }, out)
    })
}

/// As `fsdp_local_group_create`, for engines whose CPU backend runs its three streams apart: each
/// stream is a worker thread that runs its queue in order, every operation after a delay drawn
/// from `seed` (rank `r` draws from `seed + r`), and collectives run on the streams. Work is
/// ordered across streams only by the engine's events, so a missing one shows as a wrong value;
/// for tests. Host reads and writes (views, gradient slots, loads, shard copies) first wait for
/// the streams they depend on.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_local_group_create_async(
    world_size: usize,
    seed: u64,
    out: *mut *mut fsdp_local_group,
) -> fsdp_status {
    boundary(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        let comms = takeable(LocalComm::group(world_size)?);
        new_group(
            Comms::Local {
                comms,
                seed: Some(seed),
            },
            out,
        )
    })
}

/// Releases a local group; NULL is accepted.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_local_group_destroy(group: *mut fsdp_local_group) -> fsdp_status {
    boundary(|| {
        let is_local = |o: &Entry| matches!(o, Object::Group(Comms::Local { .. }));
        destroy(group as u64, is_local, "group")
    })
}

/// Creates rank `rank`'s engine on the CPU backend, taking the rank's communicator from `group`
/// (once per rank). Allocates every buffer the plan predicts; parameters start at zero until
/// `fsdp_engine_load_param`. Release with `fsdp_engine_destroy`.
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
        let comm = take_comm(comms, rank)?;
        let engine = Engine::new(plan, config, backend, comm)?;
        store_engine(AnyEngine::Cpu(engine), out)
    })
}

/// Writes a fresh NCCL unique id (`len` bytes, which must be 128) to `out`. One rank makes it and
/// passes the same bytes to every rank's `fsdp_engine_create_cuda_nccl`, through the caller's own
/// channel (its launcher, `torch.distributed`, a file). Does not need a GPU, but loads NCCL
/// (`libnccl.so.2`, or the library named by `FSDP_NCCL_LIBRARY`): `FSDP_UNAVAILABLE` without it.
/// May be called from any thread.
///
/// # Safety
/// `out` is NULL or valid for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_nccl_unique_id(out: *mut u8, len: usize) -> fsdp_status {
    boundary(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        if len != UNIQUE_ID_BYTES {
            return Err(invalid(format!(
                "a unique id has {UNIQUE_ID_BYTES} bytes, not {len}"
            )));
        }
        let id = NcclComm::unique_id()?;
        // SAFETY: non-null and valid for `len` == `id.len()` bytes by the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(id.as_ptr(), out, id.len()) };
        Ok(())
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
/// own gather and reduce streams.
///
/// Blocks until every rank joined the NCCL group. Allocates every buffer the plan predicts on the
/// device; parameters start at zero until `fsdp_engine_load_param`. Release with
/// `fsdp_engine_destroy`. `FSDP_UNAVAILABLE` when the CUDA driver, the kernels or NCCL are missing,
/// `FSDP_DEVICE_ERROR` for a device that does not exist or a stream of another context.
///
/// # Safety
/// `config` is NULL or valid for a read; `unique_id` is NULL or valid for `id_len` bytes; `out` is
/// NULL or valid for a write.
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
    out: *mut *mut fsdp_engine,
) -> fsdp_status {
    boundary(|| {
        let plan = plan_of(plan)?;
        // SAFETY: the caller's contract.
        let config = config_of(unsafe { config.as_ref() }.ok_or_else(|| null("config"))?)?;
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: the caller's contract.
        let id = unsafe { unique_id_of(unique_id, id_len) }?;
        let device = device_ordinal(device)?;
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
        // SAFETY: the function's contract: `stream` is 0 or a live stream that outlives the engine.
        let backend = unsafe { CudaBackend::with_raw_stream(device, stream) }?;
        let comm = NcclComm::new(&id, rank, world_size, &backend)?;
        let engine = Engine::new(plan, config, backend, comm)?;
        store_engine(AnyEngine::CudaNccl(engine), out)
    })
}

/// A unique id from C.
///
/// # Safety
/// `id` is NULL or valid for `len` bytes.
unsafe fn unique_id_of(id: *const u8, len: usize) -> Outcome<[u8; UNIQUE_ID_BYTES]> {
    if id.is_null() {
        return Err(null("unique_id"));
    }
    if len != UNIQUE_ID_BYTES {
        return Err(invalid(format!(
            "a unique id has {UNIQUE_ID_BYTES} bytes, not {len}"
        )));
    }
    let mut bytes = [0u8; UNIQUE_ID_BYTES];
    // SAFETY: non-null and valid for `len` == `bytes.len()` bytes by the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(id, bytes.as_mut_ptr(), len) };
    Ok(bytes)
}

/// Creates the communicators of `world_size` ranks that share one GPU, one thread of this process
/// each: NCCL refuses two ranks on one device, this group does not. Each rank's engine takes its
/// communicator with `fsdp_engine_create_cuda_loopback`; every rank must then issue the same hooks
/// in the same order, from its own thread. Needs no GPU itself. Release with
/// `fsdp_loopback_group_destroy` (engines keep theirs).
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_loopback_group_create(
    world_size: usize,
    out: *mut *mut fsdp_loopback_group,
) -> fsdp_status {
    boundary(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        new_group(
            Comms::Loopback(takeable(LoopbackComm::group(world_size)?)),
            out,
        )
    })
}

/// Releases a loopback group; NULL is accepted.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_loopback_group_destroy(group: *mut fsdp_loopback_group) -> fsdp_status {
    boundary(|| {
        let is_loopback = |o: &Entry| matches!(o, Object::Group(Comms::Loopback(_)));
        destroy(group as u64, is_loopback, "group")
    })
}

/// Creates rank `rank`'s engine on CUDA device `device`, taking the rank's communicator from
/// `group` (once per rank, and only once the device is found usable: a failed call leaves it in
/// the group). `stream` is the rank's compute stream, as for `fsdp_engine_create_cuda_nccl`; give
/// each rank its own. Does not block on the other ranks. Release with `fsdp_engine_destroy`.
///
/// # Safety
/// `config` is NULL or valid for a read; `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_create_cuda_loopback(
    plan: *const fsdp_plan,
    config: *const fsdp_config,
    device: c_int,
    group: *mut fsdp_loopback_group,
    rank: usize,
    stream: u64,
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
        // SAFETY: the function's contract: `stream` is 0 or a live stream that outlives the engine.
        let backend = unsafe { CudaBackend::with_raw_stream(device, stream) }?;
        let comm = take_comm(comms, rank)?;
        let engine = Engine::new(plan, config, backend, comm)?;
        store_engine(AnyEngine::CudaLoopback(engine), out)
    })
}

/// Releases an engine and everything it allocated; NULL is accepted. On a GPU it blocks until the
/// device finished the work still using the engine's memory. CPU and loopback ranks still in a
/// collective with it fail with `FSDP_COMM_ERROR` instead of waiting forever; NCCL ranks must all
/// destroy their engines at the same point of the training.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_destroy(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| destroy(engine as u64, |o| matches!(o, Object::Engine(_)), "engine"))
}

/// Before `unit`'s forward (`FSDP_ROOT` for the root): gathers its groups, prefetches the next
/// unit. Takes part in collectives: every rank must call it. On a GPU it does not block the host.
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
        on_engine(engine, |any| {
            // SAFETY: the caller's contract.
            let input = unsafe { caller_input(any, data, numel, dtype) }?;
            Ok(with_engine!(any, e => e.grad(ParamId(param), input))?)
        })
    })
}

/// A caller's tensor as `any` reads it: host memory for a CPU engine, a device address on the
/// compute stream for a CUDA engine.
///
/// # Safety
/// CPU engine: `data` is NULL or valid for `numel` elements of `dtype`. CUDA engine: as
/// `Input::Device` requires.
unsafe fn caller_input<'a>(
    any: &AnyEngine,
    data: *const c_void,
    numel: usize,
    dtype: DType,
) -> Outcome<Input<'a>> {
    match any {
        AnyEngine::Cpu(_) => {
            // SAFETY: the caller's contract.
            let bytes = unsafe { host_bytes(data, numel, dtype, "data") }?;
            Ok(Input::host_bytes(bytes, dtype))
        }
        AnyEngine::CudaNccl(_) | AnyEngine::CudaLoopback(_) => {
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
/// stream; does not block.
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

/// What the engine did so far.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_counters(
    engine: *mut fsdp_engine,
    out: *mut fsdp_counters,
) -> fsdp_status {
    boundary(|| {
        let c = on_engine(engine, |any| Ok(with_engine!(any, e => e.counters())))?;
        let counters = fsdp_counters {
            all_gathers: c.all_gathers,
            prefetches: c.prefetches,
            reuses: c.reuses,
            evictions: c.evictions,
            reduce_scatters: c.reduce_scatters,
            extra_slots: c.extra_slots,
            host_waits: c.host_waits,
            steps: c.steps,
        };
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", counters) }
    })
}

/// Bytes the engine's backend holds now and at its peak.
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
        let m = on_engine(engine, |any| Ok(with_engine!(any, e => e.memory())))?;
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
    boundary(|| {
        if out.is_null() || written.is_null() {
            return Err(null("out or written"));
        }
        let shard = on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.param_shard(group))?)
        })?;
        if shard.len() > capacity {
            return Err(invalid(format!(
                "the shard has {} bytes, out holds {capacity}",
                shard.len()
            )));
        }
        // SAFETY: non-null, valid for `capacity` >= `shard.len()` bytes by the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(shard.as_ptr(), out.cast::<u8>(), shard.len()) };
        // SAFETY: the caller's contract.
        unsafe { put(written, "written", shard.len()) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_becomes_a_status_and_a_message() {
        let status = boundary(|| panic!("deliberate"));
        assert_eq!(status, fsdp_status::FSDP_PANIC);
        // SAFETY: fsdp_last_error never returns NULL and its string is NUL-terminated.
        let message = unsafe { CStr::from_ptr(fsdp_last_error()) }
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(message, "panic inside fsdp-fusion: deliberate");
    }

    #[test]
    fn a_poisoned_engine_reports_instead_of_crashing() {
        let m = Mutex::new(0u8);
        let _ = catch_unwind(AssertUnwindSafe(|| {
            let _guard = m.lock().unwrap();
            panic!("while locked");
        }));
        let failure = lock(&m).unwrap_err();
        assert_eq!(failure.status, fsdp_status::FSDP_PANIC);
    }

    #[test]
    fn messages_with_a_nul_keep_their_start() {
        remember("before\0after".to_string());
        // SAFETY: as above.
        let message = unsafe { CStr::from_ptr(fsdp_last_error()) }
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(message, "before");
    }
}
