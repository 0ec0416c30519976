//! A step captured on the engine's compute stream, by the engine itself or by the caller (its own
//! CUDA stream capture, or `torch.cuda.graph` given that stream), and its replays, from C. The
//! engine's handle keeps the captured step, so that each replay's calls name the engine alone.

use super::handles::{AnyCapturedStep, AnyEngine, on_engine, on_engine_captures, with_engine};
use super::status::{boundary, fsdp_status};
use super::types::fsdp_engine;
use crate::error::Error;

/// Between steps, right after a training step (the warm-up: one that entered a backward pass,
/// or replays since it; an empty or forward-only step is none), and before the caller begins
/// its capture of the engine's compute stream, in thread-local or relaxed mode (the engine's
/// watchdog queries events from a thread of its own, which a global-mode capture forbids): the
/// next step's first call that queues work joins that capture.
/// `FSDP_MISUSE`, with nothing changed, where a step could not be captured (per-step gradient
/// shards, `verify_collectives`, a trace, the loopback communicator, with no warm-up or
/// mid-step), and for that first call where no capture of the compute stream is under way.
/// During the capture a host read (the gradient norm on the host, a save, a load, a host
/// gradient) is `FSDP_MISUSE`; clip with `fsdp_engine_clip_grad_norm_on_device`.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_join_capture(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| on_engine(engine, |any| Ok(with_engine!(any, e => e.join_capture())?)))
}

/// After the captured step's `fsdp_engine_end_step`, before the caller ends its capture: the
/// engine's other streams join back into the compute stream, the engine is again where it was
/// when the capture began (nothing ran), and its handle keeps the step for
/// `fsdp_engine_before_replay` and `fsdp_engine_replayed`. `FSDP_MISUSE` where no step joined
/// the capture (the engine awaits it no longer) and mid-step; a capture that failed poisons
/// the engine (`FSDP_POISONED` from then on), and its graph must not be replayed. The handle
/// keeps the last step left: replay only the graph of the last capture.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_leave_capture(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| {
        on_engine_captures(engine, |any, captures| {
            captures.by_caller = Some(with_engine!(any, e => e.leave_capture())?);
            Ok(())
        })
    })
}

/// Gives up the capture under way, for a failure inside the captured step: where no step joined
/// it yet the engine awaits it no longer, with nothing else changed; between steps it is left
/// and its step dropped; mid-step the engine's other streams join back into the compute stream
/// (so that the caller can end its capture), the engine leaves it and is poisoned
/// (`FSDP_POISONED`): its state is a step's that never ran. With no capture under way it does
/// nothing.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_abandon_capture(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| {
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.abandon_capture())?)
        })
    })
}

/// Before each replay of the captured step, between steps: orders the engine's work so far
/// before it and writes the step's values (step count, learning rate now) on the compute
/// stream. The caller then launches its graph on the compute stream and calls
/// `fsdp_engine_replayed`; between them a step's call, a capture, a save, a load and a read of
/// the state are `FSDP_MISUSE`. `FSDP_MISUSE` with no captured step, twice in a row, or
/// mid-step. Where the caller's launch fails, abort the engine (`fsdp_engine_abort`): whether
/// the graph's work was queued is not known, and its state would be a guess.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_before_replay(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| {
        on_engine_captures(engine, |any, captures| {
            let replay = captures.by_caller.as_ref().ok_or_else(no_captured_step)?;
            Ok(with_engine!(any, e => e.before_replay(replay))?)
        })
    })
}

/// After the caller launched its replay on the compute stream: holds the step's collectives to
/// the engine's deadline, orders the engine's later work after the replay, and moves its step
/// count and counters on as the captured step did; no host wait. `FSDP_MISUSE` without
/// `fsdp_engine_before_replay` first.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_replayed(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| {
        on_engine_captures(engine, |any, captures| {
            let replay = captures.by_caller.as_ref().ok_or_else(no_captured_step)?;
            Ok(with_engine!(any, e => e.replayed(replay))?)
        })
    })
}

fn no_captured_step() -> Error {
    Error::Capture {
        what: "a replay with no captured step (fsdp_engine_leave_capture keeps it)".into(),
    }
}

/// Between steps, after the warm-up (as for `fsdp_engine_join_capture`): the engine begins
/// capturing its compute stream itself (on a CPU engine of an asynchronous group,
/// `fsdp_local_group_create_async`; on a CUDA engine, in thread-local mode). The next step's
/// calls, and the caller's work queued on the compute stream meanwhile
/// (`fsdp_engine_launch_host_func`, a CUDA engine's kernels on that stream), are captured and
/// do not run; `fsdp_engine_end_capture` after the step's `fsdp_engine_end_step` ends it, on
/// the thread that began it (`FSDP_MISUSE` on another, as for `fsdp_engine_abandon_capture`,
/// with nothing changed: a CUDA capture in thread-local mode ends on its own thread; an engine
/// poisoned on another thread leaves the capture to that one too, for
/// `fsdp_engine_abandon_capture` or `fsdp_engine_destroy` there). Refused as
/// `fsdp_engine_join_capture` is (`FSDP_MISUSE`, nothing changed), `FSDP_UNAVAILABLE` on an
/// eager CPU group, whose streams cannot capture,
/// and `FSDP_DEVICE_ERROR` where the driver refuses to begin it (the legacy default stream
/// cannot be captured): that refusal changes nothing and does not poison the engine.
/// During the capture a host read (`fsdp_engine_param`, the gradient norm on the host, a save, a
/// load, a host gradient) is `FSDP_MISUSE`: read with `fsdp_engine_param_device`, hand gradients
/// over with `fsdp_engine_grad_device`, clip with `fsdp_engine_clip_grad_norm_on_device`.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_begin_capture(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| on_engine(engine, |any| Ok(with_engine!(any, e => e.begin_capture())?)))
}

/// After the captured step's `fsdp_engine_end_step`: ends the engine's capture. The engine is
/// again where it was when the capture began (nothing ran), and its handle keeps the step for
/// `fsdp_engine_replay`, in place of the one it kept. `FSDP_MISUSE` with no capture of the
/// engine's own under way and mid-step; a capture that failed poisons the engine.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_end_capture(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| {
        on_engine_captures(engine, |any, captures| {
            captures.by_engine = Some(match any {
                AnyEngine::Cpu(e) => AnyCapturedStep::Cpu(e.end_capture()?),
                AnyEngine::CudaNccl(e) => AnyCapturedStep::Cuda(e.end_capture()?),
                AnyEngine::CudaLoopback(e) => AnyCapturedStep::Cuda(e.end_capture()?),
            });
            Ok(())
        })
    })
}

/// Between steps, replays the step the engine captured last (`fsdp_engine_end_capture`): writes
/// the step's values (step count, learning rate now: `fsdp_engine_set_lr` between replays takes
/// effect) on the compute stream, queues the captured work there, and moves the engine's step
/// count and counters on as the step did; no host wait. The caller writes the next inputs where
/// the captured work reads them first, in stream order (a host function queued before the
/// replay, or after a wait for the stream). `FSDP_MISUSE` with no captured step, mid-step,
/// during a capture, and between `fsdp_engine_before_replay` and `fsdp_engine_replayed`.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_replay(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| {
        on_engine_captures(engine, |any, captures| {
            let no_step = || Error::Capture {
                what:
                    "a replay with no step the engine captured (fsdp_engine_end_capture keeps it)"
                        .into(),
            };
            match (any, captures.by_engine.as_ref().ok_or_else(no_step)?) {
                (AnyEngine::Cpu(e), AnyCapturedStep::Cpu(step)) => Ok(e.replay(step)?),
                (AnyEngine::CudaNccl(e), AnyCapturedStep::Cuda(step)) => Ok(e.replay(step)?),
                (AnyEngine::CudaLoopback(e), AnyCapturedStep::Cuda(step)) => Ok(e.replay(step)?),
                // A handle keeps only its own engine's steps.
                _ => Err(Error::Capture {
                    what: "a replay of a step another kind of engine captured".into(),
                }
                .into()),
            }
        })
    })
}
