//! The dense stack on the GPU through the engine: no host wait in steady state, and gradients equal
//! to the unsharded GEMMs'.

use std::sync::Arc;

use fsdp_fusion::backend::cuda::CudaBackend;
use fsdp_fusion::comm::loopback::LoopbackComm;
use fsdp_fusion::comm::nccl::NcclComm;
use fsdp_fusion::watch::DEFAULT_TIMEOUT;
use fsdp_fusion::{Communicator, Engine, EngineConfig, Plan};
use fsdp_fusion_support::gpu_stack::{HookTime, Stack, StackShape, UnshardedStack};
use fsdp_fusion_support::ranks::on_threads;

const SHAPE: StackShape = StackShape {
    layers: 6,
    width: 256,
    batch: 64,
};
const SEED: u64 = 3;

/// One rank's engine and stack, weights loaded.
fn rank<C: Communicator<CudaBackend>>(
    backend: CudaBackend,
    comm: C,
) -> (Engine<CudaBackend, C>, Stack) {
    let plan = Arc::new(Plan::new(&SHAPE.spec().unwrap(), comm.world_size()).unwrap());
    let stack = Stack::new(&backend, SHAPE, SEED).unwrap();
    let mut engine = Engine::new(plan, EngineConfig::default(), backend, comm).unwrap();
    stack.load(&mut engine, SEED).unwrap();
    (engine, stack)
}

/// Host waits of each of `steps` whole steps (hooks, GEMMs, sync, optimizer, end of step).
fn host_waits_per_step<C: Communicator<CudaBackend>>(
    backend: CudaBackend,
    comm: C,
    steps: usize,
) -> Vec<u64> {
    let (mut engine, mut stack) = rank(backend, comm);
    let mut hooks = HookTime::default();
    (0..steps)
        .map(|_| {
            let before = engine.counters().host_waits;
            stack.step(&mut engine, &mut hooks).unwrap();
            engine.optimizer_step().unwrap();
            engine.end_step().unwrap();
            engine.counters().host_waits - before
        })
        .collect()
}

/// The rank's gradient shard of every layer after one forward and backward.
fn grads_of_one_step<C: Communicator<CudaBackend>>(backend: CudaBackend, comm: C) -> Vec<Vec<f32>> {
    let (mut engine, mut stack) = rank(backend, comm);
    stack.step(&mut engine, &mut HookTime::default()).unwrap();
    (0..SHAPE.layers)
        .map(|g| engine.grad_shard(g).unwrap())
        .collect()
}

fn nccl_rank() -> (CudaBackend, NcclComm) {
    let backend = CudaBackend::new(0).unwrap_or_else(|e| panic!("{e}"));
    let id = NcclComm::unique_id().unwrap_or_else(|e| panic!("{e}"));
    let comm =
        NcclComm::new(&id, 0, 1, &backend, DEFAULT_TIMEOUT).unwrap_or_else(|e| panic!("{e}"));
    (backend, comm)
}

/// Runs `f` on every rank of a loopback group, one thread each.
fn on_loopback<R: Send>(world: usize, f: impl Fn(CudaBackend, LoopbackComm) -> R + Sync) -> Vec<R> {
    on_threads(LoopbackComm::group(world).unwrap(), |_, c| {
        f(CudaBackend::new(0).unwrap(), c)
    })
}

fn unsharded_grads() -> Vec<Vec<f32>> {
    let backend = CudaBackend::new(0).unwrap_or_else(|e| panic!("{e}"));
    let mut unsharded = UnshardedStack::new(&backend, SHAPE, SEED).unwrap();
    unsharded.step().unwrap();
    (0..SHAPE.layers)
        .map(|l| unsharded.weight_grad(l).unwrap())
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn steady_state_steps_never_block_the_host() {
    let (backend, comm) = nccl_rank();
    let waits = host_waits_per_step(backend, comm, 4);
    assert_eq!(waits, [0, 0, 0, 0], "nccl: host waits per step");
    for world in [2, 4] {
        for (rank, waits) in on_loopback(world, |b, c| host_waits_per_step(b, c, 3))
            .iter()
            .enumerate()
        {
            assert_eq!(
                waits,
                &[0, 0, 0],
                "loopback world {world} rank {rank}: host waits per step"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn engine_gradients_equal_the_unsharded_gemms() {
    let whole = unsharded_grads();
    let (backend, comm) = nccl_rank();
    assert_eq!(
        grads_of_one_step(backend, comm),
        whole,
        "nccl at world size 1"
    );
    // Every rank computes the same gradients, so the mean over two ranks is exactly one rank's.
    let shards = on_loopback(2, grads_of_one_step);
    for layer in 0..SHAPE.layers {
        let joined: Vec<f32> = shards.iter().flat_map(|rank| rank[layer].clone()).collect();
        assert_eq!(joined, whole[layer], "loopback world 2, layer {layer}");
    }
}
