//! The example model trained with its math queued on the compute stream of the asynchronous CPU
//! backend, as a GPU model's kernels are, so that a step can be captured
//! ([`Engine::begin_capture`]) and replayed: the first step eager, the second captured (which
//! runs nothing) and replayed, every later one a replay of it with that step's micro-batches
//! written before it and its learning rate set ([`Engine::set_lr`]).
//!
//! The model's buffers (each pass's micro-batch and loss, each parameter's gradient) are host
//! memory the stream's jobs reach by address. Every job of the model holds them, and a job of
//! the model follows every hand-over of a gradient to the engine, whose reads hold nothing, so
//! they live as long as any queued or captured work may use them, on the error paths too.

use std::sync::Mutex;

use fsdp_fusion::backend::cpu::{CpuBuffer, CpuGraph};
use fsdp_fusion::backend::{RawAddress, Region};
use fsdp_fusion::{CapturedStep, CpuBackend, Stream};

use super::pass::{PassRunner, PassState, Stage, check_gradients};
use super::training::RankSteps;
use super::*;

/// A rank's steps with the model's work on its compute stream, the steps after the first
/// replays of one captured step.
pub struct CapturedSteps {
    model: Mlp,
    passes: u64,
    base_lr: f32,
    recipe: Recipe,
    /// The rank's index in the grid, which picks its micro-batches.
    rank: usize,
    buffers: Arc<StreamBuffers>,
    /// The pass under way, as the stages leave it.
    state: Arc<Mutex<PassState>>,
    /// Whether a step ran: the capture follows one.
    warmed_up: bool,
    captured: Option<CapturedStep<CpuGraph>>,
}

/// The model's buffers outside the engine.
struct StreamBuffers {
    /// Each pass's inputs and targets.
    batches: Vec<(CpuBuffer, CpuBuffer)>,
    /// Each parameter's gradient, as the stages write it.
    grads: Vec<CpuBuffer>,
    /// Each pass's loss.
    losses: CpuBuffer,
}

/// The address of `numel` f32 at the start of `buffer`.
fn address(backend: &CpuBackend, buffer: &CpuBuffer, numel: usize) -> Result<u64> {
    backend.stream_address(buffer, Region::new(0, numel, DType::F32))
}

/// Reads `numel` elements of `dtype` at `address`, widened to f32.
///
/// # Safety
/// `address` is valid for `numel` elements of `dtype`, which nothing writes meanwhile.
unsafe fn read(address: u64, numel: usize, dtype: DType) -> Vec<f32> {
    // SAFETY: as the caller promises.
    let bytes = unsafe { std::slice::from_raw_parts(address as *const u8, numel * dtype.size()) };
    widen(dtype, bytes)
}

/// Writes `values` at `address`.
///
/// # Safety
/// `address` is valid for `values.len()` f32, which nothing else reads or writes meanwhile.
unsafe fn write(address: u64, values: &[f32]) {
    // SAFETY: as the caller promises.
    unsafe {
        std::ptr::copy_nonoverlapping(
            values.as_ptr().cast::<u8>(),
            address as *mut u8,
            values.len() * 4,
        )
    }
}

fn lock(state: &Mutex<PassState>) -> Result<std::sync::MutexGuard<'_, PassState>> {
    state.lock().map_err(|_| Error::Panicked {
        message: "a stage of the example model's pass panicked".into(),
    })
}

impl<C: Communicator<CpuBackend>> RankSteps<CpuBackend, C> for CapturedSteps {
    fn step(&mut self, engine: &mut Engine<CpuBackend, C>, step: u64) -> Result<(f32, GradNorm)> {
        self.write_batches(engine, step)?;
        engine.set_lr(self.base_lr * self.recipe.schedule.factor(step))?;
        let norm = if !self.warmed_up {
            let norm = self.queue_step(engine, true)?;
            self.warmed_up = true;
            norm
        } else {
            if self.captured.is_none() {
                engine.begin_capture()?;
                if let Err(e) = self.queue_step(engine, false) {
                    // The engine's error; giving the capture up cannot tell more.
                    let _ = engine.abandon_capture();
                    return Err(e);
                }
                self.captured = Some(engine.end_capture()?);
            }
            if let Some(captured) = &self.captured {
                engine.replay(captured)?;
            }
            GradNorm {
                l2: f32::NAN,
                max: f32::NAN,
            }
        };
        Ok((self.loss(engine)?, norm))
    }
}

impl CapturedSteps {
    /// The steps of `model`'s training on `engine` (an asynchronous CPU backend's), `passes`
    /// micro-batches a step at the configured learning rate times the recipe's schedule.
    pub fn new<C: Communicator<CpuBackend>>(
        model: &Mlp,
        engine: &Engine<CpuBackend, C>,
        passes: u64,
        recipe: Recipe,
    ) -> Result<CapturedSteps> {
        let backend = engine.backend();
        let floats = |n: usize| backend.alloc_scratch(n * 4);
        let c = &model.config;
        let rows = c.batch * c.inputs;
        let batches = (0..passes)
            .map(|_| Ok((floats(rows)?, floats(rows)?)))
            .collect::<Result<Vec<_>>>()?;
        let grads = engine
            .plan()
            .params()
            .iter()
            .map(|p| floats(p.numel()))
            .collect::<Result<Vec<_>>>()?;
        Ok(CapturedSteps {
            model: model.clone(),
            passes,
            base_lr: engine.config().optimizer.lr(),
            recipe,
            rank: engine.replica().index * engine.plan().world_size() + engine.rank(),
            buffers: Arc::new(StreamBuffers {
                batches,
                grads,
                losses: floats(passes as usize)?,
            }),
            state: Arc::new(Mutex::new(PassState::default())),
            warmed_up: false,
            captured: None,
        })
    }

    /// Queues the writes of step `step`'s micro-batches on the compute stream, after the work
    /// that read the last step's.
    fn write_batches<C: Communicator<CpuBackend>>(
        &self,
        engine: &Engine<CpuBackend, C>,
        step: u64,
    ) -> Result<()> {
        let backend = engine.backend();
        for (pass, (x_buffer, y_buffer)) in (0..self.passes).zip(&self.buffers.batches) {
            let (x, y) = self.model.batch(step, pass, self.rank)?;
            let to = (
                address(backend, x_buffer, x.len())?,
                address(backend, y_buffer, y.len())?,
            );
            let buffers = Arc::clone(&self.buffers);
            backend.run(Stream::Compute, move || {
                let _held = &buffers;
                // SAFETY: the buffers hold a micro-batch each, alive while this job is; the
                // stream's jobs are the only ones to touch them, one after another.
                unsafe {
                    write(to.0, &x);
                    write(to.1, &y);
                }
                Ok(())
            })?;
        }
        Ok(())
    }

    /// Queues one step: each pass's stages between the engine's hooks, the gradient sync and
    /// clipping, the update. With `on_host` the norm is read by the host and returned (NaN
    /// otherwise, and where the engine steps in the backward).
    fn queue_step<C: Communicator<CpuBackend>>(
        &self,
        engine: &mut Engine<CpuBackend, C>,
        on_host: bool,
    ) -> Result<GradNorm> {
        let rows = self.model.config.batch * self.model.config.inputs;
        for (pass, (x_buffer, y_buffer)) in self.buffers.batches.iter().enumerate() {
            let backend = engine.backend();
            let from = (
                address(backend, x_buffer, rows)?,
                address(backend, y_buffer, rows)?,
            );
            let (state, buffers) = (Arc::clone(&self.state), Arc::clone(&self.buffers));
            backend.run(Stream::Compute, move || {
                let _held = &buffers;
                // SAFETY: as in `write_batches`.
                let (x, y) = unsafe {
                    (
                        read(from.0, rows, DType::F32),
                        read(from.1, rows, DType::F32),
                    )
                };
                *lock(&state)? = PassState::new(x, y);
                Ok(())
            })?;
            let mut runner = StreamRunner {
                engine: &mut *engine,
                state: &self.state,
                buffers: &self.buffers,
            };
            self.model.run_pass(&mut runner)?;
            let backend = engine.backend();
            let to =
                address(backend, &self.buffers.losses, self.passes as usize)? + 4 * pass as u64;
            let (state, buffers) = (Arc::clone(&self.state), Arc::clone(&self.buffers));
            backend.run(Stream::Compute, move || {
                let _held = &buffers;
                let loss = lock(&state)?.loss;
                // SAFETY: the pass's place in the losses, as in `write_batches`.
                unsafe { write(to, &[loss]) };
                Ok(())
            })?;
        }
        engine.finish_grad_sync()?;
        let norm = match on_host {
            true => step_norm(engine, self.recipe)?,
            false => {
                if let Some(max_norm) = self.recipe.clip {
                    engine.clip_grad_norm_on_device(max_norm)?;
                }
                GradNorm {
                    l2: f32::NAN,
                    max: f32::NAN,
                }
            }
        };
        engine.optimizer_step()?;
        engine.end_step()?;
        Ok(norm)
    }

    /// The mean of the last step's losses (a host wait for the compute stream).
    fn loss<C: Communicator<CpuBackend>>(&self, engine: &Engine<CpuBackend, C>) -> Result<f32> {
        let mut bytes = vec![0u8; self.passes as usize * 4];
        let region = Region::new(0, self.passes as usize, DType::F32);
        engine
            .backend()
            .download(&self.buffers.losses, region, &mut bytes)?;
        let sum = widen(DType::F32, &bytes)
            .iter()
            .fold(0.0, |sum, loss| sum + loss);
        Ok(sum / self.passes as f32)
    }
}

/// Queues the stages on the engine's compute stream, each between the hooks that keep its
/// parameters gathered, and hands their gradients over as device inputs.
struct StreamRunner<'a, C: Communicator<CpuBackend>> {
    engine: &'a mut Engine<CpuBackend, C>,
    state: &'a Arc<Mutex<PassState>>,
    buffers: &'a Arc<StreamBuffers>,
}

impl<C: Communicator<CpuBackend>> PassRunner for StreamRunner<'_, C> {
    fn hook(&mut self, hook: Hook, unit: Unit) -> Result<()> {
        EngineParams(&mut *self.engine).hook(hook, unit)
    }

    fn stage(&mut self, reads: &[ParamId], grads: &[ParamId], stage: Stage) -> Result<()> {
        let reads = reads
            .iter()
            .map(|&param| self.engine.param_device(param))
            .collect::<Result<Vec<_>>>()?;
        let backend = self.engine.backend();
        let plan = self.engine.plan();
        let outs = grads
            .iter()
            .map(|&param| {
                let layout = plan.param(param)?;
                let buffer = &self.buffers.grads[param.0];
                Ok((
                    param,
                    address(backend, buffer, layout.numel())?,
                    layout.numel(),
                    layout.name(),
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let targets: Vec<(u64, usize, String)> = outs
            .iter()
            .map(|&(_, at, numel, name)| (at, numel, name.to_string()))
            .collect();
        let (state, buffers) = (Arc::clone(self.state), Arc::clone(self.buffers));
        backend.run(Stream::Compute, move || {
            let _held = &buffers;
            // SAFETY: each parameter's gathered values, read on the compute stream between the
            // hooks that keep them (this job is queued there).
            let values: Vec<Vec<f32>> = reads
                .iter()
                .map(|t| unsafe { read(t.ptr, t.numel, t.dtype) })
                .collect();
            let given = stage(&mut *lock(&state)?, &values);
            check_gradients(given.len(), targets.len())?;
            for ((at, numel, name), grad) in targets.iter().zip(&given) {
                if grad.len() != *numel {
                    return Err(Error::GradientLength {
                        name: name.clone(),
                        expected: *numel,
                        got: grad.len(),
                    });
                }
                // SAFETY: the parameter's gradient buffer, as in `write_batches`; the engine
                // reads it on this stream after this job.
                unsafe { write(*at, grad) };
            }
            Ok(())
        })?;
        // SAFETY: each buffer holds the gradient written above on the compute stream, where the
        // engine reads it; the jobs queued after that read hold the buffers, and the next write
        // is a later job of the same stream.
        let inputs: Vec<(ParamId, Input<'static>)> = outs
            .iter()
            .map(|&(param, at, numel, _)| (param, unsafe { Input::device(at, numel, DType::F32) }))
            .collect();
        let handed = match inputs.as_slice() {
            [] => Ok(()),
            [(param, input)] => self.engine.grad(*param, *input),
            _ => self.engine.grads(&inputs),
        };
        // The engine's reads of the buffers, queued or not, come before this job, which holds
        // them.
        let buffers = Arc::clone(self.buffers);
        let held = self.engine.backend().run(Stream::Compute, move || {
            let _held = &buffers;
            Ok(())
        });
        handed.and(held)
    }
}
