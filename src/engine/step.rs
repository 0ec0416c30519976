//! The end of a step's backward passes, the optimizer, the end of a step, and the loads and reads
//! of the shards between steps.

use super::Engine;
use super::norm::{Clip, ShardSum, sum_over_grad_shards};
use crate::backend::{Backend, Input, Moments, OptimizerShard, Region, Source, StepUpdate};
use crate::comm::Communicator;
use crate::config::GradShardMemory;
use crate::dtype::convert;
use crate::error::{Error, Result};
use crate::optim::{GroupUpdate, MomentStorage};
use crate::plan::{NONFINITE_COUNT_BYTES, SKIPPED_STEPS_BYTES};
use crate::trace::SpanKind;
use crate::types::{DType, ParamId, Stream};

/// What the optimizer owns: each group's masters and moments, the steps taken, and this step's
/// decisions.
pub(super) struct OptimizerState<Buf> {
    pub(super) groups: Vec<GroupOptimizerState<Buf>>,
    /// Optimizer steps taken (AdamW's bias correction counts them).
    pub(super) steps: u64,
    /// Whether this step's optimizer step ran.
    pub(super) stepped: bool,
    /// Whether this step's updates began inside its backward
    /// ([`crate::EngineConfig::step_in_backward`]).
    pub(super) updating: bool,
    /// How this step's optimizer clips its gradients, if it does.
    pub(super) clip: Option<Clip>,
    /// Whether the device decides to skip this step ([`Engine::skip_nonfinite_on_device`]).
    pub(super) skip_nonfinite: bool,
    /// Whether this step's norm parts are gathered on the device.
    pub(super) parts_on_device: bool,
    /// Skip decisions queued on the device since the host last read the steps skipped there
    /// ([`Engine::read_device_skips`]): while any is, each step's values are counted out of
    /// them on the device.
    pub(super) device_decisions: u64,
    /// Where the step's checks of its gradients add up, and the step's values its updates read;
    /// `None` where nothing trains.
    pub(super) checks: Option<StepChecks<Buf>>,
}

impl<Buf> OptimizerState<Buf> {
    /// Counts an optimizer step. The count can come from a checkpoint: at its largest it stays
    /// there, as a replay's does, rather than wrapping to a step 0 (whose bias correction is 0).
    fn count_step(&mut self) {
        self.steps = self.steps.saturating_add(1);
    }
}

/// The buffers of the plan's [`crate::plan::StepScratch`].
pub(super) struct StepChecks<Buf> {
    /// Where [`Engine::grad_norm`] sums this rank's part.
    pub(super) norm_part: Buf,
    /// Every rank's part, where [`Engine::clip_grad_norm_on_device`] gathers them above world
    /// size 1.
    pub(super) norm_parts: Buf,
    /// Where [`Engine::nonfinite_grads`] counts.
    pub(super) nonfinite_count: Buf,
    /// The [`crate::optim::StepValues`] the step's updates read.
    pub(super) step_values: Buf,
    /// The steps skipped on the device since the host last read them (a u64).
    pub(super) skipped_steps: Buf,
}

impl<Buf> StepChecks<Buf> {
    /// The norm parts gathered on the device for `ranks` ranks (this rank's alone at world size
    /// 1), the count of steps skipped there, and the step's values.
    fn gathered(&mut self, ranks: usize) -> (&Buf, &mut Buf, &mut Buf) {
        let parts = match ranks {
            1 => &self.norm_part,
            _ => &self.norm_parts,
        };
        (parts, &mut self.skipped_steps, &mut self.step_values)
    }
}

/// One group's optimizer state.
pub(super) struct GroupOptimizerState<Buf> {
    /// The fp32 master of a trainable bf16 or f16 group.
    pub(super) master: Option<Buf>,
    /// AdamW's first and second moments.
    pub(super) moments: Option<(Buf, Buf)>,
}

impl<Buf> OptimizerState<Buf> {
    pub(super) fn new(
        groups: Vec<GroupOptimizerState<Buf>>,
        checks: Option<StepChecks<Buf>>,
    ) -> Self {
        OptimizerState {
            groups,
            steps: 0,
            stepped: false,
            updating: false,
            clip: None,
            skip_nonfinite: false,
            parts_on_device: false,
            device_decisions: 0,
            checks,
        }
    }
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Ends the backward passes of this step: ends any backward still open, reduces every group
    /// (those whose last gradient never came too), and orders compute after the reductions. On a
    /// GPU it does not block the host: later compute-stream work waits for the reduce stream
    /// (with [`crate::EngineConfig::verify_collectives`] it blocks, to compare the ranks').
    /// Refused once the optimizer stepped (`Error::OptimizerStepped`).
    pub fn finish_grad_sync(&mut self) -> Result<()> {
        let _range = crate::nvtx::range("finish_grad_sync", "");
        self.healthy()?;
        self.check_not_stepped("syncing gradients")?;
        self.check_captured_step_open()?;
        self.check_no_open_slot()?;
        self.check_no_forward_open()?;
        self.effects(|e| {
            while let Some(u) = e.open.backward.pop_first() {
                e.release_unit(u)?;
            }
            e.apply_decided(crate::grads::GradPipeline::finish)?;
            if e.config.verify_collectives {
                e.verify_collectives()?;
            }
            let reduced = e.backend.record(Stream::Reduce)?;
            e.backend.wait(Stream::Compute, &reduced)
        })
    }

    /// Updates every trainable shard from its gradient shard with the configured optimizer, once
    /// per step, after [`Engine::finish_grad_sync`], with no unit's forward or backward open
    /// (`Error::ForwardStillOpen`, `Error::BackwardStillOpen`: the update would write shards an
    /// open unit reads).
    pub fn optimizer_step(&mut self) -> Result<()> {
        let _range = crate::nvtx::range("optimizer_step", "");
        self.healthy()?;
        self.check_captured_step_open()?;
        if !self.reducing.pipeline.synced() {
            return Err(Error::GradsNotSynced {
                action: "the optimizer step",
            });
        }
        if self.optimizer.stepped {
            return Err(Error::OptimizerAlreadyStepped);
        }
        // The update would write shards an open unit reads, and no later call could close it.
        self.check_no_forward_open()?;
        self.check_no_backward_open()?;
        self.effects(Engine::step_shards)
    }

    /// `Error::ForwardStillOpen` naming the first unit whose forward is open.
    fn check_no_forward_open(&self) -> Result<()> {
        match self.open.forward.first() {
            Some(&u) => Err(Error::ForwardStillOpen {
                unit: self.plan.units()[u],
            }),
            None => Ok(()),
        }
    }

    /// `Error::BackwardStillOpen` naming the first unit whose backward is open.
    fn check_no_backward_open(&self) -> Result<()> {
        match self.open.backward.first() {
            Some(&u) => Err(Error::BackwardStillOpen {
                unit: self.plan.units()[u],
            }),
            None => Ok(()),
        }
    }

    fn step_shards(&mut self) -> Result<()> {
        let start = self.mark(Stream::Compute)?;
        if self.config.step_in_backward {
            // Every group was updated as its gradient became final; a step that trained nothing
            // counts as the ordinary one does.
            if !self.optimizer.updating {
                self.optimizer.count_step();
            }
        } else {
            self.order_after_gathers()?;
            self.optimizer.count_step();
            let clip = self.optimizer.clip.take();
            let grad_scale = match clip {
                Some(Clip::OnHost { coefficient }) => coefficient,
                _ => 1.0,
            };
            self.write_step_values(grad_scale)?;
            // A captured step counts out the skips before each replay, whatever the count when
            // it was captured: its replays follow skips of their own or of other steps.
            if self.optimizer.device_decisions > 0 || self.capture.is_some() {
                self.count_out_device_skips()?;
            }
            if let Some(Clip::OnDevice { max_norm }) = clip {
                self.clip_on_device(max_norm)?;
            }
            if self.optimizer.skip_nonfinite {
                self.decide_skip_on_device()?;
            }
            for g in 0..self.plan.groups().len() {
                if self.plan.groups()[g].trainable {
                    self.update_group(g)?;
                }
            }
        }
        self.push_span(Stream::Compute, SpanKind::Optimizer, start)?;
        self.gathering.shards_updated = Some(self.backend.record(Stream::Compute)?);
        self.optimizer.stepped = true;
        Ok(())
    }

    /// Orders the compute stream after the gathers in flight: a gather still in flight (a
    /// prefetch no hook used) reads the shards (or masters) the optimizer writes.
    fn order_after_gathers(&mut self) -> Result<()> {
        if !self.gathering.slots.is_empty() {
            let gathered = self.backend.record(Stream::Gather)?;
            self.backend.wait(Stream::Compute, &gathered)?;
        }
        Ok(())
    }

    /// Writes the step's [`crate::optim::StepValues`] for its updates, at the step's count
    /// ([`OptimizerState::steps`]) and the engine's learning rate and weight decay now, every
    /// gradient multiplied by `grad_scale`: on the compute stream, after the last step's updates
    /// that read them.
    pub(super) fn write_step_values(&mut self, grad_scale: f32) -> Result<()> {
        if self.capture.is_some() {
            // A launch would bake them into the captured step: each replay writes its own.
            return Ok(());
        }
        let values = (self.config.optimizer).step_values(self.optimizer.steps, grad_scale);
        let Some(checks) = self.optimizer.checks.as_mut() else {
            // Nothing trains: no update reads them.
            return Ok(());
        };
        // SAFETY: the values are only ever used on the compute stream.
        unsafe {
            (self.backend).write_step_values(Stream::Compute, &mut checks.step_values, &values)
        }
    }

    /// Sets the step values' clipping coefficient of `max_norm` from the norm parts
    /// [`Engine::clip_grad_norm_on_device`] gathered, on the compute stream.
    fn clip_on_device(&mut self, max_norm: f32) -> Result<()> {
        let ranks = self.plan.world_size();
        let Some(checks) = self.optimizer.checks.as_mut() else {
            return Ok(());
        };
        let (parts, _, step_values) = checks.gathered(ranks);
        // SAFETY: the parts and the values are used on the compute stream only, but for the
        // gather of the parts, which the compute stream waited for.
        unsafe {
            (self.backend).clip_step_values(Stream::Compute, (parts, ranks), max_norm, step_values)
        }
    }

    /// Makes the step's values, written by the host for its count of updates, those of the
    /// count less the steps skipped on the device so far, on the compute stream.
    fn count_out_device_skips(&mut self) -> Result<()> {
        let Some(checks) = self.optimizer.checks.as_mut() else {
            return Ok(());
        };
        let StepChecks {
            skipped_steps,
            step_values,
            ..
        } = checks;
        // SAFETY: the count and the values are used on the compute stream only.
        unsafe { (self.backend).correct_step_values(Stream::Compute, skipped_steps, step_values) }
    }

    /// Sets the step values' skip decision from the norm parts gathered on the device, and
    /// counts a skipped step there, on the compute stream.
    fn decide_skip_on_device(&mut self) -> Result<()> {
        let ranks = self.plan.world_size();
        let Some(checks) = self.optimizer.checks.as_mut() else {
            return Ok(());
        };
        let (parts, skipped, step_values) = checks.gathered(ranks);
        // SAFETY: the parts, the count and the values are used on the compute stream only, but
        // for the gather of the parts, which the compute stream waited for.
        unsafe {
            (self.backend).skip_nonfinite_step(
                Stream::Compute,
                (parts, ranks),
                skipped,
                step_values,
            )
        }?;
        self.optimizer.device_decisions += 1;
        Ok(())
    }

    /// Updates group `i`'s shard from its gradient shard with the values
    /// [`Engine::write_step_values`] wrote for the step.
    fn update_group(&mut self, i: usize) -> Result<()> {
        let g = &self.plan.groups()[i];
        let group = GroupUpdate {
            lr_scale: g.lr_scale,
            decay: g.weight_decay,
        };
        let count = self.reducing.groups.len();
        let missing = Error::GroupOutOfRange { group: i, count };
        let values = match self.optimizer.checks.as_ref() {
            Some(checks) => &checks.step_values,
            // A trainable group has them: they are made when anything trains.
            None => return Err(missing),
        };
        // Every trainable group has its shard once its gradient is final (a group without
        // gradients got a zeroed one).
        let grad = self.reducing.groups[i].shard.as_ref().ok_or(missing)?;
        let master_only = self.policy.master_only(g.index);
        let first_index = (self.plan.shard_index(g, self.rank)? * g.shard_numel) as u64;
        // A master-only group steps its master as an f32 parameter that is its own master.
        let GroupOptimizerState { master, moments } = &mut self.optimizer.groups[i];
        let (param, dtype, master) = match (master_only, master.as_mut()) {
            (true, Some(master)) => (master, DType::F32, None),
            (_, master) => (&mut self.param_shards[i], g.dtype, master),
        };
        let shard = OptimizerShard {
            param,
            dtype,
            numel: g.shard_numel,
            grad,
            master,
            moments: moments.as_mut().map(|(first, second)| Moments {
                first,
                second,
                storage: match self.config.moment_dtype {
                    DType::Bf16 => MomentStorage::Bf16Stochastic {
                        group: i as u32,
                        first_index,
                    },
                    _ => MomentStorage::F32,
                },
            }),
        };
        // SAFETY: on the compute stream, which waited for every reduction into the gradient
        // shard (`finish_grad_sync`, or the retire of the group's last reduction in the
        // backward) and for every gather reading the parameter shards or masters
        // (`order_after_gathers`); the moments are only ever used on the compute stream. The
        // step's next gather waits for this one (`shards_updated`), and the next step's first
        // reductions are queued after it with compute's event.
        let update = StepUpdate {
            kind: self.config.optimizer.kind(),
            values,
            group,
        };
        unsafe { self.backend.optimizer_step(Stream::Compute, update, shard) }
    }

    /// Updates group `group` inside the backward ([`crate::EngineConfig::step_in_backward`]): its
    /// gradient shard is final. The step's first such update counts the step; a per-step
    /// gradient shard is freed right after its update.
    pub(super) fn update_in_backward(&mut self, group: usize) -> Result<()> {
        self.order_after_gathers()?;
        let start = self.mark(Stream::Compute)?;
        if !std::mem::replace(&mut self.optimizer.updating, true) {
            self.optimizer.count_step();
            self.write_step_values(1.0)?;
        }
        self.update_group(group)?;
        self.push_span(Stream::Compute, SpanKind::Optimizer, start)?;
        // The next step's first gather waits for this update too, whether or not
        // `optimizer_step` ends the updates.
        self.gathering.shards_updated = Some(self.backend.record(Stream::Compute)?);
        if self.config.grad_shard_memory == GradShardMemory::PerStep {
            let shard = self.reducing.groups[group].shard.take();
            // SAFETY: the compute stream used the shard last (the update above), after waiting
            // for every other stream's use of it: the reduction that wrote it (the retire of
            // its last reduction, or at world size 1 none: the gradients were written on
            // compute).
            unsafe { self.backend.free_after_compute(shard) }?;
        }
        Ok(())
    }

    /// Ends the step: every gathered buffer is freed (its contents are stale once the shards
    /// change) and the next step's first reductions overwrite the gradient shards.
    pub fn end_step(&mut self) -> Result<()> {
        let _range = crate::nvtx::range("end_step", "");
        self.healthy()?;
        self.check_captured_step_open()?;
        self.check_no_forward_open()?;
        self.check_no_backward_open()?;
        if self.reducing.pipeline.pending() {
            return Err(Error::GradsNotSynced {
                action: "ending the step",
            });
        }
        let mut fx = std::mem::take(&mut self.gathering.effects);
        fx.clear();
        // Refused with nothing changed while a buffer is in use.
        let decided = self.gathering.machine.reset(&mut fx);
        let result = decided.and_then(|()| {
            self.effects(|e| {
                e.apply_gather_effects(&fx)?;
                // A step whose groups were updated in its backward was not skipped.
                if e.reducing.pipeline.synced() && !e.optimizer.stepped && !e.optimizer.updating {
                    e.counters.skipped_steps += 1;
                }
                if e.config.grad_shard_memory == GradShardMemory::PerStep {
                    // Freed after the optimizer's work was queued: the backend frees them in
                    // stream order.
                    let shards = e.reducing.groups.iter_mut().filter_map(|g| g.shard.take());
                    e.backend.free(shards)?;
                }
                e.gathering.schedule.end_step();
                e.reducing.pipeline.end_step();
                e.optimizer.stepped = false;
                e.optimizer.updating = false;
                e.optimizer.clip = None;
                e.optimizer.skip_nonfinite = false;
                e.optimizer.parts_on_device = false;
                e.counters.steps += 1;
                e.collectives.in_step = 0;
                e.collectives.issued.clear();
                Ok(())
            })
        });
        self.gathering.effects = fx;
        result
    }

    /// Sets the learning rate of the next optimizer steps (a schedule calls it before each one);
    /// every parameter's is this times its `lr_scale`. Every rank must set the same.
    pub fn set_lr(&mut self, lr: f32) -> Result<()> {
        self.healthy()?;
        self.check_before_updates("changing the learning rate once the step's gradients began")?;
        let decay = self.config.optimizer.weight_decay();
        self.config.optimizer = self.config.optimizer.with_lr_and_decay(lr, decay)?;
        Ok(())
    }

    /// Sets the weight decay of the next optimizer steps, for the parameters that take it.
    pub fn set_weight_decay(&mut self, weight_decay: f32) -> Result<()> {
        self.healthy()?;
        self.check_before_updates("changing the weight decay once the step's gradients began")?;
        let lr = self.config.optimizer.lr();
        self.config.optimizer = self.config.optimizer.with_lr_and_decay(lr, weight_decay)?;
        Ok(())
    }

    /// Writes `data` (the whole parameter, in its dtype, on the host) into this rank's shard and
    /// its fp32 master (the value widened, as the optimizer's next step reads it): only the part
    /// the rank holds is kept, and no other parameter's state changes. Every rank loads every
    /// parameter. Allowed between steps (`Error::MidStep` otherwise).
    pub fn load_param(&mut self, param: ParamId, data: Input<'_>) -> Result<()> {
        self.healthy()?;
        self.check_step_boundary("loading a parameter")?;
        let layout = self.plan.param(param)?;
        let Source::Host { bytes, dtype } = data.0 else {
            return Err(Error::Unsupported {
                backend: self.backend.name(),
                what: "device memory as a parameter's initial value",
            });
        };
        if dtype != layout.dtype {
            return Err(Error::DtypeMismatch {
                name: layout.name.clone(),
                param: layout.dtype,
                requested: dtype,
            });
        }
        if bytes.len() % dtype.size() != 0 {
            return Err(Error::PartialElement {
                name: layout.name.clone(),
                bytes: bytes.len(),
                dtype,
            });
        }
        if data.numel() != layout.numel {
            return Err(Error::DataLength {
                name: layout.name.clone(),
                expected: layout.numel,
                got: data.numel(),
            });
        }
        let held = self.held_elements(param)?;
        let size = dtype.size();
        self.store_held(
            param,
            &bytes[held.start * size..held.end * size],
            &mut Vec::new(),
        )
    }

    /// The elements of parameter `param` that this rank's shard holds (empty when none).
    pub(super) fn held_elements(&self, param: ParamId) -> Result<std::ops::Range<usize>> {
        let layout = self.plan.param(param)?;
        let shard = self
            .plan
            .shard_range(&self.plan.groups()[layout.group], self.rank)?;
        let start = layout.offset.max(shard.start);
        let end = (layout.offset + layout.numel).min(shard.end);
        match start < end {
            true => Ok(start - layout.offset..end - layout.offset),
            false => Ok(0..0),
        }
    }

    /// Bytes of the fp32 master of the elements of `param` that this rank holds: 0 where its
    /// group has no master.
    pub(super) fn held_master_bytes(&self, param: ParamId) -> Result<usize> {
        let group = self.plan.param(param)?.group;
        match self.optimizer.groups[group].master.is_some() {
            true => Ok(self.held_elements(param)?.len() * DType::F32.size()),
            false => Ok(0),
        }
    }

    /// Writes `values` (the elements [`Engine::held_elements`] names, in the parameter's dtype)
    /// into this rank's shard and master; between steps, where no group is gathered. `wide`
    /// takes the values widened for the master, growing first where it is shorter than
    /// [`Engine::held_master_bytes`]: too little memory for that changes nothing, and where it
    /// has the room only the device can fail the call, which poisons the engine.
    pub(super) fn store_held(
        &mut self,
        param: ParamId,
        values: &[u8],
        wide: &mut Vec<u8>,
    ) -> Result<()> {
        let layout = self.plan.param(param)?;
        let held = self.held_elements(param)?;
        if held.is_empty() {
            return Ok(());
        }
        let (index, dtype) = (layout.group, layout.dtype);
        let group = &self.plan.groups()[index];
        let at = layout.offset + held.start - self.plan.shard_range(group, self.rank)?.start;
        let master_only = self.policy.master_only(group.index);
        // Exactly what the shard holds, widened: only this parameter's range, so the fp32
        // progress of the group's other parameters stays.
        let wide = match self.optimizer.groups[index].master.is_some() {
            true => {
                crate::fallible::refill(wide, held.len() * DType::F32.size(), "a master")?;
                convert((wide.as_mut_slice(), DType::F32), (values, dtype));
                Some(wide.as_slice())
            }
            false => None,
        };
        self.effects(|e| {
            if !master_only {
                let region = Region::new(at, held.len(), dtype);
                e.backend
                    .upload(&mut e.param_shards[index], region, values)?;
            }
            if let (Some(master), Some(wide)) = (e.optimizer.groups[index].master.as_mut(), wide) {
                e.backend
                    .upload(master, Region::new(at, held.len(), DType::F32), wide)?;
            }
            Ok(())
        })
    }

    /// The number of infinite or NaN values in this rank's gradient shards as synced this step
    /// (a rank's shard holds the reduced gradient of its part of every group, so a non-finite
    /// gradient on any rank shows on the rank that holds its element). Allowed from
    /// [`Engine::finish_grad_sync`] to [`Engine::end_step`]; blocks the host for the count.
    pub fn nonfinite_grads(&mut self) -> Result<u64> {
        self.healthy()?;
        self.check_not_capturing("counting non-finite gradients, a host read of the device")?;
        self.refuse_in_backward_updates("counting non-finite gradients")?;
        if !self.reducing.pipeline.synced() {
            return Err(Error::GradsNotSynced {
                action: "counting non-finite gradients",
            });
        }
        self.effects(|e| {
            // Nothing trains: no gradient, none non-finite.
            let Some(checks) = e.optimizer.checks.as_mut() else {
                return Ok(0);
            };
            let mut bytes = [0u8; NONFINITE_COUNT_BYTES];
            let (groups, counter) = (&e.reducing.groups, &mut checks.nonfinite_count);
            let sum = ShardSum::NonFinite;
            sum_over_grad_shards(&e.backend, &e.plan, groups, counter, sum, &mut bytes)?;
            Ok(u64::from_le_bytes(bytes))
        })
    }

    /// The steps the device skipped ([`Engine::skip_nonfinite_on_device`]) since the host last
    /// read them, now counted on the host: the optimizer's steps (AdamW's bias correction, the
    /// step a checkpoint saves) less them, [`crate::Counters::skipped_steps`] plus them. Between
    /// steps, not during a capture; blocks the host for the count where a decision was queued
    /// since the last read (0 at once otherwise). Every rank reads the same count: the ranks
    /// decide alike.
    pub fn read_device_skips(&mut self) -> Result<u64> {
        let action = "reading the steps skipped on the device";
        self.healthy()?;
        self.check_step_boundary(action)?;
        self.effects(|e| {
            let skipped = e.take_device_skips()?;
            e.optimizer.steps = e.optimizer.steps.saturating_sub(skipped);
            Ok(skipped)
        })
    }

    /// The steps skipped on the device since the host last read them (a host wait where a
    /// decision was queued since), added to [`crate::Counters::skipped_steps`], the device's
    /// count zeroed on the compute stream: the host's counts hold every skip from here.
    pub(super) fn take_device_skips(&mut self) -> Result<u64> {
        if std::mem::take(&mut self.optimizer.device_decisions) == 0 {
            return Ok(0);
        }
        let Some(checks) = self.optimizer.checks.as_mut() else {
            return Ok(0);
        };
        let mut bytes = [0u8; SKIPPED_STEPS_BYTES];
        let region = Region::new(0, SKIPPED_STEPS_BYTES / 4, DType::F32);
        self.backend
            .download(&checks.skipped_steps, region, &mut bytes)?;
        // SAFETY: the count is used on the compute stream only.
        unsafe { (self.backend).zero(Stream::Compute, &mut checks.skipped_steps, region) }?;
        let skipped = u64::from_le_bytes(bytes);
        self.counters.skipped_steps = self.counters.skipped_steps.saturating_add(skipped);
        Ok(skipped)
    }

    /// This rank's parameter shard of `group`, as bytes in the group's dtype (of a master-only
    /// group, its master rounded to the dtype: what a gather casts). Blocks until the copy is
    /// done.
    pub fn param_shard(&self, group: usize) -> Result<Vec<u8>> {
        self.healthy()?;
        self.check_not_capturing("reading a parameter shard")?;
        let g = self.plan.group(group)?;
        let region = Region::new(0, g.shard_numel, g.dtype);
        let mut out = crate::fallible::filled(region.len * g.dtype.size(), 0u8, "a shard's copy")?;
        match self.optimizer.groups[group].master.as_ref() {
            Some(master) if self.policy.master_only(g.index) => {
                let f32s = Region::new(0, g.shard_numel, DType::F32);
                let mut wide = crate::fallible::filled(g.shard_numel * 4, 0u8, "a master's copy")?;
                self.observe(self.backend.download(master, f32s, &mut wide))?;
                convert((&mut out, g.dtype), (&wide, DType::F32));
            }
            _ => self.observe(self.backend.download(
                &self.param_shards[group],
                region,
                &mut out,
            ))?,
        }
        Ok(out)
    }

    /// This rank's fp32 gradient shard of `group`, once the step's gradients are synced (or
    /// between steps; zeros for a frozen group, which takes none, and where a per-step shard is
    /// not made, or was freed: at the step's end, or after its update in the backward). Refused
    /// while gradients are arriving: part of the shard is not written yet.
    pub fn grad_shard(&self, group: usize) -> Result<Vec<f32>> {
        self.healthy()?;
        self.check_not_capturing("reading a gradient shard")?;
        if self.reducing.pipeline.pending() {
            return Err(Error::GradsNotSynced {
                action: "reading a gradient shard",
            });
        }
        let g = self.plan.group(group)?;
        let mut out = crate::fallible::filled(g.shard_numel, 0f32, "a gradient shard's copy")?;
        if let Some(shard) = &self.reducing.groups[group].shard {
            let region = Region::new(0, g.shard_numel, DType::F32);
            let copied = self
                .backend
                .download(shard, region, bytemuck::cast_slice_mut(&mut out));
            self.observe(copied)?;
        }
        Ok(out)
    }
}
