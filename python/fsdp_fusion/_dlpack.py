"""Engine memory as torch tensors through DLPack: no copy, no NumPy, host and device memory alike,
and bf16 is a DLPack type (the CUDA array interface has none)."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_char_p, c_int32, c_int64, c_uint8, c_uint16, c_uint64, c_void_p

import torch


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", _DLDevice),
        ("ndim", c_int32),
        ("dtype", _DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),
        ("byte_offset", c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", c_void_p), ("deleter", c_void_p)]


class _Export(ctypes.Structure):
    """A 1-D DLPack tensor with its shape and stride beside it."""

    _fields_ = [("managed", _DLManagedTensor), ("shape", c_int64), ("stride", c_int64)]


_DL_DEVICES = {"cpu": 1, "cuda": 2}  # kDLCPU, kDLCUDA
_DL_DTYPES = {torch.float32: (2, 32), torch.float16: (2, 16), torch.bfloat16: (4, 16)}
_DLTENSOR = b"dltensor"  # the capsule keeps a pointer to its name: a module constant outlives it
# A prototype of its own, so that ctypes.pythonapi.PyCapsule_New keeps whatever types others set.
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, c_void_p, c_char_p, c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))
# The engine owns the memory, so the exports have no deleter; torch still reads that field when a
# tensor dies, so they are kept for the process's life (one per parameter and gather slot).
_EXPORTS = []


def device_index(device: torch.device) -> int:
    """The ordinal of `device`: for a bare `cuda` the current device, as torch places a tensor
    made on it; 0 for the host."""
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else 0


def tensor_at(address: int, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-copy 1-D tensor over `numel` (at least 1) elements of `dtype` at `address` on
    `device`."""
    export = _Export(shape=numel, stride=1)
    base = ctypes.addressof(export)
    t = export.managed.dl_tensor
    t.data, t.ndim, t.byte_offset = address, 1, 0
    t.device = _DLDevice(_DL_DEVICES[device.type], device_index(device))
    t.dtype = _DLDataType(*_DL_DTYPES[dtype], 1)
    t.shape = ctypes.cast(base + _Export.shape.offset, POINTER(c_int64))
    t.strides = ctypes.cast(base + _Export.stride.offset, POINTER(c_int64))
    _EXPORTS.append(export)
    return torch.from_dlpack(_capsule_new(base, _DLTENSOR, None))
