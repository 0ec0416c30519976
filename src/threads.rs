//! Scoped threads that the system may refuse: a refusal is an error, never a panic.

use std::sync::Arc;
use std::thread::{Builder, Scope, ScopedJoinHandle};

use crate::error::{Error, Result};

/// Runs `work` on a new thread of `scope`; `Error::Spawn` naming `what` where the system
/// refuses one (too many threads, too little memory for its stack).
pub(crate) fn spawn_scoped<'scope, T: Send + 'scope>(
    scope: &'scope Scope<'scope, '_>,
    what: &'static str,
    work: impl FnOnce() -> T + Send + 'scope,
) -> Result<ScopedJoinHandle<'scope, T>> {
    Builder::new()
        .spawn_scoped(scope, work)
        .map_err(|source| Error::Spawn {
            what,
            source: Arc::new(source),
        })
}
