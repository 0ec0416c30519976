//! The engine on the CUDA backend trains the example model exactly like the unsharded reference
//! (and so like the CPU backend), parameter by parameter after every step: loopback at world sizes
//! 1, 2, 4 and 8 on one GPU (hybrid grids and expert groups among them), and NCCL at world size
//! 1.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use fsdp_fusion::backend::cuda::{CudaBackend, DeviceAllocator};
use fsdp_fusion::comm::hybrid::Hybrid;
use fsdp_fusion::comm::loopback::LoopbackComm;
use fsdp_fusion::comm::nccl::NcclComm;
use fsdp_fusion::comm::process_group_comms;
use fsdp_fusion::optim::LrSchedule;
use fsdp_fusion::watch::DEFAULT_TIMEOUT;
use fsdp_fusion::{
    Accumulation, Backend, Communicator, DType, EngineConfig, GradShardMemory, ParamStorage, Plan,
    Policy, Stream,
};
use fsdp_fusion_support::mlp::{Checkpoints, Mlp, MlpConfig, RankSummary, Recipe, Training};

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
    // Under hybrid sharding the plan is each replica's.
    let replicas = ranks.first().map_or(1, |(_, c)| c.replica().count);
    let shard_size = ranks.len() / replicas;
    let plan = Arc::new(Plan::hybrid(&model.spec().unwrap(), replicas, shard_size).unwrap());
    let init = model.init(9);
    // An engine that steps in the backward takes one backward pass a step, and refuses the norm.
    let in_backward = config.step_in_backward;
    let training = Training {
        model: &model,
        plan: &plan,
        config: &config,
        init: &init,
        steps: STEPS,
        passes: if in_backward { 1 } else { PASSES },
        recipe,
    };
    let mut worst = 0f32;
    let summaries = training
        .compare(ranks, |step, c| {
            let norms = (c.grad_norm - c.reference_grad_norm).abs() / c.reference_grad_norm;
            assert!(in_backward || norms <= 1e-6, "step {step}: {c:?}");
            worst = worst.max(c.difference);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    check_memory(&plan, &config, &summaries);
    worst
}

/// The device memory each rank held is the plan's, but for slots a tight limit added; where the
/// optimizer steps in the backward with per-step gradient shards, the plan bounds the peak.
fn check_memory(plan: &Plan, config: &EngineConfig, summaries: &[RankSummary]) {
    let policy = Policy::new(plan, config).unwrap();
    let predicted = policy.memory;
    for (rank, s) in summaries.iter().enumerate() {
        let extra = s.counters.extra_slots as usize * plan.gather_slot_bytes();
        match policy.layout.grad_shards_in_flight {
            Some(_) => assert!(s.memory.peak <= predicted.peak + extra, "rank {rank}"),
            None => assert_eq!(s.memory.peak, predicted.peak + extra, "rank {rank}"),
        }
        assert_eq!(
            s.memory.current,
            predicted.between_steps + extra,
            "rank {rank}"
        );
    }
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
fn loopback_hybrid_grids_equal_the_reference() {
    for (replicas, shard_size) in [(2, 2), (2, 4), (4, 2), (1, 8), (8, 1)] {
        for dtype in [DType::F32, DType::Bf16] {
            let config = EngineConfig {
                reduce_dtype: dtype,
                ..EngineConfig::default()
            };
            let ranks = Hybrid::grid(replicas, shard_size, LoopbackComm::group)
                .unwrap()
                .into_iter()
                .map(|c| (CudaBackend::new(0).unwrap_or_else(|e| panic!("{e}")), c))
                .collect();
            let diff = parity(dtype, config, ranks);
            eprintln!("loopback grid {replicas} x {shard_size} {dtype}: {diff:e}");
            assert!(
                diff <= 1e-6,
                "grid {replicas} x {shard_size} {dtype}: {diff}"
            );
        }
    }
}

/// Trains the model with expert groups of `size` on `ranks` (each with its process groups)
/// beside the reference; returns the largest relative difference of any copy over all steps.
fn expert_parity<C: Communicator<CudaBackend>>(
    dtype: DType,
    size: usize,
    ranks: Vec<(CudaBackend, C, Vec<C>)>,
) -> f32 {
    let model = Mlp::with_experts(model(dtype).config, size);
    let plan = Arc::new(Plan::new(&model.spec().unwrap(), ranks.len()).unwrap());
    let init = model.init(9);
    let config = EngineConfig {
        reduce_dtype: dtype,
        verify_collectives: true,
        ..EngineConfig::default()
    };
    let training = Training {
        model: &model,
        plan: &plan,
        config: &config,
        init: &init,
        steps: STEPS,
        passes: PASSES,
        recipe: Recipe {
            clip: Some(0.05),
            ..Recipe::default()
        },
    };
    let mut worst = 0f32;
    let summaries = training
        .compare_in_process_groups(ranks, Checkpoints::default(), |step, c| {
            let norms = (c.grad_norm - c.reference_grad_norm).abs() / c.reference_grad_norm;
            assert!(norms <= 1e-6, "step {step}: {c:?}");
            worst = worst.max(c.difference);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    check_memory(&plan, &config, &summaries);
    worst
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_expert_groups_equal_the_reference() {
    for (world, size) in [(4, 2), (8, 2), (8, 4), (4, 1)] {
        for dtype in [DType::F32, DType::Bf16] {
            let groups = process_group_comms(world, size, LoopbackComm::group).unwrap();
            let ranks = loopback(world)
                .into_iter()
                .zip(groups)
                .map(|((backend, comm), group)| (backend, comm, vec![group]))
                .collect();
            let diff = expert_parity(dtype, size, ranks);
            eprintln!("loopback experts {world} ranks, groups of {size}, {dtype}: {diff:e}");
            assert!(
                diff <= 1e-6,
                "{world} ranks, groups of {size}, {dtype}: {diff}"
            );
        }
    }
}

/// At world size 1 nothing travels: this checks the split into the expert group and the engine
/// around it; the split communicator carries collectives in `benches/multi_gpu.sh` only.
#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_engine_with_an_expert_group_at_world_size_1_equals_the_reference() {
    let backend = CudaBackend::new(0).unwrap_or_else(|e| panic!("{e}"));
    let id = NcclComm::unique_id().unwrap_or_else(|e| panic!("{e}"));
    let comm =
        NcclComm::new(&id, 0, 1, &backend, DEFAULT_TIMEOUT).unwrap_or_else(|e| panic!("{e}"));
    let model = Mlp::with_experts(model(DType::Bf16).config, 1);
    let spec = model.spec().unwrap();
    let groups = comm
        .process_groups(&spec.process_groups, DEFAULT_TIMEOUT)
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(groups.len(), 1);
    let diff = expert_parity(DType::Bf16, 1, vec![(backend, comm, groups)]);
    eprintln!("nccl world 1 with an expert group: {diff:e}");
    assert!(diff <= 1e-6, "{diff}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_engine_at_world_size_1_equals_the_reference() {
    for dtype in [DType::F32, DType::Bf16] {
        let backend = CudaBackend::new(0).unwrap_or_else(|e| panic!("{e}"));
        let id = NcclComm::unique_id().unwrap_or_else(|e| panic!("{e}"));
        let comm =
            NcclComm::new(&id, 0, 1, &backend, DEFAULT_TIMEOUT).unwrap_or_else(|e| panic!("{e}"));
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

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_engines_with_bf16_moments_equal_the_reference() {
    let recipe = Recipe {
        schedule: LrSchedule::Constant,
        clip: Some(0.05),
    };
    for world in [1, 2, 4] {
        for param_storage in [ParamStorage::ShardAndMaster, ParamStorage::MasterOnly] {
            let config = EngineConfig {
                moment_dtype: DType::Bf16,
                param_storage,
                ..EngineConfig::default()
            };
            let diff = parity_under(DType::Bf16, config, recipe, loopback(world));
            eprintln!("bf16 moments loopback world {world} {param_storage:?}: {diff:e}");
            assert!(diff <= 1e-6, "world {world} {param_storage:?}: {diff}");
        }
    }
}

/// A caching allocator as PyTorch's is, made harsh: a block given back goes on a free list at
/// once and is handed out again with no wait, and its bytes are overwritten (0xFF) on the compute
/// stream when it comes back, as the next compute-stream work that reused it would. A release
/// that came before the engine's last use of a block shows as wrong values.
struct ReusingAllocator {
    compute: u64,
    free: Mutex<Vec<(u64, usize)>>,
    outstanding: AtomicUsize,
    allocations: AtomicUsize,
    reuses: AtomicUsize,
}

impl ReusingAllocator {
    fn new(backend: &CudaBackend) -> ReusingAllocator {
        ReusingAllocator {
            // SAFETY: only the stream's address is kept, to compare with the allocator's.
            compute: unsafe { backend.stream(Stream::Compute) }.cu_stream() as u64,
            free: Mutex::default(),
            outstanding: AtomicUsize::new(0),
            allocations: AtomicUsize::new(0),
            reuses: AtomicUsize::new(0),
        }
    }
}

// SAFETY: every address is a `cuMemAlloc` of the context current on the calling thread (the
// backend's primary context, bound by the backend before it asks), used by one block at a time;
// a block is reused only in the compute stream's order, which the contract allows.
unsafe impl DeviceAllocator for ReusingAllocator {
    fn allocate(&self, bytes: usize) -> fsdp_fusion::Result<u64> {
        self.outstanding.fetch_add(bytes, Ordering::SeqCst);
        self.allocations.fetch_add(1, Ordering::SeqCst);
        let mut free = self.free.lock().unwrap();
        if let Some(i) = free.iter().position(|&(_, b)| b == bytes) {
            self.reuses.fetch_add(1, Ordering::SeqCst);
            return Ok(free.swap_remove(i).0);
        }
        // SAFETY: a plain allocation in the current context.
        unsafe { cudarc::driver::result::malloc_sync(bytes) }.map_err(|_| {
            fsdp_fusion::Error::OutOfMemory {
                bytes,
                what: "the test's allocator".into(),
            }
        })
    }

    fn release(&self, ptr: u64, bytes: usize) {
        let stream = self.compute as usize as cudarc::driver::sys::CUstream;
        // SAFETY: the block is this allocator's; the fill is queued on the compute stream, after
        // the work the engine ordered before giving the block back.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, 0xFF, bytes, stream) }
            .unwrap_or_else(|e| panic!("{e}"));
        self.free.lock().unwrap().push((ptr, bytes));
        self.outstanding.fetch_sub(bytes, Ordering::SeqCst);
    }
}

impl Drop for ReusingAllocator {
    fn drop(&mut self) {
        for &(ptr, _) in self.free.lock().unwrap().iter() {
            // SAFETY: allocated above, freed once; cuMemFree waits for the fills.
            unsafe { cudarc::driver::result::free_sync(ptr) }.unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// Loopback ranks on the GPU, each with its allocator (which fills what it gets back with 0xFF:
/// a shard used after it was given back shows as NaN).
fn loopback_with_allocators(
    world: usize,
) -> (Vec<(CudaBackend, LoopbackComm)>, Vec<Arc<ReusingAllocator>>) {
    let mut allocators = Vec::new();
    let ranks = LoopbackComm::group(world)
        .unwrap()
        .into_iter()
        .map(|c| {
            let backend = CudaBackend::new(0).unwrap_or_else(|e| panic!("{e}"));
            let allocator = Arc::new(ReusingAllocator::new(&backend));
            allocators.push(allocator.clone());
            (backend.with_allocator(allocator), c)
        })
        .collect();
    (ranks, allocators)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_optimizer_stepping_in_the_backward_equals_the_reference() {
    let recipe = Recipe {
        schedule: LrSchedule::WarmupCosine {
            warmup_steps: 2,
            total_steps: STEPS,
            min_factor: 0.1,
        },
        clip: None,
    };
    for world in [1, 2, 4] {
        for param_storage in [ParamStorage::ShardAndMaster, ParamStorage::MasterOnly] {
            let (ranks, allocators) = loopback_with_allocators(world);
            let config = EngineConfig {
                step_in_backward: true,
                param_storage,
                grad_shard_memory: GradShardMemory::PerStep,
                ..EngineConfig::default()
            };
            let diff = parity_under(DType::Bf16, config, recipe, ranks);
            eprintln!("in the backward, loopback world {world} {param_storage:?}: {diff:e}");
            assert!(diff <= 1e-6, "world {world} {param_storage:?}: {diff}");
            for a in &allocators {
                assert_eq!(a.outstanding.load(Ordering::SeqCst), 0);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn per_step_gradient_shards_from_a_caller_s_allocator_equal_the_reference() {
    let recipe = Recipe {
        schedule: LrSchedule::Constant,
        clip: Some(0.05),
    };
    for world in [1, 2, 4] {
        for accumulation in [Accumulation::ReduceEveryPass, Accumulation::NoSync] {
            // One allocator per rank (per compute stream), as the contract says.
            let (ranks, allocators) = loopback_with_allocators(world);
            let config = EngineConfig {
                accumulation,
                grad_shard_memory: GradShardMemory::PerStep,
                ..EngineConfig::default()
            };
            let diff = parity_under(DType::Bf16, config.clone(), recipe, ranks);
            eprintln!("per-step loopback world {world} {accumulation:?}: {diff:e}");
            assert!(diff <= 1e-6, "world {world} {accumulation:?}: {diff}");
            // Every buffer came from the allocator and went back to it; the gradient shards
            // came anew each step, in blocks that the steps before used.
            let plan = Plan::new(&model(DType::Bf16).spec().unwrap(), world).unwrap();
            let trainable = plan.groups().iter().filter(|g| g.trainable()).count();
            for a in &allocators {
                let allocations = a.allocations.load(Ordering::SeqCst);
                assert!(
                    allocations >= trainable * STEPS as usize,
                    "{allocations} allocations"
                );
                let reuses = a.reuses.load(Ordering::SeqCst);
                assert!(
                    reuses >= trainable * (STEPS as usize - 1),
                    "{reuses} reuses"
                );
                assert_eq!(a.outstanding.load(Ordering::SeqCst), 0);
            }
        }
    }
    // Without an allocator `cuMemFree` would wait for the device every step: refused.
    let backend = CudaBackend::new(0).unwrap_or_else(|e| panic!("{e}"));
    let comm = LoopbackComm::group(1).unwrap().pop().unwrap();
    let plan = Arc::new(Plan::new(&model(DType::F32).spec().unwrap(), 1).unwrap());
    let config = EngineConfig {
        grad_shard_memory: GradShardMemory::PerStep,
        ..EngineConfig::default()
    };
    match fsdp_fusion::Engine::new(plan, config, backend, comm) {
        Err(fsdp_fusion::Error::InvalidConfig { field, reason }) => {
            assert_eq!(field, "grad_shard_memory");
            assert!(reason.contains("allocator"), "{reason}");
        }
        other => panic!("{:?}", other.err()),
    }
}
