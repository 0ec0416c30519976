//! A whole step captured on the engine's streams once and replayed step after step
//! ([`Backend::begin_capture`]): the hooks' host work runs once, at the capture, and a replay
//! queues the step's device work with no hook, no decision and no allocation.
//!
//! What a captured step cannot bake in lives on the device: the optimizer's [`StepValues`] are
//! written before each replay, from the engine's step count and learning rate then. The host's
//! state follows each replay as the captured step moved it (the step count, the counters), so a
//! save, a load, `set_lr` or an eager step between replays work as between eager steps.
//!
//! [`StepValues`]: crate::optim::StepValues

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Counters, Engine};
use crate::backend::Backend;
use crate::comm::{Communicator, Fingerprint};
use crate::config::GradShardMemory;
use crate::error::{Error, Result};
use crate::types::Stream;

/// Each engine's identity, so that a step captured by one is never replayed on another's buffers.
static ENGINES: AtomicU64 = AtomicU64::new(0);

pub(super) fn next_engine_id() -> u64 {
    ENGINES.fetch_add(1, Ordering::Relaxed)
}

/// Each captured step's identity, so that `replayed` names the step `before_replay` did.
static STEPS: AtomicU64 = AtomicU64::new(0);

/// A step captured by [`Engine::end_capture`], for [`Engine::replay`] on the same engine.
pub struct CapturedStep<G> {
    graph: G,
    replay: StepReplay,
}

impl<G> std::fmt::Debug for CapturedStep<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CapturedStep")
            .field("replay", &self.replay)
            .finish_non_exhaustive()
    }
}

/// What each replay of a captured step does to the engine that captured it: the host's counts
/// it moves and the collectives it holds to the deadline. [`Engine::leave_capture`] gives it
/// for a step the caller captured, for [`Engine::before_replay`] and [`Engine::replayed`].
pub struct StepReplay {
    engine: u64,
    id: u64,
    /// What the step did to the host's counts: each replay adds it.
    moved: HostCounts,
    /// The step's collectives, each with this rank's place among its ranks and their number:
    /// each replay holds them to the engine's deadline.
    collectives: Vec<(Fingerprint, (usize, usize))>,
}

impl std::fmt::Debug for StepReplay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepReplay")
            .field("engine", &self.engine)
            .field("moved", &self.moved)
            .finish_non_exhaustive()
    }
}

/// The host's counts that a step moves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct HostCounts {
    counters: Counters,
    optimizer_steps: u64,
    /// Skip decisions queued on the device ([`Engine::skip_nonfinite_on_device`]).
    device_decisions: u64,
}

impl HostCounts {
    /// What moved from `earlier` to `self`; every count only grows.
    fn since(&self, earlier: &HostCounts) -> HostCounts {
        let (now, then) = (&self.counters, &earlier.counters);
        let moved = |now: u64, then: u64| now.saturating_sub(then);
        HostCounts {
            counters: Counters {
                all_gathers: moved(now.all_gathers, then.all_gathers),
                prefetches: moved(now.prefetches, then.prefetches),
                reuses: moved(now.reuses, then.reuses),
                evictions: moved(now.evictions, then.evictions),
                reduce_scatters: moved(now.reduce_scatters, then.reduce_scatters),
                extra_slots: moved(now.extra_slots, then.extra_slots),
                host_waits: 0,
                steps: moved(now.steps, then.steps),
                skipped_steps: moved(now.skipped_steps, then.skipped_steps),
            },
            optimizer_steps: moved(self.optimizer_steps, earlier.optimizer_steps),
            device_decisions: moved(self.device_decisions, earlier.device_decisions),
        }
    }

    /// `self` moved on by `moved`.
    fn plus(&self, moved: &HostCounts) -> HostCounts {
        let (now, by) = (&self.counters, &moved.counters);
        HostCounts {
            counters: Counters {
                all_gathers: now.all_gathers.saturating_add(by.all_gathers),
                prefetches: now.prefetches.saturating_add(by.prefetches),
                reuses: now.reuses.saturating_add(by.reuses),
                evictions: now.evictions.saturating_add(by.evictions),
                reduce_scatters: now.reduce_scatters.saturating_add(by.reduce_scatters),
                extra_slots: now.extra_slots.saturating_add(by.extra_slots),
                host_waits: now.host_waits,
                steps: now.steps.saturating_add(by.steps),
                skipped_steps: now.skipped_steps.saturating_add(by.skipped_steps),
            },
            optimizer_steps: self.optimizer_steps.saturating_add(moved.optimizer_steps),
            device_decisions: (self.device_decisions).saturating_add(moved.device_decisions),
        }
    }
}

/// A capture under way: who began it, on which thread, the host's counts when it began, which
/// its end restores (nothing ran), and the collectives it holds.
pub(super) struct Capturing {
    by: CaptureBy,
    thread: std::thread::ThreadId,
    began: HostCounts,
    collectives: Vec<(Fingerprint, (usize, usize))>,
}

/// Who captures the compute stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum CaptureBy {
    /// The engine's backend ([`Engine::begin_capture`]).
    Engine,
    /// The caller, whose capture the step's first work joins ([`Engine::join_capture`]).
    CallerNotJoined,
    /// The caller, joined.
    Caller,
}

impl Capturing {
    /// Keeps `collective` (this rank's place and the ranks' number) for the replays' deadlines.
    pub(super) fn hold(&mut self, collective: Fingerprint, peers: (usize, usize)) -> Result<()> {
        self.collectives
            .try_reserve(1)
            .map_err(|_| Error::OutOfMemory {
                bytes: std::mem::size_of::<(Fingerprint, (usize, usize))>(),
                what: "a capture's collectives".into(),
            })?;
        self.collectives.push((collective, peers));
        Ok(())
    }
}

fn refused(what: &str) -> Error {
    Error::Capture { what: what.into() }
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Begins capturing a step on the compute stream, between steps, right after a training
    /// step (one that entered a backward pass, or replays since it): that step is the warm-up,
    /// whose recorded units' order the captured step's prefetches follow and whose gather slots
    /// it reuses (an empty or forward-only step is none). The step's hooks, `finish_grad_sync`,
    /// `optimizer_step` and `end_step` then queue work that runs only at [`Engine::replay`]. End it with [`Engine::end_capture`] (or give
    /// it up with [`Engine::abandon_capture`]) on the thread that began it: both refuse on
    /// another, with nothing changed, as a CUDA stream capture in thread-local mode ends on its
    /// own thread (an engine poisoned on another thread leaves it to that one too).
    ///
    /// Refused, with nothing changed, where a step would do what a capture cannot hold: per-step
    /// gradient shards (allocated and freed), [`crate::EngineConfig::verify_collectives`] and a
    /// trace (host reads of the device), collectives whose ranks meet on the host (the loopback
    /// communicator); and by a backend that cannot capture (`Error::Unsupported`). During the
    /// capture the gradient norm on the host (clip with [`Engine::clip_grad_norm_on_device`]),
    /// the non-finite count, host gradients, and everything allowed only between steps (a save,
    /// a load, a read of the state) are `Error::Capture`.
    pub fn begin_capture(&mut self) -> Result<()> {
        let began = self.check_step_capturable()?;
        // A backend that cannot capture refuses here, with nothing but the fence's order
        // changed.
        self.backend.begin_capture(Stream::Compute)?;
        self.capture = Some(Capturing {
            by: CaptureBy::Engine,
            thread: std::thread::current().id(),
            began,
            collectives: Vec::new(),
        });
        self.effects(Engine::fork_into_capture)
    }

    /// As [`Engine::begin_capture`], for a capture the caller makes itself on the engine's
    /// compute stream (its own stream capture, or a framework's, such as `torch.cuda.graph`
    /// given that stream), in thread-local or relaxed mode: in global mode the engine's
    /// watchdog, which queries events from a thread of its own, would fail it. Called between
    /// steps, before the caller begins its capture. The step's first call that queues work
    /// joins the capture (`Error::Capture`, with nothing changed, where no capture of the
    /// compute stream is under way then); after the step's
    /// `end_step`, [`Engine::leave_capture`] comes before the caller ends its capture. Refused
    /// as [`Engine::begin_capture`] is.
    pub fn join_capture(&mut self) -> Result<()> {
        let began = self.check_step_capturable()?;
        self.capture = Some(Capturing {
            by: CaptureBy::CallerNotJoined,
            thread: std::thread::current().id(),
            began,
            collectives: Vec::new(),
        });
        Ok(())
    }

    /// Joins the caller's capture that [`Engine::join_capture`] awaits, if it does, before a
    /// call's first work: a refusal changes nothing.
    pub(super) fn join_callers_capture(&mut self) -> Result<()> {
        match &self.capture {
            Some(c) if c.by == CaptureBy::CallerNotJoined => {}
            _ => return Ok(()),
        }
        self.backend.join_capture(Stream::Compute)?;
        if let Some(c) = self.capture.as_mut() {
            c.by = CaptureBy::Caller;
        }
        let forked = self.fork_into_capture();
        self.observe(forked)
    }

    /// What every capture refuses (see [`Engine::begin_capture`]), then the fence that orders
    /// everything queued so far before the capture's first work on any stream, so that no
    /// captured wait needs an event from before it: the host's counts now.
    fn check_step_capturable(&mut self) -> Result<HostCounts> {
        self.healthy()?;
        if self.capture.is_some() {
            return Err(refused("a capture inside another"));
        }
        self.check_step_boundary("a capture")?;
        if !self.gathering.schedule.last_step_trained() {
            return Err(refused(
                "a step that does not follow a training step (the warm-up, whose recorded units' \
                 order the captured step's prefetches follow, and whose gather slots it reuses): \
                 the last step ended was empty or forward-only",
            ));
        }
        if self.config.grad_shard_memory == GradShardMemory::PerStep {
            return Err(refused(
                "per-step gradient shards (GradShardMemory::PerStep), which a step allocates \
                 and frees",
            ));
        }
        if self.config.verify_collectives {
            return Err(refused(
                "verify_collectives, whose comparison of the ranks' collectives waits on the host",
            ));
        }
        if self.trace.is_some() {
            return Err(refused(
                "a trace, whose timings are host reads of the device",
            ));
        }
        let host_meetings = std::iter::once(&self.comm).chain(&self.process_groups);
        if host_meetings.into_iter().any(|c| c.meets_on_the_host()) {
            return Err(refused(
                "collectives whose ranks meet on the host (the loopback communicator)",
            ));
        }
        let began = self.host_counts();
        self.effects(Engine::fence)?;
        Ok(began)
    }

    /// The other streams join the capture of the compute stream.
    fn fork_into_capture(&mut self) -> Result<()> {
        let fork = self.backend.record(Stream::Compute)?;
        self.backend.wait(Stream::Gather, &fork)?;
        self.backend.wait(Stream::Reduce, &fork)
    }

    /// Ends the capture after the captured step's [`Engine::end_step`]: the step, for
    /// [`Engine::replay`]. Nothing of it ran, so the engine is where it was when the capture
    /// began (its step count, counters, shards). `Error::MidStep` before the step's end, with
    /// the capture still under way.
    pub fn end_capture(&mut self) -> Result<CapturedStep<B::Graph>> {
        self.end_any_capture(CaptureBy::Engine, |backend| backend.end_capture())
            .map(|(graph, replay)| CapturedStep { graph, replay })
    }

    /// Ends the engine's part of the caller's capture ([`Engine::join_capture`]) after the
    /// captured step's [`Engine::end_step`], before the caller ends its capture: the other
    /// streams join back into the compute stream, and the engine is where it was when the
    /// capture began. What each replay does, for [`Engine::before_replay`] and
    /// [`Engine::replayed`]. `Error::MidStep` before the step's end, with the capture still
    /// under way. `Error::Capture` where no step joined the caller's capture, which the engine
    /// then awaits no longer, with nothing else changed; and where that capture failed, which
    /// poisons the engine (its streams' work since the capture began is not known).
    pub fn leave_capture(&mut self) -> Result<StepReplay> {
        if let Some(c) = &self.capture
            && c.by == CaptureBy::CallerNotJoined
        {
            self.capture = None;
            return Err(refused(
                "a leave of a capture that no step joined (the engine awaits it no longer)",
            ));
        }
        self.end_any_capture(CaptureBy::Caller, |backend| backend.leave_capture())
            .map(|((), replay)| replay)
    }

    /// Gives up a capture that will not be replayed, of either kind, at any point: for a
    /// failure inside the captured step. Where no step joined the caller's capture yet, the
    /// engine stops awaiting it, with nothing else changed; between steps the capture ends as
    /// [`Engine::end_capture`] or [`Engine::leave_capture`] ends it, its step dropped. Mid-step
    /// the other streams join back into the compute stream (so that the caller can end its
    /// capture), the engine ends its own capture or leaves the caller's, and is then poisoned
    /// (its host state is a step's that never ran), its communicators left as they are, as no
    /// collective of the step ran. No capture under way: nothing happens.
    pub fn abandon_capture(&mut self) -> Result<()> {
        self.check_capture_thread()?;
        let Some(by) = self.capture.as_ref().map(|c| c.by) else {
            return Ok(());
        };
        if by == CaptureBy::CallerNotJoined {
            self.capture = None;
            return Ok(());
        }
        if self.at_step_boundary() && self.poisoned.get().is_none() {
            return match by {
                CaptureBy::Engine => self.end_capture().map(drop),
                _ => self.leave_capture().map(drop),
            };
        }
        // Best effort: the engine is poisoned whatever fails here.
        self.drop_backend_capture();
        self.capture = None;
        let cause = refused("a step abandoned during its capture, which never ran");
        // Poisoned without the communicators' abort: no collective of the step ran, so none
        // waits for a peer, and an abort inside the caller's capture (still under way) would
        // fail it.
        let _ = self.poisoned.set(cause.clone());
        Err(Error::Poisoned {
            cause: Box::new(cause),
        })
    }

    /// Ends the backend's part of the capture under way, best effort, for a capture given up:
    /// the other streams join back into the compute stream (so that a caller's capture can
    /// end), then the engine's own capture ends or the caller's is left (the caller ends it).
    /// The engine's own capture is left to the thread that began it (a poisoning on another
    /// thread: the driver would refuse its end there, and the backend forget it), which ends
    /// it at its `abandon_capture` or the engine's drop.
    pub(super) fn drop_backend_capture(&self) {
        let Some(by) = self.capture.as_ref().map(|c| c.by) else {
            return;
        };
        if by == CaptureBy::CallerNotJoined || self.own_capture_elsewhere() {
            return;
        }
        let _ = self.join_streams_on_compute();
        let _ = match by {
            CaptureBy::Engine => self.backend.end_capture().map(drop),
            _ => self.backend.leave_capture(),
        };
    }

    /// Refuses, with nothing changed, to end or give up the engine's own capture on another
    /// thread than the one that began it: a CUDA stream capture in thread-local mode ends on its
    /// own thread, and the driver's refusal there would leave the stream capturing.
    fn check_capture_thread(&self) -> Result<()> {
        match self.own_capture_elsewhere() {
            true => Err(refused(
                "an end of the engine's capture on another thread than the one that began it",
            )),
            false => Ok(()),
        }
    }

    /// Whether the engine's own capture is under way and began on another thread than this.
    fn own_capture_elsewhere(&self) -> bool {
        self.capture
            .as_ref()
            .is_some_and(|c| c.by == CaptureBy::Engine && c.thread != std::thread::current().id())
    }

    /// Ends the capture that `by` began, by `end` on the backend, once the captured step ended.
    fn end_any_capture<T>(
        &mut self,
        by: CaptureBy,
        end: impl FnOnce(&B) -> Result<T>,
    ) -> Result<(T, StepReplay)> {
        self.healthy()?;
        self.check_capture_thread()?;
        let Some(capturing) = self.capture.as_ref() else {
            return Err(refused("an end with no capture under way"));
        };
        if capturing.by != by {
            return Err(refused(match by {
                CaptureBy::Engine => "end_capture of the caller's capture (leave_capture)",
                _ => "leave_capture of the engine's own capture (end_capture)",
            }));
        }
        let began = capturing.began;
        if !self.at_step_boundary() {
            return Err(Error::MidStep {
                action: "the end of a capture",
            });
        }
        let moved = self.host_counts().since(&began);
        let ended = self.effects(|e| {
            // The other streams join back into the compute stream.
            e.join_streams_on_compute()?;
            let collectives = e.capture.take().map(|c| c.collectives).unwrap_or_default();
            let ended = end(&e.backend)?;
            // The events kept in the capture were never recorded. After the engine's own
            // capture a fence orders everything again; the caller's capture is still under way,
            // where new waits would join it again, and the fence at `join_capture` already
            // ordered every stream after all work before the capture.
            match by {
                CaptureBy::Engine => e.fence()?,
                _ => e.forget_events(),
            }
            Ok((ended, collectives))
        });
        // Nothing of the step ran, whether its capture holds it or failed.
        self.set_host_counts(began);
        let (ended, collectives) = ended?;
        Ok((
            ended,
            StepReplay {
                engine: self.id,
                id: STEPS.fetch_add(1, Ordering::Relaxed),
                moved,
                collectives,
            },
        ))
    }

    /// Replays `step`, captured by this engine, between steps: writes the step's values (the
    /// engine's step count and learning rate now), queues the captured work on the compute
    /// stream, and moves the engine's step count and counters on as the captured step did.
    /// The host does not wait: a read of the results (a download, a save) waits as after an
    /// eager step.
    pub fn replay(&mut self, step: &CapturedStep<B::Graph>) -> Result<()> {
        self.before_replay(&step.replay)?;
        // SAFETY: this engine captured the graph (`before_replay` checked the step is its);
        // every buffer its work uses is the engine's, alive as long as the engine (none is made
        // or freed in a capture), or a caller's device input, valid while a captured step
        // holding it may be replayed (`Input::device`); `before_replay`'s fence ordered every
        // stream's earlier work before it, and `replayed`'s orders every later work after it.
        let launched = unsafe { self.backend.replay(&step.graph) };
        match self.observe(launched) {
            Ok(()) => self.replayed(&step.replay),
            Err(e) => {
                self.replay_pending = None;
                Err(e)
            }
        }
    }

    /// Before the caller's replay of a step it captured ([`Engine::leave_capture`]), between
    /// steps: orders every stream's work so far before the replay and writes the step's values
    /// (the engine's step count and learning rate now) on the compute stream. The caller then
    /// launches its graph on the compute stream, and calls [`Engine::replayed`]: between them a
    /// step's call, a capture, a save, a load and a read of the state are `Error::Capture`.
    pub fn before_replay(&mut self, step: &StepReplay) -> Result<()> {
        self.check_replay_of_own(step)?;
        if self.replay_pending.is_some() {
            return Err(refused(
                "before_replay twice (replayed comes after the caller's replay)",
            ));
        }
        self.check_step_boundary("a replay")?;
        let optimizer_steps = self.optimizer.steps;
        self.effects(|e| {
            // The captured work's streams are ordered after the compute stream only: everything
            // queued before on the others comes first.
            e.fence()?;
            if step.moved.optimizer_steps > 0 {
                e.optimizer.steps = optimizer_steps.saturating_add(1);
                let written = e.write_step_values(1.0);
                e.optimizer.steps = optimizer_steps;
                written?;
            }
            Ok(())
        })?;
        self.replay_pending = Some(step.id);
        Ok(())
    }

    /// After the caller launched its replay of `step` on the compute stream
    /// ([`Engine::before_replay`]): holds the step's collectives to the deadline, orders every
    /// stream's later work after the replay, and moves the engine's step count and counters on
    /// as the captured step did. The host does not wait. Refused, with nothing changed, without
    /// [`Engine::before_replay`] of the same `step` first.
    pub fn replayed(&mut self, step: &StepReplay) -> Result<()> {
        self.check_replay_of_own(step)?;
        match self.replay_pending {
            None => return Err(refused("replayed without before_replay")),
            Some(id) if id != step.id => {
                return Err(refused(
                    "replayed of another step than before_replay's (which wrote that step's \
                     values)",
                ));
            }
            Some(_) => {}
        }
        let counts = self.host_counts();
        self.effects(|e| {
            let done = Arc::new(e.backend.record(Stream::Compute)?);
            for &(collective, peers) in &step.collectives {
                e.deadlines.track(collective, peers, Arc::clone(&done));
            }
            e.fence()
        })?;
        self.replay_pending = None;
        self.set_host_counts(counts.plus(&step.moved));
        Ok(())
    }

    /// A healthy engine, replaying a step it captured.
    fn check_replay_of_own(&self, step: &StepReplay) -> Result<()> {
        self.healthy()?;
        if step.engine != self.id {
            return Err(refused("a replay of a step another engine captured"));
        }
        Ok(())
    }

    /// Whether a capture is under way.
    pub fn capturing(&self) -> bool {
        self.capture.is_some()
    }

    /// `Error::Capture` once the captured step ended: a capture holds one step, whose replays
    /// write one step's values.
    pub(super) fn check_captured_step_open(&self) -> Result<()> {
        if self.replay_pending.is_some() {
            return Err(refused(
                "a step between before_replay and replayed (the caller's replay goes there)",
            ));
        }
        match &self.capture {
            Some(c) if self.counters.steps != c.began.counters.steps => Err(refused(
                "a second step in one capture (end_capture after the step's end_step: a capture \
                 holds one step)",
            )),
            _ => Ok(()),
        }
    }

    /// `Error::Capture` naming `action` while a capture is under way, or a caller's replay is
    /// due ([`Engine::before_replay`]).
    pub(super) fn check_not_capturing(&self, action: &str) -> Result<()> {
        if self.replay_pending.is_some() {
            return Err(refused(&format!(
                "{action}, between before_replay and replayed (the caller's replay goes there)"
            )));
        }
        match self.capture {
            Some(_) => Err(refused(&format!("{action}, during a capture"))),
            None => Ok(()),
        }
    }

    fn host_counts(&self) -> HostCounts {
        HostCounts {
            counters: self.counters,
            optimizer_steps: self.optimizer.steps,
            device_decisions: self.optimizer.device_decisions,
        }
    }

    fn set_host_counts(&mut self, counts: HostCounts) {
        self.counters = counts.counters;
        self.optimizer.steps = counts.optimizer_steps;
        self.optimizer.device_decisions = counts.device_decisions;
    }

    /// Orders every stream's later work after every stream's work so far, and forgets the
    /// events kept between steps (the last update of the shards, the slots' last uses): the
    /// order they gave is now everyone's.
    fn fence(&mut self) -> Result<()> {
        self.join_streams_on_compute()?;
        let all = self.backend.record(Stream::Compute)?;
        for other in [Stream::Gather, Stream::Reduce] {
            self.backend.wait(other, &all)?;
        }
        self.forget_events();
        Ok(())
    }

    /// Forgets the events kept between steps.
    fn forget_events(&mut self) {
        self.gathering.forget_events();
        for slot in &mut self.reducing.slots {
            slot.reduced = None;
        }
    }
}
