//! Saving and loading this rank's part of a sharded checkpoint at a step boundary.

use std::path::Path;

use super::Engine;
use crate::backend::{Backend, Region};
use crate::checkpoint::{self, RankManifest, Section, SectionKind};
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::optim::OptimizerConfig;
use crate::types::{BufferState, DType};

/// A section of this rank's state: which buffer, and its region.
struct Part {
    group: usize,
    kind: SectionKind,
    region: Region,
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Writes this rank's state into `dir` (made if missing): each group's values in its dtype,
    /// the fp32 masters and AdamW's moments, with the optimizer's step count and settings and
    /// the plan's layout. No communication: every rank saves its own part, data first, its
    /// manifest last, each under a temporary name, flushed and renamed, so a part that a crash
    /// interrupts is never taken for a whole one. Refused (`Error::CheckpointExists`) where
    /// `dir` holds this rank's part already, and between a step's first hook and its
    /// `end_step`. Blocks until every byte is on disk.
    pub fn save(&self, dir: &Path) -> Result<()> {
        self.healthy()?;
        self.check_step_boundary("saving a checkpoint")?;
        checkpoint::prepare(dir, self.rank)?;
        let parts = self.parts();
        let mut sections = Vec::with_capacity(parts.len());
        let mut offset = 0u64;
        for p in &parts {
            let bytes = (p.region.len * p.region.dtype.size()) as u64;
            sections.push(Section {
                group: p.group,
                kind: p.kind,
                offset,
                bytes,
            });
            offset += bytes;
        }
        let manifest = RankManifest {
            format: checkpoint::FORMAT,
            rank: self.rank,
            world_size: self.plan.world_size(),
            optimizer_steps: self.optimizer_steps,
            lr: self.config.optimizer.lr(),
            weight_decay: self.config.optimizer.weight_decay(),
            optimizer: optimizer_name(&self.config.optimizer).into(),
            params: checkpoint::records(&self.plan),
            sections,
            data_bytes: 0,
            data_xxh3: String::new(),
        };
        checkpoint::write_rank(dir, manifest, |write| {
            for p in &parts {
                write(&self.read_part(p)?)?;
            }
            Ok(())
        })
    }

    /// Restores this rank's state from the checkpoint in `dir`, saved by an engine of the same
    /// plan (the same parameters, laid out at the same world size) and optimizer. Everything is
    /// checked before anything changes: every rank's manifest present and agreeing (a save
    /// that did not finish is refused), this rank's data of the manifest's length and checksum,
    /// the parameters equal to the plan's (`Error::CheckpointMismatch` lists what differs).
    /// The optimizer continues from the saved step with the saved learning rate and weight
    /// decay. Allowed at a step boundary only; blocks until the state is on the device.
    pub fn load(&mut self, dir: &Path) -> Result<()> {
        self.healthy()?;
        self.check_step_boundary("loading a checkpoint")?;
        let world = self.plan.world_size();
        let manifest = match checkpoint::read_manifest(dir, self.rank) {
            Ok(manifest) => manifest,
            // A rank past the saved world size finds no manifest of its own: rank 0's says why.
            Err(missing) => {
                return Err(match checkpoint::read_manifest(dir, 0) {
                    Ok(first) if first.world_size != world => Error::CheckpointMismatch {
                        differences: vec![saved_by(first.world_size, world)],
                    },
                    _ => missing,
                });
            }
        };
        let mut differences = Vec::new();
        if manifest.world_size != world {
            differences.push(saved_by(manifest.world_size, world));
        }
        if manifest.optimizer != optimizer_name(&self.config.optimizer) {
            differences.push(format!(
                "saved with {}, loaded with {}",
                manifest.optimizer,
                optimizer_name(&self.config.optimizer)
            ));
        }
        differences.extend(checkpoint::differences(
            &manifest.params,
            &checkpoint::records(&self.plan),
        ));
        if !differences.is_empty() {
            return Err(Error::CheckpointMismatch { differences });
        }
        for rank in (0..world).filter(|&r| r != self.rank) {
            let other = checkpoint::read_manifest(dir, rank)?;
            if (other.world_size, other.optimizer_steps) != (world, manifest.optimizer_steps) {
                return Err(Error::CheckpointUnreadable {
                    path: checkpoint::manifest_path(dir, rank).display().to_string(),
                    reason: format!(
                        "of another save: {} ranks at step {}, rank {}'s says {} at {}",
                        other.world_size,
                        other.optimizer_steps,
                        self.rank,
                        world,
                        manifest.optimizer_steps
                    ),
                });
            }
        }
        let data = checkpoint::read_data(dir, &manifest)?;
        let parts = self.parts();
        let found: Vec<&Section> = parts
            .iter()
            .map(|p| {
                manifest
                    .sections
                    .iter()
                    .find(|s| (s.group, s.kind) == (p.group, p.kind))
                    .filter(|s| s.bytes == (p.region.len * p.region.dtype.size()) as u64)
                    .ok_or_else(|| Error::CheckpointUnreadable {
                        path: checkpoint::manifest_path(dir, self.rank)
                            .display()
                            .to_string(),
                        reason: format!("no {:?} section of group {} of its size", p.kind, p.group),
                    })
            })
            .collect::<Result<_>>()?;
        let optimizer = self
            .config
            .optimizer
            .with_lr_and_decay(manifest.lr, manifest.weight_decay)?;
        self.effects(|e| {
            for (p, s) in parts.iter().zip(&found) {
                let start = s.offset as usize;
                let bytes = &data[start..start + s.bytes as usize];
                e.write_part(p, bytes)?;
            }
            Ok(())
        })?;
        self.config.optimizer = optimizer;
        self.optimizer_steps = manifest.optimizer_steps;
        // The masters were loaded: nothing is widened from the shards at the next step.
        self.master_stale.fill(false);
        Ok(())
    }

    /// Every section of this rank's state, in group order.
    fn parts(&self) -> Vec<Part> {
        let mut parts = Vec::new();
        for g in self.plan.groups() {
            let (group, n) = (g.index, g.shard_numel);
            parts.push(Part {
                group,
                kind: SectionKind::Values,
                region: Region::new(0, n, g.dtype),
            });
            if !g.trainable {
                continue;
            }
            if self.masters[group].is_some() {
                parts.push(Part {
                    group,
                    kind: SectionKind::Master,
                    region: Region::new(0, n, DType::F32),
                });
            }
            if self.moments[group].is_some() {
                for kind in [SectionKind::FirstMoment, SectionKind::SecondMoment] {
                    parts.push(Part {
                        group,
                        kind,
                        region: Region::new(0, n, DType::F32),
                    });
                }
            }
        }
        parts
    }

    fn read_part(&self, p: &Part) -> Result<Vec<u8>> {
        if p.kind == SectionKind::Values {
            return self.param_shard(p.group);
        }
        let mut out = crate::fallible::filled(
            p.region.len * p.region.dtype.size(),
            0u8,
            "a checkpoint section",
        )?;
        let buffer = self.state_buffer(p)?;
        self.observe(self.backend.download(buffer, p.region, &mut out))?;
        Ok(out)
    }

    fn write_part(&mut self, p: &Part, bytes: &[u8]) -> Result<()> {
        let g = p.group;
        let master_only = self.plan.master_only(&self.config, &self.plan.groups()[g]);
        let missing = Error::GroupOutOfRange {
            group: g,
            count: self.plan.groups().len(),
        };
        let buffer = match p.kind {
            // A master-only group's values are its master rounded: the master section has them.
            SectionKind::Values if master_only => return Ok(()),
            SectionKind::Values => &mut self.shards[g],
            SectionKind::Master => self.masters[g].as_mut().ok_or(missing)?,
            SectionKind::FirstMoment => {
                self.moments[g].as_mut().map(|m| &mut m.0).ok_or(missing)?
            }
            SectionKind::SecondMoment => {
                self.moments[g].as_mut().map(|m| &mut m.1).ok_or(missing)?
            }
        };
        self.backend.upload(buffer, p.region, bytes)
    }

    fn state_buffer(&self, p: &Part) -> Result<&B::Buffer> {
        let missing = Error::GroupOutOfRange {
            group: p.group,
            count: self.plan.groups().len(),
        };
        match p.kind {
            SectionKind::Values => Ok(&self.shards[p.group]),
            SectionKind::Master => self.masters[p.group].as_ref().ok_or(missing),
            SectionKind::FirstMoment => self.moments[p.group].as_ref().map(|m| &m.0).ok_or(missing),
            SectionKind::SecondMoment => {
                self.moments[p.group].as_ref().map(|m| &m.1).ok_or(missing)
            }
        }
    }

    /// Refuses `action` between a step's first hook or gradient and its `end_step`.
    fn check_step_boundary(&self, action: &'static str) -> Result<()> {
        self.check_not_stepped(action)?;
        let open = self
            .forward_open
            .iter()
            .chain(&self.backward_open)
            .any(|&o| o);
        let gathered =
            (0..self.plan.groups().len()).any(|g| self.gathers.state(g) != BufferState::Freed);
        if open || gathered || self.grads.pending() || self.grads.synced() {
            return Err(Error::MidStep { action });
        }
        Ok(())
    }
}

fn optimizer_name(optimizer: &OptimizerConfig) -> &'static str {
    match optimizer {
        OptimizerConfig::AdamW { .. } => "adamw",
        OptimizerConfig::Sgd { .. } => "sgd",
    }
}

fn saved_by(saved: usize, loaded: usize) -> String {
    format!("saved by {saved} ranks, loaded by {loaded} (resharding is not supported yet)")
}
