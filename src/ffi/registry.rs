//! Live handles of the C API. A handle is an opaque number, never a Rust address: a destroyed or
//! made-up handle is found missing here and reported, instead of being dereferenced.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::ffi::{Failure, fsdp_status};

/// What a handle names. A group guards its own parts (it may hold communicators of several
/// kinds, each behind its own lock); an engine is used by one call at a time.
pub(crate) enum Object<P, G, E> {
    Plan(P),
    Group(G),
    Engine(Mutex<E>),
}

pub(crate) struct Registry<P, G, E> {
    next: u64,
    live: HashMap<u64, Arc<Object<P, G, E>>>,
}

impl<P, G, E> Registry<P, G, E> {
    pub(crate) fn new() -> Self {
        Registry {
            next: 1,
            live: HashMap::new(),
        }
    }

    /// Stores `object` and returns its handle, never 0 and never reused.
    pub(crate) fn insert(&mut self, object: Object<P, G, E>) -> u64 {
        // Spaced like aligned addresses, so a handle looks like one in a debugger.
        let handle = self.next << 4;
        self.next += 1;
        self.live.insert(handle, Arc::new(object));
        handle
    }

    pub(crate) fn get(&self, handle: u64) -> Result<Arc<Object<P, G, E>>, Failure> {
        self.live.get(&handle).cloned().ok_or_else(|| stale(handle))
    }

    pub(crate) fn remove(&mut self, handle: u64) -> Result<Arc<Object<P, G, E>>, Failure> {
        self.live.remove(&handle).ok_or_else(|| stale(handle))
    }
}

fn stale(handle: u64) -> Failure {
    Failure::new(
        fsdp_status::FSDP_INVALID_HANDLE,
        format!("handle {handle:#x} is not live: it was destroyed or never created"),
    )
}

/// Locks a handle's object; a panic while it was held leaves it unusable.
pub(crate) fn lock<T>(m: &Mutex<T>) -> Result<MutexGuard<'_, T>, Failure> {
    m.lock().map_err(|_| {
        Failure::new(
            fsdp_status::FSDP_PANIC,
            "the object was left unusable by an earlier panic; destroy it".to_string(),
        )
    })
}
