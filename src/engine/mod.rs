//! One rank's runtime: owns the shards, slots and optimizer state, applies the decisions of
//! the crate's pure machines (`state`, `schedule`, `grads`) through a backend and a communicator.
//!
//! - `mod.rs`: creation, the hooks, the failure policy (misuse changes nothing; a failure once
//!   work began poisons the engine), the collectives' tags.
//! - `gather`: gather slots, placement and the all-gathers; `reduce`: gradient slots and the
//!   reductions; `step`: the sync, the optimizer, the end of a step, loads and shard reads;
//!   `views`: the gathered parameters and gradient places as the caller reads and writes them;
//!   `checks`: the ranks' comparisons of their plans and their collectives; `agree`: the ranks'
//!   agreement on a step all take or none; `parts`: the rank's state as a checkpoint holds it;
//!   `save`, `load`: checkpoints; `full_model`: safetensors exports and imports; `spans`: tracing.

mod agree;
mod capture;
mod checks;
mod create;
mod deadlines;
mod full_model;
mod gather;
#[cfg(feature = "fault-injection")]
mod hang;
mod load;
mod norm;
mod parts;
mod reduce;
mod save;
mod spans;
mod step;
mod views;

use std::collections::BTreeSet;
use std::sync::{Arc, OnceLock};

use crate::backend::{Backend, MemoryUsage, Region};
use crate::comm::{Communicator, Fingerprint, Purpose, Tag};
use crate::config::{EngineConfig, GradShardMemory};
use crate::error::{Error, Result};
use crate::grads::{GradPipeline, Passes};
use crate::plan::{Plan, Policy};
use crate::schedule::Phase;
use crate::types::{BufferState, DType, Stream, Unit};
use crate::watch::{AbortHandle, Watch};
pub use create::Refused;
use gather::Gathering;
pub use norm::GradNorm;
use reduce::Reducing;
use spans::Trace;
use step::OptimizerState;

pub use capture::{CapturedStep, StepReplay};
pub use views::DeviceTensor;

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
    /// Reductions of a group's gradients from where they were taken (a slot, or the fp32
    /// accumulator of no-sync accumulation) into its shard: a reduce-scatter where gradients
    /// travel, a scaled copy on the rank where they do not. Gradients written straight into the
    /// shards (at world size 1 with nothing to scale) take none.
    pub reduce_scatters: u64,
    /// Gather slots allocated beyond `double_buffer_limit` because a required gather found
    /// every gathered buffer in use.
    pub extra_slots: u64,
    /// Times the host blocked on the device.
    pub host_waits: u64,
    pub steps: u64,
    /// Steps whose gradients were synced that ended without an optimizer step (skipped, say for
    /// non-finite gradients).
    pub skipped_steps: u64,
}

/// One rank's FSDP runtime over backend `B` and communicator `C`.
///
/// A step is: for each micro-batch, the forward hooks of each unit in execution order
/// ([`Engine::pre_forward`] / [`Engine::post_forward`]), then the backward hooks in reverse
/// ([`Engine::pre_backward`] / [`Engine::post_backward`]) with one [`Engine::grad`] per trainable
/// parameter; then [`Engine::finish_grad_sync`], [`Engine::optimizer_step`] and
/// [`Engine::end_step`]. Gradients of several micro-batches add up until the step ends.
///
/// A misuse (a hook out of order, a bad gradient) is a specific error that changes nothing. A
/// failure once a call's work began (a device or communicator error, a peer gone, a deadline
/// passed, an abort) poisons the engine: every later call returns [`Error::Poisoned`] naming the
/// first failure, and no view is handed out.
pub struct Engine<B: Backend, C: Communicator<B>> {
    /// First, so that dropping the engine releases a held stream before anything waits on it.
    #[cfg(feature = "fault-injection")]
    hang: Option<hang::Hang>,
    plan: Arc<Plan>,
    config: EngineConfig,
    /// The configuration resolved on the plan: the buffers allocated, the slots, the limits.
    policy: Policy,
    rank: usize,
    // The backend is dropped before the communicator: its queued collectives finish (or fail)
    // while the group still counts this rank in.
    backend: B,
    comm: C,
    /// One communicator per process group of the plan, in its order.
    process_groups: Vec<C>,
    watch: Watch,
    /// The collectives in flight, held to the engine's timeout by a thread of its own.
    deadlines: deadlines::Deadlines<B::Event>,
    /// The first failure once a call's work began; set through `&self` too, since a read of the
    /// device is where an asynchronous failure shows.
    poisoned: OnceLock<Error>,
    /// Each group's shard of its parameters, in their dtype (empty for a master-only group).
    param_shards: Vec<B::Buffer>,
    gathering: Gathering<B::Buffer, B::Event>,
    reducing: Reducing<B::Buffer, B::Event>,
    optimizer: OptimizerState<B::Buffer>,
    open: OpenUnits,
    collectives: CollectiveLog,
    counters: Counters,
    trace: Option<Trace<B::Event>>,
    saving: save::Saving<B::HostBuffer>,
    /// This engine's identity among the process's engines, which its captured steps carry.
    id: u64,
    /// The capture under way ([`Engine::begin_capture`]).
    capture: Option<capture::Capturing>,
    /// Between [`Engine::before_replay`] and [`Engine::replayed`]: the caller's replay of this
    /// captured step is due.
    replay_pending: Option<u64>,
}

/// The units whose forward, and whose backward, is open.
#[derive(Default)]
struct OpenUnits {
    forward: BTreeSet<usize>,
    backward: BTreeSet<usize>,
}

/// The collectives issued since the step began.
#[derive(Default)]
struct CollectiveLog {
    in_step: u64,
    /// Their fingerprints, kept when [`EngineConfig::verify_collectives`] is on.
    issued: Vec<Fingerprint>,
}

/// Allocates `bytes` for `what`, naming it when memory runs out.
fn alloc<B: Backend>(backend: &B, bytes: usize, what: impl Fn() -> String) -> Result<B::Buffer> {
    naming_what_ran_out(backend.alloc(bytes), what)
}

/// `result`, an allocation's, with `what` named in its error when memory ran out.
fn naming_what_ran_out<T>(result: Result<T>, what: impl Fn() -> String) -> Result<T> {
    result.map_err(|e| match e {
        Error::OutOfMemory { bytes, .. } => Error::OutOfMemory {
            bytes,
            what: what(),
        },
        other => other,
    })
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The configuration resolved on the plan: what the engine allocated and decides by.
    pub fn policy(&self) -> &Policy {
        &self.policy
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
        Ok(self.gathering.machine.state(group))
    }

    /// Gathered buffers now (SYNCING, USING or READY).
    pub fn gathered_count(&self) -> usize {
        self.gathering.machine.gathered()
    }

    /// This rank's replica under hybrid sharding, and how many there are (`(0, 1)` without).
    pub fn replica(&self) -> crate::comm::Replica {
        self.comm.replica()
    }

    /// A handle that aborts this engine from another thread: a blocked call returns
    /// [`Error::Aborted`], the engine is poisoned, its peers see it gone, and its communicators
    /// end their collectives under way on the device, so that its streams drain.
    pub fn abort_handle(&self) -> AbortHandle {
        AbortHandle(self.watch.clone())
    }

    /// Whether a step is under way: a hook, gradient or sync since the last [`Engine::end_step`].
    pub fn in_step(&self) -> bool {
        self.gathering.schedule.phase().is_some()
            || self.reducing.open_slot.is_some()
            || self.reducing.pipeline.pending()
            || self.reducing.pipeline.synced()
            || self.optimizer.stepped
    }

    /// The first failure that poisoned the engine, if any.
    pub fn poisoned(&self) -> Option<&Error> {
        self.poisoned.get()
    }

    /// Marks the engine failed with `cause` (also a panic in a call, seen by the C API) and
    /// aborts its communicator, so that work queued on its streams ends instead of waiting for
    /// peers.
    pub(crate) fn poison(&self, cause: Error) {
        // Only the first failure is kept.
        if self.poisoned.set(cause).is_ok() {
            // The capture's graph is of no use any more; its end lets the streams go on. (The
            // communicators' abort below can still fail a caller's capture, which a failure
            // inside it does anyway.)
            self.drop_backend_capture();
            self.comm.abort();
            for c in &self.process_groups {
                c.abort();
            }
        }
    }

    /// `Err(Error::Poisoned)` once a failure poisoned the engine or it was aborted (naming that
    /// as its cause); a failure its communicator or watch found since poisons it.
    pub(crate) fn healthy(&self) -> Result<()> {
        if let Some(cause) = self.poisoned.get() {
            return Err(Error::Poisoned {
                cause: Box::new(cause.clone()),
            });
        }
        let health = self
            .watch
            .check()
            .and_then(|()| self.comm.health())
            .and_then(|()| {
                self.process_groups
                    .iter()
                    .try_for_each(Communicator::<B>::health)
            });
        match health {
            // Aborted while idle: the call is the first to see it, and is refused as every
            // later one is.
            Err(Error::Aborted) => {
                self.poison(Error::Aborted);
                Err(Error::Poisoned {
                    cause: Box::new(Error::Aborted),
                })
            }
            found => self.observe(found),
        }
    }

    /// Runs the part of a call that changes the engine, after joining the caller's capture
    /// where one awaits the step's first work ([`Engine::join_capture`]): an error there
    /// leaves the engine half-done, so it poisons it.
    fn effects<T>(&mut self, work: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        self.join_callers_capture()?;
        let result = work(self);
        self.observe(result)
    }

    /// Poisons the engine with the error of `result`, the outcome of work on the device.
    fn observe<T>(&self, result: Result<T>) -> Result<T> {
        if let Err(e) = &result {
            self.poison(e.clone());
        }
        result
    }

    /// Between [`Engine::optimizer_step`] and [`Engine::end_step`] the gathered buffers hold the
    /// weights from before the update, and gathers would race the optimizer's writes: nothing but
    /// the end of the step is allowed.
    fn check_not_stepped(&self, action: &'static str) -> Result<()> {
        if self.optimizer.stepped {
            return Err(Error::OptimizerStepped { action });
        }
        Ok(())
    }

    /// Refuses more gradients once the step's clipping or skip was decided over those so far:
    /// the decision (a host coefficient, the device's norm parts) would not see them.
    fn check_undecided(&self, action: &'static str) -> Result<()> {
        let o = &self.optimizer;
        if o.clip.is_some() || o.skip_nonfinite || o.parts_on_device {
            return Err(Error::GradientsDecided { action });
        }
        Ok(())
    }

    fn unit_index(&self, unit: Unit) -> Result<usize> {
        self.plan
            .unit_index(unit)
            .ok_or(Error::UnknownUnit { unit })
    }

    /// This rank's place among the ranks of process group `process_group` (`None`: its
    /// replica's data-parallel ranks), and their number.
    fn peers(&self, process_group: Option<usize>) -> (usize, usize) {
        match process_group.and_then(|pg| self.plan.process_groups().get(pg)) {
            Some(g) => (self.rank % g.size, g.size),
            None => (self.rank, self.plan.world_size()),
        }
    }

    /// Marks the current end of `stream`'s work, after `collective` where one was just queued
    /// on it (this rank at place `peers.0` of `peers.1`), which is then held to the engine's
    /// timeout ([`deadlines`]) until its stream reaches the mark.
    fn record_collective(
        &mut self,
        stream: Stream,
        collective: Option<(Fingerprint, (usize, usize))>,
    ) -> Result<Arc<B::Event>> {
        #[cfg(feature = "fault-injection")]
        if collective.is_some() {
            hang::Hang::after_collective(&mut self.hang, &self.backend, stream)?;
        }
        let done = Arc::new(self.backend.record(stream)?);
        // A captured collective runs at its replays, which hold it to the deadline: its
        // event here is never recorded.
        match (collective, self.capture.as_mut()) {
            (Some((collective, peers)), Some(capture)) => capture.hold(collective, peers)?,
            (Some((collective, peers)), None) => {
                self.deadlines.track(collective, peers, Arc::clone(&done))
            }
            (None, _) => {}
        }
        Ok(done)
    }

    /// The tag of the next collective, for `purpose`; its fingerprint is kept for the step's
    /// verification when that is on.
    fn next_tag(&mut self, purpose: Purpose, fingerprint: impl FnOnce(Tag) -> Fingerprint) -> Tag {
        let tag = Tag {
            purpose,
            step: self.counters.steps,
            seq: self.collectives.in_step,
        };
        self.collectives.in_step += 1;
        if self.config.verify_collectives {
            self.collectives.issued.push(fingerprint(tag));
        }
        tag
    }

    /// Before `unit`'s forward: its groups are gathered (reused if READY) and compute waits for
    /// them; the next unit expected is prefetched. Does not block the host on a GPU. A forward
    /// while a unit's backward is open (a recompute, for activation checkpointing) is part of
    /// that backward pass: it does not end the pass.
    pub fn pre_forward(&mut self, unit: Unit) -> Result<()> {
        let _range = crate::nvtx::range("pre_forward", unit);
        self.healthy()?;
        self.check_not_stepped("a forward")?;
        self.check_captured_step_open()?;
        let u = self.unit_index(unit)?;
        if self.open.forward.contains(&u) {
            return Err(Error::ForwardAlreadyOpen { unit });
        }
        self.check_no_open_slot()?;
        if self.config.step_in_backward && self.open.backward.is_empty() && self.has_gradients() {
            return Err(Error::StepInBackward {
                what: "a forward after the step's backward (a second pass)",
            });
        }
        self.effects(|e| {
            // A forward while a backward is open recomputes activations inside that backward
            // (activation checkpointing): it belongs to the backward pass, so it neither ends
            // the pass (which would reduce half-filled groups early) nor starts a forward one,
            // and prefetching keeps to the backward order.
            if e.open.backward.is_empty() {
                e.begin(Phase::Forward, u)?;
            }
            e.open.forward.insert(u);
            e.use_unit_traced(u, Phase::Forward)
        })
    }

    /// After `unit`'s forward: its groups become READY once no hook uses them.
    pub fn post_forward(&mut self, unit: Unit) -> Result<()> {
        let _range = crate::nvtx::range("post_forward", unit);
        self.healthy()?;
        self.check_not_stepped("a forward")?;
        let u = self.unit_index(unit)?;
        if !self.open.forward.contains(&u) {
            return Err(Error::ForwardNotOpen { unit });
        }
        self.effects(|e| {
            e.open.forward.remove(&u);
            e.end_span(u, Phase::Forward)?;
            e.release_unit(u)
        })
    }

    /// Before `unit`'s backward: as [`Engine::pre_forward`], prefetching the unit expected next in
    /// backward order.
    pub fn pre_backward(&mut self, unit: Unit) -> Result<()> {
        let _range = crate::nvtx::range("pre_backward", unit);
        self.healthy()?;
        self.check_not_stepped("a backward")?;
        self.check_undecided("a backward")?;
        self.check_captured_step_open()?;
        let u = self.unit_index(unit)?;
        if self.open.backward.contains(&u) {
            return Err(Error::BackwardAlreadyOpen { unit });
        }
        self.check_no_open_slot()?;
        if self.config.step_in_backward && self.reducing.pipeline.synced() {
            // Its groups were updated, and their gradient shards may be freed.
            return Err(Error::StepInBackward {
                what: "a backward after the step's gradients were synced",
            });
        }
        self.effects(|e| {
            e.begin(Phase::Backward, u)?;
            // Each rank's hooks begin its pass, after the step's sync too (where the phase
            // stays the backward's), whichever gradients it gets.
            e.reducing.pipeline.begin_pass();
            e.open.backward.insert(u);
            e.use_unit_traced(u, Phase::Backward)
        })
    }

    /// After `unit`'s backward. Optional where the ranks hand over the same gradients in the
    /// same order: [`Engine::finish_grad_sync`] ends any backward still open. Where gradients
    /// travel between ranks (above world size 1, or with replicas) it reduce-scatters every
    /// trainable group of the unit (not the root's, which take gradients until the pass ends),
    /// a parameter with no gradient counting as zero, and the unit's later gradients of the
    /// pass are refused. Ranks whose gradients differ (some without a parameter's) end each
    /// unit's backward before the next unit's gradients: the reductions then follow the hooks,
    /// which every rank issues alike. A pass of hooks with no gradient at all reduces zeros
    /// and ends with [`Engine::finish_grad_sync`] like any other.
    pub fn post_backward(&mut self, unit: Unit) -> Result<()> {
        let _range = crate::nvtx::range("post_backward", unit);
        self.healthy()?;
        self.check_not_stepped("a backward")?;
        let u = self.unit_index(unit)?;
        if !self.open.backward.contains(&u) {
            return Err(Error::BackwardNotOpen { unit });
        }
        // Its end would end the unit's groups under the open slot.
        self.check_no_open_slot()?;
        self.effects(|e| {
            e.open.backward.remove(&u);
            e.end_span(u, Phase::Backward)?;
            e.release_unit(u)?;
            e.complete_unit(unit)
        })
    }

    /// Whether the step has gradients: some arrived, or they were synced.
    fn has_gradients(&self) -> bool {
        self.reducing.pipeline.pending() || self.reducing.pipeline.synced()
    }

    /// Where updates run in the backward, refuses `what`, which needs the whole gradient before
    /// the updates.
    fn refuse_in_backward_updates(&self, what: &'static str) -> Result<()> {
        match self.config.step_in_backward {
            true => Err(Error::StepInBackward { what }),
            false => Ok(()),
        }
    }

    /// Where updates run in the backward, refuses `what` once the step has gradients: an update
    /// may have run.
    fn check_before_updates(&self, what: &'static str) -> Result<()> {
        match self.config.step_in_backward && self.has_gradients() {
            true => Err(Error::StepInBackward { what }),
            false => Ok(()),
        }
    }

    /// A gradient slot the caller is writing must be committed before anything else.
    fn check_no_open_slot(&self) -> Result<()> {
        match self.reducing.open_slot {
            Some(open) => Err(Error::GradSlotOpen {
                name: self.plan.params()[open.0].name.clone(),
            }),
            None => Ok(()),
        }
    }

    fn begin(&mut self, phase: Phase, unit: usize) -> Result<()> {
        self.enter(phase)?;
        self.gathering.schedule.record(unit);
        Ok(())
    }

    /// Enters `phase`; leaving a backward pass reduces the groups still waiting for gradients.
    /// (A pass of gradients begins at a `pre_backward` or a gradient, whatever the phase.)
    fn enter(&mut self, phase: Phase) -> Result<()> {
        if self.gathering.schedule.enter(phase) != Some(Phase::Backward) {
            return Ok(());
        }
        self.apply_decided(GradPipeline::end_pass)
    }
}

/// The communicator of the ranks that shard a group of process group `process_group` (`None`:
/// the data-parallel world).
fn group_comm<'a, C>(
    comm: &'a mut C,
    process_groups: &'a mut [C],
    process_group: Option<usize>,
) -> Result<&'a mut C> {
    match process_group {
        None => Ok(comm),
        Some(pg) => {
            let count = process_groups.len();
            process_groups
                .get_mut(pg)
                .ok_or(Error::GroupOutOfRange { group: pg, count })
        }
    }
}
