"""libfsdp_fusion.so through ctypes: where it is found, its C structs and its functions' types.

`library()` loads it once per path; `Library.call` raises the error of a failed status.
"""

from __future__ import annotations

import ctypes
import os
import threading
from ctypes import POINTER, c_bool, c_char_p, c_int, c_int64, c_size_t
from ctypes import c_uint8, c_uint32, c_uint64, c_void_p
from pathlib import Path

from .errors import FsdpError, UnavailableError, error_of

LIBRARY_ENV = "FSDP_FUSION_LIBRARY"
"""The variable naming libfsdp_fusion.so when no path is passed."""

LIBRARY_NAME = "libfsdp_fusion.so"

PACKAGED_NAME = "libfsdp_fusion.abi3.so"
"""The library as the package's build (setup.py) installs it beside the package's modules."""

ROOT = -1
"""The unit index of parameters outside every unit (`FSDP_ROOT`)."""

UNIQUE_ID_BYTES = 128

ABI_VERSION = 5
"""The C ABI (`FSDP_ABI_VERSION`) this package's structs and signatures follow."""


class ParamSpec(ctypes.Structure):
    _fields_ = [
        ("name", c_char_p),
        ("shape", POINTER(c_uint64)),
        ("ndim", c_size_t),
        ("dtype", c_uint32),
        ("unit", c_int64),
        ("trainable", c_uint8),
        ("tied", c_uint8),
        ("no_weight_decay", c_uint8),
        ("lr_scale", ctypes.c_float),
    ]


class Config(ctypes.Structure):
    _fields_ = [
        ("double_buffer_limit", c_size_t),
        ("max_reduces_in_flight", c_size_t),
        ("overlap", c_uint8),
        ("grad_reduction", c_uint32),
        ("optimizer", c_uint32),
        ("lr", ctypes.c_float),
        ("beta1", ctypes.c_float),
        ("beta2", ctypes.c_float),
        ("eps", ctypes.c_float),
        ("weight_decay", ctypes.c_float),
        ("timeout_seconds", ctypes.c_double),
        ("verify_collectives", c_uint8),
        ("grad_scale", ctypes.c_float),
        ("reduce_dtype", c_uint32),
        ("accumulation", c_uint32),
        ("param_storage", c_uint32),
        ("grad_shard_memory", c_uint32),
        ("moment_dtype", c_uint32),
        ("save_staging", c_uint8),
        ("step_in_backward", c_uint8),
    ]


class ParamInfo(ctypes.Structure):
    _fields_ = [
        ("numel", c_size_t),
        ("dtype", c_uint32),
        ("unit", c_int64),
        ("trainable", c_bool),
        ("group", c_size_t),
        ("offset", c_size_t),
        ("padded_numel", c_size_t),
    ]


class Grad(ctypes.Structure):
    """One entry of `fsdp_engine_grads`."""

    _fields_ = [("param", c_size_t), ("data", c_void_p), ("numel", c_size_t), ("dtype", c_uint32)]


class Memory(ctypes.Structure):
    """Bytes one rank allocates, as the plan predicts them (`fsdp_memory`)."""

    _fields_ = [
        (name, c_size_t)
        for name in (
            "param_shards",
            "grad_shards",
            "optimizer_state",
            "gathered_slots",
            "grad_slots",
            "grad_accumulators",
            "peak",
            "between_steps",
        )
    ]


class Counters(ctypes.Structure):
    """What the engine did so far (`fsdp_counters`)."""

    _fields_ = [
        (name, c_uint64)
        for name in (
            "all_gathers",
            "prefetches",
            "reuses",
            "evictions",
            "reduce_scatters",
            "extra_slots",
            "host_waits",
            "steps",
            "skipped_steps",
        )
    ]


class GradNorm(ctypes.Structure):
    """The whole model's gradient norms (`fsdp_grad_norm`)."""

    _fields_ = [("l2", ctypes.c_float), ("max", ctypes.c_float)]


_HANDLE = c_void_p
_OUT = POINTER(c_void_p)
_SIGNATURES = {
    "fsdp_last_error": ([], c_char_p),
    "fsdp_abi_version": ([], c_uint32),
    "fsdp_config_default": ([POINTER(Config)], c_int),
    "fsdp_plan_from_specs": ([POINTER(ParamSpec), c_size_t, c_size_t, _OUT], c_int),
    "fsdp_plan_from_json": ([c_char_p, c_size_t, _OUT], c_int),
    "fsdp_plan_destroy": ([_HANDLE], c_int),
    "fsdp_plan_param_info": ([_HANDLE, c_size_t, POINTER(ParamInfo)], c_int),
    "fsdp_local_group_create": ([c_size_t, _OUT], c_int),
    "fsdp_local_group_destroy": ([_HANDLE], c_int),
    "fsdp_engine_create_cpu": ([_HANDLE, POINTER(Config), _HANDLE, c_size_t, _OUT], c_int),
    "fsdp_nccl_unique_id": ([POINTER(c_uint8), c_size_t], c_int),
    "fsdp_engine_create_cuda_nccl": (
        [_HANDLE, POINTER(Config), c_int, POINTER(c_uint8), c_size_t, c_size_t, c_size_t,
         c_uint64, c_void_p, _OUT],
        c_int,
    ),
    "fsdp_loopback_group_create": ([c_size_t, _OUT], c_int),
    "fsdp_loopback_group_destroy": ([_HANDLE], c_int),
    "fsdp_engine_create_cuda_loopback": (
        [_HANDLE, POINTER(Config), c_int, _HANDLE, c_size_t, c_uint64, c_void_p, _OUT],
        c_int,
    ),
    "fsdp_engine_destroy": ([_HANDLE], c_int),
    "fsdp_engine_pre_forward": ([_HANDLE, c_int64], c_int),
    "fsdp_engine_post_forward": ([_HANDLE, c_int64], c_int),
    "fsdp_engine_pre_backward": ([_HANDLE, c_int64], c_int),
    "fsdp_engine_post_backward": ([_HANDLE, c_int64], c_int),
    "fsdp_engine_load_param": ([_HANDLE, c_size_t, c_void_p, c_size_t, c_uint32], c_int),
    "fsdp_engine_params": ([_HANDLE, POINTER(c_size_t), c_size_t, POINTER(c_void_p)], c_int),
    "fsdp_engine_param_device": (
        [_HANDLE, c_size_t, POINTER(c_void_p), POINTER(c_size_t), POINTER(c_uint32)],
        c_int,
    ),
    "fsdp_engine_grad": ([_HANDLE, c_size_t, c_void_p, c_size_t, c_uint32], c_int),
    "fsdp_engine_grads": ([_HANDLE, POINTER(Grad), c_size_t], c_int),
    "fsdp_engine_finish_grad_sync": ([_HANDLE], c_int),
    "fsdp_engine_optimizer_step": ([_HANDLE], c_int),
    "fsdp_engine_end_step": ([_HANDLE], c_int),
    "fsdp_engine_counters": ([_HANDLE, POINTER(Counters)], c_int),
    "fsdp_engine_save": ([_HANDLE, c_char_p], c_int),
    "fsdp_engine_load": ([_HANDLE, c_char_p], c_int),
    "fsdp_engine_save_async": ([_HANDLE, c_char_p], c_int),
    "fsdp_engine_wait_save": ([_HANDLE], c_int),
    "fsdp_engine_export_safetensors": ([_HANDLE, c_char_p], c_int),
    "fsdp_checkpoint_export_safetensors": ([c_char_p, c_char_p], c_int),
    "fsdp_engine_gather_group": ([_HANDLE, c_size_t, c_void_p, c_size_t, POINTER(c_size_t)],
                                 c_int),
    "fsdp_engine_import_safetensors": ([_HANDLE, c_char_p], c_int),
    "fsdp_engine_memory": ([_HANDLE, POINTER(c_size_t), POINTER(c_size_t)], c_int),
    "fsdp_plan_memory": ([_HANDLE, POINTER(Config), POINTER(Memory)], c_int),
    "fsdp_engine_nonfinite_grads": ([_HANDLE, POINTER(c_uint64)], c_int),
    "fsdp_engine_abort": ([_HANDLE], c_int),
    "fsdp_engine_set_lr": ([_HANDLE, ctypes.c_float], c_int),
    "fsdp_engine_set_weight_decay": ([_HANDLE, ctypes.c_float], c_int),
    "fsdp_engine_grad_norm": ([_HANDLE, POINTER(GradNorm)], c_int),
    "fsdp_engine_clip_grad_norm": ([_HANDLE, ctypes.c_float, POINTER(GradNorm)], c_int),
    "fsdp_engine_clip_grad_norm_on_device": ([_HANDLE, ctypes.c_float], c_int),
    "fsdp_engine_skip_nonfinite_on_device": ([_HANDLE], c_int),
    "fsdp_engine_read_device_skips": ([_HANDLE, POINTER(c_uint64)], c_int),
    "fsdp_engine_join_capture": ([_HANDLE], c_int),
    "fsdp_engine_leave_capture": ([_HANDLE], c_int),
    "fsdp_engine_abandon_capture": ([_HANDLE], c_int),
    "fsdp_engine_before_replay": ([_HANDLE], c_int),
    "fsdp_engine_replayed": ([_HANDLE], c_int),
    "fsdp_engine_param_shard": (
        [_HANDLE, c_size_t, c_void_p, c_size_t, POINTER(c_size_t)],
        c_int,
    ),
}


class Library:
    """libfsdp_fusion.so with typed functions, as attributes; `call` raises the error of a
    failed status."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._lib = ctypes.CDLL(os.fspath(path))
        except OSError as e:
            raise UnavailableError(f"{path} does not load: {e}") from e
        version = getattr(self._lib, "fsdp_abi_version", None)
        if version is None:
            raise UnavailableError(f"{path} has no fsdp_abi_version: a library older than this "
                                   "package")
        version.argtypes, version.restype = [], c_uint32
        if version() != ABI_VERSION:
            raise UnavailableError(f"{path} has C ABI {version()}, this package needs "
                                   f"{ABI_VERSION}: build the library and the package of one "
                                   "checkout")
        for name, (args, result) in _SIGNATURES.items():
            try:
                function = getattr(self._lib, name)
            except AttributeError as e:
                raise UnavailableError(f"{path} has no {name}: a library older than this "
                                       "package") from e
            function.argtypes, function.restype = args, result
            setattr(self, name, function)

    def call(self, name: str, *args) -> None:
        status = getattr(self, name)(*args)
        if status != 0:
            raise self.error(name, status)

    def error(self, name: str, status: int) -> FsdpError:
        """The error of `status` from `name`, with this thread's message from the library."""
        message = self.fsdp_last_error().decode("utf-8", "replace")
        return error_of(name, status, message)


def candidates(path: str | os.PathLike | None = None) -> list[Path]:
    """Where the library is looked for, in order: `path`, `$FSDP_FUSION_LIBRARY`, the one the
    package's build installed beside it, then `target/release` of the checkout holding the
    package and of the current directory."""
    if path is not None:
        return [Path(path)]
    if os.environ.get(LIBRARY_ENV):
        return [Path(os.environ[LIBRARY_ENV])]
    here = Path(__file__).resolve().parent
    return [here / PACKAGED_NAME,
            here.parents[1] / "target" / "release" / LIBRARY_NAME,
            Path.cwd() / "target" / "release" / LIBRARY_NAME]


_LOADED: dict[Path, Library] = {}
_LOADING = threading.Lock()


def library(path: str | os.PathLike | None = None) -> Library:
    """The library at the first of `candidates(path)` that exists, loaded once per process."""
    tried = candidates(path)
    found = next((p for p in tried if p.is_file()), None)
    if found is None:
        places = ", ".join(str(p) for p in tried)
        raise UnavailableError(f"{LIBRARY_NAME} not found (tried {places}): install the package "
                               f"from a checkout with `pip install ./python`, which builds it, or "
                               f"set {LIBRARY_ENV}")
    found = found.resolve()
    with _LOADING:
        if found not in _LOADED:
            _LOADED[found] = Library(found)
        return _LOADED[found]


class Releasing:
    """Something holding library handles that `close()` releases: at the end of a `with` block,
    or when collected."""

    def close(self):
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *_exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - nothing to report to at interpreter exit
            pass
