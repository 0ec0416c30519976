//! Hybrid sharding on CPU ranks: a grid of `replicas x shard_size` ranks trains exactly as the
//! unsharded reference of as many ranks (each replica's gradients summed, then the replicas'),
//! every replica's parameters equal after every step, on the eager CPU backend and on
//! asynchronous ones; the plan's memory is each rank's; only the first replica saves.

use std::sync::Arc;

use fsdp_fusion::comm::hybrid::Hybrid;
use fsdp_fusion::{
    Accumulation, DType, Engine, EngineConfig, Error, LocalComm, OptimizerConfig, Plan, Policy,
};
use fsdp_fusion_support::mlp::{Checkpoints, Mlp, MlpConfig, Recipe, Training, assemble};
use fsdp_fusion_support::ranks::{Mode, for_each_mode_of_a_long_suite, within_deadline};
use fsdp_fusion_support::values::widen;

fn model() -> Mlp {
    Mlp::new(MlpConfig {
        layers: 3,
        width: 24,
        inputs: 12,
        batch: 5,
        dtype: DType::Bf16,
        seed: 11,
        embed_lr_scale: 0.5,
    })
}

/// Trains a grid of `replicas x shard_size` ranks beside the reference in `mode`; returns the
/// largest relative parameter difference of any replica after any step.
fn hybrid_parity(mode: Mode, (replicas, shard_size): (usize, usize), config: EngineConfig) -> f32 {
    let model = model();
    let plan = Arc::new(Plan::hybrid(&model.spec().unwrap(), replicas, shard_size).unwrap());
    let init = model.init(3);
    let training = Training {
        model: &model,
        plan: &plan,
        config: &config,
        init: &init,
        steps: 3,
        passes: 2,
        recipe: Recipe::default(),
    };
    let ranks = Hybrid::grid(replicas, shard_size, LocalComm::group)
        .unwrap()
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| (mode.backend(rank), comm))
        .collect();
    let mut worst = 0f32;
    let summaries = training
        .compare(ranks, |_, c| {
            assert!(
                (c.loss - c.reference_loss).abs() <= 1e-6 * c.reference_loss.abs(),
                "{c:?}"
            );
            assert!(
                (c.grad_norm - c.reference_grad_norm).abs() <= 1e-6 * c.reference_grad_norm,
                "{c:?}"
            );
            worst = worst.max(c.difference);
            Ok(())
        })
        .unwrap();
    assert_eq!(summaries.len(), replicas * shard_size);
    let predicted = Policy::new(&plan, &config).unwrap().memory;
    for (rank, s) in summaries.iter().enumerate() {
        // As in the plain parity runs: the plan's, and each gather slot the limit lacked.
        let extra = s.counters.extra_slots as usize * plan.gather_slot_bytes();
        assert_eq!(s.memory.peak, predicted.peak + extra, "rank {rank}'s peak");
        // Gradients travel at every grid but 1 x 1: one reduction per trainable group and pass.
        assert!(
            s.counters.reduce_scatters > 0,
            "rank {rank} reduced nothing"
        );
    }
    worst
}

fn every_mode(grid: (usize, usize), config: &EngineConfig) -> f32 {
    for_each_mode_of_a_long_suite(|mode| {
        let config = config.clone();
        let what = format!("hybrid sharding {grid:?} ({mode:?})");
        within_deadline(&what, move || hybrid_parity(mode, grid, config))
    })
    .into_iter()
    .fold(0f32, f32::max)
}

fn adamw() -> EngineConfig {
    EngineConfig {
        optimizer: OptimizerConfig::AdamW {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        ..EngineConfig::default()
    }
}

#[test]
fn every_grid_of_eight_ranks_trains_as_the_reference_of_eight() {
    for grid in [(2, 2), (2, 4), (4, 2), (1, 8), (8, 1)] {
        let diff = every_mode(grid, &adamw());
        assert!(diff <= 1e-6, "grid {grid:?}: {diff}");
    }
}

#[test]
fn hybrid_sharding_with_bf16_gradients_and_without_sync_between_passes() {
    for accumulation in [Accumulation::ReduceEveryPass, Accumulation::NoSync] {
        let config = EngineConfig {
            reduce_dtype: DType::Bf16,
            accumulation,
            ..adamw()
        };
        for grid in [(2, 2), (4, 1)] {
            let diff = every_mode(grid, &config);
            assert!(diff <= 1e-6, "grid {grid:?}, {accumulation:?}: {diff}");
        }
    }
}

#[test]
fn a_plan_for_other_replicas_than_the_communicators_is_refused() {
    let model = model();
    let plan = Arc::new(Plan::hybrid(&model.spec().unwrap(), 2, 1).unwrap());
    let comm = LocalComm::group(1).unwrap().remove(0);
    let err = Engine::new(
        plan,
        EngineConfig::default(),
        fsdp_fusion::CpuBackend::new(),
        comm,
    )
    .err();
    assert!(
        matches!(err, Some(Error::ReplicasMismatch { plan: 2, comm: 1 })),
        "{err:?}"
    );
    assert!(matches!(
        Plan::hybrid(&model.spec().unwrap(), 0, 2),
        Err(Error::ZeroWorldSize)
    ));
}

#[test]
fn only_the_first_replica_saves_and_its_checkpoint_loads_at_another_world_size() {
    within_deadline("saving under hybrid sharding", || {
        let dir = std::env::temp_dir().join(format!("fsdp-hsdp-save-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let model = model();
        let spec = model.spec().unwrap();
        let plan = Arc::new(Plan::hybrid(&spec, 2, 2).unwrap());
        let (config, init) = (adamw(), model.init(3));
        let training = Training {
            model: &model,
            plan: &plan,
            config: &config,
            init: &init,
            steps: 2,
            passes: 1,
            recipe: Recipe::default(),
        };
        let ranks = Hybrid::grid(2, 2, LocalComm::group)
            .unwrap()
            .into_iter()
            .map(|comm| (fsdp_fusion::CpuBackend::new(), comm))
            .collect();
        let mut last = Vec::new();
        let checkpoints = Checkpoints {
            resume: None,
            save: Some(&dir),
        };
        training
            .on_ranks_with(ranks, checkpoints, |_, ranks| {
                last = assemble(&plan, &ranks[..2])?;
                // Both replicas hold the same parameters.
                assert_eq!(assemble(&plan, &ranks[2..])?, last);
                Ok(())
            })
            .unwrap();
        let manifests: Vec<bool> = (0..4)
            .map(|rank| fsdp_fusion::checkpoint::read_manifest(&dir, rank).is_ok())
            .collect();
        assert_eq!(manifests, [true, true, false, false], "ranks 0 and 1 wrote");
        // The saved state is a plain checkpoint of world size 2: one rank takes all of it.
        let one_plan = Arc::new(Plan::new(&spec, 1).unwrap());
        let comm = LocalComm::group(1).unwrap().remove(0);
        let mut one = Engine::new(
            Arc::clone(&one_plan),
            config,
            fsdp_fusion::CpuBackend::new(),
            comm,
        )
        .unwrap();
        one.load(&dir).unwrap();
        let shards = (0..one_plan.groups().len())
            .map(|g| one.param_shard(g))
            .collect::<Result<Vec<_>, _>>()
            .unwrap();
        let loaded: Vec<Vec<f32>> = (0..one_plan.params().len())
            .map(|i| {
                let id = fsdp_fusion::ParamId(i);
                let group = one_plan.param(id).unwrap().group();
                let bytes = one_plan
                    .assemble_param(id, std::slice::from_ref(&shards[group]))
                    .unwrap();
                widen(one_plan.param(id).unwrap().dtype(), &bytes)
            })
            .collect();
        assert_eq!(loaded, last);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

#[test]
fn replicas_whose_plans_differ_refuse_to_start_at_every_grid() {
    // The second replica declares the last parameter in f32: its plan differs, its replica's
    // ranks agree among themselves.
    let model = model();
    let spec = model.spec().unwrap();
    let mut other = spec.clone();
    if let Some(last) = other.params.last_mut() {
        last.dtype = DType::F32;
    }
    for (replicas, shard_size) in [(2, 1), (2, 2)] {
        for_each_mode_of_a_long_suite(|mode| {
            let (spec, other) = (spec.clone(), other.clone());
            let errors = within_deadline("replicas with other plans", move || {
                let ranks = Hybrid::grid(replicas, shard_size, LocalComm::group).unwrap();
                std::thread::scope(|s| {
                    let handles: Vec<_> = ranks
                        .into_iter()
                        .enumerate()
                        .map(|(rank, comm)| {
                            let declared = if rank < shard_size { &spec } else { &other };
                            let plan =
                                Arc::new(Plan::hybrid(declared, replicas, shard_size).unwrap());
                            s.spawn(move || {
                                Engine::new(plan, adamw(), mode.backend(rank), comm).err()
                            })
                        })
                        .collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().unwrap())
                        .collect::<Vec<_>>()
                })
            });
            for (rank, err) in errors.iter().enumerate() {
                assert!(
                    matches!(err, Some(Error::PlanMismatch { rank: r, .. }) if *r == shard_size),
                    "({replicas}, {shard_size}), rank {rank}: {err:?}"
                );
            }
        });
    }
}
