//! A rank's state as a checkpoint holds it: its sections ("parts": each group's values
//! or fp32 master, AdamW's moments) and the buffers they are, shared by the save (`save`) and
//! the load (`load`); and the step boundary both keep to.

use super::Engine;
use super::step::GroupOptimizerState;
use crate::backend::{Backend, Region};
use crate::checkpoint::SectionKind;
use crate::comm::Communicator;
use crate::config::EngineConfig;
use crate::error::{Error, Result};
use crate::optim::OptimizerConfig;
use crate::plan::Plan;
use crate::types::DType;

/// The bytes of `part`.
pub(super) fn bytes_of(part: &Part) -> usize {
    part.region.len * part.region.dtype.size()
}

/// A section of this rank's state: which buffer, and its region.
pub(super) struct Part {
    pub(super) group: usize,
    pub(super) kind: SectionKind,
    pub(super) region: Region,
}

/// Every section of a rank's state under `plan` and `config`, in group order: each group's
/// values (a trainable bf16/f16 group's fp32 master instead, which they are rounded from), then
/// AdamW's moments of a trainable group.
fn parts_of(plan: &Plan, config: &EngineConfig) -> Vec<Part> {
    let mut parts = Vec::new();
    for g in plan.groups() {
        let (group, n) = (g.index, g.shard_numel);
        let has_master = g.trainable && g.dtype != DType::F32;
        parts.push(match has_master {
            true => Part {
                group,
                kind: SectionKind::Master,
                region: Region::new(0, n, DType::F32),
            },
            false => Part {
                group,
                kind: SectionKind::Values,
                region: Region::new(0, n, g.dtype),
            },
        });
        if g.trainable && config.optimizer.has_moments() {
            for kind in [SectionKind::FirstMoment, SectionKind::SecondMoment] {
                parts.push(Part {
                    group,
                    kind,
                    region: Region::new(0, n, config.moment_dtype),
                });
            }
        }
    }
    parts
}

/// The bytes of a rank's state under `plan` and `config`: what a save writes, and what
/// [`EngineConfig::save_staging`] makes ahead.
pub(super) fn state_bytes(plan: &Plan, config: &EngineConfig) -> usize {
    parts_of(plan, config).iter().map(bytes_of).sum()
}

/// Part `p`'s device buffer among a rank's shards and optimizer state.
pub(super) fn state_buffer_mut<'a, B: Backend>(
    (shards, optimizer): (
        &'a mut [B::Buffer],
        &'a mut [GroupOptimizerState<B::Buffer>],
    ),
    p: &Part,
) -> Result<&'a mut B::Buffer> {
    let (g, count) = (p.group, shards.len());
    let missing = Error::GroupOutOfRange { group: g, count };
    if p.kind == SectionKind::Values {
        return shards.get_mut(g).ok_or(missing);
    }
    let state = optimizer.get_mut(g).ok_or_else(|| missing.clone())?;
    match (p.kind, &mut state.master, &mut state.moments) {
        (SectionKind::Master, Some(master), _) => Ok(master),
        (SectionKind::FirstMoment, _, Some((first, _))) => Ok(first),
        (SectionKind::SecondMoment, _, Some((_, second))) => Ok(second),
        _ => Err(missing),
    }
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Every section of this rank's state, in group order.
    pub(super) fn parts(&self) -> Vec<Part> {
        parts_of(&self.plan, &self.config)
    }

    pub(super) fn state_buffer(&self, p: &Part) -> Result<&B::Buffer> {
        let missing = Error::GroupOutOfRange {
            group: p.group,
            count: self.plan.groups().len(),
        };
        let state = &self.optimizer.groups[p.group];
        match (p.kind, &state.master, &state.moments) {
            (SectionKind::Values, _, _) => Ok(&self.param_shards[p.group]),
            (SectionKind::Master, Some(master), _) => Ok(master),
            (SectionKind::FirstMoment, _, Some((first, _))) => Ok(first),
            (SectionKind::SecondMoment, _, Some((_, second))) => Ok(second),
            _ => Err(missing),
        }
    }

    /// Refuses `action` between a step's first hook or gradient and its `end_step`, and during
    /// a capture.
    pub(super) fn check_step_boundary(&self, action: &'static str) -> Result<()> {
        self.check_not_stepped(action)?;
        if !self.at_step_boundary() {
            return Err(Error::MidStep { action });
        }
        self.check_not_capturing(action)
    }

    /// Whether no step is under way: no hook open, nothing gathered, no gradient taken.
    pub(super) fn at_step_boundary(&self) -> bool {
        let open = !self.open.forward.is_empty() || !self.open.backward.is_empty();
        !(open
            || self.optimizer.stepped
            || self.gathering.machine.gathered() > 0
            || self.reducing.pipeline.pending()
            || self.reducing.pipeline.synced())
    }
}

pub(super) fn optimizer_name(optimizer: &OptimizerConfig) -> &'static str {
    match optimizer {
        OptimizerConfig::AdamW { .. } => "adamw",
        OptimizerConfig::Sgd { .. } => "sgd",
    }
}
