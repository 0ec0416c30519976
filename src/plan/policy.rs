//! What a configuration makes of a plan: the limits as they bind, how many gather and gradient
//! slots, which groups keep only their master, where gradients go.

use crate::config::{Accumulation, EngineConfig, ParamStorage};
use crate::types::DType;

use super::{Group, Plan};

/// How a configuration's limits act on one plan (see [`Plan::limits`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub gathered: usize,
    pub reduces_in_flight: usize,
}

impl Plan {
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
}
