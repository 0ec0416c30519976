//! Optimizers on the shards, and the exact element-wise arithmetic every backend follows.
//!
//! Each update is written as a fixed sequence of single-precision operations with no fused
//! multiply-add, so the CPU backend, the CUDA kernels and the unsharded reference agree bit for bit.

use crate::error::{Error, Result};
use crate::types::DType;

/// The optimizer the engine runs on each rank's shards.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum OptimizerConfig {
    /// `p -= lr * (g + weight_decay * p)`, as `torch.optim.SGD` without momentum.
    Sgd { lr: f32, weight_decay: f32 },
    /// Adam with decoupled weight decay (Loshchilov and Hutter), as PyTorch's `AdamW`.
    AdamW {
        lr: f32,
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
    },
}

impl Default for OptimizerConfig {
    /// PyTorch's `AdamW` defaults.
    fn default() -> OptimizerConfig {
        OptimizerConfig::AdamW {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

fn check(ok: bool, field: &'static str, value: f32, expected: &str) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidConfig {
            field,
            reason: format!("is {value}, expected {expected}"),
        })
    }
}

impl OptimizerConfig {
    /// SGD at `lr` without weight decay.
    pub fn sgd(lr: f32) -> OptimizerConfig {
        OptimizerConfig::Sgd {
            lr,
            weight_decay: 0.0,
        }
    }

    /// Checks the hyper-parameters' ranges.
    pub fn validate(&self) -> Result<()> {
        match *self {
            OptimizerConfig::Sgd { lr, weight_decay } => {
                check(lr.is_finite() && lr >= 0.0, "lr", lr, "finite, >= 0")?;
                check(
                    weight_decay.is_finite() && weight_decay >= 0.0,
                    "weight_decay",
                    weight_decay,
                    "finite, >= 0",
                )
            }
            OptimizerConfig::AdamW {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                check(lr.is_finite() && lr >= 0.0, "lr", lr, "finite, >= 0")?;
                check((0.0..1.0).contains(&beta1), "beta1", beta1, "in [0, 1)")?;
                check((0.0..1.0).contains(&beta2), "beta2", beta2, "in [0, 1)")?;
                check(eps.is_finite() && eps > 0.0, "eps", eps, "finite, > 0")?;
                check(
                    weight_decay.is_finite() && weight_decay >= 0.0,
                    "weight_decay",
                    weight_decay,
                    "finite, >= 0",
                )
            }
        }
    }

    /// Whether the optimizer keeps AdamW moments.
    pub fn has_moments(&self) -> bool {
        matches!(self, OptimizerConfig::AdamW { .. })
    }

    /// The learning rate.
    pub fn lr(&self) -> f32 {
        match *self {
            OptimizerConfig::Sgd { lr, .. } | OptimizerConfig::AdamW { lr, .. } => lr,
        }
    }

    /// The weight decay of parameters that take it.
    pub fn weight_decay(&self) -> f32 {
        match *self {
            OptimizerConfig::Sgd { weight_decay, .. }
            | OptimizerConfig::AdamW { weight_decay, .. } => weight_decay,
        }
    }

    /// The same optimizer with learning rate `lr` and weight decay `weight_decay`, checked.
    pub fn with_lr_and_decay(&self, lr: f32, weight_decay: f32) -> Result<OptimizerConfig> {
        let mut next = *self;
        match &mut next {
            OptimizerConfig::Sgd {
                lr: l,
                weight_decay: w,
            }
            | OptimizerConfig::AdamW {
                lr: l,
                weight_decay: w,
                ..
            } => {
                *l = lr;
                *w = weight_decay;
            }
        }
        next.validate()?;
        Ok(next)
    }

    /// The coefficients of update number `step` (counting from 1) for a parameter group at the
    /// learning rate times `lr_scale`, with weight decay when `decay`, and gradients multiplied by
    /// `grad_scale` (the clipping coefficient; 1 leaves them as they are): the group's part
    /// ([`GroupUpdate::coefficients`]) of the step's [`StepValues`].
    pub fn coefficients(&self, step: u64, group: GroupSettings) -> Update {
        let GroupSettings {
            lr_scale,
            decay,
            grad_scale,
        } = group;
        let values = self.step_values(step, grad_scale);
        GroupUpdate { lr_scale, decay }.coefficients(self.kind(), &values)
    }

    /// Which optimizer this is.
    pub fn kind(&self) -> OptimizerKind {
        match self {
            OptimizerConfig::Sgd { .. } => OptimizerKind::Sgd,
            OptimizerConfig::AdamW { .. } => OptimizerKind::AdamW,
        }
    }

    /// The values of update number `step` (counting from 1) that every group shares, gradients
    /// multiplied by `grad_scale` first.
    pub fn step_values(&self, step: u64, grad_scale: f32) -> StepValues {
        let mut values = StepValues {
            bias1: 1.0,
            step,
            lr: self.lr(),
            weight_decay: self.weight_decay(),
            beta1: 0.0,
            beta2: 0.0,
            eps: 0.0,
            sqrt_bias2: 1.0,
            grad_scale,
            skip: 0,
        };
        if let OptimizerConfig::AdamW {
            beta1, beta2, eps, ..
        } = *self
        {
            values.beta1 = beta1;
            values.beta2 = beta2;
            values.eps = eps;
            (values.bias1, values.sqrt_bias2) = bias_corrections(beta1, beta2, step);
        }
        values
    }
}

/// AdamW's `1 - beta1^t` and `sqrt(1 - beta2^t)` (as f32) at update `t`: for SGD, whose betas
/// are 0, 1 and 1 from `t = 1`. What a backend recomputes on the device where steps were skipped
/// there ([`crate::Backend::correct_step_values`]), operation for operation.
pub fn bias_corrections(beta1: f32, beta2: f32, t: u64) -> (f64, f32) {
    let t = t.min(i32::MAX as u64) as u32;
    let bias2 = 1.0 - powi(f64::from(beta2), t);
    (1.0 - powi(f64::from(beta1), t), bias2.sqrt() as f32)
}

/// `x^n` by repeated squaring, the multiplications in the order of `f64::powi` (compiler-rt's
/// `__powidf2`): spelled out, so that a kernel can repeat it bit for bit.
fn powi(mut x: f64, mut n: u32) -> f64 {
    let mut r = 1.0;
    loop {
        if n & 1 == 1 {
            r *= x;
        }
        n /= 2;
        if n == 0 {
            return r;
        }
        x *= x;
    }
}

/// Which optimizer runs: the kernel a backend launches. The numbers it uses come from the step's
/// [`StepValues`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptimizerKind {
    Sgd,
    AdamW,
}

/// What changes from one optimizer step to the next, shared by every group: the kernels read it
/// from device memory, where the engine writes it on the compute stream before the step's first
/// update, so that no launch of an update bakes in a step's numbers (a captured step reads each
/// replay's own). Laid out as the kernels' `StepValues`.
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub struct StepValues {
    /// `1 - beta1^t` (AdamW; 1 for SGD).
    pub bias1: f64,
    /// The update's number `t`, counting from 1: the moments' rounding seed comes from it.
    pub step: u64,
    pub lr: f32,
    pub weight_decay: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// `sqrt(1 - beta2^t)` (AdamW; 1 for SGD).
    pub sqrt_bias2: f32,
    /// Gradients are multiplied by this first (the clipping coefficient, else 1).
    pub grad_scale: f32,
    /// Nonzero where the device decided to skip the step
    /// ([`crate::Engine::skip_nonfinite_on_device`]): every update leaves its shard, master and
    /// moments as they are.
    pub skip: u32,
}

// SAFETY: `repr(C)`, every field plain data of any bit pattern, and no padding: 8 + 8 + 8 * 4
// bytes, a multiple of the 8-byte alignment.
unsafe impl bytemuck::Zeroable for StepValues {}
// SAFETY: as above.
unsafe impl bytemuck::Pod for StepValues {}

/// Bytes of [`StepValues`] in device memory.
pub const STEP_VALUES_BYTES: usize = std::mem::size_of::<StepValues>();

// The kernels' `StepValues` asserts the same layout.
const _: () = assert!(
    STEP_VALUES_BYTES == 48
        && std::mem::offset_of!(StepValues, step) == 8
        && std::mem::offset_of!(StepValues, lr) == 16
        && std::mem::offset_of!(StepValues, eps) == 32
        && std::mem::offset_of!(StepValues, sqrt_bias2) == 36
        && std::mem::offset_of!(StepValues, grad_scale) == 40
        && std::mem::offset_of!(StepValues, skip) == 44
);

/// What sets one group's update apart, the same every step: its learning-rate scale and whether
/// weight decay applies.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupUpdate {
    pub lr_scale: f32,
    pub decay: bool,
}

impl GroupUpdate {
    /// The group's coefficients of the step `values` describe, operation for operation as the
    /// kernels compute them from the same values.
    pub fn coefficients(&self, kind: OptimizerKind, values: &StepValues) -> Update {
        let lr = values.lr * self.lr_scale;
        let weight_decay = if self.decay { values.weight_decay } else { 0.0 };
        match kind {
            OptimizerKind::Sgd => Update::Sgd {
                lr,
                weight_decay,
                grad_scale: values.grad_scale,
            },
            OptimizerKind::AdamW => {
                let lr = f64::from(lr);
                let (b1, b2) = (f64::from(values.beta1), f64::from(values.beta2));
                Update::AdamW(AdamwCoefficients {
                    decay: (1.0 - lr * f64::from(weight_decay)) as f32,
                    beta1: values.beta1,
                    one_minus_beta1: (1.0 - b1) as f32,
                    beta2: values.beta2,
                    one_minus_beta2: (1.0 - b2) as f32,
                    step_size: (lr / values.bias1) as f32,
                    sqrt_bias2: values.sqrt_bias2,
                    eps: values.eps,
                    grad_scale: values.grad_scale,
                })
            }
        }
    }
}

/// How one parameter group steps: its learning-rate scale, whether weight decay applies, and the
/// factor its gradients are multiplied by first.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupSettings {
    pub lr_scale: f32,
    pub decay: bool,
    pub grad_scale: f32,
}

impl Default for GroupSettings {
    /// The engine's learning rate, weight decay on, gradients as they are.
    fn default() -> GroupSettings {
        GroupSettings {
            lr_scale: 1.0,
            decay: true,
            grad_scale: 1.0,
        }
    }
}

/// A learning rate that changes with the step: the engine's learning rate times
/// [`LrSchedule::factor`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrSchedule {
    Constant,
    /// A linear warmup from `1 / warmup_steps` to 1 over `warmup_steps` steps, then a cosine
    /// decay to `min_factor` over the remaining steps to `total_steps`, as PyTorch's
    /// `SequentialLR([LinearLR(start_factor=1/warmup_steps, total_iters=warmup_steps),
    /// CosineAnnealingLR(T_max=total_steps - warmup_steps, eta_min=min_factor * lr)],
    /// milestones=[warmup_steps])`.
    WarmupCosine {
        warmup_steps: u64,
        total_steps: u64,
        min_factor: f32,
    },
}

impl LrSchedule {
    /// The factor of step `step` (counting from 0); past `total_steps`, `min_factor`.
    pub fn factor(&self, step: u64) -> f32 {
        match *self {
            LrSchedule::Constant => 1.0,
            LrSchedule::WarmupCosine {
                warmup_steps,
                total_steps,
                min_factor,
            } => {
                if step < warmup_steps {
                    let start = 1.0 / warmup_steps as f64;
                    return (start + (1.0 - start) * step as f64 / warmup_steps as f64) as f32;
                }
                let span = total_steps.saturating_sub(warmup_steps).max(1);
                let progress = (step - warmup_steps).min(span) as f64 / span as f64;
                let min = f64::from(min_factor);
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
                (min + (1.0 - min) * cosine) as f32
            }
        }
    }
}

/// One group's coefficients of one step ([`GroupUpdate::coefficients`]), as each update computes
/// them from the step's [`StepValues`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Update {
    Sgd {
        lr: f32,
        weight_decay: f32,
        grad_scale: f32,
    },
    AdamW(AdamwCoefficients),
}

/// AdamW's coefficients of one group and step, as the kernels compute them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamwCoefficients {
    /// `1 - lr * weight_decay`.
    pub decay: f32,
    pub beta1: f32,
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    /// `lr / (1 - beta1^t)`.
    pub step_size: f32,
    /// `sqrt(1 - beta2^t)`.
    pub sqrt_bias2: f32,
    pub eps: f32,
    /// Gradients are multiplied by this first (the clipping coefficient, else 1).
    pub grad_scale: f32,
}

/// One element of AdamW: returns the new `(param, m, v)`.
#[inline]
pub fn adamw_element(p: f32, m: f32, v: f32, g: f32, c: &AdamwCoefficients) -> (f32, f32, f32) {
    let g = g * c.grad_scale;
    let p = p * c.decay;
    let m = c.beta1 * m + c.one_minus_beta1 * g;
    let v = c.beta2 * v + (c.one_minus_beta2 * g) * g;
    let denom = v.sqrt() / c.sqrt_bias2 + c.eps;
    (p - c.step_size * (m / denom), m, v)
}

/// How AdamW's moments are stored between steps. The update always computes them in f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MomentStorage {
    F32,
    /// bf16, each new moment rounded stochastically (up with the probability of its distance
    /// from the value below): unbiased, so that the second moment still moves when
    /// `(1 - beta2) * g^2` is below half a bf16 step of it, where rounding to nearest would stall
    /// it. The random bits are a hash of the step's seed ([`moment_seed`] of the step's number
    /// in [`StepValues`] and `group`) and the element's index in the group's layout
    /// (`first_index` + its index in the shard), so every backend and the reference round alike.
    Bf16Stochastic {
        group: u32,
        first_index: u64,
    },
}

impl MomentStorage {
    /// The element type the moments are stored in.
    pub fn dtype(self) -> DType {
        match self {
            MomentStorage::F32 => DType::F32,
            MomentStorage::Bf16Stochastic { .. } => DType::Bf16,
        }
    }
}

/// One round of a 32-bit integer hash (lowbias32).
#[inline]
fn mix(x: u32) -> u32 {
    let x = (x ^ (x >> 16)).wrapping_mul(0x7feb_352d);
    let x = (x ^ (x >> 15)).wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// The seed of the moments' rounding of optimizer step `step` (1-based) of group `group`.
pub fn moment_seed(step: u64, group: usize) -> u32 {
    mix((step as u32) ^ mix(((step >> 32) as u32) ^ mix(group as u32 ^ 0x9e37_79b9)))
}

/// The random bits of moment `which` (0: first, 1: second) of the element at `index`.
#[inline]
pub fn rounding_bits(seed: u32, index: u64, which: u32) -> u32 {
    mix(seed ^ mix((index as u32) ^ mix(((index >> 32) as u32) ^ which)))
}

/// `x` rounded to bf16 stochastically with the random `bits` (their low 16 are used): the bits
/// below bf16's are added to before they are cut off. Infinities and NaN round to nearest.
#[inline]
pub fn bf16_stochastic(x: f32, bits: u32) -> u16 {
    if !x.is_finite() {
        return half::bf16::from_f32(x).to_bits();
    }
    (x.to_bits().wrapping_add(bits & 0xFFFF) >> 16) as u16
}

/// One element of SGD: the gradient (times `grad_scale`) plus `weight_decay * p` (none at all
/// when it is 0, as `torch.optim.SGD` skips the term), times `lr`, off the parameter.
#[inline]
pub fn sgd_element(p: f32, g: f32, lr: f32, weight_decay: f32, grad_scale: f32) -> f32 {
    let g = g * grad_scale;
    let d = if weight_decay != 0.0 {
        g + weight_decay * p
    } else {
        g
    };
    p - lr * d
}

/// One element of a gradient or shard accumulation: `dst = scale * src` or `dst + scale * src`.
#[inline]
pub fn accumulate_element(dst: f32, src: f32, scale: f32, add: bool) -> f32 {
    if add { dst + scale * src } else { scale * src }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn powers_by_squaring_are_the_standard_library_s_bit_for_bit() {
        for beta in [0.9f32, 0.95, 0.98, 0.99, 0.999, 0.9999, 0.5, 0.1, 0.0] {
            let x = f64::from(beta);
            for n in (0..5000).chain([65_535, 65_536, 1 << 20, 1 << 20 | 1, i32::MAX as u32]) {
                let n = std::hint::black_box(n);
                assert_eq!(
                    powi(x, n).to_bits(),
                    x.powi(n as i32).to_bits(),
                    "{beta}^{n}"
                );
            }
        }
    }

    #[test]
    fn stochastic_bf16_rounding_is_unbiased_and_one_step_wide() {
        // (1 - beta2) * g^2 far below half a bf16 step of v: rounding to nearest never moves v.
        let v = 1.0f32;
        let updated = 0.999 * v + 0.001 * 1.5;
        assert_eq!(
            half::bf16::from_f32(updated).to_f32(),
            1.0,
            "nearest stalls"
        );
        let (down, up) = (1.0f32, f32::from_bits(1.0f32.to_bits() + 0x1_0000));
        let seed = moment_seed(7, 3);
        let mut sum = 0f64;
        let n = 1 << 16;
        for i in 0..n {
            let r = half::bf16::from_bits(bf16_stochastic(updated, rounding_bits(seed, i, 1)));
            let r = r.to_f32();
            assert!(r == down || r == up, "{r}");
            sum += f64::from(r);
        }
        let mean = sum / n as f64;
        assert!(
            (mean - f64::from(updated)).abs() < 3e-5,
            "{mean} against {updated}"
        );
        // Exact values stay exact; negative ones round in magnitude the same way.
        assert_eq!(
            bf16_stochastic(-0.75, u32::MAX),
            half::bf16::from_f32(-0.75).to_bits()
        );
        assert_eq!(
            bf16_stochastic(f32::INFINITY, 0x1234),
            half::bf16::INFINITY.to_bits()
        );
        assert!(half::bf16::from_bits(bf16_stochastic(f32::NAN, 7)).is_nan());
        // Different steps, groups, elements and moments draw different bits.
        assert_ne!(moment_seed(1, 0), moment_seed(2, 0));
        assert_ne!(moment_seed(1, 0), moment_seed(1, 1));
        assert_ne!(rounding_bits(seed, 0, 0), rounding_bits(seed, 0, 1));
        assert_ne!(rounding_bits(seed, 0, 0), rounding_bits(seed, 1 << 32, 0));
    }

    #[test]
    fn adamw_first_step_moves_each_param_by_about_lr() {
        let cfg = OptimizerConfig::AdamW {
            lr: 0.1,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        let Update::AdamW(c) = cfg.coefficients(1, GroupSettings::default()) else {
            unreachable!()
        };
        for g in [3.0f32, -0.002, 1e4] {
            let (p, m, v) = adamw_element(1.0, 0.0, 0.0, g, &c);
            // After bias correction, m_hat / sqrt(v_hat) = sign(g).
            assert!((p - (1.0 - 0.1 * g.signum())).abs() < 1e-5, "g={g} p={p}");
            assert!((m - 0.1 * g).abs() <= 1e-6 * g.abs());
            assert!((v - 0.001 * g * g).abs() <= 1e-6 * g * g);
        }
    }

    /// The coefficients of the step values are the formulas written out whole (lr and weight
    /// decay in f64 from the f32 scaled rate, bias corrections of `powi`), bit for bit.
    #[test]
    fn coefficients_are_the_written_out_formulas() {
        let (beta1, beta2, eps) = (0.9f32, 0.95f32, 1e-8f32);
        let adamw = OptimizerConfig::AdamW {
            lr: 3e-4,
            beta1,
            beta2,
            eps,
            weight_decay: 0.1,
        };
        for step in [1u64, 2, 7, 1000, (3 << 32) + 7] {
            for (lr_scale, decay, grad_scale) in [(1.0f32, true, 1.0f32), (0.3, false, 0.625)] {
                let settings = GroupSettings {
                    lr_scale,
                    decay,
                    grad_scale,
                };
                let lr = f64::from(3e-4f32 * lr_scale);
                let weight_decay = if decay { f64::from(0.1f32) } else { 0.0 };
                let t = step.min(i32::MAX as u64) as i32;
                let expected = AdamwCoefficients {
                    decay: (1.0 - lr * weight_decay) as f32,
                    beta1,
                    one_minus_beta1: (1.0 - f64::from(beta1)) as f32,
                    beta2,
                    one_minus_beta2: (1.0 - f64::from(beta2)) as f32,
                    step_size: (lr / (1.0 - f64::from(beta1).powi(t))) as f32,
                    sqrt_bias2: (1.0 - f64::from(beta2).powi(t)).sqrt() as f32,
                    eps,
                    grad_scale,
                };
                let got = adamw.coefficients(step, settings);
                assert_eq!(got, Update::AdamW(expected), "step {step}, {settings:?}");
                let sgd = OptimizerConfig::Sgd {
                    lr: 3e-4,
                    weight_decay: 0.1,
                };
                let expected = Update::Sgd {
                    lr: 3e-4f32 * lr_scale,
                    weight_decay: if decay { 0.1 } else { 0.0 },
                    grad_scale,
                };
                assert_eq!(sgd.coefficients(step, settings), expected);
            }
        }
    }

    #[test]
    fn adamw_decay_is_decoupled() {
        let cfg = OptimizerConfig::AdamW {
            lr: 0.5,
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let Update::AdamW(c) = cfg.coefficients(3, GroupSettings::default()) else {
            unreachable!()
        };
        assert_eq!(c.decay, 0.95);
        // A zero gradient with zero moments leaves only the decay.
        assert_eq!(adamw_element(2.0, 0.0, 0.0, 0.0, &c).0, 1.9);
    }

    #[test]
    fn invalid_hyper_parameters_are_named() {
        let bad = OptimizerConfig::AdamW {
            lr: 1e-3,
            beta1: 1.0,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        };
        assert!(matches!(
            bad.validate(),
            Err(Error::InvalidConfig { field: "beta1", .. })
        ));
        let bad = OptimizerConfig::sgd(f32::NAN);
        assert!(matches!(
            bad.validate(),
            Err(Error::InvalidConfig { field: "lr", .. })
        ));
        assert!(OptimizerConfig::default().validate().is_ok());
    }
}
