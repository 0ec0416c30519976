//! Groups from C: the communicators of CPU ranks (eager or asynchronous), of loopback ranks on
//! one GPU, and NCCL's unique ids.

use std::ffi::c_int;

use super::comms::{Comms, takeable};
use super::handles::{Entry, destroy, handles};
use super::registry::Object;
use super::status::{Outcome, boundary, fsdp_status, invalid, null, put};
use super::types::{fsdp_local_group, fsdp_loopback_group};
use crate::comm::local::LocalComm;
use crate::comm::loopback::LoopbackComm;
use crate::comm::nccl::{NcclComm, UNIQUE_ID_BYTES};

/// Stores a group under a new handle and writes it to `out`, checked for NULL first.
fn new_group<H>(comms: Comms, out: *mut *mut H) -> Outcome {
    let handle = handles()?.insert(Object::Group(comms))?;
    // SAFETY: the caller checked `out` and guarantees it is valid for a write.
    unsafe { put(out, "out", handle as *mut H) }
}

/// A CUDA device ordinal from C's `int`.
pub(crate) fn device_ordinal(device: c_int) -> Outcome<usize> {
    usize::try_from(device).map_err(|_| invalid(format!("device {device} is not a device ordinal")))
}

/// Creates the communicators of `world_size` CPU ranks running as threads of this process. Each
/// rank's engine takes its communicator with `fsdp_engine_create_cpu`; every rank must then issue
/// the same hooks in the same order. Release with `fsdp_local_group_destroy` (engines keep theirs).
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_local_group_create(
    world_size: usize,
    out: *mut *mut fsdp_local_group,
) -> fsdp_status {
    boundary(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        let comms = takeable(LocalComm::group(world_size)?);
        new_group(Comms::Local { comms, seed: None }, out)
    })
}

/// As `fsdp_local_group_create`, for engines whose CPU backend runs its three streams apart: each
/// stream is a worker thread that runs its queue in order, every operation after a delay drawn
/// from `seed` (rank `r` draws from `seed + r`), and collectives run on the streams. Work is
/// ordered across streams only by the engine's events, so a missing one shows as a wrong value;
/// for tests. Host reads and writes (views, gradient slots, loads, shard copies) first wait for
/// the streams they depend on.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_local_group_create_async(
    world_size: usize,
    seed: u64,
    out: *mut *mut fsdp_local_group,
) -> fsdp_status {
    boundary(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        let comms = takeable(LocalComm::group(world_size)?);
        new_group(
            Comms::Local {
                comms,
                seed: Some(seed),
            },
            out,
        )
    })
}

/// Releases a local group; NULL is accepted.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_local_group_destroy(group: *mut fsdp_local_group) -> fsdp_status {
    boundary(|| {
        let is_local = |o: &Entry| matches!(o, Object::Group(Comms::Local { .. }));
        destroy(group as u64, is_local, "group")
    })
}

/// Writes a fresh NCCL unique id (`len` bytes, which must be 128) to `out`. One rank makes it and
/// passes the same bytes to every rank's `fsdp_engine_create_cuda_nccl`, through the caller's own
/// channel (its launcher, `torch.distributed`, a file). Does not need a GPU, but loads NCCL
/// (`libnccl.so.2`, or the library named by `FSDP_NCCL_LIBRARY`): `FSDP_UNAVAILABLE` without it.
/// May be called from any thread.
///
/// # Safety
/// `out` is NULL or valid for `len` bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_nccl_unique_id(out: *mut u8, len: usize) -> fsdp_status {
    boundary(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        if len != UNIQUE_ID_BYTES {
            return Err(invalid(format!(
                "a unique id has {UNIQUE_ID_BYTES} bytes, not {len}"
            )));
        }
        let id = NcclComm::unique_id()?;
        // SAFETY: non-null and valid for `len` == `id.len()` bytes by the caller's contract.
        unsafe { std::ptr::copy_nonoverlapping(id.as_ptr(), out, id.len()) };
        Ok(())
    })
}

/// Creates the communicators of `world_size` ranks that share one GPU, one thread of this process
/// each: NCCL refuses two ranks on one device, this group does not. Each rank's engine takes its
/// communicator with `fsdp_engine_create_cuda_loopback`; every rank must then issue the same hooks
/// in the same order, from its own thread. Needs no GPU itself. Release with
/// `fsdp_loopback_group_destroy` (engines keep theirs).
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_loopback_group_create(
    world_size: usize,
    out: *mut *mut fsdp_loopback_group,
) -> fsdp_status {
    boundary(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        new_group(
            Comms::Loopback(takeable(LoopbackComm::group(world_size)?)),
            out,
        )
    })
}

/// Releases a loopback group; NULL is accepted.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_loopback_group_destroy(group: *mut fsdp_loopback_group) -> fsdp_status {
    boundary(|| {
        let is_loopback = |o: &Entry| matches!(o, Object::Group(Comms::Loopback(_)));
        destroy(group as u64, is_loopback, "group")
    })
}

/// A unique id from C.
///
/// # Safety
/// `id` is NULL or valid for `len` bytes.
pub(crate) unsafe fn unique_id_of(id: *const u8, len: usize) -> Outcome<[u8; UNIQUE_ID_BYTES]> {
    if id.is_null() {
        return Err(null("unique_id"));
    }
    if len != UNIQUE_ID_BYTES {
        return Err(invalid(format!(
            "a unique id has {UNIQUE_ID_BYTES} bytes, not {len}"
        )));
    }
    let mut bytes = [0u8; UNIQUE_ID_BYTES];
    // SAFETY: non-null and valid for `len` == `bytes.len()` bytes by the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(id, bytes.as_mut_ptr(), len) };
    Ok(bytes)
}
