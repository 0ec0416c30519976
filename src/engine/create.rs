//! Making an engine: its arguments checked, every buffer the plan predicts allocated, the
//! ranks' plans and settings compared, and the parts assembled; or, refused, what it was given
//! handed back.

use super::reduce::{GradSlot, GroupGrads};
use super::step::{GroupOptimizerState, StepChecks};
use super::*;
use crate::grads::{GradRoute, Updates};
use crate::plan::Group;

/// An engine that could not be made, with the backend and communicators it was given: the rank
/// can try again with them (its peers have not heard from it, unless the ranks' plans differed).
pub struct Refused<B, C> {
    pub error: Error,
    pub backend: B,
    pub comm: C,
    pub process_groups: Vec<C>,
}

impl<B, C> std::fmt::Debug for Refused<B, C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Refused")
            .field("error", &self.error)
            .finish_non_exhaustive()
    }
}

/// The engine's parts as a plan makes them: every buffer allocated up front (per-step gradient
/// shards come later) and the pure machines.
struct Parts<B: Backend> {
    param_shards: Vec<B::Buffer>,
    gathering: Gathering<B::Buffer, B::Event>,
    reducing: Reducing<B::Buffer, B::Event>,
    optimizer: OptimizerState<B::Buffer>,
}

impl<B: Backend> Parts<B> {
    /// Allocates every buffer of `policy`'s layout but per-step gradient shards, which come
    /// with the step's first gradient of their group.
    fn make(plan: &Plan, config: &EngineConfig, policy: &Policy, backend: &B) -> Result<Self> {
        let layout = &policy.layout;
        let what = "the engine's buffer lists";
        let groups = layout.groups.len();
        let mut param_shards = crate::fallible::with_capacity(groups, what)?;
        let mut grads = crate::fallible::with_capacity(groups, what)?;
        let mut optimizer = crate::fallible::with_capacity(groups, what)?;
        for ((i, g), group) in layout.groups.iter().enumerate().zip(plan.groups()) {
            let buffer = |bytes: usize, what: &str| {
                alloc(backend, bytes, || format!("the {what} of group {i}"))
            };
            param_shards.push(buffer(g.shard, "parameter shard")?);
            let grad_shard = g.grad_shard.filter(|_| !layout.per_step_grad_shards);
            let shard = (grad_shard.map(|b| buffer(b, "gradient shard"))).transpose()?;
            let master = (g.master.map(|b| buffer(b, "fp32 master shard"))).transpose()?;
            let moment_pair = |b| Ok((buffer(b, "first moment")?, buffer(b, "second moment")?));
            let moments = g.moment.map(moment_pair).transpose()?;
            let accumulator =
                (g.accumulator.map(|b| buffer(b, "gradient accumulator"))).transpose()?;
            grads.push(GroupGrads {
                shard,
                accumulator,
                padding: padding_of(plan, group),
            });
            optimizer.push(GroupOptimizerState { master, moments });
        }
        let mut gather_slots = crate::fallible::with_capacity(layout.gather_slots, what)?;
        for i in 0..layout.gather_slots {
            let slot = alloc(backend, layout.gather_slot_bytes, || {
                format!("gather slot {i}")
            });
            gather_slots.push(slot?);
        }
        let mut grad_slots = crate::fallible::with_capacity(layout.grad_slots, what)?;
        for i in 0..layout.grad_slots {
            grad_slots.push(GradSlot {
                buffer: alloc(backend, layout.grad_slot_bytes, || {
                    format!("gradient slot {i}")
                })?,
                reduced: None,
            });
        }
        let scratch = |bytes: usize, what: &str| alloc(backend, bytes, || what.to_string());
        let step_scratch = layout.step_scratch.map(|s| {
            Ok::<_, Error>(StepChecks {
                norm_part: scratch(s.norm_part, "the gradient norms' part")?,
                norm_parts: scratch(s.norm_parts, "every rank's part of the gradient norms")?,
                nonfinite_count: scratch(s.nonfinite_count, "the non-finite count")?,
                step_values: scratch(s.step_values, "the step's values")?,
                skipped_steps: scratch(s.skipped_steps, "the steps skipped on the device")?,
            })
        });
        let limit = policy.limits.gathered;
        Ok(Parts {
            param_shards,
            gathering: Gathering::new(groups, plan.units().len(), limit, gather_slots),
            reducing: Reducing {
                pipeline: grad_pipeline(plan, config, policy),
                groups: grads,
                slots: grad_slots,
                open_slot: None,
                effects: Vec::new(),
            },
            optimizer: OptimizerState::new(optimizer, step_scratch.transpose()?),
        })
    }
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Allocates every buffer the plan predicts (shards, gradient shards unless per step,
    /// optimizer state, gather and gradient slots), then compares the ranks' plans (a collective: every rank makes its
    /// engine at the same point) and refuses to start on a difference, naming the first differing
    /// parameter. Parameters start at zero until [`Engine::load_param`].
    pub fn new(plan: Arc<Plan>, config: EngineConfig, backend: B, comm: C) -> Result<Self> {
        Engine::try_new(plan, config, backend, comm).map_err(|refused| refused.error)
    }

    /// As [`Engine::new`], giving the backend and the communicator back on failure, so that the
    /// rank can try again (say with a smaller configuration after `Error::OutOfMemory`, or
    /// once a peer that was late came). A meeting that failed leaves nothing in the
    /// communicator; a backend whose stream ran a failed collective (an asynchronous CPU
    /// backend's after the ranks' plan check timed out) reports that failure again, and the
    /// retry takes a fresh one.
    pub fn try_new(
        plan: Arc<Plan>,
        config: EngineConfig,
        backend: B,
        comm: C,
    ) -> std::result::Result<Self, Refused<B, C>> {
        Engine::try_with_process_groups(plan, config, backend, comm, Vec::new())
    }

    /// As [`Engine::new`] for a plan whose parameters name process groups
    /// ([`crate::ProcessGroupSpec`]): `process_groups[i]` joins this rank to the ranks of its
    /// group of the plan's `i`th process group (rank `r` of `comm` at place `r % size` of the
    /// group of ranks `r / size * size ..`), and carries that group's collectives.
    pub fn with_process_groups(
        plan: Arc<Plan>,
        config: EngineConfig,
        backend: B,
        comm: C,
        process_groups: Vec<C>,
    ) -> Result<Self> {
        Engine::try_with_process_groups(plan, config, backend, comm, process_groups)
            .map_err(|refused| refused.error)
    }

    /// As [`Engine::with_process_groups`], giving everything back on failure as
    /// [`Engine::try_new`] does.
    pub fn try_with_process_groups(
        plan: Arc<Plan>,
        config: EngineConfig,
        mut backend: B,
        mut comm: C,
        mut process_groups: Vec<C>,
    ) -> std::result::Result<Self, Refused<B, C>> {
        let watch = Watch::new(config.timeout);
        backend.set_watch(&watch);
        comm.set_watch(&watch);
        for c in &mut process_groups {
            c.set_watch(&watch);
        }
        let parts = Engine::<B, C>::check_arguments(&plan, &config, &backend, &comm)
            .and_then(|()| check_process_groups(&plan, comm.rank(), &process_groups))
            .and_then(|()| Policy::new(&plan, &config))
            .and_then(|policy| {
                let parts = Parts::make(&plan, &config, &policy, &backend)?;
                let bytes = parts::state_bytes(&plan, &config);
                let staging = (config.save_staging)
                    .then(|| Ok::<_, Error>((backend.alloc_host(bytes)?, bytes)))
                    .transpose()?;
                let deadlines = deadlines::Deadlines::start(watch.clone(), B::reached)?;
                Ok((policy, parts, (staging, deadlines)))
            });
        let (policy, parts, (save_staging, deadlines)) = match parts {
            Ok(parts) => parts,
            Err(error) => {
                return Err(Refused {
                    error,
                    backend,
                    comm,
                    process_groups,
                });
            }
        };
        let comms = (comm, process_groups);
        let watching = (watch, deadlines);
        let mut engine = Engine::assemble((plan, config, policy), backend, comms, watching, parts);
        engine.saving.staging = save_staging;
        if let Err(error) = engine.check_plans() {
            let Engine {
                backend,
                comm,
                process_groups,
                ..
            } = engine;
            return Err(Refused {
                error,
                backend,
                comm,
                process_groups,
            });
        }
        Ok(engine)
    }

    fn check_arguments(plan: &Plan, config: &EngineConfig, backend: &B, comm: &C) -> Result<()> {
        config.validate()?;
        if config.grad_shard_memory == GradShardMemory::PerStep && !backend.frees_in_stream_order()
        {
            return Err(Error::InvalidConfig {
                field: "grad_shard_memory",
                reason: format!(
                    "per step, but the {} backend does not free in stream order (a CUDA backend \
                     needs the caller's allocator)",
                    backend.name()
                ),
            });
        }
        let (rank, world) = (comm.rank(), comm.world_size());
        if world != plan.world_size() {
            return Err(Error::WorldSizeMismatch {
                plan: plan.world_size(),
                comm: world,
            });
        }
        plan.rank_of_world(rank)?;
        let replicas = comm.replica().count;
        if replicas != plan.replicas() {
            return Err(Error::ReplicasMismatch {
                plan: plan.replicas(),
                comm: replicas,
            });
        }
        Ok(())
    }

    fn assemble(
        (plan, config, policy): (Arc<Plan>, EngineConfig, Policy),
        backend: B,
        (comm, process_groups): (C, Vec<C>),
        (watch, deadlines): (Watch, deadlines::Deadlines<B::Event>),
        parts: Parts<B>,
    ) -> Self {
        Engine {
            #[cfg(feature = "fault-injection")]
            hang: None,
            rank: comm.rank(),
            param_shards: parts.param_shards,
            gathering: parts.gathering,
            reducing: parts.reducing,
            optimizer: parts.optimizer,
            open: OpenUnits::default(),
            collectives: CollectiveLog::default(),
            counters: Counters::default(),
            trace: None,
            saving: save::Saving {
                pending: None,
                staging: None,
            },
            id: capture::next_engine_id(),
            capture: None,
            replay_pending: None,
            poisoned: OnceLock::new(),
            watch,
            deadlines,
            plan,
            config,
            policy,
            backend,
            comm,
            process_groups,
        }
    }
}

/// Checks that `process_groups` join rank `rank` to its group of each of the plan's process
/// groups: one communicator each, of the group's size, this rank at its place.
fn check_process_groups<B: Backend, C: Communicator<B>>(
    plan: &Plan,
    rank: usize,
    process_groups: &[C],
) -> Result<()> {
    let declared = plan.process_groups();
    if process_groups.len() != declared.len() {
        return Err(Error::InvalidConfig {
            field: "process_groups",
            reason: format!(
                "{} communicators for the plan's {} process groups",
                process_groups.len(),
                declared.len()
            ),
        });
    }
    for (g, c) in declared.iter().zip(process_groups) {
        let place = rank % g.size;
        if (c.world_size(), c.rank()) != (g.size, place) || c.replica().count != 1 {
            return Err(Error::ProcessGroupMismatch {
                name: g.name.clone(),
                size: g.size,
                rank,
                place,
                comm_size: c.world_size(),
                comm_rank: c.rank(),
            });
        }
    }
    Ok(())
}

/// The regions of `group`'s layout that no gradient covers (padding), as f32.
fn padding_of(plan: &Plan, group: &Group) -> Vec<Region> {
    group
        .params
        .iter()
        .map(|&p| &plan.params()[p.0])
        .filter(|p| p.padded_numel > p.numel)
        .map(|p| Region::new(p.offset + p.numel, p.padded_numel - p.numel, DType::F32))
        .collect()
}

/// The reduction pipeline of `plan` under `policy`: who reduces what and when.
fn grad_pipeline(plan: &Plan, config: &EngineConfig, policy: &Policy) -> GradPipeline {
    let members = plan
        .groups()
        .iter()
        .map(|g| match g.trainable {
            true => g.params.iter().map(|p| p.0).collect(),
            false => Vec::new(),
        })
        .collect();
    let passes = if !policy.grad_accumulators {
        Passes::ReduceEach
    } else if policy.grad_slot_dtype == DType::F32 {
        Passes::AccumulateInPlace
    } else {
        Passes::AccumulateStaged
    };
    let route = if policy.grads_direct {
        GradRoute::IntoShards
    } else if plan.grads_travel() {
        GradRoute::ReducedAcrossRanks
    } else {
        GradRoute::Reduced
    };
    GradPipeline::new(
        members,
        plan.params().len(),
        (policy.layout.grad_slots, policy.limits.reduces_in_flight),
        config.overlap,
        route,
        (passes, updates(config)),
    )
}

/// When the optimizer updates the groups under `config`.
fn updates(config: &EngineConfig) -> Updates {
    match config.step_in_backward {
        true => Updates::InBackward,
        false => Updates::AfterBackward,
    }
}
