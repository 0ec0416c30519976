//! Orderings between the streams that once went missing, each checked where the streams really
//! run apart: the asynchronous CPU backend over many seeds, and the GPU.

use std::sync::Arc;

use fsdp_fusion::types::Stream;
use fsdp_fusion::{
    Backend, Communicator, DType, Engine, EngineConfig, Input, ModelSpec, OptimizerConfig,
    ParamSpec, Plan, Unit,
};
use fsdp_fusion_support::ranks::{for_each_mode, on_engines};

const LEN: usize = 64;

fn model() -> ModelSpec {
    ModelSpec::new(vec![
        ParamSpec::new("w", &[LEN as u64], DType::F32).in_unit(0),
    ])
    .unwrap()
}

fn sgd() -> EngineConfig {
    EngineConfig {
        optimizer: OptimizerConfig::sgd(1.0),
        ..EngineConfig::default()
    }
}

/// Step 1: every weight (1) gets gradient 1, and the compute stream has `busy` more operations
/// queued before the optimizer; step 2: no gradient. With SGD at lr 1 the weights end at 0; if
/// step 2's zeroing of the gradient shards ran before step 1's optimizer read them, they stay 1.
/// Returns the rank's shard of `w` after both steps.
fn two_steps<B: Backend, C: Communicator<B>>(
    e: &mut Engine<B, C>,
    busy: impl FnOnce(&B),
) -> Vec<f32> {
    let w = e.plan().param_id("w").unwrap();
    e.load_param(w, Input::host(&[1f32; LEN])).unwrap();
    e.pre_forward(Unit::Layer(0)).unwrap();
    e.post_forward(Unit::Layer(0)).unwrap();
    e.pre_backward(Unit::Layer(0)).unwrap();
    e.grad(w, Input::host(&[1f32; LEN])).unwrap();
    e.post_backward(Unit::Layer(0)).unwrap();
    e.finish_grad_sync().unwrap();
    busy(e.backend());
    e.optimizer_step().unwrap();
    e.end_step().unwrap();
    // An evaluation-like step: a forward, no gradient.
    e.pre_forward(Unit::Layer(0)).unwrap();
    e.post_forward(Unit::Layer(0)).unwrap();
    e.finish_grad_sync().unwrap();
    e.optimizer_step().unwrap();
    e.end_step().unwrap();
    let group = e.plan().param(w).unwrap().group();
    bytemuck::cast_slice(&e.param_shard(group).unwrap()).to_vec()
}

#[test]
fn a_step_without_gradients_keeps_the_update_of_the_step_before() {
    for_each_mode(|mode| {
        for world in [1, 2] {
            let plan = Arc::new(Plan::new(&model(), world).unwrap());
            let shards = on_engines(&plan, &sgd(), mode, |mut e| {
                two_steps(&mut e, |b| {
                    for _ in 0..300 {
                        b.record(Stream::Compute).unwrap();
                    }
                })
            });
            for (rank, shard) in shards.iter().enumerate() {
                let held = plan.shard_range(&plan.groups()[0], rank).unwrap();
                let w = &shard[..held.end.min(LEN).saturating_sub(held.start)];
                assert!(
                    w.iter().all(|&x| x == 0.0),
                    "world {world} rank {rank} ({mode:?}): {w:?}, step 1's update was lost"
                );
            }
        }
    });
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn on_the_gpu_a_step_without_gradients_keeps_the_update_of_the_step_before() {
    use fsdp_fusion::backend::Region;
    use fsdp_fusion::backend::cuda::CudaBackend;
    use fsdp_fusion::comm::loopback::LoopbackComm;
    let plan = Arc::new(Plan::new(&model(), 1).unwrap());
    let backend = CudaBackend::new(0).unwrap();
    let comm = LoopbackComm::group(1).unwrap().pop().unwrap();
    let mut e = Engine::new(plan, sgd(), backend, comm).unwrap();
    // A few hundred kernels over 64 MiB keep the compute stream busy for milliseconds.
    let mut scratch = e.backend().alloc(64 << 20).unwrap();
    let shard = two_steps(&mut e, |b| {
        for _ in 0..300 {
            // SAFETY: the scratch buffer is used on the compute stream only.
            unsafe {
                b.zero(
                    Stream::Compute,
                    &mut scratch,
                    Region::new(0, 16 << 20, DType::F32),
                )
            }
            .unwrap();
        }
    });
    assert!(
        shard[..LEN].iter().all(|&x| x == 0.0),
        "{:?}: step 1's update was lost",
        &shard[..LEN]
    );
}
