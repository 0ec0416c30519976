//! NVTX ranges around the engine's hooks, for Nsight Systems users: built with the `nvtx` cargo
//! feature, otherwise nothing. The NVTX library is loaded at run time; without it, no range.

use std::fmt::Display;

/// A range named `what` and `unit`, open until the returned guard drops.
#[cfg(feature = "nvtx")]
pub(crate) fn range(what: &str, unit: impl Display) -> Option<cudarc::nvtx::Range> {
    use std::sync::OnceLock;
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only opens and closes the NVTX library under cudarc's candidate names.
    let present = *PRESENT.get_or_init(|| unsafe { cudarc::nvtx::sys::is_culib_present() });
    present.then(|| cudarc::nvtx::scoped_range(format!("{what} {unit}")))
}

/// Without the `nvtx` feature: a guard that marks nothing.
#[cfg(not(feature = "nvtx"))]
pub(crate) struct NoRange;

#[cfg(not(feature = "nvtx"))]
pub(crate) fn range(_what: &str, _unit: impl Display) -> NoRange {
    NoRange
}
