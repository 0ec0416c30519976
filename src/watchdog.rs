//! A thread that looks for a rank's failure that no wait of its own sees (a communicator's
//! asynchronous error, a collective in flight past its deadline) while its host may be blocked
//! in a wait, and fails the rank's watch with it, so the wait ends with that error instead of
//! running out its deadline.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::watch::Watch;

pub(crate) struct Watchdog {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Starts a thread (`what`, in a spawn error) that calls `failure` every `period` until it
    /// returns an error, which it gives to `watch`, or until the watchdog is dropped.
    pub(crate) fn start(
        what: &'static str,
        watch: Watch,
        period: Duration,
        mut failure: impl FnMut() -> Option<Error> + Send + 'static,
    ) -> Result<Watchdog> {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("fsdp-watchdog".into())
            .spawn(move || {
                while !stopped.load(Ordering::SeqCst) {
                    if let Some(cause) = failure() {
                        watch.fail(cause);
                        return;
                    }
                    std::thread::park_timeout(period);
                }
            })
            .map_err(|e| Error::Spawn {
                what,
                source: Arc::new(e),
            })?;
        Ok(Watchdog {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Instant;

    use super::*;

    #[test]
    fn a_failure_found_ends_the_ranks_blocked_wait_with_it() {
        let watch = Watch::new(Duration::from_secs(60));
        let looks = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&looks);
        let _dog = Watchdog::start(
            "a test's watchdog",
            watch.clone(),
            Duration::from_millis(1),
            move || {
                (counted.fetch_add(1, Ordering::SeqCst) == 3).then(|| Error::Nccl {
                    call: "ncclCommGetAsyncError",
                    code: 6,
                    message: "remote process exited".into(),
                })
            },
        )
        .unwrap();
        let start = Instant::now();
        let err = watch
            .poll(
                Duration::from_millis(1),
                || "a stuck collective".into(),
                || Ok(false),
            )
            .unwrap_err();
        assert!(
            matches!(&err, Error::Nccl { code: 6, message, .. } if message == "remote process exited"),
            "{err:?}"
        );
        assert!(start.elapsed() < Duration::from_secs(10));
        assert_eq!(
            looks.load(Ordering::SeqCst),
            4,
            "it stops looking once it failed"
        );
        assert!(watch.has_left(), "its peers see the rank gone");
        assert!(matches!(watch.check(), Err(Error::Nccl { code: 6, .. })));
    }

    #[test]
    fn dropping_the_watchdog_stops_it_at_once() {
        let watch = Watch::new(Duration::from_secs(60));
        let looks = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&looks);
        let dog = Watchdog::start(
            "a test's watchdog",
            watch.clone(),
            Duration::from_secs(3600),
            move || {
                counted.fetch_add(1, Ordering::SeqCst);
                None
            },
        )
        .unwrap();
        let start = Instant::now();
        while looks.load(Ordering::SeqCst) == 0 {
            assert!(start.elapsed() < Duration::from_secs(10), "it never looked");
            std::thread::yield_now();
        }
        drop(dog);
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the drop waited a period"
        );
        assert_eq!(looks.load(Ordering::SeqCst), 1);
        assert!(watch.check().is_ok());
    }
}
