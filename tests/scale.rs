//! Planning, making an engine and every hook stay linear in the number of units: a plan of many
//! units is made in a bounded time, and a step's time per unit does not grow with the units.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fsdp_fusion::{
    CpuBackend, DType, Engine, EngineConfig, Input, LocalComm, ModelSpec, OptimizerConfig, ParamId,
    ParamSpec, Plan, Unit,
};

/// A model of `units` units of one 1-element parameter each.
fn model(units: u32) -> ModelSpec {
    let params = (0..units)
        .map(|u| ParamSpec::new(format!("w{u}"), &[1], DType::F32).in_unit(u))
        .collect();
    ModelSpec::new(params).unwrap()
}

fn engine(units: u32) -> Engine<CpuBackend, LocalComm> {
    let plan = Arc::new(Plan::new(&model(units), 1).unwrap());
    let comm = LocalComm::group(1).unwrap().pop().unwrap();
    let config = EngineConfig {
        optimizer: OptimizerConfig::sgd(0.0),
        ..EngineConfig::default()
    };
    Engine::new(plan, config, CpuBackend::new(), comm).unwrap()
}

/// The time of one step through every hook of every unit.
fn step(e: &mut Engine<CpuBackend, LocalComm>, units: u32) -> Duration {
    let grad = [1.0f32];
    let started = Instant::now();
    for u in 0..units {
        e.pre_forward(Unit::Layer(u)).unwrap();
        e.post_forward(Unit::Layer(u)).unwrap();
    }
    for u in (0..units).rev() {
        e.pre_backward(Unit::Layer(u)).unwrap();
        e.grad(ParamId(u as usize), Input::host(&grad)).unwrap();
        e.post_backward(Unit::Layer(u)).unwrap();
    }
    e.finish_grad_sync().unwrap();
    e.optimizer_step().unwrap();
    e.end_step().unwrap();
    started.elapsed()
}

/// 100 000 units: a plan that searched its groups and units linearly for each parameter took
/// over two minutes here unoptimized; one that looks them up takes a fraction of a second.
#[test]
fn a_plan_of_100k_units_is_made_in_a_second() {
    let model = model(100_000);
    let started = Instant::now();
    let plan = Plan::new(&model, 8).unwrap();
    let took = started.elapsed();
    assert_eq!(plan.units().len(), 100_000);
    assert_eq!(plan.unit_index(Unit::Layer(99_999)), Some(99_999));
    assert!(took < Duration::from_secs(2), "planning took {took:?}");
}

/// Each hook's lookups are O(1) or O(log n): the best of three steps per unit at 16 times the
/// units stays within 3 times that at the fewer (a lookup linear in the units would make it 16).
#[test]
fn a_steps_time_per_unit_does_not_grow_with_the_units() {
    let per_unit = |units: u32| {
        let mut e = engine(units);
        step(&mut e, units);
        let best = (0..3).map(|_| step(&mut e, units)).min().unwrap();
        best.as_secs_f64() / f64::from(units)
    };
    let (few, many) = (per_unit(1_000), per_unit(16_000));
    assert!(
        many < 3.0 * few,
        "{:.2} us per unit at 16 000 units, {:.2} us at 1 000",
        many * 1e6,
        few * 1e6
    );
}
