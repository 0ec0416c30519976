//! What the C handles name: plans, groups and engines in one process-wide registry, and the
//! ways to reach them. An engine's entry keeps, outside the engine's own lock, what other threads
//! need while one of its calls blocks: its abort handle and its last counters.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, LazyLock, Mutex};

use super::comms::Comms;
use super::registry::{Object, Registry, lock};
use super::status::{Failure, Outcome, fsdp_status, null, panic_message, put};
use super::types::{fsdp_counters, fsdp_engine, fsdp_plan};
use crate::backend::Backend;
use crate::backend::MemoryUsage;
use crate::backend::cpu::CpuBackend;
use crate::backend::cpu::CpuGraph;
use crate::backend::cuda::CudaBackend;
use crate::comm::local::LocalComm;
use crate::comm::loopback::LoopbackComm;
use crate::comm::nccl::NcclComm;
use crate::engine::{CapturedStep, Engine, StepReplay};
use crate::error::Error;
use crate::plan::Plan;
// The gate and the engine's slot hold no state a panic can leave half-changed.
use crate::sync::lock as locked;
use crate::watch::AbortHandle;

/// The engines the C API can create.
pub(crate) enum AnyEngine {
    Cpu(Engine<CpuBackend, LocalComm>),
    CudaNccl(Engine<CudaBackend, NcclComm>),
    CudaLoopback(Engine<CudaBackend, LoopbackComm>),
}

/// Runs `$body` with `$e` bound to the engine inside any variant.
macro_rules! with_engine {
    ($any:expr, $e:ident => $body:expr) => {
        match $any {
            $crate::ffi::handles::AnyEngine::Cpu($e) => $body,
            $crate::ffi::handles::AnyEngine::CudaNccl($e) => $body,
            $crate::ffi::handles::AnyEngine::CudaLoopback($e) => $body,
        }
    };
}
pub(crate) use with_engine;

/// Where the tensors a caller hands an engine live: host memory on the CPU backend, device
/// memory on CUDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TensorMemory {
    Host,
    Device,
}

impl AnyEngine {
    fn tensor_memory(&self) -> TensorMemory {
        match self {
            AnyEngine::Cpu(_) => TensorMemory::Host,
            AnyEngine::CudaNccl(_) | AnyEngine::CudaLoopback(_) => TensorMemory::Device,
        }
    }
}

/// An engine and what other threads reach without its lock.
pub(crate) struct EngineEntry {
    /// Known without the engine's lock, so that a call converts its inputs before taking it.
    tensors: TensorMemory,
    /// Taken, and dropped, by `fsdp_engine_destroy` or by the last call it found running.
    engine: Mutex<Option<AnyEngine>>,
    /// The calls on the engine and its destruction, which decides who drops it.
    gate: Mutex<Gate>,
    abort: AbortHandle,
    /// Counters and memory as of the end of the engine's last call.
    report: Mutex<(fsdp_counters, MemoryUsage)>,
    /// The steps captured last, for their replays; they go with the engine.
    captures: Mutex<Captures>,
}

/// The calls that entered an engine and have not left, and whether it was destroyed: no call
/// enters after that, and the last one to leave, or the destroy that found none, drops it.
#[derive(Default)]
struct Gate {
    calls: usize,
    destroyed: bool,
}

/// A call in an engine: it leaves as this goes, on every path out.
struct Entered<'a>(&'a EngineEntry);

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        self.0.leave();
    }
}

impl EngineEntry {
    /// A call enters the engine until the guard goes; `FSDP_INVALID_HANDLE` once it was
    /// destroyed (a call that found the handle before).
    fn enter(&self) -> Outcome<Entered<'_>> {
        let mut gate = locked(&self.gate);
        if gate.destroyed {
            return Err(Failure::new(
                fsdp_status::FSDP_INVALID_HANDLE,
                "engine was destroyed as this call began".to_string(),
            ));
        }
        gate.calls += 1;
        Ok(Entered(self))
    }

    /// A call leaves the engine; the last one after its destruction drops it.
    fn leave(&self) {
        let last = {
            let mut gate = locked(&self.gate);
            gate.calls = gate.calls.saturating_sub(1);
            gate.destroyed && gate.calls == 0
        };
        if last {
            self.drop_engine();
        }
    }

    /// Marks the engine destroyed: dropped here where no call is in it; else the calls in it
    /// are aborted, so that they return, and the last drops it.
    fn destroy(&self) {
        let idle = {
            let mut gate = locked(&self.gate);
            gate.destroyed = true;
            gate.calls == 0
        };
        match idle {
            true => self.drop_engine(),
            false => self.abort.abort(),
        }
    }

    /// Drops the engine and the steps captured on it, by the thread that destroyed it or the
    /// last call in it, never later on a thread that only read its counters or aborted it. A
    /// capture still under way is given up first (a CUDA stream capture would otherwise stay
    /// open on the caller's compute stream, and the engine's memory could not be freed inside
    /// it); one begun on another thread stays, as the driver would refuse its end.
    fn drop_engine(&self) {
        let engine = locked(&self.engine).take();
        if let Some(mut engine) = engine {
            let _ = with_engine!(&mut engine, e => e.abandon_capture());
            drop(engine);
        }
        let captures = std::mem::take(&mut *locked(&self.captures));
        drop(captures);
    }
}

/// The steps an engine's handle keeps for their replays.
#[derive(Default)]
pub(crate) struct Captures {
    /// The step the caller captured last ([`Engine::leave_capture`]).
    pub(crate) by_caller: Option<StepReplay>,
    /// The step the engine captured last ([`Engine::end_capture`]).
    pub(crate) by_engine: Option<AnyCapturedStep>,
}

/// A step an engine captured itself, of either backend.
pub(crate) enum AnyCapturedStep {
    Cpu(CapturedStep<CpuGraph>),
    Cuda(CapturedStep<<CudaBackend as Backend>::Graph>),
}

/// What a live handle names.
pub(crate) type Entry = Object<Arc<Plan>, Comms, EngineEntry>;
type Handles = Registry<Arc<Plan>, Comms, EngineEntry>;

static HANDLES: LazyLock<Mutex<Handles>> = LazyLock::new(|| Mutex::new(Registry::new()));

pub(crate) fn handles() -> Outcome<std::sync::MutexGuard<'static, Handles>> {
    lock(&HANDLES)
}

pub(crate) fn object(handle: u64, what: &'static str) -> Outcome<Arc<Entry>> {
    if handle == 0 {
        return Err(null(what));
    }
    handles()?.get(handle)
}

pub(crate) fn wrong_kind(what: &'static str) -> Failure {
    Failure::new(
        fsdp_status::FSDP_INVALID_HANDLE,
        format!("{what} is a live handle of another kind"),
    )
}

pub(crate) fn plan_of(plan: *const fsdp_plan) -> Outcome<Arc<Plan>> {
    match &*object(plan as u64, "plan")? {
        Object::Plan(p) => Ok(Arc::clone(p)),
        _ => Err(wrong_kind("plan")),
    }
}

/// Stores an engine under a new handle and writes it to `out`, checked for NULL first.
pub(crate) fn store_engine(engine: AnyEngine, out: *mut *mut fsdp_engine) -> Outcome {
    let abort = with_engine!(&engine, e => e.abort_handle());
    let entry = EngineEntry {
        tensors: engine.tensor_memory(),
        report: Mutex::new(report(&engine)),
        engine: Mutex::new(Some(engine)),
        gate: Mutex::new(Gate::default()),
        abort,
        captures: Mutex::new(Captures::default()),
    };
    let handle = handles()?.insert(Object::Engine(entry))?;
    // SAFETY: the caller checked `out` and guarantees it is valid for a write.
    unsafe { put(out, "out", handle as *mut fsdp_engine) }
}

fn report(engine: &AnyEngine) -> (fsdp_counters, MemoryUsage) {
    with_engine!(engine, e => (e.counters().into(), e.memory()))
}

fn entry_of(object: &Entry) -> Outcome<&EngineEntry> {
    match object {
        Object::Engine(entry) => Ok(entry),
        _ => Err(wrong_kind("engine")),
    }
}

/// Runs `f` on the engine behind `engine`, holding its lock. A panic inside poisons the engine
/// and takes the rank out of its group, so its peers fail at once instead of waiting for it.
pub(crate) fn on_engine<T>(
    engine: *mut fsdp_engine,
    f: impl FnOnce(&mut AnyEngine) -> Outcome<T>,
) -> Outcome<T> {
    on_engine_with(engine, |_| Ok(()), |any, ()| f(any))
}

/// As [`on_engine`], with `prepare` run first, before the engine's lock, on where the tensors
/// a caller hands the engine live: a call converts its inputs there, and refuses bad ones
/// without waiting for a call in progress on another thread.
pub(crate) fn on_engine_with<P, T>(
    engine: *mut fsdp_engine,
    prepare: impl FnOnce(TensorMemory) -> Outcome<P>,
    f: impl FnOnce(&mut AnyEngine, P) -> Outcome<T>,
) -> Outcome<T> {
    let object = object(engine as u64, "engine")?;
    let entry = entry_of(&object)?;
    let prepared = prepare(entry.tensors)?;
    let _entered = entry.enter()?;
    run_on(entry, |any| f(any, prepared))
}

/// Runs `f` on `entry`'s engine under its lock, for a call that entered it.
fn run_on<T>(entry: &EngineEntry, f: impl FnOnce(&mut AnyEngine) -> Outcome<T>) -> Outcome<T> {
    let mut held = lock(&entry.engine)?;
    let Some(any) = held.as_mut() else {
        return Err(Failure::new(
            fsdp_status::FSDP_INVALID_HANDLE,
            "engine was destroyed as this call began".to_string(),
        ));
    };
    let outcome = catch_unwind(AssertUnwindSafe(|| f(&mut *any)));
    let outcome = outcome.unwrap_or_else(|payload| {
        let message = format!("panic inside fsdp-fusion: {}", panic_message(&*payload));
        let cause = Error::Panicked {
            message: message.clone(),
        };
        with_engine!(&mut *any, e => e.poison(cause));
        entry.abort.leave();
        Err(Failure::new(
            fsdp_status::FSDP_PANIC,
            format!("{message}; the engine is poisoned and has left its group"),
        ))
    });
    *lock(&entry.report)? = report(any);
    outcome
}

/// As [`on_engine`], with the steps captured last on `engine`, kept with its handle: a
/// poisoned engine says so before `f` looks for a step.
pub(crate) fn on_engine_captures<T>(
    engine: *mut fsdp_engine,
    f: impl FnOnce(&mut AnyEngine, &mut Captures) -> Outcome<T>,
) -> Outcome<T> {
    let object = object(engine as u64, "engine")?;
    let entry = entry_of(&object)?;
    // Taken inside the engine's lock, so that the call's leave, which may drop the engine and
    // its steps, finds it free.
    on_engine(engine, |any| {
        with_engine!(&*any, e => e.healthy())?;
        f(any, &mut *lock(&entry.captures)?)
    })
}

/// The counters and memory of `engine` as of the end of its last call; never waits for a call
/// in progress.
pub(crate) fn engine_report(engine: *mut fsdp_engine) -> Outcome<(fsdp_counters, MemoryUsage)> {
    let object = object(engine as u64, "engine")?;
    let report = *lock(&entry_of(&object)?.report)?;
    Ok(report)
}

/// Aborts `engine` without waiting for its lock.
pub(crate) fn abort_engine(engine: *mut fsdp_engine) -> Outcome {
    let object = object(engine as u64, "engine")?;
    entry_of(&object)?.abort.abort();
    Ok(())
}

pub(crate) fn destroy(
    handle: u64,
    kind_ok: impl Fn(&Entry) -> bool,
    what: &'static str,
) -> Outcome {
    if handle == 0 {
        return Ok(());
    }
    let removed = {
        let mut handles = handles()?;
        if !kind_ok(&*handles.get(handle)?) {
            return Err(wrong_kind(what));
        }
        handles.remove(handle)?
    };
    // After the registry is unlocked: an engine's drop waits for its queued work, whose
    // collectives need the other ranks, whose calls need the registry. No call enters the
    // engine after this; calls in it (blocked in a collective, say) are aborted, so that they
    // return and the last drops it; an idle engine finishes its queued work as it drops, here.
    match &*removed {
        Object::Engine(entry) => entry.destroy(),
        // A rank inside its creation holds the group until it returns: its peers that no
        // engine took go now, so that it fails at once instead of at its deadline.
        Object::Group(comms) => comms.release(),
        _ => {}
    }
    drop(removed);
    Ok(())
}
