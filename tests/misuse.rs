//! Every bad input and every misuse of the hooks gives a specific error and changes nothing: after
//! it, a correct step gives exactly what it gives on an engine that never saw the mistake. Each
//! case runs at world sizes 1, 2 and 4, on the eager CPU backend and on asynchronous ones.

use std::sync::Arc;

use fsdp_fusion::backend::Region;
use fsdp_fusion::backend::cpu::{CpuBackend, CpuBuffer};
use fsdp_fusion::comm::Tag;
use fsdp_fusion::types::Stream;
use fsdp_fusion::watch::Watch;
use fsdp_fusion::{
    Accumulation, Communicator, DType, Engine, EngineConfig, Error, GradShardMemory, Input,
    LocalComm, ModelSpec, OptimizerConfig, ParamId, ParamSpec, Plan, Unit,
};
use fsdp_fusion_support::ranks::{CpuEngine, Mode, for_each_mode, on_engines};

const WORLD_SIZES: [usize; 3] = [1, 2, 4];

/// embed (tied, root), w (unit 0), b (unit 0, bf16), g (unit 0, frozen), head (root).
fn model() -> ModelSpec {
    ModelSpec::new(vec![
        ParamSpec::new("embed", &[4, 3], DType::F32).tied(),
        ParamSpec::new("w", &[3, 3], DType::F32).in_unit(0),
        ParamSpec::new("b", &[3], DType::Bf16).in_unit(0),
        ParamSpec::new("g", &[3], DType::F32).in_unit(0).frozen(),
        ParamSpec::new("head", &[4], DType::F32),
    ])
    .unwrap()
}

fn plan(world: usize) -> Arc<Plan> {
    Arc::new(Plan::new(&model(), world).unwrap())
}

/// The value of element `j` of parameter `i` as loaded.
fn initial(i: usize, j: usize) -> f32 {
    (i * 10 + j) as f32 * 0.1
}

/// Loads every parameter's initial value.
fn load(e: &mut CpuEngine) {
    for (i, p) in model().params.iter().enumerate() {
        let values: Vec<f32> = (0..p.numel().unwrap()).map(|j| initial(i, j)).collect();
        if p.dtype == DType::Bf16 {
            let v: Vec<half::bf16> = values.iter().map(|&x| half::bf16::from_f32(x)).collect();
            e.load_param(ParamId(i), Input::host(&v)).unwrap();
        } else {
            e.load_param(ParamId(i), Input::host(&values)).unwrap();
        }
    }
}

/// Runs `f` on a loaded engine of every rank of a `world`-rank group in `mode`.
fn on_loaded<R: Send + 'static>(
    world: usize,
    mode: Mode,
    f: impl Fn(&mut CpuEngine) -> R + Send + Sync + 'static,
) -> Vec<R> {
    on_loaded_with(&EngineConfig::default(), world, mode, f)
}

/// As [`on_loaded`], the engines made with `config`.
fn on_loaded_with<R: Send + 'static>(
    config: &EngineConfig,
    world: usize,
    mode: Mode,
    f: impl Fn(&mut CpuEngine) -> R + Send + Sync + 'static,
) -> Vec<R> {
    on_engines(&plan(world), config, mode, move |mut e| {
        load(&mut e);
        f(&mut e)
    })
}

fn id(e: &CpuEngine, name: &str) -> ParamId {
    e.plan().param_id(name).unwrap()
}

fn grad(e: &mut CpuEngine, name: &str) -> fsdp_fusion::Result<()> {
    let p = id(e, name);
    let numel = e.plan().param(p).unwrap().numel();
    e.grad(p, Input::host(&grad_values(numel)))
}

/// A whole correct step; returns every shard afterwards.
fn step(e: &mut CpuEngine) -> Vec<Vec<u8>> {
    forward_and_layer_backward(e);
    root_grads_and_end(e)
}

/// The forward, and the backward of unit 0 (its groups then updated where the optimizer steps
/// in the backward).
fn forward_and_layer_backward(e: &mut CpuEngine) {
    e.pre_forward(Unit::Root).unwrap();
    e.post_forward(Unit::Root).unwrap();
    e.pre_forward(Unit::Layer(0)).unwrap();
    e.post_forward(Unit::Layer(0)).unwrap();
    e.pre_backward(Unit::Layer(0)).unwrap();
    for name in ["w", "b"] {
        grad(e, name).unwrap();
    }
    e.post_backward(Unit::Layer(0)).unwrap();
}

/// The root's gradients, then the end of the step; returns every shard afterwards.
fn root_grads_and_end(e: &mut CpuEngine) -> Vec<Vec<u8>> {
    for name in ["head", "embed"] {
        grad(e, name).unwrap();
    }
    end_step(e)
}

/// Syncs gradients, steps the optimizer, ends the step; returns every shard afterwards.
fn end_step(e: &mut CpuEngine) -> Vec<Vec<u8>> {
    e.finish_grad_sync().unwrap();
    e.optimizer_step().unwrap();
    e.end_step().unwrap();
    shards(e)
}

fn shards(e: &CpuEngine) -> Vec<Vec<u8>> {
    (0..e.plan().groups().len())
        .map(|g| e.param_shard(g).unwrap())
        .collect()
}

/// At every world size and in every mode: runs `mistake` on every rank after `setup`, checks its
/// error with `expected` and that it changed no counter, then checks that `finish` gives the same
/// shards as on engines that never made the mistake.
fn assert_harmless(
    setup: impl Fn(&mut CpuEngine) + Copy + Send + Sync + 'static,
    mistake: impl Fn(&mut CpuEngine) -> fsdp_fusion::Result<()> + Copy + Send + Sync + 'static,
    expected: impl Fn(&Error) -> bool + Copy + Send + Sync + 'static,
    finish: impl Fn(&mut CpuEngine) -> Vec<Vec<u8>> + Copy + Send + Sync + 'static,
) {
    assert_harmless_with(&EngineConfig::default(), setup, mistake, expected, finish);
}

/// As [`assert_harmless`], the engines made with `config`.
fn assert_harmless_with(
    config: &EngineConfig,
    setup: impl Fn(&mut CpuEngine) + Copy + Send + Sync + 'static,
    mistake: impl Fn(&mut CpuEngine) -> fsdp_fusion::Result<()> + Copy + Send + Sync + 'static,
    expected: impl Fn(&Error) -> bool + Copy + Send + Sync + 'static,
    finish: impl Fn(&mut CpuEngine) -> Vec<Vec<u8>> + Copy + Send + Sync + 'static,
) {
    for world in WORLD_SIZES {
        for_each_mode(|mode| {
            let want = on_loaded_with(config, world, mode, move |e| {
                setup(e);
                finish(e)
            });
            let got = on_loaded_with(config, world, mode, move |e| {
                setup(e);
                let counters = e.counters();
                let err = mistake(e).unwrap_err();
                assert!(expected(&err), "world {world}: unexpected error: {err:?}");
                assert!(!err.to_string().is_empty());
                assert_eq!(
                    e.counters(),
                    counters,
                    "world {world}: the failed call changed the counters"
                );
                finish(e)
            });
            assert_eq!(
                got, want,
                "world {world}: the failed call changed the outcome"
            );
        });
    }
}

fn nothing(_: &mut CpuEngine) {}

fn in_backward() -> EngineConfig {
    EngineConfig {
        step_in_backward: true,
        ..EngineConfig::default()
    }
}

fn stepping_in_backward(error: &Error) -> bool {
    matches!(error, Error::StepInBackward { .. })
}

/// A whole step's hooks and gradients, and their sync.
fn synced(e: &mut CpuEngine) {
    forward_and_layer_backward(e);
    for name in ["head", "embed"] {
        grad(e, name).unwrap();
    }
    e.finish_grad_sync().unwrap();
}

/// The optimizer's step and the end of a step left synced; returns every shard.
fn stepped_and_ended(e: &mut CpuEngine) -> Vec<Vec<u8>> {
    e.optimizer_step().unwrap();
    e.end_step().unwrap();
    shards(e)
}

#[test]
fn stepping_in_the_backward_refuses_what_needs_the_whole_gradient() {
    let config = in_backward();
    let norm = |e: &mut CpuEngine| e.grad_norm().map(|_| ());
    let clip = |e: &mut CpuEngine| e.clip_grad_norm(1.0).map(|_| ());
    let count = |e: &mut CpuEngine| e.nonfinite_grads().map(|_| ());
    assert_harmless_with(
        &config,
        synced,
        norm,
        stepping_in_backward,
        stepped_and_ended,
    );
    assert_harmless_with(
        &config,
        synced,
        clip,
        stepping_in_backward,
        stepped_and_ended,
    );
    assert_harmless_with(
        &config,
        synced,
        count,
        stepping_in_backward,
        stepped_and_ended,
    );
    // A backward after the sync would reduce into gradient shards its updates were done with.
    let backward_again = |e: &mut CpuEngine| e.pre_backward(Unit::Layer(0));
    assert_harmless_with(
        &config,
        synced,
        backward_again,
        stepping_in_backward,
        stepped_and_ended,
    );
}

#[test]
fn stepping_in_the_backward_refuses_a_second_pass_and_new_settings_once_gradients_began() {
    let config = in_backward();
    let second_forward = |e: &mut CpuEngine| e.pre_forward(Unit::Root);
    let lr = |e: &mut CpuEngine| e.set_lr(0.5);
    let decay = |e: &mut CpuEngine| e.set_weight_decay(0.5);
    for mistake in [second_forward, lr, decay] {
        assert_harmless_with(
            &config,
            forward_and_layer_backward,
            mistake,
            stepping_in_backward,
            root_grads_and_end,
        );
    }
    // Between steps the settings change as ever.
    for world in WORLD_SIZES {
        for_each_mode(|mode| {
            on_loaded_with(&in_backward(), world, mode, |e| {
                e.set_lr(0.5).unwrap();
                e.set_weight_decay(0.5).unwrap();
            });
        });
    }
}

/// unit 0 holds x; unit 1 holds w1 and w2 in one group.
fn two_units() -> ModelSpec {
    ModelSpec::new(vec![
        ParamSpec::new("x", &[4], DType::F32).in_unit(0),
        ParamSpec::new("w1", &[4], DType::F32).in_unit(1),
        ParamSpec::new("w2", &[4], DType::F32).in_unit(1),
    ])
    .unwrap()
}

#[test]
fn stepping_in_the_backward_takes_a_batch_unit_after_unit_the_open_one_first() {
    // w1 alone, then w2 beside unit 0's x in one batch, in either order: unit 1 is taking
    // gradients when the batch comes, so its w2 is taken first and joins w1, then x ends unit 1;
    // the step equals the ordinary one. Ended without `optimizer_step`, a step whose groups
    // were updated in its backward is not skipped.
    for world in WORLD_SIZES {
        let plan = Arc::new(Plan::new(&two_units(), world).unwrap());
        for x_first in [false, true] {
            for_each_mode(|mode| {
                let run = |config: EngineConfig| {
                    on_engines(&plan, &config, mode, move |mut e| {
                        let id = |name| e.plan().param_id(name).unwrap();
                        let (x, w1, w2) = (id("x"), id("w1"), id("w2"));
                        let (a, b) = (grad_values(4), [0.25f32; 4]);
                        e.grads(&[(w1, Input::host(&a))]).unwrap();
                        // A shard read while gradients arrive would show unwritten elements.
                        let group = e.plan().param(w1).unwrap().group();
                        assert!(matches!(
                            e.grad_shard(group),
                            Err(Error::GradsNotSynced { .. })
                        ));
                        let mut batch = [(w2, Input::host(&b)), (x, Input::host(&a))];
                        if x_first {
                            batch.reverse();
                        }
                        e.grads(&batch).unwrap();
                        e.finish_grad_sync().unwrap();
                        if e.config().step_in_backward {
                            e.end_step().unwrap();
                            assert_eq!(e.counters().skipped_steps, 0);
                        } else {
                            e.optimizer_step().unwrap();
                            e.end_step().unwrap();
                        }
                        shards(&e)
                    })
                };
                assert_eq!(
                    run(in_backward()),
                    run(EngineConfig::default()),
                    "world {world}, x first {x_first}"
                );
            });
        }
    }
}

#[test]
fn stepping_in_the_backward_holds_one_unit_s_gradient_shards_for_a_batch_of_several() {
    // Units 0 and 1, a group of two parameters each; at world size 1 a batch of a1 and b1 ends
    // unit 0 (a2 counts as zero) when unit 1's gradient is taken, as two calls would: its shard
    // goes before unit 1's is held, so the step stays within the plan's peak (below the
    // ordinary step's). Above it no gradient ends a unit (the ranks' reductions may not depend
    // on which gradients each got), the pass's end reduces both, and the shards held are those
    // of the reductions in flight. Either way the step trains as the ordinary one with a2 zero.
    let model = ModelSpec::new(vec![
        ParamSpec::new("a1", &[64], DType::F32).in_unit(0),
        ParamSpec::new("a2", &[64], DType::F32).in_unit(0),
        ParamSpec::new("b1", &[64], DType::F32).in_unit(1),
        ParamSpec::new("b2", &[64], DType::F32).in_unit(1),
    ])
    .unwrap();
    let per_step = |step_in_backward| EngineConfig {
        step_in_backward,
        grad_shard_memory: GradShardMemory::PerStep,
        ..EngineConfig::default()
    };
    for world in WORLD_SIZES {
        let plan = Arc::new(Plan::new(&model, world).unwrap());
        for_each_mode(|mode| {
            let run = |config: EngineConfig| {
                on_engines(&plan, &config, mode, move |mut e| {
                    let id = |name| e.plan().param_id(name).unwrap();
                    let (a1, a2, b1, b2) = (id("a1"), id("a2"), id("b1"), id("b2"));
                    let g = grad_values(64);
                    e.grads(&[(a1, Input::host(&g)), (b1, Input::host(&g))])
                        .unwrap();
                    // Above world size 1 only a unit's hooks end it.
                    if e.config().step_in_backward && world == 1 {
                        assert!(matches!(
                            e.grad(a2, Input::host(&g)),
                            Err(Error::StepInBackward { .. })
                        ));
                    }
                    e.grad(b2, Input::host(&g)).unwrap();
                    e.finish_grad_sync().unwrap();
                    if !e.config().step_in_backward {
                        e.optimizer_step().unwrap();
                    }
                    e.end_step().unwrap();
                    let extra = e.counters().extra_slots as usize * e.plan().gather_slot_bytes();
                    (shards(&e), e.memory().peak - extra, e.policy().memory.peak)
                })
            };
            let (in_backward, after) = (run(per_step(true)), run(per_step(false)));
            for ((shards, peak, planned), (after_shards, after_peak, after_planned)) in
                in_backward.iter().zip(&after)
            {
                assert_eq!(shards, after_shards, "world {world}");
                assert!(peak <= planned, "world {world}: {peak} > {planned}");
                // Above world size 1 both reductions may be in flight at once, each shard held.
                assert!(world > 1 || planned < after_planned, "world {world}");
                if planned < after_planned {
                    assert!(peak < after_peak, "world {world}: {peak} >= {after_peak}");
                }
            }
        });
    }
}

#[test]
fn stepping_in_the_backward_refuses_a_gradient_of_a_group_its_units_backward_ended() {
    // Unit 0's two parameters share a group: the unit's backward ending with one of them
    // counts the other as zero and updates the group.
    let model = ModelSpec::new(vec![
        ParamSpec::new("w1", &[4], DType::F32).in_unit(0),
        ParamSpec::new("w2", &[4], DType::F32).in_unit(0),
    ])
    .unwrap();
    for world in WORLD_SIZES {
        let plan = Arc::new(Plan::new(&model, world).unwrap());
        for_each_mode(|mode| {
            on_engines(&plan, &in_backward(), mode, move |mut e| {
                let w1 = e.plan().param_id("w1").unwrap();
                let w2 = e.plan().param_id("w2").unwrap();
                let g = grad_values(4);
                e.pre_forward(Unit::Layer(0)).unwrap();
                e.post_forward(Unit::Layer(0)).unwrap();
                e.pre_backward(Unit::Layer(0)).unwrap();
                e.grad(w1, Input::host(&g)).unwrap();
                e.post_backward(Unit::Layer(0)).unwrap();
                let late = e.grad(w2, Input::host(&g)).unwrap_err();
                assert!(stepping_in_backward(&late), "world {world}: {late:?}");
                e.finish_grad_sync().unwrap();
                e.optimizer_step().unwrap();
                e.end_step().unwrap();
            });
        });
    }
}

#[test]
fn hook_for_an_unknown_unit() {
    assert_harmless(
        nothing,
        |e| e.pre_forward(Unit::Layer(7)),
        |err| {
            matches!(
                err,
                Error::UnknownUnit {
                    unit: Unit::Layer(7)
                }
            )
        },
        step,
    );
}

#[test]
fn forward_ended_twice() {
    let finish = |e: &mut CpuEngine| {
        // Root's forward already ran in setup.
        e.pre_forward(Unit::Layer(0)).unwrap();
        e.post_forward(Unit::Layer(0)).unwrap();
        e.pre_backward(Unit::Layer(0)).unwrap();
        grad(e, "w").unwrap();
        grad(e, "b").unwrap();
        grad(e, "head").unwrap();
        grad(e, "embed").unwrap();
        end_step(e)
    };
    assert_harmless(
        |e| {
            e.pre_forward(Unit::Root).unwrap();
            e.post_forward(Unit::Root).unwrap();
        },
        |e| e.post_forward(Unit::Root),
        |err| matches!(err, Error::ForwardNotOpen { unit: Unit::Root }),
        finish,
    );
}

#[test]
fn forward_started_twice() {
    let finish = |e: &mut CpuEngine| {
        e.post_forward(Unit::Root).unwrap();
        step(e)
    };
    assert_harmless(
        |e| e.pre_forward(Unit::Root).unwrap(),
        |e| e.pre_forward(Unit::Root),
        |err| matches!(err, Error::ForwardAlreadyOpen { unit: Unit::Root }),
        finish,
    );
}

#[test]
fn backward_ended_without_starting() {
    assert_harmless(
        nothing,
        |e| e.post_backward(Unit::Layer(0)),
        |err| {
            matches!(
                err,
                Error::BackwardNotOpen {
                    unit: Unit::Layer(0)
                }
            )
        },
        step,
    );
}

#[test]
fn gradient_for_a_frozen_param() {
    assert_harmless(
        nothing,
        |e| grad(e, "g"),
        |err| matches!(err, Error::FrozenGradient { name } if name == "g"),
        step,
    );
}

#[test]
fn gradient_for_an_unknown_param() {
    assert_harmless(
        nothing,
        |e| e.grad(ParamId(99), Input::host(&[1.0f32])),
        |err| matches!(err, Error::ParamIdOutOfRange { id: 99, count: 5 }),
        step,
    );
    assert!(
        matches!(plan(1).param_id("nope"), Err(Error::UnknownParam { name }) if name == "nope")
    );
}

#[test]
fn gradient_of_the_wrong_length() {
    assert_harmless(
        nothing,
        |e| e.grad(id(e, "w"), Input::host(&[1.0f32; 8])),
        |err| matches!(err, Error::GradientLength { name, expected: 9, got: 8 } if name == "w"),
        step,
    );
}

#[test]
fn gradient_of_the_wrong_dtype() {
    // "b" is bf16: f16 is neither its dtype nor f32.
    let g = [half::f16::from_f32(1.0); 3];
    assert_harmless(
        nothing,
        move |e| e.grad(id(e, "b"), Input::host(&g)),
        |err| matches!(err, Error::GradientDtype { name, param: DType::Bf16, got: DType::F16 } if name == "b"),
        step,
    );
}

#[test]
fn second_gradient_in_one_pass() {
    let finish = |e: &mut CpuEngine| {
        grad(e, "b").unwrap();
        grad(e, "head").unwrap();
        grad(e, "embed").unwrap();
        end_step(e)
    };
    assert_harmless(
        |e| grad(e, "w").unwrap(),
        |e| grad(e, "w"),
        |err| matches!(err, Error::DuplicateGradient { name } if name == "w"),
        finish,
    );
}

#[test]
fn end_of_step_before_gradients_are_synced() {
    let finish = |e: &mut CpuEngine| end_step(e);
    assert_harmless(
        |e| grad(e, "w").unwrap(),
        |e| e.end_step(),
        |err| matches!(err, Error::GradsNotSynced { .. }),
        finish,
    );
}

#[test]
fn optimizer_before_sync_and_twice_in_a_step() {
    let finish = |e: &mut CpuEngine| end_step(e);
    assert_harmless(
        |e| grad(e, "w").unwrap(),
        |e| e.optimizer_step(),
        |err| matches!(err, Error::GradsNotSynced { .. }),
        finish,
    );
    assert_harmless(
        stepped,
        |e| e.optimizer_step(),
        |err| matches!(err, Error::OptimizerAlreadyStepped),
        end_stepped,
    );
}

/// A step's gradients synced, and its clipping and skip decided on the device over them.
fn decided(e: &mut CpuEngine) {
    synced(e);
    e.clip_grad_norm_on_device(0.5).unwrap();
    e.skip_nonfinite_on_device().unwrap();
}

/// Once the step's clipping or skip was decided over its gradients, more of them (a further
/// backward pass, which that decision would not see) are refused with nothing changed.
#[test]
fn gradients_after_the_step_s_clipping_or_skip_was_decided_are_refused() {
    let refused = |err: &Error| matches!(err, Error::GradientsDecided { .. });
    assert_harmless(
        decided,
        |e| e.pre_backward(Unit::Layer(0)),
        refused,
        stepped_and_ended,
    );
    assert_harmless(decided, |e| grad(e, "head"), refused, stepped_and_ended);
    let on_host = |e: &mut CpuEngine| {
        forward_and_layer_backward(e);
        e.finish_grad_sync().unwrap();
        e.clip_grad_norm(0.5).unwrap();
    };
    assert_harmless(on_host, |e| grad(e, "embed"), refused, stepped_and_ended);
}

/// A step's hooks and gradients, its sync and its optimizer step: all but the end of the step.
fn stepped(e: &mut CpuEngine) {
    step(e);
    grad(e, "w").unwrap();
    e.finish_grad_sync().unwrap();
    e.optimizer_step().unwrap();
}

/// Ends a step left by [`stepped`], then runs a whole step; returns every shard.
fn end_stepped(e: &mut CpuEngine) -> Vec<Vec<u8>> {
    e.end_step().unwrap();
    step(e)
}

#[test]
fn after_the_optimizer_step_only_the_end_of_the_step_is_allowed() {
    let refused = |err: &Error| matches!(err, Error::OptimizerStepped { .. });
    assert_harmless(
        stepped,
        |e| e.pre_forward(Unit::Layer(0)),
        refused,
        end_stepped,
    );
    assert_harmless(
        stepped,
        |e| e.post_forward(Unit::Root),
        refused,
        end_stepped,
    );
    assert_harmless(
        stepped,
        |e| e.pre_backward(Unit::Layer(0)),
        refused,
        end_stepped,
    );
    assert_harmless(
        stepped,
        |e| e.post_backward(Unit::Root),
        refused,
        end_stepped,
    );
    assert_harmless(stepped, |e| grad(e, "b"), refused, end_stepped);
    assert_harmless(
        stepped,
        |e| e.grad_slot(id(e, "w")).map(drop),
        refused,
        end_stepped,
    );
    assert_harmless(stepped, |e| e.commit_grad(id(e, "w")), refused, end_stepped);
    assert_harmless(
        stepped,
        |e| e.load_param(id(e, "head"), Input::host(&[9f32; 4])),
        refused,
        end_stepped,
    );
    assert_harmless(stepped, |e| e.finish_grad_sync(), refused, end_stepped);
}

/// The step's sync, then a unit's forward or backward opened: the optimizer step would write
/// shards the unit reads, and no call could then close the unit.
#[test]
fn the_optimizer_step_is_refused_while_a_unit_is_open() {
    let synced = |e: &mut CpuEngine| {
        step(e);
        grad(e, "w").unwrap();
        e.finish_grad_sync().unwrap();
    };
    let forward_open = move |e: &mut CpuEngine| {
        synced(e);
        e.pre_forward(Unit::Layer(0)).unwrap();
    };
    let backward_open = move |e: &mut CpuEngine| {
        synced(e);
        e.pre_backward(Unit::Layer(0)).unwrap();
    };
    let forward_closed = |e: &mut CpuEngine| {
        e.post_forward(Unit::Layer(0)).unwrap();
        end_step(e)
    };
    let backward_closed = |e: &mut CpuEngine| {
        e.post_backward(Unit::Layer(0)).unwrap();
        end_step(e)
    };
    let unit_0 = Unit::Layer(0);
    assert_harmless(
        forward_open,
        |e| e.optimizer_step(),
        move |err| matches!(err, Error::ForwardStillOpen { unit } if *unit == unit_0),
        forward_closed,
    );
    assert_harmless(
        backward_open,
        |e| e.optimizer_step(),
        move |err| matches!(err, Error::BackwardStillOpen { unit } if *unit == unit_0),
        backward_closed,
    );
}

/// A parameter loaded mid-step, even where its group is not gathered (the step's sync ended
/// every unit), is refused: the step's update would apply gradients of the old values to it.
#[test]
fn a_parameter_is_loaded_between_steps_only() {
    let finish = |e: &mut CpuEngine| {
        stepped_and_ended(e);
        step(e)
    };
    assert_harmless(
        synced,
        |e| e.load_param(id(e, "w"), Input::host(&[0f32; 9])),
        |err| matches!(err, Error::MidStep { .. }),
        finish,
    );
}

/// Host bytes that are not a whole number of the gradient's elements are refused as the
/// caller's mistake, alone or in a batch, before anything changes.
#[test]
fn a_gradient_or_a_value_of_a_partial_element_is_refused() {
    let ragged = |e: &mut CpuEngine| {
        let bytes = vec![0u8; 9 * 4 + 1];
        e.grad(id(e, "w"), Input::host_bytes(&bytes, DType::F32))
    };
    let ragged_in_a_batch = |e: &mut CpuEngine| {
        let (head, bytes) = (vec![0.5f32; 4], vec![0u8; 9 * 4 + 1]);
        e.grads(&[
            (id(e, "head"), Input::host(&head)),
            (id(e, "w"), Input::host_bytes(&bytes, DType::F32)),
        ])
    };
    let ragged_value = |e: &mut CpuEngine| {
        let bytes = vec![0u8; 9 * 4 + 1];
        e.load_param(id(e, "w"), Input::host_bytes(&bytes, DType::F32))
    };
    let refused = |err: &Error| matches!(err, Error::PartialElement { name, bytes: 37, dtype: DType::F32 } if name == "w");
    assert_harmless(nothing, ragged, refused, step);
    assert_harmless(nothing, ragged_in_a_batch, refused, step);
    assert_harmless(nothing, ragged_value, refused, step);
}

#[test]
fn sync_or_end_with_a_forward_open() {
    let finish = |e: &mut CpuEngine| {
        e.post_forward(Unit::Layer(0)).unwrap();
        step(e)
    };
    assert_harmless(
        |e| e.pre_forward(Unit::Layer(0)).unwrap(),
        |e| e.finish_grad_sync(),
        |err| {
            matches!(
                err,
                Error::ForwardStillOpen {
                    unit: Unit::Layer(0)
                }
            )
        },
        finish,
    );
    assert_harmless(
        |e| e.pre_forward(Unit::Layer(0)).unwrap(),
        |e| e.end_step(),
        |err| {
            matches!(
                err,
                Error::ForwardStillOpen {
                    unit: Unit::Layer(0)
                }
            )
        },
        finish,
    );
}

#[test]
fn views_only_while_gathered_and_in_their_dtype() {
    let open = |e: &mut CpuEngine| e.pre_forward(Unit::Layer(0)).unwrap();
    let close_and_step = |e: &mut CpuEngine| {
        e.post_forward(Unit::Layer(0)).unwrap();
        step(e)
    };
    assert_harmless(
        nothing,
        |e| e.param::<f32>(id(e, "w")).map(drop),
        |err| matches!(err, Error::NotGathered { name } if name == "w"),
        step,
    );
    assert_harmless(
        open,
        |e| e.param::<half::bf16>(id(e, "w")).map(drop),
        |err| {
            matches!(
                err,
                Error::DtypeMismatch {
                    param: DType::F32,
                    requested: DType::Bf16,
                    ..
                }
            )
        },
        close_and_step,
    );
    assert_harmless(
        open,
        |e| e.load_param(id(e, "w"), Input::host(&[0f32; 9])),
        |err| matches!(err, Error::MidStep { .. }),
        close_and_step,
    );
    // READY still holds the values but is not in use: no view.
    assert_harmless(
        |e| {
            e.pre_forward(Unit::Layer(0))
                .and_then(|()| e.post_forward(Unit::Layer(0)))
                .unwrap()
        },
        |e| e.param::<f32>(id(e, "w")).map(drop),
        |err| matches!(err, Error::NotGathered { .. }),
        step,
    );
}

#[test]
fn a_view_holds_the_loaded_values_on_every_rank() {
    for world in WORLD_SIZES {
        for_each_mode(|mode| {
            let views = on_loaded(world, mode, |e| {
                e.pre_forward(Unit::Layer(0)).unwrap();
                let view = e.param::<f32>(id(e, "w")).unwrap().to_vec();
                e.post_forward(Unit::Layer(0)).unwrap();
                view
            });
            let loaded: Vec<f32> = (0..9).map(|j| initial(1, j)).collect();
            assert_eq!(views, vec![loaded; world], "world {world}");
        });
    }
}

#[test]
fn loads_of_the_wrong_length_or_dtype() {
    assert_harmless(
        nothing,
        |e| e.load_param(id(e, "w"), Input::host(&[0f32; 4])),
        |err| {
            matches!(
                err,
                Error::DataLength {
                    expected: 9,
                    got: 4,
                    ..
                }
            )
        },
        step,
    );
    assert_harmless(
        nothing,
        |e| e.load_param(id(e, "w"), Input::host(&[half::f16::ZERO; 9])),
        |err| {
            matches!(
                err,
                Error::DtypeMismatch {
                    requested: DType::F16,
                    ..
                }
            )
        },
        step,
    );
}

#[test]
fn bad_configurations_and_sizes() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let one = LocalComm::group(1).unwrap().pop().unwrap();
    assert!(matches!(
        Engine::new(
            Arc::clone(&plan),
            EngineConfig::default(),
            CpuBackend::new(),
            one
        ),
        Err(Error::WorldSizeMismatch { plan: 2, comm: 1 })
    ));
    let comm = LocalComm::group(2).unwrap().pop().unwrap();
    let config = EngineConfig {
        double_buffer_limit: 0,
        ..EngineConfig::default()
    };
    assert!(matches!(
        Engine::new(Arc::clone(&plan), config, CpuBackend::new(), comm),
        Err(Error::InvalidConfig {
            field: "double_buffer_limit",
            ..
        })
    ));
    for accumulation in [Accumulation::NoSync, Accumulation::KeepGathered] {
        let comm = LocalComm::group(2).unwrap().pop().unwrap();
        let config = EngineConfig {
            accumulation,
            ..in_backward()
        };
        assert!(matches!(
            Engine::new(Arc::clone(&plan), config, CpuBackend::new(), comm),
            Err(Error::InvalidConfig {
                field: "step_in_backward",
                ..
            })
        ));
    }
    let comm = LocalComm::group(2).unwrap().pop().unwrap();
    let config = EngineConfig {
        optimizer: OptimizerConfig::sgd(-1.0),
        ..EngineConfig::default()
    };
    assert!(matches!(
        Engine::new(plan, config, CpuBackend::new(), comm),
        Err(Error::InvalidConfig { field: "lr", .. })
    ));
    assert!(matches!(Plan::new(&model(), 0), Err(Error::ZeroWorldSize)));
    assert!(matches!(LocalComm::group(0), Err(Error::ZeroWorldSize)));
}

/// A communicator that claims a rank outside its group.
struct BadRank;

impl Communicator<CpuBackend> for BadRank {
    fn rank(&self) -> usize {
        2
    }
    fn world_size(&self) -> usize {
        2
    }
    fn set_watch(&mut self, _: &Watch) {}
    unsafe fn all_gather(
        &mut self,
        _: &CpuBackend,
        _: Stream,
        _: Tag,
        _: &CpuBuffer,
        _: Region,
        _: &mut CpuBuffer,
        _: Region,
    ) -> fsdp_fusion::Result<()> {
        Ok(())
    }
    unsafe fn all_gather_in_place(
        &mut self,
        _: &CpuBackend,
        _: Stream,
        _: Tag,
        _: &mut CpuBuffer,
        _: Region,
    ) -> fsdp_fusion::Result<()> {
        Ok(())
    }
    unsafe fn reduce_scatter(
        &mut self,
        _: &CpuBackend,
        _: Stream,
        _: Tag,
        _: &mut CpuBuffer,
        _: Region,
        _: f32,
    ) -> fsdp_fusion::Result<()> {
        Ok(())
    }
    unsafe fn all_reduce(
        &mut self,
        _: &CpuBackend,
        _: Stream,
        _: Tag,
        _: &mut CpuBuffer,
        _: Region,
        _: f32,
    ) -> fsdp_fusion::Result<()> {
        Ok(())
    }
}

#[test]
fn rank_at_or_past_the_world_size() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    assert!(matches!(
        Engine::new(plan, EngineConfig::default(), CpuBackend::new(), BadRank),
        Err(Error::RankOutOfRange {
            rank: 2,
            world_size: 2
        })
    ));
}

#[test]
fn bad_model_files() {
    let err = ModelSpec::from_json(r#"{"params": [{"name": "a", "shape": [2], "dtype": "int8"}]}"#)
        .unwrap_err();
    assert!(matches!(&err, Error::UnknownDtype { name, given } if name == "a" && given == "int8"));
    let err = ModelSpec::from_json("{\n \"params\": [\n  {\"name\": \"a\" \"shape\": [2]}\n ]\n}")
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::Json {
                line: 3,
                column: 16,
                ..
            }
        ),
        "{err:?}"
    );
    let err = ModelSpec::from_json(
        r#"{"params": [{"name": "a", "shape": [2], "dtype": "f32"}, {"name": "a", "shape": [1], "dtype": "f32"}]}"#,
    )
    .unwrap_err();
    assert!(matches!(
        err,
        Error::DuplicateName {
            first: 0,
            second: 1,
            ..
        }
    ));
    let err = ModelSpec::from_json(r#"{"params": [{"name": "", "shape": [2], "dtype": "f32"}]}"#)
        .unwrap_err();
    assert!(matches!(err, Error::EmptyName { index: 0 }));
    let err = ModelSpec::from_json(
        r#"{"params": [{"name": "big", "shape": [4294967296, 4294967296, 4], "dtype": "f32"}]}"#,
    )
    .unwrap_err();
    assert!(matches!(err, Error::NumelOverflow { name, .. } if name == "big"));
    let err = ModelSpec::from_json(r#"{"params": [{"name": "n", "shape": [-1], "dtype": "f32"}]}"#)
        .unwrap_err();
    assert!(matches!(err, Error::Json { line: 1, .. }));
}

#[test]
fn another_gradient_while_a_slot_is_open() {
    let open = |e: &mut CpuEngine| {
        let w = id(e, "w");
        e.grad_slot(w).unwrap().fill(0.0);
    };
    // The test step gives "w" a gradient again: commit this pass's zero gradient first.
    let finish_after_commit = |e: &mut CpuEngine| {
        let w = id(e, "w");
        e.commit_grad(w).unwrap();
        e.finish_grad_sync().unwrap();
        e.end_step().unwrap();
        step(e)
    };
    assert_harmless(
        open,
        |e| grad(e, "b"),
        |err| matches!(err, Error::GradSlotOpen { name } if name == "w"),
        finish_after_commit,
    );
    assert_harmless(
        open,
        |e| e.finish_grad_sync(),
        |err| matches!(err, Error::GradSlotOpen { name } if name == "w"),
        finish_after_commit,
    );
    assert_harmless(
        nothing,
        |e| e.commit_grad(id(e, "w")),
        |err| matches!(err, Error::GradSlotNotOpen { name } if name == "w"),
        step,
    );
    // The end of the unit's backward would end its groups under the open slot (and, where the
    // optimizer steps in the backward, update them without the slot's gradient).
    let open_in_backward = |e: &mut CpuEngine| {
        e.pre_forward(Unit::Root).unwrap();
        e.post_forward(Unit::Root).unwrap();
        e.pre_forward(Unit::Layer(0)).unwrap();
        e.post_forward(Unit::Layer(0)).unwrap();
        e.pre_backward(Unit::Layer(0)).unwrap();
        let w = id(e, "w");
        e.grad_slot(w).unwrap().fill(0.0);
    };
    let commit_then_finish = |e: &mut CpuEngine| {
        let w = id(e, "w");
        e.commit_grad(w).unwrap();
        grad(e, "b").unwrap();
        e.post_backward(Unit::Layer(0)).unwrap();
        root_grads_and_end(e)
    };
    for config in [EngineConfig::default(), in_backward()] {
        assert_harmless_with(
            &config,
            open_in_backward,
            |e| e.post_backward(Unit::Layer(0)),
            |err| matches!(err, Error::GradSlotOpen { name } if name == "w"),
            commit_then_finish,
        );
    }
}

/// The gradient `grad` hands over, of `n` elements.
fn grad_values(n: usize) -> Vec<f32> {
    (0..n).map(|j| 0.5 - j as f32 * 0.25).collect()
}

#[test]
fn a_gradient_batch_with_one_bad_entry_takes_none_of_it() {
    assert_harmless(
        nothing,
        |e| {
            let g = grad_values(9);
            e.grads(&[
                (id(e, "w"), Input::host(&g)),
                (id(e, "head"), Input::host(&g[..3])),
            ])
        },
        |err| matches!(err, Error::GradientLength { name, expected: 4, got: 3 } if name == "head"),
        step,
    );
    assert_harmless(
        nothing,
        |e| {
            let g = grad_values(9);
            e.grads(&[(id(e, "w"), Input::host(&g)), (id(e, "w"), Input::host(&g))])
        },
        |err| matches!(err, Error::DuplicateGradient { name } if name == "w"),
        step,
    );
}

#[test]
fn a_gradient_batch_gives_what_its_gradients_give_one_by_one() {
    for_each_mode(|mode| {
        let one_by_one = on_loaded(2, mode, step);
        let batched = on_loaded(2, mode, |e| {
            e.pre_forward(Unit::Root).unwrap();
            e.post_forward(Unit::Root).unwrap();
            e.pre_forward(Unit::Layer(0)).unwrap();
            e.post_forward(Unit::Layer(0)).unwrap();
            e.pre_backward(Unit::Layer(0)).unwrap();
            let (w, b) = (grad_values(9), grad_values(3));
            e.grads(&[(id(e, "b"), Input::host(&b)), (id(e, "w"), Input::host(&w))])
                .unwrap();
            e.post_backward(Unit::Layer(0)).unwrap();
            let (head, embed) = (grad_values(4), grad_values(12));
            e.grads(&[
                (id(e, "head"), Input::host(&head)),
                (id(e, "embed"), Input::host(&embed)),
            ])
            .unwrap();
            end_step(e)
        });
        assert_eq!(batched, one_by_one);
    });
}

#[test]
fn norms_before_the_sync_and_bad_clips_or_rates_are_refused() {
    assert_harmless(
        nothing,
        |e| e.clip_grad_norm(1.0).map(drop),
        |err| matches!(err, Error::GradsNotSynced { .. }),
        step,
    );
    let synced = |e: &mut CpuEngine| {
        for name in ["w", "b", "head", "embed"] {
            grad(e, name).unwrap();
        }
        e.finish_grad_sync().unwrap();
    };
    for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        assert_harmless(
            synced,
            move |e| e.clip_grad_norm(bad).map(drop),
            |err| {
                matches!(
                    err,
                    Error::InvalidConfig {
                        field: "max_norm",
                        ..
                    }
                )
            },
            end_step,
        );
    }
    assert_harmless(
        nothing,
        |e| e.set_lr(f32::NAN),
        |err| matches!(err, Error::InvalidConfig { field: "lr", .. }),
        step,
    );
    assert_harmless(
        nothing,
        |e| e.set_weight_decay(-0.5),
        |err| {
            matches!(
                err,
                Error::InvalidConfig {
                    field: "weight_decay",
                    ..
                }
            )
        },
        step,
    );
}

#[test]
fn a_step_ended_without_the_optimizer_is_skipped_and_counted() {
    for world in WORLD_SIZES {
        for_each_mode(|mode| {
            let out = on_loaded(world, mode, |e| {
                let before = shards(e);
                for name in ["w", "b", "head", "embed"] {
                    grad(e, name).unwrap();
                }
                e.finish_grad_sync().unwrap();
                let norm = e.grad_norm().unwrap();
                e.end_step().unwrap();
                let skipped = (shards(e), e.counters().skipped_steps);
                // The next step overwrites the skipped step's gradients.
                let after = step(e);
                (before, skipped, norm, after, e.counters().skipped_steps)
            });
            let fresh = on_loaded(world, mode, step);
            for ((before, (kept, skipped), norm, after, later), fresh) in out.into_iter().zip(fresh)
            {
                assert_eq!(
                    kept, before,
                    "world {world}: a skipped step changed the shards"
                );
                assert_eq!((skipped, later), (1, 1));
                assert!(norm.is_finite() && norm.l2 > 0.0);
                assert_eq!(after, fresh, "world {world}: the skipped gradients stayed");
            }
        });
    }
}

#[test]
fn no_gradient_slot_where_gradients_travel_in_bf16() {
    for_each_mode(|mode| {
        let config = EngineConfig {
            reduce_dtype: DType::Bf16,
            ..EngineConfig::default()
        };
        let plain = on_engines(&plan(2), &config, mode, |mut e| {
            load(&mut e);
            step(&mut e)
        });
        let refused = on_engines(&plan(2), &config, mode, move |mut e| {
            load(&mut e);
            e.pre_forward(Unit::Layer(0)).unwrap();
            e.post_forward(Unit::Layer(0)).unwrap();
            e.pre_backward(Unit::Layer(0)).unwrap();
            let w = id(&e, "w");
            let err = e.grad_slot(w).map(drop).unwrap_err();
            assert!(
                matches!(&err, Error::GradSlotUnavailable { reason } if reason.contains("bf16")),
                "{err:?}"
            );
            // The unit's end reduces its groups (a zero gradient, which the step leaves out).
            e.post_backward(Unit::Layer(0)).unwrap();
            e.finish_grad_sync().unwrap();
            e.end_step().unwrap();
            step(&mut e)
        });
        assert_eq!(refused, plain, "the refusal changed nothing");
    });
}

/// A backward pass over unit 0 that writes `w`'s gradient into its slot and hands the others
/// over; the slot is refused, with nothing changed, where an earlier pass's gradient is in its
/// place, and the gradient handed over instead.
fn pass_through_the_slot(e: &mut CpuEngine) {
    e.pre_forward(Unit::Layer(0)).unwrap();
    e.post_forward(Unit::Layer(0)).unwrap();
    e.pre_backward(Unit::Layer(0)).unwrap();
    let w = id(e, "w");
    match e.grad_slot(w) {
        Ok(slot) => {
            slot.copy_from_slice(&grad_values(9));
            e.commit_grad(w).unwrap();
        }
        Err(Error::GradSlotUnavailable { reason }) => {
            assert!(reason.contains("earlier pass"), "{reason}");
            grad(e, "w").unwrap();
        }
        Err(other) => panic!("{other:?}"),
    }
    grad(e, "b").unwrap();
    e.post_backward(Unit::Layer(0)).unwrap();
}

#[test]
fn the_slot_of_a_later_pass_is_refused_where_it_adds_to_an_earlier_one() {
    for_each_mode(|mode| {
        let no_sync = EngineConfig {
            accumulation: Accumulation::NoSync,
            ..EngineConfig::default()
        };
        for (world, config) in [(1, EngineConfig::default()), (2, no_sync)] {
            let handed_over = on_engines(&plan(world), &config, mode, |mut e| {
                load(&mut e);
                for _ in 0..2 {
                    e.pre_forward(Unit::Layer(0)).unwrap();
                    e.post_forward(Unit::Layer(0)).unwrap();
                    e.pre_backward(Unit::Layer(0)).unwrap();
                    grad(&mut e, "w").unwrap();
                    grad(&mut e, "b").unwrap();
                    e.post_backward(Unit::Layer(0)).unwrap();
                }
                end_step(&mut e)
            });
            let through_slots = on_engines(&plan(world), &config, mode, |mut e| {
                load(&mut e);
                pass_through_the_slot(&mut e);
                pass_through_the_slot(&mut e);
                end_step(&mut e)
            });
            assert_eq!(through_slots, handed_over, "world {world}");
        }
    });
}
