//! The CUDA driver as this crate meets it: whether it is installed, its errors, its contexts.

use std::sync::{Arc, OnceLock};

use cudarc::driver::CudaContext;
use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys::CUresult;

use crate::error::{Error, Result};

/// Whether the NVIDIA driver library (`libcuda.so`) can be loaded. Checked once: cudarc panics on
/// the first driver call when the library is missing, so every constructor asks this first.
pub fn is_driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only opens and closes the driver library under cudarc's candidate names.
    *PRESENT.get_or_init(|| unsafe { cudarc::driver::sys::is_culib_present() })
}

pub(crate) fn ensure_driver() -> Result<()> {
    if is_driver_present() {
        Ok(())
    } else {
        Err(Error::CudaUnavailable {
            reason:
                "the NVIDIA driver library (libcuda.so) was not found on the library search path"
                    .into(),
        })
    }
}

/// Turns a driver error of `call` into the crate's error, with the driver's own description.
pub(crate) fn cuda(call: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Cuda {
        call,
        code: e.0 as i32,
        message: e
            .error_string()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0)),
    }
}

/// An error of `call` the driver did not report but this crate detected, in the driver's terms.
pub(crate) fn cuda_error(call: &'static str, code: CUresult, message: String) -> Error {
    Error::Cuda {
        call,
        code: code as i32,
        message,
    }
}

/// Device `ordinal`'s primary context, the one the CUDA runtime (PyTorch, NCCL) uses too.
pub(crate) fn primary_context(ordinal: usize) -> Result<Arc<CudaContext>> {
    ensure_driver()?;
    result::init().map_err(cuda("cuInit"))?;
    let count = result::device::get_count().map_err(cuda("cuDeviceGetCount"))?;
    if ordinal >= usize::try_from(count).unwrap_or(0) {
        return Err(cuda_error(
            "cuDeviceGet",
            CUresult::CUDA_ERROR_INVALID_DEVICE,
            format!("device {ordinal} does not exist: the driver sees {count} device(s)"),
        ));
    }
    let ctx = CudaContext::new(ordinal).map_err(cuda("cuDevicePrimaryCtxRetain"))?;
    untrack(&ctx);
    Ok(ctx)
}

/// Turns off cudarc's per-slice event tracking on `ctx`, a handle of this crate's own: this crate
/// orders its streams with its own events, and with tracking on cudarc would also synchronize the
/// whole context (a host wait) when the first extra stream is created. A caller's own handles of
/// the same context keep their tracking.
fn untrack(ctx: &CudaContext) {
    // SAFETY: this crate allocates no cudarc `CudaSlice`, so no slice of ours relies on tracking.
    unsafe { ctx.disable_event_tracking() };
}

/// Makes `ctx` current on the calling thread: raw driver calls act on the current context.
pub(crate) fn bind(ctx: &CudaContext) -> Result<()> {
    ctx.bind_to_thread().map_err(cuda("cuCtxSetCurrent"))
}
