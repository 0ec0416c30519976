//! Sharded checkpoints through the CUDA backend: loopback ranks on one GPU save, load at another
//! world size and back, and continue exactly as an uninterrupted run; the bytes are the CPU
//! backend's.

use std::path::PathBuf;
use std::sync::Arc;

use fsdp_fusion::backend::cuda::CudaBackend;
use fsdp_fusion::comm::loopback::LoopbackComm;
use fsdp_fusion::{DType, Engine, EngineConfig, Plan};
use fsdp_fusion_support::mlp::{Mlp, MlpConfig, Recipe, load, sharded_step};
use fsdp_fusion_support::ranks::on_threads;

fn model() -> Mlp {
    Mlp::new(MlpConfig {
        layers: 3,
        width: 96,
        inputs: 40,
        batch: 6,
        dtype: DType::Bf16,
        seed: 5,
        embed_lr_scale: 1.0,
    })
}

/// What each loopback rank of `world` does: a fresh engine (loaded with the initial values, or
/// from `resume`), `steps` steps, then a save into `save`; every group's shard afterwards.
fn run(
    world: usize,
    resume: Option<PathBuf>,
    steps: std::ops::Range<u64>,
    save: Option<PathBuf>,
) -> Vec<Vec<Vec<u8>>> {
    let mlp = model();
    let plan = Arc::new(Plan::new(&mlp.spec().unwrap(), world).unwrap());
    let init = mlp.init(9);
    let comms = LoopbackComm::group(world).unwrap();
    on_threads(comms, move |_, comm| {
        let backend = CudaBackend::new(0).unwrap_or_else(|e| panic!("{e}"));
        let config = EngineConfig::default();
        let base_lr = config.optimizer.lr();
        let mut e = Engine::new(Arc::clone(&plan), config, backend, comm).unwrap();
        match &resume {
            Some(dir) => e.load(dir).unwrap(),
            None => load(&mut e, &init).unwrap(),
        }
        for step in steps.clone() {
            sharded_step(&mlp, &mut e, (step, 2), base_lr, Recipe::default()).unwrap();
        }
        if let Some(dir) = &save {
            e.save(dir).unwrap();
        }
        (0..plan.groups().len())
            .map(|g| e.param_shard(g).unwrap())
            .collect()
    })
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_ranks_save_reshard_and_continue_exactly() {
    let root =
        std::env::temp_dir().join(format!("fsdp-fusion-gpu-checkpoint-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (first, second) = (root.join("at-2"), root.join("at-4"));
    let straight = run(2, None, 0..4, None);
    run(2, None, 0..2, Some(first.clone()));
    run(4, Some(first), 0..0, Some(second.clone()));
    let back = run(2, Some(second), 2..4, None);
    let _ = std::fs::remove_dir_all(&root);
    assert_eq!(
        back, straight,
        "saved at 2, loaded at 4, saved, loaded at 2: not the straight run"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_ranks_gather_whole_groups_and_save_in_the_background() {
    for (world, storage) in [
        (2, fsdp_fusion::ParamStorage::ShardAndMaster),
        (4, fsdp_fusion::ParamStorage::MasterOnly),
    ] {
        let mlp = model();
        let plan = Arc::new(Plan::new(&mlp.spec().unwrap(), world).unwrap());
        let init = mlp.init(9);
        let dir = std::env::temp_dir().join(format!(
            "fsdp-fusion-gpu-async-{}-{world}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        let (background, blocking) = (dir.join("async"), dir.join("blocking"));
        let comms = LoopbackComm::group(world).unwrap();
        let ranks = on_threads(comms, {
            let plan = Arc::clone(&plan);
            let (background, blocking) = (background.clone(), blocking.clone());
            move |_, comm| {
                let backend = CudaBackend::new(0).unwrap_or_else(|e| panic!("{e}"));
                let config = EngineConfig {
                    param_storage: storage,
                    ..EngineConfig::default()
                };
                let base_lr = config.optimizer.lr();
                let mut e = Engine::new(Arc::clone(&plan), config, backend, comm).unwrap();
                load(&mut e, &init).unwrap();
                for step in 0..2 {
                    sharded_step(&mlp, &mut e, (step, 2), base_lr, Recipe::default()).unwrap();
                }
                let shards: Vec<Vec<u8>> = (0..plan.groups().len())
                    .map(|g| e.param_shard(g).unwrap())
                    .collect();
                let groups: Vec<Vec<u8>> = (0..plan.groups().len())
                    .map(|g| e.gather_group(g).unwrap())
                    .collect();
                e.save(&blocking).unwrap();
                e.save_async(&background).unwrap();
                sharded_step(&mlp, &mut e, (2, 2), base_lr, Recipe::default()).unwrap();
                e.wait_save().unwrap();
                (shards, groups)
            }
        });
        for (g, group) in plan.groups().iter().enumerate() {
            let whole: Vec<u8> = ranks.iter().flat_map(|(s, _)| s[g].clone()).collect();
            for (rank, (_, groups)) in ranks.iter().enumerate() {
                assert_eq!(groups[g], whole, "world {world} group {g} on rank {rank}");
            }
            assert_eq!(whole.len(), group.padded_numel() * group.dtype().size());
        }
        for rank in 0..world {
            let read =
                |d: &PathBuf| std::fs::read(fsdp_fusion::checkpoint::data_path(d, rank)).unwrap();
            assert_eq!(
                read(&background),
                read(&blocking),
                "world {world} rank {rank}"
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
