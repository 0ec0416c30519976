//! A step from C: the hooks around each unit's forward and backward, the parameters' views,
//! the gradients handed over, and the step's end.

use std::ffi::c_void;

use super::engine_values::host_bytes;
use super::handles::{TensorMemory, on_engine, on_engine_with, with_engine};
use super::status::{Failure, Outcome, boundary, caller_slice, fsdp_status, invalid, null, put};
use super::types::{dtype_code, dtype_of, fsdp_engine, fsdp_grad, unit_of};
use crate::backend::Input;
use crate::types::{DType, ParamId};

/// Before `unit`'s forward (`FSDP_ROOT` for the root): gathers its groups, prefetches the next
/// unit. Takes part in collectives: every rank must call it. On a GPU it does not block the host.
/// A forward while a unit's backward is open (a recompute, for activation checkpointing) stays
/// part of that backward pass.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_pre_forward(engine: *mut fsdp_engine, unit: i64) -> fsdp_status {
    unit_hook(engine, unit, UnitHook::PreForward)
}

/// After `unit`'s forward: its parameter views stay valid only while another of its hooks is open.
/// Does not block the host.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_post_forward(engine: *mut fsdp_engine, unit: i64) -> fsdp_status {
    unit_hook(engine, unit, UnitHook::PostForward)
}

/// Before `unit`'s backward: as `fsdp_engine_pre_forward`, prefetching in backward order.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_pre_backward(engine: *mut fsdp_engine, unit: i64) -> fsdp_status {
    unit_hook(engine, unit, UnitHook::PreBackward)
}

/// After `unit`'s backward. Optional where the ranks hand over the same gradients in the same
/// order: `fsdp_engine_finish_grad_sync` ends any still open. Where gradients travel between
/// ranks (above world size 1, or with replicas) it reduce-scatters every trainable group of the
/// unit (a collective; not the root's, which take gradients until the pass ends), a parameter
/// with no gradient counting as zero, and refuses the unit's later gradients of the pass. Ranks
/// whose gradients differ (some without a parameter's) end each unit's backward before the next
/// unit's gradients: the reductions then follow the hooks, which every rank issues alike. A pass
/// of hooks with no gradient at all reduces zeros and ends with `fsdp_engine_finish_grad_sync`
/// like any other. Does not block the host.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_post_backward(engine: *mut fsdp_engine, unit: i64) -> fsdp_status {
    unit_hook(engine, unit, UnitHook::PostBackward)
}

/// The four hooks around a unit, each C function one call of [`unit_hook`].
#[derive(Clone, Copy)]
enum UnitHook {
    PreForward,
    PostForward,
    PreBackward,
    PostBackward,
}

fn unit_hook(engine: *mut fsdp_engine, unit: i64, hook: UnitHook) -> fsdp_status {
    boundary(|| {
        let unit = unit_of(unit)?;
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => match hook {
                UnitHook::PreForward => e.pre_forward(unit),
                UnitHook::PostForward => e.post_forward(unit),
                UnitHook::PreBackward => e.pre_backward(unit),
                UnitHook::PostBackward => e.post_backward(unit),
            })?)
        })
    })
}

/// The address of `param`'s gathered values and their count and dtype, valid while one of the
/// parameter's unit's hooks is open; read only (it is a copy of the shards). The engine owns the
/// memory, which holds another group once the unit's hooks closed and the unit was evicted.
///
/// CPU engine: host memory (on an asynchronous group, the call first waits for the engine's
/// compute stream). CUDA engine: a device address, to read on the compute stream only (the hook
/// that opened the unit made that stream wait for the gather); does not block.
///
/// # Safety
/// Each out-pointer is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_param(
    engine: *mut fsdp_engine,
    param: usize,
    data: *mut *const c_void,
    numel: *mut usize,
    dtype: *mut u32,
) -> fsdp_status {
    // SAFETY: the caller's contract.
    unsafe { param_view(engine, ParamId(param), (data, numel, dtype), ViewFor::Host) }
}

/// Who reads a parameter's view: the host, or work on the compute stream.
#[derive(Clone, Copy)]
pub(super) enum ViewFor {
    Host,
    Stream,
}

/// Writes the address of `param`'s gathered values, for `reader`, and their count and dtype to
/// the caller's out-pointers.
///
/// # Safety
/// Each out-pointer is NULL or valid for a write.
pub(super) unsafe fn param_view(
    engine: *mut fsdp_engine,
    param: ParamId,
    (data, numel, dtype): (*mut *const c_void, *mut usize, *mut u32),
    reader: ViewFor,
) -> fsdp_status {
    boundary(|| {
        if data.is_null() || numel.is_null() || dtype.is_null() {
            return Err(null("data, numel or dtype"));
        }
        let (address, layout) = on_engine(engine, |any| {
            with_engine!(any, e => {
                let address = match reader {
                    ViewFor::Host => e.param_address(param)?,
                    ViewFor::Stream => e.param_device(param)?.ptr,
                };
                Ok((address, e.plan().param(param)?.clone()))
            })
        })?;
        // SAFETY: checked non-null; the caller's contract.
        unsafe {
            put(data, "data", address as *const c_void)?;
            put(numel, "numel", layout.numel)?;
            put(dtype, "dtype", dtype_code(layout.dtype))
        }
    })
}

/// Hands over `param`'s gradient for this backward pass: `numel` elements of `dtype` (the
/// parameter's dtype or `FSDP_F32`); it is added in fp32 to this pass's reduction. Where
/// gradients stay on the rank the group's last gradient ends the group's pass. Where they travel
/// (above world size 1, or with replicas) no gradient launches a reduce-scatter: the end of the
/// unit's backward (`fsdp_engine_post_backward`) or of the pass does, in the plan's order, so the
/// ranks may hand over different gradients (one with none counts as zero) as long as they issue
/// the same hooks in the same order. Where no backward hook marks a pass (gradients handed over
/// with no `fsdp_engine_pre_backward`), a rank's first gradient begins the pass: each rank then
/// hands over at least one gradient in every pass, or the ranks' collectives differ and fail, at
/// the latest at the engine's deadline. A gradient of a unit whose backward ended in this pass is refused
/// (`FSDP_MISUSE`). The caller keeps ownership of `data`.
///
/// CPU engine: `data` is host memory, read before the call returns. CUDA engine: `data` is a
/// device address, read on the compute stream (the caller's stream) after the work already queued
/// there; it must stay valid until that stream passed this point, which PyTorch's caching
/// allocator ensures for a tensor made on that stream. Does not block the host.
///
/// # Safety
/// CPU engine: `data` is NULL or valid for `numel` elements of `dtype`. CUDA engine: `data` is 0
/// or a device address valid for `numel` elements of `dtype` until the compute stream read them.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_grad(
    engine: *mut fsdp_engine,
    param: usize,
    data: *const c_void,
    numel: usize,
    dtype: u32,
) -> fsdp_status {
    boundary(|| {
        let dtype = dtype_of(dtype)?;
        on_engine_with(
            engine,
            // SAFETY: the caller's contract.
            |memory| unsafe { caller_input(memory, data, numel, dtype) },
            |any, input| Ok(with_engine!(any, e => e.grad(ParamId(param), input))?),
        )
    })
}

/// Hands over several gradients of this backward pass at once: as `fsdp_engine_grad` on each
/// entry in order, for one call per unit instead of one per parameter; where the optimizer steps
/// in the backward, the entries are taken unit after unit, the unit already taking gradients
/// first, then the others in the order of their first entry (where gradients stay on the rank
/// each unit's gradients end the units before it but the root). Every entry is checked (its
/// parameter, dtype, length, and no parameter twice) before any is taken, so a refused batch
/// changes nothing. `count` 0 does nothing.
///
/// # Safety
/// `grads` is NULL (with `count` 0) or valid for `count` entries, each of whose `data` is as
/// `fsdp_engine_grad` requires.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_grads(
    engine: *mut fsdp_engine,
    grads: *const fsdp_grad,
    count: usize,
) -> fsdp_status {
    boundary(|| {
        // SAFETY: the caller's contract.
        let entries = unsafe { caller_slice(grads, count, "grads") }?;
        let convert = |memory| {
            let mut batch = crate::fallible::with_capacity(entries.len(), "a gradient batch")?;
            for (i, g) in entries.iter().enumerate() {
                let dtype =
                    dtype_of(g.dtype).map_err(|f| invalid(format!("grads[{i}]: {}", f.message)))?;
                // SAFETY: the caller's contract for each entry.
                let input = unsafe { caller_input(memory, g.data, g.numel, dtype) }
                    .map_err(|f| Failure::new(f.status, format!("grads[{i}]: {}", f.message)))?;
                batch.push((ParamId(g.param), input));
            }
            Ok(batch)
        };
        on_engine_with(engine, convert, |any, batch| {
            Ok(with_engine!(any, e => e.grads(&batch))?)
        })
    })
}

/// The gathered addresses of `count` parameters at once, `data[i]` for `params[i]`: as
/// `fsdp_engine_param` on each, for one call per unit instead of one per parameter. Every
/// parameter's unit must have a hook open; on failure nothing is written.
///
/// # Safety
/// `params` and `data` are NULL (with `count` 0) or valid for `count` reads and writes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_params(
    engine: *mut fsdp_engine,
    params: *const usize,
    count: usize,
    data: *mut *const c_void,
) -> fsdp_status {
    boundary(|| {
        // SAFETY: the caller's contract.
        let ids = unsafe { caller_slice(params, count, "params") }?;
        if data.is_null() && count > 0 {
            return Err(null("data"));
        }
        let addresses = on_engine(engine, |any| {
            let mut addresses = crate::fallible::with_capacity(ids.len(), "addresses")?;
            for &id in ids {
                addresses.push(with_engine!(any, e => e.param_address(ParamId(id)))?);
            }
            Ok(addresses)
        })?;
        for (i, address) in addresses.into_iter().enumerate() {
            // SAFETY: `data` is non-null and valid for `count` writes by the caller's contract.
            unsafe { data.add(i).write(address as *const c_void) };
        }
        Ok(())
    })
}

/// A caller's tensor in `memory`: host memory for a CPU engine, a device address on the compute
/// stream for a CUDA engine.
///
/// # Safety
/// Host memory: `data` is NULL or valid for `numel` elements of `dtype`. Device memory: as
/// `Input::Device` requires.
unsafe fn caller_input<'a>(
    memory: TensorMemory,
    data: *const c_void,
    numel: usize,
    dtype: DType,
) -> Outcome<Input<'a>> {
    match memory {
        TensorMemory::Host => {
            // SAFETY: the caller's contract.
            let bytes = unsafe { host_bytes(data, numel, dtype, "data") }?;
            Ok(Input::host_bytes(bytes, dtype))
        }
        // SAFETY: the caller's contract.
        TensorMemory::Device => unsafe { device_input(data, numel, dtype) },
    }
}

/// `numel` elements of `dtype` at `data`, read on the compute stream.
///
/// # Safety
/// As [`Input::device`].
pub(super) unsafe fn device_input(
    data: *const c_void,
    numel: usize,
    dtype: DType,
) -> Outcome<Input<'static>> {
    if data.is_null() && numel > 0 {
        return Err(null("data"));
    }
    // SAFETY: the caller's contract, which is `Input::device`'s.
    Ok(unsafe { Input::device(data as u64, numel, dtype) })
}

/// Opens `param`'s fp32 place in its gradient slot (`numel` floats at `*out`) for the caller to
/// write this pass's gradient into; `fsdp_engine_commit_grad` must follow before any other
/// gradient or hook. The place is NOT zero-filled: it holds what an earlier gradient left there,
/// so write every element and never add into it (a GEMM with beta = 1 would add those values to
/// the gradient). The engine owns the memory; it is the caller's to write until the commit.
/// CPU engine: host memory, written by the host (on an asynchronous group, the call first waits
/// for the engine's compute stream). CUDA engine: a device address, to write on the compute
/// stream; does not block. `FSDP_MISUSE`, with nothing opened, where gradients travel in bf16
/// (`reduce_dtype`) above world size 1, and for a step's later passes at world size 1 or under
/// `FSDP_NO_SYNC` (where they add into the earlier passes'): hand them over with
/// `fsdp_engine_grad` there.
///
/// # Safety
/// `out` is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_grad_slot(
    engine: *mut fsdp_engine,
    param: usize,
    out: *mut *mut f32,
) -> fsdp_status {
    boundary(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        let address = on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.grad_slot_address(ParamId(param)))?)
        })?;
        // SAFETY: the caller's contract.
        unsafe { put(out, "out", address as *mut f32) }
    })
}

/// Declares the gradient written into the slot `fsdp_engine_grad_slot` opened (on a GPU: queued
/// on the compute stream before this call). Does not block.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_commit_grad(engine: *mut fsdp_engine, param: usize) -> fsdp_status {
    boundary(|| {
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.commit_grad(ParamId(param)))?)
        })
    })
}

/// Ends the step's backward passes: reduces every group and orders the optimizer after the
/// reductions. A collective. On a GPU it does not block the host.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_finish_grad_sync(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| {
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.finish_grad_sync())?)
        })
    })
}

/// Steps the optimizer on this rank's shards, once per step, after the gradient sync, with no
/// unit's forward or backward open (`FSDP_MISUSE` otherwise, nothing changed). On a GPU it
/// runs on the compute stream and does not block the host.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_optimizer_step(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| {
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.optimizer_step())?)
        })
    })
}

/// Ends the step: gathered buffers are released (views from `fsdp_engine_param` are stale); the
/// next step starts. Does not block the host.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_engine_end_step(engine: *mut fsdp_engine) -> fsdp_status {
    boundary(|| on_engine(engine, |any| Ok(with_engine!(any, e => e.end_step())?)))
}
