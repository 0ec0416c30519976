//! A whole training step captured once as a CUDA graph and replayed, beside the same step eager.
//!
//! For each shape (layers, width, batch), one rank on NCCL at world size 1: the stack of dense bf16
//! layers of the pipeline bench trains through the engine (forward and backward GEMMs, every hook,
//! the gradient sync, AdamW, the step's end), eagerly and as replays of one captured step; the
//! same GEMMs with no engine, eagerly and captured, are the baselines (the captured one is the
//! graph's roofline). Step times are medians of the time between CUDA events recorded on the
//! compute stream before and after each step, so host time that keeps the GPU waiting counts;
//! host ms is the host's own time to issue one step. After the same steps, the eager and the
//! replayed engine's shards are compared bit for bit.
//!
//!     .gpu/bin/bench-captured_step [--shapes 32x1024x64,...] [--steps 50]

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;

use fsdp_fusion::backend::cuda::{CudaBackend, is_driver_present};
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
    let mut times = marks
        .windows(2)
        .map(|w| backend(on).elapsed_ms(&w[0], &w[1]).map(f64::from))
        .collect::<Result<Vec<_>>>()?;
    times.sort_by(f64::total_cmp);
    let gpu_ms = times.get(times.len() / 2).copied().unwrap_or(f64::NAN);
    Ok(Timed { gpu_ms, host_ms })
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
}

impl Trainer {
    fn backend(&self) -> &CudaBackend {
        self.engine.backend()
    }

    fn step(&mut self) -> Result<()> {
        self.stack.step(&mut self.engine, &mut self.hooks)?;
        self.engine.optimizer_step()?;
        self.engine.end_step()
    }
}

/// The engine's steps, eager or replayed: the timing and every group's shard at the end.
fn engine(shape: StackShape, args: &Args, captured: bool) -> Result<(Timed, Vec<Vec<u8>>)> {
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
    Ok((timing, shards))
}

fn run(args: &Args) -> Result<()> {
    println!(
        "{:<20} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>8}",
        "shape (L,w,batch)",
        "plain ms",
        "plain gr",
        "eager ms",
        "replay ms",
        "x plain",
        "x pl. gr",
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
        let (eager, eager_shards) = engine(shape, args, false)?;
        let (replayed, replayed_shards) = engine(shape, args, true)?;
        println!(
            "{:<20} {:>10.3} {:>10.3} {:>10.3} {:>10.3} {:>9.3} {:>9.3} {:>9.3} {:>9.3} {:>8}",
            format!("({}, {}, {})", shape.layers, shape.width, shape.batch),
            plain.gpu_ms,
            plain_graph.gpu_ms,
            eager.gpu_ms,
            replayed.gpu_ms,
            replayed.gpu_ms / plain.gpu_ms,
            replayed.gpu_ms / plain_graph.gpu_ms,
            eager.host_ms,
            replayed.host_ms,
            eager_shards == replayed_shards,
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
