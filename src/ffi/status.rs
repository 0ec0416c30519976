//! Statuses and messages: every exported function returns an [`fsdp_status`] and leaves its
//! message for [`fsdp_last_error`]; its body runs inside [`boundary`], which catches panics.

use std::cell::RefCell;
use std::ffi::{CStr, CString, c_char};
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::error::Error;

/// The outcome of a call.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum fsdp_status {
    FSDP_OK = 0,
    /// A required pointer argument was NULL.
    FSDP_NULL_POINTER = 1,
    /// A handle that is not live, or of the wrong kind.
    FSDP_INVALID_HANDLE = 2,
    /// A bad value: size, dtype, name, shape, configuration, model file contents, a launch
    /// environment variable; or ranks whose plans differ.
    FSDP_INVALID_ARGUMENT = 3,
    /// A call out of order: hooks, gradients, steps. Nothing changed, unless the call says
    /// otherwise.
    FSDP_MISUSE = 4,
    /// CUDA, its kernels or NCCL are not available.
    FSDP_UNAVAILABLE = 5,
    /// The device failed (the engine is poisoned, unless the call says otherwise).
    FSDP_DEVICE_ERROR = 6,
    /// A collective failed: ranks that issued different collectives, a peer that left (the engine
    /// is poisoned); or the unique id exchange of a launch from the environment failed.
    FSDP_COMM_ERROR = 7,
    /// A file could not be read or written.
    FSDP_IO_ERROR = 8,
    /// The library panicked. A panic inside an engine's work poisons the engine, which leaves
    /// its group; one around it (checking the call's arguments, reporting its outcome) leaves
    /// the engine as it was, unless it held the engine's lock, after which every call on it
    /// returns `FSDP_PANIC`: destroy it.
    FSDP_PANIC = 9,
    /// Too little host or device memory: nothing was half-built where a call allocates up front
    /// (making an engine); a per-step gradient shard refused inside a step poisons the engine.
    FSDP_OUT_OF_MEMORY = 10,
    /// A wait passed the engine's deadline (`fsdp_config.timeout_seconds`); the engine is
    /// poisoned, unless the call says otherwise (`fsdp_engine_wait_save` while a rank's files
    /// are still being written).
    FSDP_TIMEOUT = 11,
    /// The engine was aborted (`fsdp_engine_abort`, or `fsdp_engine_destroy` from another
    /// thread).
    FSDP_ABORTED = 12,
    /// An earlier failure poisoned the engine: only `fsdp_engine_destroy` (and reading its
    /// counters and memory) still works; the message names the first failure.
    FSDP_POISONED = 13,
}

/// A failed call: its status and message.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) status: fsdp_status,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(status: fsdp_status, message: String) -> Failure {
        Failure { status, message }
    }
}

/// The status an error is reported with.
pub(crate) fn status_of(e: &Error) -> fsdp_status {
    use fsdp_status::*;
    match e {
        Error::ModelFile { .. } | Error::Write { .. } | Error::CheckpointUnreadable { .. } => {
            FSDP_IO_ERROR
        }
        Error::NotUtf8 { .. }
        | Error::Json { .. }
        | Error::EmptyModel
        | Error::EmptyName { .. }
        | Error::NulInName { .. }
        | Error::DuplicateName { .. }
        | Error::NumelOverflow { .. }
        | Error::UnknownDtype { .. }
        | Error::ZeroWorldSize
        | Error::InvalidProcessGroup { .. }
        | Error::UnknownProcessGroup { .. }
        | Error::ProcessGroupMismatch { .. }
        | Error::RankOutOfRange { .. }
        | Error::LayoutOverflow { .. }
        | Error::SizeOverflow { .. }
        | Error::InvalidConfig { .. }
        | Error::WorldSizeMismatch { .. }
        | Error::ReplicasMismatch { .. }
        | Error::UnknownParam { .. }
        | Error::ParamIdOutOfRange { .. }
        | Error::GroupOutOfRange { .. }
        | Error::GradientLength { .. }
        | Error::InvalidLrScale { .. }
        | Error::GradientDtype { .. }
        | Error::DataLength { .. }
        | Error::PartialElement { .. }
        | Error::DtypeMismatch { .. }
        | Error::PlanMismatch { .. }
        | Error::SettingsMismatch { .. }
        | Error::CheckpointMismatch { .. }
        | Error::CheckpointExists { .. }
        | Error::EmptyPath { .. }
        | Error::ReservedName { .. }
        | Error::LaunchEnv { .. }
        | Error::OutOfRange { .. } => FSDP_INVALID_ARGUMENT,
        Error::UnknownUnit { .. }
        | Error::ForwardAlreadyOpen { .. }
        | Error::ForwardNotOpen { .. }
        | Error::BackwardAlreadyOpen { .. }
        | Error::BackwardNotOpen { .. }
        | Error::ForwardStillOpen { .. }
        | Error::BackwardStillOpen { .. }
        | Error::FrozenGradient { .. }
        | Error::DuplicateGradient { .. }
        | Error::GradSlotOpen { .. }
        | Error::GradSlotNotOpen { .. }
        | Error::GradSlotUnavailable { .. }
        | Error::GradsNotSynced { .. }
        | Error::NotGathered { .. }
        | Error::OptimizerAlreadyStepped
        | Error::OptimizerStepped { .. }
        | Error::GradientsDecided { .. }
        | Error::StepInBackward { .. }
        | Error::GradientAfterItsUnit { .. }
        | Error::MidStep { .. }
        | Error::SavePending { .. }
        | Error::ForbiddenTransition { .. }
        | Error::Capture { .. } => FSDP_MISUSE,
        Error::CudaUnavailable { .. }
        | Error::KernelsUnavailable
        | Error::NcclUnavailable { .. }
        | Error::Unsupported { .. } => FSDP_UNAVAILABLE,
        Error::Cuda { .. }
        | Error::BadAllocation { .. }
        | Error::Spawn { .. }
        | Error::WorkerPanicked { .. } => FSDP_DEVICE_ERROR,
        Error::Nccl { .. }
        | Error::CollectiveMismatch { .. }
        | Error::CollectivesCrossed { .. }
        | Error::PeerGone { .. }
        | Error::Rendezvous { .. }
        | Error::RankPanicked { .. } => FSDP_COMM_ERROR,
        Error::Panicked { .. } => FSDP_PANIC,
        Error::OutOfMemory { .. } => FSDP_OUT_OF_MEMORY,
        Error::Timeout { .. } | Error::CollectiveTimedOut { .. } => FSDP_TIMEOUT,
        Error::Aborted => FSDP_ABORTED,
        Error::Poisoned { .. } => FSDP_POISONED,
        Error::StreamFailed { cause, .. } => status_of(cause),
        Error::PeerRefused { cause, .. } => status_of(cause),
    }
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure::new(status_of(&e), e.to_string())
    }
}

pub(crate) type Outcome<T = ()> = Result<T, Failure>;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn remember(message: String) {
    // A message with a NUL in it keeps what comes before the NUL.
    let message = CString::new(message).unwrap_or_else(|e| {
        let end = e.nul_position();
        CString::new(&e.into_vec()[..end]).unwrap_or_default()
    });
    // Gone at the thread's exit (a destructor's call then): the message is dropped.
    let _ = LAST_ERROR.try_with(|m| *m.borrow_mut() = message);
}

/// What a caught panic said.
pub(crate) fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".to_string())
}

/// Runs the body of an exported function: its failure or panic becomes a status and a message.
pub(crate) fn boundary(body: impl FnOnce() -> Outcome) -> fsdp_status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => fsdp_status::FSDP_OK,
        Ok(Err(failure)) => {
            remember(failure.message);
            failure.status
        }
        Err(payload) => {
            remember(format!(
                "panic inside fsdp-fusion: {}",
                panic_message(&*payload)
            ));
            fsdp_status::FSDP_PANIC
        }
    }
}

pub(crate) fn null(what: &str) -> Failure {
    Failure::new(fsdp_status::FSDP_NULL_POINTER, format!("{what} is NULL"))
}

pub(crate) fn invalid(message: String) -> Failure {
    Failure::new(fsdp_status::FSDP_INVALID_ARGUMENT, message)
}

/// `count` values of `T` at `ptr` from C: empty for `count` 0 (whatever `ptr`); else `ptr` must
/// not be NULL, must be aligned for `T`, and the values must span at most `isize::MAX` bytes
/// (what a slice can), each refused with a status rather than taken.
///
/// # Safety
/// `ptr` is NULL or valid for `count` reads of `T` for the returned lifetime.
pub(crate) unsafe fn caller_slice<'a, T>(
    ptr: *const T,
    count: usize,
    what: &str,
) -> Outcome<&'a [T]> {
    if count == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(null(what));
    }
    if !ptr.is_aligned() {
        return Err(invalid(format!(
            "{what} is not aligned to {} bytes",
            std::mem::align_of::<T>()
        )));
    }
    let fits = count
        .checked_mul(std::mem::size_of::<T>())
        .is_some_and(|bytes| isize::try_from(bytes).is_ok());
    if !fits {
        return Err(invalid(format!(
            "{what}: {count} values of {} bytes are more than memory holds",
            std::mem::size_of::<T>()
        )));
    }
    // SAFETY: non-null, aligned, at most isize::MAX bytes; valid for `count` reads by the
    // caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(ptr, count) })
}

/// Writes `value` through an out-pointer checked for NULL.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
pub(crate) unsafe fn put<T>(out: *mut T, what: &'static str, value: T) -> Outcome {
    if out.is_null() {
        return Err(null(what));
    }
    // SAFETY: checked non-null; the caller guarantees it is valid for a write.
    unsafe { out.write(value) };
    Ok(())
}

/// # Safety
/// `s` is NULL or a NUL-terminated string.
pub(crate) unsafe fn text<'a>(s: *const c_char, what: &str) -> Outcome<&'a str> {
    if s.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map_err(|_| invalid(format!("{what} is not UTF-8")))
}

/// A path from C: its bytes as they are (a file name need not be UTF-8).
///
/// # Safety
/// `s` is NULL or a NUL-terminated string.
pub(crate) unsafe fn file_path<'a>(s: *const c_char, what: &str) -> Outcome<&'a std::path::Path> {
    if s.is_null() {
        return Err(null(what));
    }
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    let bytes = unsafe { CStr::from_ptr(s) }.to_bytes();
    Ok(std::path::Path::new(
        <std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(bytes),
    ))
}

/// The version of the C ABI this header describes: the layout of every struct and the
/// parameters of every function. It changes with each of them; a caller compares it with its
/// own `FSDP_ABI_VERSION` before any other call, so that a library and a caller of different
/// versions never exchange structs.
pub const FSDP_ABI_VERSION: u32 = 5;

/// The library's `FSDP_ABI_VERSION`.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_abi_version() -> u32 {
    FSDP_ABI_VERSION
}

/// The calling thread's message for its last failed call; never NULL. The string stays valid
/// until the thread's next failed call.
#[unsafe(no_mangle)]
pub extern "C" fn fsdp_last_error() -> *const c_char {
    LAST_ERROR
        .try_with(|m| m.borrow().as_ptr())
        .unwrap_or(c"".as_ptr())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        // SAFETY: fsdp_last_error never returns NULL and its string is NUL-terminated.
        unsafe { CStr::from_ptr(fsdp_last_error()) }
            .to_str()
            .unwrap()
            .to_string()
    }

    #[test]
    fn a_panic_becomes_a_status_and_a_message() {
        let status = boundary(|| panic!("deliberate"));
        assert_eq!(status, fsdp_status::FSDP_PANIC);
        assert_eq!(last_error(), "panic inside fsdp-fusion: deliberate");
    }

    #[test]
    fn messages_with_a_nul_keep_their_start() {
        remember("before\0after".to_string());
        assert_eq!(last_error(), "before");
    }

    #[test]
    fn a_failed_stream_reports_its_cause_s_status() {
        let cause = Error::Timeout {
            op: "x".into(),
            waited: std::time::Duration::ZERO,
        };
        let failed = Error::StreamFailed {
            stream: crate::types::Stream::Reduce,
            cause: std::sync::Arc::new(cause),
        };
        assert_eq!(status_of(&failed), fsdp_status::FSDP_TIMEOUT);
    }
}
