//! How one rank's engine runs.

use std::time::Duration;

use crate::error::{Error, Result};
use crate::optim::OptimizerConfig;
use crate::types::DType;
use crate::watch::DEFAULT_TIMEOUT;

/// How gradients from the ranks combine.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum GradReduction {
    /// Sum divided by the world size.
    #[default]
    Mean,
    Sum,
    /// Sum, each rank's gradient first multiplied by this factor (finite, > 0): a loop that
    /// normalizes by a count of its own (the global token count, say) without a second pass.
    Scaled(f32),
}

/// How the gradients of a step's several backward passes come together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Accumulation {
    /// Every pass reduce-scatters its gradients, accumulated into the fp32 shards.
    #[default]
    ReduceEveryPass,
    /// The passes accumulate each rank's gradients unsharded in fp32 (one accumulator per
    /// trainable group, a whole unsharded gradient); `finish_grad_sync` reduce-scatters them
    /// once. Fewer bytes moved for more memory; the reduction does not overlap a backward.
    NoSync,
    /// Every group stays gathered from its first use until the step ends, so later passes
    /// gather nothing: the whole model's parameters in memory for no re-gathers. Gradients
    /// reduce every pass.
    KeepGathered,
}

/// Where a trainable bf16 or f16 parameter's values persist between steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum ParamStorage {
    /// A shard in the parameter's dtype beside its fp32 master: a gather reads the shard, and at
    /// world size 1 the shard is the gathered view (it never moves).
    #[default]
    ShardAndMaster,
    /// The fp32 master only: a gather first casts this rank's part of the master into its place
    /// in the gather slot, then gathers in place; at world size 1 the cast fills the slot that
    /// is the view (views then move between slots, as above world size 1). Saves the shard's
    /// bytes (half the master's for bf16) for a cast per gather.
    MasterOnly,
}

/// When each trainable group's fp32 gradient shard exists.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum GradShardMemory {
    /// Allocated with the engine, kept for its life.
    #[default]
    Persistent,
    /// Allocated when a step first writes it, freed when the step ends: between steps and
    /// through the step's first forward the engine holds no gradient memory, so a framework
    /// allocating from the same pool (the CUDA backend with a caller's allocator) uses it for
    /// the forward's activations. Needs a backend that frees in stream order
    /// ([`crate::backend::Backend::frees_in_stream_order`]).
    PerStep,
}

impl GradReduction {
    /// The factor each rank's gradient is multiplied by before the ranks' are summed.
    pub fn scale(self, world_size: usize) -> f32 {
        match self {
            GradReduction::Mean => 1.0 / world_size as f32,
            GradReduction::Sum => 1.0,
            GradReduction::Scaled(factor) => factor,
        }
    }
}

/// The engine's settings.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Most gathered (syncing, in use or ready) buffers kept at once; a required gather may exceed
    /// it when no ready buffer can be evicted, a prefetch never does. The engine makes a gather
    /// slot for each group of the root and of the unit of most groups where the limit is lower,
    /// so that hooks one unit at a time gather into slots made with it. At least 1; a limit
    /// above the plan's group count acts as that count.
    pub double_buffer_limit: usize,
    /// Most gradient reduce-scatters in flight before the oldest is retired. At least 1; a value
    /// above the plan's trainable group count acts as that count.
    pub max_reduces_in_flight: usize,
    /// Prefetch the next unit's gathers and keep reductions in flight; off, every collective
    /// completes before the hook that issued it returns.
    pub overlap: bool,
    pub grad_reduction: GradReduction,
    /// The element type gradients travel in between ranks: f32, or bf16 (half the bytes sent
    /// and half the gradient slots' memory; each rank's gradient rounded to bf16, the ranks' sum
    /// rounded again, then accumulated into the fp32 shards). Nothing travels at world size 1,
    /// where gradients stay f32.
    pub reduce_dtype: DType,
    pub accumulation: Accumulation,
    pub param_storage: ParamStorage,
    pub grad_shard_memory: GradShardMemory,
    /// How AdamW's moments are stored: f32, or bf16 (half their memory; each new moment, computed
    /// in f32, rounded stochastically so that it stays unbiased,
    /// [`crate::optim::MomentStorage::Bf16Stochastic`]). The update itself is the f32 one.
    pub moment_dtype: DType,
    pub optimizer: OptimizerConfig,
    /// How long any blocking wait (a collective's meeting, a host wait for the device) lasts
    /// before it fails with `Error::Timeout`, poisoning the engine (a wait for the asynchronous
    /// CPU backend's own streams: four times this, as [`crate::CpuBackend::asynchronous`] says);
    /// and how long a collective
    /// may stay in flight on its stream before the engine's watchdog fails the rank with
    /// `Error::CollectiveTimedOut` and aborts its communicators. Positive.
    pub timeout: Duration,
    /// Compare the ranks' collectives of every step in `finish_grad_sync` (one small all-gather
    /// and a host wait), failing every rank, with both versions named, where they differ. The
    /// CPU and loopback communicators compare every collective anyway; this is for NCCL, as
    /// PyTorch's `TORCH_DISTRIBUTED_DEBUG=DETAIL` is. The record (48 bytes a collective) is
    /// kept until `end_step`: an evaluation loop that never ends a step grows it with every
    /// gather.
    pub verify_collectives: bool,
    /// Step the optimizer inside the backward pass: each trainable group's update is queued as
    /// soon as its gradient shard is final (at world size 1 once the group's gradients are all
    /// written, or its unit's backward ended; above, once its reduction completed), and a
    /// per-step gradient shard is freed right after its update, so that the step holds the
    /// gradient shards of the groups in flight only. The result equals the ordinary step bit for
    /// bit. Everything that needs every gradient before the update is refused: several backward
    /// passes a step (so `accumulation` stays `ReduceEveryPass`, and a second forward in a step
    /// is an error), clipping by the global norm, the norm, the non-finite count, and changing
    /// the learning rate or weight decay once the step's gradients began. The plan's peak of
    /// per-step gradient shards in this mode takes each unit's backward as ended by its
    /// `post_backward` (as the PyTorch package's hooks end it): above world size 1, gradients
    /// handed over with no backward hooks fill every unit's gradient slots at once, and the
    /// groups reduced in part then hold more shards than planned.
    pub step_in_backward: bool,
    /// Make the host memory that [`crate::Engine::save_async`] copies the rank's state into
    /// (page-locked on a GPU, the state's size) with the engine, so that even the first
    /// asynchronous save's call only copies: page-locking gigabytes takes seconds. Off, the first
    /// asynchronous save makes it. Either way it is kept for the next saves.
    pub save_staging: bool,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            double_buffer_limit: 2,
            max_reduces_in_flight: 2,
            overlap: true,
            grad_reduction: GradReduction::Mean,
            reduce_dtype: DType::F32,
            accumulation: Accumulation::ReduceEveryPass,
            param_storage: ParamStorage::ShardAndMaster,
            grad_shard_memory: GradShardMemory::Persistent,
            moment_dtype: DType::F32,
            optimizer: OptimizerConfig::default(),
            timeout: DEFAULT_TIMEOUT,
            verify_collectives: false,
            step_in_backward: false,
            save_staging: false,
        }
    }
}

impl EngineConfig {
    /// Checks every field.
    pub fn validate(&self) -> Result<()> {
        if self.double_buffer_limit == 0 {
            return Err(Error::InvalidConfig {
                field: "double_buffer_limit",
                reason: "must be at least 1".into(),
            });
        }
        if self.max_reduces_in_flight == 0 {
            return Err(Error::InvalidConfig {
                field: "max_reduces_in_flight",
                reason: "must be at least 1".into(),
            });
        }
        if let GradReduction::Scaled(factor) = self.grad_reduction {
            if !(factor.is_finite() && factor > 0.0) {
                return Err(Error::InvalidConfig {
                    field: "grad_reduction",
                    reason: format!("a scale of {factor}, expected finite, > 0"),
                });
            }
        }
        if self.reduce_dtype == DType::F16 {
            return Err(Error::InvalidConfig {
                field: "reduce_dtype",
                reason: "f16, expected f32 or bf16 (an f16 sum overflows at 65504)".into(),
            });
        }
        if self.moment_dtype == DType::F16 {
            return Err(Error::InvalidConfig {
                field: "moment_dtype",
                reason: "f16, expected f32 or bf16 (f16's range cuts off small second moments)"
                    .into(),
            });
        }
        if self.step_in_backward && self.accumulation != Accumulation::ReduceEveryPass {
            return Err(Error::InvalidConfig {
                field: "step_in_backward",
                reason: format!(
                    "takes one backward pass a step, while accumulation {:?} is for several: \
                     use ReduceEveryPass",
                    self.accumulation
                ),
            });
        }
        if self.timeout.is_zero() {
            return Err(Error::InvalidConfig {
                field: "timeout",
                reason: "must be positive".into(),
            });
        }
        self.optimizer.validate()
    }
}
