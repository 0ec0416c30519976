//! One forward and backward pass of the example model as stages between the hooks: each stage
//! reads some parameters' values and the pass's state, and gives some parameters' gradients. A
//! [`PassRunner`] runs them: at once on the host ([`Mlp::pass`]), or as work queued on a stream
//! (`captured`), so that both compute the same values by the same functions.

use super::*;

/// What a pass's stages read and leave: its micro-batch, its activations, the backward's values
/// and the loss.
#[derive(Clone, Debug, Default)]
pub struct PassState {
    pub x: Vec<f32>,
    pub y: Vec<f32>,
    /// Each layer's input, then the last layer's output.
    hs: Vec<Vec<f32>>,
    /// Each layer's activation.
    acts: Vec<Vec<f32>>,
    /// The loss's gradient by the model's output.
    dout: Vec<f32>,
    /// The loss's gradient by the output of the layer the backward reached.
    dh: Vec<f32>,
    /// The embedding's gradient through the output projection.
    d_embed: Vec<f32>,
    pub loss: f32,
}

impl PassState {
    /// A pass's state before its first stage: its micro-batch.
    pub fn new(x: Vec<f32>, y: Vec<f32>) -> PassState {
        PassState {
            x,
            y,
            ..PassState::default()
        }
    }
}

/// A stage: from the pass's state and the values of the parameters it reads (in order, widened
/// to f32), the gradients it gives (in order).
pub type Stage = Arc<dyn Fn(&mut PassState, &[Vec<f32>]) -> Vec<Vec<f32>> + Send + Sync>;

/// Whoever runs a pass's hooks and stages.
pub trait PassRunner {
    /// Before or after a unit's forward or backward.
    fn hook(&mut self, hook: Hook, unit: Unit) -> Result<()>;
    /// Runs `stage` on the values of `reads`, then hands over the gradients it gives, one for
    /// each of `grads` (several in one call).
    fn stage(&mut self, reads: &[ParamId], grads: &[ParamId], stage: Stage) -> Result<()>;
}

impl Mlp {
    /// One forward and backward pass on a micro-batch, with every hook; returns the loss.
    pub fn pass(&self, params: &mut impl Params, x: &[f32], y: &[f32]) -> Result<f32> {
        let state = PassState::new(x.to_vec(), y.to_vec());
        let mut runner = HostRunner { params, state };
        self.run_pass(&mut runner)?;
        Ok(runner.state.loss)
    }

    /// One forward and backward pass on the micro-batch of `runner`'s state, with every hook;
    /// the loss is left in the state.
    pub fn run_pass(&self, runner: &mut impl PassRunner) -> Result<()> {
        let (s, ids) = (self.shape(), self.ids);
        let (b, n, w) = (s.batch, s.inputs, s.width);

        runner.hook(Hook::PreForward, Unit::Root)?;
        let embed_input: Stage = Arc::new(move |p, v| {
            p.hs = vec![matmul(&p.x, false, &v[0], false, b, n, w)];
            p.acts.clear();
            Vec::new()
        });
        runner.stage(&[ids.embed()], &[], embed_input)?;
        runner.hook(Hook::PostForward, Unit::Root)?;
        for i in 0..s.layers {
            let unit = Unit::Layer(i as u32);
            runner.hook(Hook::PreForward, unit)?;
            let layer: Stage = Arc::new(move |p, v| {
                let (a, h) = layer_values(s, &p.hs[i], [&v[0], &v[1], &v[2]]);
                p.acts.push(a);
                p.hs.push(h);
                Vec::new()
            });
            runner.stage(&[ids.weight(i), ids.bias(i), ids.gain(i)], &[], layer)?;
            runner.hook(Hook::PostForward, unit)?;
        }
        runner.hook(Hook::PreForward, Unit::Root)?;
        let head: Stage = Arc::new(move |p, v| {
            let out = head_values(s, &p.hs[s.layers], &v[0], &v[1]);
            (p.dout, p.loss) = loss_and_gradient(&out, &p.y);
            Vec::new()
        });
        runner.stage(&[ids.embed(), ids.head_bias()], &[], head)?;
        runner.hook(Hook::PostForward, Unit::Root)?;

        runner.hook(Hook::PreBackward, Unit::Root)?;
        let head_backward: Stage = Arc::new(move |p, v| {
            p.d_embed = matmul(&p.dout, true, &p.hs[s.layers], false, n, b, w);
            p.dh = matmul(&p.dout, false, &v[0], false, b, n, w);
            vec![sum_rows(&p.dout, n)]
        });
        runner.stage(&[ids.embed()], &[ids.head_bias()], head_backward)?;
        runner.hook(Hook::PostBackward, Unit::Root)?;
        for i in (0..s.layers).rev() {
            let unit = Unit::Layer(i as u32);
            runner.hook(Hook::PreBackward, unit)?;
            let backward: Stage = Arc::new(move |p, v| layer_backward(s, p, i, &v[0], &v[1]));
            // A layer's gradients in one call: an engine takes them as a batch.
            let grads = [ids.weight(i), ids.bias(i)];
            runner.stage(&[ids.weight(i), ids.gain(i)], &grads, backward)?;
            runner.hook(Hook::PostBackward, unit)?;
        }
        let embed_grad: Stage = Arc::new(move |p, _| {
            let from_input = matmul(&p.x, true, &p.dh, false, n, b, w);
            for (d, v) in p.d_embed.iter_mut().zip(from_input) {
                *d += v;
            }
            vec![std::mem::take(&mut p.d_embed)]
        });
        runner.stage(&[], &[ids.embed()], embed_grad)
    }
}

/// The gradient of `0.5 * mean((out - y)^2)` by `out`, and the loss.
fn loss_and_gradient(out: &[f32], y: &[f32]) -> (Vec<f32>, f32) {
    let count = out.len() as f32;
    let mut loss = 0f32;
    let dout = out
        .iter()
        .zip(y)
        .map(|(o, t)| {
            let d = o - t;
            loss += d * d;
            d / count
        })
        .collect();
    (dout, 0.5 * loss / count)
}

/// Layer `i`'s backward from the gradient by its output: its weight's and bias's gradients,
/// the gradient by its input left in the state.
fn layer_backward(
    s: Shape,
    p: &mut PassState,
    i: usize,
    weight: &[f32],
    gain: &[f32],
) -> Vec<Vec<f32>> {
    let (b, w) = (s.batch, s.width);
    let mut dz = vec![0f32; b * w];
    for (r, dz_row) in dz.chunks_exact_mut(w).enumerate() {
        for j in 0..w {
            let a = p.acts[i][r * w + j];
            dz_row[j] = p.dh[r * w + j] * gain[j] * (1.0 - a * a);
        }
    }
    let weight_grad = matmul(&p.hs[i], true, &dz, false, w, b, w);
    let bias_grad = sum_rows(&dz, w);
    let back = matmul(&dz, false, weight, true, b, w, w);
    for (d, v) in p.dh.iter_mut().zip(back) {
        *d += v;
    }
    vec![weight_grad, bias_grad]
}

/// Refuses a stage that gave `given` gradients for `expected` parameters.
pub(super) fn check_gradients(given: usize, expected: usize) -> Result<()> {
    match given == expected {
        true => Ok(()),
        false => Err(Error::InvalidConfig {
            field: "stage",
            reason: format!("gave {given} gradients for {expected} parameters"),
        }),
    }
}

/// Runs the stages at once, with the values and gradients of a [`Params`].
struct HostRunner<'a, P: Params> {
    params: &'a mut P,
    state: PassState,
}

impl<P: Params> PassRunner for HostRunner<'_, P> {
    fn hook(&mut self, hook: Hook, unit: Unit) -> Result<()> {
        self.params.hook(hook, unit)
    }

    fn stage(&mut self, reads: &[ParamId], grads: &[ParamId], stage: Stage) -> Result<()> {
        let values = reads
            .iter()
            .map(|&param| self.params.value(param))
            .collect::<Result<Vec<_>>>()?;
        let given = stage(&mut self.state, &values);
        check_gradients(given.len(), grads.len())?;
        match (grads, given.as_slice()) {
            ([], _) => Ok(()),
            ([param], [grad]) => self.params.grad(*param, grad),
            _ => {
                let batch: Vec<(ParamId, &[f32])> = grads
                    .iter()
                    .copied()
                    .zip(given.iter().map(Vec::as_slice))
                    .collect();
                self.params.grads(&batch)
            }
        }
    }
}
