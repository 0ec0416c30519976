//! What a configuration makes of a plan, resolved once: the limits as they bind, how many gather
//! and gradient slots, which groups keep only their master, where gradients go, and the buffers
//! that follow from those. The engine allocates from it and the memory report sums it, so the
//! prediction cannot drift from what is allocated.

use crate::config::{Accumulation, EngineConfig, ParamStorage};
use crate::error::Result;
use crate::types::{DType, Unit};

use super::{BufferLayout, Group, MemoryPerRank, Plan, buffers, memory};

/// How a configuration's limits act on one plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Limits {
    pub gathered: usize,
    pub reduces_in_flight: usize,
}

/// A plan under a configuration: every decision the engine and the memory report share.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    /// The configuration's limits as they act on this plan: no more gathered buffers than
    /// groups (every group with `Accumulation::KeepGathered`), no more reductions in flight than
    /// trainable groups (a larger limit never binds).
    pub limits: Limits,
    /// Per group, whether it keeps its values in the fp32 master only (`ParamStorage::MasterOnly`,
    /// a trainable bf16 or f16 group): no shard in its dtype, each gather casting the master.
    pub(super) master_only: Vec<bool>,
    /// Whether gradients go straight into the fp32 shards (every pass, adding after the first):
    /// at world size 1 the shard is the whole gradient, unless the reduction scales it or
    /// replicas must agree on it.
    pub grads_direct: bool,
    /// Whether `Accumulation::NoSync` keeps unsharded fp32 accumulators: where gradients do not
    /// go straight into the shards.
    pub grad_accumulators: bool,
    /// The element type of the gradient slots: the transport's, f32 where nothing travels.
    pub grad_slot_dtype: DType,
    /// The buffers a rank allocates.
    pub layout: BufferLayout,
    /// Their bytes, by kind and in all.
    pub memory: MemoryPerRank,
    /// The facts the buffer report gives its reasons from.
    pub(super) world_size: usize,
    pub(super) groups: usize,
    pub(super) trainable: usize,
    pub(super) accumulation: Accumulation,
}

impl Policy {
    /// Resolves `config` on `plan`; `Error::InvalidConfig` for a config that an engine refuses
    /// ([`EngineConfig::validate`]), `Error::SizeOverflow` when a buffer's or the total's size
    /// does not fit in a `usize`.
    pub fn new(plan: &Plan, config: &EngineConfig) -> Result<Policy> {
        config.validate()?;
        let groups = plan.groups();
        let trainable = groups.iter().filter(|g| g.trainable).count();
        let gathered = match config.accumulation {
            Accumulation::KeepGathered => groups.len(),
            _ => config.double_buffer_limit.min(groups.len()),
        };
        let limits = Limits {
            gathered: gathered.max(1),
            reduces_in_flight: config.max_reduces_in_flight.min(trainable).max(1),
        };
        let master_only: Vec<bool> = groups
            .iter()
            .map(|g| keeps_only_master(config, g))
            .collect();
        let grads_direct = !plan.grads_travel() && config.grad_reduction.scale(1) == 1.0;
        let grad_accumulators = config.accumulation == Accumulation::NoSync && !grads_direct;
        let grad_slot_dtype = match plan.grads_travel() {
            true => config.reduce_dtype,
            false => DType::F32,
        };
        // At world size 1 a shard is its whole buffer and serves as the gathered view: only the
        // groups without a shard (master-only) need slots to be gathered into. Beyond the limit,
        // a slot for each group gathered at once (the root's and one unit's) where units' hooks
        // come one after another: their gathers are required, and the slots are made with the
        // engine rather than at the first step.
        let takes_slot = |g: usize| plan.world_size() > 1 || master_only[g];
        let gathered_at_once = {
            let (root, unit) = groups_at_once(plan, takes_slot);
            root.saturating_add(unit)
        };
        let gather_slots = match plan.world_size() {
            1 => master_only
                .iter()
                .filter(|&&m| m)
                .count()
                .min(limits.gathered),
            _ => limits.gathered,
        }
        .max(gathered_at_once);
        // One slot being filled beside each reduction in flight; none where gradients go
        // straight into the shards or fp32 accumulators are reduced in place. Where each pass
        // reduces across ranks, a group holds its slot until its unit's backward ends, so every
        // group that takes gradients at once (the root's and one unit's) has one: none is
        // reduced in part, which would depend on the gradients a rank got.
        let in_place = grad_accumulators && grad_slot_dtype == DType::F32;
        let filled_at_once = {
            let (root, unit) = groups_at_once(plan, |g| groups[g].trainable);
            root.saturating_add(unit)
        };
        let grad_slots = match trainable > 0 && !grads_direct && !in_place {
            true if plan.grads_travel() && !grad_accumulators => {
                (limits.reduces_in_flight + 1).max(filled_at_once)
            }
            true => limits.reduces_in_flight + 1,
            false => 0,
        };
        let mut layout = buffers::layout(
            plan,
            config,
            &master_only,
            grad_accumulators,
            (gather_slots, grad_slots, grad_slot_dtype),
        )?;
        if config.step_in_backward && layout.per_step_grad_shards {
            let reductions = match config.overlap {
                true => limits.reduces_in_flight,
                false => 1,
            };
            layout.grad_shards_in_flight = Some(grad_shards_in_flight(
                plan,
                &layout,
                (!grads_direct).then_some(reductions),
            )?);
        }
        Ok(Policy {
            limits,
            grads_direct,
            grad_accumulators,
            grad_slot_dtype,
            memory: memory::memory_of(&layout)?,
            layout,
            master_only,
            world_size: plan.world_size(),
            groups: groups.len(),
            trainable,
            accumulation: config.accumulation,
        })
    }

    /// Whether group `group` keeps its values in the fp32 master only.
    pub fn master_only(&self, group: usize) -> bool {
        self.master_only.get(group) == Some(&true)
    }
}

/// The root's groups that `counts`, and the most of any other unit's: the groups held at once
/// where units' hooks come one after another (gathered, or taking gradients).
fn groups_at_once(plan: &Plan, counts: impl Fn(usize) -> bool) -> (usize, usize) {
    let (mut root, mut most) = (0, 0);
    for (u, &unit) in plan.units().iter().enumerate() {
        let counted = (plan.unit_groups(u).unwrap_or_default().iter())
            .filter(|&&g| counts(g))
            .count();
        match unit {
            Unit::Root => root = counted,
            _ => most = most.max(counted),
        }
    }
    (root, most)
}

/// The most bytes of per-step gradient shards held at once where each group's goes right after
/// its update in the backward (never more than every shard). Gradients of one unit end those of
/// every other unit but the root, so at most the root's groups and one other unit's take
/// gradients at once.
/// - At world size 1 (`reductions` `None`) a shard lives from its group's first gradient to its
///   update: the root's shards and the largest other unit's.
/// - Where gradients travel, a shard lives from the group's first reduction to the retire of its
///   last, and at most `reductions` are in flight: the largest `reductions` shards. A group is
///   reduced before its gradients are complete only when every gradient slot is being filled,
///   which takes more groups taking gradients at once than slots; then the root's shards and
///   the largest other unit's count too.
fn grad_shards_in_flight(
    plan: &Plan,
    layout: &BufferLayout,
    reductions: Option<usize>,
) -> Result<usize> {
    let overflow = || crate::error::Error::SizeOverflow {
        what: "gradient shards",
    };
    let shard = |g: usize| layout.groups[g].grad_shard.unwrap_or(0);
    let sum = |groups: &[usize]| {
        groups
            .iter()
            .try_fold(0usize, |total, &g| total.checked_add(shard(g)))
    };
    let (mut root, mut largest_unit) = (0usize, 0usize);
    for (u, &unit) in plan.units().iter().enumerate() {
        let bytes = sum(plan.unit_groups(u).unwrap_or_default()).ok_or_else(overflow)?;
        match unit {
            Unit::Root => root = bytes,
            _ => largest_unit = largest_unit.max(bytes),
        }
    }
    let (root_groups, most_unit_groups) = groups_at_once(plan, |g| plan.groups()[g].trainable);
    let open_units = root.checked_add(largest_unit).ok_or_else(overflow)?;
    let bound = match reductions {
        None => open_units,
        Some(count) => {
            let mut shards =
                crate::fallible::with_capacity(layout.groups.len(), "the gradient shards' sizes")?;
            shards.extend((0..layout.groups.len()).map(shard));
            shards.sort_unstable_by(|a, b| b.cmp(a));
            let largest = shards
                .iter()
                .take(count)
                .try_fold(0usize, |total, &b| total.checked_add(b))
                .ok_or_else(overflow)?;
            let partial = root_groups + most_unit_groups > layout.grad_slots;
            match partial {
                true => largest.checked_add(open_units).ok_or_else(overflow)?,
                false => largest,
            }
        }
    };
    let all = (0..layout.groups.len())
        .try_fold(0usize, |total, g| total.checked_add(shard(g)))
        .ok_or_else(overflow)?;
    Ok(bound.min(all))
}

fn keeps_only_master(config: &EngineConfig, group: &Group) -> bool {
    config.param_storage == ParamStorage::MasterOnly && group.trainable && group.dtype != DType::F32
}
