//! The bytes a rank allocates for a plan under a configuration, in all and buffer by buffer.

use serde::Serialize;

use crate::config::Accumulation;
use crate::error::{Error, Result};

use super::{BufferLayout, GroupBuffers, Policy};

/// Bytes one rank holds: everything is allocated before the first step, except per-step gradient
/// shards ([`crate::GradShardMemory::PerStep`]), which exist from a step's first gradient to its
/// end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryPerRank {
    pub param_shards: usize,
    pub grad_shards: usize,
    /// fp32 masters, AdamW's moments, and (where anything trains) the
    /// [`super::StepScratch`]: where the gradient norms and the non-finite count add up, every
    /// rank's norm part above world size 1, the step's values the updates read and the count of
    /// steps skipped on the device.
    pub optimizer_state: usize,
    pub gathered_slots: usize,
    pub grad_slots: usize,
    /// The unsharded fp32 gradients of `Accumulation::NoSync`.
    pub grad_accumulators: usize,
    /// Everything, held once a step's gradients are synced.
    pub peak: usize,
    /// What is held between steps: `peak` less per-step gradient shards.
    pub between_steps: usize,
}

/// One kind of buffer a rank allocates: how many, their bytes together, and why that many.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BufferReport {
    pub what: &'static str,
    pub count: usize,
    pub bytes: usize,
    pub why: String,
}

impl Policy {
    /// Every buffer [`Policy::memory`] counts, by kind, with the reason for its count;
    /// the bytes add up to its peak.
    pub fn buffer_report(&self) -> Vec<BufferReport> {
        let (layout, m, limits) = (&self.layout, &self.memory, self.limits);
        let shards = self.master_only.iter().filter(|&&m| !m).count();
        let held = |buffer: fn(&GroupBuffers) -> Option<usize>| {
            layout.groups.iter().filter(|g| buffer(g).is_some()).count()
        };
        let masters = held(|g| g.master);
        let moments = 2 * held(|g| g.moment);
        let gather_slots = layout.gather_slots;
        let gather_why = match (self.world_size, self.accumulation) {
            (1, _) if gather_slots == 0 => {
                "none: at world size 1 each shard is its group's view".to_string()
            }
            (1, _) => format!(
                "master-only groups cast into slots, at most {} gathered at once, or the \
                 root's and one unit's where more",
                limits.gathered
            ),
            (_, Accumulation::KeepGathered) => "every group stays gathered for the step".into(),
            _ => format!(
                "double_buffer_limit: {} of {} groups gathered at once, or the root's and one \
                 unit's where more",
                limits.gathered, self.groups
            ),
        };
        let grad_slots = layout.grad_slots;
        let grad_why = if self.trainable == 0 {
            "none: nothing trains".to_string()
        } else if self.grads_direct {
            "none: at world size 1 gradients go straight into the shards".into()
        } else if grad_slots == 0 {
            "none: the fp32 accumulators are reduced in place".into()
        } else if grad_slots > limits.reduces_in_flight + 1 {
            format!(
                "one for each group taking gradients at once (the root's and one unit's) until \
                 its unit's backward ends, in {}",
                self.grad_slot_dtype
            )
        } else {
            format!(
                "one filling beside each of {} reductions in flight, in {}",
                limits.reduces_in_flight, self.grad_slot_dtype
            )
        };
        let accumulators = held(|g| g.accumulator);
        vec![
            BufferReport {
                what: "parameter shards",
                count: shards,
                bytes: m.param_shards,
                why: "each group's part in its dtype (master-only groups have none)".into(),
            },
            BufferReport {
                what: "gradient shards",
                count: self.trainable,
                bytes: m.grad_shards,
                why: match (layout.per_step_grad_shards, layout.grad_shards_in_flight) {
                    (false, _) => "each trainable group's part of the reduced fp32 gradient".into(),
                    (true, None) => "each trainable group's part of the reduced \
                        fp32 gradient, from the step's first gradient of the group to the step's end"
                        .into(),
                    (true, Some(_)) => "the most held at once, each from its group's first \
                        gradient (or reduction) to its update in the backward: at world size 1 \
                        the root's and the largest other unit's; above, one per reduction in \
                        flight (the largest)"
                        .into(),
                },
            },
            BufferReport {
                what: "optimizer state",
                count: masters
                    + moments
                    + layout.step_scratch.map_or(0, |s| 4 + usize::from(s.norm_parts > 0)),
                bytes: m.optimizer_state,
                why: match layout.step_scratch {
                    Some(_) => "fp32 masters of bf16/f16 groups, AdamW's two moments, where \
                        the gradient norms and the non-finite count add up (16 and 8 bytes), \
                        every rank's norm part for clipping on the device (16 bytes a rank, \
                        none at world size 1), the step's values that the updates read \
                        (48 bytes), and the count of steps skipped on the device (8 bytes)"
                        .into(),
                    None => "none: nothing trains".into(),
                },
            },
            BufferReport {
                what: "gather slots",
                count: gather_slots,
                bytes: m.gathered_slots,
                why: gather_why,
            },
            BufferReport {
                what: "gradient slots",
                count: grad_slots,
                bytes: m.grad_slots,
                why: grad_why,
            },
            BufferReport {
                what: "gradient accumulators",
                count: accumulators,
                bytes: m.grad_accumulators,
                why: if accumulators > 0 {
                    "no-sync: each trainable group's unsharded fp32 gradient".into()
                } else {
                    "none: no no-sync accumulation".into()
                },
            },
        ]
    }
}

/// The bytes of `layout`, by kind and in all; `Error::SizeOverflow` when a total does not fit in
/// a `usize`.
pub(super) fn memory_of(layout: &BufferLayout) -> Result<MemoryPerRank> {
    let overflow = |what: &'static str| move || Error::SizeOverflow { what };
    let add = |total: usize, bytes: Option<usize>, what: &'static str| {
        bytes
            .and_then(|b| total.checked_add(b))
            .ok_or_else(overflow(what))
    };
    let mut m = MemoryPerRank::default();
    for g in &layout.groups {
        m.param_shards = add(m.param_shards, Some(g.shard), "parameter shards")?;
        m.grad_shards = add(m.grad_shards, g.grad_shard.or(Some(0)), "gradient shards")?;
        let moments = g.moment.map_or(Some(0), |b| b.checked_mul(2));
        let optimizer = moments.and_then(|b| b.checked_add(g.master.unwrap_or(0)));
        m.optimizer_state = add(m.optimizer_state, optimizer, "optimizer state")?;
        m.grad_accumulators = add(
            m.grad_accumulators,
            g.accumulator.or(Some(0)),
            "gradient accumulators",
        )?;
    }
    if let Some(held) = layout.grad_shards_in_flight {
        m.grad_shards = held;
    }
    let scratch = layout.step_scratch.map_or(Some(0), |s| s.bytes());
    m.optimizer_state = add(m.optimizer_state, scratch, "optimizer state")?;
    m.gathered_slots = layout
        .gather_slots
        .checked_mul(layout.gather_slot_bytes)
        .ok_or_else(overflow("gather slots"))?;
    m.grad_slots = layout
        .grad_slots
        .checked_mul(layout.grad_slot_bytes)
        .ok_or_else(overflow("gradient slots"))?;
    m.peak = [
        m.grad_shards,
        m.optimizer_state,
        m.gathered_slots,
        m.grad_slots,
        m.grad_accumulators,
    ]
    .into_iter()
    .try_fold(m.param_shards, |total, b| total.checked_add(b))
    .ok_or_else(overflow("the total"))?;
    m.between_steps = match layout.per_step_grad_shards {
        false => m.peak,
        true => m.peak - m.grad_shards,
    };
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{EngineConfig, ParamStorage};
    use crate::plan::Plan;
    use crate::spec::{ModelSpec, ParamSpec};
    use crate::types::DType;

    fn model(params: Vec<ParamSpec>) -> ModelSpec {
        ModelSpec::new(params).unwrap()
    }

    #[test]
    fn memory_counts_every_fixed_allocation() {
        let m = model(vec![
            ParamSpec::new("w", &[1000], DType::Bf16).in_unit(0),
            ParamSpec::new("f", &[10], DType::F32).in_unit(0).frozen(),
        ]);
        let plan = Plan::new(&m, 4).unwrap();
        let config = EngineConfig::default();
        let mem = Policy::new(&plan, &config).unwrap().memory;
        // bf16 aligns to 128 elements per rank, 512 at 4 ranks: 1000 pads to 1024.
        let w = &plan.groups()[1];
        assert_eq!(w.padded_numel, 1024);
        let f = &plan.groups()[0];
        assert_eq!(f.padded_numel, 256);
        assert_eq!(mem.param_shards, 256 * 2 + 64 * 4);
        assert_eq!(mem.grad_shards, 256 * 4);
        // AdamW on bf16: fp32 master plus two moments; where the norms and the non-finite
        // count add up, the 4 ranks' norm parts, the step's values and the count of steps
        // skipped on the device.
        assert_eq!(mem.optimizer_state, 256 * 12 + 16 + 4 * 16 + 8 + 48 + 8);
        assert_eq!(mem.gathered_slots, 2 * 2048);
        // Two reductions in flight are allowed but one trainable group binds: one in flight, one
        // being filled.
        assert_eq!(mem.grad_slots, 2 * 1024 * 4);
        assert_eq!(
            mem.peak,
            mem.param_shards
                + mem.grad_shards
                + mem.optimizer_state
                + mem.gathered_slots
                + mem.grad_slots
        );
    }

    #[test]
    fn stepping_in_the_backward_holds_the_root_s_shards_one_unit_s_and_those_in_flight() {
        // Root: one group of 100 + 50 elements. Unit 0: a decayed group and an exempt one.
        // Unit 1: one group.
        let m = model(vec![
            ParamSpec::new("embed", &[100], DType::F32),
            ParamSpec::new("head", &[50], DType::F32),
            ParamSpec::new("w0", &[200], DType::F32).in_unit(0),
            ParamSpec::new("b0", &[10], DType::F32)
                .in_unit(0)
                .no_weight_decay(),
            ParamSpec::new("w1", &[300], DType::F32).in_unit(1),
        ]);
        let config = |step_in_backward, grad_shard_memory| EngineConfig {
            step_in_backward,
            grad_shard_memory,
            ..EngineConfig::default()
        };
        let memory = |world, c: EngineConfig| {
            Policy::new(&Plan::new(&m, world).unwrap(), &c)
                .unwrap()
                .memory
        };
        use crate::config::GradShardMemory::{PerStep, Persistent};
        // World size 1, f32 padded to 64 elements: root 128 + 64, unit 0 256 + 64, unit 1 320.
        let held = memory(1, config(true, PerStep));
        assert_eq!(held.grad_shards, (192 + 320) * 4);
        let all = memory(1, config(false, PerStep));
        assert_eq!(all.grad_shards, (192 + 320 + 320) * 4);
        assert_eq!(all.peak - held.peak, 320 * 4);
        assert_eq!(held.between_steps, all.between_steps);
        // Persistent shards stay whole.
        assert_eq!(
            memory(1, config(true, Persistent)),
            memory(1, config(false, Persistent))
        );
        // World size 4, padded to 256 elements, a quarter each: root 128, unit 0 64 + 64, unit 1
        // 128. Two reductions in flight hold the two largest; the root's group and unit 0's two
        // take gradients at once in as many slots as there are (three), so no group is reduced
        // before its gradients are complete.
        let held = memory(4, config(true, PerStep));
        assert_eq!(held.grad_shards, (128 + 128) * 4);
        let one_at_a_time = EngineConfig {
            overlap: false,
            ..config(true, PerStep)
        };
        assert_eq!(memory(4, one_at_a_time).grad_shards, 128 * 4);
        // One reduction in flight still has a slot for each of the three groups taking
        // gradients at once: the largest shard only.
        let one_in_flight = EngineConfig {
            max_reduces_in_flight: 1,
            ..config(true, PerStep)
        };
        let policy = Policy::new(&Plan::new(&m, 4).unwrap(), &one_in_flight).unwrap();
        assert_eq!(policy.layout.grad_slots, 3);
        assert_eq!(policy.memory.grad_shards, 128 * 4);
        // Where nothing travels but a reduction scales the gradients, two slots: three groups
        // taking gradients may have one reduced early, its shard kept until its last
        // reduction; the root's and unit 0's count then, bounded by every shard.
        let scaled = EngineConfig {
            grad_reduction: crate::config::GradReduction::Scaled(0.5),
            ..one_in_flight
        };
        let policy = Policy::new(&Plan::new(&m, 1).unwrap(), &scaled).unwrap();
        assert_eq!(policy.layout.grad_slots, 2);
        assert_eq!(policy.memory.grad_shards, (320 + 192 + 320) * 4);
    }

    #[test]
    fn a_config_an_engine_refuses_has_no_prediction() {
        let m = model(vec![ParamSpec::new("w", &[64], DType::F32)]);
        let plan = Plan::new(&m, 1).unwrap();
        let f16_sums = EngineConfig {
            reduce_dtype: DType::F16,
            ..EngineConfig::default()
        };
        let refused = Policy::new(&plan, &f16_sums).err();
        assert!(
            matches!(
                &refused,
                Some(Error::InvalidConfig {
                    field: "reduce_dtype",
                    ..
                })
            ),
            "{refused:?}"
        );
    }

    #[test]
    fn a_model_that_trains_nothing_has_no_optimizer_state() {
        let frozen = model(vec![
            ParamSpec::new("f", &[10], DType::F32).in_unit(0).frozen(),
        ]);
        let policy =
            Policy::new(&Plan::new(&frozen, 2).unwrap(), &EngineConfig::default()).unwrap();
        assert_eq!(policy.layout.step_scratch, None);
        assert_eq!(policy.memory.optimizer_state, 0);
    }

    #[test]
    fn the_buffer_report_adds_up_to_the_peak_and_says_why() {
        let m = model(vec![
            ParamSpec::new("w", &[1000], DType::Bf16).in_unit(0),
            ParamSpec::new("f", &[10], DType::F32).in_unit(0).frozen(),
        ]);
        let configs = [
            EngineConfig::default(),
            EngineConfig {
                accumulation: Accumulation::NoSync,
                ..EngineConfig::default()
            },
            EngineConfig {
                accumulation: Accumulation::KeepGathered,
                reduce_dtype: DType::Bf16,
                ..EngineConfig::default()
            },
            EngineConfig {
                param_storage: ParamStorage::MasterOnly,
                ..EngineConfig::default()
            },
        ];
        for world in [1, 4] {
            let plan = Plan::new(&m, world).unwrap();
            for config in &configs {
                let policy = Policy::new(&plan, config).unwrap();
                let report = policy.buffer_report();
                let total: usize = report.iter().map(|b| b.bytes).sum();
                let peak = policy.memory.peak;
                assert_eq!(total, peak, "world {world} {config:?}");
                let slots = &report[4];
                assert_eq!(slots.what, "gradient slots");
                match (world, config.accumulation) {
                    (1, _) => assert!(slots.why.contains("straight into the shards")),
                    (_, Accumulation::NoSync) => assert!(slots.why.contains("in place")),
                    _ => assert!(slots.why.contains("reductions in flight"), "{}", slots.why),
                }
                assert_eq!(slots.count == 0, slots.bytes == 0);
            }
        }
    }
}
