//! Making an engine: its arguments checked, every buffer the plan predicts allocated, the
//! ranks' plans and settings compared, and the parts assembled; or, refused, what it was given
//! handed back.

use super::*;
use crate::plan::BufferLayout;

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

/// The buffers of an engine, allocated up front (per-step gradient shards come later).
struct Buffers<B: Backend> {
    shards: Vec<B::Buffer>,
    grad_shards: Vec<Option<B::Buffer>>,
    masters: Vec<Option<B::Buffer>>,
    moments: Vec<Option<(B::Buffer, B::Buffer)>>,
    slot_buffers: Vec<B::Buffer>,
    grad_slots: Vec<GradSlot<B::Buffer, B::Event>>,
    grad_accumulators: Vec<Option<B::Buffer>>,
}

impl<B: Backend> Buffers<B> {
    /// Allocates every buffer of `layout` but per-step gradient shards, which come with the
    /// step's first gradient of their group.
    fn allocate(layout: &BufferLayout, backend: &B) -> Result<Buffers<B>> {
        let what = "the engine's buffer lists";
        let groups = layout.groups.len();
        let mut shards = crate::fallible::with_capacity(groups, what)?;
        let mut grad_shards = crate::fallible::with_capacity(groups, what)?;
        let mut masters = crate::fallible::with_capacity(groups, what)?;
        let mut moments = crate::fallible::with_capacity(groups, what)?;
        let mut grad_accumulators = crate::fallible::with_capacity(groups, what)?;
        for (i, g) in layout.groups.iter().enumerate() {
            let buffer = |bytes: usize, what: &str| {
                alloc(backend, bytes, || format!("the {what} of group {i}"))
            };
            shards.push(buffer(g.shard, "parameter shard")?);
            let grad_shard = g.grad_shard.filter(|_| !layout.per_step_grad_shards);
            grad_shards.push(
                grad_shard
                    .map(|b| buffer(b, "gradient shard"))
                    .transpose()?,
            );
            masters.push(
                g.master
                    .map(|b| buffer(b, "fp32 master shard"))
                    .transpose()?,
            );
            let moment_pair = |b| Ok((buffer(b, "first moment")?, buffer(b, "second moment")?));
            moments.push(g.moment.map(moment_pair).transpose()?);
            let accumulator = g.accumulator.map(|b| buffer(b, "gradient accumulator"));
            grad_accumulators.push(accumulator.transpose()?);
        }
        let mut slot_buffers = crate::fallible::with_capacity(layout.gather_slots, what)?;
        for i in 0..layout.gather_slots {
            let slot = alloc(backend, layout.gather_slot_bytes, || {
                format!("gather slot {i}")
            });
            slot_buffers.push(slot?);
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
        Ok(Buffers {
            shards,
            grad_shards,
            masters,
            moments,
            slot_buffers,
            grad_slots,
            grad_accumulators,
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
                let buffers = Buffers::allocate(&policy.layout, &backend)?;
                let state = State::new(&plan, &config, policy)?;
                let bytes = parts::state_bytes(&plan, &config);
                let staging = (config.save_staging)
                    .then(|| Ok::<_, Error>((backend.alloc_host(bytes)?, bytes)))
                    .transpose()?;
                let deadlines = deadlines::Deadlines::start(watch.clone(), B::reached)?;
                Ok((buffers, state, (staging, deadlines)))
            });
        let (buffers, state, (save_staging, deadlines)) = match parts {
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
        let mut engine = Engine::assemble(plan, config, backend, comms, watching, buffers, state);
        engine.save_staging = save_staging;
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
        if rank >= world {
            return Err(Error::RankOutOfRange {
                rank,
                world_size: world,
            });
        }
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
        plan: Arc<Plan>,
        config: EngineConfig,
        backend: B,
        (comm, process_groups): (C, Vec<C>),
        (watch, deadlines): (Watch, deadlines::Deadlines<B::Event>),
        buffers: Buffers<B>,
        state: State,
    ) -> Self {
        let free_slots = (0..buffers.slot_buffers.len())
            .rev()
            .map(|buffer_index| GatherSlot {
                buffer_index,
                free_after: None,
            })
            .collect();
        let groups = plan.groups().len();
        let units = plan.units().len();
        Engine {
            #[cfg(feature = "fault-injection")]
            hang: None,
            rank: comm.rank(),
            gathers: state.gathers,
            policy: state.policy,
            schedule: Schedule::new(units),
            grads: state.grads,
            padding: state.padding,
            placed: (0..groups).map(|_| None).collect(),
            gathered: (0..groups).map(|_| None).collect(),
            released: vec![None; groups],
            param_shards: buffers.shards,
            grad_shards: buffers.grad_shards,
            masters: buffers.masters,
            moments: buffers.moments,
            slot_buffers: buffers.slot_buffers,
            free_slots,
            shards_updated: None,
            grad_slots: buffers.grad_slots,
            grad_accumulators: buffers.grad_accumulators,
            forward_open: BTreeSet::new(),
            backward_open: BTreeSet::new(),
            optimizer_steps: 0,
            stepped: false,
            open_slot: None,
            counters: Counters::default(),
            collectives_in_step: 0,
            issued: Vec::new(),
            nonfinite_counter: None,
            norm_part: None,
            clip_scale: None,
            gather_effects: Vec::new(),
            gather_batch: GatherBatch::default(),
            grad_effects: Vec::new(),
            trace: None,
            pending_save: None,
            save_staging: None,
            poisoned: OnceLock::new(),
            watch,
            deadlines,
            plan,
            config,
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

/// The engine's pure machines and layout facts, derived from the plan.
struct State {
    gathers: Gathers,
    grads: GradPipeline,
    padding: Vec<Vec<Region>>,
    policy: Policy,
}

impl State {
    fn new(plan: &Plan, config: &EngineConfig, policy: Policy) -> Result<State> {
        let groups = plan.groups();
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
        let limits = policy.limits;
        let passes = if !policy.grad_accumulators {
            Passes::ReduceEach
        } else if policy.grad_slot_dtype == DType::F32 {
            Passes::AccumulateInPlace
        } else {
            Passes::AccumulateStaged
        };
        Ok(State {
            gathers: Gathers::new(groups.len(), limits.gathered),
            grads: GradPipeline::new(
                members,
                plan.params().len(),
                (policy.layout.grad_slots, limits.reduces_in_flight),
                config.overlap,
                policy.grads_direct,
                passes,
            ),
            padding,
            policy,
        })
    }
}
