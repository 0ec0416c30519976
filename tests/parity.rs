//! Sharded training on CPU ranks equals the unsharded reference, parameter by parameter, after
//! every step, on the eager CPU backend and on asynchronous ones; steps captured once and
//! replayed on asynchronous ones equal the eager steps bit for bit.

use std::sync::Arc;

use fsdp_fusion::optim::LrSchedule;
use fsdp_fusion::{
    Accumulation, DType, EngineConfig, GradReduction, GradShardMemory, LocalComm, OptimizerConfig,
    ParamStorage, Plan, Policy,
};
use fsdp_fusion_support::mlp::{Checkpoints, Mlp, MlpConfig, Recipe, Reference, Training};
use fsdp_fusion_support::ranks::{Mode, for_each_case_and_mode_of_a_long_suite, within_deadline};
use fsdp_fusion_support::values::max_relative_difference;

const STEPS: u64 = 4;
const PASSES: u64 = 2;

/// One parity run's settings, named for its failure.
struct Case {
    name: String,
    world: usize,
    dtype: DType,
    config: EngineConfig,
    recipe: Recipe,
}

impl std::fmt::Debug for Case {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} at world size {}", self.name, self.world)
    }
}

/// A case of `config` at each of `worlds`, under `recipe`.
fn at_worlds(
    name: &str,
    worlds: &[usize],
    dtype: DType,
    config: &EngineConfig,
    recipe: Recipe,
) -> Vec<Case> {
    worlds
        .iter()
        .map(|&world| Case {
            name: name.to_string(),
            world,
            dtype,
            config: config.clone(),
            recipe,
        })
        .collect()
}

/// Trains every case both ways in every mode, the runs side by side, and asserts that each
/// case's largest relative parameter difference over every step is at most 1e-6 in every mode
/// (a failure names the case and the mode).
fn assert_parity(cases: &[Case]) {
    let differences = for_each_case_and_mode_of_a_long_suite(cases, |case, mode| {
        let what = format!("{case:?} ({mode:?}, {:?})", case.recipe);
        let (world, dtype, config, recipe) =
            (case.world, case.dtype, case.config.clone(), case.recipe);
        let diff = within_deadline(&what, move || parity_in(mode, world, dtype, config, recipe));
        (mode, diff)
    });
    for (case, differences) in cases.iter().zip(differences) {
        for (mode, diff) in differences {
            assert!(diff <= 1e-6, "{case:?} ({mode:?}): {diff}");
        }
    }
}

/// The model every case trains.
fn model(dtype: DType) -> Mlp {
    Mlp::new(MlpConfig {
        layers: 3,
        width: 24,
        inputs: 12,
        batch: 5,
        dtype,
        seed: 11,
        embed_lr_scale: 0.5,
    })
}

/// Runs `f` on the training of [`model`] at `world` ranks, [`STEPS`] steps of [`PASSES`]
/// micro-batches (one where the engine steps in the backward, which takes one pass a step).
fn with_training<R>(
    world: usize,
    dtype: DType,
    config: &EngineConfig,
    recipe: Recipe,
    f: impl FnOnce(&Training<'_>) -> R,
) -> R {
    let model = model(dtype);
    let plan = Arc::new(Plan::new(&model.spec().unwrap(), world).unwrap());
    let init = model.init(3);
    f(&Training {
        model: &model,
        plan: &plan,
        config,
        init: &init,
        steps: STEPS,
        passes: if config.step_in_backward { 1 } else { PASSES },
        recipe,
    })
}

fn parity_in(mode: Mode, world: usize, dtype: DType, config: EngineConfig, recipe: Recipe) -> f32 {
    with_training(world, dtype, &config, recipe, |t| parity_of(mode, t))
}

/// The largest relative parameter difference between `training` on ranks of `mode` and the
/// reference, over every step, after checking the run's memory, losses and norms.
fn parity_of(mode: Mode, training: &Training<'_>) -> f32 {
    let Training {
        model,
        plan,
        config,
        init,
        passes,
        recipe,
        ..
    } = *training;
    let world = plan.world_size();
    let mut steps = Vec::new();
    let ranks = LocalComm::group(world)
        .unwrap()
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| (mode.backend(rank), comm))
        .collect();
    let summaries = training
        .compare(ranks, |_, c| {
            steps.push(*c);
            Ok(())
        })
        .unwrap();
    assert_eq!(steps.len() as u64, STEPS);
    // Every mode's buffers are in the plan, exactly, but for the gather slots a limit too tight
    // for the model added (each counted); between steps only per-step gradient shards are gone.
    // Where the optimizer steps in the backward, the plan bounds the per-step shards held at
    // once, and the step holds fewer than all of them.
    let predicted = Policy::new(plan, config).unwrap().memory;
    let all_shards = Policy::new(
        plan,
        &EngineConfig {
            step_in_backward: false,
            ..config.clone()
        },
    )
    .unwrap()
    .memory;
    for (rank, s) in summaries.iter().enumerate() {
        let extra = s.counters.extra_slots as usize * plan.gather_slot_bytes();
        if predicted.grad_shards < all_shards.grad_shards {
            assert!(
                s.memory.peak <= predicted.peak + extra,
                "rank {rank}'s peak"
            );
            assert!(
                s.memory.peak < all_shards.peak + extra,
                "rank {rank}'s peak"
            );
        } else {
            assert_eq!(s.memory.peak, predicted.peak + extra, "rank {rank}'s peak");
        }
        assert_eq!(
            s.memory.current,
            predicted.between_steps + extra,
            "rank {rank}'s bytes"
        );
        if config.accumulation == Accumulation::KeepGathered {
            assert_eq!(s.counters.extra_slots, 0, "every group has its slot");
        }
    }
    for c in &steps {
        assert!(
            (c.loss - c.reference_loss).abs() <= 1e-6 * c.reference_loss.abs(),
            "{steps:?}"
        );
        // An engine that steps in the backward refuses the norm.
        assert!(
            config.step_in_backward
                || (c.grad_norm - c.reference_grad_norm).abs() <= 1e-6 * c.reference_grad_norm,
            "gradient norms: {steps:?}"
        );
        // A clip that scales nothing would test nothing.
        if let Some(max) = recipe.clip {
            assert!(
                c.reference_grad_norm > max,
                "{max} clips nothing: {steps:?}"
            );
        }
    }
    // Training moved the parameters: a run that did nothing would also "agree".
    let mut reference = Reference::new(model.clone(), init, world, config, recipe).unwrap();
    let start = reference.values().to_vec();
    reference.step(0, passes).unwrap();
    let moved = max_relative_difference(reference.values(), &start);
    assert!(moved > 1e-3, "parameters barely moved: {moved}");
    steps.iter().map(|c| c.difference).fold(0.0, f32::max)
}

fn config(overlap: bool) -> EngineConfig {
    EngineConfig {
        overlap,
        ..EngineConfig::default()
    }
}

#[test]
fn f32_parity_at_every_world_size_with_overlap_on_and_off() {
    let mut cases = at_worlds(
        "overlap",
        &[1, 2, 3, 4, 8],
        DType::F32,
        &config(true),
        Recipe::default(),
    );
    cases.extend(at_worlds(
        "no overlap",
        &[1, 2, 3, 4, 8],
        DType::F32,
        &config(false),
        Recipe::default(),
    ));
    assert_parity(&cases);
}

#[test]
fn bf16_parity_with_fp32_master_weights() {
    assert_parity(&at_worlds(
        "bf16",
        &[1, 3, 4],
        DType::Bf16,
        &config(true),
        Recipe::default(),
    ));
}

#[test]
fn f16_parity_with_sgd_and_summed_gradients() {
    let config = EngineConfig {
        optimizer: OptimizerConfig::sgd(0.05),
        grad_reduction: GradReduction::Sum,
        ..EngineConfig::default()
    };
    assert_parity(&at_worlds(
        "f16 SGD",
        &[2, 8],
        DType::F16,
        &config,
        Recipe::default(),
    ));
}

#[test]
fn parity_with_gradients_scaled_by_a_factor_of_the_loop_s_own() {
    // A loop that divides by its global count itself: every rank's gradient times 1/24.
    let config = EngineConfig {
        grad_reduction: GradReduction::Scaled(1.0 / 24.0),
        ..config(true)
    };
    assert_parity(&at_worlds(
        "scaled by 1/24",
        &[1, 3, 4],
        DType::F32,
        &config,
        Recipe::default(),
    ));
}

#[test]
fn parity_holds_at_the_tightest_limits() {
    let config = EngineConfig {
        double_buffer_limit: 1,
        max_reduces_in_flight: 1,
        ..EngineConfig::default()
    };
    assert_parity(&at_worlds(
        "tightest limits",
        &[4],
        DType::F32,
        &config,
        Recipe::default(),
    ));
}

#[test]
fn parity_under_every_recipe_of_schedule_and_clipping() {
    let warmup_cosine = LrSchedule::WarmupCosine {
        warmup_steps: 2,
        total_steps: STEPS,
        min_factor: 0.1,
    };
    let sgd = EngineConfig {
        optimizer: OptimizerConfig::sgd(0.5),
        ..config(true)
    };
    // A clip below the gradients' norm, so that it scales every step (checked in `parity_in`).
    let mut cases = Vec::new();
    for (schedule, clip) in [
        (warmup_cosine, None),
        (LrSchedule::Constant, Some(0.05)),
        (warmup_cosine, Some(0.05)),
    ] {
        let recipe = Recipe { schedule, clip };
        let name = format!("{recipe:?}");
        cases.extend(at_worlds(
            &name,
            &[1, 2, 3, 4, 8],
            DType::F32,
            &config(true),
            recipe,
        ));
        cases.extend(at_worlds(
            &format!("bf16 SGD {name}"),
            &[3],
            DType::Bf16,
            &sgd,
            recipe,
        ));
    }
    assert_parity(&cases);
}

/// A warmup-cosine schedule and a clip below the gradients' norm: the recipe every mode and
/// transport is checked under.
fn full_recipe() -> Recipe {
    Recipe {
        schedule: LrSchedule::WarmupCosine {
            warmup_steps: 2,
            total_steps: STEPS,
            min_factor: 0.1,
        },
        clip: Some(0.05),
    }
}

#[test]
fn parity_in_every_accumulation_mode_and_transport_dtype_under_a_schedule_and_a_clip() {
    // The reference rounds as the bf16 transport does (each rank's gradient, then the ranks'
    // f32 sum), so bf16 transport is held to the same 1e-6 as f32.
    let mut cases = Vec::new();
    for accumulation in [
        Accumulation::ReduceEveryPass,
        Accumulation::NoSync,
        Accumulation::KeepGathered,
    ] {
        for reduce_dtype in [DType::F32, DType::Bf16] {
            let config = EngineConfig {
                accumulation,
                reduce_dtype,
                ..config(true)
            };
            let name = format!("{accumulation:?} {reduce_dtype}");
            cases.extend(at_worlds(
                &name,
                &[1, 2, 3, 4, 8],
                DType::F32,
                &config,
                full_recipe(),
            ));
        }
    }
    assert_parity(&cases);
}

#[test]
fn per_step_gradient_shards_in_every_accumulation_mode_and_parameter_storage() {
    let mut cases = Vec::new();
    for accumulation in [
        Accumulation::ReduceEveryPass,
        Accumulation::NoSync,
        Accumulation::KeepGathered,
    ] {
        for param_storage in [ParamStorage::ShardAndMaster, ParamStorage::MasterOnly] {
            let config = EngineConfig {
                accumulation,
                param_storage,
                grad_shard_memory: GradShardMemory::PerStep,
                ..config(true)
            };
            let name = format!("{accumulation:?} {param_storage:?}");
            cases.extend(at_worlds(
                &name,
                &[1, 3, 4],
                DType::Bf16,
                &config,
                full_recipe(),
            ));
        }
    }
    assert_parity(&cases);
}

#[test]
fn the_optimizer_stepping_in_the_backward_trains_exactly_as_after_it() {
    // Each group updated as its gradient becomes final, against the reference's step after the
    // whole backward: the same arithmetic on the same gradients, at every world size, both
    // storages, both moment dtypes, per-step and persistent gradient shards, overlap on and off,
    // under a schedule.
    // The full recipe but for the clip, which needs the whole gradient first.
    let recipe = Recipe {
        clip: None,
        ..full_recipe()
    };
    let mut cases = Vec::new();
    for (param_storage, moment_dtype) in [
        (ParamStorage::ShardAndMaster, DType::F32),
        (ParamStorage::MasterOnly, DType::Bf16),
    ] {
        for grad_shard_memory in [GradShardMemory::PerStep, GradShardMemory::Persistent] {
            for overlap in [true, false] {
                let config = EngineConfig {
                    step_in_backward: true,
                    param_storage,
                    moment_dtype,
                    grad_shard_memory,
                    ..config(overlap)
                };
                let name = format!(
                    "in the backward, {param_storage:?}, {moment_dtype} moments, \
                     {grad_shard_memory:?}, overlap {overlap}"
                );
                cases.extend(at_worlds(
                    &name,
                    &[1, 2, 3, 4],
                    DType::Bf16,
                    &config,
                    recipe,
                ));
            }
        }
    }
    assert_parity(&cases);
}

#[test]
fn bf16_moments_round_as_the_reference_does_at_every_world_size() {
    // The reference rounds each new moment with the same bits (the step, the group, the
    // element's place in its layout), so the runs agree to 1e-6 as f32 moments do.
    let mut cases = Vec::new();
    for param_storage in [ParamStorage::ShardAndMaster, ParamStorage::MasterOnly] {
        let config = EngineConfig {
            moment_dtype: DType::Bf16,
            param_storage,
            ..config(true)
        };
        let name = format!("{param_storage:?}");
        cases.extend(at_worlds(
            &name,
            &[1, 2, 3, 4, 8],
            DType::Bf16,
            &config,
            full_recipe(),
        ));
        let f32_params = format!("{name} f32 parameters");
        cases.extend(at_worlds(
            &f32_params,
            &[3],
            DType::F32,
            &config,
            full_recipe(),
        ));
    }
    assert_parity(&cases);
}

#[test]
fn bf16_parameters_with_bf16_transport_and_no_sync_sgd_with_a_scaled_sum() {
    let config = EngineConfig {
        accumulation: Accumulation::NoSync,
        reduce_dtype: DType::Bf16,
        optimizer: OptimizerConfig::sgd(0.5),
        grad_reduction: GradReduction::Scaled(1.0 / 3.0),
        ..config(false)
    };
    assert_parity(&at_worlds(
        "bf16 transport",
        &[1, 3],
        DType::Bf16,
        &config,
        full_recipe(),
    ));
}

#[test]
fn master_only_storage_trains_exactly_as_a_shard_beside_its_master() {
    // A gather casts the fp32 master: exactly the value a bf16/f16 shard would hold.
    let mut cases = Vec::new();
    for (dtype, optimizer) in [
        (DType::Bf16, OptimizerConfig::default()),
        (DType::F16, OptimizerConfig::sgd(0.05)),
    ] {
        let config = EngineConfig {
            param_storage: ParamStorage::MasterOnly,
            optimizer,
            ..config(true)
        };
        let name = format!("master only, {dtype}");
        cases.extend(at_worlds(
            &name,
            &[1, 2, 3, 4, 8],
            dtype,
            &config,
            full_recipe(),
        ));
    }
    assert_parity(&cases);
}

#[test]
fn master_only_storage_holds_no_shard_for_its_groups() {
    let model = Mlp::new(MlpConfig {
        layers: 3,
        width: 24,
        inputs: 12,
        batch: 5,
        dtype: DType::Bf16,
        seed: 11,
        embed_lr_scale: 0.5,
    });
    for world in [1, 4] {
        let plan = Plan::new(&model.spec().unwrap(), world).unwrap();
        let both = EngineConfig::default();
        let master_only = EngineConfig {
            param_storage: ParamStorage::MasterOnly,
            ..EngineConfig::default()
        };
        let (a, b) = (
            Policy::new(&plan, &both).unwrap().memory,
            Policy::new(&plan, &master_only).unwrap().memory,
        );
        let trainable: usize = plan
            .groups()
            .iter()
            .filter(|g| g.trainable())
            .map(|g| g.shard_numel() * 2)
            .sum();
        assert_eq!(a.param_shards - b.param_shards, trainable, "world {world}");
        if world == 1 {
            // The views need slots now: one for each master-only group gathered at once, the
            // root's two (the tied embedding, the head's bias) and a layer's two (its weight and
            // bias; its frozen gain keeps a shard), past the limit of 2.
            assert_eq!(a.gathered_slots, 0);
            assert_eq!(b.gathered_slots, 4 * plan.gather_slot_bytes());
        } else {
            assert_eq!(a.gathered_slots, b.gathered_slots);
        }
    }
}

/// Trains every case eagerly on eager ranks and, in every asynchronous mode, with the model's
/// work on the compute stream, its second step captured and the rest replays
/// ([`Training::on_ranks_captured`]): every rank's shards and loss are the eager run's bit for
/// bit after every step; the gradient norm, which stays on the device in the replays, is the
/// eager one at the first step. The same steps compared with the reference
/// ([`Training::compare_captured`], the main job's `--capture`) differ from it by at most 1e-6.
fn assert_captured_parity(cases: &[Case]) {
    for_each_case_and_mode_of_a_long_suite(cases, |case, mode| {
        // Only streams that run apart capture.
        let Mode::Async(_) = mode else { return };
        let what = format!("{case:?} ({mode:?}, {:?}) captured", case.recipe);
        let (world, dtype, config, recipe) =
            (case.world, case.dtype, case.config.clone(), case.recipe);
        within_deadline(&what.clone(), move || {
            with_training(world, dtype, &config, recipe, |training| {
                let comms = || LocalComm::group(world).unwrap().into_iter().enumerate();
                let asynchronous = || comms().map(|(r, c)| (mode.backend(r), c, Vec::new()));
                let mut eager = Vec::new();
                let ranks = comms().map(|(r, c)| (Mode::Eager.backend(r), c)).collect();
                training
                    .on_ranks(ranks, |_, ranks| {
                        eager.push(ranks.to_vec());
                        Ok(())
                    })
                    .unwrap();
                let mut captured = Vec::new();
                let checkpoints = Checkpoints::default();
                training
                    .on_ranks_captured(asynchronous().collect(), checkpoints, |_, ranks| {
                        captured.push(ranks.to_vec());
                        Ok(())
                    })
                    .unwrap();
                assert_eq!(eager.len() as u64, STEPS, "{what}");
                assert_eq!(captured.len() as u64, STEPS, "{what}");
                for (step, (e, c)) in eager.iter().zip(&captured).enumerate() {
                    for (rank, (e, c)) in e.iter().zip(c).enumerate() {
                        let at = format!("{what}: step {step}, rank {rank}");
                        assert_eq!(e.shards, c.shards, "{at}");
                        assert_eq!(e.loss.to_bits(), c.loss.to_bits(), "{at}");
                        let norm = (e.grad_norm.l2.to_bits(), c.grad_norm.l2.to_bits());
                        match step {
                            0 => assert_eq!(norm.0, norm.1, "{at}"),
                            _ => assert!(c.grad_norm.l2.is_nan(), "{at}"),
                        }
                    }
                }
                let mut compared = Vec::new();
                training
                    .compare_captured(asynchronous().collect(), checkpoints, |_, c| {
                        compared.push(c.difference);
                        Ok(())
                    })
                    .unwrap();
                assert_eq!(compared.len() as u64, STEPS, "{what}");
                assert!(compared.iter().all(|&d| d <= 1e-6), "{what}: {compared:?}");
            })
        })
    });
}

#[test]
fn steps_captured_and_replayed_train_as_eager_steps_do() {
    let mut cases = at_worlds(
        "f32",
        &[1, 2, 3, 4],
        DType::F32,
        &config(true),
        full_recipe(),
    );
    let bf16_no_sync = EngineConfig {
        accumulation: Accumulation::NoSync,
        reduce_dtype: DType::Bf16,
        ..config(false)
    };
    let keep_gathered = EngineConfig {
        accumulation: Accumulation::KeepGathered,
        optimizer: OptimizerConfig::sgd(0.5),
        ..config(true)
    };
    let in_backward = EngineConfig {
        step_in_backward: true,
        ..config(true)
    };
    let no_clip = Recipe {
        clip: None,
        ..full_recipe()
    };
    cases.extend(at_worlds(
        "bf16 no-sync",
        &[3],
        DType::Bf16,
        &bf16_no_sync,
        full_recipe(),
    ));
    cases.extend(at_worlds(
        "keep gathered SGD",
        &[2],
        DType::F32,
        &keep_gathered,
        full_recipe(),
    ));
    cases.extend(at_worlds(
        "in the backward",
        &[2],
        DType::Bf16,
        &in_backward,
        no_clip,
    ));
    assert_captured_parity(&cases);
}
