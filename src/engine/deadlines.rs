//! Deadlines for the collectives in flight on a rank's streams, which no host wait may see: the
//! engine hands each collective it queues, with the event its stream reaches once it is done, to
//! a thread of its own; past the engine's timeout a collective still in flight fails the rank's
//! watch, which aborts its communicators ([`crate::watch::Watch::on_end`]), so its kernels end,
//! its streams drain, the caller's own waits on them return, and the next engine call reports
//! the collective. The engine's thread only appends (a lock and a push per collective); the
//! watchdog looks every [`period`] and never at a collective younger than the timeout.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::comm::Fingerprint;
use crate::error::{Error, Result};
// Every critical section leaves the queue whole.
use crate::sync::lock;
use crate::watch::Watch;
use crate::watchdog::Watchdog;

/// A collective queued on a stream: what it is, among which ranks, and when its stream is done
/// with it.
struct InFlight<E> {
    collective: Fingerprint,
    /// This rank's place among the ranks of the collective, and their number.
    place: usize,
    peers: usize,
    done: Arc<E>,
    issued: Instant,
}

type Queue<E> = Arc<Mutex<VecDeque<InFlight<E>>>>;

/// How often the watchdog looks, for `timeout`: often enough to fail a collective soon after its
/// deadline, rarely enough to cost nothing.
pub(super) fn period(timeout: Duration) -> Duration {
    (timeout / 8).clamp(Duration::from_millis(5), Duration::from_secs(1))
}

/// The collectives in flight of one engine, and the thread that holds them to their deadline.
pub(super) struct Deadlines<E> {
    queue: Queue<E>,
    _watchdog: Watchdog,
}

impl<E: Send + Sync + 'static> Deadlines<E> {
    /// Starts the watchdog of the rank whose watch is `watch`; `reached` says whether its
    /// stream reached an event.
    pub(super) fn start(watch: Watch, reached: fn(&E) -> Result<bool>) -> Result<Deadlines<E>> {
        let queue: Queue<E> = Arc::default();
        let watched = Arc::clone(&queue);
        let timeout = watch.timeout();
        let what = "the engine's watchdog of collectives in flight";
        let watchdog = Watchdog::start(what, watch, period(timeout), move || {
            overdue(&watched, timeout, reached)
        })?;
        Ok(Deadlines {
            queue,
            _watchdog: watchdog,
        })
    }

    /// Holds `collective` (this rank at `place` of `peers` ranks), which its stream is done with
    /// once it reaches `done`, to the deadline.
    pub(super) fn track(
        &self,
        collective: Fingerprint,
        (place, peers): (usize, usize),
        done: Arc<E>,
    ) {
        lock(&self.queue).push_back(InFlight {
            collective,
            place,
            peers,
            done,
            issued: Instant::now(),
        });
    }
}

/// Drops the collectives at the front of `queue` that are done; the error for the first one
/// still in flight past `timeout`, if any. A failure to look at an event is that error too: the
/// device is then in no state to go on.
fn overdue<E>(
    queue: &Mutex<VecDeque<InFlight<E>>>,
    timeout: Duration,
    reached: fn(&E) -> Result<bool>,
) -> Option<Error> {
    let mut queue = lock(queue);
    while let Some(front) = queue.front() {
        match reached(&front.done) {
            Ok(true) => {
                queue.pop_front();
            }
            Ok(false) => {
                let waited = front.issued.elapsed();
                return (waited >= timeout).then(|| Error::CollectiveTimedOut {
                    collective: front.collective.to_string(),
                    place: front.place,
                    peers: front.peers,
                    waited,
                });
            }
            Err(e) => return Some(e),
        }
    }
    None
}
