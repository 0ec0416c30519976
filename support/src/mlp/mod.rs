//! The example model: a stack of dense residual layers between a tied input/output projection,
//! its CPU math, synthetic data from a fixed teacher (here), an unsharded reference trainer
//! (`reference`), and the harness that trains it sharded beside the reference (`training`).
//!
//! Layer `i` computes `h + gain_i * tanh(h W_i + b_i)`, with `gain_i` frozen. The input projection
//! `x E` and the output `h E^T + c` share `E` (tied); `c` sits outside every layer. The loss is
//! `0.5 * mean((out - y)^2)` against the teacher's output `y`, a model of the same shape with other
//! weights. Both trainers run the same functions in the same order, so a correct sharded engine
//! reproduces the reference exactly.
//!
//! With experts ([`Mlp::with_experts`]) the weight and bias of every odd layer are sharded over
//! the process group [`EXPERT_GROUP`]: each group of its ranks holds its own copy of them (other
//! values from the start, [`Mlp::copy_init`]), trained on its ranks' micro-batches only.

use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc;

use fsdp_fusion::engine::GradNorm;
use fsdp_fusion::optim::{
    GroupSettings, LrSchedule, Update, accumulate_element, adamw_element, bf16_stochastic,
    moment_seed, rounding_bits, sgd_element,
};
use fsdp_fusion::{
    Accumulation, Backend, Communicator, Counters, CpuBackend, DType, Engine, EngineConfig, Error,
    Input, LocalComm, MemoryUsage, ModelSpec, OptimizerConfig, ParamId, ParamSpec, Plan,
    ProcessGroupSpec, Result, Unit,
};

/// The process group of the example model's expert parameters.
pub const EXPERT_GROUP: &str = "experts";

mod captured;
mod pass;
mod reference;
mod training;

pub use captured::CapturedSteps;
pub use pass::{PassRunner, PassState, Stage};
pub use reference::Reference;
pub use training::{
    Checkpoints, Comparison, RankStep, RankSteps, RankSummary, Training, assemble, assemble_copy,
};

use crate::rng::Rng;
use crate::values::{max_relative_difference, narrow, round_to, widen};

/// The shape of the example model and of its data.
#[derive(Clone, Debug, PartialEq)]
pub struct MlpConfig {
    pub layers: usize,
    pub width: usize,
    /// Width of the input and of the output.
    pub inputs: usize,
    /// Rows of each rank's micro-batch.
    pub batch: usize,
    pub dtype: DType,
    pub seed: u64,
    /// The embedding's learning-rate scale (biases and gains are exempt from weight decay).
    pub embed_lr_scale: f32,
}

impl MlpConfig {
    /// A model small enough for a test to save and load many times: 3 layers of `width`, 12
    /// inputs, micro-batches of 5 rows, seed 11, the embedding at half the learning rate.
    pub fn small(dtype: DType, width: usize) -> MlpConfig {
        MlpConfig {
            layers: 3,
            width,
            inputs: 12,
            batch: 5,
            dtype,
            seed: 11,
            embed_lr_scale: 0.5,
        }
    }
}

impl Default for MlpConfig {
    fn default() -> MlpConfig {
        MlpConfig {
            layers: 4,
            width: 64,
            inputs: 32,
            batch: 16,
            dtype: DType::F32,
            seed: 7,
            embed_lr_scale: 1.0,
        }
    }
}

/// The example model's parameters, by id.
#[derive(Clone, Copy, Debug)]
pub struct MlpParams {
    layers: usize,
}

impl MlpParams {
    pub fn embed(&self) -> ParamId {
        ParamId(0)
    }
    pub fn weight(&self, layer: usize) -> ParamId {
        ParamId(1 + 3 * layer)
    }
    pub fn bias(&self, layer: usize) -> ParamId {
        ParamId(2 + 3 * layer)
    }
    pub fn gain(&self, layer: usize) -> ParamId {
        ParamId(3 + 3 * layer)
    }
    pub fn head_bias(&self) -> ParamId {
        ParamId(1 + 3 * self.layers)
    }
}

/// `c = op(a) op(b)`, `op(a)` being `m x k` and `op(b)` `k x n`, all row-major.
fn matmul(a: &[f32], ta: bool, b: &[f32], tb: bool, m: usize, k: usize, n: usize) -> Vec<f32> {
    assert!(a.len() == m * k && b.len() == k * n, "matmul shapes");
    let mut c = vec![0f32; m * n];
    let (rsa, csa) = if ta { (1, m as isize) } else { (k as isize, 1) };
    let (rsb, csb) = if tb { (1, k as isize) } else { (n as isize, 1) };
    // SAFETY: a holds m*k, b k*n and c m*n elements, and the strides stay inside them.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa,
            csa,
            b.as_ptr(),
            rsb,
            csb,
            0.0,
            c.as_mut_ptr(),
            n as isize,
            1,
        );
    }
    c
}

fn sum_rows(x: &[f32], cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; cols];
    for row in x.chunks_exact(cols) {
        for (o, v) in out.iter_mut().zip(row) {
            *o += v;
        }
    }
    out
}

/// What a trainer's pass needs from whoever holds the parameters.
pub trait Params {
    /// Before or after a unit's forward or backward.
    fn hook(&mut self, hook: Hook, unit: Unit) -> Result<()>;
    /// The current value of a parameter, widened to f32.
    fn value(&mut self, param: ParamId) -> Result<Vec<f32>>;
    /// A parameter's gradient for this pass.
    fn grad(&mut self, param: ParamId, grad: &[f32]) -> Result<()>;
    /// Several parameters' gradients at once, as [`Params::grad`] on each in order.
    fn grads(&mut self, grads: &[(ParamId, &[f32])]) -> Result<()> {
        grads
            .iter()
            .try_for_each(|&(param, grad)| self.grad(param, grad))
    }
}

/// The hook points of a pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hook {
    PreForward,
    PostForward,
    PreBackward,
    PostBackward,
}

/// The example model.
#[derive(Clone, Debug)]
pub struct Mlp {
    pub config: MlpConfig,
    pub ids: MlpParams,
    /// The size of the expert process group, if the model has experts.
    pub experts: Option<usize>,
}

impl Mlp {
    pub fn new(config: MlpConfig) -> Mlp {
        let ids = MlpParams {
            layers: config.layers,
        };
        Mlp {
            config,
            ids,
            experts: None,
        }
    }

    /// The model with the weight and bias of every odd layer sharded over groups of `size`
    /// ranks of [`EXPERT_GROUP`], a copy per group.
    pub fn with_experts(config: MlpConfig, size: usize) -> Mlp {
        Mlp {
            experts: Some(size),
            ..Mlp::new(config)
        }
    }

    /// Whether `param` is an expert parameter: one copy per group of expert ranks.
    pub fn is_expert(&self, param: ParamId) -> bool {
        self.experts.is_some()
            && (0..self.config.layers)
                .filter(|l| l % 2 == 1)
                .any(|l| param == self.ids.weight(l) || param == self.ids.bias(l))
    }

    /// The copy of the expert parameters that rank `rank` holds (0 without experts).
    pub fn copy_of(&self, rank: usize) -> usize {
        self.experts.map_or(0, |size| rank / size)
    }

    /// The initial values of copy `copy` from `init`: the expert parameters' elements rotated
    /// by `7 * copy` places, the others as they are.
    pub fn copy_init(&self, init: &[Vec<f32>], copy: usize) -> Vec<Vec<f32>> {
        init.iter()
            .enumerate()
            .map(|(i, v)| {
                let mut v = v.clone();
                if self.is_expert(ParamId(i)) && !v.is_empty() {
                    let by = 7 * copy % v.len();
                    v.rotate_left(by);
                }
                v
            })
            .collect()
    }

    /// The declared parameters, in id order.
    pub fn spec(&self) -> Result<ModelSpec> {
        let c = &self.config;
        let (w, d) = (c.width as u64, c.dtype);
        let mut params = vec![
            ParamSpec::new("embed", &[c.inputs as u64, w], d)
                .tied()
                .with_lr_scale(c.embed_lr_scale),
        ];
        for i in 0..c.layers {
            let u = i as u32;
            params.push(ParamSpec::new(format!("layers.{i}.weight"), &[w, w], d).in_unit(u));
            params.push(
                ParamSpec::new(format!("layers.{i}.bias"), &[w], d)
                    .in_unit(u)
                    .no_weight_decay(),
            );
            params.push(
                ParamSpec::new(format!("layers.{i}.gain"), &[w], d)
                    .in_unit(u)
                    .frozen(),
            );
        }
        params.push(ParamSpec::new("head.bias", &[c.inputs as u64], d).no_weight_decay());
        let Some(size) = self.experts else {
            return ModelSpec::new(params);
        };
        let params = params
            .into_iter()
            .enumerate()
            .map(|(i, p)| match self.is_expert(ParamId(i)) {
                true => p.in_process_group(EXPERT_GROUP),
                false => p,
            })
            .collect();
        ModelSpec::with_process_groups(
            params,
            vec![ProcessGroupSpec {
                name: EXPERT_GROUP.into(),
                size,
            }],
        )
    }

    /// Initial values from `seed`, in id order, before rounding to the dtype.
    pub fn init(&self, seed: u64) -> Vec<Vec<f32>> {
        let c = &self.config;
        let mut rng = Rng::new(seed);
        let mut out = vec![rng.fill(c.inputs * c.width, 1.0 / (c.inputs as f32).sqrt())];
        for _ in 0..c.layers {
            out.push(rng.fill(c.width * c.width, 1.0 / (c.width as f32).sqrt()));
            out.push(rng.fill(c.width, 0.1));
            out.push((0..c.width).map(|_| 0.5 + 0.25 * rng.uniform()).collect());
        }
        out.push(rng.fill(c.inputs, 0.1));
        out
    }

    /// Rank `rank`'s micro-batch `pass` of step `step`: inputs and the teacher's outputs.
    pub fn batch(&self, step: u64, pass: u64, rank: usize) -> Result<(Vec<f32>, Vec<f32>)> {
        let c = &self.config;
        let mut rng = Rng::new(c.seed ^ (step << 32) ^ (pass << 16) ^ rank as u64);
        let x = rng.fill(c.batch * c.inputs, 1.0);
        let mut teacher = TeacherParams(self.init(c.seed.wrapping_add(1)));
        let y = self.forward(&mut teacher, &x)?;
        Ok((x, y))
    }

    /// The model's output for inputs `x`, with no hooks and no gradients.
    fn forward(&self, params: &mut impl Params, x: &[f32]) -> Result<Vec<f32>> {
        let c = &self.config;
        let (b, n, w) = (c.batch, c.inputs, c.width);
        let embed = params.value(self.ids.embed())?;
        let mut h = matmul(x, false, &embed, false, b, n, w);
        for i in 0..c.layers {
            h = self.layer(params, i, &h)?.1;
        }
        self.head(params, &embed, &h)
    }

    fn layer(&self, params: &mut impl Params, i: usize, h: &[f32]) -> Result<(Vec<f32>, Vec<f32>)> {
        let weight = params.value(self.ids.weight(i))?;
        let bias = params.value(self.ids.bias(i))?;
        let gain = params.value(self.ids.gain(i))?;
        Ok(layer_values(self.shape(), h, [&weight, &bias, &gain]))
    }

    fn head(&self, params: &mut impl Params, embed: &[f32], h: &[f32]) -> Result<Vec<f32>> {
        let bias = params.value(self.ids.head_bias())?;
        Ok(head_values(self.shape(), h, embed, &bias))
    }

    /// The sizes its math needs.
    fn shape(&self) -> Shape {
        let c = &self.config;
        Shape {
            batch: c.batch,
            inputs: c.inputs,
            width: c.width,
            layers: c.layers,
        }
    }
}

/// The sizes of the example model's math.
#[derive(Clone, Copy, Debug)]
struct Shape {
    batch: usize,
    inputs: usize,
    width: usize,
    layers: usize,
}

/// A layer's activation `tanh(h W + b)` and its output `h + gain * activation`, from `h` and
/// the layer's weight, bias and gain.
fn layer_values(s: Shape, h: &[f32], [weight, bias, gain]: [&[f32]; 3]) -> (Vec<f32>, Vec<f32>) {
    let (b, w) = (s.batch, s.width);
    let mut a = matmul(h, false, weight, false, b, w, w);
    for row in a.chunks_exact_mut(w) {
        for (z, bj) in row.iter_mut().zip(bias) {
            *z = (*z + bj).tanh();
        }
    }
    let mut out = h.to_vec();
    for (row_out, row_a) in out.chunks_exact_mut(w).zip(a.chunks_exact(w)) {
        for j in 0..w {
            row_out[j] += gain[j] * row_a[j];
        }
    }
    (a, out)
}

/// The model's output `h E^T + c`.
fn head_values(s: Shape, h: &[f32], embed: &[f32], bias: &[f32]) -> Vec<f32> {
    let mut out = matmul(h, false, embed, true, s.batch, s.width, s.inputs);
    for row in out.chunks_exact_mut(s.inputs) {
        for (o, bj) in row.iter_mut().zip(bias) {
            *o += bj;
        }
    }
    out
}

/// The teacher's parameters: values only.
struct TeacherParams(Vec<Vec<f32>>);

impl Params for TeacherParams {
    fn hook(&mut self, _: Hook, _: Unit) -> Result<()> {
        Ok(())
    }
    fn value(&mut self, param: ParamId) -> Result<Vec<f32>> {
        Ok(self.0[param.0].clone())
    }
    fn grad(&mut self, _: ParamId, _: &[f32]) -> Result<()> {
        Ok(())
    }
}

/// A rank's engine as the trainer's parameter holder.
pub struct EngineParams<'a, B: Backend, C: Communicator<B>>(pub &'a mut Engine<B, C>);

impl<B: Backend, C: Communicator<B>> Params for EngineParams<'_, B, C> {
    fn hook(&mut self, hook: Hook, unit: Unit) -> Result<()> {
        match hook {
            Hook::PreForward => self.0.pre_forward(unit),
            Hook::PostForward => self.0.post_forward(unit),
            Hook::PreBackward => self.0.pre_backward(unit),
            Hook::PostBackward => self.0.post_backward(unit),
        }
    }
    fn value(&mut self, param: ParamId) -> Result<Vec<f32>> {
        let dtype = self.0.plan().param(param)?.dtype();
        Ok(widen(dtype, &self.0.param_bytes(param)?))
    }
    fn grad(&mut self, param: ParamId, grad: &[f32]) -> Result<()> {
        self.0.grad(param, Input::host(grad))
    }
    fn grads(&mut self, grads: &[(ParamId, &[f32])]) -> Result<()> {
        let mut batch = Vec::with_capacity(grads.len());
        batch.extend(
            grads
                .iter()
                .map(|&(param, grad)| (param, Input::host(grad))),
        );
        self.0.grads(&batch)
    }
}

/// Loads the model's initial values into a rank's engine.
pub fn load<B: Backend, C: Communicator<B>>(
    engine: &mut Engine<B, C>,
    values: &[Vec<f32>],
) -> Result<()> {
    for (i, v) in values.iter().enumerate() {
        let id = ParamId(i);
        let dtype = engine.plan().param(id)?.dtype();
        let bytes = narrow(dtype, v);
        engine.load_param(id, Input::host_bytes(&bytes, dtype))?;
    }
    Ok(())
}

/// What a run sets beyond the engine's configuration: the learning-rate schedule (of the
/// configured learning rate) and the gradient clipping.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Recipe {
    pub schedule: LrSchedule,
    /// Clip the whole gradient's 2-norm to this.
    pub clip: Option<f32>,
}

impl Default for Recipe {
    fn default() -> Recipe {
        Recipe {
            schedule: LrSchedule::Constant,
            clip: None,
        }
    }
}

/// One sharded training step on a rank: the step's learning rate, `passes` micro-batches,
/// gradient sync, the gradient norm (clipped under the recipe), optimizer step. Returns the mean
/// loss of the rank's micro-batches and the gradient norm before clipping (NaN where the engine
/// steps in the backward, which refuses the norm).
pub fn sharded_step<B: Backend, C: Communicator<B>>(
    model: &Mlp,
    engine: &mut Engine<B, C>,
    (step, passes): (u64, u64),
    base_lr: f32,
    recipe: Recipe,
) -> Result<(f32, GradNorm)> {
    // Each rank of the grid takes its own micro-batches: replica by replica, rank by rank.
    let rank = engine.replica().index * engine.plan().world_size() + engine.rank();
    engine.set_lr(base_lr * recipe.schedule.factor(step))?;
    let mut loss = 0.0;
    for pass in 0..passes {
        let (x, y) = model.batch(step, pass, rank)?;
        loss += model.pass(&mut EngineParams(engine), &x, &y)?;
    }
    engine.finish_grad_sync()?;
    let norm = step_norm(engine, recipe)?;
    engine.optimizer_step()?;
    engine.end_step()?;
    Ok((loss / passes as f32, norm))
}

/// The synced gradients' norm before clipping, clipped under the recipe (NaN where the engine
/// steps in the backward, which refuses the norm).
fn step_norm<B: Backend, C: Communicator<B>>(
    engine: &mut Engine<B, C>,
    recipe: Recipe,
) -> Result<GradNorm> {
    match (recipe.clip, engine.config().step_in_backward) {
        (Some(max), _) => engine.clip_grad_norm(max),
        (None, true) => Ok(GradNorm {
            l2: f32::NAN,
            max: f32::NAN,
        }),
        (None, false) => engine.grad_norm(),
    }
}

/// The arithmetic of the engine's gradient path, element by element: each rank's gradient in
/// the transport's dtype, scaled and summed in rank order, the sum rounded to the transport's
/// dtype; with accumulators, each rank's passes summed in fp32 first. Under hybrid sharding
/// each replica's ranks are summed so, then the replicas' sums, in replica order, rounded once.
#[derive(Clone, Copy, Debug)]
pub struct GradPath {
    /// The reduction's factor on each rank's gradient.
    pub scale: f32,
    /// Ranks per replica: the ranks summed before the replicas are.
    pub shard_size: usize,
    /// The transport's dtype; f32 at world size 1, where nothing travels.
    pub transport: DType,
    /// Whether the passes accumulate before one reduction (no-sync).
    pub accumulate: bool,
}

impl GradPath {
    /// The path `config` gives gradients at `world_size` ranks.
    pub fn of(config: &EngineConfig, world_size: usize) -> GradPath {
        GradPath::hybrid(config, 1, world_size)
    }

    /// The path of hybrid sharding, `replicas` of `shard_size` ranks.
    pub fn hybrid(config: &EngineConfig, replicas: usize, shard_size: usize) -> GradPath {
        let ranks = replicas * shard_size;
        GradPath {
            scale: config.grad_reduction.scale(ranks),
            shard_size,
            transport: if ranks == 1 {
                DType::F32
            } else {
                config.reduce_dtype
            },
            accumulate: config.accumulation == Accumulation::NoSync,
        }
    }

    /// `grads[pass][rank]`, one parameter's, combined as the engine combines them.
    fn combine(&self, grads: &[Vec<Vec<f32>>]) -> Vec<f32> {
        let within = |per_rank: &[Vec<f32>]| -> Vec<f32> {
            let mut sum: Vec<f32> = Vec::new();
            for g in per_rank {
                let g = round_to(self.transport, g);
                if sum.is_empty() {
                    sum = g.iter().map(|&g| self.scale * g).collect();
                } else {
                    sum.iter_mut()
                        .zip(g)
                        .for_each(|(s, g)| *s = accumulate_element(*s, g, self.scale, true));
                }
            }
            round_to(self.transport, &sum)
        };
        let reduce = |per_rank: &[Vec<f32>]| -> Vec<f32> {
            let replicas: Vec<Vec<f32>> = per_rank.chunks(self.shard_size).map(within).collect();
            match replicas.as_slice() {
                [one] => one.clone(),
                _ => {
                    let mut total = replicas[0].clone();
                    for replica in &replicas[1..] {
                        total.iter_mut().zip(replica).for_each(|(t, r)| *t += r);
                    }
                    round_to(self.transport, &total)
                }
            }
        };
        let add_up = |parts: &mut dyn Iterator<Item = Vec<f32>>| -> Vec<f32> {
            let mut total: Vec<f32> = Vec::new();
            for part in parts {
                if total.is_empty() {
                    total = part;
                } else {
                    total.iter_mut().zip(part).for_each(|(t, p)| *t += p);
                }
            }
            total
        };
        if self.accumulate {
            let ranks = grads.first().map_or(0, Vec::len);
            let per_rank: Vec<Vec<f32>> = (0..ranks)
                .map(|r| add_up(&mut grads.iter().map(|pass| pass[r].clone())))
                .collect();
            reduce(&per_rank)
        } else {
            add_up(&mut grads.iter().map(|pass| reduce(pass)))
        }
    }
}
