//! A model of many units of one 1-element f32 parameter each, and a step through every hook of
//! every unit: the engine's bookkeeping alone, with no data to move, for the host-cost bench and
//! the tests that hold it linear in the number of units.

use std::hint::black_box;
use std::sync::Arc;

use fsdp_fusion::{
    CpuBackend, DType, Engine, EngineConfig, Input, LocalComm, ModelSpec, OptimizerConfig, ParamId,
    ParamSpec, Plan, Unit,
};

/// `units` units, parameter `w{u}` in unit `u`.
pub fn model(units: u32) -> ModelSpec {
    let params = (0..units)
        .map(|u| ParamSpec::new(format!("w{u}"), &[1], DType::F32).in_unit(u))
        .collect();
    ModelSpec::new(params).unwrap()
}

/// One eager CPU rank of [`model`] with `overlap`, SGD at a learning rate of 0.
pub fn engine(units: u32, overlap: bool) -> Engine<CpuBackend, LocalComm> {
    let plan = Arc::new(Plan::new(&model(units), 1).unwrap());
    let comm = LocalComm::group(1).unwrap().pop().unwrap();
    let config = EngineConfig {
        overlap,
        optimizer: OptimizerConfig::sgd(0.0),
        ..EngineConfig::default()
    };
    Engine::new(plan, config, CpuBackend::new(), comm).unwrap()
}

/// One step of `e`, a rank of [`model`]`(units)`: pre and post forward of every unit, then pre
/// backward, a gradient and post backward of every unit in reverse, `finish_grad_sync` and
/// `end_step`.
pub fn step(e: &mut Engine<CpuBackend, LocalComm>, units: u32) {
    let grad = [1.0f32];
    for u in 0..units {
        e.pre_forward(Unit::Layer(u)).unwrap();
        e.post_forward(Unit::Layer(u)).unwrap();
    }
    for u in (0..units).rev() {
        e.pre_backward(Unit::Layer(u)).unwrap();
        e.grad(ParamId(u as usize), Input::host(black_box(&grad)))
            .unwrap();
        e.post_backward(Unit::Layer(u)).unwrap();
    }
    e.finish_grad_sync().unwrap();
    e.end_step().unwrap();
}
