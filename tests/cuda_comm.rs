//! The GPU communicators: the loopback one (N ranks on one GPU) against `LocalComm` on the CPU,
//! bit for bit, collective by collective and through whole training runs; NCCL at world size 1.
//! Tests marked "needs a CUDA GPU" run on the GPU machine; the others run everywhere.
//!
//! Collectives and the backends' data operations are `unsafe` because they run after they return:
//! each scenario orders its streams with events (or uses a buffer on one stream only) and reads
//! results with a download, which orders itself after every stream.

use std::fmt::Debug;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fsdp_fusion::backend::cuda::CudaBackend;
use fsdp_fusion::backend::{Backend, Input, Region};
use fsdp_fusion::comm::launch::LaunchEnv;
use fsdp_fusion::comm::loopback::LoopbackComm;
use fsdp_fusion::comm::nccl::{Collective, NcclComm, nccl_version};
use fsdp_fusion::comm::{Purpose, Tag};
use fsdp_fusion::types::Stream;
use fsdp_fusion::watch::DEFAULT_TIMEOUT;
use fsdp_fusion::{
    Communicator, Counters, CpuBackend, DType, Engine, EngineConfig, Error, LocalComm, ModelSpec,
    OptimizerConfig, ParamSpec, Plan, Unit,
};
use fsdp_fusion_support::faults::{Faulty, is_injected};
use fsdp_fusion_support::ranks::on_threads;
use fsdp_fusion_support::rng::Rng;
use fsdp_fusion_support::values::narrow;

const WORLD_SIZES: [usize; 5] = [1, 2, 3, 4, 8];
const DTYPES: [DType; 3] = [DType::Bf16, DType::F16, DType::F32];

/// The tag of the `seq`th collective of a test's step 0, for group 0.
fn tag(seq: u64) -> Tag {
    Tag {
        purpose: Purpose::Group(0),
        step: 0,
        seq,
    }
}

fn gpu() -> CudaBackend {
    CudaBackend::new(0).unwrap_or_else(|e| panic!("a CUDA backend on device 0: {e}"))
}

/// A buffer of `bytes` holding `data` from element `offset` on (elements of `dtype`).
fn buffer<B: Backend>(b: &B, bytes: usize, offset: usize, dtype: DType, data: &[u8]) -> B::Buffer {
    let mut buf = b.alloc(bytes).unwrap();
    let region = Region::new(offset, data.len() / dtype.size(), dtype);
    b.upload(&mut buf, region, data).unwrap();
    buf
}

/// Every byte of a buffer of `bytes` bytes (an even number).
fn read<B: Backend>(b: &B, buf: &B::Buffer, bytes: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes];
    b.download(buf, Region::new(0, bytes / 2, DType::Bf16), &mut out)
        .unwrap_or_else(|e| panic!("{} download of {bytes} bytes: {e}", b.name()));
    out
}

/// One rank's part of a test, the same code on both backends; returns what to compare.
trait Scenario: Sync {
    type Out: PartialEq + Debug + Send;
    fn run<B: Backend, C: Communicator<B>>(&self, b: &B, c: &mut C) -> Self::Out;
}

/// Runs `s` on `world` CPU ranks (`LocalComm`) and `world` GPU ranks (`LoopbackComm`, one GPU)
/// and checks that every rank's outputs are equal.
fn loopback_equals_local<S: Scenario>(world: usize, s: &S, what: &str) {
    let cpu = on_threads(LocalComm::group(world).unwrap(), |_, mut c| {
        s.run(&CpuBackend::new(), &mut c)
    });
    let gpu = on_threads(LoopbackComm::group(world).unwrap(), |_, mut c| {
        s.run(&gpu(), &mut c)
    });
    for (rank, (cpu, gpu)) in cpu.iter().zip(&gpu).enumerate() {
        assert!(
            cpu == gpu,
            "{what}, world size {world}: rank {rank} differs from the CPU"
        );
    }
}

/// An all-gather of `len` elements per rank, from and into regions that start inside their
/// buffers; the rest of the output holds a pattern that must survive.
struct AllGather {
    dtype: DType,
    len: usize,
}

impl Scenario for AllGather {
    type Out = Vec<u8>;

    fn run<B: Backend, C: Communicator<B>>(&self, b: &B, c: &mut C) -> Vec<u8> {
        let (dtype, len, world) = (self.dtype, self.len, c.world_size());
        let size = dtype.size();
        let data = narrow(dtype, &Rng::new(c.rank() as u64 + 1).wide_values(len));
        let shard = buffer(b, (5 + len) * size, 5, dtype, &data);
        let out_bytes = (9 + world * len + 3) * size;
        let pattern = narrow(dtype, &Rng::new(99).wide_values(out_bytes / size));
        let mut out = buffer(b, out_bytes, 0, dtype, &pattern);
        let (shard_region, out_region) = (
            Region::new(5, len, dtype),
            Region::new(9, world * len, dtype),
        );
        unsafe {
            c.all_gather(
                b,
                Stream::Gather,
                tag(0),
                &shard,
                shard_region,
                &mut out,
                out_region,
            )
        }
        .unwrap();
        read(b, &out, out_bytes)
    }
}

/// An in-place all-gather of `len` elements per rank in a region that starts inside its buffer:
/// each rank writes only its own part; the rest of the buffer holds a pattern that must survive.
struct AllGatherInPlace {
    dtype: DType,
    len: usize,
}

impl Scenario for AllGatherInPlace {
    type Out = Vec<u8>;

    fn run<B: Backend, C: Communicator<B>>(&self, b: &B, c: &mut C) -> Vec<u8> {
        let (dtype, len, world, rank) = (self.dtype, self.len, c.world_size(), c.rank());
        let size = dtype.size();
        let bytes = (9 + world * len + 3) * size;
        let pattern = narrow(dtype, &Rng::new(99).wide_values(bytes / size));
        let mut buf = buffer(b, bytes, 0, dtype, &pattern);
        let own = narrow(dtype, &Rng::new(rank as u64 + 1).wide_values(len));
        b.upload(&mut buf, Region::new(9 + rank * len, len, dtype), &own)
            .unwrap();
        let region = Region::new(9, world * len, dtype);
        unsafe { c.all_gather_in_place(b, Stream::Gather, tag(0), &mut buf, region) }.unwrap();
        read(b, &buf, bytes)
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_all_gather_in_place_equals_local_comm() {
    for world in WORLD_SIZES {
        for dtype in DTYPES {
            for len in [1, 1003, 1 << 16] {
                let what = format!("in-place all-gather of {len} {dtype}");
                loopback_equals_local(world, &AllGatherInPlace { dtype, len }, &what);
            }
        }
    }
}

/// An in-place reduce-scatter of a region of `dtype` inside its buffer.
struct ReduceScatter {
    dtype: DType,
    part: usize,
}

impl Scenario for ReduceScatter {
    type Out = Vec<u8>;

    fn run<B: Backend, C: Communicator<B>>(&self, b: &B, c: &mut C) -> Vec<u8> {
        let (world, part, dtype) = (c.world_size(), self.part, self.dtype);
        let values = Rng::new(c.rank() as u64 + 7).wide_values(3 + world * part + 5);
        let bytes = values.len() * dtype.size();
        let mut buf = buffer(b, bytes, 0, dtype, &narrow(dtype, &values));
        let region = Region::new(3, world * part, dtype);
        // A scale other than 1 takes NCCL's premultiplied sum and the loopback kernel's scaling.
        unsafe { c.reduce_scatter(b, Stream::Reduce, tag(0), &mut buf, region, 0.5) }.unwrap();
        read(b, &buf, bytes)
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_all_gather_equals_local_comm() {
    for world in WORLD_SIZES {
        for dtype in DTYPES {
            for len in [1, 1003, 1 << 16] {
                let what = format!("all-gather of {len} {dtype}");
                loopback_equals_local(world, &AllGather { dtype, len }, &what);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_reduce_scatter_equals_local_comm_in_rank_order() {
    for world in WORLD_SIZES {
        for dtype in [DType::F32, DType::Bf16] {
            for part in [1, 1001, 1 << 16] {
                let what = format!("reduce-scatter of {part} {dtype} per rank");
                loopback_equals_local(world, &ReduceScatter { dtype, part }, &what);
            }
        }
    }
}

/// An in-place all-reduce of a region of `dtype` inside its buffer, twice: the second of a
/// region larger than the first (the loopback scratch grows while the first's readers may run).
struct AllReduce {
    dtype: DType,
    len: usize,
}

impl Scenario for AllReduce {
    type Out = Vec<u8>;

    fn run<B: Backend, C: Communicator<B>>(&self, b: &B, c: &mut C) -> Vec<u8> {
        let (len, dtype) = (self.len, self.dtype);
        let values = Rng::new(c.rank() as u64 + 11).wide_values(3 + 2 * len + 5);
        let bytes = values.len() * dtype.size();
        let mut buf = buffer(b, bytes, 0, dtype, &narrow(dtype, &values));
        let first = Region::new(3, len, dtype);
        let second = Region::new(3, 2 * len, dtype);
        unsafe { c.all_reduce(b, Stream::Reduce, tag(0), &mut buf, first, 0.5) }.unwrap();
        unsafe { c.all_reduce(b, Stream::Reduce, tag(1), &mut buf, second, 1.0) }.unwrap();
        read(b, &buf, bytes)
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_all_reduce_equals_local_comm_in_rank_order() {
    for world in WORLD_SIZES {
        for dtype in [DType::F32, DType::Bf16] {
            for len in [1, 1001, 1 << 16] {
                let what = format!("all-reduce of {len} {dtype}");
                loopback_equals_local(world, &AllReduce { dtype, len }, &what);
            }
        }
    }
}

/// Rounds of all-gather then reduce-scatter, each rank changing its inputs right before and right
/// after every collective on the collective's own stream. A collective that read a rank's buffer
/// before that rank's stream reached it, or after it moved on, gives different bytes than the
/// CPU, where everything runs in program order.
struct BackToBack {
    part: usize,
    rounds: usize,
}

impl Scenario for BackToBack {
    type Out = (Vec<u8>, Vec<u8>, Vec<u8>, u64);

    fn run<B: Backend, C: Communicator<B>>(&self, b: &B, c: &mut C) -> Self::Out {
        let (world, part, rank) = (c.world_size(), self.part, c.rank());
        let f32s = |n: usize, seed: u64| narrow(DType::F32, &Rng::new(seed).wide_values(n));
        let whole = Region::new(0, world * part, DType::F32);
        let own = Region::new(rank * part, part, DType::F32);
        let shard_region = Region::new(0, part, DType::F32);
        let delta = buffer(b, part * 4, 0, DType::F32, &f32s(part, 100 + rank as u64));
        let mut shard = buffer(b, part * 4, 0, DType::F32, &f32s(part, 200 + rank as u64));
        let mut out = b.alloc(world * part * 4).unwrap();
        let mut grads = b.alloc(world * part * 4).unwrap();
        let mut sums = b.alloc(part * 4).unwrap();
        let waits_before = b.host_waits();
        for round in 0..self.rounds as u64 {
            let g = Stream::Gather;
            unsafe { b.accumulate(g, &delta, shard_region, &mut shard, shard_region, 1.0, true) }
                .unwrap();
            unsafe { c.all_gather(b, g, tag(2 * round), &shard, shard_region, &mut out, whole) }
                .unwrap();
            unsafe {
                b.accumulate(
                    g,
                    &delta,
                    shard_region,
                    &mut shard,
                    shard_region,
                    -0.5,
                    true,
                )
            }
            .unwrap();
            let gathered = b.record(g).unwrap();
            let r = Stream::Reduce;
            b.wait(r, &gathered).unwrap();
            unsafe { b.accumulate(r, &out, whole, &mut grads, whole, 0.75, true) }.unwrap();
            unsafe { c.reduce_scatter(b, r, tag(2 * round + 1), &mut grads, whole, 1.0) }.unwrap();
            unsafe { b.accumulate(r, &grads, own, &mut sums, shard_region, 1.0, true) }.unwrap();
            unsafe { b.zero(r, &mut grads, whole) }.unwrap();
            // The next all-gather overwrites `out`, which the reduce stream read this round.
            let reduced = b.record(r).unwrap();
            b.wait(g, &reduced).unwrap();
        }
        let waits = b.host_waits() - waits_before;
        let n = world * part * 4;
        (
            read(b, &shard, part * 4),
            read(b, &out, n),
            read(b, &sums, part * 4),
            waits,
        )
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_back_to_back_collectives_keep_every_ranks_order() {
    for world in WORLD_SIZES {
        let s = BackToBack {
            part: 1 << 18,
            rounds: 6,
        };
        loopback_equals_local(world, &s, "back-to-back collectives");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_collectives_never_block_the_host() {
    let s = BackToBack {
        part: 4096,
        rounds: 3,
    };
    let waits = on_threads(LoopbackComm::group(4).unwrap(), |_, mut c| {
        s.run(&gpu(), &mut c).3
    });
    assert_eq!(
        waits,
        vec![0; 4],
        "host waits per rank during the collectives"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_mismatched_collectives_are_reported_on_every_rank() {
    let results = on_threads(LoopbackComm::group(2).unwrap(), |_, mut c| {
        let b = gpu();
        let n = 2 + c.rank() * 2;
        let mut buf = b.alloc(n * 4).unwrap();
        unsafe {
            c.reduce_scatter(
                &b,
                Stream::Reduce,
                tag(0),
                &mut buf,
                Region::new(0, n, DType::F32),
                1.0,
            )
        }
    });
    for r in results {
        assert!(
            matches!(&r, Err(Error::CollectiveMismatch { rank: 1, .. })),
            "{r:?}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_a_rank_that_leaves_fails_the_others_instead_of_hanging() {
    let results = on_threads(LoopbackComm::group(3).unwrap(), |_, mut c| {
        if c.rank() == 1 {
            drop(c);
            return Ok(());
        }
        let b = gpu();
        let mut buf = b.alloc(12).unwrap();
        unsafe {
            c.reduce_scatter(
                &b,
                Stream::Reduce,
                tag(0),
                &mut buf,
                Region::new(0, 3, DType::F32),
                1.0,
            )
        }
    });
    // Rank 0 sees rank 1 gone; rank 2 may see rank 1 or rank 0, which left after its error.
    assert!(
        matches!(results[0], Err(Error::PeerGone { rank: 1, .. })),
        "rank 0: {:?}",
        results[0]
    );
    assert!(
        matches!(results[2], Err(Error::PeerGone { rank: 0 | 1, .. })),
        "rank 2: {:?}",
        results[2]
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_arguments_are_checked_before_communicating() {
    // One rank of two: a call that reached the other rank would wait for it forever.
    let mut comms = LoopbackComm::group(2).unwrap();
    let b = gpu();
    let mut buf = b.alloc(64).unwrap();
    let shard = b.alloc(8).unwrap();
    let c = &mut comms[0];
    let r = unsafe {
        c.reduce_scatter(
            &b,
            Stream::Reduce,
            tag(0),
            &mut buf,
            Region::new(0, 3, DType::F32),
            1.0,
        )
    };
    assert!(matches!(r, Err(Error::OutOfRange { len: 3, .. })), "{r:?}");
    let r = unsafe {
        c.reduce_scatter(
            &b,
            Stream::Reduce,
            tag(0),
            &mut buf,
            Region::new(10, 8, DType::F32),
            1.0,
        )
    };
    assert!(
        matches!(
            r,
            Err(Error::OutOfRange {
                offset: 10,
                len: 8,
                capacity: 16
            })
        ),
        "{r:?}"
    );
    let (s, o) = (Region::new(0, 2, DType::F32), Region::new(0, 5, DType::F32));
    let r = unsafe { c.all_gather(&b, Stream::Gather, tag(0), &shard, s, &mut buf, o) };
    assert!(
        matches!(
            r,
            Err(Error::OutOfRange {
                len: 5,
                capacity: 4,
                ..
            })
        ),
        "{r:?}"
    );
    let o = Region::new(0, 4, DType::Bf16);
    let r = unsafe { c.all_gather(&b, Stream::Gather, tag(0), &shard, s, &mut buf, o) };
    assert!(matches!(r, Err(Error::OutOfRange { .. })), "{r:?}");
}

/// Three layers of a bf16 weight, an f32 bias and a frozen f32 gain.
fn model() -> ModelSpec {
    let mut params = Vec::new();
    for i in 0..3 {
        params.push(ParamSpec::new(format!("w{i}"), &[24, 20], DType::Bf16).in_unit(i));
        params.push(ParamSpec::new(format!("b{i}"), &[37], DType::F32).in_unit(i));
        params.push(
            ParamSpec::new(format!("g{i}"), &[24], DType::F32)
                .in_unit(i)
                .frozen(),
        );
    }
    ModelSpec::new(params).unwrap()
}

/// What a rank holds after a step: its parameter shards, its gradient shards and its counters
/// (host waits aside: host gradients cost one on the GPU, none on the CPU).
type StepState = (Vec<Vec<u8>>, Vec<Vec<f32>>, Counters);

/// Trains `steps` steps of two backward passes each, with host gradients that differ per rank.
struct Training {
    plan: Arc<Plan>,
    config: EngineConfig,
    steps: u64,
}

impl Training {
    fn train<B: Backend, C: Communicator<B>>(&self, backend: B, comm: C) -> Vec<StepState> {
        let rank = comm.rank();
        let mut e = Engine::new(Arc::clone(&self.plan), self.config.clone(), backend, comm)
            .unwrap_or_else(|e| panic!("engine on rank {rank}: {e}"));
        let params = self.plan.params().to_vec();
        for (i, p) in params.iter().enumerate() {
            let init = narrow(p.dtype(), &Rng::new(1000 + i as u64).wide_values(p.numel()));
            let input = Input::host_bytes(&init, p.dtype());
            e.load_param(e.plan().param_id(p.name()).unwrap(), input)
                .unwrap();
        }
        let units = [Unit::Layer(0), Unit::Layer(1), Unit::Layer(2)];
        let mut states = Vec::new();
        for step in 0..self.steps {
            for pass in 0..2u64 {
                for &u in &units {
                    e.pre_forward(u).unwrap();
                    e.post_forward(u).unwrap();
                }
                for &u in units.iter().rev() {
                    e.pre_backward(u).unwrap();
                    for (i, p) in params.iter().enumerate() {
                        if p.unit() != u || !p.trainable() {
                            continue;
                        }
                        let seed = ((step * 2 + pass) * 64 + rank as u64) * 64 + i as u64;
                        let grad = Rng::new(seed).wide_values(p.numel());
                        let grad: Vec<f32> = grad.iter().map(|g| g * 1e-9).collect();
                        let id = e.plan().param_id(p.name()).unwrap();
                        e.grad(id, Input::host(&grad)).unwrap();
                    }
                    e.post_backward(u).unwrap();
                }
            }
            e.finish_grad_sync().unwrap();
            e.optimizer_step().unwrap();
            e.end_step().unwrap();
            let groups = 0..self.plan.groups().len();
            let shards = groups.clone().map(|g| e.param_shard(g).unwrap()).collect();
            let grads = groups.map(|g| e.grad_shard(g).unwrap()).collect();
            let counters = Counters {
                host_waits: 0,
                ..e.counters()
            };
            states.push((shards, grads, counters));
        }
        states
    }
}

fn training(world: usize, config: EngineConfig) -> Training {
    Training {
        plan: Arc::new(Plan::new(&model(), world).unwrap()),
        config,
        steps: 3,
    }
}

/// The CPU engine's states after each step, rank by rank.
fn cpu_training(t: &Training, world: usize) -> Vec<Vec<StepState>> {
    on_threads(LocalComm::group(world).unwrap(), |_, c| {
        t.train(CpuBackend::new(), c)
    })
}

fn assert_same_training(cpu: &[Vec<StepState>], gpu: &[Vec<StepState>], what: &str) {
    for (rank, (cpu, gpu)) in cpu.iter().zip(gpu).enumerate() {
        for (step, (c, g)) in cpu.iter().zip(gpu).enumerate() {
            assert!(
                c.0 == g.0,
                "{what}: rank {rank}, step {step}: parameter shards differ"
            );
            assert!(
                c.1 == g.1,
                "{what}: rank {rank}, step {step}: gradient shards differ"
            );
            assert_eq!(
                c.2, g.2,
                "{what}: rank {rank}, step {step}: counters differ"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn engines_on_loopback_train_exactly_like_engines_on_the_cpu() {
    let tight = EngineConfig {
        double_buffer_limit: 1,
        max_reduces_in_flight: 1,
        ..EngineConfig::default()
    };
    let sgd = EngineConfig {
        optimizer: OptimizerConfig::sgd(0.05),
        overlap: false,
        ..EngineConfig::default()
    };
    for world in WORLD_SIZES {
        for (name, config) in [
            ("default", EngineConfig::default()),
            ("tight", tight.clone()),
            ("sgd", sgd.clone()),
        ] {
            let t = training(world, config);
            let cpu = cpu_training(&t, world);
            let gpu = on_threads(LoopbackComm::group(world).unwrap(), |_, c| {
                t.train(gpu(), c)
            });
            assert_same_training(&cpu, &gpu, &format!("world size {world}, {name} config"));
        }
    }
}

#[test]
fn without_nccl_its_constructors_report_nccl_unavailable() {
    match nccl_version() {
        Err(Error::NcclUnavailable { .. }) => {}
        Ok(v) => {
            eprintln!("NCCL {v:?} is installed: covered by the GPU tests");
            return;
        }
        Err(other) => panic!("expected NcclUnavailable, got {other:?}"),
    }
    let r = NcclComm::unique_id();
    assert!(
        matches!(&r, Err(Error::NcclUnavailable { reason }) if reason.contains("libnccl")),
        "{r:?}"
    );
    let r = NcclComm::group(&[0], DEFAULT_TIMEOUT).map(|_| ());
    assert!(matches!(r, Err(Error::NcclUnavailable { .. })), "{r:?}");
}

#[test]
fn nccl_device_lists_are_checked_before_loading_anything() {
    assert!(matches!(
        NcclComm::group(&[], DEFAULT_TIMEOUT),
        Err(Error::ZeroWorldSize)
    ));
    assert!(matches!(
        NcclComm::group(&[2, 2], DEFAULT_TIMEOUT),
        Err(Error::InvalidConfig {
            field: "devices",
            ..
        })
    ));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_is_found_and_is_a_2_x_release() {
    let (major, minor, patch) = nccl_version().unwrap_or_else(|e| panic!("{e}"));
    eprintln!("NCCL {major}.{minor}.{patch}");
    assert_eq!(major, 2);
}

/// `s` on one CPU rank: what every communicator of one rank must give.
fn on_one_cpu_rank<S: Scenario>(s: &S) -> S::Out {
    s.run(
        &CpuBackend::new(),
        &mut LocalComm::group(1).unwrap().remove(0),
    )
}

fn nccl_of_one(b: &CudaBackend) -> NcclComm {
    let id = NcclComm::unique_id().unwrap_or_else(|e| panic!("unique id: {e}"));
    NcclComm::new(&id, 0, 1, b, DEFAULT_TIMEOUT)
        .unwrap_or_else(|e| panic!("a communicator of one rank: {e}"))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_at_world_size_1_gathers_and_reduces_like_local_comm() {
    let b = gpu();
    let mut comm = nccl_of_one(&b);
    assert_eq!((comm.rank(), comm.world_size(), comm.device()), (0, 1, 0));
    for dtype in DTYPES {
        for len in [1, 1003, 1 << 16] {
            let s = AllGather { dtype, len };
            let cpu = on_one_cpu_rank(&s);
            assert!(
                s.run(&b, &mut comm) == cpu,
                "NCCL all-gather of {len} {dtype}"
            );
        }
    }
    for dtype in DTYPES {
        let s = AllGatherInPlace { dtype, len: 1003 };
        let cpu = on_one_cpu_rank(&s);
        assert!(
            s.run(&b, &mut comm) == cpu,
            "NCCL in-place all-gather of 1003 {dtype}"
        );
    }
    for dtype in [DType::F32, DType::Bf16] {
        for len in [1, 1001, 1 << 16] {
            let s = AllReduce { dtype, len };
            let cpu = on_one_cpu_rank(&s);
            assert!(
                s.run(&b, &mut comm) == cpu,
                "NCCL all-reduce of {len} {dtype}"
            );
        }
    }
    for dtype in [DType::F32, DType::Bf16] {
        for part in [1, 1001, 1 << 16] {
            let s = ReduceScatter { dtype, part };
            let cpu = on_one_cpu_rank(&s);
            assert!(
                s.run(&b, &mut comm) == cpu,
                "NCCL reduce-scatter of {part} {dtype}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_group_of_one_device_works() {
    let mut comms = NcclComm::group(&[0], DEFAULT_TIMEOUT)
        .unwrap_or_else(|e| panic!("NCCL's init of a group: {e}"));
    assert_eq!(comms.len(), 1);
    let b = gpu();
    let s = AllGather {
        dtype: DType::Bf16,
        len: 4099,
    };
    let cpu = on_one_cpu_rank(&s);
    assert!(
        s.run(&b, &mut comms[0]) == cpu,
        "all-gather through a group made in one process"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_batches_go_out_as_one_group() {
    let b = gpu();
    let mut comm = nccl_of_one(&b);
    let data: Vec<f32> = Rng::new(5).wide_values(1000);
    let bytes = narrow(DType::F32, &data);
    let shard = buffer(&b, 4000, 0, DType::F32, &bytes);
    let mut out = b.alloc(4000).unwrap();
    let mut grads = buffer(&b, 4000, 0, DType::F32, &bytes);
    let r = Region::new(0, 1000, DType::F32);
    let ops = [
        Collective::AllGather {
            shard: &shard,
            shard_region: r,
            out: &mut out,
            out_region: r,
        },
        Collective::ReduceScatter {
            buf: &mut grads,
            region: r,
            scale: 1.0,
        },
    ];
    unsafe { comm.batch(&b, Stream::Gather, &ops) }.unwrap();
    assert!(read(&b, &out, 4000) == bytes, "batched all-gather");
    assert!(read(&b, &grads, 4000) == bytes, "batched reduce-scatter");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_arguments_are_checked_before_nccl_is_called() {
    let b = gpu();
    let id = NcclComm::unique_id().unwrap();
    assert!(matches!(
        NcclComm::new(&id, 1, 1, &b, DEFAULT_TIMEOUT),
        Err(Error::RankOutOfRange {
            rank: 1,
            world_size: 1
        })
    ));
    assert!(matches!(
        NcclComm::new(&id, 0, 0, &b, DEFAULT_TIMEOUT),
        Err(Error::ZeroWorldSize)
    ));
    let mut comm = nccl_of_one(&b);
    let mut buf = b.alloc(64).unwrap();
    let shard = b.alloc(64).unwrap();
    let r = unsafe {
        comm.reduce_scatter(
            &b,
            Stream::Reduce,
            tag(0),
            &mut buf,
            Region::new(10, 8, DType::F32),
            1.0,
        )
    };
    assert!(
        matches!(
            r,
            Err(Error::OutOfRange {
                offset: 10,
                len: 8,
                capacity: 16
            })
        ),
        "{r:?}"
    );
    let r = unsafe {
        comm.reduce_scatter(
            &b,
            Stream::Reduce,
            tag(0),
            &mut buf,
            Region::new(0, 8, DType::F16),
            1.0,
        )
    };
    assert!(matches!(r, Err(Error::Unsupported { .. })), "{r:?}");
    let (s, o) = (Region::new(0, 4, DType::F32), Region::new(0, 5, DType::F32));
    let r = unsafe { comm.all_gather(&b, Stream::Gather, tag(0), &shard, s, &mut buf, o) };
    assert!(
        matches!(
            r,
            Err(Error::OutOfRange {
                len: 5,
                capacity: 4,
                ..
            })
        ),
        "{r:?}"
    );
    let ops = [Collective::ReduceScatter {
        buf: &mut buf,
        region: Region::new(0, 17, DType::F32),
        scale: 1.0,
    }];
    let r = unsafe { comm.batch(&b, Stream::Reduce, &ops) };
    assert!(matches!(r, Err(Error::OutOfRange { len: 17, .. })), "{r:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_engine_on_nccl_at_world_size_1_trains_exactly_like_the_cpu() {
    for config in [
        EngineConfig::default(),
        EngineConfig {
            overlap: false,
            ..EngineConfig::default()
        },
    ] {
        let t = training(1, config);
        let cpu = cpu_training(&t, 1);
        let b = gpu();
        let comm = nccl_of_one(&b);
        let gpu = vec![t.train(b, comm)];
        assert_same_training(&cpu, &gpu, "NCCL world size 1");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_init_past_its_deadline_is_a_timeout_and_the_process_goes_on() {
    let b = gpu();
    let id = NcclComm::unique_id().unwrap();
    let started = Instant::now();
    // Rank 0 of 2, with no rank 1 ever coming.
    let r = NcclComm::new(&id, 0, 2, &b, Duration::from_millis(1500));
    match &r {
        Err(Error::Timeout { op, waited }) => {
            assert!(op.contains("init of rank 0 of 2"), "{op}");
            assert!(*waited >= Duration::from_millis(1500));
        }
        other => panic!("{:?}", other.as_ref().map(|_| ())),
    }
    assert!(started.elapsed() < Duration::from_secs(60));
    // The half-made communicator was aborted: a new one works.
    let s = AllGather {
        dtype: DType::F32,
        len: 777,
    };
    let cpu = on_one_cpu_rank(&s);
    assert!(
        s.run(&b, &mut nccl_of_one(&b)) == cpu,
        "after a timed-out init"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_aborted_nccl_communicator_refuses_later_collectives_and_drops_at_once() {
    let b = gpu();
    let mut comm = nccl_of_one(&b);
    assert!(comm.health().is_ok());
    comm.abort();
    let shard = b.alloc(64).unwrap();
    let mut out = b.alloc(64).unwrap();
    let r = Region::new(0, 16, DType::F32);
    let got = unsafe { comm.all_gather(&b, Stream::Gather, tag(0), &shard, r, &mut out, r) };
    assert!(
        matches!(&got, Err(Error::Nccl { message, .. }) if message.contains("aborted")),
        "{got:?}"
    );
    assert!(
        comm.health().is_err(),
        "an aborted communicator is not healthy"
    );
    let started = Instant::now();
    drop(comm);
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_from_the_launch_environment_at_world_size_1_gathers() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let env = LaunchEnv::from_vars(|name| match name {
        "RANK" | "LOCAL_RANK" => Some("0".into()),
        "WORLD_SIZE" => Some("1".into()),
        "MASTER_ADDR" => Some("127.0.0.1".into()),
        "MASTER_PORT" => Some(port.clone()),
        _ => None,
    })
    .unwrap();
    let b = CudaBackend::new(env.local_rank).unwrap();
    let mut comm = NcclComm::from_launch(&env, &b, DEFAULT_TIMEOUT).unwrap();
    let s = AllGather {
        dtype: DType::Bf16,
        len: 1001,
    };
    let cpu = on_one_cpu_rank(&s);
    assert!(
        s.run(&b, &mut comm) == cpu,
        "through the launch environment"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_aborted_nccl_engine_drops_at_once() {
    let b = gpu();
    let comm = nccl_of_one(&b);
    let plan = Arc::new(Plan::new(&model(), 1).unwrap());
    let mut e = Engine::new(plan, EngineConfig::default(), b, comm).unwrap();
    e.abort_handle().abort();
    assert!(matches!(
        e.pre_forward(Unit::Layer(0)),
        Err(Error::Poisoned { cause }) if matches!(*cause, Error::Aborted)
    ));
    let started = Instant::now();
    drop(e);
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nccl_splits_into_a_hybrid_grid_of_one_that_trains_like_the_cpu() {
    let b = gpu();
    let world = nccl_of_one(&b);
    let part = world.split(0, 0, DEFAULT_TIMEOUT).unwrap();
    assert_eq!((part.rank(), part.world_size()), (0, 1));
    let s = AllGather {
        dtype: DType::F32,
        len: 333,
    };
    let cpu = on_one_cpu_rank(&s);
    let mut part = part;
    assert!(s.run(&b, &mut part) == cpu, "through a split communicator");
    assert!(matches!(
        world.hybrid(2, DEFAULT_TIMEOUT),
        Err(Error::InvalidConfig {
            field: "replicas",
            ..
        })
    ));
    let hybrid = world.hybrid(1, DEFAULT_TIMEOUT).unwrap();
    drop(world);
    let t = training(1, EngineConfig::default());
    let cpu = cpu_training(&t, 1);
    let gpu = vec![t.train(b, hybrid)];
    assert_same_training(&cpu, &gpu, "NCCL hybrid 1 x 1");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn an_injected_nccl_error_poisons_the_engine_aborts_its_communicators_and_the_process_goes_on() {
    let b = gpu();
    let comm = Faulty::new(nccl_of_one(&b), false);
    let (fault, aborts) = (Arc::clone(&comm.fault), Arc::clone(&comm.aborts));
    let plan = Arc::new(Plan::new(&model(), 1).unwrap());
    let mut e = Engine::new(plan, EngineConfig::default(), b, comm).unwrap();
    e.pre_forward(Unit::Layer(0)).unwrap();
    fault.store(true, std::sync::atomic::Ordering::SeqCst);
    let err = e.post_forward(Unit::Layer(0)).unwrap_err();
    assert!(is_injected(&err), "{err:?}");
    assert!(
        matches!(e.pre_forward(Unit::Layer(1)), Err(Error::Poisoned { .. })),
        "later calls are refused"
    );
    assert_eq!(aborts.load(std::sync::atomic::Ordering::SeqCst), 1);
    let started = Instant::now();
    drop(e);
    assert!(started.elapsed() < Duration::from_secs(10));
    // The process goes on: a new communicator works.
    let b = gpu();
    let s = AllGather {
        dtype: DType::F32,
        len: 99,
    };
    let cpu = on_one_cpu_rank(&s);
    assert!(
        s.run(&b, &mut nccl_of_one(&b)) == cpu,
        "after the poisoned engine"
    );
}
