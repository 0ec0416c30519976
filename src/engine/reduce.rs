//! Gradient slots, the places gradients are written into, and the reductions into the shards.

use std::sync::Arc;

use super::Engine;
use crate::backend::{Backend, Input, Region, Source};
use crate::comm::{Communicator, Fingerprint, Purpose};
use crate::error::{Error, Result};
use crate::grads::{GradEffect, GradPipeline, GradTarget};
use crate::schedule::Phase;
use crate::trace::SpanKind;
use crate::types::{DType, ParamId, Stream, Unit};

/// What reducing owns: the reduction pipeline, each group's gradient buffers and the gradient
/// slots.
pub(super) struct Reducing<Buf, E> {
    pub(super) pipeline: GradPipeline,
    pub(super) groups: Vec<GroupGrads<Buf>>,
    pub(super) slots: Vec<GradSlot<Buf, E>>,
    /// The parameter whose place in a slot the caller has open ([`Engine::open_grad_slot`]).
    pub(super) open_slot: Option<ParamId>,
    /// Reused between calls, so that a gradient allocates nothing.
    pub(super) effects: Vec<GradEffect>,
}

impl<Buf, E> Reducing<Buf, E> {
    /// The buffer a reduction of `group` reads (its slot or accumulator at `place`) and the
    /// gradient shard it writes.
    fn source_and_shard(
        &mut self,
        group: usize,
        place: GradTarget,
    ) -> Result<(&mut Buf, &mut Buf)> {
        let count = self.groups.len();
        let missing = || Error::GroupOutOfRange { group, count };
        let GroupGrads {
            shard, accumulator, ..
        } = self.groups.get_mut(group).ok_or_else(missing)?;
        let source = match place {
            GradTarget::Slot(slot) => &mut self.slots[slot].buffer,
            GradTarget::Accumulator(g) if g == group => accumulator.as_mut().ok_or_else(missing)?,
            GradTarget::Accumulator(_) | GradTarget::Shard(_) => return Err(missing()),
        };
        Ok((source, shard.as_mut().ok_or_else(missing)?))
    }
}

/// Gradients of a batch waiting to be written into one place, all adding or all not.
pub(super) struct Writes<'a> {
    target: Option<(GradTarget, bool)>,
    pending: Vec<(Input<'a>, Region)>,
}

/// One group's gradient buffers.
pub(super) struct GroupGrads<Buf> {
    /// The fp32 gradient shard of a trainable group (per step: from the step's first gradient
    /// of the group to its end).
    pub(super) shard: Option<Buf>,
    /// The unsharded fp32 gradient of no-sync accumulation.
    pub(super) accumulator: Option<Buf>,
    /// The regions of the group's layout that no gradient covers (padding), as f32.
    pub(super) padding: Vec<Region>,
}

pub(super) struct GradSlot<Buf, E> {
    pub(super) buffer: Buf,
    /// The reduction that last read the slot.
    pub(super) reduced: Option<std::sync::Arc<E>>,
}

/// The buffer behind a place for gradients: a slot, a group's accumulator, or (world size 1) a
/// group's shard, each laid out as the group.
pub(super) fn place_buffer<'a, Buf, E>(
    slots: &'a mut [GradSlot<Buf, E>],
    groups: &'a mut [GroupGrads<Buf>],
    place: GradTarget,
) -> Result<&'a mut Buf> {
    let count = groups.len();
    let missing = |group| Error::GroupOutOfRange { group, count };
    match place {
        GradTarget::Slot(slot) => Ok(&mut slots[slot].buffer),
        GradTarget::Shard(group) => {
            (groups.get_mut(group).and_then(|g| g.shard.as_mut())).ok_or(missing(group))
        }
        GradTarget::Accumulator(group) => (groups.get_mut(group))
            .and_then(|g| g.accumulator.as_mut())
            .ok_or(missing(group)),
    }
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Hands over `param`'s gradient for this backward pass, in the param's dtype or f32; it is
    /// written into a slot of the transport's dtype (or the fp32 shard, or accumulator). Where
    /// gradients stay on the rank the group's last gradient ends the group's pass. Where they
    /// travel (above world size 1, or with replicas) no gradient launches a reduce-scatter: the
    /// end of the unit's backward ([`Engine::post_backward`]) or of the pass does, in the plan's
    /// order, so the ranks may hand over different gradients
    /// (one with none counts as zero) as long as they issue the same hooks in the same order.
    /// Where no backward hook marks a pass (gradients handed over with no
    /// [`Engine::pre_backward`]), a rank's first gradient begins the pass: each rank then hands
    /// over at least one gradient in every pass, or the ranks' collectives differ and fail, at
    /// the latest at the engine's deadline. A gradient of a unit whose backward ended in this pass is
    /// `Error::GradientAfterItsUnit`. Host input is read before this returns.
    pub fn grad(&mut self, param: ParamId, gradient: Input<'_>) -> Result<()> {
        self.healthy()?;
        self.check_input(param, gradient)?;
        let group = self.check_grad(param, gradient.dtype(), gradient.numel())?;
        self.take_grads(&[(param, group, gradient)])
    }

    /// Hands over several gradients of this backward pass, as [`Engine::grad`] on each, taken
    /// group by group in the plan's order of groups (each group's in the batch's order): the
    /// gradients of one group go to the device together, in one operation where the backend
    /// can (a layer whose parameters alternate between a decayed and an exempt group costs two
    /// launches, not one per parameter). Where the optimizer steps in the backward, the batch is
    /// taken unit after unit, the unit already taking gradients first, then the others in the
    /// order of their first gradient in the batch, as one call per unit would take them: where
    /// gradients stay on the rank each unit's gradients end the units before it but the root.
    /// Every entry is checked before any is taken (a parameter named twice is
    /// `Error::DuplicateGradient`), so a refused batch changes nothing. An empty batch does
    /// nothing (it starts no backward).
    pub fn grads(&mut self, gradients: &[(ParamId, Input<'_>)]) -> Result<()> {
        self.healthy()?;
        if gradients.is_empty() {
            return Ok(());
        }
        let mut batch = crate::fallible::with_capacity(gradients.len(), "a batch's gradients")?;
        let mut named = crate::fallible::filled(self.plan.params().len(), false, "a batch's ids")?;
        for &(param, gradient) in gradients {
            self.check_input(param, gradient)?;
            let group = self.check_grad(param, gradient.dtype(), gradient.numel())?;
            let seen = named.get_mut(param.0).ok_or(Error::ParamIdOutOfRange {
                id: param.0,
                count: self.plan.params().len(),
            })?;
            if std::mem::replace(seen, true) {
                return Err(Error::DuplicateGradient {
                    name: self.plan.param(param)?.name.clone(),
                });
            }
            batch.push((param, group, gradient));
        }
        // Stable: a group's gradients keep the caller's order.
        if self.config.step_in_backward {
            let units = self.units_in_taking_order(&batch)?;
            let groups = self.plan.groups();
            batch.sort_by_key(|&(_, group, _)| {
                let unit = groups[group].unit;
                (units.iter().position(|&u| u == unit), group)
            });
        } else {
            batch.sort_by_key(|&(_, group, _)| group);
        }
        self.take_grads(&batch)
    }

    /// Where updates run in the backward, the units of a batch's gradients in the order they are
    /// taken, each unit's gradients together: the unit other than the root already taking
    /// gradients (there is at most one), then the others, the root among them, in the order of
    /// their first gradient in the batch. So a batch is taken as its units' gradients one unit
    /// after another would be, each unit's ending the ones before it but the root, and no more
    /// gradient shards are held than so.
    fn units_in_taking_order(&self, batch: &[(ParamId, usize, Input<'_>)]) -> Result<Vec<Unit>> {
        let groups = self.plan.groups();
        let mut units = crate::fallible::with_capacity(batch.len(), "a batch's units")?;
        for &(_, group, _) in batch {
            let unit = groups[group].unit;
            if !units.contains(&unit) {
                units.push(unit);
            }
        }
        let pipeline = &self.reducing.pipeline;
        let taking = |unit: Unit| {
            unit != Unit::Root
                && groups.iter().filter(|g| g.unit == unit).any(|g| {
                    !pipeline.closed(g.index) && g.params.iter().any(|p| pipeline.received(p.0))
                })
        };
        // Stable: the others keep their order.
        units.sort_by_key(|&unit| !taking(unit));
        Ok(units)
    }

    /// Writes the gradients `writes` holds into their place.
    fn flush_writes(&mut self, writes: &mut Writes<'_>) -> Result<()> {
        let Some((place, add)) = writes.target.take() else {
            return Ok(());
        };
        let buffer = place_buffer(&mut self.reducing.slots, &mut self.reducing.groups, place)?;
        // SAFETY: as for the other compute-stream writes of a place in `apply_grad_effects`; the
        // parameters' regions of one place do not overlap.
        let written = unsafe {
            self.backend
                .accumulate_inputs(Stream::Compute, &writes.pending, buffer, 1.0, add)
        };
        writes.pending.clear();
        written
    }

    /// Takes checked gradients, each `(param, its group, gradient)`, into their places in order:
    /// consecutive writes into one place go to the backend as one call.
    fn take_grads(&mut self, gradients: &[(ParamId, usize, Input<'_>)]) -> Result<()> {
        self.effects(|e| {
            // Entering the backward never ends a pass: no effect of it passes the writes.
            e.enter(Phase::Backward)?;
            let plan = Arc::clone(&e.plan);
            let groups = plan.groups();
            let mut writes = Writes {
                target: None,
                // A gradient makes one write.
                pending: crate::fallible::with_capacity(gradients.len(), "a batch's writes")?,
            };
            let mut taking = None;
            for &(param, group, gradient) in gradients {
                let _range = crate::nvtx::range("grad", param.0);
                let unit = groups[group].unit;
                if taking != Some(unit) {
                    // A unit's gradients end the others' (where updates run in the backward):
                    // what was written goes first.
                    e.flush_writes(&mut writes)?;
                    e.complete_units_but(|u| u == unit)?;
                    taking = Some(unit);
                }
                let writing = Some((gradient, &mut writes));
                e.apply_decided_with(writing, |p, fx| p.on_grad(param.0, group, fx))?;
            }
            e.flush_writes(&mut writes)
        })
    }

    /// Where updates run in the backward and gradients stay on the rank, gradients of some
    /// units end the gradients of every other unit but the root (whose parameters are used from
    /// the backward's start to its end): their backward is over, the parameters that got none
    /// count as zero, and their groups are final. So at most the root's groups and one other
    /// unit's wait for gradients. `arriving` says whether gradients of a unit arrive now. Where
    /// gradients travel, only the ranks' hooks end a unit: which gradients arrive may differ
    /// between ranks, and their reductions may not.
    fn complete_units_but(&mut self, arriving: impl Fn(Unit) -> bool) -> Result<()> {
        if !self.config.step_in_backward || self.plan.grads_travel() {
            return Ok(());
        }
        let plan = Arc::clone(&self.plan);
        let groups = plan.groups();
        let ended = |g: usize| groups[g].unit != Unit::Root && !arriving(groups[g].unit);
        self.apply_decided(|p, fx| p.complete_groups_where(ended, fx))
    }

    /// `unit`'s backward ended ([`Engine::post_backward`]): where gradients are reduced across
    /// ranks, every trainable group of it but the root's is reduced (the parameters that got
    /// none count as zero); elsewhere, where updates run in the backward, its groups are final.
    pub(super) fn complete_unit(&mut self, unit: Unit) -> Result<()> {
        let plan = Arc::clone(&self.plan);
        let groups = plan.groups();
        let root = unit == Unit::Root;
        self.apply_decided(|p, fx| p.end_unit(|g| groups[g].unit == unit, root, fx))
    }

    /// Refuses `param`'s gradient in host memory during a capture (a replay would take the
    /// bytes of the capture again), or of bytes that are not a whole number of its elements.
    fn check_input(&self, param: ParamId, gradient: Input<'_>) -> Result<()> {
        match gradient.0 {
            Source::Host { bytes, dtype } => {
                self.check_not_capturing("a gradient in host memory")?;
                if bytes.len() % dtype.size() != 0 {
                    return Err(Error::PartialElement {
                        name: self.plan.param(param)?.name.clone(),
                        bytes: bytes.len(),
                        dtype,
                    });
                }
                Ok(())
            }
            Source::Device { .. } => Ok(()),
        }
    }

    /// Checks a gradient for `param` before anything changes; returns its group.
    fn check_grad(&self, param: ParamId, dtype: DType, numel: usize) -> Result<usize> {
        self.check_not_stepped("a gradient")?;
        self.check_undecided("a gradient")?;
        self.check_captured_step_open()?;
        let layout = self.plan.param(param)?;
        let name = || layout.name.clone();
        self.check_no_open_slot()?;
        if !layout.trainable {
            return Err(Error::FrozenGradient { name: name() });
        }
        if dtype != layout.dtype && dtype != DType::F32 {
            return Err(Error::GradientDtype {
                name: name(),
                param: layout.dtype,
                got: dtype,
            });
        }
        if numel != layout.numel {
            return Err(Error::GradientLength {
                name: name(),
                expected: layout.numel,
                got: numel,
            });
        }
        if self.reducing.pipeline.received(param.0) {
            return Err(Error::DuplicateGradient { name: name() });
        }
        if self.reducing.pipeline.closed(layout.group) {
            return Err(Error::StepInBackward {
                what: "a gradient for a group already updated in this step (after its unit's \
                       backward ended)",
            });
        }
        if self.reducing.pipeline.ended(layout.group) {
            return Err(Error::GradientAfterItsUnit {
                name: name(),
                unit: layout.unit,
            });
        }
        Ok(layout.group)
    }

    /// Opens `param`'s fp32 place in its group's gradient slot for the caller to write this
    /// pass's gradient into; returns the place and the region. The place is not zero-filled (that
    /// would cost a pass over it): it holds what an earlier gradient left there, so the caller
    /// writes every element (on a GPU, on the compute stream) and never adds into it.
    /// [`Engine::commit_grad`] must follow before any other gradient or hook. Refused
    /// (`Error::GradSlotUnavailable`) where gradients travel in bf16, and for a step's later
    /// passes where they add into an earlier pass's (world size 1, no-sync): there the place is
    /// not one the caller can overwrite with f32.
    pub(super) fn open_grad_slot(&mut self, param: ParamId) -> Result<(GradTarget, Region)> {
        let _range = crate::nvtx::range("grad_slot", param.0);
        self.healthy()?;
        self.check_captured_step_open()?;
        if self.policy.grad_slot_dtype != DType::F32 {
            return Err(Error::GradSlotUnavailable {
                reason: "gradients travel in bf16 (reduce_dtype)",
            });
        }
        let group = self.check_grad(param, DType::F32, self.plan.param(param)?.numel)?;
        if self.reducing.pipeline.next_adds(group) {
            return Err(Error::GradSlotUnavailable {
                reason: "an earlier pass's gradient of the step is in its place (world size 1, \
                         or no-sync accumulation)",
            });
        }
        self.effects(|e| {
            e.enter(Phase::Backward)?;
            let unit = e.plan.groups()[group].unit;
            e.complete_units_but(|u| u == unit)?;
            let place = e.apply_decided(|p, fx| p.open(group, fx))?;
            e.reducing.open_slot = Some(param);
            let layout = &e.plan.params()[param.0];
            Ok((place, Region::new(layout.offset, layout.numel, DType::F32)))
        })
    }

    /// Declares `param`'s gradient written into the slot [`Engine::grad_slot_address`] (or, on the
    /// CPU, `grad_slot`) opened; it counts as [`Engine::grad`] does.
    pub fn commit_grad(&mut self, param: ParamId) -> Result<()> {
        let _range = crate::nvtx::range("commit_grad", param.0);
        self.healthy()?;
        self.check_not_stepped("a gradient")?;
        let layout = self.plan.param(param)?;
        if self.reducing.open_slot != Some(param) {
            return Err(Error::GradSlotNotOpen {
                name: layout.name.clone(),
            });
        }
        let group = layout.group;
        self.effects(|e| {
            e.reducing.open_slot = None;
            e.apply_decided(|p, fx| p.commit(param.0, group, fx))
        })
    }

    /// Lets the pipeline decide (`decide` pushes its effects) and applies what it decided, in
    /// the buffer of effects reused between calls.
    pub(super) fn apply_decided<T>(
        &mut self,
        decide: impl FnOnce(&mut GradPipeline, &mut Vec<GradEffect>) -> T,
    ) -> Result<T> {
        self.apply_decided_with(None, decide)
    }

    /// As [`Engine::apply_decided`], a gradient's writes (`gradient`) joining the writes waiting
    /// as [`Engine::apply_grad_effects`] says.
    fn apply_decided_with<'a, T>(
        &mut self,
        gradient: Option<(Input<'a>, &mut Writes<'a>)>,
        decide: impl FnOnce(&mut GradPipeline, &mut Vec<GradEffect>) -> T,
    ) -> Result<T> {
        let mut fx = std::mem::take(&mut self.reducing.effects);
        fx.clear();
        let decided = decide(&mut self.reducing.pipeline, &mut fx);
        let result = self.apply_grad_effects(&fx, gradient);
        self.reducing.effects = fx;
        result.map(|()| decided)
    }

    /// Applies `effects` in order. A gradient's writes (with `gradient`: the gradient and the
    /// writes waiting) join the writes waiting when they go to the same place, so that a batch's
    /// gradients reach the backend in one call; every other effect first writes those.
    pub(super) fn apply_grad_effects<'a>(
        &mut self,
        effects: &[GradEffect],
        mut gradient: Option<(Input<'a>, &mut Writes<'a>)>,
    ) -> Result<()> {
        for &effect in effects {
            if let Some(group) = effect.shard_written() {
                self.ensure_grad_shard(group)?;
            }
            if let (Some((_, writes)), false) = (
                gradient.as_mut(),
                matches!(effect, GradEffect::Write { .. }),
            ) {
                self.flush_writes(writes)?;
            }
            match effect {
                GradEffect::Retire { slot } => {
                    if let Some(reduced) = self.reducing.slots[slot].reduced.take() {
                        self.backend.wait(Stream::Compute, &reduced)?;
                    }
                }
                // SAFETY (the three compute-stream writes of a place): a slot is written only
                // once the compute stream waited for the reduction that last read it (`Retire`,
                // which the pipeline issues before it hands the slot out again); a shard (world
                // size 1) only for a step's first gradients, after `finish_grad_sync` made compute
                // wait for every reduction of the step before.
                GradEffect::ZeroPadding { place, group } => {
                    let dtype = self.place_dtype(place);
                    for i in 0..self.reducing.groups[group].padding.len() {
                        let padding = self.reducing.groups[group].padding[i];
                        let region = Region::new(padding.offset, padding.len, dtype);
                        let buffer = place_buffer(
                            &mut self.reducing.slots,
                            &mut self.reducing.groups,
                            place,
                        )?;
                        // SAFETY: see above.
                        unsafe { self.backend.zero(Stream::Compute, buffer, region) }?;
                    }
                }
                GradEffect::ZeroParam { place, param } => {
                    let region = self.param_region(param, place);
                    let buffer =
                        place_buffer(&mut self.reducing.slots, &mut self.reducing.groups, place)?;
                    // SAFETY: see above.
                    unsafe { self.backend.zero(Stream::Compute, buffer, region) }?;
                }
                GradEffect::Write { param, place, add } => {
                    if let Some((input, writes)) = gradient.as_mut() {
                        if writes.target != Some((place, add)) {
                            self.flush_writes(writes)?;
                            writes.target = Some((place, add));
                        }
                        let region = self.param_region(param, place);
                        writes.pending.push((*input, region));
                    }
                }
                GradEffect::Stage { group, slot } => {
                    let numel = self.plan.groups()[group].padded_numel;
                    let dtype = self.place_dtype(GradTarget::Slot(slot));
                    let count = self.reducing.groups.len();
                    let accumulator = (self.reducing.groups.get(group))
                        .and_then(|g| g.accumulator.as_ref())
                        .ok_or(Error::GroupOutOfRange { group, count })?;
                    // SAFETY: the slot as above; the accumulator was last written on the compute
                    // stream, where this copy runs.
                    unsafe {
                        self.backend.accumulate(
                            Stream::Compute,
                            accumulator,
                            Region::new(0, numel, DType::F32),
                            &mut self.reducing.slots[slot].buffer,
                            Region::new(0, numel, dtype),
                            1.0,
                            false,
                        )
                    }?;
                }
                GradEffect::Reduce {
                    group,
                    place,
                    overwrite,
                } => self.reduce(group, place, overwrite)?,
                GradEffect::Final { group } => self.update_in_backward(group)?,
                GradEffect::ZeroShard { group } => {
                    let numel = self.plan.groups()[group].shard_numel;
                    if let Some(shard) = self.reducing.groups[group].shard.as_mut() {
                        let region = Region::new(0, numel, DType::F32);
                        // SAFETY: on the compute stream, after the previous step's optimizer read
                        // the shard there; no reduction of this step writes it (the group got no
                        // gradient), and the previous step's were waited for by its sync.
                        unsafe { self.backend.zero(Stream::Compute, shard, region) }?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Makes trainable `group`'s per-step gradient shard ([`crate::GradShardMemory::PerStep`]) when the
    /// step first writes it; it goes at the step's end.
    fn ensure_grad_shard(&mut self, group: usize) -> Result<()> {
        let g = &self.plan.groups()[group];
        if !g.trainable || self.reducing.groups[group].shard.is_some() {
            return Ok(());
        }
        // The step writes every element before anything reads the shard: its first gradients
        // (with the padding and the parameters that got none zeroed), its first reduction, or a
        // zero fill when the group got nothing.
        let shard =
            super::naming_what_ran_out(self.backend.alloc_unfilled(g.shard_numel * 4), || {
                format!("the gradient shard of group {group}")
            })?;
        self.reducing.groups[group].shard = Some(shard);
        Ok(())
    }

    /// The element type of gradients at `place`: a slot's is the transport's, the rest f32.
    fn place_dtype(&self, place: GradTarget) -> DType {
        match place {
            GradTarget::Slot(_) => self.policy.grad_slot_dtype,
            GradTarget::Shard(_) | GradTarget::Accumulator(_) => DType::F32,
        }
    }

    /// `param`'s region of its group's layout, at `place`.
    fn param_region(&self, param: usize, place: GradTarget) -> Region {
        let layout = &self.plan.params()[param];
        Region::new(layout.offset, layout.numel, self.place_dtype(place))
    }

    fn reduce(&mut self, group: usize, place: GradTarget, overwrite: bool) -> Result<()> {
        let world = self.plan.world_size();
        let g = &self.plan.groups()[group];
        let (padded, shard_numel) = (g.padded_numel, g.shard_numel);
        let (own_place, process_group) = (self.plan.shard_index(g, self.rank)?, g.process_group);
        let dtype = self.place_dtype(place);
        let written = self.backend.record(Stream::Compute)?;
        self.backend.wait(Stream::Reduce, &written)?;
        let start = self.mark(Stream::Reduce)?;
        // A mean divides by every data-parallel rank, in a process group too: an expert's tokens
        // come from all of them.
        let ranks = world.saturating_mul(self.plan.replicas());
        let scale = self.config.grad_reduction.scale(ranks);
        let region = Region::new(0, padded, dtype);
        let tag = self.plan.grads_travel().then(|| {
            self.next_tag(Purpose::Group(group), |tag| {
                Fingerprint::reduce_scatter(tag, region)
            })
        });
        // Made by `ensure_grad_shard` before any effect that writes it.
        let (source, shard) = self.reducing.source_and_shard(group, place)?;
        // Where nothing travels the sum over ranks is the place itself, scaled on its way to the
        // shard.
        let shard_scale = if let Some(tag) = tag {
            let comm = super::group_comm(&mut self.comm, &mut self.process_groups, process_group)?;
            // SAFETY: the reduce stream waited (above) for compute's writes of the place; compute
            // writes a slot again only after waiting for this reduction (`Retire`), an
            // accumulator only in the next step, after `finish_grad_sync` waited for it.
            unsafe {
                comm.reduce_scatter(&self.backend, Stream::Reduce, tag, source, region, scale)
            }?;
            1.0
        } else {
            scale
        };
        self.counters.reduce_scatters += 1;
        let own = Region::new(own_place * shard_numel, shard_numel, dtype);
        // SAFETY: the place as above; the gradient shard is written after every compute-stream
        // use of it so far (the wait above: the previous step's optimizer, this step's direct
        // writes at world size 1) and read by compute only after `finish_grad_sync` waited for
        // the reduce stream.
        unsafe {
            self.backend.accumulate(
                Stream::Reduce,
                source,
                own,
                shard,
                Region::new(0, shard_numel, DType::F32),
                shard_scale,
                !overwrite,
            )
        }?;
        self.push_span(Stream::Reduce, SpanKind::ReduceScatter { group }, start)?;
        let peers = self.peers(process_group);
        let collective = tag.map(|tag| (Fingerprint::reduce_scatter(tag, region), peers));
        let reduced = self.record_collective(Stream::Reduce, collective)?;
        if let GradTarget::Slot(slot) = place {
            self.reducing.slots[slot].reduced = Some(reduced);
        }
        Ok(())
    }
}
