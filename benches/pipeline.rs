//! The overlapped pipeline on one GPU, beside the same GEMMs with no sharding.
//!
//! For each shape (layers, width, batch) and each communicator (NCCL at world size 1; loopback at
//! 4 and 8 ranks on one GPU; NCCL on N GPUs with `--comms ncclN`), a stack of dense bf16 layers (each an FSDP unit) trains through the
//! engine: forward and backward GEMMs through cuBLAS on the compute stream, weight gradients
//! written in fp32 by their GEMM into the engine's slots, every hook, the gradient sync; the AdamW
//! step is timed on its own. Prints a table, or JSON lines (`--json`) that
//! `benches/fsdp2_pipeline.py --ours` puts beside PyTorch FSDP2. `--trace FILE` writes a Chrome
//! trace of one step of the largest shape (FILE) and an SVG picture of it (FILE.svg).
//!
//! `--reduce-dtypes f32,bf16` runs each configuration with either gradient transport (bf16 hands
//! the GEMM's fp32 weight gradient over instead of writing it into a slot).
//!
//!     .gpu/bin/bench-pipeline [--json] [--trace step.json] [--shapes 32x1024x64,...]

use std::process::ExitCode;
use std::sync::{Arc, Barrier};

use clap::Parser;

use fsdp_fusion::backend::cuda::{CudaBackend, is_driver_present};
use fsdp_fusion::comm::loopback::LoopbackComm;
use fsdp_fusion::comm::nccl::NcclComm;
use fsdp_fusion::trace::{self, TimedSpan};
use fsdp_fusion::types::Stream;
use fsdp_fusion::{Backend, Communicator, DType, Engine, EngineConfig, Plan, Policy, Result};
use fsdp_fusion_support::gpu_stack::{HookTime, Stack, StackShape, UnshardedStack};
use fsdp_fusion_support::ranks::on_threads;

#[derive(Parser)]
struct Args {
    /// Comma-separated LAYERSxWIDTHxBATCH.
    #[arg(
        long,
        default_value = "32x1024x64,32x4096x1024,16x8192x2048,64x2048x512"
    )]
    shapes: String,
    /// Comma-separated communicators: ncclN (N GPUs, one NCCL rank each, driven by this process),
    /// loopN (N ranks on GPU 0).
    #[arg(long, default_value = "nccl1,loop4,loop8")]
    comms: String,
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    #[arg(long, default_value_t = 10)]
    steps: usize,
    /// JSON lines instead of a table.
    #[arg(long)]
    json: bool,
    /// Writes a Chrome trace of one step of the largest shape here, and an SVG beside it.
    #[arg(long)]
    trace: Option<String>,
    /// Comma-separated gradient transport dtypes: f32, bf16.
    #[arg(long, default_value = "f32")]
    reduce_dtypes: String,
    /// Accepted and ignored, as cargo bench passes it.
    #[arg(long, hide = true)]
    bench: bool,
}

/// What one rank measured.
#[derive(Debug, Default)]
struct RankResult {
    step_ms: f64,
    unsharded_ms: f64,
    optimizer_ms: f64,
    hook_us: f64,
    hook_calls_per_step: f64,
    gather_wait_ms: f64,
    peak_bytes: usize,
    plan_bytes: usize,
    /// Bytes each rank's reduce-scatters of a step take in.
    reduced_bytes: usize,
    spans: Vec<TimedSpan>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Times `steps` steps of the unsharded GEMMs on `backend`'s compute stream (median per step).
fn time_unsharded(backend: &CudaBackend, shape: StackShape, args: &Args) -> Result<f64> {
    let mut stack = UnshardedStack::new(backend, shape, 1)?;
    for _ in 0..args.warmup {
        stack.step()?;
    }
    let mut marks = vec![backend.record_timed(Stream::Compute)?];
    for _ in 0..args.steps {
        stack.step()?;
        marks.push(backend.record_timed(Stream::Compute)?);
    }
    let times = marks
        .windows(2)
        .map(|w| backend.elapsed_ms(&w[0], &w[1]).map(f64::from))
        .collect::<Result<Vec<_>>>()?;
    Ok(median(times))
}

/// One rank: the unsharded baseline, then the engine's steps, then one traced step. The ranks
/// of a loopback group share the GPU, so their baselines run together too (`start` lines them up).
fn run_rank<C: Communicator<CudaBackend>>(
    backend: CudaBackend,
    comm: C,
    (shape, reduce_dtype): (StackShape, DType),
    args: &Args,
    start: &Barrier,
) -> Result<RankResult> {
    start.wait();
    let unsharded_ms = time_unsharded(&backend, shape, args)?;
    let plan = Arc::new(Plan::new(&shape.spec()?, comm.world_size())?);
    let config = EngineConfig {
        reduce_dtype,
        ..EngineConfig::default()
    };
    let plan_bytes = Policy::new(&plan, &config)?.memory.peak;
    let reduced_bytes = if plan.world_size() > 1 {
        plan.groups()
            .iter()
            .filter(|g| g.trainable())
            .map(|g| g.padded_numel() * reduce_dtype.size())
            .sum()
    } else {
        0
    };
    let mut stack = Stack::new(&backend, shape, 1)?;
    let mut engine = Engine::new(plan, config, backend, comm)?;
    stack.load(&mut engine, 1)?;
    let mut hooks = HookTime::default();
    for _ in 0..args.warmup {
        stack.step(&mut engine, &mut hooks)?;
        engine.optimizer_step()?;
        engine.end_step()?;
    }
    hooks = HookTime::default();
    let b = |e: &Engine<CudaBackend, C>, s| e.backend().record_timed(s);
    let mut marks = Vec::with_capacity(args.steps);
    for _ in 0..args.steps {
        let start = b(&engine, Stream::Compute)?;
        stack.step(&mut engine, &mut hooks)?;
        let synced = b(&engine, Stream::Compute)?;
        engine.optimizer_step()?;
        let stepped = b(&engine, Stream::Compute)?;
        engine.end_step()?;
        marks.push((start, synced, stepped));
    }
    let backend = engine.backend();
    let mut step_ms = Vec::new();
    let mut optimizer_ms = Vec::new();
    for (start, synced, stepped) in &marks {
        step_ms.push(f64::from(backend.elapsed_ms(start, synced)?));
        optimizer_ms.push(f64::from(backend.elapsed_ms(synced, stepped)?));
    }
    let calls = hooks.calls as f64 / args.steps as f64;
    let hook_us = hooks.mean_us();

    engine.set_tracing(true)?;
    let origin = engine.backend().record_timed(Stream::Compute)?;
    stack.step(&mut engine, &mut HookTime::default())?;
    engine.optimizer_step()?;
    let raw = engine.take_trace();
    engine.end_step()?;
    engine.set_tracing(false)?;
    let spans = trace::resolve(engine.backend(), &origin, &raw)?;
    Ok(RankResult {
        step_ms: median(step_ms),
        unsharded_ms,
        optimizer_ms: median(optimizer_ms),
        hook_us,
        hook_calls_per_step: calls,
        gather_wait_ms: trace::gather_wait_ms(&spans),
        peak_bytes: engine.memory().peak,
        plan_bytes,
        reduced_bytes,
        spans,
    })
}

/// Runs every rank of one configuration, one thread each.
fn run_ranks<C: Communicator<CudaBackend> + 'static>(
    ranks: Vec<(CudaBackend, C)>,
    shape: (StackShape, DType),
    args: &Args,
) -> Result<Vec<RankResult>> {
    let start = Barrier::new(ranks.len());
    on_threads(ranks, |_, (b, c)| run_rank(b, c, shape, args, &start))
        .into_iter()
        .collect()
}

fn run_comm(comm: &str, shape: (StackShape, DType), args: &Args) -> Result<Vec<RankResult>> {
    if let Some(world) = comm.strip_prefix("loop") {
        let world: usize = world.parse().map_err(|_| bad_comm(comm))?;
        let ranks = LoopbackComm::group(world)?
            .into_iter()
            .map(|c| Ok((CudaBackend::new(0)?, c)))
            .collect::<Result<Vec<_>>>()?;
        run_ranks(ranks, shape, args)
    } else if let Some(world) = comm.strip_prefix("nccl") {
        // One process drives GPUs 0..world, one NCCL rank each.
        let devices: Vec<usize> = (0..world.parse().map_err(|_| bad_comm(comm))?).collect();
        let ranks = NcclComm::group(&devices, fsdp_fusion::watch::DEFAULT_TIMEOUT)?
            .into_iter()
            .map(|c| Ok((CudaBackend::new(c.device())?, c)))
            .collect::<Result<Vec<_>>>()?;
        run_ranks(ranks, shape, args)
    } else {
        Err(bad_comm(comm))
    }
}

fn bad_comm(comm: &str) -> fsdp_fusion::Error {
    fsdp_fusion::Error::InvalidConfig {
        field: "comms",
        reason: format!("{comm:?} is neither ncclN nor loopN"),
    }
}

fn run(args: &Args) -> Result<()> {
    let shapes =
        StackShape::parse_list(&args.shapes).ok_or_else(|| fsdp_fusion::Error::InvalidConfig {
            field: "shapes",
            reason: format!("{:?} is not LAYERSxWIDTHxBATCH,...", args.shapes),
        })?;
    let largest = shapes
        .iter()
        .copied()
        .max_by(|a, b| a.flops().total_cmp(&b.flops()));
    let reduce_dtypes = args
        .reduce_dtypes
        .split(',')
        .map(|d| {
            DType::parse(d).ok_or_else(|| fsdp_fusion::Error::InvalidConfig {
                field: "reduce_dtypes",
                reason: format!("{d:?} is not f32 or bf16"),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if !args.json {
        println!(
            "{:<20} {:<6} {:<5} {:>9} {:>10} {:>7} {:>11} {:>10} {:>11} {:>13} {:>9} {:>9} {:>9} {:>10}",
            "shape (L,w,batch)",
            "comm",
            "grads",
            "step ms",
            "unshard ms",
            "+%",
            "unit ovh us",
            "host us/h",
            "hooks/step",
            "gather wait",
            "optim ms",
            "peak GiB",
            "plan GiB",
            "RS MiB/st"
        );
    }
    for shape in &shapes {
        for (comm, &reduce_dtype) in args
            .comms
            .split(',')
            .flat_map(|c| reduce_dtypes.iter().map(move |d| (c, d)))
        {
            let ranks = run_comm(comm, (*shape, reduce_dtype), args)?;
            let r = &ranks[0];
            let per_unit_us = (r.step_ms - r.unsharded_ms) * 1e3 / shape.layers as f64;
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({
                        "who": "fsdp-fusion", "comm": comm, "reduce_dtype": reduce_dtype.name(),
                        "reduced_bytes_per_step": r.reduced_bytes,
                        "layers": shape.layers, "width": shape.width,
                        "batch": shape.batch, "world_size": ranks.len(), "step_ms": r.step_ms,
                        "unsharded_ms": r.unsharded_ms, "per_unit_overhead_us": per_unit_us,
                        "host_us_per_hook": r.hook_us, "hook_calls_per_step": r.hook_calls_per_step,
                        "gather_wait_ms": r.gather_wait_ms, "optimizer_ms": r.optimizer_ms,
                        "peak_bytes": r.peak_bytes, "plan_bytes": r.plan_bytes,
                    })
                );
            } else {
                println!(
                    "{:<20} {:<6} {:<5} {:>9.3} {:>10.3} {:>7.1} {:>11.1} {:>10.2} {:>11.0} {:>13.3} {:>9.3} {:>9.3} {:>9.3} {:>10.1}",
                    format!("({}, {}, {})", shape.layers, shape.width, shape.batch),
                    comm,
                    reduce_dtype.name(),
                    r.step_ms,
                    r.unsharded_ms,
                    100.0 * (r.step_ms / r.unsharded_ms - 1.0),
                    per_unit_us,
                    r.hook_us,
                    r.hook_calls_per_step,
                    r.gather_wait_ms,
                    r.optimizer_ms,
                    r.peak_bytes as f64 / (1u64 << 30) as f64,
                    r.plan_bytes as f64 / (1u64 << 30) as f64,
                    r.reduced_bytes as f64 / (1u64 << 20) as f64
                );
            }
            if let (Some(path), Some(largest)) = (&args.trace, largest) {
                if largest == *shape && comm == args.comms.split(',').next().unwrap_or_default() {
                    let spans: Vec<Vec<TimedSpan>> =
                        ranks.iter().map(|r| r.spans.clone()).collect();
                    let title = format!(
                        "one step, {} layers of width {}, batch {}, {comm}, rank 0: compute, gather, reduce streams",
                        shape.layers, shape.width, shape.batch
                    );
                    let io = |source: std::io::Error| fsdp_fusion::Error::Write {
                        path: path.clone(),
                        source: std::sync::Arc::new(source),
                    };
                    std::fs::write(path, trace::chrome_trace(&spans).to_string()).map_err(io)?;
                    std::fs::write(format!("{path}.svg"), trace::svg(&spans[0], &title))
                        .map_err(io)?;
                }
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !is_driver_present() {
        println!("bench-pipeline: no NVIDIA driver on this machine; nothing to measure");
        return ExitCode::SUCCESS;
    }
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
