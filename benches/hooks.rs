//! Host cost of the engine's decisions: every hook of every unit in a steady-state step, on one
//! rank with tiny parameters, so the time is the engine's bookkeeping, not data movement.
//! The per-unit figure is the step's time divided by the number of units.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use fsdp_fusion::{
    CpuBackend, DType, Engine, EngineConfig, Input, LocalComm, ModelSpec, OptimizerConfig, ParamId,
    ParamSpec, Plan, Unit,
};

const UNITS: u32 = 64;

fn engine(overlap: bool) -> Engine<CpuBackend, LocalComm> {
    let params = (0..UNITS)
        .map(|u| ParamSpec::new(format!("w{u}"), &[1], DType::F32).in_unit(u))
        .collect();
    let plan = Arc::new(Plan::new(&ModelSpec::new(params).unwrap(), 1).unwrap());
    let comm = LocalComm::group(1).unwrap().pop().unwrap();
    let config = EngineConfig {
        overlap,
        optimizer: OptimizerConfig::sgd(0.0),
        ..EngineConfig::default()
    };
    Engine::new(plan, config, CpuBackend::new(), comm).unwrap()
}

fn step(e: &mut Engine<CpuBackend, LocalComm>) {
    let grad = [1.0f32];
    for u in 0..UNITS {
        e.pre_forward(Unit::Layer(u)).unwrap();
        e.post_forward(Unit::Layer(u)).unwrap();
    }
    for u in (0..UNITS).rev() {
        e.pre_backward(Unit::Layer(u)).unwrap();
        e.grad(ParamId(u as usize), Input::host(black_box(&grad)))
            .unwrap();
        e.post_backward(Unit::Layer(u)).unwrap();
    }
    e.finish_grad_sync().unwrap();
    e.end_step().unwrap();
}

fn hooks(c: &mut Criterion) {
    let mut group = c.benchmark_group("hooks");
    group.throughput(Throughput::Elements(UNITS as u64));
    for overlap in [true, false] {
        let mut e = engine(overlap);
        step(&mut e);
        let name = format!(
            "step_of_{UNITS}_units_overlap_{}",
            if overlap { "on" } else { "off" }
        );
        group.bench_function(name, |b| b.iter(|| step(&mut e)));
    }
    group.finish();
}

criterion_group!(benches, hooks);
criterion_main!(benches);
