//! A whole training step captured once as a CUDA graph and replayed, beside the same step eager.
//!
//! For each shape (layers, width, batch), one rank on NCCL at world size 1: the stack of dense bf16
//! layers of the pipeline bench trains through the engine (forward and backward GEMMs, every hook,
//! the gradient sync, AdamW, the step's end), eagerly and as replays of one captured step; the
//! same GEMMs with no engine, eagerly and captured, are the baselines (the captured one is the
//! graph's roofline, with the engine's optimizer time added, as the plain GEMMs have none).
//! Step times are medians of the time between CUDA events recorded on the
//! compute stream before and after each step, so host time that keeps the GPU waiting counts;
//! host ms is the host's own time to issue one step. After the same steps, the eager and the
//! replayed engine's shards are compared bit for bit.
//!
//!     .gpu/bin/bench-captured_step [--shapes 32x1024x64,...] [--steps 50]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;

use fsdp_fusion::backend::cuda::{CudaBackend, CudaBackendEvent, is_driver_present};
use fsdp_fusion::comm::nccl::NcclComm;
use fsdp_fusion::types::Stream;
use fsdp_fusion::{Backend, Engine, EngineConfig, Error, Plan, Result};
use fsdp_fusion_support::gpu_stack::{HookTime, Stack, StackShape, UnshardedStack};

#[derive(Parser)]
struct Args {
    /// Comma-separated LAYERSxWIDTHxBATCH.
    #[arg(long, default_value = "32x256x16,32x1024x64,32x4096x1024")]
    shapes: String,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    #[arg(long, default_value_t = 50)]
    steps: usize,
    /// Accepted and ignored, as cargo bench passes it.
    #[arg(long, hide = true)]
    bench: bool,
}

/// The median GPU time per step and the mean host time per step.
struct Timed {
    gpu_ms: f64,
    host_ms: f64,
}

/// Times `steps` calls of `step` on `on` by events on its backend's compute stream around each.
fn timed<T>(
    on: &mut T,
    backend: fn(&T) -> &CudaBackend,
    steps: usize,
    mut step: impl FnMut(&mut T) -> Result<()>,
) -> Result<Timed> {
    let mut marks = vec![backend(on).record_timed(Stream::Compute)?];
    let host = Instant::now();
    for _ in 0..steps {
        step(on)?;
        marks.push(backend(on).record_timed(Stream::Compute)?);
    }
    let host_ms = host.elapsed().as_secs_f64() * 1e3 / steps.max(1) as f64;
    let times = marks
        .windows(2)
        .map(|w| backend(on).elapsed_ms(&w[0], &w[1]).map(f64::from))
        .collect::<Result<Vec<_>>>()?;
    Ok(Timed {
        gpu_ms: median(times),
        host_ms,
    })
}

/// The unsharded GEMMs, eager then captured.
fn unsharded(shape: StackShape, args: &Args) -> Result<(Timed, Timed)> {
    let backend = CudaBackend::new(0)?;
    let stack = UnshardedStack::new(&backend, shape, 1)?;
    let mut plain = (backend, stack);
    for _ in 0..args.warmup {
        plain.1.step()?;
    }
    let eager = timed(&mut plain, |p| &p.0, args.steps, |p| p.1.step())?;
    let graph = plain.1.capture()?;
    let mut graph = (plain.0, graph);
    let captured = timed(&mut graph, |g| &g.0, args.steps, |g| g.1.replay())?;
    Ok((eager, captured))
}

/// An engine training a stack.
struct Trainer {
    engine: Engine<CudaBackend, NcclComm>,
    stack: Stack,
    hooks: HookTime,
    /// Events on the compute stream around each eager step's `optimizer_step`.
    optimizer_marks: Vec<(CudaBackendEvent, CudaBackendEvent)>,
}

impl Trainer {
    fn backend(&self) -> &CudaBackend {
        self.engine.backend()
    }

    fn step(&mut self) -> Result<()> {
        self.stack.step(&mut self.engine, &mut self.hooks)?;
        if self.engine.capturing() {
            // A timed event would be a node of the graph, never recorded on its own.
            self.engine.optimizer_step()?;
        } else {
            let before = self.backend().record_timed(Stream::Compute)?;
            self.engine.optimizer_step()?;
            let after = self.backend().record_timed(Stream::Compute)?;
            self.optimizer_marks.push((before, after));
        }
        self.engine.end_step()
    }

    /// The median time of the eager steps' optimizer.
    fn optimizer_ms(&self) -> Result<f64> {
        let times = self
            .optimizer_marks
            .iter()
            .map(|(a, b)| self.backend().elapsed_ms(a, b).map(f64::from))
            .collect::<Result<Vec<_>>>()?;
        Ok(median(times))
    }
}

fn median(mut times: Vec<f64>) -> f64 {
    times.sort_by(f64::total_cmp);
    times.get(times.len() / 2).copied().unwrap_or(f64::NAN)
}

/// What the engine's steps measured, eager or replayed.
struct Trained {
    timing: Timed,
    /// The median time of the optimizer in the eager steps (the warm-up's when replayed).
    optimizer_ms: f64,
    /// Every group's shard at the end.
    shards: Vec<Vec<u8>>,
}

/// The engine's steps, eager or replayed.
fn engine(shape: StackShape, args: &Args, captured: bool) -> Result<Trained> {
    let plan = Arc::new(Plan::new(&shape.spec()?, 1)?);
    let comm = NcclComm::group(&[0], fsdp_fusion::watch::DEFAULT_TIMEOUT)?
        .pop()
        .ok_or_else(|| Error::InvalidConfig {
            field: "devices",
            reason: "NCCL made no rank for GPU 0".into(),
        })?;
    let backend = CudaBackend::new(comm.device())?;
    let stack = Stack::new(&backend, shape, 1)?;
    let mut engine = Engine::new(plan, EngineConfig::default(), backend, comm)?;
    stack.load(&mut engine, 1)?;
    let mut t = Trainer {
        engine,
        stack,
        hooks: HookTime::default(),
        optimizer_marks: Vec::new(),
    };
    for _ in 0..args.warmup {
        t.step()?;
    }
    let timing = if captured {
        t.engine.begin_capture()?;
        t.step()?;
        let graph = t.engine.end_capture()?;
        timed(&mut t, Trainer::backend, args.steps, |t| {
            t.engine.replay(&graph)
        })?
    } else {
        timed(&mut t, Trainer::backend, args.steps, Trainer::step)?
    };
    let shards = (0..t.engine.plan().groups().len())
        .map(|g| t.engine.param_shard(g))
        .collect::<Result<Vec<_>>>()?;
    Ok(Trained {
        timing,
        optimizer_ms: t.optimizer_ms()?,
        shards,
    })
}

fn run(args: &Args) -> Result<()> {
    println!(
        "{:<20} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>10} {:>8} {:>8} {:>6}",
        "shape (L,w,batch)",
        "plain ms",
        "plain gr",
        "eager ms",
        "replay ms",
        "optim ms",
        "x plain",
        "x plain gr",
        "host eag",
        "host rep",
        "equal"
    );
    let shapes = StackShape::parse_list(&args.shapes).ok_or_else(|| Error::InvalidConfig {
        field: "shapes",
        reason: format!("{:?} is not LAYERSxWIDTHxBATCH,...", args.shapes),
    })?;
    for shape in shapes {
        let (plain, plain_graph) = unsharded(shape, args)?;
        let eager = engine(shape, args, false)?;
        let replayed = engine(shape, args, true)?;
        // The plain GEMMs have no optimizer: the graph's roofline for the engine's step is
        // theirs captured plus the engine's own update.
        let roofline = plain_graph.gpu_ms + eager.optimizer_ms;
        println!(
            "{:<20} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>8.3} {:>10.3} {:>8.3} {:>8.3} {:>6}",
            format!("({}, {}, {})", shape.layers, shape.width, shape.batch),
            plain.gpu_ms,
            plain_graph.gpu_ms,
            eager.timing.gpu_ms,
            replayed.timing.gpu_ms,
            eager.optimizer_ms,
            replayed.timing.gpu_ms / plain.gpu_ms,
            replayed.timing.gpu_ms / roofline,
            eager.timing.host_ms,
            replayed.timing.host_ms,
            eager.shards == replayed.shards,
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    if !is_driver_present() {
        eprintln!("captured_step bench: no CUDA driver here; run it on the GPU machine");
        return ExitCode::SUCCESS;
    }
    match run(&Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("captured_step bench: {e}");
            ExitCode::FAILURE
        }
    }
}
