//! The caller's work in the order of the engine's compute stream, from C: host functions queued
//! there, the gathered addresses such work reads, and the gradients it writes. A CPU model's
//! math queued this way is what a GPU model's kernels are on a CUDA engine's stream: it runs in
//! stream order without the host waiting, and a capture (`fsdp_engine_begin_capture`) holds it.

use std::ffi::c_void;

use super::engine_hooks::{ViewFor, device_input, param_view};
use super::handles::{on_engine, with_engine};
use super::status::{Outcome, boundary, fsdp_status, null};
use super::types::{dtype_of, fsdp_engine};
use crate::types::ParamId;

/// A function the engine queues on its compute stream, called with the caller's data.
pub type fsdp_host_func = Option<unsafe extern "C" fn(user_data: *mut c_void)>;

/// Queues `func(user_data)` on the engine's compute stream, after the work queued there so far;
/// the engine's later work on that stream waits for it to return. CPU engine: the compute
/// stream's worker thread calls it on an asynchronous group (`fsdp_local_group_create_async`),
/// and the call itself does on an eager one. CUDA engine: `cuLaunchHostFunc` on the compute
/// stream, so `func` makes no CUDA call and reads no device memory. Queued during a capture it
/// is captured, and called at each replay instead. Never waits for the stream (on an eager
/// group the call runs `func` itself before it returns).
///
/// `func` calls no `fsdp_engine_*` function of this engine but `fsdp_engine_counters`,
/// `fsdp_engine_memory` and `fsdp_engine_abort`: the engine's lock is held around an eager
/// group's call, and an asynchronous group's engine may wait for the stream that runs `func`.
///
/// # Safety
/// `func` may be called with `user_data` on another thread, once now or once per replay of a
/// capture that holds it; what `user_data` points to stays valid until the last such call
/// returned.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_launch_host_func(
    engine: *mut fsdp_engine,
    func: fsdp_host_func,
    user_data: *mut c_void,
) -> fsdp_status {
    boundary(|| {
        let func = func.ok_or_else(|| null("func"))?;
        on_engine(engine, |any| {
            // SAFETY: the caller's contract, which is `Engine::launch_host_func`'s.
            Ok(with_engine!(any, e => unsafe { e.launch_host_func(func, user_data) })?)
        })
    })
}

/// The address of `param`'s gathered values and their count and dtype, for work queued on the
/// compute stream: a host function on a CPU engine (`fsdp_engine_launch_host_func`; the address
/// is host memory), a kernel on a CUDA engine (as `fsdp_engine_param`'s). Valid in that work
/// while one of the parameter's unit's hooks is open; read only. Does not block, and is allowed
/// during a capture. (`fsdp_engine_param` is refused there: on a CPU engine it waits for the
/// stream, so that the host may read the values.)
///
/// # Safety
/// Each out-pointer is NULL or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_param_device(
    engine: *mut fsdp_engine,
    param: usize,
    data: *mut *const c_void,
    numel: *mut usize,
    dtype: *mut u32,
) -> fsdp_status {
    // SAFETY: the caller's contract.
    unsafe {
        param_view(
            engine,
            ParamId(param),
            (data, numel, dtype),
            ViewFor::Stream,
        )
    }
}

/// Hands over `param`'s gradient for this backward pass as `fsdp_engine_grad` does, read on the
/// compute stream after the work queued there so far, on either backend: on a CPU engine, host
/// memory that a host function queued before this call writes; on a CUDA engine, a device address
/// (as for `fsdp_engine_grad`). Does not block, and is allowed during a capture.
///
/// # Safety
/// `data` is NULL (with `numel` 0) or valid for `numel` elements of `dtype` until the compute
/// stream read them; after this call nothing writes them before then but work queued on the
/// compute stream after it. Handed over during a capture, it is read again at each replay, so it
/// stays valid, and is written only in stream order, while the captured step may be replayed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn fsdp_engine_grad_device(
    engine: *mut fsdp_engine,
    param: usize,
    data: *const c_void,
    numel: usize,
    dtype: u32,
) -> fsdp_status {
    boundary(|| -> Outcome {
        // SAFETY: the caller's contract.
        let input = unsafe { device_input(data, numel, dtype_of(dtype)?) }?;
        on_engine(engine, |any| {
            Ok(with_engine!(any, e => e.grad(ParamId(param), input))?)
        })
    })
}
