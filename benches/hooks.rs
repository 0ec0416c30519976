//! Host cost of the engine's decisions: every hook of every unit in a steady-state step, on one
//! rank with tiny parameters, so the time is the engine's bookkeeping, not data movement.
//! The per-unit figure is the step's time divided by the number of units.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use fsdp_fusion_support::unit_stack::{engine, step};

const UNITS: u32 = 64;

fn hooks(c: &mut Criterion) {
    let mut group = c.benchmark_group("hooks");
    group.throughput(Throughput::Elements(UNITS as u64));
    for overlap in [true, false] {
        let mut e = engine(UNITS, overlap);
        step(&mut e, UNITS);
        let name = format!(
            "step_of_{UNITS}_units_overlap_{}",
            if overlap { "on" } else { "off" }
        );
        group.bench_function(name, |b| b.iter(|| step(&mut e, UNITS)));
    }
    group.finish();
}

criterion_group!(benches, hooks);
criterion_main!(benches);
