//! Parameters sharded over a process group of another size than the data-parallel world (MoE
//! expert parameters): every group of expert ranks trains its own copy exactly as the
//! reference does (the dense gradients summed over every rank, the expert ones over the copy's
//! ranks), on the eager CPU backend and on asynchronous ones; bad declarations and mismatched
//! communicators are refused by name; checkpoints keep every copy and load at another world
//! size with as many copies.

use std::sync::Arc;

use fsdp_fusion::comm::process_group_comms;
use fsdp_fusion::{
    Accumulation, DType, Engine, EngineConfig, Error, LocalComm, ModelSpec, OptimizerConfig,
    ParamSpec, Plan, Policy, ProcessGroupSpec,
};
use fsdp_fusion_support::mlp::{
    Checkpoints, EXPERT_GROUP, Mlp, MlpConfig, RankStep, Recipe, Training, assemble_copy,
};
use fsdp_fusion_support::ranks::{
    Mode, for_each_mode_of_a_long_suite, local_ranks, on_engines, within_deadline,
};
use fsdp_fusion_support::values::max_relative_difference;

fn model(experts: usize) -> Mlp {
    Mlp::with_experts(
        MlpConfig {
            layers: 4,
            width: 24,
            inputs: 12,
            batch: 5,
            dtype: DType::Bf16,
            seed: 5,
            embed_lr_scale: 0.5,
        },
        experts,
    )
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

fn training<'a>(
    model: &'a Mlp,
    plan: &'a Arc<Plan>,
    config: &'a EngineConfig,
    init: &'a [Vec<f32>],
    steps: u64,
) -> Training<'a> {
    Training {
        model,
        plan,
        config,
        init,
        steps,
        passes: 2,
        recipe: Recipe {
            clip: Some(0.05),
            ..Recipe::default()
        },
    }
}

/// Trains `world` ranks with expert groups of `size` beside the reference in `mode`; returns
/// the largest relative parameter difference of any copy after any step.
fn expert_parity(mode: Mode, (world, size): (usize, usize), config: EngineConfig) -> f32 {
    let model = model(size);
    let plan = Arc::new(Plan::new(&model.spec().unwrap(), world).unwrap());
    let init = model.init(3);
    let mut worst = 0f32;
    let ranks = local_ranks(&plan, mode).unwrap();
    let summaries = training(&model, &plan, &config, &init, 3)
        .compare_in_process_groups(ranks, Checkpoints::default(), |_, c| {
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
    let predicted = Policy::new(&plan, &config).unwrap().memory;
    for (rank, s) in summaries.iter().enumerate() {
        let extra = s.counters.extra_slots as usize * plan.gather_slot_bytes();
        assert_eq!(s.memory.peak, predicted.peak + extra, "rank {rank}'s peak");
    }
    worst
}

fn every_mode(grid: (usize, usize), config: &EngineConfig) -> f32 {
    for_each_mode_of_a_long_suite(|mode| {
        let config = config.clone();
        let what = format!("expert groups {grid:?} ({mode:?})");
        within_deadline(&what, move || expert_parity(mode, grid, config))
    })
    .into_iter()
    .fold(0f32, f32::max)
}

#[test]
fn expert_groups_of_every_size_train_as_the_reference() {
    for grid in [(4, 2), (8, 2), (8, 4), (4, 1), (2, 2)] {
        let diff = every_mode(grid, &adamw());
        assert!(diff <= 1e-6, "{grid:?}: {diff}");
    }
}

#[test]
fn expert_groups_with_bf16_gradients_and_without_sync_between_passes() {
    for accumulation in [Accumulation::ReduceEveryPass, Accumulation::NoSync] {
        let config = EngineConfig {
            reduce_dtype: DType::Bf16,
            accumulation,
            moment_dtype: DType::Bf16,
            ..adamw()
        };
        let diff = every_mode((4, 2), &config);
        assert!(diff <= 1e-6, "{accumulation:?}: {diff}");
    }
}

#[test]
fn a_plan_places_expert_groups_on_blocks_of_consecutive_ranks() {
    let model = model(2);
    let plan = Plan::new(&model.spec().unwrap(), 6).unwrap();
    let expert = plan.param(model.ids.weight(1)).unwrap().group();
    let dense = plan.param(model.ids.weight(0)).unwrap().group();
    let (expert, dense) = (&plan.groups()[expert], &plan.groups()[dense]);
    assert_eq!((expert.shards(), dense.shards()), (2, 6));
    assert_eq!(expert.process_group(), Some(0));
    assert_eq!(plan.process_groups()[0].name, EXPERT_GROUP);
    assert_eq!((plan.copies(expert), plan.copies(dense)), (3, 1));
    for rank in 0..6 {
        assert_eq!(plan.shard_index(expert, rank).unwrap(), rank % 2);
        assert_eq!(plan.copy(expert, rank).unwrap(), rank / 2);
        assert_eq!(
            plan.shard_range(expert, rank).unwrap(),
            expert.shard_numel() * (rank % 2)..expert.shard_numel() * (rank % 2 + 1)
        );
        assert_eq!(plan.shard_index(dense, rank).unwrap(), rank);
    }
    // A rank outside the world holds no shard and no copy.
    for outside in [6, usize::MAX] {
        let refused = |r: fsdp_fusion::Result<_>| {
            matches!(
                r,
                Err(fsdp_fusion::Error::RankOutOfRange { rank, world_size: 6 }) if rank == outside
            )
        };
        assert!(refused(plan.shard_index(dense, outside).map(drop)));
        assert!(refused(plan.copy(expert, outside).map(drop)));
        assert!(refused(plan.shard_range(expert, outside).map(drop)));
    }
    // The expert's buffer splits into 2 shards of 256-byte multiples, the dense one into 6.
    assert_eq!(expert.padded_numel() % (2 * 128), 0);
    assert_eq!(expert.shard_numel() * 2, expert.padded_numel());
    assert_eq!(dense.padded_numel() % (6 * 128), 0);
}

#[test]
fn bad_process_groups_are_refused_by_name() {
    let p = |name: &str| ParamSpec::new(name, &[4], DType::F32);
    let experts = |size| ProcessGroupSpec {
        name: "experts".into(),
        size,
    };
    let err =
        ModelSpec::with_process_groups(vec![p("a").in_process_group("moe")], vec![experts(2)])
            .unwrap_err();
    assert!(
        matches!(&err, Error::UnknownProcessGroup { name, group } if name == "a" && group == "moe"),
        "{err}"
    );
    for groups in [vec![experts(0)], vec![experts(2), experts(4)]] {
        let err = ModelSpec::with_process_groups(vec![p("a")], groups).unwrap_err();
        assert!(matches!(&err, Error::InvalidProcessGroup { name, .. } if name == "experts"));
    }
    let spec =
        ModelSpec::with_process_groups(vec![p("a").in_process_group("experts")], vec![experts(4)])
            .unwrap();
    let err = Plan::new(&spec, 6).unwrap_err();
    assert!(
        err.to_string()
            .contains("4 ranks, which do not divide the 6"),
        "{err}"
    );
    let err = Plan::hybrid(&spec, 2, 4).unwrap_err();
    assert!(err.to_string().contains("hybrid sharding"), "{err}");
    // A spec changed after its checks: the plan still refuses a group it does not declare.
    let mut renamed = spec.clone();
    renamed.params[0].process_group = Some("expert".into());
    let err = Plan::new(&renamed, 4).unwrap_err();
    assert!(
        matches!(&err, Error::UnknownProcessGroup { group, .. } if group == "expert"),
        "{err}"
    );
    // A model file declares its groups, and each parameter names its own.
    let spec = ModelSpec::from_json(
        r#"{"params": [{"name": "w", "shape": [4], "dtype": "f32", "group": "experts"},
                       {"name": "b", "shape": [4], "dtype": "f32"}],
            "process_groups": [{"name": "experts", "size": 2}]}"#,
    )
    .unwrap();
    assert_eq!(spec.process_groups, vec![experts(2)]);
    assert_eq!(spec.params[0].process_group.as_deref(), Some("experts"));
    assert_eq!(spec.params[1].process_group, None);
    let err = ModelSpec::from_json(
        r#"{"params": [{"name": "w", "shape": [4], "dtype": "f32", "group": "experts"}]}"#,
    )
    .unwrap_err();
    assert!(matches!(err, Error::UnknownProcessGroup { .. }), "{err}");
}

#[test]
fn an_engine_refuses_missing_or_mismatched_process_group_communicators() {
    let model = model(2);
    let plan = Arc::new(Plan::new(&model.spec().unwrap(), 4).unwrap());
    let config = adamw();
    let world = LocalComm::group(4).unwrap();
    let mut pairs = process_group_comms(4, 2, LocalComm::group).unwrap();
    let mut wrong_size = process_group_comms(4, 4, LocalComm::group).unwrap();
    let mut world = world.into_iter();
    // Each refusal gives the communicators back; the refusals happen before any collective.
    let Err(refused) = Engine::try_new(
        Arc::clone(&plan),
        config.clone(),
        fsdp_fusion::CpuBackend::new(),
        world.next().unwrap(),
    ) else {
        panic!("an engine without its process groups");
    };
    assert!(
        matches!(
            &refused.error,
            Error::InvalidConfig {
                field: "process_groups",
                ..
            }
        ),
        "{}",
        refused.error
    );
    let Err(refused) = Engine::try_with_process_groups(
        Arc::clone(&plan),
        config.clone(),
        fsdp_fusion::CpuBackend::new(),
        refused.comm,
        vec![wrong_size.remove(0)],
    ) else {
        panic!("an engine with a process group of another size");
    };
    assert!(
        matches!(
            &refused.error,
            Error::ProcessGroupMismatch {
                size: 2,
                comm_size: 4,
                ..
            }
        ),
        "{}",
        refused.error
    );
    assert_eq!(refused.process_groups.len(), 1);
    // Rank 0 with the communicator of place 1.
    let err = Engine::with_process_groups(
        plan,
        config,
        fsdp_fusion::CpuBackend::new(),
        refused.comm,
        vec![pairs.remove(1)],
    )
    .err()
    .unwrap();
    assert!(
        matches!(
            err,
            Error::ProcessGroupMismatch {
                rank: 0,
                place: 0,
                comm_rank: 1,
                ..
            }
        ),
        "{err}"
    );
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("fsdp-experts-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Every copy's parameters, read back from `world` engines with expert groups of `size`
/// that loaded the checkpoint in `dir`.
fn loaded_copies(dir: &std::path::Path, (world, size): (usize, usize)) -> Vec<Vec<Vec<f32>>> {
    let model = model(size);
    let plan = Arc::new(Plan::new(&model.spec().unwrap(), world).unwrap());
    let dir = dir.to_path_buf();
    let ranks: Vec<RankStep> = on_engines(&plan, &adamw(), Mode::Eager, move |mut engine| {
        engine.load(&dir).unwrap();
        RankStep {
            loss: 0.0,
            grad_norm: fsdp_fusion::engine::GradNorm { l2: 0.0, max: 0.0 },
            shards: (0..engine.plan().groups().len())
                .map(|g| engine.param_shard(g).unwrap())
                .collect(),
        }
    });
    (0..world / size)
        .map(|copy| assemble_copy(&plan, &ranks, copy).unwrap())
        .collect()
}

#[test]
fn a_checkpoint_keeps_every_copy_and_loads_where_the_copies_are_as_many() {
    let dir = scratch("save");
    let mlp = model(2);
    let plan = Arc::new(Plan::new(&mlp.spec().unwrap(), 4).unwrap());
    let config = adamw();
    let init = mlp.init(9);
    let mut trained: Vec<RankStep> = Vec::new();
    training(&mlp, &plan, &config, &init, 2)
        .on_ranks_in_process_groups(
            local_ranks(&plan, Mode::Eager).unwrap(),
            Checkpoints {
                resume: None,
                save: Some(&dir),
            },
            |_, ranks| {
                trained = ranks.to_vec();
                Ok(())
            },
        )
        .unwrap();
    let saved: Vec<Vec<Vec<f32>>> = (0..2)
        .map(|copy| assemble_copy(&plan, &trained, copy).unwrap())
        .collect();
    // The copies differ (they start apart): a load that mixed them up would show below.
    assert_ne!(saved[0], saved[1]);
    // Two copies at every world size that has two: of 4, 8 and 2 ranks.
    for grid in [(4, 2), (8, 4), (2, 1)] {
        let loaded = loaded_copies(&dir, grid);
        for (copy, values) in loaded.iter().enumerate() {
            assert_eq!(
                max_relative_difference(values, &saved[copy]),
                0.0,
                "{grid:?}, copy {copy}"
            );
        }
    }
    // Resuming continues each copy as the reference that ran every step does.
    let mut worst = 0f32;
    training(&mlp, &plan, &config, &init, 4)
        .compare_in_process_groups(
            local_ranks(&plan, Mode::Eager).unwrap(),
            Checkpoints {
                resume: Some(&dir),
                save: None,
            },
            |_, c| {
                worst = worst.max(c.difference);
                Ok(())
            },
        )
        .unwrap();
    assert!(worst <= 1e-6, "{worst}");
    // One copy, or the same world without experts: refused, nothing loaded.
    for spec in [
        model(4).spec().unwrap(),
        Mlp::new(mlp.config.clone()).spec().unwrap(),
    ] {
        let plan = Arc::new(Plan::new(&spec, 4).unwrap());
        let dir = dir.clone();
        let errors = on_engines(&plan, &config, Mode::Eager, move |mut engine| {
            engine.load(&dir).unwrap_err()
        });
        for err in errors {
            assert!(matches!(err, Error::CheckpointMismatch { .. }), "{err}");
        }
    }
    let err =
        fsdp_fusion::export::export_checkpoint(&dir, &dir.join("model.safetensors")).unwrap_err();
    assert!(matches!(err, Error::InvalidProcessGroup { .. }), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
