//! NVTX ranges around the engine's hooks, for Nsight Systems and Nsight Compute users: built with
//! the `nvtx` cargo feature, otherwise nothing. NVTX's C API is loaded at run time from the NVTX 3
//! interop library (the only one CUDA 13 ships) or the NVTX 2 library of older toolkits; without
//! either, no range. A profiler injects itself through whichever is loaded.

use std::fmt::Display;

#[cfg(feature = "nvtx")]
mod api {
    use std::ffi::{CString, c_char};
    use std::sync::OnceLock;

    /// `nvtxRangeStartA`: a range that may end on another thread, named by a C string.
    type Start = unsafe extern "C" fn(*const c_char) -> u64;
    /// `nvtxRangeEnd`.
    type End = unsafe extern "C" fn(u64);

    /// Libraries exporting NVTX's C API, in the order tried.
    const LIBRARIES: [&str; 4] = [
        "libnvtx3interop.so.1",
        "libnvtx3interop.so",
        "libnvToolsExt.so.1",
        "libnvToolsExt.so",
    ];

    struct Nvtx {
        start: Start,
        end: End,
        /// Keeps the functions above loaded.
        _library: libloading::Library,
    }

    fn load() -> Option<Nvtx> {
        LIBRARIES.into_iter().find_map(|name| {
            // SAFETY: NVTX's libraries run no initialisation that the process relies on.
            let library = unsafe { libloading::Library::new(name) }.ok()?;
            // SAFETY: the symbols have these C signatures in every NVTX version.
            let start = unsafe { library.get::<Start>(b"nvtxRangeStartA\0") }.ok()?;
            // SAFETY: as above.
            let end = unsafe { library.get::<End>(b"nvtxRangeEnd\0") }.ok()?;
            Some(Nvtx {
                start: *start,
                end: *end,
                _library: library,
            })
        })
    }

    fn nvtx() -> Option<&'static Nvtx> {
        static NVTX: OnceLock<Option<Nvtx>> = OnceLock::new();
        NVTX.get_or_init(load).as_ref()
    }

    /// An open range; it ends when dropped.
    pub(crate) struct Range {
        id: u64,
        end: End,
    }

    impl Drop for Range {
        fn drop(&mut self) {
            // SAFETY: `id` came from this library's `nvtxRangeStartA`, and is ended once.
            unsafe { (self.end)(self.id) }
        }
    }

    /// A range named `name`; `None` without an NVTX library, or for a name with a NUL.
    pub(crate) fn start(name: String) -> Option<Range> {
        let nvtx = nvtx()?;
        let name = CString::new(name).ok()?;
        // SAFETY: `name` is a NUL-terminated string that outlives the call (NVTX copies it).
        let id = unsafe { (nvtx.start)(name.as_ptr()) };
        Some(Range { id, end: nvtx.end })
    }
}

/// A range named `what` and `unit`, open until the returned guard drops.
#[cfg(feature = "nvtx")]
pub(crate) fn range(what: &str, unit: impl Display) -> Option<api::Range> {
    api::start(format!("{what} {unit}"))
}

/// Without the `nvtx` feature: a guard that marks nothing.
#[cfg(not(feature = "nvtx"))]
pub(crate) struct NoRange;

#[cfg(not(feature = "nvtx"))]
pub(crate) fn range(_what: &str, _unit: impl Display) -> NoRange {
    NoRange
}
