//! Ranks whose backward passes differ in which gradients they hand over, and in what order (an
//! expert no token was routed to, a branch one rank's batch skipped), reduce the same groups in
//! the same order, and train as if each missing gradient were zero: every rank's parameters
//! equal SGD on the mean of the ranks' gradients. Each case runs eagerly and on asynchronous
//! CPU backends, with the ranks' collectives compared every step.

use std::sync::Arc;

use fsdp_fusion::{
    Accumulation, Communicator, CpuBackend, DType, Engine, EngineConfig, Error, Input, ModelSpec,
    OptimizerConfig, ParamId, ParamSpec, Plan, Result, Unit,
};
use fsdp_fusion_support::ranks::{for_each_mode, on_engines};

const LR: f32 = 0.5;

/// The root's parameter and two units of two groups each (a decayed one of two parameters, an
/// exempt one), of odd sizes.
fn model() -> ModelSpec {
    ModelSpec::new(vec![
        ParamSpec::new("r", &[5], DType::F32),
        ParamSpec::new("a", &[7], DType::F32).in_unit(0),
        ParamSpec::new("a2", &[3], DType::F32).in_unit(0),
        ParamSpec::new("an", &[4], DType::F32)
            .in_unit(0)
            .no_weight_decay(),
        ParamSpec::new("b", &[6], DType::F32).in_unit(1),
        ParamSpec::new("b2", &[2], DType::F32).in_unit(1),
        ParamSpec::new("bn", &[9], DType::F32)
            .in_unit(1)
            .no_weight_decay(),
    ])
    .unwrap()
}

/// The parameters `rank` hands gradients over for, in its order: rank 0 every one, rank 1 none
/// of unit 1's exempt group and not `a`, rank 2 none of the root's or of unit 0's exempt group
/// and not `b2`, each unit's in another order.
fn handed_over(rank: usize) -> &'static [&'static str] {
    match rank {
        0 => &["b", "b2", "bn", "a", "a2", "an", "r"],
        1 => &["r", "b2", "b", "an", "a2"],
        _ => &["bn", "b", "a", "a2"],
    }
}

fn gradient(rank: usize, param: ParamId, numel: usize) -> Vec<f32> {
    (0..numel)
        .map(|i| (rank + 1) as f32 * 0.25 + param.0 as f32 * 0.5 + i as f32 * 0.125)
        .collect()
}

fn initial(param: ParamId, numel: usize) -> Vec<f32> {
    (0..numel)
        .map(|i| 1.0 + param.0 as f32 - i as f32 * 0.0625)
        .collect()
}

/// How a rank hands a unit's gradients over, between the unit's hooks (unit 1's backward, then
/// unit 0's, then the root's).
#[derive(Clone, Copy, Debug)]
enum Drive {
    OneByOne,
    Batch,
}

/// One step of `drive` on `e`: a forward with every hook, the rank's gradients, the sync and the
/// optimizer's step; returns every parameter's whole value after it.
fn step<C: Communicator<CpuBackend>>(
    e: &mut Engine<CpuBackend, C>,
    drive: Drive,
) -> Result<Vec<Vec<f32>>> {
    let plan = e.plan().clone();
    load_initial(e)?;
    forward(e)?;
    let rank = e.rank();
    let gradients: Vec<(ParamId, Vec<f32>)> = handed_over(rank)
        .iter()
        .map(|name| {
            let id = plan.param_id(name)?;
            Ok((id, gradient(rank, id, plan.param(id)?.numel())))
        })
        .collect::<Result<_>>()?;
    for unit in [Unit::Layer(1), Unit::Layer(0), Unit::Root] {
        e.pre_backward(unit)?;
        let mut batch = Vec::new();
        for (id, g) in &gradients {
            if plan.param(*id)?.unit() == unit {
                batch.push((*id, Input::host(g)));
            }
        }
        match drive {
            Drive::OneByOne => {
                for &(id, g) in &batch {
                    e.grad(id, g)?;
                }
            }
            Drive::Batch => e.grads(&batch)?,
        }
        e.post_backward(unit)?;
    }
    e.finish_grad_sync()?;
    e.optimizer_step()?;
    e.end_step()?;
    values_of(e)
}

/// Every parameter's whole value.
fn values_of<C: Communicator<CpuBackend>>(e: &mut Engine<CpuBackend, C>) -> Result<Vec<Vec<f32>>> {
    let plan = e.plan().clone();
    let mut values = vec![Vec::new(); plan.params().len()];
    for g in plan.groups() {
        let whole = e.gather_group(g.index())?;
        for id in g.params() {
            let p = plan.param(*id)?;
            values[id.0] = whole[p.offset() * 4..(p.offset() + p.numel()) * 4]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
        }
    }
    Ok(values)
}

/// SGD on the mean over `world` ranks of their gradients, zero where a rank handed none over.
fn expected(plan: &Plan, world: usize) -> Vec<Vec<f32>> {
    plan.params()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let id = ParamId(i);
            let mut mean = vec![0f32; p.numel()];
            for rank in 0..world {
                if handed_over(rank).contains(&p.name()) {
                    for (m, g) in mean.iter_mut().zip(gradient(rank, id, p.numel())) {
                        *m += g;
                    }
                }
            }
            (initial(id, p.numel()).iter().zip(mean))
                .map(|(v, m)| v - LR * (m / world as f32))
                .collect()
        })
        .collect()
}

/// SGD, the ranks' collectives compared every step.
fn sgd() -> EngineConfig {
    EngineConfig {
        optimizer: OptimizerConfig::sgd(LR),
        verify_collectives: true,
        ..EngineConfig::default()
    }
}

fn configs() -> Vec<(&'static str, EngineConfig)> {
    let base = sgd();
    vec![
        ("every pass reduces", base.clone()),
        (
            "no overlap, one reduction in flight",
            EngineConfig {
                overlap: false,
                max_reduces_in_flight: 1,
                ..base.clone()
            },
        ),
        (
            "no-sync accumulation",
            EngineConfig {
                accumulation: Accumulation::NoSync,
                ..base.clone()
            },
        ),
        (
            "the optimizer in the backward",
            EngineConfig {
                step_in_backward: true,
                ..base
            },
        ),
    ]
}

#[test]
fn ranks_handing_over_different_gradients_in_different_orders_train_on_their_mean() {
    for world in [2, 3] {
        let plan = Arc::new(Plan::new(&model(), world).unwrap());
        let want = expected(&plan, world);
        for (name, config) in configs() {
            for drive in [Drive::OneByOne, Drive::Batch] {
                for_each_mode(|mode| {
                    let values = on_engines(&plan, &config, mode, move |mut e| step(&mut e, drive));
                    for (rank, got) in values.into_iter().enumerate() {
                        let got = got.unwrap_or_else(|e| {
                            panic!("world {world}, {name}, {drive:?}, {mode:?}, rank {rank}: {e}")
                        });
                        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                            for (x, y) in g.iter().zip(w) {
                                assert!(
                                    (x - y).abs() <= 1e-6 * y.abs().max(1.0),
                                    "world {world}, {name}, {drive:?}, {mode:?}, rank {rank}, \
                                     {}: {g:?} against {w:?}",
                                    plan.params()[i].name()
                                );
                            }
                        }
                    }
                });
            }
        }
    }
}

#[test]
fn a_gradient_after_its_units_backward_ended_is_refused_and_the_pass_goes_on() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let config = sgd();
    for_each_mode(|mode| {
        let outcomes = on_engines(&plan, &config, mode, |mut e| -> Result<Error> {
            let a = e.plan().param_id("a")?;
            let numel = e.plan().param(a)?.numel();
            forward(&mut e)?;
            e.pre_backward(Unit::Layer(0))?;
            e.post_backward(Unit::Layer(0))?;
            let late = e.grad(a, Input::host(&vec![1.0; numel])).unwrap_err();
            // Refused, nothing changed: the step ends as the peer's does.
            e.finish_grad_sync()?;
            e.optimizer_step()?;
            e.end_step()?;
            Ok(late)
        });
        for outcome in outcomes {
            match outcome {
                Ok(Error::GradientAfterItsUnit { name, unit }) => {
                    assert_eq!((name.as_str(), unit), ("a", Unit::Layer(0)));
                }
                other => panic!("{mode:?}: {other:?}"),
            }
        }
    });
}

/// A backward pass with every hook, unit 1's then unit 0's then the root's, in which only rank 0
/// hands over gradients.
fn backward_of_rank_0<C: Communicator<CpuBackend>>(e: &mut Engine<CpuBackend, C>) -> Result<()> {
    let plan = e.plan().clone();
    for unit in [Unit::Layer(1), Unit::Layer(0), Unit::Root] {
        e.pre_backward(unit)?;
        if e.rank() == 0 {
            for p in plan.params().iter().filter(|p| p.unit() == unit) {
                let id = plan.param_id(p.name())?;
                e.grad(id, Input::host(&gradient(0, id, p.numel())))?;
            }
        }
        e.post_backward(unit)?;
    }
    Ok(())
}

/// A step of two backward passes of rank 0's gradients, each synced, then the update.
fn two_synced_passes_of_rank_0<C: Communicator<CpuBackend>>(
    e: &mut Engine<CpuBackend, C>,
) -> Result<()> {
    forward(e)?;
    backward_of_rank_0(e)?;
    e.finish_grad_sync()?;
    backward_of_rank_0(e)?;
    e.finish_grad_sync()?;
    e.optimizer_step()?;
    e.end_step()
}

/// Every parameter's initial value.
fn load_initial<C: Communicator<CpuBackend>>(e: &mut Engine<CpuBackend, C>) -> Result<()> {
    let plan = e.plan().clone();
    for p in plan.params() {
        let id = plan.param_id(p.name())?;
        e.load_param(id, Input::host(&initial(id, p.numel())))?;
    }
    Ok(())
}

fn forward<C: Communicator<CpuBackend>>(e: &mut Engine<CpuBackend, C>) -> Result<()> {
    for unit in [Unit::Root, Unit::Layer(0), Unit::Layer(1)] {
        e.pre_forward(unit)?;
        e.post_forward(unit)?;
    }
    Ok(())
}

#[test]
fn only_the_hooks_begin_and_end_a_pass_so_ranks_without_gradients_keep_in_step() {
    // Rank 1 gets no gradient at all. Steps: a forward between the sync and the optimizer's
    // step; a step with no backward; a second backward pass after the sync. Each rank issues
    // the same collectives (compared every step) and as many reductions.
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let config = sgd();
    for_each_mode(|mode| {
        let counts = on_engines(&plan, &config, mode, |mut e| -> Result<Vec<u64>> {
            let mut counts = Vec::new();
            forward(&mut e)?;
            backward_of_rank_0(&mut e)?;
            e.finish_grad_sync()?;
            forward(&mut e)?;
            e.optimizer_step()?;
            e.end_step()?;
            counts.push(e.counters().reduce_scatters);
            forward(&mut e)?;
            e.finish_grad_sync()?;
            e.optimizer_step()?;
            e.end_step()?;
            counts.push(e.counters().reduce_scatters);
            two_synced_passes_of_rank_0(&mut e)?;
            counts.push(e.counters().reduce_scatters);
            Ok(counts)
        });
        let counts: Vec<Vec<u64>> = counts
            .into_iter()
            .map(|c| c.unwrap_or_else(|e| panic!("{mode:?}: {e}")))
            .collect();
        // Five trainable groups a pass: one pass, none, two.
        assert_eq!(counts[0], [5, 5, 15], "{mode:?}");
        assert_eq!(counts[0], counts[1], "{mode:?}");
    });
}

/// A second backward pass after the step's first sync (a further micro-batch) adds to the
/// passes before it in every accumulation: with rank 0's gradients in both passes and none on
/// rank 1, every parameter ends as SGD on the mean of the two passes' sums, bit for bit.
#[test]
fn a_pass_after_a_sync_adds_to_the_passes_before_in_every_accumulation() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let no_sync = EngineConfig {
        accumulation: Accumulation::NoSync,
        ..sgd()
    };
    let want: Vec<Vec<f32>> = plan
        .params()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (id, g) = (ParamId(i), gradient(0, ParamId(i), p.numel()));
            let initial = initial(id, p.numel());
            // Two passes of `g` from rank 0, none from rank 1: their mean is `g`.
            initial.iter().zip(g).map(|(v, g)| v - LR * g).collect()
        })
        .collect();
    for (what, config) in [("every pass reduces", sgd()), ("no-sync", no_sync)] {
        for_each_mode(|mode| {
            let values = on_engines(&plan, &config, mode, |mut e| -> Result<Vec<Vec<f32>>> {
                load_initial(&mut e)?;
                two_synced_passes_of_rank_0(&mut e)?;
                values_of(&mut e)
            });
            for (rank, values) in values.into_iter().enumerate() {
                let values = values.unwrap_or_else(|e| panic!("{what}, {mode:?}: {e}"));
                assert_eq!(values, want, "{what}, {mode:?}, rank {rank}");
            }
        });
    }
}
