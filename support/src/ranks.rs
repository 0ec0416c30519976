//! Ranks as threads: the modes CPU ranks run in (eager, or asynchronous over seeds), one thread
//! per rank, and a deadline on every multi-rank run, so that a hang fails a test instead of
//! stalling it.

use std::fmt::Debug;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use fsdp_fusion::comm::process_group_comms;
use fsdp_fusion::{CpuBackend, Engine, EngineConfig, LocalComm, Plan, Result};

/// How long a multi-rank run may take before the test fails instead of hanging.
pub const DEADLINE: Duration = Duration::from_secs(300);

/// Asynchronous seeds run by default; `FSDP_ASYNC_SEEDS=N` runs seeds `0..N` instead, and
/// `FSDP_ASYNC_SEED=S` only seed `S` (to reproduce a failure).
const DEFAULT_SEEDS: u64 = 3;

/// Asynchronous seeds the long suites (whole training loops over every world size and setting,
/// [`for_each_case_and_mode_of_a_long_suite`]) run by default: they find ordering bugs at many
/// times the cost per seed of the short suites, which run [`DEFAULT_SEEDS`].
/// `FSDP_ASYNC_SEEDS_LONG=N` runs seeds `0..N` instead; `FSDP_ASYNC_SEED=S` only seed `S`.
const DEFAULT_LONG_SEEDS: u64 = 1;

/// How many of a long suite's runs go side by side: enough to keep two cores busy while their
/// streams sleep, few enough that a run's delays stay near the ones drawn.
const LONG_SUITE_RUNS_AT_ONCE: usize = 16;

/// How a test's CPU ranks run their streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Eager,
    /// Asynchronous streams; rank `r` draws its delays from `seed * 1000 + r`.
    Async(u64),
}

impl Mode {
    /// Rank `rank`'s backend in this mode.
    pub fn backend(self, rank: usize) -> CpuBackend {
        match self {
            Mode::Eager => CpuBackend::new(),
            Mode::Async(seed) => CpuBackend::asynchronous(seed * 1000 + rank as u64)
                .unwrap_or_else(|e| panic!("an asynchronous backend: {e}")),
        }
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .parse()
            .unwrap_or_else(|_| panic!("{name}={value:?} is not a number")),
    )
}

/// The asynchronous seeds to run: `0..count`, `count` read from `variable` (else `default`), or
/// only `FSDP_ASYNC_SEED`'s.
fn seeds(variable: &str, default: u64) -> Vec<u64> {
    if let Some(seed) = env_u64("FSDP_ASYNC_SEED") {
        return vec![seed];
    }
    (0..env_u64(variable).unwrap_or(default)).collect()
}

/// Eager, then asynchronous over each of `seeds`.
fn modes_over(seeds: Vec<u64>) -> Vec<Mode> {
    std::iter::once(Mode::Eager)
        .chain(seeds.into_iter().map(Mode::Async))
        .collect()
}

/// Eager, then asynchronous over every seed.
pub fn modes() -> Vec<Mode> {
    modes_over(seeds("FSDP_ASYNC_SEEDS", DEFAULT_SEEDS))
}

/// Eager, then asynchronous over every seed of a long suite.
pub fn long_suite_modes() -> Vec<Mode> {
    modes_over(seeds("FSDP_ASYNC_SEEDS_LONG", DEFAULT_LONG_SEEDS))
}

/// Runs `body` in every mode, modes side by side (one thread each): each mode's run has its own
/// ranks, backends and files. As many at a time as the machine has cores, and at least four,
/// since the asynchronous backends' streams mostly sleep; no more, so that the short suites'
/// deadlines of a few hundred milliseconds stay met with several tests at a time. Returns each
/// mode's result in the order of [`modes`]; every failing mode is named (with the variable that
/// reproduces it) before the first one's panic goes on.
pub fn for_each_mode<R: Send>(body: impl Fn(Mode) -> R + Sync) -> Vec<R> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let runs = modes().into_iter().map(|mode| ((), mode)).collect();
    run_side_by_side(runs, cores.max(4), |&(), mode| body(mode))
}

/// As [`for_each_mode`], for a long suite (whole training loops, no tight deadline) of
/// independent cases: `body(case, mode)` for every case in every mode of
/// [`long_suite_modes`], up to 16 runs side by side. Returns each case's
/// results in the order of the modes, the cases in their order.
pub fn for_each_case_and_mode_of_a_long_suite<C: Debug + Sync, R: Send>(
    cases: &[C],
    body: impl Fn(&C, Mode) -> R + Sync,
) -> Vec<Vec<R>> {
    let modes = long_suite_modes();
    let runs = cases
        .iter()
        .flat_map(|case| modes.iter().map(move |&mode| (case, mode)))
        .collect();
    let mut results =
        run_side_by_side(runs, LONG_SUITE_RUNS_AT_ONCE, |case, mode| body(case, mode)).into_iter();
    cases
        .iter()
        .map(|_| results.by_ref().take(modes.len()).collect())
        .collect()
}

/// As [`for_each_case_and_mode_of_a_long_suite`], for a suite of one case.
pub fn for_each_mode_of_a_long_suite<R: Send>(body: impl Fn(Mode) -> R + Sync) -> Vec<R> {
    for_each_case_and_mode_of_a_long_suite(&[()], |&(), mode| body(mode))
        .into_iter()
        .flatten()
        .collect()
}

/// Runs `body` on each (case, mode) of `runs`, at most `side_by_side` at a time.
fn run_side_by_side<C: Debug + Sync, R: Send>(
    runs: Vec<(C, Mode)>,
    side_by_side: usize,
    body: impl Fn(&C, Mode) -> R + Sync,
) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let outcomes: Vec<Mutex<Option<std::thread::Result<R>>>> =
        runs.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..side_by_side.clamp(1, runs.len().max(1)) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let (Some((case, mode)), Some(slot)) = (runs.get(i), outcomes.get(i)) else {
                        break;
                    };
                    let outcome = catch_unwind(AssertUnwindSafe(|| body(case, *mode)));
                    *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(outcome);
                }
            });
        }
    });
    let mut results = Vec::with_capacity(runs.len());
    let mut first_panic = None;
    for ((case, mode), outcome) in runs.into_iter().zip(outcomes) {
        match outcome.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(Ok(r)) => results.push(r),
            Some(Err(panic)) => {
                name_the_failing(&case, mode);
                first_panic.get_or_insert(panic);
            }
            None => unreachable!("every run is taken by a thread"),
        }
    }
    if let Some(panic) = first_panic {
        resume_unwind(panic);
    }
    results
}

fn name_the_failing(case: &dyn Debug, mode: Mode) {
    let case = format!("{case:?}");
    let case = if case == "()" {
        String::new()
    } else {
        format!("{case}: ")
    };
    match mode {
        Mode::Eager => eprintln!("{case}failed on the eager CPU backend"),
        Mode::Async(seed) => eprintln!(
            "{case}failed on the asynchronous CPU backend, seed {seed} (FSDP_ASYNC_SEED={seed} runs only it)"
        ),
    }
}

/// Runs `f` on its own thread and waits for it at most [`DEADLINE`]; a panic in `f` goes on in
/// the caller, and a run past the deadline fails instead of hanging.
pub fn within_deadline<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = mpsc::channel();
    let worker = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(DEADLINE) {
        Ok(r) => {
            let _ = worker.join();
            r
        }
        Err(mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
            Err(panic) => resume_unwind(panic),
            Ok(()) => unreachable!("the worker sends before it ends"),
        },
        Err(mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what} did not finish within {DEADLINE:?}")
        }
    }
}

/// Runs `f(index, item)` for every item, one thread each, and returns the results in order; a
/// thread's panic goes on in the caller as it was.
pub fn on_threads<T: Send, R: Send>(items: Vec<T>, f: impl Fn(usize, T) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = items
            .into_iter()
            .enumerate()
            .map(|(i, item)| s.spawn(move || f(i, item)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| resume_unwind(p)))
            .collect()
    })
}

/// Runs `f(rank, backend, comm)` on every rank of a `world`-rank group, one thread each, under
/// [`DEADLINE`]; returns the results in rank order. A rank's panic goes on in the caller.
pub fn on_ranks<R: Send + 'static>(
    world: usize,
    mode: Mode,
    f: impl Fn(usize, CpuBackend, LocalComm) -> R + Send + Sync + 'static,
) -> Vec<R> {
    within_deadline(&format!("{world} ranks ({mode:?})"), move || {
        let comms = LocalComm::group(world).unwrap_or_else(|e| panic!("a local group: {e}"));
        on_threads(comms, |rank, comm| f(rank, mode.backend(rank), comm))
    })
}

pub type CpuEngine = Engine<CpuBackend, LocalComm>;

/// Every rank of `plan`'s world size in `mode`, in rank order: its backend, its local
/// communicator, and its communicators of the plan's process groups.
pub fn local_ranks(
    plan: &Plan,
    mode: Mode,
) -> Result<Vec<(CpuBackend, LocalComm, Vec<LocalComm>)>> {
    let world = plan.world_size();
    let mut groups: Vec<std::vec::IntoIter<LocalComm>> = plan
        .process_groups()
        .iter()
        .map(|g| process_group_comms(world, g.size, LocalComm::group).map(Vec::into_iter))
        .collect::<Result<_>>()?;
    LocalComm::group(world)?
        .into_iter()
        .enumerate()
        .map(|(rank, comm)| {
            let own = groups.iter_mut().filter_map(Iterator::next).collect();
            Ok((mode.backend(rank), comm, own))
        })
        .collect()
}

/// Runs `f` on an engine of every rank of `plan`'s world size (in its process groups), one
/// thread each, under [`DEADLINE`]; returns the results in rank order.
pub fn on_engines<R: Send + 'static>(
    plan: &Arc<Plan>,
    config: &EngineConfig,
    mode: Mode,
    f: impl Fn(CpuEngine) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let (plan, config) = (Arc::clone(plan), config.clone());
    let what = format!("{} ranks ({mode:?})", plan.world_size());
    within_deadline(&what, move || {
        let ranks = local_ranks(&plan, mode).unwrap_or_else(|e| panic!("local ranks: {e}"));
        on_threads(ranks, |_, (backend, comm, groups)| {
            let engine = Engine::with_process_groups(
                Arc::clone(&plan),
                config.clone(),
                backend,
                comm,
                groups,
            )
            .unwrap_or_else(|e| panic!("an engine: {e}"));
            f(engine)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_return_in_order_a_long_suite_s_runs_side_by_side_and_a_panic_goes_on() {
        assert_eq!(for_each_mode(|mode| mode), modes());
        assert_eq!(
            for_each_mode_of_a_long_suite(|mode| mode),
            long_suite_modes()
        );
        // Every run waits (for a while) until as many as go at once have started.
        let cases = [10, 20, 30];
        let at_once = (cases.len() * long_suite_modes().len()).min(LONG_SUITE_RUNS_AT_ONCE);
        let started = AtomicUsize::new(0);
        let seen = for_each_case_and_mode_of_a_long_suite(&cases, |&case, mode| {
            started.fetch_add(1, Ordering::SeqCst);
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while started.load(Ordering::SeqCst) < at_once && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            (case, mode, started.load(Ordering::SeqCst) >= at_once)
        });
        let want: Vec<Vec<_>> = cases
            .iter()
            .map(|&case| {
                let modes = long_suite_modes().into_iter();
                modes.map(|mode| (case, mode, true)).collect()
            })
            .collect();
        assert_eq!(seen, want);
        let panicked = catch_unwind(|| for_each_mode(|mode| assert_ne!(mode, Mode::Eager)));
        assert!(panicked.is_err());
        let panicked = catch_unwind(|| {
            for_each_case_and_mode_of_a_long_suite(&cases, |&case, _| assert_ne!(case, 20))
        });
        assert!(panicked.is_err());
    }

    #[test]
    fn threads_return_in_order_and_panics_go_on() {
        assert_eq!(on_threads(vec![10, 20, 30], |i, x| x + i), vec![10, 21, 32]);
        let panicked = catch_unwind(|| on_threads(vec![0, 1], |_, x| assert_eq!(x, 0)));
        assert!(panicked.is_err());
    }

    #[test]
    fn ranks_see_their_own_rank_and_the_world() {
        let seen = on_ranks(3, Mode::Eager, |rank, _, comm| {
            use fsdp_fusion::Communicator;
            (rank, comm.rank(), comm.world_size())
        });
        assert_eq!(seen, vec![(0, 0, 3), (1, 1, 3), (2, 2, 3)]);
    }
}
