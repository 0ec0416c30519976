//! Planning, making an engine and every hook stay linear in the number of units: a plan of many
//! units is made in a bounded time, and a step's time per unit does not grow with the units.

use std::time::{Duration, Instant};

use fsdp_fusion::{Plan, Unit};
use fsdp_fusion_support::unit_stack::{engine, model, step};

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
        let mut e = engine(units, true);
        step(&mut e, units);
        let timed = |e: &mut _| {
            let started = Instant::now();
            step(e, units);
            started.elapsed()
        };
        let best = (0..3).map(|_| timed(&mut e)).min().unwrap();
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
