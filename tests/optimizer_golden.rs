//! The optimizers against PyTorch's: the parity reference shares the engine's arithmetic, so a
//! wrong formula would pass parity; these values come from `torch.optim` itself
//! (`python3 tests/golden/optimizers.py`).

use std::sync::Arc;

use fsdp_fusion::{DType, EngineConfig, Input, ModelSpec, OptimizerConfig, ParamSpec, Plan, Unit};
use fsdp_fusion_support::ranks::{for_each_mode, on_engines};

const INITIAL: [f32; 8] = [1.0, -0.5, 0.25, 3.0, -2.0, 0.0, 1e-3, -7.5];

/// As `gradient` in tests/golden/optimizers.py.
fn gradient(step: u64, i: usize) -> f32 {
    if i == 5 && step % 2 == 0 {
        return 0.0;
    }
    let scale = if i == 3 { 10.0 } else { 1.0 };
    (((i + 1) as f64 * 0.37 - step as f64 * 0.51) * scale) as f32
}

// Computed by torch 2.15.0+cu132 on the CPU.
/// `torch.optim.AdamW(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)`, after each step.
const ADAMW: [[f32; 8]; 5] = [
    [
        1.0090001,
        -0.5095,
        0.23975,
        2.987,
        -2.0080001,
        -0.01,
        -0.009001001,
        -7.5025005,
    ],
    [
        1.016676,
        -0.50749105,
        0.23177949,
        2.9747696,
        -2.0156076,
        -0.016690582,
        -0.018823631,
        -7.504871,
    ],
    [
        1.0245395,
        -0.50069344,
        0.23027426,
        2.9649549,
        -2.022148,
        -0.023868952,
        -0.028252378,
        -7.5069647,
    ],
    [
        1.0325971,
        -0.4924983,
        0.23395051,
        2.9597108,
        -2.0264032,
        -0.029738842,
        -0.03693516,
        -7.508557,
    ],
    [
        1.040834,
        -0.48362678,
        0.24002634,
        2.958922,
        -2.0270784,
        -0.033649795,
        -0.044336554,
        -7.509314,
    ],
];
/// `torch.optim.SGD(lr=0.1)`, after each step.
const SGD: [[f32; 8]; 5] = [
    [1.014, -0.523, 0.19, 2.03, -2.134, -0.171, -0.207, -7.745],
    [
        1.0790001,
        -0.495,
        0.181,
        1.5699999,
        -2.217,
        -0.171,
        -0.36400002,
        -7.939,
    ],
    [
        1.1950002,
        -0.416,
        0.22299999,
        1.6199999,
        -2.249,
        -0.24000001,
        -0.47000003,
        -8.082,
    ],
    [
        1.3620002,
        -0.286,
        0.31599998,
        2.1799998,
        -2.23,
        -0.24000001,
        -0.52500004,
        -8.174,
    ],
    [
        1.5800003,
        -0.10500002,
        0.45999998,
        3.2499998,
        -2.16,
        -0.207,
        -0.52900004,
        -8.215,
    ],
];

/// `torch.optim.SGD(lr=0.1, weight_decay=0.1)`, after each step.
const SGD_DECAY: [[f32; 8]; 5] = [
    [
        1.004,
        -0.518,
        0.1875,
        2.0,
        -2.114,
        -0.171,
        -0.20700999,
        -7.67,
    ],
    [
        1.05896,
        -0.48482,
        0.176625,
        1.52,
        -2.1758602,
        -0.16929,
        -0.36193988,
        -7.7873,
    ],
    [
        1.1643704,
        -0.4009718,
        0.21685874,
        1.5548,
        -2.1861017,
        -0.2365971,
        -0.46432048,
        -7.852427,
    ],
    [
        1.3197267,
        -0.26696208,
        0.30769014,
        2.099252,
        -2.1452405,
        -0.23423113,
        -0.5146773,
        -7.865903,
    ],
    [
        1.5245295,
        -0.08329246,
        0.44861326,
        3.1482594,
        -2.0537882,
        -0.19888882,
        -0.5135305,
        -7.8282437,
    ],
];

/// Trains the parameter for 5 steps at `world` ranks in every mode and checks each step against
/// `want` within `tolerance` relative to the value (at least 1).
fn matches_torch(optimizer: OptimizerConfig, want: &'static [[f32; 8]; 5], tolerance: f32) {
    let model = ModelSpec::new(vec![ParamSpec::new("p", &[8], DType::F32).in_unit(0)]).unwrap();
    for world in [1, 2] {
        let plan = Arc::new(Plan::new(&model, world).unwrap());
        let config = EngineConfig {
            optimizer,
            ..EngineConfig::default()
        };
        for_each_mode(|mode| {
            let runs = on_engines(&plan, &config, mode, move |mut e| {
                let p = e.plan().param_id("p").unwrap();
                e.load_param(p, Input::host(&INITIAL)).unwrap();
                let mut steps = Vec::new();
                for step in 1..=5 {
                    e.pre_backward(Unit::Layer(0)).unwrap();
                    let g: Vec<f32> = (0..8).map(|i| gradient(step, i)).collect();
                    e.grad(p, Input::host(&g)).unwrap();
                    e.post_backward(Unit::Layer(0)).unwrap();
                    e.finish_grad_sync().unwrap();
                    e.optimizer_step().unwrap();
                    e.end_step().unwrap();
                    e.pre_forward(Unit::Layer(0)).unwrap();
                    steps.push(e.param::<f32>(p).unwrap().to_vec());
                    e.post_forward(Unit::Layer(0)).unwrap();
                }
                steps
            });
            for (rank, steps) in runs.iter().enumerate() {
                for (step, (got, want)) in steps.iter().zip(want).enumerate() {
                    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
                        assert!(
                            (g - w).abs() <= tolerance * w.abs().max(1.0),
                            "world {world} rank {rank} step {} element {i}: {g} against torch's {w}",
                            step + 1
                        );
                    }
                }
            }
        });
    }
}

#[test]
fn adamw_matches_torch_optim_adamw() {
    let adamw = OptimizerConfig::AdamW {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    matches_torch(adamw, &ADAMW, 1e-6);
}

#[test]
fn sgd_matches_torch_optim_sgd() {
    // PyTorch's CPU kernel fuses `p - lr * g` into one rounding; the engine rounds twice, as its
    // GPU kernels do, so the two may differ in the last bit.
    matches_torch(OptimizerConfig::sgd(0.1), &SGD, 1e-6);
    let decay = OptimizerConfig::Sgd {
        lr: 0.1,
        weight_decay: 0.1,
    };
    matches_torch(decay, &SGD_DECAY, 1e-6);
}
