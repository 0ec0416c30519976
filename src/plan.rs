//! Pure layout: groups, their order, padded offsets, shard ranges and the memory each rank holds.

use std::collections::HashMap;
use std::ops::Range;

use serde::Serialize;

use crate::config::{Accumulation, EngineConfig, GradShardMemory, ParamStorage};
use crate::error::{Error, Result};
use crate::spec::{ModelSpec, ProcessGroupSpec};
use crate::types::DType;
use crate::types::{ParamId, Unit};

/// Every parameter starts this many bytes after the start of its group's buffer, times an integer.
pub const ALIGNMENT_BYTES: usize = 256;

/// Where one parameter lives in its group's flat buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamLayout {
    pub name: String,
    pub shape: Vec<u64>,
    pub dtype: DType,
    pub trainable: bool,
    pub unit: Unit,
    pub numel: usize,
    pub group: usize,
    /// First element in the group's buffer.
    pub offset: usize,
    /// Elements reserved: `numel` rounded up to the group's alignment.
    pub padded_numel: usize,
}

/// Parameters that share dtype, trainability, unit, tying and optimizer settings (weight decay
/// on or off, learning-rate scale), packed into one flat buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct Group {
    pub index: usize,
    pub dtype: DType,
    pub trainable: bool,
    pub unit: Unit,
    pub tied: bool,
    pub weight_decay: bool,
    pub lr_scale: f32,
    /// The process group ([`Plan::process_groups`]) whose ranks shard the group; `None` for
    /// the data-parallel world.
    pub process_group: Option<usize>,
    /// The ranks the buffer is sharded over: the world size, or the process group's size.
    pub shards: usize,
    /// Buffer length: a multiple of `shards`.
    pub padded_numel: usize,
    /// Elements each rank holds: `padded_numel / shards`.
    pub shard_numel: usize,
    /// Members in model order.
    pub params: Vec<ParamId>,
}

impl Group {
    /// Bytes of the gathered buffer.
    pub fn padded_bytes(&self) -> usize {
        self.padded_numel * self.dtype.size()
    }
}

/// How a configuration's limits act on one plan (see [`Plan::limits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub gathered: usize,
    pub reduces_in_flight: usize,
}

/// Bytes one rank holds: everything is allocated before the first step, except per-step gradient
/// shards ([`crate::GradShardMemory::PerStep`]), which exist from a step's first gradient to its
/// end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryPerRank {
    pub param_shards: usize,
    pub grad_shards: usize,
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

/// The layout of a model at one world size: the ranks that shard it, each holding
/// `1 / world_size` of every group; under hybrid sharding ([`Plan::hybrid`]) the ranks of one
/// replica, of `replicas` that each hold it all. A group of a process group
/// ([`ProcessGroupSpec`]) is sharded over that group's ranks instead, each group of ranks
/// holding its own copy.
#[derive(Clone, Debug)]
pub struct Plan {
    world_size: usize,
    replicas: usize,
    process_groups: Vec<ProcessGroupSpec>,
    params: Vec<ParamLayout>,
    groups: Vec<Group>,
    units: Vec<Unit>,
    /// Each unit's position in `units`.
    unit_index: HashMap<Unit, usize>,
    unit_groups: Vec<Vec<usize>>,
    by_name: HashMap<String, ParamId>,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct GroupKey {
    dtype: DType,
    trainable: bool,
    unit: Unit,
    tied: bool,
    weight_decay: bool,
    /// The learning-rate scale's bits: equal scales share a group.
    lr_scale: u32,
    process_group: Option<usize>,
}

impl Plan {
    /// Groups, orders and pads `model`'s parameters for `world_size` ranks.
    pub fn new(model: &ModelSpec, world_size: usize) -> Result<Plan> {
        Plan::hybrid(model, 1, world_size)
    }

    /// The plan of hybrid sharding ([`crate::comm::hybrid`]): `model` sharded over the
    /// `shard_size` ranks of each of `replicas` replicas.
    pub fn hybrid(model: &ModelSpec, replicas: usize, shard_size: usize) -> Result<Plan> {
        let world_size = shard_size;
        if world_size == 0 || replicas == 0 {
            return Err(Error::ZeroWorldSize);
        }
        for g in &model.process_groups {
            if replicas > 1 {
                return Err(Error::InvalidProcessGroup {
                    name: g.name.clone(),
                    reason: format!("is not supported under hybrid sharding ({replicas} replicas)"),
                });
            }
            g.check_divides(world_size)?;
        }
        // Groups in order of first appearance, members in model order.
        let mut keys: Vec<GroupKey> = Vec::new();
        let mut key_index: HashMap<GroupKey, usize> = HashMap::new();
        let mut members: Vec<Vec<usize>> = Vec::new();
        for (i, p) in model.params.iter().enumerate() {
            let key = GroupKey {
                dtype: p.dtype,
                trainable: p.trainable,
                unit: Unit::from(p.unit),
                tied: p.tied,
                weight_decay: p.weight_decay,
                lr_scale: p.lr_scale.to_bits(),
                process_group: match (&p.process_group, model.process_group_of(p)) {
                    (Some(group), None) => {
                        return Err(Error::UnknownProcessGroup {
                            name: p.name.clone(),
                            group: group.clone(),
                        });
                    }
                    (_, index) => index,
                },
            };
            match key_index.get(&key) {
                Some(&g) => members[g].push(i),
                None => {
                    key_index.insert(key.clone(), keys.len());
                    keys.push(key);
                    members.push(vec![i]);
                }
            }
        }
        // Stable sort: tied first, then frozen, then trainable; by unit within, the root last.
        let mut order: Vec<usize> = (0..keys.len()).collect();
        order.sort_by_key(|&g| {
            let k = &keys[g];
            let class = if k.tied {
                0
            } else if !k.trainable {
                1
            } else {
                2
            };
            (class, k.unit)
        });

        let mut params: Vec<Option<ParamLayout>> = vec![None; model.params.len()];
        let mut groups = Vec::with_capacity(order.len());
        for (index, &g) in order.iter().enumerate() {
            let key = &keys[g];
            let shards = key
                .process_group
                .map_or(world_size, |pg| model.process_groups[pg].size);
            let overflow = |i: usize| {
                move || Error::LayoutOverflow {
                    name: model.params[i].name.clone(),
                    world_size,
                }
            };
            let first = members[g][0];
            let align = (ALIGNMENT_BYTES / key.dtype.size())
                .checked_mul(shards)
                .ok_or_else(overflow(first))?;
            let mut offset = 0usize;
            for &i in &members[g] {
                let spec = &model.params[i];
                let overflow = overflow(i);
                let numel = spec.numel().ok_or_else(|| Error::NumelOverflow {
                    name: spec.name.clone(),
                    shape: spec.shape.clone(),
                })?;
                let padded_numel = numel
                    .div_ceil(align)
                    .checked_mul(align)
                    .ok_or_else(overflow)?;
                params[i] = Some(ParamLayout {
                    name: spec.name.clone(),
                    shape: spec.shape.clone(),
                    dtype: spec.dtype,
                    trainable: spec.trainable,
                    unit: key.unit,
                    numel,
                    group: index,
                    offset,
                    padded_numel,
                });
                offset = offset.checked_add(padded_numel).ok_or_else(overflow)?;
            }
            let last = members[g][members[g].len() - 1];
            offset
                .checked_mul(key.dtype.size())
                .ok_or_else(overflow(last))?;
            groups.push(Group {
                index,
                dtype: key.dtype,
                trainable: key.trainable,
                unit: key.unit,
                tied: key.tied,
                weight_decay: key.weight_decay,
                lr_scale: f32::from_bits(key.lr_scale),
                process_group: key.process_group,
                shards,
                padded_numel: offset,
                shard_numel: offset / shards,
                params: members[g].iter().map(|&i| ParamId(i)).collect(),
            });
        }
        let params: Vec<ParamLayout> = params.into_iter().flatten().collect();

        let mut units: Vec<Unit> = Vec::new();
        let mut unit_index: HashMap<Unit, usize> = HashMap::new();
        let mut unit_groups: Vec<Vec<usize>> = Vec::new();
        for g in &groups {
            match unit_index.get(&g.unit) {
                Some(&u) => unit_groups[u].push(g.index),
                None => {
                    unit_index.insert(g.unit, units.len());
                    units.push(g.unit);
                    unit_groups.push(vec![g.index]);
                }
            }
        }
        let by_name = params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.name.clone(), ParamId(i)))
            .collect();
        Ok(Plan {
            world_size,
            replicas,
            process_groups: model.process_groups.clone(),
            params,
            groups,
            units,
            unit_index,
            unit_groups,
            by_name,
        })
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Replicas of the sharded model: 1 but under hybrid sharding.
    pub fn replicas(&self) -> usize {
        self.replicas
    }

    /// The process groups the model declares, in its order.
    pub fn process_groups(&self) -> &[ProcessGroupSpec] {
        &self.process_groups
    }

    /// Rank `rank`'s place among the ranks that shard `group`: the shard it holds.
    pub fn place(&self, group: &Group, rank: usize) -> usize {
        rank % group.shards
    }

    /// Which copy of `group` rank `rank` holds: its process group's index among the world's
    /// (0 for a group of the data-parallel world, which has one copy).
    pub fn copy(&self, group: &Group, rank: usize) -> usize {
        rank / group.shards
    }

    /// Copies of `group` in the world: one per group of ranks of its process group.
    pub fn copies(&self, group: &Group) -> usize {
        self.world_size / group.shards
    }

    /// Whether a gradient goes to other ranks: a sharded group, or replicas to agree with.
    pub fn grads_travel(&self) -> bool {
        self.world_size > 1 || self.replicas > 1
    }

    /// Parameters in model order.
    pub fn params(&self) -> &[ParamLayout] {
        &self.params
    }

    /// Groups in buffer order.
    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// Units in order of their first group.
    pub fn units(&self) -> &[Unit] {
        &self.units
    }

    /// The position of `unit` in [`Plan::units`].
    pub fn unit_index(&self, unit: Unit) -> Option<usize> {
        self.unit_index.get(&unit).copied()
    }

    /// The groups of the unit at `unit_index` in [`Plan::units`].
    pub fn unit_groups(&self, unit_index: usize) -> &[usize] {
        &self.unit_groups[unit_index]
    }

    /// Looks a parameter up by name.
    pub fn param_id(&self, name: &str) -> Result<ParamId> {
        self.by_name
            .get(name)
            .copied()
            .ok_or_else(|| Error::UnknownParam {
                name: name.to_string(),
            })
    }

    /// The layout of a parameter, or an error for an id past the end.
    pub fn param(&self, id: ParamId) -> Result<&ParamLayout> {
        self.params.get(id.0).ok_or(Error::ParamIdOutOfRange {
            id: id.0,
            count: self.params.len(),
        })
    }

    /// The layout of a group, or an error for an index past the end.
    pub fn group(&self, index: usize) -> Result<&Group> {
        self.groups.get(index).ok_or(Error::GroupOutOfRange {
            group: index,
            count: self.groups.len(),
        })
    }

    /// The elements of group `group`'s buffer that rank `rank` holds.
    pub fn shard_range(&self, group: &Group, rank: usize) -> Range<usize> {
        let place = self.place(group, rank);
        group.shard_numel * place..group.shard_numel * (place + 1)
    }

    /// Reassembles parameter `param` (bytes in its dtype) from the shards of one copy of its
    /// group, `shards[p]` being the one at place `p` (rank `p` of the world, but in a process
    /// group).
    pub fn assemble_param(&self, param: ParamId, shards: &[Vec<u8>]) -> Result<Vec<u8>> {
        let layout = self.param(param)?;
        let group = &self.groups[layout.group];
        let size = layout.dtype.size();
        let shard_bytes = group.shard_numel * size;
        if shards.len() != group.shards {
            return Err(Error::WorldSizeMismatch {
                plan: group.shards,
                comm: shards.len(),
            });
        }
        if let Some(bad) = shards.iter().find(|s| s.len() != shard_bytes) {
            return Err(Error::DataLength {
                name: layout.name.clone(),
                expected: group.shard_numel,
                got: bad.len() / size,
            });
        }
        let start = layout.offset * size;
        Ok((start..start + layout.numel * size)
            .map(|byte| shards[byte / shard_bytes][byte % shard_bytes])
            .collect())
    }

    /// Bytes of the largest gathered buffer: the size of one gather slot.
    pub fn gather_slot_bytes(&self) -> usize {
        self.groups
            .iter()
            .map(Group::padded_bytes)
            .max()
            .unwrap_or(0)
    }

    /// The configuration's limits as they act on this plan: no more gathered buffers than groups
    /// (every group with `Accumulation::KeepGathered`), no more reductions in flight than
    /// trainable groups (a larger limit never binds).
    pub fn limits(&self, config: &EngineConfig) -> Limits {
        let trainable = self.groups.iter().filter(|g| g.trainable).count();
        let gathered = match config.accumulation {
            Accumulation::KeepGathered => self.groups.len(),
            _ => config.double_buffer_limit.min(self.groups.len()),
        };
        Limits {
            gathered: gathered.max(1),
            reduces_in_flight: config.max_reduces_in_flight.min(trainable).max(1),
        }
    }

    /// Number of gather slots: the limit; at world size 1, where a shard is its whole buffer and
    /// serves as the gathered view, only as many as groups without a shard (master-only) can be
    /// gathered at once.
    pub fn gather_slot_count(&self, config: &EngineConfig) -> usize {
        let limit = self.limits(config).gathered;
        if self.world_size == 1 {
            let casts = self
                .groups
                .iter()
                .filter(|g| self.master_only(config, g))
                .count();
            casts.min(limit)
        } else {
            limit
        }
    }

    /// Whether `group` keeps its values in the fp32 master only (`ParamStorage::MasterOnly`, a
    /// trainable bf16 or f16 group): no shard in its dtype, each gather casting the master.
    pub fn master_only(&self, config: &EngineConfig, group: &Group) -> bool {
        config.param_storage == ParamStorage::MasterOnly
            && group.trainable
            && group.dtype != DType::F32
    }

    /// Whether gradients go straight into the fp32 shards (every pass, adding after the first):
    /// at world size 1 the shard is the whole gradient, unless the reduction scales it or
    /// replicas must agree on it.
    pub fn grads_direct(&self, config: &EngineConfig) -> bool {
        !self.grads_travel() && config.grad_reduction.scale(1) == 1.0
    }

    /// Whether `Accumulation::NoSync` keeps unsharded fp32 accumulators: where gradients do
    /// not go straight into the shards.
    pub fn grad_accumulators(&self, config: &EngineConfig) -> bool {
        config.accumulation == Accumulation::NoSync && !self.grads_direct(config)
    }

    /// The element type of the gradient slots: the transport's, f32 where nothing travels.
    pub fn grad_slot_dtype(&self, config: &EngineConfig) -> DType {
        if !self.grads_travel() {
            DType::F32
        } else {
            config.reduce_dtype
        }
    }

    /// Elements of the largest trainable group: the size of one gradient slot.
    pub fn grad_slot_numel(&self) -> usize {
        self.groups
            .iter()
            .filter(|g| g.trainable)
            .map(|g| g.padded_numel)
            .max()
            .unwrap_or(0)
    }

    /// Number of temporary gradient slots: one being filled beside each reduction in flight;
    /// none where gradients go straight into the shards (world size 1) or fp32 accumulators are
    /// reduced in place.
    pub fn grad_slot_count(&self, config: &EngineConfig) -> usize {
        let in_place = self.grad_accumulators(config) && self.grad_slot_dtype(config) == DType::F32;
        let needed = !self.grads_direct(config) && !in_place;
        if self.groups.iter().any(|g| g.trainable) && needed {
            self.limits(config).reduces_in_flight + 1
        } else {
            0
        }
    }

    /// The bytes each rank allocates for this plan under `config`; `Error::SizeOverflow` when a
    /// total does not fit in a `usize`.
    pub fn memory_per_rank(&self, config: &EngineConfig) -> Result<MemoryPerRank> {
        let overflow = |what: &'static str| move || Error::SizeOverflow { what };
        let add = |total: usize, bytes: Option<usize>, what: &'static str| {
            bytes
                .and_then(|b| total.checked_add(b))
                .ok_or_else(overflow(what))
        };
        let mut m = MemoryPerRank::default();
        for g in &self.groups {
            let size = if self.master_only(config, g) {
                0
            } else {
                g.dtype.size()
            };
            m.param_shards = add(
                m.param_shards,
                g.shard_numel.checked_mul(size),
                "parameter shards",
            )?;
            if g.trainable {
                m.grad_shards = add(
                    m.grad_shards,
                    g.shard_numel.checked_mul(4),
                    "gradient shards",
                )?;
                m.optimizer_state = add(
                    m.optimizer_state,
                    config
                        .optimizer
                        .state_bytes(g.dtype, config.moment_dtype, g.shard_numel),
                    "optimizer state",
                )?;
            }
        }
        m.gathered_slots = self
            .gather_slot_count(config)
            .checked_mul(self.gather_slot_bytes())
            .ok_or_else(overflow("gather slots"))?;
        m.grad_slots = self
            .grad_slot_numel()
            .checked_mul(self.grad_slot_dtype(config).size())
            .and_then(|b| b.checked_mul(self.grad_slot_count(config)))
            .ok_or_else(overflow("gradient slots"))?;
        if self.grad_accumulators(config) {
            for g in self.groups.iter().filter(|g| g.trainable) {
                m.grad_accumulators = add(
                    m.grad_accumulators,
                    g.padded_numel.checked_mul(4),
                    "gradient accumulators",
                )?;
            }
        }
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
        m.between_steps = match config.grad_shard_memory {
            GradShardMemory::Persistent => m.peak,
            GradShardMemory::PerStep => m.peak - m.grad_shards,
        };
        Ok(m)
    }

    /// Every buffer [`Plan::memory_per_rank`] counts, by kind, with the reason for its count;
    /// the bytes add up to its peak.
    pub fn buffer_report(&self, config: &EngineConfig) -> Result<Vec<BufferReport>> {
        let m = self.memory_per_rank(config)?;
        let limits = self.limits(config);
        let trainable = self.groups.iter().filter(|g| g.trainable).count();
        let shards = self
            .groups
            .iter()
            .filter(|g| !self.master_only(config, g))
            .count();
        let masters = self
            .groups
            .iter()
            .filter(|g| g.trainable && g.dtype != DType::F32)
            .count();
        let moments = if config.optimizer.has_moments() {
            trainable * 2
        } else {
            0
        };
        let gather_slots = self.gather_slot_count(config);
        let gather_why = match (self.world_size, config.accumulation) {
            (1, _) if gather_slots == 0 => {
                "none: at world size 1 each shard is its group's view".to_string()
            }
            (1, _) => format!(
                "master-only groups cast into slots, at most {} gathered at once",
                limits.gathered
            ),
            (_, Accumulation::KeepGathered) => "every group stays gathered for the step".into(),
            _ => format!(
                "double_buffer_limit: {} of {} groups gathered at once",
                limits.gathered,
                self.groups.len()
            ),
        };
        let grad_slots = self.grad_slot_count(config);
        let grad_why = if trainable == 0 {
            "none: nothing trains".to_string()
        } else if self.grads_direct(config) {
            "none: at world size 1 gradients go straight into the shards".into()
        } else if grad_slots == 0 {
            "none: the fp32 accumulators are reduced in place".into()
        } else {
            format!(
                "one filling beside each of {} reductions in flight, in {}",
                limits.reduces_in_flight,
                self.grad_slot_dtype(config)
            )
        };
        let accumulators = if self.grad_accumulators(config) {
            trainable
        } else {
            0
        };
        Ok(vec![
            BufferReport {
                what: "parameter shards",
                count: shards,
                bytes: m.param_shards,
                why: "each group's part in its dtype (master-only groups have none)".into(),
            },
            BufferReport {
                what: "gradient shards",
                count: trainable,
                bytes: m.grad_shards,
                why: match config.grad_shard_memory {
                    GradShardMemory::Persistent => {
                        "each trainable group's part of the reduced fp32 gradient".into()
                    }
                    GradShardMemory::PerStep => "each trainable group's part of the reduced \
                        fp32 gradient, from the step's first gradient of the group to the step's end"
                        .into(),
                },
            },
            BufferReport {
                what: "optimizer state",
                count: masters + moments,
                bytes: m.optimizer_state,
                why: "fp32 masters of bf16/f16 groups, and AdamW's two moments".into(),
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
        ])
    }

    /// Every fact of parameter `index`'s declaration and layout, as the ranks compare their plans.
    pub fn describe_param(&self, index: usize) -> String {
        match self.params.get(index) {
            None => "no parameter".to_string(),
            Some(p) => format!(
                "{:?} ({}, shape {:?}, {}, {}, group {} at offset {} of {} elements{})",
                p.name,
                p.dtype,
                p.shape,
                p.unit,
                if p.trainable { "trainable" } else { "frozen" },
                p.group,
                p.offset,
                p.padded_numel,
                match self.groups[p.group].process_group {
                    Some(pg) => format!(
                        ", sharded over {} ranks of process group {:?}",
                        self.groups[p.group].shards, self.process_groups[pg].name
                    ),
                    None => String::new(),
                }
            ),
        }
    }

    /// The plan as JSON: world size, alignment, groups with their params, memory per rank.
    pub fn to_json(&self, config: &EngineConfig) -> serde_json::Value {
        let groups: Vec<serde_json::Value> = self
            .groups
            .iter()
            .map(|g| {
                let params: Vec<serde_json::Value> = g
                    .params
                    .iter()
                    .map(|&id| {
                        let p = &self.params[id.0];
                        serde_json::json!({
                            "name": p.name,
                            "shape": p.shape,
                            "numel": p.numel,
                            "offset": p.offset,
                            "padded_numel": p.padded_numel,
                        })
                    })
                    .collect();
                serde_json::json!({
                    "index": g.index,
                    "dtype": g.dtype,
                    "trainable": g.trainable,
                    "unit": g.unit.layer(),
                    "tied": g.tied,
                    "process_group": g.process_group.map(|pg| &self.process_groups[pg].name),
                    "shards": g.shards,
                    "padded_numel": g.padded_numel,
                    "shard_numel": g.shard_numel,
                    "params": params,
                })
            })
            .collect();
        serde_json::json!({
            "world_size": self.world_size,
            "process_groups": self.process_groups.iter().map(|g| serde_json::json!({
                "name": g.name,
                "size": g.size,
            })).collect::<Vec<_>>(),
            "alignment_bytes": ALIGNMENT_BYTES,
            "double_buffer_limit": config.double_buffer_limit,
            "max_reduces_in_flight": config.max_reduces_in_flight,
            "groups": groups,
            "memory_per_rank": self.memory_per_rank(config).ok(),
            "buffers": self.buffer_report(config).ok(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::ParamSpec;

    fn model(params: Vec<ParamSpec>) -> ModelSpec {
        ModelSpec::new(params).unwrap()
    }

    #[test]
    fn groups_sort_tied_then_frozen_then_trainable_with_the_root_last() {
        let m = model(vec![
            ParamSpec::new("head_bias", &[3], DType::F32),
            ParamSpec::new("w1", &[4, 4], DType::Bf16).in_unit(1),
            ParamSpec::new("g1", &[4], DType::Bf16).in_unit(1).frozen(),
            ParamSpec::new("w0", &[4, 4], DType::Bf16).in_unit(0),
            ParamSpec::new("b0", &[4], DType::Bf16).in_unit(0),
            ParamSpec::new("embed", &[10, 4], DType::Bf16).tied(),
            ParamSpec::new("norm", &[4], DType::F32).frozen(),
        ]);
        let plan = Plan::new(&m, 2).unwrap();
        let names: Vec<Vec<&str>> = plan
            .groups()
            .iter()
            .map(|g| {
                g.params
                    .iter()
                    .map(|&p| plan.params()[p.0].name.as_str())
                    .collect()
            })
            .collect();
        assert_eq!(
            names,
            vec![
                vec!["embed"],
                vec!["g1"],
                vec!["norm"],
                vec!["w0", "b0"],
                vec!["w1"],
                vec!["head_bias"],
            ]
        );
        assert_eq!(plan.units(), &[Unit::Root, Unit::Layer(1), Unit::Layer(0)]);
        assert_eq!(plan.unit_groups(0), &[0, 2, 5]);
    }

    #[test]
    fn offsets_pad_to_256_bytes_times_world_size() {
        let m = model(vec![
            ParamSpec::new("a", &[3], DType::Bf16),
            ParamSpec::new("b", &[300], DType::Bf16),
            ParamSpec::new("c", &[], DType::Bf16),
        ]);
        let plan = Plan::new(&m, 3).unwrap();
        // 128 bf16 elements per 256 bytes, times 3 ranks.
        let layout: Vec<(usize, usize)> = plan
            .params()
            .iter()
            .map(|p| (p.offset, p.padded_numel))
            .collect();
        assert_eq!(layout, vec![(0, 384), (384, 384), (768, 384)]);
        let g = &plan.groups()[0];
        assert_eq!((g.padded_numel, g.shard_numel), (1152, 384));
        assert_eq!(plan.shard_range(g, 2), 768..1152);
    }

    #[test]
    fn memory_counts_every_fixed_allocation() {
        let m = model(vec![
            ParamSpec::new("w", &[1000], DType::Bf16).in_unit(0),
            ParamSpec::new("f", &[10], DType::F32).in_unit(0).frozen(),
        ]);
        let plan = Plan::new(&m, 4).unwrap();
        let config = EngineConfig::default();
        let mem = plan.memory_per_rank(&config).unwrap();
        // bf16 aligns to 128 elements per rank, 512 at 4 ranks: 1000 pads to 1024.
        let w = &plan.groups()[1];
        assert_eq!(w.padded_numel, 1024);
        let f = &plan.groups()[0];
        assert_eq!(f.padded_numel, 256);
        assert_eq!(mem.param_shards, 256 * 2 + 64 * 4);
        assert_eq!(mem.grad_shards, 256 * 4);
        // AdamW on bf16: fp32 master plus two moments.
        assert_eq!(mem.optimizer_state, 256 * 12);
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
                let report = plan.buffer_report(config).unwrap();
                let total: usize = report.iter().map(|b| b.bytes).sum();
                let peak = plan.memory_per_rank(config).unwrap().peak;
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

    #[test]
    fn zero_world_size_is_an_error() {
        let m = model(vec![ParamSpec::new("a", &[1], DType::F32)]);
        assert!(matches!(Plan::new(&m, 0), Err(Error::ZeroWorldSize)));
    }

    #[test]
    fn huge_world_size_overflows_with_an_error() {
        let m = model(vec![ParamSpec::new("a", &[u32::MAX as u64, 4], DType::F32)]);
        assert!(matches!(
            Plan::new(&m, usize::MAX / 8),
            Err(Error::LayoutOverflow { name, .. }) if name == "a"
        ));
    }

    #[test]
    fn lookups_fail_with_specific_errors() {
        let plan = Plan::new(&model(vec![ParamSpec::new("a", &[1], DType::F32)]), 1).unwrap();
        assert_eq!(plan.param_id("a").unwrap(), ParamId(0));
        assert!(matches!(plan.param_id("b"), Err(Error::UnknownParam { name }) if name == "b"));
        assert!(matches!(
            plan.param(ParamId(5)),
            Err(Error::ParamIdOutOfRange { id: 5, count: 1 })
        ));
        assert!(matches!(
            plan.group(1),
            Err(Error::GroupOutOfRange { group: 1, count: 1 })
        ));
        assert_eq!(plan.unit_index(Unit::Layer(0)), None);
    }
}
