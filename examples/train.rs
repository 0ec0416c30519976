//! The main job: trains the example model (dense residual layers, each an FSDP unit, between a
//! tied input/output projection; frozen gains) on CPU ranks, beside the unsharded reference on the
//! same data, and prints both losses, the largest parameter difference and the memory per rank.
//!
//! cargo run --release --example train [-- --ranks 4 --layers 4 --width 64 --steps 20 ...]
//! cargo run --release --example train -- --backend cuda --comm loopback   # ranks on one GPU
//! cargo run --release --example train -- --backend cuda --comm nccl       # one GPU per rank
//! cargo run --release --example train -- --ranks 8 --replicas 2   # hybrid: 2 replicas of 4
//! cargo run --release --example train -- --ranks 8 --experts 2    # expert groups of 2 ranks
//! cargo run --release --example train -- --capture   # one step captured, replayed for the rest
//! cargo run --release --example train -- --steps 10 --save run        # then:
//! cargo run --release --example train -- --steps 20 --resume run --export model.safetensors

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, ValueEnum};
use fsdp_fusion::backend::cuda::CudaBackend;
use fsdp_fusion::comm::hybrid::Hybrid;
use fsdp_fusion::comm::loopback::LoopbackComm;
use fsdp_fusion::comm::nccl::NcclComm;
use fsdp_fusion::comm::process_group_comms;
use fsdp_fusion::optim::LrSchedule;
use fsdp_fusion::{
    Accumulation, DType, EngineConfig, GradReduction, OptimizerConfig, Plan, Policy,
};
use fsdp_fusion_support::mlp::{Checkpoints, Comparison, Mlp, MlpConfig, Recipe, Training};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Clone, Copy, ValueEnum)]
enum Dtype {
    F32,
    Bf16,
    F16,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendKind {
    Cpu,
    Cuda,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CommKind {
    /// CPU ranks as threads (the CPU backend's only communicator).
    Local,
    /// Every rank on GPU 0, collectives as device copies (CUDA backend).
    Loopback,
    /// NCCL, rank r on GPU r, all driven by this process (CUDA backend).
    Nccl,
}

#[derive(Clone, Copy, ValueEnum)]
enum Optimizer {
    Adamw,
    Sgd,
}

#[derive(Clone, Copy, ValueEnum)]
enum Schedule {
    Constant,
    /// A linear warmup over `--warmup-steps`, then a cosine decay to 0 at the last step.
    WarmupCosine,
}

#[derive(Clone, Copy, ValueEnum)]
enum ReduceDtype {
    F32,
    Bf16,
}

#[derive(Clone, Copy, ValueEnum)]
enum Accumulate {
    /// Every pass reduce-scatters its gradients.
    Reduce,
    /// The passes add into unsharded fp32 gradients, reduce-scattered once per step.
    NoSync,
    /// Parameters stay gathered between the passes of a step.
    KeepGathered,
}

#[derive(Parser)]
#[command(about = "Train the example model sharded over CPU ranks beside an unsharded reference")]
struct Args {
    /// Data-parallel ranks (threads).
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// Hybrid sharding: the ranks form this many replicas, each sharding the model over
    /// `ranks / replicas` ranks; gradients are all-reduced across the replicas.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    /// Expert parameters: every odd layer's weight and bias sharded over groups of this many
    /// ranks, each group with its own copy trained on its ranks' data.
    #[arg(long)]
    experts: Option<usize>,
    #[arg(long, default_value_t = 4)]
    layers: usize,
    #[arg(long, default_value_t = 64)]
    width: usize,
    /// Width of the input and output (the tied projection is inputs x width).
    #[arg(long, default_value_t = 32)]
    inputs: usize,
    /// Rows per rank per micro-batch.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// Micro-batches (backward passes) per step, accumulated.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..))]
    passes: u64,
    #[arg(long, value_enum, default_value = "f32")]
    dtype: Dtype,
    /// Gathered buffers kept at once (double_buffer_limit). Each layer holds three groups (its
    /// weight, its bias, which takes no weight decay, and its frozen gain), so 6 lets the next
    /// layer's prefetch overlap.
    #[arg(long, default_value_t = 6)]
    limit: usize,
    /// Gradient reduce-scatters in flight.
    #[arg(long, default_value_t = 2)]
    reduces: usize,
    /// Prefetch and overlap collectives: on or off.
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    overlap: String,
    #[arg(long, value_enum, default_value = "adamw")]
    optimizer: Optimizer,
    #[arg(long, default_value_t = 1e-2)]
    lr: f32,
    /// Sum gradients over ranks instead of averaging.
    #[arg(long)]
    sum: bool,
    #[arg(long, value_enum, default_value = "constant")]
    lr_schedule: Schedule,
    /// Steps of the warmup-cosine schedule's warmup.
    #[arg(long, default_value_t = 5)]
    warmup_steps: u64,
    /// Clip the whole gradient's 2-norm to this.
    #[arg(long)]
    clip: Option<f32>,
    /// The dtype gradients travel in between ranks (accumulated in fp32 either way).
    #[arg(long, value_enum, default_value = "f32")]
    reduce_dtype: ReduceDtype,
    /// How a step's passes come together.
    #[arg(long, value_enum, default_value = "reduce")]
    accumulate: Accumulate,
    #[arg(long, value_enum, default_value = "cpu")]
    backend: BackendKind,
    /// Defaults to local on the CPU backend, loopback on the CUDA backend.
    #[arg(long, value_enum)]
    comm: Option<CommKind>,
    /// Continue from this checkpoint (of `--save`) at its saved step, up to `--steps`; the
    /// reference runs every step from the start (at this run's rank count: resharded from
    /// another, the comparison shows the other run's data).
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Save every rank's state into this directory (a new one) after the last step.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Write the full model as a safetensors file (a new one) after the last step.
    #[arg(long)]
    export: Option<PathBuf>,
    /// Step the optimizer inside the backward, each group as soon as its gradient is final (one
    /// pass a step, no clipping: the grad norm column is then NaN).
    #[arg(long)]
    step_in_backward: bool,
    /// Capture the second step once (which runs nothing) and replay it for that step and every
    /// later one, with the model's math queued on each rank's compute stream (CPU ranks whose
    /// streams run apart, as a GPU's do). The grad norm column is NaN for the replayed steps:
    /// the host does not compute their norm (with --clip it stays on the device).
    #[arg(long)]
    capture: bool,
}

/// Runs longer than this show a progress bar and print a line every few steps.
const QUIET_AFTER: u64 = 50;

/// The backends and communicators that go together.
enum Setup {
    CpuLocal,
    CudaLoopback,
    CudaNccl,
}

fn setup(args: &Args) -> fsdp_fusion::Result<Setup> {
    match (args.backend, args.comm) {
        (BackendKind::Cpu, None | Some(CommKind::Local)) => Ok(Setup::CpuLocal),
        (BackendKind::Cuda, None | Some(CommKind::Loopback)) => Ok(Setup::CudaLoopback),
        (BackendKind::Cuda, Some(CommKind::Nccl)) => Ok(Setup::CudaNccl),
        _ => Err(fsdp_fusion::Error::InvalidConfig {
            field: "comm",
            reason: "local goes with the CPU backend, loopback and nccl with the CUDA backend"
                .into(),
        }),
    }
}

fn run(args: &Args) -> fsdp_fusion::Result<()> {
    let setup = setup(args)?;
    let dtype = match args.dtype {
        Dtype::F32 => DType::F32,
        Dtype::Bf16 => DType::Bf16,
        Dtype::F16 => DType::F16,
    };
    let shape = MlpConfig {
        layers: args.layers,
        width: args.width,
        inputs: args.inputs,
        batch: args.batch,
        dtype,
        seed: 7,
        embed_lr_scale: 1.0,
    };
    let model = match args.experts {
        Some(size) => Mlp::with_experts(shape, size),
        None => Mlp::new(shape),
    };
    let optimizer = match args.optimizer {
        Optimizer::Adamw => OptimizerConfig::AdamW {
            lr: args.lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        Optimizer::Sgd => OptimizerConfig::sgd(args.lr),
    };
    let config = EngineConfig {
        double_buffer_limit: args.limit,
        max_reduces_in_flight: args.reduces,
        overlap: args.overlap == "on",
        grad_reduction: if args.sum {
            GradReduction::Sum
        } else {
            GradReduction::Mean
        },
        reduce_dtype: match args.reduce_dtype {
            ReduceDtype::F32 => DType::F32,
            ReduceDtype::Bf16 => DType::Bf16,
        },
        accumulation: match args.accumulate {
            Accumulate::Reduce => Accumulation::ReduceEveryPass,
            Accumulate::NoSync => Accumulation::NoSync,
            Accumulate::KeepGathered => Accumulation::KeepGathered,
        },
        optimizer,
        step_in_backward: args.step_in_backward,
        ..EngineConfig::default()
    };
    config.validate()?;
    if args.step_in_backward && args.passes != 1 {
        return Err(fsdp_fusion::Error::InvalidConfig {
            field: "step_in_backward",
            reason: format!(
                "takes one backward pass a step, not {}: add --passes 1",
                args.passes
            ),
        });
    }
    let shard_size = fsdp_fusion::comm::hybrid::shard_size(args.ranks, args.replicas)?;
    let plan = Arc::new(Plan::hybrid(&model.spec()?, args.replicas, shard_size)?);
    let init = model.init(1);
    let training = Training {
        model: &model,
        plan: &plan,
        config: &config,
        init: &init,
        steps: args.steps,
        passes: args.passes,
        recipe: Recipe {
            schedule: match args.lr_schedule {
                Schedule::Constant => LrSchedule::Constant,
                Schedule::WarmupCosine => LrSchedule::WarmupCosine {
                    warmup_steps: args.warmup_steps,
                    total_steps: args.steps,
                    min_factor: 0.0,
                },
            },
            clip: args.clip,
        },
    };

    println!(
        "fsdp-fusion: {} {} ranks ({} replica(s) of {}{}), {} layers of width {}, {}, {} groups, limit {}, overlap {}, {} pass(es) per step ({:?}), gradients travel in {}",
        args.ranks,
        match args.backend {
            BackendKind::Cpu => "CPU",
            BackendKind::Cuda => "CUDA",
        },
        args.replicas,
        shard_size,
        args.experts.map_or(String::new(), |size| format!(
            ", experts in groups of {size}"
        )),
        args.layers,
        args.width,
        dtype,
        plan.groups().len(),
        args.limit,
        args.overlap,
        args.passes,
        config.accumulation,
        config.reduce_dtype
    );
    let bar = (args.steps > QUIET_AFTER).then(|| {
        let bar = ProgressBar::new(args.steps);
        bar.set_style(
            ProgressStyle::with_template("{bar:40} {pos}/{len} steps {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    });
    let every = if bar.is_some() { args.steps / 20 } else { 1 };
    // A bar drawing to a terminal keeps the lines above it; without a terminal it draws nothing.
    let say = |line: String| match &bar {
        Some(bar) if !bar.is_hidden() => bar.println(line),
        _ => println!("{line}"),
    };
    say(format!(
        "{:>6}  {:>14}  {:>14}  {:>12}  {:>12}  {:>20}",
        "step", "loss sharded", "loss reference", "grad norm", "reference", "max rel. param diff"
    ));
    let mut worst = 0f32;
    let on_step = |step: u64, c: &Comparison| -> fsdp_fusion::Result<()> {
        let (loss, diff) = (c.loss, c.difference);
        worst = worst.max(diff);
        if (step + 1) % every.max(1) == 0 || step == 0 {
            say(format!(
                "{:>6}  {loss:>14.7}  {:>14.7}  {:>12.6}  {:>12.6}  {diff:>20.3e}",
                step + 1,
                c.reference_loss,
                c.grad_norm,
                c.reference_grad_norm
            ));
        }
        if let Some(bar) = &bar {
            bar.set_message(format!("loss {loss:.6}"));
            bar.inc(1);
        }
        Ok(())
    };
    // An export without a save goes through a checkpoint of its own, named after it.
    let export_dir = args.export.as_ref().map(|file| match &args.save {
        Some(dir) => (dir.clone(), false),
        None => {
            let mut name = file.clone().into_os_string();
            name.push(".checkpoint");
            (PathBuf::from(name), true)
        }
    });
    // Refused before training, rather than after it: the export is a new file beside the
    // checkpoint it is made from (a temporary one new too).
    if let (Some(file), Some((dir, temporary))) = (&args.export, &export_dir) {
        fsdp_fusion::checkpoint::check_path(file, "the exported file")?;
        let absolute = |p: &PathBuf| std::path::absolute(p).unwrap_or_else(|_| p.clone());
        if absolute(file) == absolute(dir) {
            return Err(fsdp_fusion::Error::InvalidConfig {
                field: "export",
                reason: format!(
                    "is the checkpoint directory {}: name another file",
                    dir.display()
                ),
            });
        }
        // A link counts, dangling or not: the export never writes through one.
        let taken = [(file, true), (dir, *temporary)]
            .into_iter()
            .find(|(path, new)| *new && std::fs::symlink_metadata(path).is_ok());
        if let Some((path, _)) = taken {
            return Err(fsdp_fusion::Error::CheckpointExists {
                path: path.display().to_string(),
            });
        }
    }
    // Refused before training, rather than after it.
    if let Some(dir) = &args.save {
        fsdp_fusion::checkpoint::check_free(dir)?;
    }
    let checkpoints = Checkpoints {
        resume: args.resume.as_deref(),
        save: args
            .save
            .as_deref()
            .or(export_dir.as_ref().map(|(dir, _)| dir.as_path())),
    };
    let summaries = match (setup, args.experts) {
        (Setup::CpuLocal, Some(size)) if args.capture => {
            let ranks = expert_ranks(args.ranks, size, fsdp_fusion::LocalComm::group, |rank| {
                fsdp_fusion::CpuBackend::asynchronous(rank as u64)
            })?;
            training.compare_captured(ranks, checkpoints, on_step)?
        }
        (Setup::CpuLocal, None) if args.capture => {
            let ranks = Hybrid::grid(args.replicas, shard_size, fsdp_fusion::LocalComm::group)?
                .into_iter()
                .enumerate()
                .map(|(rank, c)| {
                    let backend = fsdp_fusion::CpuBackend::asynchronous(rank as u64)?;
                    Ok((backend, c, Vec::new()))
                })
                .collect::<fsdp_fusion::Result<Vec<_>>>()?;
            training.compare_captured(ranks, checkpoints, on_step)?
        }
        (_, _) if args.capture => {
            return Err(fsdp_fusion::Error::InvalidConfig {
                field: "capture",
                reason:
                    "needs the model's math queued on a stream, and the example model computes \
                         on the host, which only the CPU backend's streams can run: use \
                         --backend cpu"
                        .into(),
            });
        }
        (Setup::CpuLocal, Some(size)) => {
            let ranks = expert_ranks(args.ranks, size, fsdp_fusion::LocalComm::group, |_| {
                Ok(fsdp_fusion::CpuBackend::new())
            })?;
            training.compare_in_process_groups(ranks, checkpoints, on_step)?
        }
        (Setup::CudaLoopback, Some(size)) => {
            let ranks = expert_ranks(args.ranks, size, LoopbackComm::group, |_| {
                CudaBackend::new(0)
            })?;
            training.compare_in_process_groups(ranks, checkpoints, on_step)?
        }
        (Setup::CudaNccl, Some(_)) => {
            let timeout = fsdp_fusion::watch::DEFAULT_TIMEOUT;
            let ranks = on_each_gpu(args.ranks, |c| {
                let groups = c.process_groups(plan.process_groups(), timeout)?;
                Ok((CudaBackend::new(c.device())?, c, groups))
            })?;
            training.compare_in_process_groups(ranks, checkpoints, on_step)?
        }
        (Setup::CpuLocal, None) => {
            let ranks = Hybrid::grid(args.replicas, shard_size, fsdp_fusion::LocalComm::group)?
                .into_iter()
                .map(|c| (fsdp_fusion::CpuBackend::new(), c))
                .collect();
            training.compare_with(ranks, checkpoints, on_step)?
        }
        (Setup::CudaLoopback, None) => {
            let ranks = Hybrid::grid(args.replicas, shard_size, LoopbackComm::group)?
                .into_iter()
                .map(|c| Ok((CudaBackend::new(0)?, c)))
                .collect::<fsdp_fusion::Result<Vec<_>>>()?;
            training.compare_with(ranks, checkpoints, on_step)?
        }
        (Setup::CudaNccl, None) => {
            let timeout = fsdp_fusion::watch::DEFAULT_TIMEOUT;
            let ranks = on_each_gpu(args.ranks, |c| {
                let hybrid = c.hybrid(args.replicas, timeout)?;
                Ok((CudaBackend::new(c.device())?, hybrid))
            })?;
            training.compare_with(ranks, checkpoints, on_step)?
        }
    };
    if let Some(dir) = &args.save {
        println!("saved every rank's state into {}", dir.display());
    }
    if let (Some(file), Some((dir, temporary))) = (&args.export, &export_dir) {
        let exported = fsdp_fusion::export::export_checkpoint(dir, file);
        if *temporary {
            let _ = std::fs::remove_dir_all(dir);
        }
        exported?;
        println!("exported the model to {}", file.display());
    }
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    println!(
        "largest relative parameter difference, sharded vs reference, over all steps: {worst:.3e}"
    );
    let predicted = Policy::new(&plan, &config)?.memory;
    println!(
        "bytes per rank: measured peak vs plan (shards {}, grad shards {}, optimizer state {}, gather slots {}, grad slots {}, grad accumulators {})",
        predicted.param_shards,
        predicted.grad_shards,
        predicted.optimizer_state,
        predicted.gathered_slots,
        predicted.grad_slots,
        predicted.grad_accumulators
    );
    for (rank, s) in summaries.iter().enumerate() {
        println!(
            "  rank {rank}: {:>10} measured, {:>10} predicted ({:.1}%); {} all-gathers ({} prefetched, {} reuses), {} reduce-scatters",
            s.memory.peak,
            predicted.peak,
            100.0 * s.memory.peak as f64 / predicted.peak as f64,
            s.counters.all_gathers,
            s.counters.prefetches,
            s.counters.reuses,
            s.counters.reduce_scatters
        );
    }
    Ok(())
}

/// Every rank's backend (`backend(rank)`), communicator and expert group's communicator, the
/// groups of `size` ranks, from `group(n)`, which makes the handles of one group of `n` ranks.
fn expert_ranks<B, C>(
    ranks: usize,
    size: usize,
    mut group: impl FnMut(usize) -> fsdp_fusion::Result<Vec<C>>,
    backend: impl Fn(usize) -> fsdp_fusion::Result<B>,
) -> fsdp_fusion::Result<Vec<(B, C, Vec<C>)>> {
    let experts = process_group_comms(ranks, size, &mut group)?;
    group(ranks)?
        .into_iter()
        .zip(experts)
        .enumerate()
        .map(|(rank, (comm, expert))| Ok((backend(rank)?, comm, vec![expert])))
        .collect()
}

/// An NCCL group of `ranks` GPUs (rank r on GPU r), each rank's communicator then given to
/// `make` on a thread of its own: the splits in it are collectives of every rank at once.
fn on_each_gpu<T: Send>(
    ranks: usize,
    make: impl Fn(NcclComm) -> fsdp_fusion::Result<T> + Sync,
) -> fsdp_fusion::Result<Vec<T>> {
    let devices: Vec<usize> = (0..ranks).collect();
    let comms = NcclComm::group(&devices, fsdp_fusion::watch::DEFAULT_TIMEOUT)?;
    std::thread::scope(|s| {
        let made: Vec<_> = comms.into_iter().map(|c| s.spawn(|| make(c))).collect();
        made.into_iter()
            .enumerate()
            .map(|(rank, made)| {
                made.join()
                    .map_err(|_| fsdp_fusion::Error::RankPanicked { rank })?
            })
            .collect()
    })
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
