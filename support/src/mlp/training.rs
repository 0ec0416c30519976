//! Training the example model sharded, rank by rank, beside its reference, and comparing them.

use super::*;

/// One rank's state after a step.
#[derive(Clone, Debug)]
pub struct RankStep {
    pub loss: f32,
    /// The step's gradient norm before clipping (the same on every rank).
    pub grad_norm: GradNorm,
    /// The rank's parameter shard of every group, as bytes.
    pub shards: Vec<Vec<u8>>,
}

/// What a rank measured over a run.
#[derive(Clone, Copy, Debug)]
pub struct RankSummary {
    pub memory: MemoryUsage,
    pub counters: Counters,
}

/// How a rank runs its steps on its engine.
pub trait RankSteps<B: Backend, C: Communicator<B>> {
    /// Runs step `step`: the mean loss of the rank's micro-batches and the gradient norm before
    /// clipping (NaN where the host does not see it).
    fn step(&mut self, engine: &mut Engine<B, C>, step: u64) -> Result<(f32, GradNorm)>;
}

/// Every step eager, the model's math on the host ([`sharded_step`]).
struct EagerSteps<'a> {
    model: &'a Mlp,
    passes: u64,
    base_lr: f32,
    recipe: Recipe,
}

impl<B: Backend, C: Communicator<B>> RankSteps<B, C> for EagerSteps<'_> {
    fn step(&mut self, engine: &mut Engine<B, C>, step: u64) -> Result<(f32, GradNorm)> {
        let (model, recipe) = (self.model, self.recipe);
        sharded_step(model, engine, (step, self.passes), self.base_lr, recipe)
    }
}

/// Every parameter's values, assembled from each rank's shards after a step (the first copy,
/// with experts).
pub fn assemble(plan: &Plan, ranks: &[RankStep]) -> Result<Vec<Vec<f32>>> {
    assemble_copy(plan, ranks, 0)
}

/// As [`assemble`], with copy `copy` of each group of a process group (the shards of the ranks
/// of its `copy`th group of ranks); a group with fewer copies gives its last.
pub fn assemble_copy(plan: &Plan, ranks: &[RankStep], copy: usize) -> Result<Vec<Vec<f32>>> {
    (0..plan.params().len())
        .map(|i| {
            let id = ParamId(i);
            let layout = plan.param(id)?;
            let group = plan.group(layout.group())?;
            let first = copy.min(plan.copies(group) - 1) * group.shards();
            let shards: Vec<Vec<u8>> = ranks
                .iter()
                .skip(first)
                .take(group.shards())
                .map(|r| r.shards[layout.group()].clone())
                .collect();
            Ok(widen(layout.dtype(), &plan.assemble_param(id, &shards)?))
        })
        .collect()
}

/// A training run of the example model: what every rank and the reference share.
#[derive(Clone, Copy)]
pub struct Training<'a> {
    pub model: &'a Mlp,
    pub plan: &'a Arc<Plan>,
    pub config: &'a EngineConfig,
    /// Initial values, in id order, before rounding to the dtype.
    pub init: &'a [Vec<f32>],
    pub steps: u64,
    /// Micro-batches (backward passes) per step.
    pub passes: u64,
    pub recipe: Recipe,
}

/// Where a run starts and what it leaves: from the initial values, or from the checkpoint in
/// `resume` (continuing at its saved step); with every rank's state saved into `save` at the end.
#[derive(Clone, Copy, Debug, Default)]
pub struct Checkpoints<'a> {
    pub resume: Option<&'a Path>,
    pub save: Option<&'a Path>,
}

impl Checkpoints<'_> {
    /// The first step to run: the checkpoint's optimizer steps, else 0.
    fn start(&self) -> Result<u64> {
        match self.resume {
            Some(dir) => Ok(fsdp_fusion::checkpoint::read_manifest(dir, 0)?.optimizer_steps),
            None => Ok(0),
        }
    }
}

/// One step of a sharded run beside the reference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Comparison {
    /// Mean over ranks of each rank's mean loss.
    pub loss: f32,
    pub reference_loss: f32,
    /// [`max_relative_difference`] of every parameter after the step.
    pub difference: f32,
    /// Rank 0's gradient 2-norm before clipping, and the reference's.
    pub grad_norm: f32,
    pub reference_grad_norm: f32,
}

impl Training<'_> {
    /// Trains on `plan.world_size()` CPU ranks, one thread each; after every step
    /// `on_step(step, ranks)` sees each rank's loss and shards.
    pub fn on_cpu(
        &self,
        on_step: impl FnMut(u64, &[RankStep]) -> Result<()>,
    ) -> Result<Vec<RankSummary>> {
        let ranks = LocalComm::group(self.plan.world_size())?
            .into_iter()
            .map(|comm| (CpuBackend::new(), comm))
            .collect();
        self.on_ranks(ranks, on_step)
    }

    /// Trains beside the [`Reference`] on the given ranks, comparing after
    /// every step; `on_step` sees each comparison as it comes.
    pub fn compare<B: Backend, C: Communicator<B>>(
        &self,
        ranks: Vec<(B, C)>,
        on_step: impl FnMut(u64, &Comparison) -> Result<()>,
    ) -> Result<Vec<RankSummary>> {
        self.compare_with(ranks, Checkpoints::default(), on_step)
    }

    /// As [`Training::compare`], starting and ending as `checkpoints` says; a resumed run is
    /// compared with a reference that ran every step from the initial values.
    pub fn compare_with<B: Backend, C: Communicator<B>>(
        &self,
        ranks: Vec<(B, C)>,
        checkpoints: Checkpoints<'_>,
        on_step: impl FnMut(u64, &Comparison) -> Result<()>,
    ) -> Result<Vec<RankSummary>> {
        self.compare_in_process_groups(without_process_groups(ranks), checkpoints, on_step)
    }

    /// As [`Training::compare_with`], each rank with its communicators of the plan's process
    /// groups ([`Engine::with_process_groups`]); every copy of the expert parameters is
    /// compared with the reference's.
    pub fn compare_in_process_groups<B: Backend, C: Communicator<B>>(
        &self,
        ranks: Vec<(B, C, Vec<C>)>,
        checkpoints: Checkpoints<'_>,
        on_step: impl FnMut(u64, &Comparison) -> Result<()>,
    ) -> Result<Vec<RankSummary>> {
        self.compare_by(ranks, checkpoints, &|_| Ok(self.eager_steps()), on_step)
    }

    /// As [`Training::compare_in_process_groups`] on CPU ranks whose backends are asynchronous
    /// ([`CpuBackend::asynchronous`]), with the model's work queued on each rank's compute
    /// stream: the first step eager, the second captured and replayed, every later one a replay
    /// of it ([`CapturedSteps`]). The gradient norm is NaN for the replayed steps: the host does
    /// not compute it (clipping, where the recipe clips, reads it on the device).
    pub fn compare_captured<C: Communicator<CpuBackend>>(
        &self,
        ranks: Vec<(CpuBackend, C, Vec<C>)>,
        checkpoints: Checkpoints<'_>,
        on_step: impl FnMut(u64, &Comparison) -> Result<()>,
    ) -> Result<Vec<RankSummary>> {
        self.compare_by(ranks, checkpoints, &|e| self.captured_steps(e), on_step)
    }

    /// As [`Training::on_ranks_in_process_groups`], with the steps of
    /// [`Training::compare_captured`].
    pub fn on_ranks_captured<C: Communicator<CpuBackend>>(
        &self,
        ranks: Vec<(CpuBackend, C, Vec<C>)>,
        checkpoints: Checkpoints<'_>,
        on_step: impl FnMut(u64, &[RankStep]) -> Result<()>,
    ) -> Result<Vec<RankSummary>> {
        self.on_ranks_by(ranks, checkpoints, &|e| self.captured_steps(e), on_step)
    }

    /// The model's work on `engine`'s compute stream, the steps after the first replayed.
    fn captured_steps<C: Communicator<CpuBackend>>(
        &self,
        engine: &Engine<CpuBackend, C>,
    ) -> Result<CapturedSteps> {
        CapturedSteps::new(self.model, engine, self.passes, self.recipe)
    }

    /// Every step eager, the model's math on the host.
    fn eager_steps(&self) -> EagerSteps<'_> {
        EagerSteps {
            model: self.model,
            passes: self.passes,
            base_lr: self.config.optimizer.lr(),
            recipe: self.recipe,
        }
    }

    /// As [`Training::compare_in_process_groups`], each rank's steps run by what `steps` makes
    /// for its engine.
    fn compare_by<B: Backend, C: Communicator<B>, S: RankSteps<B, C>>(
        &self,
        ranks: Vec<(B, C, Vec<C>)>,
        checkpoints: Checkpoints<'_>,
        steps: &(dyn Fn(&Engine<B, C>) -> Result<S> + Sync),
        mut on_step: impl FnMut(u64, &Comparison) -> Result<()>,
    ) -> Result<Vec<RankSummary>> {
        let (replicas, world) = (self.plan.replicas(), self.plan.world_size());
        let mut reference = Reference::hybrid(
            self.model.clone(),
            self.init,
            (replicas, world),
            self.config,
            self.recipe,
        )?;
        for step in 0..checkpoints.start()? {
            reference.step(step, self.passes)?;
        }
        self.on_ranks_by(ranks, checkpoints, steps, |step, ranks| {
            let (reference_loss, reference_norm) = reference.step(step, self.passes)?;
            let comparison = Comparison {
                loss: ranks.iter().map(|r| r.loss).sum::<f32>() / ranks.len() as f32,
                reference_loss,
                grad_norm: ranks.first().map_or(f32::NAN, |r| r.grad_norm.l2),
                reference_grad_norm: reference_norm.l2,
                // Every replica's parameters, each copy against the reference's.
                difference: ranks
                    .chunks(world)
                    .flat_map(|replica| (0..reference.copies()).map(move |copy| (replica, copy)))
                    .map(|(replica, copy)| {
                        let values = assemble_copy(self.plan, replica, copy)?;
                        let expected = reference.copy_values(copy).unwrap_or_default();
                        Ok(max_relative_difference(&values, expected))
                    })
                    .try_fold(0f32, |worst, d: Result<f32>| d.map(|d| worst.max(d)))?,
            };
            on_step(step, &comparison)
        })
    }

    /// [`Training::compare`] on CPU ranks.
    pub fn compare_on_cpu(
        &self,
        on_step: impl FnMut(u64, &Comparison) -> Result<()>,
    ) -> Result<Vec<RankSummary>> {
        let ranks = LocalComm::group(self.plan.world_size())?
            .into_iter()
            .map(|comm| (CpuBackend::new(), comm))
            .collect();
        self.compare(ranks, on_step)
    }

    /// Trains on the given ranks' backends and communicators, in rank order, one thread each.
    pub fn on_ranks<B: Backend, C: Communicator<B>>(
        &self,
        ranks: Vec<(B, C)>,
        on_step: impl FnMut(u64, &[RankStep]) -> Result<()>,
    ) -> Result<Vec<RankSummary>> {
        self.on_ranks_with(ranks, Checkpoints::default(), on_step)
    }

    /// As [`Training::on_ranks`], starting and ending as `checkpoints` says.
    pub fn on_ranks_with<B: Backend, C: Communicator<B>>(
        &self,
        ranks: Vec<(B, C)>,
        checkpoints: Checkpoints<'_>,
        on_step: impl FnMut(u64, &[RankStep]) -> Result<()>,
    ) -> Result<Vec<RankSummary>> {
        self.on_ranks_in_process_groups(without_process_groups(ranks), checkpoints, on_step)
    }

    /// As [`Training::on_ranks_with`], each rank with its communicators of the plan's process
    /// groups; a rank starts from its copy's initial values ([`Mlp::copy_init`]).
    pub fn on_ranks_in_process_groups<B: Backend, C: Communicator<B>>(
        &self,
        ranks: Vec<(B, C, Vec<C>)>,
        checkpoints: Checkpoints<'_>,
        on_step: impl FnMut(u64, &[RankStep]) -> Result<()>,
    ) -> Result<Vec<RankSummary>> {
        self.on_ranks_by(ranks, checkpoints, &|_| Ok(self.eager_steps()), on_step)
    }

    /// As [`Training::on_ranks_in_process_groups`], each rank's steps run by what `steps` makes
    /// for its engine.
    fn on_ranks_by<B: Backend, C: Communicator<B>, S: RankSteps<B, C>>(
        &self,
        ranks: Vec<(B, C, Vec<C>)>,
        checkpoints: Checkpoints<'_>,
        steps: &(dyn Fn(&Engine<B, C>) -> Result<S> + Sync),
        mut on_step: impl FnMut(u64, &[RankStep]) -> Result<()>,
    ) -> Result<Vec<RankSummary>> {
        let start = checkpoints.start()?;
        let Training {
            model,
            plan,
            config,
            init,
            steps: last,
            ..
        } = *self;
        // Every rank of the grid, replica by replica.
        let shard_size = plan.world_size();
        let world = shard_size * plan.replicas();
        if ranks.len() != world {
            return Err(Error::WorldSizeMismatch {
                plan: world,
                comm: ranks.len(),
            });
        }
        let (tx, rx) = mpsc::channel::<(usize, RankStep)>();
        std::thread::scope(|scope| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|(backend, comm, process_groups)| {
                    let tx = tx.clone();
                    scope.spawn(move || -> Result<RankSummary> {
                        let rank = comm.replica().index * shard_size + comm.rank();
                        let mut engine = Engine::with_process_groups(
                            Arc::clone(plan),
                            config.clone(),
                            backend,
                            comm,
                            process_groups,
                        )?;
                        match checkpoints.resume {
                            Some(dir) => engine.load(dir)?,
                            None => load(&mut engine, &model.copy_init(init, model.copy_of(rank)))?,
                        }
                        let mut rank_steps = steps(&engine)?;
                        for step in start..last {
                            let (loss, grad_norm) = rank_steps.step(&mut engine, step)?;
                            let shards = (0..plan.groups().len())
                                .map(|g| engine.param_shard(g))
                                .collect::<Result<Vec<_>>>()?;
                            let record = RankStep {
                                loss,
                                grad_norm,
                                shards,
                            };
                            if tx.send((rank, record)).is_err() {
                                break;
                            }
                        }
                        if let Some(dir) = checkpoints.save {
                            engine.save(dir)?;
                        }
                        Ok(RankSummary {
                            memory: engine.memory(),
                            counters: engine.counters(),
                        })
                    })
                })
                .collect();
            drop(tx);
            let mut outcome = Ok(());
            'steps: for step in start..last {
                let mut ranks: Vec<Option<RankStep>> = vec![None; world];
                for _ in 0..world {
                    match rx.recv() {
                        Ok((rank, record)) => ranks[rank] = Some(record),
                        Err(_) => break 'steps,
                    }
                }
                let ranks: Vec<RankStep> = ranks.into_iter().flatten().collect();
                if let Err(e) = on_step(step, &ranks) {
                    outcome = Err(e);
                    break;
                }
            }
            drop(rx);
            let mut summaries = Vec::with_capacity(world);
            let mut failure: Option<Error> = None;
            for (rank, handle) in handles.into_iter().enumerate() {
                match handle.join().unwrap_or(Err(Error::RankPanicked { rank })) {
                    Ok(summary) => summaries.push(summary),
                    // A failing rank makes the others fail with RankLeft: report the cause.
                    Err(e) => match failure {
                        Some(Error::PeerGone { .. }) | None => failure = Some(e),
                        Some(_) => {}
                    },
                }
            }
            outcome?;
            failure.map_or(Ok(summaries), Err)
        })
    }
}

/// Ranks with no process-group communicators.
fn without_process_groups<B, C>(ranks: Vec<(B, C)>) -> Vec<(B, C, Vec<C>)> {
    ranks
        .into_iter()
        .map(|(backend, comm)| (backend, comm, Vec::new()))
        .collect()
}
