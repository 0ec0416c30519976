"""The errors of fsdp_fusion: one class per status of the C API, all of them `FsdpError`.

A failed call into the library raises the class of its status, with the function, the status
name and the library's message; a bad argument found before any call raises
`InvalidArgumentError` (also a `ValueError`).
"""

from __future__ import annotations


class FsdpError(RuntimeError):
    """A failure of fsdp_fusion. `function` and `status` name the C call and its status (None
    when the package refused an argument before calling the library)."""

    def __init__(self, message: str, function: str | None = None, status: str | None = None):
        super().__init__(message)
        self.function = function
        self.status = status


class NullPointerError(FsdpError):
    """FSDP_NULL_POINTER: a required pointer was NULL (a bug of this package)."""


class InvalidHandleError(FsdpError):
    """FSDP_INVALID_HANDLE: a handle that was destroyed or never made."""


class InvalidArgumentError(FsdpError, ValueError):
    """FSDP_INVALID_ARGUMENT: a value the engine cannot take (a shape, a dtype, a size)."""


class MisuseError(FsdpError):
    """FSDP_MISUSE: a call out of order (a hook, a gradient, a step); the engine is unchanged."""


class UnavailableError(FsdpError):
    """FSDP_UNAVAILABLE: CUDA, its kernels or NCCL are missing."""


class DeviceError(FsdpError):
    """FSDP_DEVICE_ERROR: the device failed; the engine is poisoned."""


class CommError(FsdpError):
    """FSDP_COMM_ERROR: a collective failed, a peer left, or the ranks' collectives differ."""


class IoError(FsdpError):
    """FSDP_IO_ERROR: a file could not be read or written."""


class PanicError(FsdpError):
    """FSDP_PANIC: a bug inside the library; the engine is poisoned and left its group."""


class OutOfMemoryError(FsdpError, MemoryError):
    """FSDP_OUT_OF_MEMORY: a host or device allocation failed. Making a wrapper: nothing
    changed, a smaller configuration can be tried; a per-step gradient shard refused during a
    backward poisons the engine."""


class FsdpTimeoutError(FsdpError, TimeoutError):
    """FSDP_TIMEOUT: a wait ran past the engine's timeout (a peer that never came, a stalled
    device); the engine is poisoned, except from `wait_save` while a rank's files are still
    being written (the save stays pending: call again)."""


class AbortedError(FsdpError):
    """FSDP_ABORTED: the engine was aborted (`FusedFSDP.abort`) while or before it waited."""


class PoisonedError(FsdpError):
    """FSDP_POISONED: an earlier failure poisoned the engine; only closing it still works."""


# In the order of the C API's status codes (FSDP_OK = 0 first).
STATUS_ERRORS: list[tuple[str, type[FsdpError] | None]] = [
    ("FSDP_OK", None),
    ("FSDP_NULL_POINTER", NullPointerError),
    ("FSDP_INVALID_HANDLE", InvalidHandleError),
    ("FSDP_INVALID_ARGUMENT", InvalidArgumentError),
    ("FSDP_MISUSE", MisuseError),
    ("FSDP_UNAVAILABLE", UnavailableError),
    ("FSDP_DEVICE_ERROR", DeviceError),
    ("FSDP_COMM_ERROR", CommError),
    ("FSDP_IO_ERROR", IoError),
    ("FSDP_PANIC", PanicError),
    ("FSDP_OUT_OF_MEMORY", OutOfMemoryError),
    ("FSDP_TIMEOUT", FsdpTimeoutError),
    ("FSDP_ABORTED", AbortedError),
    ("FSDP_POISONED", PoisonedError),
]


def error_of(function: str, status: int, message: str) -> FsdpError:
    """The error a failed call raises."""
    if 0 < status < len(STATUS_ERRORS):
        name, cls = STATUS_ERRORS[status]
    else:
        name, cls = f"status {status}", FsdpError
    return cls(f"{function}: {name}: {message}", function, name)
