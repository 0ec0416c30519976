//! Faults injected from C, in builds with the `fault-injection` feature: for the tests of
//! clients (C, Python) against a stuck peer.

use super::handles::{on_engine, with_engine};
use super::status::{boundary, fsdp_status};
use super::types::fsdp_engine;

/// Makes collective number `at` the engine issues from now (0: the next, counted over every
/// kind) hang on its stream once queued, as one whose peer is stuck does on the device, until the
/// rank ends: the watchdog fails it past the engine's timeout (`FSDP_TIMEOUT` at the next call,
/// naming the collective), `fsdp_engine_abort`, or `fsdp_engine_destroy`. The host goes on
/// meanwhile, and the caller's own stream waits end when the rank does. On the eager CPU backend
/// the call that queues the collective fails with `FSDP_UNAVAILABLE` instead (its streams run on
/// the caller's thread).
/// `FSDP_POISONED` on a poisoned or aborted engine. Only in builds with the `fault-injection`
/// feature; not for training.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_hang_collective(engine: *mut fsdp_engine, at: u64) -> fsdp_status {
    boundary(|| {
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.hang_collective(at))?)
        })
    })
}
