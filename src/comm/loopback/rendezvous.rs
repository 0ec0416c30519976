//! A host rendezvous of the threads of a group: each deposits a value, all get every value.

use std::sync::{Condvar, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::fallible::filled;
use crate::watch::Watch;

#[derive(Debug)]
struct State<T> {
    /// Completed exchanges.
    generation: u64,
    arrived: usize,
    /// Deposits of even and odd generations. A rank can deposit into a generation's half again
    /// only after the next exchange completed, and so after every rank read this one.
    deposits: [Vec<Option<T>>; 2],
    /// Ranks whose handle was dropped.
    left: Vec<bool>,
    /// Each rank's watch: an aborted rank, or one whose thread ended, is gone for the others.
    watches: Vec<Watch>,
}

impl<T> State<T> {
    /// The first rank other than `rank` that is gone.
    fn gone(&self, rank: usize) -> Option<usize> {
        (0..self.left.len()).find(|&r| r != rank && (self.left[r] || self.watches[r].has_left()))
    }
}

/// The meeting point of `world_size` ranks, one thread each.
#[derive(Debug)]
pub(super) struct Rendezvous<T> {
    world_size: usize,
    state: Mutex<State<T>>,
    changed: Condvar,
}

impl<T: Clone> Rendezvous<T> {
    pub(super) fn new(world_size: usize) -> Result<Rendezvous<T>> {
        let what = "a loopback group";
        Ok(Rendezvous {
            world_size,
            state: Mutex::new(State {
                generation: 0,
                arrived: 0,
                deposits: [
                    filled(world_size, None, what)?,
                    filled(world_size, None, what)?,
                ],
                left: filled(world_size, false, what)?,
                watches: filled(world_size, Watch::default(), what)?,
            }),
            changed: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // A rank that panicked while holding the lock left the state consistent: keep going.
        crate::sync::lock(&self.state)
    }

    /// Deposits `value` as `rank`'s, waits until every rank deposited, and returns the values in
    /// rank order. Fails with `Error::PeerGone` (naming `op`) if a rank is gone first, and as
    /// `watch` says on an abort or past its deadline.
    pub(super) fn exchange(
        &self,
        rank: usize,
        watch: &Watch,
        op: &str,
        value: T,
    ) -> Result<Vec<T>> {
        let gone = |rank| Error::PeerGone {
            rank,
            op: op.to_string(),
        };
        // An abort (which leaves too) is the rank's own error to give.
        watch.check()?;
        if watch.has_left() {
            return Err(gone(rank));
        }
        let mut state = self.lock();
        let generation = state.generation;
        let half = (generation % 2) as usize;
        state.deposits[half][rank] = Some(value);
        state.arrived += 1;
        if state.arrived == self.world_size {
            state.arrived = 0;
            state.generation += 1;
            self.changed.notify_all();
        }
        let waited = watch.wait_while(
            state,
            &self.changed,
            || op.to_string(),
            |state| {
                if state.generation != generation {
                    return Ok(false);
                }
                // An abort (which leaves too) is the rank's own error to give.
                watch.check()?;
                if watch.has_left() {
                    return Err(gone(rank));
                }
                match state.gone(rank) {
                    Some(r) => Err(gone(r)),
                    None => Ok(true),
                }
            },
        );
        let state = match waited {
            Ok(state) => state,
            Err(e) => {
                // This rank leaves the exchange it never completed, its value with it, so that
                // a later one (a retried engine creation) starts from no arrival.
                let mut state = self.lock();
                if state.generation == generation {
                    state.arrived = state.arrived.saturating_sub(1);
                    state.deposits[half][rank] = None;
                }
                return Err(e);
            }
        };
        let deposits = &state.deposits[half];
        deposits
            .iter()
            .enumerate()
            .map(|(rank, d)| d.clone().ok_or_else(|| gone(rank)))
            .collect()
    }

    /// Marks `rank` as gone: ranks waiting now or later fail instead of hanging.
    pub(super) fn leave(&self, rank: usize) {
        let mut state = self.lock();
        state.left[rank] = true;
        self.changed.notify_all();
    }

    /// The watch whose abort or departure makes `rank` gone for the others.
    pub(super) fn set_watch(&self, rank: usize, watch: &Watch) {
        self.lock().watches[rank] = watch.clone();
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn every_rank_gets_every_value_in_rank_order_round_after_round() {
        let world = 4;
        let rv = Arc::new(Rendezvous::<(usize, u64)>::new(world).unwrap());
        let rounds = 500;
        std::thread::scope(|s| {
            for rank in 0..world {
                let rv = Arc::clone(&rv);
                s.spawn(move || {
                    for seq in 0..rounds {
                        let got = rv
                            .exchange(rank, &Watch::default(), "x", (rank, seq))
                            .unwrap();
                        let expected: Vec<_> = (0..world).map(|r| (r, seq)).collect();
                        assert_eq!(got, expected, "rank {rank}, round {seq}");
                    }
                });
            }
        });
    }

    #[test]
    fn a_rank_that_leaves_fails_the_waiting_ranks() {
        let rv = Arc::new(Rendezvous::<u8>::new(3).unwrap());
        std::thread::scope(|s| {
            let waiters: Vec<_> = (0..2)
                .map(|rank| {
                    let rv = Arc::clone(&rv);
                    s.spawn(move || rv.exchange(rank, &Watch::default(), "x", 0))
                })
                .collect();
            rv.leave(2);
            for w in waiters {
                let r = w.join().unwrap();
                assert!(matches!(r, Err(Error::PeerGone { rank: 2, .. })), "{r:?}");
            }
        });
    }

    #[test]
    fn a_rank_that_failed_an_exchange_takes_its_value_back() {
        let rv = Arc::new(Rendezvous::<u8>::new(2).unwrap());
        let short = Watch::new(std::time::Duration::from_millis(20));
        let r = rv.exchange(0, &short, "x", 7);
        assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
        // The next exchange is the retry's and its peer's, not the failed one's.
        let watch = Watch::new(std::time::Duration::from_secs(10));
        std::thread::scope(|s| {
            let other = {
                let (rv, watch) = (Arc::clone(&rv), watch.clone());
                s.spawn(move || rv.exchange(1, &watch, "x", 1))
            };
            assert_eq!(rv.exchange(0, &watch, "x", 0).unwrap(), vec![0, 1]);
            assert_eq!(other.join().unwrap().unwrap(), vec![0, 1]);
        });
    }

    #[test]
    fn a_rank_that_leaves_ends_its_own_wait_at_once() {
        let rv = Rendezvous::<u8>::new(2).unwrap();
        let watch = Watch::new(std::time::Duration::from_secs(30));
        let start = std::time::Instant::now();
        let r = std::thread::scope(|s| {
            let leaver = watch.clone();
            s.spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(30));
                leaver.leave();
            });
            rv.exchange(0, &watch, "x", 0)
        });
        assert!(matches!(r, Err(Error::PeerGone { rank: 0, .. })), "{r:?}");
        assert!(start.elapsed() < std::time::Duration::from_secs(10));
    }

    #[test]
    fn an_aborted_or_failed_rank_gives_its_own_error_not_its_departure() {
        let rv = Rendezvous::<u8>::new(2).unwrap();
        let aborted = Watch::default();
        aborted.abort();
        let r = rv.exchange(0, &aborted, "x", 0);
        assert!(matches!(r, Err(Error::Aborted)), "{r:?}");
        let failed = Watch::default();
        failed.fail(Error::Timeout {
            op: "a watchdog's".into(),
            waited: std::time::Duration::ZERO,
        });
        let r = rv.exchange(0, &failed, "x", 0);
        assert!(
            matches!(&r, Err(Error::Timeout { op, .. }) if op == "a watchdog's"),
            "{r:?}"
        );
    }

    #[test]
    fn leaving_after_the_last_exchange_does_not_fail_it() {
        let rv = Arc::new(Rendezvous::<u8>::new(2).unwrap());
        std::thread::scope(|s| {
            let other = {
                let rv = Arc::clone(&rv);
                s.spawn(move || {
                    let r = rv.exchange(1, &Watch::default(), "x", 1);
                    rv.leave(1);
                    r
                })
            };
            assert_eq!(
                rv.exchange(0, &Watch::default(), "x", 0).unwrap(),
                vec![0, 1]
            );
            assert_eq!(other.join().unwrap().unwrap(), vec![0, 1]);
            assert!(matches!(
                rv.exchange(0, &Watch::default(), "x", 0),
                Err(Error::PeerGone { rank: 1, .. })
            ));
        });
    }
}
