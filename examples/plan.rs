//! Prints the plan of a model file: groups, params, padding and the bytes each rank holds.
//!
//! cargo run --release --example plan -- --model examples/models/tiny.json --world-size 4 [--json]
//!     [--param-storage master-only (or master)] [--grad-shards per-step] [--moment-dtype bf16]
//!     [--step-in-backward]

use std::io::{self, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use fsdp_fusion::plan::ALIGNMENT_BYTES;
use fsdp_fusion::{
    DType, EngineConfig, GradShardMemory, ModelSpec, OptimizerConfig, ParamStorage, Plan, Policy,
};

/// What a trainable group keeps of its parameters (`EngineConfig::param_storage`).
#[derive(Clone, Copy, ValueEnum)]
enum Storage {
    /// A shard in the parameter's dtype beside the fp32 master.
    ShardAndMaster,
    /// The fp32 master only; gathers cast it (`master`, as the Python package names it).
    #[value(alias = "master")]
    MasterOnly,
}

/// When the fp32 gradient shards live (`EngineConfig::grad_shard_memory`).
#[derive(Clone, Copy, ValueEnum)]
enum GradShards {
    /// With the engine.
    Persistent,
    /// From a step's first gradient of their group to the step's end.
    PerStep,
}

/// The dtype of AdamW's moments (`EngineConfig::moment_dtype`).
#[derive(Clone, Copy, ValueEnum)]
enum MomentDtype {
    F32,
    Bf16,
}

#[derive(Parser)]
#[command(about = "Print how fsdp-fusion groups, pads and shards a model")]
struct Args {
    /// Model file: {"params": [{"name", "shape", "dtype", "unit"?, "trainable"?, "tied"?}]}
    #[arg(long)]
    model: PathBuf,
    #[arg(long)]
    world_size: usize,
    /// Gathered buffers kept at once (double_buffer_limit).
    #[arg(long, default_value_t = 2)]
    limit: usize,
    /// Gradient reduce-scatters in flight.
    #[arg(long, default_value_t = 2)]
    reduces: usize,
    /// adamw or sgd: decides the optimizer state counted per rank.
    #[arg(long, default_value = "adamw")]
    optimizer: String,
    #[arg(long, value_enum, default_value_t = Storage::ShardAndMaster)]
    param_storage: Storage,
    #[arg(long, value_enum, default_value_t = GradShards::Persistent)]
    grad_shards: GradShards,
    #[arg(long, value_enum, default_value_t = MomentDtype::F32)]
    moment_dtype: MomentDtype,
    /// The optimizer steps in the backward (`EngineConfig::step_in_backward`): with per-step
    /// gradient shards, the step holds those of the groups in flight only.
    #[arg(long)]
    step_in_backward: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn mib(bytes: usize) -> String {
    format!("{:>10.3} MiB", bytes as f64 / (1 << 20) as f64)
}

/// Why the example stopped early.
enum Stop {
    Plan(fsdp_fusion::Error),
    Output(io::Error),
}

impl From<fsdp_fusion::Error> for Stop {
    fn from(e: fsdp_fusion::Error) -> Stop {
        Stop::Plan(e)
    }
}

impl From<io::Error> for Stop {
    fn from(e: io::Error) -> Stop {
        Stop::Output(e)
    }
}

fn run(args: &Args, out: &mut impl Write) -> Result<(), Stop> {
    let model = ModelSpec::from_path(&args.model)?;
    let plan = Plan::new(&model, args.world_size)?;
    let optimizer = match args.optimizer.as_str() {
        "adamw" => OptimizerConfig::default(),
        "sgd" => OptimizerConfig::sgd(0.01),
        other => {
            return Err(Stop::Plan(fsdp_fusion::Error::InvalidConfig {
                field: "optimizer",
                reason: format!("is {other:?}, expected adamw or sgd"),
            }));
        }
    };
    let config = EngineConfig {
        double_buffer_limit: args.limit,
        max_reduces_in_flight: args.reduces,
        optimizer,
        param_storage: match args.param_storage {
            Storage::ShardAndMaster => ParamStorage::ShardAndMaster,
            Storage::MasterOnly => ParamStorage::MasterOnly,
        },
        grad_shard_memory: match args.grad_shards {
            GradShards::Persistent => GradShardMemory::Persistent,
            GradShards::PerStep => GradShardMemory::PerStep,
        },
        moment_dtype: match args.moment_dtype {
            MomentDtype::F32 => DType::F32,
            MomentDtype::Bf16 => DType::Bf16,
        },
        step_in_backward: args.step_in_backward,
        ..EngineConfig::default()
    };
    config.validate()?;
    if args.json {
        writeln!(out, "{:#}", plan.to_json(&Policy::new(&plan, &config)?))?;
        return Ok(());
    }
    writeln!(
        out,
        "{}: {} params, world size {}, alignment {} bytes",
        args.model.display(),
        plan.params().len(),
        plan.world_size(),
        ALIGNMENT_BYTES
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "{:>5}  {:<5}  {:<9}  {:<5}  {:<4}  {:<14}  {:>6}  {:>12}  {:>12}  {:>12}  {:>8}",
        "group",
        "dtype",
        "trainable",
        "unit",
        "tied",
        "sharded over",
        "params",
        "numel",
        "padded",
        "shard",
        "padding"
    )?;
    let (mut numel_all, mut padded_all) = (0usize, 0usize);
    for g in plan.groups() {
        let numel: usize = g.params().iter().map(|&p| plan.params()[p.0].numel()).sum();
        numel_all += numel;
        padded_all += g.padded_numel();
        writeln!(
            out,
            "{:>5}  {:<5}  {:<9}  {:<5}  {:<4}  {:<14}  {:>6}  {:>12}  {:>12}  {:>12}  {:>7.1}%",
            g.index(),
            g.dtype().name(),
            if g.trainable() { "yes" } else { "frozen" },
            g.unit().layer().map_or("-".to_string(), |u| u.to_string()),
            if g.tied() { "yes" } else { "" },
            match g.process_group() {
                Some(pg) => format!("{} {}", g.shards(), plan.process_groups()[pg].name),
                None => format!("{} (world)", g.shards()),
            }
            .escape_debug()
            .to_string(),
            g.params().len(),
            numel,
            g.padded_numel(),
            g.shard_numel(),
            overhead(numel, g.padded_numel())
        )?;
    }
    writeln!(out)?;
    writeln!(
        out,
        "{:>5}  {:<28}  {:<14}  {:>12}  {:>12}  {:>12}",
        "group", "param", "shape", "numel", "offset", "padded"
    )?;
    for g in plan.groups() {
        for &id in g.params() {
            let p = &plan.params()[id.0];
            writeln!(
                out,
                "{:>5}  {:<28}  {:<14}  {:>12}  {:>12}  {:>12}",
                g.index(),
                // Names are the caller's text: control characters are shown escaped.
                p.name().escape_debug().to_string(),
                format!("{:?}", p.shape()),
                p.numel(),
                p.offset(),
                p.padded_numel()
            )?;
        }
    }
    let policy = Policy::new(&plan, &config)?;
    let m = policy.memory;
    writeln!(out)?;
    writeln!(
        out,
        "padding overhead: {:.2}% ({} of {} elements)",
        overhead(numel_all, padded_all),
        padded_all - numel_all,
        padded_all
    )?;
    writeln!(
        out,
        "bytes per rank (limit {}, {} reduce-scatters in flight, {}, {} storage, {} gradient \
         shards, {} moments):",
        args.limit,
        args.reduces,
        args.optimizer,
        name(args.param_storage),
        name(args.grad_shards),
        name(args.moment_dtype),
    )?;
    for b in policy.buffer_report() {
        writeln!(
            out,
            "  {:<22} {:>4} x, {} ({} bytes): {}",
            b.what,
            b.count,
            mib(b.bytes),
            b.bytes,
            b.why
        )?;
    }
    for (what, bytes) in [("peak", m.peak), ("between steps", m.between_steps)] {
        writeln!(out, "  {what:<22}         {} ({bytes} bytes)", mib(bytes))?;
    }
    Ok(())
}

/// An option's value as it is written on the command line.
fn name(value: impl ValueEnum) -> String {
    value
        .to_possible_value()
        .map_or_else(String::new, |v| v.get_name().to_owned())
}

fn overhead(numel: usize, padded: usize) -> f64 {
    if numel == 0 {
        0.0
    } else {
        100.0 * (padded - numel) as f64 / numel as f64
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args, &mut io::stdout().lock()) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away (`| head`): nothing more to say.
        Err(Stop::Output(e)) if e.kind() == io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(Stop::Output(e)) => {
            eprintln!("error: cannot write the plan: {e}");
            ExitCode::FAILURE
        }
        Err(Stop::Plan(e)) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
