//! An engine's values from C: parameters loaded, shards and gathered groups copied out, and
//! what the engine counted.

use std::ffi::c_void;

use super::handles::engine_report;
use super::handles::{AnyEngine, on_engine, with_engine};
use super::status::{Outcome, boundary, caller_slice, fsdp_status, invalid, null, put};
use super::types::{dtype_of, fsdp_counters, fsdp_engine};
use crate::backend::Input;
use crate::types::{DType, ParamId};

/// Writes `numel` elements of `dtype` (the parameter's whole value) into this rank's shard; only
/// the rank's part is kept. `data` is host memory on every backend, read before the call returns.
/// Every rank loads every parameter, between steps (`FSDP_MISUSE` inside a step, nothing
/// changed). Blocks: on a GPU, until the copy to the device
/// is done (after the work already queued on the engine's streams).
///
/// # Safety
/// `data` is NULL or valid for `numel` elements of `dtype`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_load_param(
    engine: *mut fsdp_engine,
    param: usize,
    data: *const c_void,
    numel: usize,
    dtype: u32,
) -> fsdp_status {
    boundary(|| {
        let dtype = dtype_of(dtype)?;
        // SAFETY: the caller's contract.
        let bytes = unsafe { host_bytes(data, numel, dtype, "data") }?;
        let input = Input::host_bytes(bytes, dtype);
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.load_param(ParamId(param), input))?)
        })
    })
}

/// # Safety
/// `data` is NULL or valid for `numel` elements of `dtype`.
pub(super) unsafe fn host_bytes<'a>(
    data: *const c_void,
    numel: usize,
    dtype: DType,
    what: &'static str,
) -> Outcome<&'a [u8]> {
    let len = numel
        .checked_mul(dtype.size())
        .ok_or_else(|| invalid(format!("{numel} elements of {dtype} overflow")))?;
    // SAFETY: valid for `len` bytes by the caller's contract.
    unsafe { caller_slice(data.cast::<u8>(), len, what) }
}

/// What the engine did, as of the end of its last call: never waits for a call in progress on
/// another thread, and works on a poisoned engine too.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_counters(
    engine: *mut fsdp_engine,
    out: *mut fsdp_counters,
) -> fsdp_status {
    boundary(|| {
        let (counters, _) = engine_report(engine)?;
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", counters) }
    })
}

/// Bytes the engine's backend held at the end of its last call, and at its peak; as
/// `fsdp_engine_counters`, never waits.
///
/// # Safety
/// Each out-pointer is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_memory(
    engine: *mut fsdp_engine,
    current: *mut usize,
    peak: *mut usize,
) -> fsdp_status {
    boundary(|| {
        if current.is_null() || peak.is_null() {
            return Err(null("current or peak"));
        }
        let (_, m) = engine_report(engine)?;
        // SAFETY: checked non-null; the caller's contract.
        unsafe {
            put(current, "current", m.current)?;
            put(peak, "peak", m.peak)
        }
    })
}

/// Copies this rank's parameter shard of group `group` (bytes in the group's dtype) into `out`,
/// host memory of `capacity` bytes; `*written` gets the shard's size. Blocks until the copy is
/// done (on a GPU, after the work already queued on the engine's streams). A `capacity` below
/// the size is `FSDP_INVALID_ARGUMENT`, with `*written` the size needed and `out` untouched;
/// `out` may be NULL where `capacity` is 0 (asking the size, or copying an empty shard).
///
/// # Safety
/// `out` is NULL or valid for `capacity` bytes; `written` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_param_shard(
    engine: *mut fsdp_engine,
    group: usize,
    out: *mut c_void,
    capacity: usize,
    written: *mut usize,
) -> fsdp_status {
    // SAFETY: the caller's contract.
    unsafe { group_bytes(engine, (group, false), (out, capacity), written) }
}

/// Copies group `group`'s whole padded buffer (bytes in its dtype), gathered from every rank's
/// shard (of a process group's group, from the shards of this rank's copy), into `out`, host
/// memory of `capacity` bytes; `*written` gets its size. A collective: every rank calls it for
/// the same groups in the same order, between steps (`FSDP_MISUSE` inside one), and with a
/// non-NULL `out` or a `capacity` of 0 (one rank's NULL `out` of a `capacity` above 0 is
/// refused before the gather, which leaves the others to their deadline). Blocks until the bytes
/// are there. A `capacity` below the size is `FSDP_INVALID_ARGUMENT` after the gather, with
/// `*written` the size needed and `out` untouched; `out` may be NULL where `capacity` is 0
/// (asking the size, or copying an empty group).
///
/// # Safety
/// `out` is NULL or valid for `capacity` bytes; `written` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_gather_group(
    engine: *mut fsdp_engine,
    group: usize,
    out: *mut c_void,
    capacity: usize,
    written: *mut usize,
) -> fsdp_status {
    // SAFETY: the caller's contract.
    unsafe { group_bytes(engine, (group, true), (out, capacity), written) }
}

/// Copies this rank's shard of `group` (or, `gathered`, the whole group from every rank's) into
/// the caller's `out` of `capacity` bytes and their count into `written`.
///
/// # Safety
/// `out` is NULL or valid for `capacity` bytes; `written` is NULL or valid for a write.
unsafe fn group_bytes(
    engine: *mut fsdp_engine,
    (group, gathered): (usize, bool),
    (out, capacity): (*mut c_void, usize),
    written: *mut usize,
) -> fsdp_status {
    boundary(|| {
        if (out.is_null() && capacity > 0) || written.is_null() {
            return Err(null("out or written"));
        }
        let bytes = on_engine(engine, |any| {
            Ok(with_engine!(any, e => if gathered {
                e.gather_group(group)
            } else {
                e.param_shard(group)
            })?)
        })?;
        // SAFETY: the caller's contract.
        unsafe { copy_out(&bytes, (out, capacity), written) }
    })
}

/// Copies `bytes` into the caller's `out` of `capacity` bytes and their count into `written`.
///
/// # Safety
/// `out` is valid for `capacity` bytes (non-null where that is above 0) and `written` for a
/// write, non-null.
unsafe fn copy_out(
    bytes: &[u8],
    (out, capacity): (*mut c_void, usize),
    written: *mut usize,
) -> Outcome {
    if bytes.len() > capacity {
        // The size needed, for the caller's next try.
        // SAFETY: the caller's contract.
        unsafe { put(written, "written", bytes.len()) }?;
        return Err(invalid(format!(
            "the copy has {} bytes, out holds {capacity}",
            bytes.len()
        )));
    }
    // A copy of nothing leaves `out` alone: it may be NULL.
    if !bytes.is_empty() {
        // SAFETY: non-null, valid for `capacity` >= `bytes.len()` > 0 bytes by the caller's
        // contract.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), out.cast::<u8>(), bytes.len()) };
    }
    // SAFETY: the caller's contract.
    unsafe { put(written, "written", bytes.len()) }
}

/// Writes to `out` the number of infinite or NaN values in this rank's gradient shards as synced
/// this step (a non-finite gradient on any rank shows on the rank holding its element; under
/// hybrid sharding every replica holds the same shards, so a total sums one replica's ranks). Allowed
/// from `fsdp_engine_finish_grad_sync` to `fsdp_engine_end_step` (`FSDP_MISUSE` otherwise);
/// blocks the host for the count.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_nonfinite_grads(
    engine: *mut fsdp_engine,
    out: *mut u64,
) -> fsdp_status {
    // SAFETY: the caller's contract.
    unsafe {
        put_count(engine, out, |any| {
            Ok(with_engine!(any, e => e.nonfinite_grads())?)
        })
    }
}

/// Writes to `out`, checked for NULL first, what `count` gives of the engine.
///
/// # Safety
/// `out` is NULL or valid for a write.
unsafe fn put_count(
    engine: *mut fsdp_engine,
    out: *mut u64,
    count: impl FnOnce(&mut AnyEngine) -> Outcome<u64>,
) -> fsdp_status {
    boundary(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        let value = on_engine(engine, count)?;
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", value) }
    })
}

/// Writes to `out` the steps the device skipped (`fsdp_engine_skip_nonfinite_on_device`) since
/// the host last read them, and counts them on the host: the optimizer's steps (AdamW's bias
/// correction, the step a checkpoint saves) less them, the counters' `skipped_steps` plus them.
/// Between steps, not during a capture (`FSDP_MISUSE` otherwise); blocks the host for the count
/// where a decision was queued since the last read (0 at once otherwise).
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_read_device_skips(
    engine: *mut fsdp_engine,
    out: *mut u64,
) -> fsdp_status {
    // SAFETY: the caller's contract.
    unsafe {
        put_count(engine, out, |any| {
            Ok(with_engine!(any, e => e.read_device_skips())?)
        })
    }
}
