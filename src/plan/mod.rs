//! Pure layout: groups, their order, padded offsets and shard ranges; a configuration resolved
//! on a plan (`policy`), the buffers it makes (`buffers`) and their bytes (`memory`), and the
//! plan as JSON (`json`).

use std::collections::HashMap;
use std::ops::Range;

use crate::error::{Error, Result};
use crate::spec::{ModelSpec, ProcessGroupSpec};
use crate::types::DType;
use crate::types::{ParamId, Unit};

mod buffers;
mod json;
mod memory;
mod policy;

pub use buffers::{
    BufferLayout, GroupBuffers, NONFINITE_COUNT_BYTES, NORM_PART_BYTES, SKIPPED_STEPS_BYTES,
    StepScratch,
};
pub use memory::{BufferReport, MemoryPerRank};
pub use policy::{Limits, Policy};

/// Every parameter starts this many bytes after the start of its group's buffer, times an integer.
pub const ALIGNMENT_BYTES: usize = 256;

/// Where one parameter lives in its group's flat buffer. Made by [`Plan`] alone, so that what
/// its methods compute from it holds; read through its accessors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamLayout {
    pub(crate) name: String,
    pub(crate) shape: Vec<u64>,
    pub(crate) dtype: DType,
    pub(crate) trainable: bool,
    pub(crate) unit: Unit,
    pub(crate) numel: usize,
    pub(crate) group: usize,
    pub(crate) offset: usize,
    pub(crate) padded_numel: usize,
}

impl ParamLayout {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn shape(&self) -> &[u64] {
        &self.shape
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn trainable(&self) -> bool {
        self.trainable
    }

    pub fn unit(&self) -> Unit {
        self.unit
    }

    pub fn numel(&self) -> usize {
        self.numel
    }

    pub fn group(&self) -> usize {
        self.group
    }

    /// First element in the group's buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }

    /// Elements reserved: `numel` rounded up to the group's alignment.
    pub fn padded_numel(&self) -> usize {
        self.padded_numel
    }
}

/// Parameters that share dtype, trainability, unit, tying and optimizer settings (weight decay
/// on or off, learning-rate scale), packed into one flat buffer. Made by [`Plan`] alone (a group
/// with no shards would divide by zero in its shard arithmetic); read through its accessors.
///
/// ```compile_fail
/// fn no_shards(plan: &fsdp_fusion::Plan) -> usize {
///     let mut group = plan.groups()[0].clone();
///     group.shards = 0;
///     plan.shard_index(&group, 1).unwrap_or(0)
/// }
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Group {
    pub(crate) index: usize,
    pub(crate) dtype: DType,
    pub(crate) trainable: bool,
    pub(crate) unit: Unit,
    pub(crate) tied: bool,
    pub(crate) weight_decay: bool,
    pub(crate) lr_scale: f32,
    pub(crate) process_group: Option<usize>,
    pub(crate) shards: usize,
    pub(crate) padded_numel: usize,
    pub(crate) shard_numel: usize,
    pub(crate) params: Vec<ParamId>,
}

impl Group {
    pub fn index(&self) -> usize {
        self.index
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn trainable(&self) -> bool {
        self.trainable
    }

    pub fn unit(&self) -> Unit {
        self.unit
    }

    pub fn tied(&self) -> bool {
        self.tied
    }

    pub fn weight_decay(&self) -> bool {
        self.weight_decay
    }

    pub fn lr_scale(&self) -> f32 {
        self.lr_scale
    }

    /// The process group ([`Plan::process_groups`]) whose ranks shard the group; `None` for
    /// the data-parallel world.
    pub fn process_group(&self) -> Option<usize> {
        self.process_group
    }

    /// The ranks the buffer is sharded over: the world size, or the process group's size.
    pub fn shards(&self) -> usize {
        self.shards
    }

    /// Buffer length: a multiple of `shards`.
    pub fn padded_numel(&self) -> usize {
        self.padded_numel
    }

    /// Elements each rank holds: `padded_numel / shards`.
    pub fn shard_numel(&self) -> usize {
        self.shard_numel
    }

    /// Members in model order.
    pub fn params(&self) -> &[ParamId] {
        &self.params
    }

    /// Bytes of the gathered buffer.
    pub fn padded_bytes(&self) -> usize {
        self.padded_numel * self.dtype.size()
    }
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
        model.check()?;
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
                // -0.0 and 0.0 are one scale.
                lr_scale: (p.lr_scale + 0.0).to_bits(),
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

    /// Which shard of `group` rank `rank` holds: its index among the ranks that shard the group.
    /// `Error::RankOutOfRange` for a rank outside the world.
    pub fn shard_index(&self, group: &Group, rank: usize) -> Result<usize> {
        Ok(self.rank_of_world(rank)? % group.shards)
    }

    /// Which copy of `group` rank `rank` holds: its process group's index among the world's
    /// (0 for a group of the data-parallel world, which has one copy). `Error::RankOutOfRange`
    /// for a rank outside the world.
    pub fn copy(&self, group: &Group, rank: usize) -> Result<usize> {
        Ok(self.rank_of_world(rank)? / group.shards)
    }

    /// `rank`, checked to be one of the world's (`Error::RankOutOfRange`).
    pub(crate) fn rank_of_world(&self, rank: usize) -> Result<usize> {
        match rank < self.world_size {
            true => Ok(rank),
            false => Err(Error::RankOutOfRange {
                rank,
                world_size: self.world_size,
            }),
        }
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

    /// The groups of the unit at `unit_index` in [`Plan::units`]; none for an index past the end.
    pub fn unit_groups(&self, unit_index: usize) -> Option<&[usize]> {
        self.unit_groups.get(unit_index).map(Vec::as_slice)
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

    /// The elements of group `group`'s buffer that rank `rank` holds. `Error::RankOutOfRange`
    /// for a rank outside the world.
    pub fn shard_range(&self, group: &Group, rank: usize) -> Result<Range<usize>> {
        let place = self.shard_index(group, rank)?;
        Ok(group.shard_numel * place..group.shard_numel * (place + 1))
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

    /// Elements of the largest trainable group: the size of one gradient slot.
    pub fn grad_slot_numel(&self) -> usize {
        self.groups
            .iter()
            .filter(|g| g.trainable)
            .map(|g| g.padded_numel)
            .max()
            .unwrap_or(0)
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
        assert_eq!(plan.unit_groups(0), Some(&[0, 2, 5][..]));
        assert_eq!(plan.unit_groups(plan.units().len()), None);
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
        assert_eq!(plan.shard_range(g, 2).unwrap(), 768..1152);
    }

    #[test]
    fn zero_world_size_is_an_error() {
        let m = model(vec![ParamSpec::new("a", &[1], DType::F32)]);
        assert!(matches!(Plan::new(&m, 0), Err(Error::ZeroWorldSize)));
    }

    #[test]
    fn a_model_changed_after_its_checks_is_checked_again_by_its_plan() {
        let mut duplicate = model(vec![ParamSpec::new("a", &[4], DType::F32)]);
        duplicate.params.push(ParamSpec::new("a", &[4], DType::F32));
        assert!(matches!(
            Plan::new(&duplicate, 2),
            Err(Error::DuplicateName {
                first: 0,
                second: 1,
                ..
            })
        ));
        let mut nan = model(vec![ParamSpec::new("w", &[4], DType::F32)]);
        nan.params[0].lr_scale = f32::NAN;
        assert!(matches!(
            Plan::new(&nan, 1),
            Err(Error::InvalidLrScale { .. })
        ));
        let mut empty = model(vec![ParamSpec::new("w", &[4], DType::F32)]);
        empty.params.clear();
        assert!(matches!(Plan::new(&empty, 1), Err(Error::EmptyModel)));
        let named = ModelSpec::new(vec![ParamSpec::new("w\0", &[4], DType::F32)]);
        assert!(matches!(named, Err(Error::NulInName { index: 0 })));
    }

    #[test]
    fn a_negative_zero_learning_rate_scale_is_zero() {
        let m = model(vec![
            ParamSpec::new("a", &[4], DType::F32).with_lr_scale(0.0),
            ParamSpec::new("b", &[4], DType::F32).with_lr_scale(-0.0),
        ]);
        assert_eq!(Plan::new(&m, 1).unwrap().groups().len(), 1);
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
