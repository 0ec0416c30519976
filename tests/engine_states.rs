//! The gather and reduce machinery, observed through the engine's counters and buffer states, on
//! the eager CPU backend and on asynchronous ones.

use std::sync::Arc;

use fsdp_fusion::types::{BufferState, Stream};
use fsdp_fusion::{
    Accumulation, DType, Engine, EngineConfig, GradReduction, GradShardMemory, Input, LocalComm,
    ModelSpec, OptimizerConfig, ParamSpec, Plan, Unit,
};
use fsdp_fusion_support::ranks::{CpuEngine, Mode, for_each_mode, on_engines};

/// A world-size-1 engine in `mode`.
fn engine(mode: Mode, model: ModelSpec, config: EngineConfig) -> CpuEngine {
    let plan = Arc::new(Plan::new(&model, 1).unwrap());
    let comm = LocalComm::group(1).unwrap().pop().unwrap();
    Engine::new(plan, config, mode.backend(0), comm).unwrap()
}

/// Runs `f` on both ranks of a two-rank group, one thread each: at world size 1 a shard is its
/// whole buffer, so gathers use no slot and move no data.
fn on_two_ranks<R: Send + 'static>(
    mode: Mode,
    model: ModelSpec,
    config: EngineConfig,
    f: impl Fn(CpuEngine) -> R + Send + Sync + 'static,
) -> Vec<R> {
    on_engines(&Arc::new(Plan::new(&model, 2).unwrap()), &config, mode, f)
}

/// A tied embedding and `layers` units of one trainable weight each (and a frozen gain when
/// `frozen`).
fn stack(layers: u32, frozen: bool) -> ModelSpec {
    let mut params = vec![ParamSpec::new("embed", &[8, 4], DType::F32).tied()];
    for i in 0..layers {
        params.push(ParamSpec::new(format!("w{i}"), &[4, 4], DType::F32).in_unit(i));
        if frozen {
            params.push(
                ParamSpec::new(format!("g{i}"), &[4], DType::Bf16)
                    .in_unit(i)
                    .frozen(),
            );
        }
    }
    ModelSpec::new(params).unwrap()
}

fn no_overlap() -> EngineConfig {
    EngineConfig {
        overlap: false,
        ..EngineConfig::default()
    }
}

fn groups_of(e: &CpuEngine, unit: Unit) -> Vec<usize> {
    let u = e.plan().unit_index(unit).unwrap();
    e.plan().unit_groups(u).unwrap().to_vec()
}

#[test]
fn a_ready_reuse_issues_no_all_gather() {
    for_each_mode(|mode| {
        let mut e = engine(mode, stack(2, false), no_overlap());
        e.pre_forward(Unit::Layer(0)).unwrap();
        assert_eq!(e.counters().all_gathers, 1);
        e.post_forward(Unit::Layer(0)).unwrap();
        let g = groups_of(&e, Unit::Layer(0))[0];
        assert_eq!(e.buffer_state(g).unwrap(), BufferState::Ready);
        e.pre_forward(Unit::Layer(0)).unwrap();
        let c = e.counters();
        assert_eq!((c.all_gathers, c.reuses), (1, 1));
        assert_eq!(e.buffer_state(g).unwrap(), BufferState::Using);
    });
}

/// Runs one training step's hooks over every unit, checking `check` after each hook.
fn walk_step(e: &mut CpuEngine, layers: u32, check: &mut impl FnMut(&CpuEngine)) {
    walk_pass(e, layers, check);
    e.finish_grad_sync().unwrap();
    e.optimizer_step().unwrap();
    e.end_step().unwrap();
}

/// Runs one forward and backward pass's hooks over every unit, checking `check` after each.
fn walk_pass(e: &mut CpuEngine, layers: u32, check: &mut impl FnMut(&CpuEngine)) {
    let w = |e: &CpuEngine, i: u32| e.plan().param_id(&format!("w{i}")).unwrap();
    e.pre_forward(Unit::Root).unwrap();
    check(e);
    e.post_forward(Unit::Root).unwrap();
    for i in 0..layers {
        e.pre_forward(Unit::Layer(i)).unwrap();
        check(e);
        e.post_forward(Unit::Layer(i)).unwrap();
    }
    for i in (0..layers).rev() {
        e.pre_backward(Unit::Layer(i)).unwrap();
        check(e);
        let id = w(e, i);
        e.grad(id, Input::host(&[0.5f32; 16])).unwrap();
        e.post_backward(Unit::Layer(i)).unwrap();
        check(e);
    }
    let embed = e.plan().param_id("embed").unwrap();
    e.grad(embed, Input::host(&[0.25f32; 32])).unwrap();
}

/// Collectives and memory of two ranks over two steps of three passes each.
#[derive(Debug, PartialEq)]
struct PassesRun {
    all_gathers: u64,
    reduce_scatters: u64,
    peak: usize,
    predicted: usize,
}

fn three_passes_a_step(mode: Mode, accumulation: Accumulation) -> Vec<PassesRun> {
    let config = EngineConfig {
        accumulation,
        ..EngineConfig::default()
    };
    on_two_ranks(mode, stack(4, true), config, |mut e| {
        for _ in 0..2 {
            for _ in 0..3 {
                walk_pass(&mut e, 4, &mut |_| {});
            }
            e.finish_grad_sync().unwrap();
            e.optimizer_step().unwrap();
            e.end_step().unwrap();
        }
        PassesRun {
            all_gathers: e.counters().all_gathers,
            reduce_scatters: e.counters().reduce_scatters,
            peak: e.memory().peak,
            predicted: e.policy().memory.peak,
        }
    })
}

#[test]
fn keeping_groups_gathered_gathers_each_once_a_step_however_many_passes() {
    for_each_mode(|mode| {
        let groups = Plan::new(&stack(4, true), 2).unwrap().groups().len() as u64;
        for run in three_passes_a_step(mode, Accumulation::KeepGathered) {
            assert_eq!(run.all_gathers, 2 * groups, "{run:?}");
            assert_eq!(run.peak, run.predicted, "{run:?}");
        }
        for run in three_passes_a_step(mode, Accumulation::ReduceEveryPass) {
            assert!(run.all_gathers > 2 * 3 * (groups - 1), "{run:?}");
        }
    });
}

#[test]
fn no_sync_reduces_each_trainable_group_once_a_step() {
    for_each_mode(|mode| {
        let plan = Plan::new(&stack(4, true), 2).unwrap();
        let trainable = plan.groups().iter().filter(|g| g.trainable()).count() as u64;
        let no_sync = three_passes_a_step(mode, Accumulation::NoSync);
        let every_pass = three_passes_a_step(mode, Accumulation::ReduceEveryPass);
        for (once, each) in no_sync.iter().zip(&every_pass) {
            assert_eq!(once.reduce_scatters, 2 * trainable, "{once:?}");
            assert_eq!(each.reduce_scatters, 2 * 3 * trainable, "{each:?}");
            // The accumulators: one unsharded fp32 gradient, in the plan.
            assert_eq!(once.peak, once.predicted, "{once:?}");
            assert!(once.predicted > each.predicted);
        }
    });
}

#[test]
fn prefetch_never_pushes_the_gathered_count_past_the_limit() {
    for_each_mode(|mode| {
        for limit in [1, 2, 3] {
            let config = EngineConfig {
                double_buffer_limit: limit,
                ..EngineConfig::default()
            };
            let mut e = engine(mode, stack(6, false), config);
            let mut worst = 0;
            for _ in 0..3 {
                walk_step(&mut e, 6, &mut |e| worst = worst.max(e.gathered_count()));
            }
            assert!(worst <= limit, "limit {limit}: {worst} gathered");
            let c = e.counters();
            assert_eq!(c.extra_slots, 0);
            if limit > 1 {
                assert!(c.prefetches > 0, "limit {limit}: nothing prefetched");
            }
        }
    });
}

#[test]
fn in_steady_state_every_gather_after_the_first_is_a_prefetch() {
    for_each_mode(|mode| {
        let mut e = engine(mode, stack(6, false), EngineConfig::default());
        walk_step(&mut e, 6, &mut |_| {});
        let before = e.counters();
        walk_step(&mut e, 6, &mut |_| {});
        let after = e.counters();
        let gathers = after.all_gathers - before.all_gathers;
        let prefetches = after.prefetches - before.prefetches;
        // Forward: root + 6 layers; backward: 4 layers, the last two still READY from forward.
        assert_eq!(gathers, 11);
        assert_eq!(prefetches, gathers - 1);
    });
}

#[test]
fn a_unit_of_more_groups_than_the_limit_gathers_into_slots_made_with_the_engine() {
    for_each_mode(|mode| {
        // The root has one group, each unit two (trainable f32, frozen bf16), and the limit is
        // 1: the engine makes a slot for each group of the root and of one unit.
        let config = EngineConfig {
            double_buffer_limit: 1,
            overlap: false,
            ..EngineConfig::default()
        };
        on_two_ranks(mode, stack(2, true), config, |mut e| {
            let predicted = e.policy().memory.peak;
            let slot = e.plan().gather_slot_bytes();
            assert_eq!(e.policy().memory.gathered_slots, 3 * slot);
            assert_eq!(e.memory().current, predicted);
            e.pre_forward(Unit::Root).unwrap();
            e.pre_forward(Unit::Layer(0)).unwrap();
            assert_eq!(e.gathered_count(), 3);
            let c = e.counters();
            assert_eq!((c.all_gathers, c.extra_slots), (3, 0));
            assert_eq!(e.memory().current, predicted);
            for g in groups_of(&e, Unit::Layer(0)) {
                assert_eq!(e.buffer_state(g).unwrap(), BufferState::Using);
            }
            // A second unit open at once (hooks the plan does not foresee) still gathers,
            // into slots of its own made then and counted.
            e.pre_forward(Unit::Layer(1)).unwrap();
            assert_eq!(e.gathered_count(), 5);
            assert_eq!(e.counters().extra_slots, 2);
            assert_eq!(e.memory().current, predicted + 2 * slot);
        });
    });
}

#[test]
fn at_world_size_1_the_shard_is_the_view_and_no_slot_is_allocated() {
    for_each_mode(|mode| {
        let mut e = engine(mode, stack(2, true), EngineConfig::default());
        assert_eq!(e.policy().memory.gathered_slots, 0);
        assert_eq!(e.memory().current, e.policy().memory.peak);
        let w0 = e.plan().param_id("w0").unwrap();
        e.load_param(w0, Input::host(&[2.5f32; 16])).unwrap();
        e.pre_forward(Unit::Layer(0)).unwrap();
        assert_eq!(e.param::<f32>(w0).unwrap(), &[2.5f32; 16]);
        let c = e.counters();
        assert_eq!((c.all_gathers, c.extra_slots), (2, 0));
    });
}

#[test]
fn prefetch_follows_the_recorded_order_not_the_group_order() {
    for_each_mode(|mode| {
        // Frozen groups sort before every trainable one, so group order is not execution order.
        let mut e = engine(
            mode,
            stack(3, true),
            EngineConfig {
                double_buffer_limit: 4,
                ..EngineConfig::default()
            },
        );
        let order = [Unit::Layer(2), Unit::Layer(0), Unit::Layer(1)];
        for _ in 0..2 {
            for &u in &order {
                e.pre_forward(u).unwrap();
                e.post_forward(u).unwrap();
            }
            e.end_step().unwrap();
        }
        e.pre_forward(Unit::Layer(2)).unwrap();
        for g in groups_of(&e, Unit::Layer(0)) {
            assert_eq!(
                e.buffer_state(g).unwrap(),
                BufferState::Syncing,
                "group {g}"
            );
        }
        for g in groups_of(&e, Unit::Layer(1)) {
            assert_eq!(e.buffer_state(g).unwrap(), BufferState::Freed, "group {g}");
        }
    });
}

#[test]
fn memory_is_fixed_up_front_and_matches_the_plan() {
    for_each_mode(|mode| {
        let mut e = engine(mode, stack(4, true), EngineConfig::default());
        let predicted = e.policy().memory.peak;
        assert_eq!(e.memory().current, predicted);
        for _ in 0..3 {
            walk_step(&mut e, 4, &mut |_| {});
        }
        assert_eq!(e.memory().peak, predicted);
        assert_eq!(e.counters().steps, 3);
    });
}

/// The parameter shards after two steps of two layers at world size 1, each gradient `factor`
/// times a fixed ramp, written into the slot (`zero_copy`) or handed over.
fn two_steps(mode: Mode, config: EngineConfig, factor: f32, zero_copy: bool) -> Vec<Vec<u8>> {
    let mut e = engine(mode, stack(2, false), config);
    for _ in 0..2 {
        for i in (0..2).rev() {
            e.pre_backward(Unit::Layer(i)).unwrap();
            let id = e.plan().param_id(&format!("w{i}")).unwrap();
            let g: Vec<f32> = (0..16)
                .map(|j| factor * (i as f32 + 1.0) * j as f32)
                .collect();
            if zero_copy {
                e.grad_slot(id).unwrap().copy_from_slice(&g);
                e.commit_grad(id).unwrap();
            } else {
                e.grad(id, Input::host(&g)).unwrap();
            }
            e.post_backward(Unit::Layer(i)).unwrap();
        }
        e.finish_grad_sync().unwrap();
        e.optimizer_step().unwrap();
        e.end_step().unwrap();
    }
    (0..e.plan().groups().len())
        .map(|g| e.param_shard(g).unwrap())
        .collect()
}

#[test]
fn writing_into_the_slot_equals_handing_over_the_gradient() {
    for_each_mode(|mode| {
        let config = EngineConfig::default();
        let copied = two_steps(mode, config.clone(), 1.0, false);
        assert_eq!(two_steps(mode, config, 1.0, true), copied);
        assert_ne!(copied, run_untrained(mode));
    });
}

#[test]
fn a_scaled_reduction_scales_gradients_written_either_way_at_world_size_1() {
    for_each_mode(|mode| {
        let sgd = OptimizerConfig::Sgd {
            lr: 0.1,
            weight_decay: 0.0,
        };
        let config = |grad_reduction| EngineConfig {
            grad_reduction,
            optimizer: sgd,
            ..EngineConfig::default()
        };
        // A power of two, so that scaling before or after the sum rounds the same.
        let expected = two_steps(mode, config(GradReduction::Sum), 0.25, false);
        for zero_copy in [false, true] {
            let scaled = two_steps(mode, config(GradReduction::Scaled(0.25)), 1.0, zero_copy);
            assert_eq!(scaled, expected, "zero copy {zero_copy}");
        }
        assert_ne!(
            expected,
            two_steps(mode, config(GradReduction::Sum), 1.0, false)
        );
    });
}

fn run_untrained(mode: Mode) -> Vec<Vec<u8>> {
    let e = engine(mode, stack(2, false), EngineConfig::default());
    (0..e.plan().groups().len())
        .map(|g| e.param_shard(g).unwrap())
        .collect()
}

#[test]
fn tracing_records_a_span_for_every_hook_and_collective() {
    for_each_mode(|mode| {
        use fsdp_fusion::trace::SpanKind;
        on_two_ranks(mode, stack(2, false), EngineConfig::default(), |mut e| {
            walk_step(&mut e, 2, &mut |_| {});
            let before = e.counters();
            e.set_tracing(true).unwrap();
            let origin = fsdp_fusion::Backend::record_timed(e.backend(), Stream::Compute).unwrap();
            // Every stream's later work comes after the origin only once it waits for it.
            for stream in [Stream::Gather, Stream::Reduce] {
                fsdp_fusion::Backend::wait(e.backend(), stream, &origin).unwrap();
            }
            walk_step(&mut e, 2, &mut |_| {});
            let after = e.counters();
            let raw = e.take_trace();
            let spans = fsdp_fusion::trace::resolve(e.backend(), &origin, &raw).unwrap();
            let count =
                |f: &dyn Fn(SpanKind) -> bool| spans.iter().filter(|s| f(s.kind)).count() as u64;
            // Root forward, two layers forward, two layers backward.
            assert_eq!(count(&|k| matches!(k, SpanKind::GatherWait(_))), 5);
            assert_eq!(count(&|k| matches!(k, SpanKind::Forward(_))), 3);
            assert_eq!(count(&|k| matches!(k, SpanKind::Backward(_))), 2);
            assert_eq!(count(&|k| matches!(k, SpanKind::Optimizer)), 1);
            let gathers = after.all_gathers - before.all_gathers;
            assert!(gathers > 0);
            assert_eq!(count(&|k| matches!(k, SpanKind::AllGather { .. })), gathers);
            assert_eq!(
                count(&|k| matches!(k, SpanKind::ReduceScatter { .. })),
                after.reduce_scatters - before.reduce_scatters
            );
            for s in &spans {
                let stream = match s.kind {
                    SpanKind::AllGather { .. } => Stream::Gather,
                    SpanKind::ReduceScatter { .. } => Stream::Reduce,
                    _ => Stream::Compute,
                };
                assert_eq!(s.stream, stream, "{:?}", s.kind);
                assert!(s.start_ms >= 0.0 && s.duration_ms >= 0.0, "{s:?}");
            }
            e.set_tracing(false).unwrap();
            walk_step(&mut e, 2, &mut |_| {});
            assert!(e.take_trace().is_empty());
        });
    });
}

#[test]
fn an_evaluation_loop_without_an_end_of_step_keeps_prefetching() {
    for_each_mode(|mode| {
        let mut e = engine(mode, stack(6, false), EngineConfig::default());
        walk_step(&mut e, 6, &mut |_| {});
        let forward = |e: &mut CpuEngine| {
            let (before, memory) = (e.counters(), e.memory());
            for unit in std::iter::once(Unit::Root).chain((0..6).map(Unit::Layer)) {
                e.pre_forward(unit).unwrap();
                e.post_forward(unit).unwrap();
            }
            assert_eq!(e.memory(), memory, "an evaluation pass allocated");
            let after = e.counters();
            (
                after.all_gathers - before.all_gathers,
                after.prefetches - before.prefetches,
            )
        };
        forward(&mut e);
        for pass in 0..300 {
            // Root and six layers, two gathered at a time: every gather but the root's is a
            // prefetch, however long the loop.
            assert_eq!(forward(&mut e), (7, 6), "pass {pass}");
        }
    });
}

#[test]
fn a_gradient_slot_is_not_zero_filled() {
    for_each_mode(|mode| {
        // At world size 1 a step's first gradients go straight into the gradient shard, so the
        // next step's place for the same parameter holds the last step's gradient.
        let mut e = engine(mode, stack(1, false), EngineConfig::default());
        let w = e.plan().param_id("w0").unwrap();
        let g: Vec<f32> = (0..16).map(|j| j as f32 + 1.0).collect();
        e.pre_backward(Unit::Layer(0)).unwrap();
        e.grad(w, Input::host(&g)).unwrap();
        e.post_backward(Unit::Layer(0)).unwrap();
        e.finish_grad_sync().unwrap();
        e.optimizer_step().unwrap();
        e.end_step().unwrap();
        e.pre_backward(Unit::Layer(0)).unwrap();
        assert_eq!(e.grad_slot(w).unwrap(), &g[..]);
        e.commit_grad(w).unwrap();
    });
}

/// One step of two units under a root of two parameters in one group, whose backward
/// recomputes each unit's forward inside its open backward when `recompute`, as activation
/// checkpointing does; returns the step's reduce-scatters and rank 0's root shard after an SGD
/// step.
fn checkpointed_step(mode: Mode, recompute: bool) -> (u64, Vec<u8>) {
    let mut params = vec![
        ParamSpec::new("head", &[4], DType::F32),
        ParamSpec::new("tail", &[8], DType::F32),
    ];
    params.extend((0..2).map(|i| ParamSpec::new(format!("w{i}"), &[4, 4], DType::F32).in_unit(i)));
    let model = ModelSpec::new(params).unwrap();
    let config = EngineConfig {
        optimizer: fsdp_fusion::OptimizerConfig::sgd(0.5),
        ..EngineConfig::default()
    };
    let mut ranks = on_two_ranks(mode, model, config, move |mut e| {
        let ids: Vec<_> = ["head", "tail", "w0", "w1"]
            .iter()
            .map(|n| e.plan().param_id(n).unwrap())
            .collect();
        let numel = |e: &CpuEngine, id| e.plan().param(id).unwrap().numel();
        for &id in &ids {
            e.load_param(id, Input::host(&vec![1.0f32; numel(&e, id)]))
                .unwrap();
        }
        let grad = |e: &mut CpuEngine, id| {
            let g = vec![0.25f32 * (1 + e.rank()) as f32; numel(e, id)];
            e.grad(id, Input::host(&g)).unwrap();
        };
        e.pre_forward(Unit::Root).unwrap();
        for i in 0..2 {
            e.pre_forward(Unit::Layer(i)).unwrap();
            e.post_forward(Unit::Layer(i)).unwrap();
        }
        e.post_forward(Unit::Root).unwrap();
        // The head's gradient comes first, the tail's last: the root's group is half-filled
        // during the units' backward.
        e.pre_backward(Unit::Root).unwrap();
        grad(&mut e, ids[0]);
        for i in (0..2).rev() {
            e.pre_backward(Unit::Layer(i)).unwrap();
            if recompute {
                e.pre_forward(Unit::Layer(i)).unwrap();
                e.post_forward(Unit::Layer(i)).unwrap();
            }
            grad(&mut e, ids[2 + i as usize]);
            e.post_backward(Unit::Layer(i)).unwrap();
        }
        grad(&mut e, ids[1]);
        e.post_backward(Unit::Root).unwrap();
        e.finish_grad_sync().unwrap();
        e.optimizer_step().unwrap();
        e.end_step().unwrap();
        let group = e.plan().param(ids[0]).unwrap().group();
        (e.counters().reduce_scatters, e.param_shard(group).unwrap())
    });
    ranks.swap_remove(0)
}

#[test]
fn a_forward_recomputed_inside_the_backward_keeps_the_pass_and_its_reductions() {
    for_each_mode(|mode| {
        let (plain_reduces, plain_shard) = checkpointed_step(mode, false);
        let (recomputed_reduces, recomputed_shard) = checkpointed_step(mode, true);
        // Three groups (the root's, w0's, w1's), each reduced once.
        assert_eq!(plain_reduces, 3);
        assert_eq!(recomputed_reduces, plain_reduces);
        assert_eq!(recomputed_shard, plain_shard);
    });
}

#[test]
fn per_step_gradient_shards_exist_from_the_first_gradient_to_the_step_s_end() {
    let config = EngineConfig {
        grad_shard_memory: GradShardMemory::PerStep,
        ..EngineConfig::default()
    };
    let layers = 4;
    let run = move |mut e: CpuEngine| {
        let m = e.policy().memory;
        assert_eq!(m.between_steps, m.peak - m.grad_shards);
        assert!(m.grad_shards > 0);
        assert_eq!(e.memory().current, m.between_steps, "before the first step");
        for step in 0..2 {
            let mut seen = Vec::new();
            walk_pass(&mut e, layers, &mut |e| seen.push(e.memory().current));
            // The forward's hooks (the root and each layer) saw no gradient memory; the first
            // backward hook of a layer neither (its gradient comes after it).
            let forward = layers as usize + 2;
            assert!(
                seen[..forward].iter().all(|&b| b == m.between_steps),
                "step {step}: {seen:?}"
            );
            assert!(
                seen[forward..].iter().any(|&b| b > m.between_steps),
                "step {step}: {seen:?}"
            );
            e.finish_grad_sync().unwrap();
            assert_eq!(
                e.memory().current,
                m.peak,
                "step {step}: every shard, once synced"
            );
            e.optimizer_step().unwrap();
            e.end_step().unwrap();
            assert_eq!(e.memory().current, m.between_steps, "after step {step}");
        }
        assert_eq!(e.memory().peak, m.peak);
        e.param_shard(1).unwrap()
    };
    for_each_mode(|mode| {
        run(engine(mode, stack(layers, true), config.clone()));
        let shards = on_two_ranks(mode, stack(layers, true), config.clone(), run);
        // The same steps with persistent shards give the same values.
        let persistent = on_two_ranks(
            mode,
            stack(layers, true),
            EngineConfig::default(),
            move |e| {
                let mut e = e;
                for _ in 0..2 {
                    walk_step(&mut e, layers, &mut |_| {});
                }
                e.param_shard(1).unwrap()
            },
        );
        assert_eq!(shards, persistent);
    });
}
