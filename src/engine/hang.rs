//! An engine's collective made to hang on its stream, for the tests of clients (C, Python)
//! that meet a stuck peer through their own waits ([`Engine::hang_collective`]).

use super::Engine;
use crate::backend::Backend;
use crate::backend::hold::Release;
use crate::comm::Communicator;
use crate::error::Result;
use crate::types::Stream;

/// The collective to hang, counted down as the rank issues them, and its release.
pub(super) struct Hang {
    /// Collectives still to go before the one that hangs; none once it is queued.
    before: Option<u64>,
    release: Release,
}

impl Hang {
    /// Holds `stream` after the collective just queued on it when that one is the one to hang.
    pub(super) fn after_collective<B: Backend>(
        hang: &mut Option<Hang>,
        backend: &B,
        stream: Stream,
    ) -> Result<()> {
        let Some(h) = hang else { return Ok(()) };
        match h.before {
            Some(0) => {
                h.before = None;
                backend.hold(stream, &h.release)
            }
            Some(n) => {
                h.before = Some(n - 1);
                Ok(())
            }
            None => Ok(()),
        }
    }
}

impl Drop for Hang {
    /// An engine dropped before its hang began or ended leaves no stream held.
    fn drop(&mut self) {
        self.release.set();
    }
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Makes collective number `at` this rank issues from now (0: the next, counted over every
    /// kind) hang on its stream once queued, until the rank ends: aborted, failed by that
    /// collective past its deadline, or dropped. So the engine meets what a collective whose peer
    /// is stuck does on the device: the host goes on, the collective never completes. On the
    /// eager CPU backend, which would block its caller for good, the call that queues the
    /// collective fails with `Error::Unsupported` instead. A later call replaces the hang (and
    /// releases it, if it began).
    pub fn hang_collective(&mut self, at: u64) -> Result<()> {
        self.healthy()?;
        let release = Release::default();
        let ended = release.clone();
        self.watch.on_end(Box::new(move || ended.set()));
        self.hang = Some(Hang {
            before: Some(at),
            release,
        });
        Ok(())
    }
}
