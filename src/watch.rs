//! What every blocking wait of one rank checks: its deadline, whether the rank was aborted from
//! another thread, and whether it left its group.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// How long a blocking wait lasts by default before it fails with [`Error::Timeout`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// How often a blocked wait looks at the abort flag and its peers.
const POLL: Duration = Duration::from_millis(10);

/// What ends a rank's work that no host wait sees: a communicator's collectives under way on
/// the device, say. Run once, from whichever thread ends the rank.
pub type EndHook = Box<dyn FnOnce() + Send>;

struct State {
    timeout: Duration,
    aborted: AtomicBool,
    left: AtomicBool,
    /// A failure seen off the rank's thread (a communicator's watchdog), ending its waits.
    fault: OnceLock<Error>,
    /// Whether the rank ended (aborted, or failed off its thread), and the hooks to run then.
    on_end: Mutex<(bool, Vec<EndHook>)>,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("timeout", &self.timeout)
            .field("aborted", &self.aborted)
            .field("left", &self.left)
            .field("fault", &self.fault)
            .finish_non_exhaustive()
    }
}

/// One rank's deadline and abort flag, shared by its engine, backend and communicator.
#[derive(Clone, Debug)]
pub struct Watch(Arc<State>);

impl Default for Watch {
    fn default() -> Watch {
        Watch::new(DEFAULT_TIMEOUT)
    }
}

impl Watch {
    pub fn new(timeout: Duration) -> Watch {
        Watch(Arc::new(State {
            timeout,
            aborted: AtomicBool::new(false),
            left: AtomicBool::new(false),
            fault: OnceLock::new(),
            on_end: Mutex::new((false, Vec::new())),
        }))
    }

    pub fn timeout(&self) -> Duration {
        self.0.timeout
    }

    /// Makes every blocked and later wait of the rank fail with [`Error::Aborted`], its peers
    /// see it gone, and its work under way on a device end ([`Watch::on_end`]).
    pub fn abort(&self) {
        self.0.aborted.store(true, Ordering::SeqCst);
        self.leave();
        self.end();
    }

    /// Registers `hook` to run when the rank is aborted or fails off its thread (at once where it
    /// already was): a communicator ends its collectives under way on the device with it.
    pub fn on_end(&self, hook: EndHook) {
        let mut hooks = self.hooks();
        if hooks.0 {
            drop(hooks);
            hook();
        } else {
            hooks.1.push(hook);
        }
    }

    /// Runs every hook [`Watch::on_end`] registered, once.
    fn end(&self) {
        let hooks = {
            let mut hooks = self.hooks();
            hooks.0 = true;
            std::mem::take(&mut hooks.1)
        };
        hooks.into_iter().for_each(|hook| hook());
    }

    fn hooks(&self) -> MutexGuard<'_, (bool, Vec<EndHook>)> {
        // A hook runs outside the lock: a panic in one leaves the list whole.
        crate::sync::lock(&self.0.on_end)
    }

    /// Marks the rank as gone for its peers (its thread ended, or it was aborted).
    pub fn leave(&self) {
        self.0.left.store(true, Ordering::SeqCst);
    }

    /// Makes every blocked and later wait of the rank fail with `cause` (the first one given),
    /// and its peers see it gone: for a failure found by another thread, such as a
    /// communicator's watchdog.
    pub(crate) fn fail(&self, cause: Error) {
        let _ = self.0.fault.set(cause);
        self.leave();
        self.end();
    }

    pub fn is_aborted(&self) -> bool {
        self.0.aborted.load(Ordering::SeqCst)
    }

    /// Whether the rank left its group.
    pub fn has_left(&self) -> bool {
        self.0.left.load(Ordering::SeqCst)
    }

    /// The failure given to [`Watch::fail`], once the rank failed that way, else
    /// `Err(Error::Aborted)` once it was aborted.
    pub(crate) fn check(&self) -> Result<()> {
        if let Some(cause) = self.0.fault.get() {
            return Err(cause.clone());
        }
        if self.is_aborted() {
            return Err(Error::Aborted);
        }
        Ok(())
    }

    /// Waits on `changed` with `guard` held between looks, while `pending` says so (`Ok(true)`),
    /// until it says done (`Ok(false)`) or fails; fails with [`Error::Aborted`] once aborted and
    /// with [`Error::Timeout`] naming `op()` past the deadline.
    pub(crate) fn wait_while<'a, T>(
        &self,
        mut guard: MutexGuard<'a, T>,
        changed: &Condvar,
        op: impl Fn() -> String,
        mut pending: impl FnMut(&mut T) -> Result<bool>,
    ) -> Result<MutexGuard<'a, T>> {
        let start = Instant::now();
        let timeout = self.timeout();
        loop {
            if !pending(&mut guard)? {
                return Ok(guard);
            }
            self.check()?;
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(Error::Timeout { op: op(), waited });
            }
            let slice = POLL.min(timeout - waited);
            guard = changed
                .wait_timeout(guard, slice)
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .0;
        }
    }

    /// Polls `done` until it says so, as [`Watch::wait_while`] does, sleeping `pause` between
    /// looks (for waits that have no condition variable, such as a device's).
    pub(crate) fn poll(
        &self,
        pause: Duration,
        op: impl Fn() -> String,
        done: impl FnMut() -> Result<bool>,
    ) -> Result<()> {
        self.poll_within(self.timeout(), pause, op, done)
    }

    /// As [`Watch::poll`], with the deadline `timeout` after the call instead of the rank's.
    pub(crate) fn poll_within(
        &self,
        timeout: Duration,
        pause: Duration,
        op: impl Fn() -> String,
        mut done: impl FnMut() -> Result<bool>,
    ) -> Result<()> {
        let start = Instant::now();
        loop {
            if done()? {
                return Ok(());
            }
            self.check()?;
            let waited = start.elapsed();
            if waited >= timeout {
                return Err(Error::Timeout { op: op(), waited });
            }
            std::thread::sleep(pause.min(timeout - waited));
        }
    }
}

/// A handle that aborts one engine from any thread: its blocked call and every later one fail
/// with [`Error::Aborted`], and its peers see it gone.
#[derive(Clone, Debug)]
pub struct AbortHandle(pub(crate) Watch);

impl AbortHandle {
    pub fn abort(&self) {
        self.0.abort();
    }

    /// Takes the rank out of its group without aborting its engine, on the local and loopback
    /// communicators: its peers' waits for it fail, and so do its own later collectives. NCCL
    /// has no such signal: there the rank's collectives go on, and a peer's wait for one it
    /// never issues ends at the peer's deadline.
    pub fn leave(&self) {
        self.0.leave();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_ends_when_done_fails_past_its_deadline_and_on_abort() {
        let lock = Mutex::new(0u32);
        let changed = Condvar::new();
        let watch = Watch::new(Duration::from_millis(30));
        let guard = watch
            .wait_while(
                lock.lock().unwrap(),
                &changed,
                || "x".into(),
                |n| {
                    *n += 1;
                    Ok(*n < 3)
                },
            )
            .unwrap();
        assert_eq!(*guard, 3);
        drop(guard);
        let err = watch
            .wait_while(
                lock.lock().unwrap(),
                &changed,
                || "a test wait".into(),
                |_| Ok(true),
            )
            .unwrap_err();
        assert!(
            matches!(&err, Error::Timeout { op, waited } if op == "a test wait" && *waited >= Duration::from_millis(30)),
            "{err:?}"
        );
        let long = Watch::new(Duration::from_secs(60));
        let aborter = long.clone();
        let start = Instant::now();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            aborter.abort();
        });
        let err = long.poll(Duration::from_millis(1), || "x".into(), || Ok(false));
        t.join().unwrap();
        assert!(matches!(err, Err(Error::Aborted)), "{err:?}");
        assert!(start.elapsed() < Duration::from_secs(5));
        assert!(long.has_left());
    }
}
