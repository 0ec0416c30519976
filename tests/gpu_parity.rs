//! The engine on the CUDA backend trains the example model exactly like the unsharded reference
//! (and so like the CPU backend), parameter by parameter after every step: loopback at world sizes
//! 1, 2, 4 and 8 on one GPU, and NCCL at world size 1.

use std::sync::Arc;

use fsdp_fusion::backend::cuda::CudaBackend;
use fsdp_fusion::comm::loopback::LoopbackComm;
use fsdp_fusion::comm::nccl::NcclComm;
use fsdp_fusion::optim::LrSchedule;
use fsdp_fusion::{Accumulation, Backend, Communicator, DType, EngineConfig, ParamStorage, Plan};
use fsdp_fusion_support::mlp::{Mlp, MlpConfig, Recipe, Training};

const STEPS: u64 = 4;
const PASSES: u64 = 2;

fn model(dtype: DType) -> Mlp {
    Mlp::new(MlpConfig {
        layers: 3,
        width: 96,
        inputs: 40,
        batch: 6,
        dtype,
        seed: 5,
        embed_lr_scale: 1.0,
    })
}

/// Trains on `ranks` beside the reference and returns the largest relative difference over all
/// steps.
fn parity<B: Backend, C: Communicator<B>>(
    dtype: DType,
    config: EngineConfig,
    ranks: Vec<(B, C)>,
) -> f32 {
    parity_under(dtype, config, Recipe::default(), ranks)
}

/// As [`parity`], under `recipe`; the gradient norms agree too.
fn parity_under<B: Backend, C: Communicator<B>>(
    dtype: DType,
    config: EngineConfig,
    recipe: Recipe,
    ranks: Vec<(B, C)>,
) -> f32 {
    let model = model(dtype);
    let plan = Arc::new(Plan::new(&model.spec().unwrap(), ranks.len()).unwrap());
    let init = model.init(9);
    let training = Training {
        model: &model,
        plan: &plan,
        config: &config,
        init: &init,
        steps: STEPS,
        passes: PASSES,
        recipe,
    };
    let mut worst = 0f32;
    let summaries = training
        .compare(ranks, |step, c| {
            let norms = (c.grad_norm - c.reference_grad_norm).abs() / c.reference_grad_norm;
            assert!(norms <= 1e-6, "step {step}: {c:?}");
            worst = worst.max(c.difference);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    // The device memory each rank held is the plan's, but for slots a tight limit added.
    let predicted = plan.memory_per_rank(&config).unwrap().peak;
    for (rank, s) in summaries.iter().enumerate() {
        let extra = s.counters.extra_slots as usize * plan.gather_slot_bytes();
        assert_eq!(s.memory.peak, predicted + extra, "rank {rank}");
    }
    worst
}

fn loopback(world: usize) -> Vec<(CudaBackend, LoopbackComm)> {
    LoopbackComm::group(world)
        .unwrap()
        .into_iter()
        .map(|c| (CudaBackend::new(0).unwrap_or_else(|e| panic!("{e}")), c))
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_engines_equal_the_reference() {
    for world in [1, 2, 4, 8] {
        for dtype in [DType::F32, DType::Bf16] {
            for overlap in [true, false] {
                // The per-step comparison of the ranks' collectives finds nothing to report.
                let config = EngineConfig {
                    overlap,
                    verify_collectives: overlap,
                    ..EngineConfig::default()
                };
                let diff = parity(dtype, config, loopback(world));
                eprintln!(
                    "loopback world {world} {dtype} overlap {overlap}: max relative difference {diff:e}"
                );
                assert!(
                    diff <= 1e-6,
                    "world {world} {dtype} overlap {overlap}: {diff}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_engine_at_world_size_1_equals_the_reference() {
    for dtype in [DType::F32, DType::Bf16] {
        let backend = CudaBackend::new(0).unwrap_or_else(|e| panic!("{e}"));
        let id = NcclComm::unique_id().unwrap_or_else(|e| panic!("{e}"));
        let comm = NcclComm::new(&id, 0, 1, &backend).unwrap_or_else(|e| panic!("{e}"));
        let diff = parity(dtype, EngineConfig::default(), vec![(backend, comm)]);
        eprintln!("nccl world 1 {dtype}: max relative difference {diff:e}");
        assert!(diff <= 1e-6, "{dtype}: {diff}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_engines_equal_the_reference_in_every_mode_and_transport_under_a_recipe() {
    let recipe = Recipe {
        schedule: LrSchedule::WarmupCosine {
            warmup_steps: 2,
            total_steps: STEPS,
            min_factor: 0.1,
        },
        clip: Some(0.05),
    };
    for accumulation in [
        Accumulation::ReduceEveryPass,
        Accumulation::NoSync,
        Accumulation::KeepGathered,
    ] {
        for reduce_dtype in [DType::F32, DType::Bf16] {
            for world in [1, 2, 4, 8] {
                let config = EngineConfig {
                    accumulation,
                    reduce_dtype,
                    ..EngineConfig::default()
                };
                let diff = parity_under(DType::Bf16, config, recipe, loopback(world));
                eprintln!(
                    "loopback world {world} {accumulation:?} {reduce_dtype} transport, bf16 \
                     parameters, warmup-cosine, clip 0.05: max relative difference {diff:e}"
                );
                assert!(
                    diff <= 1e-6,
                    "world {world} {accumulation:?} {reduce_dtype}: {diff}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_engines_with_master_only_storage_equal_the_reference() {
    for world in [1, 2, 4, 8] {
        let config = EngineConfig {
            param_storage: ParamStorage::MasterOnly,
            double_buffer_limit: 8,
            ..EngineConfig::default()
        };
        let diff = parity(DType::Bf16, config, loopback(world));
        eprintln!("loopback world {world}, master-only bf16: max relative difference {diff:e}");
        assert!(diff <= 1e-6, "world {world}: {diff}");
    }
}
