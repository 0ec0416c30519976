//! A plan as the ranks compare it and as JSON.

use super::{ALIGNMENT_BYTES, Plan, Policy};

impl Plan {
    /// Every fact of parameter `index`'s declaration and layout, as the ranks compare their plans.
    pub fn describe_param(&self, index: usize) -> String {
        match self.params.get(index) {
            None => "no parameter".to_string(),
            Some(p) => format!(
                "{:?} ({}, shape {:?}, {}, {}{}{}, lr scale {}, group {} at offset {} of {} \
                 elements{})",
                p.name,
                p.dtype,
                p.shape,
                p.unit,
                if p.trainable { "trainable" } else { "frozen" },
                if self.groups[p.group].weight_decay {
                    ""
                } else {
                    ", no weight decay"
                },
                if self.groups[p.group].tied {
                    ", tied"
                } else {
                    ""
                },
                self.groups[p.group].lr_scale,
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

    /// The plan as JSON under `policy`: world size, alignment, the limits as they bind, groups
    /// with their params, memory per rank and the buffers it counts.
    pub fn to_json(&self, policy: &Policy) -> serde_json::Value {
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
            "limits": policy.limits,
            "groups": groups,
            "memory_per_rank": policy.memory,
            "buffers": policy.buffer_report(),
        })
    }
}
