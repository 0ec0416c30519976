//! SCRATCH (review of 5ce5373): not to be committed.
use std::sync::Arc;
use std::time::Duration;

use fsdp_fusion::{
    CpuBackend, DType, Engine, EngineConfig, Input, LocalComm, ModelSpec, OptimizerConfig,
    ParamSpec, Plan, Result, Unit,
};
use fsdp_fusion_support::ranks::{Mode, on_engines};

fn model() -> ModelSpec {
    ModelSpec::new(vec![
        ParamSpec::new("r", &[5], DType::F32),
        ParamSpec::new("a", &[7], DType::F32).in_unit(0),
        ParamSpec::new("a2", &[3], DType::F32).in_unit(0),
        ParamSpec::new("an", &[4], DType::F32).in_unit(0).no_weight_decay(),
        ParamSpec::new("b", &[6], DType::F32).in_unit(1),
        ParamSpec::new("b2", &[2], DType::F32).in_unit(1),
        ParamSpec::new("bn", &[9], DType::F32).in_unit(1).no_weight_decay(),
    ])
    .unwrap()
}

fn config() -> EngineConfig {
    EngineConfig {
        optimizer: OptimizerConfig::sgd(0.5),
        verify_collectives: true,
        timeout: Duration::from_secs(3),
        ..EngineConfig::default()
    }
}

type E = Engine<CpuBackend, LocalComm>;

fn grad(e: &mut E, name: &str) -> Result<()> {
    let id = e.plan().param_id(name)?;
    let n = e.plan().param(id)?.numel;
    e.grad(id, Input::host(&vec![1.0f32; n]))
}

fn forward(e: &mut E) -> Result<()> {
    for unit in [Unit::Root, Unit::Layer(0), Unit::Layer(1)] {
        e.pre_forward(unit)?;
        e.post_forward(unit)?;
    }
    Ok(())
}

fn report(what: &str, out: Vec<Result<(u64, u64)>>) {
    for (rank, o) in out.iter().enumerate() {
        eprintln!("{what}: rank {rank}: {o:?}");
    }
}

/// 1. Identical hooks (root only), second backward after finish_grad_sync: pass begun on rank 0
/// by its gradient only; rank 1 got none.
#[test]
fn s1_pass_begun_by_a_gradient_only() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let out = on_engines(&plan, &config(), Mode::Eager, |mut e| -> Result<(u64, u64)> {
        forward(&mut e)?;
        e.pre_backward(Unit::Root)?;
        e.post_backward(Unit::Root)?;
        e.finish_grad_sync()?;
        let before = e.counters().reduce_scatters;
        // A second backward of the step after the sync (retain_graph), same hooks on both.
        e.pre_backward(Unit::Root)?;
        if e.rank() == 0 {
            grad(&mut e, "r")?;
        }
        e.post_backward(Unit::Root)?;
        e.finish_grad_sync()?;
        let after = e.counters().reduce_scatters;
        e.optimizer_step()?;
        e.end_step()?;
        Ok((before, after))
    });
    report("s1", out);
}

/// 1b. No backward hooks at all: rank 0 hands over a gradient, rank 1 none.
#[test]
fn s1b_no_backward_hooks() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let out = on_engines(&plan, &config(), Mode::Eager, |mut e| -> Result<(u64, u64)> {
        forward(&mut e)?;
        if e.rank() == 0 {
            grad(&mut e, "a")?;
        }
        e.finish_grad_sync()?;
        let after = e.counters().reduce_scatters;
        e.optimizer_step()?;
        e.end_step()?;
        Ok((0, after))
    });
    report("s1b", out);
}

/// 2. Same hooks, post_backward (documented optional) left to finish_grad_sync: every slot is
/// filling, and the partial reduction picks the group by arrival.
#[test]
fn s2_no_post_backward_partial_by_arrival() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let out = on_engines(&plan, &config(), Mode::Eager, |mut e| -> Result<(u64, u64)> {
        eprintln!("slots {}", e.policy().layout.grad_slots);
        forward(&mut e)?;
        e.pre_backward(Unit::Layer(1))?;
        let order: &[&str] = match e.rank() {
            0 => &["b", "bn"],
            _ => &["bn", "b"],
        };
        for n in order {
            grad(&mut e, n)?;
        }
        e.pre_backward(Unit::Layer(0))?;
        let order: &[&str] = match e.rank() {
            0 => &["a", "an"],
            _ => &["an", "a"],
        };
        for n in order {
            grad(&mut e, n)?;
        }
        e.finish_grad_sync()?;
        let after = e.counters().reduce_scatters;
        e.optimizer_step()?;
        e.end_step()?;
        Ok((0, after))
    });
    report("s2", out);
}

/// 2b. Same hooks, two units' backwards open at once (each post_backward issued).
#[test]
fn s2b_overlapping_unit_backwards() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let out = on_engines(&plan, &config(), Mode::Eager, |mut e| -> Result<(u64, u64)> {
        forward(&mut e)?;
        e.pre_backward(Unit::Layer(1))?;
        e.pre_backward(Unit::Layer(0))?;
        let order: &[&str] = match e.rank() {
            0 => &["b", "bn", "a", "an"],
            _ => &["an", "a", "bn", "b"],
        };
        for n in order {
            grad(&mut e, n)?;
        }
        e.post_backward(Unit::Layer(1))?;
        e.post_backward(Unit::Layer(0))?;
        e.finish_grad_sync()?;
        let after = e.counters().reduce_scatters;
        e.optimizer_step()?;
        e.end_step()?;
        Ok((0, after))
    });
    report("s2b", out);
}

/// 3. A backward with no gradient at all on any rank, then end_step without a sync (worked
/// before the commit: nothing was pending).
#[test]
fn s3_gradient_free_backward_then_end_step() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let out = on_engines(&plan, &config(), Mode::Eager, |mut e| -> Result<(u64, u64)> {
        forward(&mut e)?;
        for unit in [Unit::Layer(1), Unit::Layer(0), Unit::Root] {
            e.pre_backward(unit)?;
            e.post_backward(unit)?;
        }
        let rs = e.counters().reduce_scatters;
        let ended = e.end_step();
        eprintln!("s3 rank {} in_step={} end_step -> {ended:?}", e.rank(), e.in_step());
        Ok((rs, 0))
    });
    report("s3", out);
}

/// Rank 0 hands over every gradient, rank 1 none, with every hook: a full step.
fn full_step(e: &mut E) -> Result<()> {
    forward(e)?;
    for (unit, names) in [
        (Unit::Layer(1), &["b", "b2", "bn"][..]),
        (Unit::Layer(0), &["a", "a2", "an"][..]),
        (Unit::Root, &["r"][..]),
    ] {
        e.pre_backward(unit)?;
        if e.rank() == 0 {
            for n in names {
                grad(e, n)?;
            }
        }
        e.post_backward(unit)?;
    }
    e.finish_grad_sync()?;
    e.optimizer_step()?;
    e.end_step()
}

/// 4. end_pass's zero opens set in_pass again on the rank that missed a gradient only: a later
/// step with no backward (forward, then the step) reduces every group on that rank alone.
#[test]
fn s4_stale_in_pass_after_zero_opens() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let out = on_engines(&plan, &config(), Mode::Eager, |mut e| -> Result<(u64, u64)> {
        full_step(&mut e)?;
        let before = e.counters().reduce_scatters;
        forward(&mut e)?;
        e.finish_grad_sync()?;
        let after = e.counters().reduce_scatters;
        e.optimizer_step()?;
        e.end_step()?;
        Ok((before, after))
    });
    report("s4", out);
}

/// 4b. Same, within one step: finish_grad_sync, then an evaluation forward before the
/// optimizer's step (enter(Forward) ends the "pass").
#[test]
fn s4b_forward_between_sync_and_step() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let out = on_engines(&plan, &config(), Mode::Eager, |mut e| -> Result<(u64, u64)> {
        forward(&mut e)?;
        for (unit, names) in [
            (Unit::Layer(1), &["b", "b2", "bn"][..]),
            (Unit::Layer(0), &["a", "a2", "an"][..]),
            (Unit::Root, &["r"][..]),
        ] {
            e.pre_backward(unit)?;
            if e.rank() == 0 {
                for n in names {
                    grad(&mut e, n)?;
                }
            }
            e.post_backward(unit)?;
        }
        e.finish_grad_sync()?;
        let before = e.counters().reduce_scatters;
        forward(&mut e)?;
        let after = e.counters().reduce_scatters;
        e.finish_grad_sync()?;
        e.optimizer_step()?;
        e.end_step()?;
        Ok((before, after))
    });
    report("s4b", out);
}
