//! The C types: constants, opaque handles, declarations, settings and reports, and their
//! conversions to and from the crate's own.

use std::ffi::{c_char, c_void};
use std::time::Duration;

use super::status::{Outcome, fsdp_status, invalid, put};
use crate::config::{Accumulation, EngineConfig, GradReduction, GradShardMemory, ParamStorage};
use crate::engine::Counters;
use crate::optim::OptimizerConfig;
use crate::plan::MemoryPerRank;
use crate::types::{DType, Unit};

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
/// A sum of each rank's gradient times `fsdp_config.grad_scale`.
pub const FSDP_SCALED: u32 = 2;

/// `fsdp_config.accumulation` values: how a step's backward passes come together.
/// Every pass reduce-scatters its gradients.
pub const FSDP_REDUCE_EVERY_PASS: u32 = 0;
/// The passes accumulate unsharded fp32 gradients; `fsdp_engine_finish_grad_sync` reduces them
/// once.
pub const FSDP_NO_SYNC: u32 = 1;
/// Every group stays gathered from its first use until the step ends.
pub const FSDP_KEEP_GATHERED: u32 = 2;

/// `fsdp_config.param_storage` values: where a trainable bf16/f16 parameter persists.
/// A shard in its dtype beside the fp32 master; at world size 1 the views are the shards.
pub const FSDP_SHARD_AND_MASTER: u32 = 0;
/// The fp32 master only, cast at every gather: less memory, and views that move at every world
/// size.
pub const FSDP_MASTER_ONLY: u32 = 1;

/// `fsdp_config.grad_shard_memory` values: when the fp32 gradient shards exist.
/// Allocated with the engine, kept for its life.
pub const FSDP_GRAD_SHARDS_PERSISTENT: u32 = 0;
/// Allocated at a step's first gradient of each group, freed at `fsdp_engine_end_step`: needs the
/// CPU backend or a CUDA engine made with an allocator (`fsdp_device_allocator`).
pub const FSDP_GRAD_SHARDS_PER_STEP: u32 = 1;

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

/// One rank's engine. Any thread may call it, one call at a time (calls on one engine are
/// serialized): a step may be driven by a pool of threads in turn. Its rank is gone for its peers
/// when the engine is destroyed or aborted, a call of it panics, or its process ends; a thread
/// that ends between calls leaves the engine as it was, for the next thread to go on with.
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
    /// 1: takes gradients and is optimized; 0: frozen. Other values are refused.
    pub trainable: u8,
    /// 1: used under several names (a tied embedding and head), grouped apart from untied
    /// parameters; 0: not. Other values are refused. Tying keeps nothing gathered: a parameter
    /// that several units use belongs to the root (`FSDP_ROOT`), gathered through the whole
    /// forward and backward.
    pub tied: u8,
    /// 1: exempt from weight decay (biases, norms and embeddings in LLM recipes); 0: decayed.
    /// Other values are refused.
    pub no_weight_decay: u8,
    /// The parameter's learning rate is the engine's times this (finite, >= 0); 0 is taken as 1,
    /// so that a zero-filled spec trains at the engine's rate (a parameter that must not move is
    /// frozen instead).
    pub lr_scale: f32,
}

/// An engine's settings; start from `fsdp_config_default`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fsdp_config {
    pub double_buffer_limit: usize,
    pub max_reduces_in_flight: usize,
    /// 1: prefetch and keep reductions in flight; 0: every collective completes within its hook.
    pub overlap: u8,
    /// `FSDP_MEAN`, `FSDP_SUM` or `FSDP_SCALED`.
    pub grad_reduction: u32,
    /// `FSDP_ADAMW` or `FSDP_SGD` (which uses `lr` and `weight_decay`, as `torch.optim.SGD`
    /// without momentum: the decay is added to the gradient).
    pub optimizer: u32,
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
    /// Seconds any blocking wait of the engine lasts before it fails with `FSDP_TIMEOUT`; positive.
    /// A collective still in flight on the device this long after it was queued fails the engine
    /// too (`FSDP_TIMEOUT` at the next call, naming it), its communicators aborted so that the
    /// streams drain and the caller's own device waits return.
    pub timeout_seconds: f64,
    /// 1: compare the ranks' collectives of every step in `fsdp_engine_finish_grad_sync` (for
    /// NCCL, which does not compare them itself; costs a small all-gather and a host wait).
    pub verify_collectives: u8,
    /// `FSDP_SCALED`'s factor (finite, > 0); ignored otherwise.
    pub grad_scale: f32,
    /// The element type gradients travel in between ranks: `FSDP_F32` or `FSDP_BF16` (half the
    /// bytes and slot memory; sums rounded to bf16 before the fp32 shards accumulate them).
    pub reduce_dtype: u32,
    /// `FSDP_REDUCE_EVERY_PASS`, `FSDP_NO_SYNC` or `FSDP_KEEP_GATHERED`.
    pub accumulation: u32,
    /// `FSDP_SHARD_AND_MASTER` or `FSDP_MASTER_ONLY`.
    pub param_storage: u32,
    /// `FSDP_GRAD_SHARDS_PERSISTENT` or `FSDP_GRAD_SHARDS_PER_STEP`.
    pub grad_shard_memory: u32,
    /// AdamW's moments: `FSDP_F32`, or `FSDP_BF16` (half the memory; each new moment rounded
    /// stochastically, unbiased, the update itself computed in f32).
    pub moment_dtype: u32,
    /// 1: make the host memory `fsdp_engine_save_async` copies the state into (page-locked on
    /// a GPU, the size of the rank's state) with the engine, so that even the first
    /// asynchronous save's call only copies; 0: the first asynchronous save makes it.
    pub save_staging: u8,
    /// 1: step the optimizer inside the backward pass, each trainable group as soon as its
    /// gradient shard is final, a per-step shard freed right after (the same result as the
    /// ordinary step, bit for bit; `fsdp_engine_optimizer_step` then only ends the updates).
    /// One backward pass a step (`FSDP_REDUCE_EVERY_PASS`; a second forward in a step is
    /// `FSDP_MISUSE`); the gradient norm, clipping, the non-finite count and changing the
    /// learning rate or weight decay once the step's gradients began are `FSDP_MISUSE`. The
    /// plan's peak of per-step shards in this mode takes each unit's backward as ended by
    /// `fsdp_engine_post_backward`: above world size 1, gradients handed over with no backward
    /// hooks may hold more shards at once.
    pub step_in_backward: u8,
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
    /// The unsharded fp32 gradients of `FSDP_NO_SYNC`.
    pub grad_accumulators: usize,
    /// Everything, held once a step's gradients are synced.
    pub peak: usize,
    /// What is held between steps: `peak` less per-step gradient shards.
    pub between_steps: usize,
}

impl From<MemoryPerRank> for fsdp_memory {
    fn from(m: MemoryPerRank) -> fsdp_memory {
        fsdp_memory {
            param_shards: m.param_shards,
            grad_shards: m.grad_shards,
            optimizer_state: m.optimizer_state,
            gathered_slots: m.gathered_slots,
            grad_slots: m.grad_slots,
            grad_accumulators: m.grad_accumulators,
            peak: m.peak,
            between_steps: m.between_steps,
        }
    }
}

/// One gradient of a batch handed to `fsdp_engine_grads`: as the arguments of
/// `fsdp_engine_grad`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct fsdp_grad {
    pub param: usize,
    pub data: *const c_void,
    pub numel: usize,
    /// `fsdp_dtype`: the parameter's dtype or `FSDP_F32`.
    pub dtype: u32,
}

/// The whole model's gradient norms: the 2-norm and the largest magnitude (NaN or infinite when
/// a gradient element is).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct fsdp_grad_norm {
    pub l2: f32,
    pub max: f32,
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
    /// Steps whose gradients were synced that ended without an optimizer step.
    pub skipped_steps: u64,
}

impl From<Counters> for fsdp_counters {
    fn from(c: Counters) -> fsdp_counters {
        fsdp_counters {
            all_gathers: c.all_gathers,
            prefetches: c.prefetches,
            reuses: c.reuses,
            evictions: c.evictions,
            reduce_scatters: c.reduce_scatters,
            extra_slots: c.extra_slots,
            host_waits: c.host_waits,
            steps: c.steps,
            skipped_steps: c.skipped_steps,
        }
    }
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

pub(crate) fn dtype_of(code: u32) -> Outcome<DType> {
    match code {
        FSDP_BF16 => Ok(DType::Bf16),
        FSDP_F16 => Ok(DType::F16),
        FSDP_F32 => Ok(DType::F32),
        other => Err(invalid(format!(
            "dtype {other} is not FSDP_BF16, FSDP_F16 or FSDP_F32"
        ))),
    }
}

/// The dtype of configuration field `field`, which takes `FSDP_F32` or `FSDP_BF16`.
fn field_dtype(code: u32, field: &str) -> Outcome<DType> {
    match code {
        FSDP_F32 => Ok(DType::F32),
        FSDP_BF16 => Ok(DType::Bf16),
        other => Err(invalid(format!(
            "{field} is {other}, not FSDP_F32 or FSDP_BF16"
        ))),
    }
}

pub(crate) fn dtype_code(dtype: DType) -> u32 {
    match dtype {
        DType::Bf16 => FSDP_BF16,
        DType::F16 => FSDP_F16,
        DType::F32 => FSDP_F32,
    }
}

pub(crate) fn unit_of(unit: i64) -> Outcome<Unit> {
    match unit {
        FSDP_ROOT => Ok(Unit::Root),
        u => u32::try_from(u)
            .map(Unit::Layer)
            .map_err(|_| invalid(format!("unit {u} is neither FSDP_ROOT nor a u32 index"))),
    }
}

/// A C flag: 0 or 1, anything else refused.
pub(crate) fn flag(value: u8, what: &str) -> Outcome<bool> {
    match value {
        0 => Ok(false),
        1 => Ok(true),
        other => Err(invalid(format!("{what} is {other}, not 0 or 1"))),
    }
}

pub(crate) fn config_of(c: &fsdp_config) -> Outcome<EngineConfig> {
    let optimizer = match c.optimizer {
        FSDP_ADAMW => OptimizerConfig::AdamW {
            lr: c.lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
        },
        FSDP_SGD => OptimizerConfig::Sgd {
            lr: c.lr,
            weight_decay: c.weight_decay,
        },
        other => {
            return Err(invalid(format!(
                "optimizer {other} is not FSDP_ADAMW or FSDP_SGD"
            )));
        }
    };
    let grad_reduction = match c.grad_reduction {
        FSDP_MEAN => GradReduction::Mean,
        FSDP_SUM => GradReduction::Sum,
        FSDP_SCALED => GradReduction::Scaled(c.grad_scale),
        other => {
            return Err(invalid(format!(
                "grad_reduction {other} is not FSDP_MEAN, FSDP_SUM or FSDP_SCALED"
            )));
        }
    };
    let accumulation = match c.accumulation {
        FSDP_REDUCE_EVERY_PASS => Accumulation::ReduceEveryPass,
        FSDP_NO_SYNC => Accumulation::NoSync,
        FSDP_KEEP_GATHERED => Accumulation::KeepGathered,
        other => {
            return Err(invalid(format!(
                "accumulation {other} is not FSDP_REDUCE_EVERY_PASS, FSDP_NO_SYNC or \
                 FSDP_KEEP_GATHERED"
            )));
        }
    };
    let param_storage = match c.param_storage {
        FSDP_SHARD_AND_MASTER => ParamStorage::ShardAndMaster,
        FSDP_MASTER_ONLY => ParamStorage::MasterOnly,
        other => {
            return Err(invalid(format!(
                "param_storage {other} is not FSDP_SHARD_AND_MASTER or FSDP_MASTER_ONLY"
            )));
        }
    };
    let grad_shard_memory = match c.grad_shard_memory {
        FSDP_GRAD_SHARDS_PERSISTENT => GradShardMemory::Persistent,
        FSDP_GRAD_SHARDS_PER_STEP => GradShardMemory::PerStep,
        other => {
            return Err(invalid(format!(
                "grad_shard_memory {other} is not FSDP_GRAD_SHARDS_PERSISTENT or \
                 FSDP_GRAD_SHARDS_PER_STEP"
            )));
        }
    };
    let timeout = Duration::try_from_secs_f64(c.timeout_seconds)
        .ok()
        .filter(|t| !t.is_zero())
        .ok_or_else(|| {
            invalid(format!(
                "timeout_seconds is {}, not a positive number of seconds",
                c.timeout_seconds
            ))
        })?;
    let config = EngineConfig {
        double_buffer_limit: c.double_buffer_limit,
        max_reduces_in_flight: c.max_reduces_in_flight,
        overlap: flag(c.overlap, "overlap")?,
        grad_reduction,
        reduce_dtype: field_dtype(c.reduce_dtype, "reduce_dtype")?,
        accumulation,
        param_storage,
        grad_shard_memory,
        moment_dtype: field_dtype(c.moment_dtype, "moment_dtype")?,
        optimizer,
        timeout,
        verify_collectives: flag(c.verify_collectives, "verify_collectives")?,
        step_in_backward: flag(c.step_in_backward, "step_in_backward")?,
        save_staging: flag(c.save_staging, "save_staging")?,
    };
    config.validate()?;
    Ok(config)
}

/// Fills `out` with the defaults: limit 2, 2 reductions in flight, overlap on, mean (scale 1),
/// AdamW with PyTorch's defaults (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01), a
/// 600-second timeout, collectives not verified, f32 gradient transport, a reduction every pass,
/// a shard beside each master, persistent gradient shards, f32 moments, no save staging made
/// ahead, the optimizer stepped after the backward.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_config_default(out: *mut fsdp_config) -> fsdp_status {
    super::status::boundary(|| {
        let d = EngineConfig::default();
        let (lr, beta1, beta2, eps, weight_decay) = match d.optimizer {
            OptimizerConfig::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => (lr, beta1, beta2, eps, weight_decay),
            OptimizerConfig::Sgd { lr, weight_decay } => (lr, 0.0, 0.0, 0.0, weight_decay),
        };
        let config = fsdp_config {
            double_buffer_limit: d.double_buffer_limit,
            max_reduces_in_flight: d.max_reduces_in_flight,
            overlap: u8::from(d.overlap),
            grad_reduction: FSDP_MEAN,
            optimizer: FSDP_ADAMW,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            timeout_seconds: d.timeout.as_secs_f64(),
            verify_collectives: u8::from(d.verify_collectives),
            grad_scale: 1.0,
            reduce_dtype: FSDP_F32,
            accumulation: FSDP_REDUCE_EVERY_PASS,
            param_storage: FSDP_SHARD_AND_MASTER,
            grad_shard_memory: FSDP_GRAD_SHARDS_PERSISTENT,
            moment_dtype: FSDP_F32,
            save_staging: u8::from(d.save_staging),
            step_in_backward: u8::from(d.step_in_backward),
        };
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", config) }
    })
}
