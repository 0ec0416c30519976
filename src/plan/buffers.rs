//! The buffers a rank allocates for a plan under a configuration, as its [`super::Policy`]
//! decides them: the engine allocates exactly these, and the memory report sums them.

use crate::config::{EngineConfig, GradShardMemory};
use crate::error::{Error, Result};
use crate::types::DType;

use super::Plan;

/// One group's buffers, in bytes; `None` where the group has no such buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupBuffers {
    /// The parameter shard in the group's dtype: 0 bytes for a master-only group, whose gathers
    /// cast the master.
    pub shard: usize,
    /// The fp32 gradient shard of a trainable group.
    pub grad_shard: Option<usize>,
    /// The fp32 master of a trainable bf16 or f16 group.
    pub master: Option<usize>,
    /// Each of AdamW's two moments.
    pub moment: Option<usize>,
    /// The unsharded fp32 gradient of `Accumulation::NoSync`.
    pub accumulator: Option<usize>,
}

/// Bytes of a rank's part of the gradient norms: the f64 sum of squares, the u32 bits of the
/// largest magnitude, and 4 bytes of padding.
pub const NORM_PART_BYTES: usize = 16;

/// Bytes of a rank's count of non-finite gradient elements: a u64.
pub const NONFINITE_COUNT_BYTES: usize = 8;

/// Bytes of the count of steps skipped on the device that the host has not read yet: a u64.
pub const SKIPPED_STEPS_BYTES: usize = 8;

/// A step's few bytes on the device, made with the engine when anything trains: where the checks
/// of its gradients add up (the norms' part and the non-finite count), the
/// [`crate::optim::StepValues`] its updates read, and the steps skipped on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepScratch {
    pub norm_part: usize,
    /// Every rank's norm part, gathered for clipping on the device; none at world size 1.
    pub norm_parts: usize,
    pub nonfinite_count: usize,
    pub step_values: usize,
    /// Steps skipped on the device ([`crate::Engine::skip_nonfinite_on_device`]) that the host
    /// has not read yet.
    pub skipped_steps: usize,
}

impl StepScratch {
    /// Their bytes together; `None` past `usize` (a world of size near `usize::MAX / 16`).
    pub fn bytes(&self) -> Option<usize> {
        [
            self.norm_parts,
            self.nonfinite_count,
            self.step_values,
            self.skipped_steps,
        ]
        .into_iter()
        .try_fold(self.norm_part, usize::checked_add)
    }
}

/// Every buffer a rank allocates: per group, then the gather and gradient slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BufferLayout {
    pub groups: Vec<GroupBuffers>,
    /// `None` where nothing trains.
    pub step_scratch: Option<StepScratch>,
    pub gather_slots: usize,
    pub gather_slot_bytes: usize,
    pub grad_slots: usize,
    pub grad_slot_bytes: usize,
    /// Whether gradient shards come with a step's first gradient of their group and go when the
    /// step ends ([`GradShardMemory::PerStep`]) rather than live as long as the engine.
    pub per_step_grad_shards: bool,
    /// Where per-step gradient shards go right after their group's update inside the backward
    /// ([`EngineConfig::step_in_backward`]): the most bytes of them held at once.
    pub grad_shards_in_flight: Option<usize>,
}

/// The buffers a rank allocates for `plan` under `config`, given the policy's decisions;
/// `Error::SizeOverflow` when a size does not fit in a `usize`.
pub(super) fn layout(
    plan: &Plan,
    config: &EngineConfig,
    master_only: &[bool],
    accumulates: bool,
    (gather_slots, grad_slots, grad_slot_dtype): (usize, usize, DType),
) -> Result<BufferLayout> {
    let bytes = |numel: usize, dtype: DType, what: &'static str| {
        numel
            .checked_mul(dtype.size())
            .ok_or(Error::SizeOverflow { what })
    };
    let mut groups =
        crate::fallible::with_capacity(plan.groups().len(), "the plan's buffer layout")?;
    for (g, &master_only) in plan.groups().iter().zip(master_only) {
        let trains = g.trainable;
        let shard = match master_only {
            true => 0,
            false => bytes(g.shard_numel, g.dtype, "parameter shards")?,
        };
        let f32_shard = |what| bytes(g.shard_numel, DType::F32, what);
        groups.push(GroupBuffers {
            shard,
            grad_shard: trains.then(|| f32_shard("gradient shards")).transpose()?,
            master: (trains && g.dtype != DType::F32)
                .then(|| f32_shard("optimizer state"))
                .transpose()?,
            moment: (trains && config.optimizer.has_moments())
                .then(|| bytes(g.shard_numel, config.moment_dtype, "optimizer state"))
                .transpose()?,
            accumulator: (trains && accumulates)
                .then(|| bytes(g.padded_numel, DType::F32, "gradient accumulators"))
                .transpose()?,
        });
    }
    let trains = plan.groups().iter().any(|g| g.trainable);
    Ok(BufferLayout {
        groups,
        step_scratch: trains.then_some(StepScratch {
            norm_part: NORM_PART_BYTES,
            norm_parts: match plan.world_size() {
                1 => 0,
                world => bytes(world, DType::F32, "the ranks' norm parts")?
                    .checked_mul(NORM_PART_BYTES / 4)
                    .ok_or(Error::SizeOverflow {
                        what: "the ranks' norm parts",
                    })?,
            },
            nonfinite_count: NONFINITE_COUNT_BYTES,
            step_values: crate::optim::STEP_VALUES_BYTES,
            skipped_steps: SKIPPED_STEPS_BYTES,
        }),
        gather_slots,
        gather_slot_bytes: plan.gather_slot_bytes(),
        grad_slots,
        grad_slot_bytes: bytes(plan.grad_slot_numel(), grad_slot_dtype, "gradient slots")?,
        per_step_grad_shards: config.grad_shard_memory == GradShardMemory::PerStep,
        grad_shards_in_flight: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Accumulation, ParamStorage};
    use crate::optim::OptimizerConfig;
    use crate::plan::Policy;
    use crate::spec::{ModelSpec, ParamSpec};

    /// One trainable group of `dtype` and 1024 elements (4 KiB of f32) at world size 2.
    fn plan(dtype: DType) -> Plan {
        let params = vec![ParamSpec::new("w", &[1024], dtype).in_unit(0)];
        Plan::new(&ModelSpec::new(params).unwrap(), 2).unwrap()
    }

    #[test]
    fn masters_and_moments_follow_the_dtypes_and_the_optimizer() {
        let shard = 512;
        let adamw = EngineConfig::default();
        let g = Policy::new(&plan(DType::Bf16), &adamw)
            .unwrap()
            .layout
            .groups[0];
        assert_eq!(
            (g.shard, g.grad_shard, g.master, g.moment),
            (shard * 2, Some(shard * 4), Some(shard * 4), Some(shard * 4))
        );
        let bf16_moments = EngineConfig {
            moment_dtype: DType::Bf16,
            ..EngineConfig::default()
        };
        let g = Policy::new(&plan(DType::Bf16), &bf16_moments)
            .unwrap()
            .layout
            .groups[0];
        assert_eq!(g.moment, Some(shard * 2));
        let sgd = EngineConfig {
            optimizer: OptimizerConfig::sgd(0.1),
            ..EngineConfig::default()
        };
        let g = Policy::new(&plan(DType::F16), &sgd).unwrap().layout.groups[0];
        assert_eq!((g.master, g.moment), (Some(shard * 4), None));
        let g = Policy::new(&plan(DType::F32), &sgd).unwrap().layout.groups[0];
        assert_eq!((g.master, g.moment, g.accumulator), (None, None, None));
    }

    #[test]
    fn master_only_storage_and_no_sync_accumulation_shape_the_buffers() {
        let config = EngineConfig {
            param_storage: ParamStorage::MasterOnly,
            accumulation: Accumulation::NoSync,
            grad_shard_memory: GradShardMemory::PerStep,
            ..EngineConfig::default()
        };
        let layout = Policy::new(&plan(DType::Bf16), &config).unwrap().layout;
        let g = layout.groups[0];
        assert_eq!(
            (g.shard, g.master, g.accumulator),
            (0, Some(512 * 4), Some(1024 * 4))
        );
        assert!(layout.per_step_grad_shards);
    }
}
