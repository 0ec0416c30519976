//! Work on a stream that completes only once released: the stand-in for a collective stuck on
//! the device, with which the tests of a client (C, Python) meet a stuck peer
//! ([`crate::Engine::hang_collective`]).

use std::any::Any;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// What keeps a word's memory valid (on a GPU, the context whose page-locked memory it is):
/// the release outlives the backend, in the hooks of a rank's end.
type Keeper = Arc<dyn Any + Send + Sync>;

/// The release of the work [`crate::Backend::hold`] queued: a flag, and on a GPU the page-locked
/// words mapped into the device that the streams wait on.
#[derive(Clone, Debug, Default)]
pub struct Release {
    set: Arc<AtomicBool>,
    /// Host addresses of words a device stream waits to become 1, each with what keeps it.
    words: Arc<Mutex<Vec<(usize, Keeper)>>>,
}

impl Release {
    pub fn is_set(&self) -> bool {
        self.set.load(Ordering::SeqCst)
    }

    /// Ends every hold on this release, queued or to come.
    pub fn set(&self) {
        self.set.store(true, Ordering::SeqCst);
        for (word, _) in self.words().iter() {
            // SAFETY: a page-locked word `add_word`'s caller allocated and never frees, in
            // memory its keeper, held beside it, keeps valid.
            unsafe { (*word as *mut u32).write_volatile(1) };
        }
    }

    /// Adds a page-locked word a device stream waits on, set at once if the release already is.
    ///
    /// # Safety
    /// `word` is a page-locked `u32` that is never freed, in memory valid while `keeper` lives.
    pub(crate) unsafe fn add_word(&self, word: *mut u32, keeper: Keeper) {
        self.words().push((word as usize, keeper));
        if self.is_set() {
            // SAFETY: the caller's contract.
            unsafe { word.write_volatile(1) };
        }
    }

    fn words(&self) -> std::sync::MutexGuard<'_, Vec<(usize, Keeper)>> {
        // Each critical section pushes or reads: a panic leaves the list whole.
        crate::sync::lock(&self.words)
    }
}
