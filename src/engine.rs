//! One rank's runtime: owns the shards, slots and optimizer state, applies the pure decisions of
//! [`crate::state`], [`crate::schedule`] and [`crate::grads`] through a backend and a communicator.

use std::sync::Arc;

use crate::backend::cpu::CpuBackend;
use crate::backend::{
    Backend, Input, MemoryUsage, OptimizerShard, RawAddress, Region, Source, Stream,
};
use crate::comm::Communicator;
use crate::config::{EngineConfig, GradReduction};
use crate::dtype::{DType, Element};
use crate::error::{Error, Result};
use crate::grads::{GradEffect, GradPipeline, Place};
use crate::plan::{ParamId, ParamLayout, Plan, Unit};
use crate::schedule::{Phase, Schedule};
use crate::state::{BufferState, GatherEffect, Gathers};

/// What the engine did, counted since it was created.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// All-gathers issued, prefetches included (at world size 1 a gather marks the shard as the
    /// view and moves nothing).
    pub all_gathers: u64,
    /// All-gathers issued ahead of use.
    pub prefetches: u64,
    /// Uses served by a READY buffer without communication.
    pub reuses: u64,
    /// Gathered buffers given back.
    pub evictions: u64,
    /// Reductions of a gradient slot into a shard (at world size 1 a step's first gradients are
    /// written straight into the shards, with no reduction).
    pub reduce_scatters: u64,
    /// Gather slots allocated beyond `double_buffer_limit` because a required gather found
    /// every gathered buffer in use.
    pub extra_slots: u64,
    /// Times the host blocked on the device.
    pub host_waits: u64,
    pub steps: u64,
}

/// What a traced span covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanKind {
    /// The compute stream waiting for a unit's gathers, at the start of one of its hooks.
    GatherWait(Unit),
    Forward(Unit),
    Backward(Unit),
    AllGather {
        group: usize,
    },
    /// A reduce-scatter and the accumulation of its result into the group's gradient shard.
    ReduceScatter {
        group: usize,
    },
    Optimizer,
}

/// An interval of one stream's work, between two timed events.
#[derive(Debug)]
pub struct Span<E> {
    pub stream: Stream,
    pub kind: SpanKind,
    pub start: E,
    pub end: E,
}

/// The spans being collected, and the open forward and backward of each unit.
struct Trace<E> {
    spans: Vec<Span<E>>,
    forward: Vec<Option<E>>,
    backward: Vec<Option<E>>,
}

/// Where a gathered group's values live.
enum Placement<E> {
    Slot(GatherSlot<E>),
    /// At world size 1 the shard is the whole buffer: the view is the shard itself.
    Shard,
}

struct GatherSlot<E> {
    buffer_index: usize,
    /// Compute's last use of the group that held the slot.
    free_after: Option<Arc<E>>,
}

/// The buffer behind a place for gradients: a slot, or (world size 1) a group's shard, whose
/// layout is the group's.
fn place_buffer<'a, Buf, E>(
    slots: &'a mut [GradSlot<Buf, E>],
    shards: &'a mut [Option<Buf>],
    place: Place,
) -> Result<&'a mut Buf> {
    match place {
        Place::Slot(slot) => Ok(&mut slots[slot].buffer),
        Place::Shard(group) => {
            let count = shards.len();
            shards
                .get_mut(group)
                .and_then(Option::as_mut)
                .ok_or(Error::GroupOutOfRange { group, count })
        }
    }
}

struct GradSlot<Buf, E> {
    buffer: Buf,
    /// The reduction that last read the slot.
    reduced: Option<E>,
}

/// One rank's FSDP runtime over backend `B` and communicator `C`.
///
/// A step is: for each micro-batch, the forward hooks of each unit in execution order
/// ([`Engine::pre_forward`] / [`Engine::post_forward`]), then the backward hooks in reverse
/// ([`Engine::pre_backward`] / [`Engine::post_backward`]) with one [`Engine::grad`] per trainable
/// parameter; then [`Engine::finish_grad_sync`], [`Engine::optimizer_step`] and
/// [`Engine::end_step`]. Gradients of several micro-batches add up until the step ends.
pub struct Engine<B: Backend, C: Communicator<B>> {
    plan: Arc<Plan>,
    config: EngineConfig,
    rank: usize,
    backend: B,
    comm: C,
    shards: Vec<B::Buffer>,
    grad_shards: Vec<Option<B::Buffer>>,
    masters: Vec<Option<B::Buffer>>,
    moments: Vec<Option<(B::Buffer, B::Buffer)>>,
    master_stale: Vec<bool>,
    slot_buffers: Vec<B::Buffer>,
    free_slots: Vec<GatherSlot<B::Event>>,
    placed: Vec<Option<Placement<B::Event>>>,
    /// Per group, the regions of its layout that no gradient covers (padding), as f32.
    padding: Vec<Vec<Region>>,
    gathered: Vec<Option<B::Event>>,
    released: Vec<Option<Arc<B::Event>>>,
    shards_updated: Option<B::Event>,
    grad_slots: Vec<GradSlot<B::Buffer, B::Event>>,
    gathers: Gathers,
    grads: GradPipeline,
    schedule: Schedule,
    forward_open: Vec<bool>,
    backward_open: Vec<bool>,
    optimizer_steps: u64,
    stepped: bool,
    open_slot: Option<ParamId>,
    counters: Counters,
    gather_effects: Vec<GatherEffect>,
    grad_effects: Vec<GradEffect>,
    trace: Option<Trace<B::Event>>,
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Allocates every buffer the plan predicts (shards, gradient shards, optimizer state, gather
    /// and gradient slots); parameters start at zero until [`Engine::load_param`].
    pub fn new(plan: Arc<Plan>, config: EngineConfig, backend: B, comm: C) -> Result<Self> {
        config.validate()?;
        let (rank, world) = (comm.rank(), comm.world_size());
        if world != plan.world_size() {
            return Err(Error::WorldSizeMismatch {
                plan: plan.world_size(),
                comm: world,
            });
        }
        if rank >= world {
            return Err(Error::RankOutOfRange {
                rank,
                world_size: world,
            });
        }
        let groups = plan.groups();
        let mut shards = Vec::with_capacity(groups.len());
        let mut grad_shards = Vec::with_capacity(groups.len());
        let mut masters = Vec::with_capacity(groups.len());
        let mut moments = Vec::with_capacity(groups.len());
        for g in groups {
            shards.push(backend.alloc(g.shard_numel * g.dtype.size())?);
            let f32_shard = || backend.alloc(g.shard_numel * 4);
            let trains = g.trainable;
            grad_shards.push(if trains { Some(f32_shard()?) } else { None });
            masters.push(if trains && g.dtype != DType::F32 {
                Some(f32_shard()?)
            } else {
                None
            });
            moments.push(if trains && config.optimizer.has_moments() {
                Some((f32_shard()?, f32_shard()?))
            } else {
                None
            });
        }
        let slot_bytes = plan.gather_slot_bytes();
        let slot_count = plan.gather_slot_count(&config);
        let slot_buffers = (0..slot_count)
            .map(|_| backend.alloc(slot_bytes))
            .collect::<Result<Vec<_>>>()?;
        let free_slots = (0..slot_count)
            .rev()
            .map(|buffer_index| GatherSlot {
                buffer_index,
                free_after: None,
            })
            .collect();
        let grad_slot_bytes = plan.grad_slot_numel() * 4;
        let grad_slots = (0..plan.grad_slot_count(&config))
            .map(|_| {
                Ok(GradSlot {
                    buffer: backend.alloc(grad_slot_bytes)?,
                    reduced: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let members = groups
            .iter()
            .map(|g| {
                if g.trainable {
                    g.params.iter().map(|p| p.0).collect()
                } else {
                    Vec::new()
                }
            })
            .collect();
        let padding = groups
            .iter()
            .map(|g| {
                g.params
                    .iter()
                    .map(|&p| &plan.params()[p.0])
                    .filter(|p| p.padded_numel > p.numel)
                    .map(|p| Region::new(p.offset + p.numel, p.padded_numel - p.numel, DType::F32))
                    .collect()
            })
            .collect();
        let grads = GradPipeline::new(
            members,
            plan.params().len(),
            grad_slots.len(),
            config.max_reduces_in_flight,
            config.overlap,
            plan.world_size() == 1,
        );
        let units = plan.units().len();
        Ok(Engine {
            gathers: Gathers::new(groups.len(), config.double_buffer_limit),
            schedule: Schedule::new(units),
            grads,
            placed: (0..groups.len()).map(|_| None).collect(),
            padding,
            gathered: (0..groups.len()).map(|_| None).collect(),
            released: vec![None; groups.len()],
            master_stale: vec![true; groups.len()],
            shards,
            grad_shards,
            masters,
            moments,
            slot_buffers,
            free_slots,
            shards_updated: None,
            grad_slots,
            forward_open: vec![false; units],
            backward_open: vec![false; units],
            optimizer_steps: 0,
            stepped: false,
            open_slot: None,
            counters: Counters::default(),
            gather_effects: Vec::new(),
            grad_effects: Vec::new(),
            trace: None,
            plan,
            config,
            rank,
            backend,
            comm,
        })
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// What the engine did so far.
    pub fn counters(&self) -> Counters {
        Counters {
            host_waits: self.backend.host_waits(),
            ..self.counters
        }
    }

    /// Bytes the backend holds now and at its peak.
    pub fn memory(&self) -> MemoryUsage {
        self.backend.memory()
    }

    /// The state of group `group`'s gathered buffer.
    pub fn buffer_state(&self, group: usize) -> Result<BufferState> {
        self.plan.group(group)?;
        Ok(self.gathers.state(group))
    }

    /// Gathered buffers now (SYNCING, USING or READY).
    pub fn gathered_count(&self) -> usize {
        self.gathers.gathered()
    }

    /// Between [`Engine::optimizer_step`] and [`Engine::end_step`] the gathered buffers hold the
    /// weights from before the update, and gathers would race the optimizer's writes: nothing but
    /// the end of the step is allowed.
    fn check_not_stepped(&self, action: &'static str) -> Result<()> {
        if self.stepped {
            return Err(Error::OptimizerStepped { action });
        }
        Ok(())
    }

    fn unit_index(&self, unit: Unit) -> Result<usize> {
        self.plan
            .unit_index(unit)
            .ok_or(Error::UnknownUnit { unit })
    }

    /// Before `unit`'s forward: its groups are gathered (reused if READY) and compute waits for
    /// them; the next unit expected is prefetched. Does not block the host on a GPU.
    pub fn pre_forward(&mut self, unit: Unit) -> Result<()> {
        let _range = crate::nvtx::range("pre_forward", unit);
        self.check_not_stepped("a forward")?;
        let u = self.unit_index(unit)?;
        if self.forward_open[u] {
            return Err(Error::ForwardAlreadyOpen { unit });
        }
        self.begin(Phase::Forward, u)?;
        self.forward_open[u] = true;
        self.use_unit_traced(u, Phase::Forward)
    }

    /// After `unit`'s forward: its groups become READY once no hook uses them.
    pub fn post_forward(&mut self, unit: Unit) -> Result<()> {
        let _range = crate::nvtx::range("post_forward", unit);
        self.check_not_stepped("a forward")?;
        let u = self.unit_index(unit)?;
        if !self.forward_open[u] {
            return Err(Error::ForwardNotOpen { unit });
        }
        self.forward_open[u] = false;
        self.end_span(u, Phase::Forward)?;
        self.release_unit(u)
    }

    /// Before `unit`'s backward: as [`Engine::pre_forward`], prefetching the unit expected next in
    /// backward order.
    pub fn pre_backward(&mut self, unit: Unit) -> Result<()> {
        let _range = crate::nvtx::range("pre_backward", unit);
        self.check_not_stepped("a backward")?;
        let u = self.unit_index(unit)?;
        if self.backward_open[u] {
            return Err(Error::BackwardAlreadyOpen { unit });
        }
        self.begin(Phase::Backward, u)?;
        self.backward_open[u] = true;
        self.use_unit_traced(u, Phase::Backward)
    }

    /// After `unit`'s backward. Optional: [`Engine::finish_grad_sync`] ends any backward still open.
    pub fn post_backward(&mut self, unit: Unit) -> Result<()> {
        let _range = crate::nvtx::range("post_backward", unit);
        self.check_not_stepped("a backward")?;
        let u = self.unit_index(unit)?;
        if !self.backward_open[u] {
            return Err(Error::BackwardNotOpen { unit });
        }
        self.backward_open[u] = false;
        self.end_span(u, Phase::Backward)?;
        self.release_unit(u)
    }

    /// Hands over `param`'s gradient for this backward pass, in the param's dtype or f32; it is
    /// written into an fp32 slot, and the group is reduce-scattered once all its trainable params
    /// have theirs. The gradient may be read after this returns (host input is consumed at once).
    pub fn grad(&mut self, param: ParamId, gradient: Input<'_>) -> Result<()> {
        let _range = crate::nvtx::range("grad", param.0);
        let group = self.check_grad(param, gradient.dtype(), gradient.numel())?;
        self.enter(Phase::Backward)?;
        let mut fx = std::mem::take(&mut self.grad_effects);
        fx.clear();
        self.grads.on_grad(param.0, group, &mut fx);
        let result = self.apply_grad_effects(&fx, Some(gradient));
        self.grad_effects = fx;
        result
    }

    /// Checks a gradient for `param` before anything changes; returns its group.
    fn check_grad(&self, param: ParamId, dtype: DType, numel: usize) -> Result<usize> {
        self.check_not_stepped("a gradient")?;
        let layout = self.plan.param(param)?;
        let name = || layout.name.clone();
        if let Some(open) = self.open_slot {
            return Err(Error::GradSlotOpen {
                name: self.plan.params()[open.0].name.clone(),
            });
        }
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
        if self.grads.received(param.0) {
            return Err(Error::DuplicateGradient { name: name() });
        }
        Ok(layout.group)
    }

    /// Opens `param`'s fp32 place in its group's gradient slot for the caller to write this
    /// pass's gradient into; returns the place and the region. The place is not zero-filled (that
    /// would cost a pass over it): it holds what an earlier gradient left there, so the caller
    /// writes every element (on a GPU, on the compute stream) and never adds into it.
    /// [`Engine::commit_grad`] must follow before any other gradient.
    fn open_grad_slot(&mut self, param: ParamId) -> Result<(Place, Region)> {
        let _range = crate::nvtx::range("grad_slot", param.0);
        let group = self.check_grad(param, DType::F32, self.plan.param(param)?.numel)?;
        self.enter(Phase::Backward)?;
        let mut fx = std::mem::take(&mut self.grad_effects);
        fx.clear();
        let place = self.grads.open(group, &mut fx);
        let result = self.apply_grad_effects(&fx, None);
        self.grad_effects = fx;
        result?;
        self.open_slot = Some(param);
        let layout = &self.plan.params()[param.0];
        Ok((place, Region::new(layout.offset, layout.numel, DType::F32)))
    }

    /// Declares `param`'s gradient written into the slot [`Engine::grad_slot_address`] (or, on the
    /// CPU, `grad_slot`) opened; the group's last gradient launches its reduce-scatter.
    pub fn commit_grad(&mut self, param: ParamId) -> Result<()> {
        let _range = crate::nvtx::range("commit_grad", param.0);
        self.check_not_stepped("a gradient")?;
        let layout = self.plan.param(param)?;
        if self.open_slot != Some(param) {
            return Err(Error::GradSlotNotOpen {
                name: layout.name.clone(),
            });
        }
        let group = layout.group;
        self.open_slot = None;
        let mut fx = std::mem::take(&mut self.grad_effects);
        fx.clear();
        self.grads.commit(param.0, group, &mut fx);
        let result = self.apply_grad_effects(&fx, None);
        self.grad_effects = fx;
        result
    }

    /// Ends the backward passes of this step: ends any backward still open, reduces every group
    /// (those whose last gradient never came too), and orders compute after the reductions. On a
    /// GPU it does not block the host: later compute-stream work waits for the reduce stream.
    pub fn finish_grad_sync(&mut self) -> Result<()> {
        let _range = crate::nvtx::range("finish_grad_sync", "");
        if let Some(open) = self.open_slot {
            return Err(Error::GradSlotOpen {
                name: self.plan.params()[open.0].name.clone(),
            });
        }
        if let Some(u) = self.forward_open.iter().position(|&o| o) {
            return Err(Error::ForwardStillOpen {
                unit: self.plan.units()[u],
            });
        }
        for u in 0..self.backward_open.len() {
            if self.backward_open[u] {
                self.backward_open[u] = false;
                self.release_unit(u)?;
            }
        }
        let mut fx = std::mem::take(&mut self.grad_effects);
        fx.clear();
        self.grads.finish(&mut fx);
        let result = self.apply_grad_effects(&fx, None);
        self.grad_effects = fx;
        result?;
        let reduced = self.backend.record(Stream::Reduce)?;
        self.backend.wait(Stream::Compute, &reduced)
    }

    /// Updates every trainable shard from its gradient shard with the configured optimizer, once
    /// per step, after [`Engine::finish_grad_sync`].
    pub fn optimizer_step(&mut self) -> Result<()> {
        let _range = crate::nvtx::range("optimizer_step", "");
        if !self.grads.synced() {
            return Err(Error::GradsNotSynced {
                action: "the optimizer step",
            });
        }
        if self.stepped {
            return Err(Error::OptimizerAlreadyStepped);
        }
        // A gather still in flight (a prefetch no hook used) reads the shards the optimizer writes.
        if self.plan.world_size() > 1 {
            let gathered = self.backend.record(Stream::Gather)?;
            self.backend.wait(Stream::Compute, &gathered)?;
        }
        self.optimizer_steps += 1;
        let start = self.mark(Stream::Compute)?;
        let update = self.config.optimizer.coefficients(self.optimizer_steps);
        for g in self.plan.groups().iter().filter(|g| g.trainable) {
            let i = g.index;
            let Some(grad) = self.grad_shards[i].as_ref() else {
                continue;
            };
            if self.master_stale[i] {
                if let Some(master) = self.masters[i].as_mut() {
                    let whole = Region::new(0, g.shard_numel, g.dtype);
                    // SAFETY: as the optimizer's accesses below.
                    unsafe {
                        self.backend
                            .widen(Stream::Compute, &self.shards[i], whole, master)
                    }?;
                }
                self.master_stale[i] = false;
            }
            let shard = OptimizerShard {
                param: &mut self.shards[i],
                dtype: g.dtype,
                numel: g.shard_numel,
                grad,
                master: self.masters[i].as_mut(),
                moments: self.moments[i].as_mut().map(|(m, v)| (m, v)),
            };
            // SAFETY: on the compute stream, which waited for every reduction into the gradient
            // shards (`finish_grad_sync`) and for every gather reading the parameter shards
            // (above); the masters and moments are only ever used on the compute stream. The
            // step's next gather waits for this one (`shards_updated`), and the next step's first
            // reductions are queued after it with compute's event.
            unsafe { self.backend.optimizer_step(Stream::Compute, &update, shard) }?;
        }
        self.push_span(Stream::Compute, SpanKind::Optimizer, start)?;
        self.shards_updated = Some(self.backend.record(Stream::Compute)?);
        self.stepped = true;
        Ok(())
    }

    /// Ends the step: every gathered buffer is freed (its contents are stale once the shards
    /// change) and the next step's first reductions overwrite the gradient shards.
    pub fn end_step(&mut self) -> Result<()> {
        let _range = crate::nvtx::range("end_step", "");
        if let Some(u) = self.forward_open.iter().position(|&o| o) {
            return Err(Error::ForwardStillOpen {
                unit: self.plan.units()[u],
            });
        }
        if let Some(u) = self.backward_open.iter().position(|&o| o) {
            return Err(Error::BackwardStillOpen {
                unit: self.plan.units()[u],
            });
        }
        if self.grads.pending() {
            return Err(Error::GradsNotSynced {
                action: "ending the step",
            });
        }
        let mut fx = std::mem::take(&mut self.gather_effects);
        fx.clear();
        self.gathers.reset(&mut fx)?;
        let result = self.apply_gather_effects(&fx);
        self.gather_effects = fx;
        result?;
        self.schedule.end_step();
        self.grads.end_step();
        self.stepped = false;
        self.counters.steps += 1;
        Ok(())
    }

    /// Writes `data` (the whole parameter, in its dtype, on the host) into this rank's shard: only
    /// the part the rank holds is kept. Every rank loads every parameter. Allowed between steps.
    pub fn load_param(&mut self, param: ParamId, data: Input<'_>) -> Result<()> {
        self.check_not_stepped("loading a parameter")?;
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
        if data.numel() != layout.numel {
            return Err(Error::DataLength {
                name: layout.name.clone(),
                expected: layout.numel,
                got: data.numel(),
            });
        }
        if self.gathers.state(layout.group) != BufferState::Freed {
            return Err(Error::Gathered {
                name: layout.name.clone(),
            });
        }
        let group = &self.plan.groups()[layout.group];
        let shard = self.plan.shard_range(group, self.rank);
        let start = layout.offset.max(shard.start);
        let end = (layout.offset + layout.numel).min(shard.end);
        if start < end {
            let src = &bytes
                [(start - layout.offset) * dtype.size()..(end - layout.offset) * dtype.size()];
            let region = Region::new(start - shard.start, end - start, dtype);
            self.backend
                .upload(&mut self.shards[layout.group], region, src)?;
        }
        self.master_stale[layout.group] = true;
        Ok(())
    }

    /// A copy of the gathered values of `param`, as bytes in its dtype; allowed while one of its
    /// unit's hooks is open. Blocks the host until the copy is done.
    pub fn param_bytes(&self, param: ParamId) -> Result<Vec<u8>> {
        let (layout, slot) = self.gathered_view(param)?;
        let mut out = vec![0u8; layout.numel * layout.dtype.size()];
        let region = Region::new(layout.offset, layout.numel, layout.dtype);
        self.backend.download(slot, region, &mut out)?;
        Ok(out)
    }

    /// This rank's parameter shard of `group`, as bytes in the group's dtype.
    pub fn param_shard(&self, group: usize) -> Result<Vec<u8>> {
        let g = self.plan.group(group)?;
        let region = Region::new(0, g.shard_numel, g.dtype);
        let mut out = vec![0u8; g.shard_numel * g.dtype.size()];
        self.backend
            .download(&self.shards[group], region, &mut out)?;
        Ok(out)
    }

    /// This rank's fp32 gradient shard of trainable `group`, as synced so far this step.
    pub fn grad_shard(&self, group: usize) -> Result<Vec<f32>> {
        let g = self.plan.group(group)?;
        let mut out = vec![0f32; g.shard_numel];
        if let Some(shard) = &self.grad_shards[group] {
            let region = Region::new(0, g.shard_numel, DType::F32);
            self.backend
                .download(shard, region, bytemuck::cast_slice_mut(&mut out))?;
        }
        Ok(out)
    }

    /// The gathered view of a parameter: its slot, checked to be in use.
    pub(crate) fn gathered_view(&self, param: ParamId) -> Result<(&ParamLayout, &B::Buffer)> {
        let layout = self.plan.param(param)?;
        match (&self.placed[layout.group], self.gathers.state(layout.group)) {
            (Some(Placement::Slot(slot)), BufferState::Using) => {
                Ok((layout, &self.slot_buffers[slot.buffer_index]))
            }
            (Some(Placement::Shard), BufferState::Using) => {
                Ok((layout, &self.shards[layout.group]))
            }
            _ => Err(Error::NotGathered {
                name: layout.name.clone(),
            }),
        }
    }

    fn begin(&mut self, phase: Phase, unit: usize) -> Result<()> {
        if let Some(open) = self.open_slot {
            return Err(Error::GradSlotOpen {
                name: self.plan.params()[open.0].name.clone(),
            });
        }
        self.enter(phase)?;
        self.schedule.record(unit);
        Ok(())
    }

    /// Enters `phase`; leaving a backward pass reduces the groups still waiting for gradients.
    fn enter(&mut self, phase: Phase) -> Result<()> {
        if self.schedule.enter(phase) != Some(Phase::Backward) {
            return Ok(());
        }
        let mut fx = std::mem::take(&mut self.grad_effects);
        fx.clear();
        self.grads.end_pass(&mut fx);
        let result = self.apply_grad_effects(&fx, None);
        self.grad_effects = fx;
        result
    }

    /// Starts collecting spans of every stream's work (clearing earlier ones), or stops.
    pub fn set_tracing(&mut self, on: bool) {
        let units = self.plan.units().len();
        self.trace = on.then(|| Trace {
            spans: Vec::new(),
            forward: (0..units).map(|_| None).collect(),
            backward: (0..units).map(|_| None).collect(),
        });
    }

    /// The spans collected since tracing started or since the last call.
    pub fn take_trace(&mut self) -> Vec<Span<B::Event>> {
        self.trace
            .as_mut()
            .map(|t| std::mem::take(&mut t.spans))
            .unwrap_or_default()
    }

    /// A timed event on `stream` when tracing, to delimit a span.
    fn mark(&self, stream: Stream) -> Result<Option<B::Event>> {
        match self.trace {
            Some(_) => self.backend.record_timed(stream).map(Some),
            None => Ok(None),
        }
    }

    fn push_span(&mut self, stream: Stream, kind: SpanKind, start: Option<B::Event>) -> Result<()> {
        if let Some(start) = start {
            let end = self.backend.record_timed(stream)?;
            if let Some(trace) = self.trace.as_mut() {
                trace.spans.push(Span {
                    stream,
                    kind,
                    start,
                    end,
                });
            }
        }
        Ok(())
    }

    /// Uses unit `u` for `phase`; when tracing, records the compute stream's wait for its gathers
    /// and opens the unit's compute span.
    fn use_unit_traced(&mut self, u: usize, phase: Phase) -> Result<()> {
        let before = self.mark(Stream::Compute)?;
        self.use_unit(u)?;
        let unit = self.plan.units()[u];
        self.push_span(Stream::Compute, SpanKind::GatherWait(unit), before)?;
        let start = self.mark(Stream::Compute)?;
        if let Some(trace) = self.trace.as_mut() {
            match phase {
                Phase::Forward => trace.forward[u] = start,
                Phase::Backward => trace.backward[u] = start,
            }
        }
        Ok(())
    }

    /// Closes unit `u`'s compute span of `phase`, if tracing opened one.
    fn end_span(&mut self, u: usize, phase: Phase) -> Result<()> {
        let unit = self.plan.units()[u];
        let (start, kind) = match (self.trace.as_mut(), phase) {
            (Some(t), Phase::Forward) => (t.forward[u].take(), SpanKind::Forward(unit)),
            (Some(t), Phase::Backward) => (t.backward[u].take(), SpanKind::Backward(unit)),
            (None, _) => return Ok(()),
        };
        self.push_span(Stream::Compute, kind, start)
    }

    fn use_unit(&mut self, u: usize) -> Result<()> {
        let mut fx = std::mem::take(&mut self.gather_effects);
        fx.clear();
        let plan = Arc::clone(&self.plan);
        let mut result = Ok(());
        for &g in plan.unit_groups(u) {
            if self.gathers.state(g) == BufferState::Ready {
                self.counters.reuses += 1;
            }
            result = self.gathers.acquire(g, &mut fx);
            if result.is_err() {
                break;
            }
        }
        if result.is_ok() && self.config.overlap {
            if let Some(next) = self.schedule.predict_next() {
                for &g in plan.unit_groups(next) {
                    let before = fx.len();
                    match self.gathers.prefetch(g, &mut fx) {
                        Ok(true) => self.counters.prefetches += (fx.len() > before) as u64,
                        Ok(false) => {}
                        Err(e) => {
                            result = Err(e);
                            break;
                        }
                    }
                }
            }
        }
        let applied = self.apply_gather_effects(&fx);
        self.gather_effects = fx;
        result.and(applied)
    }

    fn release_unit(&mut self, u: usize) -> Result<()> {
        let done = Arc::new(self.backend.record(Stream::Compute)?);
        let plan = Arc::clone(&self.plan);
        for &g in plan.unit_groups(u) {
            self.gathers.release(g)?;
            self.released[g] = Some(Arc::clone(&done));
        }
        Ok(())
    }

    fn apply_gather_effects(&mut self, effects: &[GatherEffect]) -> Result<()> {
        for &effect in effects {
            match effect {
                GatherEffect::Evict(g) => {
                    if let Some(Placement::Slot(mut slot)) = self.placed[g].take() {
                        slot.free_after = self.released[g].take();
                        self.free_slots.push(slot);
                    }
                    self.gathered[g] = None;
                    self.counters.evictions += 1;
                }
                GatherEffect::Gather(g) => self.gather(g)?,
                GatherEffect::Wait(g) => {
                    if let Some(done) = self.gathered[g].take() {
                        self.backend.wait(Stream::Compute, &done)?;
                    }
                }
            }
        }
        Ok(())
    }

    fn gather(&mut self, g: usize) -> Result<()> {
        self.counters.all_gathers += 1;
        if self.plan.world_size() == 1 {
            self.placed[g] = Some(Placement::Shard);
            return Ok(());
        }
        let slot = match self.free_slots.pop() {
            Some(slot) => slot,
            None => {
                self.slot_buffers
                    .push(self.backend.alloc(self.plan.gather_slot_bytes())?);
                self.counters.extra_slots += 1;
                GatherSlot {
                    buffer_index: self.slot_buffers.len() - 1,
                    free_after: None,
                }
            }
        };
        if let Some(done) = &slot.free_after {
            self.backend.wait(Stream::Gather, done)?;
        }
        // The first gather after an optimizer step waits for it; later ones follow on the stream.
        if let Some(updated) = self.shards_updated.take() {
            self.backend.wait(Stream::Gather, &updated)?;
        }
        let start = self.mark(Stream::Gather)?;
        let group = &self.plan.groups()[g];
        let shard_region = Region::new(0, group.shard_numel, group.dtype);
        let full_region = Region::new(0, group.padded_numel, group.dtype);
        // SAFETY: the gather stream writes the slot after compute's last use of the group that
        // held it (`free_after`, waited above) and reads the shard after the optimizer's last
        // write (`shards_updated`, waited above for the step's first gather; later ones follow it
        // on the gather stream). The optimizer waits for the gather stream before it writes.
        let result = unsafe {
            self.comm.all_gather(
                &self.backend,
                Stream::Gather,
                &self.shards[g],
                shard_region,
                &mut self.slot_buffers[slot.buffer_index],
                full_region,
            )
        };
        self.placed[g] = Some(Placement::Slot(GatherSlot {
            free_after: None,
            ..slot
        }));
        result?;
        self.push_span(Stream::Gather, SpanKind::AllGather { group: g }, start)?;
        self.gathered[g] = Some(self.backend.record(Stream::Gather)?);
        Ok(())
    }

    fn apply_grad_effects(
        &mut self,
        effects: &[GradEffect],
        input: Option<Input<'_>>,
    ) -> Result<()> {
        for &effect in effects {
            match effect {
                GradEffect::Retire { slot } => {
                    if let Some(reduced) = self.grad_slots[slot].reduced.take() {
                        self.backend.wait(Stream::Compute, &reduced)?;
                    }
                }
                // SAFETY (the three compute-stream writes of a place): a slot is written only
                // once the compute stream waited for the reduction that last read it (`Retire`,
                // which the pipeline issues before it hands the slot out again); a shard (world
                // size 1) only for a step's first gradients, after `finish_grad_sync` made compute
                // wait for every reduction of the step before.
                GradEffect::ZeroPadding { place, group } => {
                    for i in 0..self.padding[group].len() {
                        let region = self.padding[group][i];
                        let buffer =
                            place_buffer(&mut self.grad_slots, &mut self.grad_shards, place)?;
                        // SAFETY: see above.
                        unsafe { self.backend.zero(Stream::Compute, buffer, region) }?;
                    }
                }
                GradEffect::ZeroParam { place, param } => {
                    let layout = &self.plan.params()[param];
                    let region = Region::new(layout.offset, layout.numel, DType::F32);
                    let buffer = place_buffer(&mut self.grad_slots, &mut self.grad_shards, place)?;
                    // SAFETY: see above.
                    unsafe { self.backend.zero(Stream::Compute, buffer, region) }?;
                }
                GradEffect::Write { param, place } => {
                    let layout = &self.plan.params()[param];
                    let region = Region::new(layout.offset, layout.numel, DType::F32);
                    if let Some(input) = input {
                        let buffer =
                            place_buffer(&mut self.grad_slots, &mut self.grad_shards, place)?;
                        // SAFETY: see above.
                        unsafe {
                            self.backend.accumulate_input(
                                Stream::Compute,
                                input,
                                buffer,
                                region,
                                1.0,
                                false,
                            )
                        }?;
                    }
                }
                GradEffect::Reduce {
                    group,
                    slot,
                    overwrite,
                } => self.reduce(group, slot, overwrite)?,
                GradEffect::ZeroShard { group } => {
                    let numel = self.plan.groups()[group].shard_numel;
                    if let Some(shard) = self.grad_shards[group].as_mut() {
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

    fn reduce(&mut self, group: usize, slot: usize, overwrite: bool) -> Result<()> {
        let g = &self.plan.groups()[group];
        let written = self.backend.record(Stream::Compute)?;
        self.backend.wait(Stream::Reduce, &written)?;
        let start = self.mark(Stream::Reduce)?;
        let buffer = &mut self.grad_slots[slot].buffer;
        // At world size 1 the sum over ranks is the slot itself.
        if self.plan.world_size() > 1 {
            // SAFETY: the reduce stream waited (above) for compute's writes of the slot; compute
            // writes it again only after waiting for this reduction (`Retire`).
            unsafe {
                self.comm.reduce_scatter(
                    &self.backend,
                    Stream::Reduce,
                    buffer,
                    Region::new(0, g.padded_numel, DType::F32),
                )
            }?;
        }
        self.counters.reduce_scatters += 1;
        let scale = match self.config.grad_reduction {
            GradReduction::Mean => 1.0 / self.plan.world_size() as f32,
            GradReduction::Sum => 1.0,
        };
        let own = Region::new(self.rank * g.shard_numel, g.shard_numel, DType::F32);
        let Some(shard) = self.grad_shards[group].as_mut() else {
            return Ok(());
        };
        // SAFETY: the slot as above; the gradient shard is written after every compute-stream
        // use of it so far (the wait above: the previous step's optimizer, this step's direct
        // writes at world size 1) and read by compute only after `finish_grad_sync` waited for
        // the reduce stream.
        unsafe {
            self.backend.accumulate(
                Stream::Reduce,
                buffer,
                own,
                shard,
                Region::new(0, g.shard_numel, DType::F32),
                scale,
                !overwrite,
            )
        }?;
        self.push_span(Stream::Reduce, SpanKind::ReduceScatter { group }, start)?;
        self.grad_slots[slot].reduced = Some(self.backend.record(Stream::Reduce)?);
        Ok(())
    }
}

impl<C: Communicator<CpuBackend>> Engine<CpuBackend, C> {
    /// The gathered values of `param`, readable while one of its unit's hooks is open.
    ///
    /// On an asynchronous backend it first waits for the compute stream (the host reads the view
    /// as compute-stream work).
    pub fn param<T: Element>(&self, param: ParamId) -> Result<&[T]> {
        let (layout, slot) = self.gathered_view(param)?;
        if layout.dtype != T::DTYPE {
            return Err(Error::DtypeMismatch {
                name: layout.name.clone(),
                param: layout.dtype,
                requested: T::DTYPE,
            });
        }
        self.backend.drain(Stream::Compute)?;
        let region = Region::new(layout.offset, layout.numel, layout.dtype);
        // SAFETY: the compute stream completed its work, which waited for the gather (the hook
        // that opened the unit); no stream writes a gathered buffer in use (a slot is reused only
        // once its group was evicted, which needs every hook of its unit closed, hence `&mut
        // self`), nor a shard viewed at world size 1 outside the optimizer (compute, drained).
        let bytes = unsafe { self.backend.host_bytes(slot, region) }?;
        bytemuck::try_cast_slice(bytes).map_err(|_| Error::OutOfRange {
            offset: layout.offset,
            len: layout.numel,
            capacity: bytes.len() / layout.dtype.size(),
        })
    }

    /// `param`'s fp32 place in its gradient slot, to overwrite whole with this pass's gradient
    /// before [`Engine::commit_grad`]. It is not zero-filled: it holds what an earlier gradient
    /// left there, so adding into it (as a GEMM with beta = 1 would) gives a wrong gradient.
    ///
    /// On an asynchronous backend it first waits for the compute stream (the host writes the slot
    /// as compute-stream work).
    pub fn grad_slot(&mut self, param: ParamId) -> Result<&mut [f32]> {
        let (place, region) = self.open_grad_slot(param)?;
        self.backend.drain(Stream::Compute)?;
        let buffer = place_buffer(&mut self.grad_slots, &mut self.grad_shards, place)?;
        // SAFETY: the compute stream completed its work, which waited for the reduction that last
        // read the place (see `apply_grad_effects`); no stream touches the place again before
        // `commit_grad` queues its reduction after this write.
        let bytes = unsafe { self.backend.host_bytes_mut(buffer, region) }?;
        bytemuck::try_cast_slice_mut(bytes).map_err(|_| Error::OutOfRange {
            offset: region.offset,
            len: region.len,
            capacity: 0,
        })
    }
}

impl<B: RawAddress, C: Communicator<B>> Engine<B, C> {
    /// The address of `param`'s gathered values (host on the CPU, device on a GPU), valid while
    /// one of its unit's hooks is open; read only.
    pub fn param_address(&self, param: ParamId) -> Result<u64> {
        let (layout, slot) = self.gathered_view(param)?;
        self.backend
            .address(slot, Region::new(layout.offset, layout.numel, layout.dtype))
    }

    /// The address of `param`'s fp32 place in its gradient slot, for the caller to overwrite
    /// whole with this pass's gradient (on a GPU, on the compute stream) before
    /// [`Engine::commit_grad`]. It is not zero-filled: it holds what an earlier gradient left
    /// there, so adding into it (as a GEMM with beta = 1 would) gives a wrong gradient. On the CPU
    /// it first waits for the compute stream.
    pub fn grad_slot_address(&mut self, param: ParamId) -> Result<u64> {
        let (place, region) = self.open_grad_slot(param)?;
        self.backend.address_mut(
            place_buffer(&mut self.grad_slots, &mut self.grad_shards, place)?,
            region,
        )
    }
}
