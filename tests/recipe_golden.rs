//! A training recipe against PyTorch's (`python3 tests/golden/recipes.py`): the warmup-cosine
//! schedule, the whole gradient's norm and its clipping, and AdamW over two groups, one exempt
//! from weight decay at half the learning rate. The parity reference shares the engine's
//! arithmetic; these values come from torch itself.

use std::sync::Arc;

use fsdp_fusion::optim::LrSchedule;
use fsdp_fusion::{
    DType, EngineConfig, Input, ModelSpec, OptimizerConfig, ParamId, ParamSpec, Plan, Unit,
};
use fsdp_fusion_support::ranks::{for_each_mode, on_engines};
use fsdp_fusion_support::values::widen;

const DECAYED: [f32; 8] = [1.0, -0.5, 0.25, 3.0, -2.0, 0.0, 1e-3, -7.5];
const EXEMPT: [f32; 5] = [0.5, -1.5, 2.0, 0.125, -0.25];
const LR: f32 = 1e-2;
const MAX_NORM: f32 = 1.0;

/// As `gradient` in tests/golden/recipes.py.
fn gradient(step: u64, i: usize) -> f32 {
    let scale = if i % 4 == 1 { 3.0 } else { 1.0 };
    (((i + 1) as f64 * 0.37 - step as f64 * 0.51) * scale) as f32
}

// Computed by torch 2.15.0+cu132 on the CPU.
/// `SequentialLR([LinearLR(start_factor=1/2, total_iters=2), CosineAnnealingLR(T_max=4,
/// eta_min=0.1 * lr)], milestones=[2])`: the lr over the base lr, steps 0 to 6.
const FACTORS: [f32; 7] = [0.5, 0.75, 1.0, 0.86819804, 0.55, 0.23180194, 0.1];
/// `clip_grad_norm_(max_norm=1.0)`'s total norm, steps 1 to 4.
const NORMS: [f32; 4] = [13.6522455, 11.250151, 9.273371, 8.041909];
/// The two parameters after each step: AdamW(betas=(0.9, 0.999), eps=1e-8), the first group at
/// lr 1e-2 with weight decay 0.1, the second at 5e-3 without, both under the schedule above with
/// eta_min 0, gradients clipped to 1.0.
const DECAYED_AFTER: [[f32; 8]; 4] = [
    [
        1.0044999,
        -0.50475,
        0.244875,
        2.9934998,
        -2.004,
        -0.005,
        -0.0040004994,
        -7.50125,
    ],
    [
        1.0101196,
        -0.502565,
        0.23874727,
        2.9841146,
        -2.009868,
        -0.0124410335,
        -0.011473164,
        -7.503114,
    ],
    [
        1.0176818,
        -0.4954187,
        0.23875894,
        2.9742072,
        -2.0169008,
        -0.022053162,
        -0.021296717,
        -7.505539,
    ],
    [
        1.0242623,
        -0.48840022,
        0.24298654,
        2.9711878,
        -2.0204911,
        -0.02932331,
        -0.029264327,
        -7.507404,
    ],
];
const EXEMPT_AFTER: [[f32; 5]; 4] = [
    [0.4975, -1.5025, 1.9975, 0.1225, -0.2525],
    [0.4937506, -1.5062518, 1.9937469, 0.11874607, -0.25625443],
    [0.4887634, -1.5112518, 1.9887396, 0.113734365, -0.26126885],
    [0.48455986, -1.5154914, 1.9844794, 0.109461635, -0.26554954],
];

#[track_caller]
fn assert_close(got: f32, want: f32, what: &str) {
    assert!(
        (got - want).abs() <= 1e-6 * want.abs().max(1e-3),
        "{what}: {got} against torch's {want}"
    );
}

#[test]
fn the_warmup_cosine_schedule_is_torch_s() {
    let schedule = LrSchedule::WarmupCosine {
        warmup_steps: 2,
        total_steps: 6,
        min_factor: 0.1,
    };
    for (step, &want) in FACTORS.iter().enumerate() {
        assert_close(schedule.factor(step as u64), want, &format!("step {step}"));
    }
    // Past the end it stays at the minimum (torch's cosine would rise again).
    assert_eq!(schedule.factor(7), schedule.factor(100));
    assert_close(schedule.factor(100), 0.1, "past the end");
    assert_eq!(LrSchedule::Constant.factor(17), 1.0);
}

#[test]
fn norms_clipping_and_decay_groups_are_torch_s_at_every_world_size() {
    let model = ModelSpec::new(vec![
        ParamSpec::new("decayed", &[8], DType::F32),
        ParamSpec::new("exempt", &[5], DType::F32)
            .no_weight_decay()
            .with_lr_scale(0.5),
    ])
    .unwrap();
    let config = EngineConfig {
        optimizer: OptimizerConfig::AdamW {
            lr: LR,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        ..EngineConfig::default()
    };
    let schedule = LrSchedule::WarmupCosine {
        warmup_steps: 2,
        total_steps: 6,
        min_factor: 0.0,
    };
    for world in [1, 2, 4] {
        let plan = Arc::new(Plan::new(&model, world).unwrap());
        for_each_mode(|mode| {
            let ranks = on_engines(&plan, &config, mode, move |mut e| {
                e.load_param(ParamId(0), Input::host(&DECAYED)).unwrap();
                e.load_param(ParamId(1), Input::host(&EXEMPT)).unwrap();
                let mut steps = Vec::new();
                for step in 1..=4u64 {
                    e.set_lr(LR * schedule.factor(step - 1)).unwrap();
                    e.pre_forward(Unit::Root).unwrap();
                    e.post_forward(Unit::Root).unwrap();
                    e.pre_backward(Unit::Root).unwrap();
                    // Every rank's gradient is the whole one: their mean is it again.
                    let all: Vec<f32> = (0..13).map(|i| gradient(step, i)).collect();
                    e.grad(ParamId(0), Input::host(&all[..8])).unwrap();
                    e.grad(ParamId(1), Input::host(&all[8..])).unwrap();
                    e.post_backward(Unit::Root).unwrap();
                    e.finish_grad_sync().unwrap();
                    let norm = e.clip_grad_norm(MAX_NORM).unwrap();
                    e.optimizer_step().unwrap();
                    e.end_step().unwrap();
                    let shards: Vec<Vec<u8>> = (0..e.plan().groups().len())
                        .map(|g| e.param_shard(g).unwrap())
                        .collect();
                    steps.push((norm, shards));
                }
                steps
            });
            for step in 0..4 {
                let norm = ranks[0][step].0;
                for rank in &ranks {
                    assert_eq!(rank[step].0, norm, "the ranks' norms differ");
                }
                let what = format!("world {world} {mode:?} step {}", step + 1);
                assert_close(norm.l2, NORMS[step], &format!("{what}: norm"));
                for (id, want) in [(0, &DECAYED_AFTER[step][..]), (1, &EXEMPT_AFTER[step][..])] {
                    let layout = plan.param(ParamId(id)).unwrap();
                    let shards: Vec<Vec<u8>> = ranks
                        .iter()
                        .map(|r| r[step].1[layout.group()].clone())
                        .collect();
                    let got = widen(
                        DType::F32,
                        &plan.assemble_param(ParamId(id), &shards).unwrap(),
                    );
                    for (j, (&g, &w)) in got.iter().zip(want).enumerate() {
                        assert_close(g, w, &format!("{what}: param {id}[{j}]"));
                    }
                }
            }
        });
    }
}
