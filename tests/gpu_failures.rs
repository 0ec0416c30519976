//! On the GPU, ranks that diverge, stop or are aborted get an error, and non-finite gradients are
//! counted: CUDA engines of two loopback ranks on one GPU, one thread each.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fsdp_fusion::backend::cuda::CudaBackend;
use fsdp_fusion::comm::loopback::LoopbackComm;
use fsdp_fusion::{
    DType, Engine, EngineConfig, Error, Input, ModelSpec, OptimizerConfig, ParamSpec, Plan, Result,
    Unit,
};
use fsdp_fusion_support::ranks::on_threads;

type GpuEngine = Engine<CudaBackend, LoopbackComm>;

fn root(e: &Error) -> &Error {
    match e {
        Error::StreamFailed { cause, .. } => root(cause),
        Error::Poisoned { cause } => root(cause),
        other => other,
    }
}

/// Runs `f` on both engines of a two-rank loopback group, one thread each.
fn on_two_gpu_ranks<R: Send>(config: EngineConfig, f: impl Fn(GpuEngine) -> R + Sync) -> Vec<R> {
    let model = ModelSpec::new(vec![
        ParamSpec::new("a", &[64], DType::F32).in_unit(0),
        ParamSpec::new("b", &[64], DType::F32).in_unit(1),
    ])
    .unwrap();
    let plan = Arc::new(Plan::new(&model, 2).unwrap());
    on_threads(LoopbackComm::group(2).unwrap(), |_, comm| {
        let backend = CudaBackend::new(0).unwrap_or_else(|e| panic!("{e}"));
        f(Engine::new(Arc::clone(&plan), config.clone(), backend, comm).unwrap())
    })
}

fn sgd() -> EngineConfig {
    EngineConfig {
        optimizer: OptimizerConfig::sgd(0.5),
        ..EngineConfig::default()
    }
}

fn forward(e: &mut GpuEngine) -> Result<()> {
    for u in [Unit::Layer(0), Unit::Layer(1)] {
        e.pre_forward(u)?;
        e.post_forward(u)?;
    }
    Ok(())
}

/// Gradients for `names` with no unit hook, then the sync, which reduces them in the plan's
/// order.
fn backward_in_order(e: &mut GpuEngine, names: [&str; 2], g: &[f32; 64]) -> Result<()> {
    for name in names {
        let id = e.plan().param_id(name)?;
        e.grad(id, Input::host(g))?;
    }
    e.finish_grad_sync()
}

/// The backward of the units of `names` in that order, each unit's gradient between its hooks
/// (its end reduces it), then the sync.
fn units_backward_in_order(e: &mut GpuEngine, names: [&str; 2]) -> Result<()> {
    for name in names {
        let id = e.plan().param_id(name)?;
        let unit = e.plan().param(id)?.unit();
        e.pre_backward(unit)?;
        e.grad(id, Input::host(&[1.0; 64]))?;
        e.post_backward(unit)?;
    }
    e.finish_grad_sync()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn loopback_ranks_that_end_units_backward_in_another_order_fail_naming_both() {
    let outcomes = on_two_gpu_ranks(sgd(), |mut e| {
        let order = if e.rank() == 0 {
            ["a", "b"]
        } else {
            ["b", "a"]
        };
        let result = forward(&mut e).and_then(|()| units_backward_in_order(&mut e, order));
        result.err().map(|e| root(&e).clone())
    });
    for error in outcomes {
        assert!(
            matches!(&error, Some(Error::CollectiveMismatch { rank: 1, expected, got })
                if expected.contains("group 0") && got.contains("group 1")),
            "{error:?}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_loopback_rank_blocked_by_a_silent_peer_times_out_or_is_aborted() {
    let quick = EngineConfig {
        timeout: Duration::from_millis(300),
        ..sgd()
    };
    let outcomes = on_two_gpu_ranks(quick, |mut e| {
        forward(&mut e).unwrap();
        if e.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
            return None;
        }
        let started = Instant::now();
        let error = backward_in_order(&mut e, ["a", "b"], &[1.0; 64]).unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(30));
        Some(root(&error).clone())
    });
    // The meeting's own deadline, or the watchdog's of the collective in flight.
    assert!(
        matches!(
            &outcomes[0],
            Some(Error::Timeout { op, .. } | Error::CollectiveTimedOut { collective: op, .. })
                if op.contains("reduce-scatter of group 0")
        ),
        "{outcomes:?}"
    );
    let outcomes = on_two_gpu_ranks(sgd(), |mut e| {
        forward(&mut e).unwrap();
        if e.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1000));
            return None;
        }
        let handle = e.abort_handle();
        let aborter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            handle.abort();
        });
        let error = backward_in_order(&mut e, ["a", "b"], &[1.0; 64]).unwrap_err();
        aborter.join().unwrap();
        let later = e.pre_forward(Unit::Layer(0));
        Some((root(&error).clone(), later.is_err()))
    });
    assert!(
        matches!(outcomes[0], Some((Error::Aborted, true))),
        "{outcomes:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn non_finite_gradients_are_counted_on_the_gpu() {
    let counts = on_two_gpu_ranks(sgd(), |mut e| {
        forward(&mut e).unwrap();
        let mut g = [1.0f32; 64];
        if e.rank() == 1 {
            g[7] = f32::NAN;
            g[9] = f32::NEG_INFINITY;
            g[63] = f32::INFINITY;
        }
        backward_in_order(&mut e, ["a", "b"], &g).unwrap();
        e.nonfinite_grads().unwrap()
    });
    // `a`'s and `b`'s padded groups hold 128 elements, 64 per rank: rank 0 holds all three.
    assert_eq!(counts, vec![6, 0]);
}

/// A gather that never completes on the device (its stream waits on a word only the rank's end
/// sets, as a collective stuck on a peer waits): past the engine's timeout the watchdog fails
/// the rank, the streams drain, the caller's own stream syncs return, and the next call names
/// the collective.
#[test]
#[ignore = "needs a CUDA GPU"]
fn a_gather_hung_on_the_device_fails_past_the_deadline_and_the_streams_drain() {
    use fsdp_fusion::Backend;
    use fsdp_fusion_support::faults::Faulty;
    let timeout = Duration::from_secs(2);
    let model = ModelSpec::new(vec![
        ParamSpec::new("a", &[64], DType::F32).in_unit(0),
        ParamSpec::new("b", &[64], DType::F32).in_unit(1),
    ])
    .unwrap();
    let plan = Arc::new(Plan::new(&model, 2).unwrap());
    let config = EngineConfig { timeout, ..sgd() };
    let outcomes = on_threads(LoopbackComm::group(2).unwrap(), |_, comm| {
        let backend = CudaBackend::new(0).unwrap_or_else(|e| panic!("{e}"));
        // Collective 0 is the plan check; 1 is the first gather.
        let comm = Faulty::hanging(comm, 1);
        let mut e = Engine::new(Arc::clone(&plan), config.clone(), backend, comm).unwrap();
        let start = Instant::now();
        e.pre_forward(Unit::Layer(0)).unwrap();
        let synced: Vec<_> = [
            fsdp_fusion::Stream::Compute,
            fsdp_fusion::Stream::Gather,
            fsdp_fusion::Stream::Reduce,
        ]
        .into_iter()
        .map(|s| {
            e.backend()
                .record(s)
                .and_then(|d| e.backend().synchronize(&d))
        })
        .collect();
        let waited = start.elapsed();
        let next = e.post_forward(Unit::Layer(0));
        (synced, waited, next, e.end_step())
    });
    for (rank, (_synced, waited, next, later)) in outcomes.into_iter().enumerate() {
        eprintln!("rank {rank}: the stream syncs returned {waited:?} after the hung gather");
        assert!(
            waited < timeout + Duration::from_secs(5),
            "rank {rank}: {waited:?}"
        );
        let e = next.expect_err("the call after the deadline");
        assert!(
            matches!(root(&e), Error::CollectiveTimedOut { peers: 2, .. }),
            "rank {rank}: {e}"
        );
        assert!(
            matches!(later, Err(Error::Poisoned { .. })),
            "rank {rank}: {later:?}"
        );
    }
}
