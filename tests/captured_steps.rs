//! A step captured once on the asynchronous CPU backend's streams and replayed step after step
//! trains exactly as the same steps run eagerly: at world sizes 1 to 4, with AdamW under a
//! learning rate changed every step (the replays read it from the step's values on the
//! device), SGD, bf16 parameters with fp32 masters, and the optimizer inside the backward. The
//! model's work runs on the compute stream too (a gradient `w - target` from the gathered
//! values and a target refilled before every step), as a GPU model's kernels would, so the
//! capture holds it; the host's counts follow the replays, and an eager step after them goes on
//! from where they left.

use std::sync::Arc;

use fsdp_fusion::backend::{Backend, RawAddress, Region};
use fsdp_fusion::{
    CpuBackend, DType, Engine, EngineConfig, Error, GradShardMemory, Input, LocalComm, ModelSpec,
    OptimizerConfig, ParamId, ParamSpec, Plan, Result, Stream, Unit,
};
use fsdp_fusion_support::ranks::{Mode, for_each_mode, on_engines};

const STEPS: usize = 5;

/// The root's parameter, and two units: unit 0 an f32 group and an exempt one, unit 1 an f32
/// and a bf16 group; odd sizes.
fn model() -> ModelSpec {
    ModelSpec::new(vec![
        ParamSpec::new("r", &[5], DType::F32),
        ParamSpec::new("a", &[7], DType::F32).in_unit(0),
        ParamSpec::new("an", &[4], DType::F32)
            .in_unit(0)
            .no_weight_decay(),
        ParamSpec::new("b", &[6], DType::F32).in_unit(1),
        ParamSpec::new("c", &[9], DType::Bf16).in_unit(1),
    ])
    .unwrap()
}

/// Each parameter's target of `step` on `rank`.
fn target(rank: usize, step: usize, param: usize, numel: usize) -> Vec<f32> {
    (0..numel)
        .map(|i| ((rank * 7 + step * 3 + param * 5 + i) % 11) as f32 * 0.25 - 1.0)
        .collect()
}

/// Each rank's buffers outside the engine: per parameter, its target (refilled before every
/// step) and its gradient (written on the compute stream), with their addresses.
struct Batch {
    targets: Vec<<CpuBackend as Backend>::Buffer>,
    gradients: Vec<<CpuBackend as Backend>::Buffer>,
}

impl Batch {
    fn new(e: &Engine<CpuBackend, LocalComm>) -> Result<Batch> {
        let numels: Vec<usize> = e.plan().params().iter().map(|p| p.numel).collect();
        let scratch = |n: usize| e.backend().alloc_scratch(n * 4);
        Ok(Batch {
            targets: numels.iter().map(|&n| scratch(n)).collect::<Result<_>>()?,
            gradients: numels.iter().map(|&n| scratch(n)).collect::<Result<_>>()?,
        })
    }

    fn fill(&mut self, e: &Engine<CpuBackend, LocalComm>, step: usize) -> Result<()> {
        for (i, p) in e.plan().params().iter().enumerate() {
            let values = target(e.rank(), step, i, p.numel);
            let region = Region::new(0, p.numel, DType::F32);
            let bytes: &[u8] = bytemuck::cast_slice(&values);
            e.backend().upload(&mut self.targets[i], region, bytes)?;
        }
        Ok(())
    }
}

/// Runs `f` on `e` and a batch of its own, which outlives the engine: the engine's end lets its
/// streams finish the work that reads the batch.
fn with_batch<R>(
    mut e: Engine<CpuBackend, LocalComm>,
    f: impl FnOnce(&mut Engine<CpuBackend, LocalComm>, &mut Batch) -> R,
) -> R {
    let mut batch = Batch::new(&e).unwrap_or_else(|e| panic!("a batch: {e}"));
    let r = f(&mut e, &mut batch);
    drop(e);
    r
}

/// One step's hooks, with the model's work on the compute stream: each parameter's gradient is
/// its gathered value minus its target.
fn step(e: &mut Engine<CpuBackend, LocalComm>, batch: &Batch) -> Result<()> {
    for unit in [Unit::Root, Unit::Layer(0), Unit::Layer(1)] {
        e.pre_forward(unit)?;
        e.post_forward(unit)?;
    }
    let plan = e.plan().clone();
    for unit in [Unit::Layer(1), Unit::Layer(0), Unit::Root] {
        e.pre_backward(unit)?;
        for (i, p) in plan.params().iter().enumerate() {
            if p.unit != unit {
                continue;
            }
            let id = ParamId(i);
            let values = e.param_device(id)?;
            let f32s = Region::new(0, p.numel, DType::F32);
            let target = e.backend().stream_address(&batch.targets[i], f32s)?;
            let gradient = e.backend().stream_address(&batch.gradients[i], f32s)?;
            e.backend().run(Stream::Compute, move || {
                // SAFETY: on the compute stream, after the hook that gathered the values; the
                // batch's buffers outlive every step and are written by the host only between
                // steps (an upload waits for the streams).
                unsafe {
                    for k in 0..values.numel {
                        let w = match values.dtype {
                            DType::Bf16 => {
                                half::bf16::from_bits(*(values.ptr as *const u16).add(k)).to_f32()
                            }
                            _ => *(values.ptr as *const f32).add(k),
                        };
                        let t = *(target as *const f32).add(k);
                        *(gradient as *mut f32).add(k) = w - t;
                    }
                }
                Ok(())
            })?;
            // SAFETY: the gradient buffer holds `numel` f32, written above on the compute
            // stream, where the engine reads it; the next write is the next step's.
            e.grad(id, unsafe { Input::device(gradient, p.numel, DType::F32) })?;
        }
        e.post_backward(unit)?;
    }
    e.finish_grad_sync()?;
    e.optimizer_step()?;
    e.end_step()
}

/// The learning rate of step `step`: a different one every step.
fn lr(step: usize) -> f32 {
    0.05 / (1.0 + step as f32)
}

/// Every group's shard bytes after each of [`STEPS`] steps, and the counts at the end; the steps
/// from the second on captured once and replayed when `captured`, with one eager step after
/// the replays.
fn train(mode: Mode, world: usize, config: &EngineConfig, captured: bool) -> Vec<Trained> {
    let plan = Arc::new(Plan::new(&model(), world).unwrap());
    on_engines(&plan, config, mode, move |e| {
        with_batch(e, |e, batch| -> Trained {
            let mut shards = Vec::new();
            let mut capture = None;
            for s in 0..STEPS {
                batch.fill(e, s).unwrap();
                e.set_lr(lr(s)).unwrap();
                let replayed = captured && (1..STEPS - 1).contains(&s);
                if replayed {
                    if capture.is_none() {
                        e.begin_capture().unwrap();
                        step(e, batch).unwrap();
                        capture = Some(e.end_capture().unwrap());
                    }
                    e.replay(capture.as_ref().unwrap()).unwrap();
                } else {
                    step(e, batch).unwrap();
                }
                let groups = 0..e.plan().groups().len();
                shards.push(groups.map(|g| e.param_shard(g).unwrap()).collect());
            }
            Trained {
                shards,
                steps: e.counters().steps,
                reduce_scatters: e.counters().reduce_scatters,
                all_gathers: e.counters().all_gathers,
            }
        })
    })
}

#[derive(Debug, PartialEq)]
struct Trained {
    shards: Vec<Vec<Vec<u8>>>,
    steps: u64,
    reduce_scatters: u64,
    all_gathers: u64,
}

fn configs() -> Vec<(&'static str, EngineConfig)> {
    let adamw = EngineConfig::default();
    vec![
        ("adamw", adamw.clone()),
        (
            "sgd with weight decay",
            EngineConfig {
                optimizer: OptimizerConfig::Sgd {
                    lr: 0.1,
                    weight_decay: 0.01,
                },
                ..adamw.clone()
            },
        ),
        (
            "adamw in the backward",
            EngineConfig {
                step_in_backward: true,
                ..adamw
            },
        ),
    ]
}

#[test]
fn replays_of_a_captured_step_train_as_eager_steps_do() {
    for world in 1..=4 {
        for (name, config) in configs() {
            let runs = for_each_mode(|mode| match mode {
                Mode::Eager => None,
                Mode::Async(_) => Some((
                    train(mode, world, &config, false),
                    train(mode, world, &config, true),
                )),
            });
            for (eager, replayed) in runs.into_iter().flatten() {
                for (rank, (eager, replayed)) in eager.iter().zip(&replayed).enumerate() {
                    let what = format!("world {world}, {name}, rank {rank}");
                    for (s, (e, r)) in eager.shards.iter().zip(&replayed.shards).enumerate() {
                        let group = (e.iter().zip(r)).position(|(e, r)| e != r);
                        assert_eq!(group, None, "{what}: step {s}'s shards differ");
                    }
                    assert_eq!(eager, replayed, "{what}: counts");
                }
                // Each step moved the parameters.
                let shards = &eager[0].shards;
                assert!(shards.windows(2).all(|w| w[0] != w[1]), "{name}");
            }
        }
    }
}

/// `r`'s capture error, naming `what`.
fn assert_refused<T: std::fmt::Debug>(r: Result<T>, what: &str) {
    match r {
        Err(Error::Capture { what: message }) => {
            assert!(message.contains(what), "{message:?} names no {what:?}")
        }
        other => panic!("expected a capture error naming {what:?}, got {other:?}"),
    }
}

#[test]
fn what_a_captured_step_cannot_hold_is_refused_with_nothing_changed() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let config = EngineConfig::default();
    let mode = Mode::Async(0);
    let outcomes = on_engines(&plan, &config, mode, |e| {
        with_batch(e, |e, batch| -> Result<()> {
            batch.fill(e, 0)?;
            assert_refused(e.begin_capture(), "warm-up");
            step(e, batch)?;
            e.pre_forward(Unit::Root)?;
            assert!(matches!(e.begin_capture(), Err(Error::MidStep { .. })));
            e.post_forward(Unit::Root)?;
            for unit in [Unit::Layer(0), Unit::Layer(1)] {
                e.pre_forward(unit)?;
                e.post_forward(unit)?;
            }
            // A forward with no backward: the step ends as usual.
            e.end_step()?;
            e.begin_capture()?;
            assert_refused(e.begin_capture(), "inside another");
            assert_refused(e.param_shard(0), "during a capture");
            assert_refused(e.save(std::path::Path::new("unused")), "during a capture");
            e.pre_forward(Unit::Root)?;
            assert!(matches!(e.end_capture(), Err(Error::MidStep { .. })));
            e.post_forward(Unit::Root)?;
            for unit in [Unit::Layer(0), Unit::Layer(1)] {
                e.pre_forward(unit)?;
                e.post_forward(unit)?;
            }
            for unit in [Unit::Layer(1), Unit::Layer(0), Unit::Root] {
                e.pre_backward(unit)?;
                e.post_backward(unit)?;
            }
            e.finish_grad_sync()?;
            assert_refused(e.grad_norm(), "the gradient norm");
            assert_refused(e.nonfinite_grads(), "non-finite");
            e.optimizer_step()?;
            e.end_step()?;
            let before = e.counters();
            let captured = e.end_capture()?;
            // Nothing ran: the counts are the capture's beginning's.
            assert_eq!(e.counters().steps, before.steps - 1);
            assert_refused(e.end_capture(), "no capture under way");
            e.replay(&captured)?;
            e.replay(&captured)?;
            assert_eq!(e.counters().steps, before.steps + 1);
            Ok(())
        })
    });
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        outcome.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
    // Refused before anything is queued: per-step gradient shards, the ranks' comparison of
    // their collectives, the eager backend; and a step another engine captured.
    let refusals = [
        (
            EngineConfig {
                grad_shard_memory: GradShardMemory::PerStep,
                ..config.clone()
            },
            Mode::Async(0),
            "per-step gradient shards",
        ),
        (
            EngineConfig {
                verify_collectives: true,
                ..config.clone()
            },
            Mode::Async(0),
            "verify_collectives",
        ),
        (config.clone(), Mode::Eager, ""),
    ];
    for (config, mode, what) in refusals {
        let outcomes = on_engines(&plan, &config, mode, move |e| {
            with_batch(e, |e, batch| -> Result<()> {
                batch.fill(e, 0)?;
                step(e, batch)?;
                match mode {
                    Mode::Eager => assert!(matches!(
                        e.begin_capture(),
                        Err(Error::Unsupported { backend: "cpu", .. })
                    )),
                    Mode::Async(_) => assert_refused(e.begin_capture(), what),
                }
                assert!(!e.capturing());
                step(e, batch)
            })
        });
        for outcome in outcomes {
            outcome.unwrap();
        }
    }
    let plan_of_one = Arc::new(Plan::new(&model(), 1).unwrap());
    // Captured, never replayed: the batch may go with the engine.
    let captured = on_engines(&plan_of_one, &config, mode, |e| {
        with_batch(e, |e, batch| {
            batch.fill(e, 0).unwrap();
            step(e, batch).unwrap();
            e.begin_capture().unwrap();
            step(e, batch).unwrap();
            e.end_capture().unwrap()
        })
    });
    let other = on_engines(&plan_of_one, &config, mode, move |mut e| {
        e.replay(&captured[0])
    });
    assert_refused(other.into_iter().next().unwrap(), "another engine");
}
