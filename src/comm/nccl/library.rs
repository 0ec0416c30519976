//! libnccl, found and opened here rather than by cudarc.
//!
//! cudarc's own loader tries fixed names (`libnccl.so`, `libnccl.so.<CUDA major>`, ...) but not
//! `libnccl.so.2`, the only name the pip wheels (`nvidia-nccl-cu12/13`) and the runtime packages
//! install, and it panics when no name loads or a symbol is missing. Loading it first under
//! another name does not help: the dynamic linker matches a later `dlopen("libnccl.so")` against
//! loaded libraries by that exact name or their SONAME (`libnccl.so.2`), and reads
//! `LD_LIBRARY_PATH` only at process start. So this module opens the library itself and resolves
//! the few functions the crate calls, typed with cudarc's NCCL bindings; any failure is an
//! `Error::NcclUnavailable`, never a panic.

use std::ffi::{OsStr, OsString, c_char, c_int, c_void};
use std::sync::OnceLock;

use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclUniqueId};
use libloading::Library;

use crate::error::{Error, Result};

/// The variable naming the NCCL library to load, as a path or a file name, instead of the
/// default names. Read once, at the first NCCL call of the process.
pub const NCCL_LIBRARY_ENV: &str = "FSDP_NCCL_LIBRARY";

/// Names tried in order when the variable is unset: the runtime name (system packages, pip
/// wheels, the copy PyTorch already loaded), then the development symlink.
const DEFAULT_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// The names to try: the variable's value alone when set, so a wrong path is an error rather than
/// a silent fallback to another library.
pub(super) fn candidates(env: Option<OsString>) -> Vec<OsString> {
    match env {
        Some(path) if !path.is_empty() => vec![path],
        _ => DEFAULT_NAMES.iter().map(OsString::from).collect(),
    }
}

/// An `ncclResult_t` read as a plain integer, so that a code newer than cudarc's enum stays a
/// number instead of an invalid enum value.
pub(super) type NcclStatus = c_int;

/// An `ncclRedOp_t` as a plain integer: the operators NCCL creates (`ncclRedOpCreatePreMulSum`)
/// are values past cudarc's enum.
pub(super) type NcclRedOp = c_int;

/// `ncclSum`.
pub(super) const NCCL_SUM: NcclRedOp = 0;

/// `ncclScalarHostImmediate`: the scalar is read from host memory during the call.
pub(super) const NCCL_SCALAR_HOST_IMMEDIATE: c_int = 1;

/// `ncclInProgress`: a nonblocking communicator's call is still under way.
pub(super) const NCCL_IN_PROGRESS: NcclStatus = 7;

/// `NCCL_CONFIG_UNDEF_INT`: a setting left to NCCL.
const UNDEF_INT: c_int = c_int::MIN;

/// `ncclConfig_t` as NCCL 2.14 defined it, the first version with nonblocking communicators.
/// NCCL reads a config by the version it names, so this prefix serves every later library too
/// (cudarc's binding is the layout of one newer version, which an older library would misread).
#[repr(C)]
pub(super) struct NcclConfig {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
}

impl NcclConfig {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: calls return at once (`ncclInProgress`)
    /// and their end is polled, so every wait keeps a deadline. Each communicator takes at most
    /// half the current device's multiprocessors (`maxCTAs`): a rank's two communicators run
    /// on two streams, and NCCL does not promise that two communicators' kernels make progress
    /// together; with each bounded to half the device, both always fit on it at once, so
    /// neither's kernels can wait for a peer behind the other's. (NCCL's own default of at
    /// most 32 or 64 is already below half of a datacenter GPU's; the bound is for smaller
    /// ones.)
    pub(super) fn nonblocking() -> NcclConfig {
        NcclConfig {
            size: std::mem::size_of::<NcclConfig>(),
            magic: 0xcafe_beef,
            version: 21400,
            blocking: 0,
            cga_cluster_size: UNDEF_INT,
            min_ctas: UNDEF_INT,
            max_ctas: half_the_multiprocessors().unwrap_or(UNDEF_INT),
            net_name: std::ptr::null(),
        }
    }
}

/// Half the multiprocessors of the calling thread's current device, at least 1.
fn half_the_multiprocessors() -> Option<c_int> {
    use cudarc::driver::{result, sys};
    let mut device = 0;
    // SAFETY: writes one device ordinal; fails without a current context.
    let found = unsafe { sys::cuCtxGetDevice(&mut device) };
    if found != sys::CUresult::CUDA_SUCCESS {
        return None;
    }
    let attribute = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
    // SAFETY: `device` came from the driver above.
    let count = unsafe { result::device::get_attribute(device, attribute) }.ok()?;
    Some((count / 2).max(1))
}

/// The functions the crate calls, with the C signatures of `nccl.h` (2.18 or later).
pub(super) struct Nccl {
    pub(super) get_version: unsafe extern "C" fn(*mut c_int) -> NcclStatus,
    pub(super) get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> NcclStatus,
    pub(super) comm_init_rank_config: unsafe extern "C" fn(
        *mut ncclComm_t,
        c_int,
        ncclUniqueId,
        c_int,
        *mut NcclConfig,
    ) -> NcclStatus,
    pub(super) comm_split: unsafe extern "C" fn(
        ncclComm_t,
        c_int,
        c_int,
        *mut ncclComm_t,
        *mut NcclConfig,
    ) -> NcclStatus,
    pub(super) comm_get_async_error:
        unsafe extern "C" fn(ncclComm_t, *mut NcclStatus) -> NcclStatus,
    pub(super) comm_finalize: unsafe extern "C" fn(ncclComm_t) -> NcclStatus,
    pub(super) comm_count: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> NcclStatus,
    pub(super) comm_user_rank: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> NcclStatus,
    pub(super) comm_abort: unsafe extern "C" fn(ncclComm_t) -> NcclStatus,
    pub(super) comm_destroy: unsafe extern "C" fn(ncclComm_t) -> NcclStatus,
    pub(super) all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclComm_t,
        cudaStream_t,
    ) -> NcclStatus,
    pub(super) reduce_scatter: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        NcclRedOp,
        ncclComm_t,
        cudaStream_t,
    ) -> NcclStatus,
    pub(super) all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        NcclRedOp,
        ncclComm_t,
        cudaStream_t,
    ) -> NcclStatus,
    pub(super) red_op_create_pre_mul_sum: unsafe extern "C" fn(
        *mut NcclRedOp,
        *mut c_void,
        ncclDataType_t,
        c_int,
        ncclComm_t,
    ) -> NcclStatus,
    pub(super) red_op_destroy: unsafe extern "C" fn(NcclRedOp, ncclComm_t) -> NcclStatus,
    pub(super) group_start: unsafe extern "C" fn() -> NcclStatus,
    pub(super) group_end: unsafe extern "C" fn() -> NcclStatus,
    pub(super) get_error_string: unsafe extern "C" fn(NcclStatus) -> *const c_char,
    pub(super) get_last_error: unsafe extern "C" fn(ncclComm_t) -> *const c_char,
    /// Keeps the functions above loaded; never unloaded, since `Nccl` lives in a static.
    _library: Library,
}

/// The process's NCCL, loaded on first use.
pub(super) fn nccl() -> Result<&'static Nccl> {
    static NCCL: OnceLock<Result<Nccl, String>> = OnceLock::new();
    NCCL.get_or_init(|| open(candidates(std::env::var_os(NCCL_LIBRARY_ENV))))
        .as_ref()
        .map_err(|reason| Error::NcclUnavailable {
            reason: reason.clone(),
        })
}

fn open(candidates: Vec<OsString>) -> Result<Nccl, String> {
    let mut tried = Vec::with_capacity(candidates.len());
    for name in &candidates {
        // SAFETY: loading runs libnccl's initializers, which only set up its own state.
        match unsafe { Library::new(name.as_os_str()) } {
            Ok(library) => return resolve(library, name),
            Err(e) => tried.push(format!("{}: {e}", name.to_string_lossy())),
        }
    }
    Err(format!(
        "libnccl could not be loaded (set {NCCL_LIBRARY_ENV} to its path): {}",
        tried.join("; ")
    ))
}

fn resolve(library: Library, name: &OsStr) -> Result<Nccl, String> {
    /// Copies one function pointer out of the library.
    ///
    /// # Safety
    /// `T` is the function's C signature.
    unsafe fn get<T: Copy>(library: &Library, name: &OsStr, symbol: &str) -> Result<T, String> {
        // SAFETY: the caller gives the C signature; the pointer stays valid while `library` is
        // loaded, which `Nccl` guarantees by owning it.
        unsafe { library.get::<T>(symbol) }
            .map(|f| *f)
            .map_err(|e| format!("{} lacks {symbol}: {e}", name.to_string_lossy()))
    }
    // SAFETY: each type below is the C signature of its function in nccl.h (2.18 or later).
    unsafe {
        Ok(Nccl {
            get_version: get(&library, name, "ncclGetVersion")?,
            get_unique_id: get(&library, name, "ncclGetUniqueId")?,
            comm_init_rank_config: get(&library, name, "ncclCommInitRankConfig")?,
            comm_split: get(&library, name, "ncclCommSplit")?,
            comm_get_async_error: get(&library, name, "ncclCommGetAsyncError")?,
            comm_finalize: get(&library, name, "ncclCommFinalize")?,
            comm_count: get(&library, name, "ncclCommCount")?,
            comm_user_rank: get(&library, name, "ncclCommUserRank")?,
            comm_abort: get(&library, name, "ncclCommAbort")?,
            comm_destroy: get(&library, name, "ncclCommDestroy")?,
            all_gather: get(&library, name, "ncclAllGather")?,
            reduce_scatter: get(&library, name, "ncclReduceScatter")?,
            all_reduce: get(&library, name, "ncclAllReduce")?,
            red_op_create_pre_mul_sum: get(&library, name, "ncclRedOpCreatePreMulSum")?,
            red_op_destroy: get(&library, name, "ncclRedOpDestroy")?,
            group_start: get(&library, name, "ncclGroupStart")?,
            group_end: get(&library, name, "ncclGroupEnd")?,
            get_error_string: get(&library, name, "ncclGetErrorString")?,
            get_last_error: get(&library, name, "ncclGetLastError")?,
            _library: library,
        })
    }
}

impl Nccl {
    /// Turns the status of `call` into a result; an error carries NCCL's code, its description
    /// and the last error NCCL logged for `comm` (null for calls outside a communicator).
    pub(super) fn check(
        &self,
        call: &'static str,
        status: NcclStatus,
        comm: ncclComm_t,
    ) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: both return static or thread-local strings owned by NCCL, or null.
        let (text, last) =
            unsafe { ((self.get_error_string)(status), (self.get_last_error)(comm)) };
        let mut message = c_text(text).unwrap_or_else(|| "unknown NCCL error".into());
        if let Some(last) = c_text(last).filter(|l| !l.is_empty()) {
            message = format!("{message}: {last}");
        }
        Err(Error::Nccl {
            call,
            code: status,
            message,
        })
    }
}

/// A C string NCCL returned, if any.
fn c_text(text: *const c_char) -> Option<String> {
    // SAFETY: NCCL returns null or a NUL-terminated string that outlives this call.
    (!text.is_null()).then(|| {
        unsafe { std::ffi::CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn a_communicator_takes_at_most_half_the_multiprocessors() {
        use cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        let ctx = crate::backend::cuda::primary_context(0).unwrap();
        crate::backend::cuda::bind(&ctx).unwrap();
        let count = ctx
            .attribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .unwrap();
        let config = NcclConfig::nonblocking();
        assert_eq!(config.blocking, 0);
        assert!(
            config.max_ctas >= 1 && 2 * config.max_ctas <= count,
            "maxCTAs {} of {count} multiprocessors",
            config.max_ctas
        );
    }

    #[test]
    fn the_runtime_name_is_tried_before_the_development_symlink() {
        assert_eq!(
            candidates(None),
            vec![OsString::from("libnccl.so.2"), OsString::from("libnccl.so")]
        );
        assert_eq!(candidates(Some(OsString::new())), candidates(None));
    }

    #[test]
    fn the_variable_names_the_only_library_tried() {
        let path = OsString::from("/opt/site-packages/nvidia/nccl/lib/libnccl.so.2");
        assert_eq!(candidates(Some(path.clone())), vec![path]);
    }

    #[test]
    fn a_library_that_is_nowhere_is_an_error_naming_every_attempt() {
        let missing = OsString::from("/nonexistent/libnccl.so.2");
        let Err(reason) = open(vec![missing]) else {
            panic!("a nonexistent path loaded");
        };
        assert!(reason.contains("/nonexistent/libnccl.so.2"), "{reason}");
        assert!(reason.contains(NCCL_LIBRARY_ENV), "{reason}");
    }

    #[test]
    fn a_library_without_the_functions_is_an_error_naming_the_first_missing_one() {
        let Err(reason) = open(vec![OsString::from("libm.so.6")]) else {
            panic!("libm passed for libnccl");
        };
        assert!(
            reason.contains("libm.so.6 lacks ncclGetVersion"),
            "{reason}"
        );
    }
}
