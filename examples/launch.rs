//! One rank of a run launched like torchrun, one process per GPU: its place from `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR` and `MASTER_PORT`, the NCCL unique id from rank 0
//! over TCP. Trains the example model (hybrid sharding with `--replicas`); after every step
//! every rank gathers the whole model and rank 0 compares it with the unsharded reference of as
//! many ranks, which it runs itself. Exits non-zero when they differ by more than `--tolerance`.
//!
//! ```sh
//! torchrun --nproc-per-node 8 .gpu/bin/launch --replicas 2
//! RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29512 .gpu/bin/launch
//! ```

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use fsdp_fusion::backend::cuda::CudaBackend;
use fsdp_fusion::comm::launch::LaunchEnv;
use fsdp_fusion::comm::nccl::NcclComm;
use fsdp_fusion::{Communicator, DType, Engine, EngineConfig, ParamId, Plan};
use fsdp_fusion_support::mlp::{Mlp, MlpConfig, Recipe, Reference, load, sharded_step};
use fsdp_fusion_support::values::{max_relative_difference, widen};

#[derive(Parser)]
#[command(about = "One rank of the example model's training, launched like torchrun")]
struct Args {
    /// Hybrid sharding: replicas of `WORLD_SIZE / replicas` ranks each.
    #[arg(long, default_value_t = 1)]
    replicas: usize,
    #[arg(long, default_value_t = 10)]
    steps: u64,
    /// The largest relative parameter difference from the reference allowed.
    #[arg(long, default_value_t = 1e-5)]
    tolerance: f32,
    /// Seconds each exchange and NCCL's init may take.
    #[arg(long, default_value_t = 300)]
    timeout: u64,
}

fn main() -> ExitCode {
    match run(&Args::parse()) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// Every parameter's values, from every group gathered whole.
fn full_model<C: Communicator<CudaBackend>>(
    engine: &mut Engine<CudaBackend, C>,
) -> fsdp_fusion::Result<Vec<Vec<f32>>> {
    let plan = engine.plan().clone();
    let groups = (0..plan.groups().len())
        .map(|g| engine.gather_group(g))
        .collect::<fsdp_fusion::Result<Vec<_>>>()?;
    (0..plan.params().len())
        .map(|i| {
            let id = ParamId(i);
            let layout = plan.param(id)?;
            let group = &groups[layout.group()];
            let part = group.len() / plan.group(layout.group())?.shards();
            let shards: Vec<Vec<u8>> = group.chunks(part.max(1)).map(<[u8]>::to_vec).collect();
            Ok(widen(layout.dtype(), &plan.assemble_param(id, &shards)?))
        })
        .collect()
}

fn run(args: &Args) -> fsdp_fusion::Result<bool> {
    let env = LaunchEnv::from_env()?;
    let timeout = Duration::from_secs(args.timeout);
    let shard_size = fsdp_fusion::comm::hybrid::shard_size(env.world_size, args.replicas)?;
    let model = Mlp::new(MlpConfig {
        layers: 4,
        width: 64,
        inputs: 32,
        batch: 16,
        dtype: DType::Bf16,
        seed: 7,
        embed_lr_scale: 0.5,
    });
    let plan = Arc::new(Plan::hybrid(&model.spec()?, args.replicas, shard_size)?);
    let config = EngineConfig {
        timeout,
        ..EngineConfig::default()
    };
    let init = model.init(1);
    let backend = CudaBackend::new(env.local_rank)?;
    let world = NcclComm::from_launch(&env, &backend, timeout)?;
    let comm = world.hybrid(args.replicas, timeout)?;
    drop(world);
    let mut engine = Engine::new(Arc::clone(&plan), config.clone(), backend, comm)?;
    load(&mut engine, &init)?;
    let mut reference = (env.rank == 0)
        .then(|| {
            Reference::hybrid(
                model.clone(),
                &init,
                (args.replicas, shard_size),
                &config,
                Recipe::default(),
            )
        })
        .transpose()?;
    let base_lr = config.optimizer.lr();
    let mut worst = 0f32;
    for step in 0..args.steps {
        let (loss, _) = sharded_step(&model, &mut engine, (step, 1), base_lr, Recipe::default())?;
        let values = full_model(&mut engine)?;
        if let Some(reference) = reference.as_mut() {
            let (reference_loss, _) = reference.step(step, 1)?;
            let difference = max_relative_difference(&values, reference.values());
            worst = worst.max(difference);
            println!(
                "step {step}: rank 0 loss {loss:.6}, reference (all ranks) {reference_loss:.6}, parameter difference {difference:.3e}"
            );
        }
    }
    if env.rank == 0 {
        println!(
            "{} ranks ({} replica(s) of {shard_size}): largest relative parameter difference {worst:.3e}",
            env.world_size, args.replicas
        );
    }
    Ok(worst <= args.tolerance)
}
