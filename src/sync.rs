//! Locks taken whatever a panic left: every mutex of the crate whose lock goes through here is
//! held only by code that leaves its data whole wherever a panic can come from (each call site
//! says why), so a poisoned lock is taken as it is. The panic itself is the error reported: the
//! C boundary catches it, and a Rust caller sees it on its thread.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// `mutex`'s guard, poisoned or not.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
