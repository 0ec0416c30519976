"""The engine's device memory from PyTorch's caching allocator (`fsdp_device_allocator`), so
that its buffers and PyTorch's tensors share one pool and its accounting
(`torch.cuda.memory_allocated` counts the engine's buffers)."""

from __future__ import annotations

import ctypes
from ctypes import POINTER, c_int, c_size_t, c_uint64, c_void_p

import torch

_ALLOCATE = ctypes.CFUNCTYPE(c_int, c_void_p, c_size_t, POINTER(c_uint64))
_RELEASE = ctypes.CFUNCTYPE(None, c_void_p, c_uint64, c_size_t)


class DeviceAllocator(ctypes.Structure):
    _fields_ = [("context", c_void_p), ("allocate", _ALLOCATE), ("release", _RELEASE)]


class TorchAllocator:
    """Blocks of `stream` (the engine's compute stream) on `device`: the engine gives a block
    back once that stream is ordered after every use of it, which is how the caching allocator
    reuses a stream's blocks. Keep it alive as long as the engine."""

    def __init__(self, device: int, stream: torch.cuda.Stream):
        handle = stream.cuda_stream
        self.failure: BaseException | None = None

        alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete

        def allocate(_context, nbytes, out):
            try:
                out[0] = alloc(nbytes, device, handle)
            except BaseException as e:  # noqa: BLE001 - nothing may cross into C
                self.failure = e
                return 1
            return 0

        def release(_context, address, _nbytes):
            try:
                delete(address)
            except Exception:  # noqa: BLE001 - at interpreter exit PyTorch may be gone
                pass

        # The ctypes function objects must outlive every call the engine makes through them.
        self._allocate, self._release = _ALLOCATE(allocate), _RELEASE(release)
        self.struct = DeviceAllocator(None, self._allocate, self._release)

    def take_failure(self) -> BaseException | None:
        """Why the last refused allocation was refused (PyTorch's exception), once."""
        failure, self.failure = self.failure, None
        return failure
