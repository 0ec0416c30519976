//! A step captured once on the asynchronous CPU backend's streams and replayed step after step
//! trains exactly as the same steps run eagerly: at world sizes 1 to 4, with AdamW under a
//! learning rate changed every step (the replays read it from the step's values on the
//! device), SGD, bf16 parameters with fp32 masters, and the optimizer inside the backward. The
//! model's work runs on the compute stream too (a gradient `w - target` from the gathered
//! values and a target refilled before every step, made by the backend's own operations), as a
//! GPU model's kernels would, so the capture holds it; the host's counts follow the replays, and
//! an eager step after them goes on from where they left. The same steps run on the GPU (NCCL at
//! world size 1) where one is present. The whole training loops run over the long suites'
//! seeds; the replays' ordering against work left on other streams over the short suites'.

use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use fsdp_fusion::backend::cpu::CpuBackend;
use fsdp_fusion::backend::cuda::CudaBackend;
use fsdp_fusion::backend::{Backend, RawAddress, Region};
use fsdp_fusion::comm::hybrid::Hybrid;
use fsdp_fusion::comm::loopback::LoopbackComm;
use fsdp_fusion::comm::nccl::NcclComm;
use fsdp_fusion::watch::DEFAULT_TIMEOUT;
use fsdp_fusion::{
    Accumulation, Communicator, DType, Engine, EngineConfig, Error, GradShardMemory, Input,
    LocalComm, ModelSpec, OptimizerConfig, ParamId, ParamSpec, ParamStorage, Plan,
    ProcessGroupSpec, Result, Stream, Unit,
};
use fsdp_fusion_support::ranks::{
    Mode, for_each_mode, for_each_mode_of_a_long_suite, on_engines, on_threads, within_deadline,
};
use fsdp_fusion_support::scratch::Scratch;

const STEPS: usize = 5;

/// The root's parameter, and two units: unit 0 an f32 group and an exempt one, unit 1 an f32
/// and a bf16 group; odd sizes.
fn model() -> ModelSpec {
    ModelSpec::new(vec![
        ParamSpec::new("r", &[5], DType::F32),
        ParamSpec::new("a", &[7], DType::F32).in_unit(0),
        ParamSpec::new("an", &[4], DType::F32)
            .in_unit(0)
            .no_weight_decay(),
        ParamSpec::new("b", &[6], DType::F32).in_unit(1),
        ParamSpec::new("c", &[9], DType::Bf16).in_unit(1),
    ])
    .unwrap()
}

/// [`model`] with unit 1's f32 group an expert's: sharded over process groups of 2 ranks.
fn model_with_an_expert() -> ModelSpec {
    let params = model()
        .params
        .into_iter()
        .map(|p| match p.name.as_str() {
            "b" => p.in_process_group("experts"),
            _ => p,
        })
        .collect();
    let experts = ProcessGroupSpec {
        name: "experts".into(),
        size: 2,
    };
    ModelSpec::with_process_groups(params, vec![experts]).unwrap()
}

/// Each parameter's target of `step` on `rank`.
fn target(rank: usize, step: usize, param: usize, numel: usize) -> Vec<f32> {
    (0..numel)
        .map(|i| ((rank * 7 + step * 3 + param * 5 + i) % 11) as f32 * 0.25 - 1.0)
        .collect()
}

/// Each rank's buffers outside the engine: per parameter, its target (refilled before every
/// step) and its gradient (written on the compute stream).
struct Batch<B: Backend> {
    targets: Vec<B::Buffer>,
    gradients: Vec<B::Buffer>,
    /// How each step clips its gradients by their global norm.
    clip: Clipping,
    /// Where set, each gradient is copied into its slot by this (the model's own kernel, on
    /// the compute stream) and committed, instead of handed over.
    into_slots: Option<StreamCopy<B>>,
    /// Where set, the replays are of a capture the caller makes ([`Engine::join_capture`]).
    by_caller: Option<CallerCapture<B>>,
    /// How a step whose gradient is not finite is skipped.
    skip: Skipping,
    /// The rank and step whose target holds a NaN, making a gradient of the step NaN.
    nonfinite_at: Option<(usize, usize)>,
}

/// How a step whose gradient is not finite is skipped, if it is.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Skipping {
    No,
    /// By the host: no optimizer step after a norm that is not finite ([`Engine::grad_norm`]).
    OnHost,
    /// On the device ([`Engine::skip_nonfinite_on_device`]).
    OnDevice,
}

/// A capture of the compute stream made by the caller, outside the engine's backend
/// ([`Engine::join_capture`]): `begin` begins it, `end` ends it and gives its replay, which
/// launches the graph on the compute stream.
struct CallerCapture<B> {
    begin: fn(&B) -> Result<()>,
    end: fn(&B) -> Result<Replay<B>>,
}

impl<B> Clone for CallerCapture<B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for CallerCapture<B> {}

/// Launches a caller's graph on the compute stream of the backend that captured it.
type Replay<B> = Box<dyn Fn(&B) -> Result<()>>;

/// On the CPU the caller's capture is the backend's own (`Backend::begin_capture`), which the
/// engine joins.
fn cpu_caller_capture() -> CallerCapture<CpuBackend> {
    CallerCapture {
        begin: |b| b.begin_capture(Stream::Compute),
        end: |b| {
            let graph = b.end_capture()?;
            // SAFETY: the backend captured the graph; its buffers are the engine's and the
            // batch's, alive while it is replayed; `before_replay` and `replayed` order it.
            Ok(Box::new(move |b: &CpuBackend| unsafe { b.replay(&graph) }))
        },
    }
}

/// Queues a copy of `bytes` bytes from stream address `from` to `to` on `backend`'s compute
/// stream.
type StreamCopy<B> = fn(&B, u64, u64, usize) -> Result<()>;

/// [`StreamCopy`] on the CPU backend: a job of the compute stream.
fn cpu_stream_copy(backend: &CpuBackend, from: u64, to: u64, bytes: usize) -> Result<()> {
    backend.run(Stream::Compute, move || {
        // SAFETY: both hold `bytes` bytes of buffers that outlive the stream's work (the batch's
        // gradient and the engine's slot, valid until `commit_grad` queues its read after this
        // job); nothing else touches them while the job runs.
        unsafe { std::ptr::copy_nonoverlapping(from as *const u8, to as *mut u8, bytes) };
        Ok(())
    })
}

/// How a step clips its gradients by their global norm, if it does.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Clipping {
    No,
    /// The norm read by the host ([`Engine::clip_grad_norm`]).
    OnHost(f32),
    /// The norm kept on the device ([`Engine::clip_grad_norm_on_device`]).
    OnDevice(f32),
}

impl<B: Backend> Batch<B> {
    fn new<C: Communicator<B>>(e: &Engine<B, C>) -> Result<Batch<B>> {
        let numels: Vec<usize> = e.plan().params().iter().map(|p| p.numel()).collect();
        let scratch = |n: usize| e.backend().alloc_scratch(n * 4);
        Ok(Batch {
            targets: numels.iter().map(|&n| scratch(n)).collect::<Result<_>>()?,
            gradients: numels.iter().map(|&n| scratch(n)).collect::<Result<_>>()?,
            clip: Clipping::No,
            into_slots: None,
            by_caller: None,
            skip: Skipping::No,
            nonfinite_at: None,
        })
    }

    fn fill<C: Communicator<B>>(&mut self, e: &Engine<B, C>, step: usize) -> Result<()> {
        for (i, p) in e.plan().params().iter().enumerate() {
            let mut values = target(e.rank(), step, i, p.numel());
            if self.nonfinite_at == Some((e.rank(), step)) && i == 1 {
                values[0] = f32::NAN;
            }
            let region = Region::new(0, p.numel(), DType::F32);
            let bytes: &[u8] = bytemuck::cast_slice(&values);
            e.backend().upload(&mut self.targets[i], region, bytes)?;
        }
        Ok(())
    }
}

/// Runs `f` on `e` and a batch of its own, which outlives the engine: the engine's end lets its
/// streams finish the work that reads the batch.
fn with_batch<B: Backend, C: Communicator<B>, R>(
    mut e: Engine<B, C>,
    f: impl FnOnce(&mut Engine<B, C>, &mut Batch<B>) -> R,
) -> R {
    let mut batch = Batch::new(&e).unwrap_or_else(|e| panic!("a batch: {e}"));
    let r = f(&mut e, &mut batch);
    drop(e);
    r
}

/// One step's hooks, with the model's work on the compute stream: each parameter's gradient is
/// its gathered value minus its target, made by the backend's operations.
fn step<B: RawAddress, C: Communicator<B>>(
    e: &mut Engine<B, C>,
    batch: &mut Batch<B>,
) -> Result<()> {
    for unit in [Unit::Root, Unit::Layer(0), Unit::Layer(1)] {
        e.pre_forward(unit)?;
        e.post_forward(unit)?;
    }
    let plan = e.plan().clone();
    for unit in [Unit::Layer(1), Unit::Layer(0), Unit::Root] {
        e.pre_backward(unit)?;
        for (i, p) in plan.params().iter().enumerate() {
            if p.unit() != unit {
                continue;
            }
            let id = ParamId(i);
            let values = e.param_device(id)?;
            let f32s = Region::new(0, p.numel(), DType::F32);
            let gradient = &mut batch.gradients[i];
            // SAFETY: on the compute stream, after the hook that gathered the values (valid
            // until the unit's hooks close); the batch's buffers are used on the compute stream
            // only, and by the host between steps (an upload waits for the streams).
            unsafe {
                let gathered = Input::device(values.ptr, values.numel, values.dtype);
                let b = e.backend();
                b.accumulate_input(Stream::Compute, gathered, gradient, f32s, 1.0, false)?;
                b.accumulate(
                    Stream::Compute,
                    &batch.targets[i],
                    f32s,
                    gradient,
                    f32s,
                    -1.0,
                    true,
                )?;
            }
            let address = e.backend().stream_address(&batch.gradients[i], f32s)?;
            if let Some(copy) = batch.into_slots {
                let slot = e.grad_slot_device(id)?;
                copy(e.backend(), address, slot.ptr, p.numel() * 4)?;
                e.commit_grad(id)?;
                continue;
            }
            // SAFETY: the gradient buffer holds `numel` f32, written above on the compute
            // stream, where the engine reads it; the next write is the next step's.
            e.grad(id, unsafe { Input::device(address, p.numel(), DType::F32) })?;
        }
        e.post_backward(unit)?;
    }
    e.finish_grad_sync()?;
    match batch.clip {
        Clipping::No => {}
        Clipping::OnHost(max_norm) => drop(e.clip_grad_norm(max_norm)?),
        Clipping::OnDevice(max_norm) => e.clip_grad_norm_on_device(max_norm)?,
    }
    match batch.skip {
        Skipping::No => e.optimizer_step()?,
        Skipping::OnHost => {
            if e.grad_norm()?.is_finite() {
                e.optimizer_step()?;
            }
        }
        Skipping::OnDevice => {
            e.skip_nonfinite_on_device()?;
            e.optimizer_step()?;
        }
    }
    e.end_step()
}

/// The learning rate of step `step`: a different one every step.
fn lr(step: usize) -> f32 {
    0.05 / (1.0 + step as f32)
}

/// [`STEPS`] steps on `e`: every group's shard bytes after each, and the counts at the end; the
/// steps from the second on captured once and replayed when `captured`, with one eager step
/// after the replays.
fn train<B: RawAddress, C: Communicator<B>>(
    e: Engine<B, C>,
    captured: bool,
    clip: Clipping,
) -> Trained {
    train_batch(e, captured, |batch| batch.clip = clip)
}

/// [`train`] with the batch set up by `setup`.
fn train_batch<B: RawAddress, C: Communicator<B>>(
    e: Engine<B, C>,
    captured: bool,
    setup: impl FnOnce(&mut Batch<B>),
) -> Trained {
    with_batch(e, |e, batch| {
        setup(batch);
        let mut shards = Vec::new();
        let mut capture = None;
        let mut callers = None;
        for s in 0..STEPS {
            batch.fill(e, s).unwrap();
            e.set_lr(lr(s)).unwrap();
            let replayed = captured && (1..STEPS - 1).contains(&s);
            if let (true, Some(caller)) = (replayed, batch.by_caller) {
                if callers.is_none() {
                    e.join_capture().unwrap();
                    (caller.begin)(e.backend()).unwrap();
                    step(e, batch).unwrap();
                    let step = e.leave_capture().unwrap();
                    callers = Some(((caller.end)(e.backend()).unwrap(), step));
                }
                let (replay, step) = callers.as_ref().unwrap();
                e.before_replay(step).unwrap();
                replay(e.backend()).unwrap();
                e.replayed(step).unwrap();
            } else if replayed {
                if capture.is_none() {
                    e.begin_capture().unwrap();
                    step(e, batch).unwrap();
                    capture = Some(e.end_capture().unwrap());
                }
                e.replay(capture.as_ref().unwrap()).unwrap();
            } else {
                step(e, batch).unwrap();
            }
            let groups = 0..e.plan().groups().len();
            shards.push(groups.map(|g| e.param_shard(g).unwrap()).collect());
        }
        e.read_device_skips().unwrap();
        Trained {
            shards,
            steps: e.counters().steps,
            skipped_steps: e.counters().skipped_steps,
            reduce_scatters: e.counters().reduce_scatters,
            all_gathers: e.counters().all_gathers,
        }
    })
}

/// [`train`] on CPU ranks.
fn train_cpu(mode: Mode, world: usize, config: &EngineConfig, captured: bool) -> Vec<Trained> {
    train_cpu_clipped(mode, world, config, (captured, Clipping::No))
}

/// [`train`] on CPU ranks, the replays of a capture the caller makes.
fn train_cpu_by_caller(mode: Mode, world: usize, config: &EngineConfig) -> Vec<Trained> {
    let plan = Arc::new(Plan::new(&model(), world).unwrap());
    on_engines(&plan, config, mode, move |e| {
        train_batch(e, true, |b| b.by_caller = Some(cpu_caller_capture()))
    })
}

/// [`train`] on CPU ranks, clipping as `clip` says.
fn train_cpu_clipped(
    mode: Mode,
    world: usize,
    config: &EngineConfig,
    (captured, clip): (bool, Clipping),
) -> Vec<Trained> {
    let plan = Arc::new(Plan::new(&model(), world).unwrap());
    on_engines(&plan, config, mode, move |e| train(e, captured, clip))
}

/// The first difference of `eager` and `replayed`, `what` named.
fn assert_trained_alike(eager: &Trained, replayed: &Trained, what: &str) {
    for (s, (e, r)) in eager.shards.iter().zip(&replayed.shards).enumerate() {
        let group = (e.iter().zip(r)).position(|(e, r)| e != r);
        assert_eq!(group, None, "{what}: step {s}'s shards differ");
    }
    assert_eq!(eager, replayed, "{what}: counts");
}

#[derive(Debug, PartialEq)]
struct Trained {
    shards: Vec<Vec<Vec<u8>>>,
    steps: u64,
    skipped_steps: u64,
    reduce_scatters: u64,
    all_gathers: u64,
}

fn configs() -> Vec<(&'static str, EngineConfig)> {
    let adamw = EngineConfig::default();
    vec![
        ("adamw", adamw.clone()),
        (
            "sgd with weight decay",
            EngineConfig {
                optimizer: OptimizerConfig::Sgd {
                    lr: 0.1,
                    weight_decay: 0.01,
                },
                ..adamw.clone()
            },
        ),
        (
            "adamw in the backward",
            EngineConfig {
                step_in_backward: true,
                ..adamw.clone()
            },
        ),
        (
            "master-only storage, bf16 moments, no-sync accumulation",
            EngineConfig {
                param_storage: ParamStorage::MasterOnly,
                moment_dtype: DType::Bf16,
                accumulation: Accumulation::NoSync,
                ..adamw
            },
        ),
    ]
}

#[test]
fn replays_of_a_captured_step_train_as_eager_steps_do() {
    for world in 1..=4 {
        for (name, config) in configs() {
            let runs = for_each_mode_of_a_long_suite(|mode| match mode {
                Mode::Eager => None,
                Mode::Async(_) => Some((
                    train_cpu(mode, world, &config, false),
                    train_cpu(mode, world, &config, true),
                    train_cpu_by_caller(mode, world, &config),
                )),
            });
            for (eager, replayed, by_caller) in runs.into_iter().flatten() {
                for (rank, (eager, replayed)) in eager.iter().zip(&replayed).enumerate() {
                    let what = format!("world {world}, {name}, rank {rank}");
                    assert_trained_alike(eager, replayed, &what);
                    let what = format!("{what}, the caller's capture");
                    assert_trained_alike(eager, &by_caller[rank], &what);
                }
                // Each step moved the parameters (rank 0 holds part of every group; at world
                // sizes above 1 another rank's shards of these small groups may be padding).
                let shards = &eager[0].shards;
                assert!(shards.windows(2).all(|w| w[0] != w[1]), "{name}");
            }
        }
    }
}

/// Gradients that the model's own work writes into the engine's slots on the compute stream
/// (`grad_slot_device`, then `commit_grad`) replay as they train eagerly, at world sizes 1 to 4.
#[test]
fn replays_of_gradients_written_into_their_slots_train_as_eager_steps_do() {
    for world in 1..=4 {
        let plan = Arc::new(Plan::new(&model(), world).unwrap());
        let config = EngineConfig::default();
        let runs = for_each_mode_of_a_long_suite(|mode| {
            let train = |captured| {
                on_engines(&plan, &config, mode, move |e| {
                    train_batch(e, captured, |b| b.into_slots = Some(cpu_stream_copy))
                })
            };
            match mode {
                Mode::Eager => None,
                Mode::Async(_) => Some((train(false), train(true))),
            }
        });
        // The slots' gradients train as handed-over ones do.
        let handed_over = train_cpu(Mode::Eager, world, &config, false);
        for (eager, replayed) in runs.into_iter().flatten() {
            for (rank, (eager, replayed)) in eager.iter().zip(&replayed).enumerate() {
                assert_trained_alike(eager, replayed, &format!("world {world}, rank {rank}"));
            }
            assert_eq!(eager, handed_over, "world {world}");
        }
    }
}

/// Clipping by the global norm on the device equals clipping by the norm the host read, bit for
/// bit, and replays of a step that clips on the device clip by each replay's own norm: at world
/// sizes 1 to 4, with a bound that clips every step and one that clips none.
#[test]
fn clipping_on_the_device_equals_the_host_s_and_replays_with_it() {
    for world in 1..=4 {
        for (name, config) in configs().into_iter().take(2) {
            for max_norm in [0.25, 1e6] {
                // The eager backend cannot capture: its device clipping stands in for replays.
                let runs = for_each_mode_of_a_long_suite(|mode| {
                    let train =
                        |captured, clip| train_cpu_clipped(mode, world, &config, (captured, clip));
                    let captured = matches!(mode, Mode::Async(_));
                    [
                        train(false, Clipping::No),
                        train(false, Clipping::OnHost(max_norm)),
                        train(false, Clipping::OnDevice(max_norm)),
                        train(captured, Clipping::OnDevice(max_norm)),
                    ]
                });
                for [unclipped, host, device, replayed] in runs {
                    // The small bound clips: the parameters move less.
                    let clipped = unclipped[0].shards != host[0].shards;
                    assert_eq!(clipped, max_norm < 1.0, "world {world}, {name}, {max_norm}");
                    for rank in 0..world {
                        let what = format!("world {world}, {name}, max norm {max_norm}");
                        let what = format!("{what}, rank {rank}");
                        assert_trained_alike(&host[rank], &device[rank], &what);
                        assert_trained_alike(&host[rank], &replayed[rank], &what);
                    }
                }
            }
        }
    }
}

/// [`train`] on CPU ranks, skipping as `skip` says, the gradient of rank and step `nonfinite_at`
/// not finite.
fn train_cpu_skipping(
    mode: Mode,
    world: usize,
    config: &EngineConfig,
    (captured, skip): (bool, Skipping),
    nonfinite_at: (usize, usize),
) -> Vec<Trained> {
    let plan = Arc::new(Plan::new(&model(), world).unwrap());
    on_engines(&plan, config, mode, move |e| {
        train_batch(e, captured, |b| {
            b.skip = skip;
            b.nonfinite_at = Some(nonfinite_at);
        })
    })
}

/// A step whose gradient is not finite on one rank, skipped on the device
/// ([`Engine::skip_nonfinite_on_device`]), trains as the same step skipped by the host after a
/// norm that is not finite: eagerly and replayed, and so do the steps after it (AdamW's bias
/// correction leaves the skipped step out, bf16 moments round with its count), at world sizes
/// 1 to 4, the skipped step a replay or the eager step after the replays. The host reads the
/// skipped step back ([`Engine::read_device_skips`]).
#[test]
fn steps_skipped_on_the_device_train_as_steps_the_host_skips() {
    let configs = configs();
    let chosen = [&configs[0], &configs[3]];
    for world in 1..=4 {
        for (name, config) in chosen {
            for at in [2, STEPS - 1] {
                let runs = for_each_mode_of_a_long_suite(|mode| {
                    let train = |how| train_cpu_skipping(mode, world, config, how, (world - 1, at));
                    let captured = matches!(mode, Mode::Async(_));
                    [
                        train((false, Skipping::OnHost)),
                        train((false, Skipping::OnDevice)),
                        train((captured, Skipping::OnDevice)),
                    ]
                });
                for [host, device, replayed] in runs {
                    let what = format!("world {world}, {name}, skipped at {at}");
                    // The step before moved the parameters; the skipped one left them.
                    assert!(
                        host.iter().any(|t| t.shards[at - 1] != t.shards[at - 2]),
                        "{what}"
                    );
                    for (rank, trained) in host.iter().enumerate() {
                        let what = format!("{what}, rank {rank}");
                        assert_eq!(trained.skipped_steps, 1, "{what}");
                        assert_eq!(
                            trained.shards[at],
                            trained.shards[at - 1],
                            "{what}: skipped"
                        );
                        assert_trained_alike(trained, &device[rank], &what);
                        assert_trained_alike(trained, &replayed[rank], &what);
                    }
                }
            }
        }
    }
}

#[test]
fn clipping_and_skipping_on_the_device_refuse_what_the_host_s_refuse() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let in_backward = EngineConfig {
        step_in_backward: true,
        ..EngineConfig::default()
    };
    for config in [EngineConfig::default(), in_backward] {
        let outcomes = on_engines(&plan, &config, Mode::Eager, |mut e| {
            let refusals = [f32::NAN, 0.0, -1.0, f32::INFINITY].map(|bad| {
                let r = e.clip_grad_norm_on_device(bad);
                matches!(
                    r,
                    Err(Error::InvalidConfig {
                        field: "max_norm",
                        ..
                    })
                ) || matches!(r, Err(Error::StepInBackward { .. }))
            });
            let unsynced = e.clip_grad_norm_on_device(1.0);
            let skip_unsynced = e.skip_nonfinite_on_device();
            let step = e.config().step_in_backward;
            (refusals, [unsynced, skip_unsynced], step)
        });
        for (refusals, unsynced, in_backward) in outcomes {
            assert_eq!(refusals, [true; 4]);
            for unsynced in unsynced {
                match in_backward {
                    true => assert!(matches!(unsynced, Err(Error::StepInBackward { .. }))),
                    false => assert!(
                        matches!(unsynced, Err(Error::GradsNotSynced { .. })),
                        "{unsynced:?}"
                    ),
                }
            }
        }
    }
}

/// Under hybrid sharding (2 replicas of 2 ranks), replays that clip on the device train as eager
/// steps that clip by the host's norm: the norm parts gathered within each replica.
#[test]
fn replays_under_hybrid_sharding_train_as_eager_steps_do() {
    let plan = Arc::new(Plan::hybrid(&model(), 2, 2).unwrap());
    let run = |mode: Mode, captured: bool, clip: Clipping| {
        let plan = Arc::clone(&plan);
        within_deadline("a hybrid grid", move || {
            let comms = Hybrid::grid(2, 2, LocalComm::group).unwrap();
            on_threads(comms, |rank, comm| {
                let backend = mode.backend(rank);
                let config = EngineConfig::default();
                let e = Engine::new(Arc::clone(&plan), config, backend, comm).unwrap();
                train(e, captured, clip)
            })
        })
    };
    for_each_mode(|mode| {
        if mode == Mode::Eager {
            return;
        }
        let eager = run(mode, false, Clipping::OnHost(0.25));
        let replayed = run(mode, true, Clipping::OnDevice(0.25));
        for (rank, (eager, replayed)) in eager.iter().zip(&replayed).enumerate() {
            assert_trained_alike(eager, replayed, &format!("{mode:?}, rank {rank}"));
        }
        // The replicas hold the same shards.
        assert_eq!(eager[0].shards, eager[2].shards);
    });
}

/// With an expert's parameters sharded over process groups of 2 of the 4 ranks, replays that
/// clip on the device train as eager steps clipping by the host's norm.
#[test]
fn replays_with_expert_groups_train_as_eager_steps_do() {
    let plan = Arc::new(Plan::new(&model_with_an_expert(), 4).unwrap());
    let config = EngineConfig::default();
    let runs = for_each_mode_of_a_long_suite(|mode| {
        let train =
            |captured, clip| on_engines(&plan, &config, mode, move |e| train(e, captured, clip));
        let captured = matches!(mode, Mode::Async(_));
        (
            train(false, Clipping::OnHost(0.25)),
            train(captured, Clipping::OnDevice(0.25)),
        )
    });
    for (eager, replayed) in runs {
        for (rank, (eager, replayed)) in eager.iter().zip(&replayed).enumerate() {
            assert_trained_alike(eager, replayed, &format!("rank {rank}"));
        }
    }
}

/// An evaluation step: the forward hooks of the root only, which leaves the next unit's
/// prefetch queued on the gather stream with nothing waiting for it.
fn evaluation<B: Backend, C: Communicator<B>>(e: &mut Engine<B, C>) -> Result<()> {
    e.pre_forward(Unit::Root)?;
    e.post_forward(Unit::Root)?;
    e.end_step()
}

/// Replays queued back to back with evaluation steps between them, the host waiting for
/// nothing, train as the same steps run eagerly: a replay comes after every stream's earlier
/// work (a prefetch left on the gather stream), not only the compute stream's.
#[test]
fn replays_follow_the_work_left_on_every_stream() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let config = EngineConfig::default();
    let run = move |mode: Mode, captured: bool| {
        on_engines(&plan, &config, mode, move |e| {
            with_batch(e, |e, batch| -> Result<Vec<Vec<u8>>> {
                batch.fill(e, 0)?;
                step(e, batch)?;
                let capture = match captured {
                    true => {
                        e.begin_capture()?;
                        step(e, batch)?;
                        Some(e.end_capture()?)
                    }
                    false => None,
                };
                for s in 1..6 {
                    evaluation(e)?;
                    e.set_lr(lr(s))?;
                    match &capture {
                        Some(capture) => e.replay(capture)?,
                        None => step(e, batch)?,
                    }
                }
                (0..e.plan().groups().len())
                    .map(|g| e.param_shard(g))
                    .collect()
            })
        })
    };
    for_each_mode(|mode| {
        if mode == Mode::Eager {
            return;
        }
        let eager = run(mode, false);
        let replayed = run(mode, true);
        for (rank, (eager, replayed)) in eager.into_iter().zip(replayed).enumerate() {
            let (eager, replayed) = (eager.unwrap(), replayed.unwrap());
            assert_eq!(eager, replayed, "{mode:?}, rank {rank}");
        }
    });
}

/// Replays of a step captured before any step was skipped on the device, and that decides
/// nothing itself, count out a skip the device makes after the capture (an eager step between
/// the replays): they train as eager steps do around a step the host skips, at world sizes 1
/// and 2, AdamW's bias correction and bf16 moments' rounding counting the skip out.
#[test]
fn replays_of_a_step_captured_before_a_skip_on_the_device_count_it_out() {
    const SKIPPED: usize = 2;
    let config = EngineConfig {
        moment_dtype: DType::Bf16,
        ..EngineConfig::default()
    };
    for world in [1, 2] {
        let plan = Arc::new(Plan::new(&model(), world).unwrap());
        let run = |device: bool| {
            on_engines(&plan, &config, Mode::Async(3), move |e| {
                with_batch(e, move |e, batch| -> Result<Vec<Vec<Vec<u8>>>> {
                    batch.nonfinite_at = Some((world - 1, SKIPPED));
                    let mut capture = None;
                    let mut shards = Vec::new();
                    for s in 0..STEPS {
                        batch.fill(e, s)?;
                        e.set_lr(lr(s))?;
                        batch.skip = match (s, device) {
                            (SKIPPED, true) => Skipping::OnDevice,
                            (SKIPPED, false) => Skipping::OnHost,
                            _ => Skipping::No,
                        };
                        match (&capture, device && s != SKIPPED && s > 0) {
                            (Some(captured), true) => e.replay(captured)?,
                            (None, true) => {
                                e.begin_capture()?;
                                step(e, batch)?;
                                let captured = capture.insert(e.end_capture()?);
                                e.replay(captured)?;
                            }
                            (_, false) => step(e, batch)?,
                        }
                        let groups = 0..e.plan().groups().len();
                        shards.push(groups.map(|g| e.param_shard(g)).collect::<Result<_>>()?);
                    }
                    assert_eq!(e.read_device_skips()?, u64::from(device));
                    Ok(shards)
                })
            })
        };
        let (host, device) = (run(false), run(true));
        for (rank, (host, device)) in host.into_iter().zip(device).enumerate() {
            let (host, device) = (host.unwrap(), device.unwrap());
            assert_eq!(
                host[SKIPPED],
                host[SKIPPED - 1],
                "world {world}, rank {rank}: skipped"
            );
            assert_eq!(host, device, "world {world}, rank {rank}");
        }
    }
}

/// A load after a step the device skipped counts the skip before it takes the checkpoint's step
/// count: nothing the device decided goes uncounted.
#[test]
fn a_load_counts_the_skips_the_host_has_not_read() {
    let plan = Arc::new(Plan::new(&model(), 1).unwrap());
    let dir = Arc::new(Scratch::new("captured-steps-load-counts"));
    let counted = on_engines(&plan, &EngineConfig::default(), Mode::Async(2), move |e| {
        let dir = Arc::clone(&dir);
        with_batch(e, move |e, batch| -> Result<(u64, u64)> {
            batch.fill(e, 0)?;
            step(e, batch)?;
            e.save(dir.path())?;
            (batch.skip, batch.nonfinite_at) = (Skipping::OnDevice, Some((0, 1)));
            batch.fill(e, 1)?;
            step(e, batch)?;
            let unread = e.counters().skipped_steps;
            e.load(dir.path())?;
            Ok((unread, e.counters().skipped_steps))
        })
    });
    for outcome in counted {
        assert_eq!(
            outcome.unwrap(),
            (0, 1),
            "skipped steps before and after the load"
        );
    }
}

/// A save that one rank's own check refuses (its directory is taken) still reads the device's
/// skips on every rank: the ranks' step counts stay alike, and the next save holds them.
#[test]
fn a_save_refused_on_one_rank_reads_the_skips_on_every_rank() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    for_each_mode(|mode| {
        let dir = Arc::new(Scratch::new("captured-steps-refused-save"));
        let saving = Arc::clone(&dir);
        let counted = on_engines(&plan, &EngineConfig::default(), mode, move |e| {
            let dir = Arc::clone(&saving);
            with_batch(e, move |e, batch| -> Result<(u64, u64)> {
                (batch.skip, batch.nonfinite_at) = (Skipping::OnDevice, Some((1, 1)));
                for s in 0..3 {
                    batch.fill(e, s)?;
                    step(e, batch)?;
                    if s == 0 {
                        e.save(&dir.path().join("taken"))?;
                    }
                }
                let mine = match e.rank() {
                    1 => dir.path().join("taken"),
                    _ => dir.path().join("free"),
                };
                // Rank 1's own refusal, and rank 0's report of it.
                let refused = match e.save(&mine).err() {
                    Some(Error::PeerRefused { rank: 1, cause }) if e.rank() == 0 => Some(*cause),
                    other => other,
                };
                assert!(
                    matches!(refused, Some(Error::CheckpointExists { .. })),
                    "rank {}: {refused:?}",
                    e.rank()
                );
                let after_refusal = e.counters().skipped_steps;
                e.save(&dir.path().join("saved"))?;
                Ok((after_refusal, e.counters().skipped_steps))
            })
        });
        for (rank, outcome) in counted.into_iter().enumerate() {
            assert_eq!(
                outcome.unwrap(),
                (1, 1),
                "{mode:?}, rank {rank}: skips after the refused save, then the saved one"
            );
        }
        let saved = dir.path().join("saved");
        let manifest = fsdp_fusion::checkpoint::read_manifest(&saved, 0).unwrap();
        assert_eq!(
            manifest.optimizer_steps, 2,
            "{mode:?}: three steps, one skipped"
        );
    });
}

/// A checkpoint saved between replays holds the replayed steps, a replay the device skipped on a
/// gradient that is not finite left out of its step count: engines that load it and take an
/// eager step end where eager steps all along do, the host skipping that step (AdamW's bias
/// correction of the step after the load shows the step count came through).
#[test]
fn a_checkpoint_between_replays_holds_what_they_trained() {
    const SKIPPED: usize = 2;
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let config = EngineConfig::default();
    let mode = Mode::Async(1);
    let dir = Arc::new(Scratch::new("captured-steps-checkpoint"));
    let saved = Arc::clone(&dir);
    let replayed = on_engines(&plan, &config, mode, move |e| {
        with_batch(e, |e, batch| -> Result<u64> {
            (batch.skip, batch.nonfinite_at) = (Skipping::OnDevice, Some((1, SKIPPED)));
            batch.fill(e, 0)?;
            e.set_lr(lr(0))?;
            step(e, batch)?;
            batch.fill(e, 1)?;
            e.begin_capture()?;
            step(e, batch)?;
            let capture = e.end_capture()?;
            for s in 1..4 {
                batch.fill(e, s)?;
                e.set_lr(lr(s))?;
                e.replay(&capture)?;
            }
            e.save(saved.path())?;
            Ok(e.counters().skipped_steps)
        })
    });
    for (rank, skipped) in replayed.into_iter().enumerate() {
        assert_eq!(
            skipped.unwrap(),
            1,
            "rank {rank}: the skip read by the save"
        );
    }
    let manifest = fsdp_fusion::checkpoint::read_manifest(dir.path(), 0).unwrap();
    assert_eq!(manifest.optimizer_steps, 3, "four steps, one skipped");
    let resume = move |e: Engine<_, _>, load: bool| {
        let dir = Arc::clone(&dir);
        with_batch(e, move |e, batch| -> Result<Vec<Vec<u8>>> {
            (batch.skip, batch.nonfinite_at) = (Skipping::OnHost, Some((1, SKIPPED)));
            let steps = match load {
                true => {
                    e.load(dir.path())?;
                    4..5
                }
                false => 0..5,
            };
            for s in steps {
                batch.fill(e, s)?;
                e.set_lr(lr(s))?;
                step(e, batch)?;
            }
            (0..e.plan().groups().len())
                .map(|g| e.param_shard(g))
                .collect()
        })
    };
    let resume = Arc::new(resume);
    let again = Arc::clone(&resume);
    let loaded = on_engines(&plan, &config, mode, move |e| resume(e, true));
    let eager = on_engines(&plan, &config, mode, move |e| again(e, false));
    for (rank, (loaded, eager)) in loaded.into_iter().zip(eager).enumerate() {
        assert_eq!(loaded.unwrap(), eager.unwrap(), "rank {rank}");
    }
}

/// A capture given up (`abandon_capture`): before its step's first work it changes nothing;
/// between steps it ends the capture; mid-step, of either kind, it poisons the engine, with the
/// other streams joined back so that the caller can end its capture. A caller's capture that
/// ended before the engine left it poisons the engine at the leave.
#[test]
fn a_capture_given_up_or_ended_early_changes_nothing_or_poisons() {
    type Cpu = Engine<CpuBackend, LocalComm>;
    let plan = Arc::new(Plan::new(&model(), 1).unwrap());
    // After a warm-up step, on the asynchronous backend over the short suites' seeds.
    let warmed = |f: fn(&mut Cpu, &mut Batch<CpuBackend>) -> Result<()>| {
        for_each_mode(|mode| {
            if mode == Mode::Eager {
                return; // which cannot capture
            }
            let outcomes = on_engines(&plan, &EngineConfig::default(), mode, move |e| {
                with_batch(e, |e, batch| {
                    batch.fill(e, 0)?;
                    step(e, batch)?;
                    f(e, batch)
                })
            });
            for outcome in outcomes {
                outcome.unwrap_or_else(|e| panic!("{mode:?}: {e}"));
            }
        });
    };
    // Before the step's first work, and between steps: nothing lost, the engine goes on.
    warmed(|e, batch| {
        let before = e.counters();
        e.join_capture()?;
        e.abandon_capture()?;
        assert_eq!(e.counters(), before);
        e.join_capture()?;
        e.backend().begin_capture(Stream::Compute)?;
        step(e, batch)?;
        e.abandon_capture()?;
        e.backend().end_capture()?;
        assert_eq!(e.counters(), before, "nothing of the abandoned step ran");
        e.abandon_capture()?; // none under way
        step(e, batch)?;
        assert_eq!(e.counters().steps, before.steps + 1);
        Ok(())
    });
    // Mid-step, the caller's: poisoned, and the caller's capture ends (its streams joined).
    warmed(|e, batch| {
        e.join_capture()?;
        e.backend().begin_capture(Stream::Compute)?;
        e.pre_forward(Unit::Root)?;
        assert!(matches!(e.abandon_capture(), Err(Error::Poisoned { .. })));
        e.backend().end_capture()?;
        assert!(e.poisoned().is_some());
        assert!(matches!(step(e, batch), Err(Error::Poisoned { .. })));
        Ok(())
    });
    // Mid-step, the engine's own: poisoned, its capture ended.
    warmed(|e, _| {
        e.begin_capture()?;
        e.pre_forward(Unit::Root)?;
        assert!(matches!(e.abandon_capture(), Err(Error::Poisoned { .. })));
        assert_refused(e.backend().end_capture(), "no capture under way");
        Ok(())
    });
    // The engine's own, ended or given up on another thread: refused with nothing changed (a
    // CUDA capture in thread-local mode ends on its own thread), then ended on its own.
    warmed(|e, batch| {
        let steps = e.counters().steps;
        e.begin_capture()?;
        step(e, batch)?;
        let before = e.counters();
        let elsewhere = std::thread::scope(|s| {
            s.spawn(|| (e.end_capture().err(), e.abandon_capture().err()))
                .join()
                .expect("the other thread")
        });
        for refusal in [elsewhere.0, elsewhere.1] {
            assert!(
                matches!(&refusal, Some(Error::Capture { what }) if what.contains("another thread")),
                "{refusal:?}"
            );
        }
        assert_eq!(e.counters(), before);
        let captured = e.end_capture()?;
        e.replay(&captured)?;
        assert_eq!(e.counters().steps, steps + 1);
        Ok(())
    });
    // The engine's own, poisoned on another thread (an abort seen by a hook there): the
    // capture is left to the thread that began it (a CUDA capture ends on its own thread),
    // which ends it as it gives the capture up.
    warmed(|e, _| {
        e.begin_capture()?;
        e.pre_forward(Unit::Root)?;
        let abort = e.abort_handle();
        let seen = std::thread::scope(|s| {
            s.spawn(|| {
                abort.abort();
                e.post_forward(Unit::Root).err()
            })
            .join()
            .expect("the other thread")
        });
        assert!(matches!(seen, Some(Error::Poisoned { .. })), "{seen:?}");
        assert!(
            e.backend().alloc(8).is_err(),
            "the capture was ended elsewhere"
        );
        assert!(matches!(e.abandon_capture(), Err(Error::Poisoned { .. })));
        assert!(
            e.backend().alloc(8).is_ok(),
            "the capture is still under way"
        );
        Ok(())
    });
    // The caller ended its capture before the engine left it.
    warmed(|e, batch| {
        e.join_capture()?;
        e.backend().begin_capture(Stream::Compute)?;
        step(e, batch)?;
        assert!(
            e.backend().end_capture().is_err(),
            "the streams were not joined back"
        );
        assert_refused(e.leave_capture(), "a capture left after it ended");
        assert!(e.poisoned().is_some());
        Ok(())
    });
}

/// `r`'s capture error, naming `what`.
fn assert_refused<T: std::fmt::Debug>(r: Result<T>, what: &str) {
    match r {
        Err(Error::Capture { what: message }) => {
            assert!(message.contains(what), "{message:?} names no {what:?}")
        }
        other => panic!("expected a capture error naming {what:?}, got {other:?}"),
    }
}

#[test]
fn what_a_captured_step_cannot_hold_is_refused_with_nothing_changed() {
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let config = EngineConfig::default();
    let mode = Mode::Async(0);
    let outcomes = on_engines(&plan, &config, mode, |e| {
        with_batch(e, |e, batch| -> Result<()> {
            batch.fill(e, 0)?;
            assert_refused(e.begin_capture(), "warm-up");
            step(e, batch)?;
            e.pre_forward(Unit::Root)?;
            assert!(matches!(e.begin_capture(), Err(Error::MidStep { .. })));
            e.post_forward(Unit::Root)?;
            for unit in [Unit::Layer(0), Unit::Layer(1)] {
                e.pre_forward(unit)?;
                e.post_forward(unit)?;
            }
            // A forward with no backward: the step ends as usual, and is no warm-up (its
            // record replaced the training step's forward order); nor is an empty step.
            e.end_step()?;
            assert_refused(e.begin_capture(), "warm-up");
            step(e, batch)?;
            e.end_step()?;
            assert_refused(e.begin_capture(), "warm-up");
            assert_refused(e.join_capture(), "warm-up");
            // Nor is a step whose one call was an empty gradient batch, which does nothing.
            e.grads(&[])?;
            e.end_step()?;
            assert_refused(e.begin_capture(), "warm-up");
            step(e, batch)?;
            e.set_tracing(true).unwrap();
            assert_refused(e.begin_capture(), "a trace");
            e.set_tracing(false).unwrap();
            e.begin_capture()?;
            assert_refused(e.begin_capture(), "inside another");
            assert_refused(e.param_shard(0), "during a capture");
            assert_refused(e.save(std::path::Path::new("unused")), "during a capture");
            assert_refused(e.set_tracing(true), "a trace");
            let zeros = vec![0f32; e.plan().params()[0].numel()];
            assert_refused(
                e.load_param(ParamId(0), Input::host(&zeros)),
                "during a capture",
            );
            e.pre_forward(Unit::Root)?;
            assert!(matches!(e.end_capture(), Err(Error::MidStep { .. })));
            e.post_forward(Unit::Root)?;
            for unit in [Unit::Layer(0), Unit::Layer(1)] {
                e.pre_forward(unit)?;
                e.post_forward(unit)?;
            }
            for unit in [Unit::Layer(1), Unit::Layer(0), Unit::Root] {
                e.pre_backward(unit)?;
                if unit == Unit::Layer(1) {
                    // A replay would take the bytes of the capture again.
                    let g = vec![0.5f32; e.plan().params()[3].numel()];
                    assert_refused(e.grad(ParamId(3), Input::host(&g)), "host memory");
                }
                e.post_backward(unit)?;
            }
            e.finish_grad_sync()?;
            assert_refused(e.grad_norm(), "the gradient norm");
            assert_refused(e.nonfinite_grads(), "non-finite");
            e.optimizer_step()?;
            e.end_step()?;
            // A capture holds one step: its replays write one step's values.
            assert_refused(e.pre_forward(Unit::Root), "a second step");
            assert_refused(e.end_step(), "a second step");
            let before = e.counters();
            let captured = e.end_capture()?;
            // Nothing ran: the counts are the capture's beginning's.
            assert_eq!(e.counters().steps, before.steps - 1);
            assert_refused(e.end_capture(), "no capture under way");
            e.replay(&captured)?;
            e.replay(&captured)?;
            assert_eq!(e.counters().steps, before.steps + 1);
            // The caller's capture: a step's first work joins it, and is refused, with nothing
            // changed, where the caller began none; the replay's calls come in pairs.
            e.join_capture()?;
            assert_refused(e.join_capture(), "inside another");
            assert_refused(e.pre_forward(Unit::Root), "join");
            assert_refused(e.leave_capture(), "no step joined");
            e.join_capture()?;
            e.backend().begin_capture(Stream::Compute)?;
            assert_refused(e.end_capture(), "leave_capture");
            step(e, batch)?;
            let replay = e.leave_capture()?;
            let graph = e.backend().end_capture()?;
            // A second step captured: `replayed` must name `before_replay`'s.
            e.join_capture()?;
            e.backend().begin_capture(Stream::Compute)?;
            step(e, batch)?;
            let other = e.leave_capture()?;
            drop(e.backend().end_capture()?);
            assert_refused(e.replayed(&replay), "without before_replay");
            e.before_replay(&replay)?;
            assert_refused(e.before_replay(&replay), "twice");
            assert_refused(e.replayed(&other), "another step than before_replay's");
            let between = "between before_replay and replayed";
            assert_refused(e.pre_forward(Unit::Root), between);
            assert_refused(e.join_capture(), between);
            assert_refused(e.param_shard(0), between);
            assert_refused(e.save(std::path::Path::new("unused")), between);
            // SAFETY: as in `cpu_caller_capture`.
            unsafe { e.backend().replay(&graph) }?;
            e.replayed(&replay)?;
            assert_eq!(e.counters().steps, before.steps + 2);
            Ok(())
        })
    });
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        outcome.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
    }
    // Refused before anything is queued: per-step gradient shards, the ranks' comparison of
    // their collectives, the eager backend; and a step another engine captured.
    let refusals = [
        (
            EngineConfig {
                grad_shard_memory: GradShardMemory::PerStep,
                ..config.clone()
            },
            Mode::Async(0),
            "per-step gradient shards",
        ),
        (
            EngineConfig {
                verify_collectives: true,
                ..config.clone()
            },
            Mode::Async(0),
            "verify_collectives",
        ),
        (config.clone(), Mode::Eager, ""),
    ];
    for (config, mode, what) in refusals {
        let outcomes = on_engines(&plan, &config, mode, move |e| {
            with_batch(e, |e, batch| -> Result<()> {
                batch.fill(e, 0)?;
                step(e, batch)?;
                match mode {
                    Mode::Eager => assert!(matches!(
                        e.begin_capture(),
                        Err(Error::Unsupported { backend: "cpu", .. })
                    )),
                    Mode::Async(_) => assert_refused(e.begin_capture(), what),
                }
                assert!(!e.capturing());
                step(e, batch)
            })
        });
        for outcome in outcomes {
            outcome.unwrap();
        }
    }
    let plan_of_one = Arc::new(Plan::new(&model(), 1).unwrap());
    // Captured, never replayed: the batch may go with the engine.
    let captured = on_engines(&plan_of_one, &config, mode, |e| {
        with_batch(e, |e, batch| {
            batch.fill(e, 0).unwrap();
            step(e, batch).unwrap();
            e.begin_capture().unwrap();
            step(e, batch).unwrap();
            e.end_capture().unwrap()
        })
    });
    let other = on_engines(&plan_of_one, &config, mode, move |mut e| {
        e.replay(&captured[0])
    });
    assert_refused(other.into_iter().next().unwrap(), "another engine");
}

/// The caller's own capture of the compute stream, in thread-local mode (as
/// `torch.cuda.graph(..., capture_error_mode="thread_local")` makes it), outside the backend.
fn cuda_caller_capture() -> CallerCapture<CudaBackend> {
    fn driver(e: cudarc::driver::DriverError) -> Error {
        Error::Cuda {
            call: "a stream capture",
            code: e.0 as i32,
            message: e.to_string(),
        }
    }
    CallerCapture {
        begin: |b| {
            // SAFETY: the capture only records the work queued on the stream.
            let stream = unsafe { b.stream(Stream::Compute) };
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(driver)
        },
        end: |b| {
            // SAFETY: as above.
            let stream = unsafe { b.stream(Stream::Compute) };
            let graph = stream
                .end_capture(CUgraphInstantiate_flags(0))
                .map_err(driver)?;
            let graph = graph.ok_or_else(|| Error::Capture {
                what: "an empty capture".into(),
            })?;
            Ok(Box::new(move |_: &CudaBackend| {
                graph.launch().map_err(driver)
            }))
        },
    }
}

/// An engine of `plan` on GPU 0 with an NCCL communicator of one rank.
fn nccl_engine(plan: &Arc<Plan>, config: &EngineConfig) -> Engine<CudaBackend, NcclComm> {
    let backend = CudaBackend::new(0).unwrap_or_else(|e| panic!("{e}"));
    let id = NcclComm::unique_id().unwrap_or_else(|e| panic!("{e}"));
    let comm =
        NcclComm::new(&id, 0, 1, &backend, DEFAULT_TIMEOUT).unwrap_or_else(|e| panic!("{e}"));
    Engine::new(Arc::clone(plan), config.clone(), backend, comm).unwrap_or_else(|e| panic!("{e}"))
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn replays_of_a_captured_step_train_as_eager_steps_do_on_the_gpu() {
    let plan = Arc::new(Plan::new(&model(), 1).unwrap());
    for (name, config) in configs() {
        let eager = train(nccl_engine(&plan, &config), false, Clipping::No);
        let replayed = train(nccl_engine(&plan, &config), true, Clipping::No);
        assert_trained_alike(&eager, &replayed, name);
        let by_caller = train_batch(nccl_engine(&plan, &config), true, |b| {
            b.by_caller = Some(cuda_caller_capture())
        });
        assert_trained_alike(&eager, &by_caller, &format!("{name}, the caller's capture"));
        if config.step_in_backward {
            continue; // which refuses clipping by the global norm
        }
        // Clipped on the device, eagerly and in the replays, as by the host's norm.
        let host = train(nccl_engine(&plan, &config), false, Clipping::OnHost(0.25));
        let device = train(nccl_engine(&plan, &config), false, Clipping::OnDevice(0.25));
        let replayed = train(nccl_engine(&plan, &config), true, Clipping::OnDevice(0.25));
        assert_ne!(host.shards, eager.shards, "{name}: the bound clips");
        assert_trained_alike(&host, &device, name);
        assert_trained_alike(&host, &replayed, name);
        assert!(eager.shards.windows(2).all(|w| w[0] != w[1]), "{name}");
        // A step whose gradient is not finite, skipped on the device, eagerly and in a replay
        // and in the eager step after the replays, as by the host.
        for at in [2, STEPS - 1] {
            let skipping = |captured, skip| {
                train_batch(nccl_engine(&plan, &config), captured, |b| {
                    (b.skip, b.nonfinite_at) = (skip, Some((0, at)));
                })
            };
            let host = skipping(false, Skipping::OnHost);
            assert_eq!(
                host.shards[at],
                host.shards[at - 1],
                "{name}: the skip at {at}"
            );
            let what = format!("{name}, skipped at {at}");
            assert_trained_alike(&host, &skipping(false, Skipping::OnDevice), &what);
            assert_trained_alike(&host, &skipping(true, Skipping::OnDevice), &what);
        }
    }
    // The loopback's ranks meet on the host: refused before anything is queued.
    let plan = Arc::new(Plan::new(&model(), 2).unwrap());
    let outcomes = within_deadline("two loopback ranks", move || {
        let comms = LoopbackComm::group(2).unwrap();
        on_threads(comms, |_, comm| {
            let backend = CudaBackend::new(0).unwrap();
            let e = Engine::new(Arc::clone(&plan), EngineConfig::default(), backend, comm).unwrap();
            with_batch(e, |e, batch| -> Result<()> {
                batch.fill(e, 0)?;
                step(e, batch)?;
                assert_refused(e.begin_capture(), "meet on the host");
                step(e, batch)
            })
        })
    });
    for outcome in outcomes {
        outcome.unwrap();
    }
}
