//! Checkpoint throughput on CPU ranks against the machine's own limits, measured in the same run:
//! a save of `--ranks` ranks (each writing and flushing its own file) beside the same bytes
//! written and flushed by as many threads with nothing else to do; a load at the same world size
//! and a resharding load at one rank fewer beside a load of the same state saved at that world
//! size, all from the page cache, beside the same files read whole on as many threads. Each model is bf16 with AdamW (4 + 4 + 4 bytes of state a parameter).
//!
//!     cargo bench --bench checkpoint -- --gib 4 --ranks 4 --dir /tmp/ckpt-bench

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use fsdp_fusion::{CpuBackend, DType, Engine, EngineConfig, Input, LocalComm, ModelSpec};
use fsdp_fusion::{ParamId, ParamSpec, Plan};
use fsdp_fusion_support::ranks::on_threads;

#[derive(Parser)]
struct Args {
    /// GiB of state (masters and moments) in the checkpoint.
    #[arg(long, default_value_t = 2.0)]
    gib: f64,
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    #[arg(long, default_value = "/tmp/fsdp-fusion-checkpoint-bench")]
    dir: PathBuf,
    /// Accepted for `cargo bench`'s own flag.
    #[arg(long, hide = true)]
    bench: bool,
}

/// Units of one bf16 parameter of `numel` elements each, `count` of them.
fn spec(count: usize, numel: u64) -> ModelSpec {
    let params = (0..count)
        .map(|i| ParamSpec::new(format!("w{i}"), &[numel], DType::Bf16).in_unit(i as u32))
        .collect();
    ModelSpec::new(params).unwrap()
}

/// Runs `f` on an engine of every rank of `plan`; the seconds from the first rank's start to the
/// last one's end.
fn on_engines(plan: &Arc<Plan>, f: impl Fn(&mut Engine<CpuBackend, LocalComm>) + Sync) -> f64 {
    let comms = LocalComm::group(plan.world_size()).unwrap();
    let engines = on_threads(comms, |_, comm| {
        Engine::new(
            Arc::clone(plan),
            EngineConfig::default(),
            CpuBackend::new(),
            comm,
        )
        .unwrap()
    });
    let start = Instant::now();
    on_threads(engines, |_, mut e| f(&mut e));
    start.elapsed().as_secs_f64()
}

/// Seconds for `files.len()` threads to each write and flush `bytes` bytes into its own file.
fn write_limit(files: &[PathBuf], bytes: u64) -> f64 {
    let chunk = vec![0x5au8; 4 << 20];
    let start = Instant::now();
    on_threads(files.to_vec(), |_, path| {
        let mut f = std::fs::File::create(&path).unwrap();
        let mut left = bytes;
        while left > 0 {
            let n = left.min(chunk.len() as u64) as usize;
            f.write_all(&chunk[..n]).unwrap();
            left -= n as u64;
        }
        f.sync_all().unwrap();
    });
    let seconds = start.elapsed().as_secs_f64();
    files.iter().for_each(|f| std::fs::remove_file(f).unwrap());
    seconds
}

/// Seconds to read `files` whole, one thread each.
fn read_limit(files: Vec<PathBuf>) -> f64 {
    let start = Instant::now();
    on_threads(files, |_, path| std::fs::read(path).unwrap().len());
    start.elapsed().as_secs_f64()
}

fn checkpoint_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

fn main() {
    let args = Args::parse();
    let ranks = args.ranks.max(2);
    let _ = std::fs::remove_dir_all(&args.dir);
    std::fs::create_dir_all(&args.dir).unwrap();
    // 12 bytes of state a parameter, in 16 units.
    let numel = ((args.gib * (1u64 << 30) as f64) / 12.0 / 16.0) as u64;
    let model = spec(16, numel);
    let plan = |world| Arc::new(Plan::new(&model, world).unwrap());
    let saved = args.dir.join("saved");
    let values: Vec<u8> = (0..numel * 2).map(|i| (i % 251) as u8).collect();
    let save = on_engines(&plan(ranks), |e| {
        for i in 0..16 {
            e.load_param(ParamId(i), Input::host_bytes(&values, DType::Bf16))
                .unwrap();
        }
        e.save(&saved).unwrap();
    });
    // `save` includes loading the values; time them alone.
    let fill = on_engines(&plan(ranks), |e| {
        for i in 0..16 {
            e.load_param(ParamId(i), Input::host_bytes(&values, DType::Bf16))
                .unwrap();
        }
    });
    let save = save - fill;
    let bytes = checkpoint_bytes(&saved);
    let gb = bytes as f64 / 1e9;
    let limit_files: Vec<PathBuf> = (0..ranks)
        .map(|r| args.dir.join(format!("limit-{r}")))
        .collect();
    let write = write_limit(&limit_files, bytes / ranks as u64);
    let files: Vec<PathBuf> = (0..ranks)
        .map(|r| fsdp_fusion::checkpoint::data_path(&saved, r))
        .collect();
    let read = read_limit(files);
    let load = on_engines(&plan(ranks), |e| e.load(&saved).unwrap());
    let reshard = on_engines(&plan(ranks - 1), |e| e.load(&saved).unwrap());
    // The same state saved at the resharding load's world size, loaded there.
    let fewer = args.dir.join("fewer");
    on_engines(&plan(ranks - 1), |e| e.save(&fewer).unwrap());
    let same = on_engines(&plan(ranks - 1), |e| e.load(&fewer).unwrap());
    println!(
        "{gb:.2} GB of checkpoint, {ranks} CPU ranks ({} cores), from the page cache but the save",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let row = |what: &str, seconds: f64, limit: f64| {
        println!(
            "{what:<34} {seconds:7.2} s {:7.2} GB/s  {:.2} of the limit",
            gb / seconds,
            limit / seconds
        );
    };
    println!(
        "{:<34} {:7.2} s {:7.2} GB/s",
        "limit: write and flush, per rank",
        write,
        gb / write
    );
    println!(
        "{:<34} {:7.2} s {:7.2} GB/s",
        "limit: read the files whole",
        read,
        gb / read
    );
    row("save", save, write);
    row(&format!("load at {ranks} ranks"), load, read);
    row(
        &format!("load at {} ranks of its save", ranks - 1),
        same,
        read,
    );
    row(
        &format!("resharding load at {} ranks", ranks - 1),
        reshard,
        read,
    );
    println!(
        "resharding load / load of the same bytes at {} ranks: {:.2} of the time",
        ranks - 1,
        reshard / same
    );
    let _ = std::fs::remove_dir_all(&args.dir);
}
