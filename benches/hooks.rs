//! Host cost of the engine's decisions: every hook of every unit in a steady-state step, on one
//! rank with tiny parameters, so the time is the engine's bookkeeping, not data movement.
//! The per-unit figure is the step's time divided by the number of units: the median over
//! samples of many steps, with the 10th and 90th percentiles.
//!
//!     cargo bench --bench hooks [-- --samples 50]

use std::time::{Duration, Instant};

use clap::Parser;
use fsdp_fusion_support::unit_stack::{engine, step};

const UNITS: u32 = 64;
/// Each sample times this much of stepping, whole steps.
const SAMPLE: Duration = Duration::from_millis(100);

#[derive(Parser)]
struct Args {
    /// Samples of each case, for the median and the 10th and 90th percentiles.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u16).range(10..))]
    samples: u16,
    /// Accepted and ignored, as cargo bench passes it.
    #[arg(long, hide = true)]
    bench: bool,
}

fn main() {
    let samples = usize::from(Args::parse().samples);
    for overlap in [true, false] {
        let mut e = engine(UNITS, overlap);
        // Steps per sample, from a first second of warm-up steps.
        let warm = Instant::now();
        let mut steps = 0u32;
        while warm.elapsed() < Duration::from_secs(1) {
            step(&mut e, UNITS);
            steps += 1;
        }
        let per_sample = (f64::from(steps) * SAMPLE.as_secs_f64()).ceil().max(1.0) as u32;
        let mut per_step: Vec<f64> = (0..samples)
            .map(|_| {
                let start = Instant::now();
                for _ in 0..per_sample {
                    step(&mut e, UNITS);
                }
                start.elapsed().as_secs_f64() / f64::from(per_sample)
            })
            .collect();
        per_step.sort_by(f64::total_cmp);
        let at = |q: usize| per_step[(per_step.len() - 1) * q / 100] * 1e6;
        println!(
            "step of {UNITS} units, overlap {}: {:.2} us per step ({:.2}-{:.2}), {:.3} us per unit",
            if overlap { "on" } else { "off" },
            at(50),
            at(10),
            at(90),
            at(50) / f64::from(UNITS),
        );
    }
}
