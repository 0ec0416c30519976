//! Live handles of the C API. A handle is an opaque number, never a Rust address: a destroyed or
//! made-up handle is found missing here and reported, instead of being dereferenced.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use super::status::{Failure, fsdp_status};

/// What a handle names. A group guards its own parts (it may hold communicators of several
/// kinds, each behind its own lock); an engine's entry guards its engine.
pub(crate) enum Object<P, G, E> {
    Plan(P),
    Group(G),
    Engine(E),
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
    pub(crate) fn insert(&mut self, object: Object<P, G, E>) -> Result<u64, Failure> {
        self.live.try_reserve(1).map_err(|_| {
            Failure::new(
                fsdp_status::FSDP_OUT_OF_MEMORY,
                "out of memory for a new handle".to_string(),
            )
        })?;
        // Spaced like aligned addresses, so a handle looks like one in a debugger.
        let handle = self.next << 4;
        self.next += 1;
        self.live.insert(handle, Arc::new(object));
        Ok(handle)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::panic::{AssertUnwindSafe, catch_unwind};

    #[test]
    fn a_lock_poisoned_by_a_panic_reports_instead_of_crashing() {
        let m = Mutex::new(0u8);
        let _ = catch_unwind(AssertUnwindSafe(|| {
            let _guard = m.lock().unwrap();
            panic!("while locked");
        }));
        let failure = lock(&m).unwrap_err();
        assert_eq!(failure.status, fsdp_status::FSDP_PANIC);
    }

    #[test]
    fn handles_are_never_reused_and_stale_ones_are_reported() {
        let mut r: Registry<u8, u8, u8> = Registry::new();
        let a = r.insert(Object::Plan(1)).unwrap();
        r.remove(a).unwrap();
        let b = r.insert(Object::Plan(2)).unwrap();
        assert_ne!(a, b);
        assert_eq!(
            r.get(a).err().map(|f| f.status),
            Some(fsdp_status::FSDP_INVALID_HANDLE)
        );
    }
}
