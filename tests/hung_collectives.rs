//! A collective that never completes on its stream (a peer stuck or gone, as NCCL would show
//! it: a kernel waiting on the device) fails the rank past the engine's timeout wherever the host
//! waits: the engine's watchdog aborts the rank's communicators, its streams drain, the caller's
//! own wait on a stream returns, and the next engine call names the collective. In each phase of
//! a step with a collective of its own (gathers in the forward and the backward, reductions, the
//! last one still in flight at `finish_grad_sync`, the norm's exchange before the optimizer), on
//! 2 ranks of the asynchronous CPU backend; and at once on `abort()` from another thread.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use fsdp_fusion::{
    Backend, CpuBackend, DType, Engine, EngineConfig, Error, Input, LocalComm, ModelSpec,
    OptimizerConfig, ParamId, ParamSpec, Plan, Stream, Unit,
};
use fsdp_fusion_support::faults::Faulty;
use fsdp_fusion_support::ranks::{Mode, on_threads, within_deadline};

type HungEngine = Engine<CpuBackend, Faulty<LocalComm>>;

/// One engine call of a step.
type Call = fn(&mut HungEngine) -> Result<(), Error>;

const TIMEOUT: Duration = Duration::from_millis(800);

/// How long past the timeout a wait may end: the watchdog's period and the stream's drain.
const SLACK: Duration = Duration::from_secs(4);

fn plan() -> Arc<Plan> {
    let params = (0..3)
        .map(|u| ParamSpec::new(format!("w{u}"), &[64], DType::F32).in_unit(u))
        .collect();
    Arc::new(Plan::new(&ModelSpec::new(params).unwrap(), 2).unwrap())
}

/// One step's calls, in order, over 3 units with one gathered at a time (so the backward
/// gathers again); each returns what the engine said.
fn calls() -> Vec<(&'static str, Call)> {
    fn grad(e: &mut HungEngine, p: usize) -> Result<(), Error> {
        e.grad(ParamId(p), Input::host(&[0.5f32; 64]))
    }
    vec![
        ("pre_forward 0", |e| e.pre_forward(Unit::Layer(0))),
        ("post_forward 0", |e| e.post_forward(Unit::Layer(0))),
        ("pre_forward 1", |e| e.pre_forward(Unit::Layer(1))),
        ("post_forward 1", |e| e.post_forward(Unit::Layer(1))),
        ("pre_forward 2", |e| e.pre_forward(Unit::Layer(2))),
        ("post_forward 2", |e| e.post_forward(Unit::Layer(2))),
        ("pre_backward 2", |e| e.pre_backward(Unit::Layer(2))),
        ("grad 2", |e| grad(e, 2)),
        ("post_backward 2", |e| e.post_backward(Unit::Layer(2))),
        ("pre_backward 1", |e| e.pre_backward(Unit::Layer(1))),
        ("grad 1", |e| grad(e, 1)),
        ("post_backward 1", |e| e.post_backward(Unit::Layer(1))),
        ("pre_backward 0", |e| e.pre_backward(Unit::Layer(0))),
        ("grad 0", |e| grad(e, 0)),
        ("finish_grad_sync", |e| e.finish_grad_sync()),
        ("clip_grad_norm", |e| e.clip_grad_norm(1.0).map(drop)),
        ("optimizer_step", |e| e.optimizer_step()),
        ("end_step", |e| e.end_step()),
    ]
}

fn engines(hang_at: Option<usize>, seed: u64) -> Vec<(HungEngine, Arc<AtomicUsize>)> {
    let config = EngineConfig {
        optimizer: OptimizerConfig::sgd(0.1),
        timeout: TIMEOUT,
        double_buffer_limit: 1,
        ..EngineConfig::default()
    };
    let plan = plan();
    on_threads(LocalComm::group(2).unwrap(), |rank, comm| {
        let comm = match hang_at {
            Some(at) => Faulty::hanging(comm, at),
            None => Faulty::new(comm, false),
        };
        let issued = Arc::clone(&comm.issued);
        let backend = Mode::Async(seed + rank as u64).backend(rank);
        let e = Engine::new(Arc::clone(&plan), config.clone(), backend, comm).unwrap();
        (e, issued)
    })
}

/// The collectives issued before each call of a step.
fn collectives_before_each_call() -> Vec<usize> {
    let ranks = engines(None, 1);
    let counts = on_threads(ranks, |_, (mut e, issued)| {
        calls()
            .into_iter()
            .map(|(what, call)| {
                let before = issued.load(Ordering::SeqCst);
                call(&mut e).unwrap_or_else(|err| panic!("{what}: {err}"));
                before
            })
            .collect::<Vec<_>>()
    });
    counts[0].clone()
}

/// The failure under the poisoning and the failed stream it came through.
fn root(e: &Error) -> &Error {
    match e {
        Error::Poisoned { cause } => root(cause),
        Error::StreamFailed { cause, .. } => root(cause),
        other => other,
    }
}

#[test]
fn a_hung_collective_in_any_phase_fails_every_wait_past_the_deadline() {
    within_deadline("hung collectives", || {
        let before = collectives_before_each_call();
        let steps = calls();
        // The phases with a collective of their own: each call that issues one.
        let phases: Vec<usize> = (0..steps.len())
            .filter(|&i| before.get(i + 1).is_some_and(|&next| next > before[i]))
            .collect();
        let names: Vec<_> = phases.iter().map(|&i| steps[i].0).collect();
        // A gather in the forward and in the backward, reductions (at a unit's backward's end,
        // and at `finish_grad_sync` for the unit whose backward no hook ended), the norm's
        // exchange before the optimizer.
        for wanted in [
            "pre_forward 0",
            "pre_backward 1",
            "post_backward 1",
            "finish_grad_sync",
            "clip_grad_norm",
        ] {
            assert!(
                names.contains(&wanted),
                "{wanted} issues no collective: {names:?}"
            );
        }
        // The phases side by side: each mostly waits out its timeout.
        on_threads(phases, |seed, phase| {
            let at = before[phase];
            let what = steps[phase].0;
            let outcomes = on_threads(engines(Some(at), 10 + seed as u64), move |_, (mut e, _)| {
                let calls = calls();
                for (name, call) in &calls[..phase] {
                    call(&mut e).unwrap_or_else(|err| panic!("{what}: {name}: {err}"));
                }
                let start = Instant::now();
                // The hung call itself returns (it queues, or waits within the deadline).
                let hung = (calls[phase].1)(&mut e);
                // The caller's own wait on the device returns too (every stream, as
                // `torch.cuda.synchronize()` waits for).
                let synced: Vec<_> = [Stream::Compute, Stream::Gather, Stream::Reduce]
                    .into_iter()
                    .map(|s| {
                        let b = e.backend();
                        b.record(s).and_then(|done| b.synchronize(&done))
                    })
                    .collect();
                let waited = start.elapsed();
                let next = match calls.get(phase + 1) {
                    Some((_, call)) => call(&mut e),
                    None => e.pre_forward(Unit::Layer(0)),
                };
                let later = e.end_step();
                (hung, synced, waited, next, later)
            });
            for (rank, (hung, _synced, waited, next, later)) in outcomes.into_iter().enumerate() {
                let what = format!("hung at {what} (collective {at}), rank {rank}");
                assert!(
                    waited < TIMEOUT + SLACK,
                    "{what}: the waits took {waited:?}"
                );
                // Named: which collective, of which step, among how many ranks.
                let named = |e: &Error| {
                    let text = e.to_string();
                    text.contains("still in flight")
                        && text.contains("of step 0")
                        && text.contains("of 2")
                };
                // The error comes at the hung call (a host wait inside it) or at the next one.
                let first = match (&hung, &next) {
                    (Err(e), _) => e,
                    (Ok(()), Err(e)) => e,
                    (Ok(()), Ok(())) => panic!("{what}: no call failed"),
                };
                let cause = root(first);
                assert!(
                    matches!(cause, Error::CollectiveTimedOut { peers: 2, .. }) && named(cause),
                    "{what}: {first}"
                );
                assert!(
                    matches!(&later, Err(e @ Error::Poisoned { .. }) if matches!(root(e), Error::CollectiveTimedOut { .. })),
                    "{what}: a later call: {later:?}"
                );
            }
        });
    });
}

#[test]
fn abort_from_another_thread_ends_a_hung_collective_at_once() {
    within_deadline("an aborted hung collective", || {
        let before = collectives_before_each_call();
        let at = before[0];
        let config_timeout = Duration::from_secs(600);
        let plan = plan();
        let outcomes = on_threads(LocalComm::group(2).unwrap(), move |rank, comm| {
            let config = EngineConfig {
                optimizer: OptimizerConfig::sgd(0.1),
                timeout: config_timeout,
                ..EngineConfig::default()
            };
            let backend = Mode::Async(40 + rank as u64).backend(rank);
            let mut e = Engine::new(
                Arc::clone(&plan),
                config,
                backend,
                Faulty::hanging(comm, at),
            )
            .unwrap();
            let abort = e.abort_handle();
            let start = Instant::now();
            let aborter = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(200));
                abort.abort();
            });
            e.pre_forward(Unit::Layer(0)).unwrap();
            let synced = e
                .backend()
                .record(Stream::Compute)
                .and_then(|done| e.backend().synchronize(&done));
            let waited = start.elapsed();
            aborter.join().unwrap();
            drop(synced);
            (waited, e.post_forward(Unit::Layer(0)))
        });
        for (rank, (waited, next)) in outcomes.into_iter().enumerate() {
            assert!(
                waited < Duration::from_secs(5),
                "rank {rank}: waited {waited:?} for a 600 s timeout"
            );
            assert!(
                matches!(&next, Err(Error::Poisoned { cause }) if matches!(**cause, Error::Aborted)),
                "rank {rank}: {next:?}"
            );
        }
    });
}
